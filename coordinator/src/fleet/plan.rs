//! A fleet's `procedure:` carried out as a pure state machine (the fleet-loops seed, §A
//! fixed step graph, §Unattended runs; the fleet reference, §6 DAG executor, §7 HITL).
//! No IO: the run's adapter (`fleet::run`) asks [`Procedure::next_rank`] for the steps to
//! send, runs them (at most the fan-out cap at once, each up to [`Launch::attempts`] times),
//! reports each with [`Procedure::step_ended`], and when no rank is left reads the
//! [`Procedure::outcome`], the job's [`Procedure::result`] and what to keep on the job
//! ([`Procedure::parked`], [`Procedure::done_outputs`]).
//!
//! The rules:
//! - Ranks: a step's rank is its longest dependency chain ([`fleet::procedure_ranks`]); a
//!   cycle refuses the run when it starts. Every step of a rank is sent, all are awaited,
//!   then the next rank starts.
//! - What a step is sent ([`step_text`]): the work (the job's text, or the standing goal),
//!   its own task labelled by its id, each completed dependency's output labelled only by
//!   the dependency's id (at most [`MAX_DEPENDENCY_OUTPUT`] bytes each, the cut marked), and
//!   the reply contract ([`REPLY_CONTRACT`]). A dependency with no output adds nothing.
//! - Failure, per step `on_failure`: `abort` ends the run failed after the current rank;
//!   `skip` goes on (dependents run without its output); `retry` sends it again up to
//!   `max_retries` times, then aborts.
//! - Approval: a step with a `tier` needs it unless `hitl.auto_approve_tiers` lists the
//!   tier (auto-approved steps are noted on the channel). `hitl.mode: deny` refuses it (a
//!   failure; its `on_failure` applies); otherwise the request is parked and the step is
//!   blocked. With `wait` (and a job) the run waits for the answer after the step's rank
//!   ([`Procedure::waits`], [`Procedure::answered`]); with `defer` or no mode (the run has
//!   no terminal to ask on) it does not, and the answer given with `mur fleet approve` /
//!   `deny` applies to the next run of that job.
//! - Dependents of a blocked, failed or not-run step are not run; independent branches
//!   still complete. Steps already done for the job (before it was parked) are not sent
//!   again: their outputs are kept on the job.
//! - Outcome: failed if any failure was not recovered, else blocked if any step awaits
//!   approval, else done.

use mur_proto::fleet::{self, Decision, HitlMode, Job, OnFailure, Step};
use std::collections::BTreeMap;

/// Most bytes of one dependency's output appended to a dependent step (reference §6).
pub const MAX_DEPENDENCY_OUTPUT: usize = 24_000;

/// Appended to every procedure step's text (reference §6 "a fixed reply contract"; §8
/// #595: partial work reported as complete).
pub const REPLY_CONTRACT: &str = "End your reply with a \"Completion:\" checklist: one line per part of your step, \
     \"- [x]\" when it is done and \"- [ ]\" when it is not.";

/// Where a step stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StepState {
    /// Not sent yet.
    Waiting,
    /// Sent, not reported yet.
    Sent,
    /// Completed, with its output.
    Done(String),
    /// Failed with `on_failure: skip`: recorded, the run goes on.
    Skipped(String),
    /// Failed and not recovered: the run ends failed after this rank.
    Failed(String),
    /// Waiting for approval (parked).
    Blocked,
    /// Not run, and why.
    NotRun(String),
}

/// One step to send now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Launch {
    /// The step id.
    pub id: String,
    /// The member capsule.
    pub member: String,
    /// The task's text ([`step_text`]).
    pub text: String,
    /// How many times to send it at most, stopping at the first success: 1, or
    /// 1 + `max_retries` with `on_failure: retry`.
    pub attempts: u32,
}

/// The steps of one rank to send, and what the channel should say about the others.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rank {
    /// 0-based.
    pub index: usize,
    /// The steps to send, in procedure order.
    pub launches: Vec<Launch>,
    /// One line per step approved, parked, denied or not run (a `note` event each).
    pub notes: Vec<String>,
}

