//! The `mur` micro service's endpoints: task intake (with the leader's shortcuts and their
//! order, [`IntakeOrder`]), task and capsule queries, cancel, cluster status.

use super::*;
use mur_proto::task::{Lane, Origin};
use serde::Serialize;

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
pub(super) struct IntakeOrder {
    /// Requests this process's standby context is answering now (a submission among them
    /// may be about to create its record).
    pub(super) standby_requests: AtomicUsize,
    /// The highest revision a creation by this process's standby context returned.
    pub(super) standby_created: AtomicU64,
    /// The highest `mur_tasks` revision the leader's watch (or its restore) has handed to
    /// the scheduler.
    pub(super) watched: AtomicU64,
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
pub(super) fn answer_as_standby(ctx: &Arc<Ctx>, intake: &Arc<IntakeOrder>, kind: Endpoint, request: Request) {
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
    pub(super) fn new(intake: &Arc<IntakeOrder>) -> Self {
        intake.standby_requests.fetch_add(1, Ordering::SeqCst);
        StandbyRequest(intake.clone())
    }
}

impl Drop for StandbyRequest {
    fn drop(&mut self) {
        self.0.standby_requests.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The API endpoints.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Endpoint {
    Submit,
    Get,
    List,
    Cancel,
    Capsules,
    Status,
    Fleet(crate::fleet::api::Op),
}

impl Endpoint {
    pub(super) const ALL: [Endpoint; 6] =
        [Endpoint::Submit, Endpoint::Get, Endpoint::List, Endpoint::Cancel, Endpoint::Capsules, Endpoint::Status];

    pub(super) fn subject(self) -> &'static str {
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

/// `task.list`'s optional request body (the console, issue #38, builds one too).
#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ListRequest {
    /// Only tasks in this state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) state: Option<TaskState>,
    /// At most this many (the newest), 1 to [`LIST_LIMIT`]; [`LIST_LIMIT`] when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) limit: Option<usize>,
    /// Only tasks of this capsule (the A2A endpoint's `ListTasks`, issue #29 item 6).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) capsule: Option<String>,
    /// Only tasks of this context.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) context_id: Option<String>,
    /// Only tasks waiting or run in this lane (issue #38).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) lane: Option<Lane>,
    /// Only tasks of this origin (issue #38).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) origin: Option<Origin>,
    /// Only tasks older than this one in the list's order (submitted earlier, or at the
    /// same millisecond with a smaller id): the next page after a page ending with it
    /// (issue #38: the console pages through any number of tasks).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) before: Option<ListCursor>,
}

/// Where a page of `task.list` ends: the last task's `submitted_at` and id.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ListCursor {
    /// The task's `submitted_at`, unix ms.
    pub submitted_at: u64,
    /// The task's id.
    pub task_id: String,
}

impl ListRequest {
    /// Whether `record` passes the request's filters.
    pub(crate) fn matches(&self, record: &TaskRecord) -> bool {
        self.state.is_none_or(|s| s == record.state)
            && self.capsule.as_ref().is_none_or(|c| *c == record.capsule)
            && self.context_id.as_ref().is_none_or(|c| *c == record.context_id)
            && self.lane.is_none_or(|l| l == record.lane)
            && self.origin.is_none_or(|o| o == record.origin)
            && self
                .before
                .as_ref()
                .is_none_or(|b| (record.submitted_at, record.task_id.as_str()) < (b.submitted_at, b.task_id.as_str()))
    }
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

pub(super) fn to_json<T: serde::Serialize>(value: &T) -> Result<Bytes, ApiError> {
    serde_json::to_vec(value).map(Bytes::from).map_err(|e| internal("reply", e))
}

impl Ctx {
    pub(super) async fn handle(self: &Arc<Self>, kind: Endpoint, request: Request) {
        let body = &request.message.payload;
        let result = match kind {
            Endpoint::Submit => self.submit(request.message.headers.as_ref(), body).await.and_then(|r| to_json(&r)),
            Endpoint::Get => self.get(body).await.and_then(|r| to_json(&r)),
            Endpoint::List => self.list(body).await.and_then(|r| to_json(&r)),
            Endpoint::Cancel => self.cancel(body).await.and_then(|r| to_json(&r)),
            Endpoint::Capsules => self.capsules().await.and_then(|r| to_json(&r)),
            Endpoint::Status => self.status().await.and_then(|r| to_json(&r)),
            Endpoint::Fleet(op) => match self.caller(kind, request.message.headers.as_ref()) {
                Ok(caller) => self.fleets.handle(op, request.message.headers.as_ref(), body, caller.as_deref()).await,
                Err(e) => Err(e),
            },
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

    /// Who called `kind`, as nats-server states it ([`mur_nats::identity`]): `Some(name)`
    /// for the endpoints that record a name when this coordinator has an identity
    /// connection (they reach it through that connection only), `None` otherwise (no
    /// identity connection: the handler records the name the request gives, unverified).
    fn caller(&self, kind: Endpoint, headers: Option<&async_nats::HeaderMap>) -> Result<Option<String>, ApiError> {
        let subject = kind.subject();
        match &self.identities {
            Some(ids) if mur_nats::identity::IDENTITY_SUBJECTS.contains(&subject) => {
                ids.caller(subject, headers).map(Some).map_err(|e| ApiError::invalid(e.to_string()))
            }
            _ => Ok(None),
        }
    }

    /// `task.submit`: validates, checks the capsule, creates the record. Its span is a
    /// child of the request's `traceparent` header, and the record keeps the span's own
    /// `traceparent` (issue #7 §Trace context).
    pub(super) async fn submit(
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
        let task_id = request.task_id.clone().unwrap_or_else(TaskId::generate);
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
            self.releasing.lock().expect("releasing lock").insert(task_id.clone());
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
                    let _ = self.inputs.send(Input::Ended { task_id: task_id.clone() });
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
    pub(super) async fn admit(&self, record: &TaskRecord, queue_capsule: bool) -> bool {
        if self.lease.is_none() {
            return false;
        }
        let (answer, admitted) = oneshot::channel();
        let asked = Admission {
            task_id: record.task_id.clone(),
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
    pub(super) async fn get(&self, body: &[u8]) -> Result<TaskRecord, ApiError> {
        let task_id = task_ref(body)?;
        Ok(self.read_task(&task_id).await?.1)
    }

    pub(super) async fn read_task(&self, task_id: &TaskId) -> Result<(u64, TaskRecord), ApiError> {
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
    /// ([`mur_nats::read::latest`]: its consumer is deleted when the pass is over, so a
    /// flood of status requests leaves none behind; issue #29 item 3). Nothing is held: a store of thousands of long results used to be
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
    pub(super) async fn scan_records(&self, mut visit: impl FnMut(&str, Option<TaskRecord>)) -> Result<(), ApiError> {
        let pass = async {
            let _turn = self.scans.acquire().await.map_err(|e| ApiError::new(ErrorCode::Unavailable, e.to_string()))?;
            mur_nats::read::latest(&self.tasks, ">", |entry| visit(&entry.key, self.record_of(&entry)))
                .await
                .map_err(|e| unavailable("mur_tasks: read", e))
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
    pub(super) async fn list(&self, body: &[u8]) -> Result<Page<TaskRecord>, ApiError> {
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
            let Some(mut r) = record.filter(|r| filter.matches(r)) else { return };
            let fields = [Some(&mut r.text), r.result.as_mut(), r.error.as_mut()];
            if page::clip_fields(fields.into_iter().flatten()) {
                clipped.insert(key.to_string());
            }
            records.insert(key.to_string(), r);
            if records.len() >= 2 * limit {
                let mut newest: Vec<TaskRecord> = records.drain().map(|(_, r)| r).collect();
                newest.sort_by(newest_first);
                newest.truncate(limit);
                records.extend(newest.into_iter().map(|r| (r.task_id.to_string(), r)));
            }
        })
        .await?;
        let mut records: Vec<TaskRecord> = records.into_values().collect();
        records.sort_by(newest_first);
        records.truncate(limit);
        let max_payload = self.js.client().server_info().max_payload;
        Ok(page::fit(records, max_payload, |r| clipped.contains(r.task_id.as_str()).then(|| r.task_id.to_string())))
    }

    /// `task.cancel` (issue #8 §Cancel): a task still waiting in its lane becomes
    /// `canceled` at once and never starts; a released or running one gets
    /// `cancel_requested_at`, and a note on [`cluster::cancel_subject`] tells the worker
    /// running it, which stops it and ends it `canceled` (the worker also finds the flag at
    /// its next progress tick, or when the dispatch reaches it). The answer is the record
    /// after the change. A finished task is a conflict.
    pub(super) async fn cancel(&self, body: &[u8]) -> Result<TaskRecord, ApiError> {
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
    pub(super) async fn status(&self) -> Result<cluster::ClusterStatus, ApiError> {
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
        let mut workers: std::collections::BTreeMap<String, WorkerInfo> = std::collections::BTreeMap::new();
        mur_nats::read::latest(&workers_kv, ">", |entry| {
            match serde_json::from_slice::<WorkerInfo>(&entry.value) {
                Ok(w) if entry.operation == kv::Operation::Put => workers.insert(entry.key, w),
                _ => workers.remove(&entry.key),
            };
        })
        .await
        .map_err(|e| unavailable("mur_workers: read", e))?;
        let workers: Vec<WorkerInfo> = workers.into_values().collect();
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
}

/// The task id named by a `task.get` / `task.cancel` body: a [`TaskRef`] JSON object, or
/// the bare id.
fn task_ref(body: &[u8]) -> Result<TaskId, ApiError> {
    let text = std::str::from_utf8(body)
        .map_err(|e| ApiError::invalid(format!("request: invalid UTF-8 at byte {}", e.valid_up_to())))?
        .trim();
    let task_id = if text.starts_with('{') {
        serde_json::from_str::<TaskRef>(text).map_err(|e| ApiError::invalid(format!("request: {e}")))?.task_id
    } else {
        TaskId::unchecked(text)
    };
    if task_id.is_empty() {
        return Err(ApiError::invalid("task_id: required"));
    }
    if !Id::is_valid(IdKind::Task, &task_id) {
        return Err(ApiError::invalid(format!("task_id: must be a tsk_ id, got {task_id:?}")));
    }
    Ok(task_id)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::Ordering;

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

    #[test]
    fn a_submission_goes_straight_to_the_scheduler_only_after_every_earlier_revision() {
        let intake = IntakeOrder::default();
        intake.watched.store(10, Ordering::SeqCst);
        assert!(intake.may_hand_straight(11));
        assert!(!intake.may_hand_straight(12), "revision 11 may be another coordinator's submission");
        assert!(intake.may_hand_straight(5));
    }

    fn listed(id: &str, submitted_at: u64, origin: Origin) -> TaskRecord {
        let mut r: TaskRecord = serde_json::from_value(serde_json::json!({
            "task_id": id, "capsule": "c", "capsule_digest": "d", "context_id": "ctx_1", "text": "t",
            "origin": "user", "lane": "user", "state": "submitted", "attempt": 0, "submitted_at": submitted_at,
        }))
        .unwrap();
        r.origin = origin;
        r.lane = origin.lane();
        r
    }

    #[test]
    fn a_list_request_filters_by_lane_and_origin_and_pages_after_its_cursor() {
        let request: ListRequest =
            serde_json::from_str(r#"{"lane": "bg", "before": {"submitted_at": 20, "task_id": "tsk_b"}}"#).unwrap();
        assert!(request.matches(&listed("tsk_a", 20, Origin::Event)), "same ms, smaller id");
        assert!(!request.matches(&listed("tsk_b", 20, Origin::Event)), "the cursor's own task");
        assert!(!request.matches(&listed("tsk_c", 20, Origin::Event)), "same ms, larger id");
        assert!(request.matches(&listed("tsk_z", 19, Origin::Schedule)));
        assert!(!request.matches(&listed("tsk_z", 19, Origin::User)), "lane user");
        let by_origin: ListRequest = serde_json::from_str(r#"{"origin": "schedule"}"#).unwrap();
        assert!(by_origin.matches(&listed("tsk_z", 1, Origin::Schedule)));
        assert!(!by_origin.matches(&listed("tsk_z", 1, Origin::Event)));
        let bad = serde_json::from_str::<ListRequest>(r#"{"lane": "fast"}"#).unwrap_err().to_string();
        assert!(bad.contains("unknown variant `fast`"), "{bad}");
    }
}
