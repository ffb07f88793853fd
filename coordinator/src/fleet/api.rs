//! The fleet API (`mur.api.fleet.*`, issue #10): definitions, jobs, the kill-switch and
//! the channel, kept in JetStream ([`mur_proto::fleet_store`] names every key and subject)
//! so that any coordinator and any client see one state. Every coordinator serves it,
//! leader or standby: each handler only reads and writes the buckets and the stream, and
//! every change of a job or a definition is a compare-and-set on the key's revision.
//!
//! The rules are the pure ones of [`mur_proto::fleet`]: [`Fleet::parse`] (strict) for
//! `create` / `apply`, [`Fleet::load_stored`] (lenient) for everything that reads a stored
//! definition, [`apply_loop_edit`] for `set-loop`, [`Job::transition`] for `cancel`,
//! [`JobFilter`] for `jobs`. Nothing is written before the request has passed them, so a
//! refused request changes nothing stored (the design's invariant 7).
//!
//! The same [`Fleets`] handle gives the run engine what it needs: [`Fleets::stop_state`]
//! (fail closed), [`Fleets::publish`] and [`Fleets::channel`], [`Fleets::jobs_of`] and
//! [`Fleets::update_job`].

use crate::resources::Resources;
use async_nats::jetstream::{self, kv, stream};
use bytes::Bytes;
use mur_nats::clock::{Clock, SystemClock};
use mur_proto::cluster::{ApiError, ErrorCode};
use mur_proto::fleet::{self, Decision, Fleet, Job, JobFilter, JobStatus, LoopEdit, apply_loop_edit};
use mur_proto::fleet_store::{
    self, AnswerRequest, CancelRequest, ChannelEvent, DefineAction, DefineReply, DefineRequest, EventKind, FleetInfo,
    FleetRef, FleetSummary, JobsRequest, LogRequest, SendRequest, Sentinel, SetLoopRequest, StopRequest, StopState,
    api,
};
use mur_proto::page::{self, Page};
use serde::de::DeserializeOwned;
use std::collections::BTreeMap;

/// Compare-and-set attempts on one key before giving up.
const CAS_ATTEMPTS: usize = 8;

/// The longest `fleet.yaml` accepted, in bytes.
pub const MAX_DEFINITION_BYTES: usize = 1 << 20;

/// One endpoint of the fleet API.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// `fleet.create`.
    Create,
    /// `fleet.apply`.
    Apply,
    /// `fleet.ls`.
    List,
    /// `fleet.show`.
    Show,
    /// `fleet.rm`.
    Remove,
    /// `fleet.send`.
    Send,
    /// `fleet.jobs`.
    Jobs,
    /// `fleet.cancel`.
    Cancel,
    /// `fleet.set_loop`.
    SetLoop,
    /// `fleet.stop`.
    Stop,
    /// `fleet.start`.
    Start,
    /// `fleet.log`.
    Log,
    /// `fleet.approve`.
    Approve,
    /// `fleet.deny`.
    Deny,
    /// `fleet.trigger`.
    Trigger,
}

impl Op {
    /// Every endpoint.
    pub const ALL: [Op; 15] = [
        Op::Create,
        Op::Apply,
        Op::List,
        Op::Show,
        Op::Remove,
        Op::Send,
        Op::Jobs,
        Op::Cancel,
        Op::SetLoop,
        Op::Stop,
        Op::Start,
        Op::Log,
        Op::Approve,
        Op::Deny,
        Op::Trigger,
    ];

    /// Its subject.
    pub const fn subject(self) -> &'static str {
        match self {
            Op::Create => api::CREATE,
            Op::Apply => api::APPLY,
            Op::List => api::LIST,
            Op::Show => api::SHOW,
            Op::Remove => api::REMOVE,
            Op::Send => api::SEND,
            Op::Jobs => api::JOBS,
            Op::Cancel => api::CANCEL,
            Op::SetLoop => api::SET_LOOP,
            Op::Stop => api::STOP,
            Op::Start => api::START,
            Op::Log => api::LOG,
            Op::Approve => api::APPROVE,
            Op::Deny => api::DENY,
            Op::Trigger => api::TRIGGER,
        }
    }
}

/// Jobs read from `mur_jobs` at once when a fleet's jobs are listed.
const JOB_READS_AT_ONCE: usize = 16;

/// A job with its `mur_jobs` key and revision.
type KeyedJob = (String, u64, Job);

/// Handles on the fleet buckets and stream.
#[derive(Clone)]
pub struct Fleets {
    js: jetstream::Context,
    defs: kv::Store,
    jobs: kv::Store,
    channel: stream::Stream,
    instance: String,
}

fn unavailable(what: &str, e: impl std::fmt::Display) -> ApiError {
    ApiError::new(ErrorCode::Unavailable, format!("{what}: {e}"))
}

fn internal(what: &str, e: impl std::fmt::Display) -> ApiError {
    ApiError::new(ErrorCode::Internal, format!("{what}: {e}"))
}

fn to_json<T: serde::Serialize>(value: &T) -> Result<Bytes, ApiError> {
    serde_json::to_vec(value).map(Bytes::from).map_err(|e| internal("reply", e))
}

fn request<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| ApiError::invalid(format!("request: {e}")))
}

fn check_name(fleet: &str) -> Result<(), ApiError> {
    if fleet::is_valid_fleet_name(fleet) {
        Ok(())
    } else {
        Err(ApiError::invalid(format!("fleet: must be 1-64 characters of a-z, 0-9, '-' or '_', got {fleet:?}")))
    }
}

