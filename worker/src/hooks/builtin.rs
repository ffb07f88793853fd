//! The built-in hooks, named in a manifest's `command` as `builtin:compact` and
//! `builtin:memory` (issue #4).
//!
//! - `compact` (bind it to `on-compaction` with `commit_policy: replace-context`):
//!   summarises the front of the conversation with the capsule's own driver, through the
//!   inference gate (so spend ceilings apply and the call is traced as `hook:<name>`), and
//!   keeps the tail verbatim. The tail never starts with a tool result, so every tool call
//!   stays next to its result. The prompt is `inference.compaction.system_prompt`, else
//!   [`COMPACT_PROMPT`]. Asked to summarise an overflowing seed, it condenses all of it.
//! - `memory` (declare it without a binding and with `commit_policy: seed-context`, or
//!   bound to `on-task-start`): appends one line per finished task attempt (its id, exit
//!   status and the start of its result) to a store, and seeds the stored lines back, one
//!   message each, oldest first, at the next task's start. The store is a JSON-lines file
//!   in the workdir for `mur run`.

use super::{Builtin, InferenceGate, InferenceRequest};
use async_trait::async_trait;
use mur_proto::hook::{Answer, Envelope, Event};
use mur_proto::message::{Block, Message, Role};
use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

/// The default summarising prompt of `builtin:compact`.
pub const COMPACT_PROMPT: &str = "You condense agent conversations. Summarise the transcript you are given: the task, \
what was tried, what was learned, file names, commands and their results that still matter, and what remains to do. \
Be factual and brief; do not invent anything.";

/// Messages kept verbatim at the end of a compacted history (at least; the cut moves back
/// so the tail does not start with a tool result).
pub const KEEP_TAIL: usize = 4;

/// Characters of each message put in the transcript sent for summarising.
const TRANSCRIPT_CHARS: usize = 2000;

/// The file `builtin:memory` keeps, under the workdir.
pub const MEMORY_FILE: &str = "memory.jsonl";

/// The built-in hooks, by command.
pub fn registry(gate: Arc<dyn InferenceGate>, workdir: PathBuf) -> HashMap<String, Arc<dyn Builtin>> {
    let mut map: HashMap<String, Arc<dyn Builtin>> = HashMap::new();
    map.insert("builtin:compact".into(), Arc::new(Compact { gate }));
    map.insert("builtin:memory".into(), Arc::new(Memory { path: workdir.join(MEMORY_FILE) }));
    map
}

/// `builtin:compact`.
pub struct Compact {
    gate: Arc<dyn InferenceGate>,
}

/// Where the verbatim tail starts: at most [`KEEP_TAIL`] messages from the end, moved back
/// past tool results so the tail opens with a user or assistant message.
pub fn tail_start(messages: &[Message]) -> usize {
    let mut start = messages.len().saturating_sub(KEEP_TAIL);
    while start > 0 && messages[start].role == Role::Tool {
        start -= 1;
    }
    start
}

/// A plain-text transcript of `messages` for the summariser.
pub fn transcript(messages: &[Message]) -> String {
    let mut out = String::new();
    for m in messages {
        let mut text = String::new();
        for b in &m.content {
            match b {
                Block::Text { text: t } => text.push_str(t),
                Block::ToolCall { name, input, .. } => text.push_str(&format!("[calls {name} with {input}]")),
            }
            text.push('\n');
        }
        let text: String = text.chars().take(TRANSCRIPT_CHARS).collect();
        let who = match m.role {
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool result",
        };
        out.push_str(&format!("{who}: {}\n", text.trim_end()));
    }
    out
}

#[async_trait]
impl Builtin for Compact {
    async fn handle(&self, envelope: &Envelope) -> Result<Answer, String> {
        let Event::OnCompaction { messages, system_prompt, seed_budget_tokens, .. } = &envelope.event else {
            return Ok(Answer::None);
        };
        let (front, tail) = if seed_budget_tokens.is_some() {
            (&messages[..], &messages[messages.len()..])
        } else {
            messages.split_at(tail_start(messages))
        };
        if front.is_empty() {
            return Ok(Answer::None);
        }
        let request = InferenceRequest {
            system: Some(system_prompt.clone().unwrap_or_else(|| COMPACT_PROMPT.to_string())),
            messages: vec![Message::user(format!("Transcript to summarise:\n\n{}", transcript(front)))],
            max_tokens: None,
        };
        let summary = self.gate.run_inference(&envelope.hook, request).await.map_err(|e| e.to_string())?;
        let mut out = vec![Message::user(format!("Summary of the conversation so far:\n{}", summary.trim()))];
        out.extend_from_slice(tail);
        Ok(Answer::ReplaceContext { messages: out })
    }
}

/// `builtin:memory`.
pub struct Memory {
    path: PathBuf,
}

#[derive(serde::Serialize, serde::Deserialize)]
struct Entry {
    task_id: String,
    exit_status: String,
    summary: String,
}

#[async_trait]
impl Builtin for Memory {
    async fn handle(&self, envelope: &Envelope) -> Result<Answer, String> {
        match &envelope.event {
            Event::OnTaskEnd { task_id, exit_status, result, .. } => {
                let entry = Entry {
                    task_id: task_id.clone(),
                    exit_status: exit_status.as_str().to_string(),
                    summary: result.chars().take(500).collect(),
                };
                let line = serde_json::to_string(&entry).map_err(|e| e.to_string())?;
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&self.path)
                    .and_then(|mut f| writeln!(f, "{line}"))
                    .map_err(|e| format!("{}: {e}", self.path.display()))?;
                Ok(Answer::None)
            }
            Event::OnTaskStart { .. } => {
                let text = match std::fs::read_to_string(&self.path) {
                    Ok(t) => t,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Answer::None),
                    Err(e) => return Err(format!("{}: {e}", self.path.display())),
                };
                let messages: Vec<Message> = text
                    .lines()
                    .filter_map(|l| serde_json::from_str::<Entry>(l).ok())
                    .map(|e| {
                        Message::user(format!("From an earlier task ({}, {}): {}", e.task_id, e.exit_status, e.summary))
                    })
                    .collect();
                Ok(if messages.is_empty() { Answer::None } else { Answer::SeedContext { messages } })
            }
            _ => Ok(Answer::None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn call(id: &str) -> Message {
        Message::assistant(vec![Block::ToolCall { id: id.into(), name: "sh".into(), input: json!({}) }])
    }

    #[test]
    fn the_tail_never_starts_with_a_tool_result() {
        let m = vec![
            Message::user("task"),
            call("a"),
            Message::tool_result("a", "1", false),
            call("b"),
            Message::tool_result("b", "2", false),
            Message::tool_result("b2", "3", false),
        ];
        // last 4 would start at index 2 (a tool result): moves back to the call at 1
        assert_eq!(tail_start(&m), 1);
        assert_eq!(tail_start(&m[..2]), 0);
    }

    #[test]
    fn transcripts_name_roles_and_calls() {
        let t = transcript(&[Message::user("do x"), call("a"), Message::tool_result("a", "ok", false)]);
        assert_eq!(t, "user: do x\nassistant: [calls sh with {}]\ntool result: ok\n");
    }
}
