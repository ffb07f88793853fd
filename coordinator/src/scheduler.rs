//! The coordinator's dispatch decisions: which waiting task a free worker slot goes to, and
//! when. Every submitted task waits here and is released to the workers only while a slot is
//! free, so lane order holds cluster-wide and no worker hoards work it cannot start
//! (the design, §A task's way through the cluster, step 3; shape (a) of §JetStream resources).
//!
//! The rules (each one tested in `scheduler/tests.rs`):
//! 1. **Lane order** (the session-loop seed, §Queue lanes; the design, §Invariants 1): the
//!    next release is the front of the highest non-empty lane, `user` before `peer` before
//!    `bg`, arrival order (`seq`) within a lane: one global order across all capsules. A
//!    released task is never taken back: lanes decide which task starts next, never which one
//!    stops.
//! 2. **One at a time for `queue` capsules** (the session-loop seed, §Capsule lifecycle;
//!    the design, §Invariants 2): a task of a capsule with `task_acceptance: queue` is not
//!    released while any task of that capsule is released and not ended. It is skipped over
//!    (tasks behind it may go first) and is next in lane order again once its capsule's task
//!    ends. Tasks of `single` capsules are independent instances and run in parallel.
//! 3. **Capacity** (the design, §Invariants 8): free slots = the slots of the live workers −
//!    the tasks released and not ended. A released task holds a slot from its release, before
//!    any worker starts it, and keeps holding it when its worker goes: JetStream redelivers it
//!    after the ack wait, so it stays in flight until it ends.
//! 4. **Idempotent inputs**: a second `Submitted` for a known task, an `Ended` for an ended
//!    one, and the like change nothing (the adapter may replay after a restart); each is
//!    reported as [`Output::Ignored`] for the adapter to log. Ended tasks are known by the
//!    last [`ENDED_KEPT`] ids, so the memory of them is bounded.
//! 5. **Rebuild**: [`Scheduler::restore`] replays the task records of a restarted coordinator
//!    in any order and ends in the state the old one had, so it releases the same next task.
//!
//! Pure: no IO, no async, no clock (the conventions, §7 item 3). The adapter turns task
//! records, worker heartbeats and dispatch acks into [`Input`]s, and publishes each
//! [`Output::Release`] into `MUR_DISPATCH` with the message id `<task id>:<attempt>`.

use mur_proto::lanes::Lanes;
use mur_proto::{Lane, TaskId};
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};

#[cfg(test)]
mod tests;

/// The attempt number of a task's release. The scheduler releases a task once and never
/// takes it back, so every release is attempt 1; the number is part of the dispatch's
/// message id (`<task id>:<attempt>`, the design, §JetStream resources) so that a restarted
/// coordinator re-releasing a task its predecessor had already published is de-duplicated by
/// JetStream rather than dispatched twice.
pub const FIRST_ATTEMPT: u32 = 1;

/// A fact the scheduler learns: a task record's change, a worker's arrival or departure.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Input {
    /// A task was stored and waits to be released.
    Submitted {
        /// `tsk_…`.
        task_id: TaskId,
        /// The capsule the task runs in.
        capsule: String,
        /// The lane the task waits in (its origin's lane).
        lane: Lane,
        /// Whether the capsule has `task_acceptance: queue` (at most one of its tasks in
        /// flight cluster-wide).
        queue_capsule: bool,
        /// Arrival order: the KV revision that created the task record. Orders the tasks of a
        /// lane, whatever order the `Submitted` inputs come in; ties go to the smaller id.
        seq: u64,
    },
    /// A worker is live with `slots` task slots; a second `WorkerUp` for the same worker
    /// replaces its slot count.
    WorkerUp {
        /// The worker's id.
        worker_id: String,
        /// How many tasks it runs at once (0 for a worker that is draining).
        slots: u32,
    },
    /// A worker is gone: its slots no longer count. The tasks it held stay in flight until
    /// they end (JetStream redelivers them to another worker after the ack wait).
    WorkerGone {
        /// The worker's id.
        worker_id: String,
    },
    /// A worker took the task. For a task this scheduler released this records the worker (a
    /// second `Started` with another worker is a takeover after redelivery); for a task still
    /// waiting here it means another (earlier) coordinator released it: it leaves the wait
    /// and holds a slot.
    Started {
        /// `tsk_…`.
        task_id: TaskId,
        /// The worker running it.
        worker_id: String,
    },
    /// A task was released by another (earlier) coordinator and has not started: it leaves
    /// the wait and holds a slot, with no worker yet. Used when replaying the task records of
    /// a restart; a no-op for a task already in flight.
    Released {
        /// `tsk_…`.
        task_id: TaskId,
    },
    /// The task's terminal record (completed, failed or canceled) was written. A waiting task
    /// leaves the wait; an in-flight one frees its slot and its `queue` capsule.
    Ended {
        /// `tsk_…`.
        task_id: TaskId,
    },
    /// The task was canceled while waiting: it never starts. A task already released is not
    /// taken back (it is cancelled at its worker and ends with [`Input::Ended`]).
    Canceled {
        /// `tsk_…`.
        task_id: TaskId,
    },
}

