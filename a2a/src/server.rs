//! The A2A HTTP endpoint of one capsule (the runtime reference, §5): the agent card
//! at `GET /.well-known/agent-card.json` and JSON-RPC 2.0 at `POST /`.
//!
//! Methods, in both the 1.0 names (§9.4 of the specification) and the 0.3 names the
//! official SDKs still serve:
//!
//! | 1.0 | 0.3 | does |
//! |---|---|---|
//! | `SendMessage` | `message/send` | admit a task; answer with it |
//! | `SendStreamingMessage` | `message/stream` | admit a task; SSE of its updates |
//! | `GetTask` | `tasks/get` | the task's state (-32001 when unknown) |
//! | `CancelTask` | `tasks/cancel` | cancel it (-32002 when already ended) |
//! | `SubscribeToTask` | `tasks/resubscribe` | SSE of a running task's updates |
//!
//! Versions (§3.6): the `A2A-Version` header (or `A2A-Version` query parameter) names the
//! version a request uses; an absent or empty one means 0.3 (§3.6.2). A 1.0 method needs
//! `1.0` and a 0.3 method needs `0.3`, otherwise -32009 `VersionNotSupportedError`, as the
//! official Python SDK answers; patch numbers are ignored. Responses echo the version used
//! in an `A2A-Version` header.
//!
//! Sends: the text parts joined by `\n` become the task's text; the origin is read from
//! `x-murmur-task-origin` with [`Origin::from_http_header`] (only `peer` and `completion`
//! are believed; anything else, a claimed `user` included, is `event` and waits in `bg`).
//! A capsule with `task_acceptance: none` answers -32601; a full queue or a busy `single`
//! capsule answers a task in state `rejected`. A 1.0 `SendMessage` waits until the task
//! settles unless `configuration.returnImmediately` is true (§3.2.2); a 0.3 `message/send`
//! answers at once unless `configuration.blocking` is true.
//!
//! Streams: every SSE event's `data` is a JSON-RPC response with the request's id; the first
//! carries the task, the later ones its status and artifact updates (1.0:
//! `{"statusUpdate"|"artifactUpdate": …}`; 0.3: `kind: status-update` with `final`,
//! `kind: artifact-update`); the stream ends after the terminal status.
//!
//! Notifications (a request without an `id` member) are carried out and not answered:
//! HTTP 204 with no body (JSON-RPC 2.0 §4.1). An `id` of null is an id.

use axum::Router;
use axum::body::Bytes;
use axum::extract::{RawQuery, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Json, Response};
use axum::routing::{get, post};
use futures::stream::{self, StreamExt};
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use std::convert::Infallible;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use super::backend::Backend;
use super::card::{AgentCard, AgentInfo, agent_card};
use super::jsonrpc::{self, RpcError};
use super::{ORIGIN_HEADER, VERSION_0_3, VERSION_1_0, VERSION_HEADER, v1, v03};
use crate::intake::{self, Rejected, Submission, TaskRecord, TaskUpdate};
use mur_proto::Origin;

/// Where the card is served.
pub const AGENT_CARD_PATH: &str = "/.well-known/agent-card.json";

/// The address to bind by default: loopback, any free port.
pub const DEFAULT_BIND: &str = "127.0.0.1:0";

/// How often an idle SSE stream sends a keep-alive comment.
const SSE_KEEP_ALIVE: Duration = Duration::from_secs(15);

/// How long [`Server::shutdown`] lets open requests (streams) finish before dropping them.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// The protocol version a request is processed under.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Version {
    /// A2A 1.0.
    V1_0,
    /// A2A 0.3.
    V0_3,
}

