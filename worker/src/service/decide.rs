//! What a worker does with one dispatch, apart from doing it: [`decide`] looks at what the
//! delivery knows so far ([`Known`]: the task record, the capsule, the checkpoints of a
//! takeover, the fan-out permit) and names the next [`Step`]. The service does the step's
//! IO, adds what it learned to [`Known`] and asks again, until the dispatch is answered
//! (ack, terminate, nak with a delay), the record is ended, or it is marked `working` and
//! the task runs (the module docs of `service`, steps 1–3; issue #8 §Takeover; issue #11
//! §The fan-out cap).

use mur_proto::SessionId;
use mur_proto::cluster::TaskRecord;
use mur_proto::fanout::FleetStep;
use mur_proto::task::{ExitStatus, TaskState};
use std::time::Duration;

/// Which delivery of which dispatch message is being handled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Delivered {
    /// 1 for the first delivery, +1 per redelivery.
    pub number: u64,
    /// The message's sequence in `MUR_DISPATCH` (`None` only for a message without
    /// JetStream metadata, never expected).
    pub stream_seq: Option<u64>,
}

/// How a dispatch is answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Answer {
    /// Done with (ran, or nothing to run): double-ack.
    Ack,
    /// Can never be run (not a dispatch, no record): terminate.
    Term,
    /// A transient failure: redeliver after this delay ([`nak_delay`]).
    Nak(Duration),
    /// No answer: the message's delivery under way is another session's (this one was
    /// superseded, [`Hold::Superseded`]); an answer from here would ack, or send back, the
    /// dispatch that session runs under.
    Leave,
}

impl Answer {
    /// A nak for `delivery`, with its delay.
    pub fn nak(delivery: Delivered) -> Answer {
        Answer::Nak(nak_delay(delivery.number))
    }
}

/// How long a dispatch that could not be handled waits before its next delivery: 1 s after
/// the first, doubling, at most 30 s (issue #8: retries wait, never an instant
/// redelivery loop). After the consumer's `max_deliver` deliveries the coordinator
/// dead-letters it.
pub(super) fn nak_delay(delivery: u64) -> Duration {
    Duration::from_secs(1u64 << delivery.saturating_sub(1).min(5)).min(Duration::from_secs(30))
}

/// The task record as this delivery knows it.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Record {
    /// Carried in the dispatch, as the release wrote it, with its revision: not read. One
    /// compare-and-set is tried on it; a long wait starts from a read instead.
    Carried(TaskRecord, u64),
    /// Read from `mur_tasks` during this delivery, with its revision.
    Read(TaskRecord, u64),
    /// Known to have moved on (a compare-and-set on it lost, or a permit wait ended since):
    /// to be read again.
    Stale,
    /// Read, and there is none: nothing to run.
    Missing,
    /// Could not be read (JetStream did not answer).
    Unreadable,
}

/// Something a delivery fetches once: the capsule, a takeover's checkpoints.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Fetch<T> {
    /// Not fetched yet.
    NotYet,
    /// Fetched.
    Done(T),
    /// The broker did not answer: another delivery fetches again.
    Unavailable,
    /// Can never be fetched: the task fails with this reason.
    Failed(String),
}

/// Where a fleet step's wait for a fan-out permit stands (issue #11).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Permit {
    /// No permit held (none waited for yet, or the task is no fleet step).
    NotHeld,
    /// A permit is held (renewed in the background).
    Held,
    /// The wait ended without one.
    Ended(PermitWait),
}

/// Why a step stopped waiting for a fan-out permit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum PermitWait {
    /// The task's deadline passed first.
    Deadline,
    /// The task was cancelled, or the worker is stopping.
    Cancelled,
    /// JetStream failed. `hold_permit` no longer ends a wait so (it waits again within the
    /// delivery: issue #29 item 3); [`decide`] still naks one, should a caller report it.
    Failed,
}

/// What one delivery knows so far. `C` is the loaded capsule, `T` the takeover read from
/// the checkpoints (the tests use `()` for both).
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Known<C, T> {
    /// The task record.
    pub record: Record,
    /// The capsule named by the record (its name and digest never change, so it is kept
    /// when the record is read again).
    pub capsule: Fetch<C>,
    /// The checkpoints of the session the record names, for a takeover (read again with
    /// the record).
    pub takeover: Fetch<T>,
    /// The fan-out permit, for a fleet step.
    pub permit: Permit,
}

