//! murmur's metrics (issue #32 §Metrics): the instruments every process records to, on the
//! OpenTelemetry metrics API, named after the OpenTelemetry semantic conventions where
//! they have a name (`gen_ai.client.token.usage`, `gen_ai.client.operation.duration`) and
//! `mur.*` otherwise.
//!
//! What reads them is the binary's choice: `mur` installs a meter provider only when a
//! process serves `/metrics` (`--metrics`) or exports OTLP metrics; otherwise the global
//! provider is the API's no-op and recording costs a call. Prometheus names follow the
//! OpenTelemetry mapping: dots become underscores, unit `s` adds `_seconds`, counters end
//! `_total` (`mur.task.ends` → `mur_task_ends_total`).
//!
//! Labels stay bounded: capsule, lane, exit status, model, provider, token type, hook,
//! tool and fleet names — never a task id or free text.
//!
//! The leader's cluster-wide gauges ([`ClusterGauges`]) are published by the leading
//! coordinator with [`publish_cluster`] and read when the metrics are collected; a
//! publication older than [`CLUSTER_GAUGES_TTL`] is not reported, so a coordinator that
//! stopped leading stops reporting them.

use mur_proto::cluster::TaskRecord;
use opentelemetry::KeyValue;
use opentelemetry::metrics::{Counter, Histogram, Meter, ObservableGauge};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

static ENABLED: AtomicBool = AtomicBool::new(false);

/// Says that a meter provider reads the instruments: from now on [`get`] gives the
/// instruments of the global provider installed by then, and work done only for metrics
/// (the leader's gauges) is done. The binary calls it when it installs one.
pub fn enable() {
    ENABLED.store(true, Ordering::Relaxed);
}

/// Undoes [`enable`]: [`get`] gives no-op instruments again (the benchmark's "metrics
/// off" runs between "on" runs in one process).
pub fn disable() {
    ENABLED.store(false, Ordering::Relaxed);
}

/// Whether [`enable`] was called.
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// A model call ended after `elapsed`: `gen_ai.client.operation.duration`, with
/// `error.type` = `error` when it failed.
pub fn model_call(provider: &'static str, model: &str, elapsed: Duration, error: Option<String>) {
    let mut labels = vec![
        KeyValue::new("gen_ai.operation.name", "chat"),
        KeyValue::new("gen_ai.provider.name", provider),
        KeyValue::new("gen_ai.request.model", model.to_string()),
    ];
    if let Some(error) = error {
        labels.push(KeyValue::new("error.type", error));
    }
    get().operation_duration.record(elapsed.as_secs_f64(), &labels);
}

/// A model call's tokens: `gen_ai.client.token.usage` once per type (`cached` only when
/// the provider reported cache reads).
pub fn tokens(provider: &'static str, model: &str, input: u64, output: u64, cached: Option<u64>) {
    let m = get();
    let record = |kind: &'static str, n: u64| {
        let labels = [
            KeyValue::new("gen_ai.operation.name", "chat"),
            KeyValue::new("gen_ai.provider.name", provider),
            KeyValue::new("gen_ai.request.model", model.to_string()),
            KeyValue::new("gen_ai.token.type", kind),
        ];
        m.token_usage.record(n, &labels);
    };
    record("input", input);
    record("output", output);
    if let Some(cached) = cached {
        record("cached", cached);
    }
}

/// A worker took `record` (now `working`) on its `delivery`-th delivery, from its
/// checkpoints when `takeover`: the dispatch latency (submission to now), a redelivery
/// after the first delivery, a takeover.
pub fn task_started(record: &TaskRecord, delivery: u64, takeover: bool, now_ms: u64) {
    let m = get();
    let capsule = [KeyValue::new("capsule", record.capsule.clone())];
    if delivery > 1 {
        m.redeliveries.add(1, &capsule);
    }
    if takeover {
        m.takeovers.add(1, &capsule);
    } else if delivery == 1 {
        // The first start only: a redelivery's latency is the ack wait's, not dispatch's.
        let secs = now_ms.saturating_sub(record.submitted_at) as f64 / 1000.0;
        m.dispatch_latency.record(secs, &[KeyValue::new("lane", record.origin.lane().as_str())]);
    }
}

