//! The coordinator's A2A HTTP endpoint (issue #7): one endpoint per capsule at
//! `/capsules/<name>/` (agent card at `/capsules/<name>/.well-known/agent-card.json`,
//! JSON-RPC at `POST /capsules/<name>/`), so `mur task send --url URL "text"` works against
//! the cluster as it does against a single capsule.
//!
//! Each capsule's endpoint is the capsule's own A2A server
//! ([`mur_a2a::server::router`]) over a [`ClusterBackend`], which talks to the
//! coordinator through its NATS API (`mur.api.task.*`) and follows task records in
//! [`TASKS_BUCKET`]. Origins follow the A2A endpoint's rule: only `peer` and `completion`
//! in `x-murmur-task-origin` are believed, anything else (a claimed `user` included) is
//! `event` and waits in `bg`.
//!
//! `/mcp` serves the cluster as MCP tools over streamable HTTP (issue #35 §murmur as an MCP
//! server): [`mur_mcp::Cluster`], the server `mur mcp serve` runs on stdio, one per MCP
//! session, over this coordinator's NATS connection. Its `Host` header must be a loopback
//! name or the host of the base URL (rmcp's DNS-rebinding check); the sessions end when the
//! listener shuts down.
//!
//! `/ui/` is the web console ([`crate::console`], issue #38), under the same guard.
//!
//! Authentication (issue #31): every request but `/healthz` and the agent cards passes the
//! endpoint's [`Guard`] — a bearer token from `mur auth token create`, valid for the
//! capsule of the path (`/mcp`: a token for every capsule, admin scope); the keyring
//! follows the `mur_tokens` bucket, so a revoked token is refused from the moment the
//! coordinator's watch sees the change. [`mur_a2a::auth`] has the modes and refusals.
//!
//! Refusals: the coordinator's refusal of a submission (an unknown capsule's `not_found`, an
//! invalid context id, no coordinator answering) comes back as a task in state `rejected`
//! whose status message is the coordinator's message, as a capsule's own refusals do.