/// What the adapter does after an input.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Output {
    /// Publish the task into `MUR_DISPATCH` (message id `<task_id>:<attempt>`). The task now
    /// holds a slot until its [`Input::Ended`].
    Release {
        /// `tsk_…`.
        task_id: TaskId,
        /// Always [`FIRST_ATTEMPT`] today; see there.
        attempt: u32,
    },
    /// The input changed nothing the adapter needs to act on; worth a log line.
    Ignored(Ignored),
}

/// Why an input was ignored (rule 4). Messages are lowercase log lines.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Ignored {
    /// A `Submitted` for a task already waiting or in flight.
    #[error("task {task_id}: already submitted")]
    DuplicateSubmit {
        /// `tsk_…`.
        task_id: TaskId,
    },
    /// An input about a task that has ended here (or was canceled while waiting).
    #[error("task {task_id}: already ended")]
    AlreadyEnded {
        /// `tsk_…`.
        task_id: TaskId,
    },
    /// A `Started` or `Released` for a task never submitted here, or an `Ended` or `Canceled`
    /// before its `Submitted`. The last two still mark the task ended, so a late `Submitted`
    /// for it is ignored.
    #[error("task {task_id}: not submitted to this scheduler")]
    UnknownTask {
        /// `tsk_…`.
        task_id: TaskId,
    },
    /// A `Canceled` for a task already released: a running task is never interrupted by the
    /// scheduler; the worker cancels it and it ends.
    #[error("task {task_id}: already released, cancel it at its worker")]
    AlreadyReleased {
        /// `tsk_…`.
        task_id: TaskId,
    },
    /// A `WorkerGone` for a worker that is not up.
    #[error("worker {worker_id}: not up")]
    UnknownWorker {
        /// The worker's id.
        worker_id: String,
    },
}

/// The scheduler's state at one instant, for `mur` status commands, logs and tests.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Snapshot {
    /// The waiting tasks of each lane, in [`Lane::ALL`] order (`user`, `peer`, `bg`).
    pub lanes: [LaneSnapshot; 3],
    /// The waiting task the next free slot goes to (the front of the highest lane, skipping
    /// tasks of busy `queue` capsules); `None` when nothing waiting can be released.
    pub next: Option<TaskId>,
    /// Tasks released and not ended, in arrival (`seq`) order.
    pub in_flight: Vec<InFlightTask>,
    /// Live workers and their slots, by worker id.
    pub workers: BTreeMap<String, u32>,
    /// Sum of the live workers' slots.
    pub total_slots: u64,
    /// `total_slots` − tasks in flight, never below 0 (it is 0 while more tasks are in flight
    /// than live slots, after a worker went).
    pub free_slots: u64,
    /// `queue` capsules with a task in flight, sorted.
    pub busy_queue_capsules: Vec<String>,
}

/// The scheduler's load, for the leader's gauges ([`Scheduler::load`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Load {
    /// Per capsule and lane: `(capsule, lane, tasks waiting, the oldest one's id)`.
    pub waiting: Vec<(String, Lane, usize, String)>,
    /// Per capsule: `(capsule, tasks in flight)`.
    pub in_flight: Vec<(String, usize)>,
    /// Live workers.
    pub workers: usize,
    /// Their slots.
    pub total_slots: u64,
    /// Their free slots.
    pub free_slots: u64,
}

