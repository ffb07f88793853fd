//! The JetStream resources the cluster needs, created or updated at coordinator start.
//!
//! [`ensure`] is idempotent: for each stream, key-value bucket, object store and durable
//! consumer it creates what is missing, updates what differs from [`Settings`], and then
//! reads the resource back to check that the server kept the settings asked for (a server
//! may silently clamp or ignore a field). Running it twice changes nothing the second
//! time; two coordinators running it at once converge on the same settings.
//!
//! Names come from [`mur_proto::cluster`]. Key-value buckets and object stores are
//! JetStream streams underneath (`KV_<bucket>`, `OBJ_<bucket>`); their stream settings are
//! built here the way async-nats 0.51 builds them (`kv_to_stream_config`,
//! `create_object_store`), so one create-compare-update path serves every resource and
//! the handles come back through `get_key_value` / `get_object_store`
//! (the JetStream patterns reference, §1.3–1.5).

use async_nats::jetstream::consumer::{self, AckPolicy, DeliverPolicy, PullConsumer};
use async_nats::jetstream::context::{ConsumerInfoErrorKind, GetStreamErrorKind};
use async_nats::jetstream::stream::{self, DiscardPolicy, RetentionPolicy, StorageType};
use async_nats::jetstream::{self, ErrorCode, kv, object_store};
use mur_proto::{cluster, fanout, fleet_store};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::time::Duration;

/// How the cluster's streams and buckets are set up. Every field has a default, so an
/// empty YAML mapping is valid; unknown keys are refused.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Settings {
    /// Seconds a worker may go without acking or signalling progress on a dispatch before
    /// JetStream redelivers it to another worker. Default 30. Workers send a progress
    /// signal every third of it while a task runs.
    pub ack_wait_secs: u64,
    /// Deliveries of one dispatch before JetStream gives up on it (a poison task).
    /// Default 5.
    pub max_deliver: u32,
    /// Dispatches delivered to workers and not yet acked, cluster-wide, before JetStream
    /// delivers no more. Default 10000 (far above any slot count: the coordinator, not this
    /// cap, decides how many tasks run).
    pub max_ack_pending: u32,
    /// Where JetStream keeps the data: `file` (default; survives a server restart) or
    /// `memory` (fast, lost on restart: tests and demos).
    pub storage: Storage,
    /// Copies of each stream in a JetStream cluster, 1–5. Default 1 (a single server).
    pub replicas: u8,
    /// Seconds a trace event is kept in `MUR_TRACE`; 0 keeps it until `trace_max_bytes`
    /// pushes it out. Default 604800 (7 days).
    pub trace_max_age_secs: u64,
    /// Bytes `MUR_TRACE` may hold before its oldest events go; absent means no limit.
    /// Default absent.
    pub trace_max_bytes: Option<u64>,
    /// Seconds within which a dispatch published twice with the same message id is stored
    /// once. Default 120.
    pub duplicate_window_secs: u64,
    /// Revisions kept per task record in `mur_tasks`, 1–64. Default 5.
    pub task_history: u8,
    /// Revisions kept per capsule in `mur_capsule_index`, 1–64: how many earlier pushes
    /// `mur capsule ls` can still name. Default 64.
    pub capsule_history: u8,
    /// Seconds the leading coordinator's lease in `mur_leader` lives without a renewal
    /// (the bucket's max age): how long the cluster may go without a leader after the
    /// leader dies before a standby takes over (issue #8 §Standby coordinators). At
    /// least 2. Default 10.
    pub leader_lease_secs: u64,
    /// Seconds a fan-out permit (or a step's place in line for one) in `mur_fanout` lives
    /// without a renewal (the bucket's max age): how soon a crashed step's permit comes
    /// back (issue #11 §The fan-out cap; the design's invariant 5). Holders renew every third
    /// of it. At least 2. Default 15.
    pub fanout_lease_secs: u64,
    /// Seconds a worker's registration stays in `mur_workers` after its last heartbeat
    /// (the bucket's max age): `mur cluster status` lists a worker that stopped without
    /// deregistering (killed, its machine gone) as silent until then, and forgets it
    /// after. 30 ([`DEFAULT_WORKER_TIMEOUT`] with room) to [`MAX_SILENT_WORKER_SECS`].
    /// Default 3600.
    ///
    /// [`DEFAULT_WORKER_TIMEOUT`]: crate::service::DEFAULT_WORKER_TIMEOUT
    pub silent_worker_secs: u64,
}

