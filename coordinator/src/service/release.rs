//! Releases: the actor owning the scheduler, and each [`Output::Release`] carried out (a
//! compare-and-set to attempt 1, then the dispatch published).

use super::*;

impl Ctx {
    /// Parses a task record entry, logging a malformed one.
    pub(super) fn record_of(&self, entry: &kv::Entry) -> Option<TaskRecord> {
        if entry.operation != kv::Operation::Put {
            return None;
        }
        serde_json::from_slice(&entry.value)
            .inspect_err(|e| {
                tracing::warn!(instance = %self.instance, key = %entry.key, "skipping a malformed task record: {e}");
            })
            .ok()
    }

    /// Notes a task waiting at attempt 0 at `revision`; returns whether it was already
    /// noted (its `Submitted` input was sent).
    pub(super) fn note_waiting(&self, revision: u64, record: TaskRecord) -> bool {
        let mut waiting = self.waiting.lock().expect("waiting lock");
        let known = waiting.contains_key(&record.task_id);
        waiting.insert(record.task_id.clone(), (revision, record));
        known
    }

    /// Takes a waiting task's record out (released, or ended while waiting).
    pub(super) fn take_waiting(&self, task_id: &TaskId) -> Option<(u64, TaskRecord)> {
        self.waiting.lock().expect("waiting lock").remove(task_id)
    }

    pub(super) async fn carry_out(&self, output: Output) {
        match output {
            Output::Release { task_id, .. } => self.release(&task_id).await,
            Output::Ignored(why) => tracing::debug!(instance = %self.instance, "scheduler: {why}"),
        }
    }

    /// Releases a task: attempt 0 → 1 on its record, then its dispatch. Each step's NATS
    /// failure (a broker restart) is retried on its own ([`Ctx::retrying`]) while this
    /// coordinator holds a valid lease (after that the next leader releases the task from
    /// its record): a record written released always gets its dispatch, so a task the
    /// scheduler released is never left waiting for a coordinator restart. Releases run
    /// concurrently, so the retries hold up no other.
    pub(super) async fn release(&self, task_id: &TaskId) {
        if let Some(released) = self.retrying(task_id, || self.mark_released(task_id)).await.flatten() {
            self.dispatch_released(released).await;
        }
    }

    /// Runs `step` until it succeeds, retrying an error after a backoff of 0.1 s doubling
    /// to 2 s; `None` once this coordinator may no longer release (checked before each
    /// try).
    async fn retrying<T, F: Future<Output = Result<T, String>>>(
        &self,
        task_id: &TaskId,
        mut step: impl FnMut() -> F,
    ) -> Option<T> {
        let mut backoff = Duration::from_millis(100);
        while self.may_release(task_id) {
            match step().await {
                Ok(value) => return Some(value),
                Err(e) => {
                    tracing::warn!(instance = %self.instance, %task_id, "release failed, retrying: {e}");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                }
            }
        }
        None
    }

    /// Whether this coordinator may release tasks: it leads under a lease still valid.
    /// Fencing: a leader whose lease may have passed to another releases nothing; the next
    /// leader releases the task from its record.
    fn may_release(&self, task_id: &TaskId) -> bool {
        let valid = self.lease.as_ref().is_some_and(|l| l.is_valid());
        if !valid {
            tracing::warn!(instance = %self.instance, %task_id, "not releasing: not holding a valid lease");
        }
        valid
    }

    /// Publishes the dispatch of a task whose record is stored released (admitted at
    /// submit, released by [`Ctx::release`], or found released by another coordinator),
    /// retrying a NATS failure ([`Ctx::retrying`]). The record and its revision go along:
    /// the worker starts from them without reading the record (issue #9).
    pub(super) async fn dispatch_released(&self, released: Released) {
        let task_id = released.record.task_id.clone();
        let traceparent = released.record.traceparent.clone();
        let dispatch =
            Dispatch { task_id: task_id.clone(), attempt: released.record.attempt, released: Some(released) };
        if self.retrying(&task_id, || self.publish(&dispatch, traceparent.as_deref())).await.is_some() {
            tracing::info!(instance = %self.instance, %task_id, attempt = dispatch.attempt, "task released");
        }
    }

