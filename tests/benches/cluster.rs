//! `cargo bench -p mur-tests --bench cluster`: the cluster's speed (issue #9).
//!
//! One run starts its own nats-server (file storage, as deployed) and reports:
//!
//! - the baseline: a raw JetStream round trip on that server, measured first: publish a
//!   message the size of a dispatch into a work-queue stream (awaiting the stream's ack),
//!   receive it on a waiting batch-1 pull consumer, double-ack it;
//! - the no-op round trip: submit a task over the NATS API (`mur.api.task.submit`) → its
//!   terminal record reaches the client, one task at a time, a scripted capsule whose one
//!   reply ends the task. The client holds one watch on `mur_tasks`, opened before; a
//!   second figure waits as `mur task send --wait` does (a watch opened per task, after
//!   the submit reply);
//! - the dispatch latency of the same tasks: submit → the worker's `task_start` trace line
//!   reaches the client (on `mur.trace.>`), and its ratio to the raw round trip;
//! - the sustained throughput of no-op tasks with 1 and 4 in-process workers of 8 slots
//!   (the default), tasks submitted by 32 concurrent callers;
//! - the slow-model cycle's ceiling on this machine, measured before the cluster's figure:
//!   the same broker traffic per task as the cluster's path (records, index read, release,
//!   dispatch, pull, trace lines, acks) exchanged by a minimal coordinator and four minimal
//!   workers with nothing else to do, the model an exact 200 ms sleep (`raw_cycle.rs`;
//!   `MUR_BENCH_RAW=minimal`: records and the dispatch only); the cluster's figure is
//!   printed as a share of it too;
//! - the throughput of 4 workers × 16 slots with a model answering every call after 200 ms,
//!   against the ideal (slots ÷ 0.2 s): a fake OpenAI server over a real socket, and the
//!   scripted driver's `delay_ms` (the cluster's own overhead, without an HTTP client);
//!   640 tasks from the first submit to the last end, three runs, the median judged (with
//!   one round of 64 and the rate once every slot is busy beside it); with the fake
//!   OpenAI server, where each task's cycle goes (`working` seen → the model's request,
//!   the request → its answer, the answer → the terminal record seen; every prompt names
//!   its task, so the server's timings are matched to it);
//! - what authentication and TLS cost (issue #31): the no-op round trip p50 and the no-op
//!   throughput (1 worker × 8 slots) on a plaintext cluster and on one with `mur auth init
//!   --tls`'s configuration (every process on its role's credentials over TLS, the
//!   coordinator with its identity connection), alternated twice, each round a fresh
//!   cluster; the means and their ratios (targets: p50 ≤ 1.25×, throughput ≥ 0.85× the
//!   plaintext figures);
//! - the resident memory (`VmRSS`) of a `mur worker` process with 16 slots, idle and with
//!   16 sessions running against that fake model (idle = registered, before any task);
//! - a `mur coordinator` process restarting over a store of 3000 ended tasks with 100 KB
//!   results each: the time until it has restored its scheduler, its peak resident
//!   memory (`VmHWM`), and how long a `capsule.list` asked as the restore starts waits for
//!   its answer, against the same over an empty store.
//!
//! The coordinator, the in-process workers and the client share this process and its
//! runtime, and the machine with nats-server; on a 2-core box everything competes for the
//! same two cores, as it would in `mur dev`.
//!
//! `MUR_BENCH_PHASES` picks phases, for profiling one: any of `noop` (baseline, round
//! trips, dispatch, no-op throughput), `metrics`, `secured`, `slow`, `memory` and `restore`,
//! comma-separated; all by default.
//!
//! Sizes: a release build runs the full counts; a debug build (`cargo test --workspace`,
//! CI's smoke run) or `MUR_BENCH_QUICK=1` runs a few dozen tasks per figure. Figures and
//! pass/fail are printed; no target fails the run (only a task that does not finish does).
//!
//! The `mur` binary is taken from `MUR_BIN` or next to this benchmark
//! (`target/<profile>/mur`): `cargo test --workspace` builds it; for the release figures
//! run `cargo build --release --bin mur` first. Without it the memory figures are skipped.

use async_nats::jetstream::{self, consumer, stream};
use futures::StreamExt;
use mur_proto::TaskId;
use mur_proto::cluster::{self, Dispatch, SubmitReply, SubmitRequest, api};
use mur_proto::task::{Origin, TaskState};
use mur_proto::{Id, IdKind};
use mur_tests::capsule::TestCapsule;
use mur_tests::fake_openai::{FakeOpenAi, FakeReply};
use mur_tests::sandbox::Sandbox;
use serde::Deserialize;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::Notify;

#[path = "cluster/raw_cycle.rs"]
mod raw_cycle;

/// How long any one phase may take before the run fails (a loaded CI box included).
const PHASE_DEADLINE: Duration = Duration::from_secs(300);
/// The fake model's answer time in the slow-model figure.
const MODEL_DELAY: Duration = Duration::from_millis(200);

/// How many of everything.
struct Sizes {
    raw: usize,
    round_trips: usize,
    waits: usize,
    noop_tasks: usize,
    slow_rounds: usize,
    /// How many times the slow-model run is repeated; the median is judged.
    slow_runs: usize,
    /// Ended task records in the store a coordinator restarts over.
    ended_records: usize,
}

impl Sizes {
    fn get() -> (Sizes, bool) {
        let quick = cfg!(debug_assertions) || std::env::var_os("MUR_BENCH_QUICK").is_some_and(|v| v != "0");
        if quick {
            (
                Sizes {
                    raw: 50,
                    round_trips: 30,
                    waits: 10,
                    noop_tasks: 40,
                    slow_rounds: 1,
                    slow_runs: 1,
                    ended_records: 40,
                },
                true,
            )
        } else {
            (
                Sizes {
                    raw: 3000,
                    round_trips: 1000,
                    waits: 200,
                    noop_tasks: 4000,
                    slow_rounds: 10,
                    slow_runs: 3,
                    ended_records: 3000,
                },
                false,
            )
        }
    }
}