fn not_found(fleet: &str) -> ApiError {
    ApiError::new(
        ErrorCode::NotFound,
        format!("fleet: no fleet named {fleet:?} (create it with `mur fleet create FILE`)"),
    )
}

/// The summary of a stored definition: what loads of it, its kill-switch and job counts,
/// and the notices of loading it.
fn summarize(name: &str, text: &str, stop: StopState, jobs: &[Job]) -> (FleetSummary, Vec<String>) {
    let mut summary = FleetSummary {
        name: name.to_string(),
        members: Vec::new(),
        stop,
        queued: 0,
        running: 0,
        blocked: 0,
        trigger: "manual".to_string(),
        done_when: String::new(),
        error: None,
    };
    summary.count(jobs);
    let notices = match Fleet::load_stored(text) {
        Ok(f) => {
            summary.members = f.members;
            summary.trigger = f.r#loop.trigger.as_text();
            summary.done_when = f.r#loop.done_when.as_text();
            f.notices
        }
        Err(e) => {
            summary.error = Some(e.to_string());
            Vec::new()
        }
    };
    (summary, notices)
}

impl Fleets {
    /// Handles on the resources [`crate::resources::ensure`] set up.
    /// The `mur_fleets` bucket (definitions, sentinels, run records).
    pub fn defs(&self) -> &kv::Store {
        &self.defs
    }

    /// A handle for `instance` on the fleet buckets and stream that `ensure` set up.
    pub fn new(js: jetstream::Context, res: &Resources, instance: impl Into<String>) -> Fleets {
        Fleets {
            js,
            defs: res.fleets.clone(),
            jobs: res.jobs.clone(),
            channel: res.fleet_channel.clone(),
            instance: instance.into(),
        }
    }

    /// Answers one request of `op` (its NATS `headers`, its `body`): the reply's JSON, or
    /// the error. `caller` is who sent it as nats-server states it
    /// ([`mur_nats::identity`]), when the coordinator has an identity connection:
    /// `approve`, `deny`, `stop`, `start` and `send` record that name, never the one the
    /// request gives (`by`, `source`), which is recorded only without it (local clusters
    /// without credentials: unverified, the client sends `$USER`). A `fleet.send` is
    /// answered in a `process mur.api.fleet.send` span joined to the caller's
    /// `traceparent`, which the job keeps (issue #32 §Fleet runs traced).
    ///
    /// # Errors
    /// The request's [`ApiError`].
    pub async fn handle(
        &self,
        op: Op,
        headers: Option<&async_nats::HeaderMap>,
        body: &[u8],
        caller: Option<&str>,
    ) -> Result<Bytes, ApiError> {
        match op {
            Op::Create => self.define(request(body)?, false).await.and_then(|r| to_json(&r)),
            Op::Apply => self.define(request(body)?, true).await.and_then(|r| to_json(&r)),
            Op::List => self.list().await.and_then(|r| to_json(&r)),
            Op::Show => self.show(&request::<FleetRef>(body)?.fleet).await.and_then(|r| to_json(&r)),
            Op::Remove => self.remove(request(body)?).await.and_then(|r| to_json(&r)),
            Op::Send => {
                let span = tracing::info_span!(
                    "fleet_send",
                    otel.name = %format!("process {}", api::SEND),
                    otel.kind = "server",
                    messaging.system = "nats",
                    messaging.operation.type = "process",
                    messaging.destination.name = api::SEND,
                    mur.fleet = tracing::field::Empty,
                    mur.job_id = tracing::field::Empty,
                );
                let traceparent = mur_nats::trace_context::join(&span, headers);
                let send = async {
                    let req: SendRequest = request(body)?;
                    tracing::Span::current().record("mur.fleet", req.fleet.as_str());
                    let job = self.send(req, caller, traceparent).await?;
                    tracing::Span::current().record("mur.job_id", job.id.as_str());
                    to_json(&job)
                };
                tracing::Instrument::instrument(send, span).await
            }
            Op::Jobs => self.list_jobs(request(body)?).await.and_then(|r| to_json(&r)),
            Op::Cancel => self.cancel(request(body)?).await.and_then(|r| to_json(&r)),
            Op::SetLoop => self.set_loop(request(body)?).await.and_then(|r| to_json(&r)),
            Op::Stop => self.stop(request(body)?, caller).await.and_then(|r| to_json(&r)),
            Op::Start => self.start(request(body)?, caller).await.and_then(|r| to_json(&r)),
            Op::Log => self.log(request(body)?).await.and_then(|r| to_json(&r)),
            Op::Approve => self.answer(request(body)?, Decision::Approved, caller).await.and_then(|r| to_json(&r)),
            Op::Deny => self.answer(request(body)?, Decision::Denied, caller).await.and_then(|r| to_json(&r)),
            Op::Trigger => self.trigger(request(body)?).await.and_then(|r| to_json(&r)),
        }
    }

    // -----------------------------------------------------------------------------------
    // Reads the run engine shares.

    /// The stored definition of `fleet` and its revision.
    ///
    /// # Errors
    /// `not_found` when there is none; `unavailable` when it cannot be read.
    pub async fn definition(&self, fleet: &str) -> Result<(u64, String), ApiError> {
        check_name(fleet)?;
        let entry =
            self.defs.entry(fleet_store::def_key(fleet)).await.map_err(|e| unavailable("mur_fleets: read", e))?;
        let Some(entry) = entry.filter(|e| e.operation == kv::Operation::Put) else {
            return Err(not_found(fleet));
        };
        let text = String::from_utf8(entry.value.to_vec()).map_err(|e| internal("mur_fleets: definition", e))?;
        Ok((entry.revision, text))
    }