impl<C, T> Known<C, T> {
    /// What a delivery knows at first: the record the dispatch carries, or nothing yet.
    pub fn new(carried: Option<(TaskRecord, u64)>) -> Known<C, T> {
        Known {
            record: carried.map_or(Record::Stale, |(r, revision)| Record::Carried(r, revision)),
            capsule: Fetch::NotYet,
            takeover: Fetch::NotYet,
            permit: Permit::NotHeld,
        }
    }

    /// Learns the record read from `mur_tasks`: `Ok(None)` when there is none. A takeover's
    /// checkpoints are read again for it.
    pub fn read<E>(&mut self, read: Result<Option<(TaskRecord, u64)>, E>) {
        self.record = match read {
            Ok(Some((r, revision))) => Record::Read(r, revision),
            Ok(None) => Record::Missing,
            Err(_) => Record::Unreadable,
        };
        self.takeover = Fetch::NotYet;
    }

    /// The record and its revision, when one is known.
    pub fn current(&self) -> Option<(TaskRecord, u64)> {
        match &self.record {
            Record::Carried(r, revision) | Record::Read(r, revision) => Some((r.clone(), *revision)),
            Record::Stale | Record::Missing | Record::Unreadable => None,
        }
    }
}

/// The next thing to do with a dispatch, with what the doing needs of [`Known`].
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Step<'a, C> {
    /// Answer the dispatch: nothing more to do with it.
    Answer(Answer),
    /// Ack the dispatch as a duplicate: the record is `working` under another dispatch
    /// message, whose delivery runs the task ([`run_elsewhere`]).
    Duplicate,
    /// Read the record (again) from `mur_tasks`.
    Read,
    /// Fetch and load the bundle of this record's capsule.
    LoadCapsule(&'a TaskRecord),
    /// Read the checkpoints of the session that had this record `working` (its worker
    /// stopped answering for it): the task is taken over from the last one.
    TakeOver(&'a TaskRecord),
    /// Wait in line for a fan-out permit for this record's fleet step.
    WaitForPermit(&'a TaskRecord, &'a FleetStep),
    /// Compare-and-set the record to its end (unless it ended, or runs elsewhere,
    /// meanwhile), then ack; nak when the write fails.
    End(End),
    /// Compare-and-set the record to `working` under a new session, then run the task with
    /// `capsule`; a `carried` record gets one try, a conflict sends it to be read again.
    MarkWorking {
        /// The record.
        record: &'a TaskRecord,
        /// The loaded capsule.
        capsule: &'a C,
        /// Whether the record is the one the dispatch carried.
        carried: bool,
    },
}

/// A terminal record to write ([`Step::End`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct End {
    /// The exit status.
    pub exit: ExitStatus,
    /// The record's `result`.
    pub result: String,
    /// The record's `error`.
    pub error: Option<String>,
    /// Whether the record names this worker (`worker`): it tried to run the task.
    pub by_this_worker: bool,
}

impl End {
    fn without_error<'a, C>(exit: ExitStatus) -> Step<'a, C> {
        Step::End(End { exit, result: exit.as_str().to_string(), error: None, by_this_worker: false })
    }
}

