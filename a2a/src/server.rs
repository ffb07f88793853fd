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
//! | `ListTasks` | `tasks/list` | the tasks, most recently updated first, paged (§3.1.4) |
//! | `CreateTaskPushNotificationConfig`, `GetTaskPushNotificationConfig`, `ListTaskPushNotificationConfigs`, `DeleteTaskPushNotificationConfig` | `tasks/pushNotificationConfig/{set,get,list,delete}` | -32003 `PushNotificationNotSupportedError` while the card says `pushNotifications: false` (§3.3.4) |
//!
//! `ListTasks` filters by `contextId`, `status` and `statusTimestampAfter`, answers
//! `{tasks, nextPageToken, pageSize, totalSize}` with `pageSize` 1 to 100 (50 when absent;
//! another value is -32602 naming the field); `nextPageToken` is the id of the page's last
//! task, and `""` on the last page; tasks leave their artifacts out unless
//! `includeArtifacts` is true. The 0.3 name answers the same object with 0.3 tasks.
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

use super::auth::{Guard, Mode};
use super::backend::Backend;
use super::card::{AgentCard, AgentInfo, agent_card};
use super::jsonrpc::{self, RpcError};
use super::{ORIGIN_HEADER, VERSION_0_3, VERSION_1_0, VERSION_HEADER, v1, v03};
use crate::intake::{self, Rejected, Submission, TaskRecord, TaskUpdate};
use mur_proto::Origin;
use mur_proto::cluster::Access;

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
    List,
    PushConfig,
}

/// The version and operation of a method name; `None` for a method not served.
fn method(name: &str) -> Option<(Version, Op)> {
    Some(match name {
        "SendMessage" => (Version::V1_0, Op::Send),
        "SendStreamingMessage" => (Version::V1_0, Op::Stream),
        "GetTask" => (Version::V1_0, Op::Get),
        "CancelTask" => (Version::V1_0, Op::Cancel),
        "SubscribeToTask" => (Version::V1_0, Op::Subscribe),
        "ListTasks" => (Version::V1_0, Op::List),
        "CreateTaskPushNotificationConfig"
        | "GetTaskPushNotificationConfig"
        | "ListTaskPushNotificationConfigs"
        | "DeleteTaskPushNotificationConfig" => (Version::V1_0, Op::PushConfig),
        "message/send" => (Version::V0_3, Op::Send),
        "message/stream" => (Version::V0_3, Op::Stream),
        "tasks/get" => (Version::V0_3, Op::Get),
        "tasks/cancel" => (Version::V0_3, Op::Cancel),
        "tasks/resubscribe" => (Version::V0_3, Op::Subscribe),
        "tasks/list" => (Version::V0_3, Op::List),
        "tasks/pushNotificationConfig/set"
        | "tasks/pushNotificationConfig/get"
        | "tasks/pushNotificationConfig/list"
        | "tasks/pushNotificationConfig/delete" => (Version::V0_3, Op::PushConfig),
        _ => return None,
    })
}

impl Op {
    /// What a token's scope must allow for it: sends and cancels change, the rest read.
    fn access(self) -> Access {
        match self {
            Op::Send | Op::Stream | Op::Cancel => Access::Write,
            Op::Get | Op::Subscribe | Op::List | Op::PushConfig => Access::Read,
        }
    }
}

struct App {
    backend: Arc<dyn Backend>,
    card: AgentCard,
    guard: Guard,
    /// The capsule a token must be valid for.
    capsule: String,
}

/// The endpoint's routes over `backend`, serving `card`; nothing is authenticated.
pub fn router(backend: Arc<dyn Backend>, card: AgentCard) -> Router {
    guarded_router(backend, card, Guard::off())
}