/// The waiting tasks of one lane.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaneSnapshot {
    /// The lane.
    pub lane: Lane,
    /// How many tasks wait in it.
    pub waiting: usize,
    /// The `seq` of its oldest waiting task.
    pub oldest_seq: Option<u64>,
}

/// A task released and not ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InFlightTask {
    /// `tsk_…`.
    pub task_id: TaskId,
    /// Its capsule.
    pub capsule: String,
    /// Whether the capsule is a `queue` capsule.
    pub queue_capsule: bool,
    /// The lane it waited in.
    pub lane: Lane,
    /// Its arrival order.
    pub seq: u64,
    /// The worker that last reported starting it; `None` until one does.
    pub worker_id: Option<String>,
}

/// A waiting task, as it sits in the lanes.
#[derive(Clone, Debug)]
struct Waiting {
    lane: Lane,
    seq: u64,
    task_id: TaskId,
    capsule: String,
    queue_capsule: bool,
}

/// A released task.
#[derive(Clone, Debug)]
struct InFlight {
    capsule: String,
    queue_capsule: bool,
    lane: Lane,
    seq: u64,
    worker_id: Option<String>,
}

/// The dispatch state machine: waiting tasks in lanes, tasks in flight, live workers.
///
/// Feed it with [`Scheduler::apply`]; rebuild it after a restart with
/// [`Scheduler::restore`]. Costs: a release or a removal scans the waiting tasks (O(n)); an
/// out-of-order `Submitted` re-sorts them (O(n log n)). The last [`ENDED_KEPT`] ended task
/// ids are remembered (rule 4), one short string each.
#[derive(Clone, Debug, Default)]
pub struct Scheduler {
    /// Waiting tasks in dispatch order (sorted by `(seq, task_id)` within each lane whenever
    /// `unsorted` is false, which holds between calls).
    waiting: Lanes<Waiting>,
    /// The ids of the waiting tasks.
    waiting_ids: HashSet<TaskId>,
    /// The largest `(seq, task_id)` pushed into each lane since it was last sorted or empty:
    /// a `Submitted` above it goes at the back, one below it marks the lanes unsorted.
    lane_max: [Option<(u64, TaskId)>; 3],
    /// Whether a `Submitted` came out of order and the lanes need sorting.
    unsorted: bool,
    /// Tasks released and not ended, by id.
    in_flight: HashMap<TaskId, InFlight>,
    /// Tasks in flight per capsule (only non-zero counts are kept).
    capsule_load: HashMap<String, u32>,
    /// The last [`ENDED_KEPT`] tasks that ended or were canceled here.
    ended: Ended,
    /// Live workers and their slots.
    workers: BTreeMap<String, u32>,
}

/// How many ended task ids the scheduler remembers (rule 4). A late input for an ended
/// task comes from a watch a little behind the intake, within moments of the end; an
/// unbounded set grew with every task a long-lived coordinator saw (~60 bytes each: 50 MB a
/// day at 10 tasks/s). 100,000 ids, each held twice (set and order), are ~15 MB.
pub const ENDED_KEPT: usize = 100_000;

/// The ids of the tasks that ended most recently, at most [`ENDED_KEPT`]: the oldest is
/// forgotten when one more ends.
#[derive(Clone, Debug, Default)]
struct Ended {
    ids: HashSet<TaskId>,
    order: VecDeque<TaskId>,
}

impl Ended {
    fn contains(&self, task_id: &str) -> bool {
        self.ids.contains(task_id)
    }

    fn insert(&mut self, task_id: TaskId) {
        if self.ids.insert(task_id.clone()) {
            self.order.push_back(task_id);
        }
        while self.order.len() > ENDED_KEPT {
            if let Some(oldest) = self.order.pop_front() {
                self.ids.remove(&oldest);
            }
        }
    }
}