/// How the procedure ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Every step completed (or failed with `skip`).
    Done,
    /// A failure was not recovered.
    Failed,
    /// No failure, but a step awaits approval.
    Blocked,
}

/// A procedure in progress for one iteration.
#[derive(Clone, Debug)]
pub struct Procedure {
    fleet: String,
    job: Option<String>,
    work: String,
    steps: Vec<Step>,
    ranks: Vec<Vec<usize>>,
    state: Vec<StepState>,
    next: usize,
    aborted: bool,
    auto_approve: Vec<fleet::RiskTier>,
    mode: Option<HitlMode>,
    answer: Option<(Decision, Vec<String>, String)>,
}

/// `text` cut to at most [`MAX_DEPENDENCY_OUTPUT`] bytes (on a character boundary), with
/// the cut marked: `[truncated: 24000 of 30000 bytes shown]`.
pub fn clip_output(text: &str) -> String {
    if text.len() <= MAX_DEPENDENCY_OUTPUT {
        return text.to_string();
    }
    let mut end = MAX_DEPENDENCY_OUTPUT;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}\n[truncated: {end} of {} bytes shown]", &text[..end], text.len())
}

/// The text a procedure step is sent: the work, `Step <id>: <task>`, each dependency's
/// output as `Output of step <id>:` followed by it ([`clip_output`]), and the reply
/// contract, separated by blank lines.
pub fn step_text(work: &str, id: &str, task: &str, dependencies: &[(&str, &str)]) -> String {
    let mut text = work.trim_end().to_string();
    let task = task.trim();
    if task.is_empty() {
        text.push_str(&format!("\n\nStep {id}."));
    } else {
        text.push_str(&format!("\n\nStep {id}: {task}"));
    }
    for (dep, output) in dependencies {
        if !output.trim().is_empty() {
            text.push_str(&format!("\n\nOutput of step {dep}:\n{}", clip_output(output)));
        }
    }
    text.push_str("\n\n");
    text.push_str(REPLY_CONTRACT);
    text
}

impl Procedure {
    /// A procedure for `work` (the job's text or the standing goal). With `job`, the steps
    /// it already completed are not sent again and an answered approval applies.
    ///
    /// # Errors
    /// The fleet has no procedure, or its steps form a cycle:
    /// `fleet '<name>': procedure: dependency cycle among steps "a", "b"`.
    pub fn new(fleet: &fleet::Fleet, work: &str, job: Option<&Job>) -> Result<Procedure, String> {
        check(fleet)?;
        let ranks = fleet::procedure_ranks(&fleet.procedure).map_err(|e| format!("fleet '{}': {e}", fleet.name))?;
        let index = |id: &str| fleet.procedure.iter().position(|s| s.id == id).unwrap_or(0);
        let ranks = ranks.iter().map(|r| r.iter().map(|s| index(&s.id)).collect()).collect();
        let state = fleet
            .procedure
            .iter()
            .map(|s| match job.and_then(|j| j.steps_done.get(&s.id)) {
                Some(output) => StepState::Done(output.clone()),
                None => StepState::Waiting,
            })
            .collect();
        let answer = job.and_then(|j| j.approval.as_ref()).and_then(|a| {
            a.decision.map(|d| (d, a.steps.clone(), a.by.clone().unwrap_or_else(|| "someone".to_string())))
        });
        Ok(Procedure {
            fleet: fleet.name.clone(),
            job: job.map(|j| j.id.clone()),
            work: work.to_string(),
            steps: fleet.procedure.clone(),
            ranks,
            state,
            next: 0,
            aborted: false,
            auto_approve: fleet.hitl.auto_approve_tiers.clone(),
            mode: fleet.hitl.mode,
            answer,
        })
    }