/// [`router`] with requests checked by `guard` (tokens valid for the card's capsule,
/// `card.name`); unless the guard is off, the card declares the bearer scheme
/// ([`crate::auth::bearer_card`]) and is served without a token.
pub fn guarded_router(backend: Arc<dyn Backend>, card: AgentCard, guard: Guard) -> Router {
    let card = if guard.mode() == Mode::Off || card.security_schemes.is_some() {
        card
    } else {
        crate::auth::bearer_card(card)
    };
    let capsule = card.name.clone();
    Router::new().route(AGENT_CARD_PATH, get(serve_card)).route("/", post(serve_rpc)).with_state(Arc::new(App {
        backend,
        card,
        guard,
        capsule,
    }))
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
    // Who it is, before anything of the body is read (the id answered is then null).
    let grant = match app.guard.authenticate(&headers) {
        Ok(grant) => grant,
        Err(refusal) => return refusal.response(&Value::Null),
    };
    let request = match jsonrpc::parse_request(&body) {
        Ok(request) => request,
        Err((id, error)) => return Json(jsonrpc::failure(&id, &error)).into_response(),
    };
    // What it may do: before a notification is carried out too.
    let access = method(&request.method).map_or(Access::Read, |(_, op)| op.access());
    if let Err(refusal) = Guard::authorize(grant.as_ref(), Some(&app.capsule), access) {
        return refusal.response(&request.id);
    }
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
        Op::List => list_tasks(backend, version, raw).await.map(Reply::Result),
        Op::PushConfig => {
            if app.card.capabilities.push_notifications == Some(true) {
                // No backend carries push configs; a card claiming them would be wrong.
                return Err(RpcError::method_not_found(method_name));
            }
            Err(RpcError::new(
                jsonrpc::PUSH_NOTIFICATION_NOT_SUPPORTED,
                "push notifications are not supported: the agent card says capabilities.pushNotifications false",
            )
            .with_data(json!({ "method": method_name })))
        }
    }
}

/// Most tasks one `ListTasks` page holds, and the page size when none is asked (1.0
/// §3.1.4, the proto's `page_size`).
const LIST_PAGE_MAX: i32 = 100;
const LIST_PAGE_DEFAULT: i32 = 50;

/// `ListTasks` / `tasks/list` (module docs).
async fn list_tasks(backend: &dyn Backend, version: Version, raw: Value) -> Result<Value, RpcError> {
    let p: v1::ListTasksRequest = if raw.is_null() { Default::default() } else { params(raw)? };
    let page_size = p.page_size.unwrap_or(LIST_PAGE_DEFAULT);
    if !(1..=LIST_PAGE_MAX).contains(&page_size) {
        return Err(RpcError::invalid_params(format!("pageSize: must be 1 to {LIST_PAGE_MAX}, got {page_size}")));
    }
    let mut filter = intake::TaskFilter { context_id: p.context_id.filter(|c| !c.is_empty()), ..Default::default() };
    // A state murmur never gives a task (input or auth required) matches none.
    let mut none_match = false;
    if let Some(status) = p.status.as_deref().filter(|s| !s.is_empty()) {
        match status_filter(status)? {
            StatusFilter::Any => {}
            StatusFilter::State(state) => filter.state = Some(state),
            StatusFilter::Never => none_match = true,
        }
    }
    if let Some(after) = p.status_timestamp_after.as_deref().filter(|s| !s.is_empty()) {
        let at = humantime::parse_rfc3339_weak(after).map_err(|e| {
            RpcError::invalid_params(format!(
                "statusTimestampAfter: must be an ISO 8601 time such as 2026-01-02T03:04:05Z, got {after:?} ({e})"
            ))
        })?;
        let ms = at.duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis());
        filter.updated_since = Some(u64::try_from(ms).unwrap_or(u64::MAX));
    }
    let all = if none_match {
        Vec::new()
    } else {
        backend.list(&filter).await.map_err(|e| RpcError::new(jsonrpc::INTERNAL_ERROR, e.to_string()))?
    };
    let start = match p.page_token.as_deref().filter(|t| !t.is_empty()) {
        None => 0,
        Some(token) => all.iter().position(|r| r.id == token).map(|i| i + 1).ok_or_else(|| {
            RpcError::invalid_params(format!(
                "pageToken: {token:?} is no nextPageToken of this endpoint (its task is gone); list again from the start"
            ))
        })?,
    };
    let size = usize::try_from(page_size).unwrap_or(1);
    let page = &all[start.min(all.len())..(start + size).min(all.len())];
    let next =
        if start + size < all.len() { page.last().map_or(String::new(), |r| r.id.clone()) } else { String::new() };
    let include_artifacts = p.include_artifacts.unwrap_or(false);
    let tasks: Vec<Value> = page
        .iter()
        .map(|record| {
            let mut task = task_value(version, record, p.history_length);
            if !include_artifacts && let Some(object) = task.as_object_mut() {
                object.remove("artifacts");
            }
            task
        })
        .collect();
    Ok(json!({
        "tasks": tasks,
        "nextPageToken": next,
        "pageSize": page_size,
        "totalSize": all.len(),
    }))
}