    /// The kill-switch of `fleet`. A sentinel that cannot be read, or does not parse,
    /// counts as stopped (fail closed).
    pub async fn stop_state(&self, fleet: &str) -> StopState {
        match self.defs.get(fleet_store::stopped_key(fleet)).await {
            Ok(value) => StopState::from_value(value.as_deref()),
            Err(e) => StopState::Unreadable { error: format!("mur_fleets: read: {e}") },
        }
    }

    /// Every job of `fleet` with its revision, oldest first (malformed ones are logged
    /// and skipped).
    ///
    /// # Errors
    /// `unavailable` when `mur_jobs` cannot be read.
    pub async fn jobs_of(&self, fleet: &str) -> Result<Vec<(u64, Job)>, ApiError> {
        let mut jobs: Vec<(u64, Job)> =
            self.read_jobs(&format!("{fleet}.")).await?.into_iter().map(|(_, revision, job)| (revision, job)).collect();
        jobs.sort_by(|a, b| a.1.id.cmp(&b.1.id));
        Ok(jobs)
    }

    /// The jobs whose `mur_jobs` keys start with `prefix` (`<fleet>.`, or `` for every
    /// fleet's), each with its key and revision, in key order. The keys are listed once
    /// (a key written while they are listed comes once, not twice) and read 16 at a time:
    /// one request after another took 650 ms for a fleet of 2,000 jobs, every time its
    /// jobs were listed or a run looked for the next one. Deleted keys and malformed jobs
    /// (logged) are left out.
    async fn read_jobs(&self, prefix: &str) -> Result<Vec<KeyedJob>, ApiError> {
        use futures::StreamExt;
        let keys: std::collections::BTreeSet<String> = mur_nats::read::keys(&self.jobs, ">")
            .await
            .map_err(|e| unavailable("mur_jobs: keys", e))?
            .into_iter()
            .filter(|k| k.starts_with(prefix))
            .collect();
        let read: Vec<Result<Option<KeyedJob>, ApiError>> = futures::stream::iter(keys)
            .map(|key| async move { Ok(self.read_job(&key).await?.map(|(revision, job)| (key, revision, job))) })
            .buffered(JOB_READS_AT_ONCE)
            .collect()
            .await;
        read.into_iter().filter_map(Result::transpose).collect()
    }

    /// Stores a new job of `fleet` as it is (the run engine's job for a parked standing
    /// goal).
    ///
    /// # Errors
    /// `unavailable` when `mur_jobs` does not take it (or the id is taken).
    pub async fn create_job(&self, fleet: &str, job: &Job) -> Result<(), ApiError> {
        self.jobs
            .create(fleet_store::job_key(fleet, &job.id), to_json(job)?)
            .await
            .map(drop)
            .map_err(|e| unavailable("mur_jobs: create", e))
    }

    /// One job of `fleet` (`None` when it is gone or malformed).
    ///
    /// # Errors
    /// `unavailable` when `mur_jobs` cannot be read.
    pub async fn job(&self, fleet: &str, job_id: &str) -> Result<Option<Job>, ApiError> {
        Ok(self.read_job(&fleet_store::job_key(fleet, job_id)).await?.map(|(_, j)| j))
    }

    async fn read_job(&self, key: &str) -> Result<Option<(u64, Job)>, ApiError> {
        let entry = self.jobs.entry(key).await.map_err(|e| unavailable("mur_jobs: read", e))?;
        let Some(entry) = entry.filter(|e| e.operation == kv::Operation::Put) else { return Ok(None) };
        match serde_json::from_slice::<Job>(&entry.value) {
            Ok(job) => Ok(Some((entry.revision, job))),
            Err(e) => {
                tracing::warn!(instance = %self.instance, key, "skipping a malformed job: {e}");
                Ok(None)
            }
        }
    }

    /// Changes a job with `change` under a compare-and-set, retrying when another writer
    /// got there first; returns the job as written.
    ///
    /// # Errors
    /// What `change` returns (it sees the current job each attempt); `not_found` when the
    /// job is gone; `unavailable` when the bucket cannot be read or written.
    pub async fn update_job(
        &self,
        fleet: &str,
        job_id: &str,
        mut change: impl FnMut(&mut Job) -> Result<(), ApiError>,
    ) -> Result<Job, ApiError> {
        let key = fleet_store::job_key(fleet, job_id);
        for _ in 0..CAS_ATTEMPTS {
            let Some((revision, mut job)) = self.read_job(&key).await? else {
                return Err(ApiError::new(ErrorCode::NotFound, format!("job: no job {job_id} in fleet {fleet}")));
            };
            change(&mut job)?;
            match self.jobs.update(&key, to_json(&job)?, revision).await {
                Ok(_) => return Ok(job),
                Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => continue,
                Err(e) => return Err(unavailable("mur_jobs: update", e)),
            }
        }
        Err(ApiError::new(ErrorCode::Unavailable, format!("job {job_id}: changed too often, retry")))
    }

