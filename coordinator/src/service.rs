//! The coordinator's NATS adapter: it serves the `mur` micro service (task intake, task and
//! capsule queries), turns the `mur_tasks` and `mur_workers` buckets into [`Input`]s for
//! the [`Scheduler`], and carries out every [`Output::Release`] (the design, §A task's way
//! through the cluster, steps 1–3).
//!
//! Layout of [`run`]:
//! 1. [`resources::ensure`], then one watcher per bucket (`watch_with_history(">")`: the
//!    last revision of every key, then every change; `watch_all` would give only the
//!    changes). What the watchers deliver until they are caught up is the restart replay
//!    given to [`Scheduler::restore`]; after that each change is fed to the scheduler as
//!    it comes.
//! 2. One actor task owns the scheduler: every input (from the watchers, the worker
//!    heartbeat tick, `task.submit` and `task.cancel`) goes through one mpsc channel, so
//!    inputs are applied in the order they are sent. The releases an input produces are
//!    carried out concurrently (each a compare-and-set and a publish awaiting its ack),
//!    so that no release waits for another's round trips.
//! 3. The micro service `mur` ([`cluster::SERVICE_NAME`], discoverable with `$SRV.INFO`)
//!    has one endpoint per subject of [`cluster::api`]; each request is handled in a task
//!    of its own. Replies follow the scheme of [`mur_nats::api`] (success = the plain JSON
//!    value; failure = micro service error headers + the [`ApiError`] JSON, sent as an
//!    error so the service stats count it).
//!
//! Admission at submit (issue #9): `task.submit` first asks the actor to
//! [`Scheduler::admit`] the task. When a slot is free and nothing would be released before
//! it, the task is taken into flight there, its record is created already released
//! (`submitted`, attempt 1) and its dispatch published at once: no compare-and-set from
//! attempt 0, one record write and one hop fewer per task. Otherwise it waits and is
//! released as below. A record that could not be created gives its slot back
//! ([`Input::Ended`]).
//!
//! Mapping of task records to inputs (the contract with the worker):
//! - `submitted`, attempt 0 → [`Input::Submitted`] with `seq` = the entry's revision. A
//!   record still at attempt 0 has never been changed since its creation, so this is its
//!   creation revision: the task's arrival order. `task.submit` sends the same input itself
//!   as soon as it has created the record (with the revision the create returned and the
//!   queue flag of the index entry it read), so a task is released without waiting for the
//!   watch; the watch's copy is then skipped (or, in a race, ignored by the scheduler as a
//!   duplicate).
//! - `submitted`, attempt ≥ 1 → [`Input::Released`] (the coordinator bumped the attempt
//!   before publishing its dispatch). One that this coordinator did not write (another
//!   stored it released and lost its lease or died before its dispatch went out) is fed as
//!   `Submitted` then `Released`, and its dispatch is published again (same message id).
//!   At a restart it is replayed after its `Submitted`
//!   (whose `seq` is then the latest revision: only in-flight ordering in snapshots uses
//!   it), and its dispatch is published again with the same message id: if the previous
//!   coordinator died between the compare-and-set and the publish, the dispatch goes out
//!   now; otherwise JetStream drops the copy as a duplicate (within the stream's
//!   duplicate window, [`Settings::duplicate_window_secs`]).
//! - `working` → [`Input::Started`] with the record's worker.
//! - terminal (`completed`, `failed`, `canceled`, `rejected`) → [`Input::Ended`].
//!
//! A release: compare-and-set the record from `submitted`/attempt 0 to attempt 1 (from the
//! record and revision last seen by the intake or the watch; read afresh only when that
//! revision has moved on), then publish [`Dispatch`] to [`cluster::DISPATCH_SUBJECT`] with
//! message id [`Dispatch::msg_id`], awaiting the ack. The dispatch carries the record
//! written and its revision ([`Dispatch::released`]), so the worker need not read it. A record no longer at attempt 0 or no longer
//! `submitted` (cancelled meanwhile, or released by another coordinator) is left alone:
//! the watcher reports what happened to it.
//!
//! Whether a task's capsule is a `queue` capsule is read from the capsule index entry
//! ([`CapsuleIndexEntry::queue`]) of the capsule's latest push when the task is first seen.

use crate::lease::{Held, Lease};
use crate::resources::{self, Resources, Settings};
use crate::scheduler::{self, Input, Output, Scheduler};
use async_nats::jetstream::{self, kv, message::PublishMessage};
use async_nats::service::{Request, ServiceExt};
use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use mur_nats::api;
use mur_nats::clock::{Clock, SystemClock};
use mur_nats::trace_context;
use mur_proto::cluster::{
    self, ApiError, CapsuleEntry, CapsuleIndexEntry, Dispatch, ErrorCode, Released, SubmitReply, SubmitRequest,
    TaskRecord, TaskRef, WorkerInfo,
};
use mur_proto::page::{self, Page};
use mur_proto::task::TaskState;
use mur_proto::{ExitStatus, Id, IdKind};
use serde::Deserialize;
use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinSet;
use tracing::Instrument;

/// The tracing target of the lines a coordinator writes when it stands by or starts
/// leading: `mur coordinator` shows them by default (issue #29 item 14).
pub const ROLE_LOG_TARGET: &str = "mur::role";

/// How long a worker may go without a heartbeat before its slots stop counting.
pub const DEFAULT_WORKER_TIMEOUT: Duration = Duration::from_secs(10);

/// The most records `task.list` answers with (the newest ones).
pub const LIST_LIMIT: usize = 1000;

/// How often worker heartbeats are checked for age.
const HEARTBEAT_CHECK: Duration = Duration::from_secs(1);

/// How the coordinator runs.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// The cluster's streams and buckets.
    pub settings: Settings,
    /// The fleet part of the cluster config: `prices:`, `fleet.autorun` (issue #11).
    pub fleet: crate::fleet_cost::FleetSettings,
    /// This coordinator's name, for logs.
    pub instance: String,
    /// A worker whose heartbeat is older than this is gone ([`DEFAULT_WORKER_TIMEOUT`]).
    pub worker_timeout: Duration,
}

impl Config {
    /// A configuration with the default worker timeout.
    pub fn new(settings: Settings, instance: impl Into<String>) -> Config {
        Config {
            settings,
            fleet: crate::fleet_cost::FleetSettings::default(),
            instance: instance.into(),
            worker_timeout: DEFAULT_WORKER_TIMEOUT,
        }
    }
}

impl Default for Config {
    fn default() -> Self {
        Config::new(Settings::default(), "coordinator")
    }
}