/// The allocator `mur` ships with (cli/src/main.rs): the coordinator and the workers run in
/// this process, and should allocate as they do in `mur`.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    mur_nats::tls::install_crypto_provider();
    let (sizes, quick) = Sizes::get();
    // Every file of the run (nats-server's store, the workers' session folders) goes to a
    // fresh folder in shared memory (`/dev/shm`) where there is one, else under the target
    // directory, as cargo provides for benchmarks; `MUR_BENCH_TMPDIR` chooses another place.
    // Why not the disk: this kind of machine's root file system is ext4 *without a journal*,
    // where the kernel skips every inode freed in the last 60 s when it allocates one
    // (`recently_deleted` in fs/ext4/ialloc.c, checked only without a journal): after the
    // no-op phase's folders are removed, each new session folder scanned past tens of
    // thousands of them, and a profile of the slow phase showed 55 % of all CPU there
    // (87–89 % of ideal on disk against 95–97 % in shared memory, same build, same hour).
    // That measures the disk's bookkeeping, not murmur; a journaled ext4 does not do it.
    // A folder made in /dev/shm is removed when `shm` drops, at the end of the run.
    let chosen = std::env::var_os("MUR_BENCH_TMPDIR").map(std::path::PathBuf::from);
    let shm =
        chosen.is_none().then(|| tempfile::Builder::new().prefix("mur-bench-").tempdir_in("/dev/shm").ok()).flatten();
    let scratch = chosen
        .or_else(|| shm.as_ref().map(|d| d.path().to_path_buf()))
        .unwrap_or_else(|| std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")));
    std::fs::create_dir_all(&scratch).expect("the benchmark's scratch directory");
    let _ = tempfile::env::override_temp_dir(&scratch);
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("tokio runtime");
    let mut table = Table::default();
    table.note(&format!("scratch files (nats-server's store, session folders) under {}", scratch.display()));
    // `MUR_BENCH_PHASES=noop,slow,memory,restore` (any of them; all by default) runs fewer, for
    // profiling one.
    let phases =
        std::env::var("MUR_BENCH_PHASES").unwrap_or_else(|_| "noop,metrics,secured,slow,memory,restore".into());
    let phase = |name: &str| phases.split(',').any(|p| p.trim() == name);
    runtime.block_on(async {
        if phase("noop") {
            latency_and_noop_throughput(&sizes, &mut table).await;
        }
        if phase("metrics") {
            metrics_cost(&sizes, &mut table).await;
        }
        if phase("secured") {
            security_cost(&sizes, &mut table).await;
        }
        if phase("slow") {
            slow_model_throughput(&sizes, &mut table).await;
        }
        if phase("memory") {
            worker_memory(&mut table).await;
        }
        if phase("restore") {
            coordinator_restore(&sizes, &mut table).await;
        }
    });
    table.print(quick);
    drop(shm);
}

// ---------------------------------------------------------------------------------------
// Phase 1: raw baseline, round trips, dispatch latency, no-op throughput.

async fn latency_and_noop_throughput(sizes: &Sizes, table: &mut Table) {
    let mut sb = Sandbox::start(1, 8).await;
    let noop = noop_capsule();
    sb.push(noop.dir()).await;

    let raw = raw_round_trips(&sb, sizes.raw).await;
    table.row(
        &format!("raw JetStream publish → pull → ack (n={})", raw.len()),
        quantiles(&raw),
        "baseline".into(),
        None,
    );

    let watcher = Watcher::start(&sb.client, true).await;
    // Warm up: the bundle is fetched and unpacked by the first task.
    for _ in 0..3 {
        let id = submit(&sb.client, "noop").await;
        watcher.wait_ended(&id, true).await;
    }
    let mut round_trips = Vec::with_capacity(sizes.round_trips);
    let mut dispatches = Vec::with_capacity(sizes.round_trips);
    let mut timeline = Timeline::default();
    for _ in 0..sizes.round_trips {
        let t0 = Instant::now();
        let id = submit(&sb.client, "noop").await;
        let replied = t0.elapsed();
        let steps = watcher.wait_ended(&id, true).await;
        let (Some(ended), Some(started)) = (steps.ended, steps.started) else { unreachable!("waited for both") };
        round_trips.push(ended - t0);
        dispatches.push(started - t0);
        timeline.add(t0, replied, &steps);
    }
    let (rt50, rt99) = quantiles(&round_trips);
    table.row(
        &format!("no-op round trip, submit → result (n={})", round_trips.len()),
        (rt50, rt99),
        "p50 < 1.5 ms, p99 < 5 ms".into(),
        Some(rt50 < Duration::from_micros(1500) && rt99 < Duration::from_millis(5)),
    );
    let (d50, d99) = quantiles(&dispatches);
    let (raw50, raw99) = quantiles(&raw);
    // The issue's reference machine had a raw round trip of p50 0.28 ms: its 1.5 ms target is
    // 5.4× that. Printed beside the absolute target, which alone is judged.
    table.note(&format!(
        "no-op round trip: p50 {:.1}× this server's raw round trip (the target, 1.5 ms, is 5.4× the \
         reference machine's raw p50 of 0.28 ms; this machine's is {})",
        ratio(rt50, raw50),
        ms(raw50)
    ));
    let (r50, r99) = (ratio(d50, raw50), ratio(d99, raw99));
    table.row(
        &format!("dispatch, submit → task_start (n={})", dispatches.len()),
        (d50, d99),
        format!("≤ 5× raw: {r50:.1}× / {r99:.1}×"),
        Some(r50 <= 5.0 && r99 <= 5.0),
    );
    table.timeline = Some(timeline);
    watcher.stop_detail();

    // As `mur task send --wait` waits: a watch of its own per task, after the reply.
    let js = jetstream::new(sb.client.clone());
    let tasks = js.get_key_value(cluster::TASKS_BUCKET).await.expect("mur_tasks");
    let mut waits = Vec::with_capacity(sizes.waits);
    for _ in 0..sizes.waits {
        let t0 = Instant::now();
        let id = submit(&sb.client, "noop").await;
        let mut watch = tasks.watch_with_history(&id).await.expect("watch a task");
        while let Some(entry) = watch.next().await {
            let entry = entry.expect("watch entry");
            if state_of(&entry.value).is_some_and(TaskState::is_terminal) {
                break;
            }
        }
        waits.push(t0.elapsed());
    }
    table.row(
        &format!("  round trip waiting as `task send --wait` (n={})", waits.len()),
        quantiles(&waits),
        "(a watch per task)".into(),
        None,
    );

    let one = throughput(&sb, &watcher, "noop", sizes.noop_tasks, 8, None).await;
    table.rate(
        &format!("no-op throughput, 1 worker × 8 slots (n={})", sizes.noop_tasks),
        one.per_s,
        "≥ 1700 tasks/s",
        Some(one.per_s >= 1700.0),
    );
    table.note(&format!("1 worker: {}", one.describe()));
    for i in 1..4 {
        sb.add_worker(&format!("wkr-test-{i}"), 8).await;
    }
    sb.wait_ready(4).await;
    let four = throughput(&sb, &watcher, "noop", sizes.noop_tasks, 32, None).await;
    table.rate(
        &format!("no-op throughput, 4 workers × 8 slots (n={})", sizes.noop_tasks),
        four.per_s,
        "≥ 1700 tasks/s",
        Some(four.per_s >= 1700.0),
    );
    table.note(&format!("4 workers: {}", four.describe()));
    drop(watcher);
    sb.shutdown().await;
}

// ---------------------------------------------------------------------------------------
// Phase 1b: what metrics cost (issue #32: "metrics on must not slow the cluster").