/// The most `silent_worker_secs` may be: one year (the server keeps no longer max age
/// exactly; a refused value must leave the bucket as it was).
pub const MAX_SILENT_WORKER_SECS: u64 = 365 * 24 * 3600;

impl Default for Settings {
    fn default() -> Self {
        Settings {
            ack_wait_secs: 30,
            max_deliver: 5,
            max_ack_pending: 10_000,
            storage: Storage::File,
            replicas: 1,
            trace_max_age_secs: 7 * 24 * 3600,
            trace_max_bytes: None,
            duplicate_window_secs: 120,
            task_history: 5,
            capsule_history: 64,
            leader_lease_secs: 10,
            fanout_lease_secs: 15,
            silent_worker_secs: 3600,
        }
    }
}

/// JetStream storage for every resource.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Storage {
    /// On disk.
    #[default]
    File,
    /// In memory.
    Memory,
}

impl Settings {
    /// Checks every rule, reporting all broken ones as `field: rule, got value`.
    ///
    /// # Errors
    /// [`Error::Settings`] listing the broken rules.
    pub fn validate(&self) -> Result<(), Error> {
        let mut errors = Vec::new();
        let mut at_least = |field: &str, value: u64, min: u64| {
            if value < min {
                errors.push(format!("{field}: must be at least {min}, got {value}"));
            }
        };
        at_least("ack_wait_secs", self.ack_wait_secs, 1);
        at_least("max_deliver", self.max_deliver.into(), 1);
        at_least("max_ack_pending", self.max_ack_pending.into(), 1);
        at_least("duplicate_window_secs", self.duplicate_window_secs, 1);
        at_least("leader_lease_secs", self.leader_lease_secs, 2);
        at_least("fanout_lease_secs", self.fanout_lease_secs, 2);
        // Past the coordinator's worker timeout (10 s) with room, or a killed worker's
        // entry expires before it is ever listed silent.
        at_least("silent_worker_secs", self.silent_worker_secs, 30);
        if let Some(bytes) = self.trace_max_bytes {
            at_least("trace_max_bytes", bytes, 1);
        }
        if self.silent_worker_secs > MAX_SILENT_WORKER_SECS {
            errors.push(format!(
                "silent_worker_secs: must be at most {MAX_SILENT_WORKER_SECS} (one year), got {}",
                self.silent_worker_secs
            ));
        }
        for (field, value, max) in [
            ("replicas", self.replicas, 5),
            ("task_history", self.task_history, 64),
            ("capsule_history", self.capsule_history, 64),
        ] {
            if !(1..=max).contains(&value) {
                errors.push(format!("{field}: must be between 1 and {max}, got {value}"));
            }
        }
        if errors.is_empty() { Ok(()) } else { Err(Error::Settings(errors)) }
    }

    fn storage_type(&self) -> StorageType {
        match self.storage {
            Storage::File => StorageType::File,
            Storage::Memory => StorageType::Memory,
        }
    }

    /// `MUR_DISPATCH`: a work queue with one subject, de-duplicating by message id.
    pub fn dispatch_stream(&self) -> stream::Config {
        stream::Config {
            name: cluster::DISPATCH_STREAM.into(),
            description: Some("murmur: tasks released to workers".into()),
            subjects: vec![cluster::DISPATCH_SUBJECT.into()],
            retention: RetentionPolicy::WorkQueue,
            storage: self.storage_type(),
            num_replicas: self.replicas.into(),
            duplicate_window: Duration::from_secs(self.duplicate_window_secs),
            ..Default::default()
        }
    }

