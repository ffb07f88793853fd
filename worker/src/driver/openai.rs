//! The `openai` driver: chat completions against any OpenAI-compatible server, as one JSON
//! reply or as a stream of server-sent events.
//!
//! The wire format is OpenAI's Chat Completions API: `POST {endpoint}/chat/completions`
//! with `model`, `max_tokens` or `max_completion_tokens` ([`MaxTokensParam`]), `messages`,
//! `tools` (and `stream`, `stream_options` when streaming); the reply is a
//! `chat.completion` object, or `chat.completion.chunk` objects sent as `data:` events and
//! closed by `data: [DONE]`.
//!
//! Everything but the HTTP exchange is pure and tested without IO: [`request_body`] builds
//! the body as a JSON value (the reference shape), [`RequestEncoder`] writes the same JSON
//! as text from per-message pieces kept across calls (what the driver sends, so a turn
//! serialises only the messages added since the last one), [`parse_completion`] reads a
//! JSON reply, [`StreamAssembler`] puts streamed chunks back together (tool calls by the
//! [`tool_calls::Assembler`] both paths share), and [`read_stream`] runs the SSE decoder
//! ([`sse`]) over any byte stream into the assembler.
//!
//! The whole call, streamed body included, is one attempt of [`http::post_read`]: a stream
//! that breaks, stalls, ends early or carries a malformed chunk is retried ([`http::retryable`]).

use super::http::{self, Attempt, Exchange, Failed, Failure};
use super::{Driver, Error, ModelRequest, ModelResponse, ProviderError, StopReason, ToolSpec, sse, tool_calls};
use async_trait::async_trait;
use bytes::Bytes;
use futures::Stream;
pub use mur_proto::manifest::MaxTokensParam;
use mur_proto::message::{Block, Message, Role};
use mur_proto::trace::ProviderUsage;
use serde_json::{Map, Value, json};
use std::fmt::Display;
use std::sync::Mutex;
use std::time::Duration;

/// Settings of the `openai` driver, from the manifest's `inference:` block.
#[derive(Clone, Debug)]
pub struct Config {
    /// Base URL up to and including `/v1` (a trailing slash is tolerated).
    pub endpoint: String,
    /// Bearer token; no `Authorization` header when absent or empty.
    pub api_key: Option<String>,
    /// Use SSE streaming.
    pub stream: bool,
    /// Retries, per-attempt timeout and idle-read timeout (`inference.max_retries`,
    /// `inference.timeout_secs`, `inference.idle_timeout_secs`).
    pub policy: http::Policy,
    /// The key of the output cap (`inference.max_tokens_param`, else
    /// [`MaxTokensParam::for_endpoint`]).
    pub max_tokens_param: MaxTokensParam,
}

/// The driver. It keeps the wire JSON of the conversation it last sent
/// ([`RequestEncoder`]), so each call serialises only the messages added since.
pub struct OpenAi {
    config: Config,
    client: reqwest::Client,
    encoder: Mutex<RequestEncoder>,
}

impl OpenAi {
    /// A driver for `config`.
    pub fn new(config: Config) -> Self {
        OpenAi { config, client: super::http::shared_client(), encoder: Mutex::default() }
    }

    /// The body of `request`, from the encoder's cache. A panic while encoding (never
    /// expected) poisons the lock; the cache may then be half-updated, so it is dropped.
    fn encode(&self, request: &ModelRequest<'_>) -> Bytes {
        let mut encoder = self.encoder.lock().unwrap_or_else(|poisoned| {
            self.encoder.clear_poison();
            let mut encoder = poisoned.into_inner();
            *encoder = RequestEncoder::default();
            encoder
        });
        Bytes::from(encoder.encode(request, self.config.stream, self.config.max_tokens_param))
    }
}

#[async_trait]
impl Driver for OpenAi {
    fn kind(&self) -> &'static str {
        "openai"
    }

    /// One chat completion.
    ///
    /// # Errors
    /// [`Error::Status`] on an HTTP error status, [`Error::Transport`] when the connection
    /// fails or breaks mid-stream, [`Error::Protocol`] for a reply that is not a chat
    /// completion or carries an in-band `error` object.
    async fn call(&self, request: &ModelRequest<'_>) -> Result<ModelResponse, Error> {
        self.call_logged(request).await.0
    }

    async fn call_logged(&self, request: &ModelRequest<'_>) -> (Result<ModelResponse, Error>, Vec<Attempt>) {
        match self.exchange(request).await {
            Ok(ex) => (Ok(ex.value), ex.attempts),
            Err(f) => (Err(f.error), f.attempts),
        }
    }
}

impl OpenAi {
    /// One chat completion with the log of its attempts.
    ///
    /// # Errors
    /// [`Failure`] carrying [`Error::Status`] on an HTTP error status (after retries for
    /// 429 and 5xx), [`Error::Transport`] when the connection fails or breaks mid-stream,
    /// [`Error::Timeout`], [`Error::Protocol`] for a reply that is not a chat completion or
    /// carries an in-band `error` object.
    pub async fn exchange(&self, request: &ModelRequest<'_>) -> Result<Exchange<ModelResponse>, Failure> {
        let stream = self.config.stream;
        let body = self.encode(request);
        let mut headers = Vec::new();
        if let Some(key) = self.config.api_key.as_deref().filter(|k| !k.is_empty()) {
            headers.push(("authorization", format!("Bearer {key}")));
        }
        if stream {
            headers.push(("accept", "text/event-stream".to_string()));
        }
        let url = chat_completions_url(&self.config.endpoint);
        let policy = &self.config.policy;
        let idle = policy.idle_timeout;
        http::post_read(&self.client, &url, &headers, body, policy, |resp| read_reply(resp, stream, idle)).await
    }
}

