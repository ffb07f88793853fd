//! A small A2A 1.0 JSON-RPC client: what `mur task send` uses to hand a capsule a task.
//!
//! Every request carries `A2A-Version: 1.0` (1.0 §3.6.1: clients MUST send it) and, when
//! given, the task's origin in `x-murmur-task-origin` (a capsule believes only `peer` and
//! `completion` there; the session-loop seed, §Queue lanes).
//!
//! Usage, as the CLI would wire `mur task send --url URL "text" [--origin O] [--context ID]
//! [--wait]`:
//!
//! ```no_run
//! # async fn demo() -> Result<(), mur_a2a::client::Error> {
//! use mur_a2a::client::{SendOptions, send_task};
//! use std::time::Duration;
//! let options = SendOptions { origin: None, context_id: Some("ctx_1".into()) };
//! // Without --wait: the task as admitted (`TASK_STATE_SUBMITTED`, or `REJECTED`).
//! let task = send_task("http://127.0.0.1:4000/", "summarise the logs", &options, None).await?;
//! // With --wait: follows the task's updates until it ends, then prints its result.
//! let done = send_task("http://127.0.0.1:4000/", "again", &options, Some(Duration::from_millis(250))).await?;
//! println!("{} {:?}: {}", done.id, done.status.state, done.artifact_text());
//! # Ok(()) }
//! ```

use eventsource_stream::Eventsource;
use futures::stream::{BoxStream, StreamExt};
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use std::time::Duration;

use super::card::AgentCard;
use super::jsonrpc::RpcError;
use super::server::AGENT_CARD_PATH;
use super::v1::{self, StreamResponse};
use super::{ORIGIN_HEADER, VERSION_1_0, VERSION_HEADER};
use mur_proto::{Id, IdKind, Origin};

/// Errors of the client.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The request did not reach the endpoint, or its body could not be read.
    #[error("a2a request to {url} failed: {reason}")]
    Transport {
        /// The endpoint.
        url: String,
        /// What failed: the HTTP client's causes, innermost last
        /// (`client error (Connect): tcp connect error: Connection refused (os error 111)`).
        reason: String,
    },
    /// The endpoint answered with a non-2xx HTTP status.
    #[error("a2a endpoint answered http {status}: {body}")]
    Status {
        /// The status code.
        status: u16,
        /// The start of the body.
        body: String,
    },
    /// The endpoint answered a JSON-RPC error (e.g. -32001 task not found).
    #[error("a2a error {}: {}", .0.code, .0.message)]
    Rpc(RpcError),
    /// The answer is not the JSON expected.
    #[error("a2a answer not understood: {0}")]
    Decode(String),
    /// `SendMessage` answered a message where a task was expected.
    #[error("the agent answered with a message, not a task")]
    NotATask(Box<v1::Message>),
    /// The url is not a valid URL.
    #[error("invalid a2a url {url:?}: {reason}")]
    Url {
        /// The url given.
        url: String,
        /// Why it is invalid.
        reason: String,
    },
}

/// Options of a send.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SendOptions {
    /// Sent as `x-murmur-task-origin` when set.
    pub origin: Option<Origin>,
    /// The conversation to continue (`contextId`); a new one when `None`.
    pub context_id: Option<String>,
}

/// An A2A 1.0 client for one JSON-RPC endpoint.
#[derive(Clone, Debug)]
pub struct Client {
    http: reqwest::Client,
    endpoint: String,
    token: Option<Bearer>,
}

/// A bearer token, whose `Debug` hides it.
#[derive(Clone)]
struct Bearer(String);

impl std::fmt::Debug for Bearer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Bearer(***)")
    }
}

impl Client {
    /// A client of the JSON-RPC endpoint at `url` (a capsule's `http://host:port/`).
    pub fn new(url: impl Into<String>) -> Client {
        mur_nats::tls::install_crypto_provider();
        Client { http: reqwest::Client::new(), endpoint: url.into(), token: None }
    }

    /// The same client sending `Authorization: Bearer <token>` with every request (an
    /// endpoint's token, `mur auth token create`).
    pub fn with_token(mut self, token: impl Into<String>) -> Client {
        self.token = Some(Bearer(token.into()));
        self
    }

    /// Same, over a caller-configured HTTP client (timeouts, proxies).
    pub fn with_http(http: reqwest::Client, url: impl Into<String>) -> Client {
        Client { http, endpoint: url.into(), token: None }
    }