/// The leader dead-lettered a task of `capsule`: `mur.task.dead_letters`.
pub fn dead_letter(capsule: &str) {
    get().dead_letters.add(1, &[KeyValue::new("capsule", capsule.to_string())]);
}

/// A tool call of `tool` took `elapsed`: `mur.tool.duration`.
pub fn tool_call(tool: &str, elapsed: Duration) {
    get().tool_duration.record(elapsed.as_secs_f64(), &[KeyValue::new("gen_ai.tool.name", tool.to_string())]);
}

/// The hook `hook` answered `event` (its binding, `on-task-end`) after `elapsed`:
/// `mur.hook.duration`.
pub fn hook_call(hook: &str, event: &'static str, elapsed: Duration) {
    let labels = [KeyValue::new("hook", hook.to_string()), KeyValue::new("event", event)];
    get().hook_duration.record(elapsed.as_secs_f64(), &labels);
}

/// A fleet's steps cost `usd` more: `mur.fleet.spend.usd`.
pub fn fleet_spend(fleet: &str, usd: f64) {
    if usd > 0.0 {
        get().fleet_spend.add(usd, &[KeyValue::new("fleet", fleet.to_string())]);
    }
}

/// This coordinator took the lease (`to` = `leading`) or gave it up (`standby`):
/// `mur.leader.changes`.
pub fn leader_change(to: &'static str) {
    get().leader_changes.add(1, &[KeyValue::new("to", to)]);
}

/// The terminal `record` was written by this process: `mur.task.ends`.
pub fn task_ended(record: &TaskRecord) {
    let status = record.exit_status.map_or("unknown", |s| s.as_str());
    get().task_ends.add(1, &[KeyValue::new("capsule", record.capsule.clone()), KeyValue::new("exit_status", status)]);
}

/// The meter's name (the instrumentation scope).
pub const METER: &str = "mur";

/// How long a [`publish_cluster`] publication is reported.
pub const CLUSTER_GAUGES_TTL: Duration = Duration::from_secs(15);

/// Bucket bounds of `gen_ai.client.operation.duration` (seconds), as the semantic
/// conventions advise.
const MODEL_CALL_BOUNDS: [f64; 14] =
    [0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92];

/// Bucket bounds of `gen_ai.client.token.usage` (tokens), as the semantic conventions
/// advise.
const TOKEN_BOUNDS: [f64; 14] = [
    1.0, 4.0, 16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0, 262144.0, 1048576.0, 4194304.0, 16777216.0,
    67108864.0,
];

/// Bucket bounds of the dispatch latency, hook and tool durations (seconds): a millisecond
/// to five minutes.
const LATENCY_BOUNDS: [f64; 17] =
    [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0];

/// The instruments; [`get`] gives the process's one set.
pub struct Metrics {
    /// `gen_ai.client.token.usage` (histogram, `{token}`): tokens per model call, by
    /// `gen_ai.operation.name`, `gen_ai.provider.name`, `gen_ai.request.model` and
    /// `gen_ai.token.type` (`input`, `output`; `cached` for the input tokens the provider
    /// read from its cache, murmur's addition).
    pub token_usage: Histogram<u64>,
    /// `gen_ai.client.operation.duration` (histogram, `s`): one model call, retries
    /// included, by `gen_ai.operation.name`, `gen_ai.provider.name`,
    /// `gen_ai.request.model` and, when it failed, `error.type`.
    pub operation_duration: Histogram<f64>,
    /// `mur.task.ends` (counter, `{task}`): tasks ended, by `capsule` and `exit_status`
    /// (`ok`, `failed`, `max_turns_reached`, `canceled`, …), counted by the process that
    /// wrote the terminal record.
    pub task_ends: Counter<u64>,
    /// `mur.task.dispatch.latency` (histogram, `s`): from a task's submission to its
    /// `task_start` on a worker, by `lane`.
    pub dispatch_latency: Histogram<f64>,
    /// `mur.task.redeliveries` (counter, `{delivery}`): dispatches a worker received more
    /// than once (its earlier worker stopped answering, or a nak), by `capsule`.
    pub redeliveries: Counter<u64>,
    /// `mur.task.takeovers` (counter, `{task}`): tasks a worker took over from its
    /// checkpoints, by `capsule`.
    pub takeovers: Counter<u64>,
    /// `mur.task.dead_letters` (counter, `{task}`): tasks the leader dead-lettered after
    /// their last delivery.
    pub dead_letters: Counter<u64>,
    /// `mur.hook.duration` (histogram, `s`): one hook dispatch, by `hook` (its name in the
    /// manifest) and `event`.
    pub hook_duration: Histogram<f64>,
    /// `mur.tool.duration` (histogram, `s`): one tool call, by `gen_ai.tool.name`.
    pub tool_duration: Histogram<f64>,
    /// `mur.fleet.spend.usd` (counter, `USD`): what fleet steps' model calls cost, by
    /// `fleet`, counted as each step ends.
    pub fleet_spend: Counter<f64>,
    /// `mur.leader.changes` (counter, `{change}`): this coordinator taking the lease
    /// (`to` = `leading`) or giving it up (`to` = `standby`).
    pub leader_changes: Counter<u64>,
    _gauges: Vec<ObservableGauge<u64>>,
    _age: ObservableGauge<f64>,
}

