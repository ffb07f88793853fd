//! The cluster worker: pulls dispatches from `MUR_DISPATCH` one at a time while a slot is
//! free, runs each task in a session of its own, and keeps the task record in `mur_tasks`
//! (the design, §A task's way, steps 4–5).
//!
//! For each dispatch ([`Dispatch`]) the worker:
//! 1. reads the task record and its revision (or takes them from the dispatch); a
//!    terminal record is acked and skipped, and so is a `working` record whose
//!    `dispatch_seq` names another message (a duplicate dispatch: that message's delivery
//!    runs the task, or takes it over when its worker dies);
//! 2. fetches the capsule bundle named by the record (`capsule`, `capsule_digest`) into
//!    `<workdir>/cache/<capsule>/<digest>/` (once per digest) and loads it; when that
//!    fails the record ends `failed` with the reason in `result` and `error`, and the
//!    dispatch is acked (a broken bundle is not retried forever);
//! 3. compare-and-sets the record to `working` with its id, the new `session_id`, the
//!    dispatch message's stream sequence (`dispatch_seq`) and `started_at` (an earlier
//!    `started_at` is kept);
//! 4. runs the task in a session built as `mur run` builds one
//!    ([`crate::launch::build_session_parts`]), in the session folder
//!    `<workdir>/sessions/<session_id>/` (`MURMUR.md`, `trace.jsonl`, `out/`, `logs/`;
//!    commands run there too, like `mur run` without `--workdir`). Trace lines go both to
//!    the local `trace.jsonl` and to `mur.trace.<session_id>` (stream `MUR_TRACE`),
//!    published by a background task with the core client so the loop never waits on
//!    NATS; they are all handed to the connection before the record is finished, which
//!    orders them before it. While the task runs, an
//!    in-progress ack goes out every [`Config::progress_every`];
//! 5. compare-and-sets the record to its terminal state (`completed` for exit `ok`,
//!    `canceled` for `canceled`, `failed` otherwise) with `exit_status`, `result`,
//!    `ended_at`, gives the slot back (a pull request for it goes out at once), then
//!    double-acks the dispatch.
//!
//! A compare-and-set that loses re-reads the record and tries again, a bounded number of
//! times; a record that became terminal meanwhile is left alone. A dispatch whose payload
//! is not a [`Dispatch`] or whose record does not exist is terminated (`AckKind::Term`);
//! one that meets a NATS error is nak'ed for redelivery.
//!
//! The worker registers in `mur_workers` ([`WorkerInfo`]) and re-puts its entry every
//! [`HEARTBEAT_EVERY`]. On shutdown it stops pulling, lets running tasks finish within
//! [`Config::shutdown_grace`], then cancels the rest (they end `canceled`), and deletes
//! its entry.
//!
//! Conversations and checkpoints live in `mur_sessions` (issue #8 §Checkpoints,
//! §Takeover): a threaded capsule's task (and every `completion` task) starts from its
//! context's conversation (`ctx.<capsule>.<context_id>`, written when a task of it ends
//! `ok`); after every turn the loop stores what the turn added under
//! `ckpt.<task_id>.<turn>` and waits for the store. A dispatch whose record is already
//! `working` (the worker that had it died: JetStream redelivered it after the ack wait)
//! is taken over: a new session resumes after the last checkpoint and writes
//! `task_takeover`. A finished task's checkpoints are purged.
//!
//! A shell command still running after `lifecycle.shell_grace_secs` moves to the
//! background ([`detached`]); its end comes back as a `completion` task submitted to the
//! coordinator for the same capsule and context.

use crate::bundle;
use crate::capsule::{self, Capsule};
use crate::launch::{Setup, build_session_parts};
use crate::session::machine::Counters;
use crate::session::{Checkpoints, Durable, Resumed, Session, Takeover, TaskSpec, TurnCheckpoint};
use crate::tools::background::DetachSink;
use crate::tools::fleet::FleetAccess;
use crate::tools::{Toolbox, Tools};
use crate::trace::{self, FileSink, Sink, Tee};
use crate::workdir::Layout;
use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::{self, AckKind, kv, object_store};
use bytes::Bytes;
use futures::StreamExt;
use mur_nats::clock::{Clock, SystemClock};
use mur_nats::fanout;
use mur_nats::tasks::{self as task_records, read};
use mur_nats::trace_context;
use mur_proto::cluster::{self, Checkpoint, CheckpointCounters, Dispatch, StoredConversation, TaskRecord, WorkerInfo};
use mur_proto::ids::{Id, IdKind};
use mur_proto::manifest::Conversation;
use mur_proto::message::Message;
use mur_proto::task::Origin;
use mur_proto::task::{ExitStatus, TaskState};
use mur_proto::trace::Line;
use std::collections::HashMap;
use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

pub mod detached;
pub mod retention;

/// How often the worker re-puts its registration in `mur_workers`.
pub const HEARTBEAT_EVERY: Duration = Duration::from_secs(2);
/// How long one pull request waits for a dispatch at the server before it expires (and is
/// sent again, while its slot is still free).
const FETCH_EXPIRY: Duration = Duration::from_secs(1);
/// How long after its expiry a pull request with no answer at all (a server restart loses
/// them) is given up on and sent again.
const LOST_PULL: Duration = Duration::from_secs(5);
/// How long to wait before pulling again after a failed pull.
const PULL_BACKOFF: Duration = Duration::from_millis(500);
/// How long a worker keeps trying to write a finished task's terminal record (through a
/// broker restart, say) before it gives the task back for redelivery.
const TERMINAL_WRITE_PATIENCE: Duration = Duration::from_secs(60);
/// How many loaded capsules (name and digest) a worker keeps in memory; past it the
/// memory is emptied and refilled as tasks come.
const LOADED_CAPSULES: usize = 64;
/// The `source` of every task the worker runs (`task_start.source`).
pub const TASK_SOURCE: &str = "cluster";

/// How a worker runs.
#[derive(Clone, Debug)]
pub struct Config {
    /// The worker's id, unique in the cluster: the key of its `mur_workers` entry.
    /// Default `wkr_<uuid>`.
    pub worker_id: String,
    /// Tasks run at once. Default 8: agents mostly wait on models and tools.
    pub slots: u32,
    /// The worker's folder: `cache/<capsule>/<digest>/` (unpacked bundles) and
    /// `sessions/<session_id>/` (one per task).
    pub workdir: PathBuf,
    /// How often a running task's dispatch gets an in-progress ack. Default (`None`): a
    /// third of the dispatch consumer's ack wait, read from the server at start (10 s
    /// with the default ack wait of 30 s), so the cluster config sets both.
    pub progress_every: Option<Duration>,
    /// How long running tasks may go on after shutdown before they are cancelled.
    /// Default 30 s.
    pub shutdown_grace: Duration,
    /// How many finished session folders the worker keeps under `sessions/` (the newest);
    /// older ones are removed as sessions finish. Default [`KEEP_SESSIONS`]. See
    /// [`retention`].
    pub keep_sessions: usize,
    /// Refuse tasks of capsules without a `sandbox:` block (`mur worker
    /// --require-sandbox`, issue #37): such a task fails with that reason and no command
    /// runs. Default false.
    pub require_sandbox: bool,
}

/// The default of [`Config::keep_sessions`].
pub const KEEP_SESSIONS: usize = 1000;

impl Config {
    /// The defaults, with the worker's folder `workdir`.
    pub fn new(workdir: impl Into<PathBuf>) -> Config {
        Config {
            worker_id: format!("wkr_{}", uuid::Uuid::now_v7().simple()),
            slots: 8,
            workdir: workdir.into(),
            progress_every: None,
            shutdown_grace: Duration::from_secs(30),
            keep_sessions: KEEP_SESSIONS,
            require_sandbox: false,
        }
    }
}

/// Why the worker could not run.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A setting is out of range.
    #[error("worker config: {0}")]
    Config(String),
    /// A JetStream resource could not be opened (has the coordinator created it?).
    #[error("opening {what}: {reason}")]
    Open {
        /// The resource.
        what: &'static str,
        /// The server's or client's error.
        reason: String,
    },
    /// The worker's folder could not be made.
    #[error("{path}: {source}")]
    Io {
        /// The folder.
        path: PathBuf,
        /// The IO error.
        source: std::io::Error,
    },
    /// The first registration in `mur_workers` failed.
    #[error("registering worker {worker_id}: {reason}")]
    Register {
        /// The worker's id.
        worker_id: String,
        /// The error.
        reason: String,
    },
}

fn open<E: std::fmt::Display>(what: &'static str) -> impl FnOnce(E) -> Error {
    move |e| Error::Open { what, reason: e.to_string() }
}

