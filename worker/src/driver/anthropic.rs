//! The `anthropic` driver: Anthropic's Messages API (`POST {endpoint}/v1/messages`,
//! `anthropic-version: 2023-06-01`), plain JSON or SSE streaming, over the retrying
//! exchange of [`super::http`].
//!
//! Translation to the wire (Messages API reference, "messages" and "tools"):
//! - `user` text → a `user` message of `text` blocks; `assistant` → `text` and
//!   `tool_use{id,name,input}` blocks; a `tool` message → a `tool_result` block
//!   `{tool_use_id, content, is_error}` in a `user` message.
//! - The API wants roles to alternate, so consecutive messages that land on the same role
//!   are merged into one (several tool results, and a user text after them, become one
//!   `user` message); in a `user` message the `tool_result` blocks go first, as the API
//!   requires.
//! - `system` and `tools` are left out when empty.
//!
//! Translation back: `text` → [`Block::Text`], `tool_use` → [`Block::ToolCall`], other block
//! types (thinking, server tools) are skipped; `stop_reason` by [`stop_reason`]; usage by
//! [`WireUsage`]. A streamed reply is assembled by the IO-free [`StreamAssembler`].

use super::http::{self, Attempt, Exchange, Failed, Failure};
use super::{Driver, Error, ModelRequest, ModelResponse, ProviderError, StopReason, sse};
use async_trait::async_trait;
use mur_proto::message::{Block, Message, Role, join_text};
use mur_proto::trace::ProviderUsage;
use serde::Deserialize;
use serde_json::{Map, Value, json};
use std::collections::BTreeMap;

/// The API version sent as `anthropic-version`.
pub const API_VERSION: &str = "2023-06-01";

/// Settings of the `anthropic` driver, from the manifest's `inference:` block.
#[derive(Clone)]
pub struct Config {
    /// Base URL, like `https://api.anthropic.com`; a trailing `/v1` is accepted too.
    pub endpoint: String,
    /// Sent as `x-api-key` (left out when `None`, for proxies that add it).
    pub api_key: Option<String>,
    /// Model used when the request names none.
    pub model: Option<String>,
    /// Use SSE streaming (`"stream": true`).
    pub stream: bool,
    /// Retries, per-attempt timeout, and (streaming) the idle-read timeout
    /// [`http::Policy::idle_timeout`].
    pub policy: http::Policy,
}

impl std::fmt::Debug for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Config")
            .field("endpoint", &self.endpoint)
            .field("api_key", &self.api_key.as_ref().map(|_| "<redacted>"))
            .field("model", &self.model)
            .field("stream", &self.stream)
            .field("policy", &self.policy)
            .finish()
    }
}

/// The driver.
pub struct Anthropic {
    config: Config,
    client: reqwest::Client,
}

impl Anthropic {
    /// A driver for `config`.
    pub fn new(config: Config) -> Self {
        Anthropic { config, client: super::http::shared_client() }
    }

    /// One model call, with the log of every HTTP attempt it took ([`Driver::call`] without
    /// dropping the log).
    ///
    /// Cancel-safe: dropping the future closes the connection (see [`http::post_json`]).
    ///
    /// # Errors
    /// A [`Failure`]: the last attempt's [`Error`] and the attempts. An error status carries
    /// the provider's error parsed ([`ProviderError`]). A streamed reply is read inside its
    /// attempt, so a stream that breaks, stalls, ends before `message_stop`, carries a
    /// malformed event or a transient `error` event (`overloaded_error`) is retried
    /// ([`http::retryable`]).
    pub async fn exchange(&self, request: &ModelRequest<'_>) -> Result<Exchange<ModelResponse>, Failure> {
        let model =
            if request.model.is_empty() { self.config.model.as_deref().unwrap_or_default() } else { request.model };
        let stream = self.config.stream;
        let body = bytes::Bytes::from(request_body(model, request, stream).to_string());
        let url = messages_url(&self.config.endpoint);
        let mut headers = vec![("anthropic-version", API_VERSION.to_string())];
        if let Some(key) = &self.config.api_key {
            headers.push(("x-api-key", key.clone()));
        }
        let policy = &self.config.policy;
        let idle = policy.idle_timeout;
        http::post_read(&self.client, &url, &headers, body, policy, |resp| read_reply(resp, stream, idle)).await
    }
}

