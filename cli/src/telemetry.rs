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
//! Metrics (issue #32) are recorded only when something reads them: with `--metrics`
//! ([`Telemetry::registry`], served at `/metrics` by [`crate::observe`]) a meter provider
//! is installed globally whose Prometheus reader fills that registry; without it the
//! instruments of [`mur_nats::metrics`] are the API's no-ops and cost nothing.

use anyhow::{Context as _, Result};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{Protocol, WithExportConfig as _};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::metrics::SdkMeterProvider;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use opentelemetry_sdk::trace::span_processor_with_async_runtime::BatchSpanProcessor;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;
use tracing_subscriber::{EnvFilter, Layer as _};

/// The variables that turn export on (OpenTelemetry SDK environment variables).
const ENDPOINT_VARS: [&str; 2] = ["OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"];

/// The log filter when `MUR_LOG` is unset: warnings, and the lines a coordinator writes
/// when it stands by or starts leading ([`mur_coordinator::service::ROLE_LOG_TARGET`],
/// issue #29 item 14).
pub const DEFAULT_LOG_FILTER: &str = "warn,mur::role=info";

/// The installed exporter; [`Telemetry::shutdown`] flushes it.
pub struct Telemetry {
    export: Option<(SdkTracerProvider, tokio::runtime::Runtime)>,
    metrics: Option<(SdkMeterProvider, prometheus::Registry)>,
}

/// Installs the global subscriber: the log lines on stderr (filter `MUR_LOG`, default
/// [`DEFAULT_LOG_FILTER`]: warnings, and a coordinator's role changes), plus span export when an OTLP endpoint is configured, as `service` unless
/// `OTEL_SERVICE_NAME` says otherwise. An exporter that cannot be built is reported on
/// stderr and left out: the command still runs.
///
/// With `prometheus` (the command was given `--metrics`), also installs the global meter
/// provider whose reader fills [`Telemetry::registry`].
pub fn init(service: &str, prometheus: bool) -> Telemetry {
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    let log_filter = || EnvFilter::try_from_env("MUR_LOG").unwrap_or_else(|_| EnvFilter::new(DEFAULT_LOG_FILTER));
    // Colours only on a terminal: a log file gets plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let logs = tracing_subscriber::fmt::layer().with_writer(std::io::stderr).with_ansi(ansi).with_filter(log_filter());
    let configured = ENDPOINT_VARS.iter().any(|v| std::env::var_os(v).is_some_and(|s| !s.is_empty()));
    let export = if configured {
        match exporter(service) {
            Ok(export) => Some(export),
            Err(e) => {
                eprintln!("mur: OpenTelemetry export is off: {e:#}");
                None
            }
        }
    } else {
        None
    };
    let otel = export.as_ref().map(|(provider, _)| {
        // Every span of murmur's own crates, whatever `MUR_LOG` shows on stderr.
        let spans = EnvFilter::new("info");
        tracing_opentelemetry::layer().with_tracer(provider.tracer("mur")).with_filter(spans)
    });
    tracing_subscriber::registry().with(logs).with(otel).init();
    let metrics = if prometheus {
        match meters(service) {
            Ok(metrics) => Some(metrics),
            Err(e) => {
                eprintln!("mur: metrics are off: {e:#}");
                None
            }
        }
    } else {
        None
    };
    Telemetry { export, metrics }
}

/// `service.name`: `OTEL_SERVICE_NAME`, else `service`.
fn service_name(service: &str) -> String {
    std::env::var("OTEL_SERVICE_NAME").ok().filter(|s| !s.is_empty()).unwrap_or_else(|| service.into())
}

/// The global meter provider with a Prometheus reader, and the registry it fills. The
/// exporter adds no `otel_scope_*` labels (every instrument is murmur's own meter) and
/// keeps the unit and `_total` suffixes of the OpenTelemetry-to-Prometheus mapping
/// (`gen_ai.client.operation.duration`, unit `s` → `gen_ai_client_operation_duration_seconds`).
fn meters(service: &str) -> Result<(SdkMeterProvider, prometheus::Registry)> {
    let registry = prometheus::Registry::new();
    let reader = opentelemetry_prometheus::exporter()
        .with_registry(registry.clone())
        .scope_info_enabled(false)
        .build()
        .context("building the Prometheus exporter")?;
    let resource = Resource::builder().with_service_name(service_name(service)).build();
    let provider = SdkMeterProvider::builder().with_reader(reader).with_resource(resource).build();
    opentelemetry::global::set_meter_provider(provider.clone());
    mur_nats::metrics::enable();
    Ok((provider, registry))
}

/// The provider exporting over OTLP/HTTP, and the runtime its batch processor runs on.
fn exporter(service: &str) -> Result<(SdkTracerProvider, tokio::runtime::Runtime)> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("mur-otel")
        .enable_all()
        .build()
        .context("starting the exporter's runtime")?;
    // The processor spawns its task on the runtime it is built in.
    let _entered = runtime.enter();
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(Protocol::HttpBinary)
        .build()
        .context("building the OTLP/HTTP exporter")?;
    let processor = BatchSpanProcessor::builder(exporter, opentelemetry_sdk::runtime::Tokio).build();
    let resource = Resource::builder().with_service_name(service_name(service)).build();
    let provider = SdkTracerProvider::builder().with_span_processor(processor).with_resource(resource).build();
    Ok((provider, runtime))
}

impl Telemetry {
    /// The registry `/metrics` serves, when metrics are on.
    pub fn registry(&self) -> Option<prometheus::Registry> {
        self.metrics.as_ref().map(|(_, registry)| registry.clone())
    }

    /// Exports the spans still queued and stops the exporter (a no-op when export is off).
    pub fn shutdown(self) {
        if let Some((provider, _)) = &self.metrics {
            let _ = provider.shutdown();
        }
        let Some((provider, runtime)) = self.export else { return };
        // Called outside any runtime: the processor's task runs on `runtime` meanwhile.
        if let Err(e) = provider.shutdown() {
            eprintln!("mur: flushing OpenTelemetry spans: {e}");
        }
        runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    }
}