/// The JetStream resources a worker uses.
struct Opened {
    tasks: kv::Store,
    workers: kv::Store,
    sessions: kv::Store,
    capsules: object_store::ObjectStore,
    consumer: PullConsumer,
    fanout: fanout::Semaphore,
}

async fn open_resources(js: &jetstream::Context) -> Result<Opened, Error> {
    Ok(Opened {
        tasks: js.get_key_value(cluster::TASKS_BUCKET).await.map_err(open(cluster::TASKS_BUCKET))?,
        workers: js.get_key_value(cluster::WORKERS_BUCKET).await.map_err(open(cluster::WORKERS_BUCKET))?,
        sessions: js.get_key_value(cluster::SESSIONS_BUCKET).await.map_err(open(cluster::SESSIONS_BUCKET))?,
        capsules: js.get_object_store(cluster::CAPSULES_STORE).await.map_err(open(cluster::CAPSULES_STORE))?,
        consumer: js
            .get_consumer_from_stream(cluster::DISPATCH_CONSUMER, cluster::DISPATCH_STREAM)
            .await
            .map_err(open(cluster::DISPATCH_CONSUMER))?,
        fanout: fanout::Semaphore::open(js).await.map_err(open(mur_proto::fanout::FANOUT_BUCKET))?,
    })
}

/// What every task handler shares.
struct Shared {
    client: async_nats::Client,
    tasks: kv::Store,
    /// `mur_sessions`: per-turn checkpoints and threaded conversations.
    sessions: kv::Store,
    capsules: object_store::ObjectStore,
    /// The cluster-wide fan-out semaphore: a fleet step runs only while it holds a permit.
    fanout: fanout::Semaphore,
    config: Config,
    /// Fired when the shutdown grace has passed: running tasks are cancelled.
    hard_stop: CancellationToken,
    /// The stop of every dispatch in hand, by task id, then by a number of its own (two
    /// dispatches of one task may be in hand at once: a redelivery, a duplicate).
    running: std::sync::Mutex<HashMap<String, HashMap<u64, CancellationToken>>>,
    /// The number of the next dispatch taken in hand, for `running`.
    next_in_hand: std::sync::atomic::AtomicU64,
    /// The hosts of sessions' detached commands ([`detached::Host`]); they outlive their
    /// task, until their commands end or the worker stops.
    detached: tokio_util::task::TaskTracker,
    /// Fired at shutdown: detached commands still running are abandoned.
    detached_stop: CancellationToken,
    /// Told when a task gives its slot back, before its dispatch is answered: the pull
    /// loop covers the slot at once.
    slot_freed: tokio::sync::Notify,
    /// Capsules loaded so far, by name and digest ([`load_capsule`]).
    loaded: std::sync::Mutex<HashMap<(String, String), Arc<Capsule>>>,
    /// The finished session folders kept, and the removal of older ones.
    retention: Arc<retention::Retention>,
}

/// Runs the worker until `shutdown` resolves, then drains it (see the module docs).
///
/// # Errors
/// [`Error`] when the worker cannot start: a bad config, an unwritable workdir, a failed
/// first registration. Streams and buckets the coordinator has not created yet are
/// waited for (until `shutdown`). Once running, task
/// failures end up in task records, not here.
pub async fn run(client: async_nats::Client, config: Config, shutdown: impl Future<Output = ()>) -> Result<(), Error> {
    if config.slots == 0 {
        return Err(Error::Config("slots: must be at least 1, got 0".into()));
    }
    if config.progress_every.is_some_and(|d| d.is_zero()) {
        return Err(Error::Config("progress_every: must be more than 0".into()));
    }
    let mut config = config;
    std::fs::create_dir_all(&config.workdir).map_err(|source| Error::Io { path: config.workdir.clone(), source })?;
    config.workdir =
        std::path::absolute(&config.workdir).map_err(|source| Error::Io { path: config.workdir.clone(), source })?;
    // The sandbox fences (address rules) a killed worker left behind.
    tokio::task::spawn_blocking(crate::sandbox::netfilter::sweep);

    // The coordinator creates the streams and buckets: until it has, wait for them (a
    // worker may start first, as docker-compose starts services in any order).
    tokio::pin!(shutdown);
    let js = jetstream::new(client.clone());
    let mut waiting_logged = false;
    let Opened { tasks, workers, sessions, capsules, consumer, fanout } = loop {
        match open_resources(&js).await {
            Ok(opened) => break opened,
            Err(e) => {
                if !waiting_logged {
                    tracing::info!(error = %e, "waiting for the coordinator to create the cluster's streams and buckets");
                    waiting_logged = true;
                }
                tokio::select! {
                    biased;
                    () = &mut shutdown => return Ok(()),
                    () = tokio::time::sleep(PULL_BACKOFF) => {}
                }
            }
        }
    };

    let ack_wait = consumer.cached_info().config.ack_wait;
    config.progress_every = Some(config.progress_every.unwrap_or(ack_wait / 3).max(Duration::from_millis(100)));

    let slots = Arc::new(Semaphore::new(config.slots as usize));
    let registration = Registration {
        workers: workers.clone(),
        slots: slots.clone(),
        info: WorkerInfo {
            worker_id: config.worker_id.clone(),
            slots: config.slots,
            busy: 0,
            started_at: SystemClock.now_ms(),
            heartbeat_at: 0,
            version: env!("CARGO_PKG_VERSION").to_string(),
        },
    };
    registration.put().await.map_err(|reason| Error::Register { worker_id: config.worker_id.clone(), reason })?;
    let heartbeat_stop = CancellationToken::new();
    let heartbeat = tokio::spawn(registration.clone().beat(heartbeat_stop.clone()));

    let mut puller = Puller::start(&client, js, consumer).await.map_err(open(cluster::DISPATCH_CONSUMER))?;
    // Cancel notes (`mur.cancel.<task_id>`) stop the named task at once if it runs here.
    let cancels = client
        .subscribe(format!("{}*", cluster::CANCEL_SUBJECT_PREFIX))
        .await
        .map_err(|e| Error::Register { worker_id: config.worker_id.clone(), reason: e.to_string() })?;
    let retention = Arc::new(retention::Retention::new(config.keep_sessions));
    // Held while the worker runs: a worker starting alone on this workdir counts what an
    // earlier process left there (`service/retention.rs`).
    let sessions_dir = config.workdir.join("sessions");
    let (_sessions_lock, adopted) = retention::lock_and_adopt(&sessions_dir, &retention)
        .map_err(|source| Error::Io { path: sessions_dir.clone(), source })?;
    if adopted > 0 {
        tracing::info!(adopted, dir = %sessions_dir.display(), "session folders an earlier worker left are counted for --keep-sessions");
    }
    let shared = Arc::new(Shared {
        client,
        tasks,
        sessions,
        capsules,
        fanout,
        config,
        hard_stop: CancellationToken::new(),
        running: std::sync::Mutex::new(HashMap::new()),
        next_in_hand: std::sync::atomic::AtomicU64::new(0),
        detached: tokio_util::task::TaskTracker::new(),
        detached_stop: CancellationToken::new(),
        loaded: std::sync::Mutex::new(HashMap::new()),
        retention,
        slot_freed: tokio::sync::Notify::new(),
    });
    let cancel_listener = tokio::spawn(listen_for_cancels(shared.clone(), cancels));
    let mut running = JoinSet::new();
    loop {
        while running.try_join_next().is_some() {}
        puller.forget_lost();
        let sent = puller.cover(slots.available_permits()).await;
        let lost_at = puller.lost_at();
        let pulled = match sent {
            Err(e) => Err(e),
            Ok(()) => tokio::select! {
                biased;
                () = &mut shutdown => break,
                // A task ended: its slot is free, cover it.
                Some(_) = running.join_next(), if !running.is_empty() => continue,
                () = shared.slot_freed.notified() => continue,
                () = sleep_until(lost_at) => continue,
                pulled = puller.next() => pulled,
            },
        };
        match pulled {
            Ok(Some(msg)) => start(&shared, &slots, &mut running, msg).await,
            Ok(None) => {}
            Err(e) => {
                tracing::warn!(error = %e, "pulling a dispatch failed");
                tokio::select! {
                    biased;
                    () = &mut shutdown => break,
                    () = tokio::time::sleep(PULL_BACKOFF) => {}
                }
            }
        }
    }
    // The pull requests still out may yet bring a dispatch each, for a slot kept free for
    // it: run those too rather than leave them to the ack wait.
    let answered = tokio::time::timeout(FETCH_EXPIRY + LOST_PULL, async {
        while puller.waiting() > 0 {
            match puller.next().await {
                Ok(Some(msg)) => start(&shared, &slots, &mut running, msg).await,
                Ok(None) => {}
                Err(e) => tracing::debug!(error = %e, "a pull request failed during shutdown"),
            }
        }
    });
    if answered.await.is_err() {
        tracing::debug!(waiting = puller.waiting(), "pull requests unanswered at shutdown");
    }

    // Drain: running tasks get the grace period, then are cancelled and end `canceled`.
    let drained =
        tokio::time::timeout(shared.config.shutdown_grace, async { while running.join_next().await.is_some() {} })
            .await;
    if drained.is_err() {
        tracing::info!(running = running.len(), "shutdown grace over: cancelling running tasks");
        shared.hard_stop.cancel();
        while running.join_next().await.is_some() {}
    }
    shared.detached_stop.cancel();
    shared.detached.close();
    shared.detached.wait().await;
    heartbeat_stop.cancel();
    cancel_listener.abort();
    let _ = heartbeat.await;
    if let Err(e) = workers.delete(&shared.config.worker_id).await {
        tracing::warn!(error = %e, "deleting the worker's registration failed");
    }
    Ok(())
}

