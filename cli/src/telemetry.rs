//! Logging, and OpenTelemetry span export when it is configured (issue #7 §Trace context:
//! people "watch it on OpenTelemetry dashboards").
//!
//! Off unless `OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` is set;
//! then every `tracing` span of the process is exported over OTLP/HTTP with protobuf
//! bodies (`<endpoint>/v1/traces`, or the traces endpoint as given), through a batch
//! processor on a tokio runtime of its own, so every command keeps its own runtime.
//! `service.name` is `mur-coordinator`, `mur-worker` or `mur`; `OTEL_SERVICE_NAME`
//! overrides it. The other standard variables apply as the OpenTelemetry SDK reads them
//! (`OTEL_EXPORTER_OTLP_HEADERS`, `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_BSP_SCHEDULE_DELAY`,
//! …; opentelemetry.io/docs/specs/otel/configuration/sdk-environment-variables/).
//! [`Telemetry::shutdown`] flushes what is left on exit.
//!
//! The W3C Trace Context propagator is installed globally either way; murmur's own
//! processes pass context with [`mur_nats::trace_context`].
//!
//! Metrics (issue #32) are recorded only when something reads them, and only by the
//! long-running processes (`mur coordinator`, `mur worker`, `mur dev`): a meter provider is
//! installed globally when `--metrics` is given (its Prometheus reader fills
//! [`Telemetry::registry`], served at `/metrics` by [`crate::observe`]) or when
//! `OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_EXPORTER_OTLP_METRICS_ENDPOINT` is set (a
//! periodic reader exports OTLP/HTTP protobuf to `<endpoint>/v1/metrics`, every
//! `OTEL_METRIC_EXPORT_INTERVAL` ms, 60 s by default, cumulative temporality); without
//! either the instruments of [`mur_nats::metrics`] are the API's no-ops.

use anyhow::{Context as _, Result};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{Protocol, WithExportConfig as _};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::metrics::SdkMeterProvider;
use opentelemetry_sdk::metrics::periodic_reader_with_async_runtime::PeriodicReader;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use opentelemetry_sdk::trace::span_processor_with_async_runtime::BatchSpanProcessor;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;
use tracing_subscriber::{EnvFilter, Layer as _};

/// The variables that turn span export on (OpenTelemetry SDK environment variables).
const TRACE_ENDPOINT_VARS: [&str; 2] = ["OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"];

/// The variables that turn OTLP metric export on.
const METRIC_ENDPOINT_VARS: [&str; 2] = ["OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"];

/// The log filter when `MUR_LOG` is unset: warnings, and the lines a coordinator writes
/// when it stands by or starts leading ([`mur_coordinator::service::ROLE_LOG_TARGET`],
/// issue #29 item 14).
pub const DEFAULT_LOG_FILTER: &str = "warn,mur::role=info";

/// What a command wants of metrics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Metrics {
    /// A short command: none.
    Off,
    /// A long-running process: OTLP export when configured.
    Export,
    /// A long-running process given `--metrics`: the Prometheus registry too.
    Serve,
}

/// The installed exporters; [`Telemetry::shutdown`] flushes them.
pub struct Telemetry {
    /// The runtime the exporters' batch and periodic tasks run on.
    runtime: Option<tokio::runtime::Runtime>,
    spans: Option<SdkTracerProvider>,
    meters: Option<SdkMeterProvider>,
    registry: Option<prometheus::Registry>,
}

fn configured(vars: &[&str]) -> bool {
    vars.iter().any(|v| std::env::var_os(v).is_some_and(|s| !s.is_empty()))
}