/// Why the coordinator stopped.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The streams and buckets could not be set up.
    #[error(transparent)]
    Resources(#[from] resources::Error),
    /// A NATS request the coordinator cannot do without failed.
    #[error("{what}: {source}")]
    Nats {
        /// What was being done.
        what: String,
        /// The client's error.
        source: async_nats::Error,
    },
    /// A background loop (a watcher or the scheduler) ended before the shutdown.
    #[error("{0} ended unexpectedly")]
    LoopEnded(&'static str),
}

fn nats<E: Into<async_nats::Error>>(what: impl Into<String>) -> impl FnOnce(E) -> Error {
    let what = what.into();
    move |e| Error::Nats { what, source: e.into() }
}

/// Runs the coordinator until `shutdown` resolves: sets up the resources, restores the
/// scheduler from the buckets, serves the `mur` micro service and dispatches tasks.
///
/// A leader whose restore fails (the replay's watch refused or timed out by the broker) does
/// not stop: it gives the lease back and stands by, trying again one renewal interval
/// (a third of the lease) later, twice that after a second failure in a row, and so on up
/// to 30 s ([`restore_retry_pause`]).
///
/// # Errors
/// [`Error::Resources`] when the streams and buckets cannot be set up, [`Error::Nats`] when
/// the service cannot start, [`Error::LoopEnded`] when a bucket watch of a leader ends on
/// its own (the connection is gone for good).
pub async fn run(client: async_nats::Client, config: Config, shutdown: impl Future<Output = ()>) -> Result<(), Error> {
    let instance = config.instance.clone();
    let js = jetstream::new(client.clone());
    let res = Arc::new(resources::ensure(&js, &config.settings).await?);

    // Every coordinator serves the API, a standby too: a submission only writes a record,
    // which the leader's watcher picks up, so intake goes on during a failover.
    let (no_actor, _) = mpsc::unbounded_channel();
    let (no_admissions, _) = mpsc::unbounded_channel();
    // One pass over every task record at a time in this process (the restore's, a list's, a
    // status'): several at once over a store of gigabytes outran this connection (the
    // server cut it off as a slow consumer, the lease's renewals timed out with it).
    let scans = Arc::new(tokio::sync::Semaphore::new(1));
    let intake = Arc::new(IntakeOrder::default());
    let bundles = Arc::new(BundleFlags::default());
    let shared = ProcessShared { scans: scans.clone(), intake: intake.clone(), bundles: bundles.clone() };
    let api_ctx = Arc::new(Ctx {
        js: js.clone(),
        tasks: res.tasks.clone(),
        capsule_index: res.capsule_index.clone(),
        inputs: no_actor,
        admissions: no_admissions,
        instance: instance.clone(),
        lease: None,
        fleets: crate::fleets::Fleets::new(js.clone(), &res, instance.clone()),
        waiting: Mutex::default(),
        releasing: Mutex::default(),
        worker_timeout_ms: millis(config.worker_timeout),
        scans: scans.clone(),
        intake: intake.clone(),
        bundles: bundles.clone(),
    });
    let service = client
        .service_builder()
        .description("murmur coordinator: task intake, lane-ordered dispatch, queries")
        .start(cluster::SERVICE_NAME, env!("CARGO_PKG_VERSION"))
        .await
        .map_err(nats("service mur: start"))?;
    let group = service.group(cluster::api::PREFIX);
    let mut endpoints = Vec::new();
    for kind in Endpoint::ALL.into_iter().chain(crate::fleets::Op::ALL.map(Endpoint::Fleet)) {
        let subject = kind.subject();
        let suffix = &subject[cluster::api::PREFIX.len() + 1..];
        let endpoint = group
            .endpoint_builder()
            .name(suffix.replace('.', "_"))
            .add(suffix)
            .await
            .map_err(nats(format!("service mur: endpoint {subject}")))?;
        endpoints.push(endpoint.map(move |request| (kind, request)).boxed());
    }
    let mut requests = futures::stream::select_all(endpoints);
    tracing::info!(instance = %instance, "coordinator serving {}", cluster::api::PREFIX);

    // Fleet runs this process carries out, across its terms as leader.
    let active_runs = crate::fleet_run::Active::default();
    let lease =
        Lease::new(res.leader.clone(), instance.clone(), Duration::from_secs(config.settings.leader_lease_secs));
    let mut shutdown = std::pin::pin!(shutdown);
    let mut standby_logged = false;
    // Restores failed in a row; after one, the next try waits (another coordinator may take
    // the lease meanwhile) rather than repeat the failure at once.
    let mut failed_restores = 0u32;
    let mut pause_first = None;
    let outcome = 'outer: loop {
        // Standby: try to take the lease now and every renewal interval.
        let held = loop {
            let pause = match pause_first.take() {
                Some(pause) => pause,
                None => {
                    match lease.try_acquire().await {
                        Ok(Some(held)) => break Arc::new(held),
                        Ok(None) => {
                            if !standby_logged {
                                let holder = Lease::holder(&res.leader).await.ok().flatten().map(|l| l.instance);
                                let holder = holder.as_deref().unwrap_or("another coordinator");
                                tracing::info!(target: ROLE_LOG_TARGET, "coordinator {instance} standing by: {holder} leads");
                                standby_logged = true;
                            }
                            if let Err(e) = lease.stand_by().await {
                                tracing::warn!(instance = %instance, "saying this coordinator stands by: {e}");
                            }
                        }
                        Err(e) => tracing::warn!(instance = %instance, "taking the lease: {e}"),
                    }
                    lease.renew_every()
                }
            };
            let wait = tokio::time::sleep(pause);
            tokio::pin!(wait);
            loop {
                tokio::select! {
                    () = &mut shutdown => break 'outer Ok(()),
                    () = &mut wait => break,
                    request = requests.next() => match request {
                        Some((kind, request)) => answer_as_standby(&api_ctx, &intake, kind, request),
                        None => break 'outer Err(Error::LoopEnded("the service")),
                    },
                }
            }
        };
        standby_logged = false;
        lease.stop_standing_by().await;
        tracing::info!(target: ROLE_LOG_TARGET, "coordinator {instance} leading (term {})", held.term);
        mur_nats::metrics::leader_change("leading");
        let kept = lease.keep(&held);
        tokio::pin!(kept);
        // The restore (a replay of every record, seconds over a store of gigabytes) runs
        // while the lease is renewed and the API is answered as a standby answers it: the
        // lease does not lapse under it, and callers do not wait for it. It is a task of its
        // own, so that its CPU (parsing every record) holds up neither this loop's requests
        // nor the renewals; dropped (stepping down, a shutdown), it is aborted.
        let mut restoring = tokio_util::task::AbortOnDropHandle::new(tokio::spawn({
            let (client, config, res, held) = (client.clone(), config.clone(), res.clone(), held.clone());
            let (active_runs, shared) = (active_runs.clone(), shared.clone());
            async move { lead(&client, &config, &res, held, &active_runs, &shared).await }
        }));
        let mut leading = loop {
            tokio::select! {
                () = &mut shutdown => {
                    lease.release(&held).await;
                    break 'outer Ok(());
                }
                lost = &mut kept => {
                    // The restore stops where it is (what it released, it released while the
                    // lease was valid: fencing); the next leader's replay takes over.
                    tracing::warn!(instance = %instance, "stepping down while restoring: {lost}");
                    continue 'outer;
                }
                restored = &mut restoring => match restored.unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic())) {
                    Ok(l) => {
                        failed_restores = 0;
                        break l;
                    }
                    Err(e) => {
                        // The restore only reads (a watch refused or timed out: a broker
                        // restarting, a store too cold to answer in time); nothing was
                        // released yet. Give the lease back and try again later rather than
                        // end the process.
                        failed_restores += 1;
                        let pause = restore_retry_pause(lease.renew_every(), failed_restores);
                        tracing::warn!(
                            instance = %instance,
                            failed_restores,
                            retry_in = ?pause,
                            "restoring failed, standing by to try again: {e}"
                        );
                        lease.release(&held).await;
                        pause_first = Some(pause);
                        continue 'outer;
                    }
                },
                request = requests.next() => match request {
                    Some((kind, request)) => answer_as_standby(&api_ctx, &intake, kind, request),
                    None => {
                        lease.release(&held).await;
                        break 'outer Err(Error::LoopEnded("the service"));
                    }
                },
            }
        };
        let stepped_down = loop {
            tokio::select! {
                () = &mut shutdown => {
                    leading.stop().await;
                    lease.release(&held).await;
                    break 'outer Ok(());
                }
                lost = &mut kept => break lost,
                ended = leading.loops.join_next() => {
                    let what = match ended {
                        Some(Ok(what)) => what,
                        Some(Err(_)) | None => "a coordinator loop",
                    };
                    leading.stop().await;
                    lease.release(&held).await;
                    break 'outer Err(Error::LoopEnded(what));
                }
                request = requests.next() => match request {
                    Some((kind, request)) => {
                        // The leader's own context: a submission goes straight to its
                        // scheduler.
                        let ctx = leading.ctx.clone();
                        tokio::spawn(async move { ctx.handle(kind, request).await });
                    }
                    None => {
                        leading.stop().await;
                        lease.release(&held).await;
                        break 'outer Err(Error::LoopEnded("the service"));
                    }
                },
            }
        };
        tracing::warn!(instance = %instance, "stepping down: {stepped_down}");
        mur_nats::metrics::leader_change("standby");
        leading.stop().await;
    };
    tracing::info!(instance = %instance, "coordinator stopping");
    drop(requests);
    lease.stop_standing_by().await;
    if let Err(e) = service.stop().await {
        tracing::warn!(instance = %instance, "stopping the service: {e}");
    }
    outcome
}

/// How long a coordinator whose restore failed `failures` times in a row waits before it
/// tries to lead again: the lease's renewal interval, doubled per failure after the first,
/// at most [`RESTORE_RETRY_MAX`]. Each failed try leaves the watch it opened to the broker,
/// which keeps the consumer until its 30 s inactivity threshold: a pause growing to that
/// keeps such leftovers to a few, and the log to a line every 30 s.
fn restore_retry_pause(renew_every: Duration, failures: u32) -> Duration {
    renew_every.saturating_mul(1 << failures.saturating_sub(1).min(8)).min(RESTORE_RETRY_MAX).max(renew_every)
}

/// The longest pause between a coordinator's tries to restore ([`restore_retry_pause`]).
const RESTORE_RETRY_MAX: Duration = Duration::from_secs(30);

/// The loops of a leading coordinator.
struct Leading {
    ctx: Arc<Ctx>,
    loops: JoinSet<&'static str>,
    stop: watch::Sender<bool>,
}

impl Leading {
    async fn stop(&mut self) {
        let _ = self.stop.send(true);
        while self.loops.join_next().await.is_some() {}
    }
}