    /// `MUR_DEAD_LETTERS`: the dispatch consumer's max-deliveries advisories, a work queue
    /// (issue #29 item 1: a core NATS message nobody stored was lost while no coordinator
    /// ran).
    pub fn dead_letter_stream(&self) -> stream::Config {
        stream::Config {
            name: cluster::DEAD_LETTER_STREAM.into(),
            description: Some(
                "murmur: max-deliveries advisories of MUR_DISPATCH/workers, until their tasks end".into(),
            ),
            subjects: vec![cluster::DEAD_LETTER_SUBJECT.into()],
            retention: RetentionPolicy::WorkQueue,
            storage: self.storage_type(),
            num_replicas: self.replicas.into(),
            ..Default::default()
        }
    }

    /// The `coordinators` consumer on `MUR_DEAD_LETTERS`: durable, pull, explicit ack; a
    /// notice whose task could not be ended (the broker failed) comes again after the ack
    /// wait.
    pub fn dead_letter_consumer(&self) -> consumer::pull::Config {
        consumer::pull::Config {
            durable_name: Some(cluster::DEAD_LETTER_CONSUMER.into()),
            description: Some("murmur: the leading coordinator ends each given-up dispatch's task".into()),
            deliver_policy: DeliverPolicy::All,
            ack_policy: AckPolicy::Explicit,
            ack_wait: Duration::from_secs(DEAD_LETTER_ACK_WAIT_SECS),
            // Delivered until handled: a notice given up on is a task left `working`.
            max_deliver: -1,
            max_ack_pending: 1000,
            ..Default::default()
        }
    }

    /// `MUR_TRACE`: every session's trace events, kept by age and size.
    pub fn trace_stream(&self) -> stream::Config {
        stream::Config {
            name: cluster::TRACE_STREAM.into(),
            description: Some("murmur: trace events, subject mur.trace.<session_id>".into()),
            subjects: vec![cluster::TRACE_SUBJECTS.into()],
            retention: RetentionPolicy::Limits,
            max_age: Duration::from_secs(self.trace_max_age_secs),
            max_bytes: self.trace_max_bytes.map_or(-1, |b| i64::try_from(b).unwrap_or(i64::MAX)),
            storage: self.storage_type(),
            num_replicas: self.replicas.into(),
            allow_direct: true,
            ..Default::default()
        }
    }

    /// The stream behind `mur_tasks` (task records, `task_history` revisions per key).
    pub fn tasks_stream(&self) -> stream::Config {
        self.kv_stream(cluster::TASKS_BUCKET, "murmur: task records, key = task id", self.task_history)
    }

    /// The stream behind KV bucket `bucket` keeping `history` revisions per key, as
    /// async-nats' `create_key_value` would build it.
    pub fn kv_stream(&self, bucket: &str, description: &str, history: u8) -> stream::Config {
        stream::Config {
            name: format!("KV_{bucket}"),
            description: Some(description.into()),
            subjects: vec![format!("$KV.{bucket}.>")],
            max_messages_per_subject: history.into(),
            max_bytes: -1,
            storage: self.storage_type(),
            num_replicas: self.replicas.into(),
            allow_rollup: true,
            deny_delete: true,
            deny_purge: false,
            // Direct gets are answered by any replica, a follower that has not applied the
            // latest write included: with several replicas a record read right after it was
            // written (the A2A endpoint reading the task it just submitted, through the
            // other coordinator) came back "not found" (issue #33, deploy/chaos). Without
            // them a key's read goes to the stream's leader, which has every acknowledged
            // write. One replica has no follower: direct gets stay, as async-nats makes them.
            allow_direct: self.replicas == 1,
            discard: DiscardPolicy::New,
            ..Default::default()
        }
    }

    /// The stream behind object store `bucket`, as async-nats' `create_object_store`
    /// would build it.
    pub fn object_stream(&self, bucket: &str, description: &str) -> stream::Config {
        stream::Config {
            name: format!("OBJ_{bucket}"),
            description: Some(description.into()),
            subjects: vec![format!("$O.{bucket}.C.>"), format!("$O.{bucket}.M.>")],
            max_bytes: -1,
            storage: self.storage_type(),
            num_replicas: self.replicas.into(),
            allow_rollup: true,
            allow_direct: true,
            discard: DiscardPolicy::New,
            ..Default::default()
        }
    }

