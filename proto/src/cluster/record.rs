//! The task record kept in `mur_tasks` and the dispatch that carries it to a worker.

use super::*;

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
    pub task_id: TaskId,
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
    /// Tool calls found in doubt at its takeovers — started by a worker that died before
    /// they ended — rerun or reported to the model (issue #34, `tool_call_in_doubt`
    /// lines); on its terminal record, absent when none.
    #[serde(default, skip_serializing_if = "is_zero_u32")]
    pub tool_calls_in_doubt: u32,
}

fn is_zero_u32(n: &u32) -> bool {
    *n == 0
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
    pub fn submitted(task_id: TaskId, request: SubmitRequest, capsule_digest: String, now_ms: u64) -> TaskRecord {
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
            tool_calls_in_doubt: 0,
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
    pub task_id: TaskId,
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
    pub fn bare(task_id: TaskId, attempt: u32) -> Dispatch {
        Dispatch { task_id, attempt, released: None }
    }

    /// The `Nats-Msg-Id`: `<task_id>:<attempt>` (the JetStream patterns reference, §1.4).
    pub fn msg_id(&self) -> String {
        format!("{}:{}", self.task_id, self.attempt)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_terminal_record_too_large_for_a_message_clips_its_result_to_fit() {
        let request = SubmitRequest::new("echo", "y".repeat(100_000), Origin::User);
        let mut record = TaskRecord::submitted(TaskId::unchecked("tsk_1"), request, "ab".repeat(32), 5);
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
            TaskId::unchecked("tsk_2"),
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
            TaskId::unchecked("tsk_3"),
            SubmitRequest::new("echo", "y".repeat(100_000), Origin::User),
            "ab".repeat(32),
            5,
        );
        assert_eq!(small.check_room(max), Ok(()));
    }

    #[test]
    fn a_submitted_record_takes_its_lane_from_the_origin() {
        let req = SubmitRequest::new("c", "t", Origin::Schedule);
        let rec = TaskRecord::submitted(TaskId::unchecked("tsk_1"), req, "ab".repeat(32), 1_700_000_000_000);
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
        let mut rec = TaskRecord::submitted(TaskId::unchecked("tsk_1"), req, "ab".repeat(32), 1_700_000_000_000);
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
        assert_eq!(old, Dispatch::bare(TaskId::unchecked("tsk_1"), 1));
        assert_eq!(serde_json::to_string(&old).unwrap(), r#"{"task_id":"tsk_1","attempt":1}"#);
        let request = SubmitRequest::parse(br#"{"capsule":"hello","text":"hi"}"#).unwrap();
        let mut record = TaskRecord::submitted(TaskId::unchecked("tsk_1"), request, "ab".repeat(32), 5);
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
}
