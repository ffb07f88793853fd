//! A fake OpenAI chat-completions server (issue #2) over a real socket on
//! `127.0.0.1`, for driving the `openai` driver in tests.
//!
//! It answers `POST /v1/chat/completions` with the replies it was given, in order: a
//! JSON completion, a streamed completion (real `data:` framing, closed by
//! `data: [DONE]`), or an HTTP error. It records every request so a test can check what
//! the driver sent. Other paths get 404; running out of replies gets 500.
//!
//! For benchmarks it can answer every request with the same reply ([`FakeOpenAi::repeating`])
//! and wait before each answer, like a slow model ([`FakeOpenAi::set_delay`]).
//!
//! ```no_run
//! # async fn demo() {
//! use mur_tests::fake_openai::{FakeOpenAi, FakeReply};
//! use mur_worker::driver::openai::{Config, MaxTokensParam, OpenAi};
//!
//! let fake = FakeOpenAi::start(vec![FakeReply::text("hi")]);
//! let driver = OpenAi::new(Config { endpoint: fake.url(), api_key: None, stream: false, policy: Default::default(), max_tokens_param: MaxTokensParam::MaxTokens });
//! // … drive it, then check what it sent:
//! let sent = fake.requests();
//! # }
//! ```

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use serde_json::{Value, json};
use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::oneshot;

/// One reply of the fake server.
#[derive(Clone, Debug)]
pub enum FakeReply {
    /// A `chat.completion` object, sent as `200 application/json`.
    Json(Value),
    /// A streamed completion: each `chat.completion.chunk` object is sent as
    /// `data: <json>\n\n` in two body frames split inside the event (inside a multi-byte
    /// character when the event has one), then `data: [DONE]\n\n`; `text/event-stream`.
    Stream(Vec<Value>),
    /// An HTTP error status with this body.
    Status(u16, String),
    /// `200 text/event-stream` whose body is these frames, written as given (a malformed
    /// chunk, a huge line, a stream without `[DONE]`…), then the body ends.
    Raw(Vec<Vec<u8>>),
    /// As [`FakeReply::Raw`], then the server goes silent with the connection open (a
    /// stalled stream) until the client gives up.
    Stall(Vec<Vec<u8>>),
    /// As [`FakeReply::Raw`], then the connection is cut mid-body (a dropped connection).
    Drop(Vec<Vec<u8>>),
    /// `200 text/event-stream` that sends this frame (say, an SSE comment) every interval,
    /// forever: never idle, never done.
    Trickle(Vec<u8>, Duration),
}

/// The `data: <json>\n\n` frame of one chunk object.
pub fn sse_frame(chunk: &Value) -> Vec<u8> {
    format!("data: {chunk}\n\n").into_bytes()
}

impl FakeReply {
    /// A JSON completion holding `text`, `finish_reason: "stop"`, and no usage.
    pub fn text(text: &str) -> Self {
        FakeReply::Json(json!({
            "id": "chatcmpl-fake",
            "object": "chat.completion",
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": "stop",
            }],
        }))
    }
}

impl FakeReply {
    /// A JSON completion holding `text` with a `usage` object as OpenAI reports it:
    /// `prompt_tokens` (cached ones included), `completion_tokens`, `total_tokens` and
    /// `prompt_tokens_details.cached_tokens`.
    pub fn text_with_usage(text: &str, prompt_tokens: u64, completion_tokens: u64, cached_tokens: u64) -> Self {
        let FakeReply::Json(mut value) = FakeReply::text(text) else { unreachable!("text is a JSON reply") };
        value["usage"] = json!({
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
        });
        FakeReply::Json(value)
    }
}

/// One request the fake received.
#[derive(Clone, Debug)]
pub struct Received {
    /// The `Authorization` header, if any.
    pub authorization: Option<String>,
    /// The JSON body (a JSON string holding the raw text when it was not JSON).
    pub body: Value,
}

#[derive(Default)]
struct Shared {
    replies: Mutex<VecDeque<FakeReply>>,
    given: usize,
    /// Answers every request once `replies` is empty.
    repeat: Option<FakeReply>,
    /// Answers every request from its body, before `replies` and `repeat` are looked at.
    responder: Option<Responder>,
    /// Waited before each answer.
    delay: Mutex<Duration>,
    /// Whether requests are kept for [`FakeOpenAi::received`].
    record: bool,
    /// Requests answered so far.
    served: AtomicUsize,
    received: Mutex<Vec<Received>>,
    /// Whether answers are timed for [`FakeOpenAi::timings`].
    timing: std::sync::atomic::AtomicBool,
    timings: Mutex<Vec<Timed>>,
}