    /// `MUR_FLEET`: every fleet's channel (`mur.fleet.<fleet>.channel`), kept until the
    /// fleet is removed.
    pub fn fleet_stream(&self) -> stream::Config {
        stream::Config {
            name: fleet_store::FLEET_STREAM.into(),
            description: Some("murmur: fleet channels, subject mur.fleet.<fleet>.channel".into()),
            subjects: vec![fleet_store::FLEET_SUBJECTS.into()],
            retention: RetentionPolicy::Limits,
            storage: self.storage_type(),
            num_replicas: self.replicas.into(),
            allow_direct: true,
            ..Default::default()
        }
    }

    /// The `workers` consumer on `MUR_DISPATCH`: durable, pull, explicit ack.
    pub fn dispatch_consumer(&self) -> consumer::pull::Config {
        consumer::pull::Config {
            durable_name: Some(cluster::DISPATCH_CONSUMER.into()),
            description: Some("murmur: every worker pulls its dispatches here".into()),
            deliver_policy: DeliverPolicy::All,
            ack_policy: AckPolicy::Explicit,
            ack_wait: Duration::from_secs(self.ack_wait_secs),
            max_deliver: self.max_deliver.into(),
            max_ack_pending: self.max_ack_pending.into(),
            ..Default::default()
        }
    }
}

/// Seconds a dead-letter notice read and not acked waits before it is delivered again.
const DEAD_LETTER_ACK_WAIT_SECS: u64 = 30;

/// Handles on every resource [`ensure`] set up.
pub struct Resources {
    /// `MUR_DISPATCH`.
    pub dispatch: stream::Stream,
    /// The `workers` pull consumer on `MUR_DISPATCH`.
    pub dispatch_consumer: PullConsumer,
    /// The `coordinators` pull consumer on `MUR_DEAD_LETTERS`.
    pub dead_letter_consumer: PullConsumer,
    /// `MUR_TRACE`.
    pub trace: stream::Stream,
    /// `mur_tasks`: task records.
    pub tasks: kv::Store,
    /// `mur_workers`: worker registrations and heartbeats.
    pub workers: kv::Store,
    /// `mur_sessions`: session checkpoints.
    pub sessions: kv::Store,
    /// `mur_capsule_index`: each capsule's latest bundle.
    pub capsule_index: kv::Store,
    /// `mur_leader`: the leader's lease.
    pub leader: kv::Store,
    /// `mur_fanout`: the fan-out semaphore's permits and waiting steps.
    pub fanout: kv::Store,
    /// `mur_capsules`: capsule bundles.
    pub capsules: object_store::ObjectStore,
    /// `mur_fleets`: fleet definitions and kill-switch sentinels.
    pub fleets: kv::Store,
    /// `mur_jobs`: fleet jobs.
    pub jobs: kv::Store,
    /// `MUR_FLEET`: fleet channels.
    pub fleet_channel: stream::Stream,
    /// What [`ensure`] did to each resource, in the order it went through them.
    pub outcomes: Vec<Outcome>,
}

impl fmt::Debug for Resources {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The object store handle has no Debug; the outcomes say what is there.
        f.debug_struct("Resources").field("outcomes", &self.outcomes).finish_non_exhaustive()
    }
}

/// What [`ensure`] did to one resource.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Outcome {
    /// The stream name, or `<stream>/<consumer>` for a consumer.
    pub resource: String,
    /// Created, updated or left alone.
    pub action: Action,
}

/// See [`Outcome`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// It did not exist.
    Created,
    /// It existed with other settings.
    Updated,
    /// It existed with these settings.
    Unchanged,
}

/// One setting the server holds differently from what was asked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Diff {
    /// The setting (async-nats' field name).
    pub field: &'static str,
    /// What the settings ask for.
    pub want: String,
    /// What the server has.
    pub got: String,
}

impl fmt::Display for Diff {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: want {}, got {}", self.field, self.want, self.got)
    }
}

