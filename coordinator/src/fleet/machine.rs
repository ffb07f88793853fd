//! The fleet run as a pure state machine (issue #10 §Runs and loops; the fleet-loops seed,
//! §Three ways a loop ends, §The bounds): what to do next given what the run has seen. No
//! IO: the coordinator's adapter reads the sentinel, the jobs and the channel, hands them
//! in as a [`View`], carries out the [`Next`] (claims the job, submits the delegated steps
//! as `peer` capsule tasks, waits for their records) and reports the replies with
//! [`Run::iteration_ended`].
//!
//! Order of the checks before every iteration (the seed's): the kill-switch (a sentinel
//! that cannot be read counts as set: fail closed), then deadline → stuck (never before the
//! first iteration) → the 10 000-iteration ceiling ([`fleet::check_guards`]) → the budget
//! (issue #11 §Cost: spent + projected next > budget, [`cost::projected_next`]; only for a
//! fleet on metered models), then `done_when: queue-empty` (before any model call, so it
//! costs nothing). A run without
//! `--loop` makes one iteration. Plans: a fleet without a router (or with one member) sends
//! the work to every member (with `parallel:`, one step per track:
//! [`crate::fleet::plan::track_steps`]); with a router and several members the router plans each
//! iteration ([`Next::Plan`]: every member gets the work followed by the router's
//! assignment) and, when `done_when` is empty, judges DONE after it (one model call). A
//! fleet with a `procedure:` runs it instead, never the router ([`Next::Procedure`]; the
//! steps are [`crate::fleet::plan`]'s); a procedure with a cycle refuses the run when it
//! starts. The work is the oldest blocked job whose approval was answered, else the oldest
//! queued job ([`fleet::next_job`]).

use mur_proto::cost;
use mur_proto::fleet::{self, DoneWhen, Fleet, GuardInput, Job, PlanKind, Stop};
use std::time::Duration;

/// What a run was started with.
#[derive(Clone, Debug)]
pub struct Spec {
    /// The run id (`--run-id`, or generated); iterations are `<run id>-<n>` for a loop.
    pub run_id: String,
    /// The fleet as loaded.
    pub fleet: Fleet,
    /// `--loop`.
    pub looping: bool,
    /// The job named on the command line (`mur fleet run NAME JOB`), if any.
    pub job: Option<String>,
    /// The resolved deadline.
    pub deadline: Duration,
    /// The resolved stuck window (`None`: off).
    pub stuck: Option<Duration>,
    /// When the run started, unix ms.
    pub started_at: u64,
    /// The spend ceiling, USD, when one applies: the resolved cost bound of a fleet on
    /// metered models (a model with a price); `None` otherwise (issue #11 §Cost).
    pub budget_usd: Option<f64>,
    /// The dearest output price of the fleet's models, USD per 1,000 tokens: the rate of
    /// the first iteration's projection ([`cost::projected_next`]); 0 when not metered.
    pub guard_rate: f64,
}

/// What the adapter read just now.
#[derive(Clone, Debug)]
pub struct View<'a> {
    /// Now, unix ms.
    pub now: u64,
    /// The kill-switch: `Ok(true)` set, `Ok(false)` clear, `Err` unreadable (counts as set).
    pub stopped: Result<bool, String>,
    /// The fleet's jobs (any order).
    pub jobs: &'a [Job],
    /// When the channel last had an agent-authored event (router or member), unix ms.
    pub last_agent_event: Option<u64>,
}

/// One delegated step: a `peer` task for `member` with `text`; the time left on the
/// loop's clock travels with it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Step {
    /// The member capsule.
    pub member: String,
    /// The task's text.
    pub text: String,
    /// The time left when it is sent (`fleet::inherited_deadline`: at least 1 s).
    pub time_left: Duration,
}

