//! The hook protocol: the event a hook program receives on stdin and the answer it prints
//! on stdout (issue #4; `reference/murmur-runtime.md` §3 for the per-binding fields, with
//! the seed's kebab-case names written snake_case: `budget-tokens` is `budget_tokens`).
//!
//! One JSON object per event. Every event carries `version` ([`VERSION`]), `event` (the
//! binding, e.g. `"on-task-end"`), `session_id` and `hook` (the receiving hook's name).
//! The answer is `{"action": "none"}`, `{"action": "reopen-task", "reason": "…"}`,
//! `{"action": "seed-context", "messages": […]}` or `{"action": "replace-context",
//! "messages": […]}`; empty output means none. Message `content` may be a string or an
//! array of blocks. `docs/hook-event.schema.json` and `docs/hook-answer.schema.json` are
//! the JSON Schemas.

use crate::message::Message;
use crate::task::ExitStatus;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The protocol version carried in every event's `version` field.
pub const VERSION: u32 = 1;

/// The header every event carries.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Envelope {
    /// [`VERSION`].
    pub version: u32,
    /// The session.
    pub session_id: String,
    /// The receiving hook's name.
    pub hook: String,
    /// The event, tagged by `event` with the binding's name.
    #[serde(flatten)]
    pub event: Event,
}

/// The events, one per binding.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "kebab-case")]
pub enum Event {
    /// Before the session exists.
    OnStage {
        /// `capabilities.shell.allow`.
        shell_allow: Vec<String>,
    },
    /// Once per launch, first.
    OnSessionStart {
        /// Capsule name.
        capsule_name: String,
        /// Capsule version.
        capsule_version: String,
        /// Model label.
        model: String,
        /// Capabilities granted.
        capabilities: Vec<String>,
    },
    /// Once per task, before its first turn; a `seed-context` hook answers here.
    OnTaskStart {
        /// `tsk_…`.
        task_id: String,
        /// `ctx_…`.
        context_id: String,
        /// `cli`, `task_md`, `a2a`, …
        source: String,
        /// Bytes of the task text.
        input_bytes: u64,
        /// The seed ceiling: floor(`context.max_tokens` × `context.seed_budget`); 0 when
        /// the capsule declares no `context.max_tokens`.
        budget_tokens: u64,
        /// `context.max_tokens`, 0 when absent.
        context_window: u64,
        /// Tokens of history loaded ahead of the task.
        prior_tokens: u64,
    },
    /// After each model response.
    OnInference {
        /// The task.
        task_id: String,
        /// 0-based turn.
        turn: u32,
        /// Estimated input tokens.
        input_tokens: u64,
        /// Estimated output tokens.
        output_tokens: u64,
        /// `tool_call`, `end_turn` or `text`.
        decision: String,
        /// First tool called.
        tool_name: Option<String>,
    },
    /// After each tool call.
    OnToolCall {
        /// The task.
        task_id: String,
        /// Turn that asked for it.
        turn: u32,
        /// Tool name.
        tool_name: String,
        /// The call's input.
        input: Value,
        /// Bytes of the result text.
        output_bytes: u64,
        /// Wall time, ms.
        duration_ms: u64,
        /// `ok` or `error`.
        status: String,
    },
    /// After each shell command.
    OnShell {
        /// The task.
        task_id: String,
        /// Turn that asked for it.
        turn: u32,
        /// Resolved binary.
        binary: String,
        /// The command (first 200 chars).
        command: String,
        /// Exit code.
        exit_code: i32,
        /// Bytes of stdout.
        stdout_bytes: u64,
        /// Bytes of stderr.
        stderr_bytes: u64,
        /// Wall time, ms.
        duration_ms: u64,
    },
    /// The context crossed the compaction threshold; a `replace-context` hook answers.
    OnCompaction {
        /// The task.
        task_id: String,
        /// The turn after which the threshold was crossed.
        turn: u32,
        /// The full history, oldest first.
        messages: Vec<Message>,
        /// This turn's occupancy (input + output tokens).
        session_tokens: u64,
        /// `inference.compaction.threshold`.
        threshold: f64,
        /// `context.max_tokens`.
        context_window: u64,
        /// `inference.compaction.model`.
        model: Option<String>,
        /// `inference.compaction.system_prompt`.
        system_prompt: Option<String>,
        /// Set when the runtime asks the hook to summarise an overflowing seed instead of
        /// the history: the token ceiling the summary must fit.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        seed_budget_tokens: Option<u64>,
    },
    /// After each attempt of a task; a `reopen-task` hook answers.
    OnTaskEnd {
        /// The task.
        task_id: String,
        /// The attempt's exit status.
        exit_status: ExitStatus,
        /// The attempt's final text (`out/result.txt`).
        result: String,
        /// Reopens granted so far (0 on the first attempt).
        reopen_count: u32,
        /// 1-based attempt number (`reopen_count + 1`).
        attempt: u32,
    },
    /// Once per launch, last.
    OnSessionEnd {
        /// Sum of task turns.
        total_turns: u32,
        /// Sum of input tokens.
        total_input_tokens: u64,
        /// Sum of output tokens.
        total_output_tokens: u64,
        /// Sum of tool calls.
        total_tool_calls: u32,
        /// Sum of shell calls.
        total_shell_calls: u32,
        /// Wall time, ms.
        duration_ms: u64,
        /// The last task's exit status.
        exit_status: ExitStatus,
    },
}