/// Reads one 2xx reply inside its attempt: a JSON message, or (streaming) an event stream.
async fn read_reply(
    response: reqwest::Response,
    stream: bool,
    idle: std::time::Duration,
) -> Result<ModelResponse, Failed> {
    let status = response.status().as_u16();
    let fail = |e: Error, streamed: bool| {
        let retry = http::retryable(&e, streamed);
        Failed::after(status, e, retry)
    };
    if stream {
        return read_stream(response.bytes_stream(), sse::Limits::default(), idle).await.map_err(|e| fail(e, true));
    }
    let bytes = response
        .bytes()
        .await
        .map_err(|e| Failed::after(status, Error::Transport(format!("reading the reply: {e}")), true))?;
    let value: Value = serde_json::from_slice(&bytes).map_err(|e| {
        let text = String::from_utf8_lossy(&bytes);
        Failed::after(
            status,
            Error::Protocol(format!("the reply is not JSON ({e}): {}", http::truncate(&text, 2048))),
            false,
        )
    })?;
    parse_response(&value).map_err(|e| fail(e, false))
}

#[async_trait]
impl Driver for Anthropic {
    fn kind(&self) -> &'static str {
        "anthropic"
    }

    async fn call(&self, request: &ModelRequest<'_>) -> Result<ModelResponse, Error> {
        self.call_logged(request).await.0
    }

    async fn call_logged(&self, request: &ModelRequest<'_>) -> (Result<ModelResponse, Error>, Vec<Attempt>) {
        match self.exchange(request).await {
            Ok(ex) => {
                log_retries(&ex.attempts);
                (Ok(ex.value), ex.attempts)
            }
            Err(failure) => {
                log_retries(&failure.attempts);
                (Err(failure.error), failure.attempts)
            }
        }
    }
}

fn log_retries(attempts: &[Attempt]) {
    if attempts.len() > 1 {
        tracing::info!(attempts = attempts.len(), ?attempts, "anthropic call retried");
    }
}

/// `{endpoint}/v1/messages`, without doubling a `/v1` the endpoint already ends with.
pub fn messages_url(endpoint: &str) -> String {
    let base = endpoint.trim_end_matches('/');
    if base.ends_with("/v1") { format!("{base}/messages") } else { format!("{base}/v1/messages") }
}

/// The JSON body of a Messages API request (see the module docs for the mapping).
pub fn request_body(model: &str, request: &ModelRequest<'_>, stream: bool) -> Value {
    let mut body = Map::new();
    body.insert("model".into(), json!(model));
    body.insert("max_tokens".into(), json!(request.max_tokens));
    if !request.system.is_empty() {
        body.insert("system".into(), json!(request.system));
    }
    body.insert("messages".into(), Value::Array(wire_messages(request.messages)));
    if !request.tools.is_empty() {
        let tools = request
            .tools
            .iter()
            .map(|t| json!({"name": t.name, "description": t.description, "input_schema": t.parameters}))
            .collect();
        body.insert("tools".into(), Value::Array(tools));
    }
    if stream {
        body.insert("stream".into(), Value::Bool(true));
    }
    Value::Object(body)
}

