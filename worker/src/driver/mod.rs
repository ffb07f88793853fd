//! Model drivers: one request/response exchange with a model, in the runtime's
//! driver-neutral message model (`mur_proto::message`).
//!
//! Stop reasons follow the runtime reference, §4: `tool_call`, `end_turn`,
//! `max_tokens`, `error`; anything else is carried as [`StopReason::Other`] and fails the
//! task with `error: unsupported stop_reason '<x>'`.

pub mod anthropic;
pub mod http;
pub mod openai;
pub mod process;
pub mod scripted;
pub mod sse;
pub mod tool_calls;

use async_trait::async_trait;
use mur_proto::message::{Block, Message};
use mur_proto::trace::ProviderUsage;
use serde_json::Value;

/// A tool as offered to the model.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolSpec {
    /// Name the model calls it by.
    pub name: String,
    /// What it does.
    pub description: String,
    /// JSON schema of its input object.
    pub parameters: Value,
}

/// Everything one model call sends.
#[derive(Clone, Copy, Debug)]
pub struct ModelRequest<'a> {
    /// Provider model name (empty for the scripted driver).
    pub model: &'a str,
    /// The system prompt.
    pub system: &'a str,
    /// The conversation, oldest first.
    pub messages: &'a [Message],
    /// Which conversation `messages` is ([`History::epoch`]): while two calls carry the
    /// same non-zero epoch, the later one's messages extend the earlier one's (the first
    /// messages are the same, unchanged), so a driver may reuse work done per message,
    /// keyed by (epoch, index). The loop takes a fresh epoch whenever it replaces or
    /// truncates the history. 0 means unknown: nothing may be assumed, nothing reused.
    ///
    /// [`History::epoch`]: crate::session::machine::History::epoch
    pub history_epoch: u64,
    /// Tools the model may call.
    pub tools: &'a [ToolSpec],
    /// Output cap for this call (`inference.max_tokens`); the `openai` driver sends it as
    /// `max_tokens` or `max_completion_tokens` (`inference.max_tokens_param`).
    pub max_tokens: u32,
    /// The task's text (the scripted driver substitutes it for `{{task}}`).
    pub task_text: &'a str,
}

/// Why the model stopped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// The model asked for tools.
    ToolCall,
    /// The model finished.
    EndTurn,
    /// The output cap cut the reply short; the task still ends `ok` with the partial text.
    MaxTokens,
    /// The provider reported an error in-band.
    Error(String),
    /// A stop reason the runtime does not know.
    Other(String),
}

/// One model reply.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelResponse {
    /// Text and tool-call blocks, in order.
    pub content: Vec<Block>,
    /// Why it stopped.
    pub stop: StopReason,
    /// Usage as the provider reported it (fields absent when unreported).
    pub usage: ProviderUsage,
}

/// Why a model call failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The provider answered with an HTTP error status.
    #[error("provider returned HTTP {status}: {body}")]
    Status {
        /// HTTP status code.
        status: u16,
        /// The provider's error as [`ProviderError`]'s text when the body is a provider
        /// error object, else the raw body (truncated to 2 KiB).
        body: String,
        /// The parsed error object, when the body is one.
        provider: Option<Box<ProviderError>>,
    },
    /// The provider reported an error inside a 200 reply or a stream (an OpenAI
    /// `{"error": …}` chunk, an Anthropic `error` event).
    #[error("the provider reported an error: {0}")]
    Provider(Box<ProviderError>),
    /// The connection failed or broke.
    #[error("connection to the provider failed: {0}")]
    Transport(String),
    /// No complete answer within `inference.timeout_secs` (the whole attempt: request,
    /// headers and body).
    #[error("model call timed out after {0} s")]
    Timeout(u64),
    /// A streamed reply went silent for `inference.idle_timeout_secs`.
    #[error("the provider sent nothing for {0} s (inference.idle_timeout_secs)")]
    Idle(u64),
    /// The provider's answer did not follow its wire format.
    #[error("malformed provider response: {0}")]
    Protocol(String),
    /// A streamed reply broke one of the SSE decoder's size limits ([`sse::Limits`]).
    #[error("the provider's stream broke a limit: {0}")]
    Limit(String),
    /// The process transport's program failed.
    #[error("{0}")]
    Process(String),
    /// The scripted driver could not answer.
    #[error("scripted driver: {0}")]
    Script(String),
}

/// Records the response's `id` and `model` (when the provider sent them) on the current
/// span: the runner's `chat` span declares `gen_ai.response.id` and `gen_ai.response.model`
/// (issue #32 §Spans); on any other span this does nothing.
pub(crate) fn record_response(body: &serde_json::Value) {
    let span = tracing::Span::current();
    if let Some(id) = body.get("id").and_then(serde_json::Value::as_str) {
        span.record("gen_ai.response.id", id);
    }
    if let Some(model) = body.get("model").and_then(serde_json::Value::as_str) {
        span.record("gen_ai.response.model", model);
    }
}