/// What to do next.
#[derive(Clone, Debug, PartialEq)]
pub enum Next {
    /// Ask the router to plan iteration `iteration`: send `text` to it as a `peer` task,
    /// then hand its reply to [`Run::planned`], which gives the iteration.
    Plan {
        /// 0-based.
        iteration: u64,
        /// As in [`Next::Iterate`].
        iteration_run_id: String,
        /// The job worked on; `None` for the standing goal.
        job: Option<String>,
        /// The router capsule.
        router: String,
        /// The planning request.
        text: String,
        /// The time left.
        time_left: Duration,
    },
    /// Run iteration `iteration`: claim `job` (when one), then send `steps`.
    Iterate {
        /// 0-based.
        iteration: u64,
        /// `<run id>-<n>` for a loop, the run id for a single run.
        iteration_run_id: String,
        /// The job worked on; `None` for the standing goal.
        job: Option<String>,
        /// The delegated steps.
        steps: Vec<Step>,
    },
    /// Run iteration `iteration` by the fleet's procedure: claim `job` (when one), then
    /// carry out [`crate::fleet::plan::Procedure`] for `work` and report it with
    /// [`Run::procedure_ended`].
    Procedure {
        /// 0-based.
        iteration: u64,
        /// As in [`Next::Iterate`].
        iteration_run_id: String,
        /// The job worked on; `None` for the standing goal.
        job: Option<String>,
        /// The job's text, or the standing goal.
        work: String,
    },
    /// The run is over.
    Stop(Stop),
}

/// How one delegated step ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reply {
    /// The member.
    pub member: String,
    /// Whether its task ended `completed` (exit `ok`).
    pub ok: bool,
    /// Its result text.
    pub text: String,
}

/// What an iteration came to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Iteration {
    /// With a router and an empty `done_when`, the router judges DONE: send it this text
    /// and hand its reply to [`Run::judged`] (one model call per iteration).
    pub judge: Option<(String, String)>,
    /// The job's new status text: `done` when every step ended ok, else `failed`.
    pub job_done: bool,
    /// The job's result: the replies, one per member, in member order.
    pub result: String,
    /// The run ends here.
    pub stop: Option<Stop>,
}

/// Why a run cannot start.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    /// The kill-switch is set or unreadable.
    #[error("fleet '{0}' is stopped (`mur fleet start {0}` clears it)")]
    Stopped(String),
    /// Not runnable as defined (`reason` names the fleet).
    #[error("{reason}")]
    NotRunnable {
        /// The fleet.
        fleet: String,
        /// Why.
        reason: String,
    },
    /// The job named is not queued.
    #[error("job {0} is not queued in this fleet")]
    NoSuchJob(String),
}

/// A run in progress.
#[derive(Clone, Debug)]
pub struct Run {
    spec: Spec,
    iteration: u64,
    over: Option<Stop>,
    /// The iteration waiting for its plan: `(iteration run id, job, job text, time left)`.
    planning: Option<(String, Option<String>, String, Duration)>,
    /// USD spent so far ([`Run::spent`]).
    spent_usd: f64,
}

/// The text the router gets to plan an iteration.
pub fn plan_text(members: &[String], work: &str) -> String {
    format!(
        "Plan this work for the fleet's members ({}): say what each of them should do.\n\nWork:\n{work}",
        members.join(", ")
    )
}

/// The text the router gets to judge an iteration: the members' replies.
pub fn judge_text(work: &str, result: &str) -> String {
    format!(
        "Is this work DONE, or should the fleet CONTINUE? Answer DONE or CONTINUE.\n\nWork:\n{work}\n\nReplies:\n{result}"
    )
}

impl Run {
    /// Checks that the run may start (`mur fleet run` refuses a stopped fleet and a plan it
    /// cannot carry out, with the reason) and returns it.
    ///
    /// # Errors
    /// [`Refused`].
    pub fn start(spec: Spec, view: &View<'_>) -> Result<Run, Refused> {
        let name = spec.fleet.name.clone();
        if !matches!(view.stopped, Ok(false)) {
            return Err(Refused::Stopped(name));
        }
        spec.fleet.check_runnable().map_err(|reason| Refused::NotRunnable { fleet: name.clone(), reason })?;
        if spec.fleet.plan_kind() == PlanKind::Procedure {
            crate::fleet::plan::check(&spec.fleet).map_err(|reason| Refused::NotRunnable { fleet: name, reason })?;
        }
        if let Some(job) = &spec.job
            && !view
                .jobs
                .iter()
                .any(|j| &j.id == job && (j.status == fleet::JobStatus::Queued || fleet::is_answered(j)))
        {
            return Err(Refused::NoSuchJob(job.clone()));
        }
        Ok(Run { spec, iteration: 0, over: None, planning: None, spent_usd: 0.0 })
    }