/// No-op throughput (1 worker × 8 slots) with metrics off and on, alternated twice in this
/// process: "on" is what `--metrics` installs (the global meter provider with the
/// Prometheus reader, `mur_nats::metrics::enable`), each round on a fresh cluster so that
/// the leader's gauges refresh runs in the "on" rounds only. The registry is scraped once
/// at the end, to show the instruments were recorded to.
async fn metrics_cost(sizes: &Sizes, table: &mut Table) {
    let registry = prometheus::Registry::new();
    let reader = opentelemetry_prometheus::exporter()
        .with_registry(registry.clone())
        .scope_info_enabled(false)
        .build()
        .expect("the Prometheus exporter");
    let provider = opentelemetry_sdk::metrics::SdkMeterProvider::builder().with_reader(reader).build();
    opentelemetry::global::set_meter_provider(provider.clone());
    // `MUR_BENCH_METRICS_TASKS` sets the tasks per round (a debug build's smoke size is too
    // small to tell 3 % apart).
    let n = std::env::var("MUR_BENCH_METRICS_TASKS").ok().and_then(|v| v.parse().ok()).unwrap_or(sizes.noop_tasks);
    let mut rates = [Vec::new(), Vec::new()];
    for on in [false, true, false, true] {
        if on {
            mur_nats::metrics::enable();
        } else {
            mur_nats::metrics::disable();
        }
        let sb = Sandbox::start(1, 8).await;
        let noop = noop_capsule();
        sb.push(noop.dir()).await;
        let watcher = Watcher::start(&sb.client, false).await;
        for _ in 0..3 {
            let id = submit(&sb.client, "noop").await;
            watcher.wait_ended(&id, false).await;
        }
        let load = throughput(&sb, &watcher, "noop", n, 8, None).await;
        rates[usize::from(on)].push(load.per_s);
        drop(watcher);
        sb.shutdown().await;
    }
    mur_nats::metrics::disable();
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let (off, on) = (mean(&rates[0]), mean(&rates[1]));
    table.rate(&format!("no-op throughput, metrics off (n={n} × 2)"), off, "baseline", None);
    let cost = (off - on) / off * 100.0;
    table.rate(
        &format!("no-op throughput, metrics on (n={n} × 2)"),
        on,
        &format!("within 3 % of off: {:+.1} %", -cost),
        Some(cost <= 3.0),
    );
    let mut text = String::new();
    prometheus::TextEncoder::new().encode_utf8(&registry.gather(), &mut text).expect("encode");
    let ends = text.lines().find(|l| l.starts_with("mur_task_ends_total{")).unwrap_or("(none)");
    table.note(&format!("metrics rounds: off {:?}, on {:?} tasks/s; the scrape's {ends}", rates[0], rates[1]));
    let _ = provider.shutdown();
}

// ---------------------------------------------------------------------------------------
// Phase 1c: what authentication and TLS cost (issue #31: p50 within 1.25×, throughput
// within 0.85× of plaintext).

/// The no-op round trip (one task at a time, submit → terminal record seen) and the no-op
/// throughput (1 worker × 8 slots, 8 callers) on a plaintext cluster and on a secured one
/// ([`Sandbox::start_secured`]: TLS, each role's credentials, the coordinator's identity
/// connection), alternated twice, each round on a fresh cluster; prints the means and the
/// ratios. The secured cluster's configuration comes from `mur auth init`: without the
/// `mur` binary the phase is skipped.
async fn security_cost(sizes: &Sizes, table: &mut Table) {
    if mur_binary().is_none() {
        table.note("auth + TLS phase skipped: no mur binary (cargo build --release --bin mur)");
        return;
    }
    let mut p50s: [Vec<Duration>; 2] = [Vec::new(), Vec::new()];
    let mut rates: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
    for secured in [false, true, false, true] {
        let sb = if secured { Sandbox::start_secured(1, 8).await } else { Sandbox::start(1, 8).await };
        let noop = noop_capsule();
        sb.push(noop.dir()).await;
        let watcher = Watcher::start(&sb.client, false).await;
        for _ in 0..3 {
            let id = submit(&sb.client, "noop").await;
            watcher.wait_ended(&id, false).await;
        }
        let mut trips = Vec::with_capacity(sizes.round_trips);
        for _ in 0..sizes.round_trips {
            let t0 = Instant::now();
            let id = submit(&sb.client, "noop").await;
            watcher.wait_ended(&id, false).await;
            trips.push(t0.elapsed());
        }
        p50s[usize::from(secured)].push(quantiles(&trips).0);
        let load = throughput(&sb, &watcher, "noop", sizes.noop_tasks, 8, None).await;
        rates[usize::from(secured)].push(load.per_s);
        drop(watcher);
        sb.shutdown().await;
    }
    let mean_d = |v: &[Duration]| v.iter().sum::<Duration>() / v.len() as u32;
    let mean_r = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let (plain50, secure50) = (mean_d(&p50s[0]), mean_d(&p50s[1]));
    let (plain_rate, secure_rate) = (mean_r(&rates[0]), mean_r(&rates[1]));
    let n = sizes.round_trips;
    table.value(
        &format!("no-op round trip, plaintext (n={n} × 2)"),
        format!("p50 {}", ms(plain50)),
        "baseline".into(),
        None,
    );
    let r50 = ratio(secure50, plain50);
    table.value(
        &format!("no-op round trip, auth + TLS (n={n} × 2)"),
        format!("p50 {}", ms(secure50)),
        format!("≤ 1.25× plaintext: {r50:.2}×"),
        Some(r50 <= 1.25),
    );
    let m = sizes.noop_tasks;
    table.rate(&format!("no-op throughput 1×8, plaintext (n={m} × 2)"), plain_rate, "baseline", None);
    let rr = secure_rate / plain_rate;
    table.rate(
        &format!("no-op throughput 1×8, auth + TLS (n={m} × 2)"),
        secure_rate,
        &format!("≥ 0.85× plaintext: {rr:.2}×"),
        Some(rr >= 0.85),
    );
    table.note(&format!(
        "auth + TLS rounds: p50 plaintext {:?}, secured {:?}; tasks/s plaintext {:?}, secured {:?}",
        p50s[0].iter().map(|d| ms(*d)).collect::<Vec<_>>(),
        p50s[1].iter().map(|d| ms(*d)).collect::<Vec<_>>(),
        rates[0].iter().map(|r| r.round()).collect::<Vec<_>>(),
        rates[1].iter().map(|r| r.round()).collect::<Vec<_>>()
    ));
}

/// Publish → pull → double ack of one dispatch-sized message at a time, on a work-queue
/// stream like `MUR_DISPATCH`, the puller waiting on a batch-1 pull stream.
async fn raw_round_trips(sb: &Sandbox, n: usize) -> Vec<Duration> {
    let js = jetstream::new(sb.client.clone());
    let stream = js
        .create_stream(stream::Config {
            name: "BENCH_RAW".into(),
            subjects: vec!["bench.raw".into()],
            retention: stream::RetentionPolicy::WorkQueue,
            storage: stream::StorageType::File,
            ..Default::default()
        })
        .await
        .expect("raw stream");
    let consumer: consumer::PullConsumer = stream
        .create_consumer(consumer::pull::Config {
            durable_name: Some("raw".into()),
            ack_policy: consumer::AckPolicy::Explicit,
            ..Default::default()
        })
        .await
        .expect("raw consumer");
    // The puller on a client of its own, as a worker has.
    let puller_client = sb.nats.connect().await;
    let consumer: consumer::PullConsumer =
        jetstream::new(puller_client).get_consumer_from_stream("raw", "BENCH_RAW").await.unwrap_or(consumer);
    let (acked_tx, mut acked) = tokio::sync::mpsc::unbounded_channel::<Instant>();
    let puller = tokio::spawn(async move {
        let mut messages =
            consumer.stream().max_messages_per_batch(1).expires(Duration::from_secs(5)).messages().await.unwrap();
        while let Some(msg) = messages.next().await {
            let msg = msg.expect("raw message");
            msg.double_ack().await.expect("raw ack");
            if acked_tx.send(Instant::now()).is_err() {
                break;
            }
        }
    });
    let payload = serde_json::to_vec(&noop_dispatch()).unwrap();
    let mut times = Vec::with_capacity(n);
    for i in 0..n + 20 {
        let t0 = Instant::now();
        js.publish("bench.raw", payload.clone().into()).await.expect("publish").await.expect("publish ack");
        let done = acked.recv().await.expect("the puller runs");
        if i >= 20 {
            times.push(done - t0);
        }
    }
    puller.abort();
    times
}