/// A reply chosen from the request's JSON body ([`FakeOpenAi::responding`]).
pub type Responder = Arc<dyn Fn(&Value) -> FakeReply + Send + Sync>;

/// When one request was taken and answered, with its body (for a benchmark to tell which
/// task it came from).
#[derive(Clone, Debug)]
pub struct Timed {
    /// When the handler was called (the request read).
    pub received: std::time::Instant,
    /// When the answer was handed to the server to write, after the delay.
    pub answered: std::time::Instant,
    /// The raw JSON body.
    pub body: Bytes,
}

/// A running fake server; dropping it shuts the server down.
pub struct FakeOpenAi {
    url: String,
    shared: Arc<Shared>,
    shutdown: Option<oneshot::Sender<()>>,
}

impl FakeOpenAi {
    /// Binds `127.0.0.1:0` and serves `replies`, one per request, in order. Must be called
    /// from within a Tokio runtime.
    ///
    /// # Panics
    /// When no port can be bound, or outside a Tokio runtime.
    pub fn start(replies: Vec<FakeReply>) -> FakeOpenAi {
        mur_nats::tls::install_crypto_provider();
        FakeOpenAi::serve(Shared {
            given: replies.len(),
            replies: Mutex::new(replies.into()),
            record: true,
            ..Shared::default()
        })
    }

    /// Binds `127.0.0.1:0` and answers every request with `reply`, for as long as it runs.
    /// Requests are counted, not kept: [`FakeOpenAi::received`] stays empty.
    ///
    /// # Panics
    /// As [`FakeOpenAi::start`].
    pub fn repeating(reply: FakeReply) -> FakeOpenAi {
        FakeOpenAi::serve(Shared { repeat: Some(reply), ..Shared::default() })
    }

    /// Binds `127.0.0.1:0` and answers each request with what `respond` makes of its JSON
    /// body (a model whose answer depends on the conversation: a request sent again gets
    /// the same answer), keeping every request like [`FakeOpenAi::start`].
    ///
    /// # Panics
    /// As [`FakeOpenAi::start`].
    pub fn responding(respond: impl Fn(&Value) -> FakeReply + Send + Sync + 'static) -> FakeOpenAi {
        mur_nats::tls::install_crypto_provider();
        FakeOpenAi::serve(Shared { responder: Some(Arc::new(respond)), record: true, ..Shared::default() })
    }

    fn serve(shared: Shared) -> FakeOpenAi {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("fake openai: bind 127.0.0.1:0");
        listener.set_nonblocking(true).expect("fake openai: set the listener non-blocking");
        let addr = listener.local_addr().expect("fake openai: local address");
        let listener =
            tokio::net::TcpListener::from_std(listener).expect("fake openai: must be started inside a tokio runtime");
        let shared = Arc::new(shared);
        let app = Router::new()
            .route("/v1/chat/completions", post(complete))
            .fallback(not_found)
            .with_state(Arc::clone(&shared));
        let (shutdown, stopped) = oneshot::channel::<()>();
        tokio::spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(async move {
                    let _ = stopped.await;
                })
                .await;
        });
        FakeOpenAi { url: format!("http://{addr}/v1"), shared, shutdown: Some(shutdown) }
    }

    /// Waits `delay` before answering each request from now on (a slow model). Requests
    /// are answered concurrently, so N requests at once all answer after about `delay`.
    pub fn set_delay(&self, delay: Duration) {
        *self.shared.delay.lock().unwrap() = delay;
    }

    /// Times every request from now on ([`FakeOpenAi::timings`]).
    pub fn keep_timings(&self) {
        self.shared.timing.store(true, Ordering::Relaxed);
    }

    /// The timed requests so far, and forgets them.
    pub fn take_timings(&self) -> Vec<Timed> {
        std::mem::take(&mut *self.shared.timings.lock().unwrap())
    }

    /// The base URL, up to and including `/v1` (what `inference.endpoint` holds).
    pub fn url(&self) -> String {
        self.url.clone()
    }

    /// How many requests it has received.
    pub fn served(&self) -> usize {
        self.shared.served.load(Ordering::Relaxed)
    }

    /// The JSON bodies received so far, oldest first.
    pub fn requests(&self) -> Vec<Value> {
        self.received().into_iter().map(|r| r.body).collect()
    }

    /// Everything received so far (`Authorization`, body), oldest first.
    pub fn received(&self) -> Vec<Received> {
        self.shared.received.lock().unwrap().clone()
    }
}

impl Drop for FakeOpenAi {
    fn drop(&mut self) {
        if let Some(shutdown) = self.shutdown.take() {
            let _ = shutdown.send(());
        }
    }
}

