//! The live view of `mur fleet run` (issue #11 §Live follow): what the client shows while
//! it follows a run — a status line per member (or procedure step), the run's fan-out
//! permits in use, its spend so far — folded from what the cluster reports. Pure: the
//! command feeds it task records, permit counts and spend, and prints what it returns.
//!
//! A member's state is that of its latest step in the run: `waiting` (delegated, not
//! started: in line for a permit or a worker), `running`, `done`, `failed` (any other end),
//! or `blocked` (its job awaits approval). Members with no step yet are `waiting`. A running
//! member shows how long its step has run, from the step's `started_at` (issue #29: a step
//! of 44 s printed nothing meanwhile).
//!
//! Off a terminal, [`Lines`] decides which status lines are printed: one when what it says
//! changed (never the same line twice in a row), and one at least every
//! [`Lines::EVERY`] (15 s, or as set) of silence, with the running members' times.

use mur_proto::TaskId;
use mur_proto::cluster::TaskRecord;
use mur_proto::task::TaskState;
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet};

/// One member's (or step's) state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum MemberState {
    /// Delegated or about to be, not started.
    Waiting,
    /// A worker runs its step.
    Running,
    /// Its step completed.
    Done,
    /// Its step ended otherwise (failed, canceled, out of time).
    Failed,
    /// Its job awaits approval.
    Blocked,
}

impl MemberState {
    /// The word shown.
    pub const fn as_str(self) -> &'static str {
        match self {
            MemberState::Waiting => "waiting",
            MemberState::Running => "running",
            MemberState::Done => "done",
            MemberState::Failed => "failed",
            MemberState::Blocked => "blocked",
        }
    }
}

/// One status line.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct MemberLine {
    /// The member (or the procedure step's id).
    pub member: String,
    /// Its state.
    pub state: MemberState,
    /// Steps of it finished in this run so far.
    pub steps_done: u32,
    /// When its running step started (unix ms, the worker's clock), while it runs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub started_at: Option<u64>,
}

impl MemberLine {
    /// `builder running 1m05s` (with `now_ms`, while it runs), else `builder running`.
    fn words(&self, now_ms: Option<u64>) -> String {
        match (self.started_at, now_ms) {
            (Some(start), Some(now)) => {
                format!("{} {} {}", self.member, self.state.as_str(), elapsed(now.saturating_sub(start)))
            }
            _ => format!("{} {}", self.member, self.state.as_str()),
        }
    }
}

/// A time in the bounds line's units, at most two of them: `7s`, `1m05s`, `2h03m`, `1d04h`.
pub fn elapsed(ms: u64) -> String {
    let s = ms / 1000;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        3600..86_400 => format!("{}h{:02}m", s / 3600, s % 3600 / 60),
        _ => format!("{}d{:02}h", s / 86_400, s % 86_400 / 3600),
    }
}

/// What the view shows now; `--json` prints it as `{"type": "status", …}`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Status {
    /// The run.
    pub run_id: String,
    /// One line per member, in the fleet's order, then steps of other names.
    pub members: Vec<MemberLine>,
    /// The run's fan-out permits in use.
    pub permits_in_use: usize,
    /// Spend so far, USD, when the run reports it.
    pub spend_usd: Option<f64>,
}

/// A step name's latest task.
#[derive(Debug)]
struct Step {
    submitted_at: u64,
    task_id: TaskId,
    state: TaskState,
    started_at: Option<u64>,
}

/// The fold.
#[derive(Debug)]
pub struct Follow {
    run_id: String,
    order: Vec<String>,
    /// Per step name: its latest task.
    latest: BTreeMap<String, Step>,
    /// Per step name: its tasks that completed.
    done: BTreeMap<String, BTreeSet<TaskId>>,
    blocked: bool,
    permits: usize,
    spend: Option<f64>,
}

