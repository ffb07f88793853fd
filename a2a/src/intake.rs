//! Task intake for one capsule: admission, the lane-ordered wait, task states, cancel and
//! updates. `mur run` drives it; the A2A endpoint ([`crate::server`]) feeds it.
//!
//! Admission follows `lifecycle.task_acceptance` (the session-loop seed, §Capsule
//! lifecycle; the runtime reference, §5, checklist L1–L3):
//! - `none`: every message is refused with [`Rejected::NotAccepting`] (the A2A layer answers
//!   JSON-RPC -32601, as the original runtime did);
//! - `single`: one task in the session's lifetime; any message while a task waits or runs,
//!   or after the one task, gets a task in state `rejected` (a result, not an error);
//! - `queue`: up to `queue_depth` tasks may wait (not yet started); one more is `rejected`.
//!   The running task does not count.
//!
//! Waiting tasks sit in a [`Lanes`] keyed by their origin's lane and start in lane order
//! (checklist L6). A task's states go `submitted` → `working` → `completed` | `failed` |
//! `canceled`; a refused one is `rejected` from the start.
//!
//! Cancelling a running task is cooperative: [`Intake::cancel`] raises a per-task flag that
//! the runner polls with [`Intake::is_cancel_requested`] (or awaits with
//! [`Intake::cancelled`]) and then reports with `finish(id, ExitStatus::Canceled, …)`.
//! A queued task is cancelled at once and never starts.
//!
//! No IO: only tokio's in-process sync primitives. The lock is never held across an await.

use futures::stream::{self, BoxStream, StreamExt};
use mur_proto::lanes::Lanes;
use mur_proto::manifest::TaskAcceptance;
use mur_proto::task::TaskState;
use mur_proto::{ExitStatus, Id, IdKind, Lane, Origin};
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;
use tokio::sync::{Notify, broadcast, watch};

use mur_proto::task::TaskSpec;

/// How many finished (or rejected) tasks [`Intake::get`] still knows by default.
pub const DEFAULT_HISTORY_LIMIT: usize = 256;

/// Updates buffered per subscriber before it lags (a task emits a handful).
const UPDATE_BUFFER: usize = 64;

/// A message offered to the capsule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Submission {
    /// The task's text (the message's text parts joined by `\n`).
    pub text: String,
    /// The caller's `contextId`, echoed on the task; a fresh `ctx_…` when absent.
    pub context_id: Option<String>,
    /// The caller's `messageId`, kept on the task's history.
    pub message_id: Option<String>,
    /// Where the task came from; decides its lane.
    pub origin: Origin,
    /// `a2a`, `cli`, `task_md`, … (recorded on `task_start`).
    pub source: String,
}

/// A snapshot of one task.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TaskRecord {
    /// `tsk_…`.
    pub id: String,
    /// `ctx_…`, or the caller's context id.
    pub context_id: String,
    /// The caller's message id, if it gave one.
    pub message_id: Option<String>,
    /// The task's text.
    pub text: String,
    /// Where it came from.
    pub origin: Origin,
    /// `a2a`, `cli`, `task_md`, …
    pub source: String,
    /// The current state.
    pub state: TaskState,
    /// Every state the task has been in, oldest first, current last (checklist L9).
    pub states: Vec<TaskState>,
    /// Text of the status message: the refusal reason for `rejected`, the exit status (and
    /// the result's text) for `failed`, `canceled` for a cancelled task.
    pub status_message: Option<String>,
    /// How the task ended, once it ended (never set for `rejected`).
    pub exit_status: Option<ExitStatus>,
    /// The final text of a task that ended (`out/result.txt`); the artifact of a
    /// `completed` task.
    pub result: Option<String>,
    /// Whether a cancel was asked for while the task ran.
    pub cancel_requested: bool,
    /// When its state last changed (or it was made), unix ms: the order `ListTasks`
    /// lists tasks in (most recently updated first, A2A 1.0 §3.1.4); 0 when unknown.
    pub updated_at: u64,
}

impl TaskRecord {
    /// The lane the task waits (or waited) in.
    pub fn lane(&self) -> Lane {
        self.origin.lane()
    }

    /// The task as the session loop takes it.
    pub fn spec(&self) -> TaskSpec {
        TaskSpec {
            task_id: self.id.clone(),
            context_id: self.context_id.clone(),
            text: self.text.clone(),
            origin: self.origin,
            source: self.source.clone(),
        }
    }

    fn new(s: Submission, state: TaskState) -> TaskRecord {
        TaskRecord {
            id: Id::generate(IdKind::Task),
            context_id: s.context_id.unwrap_or_else(|| Id::generate(IdKind::Context)),
            message_id: s.message_id,
            text: s.text,
            origin: s.origin,
            source: s.source,
            state,
            states: vec![state],
            status_message: None,
            exit_status: None,
            result: None,
            cancel_requested: false,
            updated_at: now_ms(),
        }
    }

    fn set_state(&mut self, state: TaskState) {
        self.state = state;
        self.states.push(state);
        self.updated_at = now_ms();
    }
}