/// Why the resources could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The settings break rules, one `field: rule` per entry.
    #[error("settings: {}", .0.join("; "))]
    Settings(Vec<String>),
    /// A JetStream request failed (server unreachable, JetStream disabled, a setting the
    /// server refuses to change such as a stream's storage).
    #[error("{resource}: {action} failed: {source}")]
    Request {
        /// The stream, or `<stream>/<consumer>`.
        resource: String,
        /// `read`, `create` or `update`.
        action: &'static str,
        /// The client's error.
        source: async_nats::Error,
    },
    /// After creating or updating, the server holds other settings than asked.
    #[error("{resource}: the server did not keep the settings: {}", .diffs.iter().map(Diff::to_string).collect::<Vec<_>>().join("; "))]
    NotApplied {
        /// The stream, or `<stream>/<consumer>`.
        resource: String,
        /// Each setting that differs.
        diffs: Vec<Diff>,
    },
}

impl Error {
    fn request(resource: &str, action: &'static str, source: impl Into<async_nats::Error>) -> Error {
        Error::Request { resource: resource.to_string(), action, source: source.into() }
    }
}

/// Creates or updates every stream, key-value bucket, object store and durable consumer
/// the cluster uses, checks that the server kept `settings`, and returns handles on them.
///
/// # Errors
/// [`Error::Settings`] before any request when `settings` break a rule;
/// [`Error::Request`] when JetStream refuses or cannot be reached; [`Error::NotApplied`]
/// when a resource reads back with other settings than asked.
pub async fn ensure(js: &jetstream::Context, settings: &Settings) -> Result<Resources, Error> {
    settings.validate()?;
    let mut outcomes = Vec::new();
    let kv_buckets = [
        (cluster::WORKERS_BUCKET, "murmur: worker registrations and heartbeats, key = worker id", 1),
        (cluster::SESSIONS_BUCKET, "murmur: session checkpoints", 1),
        (
            cluster::CAPSULE_INDEX_BUCKET,
            "murmur: each capsule's latest bundle, key = capsule",
            settings.capsule_history,
        ),
    ];
    let mut streams = vec![
        settings.dispatch_stream(),
        settings.trace_stream(),
        settings.dead_letter_stream(),
        settings.tasks_stream(),
    ];
    streams.extend(kv_buckets.iter().map(|(bucket, text, history)| settings.kv_stream(bucket, text, *history)));
    for config in &mut streams {
        if config.name == format!("KV_{}", cluster::WORKERS_BUCKET) {
            config.max_age = Duration::from_secs(settings.silent_worker_secs);
        }
    }
    streams.push(stream::Config {
        max_age: Duration::from_secs(settings.leader_lease_secs),
        ..settings.kv_stream(cluster::LEADER_BUCKET, "murmur: the leading coordinator's lease, key = leader", 1)
    });
    streams.push(stream::Config {
        max_age: Duration::from_secs(settings.fanout_lease_secs),
        // Expiry leaves a marker (kept one second) so that waiters see a permit come back.
        allow_message_ttl: true,
        subject_delete_marker_ttl: Some(Duration::from_secs(1)),
        ..settings.kv_stream(
            fanout::FANOUT_BUCKET,
            "murmur: fan-out permits (slot.<n>) and waiting steps (wait.<task>)",
            1,
        )
    });
    streams
        .push(settings.object_stream(cluster::CAPSULES_STORE, "murmur: capsule bundles, object = <capsule>/<digest>"));
    streams.push(settings.kv_stream(
        fleet_store::FLEETS_BUCKET,
        "murmur: fleet definitions (def.<fleet>) and kill-switch sentinels (stopped.<fleet>)",
        fleet_store::FLEETS_HISTORY,
    ));
    streams.push(settings.kv_stream(
        fleet_store::JOBS_BUCKET,
        "murmur: fleet jobs, key = <fleet>.<job id>",
        fleet_store::JOBS_HISTORY,
    ));
    // A2A tokens (issue #31): `mur auth token create` makes the bucket when no coordinator
    // did; this gives it the cluster's storage and replicas.
    streams.push(settings.kv_stream(
        cluster::TOKENS_BUCKET,
        "murmur: A2A bearer tokens (SHA-256 only), key = token name",
        1,
    ));
    streams.push(settings.fleet_stream());
    let mut handles = Vec::with_capacity(streams.len());
    for config in &streams {
        let (stream, action) = ensure_stream(js, config).await?;
        outcomes.push(Outcome { resource: config.name.clone(), action });
        handles.push(stream);
    }
    let mut handles = handles.into_iter();
    let dispatch = handles.next().expect("dispatch stream");
    let trace = handles.next().expect("trace stream");
    let dead_letters = handles.next().expect("dead-letter stream");
    let fleet_channel = handles.next_back().expect("fleet stream");

    let (dispatch_consumer, action) = ensure_consumer(&dispatch, &settings.dispatch_consumer()).await?;
    outcomes.push(Outcome { resource: format!("{}/{}", cluster::DISPATCH_STREAM, cluster::DISPATCH_CONSUMER), action });
    let (dead_letter_consumer, action) = ensure_consumer(&dead_letters, &settings.dead_letter_consumer()).await?;
    outcomes.push(Outcome {
        resource: format!("{}/{}", cluster::DEAD_LETTER_STREAM, cluster::DEAD_LETTER_CONSUMER),
        action,
    });

    let kv = |bucket: &'static str| async move {
        js.get_key_value(bucket).await.map_err(|e| Error::request(&format!("KV_{bucket}"), "read", e))
    };
    let capsules = js
        .get_object_store(cluster::CAPSULES_STORE)
        .await
        .map_err(|e| Error::request(&format!("OBJ_{}", cluster::CAPSULES_STORE), "read", e))?;
    Ok(Resources {
        dispatch,
        dispatch_consumer,
        dead_letter_consumer,
        trace,
        tasks: kv(cluster::TASKS_BUCKET).await?,
        workers: kv(cluster::WORKERS_BUCKET).await?,
        sessions: kv(cluster::SESSIONS_BUCKET).await?,
        capsule_index: kv(cluster::CAPSULE_INDEX_BUCKET).await?,
        leader: kv(cluster::LEADER_BUCKET).await?,
        fanout: kv(fanout::FANOUT_BUCKET).await?,
        capsules,
        fleets: kv(fleet_store::FLEETS_BUCKET).await?,
        jobs: kv(fleet_store::JOBS_BUCKET).await?,
        fleet_channel,
        outcomes,
    })
}