async fn complete(State(shared): State<Arc<Shared>>, headers: HeaderMap, body: Bytes) -> Response {
    let received = std::time::Instant::now();
    let response = answer(&shared, &headers, &body).await;
    if shared.timing.load(Ordering::Relaxed) {
        let answered = std::time::Instant::now();
        shared.timings.lock().unwrap().push(Timed { received, answered, body });
    }
    response
}

async fn answer(shared: &Shared, headers: &HeaderMap, body: &Bytes) -> Response {
    let number = shared.served.fetch_add(1, Ordering::Relaxed) + 1;
    let mut chosen = None;
    if shared.record || shared.responder.is_some() {
        let body =
            serde_json::from_slice(body).unwrap_or_else(|_| Value::String(String::from_utf8_lossy(body).into_owned()));
        chosen = shared.responder.as_ref().map(|respond| respond(&body));
        let authorization = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).map(str::to_string);
        if shared.record {
            shared.received.lock().unwrap().push(Received { authorization, body });
        }
    }
    let delay = *shared.delay.lock().unwrap();
    if !delay.is_zero() {
        // To the microsecond, as a model that answers "after 200 ms" would: tokio's own
        // timer ends 1–2 ms late.
        crate::timer::sleep(delay).await;
    }
    let reply = chosen.or_else(|| shared.replies.lock().unwrap().pop_front()).or_else(|| shared.repeat.clone());
    match reply {
        Some(FakeReply::Json(value)) => axum::Json(value).into_response(),
        Some(FakeReply::Stream(chunks)) => stream_response(&chunks),
        Some(FakeReply::Raw(frames)) => raw_response(frames, End::Close),
        Some(FakeReply::Stall(frames)) => raw_response(frames, End::Stall),
        Some(FakeReply::Drop(frames)) => raw_response(frames, End::Cut),
        Some(FakeReply::Trickle(frame, every)) => trickle_response(frame, every),
        Some(FakeReply::Status(status, body)) => {
            (StatusCode::from_u16(status).expect("fake openai: a valid HTTP status"), body).into_response()
        }
        None => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("fake openai: no reply left for request {number} (it was given {} replies)", shared.given),
        )
            .into_response(),
    }
}

fn stream_response(chunks: &[Value]) -> Response {
    let mut frames: Vec<Vec<u8>> = Vec::new();
    for chunk in chunks {
        let event = format!("data: {chunk}\n\n").into_bytes();
        let half = event.len() / 2;
        // Prefer a cut inside a multi-byte character (a UTF-8 continuation byte).
        let cut = (half..event.len()).find(|&i| event[i] & 0xC0 == 0x80).unwrap_or(half);
        frames.push(event[..cut].to_vec());
        frames.push(event[cut..].to_vec());
    }
    frames.push(b"data: [DONE]\n\n".to_vec());
    let body = futures::stream::iter(frames.into_iter().map(Ok::<_, Infallible>));
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(body))
        .expect("fake openai: a valid streaming response")
}

/// How a raw body ends.
#[derive(Clone, Copy)]
pub(crate) enum End {
    /// The body ends normally.
    Close,
    /// Nothing more is sent; the connection stays open.
    Stall,
    /// The connection is cut (the body stream fails, so the server aborts it).
    Cut,
}

/// `200 text/event-stream` with `frames` as the body, ended as `end` says.
pub(crate) fn raw_response(frames: Vec<Vec<u8>>, end: End) -> Response {
    let frames = futures::stream::iter(frames.into_iter().map(Ok::<_, std::io::Error>));
    let tail = futures::stream::once(async move {
        match end {
            End::Close => Ok(Vec::new()),
            End::Stall => std::future::pending().await,
            End::Cut => {
                // As a server that dies mid-reply: the frames are on the wire first.
                tokio::time::sleep(Duration::from_millis(100)).await;
                Err(std::io::Error::new(std::io::ErrorKind::ConnectionReset, "fake: connection cut"))
            }
        }
    });
    use futures::StreamExt;
    let body = frames.chain(tail).filter(|piece| std::future::ready(!matches!(piece, Ok(p) if p.is_empty())));
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(body))
        .expect("fake: a valid streaming response")
}

fn trickle_response(frame: Vec<u8>, every: Duration) -> Response {
    let body = futures::stream::unfold(frame, move |frame| async move {
        tokio::time::sleep(every).await;
        Some((Ok::<_, Infallible>(frame.clone()), frame))
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .body(Body::from_stream(body))
        .expect("fake: a valid streaming response")
}

async fn not_found(uri: Uri) -> Response {
    (StatusCode::NOT_FOUND, format!("fake openai: no route for {}", uri.path())).into_response()
}
