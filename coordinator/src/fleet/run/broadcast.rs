//! Sending the steps of a broadcast or router-planned iteration (issue #10 §Runs and
//! loops; the fleet-loops seed, §The bounds, fan-out bound): each step is a `delegation`
//! event, a `peer` task with the loop's time left at the moment it is sent, and the
//! member's `reply` event; at most the fan-out cap are in flight at once
//! ([`fleet::resolve_fanout`]: the fleet's `fanout:`, else `MUR_FLEET_FANOUT`, else 3), and
//! the replies come back in step order.

use super::{Exec, StepKind, ms_after};
use crate::fleet::machine::{Reply, Spec, Step};
use futures::StreamExt;
use mur_nats::clock::{Clock, SystemClock};
use mur_proto::fleet;
use mur_proto::fleet_store::{Author, EventKind};
use std::time::Duration;

impl Exec {
    /// Sends `steps`, at most the fan-out cap at once; their replies in step order.
    pub(super) async fn send_steps(
        &self,
        spec: &Spec,
        steps: &[Step],
        iteration_run_id: &str,
        job: Option<&str>,
    ) -> Vec<Reply> {
        let fanout = fleet::resolve_fanout(spec.fleet.fanout, &|k| std::env::var(k).ok());
        let sends: Vec<_> = steps.iter().map(|step| self.send_step(spec, step, iteration_run_id, job)).collect();
        futures::stream::iter(sends).buffered(fanout.for_steps(steps.len())).collect().await
    }

    async fn send_step(&self, spec: &Spec, step: &Step, iteration_run_id: &str, job: Option<&str>) -> Reply {
        if self.halt.raised() {
            // The kill-switch was set while this step waited for a fan-out slot.
            return Reply { member: step.member.clone(), ok: false, text: super::NOT_STARTED.into() };
        }
        let text = format!("{} ← {}", step.member, step.text);
        self.event(EventKind::Delegation, Author::System, text, Some(iteration_run_id), job).await;
        // The time left when it is sent, not when it was planned: a step that waited for a
        // fan-out slot does not get a longer clock.
        let elapsed = Duration::from_millis(SystemClock.now_ms().saturating_sub(spec.started_at));
        let time_left = fleet::inherited_deadline(spec.deadline, elapsed).min(step.time_left);
        let span = self.step_span(StepKind::Delegate, &step.member);
        match self.delegate(span, &step.member, &step.text, ms_after(SystemClock.now_ms(), time_left), time_left).await
        {
            Ok((ok, text)) => {
                let author = Author::Member(step.member.clone());
                self.event(EventKind::Reply, author, text.clone(), Some(iteration_run_id), job).await;
                Reply { member: step.member.clone(), ok, text }
            }
            Err(e) => {
                // No member replied: the refusal, with its reason, is the system's note (as
                // a procedure step's is), so it counts as no member's progress.
                tracing::warn!(fleet = %spec.fleet.name, member = %step.member, "delegation refused: {e}");
                let note = format!("the delegation to {} was refused: {e}", step.member);
                self.event(EventKind::Note, Author::System, note, Some(iteration_run_id), job).await;
                Reply {
                    member: step.member.clone(),
                    ok: false,
                    text: format!("error: the delegated task was refused: {e}"),
                }
            }
        }
    }
}