/// The next step for the dispatch `delivery` given what it knows; `stopping` is whether
/// the worker's shutdown grace is over (its running tasks are being cancelled). In order:
/// a permit wait ended by a failure or by the worker's stop goes back; no record is
/// terminated; a record to read is read; a terminal record is acked, one running
/// elsewhere acked as a duplicate; a permit wait that ran out of time or was cancelled
/// ends the task (`deadline_exceeded`, `canceled`), and so does a cancel requested
/// before any session ran it; the capsule is loaded (a broken bundle fails the task); a
/// record `working` under another session is taken over from its checkpoints; a fleet
/// step waits for its permit (from a record read, not the carried one: the wait may be
/// long); then the record is marked `working`.
pub(super) fn decide<C, T>(known: &Known<C, T>, delivery: Delivered, stopping: bool) -> Step<'_, C> {
    let nak = Step::Answer(Answer::nak(delivery));
    if let Permit::Ended(why) = known.permit
        && (why == PermitWait::Failed || (why == PermitWait::Cancelled && stopping))
    {
        // JetStream failed, or the worker is stopping: another delivery waits again.
        return nak;
    }
    let (record, carried) = match &known.record {
        Record::Carried(r, _) => (r, true),
        Record::Read(r, _) => (r, false),
        Record::Stale => return Step::Read,
        Record::Missing => return Step::Answer(Answer::Term),
        Record::Unreadable => return nak,
    };
    if record.state.is_terminal() {
        return Step::Answer(Answer::Ack);
    }
    if run_elsewhere(record, delivery.stream_seq) {
        return Step::Duplicate;
    }
    if let Permit::Ended(why) = known.permit {
        let exit = if why == PermitWait::Deadline { ExitStatus::DeadlineExceeded } else { ExitStatus::Canceled };
        return End::without_error(exit);
    }
    if record.cancel_requested_at.is_some() {
        // Cancelled after its release, before any session ran it: it never starts.
        return End::without_error(ExitStatus::Canceled);
    }
    let capsule = match &known.capsule {
        Fetch::NotYet => return Step::LoadCapsule(record),
        Fetch::Unavailable => return nak,
        Fetch::Failed(reason) => {
            return Step::End(End {
                exit: ExitStatus::Failed,
                result: reason.clone(),
                error: Some(reason.clone()),
                by_this_worker: true,
            });
        }
        Fetch::Done(capsule) => capsule,
    };
    if taken_over(record) {
        match &known.takeover {
            Fetch::NotYet => return Step::TakeOver(record),
            Fetch::Unavailable | Fetch::Failed(_) => return nak,
            Fetch::Done(_) => {}
        }
    }
    if let (Some(step), Permit::NotHeld) = (&record.fleet_step, known.permit) {
        return if carried { Step::Read } else { Step::WaitForPermit(record, step) };
    }
    Step::MarkWorking { record, capsule, carried }
}

/// Whether `record` was being run by a session that stopped answering for it (its worker
/// died): `working` with a session. Marking it `working` again takes it over.
pub(super) fn taken_over(record: &TaskRecord) -> bool {
    record.state == TaskState::Working && record.session_id.is_some()
}

/// Whether `record` is `working` under another dispatch message than the one with
/// `stream_seq`: that message's delivery runs the task (or takes it over if its worker
/// dies, for it stays unacked until the end), so this one is a duplicate — a dispatch
/// published again after `MUR_DISPATCH`'s duplicate window — and writes nothing.
pub(super) fn run_elsewhere(record: &TaskRecord, stream_seq: Option<u64>) -> bool {
    record.state == TaskState::Working
        && matches!((record.dispatch_seq, stream_seq), (Some(running), Some(this)) if running != this)
}

/// What the record read at a progress tick says of the session running the task.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Hold {
    /// The session goes on.
    GoOn,
    /// The task was cancelled (`cancel_requested_at`): the session stops, ends the task
    /// `canceled` with its `task_end`, and writes the terminal record.
    CancelRequested,
    /// The session is no longer the task's: the record ended elsewhere (taken over and
    /// finished by another session, or dead-lettered), or it is `working` under another
    /// session (taken over while this one's worker was cut off). The session stops and
    /// writes nothing of the task's end: no `task_end`, no terminal record (the design's
    /// invariant 4: `task_end` is written once; a partitioned worker's late writes are
    /// refused, not applied).
    Superseded,
}

/// [`Hold`] for `record` read while the dispatch runs; `session` is the session this
/// delivery marked `working`, `None` before it has (a record `working` under another
/// session is then one this delivery is about to take over, not a loss).
pub(super) fn hold(record: &TaskRecord, session: Option<&SessionId>) -> Hold {
    if record.state.is_terminal() {
        return Hold::Superseded;
    }
    if let Some(ours) = session
        && record.state == TaskState::Working
        && record.session_id.as_ref() != Some(ours)
    {
        return Hold::Superseded;
    }
    if record.cancel_requested_at.is_some() {
        return Hold::CancelRequested;
    }
    Hold::GoOn
}