/// The leader's view of the cluster, published every few seconds ([`publish_cluster`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ClusterGauges {
    /// Per capsule and lane (`user`, `peer`, `bg`): tasks waiting, and the oldest one's
    /// age in seconds.
    pub waiting: Vec<Waiting>,
    /// Tasks released and not ended, per capsule.
    pub in_flight: Vec<(String, u64)>,
    /// Live workers.
    pub workers: u64,
    /// Their slots.
    pub slots: u64,
    /// Their free slots.
    pub free_slots: u64,
    /// Fan-out permits held now.
    pub permits_in_use: u64,
    /// The fan-out cap the holders and waiters were given (the largest; 0 when none).
    pub permits_cap: u64,
}

/// The waiting tasks of one capsule in one lane.
#[derive(Clone, Debug, PartialEq)]
pub struct Waiting {
    /// The capsule.
    pub capsule: String,
    /// The lane.
    pub lane: String,
    /// How many wait.
    pub tasks: u64,
    /// The oldest one's age, seconds.
    pub oldest_age_secs: f64,
}

static CLUSTER: Mutex<Option<(Instant, ClusterGauges)>> = Mutex::new(None);

/// Publishes the leader's view of the cluster, reported until [`CLUSTER_GAUGES_TTL`] has
/// passed or the next publication.
pub fn publish_cluster(gauges: ClusterGauges) {
    *CLUSTER.lock().unwrap_or_else(|e| e.into_inner()) = Some((Instant::now(), gauges));
}

/// The last publication, while fresh.
fn cluster() -> Option<ClusterGauges> {
    let held = CLUSTER.lock().unwrap_or_else(|e| e.into_inner());
    held.as_ref().filter(|(at, _)| at.elapsed() < CLUSTER_GAUGES_TTL).map(|(_, g)| g.clone())
}

/// The process's instruments: while metrics are off ([`enable`] not called), no-op ones;
/// once on, those made from the global meter provider on first use after [`enable`].
pub fn get() -> &'static Metrics {
    static METRICS: OnceLock<Metrics> = OnceLock::new();
    static NOOP: OnceLock<Metrics> = OnceLock::new();
    if enabled() {
        METRICS.get_or_init(|| Metrics::new(&opentelemetry::global::meter(METER)))
    } else {
        let noop = opentelemetry::metrics::noop::NoopMeterProvider::new();
        NOOP.get_or_init(|| Metrics::new(&opentelemetry::metrics::MeterProvider::meter(&noop, METER)))
    }
}

/// A gauge of [`ClusterGauges`] read by `read`.
fn cluster_gauge(
    meter: &Meter,
    name: &'static str,
    unit: &'static str,
    description: &'static str,
    read: impl Fn(&ClusterGauges) -> Vec<(u64, Vec<KeyValue>)> + Send + Sync + 'static,
) -> ObservableGauge<u64> {
    meter
        .u64_observable_gauge(name)
        .with_unit(unit)
        .with_description(description)
        .with_callback(move |observer| {
            if let Some(gauges) = cluster() {
                for (value, labels) in read(&gauges) {
                    observer.observe(value, &labels);
                }
            }
        })
        .build()
}