/// A dispatch as the coordinator publishes one for a no-op task: it carries the released
/// record (`Dispatch::released`), so the raw baseline moves a message of the same size.
fn noop_dispatch() -> Dispatch {
    let task_id = Id::generate(IdKind::Task);
    let request = SubmitRequest::new("noop", "hi", Origin::User);
    let mut record =
        cluster::TaskRecord::submitted(TaskId::unchecked(task_id.clone()), request, "0f".repeat(32), 1_700_000_000_000);
    record.attempt = 1;
    record.traceparent = Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into());
    Dispatch {
        task_id: TaskId::unchecked(task_id),
        attempt: 1,
        released: Some(cluster::Released { revision: 12345, record }),
    }
}

/// A throughput run: tasks ended per second, and where a task's time went under that load.
struct Load {
    per_s: f64,
    /// p50 and p99 of: submit reply → release seen, release → working, working → terminal.
    steps: [(Duration, Duration); 3],
    /// From the first submit until as many tasks as there are slots are `working`.
    fill: Duration,
    /// p50 and p99 of a slot's hand-over: the k-th end → the (k + slots)-th release (the
    /// release that end made possible).
    handover: (Duration, Duration),
    /// Each round's spread (the ends taken `slots` at a time: first end → last end), for the
    /// first and the last round: how far the slots drift apart as the run goes on.
    spread: (Duration, Duration),
    /// CPU time per task over the run, in ms: this process (client, coordinator, in-process
    /// workers, fake model) and the nats-server; `None` where `/proc` does not tell.
    cpu: Option<(f64, f64)>,
    /// With the fake OpenAI server: p50, p99 and mean of `working` seen → the request
    /// received, the request → its answer, the answer → the terminal record seen.
    model: Option<[(Duration, Duration, Duration); 3]>,
    /// Tasks per second ended between the `slots`-th end and the `(n − slots)`-th: the rate
    /// once the slots are filled, before the last round drains; `None` under three rounds.
    steady: Option<f64>,
}

impl Load {
    fn describe(&self) -> String {
        let both = |(p50, p99): (Duration, Duration)| format!("{}/{}", ms(p50), ms(p99));
        let [waiting, dispatch, running] = self.steps.map(both);
        format!(
            "p50/p99 per task: reply → released {waiting}, released → working {dispatch}, working → ended {running}; \
             every slot working after {}; a slot's hand-over (an end → the release it allows) {}; \
             a round's ends spread over {} in the first round, {} in the last{}",
            ms(self.fill),
            both(self.handover),
            ms(self.spread.0),
            ms(self.spread.1),
            self.cpu.map_or(String::new(), |(here, server)| format!(
                "; CPU per task {here:.2} ms in this process (coordinator, workers, model, client), \
                 {server:.2} ms in nats-server"
            ))
        ) + &self.model.map_or(String::new(), |[start, model, end]| {
            let three =
                |(p50, p99, mean): (Duration, Duration, Duration)| format!("{}/{}/{}", ms(p50), ms(p99), ms(mean));
            format!(
                "; p50/p99/mean: working → the model's request {}, the request → its answer {}, \
                 the answer → ended {}",
                three(start),
                three(model),
                three(end)
            )
        })
    }
}

/// Submits `n` tasks of `capsule` from 32 concurrent callers, the prompt of the i-th naming
/// it ([`prompt_of`]); the task returns each answer: i, the task id, when the reply came.
fn submit_concurrently(
    client: &async_nats::Client,
    capsule: &str,
    n: usize,
) -> tokio::task::JoinHandle<Vec<(usize, String, Instant)>> {
    let (client, capsule) = (client.clone(), capsule.to_string());
    tokio::spawn(async move {
        futures::stream::iter(0..n)
            .map(|i| {
                let (client, capsule) = (client.clone(), capsule.clone());
                async move { (i, submit_prompt(&client, &capsule, &prompt_of(i)).await, Instant::now()) }
            })
            .buffer_unordered(32)
            .collect()
            .await
    })
}

/// The CPU time used so far by this process and by the nats-server (`None` where `/proc`
/// does not tell).
struct CpuMark(Option<Duration>, Option<Duration>);

impl CpuMark {
    fn now(nats_pid: Option<u32>) -> CpuMark {
        CpuMark(cpu_time(std::process::id()), nats_pid.and_then(cpu_time))
    }

    /// Milliseconds of CPU per task since `before`, over `n` tasks: (this process, nats-server).
    fn per_task_since(&self, before: &CpuMark, n: usize) -> Option<(f64, f64)> {
        let per_task =
            |a: Option<Duration>, b: Option<Duration>| Some(b?.saturating_sub(a?).as_secs_f64() * 1000.0 / n as f64);
        per_task(before.0, self.0).zip(per_task(before.1, self.1))
    }
}

/// Submits `n` tasks from 32 concurrent callers; the rate counts from the first submit to
/// the last end.
async fn throughput(
    sb: &Sandbox,
    watcher: &Watcher,
    capsule: &str,
    n: usize,
    slots: usize,
    fake: Option<&FakeOpenAi>,
) -> Load {
    let before = watcher.ended_count();
    let cpu_before = CpuMark::now(sb.nats.pid());
    let t0 = Instant::now();
    let submitter = submit_concurrently(&sb.client, capsule, n);
    watcher.wait_count(before + n).await;
    let elapsed = t0.elapsed();
    let cpu = CpuMark::now(sb.nats.pid()).per_task_since(&cpu_before, n);
    let replies = submitter.await.expect("submitter");
    let mut steps: [Vec<Duration>; 3] = Default::default();
    let (mut releases, mut workings, mut ends) = (Vec::new(), Vec::new(), Vec::new());
    {
        let seen = watcher.seen.lock().unwrap();
        for (_, id, replied) in &replies {
            let Some(Steps { released: Some(r), working: Some(w), ended: Some(e), .. }) = seen.steps.get(id) else {
                continue;
            };
            steps[0].push(r.saturating_duration_since(*replied));
            steps[1].push(w.saturating_duration_since(*r));
            steps[2].push(e.saturating_duration_since(*w));
            releases.push(*r);
            workings.push(*w);
            ends.push(*e);
        }
    }
    let model = fake.map(|fake| {
        let seen = watcher.seen.lock().unwrap();
        let ids: HashMap<usize, &str> = replies.iter().map(|(i, id, _)| (*i, id.as_str())).collect();
        let mut parts: [Vec<Duration>; 3] = Default::default();
        for timed in fake.take_timings() {
            let Some(i) = index_in(&timed.body) else { continue };
            let Some(Steps { working: Some(w), ended: Some(e), .. }) = ids.get(&i).and_then(|id| seen.steps.get(*id))
            else {
                continue;
            };
            parts[0].push(timed.received.saturating_duration_since(*w));
            parts[1].push(timed.answered.saturating_duration_since(timed.received));
            parts[2].push(e.saturating_duration_since(timed.answered));
        }
        parts.map(|xs| p50_p99_mean(&xs))
    });
    releases.sort();
    workings.sort();
    ends.sort();
    let fill = workings.get(slots.saturating_sub(1)).map_or(Duration::ZERO, |w| w.saturating_duration_since(t0));
    let handovers: Vec<Duration> =
        ends.iter().zip(releases.iter().skip(slots)).map(|(e, r)| r.saturating_duration_since(*e)).collect();
    let rounds: Vec<Duration> =
        ends.chunks(slots.max(1)).map(|round| round[round.len() - 1].saturating_duration_since(round[0])).collect();
    let spread = (rounds.first().copied().unwrap_or_default(), rounds.last().copied().unwrap_or_default());
    let p50_p99 = |xs: &[Duration]| {
        let (p50, p99, _) = p50_p99_mean(xs);
        (p50, p99)
    };
    Load {
        per_s: n as f64 / elapsed.as_secs_f64(),
        steps: [p50_p99(&steps[0]), p50_p99(&steps[1]), p50_p99(&steps[2])],
        fill,
        handover: p50_p99(&handovers),
        cpu,
        spread,
        model,
        steady: (ends.len() >= 3 * slots && slots > 0).then(|| {
            let (first, last) = (ends[slots - 1], ends[ends.len() - slots - 1]);
            (ends.len() - 2 * slots) as f64 / last.saturating_duration_since(first).as_secs_f64()
        }),
    }
}