/// Reads one 2xx reply inside its attempt: a JSON completion, or (streaming) an event
/// stream; a server that ignores `stream: true` answers JSON, which is read as such.
async fn read_reply(response: reqwest::Response, stream: bool, idle: Duration) -> Result<ModelResponse, Failed> {
    let status = response.status().as_u16();
    if stream && !is_json(&response) {
        return read_stream(response.bytes_stream(), sse::Limits::default(), idle).await.map_err(|e| {
            let retry = http::retryable(&e, true);
            Failed::after(status, e, retry)
        });
    }
    let bytes = response
        .bytes()
        .await
        .map_err(|e| Failed::after(status, Error::Transport(format!("reading the reply: {e}")), true))?;
    let value: Value = serde_json::from_slice(&bytes).map_err(|e| {
        let text = String::from_utf8_lossy(&bytes);
        let error = Error::Protocol(format!("the completion is not JSON ({e}): {}", http::truncate(&text, 2048)));
        Failed::after(status, error, false)
    })?;
    parse_completion(&value).map_err(|e| {
        let retry = http::retryable(&e, false);
        Failed::after(status, e, retry)
    })
}

/// `{endpoint}/chat/completions`, with at most one slash between the two.
pub fn chat_completions_url(endpoint: &str) -> String {
    format!("{}/chat/completions", endpoint.trim_end_matches('/'))
}

fn is_json(response: &reqwest::Response) -> bool {
    response
        .headers()
        .get(reqwest::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim_start().starts_with("application/json"))
}

/// The request body for `request`; `stream` adds `stream: true` and asks for the usage
/// chunk (`stream_options.include_usage`); the output cap goes under `cap`'s key.
///
/// Messages: the system prompt first (when non-empty); user and tool messages carry their
/// text blocks joined with `\n`; an assistant message carries its joined text (`null` when
/// it has none but has tool calls, so the call is always replayed) and its tool calls with
/// `arguments` as the JSON text of the call's input.
pub fn request_body(request: &ModelRequest<'_>, stream: bool, cap: MaxTokensParam) -> Value {
    let mut messages = Vec::with_capacity(request.messages.len() + 1);
    if !request.system.is_empty() {
        messages.push(json!({"role": "system", "content": request.system}));
    }
    messages.extend(request.messages.iter().map(wire_message));
    let mut body = Map::new();
    body.insert("model".into(), json!(request.model));
    body.insert(cap.as_str().into(), json!(request.max_tokens));
    body.insert("messages".into(), Value::Array(messages));
    if !request.tools.is_empty() {
        body.insert("tools".into(), request.tools.iter().map(wire_tool).collect::<Value>());
    }
    if stream {
        body.insert("stream".into(), json!(true));
        body.insert("stream_options".into(), json!({"include_usage": true}));
    }
    Value::Object(body)
}

/// Builds request bodies as JSON text, the same JSON as [`request_body`], keeping the wire
/// JSON of each message it has serialised so that the next request of the same
/// conversation serialises only the messages added since.
///
/// Cache rules:
/// - messages: the wire JSON of message `i` is reused while the request's
///   [`history_epoch`](ModelRequest::history_epoch) is the non-zero epoch it was built
///   under and `i` is below the number cached (the conversation was only appended to);
///   everything from the first message not covered is serialised again. Epoch 0 reuses
///   nothing.
/// - the system message: reused while the prompt text is equal (compared, not
///   re-serialised);
/// - the tool list: reused while the request's slice is the same one (address and length)
///   under the same non-zero epoch (the loop's tool list does not change during a task),
///   or else while the specs compare equal.
///
/// A body costs one copy of the cached bytes plus the serialisation of what is new. The
/// encoder holds the wire JSON of the last conversation (about one request body) until a
/// different conversation replaces it.
#[derive(Debug, Default)]
pub struct RequestEncoder {
    /// The epoch `messages` was built under (0: none that can be reused).
    epoch: u64,
    /// The cached messages' wire JSON, comma-separated (`{…},{…}`).
    messages: Vec<u8>,
    /// Where each cached message ends in `messages`.
    ends: Vec<usize>,
    /// The system prompt and its wire message.
    system: Option<(String, Vec<u8>)>,
    /// The tool list and its wire JSON.
    tools: Option<CachedTools>,
}

#[derive(Debug)]
struct CachedTools {
    epoch: u64,
    address: usize,
    specs: Vec<ToolSpec>,
    json: Vec<u8>,
}

impl RequestEncoder {
    /// An empty encoder.
    pub fn new() -> Self {
        Self::default()
    }