/// Creates `want` if missing, updates it if its settings differ, then checks them.
async fn ensure_stream(js: &jetstream::Context, want: &stream::Config) -> Result<(stream::Stream, Action), Error> {
    let name = want.name.as_str();
    let existing = match js.get_stream(name).await {
        Ok(stream) => Some(stream),
        Err(e) if is_stream_not_found(&e) => None,
        Err(e) => return Err(Error::request(name, "read", e)),
    };
    let (stream, action) = match existing {
        None => match js.create_stream(want.clone()).await {
            Ok(stream) => (stream, Action::Created),
            // Another coordinator created it between our read and our create: compare
            // against what it made, as for any existing stream.
            Err(create) => match js.get_stream(name).await {
                Ok(stream) => update_if_needed(js, want, stream).await?,
                Err(_) => return Err(Error::request(name, "create", create)),
            },
        },
        Some(stream) => update_if_needed(js, want, stream).await?,
    };
    let diffs = stream_diffs(want, &stream.cached_info().config);
    if !diffs.is_empty() {
        return Err(Error::NotApplied { resource: name.to_string(), diffs });
    }
    Ok((stream, action))
}

async fn update_if_needed(
    js: &jetstream::Context,
    want: &stream::Config,
    stream: stream::Stream,
) -> Result<(stream::Stream, Action), Error> {
    let name = want.name.as_str();
    if stream_diffs(want, &stream.cached_info().config).is_empty() {
        return Ok((stream, Action::Unchanged));
    }
    js.update_stream(want).await.map_err(|e| Error::request(name, "update", e))?;
    // Read back rather than trust the update's answer: the check is on what is stored.
    let stream = js.get_stream(name).await.map_err(|e| Error::request(name, "read", e))?;
    Ok((stream, Action::Updated))
}

fn is_stream_not_found(e: &async_nats::jetstream::context::GetStreamError) -> bool {
    matches!(e.kind(), GetStreamErrorKind::JetStream(js) if js.error_code() == ErrorCode::STREAM_NOT_FOUND)
}