/// The conversation as Messages API messages, same-role neighbours merged.
fn wire_messages(messages: &[Message]) -> Vec<Value> {
    let mut out: Vec<(&'static str, Vec<Value>)> = Vec::new();
    for m in messages {
        let (role, blocks) = match m.role {
            Role::User => ("user", text_blocks(&m.content)),
            Role::Assistant => ("assistant", assistant_blocks(&m.content)),
            Role::Tool => (
                "user",
                vec![json!({
                    "type": "tool_result",
                    "tool_use_id": m.tool_call_id.as_deref().unwrap_or_default(),
                    "content": join_text(&m.content),
                    "is_error": m.is_error,
                })],
            ),
        };
        match out.last_mut() {
            Some((last, content)) if *last == role => content.extend(blocks),
            _ => out.push((role, blocks)),
        }
    }
    out.into_iter()
        .map(|(role, mut content)| {
            // "tool_result blocks must come FIRST in the content array" (tool use docs).
            content.sort_by_key(|b| b["type"] != "tool_result");
            json!({"role": role, "content": content})
        })
        .collect()
}

/// Text blocks; empty ones are dropped (the API refuses them) unless nothing else is left.
fn text_blocks(content: &[Block]) -> Vec<Value> {
    let texts: Vec<&str> = content
        .iter()
        .filter_map(|b| match b {
            Block::Text { text } => Some(text.as_str()),
            Block::ToolCall { .. } => None,
        })
        .collect();
    let non_empty: Vec<&str> = texts.iter().copied().filter(|t| !t.is_empty()).collect();
    let keep = if non_empty.is_empty() && !texts.is_empty() { vec![""] } else { non_empty };
    keep.into_iter().map(|text| json!({"type": "text", "text": text})).collect()
}

/// Assistant blocks: text and `tool_use`. A tool input that is not a JSON object (the
/// model sent broken JSON) goes back as `{}`, since the API accepts only objects there.
fn assistant_blocks(content: &[Block]) -> Vec<Value> {
    content
        .iter()
        .filter_map(|b| match b {
            Block::Text { text } if text.is_empty() => None,
            Block::Text { text } => Some(json!({"type": "text", "text": text})),
            Block::ToolCall { id, name, input } => {
                let input = if input.is_object() { input.clone() } else { json!({}) };
                Some(json!({"type": "tool_use", "id": id, "name": name, "input": input}))
            }
        })
        .collect()
}

/// Maps the API's `stop_reason`: `end_turn` and `stop_sequence` → `EndTurn`, `max_tokens`
/// → `MaxTokens`, `tool_use` → `ToolCall`; anything else (`pause_turn`, `refusal`, …) →
/// `Other(name)`, which the runtime refuses as unsupported.
pub fn stop_reason(name: &str) -> StopReason {
    match name {
        "end_turn" | "stop_sequence" => StopReason::EndTurn,
        "max_tokens" => StopReason::MaxTokens,
        "tool_use" => StopReason::ToolCall,
        other => StopReason::Other(other.to_string()),
    }
}

/// The API's `usage` object. Fields it leaves out (or sends as `null`) stay `None`.
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
pub struct WireUsage {
    /// Uncached input tokens → `input_tokens_actual`.
    #[serde(default)]
    pub input_tokens: Option<u64>,
    /// Output tokens → `output_tokens_actual`.
    #[serde(default)]
    pub output_tokens: Option<u64>,
    /// Input tokens read from the prompt cache → `cached_tokens`.
    #[serde(default)]
    pub cache_read_input_tokens: Option<u64>,
    /// Input tokens written to the prompt cache → `cache_write_tokens`.
    #[serde(default)]
    pub cache_creation_input_tokens: Option<u64>,
}

impl WireUsage {
    /// Overwrites the fields `newer` reports (`message_delta` repeats usage cumulatively).
    fn update(&mut self, newer: WireUsage) {
        self.input_tokens = newer.input_tokens.or(self.input_tokens);
        self.output_tokens = newer.output_tokens.or(self.output_tokens);
        self.cache_read_input_tokens = newer.cache_read_input_tokens.or(self.cache_read_input_tokens);
        self.cache_creation_input_tokens = newer.cache_creation_input_tokens.or(self.cache_creation_input_tokens);
    }

    fn provider(&self) -> ProviderUsage {
        ProviderUsage {
            input_tokens_actual: self.input_tokens,
            output_tokens_actual: self.output_tokens,
            cached_tokens: self.cache_read_input_tokens,
            cache_write_tokens: self.cache_creation_input_tokens,
        }
    }
}

/// A content block of a response (or a `content_block_start`).
#[derive(Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum WireBlock {
    Text {
        text: String,
    },
    ToolUse {
        id: String,
        name: String,
        #[serde(default)]
        input: Value,
    },
    #[serde(other)]
    Unknown,
}

#[derive(Deserialize)]
struct WireResponse {
    #[serde(default)]
    content: Vec<WireBlock>,
    #[serde(default)]
    stop_reason: Option<String>,
    #[serde(default)]
    usage: Option<WireUsage>,
}