impl Follow {
    /// A view of run `run_id` of a fleet whose members (and router) are `members`.
    pub fn new(run_id: &str, members: Vec<String>) -> Follow {
        Follow {
            run_id: run_id.to_string(),
            order: members,
            latest: BTreeMap::new(),
            done: BTreeMap::new(),
            blocked: false,
            permits: 0,
            spend: None,
        }
    }

    /// Takes a task record; records of other runs are ignored. Returns whether the view
    /// changed.
    pub fn task(&mut self, r: &TaskRecord) -> bool {
        let Some(step) = r.fleet_step.as_ref().filter(|s| s.run_id.starts_with(&self.run_id)) else { return false };
        let before = self.status();
        let now =
            Step { submitted_at: r.submitted_at, task_id: r.task_id.clone(), state: r.state, started_at: r.started_at };
        match self.latest.get_mut(&step.step) {
            Some(latest) if r.submitted_at <= latest.submitted_at && latest.task_id != r.task_id => {}
            Some(latest) => *latest = now,
            None => {
                self.latest.insert(step.step.clone(), now);
            }
        }
        if r.state == TaskState::Completed {
            self.done.entry(step.step.clone()).or_default().insert(r.task_id.clone());
        }
        self.status() != before
    }

    /// Sets whether the run's job awaits approval.
    pub fn set_blocked(&mut self, blocked: bool) -> bool {
        std::mem::replace(&mut self.blocked, blocked) != blocked
    }

    /// Sets the permits in use.
    pub fn set_permits(&mut self, in_use: usize) -> bool {
        std::mem::replace(&mut self.permits, in_use) != in_use
    }

    /// Sets the spend so far.
    pub fn set_spend(&mut self, usd: Option<f64>) -> bool {
        std::mem::replace(&mut self.spend, usd) != usd
    }

    /// The view now.
    pub fn status(&self) -> Status {
        let mut names = self.order.clone();
        names.extend(self.latest.keys().filter(|k| !self.order.contains(k)).cloned());
        let members = names
            .into_iter()
            .map(|member| {
                let latest = self.latest.get(&member);
                let state = match latest.map(|l| l.state) {
                    Some(TaskState::Working) => MemberState::Running,
                    Some(TaskState::Completed) => MemberState::Done,
                    Some(s) if s.is_terminal() => MemberState::Failed,
                    _ if self.blocked => MemberState::Blocked,
                    _ => MemberState::Waiting,
                };
                let started_at = latest.filter(|_| state == MemberState::Running).and_then(|l| l.started_at);
                let steps_done = self.done.get(&member).map_or(0, |d| d.len() as u32);
                MemberLine { member, state, steps_done, started_at }
            })
            .collect();
        Status { run_id: self.run_id.clone(), members, permits_in_use: self.permits, spend_usd: self.spend }
    }
}

impl Status {
    /// The one-line form: `builder running · reviewer waiting | permits 1 in use | spend $0.0123`.
    pub fn line(&self) -> String {
        self.line_at(None)
    }

    /// [`Status::line`] with each running member's time at `now_ms` (unix ms):
    /// `builder running 44s · reviewer waiting | …`.
    pub fn line_at(&self, now_ms: Option<u64>) -> String {
        let members: Vec<String> = self.members.iter().map(|m| m.words(now_ms)).collect();
        format!("{} | permits {} in use | {}", members.join(" · "), self.permits_in_use, self.spend())
    }

    /// `spend $0.0123`, or `spend n/a`.
    pub fn spend(&self) -> String {
        self.spend_usd.map_or_else(|| "spend n/a".to_string(), |usd| format!("spend ${usd:.4}"))
    }
}

/// Which status lines are printed off a terminal: `status: <line>` when the line (without
/// times) differs from the last one printed, and, after an interval (15 s) without any line
/// printed (a milestone counts: see [`Lines::printed`]), the status again with the running
/// members' times, so that a long step is never a long silence. Pure: the caller says when.
#[derive(Debug)]
pub struct Lines {
    every_ms: u64,
    /// The last status line printed, without times.
    last: Option<String>,
    /// When the last line of any kind was printed (unix ms).
    last_at: u64,
}