/// Creates the durable pull consumer `want` on `stream` if missing, updates it if its
/// settings differ, then checks them.
async fn ensure_consumer(
    stream: &stream::Stream,
    want: &consumer::pull::Config,
) -> Result<(PullConsumer, Action), Error> {
    let durable = want.durable_name.as_deref().expect("a durable consumer");
    let resource = format!("{}/{durable}", stream.cached_info().config.name);
    let action = match stream.consumer_info(durable).await {
        Ok(info) if consumer_diffs(want, &info.config).is_empty() => Action::Unchanged,
        Ok(_) => {
            stream.update_consumer(want.clone()).await.map_err(|e| Error::request(&resource, "update", e))?;
            Action::Updated
        }
        Err(e) if e.kind() == ConsumerInfoErrorKind::NotFound => {
            stream.create_consumer(want.clone()).await.map_err(|e| Error::request(&resource, "create", e))?;
            Action::Created
        }
        Err(e) => return Err(Error::request(&resource, "read", e)),
    };
    let info = stream.consumer_info(durable).await.map_err(|e| Error::request(&resource, "read", e))?;
    let diffs = consumer_diffs(want, &info.config);
    if !diffs.is_empty() {
        return Err(Error::NotApplied { resource, diffs });
    }
    let handle = stream.get_consumer(durable).await.map_err(|e| Error::request(&resource, "read", e))?;
    Ok((handle, action))
}

/// The settings of `want` that `got` holds differently. Only fields this module sets are
/// compared: the server fills the others with its defaults.
pub fn stream_diffs(want: &stream::Config, got: &stream::Config) -> Vec<Diff> {
    let mut diffs = Vec::new();
    let mut check = |field: &'static str, w: String, g: String| {
        if w != g {
            diffs.push(Diff { field, want: w, got: g });
        }
    };
    let sorted = |subjects: &[String]| {
        let mut s = subjects.to_vec();
        s.sort();
        format!("{s:?}")
    };
    // The server reports "no limit" as -1 whatever was sent (0 or -1).
    let limit = |v: i64| if v <= 0 { -1 } else { v };
    check("subjects", sorted(&want.subjects), sorted(&got.subjects));
    check("retention", format!("{:?}", want.retention), format!("{:?}", got.retention));
    check("storage", format!("{:?}", want.storage), format!("{:?}", got.storage));
    check("num_replicas", want.num_replicas.max(1).to_string(), got.num_replicas.max(1).to_string());
    check("max_age", format!("{:?}", want.max_age), format!("{:?}", got.max_age));
    check("max_bytes", limit(want.max_bytes).to_string(), limit(got.max_bytes).to_string());
    check(
        "max_messages_per_subject",
        limit(want.max_messages_per_subject).to_string(),
        limit(got.max_messages_per_subject).to_string(),
    );
    check("discard", format!("{:?}", want.discard), format!("{:?}", got.discard));
    check("allow_rollup", want.allow_rollup.to_string(), got.allow_rollup.to_string());
    check("deny_delete", want.deny_delete.to_string(), got.deny_delete.to_string());
    check("deny_purge", want.deny_purge.to_string(), got.deny_purge.to_string());
    check("allow_direct", want.allow_direct.to_string(), got.allow_direct.to_string());
    check("allow_message_ttl", want.allow_message_ttl.to_string(), got.allow_message_ttl.to_string());
    check(
        "subject_delete_marker_ttl",
        format!("{:?}", want.subject_delete_marker_ttl),
        format!("{:?}", got.subject_delete_marker_ttl),
    );
    if !want.duplicate_window.is_zero() {
        check("duplicate_window", format!("{:?}", want.duplicate_window), format!("{:?}", got.duplicate_window));
    }
    if want.description.is_some() {
        check("description", format!("{:?}", want.description), format!("{:?}", got.description));
    }
    diffs
}

