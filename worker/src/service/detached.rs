//! Detached shell commands on the cluster (the session-loop seed, §Detached shell; issue
//! #7 §Lifecycle on the cluster): a command still running after
//! `lifecycle.shell_grace_secs` moves to the background of the worker that ran it, and the
//! task goes on. When the command ends, its log is uploaded to the object store
//! (`logs/<work_id>.log` in `mur_capsules`) and its completion is submitted to the
//! coordinator as a `completion` task for the same capsule and context (bg lane), which
//! any worker may run: that worker fetches the log into its session folder first, at the
//! path the completion's text names. The original session's trace gets `shell_completed`
//! with the completion's task id, in its `trace.jsonl` and on its trace subject.
//!
//! A command still running when the worker shuts down is killed, and recorded
//! `shell_abandoned` (the worker is stateless: nothing would collect its end).

use crate::session::detach::{Detached, Work};
use crate::tools::background::{DetachNotice, DetachSink};
use async_nats::jetstream::object_store;
use bytes::Bytes;
use mur_nats::clock::{Clock, SystemClock};
use mur_proto::cluster::{self, ApiError, ErrorCode, SubmitRequest};
use mur_proto::ids::{Id, IdKind};
use mur_proto::trace::{Event, Line};
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::sync::mpsc::UnboundedReceiver;
use tokio_util::sync::CancellationToken;

/// How long a worker goes on sending a completion task while no coordinator answers: a
/// command's result outlives a coordinator restart or failover, not a cluster left
/// without one.
pub const COMPLETION_PATIENCE: Duration = Duration::from_secs(300);

/// The object store name of a detached command's log.
pub fn log_object(work_id: &str) -> String {
    format!("logs/{work_id}.log")
}

/// What the host of one session's detached commands needs.
pub struct Host {
    /// A client for the submissions and the trace subject.
    pub client: async_nats::Client,
    /// Where logs go.
    pub store: object_store::ObjectStore,
    /// The capsule the completion tasks are for.
    pub capsule: String,
    /// The task that ran the commands, and its context.
    pub task_id: String,
    /// The context the completions go back to.
    pub context_id: String,
    /// The session whose trace gets `shell_completed`.
    pub session_id: String,
    /// The session folder (logs are under it; its `trace.jsonl`).
    pub session_dir: PathBuf,
}

impl Host {
    /// Serves the notices of one session until `session_done` has fired and every command
    /// it detached has ended, or `stop` fires: then commands still running are killed and
    /// recorded `shell_abandoned`. `sink` is the session's, kept to kill at shutdown.
    pub async fn serve(
        self,
        mut notices: UnboundedReceiver<DetachNotice>,
        sink: DetachSink,
        session_done: CancellationToken,
        stop: CancellationToken,
    ) {
        let mut registry = Detached::new();
        loop {
            if session_done.is_cancelled() {
                // Every `Detached` notice is sent before its tool call returns: all are
                // queued by now.
                while let Ok(n) = notices.try_recv() {
                    self.handle(&mut registry, n, &stop).await;
                }
                if registry.is_empty() {
                    return;
                }
            }
            tokio::select! {
                biased;
                () = stop.cancelled() => {
                    while let Ok(n) = notices.try_recv() {
                        self.handle(&mut registry, n, &stop).await;
                    }
                    self.abandon(&registry, &sink).await;
                    return;
                }
                n = notices.recv() => match n {
                    Some(n) => self.handle(&mut registry, n, &stop).await,
                    None => return,
                },
                () = session_done.cancelled(), if !session_done.is_cancelled() => {}
            }
        }
    }

    async fn handle(&self, registry: &mut Detached, notice: DetachNotice, stop: &CancellationToken) {
        match notice {
            DetachNotice::Detached(w) => {
                let now = SystemClock.now_ms();
                let _ = registry.detach(Work {
                    work_id: w.work_id,
                    binary: w.binary,
                    command: w.command,
                    task_id: self.task_id.clone(),
                    context_id: self.context_id.clone(),
                    started_at_ms: now.saturating_sub(w.running_ms),
                    detached_at_ms: now,
                });
            }
            DetachNotice::Completed { work_id, exit_code, duration_ms, output_path, output_bytes } => {
                let Ok(done) = registry.complete(&work_id, exit_code, duration_ms, &output_path, output_bytes) else {
                    return;
                };
                self.upload_log(&work_id, &output_path).await;
                match self.submit(&done.task.text, stop).await {
                    Ok(task_id) => self.record(done.event(&task_id)).await,
                    Err(e) => tracing::warn!(work_id, error = %e, "submitting a completion task failed"),
                }
            }
        }
    }