    /// Compare-and-sets the record from `submitted`/attempt 0 to attempt 1 and returns it
    /// with its new revision; `None` when the record moved on (cancelled meanwhile, or
    /// released by another coordinator).
    async fn mark_released(&self, task_id: &TaskId) -> Result<Option<Released>, String> {
        let mut noted = self.take_waiting(task_id);
        loop {
            let (revision, mut record) = match noted.take() {
                Some(known) => known,
                None => self.read_task(task_id).await.map_err(|e| e.to_string())?,
            };
            if record.state != TaskState::Submitted || record.attempt != 0 {
                tracing::debug!(instance = %self.instance, %task_id, state = record.state.as_str(), attempt = record.attempt, "not releasing: the record moved on");
                if record.state.is_terminal() {
                    // Ended before its release (cancelled): its slot goes back now, whether or
                    // not the watch brings the end (a repeated end is ignored).
                    let _ = self.inputs.send(Input::Ended { task_id: task_id.clone() });
                }
                return Ok(None);
            }
            record.attempt = 1;
            let value = to_json(&record).map_err(|e| e.to_string())?;
            self.releasing.lock().expect("releasing lock").insert(task_id.clone());
            let written = self.tasks.update(task_id, value, revision).await;
            if written.is_err() {
                self.releasing.lock().expect("releasing lock").remove(task_id);
            }
            match written {
                Ok(revision) => return Ok(Some(Released { revision, record })),
                Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => continue,
                Err(e) => return Err(format!("mur_tasks: update: {e}")),
            }
        }
    }

    /// Publishes a dispatch with its message id and waits for the stream's ack. Its
    /// `traceparent` header names a `send` span under the task's (issue #7 §Trace context),
    /// or is the task's own when this process exports no spans.
    pub(super) async fn publish(&self, dispatch: &Dispatch, traceparent: Option<&str>) -> Result<(), String> {
        let payload = serde_json::to_vec(dispatch).map_err(|e| e.to_string())?;
        // The span ends when the ack is in.
        let (_send, headers) = trace_context::producer(cluster::DISPATCH_SUBJECT, traceparent);
        let message = PublishMessage::build().payload(payload.into()).message_id(dispatch.msg_id()).headers(headers);
        let ack = self
            .js
            .send_publish(cluster::DISPATCH_SUBJECT, message)
            .await
            .map_err(|e| format!("{}: publish: {e}", cluster::DISPATCH_STREAM))?;
        ack.await.map_err(|e| format!("{}: publish ack: {e}", cluster::DISPATCH_STREAM))?;
        Ok(())
    }
}

/// The one owner of the scheduler. Inputs are applied one at a time, in order; the
/// releases they produce are carried out concurrently, so that one release's round trips
/// (compare-and-set, publish and its ack) hold up neither the next input nor the next
/// release. Every release was decided by the scheduler, which already counted its slot,
/// so their order of completion changes no decision.
pub(super) async fn actor(
    ctx: Arc<Ctx>,
    mut scheduler: Scheduler,
    mut inputs: mpsc::UnboundedReceiver<Input>,
    mut admissions: mpsc::UnboundedReceiver<Admission>,
    mut stopped: watch::Receiver<bool>,
) -> &'static str {
    let mut releases = JoinSet::new();
    let mut gauges = crate::gauges::Refresh::new(&ctx.js, &ctx.tasks);
    loop {
        while releases.try_join_next().is_some() {}
        tokio::select! {
            _ = stopped.changed() => break,
            _ = gauges.tick() => gauges.publish(&scheduler),
            asked = admissions.recv() => {
                let Some(a) = asked else { break };
                let admitted = scheduler.admit(&a.task_id, &a.capsule, a.lane, a.queue_capsule);
                if a.answer.send(admitted).is_err() && admitted {
                    // The intake gave up before the record was written: the slot goes back.
                    let _ = ctx.inputs.send(Input::Ended { task_id: a.task_id });
                }
            }
            input = inputs.recv() => {
                let Some(input) = input else { break };
                tracing::trace!(instance = %ctx.instance, ?input, "scheduler input");
                for output in scheduler.apply(input) {
                    match output {
                        Output::Release { .. } => {
                            let ctx = ctx.clone();
                            releases.spawn(async move { ctx.carry_out(output).await });
                        }
                        Output::Ignored(_) => ctx.carry_out(output).await,
                    }
                }
            }
        }
    }
    // Releases under way finish: each has compare-and-set its record already, or will.
    while releases.join_next().await.is_some() {}
    "the scheduler"
}

/// A request to [`Scheduler::admit`] a task about to be stored, answered on `answer`.
pub(super) struct Admission {
    pub(super) task_id: TaskId,
    pub(super) capsule: String,
    pub(super) lane: mur_proto::Lane,
    pub(super) queue_capsule: bool,
    pub(super) answer: oneshot::Sender<bool>,
}