/// One change to a task, as a subscriber sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TaskUpdate {
    /// The task changed state. The update for a terminal state is the last one.
    Status {
        /// `tsk_…`.
        task_id: String,
        /// `ctx_…`.
        context_id: String,
        /// The new state.
        state: TaskState,
        /// The status message's text, if any.
        message: Option<String>,
    },
    /// The task produced output: sent once, just before `completed`, carrying the final
    /// text.
    Artifact {
        /// `tsk_…`.
        task_id: String,
        /// `ctx_…`.
        context_id: String,
        /// Unique within the task.
        artifact_id: String,
        /// Human-readable name (`result`).
        name: String,
        /// The final text.
        text: String,
    },
}

impl TaskUpdate {
    /// Whether this is the task's last update (a status in a terminal state).
    pub fn is_final(&self) -> bool {
        matches!(self, TaskUpdate::Status { state, .. } if state.is_terminal())
    }
}

/// The artifact id of a task's final text.
pub const RESULT_ARTIFACT_ID: &str = "result";

/// A message the capsule refused. Every variant but [`Rejected::NotAccepting`] carries the
/// task record in state `rejected`, which [`Intake::get`] also returns afterwards.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Rejected {
    /// `task_acceptance: none`: the capsule takes no messages (A2A: -32601).
    #[error("task acceptance is none: this capsule takes no messages")]
    NotAccepting,
    /// `task_acceptance: single` and a task waits or runs.
    #[error("task acceptance is single: a task is already waiting or running")]
    Busy {
        /// The refused task, state `rejected`.
        task: Box<TaskRecord>,
    },
    /// `task_acceptance: single` and the one task was already taken.
    #[error("task acceptance is single: this session already took its one task")]
    Spent {
        /// The refused task, state `rejected`.
        task: Box<TaskRecord>,
    },
    /// `task_acceptance: queue` with `queue_depth` tasks already waiting.
    #[error("queue full: {depth} tasks already waiting")]
    QueueFull {
        /// `lifecycle.queue_depth`.
        depth: u32,
        /// The refused task, state `rejected`.
        task: Box<TaskRecord>,
    },
    /// [`Intake::close`] was called: the session is ending.
    #[error("the session is closing: no more tasks are taken")]
    Closed {
        /// The refused task, state `rejected`.
        task: Box<TaskRecord>,
    },
}

impl Rejected {
    /// The refused task in state `rejected`; `None` for [`Rejected::NotAccepting`].
    pub fn task(&self) -> Option<&TaskRecord> {
        match self {
            Rejected::NotAccepting => None,
            Rejected::Busy { task } | Rejected::Spent { task } | Rejected::QueueFull { task, .. } => Some(task),
            Rejected::Closed { task } => Some(task),
        }
    }
}

/// Errors of the runner-side and cancel operations.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// No task has this id (never existed, or fell out of the history).
    #[error("task not found: {0}")]
    NotFound(String),
    /// The task already ended (A2A: -32002 on cancel).
    #[error("task {id} is {}: it can no longer be canceled", state.as_str())]
    NotCancelable {
        /// The task.
        id: String,
        /// Its terminal state.
        state: TaskState,
    },
    /// The task was not handed out by [`Intake::next`], or already finished.
    #[error("task {id} is not running (state {})", state.as_str())]
    NotRunning {
        /// The task.
        id: String,
        /// Its state.
        state: TaskState,
    },
    /// The tasks cannot be read now (a cluster backend whose coordinator does not answer).
    #[error("tasks unavailable: {0}")]
    Unavailable(String),
}

/// Which tasks `ListTasks` asks for (A2A 1.0 §3.1.4; every filter optional).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TaskFilter {
    /// Only tasks of this context.
    pub context_id: Option<String>,
    /// Only tasks in this state.
    pub state: Option<TaskState>,
    /// Only tasks updated at or after this time, unix ms.
    pub updated_since: Option<u64>,
}

impl TaskFilter {
    /// Whether `record` passes every filter given.
    pub fn matches(&self, record: &TaskRecord) -> bool {
        self.context_id.as_ref().is_none_or(|c| *c == record.context_id)
            && self.state.is_none_or(|s| s == record.state)
            && self.updated_since.is_none_or(|t| record.updated_at >= t)
    }
}

/// Now, unix ms (0 before the epoch).
fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// What [`Intake::next_or_idle`] found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Next {
    /// The next task, now handed to the runner.
    Task(Box<TaskRecord>),
    /// No task arrived within the idle time.
    Idle,
    /// The intake is closed and nothing waits.
    Closed,
}

/// A task's snapshot at subscription time and the updates after it.
pub struct Subscription {
    /// The task as it was when the subscription began.
    pub snapshot: TaskRecord,
    /// The updates after [`Subscription::snapshot`], ending after the final status (at
    /// once when the snapshot is already terminal).
    pub updates: BoxStream<'static, TaskUpdate>,
}

/// The updates a broadcast receiver yields, up to and including the final status. A
/// subscriber that falls more than [`UPDATE_BUFFER`] updates behind skips the ones it
/// missed.
fn updates_stream(rx: Option<broadcast::Receiver<TaskUpdate>>) -> BoxStream<'static, TaskUpdate> {
    stream::unfold(rx, |rx| async move {
        let mut rx = rx?;
        loop {
            match rx.recv().await {
                Ok(update) => {
                    let next = if update.is_final() { None } else { Some(rx) };
                    return Some((update, next));
                }
                Err(broadcast::error::RecvError::Lagged(_)) => continue,
                Err(broadcast::error::RecvError::Closed) => return None,
            }
        }
    })
    .boxed()
}