impl Version {
    /// `1.0` or `0.3`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Version::V1_0 => VERSION_1_0,
            Version::V0_3 => VERSION_0_3,
        }
    }

    /// The version a request asks for: its `A2A-Version` header, else its `A2A-Version`
    /// query parameter, else 0.3 (§3.6.1–3.6.2). Only `Major.Minor` counts. -32009 for a
    /// version not served here.
    pub fn requested(headers: &HeaderMap, query: Option<&str>) -> Result<Version, RpcError> {
        let from_header = headers.get(VERSION_HEADER).and_then(|v| v.to_str().ok()).map(str::trim);
        let from_query = query.and_then(|q| {
            q.split('&')
                .filter_map(|pair| pair.split_once('='))
                .find(|(key, _)| key.eq_ignore_ascii_case(VERSION_HEADER))
                .map(|(_, value)| value.trim())
        });
        let asked = from_header.filter(|v| !v.is_empty()).or(from_query.filter(|v| !v.is_empty())).unwrap_or("");
        if asked.is_empty() {
            return Ok(Version::V0_3);
        }
        let mut numbers = asked.split('.').map(str::parse::<u32>);
        match (numbers.next(), numbers.next()) {
            (Some(Ok(1)), Some(Ok(0))) => Ok(Version::V1_0),
            (Some(Ok(0)), Some(Ok(3))) => Ok(Version::V0_3),
            _ => Err(RpcError::version_not_supported(asked, &[VERSION_1_0, VERSION_0_3])),
        }
    }
}

/// What a method does, whatever its version's name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    Send,
    Stream,
    Get,
    Cancel,
    Subscribe,
}

/// The version and operation of a method name; `None` for a method not served.
fn method(name: &str) -> Option<(Version, Op)> {
    Some(match name {
        "SendMessage" => (Version::V1_0, Op::Send),
        "SendStreamingMessage" => (Version::V1_0, Op::Stream),
        "GetTask" => (Version::V1_0, Op::Get),
        "CancelTask" => (Version::V1_0, Op::Cancel),
        "SubscribeToTask" => (Version::V1_0, Op::Subscribe),
        "message/send" => (Version::V0_3, Op::Send),
        "message/stream" => (Version::V0_3, Op::Stream),
        "tasks/get" => (Version::V0_3, Op::Get),
        "tasks/cancel" => (Version::V0_3, Op::Cancel),
        "tasks/resubscribe" => (Version::V0_3, Op::Subscribe),
        _ => return None,
    })
}

struct App {
    backend: Arc<dyn Backend>,
    card: AgentCard,
}

/// The endpoint's routes over `backend`, serving `card`.
pub fn router(backend: Arc<dyn Backend>, card: AgentCard) -> Router {
    Router::new()
        .route(AGENT_CARD_PATH, get(serve_card))
        .route("/", post(serve_rpc))
        .with_state(Arc::new(App { backend, card }))
}

async fn serve_card(State(app): State<Arc<App>>) -> Json<AgentCard> {
    Json(app.card.clone())
}