    async fn abandon(&self, registry: &Detached, sink: &DetachSink) {
        let now = SystemClock.now_ms();
        for work in registry.running() {
            sink.kill(&work.work_id).await;
            tracing::warn!(work_id = %work.work_id, command = %work.command, "worker stopping: detached command abandoned");
            self.record(Event::ShellAbandoned {
                work_id: work.work_id.clone(),
                binary: work.binary.clone(),
                command: work.command.clone(),
                running_ms: now.saturating_sub(work.started_at_ms),
            })
            .await;
        }
    }

    async fn upload_log(&self, work_id: &str, output_path: &str) {
        let path = self.session_dir.join(output_path);
        let bytes = match tokio::fs::read(&path).await {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!(work_id, path = %path.display(), error = %e, "reading a detached command's log");
                return;
            }
        };
        let mut reader = std::io::Cursor::new(bytes);
        if let Err(e) = self.store.put(log_object(work_id).as_str(), &mut reader).await {
            tracing::warn!(work_id, error = %e, "uploading a detached command's log");
        }
    }

    /// Submits the completion task with [`mur_nats::api::submit`]: sent again, the same
    /// task, while no coordinator answers, for up to [`COMPLETION_PATIENCE`] (issue #29:
    /// it was sent once, and a completion that met a coordinator restart was lost), until
    /// `stop` fires; once `stop` has fired, sent once. Returns its id.
    async fn submit(&self, text: &str, stop: &CancellationToken) -> Result<String, ApiError> {
        let mut request = SubmitRequest {
            context_id: Some(self.context_id.clone()),
            ..SubmitRequest::new(self.capsule.clone(), text.to_string(), mur_proto::task::Origin::Completion)
        };
        let patience = if stop.is_cancelled() { Duration::ZERO } else { COMPLETION_PATIENCE };
        let sending = mur_nats::api::submit(&self.client, &mut request, patience, |e, delay| {
            tracing::info!(error = %e, delay_ms = delay.as_millis() as u64, "completion task not taken yet; sending it again");
        });
        if stop.is_cancelled() {
            return sending.await.map(|r| r.task_id.into_string());
        }
        tokio::select! {
            reply = sending => reply.map(|r| r.task_id.into_string()),
            () = stop.cancelled() => Err(ApiError::new(
                ErrorCode::Unavailable,
                "the worker stopped before a coordinator took the completion task",
            )),
        }
    }

    /// Appends `event` to the session's `trace.jsonl` and publishes it on its subject.
    async fn record(&self, event: Event) {
        let line = Line {
            event,
            session_id: self.session_id.clone(),
            timestamp: SystemClock.now_ms(),
            event_id: Id::generate(IdKind::Event),
            parent_id: None,
        };
        let Ok(json) = serde_json::to_vec(&line) else { return };
        if let Err(e) = append_line(&self.session_dir.join("trace.jsonl"), &json) {
            tracing::warn!(session_id = %self.session_id, error = %e, "writing trace.jsonl");
        }
        let subject = cluster::trace_subject(&self.session_id);
        if let Err(e) = self.client.publish(subject, Bytes::from(json)).await {
            tracing::warn!(session_id = %self.session_id, error = %e, "publishing a trace line");
        }
        let _ = self.client.flush().await;
    }
}

fn append_line(path: &Path, json: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new().append(true).create(true).open(path)?;
    f.write_all(json)?;
    f.write_all(b"\n")
}

/// Before a `completion` task runs: fetches the logs its text names (`output:
/// logs/<work_id>.log …`) from the object store into `session_dir`, so the capsule finds
/// them where the text says, whichever worker ran the command.
pub async fn fetch_logs(store: &object_store::ObjectStore, text: &str, session_dir: &Path) {
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("output: ") else { continue };
        let Some(path) = rest.split_whitespace().next() else { continue };
        let Some(work_id) = path.strip_prefix("logs/").and_then(|p| p.strip_suffix(".log")) else { continue };
        if !Id::is_valid(IdKind::Work, work_id) {
            continue;
        }
        let target = session_dir.join(path);
        let fetched = async {
            let mut object = store.get(log_object(work_id).as_str()).await.map_err(|e| e.to_string())?;
            let mut bytes = Vec::new();
            tokio::io::AsyncReadExt::read_to_end(&mut object, &mut bytes).await.map_err(|e| e.to_string())?;
            if let Some(dir) = target.parent() {
                tokio::fs::create_dir_all(dir).await.map_err(|e| e.to_string())?;
            }
            tokio::fs::write(&target, bytes).await.map_err(|e| e.to_string())
        };
        if let Err(e) = fetched.await {
            tracing::warn!(work_id, error = %e, "fetching a detached command's log");
        }
    }
}
