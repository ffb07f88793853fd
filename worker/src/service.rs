//! The cluster worker: pulls dispatches from `MUR_DISPATCH` one at a time while a slot is
//! free, runs each task in a session of its own, and keeps the task record in `mur_tasks`
//! (DESIGN.md §A task's way, steps 4–5).
//!
//! For each dispatch ([`Dispatch`]) the worker:
//! 1. reads the task record and its revision; a terminal record is acked and skipped;
//! 2. fetches the capsule bundle named by the record (`capsule`, `capsule_digest`) into
//!    `<workdir>/cache/<capsule>/<digest>/` (once per digest) and loads it; when that
//!    fails the record ends `failed` with the reason in `result` and `error`, and the
//!    dispatch is acked (a broken bundle is not retried forever);
//! 3. compare-and-sets the record to `working` with its id, the new `session_id` and
//!    `started_at` (an earlier `started_at` is kept);
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
//!    `ended_at`, then double-acks the dispatch.
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
//! Not done here: conversation restore for threaded capsules (every task starts with an
//! empty history), per-turn checkpoints in `mur_sessions`, detached shell commands (the
//! toolbox has no background host, so a command runs in the foreground to its end), and
//! reacting to a record cancelled by the coordinator while the task runs.

use crate::bundle;
use crate::capsule::{self, Capsule};
use crate::clock::{Clock, SystemClock};
use crate::launch::{Setup, build_session_parts};
use crate::session::{Session, TaskSpec};
use crate::tools::{Toolbox, Tools};
use crate::trace::{self, FileSink, Sink, Tee};
use crate::workdir::Layout;
use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::{self, AckKind, kv, object_store};
use bytes::Bytes;
use futures::StreamExt;
use mur_proto::cluster::{self, Dispatch, TaskRecord, WorkerInfo};
use mur_proto::ids::{Id, IdKind};
use mur_proto::task::{ExitStatus, TaskState};
use mur_proto::trace::Line;
use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

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
/// Compare-and-set attempts on a task record before giving up.
const CAS_ATTEMPTS: usize = 10;
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
    /// How often a running task's dispatch gets an in-progress ack. Default 10 s, a third
    /// of the default ack wait (30 s).
    pub progress_every: Duration,
    /// How long running tasks may go on after shutdown before they are cancelled.
    /// Default 30 s.
    pub shutdown_grace: Duration,
}

