//! The cluster's names and records: every JetStream resource and subject the coordinator
//! and workers share, the task record kept in `mur_tasks`, the NATS API's requests,
//! replies and wire error, and the validation of a submitted task.
//!
//! Names follow the design, §JetStream resources, with one change the code taught: there is
//! no `MUR_TASKS` stream. The coordinator keeps waiting tasks in lanes of its own
//! (the design, §JetStream resources, shape (a)), rebuilt at start from `mur_tasks`, and
//! releases one task at a time into the `MUR_DISPATCH` work queue when a worker slot is
//! free.
//!
//! Pure: no async-nats, no IO, no clock (callers pass unix milliseconds in).

use crate::fanout::FleetStep;
use crate::manifest::is_valid_name;
use crate::task::{ExitStatus, Lane, Origin, TaskState};
use crate::{Id, IdKind};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::fmt;

// ---------------------------------------------------------------------------------------
// Resource names and subjects.

/// The dispatch work queue: tasks released to workers, one message per attempt
/// ([`Dispatch`]). WorkQueue retention: a message is gone once a worker acks it.
pub const DISPATCH_STREAM: &str = "MUR_DISPATCH";
/// The one subject of [`DISPATCH_STREAM`].
pub const DISPATCH_SUBJECT: &str = "mur.dispatch";
/// The durable pull consumer on [`DISPATCH_STREAM`] that every worker shares.
pub const DISPATCH_CONSUMER: &str = "workers";

/// The trace stream: every trace event of every session, the cluster's `trace.jsonl`.
pub const TRACE_STREAM: &str = "MUR_TRACE";
/// The subjects of [`TRACE_STREAM`]: `mur.trace.<session_id>`.
pub const TRACE_SUBJECTS: &str = "mur.trace.>";
/// The prefix of [`trace_subject`], dot included.
pub const TRACE_SUBJECT_PREFIX: &str = "mur.trace.";

/// KV bucket of task records ([`TaskRecord`]); key = task id (`tsk_…`).
pub const TASKS_BUCKET: &str = "mur_tasks";
/// KV bucket of worker registrations and heartbeats ([`WorkerInfo`]); key = worker id.
pub const WORKERS_BUCKET: &str = "mur_workers";
/// KV bucket of session checkpoints (history and counters after each turn).
pub const SESSIONS_BUCKET: &str = "mur_sessions";
/// Object store of capsule bundles; object name = `<capsule>/<digest>` ([`bundle_object`]).
pub const CAPSULES_STORE: &str = "mur_capsules";
/// KV bucket naming each capsule's latest bundle; key = capsule name, value =
/// [`CapsuleIndexEntry`]. Its revision history keeps earlier digests listed.
pub const CAPSULE_INDEX_BUCKET: &str = "mur_capsule_index";

/// Every KV bucket the cluster uses.
pub const KV_BUCKETS: [&str; 5] = [TASKS_BUCKET, WORKERS_BUCKET, SESSIONS_BUCKET, CAPSULE_INDEX_BUCKET, LEADER_BUCKET];
/// The leading coordinator's lease (key [`LEADER_KEY`], value [`LeaderLease`]); the
/// bucket's max age is the lease's time to live.
pub const LEADER_BUCKET: &str = "mur_leader";
/// The lease's key in [`LEADER_BUCKET`].
pub const LEADER_KEY: &str = "leader";
/// The prefix of the keys of [`LEADER_BUCKET`] under which each standby coordinator says
/// it stands by (`standby.<process>`, value [`StandbyStatus`]), written every renewal
/// interval: the bucket's max age drops the key of one that stopped (issue #29 item 14).
pub const STANDBY_KEY_PREFIX: &str = "standby.";

/// A coordinator standing by (not holding the lease), as `mur cluster status` lists it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StandbyStatus {
    /// Its instance name.
    pub instance: String,
    /// When it last said it stands by, unix milliseconds.
    pub at: u64,
}

/// The value of the leader's lease.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaderLease {
    /// The leading coordinator's instance name.
    pub instance: String,
    /// Its term: the key's revision when it took the lease (renewals keep it).
    pub term: u64,
    /// When it took the lease, unix milliseconds.
    pub since: u64,
    /// The holding process's own id (a UUID minted when it started), absent in leases of
    /// earlier versions: a process that finds its own value under the key after it stepped
    /// down knows that term is over, and takes the lease back without waiting for the value
    /// to age out (`coordinator/src/lease.rs`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub process: Option<String>,
}

/// The name of the coordinator's NATS micro service.
pub const SERVICE_NAME: &str = "mur";

/// The coordinator's request subjects (NATS micro service endpoints). Each takes a JSON
/// request and answers JSON: the reply type on success, an [`ApiError`] otherwise.
pub mod api {
    /// The group every endpoint sits in.
    pub const PREFIX: &str = "mur.api";
    /// The API's version, carried in every error the coordinator answers
    /// ([`super::ApiError::api_version`]), so a client tells what the coordinator
    /// understands from a number, never from an error's text. 1: the first versioned API
    /// (a submission may name its [`super::SubmitRequest::task_id`]).
    pub const VERSION: u32 = 1;
    /// [`super::SubmitRequest`] → [`super::SubmitReply`].
    pub const TASK_SUBMIT: &str = "mur.api.task.submit";
    /// [`super::TaskRef`] → [`super::TaskRecord`].
    pub const TASK_GET: &str = "mur.api.task.get";
    /// Empty request, or `{"state": …, "limit": …}` → a [`crate::page::Page`] of
    /// [`super::TaskRecord`]s, newest first, fitted into one message.
    pub const TASK_LIST: &str = "mur.api.task.list";
    /// [`super::TaskRef`] → [`super::TaskRecord`] (its state after the cancel).
    pub const TASK_CANCEL: &str = "mur.api.task.cancel";
    /// Empty request → a JSON array of [`super::CapsuleEntry`].
    pub const CAPSULE_LIST: &str = "mur.api.capsule.list";
    /// Empty request → [`super::ClusterStatus`] (issue #8 §Observability of the queue).
    pub const CLUSTER_STATUS: &str = "mur.api.cluster.status";
}

/// `mur.cancel.<task_id>`: the core subject on which the coordinator tells workers that a
/// task's record now has `cancel_requested_at`, so the worker running it stops at once
/// rather than at its next progress tick (issue #8 §Cancel).
pub fn cancel_subject(task_id: &str) -> String {
    format!("{CANCEL_SUBJECT_PREFIX}{task_id}")
}

/// The prefix of [`cancel_subject`]; workers subscribe to `mur.cancel.*`.
pub const CANCEL_SUBJECT_PREFIX: &str = "mur.cancel.";

/// The subject a session's trace events go to: `mur.trace.<session_id>`.
pub fn trace_subject(session_id: &str) -> String {
    format!("{TRACE_SUBJECT_PREFIX}{session_id}")
}

/// The object name of a capsule bundle: `<capsule>/<digest>`.
pub fn bundle_object(capsule: &str, digest: &str) -> String {
    format!("{capsule}/{digest}")
}

/// Whether `digest` is a bundle digest: 64 lowercase hex digits (SHA-256).
pub fn is_valid_digest(digest: &str) -> bool {
    digest.len() == 64 && digest.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

// ---------------------------------------------------------------------------------------
// Records.

/// Room a [`TaskRecord`] leaves under the server's `max_payload` for what wraps it (a
/// KV put's headers), bytes.
pub const RECORD_MARGIN: usize = 4 * 1024;

/// Room a submitted task's record must leave for its result under the server's
/// `max_payload` (less [`RECORD_MARGIN`]), bytes: a text that leaves less is refused at
/// submission, so [`TaskRecord::fit`] can always fit the terminal record.
pub const RESULT_ROOM: usize = 16 * 1024;

/// A task as the cluster keeps it in [`TASKS_BUCKET`] (key = `task_id`). Times are unix
/// milliseconds. Every change is a compare-and-set on the key's revision.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskRecord {
    /// `tsk_…`.
    pub task_id: String,
    /// The capsule's name.
    pub capsule: String,
    /// The bundle the task runs: the capsule's latest digest when it was submitted, so a
    /// later push does not change it.
    pub capsule_digest: String,
    /// The conversation the task belongs to (`ctx_…` or the caller's id).
    pub context_id: String,
    /// The task's text.
    pub text: String,
    /// Where the task came from.
    pub origin: Origin,
    /// The lane it waits in (from `origin`).
    pub lane: Lane,
    /// Where it is now.
    pub state: TaskState,
    /// How it ended, once terminal.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_status: Option<ExitStatus>,
    /// The final answer text, once terminal.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<String>,
    /// The session running it (`ses_…`), once started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_id: Option<String>,
    /// The worker running it (or that last ran it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker: Option<String>,
    /// The [`DISPATCH_STREAM`] sequence of the dispatch message whose delivery runs the
    /// task, written with `working`. While the task is `working`, that message stays in the
    /// stream unacknowledged (it is acked only after the terminal record), so a delivery of
    /// *another* message for the task — one published again after the stream's duplicate
    /// window — is a duplicate and is dropped, while a redelivery of this one (its worker
    /// died, the design, §A task's way, step 6) takes the task over. Absent on records
    /// written before it existed: such a delivery takes over as before.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dispatch_seq: Option<u64>,
    /// Attempts so far: 0 while waiting, 1 on the first dispatch, +1 per takeover (a
    /// worker starting the task again after the session that had it `working` stopped
    /// answering, issue #29 item 9).
    pub attempt: u32,
    /// When the coordinator accepted it.
    pub submitted_at: u64,
    /// When a worker first started it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<u64>,
    /// When it reached a terminal state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended_at: Option<u64>,
    /// Why it failed or was refused, for people.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// When `mur task cancel` asked a released or running task to stop (issue #8
    /// §Cancel): the worker that has it stops it within one progress interval and ends
    /// it `canceled`; one that gets it later ends it without running it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cancel_requested_at: Option<u64>,
    /// When the task must be over (unix ms), from [`SubmitRequest::deadline_at`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline_at: Option<u64>,
    /// Programs the work needs, from [`SubmitRequest::needs`]: checked by the worker
    /// before it starts a session.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub needs: Vec<String>,
    /// Set when the task was given up after every delivery failed (issue #8 §Poison
    /// tasks): the task is `failed` and this says why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dead_letter: Option<DeadLetter>,
    /// The W3C `traceparent` of the coordinator's span that accepted the task (issue #7
    /// §Trace context: one task is one trace). The dispatch carries it in its headers too;
    /// a worker that finds no header parents the task's spans on this. Absent when the
    /// coordinator exports no traces and the client sent no `traceparent`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
    /// Set on a delegated fleet step ([`SubmitRequest::fleet_step`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fleet_step: Option<FleetStep>,
    /// The tokens the task's model calls used (issue #11 §Cost), on its terminal record:
    /// provider-reported where available, the runtime's estimate otherwise
    /// ([`crate::cost::Usage::estimated`]). Absent when no model was called.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<crate::cost::Usage>,
    /// The A2A `messageId` it came from ([`SubmitRequest::message_id`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message_id: Option<String>,
}

