//! The `scripted` driver: model replies read, in order, from a YAML file named by
//! `inference.script`. For tests and demos; the trace says the run was scripted
//! (`session_start.driver = "scripted"`).
//!
//! ```yaml
//! replies:                     # one entry per model call, in order
//!   - tool_calls:
//!       - name: sh
//!         input: { command: "echo hello" }
//!   - text: "all done"         # no tool calls: ends the task (end_turn)
//!   - text: "cut short"
//!     stop_reason: max_tokens  # optional; end_turn by default (tool_call with tool calls)
//!     usage: { input_tokens: 12, output_tokens: 3 }   # optional
//! ```
//!
//! `{{task}}` anywhere in a reply's text or in a tool call's input strings is replaced by
//! the task's text, verbatim; `{{tool_result}}` by the text of the latest tool result in
//! the conversation (empty when there is none), so a scripted capsule can report what its
//! command printed. Running out of replies is an error that ends the task `failed`,
//! unless the file says `repeat: true` (beside `replies:`): then every task starts at the
//! first reply (a task cut short leaves the next one in step), and the replies start over
//! once the last is used.
//!
//! The replies belong to the session: in a `queue` session the next task gets the next
//! reply. On the cluster every task is a session of its own and starts at the first reply;
//! a session that takes a task over after turn N goes on at reply N, as the model would
//! have.

use super::{Driver, Error, ModelRequest, ModelResponse, StopReason};
use async_trait::async_trait;
use mur_proto::message::{Block, Message, Role};
use mur_proto::trace::ProviderUsage;
use serde::Deserialize;
use serde_json::Value;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// The replies file.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Script {
    /// One entry per model call.
    pub replies: Vec<Reply>,
    /// Every task starts at the first reply, and the replies start over once the last is
    /// used (default false: the replies belong to the session, and running out is an
    /// error). A `queue` capsule answering every task the same way needs only one task's
    /// replies, whatever became of the task before.
    #[serde(default)]
    pub repeat: bool,
}

/// One scripted model reply.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Reply {
    /// Text of the reply.
    #[serde(default)]
    pub text: Option<String>,
    /// Tool calls, in order.
    #[serde(default)]
    pub tool_calls: Vec<ScriptedCall>,
    /// `end_turn`, `max_tokens`, `tool_call`, `error` or any other string (which the loop
    /// refuses as unsupported). Default: `tool_call` when there are tool calls, else
    /// `end_turn`.
    #[serde(default)]
    pub stop_reason: Option<String>,
    /// The in-band error message for `stop_reason: error`.
    #[serde(default)]
    pub error: Option<String>,
    /// Usage to report as the provider's.
    #[serde(default)]
    pub usage: Option<ScriptedUsage>,
    /// Milliseconds to wait before answering (a slow model), to within tens of
    /// microseconds ([`crate::timer`]; tokio's own timer would end 1–2 ms late).
    #[serde(default)]
    pub delay_ms: Option<u64>,
}

/// A scripted tool call.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ScriptedCall {
    /// Tool name.
    pub name: String,
    /// Input object.
    #[serde(default = "empty_object")]
    pub input: Value,
    /// Call id; default `call_<reply>_<index>`.
    #[serde(default)]
    pub id: Option<String>,
}

/// Scripted provider usage.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ScriptedUsage {
    /// Reported input tokens.
    pub input_tokens: Option<u64>,
    /// Reported output tokens.
    pub output_tokens: Option<u64>,
    /// Reported cached input tokens.
    pub cached_tokens: Option<u64>,
}

fn empty_object() -> Value {
    Value::Object(Default::default())
}

impl Script {
    /// Parses a replies file.
    ///
    /// # Errors
    /// The YAML error, with the field path; a file with no reply (every model call of a
    /// task would fail).
    pub fn parse(text: &str) -> Result<Script, String> {
        let script: Script = serde_yaml_ng::from_str(mur_proto::without_bom(text)).map_err(|e| e.to_string())?;
        if script.replies.is_empty() {
            return Err("replies: must hold at least one reply (every model call would fail)".into());
        }
        Ok(script)
    }
}

/// The driver: answers call N with reply N.
pub struct Scripted {
    script: Script,
    next: AtomicUsize,
}

impl Scripted {
    /// A driver over `script`, starting at its first reply.
    pub fn new(script: Script) -> Self {
        Scripted { script, next: AtomicUsize::new(0) }
    }

    /// A driver that resumes at reply `index` (a task taken over after `index` calls).
    pub fn starting_at(script: Script, index: usize) -> Self {
        Scripted { script, next: AtomicUsize::new(index) }
    }
}

