//! The coordinator's NATS adapter: it serves the `mur` micro service (task intake, task and
//! capsule queries), turns the `mur_tasks` and `mur_workers` buckets into [`Input`]s for
//! the [`Scheduler`], and carries out every [`Output::Release`] (the design, §A task's way
//! through the cluster, steps 1–3).
//!
//! Layout of [`run`]:
//! 1. [`resources::ensure`], then one watch per bucket ([`mur_nats::read::watch`] of `">"`: the
//!    last revision of every key, then every change; [`mur_nats::read::watch_changes`] would give only the
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
//!   `Submitted` then `Released`; the scheduler, which had it waiting, answers
//!   [`Output::Republish`] and its dispatch is published again (same message id).
//!   At a restart it is replayed after its `Submitted`
//!   (whose `seq` is then the latest revision: only in-flight ordering in snapshots uses
//!   it), and, the same way, its dispatch is published again with the same message id: if the previous
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
//!
//! The files: this one (config, errors, the shared [`Ctx`]), `leadership` ([`run`]: standby
//! and leader terms under the lease), `replay` (the restore at a term's start), `endpoints`
//! (the API), `release` (the actor and each release), `watchers` (the bucket watches).

use crate::lease::{Held, Lease};
use crate::resources::{self, Resources, Settings};
use crate::scheduler::{self, Input, Output, Scheduler};
use async_nats::jetstream::{self, kv, message::PublishMessage};
use async_nats::service::{Request, ServiceExt};
use bytes::Bytes;
use futures::StreamExt;
use mur_nats::api;
use mur_nats::clock::{Clock, SystemClock};
use mur_nats::trace_context;
use mur_proto::cluster::{
    self, ApiError, CapsuleEntry, CapsuleIndexEntry, Dispatch, ErrorCode, Released, SubmitReply, SubmitRequest,
    TaskRecord, TaskRef, WorkerInfo,
};
use mur_proto::page::{self, Page};
use mur_proto::task::TaskState;
use mur_proto::{ExitStatus, Id, IdKind, TaskId};
use serde::Deserialize;
use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinSet;
use tracing::Instrument;

mod endpoints;
mod leadership;
mod release;
mod replay;
mod watchers;

pub use endpoints::ListCursor;
pub(crate) use endpoints::ListRequest;
use endpoints::*;
use leadership::*;
pub use leadership::{run, run_with_identity};
use release::*;
use replay::*;
use watchers::*;

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
    pub fleet: crate::fleet::cost::FleetSettings,
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
            fleet: crate::fleet::cost::FleetSettings::default(),
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
    fleets: crate::fleet::api::Fleets,
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
    waiting: Mutex<HashMap<TaskId, (u64, TaskRecord)>>,
    /// Tasks released while this coordinator leads and not ended: the ones it admitted or
    /// released (noted before the record is written) and the ones its restore replayed.
    /// A released record the watch brings that is not here was written by another
    /// coordinator (one that lost its lease, or died, between the write and its dispatch):
    /// the scheduler learns of it, it is noted, and its dispatch is published again
    /// (JetStream drops the copy if it went out). Entries leave when the task ends.
    releasing: Mutex<HashSet<TaskId>>,
    /// [`Config::worker_timeout`] in ms: `cluster.status` marks a worker silent past it.
    worker_timeout_ms: u64,
    /// Woken each time the watch of `mur_tasks` brings a terminal record: a fleet run
    /// waiting for its step reads the record then, not at its next poll.
    task_ended: Arc<tokio::sync::Notify>,
    /// Which nkey user is which name, when this coordinator serves the endpoints that
    /// record a name on an identity connection ([`Identity`]).
    identities: Option<Arc<mur_nats::identity::Identities>>,
}

/// The identity connection: a connection in the account `MUR_ID` (`mur auth init`'s
/// `identity.creds`) on which the coordinator serves [`mur_nats::identity::IDENTITY_SUBJECTS`],
/// so that nats-server states who sent each such request, and which public key is which name.
pub struct Identity {
    /// The connection, authenticated as the identity user.
    pub client: async_nats::Client,
    /// The names of the nkey users.
    pub names: mur_nats::identity::Identities,
}

/// What the contexts of one coordinator process share: the API's and each term's leader's.
#[derive(Clone)]
struct ProcessShared {
    identities: Option<Arc<mur_nats::identity::Identities>>,
    scans: Arc<tokio::sync::Semaphore>,
    intake: Arc<IntakeOrder>,
    bundles: Arc<BundleFlags>,
}

impl Ctx {
    /// A context of this process over `res`, sharing `shared`: the API's (no lease; its
    /// `inputs` and `admissions` lead nowhere) or a term's leader's (`lease` held).
    fn new(
        js: &jetstream::Context,
        res: &Resources,
        config: &Config,
        shared: &ProcessShared,
        inputs: mpsc::UnboundedSender<Input>,
        admissions: mpsc::UnboundedSender<Admission>,
        lease: Option<Arc<Held>>,
    ) -> Ctx {
        Ctx {
            js: js.clone(),
            tasks: res.tasks.clone(),
            capsule_index: res.capsule_index.clone(),
            inputs,
            admissions,
            instance: config.instance.clone(),
            lease,
            fleets: crate::fleet::api::Fleets::new(js.clone(), res, config.instance.clone()),
            waiting: Mutex::default(),
            releasing: Mutex::default(),
            worker_timeout_ms: millis(config.worker_timeout),
            scans: shared.scans.clone(),
            intake: shared.intake.clone(),
            bundles: shared.bundles.clone(),
            task_ended: Arc::default(),
            identities: shared.identities.clone(),
        }
    }
}

/// `d` in whole milliseconds (saturating).
fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}
