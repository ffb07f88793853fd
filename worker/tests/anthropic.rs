//! The `anthropic` driver and the retrying HTTP exchange against a fake Messages API on a
//! real socket (127.0.0.1, port 0).
//!
//! [`Fake`] serves scripted replies in order (JSON, SSE event lists, error statuses with an
//! optional `Retry-After`, or no answer at all) and records every request it receives.
//! The dropped-connection test uses a raw TCP listener instead.

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use mur_proto::message::{Block, Message};
use mur_proto::trace::ProviderUsage;
use mur_worker::driver::anthropic::{Anthropic, Config};
use mur_worker::driver::http::Policy;
use mur_worker::driver::{Driver, Error, ModelRequest, StopReason, ToolSpec};
use serde_json::{Value, json};
use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// How long a test waits for a condition before failing.
const DEADLINE: Duration = Duration::from_secs(10);

/// One scripted answer of the fake server.
enum Reply {
    /// 200 with this JSON body.
    Json(Value),
    /// 200 `text/event-stream` with these `(event, data)` pairs.
    Sse(Vec<(&'static str, Value)>),
    /// An error status with this body and maybe a `Retry-After` header.
    Status { code: u16, body: Value, retry_after: Option<&'static str> },
    /// Never answers.
    Hang,
}

/// A request as the fake received it.
#[derive(Clone, Debug)]
struct Seen {
    at: Instant,
    headers: HeaderMap,
    body: Value,
}

struct Shared {
    replies: Mutex<VecDeque<Reply>>,
    seen: Mutex<Vec<Seen>>,
    count: tokio::sync::watch::Sender<usize>,
}

/// A fake Messages API serving `POST /v1/messages`.
struct Fake {
    addr: SocketAddr,
    shared: Arc<Shared>,
}

impl Fake {
    async fn start(replies: Vec<Reply>) -> Fake {
        let shared = Arc::new(Shared {
            replies: Mutex::new(replies.into()),
            seen: Mutex::new(Vec::new()),
            count: tokio::sync::watch::Sender::new(0),
        });
        let app = Router::new().route("/v1/messages", post(messages)).with_state(shared.clone());
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        Fake { addr, shared }
    }

    fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn seen(&self) -> Vec<Seen> {
        self.shared.seen.lock().unwrap().clone()
    }

    /// Waits until `n` requests have come in.
    async fn wait_for_requests(&self, n: usize) {
        let mut rx = self.shared.count.subscribe();
        tokio::time::timeout(DEADLINE, rx.wait_for(|c| *c >= n))
            .await
            .unwrap_or_else(|_| panic!("fewer than {n} requests within {DEADLINE:?}"))
            .unwrap();
    }
}

async fn messages(State(shared): State<Arc<Shared>>, headers: HeaderMap, body: Bytes) -> Response {
    let body = serde_json::from_slice(&body).unwrap_or(Value::Null);
    shared.seen.lock().unwrap().push(Seen { at: Instant::now(), headers, body });
    shared.count.send_modify(|c| *c += 1);
    let reply = shared.replies.lock().unwrap().pop_front();
    match reply {
        None => (StatusCode::INTERNAL_SERVER_ERROR, "no scripted reply left").into_response(),
        Some(Reply::Json(v)) => axum::Json(v).into_response(),
        Some(Reply::Sse(events)) => {
            let text: String = events.iter().map(|(name, data)| format!("event: {name}\ndata: {data}\n\n")).collect();
            ([(header::CONTENT_TYPE, "text/event-stream")], text).into_response()
        }
        Some(Reply::Status { code, body, retry_after }) => {
            let mut resp = (StatusCode::from_u16(code).unwrap(), axum::Json(body)).into_response();
            if let Some(v) = retry_after {
                resp.headers_mut().insert(header::RETRY_AFTER, v.parse().unwrap());
            }
            resp
        }
        Some(Reply::Hang) => std::future::pending().await,
    }
}

fn policy() -> Policy {
    Policy {
        max_retries: 3,
        timeout: Duration::from_secs(5),
        idle_timeout: Duration::from_secs(5),
        base_delay: Duration::from_millis(10),
        max_delay: Duration::from_millis(50),
    }
}

fn driver(endpoint: String, stream: bool, policy: Policy) -> Anthropic {
    Anthropic::new(Config {
        endpoint,
        api_key: Some("sk-test".into()),
        model: Some("claude-test".into()),
        stream,
        policy,
    })
}

fn request<'a>(messages: &'a [Message], tools: &'a [ToolSpec]) -> ModelRequest<'a> {
    ModelRequest {
        model: "",
        system: "you are terse",
        messages,
        tools,
        max_tokens: 256,
        task_text: "",
        history_epoch: 0,
    }
}

fn message(content: Value, stop_reason: &str, usage: Value) -> Value {
    json!({
        "id": "msg_1", "type": "message", "role": "assistant", "model": "claude-test",
        "content": content, "stop_reason": stop_reason, "stop_sequence": null, "usage": usage
    })
}

fn text_message(text: &str, stop_reason: &str) -> Value {
    message(json!([{"type": "text", "text": text}]), stop_reason, json!({"input_tokens": 3, "output_tokens": 2}))
}

fn error_body(kind: &str, message: &str) -> Value {
    json!({"type": "error", "error": {"type": kind, "message": message}})
}

fn status(code: u16, kind: &str, message: &str) -> Reply {
    Reply::Status { code, body: error_body(kind, message), retry_after: None }
}

#[tokio::test]
async fn stop_reasons_map_to_the_runtime_names() {
    let cases = [
        ("end_turn", StopReason::EndTurn),
        ("max_tokens", StopReason::MaxTokens),
        ("tool_use", StopReason::ToolCall),
        ("stop_sequence", StopReason::EndTurn),
        ("pause_turn", StopReason::Other("pause_turn".into())),
        ("refusal", StopReason::Other("refusal".into())),
    ];
    let fake = Fake::start(cases.iter().map(|(name, _)| Reply::Json(text_message("x", name))).collect()).await;
    let d = driver(fake.endpoint(), false, policy());
    let messages = [Message::user("hi")];
    for (name, want) in cases {
        let r = d.call(&request(&messages, &[])).await.unwrap();
        assert_eq!(r.stop, want, "stop_reason {name}");
        assert_eq!(r.content, vec![Block::Text { text: "x".into() }]);
    }
}

#[tokio::test]
async fn tool_use_round_trip_sends_merged_tool_results_next() {
    let fake = Fake::start(vec![
        Reply::Json(message(
            json!([
                {"type": "text", "text": "looking"},
                {"type": "tool_use", "id": "toolu_1", "name": "sh", "input": {"command": "ls"}},
                {"type": "tool_use", "id": "toolu_2", "name": "sh", "input": {"command": "pwd"}}
            ]),
            "tool_use",
            json!({"input_tokens": 10, "output_tokens": 20}),
        )),
        Reply::Json(text_message("done", "end_turn")),
    ])
    .await;
    let d = driver(fake.endpoint(), false, policy());
    let tools = [ToolSpec {
        name: "sh".into(),
        description: "run a shell command".into(),
        parameters: json!({"type": "object", "properties": {"command": {"type": "string"}}}),
    }];
    let mut messages = vec![Message::user("list files")];
    let first = d.call(&request(&messages, &tools)).await.unwrap();
    assert_eq!(first.stop, StopReason::ToolCall);
    assert_eq!(
        first.content[1],
        Block::ToolCall { id: "toolu_1".into(), name: "sh".into(), input: json!({"command": "ls"}) }
    );
    messages.push(Message::assistant(first.content));
    messages.push(Message::tool_result("toolu_1", "a.txt\nb.txt", false));
    messages.push(Message::tool_result("toolu_2", "permission denied", true));
    messages.push(Message::user("and then?"));
    let second = d.call(&request(&messages, &tools)).await.unwrap();
    assert_eq!(second.stop, StopReason::EndTurn);

    let seen = fake.seen();
    assert_eq!(seen.len(), 2);
    let h = &seen[0].headers;
    assert_eq!(h["x-api-key"], "sk-test");
    assert_eq!(h["anthropic-version"], "2023-06-01");
    assert_eq!(h["content-type"], "application/json");
    assert_eq!(
        seen[0].body,
        json!({
            "model": "claude-test",
            "max_tokens": 256,
            "system": "you are terse",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "list files"}]}],
            "tools": [{
                "name": "sh",
                "description": "run a shell command",
                "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}
            }]
        })
    );
    assert_eq!(
        seen[1].body["messages"],
        json!([
            {"role": "user", "content": [{"type": "text", "text": "list files"}]},
            {"role": "assistant", "content": [
                {"type": "text", "text": "looking"},
                {"type": "tool_use", "id": "toolu_1", "name": "sh", "input": {"command": "ls"}},
                {"type": "tool_use", "id": "toolu_2", "name": "sh", "input": {"command": "pwd"}}
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.txt\nb.txt", "is_error": false},
                {"type": "tool_result", "tool_use_id": "toolu_2", "content": "permission denied", "is_error": true},
                {"type": "text", "text": "and then?"}
            ]}
        ])
    );
}

