//! W3C trace context across processes (issue #7 §Trace context: "`traceparent` travels in
//! NATS message headers from the client's submit through the coordinator to the worker's
//! spans, so one task is one trace").
//!
//! `tracing` spans carry an OpenTelemetry context only when the process installed the
//! `tracing-opentelemetry` layer (`mur` does when an OTLP endpoint is configured); without
//! it, [`inject`] writes nothing and [`traceparent`] is `None`, so everything here is a
//! no-op. The format is the W3C Trace Context one (`traceparent`, `tracestate`; w3.org/TR/
//! trace-context), always, whatever global propagator the process set: it is the wire
//! format between murmur's own processes.
//!
//! Carriers: NATS message headers ([`async_nats::HeaderMap`]), HTTP headers (any
//! `(name, value)` lookup, see [`extract_with`]) and the task record's `traceparent` field
//! ([`from_traceparent`]).

use opentelemetry::Context;
use opentelemetry::propagation::{Injector, TextMapPropagator};
use opentelemetry::trace::TraceContextExt;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use std::collections::HashMap;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// The W3C header naming the parent span: `00-<trace id>-<span id>-<flags>`.
pub const TRACEPARENT: &str = "traceparent";
/// The W3C header carrying vendor state along with [`TRACEPARENT`].
pub const TRACESTATE: &str = "tracestate";

struct NatsHeaders<'a>(&'a mut async_nats::HeaderMap);

impl Injector for NatsHeaders<'_> {
    fn set(&mut self, key: &str, value: String) {
        self.0.insert(key, value.as_str());
    }
}

/// Writes the context of `span` into `headers` (`traceparent`, and `tracestate` when
/// set). Does nothing when `span` has no OpenTelemetry context.
pub fn inject(span: &tracing::Span, headers: &mut async_nats::HeaderMap) {
    let cx = span.context();
    if cx.span().span_context().is_valid() {
        TraceContextPropagator::new().inject_context(&cx, &mut NatsHeaders(headers));
    }
}

/// NATS headers holding the context of `span` (empty when it has none).
pub fn headers(span: &tracing::Span) -> async_nats::HeaderMap {
    let mut headers = async_nats::HeaderMap::new();
    inject(span, &mut headers);
    headers
}

/// The context of `span` as `(header, value)` pairs for an HTTP request (`traceparent`,
/// and `tracestate` when set); empty when it has none.
pub fn pairs(span: &tracing::Span) -> Vec<(String, String)> {
    let cx = span.context();
    if !cx.span().span_context().is_valid() {
        return Vec::new();
    }
    let mut carrier = HashMap::new();
    TraceContextPropagator::new().inject_context(&cx, &mut carrier);
    let mut pairs: Vec<(String, String)> = carrier.into_iter().collect();
    pairs.sort();
    pairs
}

/// The remote context in NATS message `headers`, if they hold a valid `traceparent`.
pub fn extract(headers: Option<&async_nats::HeaderMap>) -> Option<Context> {
    let headers = headers?;
    extract_with(|name| headers.get(name).map(|v| v.as_str().to_string()))
}

/// The remote context found through `lookup` (header name → value), if it gives a valid
/// `traceparent`. The HTTP endpoint passes a lookup over its request headers.
pub fn extract_with(lookup: impl Fn(&str) -> Option<String>) -> Option<Context> {
    let carrier: HashMap<String, String> =
        [TRACEPARENT, TRACESTATE].into_iter().filter_map(|k| lookup(k).map(|v| (k.to_string(), v))).collect();
    let cx = TraceContextPropagator::new().extract(&carrier);
    cx.span().span_context().is_valid().then_some(cx)
}

/// The remote context named by a stored `traceparent` (a task record's).
pub fn from_traceparent(traceparent: &str) -> Option<Context> {
    extract_with(|name| (name == TRACEPARENT).then(|| traceparent.to_string()))
}

/// The `traceparent` of `span`, when it has an OpenTelemetry context.
pub fn traceparent(span: &tracing::Span) -> Option<String> {
    let cx = span.context();
    if !cx.span().span_context().is_valid() {
        return None;
    }
    let mut carrier = HashMap::new();
    TraceContextPropagator::new().inject_context(&cx, &mut carrier);
    carrier.remove(TRACEPARENT)
}

