//! Tests of the dispatch rules: one table-style test per rule, then a seeded property test over
//! random input sequences that checks the invariants after every step against a plain list
//! model (the conventions, §7 item 9).

use super::*;
use mur_proto::Lane::{Bg, Peer, User};

fn submit(task_id: &str, capsule: &str, lane: Lane, queue_capsule: bool, seq: u64) -> Input {
    Input::Submitted { task_id: TaskId::unchecked(task_id), capsule: capsule.into(), lane, queue_capsule, seq }
}

fn up(worker_id: &str, slots: u32) -> Input {
    Input::WorkerUp { worker_id: worker_id.into(), slots }
}

fn gone(worker_id: &str) -> Input {
    Input::WorkerGone { worker_id: worker_id.into() }
}

fn started(task_id: &str, worker_id: &str) -> Input {
    Input::Started { task_id: TaskId::unchecked(task_id), worker_id: worker_id.into() }
}

fn released(task_id: &str) -> Input {
    Input::Released { task_id: TaskId::unchecked(task_id) }
}

fn ended(task_id: &str) -> Input {
    Input::Ended { task_id: TaskId::unchecked(task_id) }
}

fn canceled(task_id: &str) -> Input {
    Input::Canceled { task_id: TaskId::unchecked(task_id) }
}

/// The ids of the releases among `out`, in order; panics on anything else.
fn releases(out: &[Output]) -> Vec<String> {
    out.iter()
        .map(|output| match output {
            Output::Release { task_id, attempt } => {
                assert_eq!(*attempt, FIRST_ATTEMPT);
                task_id.to_string()
            }
            Output::Ignored(ignored) => panic!("expected only releases, got {ignored:?}"),
        })
        .collect()
}

/// `out` is exactly one [`Output::Ignored`]; returns its reason.
fn ignored(out: Vec<Output>) -> Ignored {
    match <[Output; 1]>::try_from(out) {
        Ok([Output::Ignored(ignored)]) => ignored,
        other => panic!("expected one ignored notice, got {other:?}"),
    }
}

fn waiting_counts(scheduler: &Scheduler) -> [usize; 3] {
    scheduler.snapshot().lanes.map(|lane| lane.waiting)
}

/// The lane test: with the one slot busy, tasks submitted to one capsule as bg, peer,
/// user, bg, user start as user, user, peer, bg, bg as the slot frees, whether the capsule is
/// `single` or `queue`; the running task is never displaced by the later user tasks.
#[test]
fn one_slot_releases_user_then_peer_then_bg_in_arrival_order() {
    for queue_capsule in [false, true] {
        let mut scheduler = Scheduler::new();
        assert!(scheduler.apply(up("w1", 1)).is_empty());
        assert_eq!(releases(&scheduler.apply(submit("t0", "cap", Bg, queue_capsule, 1))), ["t0"]);
        assert!(scheduler.apply(started("t0", "w1")).is_empty());
        for (task_id, lane, seq) in
            [("bg1", Bg, 2), ("peer1", Peer, 3), ("user1", User, 4), ("bg2", Bg, 5), ("user2", User, 6)]
        {
            assert!(scheduler.apply(submit(task_id, "cap", lane, queue_capsule, seq)).is_empty());
        }
        let snapshot = scheduler.snapshot();
        assert_eq!(
            snapshot.lanes.clone().map(|lane| (lane.lane, lane.waiting, lane.oldest_seq)),
            [(User, 2, Some(4)), (Peer, 1, Some(3)), (Bg, 2, Some(2))]
        );
        assert_eq!(snapshot.next.as_deref(), if queue_capsule { None } else { Some("user1") });
        assert_eq!(snapshot.in_flight.len(), 1);
        assert_eq!(snapshot.in_flight[0].worker_id.as_deref(), Some("w1"));
        assert_eq!(snapshot.free_slots, 0);

        let mut order = Vec::new();
        let mut running = "t0".to_string();
        for _ in 0..5 {
            let next = releases(&scheduler.apply(ended(&running)));
            assert_eq!(next.len(), 1, "queue_capsule {queue_capsule}: {next:?}");
            running = next[0].clone();
            assert!(scheduler.apply(started(&running, "w1")).is_empty());
            order.push(running.clone());
        }
        assert_eq!(order, ["user1", "user2", "peer1", "bg1", "bg2"], "queue_capsule {queue_capsule}");
        assert!(scheduler.apply(ended(&running)).is_empty());
        assert_eq!(scheduler.snapshot().free_slots, 1);
    }
}