/// Takes up the leader's duties under `held`: restores the scheduler from the buckets,
/// republishes released dispatches, and starts the watchers, the actor, the
/// dead-letter loop and the fleet loops (run requests, adoption of dead runs, triggers;
/// `active_runs`: the fleet runs this process carries out).
async fn lead(
    client: &async_nats::Client,
    config: &Config,
    res: &Resources,
    held: Arc<Held>,
    active_runs: &crate::fleet_run::Active,
    ProcessShared { scans, intake, bundles }: &ProcessShared,
) -> Result<Leading, Error> {
    let instance = config.instance.clone();
    let js = jetstream::new(client.clone());
    // The watchers start before anything is read, so no change falls between the replay
    // and the live feed.
    let mut task_watch = res.tasks.watch_with_history(">").await.map_err(nats("mur_tasks: watch"))?;
    let mut worker_watch = res.workers.watch_with_history(">").await.map_err(nats("mur_workers: watch"))?;
    let turn = scans.acquire().await.map_err(|_| Error::LoopEnded("the record scans"))?;
    let (task_entries, replayed_up_to) = caught_up(&res.tasks, &mut task_watch, |entry| !ended_or_gone(entry)).await?;
    drop(turn);
    let (worker_entries, _) = caught_up(&res.workers, &mut worker_watch, |_| true).await?;

    let (inputs, input_rx) = mpsc::unbounded_channel();
    let (admissions, admission_rx) = mpsc::unbounded_channel();
    let ctx = Arc::new(Ctx {
        js: js.clone(),
        tasks: res.tasks.clone(),
        capsule_index: res.capsule_index.clone(),
        inputs,
        admissions,
        instance: instance.clone(),
        lease: Some(held),
        fleets: crate::fleets::Fleets::new(js.clone(), res, instance.clone()),
        waiting: Mutex::default(),
        releasing: Mutex::default(),
        worker_timeout_ms: millis(config.worker_timeout),
        scans: scans.clone(),
        intake: intake.clone(),
        bundles: bundles.clone(),
    });
    // The watch goes on from the replay's last entry.
    intake.watched.store(replayed_up_to, Ordering::SeqCst);

    // The replay.
    let mut replay = Vec::new();
    let mut republish = Vec::new();
    let mut queue_flags = QueueFlags::default();
    for entry in &task_entries {
        let Some(record) = ctx.record_of(entry) else { continue };
        if record.state.is_terminal() {
            continue;
        }
        let queue_capsule = queue_flags.get(&ctx.capsule_index, &ctx.bundles, &record).await;
        replay.push(submitted_input(&record, entry.revision, queue_capsule));
        if record.state == TaskState::Submitted && record.attempt >= 1 {
            ctx.releasing.lock().expect("releasing lock").insert(record.task_id.clone());
            republish.push(Dispatch {
                task_id: record.task_id.clone(),
                attempt: record.attempt,
                released: Some(Released { revision: entry.revision, record: record.clone() }),
            });
        }
        replay.extend(progress_input(&record));
    }
    let mut workers = Workers::new(config.worker_timeout);
    let now = SystemClock.now_ms();
    for entry in &worker_entries {
        replay.extend(workers.observe(entry, now));
    }
    let replayed = replay.len();
    let (scheduler, outputs) = Scheduler::restore(replay);
    tracing::info!(
        instance = %instance,
        tasks = task_entries.len(),
        inputs = replayed,
        workers = worker_entries.len(),
        in_flight = scheduler.snapshot().in_flight.len(),
        "coordinator restored"
    );
    for dispatch in republish {
        if let Err(e) = ctx.publish(&dispatch, None).await {
            tracing::warn!(instance = %instance, task_id = %dispatch.task_id, "republishing dispatch failed: {e}");
        }
    }
    for output in outputs {
        ctx.carry_out(output).await;
    }

    let (stop, stopped) = watch::channel(false);
    let mut loops: JoinSet<&'static str> = JoinSet::new();
    loops.spawn(actor(ctx.clone(), scheduler, input_rx, admission_rx, stopped.clone()));
    loops.spawn(watch_tasks(ctx.clone(), task_watch, queue_flags, stopped.clone()));
    loops.spawn(watch_workers(ctx.clone(), worker_watch, workers, stopped.clone()));
    loops.spawn(crate::dead_letter::run(
        js.clone(),
        res.dead_letter_consumer.clone(),
        res.tasks.clone(),
        instance.clone(),
        stopped.clone(),
    ));
    let fleet_env = crate::fleet_run::Env {
        client: client.clone(),
        fleets: crate::fleets::Fleets::new(js.clone(), res, instance.clone()),
        tasks: res.tasks.clone(),
        capsule_index: res.capsule_index.clone(),
        instance: instance.clone(),
        settings: config.fleet.clone(),
        active: active_runs.clone(),
    };
    loops.spawn(crate::fleet_adopt::serve(fleet_env.clone(), stopped.clone()));
    loops.spawn(crate::fleet_trigger::serve(fleet_env.clone(), stopped.clone()));
    loops.spawn(crate::fleet_run::serve(fleet_env, stopped.clone()));
    Ok(Leading { ctx, loops, stop })
}

/// Reads a fresh `watch_with_history` watcher up to the entry that was the bucket's last when it
/// started (or later), and returns the entries of what it read that `keep` accepts: the
/// bucket's current state, or the part of it the caller needs (entries not kept are dropped
/// as they are read).
async fn caught_up(
    store: &kv::Store,
    watch: &mut kv::Watch,
    keep: impl Fn(&kv::Entry) -> bool,
) -> Result<(Vec<kv::Entry>, u64), Error> {
    // A key written while it is read comes again later (and after the watcher's consumer
    // was reset, its older revisions too — always before its newest): the last entry read
    // of a key is its state. A task cancelled during a restore used to be replayed from its
    // earlier `submitted` entry, its `canceled` one dropped as ended: the scheduler then
    // released it, the release was refused, and its slot stayed taken for good.
    let mut latest = Latest::default();
    let mut last = 0;
    read_current(store, watch, |entry| {
        let (key, revision) = (entry.key.clone(), entry.revision);
        last = last.max(revision);
        latest.read(key, revision, keep(&entry).then_some(entry));
    })
    .await?;
    Ok((latest.into_sorted(), last))
}

/// The last entry read of each key, when it is one to keep: what a pass over a bucket's
/// stream leaves once the entries of keys written during the pass have come again.
struct Latest<T> {
    by_key: HashMap<String, (u64, T)>,
}

impl<T> Default for Latest<T> {
    fn default() -> Self {
        Latest { by_key: HashMap::new() }
    }
}

impl<T> Latest<T> {
    /// An entry of `key` at `revision`: `Some` to keep it, `None` for one that is not kept
    /// (a delete, an ended record). Either way it replaces what the key's earlier entries
    /// left.
    fn read(&mut self, key: String, revision: u64, item: Option<T>) {
        match item {
            Some(item) => {
                self.by_key.insert(key, (revision, item));
            }
            None => {
                self.by_key.remove(&key);
            }
        }
    }

    /// What is kept, oldest revision first.
    fn into_sorted(self) -> Vec<T> {
        let mut kept: Vec<(u64, T)> = self.by_key.into_values().collect();
        kept.sort_by_key(|(revision, _)| *revision);
        kept.into_iter().map(|(_, item)| item).collect()
    }
}

/// Hands `visit` each entry a fresh `watch_with_history` watcher reads, up to the entry that
/// was the bucket's last when it started (or later): the latest revision of every key, in
/// one pass over the bucket's stream, nothing held here.
async fn read_current(store: &kv::Store, watch: &mut kv::Watch, mut visit: impl FnMut(kv::Entry)) -> Result<(), Error> {
    // Messages are never removed from these streams except by newer revisions, so a
    // stream empty now was empty when the watcher started: it has nothing to replay.
    let info = store.stream.get_info().await.map_err(nats(format!("{}: info", store.name)))?;
    if info.state.messages == 0 {
        return Ok(());
    }
    while let Some(entry) = watch.next().await {
        let entry = entry.map_err(nats(format!("{}: watch", store.name)))?;
        let last = entry.delta == 0;
        visit(entry);
        if last {
            return Ok(());
        }
    }
    Err(Error::LoopEnded("a bucket watch"))
}

/// Whether a `mur_tasks` entry is one the restart replay skips: a delete or purge marker,
/// or a record that has ended. Only the record's `state` is read, so an ended record is
/// looked at and dropped, not held until the replay is over: a store of thousands of ended
/// tasks with long results made a restarting coordinator hold them all at once (390 MiB
/// resident over 300 MB of results; issue #9). A record whose state cannot be read is
/// kept, for [`Ctx::record_of`] to report.
fn ended_or_gone(entry: &kv::Entry) -> bool {
    #[derive(Deserialize)]
    struct StateOnly {
        state: TaskState,
    }
    entry.operation != kv::Operation::Put
        || serde_json::from_slice::<StateOnly>(&entry.value).is_ok_and(|r| r.state.is_terminal())
}

/// How long a pass over every task record (`task.list`, `cluster.status`) may take, its
/// wait for its turn included: a NATS client's request times out at 10 s by default, and no
/// one reads the answer after that. A second less, so that the caller reads why (this
/// error) rather than its own timeout.
const SCAN_PATIENCE: Duration = Duration::from_secs(9);

/// What the leader's two intake shortcuts — admission at submit, and a submission handed
/// straight to the scheduler — wait for (the design, §Invariants 1: arrival order within a
/// lane, the order of the records' creation revisions). A task record created elsewhere (by
/// a standby's API, or by this process's while it restored) reaches the scheduler only
/// through the leader's watch; a later task taking a shortcut before the watch has brought
/// it would start first. Seen in the chaos tests under load: the first of three `queue`
/// tasks submitted while the coordinator restored, the second admitted at once after it,
/// and run first.
#[derive(Debug, Default)]
struct IntakeOrder {
    /// Requests this process's standby context is answering now (a submission among them
    /// may be about to create its record).
    standby_requests: AtomicUsize,
    /// The highest revision a creation by this process's standby context returned.
    standby_created: AtomicU64,
    /// The highest `mur_tasks` revision the leader's watch (or its restore) has handed to
    /// the scheduler.
    watched: AtomicU64,
}

impl IntakeOrder {
    /// Whether the leader may admit a task at submit: every record this process created
    /// as a standby has reached the scheduler, and none is being created. (A standby in
    /// another process is not seen here: `docs/ARCHITECTURE.md`, admission at submit.)
    fn may_admit(&self) -> bool {
        self.standby_requests.load(Ordering::SeqCst) == 0
            && self.standby_created.load(Ordering::SeqCst) <= self.watched.load(Ordering::SeqCst)
    }