impl Error {
    /// A short, bounded name of what went wrong, for `error.type` on the `chat` span and
    /// the model-call metrics (issue #32; the OpenTelemetry convention: a low-cardinality
    /// identifier, the HTTP status code for an HTTP error): `"429"`, `"provider_error"`,
    /// `"transport"`, `"timeout"`, `"idle_timeout"`, `"protocol"`, `"limit"`, `"process"`,
    /// `"script"`.
    pub fn kind(&self) -> String {
        match self {
            Error::Status { status, .. } => status.to_string(),
            Error::Provider(_) => "provider_error".into(),
            Error::Transport(_) => "transport".into(),
            Error::Timeout(_) => "timeout".into(),
            Error::Idle(_) => "idle_timeout".into(),
            Error::Protocol(_) => "protocol".into(),
            Error::Limit(_) => "limit".into(),
            Error::Process(_) => "process".into(),
            Error::Script(_) => "script".into(),
        }
    }
}

/// A provider's error object, parsed the same way for both providers:
/// OpenAI's `{"error": {"message", "type", "code", "param"}}` and Anthropic's
/// `{"type": "error", "error": {"type", "message"}}` (the API references' error sections).
/// Shown as `<type>: <message> (code <code>)`, leaving out what is absent.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ProviderError {
    /// `error.type` (`invalid_request_error`, `overloaded_error`, `server_error`…).
    pub kind: Option<String>,
    /// `error.message`; the whole `error` value as JSON text when it has no message.
    pub message: String,
    /// `error.code` (OpenAI; a string or a number), e.g. `rate_limit_exceeded`.
    pub code: Option<String>,
}

impl ProviderError {
    /// The error of a JSON value holding an `error` member (an object, or a bare string);
    /// `None` when there is none or it is `null`.
    pub fn from_value(value: &serde_json::Value) -> Option<ProviderError> {
        use serde_json::Value;
        let error = value.get("error").filter(|e| !e.is_null())?;
        if let Some(text) = error.as_str() {
            return Some(ProviderError { message: text.to_string(), ..Default::default() });
        }
        let text = |key: &str| match error.get(key) {
            Some(Value::String(s)) if !s.is_empty() => Some(s.clone()),
            Some(Value::Number(n)) => Some(n.to_string()),
            _ => None,
        };
        Some(ProviderError {
            kind: text("type"),
            message: text("message").unwrap_or_else(|| error.to_string()),
            code: text("code"),
        })
    }

    /// The error of a response body, when it is JSON holding an `error` member.
    pub fn from_body(body: &str) -> Option<ProviderError> {
        ProviderError::from_value(&serde_json::from_str(body).ok()?)
    }

    /// Whether the error says the provider is briefly unable to answer, so the same call
    /// may succeed later: type or code `overloaded_error`, `api_error`, `server_error`,
    /// `rate_limit_error`, `rate_limit_exceeded`, `service_unavailable` (Anthropic's and
    /// OpenAI's documented transient errors). Others (invalid request, authentication…)
    /// are final.
    pub fn is_transient(&self) -> bool {
        const TRANSIENT: &[&str] = &[
            "overloaded_error",
            "api_error",
            "server_error",
            "rate_limit_error",
            "rate_limit_exceeded",
            "service_unavailable",
        ];
        [&self.kind, &self.code].into_iter().flatten().any(|k| TRANSIENT.contains(&k.as_str()))
    }
}

impl std::fmt::Display for ProviderError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if let Some(kind) = &self.kind {
            write!(f, "{kind}: ")?;
        }
        f.write_str(&self.message)?;
        if let Some(code) = self.code.as_ref().filter(|c| Some(*c) != self.kind.as_ref()) {
            write!(f, " (code {code})")?;
        }
        Ok(())
    }
}

/// A model driver. Implementations hold their configuration and HTTP client.
#[async_trait]
pub trait Driver: Send + Sync {
    /// `openai`, `anthropic`, `scripted`: recorded on `session_start`.
    fn kind(&self) -> &'static str;

    /// One model call.
    ///
    /// # Errors
    /// [`Error`] when no usable reply was obtained.
    async fn call(&self, request: &ModelRequest<'_>) -> Result<ModelResponse, Error>;

    /// One model call with the log of its HTTP attempts (retries included), so every
    /// attempt can be traced. Drivers without retries keep the default: no log.
    async fn call_logged(&self, request: &ModelRequest<'_>) -> (Result<ModelResponse, Error>, Vec<http::Attempt>) {
        (self.call(request).await, Vec::new())
    }

    /// The session is taking over a task whose first `turns` model calls were made by
    /// another session (issue #8 §Takeover). Models keep no state between calls, so the
    /// default does nothing; the scripted driver goes on at reply `turns`.
    fn taken_over_at(&self, turns: u32) {
        let _ = turns;
    }

    /// A task starts in this session (before its first model call, and before
    /// [`Driver::taken_over_at`] when it is taken over). Models keep no state between
    /// calls, so the default does nothing; a repeating scripted driver starts its replies
    /// over.
    fn task_started(&self) {}
}