/// A `queue` capsule never has two tasks in flight: with 3 slots it gets one, the other
/// slots go to tasks behind its waiting ones (even from lower lanes), and once its task ends
/// its next task is first in lane order again.
#[test]
fn queue_capsule_gets_one_release_at_a_time_while_others_fill_the_slots() {
    let mut scheduler = Scheduler::new();
    scheduler.apply(up("w1", 3));
    assert_eq!(releases(&scheduler.apply(submit("q1", "q", User, true, 1))), ["q1"]);
    assert!(scheduler.apply(submit("q2", "q", User, true, 2)).is_empty());
    assert_eq!(releases(&scheduler.apply(submit("s1", "s", Bg, false, 3))), ["s1"]);
    assert!(scheduler.apply(submit("q3", "q", User, true, 4)).is_empty());
    assert_eq!(releases(&scheduler.apply(submit("s2", "s", Bg, false, 5))), ["s2"]);
    assert!(scheduler.apply(submit("s3", "s", Peer, false, 6)).is_empty());

    let snapshot = scheduler.snapshot();
    assert_eq!(snapshot.busy_queue_capsules, ["q"]);
    assert_eq!(snapshot.next.as_deref(), Some("s3"), "q2 is skipped while q1 runs");
    assert_eq!(snapshot.free_slots, 0);
    assert_eq!(waiting_counts(&scheduler), [2, 1, 0]);

    // A slot frees: the peer task goes before the user tasks of the busy queue capsule.
    assert_eq!(releases(&scheduler.apply(ended("s1"))), ["s3"]);
    // q1 ends: q2 is the front of the user lane again and takes the freed slot.
    assert_eq!(releases(&scheduler.apply(ended("q1"))), ["q2"]);
    assert_eq!(scheduler.snapshot().busy_queue_capsules, ["q"]);
    // A free slot is not enough for q3 while q2 runs.
    assert!(scheduler.apply(ended("s2")).is_empty());
    let snapshot = scheduler.snapshot();
    assert_eq!((snapshot.free_slots, snapshot.next), (1, None));
    assert_eq!(releases(&scheduler.apply(ended("q2"))), ["q3"]);
    assert_eq!(scheduler.snapshot().in_flight.iter().filter(|task| task.capsule == "q").count(), 1);
}

/// Tasks of a `single` capsule are independent instances: they run in parallel up to the
/// free slots, and the rest wait.
#[test]
fn single_capsule_tasks_run_in_parallel() {
    let mut scheduler = Scheduler::new();
    scheduler.apply(up("w1", 2));
    scheduler.apply(up("w2", 1));
    let mut out = Vec::new();
    for (n, task_id) in ["a", "b", "c", "d"].into_iter().enumerate() {
        out.extend(scheduler.apply(submit(task_id, "s", Peer, false, n as u64 + 1)));
    }
    assert_eq!(releases(&out), ["a", "b", "c"]);
    let snapshot = scheduler.snapshot();
    assert_eq!(snapshot.in_flight.iter().map(|task| task.task_id.as_str()).collect::<Vec<_>>(), ["a", "b", "c"]);
    assert!(snapshot.busy_queue_capsules.is_empty());
    assert_eq!(snapshot.next.as_deref(), Some("d"));
    assert_eq!(releases(&scheduler.apply(ended("b"))), ["d"]);
}

/// Free slots = live slots − released-not-ended: a released task holds its slot before it
/// starts and after its worker goes, until it ends; a re-announced worker's slot count
/// replaces the old one.
#[test]
fn capacity_follows_workers_up_and_gone() {
    let mut scheduler = Scheduler::new();
    for (task_id, seq) in [("a", 1), ("b", 2), ("c", 3)] {
        assert!(scheduler.apply(submit(task_id, "s", Bg, false, seq)).is_empty(), "no worker, no release");
    }
    assert_eq!(scheduler.snapshot().next.as_deref(), Some("a"));
    assert_eq!(releases(&scheduler.apply(up("w1", 2))), ["a", "b"]);
    let snapshot = scheduler.snapshot();
    assert_eq!((snapshot.total_slots, snapshot.free_slots), (2, 0), "released tasks hold slots before they start");
    assert!(snapshot.in_flight.iter().all(|task| task.worker_id.is_none()));
    scheduler.apply(started("a", "w1"));
    scheduler.apply(started("b", "w1"));

    assert!(scheduler.apply(gone("w1")).is_empty());
    let snapshot = scheduler.snapshot();
    assert_eq!((snapshot.total_slots, snapshot.free_slots), (0, 0));
    assert_eq!(
        snapshot.in_flight.iter().map(|task| (task.task_id.as_str(), task.worker_id.as_deref())).collect::<Vec<_>>(),
        [("a", Some("w1")), ("b", Some("w1"))],
        "a gone worker's tasks stay in flight"
    );
    assert!(scheduler.apply(up("w2", 1)).is_empty(), "two in flight on one live slot");
    assert!(scheduler.apply(ended("a")).is_empty(), "one in flight on one live slot");
    assert!(scheduler.apply(started("b", "w2")).is_empty());
    assert_eq!(scheduler.snapshot().in_flight[0].worker_id.as_deref(), Some("w2"), "takeover after redelivery");
    assert_eq!(releases(&scheduler.apply(ended("b"))), ["c"]);

    assert!(scheduler.apply(up("w2", 3)).is_empty());
    let snapshot = scheduler.snapshot();
    assert_eq!((snapshot.total_slots, snapshot.free_slots), (3, 2));
    assert_eq!(snapshot.workers, BTreeMap::from([("w2".to_string(), 3)]));
    assert_eq!(ignored(scheduler.apply(gone("w9"))), Ignored::UnknownWorker { worker_id: "w9".into() });
    assert!(scheduler.apply(up("w2", 0)).is_empty(), "a draining worker");
    assert_eq!(scheduler.snapshot().free_slots, 0);
}