// ---------------------------------------------------------------------------------------
// Phase 2: 4 workers × 16 slots against a model that answers after 200 ms.

async fn slow_model_throughput(sizes: &Sizes, table: &mut Table) {
    let (workers, slots) = (4usize, 16u32);
    let total_slots = workers * slots as usize;
    let ideal = total_slots as f64 / MODEL_DELAY.as_secs_f64();
    let n = total_slots * sizes.slow_rounds;
    // The ceiling first: the same cycle with nothing of murmur in it (`raw_cycle`).
    let raw = {
        let minimal = std::env::var("MUR_BENCH_RAW").is_ok_and(|v| v == "minimal");
        let protocol = if minimal { raw_cycle::Protocol::Minimal } else { raw_cycle::Protocol::Cluster };
        let cluster = raw_cycle::RawCluster::start(workers, total_slots / workers, protocol).await;
        let watcher = Watcher::start(cluster.client(), false).await;
        cluster.run(&watcher, total_slots).await;
        let one = cluster.run(&watcher, total_slots).await;
        table.value(
            &format!("  raw, one round: {total_slots} tasks at once"),
            format!("{:.0} tasks/s", one.per_s),
            format!("{:.1} % of ideal", one.per_s / ideal * 100.0),
            None,
        );
        let mut loads = Vec::new();
        for _ in 0..sizes.slow_runs {
            loads.push(cluster.run(&watcher, n).await);
        }
        let (load, spread) = median_run(loads, |l| l.per_s, ideal);
        table.value(
            &format!(
                "raw slow cycle: {}, no murmur, 4 × 16 slots (n={n}{spread})",
                if minimal { "records and dispatch only" } else { "the same broker traffic" }
            ),
            format!("{:.0} tasks/s", load.per_s),
            format!("ceiling: {:.1} % of ideal", load.per_s / ideal * 100.0),
            None,
        );
        if let Some((here, server)) = load.cpu {
            table.note(&format!(
                "raw slow cycle: CPU per task {here:.2} ms in this process, {server:.2} ms in nats-server"
            ));
        }
        load.per_s
    };
    let fake = FakeOpenAi::repeating(FakeReply::text("done"));
    fake.set_delay(MODEL_DELAY);
    let sb = Sandbox::start(workers, slots).await;
    let openai = openai_capsule("slow", &fake.url());
    let scripted = TestCapsule::new(
        "name: slow-scripted\nversion: 1.0.0\ninference:\n  driver: scripted\n  script: r.yaml\n",
        &[("r.yaml", &format!("replies:\n  - text: done\n    delay_ms: {}\n", MODEL_DELAY.as_millis()))],
    );
    sb.push(openai.dir()).await;
    sb.push(scripted.dir()).await;
    let watcher = Watcher::start(&sb.client, false).await;
    fake.keep_timings();
    for (capsule, label) in [("slow", "fake OpenAI over HTTP"), ("slow-scripted", "scripted driver's delay")] {
        let timed = (capsule == "slow").then_some(&fake);
        // Warm up every worker's bundle cache with one round.
        throughput(&sb, &watcher, capsule, total_slots, total_slots, timed).await;
        // One round at once, as the reference's Celery figure ("97 % of ideal with 64 slow
        // tasks"): the fill (64 submits while the first sessions start) weighs a fifth here.
        let one = throughput(&sb, &watcher, capsule, total_slots, total_slots, timed).await;
        table.value(
            &format!("  one round: {total_slots} tasks at once ({label})"),
            format!("{:.0} tasks/s", one.per_s),
            format!("{:.1} % of ideal", one.per_s / ideal * 100.0),
            None,
        );
        // Repeated, the median judged: one run of this phase moves by ±0.7 % on a 2-core box.
        let mut loads = Vec::new();
        for _ in 0..sizes.slow_runs {
            loads.push(throughput(&sb, &watcher, capsule, n, total_slots, timed).await);
        }
        let (load, spread) = median_run(loads, |l| l.per_s, ideal);
        let share = load.per_s / ideal;
        table.rate(
            &format!("slow model (200 ms, {label}), 4 workers × 16 slots (n={n}{spread})"),
            load.per_s,
            &format!("≥ 97 % of ideal {ideal:.0}/s: {:.1} % ({:.1} % of raw)", share * 100.0, load.per_s / raw * 100.0),
            Some(share >= 0.97),
        );
        table.note(&format!("slow model, {label}: {}", load.describe()));
        if let Some(steady) = load.steady {
            table.note(&format!(
                "slow model, {label}: between the first round's last end and the last round's first, \
                 {steady:.0} tasks/s ({:.1} % of ideal): the rate once every slot is busy, without the \
                 fill and the last round's spread",
                steady / ideal * 100.0
            ));
        }
    }
    drop(watcher);
    sb.shutdown().await;

    // The models' clocks: 64 sleeps of 200 ms at once, on this runtime. The scripted
    // driver's delay and the fake OpenAI server both sleep on `mur_worker::timer`, exact to
    // the kernel's timer slack; tokio's timer wheel, beside it, ticks in whole milliseconds
    // and rounds a deadline up, so a "200 ms" answer on it would come 1–2 ms late, which
    // the ideal above does not allow.
    let late = |exact: bool| async move {
        let sleeps: Vec<Duration> = futures::future::join_all((0..total_slots).map(|_| async move {
            let t = Instant::now();
            if exact {
                mur_tests::timer::sleep(MODEL_DELAY).await;
            } else {
                tokio::time::sleep(MODEL_DELAY).await;
            }
            t.elapsed().saturating_sub(MODEL_DELAY)
        }))
        .await;
        quantiles(&sleeps)
    };
    let (tokio_p50, tokio_p99) = late(false).await;
    let (exact_p50, exact_p99) = late(true).await;
    table.note(&format!(
        "the models' timers: {total_slots} sleeps of {} ms at once end late by p50 {} p99 {} on tokio's, \
         p50 {} p99 {} on the exact one (the scripted driver's delay and the fake OpenAI server's)",
        MODEL_DELAY.as_millis(),
        ms(tokio_p50),
        ms(tokio_p99),
        ms(exact_p50),
        ms(exact_p99)
    ));

    // What the openai driver pays per session today: it builds its HTTP client.
    let mut builds = Vec::new();
    for _ in 0..if sizes.slow_rounds > 1 { 20 } else { 3 } {
        let t = Instant::now();
        std::hint::black_box(reqwest::Client::new());
        builds.push(t.elapsed());
    }
    table.note(&format!(
        "reqwest::Client::new() (what a per-session client would cost; drivers share one): p50 {}",
        ms(percentile(&builds, 0.5))
    ));
}

