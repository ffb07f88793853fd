//! The hook protocol: the event a hook program receives on stdin and the answer it prints
//! on stdout (issue #4; the runtime reference, §3 for the per-binding fields, with
//! the seed's kebab-case names written snake_case: `budget-tokens` is `budget_tokens`).
//!
//! One JSON object per event. Every event carries `version` ([`VERSION`]), `event` (the
//! binding, e.g. `"on-task-end"`), `session_id` and `hook` (the receiving hook's name).
//! The answer is `{"action": "none"}`, `{"action": "reopen-task", "reason": "…"}`,
//! `{"action": "seed-context", "messages": […]}` or `{"action": "replace-context",
//! "messages": […]}`; empty output means none. Message `content` may be a string or an
//! array of blocks.
//!
//! The JSON Schemas are `docs/schemas/hook-event.schema.json` ([`event_schema`], what the
//! runtime writes) and `docs/schemas/hook-answer.schema.json` ([`answer_schema`], what it
//! reads), generated from these types; a unit test keeps the files in step. `docs/hooks.md`
//! is the reference for hook authors.

use crate::message::Message;
use crate::task::ExitStatus;
use schemars::JsonSchema;
use schemars::generate::SchemaSettings;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The protocol version carried in every event's `version` field.
pub const VERSION: u32 = 1;

/// One event as a hook receives it: the header every event carries, and the binding's
/// fields.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Envelope {
    /// The protocol version: 1 (`mur_proto::hook::VERSION`).
    #[schemars(extend("const" = VERSION))]
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
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
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
        /// The call's idempotency key, `<task>.<turn>.<index>`: the same on every attempt
        /// of the call (issue #34), as its command got it in `MUR_TOOL_CALL_ID`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        idempotency_key: Option<String>,
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
        /// The call's idempotency key (as in `on-tool-call`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        idempotency_key: Option<String>,
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

/// A hook's answer. Empty output (or a blank line from a persistent hook) also means none.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
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

/// The JSON Schema (draft 2020-12) of an event as the runtime writes it
/// (`docs/schemas/hook-event.schema.json`).
pub fn event_schema() -> schemars::Schema {
    let mut schema = SchemaSettings::draft2020_12().for_serialize().into_generator().into_root_schema_for::<Envelope>();
    schema.insert("title".into(), format!("murmur hook event, protocol version {VERSION}").into());
    schema
}

/// The JSON Schema (draft 2020-12) of an answer as the runtime reads it
/// (`docs/schemas/hook-answer.schema.json`).
pub fn answer_schema() -> schemars::Schema {
    let mut schema = SchemaSettings::draft2020_12().for_deserialize().into_generator().into_root_schema_for::<Answer>();
    schema.insert("title".into(), format!("murmur hook answer, protocol version {VERSION}").into());
    schema
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

    /// `value` with every object's keys in sorted order, so the files come out the same
    /// whatever serde_json features the build unified.
    fn sorted(value: Value) -> Value {
        match value {
            Value::Object(map) => {
                let mut entries: Vec<(String, Value)> = map.into_iter().collect();
                entries.sort_by(|a, b| a.0.cmp(&b.0));
                Value::Object(entries.into_iter().map(|(k, v)| (k, sorted(v))).collect())
            }
            Value::Array(items) => Value::Array(items.into_iter().map(sorted).collect()),
            other => other,
        }
    }

    #[test]
    fn the_committed_json_schemas_match_the_types() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/schemas");
        let update = std::env::var("MUR_UPDATE_SCHEMAS").is_ok_and(|v| v == "1");
        let mut stale = Vec::new();
        let schemas = [("hook-event.schema.json", event_schema()), ("hook-answer.schema.json", answer_schema())];
        for (name, schema) in schemas {
            let text = serde_json::to_string_pretty(&sorted(schema.to_value())).unwrap() + "\n";
            let path = dir.join(name);
            if update {
                std::fs::create_dir_all(&dir).unwrap();
                std::fs::write(&path, &text).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
            } else if std::fs::read_to_string(&path).ok().as_deref() != Some(text.as_str()) {
                stale.push(format!("docs/schemas/{name}"));
            }
        }
        assert!(
            stale.is_empty(),
            "{} missing or different from the types in proto/src/hook.rs; \
             run `MUR_UPDATE_SCHEMAS=1 cargo test -p mur-proto` to regenerate",
            stale.join(" and ")
        );
    }

    #[test]
    fn the_schemas_follow_serde_in_each_direction() {
        // The event schema describes what the runtime writes, the answer schema what it reads.
        let event = event_schema().to_value();
        assert_eq!(event["properties"]["version"]["const"], VERSION);
        let answer = answer_schema().to_value().to_string();
        assert!(answer.contains("\"reopen-task\""), "{answer}");
        assert!(answer.contains("A plain text, read as one text block."), "content may be a string: {answer}");
        let written = event_schema().to_value().to_string();
        assert!(!written.contains("A plain text, read as one text block."), "events always carry blocks: {written}");
    }
}
