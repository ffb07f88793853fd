//! The `procedure:` part of a fleet run (`seeds/fleet-loops.md` §A fixed step graph;
//! `reference/mur-fleet.md` §6): the IO around the pure [`crate::fleet_plan::Procedure`].
//! For one iteration it claims the job, sends each rank's steps as `peer` tasks (at most
//! the fan-out cap at once, a `retry` step again up to its `max_retries`), each with the
//! loop's time left as `deadline_at`, writes a `delegation` and a `reply` event per attempt
//! and a `note` per step approved, parked, denied or not run, then ends the job: `done` or
//! `failed` with the steps' outputs as its result, or `blocked` with the parked steps as its
//! approval request and the completed steps' outputs kept, so the run after an approval
//! continues from there.

use super::{Exec, put_record};
use crate::fleet_loop::{Run, Spec};
use crate::fleet_plan::{Launch, Outcome, Procedure};
use crate::fleets::now_ms;
use futures::StreamExt;
use mur_proto::cluster::{ApiError, ErrorCode};
use mur_proto::fleet::{self, Approval, JobStatus};
use mur_proto::fleet_store::{Author, EventKind};
use std::time::Duration;

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
                        j.claim(iteration_run_id, now_ms())
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
        let (outcome, result, outputs, parked, done) = match Procedure::new(&run.spec().fleet, work, claimed.as_ref()) {
            Ok(mut plan) => {
                let fanout = fleet::resolve_fanout(run.spec().fleet.fanout, &|k| std::env::var(k).ok());
                while let Some(rank) = plan.next_rank() {
                    for note in rank.notes {
                        self.event(EventKind::Note, Author::System, note, Some(iteration_run_id), job).await;
                    }
                    if rank.launches.is_empty() {
                        continue;
                    }
                    let cap = fanout.for_steps(rank.launches.len());
                    let spec = run.spec();
                    let ended: Vec<(String, bool, String)> = futures::stream::iter(
                        rank.launches
                            .into_iter()
                            .map(|launch| self.procedure_step(spec, launch, iteration_run_id, job)),
                    )
                    .buffer_unordered(cap)
                    .collect()
                    .await;
                    *last_agent = Some(now_ms());
                    for (id, ok, output) in ended {
                        plan.step_ended(&id, ok, output);
                    }
                }
                (plan.outcome(), plan.result(), plan.outputs(), plan.parked(), plan.done_outputs())
            }
            Err(e) => (Outcome::Failed, e, Vec::new(), Vec::new(), Default::default()),
        };
        let it = run.procedure_ended(outcome, result, &outputs);
        if let Some(id) = job {
            let status = match outcome {
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
                    j.transition(status, now_ms()).map_err(|e| ApiError::new(ErrorCode::Conflict, e.to_string()))?;
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
                let text = format!("job {id} blocked: awaiting approval of step {}", parked.join(", "));
                self.event(EventKind::StateChange, Author::System, text, Some(iteration_run_id), job).await;
            }
        }
        self.record.iterations += 1;
        self.record.updated_at = now_ms();
        if let Err(e) = put_record(&self.fleets, &self.record).await {
            tracing::warn!(fleet, "writing the run record: {e}");
        }
        true
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
            let again =
                if attempt > 1 { format!(" (attempt {attempt} of {})", launch.attempts) } else { String::new() };
            let text = format!("{} ← step {}{again}", launch.member, launch.id);
            self.event(EventKind::Delegation, Author::System, text, Some(iteration_run_id), job).await;
            let elapsed = Duration::from_millis(now_ms().saturating_sub(spec.started_at));
            let time_left = fleet::inherited_deadline(spec.deadline, elapsed);
            last = match self.submit(&launch.member, &launch.text, now_ms() + time_left.as_millis() as u64).await {
                Ok(task_id) => self.wait(&task_id, time_left).await,
                Err(e) => (false, format!("error: the delegated task was refused: {e}")),
            };
            let author = Author::Member(launch.member.clone());
            self.event(EventKind::Reply, author, last.1.clone(), Some(iteration_run_id), job).await;
            if last.0 {
                break;
            }
        }
        (launch.id, last.0, last.1)
    }
}