/// How long a dispatch that could not be handled waits before its next delivery: 1 s after
/// the first, doubling, at most 30 s (issue #8: retries wait, never an instant
/// redelivery loop). After the consumer's `max_deliver` deliveries the coordinator
/// dead-letters it.
fn nak_delay(delivery: u64) -> Duration {
    Duration::from_secs(1u64 << delivery.saturating_sub(1).min(5)).min(Duration::from_secs(30))
}

/// Cancels the running tasks named by cancel notes.
async fn listen_for_cancels(sh: Arc<Shared>, mut notes: async_nats::Subscriber) {
    while let Some(note) = notes.next().await {
        let Some(task_id) = note.subject.strip_prefix(cluster::CANCEL_SUBJECT_PREFIX) else { continue };
        if let Some(tokens) = sh.running.lock().expect("running lock").get(task_id) {
            tracing::info!(task_id, "cancel requested: stopping the task");
            tokens.values().for_each(CancellationToken::cancel);
        }
    }
}

/// Sleeps until `at`, or forever.
async fn sleep_until(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Runs a pulled dispatch in a free slot. A pull request always stands for a free slot, so
/// there is one; if not (an answer to a request given up on as lost), the dispatch goes
/// back at once for another worker: a worker never holds a dispatch it cannot start.
async fn start(shared: &Arc<Shared>, slots: &Arc<Semaphore>, running: &mut JoinSet<()>, msg: jetstream::Message) {
    match slots.clone().try_acquire_owned() {
        Ok(permit) => {
            running.spawn(handle(shared.clone(), msg, permit));
        }
        Err(_) => {
            tracing::debug!("a dispatch arrived with no free slot: handed back");
            if let Err(e) = msg.ack_with(AckKind::Nak(None)).await {
                tracing::warn!(error = %e, "handing back a dispatch failed; it will be redelivered");
            }
        }
    }
}

/// The worker's pull requests on the `workers` consumer: one request for one message per
/// free slot, all standing at once, answered on one inbox. A dispatch published while a
/// slot is free finds a request waiting at the server and goes out at once; a worker never
/// asks for more messages than it has free slots, so it never hoards work it cannot start.
///
/// Each request expires at the server after [`FETCH_EXPIRY`] (the server answers `408`)
/// and is sent again while its slot is still free; one with no answer at all
/// [`LOST_PULL`] after that (a restarted server forgets them) is given up on.
struct Puller {
    consumer: PullConsumer,
    context: jetstream::Context,
    inbox: async_nats::Subject,
    answers: async_nats::Subscriber,
    /// When each unanswered request was sent, oldest first.
    waiting: std::collections::VecDeque<tokio::time::Instant>,
}

impl Puller {
    async fn start(
        client: &async_nats::Client,
        context: jetstream::Context,
        consumer: PullConsumer,
    ) -> Result<Puller, async_nats::SubscribeError> {
        let inbox = async_nats::Subject::from(client.new_inbox());
        let answers = client.subscribe(inbox.clone()).await?;
        Ok(Puller { consumer, context, inbox, answers, waiting: Default::default() })
    }

    /// Requests outstanding.
    fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Sends requests until `free` slots each have one.
    async fn cover(&mut self, free: usize) -> Result<(), String> {
        while self.waiting.len() < free {
            let request =
                jetstream::consumer::pull::BatchConfig { batch: 1, expires: Some(FETCH_EXPIRY), ..Default::default() };
            self.consumer.request_batch(request, self.inbox.clone()).await.map_err(|e| e.to_string())?;
            self.waiting.push_back(tokio::time::Instant::now());
        }
        Ok(())
    }

    /// When the oldest request will count as lost, if one is out.
    fn lost_at(&self) -> Option<tokio::time::Instant> {
        self.waiting.front().map(|sent| *sent + FETCH_EXPIRY + LOST_PULL)
    }

    /// Forgets the requests unanswered for too long.
    fn forget_lost(&mut self) {
        let now = tokio::time::Instant::now();
        while self.lost_at().is_some_and(|at| at <= now) {
            tracing::debug!("a pull request went unanswered: sending another");
            self.waiting.pop_front();
        }
    }

    /// The next answer to a request: a dispatch, `None` for an expired request, an error
    /// for any other status. Cancel-safe.
    async fn next(&mut self) -> Result<Option<jetstream::Message>, String> {
        let Some(message) = self.answers.next().await else {
            return Err("the pull subscription ended".into());
        };
        let status = message.status.unwrap_or(async_nats::StatusCode::OK);
        if status == async_nats::StatusCode::IDLE_HEARTBEAT {
            return Ok(None);
        }
        self.waiting.pop_front();
        match status {
            async_nats::StatusCode::OK => Ok(Some(jetstream::Message { message, context: self.context.clone() })),
            async_nats::StatusCode::TIMEOUT => Ok(None),
            other => Err(format!("pull request answered {other}: {}", message.description.unwrap_or_default())),
        }
    }
}

/// The worker's entry in `mur_workers`.
#[derive(Clone)]
struct Registration {
    workers: kv::Store,
    slots: Arc<Semaphore>,
    info: WorkerInfo,
}

impl Registration {
    async fn put(&self) -> Result<(), String> {
        let mut info = self.info.clone();
        info.busy = info.slots.saturating_sub(self.slots.available_permits() as u32);
        info.heartbeat_at = SystemClock.now_ms();
        let json = serde_json::to_vec(&info).map_err(|e| e.to_string())?;
        self.workers.put(&info.worker_id, json.into()).await.map(drop).map_err(|e| e.to_string())
    }

    async fn beat(self, stop: CancellationToken) {
        let mut every = tokio::time::interval_at(tokio::time::Instant::now() + HEARTBEAT_EVERY, HEARTBEAT_EVERY);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                _ = every.tick() => {}
            }
            if let Err(e) = self.put().await {
                tracing::warn!(error = %e, "worker heartbeat failed");
            }
        }
    }
}

/// How a dispatch is answered.
#[derive(Debug, PartialEq, Eq)]
enum Answer {
    /// Done with (ran, or nothing to run): double-ack.
    Ack,
    /// Can never be run (not a dispatch, no record): terminate.
    Term,
    /// A transient failure: redeliver.
    Nak,
}