    /// Whether a record created at `revision` may go straight to the scheduler: the watch
    /// has handed it every earlier revision, whoever wrote them. Otherwise the watch brings
    /// it, after them.
    fn may_hand_straight(&self, revision: u64) -> bool {
        self.watched.load(Ordering::SeqCst) + 1 >= revision
    }
}

/// Answers `request` in a task of its own with the standby context `ctx`, counted in
/// `intake` until its answer ([`IntakeOrder`]).
fn answer_as_standby(ctx: &Arc<Ctx>, intake: &Arc<IntakeOrder>, kind: Endpoint, request: Request) {
    let (ctx, counted) = (ctx.clone(), StandbyRequest::new(intake));
    tokio::spawn(async move {
        ctx.handle(kind, request).await;
        drop(counted);
    });
}

/// Counts a request the standby context answers, from its arrival until its answer
/// ([`IntakeOrder`]).
struct StandbyRequest(Arc<IntakeOrder>);

impl StandbyRequest {
    fn new(intake: &Arc<IntakeOrder>) -> Self {
        intake.standby_requests.fetch_add(1, Ordering::SeqCst);
        StandbyRequest(intake.clone())
    }
}

impl Drop for StandbyRequest {
    fn drop(&mut self) {
        self.0.standby_requests.fetch_sub(1, Ordering::SeqCst);
    }
}

/// What every endpoint handler shares.
struct Ctx {
    js: jetstream::Context,
    tasks: kv::Store,
    capsule_index: kv::Store,
    inputs: mpsc::UnboundedSender<Input>,
    /// Asks the scheduler to admit a task about to be stored straight into flight
    /// ([`Scheduler::admit`]).
    admissions: mpsc::UnboundedSender<Admission>,
    instance: String,
    /// The lease under which this coordinator leads; `None` for the API's handlers, which
    /// release nothing.
    lease: Option<Arc<Held>>,
    /// The fleet API (`mur.api.fleet.*`).
    fleets: crate::fleets::Fleets,
    /// One pass over every task record at a time, shared by this process's contexts (see
    /// [`Ctx::scan_records`]).
    scans: Arc<tokio::sync::Semaphore>,
    /// What the leader's intake shortcuts wait for, shared by this process's contexts.
    intake: Arc<IntakeOrder>,
    /// The queue flags of the bundles read from the index, shared by this process's contexts.
    bundles: Arc<BundleFlags>,
    /// The last known record and revision of each task waiting here at attempt 0, from
    /// the intake or the watch: a release compare-and-sets from it without reading the
    /// record first (and reads it when the revision has moved on). Entries leave at the
    /// release or when the task ends.
    waiting: Mutex<HashMap<String, (u64, TaskRecord)>>,
    /// Tasks released while this coordinator leads and not ended: the ones it admitted or
    /// released (noted before the record is written) and the ones its restore replayed.
    /// A released record the watch brings that is not here was written by another
    /// coordinator (one that lost its lease, or died, between the write and its dispatch):
    /// the scheduler learns of it, it is noted, and its dispatch is published again
    /// (JetStream drops the copy if it went out). Entries leave when the task ends.
    releasing: Mutex<HashSet<String>>,
    /// [`Config::worker_timeout`] in ms: `cluster.status` marks a worker silent past it.
    worker_timeout_ms: u64,
}

/// The API endpoints.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Endpoint {
    Submit,
    Get,
    List,
    Cancel,
    Capsules,
    Status,
    Fleet(crate::fleets::Op),
}

impl Endpoint {
    const ALL: [Endpoint; 6] =
        [Endpoint::Submit, Endpoint::Get, Endpoint::List, Endpoint::Cancel, Endpoint::Capsules, Endpoint::Status];

    fn subject(self) -> &'static str {
        match self {
            Endpoint::Submit => cluster::api::TASK_SUBMIT,
            Endpoint::Get => cluster::api::TASK_GET,
            Endpoint::List => cluster::api::TASK_LIST,
            Endpoint::Cancel => cluster::api::TASK_CANCEL,
            Endpoint::Capsules => cluster::api::CAPSULE_LIST,
            Endpoint::Status => cluster::api::CLUSTER_STATUS,
            Endpoint::Fleet(op) => op.subject(),
        }
    }
}

/// `task.list`'s optional request body.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ListRequest {
    /// Only tasks in this state.
    #[serde(default)]
    state: Option<TaskState>,
    /// At most this many (the newest), 1 to [`LIST_LIMIT`]; [`LIST_LIMIT`] when absent.
    #[serde(default)]
    limit: Option<usize>,
}

fn unavailable(what: &str, e: impl std::fmt::Display) -> ApiError {
    ApiError::new(ErrorCode::Unavailable, format!("{what}: {e}"))
}

/// A capsule index read that failed: the server's fault is `unavailable`, anything else
/// (a malformed entry) `internal`.
fn index_error(e: mur_nats::bundle::Error) -> ApiError {
    match e {
        mur_nats::bundle::Error::Nats { .. } => unavailable("mur_capsule_index", e),
        other => internal("mur_capsule_index", other),
    }
}

fn internal(what: &str, e: impl std::fmt::Display) -> ApiError {
    ApiError::new(ErrorCode::Internal, format!("{what}: {e}"))
}

fn to_json<T: serde::Serialize>(value: &T) -> Result<Bytes, ApiError> {
    serde_json::to_vec(value).map(Bytes::from).map_err(|e| internal("reply", e))
}

impl Ctx {
    async fn handle(self: &Arc<Self>, kind: Endpoint, request: Request) {
        let body = &request.message.payload;
        let result = match kind {
            Endpoint::Submit => self.submit(request.message.headers.as_ref(), body).await.and_then(|r| to_json(&r)),
            Endpoint::Get => self.get(body).await.and_then(|r| to_json(&r)),
            Endpoint::List => self.list(body).await.and_then(|r| to_json(&r)),
            Endpoint::Cancel => self.cancel(body).await.and_then(|r| to_json(&r)),
            Endpoint::Capsules => self.capsules().await.and_then(|r| to_json(&r)),
            Endpoint::Status => self.status().await.and_then(|r| to_json(&r)),
            Endpoint::Fleet(op) => self.fleets.handle(op, body).await,
        };
        let sent = match result {
            Ok(reply) => request.respond(Ok(reply)).await,
            Err(err) => {
                tracing::debug!(instance = %self.instance, subject = kind.subject(), "refused: {err}");
                let (error, headers) = api::service_error(&err);
                request.respond_with_headers(Err(error), headers).await
            }
        };
        if let Err(e) = sent {
            tracing::warn!(instance = %self.instance, subject = kind.subject(), "reply failed: {e}");
        }
    }

    /// `task.submit`: validates, checks the capsule, creates the record. Its span is a
    /// child of the request's `traceparent` header, and the record keeps the span's own
    /// `traceparent` (issue #7 §Trace context).
    async fn submit(
        self: &Arc<Self>,
        headers: Option<&async_nats::HeaderMap>,
        body: &[u8],
    ) -> Result<SubmitReply, ApiError> {
        let span = tracing::info_span!(
            "submit",
            otel.name = %format!("process {}", cluster::api::TASK_SUBMIT),
            otel.kind = "server",
            messaging.system = "nats",
            messaging.operation.type = "process",
            messaging.destination.name = cluster::api::TASK_SUBMIT,
            mur.task_id = tracing::field::Empty,
        );
        let traceparent = trace_context::join(&span, headers);
        self.create_task(body, traceparent).instrument(span).await
    }

    async fn create_task(self: &Arc<Self>, body: &[u8], traceparent: Option<String>) -> Result<SubmitReply, ApiError> {
        let request = SubmitRequest::parse(body)?;
        request.validate()?;
        let Some(latest) = self.latest_capsule(&request.capsule).await? else {
            return Err(ApiError::new(
                ErrorCode::NotFound,
                format!("capsule: no capsule named {:?} (push it with `mur capsule push`)", request.capsule),
            ));
        };
        self.bundles.learn(&latest);
        // A caller's own id makes a submission sent twice one task (see below).
        let minted_by_caller = request.task_id.is_some();
        let task_id = request.task_id.clone().unwrap_or_else(|| Id::generate(IdKind::Task));
        tracing::Span::current().record("mur.task_id", task_id.as_str());
        let mut record = TaskRecord::submitted(task_id.clone(), request, latest.digest, SystemClock.now_ms());
        record.traceparent = traceparent;
        // Room for the result: a terminal record the server refuses would leave the task
        // `working` until its dispatch dead-letters, and only the result can be clipped.
        record.check_room(self.js.client().server_info().max_payload).map_err(ApiError::invalid)?;
        // A task that would be released at once is stored released (attempt 1) and its
        // dispatch published: one record write and one hop fewer (issue #9). Not one whose
        // id the caller minted: it may be a submission sent again, already stored (and
        // admitted, or running); the scheduler's slot must not be taken for it twice.
        let admitted = !minted_by_caller && self.intake.may_admit() && self.admit(&record, latest.queue).await;
        if admitted {
            record.attempt = scheduler::FIRST_ATTEMPT;
            self.releasing.lock().expect("releasing lock").insert(task_id.to_string());
        }
        let value = to_json(&record)?;
        let created = self.tasks.create(&task_id, value).await;
        if let (None, Ok(revision)) = (&self.lease, &created) {
            self.intake.standby_created.fetch_max(*revision, Ordering::SeqCst);
        }
        let revision = match created {
            Ok(revision) => revision,
            Err(e) if minted_by_caller && e.kind() == kv::CreateErrorKind::AlreadyExists => {
                return self.submitted_before(&record).await;
            }
            Err(e) => {
                if admitted {
                    // Its slot goes back: the task was never stored.
                    self.releasing.lock().expect("releasing lock").remove(task_id.as_str());
                    let _ = self.inputs.send(Input::Ended { task_id: task_id.to_string() });
                }
                return Err(unavailable("mur_tasks: create", e));
            }
        };
        tracing::info!(instance = %self.instance, %task_id, capsule = %record.capsule, lane = %record.lane, admitted, "task submitted");
        if admitted {
            let released = Released { revision, record };
            let ctx = self.clone();
            tokio::spawn(async move { ctx.dispatch_released(released).await });
        } else if self.lease.is_some() && self.intake.may_hand_straight(revision) {
            // Straight to the scheduler, with the queue flag just read: the watch brings the
            // same record later (a duplicate `Submitted`, ignored), after a hop and, for a
            // task it has not seen here, a capsule index read.
            // Only a leader's context has a scheduler (a standby's would note the task in a
            // map nothing ever drains); the leader's watch brings it there either way.
            let input = submitted_input(&record, revision, latest.queue);
            self.note_waiting(revision, record);
            let _ = self.inputs.send(input);
        }
        Ok(SubmitReply { task_id, state: TaskState::Submitted })
    }