    /// The next rank's steps to send; `None` when every rank has been handed out or a
    /// failure aborted the run. Steps already done are passed over; blocked, denied and
    /// not-run steps are settled here and reported in [`Rank::notes`].
    pub fn next_rank(&mut self) -> Option<Rank> {
        if self.aborted || self.next >= self.ranks.len() {
            return None;
        }
        let index = self.next;
        self.next += 1;
        let mut rank = Rank { index, launches: Vec::new(), notes: Vec::new() };
        for &i in &self.ranks[index].clone() {
            if self.state[i] == StepState::Waiting {
                self.consider(i, &mut rank);
            }
        }
        Some(rank)
    }

    /// Whether the run should wait for an answer now (`hitl.mode: wait`, a step parked,
    /// and a job to answer on): the adapter waits, then hands the answer to
    /// [`Procedure::answered`] before it asks for the next rank.
    pub fn waits(&self) -> bool {
        self.mode == Some(HitlMode::Wait) && self.job.is_some() && self.state.contains(&StepState::Blocked)
    }

    /// The answer given while the run waited (`hitl.mode: wait`): the parked steps are
    /// settled with it as a run that starts after the answer would settle them — approved
    /// ones are returned to send now, denied ones fail (their `on_failure` applies).
    pub fn answered(&mut self, decision: Decision, by: &str) -> Rank {
        let parked: Vec<usize> = (0..self.steps.len()).filter(|&i| self.state[i] == StepState::Blocked).collect();
        let ids = parked.iter().map(|&i| self.steps[i].id.clone()).collect();
        self.answer = Some((decision, ids, by.to_string()));
        let mut rank = Rank { index: self.next.saturating_sub(1), launches: Vec::new(), notes: Vec::new() };
        for i in parked {
            self.state[i] = StepState::Waiting;
            self.consider(i, &mut rank);
        }
        rank
    }

    /// Settles waiting step `i`: not run (a dependency did not complete), approved,
    /// denied, parked, or added to `rank`'s launches.
    fn consider(&mut self, i: usize, rank: &mut Rank) {
        let step = self.steps[i].clone();
        if let Some(reason) = self.unmet(&step) {
            rank.notes.push(format!("step {} not run: {reason}", step.id));
            self.state[i] = StepState::NotRun(reason);
            return;
        }
        if let Some(tier) = step.tier {
            let answered = self.answer.as_ref().filter(|(_, steps, _)| steps.contains(&step.id));
            match answered {
                Some((Decision::Approved, _, by)) => {
                    rank.notes.push(format!("step {} ({}) approved by {by}", step.id, tier.as_str()));
                }
                Some((Decision::Denied, _, by)) => {
                    let why = format!("denied by {by}");
                    rank.notes.push(format!("step {} ({}) {why}", step.id, tier.as_str()));
                    self.failed(i, why);
                    return;
                }
                None if self.auto_approve.contains(&tier) => {
                    rank.notes.push(format!(
                        "step {} ({}) auto-approved by hitl.auto_approve_tiers",
                        step.id,
                        tier.as_str()
                    ));
                }
                None if self.mode == Some(HitlMode::Deny) => {
                    let why = "denied by hitl.mode deny".to_string();
                    rank.notes.push(format!("step {} ({}) {why}", step.id, tier.as_str()));
                    self.failed(i, why);
                    return;
                }
                None => {
                    let how = match &self.job {
                        Some(job) => format!("mur fleet approve {} {job}", self.fleet),
                        None => "send the work as a job to approve it".to_string(),
                    };
                    rank.notes.push(format!("step {} ({}) awaits approval: {how}", step.id, tier.as_str()));
                    self.state[i] = StepState::Blocked;
                    return;
                }
            }
        }
        let deps: Vec<(&str, &str)> = step
            .depends_on
            .iter()
            .filter_map(|d| {
                let j = self.steps.iter().position(|s| &s.id == d)?;
                match &self.state[j] {
                    StepState::Done(out) => Some((d.as_str(), out.as_str())),
                    _ => None,
                }
            })
            .collect();
        let attempts = if step.on_failure == OnFailure::Retry { 1 + step.max_retries } else { 1 };
        rank.launches.push(Launch {
            id: step.id.clone(),
            member: step.member.clone(),
            text: step_text(&self.work, &step.id, &step.task, &deps),
            attempts,
        });
        self.state[i] = StepState::Sent;
    }