/// Whether the terminal write of `session` may end `record`: not when it ended, nor when
/// another session holds it (taken over; [`Hold::Superseded`]).
pub(super) fn ends_for(record: &TaskRecord, session: &SessionId) -> bool {
    !record.state.is_terminal() && record.session_id.as_ref() == Some(session)
}

/// Whether a compare-and-set may write `record` for the delivery with `stream_seq`: not
/// when it ended, or runs under another dispatch message, meanwhile.
pub(super) fn writable(record: &TaskRecord, stream_seq: Option<u64>) -> bool {
    !record.state.is_terminal() && !run_elsewhere(record, stream_seq)
}

#[cfg(test)]
mod tests {
    use super::*;
    use mur_proto::cluster::SubmitRequest;
    use mur_proto::{SessionId, TaskId};

    const DELIVERY: Delivered = Delivered { number: 3, stream_seq: Some(7) };
    const NAK: Step<'static, ()> = Step::Answer(Answer::Nak(Duration::from_secs(4)));

    fn submitted() -> TaskRecord {
        let request: SubmitRequest =
            serde_json::from_value(serde_json::json!({ "capsule": "c", "text": "t" })).expect("a submit request");
        TaskRecord::submitted(TaskId::unchecked("tsk_1"), request, "sha256:d".into(), 1)
    }

    fn with(change: impl FnOnce(&mut TaskRecord)) -> TaskRecord {
        let mut r = submitted();
        change(&mut r);
        r
    }

    fn working(session: &str, dispatch_seq: u64) -> TaskRecord {
        with(|r| {
            r.state = TaskState::Working;
            r.session_id = Some(SessionId::unchecked(session));
            r.dispatch_seq = Some(dispatch_seq);
        })
    }

    fn step_of_fleet() -> TaskRecord {
        with(|r| r.fleet_step = Some(FleetStep { fleet: "f".into(), run_id: "run_1".into(), step: "a".into(), cap: 1 }))
    }

    /// Known with `record` read, the capsule loaded, no permit.
    fn read(record: TaskRecord) -> Known<(), ()> {
        Known {
            record: Record::Read(record, 1),
            capsule: Fetch::Done(()),
            takeover: Fetch::NotYet,
            permit: Permit::NotHeld,
        }
    }