    /// The answer to a submission whose caller-minted id is stored already: the earlier
    /// submission of the same task (capsule and text) got through, and its task's state
    /// now is the answer; a record of another task under that id is a `conflict`.
    async fn submitted_before(&self, sent: &TaskRecord) -> Result<SubmitReply, ApiError> {
        let (_, stored) = self.read_task(&sent.task_id).await?;
        if stored.capsule != sent.capsule || stored.text != sent.text {
            return Err(ApiError::new(
                ErrorCode::Conflict,
                format!(
                    "task_id: {} is another task's (capsule {:?}, submitted at {} unix ms); mint a new id",
                    sent.task_id, stored.capsule, stored.submitted_at
                ),
            ));
        }
        tracing::info!(instance = %self.instance, task_id = %sent.task_id, "task submitted again: answered with the stored one");
        Ok(SubmitReply { task_id: stored.task_id, state: stored.state })
    }

    /// Asks the scheduler to admit `record`'s task straight into flight
    /// ([`Scheduler::admit`]). Only a leader's context has a scheduler; a standby's, or a
    /// leader whose actor has stopped, admits nothing.
    async fn admit(&self, record: &TaskRecord, queue_capsule: bool) -> bool {
        if self.lease.is_none() {
            return false;
        }
        let (answer, admitted) = oneshot::channel();
        let asked = Admission {
            task_id: record.task_id.to_string(),
            capsule: record.capsule.clone(),
            lane: record.lane,
            queue_capsule,
            answer,
        };
        self.admissions.send(asked).is_ok() && admitted.await.unwrap_or(false)
    }

    async fn latest_capsule(&self, name: &str) -> Result<Option<CapsuleIndexEntry>, ApiError> {
        mur_nats::bundle::latest(&self.capsule_index, name).await.map_err(index_error)
    }

    /// `task.get`.
    async fn get(&self, body: &[u8]) -> Result<TaskRecord, ApiError> {
        let task_id = task_ref(body)?;
        Ok(self.read_task(&task_id).await?.1)
    }

    async fn read_task(&self, task_id: &str) -> Result<(u64, TaskRecord), ApiError> {
        let entry = self.tasks.entry(task_id).await.map_err(|e| unavailable("mur_tasks: read", e))?;
        let Some(entry) = entry.filter(|e| e.operation == kv::Operation::Put) else {
            return Err(ApiError::new(ErrorCode::NotFound, format!("task: no task {task_id}")));
        };
        let record =
            serde_json::from_slice(&entry.value).map_err(|e| internal(&format!("task record {task_id}"), e))?;
        Ok((entry.revision, record))
    }

    /// Hands `visit` the latest revision of every task record (malformed ones are logged and
    /// skipped: [`Ctx::record_of`]), read in one pass over the bucket's stream
    /// ([`read_current`]). Nothing is held: a store of thousands of long results used to be
    /// read key by key into one `Vec` for every `task.list` and `cluster.status` (3–4 s and
    /// ~1× the store in memory per call at 600–800 MB; past ~2 GB every call ran out of the
    /// caller's 10 s).
    ///
    /// `visit` gets each entry's key and its record (`None`: deleted or malformed). A key
    /// written during the pass comes again, newer: the visitor keeps the last of each key.
    ///
    /// One pass at a time in the process (the restore's included): the others wait their
    /// turn. A pass not over within [`SCAN_PATIENCE`], its wait included, is given up
    /// (`unavailable`): its caller has stopped waiting for the answer.
    async fn scan_records(&self, mut visit: impl FnMut(&str, Option<TaskRecord>)) -> Result<(), ApiError> {
        let pass = async {
            let _turn = self.scans.acquire().await.map_err(|e| ApiError::new(ErrorCode::Unavailable, e.to_string()))?;
            let mut watch = self.tasks.watch_with_history(">").await.map_err(|e| unavailable("mur_tasks: watch", e))?;
            read_current(&self.tasks, &mut watch, |entry| visit(&entry.key, self.record_of(&entry)))
                .await
                .map_err(|e| ApiError::new(ErrorCode::Unavailable, e.to_string()))
        };
        tokio::time::timeout(SCAN_PATIENCE, pass).await.unwrap_or_else(|_| {
            Err(ApiError::new(
                ErrorCode::Unavailable,
                format!(
                    "mur_tasks: the task records were not read within {} s (a large store, or other reads of it \
                     before this one): try again",
                    SCAN_PATIENCE.as_secs()
                ),
            ))
        })
    }

    /// `task.list`: newest first, at most the request's `limit` (1 to [`LIST_LIMIT`],
    /// default [`LIST_LIMIT`]; anything else is refused naming the field), fitted into one
    /// reply ([`page::fit`]: long texts, results and errors clipped, the oldest left out
    /// when they do not fit, and the page says so).
    async fn list(&self, body: &[u8]) -> Result<Page<TaskRecord>, ApiError> {
        let filter: ListRequest = if body.iter().all(u8::is_ascii_whitespace) {
            ListRequest::default()
        } else {
            serde_json::from_slice(body).map_err(|e| ApiError::invalid(format!("request: {e}")))?
        };
        let limit = match filter.limit {
            None => LIST_LIMIT,
            Some(n) if (1..=LIST_LIMIT).contains(&n) => n,
            Some(n) => return Err(ApiError::invalid(format!("limit: must be 1 to {LIST_LIMIT}, got {n}"))),
        };
        // The newest `limit` that match, clipped as they are read (so at most twice `limit`
        // clipped records are held at once), then fitted into one reply.
        let newest_first =
            |a: &TaskRecord, b: &TaskRecord| (b.submitted_at, &b.task_id).cmp(&(a.submitted_at, &a.task_id));
        let mut records: HashMap<String, TaskRecord> = HashMap::new();
        let mut clipped = HashSet::new();
        self.scan_records(|key, record| {
            // The last entry of a key is its state: an earlier one read goes.
            records.remove(key);
            clipped.remove(key);
            let Some(mut r) = record.filter(|r| filter.state.is_none_or(|s| s == r.state)) else { return };
            let fields = [Some(&mut r.text), r.result.as_mut(), r.error.as_mut()];
            if page::clip_fields(fields.into_iter().flatten()) {
                clipped.insert(key.to_string());
            }
            records.insert(key.to_string(), r);
            if records.len() >= 2 * limit {
                let mut newest: Vec<TaskRecord> = records.drain().map(|(_, r)| r).collect();
                newest.sort_by(newest_first);
                newest.truncate(limit);
                records.extend(newest.into_iter().map(|r| (r.task_id.clone(), r)));
            }
        })
        .await?;
        let mut records: Vec<TaskRecord> = records.into_values().collect();
        records.sort_by(newest_first);
        records.truncate(limit);
        let max_payload = self.js.client().server_info().max_payload;
        Ok(page::fit(records, max_payload, |r| clipped.contains(&r.task_id).then(|| r.task_id.clone())))
    }