/// A non-streamed Messages API response as a [`ModelResponse`].
///
/// # Errors
/// [`Error::Protocol`] when it does not have the documented shape or has no `stop_reason`.
pub fn parse_response(body: &Value) -> Result<ModelResponse, Error> {
    super::record_response(body);
    let wire =
        WireResponse::deserialize(body).map_err(|e| Error::Protocol(format!("unexpected messages response: {e}")))?;
    let content = wire
        .content
        .into_iter()
        .filter_map(|b| match b {
            WireBlock::Text { text } => Some(Block::Text { text }),
            WireBlock::ToolUse { id, name, input } => Some(Block::ToolCall { id, name, input }),
            WireBlock::Unknown => None,
        })
        .collect();
    let stop = wire
        .stop_reason
        .as_deref()
        .map(stop_reason)
        .ok_or_else(|| Error::Protocol("messages response has no stop_reason".into()))?;
    Ok(ModelResponse { content, stop, usage: wire.usage.unwrap_or_default().provider() })
}

/// A content block being streamed.
#[derive(Debug)]
enum Partial {
    Text(String),
    Tool {
        id: String,
        name: String,
        /// The `input` of `content_block_start` (used when no delta comes).
        start: Value,
        /// `input_json_delta.partial_json` fragments, concatenated.
        json: String,
    },
    /// A block type the runtime does not use (thinking, server tools).
    Skipped,
}

/// Builds a [`ModelResponse`] from the events of a streamed reply, without IO.
///
/// Feed it every event, in order, with [`StreamAssembler::feed`]; [`StreamAssembler::finish`]
/// gives the response. Blocks are kept by their `index`; `text_delta` text and
/// `input_json_delta` fragments are appended to their block, and a tool's input is parsed
/// when the reply is finished (input that is not valid JSON is kept as a JSON string).
/// An `error` event ends the reply, and [`finish`](Self::finish) fails with its
/// [`ProviderError`]. `ping` and unknown events are ignored (the API may add event types).
#[derive(Debug, Default)]
pub struct StreamAssembler {
    blocks: BTreeMap<u64, Partial>,
    stop: Option<String>,
    usage: WireUsage,
    error: Option<ProviderError>,
    stopped: bool,
}

impl StreamAssembler {
    /// An assembler that has seen nothing.
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether the reply is complete (`message_stop` or `error` seen).
    pub fn is_done(&self) -> bool {
        self.stopped || self.error.is_some()
    }