/// Why a task went to the dead letters: its dispatch was delivered the consumer's
/// `max_deliver` times and never finished (the workers that had it died, or failed to
/// handle it each time).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeadLetter {
    /// For people: what happened on the deliveries.
    pub reason: String,
    /// Deliveries made.
    pub deliveries: u64,
    /// The worker that had it last, if known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_worker: Option<String>,
    /// When it was given up, unix milliseconds.
    pub at: u64,
}

impl TaskRecord {
    /// A freshly accepted task in state `submitted`. A request without a context id gets a
    /// fresh `ctx_…`.
    pub fn submitted(task_id: String, request: SubmitRequest, capsule_digest: String, now_ms: u64) -> TaskRecord {
        TaskRecord {
            task_id,
            capsule: request.capsule,
            capsule_digest,
            context_id: request.context_id.unwrap_or_else(|| Id::generate(IdKind::Context)),
            text: request.text,
            origin: request.origin,
            lane: request.origin.lane(),
            state: TaskState::Submitted,
            exit_status: None,
            result: None,
            session_id: None,
            worker: None,
            dispatch_seq: None,
            attempt: 0,
            submitted_at: now_ms,
            started_at: None,
            ended_at: None,
            error: None,
            cancel_requested_at: None,
            deadline_at: request.deadline_at,
            fleet_step: request.fleet_step,
            needs: request.needs,
            dead_letter: None,
            traceparent: None,
            usage: None,
            message_id: request.message_id,
        }
    }

    /// Whether the record's JSON is surely at most `budget` bytes without serializing it:
    /// most records are far from any limit, and the checks on the hot path (submission,
    /// the terminal write) skip the serializing for them. A byte of text is at most six in
    /// JSON (`\u001b`); the other fields are names, ids and numbers (64 KiB allowed them).
    fn surely_within(&self, budget: usize) -> bool {
        let texts =
            self.text.len() + self.result.as_ref().map_or(0, String::len) + self.error.as_ref().map_or(0, String::len);
        texts.saturating_mul(6) + 64 * 1024 <= budget
    }

    /// Checks, at submission, that the record leaves [`RESULT_ROOM`] bytes for the result
    /// under `max_payload` less [`RECORD_MARGIN`], so [`TaskRecord::fit`] can always fit the
    /// terminal record.
    ///
    /// # Errors
    /// The `text: …` rule broken, naming about how many bytes of text this server takes.
    pub fn check_room(&self, max_payload: usize) -> Result<(), String> {
        let room = max_payload.saturating_sub(RECORD_MARGIN + RESULT_ROOM);
        if self.surely_within(room) {
            return Ok(());
        }
        let size = serde_json::to_vec(self).map_or(usize::MAX, |j| j.len());
        if size <= room {
            return Ok(());
        }
        let most = room.saturating_sub(size.saturating_sub(self.text.len()));
        Err(format!(
            "text: at most about {most} bytes on this cluster (its nats-server's max_payload is {max_payload} bytes, \
             and a task's record keeps {RESULT_ROOM} of them for the result), got {}",
            self.text.len()
        ))
    }

    /// Clips the `result`, then the `error`, so that the record's JSON fits a message of
    /// `max_payload` bytes less [`RECORD_MARGIN`]: a server refuses a larger one, and a
    /// terminal record that cannot be written leaves its task `working` until its dispatch
    /// dead-letters. A clipped field keeps its start and ends with a note of the bytes cut;
    /// the whole result stays in the session folder's `out/result.txt`. Returns whether it
    /// clipped; a record that no clipping of these two fits (its text alone near the limit)
    /// is left as it is.
    pub fn fit(&mut self, max_payload: usize) -> bool {
        let budget = max_payload.saturating_sub(RECORD_MARGIN);
        let size = |r: &TaskRecord| serde_json::to_vec(r).map_or(usize::MAX, |j| j.len());
        if self.surely_within(budget) || size(self) <= budget {
            return false;
        }
        let mut fitted = self.clone();
        for field in [0, 1] {
            let over = size(&fitted).saturating_sub(budget);
            let text = match field {
                0 => fitted.result.as_mut(),
                _ => fitted.error.as_mut(),
            };
            let Some(text) = text.filter(|_| over > 0) else { continue };
            let note = format!("\n… [clipped: {} bytes in all; the whole is in out/result.txt]", text.len());
            // Each byte cut shortens the JSON by at least one byte (escapes only add); the
            // note is counted as JSON (its line break is two bytes there).
            let note_json = serde_json::to_string(&note).map_or(note.len() * 6, |j| j.len() - 2);
            if text.len() <= note_json {
                continue;
            }
            let mut cut = text.len().saturating_sub(over + note_json);
            while !text.is_char_boundary(cut) {
                cut -= 1;
            }
            text.truncate(cut);
            text.push_str(&note);
        }
        if size(&fitted) > budget {
            return false;
        }
        *self = fitted;
        true
    }
}

/// One message of [`DISPATCH_STREAM`]: "run this task". Published with the message id
/// [`Dispatch::msg_id`] so a repeated publish of one attempt is dropped, and a real retry
/// (a new attempt) is not.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Dispatch {
    /// The task to run (its record is in [`TASKS_BUCKET`]).
    pub task_id: String,
    /// Which dispatch of the task this is, from 1.
    pub attempt: u32,
    /// The record as the release wrote it, with its revision (issue #9: no broker round
    /// trip the dispatch path can do without). The worker compare-and-sets the record to
    /// `working` from it without reading it first; a record that changed since (cancel
    /// requested, taken by an earlier delivery) fails that compare-and-set, and the worker
    /// reads the record then. Absent (`None`) the worker reads the record: a dispatch
    /// published by an earlier coordinator version.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub released: Option<Released>,
}

/// A task record and the revision it has in [`TASKS_BUCKET`] (see [`Dispatch::released`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Released {
    /// The key's revision after the release's compare-and-set.
    pub revision: u64,
    /// The record at that revision.
    pub record: TaskRecord,
}

impl Dispatch {
    /// A dispatch of `task_id`'s attempt `attempt` carrying nothing more (the worker reads
    /// the record).
    pub fn bare(task_id: impl Into<String>, attempt: u32) -> Dispatch {
        Dispatch { task_id: task_id.into(), attempt, released: None }
    }

    /// The `Nats-Msg-Id`: `<task_id>:<attempt>` (the JetStream patterns reference, §1.4).
    pub fn msg_id(&self) -> String {
        format!("{}:{}", self.task_id, self.attempt)
    }
}

/// What `mur cluster status` shows (issue #8 §Observability of the queue): the queue per
/// capsule and lane, what is in flight and where, the dead letters, the workers, the
/// leader. Ages are milliseconds at `at` (unix ms).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterStatus {
    /// When it was read.
    pub at: u64,
    /// The leading coordinator, if any holds the lease.
    pub leader: Option<LeaderLease>,
    /// The coordinators standing by, by instance name (issue #29 item 14); empty from a
    /// coordinator that did not say.
    #[serde(default)]
    pub standbys: Vec<StandbyStatus>,
    /// Waiting tasks per capsule and lane, in lane order (`user`, `peer`, `bg`).
    pub lanes: Vec<LaneStatus>,
    /// Released or running tasks, oldest first.
    pub in_flight: Vec<InFlight>,
    /// Tasks given up after every delivery failed, newest first.
    pub dead_letters: Vec<DeadLetterEntry>,
    /// Registered workers.
    pub workers: Vec<WorkerStatus>,
    /// The fan-out semaphore: permits in use, holders, waiting steps (issue #11).
    #[serde(default)]
    pub fanout: crate::fanout::FanoutStatus,
}

/// One capsule's lane.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LaneStatus {
    /// The capsule.
    pub capsule: String,
    /// The lane.
    pub lane: Lane,
    /// Tasks waiting in it.
    pub pending: u64,
    /// How long its oldest task has waited, ms.
    pub oldest_age_ms: u64,
}

/// A released or running task.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct InFlight {
    /// `tsk_…`.
    pub task_id: String,
    /// The capsule.
    pub capsule: String,
    /// Its lane.
    pub lane: Lane,
    /// `submitted` (released, not started yet) or `working`.
    pub state: TaskState,
    /// The worker that holds it (once started).
    pub worker: Option<String>,
    /// Its dispatch attempt.
    pub attempt: u32,
    /// How long since it was started (or submitted, while not started), ms.
    pub age_ms: u64,
    /// A cancel was asked for.
    pub cancel_requested: bool,
}

/// A dead letter, as listed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeadLetterEntry {
    /// `tsk_…`.
    pub task_id: String,
    /// The capsule.
    pub capsule: String,
    /// Why, and how many deliveries.
    pub dead_letter: DeadLetter,
}