/// Position of `lane` in [`Lane::ALL`].
const fn lane_rank(lane: Lane) -> usize {
    match lane {
        Lane::User => 0,
        Lane::Peer => 1,
        Lane::Bg => 2,
    }
}

/// Whether a waiting task may be released now (rule 2): `single` tasks always, `queue` tasks
/// only while nothing of their capsule is in flight.
fn releasable(task: &Waiting, capsule_load: &HashMap<String, u32>) -> bool {
    !task.queue_capsule || !capsule_load.contains_key(&task.capsule)
}

impl Scheduler {
    /// An empty scheduler: no tasks, no workers.
    pub fn new() -> Self {
        Self::default()
    }

    /// Rebuilds the state of a restarted coordinator from a replay of the task records and
    /// worker registrations (rule 5): `Submitted` for every task not ended, followed (in any
    /// position of the replay) by `Started` or `Released` for the ones in flight, and
    /// `WorkerUp` for every live worker. The replay's order does not matter beyond the
    /// relative order of `WorkerUp`/`WorkerGone` for one worker: every `Submitted` is applied
    /// first, `seq` restores arrival order, and nothing is released until the whole replay is
    /// in. Returns the scheduler and the outputs of the replay (`Ignored` notices, then the
    /// releases due once the state is whole; none if the old coordinator was caught up).
    pub fn restore(replay: impl IntoIterator<Item = Input>) -> (Scheduler, Vec<Output>) {
        let (submits, rest): (Vec<_>, Vec<_>) =
            replay.into_iter().partition(|input| matches!(input, Input::Submitted { .. }));
        let mut scheduler = Scheduler::new();
        let mut out = Vec::new();
        for input in submits.into_iter().chain(rest) {
            scheduler.learn(input, &mut out);
        }
        scheduler.dispatch(&mut out);
        (scheduler, out)
    }

    /// Takes in one fact and returns what to do: the releases it makes possible, in release
    /// order, after an [`Output::Ignored`] if the input changed nothing.
    pub fn apply(&mut self, input: Input) -> Vec<Output> {
        let mut out = Vec::new();
        self.learn(input, &mut out);
        self.dispatch(&mut out);
        out
    }

    /// Admits a task about to be stored straight into flight when a task submitted now
    /// would be released at once (rules 1–3): a slot is free and the task is releasable
    /// (its `queue` capsule has nothing in flight). While a slot is free nothing
    /// releasable waits (every input ends with the releases it allows), so no task in any
    /// lane is passed over. Returns `true` when admitted: the task holds a slot from now
    /// and the adapter stores its record already released (attempt [`FIRST_ATTEMPT`]) and
    /// publishes its dispatch, one record write fewer than a wait and a release (issue
    /// #9). `false` (no free slot, a busy `queue` capsule, or a task id already known)
    /// changes nothing: the task is submitted as usual. An admitted task whose record
    /// could not be stored is given back with [`Input::Ended`]; it is listed in flight
    /// with `seq` 0 until then (its record's revision is not known before it is stored).
    pub fn admit(&mut self, task_id: &TaskId, capsule: &str, lane: Lane, queue_capsule: bool) -> bool {
        if self.free_slots() == 0
            || self.ended.contains(task_id)
            || self.waiting_ids.contains(task_id)
            || self.in_flight.contains_key(task_id)
        {
            return false;
        }
        let task = Waiting { lane, seq: 0, task_id: task_id.clone(), capsule: capsule.to_string(), queue_capsule };
        if !releasable(&task, &self.capsule_load) {
            return false;
        }
        self.hold_slot(task, None);
        true
    }