#[tokio::test]
async fn usage_reports_cache_fields_when_present_and_none_when_absent() {
    let fake = Fake::start(vec![
        Reply::Json(message(
            json!([{"type": "text", "text": "a"}]),
            "end_turn",
            json!({"input_tokens": 12, "output_tokens": 4,
                   "cache_read_input_tokens": 1000, "cache_creation_input_tokens": 50}),
        )),
        Reply::Json(message(
            json!([{"type": "text", "text": "b"}]),
            "end_turn",
            json!({"input_tokens": 12, "output_tokens": 4}),
        )),
        Reply::Json(json!({"content": [], "stop_reason": "end_turn"})),
    ])
    .await;
    // An endpoint that already ends in /v1 is not doubled (the fake only serves /v1/messages).
    let d = driver(format!("{}/v1", fake.endpoint()), false, policy());
    let messages = [Message::user("hi")];
    let usage = |input, output, cached, written| ProviderUsage {
        input_tokens_actual: input,
        output_tokens_actual: output,
        cached_tokens: cached,
        cache_write_tokens: written,
    };
    let r = d.call(&request(&messages, &[])).await.unwrap();
    assert_eq!(r.usage, usage(Some(12), Some(4), Some(1000), Some(50)));
    let r = d.call(&request(&messages, &[])).await.unwrap();
    assert_eq!(r.usage, usage(Some(12), Some(4), None, None));
    let r = d.call(&request(&messages, &[])).await.unwrap();
    assert_eq!(r.usage, usage(None, None, None, None));
}

