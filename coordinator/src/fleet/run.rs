//! Fleet runs on the leading coordinator (issue #10 §Runs and loops): the IO around the
//! pure [`crate::fleet::machine::Run`]. Only the leader listens on
//! [`fleet_store::RUN_SUBJECT`]; a request is checked (the fleet loads, its bounds
//! resolve, the kill-switch is clear, the plan is one this version runs), answered at once
//! with the run's record (the client prints the `bounds:` line and follows), and the run
//! goes on here without the client:
//!
//! - each iteration claims its job (`running`, with the iteration's run id), writes a
//!   `delegation` event per member, submits one `peer` task per member through the task
//!   API (at most the fan-out cap at once, [`broadcast`]), waits for their terminal
//!   records (a step still running when the loop's time is up is cancelled), writes each
//!   member's `reply` event, and ends the job `done` or `failed` with the replies as its
//!   result;
//! - the run's record (`run.<id>` in `mur_fleets`) is rewritten after every iteration and
//!   at the end with the stop's label; the stop reason is the channel's last event.
//!
//! With a router, its plan is a `peer` task too (a `decision` event), and so is its DONE
//! judgment when `done_when` is empty. Every step carries the loop's time left as
//! `deadline_at`; the worker stops it then.
//!
//! A fleet with a `procedure:` runs it instead ([`procedure`]: ranks, retries, approvals).
//!
//! The kill-switch reaches a run in flight ([`halt`], issue #29 item 4): once it is set no
//! iteration, rank, step or attempt starts, running steps are canceled (kept with
//! `--drain`), the iteration's job ends `canceled` unless it got done, and the run ends
//! `stopped`.
//!
//! Each iteration's spend (its tasks' `usage` at the cluster's `prices:`) goes into the
//! record, per job and per member, and a `note` on the channel; the budget is checked by
//! the pure run before each iteration (issue #11 §Cost, [`crate::fleet::cost`]). A run a dead
//! coordinator left `running` is taken over by [`crate::fleet::adopt`] through [`resume`].

mod broadcast;
mod halt;
mod procedure;
mod traced;

use crate::fleet::api::Fleets;
use crate::fleet::cost::FleetSettings;
use crate::fleet::machine::{Next, Refused, Run, Spec, View};
use async_nats::jetstream::kv;
use bytes::Bytes;
use futures::StreamExt;
use mur_nats::clock::{Clock, SystemClock};
use mur_proto::cluster::{self, ApiError, ErrorCode, SubmitRequest, TaskRecord};
use mur_proto::fanout::FleetStep;
use mur_proto::fleet::{self, Fleet, JobStatus, RunFlags, Stop};
use mur_proto::fleet_store::{self, Author, ChannelEvent, EventKind, RunRecord, RunRequest};
use mur_proto::task::{Origin, TaskState};
use std::time::Duration;
use tokio::sync::watch;
use traced::{StepKind, mark_error};
use tracing::Instrument as _;

/// How long past a step's deadline the coordinator waits for its record before it cancels
/// the task itself.
const WAIT_SLACK: Duration = Duration::from_secs(10);

/// The reply of a step the kill-switch kept from starting.
const NOT_STARTED: &str = "not started: the fleet was stopped";

/// The reply of a step the kill-switch canceled while it ran.
const CANCELED_BY_STOP: &str = "canceled: the fleet was stopped";

/// Run records known to be over, so the leader's once-a-second scans (adoption,
/// triggers) do not read them again; forgotten every minute, so that a run id reused with
/// `--run-id` is seen within it.
pub struct OverCache {
    keys: std::collections::HashSet<String>,
    since: tokio::time::Instant,
}

impl OverCache {
    /// How long a key is remembered.
    const KEEP: Duration = Duration::from_secs(60);

    /// An empty cache.
    pub fn new() -> OverCache {
        OverCache { keys: Default::default(), since: tokio::time::Instant::now() }
    }

    /// Forgets everything once a minute has passed since it last did.
    pub fn expire(&mut self) {
        if self.since.elapsed() > Self::KEEP {
            self.keys.clear();
            self.since = tokio::time::Instant::now();
        }
    }

    /// Whether `key` (a `run.<id>` key) is known to be over.
    pub fn contains(&self, key: &str) -> bool {
        self.keys.contains(key)
    }

    /// Remembers that `key`'s run is over.
    pub fn insert(&mut self, key: String) {
        self.keys.insert(key);
    }
}