    /// Takes one event: its SSE `event` name and `data`. An empty or `message` name (no
    /// `event:` line) falls back to the data's `type`.
    ///
    /// # Errors
    /// [`Error::Protocol`] when the data is not JSON or not the event's documented shape.
    pub fn feed(&mut self, event: &str, data: &str) -> Result<(), Error> {
        let value: Value = serde_json::from_str(data)
            .map_err(|e| Error::Protocol(format!("event '{event}' is not JSON ({e}): {data}")))?;
        let name = match event {
            "" | "message" => value.get("type").and_then(Value::as_str).unwrap_or(event),
            named => named,
        };
        let bad = |what: &str| Error::Protocol(format!("event '{name}' {what}: {data}"));
        match name {
            "message_start" => {
                if let Some(message) = value.get("message") {
                    super::record_response(message);
                }
                if let Some(usage) = value.pointer("/message/usage") {
                    let usage = WireUsage::deserialize(usage).map_err(|_| bad("bad usage"))?;
                    self.usage.update(usage);
                }
            }
            "content_block_start" => {
                let index = index(&value).ok_or_else(|| bad("has no index"))?;
                let block = value.get("content_block").ok_or_else(|| bad("has no content_block"))?;
                let block = WireBlock::deserialize(block).map_err(|_| bad("bad content_block"))?;
                let partial = match block {
                    WireBlock::Text { text } => Partial::Text(text),
                    WireBlock::ToolUse { id, name, input } => {
                        Partial::Tool { id, name, start: input, json: String::new() }
                    }
                    WireBlock::Unknown => Partial::Skipped,
                };
                self.blocks.insert(index, partial);
            }
            "content_block_delta" => {
                let index = index(&value).ok_or_else(|| bad("has no index"))?;
                let delta = value.get("delta").ok_or_else(|| bad("has no delta"))?;
                let kind = delta.get("type").and_then(Value::as_str);
                let block = self.blocks.get_mut(&index);
                match (kind, block) {
                    (Some("text_delta"), Some(Partial::Text(text))) => {
                        let piece = delta["text"].as_str().ok_or_else(|| bad("has no text"))?;
                        text.push_str(piece);
                    }
                    (Some("input_json_delta"), Some(Partial::Tool { json, .. })) => {
                        let piece = delta["partial_json"].as_str().ok_or_else(|| bad("has no partial_json"))?;
                        json.push_str(piece);
                    }
                    (Some("text_delta" | "input_json_delta"), _) => {
                        return Err(bad("does not match its block"));
                    }
                    // thinking_delta, signature_delta, citations_delta…
                    _ => {}
                }
            }
            "message_delta" => {
                if let Some(reason) = value.pointer("/delta/stop_reason").and_then(Value::as_str) {
                    self.stop = Some(reason.to_string());
                }
                if let Some(usage) = value.get("usage") {
                    let usage = WireUsage::deserialize(usage).map_err(|_| bad("bad usage"))?;
                    self.usage.update(usage);
                }
            }
            "message_stop" => self.stopped = true,
            "error" => {
                self.error = Some(ProviderError::from_value(&value).unwrap_or_else(|| ProviderError {
                    message: format!("stream error: {data}"),
                    ..ProviderError::default()
                }));
            }
            // content_block_stop, ping, and event types added later.
            _ => {}
        }
        Ok(())
    }

    /// The assembled response.
    ///
    /// # Errors
    /// [`Error::Provider`] after an `error` event; [`Error::Protocol`] when the stream
    /// ended before `message_stop` or without a `stop_reason`.
    pub fn finish(self) -> Result<ModelResponse, Error> {
        let stop = match (self.error, self.stop) {
            (Some(error), _) => return Err(Error::Provider(Box::new(error))),
            (None, _) if !self.stopped => {
                return Err(Error::Protocol("stream ended before message_stop".into()));
            }
            (None, Some(reason)) => stop_reason(&reason),
            (None, None) => {
                return Err(Error::Protocol("stream ended without a stop_reason".into()));
            }
        };
        let content = self
            .blocks
            .into_values()
            .filter_map(|p| match p {
                Partial::Text(text) => Some(Block::Text { text }),
                Partial::Tool { id, name, start, json } => {
                    let input = if json.is_empty() {
                        start
                    } else {
                        serde_json::from_str(&json).unwrap_or(Value::String(json))
                    };
                    Some(Block::ToolCall { id, name, input })
                }
                Partial::Skipped => None,
            })
            .collect();
        Ok(ModelResponse { content, stop, usage: self.usage.provider() })
    }
}

fn index(value: &Value) -> Option<u64> {
    value.get("index").and_then(Value::as_u64)
}