fn streamed_reply() -> Vec<(&'static str, Value)> {
    vec![
        (
            "message_start",
            json!({"type": "message_start", "message": {"id": "msg_1", "type": "message",
                "role": "assistant", "content": [], "model": "claude-test", "stop_reason": null,
                "usage": {"input_tokens": 30, "output_tokens": 1, "cache_creation_input_tokens": 8}}}),
        ),
        (
            "content_block_start",
            json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
        ),
        ("ping", json!({"type": "ping"})),
        (
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "I'll "}}),
        ),
        (
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "check ✓"}}),
        ),
        ("content_block_stop", json!({"type": "content_block_stop", "index": 0})),
        (
            "content_block_start",
            json!({"type": "content_block_start", "index": 1, "content_block":
                {"type": "tool_use", "id": "toolu_7", "name": "sh", "input": {}}}),
        ),
        (
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": "{\"comm"}}),
        ),
        (
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": "and\": \"ls -"}}),
        ),
        (
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": "la\"}"}}),
        ),
        ("content_block_stop", json!({"type": "content_block_stop", "index": 1})),
        (
            "message_delta",
            json!({"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": null},
                "usage": {"output_tokens": 27}}),
        ),
        ("message_stop", json!({"type": "message_stop"})),
    ]
}

#[tokio::test]
async fn streaming_assembles_text_and_tool_use_from_json_fragments() {
    let fake = Fake::start(vec![Reply::Sse(streamed_reply())]).await;
    let d = driver(fake.endpoint(), true, policy());
    let messages = [Message::user("list")];
    let r = d.call(&request(&messages, &[])).await.unwrap();
    assert_eq!(r.stop, StopReason::ToolCall);
    assert_eq!(
        r.content,
        vec![
            Block::Text { text: "I'll check ✓".into() },
            Block::ToolCall { id: "toolu_7".into(), name: "sh".into(), input: json!({"command": "ls -la"}) }
        ]
    );
    assert_eq!(
        r.usage,
        ProviderUsage {
            input_tokens_actual: Some(30),
            output_tokens_actual: Some(27),
            cached_tokens: None,
            cache_write_tokens: Some(8),
        }
    );
    assert_eq!(fake.seen()[0].body["stream"], true);
}

#[tokio::test]
async fn streaming_is_retried_before_the_body_starts() {
    let fake = Fake::start(vec![status(529, "overloaded_error", "Overloaded"), Reply::Sse(streamed_reply())]).await;
    let d = driver(fake.endpoint(), true, policy());
    let messages = [Message::user("list")];
    let ex = d.exchange(&request(&messages, &[])).await.unwrap();
    assert_eq!(ex.value.stop, StopReason::ToolCall);
    let statuses: Vec<_> = ex.attempts.iter().map(|a| a.status).collect();
    assert_eq!(statuses, [Some(529), Some(200)]);
}