impl Metrics {
    fn new(meter: &Meter) -> Metrics {
        let seconds = |name: &'static str, description: &'static str, bounds: &[f64]| {
            meter
                .f64_histogram(name)
                .with_unit("s")
                .with_description(description)
                .with_boundaries(bounds.to_vec())
                .build()
        };
        let count = |name: &'static str, unit: &'static str, description: &'static str| {
            meter.u64_counter(name).with_unit(unit).with_description(description).build()
        };
        let gauges = vec![
            cluster_gauge(meter, "mur.tasks.waiting", "{task}", "Tasks waiting, per capsule and lane", |g| {
                g.waiting
                    .iter()
                    .map(|w| {
                        (
                            w.tasks,
                            vec![KeyValue::new("capsule", w.capsule.clone()), KeyValue::new("lane", w.lane.clone())],
                        )
                    })
                    .collect()
            }),
            cluster_gauge(meter, "mur.tasks.in_flight", "{task}", "Tasks released and not ended, per capsule", |g| {
                g.in_flight.iter().map(|(capsule, n)| (*n, vec![KeyValue::new("capsule", capsule.clone())])).collect()
            }),
            cluster_gauge(meter, "mur.workers.alive", "{worker}", "Live workers", |g| vec![(g.workers, vec![])]),
            cluster_gauge(meter, "mur.workers.slots", "{slot}", "The live workers' slots", |g| vec![(g.slots, vec![])]),
            cluster_gauge(meter, "mur.workers.slots.free", "{slot}", "The live workers' free slots", |g| {
                vec![(g.free_slots, vec![])]
            }),
            cluster_gauge(meter, "mur.fanout.permits.in_use", "{permit}", "Fan-out permits held", |g| {
                vec![(g.permits_in_use, vec![])]
            }),
            cluster_gauge(meter, "mur.fanout.permits.cap", "{permit}", "The fan-out cap", |g| {
                vec![(g.permits_cap, vec![])]
            }),
        ];
        let age = meter
            .f64_observable_gauge("mur.tasks.waiting.oldest_age")
            .with_unit("s")
            .with_description("The oldest waiting task's age, per capsule and lane")
            .with_callback(|observer| {
                for w in cluster().map(|g| g.waiting).unwrap_or_default() {
                    let labels = [KeyValue::new("capsule", w.capsule), KeyValue::new("lane", w.lane)];
                    observer.observe(w.oldest_age_secs, &labels);
                }
            })
            .build();
        Metrics {
            token_usage: meter
                .u64_histogram("gen_ai.client.token.usage")
                .with_unit("{token}")
                .with_description("Number of input and output tokens used")
                .with_boundaries(TOKEN_BOUNDS.to_vec())
                .build(),
            operation_duration: seconds(
                "gen_ai.client.operation.duration",
                "GenAI operation duration",
                &MODEL_CALL_BOUNDS,
            ),
            task_ends: count("mur.task.ends", "{task}", "Tasks ended, by exit status"),
            dispatch_latency: seconds(
                "mur.task.dispatch.latency",
                "From a task's submission to its start on a worker",
                &LATENCY_BOUNDS,
            ),
            redeliveries: count("mur.task.redeliveries", "{delivery}", "Dispatches delivered again"),
            takeovers: count("mur.task.takeovers", "{task}", "Tasks taken over from their checkpoints"),
            dead_letters: count("mur.task.dead_letters", "{task}", "Tasks dead-lettered"),
            hook_duration: seconds("mur.hook.duration", "One hook dispatch", &LATENCY_BOUNDS),
            tool_duration: seconds("mur.tool.duration", "One tool call", &LATENCY_BOUNDS),
            fleet_spend: meter
                .f64_counter("mur.fleet.spend.usd")
                .with_unit("USD")
                .with_description("What fleet steps' model calls cost")
                .build(),
            leader_changes: count("mur.leader.changes", "{change}", "This coordinator taking or giving up the lease"),
            _gauges: gauges,
            _age: age,
        }
    }
}