/// Reads a streamed reply to its end (`message_stop` or an `error` event), through the
/// [`sse`] decoder under `limits`; each wait for the body is bounded by `idle`.
///
/// # Errors
/// As [`sse::read`] and [`StreamAssembler::feed`] / [`StreamAssembler::finish`].
pub async fn read_stream<S, B, E>(
    bytes: S,
    limits: sse::Limits,
    idle: std::time::Duration,
) -> Result<ModelResponse, Error>
where
    S: futures::Stream<Item = Result<B, E>>,
    B: AsRef<[u8]>,
    E: std::fmt::Display,
{
    let mut assembler = StreamAssembler::new();
    sse::read(bytes, limits, idle, |event| {
        assembler.feed(&event.event, &event.data)?;
        Ok(if assembler.is_done() { sse::Flow::Stop } else { sse::Flow::Continue })
    })
    .await?;
    assembler.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::ToolSpec;

    fn request<'a>(messages: &'a [Message], tools: &'a [ToolSpec]) -> ModelRequest<'a> {
        ModelRequest {
            model: "claude-test",
            system: "",
            messages,
            tools,
            max_tokens: 64,
            task_text: "",
            history_epoch: 0,
        }
    }

    #[test]
    fn messages_url_adds_v1_once() {
        assert_eq!(messages_url("https://api.anthropic.com"), "https://api.anthropic.com/v1/messages");
        assert_eq!(messages_url("https://api.anthropic.com/"), "https://api.anthropic.com/v1/messages");
        assert_eq!(messages_url("http://proxy/anthropic/v1"), "http://proxy/anthropic/v1/messages");
        assert_eq!(messages_url("http://h/v1/"), "http://h/v1/messages");
    }

    #[test]
    fn empty_system_and_tools_are_left_out() {
        let messages = [Message::user("hi")];
        let body = request_body("m", &request(&messages, &[]), false);
        assert_eq!(
            body,
            json!({
                "model": "m",
                "max_tokens": 64,
                "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
            })
        );
    }

    #[test]
    fn system_tools_and_stream_are_sent_when_set() {
        let messages = [Message::user("hi")];
        let tools = [ToolSpec {
            name: "sh".into(),
            description: "run a command".into(),
            parameters: json!({"type": "object"}),
        }];
        let mut req = request(&messages, &tools);
        req.system = "be brief";
        let body = request_body("m", &req, true);
        assert_eq!(body["system"], "be brief");
        assert_eq!(body["stream"], true);
        assert_eq!(
            body["tools"],
            json!([{"name": "sh", "description": "run a command", "input_schema": {"type": "object"}}])
        );
    }

    #[test]
    fn tool_results_and_following_user_text_merge_into_one_user_message() {
        let messages = [
            Message::user("task"),
            Message::assistant(vec![
                Block::Text { text: "calling".into() },
                Block::ToolCall { id: "t1".into(), name: "sh".into(), input: json!({"command": "ls"}) },
                Block::ToolCall { id: "t2".into(), name: "sh".into(), input: json!({"command": "pwd"}) },
            ]),
            Message::tool_result("t1", "a b", false),
            Message::tool_result("t2", "denied", true),
            Message::user("keep going"),
        ];
        let body = request_body("m", &request(&messages, &[]), false);
        assert_eq!(
            body["messages"],
            json!([
                {"role": "user", "content": [{"type": "text", "text": "task"}]},
                {"role": "assistant", "content": [
                    {"type": "text", "text": "calling"},
                    {"type": "tool_use", "id": "t1", "name": "sh", "input": {"command": "ls"}},
                    {"type": "tool_use", "id": "t2", "name": "sh", "input": {"command": "pwd"}}
                ]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": "a b", "is_error": false},
                    {"type": "tool_result", "tool_use_id": "t2", "content": "denied", "is_error": true},
                    {"type": "text", "text": "keep going"}
                ]}
            ])
        );
    }

    #[test]
    fn tool_results_come_before_text_in_a_merged_user_message() {
        let messages = [
            Message::assistant(vec![Block::ToolCall {
                id: "t1".into(),
                name: "sh".into(),
                input: Value::String("{broken".into()),
            }]),
            Message::user("note"),
            Message::tool_result("t1", "out", false),
        ];
        let body = request_body("m", &request(&messages, &[]), false);
        let msgs = body["messages"].as_array().unwrap();
        assert_eq!(msgs[0]["content"][0]["input"], json!({}));
        assert_eq!(msgs[1]["content"][0]["type"], "tool_result");
        assert_eq!(msgs[1]["content"][1]["text"], "note");
    }

    #[test]
    fn stop_reasons_map_to_the_runtime_names() {
        assert_eq!(stop_reason("end_turn"), StopReason::EndTurn);
        assert_eq!(stop_reason("stop_sequence"), StopReason::EndTurn);
        assert_eq!(stop_reason("max_tokens"), StopReason::MaxTokens);
        assert_eq!(stop_reason("tool_use"), StopReason::ToolCall);
        assert_eq!(stop_reason("pause_turn"), StopReason::Other("pause_turn".into()));
        assert_eq!(stop_reason("refusal"), StopReason::Other("refusal".into()));
    }

    #[test]
    fn response_blocks_usage_and_stop_are_translated() {
        let body = json!({
            "id": "msg_1", "type": "message", "role": "assistant", "model": "m",
            "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "x"},
                {"type": "text", "text": "let me look"},
                {"type": "tool_use", "id": "toolu_1", "name": "sh", "input": {"command": "ls"}}
            ],
            "stop_reason": "tool_use", "stop_sequence": null,
            "usage": {"input_tokens": 10, "output_tokens": 5,
                      "cache_read_input_tokens": 100, "cache_creation_input_tokens": null}
        });
        let r = parse_response(&body).unwrap();
        assert_eq!(r.stop, StopReason::ToolCall);
        assert_eq!(
            r.content,
            vec![
                Block::Text { text: "let me look".into() },
                Block::ToolCall { id: "toolu_1".into(), name: "sh".into(), input: json!({"command": "ls"}) }
            ]
        );
        assert_eq!(
            r.usage,
            ProviderUsage {
                input_tokens_actual: Some(10),
                output_tokens_actual: Some(5),
                cached_tokens: Some(100),
                cache_write_tokens: None,
            }
        );
        let bare = parse_response(&json!({"content": [], "stop_reason": "end_turn"})).unwrap();
        assert_eq!(bare.usage, ProviderUsage::default());
        let err = parse_response(&json!({"content": []})).unwrap_err();
        assert!(err.to_string().contains("no stop_reason"), "{err}");
    }

    #[test]
    fn error_bodies_give_type_and_message() {
        let body = r#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#;
        let error = ProviderError::from_body(body).unwrap();
        assert_eq!(error.to_string(), "overloaded_error: Overloaded");
        assert!(error.is_transient());
        assert_eq!(ProviderError::from_body("<html>bad gateway</html>"), None);
    }

    /// An SSE stream with a text block and a tool_use block whose input arrives in pieces,
    /// both holding multi-byte characters.
    fn sse_fixture() -> String {
        let events = [
            (
                "message_start",
                json!({"type": "message_start", "message": {"id": "msg_1", "type": "message",
                    "role": "assistant", "content": [], "model": "m", "stop_reason": null,
                    "usage": {"input_tokens": 25, "output_tokens": 1, "cache_read_input_tokens": 7}}}),
            ),
            (
                "content_block_start",
                json!({"type": "content_block_start", "index": 0,
                    "content_block": {"type": "text", "text": ""}}),
            ),
            ("ping", json!({"type": "ping"})),
            (
                "content_block_delta",
                json!({"type": "content_block_delta", "index": 0,
                    "delta": {"type": "text_delta", "text": "héllo"}}),
            ),
            (
                "content_block_delta",
                json!({"type": "content_block_delta", "index": 0,
                    "delta": {"type": "text_delta", "text": " ✓"}}),
            ),
            ("content_block_stop", json!({"type": "content_block_stop", "index": 0})),
            (
                "content_block_start",
                json!({"type": "content_block_start", "index": 1,
                    "content_block": {"type": "tool_use", "id": "toolu_9", "name": "sh", "input": {}}}),
            ),
            (
                "content_block_delta",
                json!({"type": "content_block_delta", "index": 1,
                    "delta": {"type": "input_json_delta", "partial_json": ""}}),
            ),
            (
                "content_block_delta",
                json!({"type": "content_block_delta", "index": 1,
                    "delta": {"type": "input_json_delta", "partial_json": "{\"command\": \"echo hé"}}),
            ),
            (
                "content_block_delta",
                json!({"type": "content_block_delta", "index": 1,
                    "delta": {"type": "input_json_delta", "partial_json": "llo ✓\"}"}}),
            ),
            ("content_block_stop", json!({"type": "content_block_stop", "index": 1})),
            (
                "message_delta",
                json!({"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": null},
                    "usage": {"output_tokens": 42}}),
            ),
            ("message_stop", json!({"type": "message_stop"})),
        ];
        events.iter().map(|(name, data)| format!("event: {name}\ndata: {data}\n\n")).collect()
    }

    fn expected() -> ModelResponse {
        ModelResponse {
            content: vec![
                Block::Text { text: "héllo ✓".into() },
                Block::ToolCall {
                    id: "toolu_9".into(), name: "sh".into(), input: json!({"command": "echo héllo ✓"})
                },
            ],
            stop: StopReason::ToolCall,
            usage: ProviderUsage {
                input_tokens_actual: Some(25),
                output_tokens_actual: Some(42),
                cached_tokens: Some(7),
                cache_write_tokens: None,
            },
        }
    }

    /// Runs `chunks` through the SSE parser and the assembler.
    fn assemble(chunks: Vec<Vec<u8>>) -> ModelResponse {
        let stream = futures::stream::iter(chunks.into_iter().map(Ok::<_, std::convert::Infallible>));
        let runtime = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
        runtime.block_on(read_stream(stream, sse::Limits::default(), std::time::Duration::from_secs(5))).unwrap()
    }

    #[test]
    fn stream_assembles_text_and_tool_input_fragments() {
        assert_eq!(assemble(vec![sse_fixture().into_bytes()]), expected());
    }

    #[test]
    fn stream_split_at_every_byte_offset_assembles_the_same() {
        let bytes = sse_fixture().into_bytes();
        // The fixture really has multi-byte characters to cut through.
        assert!(std::str::from_utf8(&bytes[..bytes.len() - 1]).is_ok());
        assert!(bytes.iter().any(|b| *b >= 0x80));
        for at in 0..=bytes.len() {
            let (a, b) = bytes.split_at(at);
            assert_eq!(assemble(vec![a.to_vec(), b.to_vec()]), expected(), "split at byte {at}");
        }
    }

    #[test]
    fn stream_error_event_fails_the_reply_with_the_parsed_error() {
        let mut a = StreamAssembler::new();
        a.feed(
            "content_block_start",
            r#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":"par"}}"#,
        )
        .unwrap();
        a.feed("error", r#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#).unwrap();
        assert!(a.is_done());
        let err = a.finish().unwrap_err();
        assert!(
            matches!(&err, Error::Provider(e) if e.kind.as_deref() == Some("overloaded_error") && e.message == "Overloaded"),
            "{err:?}"
        );
    }

    #[test]
    fn stream_cut_before_message_stop_is_an_error() {
        let mut a = StreamAssembler::new();
        a.feed("message_delta", r#"{"type":"message_delta","delta":{"stop_reason":"end_turn"}}"#).unwrap();
        assert!(!a.is_done());
        let err = a.finish().unwrap_err();
        assert!(err.to_string().contains("before message_stop"), "{err}");
    }

    #[test]
    fn stream_tool_without_deltas_keeps_its_start_input_and_bad_json_stays_a_string() {
        let mut a = StreamAssembler::new();
        for (event, data) in [
            (
                "content_block_start",
                r#"{"index":0,"content_block":{"type":"tool_use","id":"a","name":"x","input":{}}}"#,
            ),
            (
                "content_block_start",
                r#"{"index":1,"content_block":{"type":"tool_use","id":"b","name":"y","input":{}}}"#,
            ),
            ("content_block_delta", r#"{"index":1,"delta":{"type":"input_json_delta","partial_json":"{\"cut"}}"#),
            ("message_delta", r#"{"delta":{"stop_reason":"max_tokens"},"usage":{"output_tokens":3}}"#),
            ("message_stop", r#"{}"#),
        ] {
            a.feed(event, data).unwrap();
        }
        let r = a.finish().unwrap();
        assert_eq!(r.stop, StopReason::MaxTokens);
        assert_eq!(
            r.content,
            vec![
                Block::ToolCall { id: "a".into(), name: "x".into(), input: json!({}) },
                Block::ToolCall { id: "b".into(), name: "y".into(), input: Value::String("{\"cut".into()) },
            ]
        );
        assert_eq!(r.usage.input_tokens_actual, None);
        assert_eq!(r.usage.output_tokens_actual, Some(3));
    }

    #[test]
    fn stream_events_that_are_not_json_are_protocol_errors() {
        let err = StreamAssembler::new().feed("content_block_delta", "{oops").unwrap_err();
        assert!(matches!(err, Error::Protocol(_)), "{err}");
    }
}
