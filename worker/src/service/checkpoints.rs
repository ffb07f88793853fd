//! A task's per-turn checkpoints in `mur_sessions`: written after every turn, read for a
//! takeover, purged when the task ends (issue #8 §Checkpoints, §Takeover).

use super::*;

/// Purges a finished task's checkpoints: nothing will take it over any more.
pub(super) async fn drop_checkpoints(sessions: &kv::Store, task_id: &TaskId) {
    let filter = format!("{}{}>", sessions.prefix, cluster::checkpoint_prefix(task_id));
    if let Err(e) = sessions.stream.purge().filter(filter).await {
        tracing::debug!(%task_id, error = %e, "purging the task's checkpoints failed");
    }
}

/// Reads a task's checkpoints, in write order, and folds them ([`Checkpoint::fold`]).
/// `Ok(None)` when it has none.
pub(super) async fn read_checkpoints(
    sessions: &kv::Store,
    task_id: &TaskId,
) -> Result<Option<cluster::Resume>, String> {
    use async_nats::jetstream::consumer::{DeliverPolicy, pull};
    // One key per turn: read them all through the bucket's stream, filtered by prefix.
    let filter = format!("{}{}>", sessions.prefix, cluster::checkpoint_prefix(task_id));
    let mut consumer = sessions
        .stream
        .create_consumer(pull::OrderedConfig {
            filter_subject: filter,
            deliver_policy: DeliverPolicy::LastPerSubject,
            ..Default::default()
        })
        .await
        .map_err(|e| e.to_string())?;
    let pending = consumer.info().await.map_err(|e| e.to_string())?.num_pending;
    let mut checkpoints = Vec::new();
    if pending > 0 {
        let mut messages = consumer.messages().await.map_err(|e| e.to_string())?;
        while let Some(msg) = messages.next().await {
            let msg = msg.map_err(|e| e.to_string())?;
            let info = msg.info().map_err(|e| e.to_string())?;
            let left = info.pending;
            if !msg.payload.is_empty() {
                let c: Checkpoint = serde_json::from_slice(&msg.payload)
                    .map_err(|e| format!("checkpoint {} is not valid JSON: {e}", msg.subject))?;
                checkpoints.push(c);
            }
            if left == 0 {
                break;
            }
        }
    }
    Ok(Checkpoint::fold(checkpoints))
}

pub(super) fn takeover_from(
    r: Option<cluster::Resume>,
    delivery: u64,
    previous_session_id: String,
    previous_worker: String,
) -> Takeover {
    let checkpoint = r.map(|r| {
        let c = r.last.counters;
        Resumed {
            history: r.last.messages,
            counters: Counters {
                turns: c.turns,
                input_tokens: c.input_tokens,
                output_tokens: c.output_tokens,
                tool_calls: c.tool_calls,
                shell_calls: c.shell_calls,
            },
            session_tokens: r.last.session_tokens,
            reopens: r.last.reopens,
        }
    });
    Takeover { checkpoint, delivery, previous_session_id, previous_worker }
}

/// Writes a task's per-turn checkpoints to `mur_sessions` ([`checkpoint_key`]).
pub(super) struct KvCheckpoints {
    pub(super) sessions: kv::Store,
    pub(super) task_id: TaskId,
    pub(super) session_id: SessionId,
    pub(super) worker: String,
    /// Whether the task has checkpoints (to purge at its end).
    pub(super) saved: AtomicBool,
    /// The server's `max_payload`: a checkpoint larger than one message is written in parts.
    pub(super) max_payload: usize,
}

#[async_trait::async_trait]
impl Checkpoints for KvCheckpoints {
    async fn save(&self, c: TurnCheckpoint) -> Result<(), String> {
        let checkpoint = Checkpoint {
            task_id: self.task_id.clone(),
            session_id: self.session_id.clone(),
            worker: self.worker.clone(),
            turn: c.turn,
            replace: c.delta.replace,
            messages: c.delta.messages,
            counters: CheckpointCounters {
                turns: c.counters.turns,
                input_tokens: c.counters.input_tokens,
                output_tokens: c.counters.output_tokens,
                tool_calls: c.counters.tool_calls,
                shell_calls: c.counters.shell_calls,
            },
            session_tokens: c.session_tokens,
            reopens: c.reopens,
            at_ms: SystemClock.now_ms(),
            part: 0,
            parts: 0,
        };
        // One value, or its parts in order when one message cannot hold it (a long
        // history after a compaction or a takeover).
        let values = checkpoint.split(self.max_payload).map_err(|e| e.to_string())?;
        self.saved.store(true, Ordering::Relaxed);
        for (key, json) in values {
            self.sessions.put(key, json.into()).await.map_err(|e| e.to_string())?;
        }
        Ok(())
    }
}