/// Runs one dispatch in its slot, with in-progress acks while it works.
async fn handle(sh: Arc<Shared>, msg: jetstream::Message, slot: OwnedSemaphorePermit) {
    let msg = Arc::new(msg);
    // The task's own stop: fired by a cancel (the note on `mur.cancel.<task_id>`, or the
    // record's `cancel_requested_at` seen at a progress tick) or by the shutdown grace.
    let cancel = sh.hard_stop.child_token();
    // Parsed once, here: a payload that is no dispatch is terminated by `run_dispatch`.
    let parsed = serde_json::from_slice::<Dispatch>(&msg.payload);
    let carried_traceparent =
        parsed.as_ref().ok().and_then(|d| d.released.as_ref()).map(|r| r.record.traceparent.clone());
    let task_id = parsed.as_ref().ok().map(|d| d.task_id.clone());
    let in_hand = sh.next_in_hand.fetch_add(1, Ordering::Relaxed);
    if let Some(id) = &task_id {
        sh.running.lock().expect("running lock").entry(id.clone()).or_default().insert(in_hand, cancel.clone());
    }
    let progress = tokio::spawn({
        let msg = msg.clone();
        let every = sh.config.progress_every.unwrap_or(Duration::from_secs(10));
        let tasks = sh.tasks.clone();
        let task_id = task_id.clone();
        let cancel = cancel.clone();
        async move {
            let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
            loop {
                tick.tick().await;
                if let Err(e) = msg.ack_with(AckKind::Progress).await {
                    tracing::debug!(error = %e, "in-progress ack failed");
                }
                if let Some(id) = &task_id
                    && let Ok(Some((record, _))) = read(&tasks, id).await
                    && (record.cancel_requested_at.is_some() || record.state.is_terminal())
                {
                    cancel.cancel();
                }
            }
        }
    });
    let delivered = match msg.info() {
        Ok(i) => Delivered { number: i.delivered.max(1) as u64, stream_seq: Some(i.stream_sequence) },
        Err(_) => Delivered { number: 1, stream_seq: None },
    };
    let span = dispatch_span(&sh, &msg, task_id.as_deref(), carried_traceparent, delivered.number).await;
    let answer = run_dispatch(&sh, parsed, delivered, cancel).instrument(span).await;
    progress.abort();
    if let Some(id) = &task_id {
        let mut running = sh.running.lock().expect("running lock");
        if let Some(tokens) = running.get_mut(id) {
            tokens.remove(&in_hand);
            if tokens.is_empty() {
                running.remove(id);
            }
        }
    }
    // The task is done with (its terminal record is written, or it goes back): its slot
    // is free while the answer is on its way, so the next pull request goes out now
    // rather than a round trip later (issue #9).
    drop(slot);
    sh.slot_freed.notify_one();
    let acked = match answer {
        Answer::Ack => msg.double_ack().await,
        Answer::Term => msg.ack_with(AckKind::Term).await,
        Answer::Nak => msg.ack_with(AckKind::Nak(Some(nak_delay(delivered.number)))).await,
    };
    if let Err(e) = acked {
        tracing::warn!(error = %e, ?answer, "answering a dispatch failed; it will be redelivered");
    }
}

/// Which delivery of which dispatch message is being handled.
#[derive(Clone, Copy, Debug)]
struct Delivered {
    /// 1 for the first delivery, +1 per redelivery.
    number: u64,
    /// The message's sequence in `MUR_DISPATCH` (`None` only for a message without
    /// JetStream metadata, never expected).
    stream_seq: Option<u64>,
}

async fn run_dispatch(
    sh: &Shared,
    parsed: Result<Dispatch, serde_json::Error>,
    delivery: Delivered,
    cancel: CancellationToken,
) -> Answer {
    // A fleet step's fan-out permit, once it holds one; given back whatever happened.
    let mut permit = None;
    let answer = run_dispatch_holding(sh, parsed, delivery, cancel, &mut permit).await;
    if let Some(permit) = permit {
        permit.release().await;
    }
    answer
}

/// [`run_dispatch`]'s work; a fleet step's permit, once taken, is left in `permit`.
async fn run_dispatch_holding(
    sh: &Shared,
    parsed: Result<Dispatch, serde_json::Error>,
    Delivered { number: delivery, stream_seq }: Delivered,
    cancel: CancellationToken,
    permit: &mut Option<Arc<fanout::StepPermit>>,
) -> Answer {
    // The session's stop: the task's, or the loss of its fan-out permit (watched until the
    // dispatch is done with: `_dispatch_over` fires then).
    let session_cancel = cancel.child_token();
    let dispatch_over = CancellationToken::new();
    let _dispatch_over = dispatch_over.clone().drop_guard();
    let dispatch: Dispatch = match parsed {
        Ok(d) => d,
        Err(e) => {
            tracing::warn!(error = %e, "a dispatch that is not a Dispatch: terminated");
            return Answer::Term;
        }
    };
    let key = dispatch.task_id.as_str();
    // What a terminal record is fitted to ([`end_record`]).
    let max_payload = sh.client.server_info().max_payload;
    // The record as the release wrote it, when the dispatch carries it: no read. The
    // compare-and-set to `working` below is on its revision, so a record that changed
    // since (cancel requested, an earlier delivery took it) is read and looked at afresh.
    let (mut current, mut carried) = match dispatch.released {
        Some(r) => ((r.record, r.revision), true),
        None => match read_dispatched(sh, key).await {
            Ok(c) => (c, false),
            Err(answer) => return answer,
        },
    };
    let worker_id = sh.config.worker_id.clone();
    let (current, capsule, takeover, session_id, prepared) = loop {
        if current.0.state.is_terminal() {
            return Answer::Ack;
        }
        // Another message's delivery runs this task (or will take it over if its worker
        // dies: that message stays unacked until the end): this one is a duplicate,
        // published again after the stream's duplicate window. Dropped, not taken over.
        if run_elsewhere(&current.0, stream_seq) {
            tracing::warn!(
                task_id = key,
                running = current.0.dispatch_seq,
                duplicate = stream_seq,
                "a second dispatch of a task another dispatch is running: dropped"
            );
            return Answer::Ack;
        }
        if current.0.cancel_requested_at.is_some() {
            // Cancelled after its release, before any session ran it: it never starts.
            return finished(
                task_records::update(&sh.tasks, key, Some(current), |r| {
                    if r.state.is_terminal() || run_elsewhere(r, stream_seq) {
                        return false;
                    }
                    end_record(r, ExitStatus::Canceled, "canceled", None, max_payload);
                    true
                })
                .await,
                key,
            );
        }

        let capsule = match load_capsule(sh, &current.0).await {
            Ok(c) => c,
            Err(Loading::Transient(reason)) => {
                // The broker did not answer (a restart under way): another delivery, after
                // the nak delay, fetches again; the task does not fail for it.
                tracing::warn!(task_id = key, "{reason}; the dispatch goes back");
                return Answer::Nak;
            }
            Err(Loading::Failed(reason)) => {
                let w = worker_id.clone();
                return finished(
                    task_records::update(&sh.tasks, key, Some(current), |r| {
                        if r.state.is_terminal() || run_elsewhere(r, stream_seq) {
                            return false;
                        }
                        r.worker = Some(w.clone());
                        end_record(r, ExitStatus::Failed, &reason, Some(&reason), max_payload);
                        true
                    })
                    .await,
                    key,
                );
            }
        };

        // A record already `working` was being run by a session that stopped answering for
        // it (its worker died): take over from its last checkpoint (issue #8 §Takeover).
        let takeover = match (&current.0.state, &current.0.session_id) {
            (TaskState::Working, Some(previous)) => {
                let previous_worker = current.0.worker.clone().unwrap_or_default();
                match read_checkpoints(&sh.sessions, key).await {
                    Ok(r) => Some(takeover_from(r, delivery, previous.clone(), previous_worker)),
                    Err(e) => {
                        tracing::warn!(task_id = key, error = %e, "reading the task's checkpoints failed");
                        return Answer::Nak;
                    }
                }
            }
            _ => None,
        };

        // A delegated fleet step runs only while it holds a fan-out permit (issue #11):
        // wait in line for one, with in-progress acks still going out, until it is free or
        // the task is cancelled or out of time.
        if let (Some(step), None) = (&current.0.fleet_step, permit.as_ref()) {
            if carried {
                // The wait may be long and ends in writes: start it from the record as it
                // is (another dispatch of the step may be running it already).
                carried = false;
                current = match read_dispatched(sh, key).await {
                    Ok(c) => c,
                    Err(answer) => return answer,
                };
                continue;
            }
            match hold_permit(sh, &current.0, step, &cancel).await {
                Ok(held) => {
                    let (lost, stop, over) = (held.lost(), session_cancel.clone(), dispatch_over.clone());
                    tokio::spawn(async move {
                        tokio::select! {
                            () = lost.cancelled() => stop.cancel(),
                            () = over.cancelled() => {}
                        }
                    });
                    *permit = Some(held);
                }
                Err(stop) => {
                    let exit = match stop {
                        PermitWait::Deadline => ExitStatus::DeadlineExceeded,
                        PermitWait::Cancelled if !sh.hard_stop.is_cancelled() => ExitStatus::Canceled,
                        // The worker is stopping, or JetStream failed: another delivery waits again.
                        PermitWait::Cancelled | PermitWait::Failed => return Answer::Nak,
                    };
                    let base = match read(&sh.tasks, key).await {
                        Ok(Some(c)) => c,
                        Ok(None) => return Answer::Term,
                        Err(_) => return Answer::Nak,
                    };
                    return finished(
                        task_records::update(&sh.tasks, key, Some(base), |r| {
                            if r.state.is_terminal() || run_elsewhere(r, stream_seq) {
                                return false;
                            }
                            end_record(r, exit, exit.as_str(), None, max_payload);
                            true
                        })
                        .await,
                        key,
                    );
                }
            }
        }

        let session_id = Id::generate(IdKind::Session);
        // The session folder is made on a blocking thread while the record goes to
        // `working` (issue #9: file creation kept off the async threads and the wait).
        let access = FleetAccess {
            client: sh.client.clone(),
            source: format!("capsule:{}", current.0.capsule),
            permit: permit.clone(),
            cancel: session_cancel.clone(),
        };
        let prepared = Prepared::start(sh, &capsule, &session_id, access);
        let mark_working = |r: &mut TaskRecord| {
            if r.state.is_terminal() || run_elsewhere(r, stream_seq) {
                return false;
            }
            // A record another session had `working` is taken over: a new attempt (issue
            // #29 item 9). The coordinator publishes dispatches again only of `submitted`
            // records, so the number it put in the dispatch's message id is not reused.
            if r.state == TaskState::Working && r.session_id.is_some() {
                r.attempt += 1;
            }
            r.state = TaskState::Working;
            r.worker = Some(worker_id.clone());
            r.session_id = Some(session_id.clone());
            r.dispatch_seq = stream_seq.or(r.dispatch_seq);
            r.started_at = r.started_at.or(Some(SystemClock.now_ms()));
            true
        };
        let working = if carried {
            // One try on the carried revision; a conflict means the record moved on.
            carried = false;
            let mut record = current.0.clone();
            if !mark_working(&mut record) {
                prepared.discard();
                return Answer::Ack;
            }
            let json = match serde_json::to_vec(&record) {
                Ok(json) => json,
                Err(e) => {
                    tracing::warn!(task_id = key, error = %e, "marking the task working failed");
                    prepared.discard();
                    return Answer::Nak;
                }
            };
            match sh.tasks.update(key, json.into(), current.1).await {
                Ok(revision) => Ok(Some((record, revision))),
                Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => {
                    prepared.discard();
                    current = match read_dispatched(sh, key).await {
                        Ok(c) => c,
                        Err(answer) => return answer,
                    };
                    continue;
                }
                Err(e) => Err(task_records::Error::Unavailable { what: format!("update {key}"), source: e.into() }),
            }
        } else {
            task_records::update(&sh.tasks, key, Some(current), mark_working).await
        };
        match working {
            Ok(Some(c)) => break (c, capsule, takeover, session_id, prepared),
            Ok(None) => {
                prepared.discard();
                return Answer::Ack; // ended elsewhere meanwhile
            }
            Err(e) => {
                tracing::warn!(task_id = key, error = %e, "marking the task working failed");
                prepared.discard();
                return Answer::Nak;
            }
        }
    };
    let task = current.0.clone();
    let checkpointed = takeover.is_some();
    mur_nats::metrics::task_started(&task, delivery, checkpointed, SystemClock.now_ms());
    let checkpoints = Arc::new(KvCheckpoints {
        sessions: sh.sessions.clone(),
        task_id: task.task_id.clone(),
        session_id: session_id.clone(),
        worker: worker_id.clone(),
        saved: AtomicBool::new(checkpointed),
        max_payload,
    });
    let (exit, result, error, usage) = match run_session(
        sh,
        &task,
        &capsule,
        &session_id,
        prepared,
        takeover,
        checkpoints.clone(),
        session_cancel.clone(),
    )
    .await
    {
        Ok((exit, result, usage)) => (exit, result, None, usage),
        Err(e) => (ExitStatus::Failed, format!("error: {e}"), Some(e), None),
    };
    // A step that lost its permit (its worker stalled past the lease) stopped, or ran on
    // without one: it writes no end; another delivery runs it again once it holds a
    // permit (issue #11 §The fan-out cap: the count never rises above the cap).
    if let Some(permit) = permit.as_ref()
        && !permit.still_held().await
    {
        tracing::warn!(task_id = key, "the step's fan-out permit was lost: its end is not written; it runs again");
        return Answer::Nak;
    }
    // The terminal record must be written (a nak would run the task again): keep trying
    // through a broker outage, with in-progress acks still going out, for up to a minute.
    let mut delays = mur_nats::backoff::delays(Duration::from_millis(100), Duration::from_secs(2));
    let give_up = tokio::time::Instant::now() + TERMINAL_WRITE_PATIENCE;
    let mut known = Some(current);
    let written = loop {
        let written = task_records::update(&sh.tasks, key, known.take(), |r| {
            if r.state.is_terminal() {
                return false;
            }
            r.usage.clone_from(&usage);
            end_record(r, exit, &result, error.as_deref(), max_payload);
            true
        })
        .await;
        if written.is_ok() || tokio::time::Instant::now() >= give_up {
            break written;
        }
        tracing::warn!(task_id = key, error = ?written.as_ref().err(), "writing the terminal record failed; retrying");
        tokio::time::sleep(delays.next().unwrap_or(Duration::from_secs(2))).await;
    };
    let answer = finished(written, key);
    if answer == Answer::Ack && checkpoints.saved.load(Ordering::Relaxed) {
        drop_checkpoints(&sh.sessions, key).await;
    }
    answer
}