/// A registered worker.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerStatus {
    /// Its id.
    pub worker_id: String,
    /// Its slots.
    pub slots: u32,
    /// Slots free at its last heartbeat.
    pub free: u32,
    /// How long since its last heartbeat, ms.
    pub heartbeat_age_ms: u64,
    /// Whether that heartbeat is within the coordinator's worker timeout: a silent worker
    /// (stopped, killed, cut off) gets no dispatch and its slots count for nothing. Its
    /// registration stays in `mur_workers` until it beats again or is removed. `true` in
    /// a reply from a coordinator that did not say.
    #[serde(default = "heard_from")]
    pub live: bool,
}

fn heard_from() -> bool {
    true
}

impl ClusterStatus {
    /// Builds the status from every task record, every worker registration and the
    /// lease, at `now` (unix ms); a worker whose last heartbeat is more than
    /// `worker_timeout_ms` old is not [`WorkerStatus::live`]. Pure: the coordinator reads
    /// the buckets, this sorts.
    pub fn build(
        records: &[TaskRecord],
        workers: &[WorkerInfo],
        leader: Option<LeaderLease>,
        now: u64,
        worker_timeout_ms: u64,
    ) -> Self {
        let mut lanes: Vec<LaneStatus> = Vec::new();
        let mut in_flight = Vec::new();
        let mut dead_letters = Vec::new();
        for r in records {
            match r.state {
                TaskState::Submitted if r.attempt == 0 => {
                    let age = now.saturating_sub(r.submitted_at);
                    match lanes.iter_mut().find(|l| l.capsule == r.capsule && l.lane == r.lane) {
                        Some(l) => {
                            l.pending += 1;
                            l.oldest_age_ms = l.oldest_age_ms.max(age);
                        }
                        None => lanes.push(LaneStatus {
                            capsule: r.capsule.clone(),
                            lane: r.lane,
                            pending: 1,
                            oldest_age_ms: age,
                        }),
                    }
                }
                TaskState::Submitted | TaskState::Working => in_flight.push(InFlight {
                    task_id: r.task_id.clone(),
                    capsule: r.capsule.clone(),
                    lane: r.lane,
                    state: r.state,
                    worker: r.worker.clone().filter(|_| r.state == TaskState::Working),
                    attempt: r.attempt,
                    age_ms: now.saturating_sub(r.started_at.unwrap_or(r.submitted_at)),
                    cancel_requested: r.cancel_requested_at.is_some(),
                }),
                _ => {
                    if let Some(d) = &r.dead_letter {
                        dead_letters.push(DeadLetterEntry {
                            task_id: r.task_id.clone(),
                            capsule: r.capsule.clone(),
                            dead_letter: d.clone(),
                        });
                    }
                }
            }
        }
        lanes.sort_by(|a, b| (&a.capsule, a.lane).cmp(&(&b.capsule, b.lane)));
        in_flight.sort_by(|a, b| b.age_ms.cmp(&a.age_ms).then_with(|| a.task_id.cmp(&b.task_id)));
        dead_letters.sort_by_key(|d| std::cmp::Reverse(d.dead_letter.at));
        let mut workers: Vec<WorkerStatus> = workers
            .iter()
            .map(|w| WorkerStatus {
                worker_id: w.worker_id.clone(),
                slots: w.slots,
                free: w.slots.saturating_sub(w.busy),
                heartbeat_age_ms: now.saturating_sub(w.heartbeat_at),
                live: !heartbeat_expired(w.heartbeat_at, now, worker_timeout_ms),
            })
            .collect();
        workers.sort_by(|a, b| a.worker_id.cmp(&b.worker_id));
        ClusterStatus {
            at: now,
            leader,
            standbys: Vec::new(),
            lanes,
            in_flight,
            dead_letters,
            workers,
            fanout: Default::default(),
        }
    }
}

/// One per-turn checkpoint of a running task in [`SESSIONS_BUCKET`], under
/// [`checkpoint_key`] (issue #8 §Checkpoints; the design, §A task's way, step 4): what the
/// turns since the previous checkpoint added to the conversation, never the whole history
/// again, so a long task costs linear bytes. The first checkpoint of an attempt, and any
/// after the history was replaced (compaction, a reopen), has `replace: true` and carries
/// every message. A takeover reads the task's checkpoints in order
/// ([`Checkpoint::fold`]) and resumes after the last one.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Checkpoint {
    /// The task (`tsk_…`).
    pub task_id: String,
    /// The session that wrote it (`ses_…`).
    pub session_id: String,
    /// The worker that wrote it.
    pub worker: String,
    /// Model calls made when it was written (the task's `turns` counter).
    pub turn: u32,
    /// `messages` is the whole history, not an addition to it.
    pub replace: bool,
    /// The messages added since the previous checkpoint (or all of them, see `replace`).
    pub messages: Vec<crate::message::Message>,
    /// The task's counters so far.
    pub counters: CheckpointCounters,
    /// The last request's input plus output tokens (the compaction check's figure).
    pub session_tokens: u64,
    /// Reopens granted so far, as `(hook, reason)`, in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub reopens: Vec<(String, String)>,
    /// When it was written, unix milliseconds.
    pub at_ms: u64,
    /// Which part this is of a checkpoint written in [`Checkpoint::parts`] parts, from 0
    /// (absent: 0). See [`Checkpoint::split`].
    #[serde(default, skip_serializing_if = "is_zero")]
    pub part: u32,
    /// How many parts the turn's checkpoint was written in, when one message could not
    /// hold it (absent: 0, a whole checkpoint).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub parts: u32,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// Room kept in a `mur_sessions` value for the message's subject and headers when one is
/// fitted to the server's `max_payload` ([`Checkpoint::split`], [`StoredConversation`]).
pub const SESSION_VALUE_MARGIN: usize = 4 * 1024;

/// `messages` in consecutive runs whose JSON arrays each take at most `room` bytes after
/// `overhead` bytes of their own; a message larger than that alone is a run of its own
/// (its write fails, as it would have whole). One run when all fit; never an empty run
/// unless `messages` is empty.
pub fn split_messages(
    messages: Vec<crate::message::Message>,
    overhead: usize,
    room: usize,
) -> Vec<Vec<crate::message::Message>> {
    let mut runs = vec![Vec::new()];
    let mut used = overhead + 2;
    for m in messages {
        let size = serde_json::to_vec(&m).map_or(usize::MAX, |j| j.len()) + 1;
        let run = runs.last_mut().expect("never empty");
        if !run.is_empty() && used.saturating_add(size) > room {
            runs.push(Vec::new());
            used = overhead + 2;
        }
        used = used.saturating_add(size);
        runs.last_mut().expect("never empty").push(m);
    }
    runs
}

/// The counters a [`Checkpoint`] carries (those of `task_end`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointCounters {
    /// Model calls made.
    pub turns: u32,
    /// Sum of input tokens.
    pub input_tokens: u64,
    /// Sum of output tokens.
    pub output_tokens: u64,
    /// Tool calls made.
    pub tool_calls: u32,
    /// Shell commands run.
    pub shell_calls: u32,
}

/// Where a task resumes: the folded checkpoints.
#[derive(Clone, Debug, PartialEq)]
pub struct Resume {
    /// The last checkpoint (its `messages` replaced by the whole history).
    pub last: Checkpoint,
}

impl Checkpoint {
    /// Folds checkpoints read in write order into the state after the last one: the whole
    /// history and the last counters. `None` for no checkpoints, or when the first one is
    /// not a `replace` (the chain is broken: start over). A checkpoint written in parts
    /// counts once all its parts are read, in order; one whose parts stop short (its
    /// worker died while writing them) is left out, so the task resumes after the turn
    /// before it.
    pub fn fold(checkpoints: impl IntoIterator<Item = Checkpoint>) -> Option<Resume> {
        let mut state: Option<Checkpoint> = None;
        let mut pending: Option<Checkpoint> = None;
        for c in checkpoints {
            let whole = if c.parts > 1 {
                match pending.take() {
                    Some(mut p) if c.part == p.part + 1 && c.turn == p.turn && c.session_id == p.session_id => {
                        p.messages.extend(c.messages);
                        p.part = c.part;
                        p
                    }
                    // A first part (any pending one before it stopped short), or a stray.
                    _ if c.part == 0 => c,
                    _ => continue,
                }
            } else {
                pending = None;
                c
            };
            if whole.parts > 1 && whole.part + 1 < whole.parts {
                pending = Some(whole);
                continue;
            }
            let c = Checkpoint { part: 0, parts: 0, ..whole };
            state = match state {
                _ if c.replace => Some(c),
                None => return None,
                Some(mut s) => {
                    s.messages.extend(c.messages);
                    Some(Checkpoint { messages: s.messages, ..c })
                }
            };
        }
        state.map(|last| Resume { last })
    }

    /// The checkpoint as the values to write, each within `max_payload` bytes (less
    /// [`SESSION_VALUE_MARGIN`]), with their keys: itself under [`checkpoint_key`] when it
    /// fits, else its messages split over parts (`part` 0, 1, … of `parts`, all with its
    /// counters, `replace` on the first only) under [`checkpoint_part_key`]. Written in
    /// this order, [`Checkpoint::fold`] reads them back as one.
    ///
    /// # Errors
    /// The JSON encoder's, never expected for these types.
    pub fn split(self, max_payload: usize) -> Result<Vec<(String, Vec<u8>)>, serde_json::Error> {
        let room = max_payload.saturating_sub(SESSION_VALUE_MARGIN);
        let key = checkpoint_key(&self.task_id, self.turn);
        let json = serde_json::to_vec(&self)?;
        if json.len() <= room {
            return Ok(vec![(key, json)]);
        }
        let Checkpoint { messages, replace, .. } = self;
        let shell = Checkpoint { messages: Vec::new(), part: u32::MAX, parts: u32::MAX, replace: false, ..self };
        let overhead = serde_json::to_vec(&shell)?.len();
        let runs = split_messages(messages, overhead, room);
        let parts = runs.len() as u32;
        runs.into_iter()
            .zip(0..)
            .map(|(messages, part)| {
                let c = Checkpoint { messages, part, parts, replace: replace && part == 0, ..shell.clone() };
                Ok((checkpoint_part_key(&c.task_id, c.turn, part), serde_json::to_vec(&c)?))
            })
            .collect()
    }
}