#[tokio::test]
async fn streaming_overloaded_error_event_retries_the_whole_call() {
    let mut events = streamed_reply();
    events.truncate(4);
    events.push(("error", error_body("overloaded_error", "Overloaded mid-stream")));
    let fake = Fake::start(vec![Reply::Sse(events), Reply::Sse(streamed_reply())]).await;
    let d = driver(fake.endpoint(), true, policy());
    let messages = [Message::user("list")];
    let ex = d.exchange(&request(&messages, &[])).await.unwrap();
    assert_eq!(ex.value.stop, StopReason::ToolCall);
    let log: Vec<_> = ex.attempts.iter().map(|a| (a.number, a.status, a.error.clone())).collect();
    assert_eq!(
        log,
        [
            (1, Some(200), Some("the provider reported an error: overloaded_error: Overloaded mid-stream".into())),
            (2, Some(200), None),
        ]
    );
    // The same request both times: nothing of the failed stream was kept.
    let seen = fake.seen();
    assert_eq!(seen.len(), 2);
    assert_eq!(seen[0].body, seen[1].body);
}

#[tokio::test]
async fn streaming_error_event_of_a_final_kind_is_not_retried() {
    let mut events = streamed_reply();
    events.truncate(4);
    events.push(("error", error_body("invalid_request_error", "prompt is too long")));
    let fake = Fake::start(vec![Reply::Sse(events), Reply::Sse(streamed_reply())]).await;
    let d = driver(fake.endpoint(), true, policy());
    let messages = [Message::user("list")];
    let failure = d.exchange(&request(&messages, &[])).await.unwrap_err();
    assert_eq!(failure.error.to_string(), "the provider reported an error: invalid_request_error: prompt is too long");
    assert_eq!(failure.attempts.len(), 1);
}

#[tokio::test]
async fn rate_limit_waits_for_retry_after_then_retries() {
    let fake = Fake::start(vec![
        Reply::Status { code: 429, body: error_body("rate_limit_error", "slow down"), retry_after: Some("1") },
        Reply::Json(text_message("ok", "end_turn")),
    ])
    .await;
    // Retry-After (1 s) is above max_delay (50 ms) and is still honoured.
    let d = driver(fake.endpoint(), false, policy());
    let messages = [Message::user("hi")];
    let start = Instant::now();
    let ex = d.exchange(&request(&messages, &[])).await.unwrap();
    assert!(start.elapsed() >= Duration::from_millis(900));
    assert_eq!(ex.value.stop, StopReason::EndTurn);
    assert_eq!(ex.attempts.len(), 2);
    assert_eq!(ex.attempts[0].status, Some(429));
    assert!(ex.attempts[0].error.as_deref().unwrap().contains("slow down"));
    assert_eq!(ex.attempts[1].status, Some(200));
    assert_eq!(ex.attempts[1].error, None);
    assert!(ex.attempts[1].waited_ms >= 900, "{:?}", ex.attempts);
    let seen = fake.seen();
    assert_eq!(seen.len(), 2);
    assert!(seen[1].at - seen[0].at >= Duration::from_millis(900));
}

#[tokio::test]
async fn server_error_is_retried_then_succeeds() {
    let fake = Fake::start(vec![
        status(503, "api_error", "upstream unavailable"),
        Reply::Json(text_message("ok", "end_turn")),
    ])
    .await;
    let d = driver(fake.endpoint(), false, policy());
    let messages = [Message::user("hi")];
    let ex = d.exchange(&request(&messages, &[])).await.unwrap();
    assert_eq!(ex.value.content, vec![Block::Text { text: "ok".into() }]);
    let numbers: Vec<_> = ex.attempts.iter().map(|a| (a.number, a.status)).collect();
    assert_eq!(numbers, [(1, Some(503)), (2, Some(200))]);
    // The log keeps the provider's raw error body.
    let first_error = ex.attempts[0].error.as_deref().unwrap();
    assert!(
        first_error.starts_with("provider returned HTTP 503: ") && first_error.contains("upstream unavailable"),
        "{first_error}"
    );
    assert_eq!(ex.attempts[0].waited_ms, 0);
    // The jittered backoff stays under the first ceiling (base_delay, 10 ms).
    assert!(ex.attempts[1].waited_ms <= 10, "{:?}", ex.attempts);
}