/// Whether `record` is `working` under another dispatch message than the one with
/// `stream_seq`: that message's delivery runs the task (or takes it over if its worker
/// dies, for it stays unacked until the end), so this one is a duplicate — a dispatch
/// published again after `MUR_DISPATCH`'s duplicate window — and writes nothing.
fn run_elsewhere(record: &TaskRecord, stream_seq: Option<u64>) -> bool {
    record.state == TaskState::Working
        && matches!((record.dispatch_seq, stream_seq), (Some(running), Some(this)) if running != this)
}

/// Reads a dispatched task's record; the answer to give the dispatch when there is none
/// (terminate: nothing to run) or it cannot be read (redeliver).
async fn read_dispatched(sh: &Shared, key: &str) -> Result<(TaskRecord, u64), Answer> {
    match read(&sh.tasks, key).await {
        Ok(Some(c)) => Ok(c),
        Ok(None) => {
            tracing::warn!(task_id = key, "a dispatch without a task record: terminated");
            Err(Answer::Term)
        }
        Err(e) => {
            tracing::warn!(task_id = key, error = %e, "reading the task record failed");
            Err(Answer::Nak)
        }
    }
}

/// Why a step stopped waiting for a fan-out permit.
enum PermitWait {
    /// The task's deadline passed first.
    Deadline,
    /// The task was cancelled, or the worker is stopping.
    Cancelled,
    /// JetStream failed.
    Failed,
}

/// Waits for a fan-out permit for `task` (it is then renewed in the background).
async fn hold_permit(
    sh: &Shared,
    task: &TaskRecord,
    step: &mur_proto::fanout::FleetStep,
    cancel: &CancellationToken,
) -> Result<Arc<fanout::StepPermit>, PermitWait> {
    let holder = mur_proto::fanout::Holder {
        task_id: task.task_id.clone(),
        worker: sh.config.worker_id.clone(),
        step: step.clone(),
        since: SystemClock.now_ms(),
    };
    let deadline = task
        .deadline_at
        .map(|at| tokio::time::Instant::now() + Duration::from_millis(at.saturating_sub(SystemClock.now_ms())));
    // The deadline ends the wait through the wait's own stop, so the wait removes its
    // ticket on the way out: a ticket left behind would keep its place in line, and hold
    // back a freed permit, until its lease ran out.
    let wait = cancel.child_token();
    let out_of_time = Arc::new(AtomicBool::new(false));
    let timer = tokio::spawn({
        let (wait, out_of_time) = (wait.clone(), out_of_time.clone());
        async move {
            sleep_until(deadline).await;
            out_of_time.store(true, Ordering::SeqCst);
            wait.cancel();
        }
    });
    let result = fanout::StepPermit::acquire(&sh.fanout, holder, &wait).await;
    timer.abort();
    match result {
        Ok(p) => Ok(p),
        Err(fanout::Error::Cancelled) if !cancel.is_cancelled() && out_of_time.load(Ordering::SeqCst) => {
            Err(PermitWait::Deadline)
        }
        Err(fanout::Error::Cancelled) => Err(PermitWait::Cancelled),
        Err(e) => {
            tracing::warn!(task_id = %task.task_id, error = %e, "waiting for a fan-out permit failed");
            Err(PermitWait::Failed)
        }
    }
}