    /// The endpoint URL.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    fn transport(&self, e: reqwest::Error) -> Error {
        Error::Transport { url: self.endpoint.clone(), reason: causes(&e) }
    }

    /// The agent card from `/.well-known/agent-card.json` on the endpoint's host.
    pub async fn agent_card(&self) -> Result<AgentCard, Error> {
        let base = reqwest::Url::parse(&self.endpoint)
            .map_err(|e| Error::Url { url: self.endpoint.clone(), reason: e.to_string() })?;
        let url =
            base.join(AGENT_CARD_PATH).map_err(|e| Error::Url { url: self.endpoint.clone(), reason: e.to_string() })?;
        let response = self.http.get(url).send().await.map_err(|e| self.transport(e))?;
        let response = check_status(response).await?;
        response.json().await.map_err(|e| Error::Decode(e.to_string()))
    }

    fn request(&self, method: &str, params: Value, origin: Option<Origin>) -> reqwest::RequestBuilder {
        let body = json!({ "jsonrpc": "2.0", "id": Id::generate(IdKind::Message), "method": method, "params": params });
        let mut request = self.http.post(&self.endpoint).header(VERSION_HEADER, VERSION_1_0).json(&body);
        if let Some(Bearer(token)) = &self.token {
            request = request.bearer_auth(token);
        }
        if let Some(origin) = origin {
            request = request.header(ORIGIN_HEADER, origin.as_str());
        }
        // The caller's span, when it has one (issue #7 §Trace context).
        for (name, value) in mur_nats::trace_context::pairs(&tracing::Span::current()) {
            request = request.header(name, value);
        }
        request
    }

    async fn call<T: DeserializeOwned>(&self, method: &str, params: Value, origin: Option<Origin>) -> Result<T, Error> {
        let response = self.request(method, params, origin).send().await.map_err(|e| self.transport(e))?;
        let response = check_status(response).await?;
        let envelope: Value = response.json().await.map_err(|e| Error::Decode(e.to_string()))?;
        result_of(envelope)
    }

    /// `SendMessage` with `returnImmediately: true`: the task as admitted (`SUBMITTED`, or
    /// `REJECTED` when the capsule's queue is full or it is busy).
    pub async fn send(&self, text: &str, options: &SendOptions) -> Result<v1::Task, Error> {
        let params = send_params(text, options, Some(true));
        match self.call::<v1::SendMessageResponse>("SendMessage", params, options.origin).await? {
            v1::SendMessageResponse::Task(task) => Ok(task),
            v1::SendMessageResponse::Message(message) => Err(Error::NotATask(Box::new(message))),
        }
    }

    /// `SendStreamingMessage`: the task first, then its status and artifact updates until
    /// it ends.
    pub async fn send_streaming(
        &self,
        text: &str,
        options: &SendOptions,
    ) -> Result<BoxStream<'static, Result<StreamResponse, Error>>, Error> {
        self.stream("SendStreamingMessage", send_params(text, options, None), options.origin).await
    }

    /// Calls a streaming method: its JSON-RPC results, one per SSE event.
    async fn stream(
        &self,
        method: &str,
        params: Value,
        origin: Option<Origin>,
    ) -> Result<BoxStream<'static, Result<StreamResponse, Error>>, Error> {
        let response = self
            .request(method, params, origin)
            .header(reqwest::header::ACCEPT, "text/event-stream")
            .send()
            .await
            .map_err(|e| self.transport(e))?;
        let response = check_status(response).await?;
        let is_sse = response
            .headers()
            .get(reqwest::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/event-stream"));
        if !is_sse {
            // An error before the stream started comes back as one JSON-RPC response.
            let envelope: Value = response.json().await.map_err(|e| Error::Decode(e.to_string()))?;
            return Err(result_of::<Value>(envelope)
                .err()
                .unwrap_or_else(|| Error::Decode("expected a stream".into())));
        }
        let events = response.bytes_stream().eventsource().map(|event| {
            let event = event.map_err(|e| Error::Decode(format!("sse: {e}")))?;
            let envelope: Value = serde_json::from_str(&event.data).map_err(|e| Error::Decode(e.to_string()))?;
            result_of::<StreamResponse>(envelope)
        });
        Ok(events.boxed())
    }

    /// `GetTask`.
    pub async fn get(&self, id: &str) -> Result<v1::Task, Error> {
        self.call("GetTask", json!({ "id": id }), None).await
    }

    /// `CancelTask`.
    pub async fn cancel(&self, id: &str) -> Result<v1::Task, Error> {
        self.call("CancelTask", json!({ "id": id }), None).await
    }

    /// `SubscribeToTask`: the task first, then its status and artifact updates until it
    /// ends (an endpoint refuses a task that already ended).
    pub async fn subscribe(&self, id: &str) -> Result<BoxStream<'static, Result<StreamResponse, Error>>, Error> {
        self.stream("SubscribeToTask", json!({ "id": id }), None).await
    }

    /// Waits until task `id` is terminal or interrupted and returns it. Follows the task's
    /// updates (`SubscribeToTask`), so its end is seen the moment it is written, even by a
    /// host that stops right after (a `mur run` canceling its waiting tasks as it exits);
    /// where the stream is refused or breaks off, reads it again (`GetTask`) every `every`.
    pub async fn wait(&self, id: &str, every: Duration) -> Result<v1::Task, Error> {
        loop {
            let task = self.get(id).await?;
            if task.status.state.is_settled() {
                return Ok(task);
            }
            if let Some(ended) = self.follow(task).await {
                return Ok(ended);
            }
            tokio::time::sleep(every).await;
        }
    }

    /// Folds `task`'s updates into it until it settles; `None` when the stream could not be
    /// opened or ended first. The settled task is read again for its whole record (its
    /// metadata: exit status, lane); when the endpoint is gone by then, the fold is it.
    async fn follow(&self, mut task: v1::Task) -> Option<v1::Task> {
        let mut events = self.subscribe(&task.id).await.ok()?;
        while let Some(Ok(event)) = events.next().await {
            match event {
                StreamResponse::Task(t) => task = t,
                StreamResponse::StatusUpdate(u) => task.status = u.status,
                StreamResponse::ArtifactUpdate(u) => {
                    match task.artifacts.iter_mut().find(|a| a.artifact_id == u.artifact.artifact_id) {
                        Some(a) if u.append == Some(true) => a.parts.extend(u.artifact.parts),
                        Some(a) => *a = u.artifact,
                        None => task.artifacts.push(u.artifact),
                    }
                }
                StreamResponse::Message(_) => {}
            }
            if task.status.state.is_settled() {
                return Some(self.get(&task.id).await.unwrap_or(task));
            }
        }
        None
    }
}