/// Rule 4: repeated and late inputs change nothing and say why.
#[test]
fn duplicate_and_late_inputs_are_ignored() {
    let mut scheduler = Scheduler::new();
    scheduler.apply(up("w1", 1));
    assert_eq!(releases(&scheduler.apply(submit("a", "s", Bg, false, 1))), ["a"]);
    let dup = ignored(scheduler.apply(submit("a", "s", User, false, 1)));
    assert_eq!(dup, Ignored::DuplicateSubmit { task_id: TaskId::unchecked("a") });
    assert_eq!(dup.to_string(), "task a: already submitted");
    assert!(scheduler.apply(submit("b", "s", Bg, false, 2)).is_empty());
    let before = scheduler.snapshot();
    assert_eq!(
        ignored(scheduler.apply(submit("b", "other", User, true, 0))),
        Ignored::DuplicateSubmit { task_id: TaskId::unchecked("b") }
    );
    assert_eq!(scheduler.snapshot(), before, "a duplicate with other fields does not move the task");

    let running = ignored(scheduler.apply(canceled("a")));
    assert_eq!(running, Ignored::AlreadyReleased { task_id: TaskId::unchecked("a") });
    assert_eq!(running.to_string(), "task a: already released, cancel it at its worker");
    assert_eq!(releases(&scheduler.apply(ended("a"))), ["b"]);
    assert_eq!(ignored(scheduler.apply(ended("a"))), Ignored::AlreadyEnded { task_id: TaskId::unchecked("a") });
    assert_eq!(
        ignored(scheduler.apply(submit("a", "s", Bg, false, 1))),
        Ignored::AlreadyEnded { task_id: TaskId::unchecked("a") }
    );
    assert_eq!(ignored(scheduler.apply(started("a", "w1"))), Ignored::AlreadyEnded { task_id: TaskId::unchecked("a") });
    assert!(scheduler.apply(released("b")).is_empty(), "released twice is a no-op");

    assert!(scheduler.apply(submit("c", "s", User, false, 3)).is_empty());
    assert!(scheduler.apply(canceled("c")).is_empty());
    assert_eq!(ignored(scheduler.apply(canceled("c"))), Ignored::AlreadyEnded { task_id: TaskId::unchecked("c") });
    assert_eq!(ignored(scheduler.apply(ended("c"))), Ignored::AlreadyEnded { task_id: TaskId::unchecked("c") });
    assert!(scheduler.apply(submit("d", "s", User, false, 4)).is_empty());
    assert!(scheduler.apply(ended("d")).is_empty(), "ended while waiting: it leaves the wait");
    assert_eq!(waiting_counts(&scheduler), [0, 0, 0]);

    // An end before the submit (a replay out of order): the late submit is ignored.
    assert_eq!(ignored(scheduler.apply(ended("x"))), Ignored::UnknownTask { task_id: TaskId::unchecked("x") });
    assert_eq!(
        ignored(scheduler.apply(submit("x", "s", User, false, 5))),
        Ignored::AlreadyEnded { task_id: TaskId::unchecked("x") }
    );
    let before = scheduler.snapshot();
    assert_eq!(ignored(scheduler.apply(started("y", "w1"))), Ignored::UnknownTask { task_id: TaskId::unchecked("y") });
    assert_eq!(scheduler.snapshot(), before, "a start of an unknown task holds no slot");
    assert_eq!(releases(&scheduler.apply(ended("b"))), Vec::<String>::new());
    assert_eq!(scheduler.snapshot().free_slots, 1);
}

/// Rule 4's memory of ended tasks is bounded: the last `ENDED_KEPT` ids are known, the
/// oldest is forgotten first, so a long-lived coordinator does not grow with every task.
#[test]
fn ended_tasks_are_remembered_up_to_ended_kept_and_the_oldest_is_forgotten_first() {
    let mut scheduler = Scheduler::new();
    for n in 0..=ENDED_KEPT {
        scheduler.apply(ended(&format!("t{n}")));
    }
    assert_eq!(scheduler.ended.ids.len(), ENDED_KEPT);
    assert_eq!(scheduler.ended.order.len(), ENDED_KEPT);
    // The oldest is forgotten: its late submit waits like a new task's.
    assert!(scheduler.apply(submit("t0", "s", User, false, 1)).is_empty());
    assert_eq!(waiting_counts(&scheduler), [1, 0, 0]);
    // The second oldest and the newest are still known.
    assert_eq!(
        ignored(scheduler.apply(submit("t1", "s", User, false, 2))),
        Ignored::AlreadyEnded { task_id: TaskId::unchecked("t1") }
    );
    let newest = format!("t{ENDED_KEPT}");
    assert_eq!(ignored(scheduler.apply(ended(&newest))), Ignored::AlreadyEnded { task_id: TaskId::unchecked(newest) });
}