use async_trait::async_trait;
use axum::Router;
use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::{StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::any;
use futures::stream::{self, StreamExt};
use mur_a2a::Backend;
use mur_a2a::auth::Guard;
use mur_a2a::card::{AgentInfo, agent_card};
use mur_a2a::intake::{
    self, RESULT_ARTIFACT_ID, Rejected, Submission, Subscription, TaskFilter, TaskRecord, TaskUpdate,
};
use mur_nats::trace_context;
use mur_proto::cluster::{
    Access, ApiError, CAPSULE_INDEX_BUCKET, CapsuleIndexEntry, ErrorCode, SubmitRequest, TASKS_BUCKET,
    TaskRecord as ClusterRecord, TaskRef, api,
};
use mur_proto::task::TaskState;
use mur_proto::{Id, IdKind, TaskId};
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::io;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::TcpListener;
use tower::ServiceExt;
use tracing::Instrument;

/// How long a subscription waits for the task's record to show up in the bucket.
const FIRST_ENTRY_WAIT: Duration = Duration::from_secs(10);

/// Serves the endpoint on `listener` until `shutdown` resolves.
///
/// # Errors
/// When the listener fails.
pub async fn serve(
    client: async_nats::Client,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    let base = format!("http://{}", listener.local_addr()?);
    serve_at(client, listener, base, shutdown).await
}

/// [`serve`] with the base URL the agent cards advertise given (`--public-url`: the
/// address clients reach, when it is not the bound one, as behind a proxy or in a
/// container bound to `0.0.0.0`).
///
/// # Errors
/// When the listener fails.
pub async fn serve_at(
    client: async_nats::Client,
    listener: TcpListener,
    base: String,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    serve_with(client, listener, base, Guard::off(), None, shutdown).await
}

/// [`serve_at`] with requests checked by `guard`, over TLS with `tls` when given.
///
/// # Errors
/// When the listener fails.
pub async fn serve_with(
    client: async_nats::Client,
    listener: TcpListener,
    base: String,
    guard: Guard,
    tls: Option<Arc<rustls::ServerConfig>>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    // Open MCP streams end with the listener, or the graceful shutdown would wait for them.
    let mcp_stop = tokio_util::sync::CancellationToken::new();
    let router = guarded_app(client, base.trim_end_matches('/').to_string(), mcp_stop.clone(), guard);
    let shutdown = async move {
        shutdown.await;
        mcp_stop.cancel();
    };
    mur_a2a::tls::serve(listener, tls, router, shutdown).await
}

/// `GET /healthz`: 200 `ok` while the coordinator's NATS connection is up, 503 otherwise
/// (for container health checks).
async fn healthz(State(state): State<Arc<Endpoints>>) -> (axum::http::StatusCode, &'static str) {
    match state.client.connection_state() {
        async_nats::connection::State::Connected => (axum::http::StatusCode::OK, "ok\n"),
        _ => (axum::http::StatusCode::SERVICE_UNAVAILABLE, "nats: not connected\n"),
    }
}

/// The endpoint's routes; cards advertise `<base>/capsules/<name>/`. MCP sessions at
/// `/mcp` end when `mcp_stop` fires.
pub fn app(
    client: async_nats::Client,
    base: impl Into<String>,
    mcp_stop: tokio_util::sync::CancellationToken,
) -> Router {
    guarded_app(client, base, mcp_stop, Guard::off())
}

/// [`app`] with requests checked by `guard` (module docs).
pub fn guarded_app(
    client: async_nats::Client,
    base: impl Into<String>,
    mcp_stop: tokio_util::sync::CancellationToken,
    guard: Guard,
) -> Router {
    let base = base.into();
    let mcp = Router::new()
        .nest_service(MCP_PATH, mcp_service(client.clone(), &base, mcp_stop))
        .layer(axum::middleware::from_fn_with_state(guard.clone(), cluster_wide));
    let console = crate::console::router(client.clone(), guard.clone(), base.starts_with("https:"));
    let state = Arc::new(Endpoints { client, base, guard, routers: Mutex::new(HashMap::new()) });
    Router::new()
        .route("/healthz", axum::routing::get(healthz))
        .route("/capsules/{name}", any(capsule_root))
        .route("/capsules/{name}/", any(capsule_root))
        .route("/capsules/{name}/{*rest}", any(capsule_path))
        .with_state(state)
        .merge(mcp)
        .merge(console)
}

/// `/mcp` reaches every capsule, sends included: it takes a token for every capsule, admin
/// scope.
async fn cluster_wide(State(guard): State<Guard>, request: Request, next: axum::middleware::Next) -> Response {
    match guard.admit(request.headers(), None, Access::Write) {
        Ok(_) => next.run(request).await,
        Err(refusal) => refusal.response(&serde_json::Value::Null),
    }
}

/// Where the MCP endpoint is served.
pub const MCP_PATH: &str = "/mcp";

/// The streamable-HTTP MCP service: a [`mur_mcp::Cluster`] per session.
fn mcp_service(
    client: async_nats::Client,
    base: &str,
    stop: tokio_util::sync::CancellationToken,
) -> StreamableHttpService<mur_mcp::Cluster, LocalSessionManager> {
    let mut hosts = vec!["localhost".to_string(), "127.0.0.1".to_string(), "::1".to_string()];
    // The public URL's host (`--public-url`), with and without its port.
    if let Some(authority) = base.parse::<Uri>().ok().and_then(|u| u.authority().cloned()) {
        hosts.push(authority.as_str().to_string());
        hosts.push(authority.host().trim_start_matches('[').trim_end_matches(']').to_string());
    }
    let config = StreamableHttpServerConfig::default().with_allowed_hosts(hosts).with_cancellation_token(stop);
    StreamableHttpService::new(
        move || Ok(mur_mcp::Cluster::new(client.clone())),
        Arc::new(LocalSessionManager::default()),
        config,
    )
}

/// The per-capsule routers, built on first use.
struct Endpoints {
    client: async_nats::Client,
    base: String,
    guard: Guard,
    routers: Mutex<HashMap<String, Router>>,
}

impl Endpoints {
    /// The capsule's router: cached once the capsule is known; an unknown capsule gets a
    /// fresh one each time (its submissions are refused by the coordinator).
    async fn router(&self, name: &str) -> Router {
        if let Some(router) = self.routers.lock().expect("routers").get(name) {
            return router.clone();
        }
        let entry = capsule_entry(&self.client, name).await;
        let known = entry.is_some();
        // The manifest's description, as the capsule's own endpoint says it (issue #29
        // item 6); a capsule pushed without one (or before the index kept it) gets a line
        // naming it.
        let description = entry
            .as_ref()
            .and_then(|e| e.description.clone())
            .unwrap_or_else(|| format!("murmur capsule {name}, run by the cluster"));
        let info = AgentInfo {
            name: name.to_string(),
            description,
            version: entry.map_or_else(|| "0.0.0".to_string(), |e| e.version),
            url: None,
        };
        let url = format!("{}/capsules/{name}/", self.base);
        let backend = Arc::new(ClusterBackend::new(self.client.clone(), name));
        let router = mur_a2a::server::guarded_router(backend, agent_card(&info, &url), self.guard.clone());
        if known {
            self.routers.lock().expect("routers").insert(name.to_string(), router.clone());
        }
        router
    }
}

async fn capsule_entry(client: &async_nats::Client, name: &str) -> Option<CapsuleIndexEntry> {
    let js = async_nats::jetstream::new(client.clone());
    let kv = js.get_key_value(CAPSULE_INDEX_BUCKET).await.ok()?;
    let bytes = kv.get(name).await.ok()??;
    serde_json::from_slice(&bytes).ok()
}

async fn capsule_root(
    axum::extract::State(state): axum::extract::State<Arc<Endpoints>>,
    Path(name): Path<String>,
    request: Request,
) -> Response {
    forward(&state, &name, "/", request).await
}

async fn capsule_path(
    axum::extract::State(state): axum::extract::State<Arc<Endpoints>>,
    Path((name, rest)): Path<(String, String)>,
    request: Request,
) -> Response {
    // No card for a capsule never pushed: a client discovering agents is told so, where a
    // send to it is refused by the task API (with the reason) as before.
    let card = mur_a2a::server::AGENT_CARD_PATH.trim_start_matches('/');
    if rest == card && capsule_entry(&state.client, &name).await.is_none() {
        let body = format!("no capsule named {name:?} (push it with `mur capsule push`)\n");
        return (StatusCode::NOT_FOUND, body).into_response();
    }
    forward(&state, &name, &format!("/{rest}"), request).await
}

/// Hands `request` to the capsule's router with its path rewritten to `path`.
async fn forward(state: &Endpoints, name: &str, path: &str, request: Request) -> Response {
    let (mut parts, body) = request.into_parts();
    let span = request_span(name, &parts);
    let path_and_query = match parts.uri.query() {
        Some(q) => format!("{path}?{q}"),
        None => path.to_string(),
    };
    parts.uri = match path_and_query.parse::<Uri>() {
        Ok(uri) => uri,
        Err(_) => return StatusCode::BAD_REQUEST.into_response(),
    };
    let router = state.router(name).await;
    match router.oneshot(Request::from_parts(parts, Body::new(body))).instrument(span).await {
        Ok(response) => response,
        Err(never) => match never {},
    }
}

/// The server span of one request, a child of its W3C `traceparent` header when it has
/// one, so a `SendMessage` from a traced caller puts the task in the caller's trace (issue
/// #7 §Trace context).
fn request_span(name: &str, parts: &axum::http::request::Parts) -> tracing::Span {
    let span = tracing::info_span!(
        "a2a_request",
        otel.name = %format!("{} /capsules/{{name}}/", parts.method),
        otel.kind = "server",
        http.request.method = %parts.method,
        url.path = %parts.uri.path(),
        gen_ai.agent.name = name,
    );
    let parent = trace_context::extract_with(|h| parts.headers.get(h)?.to_str().ok().map(str::to_string));
    trace_context::set_parent(&span, parent);
    span
}

/// One capsule's tasks, as the coordinator keeps them.
pub struct ClusterBackend {
    client: async_nats::Client,
    capsule: String,
}

impl ClusterBackend {
    /// The backend for `capsule`.
    pub fn new(client: async_nats::Client, capsule: impl Into<String>) -> ClusterBackend {
        ClusterBackend { client, capsule: capsule.into() }
    }

    async fn record(&self, id: &str) -> Result<ClusterRecord, ApiError> {
        let body = serde_json::to_vec(&TaskRef { task_id: TaskId::unchecked(id) }).expect("a task ref serializes");
        let record: ClusterRecord = mur_nats::api::call(&self.client, api::TASK_GET, body).await?;
        if record.capsule != self.capsule {
            return Err(ApiError::new(ErrorCode::NotFound, format!("task {id} not found")));
        }
        Ok(record)
    }
}

/// The cluster record as the A2A server sees a task.
pub fn to_intake(record: &ClusterRecord) -> TaskRecord {
    let state = record.state;
    let mut states = vec![TaskState::Submitted];
    if record.started_at.is_some() && state != TaskState::Submitted {
        states.push(TaskState::Working);
    }
    if !states.contains(&state) {
        states.push(state);
    }
    let status_message = match state {
        TaskState::Canceled => Some("canceled".to_string()),
        TaskState::Failed | TaskState::Rejected => record.error.clone().or_else(|| {
            record.exit_status.map(|e| {
                format!("{}{}", e.as_str(), record.result.as_ref().map_or(String::new(), |r| format!(": {r}")))
            })
        }),
        _ => None,
    };
    TaskRecord {
        id: record.task_id.to_string(),
        context_id: record.context_id.clone(),
        message_id: record.message_id.clone(),
        text: record.text.clone(),
        origin: record.origin,
        source: "a2a".to_string(),
        state,
        states,
        status_message,
        exit_status: record.exit_status,
        result: record.result.clone(),
        cancel_requested: false,
        updated_at: record.ended_at.or(record.started_at).unwrap_or(record.submitted_at),
    }
}

/// A submission the coordinator refused, as a task in state `rejected`.
fn refused(submission: Submission, err: &ApiError) -> Rejected {
    let task = TaskRecord {
        id: Id::generate(IdKind::Task),
        context_id: submission.context_id.unwrap_or_else(|| Id::generate(IdKind::Context)),
        message_id: submission.message_id,
        text: submission.text,
        origin: submission.origin,
        source: submission.source,
        state: TaskState::Rejected,
        states: vec![TaskState::Rejected],
        status_message: Some(err.to_string()),
        exit_status: None,
        result: None,
        cancel_requested: false,
        updated_at: mur_nats::clock::Clock::now_ms(&mur_nats::clock::SystemClock),
    };
    // The server answers every refusal carrying a task with that task; the variant is not
    // shown.
    Rejected::Closed { task: Box::new(task) }
}

/// The updates between two snapshots of a task: a status change, preceded by the result
/// artifact when it completed.
fn updates_between(previous: TaskState, next: &ClusterRecord) -> Vec<TaskUpdate> {
    if next.state == previous {
        return Vec::new();
    }
    let mut updates = Vec::new();
    if next.state == TaskState::Completed {
        updates.push(TaskUpdate::Artifact {
            task_id: next.task_id.to_string(),
            context_id: next.context_id.clone(),
            artifact_id: RESULT_ARTIFACT_ID.to_string(),
            name: RESULT_ARTIFACT_ID.to_string(),
            text: next.result.clone().unwrap_or_default(),
        });
    }
    updates.push(TaskUpdate::Status {
        task_id: next.task_id.to_string(),
        context_id: next.context_id.clone(),
        state: next.state,
        message: to_intake(next).status_message,
    });
    updates
}

#[async_trait]
impl Backend for ClusterBackend {
    async fn submit(&self, submission: Submission) -> Result<TaskRecord, Rejected> {
        let mut request = SubmitRequest {
            capsule: self.capsule.clone(),
            text: submission.text.clone(),
            origin: submission.origin,
            context_id: submission.context_id.clone(),
            deadline_at: None,
            fleet_step: None,
            needs: Vec::new(),
            task_id: None,
            message_id: submission.message_id.clone(),
        };
        // Inside the request's span (see `forward`): the coordinator's span joins its trace.
        // Sent again, the same task, while no coordinator answers (a leader failover).
        let sending = mur_nats::api::submit(&self.client, &mut request, mur_nats::api::SUBMIT_PATIENCE, |e, delay| {
            tracing::info!(error = %e, delay_ms = delay.as_millis() as u64, "A2A task not taken yet; sending it again");
        });
        let reply = match sending.await {
            Ok(reply) => reply,
            Err(err) => return Err(refused(submission, &err)),
        };
        match self.record(&reply.task_id).await {
            Ok(record) => Ok(to_intake(&record)),
            Err(err) => Err(refused(submission, &err)),
        }
    }

    async fn get(&self, id: &str) -> Option<TaskRecord> {
        self.record(id).await.ok().map(|r| to_intake(&r))
    }

    async fn cancel(&self, id: &str) -> Result<TaskRecord, intake::Error> {
        let body = serde_json::to_vec(&TaskRef { task_id: TaskId::unchecked(id) }).expect("a task ref serializes");
        let current = self.record(id).await.map_err(|_| intake::Error::NotFound(id.to_string()))?;
        match mur_nats::api::call::<ClusterRecord>(&self.client, api::TASK_CANCEL, body).await {
            Ok(record) => Ok(to_intake(&record)),
            Err(err) if err.code == ErrorCode::NotFound => Err(intake::Error::NotFound(id.to_string())),
            Err(err) if err.code == ErrorCode::Conflict && current.state.is_terminal() => {
                Err(intake::Error::NotCancelable { id: id.to_string(), state: current.state })
            }
            // A running task cannot be cancelled yet (issue #8): the server answers -32002
            // with the state it is in.
            Err(_) => Err(intake::Error::NotCancelable { id: id.to_string(), state: current.state }),
        }
    }

    async fn list(&self, filter: &TaskFilter) -> Result<Vec<TaskRecord>, intake::Error> {
        // The coordinator filters by capsule, context and state; the newest 1,000 submitted
        // come back (the API's cap), ordered here by last update.
        let body = serde_json::json!({
            "capsule": self.capsule,
            "context_id": filter.context_id,
            "state": filter.state,
        });
        let page: mur_proto::page::Page<ClusterRecord> =
            mur_nats::api::call(&self.client, api::TASK_LIST, body.to_string().into_bytes())
                .await
                .map_err(|e| intake::Error::Unavailable(e.to_string()))?;
        let mut records: Vec<TaskRecord> = page.items.iter().map(to_intake).filter(|r| filter.matches(r)).collect();
        records.sort_by(|a, b| (b.updated_at, &b.id).cmp(&(a.updated_at, &a.id)));
        Ok(records)
    }

    async fn subscribe(&self, id: &str) -> Option<Subscription> {
        let current = self.record(id).await.ok()?;
        let js = async_nats::jetstream::new(self.client.clone());
        let kv = js.get_key_value(TASKS_BUCKET).await.ok()?;
        // Its consumer is deleted when the subscription ends or is dropped (issue #29 item 3).
        let mut watch = mur_nats::read::watch(&kv, id).await.ok()?;
        // The latest value comes first; later ones follow as they are written.
        let first = match tokio::time::timeout(FIRST_ENTRY_WAIT, watch.next()).await {
            Ok(Some(Ok(entry))) => serde_json::from_slice::<ClusterRecord>(&entry.value).unwrap_or(current),
            _ => current,
        };
        let snapshot = to_intake(&first);
        if first.state.is_terminal() {
            return Some(Subscription { snapshot, updates: stream::empty().boxed() });
        }
        let updates = stream::unfold(
            (watch, first.state, VecDeque::<TaskUpdate>::new(), false),
            |(mut watch, mut last, mut pending, mut done)| async move {
                loop {
                    if let Some(update) = pending.pop_front() {
                        return Some((update, (watch, last, pending, done)));
                    }
                    if done {
                        return None;
                    }
                    let entry = match watch.next().await {
                        Some(Ok(entry)) => entry,
                        _ => return None,
                    };
                    let Ok(record) = serde_json::from_slice::<ClusterRecord>(&entry.value) else { continue };
                    pending.extend(updates_between(last, &record));
                    last = record.state;
                    done = record.state.is_terminal();
                }
            },
        );
        Some(Subscription { snapshot, updates: updates.boxed() })
    }
}
