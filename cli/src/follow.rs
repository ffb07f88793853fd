//! The live view of `mur fleet run` (issue #11 §Live follow): what the client shows while
//! it follows a run — a status line per member (or procedure step), the run's fan-out
//! permits in use, its spend so far — folded from what the cluster reports. Pure: the
//! command feeds it task records, permit counts and spend, and prints what it returns.
//!
//! A member's state is that of its latest step in the run: `waiting` (delegated, not
//! started: in line for a permit or a worker), `running`, `done`, `failed` (any other end),
//! or `blocked` (its job awaits approval). Members with no step yet are `waiting`.

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

/// The fold.
#[derive(Debug)]
pub struct Follow {
    run_id: String,
    order: Vec<String>,
    /// Per step name: (submitted_at of its latest task, task id, state).
    latest: BTreeMap<String, (u64, String, TaskState)>,
    /// Per step name: its tasks that completed.
    done: BTreeMap<String, BTreeSet<String>>,
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
        let entry = self.latest.entry(step.step.clone()).or_insert((r.submitted_at, r.task_id.clone(), r.state));
        if r.submitted_at > entry.0 || entry.1 == r.task_id {
            *entry = (r.submitted_at, r.task_id.clone(), r.state);
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
                let state = match self.latest.get(&member).map(|l| l.2) {
                    Some(TaskState::Working) => MemberState::Running,
                    Some(TaskState::Completed) => MemberState::Done,
                    Some(s) if s.is_terminal() => MemberState::Failed,
                    _ if self.blocked => MemberState::Blocked,
                    _ => MemberState::Waiting,
                };
                let steps_done = self.done.get(&member).map_or(0, |d| d.len() as u32);
                MemberLine { member, state, steps_done }
            })
            .collect();
        Status { run_id: self.run_id.clone(), members, permits_in_use: self.permits, spend_usd: self.spend }
    }
}

impl Status {
    /// The one-line form: `builder running · reviewer waiting | permits 1 in use | spend $0.0123`.
    pub fn line(&self) -> String {
        let members: Vec<String> = self.members.iter().map(|m| format!("{} {}", m.member, m.state.as_str())).collect();
        let spend = self.spend_usd.map_or_else(|| "spend n/a".to_string(), |usd| format!("spend ${usd:.4}"));
        format!("{} | permits {} in use | {spend}", members.join(" · "), self.permits_in_use)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mur_proto::fanout::FleetStep;

    fn record(task: &str, step: &str, run: &str, at: u64, state: TaskState) -> TaskRecord {
        let mut r = TaskRecord::submitted(
            task.into(),
            mur_proto::cluster::SubmitRequest {
                fleet_step: Some(FleetStep { fleet: "f".into(), run_id: run.into(), step: step.into(), cap: 3 }),
                ..mur_proto::cluster::SubmitRequest::new(step, "t", mur_proto::task::Origin::Peer)
            },
            "d".into(),
            at,
        );
        r.state = state;
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
}