    /// Why `step` cannot run: a dependency that is blocked, failed or did not run.
    fn unmet(&self, step: &Step) -> Option<String> {
        step.depends_on.iter().find_map(|d| {
            let j = self.steps.iter().position(|s| &s.id == d)?;
            match &self.state[j] {
                StepState::Blocked => Some(format!("depends on step {d}, which awaits approval")),
                StepState::Failed(_) => Some(format!("depends on step {d}, which failed")),
                StepState::NotRun(_) => Some(format!("depends on step {d}, which did not run")),
                _ => None,
            }
        })
    }

    fn failed(&mut self, i: usize, output: String) {
        match self.steps[i].on_failure {
            OnFailure::Skip => self.state[i] = StepState::Skipped(output),
            OnFailure::Abort | OnFailure::Retry => {
                self.state[i] = StepState::Failed(output);
                self.aborted = true;
            }
        }
    }

    /// How step `id` ended after its attempts: `ok` with its output, or the last
    /// attempt's failure text. A failure applies the step's `on_failure` (a retried step
    /// has used its retries: the run aborts).
    pub fn step_ended(&mut self, id: &str, ok: bool, output: String) {
        let Some(i) = self.steps.iter().position(|s| s.id == id) else { return };
        if ok {
            self.state[i] = StepState::Done(output);
        } else {
            self.failed(i, output);
        }
    }

    /// Where each step stands, in procedure order.
    pub fn states(&self) -> Vec<(&str, &StepState)> {
        self.steps.iter().map(|s| s.id.as_str()).zip(self.state.iter()).collect()
    }

    /// How the procedure ended (meaningful once [`Procedure::next_rank`] gave `None` and
    /// every sent step was reported).
    pub fn outcome(&self) -> Outcome {
        if self.state.iter().any(|s| matches!(s, StepState::Failed(_) | StepState::Sent)) {
            Outcome::Failed
        } else if self.state.contains(&StepState::Blocked) {
            Outcome::Blocked
        } else {
            Outcome::Done
        }
    }

    /// The ids of the steps awaiting approval, in procedure order.
    pub fn parked(&self) -> Vec<String> {
        self.states().into_iter().filter(|(_, s)| **s == StepState::Blocked).map(|(id, _)| id.to_string()).collect()
    }

    /// The completed steps' outputs, by id (kept on the job).
    pub fn done_outputs(&self) -> BTreeMap<String, String> {
        self.states()
            .into_iter()
            .filter_map(|(id, s)| match s {
                StepState::Done(out) => Some((id.to_string(), out.clone())),
                _ => None,
            })
            .collect()
    }

    /// The completed steps' outputs in procedure order (what a `marker:` is looked for in).
    pub fn outputs(&self) -> Vec<String> {
        self.done_outputs_in_order().into_iter().map(|(_, o)| o.to_string()).collect()
    }

    fn done_outputs_in_order(&self) -> Vec<(&str, &str)> {
        self.states()
            .into_iter()
            .filter_map(|(id, s)| match s {
                StepState::Done(out) => Some((id, out.as_str())),
                _ => None,
            })
            .collect()
    }

    /// The job's result: every step in procedure order, `[<id>]` then its output, or
    /// `[<id>] failed:` / `skipped after failing:` / `awaits approval` / `not run: <why>`.
    pub fn result(&self) -> String {
        self.states()
            .into_iter()
            .map(|(id, s)| match s {
                StepState::Done(out) => format!("[{id}]\n{out}"),
                StepState::Failed(out) => format!("[{id}] failed:\n{out}"),
                StepState::Skipped(out) => format!("[{id}] skipped after failing:\n{out}"),
                StepState::Blocked => format!("[{id}] awaits approval"),
                StepState::NotRun(why) => format!("[{id}] not run: {why}"),
                StepState::Waiting | StepState::Sent => format!("[{id}] not run: the run stopped first"),
            })
            .collect::<Vec<_>>()
            .join("\n\n")
    }
}