/// The settings of `want` that the consumer `got` holds differently.
pub fn consumer_diffs(want: &consumer::pull::Config, got: &consumer::Config) -> Vec<Diff> {
    let mut diffs = Vec::new();
    let mut check = |field: &'static str, w: String, g: String| {
        if w != g {
            diffs.push(Diff { field, want: w, got: g });
        }
    };
    check("durable_name", format!("{:?}", want.durable_name), format!("{:?}", got.durable_name));
    check("deliver_policy", format!("{:?}", want.deliver_policy), format!("{:?}", got.deliver_policy));
    check("ack_policy", format!("{:?}", want.ack_policy), format!("{:?}", got.ack_policy));
    check("ack_wait", format!("{:?}", want.ack_wait), format!("{:?}", got.ack_wait));
    check("max_deliver", want.max_deliver.to_string(), got.max_deliver.to_string());
    check("max_ack_pending", want.max_ack_pending.to_string(), got.max_ack_pending.to_string());
    check("filter_subject", want.filter_subject.clone(), got.filter_subject.clone());
    if want.description.is_some() {
        check("description", format!("{:?}", want.description), format!("{:?}", got.description));
    }
    diffs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_yaml_mapping_gives_the_defaults() {
        let s: Settings = serde_yaml_ng::from_str("{}").unwrap();
        assert_eq!(s, Settings::default());
        assert_eq!((s.ack_wait_secs, s.max_deliver, s.storage), (30, 5, Storage::File));
        let s: Settings = serde_yaml_ng::from_str("ack_wait_secs: 45\nstorage: memory\nreplicas: 3\n").unwrap();
        assert_eq!((s.ack_wait_secs, s.storage, s.replicas), (45, Storage::Memory, 3));
    }

    #[test]
    fn replicated_buckets_are_read_from_the_stream_leader() {
        let one = Settings::default();
        let three = Settings { replicas: 3, ..Settings::default() };
        let bucket = |s: &Settings| s.kv_stream(cluster::TASKS_BUCKET, "records", 5);
        assert_eq!((bucket(&one).num_replicas, bucket(&one).allow_direct), (1, true));
        assert_eq!((bucket(&three).num_replicas, bucket(&three).allow_direct), (3, false));
        // Every stream the coordinator makes carries the replicas setting.
        for config in [
            three.dispatch_stream(),
            three.dead_letter_stream(),
            three.trace_stream(),
            three.tasks_stream(),
            three.object_stream(cluster::CAPSULES_STORE, "bundles"),
            three.fleet_stream(),
        ] {
            assert_eq!(config.num_replicas, 3, "{}", config.name);
        }
    }

    #[test]
    fn unknown_settings_keys_are_refused() {
        let err = serde_yaml_ng::from_str::<Settings>("ack_wait: 45\n").unwrap_err().to_string();
        assert!(err.starts_with("unknown field `ack_wait`"), "{err}");
    }

    #[test]
    fn broken_settings_are_all_reported_with_the_field() {
        let s = Settings { ack_wait_secs: 0, max_deliver: 0, replicas: 7, capsule_history: 65, ..Settings::default() };
        assert_eq!(
            s.validate().unwrap_err().to_string(),
            "settings: ack_wait_secs: must be at least 1, got 0; max_deliver: must be at least 1, got 0; \
             replicas: must be between 1 and 5, got 7; capsule_history: must be between 1 and 64, got 65"
        );
        Settings::default().validate().unwrap();
        // Below 30 a killed worker's entry would expire before it is listed silent; above
        // a year the server would keep another max age (and a refused start must not have
        // changed the bucket).
        for (secs, rule) in [
            (29, "silent_worker_secs: must be at least 30, got 29"),
            (31_536_001, "silent_worker_secs: must be at most 31536000 (one year), got 31536001"),
        ] {
            let s = Settings { silent_worker_secs: secs, ..Settings::default() };
            assert_eq!(s.validate().unwrap_err().to_string(), format!("settings: {rule}"));
        }
        Settings { silent_worker_secs: 30, ..Settings::default() }.validate().unwrap();
    }

    #[test]
    fn diffs_ignore_server_defaults_and_name_changed_fields() {
        let s = Settings::default();
        let want = s.trace_stream();
        let mut got = want.clone();
        got.max_messages = -1;
        got.max_consumers = -1;
        assert_eq!(stream_diffs(&want, &got), []);
        got.max_age = Duration::from_secs(60);
        got.storage = StorageType::Memory;
        let diffs: Vec<String> = stream_diffs(&want, &got).iter().map(Diff::to_string).collect();
        assert_eq!(diffs, ["storage: want File, got Memory", "max_age: want 604800s, got 60s"]);
    }
}