/// The trace id of `span` (32 lowercase hex digits), when it has an OpenTelemetry context.
pub fn trace_id(span: &tracing::Span) -> Option<String> {
    let cx = span.context();
    let sc = cx.span().span_context().clone();
    sc.is_valid().then(|| sc.trace_id().to_string())
}

/// Makes `parent` the parent of `span`. Call it before `span` is first entered: a span
/// already started keeps its parent (`tracing-opentelemetry` builds the span on first use).
pub fn set_parent(span: &tracing::Span, parent: Option<Context>) {
    if let Some(cx) = parent
        && let Err(e) = span.set_parent(cx)
    {
        tracing::trace!(error = %e, "no parent set on the span");
    }
}

/// Parents `span` on the context in `headers` (a request's or a message's) and returns
/// the `traceparent` to pass on: the span's own, or the incoming one when this process
/// exports no spans (so the next process still joins the caller's trace).
pub fn join(span: &tracing::Span, headers: Option<&async_nats::HeaderMap>) -> Option<String> {
    let parent = extract(headers);
    let incoming = parent.as_ref().and_then(|_| headers?.get(TRACEPARENT)).map(|v| v.as_str().to_string());
    set_parent(span, parent);
    traceparent(span).or(incoming)
}

/// A `send {subject}` producer span (OpenTelemetry messaging conventions, reference
/// jetstream-patterns.md §5.2) under the stored `parent` `traceparent`, and the headers to
/// publish with: naming the span, or carrying `parent` itself when this process exports no
/// spans. The span lasts until it is dropped.
pub fn producer(subject: &str, parent: Option<&str>) -> (tracing::Span, async_nats::HeaderMap) {
    let span = tracing::info_span!(
        "send",
        otel.name = %format!("send {subject}"),
        otel.kind = "producer",
        messaging.system = "nats",
        messaging.operation.type = "send",
        messaging.destination.name = subject,
    );
    set_parent(&span, parent.and_then(from_traceparent));
    let mut headers = headers(&span);
    if headers.is_empty()
        && let Some(p) = parent
    {
        headers.insert(TRACEPARENT, p);
    }
    (span, headers)
}

/// A `process {subject}` consumer span (reference jetstream-patterns.md §5.2) for one
/// delivery of a message: a child of the context in its `headers`, or of `fallback` (a
/// stored `traceparent`) when they carry none. Each redelivery gets a span of its own
/// under the same parent.
pub fn consumer(
    subject: &str,
    headers: Option<&async_nats::HeaderMap>,
    fallback: Option<&str>,
    task_id: Option<&str>,
    delivery: u64,
) -> tracing::Span {
    let span = tracing::info_span!(
        "process",
        otel.name = %format!("process {subject}"),
        otel.kind = "consumer",
        messaging.system = "nats",
        messaging.operation.type = "process",
        messaging.destination.name = subject,
        nats.delivery_count = delivery,
        mur.task_id = task_id.unwrap_or_default(),
    );
    set_parent(&span, extract(headers).or_else(|| fallback.and_then(from_traceparent)));
    span
}

#[cfg(test)]
mod tests {
    use super::*;

    const PARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_traceparent_round_trips_through_nats_headers() {
        let cx = from_traceparent(PARENT).expect("a valid traceparent");
        let mut headers = async_nats::HeaderMap::new();
        TraceContextPropagator::new().inject_context(&cx, &mut NatsHeaders(&mut headers));
        assert_eq!(headers.get(TRACEPARENT).map(|v| v.as_str()), Some(PARENT));
        let back = extract(Some(&headers)).expect("extracted");
        assert_eq!(back.span().span_context().trace_id().to_string(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert!(back.span().span_context().is_remote());
    }

    #[test]
    fn garbage_or_missing_headers_give_no_context() {
        assert!(extract(None).is_none());
        assert!(extract(Some(&async_nats::HeaderMap::new())).is_none());
        assert!(from_traceparent("00-zz-00-01").is_none());
        assert!(from_traceparent("00-00000000000000000000000000000000-00f067aa0ba902b7-01").is_none());
    }

    #[test]
    fn without_the_otel_layer_nothing_is_injected() {
        let span = tracing::info_span!("x");
        assert!(headers(&span).is_empty());
        assert_eq!(traceparent(&span), None);
        assert_eq!(trace_id(&span), None);
    }
}