/// `Submitted` inputs that arrive out of `seq` order still wait in `seq` order within their
/// lane (ties go to the smaller id).
#[test]
fn out_of_order_submits_wait_in_seq_order() {
    let mut scheduler = Scheduler::new();
    for (task_id, lane, seq) in [
        ("p5", Peer, 5),
        ("p2", Peer, 2),
        ("u8", User, 8),
        ("p9", Peer, 9),
        ("b4", Bg, 4),
        ("p1", Peer, 1),
        ("u3", User, 3),
        ("p7b", Peer, 7),
        ("p7a", Peer, 7),
        ("b6", Bg, 6),
    ] {
        assert!(scheduler.apply(submit(task_id, "s", lane, false, seq)).is_empty());
    }
    let snapshot = scheduler.snapshot();
    assert_eq!(snapshot.lanes.map(|lane| lane.oldest_seq), [Some(3), Some(1), Some(4)]);
    assert_eq!(snapshot.next.as_deref(), Some("u3"));
    assert_eq!(
        releases(&scheduler.apply(up("w1", 20))),
        ["u3", "u8", "p1", "p2", "p5", "p7a", "p7b", "p9", "b4", "b6"]
    );
}

/// A history shared by the restart tests: two workers, a `queue` capsule with a task running
/// and two waiting, tasks in flight on a gone worker, one released and not started, waiting
/// tasks in every lane, some ended. Returns the scheduler and the replay a restarted
/// coordinator would read from the task records (waiting tasks and the in-flight ones with
/// their start or release, live workers), in a scrambled order.
fn busy_history() -> (Scheduler, Vec<Input>) {
    let mut scheduler = Scheduler::new();
    let tasks = [
        ("q1", "q", User, true, 1),
        ("s1", "s", Bg, false, 2),
        ("s2", "s", Peer, false, 3),
        ("q2", "q", Bg, true, 4),
        ("s3", "s", Bg, false, 5),
        ("q3", "q", User, true, 6),
        ("s4", "s", User, false, 7),
        ("t1", "t", Peer, false, 8),
        ("s5", "s", Bg, false, 9),
        ("t2", "t", Bg, false, 10),
    ];
    scheduler.apply(up("w1", 2));
    scheduler.apply(up("w2", 2));
    let mut out = Vec::new();
    for (task_id, capsule, lane, queue, seq) in tasks {
        out.extend(scheduler.apply(submit(task_id, capsule, lane, queue, seq)));
    }
    assert_eq!(releases(&out), ["q1", "s1", "s2", "s3"]);
    scheduler.apply(started("q1", "w1"));
    scheduler.apply(started("s1", "w1"));
    scheduler.apply(started("s2", "w2"));
    assert_eq!(releases(&scheduler.apply(ended("s1"))), ["s4"]);
    scheduler.apply(started("s4", "w1"));
    scheduler.apply(gone("w2"));
    scheduler.apply(up("w3", 2));
    assert_eq!(releases(&scheduler.apply(ended("s4"))), ["t1"]);
    // Now: in flight q1 (w1), s2 (gone w2), s3 (released, not started), t1 (released);
    // waiting q3 (user, behind busy q), q2 (bg), s5 (bg), t2 (bg).
    scheduler.apply(started("t1", "w3"));
    assert!(scheduler.apply(canceled("t2")).is_empty());

    let mut replay = vec![
        started("t1", "w3"),
        submit("s5", "s", Bg, false, 9),
        up("w3", 2),
        released("s3"),
        submit("q2", "q", Bg, true, 4),
        started("s2", "w2"),
        submit("t1", "t", Peer, false, 8),
        submit("s3", "s", Bg, false, 5),
        up("w1", 2),
        submit("q3", "q", User, true, 6),
        started("q1", "w1"),
        submit("s2", "s", Peer, false, 3),
        submit("q1", "q", User, true, 1),
    ];
    // Terminal records, replayed too: they change nothing but remembering the ends.
    replay.extend([ended("s1"), ended("s4"), ended("t2")]);
    (scheduler, replay)
}