/// Reads one HTTP/1.1 request (head and `content-length` body) from `sock`.
async fn read_request(sock: &mut tokio::net::TcpStream) -> Vec<u8> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let n = sock.read(&mut chunk).await.unwrap();
        assert!(n > 0, "client closed before sending a whole request");
        buf.extend_from_slice(&chunk[..n]);
        let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
            continue;
        };
        let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
        let len: usize =
            head.lines().find_map(|l| l.strip_prefix("content-length:")).map_or(0, |v| v.trim().parse().unwrap());
        if buf.len() >= end + 4 + len {
            return buf[end + 4..end + 4 + len].to_vec();
        }
    }
}

#[tokio::test]
async fn dropped_connection_is_retried() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move {
        // First attempt: accept and close without a word.
        let (sock, _) = listener.accept().await.unwrap();
        drop(sock);
        // Second attempt: a proper answer.
        let (mut sock, _) = listener.accept().await.unwrap();
        let body = read_request(&mut sock).await;
        let reply = text_message("recovered", "end_turn").to_string();
        let head = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
            reply.len()
        );
        sock.write_all(head.as_bytes()).await.unwrap();
        sock.write_all(reply.as_bytes()).await.unwrap();
        sock.shutdown().await.unwrap();
        serde_json::from_slice::<Value>(&body).unwrap()
    });
    let d = driver(format!("http://{addr}"), false, policy());
    let messages = [Message::user("hi")];
    let ex = d.exchange(&request(&messages, &[])).await.unwrap();
    assert_eq!(ex.value.content, vec![Block::Text { text: "recovered".into() }]);
    assert_eq!(ex.attempts.len(), 2);
    assert_eq!(ex.attempts[0].status, None);
    let first_error = ex.attempts[0].error.as_deref().unwrap();
    assert!(first_error.starts_with("connection to the provider failed"), "{first_error}");
    let body = tokio::time::timeout(DEADLINE, server).await.unwrap().unwrap();
    assert_eq!(body["model"], "claude-test");
}

#[tokio::test]
async fn attempt_timeout_fails_with_timeout_after_all_attempts() {
    let fake = Fake::start(vec![Reply::Hang, Reply::Hang]).await;
    let d = driver(fake.endpoint(), false, Policy { timeout: Duration::from_millis(200), max_retries: 1, ..policy() });
    let messages = [Message::user("hi")];
    let start = Instant::now();
    let failure = d.exchange(&request(&messages, &[])).await.unwrap_err();
    assert!(start.elapsed() >= Duration::from_millis(400));
    assert!(matches!(failure.error, Error::Timeout(_)), "{failure}");
    assert_eq!(failure.attempts.len(), 2);
    for a in &failure.attempts {
        assert_eq!(a.status, None);
        assert!(a.error.as_deref().unwrap().contains("timed out"));
        assert!(a.duration_ms >= 190, "{a:?}");
    }
    fake.wait_for_requests(2).await;
}

#[tokio::test]
async fn bad_request_is_not_retried() {
    let fake = Fake::start(vec![
        status(400, "invalid_request_error", "max_tokens: must be at most 8192"),
        Reply::Json(text_message("never", "end_turn")),
    ])
    .await;
    let d = driver(fake.endpoint(), false, policy());
    let messages = [Message::user("hi")];
    let failure = d.exchange(&request(&messages, &[])).await.unwrap_err();
    assert_eq!(failure.attempts.len(), 1);
    match &failure.error {
        Error::Status { status, body, .. } => {
            assert_eq!(*status, 400);
            assert_eq!(body, "invalid_request_error: max_tokens: must be at most 8192");
        }
        other => panic!("expected a status error, got {other}"),
    }
    assert_eq!(fake.seen().len(), 1);
}

#[tokio::test]
async fn spent_retries_report_the_provider_error_text() {
    let fake = Fake::start((0..4).map(|_| status(529, "overloaded_error", "Overloaded, try later")).collect()).await;
    let d = driver(fake.endpoint(), false, policy());
    let messages = [Message::user("hi")];
    let failure = d.exchange(&request(&messages, &[])).await.unwrap_err();
    let numbers: Vec<u32> = failure.attempts.iter().map(|a| a.number).collect();
    assert_eq!(numbers, [1, 2, 3, 4]);
    assert!(failure.attempts.iter().all(|a| a.status == Some(529)));
    // Through the Driver trait, the message that ends up in out/result.txt.
    let fake = Fake::start((0..4).map(|_| status(529, "overloaded_error", "Overloaded, try later")).collect()).await;
    let d = driver(fake.endpoint(), false, policy());
    let err = d.call(&request(&messages, &[])).await.unwrap_err();
    assert_eq!(err.to_string(), "provider returned HTTP 529: overloaded_error: Overloaded, try later");
    assert_eq!(fake.seen().len(), 4);
}