impl Default for OverCache {
    fn default() -> Self {
        OverCache::new()
    }
}

/// What a run on this coordinator needs besides its record.
#[derive(Clone)]
pub struct Env {
    /// The coordinator's connection.
    pub client: async_nats::Client,
    /// The fleet state.
    pub fleets: Fleets,
    /// `mur_tasks`.
    pub tasks: kv::Store,
    /// `mur_capsule_index` (each capsule's model, for pricing).
    pub capsule_index: kv::Store,
    /// This coordinator's name.
    pub instance: String,
    /// `prices:` and `fleet.autorun` of the cluster config.
    pub settings: FleetSettings,
    /// The runs this process is carrying out (run ids): never taken over by itself.
    pub active: Active,
}

/// Run ids being carried out in this process.
pub type Active = std::sync::Arc<std::sync::Mutex<std::collections::HashSet<String>>>;

/// Keeps a run id in [`Env::active`] while its executor lives.
struct ActiveGuard(Active, String);

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.0.lock().expect("active runs poisoned").remove(&self.1);
    }
}

/// Serves run requests until `stopped` (the leader stepping down or stopping).
pub async fn serve(env: Env, mut stopped: watch::Receiver<bool>) -> &'static str {
    let Env { client, instance, .. } = env.clone();
    let mut requests = match client.subscribe(fleet_store::RUN_SUBJECT).await {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(%instance, "subscribing to fleet run requests: {e}");
            return "the fleet run loop";
        }
    };
    loop {
        let msg = tokio::select! {
            _ = stopped.changed() => return "the fleet run loop",
            m = requests.next() => match m {
                Some(m) => m,
                None => return "the fleet run loop",
            },
        };
        // The request's span, joined to the caller's (`mur fleet run`'s); the run keeps
        // its `traceparent` for its iterations' spans (issue #32 §Fleet runs traced).
        let span = tracing::info_span!(
            "fleet_run",
            otel.name = %format!("process {}", fleet_store::RUN_SUBJECT),
            otel.kind = "server",
            messaging.system = "nats",
            messaging.operation.type = "process",
            messaging.destination.name = fleet_store::RUN_SUBJECT,
            mur.fleet = tracing::field::Empty,
            mur.run_id = tracing::field::Empty,
        );
        let traceparent = mur_nats::trace_context::join(&span, msg.headers.as_ref());
        let answer = match serde_json::from_slice::<RunRequest>(&msg.payload) {
            Ok(request) => {
                span.record("mur.fleet", request.fleet.as_str());
                let launched = launch(&env, request, traceparent).instrument(span.clone()).await;
                if let Ok(record) = &launched {
                    span.record("mur.run_id", record.run_id.as_str());
                }
                launched
            }
            Err(e) => Err(invalid(format!("request: {e}"))),
        }
        .and_then(|record| {
            serde_json::to_vec(&record).map(Bytes::from).map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))
        });
        if let Some(reply) = msg.reply {
            let (headers, body) = match answer {
                Ok(body) => (async_nats::HeaderMap::new(), body),
                Err(e) => mur_nats::api::error_reply(&e),
            };
            if let Err(e) = client.publish_with_headers(reply, headers, body).await {
                tracing::warn!(%instance, "answering a run request: {e}");
            }
        }
    }
}

fn invalid(message: impl Into<String>) -> ApiError {
    ApiError::invalid(message)
}

/// Starts a run on this coordinator (a `mur fleet run` request, or a trigger firing):
/// checks it, writes its first record (keeping the request's W3C `traceparent`, if any),
/// and carries it out in the background. Returns the first record.
///
/// # Errors
/// Why the run cannot start (a stopped fleet: `conflict`; bad input: `invalid_request`).
pub async fn launch(env: &Env, request: RunRequest, traceparent: Option<String>) -> Result<RunRecord, ApiError> {
    let (run, record) = start(env, request, traceparent).await?;
    let exec = Exec::new(env, record.clone(), &run);
    tokio::spawn(exec.drive(run));
    Ok(record)
}

/// Goes on with a run another coordinator left behind: `record` is its last record (the
/// caller has claimed it, `coordinator` naming this one).
pub fn resume(env: &Env, run: Run, record: RunRecord) {
    tokio::spawn(Exec::new(env, record, &run).drive(run));
}