/// Rule 5: a coordinator restored from the replay (in any order) has the old one's state,
/// releases nothing the old one had not, and then makes the same releases for the same
/// inputs.
#[test]
fn a_restored_scheduler_releases_what_the_old_one_would() {
    let (mut old, replay) = busy_history();
    for replay in [replay.clone(), replay.iter().rev().cloned().collect()] {
        let (mut new, out) = Scheduler::restore(replay);
        assert!(
            out.iter().all(|output| matches!(output, Output::Ignored(Ignored::UnknownTask { .. }))),
            "a caught-up coordinator leaves nothing to release: {out:?}"
        );
        assert_eq!(new.snapshot(), old.snapshot());
        assert_eq!(new.snapshot().next.as_deref(), Some("s5"), "q3 is skipped while q1 runs");

        let mut old = old.clone();
        for input in [
            submit("u1", "s", User, false, 11),
            ended("s3"),
            ended("q1"),
            submit("s1", "s", Bg, false, 2),
            up("w4", 3),
            submit("p1", "t", Peer, false, 12),
            ended("t1"),
            gone("w1"),
            ended("q3"),
            ended("s2"),
            ended("u1"),
        ] {
            assert_eq!(new.apply(input.clone()), old.apply(input.clone()), "after {input:?}");
            assert_eq!(new.snapshot(), old.snapshot(), "after {input:?}");
        }
    }
    // The continuation above on its own, for the record of what it releases.
    let mut out = Vec::new();
    for input in [submit("u1", "s", User, false, 11), ended("s3"), ended("q1")] {
        out.extend(old.apply(input));
    }
    assert_eq!(releases(&out), ["u1", "q3"]);
}

/// A restore whose predecessor released a task and died before recording it as started:
/// the replayed start (or release) keeps the task out of the wait, so it is not released
/// twice, and its `queue` capsule stays busy; the releases due once the replay is in come
/// last, in lane order.
#[test]
fn restore_never_releases_a_task_already_in_flight() {
    let replay = vec![
        up("w1", 3),
        started("q2", "w1"),
        submit("q1", "q", Bg, true, 1),
        submit("s1", "s", Bg, false, 3),
        submit("q2", "q", User, true, 2),
        released("s2"),
        submit("s2", "s", Peer, false, 4),
        submit("s3", "s", Peer, false, 5),
        submit("s4", "s", User, false, 6),
    ];
    let (scheduler, out) = Scheduler::restore(replay);
    assert_eq!(releases(&out), ["s4"], "one slot left: the user task");
    let snapshot = scheduler.snapshot();
    assert_eq!(snapshot.in_flight.iter().map(|task| task.task_id.as_str()).collect::<Vec<_>>(), ["q2", "s2", "s4"]);
    assert_eq!(snapshot.busy_queue_capsules, ["q"]);
    assert_eq!(snapshot.next.as_deref(), Some("s3"));
    assert_eq!(waiting_counts(&scheduler), [0, 1, 2]);
}

/// SplitMix64: a tiny seeded generator, so the property test is reproducible without a
/// dependency.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> Option<&'a T> {
        (!items.is_empty()).then(|| &items[self.below(items.len() as u64) as usize])
    }
}

/// Capsules of the property test: the first two are `queue` capsules.
const CAPSULES: [(&str, bool); 5] = [("q0", true), ("q1", true), ("s0", false), ("s1", false), ("s2", false)];

/// A task of the model.
#[derive(Clone, Debug)]
struct ModelTask {
    id: TaskId,
    capsule: String,
    queue_capsule: bool,
    lane: Lane,
    seq: u64,
}

impl ModelTask {
    fn submitted(&self) -> Input {
        submit(&self.id, &self.capsule, self.lane, self.queue_capsule, self.seq)
    }
}

/// The rules restated over plain lists, the reference for the property test.
#[derive(Default)]
struct Model {
    waiting: Vec<ModelTask>,
    in_flight: Vec<(ModelTask, Option<String>)>,
    workers: BTreeMap<String, u32>,
    /// Tasks ended or canceled that the current scheduler knows of (ordered, so that picks
    /// from it are reproducible).
    ended: BTreeSet<TaskId>,
    /// Every task ever released (or reported in flight).
    released: HashSet<TaskId>,
    /// Every task accepted by a `Submitted`.
    submitted: Vec<TaskId>,
    /// Tasks that left the wait without a release (ended or canceled while waiting).
    dropped: HashSet<TaskId>,
}

impl Model {
    fn total_slots(&self) -> u64 {
        self.workers.values().map(|&slots| u64::from(slots)).sum()
    }

    fn busy(&self, capsule: &str) -> bool {
        self.in_flight.iter().any(|(task, _)| task.capsule == capsule)
    }

    /// The highest-lane oldest task among the releasable waiting ones.
    fn next(&self) -> Option<&ModelTask> {
        self.waiting
            .iter()
            .filter(|task| !task.queue_capsule || !self.busy(&task.capsule))
            .min_by(|a, b| (a.lane, a.seq, &a.id).cmp(&(b.lane, b.seq, &b.id)))
    }

    fn take_waiting(&mut self, id: &str) -> Option<ModelTask> {
        let at = self.waiting.iter().position(|task| task.id == id)?;
        Some(self.waiting.remove(at))
    }