/// The steps of a fleet with `parallel:` and no procedure or router plan (reference §6,
/// Broadcast: "With parallel: one step per track (member round-robin, 'Approach:'
/// appended) or partition regions"): `(member, text)` per track, members taken in turn.
/// Speculative: the work, then `Approach: <approach>` when the track has one. Partition:
/// the work, then `Your part: region <i> of <n> of <target_file> (track <name>).`, then the
/// approach. `None` without `parallel:`. The judge, `pre_filter` and a track's `model` are
/// carried, not used yet.
pub fn track_steps(fleet: &fleet::Fleet, work: &str) -> Option<Vec<(String, String)>> {
    let parallel = fleet.parallel.as_ref()?;
    if fleet.members.is_empty() || parallel.tracks.is_empty() {
        return None;
    }
    let n = parallel.tracks.len();
    let steps = parallel
        .tracks
        .iter()
        .enumerate()
        .map(|(i, track)| {
            let mut text = work.trim_end().to_string();
            if let (fleet::ParallelMode::Partition, Some(p)) = (parallel.mode, &parallel.partition) {
                text.push_str(&format!(
                    "\n\nYour part: region {} of {n} of {} (track {}).",
                    i + 1,
                    p.target_file,
                    track.name
                ));
            }
            if !track.approach.trim().is_empty() {
                text.push_str(&format!("\n\nApproach: {}", track.approach.trim()));
            }
            (fleet.members[i % fleet.members.len()].clone(), text)
        })
        .collect();
    Some(steps)
}

/// Checks what a procedure run needs when it starts (the fleet has one, and it has no
/// cycle).
///
/// # Errors
/// `fleet '<name>': procedure: …` naming the rule.
pub fn check(fleet: &fleet::Fleet) -> Result<(), String> {
    if fleet.procedure.is_empty() {
        return Err(format!("fleet '{}': procedure: is empty", fleet.name));
    }
    fleet::procedure_ranks(&fleet.procedure).map(drop).map_err(|e| format!("fleet '{}': {e}", fleet.name))
}

#[cfg(test)]
mod tests {
    use super::*;
    use mur_proto::fleet::{Approval, Fleet, JobStatus};

    fn fleet(procedure: &str) -> Fleet {
        Fleet::parse(&format!("name: f\nmembers: [w, c]\nprocedure:\n{procedure}")).unwrap()
    }

    fn with_hitl(procedure: &str, hitl: &str) -> Fleet {
        Fleet::parse(&format!("name: f\nmembers: [w, c]\nhitl:\n{hitl}procedure:\n{procedure}")).unwrap()
    }

    const THREE: &str = "  - id: draft\n    member: w\n    task: Draft it.\n  - id: side\n    member: c\n    \
                         task: Note something.\n  - id: review\n    member: c\n    task: Review it.\n    \
                         depends_on: [draft]\n";

    fn ids(rank: &Rank) -> Vec<&str> {
        rank.launches.iter().map(|l| l.id.as_str()).collect()
    }