/// The values substituted into replies.
#[derive(Clone, Copy, Debug, Default)]
pub struct Vars<'a> {
    /// `{{task}}`: the task's text.
    pub task: &'a str,
    /// `{{tool_result}}`: the latest tool result's text.
    pub tool_result: &'a str,
}

impl Vars<'_> {
    fn apply(&self, s: &str) -> String {
        if !s.contains("{{") {
            return s.to_string();
        }
        s.replace("{{task}}", self.task).replace("{{tool_result}}", self.tool_result)
    }
}

fn substitute(value: &Value, vars: &Vars<'_>) -> Value {
    match value {
        Value::String(s) => Value::String(vars.apply(s)),
        Value::Array(items) => Value::Array(items.iter().map(|v| substitute(v, vars)).collect()),
        Value::Object(map) => Value::Object(map.iter().map(|(k, v)| (k.clone(), substitute(v, vars))).collect()),
        other => other.clone(),
    }
}

/// Builds the response for reply `index` (pure).
pub fn respond(reply: &Reply, index: usize, vars: &Vars<'_>) -> ModelResponse {
    let mut content = Vec::new();
    if let Some(text) = &reply.text {
        content.push(Block::Text { text: vars.apply(text) });
    }
    for (i, call) in reply.tool_calls.iter().enumerate() {
        content.push(Block::ToolCall {
            id: call.id.clone().unwrap_or_else(|| format!("call_{index}_{i}")),
            name: call.name.clone(),
            input: substitute(&call.input, vars),
        });
    }
    let stop = match reply.stop_reason.as_deref() {
        None if reply.tool_calls.is_empty() => StopReason::EndTurn,
        None | Some("tool_call") => StopReason::ToolCall,
        Some("end_turn") => StopReason::EndTurn,
        Some("max_tokens") => StopReason::MaxTokens,
        Some("error") => StopReason::Error(reply.error.clone().unwrap_or_else(|| "scripted error".into())),
        Some(other) => StopReason::Other(other.to_string()),
    };
    let usage = reply.usage.as_ref().map_or_else(ProviderUsage::default, |u| ProviderUsage {
        input_tokens_actual: u.input_tokens,
        output_tokens_actual: u.output_tokens,
        cached_tokens: u.cached_tokens,
        cache_write_tokens: None,
    });
    ModelResponse { content, stop, usage }
}