/// Installs the global subscriber: the log lines on stderr (filter `MUR_LOG`, default
/// [`DEFAULT_LOG_FILTER`]: warnings, and a coordinator's role changes), plus span export
/// when an OTLP endpoint is configured, as `service` unless `OTEL_SERVICE_NAME` says
/// otherwise; and the global meter provider as `metrics` says. An exporter that cannot be
/// built is reported on stderr and left out: the command still runs.
pub fn init(service: &str, metrics: Metrics) -> Telemetry {
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    let log_filter = || EnvFilter::try_from_env("MUR_LOG").unwrap_or_else(|_| EnvFilter::new(DEFAULT_LOG_FILTER));
    // Colours only on a terminal: a log file gets plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let logs = tracing_subscriber::fmt::layer().with_writer(std::io::stderr).with_ansi(ansi).with_filter(log_filter());
    let export_spans = configured(&TRACE_ENDPOINT_VARS);
    let export_metrics = metrics != Metrics::Off && configured(&METRIC_ENDPOINT_VARS);
    let mut telemetry = Telemetry { runtime: None, spans: None, meters: None, registry: None };
    if export_spans || export_metrics {
        match exporter_runtime() {
            Ok(runtime) => telemetry.runtime = Some(runtime),
            Err(e) => eprintln!("mur: OpenTelemetry export is off: {e:#}"),
        }
    }
    let resource = || Resource::builder().with_service_name(service_name(service)).build();
    if export_spans && let Some(runtime) = &telemetry.runtime {
        match span_exporter(runtime, resource()) {
            Ok(provider) => telemetry.spans = Some(provider),
            Err(e) => eprintln!("mur: OpenTelemetry span export is off: {e:#}"),
        }
    }
    let otel = telemetry.spans.as_ref().map(|provider| {
        // Every span of murmur's own crates, whatever `MUR_LOG` shows on stderr.
        let spans = EnvFilter::new("info");
        tracing_opentelemetry::layer().with_tracer(provider.tracer("mur")).with_filter(spans)
    });
    tracing_subscriber::registry().with(logs).with(otel).init();
    let otlp = if export_metrics { telemetry.runtime.as_ref() } else { None };
    if metrics == Metrics::Serve || otlp.is_some() {
        match meters(resource(), metrics == Metrics::Serve, otlp) {
            Ok((provider, registry)) => {
                opentelemetry::global::set_meter_provider(provider.clone());
                mur_nats::metrics::enable();
                telemetry.meters = Some(provider);
                telemetry.registry = registry;
            }
            Err(e) => eprintln!("mur: metrics are off: {e:#}"),
        }
    }
    telemetry
}

/// `service.name`: `OTEL_SERVICE_NAME`, else `service`.
fn service_name(service: &str) -> String {
    std::env::var("OTEL_SERVICE_NAME").ok().filter(|s| !s.is_empty()).unwrap_or_else(|| service.into())
}

/// The meter provider: with a Prometheus reader (and the registry it fills) when `serve`,
/// with an OTLP/HTTP periodic reader on `otlp` when given. The Prometheus exporter adds no
/// `otel_scope_*` labels (every instrument is murmur's own meter) and keeps the unit and
/// `_total` suffixes of the OpenTelemetry-to-Prometheus mapping
/// (`gen_ai.client.operation.duration`, unit `s` → `gen_ai_client_operation_duration_seconds`).
fn meters(
    resource: Resource,
    serve: bool,
    otlp: Option<&tokio::runtime::Runtime>,
) -> Result<(SdkMeterProvider, Option<prometheus::Registry>)> {
    // The periodic reader spawns its task on the runtime the provider is built in.
    let _entered = otlp.map(tokio::runtime::Runtime::enter);
    let mut builder = SdkMeterProvider::builder().with_resource(resource);
    let mut registry = None;
    if serve {
        let r = prometheus::Registry::new();
        let reader = opentelemetry_prometheus::exporter()
            .with_registry(r.clone())
            .scope_info_enabled(false)
            .build()
            .context("building the Prometheus exporter")?;
        builder = builder.with_reader(reader);
        registry = Some(r);
    }
    if otlp.is_some() {
        let exporter = opentelemetry_otlp::MetricExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpBinary)
            .build()
            .context("building the OTLP/HTTP metric exporter")?;
        builder = builder.with_reader(PeriodicReader::builder(exporter, opentelemetry_sdk::runtime::Tokio).build());
    }
    Ok((builder.build(), registry))
}

/// The runtime the exporters run on: one thread of its own, so every command keeps its
/// own runtime.
fn exporter_runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("mur-otel")
        .enable_all()
        .build()
        .context("starting the exporter's runtime")
}

/// The provider exporting spans over OTLP/HTTP from `runtime`.
fn span_exporter(runtime: &tokio::runtime::Runtime, resource: Resource) -> Result<SdkTracerProvider> {
    // The processor spawns its task on the runtime it is built in.
    let _entered = runtime.enter();
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(Protocol::HttpBinary)
        .build()
        .context("building the OTLP/HTTP exporter")?;
    let processor = BatchSpanProcessor::builder(exporter, opentelemetry_sdk::runtime::Tokio).build();
    Ok(SdkTracerProvider::builder().with_span_processor(processor).with_resource(resource).build())
}

impl Telemetry {
    /// The registry `/metrics` serves, when the command was given `--metrics`.
    pub fn registry(&self) -> Option<prometheus::Registry> {
        self.registry.clone()
    }

    /// Exports the spans and metrics still queued and stops the exporters (a no-op when
    /// export is off).
    pub fn shutdown(self) {
        // Called outside any runtime: the exporters' tasks run on `runtime` meanwhile.
        if let Some(provider) = self.meters
            && let Err(e) = provider.shutdown()
        {
            eprintln!("mur: flushing OpenTelemetry metrics: {e}");
        }
        if let Some(provider) = self.spans
            && let Err(e) = provider.shutdown()
        {
            eprintln!("mur: flushing OpenTelemetry spans: {e}");
        }
        if let Some(runtime) = self.runtime {
            runtime.shutdown_timeout(std::time::Duration::from_secs(1));
        }
    }
}