    #[test]
    fn ranks_go_in_order_and_a_dependent_step_gets_the_output_labelled_by_step_id() {
        let mut p = Procedure::new(&fleet(THREE), "Write the answer.", None).unwrap();
        let r0 = p.next_rank().unwrap();
        assert_eq!((r0.index, ids(&r0)), (0, vec!["draft", "side"]));
        assert_eq!(
            r0.launches[0],
            Launch {
                id: "draft".into(),
                member: "w".into(),
                text: format!("Write the answer.\n\nStep draft: Draft it.\n\n{REPLY_CONTRACT}"),
                attempts: 1,
            }
        );
        p.step_ended("draft", true, "the draft".into());
        p.step_ended("side", true, String::new());
        let r1 = p.next_rank().unwrap();
        assert_eq!(ids(&r1), ["review"]);
        assert_eq!(
            r1.launches[0].text,
            format!(
                "Write the answer.\n\nStep review: Review it.\n\nOutput of step draft:\nthe draft\n\n{REPLY_CONTRACT}"
            )
        );
        p.step_ended("review", true, "fine".into());
        assert_eq!(p.next_rank(), None);
        assert_eq!(p.outcome(), Outcome::Done);
        assert_eq!(p.result(), "[draft]\nthe draft\n\n[side]\n\n\n[review]\nfine");
    }

    #[test]
    fn a_cycle_refuses_the_run_naming_the_field() {
        let f = fleet("  - id: a\n    member: w\n    depends_on: [b]\n  - id: b\n    member: c\n    depends_on: [a]\n");
        assert_eq!(
            Procedure::new(&f, "x", None).unwrap_err(),
            "fleet 'f': procedure: dependency cycle among steps \"a\", \"b\""
        );
        assert_eq!(check(&f).unwrap_err(), "fleet 'f': procedure: dependency cycle among steps \"a\", \"b\"");
    }

    #[test]
    fn a_dependency_output_over_24000_bytes_is_cut_and_marked() {
        let long = "é".repeat(12_001); // 24 002 bytes: the cut falls inside a character
        let clipped = clip_output(&long);
        assert_eq!(clipped, format!("{}\n[truncated: 24000 of 24002 bytes shown]", "é".repeat(12_000)));
        assert_eq!(clip_output("short"), "short");
        let exact = "a".repeat(MAX_DEPENDENCY_OUTPUT);
        assert_eq!(clip_output(&exact), exact);
    }

    #[test]
    fn abort_stops_later_ranks_and_the_run_fails() {
        let mut p = Procedure::new(&fleet(THREE), "w", None).unwrap();
        p.next_rank().unwrap();
        p.step_ended("draft", false, "boom".into());
        p.step_ended("side", true, "noted".into());
        assert_eq!(p.next_rank(), None);
        assert_eq!(p.outcome(), Outcome::Failed);
        assert_eq!(p.result(), "[draft] failed:\nboom\n\n[side]\nnoted\n\n[review] not run: the run stopped first");
    }

    #[test]
    fn skip_goes_on_and_the_dependent_runs_without_the_failed_output() {
        let f = fleet(&THREE.replace("task: Draft it.\n", "task: Draft it.\n    on_failure: skip\n"));
        let mut p = Procedure::new(&f, "w", None).unwrap();
        p.next_rank().unwrap();
        p.step_ended("draft", false, "boom".into());
        p.step_ended("side", true, "noted".into());
        let r1 = p.next_rank().unwrap();
        assert_eq!(r1.launches[0].text, format!("w\n\nStep review: Review it.\n\n{REPLY_CONTRACT}"));
        p.step_ended("review", true, "ok".into());
        assert_eq!(p.outcome(), Outcome::Done);
    }

    #[test]
    fn retry_sends_the_step_up_to_max_retries_more_times_then_aborts() {
        let f = fleet(
            "  - id: a\n    member: w\n    on_failure: retry\n  - id: b\n    member: w\n    on_failure: retry\n    max_retries: 3\n  - id: c\n    member: w\n    depends_on: [a]\n",
        );
        let mut p = Procedure::new(&f, "w", None).unwrap();
        let r0 = p.next_rank().unwrap();
        assert_eq!(r0.launches.iter().map(|l| l.attempts).collect::<Vec<_>>(), [2, 4]);
        p.step_ended("a", false, "still broken".into());
        p.step_ended("b", true, "ok".into());
        assert_eq!(p.next_rank(), None);
        assert_eq!(p.outcome(), Outcome::Failed);
    }