impl Lines {
    /// The longest silence off a terminal by default: 15 s.
    pub const EVERY: std::time::Duration = std::time::Duration::from_secs(15);

    /// Lines printed at least every `every`, the silence counted from `now_ms`.
    pub fn new(every: std::time::Duration, now_ms: u64) -> Lines {
        Lines { every_ms: every.as_millis().try_into().unwrap_or(u64::MAX).max(1), last: None, last_at: now_ms }
    }

    /// The line to print for `status` at `now_ms`, if it says something new.
    pub fn changed(&mut self, status: &Status, now_ms: u64) -> Option<String> {
        let same = status.line();
        if self.last.as_deref() == Some(same.as_str()) {
            return None;
        }
        self.last = Some(same);
        self.last_at = now_ms;
        Some(format!("status: {}", status.line_at(Some(now_ms))))
    }

    /// The line to print at `now_ms` when nothing was printed for the interval.
    pub fn tick(&mut self, status: &Status, now_ms: u64) -> Option<String> {
        if now_ms.saturating_sub(self.last_at) < self.every_ms {
            return None;
        }
        self.last = Some(status.line());
        self.last_at = now_ms;
        Some(format!("status: {}", status.line_at(Some(now_ms))))
    }

    /// Another line (a milestone) was printed at `now_ms`.
    pub fn printed(&mut self, now_ms: u64) {
        self.last_at = now_ms;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mur_proto::fanout::FleetStep;

    fn record(task: &str, step: &str, run: &str, at: u64, state: TaskState) -> TaskRecord {
        running_since(task, step, run, at, state, None)
    }

    fn running_since(task: &str, step: &str, run: &str, at: u64, state: TaskState, started: Option<u64>) -> TaskRecord {
        let mut r = TaskRecord::submitted(
            TaskId::unchecked(task),
            mur_proto::cluster::SubmitRequest {
                fleet_step: Some(FleetStep { fleet: "f".into(), run_id: run.into(), step: step.into(), cap: 3 }),
                ..mur_proto::cluster::SubmitRequest::new(step, "t", mur_proto::task::Origin::Peer)
            },
            "d".into(),
            at,
        );
        r.state = state;
        r.started_at = started;
        r
    }

    #[test]
    fn members_move_from_waiting_to_running_to_done_or_failed() {
        let mut f = Follow::new("fleet-f-1", vec!["a".into(), "b".into()]);
        assert_eq!(f.status().line(), "a waiting · b waiting | permits 0 in use | spend n/a");
        assert!(!f.task(&record("t1", "a", "fleet-f-1-0", 1, TaskState::Submitted)), "still waiting: no new line");
        assert!(f.task(&record("t1", "a", "fleet-f-1-0", 1, TaskState::Working)));
        assert!(f.task(&record("t2", "b", "fleet-f-1-0", 2, TaskState::Failed)));
        assert!(f.set_permits(1));
        assert!(f.set_spend(Some(0.0123)));
        assert_eq!(f.status().line(), "a running · b failed | permits 1 in use | spend $0.0123");
        assert!(f.task(&record("t1", "a", "fleet-f-1-0", 1, TaskState::Completed)));
        // The next iteration's step of `a` supersedes the last one.
        assert!(f.task(&record("t3", "a", "fleet-f-1-1", 5, TaskState::Submitted)));
        let s = f.status();
        assert_eq!((s.members[0].state, s.members[0].steps_done), (MemberState::Waiting, 1));
        // Another run's steps are not this view's.
        assert!(!f.task(&record("t9", "a", "fleet-g-1-0", 9, TaskState::Working)));
    }

    #[test]
    fn a_blocked_job_shows_its_members_without_a_step_as_blocked() {
        let mut f = Follow::new("r", vec!["a".into(), "b".into()]);
        f.task(&record("t1", "a", "r", 1, TaskState::Completed));
        assert!(f.set_blocked(true));
        let json = serde_json::to_value(f.status()).unwrap();
        assert_eq!(json["members"][0], serde_json::json!({"member": "a", "state": "done", "steps_done": 1}));
        assert_eq!(json["members"][1]["state"], "blocked");
        assert_eq!(json["spend_usd"], serde_json::Value::Null);
    }

    #[test]
    fn steps_with_other_names_follow_the_members() {
        let mut f = Follow::new("r", vec!["a".into()]);
        f.task(&record("t1", "lint", "r", 1, TaskState::Working));
        assert_eq!(f.status().line(), "a waiting · lint running | permits 0 in use | spend n/a");
    }

    #[test]
    fn times_are_said_in_at_most_two_units() {
        let cases = [(0, "0s"), (7_999, "7s"), (65_000, "1m05s"), (3_599_000, "59m59s"), (7_380_000, "2h03m")];
        for (ms, said) in cases {
            assert_eq!(elapsed(ms), said);
        }
        assert_eq!(elapsed(100_800_000), "1d04h");
    }

    /// Issue #29, off a terminal: a change prints one line, the same line is never printed
    /// twice in a row, and 15 s without any line print the status again with the running
    /// members' times (a milestone printed meanwhile counts as a line).
    #[test]
    fn off_a_terminal_a_line_comes_on_each_change_and_at_least_every_15_seconds() {
        let t0 = 1_000_000;
        let mut f = Follow::new("r", vec!["a".into(), "b".into()]);
        let mut lines = Lines::new(Lines::EVERY, t0);
        let mut said = Vec::new();
        let mut at = |line: Option<String>, ms: u64| {
            if let Some(l) = line {
                said.push(format!("+{}s {l}", (ms - t0) / 1000));
            }
        };
        let s = f.status();
        at(lines.changed(&s, t0), t0);
        // a starts at t0 + 1 s: one line; the same status again prints nothing.
        f.task(&running_since("t1", "a", "r", 1, TaskState::Working, Some(t0 + 1_000)));
        let s = f.status();
        at(lines.changed(&s, t0 + 1_000), t0 + 1_000);
        at(lines.changed(&s, t0 + 2_000), t0 + 2_000);
        // Ticks every 200 ms: nothing until 15 s of silence, then the line with the time.
        for ms in (t0 + 1_200..=t0 + 31_000).step_by(200) {
            at(lines.tick(&s, ms), ms);
        }
        // A milestone at 33 s puts the next silent line off until 48 s.
        lines.printed(t0 + 33_000);
        for ms in (t0 + 31_200..=t0 + 48_000).step_by(200) {
            at(lines.tick(&s, ms), ms);
        }
        // The spend changes the line; steps_done alone does not (the line does not show it).
        assert!(f.set_spend(Some(0.5)));
        let s = f.status();
        at(lines.changed(&s, t0 + 50_000), t0 + 50_000);
        f.task(&running_since("t1", "a", "r", 1, TaskState::Completed, Some(t0 + 1_000)));
        f.task(&running_since("t2", "a", "r", 2, TaskState::Working, Some(t0 + 50_500)));
        let s = f.status();
        at(lines.changed(&s, t0 + 51_000), t0 + 51_000);
        assert_eq!(
            said,
            [
                "+0s status: a waiting · b waiting | permits 0 in use | spend n/a",
                "+1s status: a running 0s · b waiting | permits 0 in use | spend n/a",
                "+16s status: a running 15s · b waiting | permits 0 in use | spend n/a",
                "+31s status: a running 30s · b waiting | permits 0 in use | spend n/a",
                "+48s status: a running 47s · b waiting | permits 0 in use | spend n/a",
                "+50s status: a running 49s · b waiting | permits 0 in use | spend $0.5000",
            ]
        );
        let json = serde_json::to_value(f.status()).unwrap();
        assert_eq!(
            json["members"][0],
            serde_json::json!({"member": "a", "state": "running", "steps_done": 1, "started_at": t0 + 50_500})
        );
    }
}