/// The span one delivery runs in, so the task's spans (`invoke_agent` and below) join the
/// submitter's trace (issue #7 §Trace context): a child of the dispatch's `traceparent`
/// header, or of the record's when the header is missing (a dispatch republished by a
/// restarted coordinator carries none): the one in the record the dispatch carries, else
/// the stored record's. `carried` is the carried record's `traceparent` when the dispatch
/// carries the record: then it is the answer, `None` included (a task submitted without
/// trace context), and nothing is read; the stored record is read only for a dispatch
/// without its record and without the header (issue #9: that read was a broker round trip
/// on every dispatch of an untraced task).
async fn dispatch_span(
    sh: &Shared,
    msg: &jetstream::Message,
    task_id: Option<&str>,
    carried: Option<Option<String>>,
    delivery: u64,
) -> tracing::Span {
    let headers = msg.headers.as_ref();
    let stored = match (task_id, carried) {
        (_, Some(carried)) => carried,
        (Some(id), None) if trace_context::extract(headers).is_none() => {
            read(&sh.tasks, id).await.ok().flatten().and_then(|(record, _)| record.traceparent)
        }
        _ => None,
    };
    trace_context::consumer(cluster::DISPATCH_SUBJECT, headers, stored.as_deref(), task_id, delivery)
}

/// Purges a finished task's checkpoints: nothing will take it over any more.
async fn drop_checkpoints(sessions: &kv::Store, task_id: &str) {
    let filter = format!("{}{}>", sessions.prefix, cluster::checkpoint_prefix(task_id));
    if let Err(e) = sessions.stream.purge().filter(filter).await {
        tracing::debug!(task_id, error = %e, "purging the task's checkpoints failed");
    }
}

/// The answer after the terminal write: ack when the record is terminal (ours or not).
fn finished(written: Result<Option<(TaskRecord, u64)>, task_records::Error>, key: &str) -> Answer {
    match written {
        Ok(written) => {
            if let Some((record, _)) = written.filter(|(r, _)| r.state.is_terminal()) {
                mur_nats::metrics::task_ended(&record);
            }
            Answer::Ack
        }
        Err(e) => {
            tracing::warn!(task_id = key, error = %e, "writing the terminal record failed");
            Answer::Nak
        }
    }
}

/// Ends `r` with `exit`, its `result` and `error`, clipped to fit a message of
/// `max_payload` bytes ([`TaskRecord::fit`]): a terminal record the server refuses would
/// leave the task `working` until its dispatch dead-letters.
fn end_record(r: &mut TaskRecord, exit: ExitStatus, result: &str, error: Option<&str>, max_payload: usize) {
    r.state = exit.task_state();
    r.exit_status = Some(exit);
    r.result = Some(result.to_string());
    r.error = error.map(str::to_string);
    r.ended_at = Some(SystemClock.now_ms());
    if r.fit(max_payload) {
        tracing::info!(task_id = %r.task_id, max_payload, "the result was clipped to fit the task record");
    }
}

/// Fetches (or finds in the cache) and loads the record's capsule bundle. A bundle is
/// named by its digest and never changes, so a loaded capsule is kept in memory by name
/// and digest and reused (issue #9); a failed load is not kept.
async fn load_capsule(sh: &Shared, record: &TaskRecord) -> Result<Arc<Capsule>, Loading> {
    let key = (record.capsule.clone(), record.capsule_digest.clone());
    if let Some(capsule) = sh.loaded.lock().expect("loaded capsules lock").get(&key) {
        return Ok(capsule.clone());
    }
    let cache = sh.config.workdir.join("cache");
    let dir = bundle::fetch(&sh.capsules, &record.capsule, &record.capsule_digest, &cache).await.map_err(|e| {
        let reason = format!("error: fetching capsule {}: {e}", record.capsule);
        if e.is_transient() { Loading::Transient(reason) } else { Loading::Failed(reason) }
    })?;
    let env = |k: &str| std::env::var(k).ok();
    let capsule = Arc::new(
        Capsule::load(&dir, &env)
            .map_err(|e| Loading::Failed(format!("error: loading capsule {}: {e}", record.capsule)))?,
    );
    // The tokenizer its sessions will count with, loaded here (once per loaded capsule) on
    // a blocking thread: a session would load it at its first count, on a runtime thread,
    // stalling every task sharing that thread for tens of milliseconds (issue #9). Chosen
    // as a session chooses it (`launch::build_session_parts`): by its driver's kind; a
    // driver that cannot be built fails the session, which then counts nothing.
    let _ = tokio::task::spawn_blocking({
        let (capsule, dir) = (capsule.clone(), dir.clone());
        move || {
            if let Ok(driver) = capsule.driver(&dir) {
                crate::tokens::preload(driver.kind(), capsule.manifest.inference.model.as_deref());
            }
        }
    })
    .await;
    let mut loaded = sh.loaded.lock().expect("loaded capsules lock");
    if loaded.len() >= LOADED_CAPSULES {
        loaded.clear();
    }
    loaded.insert(key, capsule.clone());
    Ok(capsule)
}

/// Why a task's capsule could not be loaded.
enum Loading {
    /// The broker did not answer: the dispatch goes back and is fetched again.
    Transient(String),
    /// The bundle is missing, corrupt or its manifest is invalid: the task fails with this.
    Failed(String),
}

/// Reads a task's checkpoints, in write order, and folds them ([`Checkpoint::fold`]).
/// `Ok(None)` when it has none.
async fn read_checkpoints(sessions: &kv::Store, task_id: &str) -> Result<Option<cluster::Resume>, String> {
    use async_nats::jetstream::consumer::{DeliverPolicy, pull};
    // One key per turn: read them all through the bucket's stream, filtered by prefix.
    let filter = format!("{}{}>", sessions.prefix, cluster::checkpoint_prefix(task_id));
    let mut consumer = sessions
        .stream
        .create_consumer(pull::OrderedConfig {
            filter_subject: filter,
            deliver_policy: DeliverPolicy::LastPerSubject,
            ..Default::default()
        })
        .await
        .map_err(|e| e.to_string())?;
    let pending = consumer.info().await.map_err(|e| e.to_string())?.num_pending;
    let mut checkpoints = Vec::new();
    if pending > 0 {
        let mut messages = consumer.messages().await.map_err(|e| e.to_string())?;
        while let Some(msg) = messages.next().await {
            let msg = msg.map_err(|e| e.to_string())?;
            let info = msg.info().map_err(|e| e.to_string())?;
            let left = info.pending;
            if !msg.payload.is_empty() {
                let c: Checkpoint = serde_json::from_slice(&msg.payload)
                    .map_err(|e| format!("checkpoint {} is not valid JSON: {e}", msg.subject))?;
                checkpoints.push(c);
            }
            if left == 0 {
                break;
            }
        }
    }
    Ok(Checkpoint::fold(checkpoints))
}

fn takeover_from(
    r: Option<cluster::Resume>,
    delivery: u64,
    previous_session_id: String,
    previous_worker: String,
) -> Takeover {
    let checkpoint = r.map(|r| {
        let c = r.last.counters;
        Resumed {
            history: r.last.messages,
            counters: Counters {
                turns: c.turns,
                input_tokens: c.input_tokens,
                output_tokens: c.output_tokens,
                tool_calls: c.tool_calls,
                shell_calls: c.shell_calls,
            },
            session_tokens: r.last.session_tokens,
            reopens: r.last.reopens,
        }
    });
    Takeover { checkpoint, delivery, previous_session_id, previous_worker }
}

/// Writes a task's per-turn checkpoints to `mur_sessions` ([`checkpoint_key`]).
struct KvCheckpoints {
    sessions: kv::Store,
    task_id: String,
    session_id: String,
    worker: String,
    /// Whether the task has checkpoints (to purge at its end).
    saved: AtomicBool,
    /// The server's `max_payload`: a checkpoint larger than one message is written in parts.
    max_payload: usize,
}

#[async_trait::async_trait]
impl Checkpoints for KvCheckpoints {
    async fn save(&self, c: TurnCheckpoint) -> Result<(), String> {
        let checkpoint = Checkpoint {
            task_id: self.task_id.clone(),
            session_id: self.session_id.clone(),
            worker: self.worker.clone(),
            turn: c.turn,
            replace: c.delta.replace,
            messages: c.delta.messages,
            counters: CheckpointCounters {
                turns: c.counters.turns,
                input_tokens: c.counters.input_tokens,
                output_tokens: c.counters.output_tokens,
                tool_calls: c.counters.tool_calls,
                shell_calls: c.counters.shell_calls,
            },
            session_tokens: c.session_tokens,
            reopens: c.reopens,
            at_ms: SystemClock.now_ms(),
            part: 0,
            parts: 0,
        };
        // One value, or its parts in order when one message cannot hold it (a long
        // history after a compaction or a takeover).
        let values = checkpoint.split(self.max_payload).map_err(|e| e.to_string())?;
        self.saved.store(true, Ordering::Relaxed);
        for (key, json) in values {
            self.sessions.put(key, json.into()).await.map_err(|e| e.to_string())?;
        }
        Ok(())
    }
}

