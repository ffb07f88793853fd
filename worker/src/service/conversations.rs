//! Threaded conversations in `mur_sessions`: the context's conversation a task starts
//! from and the one it leaves (issue #8 §Checkpoints).

use super::*;

/// The conversation a task of `capsule` continues: the context's, for a threaded
/// conversation or a completion task (the session-loop seed, §Detached shell: a
/// completion joins its context), else none.
pub(super) async fn prior_conversation(
    sh: &Shared,
    task: &TaskRecord,
    capsule: &Capsule,
) -> Result<ContextConversation, String> {
    if !continues_context(task, capsule) {
        return Ok(ContextConversation::default());
    }
    let key = cluster::context_key(&task.capsule, &task.context_id);
    read_conversation_at(&sh.sessions, &key).await
}

/// A context's conversation as read, with the revision of its head in `mur_sessions`
/// (`None`: there was none).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ContextConversation {
    /// The messages.
    pub messages: Vec<Message>,
    /// The head's revision, for the compare-and-set of the next write.
    pub revision: Option<u64>,
}

/// The conversation stored under `key` ([`cluster::context_key`]), whole or in parts
/// ([`StoredConversation`]); empty when there is none.
///
/// # Errors
/// As [`read_conversation_at`].
pub async fn read_conversation(sessions: &kv::Store, key: &str) -> Result<Vec<Message>, String> {
    read_conversation_at(sessions, key).await.map(|c| c.messages)
}

/// [`read_conversation`] with the head's revision. A part removed between the head's read
/// and its own (a newer write replaced the conversation) reads the newer head.
///
/// # Errors
/// The broker's, a value that is not a conversation, or a part missing three times over.
pub async fn read_conversation_at(sessions: &kv::Store, key: &str) -> Result<ContextConversation, String> {
    let mut missing = String::new();
    'head: for _ in 0..3 {
        let entry = sessions.entry(key).await.map_err(|e| e.to_string())?;
        let Some(entry) = entry.filter(|e| e.operation == kv::Operation::Put) else {
            return Ok(ContextConversation::default());
        };
        let revision = Some(entry.revision);
        let stored: StoredConversation =
            serde_json::from_slice(&entry.value).map_err(|e| format!("conversation {key} is not valid JSON: {e}"))?;
        let parts = match stored {
            StoredConversation::Whole(messages) => return Ok(ContextConversation { messages, revision }),
            parts => parts.part_keys(key),
        };
        let mut messages = Vec::new();
        for part in parts {
            let Some(bytes) = sessions.get(&part).await.map_err(|e| e.to_string())? else {
                missing = format!("conversation {key}: part {part} is missing");
                continue 'head;
            };
            let run: Vec<Message> = serde_json::from_slice(&bytes)
                .map_err(|e| format!("conversation part {part} is not valid JSON: {e}"))?;
            messages.extend(run);
        }
        return Ok(ContextConversation { messages, revision });
    }
    Err(missing)
}

/// Stores `history` under `key` ([`cluster::context_key`]) within `max_payload`: whole, or
/// its parts and then their head ([`StoredConversation::split`]). The head is written with
/// a compare-and-set on `base`'s revision (the conversation the task started from): when
/// another task of the context ended meanwhile, its conversation is read again and the
/// messages `history` added to `base` are appended to it (up to five times). Without a
/// `base` (a task taken over, or one whose history was compacted) the head read now is
/// replaced. The parts of the conversation replaced are purged after; a losing write's
/// own at once.
///
/// # Errors
/// The broker's (what was stored before stays readable: a head is written last).
pub async fn write_conversation(
    sessions: &kv::Store,
    key: &str,
    history: Vec<Message>,
    base: Option<&ContextConversation>,
    max_payload: usize,
) -> Result<(), String> {
    // What this task added, when `history` continues `base`.
    let added: Option<Vec<Message>> =
        base.filter(|b| history.starts_with(&b.messages)).map(|b| history[b.messages.len()..].to_vec());
    // The head as it is now: its revision when there is no base to compare against, and
    // the parts to purge once it is replaced.
    let head_now = || async {
        let entry = sessions.entry(key).await.map_err(|e| e.to_string())?;
        Ok::<_, String>(
            entry
                .filter(|e| e.operation == kv::Operation::Put)
                .map(|e| (e.revision, serde_json::from_slice::<StoredConversation>(&e.value).ok())),
        )
    };
    let mut expected = match (base, &added) {
        (Some(b), Some(_)) => b.revision,
        _ => head_now().await?.map(|(revision, _)| revision),
    };
    let mut messages = history;
    for _ in 0..5 {
        // A head at another revision than expected fails the compare-and-set below.
        let before = match head_now().await? {
            Some((revision, head)) if Some(revision) == expected => head,
            _ => None,
        };
        let values = StoredConversation::split(key, messages.clone(), max_payload).map_err(|e| e.to_string())?;
        let (head_key, head) = values.last().cloned().expect("a head at least");
        let ours: Vec<String> = values[..values.len() - 1].iter().map(|(k, _)| k.clone()).collect();
        for (k, json) in &values[..values.len() - 1] {
            sessions.put(k, json.clone().into()).await.map_err(|e| e.to_string())?;
        }
        let written = match expected {
            Some(revision) => {
                sessions.update(&head_key, head.into(), revision).await.map(drop).map_err(|e| e.to_string())
            }
            None => sessions.create(&head_key, head.into()).await.map(drop).map_err(|e| e.to_string()),
        };
        match written {
            Ok(()) => {
                for old in before.map(|b| b.part_keys(key)).unwrap_or_default() {
                    if let Err(e) = sessions.purge(&old).await {
                        tracing::debug!(key = old, error = %e, "removing an earlier conversation's part failed");
                    }
                }
                return Ok(());
            }
            Err(e) => {
                tracing::debug!(key, error = %e, "the conversation changed while the task ran: merging");
                for part in ours {
                    let _ = sessions.purge(&part).await;
                }
                expected = match &added {
                    Some(added) => {
                        let now = read_conversation_at(sessions, key).await?;
                        messages = now.messages;
                        messages.extend(added.iter().cloned());
                        now.revision
                    }
                    None => head_now().await?.map(|(revision, _)| revision),
                };
            }
        }
    }
    Err(format!("conversation {key}: changed by other tasks five times while this one was written"))
}

pub(super) fn continues_context(task: &TaskRecord, capsule: &Capsule) -> bool {
    capsule.manifest.lifecycle.conversation == Conversation::Threaded || task.origin == Origin::Completion
}

/// Keeps the context's conversation after a task that ended `ok` (as `mur run` keeps
/// `contexts/<ctx>/history.json`). A failed write is logged: the next task of the
/// context starts from the conversation before this one.
pub(super) async fn save_conversation(
    sh: &Shared,
    task: &TaskRecord,
    history: &[Message],
    base: Option<&ContextConversation>,
) {
    let key = cluster::context_key(&task.capsule, &task.context_id);
    let max_payload = sh.client.server_info().max_payload;
    if let Err(e) = write_conversation(&sh.sessions, &key, history.to_vec(), base, max_payload).await {
        tracing::warn!(task_id = %task.task_id, key, error = %e, "the conversation was not kept");
    }
}