    /// The body of `request` as JSON text; `stream` and `cap` as for [`request_body`].
    pub fn encode(&mut self, request: &ModelRequest<'_>, stream: bool, cap: MaxTokensParam) -> Vec<u8> {
        self.update_messages(request.messages, request.history_epoch);
        self.update_system(request.system);
        self.update_tools(request.tools, request.history_epoch);
        let system = self.system.as_ref().map_or(&[][..], |(_, json)| json);
        let tools = self.tools.as_ref().map_or(&[][..], |cached| &cached.json);

        let mut body = Vec::with_capacity(self.messages.len() + system.len() + tools.len() + request.model.len() + 128);
        body.extend_from_slice(b"{\"model\":");
        write_json(&mut body, &request.model);
        body.extend_from_slice(b",\"");
        body.extend_from_slice(cap.as_str().as_bytes());
        body.extend_from_slice(b"\":");
        write_json(&mut body, &request.max_tokens);
        body.extend_from_slice(b",\"messages\":[");
        body.extend_from_slice(system);
        if !system.is_empty() && !self.messages.is_empty() {
            body.push(b',');
        }
        body.extend_from_slice(&self.messages);
        body.push(b']');
        if !tools.is_empty() {
            body.extend_from_slice(b",\"tools\":");
            body.extend_from_slice(tools);
        }
        if stream {
            body.extend_from_slice(b",\"stream\":true,\"stream_options\":{\"include_usage\":true}");
        }
        body.push(b'}');
        body
    }

    /// Brings the cached messages in line with `messages`: keeps what the epoch vouches
    /// for, serialises the rest.
    fn update_messages(&mut self, messages: &[Message], epoch: u64) {
        let keep = if epoch != 0 && epoch == self.epoch { self.ends.len().min(messages.len()) } else { 0 };
        self.ends.truncate(keep);
        self.messages.truncate(self.ends.last().copied().unwrap_or(0));
        self.epoch = epoch;
        for message in &messages[keep..] {
            if !self.ends.is_empty() {
                self.messages.push(b',');
            }
            write_json(&mut self.messages, &wire_message(message));
            self.ends.push(self.messages.len());
        }
    }

    /// Caches the system message's wire JSON (none when the prompt is empty).
    fn update_system(&mut self, system: &str) {
        if system.is_empty() {
            self.system = None;
        } else if self.system.as_ref().is_none_or(|(text, _)| text != system) {
            let mut json = Vec::with_capacity(system.len() + 32);
            write_json(&mut json, &json!({"role": "system", "content": system}));
            self.system = Some((system.to_string(), json));
        }
    }

    /// Caches the tool list's wire JSON (none when there are no tools).
    fn update_tools(&mut self, tools: &[ToolSpec], epoch: u64) {
        if tools.is_empty() {
            self.tools = None;
            return;
        }
        let address = tools.as_ptr() as usize;
        if let Some(cached) = self.tools.as_mut() {
            let same_slice =
                epoch != 0 && cached.epoch == epoch && cached.address == address && cached.specs.len() == tools.len();
            if same_slice || cached.specs.as_slice() == tools {
                (cached.epoch, cached.address) = (epoch, address);
                return;
            }
        }
        let mut json = Vec::new();
        write_json(&mut json, &tools.iter().map(wire_tool).collect::<Value>());
        self.tools = Some(CachedTools { epoch, address, specs: tools.to_vec(), json });
    }
}

/// Appends the JSON text of `value`.
fn write_json<T: serde::Serialize + ?Sized>(out: &mut Vec<u8>, value: &T) {
    // Serialising a JSON value, a string or a number into memory cannot fail.
    serde_json::to_writer(out, value).expect("in-memory JSON serialisation cannot fail");
}

fn wire_message(message: &Message) -> Value {
    let text = message.text();
    match message.role {
        Role::User => json!({"role": "user", "content": text}),
        Role::Tool => json!({
            "role": "tool",
            "tool_call_id": message.tool_call_id.as_deref().unwrap_or_default(),
            "content": text,
        }),
        Role::Assistant => {
            let calls: Vec<Value> = message
                .tool_calls()
                .map(|(id, name, input)| {
                    json!({
                        "id": id,
                        "type": "function",
                        "function": {"name": name, "arguments": input.to_string()},
                    })
                })
                .collect();
            // OpenAI accepts a null content only beside tool calls.
            let content = if text.is_empty() && !calls.is_empty() { Value::Null } else { Value::String(text) };
            let mut out = json!({"role": "assistant", "content": content});
            if !calls.is_empty() {
                out["tool_calls"] = Value::Array(calls);
            }
            out
        }
    }
}

fn wire_tool(tool: &ToolSpec) -> Value {
    json!({
        "type": "function",
        "function": {
            "name": tool.name,
            "description": tool.description,
            "parameters": tool.parameters,
        },
    })
}

/// Maps a non-streamed `chat.completion` object: `choices[0].message.content` becomes a
/// text block (none when empty or null), its `tool_calls` become tool-call blocks, and
/// `finish_reason` and `usage` are mapped as described on [`stop_reason`] and
/// [`provider_usage`].
///
/// # Errors
/// [`Error::Protocol`] for an in-band `{"error": …}` object (with its message) or a body
/// without `choices[0].message`.
pub fn parse_completion(body: &Value) -> Result<ModelResponse, Error> {
    in_band_error(body)?;
    super::record_response(body);
    let choice = body
        .get("choices")
        .and_then(Value::as_array)
        .and_then(|c| c.first())
        .ok_or_else(|| Error::Protocol("the completion has no choices[0]".into()))?;
    let message = choice
        .get("message")
        .filter(|m| m.is_object())
        .ok_or_else(|| Error::Protocol("choices[0] has no message".into()))?;
    let mut content = Vec::new();
    if let Some(text) = message.get("content").and_then(Value::as_str).filter(|t| !t.is_empty()) {
        content.push(Block::Text { text: text.to_string() });
    }
    // Each entry is one call, whatever index it claims (the shared assembler mints ids).
    let mut calls = tool_calls::Assembler::new();
    for call in message.get("tool_calls").and_then(Value::as_array).into_iter().flatten() {
        calls.feed(call);
        calls.close();
    }
    let has_calls = !calls.is_empty();
    content.extend(calls.finish());
    Ok(ModelResponse {
        stop: stop_reason(choice.get("finish_reason").and_then(Value::as_str), has_calls),
        content,
        usage: provider_usage(body.get("usage")),
    })
}