/// The spec of a run from its request and fleet: bounds, metering, the clock.
///
/// # Errors
/// Bad input (`invalid_request`).
pub async fn spec_of(
    env: &Env,
    fleet: &Fleet,
    request: &RunRequest,
    run_id: String,
    job: Option<String>,
    started_at: u64,
) -> Result<(Spec, mur_proto::fleet::Bounds, Option<String>), ApiError> {
    let flags = RunFlags {
        r#loop: request.looping,
        deadline: request.deadline.clone(),
        budget_usd: request.budget_usd,
        run_id: request.run_id.clone(),
        max_iterations: None,
    };
    let bounds = fleet::resolve_bounds(fleet, &flags, &env.settings.limits).map_err(|e| invalid(e.to_string()))?;
    let models = crate::fleet::cost::models_of(&env.capsule_index, &crate::fleet::cost::capsules_of(fleet)).await;
    let rate = crate::fleet::cost::rate_override(&|k| std::env::var(k).ok());
    let metering = crate::fleet::cost::metering(fleet, &bounds, &env.settings.prices, &models, rate);
    let spec = Spec {
        run_id,
        fleet: fleet.clone(),
        looping: request.looping,
        job,
        deadline: bounds.deadline.value,
        stuck: bounds.stuck.value,
        started_at,
        budget_usd: metering.budget_usd,
        guard_rate: metering.guard_rate,
    };
    Ok((spec, bounds, metering.notice))
}

/// Checks a request and makes the run and its first record.
async fn start(env: &Env, request: RunRequest, traceparent: Option<String>) -> Result<(Run, RunRecord), ApiError> {
    let fleets = &env.fleets;
    let (revision, text) = fleets.definition(&request.fleet).await?;
    let fleet = Fleet::load_stored(&text).map_err(|e| invalid(e.to_string()))?;
    if let Some(id) = &request.run_id {
        // The rule names the flag already (`--run-id: must be …`).
        fleet::check_run_id(id).map_err(invalid)?;
        // A second run under the id of one still running would share (and overwrite) its
        // record: refused. A finished run's id may be used again.
        if let Ok(Some(entry)) = fleets.defs().entry(fleet_store::run_key(id)).await
            && entry.operation == kv::Operation::Put
            && serde_json::from_slice::<RunRecord>(&entry.value).is_ok_and(|r| r.state == "running")
        {
            return Err(ApiError::new(
                ErrorCode::Conflict,
                format!("--run-id: run {id} is still running; give another id or wait for it to end"),
            ));
        }
    }
    let run_id = request.run_id.clone().unwrap_or_else(|| {
        let id = uuid::Uuid::now_v7();
        if request.looping { fleet::loop_run_id(&fleet.name, id) } else { fleet::one_shot_run_id(id) }
    });
    let jobs: Vec<_> = fleets.jobs_of(&fleet.name).await?.into_iter().map(|(_, j)| j).collect();
    let job = match &request.job {
        Some(prefix) => {
            let matching: Vec<_> = jobs.iter().filter(|j| j.id.starts_with(prefix.as_str())).collect();
            match matching.as_slice() {
                [one] => Some(one.id.clone()),
                [] => {
                    return Err(ApiError::new(
                        ErrorCode::NotFound,
                        format!("job: no job {prefix} in fleet {}", fleet.name),
                    ));
                }
                _ => return Err(invalid(format!("job: {prefix} names several jobs; give more of the id"))),
            }
        }
        None => None,
    };
    let now = SystemClock.now_ms();
    let stopped = fleets.stop_state(&fleet.name).await;
    let view = View { now, stopped: Ok(stopped.is_stopped()), jobs: &jobs, last_agent_event: None };
    let (spec, bounds, notice) = spec_of(env, &fleet, &request, run_id.clone(), job, now).await?;
    let (budget_usd, guard_rate) = (spec.budget_usd, spec.guard_rate);
    let run = Run::check_convergence(&spec).and_then(|()| Run::start(spec, &view)).map_err(|e| match e {
        Refused::Stopped(_) => ApiError::new(ErrorCode::Conflict, e.to_string()),
        other => invalid(other.to_string()),
    })?;
    let record = RunRecord {
        run_id: run_id.clone(),
        fleet: fleet.name.clone(),
        state: "running".into(),
        stop: None,
        bounds: bounds.line(),
        coordinator: env.instance.clone(),
        iterations: 0,
        started_at: now,
        updated_at: now,
        ended_at: None,
        request: Some(request),
        notices: notice.into_iter().collect(),
        budget_usd,
        guard_rate,
        spend: Default::default(),
        members: Default::default(),
        jobs: Default::default(),
        traceparent,
    };
    put_record(fleets, &record).await?;
    if let Err(e) = still_defined(fleets, &fleet.name, revision).await {
        if let Err(purge) = fleets.defs().purge(fleet_store::run_key(&run_id)).await {
            tracing::warn!(fleet = %fleet.name, run = %run_id, "removing the record of a run not started: {purge}");
        }
        return Err(e);
    }
    Ok((run, record))
}