/// A context's conversation as [`context_key`] holds it: the messages themselves (a JSON
/// array) when they fit one message, else a head naming the parts they were written in,
/// under [`conversation_part_key`] (written before the head, so a head read always finds
/// its parts).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum StoredConversation {
    /// The whole conversation.
    Whole(Vec<crate::message::Message>),
    /// The conversation in `parts` parts of generation `generation`.
    Parts {
        /// Names this write's parts apart from an earlier write's (a `uuid` v7, simple form).
        generation: String,
        /// How many parts.
        parts: u32,
    },
}

impl StoredConversation {
    /// The values to write for `messages` under `key` ([`context_key`]), each within
    /// `max_payload` bytes (less [`SESSION_VALUE_MARGIN`]), in write order: the parts,
    /// then the head; or the whole under `key` when it fits.
    ///
    /// # Errors
    /// The JSON encoder's, never expected for these types.
    pub fn split(
        key: &str,
        messages: Vec<crate::message::Message>,
        max_payload: usize,
    ) -> Result<Vec<(String, Vec<u8>)>, serde_json::Error> {
        let room = max_payload.saturating_sub(SESSION_VALUE_MARGIN);
        let json = serde_json::to_vec(&messages)?;
        if json.len() <= room {
            return Ok(vec![(key.to_string(), json)]);
        }
        let generation = uuid::Uuid::now_v7().simple().to_string();
        let runs = split_messages(messages, 0, room);
        let mut out = Vec::with_capacity(runs.len() + 1);
        for (run, part) in runs.iter().zip(0u32..) {
            out.push((conversation_part_key(key, &generation, part), serde_json::to_vec(run)?));
        }
        let head = StoredConversation::Parts { generation, parts: runs.len() as u32 };
        out.push((key.to_string(), serde_json::to_vec(&head)?));
        Ok(out)
    }

    /// The part keys of a head (none for a whole conversation).
    pub fn part_keys(&self, key: &str) -> Vec<String> {
        match self {
            StoredConversation::Whole(_) => Vec::new(),
            StoredConversation::Parts { generation, parts } => {
                (0..*parts).map(|part| conversation_part_key(key, generation, part)).collect()
            }
        }
    }
}

/// The [`SESSIONS_BUCKET`] key of a task's checkpoint after `turn` turns:
/// `ckpt.<task_id>.<turn>`; all of a task's share the prefix [`checkpoint_prefix`].
pub fn checkpoint_key(task_id: &str, turn: u32) -> String {
    format!("{}{turn}", checkpoint_prefix(task_id))
}

/// The key of part `part` of a checkpoint written in parts: [`checkpoint_key`] for part 0,
/// `ckpt.<task_id>.<turn>.<part>` after it (under the same [`checkpoint_prefix`]).
pub fn checkpoint_part_key(task_id: &str, turn: u32, part: u32) -> String {
    if part == 0 { checkpoint_key(task_id, turn) } else { format!("{}.{part}", checkpoint_key(task_id, turn)) }
}

/// `ckpt.<task_id>.`: the prefix of every checkpoint key of a task.
pub fn checkpoint_prefix(task_id: &str) -> String {
    format!("ckpt.{task_id}.")
}

/// The [`SESSIONS_BUCKET`] key of a context's conversation in a capsule:
/// `ctx.<capsule>.<context_id>` (context ids are key-safe, see [`is_valid_context_id`]).
/// Written when a task of a threaded conversation ends `ok`, read when the next starts.
pub fn context_key(capsule: &str, context_id: &str) -> String {
    format!("ctx.{capsule}.{context_id}")
}

/// The key of part `part` of generation `generation` of the conversation under `key`
/// ([`context_key`]): `<key>=<generation>.<part>`. No context id holds a `=`
/// ([`is_valid_context_id`]), so no context's key is another's part.
pub fn conversation_part_key(key: &str, generation: &str, part: u32) -> String {
    format!("{key}={generation}.{part}")
}

/// A worker's registration, refreshed by its heartbeat, in [`WORKERS_BUCKET`] (key =
/// `worker_id`). Times are unix milliseconds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerInfo {
    /// The worker's id, unique in the cluster.
    pub worker_id: String,
    /// How many tasks it runs at once.
    pub slots: u32,
    /// How many of its slots are taken.
    pub busy: u32,
    /// When the worker process started.
    pub started_at: u64,
    /// When it last said it was alive.
    pub heartbeat_at: u64,
    /// Its murmur version.
    pub version: String,
}

/// Whether a worker whose last heartbeat was at `heartbeat_at` is silent at `now` (both
/// unix ms): more than `timeout_ms` has passed. The scheduler gives a silent worker no
/// dispatch and `cluster.status` shows it so; one rule for both.
pub fn heartbeat_expired(heartbeat_at: u64, now: u64, timeout_ms: u64) -> bool {
    now.saturating_sub(heartbeat_at) > timeout_ms
}

/// The value under a capsule's name in [`CAPSULE_INDEX_BUCKET`]: its latest bundle.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CapsuleIndexEntry {
    /// SHA-256 of the bundle, lowercase hex.
    pub digest: String,
    /// The manifest's `version`.
    pub version: String,
    /// When it was pushed, unix milliseconds.
    pub pushed_at: u64,
    /// The bundle's size in bytes.
    pub bytes: u64,
    /// Whether the manifest says `lifecycle.task_acceptance: queue`: the coordinator runs
    /// at most one task of the capsule at a time cluster-wide. Absent (false) in entries
    /// pushed before the field existed.
    #[serde(default)]
    pub queue: bool,
    /// The manifest's `inference.model`, for pricing (issue #11 §Cost). Absent in entries
    /// pushed before the field existed, and for capsules without a model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// The manifest's `description`: the coordinator's A2A card for the capsule says it
    /// (issue #29 item 6). Absent in entries pushed before the field existed, and for
    /// capsules without one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
}

/// One capsule as `mur capsule ls` shows it: its name and latest bundle.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CapsuleEntry {
    /// The capsule's name.
    pub name: String,
    /// SHA-256 of its latest bundle, lowercase hex.
    pub digest: String,
    /// The manifest's `version`.
    pub version: String,
    /// When it was pushed, unix milliseconds.
    pub pushed_at: u64,
    /// The bundle's size in bytes.
    pub bytes: u64,
}

// ---------------------------------------------------------------------------------------
// API requests, replies and errors.

/// The largest task text accepted, in bytes (1 MiB). Note that NATS' default
/// `max_payload` is also 1 MiB, so a text this long needs a server with a larger
/// `max_payload` to travel inside a JSON request.
pub const MAX_TASK_BYTES: usize = 1 << 20;

/// The longest caller-chosen context id, in characters.
pub const MAX_CONTEXT_ID_CHARS: usize = 64;

/// The rule a task's or a fleet job's text breaks, if any: it must hold more than white
/// space, be at most `max_bytes` long, and hold no NUL character (U+0000) — a task's text
/// becomes a command's argument (the `hello` capsule runs it with `sh -c`), and no argument
/// of a program can carry a NUL: the task would run and end in "cannot start sh" (issue
/// #29). Other control characters are the text's own business.
///
/// The rule's words: `must not be empty`, `must not be only whitespace`, `must be at most
/// <max_bytes> bytes, got <n>`, `must not contain a NUL character (U+0000: no command's
/// argument can carry one), found at byte <i>`.
pub fn text_rule(text: &str, max_bytes: usize) -> Option<String> {
    if text.is_empty() {
        Some("must not be empty".to_string())
    } else if text.trim().is_empty() {
        Some("must not be only whitespace".to_string())
    } else if text.len() > max_bytes {
        Some(format!("must be at most {max_bytes} bytes, got {}", text.len()))
    } else {
        text.find('\0').map(|at| {
            format!(
                "must not contain a NUL character (U+0000: no command's argument can carry one), found at byte {at}"
            )
        })
    }
}

/// A task submission (`mur.api.task.submit`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SubmitRequest {
    /// The capsule to run.
    pub capsule: String,
    /// The task's text, at most [`MAX_TASK_BYTES`].
    pub text: String,
    /// Where the task comes from; `user` when absent. Over the NATS API the caller is an
    /// authenticated client and states it (the design, §A task's way, step 2).
    #[serde(default = "default_origin")]
    pub origin: Origin,
    /// The conversation to continue; a fresh `ctx_…` when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context_id: Option<String>,
    /// When the task must be over, unix ms: a fleet step inherits the time left on its
    /// loop's clock (the fleet-loops seed, §The bounds: "Every member the loop delegates
    /// to inherits the remaining time"). The worker stops a task still running then; it
    /// ends `deadline_exceeded`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline_at: Option<u64>,
    /// Set on a delegated fleet step (issue #11 §The fan-out cap): the worker runs the
    /// task only while it holds one of the first `cap` permits of the cluster-wide
    /// semaphore ([`crate::fanout`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fleet_step: Option<FleetStep>,
    /// Programs the work needs (a fleet's `needs:`, the fleet reference, §1: "passed to
    /// each delegate for dispatch-time preflight"): the worker that takes the task checks
    /// each is on its `PATH` before it starts a session, and ends the task `failed` naming
    /// the missing ones otherwise. At most [`MAX_NEEDS`], each a program name.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub needs: Vec<String>,
    /// The task's id (`tsk_…`), minted by the caller so that a submission sent again after
    /// its answer was lost (a coordinator restarting, a timeout) runs the task once: a
    /// record of that id already stored for the same capsule and text is the answer (its
    /// state as it is now); one stored for another task is refused (`conflict`). Absent,
    /// the coordinator mints the id. `mur task send` mints one and retries an unanswered
    /// submission with it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task_id: Option<String>,
    /// The A2A `messageId` of the message the task came from, kept on the record so the
    /// task's history shows the caller's message as a standalone capsule's does (issue #29
    /// item 6). At most [`MAX_MESSAGE_ID_BYTES`], no control characters.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message_id: Option<String>,
}

/// Most bytes of [`SubmitRequest::message_id`].
pub const MAX_MESSAGE_ID_BYTES: usize = 256;

