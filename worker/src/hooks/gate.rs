//! The inference endpoint for hook programs (issue #4; the context seed;
//! the runtime reference, §3, the `run-inference` import, checklist H14): a hook
//! process makes a model call with the capsule's own driver by posting to
//! `$MURMUR_INFERENCE_URL`, which is `http://127.0.0.1:<port>/hooks/<hook>/inference`.
//!
//! `POST /hooks/<hook>/inference` takes an [`InferenceRequest`] and answers
//! - 200 `{"text": "…"}` with the reply's text;
//! - 429 `{"error": "spend ceiling reached: …"}` when a spend ceiling refused the call
//!   ([`InferenceError::SpendCeiling`]); the hook's refusal flag is raised so that its
//!   reply to the current event says `spend_refused`;
//! - 502 `{"error": "…"}` when the driver failed ([`InferenceError::Driver`]);
//! - 404 for a hook the session does not have; for a body that is not a request, the
//!   status axum gives it (400 not JSON, 415 not `application/json`, 422 wrong shape).

use super::{InferenceError, InferenceGate, InferenceRequest};
use axum::Json;
use axum::Router;
use axum::extract::rejection::JsonRejection;
use axum::extract::{DefaultBodyLimit, Path as UrlPath, State};
use axum::http::StatusCode;
use axum::routing::post;
use serde_json::{Value, json};
use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use tokio::task::JoinHandle;

/// The largest request body accepted, in bytes: a compaction request carries the whole
/// history.
const BODY_LIMIT: usize = 64 * 1024 * 1024;

/// The served endpoint; stops serving when dropped.
pub(crate) struct GateServer {
    addr: std::net::SocketAddr,
    base: String,
    task: JoinHandle<()>,
}

struct Served {
    gate: Arc<dyn InferenceGate>,
    /// Per hook name: raised when a spend ceiling refused one of its calls.
    refused: HashMap<String, Arc<AtomicBool>>,
}

impl GateServer {
    /// Serves `gate` on 127.0.0.1 at a port the OS picks, for the hooks named in `refused`
    /// (each with the flag raised on a spend-ceiling refusal).
    ///
    /// # Errors
    /// Binding the socket failed.
    pub async fn start(
        gate: Arc<dyn InferenceGate>,
        refused: HashMap<String, Arc<AtomicBool>>,
    ) -> std::io::Result<GateServer> {
        let listener = tokio::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await?;
        let addr = listener.local_addr()?;
        let app = Router::new()
            .route("/hooks/{hook}/inference", post(infer))
            .layer(DefaultBodyLimit::max(BODY_LIMIT))
            .with_state(Arc::new(Served { gate, refused }));
        let task = tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app).await {
                tracing::warn!(error = %e, "the hook inference endpoint stopped");
            }
        });
        Ok(GateServer { addr, base: format!("http://{addr}"), task })
    }

    /// The address it serves on (127.0.0.1, a port the OS picked).
    pub fn addr(&self) -> std::net::SocketAddr {
        self.addr
    }

    /// `$MURMUR_INFERENCE_URL` for hook `hook`.
    pub fn url(&self, hook: &str) -> String {
        format!("{}/hooks/{hook}/inference", self.base)
    }
}

impl Drop for GateServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn infer(
    State(served): State<Arc<Served>>,
    UrlPath(hook): UrlPath<String>,
    body: Result<Json<InferenceRequest>, JsonRejection>,
) -> (StatusCode, Json<Value>) {
    let Some(refused) = served.refused.get(&hook) else {
        return (StatusCode::NOT_FOUND, Json(json!({"error": format!("no hook named {hook:?}")})));
    };
    let request = match body {
        Ok(Json(request)) => request,
        Err(e) => return (e.status(), Json(json!({"error": e.body_text()}))),
    };
    match served.gate.run_inference(&hook, request).await {
        Ok(text) => (StatusCode::OK, Json(json!({"text": text}))),
        Err(e @ InferenceError::SpendCeiling(_)) => {
            refused.store(true, Ordering::SeqCst);
            (StatusCode::TOO_MANY_REQUESTS, Json(json!({"error": e.to_string()})))
        }
        Err(e @ InferenceError::Driver(_)) => (StatusCode::BAD_GATEWAY, Json(json!({"error": e.to_string()}))),
    }
}