    fn release(&mut self, id: &str, worker_id: Option<String>) {
        let task = self.take_waiting(id).expect("released a task that was not waiting");
        assert!(self.released.insert(task.id.clone()), "{id} released twice");
        self.in_flight.push((task, worker_id));
    }

    /// Applies a fact; returns the notice the scheduler must give if it changes nothing.
    fn learn(&mut self, input: &Input) -> Option<Ignored> {
        match input.clone() {
            Input::Submitted { task_id, capsule, lane, queue_capsule, seq } => {
                if self.ended.contains(&task_id) {
                    return Some(Ignored::AlreadyEnded { task_id });
                }
                if self.waiting.iter().chain(self.in_flight.iter().map(|(task, _)| task)).any(|task| task.id == task_id)
                {
                    return Some(Ignored::DuplicateSubmit { task_id });
                }
                self.submitted.push(task_id.clone());
                self.waiting.push(ModelTask { id: task_id, capsule, queue_capsule, lane, seq });
                None
            }
            Input::WorkerUp { worker_id, slots } => {
                self.workers.insert(worker_id, slots);
                None
            }
            Input::WorkerGone { worker_id } => {
                self.workers.remove(&worker_id).is_none().then_some(Ignored::UnknownWorker { worker_id })
            }
            Input::Started { task_id, worker_id } => self.in_flight_fact(task_id, Some(worker_id)),
            Input::Released { task_id } => self.in_flight_fact(task_id, None),
            Input::Ended { task_id } | Input::Canceled { task_id } => {
                let cancel = matches!(input, Input::Canceled { .. });
                if self.ended.contains(&task_id) {
                    return Some(Ignored::AlreadyEnded { task_id });
                }
                if self.take_waiting(&task_id).is_some() {
                    self.dropped.insert(task_id.clone());
                    self.ended.insert(task_id);
                    return None;
                }
                if let Some(at) = self.in_flight.iter().position(|(task, _)| task.id == task_id) {
                    if cancel {
                        return Some(Ignored::AlreadyReleased { task_id });
                    }
                    self.in_flight.remove(at);
                    self.ended.insert(task_id);
                    return None;
                }
                self.ended.insert(task_id.clone());
                Some(Ignored::UnknownTask { task_id })
            }
        }
    }

    fn in_flight_fact(&mut self, task_id: TaskId, worker_id: Option<String>) -> Option<Ignored> {
        if let Some((_, worker)) = self.in_flight.iter_mut().find(|(task, _)| task.id == task_id) {
            if worker_id.is_some() {
                *worker = worker_id;
            }
            return None;
        }
        if self.ended.contains(&task_id) {
            return Some(Ignored::AlreadyEnded { task_id });
        }
        if self.waiting.iter().any(|task| task.id == task_id) {
            self.release(&task_id, worker_id);
            return None;
        }
        Some(Ignored::UnknownTask { task_id })
    }

    /// The snapshot the scheduler must show.
    fn snapshot(&self) -> Snapshot {
        let lanes = Lane::ALL.map(|lane| LaneSnapshot {
            lane,
            waiting: self.waiting.iter().filter(|task| task.lane == lane).count(),
            oldest_seq: self.waiting.iter().filter(|task| task.lane == lane).map(|task| task.seq).min(),
        });
        let mut in_flight: Vec<InFlightTask> = self
            .in_flight
            .iter()
            .map(|(task, worker_id)| InFlightTask {
                task_id: task.id.clone(),
                capsule: task.capsule.clone(),
                queue_capsule: task.queue_capsule,
                lane: task.lane,
                seq: task.seq,
                worker_id: worker_id.clone(),
            })
            .collect();
        in_flight.sort_by(|a, b| (a.seq, &a.task_id).cmp(&(b.seq, &b.task_id)));
        let busy: BTreeSet<String> = self
            .in_flight
            .iter()
            .filter(|(task, _)| task.queue_capsule)
            .map(|(task, _)| task.capsule.clone())
            .collect();
        Snapshot {
            lanes,
            next: self.next().map(|task| task.id.clone()),
            in_flight,
            workers: self.workers.clone(),
            total_slots: self.total_slots(),
            free_slots: self.total_slots().saturating_sub(self.in_flight.len() as u64),
            busy_queue_capsules: busy.into_iter().collect(),
        }
    }

    /// What a restarted coordinator reads back, shuffled: waiting and in-flight tasks, live
    /// workers, and (if `with_ends`) the ended tasks' terminal records.
    fn replay(&self, rng: &mut SplitMix, with_ends: bool) -> Vec<Input> {
        let mut replay: Vec<Input> = self.waiting.iter().map(ModelTask::submitted).collect();
        for (task, worker_id) in &self.in_flight {
            replay.push(task.submitted());
            replay.push(match worker_id {
                Some(worker_id) => started(&task.id, worker_id),
                None => released(&task.id),
            });
        }
        replay.extend(self.workers.iter().map(|(worker_id, &slots)| up(worker_id, slots)));
        if with_ends {
            replay.extend(self.ended.iter().map(|task_id| ended(task_id)));
        }
        for i in (1..replay.len()).rev() {
            replay.swap(i, rng.below(i as u64 + 1) as usize);
        }
        replay
    }
}