/// Checked once a run's record is written (so a `mur fleet rm` looking for runs from now
/// on sees it): the definition read at `revision` is still the fleet's and no removal of
/// it is under way (`fleet_store::Removing`).
///
/// # Errors
/// `conflict` when the fleet was removed, replaced or is being removed; `unavailable`
/// when the bucket cannot be read.
async fn still_defined(fleets: &Fleets, fleet: &str, revision: u64) -> Result<(), ApiError> {
    let read = |e| ApiError::new(ErrorCode::Unavailable, format!("mur_fleets: read: {e}"));
    let gone = || {
        ApiError::new(
            ErrorCode::Conflict,
            format!("fleet {fleet} was removed or replaced while the run started; nothing was run"),
        )
    };
    if fleets.removal_under_way(fleet, revision).await? {
        return Err(ApiError::new(
            ErrorCode::Conflict,
            format!("fleet {fleet} is being removed (mur fleet rm); nothing was run"),
        ));
    }
    match fleets.defs().entry(fleet_store::def_key(fleet)).await.map_err(read)? {
        Some(entry) if entry.operation == kv::Operation::Put && entry.revision == revision => Ok(()),
        _ => Err(gone()),
    }
}

/// Writes a run's record.
///
/// # Errors
/// `unavailable` when the bucket refuses.
pub async fn put_record(fleets: &Fleets, record: &RunRecord) -> Result<(), ApiError> {
    let json = serde_json::to_vec(record).map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))?;
    fleets
        .defs()
        .put(fleet_store::run_key(&record.run_id), json.into())
        .await
        .map(drop)
        .map_err(|e| ApiError::new(ErrorCode::Unavailable, format!("mur_fleets: put: {e}")))
}