/// Maps OpenAI's `finish_reason`: `stop` → end turn, `length` → max tokens, `tool_calls`
/// and the legacy `function_call` → tool call, anything else (`content_filter`, …) →
/// [`StopReason::Other`]. A missing or null reason means tool call when the reply has tool
/// calls and end turn otherwise.
pub fn stop_reason(finish_reason: Option<&str>, has_tool_calls: bool) -> StopReason {
    match finish_reason {
        Some("stop") => StopReason::EndTurn,
        Some("length") => StopReason::MaxTokens,
        Some("tool_calls" | "function_call") => StopReason::ToolCall,
        Some(other) => StopReason::Other(other.to_string()),
        None if has_tool_calls => StopReason::ToolCall,
        None => StopReason::EndTurn,
    }
}

/// Maps a `usage` object: `prompt_tokens` → input, `completion_tokens` → output,
/// `prompt_tokens_details.cached_tokens` → cached. Anything unreported stays `None`
/// (unknown, not 0).
pub fn provider_usage(usage: Option<&Value>) -> ProviderUsage {
    let Some(usage) = usage.filter(|u| u.is_object()) else {
        return ProviderUsage::default();
    };
    ProviderUsage {
        input_tokens_actual: usage.get("prompt_tokens").and_then(Value::as_u64),
        output_tokens_actual: usage.get("completion_tokens").and_then(Value::as_u64),
        cached_tokens: usage.pointer("/prompt_tokens_details/cached_tokens").and_then(Value::as_u64),
        cache_write_tokens: None,
    }
}

/// An in-band `{"error": {…}}` object (a 200 reply or a streamed chunk) as
/// [`Error::Provider`].
fn in_band_error(value: &Value) -> Result<(), Error> {
    match ProviderError::from_value(value) {
        None => Ok(()),
        Some(error) => Err(Error::Provider(Box::new(error))),
    }
}

/// Puts a streamed completion back together from its `chat.completion.chunk` objects
/// (pure: feed it parsed chunks, then [`finish`](Self::finish)).
///
/// Text is `delta.content` concatenated; tool calls are put together by the
/// [`tool_calls::Assembler`] (keyed by `index`, split where a server streams several calls
/// on one index, ids minted where none was given). `finish_reason` comes from the chunk that carries it, usage from
/// the final usage chunk (whose `choices` may be empty). Only choice 0 is read.
#[derive(Clone, Debug, Default)]
pub struct StreamAssembler {
    text: String,
    calls: tool_calls::Assembler,
    finish_reason: Option<String>,
    usage: ProviderUsage,
    done: bool,
}

impl StreamAssembler {
    /// An empty assembler.
    pub fn new() -> Self {
        Self::default()
    }

    /// Takes the `data` of one SSE event: `[DONE]` marks the end, anything else must be a
    /// chunk object.
    ///
    /// # Errors
    /// [`Error::Protocol`] when the data is not JSON or is an in-band error.
    pub fn feed_data(&mut self, data: &str) -> Result<(), Error> {
        if data.trim() == "[DONE]" {
            self.done = true;
            return Ok(());
        }
        let chunk: Value =
            serde_json::from_str(data).map_err(|e| Error::Protocol(format!("a streamed chunk is not JSON ({e})")))?;
        self.feed(&chunk)
    }

    /// Takes one parsed chunk object.
    ///
    /// # Errors
    /// [`Error::Provider`] for an in-band `{"error": …}` chunk.
    pub fn feed(&mut self, chunk: &Value) -> Result<(), Error> {
        in_band_error(chunk)?;
        super::record_response(chunk);
        if let Some(usage) = chunk.get("usage").filter(|u| u.is_object()) {
            self.usage = provider_usage(Some(usage));
        }
        let choices = chunk.get("choices").and_then(Value::as_array);
        for choice in choices.into_iter().flatten() {
            if choice.get("index").and_then(Value::as_u64).unwrap_or(0) != 0 {
                continue;
            }
            if let Some(delta) = choice.get("delta") {
                if let Some(text) = delta.get("content").and_then(Value::as_str) {
                    self.text.push_str(text);
                }
                let pieces = delta.get("tool_calls").and_then(Value::as_array);
                for piece in pieces.into_iter().flatten() {
                    self.calls.feed(piece);
                }
            }
            if let Some(reason) = choice.get("finish_reason").and_then(Value::as_str) {
                self.finish_reason = Some(reason.to_string());
            }
        }
        Ok(())
    }

    /// Whether `data: [DONE]` was seen (nothing more is to be read).
    pub fn is_done(&self) -> bool {
        self.done
    }