    /// `task.cancel` (issue #8 §Cancel): a task still waiting in its lane becomes
    /// `canceled` at once and never starts; a released or running one gets
    /// `cancel_requested_at`, and a note on [`cluster::cancel_subject`] tells the worker
    /// running it, which stops it and ends it `canceled` (the worker also finds the flag at
    /// its next progress tick, or when the dispatch reaches it). The answer is the record
    /// after the change. A finished task is a conflict.
    async fn cancel(&self, body: &[u8]) -> Result<TaskRecord, ApiError> {
        let task_id = task_ref(body)?;
        let mut waiting = false;
        let canceled = mur_nats::tasks::try_update(&self.tasks, &task_id, None, |record| {
            waiting = match record.state {
                TaskState::Submitted if record.attempt == 0 => true,
                TaskState::Submitted | TaskState::Working => false,
                state => {
                    return Err(ApiError::new(
                        ErrorCode::Conflict,
                        format!("task {task_id} has already ended ({})", state.as_str()),
                    ));
                }
            };
            if waiting {
                record.state = TaskState::Canceled;
                record.exit_status = Some(ExitStatus::Canceled);
                record.result = Some("canceled".into());
                record.ended_at = Some(SystemClock.now_ms());
            } else if record.cancel_requested_at.is_none() {
                record.cancel_requested_at = Some(SystemClock.now_ms());
            }
            Ok(true)
        })
        .await?;
        let (record, _) = canceled.expect("the change always writes");
        if waiting {
            tracing::info!(instance = %self.instance, %task_id, "task canceled while waiting");
            let _ = self.inputs.send(Input::Canceled { task_id });
        } else {
            tracing::info!(instance = %self.instance, %task_id, "cancel requested of a running task");
            if let Err(e) = self.js.client().publish(cluster::cancel_subject(&task_id), Bytes::new()).await {
                tracing::warn!(%task_id, error = %e, "telling the workers of a cancel failed");
            }
        }
        Ok(record)
    }

    /// `cluster.status`: read from the buckets, so any coordinator answers the same.
    async fn status(&self) -> Result<cluster::ClusterStatus, ApiError> {
        // What the status counts, without the long fields: waiting and in-flight tasks,
        // and dead letters.
        let mut records = HashMap::new();
        self.scan_records(|key, record| {
            // The last entry of a key is its state: an earlier one read goes.
            records.remove(key);
            if let Some(mut r) = record.filter(|r| !r.state.is_terminal() || r.dead_letter.is_some()) {
                r.text = String::new();
                r.result = None;
                r.error = None;
                records.insert(key.to_string(), r);
            }
        })
        .await?;
        let mut records: Vec<TaskRecord> = records.into_values().collect();
        records.sort_by(|a, b| (a.submitted_at, &a.task_id).cmp(&(b.submitted_at, &b.task_id)));
        let workers_kv =
            self.js.get_key_value(cluster::WORKERS_BUCKET).await.map_err(|e| unavailable("mur_workers", e))?;
        let keys: Vec<String> = workers_kv
            .keys()
            .await
            .map_err(|e| unavailable("mur_workers: keys", e))?
            .try_collect()
            .await
            .map_err(|e| unavailable("mur_workers: keys", e))?;
        let mut workers = Vec::new();
        for key in keys {
            if let Some(v) = workers_kv.get(&key).await.map_err(|e| unavailable("mur_workers: read", e))?
                && let Ok(w) = serde_json::from_slice::<WorkerInfo>(&v)
            {
                workers.push(w);
            }
        }
        let leader_kv =
            self.js.get_key_value(cluster::LEADER_BUCKET).await.map_err(|e| unavailable("mur_leader", e))?;
        let leader = Lease::holder(&leader_kv).await.map_err(|e| unavailable("mur_leader: read", e))?;
        let standbys =
            Lease::standbys(&leader_kv, leader.as_ref()).await.map_err(|e| unavailable("mur_leader: standbys", e))?;
        let fanout_kv =
            self.js.get_key_value(mur_proto::fanout::FANOUT_BUCKET).await.map_err(|e| unavailable("mur_fanout", e))?;
        let fanout = mur_nats::fanout::status(&fanout_kv).await.map_err(|e| unavailable("mur_fanout: read", e))?;
        Ok(cluster::ClusterStatus {
            fanout,
            standbys,
            ..cluster::ClusterStatus::build(&records, &workers, leader, SystemClock.now_ms(), self.worker_timeout_ms)
        })
    }

    /// `capsule.list`.
    async fn capsules(&self) -> Result<Vec<CapsuleEntry>, ApiError> {
        mur_nats::bundle::list(&self.capsule_index).await.map_err(index_error)
    }

    /// Parses a task record entry, logging a malformed one.
    fn record_of(&self, entry: &kv::Entry) -> Option<TaskRecord> {
        if entry.operation != kv::Operation::Put {
            return None;
        }
        serde_json::from_slice(&entry.value)
            .inspect_err(|e| {
                tracing::warn!(instance = %self.instance, key = %entry.key, "skipping a malformed task record: {e}");
            })
            .ok()
    }

    /// Notes a task waiting at attempt 0 at `revision`; returns whether it was already
    /// noted (its `Submitted` input was sent).
    fn note_waiting(&self, revision: u64, record: TaskRecord) -> bool {
        let mut waiting = self.waiting.lock().expect("waiting lock");
        let known = waiting.contains_key(&record.task_id);
        waiting.insert(record.task_id.clone(), (revision, record));
        known
    }

    /// Takes a waiting task's record out (released, or ended while waiting).
    fn take_waiting(&self, task_id: &str) -> Option<(u64, TaskRecord)> {
        self.waiting.lock().expect("waiting lock").remove(task_id)
    }

    async fn carry_out(&self, output: Output) {
        match output {
            Output::Release { task_id, .. } => self.release(&task_id).await,
            Output::Ignored(why) => tracing::debug!(instance = %self.instance, "scheduler: {why}"),
        }
    }

    /// Releases a task: attempt 0 → 1 on its record, then its dispatch. Each step's NATS
    /// failure (a broker restart) is retried on its own ([`Ctx::retrying`]) while this
    /// coordinator holds a valid lease (after that the next leader releases the task from
    /// its record): a record written released always gets its dispatch, so a task the
    /// scheduler released is never left waiting for a coordinator restart. Releases run
    /// concurrently, so the retries hold up no other.
    async fn release(&self, task_id: &str) {
        if let Some(released) = self.retrying(task_id, || self.mark_released(task_id)).await.flatten() {
            self.dispatch_released(released).await;
        }
    }

    /// Runs `step` until it succeeds, retrying an error after a backoff of 0.1 s doubling
    /// to 2 s; `None` once this coordinator may no longer release (checked before each
    /// try).
    async fn retrying<T, F: Future<Output = Result<T, String>>>(
        &self,
        task_id: &str,
        mut step: impl FnMut() -> F,
    ) -> Option<T> {
        let mut backoff = Duration::from_millis(100);
        while self.may_release(task_id) {
            match step().await {
                Ok(value) => return Some(value),
                Err(e) => {
                    tracing::warn!(instance = %self.instance, %task_id, "release failed, retrying: {e}");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                }
            }
        }
        None
    }

    /// Whether this coordinator may release tasks: it leads under a lease still valid.
    /// Fencing: a leader whose lease may have passed to another releases nothing; the next
    /// leader releases the task from its record.
    fn may_release(&self, task_id: &str) -> bool {
        let valid = self.lease.as_ref().is_some_and(|l| l.is_valid());
        if !valid {
            tracing::warn!(instance = %self.instance, %task_id, "not releasing: not holding a valid lease");
        }
        valid
    }

    /// Publishes the dispatch of a task whose record is stored released (admitted at
    /// submit, released by [`Ctx::release`], or found released by another coordinator),
    /// retrying a NATS failure ([`Ctx::retrying`]). The record and its revision go along:
    /// the worker starts from them without reading the record (issue #9).
    async fn dispatch_released(&self, released: Released) {
        let task_id = released.record.task_id.to_string();
        let traceparent = released.record.traceparent.clone();
        let dispatch =
            Dispatch { task_id: task_id.clone(), attempt: released.record.attempt, released: Some(released) };
        if self.retrying(&task_id, || self.publish(&dispatch, traceparent.as_deref())).await.is_some() {
            tracing::info!(instance = %self.instance, %task_id, attempt = dispatch.attempt, "task released");
        }
    }

    /// Compare-and-sets the record from `submitted`/attempt 0 to attempt 1 and returns it
    /// with its new revision; `None` when the record moved on (cancelled meanwhile, or
    /// released by another coordinator).
    async fn mark_released(&self, task_id: &str) -> Result<Option<Released>, String> {
        let mut noted = self.take_waiting(task_id);
        loop {
            let (revision, mut record) = match noted.take() {
                Some(known) => known,
                None => self.read_task(task_id).await.map_err(|e| e.to_string())?,
            };
            if record.state != TaskState::Submitted || record.attempt != 0 {
                tracing::debug!(instance = %self.instance, %task_id, state = record.state.as_str(), attempt = record.attempt, "not releasing: the record moved on");
                if record.state.is_terminal() {
                    // Ended before its release (cancelled): its slot goes back now, whether or
                    // not the watch brings the end (a repeated end is ignored).
                    let _ = self.inputs.send(Input::Ended { task_id: task_id.to_string() });
                }
                return Ok(None);
            }
            record.attempt = 1;
            let value = to_json(&record).map_err(|e| e.to_string())?;
            self.releasing.lock().expect("releasing lock").insert(task_id.to_string());
            let written = self.tasks.update(task_id, value, revision).await;
            if written.is_err() {
                self.releasing.lock().expect("releasing lock").remove(task_id);
            }
            match written {
                Ok(revision) => return Ok(Some(Released { revision, record })),
                Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => continue,
                Err(e) => return Err(format!("mur_tasks: update: {e}")),
            }
        }
    }