/// The median of repeated runs by their rate, and the text giving how many runs and their
/// range as shares of `ideal` (`; median of 3 runs, 93.1–95.2 %`; empty for one run).
fn median_run<T>(mut runs: Vec<T>, per_s: impl Fn(&T) -> f64, ideal: f64) -> (T, String) {
    runs.sort_by(|a, b| per_s(a).total_cmp(&per_s(b)));
    let n = runs.len();
    let range = if n > 1 {
        format!(
            "; median of {n} runs, {:.1}–{:.1} %",
            per_s(&runs[0]) / ideal * 100.0,
            per_s(&runs[n - 1]) / ideal * 100.0
        )
    } else {
        String::new()
    };
    (runs.swap_remove(n / 2), range)
}

// ---------------------------------------------------------------------------------------
// Phase 3: a `mur worker` process's resident memory.

async fn worker_memory(table: &mut Table) {
    let Some(mur) = mur_binary() else {
        table.note("worker memory: skipped, no `mur` binary (cargo build --release --bin mur, or set MUR_BIN)");
        return;
    };
    let slots = 16;
    let fake = FakeOpenAi::repeating(FakeReply::text("done"));
    let sb = Sandbox::start(0, 1).await;
    let capsule = openai_capsule("resident", &fake.url());
    sb.push(capsule.dir()).await;
    let workdir = tempfile::tempdir().expect("worker dir");
    let mut child = std::process::Command::new(mur)
        .args(["worker", "--slots", &slots.to_string(), "--id", "wkr-rss", "--server", &sb.nats.url()])
        .arg("--workdir")
        .arg(workdir.path())
        .env_remove("NATS_URL")
        .env("MUR_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn mur worker");
    let pid = child.id();
    sb.wait_ready(1).await;
    let watcher = Watcher::start(&sb.client, false).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let idle = vm_rss(pid);

    // 16 sessions at once, each waiting on a model that answers after 3 s.
    fake.set_delay(Duration::from_secs(3));
    let before = watcher.ended_count();
    let mut ids = Vec::new();
    for _ in 0..slots {
        ids.push(submit(&sb.client, "resident").await);
    }
    let deadline = Instant::now() + PHASE_DEADLINE;
    while fake.served() < slots {
        assert!(Instant::now() < deadline, "16 sessions did not reach the model");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut busy = 0;
    for _ in 0..10 {
        busy = busy.max(vm_rss(pid).unwrap_or(0));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    watcher.wait_count(before + slots).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = vm_rss(pid);
    let _ = child.kill();
    let _ = child.wait();
    drop(watcher);
    sb.shutdown().await;

    let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
    match idle {
        Some(idle) => table.value(
            "worker RSS, idle (`mur worker`, 16 slots)",
            format!("{:.1} MiB", mib(idle)),
            "< 30 MB".into(),
            Some(idle < 30_000_000),
        ),
        None => table.note("worker RSS: /proc/<pid>/status unreadable"),
    }
    table.value(
        "worker RSS, 16 sessions running",
        format!("{:.1} MiB", mib(busy)),
        "< 100 MB".into(),
        Some(busy > 0 && busy < 100_000_000),
    );
    if let Some(after) = after {
        table.value("  worker RSS, idle again after them", format!("{:.1} MiB", mib(after)), String::new(), None);
    }
}

// ---------------------------------------------------------------------------------------
// Phase 4: a `mur coordinator` process restarting over a store of ended tasks.

/// The result text of each ended task in the restore figure: a long answer, as agents give.
const ENDED_RESULT_BYTES: usize = 100_000;

async fn coordinator_restore(sizes: &Sizes, table: &mut Table) {
    let Some(mur) = mur_binary() else {
        table.note("coordinator restore: skipped, no `mur` binary (cargo build --release --bin mur, or set MUR_BIN)");
        return;
    };
    let n = sizes.ended_records;
    let empty = restore_once(&mur, 0).await;
    let full = restore_once(&mur, n).await;
    let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
    let stored = (n * ENDED_RESULT_BYTES) as f64 / 1e6;
    let times =
        |a: Duration, b: Duration| format!("{:.1}× the empty store's {}", a.as_secs_f64() / b.as_secs_f64(), ms(b));
    let sizes = |a: u64, b: u64| format!("{:.2}× the empty store's {:.1} MiB", a as f64 / b as f64, mib(b));
    table.value(
        &format!("coordinator restart over {n} ended tasks ({stored:.0} MB of results): time to restored"),
        ms(full.elapsed),
        times(full.elapsed, empty.elapsed),
        None,
    );
    table.value(
        "  coordinator peak RSS (VmHWM) by then",
        format!("{:.1} MiB", mib(full.restore_peak)),
        sizes(full.restore_peak, empty.restore_peak),
        None,
    );
    table.value(
        "  capsule.list asked as the restore starts",
        format!("{} ({} it ended)", ms(full.asked.0), if full.asked.1 { "before" } else { "after" }),
        times(full.asked.0, empty.asked.0),
        None,
    );
    table.value("  then task.list (limit 20)", ms(full.list), times(full.list, empty.list), None);
    table.value("  then cluster.status", ms(full.status), times(full.status, empty.status), None);
    table.value(
        "  coordinator peak RSS (VmHWM) after both",
        format!("{:.1} MiB", mib(full.peak)),
        sizes(full.peak, empty.peak),
        None,
    );
}

/// Starts a nats-server, stores `records` ended task records, starts `mur coordinator` on
/// it and returns how long the coordinator took to log `coordinator restored`, its peak
/// resident memory by then, and how long `task.list` and `cluster.status` then take.
async fn restore_once(mur: &std::path::Path, records: usize) -> Restore {
    let nats = mur_tests::nats::NatsServer::start();
    let js = nats.jetstream().await;
    let res = mur_coordinator::ensure(&js, &mur_coordinator::Settings::default()).await.expect("resources");
    mur_tests::procs::store_ended_tasks(&res.tasks, records, ENDED_RESULT_BYTES).await;
    let t0 = Instant::now();
    let mut child = std::process::Command::new(mur)
        .args(["coordinator", "--server", &nats.url()])
        .env_remove("NATS_URL")
        .env("MUR_LOG", "info")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn mur coordinator");
    let pid = child.id();
    let stderr = child.stderr.take().expect("stderr");
    // The log's "leading" (the restore starts) and "coordinator restored" lines, as they come.
    let (lines_tx, mut lines) = tokio::sync::mpsc::unbounded_channel::<bool>();
    tokio::task::spawn_blocking(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stderr).lines().map_while(Result::ok) {
            let restored = line.contains("coordinator restored");
            if !restored && !line.contains(" leading (term ") {
                continue;
            }
            if lines_tx.send(restored).is_err() || restored {
                return;
            }
        }
    });
    let client = nats.connect().await;
    // A question asked as the restore starts: answered meanwhile, or only after it.
    let mut asked: Option<(Instant, tokio::task::JoinHandle<Instant>)> = None;
    let restored = tokio::time::timeout(PHASE_DEADLINE, async {
        while let Some(restored) = lines.recv().await {
            if restored {
                return Some(Instant::now());
            }
            let client = client.clone();
            asked = Some((
                Instant::now(),
                tokio::spawn(async move {
                    let _: Vec<cluster::CapsuleEntry> =
                        mur_nats::api::call(&client, api::CAPSULE_LIST, "").await.expect("capsule.list");
                    Instant::now()
                }),
            ));
        }
        None
    })
    .await;
    let elapsed = t0.elapsed();
    let restore_peak = vm_field(pid, "VmHWM:").unwrap_or(0);
    let Ok(Some(restored_at)) = restored else { panic!("the coordinator did not restore over {records} ended tasks") };
    let (asked_at, answer) = asked.expect("the coordinator logged no `leading` before `coordinator restored`");
    let answered_at = answer.await.expect("capsule.list");
    let asked = (answered_at - asked_at, answered_at < restored_at);
    // The two questions that read every record: `mur task ls` and `mur cluster status`.
    let t = Instant::now();
    let page: mur_proto::page::Page<cluster::TaskRecord> =
        mur_nats::api::call(&client, api::TASK_LIST, r#"{"limit":20}"#).await.expect("task.list");
    let list = t.elapsed();
    assert_eq!(page.items.len(), records.min(20));
    let t = Instant::now();
    let _: cluster::ClusterStatus = mur_nats::api::call(&client, api::CLUSTER_STATUS, "").await.expect("status");
    let status = t.elapsed();
    let peak = vm_field(pid, "VmHWM:").unwrap_or(0);
    let _ = child.kill();
    let _ = child.wait();
    Restore { elapsed, restore_peak, asked, list, status, peak }
}

/// What [`restore_once`] measured.
struct Restore {
    /// Start → `coordinator restored`.
    elapsed: Duration,
    /// Peak RSS by then.
    restore_peak: u64,
    /// A `capsule.list` sent when the coordinator logged `leading` (its restore starts):
    /// how long its answer took, and whether it came before the restore ended.
    asked: (Duration, bool),
    /// `task.list` with `limit` 20, then `cluster.status`.
    list: Duration,
    status: Duration,
    /// Peak RSS after both.
    peak: u64,
}

fn mur_binary() -> Option<std::path::PathBuf> {
    if let Some(p) = std::env::var_os("MUR_BIN") {
        return Some(p.into());
    }
    let exe = std::env::current_exe().ok()?;
    let p = exe.parent()?.parent()?.join("mur");
    p.is_file().then_some(p)
}

/// User plus system CPU time process `pid` has used (`/proc/<pid>/stat`, in the kernel's
/// fixed 100 ticks per second).
fn cpu_time(pid: u32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces; the fields after its `)` are plain.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let (utime, stime): (u64, u64) = (fields.get(11)?.parse().ok()?, fields.get(12)?.parse().ok()?);
    Some(Duration::from_millis((utime + stime) * 10))
}

/// `VmRSS` of process `pid`, in bytes.
fn vm_rss(pid: u32) -> Option<u64> {
    vm_field(pid, "VmRSS:")
}

/// A `kB` field of `/proc/<pid>/status` (`VmRSS:`, `VmHWM:`), in bytes.
fn vm_field(pid: u32, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

// ---------------------------------------------------------------------------------------
// Capsules, the client side.

/// A scripted capsule whose one reply ends the task.
fn noop_capsule() -> TestCapsule {
    TestCapsule::new(
        "name: noop\nversion: 1.0.0\ninference:\n  driver: scripted\n  script: r.yaml\n",
        &[("r.yaml", "replies:\n  - text: ok\n")],
    )
}

/// A capsule on the openai driver pointed at the fake server `url`.
fn openai_capsule(name: &str, url: &str) -> TestCapsule {
    TestCapsule::new(
        &format!(
            "name: {name}\nversion: 1.0.0\ninference:\n  driver: openai\n  endpoint: {url}\n  model: gpt-4o-mini\n"
        ),
        &[],
    )
}

async fn submit(client: &async_nats::Client, capsule: &str) -> String {
    submit_prompt(client, capsule, "hi").await
}

/// Submits a `user` task of `capsule` with `prompt`; its id.
async fn submit_prompt(client: &async_nats::Client, capsule: &str, prompt: &str) -> String {
    let request = SubmitRequest::new(capsule, prompt, Origin::User);
    let reply: SubmitReply =
        mur_nats::api::call(client, api::TASK_SUBMIT, serde_json::to_vec(&request).unwrap()).await.expect("submit");
    reply.task_id.into_string()
}

#[derive(Deserialize)]
struct StateOnly {
    state: TaskState,
    #[serde(default)]
    attempt: u32,
}

fn state_of(value: &[u8]) -> Option<TaskState> {
    serde_json::from_slice::<StateOnly>(value).ok().map(|s| s.state)
}

#[derive(Deserialize)]
struct TaskStartLine {
    event_type: String,
    #[serde(default)]
    task_id: Option<String>,
}

/// When the client saw each step of a task: the points of the path submit → result.
#[derive(Clone, Copy, Debug, Default)]
struct Steps {
    /// The record at attempt 1, still `submitted`: created so when the task was admitted at
    /// submit (a free slot), else the coordinator's release compare-and-set.
    released: Option<Instant>,
    /// The dispatch on `mur.dispatch` (a core subscription sees the publish).
    dispatched: Option<Instant>,
    /// The record `working`: the worker's first compare-and-set.
    working: Option<Instant>,
    /// The `task_start` trace line on `mur.trace.<session>`.
    started: Option<Instant>,
    /// The terminal record.
    ended: Option<Instant>,
}

/// What a [`Watcher`] saw.
#[derive(Default)]
struct Seen {
    ended: usize,
    steps: HashMap<String, Steps>,
}

/// Follows `mur_tasks` (one watch, opened once) and, in detail mode, the dispatches and
/// the `task_start` trace lines, noting when each step of each task arrived.
struct Watcher {
    seen: Arc<Mutex<Seen>>,
    changed: Arc<Notify>,
    loops: Vec<tokio::task::JoinHandle<()>>,
}

impl Watcher {
    async fn start(client: &async_nats::Client, detail: bool) -> Watcher {
        let seen = Arc::new(Mutex::new(Seen::default()));
        let changed = Arc::new(Notify::new());
        let js = jetstream::new(client.clone());
        let tasks = js.get_key_value(cluster::TASKS_BUCKET).await.expect("mur_tasks");
        let mut watch = tasks.watch_all().await.expect("watch mur_tasks");
        let mut loops = vec![tokio::spawn({
            let (seen, changed) = (seen.clone(), changed.clone());
            async move {
                while let Some(Ok(entry)) = watch.next().await {
                    let at = Instant::now();
                    let Ok(record) = serde_json::from_slice::<StateOnly>(&entry.value) else { continue };
                    let mut seen = seen.lock().unwrap();
                    if record.state.is_terminal() {
                        seen.ended += 1;
                    }
                    let steps = seen.steps.entry(entry.key.clone()).or_default();
                    match record.state {
                        TaskState::Submitted if record.attempt >= 1 => steps.released = Some(at),
                        TaskState::Working => steps.working = Some(at),
                        state if state.is_terminal() => steps.ended = Some(at),
                        _ => {}
                    }
                    drop(seen);
                    changed.notify_waiters();
                }
            }
        })];
        if detail {
            let mut lines = client.subscribe(format!("{}>", cluster::TRACE_SUBJECT_PREFIX)).await.expect("subscribe");
            let mut dispatches = client.subscribe(cluster::DISPATCH_SUBJECT).await.expect("subscribe");
            client.flush().await.expect("flush");
            loops.push(tokio::spawn({
                let (seen, changed) = (seen.clone(), changed.clone());
                async move {
                    while let Some(msg) = lines.next().await {
                        let at = Instant::now();
                        if !msg.payload.windows(12).any(|w| w == b"\"task_start\"") {
                            continue;
                        }
                        if let Ok(TaskStartLine { event_type, task_id: Some(id) }) =
                            serde_json::from_slice(&msg.payload)
                            && event_type == "task_start"
                        {
                            seen.lock().unwrap().steps.entry(id).or_default().started = Some(at);
                            changed.notify_waiters();
                        }
                    }
                }
            }));
            loops.push(tokio::spawn({
                let seen = seen.clone();
                async move {
                    while let Some(msg) = dispatches.next().await {
                        let at = Instant::now();
                        if let Ok(dispatch) = serde_json::from_slice::<Dispatch>(&msg.payload) {
                            seen.lock().unwrap().steps.entry(dispatch.task_id.into_string()).or_default().dispatched =
                                Some(at);
                        }
                    }
                }
            }));
        }
        Watcher { seen, changed, loops }
    }

    /// Stops following the dispatches and the trace (so that throughput runs do not pay
    /// for it), and forgets the steps seen so far.
    fn stop_detail(&self) {
        for l in self.loops.iter().skip(1) {
            l.abort();
        }
        self.seen.lock().unwrap().steps.clear();
    }

    fn ended_count(&self) -> usize {
        self.seen.lock().unwrap().ended
    }

    async fn until<T>(&self, what: &str, mut check: impl FnMut(&Seen) -> Option<T>) -> T {
        let deadline = tokio::time::Instant::now() + PHASE_DEADLINE;
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(found) = check(&self.seen.lock().unwrap()) {
                return found;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                panic!("{what}: not within {PHASE_DEADLINE:?}");
            }
        }
    }

    /// Waits until `id` has ended and, in detail mode, its `task_start` line arrived;
    /// returns its steps.
    async fn wait_ended(&self, id: &str, detail: bool) -> Steps {
        self.until(&format!("task {id} ended"), |s| {
            s.steps.get(id).copied().filter(|st| st.ended.is_some() && (!detail || st.started.is_some()))
        })
        .await
    }

    async fn wait_count(&self, n: usize) {
        self.until(&format!("{n} tasks ended"), |s| (s.ended >= n).then_some(())).await;
    }
}

impl Drop for Watcher {
    fn drop(&mut self) {
        for l in &self.loops {
            l.abort();
        }
    }
}

// ---------------------------------------------------------------------------------------
// Figures and the table.

fn percentile(xs: &[Duration], p: f64) -> Duration {
    let mut xs = xs.to_vec();
    xs.sort();
    xs[((xs.len() - 1) as f64 * p).round() as usize]
}

/// p50, p99 and the mean; zeros for none.
fn p50_p99_mean(xs: &[Duration]) -> (Duration, Duration, Duration) {
    if xs.is_empty() {
        return Default::default();
    }
    let (p50, p99) = quantiles(xs);
    (p50, p99, xs.iter().sum::<Duration>() / xs.len() as u32)
}

/// The prompt of a throughput run's `i`-th task: it names the task, so the fake model's
/// timings can be matched to it ([`index_in`]).
fn prompt_of(i: usize) -> String {
    format!("bench task <{i}>")
}

/// The task index a model request's body names ([`prompt_of`]).
fn index_in(body: &[u8]) -> Option<usize> {
    let text = std::str::from_utf8(body).ok()?;
    let start = text.find("bench task <")? + "bench task <".len();
    let len = text[start..].find('>')?;
    text[start..start + len].parse().ok()
}

fn quantiles(xs: &[Duration]) -> (Duration, Duration) {
    (percentile(xs, 0.5), percentile(xs, 0.99))
}

fn ratio(a: Duration, b: Duration) -> f64 {
    a.as_secs_f64() / b.as_secs_f64().max(1e-9)
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1e3)
}