/// The conversation a task of `capsule` continues: the context's, for a threaded
/// conversation or a completion task (the session-loop seed, §Detached shell: a
/// completion joins its context), else none.
async fn prior_conversation(sh: &Shared, task: &TaskRecord, capsule: &Capsule) -> Result<ContextConversation, String> {
    if !continues_context(task, capsule) {
        return Ok(ContextConversation::default());
    }
    let key = cluster::context_key(&task.capsule, &task.context_id);
    read_conversation_at(&sh.sessions, &key).await
}

/// A context's conversation as read, with the revision of its head in `mur_sessions`
/// (`None`: there was none).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ContextConversation {
    /// The messages.
    pub messages: Vec<Message>,
    /// The head's revision, for the compare-and-set of the next write.
    pub revision: Option<u64>,
}

/// The conversation stored under `key` ([`cluster::context_key`]), whole or in parts
/// ([`StoredConversation`]); empty when there is none.
///
/// # Errors
/// As [`read_conversation_at`].
pub async fn read_conversation(sessions: &kv::Store, key: &str) -> Result<Vec<Message>, String> {
    read_conversation_at(sessions, key).await.map(|c| c.messages)
}

/// [`read_conversation`] with the head's revision. A part removed between the head's read
/// and its own (a newer write replaced the conversation) reads the newer head.
///
/// # Errors
/// The broker's, a value that is not a conversation, or a part missing three times over.
pub async fn read_conversation_at(sessions: &kv::Store, key: &str) -> Result<ContextConversation, String> {
    let mut missing = String::new();
    'head: for _ in 0..3 {
        let entry = sessions.entry(key).await.map_err(|e| e.to_string())?;
        let Some(entry) = entry.filter(|e| e.operation == kv::Operation::Put) else {
            return Ok(ContextConversation::default());
        };
        let revision = Some(entry.revision);
        let stored: StoredConversation =
            serde_json::from_slice(&entry.value).map_err(|e| format!("conversation {key} is not valid JSON: {e}"))?;
        let parts = match stored {
            StoredConversation::Whole(messages) => return Ok(ContextConversation { messages, revision }),
            parts => parts.part_keys(key),
        };
        let mut messages = Vec::new();
        for part in parts {
            let Some(bytes) = sessions.get(&part).await.map_err(|e| e.to_string())? else {
                missing = format!("conversation {key}: part {part} is missing");
                continue 'head;
            };
            let run: Vec<Message> = serde_json::from_slice(&bytes)
                .map_err(|e| format!("conversation part {part} is not valid JSON: {e}"))?;
            messages.extend(run);
        }
        return Ok(ContextConversation { messages, revision });
    }
    Err(missing)
}

/// Stores `history` under `key` ([`cluster::context_key`]) within `max_payload`: whole, or
/// its parts and then their head ([`StoredConversation::split`]). The head is written with
/// a compare-and-set on `base`'s revision (the conversation the task started from): when
/// another task of the context ended meanwhile, its conversation is read again and the
/// messages `history` added to `base` are appended to it (up to five times). Without a
/// `base` (a task taken over, or one whose history was compacted) the head read now is
/// replaced. The parts of the conversation replaced are purged after; a losing write's
/// own at once.
///
/// # Errors
/// The broker's (what was stored before stays readable: a head is written last).
pub async fn write_conversation(
    sessions: &kv::Store,
    key: &str,
    history: Vec<Message>,
    base: Option<&ContextConversation>,
    max_payload: usize,
) -> Result<(), String> {
    // What this task added, when `history` continues `base`.
    let added: Option<Vec<Message>> =
        base.filter(|b| history.starts_with(&b.messages)).map(|b| history[b.messages.len()..].to_vec());
    // The head as it is now: its revision when there is no base to compare against, and
    // the parts to purge once it is replaced.
    let head_now = || async {
        let entry = sessions.entry(key).await.map_err(|e| e.to_string())?;
        Ok::<_, String>(
            entry
                .filter(|e| e.operation == kv::Operation::Put)
                .map(|e| (e.revision, serde_json::from_slice::<StoredConversation>(&e.value).ok())),
        )
    };
    let mut expected = match (base, &added) {
        (Some(b), Some(_)) => b.revision,
        _ => head_now().await?.map(|(revision, _)| revision),
    };
    let mut messages = history;
    for _ in 0..5 {
        // A head at another revision than expected fails the compare-and-set below.
        let before = match head_now().await? {
            Some((revision, head)) if Some(revision) == expected => head,
            _ => None,
        };
        let values = StoredConversation::split(key, messages.clone(), max_payload).map_err(|e| e.to_string())?;
        let (head_key, head) = values.last().cloned().expect("a head at least");
        let ours: Vec<String> = values[..values.len() - 1].iter().map(|(k, _)| k.clone()).collect();
        for (k, json) in &values[..values.len() - 1] {
            sessions.put(k, json.clone().into()).await.map_err(|e| e.to_string())?;
        }
        let written = match expected {
            Some(revision) => {
                sessions.update(&head_key, head.into(), revision).await.map(drop).map_err(|e| e.to_string())
            }
            None => sessions.create(&head_key, head.into()).await.map(drop).map_err(|e| e.to_string()),
        };
        match written {
            Ok(()) => {
                for old in before.map(|b| b.part_keys(key)).unwrap_or_default() {
                    if let Err(e) = sessions.purge(&old).await {
                        tracing::debug!(key = old, error = %e, "removing an earlier conversation's part failed");
                    }
                }
                return Ok(());
            }
            Err(e) => {
                tracing::debug!(key, error = %e, "the conversation changed while the task ran: merging");
                for part in ours {
                    let _ = sessions.purge(&part).await;
                }
                expected = match &added {
                    Some(added) => {
                        let now = read_conversation_at(sessions, key).await?;
                        messages = now.messages;
                        messages.extend(added.iter().cloned());
                        now.revision
                    }
                    None => head_now().await?.map(|(revision, _)| revision),
                };
            }
        }
    }
    Err(format!("conversation {key}: changed by other tasks five times while this one was written"))
}

fn continues_context(task: &TaskRecord, capsule: &Capsule) -> bool {
    capsule.manifest.lifecycle.conversation == Conversation::Threaded || task.origin == Origin::Completion
}

/// A session's tools and its folder in the making: the folder (`Layout::create`),
/// `MURMUR.md` and `trace.jsonl` are created on a blocking thread (issue #9: file creation
/// is the worker's largest cost per task, and it overlaps the record's compare-and-set).
struct Prepared {
    layout: Layout,
    tools: Arc<Toolbox>,
    sink: DetachSink,
    notices: mpsc::UnboundedReceiver<crate::tools::background::DetachNotice>,
    files: tokio::task::JoinHandle<Result<FileSink, String>>,
}

impl Prepared {
    /// Starts making `<workdir>/sessions/<session_id>/` for `capsule`'s session, whose
    /// fleet tools reach the cluster with `access`.
    fn start(sh: &Shared, capsule: &Capsule, session_id: &str, access: FleetAccess) -> Prepared {
        let dir = sh.config.workdir.join("sessions").join(session_id);
        // Like `mur run` without --workdir: commands run in the session folder itself.
        let layout = Layout { workdir: dir.clone(), session_dir: dir };
        let (sink, notices) = DetachSink::channel();
        let grace = Duration::from_secs(capsule.manifest.lifecycle.shell_grace_secs);
        let tools = Arc::new(
            Toolbox::from_manifest(&capsule.manifest).with_detach(grace, sink.clone()).with_fleet_access(access),
        );
        let onboarding = capsule::onboarding(&capsule.manifest, &capsule.model_label(), &layout, &tools.specs());
        let files = tokio::task::spawn_blocking({
            let layout = layout.clone();
            move || {
                layout.create().map_err(|e| e.to_string())?;
                std::fs::write(layout.murmur_md(), onboarding)
                    .map_err(|e| format!("{}: {e}", layout.murmur_md().display()))?;
                FileSink::open(&layout.trace()).map_err(|e| e.to_string())
            }
        });
        Prepared { layout, tools, sink, notices, files }
    }

    /// The session will not run (the record moved on): its folder is removed once made.
    fn discard(self) {
        let Prepared { layout, files, .. } = self;
        tokio::spawn(async move {
            let _ = files.await;
            let dir = layout.session_dir;
            let _ = tokio::task::spawn_blocking(move || std::fs::remove_dir_all(dir)).await;
        });
    }
}

