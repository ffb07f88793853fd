//! A fake Anthropic Messages API over a real socket on `127.0.0.1`, for driving the
//! `anthropic` driver (and `mur run` with it) in tests.
//!
//! It answers `POST /v1/messages` with the replies it was given, in order: a JSON message,
//! an event stream (`event: <name>\ndata: <json>\n\n` per event), an HTTP error with
//! Anthropic's error object, or raw frames that end normally, stall or are cut
//! ([`AnthropicReply::Raw`], [`AnthropicReply::Stall`], [`AnthropicReply::Drop`]). It
//! records every request body. Running out of replies gets 500.

use crate::fake_openai::{End, raw_response};
use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use serde_json::{Value, json};
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use tokio::sync::oneshot;

/// One reply of the fake server.
#[derive(Clone, Debug)]
pub enum AnthropicReply {
    /// `200 application/json` with this message object.
    Json(Value),
    /// `200 text/event-stream`: each `(event, data)` as one event.
    Sse(Vec<(String, Value)>),
    /// An error status with Anthropic's error object `{"type":"error","error":{type,message}}`.
    Status(u16, String, String),
    /// `200 text/event-stream` with these frames as the body, then the body ends.
    Raw(Vec<Vec<u8>>),
    /// As [`AnthropicReply::Raw`], then silence with the connection open.
    Stall(Vec<Vec<u8>>),
    /// As [`AnthropicReply::Raw`], then the connection is cut.
    Drop(Vec<Vec<u8>>),
}

impl AnthropicReply {
    /// A streamed text reply: `message_start` with `usage`, one text block holding `text`,
    /// `message_delta` with `stop_reason: end_turn` and `output_tokens`, `message_stop`.
    pub fn streamed_text(text: &str, usage: Value, output_tokens: u64) -> AnthropicReply {
        AnthropicReply::Sse(streamed_text_events(text, usage, output_tokens))
    }

    /// A JSON text reply ending the turn, with `usage`.
    pub fn text(text: &str, usage: Value) -> AnthropicReply {
        AnthropicReply::Json(json!({
            "id": "msg_fake", "type": "message", "role": "assistant", "model": "claude-fake",
            "content": [{"type": "text", "text": text}],
            "stop_reason": "end_turn", "stop_sequence": null, "usage": usage,
        }))
    }
}

/// The events of [`AnthropicReply::streamed_text`].
pub fn streamed_text_events(text: &str, usage: Value, output_tokens: u64) -> Vec<(String, Value)> {
    let e = |name: &str, data: Value| (name.to_string(), data);
    vec![
        e(
            "message_start",
            json!({"type": "message_start", "message": {"id": "msg_fake", "type": "message", "role": "assistant",
                   "model": "claude-fake", "content": [], "stop_reason": null, "usage": usage}}),
        ),
        e(
            "content_block_start",
            json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
        ),
        e(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}}),
        ),
        e("content_block_stop", json!({"type": "content_block_stop", "index": 0})),
        e(
            "message_delta",
            json!({"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                   "usage": {"output_tokens": output_tokens}}),
        ),
        e("message_stop", json!({"type": "message_stop"})),
    ]
}

/// The `event: <name>\ndata: <json>\n\n` frame of one event.
pub fn event_frame(name: &str, data: &Value) -> Vec<u8> {
    format!("event: {name}\ndata: {data}\n\n").into_bytes()
}

struct Shared {
    replies: Mutex<VecDeque<AnthropicReply>>,
    received: Mutex<Vec<Value>>,
}

/// A running fake server; dropping it shuts the server down.
pub struct FakeAnthropic {
    url: String,
    shared: Arc<Shared>,
    shutdown: Option<oneshot::Sender<()>>,
}

impl FakeAnthropic {
    /// Binds `127.0.0.1:0` and serves `replies`, one per request, in order.
    ///
    /// # Panics
    /// When no port can be bound, or outside a Tokio runtime.
    pub fn start(replies: Vec<AnthropicReply>) -> FakeAnthropic {
        mur_nats::tls::install_crypto_provider();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("fake anthropic: bind 127.0.0.1:0");
        listener.set_nonblocking(true).expect("fake anthropic: set the listener non-blocking");
        let addr = listener.local_addr().expect("fake anthropic: local address");
        let listener = tokio::net::TcpListener::from_std(listener)
            .expect("fake anthropic: must be started inside a tokio runtime");
        let shared = Arc::new(Shared { replies: Mutex::new(replies.into()), received: Mutex::new(Vec::new()) });
        let app = Router::new().route("/v1/messages", post(messages)).with_state(Arc::clone(&shared));
        let (shutdown, stopped) = oneshot::channel::<()>();
        tokio::spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(async move {
                    let _ = stopped.await;
                })
                .await;
        });
        FakeAnthropic { url: format!("http://{addr}"), shared, shutdown: Some(shutdown) }
    }

    /// The base URL (what `inference.endpoint` holds).
    pub fn url(&self) -> String {
        self.url.clone()
    }

    /// The JSON bodies received so far, oldest first.
    pub fn requests(&self) -> Vec<Value> {
        self.shared.received.lock().unwrap().clone()
    }
}

impl Drop for FakeAnthropic {
    fn drop(&mut self) {
        if let Some(shutdown) = self.shutdown.take() {
            let _ = shutdown.send(());
        }
    }
}

async fn messages(State(shared): State<Arc<Shared>>, body: Bytes) -> Response {
    let body = serde_json::from_slice(&body).unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&body).into()));
    shared.received.lock().unwrap().push(body);
    let reply = shared.replies.lock().unwrap().pop_front();
    match reply {
        None => (StatusCode::INTERNAL_SERVER_ERROR, "fake anthropic: no reply left").into_response(),
        Some(AnthropicReply::Json(v)) => axum::Json(v).into_response(),
        Some(AnthropicReply::Sse(events)) => {
            let text: Vec<u8> = events.iter().flat_map(|(name, data)| event_frame(name, data)).collect();
            ([(header::CONTENT_TYPE, "text/event-stream")], text).into_response()
        }
        Some(AnthropicReply::Status(code, kind, message)) => (
            StatusCode::from_u16(code).expect("fake anthropic: a valid HTTP status"),
            axum::Json(json!({"type": "error", "error": {"type": kind, "message": message}})),
        )
            .into_response(),
        Some(AnthropicReply::Raw(frames)) => raw_response(frames, End::Close),
        Some(AnthropicReply::Stall(frames)) => raw_response(frames, End::Stall),
        Some(AnthropicReply::Drop(frames)) => raw_response(frames, End::Cut),
    }
}