    /// Appends `event` to `fleet`'s channel and returns its sequence number (the stream's,
    /// from the publish ack).
    ///
    /// # Errors
    /// `unavailable` when the stream does not take it.
    pub async fn publish(&self, fleet: &str, event: &ChannelEvent) -> Result<u64, ApiError> {
        let subject = fleet_store::channel_subject(fleet);
        let ack = self
            .js
            .publish(subject, to_json(event)?)
            .await
            .map_err(|e| unavailable(&format!("{}: publish", fleet_store::FLEET_STREAM), e))?;
        let ack = ack.await.map_err(|e| unavailable(&format!("{}: publish ack", fleet_store::FLEET_STREAM), e))?;
        Ok(ack.sequence)
    }

    /// Publishes a system event, logging (not failing) when the stream does not take it:
    /// the change it reports is already stored.
    async fn note(&self, fleet: &str, kind: EventKind, text: String, job_id: Option<&str>) {
        let mut event = ChannelEvent::system(kind, text, SystemClock.now_ms());
        event.job_id = job_id.map(str::to_string);
        if let Err(e) = self.publish(fleet, &event).await {
            tracing::warn!(instance = %self.instance, fleet, "channel event not written: {e}");
        }
    }

    /// The events of `fleet`'s channel with a sequence number above `since`, oldest
    /// first, at most [`fleet_store::MAX_LOG_EVENTS`].
    ///
    /// # Errors
    /// `unavailable` when the stream cannot be read.
    pub async fn channel(&self, fleet: &str, since: u64) -> Result<Vec<ChannelEvent>, ApiError> {
        let subject = fleet_store::channel_subject(fleet);
        let mut next = since + 1;
        let mut events = Vec::new();
        let mut bytes = 0;
        while events.len() < fleet_store::MAX_LOG_EVENTS {
            let message = match self.channel.direct_get_next_for_subject(subject.as_str(), Some(next)).await {
                Ok(m) => m,
                Err(e) if e.kind() == stream::DirectGetErrorKind::NotFound => break,
                Err(e) => return Err(unavailable(&format!("{}: read", fleet_store::FLEET_STREAM), e)),
            };
            // A page is cut before the reply would outgrow a NATS payload (the first event
            // always goes: a channel event is far smaller than the limit).
            bytes += message.payload.len() + 32;
            if bytes > fleet_store::MAX_LOG_BYTES && !events.is_empty() {
                break;
            }
            next = message.sequence + 1;
            match serde_json::from_slice::<ChannelEvent>(&message.payload) {
                Ok(mut event) => {
                    event.seq = message.sequence;
                    events.push(event);
                }
                Err(e) => {
                    tracing::warn!(instance = %self.instance, fleet, seq = message.sequence, "skipping a malformed channel event: {e}");
                }
            }
        }
        Ok(events)
    }

    // -----------------------------------------------------------------------------------
    // Handlers.

    /// `fleet.create` (`replace` false) and `fleet.apply` (`replace` true): validates
    /// strictly, then stores the text as given.
    async fn define(&self, req: DefineRequest, replace: bool) -> Result<DefineReply, ApiError> {
        if req.yaml.len() > MAX_DEFINITION_BYTES {
            return Err(ApiError::invalid(format!(
                "fleet.yaml: at most {MAX_DEFINITION_BYTES} bytes, got {}",
                req.yaml.len()
            )));
        }
        let fleet = Fleet::parse(&req.yaml).map_err(|e| ApiError::invalid(e.to_string()))?;
        let key = fleet_store::def_key(&fleet.name);
        let value = Bytes::from(req.yaml.clone());
        for _ in 0..CAS_ATTEMPTS {
            let existing = self.defs.entry(&key).await.map_err(|e| unavailable("mur_fleets: read", e))?;
            let action = match existing.filter(|e| e.operation == kv::Operation::Put) {
                Some(_) if !replace => {
                    return Err(ApiError::new(
                        ErrorCode::Conflict,
                        format!("fleet {} already exists (replace it with `mur fleet apply FILE`)", fleet.name),
                    ));
                }
                Some(entry) if entry.value == value => DefineAction::Unchanged,
                // Replaced under a `fleet rm` under way, it would be removed as soon as
                // stored: refused, so a reply of `replaced` never names a fleet about to go.
                Some(entry) if self.removal_under_way(&fleet.name, entry.revision).await? => {
                    return Err(ApiError::new(
                        ErrorCode::Conflict,
                        format!(
                            "fleet {}: a removal (`mur fleet rm`) is under way; apply it again once it has ended",
                            fleet.name
                        ),
                    ));
                }
                Some(entry) => match self.defs.update(&key, value.clone(), entry.revision).await {
                    Ok(_) => DefineAction::Replaced,
                    Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => continue,
                    Err(e) => return Err(unavailable("mur_fleets: update", e)),
                },
                None => match self.defs.create(&key, value.clone()).await {
                    Ok(_) => DefineAction::Created,
                    Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => continue,
                    Err(e) => return Err(unavailable("mur_fleets: create", e)),
                },
            };
            tracing::info!(instance = %self.instance, fleet = %fleet.name, action = action.as_str(), "fleet defined");
            return Ok(DefineReply { fleet: fleet.name, action, notices: fleet.notices });
        }
        Err(ApiError::new(ErrorCode::Unavailable, format!("fleet {}: changed too often, retry", fleet.name)))
    }