/// Most entries of [`SubmitRequest::needs`].
pub const MAX_NEEDS: usize = 32;

fn default_origin() -> Origin {
    Origin::User
}

/// The fields of a [`FleetStep`], in the order error messages list them.
const FLEET_STEP_FIELDS: [&str; 4] = ["fleet", "run_id", "step", "cap"];

/// Decodes a submission's `fleet_step`: an object of exactly [`FLEET_STEP_FIELDS`], the
/// names non-empty, `cap` at least 1. The error names the field (`fleet_step.cap: …`).
fn fleet_step_of(v: &Value) -> Result<FleetStep, String> {
    let Value::Object(m) = v else {
        return Err(format!("fleet_step: must be an object {{fleet, run_id, step, cap}}, got {v}"));
    };
    if let Some(k) = m.keys().find(|k| !FLEET_STEP_FIELDS.contains(&k.as_str())) {
        return Err(format!("fleet_step.{k}: unknown field, expected one of {}", FLEET_STEP_FIELDS.join(", ")));
    }
    let step = serde_json::from_value::<FleetStep>(v.clone()).map_err(|e| format!("fleet_step: {e}"))?;
    for (name, value) in [("fleet", &step.fleet), ("run_id", &step.run_id), ("step", &step.step)] {
        if value.trim().is_empty() {
            return Err(format!("fleet_step.{name}: must not be empty"));
        }
    }
    if step.cap == 0 {
        return Err("fleet_step.cap: must be at least 1, got 0".to_string());
    }
    Ok(step)
}

/// The fields a [`SubmitRequest`] may have, in the order error messages list them.
const SUBMIT_FIELDS: [&str; 9] =
    ["capsule", "text", "origin", "context_id", "deadline_at", "needs", "fleet_step", "task_id", "message_id"];

impl SubmitRequest {
    /// A submission of `text` to `capsule` from `origin`, in a fresh context, with no
    /// deadline and not a fleet step.
    pub fn new(capsule: impl Into<String>, text: impl Into<String>, origin: Origin) -> SubmitRequest {
        SubmitRequest {
            capsule: capsule.into(),
            text: text.into(),
            origin,
            context_id: None,
            deadline_at: None,
            fleet_step: None,
            needs: Vec::new(),
            task_id: None,
            message_id: None,
        }
    }

    /// Decodes and validates a submission from the raw request body.
    ///
    /// # Errors
    /// An [`ApiError`] with code `invalid_request`: for bytes that are not UTF-8 or not
    /// JSON, the message gives the byte offset (`request: invalid UTF-8 at byte 7`,
    /// `request: invalid JSON at byte 12: …`); otherwise it lists every broken rule, one
    /// `field: rule` per broken rule, joined by `; ` (see [`SubmitRequest::validate`]).
    pub fn parse(bytes: &[u8]) -> Result<SubmitRequest, ApiError> {
        let text = std::str::from_utf8(bytes)
            .map_err(|e| ApiError::invalid(format!("request: invalid UTF-8 at byte {}", e.valid_up_to())))?;
        let value: Value = serde_json::from_str(text).map_err(|e| {
            // A truncated document fails at its end; other errors at the byte read last.
            let at = if e.is_eof() { text.len() } else { byte_offset(text, e.line(), e.column()) };
            ApiError::invalid(format!("request: invalid JSON at byte {at}: {}", strip_position(&e.to_string())))
        })?;
        let Value::Object(map) = value else {
            return Err(ApiError::invalid(format!("request: must be a JSON object, got {}", json_type(&value))));
        };
        let mut errors = Vec::new();
        for key in map.keys() {
            if !SUBMIT_FIELDS.contains(&key.as_str()) {
                errors.push(format!("{key}: unknown field, expected one of {}", SUBMIT_FIELDS.join(", ")));
            }
        }
        let capsule = required_string(&map, "capsule", &mut errors);
        let text = required_string(&map, "text", &mut errors);
        let origin = match map.get("origin") {
            None | Some(Value::Null) => Some(Origin::User),
            Some(Value::String(s)) => match s.parse::<Origin>() {
                Ok(o) => Some(o),
                Err(e) => {
                    errors.push(e.to_string());
                    None
                }
            },
            Some(other) => {
                errors.push(format!("origin: must be a string, got {}", json_type(other)));
                None
            }
        };
        let context_id = match map.get("context_id") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s.clone()),
            Some(other) => {
                errors.push(format!("context_id: must be a string, got {}", json_type(other)));
                None
            }
        };
        let deadline_at = match map.get("deadline_at") {
            None | Some(Value::Null) => None,
            Some(Value::Number(n)) if n.as_u64().is_some() => n.as_u64(),
            Some(other) => {
                errors.push(format!("deadline_at: must be unix milliseconds (a whole number), got {other}"));
                None
            }
        };
        let fleet_step = match map.get("fleet_step") {
            None | Some(Value::Null) => None,
            Some(v) => match fleet_step_of(v) {
                Ok(step) => Some(step),
                Err(e) => {
                    errors.push(e);
                    None
                }
            },
        };
        let needs = match map.get("needs") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(items)) if items.iter().all(Value::is_string) => {
                items.iter().filter_map(|v| v.as_str().map(str::to_string)).collect()
            }
            Some(other) => {
                errors.push(format!("needs: must be an array of program names, got {other}"));
                Vec::new()
            }
        };
        let task_id = match map.get("task_id") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s.clone()),
            Some(other) => {
                errors.push(format!("task_id: must be a string, got {}", json_type(other)));
                None
            }
        };
        let message_id = match map.get("message_id") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s.clone()),
            Some(other) => {
                errors.push(format!("message_id: must be a string, got {}", json_type(other)));
                None
            }
        };
        let request = match (capsule, text, origin) {
            (Some(capsule), Some(text), Some(origin)) if errors.is_empty() => {
                SubmitRequest { capsule, text, origin, context_id, deadline_at, needs, fleet_step, task_id, message_id }
            }
            (capsule, text, _) => {
                // Still report the value rules of the fields that did decode.
                let partial = SubmitRequest {
                    capsule: capsule.unwrap_or_else(|| "x".into()),
                    text: text.unwrap_or_else(|| "x".into()),
                    origin: Origin::User,
                    context_id,
                    deadline_at: None,
                    fleet_step: None,
                    needs,
                    task_id,
                    message_id,
                };
                errors.extend(partial.rule_errors());
                errors.sort_by_key(|e| field_rank(e));
                return Err(ApiError::invalid(errors.join("; ")));
            }
        };
        request.validate()?;
        Ok(request)
    }

    /// Checks the rules of a decoded submission:
    /// - `capsule`: a capsule name ([`is_valid_name`]);
    /// - `text`: [`text_rule`] with [`MAX_TASK_BYTES`] (not empty, at most 1 MiB, no NUL);
    /// - `context_id`, when given: 1–64 characters of `A-Z a-z 0-9 - _ .`, not starting or
    ///   ending with `.` (a `ctx_…` id fits; the id becomes a KV key and a folder name);
    /// - `task_id`, when given: a task id, `tsk_` and 32 lowercase hex digits;
    /// - `message_id`, when given: 1 to [`MAX_MESSAGE_ID_BYTES`] bytes, no control
    ///   characters.
    ///
    /// # Errors
    /// An [`ApiError`] with code `invalid_request` listing every broken rule, for example
    /// `text: must be at most 1048576 bytes, got 1048577`.
    pub fn validate(&self) -> Result<(), ApiError> {
        let errors = self.rule_errors();
        if errors.is_empty() { Ok(()) } else { Err(ApiError::invalid(errors.join("; "))) }
    }

    fn rule_errors(&self) -> Vec<String> {
        let mut errors = Vec::new();
        if !is_valid_name(&self.capsule) {
            errors.push(format!(
                "capsule: must be 1-64 characters of a-z, 0-9, '-' or '_', starting with a letter or digit, got {:?}",
                self.capsule
            ));
        }
        if let Some(rule) = text_rule(&self.text, MAX_TASK_BYTES) {
            errors.push(format!("text: {rule}"));
        }
        if let Some(ctx) = self.context_id.as_deref().filter(|c| !is_valid_context_id(c)) {
            errors.push(format!(
                "context_id: must be a ctx_ id or 1-64 characters of A-Z, a-z, 0-9, '-', '_' or '.', \
                 not starting or ending with '.' nor holding '..', got {ctx:?}"
            ));
        }
        if let Some(id) = self.task_id.as_deref().filter(|id| !Id::is_valid(IdKind::Task, id)) {
            errors.push(format!("task_id: must be a task id (tsk_ and 32 lowercase hex digits), got {id:?}"));
        }
        if let Some(id) = self
            .message_id
            .as_deref()
            .filter(|id| id.is_empty() || id.len() > MAX_MESSAGE_ID_BYTES || id.chars().any(char::is_control))
        {
            errors.push(format!(
                "message_id: must be 1-{MAX_MESSAGE_ID_BYTES} bytes without control characters, got {} bytes",
                id.len()
            ));
        }
        if self.needs.len() > MAX_NEEDS {
            errors.push(format!("needs: at most {MAX_NEEDS} programs, got {}", self.needs.len()));
        }
        for (i, need) in self.needs.iter().enumerate() {
            if need.is_empty() || need.len() > 255 || need.chars().any(|c| c.is_whitespace() || c.is_control()) {
                errors.push(format!("needs[{i}]: must be a program name (1-255 characters, no spaces), got {need:?}"));
            }
        }
        errors
    }
}

/// Whether `id` is acceptable as a context id: a `ctx_…` id, or 1–64 characters of
/// `A-Z a-z 0-9 - _ .` that neither start nor end with `.` nor hold `..` (it is a part of
/// a KV key: an empty token is no key).
pub fn is_valid_context_id(id: &str) -> bool {
    Id::is_valid(IdKind::Context, id)
        || (!id.is_empty()
            && id.len() <= MAX_CONTEXT_ID_CHARS
            && !id.starts_with('.')
            && !id.ends_with('.')
            && !id.contains("..")
            && id.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.')))
}

/// The answer to a submission: the new task's id and state (`submitted`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SubmitReply {
    /// `tsk_…`.
    pub task_id: String,
    /// Its state on acceptance.
    pub state: TaskState,
}