    /// The current state.
    pub fn snapshot(&self) -> Snapshot {
        let lanes = Lane::ALL.map(|lane| LaneSnapshot {
            lane,
            waiting: self.waiting.len_of(lane),
            oldest_seq: self.waiting.iter().find(|task| task.lane == lane).map(|task| task.seq),
        });
        let next =
            self.waiting.iter().find(|task| releasable(task, &self.capsule_load)).map(|task| task.task_id.clone());
        let mut in_flight: Vec<InFlightTask> = self
            .in_flight
            .iter()
            .map(|(task_id, task)| InFlightTask {
                task_id: task_id.clone(),
                capsule: task.capsule.clone(),
                queue_capsule: task.queue_capsule,
                lane: task.lane,
                seq: task.seq,
                worker_id: task.worker_id.clone(),
            })
            .collect();
        in_flight.sort_by(|a, b| (a.seq, &a.task_id).cmp(&(b.seq, &b.task_id)));
        let busy_queue_capsules: BTreeSet<String> =
            self.in_flight.values().filter(|task| task.queue_capsule).map(|task| task.capsule.clone()).collect();
        Snapshot {
            lanes,
            next,
            in_flight,
            workers: self.workers.clone(),
            total_slots: self.total_slots(),
            free_slots: self.free_slots(),
            busy_queue_capsules: busy_queue_capsules.into_iter().collect(),
        }
    }

    /// Sum of the live workers' slots.
    /// What the leader's gauges report (issue #32): per capsule and lane, the waiting
    /// tasks and the id of the oldest (the front of its lane); the tasks in flight per
    /// capsule; the live workers, their slots and the free ones. Sorted by capsule, then
    /// lane. One pass over the waiting tasks.
    pub fn load(&self) -> Load {
        let mut waiting: BTreeMap<(&str, usize), (Lane, usize, &str)> = BTreeMap::new();
        for task in self.waiting.iter() {
            // Each lane is in dispatch order: the first task seen is its oldest.
            waiting.entry((task.capsule.as_str(), lane_rank(task.lane))).and_modify(|(_, n, _)| *n += 1).or_insert((
                task.lane,
                1,
                task.task_id.as_str(),
            ));
        }
        let mut in_flight: BTreeMap<&str, usize> = BTreeMap::new();
        for task in self.in_flight.values() {
            *in_flight.entry(task.capsule.as_str()).or_default() += 1;
        }
        Load {
            waiting: waiting
                .into_iter()
                .map(|((capsule, _), (lane, n, oldest))| (capsule.to_string(), lane, n, oldest.to_string()))
                .collect(),
            in_flight: in_flight.into_iter().map(|(capsule, n)| (capsule.to_string(), n)).collect(),
            workers: self.workers.len(),
            total_slots: self.total_slots(),
            free_slots: self.free_slots(),
        }
    }

    fn total_slots(&self) -> u64 {
        self.workers.values().map(|&slots| u64::from(slots)).sum()
    }

    /// Slots neither held by a task in flight nor missing with a gone worker (rule 3).
    fn free_slots(&self) -> u64 {
        self.total_slots().saturating_sub(self.in_flight.len() as u64)
    }

    /// Updates the state with one input, without releasing anything.
    fn learn(&mut self, input: Input, out: &mut Vec<Output>) {
        let ignored = match input {
            Input::Submitted { task_id, capsule, lane, queue_capsule, seq } => {
                self.submit(Waiting { lane, seq, task_id, capsule, queue_capsule })
            }
            Input::WorkerUp { worker_id, slots } => {
                self.workers.insert(worker_id, slots);
                None
            }
            Input::WorkerGone { worker_id } => match self.workers.remove(&worker_id) {
                Some(_) => None,
                None => Some(Ignored::UnknownWorker { worker_id }),
            },
            Input::Started { task_id, worker_id } => self.take_in_flight(task_id, Some(worker_id)),
            Input::Released { task_id } => self.take_in_flight(task_id, None),
            Input::Canceled { task_id } if self.in_flight.contains_key(&task_id) => {
                Some(Ignored::AlreadyReleased { task_id })
            }
            Input::Ended { task_id } | Input::Canceled { task_id } => self.end(task_id),
        };
        out.extend(ignored.map(Output::Ignored));
    }

    /// Puts a new task in its lane; rule 4 for a known one.
    fn submit(&mut self, task: Waiting) -> Option<Ignored> {
        if self.ended.contains(&task.task_id) {
            return Some(Ignored::AlreadyEnded { task_id: task.task_id });
        }
        if self.waiting_ids.contains(&task.task_id) || self.in_flight.contains_key(&task.task_id) {
            return Some(Ignored::DuplicateSubmit { task_id: task.task_id });
        }
        let lane = task.lane;
        let key = (task.seq, task.task_id.clone());
        let max = &mut self.lane_max[lane_rank(lane)];
        if self.waiting.len_of(lane) == 0 {
            *max = None;
        }
        match max {
            Some(max) if *max > key => self.unsorted = true,
            _ => *max = Some(key),
        }
        self.waiting_ids.insert(task.task_id.clone());
        self.waiting.push(lane, task);
        None
    }

