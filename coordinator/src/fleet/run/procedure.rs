//! The `procedure:` part of a fleet run (the fleet-loops seed, §A fixed step graph;
//! the fleet reference, §6): the IO around the pure [`crate::fleet::plan::Procedure`].
//! For one iteration it claims the job, sends each rank's steps as `peer` tasks (at most
//! the fan-out cap at once, a `retry` step again up to its `max_retries`), each with the
//! loop's time left as `deadline_at`, writes a `delegation` and a `reply` event per attempt
//! and a `note` per step approved, parked, denied or not run, then ends the job: `done` or
//! `failed` with the steps' outputs as its result, or `blocked` with the parked steps as its
//! approval request and the completed steps' outputs kept, so the run after an approval
//! continues from there. With `hitl.mode: wait` it parks the request on the job and waits
//! for the answer (until the loop's deadline) before the next rank.

use super::{Exec, StepKind, ms_after, put_record};
use crate::fleet::machine::{Run, Spec};
use crate::fleet::plan::{Launch, Outcome, Procedure, Rank};
use futures::StreamExt;
use mur_nats::clock::{Clock, SystemClock};
use mur_proto::cluster::{ApiError, ErrorCode};
use mur_proto::fleet::{self, Approval, Decision, Job, JobStatus};
use mur_proto::fleet_store::{Author, EventKind};
use std::time::Duration;

/// How often a run waiting for an approval (`hitl.mode: wait`) reads the job.
const ANSWER_POLL: Duration = Duration::from_millis(250);