/// Names one task (`mur.api.task.get`, `mur.api.task.cancel`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TaskRef {
    /// `tsk_…`.
    pub task_id: String,
}

/// What went wrong with an API request, as a small set (the conventions, §7 item 2). Non
/// exhaustive: a newer coordinator may answer a code this build does not know, which reads
/// as [`ErrorCode::Unknown`], so a client matches on codes, never on an error's text.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum ErrorCode {
    /// The request broke a rule; the message names the field. Retrying it will not help.
    InvalidRequest,
    /// The task or capsule named does not exist.
    NotFound,
    /// The request conflicts with the current state (cancelling a finished task).
    Conflict,
    /// A bug or an unexpected server answer.
    Internal,
    /// JetStream or the coordinator is not reachable now; retry later.
    Unavailable,
    /// A code this build does not know (a newer coordinator's); read as `"unknown"`.
    #[serde(other)]
    Unknown,
}

impl ErrorCode {
    /// The wire name (`"invalid_request"`, …).
    pub const fn as_str(self) -> &'static str {
        match self {
            ErrorCode::InvalidRequest => "invalid_request",
            ErrorCode::NotFound => "not_found",
            ErrorCode::Conflict => "conflict",
            ErrorCode::Internal => "internal",
            ErrorCode::Unavailable => "unavailable",
            ErrorCode::Unknown => "unknown",
        }
    }

    /// The HTTP-like status a NATS micro service error header carries (400, 404, 409,
    /// 500, 503).
    pub const fn status(self) -> u16 {
        match self {
            ErrorCode::InvalidRequest => 400,
            ErrorCode::NotFound => 404,
            ErrorCode::Conflict => 409,
            ErrorCode::Internal => 500,
            ErrorCode::Unavailable => 503,
            ErrorCode::Unknown => 500,
        }
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The error an API request gets back, as JSON: `{"code": "invalid_request", "message":
/// "text: must not be empty"}`. Displays as `<code>: <message>`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{code}: {message}")]
pub struct ApiError {
    /// The kind of failure.
    pub code: ErrorCode,
    /// What went wrong, for people: lowercase, naming the field and the rule.
    pub message: String,
    /// The [`api::VERSION`] of the coordinator that answered; `None` for an error the
    /// client made itself (no coordinator answered) or one from a coordinator older than
    /// the versioned API (which, for one, refuses a [`SubmitRequest::task_id`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_version: Option<u32>,
}

impl ApiError {
    /// An error of `code`.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> ApiError {
        ApiError { code, message: message.into(), api_version: None }
    }

    /// An `invalid_request` error.
    pub fn invalid(message: impl Into<String>) -> ApiError {
        ApiError::new(ErrorCode::InvalidRequest, message)
    }

    /// The `unavailable` error of a request to `subject` that no coordinator subscribes to
    /// (NATS answered "no responders"): it says what to start, `<subject>: no coordinator
    /// answers (no responders); start one with `mur coordinator`, or `mur dev` for a
    /// cluster on this machine` (issue #29: it named no remedy).
    pub fn no_coordinator(subject: &str) -> ApiError {
        ApiError::new(
            ErrorCode::Unavailable,
            format!(
                "{subject}: no coordinator answers (no responders); start one with `mur coordinator`, \
                 or `mur dev` for a cluster on this machine"
            ),
        )
    }
}

// ---------------------------------------------------------------------------------------
// Helpers.

fn required_string(map: &Map<String, Value>, field: &str, errors: &mut Vec<String>) -> Option<String> {
    match map.get(field) {
        None | Some(Value::Null) => {
            errors.push(format!("{field}: required"));
            None
        }
        Some(Value::String(s)) => Some(s.clone()),
        Some(other) => {
            errors.push(format!("{field}: must be a string, got {}", json_type(other)));
            None
        }
    }
}