struct Entry {
    record: TaskRecord,
    /// Dropped once the task is terminal, which ends every subscriber's stream.
    updates: Option<broadcast::Sender<TaskUpdate>>,
    cancel: watch::Sender<bool>,
}

impl Entry {
    fn new(record: TaskRecord) -> Entry {
        let updates = (!record.state.is_terminal()).then(|| broadcast::channel(UPDATE_BUFFER).0);
        Entry { record, updates, cancel: watch::channel(false).0 }
    }

    fn emit(&self, update: TaskUpdate) {
        if let Some(tx) = &self.updates {
            // No receiver is fine: nobody is watching this task.
            let _ = tx.send(update);
        }
    }

    fn emit_status(&self) {
        self.emit(TaskUpdate::Status {
            task_id: self.record.id.clone(),
            context_id: self.record.context_id.clone(),
            state: self.record.state,
            message: self.record.status_message.clone(),
        });
    }
}

#[derive(Default)]
struct State {
    waiting: Lanes<String>,
    entries: HashMap<String, Entry>,
    /// Handed out by `next` and not yet finished.
    running: HashSet<String>,
    /// Ended or rejected tasks, oldest first, for the bounded history.
    finished: VecDeque<String>,
    /// Submissions admitted through `submit` (what `single` counts).
    admitted: u64,
    closed: bool,
    /// Tasks [`Intake::cancel_waiting`] ended that no one has been told of yet (no
    /// subscriber then, no read since).
    untold: HashSet<String>,
}

/// The task intake of one capsule. Share it behind an `Arc`.
pub struct Intake {
    acceptance: TaskAcceptance,
    queue_depth: u32,
    history_limit: usize,
    state: Mutex<State>,
    /// Woken on every submission, finish and close.
    wake: Notify,
}

impl Intake {
    /// An intake applying `acceptance`; `queue_depth` is how many tasks may wait under
    /// `queue` (a depth of 0 admits none).
    pub fn new(acceptance: TaskAcceptance, queue_depth: u32) -> Intake {
        Intake {
            acceptance,
            queue_depth,
            history_limit: DEFAULT_HISTORY_LIMIT,
            state: Mutex::new(State::default()),
            wake: Notify::new(),
        }
    }

    /// Keeps at most `limit` finished or rejected tasks for [`Intake::get`] (default
    /// [`DEFAULT_HISTORY_LIMIT`]).
    pub fn with_history_limit(mut self, limit: usize) -> Intake {
        self.history_limit = limit;
        self
    }