#[async_trait]
impl Driver for Scripted {
    fn kind(&self) -> &'static str {
        "scripted"
    }

    fn taken_over_at(&self, turns: u32) {
        self.next.store(turns as usize, Ordering::SeqCst);
    }

    fn task_started(&self) {
        if self.script.repeat {
            self.next.store(0, Ordering::SeqCst);
        }
    }

    async fn call(&self, request: &ModelRequest<'_>) -> Result<ModelResponse, Error> {
        let index = self.next.fetch_add(1, Ordering::SeqCst);
        let replies = &self.script.replies;
        let at = if self.script.repeat && !replies.is_empty() { index % replies.len() } else { index };
        let Some(reply) = replies.get(at) else {
            return Err(Error::Script(format!(
                "no reply left for model call {} (the script has {} replies)",
                index + 1,
                self.script.replies.len()
            )));
        };
        if let Some(ms) = reply.delay_ms {
            crate::timer::sleep(Duration::from_millis(ms)).await;
        }
        let tool_result =
            request.messages.iter().rev().find(|m| m.role == Role::Tool).map(Message::text).unwrap_or_default();
        Ok(respond(reply, index, &Vars { task: request.task_text, tool_result: &tool_result }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req<'a>(task: &'a str) -> ModelRequest<'a> {
        ModelRequest {
            model: "",
            system: "",
            messages: &[],
            tools: &[],
            max_tokens: 1,
            task_text: task,
            history_epoch: 0,
        }
    }

    #[tokio::test]
    async fn replies_come_in_order_then_run_out() {
        let script = Script::parse(
            "replies:\n  - tool_calls:\n      - name: sh\n        input: { command: \"echo {{task}}\" }\n  - text: \"done: {{task}}\"\n",
        )
        .unwrap();
        let d = Scripted::new(script);
        let first = d.call(&req("hi there")).await.unwrap();
        assert_eq!(first.stop, StopReason::ToolCall);
        assert_eq!(
            first.content,
            vec![Block::ToolCall {
                id: "call_0_0".into(),
                name: "sh".into(),
                input: serde_json::json!({"command": "echo hi there"})
            }]
        );
        let second = d.call(&req("hi there")).await.unwrap();
        assert_eq!(second.stop, StopReason::EndTurn);
        assert_eq!(second.content, vec![Block::Text { text: "done: hi there".into() }]);
        let err = d.call(&req("x")).await.unwrap_err();
        assert_eq!(err.to_string(), "scripted driver: no reply left for model call 3 (the script has 2 replies)");
    }

    #[tokio::test]
    async fn a_reply_with_delay_ms_comes_no_sooner_than_its_delay() {
        let d = Scripted::new(Script::parse("replies:\n  - text: slow\n    delay_ms: 120\n  - text: fast\n").unwrap());
        let started = std::time::Instant::now();
        let slow = d.call(&req("a")).await.unwrap();
        let waited = started.elapsed();
        assert_eq!(slow.content, vec![Block::Text { text: "slow".into() }]);
        assert!(waited >= Duration::from_millis(120), "answered after {waited:?}, before its delay_ms of 120");
        let started = std::time::Instant::now();
        d.call(&req("b")).await.unwrap();
        assert!(started.elapsed() < Duration::from_millis(120), "a reply without delay_ms waited");
    }

    #[tokio::test]
    async fn a_repeating_script_starts_over_at_the_first_reply() {
        let d = Scripted::new(
            Script::parse("repeat: true\nreplies:\n  - text: one\n  - text: \"two: {{task}}\"\n").unwrap(),
        );
        let mut texts = Vec::new();
        for task in ["a", "b", "c", "d", "e"] {
            let reply = d.call(&req(task)).await.unwrap();
            texts.push(reply.content[0].clone());
        }
        let text = |t: &str| Block::Text { text: t.into() };
        assert_eq!(texts, [text("one"), text("two: b"), text("one"), text("two: d"), text("one")]);
        // A new task starts at the first reply, wherever the last one stopped.
        d.task_started();
        assert_eq!(d.call(&req("f")).await.unwrap().content[0], text("one"));
        d.task_started();
        assert_eq!(d.call(&req("g")).await.unwrap().content[0], text("one"));
        // Without `repeat` the replies belong to the session: a new task takes the next.
        let plain = Scripted::new(Script::parse("replies:\n  - text: one\n  - text: two\n").unwrap());
        plain.call(&req("a")).await.unwrap();
        plain.task_started();
        assert_eq!(plain.call(&req("b")).await.unwrap().content[0], text("two"));
    }

    #[test]
    fn stop_reason_and_usage_are_taken_from_the_reply() {
        let script = Script::parse(
            "replies:\n  - text: cut short\n    stop_reason: max_tokens\n    usage: { input_tokens: 12, output_tokens: 3 }\n  - text: x\n    stop_reason: weird\n",
        )
        .unwrap();
        let r = respond(&script.replies[0], 0, &Vars::default());
        assert_eq!(r.stop, StopReason::MaxTokens);
        assert_eq!(r.usage.input_tokens_actual, Some(12));
        assert_eq!(r.usage.output_tokens_actual, Some(3));
        assert_eq!(r.usage.cached_tokens, None);
        assert_eq!(respond(&script.replies[1], 1, &Vars::default()).stop, StopReason::Other("weird".into()));
    }

    #[tokio::test]
    async fn tool_result_placeholder_takes_the_latest_tool_result() {
        let script = Script::parse("replies:\n  - text: \"saw: {{tool_result}}\"\n").unwrap();
        let d = Scripted::new(script);
        let messages =
            [Message::user("t"), Message::tool_result("a", "first", false), Message::tool_result("b", "second", false)];
        let r = d
            .call(&ModelRequest {
                model: "",
                system: "",
                messages: &messages,
                history_epoch: 0,
                tools: &[],
                max_tokens: 1,
                task_text: "t",
            })
            .await
            .unwrap();
        assert_eq!(r.content, vec![Block::Text { text: "saw: second".into() }]);
    }

    #[test]
    fn a_replies_file_with_no_reply_is_refused_and_a_byte_order_mark_is_read_past() {
        assert_eq!(
            Script::parse("replies: []\n").unwrap_err(),
            "replies: must hold at least one reply (every model call would fail)"
        );
        assert_eq!(Script::parse("\u{feff}replies:\n  - text: hi\n").unwrap().replies.len(), 1);
    }

    #[test]
    fn unknown_reply_keys_are_refused_with_their_path() {
        let err = Script::parse("replies:\n  - txt: hello\n").unwrap_err();
        assert!(err.starts_with("replies[0]: unknown field `txt`"), "{err}");
    }
}