fn json_type(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Orders error lines by the field they name, in [`SUBMIT_FIELDS`] order (unknown fields
/// first), so messages are stable whatever the JSON key order.
fn field_rank(error: &str) -> usize {
    let field = error.split([':', '[']).next().unwrap_or_default();
    SUBMIT_FIELDS.iter().position(|f| *f == field).map_or(0, |i| i + 1)
}

/// The byte offset of serde_json's 1-based `line` and byte `column` in `text`: the byte at
/// which the parser stopped.
fn byte_offset(text: &str, line: usize, column: usize) -> usize {
    let line_start: usize = text.split_inclusive('\n').take(line.saturating_sub(1)).map(str::len).sum();
    (line_start + column.saturating_sub(1)).min(text.len())
}

/// serde_json's message without its ` at line L column C` suffix (the offset replaces it).
fn strip_position(message: &str) -> &str {
    message.rfind(" at line ").map_or(message, |i| &message[..i])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::Message;

    fn checkpoint(turn: u32, replace: bool, texts: &[String]) -> Checkpoint {
        Checkpoint {
            task_id: "tsk_1".into(),
            session_id: "ses_1".into(),
            worker: "w1".into(),
            turn,
            replace,
            messages: texts.iter().map(Message::user).collect(),
            counters: CheckpointCounters { turns: turn, ..Default::default() },
            session_tokens: 0,
            reopens: Vec::new(),
            at_ms: u64::from(turn),
            part: 0,
            parts: 0,
        }
    }

    fn read_back(values: &[(String, Vec<u8>)]) -> Vec<Checkpoint> {
        values.iter().map(|(_, json)| serde_json::from_slice(json).unwrap()).collect()
    }

    #[test]
    fn a_checkpoint_larger_than_a_message_is_written_in_parts_that_fold_back_into_it() {
        let max = 1 << 20;
        let big: Vec<String> = (0..5).map(|i| format!("{i}{}", "x".repeat(300_000))).collect();
        let first = checkpoint(1, true, &big[..1]);
        assert_eq!(first.clone().split(max).unwrap().len(), 1, "a checkpoint that fits is one value");
        let second = checkpoint(2, false, &big[1..]);
        let values = second.clone().split(max).unwrap();
        let keys: Vec<&str> = values.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(keys, ["ckpt.tsk_1.2", "ckpt.tsk_1.2.1"]);
        assert!(values.iter().all(|(_, json)| json.len() <= max - SESSION_VALUE_MARGIN));
        let parts = read_back(&values);
        assert_eq!((parts[0].part, parts[0].parts, parts[1].part, parts[1].parts), (0, 2, 1, 2));
        assert_eq!(parts.iter().map(|p| p.messages.len()).sum::<usize>(), 4);
        // A replace on its first part only.
        let replaced = read_back(&checkpoint(3, true, &big).split(max).unwrap());
        assert_eq!(replaced.iter().map(|p| p.replace).collect::<Vec<_>>(), [true, false]);

        let mut chain = read_back(&first.split(max).unwrap());
        chain.extend(parts.clone());
        let resumed = Checkpoint::fold(chain.clone()).unwrap().last;
        assert_eq!(resumed.messages.len(), 5);
        assert_eq!(resumed.messages[4].text(), big[4]);
        assert_eq!((resumed.turn, resumed.part, resumed.parts), (2, 0, 0));

        // Its worker died between the parts: the turn is left out, the task resumes after turn 1.
        let cut: Vec<Checkpoint> = chain[..2].to_vec();
        let resumed = Checkpoint::fold(cut.clone()).unwrap().last;
        assert_eq!((resumed.turn, resumed.messages.len()), (1, 1));
        // … and a later attempt's checkpoints after the stump still fold.
        let mut later = cut;
        later.push(checkpoint(2, false, &["again".to_string()]));
        let resumed = Checkpoint::fold(later).unwrap().last;
        assert_eq!((resumed.turn, resumed.messages.len()), (2, 2));
    }

    #[test]
    fn a_conversation_larger_than_a_message_is_stored_as_parts_under_a_head() {
        let max = 1 << 20;
        let key = context_key("chat", "ctx_1");
        let small = vec![Message::user("hi")];
        let values = StoredConversation::split(&key, small.clone(), max).unwrap();
        assert_eq!(values.len(), 1);
        assert_eq!(
            serde_json::from_slice::<StoredConversation>(&values[0].1).unwrap(),
            StoredConversation::Whole(small)
        );

        let big: Vec<Message> = (0..7).map(|i| Message::user(format!("{i}{}", "y".repeat(400_000)))).collect();
        let values = StoredConversation::split(&key, big.clone(), max).unwrap();
        assert!(values.iter().all(|(_, json)| json.len() <= max - SESSION_VALUE_MARGIN));
        // The parts first, the head last, under the conversation's own key.
        let (head_key, head) = values.last().unwrap();
        assert_eq!(head_key, &key);
        let head: StoredConversation = serde_json::from_slice(head).unwrap();
        let part_keys = head.part_keys(&key);
        assert_eq!(part_keys.len(), values.len() - 1);
        assert_eq!(part_keys, values[..values.len() - 1].iter().map(|(k, _)| k.clone()).collect::<Vec<_>>());
        assert!(part_keys[0].starts_with("ctx.chat.ctx_1=") && part_keys[0].ends_with(".0"), "{part_keys:?}");
        let joined: Vec<Message> = values[..values.len() - 1]
            .iter()
            .flat_map(|(_, json)| serde_json::from_slice::<Vec<Message>>(json).unwrap())
            .collect();
        assert_eq!(joined, big);
    }

    #[test]
    fn messages_split_into_runs_that_fit_and_keep_their_order() {
        let msgs: Vec<Message> = (0..10).map(|i| Message::user(format!("{i}{}", "z".repeat(90)))).collect();
        let one = serde_json::to_vec(&msgs[0]).unwrap().len() + 1;
        let runs = split_messages(msgs.clone(), 10, 10 + 2 + 3 * one);
        assert_eq!(runs.iter().map(Vec::len).collect::<Vec<_>>(), [3, 3, 3, 1]);
        assert_eq!(runs.concat(), msgs);
        // One larger than the room is a run of its own.
        assert_eq!(split_messages(msgs[..2].to_vec(), 0, 10).iter().map(Vec::len).collect::<Vec<_>>(), [1, 1]);
        assert_eq!(split_messages(Vec::new(), 0, 10), [Vec::<Message>::new()]);
    }

    #[test]
    fn a_terminal_record_too_large_for_a_message_clips_its_result_to_fit() {
        let request = SubmitRequest::new("echo", "y".repeat(100_000), Origin::User);
        let mut record = TaskRecord::submitted("tsk_1".into(), request, "ab".repeat(32), 5);
        let max = 1 << 20;
        // Fits already: unchanged.
        record.result = Some("short".into());
        assert!(!record.fit(max));
        assert_eq!(record.result.as_deref(), Some("short"));
        // Ten times the text, with quotes (two JSON bytes each) and a multi-byte character
        // where the cut would fall.
        let whole = format!("{}é{}", "\"".repeat(300_000), "z".repeat(800_000));
        record.result = Some(whole.clone());
        assert!(record.fit(max));
        let json = serde_json::to_vec(&record).unwrap();
        assert!(json.len() <= max - RECORD_MARGIN, "{}", json.len());
        let result = record.result.as_deref().unwrap();
        let note = format!("\n… [clipped: {} bytes in all; the whole is in out/result.txt]", whole.len());
        assert!(result.ends_with(&note), "{}", &result[result.len() - 100..]);
        assert!(whole.starts_with(result.strip_suffix(&note).unwrap()), "the start is kept");
        assert!(result.len() > 400_000, "as much as fits is kept: {}", result.len());
        // A record whose text alone is too large is left as it is.
        let mut big = TaskRecord::submitted(
            "tsk_2".into(),
            SubmitRequest::new("echo", "y".repeat(max), Origin::User),
            "ab".repeat(32),
            5,
        );
        big.result = Some("ok".into());
        assert!(!big.fit(max));
        assert_eq!(big.result.as_deref(), Some("ok"));
        // Submission refuses such a text, so a record always leaves room for its result.
        let err = big.check_room(max).unwrap_err();
        assert!(err.starts_with("text: at most about 10") && err.ends_with(", got 1048576"), "{err}");
        let small = TaskRecord::submitted(
            "tsk_3".into(),
            SubmitRequest::new("echo", "y".repeat(100_000), Origin::User),
            "ab".repeat(32),
            5,
        );
        assert_eq!(small.check_room(max), Ok(()));
    }

    #[test]
    fn a_worker_silent_past_the_timeout_is_not_live_in_the_status() {
        let info = |id: &str, heartbeat_at| WorkerInfo {
            worker_id: id.into(),
            slots: 4,
            busy: 1,
            started_at: 0,
            heartbeat_at,
            version: "0".into(),
        };
        let workers = [info("b-silent", 89_999), info("a-live", 90_000)];
        let status = ClusterStatus::build(&[], &workers, None, 100_000, 10_000);
        let seen: Vec<_> =
            status.workers.iter().map(|w| (w.worker_id.as_str(), w.free, w.heartbeat_age_ms, w.live)).collect();
        assert_eq!(seen, [("a-live", 3, 10_000, true), ("b-silent", 3, 10_001, false)]);
        // A reply from a coordinator that did not say reads as live.
        let old: WorkerStatus =
            serde_json::from_str(r#"{"worker_id":"w","slots":1,"free":1,"heartbeat_age_ms":5}"#).unwrap();
        assert!(old.live);
    }

    fn invalid(bytes: &[u8]) -> String {
        let err = SubmitRequest::parse(bytes).unwrap_err();
        assert_eq!(err.code, ErrorCode::InvalidRequest, "{err}");
        err.message
    }

    #[test]
    fn a_minimal_submission_defaults_to_the_user_origin() {
        let req = SubmitRequest::parse(br#"{"capsule":"hello","text":"hi"}"#).unwrap();
        assert_eq!(req, SubmitRequest::new("hello", "hi", Origin::User), "every optional field absent");
        let req =
            SubmitRequest::parse(br#"{"capsule":"a-1","text":"x","origin":"peer","context_id":"ctx-from-caller"}"#)
                .unwrap();
        assert_eq!((req.origin, req.context_id.as_deref()), (Origin::Peer, Some("ctx-from-caller")));
    }

    #[test]
    fn invalid_utf8_is_reported_with_its_byte_offset() {
        assert_eq!(invalid(b"{\"capsule\":\"\xff\"}"), "request: invalid UTF-8 at byte 12");
    }

    #[test]
    fn invalid_json_is_reported_with_its_byte_offset() {
        assert_eq!(invalid(br#"{"capsule": }"#), "request: invalid JSON at byte 12: expected value");
        assert_eq!(invalid(b"{\n  \"text\": \"a\",\n  oops"), "request: invalid JSON at byte 19: key must be a string");
        assert_eq!(invalid(br#"{"capsule":"a""#), "request: invalid JSON at byte 14: EOF while parsing an object");
        assert_eq!(invalid(b"[1]"), "request: must be a JSON object, got an array");
    }

    #[test]
    fn capsule_must_be_a_valid_name() {
        assert_eq!(
            invalid(br#"{"capsule":"Hello","text":"x"}"#),
            r#"capsule: must be 1-64 characters of a-z, 0-9, '-' or '_', starting with a letter or digit, got "Hello""#
        );
        assert_eq!(invalid(br#"{"text":"x"}"#), "capsule: required");
        assert_eq!(invalid(br#"{"capsule":7,"text":"x"}"#), "capsule: must be a string, got a number");
    }

    #[test]
    fn text_must_hold_more_than_whitespace_and_at_most_one_mebibyte() {
        let at_limit = serde_json::to_vec(&serde_json::json!({"capsule": "c", "text": "a".repeat(MAX_TASK_BYTES)}));
        assert!(SubmitRequest::parse(&at_limit.unwrap()).is_ok());
        let over = serde_json::to_vec(&serde_json::json!({"capsule": "c", "text": "a".repeat(MAX_TASK_BYTES + 1)}));
        assert_eq!(invalid(&over.unwrap()), "text: must be at most 1048576 bytes, got 1048577");
        assert_eq!(invalid(br#"{"capsule":"c","text":""}"#), "text: must not be empty");
        assert_eq!(invalid(br#"{"capsule":"c","text":" \n\t "}"#), "text: must not be only whitespace");
        assert_eq!(invalid(br#"{"capsule":"c"}"#), "text: required");
    }

    /// Issue #29: a task holding a NUL was accepted, ran, and ended `completed`/`ok` with
    /// "cannot start sh".
    #[test]
    fn a_text_holding_a_nul_is_refused_naming_the_rule_and_where() {
        assert_eq!(
            invalid(br#"{"capsule":"c","text":"echo a\u0000b"}"#),
            "text: must not contain a NUL character (U+0000: no command's argument can carry one), found at byte 6"
        );
        // Other control characters are allowed.
        assert!(SubmitRequest::parse(br#"{"capsule":"c","text":"printf '\u0001\u001b[1m'"}"#).is_ok());
    }

    #[test]
    fn origin_must_be_one_of_the_six() {
        assert_eq!(
            invalid(br#"{"capsule":"c","text":"x","origin":"admin"}"#),
            r#"origin: must be one of user, peer, schedule, event, completion, system, got "admin""#
        );
        assert_eq!(invalid(br#"{"capsule":"c","text":"x","origin":1}"#), "origin: must be a string, got a number");
    }

    #[test]
    fn context_id_must_be_a_ctx_id_or_a_safe_segment() {
        let ok = |ctx: &str| {
            let body = serde_json::json!({"capsule": "c", "text": "x", "context_id": ctx}).to_string();
            SubmitRequest::parse(body.as_bytes()).map(|r| r.context_id.unwrap())
        };
        assert_eq!(ok("ctx_0123456789abcdef0123456789abcdef").unwrap(), "ctx_0123456789abcdef0123456789abcdef");
        assert!(ok("Build.42_x-y").is_ok());
        assert!(ok(&"a".repeat(64)).is_ok());
        for bad in ["", "a/b", "..", "x..y", ".hidden", "trailing.", "sp ace", "a=b", "é", &"a".repeat(65)] {
            assert_eq!(
                ok(bad).unwrap_err().message,
                format!(
                    "context_id: must be a ctx_ id or 1-64 characters of A-Z, a-z, 0-9, '-', '_' or '.', \
                     not starting or ending with '.' nor holding '..', got {bad:?}"
                )
            );
        }
    }

    #[test]
    fn task_id_when_given_must_be_a_task_id() {
        let parsed = |id: Value| {
            let body = serde_json::json!({"capsule": "c", "text": "x", "task_id": id}).to_string();
            SubmitRequest::parse(body.as_bytes()).map(|r| r.task_id)
        };
        let id = "tsk_0123456789abcdef0123456789abcdef";
        assert_eq!(parsed(Value::from(id)).unwrap().as_deref(), Some(id));
        assert_eq!(parsed(Value::Null).unwrap(), None);
        for bad in ["", "tsk_1", "ctx_0123456789abcdef0123456789abcdef", "tsk_0123456789ABCDEF0123456789ABCDEF"] {
            assert_eq!(
                parsed(Value::from(bad)).unwrap_err().message,
                format!("task_id: must be a task id (tsk_ and 32 lowercase hex digits), got {bad:?}")
            );
        }
        assert_eq!(parsed(Value::from(7)).unwrap_err().message, "task_id: must be a string, got a number");
        // Absent from what is sent when not given: older coordinators read it as before.
        let sent = serde_json::to_value(SubmitRequest::new("c", "x", Origin::User)).unwrap();
        assert!(sent.get("task_id").is_none(), "{sent}");
    }

    #[test]
    fn a_message_id_is_kept_on_the_record_and_bounded() {
        let request = SubmitRequest::parse(br#"{"capsule":"c","text":"t","message_id":"msg-1"}"#).unwrap();
        assert_eq!(request.message_id.as_deref(), Some("msg-1"));
        let record = TaskRecord::submitted("tsk_1".into(), request, "d".into(), 5);
        assert_eq!(record.message_id.as_deref(), Some("msg-1"));
        let long = format!(r#"{{"capsule":"c","text":"t","message_id":"{}"}}"#, "m".repeat(257));
        assert_eq!(
            invalid(long.as_bytes()),
            "message_id: must be 1-256 bytes without control characters, got 257 bytes"
        );
        assert_eq!(
            invalid(br#"{"capsule":"c","text":"t","message_id":7}"#),
            "message_id: must be a string, got a number"
        );
    }

    #[test]
    fn every_broken_rule_is_listed_in_field_order() {
        assert_eq!(
            invalid(br#"{"text":"","extra":1,"capsule":"B A D","context_id":"a/b"}"#),
            "extra: unknown field, expected one of capsule, text, origin, context_id, deadline_at, needs, fleet_step, task_id, message_id; \
             capsule: must be 1-64 characters of a-z, 0-9, '-' or '_', starting with a letter or digit, got \"B A D\"; \
             text: must not be empty; \
             context_id: must be a ctx_ id or 1-64 characters of A-Z, a-z, 0-9, '-', '_' or '.', not starting or \
             ending with '.' nor holding '..', got \"a/b\""
        );
    }

    #[test]
    fn api_errors_travel_as_json_and_display_with_their_code() {
        let err = ApiError::new(ErrorCode::NotFound, "task tsk_1 not found");
        let json = serde_json::to_string(&err).unwrap();
        assert_eq!(json, r#"{"code":"not_found","message":"task tsk_1 not found"}"#);
        assert_eq!(serde_json::from_str::<ApiError>(&json).unwrap(), err);
        assert_eq!(err.to_string(), "not_found: task tsk_1 not found");
        let codes = [
            ErrorCode::InvalidRequest,
            ErrorCode::NotFound,
            ErrorCode::Conflict,
            ErrorCode::Internal,
            ErrorCode::Unavailable,
        ];
        let statuses: Vec<_> = codes.iter().map(|c| (c.as_str(), c.status())).collect();
        assert_eq!(
            statuses,
            [("invalid_request", 400), ("not_found", 404), ("conflict", 409), ("internal", 500), ("unavailable", 503)]
        );
    }

    #[test]
    fn a_submitted_record_takes_its_lane_from_the_origin() {
        let req = SubmitRequest::new("c", "t", Origin::Schedule);
        let rec = TaskRecord::submitted("tsk_1".into(), req, "ab".repeat(32), 1_700_000_000_000);
        assert_eq!((rec.lane, rec.state, rec.attempt), (Lane::Bg, TaskState::Submitted, 0));
        assert!(Id::is_valid(IdKind::Context, &rec.context_id), "{}", rec.context_id);
        let json = serde_json::to_value(&rec).unwrap();
        assert_eq!(json["origin"], "schedule");
        assert_eq!(json["state"], "submitted");
        assert!(json.get("exit_status").is_none(), "unset options are left out: {json}");
        assert_eq!(serde_json::from_value::<TaskRecord>(json).unwrap(), rec);
    }

    /// Issue #7 §Trace context: the record keeps the coordinator span's `traceparent`;
    /// records written before the field existed still read.
    #[test]
    fn a_record_round_trips_its_traceparent() {
        let req = SubmitRequest::new("c", "t", Origin::User);
        let mut rec = TaskRecord::submitted("tsk_1".into(), req, "ab".repeat(32), 1_700_000_000_000);
        let json = serde_json::to_value(&rec).unwrap();
        assert!(json.get("traceparent").is_none(), "no traceparent, no field: {json}");
        assert_eq!(serde_json::from_value::<TaskRecord>(json).unwrap().traceparent, None);
        rec.traceparent = Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into());
        let json = serde_json::to_value(&rec).unwrap();
        assert_eq!(json["traceparent"], "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
        assert_eq!(serde_json::from_value::<TaskRecord>(json).unwrap(), rec);
    }

    #[test]
    fn a_dispatch_carries_the_released_record_or_reads_as_before_without_it() {
        // A dispatch of an earlier version: no `released`.
        let old: Dispatch = serde_json::from_str(r#"{"task_id":"tsk_1","attempt":1}"#).unwrap();
        assert_eq!(old, Dispatch::bare("tsk_1", 1));
        assert_eq!(serde_json::to_string(&old).unwrap(), r#"{"task_id":"tsk_1","attempt":1}"#);
        let request = SubmitRequest::parse(br#"{"capsule":"hello","text":"hi"}"#).unwrap();
        let mut record = TaskRecord::submitted("tsk_1".into(), request, "ab".repeat(32), 5);
        record.attempt = 1;
        let carried = Dispatch { released: Some(Released { revision: 7, record: record.clone() }), ..old };
        let json = serde_json::to_value(&carried).unwrap();
        assert_eq!(
            (json["released"]["revision"].as_u64(), json["released"]["record"]["attempt"].as_u64()),
            (Some(7), Some(1))
        );
        assert_eq!(serde_json::from_value::<Dispatch>(json).unwrap(), carried);
        assert_eq!(carried.msg_id(), "tsk_1:1");
    }

    #[test]
    fn names_and_subjects_are_the_documented_ones() {
        assert_eq!(trace_subject("ses_1"), "mur.trace.ses_1");
        assert_eq!(Dispatch::bare("tsk_1", 2).msg_id(), "tsk_1:2");
        assert_eq!(bundle_object("hello", "ab"), "hello/ab");
        assert!(is_valid_digest(&"0f".repeat(32)));
        assert!(!is_valid_digest(&"0F".repeat(32)));
        assert!(!is_valid_digest("../etc"));
        for subject in [api::TASK_SUBMIT, api::TASK_GET, api::TASK_LIST, api::TASK_CANCEL, api::CAPSULE_LIST] {
            assert!(subject.starts_with(api::PREFIX), "{subject}");
        }
    }

    #[test]
    fn a_deadline_is_unix_milliseconds_and_reaches_the_record() {
        let r = SubmitRequest::parse(br#"{"capsule":"c","text":"t","deadline_at":1700000000000}"#).unwrap();
        assert_eq!(r.deadline_at, Some(1_700_000_000_000));
        let record = TaskRecord::submitted("tsk_1".into(), r, "d".into(), 0);
        assert_eq!(record.deadline_at, Some(1_700_000_000_000));
        let err = SubmitRequest::parse(br#"{"capsule":"c","text":"t","deadline_at":"soon"}"#).unwrap_err();
        assert_eq!(err.message, "deadline_at: must be unix milliseconds (a whole number), got \"soon\"");
        let err = SubmitRequest::parse(br#"{"capsule":"c","text":"t","deadline_at":-5}"#).unwrap_err();
        assert_eq!(err.message, "deadline_at: must be unix milliseconds (a whole number), got -5");
    }

    #[test]
    fn a_fleet_step_reaches_the_record_and_a_bad_one_is_refused_by_field() {
        let body = br#"{"capsule":"c","text":"t","fleet_step":{"fleet":"f","run_id":"r-0","step":"m","cap":3}}"#;
        let r = SubmitRequest::parse(body).unwrap();
        let record = TaskRecord::submitted("tsk_1".into(), r, "d".into(), 0);
        let step = record.fleet_step.unwrap();
        assert_eq!((step.fleet.as_str(), step.run_id.as_str(), step.step.as_str(), step.cap), ("f", "r-0", "m", 3));
        let err = SubmitRequest::parse(
            br#"{"capsule":"c","text":"t","fleet_step":{"fleet":"f","run_id":"r","step":"m","cap":0}}"#,
        )
        .unwrap_err();
        assert_eq!(err.message, "fleet_step.cap: must be at least 1, got 0");
        let err = SubmitRequest::parse(br#"{"capsule":"c","text":"t","fleet_step":{"fleet":"f"}}"#).unwrap_err();
        assert_eq!(err.message, "fleet_step: missing field `run_id`");
        for (body, message) in [
            (
                r#"{"fleet":"f","run_id":"r","step":"m","cap":3,"capp":9}"#,
                "fleet_step.capp: unknown field, expected one of fleet, run_id, step, cap",
            ),
            (r#"{"fleet":" ","run_id":"r","step":"m","cap":3}"#, "fleet_step.fleet: must not be empty"),
            (r#"{"fleet":"f","run_id":"","step":"m","cap":3}"#, "fleet_step.run_id: must not be empty"),
            (r#""f""#, "fleet_step: must be an object {fleet, run_id, step, cap}, got \"f\""),
        ] {
            let full = format!(r#"{{"capsule":"c","text":"t","fleet_step":{body}}}"#);
            assert_eq!(SubmitRequest::parse(full.as_bytes()).unwrap_err().message, message, "{body}");
        }
    }

    #[test]
    fn needs_are_program_names_and_reach_the_record() {
        let r = SubmitRequest::parse(br#"{"capsule":"c","text":"t","needs":["cargo","/usr/bin/git"]}"#).unwrap();
        assert_eq!(r.needs, ["cargo", "/usr/bin/git"]);
        let record = TaskRecord::submitted("tsk_1".into(), r, "d".into(), 0);
        assert_eq!(record.needs, ["cargo", "/usr/bin/git"]);
        let json = serde_json::to_value(&record).unwrap();
        assert_eq!(json["needs"], serde_json::json!(["cargo", "/usr/bin/git"]));
        let none = SubmitRequest::parse(br#"{"capsule":"c","text":"t"}"#).unwrap();
        assert!(serde_json::to_value(&none).unwrap().get("needs").is_none(), "left out when empty");
        let err = SubmitRequest::parse(br#"{"capsule":"c","text":"","needs":["ok","two words",""]}"#).unwrap_err();
        assert_eq!(
            err.message,
            "text: must not be empty; needs[1]: must be a program name (1-255 characters, no spaces), got \"two words\"; \
             needs[2]: must be a program name (1-255 characters, no spaces), got \"\""
        );
        let err = SubmitRequest::parse(br#"{"capsule":"c","text":"t","needs":"cargo"}"#).unwrap_err();
        assert_eq!(err.message, "needs: must be an array of program names, got \"cargo\"");
    }
}