    /// The acceptance rule in force.
    pub fn acceptance(&self) -> TaskAcceptance {
        self.acceptance
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves consistent data (every critical section is
        // a few field updates), so a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Offers a message to the capsule under the admission rules (module docs). Admitted:
    /// the task, state `submitted`, now waiting in its lane. Refused: [`Rejected`], with the
    /// task in state `rejected` except under `none`.
    pub fn submit(&self, submission: Submission) -> Result<TaskRecord, Rejected> {
        if self.acceptance == TaskAcceptance::None {
            return Err(Rejected::NotAccepting);
        }
        let mut st = self.lock();
        let refuse = |st: &mut State, make: &dyn Fn(Box<TaskRecord>) -> Rejected| {
            let mut record = TaskRecord::new(submission.clone(), TaskState::Rejected);
            record.status_message = Some(make(Box::new(record.clone())).to_string());
            let rejected = make(Box::new(record.clone()));
            self.remember_finished(st, Entry::new(record));
            Err(rejected)
        };
        if st.closed {
            return refuse(&mut st, &|task| Rejected::Closed { task });
        }
        match self.acceptance {
            TaskAcceptance::None => unreachable!("handled above"),
            TaskAcceptance::Single => {
                if !st.waiting.is_empty() || !st.running.is_empty() {
                    return refuse(&mut st, &|task| Rejected::Busy { task });
                }
                if st.admitted > 0 {
                    return refuse(&mut st, &|task| Rejected::Spent { task });
                }
            }
            TaskAcceptance::Queue => {
                if st.waiting.len() >= self.queue_depth as usize {
                    let depth = self.queue_depth;
                    return refuse(&mut st, &|task| Rejected::QueueFull { depth, task });
                }
            }
        }
        st.admitted += 1;
        let record = self.enqueue_locked(&mut st, submission);
        drop(st);
        self.wake.notify_waiters();
        Ok(record)
    }

    /// Queues a task the runtime generates itself (a `task.md` at launch, a resume's loss
    /// report), bypassing admission: `task_acceptance` does not gate these
    /// (the session-loop seed, §What a resume reports). It waits in its lane like any other
    /// and does not count as `single`'s one task.
    pub fn enqueue(&self, submission: Submission) -> TaskRecord {
        let record = self.enqueue_locked(&mut self.lock(), submission);
        self.wake.notify_waiters();
        record
    }

    fn enqueue_locked(&self, st: &mut State, submission: Submission) -> TaskRecord {
        let record = TaskRecord::new(submission, TaskState::Submitted);
        st.waiting.push(record.lane(), record.id.clone());
        st.entries.insert(record.id.clone(), Entry::new(record.clone()));
        record
    }

    /// Moves an ended entry to the bounded history, dropping the oldest beyond the limit.
    /// Ends `entry`: emits its final status, keeps it among the finished tasks, wakes the
    /// runner; returns its record.
    fn end_entry(&self, mut st: MutexGuard<'_, State>, entry: Entry) -> TaskRecord {
        entry.emit_status();
        let record = entry.record.clone();
        self.remember_finished(&mut st, entry);
        drop(st);
        self.wake.notify_waiters();
        record
    }

    fn remember_finished(&self, st: &mut State, mut entry: Entry) {
        entry.updates = None;
        let id = entry.record.id.clone();
        st.entries.insert(id.clone(), entry);
        st.finished.push_back(id);
        while st.finished.len() > self.history_limit {
            if let Some(old) = st.finished.pop_front() {
                st.entries.remove(&old);
            }
        }
    }

    /// Waits for the next task in lane order and hands it to the runner (it then counts as
    /// running for admission and cancel, though its state stays `submitted` until
    /// [`Intake::mark_working`]). `None` once [`Intake::close`] was called and nothing waits.
    /// Cancel-safe: dropping the future takes nothing.
    pub async fn next(&self) -> Option<TaskRecord> {
        loop {
            let notified = self.wake.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut st = self.lock();
                while let Some(id) = st.waiting.pop() {
                    // Every waiting id has an entry; skip one that somehow lost it.
                    if let Some(record) = st.entries.get(&id).map(|e| e.record.clone()) {
                        st.running.insert(id);
                        return Some(record);
                    }
                }
                if st.closed {
                    return None;
                }
            }
            notified.await;
        }
    }

    /// [`Intake::next`], giving up after `idle` without a task (for `--idle-exit` and the
    /// idle fallback of checklist L4).
    pub async fn next_or_idle(&self, idle: Duration) -> Next {
        match tokio::time::timeout(idle, self.next()).await {
            Ok(Some(task)) => Next::Task(Box::new(task)),
            Ok(None) => Next::Closed,
            Err(_) => Next::Idle,
        }
    }

    /// `submitted` → `working` for a task [`Intake::next`] handed out.
    pub fn mark_working(&self, id: &str) -> Result<TaskRecord, Error> {
        let mut st = self.lock();
        let running = st.running.contains(id);
        let entry = st.entries.get_mut(id).ok_or_else(|| Error::NotFound(id.to_string()))?;
        if !running || entry.record.state != TaskState::Submitted {
            return Err(Error::NotRunning { id: id.to_string(), state: entry.record.state });
        }
        entry.record.set_state(TaskState::Working);
        entry.emit_status();
        Ok(entry.record.clone())
    }

    /// Ends a running task: `ok` → `completed` (its text becomes the `result` artifact),
    /// `canceled` → `canceled`, any other exit status → `failed` with the exit status in
    /// the status message (the runtime reference, §5, §7 item 1).
    pub fn finish(&self, id: &str, exit_status: ExitStatus, result_text: &str) -> Result<TaskRecord, Error> {
        let mut st = self.lock();
        let state = st.entries.get(id).map(|e| e.record.state).ok_or_else(|| Error::NotFound(id.to_string()))?;
        if !st.running.remove(id) {
            return Err(Error::NotRunning { id: id.to_string(), state });
        }
        let Some(mut entry) = st.entries.remove(id) else {
            return Err(Error::NotFound(id.to_string()));
        };
        let record = &mut entry.record;
        record.exit_status = Some(exit_status);
        record.result = Some(result_text.to_string());
        record.status_message = match exit_status {
            ExitStatus::Ok => None,
            ExitStatus::Canceled => Some(ExitStatus::Canceled.as_str().to_string()),
            other if result_text.is_empty() => Some(other.as_str().to_string()),
            other => Some(format!("{other}: {result_text}")),
        };
        record.set_state(exit_status.task_state());
        if exit_status == ExitStatus::Ok {
            entry.emit(TaskUpdate::Artifact {
                task_id: entry.record.id.clone(),
                context_id: entry.record.context_id.clone(),
                artifact_id: RESULT_ARTIFACT_ID.to_string(),
                name: RESULT_ARTIFACT_ID.to_string(),
                text: result_text.to_string(),
            });
        }
        Ok(self.end_entry(st, entry))
    }

    /// Cancels a task. A waiting task leaves the queue and ends `canceled` at once, never
    /// having started. A running task gets its cancel flag raised and is returned as it is
    /// (`working`); the runner ends it. Errors: [`Error::NotFound`], or
    /// [`Error::NotCancelable`] for a task that already ended.
    pub fn cancel(&self, id: &str) -> Result<TaskRecord, Error> {
        let mut st = self.lock();
        let entry = st.entries.get_mut(id).ok_or_else(|| Error::NotFound(id.to_string()))?;
        if entry.record.state.is_terminal() {
            return Err(Error::NotCancelable { id: id.to_string(), state: entry.record.state });
        }
        if st.running.contains(id) {
            let entry = st.entries.get_mut(id).expect("checked above");
            entry.record.cancel_requested = true;
            entry.cancel.send_replace(true);
            return Ok(entry.record.clone());
        }
        st.waiting.remove(|waiting| waiting == id);
        let mut entry = st.entries.remove(id).expect("checked above");
        entry.record.exit_status = Some(ExitStatus::Canceled);
        entry.record.status_message = Some(ExitStatus::Canceled.as_str().to_string());
        entry.record.set_state(TaskState::Canceled);
        Ok(self.end_entry(st, entry))
    }

    /// Closes the intake and ends every task still waiting `canceled`, never having
    /// started, with `message` as its status message (what a subscriber or a `GetTask`
    /// sees); returns them in lane order. The host calls it when it stops for good (a
    /// signal, a fatal end), so no waiting task stays `submitted` with nobody left to run
    /// it. A task already handed to the runner is not touched. Those no subscriber follows
    /// count as untold until read ([`Intake::wait_untold`]).
    pub fn cancel_waiting(&self, message: &str) -> Vec<TaskRecord> {
        self.close();
        let mut ended = Vec::new();
        loop {
            let mut st = self.lock();
            let Some(id) = st.waiting.pop() else { break };
            let Some(mut entry) = st.entries.remove(&id) else { continue };
            if entry.updates.as_ref().is_none_or(|tx| tx.receiver_count() == 0) {
                st.untold.insert(id.clone());
            }
            entry.record.exit_status = Some(ExitStatus::Canceled);
            entry.record.status_message = Some(message.to_string());
            entry.record.set_state(TaskState::Canceled);
            ended.push(self.end_entry(st, entry));
        }
        ended
    }

    /// Whether a cancel was asked for task `id` (false for an unknown id).
    pub fn is_cancel_requested(&self, id: &str) -> bool {
        self.lock().entries.get(id).is_some_and(|e| *e.cancel.borrow())
    }

    /// Resolves once a cancel is asked for task `id`; never resolves for a task that is not
    /// cancelled (race it against the work). Resolves at once for an unknown id.
    pub async fn cancelled(&self, id: &str) {
        let rx = self.lock().entries.get(id).map(|e| e.cancel.subscribe());
        if let Some(mut rx) = rx {
            // An error means the task fell out of the history: nothing left to wait for.
            let _ = rx.wait_for(|requested| *requested).await;
        }
    }

    /// The task's current snapshot; `None` for an unknown id or one beyond the history.
    pub fn get(&self, id: &str) -> Option<TaskRecord> {
        let st = self.lock();
        let record = st.entries.get(id).map(|e| e.record.clone());
        self.told(st, record.as_ref());
        record
    }

    /// Someone read `record` (a `GetTask`, a subscription's snapshot): if it is the end of
    /// a task [`Intake::cancel_waiting`] ended, that end is told; [`Intake::wait_untold`]
    /// is woken.
    fn told(&self, mut st: MutexGuard<'_, State>, record: Option<&TaskRecord>) {
        if let Some(r) = record.filter(|r| r.state.is_terminal())
            && st.untold.remove(&r.id)
        {
            drop(st);
            self.wake.notify_waiters();
        }
    }

    /// The task's snapshot and its later updates, taken atomically (no update is lost
    /// between them). `None` for an unknown id.
    pub fn subscribe(&self, id: &str) -> Option<Subscription> {
        let st = self.lock();
        let entry = st.entries.get(id)?;
        let updates = updates_stream(entry.updates.as_ref().map(|tx| tx.subscribe()));
        let subscription = Subscription { snapshot: entry.record.clone(), updates };
        self.told(st, Some(&subscription.snapshot));
        Some(subscription)
    }

    /// Waits until everyone sending a task [`Intake::cancel_waiting`] ended has been told
    /// (a subscriber was there, or the task was read since), at most `timeout`; returns
    /// whether all were. The host keeps its endpoint up meanwhile, so a sender between its
    /// send and its first read learns the end instead of finding the endpoint gone.
    pub async fn wait_untold(&self, timeout: Duration) -> bool {
        let told = async {
            loop {
                let notified = self.wake.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                if self.lock().untold.is_empty() {
                    return;
                }
                notified.await;
            }
        };
        tokio::time::timeout(timeout, told).await.is_ok()
    }

    /// The tasks it knows (waiting, running, and the bounded history of ended ones) that
    /// `filter` matches, most recently updated first (ties by id).
    pub fn list(&self, filter: &TaskFilter) -> Vec<TaskRecord> {
        let st = self.lock();
        let mut records: Vec<TaskRecord> =
            st.entries.values().map(|e| &e.record).filter(|r| filter.matches(r)).cloned().collect();
        records.sort_by(|a, b| (b.updated_at, &b.id).cmp(&(a.updated_at, &a.id)));
        records
    }

    /// How many tasks wait (not yet started).
    pub fn waiting(&self) -> usize {
        self.lock().waiting.len()
    }

    /// The waiting tasks' ids in dispatch order.
    pub fn waiting_ids(&self) -> Vec<String> {
        self.lock().waiting.iter().cloned().collect()
    }

    /// Whether no task waits or runs.
    pub fn is_idle(&self) -> bool {
        let st = self.lock();
        st.waiting.is_empty() && st.running.is_empty()
    }

    /// Waits until no task waits or runs, at most `timeout`; returns whether it got idle.
    pub async fn wait_idle(&self, timeout: Duration) -> bool {
        let idle = async {
            loop {
                let notified = self.wake.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                if self.is_idle() {
                    return;
                }
                notified.await;
            }
        };
        tokio::time::timeout(timeout, idle).await.is_ok()
    }

    /// Stops taking tasks: later submissions are `rejected`, and [`Intake::next`] returns
    /// `None` once the waiting tasks are drained.
    pub fn close(&self) {
        self.lock().closed = true;
        self.wake.notify_waiters();
    }

    /// Whether [`Intake::close`] was called.
    pub fn is_closed(&self) -> bool {
        self.lock().closed
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn msg(text: &str, origin: Origin) -> Submission {
        Submission { text: text.to_string(), context_id: None, message_id: None, origin, source: "a2a".to_string() }
    }

    fn state_of(r: &Result<TaskRecord, Rejected>) -> TaskState {
        match r {
            Ok(t) => t.state,
            Err(e) => e.task().map_or(TaskState::Rejected, |t| t.state),
        }
    }

    #[test]
    fn acceptance_none_refuses_every_message_without_a_task() {
        let intake = Intake::new(TaskAcceptance::None, 5);
        let err = intake.submit(msg("hi", Origin::Peer)).unwrap_err();
        assert_eq!(err, Rejected::NotAccepting);
        assert!(err.task().is_none());
        assert_eq!(intake.waiting(), 0);
    }

    #[tokio::test]
    async fn acceptance_single_takes_one_task_and_rejects_while_busy_and_after() {
        let intake = Intake::new(TaskAcceptance::Single, 5);
        let first = intake.submit(msg("one", Origin::Event)).unwrap();
        assert_eq!(first.state, TaskState::Submitted);

        let waiting = intake.submit(msg("two", Origin::Event)).unwrap_err();
        assert!(matches!(waiting, Rejected::Busy { .. }), "{waiting:?}");
        let rejected = waiting.task().unwrap();
        assert_eq!(rejected.state, TaskState::Rejected);
        assert_eq!(intake.get(&rejected.id).unwrap().state, TaskState::Rejected, "rejected tasks stay gettable");

        let got = intake.next().await.unwrap();
        assert_eq!(got.id, first.id);
        intake.mark_working(&got.id).unwrap();
        assert!(matches!(intake.submit(msg("three", Origin::Peer)), Err(Rejected::Busy { .. })));

        intake.finish(&got.id, ExitStatus::Ok, "done").unwrap();
        let after = intake.submit(msg("four", Origin::Peer)).unwrap_err();
        assert!(matches!(after, Rejected::Spent { .. }), "{after:?}");
        assert_eq!(after.task().unwrap().status_message.as_deref(), Some(after.to_string().as_str()));
    }

    #[tokio::test]
    async fn acceptance_queue_admits_queue_depth_waiting_tasks_and_rejects_more() {
        let intake = Intake::new(TaskAcceptance::Queue, 2);
        let a = intake.submit(msg("a", Origin::Event));
        let b = intake.submit(msg("b", Origin::Event));
        let c = intake.submit(msg("c", Origin::Event));
        assert_eq!(
            [state_of(&a), state_of(&b), state_of(&c)],
            [TaskState::Submitted, TaskState::Submitted, TaskState::Rejected]
        );
        let Err(Rejected::QueueFull { depth, task }) = c else { panic!("expected queue full") };
        assert_eq!(depth, 2);
        assert_eq!(task.status_message.as_deref(), Some("queue full: 2 tasks already waiting"));

        // The running task does not count: taking one frees a slot.
        let running = intake.next().await.unwrap();
        assert_eq!(running.id, a.unwrap().id);
        assert_eq!(state_of(&intake.submit(msg("d", Origin::Event))), TaskState::Submitted);
        assert_eq!(state_of(&intake.submit(msg("e", Origin::Event))), TaskState::Rejected);
        assert_eq!(intake.waiting(), 2);
    }

    #[test]
    fn queue_depth_zero_admits_nothing() {
        let intake = Intake::new(TaskAcceptance::Queue, 0);
        assert!(matches!(intake.submit(msg("a", Origin::User)), Err(Rejected::QueueFull { depth: 0, .. })));
    }

    #[tokio::test]
    async fn tasks_start_in_lane_order_fifo_within_a_lane() {
        let intake = Intake::new(TaskAcceptance::Queue, 10);
        let ids: Vec<(String, &str)> = [
            ("bg1", Origin::Event),
            ("peer1", Origin::Peer),
            ("bg2", Origin::Completion),
            ("user1", Origin::User),
            ("peer2", Origin::Peer),
            ("bg3", Origin::Schedule),
        ]
        .into_iter()
        .map(|(text, origin)| (intake.submit(msg(text, origin)).unwrap().id, text))
        .collect();
        assert_eq!(intake.waiting_ids().len(), 6);
        let mut order = Vec::new();
        while intake.waiting() > 0 {
            let task = intake.next().await.unwrap();
            assert!(ids.iter().any(|(id, _)| *id == task.id));
            order.push(task.text.clone());
            intake.finish(&task.id, ExitStatus::Ok, "").unwrap();
        }
        assert_eq!(order, ["user1", "peer1", "peer2", "bg1", "bg2", "bg3"]);
    }

    #[test]
    fn ids_are_prefixed_and_a_caller_context_id_is_echoed() {
        let intake = Intake::new(TaskAcceptance::Queue, 10);
        let fresh = intake.submit(msg("a", Origin::Event)).unwrap();
        assert!(Id::is_valid(IdKind::Task, &fresh.id), "{}", fresh.id);
        assert!(Id::is_valid(IdKind::Context, &fresh.context_id), "{}", fresh.context_id);
        let mut given = msg("b", Origin::Peer);
        given.context_id = Some("ctx-from-caller".to_string());
        given.message_id = Some("m-1".to_string());
        let echoed = intake.submit(given).unwrap();
        assert_eq!(echoed.context_id, "ctx-from-caller");
        assert_eq!(echoed.message_id.as_deref(), Some("m-1"));
        assert_eq!(echoed.lane(), Lane::Peer);
        let spec = echoed.spec();
        assert_eq!((spec.task_id, spec.context_id, spec.origin), (echoed.id.clone(), echoed.context_id, Origin::Peer));
    }

    #[tokio::test]
    async fn finish_maps_exit_statuses_to_task_states() {
        let intake = Intake::new(TaskAcceptance::Queue, 10);
        let cases = [
            (ExitStatus::Ok, "the answer", TaskState::Completed, None),
            (
                ExitStatus::MaxTurnsReached,
                "error: max turns",
                TaskState::Failed,
                Some("max_turns_reached: error: max turns"),
            ),
            (ExitStatus::Failed, "", TaskState::Failed, Some("failed")),
            (ExitStatus::Canceled, "", TaskState::Canceled, Some("canceled")),
        ];
        for (exit, text, state, message) in cases {
            let id = intake.submit(msg("x", Origin::Event)).unwrap().id;
            assert_eq!(intake.next().await.unwrap().id, id);
            intake.mark_working(&id).unwrap();
            let done = intake.finish(&id, exit, text).unwrap();
            assert_eq!(done.state, state, "{exit}");
            assert_eq!(done.status_message.as_deref(), message, "{exit}");
            assert_eq!(done.exit_status, Some(exit));
            assert_eq!(done.states, [TaskState::Submitted, TaskState::Working, state]);
            assert_eq!(intake.get(&id).unwrap(), done);
            assert!(matches!(intake.finish(&id, ExitStatus::Ok, ""), Err(Error::NotRunning { .. })));
        }
    }

    #[tokio::test]
    async fn a_canceled_queued_task_never_starts() {
        let intake = Intake::new(TaskAcceptance::Queue, 10);
        let a = intake.submit(msg("a", Origin::Event)).unwrap();
        let b = intake.submit(msg("b", Origin::Event)).unwrap();
        let canceled = intake.cancel(&a.id).unwrap();
        assert_eq!(canceled.state, TaskState::Canceled);
        assert_eq!(canceled.states, [TaskState::Submitted, TaskState::Canceled]);
        assert_eq!(intake.next().await.unwrap().id, b.id);
        assert!(matches!(intake.cancel(&a.id), Err(Error::NotCancelable { state: TaskState::Canceled, .. })));
        assert_eq!(intake.cancel("tsk_nope"), Err(Error::NotFound("tsk_nope".to_string())));
    }

    #[tokio::test]
    async fn canceling_a_running_task_raises_its_flag_for_the_runner() {
        let intake = Arc::new(Intake::new(TaskAcceptance::Queue, 10));
        let id = intake.submit(msg("a", Origin::Event)).unwrap().id;
        intake.next().await.unwrap();
        intake.mark_working(&id).unwrap();
        assert!(!intake.is_cancel_requested(&id));
        let waiter = {
            let intake = intake.clone();
            let id = id.clone();
            tokio::spawn(async move { intake.cancelled(&id).await })
        };
        let still = intake.cancel(&id).unwrap();
        assert_eq!(still.state, TaskState::Working);
        assert!(still.cancel_requested);
        assert!(intake.is_cancel_requested(&id));
        tokio::time::timeout(Duration::from_secs(5), waiter).await.unwrap().unwrap();
        let done = intake.finish(&id, ExitStatus::Canceled, "").unwrap();
        assert_eq!(done.state, TaskState::Canceled);
    }

    #[tokio::test]
    async fn a_stopping_host_cancels_the_waiting_tasks_and_leaves_the_running_one() {
        let intake = Intake::new(TaskAcceptance::Queue, 10);
        let running = intake.submit(msg("run", Origin::Peer)).unwrap().id;
        intake.next().await.unwrap();
        intake.mark_working(&running).unwrap();
        let bg = intake.submit(msg("bg", Origin::Event)).unwrap().id;
        let peer = intake.submit(msg("peer", Origin::Peer)).unwrap().id;
        let sub = intake.subscribe(&bg).unwrap();
        let ended = intake.cancel_waiting("canceled: stopped before it started (shutdown)");
        let ids: Vec<&str> = ended.iter().map(|r| r.id.as_str()).collect();
        assert_eq!(ids, [peer.as_str(), bg.as_str()], "lane order");
        // `bg`'s subscriber was told by its stream; `peer`'s sender only once it reads.
        assert!(!intake.wait_untold(Duration::ZERO).await, "peer's end is untold");
        assert_eq!(intake.get(&peer).unwrap().state, TaskState::Canceled);
        assert!(intake.wait_untold(Duration::ZERO).await, "read: told");
        for id in [&bg, &peer] {
            let r = intake.get(id).unwrap();
            assert_eq!((r.state, r.exit_status), (TaskState::Canceled, Some(ExitStatus::Canceled)));
            assert_eq!(r.status_message.as_deref(), Some("canceled: stopped before it started (shutdown)"));
        }
        let updates: Vec<TaskUpdate> = sub.updates.collect().await;
        assert!(
            matches!(updates.last(), Some(TaskUpdate::Status { state: TaskState::Canceled, .. })),
            "the subscriber sees the end: {updates:?}"
        );
        assert_eq!(intake.get(&running).unwrap().state, TaskState::Working);
        assert_eq!(intake.waiting(), 0);
        assert!(intake.is_closed());
        assert!(intake.submit(msg("late", Origin::Peer)).is_err(), "closed");
    }

    #[tokio::test]
    async fn a_subscriber_sees_working_the_artifact_and_the_final_status() {
        let intake = Intake::new(TaskAcceptance::Queue, 10);
        let id = intake.submit(msg("a", Origin::Peer)).unwrap().id;
        let sub = intake.subscribe(&id).unwrap();
        assert_eq!(sub.snapshot.state, TaskState::Submitted);
        intake.next().await.unwrap();
        intake.mark_working(&id).unwrap();
        intake.finish(&id, ExitStatus::Ok, "hello").unwrap();
        let updates: Vec<TaskUpdate> = sub.updates.collect().await;
        let ctx = intake.get(&id).unwrap().context_id;
        assert_eq!(
            updates,
            [
                TaskUpdate::Status {
                    task_id: id.clone(),
                    context_id: ctx.clone(),
                    state: TaskState::Working,
                    message: None
                },
                TaskUpdate::Artifact {
                    task_id: id.clone(),
                    context_id: ctx.clone(),
                    artifact_id: "result".to_string(),
                    name: "result".to_string(),
                    text: "hello".to_string()
                },
                TaskUpdate::Status { task_id: id.clone(), context_id: ctx, state: TaskState::Completed, message: None },
            ]
        );
        // Subscribing to a finished task gives its snapshot and no updates.
        let late = intake.subscribe(&id).unwrap();
        assert_eq!(late.snapshot.state, TaskState::Completed);
        assert!(late.updates.collect::<Vec<_>>().await.is_empty());
        assert!(intake.subscribe("tsk_unknown").is_none());
    }

    #[tokio::test]
    async fn close_rejects_new_messages_and_next_drains_then_ends() {
        let intake = Intake::new(TaskAcceptance::Queue, 10);
        let a = intake.submit(msg("a", Origin::Event)).unwrap();
        intake.close();
        assert!(intake.is_closed());
        assert!(matches!(intake.submit(msg("b", Origin::Event)), Err(Rejected::Closed { .. })));
        assert_eq!(intake.next().await.unwrap().id, a.id);
        assert_eq!(intake.next().await, None);
        assert_eq!(intake.next_or_idle(Duration::from_secs(5)).await, Next::Closed);
    }

    #[tokio::test]
    async fn next_waits_for_a_submission_and_next_or_idle_gives_up() {
        let intake = Arc::new(Intake::new(TaskAcceptance::Queue, 10));
        assert_eq!(intake.next_or_idle(Duration::from_millis(20)).await, Next::Idle);
        let taker = {
            let intake = intake.clone();
            tokio::spawn(async move { intake.next().await })
        };
        let id = intake.submit(msg("late", Origin::User)).unwrap().id;
        let got = tokio::time::timeout(Duration::from_secs(5), taker).await.unwrap().unwrap().unwrap();
        assert_eq!(got.id, id);
        assert!(!intake.is_idle());
        intake.finish(&id, ExitStatus::Ok, "").unwrap();
        assert!(intake.wait_idle(Duration::from_secs(5)).await);
    }

    #[tokio::test]
    async fn enqueue_bypasses_admission_and_busies_a_single_capsule() {
        let intake = Intake::new(TaskAcceptance::None, 1);
        let local = intake.enqueue(Submission { source: "task_md".to_string(), ..msg("from task.md", Origin::User) });
        assert_eq!(local.state, TaskState::Submitted);
        assert_eq!(intake.next().await.unwrap().id, local.id);

        let single = Intake::new(TaskAcceptance::Single, 1);
        let local = single.enqueue(msg("report", Origin::Completion));
        assert!(matches!(single.submit(msg("x", Origin::Peer)), Err(Rejected::Busy { .. })));
        single.next().await.unwrap();
        single.finish(&local.id, ExitStatus::Ok, "").unwrap();
        assert_eq!(single.submit(msg("the one", Origin::Peer)).unwrap().state, TaskState::Submitted);
    }

    #[tokio::test]
    async fn the_history_of_finished_tasks_is_bounded() {
        let intake = Intake::new(TaskAcceptance::Queue, 10).with_history_limit(2);
        let mut ids = Vec::new();
        for _ in 0..3 {
            let id = intake.submit(msg("x", Origin::Event)).unwrap().id;
            intake.next().await.unwrap();
            intake.finish(&id, ExitStatus::Ok, "").unwrap();
            ids.push(id);
        }
        assert!(intake.get(&ids[0]).is_none());
        assert!(intake.get(&ids[1]).is_some());
        assert!(intake.get(&ids[2]).is_some());
    }

    #[tokio::test]
    async fn mark_working_refuses_a_task_not_handed_out() {
        let intake = Intake::new(TaskAcceptance::Queue, 10);
        let id = intake.submit(msg("x", Origin::Event)).unwrap().id;
        assert!(matches!(intake.mark_working(&id), Err(Error::NotRunning { state: TaskState::Submitted, .. })));
        assert_eq!(intake.mark_working("tsk_x"), Err(Error::NotFound("tsk_x".to_string())));
    }
}
