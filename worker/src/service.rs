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
//!
//! The files: this one (config, the pull loop, cancels, shutdown), `pull` (pull requests),
//! `heartbeat` (the registration), `dispatch` (one dispatch in its slot) driven by
//! `decide` (what to do next, pure), `loading` (capsule bundles), `run` (the session),
//! `checkpoints`, `conversations`, `publish` (trace lines to NATS).

use crate::bundle;
use crate::capsule::{self, Capsule};
use crate::launch::{Setup, build_session_parts};
use crate::session::machine::Counters;
use crate::session::{Checkpoints, Durable, Journal, Resumed, Session, Takeover, TaskSpec, TurnCheckpoint, Unstored};
use crate::tools::background::DetachSink;
use crate::tools::fleet::FleetAccess;
use crate::tools::{Toolbox, Tools};
use crate::trace::{self, FileSink, Sink, Tee};
use crate::workdir::Layout;
use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::{self, AckKind, kv, object_store};
use bytes::Bytes;
use decide::{
    Answer, Delivered, Fetch, Hold, Known, Permit, PermitWait, Record, Step, decide, ends_for, hold, writable,
};
use futures::StreamExt;
use mur_nats::clock::{Clock, SystemClock};
use mur_nats::fanout;
use mur_nats::tasks::{self as task_records, read};
use mur_nats::trace_context;
use mur_proto::cluster::{self, Checkpoint, CheckpointCounters, Dispatch, StoredConversation, TaskRecord, WorkerInfo};
use mur_proto::ids::{SessionId, TaskId};
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

mod checkpoints;
mod conversations;
mod decide;
pub mod detached;
mod dispatch;
mod heartbeat;
mod loading;
mod publish;
mod pull;
pub mod retention;
mod run;

use checkpoints::*;
pub use conversations::*;
use dispatch::*;
use heartbeat::*;
use loading::*;
use publish::*;
use pull::*;
use run::*;

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
    /// The JetStream context the buckets were opened with: journal entries are published
    /// through it and their acknowledgements awaited together ([`KvCheckpoints`]).
    js: jetstream::Context,
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
    running: std::sync::Mutex<HashMap<TaskId, HashMap<u64, CancellationToken>>>,
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

    let mut puller = Puller::start(&client, js.clone(), consumer).await.map_err(open(cluster::DISPATCH_CONSUMER))?;
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
        js,
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