    /// The assembled reply: the text block (none when empty), then the tool calls in index
    /// order, mapped as [`parse_completion`] maps a whole completion.
    ///
    /// # Errors
    /// [`Error::Protocol`] when the stream ended with neither `[DONE]` nor a
    /// `finish_reason` (it was cut short).
    pub fn finish(self) -> Result<ModelResponse, Error> {
        if !self.done && self.finish_reason.is_none() {
            return Err(Error::Protocol("the stream ended before data: [DONE] and without a finish_reason".into()));
        }
        let has_calls = !self.calls.is_empty();
        let mut content = Vec::new();
        if !self.text.is_empty() {
            content.push(Block::Text { text: self.text });
        }
        content.extend(self.calls.finish());
        Ok(ModelResponse { stop: stop_reason(self.finish_reason.as_deref(), has_calls), content, usage: self.usage })
    }
}

/// Reads an SSE byte stream (the body of a streamed completion) to the end or to
/// `data: [DONE]`, and assembles the reply. The [`sse`] decoder frames events under
/// `limits`; each wait for the body is bounded by `idle`.
///
/// # Errors
/// [`Error::Transport`] when the byte stream fails, [`Error::Idle`] when it goes silent,
/// [`Error::Limit`] past a limit, [`Error::Protocol`] for a malformed chunk (never
/// skipped) or a stream cut short (see [`StreamAssembler::finish`]), [`Error::Provider`]
/// for an in-band error.
pub async fn read_stream<S, B, E>(bytes: S, limits: sse::Limits, idle: Duration) -> Result<ModelResponse, Error>
where
    S: Stream<Item = Result<B, E>>,
    B: AsRef<[u8]>,
    E: Display,
{
    let mut assembler = StreamAssembler::new();
    sse::read(bytes, limits, idle, |event| {
        assembler.feed_data(&event.data)?;
        Ok(if assembler.is_done() { sse::Flow::Stop } else { sse::Flow::Continue })
    })
    .await?;
    assembler.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::convert::Infallible;

    const MT: MaxTokensParam = MaxTokensParam::MaxTokens;

    fn request<'a>(system: &'a str, messages: &'a [Message], tools: &'a [ToolSpec]) -> ModelRequest<'a> {
        ModelRequest { model: "gpt-test", system, messages, tools, max_tokens: 256, task_text: "", history_epoch: 0 }
    }

    fn call(id: &str, name: &str, input: Value) -> Block {
        Block::ToolCall { id: id.into(), name: name.into(), input }
    }

    #[test]
    fn url_tolerates_a_trailing_slash() {
        let want = "http://127.0.0.1:8080/v1/chat/completions";
        assert_eq!(chat_completions_url("http://127.0.0.1:8080/v1"), want);
        assert_eq!(chat_completions_url("http://127.0.0.1:8080/v1/"), want);
    }

    #[test]
    fn request_body_translates_every_role() {
        let messages = vec![
            Message::user("do it"),
            Message::assistant(vec![
                Block::Text { text: "first".into() },
                Block::Text { text: "second".into() },
                call("call_1", "sh", json!({"command": "ls"})),
            ]),
            Message::tool_result("call_1", "a.txt", false),
            Message::assistant(vec![Block::Text { text: "done".into() }]),
        ];
        let tools = vec![ToolSpec {
            name: "sh".into(),
            description: "runs a command".into(),
            parameters: json!({"type": "object"}),
        }];
        let body = request_body(&request("be brief", &messages, &tools), false, MT);
        assert_eq!(
            body,
            json!({
                "model": "gpt-test",
                "max_tokens": 256,
                "messages": [
                    {"role": "system", "content": "be brief"},
                    {"role": "user", "content": "do it"},
                    {"role": "assistant", "content": "first\nsecond", "tool_calls": [
                        {"id": "call_1", "type": "function",
                         "function": {"name": "sh", "arguments": "{\"command\":\"ls\"}"}},
                    ]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "a.txt"},
                    {"role": "assistant", "content": "done"},
                ],
                "tools": [{"type": "function", "function": {
                    "name": "sh", "description": "runs a command",
                    "parameters": {"type": "object"}}}],
            })
        );
    }

    #[test]
    fn tool_call_message_without_text_is_replayed_with_null_content() {
        let messages = vec![
            Message::user("go"),
            Message::assistant(vec![call("call_a", "sh", json!({})), call("call_b", "read", json!({"path": "x"}))]),
            Message::tool_result("call_a", "", true),
            Message::tool_result("call_b", "x", false),
        ];
        let body = request_body(&request("", &messages, &[]), false, MT);
        let wire = body["messages"].as_array().unwrap();
        assert_eq!(wire.len(), 4, "no system message when the prompt is empty");
        assert_eq!(wire[1]["content"], Value::Null);
        assert_eq!(wire[1]["tool_calls"][0]["id"], "call_a");
        assert_eq!(wire[1]["tool_calls"][0]["function"]["arguments"], "{}");
        assert_eq!(wire[1]["tool_calls"][1]["id"], "call_b");
        assert_eq!(wire[2], json!({"role": "tool", "tool_call_id": "call_a", "content": ""}));
    }

    #[test]
    fn streaming_asks_for_usage_and_no_tools_key_without_tools() {
        let messages = vec![Message::user("hi")];
        let body = request_body(&request("", &messages, &[]), true, MT);
        assert_eq!(body["stream"], true);
        assert_eq!(body["stream_options"], json!({"include_usage": true}));
        assert!(body.get("tools").is_none());
        let plain = request_body(&request("", &messages, &[]), false, MT);
        assert!(plain.get("stream").is_none());
        assert!(plain.get("stream_options").is_none());
    }

    fn encoded(encoder: &mut RequestEncoder, request: &ModelRequest<'_>, stream: bool) -> Value {
        serde_json::from_slice(&encoder.encode(request, stream, MT)).expect("the encoder writes JSON")
    }

    fn with_epoch<'a>(request: ModelRequest<'a>, history_epoch: u64) -> ModelRequest<'a> {
        ModelRequest { history_epoch, ..request }
    }

    /// Turn `i`'s assistant reply and tool results, in shapes that vary with `i`.
    fn turn_messages(i: usize) -> Vec<Message> {
        let id = format!("call_{i}");
        match i % 3 {
            0 => vec![
                Message::assistant(vec![call(&id, "sh", json!({"command": format!("echo {i} \"é\"")}))]),
                Message::tool_result(&id, format!("{i} \"é\"\n\ttab ✓"), false),
            ],
            1 => vec![
                Message::assistant(vec![
                    Block::Text { text: format!("step {i}") },
                    call(&id, "sh", json!({})),
                    call(&format!("{id}b"), "read", json!({"path": "a\\b"})),
                ]),
                Message::tool_result(&id, "", true),
                Message::tool_result(format!("{id}b"), "</script>\u{0}", false),
            ],
            _ => vec![Message::user(format!("go on ({i})"))],
        }
    }

    fn tools() -> Vec<ToolSpec> {
        vec![ToolSpec {
            name: "sh".into(),
            description: "runs a command".into(),
            parameters: json!({"type": "object", "properties": {"command": {"type": "string"}}}),
        }]
    }

    #[test]
    fn encoder_writes_the_same_json_as_request_body_over_a_growing_conversation() {
        let tools = tools();
        let mut encoder = RequestEncoder::new();
        let mut messages = vec![Message::user("do \"it\" ✓")];
        for i in 0..12 {
            let stream = i % 2 == 1;
            let req = with_epoch(request("be brief", &messages, &tools), 7);
            assert_eq!(encoded(&mut encoder, &req, stream), request_body(&req, stream, MT), "turn {i}");
            assert_eq!(encoder.ends.len(), messages.len(), "every message cached");
            messages.extend(turn_messages(i));
        }
        // No system prompt, no tools.
        let req = with_epoch(request("", &messages, &[]), 7);
        assert_eq!(encoded(&mut encoder, &req, false), request_body(&req, false, MT));
    }

    #[test]
    fn encoder_rebuilds_after_an_epoch_change_and_reuses_nothing_at_epoch_zero() {
        let tools = tools();
        let mut encoder = RequestEncoder::new();
        let mut first = vec![Message::user("first task")];
        (0..4).for_each(|i| first.extend(turn_messages(i)));
        let req = with_epoch(request("sys", &first, &tools), 3);
        assert_eq!(encoded(&mut encoder, &req, false), request_body(&req, false, MT));

        // A replaced history (a summary, then the same tail): new epoch, shorter, different.
        let mut replaced = vec![Message::user("summary of the first turns")];
        replaced.extend(first[first.len() - 2..].iter().cloned());
        let req = with_epoch(request("sys", &replaced, &tools), 4);
        assert_eq!(encoded(&mut encoder, &req, false), request_body(&req, false, MT));

        // A different conversation of the same length under yet another epoch.
        let mut other: Vec<Message> = vec![Message::user("second task")];
        (5..9).for_each(|i| other.extend(turn_messages(i)));
        other.truncate(first.len());
        let req = with_epoch(request("sys", &other, &tools), 5);
        assert_eq!(encoded(&mut encoder, &req, true), request_body(&req, true, MT));

        // Epoch 0 (unknown): consecutive, unrelated conversations are each encoded whole.
        for conversation in [&first, &other, &replaced] {
            let req = request("sys", conversation, &tools);
            assert_eq!(encoded(&mut encoder, &req, false), request_body(&req, false, MT));
        }
    }

    #[test]
    fn encoder_reuses_messages_only_under_the_same_epoch() {
        let tools = tools();
        let mut encoder = RequestEncoder::new();
        let cached = vec![Message::user("cached"), Message::user("also cached")];
        encoder.encode(&with_epoch(request("", &cached, &tools), 9), false, MT);
        // Same epoch: the first two messages are taken from the cache without being looked
        // at (which is why the loop must change the epoch when it rewrites history).
        let rewritten = vec![Message::user("rewritten"), Message::user("also rewritten"), Message::user("new")];
        let body = encoded(&mut encoder, &with_epoch(request("", &rewritten, &tools), 9), false);
        let contents: Vec<&Value> = body["messages"].as_array().unwrap().iter().map(|m| &m["content"]).collect();
        assert_eq!(contents, [&json!("cached"), &json!("also cached"), &json!("new")]);
        // A new epoch: nothing is reused.
        let req = with_epoch(request("", &rewritten, &tools), 10);
        assert_eq!(encoded(&mut encoder, &req, false), request_body(&req, false, MT));
    }

    #[test]
    fn encoder_follows_a_changed_system_prompt_and_tool_list() {
        let mut tools = tools();
        let mut encoder = RequestEncoder::new();
        let messages = vec![Message::user("hi")];
        let req = with_epoch(request("one", &messages, &tools), 2);
        assert_eq!(encoded(&mut encoder, &req, false), request_body(&req, false, MT));
        let req = with_epoch(request("two", &messages, &tools), 2);
        assert_eq!(encoded(&mut encoder, &req, false), request_body(&req, false, MT));
        let changed = {
            tools[0].description = "runs a command, changed".into();
            tools.clone()
        };
        let req = with_epoch(request("two", &messages, &changed), 2);
        assert_eq!(encoded(&mut encoder, &req, false), request_body(&req, false, MT));
        let req = with_epoch(request("", &messages, &[]), 2);
        assert_eq!(encoded(&mut encoder, &req, false), request_body(&req, false, MT));
    }

    #[test]
    fn completion_maps_text_tool_calls_and_usage() {
        let body = json!({
            "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
                "role": "assistant",
                "content": "looking",
                "tool_calls": [
                    {"id": "c1", "type": "function",
                     "function": {"name": "sh", "arguments": "{\"command\":\"ls\"}"}},
                    {"id": "c2", "type": "function",
                     "function": {"name": "sh", "arguments": "not json"}},
                    {"id": "", "type": "function",
                     "function": {"name": "noargs", "arguments": ""}},
                ]}}],
            "usage": {"prompt_tokens": 11, "completion_tokens": 7,
                      "prompt_tokens_details": {"cached_tokens": 4}},
        });
        let r = parse_completion(&body).unwrap();
        assert_eq!(
            r.content,
            vec![
                Block::Text { text: "looking".into() },
                call("c1", "sh", json!({"command": "ls"})),
                call("c2", "sh", json!({"_raw": "not json"})),
                call("call_2", "noargs", json!({})),
            ]
        );
        assert_eq!(r.stop, StopReason::ToolCall);
        assert_eq!(
            r.usage,
            ProviderUsage {
                input_tokens_actual: Some(11),
                output_tokens_actual: Some(7),
                cached_tokens: Some(4),
                cache_write_tokens: None,
            }
        );
    }

    #[test]
    fn null_content_and_absent_usage_stay_absent() {
        let body = json!({"choices": [{"message": {"content": null}, "finish_reason": "stop"}]});
        let r = parse_completion(&body).unwrap();
        assert!(r.content.is_empty());
        assert_eq!(r.stop, StopReason::EndTurn);
        assert_eq!(r.usage, ProviderUsage::default());
        let partial = provider_usage(Some(&json!({"prompt_tokens": 3})));
        assert_eq!(partial.input_tokens_actual, Some(3));
        assert_eq!(partial.output_tokens_actual, None);
        assert_eq!(partial.cached_tokens, None);
    }

    #[test]
    fn finish_reason_maps_to_stop_reason() {
        let table = [
            (Some("stop"), false, StopReason::EndTurn),
            (Some("stop"), true, StopReason::EndTurn),
            (Some("length"), false, StopReason::MaxTokens),
            (Some("tool_calls"), true, StopReason::ToolCall),
            (Some("function_call"), true, StopReason::ToolCall),
            (Some("content_filter"), false, StopReason::Other("content_filter".into())),
            (None, false, StopReason::EndTurn),
            (None, true, StopReason::ToolCall),
        ];
        for (reason, calls, want) in table {
            assert_eq!(stop_reason(reason, calls), want, "{reason:?} {calls}");
        }
    }

    #[test]
    fn in_band_error_is_a_provider_error_with_type_message_and_code() {
        let body = json!({"error": {"message": "model overloaded", "type": "server_error", "code": 503}});
        let err = parse_completion(&body).unwrap_err();
        assert_eq!(err.to_string(), "the provider reported an error: server_error: model overloaded (code 503)");
        let mut asm = StreamAssembler::new();
        let err = asm.feed_data(r#"{"error":{"message":"boom"}}"#).unwrap_err();
        assert_eq!(err.to_string(), "the provider reported an error: boom");
        assert!(matches!(parse_completion(&json!({"choices": []})), Err(Error::Protocol(_))));
    }

    fn chunk(delta: Value, finish_reason: Option<&str>) -> Value {
        json!({"object": "chat.completion.chunk",
               "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]})
    }

    #[test]
    fn assembler_joins_text_and_parallel_tool_call_pieces() {
        let mut asm = StreamAssembler::new();
        let chunks = [
            chunk(json!({"role": "assistant", "content": ""}), None),
            chunk(json!({"content": "let me "}), None),
            chunk(json!({"content": "check"}), None),
            chunk(
                json!({"tool_calls": [{"index": 0, "id": "c1", "type": "function",
                "function": {"name": "sh", "arguments": ""}}]}),
                None,
            ),
            chunk(json!({"tool_calls": [{"index": 0, "function": {"arguments": "{\"comm"}}]}), None),
            chunk(
                json!({"tool_calls": [{"index": 1, "id": "c2", "type": "function",
                "function": {"name": "read", "arguments": "{\"path\""}}]}),
                None,
            ),
            chunk(json!({"tool_calls": [{"index": 0, "function": {"arguments": "and\":\"ls\"}"}}]}), None),
            chunk(json!({"tool_calls": [{"index": 1, "function": {"arguments": ":\"a\"}"}}]}), None),
            chunk(json!({}), Some("tool_calls")),
            json!({"choices": [], "usage": {"prompt_tokens": 20, "completion_tokens": 9}}),
        ];
        for c in &chunks {
            asm.feed(c).unwrap();
        }
        asm.feed_data("[DONE]").unwrap();
        assert!(asm.is_done());
        let r = asm.finish().unwrap();
        assert_eq!(
            r.content,
            vec![
                Block::Text { text: "let me check".into() },
                call("c1", "sh", json!({"command": "ls"})),
                call("c2", "read", json!({"path": "a"})),
            ]
        );
        assert_eq!(r.stop, StopReason::ToolCall);
        assert_eq!(r.usage.input_tokens_actual, Some(20));
        assert_eq!(r.usage.output_tokens_actual, Some(9));
        assert_eq!(r.usage.cached_tokens, None);
    }

    #[test]
    fn assembler_without_usage_chunk_reports_no_usage() {
        let mut asm = StreamAssembler::new();
        asm.feed(&chunk(json!({"content": "hi"}), Some("length"))).unwrap();
        asm.feed(&json!({"choices": [], "usage": null})).unwrap();
        let r = asm.finish().unwrap();
        assert_eq!(r.stop, StopReason::MaxTokens);
        assert_eq!(r.usage, ProviderUsage::default());
    }

    #[test]
    fn stream_cut_short_is_an_error() {
        let mut asm = StreamAssembler::new();
        asm.feed(&chunk(json!({"content": "half"}), None)).unwrap();
        assert!(matches!(asm.finish(), Err(Error::Protocol(_))));
    }

    /// A streamed reply with multi-byte characters in the text and in the tool arguments,
    /// a comment line, a CRLF-framed event, parallel tool calls and a usage chunk.
    fn sse_body() -> Vec<u8> {
        let chunks = [
            chunk(json!({"role": "assistant", "content": ""}), None),
            chunk(json!({"content": "héllo "}), None),
            chunk(json!({"content": "wörld ✓"}), None),
            chunk(
                json!({"tool_calls": [{"index": 0, "id": "call_é", "type": "function",
                "function": {"name": "sh", "arguments": ""}}]}),
                None,
            ),
            chunk(json!({"tool_calls": [{"index": 0, "function": {"arguments": "{\"command\":\"echo hé"}}]}), None),
            chunk(
                json!({"tool_calls": [{"index": 1, "id": "call_2", "type": "function",
                "function": {"name": "write", "arguments": "{\"text\":\"wö"}}]}),
                None,
            ),
            chunk(json!({"tool_calls": [{"index": 0, "function": {"arguments": "llo ✓\"}"}}]}), None),
            chunk(json!({"tool_calls": [{"index": 1, "function": {"arguments": "rld ✓\"}"}}]}), None),
            chunk(json!({}), Some("tool_calls")),
            json!({"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 5,
                   "prompt_tokens_details": {"cached_tokens": 3}}}),
        ];
        let mut body = String::from(": keep-alive\n\n");
        for (i, c) in chunks.iter().enumerate() {
            let end = if i == 2 { "\r\n\r\n" } else { "\n\n" };
            body.push_str(&format!("data: {c}{end}"));
        }
        body.push_str("data: [DONE]\n\n");
        body.into_bytes()
    }

    async fn read_pieces(pieces: Vec<Vec<u8>>) -> ModelResponse {
        let bytes = futures::stream::iter(pieces.into_iter().map(Ok::<_, Infallible>));
        read_stream(bytes, sse::Limits::default(), Duration::from_secs(5)).await.unwrap()
    }

    #[tokio::test]
    async fn sse_split_at_every_byte_offset_gives_the_same_reply() {
        let body = sse_body();
        let want = ModelResponse {
            content: vec![
                Block::Text { text: "héllo wörld ✓".into() },
                call("call_é", "sh", json!({"command": "echo héllo ✓"})),
                call("call_2", "write", json!({"text": "wörld ✓"})),
            ],
            stop: StopReason::ToolCall,
            usage: ProviderUsage {
                input_tokens_actual: Some(10),
                output_tokens_actual: Some(5),
                cached_tokens: Some(3),
                cache_write_tokens: None,
            },
        };
        let mut inside_a_character = 0;
        for i in 0..=body.len() {
            if i < body.len() && (body[i] & 0xC0) == 0x80 {
                inside_a_character += 1;
            }
            let got = read_pieces(vec![body[..i].to_vec(), body[i..].to_vec()]).await;
            assert_eq!(got, want, "split at byte {i}");
        }
        assert!(inside_a_character >= 10, "splits inside characters were tried");
        let bytewise = read_pieces(body.iter().map(|b| vec![*b]).collect()).await;
        assert_eq!(bytewise, want, "one byte per piece");
    }

    #[tokio::test]
    async fn sse_leading_byte_order_mark_is_skipped_even_when_split() {
        let mut body = b"\xEF\xBB\xBF".to_vec();
        body.extend_from_slice(&sse_body());
        let want = read_pieces(vec![sse_body()]).await;
        for i in 0..=4 {
            let got = read_pieces(vec![body[..i].to_vec(), body[i..].to_vec()]).await;
            assert_eq!(got, want, "split at byte {i}");
        }
        let bytewise = read_pieces(body.iter().map(|b| vec![*b]).collect()).await;
        assert_eq!(bytewise, want, "one byte per piece");
    }

    #[tokio::test]
    async fn sse_reading_stops_at_done() {
        let mut body =
            b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"ok\"}}]}\n\ndata: [DONE]\n\n".to_vec();
        body.extend_from_slice(b"data: not json\n\n");
        let r = read_pieces(vec![body]).await;
        assert_eq!(r.content, vec![Block::Text { text: "ok".into() }]);
        assert_eq!(r.stop, StopReason::EndTurn);
    }
}