    fn end(exit: ExitStatus, result: &str, error: Option<&str>, by_this_worker: bool) -> Step<'static, ()> {
        Step::End(End { exit, result: result.into(), error: error.map(Into::into), by_this_worker })
    }

    /// A case: what it is, what the delivery knows, whether the worker is stopping, the step.
    type Case<'a> = (&'static str, Known<(), ()>, bool, Step<'a, ()>);

    fn mark_working(record: &TaskRecord, carried: bool) -> Step<'_, ()> {
        Step::MarkWorking { record, capsule: &(), carried }
    }

    #[test]
    fn each_thing_known_about_a_dispatch_leads_to_its_step() {
        let plain = submitted();
        let ended = with(|r| r.state = TaskState::Completed);
        let cancel_requested = with(|r| r.cancel_requested_at = Some(5));
        let ended_canceled = with(|r| {
            r.state = TaskState::Canceled;
            r.cancel_requested_at = Some(5);
        });
        let this_message = working("ses_a", 7);
        let no_session = with(|r| r.state = TaskState::Working);
        let fleet = step_of_fleet();
        let fleet_step = fleet.fleet_step.clone().expect("a fleet step");
        let canceled = end(ExitStatus::Canceled, "canceled", None, false);
        let cases: Vec<Case<'_>> = vec![
            ("no record carried: read it", Known::new(None), false, Step::Read),
            (
                "a carried record: its capsule is loaded, with no read",
                Known::new(Some((plain.clone(), 1))),
                false,
                Step::LoadCapsule(&plain),
            ),
            (
                "no record stored: terminate",
                Known { record: Record::Missing, ..read(plain.clone()) },
                false,
                Step::Answer(Answer::Term),
            ),
            ("the record unreadable: nak", Known { record: Record::Unreadable, ..read(plain.clone()) }, false, NAK),
            ("a terminal record: ack", read(ended.clone()), false, Step::Answer(Answer::Ack)),
            ("working under another dispatch message: a duplicate", read(working("ses_a", 6)), false, Step::Duplicate),
            (
                "working under this very message: taken over",
                read(this_message.clone()),
                false,
                Step::TakeOver(&this_message),
            ),
            (
                "a cancel requested before any session: end canceled",
                read(cancel_requested.clone()),
                false,
                canceled.clone(),
            ),
            (
                "a cancel requested on a terminal record: ack, nothing written",
                read(ended_canceled),
                false,
                Step::Answer(Answer::Ack),
            ),
            (
                "the capsule not loaded yet: load it",
                Known { capsule: Fetch::NotYet, ..read(plain.clone()) },
                false,
                Step::LoadCapsule(&plain),
            ),
            (
                "the capsule store did not answer: nak",
                Known { capsule: Fetch::Unavailable, ..read(plain.clone()) },
                false,
                NAK,
            ),
            (
                "a broken bundle: end failed with the reason, by this worker",
                Known { capsule: Fetch::Failed("error: no bundle".into()), ..read(plain.clone()) },
                false,
                end(ExitStatus::Failed, "error: no bundle", Some("error: no bundle"), true),
            ),
            (
                "a cancel request comes before loading the capsule",
                Known { capsule: Fetch::NotYet, ..read(cancel_requested) },
                false,
                canceled.clone(),
            ),
            (
                "the checkpoints unreadable: nak",
                Known { takeover: Fetch::Unavailable, ..read(this_message.clone()) },
                false,
                NAK,
            ),
            (
                "the checkpoints read: mark working",
                Known { takeover: Fetch::Done(()), ..read(this_message.clone()) },
                false,
                mark_working(&this_message, false),
            ),
            (
                "working without a session is no takeover: mark working",
                read(no_session.clone()),
                false,
                mark_working(&no_session, false),
            ),
            ("a plain task with its capsule: mark working", read(plain.clone()), false, mark_working(&plain, false)),
            (
                "a carried plain task with its capsule: mark working, one try",
                Known { record: Record::Carried(plain.clone(), 1), ..read(plain.clone()) },
                false,
                mark_working(&plain, true),
            ),
            (
                "a fleet step without a permit: wait for one",
                read(fleet.clone()),
                false,
                Step::WaitForPermit(&fleet, &fleet_step),
            ),
            (
                "a carried fleet step: read the record before the wait",
                Known { record: Record::Carried(fleet.clone(), 1), ..read(fleet.clone()) },
                false,
                Step::Read,
            ),
            (
                "a fleet step holding its permit: mark working",
                Known { permit: Permit::Held, ..read(fleet.clone()) },
                false,
                mark_working(&fleet, false),
            ),
            (
                "the permit wait ran out of time: read the record before ending it",
                Known { record: Record::Stale, permit: Permit::Ended(PermitWait::Deadline), ..read(fleet.clone()) },
                false,
                Step::Read,
            ),
            (
                "the permit wait ran out of time, the record read: end deadline_exceeded",
                Known { permit: Permit::Ended(PermitWait::Deadline), ..read(fleet.clone()) },
                false,
                end(ExitStatus::DeadlineExceeded, "deadline_exceeded", None, false),
            ),
            (
                "the permit wait cancelled: end canceled",
                Known { permit: Permit::Ended(PermitWait::Cancelled), ..read(fleet.clone()) },
                false,
                canceled,
            ),
            (
                "the permit wait cancelled by the worker's stop: nak, nothing read",
                Known { record: Record::Stale, permit: Permit::Ended(PermitWait::Cancelled), ..read(fleet.clone()) },
                true,
                NAK,
            ),
            (
                "the permit wait failed: nak, nothing read",
                Known { record: Record::Stale, permit: Permit::Ended(PermitWait::Failed), ..read(fleet.clone()) },
                false,
                NAK,
            ),
            (
                "the permit wait ended and the record is gone: terminate",
                Known { record: Record::Missing, permit: Permit::Ended(PermitWait::Deadline), ..read(fleet.clone()) },
                false,
                Step::Answer(Answer::Term),
            ),
            (
                "the permit wait ended and the record ended meanwhile: ack",
                Known { permit: Permit::Ended(PermitWait::Deadline), ..read(ended) },
                false,
                Step::Answer(Answer::Ack),
            ),
        ];
        for (case, known, stopping, expected) in &cases {
            assert_eq!(&decide(known, DELIVERY, *stopping), expected, "{case}");
        }
    }

    #[test]
    fn a_progress_tick_tells_a_cancel_from_a_session_superseded() {
        let ours = SessionId::unchecked("ses_a");
        let cancel = |mut r: TaskRecord| {
            r.cancel_requested_at = Some(5);
            r
        };
        let ended = |state: TaskState| with(|r| r.state = state);
        let table: Vec<(&str, TaskRecord, Option<&SessionId>, Hold)> = vec![
            ("ours, working", working("ses_a", 7), Some(&ours), Hold::GoOn),
            ("ours, cancel requested", cancel(working("ses_a", 7)), Some(&ours), Hold::CancelRequested),
            ("taken over by another session", working("ses_b", 7), Some(&ours), Hold::Superseded),
            ("taken over, and a cancel requested", cancel(working("ses_b", 7)), Some(&ours), Hold::Superseded),
            ("ended elsewhere", ended(TaskState::Completed), Some(&ours), Hold::Superseded),
            ("ended canceled elsewhere", cancel(ended(TaskState::Canceled)), Some(&ours), Hold::Superseded),
            ("dead-lettered", ended(TaskState::Failed), Some(&ours), Hold::Superseded),
            ("not marked yet: another session's, to take over", working("ses_b", 7), None, Hold::GoOn),
            ("not marked yet: released", submitted(), None, Hold::GoOn),
            ("not marked yet: cancel requested", cancel(submitted()), None, Hold::CancelRequested),
            ("not marked yet: ended", ended(TaskState::Completed), None, Hold::Superseded),
        ];
        for (case, record, session, want) in table {
            assert_eq!(hold(&record, session), want, "{case}");
        }
    }

    #[test]
    fn only_the_session_holding_the_record_writes_its_end() {
        let ours = SessionId::unchecked("ses_a");
        assert!(ends_for(&working("ses_a", 7), &ours));
        assert!(ends_for(
            &with(|r| {
                r.state = TaskState::Working;
                r.session_id = Some(ours.clone());
                r.cancel_requested_at = Some(1)
            }),
            &ours
        ));
        assert!(!ends_for(&working("ses_b", 7), &ours), "taken over");
        assert!(
            !ends_for(
                &with(|r| {
                    r.state = TaskState::Completed;
                    r.session_id = Some(ours.clone())
                }),
                &ours
            ),
            "ended"
        );
        assert!(!ends_for(&submitted(), &ours), "never marked by this session");
    }

    #[test]
    fn a_dispatch_without_a_stream_sequence_is_never_a_duplicate() {
        let record = working("ses_a", 6);
        let known = read(record.clone());
        assert_eq!(decide(&known, Delivered { number: 2, stream_seq: None }, false), Step::TakeOver(&record));
    }

    #[test]
    fn naks_wait_one_second_doubling_up_to_thirty() {
        let delays: Vec<u64> = (1..=8).map(|d| nak_delay(d).as_secs()).collect();
        assert_eq!(delays, [1, 2, 4, 8, 16, 30, 30, 30]);
        assert_eq!(nak_delay(0), Duration::from_secs(1));
    }

    #[test]
    fn a_record_read_again_forgets_the_takeover_but_keeps_the_capsule() {
        let mut known: Known<(), ()> = Known { takeover: Fetch::Done(()), ..read(working("ses_a", 7)) };
        known.read(Ok::<_, ()>(Some((working("ses_b", 7), 2))));
        assert_eq!(known.takeover, Fetch::NotYet);
        assert_eq!(known.capsule, Fetch::Done(()));
        assert_eq!(known.current().map(|(r, rev)| (r.session_id, rev)), Some((Some(SessionId::unchecked("ses_b")), 2)));
        known.read(Ok::<_, ()>(None));
        assert_eq!(known.record, Record::Missing);
        known.read(Err(()));
        assert_eq!(known.record, Record::Unreadable);
    }
}