impl Config {
    /// The defaults, with the worker's folder `workdir`.
    pub fn new(workdir: impl Into<PathBuf>) -> Config {
        Config {
            worker_id: format!("wkr_{}", uuid::Uuid::now_v7().simple()),
            slots: 8,
            workdir: workdir.into(),
            progress_every: Duration::from_secs(10),
            shutdown_grace: Duration::from_secs(30),
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

/// What every task handler shares.
struct Shared {
    client: async_nats::Client,
    tasks: kv::Store,
    capsules: object_store::ObjectStore,
    config: Config,
    /// Fired when the shutdown grace has passed: running tasks are cancelled.
    hard_stop: CancellationToken,
}

/// Runs the worker until `shutdown` resolves, then drains it (see the module docs).
///
/// # Errors
/// [`Error`] when the worker cannot start: a bad config, a missing stream, consumer or
/// bucket, an unwritable workdir, a failed first registration. Once running, task
/// failures end up in task records, not here.
pub async fn run(client: async_nats::Client, config: Config, shutdown: impl Future<Output = ()>) -> Result<(), Error> {
    if config.slots == 0 {
        return Err(Error::Config("slots: must be at least 1, got 0".into()));
    }
    if config.progress_every.is_zero() {
        return Err(Error::Config("progress_every: must be more than 0".into()));
    }
    let mut config = config;
    std::fs::create_dir_all(&config.workdir).map_err(|source| Error::Io { path: config.workdir.clone(), source })?;
    config.workdir =
        std::path::absolute(&config.workdir).map_err(|source| Error::Io { path: config.workdir.clone(), source })?;

    let js = jetstream::new(client.clone());
    let tasks = js.get_key_value(cluster::TASKS_BUCKET).await.map_err(open(cluster::TASKS_BUCKET))?;
    let workers = js.get_key_value(cluster::WORKERS_BUCKET).await.map_err(open(cluster::WORKERS_BUCKET))?;
    let capsules = js.get_object_store(cluster::CAPSULES_STORE).await.map_err(open(cluster::CAPSULES_STORE))?;
    let consumer: PullConsumer = js
        .get_consumer_from_stream(cluster::DISPATCH_CONSUMER, cluster::DISPATCH_STREAM)
        .await
        .map_err(open(cluster::DISPATCH_CONSUMER))?;

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
    let shared = Arc::new(Shared { client, tasks, capsules, config, hard_stop: CancellationToken::new() });
    let mut running = JoinSet::new();
    tokio::pin!(shutdown);
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
    heartbeat_stop.cancel();
    let _ = heartbeat.await;
    if let Err(e) = workers.delete(&shared.config.worker_id).await {
        tracing::warn!(error = %e, "deleting the worker's registration failed");
    }
    Ok(())
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
async fn handle(sh: Arc<Shared>, msg: jetstream::Message, _slot: OwnedSemaphorePermit) {
    let msg = Arc::new(msg);
    let progress = tokio::spawn({
        let msg = msg.clone();
        let every = sh.config.progress_every;
        async move {
            let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
            loop {
                tick.tick().await;
                if let Err(e) = msg.ack_with(AckKind::Progress).await {
                    tracing::debug!(error = %e, "in-progress ack failed");
                }
            }
        }
    });
    let answer = run_dispatch(&sh, &msg.payload).await;
    progress.abort();
    let acked = match answer {
        Answer::Ack => msg.double_ack().await,
        Answer::Term => msg.ack_with(AckKind::Term).await,
        Answer::Nak => msg.ack_with(AckKind::Nak(Some(Duration::from_secs(1)))).await,
    };
    if let Err(e) = acked {
        tracing::warn!(error = %e, ?answer, "answering a dispatch failed; it will be redelivered");
    }
}

async fn run_dispatch(sh: &Shared, payload: &[u8]) -> Answer {
    let dispatch: Dispatch = match serde_json::from_slice(payload) {
        Ok(d) => d,
        Err(e) => {
            tracing::warn!(error = %e, "a dispatch that is not a Dispatch: terminated");
            return Answer::Term;
        }
    };
    let key = dispatch.task_id.as_str();
    let current = match read(&sh.tasks, key).await {
        Ok(Some(c)) => c,
        Ok(None) => {
            tracing::warn!(task_id = key, "a dispatch without a task record: terminated");
            return Answer::Term;
        }
        Err(e) => {
            tracing::warn!(task_id = key, error = %e, "reading the task record failed");
            return Answer::Nak;
        }
    };
    if current.0.state.is_terminal() {
        return Answer::Ack;
    }
    let worker_id = sh.config.worker_id.clone();

    let capsule = match load_capsule(sh, &current.0).await {
        Ok(c) => c,
        Err(reason) => {
            let w = worker_id.clone();
            return finished(
                cas(&sh.tasks, key, current, |r| {
                    if r.state.is_terminal() {
                        return false;
                    }
                    r.worker = Some(w.clone());
                    end_record(r, ExitStatus::Failed, &reason, Some(&reason));
                    true
                })
                .await,
                key,
            );
        }
    };

    let session_id = Id::generate(IdKind::Session);
    let working = cas(&sh.tasks, key, current, |r| {
        if r.state.is_terminal() {
            return false;
        }
        r.state = TaskState::Working;
        r.worker = Some(worker_id.clone());
        r.session_id = Some(session_id.clone());
        r.started_at = r.started_at.or(Some(SystemClock.now_ms()));
        true
    })
    .await;
    let current = match working {
        Ok(Some(c)) => c,
        Ok(None) => return Answer::Ack, // ended elsewhere meanwhile
        Err(e) => {
            tracing::warn!(task_id = key, error = %e, "marking the task working failed");
            return Answer::Nak;
        }
    };
    let task = current.0.clone();
    let (exit, result, error) = match run_session(sh, &task, &capsule, &session_id).await {
        Ok((exit, result)) => (exit, result, None),
        Err(e) => (ExitStatus::Failed, format!("error: {e}"), Some(e)),
    };
    finished(
        cas(&sh.tasks, key, current, |r| {
            if r.state.is_terminal() {
                return false;
            }
            end_record(r, exit, &result, error.as_deref());
            true
        })
        .await,
        key,
    )
}

/// The answer after the terminal write: ack when the record is terminal (ours or not).
fn finished(written: Result<Option<(TaskRecord, u64)>, String>, key: &str) -> Answer {
    match written {
        Ok(_) => Answer::Ack,
        Err(e) => {
            tracing::warn!(task_id = key, error = %e, "writing the terminal record failed");
            Answer::Nak
        }
    }
}

fn end_record(r: &mut TaskRecord, exit: ExitStatus, result: &str, error: Option<&str>) {
    r.state = exit.task_state();
    r.exit_status = Some(exit);
    r.result = Some(result.to_string());
    r.error = error.map(str::to_string);
    r.ended_at = Some(SystemClock.now_ms());
}

/// Fetches (or finds in the cache) and loads the record's capsule bundle.
async fn load_capsule(sh: &Shared, record: &TaskRecord) -> Result<Capsule, String> {
    let cache = sh.config.workdir.join("cache");
    let dir = bundle::fetch(&sh.capsules, &record.capsule, &record.capsule_digest, &cache)
        .await
        .map_err(|e| format!("error: fetching capsule {}: {e}", record.capsule))?;
    let env = |k: &str| std::env::var(k).ok();
    Capsule::load(&dir, &env).map_err(|e| format!("error: loading capsule {}: {e}", record.capsule))
}

/// Reads a task record and its revision.
async fn read(tasks: &kv::Store, key: &str) -> Result<Option<(TaskRecord, u64)>, String> {
    let Some(entry) = tasks.entry(key).await.map_err(|e| e.to_string())? else {
        return Ok(None);
    };
    if entry.operation != kv::Operation::Put {
        return Ok(None);
    }
    let record: TaskRecord =
        serde_json::from_slice(&entry.value).map_err(|e| format!("task record {key} is not valid JSON: {e}"))?;
    Ok(Some((record, entry.revision)))
}

/// Applies `change` to the record with compare-and-set on its revision, re-reading and
/// retrying on a conflict (at most [`CAS_ATTEMPTS`] times). `change` returns false to
/// leave the record alone: then `Ok(None)`.
async fn cas(
    tasks: &kv::Store,
    key: &str,
    mut current: (TaskRecord, u64),
    mut change: impl FnMut(&mut TaskRecord) -> bool,
) -> Result<Option<(TaskRecord, u64)>, String> {
    let mut last_error = String::new();
    for _ in 0..CAS_ATTEMPTS {
        let mut record = current.0.clone();
        if !change(&mut record) {
            return Ok(None);
        }
        let json = serde_json::to_vec(&record).map_err(|e| e.to_string())?;
        match tasks.update(key, json.into(), current.1).await {
            Ok(revision) => return Ok(Some((record, revision))),
            Err(e) => {
                last_error = e.to_string();
                tracing::debug!(task_id = key, error = %e, "task record compare-and-set lost; re-reading");
                current = read(tasks, key).await?.ok_or_else(|| format!("task record {key} disappeared"))?;
            }
        }
    }
    Err(format!("task record {key}: {CAS_ATTEMPTS} compare-and-set attempts failed, last: {last_error}"))
}

/// Runs `task` in a new session `session_id` and returns its exit status and result.
async fn run_session(
    sh: &Shared,
    task: &TaskRecord,
    capsule: &Capsule,
    session_id: &str,
) -> Result<(ExitStatus, String), String> {
    let dir = sh.config.workdir.join("sessions").join(session_id);
    // Like `mur run` without --workdir: commands run in the session folder itself.
    let layout = Layout { workdir: dir.clone(), session_dir: dir };
    layout.create().map_err(|e| e.to_string())?;
    let capsule_dir = std::path::absolute(&capsule.dir).map_err(|e| e.to_string())?;
    let driver = capsule.driver(&layout.workdir).map_err(|e| e.to_string())?;
    let tools = Arc::new(Toolbox::from_manifest(&capsule.manifest));
    std::fs::write(
        layout.murmur_md(),
        capsule::onboarding(&capsule.manifest, &capsule.model_label(), &layout, tools.specs()),
    )
    .map_err(|e| format!("{}: {e}", layout.murmur_md().display()))?;
    let file = FileSink::open(&layout.trace()).map_err(|e| e.to_string())?;
    let (published, publisher) = TracePublisher::start(sh.client.clone(), cluster::trace_subject(session_id));
    let (cfg, parts) = build_session_parts(Setup {
        capsule,
        capsule_dir: &capsule_dir,
        layout: &layout,
        session_id,
        driver,
        tools,
        sink: Box::new(Tee(vec![Box::new(file), Box::new(published)])),
        system_prompt: None,
        resumed_from: None,
    });
    let outcome = async {
        let mut session = Session::start(cfg, parts).await.map_err(|e| e.to_string())?;
        let spec = TaskSpec {
            task_id: task.task_id.clone(),
            context_id: task.context_id.clone(),
            text: task.text.clone(),
            origin: task.origin,
            source: TASK_SOURCE.to_string(),
        };
        let report = session.run_task_until(spec, Vec::new(), sh.hard_stop.child_token()).await;
        let outcome = match report {
            Ok(r) => (r.outcome.exit_status, r.outcome.result),
            Err(e) => (ExitStatus::Failed, format!("error: {e}")),
        };
        if let Err(e) = session.end(None).await {
            tracing::warn!(session_id, error = %e, "ending the session failed");
        }
        Ok(outcome)
    }
    .await;
    // The session and its sink are gone: every line is queued; send them all.
    publisher.finish().await;
    outcome
}

/// A [`Sink`] handing trace lines to a background task that publishes them, in order, on
/// the session's trace subject with the core client: no per-line round trip, and a slow
/// server never blocks the loop.
struct PublishedSink {
    lines: mpsc::UnboundedSender<Bytes>,
}

impl Sink for PublishedSink {
    fn write(&mut self, line: &Line) -> Result<(), trace::Error> {
        let json = serde_json::to_vec(line).map_err(|e| trace::Error(e.to_string()))?;
        // The publisher only stops after every sender is gone.
        let _ = self.lines.send(json.into());
        Ok(())
    }
}

/// The background task behind a [`PublishedSink`].
struct TracePublisher {
    task: tokio::task::JoinHandle<()>,
}

impl TracePublisher {
    fn start(client: async_nats::Client, subject: String) -> (PublishedSink, TracePublisher) {
        let (tx, mut rx) = mpsc::unbounded_channel::<Bytes>();
        let subject = async_nats::Subject::from(subject);
        let task = tokio::spawn(async move {
            while let Some(line) = rx.recv().await {
                if let Err(e) = client.publish(subject.clone(), line).await {
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
