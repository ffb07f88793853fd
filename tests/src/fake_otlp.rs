//! A fake OpenTelemetry collector speaking OTLP/HTTP over a real socket on `127.0.0.1`
//! (issue #7 §Trace context), for checking the spans murmur's processes export.
//!
//! It takes `POST /v1/traces` with a protobuf `ExportTraceServiceRequest` body
//! (opentelemetry.io/docs/specs/otlp/#otlphttp, decoded with the `opentelemetry-proto`
//! types), keeps every span with its resource's `service.name`, and answers `200` with an
//! empty `ExportTraceServiceResponse`; likewise `POST /v1/metrics` with an
//! `ExportMetricsServiceRequest` (issue #32), keeping every data point ([`Point`]). A body
//! that does not decode gets `400`; other paths get 404. Point a process at it with
//! `OTEL_EXPORTER_OTLP_ENDPOINT` = [`FakeOtlp::url`].

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use opentelemetry_proto::tonic::collector::metrics::v1::{ExportMetricsServiceRequest, ExportMetricsServiceResponse};
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::common::v1::{AnyValue as Any, KeyValue};
use opentelemetry_proto::tonic::metrics::v1::metric::Data;
use opentelemetry_proto::tonic::metrics::v1::number_data_point;
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
    /// Attributes, each as text: strings as they are, numbers and booleans written out
    /// (arrays and maps are left out).
    pub attributes: Vec<(String, String)>,
    /// The OTLP status code (0 unset, 1 ok, 2 error).
    pub status_code: i32,
    /// The spans it links to, as `(trace id, span id)` in hex.
    pub links: Vec<(String, String)>,
}

impl Span {
    /// The string attribute `key`, if the span has it.
    pub fn attribute(&self, key: &str) -> Option<&str> {
        self.attributes.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }
}

/// One data point of an exported metric, as the collector received it.
#[derive(Clone, Debug, PartialEq)]
pub struct Point {
    /// The exporting process's `service.name`.
    pub service: String,
    /// The metric's name (`mur.task.ends`).
    pub metric: String,
    /// Its unit (`s`, `{task}`).
    pub unit: String,
    /// `gauge`, `sum` or `histogram` (others are left out).
    pub kind: &'static str,
    /// String attributes.
    pub attributes: Vec<(String, String)>,
    /// A gauge's or sum's value; a histogram's sum.
    pub value: f64,
    /// A histogram's count (1 for a gauge or sum).
    pub count: u64,
}

impl Point {
    /// The string attribute `key`, if the point has it.
    pub fn attribute(&self, key: &str) -> Option<&str> {
        self.attributes.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }
}

/// What the collector keeps.
#[derive(Default)]
struct Received {
    spans: Mutex<Vec<Span>>,
    points: Mutex<Vec<Point>>,
}

/// The running collector; stops when dropped.
pub struct FakeOtlp {
    url: String,
    received: Arc<Received>,
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
        let received = Arc::new(Received::default());
        let app = Router::new()
            .route("/v1/traces", post(export))
            .route("/v1/metrics", post(export_metrics))
            .with_state(received.clone());
        let (shutdown, stopped) = oneshot::channel::<()>();
        tokio::spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(async {
                    let _ = stopped.await;
                })
                .await;
        });
        FakeOtlp { url, received, shutdown: Some(shutdown) }
    }

    /// The base URL, for `OTEL_EXPORTER_OTLP_ENDPOINT` (exporters add `/v1/traces`).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Every span received so far, in arrival order.
    pub fn spans(&self) -> Vec<Span> {
        self.received.spans.lock().expect("spans").clone()
    }

    /// Every metric data point received so far, in arrival order (each export of
    /// cumulative metrics repeats the totals so far).
    pub fn points(&self) -> Vec<Point> {
        self.received.points.lock().expect("points").clone()
    }
}

impl Drop for FakeOtlp {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }
}

async fn export(State(received_by): State<Arc<Received>>, body: Bytes) -> Response {
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
                    status_code: span.status.as_ref().map_or(0, |s| s.code),
                    links: span.links.iter().map(|l| (hex(&l.trace_id), hex(&l.span_id))).collect(),
                });
            }
        }
    }
    received_by.spans.lock().expect("spans").extend(received);
    let reply = ExportTraceServiceResponse { partial_success: None }.encode_to_vec();
    ([(header::CONTENT_TYPE, "application/x-protobuf")], reply).into_response()
}

async fn export_metrics(State(received_by): State<Arc<Received>>, body: Bytes) -> Response {
    let request = match ExportMetricsServiceRequest::decode(body) {
        Ok(r) => r,
        Err(e) => return (StatusCode::BAD_REQUEST, format!("not an ExportMetricsServiceRequest: {e}")).into_response(),
    };
    let mut received = Vec::new();
    for resource_metrics in request.resource_metrics {
        let service = resource_metrics
            .resource
            .as_ref()
            .and_then(|r| string_attributes(&r.attributes).into_iter().find(|(k, _)| k == "service.name"))
            .map(|(_, v)| v)
            .unwrap_or_default();
        for scope in resource_metrics.scope_metrics {
            for metric in scope.metrics {
                let point = |kind, attributes: &[KeyValue], value, count| Point {
                    service: service.clone(),
                    metric: metric.name.clone(),
                    unit: metric.unit.clone(),
                    kind,
                    attributes: string_attributes(attributes),
                    value,
                    count,
                };
                let number = |p: &opentelemetry_proto::tonic::metrics::v1::NumberDataPoint| match p.value {
                    Some(number_data_point::Value::AsDouble(v)) => v,
                    Some(number_data_point::Value::AsInt(v)) => v as f64,
                    None => 0.0,
                };
                match &metric.data {
                    Some(Data::Gauge(g)) => {
                        received.extend(g.data_points.iter().map(|p| point("gauge", &p.attributes, number(p), 1)));
                    }
                    Some(Data::Sum(sum)) => {
                        received.extend(sum.data_points.iter().map(|p| point("sum", &p.attributes, number(p), 1)));
                    }
                    Some(Data::Histogram(h)) => received.extend(
                        h.data_points.iter().map(|p| point("histogram", &p.attributes, p.sum.unwrap_or(0.0), p.count)),
                    ),
                    _ => {}
                }
            }
        }
    }
    received_by.points.lock().expect("points").extend(received);
    let reply = ExportMetricsServiceResponse { partial_success: None }.encode_to_vec();
    ([(header::CONTENT_TYPE, "application/x-protobuf")], reply).into_response()
}

fn string_attributes(attributes: &[KeyValue]) -> Vec<(String, String)> {
    attributes
        .iter()
        .filter_map(|kv| match kv.value.as_ref() {
            Some(Any { value: Some(AnyValue::StringValue(s)), .. }) => Some((kv.key.clone(), s.clone())),
            Some(Any { value: Some(AnyValue::IntValue(i)), .. }) => Some((kv.key.clone(), i.to_string())),
            Some(Any { value: Some(AnyValue::DoubleValue(d)), .. }) => Some((kv.key.clone(), d.to_string())),
            Some(Any { value: Some(AnyValue::BoolValue(b)), .. }) => Some((kv.key.clone(), b.to_string())),
            _ => None,
        })
        .collect()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