    /// Records that a task is in flight: a release by someone else takes a waiting task out
    /// of the wait; for a task already in flight a worker, if given, replaces the last one.
    fn take_in_flight(&mut self, task_id: TaskId, worker_id: Option<String>) -> Option<Ignored> {
        if let Some(task) = self.in_flight.get_mut(&task_id) {
            if worker_id.is_some() {
                task.worker_id = worker_id;
            }
            return None;
        }
        if self.ended.contains(&task_id) {
            return Some(Ignored::AlreadyEnded { task_id });
        }
        let Some(task) = self.take_waiting(&task_id) else {
            return Some(Ignored::UnknownTask { task_id });
        };
        self.hold_slot(task, worker_id);
        None
    }

    /// Removes a waiting task from its lane.
    fn take_waiting(&mut self, task_id: &TaskId) -> Option<Waiting> {
        if !self.waiting_ids.remove(task_id) {
            return None;
        }
        let task = self.waiting.remove(|task| &task.task_id == task_id);
        debug_assert!(task.is_some(), "waiting_ids and lanes disagree on {task_id}");
        task
    }

    /// Moves a task (already out of the wait) in flight.
    fn hold_slot(&mut self, task: Waiting, worker_id: Option<String>) {
        *self.capsule_load.entry(task.capsule.clone()).or_default() += 1;
        let in_flight = InFlight {
            capsule: task.capsule,
            queue_capsule: task.queue_capsule,
            lane: task.lane,
            seq: task.seq,
            worker_id,
        };
        self.in_flight.insert(task.task_id, in_flight);
    }

    /// Marks a task ended: out of the wait, or out of flight (freeing its slot and its
    /// capsule). An unknown task is remembered as ended all the same, so that a late
    /// `Submitted` for it is ignored.
    fn end(&mut self, task_id: TaskId) -> Option<Ignored> {
        if self.ended.contains(&task_id) {
            return Some(Ignored::AlreadyEnded { task_id });
        }
        if self.take_waiting(&task_id).is_some() {
            self.ended.insert(task_id);
            return None;
        }
        if let Some(task) = self.in_flight.remove(&task_id) {
            if let Some(load) = self.capsule_load.get_mut(&task.capsule) {
                *load -= 1;
                if *load == 0 {
                    self.capsule_load.remove(&task.capsule);
                }
            }
            self.ended.insert(task_id);
            return None;
        }
        self.ended.insert(task_id.clone());
        Some(Ignored::UnknownTask { task_id })
    }

    /// Restores dispatch order after out-of-order `Submitted`s: by lane, then `(seq, id)`.
    fn sort_waiting(&mut self) {
        if !self.unsorted {
            return;
        }
        let mut all: Vec<Waiting> = std::iter::from_fn(|| self.waiting.pop()).collect();
        all.sort_by(|a, b| (a.lane, a.seq, &a.task_id).cmp(&(b.lane, b.seq, &b.task_id)));
        self.lane_max = Default::default();
        for task in all {
            self.lane_max[lane_rank(task.lane)] = Some((task.seq, task.task_id.clone()));
            self.waiting.push(task.lane, task);
        }
        self.unsorted = false;
    }

    /// Releases waiting tasks in lane order while slots are free (rules 1–3).
    fn dispatch(&mut self, out: &mut Vec<Output>) {
        self.sort_waiting();
        while self.free_slots() > 0 {
            let capsule_load = &self.capsule_load;
            let Some(task) = self.waiting.remove(|task| releasable(task, capsule_load)) else {
                break;
            };
            self.waiting_ids.remove(&task.task_id);
            let task_id = task.task_id.clone();
            self.hold_slot(task, None);
            out.push(Output::Release { task_id, attempt: FIRST_ATTEMPT });
        }
    }
}