/// When each step of the sequential no-op tasks was seen, after the submit.
#[derive(Default)]
struct Timeline {
    points: [Vec<Duration>; 6],
}

impl Timeline {
    const LABELS: [&str; 6] = [
        "submit reply",
        "record released (attempt 1, seen on the watch; stored so at submit with a free slot)",
        "dispatch published (seen on mur.dispatch)",
        "record working (worker's compare-and-set, seen on the watch)",
        "task_start trace line",
        "terminal record (seen on the watch)",
    ];

    fn add(&mut self, t0: Instant, replied: Duration, steps: &Steps) {
        let at = |i: Option<Instant>| i.map_or(Duration::ZERO, |i| i.saturating_duration_since(t0));
        let points =
            [replied, at(steps.released), at(steps.dispatched), at(steps.working), at(steps.started), at(steps.ended)];
        for (list, point) in self.points.iter_mut().zip(points) {
            list.push(point);
        }
    }

    fn print(&self) {
        println!("\nwhere a no-op task's time goes (sequential tasks; p50 of each point, from the submit):");
        let mut last = Duration::ZERO;
        for (label, points) in Self::LABELS.iter().zip(&self.points) {
            let p50 = percentile(points, 0.5);
            let step = p50.as_secs_f64() - last.as_secs_f64();
            println!("  +{:>8}  (step {:>+7.3} ms)  {label}", ms(p50), step * 1e3);
            last = p50;
        }
    }
}