/// What a `ListTasks` `status` asks for.
#[derive(Debug, PartialEq, Eq)]
enum StatusFilter {
    /// `TASK_STATE_UNSPECIFIED`: no filter.
    Any,
    /// Tasks in this state.
    State(mur_proto::task::TaskState),
    /// A state no murmur task is ever in (input or auth required).
    Never,
}

/// Reads a `status` given as a 1.0 name (`TASK_STATE_WORKING`) or a 0.3 one (`working`,
/// `input-required`). -32602 naming the field for anything else.
fn status_filter(status: &str) -> Result<StatusFilter, RpcError> {
    let name = if status.starts_with("TASK_STATE_") {
        status.to_string()
    } else {
        format!("TASK_STATE_{}", status.to_ascii_uppercase().replace('-', "_"))
    };
    let asked: v1::TaskState = serde_json::from_value(Value::String(name)).map_err(|_| {
        RpcError::invalid_params(format!(
            "status: must be a task state (TASK_STATE_SUBMITTED, TASK_STATE_WORKING, TASK_STATE_COMPLETED, \
             TASK_STATE_FAILED, TASK_STATE_CANCELED, TASK_STATE_REJECTED, …), got {status:?}"
        ))
    })?;
    use mur_proto::task::TaskState as S;
    Ok(match asked {
        v1::TaskState::Unspecified => StatusFilter::Any,
        v1::TaskState::Submitted => StatusFilter::State(S::Submitted),
        v1::TaskState::Working => StatusFilter::State(S::Working),
        v1::TaskState::Completed => StatusFilter::State(S::Completed),
        v1::TaskState::Failed => StatusFilter::State(S::Failed),
        v1::TaskState::Canceled => StatusFilter::State(S::Canceled),
        v1::TaskState::Rejected => StatusFilter::State(S::Rejected),
        v1::TaskState::InputRequired | v1::TaskState::AuthRequired => StatusFilter::Never,
    })
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
        Server::start_with(listener, backend, info, Guard::off(), None)
    }

    /// [`Server::start`] with requests checked by `guard`, and over TLS with `tls` (the
    /// card then advertises `https://<bound address>/`).
    pub fn start_with(
        listener: TcpListener,
        backend: Arc<dyn Backend>,
        info: AgentInfo,
        guard: Guard,
        tls: Option<Arc<rustls::ServerConfig>>,
    ) -> io::Result<Server> {
        let addr = listener.local_addr()?;
        let scheme = if tls.is_some() { "https" } else { "http" };
        let url = info.url.clone().unwrap_or_else(|| format!("{scheme}://{addr}/"));
        let mut card = agent_card(&info, &url);
        if guard.mode() != Mode::Off {
            card = crate::auth::bearer_card(card);
        }
        let app = guarded_router(backend, card.clone(), guard);
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(crate::tls::serve(listener, tls, app, async move {
            let _ = stopped.await;
        }));
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
        assert_eq!(method("ListTasks"), Some((Version::V1_0, Op::List)));
        assert_eq!(method("tasks/pushNotificationConfig/set"), Some((Version::V0_3, Op::PushConfig)));
    }

    #[test]
    fn a_status_filter_takes_both_spellings_and_names_the_field_when_wrong() {
        use mur_proto::task::TaskState as S;
        assert_eq!(status_filter("TASK_STATE_WORKING"), Ok(StatusFilter::State(S::Working)));
        assert_eq!(status_filter("completed"), Ok(StatusFilter::State(S::Completed)));
        assert_eq!(status_filter("input-required"), Ok(StatusFilter::Never));
        assert_eq!(status_filter("TASK_STATE_UNSPECIFIED"), Ok(StatusFilter::Any));
        let err = status_filter("sleeping").unwrap_err();
        assert_eq!(err.code, jsonrpc::INVALID_PARAMS);
        assert!(err.message.contains("status: must be a task state"), "{}", err.message);
    }
}
