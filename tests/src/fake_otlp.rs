//! A fake OpenTelemetry collector speaking OTLP/HTTP over a real socket on `127.0.0.1`
//! (issue #7 §Trace context), for checking the spans murmur's processes export.
//!
//! It takes `POST /v1/traces` with a protobuf `ExportTraceServiceRequest` body
//! (opentelemetry.io/docs/specs/otlp/#otlphttp, decoded with the `opentelemetry-proto`
//! types), keeps every span with its resource's `service.name`, and answers `200` with an
//! empty `ExportTraceServiceResponse`. A body that does not decode gets `400`; other paths
//! get 404. Point a process at it with `OTEL_EXPORTER_OTLP_ENDPOINT` = [`FakeOtlp::url`].

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::common::v1::{AnyValue as Any, KeyValue};
use prost::Message;
use std::sync::{Arc, Mutex};
use tokio::sync::oneshot;

/// One span as the collector received it; ids in lowercase hex, as W3C `traceparent` has
/// them (the root's `parent_span_id` is empty).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Span {
    /// The exporting process's `service.name`.
    pub service: String,
    /// The span's name.
    pub name: String,
    /// 32 hex digits.
    pub trace_id: String,
    /// 16 hex digits.
    pub span_id: String,
    /// 16 hex digits, or empty for a root span.
    pub parent_span_id: String,
    /// The OTLP `SpanKind` number (1 internal, 2 server, 3 client, 4 producer, 5 consumer).
    pub kind: i32,
    /// String attributes (others are left out).
    pub attributes: Vec<(String, String)>,
}

impl Span {
    /// The string attribute `key`, if the span has it.
    pub fn attribute(&self, key: &str) -> Option<&str> {
        self.attributes.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }
}

/// The running collector; stops when dropped.
pub struct FakeOtlp {
    url: String,
    spans: Arc<Mutex<Vec<Span>>>,
    shutdown: Option<oneshot::Sender<()>>,
}

impl FakeOtlp {
    /// Binds `127.0.0.1:0` and serves in the current tokio runtime.
    ///
    /// # Panics
    /// Outside a tokio runtime, or when the socket cannot be bound.
    pub fn start() -> FakeOtlp {
        mur_nats::tls::install_crypto_provider();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("fake otlp: bind 127.0.0.1:0");
        listener.set_nonblocking(true).expect("fake otlp: nonblocking");
        let url = format!("http://{}", listener.local_addr().expect("fake otlp: local addr"));
        let listener = tokio::net::TcpListener::from_std(listener).expect("fake otlp: start it inside a tokio runtime");
        let spans = Arc::new(Mutex::new(Vec::new()));
        let app = Router::new().route("/v1/traces", post(export)).with_state(spans.clone());
        let (shutdown, stopped) = oneshot::channel::<()>();
        tokio::spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(async {
                    let _ = stopped.await;
                })
                .await;
        });
        FakeOtlp { url, spans, shutdown: Some(shutdown) }
    }

    /// The base URL, for `OTEL_EXPORTER_OTLP_ENDPOINT` (exporters add `/v1/traces`).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Every span received so far, in arrival order.
    pub fn spans(&self) -> Vec<Span> {
        self.spans.lock().expect("spans").clone()
    }
}

impl Drop for FakeOtlp {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }
}

async fn export(State(spans): State<Arc<Mutex<Vec<Span>>>>, body: Bytes) -> Response {
    let request = match ExportTraceServiceRequest::decode(body) {
        Ok(r) => r,
        Err(e) => return (StatusCode::BAD_REQUEST, format!("not an ExportTraceServiceRequest: {e}")).into_response(),
    };
    let mut received = Vec::new();
    for resource_spans in request.resource_spans {
        let service = resource_spans
            .resource
            .as_ref()
            .and_then(|r| string_attributes(&r.attributes).into_iter().find(|(k, _)| k == "service.name"))
            .map(|(_, v)| v)
            .unwrap_or_default();
        for scope in resource_spans.scope_spans {
            for span in scope.spans {
                received.push(Span {
                    service: service.clone(),
                    name: span.name,
                    trace_id: hex(&span.trace_id),
                    span_id: hex(&span.span_id),
                    parent_span_id: hex(&span.parent_span_id),
                    kind: span.kind,
                    attributes: string_attributes(&span.attributes),
                });
            }
        }
    }
    spans.lock().expect("spans").extend(received);
    let reply = ExportTraceServiceResponse { partial_success: None }.encode_to_vec();
    ([(header::CONTENT_TYPE, "application/x-protobuf")], reply).into_response()
}

fn string_attributes(attributes: &[KeyValue]) -> Vec<(String, String)> {
    attributes
        .iter()
        .filter_map(|kv| match kv.value.as_ref() {
            Some(Any { value: Some(AnyValue::StringValue(s)), .. }) => Some((kv.key.clone(), s.clone())),
            _ => None,
        })
        .collect()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