    /// Publishes a dispatch with its message id and waits for the stream's ack. Its
    /// `traceparent` header names a `send` span under the task's (issue #7 §Trace context),
    /// or is the task's own when this process exports no spans.
    async fn publish(&self, dispatch: &Dispatch, traceparent: Option<&str>) -> Result<(), String> {
        let payload = serde_json::to_vec(dispatch).map_err(|e| e.to_string())?;
        // The span ends when the ack is in.
        let (_send, headers) = trace_context::producer(cluster::DISPATCH_SUBJECT, traceparent);
        let message = PublishMessage::build().payload(payload.into()).message_id(dispatch.msg_id()).headers(headers);
        let ack = self
            .js
            .send_publish(cluster::DISPATCH_SUBJECT, message)
            .await
            .map_err(|e| format!("{}: publish: {e}", cluster::DISPATCH_STREAM))?;
        ack.await.map_err(|e| format!("{}: publish ack: {e}", cluster::DISPATCH_STREAM))?;
        Ok(())
    }
}

/// The task id named by a `task.get` / `task.cancel` body: a [`TaskRef`] JSON object, or
/// the bare id.
fn task_ref(body: &[u8]) -> Result<String, ApiError> {
    let text = std::str::from_utf8(body)
        .map_err(|e| ApiError::invalid(format!("request: invalid UTF-8 at byte {}", e.valid_up_to())))?
        .trim();
    let task_id = if text.starts_with('{') {
        serde_json::from_str::<TaskRef>(text).map_err(|e| ApiError::invalid(format!("request: {e}")))?.task_id
    } else {
        text.to_string()
    };
    if task_id.is_empty() {
        return Err(ApiError::invalid("task_id: required"));
    }
    if !Id::is_valid(IdKind::Task, &task_id) {
        return Err(ApiError::invalid(format!("task_id: must be a tsk_ id, got {task_id:?}")));
    }
    Ok(task_id)
}

/// The `Submitted` input of a record.
fn submitted_input(record: &TaskRecord, revision: u64, queue_capsule: bool) -> Input {
    Input::Submitted {
        task_id: record.task_id.clone(),
        capsule: record.capsule.clone(),
        lane: record.lane,
        queue_capsule,
        seq: revision,
    }
}

/// What a record says beyond `Submitted`: released, started or ended.
fn progress_input(record: &TaskRecord) -> Option<Input> {
    let task_id = record.task_id.clone();
    match record.state {
        TaskState::Submitted if record.attempt == 0 => None,
        TaskState::Submitted => Some(Input::Released { task_id }),
        TaskState::Working => match &record.worker {
            Some(worker_id) => Some(Input::Started { task_id, worker_id: worker_id.clone() }),
            None => Some(Input::Released { task_id }),
        },
        _ => Some(Input::Ended { task_id }),
    }
}

/// Whether each capsule is a `queue` capsule, read from the index when first needed and
/// again for each new task whose bundle is not in [`BundleFlags`] (a push may change it).
#[derive(Default)]
struct QueueFlags {
    known: HashMap<String, bool>,
}

impl QueueFlags {
    /// The queue flag of the bundle `record` runs: from `bundles` when its digest is known
    /// there, else from the capsule's index entry (learned into `bundles` when the entry is
    /// that bundle's); the last flag read for the capsule when the index cannot be read.
    async fn get(&mut self, index: &kv::Store, bundles: &BundleFlags, record: &TaskRecord) -> bool {
        if let Some(queue) = bundles.get(&record.capsule_digest) {
            return queue;
        }
        let capsule = record.capsule.as_str();
        match index.get(capsule).await {
            Ok(Some(value)) => {
                let entry = serde_json::from_slice::<CapsuleIndexEntry>(&value).ok();
                if let Some(entry) = entry.as_ref().filter(|e| e.digest == record.capsule_digest) {
                    bundles.learn(entry);
                } else if let Some(queue) = Self::from_history(index, bundles, record).await {
                    // Pushed over since the task was submitted (a restarted coordinator
                    // remembers no bundles): its own bundle's flag, from the index's history.
                    return queue;
                }
                let queue = entry.is_some_and(|e| e.queue);
                self.known.insert(capsule.to_string(), queue);
                queue
            }
            Ok(None) => false,
            // Keep the last answer when the index cannot be read now.
            Err(e) => {
                tracing::warn!(capsule, "capsule index unreadable, using the last known queue flag: {e}");
                self.known.get(capsule).copied().unwrap_or(false)
            }
        }
    }

    /// The flag of `record`'s bundle from the index's history of its capsule (the pushes
    /// it keeps, `mur_capsule_index`'s history setting), learned into `bundles`; `None`
    /// when the history no longer holds that bundle or cannot be read.
    async fn from_history(index: &kv::Store, bundles: &BundleFlags, record: &TaskRecord) -> Option<bool> {
        let pushes = mur_nats::bundle::history(index, &record.capsule).await.ok()?;
        let entry = pushes.iter().find(|e| e.digest == record.capsule_digest)?;
        bundles.learn(entry);
        Some(entry.queue)
    }
}

/// What the contexts of one coordinator process share: the API's and each term's leader's.
#[derive(Clone)]
struct ProcessShared {
    scans: Arc<tokio::sync::Semaphore>,
    intake: Arc<IntakeOrder>,
    bundles: Arc<BundleFlags>,
}

/// The queue flag (`lifecycle.task_acceptance: queue`) of each capsule bundle this process
/// has read from the index, by bundle digest, shared by its contexts. A digest is the
/// SHA-256 of one bundle's bytes, manifest included (`mur_worker::bundle`), so its flag
/// never changes: a task whose bundle is known here is put to the scheduler without a
/// capsule index read (issue #9: the submit's read serves the watch too). Holds at most
/// [`BundleFlags::KEPT`] digests; past that it starts over.
#[derive(Default)]
pub(crate) struct BundleFlags(Mutex<HashMap<String, bool>>);

impl BundleFlags {
    /// How many digests are kept at most.
    const KEPT: usize = 4096;

    /// Notes the flag of the bundle `entry` names.
    fn learn(&self, entry: &CapsuleIndexEntry) {
        let mut flags = self.0.lock().expect("bundle flags lock");
        // Known already (every submit learns its bundle): nothing to copy.
        if flags.get(&entry.digest) == Some(&entry.queue) {
            return;
        }
        if flags.len() >= Self::KEPT && !flags.contains_key(&entry.digest) {
            flags.clear();
        }
        flags.insert(entry.digest.clone(), entry.queue);
    }

    /// The flag of bundle `digest`, if it is known here.
    fn get(&self, digest: &str) -> Option<bool> {
        self.0.lock().expect("bundle flags lock").get(digest).copied()
    }
}

/// The one owner of the scheduler. Inputs are applied one at a time, in order; the
/// releases they produce are carried out concurrently, so that one release's round trips
/// (compare-and-set, publish and its ack) hold up neither the next input nor the next
/// release. Every release was decided by the scheduler, which already counted its slot,
/// so their order of completion changes no decision.
async fn actor(
    ctx: Arc<Ctx>,
    mut scheduler: Scheduler,
    mut inputs: mpsc::UnboundedReceiver<Input>,
    mut admissions: mpsc::UnboundedReceiver<Admission>,
    mut stopped: watch::Receiver<bool>,
) -> &'static str {
    let mut releases = JoinSet::new();
    let mut gauges = crate::gauges::Refresh::new(&ctx.js, &ctx.tasks);
    loop {
        while releases.try_join_next().is_some() {}
        tokio::select! {
            _ = stopped.changed() => break,
            _ = gauges.tick() => gauges.publish(&scheduler),
            asked = admissions.recv() => {
                let Some(a) = asked else { break };
                let admitted = scheduler.admit(&a.task_id, &a.capsule, a.lane, a.queue_capsule);
                if a.answer.send(admitted).is_err() && admitted {
                    // The intake gave up before the record was written: the slot goes back.
                    let _ = ctx.inputs.send(Input::Ended { task_id: a.task_id });
                }
            }
            input = inputs.recv() => {
                let Some(input) = input else { break };
                tracing::trace!(instance = %ctx.instance, ?input, "scheduler input");
                for output in scheduler.apply(input) {
                    match output {
                        Output::Release { .. } => {
                            let ctx = ctx.clone();
                            releases.spawn(async move { ctx.carry_out(output).await });
                        }
                        Output::Ignored(_) => ctx.carry_out(output).await,
                    }
                }
            }
        }
    }
    // Releases under way finish: each has compare-and-set its record already, or will.
    while releases.join_next().await.is_some() {}
    "the scheduler"
}

/// A request to [`Scheduler::admit`] a task about to be stored, answered on `answer`.
struct Admission {
    task_id: String,
    capsule: String,
    lane: mur_proto::Lane,
    queue_capsule: bool,
    answer: oneshot::Sender<bool>,
}