    /// `fleet.ls`: every fleet, by name.
    async fn list(&self) -> Result<Vec<FleetSummary>, ApiError> {
        let keys: Vec<String> =
            mur_nats::read::keys(&self.defs, ">").await.map_err(|e| unavailable("mur_fleets: keys", e))?;
        let mut jobs: BTreeMap<String, Vec<Job>> = BTreeMap::new();
        for (key, _, job) in self.read_jobs("").await? {
            if let Some((fleet, _)) = fleet_store::split_job_key(&key) {
                jobs.entry(fleet.to_string()).or_default().push(job);
            }
        }
        let mut out = Vec::new();
        for name in keys.iter().filter_map(|k| fleet_store::fleet_of_def_key(k)) {
            let Some(text) =
                self.defs.get(fleet_store::def_key(name)).await.map_err(|e| unavailable("mur_fleets: read", e))?
            else {
                continue;
            };
            let text = String::from_utf8_lossy(&text);
            let stop = self.stop_state(name).await;
            out.push(summarize(name, &text, stop, jobs.get(name).map_or(&[][..], Vec::as_slice)).0);
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    /// `fleet.show`.
    async fn show(&self, fleet: &str) -> Result<FleetInfo, ApiError> {
        let (revision, yaml) = self.definition(fleet).await?;
        let stop = self.stop_state(fleet).await;
        let jobs: Vec<Job> = self.jobs_of(fleet).await?.into_iter().map(|(_, j)| j).collect();
        let (summary, notices) = summarize(fleet, &yaml, stop, &jobs);
        // For a trigger that fires, or one `mur fleet trigger` has used.
        let schedule = match Fleet::load_stored(&yaml) {
            Ok(f) => {
                let stored = crate::fleet::trigger::read_state(&self.defs, fleet)
                    .await
                    .map_err(|e| unavailable("mur_fleets: read", e))?;
                (f.r#loop.trigger != mur_proto::fleet::Trigger::Manual || stored.state != Default::default())
                    .then(|| crate::fleet::schedule::info(&f.r#loop, &stored.state, SystemClock.now_ms()))
            }
            Err(_) => None,
        };
        Ok(FleetInfo { summary, notices, yaml, revision, schedule })
    }

    /// `fleet.rm`: the definition, the sentinel, the jobs and the channel go.
    async fn remove(&self, req: FleetRef) -> Result<FleetRef, ApiError> {
        let (revision, _) = self.definition(&req.fleet).await?;
        // Marked before the runs are looked at: a run starting now either is seen below or
        // sees the mark and starts nothing (`fleet_store::Removing`).
        let removing = fleet_store::removing_key(&req.fleet);
        let mark = fleet_store::Removing { revision, at: SystemClock.now_ms() };
        self.defs.put(&removing, to_json(&mark)?).await.map_err(|e| unavailable("mur_fleets: put", e))?;
        // A run going would go on writing jobs and channel events for a fleet that is gone
        // (and into a new fleet of the same name): refused, nothing removed.
        let going = self.run_going(&req.fleet).await;
        if !matches!(going, Ok(None))
            && let Err(e) = self.defs.purge(&removing).await
        {
            tracing::warn!(fleet = %req.fleet, "clearing the removal mark: {e}");
        }
        if let Some(run_id) = going? {
            return Err(ApiError::new(
                ErrorCode::Conflict,
                format!(
                    "fleet {}: run {run_id} is going; stop it first (`mur fleet stop {}`), then remove the fleet once it has ended",
                    req.fleet, req.fleet
                ),
            ));
        }
        for (_, job) in self.jobs_of(&req.fleet).await? {
            self.jobs
                .purge(fleet_store::job_key(&req.fleet, &job.id))
                .await
                .map_err(|e| unavailable("mur_jobs: purge", e))?;
        }
        self.channel
            .purge()
            .filter(fleet_store::channel_subject(&req.fleet))
            .await
            .map_err(|e| unavailable(&format!("{}: purge", fleet_store::FLEET_STREAM), e))?;
        self.defs.purge(fleet_store::stopped_key(&req.fleet)).await.map_err(|e| unavailable("mur_fleets: purge", e))?;
        self.defs
            .purge(fleet_store::last_run_key(&req.fleet))
            .await
            .map_err(|e| unavailable("mur_fleets: purge", e))?;
        // Only the definition this removal was asked for: one applied since (between the
        // read above and here) stays, and the caller is told.
        let purged = self.defs.purge_expect_revision(fleet_store::def_key(&req.fleet), Some(revision)).await;
        self.defs.purge(&removing).await.map_err(|e| unavailable("mur_fleets: purge", e))?;
        match purged {
            Ok(()) => {}
            Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => {
                return Err(ApiError::new(
                    ErrorCode::Conflict,
                    format!(
                        "fleet {}: applied again while it was being removed; its new definition stays (its jobs \
                         and channel events are removed): remove it again to remove it",
                        req.fleet
                    ),
                ));
            }
            Err(e) => return Err(unavailable("mur_fleets: purge", e)),
        }
        tracing::info!(instance = %self.instance, fleet = %req.fleet, "fleet removed");
        Ok(req)
    }

    /// Whether a `mur fleet rm` of `fleet`'s definition at `revision` is under way: its
    /// mark is there and fresh ([`fleet_store::Removing`]).
    ///
    /// # Errors
    /// `unavailable` when the bucket cannot be read.
    pub async fn removal_under_way(&self, fleet: &str, revision: u64) -> Result<bool, ApiError> {
        let mark =
            self.defs.get(fleet_store::removing_key(fleet)).await.map_err(|e| unavailable("mur_fleets: read", e))?;
        Ok(mark
            .and_then(|v| serde_json::from_slice::<fleet_store::Removing>(&v).ok())
            .is_some_and(|m| m.applies(revision, SystemClock.now_ms())))
    }

    /// The id of a run of `fleet` that is not over (its record says `running`), if any.
    async fn run_going(&self, fleet: &str) -> Result<Option<String>, ApiError> {
        let keys = mur_nats::read::keys(&self.defs, "run.>").await.map_err(|e| unavailable("mur_fleets: keys", e))?;
        for key in keys {
            let value = self.defs.get(&key).await.map_err(|e| unavailable("mur_fleets: read", e))?;
            if let Some(r) = value.and_then(|v| serde_json::from_slice::<fleet_store::RunRecord>(&v).ok())
                && r.fleet == fleet
                && !r.is_over()
            {
                return Ok(Some(r.run_id));
            }
        }
        Ok(None)
    }

    /// `fleet.send`: queues a job; runs nothing.
    async fn send(&self, req: SendRequest, caller: Option<&str>, traceparent: Option<String>) -> Result<Job, ApiError> {
        let (revision, _) = self.definition(&req.fleet).await?;
        // A job's text becomes its steps' task texts: the same rule, so a job a run could
        // never submit is refused now rather than fail every step later.
        if let Some(rule) = mur_proto::cluster::text_rule(&req.text, fleet_store::MAX_JOB_BYTES) {
            return Err(ApiError::invalid(format!("text: {rule}")));
        }
        let source = match caller {
            Some(name) => name.to_string(),
            None => req.source.unwrap_or_else(|| fleet::SOURCE_CLI.to_string()),
        };
        let mut job = Job::new(req.text, source, SystemClock.now_ms());
        job.traceparent = traceparent;
        self.jobs
            .create(fleet_store::job_key(&req.fleet, &job.id), to_json(&job)?)
            .await
            .map_err(|e| unavailable("mur_jobs: create", e))?;
        // As a run does (`fleet_store::Removing`): a job written while `mur fleet rm` runs
        // is taken back, or it would be left for the next fleet of the name.
        let removed = match self.removal_under_way(&req.fleet, revision).await {
            Ok(true) => Some(format!("fleet {} is being removed (mur fleet rm); the job was not queued", req.fleet)),
            Ok(false) => match self.definition(&req.fleet).await {
                Err(e) if e.code == ErrorCode::NotFound => {
                    Some(format!("fleet {} was removed while the job was sent; it was not queued", req.fleet))
                }
                _ => None,
            },
            Err(e) => {
                tracing::warn!(fleet = %req.fleet, "reading the removal mark: {e}");
                None
            }
        };
        if let Some(reason) = removed {
            if let Err(e) = self.jobs.purge(fleet_store::job_key(&req.fleet, &job.id)).await {
                tracing::warn!(fleet = %req.fleet, job = %job.id, "taking back a job sent during a removal: {e}");
            }
            return Err(ApiError::new(ErrorCode::Conflict, reason));
        }
        tracing::info!(instance = %self.instance, fleet = %req.fleet, job = %job.id, "job queued");
        self.note(&req.fleet, EventKind::StateChange, format!("job {} queued", job.id), Some(&job.id)).await;
        Ok(job)
    }

    /// `fleet.jobs`: the fleet's jobs that `req` asks for, as [`jobs_page`] fits them.
    async fn list_jobs(&self, req: JobsRequest) -> Result<Page<Job>, ApiError> {
        self.definition(&req.fleet).await?;
        let filter = JobFilter { all: req.all, since: req.since, status: req.status };
        let jobs = self.jobs_of(&req.fleet).await?.into_iter().map(|(_, j)| j).filter(|j| filter.matches(j));
        Ok(jobs_page(jobs.collect(), self.js.client().server_info().max_payload))
    }

    /// The id of `fleet`'s job named by `wanted`: its id, or a prefix naming one job.
    async fn job_id(&self, fleet: &str, wanted: &str) -> Result<String, ApiError> {
        self.definition(fleet).await?;
        let wanted = wanted.trim();
        if wanted.is_empty() {
            return Err(ApiError::invalid("job: required"));
        }
        let jobs = self.jobs_of(fleet).await?;
        let matching: Vec<&Job> = match jobs.iter().find(|(_, j)| j.id == wanted) {
            Some((_, j)) => vec![j],
            None => jobs.iter().map(|(_, j)| j).filter(|j| j.id.starts_with(wanted)).collect(),
        };
        match matching.as_slice() {
            [] => Err(ApiError::new(ErrorCode::NotFound, format!("job: no job {wanted} in fleet {fleet}"))),
            [one] => Ok(one.id.clone()),
            many => Err(ApiError::invalid(format!(
                "job: {wanted:?} names {} jobs of fleet {fleet}; give more of the id",
                many.len()
            ))),
        }
    }

    /// `fleet.approve` / `fleet.deny`: answers a blocked job's approval request. A job that
    /// is not blocked, or whose request is already answered, is a conflict.
    async fn answer(&self, req: AnswerRequest, decision: Decision, caller: Option<&str>) -> Result<Job, ApiError> {
        let id = self.job_id(&req.fleet, &req.job).await?;
        let by = caller.unwrap_or(&req.by).trim();
        if by.is_empty() {
            return Err(ApiError::invalid("by: must not be empty"));
        }
        let now = SystemClock.now_ms();
        let job = self
            .update_job(&req.fleet, &id, |job| {
                let pending = job.approval.as_mut().filter(|a| a.decision.is_none());
                match pending {
                    Some(approval) if job.status == JobStatus::Blocked => {
                        approval.decision = Some(decision);
                        approval.by = Some(by.to_string());
                        approval.at = Some(now);
                        Ok(())
                    }
                    _ => Err(ApiError::new(
                        ErrorCode::Conflict,
                        match (&job.approval, job.status) {
                            (Some(fleet::Approval { decision: Some(d), by: Some(who), .. }), JobStatus::Blocked) => {
                                format!("job {} was already {} by {who}; the next run takes it", job.id, d.as_str())
                            }
                            _ => format!("job {} is not awaiting approval (it is {})", job.id, job.status),
                        },
                    )),
                }
            })
            .await?;
        let steps = job.approval.as_ref().map(|a| a.steps.join(", ")).unwrap_or_default();
        tracing::info!(instance = %self.instance, fleet = %req.fleet, job = %job.id, by, "job {}", decision.as_str());
        let text = format!("job {} {} by {by} (step {steps}); the next run takes it", job.id, decision.as_str());
        self.note(&req.fleet, EventKind::StateChange, text, Some(&job.id)).await;
        Ok(job)
    }

    /// `fleet.cancel`: a queued, running or blocked job becomes canceled; a finished one is
    /// a conflict.
    async fn cancel(&self, req: CancelRequest) -> Result<Job, ApiError> {
        let id = self.job_id(&req.fleet, &req.job).await?;
        let now = SystemClock.now_ms();
        let job = self
            .update_job(&req.fleet, &id, |job| {
                if job.status.is_terminal() {
                    return Err(ApiError::new(
                        ErrorCode::Conflict,
                        format!(
                            "job {} has already ended ({}); only a queued, running or blocked job can be canceled",
                            job.id, job.status
                        ),
                    ));
                }
                job.transition(JobStatus::Canceled, now).map_err(|e| ApiError::new(ErrorCode::Conflict, e.to_string()))
            })
            .await?;
        tracing::info!(instance = %self.instance, fleet = %req.fleet, job = %job.id, "job canceled");
        self.note(&req.fleet, EventKind::StateChange, format!("job {} canceled", job.id), Some(&job.id)).await;
        Ok(job)
    }

    /// `fleet.set_loop`: judges only the values given, with the parsers execution uses.
    async fn set_loop(&self, req: SetLoopRequest) -> Result<FleetInfo, ApiError> {
        let edit = LoopEdit {
            trigger: req.trigger,
            done_when: req.done_when,
            deadline: req.deadline,
            budget_usd: req.budget_usd,
            timezone: req.timezone,
            overlap: req.overlap,
            catchup: req.catchup,
            pause_after_failures: req.pause_after_failures,
        };
        if edit == LoopEdit::default() {
            return Err(ApiError::invalid(
                "give at least one of --done-when, --trigger, --deadline, --budget-usd, --timezone, --overlap, \
                 --catchup, --pause-after-failures",
            ));
        }
        let key = fleet_store::def_key(&req.fleet);
        for _ in 0..CAS_ATTEMPTS {
            let (revision, stored) = self.definition(&req.fleet).await?;
            let text = apply_loop_edit(&stored, &edit).map_err(|e| ApiError::invalid(e.to_string()))?;
            match self.defs.update(&key, Bytes::from(text), revision).await {
                Ok(_) => {
                    tracing::info!(instance = %self.instance, fleet = %req.fleet, "loop settings changed");
                    return self.show(&req.fleet).await;
                }
                Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => continue,
                Err(e) => return Err(unavailable("mur_fleets: update", e)),
            }
        }
        Err(ApiError::new(ErrorCode::Unavailable, format!("fleet {}: changed too often, retry", req.fleet)))
    }

    /// `fleet.stop`: writes the sentinel. A fleet already stopped keeps its sentinel,
    /// unless it was a `--drain` stop and this one is not: the running steps are then
    /// canceled after all (issue #29 item 4).
    async fn stop(&self, req: StopRequest, caller: Option<&str>) -> Result<FleetInfo, ApiError> {
        self.definition(&req.fleet).await?;
        let by = caller.unwrap_or(&req.by);
        let write = match self.stop_state(&req.fleet).await {
            StopState::Stopped { sentinel } => sentinel.drain && !req.drain,
            _ => true,
        };
        if write {
            let sentinel = Sentinel { at: SystemClock.now_ms(), by: by.to_string(), drain: req.drain };
            self.defs
                .put(fleet_store::stopped_key(&req.fleet), to_json(&sentinel)?)
                .await
                .map_err(|e| unavailable("mur_fleets: put", e))?;
            tracing::info!(instance = %self.instance, fleet = %req.fleet, by, "fleet stopped");
            let how = if req.drain { " (--drain: running steps finish)" } else { "" };
            self.note(&req.fleet, EventKind::StateChange, format!("stopped by {by}{how}"), None).await;
        }
        self.show(&req.fleet).await
    }

    /// `fleet.start`: clears the sentinel, and resumes a trigger paused after failures.
    async fn start(&self, req: FleetRef, caller: Option<&str>) -> Result<FleetInfo, ApiError> {
        self.definition(&req.fleet).await?;
        self.edit_trigger(&req.fleet, |s| s.resume().then(|| "resumed: `mur fleet start` cleared the pause".into()))
            .await?;
        let key = fleet_store::stopped_key(&req.fleet);
        let present = self.defs.get(&key).await.map_err(|e| unavailable("mur_fleets: read", e))?.is_some();
        if present {
            self.defs.purge(&key).await.map_err(|e| unavailable("mur_fleets: purge", e))?;
            tracing::info!(instance = %self.instance, fleet = %req.fleet, by = caller, "fleet started");
            let by = caller.map(|name| format!(" by {name}")).unwrap_or_default();
            self.note(&req.fleet, EventKind::StateChange, format!("started{by}: the kill-switch is cleared"), None)
                .await;
        }
        self.show(&req.fleet).await
    }

    /// `fleet.trigger`: asks the leader's trigger for one occurrence now (issue #36). A
    /// stopped fleet is refused (`conflict`); one asked already and not yet taken is kept.
    async fn trigger(&self, req: FleetRef) -> Result<FleetInfo, ApiError> {
        self.definition(&req.fleet).await?;
        if self.stop_state(&req.fleet).await.is_stopped() {
            return Err(ApiError::new(
                ErrorCode::Conflict,
                format!("fleet '{0}' is stopped (`mur fleet start {0}` clears it)", req.fleet),
            ));
        }
        let now = SystemClock.now_ms();
        self.edit_trigger(&req.fleet, |s| {
            s.manual.is_none().then(|| {
                s.manual = Some(now);
                format!(
                    "occurrence asked for by `mur fleet trigger` at {}",
                    mur_proto::fleet::schedule::show_instant(mur_proto::fleet::schedule::Tz::UTC, now)
                )
            })
        })
        .await?;
        self.show(&req.fleet).await
    }

    /// Changes `fleet`'s trigger state with a compare-and-set (retried when another write
    /// came first); `change` returns the channel line to write when it changed anything.
    async fn edit_trigger(
        &self,
        fleet: &str,
        change: impl Fn(&mut crate::fleet::schedule::State) -> Option<String>,
    ) -> Result<(), ApiError> {
        use crate::fleet::trigger::{WriteError, read_state, write_state};
        for _ in 0..CAS_ATTEMPTS {
            let stored = read_state(&self.defs, fleet).await.map_err(|e| unavailable("mur_fleets: read", e))?;
            let mut state = stored.state;
            let Some(line) = change(&mut state) else { return Ok(()) };
            match write_state(&self.defs, fleet, stored.revision, &state).await {
                Ok(_) => {
                    self.note(fleet, EventKind::StateChange, format!("trigger: {line}"), None).await;
                    return Ok(());
                }
                Err(WriteError::Changed(_)) => continue,
                Err(e) => return Err(unavailable("mur_fleets: update", e)),
            }
        }
        Err(ApiError::new(ErrorCode::Unavailable, format!("fleet {fleet}: its trigger changed too often, retry")))
    }

    /// `fleet.log`.
    async fn log(&self, req: LogRequest) -> Result<Vec<ChannelEvent>, ApiError> {
        self.definition(&req.fleet).await?;
        self.channel(&req.fleet, req.since.unwrap_or(0)).await
    }
}

/// `jobs` (oldest first) fitted into one reply of at most `max_payload` bytes
/// ([`page::fit`]: long texts, results and errors clipped), oldest first. When not all
/// fit, the open jobs come before the finished ones and the newest finished before older
/// ones: what is left out is the oldest history, never a queued job or the latest result.
fn jobs_page(jobs: Vec<Job>, max_payload: usize) -> Page<Job> {
    let (mut finished, open): (Vec<Job>, Vec<Job>) = jobs.into_iter().partition(|j| j.status.is_terminal());
    finished.reverse();
    let mut page = page::fit(open.into_iter().chain(finished), max_payload, |j| {
        let fields = [Some(&mut j.text), j.result.as_mut(), j.error.as_mut()];
        page::clip_fields(fields.into_iter().flatten()).then(|| j.id.clone())
    });
    // Ids are UUIDv7s: id order is the order they were queued in.
    page.items.sort_by(|a, b| a.id.cmp(&b.id));
    page
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_jobs_page_too_small_for_all_leaves_out_the_oldest_finished_jobs() {
        // 30 jobs of ~4 KiB each, queued in order; the 10 oldest and the 10 newest are
        // finished, the 10 between are open.
        let jobs: Vec<Job> = (0..30u64)
            .map(|i| {
                let mut j =
                    Job::with_id(uuid::Uuid::from_u64_pair(0x0190_0000_0000_7000, i), "x".repeat(4000), "cli", i);
                if !(10..20).contains(&i) {
                    j.status = JobStatus::Done;
                }
                j
            })
            .collect();
        let ids: Vec<String> = jobs.iter().map(|j| j.id.clone()).collect();
        // Room for 15 of them (page::fit keeps REPLY_MARGIN for the reply's envelope).
        let size = serde_json::to_vec(&jobs[0]).unwrap().len() + 1;
        let page = jobs_page(jobs.clone(), page::REPLY_MARGIN + 15 * size + size / 2);
        assert!(page.more);
        let kept: Vec<&str> = page.items.iter().map(|j| j.id.as_str()).collect();
        // Every open job, then the five newest finished, shown oldest first.
        let expected: Vec<&str> = ids[10..20].iter().chain(&ids[25..30]).map(String::as_str).collect();
        assert_eq!(kept, expected);
        // With room for all: all, in the order they were queued.
        let all = jobs_page(jobs, 1 << 20);
        assert!(!all.more);
        assert_eq!(all.items.iter().map(|j| j.id.as_str()).collect::<Vec<_>>(), ids);
    }
}