impl Exec {
    /// Runs one iteration by the fleet's procedure; false when `job` could not be claimed
    /// (canceled meanwhile: the next iteration picks again).
    pub(super) async fn run_procedure(
        &mut self,
        run: &mut Run,
        iteration_run_id: &str,
        job: Option<&str>,
        work: &str,
        last_agent: &mut Option<u64>,
    ) -> bool {
        let fleet = self.record.fleet.clone();
        let claimed = match job {
            Some(id) => {
                let claimed = self
                    .fleets
                    .update_job(&fleet, id, |j| {
                        j.claim(iteration_run_id, SystemClock.now_ms())
                            .map_err(|e| ApiError::new(ErrorCode::Conflict, e.to_string()))
                    })
                    .await;
                match claimed {
                    Ok(j) => Some(j),
                    Err(e) => {
                        tracing::info!(fleet, job = id, "job not claimed: {e}");
                        return false;
                    }
                }
            }
            None => None,
        };
        self.begin_iteration(iteration_run_id, claimed.as_ref());
        // The standing goal has no job to park a request on: one is made for it, and
        // stored only if a step is parked (its id is the one the notes name).
        let goal_job = claimed.is_none().then(|| Job::new(work, fleet::SOURCE_GOAL, SystemClock.now_ms()));
        // Whether the kill-switch kept a rank from starting.
        let mut cut = false;
        let (outcome, result, outputs, parked, done) =
            match Procedure::new(&run.spec().fleet, work, claimed.as_ref().or(goal_job.as_ref())) {
                Ok(mut plan) => {
                    let spec = run.spec();
                    while let Some(rank) = plan.next_rank() {
                        if self.halt.raised() {
                            cut = true;
                            break;
                        }
                        self.run_rank(spec, &mut plan, rank, iteration_run_id, job, last_agent).await;
                        if let (true, Some(id)) = (plan.waits(), job)
                            && let Some((decision, by)) = self.await_answer(spec, &plan, id, iteration_run_id).await
                        {
                            let now = plan.answered(decision, &by);
                            self.run_rank(spec, &mut plan, now, iteration_run_id, job, last_agent).await;
                        }
                    }
                    (plan.outcome(), plan.result(), plan.outputs(), plan.parked(), plan.done_outputs())
                }
                Err(e) => (Outcome::Failed, e, Vec::new(), Vec::new(), Default::default()),
            };
        let it = run.procedure_ended(outcome, result, &outputs);
        if let (Outcome::Blocked, Some(mut parked_goal)) = (outcome, goal_job) {
            let stored = parked_goal
                .claim(iteration_run_id, SystemClock.now_ms())
                .and_then(|()| parked_goal.transition(JobStatus::Blocked, SystemClock.now_ms()))
                .map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()));
            parked_goal.result = Some(it.result.clone());
            parked_goal.steps_done = done.clone();
            parked_goal.approval = Some(Approval { steps: parked.clone(), decision: None, by: None, at: None });
            match stored {
                Ok(()) => match self.fleets.create_job(&fleet, &parked_goal).await {
                    Ok(()) => {
                        let text = format!(
                            "job {} blocked: awaiting approval of step {} (the standing goal)",
                            parked_goal.id,
                            parked.join(", ")
                        );
                        self.blocked_job = Some(parked_goal.id.clone());
                        self.event(
                            EventKind::StateChange,
                            Author::System,
                            text,
                            Some(iteration_run_id),
                            Some(&parked_goal.id),
                        )
                        .await;
                    }
                    Err(e) => tracing::warn!(fleet, "storing the parked goal's job: {e}"),
                },
                Err(e) => tracing::warn!(fleet, "parking the goal: {e}"),
            }
        }
        if let Some(id) = job {
            // Stopped before it got done (a rank kept from starting, or a step canceled):
            // neither done nor failed.
            let stopped_short = cut || (self.halt.raised() && outcome == Outcome::Failed);
            let status = match outcome {
                Outcome::Done | Outcome::Failed if stopped_short => JobStatus::Canceled,
                Outcome::Done => JobStatus::Done,
                Outcome::Failed => JobStatus::Failed,
                Outcome::Blocked => JobStatus::Blocked,
            };
            let ended = self
                .fleets
                .update_job(&fleet, id, |j| {
                    if j.status.is_terminal() {
                        return Ok(()); // canceled meanwhile: leave it
                    }
                    if j.status != status {
                        j.transition(status, SystemClock.now_ms())
                            .map_err(|e| ApiError::new(ErrorCode::Conflict, e.to_string()))?;
                    }
                    j.result = Some(it.result.clone());
                    j.steps_done = done.clone();
                    if status == JobStatus::Blocked {
                        j.approval = Some(Approval { steps: parked.clone(), decision: None, by: None, at: None });
                    }
                    Ok(())
                })
                .await;
            if let Err(e) = ended {
                tracing::warn!(fleet, job = %id, "ending the job: {e}");
            }
            if status == JobStatus::Blocked {
                self.blocked_job = Some(id.to_string());
                let text = format!("job {id} blocked: awaiting approval of step {}", parked.join(", "));
                self.event(EventKind::StateChange, Author::System, text, Some(iteration_run_id), job).await;
            }
        }
        self.account(run, iteration_run_id, job).await;
        self.end_iteration(match outcome {
            Outcome::Failed if cut || self.halt.raised() => Some(JobStatus::Canceled.as_str()),
            Outcome::Failed => Some(JobStatus::Failed.as_str()),
            Outcome::Done | Outcome::Blocked => None,
        });
        self.record.iterations += 1;
        self.record.updated_at = SystemClock.now_ms();
        if let Err(e) = put_record(&self.fleets, &self.record).await {
            tracing::warn!(fleet, "writing the run record: {e}");
        }
        true
    }

    /// Writes a rank's notes and sends its steps, at most the fan-out cap at once, each
    /// reported to `plan` as it ends.
    async fn run_rank(
        &self,
        spec: &Spec,
        plan: &mut Procedure,
        rank: Rank,
        iteration_run_id: &str,
        job: Option<&str>,
        last_agent: &mut Option<u64>,
    ) {
        for note in rank.notes {
            self.event(EventKind::Note, Author::System, note, Some(iteration_run_id), job).await;
        }
        if rank.launches.is_empty() {
            return;
        }
        let cap = fleet::resolve_fanout(spec.fleet.fanout, &|k| std::env::var(k).ok()).for_steps(rank.launches.len());
        let ended: Vec<(String, bool, String)> = futures::stream::iter(
            rank.launches.into_iter().map(|launch| self.procedure_step(spec, launch, iteration_run_id, job)),
        )
        .buffer_unordered(cap)
        .collect()
        .await;
        *last_agent = Some(SystemClock.now_ms());
        for (id, ok, output) in ended {
            plan.step_ended(&id, ok, output);
        }
    }

    /// `hitl.mode: wait`: parks the request on the job (`blocked`, so `mur fleet approve`
    /// / `deny` take it) and waits for the answer until the loop's deadline; the answer and
    /// who gave it, with the job `running` again. `None` when the time ran out (the job
    /// stays blocked and the run ends awaiting approval) or the job was canceled.
    async fn await_answer(
        &self,
        spec: &Spec,
        plan: &Procedure,
        job: &str,
        iteration_run_id: &str,
    ) -> Option<(Decision, String)> {
        let fleet = &self.record.fleet;
        let (parked, done) = (plan.parked(), plan.done_outputs());
        let blocked = self
            .fleets
            .update_job(fleet, job, |j| {
                if j.status != JobStatus::Blocked {
                    j.transition(JobStatus::Blocked, SystemClock.now_ms())
                        .map_err(|e| ApiError::new(ErrorCode::Conflict, e.to_string()))?;
                }
                j.approval = Some(Approval { steps: parked.clone(), decision: None, by: None, at: None });
                j.steps_done = done.clone();
                Ok(())
            })
            .await;
        if let Err(e) = blocked {
            tracing::info!(fleet, job, "not waiting for approval: {e}");
            return None;
        }
        let text = format!("job {job} blocked: waiting for approval of step {} (hitl.mode wait)", parked.join(", "));
        self.event(EventKind::StateChange, Author::System, text, Some(iteration_run_id), Some(job)).await;
        let until = ms_after(spec.started_at, spec.deadline);
        loop {
            match self.fleets.job(fleet, job).await {
                Ok(Some(j)) if j.status.is_terminal() => return None,
                _ if self.halt.raised() => return None,
                Ok(Some(j)) => {
                    if let Some(Approval { decision: Some(decision), by, .. }) = j.approval {
                        let resumed = self
                            .fleets
                            .update_job(fleet, job, |j| {
                                j.transition(JobStatus::Running, SystemClock.now_ms())
                                    .map_err(|e| ApiError::new(ErrorCode::Conflict, e.to_string()))
                            })
                            .await;
                        return resumed.ok().map(|_| (decision, by.unwrap_or_else(|| "someone".into())));
                    }
                }
                Ok(None) => return None,
                Err(e) => tracing::debug!(fleet, job, "reading the job: {e}"),
            }
            if SystemClock.now_ms() >= until {
                return None;
            }
            tokio::time::sleep(ANSWER_POLL).await;
        }
    }

    /// Sends one step up to `launch.attempts` times, stopping at the first success:
    /// `(step id, completed, last output)`.
    async fn procedure_step(
        &self,
        spec: &Spec,
        launch: Launch,
        iteration_run_id: &str,
        job: Option<&str>,
    ) -> (String, bool, String) {
        let mut last = (false, String::new());
        for attempt in 1..=launch.attempts.max(1) {
            if self.halt.raised() {
                if attempt == 1 {
                    last = (false, super::NOT_STARTED.into());
                }
                break;
            }
            let again =
                if attempt > 1 { format!(" (attempt {attempt} of {})", launch.attempts) } else { String::new() };
            let text = format!("{} ← step {}{again}", launch.member, launch.id);
            self.event(EventKind::Delegation, Author::System, text, Some(iteration_run_id), job).await;
            let elapsed = Duration::from_millis(SystemClock.now_ms().saturating_sub(spec.started_at));
            let time_left = fleet::inherited_deadline(spec.deadline, elapsed);
            let span = self.step_span(StepKind::Delegate, &launch.member);
            span.record("mur.step_id", launch.id.as_str());
            span.record("mur.attempt", attempt);
            let deadline_at = ms_after(SystemClock.now_ms(), time_left);
            match self.delegate(span, &launch.member, &launch.text, deadline_at, time_left).await {
                Ok(replied) => {
                    last = replied;
                    let author = Author::Member(launch.member.clone());
                    self.event(EventKind::Reply, author, last.1.clone(), Some(iteration_run_id), job).await;
                }
                Err(e) => {
                    // A transport error fails the step and is noted; no member replied
                    // (reference §6).
                    last = (false, format!("error: the delegated task was refused: {e}"));
                    let text = format!("step {}: the delegation to {} was refused: {e}", launch.id, launch.member);
                    self.event(EventKind::Note, Author::System, text, Some(iteration_run_id), job).await;
                }
            }
            if last.0 {
                break;
            }
        }
        (launch.id, last.0, last.1)
    }
}