/// Feeds every change of `mur_tasks` to the scheduler.
async fn watch_tasks(
    ctx: Arc<Ctx>,
    mut watch: kv::Watch,
    mut queue_flags: QueueFlags,
    mut stopped: watch::Receiver<bool>,
) -> &'static str {
    'watch: loop {
        let entry = tokio::select! {
            _ = stopped.changed() => break 'watch,
            entry = watch.next() => entry,
        };
        let entry = match entry {
            Some(Ok(entry)) => entry,
            Some(Err(e)) => {
                tracing::warn!(instance = %ctx.instance, "mur_tasks watch: {e}");
                continue;
            }
            None => break 'watch,
        };
        let revision = entry.revision;
        'entry: {
            if entry.operation != kv::Operation::Put {
                // A task record deleted by hand: it will not run here.
                ctx.releasing.lock().expect("releasing lock").remove(entry.key.as_str());
                let _ = ctx.inputs.send(Input::Ended { task_id: entry.key.clone() });
                break 'entry;
            }
            let Some(record) = ctx.record_of(&entry) else { break 'entry };
            let input = match progress_input(&record) {
                None => {
                    if ctx.note_waiting(entry.revision, record.clone()) {
                        // Taken in here: the intake gave its input to the scheduler already.
                        break 'entry;
                    }
                    let queue_capsule = queue_flags.get(&ctx.capsule_index, &ctx.bundles, &record).await;
                    submitted_input(&record, entry.revision, queue_capsule)
                }
                Some(input) => {
                    if record.state.is_terminal() {
                        ctx.take_waiting(&record.task_id);
                    }
                    let released = record.state == TaskState::Submitted && record.attempt >= 1;
                    let foreign = if record.state.is_terminal() {
                        ctx.releasing.lock().expect("releasing lock").remove(record.task_id.as_str());
                        false
                    } else {
                        released && ctx.releasing.lock().expect("releasing lock").insert(record.task_id.clone())
                    };
                    if foreign {
                        // Released by another coordinator: wait-then-release here (a duplicate
                        // `Submitted` for a task known here is ignored), and its dispatch again.
                        tracing::info!(instance = %ctx.instance, task_id = %record.task_id, "a task released by another coordinator: dispatching it again");
                        let queue_capsule = queue_flags.get(&ctx.capsule_index, &ctx.bundles, &record).await;
                        if ctx.inputs.send(submitted_input(&record, entry.revision, queue_capsule)).is_err() {
                            break 'watch;
                        }
                        let (ctx, released) = (ctx.clone(), Released { revision: entry.revision, record });
                        tokio::spawn(async move { ctx.dispatch_released(released).await });
                    }
                    input
                }
            };
            if ctx.inputs.send(input).is_err() {
                break 'watch;
            }
        }
        // Every input of revisions up to here is in the scheduler's channel: a submission
        // created after it may go there straight ([`IntakeOrder`]).
        ctx.intake.watched.fetch_max(revision, Ordering::SeqCst);
    }
    "the mur_tasks watch"
}

/// Live workers as the heartbeats in `mur_workers` show them.
struct Workers {
    timeout_ms: u64,
    /// Live workers: slots and last heartbeat.
    live: HashMap<String, (u32, u64)>,
}

impl Workers {
    fn new(timeout: Duration) -> Workers {
        Workers { timeout_ms: millis(timeout), live: HashMap::new() }
    }

    /// The input a change of a worker's key means, if any.
    fn observe(&mut self, entry: &kv::Entry, now: u64) -> Option<Input> {
        let worker_id = entry.key.clone();
        if entry.operation != kv::Operation::Put {
            return self.live.remove(&worker_id).map(|_| Input::WorkerGone { worker_id });
        }
        let info = match serde_json::from_slice::<WorkerInfo>(&entry.value) {
            Ok(info) => info,
            Err(e) => {
                tracing::warn!(worker_id, "skipping a malformed worker registration: {e}");
                return None;
            }
        };
        if cluster::heartbeat_expired(info.heartbeat_at, now, self.timeout_ms) {
            return self.live.remove(&worker_id).map(|_| Input::WorkerGone { worker_id });
        }
        match self.live.insert(worker_id.clone(), (info.slots, info.heartbeat_at)) {
            Some((slots, _)) if slots == info.slots => None,
            _ => Some(Input::WorkerUp { worker_id, slots: info.slots }),
        }
    }

    /// The workers whose heartbeat is too old at `now`.
    fn expire(&mut self, now: u64) -> Vec<Input> {
        let timeout = self.timeout_ms;
        let mut gone: Vec<String> = self
            .live
            .iter()
            .filter(|(_, (_, beat))| cluster::heartbeat_expired(*beat, now, timeout))
            .map(|(id, _)| id.clone())
            .collect();
        gone.sort();
        gone.into_iter()
            .map(|worker_id| {
                self.live.remove(&worker_id);
                Input::WorkerGone { worker_id }
            })
            .collect()
    }
}

/// Feeds worker arrivals and departures to the scheduler.
async fn watch_workers(
    ctx: Arc<Ctx>,
    mut watch: kv::Watch,
    mut workers: Workers,
    mut stopped: watch::Receiver<bool>,
) -> &'static str {
    let mut tick = tokio::time::interval(HEARTBEAT_CHECK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let inputs = tokio::select! {
            _ = stopped.changed() => break,
            _ = tick.tick() => workers.expire(SystemClock.now_ms()),
            entry = watch.next() => match entry {
                Some(Ok(entry)) => workers.observe(&entry, SystemClock.now_ms()).into_iter().collect(),
                Some(Err(e)) => {
                    tracing::warn!(instance = %ctx.instance, "mur_workers watch: {e}");
                    Vec::new()
                }
                None => break,
            },
        };
        for input in inputs {
            tracing::info!(instance = %ctx.instance, ?input, "worker change");
            if ctx.inputs.send(input).is_err() {
                return "the mur_workers watch";
            }
        }
    }
    "the mur_workers watch"
}

/// `d` in whole milliseconds (saturating).
fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::{BundleFlags, IntakeOrder, Latest, StandbyRequest, restore_retry_pause};
    use mur_proto::cluster::CapsuleIndexEntry;
    use std::sync::Arc;
    use std::sync::atomic::Ordering;
    use std::time::Duration;

    #[test]
    fn the_leader_admits_at_submit_only_once_its_watch_has_brought_every_standby_submission() {
        let intake = Arc::new(IntakeOrder::default());
        intake.watched.store(10, Ordering::SeqCst);
        assert!(intake.may_admit());
        let answering = StandbyRequest::new(&intake);
        assert!(!intake.may_admit(), "a standby request may be about to create a record");
        intake.standby_created.fetch_max(12, Ordering::SeqCst);
        drop(answering);
        assert!(!intake.may_admit(), "revision 12 has not reached the scheduler");
        intake.watched.fetch_max(11, Ordering::SeqCst);
        assert!(!intake.may_admit());
        intake.watched.fetch_max(12, Ordering::SeqCst);
        assert!(intake.may_admit());
    }

    fn entry(digest: &str, queue: bool) -> CapsuleIndexEntry {
        CapsuleIndexEntry { digest: digest.into(), version: "1.0.0".into(), pushed_at: 0, bytes: 1, queue, model: None }
    }

    #[test]
    fn a_bundles_queue_flag_is_known_by_its_digest_and_the_memory_starts_over_past_its_bound() {
        let bundles = BundleFlags::default();
        assert_eq!(bundles.get("aa"), None);
        bundles.learn(&entry("aa", true));
        bundles.learn(&entry("bb", false));
        assert_eq!((bundles.get("aa"), bundles.get("bb")), (Some(true), Some(false)));
        for i in 2..BundleFlags::KEPT {
            bundles.learn(&entry(&format!("{i:064x}"), false));
        }
        assert_eq!(bundles.get("aa"), Some(true), "{} digests fit", BundleFlags::KEPT);
        bundles.learn(&entry("aa", true));
        assert_eq!(bundles.get("bb"), Some(false), "learning a known digest again forgets nothing");
        bundles.learn(&entry("cc", true));
        assert_eq!((bundles.get("aa"), bundles.get("cc")), (None, Some(true)), "one more starts over");
    }

    #[test]
    fn a_submission_goes_straight_to_the_scheduler_only_after_every_earlier_revision() {
        let intake = IntakeOrder::default();
        intake.watched.store(10, Ordering::SeqCst);
        assert!(intake.may_hand_straight(11));
        assert!(!intake.may_hand_straight(12), "revision 11 may be another coordinator's submission");
        assert!(intake.may_hand_straight(5));
    }

    #[test]
    fn a_failed_restore_is_retried_after_the_renewal_interval_doubling_up_to_30_s() {
        let renew = Duration::from_millis(3333);
        let pauses: Vec<u128> = (1..=7).map(|n| restore_retry_pause(renew, n).as_millis()).collect();
        assert_eq!(pauses, [3333, 6666, 13332, 26664, 30000, 30000, 30000]);
        assert_eq!(restore_retry_pause(renew, u32::MAX), Duration::from_secs(30));
        // A lease so long that its renewal interval is over 30 s: never sooner than it.
        assert_eq!(restore_retry_pause(Duration::from_secs(40), 3), Duration::from_secs(40));
    }

    #[test]
    fn a_key_written_during_a_pass_is_what_its_last_entry_says() {
        let mut latest = Latest::default();
        // a: submitted, then cancelled during the pass (an ended entry is not kept);
        // b: untouched; c: written twice; d: deleted, then created again.
        for (key, revision, item) in [
            ("a", 1, Some("a submitted")),
            ("b", 2, Some("b submitted")),
            ("c", 3, Some("c submitted")),
            ("d", 4, None),
            ("a", 5, None),
            ("c", 6, Some("c released")),
            ("d", 7, Some("d submitted")),
        ] {
            latest.read(key.to_string(), revision, item);
        }
        assert_eq!(latest.into_sorted(), ["b submitted", "c released", "d submitted"]);
    }
}