    #[test]
    fn a_step_with_a_tier_is_parked_its_dependents_wait_and_independent_branches_complete() {
        let f = fleet(&THREE.replace("task: Draft it.\n", "task: Draft it.\n    tier: destructive\n"));
        let mut job = Job::new("work", "cli", 0);
        job.id = "j1".into();
        let mut p = Procedure::new(&f, "work", Some(&job)).unwrap();
        let r0 = p.next_rank().unwrap();
        assert_eq!(ids(&r0), ["side"]);
        assert_eq!(r0.notes, ["step draft (destructive) awaits approval: mur fleet approve f j1"]);
        p.step_ended("side", true, "noted".into());
        let r1 = p.next_rank().unwrap();
        assert!(r1.launches.is_empty());
        assert_eq!(r1.notes, ["step review not run: depends on step draft, which awaits approval"]);
        assert_eq!(p.next_rank(), None);
        assert_eq!(p.outcome(), Outcome::Blocked);
        assert_eq!(p.parked(), ["draft"]);
        assert_eq!(p.done_outputs(), BTreeMap::from([("side".to_string(), "noted".to_string())]));

        // Approved: the next run sends the parked step and its dependent, not the done one.
        job.status = JobStatus::Blocked;
        job.steps_done = p.done_outputs();
        job.approval = Some(Approval {
            steps: p.parked(),
            decision: Some(Decision::Approved),
            by: Some("ann".into()),
            at: Some(5),
        });
        let mut again = Procedure::new(&f, "work", Some(&job)).unwrap();
        let r0 = again.next_rank().unwrap();
        assert_eq!(
            (ids(&r0), r0.notes.clone()),
            (vec!["draft"], vec!["step draft (destructive) approved by ann".to_string()])
        );
        again.step_ended("draft", true, "drafted".into());
        assert_eq!(ids(&again.next_rank().unwrap()), ["review"]);
        again.step_ended("review", true, "ok".into());
        assert_eq!(again.outcome(), Outcome::Done);
        assert_eq!(again.result(), "[draft]\ndrafted\n\n[side]\nnoted\n\n[review]\nok");
    }

    #[test]
    fn a_denied_step_fails_and_its_on_failure_applies() {
        let f = fleet(
            "  - id: a\n    member: w\n    tier: spend\n  - id: b\n    member: w\n    tier: spend\n    on_failure: skip\n",
        );
        let mut job = Job::new("work", "cli", 0);
        job.status = JobStatus::Blocked;
        job.approval = Some(Approval {
            steps: vec!["a".into(), "b".into()],
            decision: Some(Decision::Denied),
            by: Some("bob".into()),
            at: Some(1),
        });
        let mut p = Procedure::new(&f, "work", Some(&job)).unwrap();
        let r0 = p.next_rank().unwrap();
        assert_eq!(r0.launches, []);
        assert_eq!(r0.notes, ["step a (spend) denied by bob", "step b (spend) denied by bob"]);
        assert_eq!(p.outcome(), Outcome::Failed);
        assert_eq!(p.result(), "[a] failed:\ndenied by bob\n\n[b] skipped after failing:\ndenied by bob");
    }

    #[test]
    fn auto_approved_tiers_run_with_a_note_and_mode_deny_refuses_the_rest() {
        let f = with_hitl(
            "  - id: r\n    member: w\n    tier: write\n  - id: x\n    member: w\n    tier: destructive\n    on_failure: skip\n",
            "  mode: deny\n  auto_approve_tiers: [read, write]\n",
        );
        let mut p = Procedure::new(&f, "work", None).unwrap();
        let r0 = p.next_rank().unwrap();
        assert_eq!(ids(&r0), ["r"]);
        assert_eq!(
            r0.notes,
            [
                "step r (write) auto-approved by hitl.auto_approve_tiers",
                "step x (destructive) denied by hitl.mode deny"
            ]
        );
        p.step_ended("r", true, "wrote".into());
        assert_eq!(p.outcome(), Outcome::Done);
    }