/// Applies `input` to both, then checks every release and the state against the model:
/// (a) a release only while released-not-ended < live slots, (b) never two tasks of a
/// `queue` capsule in flight, (c) every release is the highest-lane oldest releasable
/// waiting task, no task is released twice, and no slot stays free while a releasable task
/// waits.
fn step(scheduler: &mut Scheduler, model: &mut Model, input: Input, context: &str) {
    let expected = model.learn(&input);
    let out = scheduler.apply(input);
    if let Some(expected) = expected {
        assert_eq!(out, [Output::Ignored(expected)], "{context}");
    }
    for output in out {
        let Output::Release { task_id, attempt } = output else {
            continue;
        };
        assert_eq!(attempt, FIRST_ATTEMPT, "{context}");
        assert!(
            (model.in_flight.len() as u64) < model.total_slots(),
            "{context}: released {task_id} with no free slot"
        );
        let next = model.next().map(|task| task.id.clone());
        assert_eq!(next.as_deref(), Some(task_id.as_str()), "{context}: lane order");
        model.release(&task_id, None);
        for (capsule, queue) in CAPSULES {
            let running = model.in_flight.iter().filter(|(task, _)| task.capsule == capsule).count();
            assert!(!queue || running <= 1, "{context}: {running} tasks of queue capsule {capsule} in flight");
        }
    }
    let snapshot = scheduler.snapshot();
    assert_eq!(snapshot, model.snapshot(), "{context}");
    assert!(snapshot.free_slots == 0 || snapshot.next.is_none(), "{context}: a slot is free and a task waits");
}

/// Random sequences of submits (some out of `seq` order), worker arrivals and departures,
/// starts, ends, cancels, duplicates and restarts keep rules 1–5 after every step; then a
/// drained run (a worker with slots, every task in flight ending) releases every task that
/// was not canceled or ended while waiting, exactly once.
#[test]
fn random_input_sequences_keep_lane_order_capacity_and_queue_exclusivity() {
    for seed in 0..120u64 {
        let mut rng = SplitMix(seed);
        let mut scheduler = Scheduler::new();
        let mut model = Model::default();
        let mut seq = 0u64;
        let mut restores = 0;
        for i in 0..400 {
            let waiting: Vec<TaskId> = model.waiting.iter().map(|task| task.id.clone()).collect();
            let in_flight: Vec<TaskId> = model.in_flight.iter().map(|(task, _)| task.id.clone()).collect();
            let ended_ids: Vec<TaskId> = model.ended.iter().cloned().collect();
            let worker = format!("w{}", rng.below(4));
            let input = match rng.below(100) {
                0..=29 => {
                    let (capsule, queue) = CAPSULES[rng.below(CAPSULES.len() as u64) as usize];
                    let lane = Lane::ALL[rng.below(3) as usize];
                    let task_seq = if rng.below(5) == 0 {
                        rng.below(seq + 1)
                    } else {
                        seq += 1;
                        seq
                    };
                    submit(&format!("t{i}"), capsule, lane, queue, task_seq)
                }
                30..=34 => {
                    let known: Vec<TaskId> = waiting.iter().chain(&in_flight).chain(&ended_ids).cloned().collect();
                    let Some(task_id) = rng.pick(&known) else { continue };
                    submit(task_id, "s0", Lane::ALL[rng.below(3) as usize], false, rng.below(seq + 1))
                }
                35..=44 => up(&worker, rng.below(4) as u32),
                45..=49 => gone(&format!("w{}", rng.below(5))),
                50..=59 => {
                    let Some(task_id) = rng.pick(&in_flight) else { continue };
                    started(task_id, &worker)
                }
                60..=76 => {
                    let Some(task_id) = rng.pick(&in_flight) else { continue };
                    ended(task_id)
                }
                77..=81 => {
                    let Some(task_id) = rng.pick(&waiting) else { continue };
                    ended(task_id)
                }
                82..=87 => {
                    let candidates = if rng.below(4) == 0 { &in_flight } else { &waiting };
                    let Some(task_id) = rng.pick(candidates) else { continue };
                    canceled(task_id)
                }
                88..=90 => {
                    let Some(task_id) = rng.pick(&ended_ids) else { continue };
                    ended(task_id)
                }
                91..=92 => {
                    let Some(task_id) = rng.pick(&in_flight) else { continue };
                    released(task_id)
                }
                93..=94 => ended(&format!("x{i}")),
                _ => {
                    // A restart: the new scheduler is built from the replay and takes over.
                    let with_ends = rng.below(2) == 0;
                    let (restored, out) = Scheduler::restore(model.replay(&mut rng, with_ends));
                    let context = format!("seed {seed} step {i}: restore");
                    assert!(
                        out.iter().all(|output| matches!(output, Output::Ignored(Ignored::UnknownTask { .. }))),
                        "{context}: {out:?}"
                    );
                    assert_eq!(restored.snapshot(), scheduler.snapshot(), "{context}");
                    scheduler = restored;
                    if !with_ends {
                        model.ended.clear();
                    }
                    restores += 1;
                    continue;
                }
            };
            let context = format!("seed {seed} step {i}: {input:?}");
            step(&mut scheduler, &mut model, input, &context);
        }
        assert!(restores > 0, "seed {seed}: no restart exercised");

        // Drain: enough slots, every task in flight ends, until nothing waits.
        step(&mut scheduler, &mut model, up("drain", 3), &format!("seed {seed}: drain"));
        while let Some((task, _)) = model.in_flight.first() {
            let input = ended(&task.id);
            let context = format!("seed {seed}: drain {input:?}");
            step(&mut scheduler, &mut model, input, &context);
        }
        assert!(model.waiting.is_empty(), "seed {seed}: tasks left waiting");
        for task_id in &model.submitted {
            assert!(
                model.released.contains(task_id) != model.dropped.contains(task_id),
                "seed {seed}: {task_id} must be released once or dropped while waiting"
            );
        }
    }
}