/// Runs `task` in a new session `session_id` (taking it over from a checkpoint when
/// `takeover` says so), in the folder `prepared` makes, and returns its exit status, its
/// result and its token usage. The session stops when `cancel` fires.
#[allow(clippy::too_many_arguments)]
async fn run_session(
    sh: &Shared,
    task: &TaskRecord,
    capsule: &Capsule,
    session_id: &str,
    prepared: Prepared,
    takeover: Option<Takeover>,
    checkpoints: Arc<KvCheckpoints>,
    cancel: CancellationToken,
) -> Result<(ExitStatus, String, Option<mur_proto::cost::Usage>), String> {
    let missing = crate::preflight::missing(&task.needs, std::env::var_os("PATH").as_deref());
    if !missing.is_empty() {
        prepared.discard();
        return Ok((ExitStatus::Failed, crate::preflight::refusal(&missing), None));
    }
    // The task's token usage, tallied from its trace for the terminal record (issue #11).
    let tally = crate::usage::UsageTally::default();
    let Prepared { layout, tools, sink, notices, files } = prepared;
    let file = files.await.map_err(|e| format!("making the session folder: {e}"))??;
    let capsule_dir = std::path::absolute(&capsule.dir).map_err(|e| e.to_string())?;
    // Fails closed before any command runs: no sandbox block under --require-sandbox, or a
    // rule the kernel cannot enforce (issue #37).
    let folders = crate::sandbox::Folders {
        workdir: layout.workdir.clone(),
        session_dir: layout.session_dir.clone(),
        capsule_dir: capsule_dir.clone(),
    };
    let sandbox = match crate::sandbox::for_session(&capsule.manifest, &folders, sh.config.require_sandbox) {
        Ok(sandbox) => sandbox,
        Err(e) => return Ok((ExitStatus::Failed, e.to_string(), None)),
    };
    let driver = capsule.driver(&layout.workdir).map_err(|e| e.to_string())?;
    if task.origin == Origin::Completion {
        detached::fetch_logs(&sh.capsules, &task.text, &layout.session_dir).await;
    }
    let session_done = CancellationToken::new();
    let host = detached::Host {
        client: sh.client.clone(),
        store: sh.capsules.clone(),
        capsule: task.capsule.clone(),
        task_id: task.task_id.clone(),
        context_id: task.context_id.clone(),
        session_id: session_id.to_string(),
        session_dir: layout.session_dir.clone(),
    };
    // Done with on every way out of here, so the host does not wait past the session.
    let _session_over = session_done.clone().drop_guard();
    // The folder is finished once the session has ended and no detached command runs in it
    // (the host returns then); only then may retention remove it.
    // A folder whose detached commands the worker's stop abandoned keeps their only output:
    // it is not counted.
    let (retention, dir, stopping) = (sh.retention.clone(), layout.session_dir.clone(), sh.detached_stop.clone());
    let serving = host.serve(notices, sink.clone(), session_done.clone(), sh.detached_stop.clone());
    sh.detached.spawn(async move {
        serving.await;
        if !stopping.is_cancelled() {
            retention.finished(dir);
        }
    });
    let (published, publisher) = TracePublisher::start(sh.client.clone(), cluster::trace_subject(session_id));
    let (cfg, parts) = build_session_parts(Setup {
        capsule,
        capsule_dir: &capsule_dir,
        layout: &layout,
        session_id,
        driver,
        tools,
        sink: Box::new(Tee(vec![Box::new(file), Box::new(published), Box::new(tally.clone())])),
        system_prompt: None,
        resumed_from: takeover.as_ref().map(|t| t.previous_session_id.clone()),
        sandbox,
    });
    let resumed = takeover.as_ref().is_some_and(|t| t.checkpoint.is_some());
    let base = if resumed { None } else { Some(prior_conversation(sh, task, capsule).await?) };
    let prior = base.as_ref().map(|b| b.messages.clone()).unwrap_or_default();
    let outcome = async {
        let mut session = Session::start(cfg, parts).await.map_err(|e| e.to_string())?;
        let spec = TaskSpec {
            task_id: task.task_id.clone(),
            context_id: task.context_id.clone(),
            text: task.text.clone(),
            origin: task.origin,
            source: TASK_SOURCE.to_string(),
        };
        // The deadline a fleet step inherited from its loop (unix ms → the runtime's clock).
        let deadline = task.deadline_at.map(|at| {
            let left = at.saturating_sub(SystemClock.now_ms());
            tokio::time::Instant::now() + Duration::from_millis(left)
        });
        let durable = Durable { takeover, checkpoints, deadline };
        let report = session.run_task_durable(spec, prior, cancel.clone(), durable).await;
        let outcome = match report {
            Ok(r) => {
                if r.outcome.exit_status == ExitStatus::Ok && continues_context(task, capsule) {
                    save_conversation(sh, task, &r.history, base.as_ref()).await;
                }
                (r.outcome.exit_status, r.outcome.result)
            }
            Err(e) => (ExitStatus::Failed, format!("error: {e}")),
        };
        if matches!(outcome.0, ExitStatus::Canceled | ExitStatus::DeadlineExceeded) {
            // murmur itself stops a cancelled task's commands, whole process groups.
            sink.kill_all().await;
        }
        if let Err(e) = session.end_until(None, &cancel).await {
            tracing::warn!(session_id, error = %e, "ending the session failed");
        }
        Ok(outcome)
    }
    .await;
    session_done.cancel();
    // The session and its sink are gone: every line is queued; send them all.
    publisher.finish().await;
    outcome.map(|(exit, result)| (exit, result, tally.usage()))
}

/// Keeps the context's conversation after a task that ended `ok` (as `mur run` keeps
/// `contexts/<ctx>/history.json`). A failed write is logged: the next task of the
/// context starts from the conversation before this one.
async fn save_conversation(sh: &Shared, task: &TaskRecord, history: &[Message], base: Option<&ContextConversation>) {
    let key = cluster::context_key(&task.capsule, &task.context_id);
    let max_payload = sh.client.server_info().max_payload;
    if let Err(e) = write_conversation(&sh.sessions, &key, history.to_vec(), base, max_payload).await {
        tracing::warn!(task_id = %task.task_id, key, error = %e, "the conversation was not kept");
    }
}

/// A [`Sink`] handing trace lines to a background task that publishes them, in order, on
/// the session's trace subject with the core client: no per-line round trip, and a slow
/// server never blocks the loop.
struct PublishedSink {
    lines: mpsc::UnboundedSender<(Bytes, Option<String>)>,
}

impl Sink for PublishedSink {
    fn write(&mut self, line: &Line) -> Result<(), trace::Error> {
        let json = serde_json::to_vec(line).map_err(|e| trace::Error(e.to_string()))?;
        // `task_end` is written once per task (the design's invariant 4): a task run again
        // after a crash publishes it with the same message id, which MUR_TRACE drops
        // within its duplicate window.
        let msg_id = match &line.event {
            mur_proto::trace::Event::TaskEnd { task_id, .. } => Some(format!("{task_id}:task_end")),
            _ => None,
        };
        // The publisher only stops after every sender is gone.
        let _ = self.lines.send((json.into(), msg_id));
        Ok(())
    }
}

/// The background task behind a [`PublishedSink`].
struct TracePublisher {
    task: tokio::task::JoinHandle<()>,
}

impl TracePublisher {
    fn start(client: async_nats::Client, subject: String) -> (PublishedSink, TracePublisher) {
        let (tx, mut rx) = mpsc::unbounded_channel::<(Bytes, Option<String>)>();
        let subject = async_nats::Subject::from(subject);
        let task = tokio::spawn(async move {
            while let Some((line, msg_id)) = rx.recv().await {
                let published = match msg_id {
                    Some(id) => {
                        let mut headers = async_nats::HeaderMap::new();
                        headers.insert(async_nats::header::NATS_MESSAGE_ID, id.as_str());
                        client.publish_with_headers(subject.clone(), headers, line).await
                    }
                    None => client.publish(subject.clone(), line).await,
                };
                if let Err(e) = published {
                    tracing::warn!(%subject, error = %e, "publishing a trace line failed");
                }
            }
        });
        (PublishedSink { lines: tx }, TracePublisher { task })
    }

    /// Waits until every line written before the sink was dropped is handed to the
    /// connection. No flush (a round trip to the server) is needed to order them before the
    /// task's terminal record: a connection delivers in order, and the record goes out on
    /// the same connection after them and is awaited, so its acknowledgement means the
    /// server has taken every line before it.
    async fn finish(self) {
        let _ = self.task.await;
    }
}
