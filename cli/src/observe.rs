//! The `--metrics HOST:PORT` listener of `mur coordinator`, `mur worker` and `mur dev`
//! (issue #32 §Health, §Metrics):
//!
//! - `GET /metrics`: the process's metrics in the Prometheus text format (0.0.4);
//! - `GET /healthz`: `200 ok` while the process runs (liveness);
//! - `GET /readyz`: `200` when ready, `503` otherwise, with a JSON body saying why
//!   ([`mur_nats::health::Readiness`]: the NATS connection, missing streams, and for a
//!   coordinator whether it leads or stands by — ready either way).

use anyhow::{Context as _, Result};
use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use mur_nats::health::Probe;
use std::net::SocketAddr;
use std::sync::Arc;

/// What the listener serves from.
struct Served {
    registry: Option<prometheus::Registry>,
    probe: Probe,
}

/// Binds `addr` and serves until `stop` is cancelled; returns the bound address and the
/// serving task. The bound address is said on stderr (`metrics at http://ADDR/metrics`),
/// for a port of 0.
///
/// # Errors
/// The address cannot be bound (named as `--metrics ADDR`).
pub async fn serve(
    addr: &str,
    registry: Option<prometheus::Registry>,
    probe: Probe,
    stop: tokio_util::sync::CancellationToken,
) -> Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = tokio::net::TcpListener::bind(addr).await.with_context(|| format!("--metrics {addr}"))?;
    let bound = listener.local_addr()?;
    let app = Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .with_state(Arc::new(Served { registry, probe }));
    let task = tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).with_graceful_shutdown(async move { stop.cancelled().await }).await {
            eprintln!("metrics listener: {e}");
        }
    });
    eprintln!("metrics at http://{bound}/metrics (/healthz, /readyz)");
    Ok((bound, task))
}

async fn metrics(State(served): State<Arc<Served>>) -> Response {
    let Some(registry) = &served.registry else {
        return (StatusCode::SERVICE_UNAVAILABLE, "metrics are off (see the process's log)\n").into_response();
    };
    let mut body = String::new();
    if let Err(e) = prometheus::TextEncoder::new().encode_utf8(&registry.gather(), &mut body) {
        return (StatusCode::INTERNAL_SERVER_ERROR, format!("encoding the metrics: {e}\n")).into_response();
    }
    ([(header::CONTENT_TYPE, prometheus::TEXT_FORMAT)], body).into_response()
}

async fn readyz(State(served): State<Arc<Served>>) -> Response {
    let readiness = served.probe.check().await;
    let status = if readiness.ready { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    (status, axum::Json(readiness)).into_response()
}