impl Event {
    /// The binding this event is delivered to.
    pub fn binding(&self) -> crate::manifest::Binding {
        use crate::manifest::Binding as B;
        match self {
            Event::OnStage { .. } => B::OnStage,
            Event::OnSessionStart { .. } => B::OnSessionStart,
            Event::OnTaskStart { .. } => B::OnTaskStart,
            Event::OnInference { .. } => B::OnInference,
            Event::OnToolCall { .. } => B::OnToolCall,
            Event::OnShell { .. } => B::OnShell,
            Event::OnCompaction { .. } => B::OnCompaction,
            Event::OnTaskEnd { .. } => B::OnTaskEnd,
            Event::OnSessionEnd { .. } => B::OnSessionEnd,
        }
    }
}

/// A hook's answer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "action", rename_all = "kebab-case")]
pub enum Answer {
    /// Nothing to commit.
    None,
    /// Veto the task's outcome and run it again with `reason` as feedback.
    ReopenTask {
        /// The feedback injected into the task.
        reason: String,
    },
    /// Messages to place at the head of the task's context, oldest first.
    SeedContext {
        /// The seed.
        messages: Vec<Message>,
    },
    /// A condensed history replacing the current one.
    ReplaceContext {
        /// The replacement.
        messages: Vec<Message>,
    },
}

impl Answer {
    /// The `action` string.
    pub fn action(&self) -> &'static str {
        match self {
            Answer::None => "none",
            Answer::ReopenTask { .. } => "reopen-task",
            Answer::SeedContext { .. } => "seed-context",
            Answer::ReplaceContext { .. } => "replace-context",
        }
    }

    /// Parses a hook's stdout: empty (or whitespace) means [`Answer::None`].
    ///
    /// # Errors
    /// A message saying why the text is not an answer.
    pub fn parse(stdout: &str) -> Result<Answer, String> {
        let t = stdout.trim();
        if t.is_empty() {
            return Ok(Answer::None);
        }
        serde_json::from_str(t).map_err(|e| format!("answer is not a hook answer object ({e}): {}", truncate(t, 200)))
    }
}

fn truncate(s: &str, n: usize) -> String {
    match s.char_indices().nth(n) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_are_flat_snake_case_objects_tagged_by_binding() {
        let e = Envelope {
            version: VERSION,
            session_id: "ses_1".into(),
            hook: "gate".into(),
            event: Event::OnTaskEnd {
                task_id: "tsk_1".into(),
                exit_status: ExitStatus::Ok,
                result: "done".into(),
                reopen_count: 0,
                attempt: 1,
            },
        };
        assert_eq!(
            serde_json::to_string(&e).unwrap(),
            r#"{"version":1,"session_id":"ses_1","hook":"gate","event":"on-task-end","task_id":"tsk_1","exit_status":"ok","result":"done","reopen_count":0,"attempt":1}"#
        );
    }

    #[test]
    fn answers_parse_from_the_documented_shapes() {
        assert_eq!(Answer::parse("").unwrap(), Answer::None);
        assert_eq!(Answer::parse("  \n").unwrap(), Answer::None);
        assert_eq!(Answer::parse(r#"{"action":"none"}"#).unwrap(), Answer::None);
        assert_eq!(
            Answer::parse(r#"{"action":"reopen-task","reason":"tests fail"}"#).unwrap(),
            Answer::ReopenTask { reason: "tests fail".into() }
        );
        assert_eq!(
            Answer::parse(r#"{"action":"seed-context","messages":[{"role":"user","content":"remember x"}]}"#).unwrap(),
            Answer::SeedContext { messages: vec![Message::user("remember x")] }
        );
        let err = Answer::parse(r#"{"action":"explode"}"#).unwrap_err();
        assert!(err.starts_with("answer is not a hook answer object (unknown variant `explode`"), "{err}");
        assert!(Answer::parse("hello").is_err());
    }
}