#[derive(Default)]
struct Table {
    rows: Vec<(String, String, String, Option<bool>)>,
    notes: Vec<String>,
    timeline: Option<Timeline>,
}

impl Table {
    fn row(&mut self, label: &str, (p50, p99): (Duration, Duration), target: String, pass: Option<bool>) {
        self.value(label, format!("p50 {}  p99 {}", ms(p50), ms(p99)), target, pass);
    }

    fn rate(&mut self, label: &str, per_s: f64, target: &str, pass: Option<bool>) {
        self.value(label, format!("{per_s:.0} tasks/s"), target.into(), pass);
    }

    fn value(&mut self, label: &str, measured: String, target: String, pass: Option<bool>) {
        eprintln!("{label}: {measured}");
        self.rows.push((label.into(), measured, target, pass));
    }

    fn note(&mut self, text: &str) {
        self.notes.push(text.into());
    }

    fn print(&self, quick: bool) {
        let cores = std::thread::available_parallelism().map_or(0, usize::from);
        println!(
            "\nmurmur cluster benchmark (issue #9): {} build, {cores} cores{}",
            if cfg!(debug_assertions) { "debug" } else { "release" },
            if quick { " — smoke run, figures not meaningful" } else { "" }
        );
        let w0 = self.rows.iter().map(|r| r.0.chars().count()).max().unwrap_or(0);
        let w1 = self.rows.iter().map(|r| r.1.chars().count()).max().unwrap_or(0);
        let w2 = self.rows.iter().map(|r| r.2.chars().count()).max().unwrap_or(0);
        println!("{:w0$}  {:w1$}  {:w2$}  result", "figure", "measured", "target");
        for (label, measured, target, pass) in &self.rows {
            let result = match pass {
                Some(true) => "pass",
                Some(false) => "MISS",
                None => "",
            };
            println!("{label:w0$}  {measured:w1$}  {target:w2$}  {result}");
        }
        for note in &self.notes {
            println!("note: {note}");
        }
        if let Some(timeline) = &self.timeline {
            timeline.print();
        }
    }
}