/// `admit`: a task is taken straight into flight only when it would be released at once;
/// otherwise nothing changes and it waits as a submitted task.
#[test]
fn a_task_is_admitted_at_submit_only_while_a_slot_is_free_and_its_queue_capsule_is_idle() {
    let mut s = Scheduler::new();
    // No worker: no free slot.
    assert!(!s.admit(&TaskId::unchecked("t0"), "a", User, false));
    assert_eq!(s.snapshot().in_flight.len(), 0);
    assert!(releases(&s.apply(up("w1", 2))).is_empty());
    assert!(s.admit(&TaskId::unchecked("t1"), "q", Bg, true));
    // The queue capsule has a task in flight: t2 of it is not admitted, and waits.
    assert!(!s.admit(&TaskId::unchecked("t2"), "q", User, true));
    assert!(releases(&s.apply(submit("t2", "q", User, true, 5))).is_empty());
    assert_eq!(waiting_counts(&s), [1, 0, 0]);
    // One slot left: t3 takes it, and then nothing more is admitted.
    assert!(s.admit(&TaskId::unchecked("t3"), "a", Peer, false));
    assert!(!s.admit(&TaskId::unchecked("t4"), "a", User, false));
    let snap = s.snapshot();
    assert_eq!(snap.free_slots, 0);
    assert_eq!(snap.in_flight.iter().map(|t| t.task_id.as_str()).collect::<Vec<_>>(), ["t1", "t3"]);
    assert_eq!(snap.busy_queue_capsules, ["q"]);
    // The admitted tasks' own records come back on the watch as released: no change.
    assert!(releases(&s.apply(released("t1"))).is_empty());
    assert!(releases(&s.apply(started("t3", "w1"))).is_empty());
    // t1 ends: its slot and its queue capsule go to the waiting t2.
    assert_eq!(releases(&s.apply(ended("t1"))), ["t2"]);
    // An id already known is never admitted again.
    assert!(releases(&s.apply(ended("t3"))).is_empty());
    assert!(!s.admit(&TaskId::unchecked("t1"), "a", User, false));
    assert!(!s.admit(&TaskId::unchecked("t2"), "a", User, false));
    // An admitted task whose record could not be stored is given back with `Ended`.
    assert!(s.admit(&TaskId::unchecked("t5"), "a", User, false));
    assert!(releases(&s.apply(ended("t5"))).is_empty());
    assert_eq!(s.snapshot().free_slots, 1);
}

/// Issue #32: the leader's gauges count waiting tasks per capsule and lane, name each
/// group's oldest, and count in-flight tasks per capsule.
#[test]
fn load_counts_waiting_tasks_per_capsule_and_lane_with_the_oldest_first() {
    let (mut s, _) = Scheduler::restore([]);
    for input in [
        submit("t1", "a", Peer, false, 1),
        submit("t2", "a", User, false, 2),
        submit("t3", "a", Peer, false, 3),
        submit("t4", "b", Bg, false, 4),
        up("w", 1),
    ] {
        s.apply(input);
    }
    // The one slot went to the front of the highest lane: t2 (user).
    let load = s.load();
    assert_eq!(
        load.waiting,
        vec![("a".to_string(), Peer, 2, "t1".to_string()), ("b".to_string(), Bg, 1, "t4".to_string())]
    );
    assert_eq!(load.in_flight, vec![("a".to_string(), 1)]);
    assert_eq!((load.workers, load.total_slots, load.free_slots), (1, 1, 0));
}
