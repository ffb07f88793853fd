//! A task's per-turn checkpoints in `mur_sessions`: written after every turn, read for a
//! takeover, purged when the task ends (issue #8 §Checkpoints, §Takeover).

use super::*;

/// Purges a finished task's checkpoints and journal: nothing will take it over any more.
pub(super) async fn drop_checkpoints(sessions: &kv::Store, task_id: &TaskId) {
    for prefix in [cluster::checkpoint_prefix(task_id), cluster::journal_prefix(task_id)] {
        let filter = format!("{}{prefix}>", sessions.prefix);
        if let Err(e) = sessions.stream.purge().filter(filter).await {
            tracing::debug!(%task_id, error = %e, "purging the task's checkpoints failed");
        }
    }
}

/// The last value of every key under `prefix`, in write order (deleted keys left out), in
/// one pass whose consumer is deleted when it is over ([`mur_nats::read::latest`]; an
/// ordered consumer was left on the server for 30 s, issue #29 item 3).
async fn read_prefix(sessions: &kv::Store, prefix: &str) -> Result<Vec<(String, bytes::Bytes)>, String> {
    // One key per turn (per entry): read them all through the bucket's stream, by prefix.
    let mut values: Vec<(String, bytes::Bytes)> = Vec::new();
    mur_nats::read::latest(sessions, &format!("{prefix}>"), |entry| {
        // A key written during the pass comes again, newer: its place is the newer one.
        values.retain(|(k, _)| *k != entry.key);
        if entry.operation == kv::Operation::Put && !entry.value.is_empty() {
            values.push((entry.key, entry.value));
        }
    })
    .await
    .map_err(|e| e.to_string())?;
    Ok(values)
}

/// Reads a task's checkpoints, in write order, and folds them ([`Checkpoint::fold`]), and
/// its tool-call journal ([`cluster::Replay`], issue #34). `Ok((None, _))` when it has no
/// checkpoint.
pub(super) async fn read_checkpoints(
    sessions: &kv::Store,
    task_id: &TaskId,
) -> Result<(Option<cluster::Resume>, cluster::Replay), String> {
    let mut checkpoints = Vec::new();
    for (subject, json) in read_prefix(sessions, &cluster::checkpoint_prefix(task_id)).await? {
        let c: Checkpoint =
            serde_json::from_slice(&json).map_err(|e| format!("checkpoint {subject} is not valid JSON: {e}"))?;
        checkpoints.push(c);
    }
    let mut entries = Vec::new();
    for (subject, json) in read_prefix(sessions, &cluster::journal_prefix(task_id)).await? {
        let e: cluster::Entry =
            serde_json::from_slice(&json).map_err(|e| format!("journal entry {subject} is not valid JSON: {e}"))?;
        entries.push(e);
    }
    Ok((Checkpoint::fold(checkpoints), cluster::Replay::fold(task_id, entries)))
}

pub(super) fn takeover_from(
    (r, replay): (Option<cluster::Resume>, cluster::Replay),
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
    Takeover { checkpoint, delivery, previous_session_id, previous_worker, replay }
}

/// Writes a task's per-turn checkpoints ([`checkpoint_key`]) and its tool-call journal
/// ([`cluster::Entry::key`]) to `mur_sessions`.
pub(super) struct KvCheckpoints {
    pub(super) sessions: kv::Store,
    /// The context `sessions` was opened with: journal entries are published through it.
    pub(super) js: jetstream::Context,
    /// Journal entries sent and not yet acknowledged, by key ([`Journal::sync`]).
    pub(super) pending: std::sync::Mutex<Vec<(String, jetstream::context::PublishAckFuture)>>,
    pub(super) task_id: TaskId,
    pub(super) session_id: SessionId,
    pub(super) worker: String,
    /// Whether the task has checkpoints or journal entries (to purge at its end).
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

#[async_trait::async_trait]
impl Journal for KvCheckpoints {
    fn worker(&self) -> &str {
        &self.worker
    }

    async fn post(&self, entry: cluster::Entry) -> Result<(), String> {
        let key = entry.key();
        let json = entry.fit(self.max_payload).map_err(|e| e.to_string())?;
        self.saved.store(true, Ordering::Relaxed);
        // The subject `kv::Store::put` writes to (the worker's context has no domain
        // prefix), published without waiting: `sync` awaits the acknowledgements together.
        let subject = format!("{}{key}", self.sessions.put_prefix.as_deref().unwrap_or(&self.sessions.prefix));
        let ack = self.js.publish(subject, json.into()).await.map_err(|e| e.to_string())?;
        self.pending.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push((key, ack));
        Ok(())
    }

    async fn sync(&self) -> Vec<Unstored> {
        let pending = std::mem::take(&mut *self.pending.lock().unwrap_or_else(std::sync::PoisonError::into_inner));
        let (keys, acks): (Vec<String>, Vec<_>) = pending.into_iter().unzip();
        // Once JetStream has acknowledged them all, the effect they guard may start.
        let acked = futures::future::join_all(acks.into_iter().map(std::future::IntoFuture::into_future)).await;
        keys.into_iter()
            .zip(acked)
            .filter_map(|(key, ack)| ack.err().map(|e| Unstored { key, why: e.to_string() }))
            .collect()
    }
}