/// `mur task send`: sends `text` to the endpoint at `url`; with `wait: Some(every)`,
/// waits until the task ends ([`Client::wait`]) and returns it finished.
pub async fn send_task(
    url: &str,
    text: &str,
    options: &SendOptions,
    wait: Option<Duration>,
) -> Result<v1::Task, Error> {
    let client = Client::new(url);
    let task = client.send(text, options).await?;
    match wait {
        Some(every) if !task.status.state.is_settled() => client.wait(&task.id, every).await,
        _ => Ok(task),
    }
}

fn send_params(text: &str, options: &SendOptions, return_immediately: Option<bool>) -> Value {
    let request = v1::SendMessageRequest {
        tenant: None,
        message: v1::Message {
            message_id: Id::generate(IdKind::Message),
            context_id: options.context_id.clone(),
            task_id: None,
            role: v1::Role::User,
            parts: vec![v1::Part::text(text)],
            metadata: None,
        },
        configuration: return_immediately
            .map(|r| v1::SendMessageConfiguration { return_immediately: Some(r), ..Default::default() }),
        metadata: None,
    };
    serde_json::to_value(request).unwrap_or(Value::Null)
}

async fn check_status(response: reqwest::Response) -> Result<reqwest::Response, Error> {
    let status = response.status();
    if status.is_success() {
        return Ok(response);
    }
    let body = response.text().await.unwrap_or_default();
    // A refusal carrying a JSON-RPC error (401, 403) is said by its message.
    let said = serde_json::from_str::<Value>(&body)
        .ok()
        .and_then(|v| v.pointer("/error/message").and_then(Value::as_str).map(str::to_string))
        .unwrap_or(body);
    Err(Error::Status { status: status.as_u16(), body: said.chars().take(2048).collect() })
}

/// The `result` of a JSON-RPC response, or its `error`.
fn result_of<T: DeserializeOwned>(mut envelope: Value) -> Result<T, Error> {
    if let Some(error) = envelope.get_mut("error").map(Value::take) {
        let error: RpcError = serde_json::from_value(error).map_err(|e| Error::Decode(e.to_string()))?;
        return Err(Error::Rpc(error));
    }
    let result = envelope.get_mut("result").map(Value::take).ok_or_else(|| Error::Decode("no result".into()))?;
    serde_json::from_value(result).map_err(|e| Error::Decode(e.to_string()))
}

/// `e`'s causes joined with `: `, from its first source on when it has one (reqwest's own
/// text repeats the URL the caller already names: `error sending request for url (…)`).
fn causes(e: &reqwest::Error) -> String {
    let mut parts = Vec::new();
    let mut next: Option<&dyn std::error::Error> = std::error::Error::source(e);
    while let Some(cause) = next {
        parts.push(cause.to_string());
        next = cause.source();
    }
    if parts.is_empty() { e.to_string() } else { parts.join(": ") }
}