/// A request's outcome before it becomes an HTTP response.
enum Reply {
    /// One JSON-RPC result.
    Result(Value),
    /// JSON-RPC results to stream as SSE, one per event.
    Stream(stream::BoxStream<'static, Value>),
}

async fn serve_rpc(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    RawQuery(query): RawQuery,
    body: Bytes,
) -> Response {
    let request = match jsonrpc::parse_request(&body) {
        Ok(request) => request,
        Err((id, error)) => return Json(jsonrpc::failure(&id, &error)).into_response(),
    };
    // A notification is carried out and not answered (JSON-RPC 2.0 §4.1): HTTP 204, no
    // body, whatever came of it. A request whose envelope is broken is answered, for it
    // cannot be told from a notification.
    if request.notification {
        // Carried out on its own, so a send that would wait for its task's end (a 1.0
        // `SendMessage` without `returnImmediately`) does not hold the connection for a
        // reply that never comes.
        tokio::spawn(async move { drop(answer(&app, &headers, query.as_deref(), request).await) });
        return StatusCode::NO_CONTENT.into_response();
    }
    answer(&app, &headers, query.as_deref(), request).await
}

/// The response to a request that passed the envelope checks.
async fn answer(app: &App, headers: &HeaderMap, query: Option<&str>, request: jsonrpc::Request) -> Response {
    let Some((version, op)) = method(&request.method) else {
        return Json(jsonrpc::failure(&request.id, &RpcError::method_not_found(&request.method))).into_response();
    };
    let asked = match Version::requested(headers, query) {
        Ok(asked) => asked,
        Err(error) => return Json(jsonrpc::failure(&request.id, &error)).into_response(),
    };
    if asked != version {
        let error = RpcError::version_not_supported(asked.as_str(), &[version.as_str()]).with_data(json!({
            "method": request.method,
            "supportedVersions": [version.as_str()],
        }));
        return with_version(Json(jsonrpc::failure(&request.id, &error)).into_response(), asked);
    }
    let origin = Origin::from_http_header(headers.get(ORIGIN_HEADER).and_then(|v| v.to_str().ok()));
    let id = request.id.clone();
    let reply = match handle(app, version, op, &request.method, request.params, origin).await {
        Ok(reply) => reply,
        Err(error) => return with_version(Json(jsonrpc::failure(&id, &error)).into_response(), version),
    };
    let response = match reply {
        Reply::Result(value) => Json(jsonrpc::success(&id, value)).into_response(),
        Reply::Stream(results) => {
            let events = results.map(move |result| {
                Ok::<_, Infallible>(Event::default().data(jsonrpc::success(&id, result).to_string()))
            });
            Sse::new(events).keep_alive(KeepAlive::new().interval(SSE_KEEP_ALIVE)).into_response()
        }
    };
    with_version(response, version)
}

fn with_version(mut response: Response, version: Version) -> Response {
    response.headers_mut().insert(HeaderName::from_static("a2a-version"), HeaderValue::from_static(version.as_str()));
    response
}

fn params<T: DeserializeOwned>(params: Value) -> Result<T, RpcError> {
    serde_json::from_value(params).map_err(RpcError::invalid_params)
}

/// A message as the intake sees it, whatever the version.
struct Inbound {
    message_id: String,
    context_id: Option<String>,
    task_id: Option<String>,
    part_count: usize,
    texts: Vec<String>,
}

/// Sends, whatever the version: checks the message, offers it, waits if asked.
struct SendArgs {
    inbound: Inbound,
    history_length: Option<i32>,
    wait: bool,
}

async fn handle(
    app: &App,
    version: Version,
    op: Op,
    method_name: &str,
    raw: Value,
    origin: Origin,
) -> Result<Reply, RpcError> {
    let backend = app.backend.as_ref();
    match op {
        Op::Send | Op::Stream => {
            let args = send_args(version, raw)?;
            let record = admit(backend, &args.inbound, origin, method_name).await?;
            if op == Op::Stream {
                return Ok(Reply::Stream(task_stream(backend, version, record, args.history_length).await));
            }
            let record = if args.wait { settle(backend, record).await } else { record };
            Ok(Reply::Result(send_result(version, &record, args.history_length)))
        }
        Op::Get => {
            let (id, history_length) = match version {
                Version::V1_0 => params::<v1::GetTaskRequest>(raw).map(|p| (p.id, p.history_length))?,
                Version::V0_3 => params::<v03::TaskQueryParams>(raw).map(|p| (p.id, p.history_length))?,
            };
            let record = backend.get(&id).await.ok_or_else(|| RpcError::task_not_found(&id))?;
            Ok(Reply::Result(task_value(version, &record, history_length)))
        }
        Op::Cancel => {
            let id = task_id_param(version, raw)?;
            let record = backend.cancel(&id).await.map_err(|e| match e {
                intake::Error::NotFound(id) => RpcError::task_not_found(&id),
                intake::Error::NotCancelable { id, state } => RpcError::task_not_cancelable(&id, state.as_str()),
                other => RpcError::new(jsonrpc::INTERNAL_ERROR, other.to_string()),
            })?;
            Ok(Reply::Result(task_value(version, &record, None)))
        }
        Op::Subscribe => {
            let id = task_id_param(version, raw)?;
            let record = backend.get(&id).await.ok_or_else(|| RpcError::task_not_found(&id))?;
            if record.state.is_terminal() {
                return Err(RpcError::unsupported(format!(
                    "task {id} is {}: nothing left to stream",
                    record.state.as_str()
                )));
            }
            Ok(Reply::Stream(task_stream(backend, version, record, None).await))
        }
    }
}

fn task_id_param(version: Version, raw: Value) -> Result<String, RpcError> {
    match version {
        Version::V1_0 => params::<v1::TaskIdRequest>(raw).map(|p| p.id),
        Version::V0_3 => params::<v03::TaskIdParams>(raw).map(|p| p.id),
    }
}

fn send_args(version: Version, raw: Value) -> Result<SendArgs, RpcError> {
    Ok(match version {
        Version::V1_0 => {
            let p: v1::SendMessageRequest = params(raw)?;
            let config = p.configuration.unwrap_or_default();
            let m = p.message;
            SendArgs {
                inbound: Inbound {
                    part_count: m.parts.len(),
                    texts: m.parts.into_iter().filter_map(|part| part.text).collect(),
                    message_id: m.message_id,
                    context_id: m.context_id,
                    task_id: m.task_id,
                },
                history_length: config.history_length,
                wait: !config.return_immediately.unwrap_or(false),
            }
        }
        Version::V0_3 => {
            let p: v03::MessageSendParams = params(raw)?;
            let config = p.configuration.unwrap_or_default();
            let m = p.message;
            SendArgs {
                inbound: Inbound {
                    part_count: m.parts.len(),
                    texts: m.texts(),
                    message_id: m.message_id,
                    context_id: m.context_id,
                    task_id: m.task_id,
                },
                history_length: config.history_length,
                wait: config.blocking.unwrap_or(false),
            }
        }
    })
}

/// Checks a message and offers it to the backend. Refusals that are results come back as
/// the `rejected` task; `task_acceptance: none` is -32601.
async fn admit(
    backend: &dyn Backend,
    inbound: &Inbound,
    origin: Origin,
    method_name: &str,
) -> Result<TaskRecord, RpcError> {
    if inbound.message_id.is_empty() {
        return Err(RpcError::invalid_params("message.messageId is required"));
    }
    if inbound.part_count == 0 {
        return Err(RpcError::invalid_params("message.parts must hold at least one part"));
    }
    if inbound.texts.is_empty() {
        return Err(RpcError::new(jsonrpc::CONTENT_TYPE_NOT_SUPPORTED, "only text parts are accepted (text/plain)"));
    }
    if let Some(task_id) = &inbound.task_id {
        let existing = backend.get(task_id).await.ok_or_else(|| RpcError::task_not_found(task_id))?;
        return Err(RpcError::unsupported(format!(
            "task {} is {}: this agent does not continue tasks, send a new message without taskId",
            existing.id,
            existing.state.as_str()
        )));
    }
    let submission = Submission {
        text: inbound.texts.join("\n"),
        context_id: inbound.context_id.clone().filter(|c| !c.is_empty()),
        message_id: Some(inbound.message_id.clone()),
        origin,
        source: "a2a".to_string(),
    };
    match backend.submit(submission).await {
        Ok(record) => Ok(record),
        Err(Rejected::NotAccepting) => Err(RpcError::method_not_found(method_name)
            .with_data(json!({ "method": method_name, "reason": Rejected::NotAccepting.to_string() }))),
        Err(refused) => refused
            .task()
            .cloned()
            .ok_or_else(|| RpcError::new(jsonrpc::INTERNAL_ERROR, format!("refused without a task: {refused}"))),
    }
}

/// Waits until the task ends (1.0 §3.2.2 "blocking"), then returns its latest snapshot.
async fn settle(backend: &dyn Backend, record: TaskRecord) -> TaskRecord {
    if record.state.is_terminal() {
        return record;
    }
    let Some(subscription) = backend.subscribe(&record.id).await else { return record };
    let mut last = subscription.snapshot;
    if !last.state.is_terminal() {
        let mut updates = subscription.updates;
        while let Some(update) = updates.next().await {
            if update.is_final() {
                break;
            }
        }
        last = backend.get(&record.id).await.unwrap_or(last);
    }
    last
}

fn task_value(version: Version, record: &TaskRecord, history_length: Option<i32>) -> Value {
    let value = match version {
        Version::V1_0 => serde_json::to_value(v1::task(record, history_length)),
        Version::V0_3 => serde_json::to_value(v03::task(record, history_length)),
    };
    value.unwrap_or(Value::Null)
}

/// `SendMessage`'s result: 1.0 wraps the task (`{"task": …}`), 0.3 answers the task itself.
fn send_result(version: Version, record: &TaskRecord, history_length: Option<i32>) -> Value {
    match version {
        Version::V1_0 => json!({ "task": task_value(version, record, history_length) }),
        Version::V0_3 => task_value(version, record, history_length),
    }
}

fn update_value(version: Version, update: &TaskUpdate) -> Value {
    match version {
        Version::V1_0 => serde_json::to_value(v1::stream_event(update)).unwrap_or(Value::Null),
        Version::V0_3 => v03::stream_event(update),
    }
}

/// The task first (as a stream's first event must be, §3.1.2), then its updates until the
/// terminal status.
async fn task_stream(
    backend: &dyn Backend,
    version: Version,
    record: TaskRecord,
    history_length: Option<i32>,
) -> stream::BoxStream<'static, Value> {
    let (snapshot, updates) = match backend.subscribe(&record.id).await {
        Some(subscription) => (subscription.snapshot, subscription.updates),
        None => (record, stream::empty().boxed()),
    };
    let first = match version {
        Version::V1_0 => json!({ "task": task_value(version, &snapshot, history_length) }),
        Version::V0_3 => task_value(version, &snapshot, history_length),
    };
    stream::once(async move { first }).chain(updates.map(move |update| update_value(version, &update))).boxed()
}

