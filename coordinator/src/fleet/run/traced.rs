//! The spans of a fleet run (issue #32 §Fleet runs traced): one trace per loop iteration,
//! or per one-shot run.
//!
//! - `iteration <fleet>` (internal) is the iteration's span, with `mur.fleet`,
//!   `mur.run_id`, `mur.iteration_run_id` and `mur.job_id`. Its parent is the job's
//!   `traceparent` (the `mur fleet send` that queued it), else, for a one-shot run, the
//!   run's (the `mur fleet run` that started it); otherwise it is the root of its own trace.
//!   A loop's iterations each start a trace and link to the run's request. A job that ends
//!   `failed` or `canceled` marks it `ERROR` with `error.type` = the job's status.
//! - `plan <router>`, `judge <router>` and `delegate <member>` (internal) are its children,
//!   one per delegated task, lasting from its submission to its terminal record, with
//!   `gen_ai.agent.name`, `mur.task_id` and, in a procedure, `mur.step_id` and
//!   `mur.attempt`. The submission goes out in the step's span, so the task's own trace
//!   (coordinator, worker) joins it through the `traceparent` header. A task that does not
//!   complete marks it `ERROR` with `error.type` = its exit status (`failed`, `canceled`,
//!   …; `refused` when the API refused it, `deadline` when it outlived the loop).
//!
//! Without an OpenTelemetry layer (no OTLP endpoint) these spans are disabled and cost
//! nothing.

use super::Exec;
use mur_proto::cluster::ApiError;
use mur_proto::fleet::Job;
use mur_proto::fleet_store::RunRecord;
use opentelemetry::trace::TraceContextExt as _;
use std::time::Duration;
use tracing::Instrument as _;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;

/// What a delegated task is to its iteration; the first word of its span's name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum StepKind {
    /// The router's plan.
    Plan,
    /// The router's DONE judgment.
    Judge,
    /// A member's step.
    Delegate,
}

impl StepKind {
    fn verb(self) -> &'static str {
        match self {
            StepKind::Plan => "plan",
            StepKind::Judge => "judge",
            StepKind::Delegate => "delegate",
        }
    }
}

/// The `iteration <fleet>` span of `iteration_run_id` of the run `record` (a loop's when
/// `looping`), working on `job` if any; parented and linked as the module says.
pub(super) fn iteration_span(
    record: &RunRecord,
    looping: bool,
    iteration_run_id: &str,
    job: Option<&Job>,
) -> tracing::Span {
    let span = tracing::info_span!(
        parent: None,
        "fleet_iteration",
        otel.name = %format!("iteration {}", record.fleet),
        otel.kind = "internal",
        mur.fleet = %record.fleet,
        mur.run_id = %record.run_id,
        mur.iteration_run_id = iteration_run_id,
        mur.job_id = tracing::field::Empty,
        otel.status_code = tracing::field::Empty,
        error.type = tracing::field::Empty,
    );
    if let Some(job) = job {
        span.record("mur.job_id", job.id.as_str());
    }
    let request = record.traceparent.as_deref().and_then(mur_nats::trace_context::from_traceparent);
    let queued = job.and_then(|j| j.traceparent.as_deref()).and_then(mur_nats::trace_context::from_traceparent);
    let (parent, link) = match (queued, looping) {
        (Some(queued), _) => (Some(queued), request),
        (None, false) => (request, None),
        (None, true) => (None, request),
    };
    mur_nats::trace_context::set_parent(&span, parent);
    if let Some(cx) = link {
        span.add_link(cx.span().span_context().clone());
    }
    span
}

/// Marks `span` (an iteration's or a step's) `ERROR` with `error.type` = `kind`.
pub(super) fn mark_error(span: &tracing::Span, kind: &str) {
    span.record("otel.status_code", "ERROR");
    span.record("error.type", kind);
}

impl Exec {
    /// Starts the span of `iteration_run_id` (ending the one before, if still open).
    pub(super) fn begin_iteration(&mut self, iteration_run_id: &str, job: Option<&Job>) {
        self.iteration = iteration_span(&self.record, self.looping, iteration_run_id, job);
    }

    /// Ends the current iteration's span; `error` marks it `ERROR` with that `error.type`.
    pub(super) fn end_iteration(&mut self, error: Option<&str>) {
        if let Some(kind) = error {
            mark_error(&self.iteration, kind);
        }
        self.iteration = tracing::Span::none();
    }

    /// A `plan`/`judge`/`delegate <member>` span under the current iteration's.
    pub(super) fn step_span(&self, kind: StepKind, member: &str) -> tracing::Span {
        tracing::info_span!(
            parent: &self.iteration,
            "fleet_step",
            otel.name = %format!("{} {member}", kind.verb()),
            otel.kind = "internal",
            gen_ai.agent.name = member,
            mur.fleet = %self.record.fleet,
            mur.task_id = tracing::field::Empty,
            mur.step_id = tracing::field::Empty,
            mur.attempt = tracing::field::Empty,
            otel.status_code = tracing::field::Empty,
            error.type = tracing::field::Empty,
        )
    }

    /// Submits a task for `member` and waits for its end ([`Exec::submit`], [`Exec::wait`])
    /// in `span`: `(completed, result text)`.
    ///
    /// # Errors
    /// The API's refusal of the task (`span` then says `refused`).
    pub(super) async fn delegate(
        &self,
        span: tracing::Span,
        member: &str,
        text: &str,
        deadline_at: u64,
        time_left: Duration,
    ) -> Result<(bool, String), ApiError> {
        let step = span.clone();
        async move {
            let task_id = match self.submit(member, text, deadline_at).await {
                Ok(id) => id,
                Err(e) => {
                    mark_error(&step, "refused");
                    return Err(e);
                }
            };
            step.record("mur.task_id", task_id.as_str());
            Ok(self.wait(&task_id, time_left).await)
        }
        .instrument(span)
        .await
    }
}