/// `at` (unix ms) plus `d`, saturating: a time that does not fit is the end of time.
pub(crate) fn ms_after(at: u64, d: Duration) -> u64 {
    at.saturating_add(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// One run being carried out.
struct Exec {
    client: async_nats::Client,
    fleets: Fleets,
    tasks: kv::Store,
    record: RunRecord,
    /// The fan-out cap every step of this run waits for (issue #11): the fleet's
    /// `fanout:`, else this coordinator's `MUR_FLEET_FANOUT`, else 3.
    fanout: u32,
    /// The fleet's `needs:`, sent with every delegated step.
    needs: Vec<String>,
    settings: FleetSettings,
    /// Usage of the tasks waited for, by capsule, until the iteration accounts it.
    tally: crate::fleet::cost::Tally,
    active: Active,
    /// The job an `awaiting-approval` stop left blocked, named in the stop's remedy.
    blocked_job: Option<String>,
    /// The kill-switch as this run has seen it ([`halt::watch`]).
    halt: halt::HaltFlag,
    /// Whether the run loops (its iterations start traces of their own, [`traced`]).
    looping: bool,
    /// The current iteration's span ([`traced`]); none between iterations.
    iteration: tracing::Span,
}

impl Exec {
    fn new(env: &Env, record: RunRecord, run: &Run) -> Exec {
        let fleet = &run.spec().fleet;
        Exec {
            client: env.client.clone(),
            fleets: env.fleets.clone(),
            tasks: env.tasks.clone(),
            record,
            fanout: fleet::resolve_fanout(fleet.fanout, &|k| std::env::var(k).ok()).cap,
            needs: fleet.needs.clone(),
            settings: env.settings.clone(),
            tally: Default::default(),
            active: env.active.clone(),
            blocked_job: None,
            halt: Default::default(),
            looping: run.spec().looping,
            iteration: tracing::Span::none(),
        }
    }

    /// Whether the run's record still names this coordinator: a coordinator that was
    /// thought dead (its heartbeat stopped, [`crate::fleet::adopt`]) and comes back must not
    /// drive a run another one took over. A record that cannot be read is taken as ours.
    async fn still_ours(&self) -> bool {
        match self.fleets.defs().get(fleet_store::run_key(&self.record.run_id)).await {
            Ok(Some(v)) => serde_json::from_slice::<RunRecord>(&v)
                .map_or(true, |r| r.coordinator == self.record.coordinator && !r.is_over()),
            _ => true,
        }
    }

    /// Accounts the iteration just ended (ref §3 step 13): its tasks' usage into the run's
    /// record (run, job, members) and the run's spend, and a `note` on the channel.
    async fn account(&mut self, run: &mut Run, iteration_run_id: &str, job: Option<&str>) {
        let usages = self.tally.take();
        let spend = crate::fleet::cost::account(&mut self.record, &self.settings.prices, job, &usages);
        run.spent(spend.usd, !usages.iter().all(|(_, u)| u.is_empty()));
        let members = usages.iter().map(|(c, _)| c.as_str()).collect::<std::collections::BTreeSet<_>>();
        let per_member = members
            .into_iter()
            .filter_map(|m| self.record.members.get(m).map(|s| format!("{m} {}", s.summary())))
            .collect::<Vec<_>>()
            .join("; ");
        let text = format!(
            "spend: iteration {iteration_run_id} {}; run {} ${:.4}; members: {per_member}",
            spend.summary(),
            self.record.run_id,
            run.spent_usd()
        );
        self.event(EventKind::Note, Author::System, text, Some(iteration_run_id), job).await;
    }

    async fn drive(mut self, mut run: Run) {
        let fleet = self.record.fleet.clone();
        self.active.lock().expect("active runs poisoned").insert(self.record.run_id.clone());
        let _active = ActiveGuard(self.active.clone(), self.record.run_id.clone());
        let _halt = halt::watch(self.fleets.clone(), fleet.clone(), self.halt.clone());
        // The heartbeat `mur job status` judges liveness by; it stops with this future, how
        // ever it ends (a panic included: the run is then dead, not alive for ever).
        let beat = tokio_util::task::AbortOnDropHandle::new(tokio::spawn({
            let defs = self.fleets.defs().clone();
            let key = fleet_store::beat_key(&self.record.run_id);
            async move {
                let mut tick = tokio::time::interval(Duration::from_millis(fleet_store::RUN_BEAT_EVERY_MS));
                loop {
                    tick.tick().await;
                    if let Err(e) = defs.put(&key, SystemClock.now_ms().to_string().into()).await {
                        tracing::debug!(key, "run heartbeat: {e}");
                    }
                }
            }
        }));
        if self.record.iterations == 0 {
            self.event(
                EventKind::StateChange,
                Author::System,
                fleet_store::run_started_text(&self.record.run_id, &self.record.bounds),
                None,
                None,
            )
            .await;
            for notice in self.record.notices.clone() {
                self.event(EventKind::Note, Author::System, fleet_store::notice_text(&notice), None, None).await;
            }
        }
        let mut last_agent: Option<u64> = None;
        let stop = loop {
            self.end_iteration(None);
            if !self.still_ours().await {
                tracing::warn!(fleet, run = %self.record.run_id, "another coordinator took the run over: leaving it");
                beat.abort();
                return;
            }
            if self.halt.raised() {
                break Stop::Stopped;
            }
            let jobs: Vec<_> = match self.fleets.jobs_of(&fleet).await {
                Ok(j) => j.into_iter().map(|(_, j)| j).collect(),
                Err(e) => {
                    tracing::warn!(fleet, "reading jobs: {e}");
                    Vec::new()
                }
            };
            let stopped = self.fleets.stop_state(&fleet).await;
            // Asked to stop by its fleet's trigger (`loop.overlap: cancel_previous`): it ends
            // `stopped` at this iteration boundary (a step under way finished).
            let canceled = self.canceled().await;
            let view = View {
                now: SystemClock.now_ms(),
                stopped: Ok(stopped.is_stopped() || canceled),
                jobs: &jobs,
                last_agent_event: last_agent,
            };
            let mut next = run.next(&view);
            let mut claimed: Option<String> = None;
            let planned = matches!(next, Next::Plan { .. });
            if let Next::Plan { iteration_run_id, job, router, text, time_left, .. } = &next {
                let mut work = None;
                if let Some(id) = job {
                    let Some(j) = self.claim(&fleet, id, iteration_run_id).await else { continue };
                    claimed = Some(id.clone());
                    work = Some(j);
                }
                self.begin_iteration(iteration_run_id, work.as_ref());
                self.event(
                    EventKind::Delegation,
                    Author::System,
                    format!("{router} ← plan"),
                    Some(iteration_run_id),
                    job.as_deref(),
                )
                .await;
                let deadline_at = ms_after(SystemClock.now_ms(), *time_left);
                let span = self.step_span(StepKind::Plan, router);
                let (ok, reply) = match self.delegate(span, router, text, deadline_at, *time_left).await {
                    Ok(replied) => replied,
                    Err(e) => (false, format!("error: the router's task was refused: {e}")),
                };
                self.event(EventKind::Decision, Author::Router, reply.clone(), Some(iteration_run_id), job.as_deref())
                    .await;
                next = run.planned(if ok { Ok(&reply) } else { Err(&reply) });
                if let (true, Some(id)) = (self.halt.raised(), &claimed) {
                    self.end_job(&fleet, id, JobStatus::Canceled, &reply).await;
                }
            }
            match next {
                Next::Stop(stop) => break stop,
                Next::Plan { .. } => {
                    // The router's plan failed: so did the iteration.
                    self.end_iteration(Some(Stop::IterationFailed.label()));
                    break Stop::IterationFailed;
                }
                Next::Procedure { iteration_run_id, job, work, .. } => {
                    if !self.run_procedure(&mut run, &iteration_run_id, job.as_deref(), &work, &mut last_agent).await {
                        continue;
                    }
                }
                Next::Iterate { iteration_run_id, job, steps, .. } => {
                    let mut work = None;
                    if let Some(id) = &job
                        && claimed.as_deref() != Some(id.as_str())
                    {
                        let Some(j) = self.claim(&fleet, id, &iteration_run_id).await else { continue };
                        work = Some(j);
                    }
                    if !planned || work.is_some() {
                        self.begin_iteration(&iteration_run_id, work.as_ref());
                    }
                    let replies = self.send_steps(run.spec(), &steps, &iteration_run_id, job.as_deref()).await;
                    last_agent = Some(SystemClock.now_ms());
                    let it = run.iteration_ended(&replies);
                    if let Some((router, text)) = it.judge.as_ref().filter(|_| !self.halt.raised()) {
                        let elapsed = Duration::from_millis(SystemClock.now_ms().saturating_sub(run.spec().started_at));
                        let left = fleet::inherited_deadline(run.spec().deadline, elapsed);
                        let span = self.step_span(StepKind::Judge, router);
                        let deadline_at = ms_after(SystemClock.now_ms(), left);
                        let (_, verdict) = match self.delegate(span, router, text, deadline_at, left).await {
                            Ok(replied) => replied,
                            Err(e) => (false, format!("error: {e}")),
                        };
                        self.event(
                            EventKind::Decision,
                            Author::Router,
                            verdict.clone(),
                            Some(&iteration_run_id),
                            job.as_deref(),
                        )
                        .await;
                        run.judged(&verdict);
                    }
                    let mut ended = None;
                    if let Some(id) = &job {
                        let status = match (it.job_done, self.halt.raised()) {
                            (true, _) => JobStatus::Done,
                            (false, true) => JobStatus::Canceled,
                            (false, false) => JobStatus::Failed,
                        };
                        self.end_job(&fleet, id, status, &it.result).await;
                        ended = (status != JobStatus::Done).then_some(status);
                    }
                    self.account(&mut run, &iteration_run_id, job.as_deref()).await;
                    self.end_iteration(ended.map(JobStatus::as_str));
                    self.record.iterations += 1;
                    self.record.updated_at = SystemClock.now_ms();
                    if !self.still_ours().await {
                        tracing::warn!(fleet, run = %self.record.run_id, "another coordinator took the run over: leaving it");
                        beat.abort();
                        return;
                    }
                    if let Err(e) = put_record(&self.fleets, &self.record).await {
                        tracing::warn!(fleet, "writing the run record: {e}");
                    }
                }
            }
        };
        self.end_iteration(None);
        beat.abort();
        // Stop means stop: a run the kill-switch reached mid-iteration did not converge,
        // whatever its last iteration came to.
        let stop = if self.halt.raised() { Stop::Stopped } else { stop };
        self.finish(stop).await;
    }

    /// Ends `job` of `fleet` in `status` with `result`, unless it ended meanwhile (a
    /// `mur fleet cancel`).
    async fn end_job(&self, fleet: &str, id: &str, status: JobStatus, result: &str) {
        let ended = self
            .fleets
            .update_job(fleet, id, |j| {
                if j.status.is_terminal() {
                    return Ok(()); // canceled meanwhile: leave it
                }
                j.transition(status, SystemClock.now_ms())
                    .map_err(|e| ApiError::new(ErrorCode::Conflict, e.to_string()))?;
                j.result = Some(result.to_string());
                Ok(())
            })
            .await;
        if let Err(e) = ended {
            tracing::warn!(fleet, job = %id, "ending the job: {e}");
        }
    }

    /// Claims `job` for `iteration_run_id`: the job as claimed, or `None` when it cannot be
    /// (canceled meanwhile, say: the next iteration picks again).
    async fn claim(&self, fleet: &str, job: &str, iteration_run_id: &str) -> Option<mur_proto::fleet::Job> {
        let claimed = self
            .fleets
            .update_job(fleet, job, |j| {
                j.claim(iteration_run_id, SystemClock.now_ms())
                    .map_err(|e| ApiError::new(ErrorCode::Conflict, e.to_string()))
            })
            .await;
        if let Err(e) = &claimed {
            tracing::info!(fleet, job, "job not claimed: {e}");
        }
        claimed.ok()
    }

    /// Whether the fleet's trigger asked this run to stop (`cancel.<run id>`, issue #36).
    async fn canceled(&self) -> bool {
        matches!(self.fleets.defs().get(fleet_store::cancel_key(&self.record.run_id)).await, Ok(Some(_)))
    }

    async fn finish(&mut self, stop: Stop) {
        let canceled = self.canceled().await;
        if canceled && let Err(e) = self.fleets.defs().purge(fleet_store::cancel_key(&self.record.run_id)).await {
            tracing::warn!(run = %self.record.run_id, "removing the run's cancel mark: {e}");
        }
        // Tasks waited for since the last iteration (a router's plan that failed).
        let rest = self.tally.take();
        if !rest.is_empty() {
            crate::fleet::cost::account(&mut self.record, &self.settings.prices, None, &rest);
        }
        let now = SystemClock.now_ms();
        self.record.state = stop.run_state().into();
        self.record.stop = Some(stop.label().into());
        self.record.ended_at = Some(now);
        self.record.updated_at = now;
        let mut text =
            format!("run {} stopped: {}; spent {}", self.record.run_id, stop.label(), self.record.spend.summary());
        let mut report = fleet_store::StopReport::new(
            stop,
            &self.record.fleet,
            &self.record.run_id,
            self.record.iterations,
            self.record.spend.usd,
            self.blocked_job.as_deref(),
        );
        if canceled && stop == Stop::Stopped {
            // Not the kill-switch: the fleet's trigger stopped it for a newer occurrence.
            report.remedy =
                Some("stopped for a newer occurrence of its trigger (loop.overlap: cancel_previous)".into());
        }
        if let Some(remedy) = &report.remedy {
            text.push_str(&format!("; {remedy}"));
        }
        let event = ChannelEvent {
            seq: 0,
            at: now,
            author: Author::System,
            kind: EventKind::Stop,
            text,
            run_id: Some(self.record.run_id.clone()),
            job_id: None,
            stop: Some(report),
        };
        if let Err(e) = self.fleets.publish(&self.record.fleet, &event).await {
            tracing::warn!(fleet = %self.record.fleet, "channel event not written: {e}");
        }
        if let Err(e) = put_record(&self.fleets, &self.record).await {
            tracing::warn!(fleet = %self.record.fleet, "writing the run record: {e}");
        }
    }

    async fn event(&self, kind: EventKind, author: Author, text: String, run_id: Option<&str>, job_id: Option<&str>) {
        let event = ChannelEvent {
            seq: 0,
            at: SystemClock.now_ms(),
            author,
            kind,
            text,
            run_id: Some(run_id.unwrap_or(&self.record.run_id).to_string()),
            job_id: job_id.map(str::to_string),
            stop: None,
        };
        if let Err(e) = self.fleets.publish(&self.record.fleet, &event).await {
            tracing::warn!(fleet = %self.record.fleet, "channel event not written: {e}");
        }
    }

    /// Submits a delegated step: a `peer` task for `member` that must be over by
    /// `deadline_at` (the time left on the loop's clock; the worker enforces it), carrying
    /// the fleet's `needs` (the worker checks them before it starts), and runs only while
    /// it holds one of the run's `fanout` permits (issue #11).
    ///
    /// # Errors
    /// `conflict` once the kill-switch was set (nothing is sent), else the API's refusal.
    async fn submit(&self, member: &str, text: &str, deadline_at: u64) -> Result<String, ApiError> {
        if halt::read(&self.fleets, &self.record.fleet, &self.halt).await {
            return Err(ApiError::new(ErrorCode::Conflict, NOT_STARTED));
        }
        let mut request = SubmitRequest {
            capsule: member.into(),
            text: text.into(),
            origin: Origin::Peer,
            context_id: None,
            deadline_at: Some(deadline_at),
            needs: self.needs.clone(),
            fleet_step: Some(FleetStep {
                fleet: self.record.fleet.clone(),
                run_id: self.record.run_id.clone(),
                step: member.into(),
                cap: self.fanout,
            }),
            task_id: None,
            message_id: None,
        };
        // Sent again, the same task, while no coordinator answers (a leader failover).
        mur_nats::api::submit(&self.client, &mut request, mur_nats::api::SUBMIT_PATIENCE, |e, delay| {
            tracing::info!(error = %e, delay_ms = delay.as_millis() as u64, "step task not taken yet; sending it again");
        })
        .await
        .map(|r| r.task_id.into_string())
    }

    /// Waits for `task_id`'s terminal record: `(completed, result text)`. The worker ends
    /// the task at its deadline; a task still not over [`WAIT_SLACK`] after it (never
    /// started: no worker free) is cancelled. Once the kill-switch asks for it
    /// ([`halt::Halt::Cancel`]) the task is cancelled at once, and waited for
    /// [`WAIT_SLACK`] more at most.
    async fn wait(&self, task_id: &str, time_left: Duration) -> (bool, String) {
        let mut deadline = tokio::time::Instant::now() + time_left + WAIT_SLACK;
        let mut backoff = Duration::from_millis(20);
        let mut stopped = false;
        loop {
            if let Ok(Some(value)) = self.tasks.get(task_id).await
                && let Ok(r) = serde_json::from_slice::<TaskRecord>(&value)
                && r.state.is_terminal()
            {
                self.tally.note(&r.capsule, r.usage.as_ref());
                if r.state != TaskState::Completed {
                    let status = r.exit_status.map_or(r.state.as_str(), |s| s.as_str());
                    mark_error(&tracing::Span::current(), if stopped { "canceled" } else { status });
                }
                let result = r.result.unwrap_or_default();
                return match (r.state == TaskState::Completed, stopped) {
                    (false, true) => (false, format!("{CANCELED_BY_STOP} ({result})")),
                    (ok, _) => (ok, result),
                };
            }
            if !stopped && self.halt.get() == halt::Halt::Cancel {
                stopped = true;
                tracing::info!(run = %self.record.run_id, task_id, "the fleet was stopped: canceling its step");
                if let Err(e) =
                    mur_nats::api::call::<TaskRecord>(&self.client, cluster::api::TASK_CANCEL, task_id.to_string())
                        .await
                {
                    tracing::info!(run = %self.record.run_id, task_id, "canceling a step: {e}");
                }
                deadline = deadline.min(tokio::time::Instant::now() + WAIT_SLACK);
                backoff = Duration::from_millis(20);
                continue;
            }
            if tokio::time::Instant::now() >= deadline {
                if stopped {
                    mark_error(&tracing::Span::current(), "canceled");
                    return (false, CANCELED_BY_STOP.into());
                }
                mark_error(&tracing::Span::current(), "deadline");
                let _ = mur_nats::api::call::<TaskRecord>(&self.client, cluster::api::TASK_CANCEL, task_id.to_string())
                    .await;
                return (false, "error: the step outlived the loop's deadline and was canceled".into());
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_millis(250));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_time_past_the_end_of_time_is_the_end_of_time() {
        assert_eq!(ms_after(1_000, Duration::from_secs(2)), 3_000);
        assert_eq!(ms_after(u64::MAX - 1, Duration::from_millis(5)), u64::MAX);
        assert_eq!(ms_after(1, Duration::MAX), u64::MAX);
    }
}