/// A running endpoint.
pub struct Server {
    addr: SocketAddr,
    url: String,
    card: AgentCard,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<io::Result<()>>,
}

impl Server {
    /// Serves `backend` on `listener` (bind it to [`DEFAULT_BIND`] unless told otherwise)
    /// from a task spawned on the current tokio runtime (call it inside one). The card
    /// advertises `info.url`, or `http://<bound address>/`.
    pub fn start(listener: TcpListener, backend: Arc<dyn Backend>, info: AgentInfo) -> io::Result<Server> {
        let addr = listener.local_addr()?;
        let url = info.url.clone().unwrap_or_else(|| format!("http://{addr}/"));
        let card = agent_card(&info, &url);
        let app = router(backend, card.clone());
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            axum::serve(listener, app)
                .with_graceful_shutdown(async move {
                    let _ = stopped.await;
                })
                .await
        });
        Ok(Server { addr, url, card, stop: Some(stop), task })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The endpoint URL the card advertises.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The card served.
    pub fn card(&self) -> &AgentCard {
        &self.card
    }

    /// Stops taking connections and waits for open requests, at most 5 s (open streams are
    /// dropped after that).
    pub async fn shutdown(mut self) -> io::Result<()> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        match tokio::time::timeout(SHUTDOWN_GRACE, &mut self.task).await {
            Ok(Ok(result)) => result,
            Ok(Err(join)) => Err(io::Error::other(join)),
            Err(_) => {
                self.task.abort();
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(version: Option<&str>) -> HeaderMap {
        let mut h = HeaderMap::new();
        if let Some(v) = version {
            h.insert(VERSION_HEADER, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    #[test]
    fn the_requested_version_defaults_to_0_3_and_ignores_patch_numbers() {
        assert_eq!(Version::requested(&headers(None), None), Ok(Version::V0_3));
        assert_eq!(Version::requested(&headers(Some("")), None), Ok(Version::V0_3));
        assert_eq!(Version::requested(&headers(Some("1.0")), None), Ok(Version::V1_0));
        assert_eq!(Version::requested(&headers(Some("1.0.2")), None), Ok(Version::V1_0));
        assert_eq!(Version::requested(&headers(Some("0.3.0")), None), Ok(Version::V0_3));
        assert_eq!(Version::requested(&headers(None), Some("x=1&A2A-Version=1.0")), Ok(Version::V1_0));
        let err = Version::requested(&headers(Some("0.5")), None).unwrap_err();
        assert_eq!(err.code, jsonrpc::VERSION_NOT_SUPPORTED);
    }

    #[test]
    fn both_generations_of_method_names_are_served() {
        assert_eq!(method("SendMessage"), Some((Version::V1_0, Op::Send)));
        assert_eq!(method("message/stream"), Some((Version::V0_3, Op::Stream)));
        assert_eq!(method("tasks/cancel"), Some((Version::V0_3, Op::Cancel)));
        assert_eq!(method("tasks/send"), None);
    }
}