    #[test]
    fn parallel_tracks_go_to_members_in_turn_with_their_approach_or_region() {
        let spec = Fleet::parse(
            "name: s\nmembers: [a, b]\nparallel:\n  mode: speculative\n  tracks:\n    - name: one\n      \
             approach: top-down\n    - name: two\n    - name: three\n      approach: bottom-up\n",
        )
        .unwrap();
        assert_eq!(
            track_steps(&spec, "Fix the bug.").unwrap(),
            [
                ("a".to_string(), "Fix the bug.\n\nApproach: top-down".to_string()),
                ("b".to_string(), "Fix the bug.".to_string()),
                ("a".to_string(), "Fix the bug.\n\nApproach: bottom-up".to_string()),
            ]
        );
        let part = Fleet::parse(
            "name: p\nmembers: [a]\nparallel:\n  mode: partition\n  partition:\n    target_file: src/lib.rs\n  \
             tracks:\n    - name: head\n    - name: tail\n      approach: carefully\n",
        )
        .unwrap();
        assert_eq!(
            track_steps(&part, "Tidy.").unwrap(),
            [
                ("a".to_string(), "Tidy.\n\nYour part: region 1 of 2 of src/lib.rs (track head).".to_string()),
                (
                    "a".to_string(),
                    "Tidy.\n\nYour part: region 2 of 2 of src/lib.rs (track tail).\n\nApproach: carefully".to_string()
                ),
            ]
        );
        assert_eq!(track_steps(&Fleet::parse("name: x\nmembers: [a]\n").unwrap(), "w"), None);
    }

    #[test]
    fn with_mode_wait_the_answer_given_during_the_run_settles_the_parked_step() {
        let f = with_hitl(
            &THREE.replace("task: Draft it.\n", "task: Draft it.\n    tier: destructive\n"),
            "  mode: wait\n",
        );
        let mut job = Job::new("work", "cli", 0);
        job.id = "j1".into();
        assert!(!Procedure::new(&f, "work", None).unwrap().waits(), "no job to answer on: nothing to wait for");
        let mut p = Procedure::new(&f, "work", Some(&job)).unwrap();
        assert!(!p.waits());
        assert_eq!(ids(&p.next_rank().unwrap()), ["side"]);
        assert!(p.waits());
        let now = p.answered(Decision::Approved, "ann");
        assert_eq!(
            (ids(&now), now.notes.clone()),
            (vec!["draft"], vec!["step draft (destructive) approved by ann".to_string()])
        );
        assert!(!p.waits());
        p.step_ended("side", true, "noted".into());
        p.step_ended("draft", true, "drafted".into());
        assert_eq!(ids(&p.next_rank().unwrap()), ["review"]);
        let mut denied = Procedure::new(&f, "work", Some(&job)).unwrap();
        denied.next_rank();
        let now = denied.answered(Decision::Denied, "bob");
        assert_eq!((now.launches.len(), now.notes), (0, vec!["step draft (destructive) denied by bob".to_string()]));
        assert_eq!(denied.next_rank(), None, "abort");
    }

    #[test]
    fn a_failed_dependency_is_named_when_its_dependents_do_not_run() {
        let f = fleet(
            "  - id: a\n    member: w\n    tier: spend\n    on_failure: skip\n  - id: b\n    member: w\n  - id: c\n    member: w\n    depends_on: [a, b]\n  - id: d\n    member: w\n    depends_on: [c]\n",
        );
        let mut p = Procedure::new(&f, "work", None).unwrap();
        p.next_rank().unwrap(); // a parked, b sent
        p.step_ended("b", true, "b out".into());
        assert_eq!(p.next_rank().unwrap().notes, ["step c not run: depends on step a, which awaits approval"]);
        assert_eq!(p.next_rank().unwrap().notes, ["step d not run: depends on step c, which did not run"]);
        assert_eq!(p.outcome(), Outcome::Blocked);
    }
}