    /// Whether a run of `spec` has a way to converge when it is a loop: an empty
    /// `done_when` asks the router for DONE (§Three ways a loop ends), so a loop of a fleet
    /// without a router would only end at its deadline, iterating flat out meanwhile. The
    /// coordinator refuses such a run when it is asked for one.
    ///
    /// # Errors
    /// [`Refused::NotRunnable`] saying how to fix it.
    pub fn check_convergence(spec: &Spec) -> Result<(), Refused> {
        let name = &spec.fleet.name;
        if spec.looping && spec.fleet.r#loop.done_when == DoneWhen::Router && spec.fleet.router.is_none() {
            return Err(Refused::NotRunnable {
                fleet: name.clone(),
                reason: format!(
                    "fleet '{name}': done_when is empty (the router judges DONE) but the fleet has no router: \
                     set it with `mur fleet set-loop {name} --done-when queue-empty` (or marker:TEXT), or give \
                     the fleet a router"
                ),
            });
        }
        Ok(())
    }

    /// A run another coordinator started and left behind (issue #11 §Jobs that outlive
    /// their coordinator): it goes on after `iterations` iterations that spent `spent_usd`,
    /// on the clock of `spec.started_at`.
    pub fn resume(spec: Spec, iterations: u64, spent_usd: f64) -> Run {
        Run { spec, iteration: iterations, over: None, planning: None, spent_usd }
    }

    /// Accounts an iteration's spend, USD (ref §3 step 13): its real cost, or, for a run
    /// with a budget whose iteration reported no tokens at all (`counted` false), the
    /// first-iteration projection: never 0.
    pub fn spent(&mut self, usd: f64, counted: bool) {
        self.spent_usd += if counted || self.spec.budget_usd.is_none() {
            usd
        } else {
            cost::projected_next(0, 0.0, self.spec.fleet.members.len(), self.spec.guard_rate)
        };
    }

    /// USD spent so far.
    pub fn spent_usd(&self) -> f64 {
        self.spent_usd
    }

    /// The run's spec.
    pub fn spec(&self) -> &Spec {
        &self.spec
    }

    /// What to do next, after the checks in the module docs.
    pub fn next(&mut self, view: &View<'_>) -> Next {
        if let Some(stop) = self.over {
            // An iteration that failed once the deadline had passed failed for it (its steps
            // inherit the deadline and are stopped at it): the run ended at its deadline, and
            // the remedy to give is to raise that.
            let elapsed = Duration::from_millis(view.now.saturating_sub(self.spec.started_at));
            let stop =
                if stop == Stop::IterationFailed && elapsed >= self.spec.deadline { Stop::Deadline } else { stop };
            self.over = Some(stop);
            return Next::Stop(stop);
        }
        let stop = self.check(view);
        if let Some(stop) = stop {
            self.over = Some(stop);
            return Next::Stop(stop);
        }
        let job = match &self.spec.job {
            Some(id) if self.iteration == 0 => view.jobs.iter().find(|j| &j.id == id),
            _ => fleet::next_job(view.jobs),
        };
        if job.is_none() && self.spec.fleet.r#loop.done_when == DoneWhen::QueueEmpty {
            self.over = Some(Stop::QueueDrained);
            return Next::Stop(Stop::QueueDrained);
        }
        let text = job.map_or_else(|| self.spec.fleet.goal.clone(), |j| j.text.clone());
        let elapsed = Duration::from_millis(view.now.saturating_sub(self.spec.started_at));
        let time_left = fleet::inherited_deadline(self.spec.deadline, elapsed);
        let iteration_run_id = if self.spec.looping {
            fleet::iteration_run_id(&self.spec.run_id, self.iteration)
        } else {
            self.spec.run_id.clone()
        };
        let job = job.map(|j| j.id.clone());
        if self.spec.fleet.plan_kind() == PlanKind::Procedure {
            return Next::Procedure { iteration: self.iteration, iteration_run_id, job, work: text };
        }
        if let (PlanKind::Router, Some(router)) = (self.spec.fleet.plan_kind(), self.spec.fleet.router.clone()) {
            let plan = plan_text(&self.spec.fleet.members, &text);
            self.planning = Some((iteration_run_id.clone(), job.clone(), text, time_left));
            return Next::Plan { iteration: self.iteration, iteration_run_id, job, router, text: plan, time_left };
        }
        let steps = match crate::fleet::plan::track_steps(&self.spec.fleet, &text) {
            Some(tracks) => tracks.into_iter().map(|(member, text)| Step { member, text, time_left }).collect(),
            None => self.steps(&text, time_left),
        };
        Next::Iterate { iteration: self.iteration, iteration_run_id, job, steps }
    }

    fn steps(&self, text: &str, time_left: Duration) -> Vec<Step> {
        self.spec.fleet.members.iter().map(|m| Step { member: m.clone(), text: text.to_string(), time_left }).collect()
    }

    /// The router's plan for the iteration [`Next::Plan`] asked for (`Err` when the
    /// router's task failed: the run ends `iteration-failed`): every member gets the work
    /// followed by the router's assignment, each of its lines as a `# ` line under a
    /// `# The router's assignment:` heading — plain reading for a model, and comments for
    /// a member that runs its work as a shell script (the builder example).
    pub fn planned(&mut self, plan: Result<&str, &str>) -> Next {
        let Some((iteration_run_id, job, text, time_left)) = self.planning.take() else {
            return Next::Stop(self.over.unwrap_or(Stop::IterationFailed));
        };
        match plan {
            Ok(plan) => {
                let assignment: Vec<String> =
                    plan.trim().lines().map(|l| format!("# {l}").trim_end().to_string()).collect();
                let with_plan = format!("{text}\n\n# The router's assignment:\n{}", assignment.join("\n"));
                let steps = self.steps(&with_plan, time_left);
                Next::Iterate { iteration: self.iteration, iteration_run_id, job, steps }
            }
            Err(_) => {
                self.over = Some(Stop::IterationFailed);
                Next::Stop(Stop::IterationFailed)
            }
        }
    }

    /// The router's verdict on the iteration just ended ([`Iteration::judge`]): DONE
    /// converges the loop; anything else goes on.
    pub fn judged(&mut self, reply: &str) -> Option<Stop> {
        if fleet::router_says_done(reply) {
            self.over = Some(Stop::Converged);
        }
        self.over
    }

    fn check(&self, view: &View<'_>) -> Option<Stop> {
        if !matches!(view.stopped, Ok(false)) {
            return Some(Stop::Stopped);
        }
        let since = view.last_agent_event.unwrap_or(self.spec.started_at).max(self.spec.started_at);
        fleet::check_guards(GuardInput {
            elapsed: Duration::from_millis(view.now.saturating_sub(self.spec.started_at)),
            deadline: self.spec.deadline,
            stuck: self.spec.stuck,
            since_progress: Duration::from_millis(view.now.saturating_sub(since)),
            iteration: self.iteration,
        })
        .or_else(|| self.unaffordable().then_some(Stop::Budget))
    }

    /// Whether the next iteration cannot be afforded (ref §3 step 4): spent + projected >
    /// budget, checked before the iteration, only when a budget applies.
    fn unaffordable(&self) -> bool {
        self.spec.budget_usd.is_some_and(|budget| {
            let projected = cost::projected_next(
                self.iteration,
                self.spent_usd,
                self.spec.fleet.members.len(),
                self.spec.guard_rate,
            );
            cost::unaffordable(self.spent_usd, projected, budget)
        })
    }

    /// How the procedure of the iteration just run ended ([`Next::Procedure`]): a failure
    /// ends the run `iteration-failed` (the job fails), a step awaiting approval ends it
    /// `awaiting-approval` (the job is blocked: `job_done` is false and `stop` says which),
    /// otherwise the job is done with `result` and the run goes on as after
    /// [`Run::iteration_ended`] (`outputs`: the completed steps' outputs, where a `marker:`
    /// line is looked for). The router is never asked.
    pub fn procedure_ended(
        &mut self,
        outcome: crate::fleet::plan::Outcome,
        result: String,
        outputs: &[String],
    ) -> Iteration {
        use crate::fleet::plan::Outcome;
        self.iteration += 1;
        let marker = match &self.spec.fleet.r#loop.done_when {
            DoneWhen::Marker(m) => outputs.iter().any(|o| fleet::marker_matches(o, m)),
            _ => false,
        };
        let stop = match outcome {
            Outcome::Failed => Some(Stop::IterationFailed),
            Outcome::Blocked => Some(Stop::AwaitingApproval),
            Outcome::Done if marker || !self.spec.looping => Some(Stop::Converged),
            Outcome::Done => None,
        };
        self.over = stop;
        Iteration { judge: None, job_done: outcome == Outcome::Done, result, stop }
    }

    /// The replies of the iteration just run (in member order): the job's outcome, and
    /// whether the run ends — a single run after its one iteration (completed when every
    /// step ended ok), a loop when a `marker:` line came back (converged) or a step failed.
    pub fn iteration_ended(&mut self, replies: &[Reply]) -> Iteration {
        self.iteration += 1;
        let job_done = !replies.is_empty() && replies.iter().all(|r| r.ok);
        let result = if replies.len() == 1 {
            replies[0].text.clone()
        } else {
            replies.iter().map(|r| format!("[{}]\n{}", r.member, r.text)).collect::<Vec<_>>().join("\n\n")
        };
        let marker = match &self.spec.fleet.r#loop.done_when {
            DoneWhen::Marker(m) => replies.iter().any(|r| fleet::marker_matches(&r.text, m)),
            _ => false,
        };
        let stop = if !job_done {
            Some(Stop::IterationFailed)
        } else if marker || !self.spec.looping {
            Some(Stop::Converged)
        } else {
            None
        };
        self.over = stop;
        let judge = match (&self.spec.fleet.router, &self.spec.fleet.r#loop.done_when, stop) {
            (Some(router), DoneWhen::Router, None) if self.spec.fleet.plan_kind() == PlanKind::Router => {
                Some((router.clone(), judge_text(&self.spec.fleet.goal, &result)))
            }
            _ => None,
        };
        Iteration { judge, job_done, result, stop }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mur_proto::fleet::JobStatus;

    fn fleet(yaml: &str) -> Fleet {
        Fleet::parse(yaml).unwrap()
    }

    fn spec(f: Fleet, looping: bool) -> Spec {
        Spec {
            run_id: "run1".into(),
            fleet: f,
            looping,
            job: None,
            deadline: Duration::from_secs(60),
            stuck: Some(Duration::from_secs(30)),
            started_at: 1_000_000,
            budget_usd: None,
            guard_rate: 0.0,
        }
    }

    fn job(id: &str, text: &str, status: JobStatus) -> Job {
        let mut j = Job::new(text, "cli", 0);
        j.id = id.to_string();
        j.status = status;
        j
    }

    fn view(now: u64, jobs: &[Job]) -> View<'_> {
        View { now, stopped: Ok(false), jobs, last_agent_event: None }
    }

    const TWO: &str = "name: pair\ngoal: keep the build green\nmembers: [a, b]\n";

    #[test]
    fn a_loop_with_nobody_to_judge_done_is_refused_and_a_one_shot_run_is_not() {
        let err = Run::check_convergence(&spec(fleet(TWO), true)).unwrap_err();
        assert_eq!(
            err.to_string(),
            "fleet 'pair': done_when is empty (the router judges DONE) but the fleet has no router: set it with \
             `mur fleet set-loop pair --done-when queue-empty` (or marker:TEXT), or give the fleet a router"
        );
        assert_eq!(Run::check_convergence(&spec(fleet(TWO), false)), Ok(()));
        let drained = format!("{TWO}loop:\n  done_when: queue-empty\n");
        assert_eq!(Run::check_convergence(&spec(fleet(&drained), true)), Ok(()));
        let routed = format!("{TWO}router: planner\n");
        assert_eq!(Run::check_convergence(&spec(fleet(&routed), true)), Ok(()));
    }

    #[test]
    fn a_stopped_or_unreadable_sentinel_refuses_the_run() {
        let jobs = [];
        let mut v = view(1_000_000, &jobs);
        v.stopped = Ok(true);
        let err = Run::start(spec(fleet(TWO), false), &v).unwrap_err();
        assert_eq!(err.to_string(), "fleet 'pair' is stopped (`mur fleet start pair` clears it)");
        v.stopped = Err("corrupt".into());
        assert_eq!(Run::start(spec(fleet(TWO), false), &v).unwrap_err(), Refused::Stopped("pair".into()));
    }

    #[test]
    fn every_member_gets_the_oldest_queued_job_with_the_time_left() {
        let jobs = [job("01b", "second", JobStatus::Queued), job("01a", "first", JobStatus::Queued)];
        let mut run = Run::start(spec(fleet(TWO), true), &view(1_000_000, &jobs)).unwrap();
        let next = run.next(&view(1_010_000, &jobs));
        assert_eq!(
            next,
            Next::Iterate {
                iteration: 0,
                iteration_run_id: "run1-0".into(),
                job: Some("01a".into()),
                steps: vec![
                    Step { member: "a".into(), text: "first".into(), time_left: Duration::from_secs(50) },
                    Step { member: "b".into(), text: "first".into(), time_left: Duration::from_secs(50) },
                ],
            }
        );
    }

    #[test]
    fn without_a_queued_job_the_standing_goal_is_the_work_and_a_single_run_ends_after_one_iteration() {
        let mut run = Run::start(spec(fleet(TWO), false), &view(1_000_000, &[])).unwrap();
        let Next::Iterate { job, steps, iteration_run_id, .. } = run.next(&view(1_000_000, &[])) else { panic!() };
        assert_eq!((job, iteration_run_id.as_str(), steps[0].text.as_str()), (None, "run1", "keep the build green"));
        let it = run.iteration_ended(&[
            Reply { member: "a".into(), ok: true, text: "A".into() },
            Reply { member: "b".into(), ok: true, text: "B".into() },
        ]);
        assert_eq!(
            it,
            Iteration { judge: None, job_done: true, result: "[a]\nA\n\n[b]\nB".into(), stop: Some(Stop::Converged) }
        );
        assert_eq!(run.next(&view(1_000_000, &[])), Next::Stop(Stop::Converged));
    }

    #[test]
    fn queue_empty_ends_the_loop_before_any_step_when_nothing_is_queued() {
        let f = fleet("name: q\nmembers: [a]\nloop:\n  done_when: queue-empty\n");
        let jobs = [job("01a", "only", JobStatus::Queued)];
        let mut run = Run::start(spec(f, true), &view(1_000_000, &jobs)).unwrap();
        assert!(matches!(run.next(&view(1_000_000, &jobs)), Next::Iterate { .. }));
        assert_eq!(run.iteration_ended(&[Reply { member: "a".into(), ok: true, text: "ok".into() }]).stop, None);
        let done = [job("01a", "only", JobStatus::Done)];
        assert_eq!(run.next(&view(1_001_000, &done)), Next::Stop(Stop::QueueDrained));
    }

    #[test]
    fn a_marker_alone_on_a_line_converges_a_loop_and_prose_mentioning_it_does_not() {
        let f = fleet("name: m\nmembers: [a]\nloop:\n  done_when: \"marker:ALL GREEN\"\n");
        let mut run = Run::start(spec(f, true), &view(1_000_000, &[])).unwrap();
        run.next(&view(1_000_000, &[]));
        let prose = Reply { member: "a".into(), ok: true, text: "not ALL GREEN yet".into() };
        assert_eq!(run.iteration_ended(&[prose]).stop, None);
        run.next(&view(1_000_000, &[]));
        let marker = Reply { member: "a".into(), ok: true, text: "tests pass\n  ALL GREEN  \n".into() };
        assert_eq!(run.iteration_ended(&[marker]).stop, Some(Stop::Converged));
    }

    #[test]
    fn the_deadline_then_stuck_are_checked_between_iterations_and_stuck_never_before_the_first() {
        let mut run = Run::start(spec(fleet(TWO), true), &view(1_000_000, &[])).unwrap();
        // 40 s without progress, but no iteration yet: stuck cannot fire.
        assert!(matches!(run.next(&view(1_040_000, &[])), Next::Iterate { .. }));
        run.iteration_ended(&[
            Reply { member: "a".into(), ok: true, text: "x".into() },
            Reply { member: "b".into(), ok: true, text: "y".into() },
        ]);
        let mut v = view(1_040_000, &[]);
        v.last_agent_event = Some(1_005_000);
        assert_eq!(run.next(&v), Next::Stop(Stop::Stuck));
        let mut late = Run::start(spec(fleet(TWO), true), &view(1_000_000, &[])).unwrap();
        assert_eq!(late.next(&view(1_060_000, &[])), Next::Stop(Stop::Deadline));
    }

    #[test]
    fn a_stop_written_during_a_loop_ends_it_before_the_next_iteration() {
        let mut run = Run::start(spec(fleet(TWO), true), &view(1_000_000, &[])).unwrap();
        run.next(&view(1_000_000, &[]));
        run.iteration_ended(&[
            Reply { member: "a".into(), ok: true, text: "x".into() },
            Reply { member: "b".into(), ok: true, text: "y".into() },
        ]);
        let mut v = view(1_001_000, &[]);
        v.stopped = Err("unreadable".into());
        assert_eq!(run.next(&v), Next::Stop(Stop::Stopped));
    }

    #[test]
    fn a_failed_step_fails_the_job_and_ends_the_run() {
        let mut run = Run::start(spec(fleet("name: one\nmembers: [a]\n"), true), &view(1_000_000, &[])).unwrap();
        run.next(&view(1_000_000, &[]));
        let it = run.iteration_ended(&[Reply { member: "a".into(), ok: false, text: "error: boom".into() }]);
        assert_eq!(
            it,
            Iteration { judge: None, job_done: false, result: "error: boom".into(), stop: Some(Stop::IterationFailed) }
        );
        assert_eq!(run.next(&view(1_030_000, &[])), Next::Stop(Stop::IterationFailed));
    }

    #[test]
    fn an_iteration_that_failed_past_the_deadline_ends_the_run_at_its_deadline() {
        let mut run = Run::start(spec(fleet("name: one\nmembers: [a]\n"), true), &view(1_000_000, &[])).unwrap();
        run.next(&view(1_000_000, &[]));
        let it = run.iteration_ended(&[Reply { member: "a".into(), ok: false, text: "error: deadline".into() }]);
        assert_eq!(it.stop, Some(Stop::IterationFailed));
        // The spec's deadline is 60 s from 1_000_000.
        assert_eq!(run.next(&view(1_060_000, &[])), Next::Stop(Stop::Deadline));
        assert_eq!(run.next(&view(1_000_000, &[])), Next::Stop(Stop::Deadline), "decided once");
    }

    #[test]
    fn a_router_plans_each_iteration_and_judges_done_when_done_when_is_empty() {
        let f = fleet("name: r\ngoal: ship it\nmembers: [a, b]\nrouter: planner\n");
        let mut run = Run::start(spec(f, true), &view(1_000_000, &[])).unwrap();
        let Next::Plan { router, text, job, .. } = run.next(&view(1_000_000, &[])) else { panic!("a plan first") };
        assert_eq!((router.as_str(), job), ("planner", None));
        assert_eq!(
            text,
            "Plan this work for the fleet's members (a, b): say what each of them should do.\n\nWork:\nship it"
        );
        let Next::Iterate { steps, .. } = run.planned(Ok("a: build\nb: test\n")) else { panic!("then the steps") };
        assert_eq!(steps[0].text, "ship it\n\n# The router's assignment:\n# a: build\n# b: test");
        assert_eq!(steps.len(), 2);
        let it = run.iteration_ended(&[
            Reply { member: "a".into(), ok: true, text: "built".into() },
            Reply { member: "b".into(), ok: true, text: "tested".into() },
        ]);
        let (judge, prompt) = it.judge.expect("the router judges");
        assert_eq!(judge, "planner");
        assert!(prompt.starts_with("Is this work DONE, or should the fleet CONTINUE?"), "{prompt}");
        assert_eq!(run.judged("CONTINUE: b must rerun"), None);
        assert!(matches!(run.next(&view(1_001_000, &[])), Next::Plan { iteration: 1, .. }));
        run.planned(Ok("again"));
        run.iteration_ended(&[
            Reply { member: "a".into(), ok: true, text: "x".into() },
            Reply { member: "b".into(), ok: true, text: "y".into() },
        ]);
        assert_eq!(run.judged("DONE"), Some(Stop::Converged));
        assert_eq!(run.next(&view(1_002_000, &[])), Next::Stop(Stop::Converged));
    }

    const PROC: &str = "name: p\ngoal: g\nmembers: [a, b]\nrouter: planner\nprocedure:\n  - id: one\n    member: a\n  - id: two\n    member: b\n    depends_on: [one]\n";

    #[test]
    fn a_procedure_is_used_instead_of_the_router_and_a_cycle_refuses_the_run() {
        let mut run = Run::start(spec(fleet(PROC), true), &view(1_000_000, &[])).unwrap();
        assert_eq!(
            run.next(&view(1_000_000, &[])),
            Next::Procedure { iteration: 0, iteration_run_id: "run1-0".into(), job: None, work: "g".into() }
        );
        let it = run.procedure_ended(crate::fleet::plan::Outcome::Done, "[one]\nx".into(), &["x".into()]);
        assert_eq!(it, Iteration { judge: None, job_done: true, result: "[one]\nx".into(), stop: None });
        let cyclic = PROC.replace("    member: a\n", "    member: a\n    depends_on: [two]\n");
        assert_eq!(
            Run::start(spec(fleet(&cyclic), false), &view(1_000_000, &[])).unwrap_err().to_string(),
            "fleet 'p': procedure: dependency cycle among steps \"one\", \"two\""
        );
    }

    #[test]
    fn a_blocked_procedure_stops_awaiting_approval_and_an_answered_job_is_taken_first() {
        let mut answered = job("01b", "parked", JobStatus::Blocked);
        answered.approval = Some(fleet::Approval {
            steps: vec!["one".into()],
            decision: Some(fleet::Decision::Approved),
            by: None,
            at: None,
        });
        let waiting = job("01c", "still parked", JobStatus::Blocked);
        let jobs = [job("01a", "older but queued", JobStatus::Queued), answered, waiting];
        let mut run = Run::start(spec(fleet(PROC), true), &view(1_000_000, &jobs)).unwrap();
        let Next::Procedure { job, work, .. } = run.next(&view(1_000_000, &jobs)) else { panic!("a procedure") };
        assert_eq!((job.as_deref(), work.as_str()), (Some("01b"), "parked"));
        let it = run.procedure_ended(crate::fleet::plan::Outcome::Blocked, "[one] awaits approval".into(), &[]);
        assert_eq!((it.job_done, it.stop), (false, Some(Stop::AwaitingApproval)));
        assert_eq!(run.next(&view(1_000_000, &jobs)), Next::Stop(Stop::AwaitingApproval));
        let mut s = spec(fleet(PROC), false);
        s.job = Some("01c".into());
        assert_eq!(Run::start(s, &view(1_000_000, &jobs)).unwrap_err(), Refused::NoSuchJob("01c".into()));
    }

    #[test]
    fn a_named_job_must_be_queued() {
        let jobs = [job("01a", "x", JobStatus::Done)];
        let mut s = spec(fleet(TWO), false);
        s.job = Some("01a".into());
        assert_eq!(Run::start(s, &view(1_000_000, &jobs)).unwrap_err(), Refused::NoSuchJob("01a".into()));
    }
    #[test]
    fn a_budget_stops_the_run_before_the_iteration_it_cannot_afford() {
        // Two members at $2 per 1,000 output tokens: the first iteration is projected at
        // 2 × 3.5 M × 2 / 1000 = $14,000.
        let mut s = spec(fleet(TWO), true);
        s.guard_rate = 2.0;
        s.budget_usd = Some(13_999.0);
        let mut poor = Run::start(s.clone(), &view(1_000_000, &[])).unwrap();
        assert_eq!(poor.next(&view(1_000_000, &[])), Next::Stop(Stop::Budget));
        s.budget_usd = Some(20_000.0);
        let mut run = Run::start(s, &view(1_000_000, &[])).unwrap();
        let ok = |m: &str| Reply { member: m.into(), ok: true, text: "x".into() };
        assert!(matches!(run.next(&view(1_000_000, &[])), Next::Iterate { .. }));
        run.iteration_ended(&[ok("a"), ok("b")]);
        run.spent(9_000.0, true);
        assert!(matches!(run.next(&view(1_000_000, &[])), Next::Iterate { iteration: 1, .. }));
        run.iteration_ended(&[ok("a"), ok("b")]);
        run.spent(9_000.0, true);
        // $18,000 spent, $9,000 projected: over $20,000.
        assert_eq!(run.next(&view(1_000_000, &[])), Next::Stop(Stop::Budget));
        assert_eq!(run.spent_usd(), 18_000.0);
    }

    #[test]
    fn an_iteration_that_reported_no_tokens_is_charged_the_projection() {
        let mut s = spec(fleet(TWO), true);
        s.guard_rate = 1.0;
        s.budget_usd = Some(100_000.0);
        let mut run = Run::start(s, &view(1_000_000, &[])).unwrap();
        run.spent(0.0, false);
        assert_eq!(run.spent_usd(), 7_000.0);
        let mut resumed = Run::resume(spec(fleet(TWO), true), 3, 1.5);
        resumed.spent(0.0, false);
        assert_eq!(resumed.spent_usd(), 1.5, "no budget: nothing is projected");
        assert!(matches!(resumed.next(&view(1_000_000, &[])), Next::Iterate { iteration: 3, .. }));
    }
}
