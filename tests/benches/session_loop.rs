//! `cargo bench -p mur-tests --bench session_loop`: the session loop's own cost per turn
//! (issue #3, "The loop's speed").
//!
//! Everything runs in one process, so the figures of one run can be compared as ratios:
//!
//! - (a) a 1,000-turn task with the scripted driver (999 replies calling a no-op tool, then
//!   `end_turn`) and a no-op tool set, the trace written to a real `trace.jsonl`;
//! - (a') task (a) again, estimating with `o200k_base` as (b) does, with no server beside;
//! - (b) a 200-turn task against the fake OpenAI server over a real socket on `127.0.0.1`
//!   (199 tool-call replies, then a text reply), the fake running on the same runtime;
//! - (c) the peak heap of task (a) (run a second time for it), from a counting global
//!   allocator, and the process's peak resident set (`VmHWM` in `/proc/self/status`),
//!   read before anything else has run;
//! - (e) the one-time load of each tokenizer: time and heap kept;
//! - (d) a baseline: the cost of building and serialising a 1-message request against the
//!   request of turn 200, for the reference builder (`request_body` + `serde_json::to_vec`)
//!   and for the driver's cached encoder;
//! - (f) the tool-call journal's cost (issue #34): task (a) as a cluster task
//!   (`run_task_durable`) with its journal appended to a KV bucket of a real nats-server
//!   started here (three entries per turn: the response, the call's start, its result,
//!   acknowledged together by one sync before the call runs), beside the same task durable
//!   with no journal, interleaved; and each sync's own round trip.
//!
//! Runtime overhead per turn is measured by wrapping the driver: the gap between the
//! starts of two consecutive model calls, minus the time spent inside the first of them.
//! It covers the reply's handling, the trace lines, the tool call and the next request's
//! preparation, and leaves out the model's own time (for (b), the HTTP round trip).
//!
//! The machine is shared, so the full run runs each task five times and keeps, for each
//! turn, the median of its five figures; a line "of which loop-thread CPU time" beside the
//! wall-clock overhead tells waiting for a core from work.
//!
//! Turn counts: `MUR_BENCH_TURNS=N` runs both tasks with N turns, once; without it a
//! release build runs the full 1,000 and 200 turns and a debug build (`cargo test --bench
//! session_loop`, CI's smoke run) runs 20. The "first" and "last" windows are
//! `min(100, gaps / 2)` turns each.

use async_trait::async_trait;
use mur_nats::clock::SystemClock;
use mur_proto::Manifest;
use mur_proto::cluster::Entry;
use mur_proto::message::Message;
use mur_proto::task::{ExitStatus, Origin};
use mur_tests::fake_openai::{FakeOpenAi, FakeReply};
use mur_worker::driver::http::Attempt;
use mur_worker::driver::openai::{self, MaxTokensParam, OpenAi};
use mur_worker::driver::scripted::{Reply, Script, Scripted, ScriptedCall};
use mur_worker::driver::{Driver, Error, ModelRequest, ModelResponse, ToolSpec};
use mur_worker::hooks::NoHooks;
use mur_worker::session::runner::Parts;
use mur_worker::session::spend::{Position, Spend};
use mur_worker::session::{Checkpoints, Durable, Journal, Session, SessionConfig, TaskSpec, TurnCheckpoint, Unstored};
use mur_worker::tokens::{self, Estimator};
use mur_worker::tools::{CallContext, Outcome, Tools};
use mur_worker::trace::{FileSink, Tracer};
use serde_json::{Value, json};
use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicIsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Counts heap bytes, while [`COUNTING`] is on, and their high-water mark. Off, it costs
/// one relaxed load per call, so that timed sections are not slowed by the counting.
struct Counting;

static COUNTING: AtomicBool = AtomicBool::new(false);
static LIVE: AtomicIsize = AtomicIsize::new(0);
static PEAK: AtomicIsize = AtomicIsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded to the system allocator with the caller's layout.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as `alloc`.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from this allocator (so from `System`) with `layout`.
        unsafe { System.dealloc(ptr, layout) };
        shrank(layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: as `dealloc` and `alloc`.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            shrank(layout.size());
            grew(new_size);
        }
        p
    }
}

fn grew(bytes: usize) {
    if COUNTING.load(Ordering::Relaxed) {
        let live = LIVE.fetch_add(bytes as isize, Ordering::Relaxed) + bytes as isize;
        PEAK.fetch_max(live, Ordering::Relaxed);
    }
}

fn shrank(bytes: usize) {
    if COUNTING.load(Ordering::Relaxed) {
        LIVE.fetch_sub(bytes as isize, Ordering::Relaxed);
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Runs `f` with the heap counted (every thread's allocations): returns its result, the
/// peak of bytes allocated above the start, and the bytes still held at the end.
fn heap_during<R>(f: impl FnOnce() -> R) -> (R, u64, i64) {
    LIVE.store(0, Ordering::SeqCst);
    PEAK.store(0, Ordering::SeqCst);
    COUNTING.store(true, Ordering::SeqCst);
    let r = f();
    COUNTING.store(false, Ordering::SeqCst);
    (r, PEAK.load(Ordering::SeqCst).max(0) as u64, LIVE.load(Ordering::SeqCst) as i64)
}

/// `VmHWM` (peak resident set) from `/proc/self/status`, in bytes.
fn vm_hwm() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// One model call as the wrapper saw it.
#[derive(Clone, Copy)]
struct Call {
    start: Instant,
    inside: Duration,
    /// The calling thread's CPU time when the call started and when it returned.
    cpu_start: Duration,
    cpu_end: Duration,
}

/// CPU time of the calling thread. The session's future is polled on the thread that
/// calls `block_on`, so between model calls this counts only the loop's own work: a gap
/// whose wall time grows while its CPU time does not was spent waiting for a core.
fn thread_cpu() -> Duration {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable timespec; the clock id is a constant Linux knows.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return Duration::ZERO;
    }
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// Forwards to a driver and records when each call started and how long it took.
struct Timed {
    inner: Arc<dyn Driver>,
    calls: Mutex<Vec<Call>>,
}

impl Timed {
    fn new(inner: Arc<dyn Driver>, turns: usize) -> Self {
        Timed { inner, calls: Mutex::new(Vec::with_capacity(turns + 1)) }
    }

    fn record(&self, start: Instant, cpu_start: Duration) {
        let inside = start.elapsed();
        let cpu_end = thread_cpu();
        self.calls.lock().unwrap().push(Call { start, inside, cpu_start, cpu_end });
    }
}

#[async_trait]
impl Driver for Timed {
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }

    async fn call(&self, request: &ModelRequest<'_>) -> Result<ModelResponse, Error> {
        let cpu_start = thread_cpu();
        let start = Instant::now();
        let r = self.inner.call(request).await;
        self.record(start, cpu_start);
        r
    }

    async fn call_logged(&self, request: &ModelRequest<'_>) -> (Result<ModelResponse, Error>, Vec<Attempt>) {
        let cpu_start = thread_cpu();
        let start = Instant::now();
        let r = self.inner.call_logged(request).await;
        self.record(start, cpu_start);
        r
    }
}

/// One tool, `noop`, that answers `ok` at once.
struct NoopTools(Arc<[ToolSpec]>);

impl NoopTools {
    fn new() -> Self {
        NoopTools(Arc::new([ToolSpec {
            name: "noop".into(),
            description: "does nothing".into(),
            parameters: json!({"type": "object", "properties": {}}),
        }]))
    }
}

#[async_trait]
impl Tools for NoopTools {
    fn specs(&self) -> Arc<[ToolSpec]> {
        self.0.clone()
    }

    async fn call(&self, _name: &str, _input: &Value, _ctx: &CallContext) -> Outcome {
        Outcome { text: "ok".into(), is_error: false, shell: None, detached: None, sandbox: None, mcp_server: None }
    }
}

fn manifest(driver: &str, model: Option<&str>, max_turns: usize) -> Arc<Manifest> {
    let mut yaml = format!("name: bench\nversion: 1.0.0\ninference:\n  driver: {driver}\n  max_turns: {max_turns}\n");
    match model {
        Some(m) => yaml.push_str(&format!("  model: {m}\n  endpoint: http://127.0.0.1:1/v1\n")),
        None => yaml.push_str("  script: replies.yaml\n"),
    }
    Arc::new(Manifest::from_yaml(&yaml, &|_| None).expect("bench manifest"))
}

/// Runs one task of `turns` model calls through a real [`Session`] with `driver` wrapped in
/// [`Timed`], writing the trace to `dir/trace.jsonl`; returns the calls as seen.
/// A journal appended to a KV bucket, as the worker's adapter does (entries published
/// without waiting, their acknowledgements awaited together at each sync), timing each
/// sync: one round trip.
struct KvJournal {
    kv: async_nats::jetstream::kv::Store,
    js: async_nats::jetstream::Context,
    pending: Mutex<Vec<(String, async_nats::jetstream::context::PublishAckFuture)>>,
    times: Mutex<Vec<Duration>>,
}

#[async_trait]
impl Journal for KvJournal {
    fn worker(&self) -> &str {
        "wkr-bench"
    }

    async fn post(&self, entry: Entry) -> Result<(), String> {
        let key = entry.key();
        let json = entry.fit(1 << 20).map_err(|e| e.to_string())?;
        let ack = self.js.publish(format!("{}{key}", self.kv.prefix), json.into()).await.map_err(|e| e.to_string())?;
        self.pending.lock().unwrap().push((key, ack));
        Ok(())
    }

    async fn sync(&self) -> Vec<Unstored> {
        let t = Instant::now();
        let pending = std::mem::take(&mut *self.pending.lock().unwrap());
        let mut unstored = Vec::new();
        let acks = futures::future::join_all(pending.into_iter().map(|(key, ack)| async move { (key, ack.await) }));
        for (key, ack) in acks.await {
            if let Err(e) = ack {
                unstored.push(Unstored { key, why: e.to_string() });
            }
        }
        self.times.lock().unwrap().push(t.elapsed());
        unstored
    }
}

/// Checkpoints that go nowhere: (f) measures the journal alone.
struct NoCheckpoints;

#[async_trait]
impl Checkpoints for NoCheckpoints {
    async fn save(&self, _checkpoint: TurnCheckpoint) -> Result<(), String> {
        Ok(())
    }
}

async fn run_task(
    dir: &Path,
    driver: Arc<dyn Driver>,
    model: Option<&str>,
    turns: usize,
    estimator: Arc<dyn Estimator>,
) -> Vec<Call> {
    run_task_with(dir, driver, model, turns, estimator, None).await
}

/// [`run_task`], as a cluster task when `durable` is given.
async fn run_task_with(
    dir: &Path,
    driver: Arc<dyn Driver>,
    model: Option<&str>,
    turns: usize,
    estimator: Arc<dyn Estimator>,
    durable: Option<Durable>,
) -> Vec<Call> {
    let kind = driver.kind();
    let timed = Arc::new(Timed::new(driver, turns));
    let clock = Arc::new(SystemClock);
    let sink = FileSink::open(&dir.join("trace.jsonl")).expect("open trace.jsonl");
    let tracer = Tracer::new("ses_bench".into(), Box::new(sink), clock.clone());
    let cfg = SessionConfig {
        manifest: manifest(kind, model, turns),
        model: model.unwrap_or_default().to_string(),
        model_label: model.unwrap_or(kind).to_string(),
        system_prompt: "You are a benchmark. Call the noop tool until told otherwise.".into(),
        system_prompt_source: "manifest",
        system_prompt_sha256: None,
        call_context: CallContext {
            capsule_dir: dir.to_path_buf(),
            workdir: dir.to_path_buf(),
            logs_dir: dir.join("logs"),
            sandbox: None,
            tool_call_id: None,
        },
        result_path: Some(dir.join("result.txt")),
        logs_dir: None,
        resumed_from: None,
    };
    let parts = Parts {
        driver: timed.clone(),
        tools: Arc::new(NoopTools::new()),
        hooks: Arc::new(NoHooks),
        tracer: Arc::new(Mutex::new(tracer)),
        clock,
        estimator,
        spend: Arc::new(Spend::new(None)),
        position: Arc::new(Position::default()),
    };
    let mut session = Session::start(cfg, parts).await.expect("session_start");
    let task = TaskSpec {
        task_id: "tsk_bench".into(),
        context_id: "ctx_bench".into(),
        text: "Call noop until the script ends.".into(),
        origin: Origin::User,
        source: "cli".into(),
    };
    let report = match durable {
        Some(durable) => session
            .run_task_durable(task, Vec::new(), tokio_util::sync::CancellationToken::new(), durable)
            .await
            .expect("trace writes"),
        None => session.run_task(task, Vec::new()).await.expect("trace writes"),
    };
    assert_eq!(report.outcome.exit_status, ExitStatus::Ok, "{}", report.outcome.result);
    assert_eq!(report.counters.turns as usize, turns);
    session.end(None).await.expect("session_end");
    timed.calls.lock().unwrap().clone()
}

/// Per-turn figures of one task.
struct Figures {
    turns: usize,
    wall: Duration,
    /// Runtime overhead before each call after the first (the gaps).
    overhead: Vec<Duration>,
    /// Time inside the driver, per call.
    model: Vec<Duration>,
    /// The loop thread's CPU time in each gap.
    cpu: Vec<Duration>,
}

impl Figures {
    fn new(calls: &[Call], wall: Duration) -> Self {
        let overhead =
            calls.windows(2).map(|w| w[1].start.duration_since(w[0].start).saturating_sub(w[0].inside)).collect();
        let cpu = calls.windows(2).map(|w| w[1].cpu_start.saturating_sub(w[0].cpu_end)).collect();
        Figures { turns: calls.len(), wall, overhead, model: calls.iter().map(|c| c.inside).collect(), cpu }
    }

    /// Each turn's median over several runs of the same task (and the median wall time):
    /// a turn that another process delayed in one run does not move the figures.
    fn median(runs: &[Figures]) -> Self {
        let per_turn = |pick: fn(&Figures) -> &Vec<Duration>| -> Vec<Duration> {
            (0..pick(&runs[0]).len()).map(|i| median(runs.iter().map(|r| pick(r)[i]).collect())).collect()
        };
        Figures {
            turns: runs[0].turns,
            wall: median(runs.iter().map(|r| r.wall).collect()),
            overhead: per_turn(|f| &f.overhead),
            model: per_turn(|f| &f.model),
            cpu: per_turn(|f| &f.cpu),
        }
    }

    fn window(&self) -> usize {
        (self.overhead.len() / 2).clamp(1, 100)
    }
}

fn median(mut xs: Vec<Duration>) -> Duration {
    xs.sort();
    xs.get(xs.len() / 2).copied().unwrap_or_default()
}

/// Runs task `once(run)` `runs` times and keeps each turn's median ([`Figures::median`]).
fn repeated(runs: usize, mut once: impl FnMut(usize) -> Figures) -> Figures {
    let all: Vec<Figures> = (0..runs).map(&mut once).collect();
    Figures::median(&all)
}

fn mean(xs: &[Duration]) -> Duration {
    if xs.is_empty() {
        return Duration::ZERO;
    }
    xs.iter().sum::<Duration>() / xs.len() as u32
}

fn percentile(xs: &[Duration], p: f64) -> Duration {
    let mut v = xs.to_vec();
    v.sort();
    v.get(((v.len() as f64 - 1.0) * p).round() as usize).copied().unwrap_or_default()
}

fn us(d: Duration) -> String {
    format!("{:.1} µs", d.as_secs_f64() * 1e6)
}

fn ratio(last: Duration, first: Duration) -> f64 {
    last.as_secs_f64() / first.as_secs_f64().max(1e-12)
}

fn mib(bytes: u64) -> String {
    format!("{:.2} MiB", bytes as f64 / (1024.0 * 1024.0))
}

fn report(title: &str, f: &Figures, model_label: &str) -> (Duration, f64) {
    let w = f.window();
    let n = f.overhead.len();
    let first = mean(&f.overhead[..w]);
    let last = mean(&f.overhead[n - w..]);
    let all = mean(&f.overhead);
    let r = ratio(last, first);
    println!("\n{title}");
    println!("  turns                          {}", f.turns);
    println!(
        "  wall time                      {:.1} ms ({} per turn, model time included)",
        f.wall.as_secs_f64() * 1e3,
        us(f.wall / f.turns as u32)
    );
    println!(
        "  runtime overhead per turn      mean {}  p50 {}  p99 {}",
        us(all),
        us(percentile(&f.overhead, 0.5)),
        us(percentile(&f.overhead, 0.99))
    );
    println!("  overhead, first {w} turns       {}", us(first));
    println!("  overhead, last {w} turns        {}", us(last));
    println!("  overhead ratio last/first      {r:.2}");
    let (cf, cl) = (mean(&f.cpu[..w]), mean(&f.cpu[n - w..]));
    println!(
        "  of which loop-thread CPU time  mean {}  first {w} {}  last {w} {}  ratio {:.2}",
        us(mean(&f.cpu)),
        us(cf),
        us(cl),
        ratio(cl, cf)
    );
    let m = f.model.len();
    let mw = w.min(m / 2).max(1);
    let (mf, ml) = (mean(&f.model[..mw]), mean(&f.model[m - mw..]));
    println!(
        "  {model_label:<30} mean {}  first {mw} {}  last {mw} {}  ratio {:.2}",
        us(mean(&f.model)),
        us(mf),
        us(ml),
        ratio(ml, mf)
    );
    (all, r)
}

/// The script of task (a): `turns - 1` replies calling `noop`, then a text reply.
fn scripted(turns: usize) -> Arc<dyn Driver> {
    let reply = |text: Option<&str>, tool_calls| Reply {
        text: text.map(str::to_string),
        tool_calls,
        stop_reason: None,
        error: None,
        usage: None,
        delay_ms: None,
    };
    let mut replies: Vec<Reply> = (0..turns - 1)
        .map(|_| reply(None, vec![ScriptedCall { name: "noop".into(), input: json!({}), id: None }]))
        .collect();
    replies.push(reply(Some("done"), vec![]));
    Arc::new(Scripted::new(Script { replies, repeat: false }))
}

/// A tool-call completion as OpenAI sends it.
fn tool_call_reply(i: usize) -> FakeReply {
    FakeReply::Json(json!({
        "id": format!("chatcmpl-{i}"),
        "object": "chat.completion",
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": null, "tool_calls": [{
                "id": format!("call_{i}"),
                "type": "function",
                "function": {"name": "noop", "arguments": "{}"},
            }]},
            "finish_reason": "tool_calls",
        }],
        "usage": {"prompt_tokens": 100 + i, "completion_tokens": 10},
    }))
}

/// The conversation of turn `turn` of task (b): the task, then per turn an assistant tool
/// call and its tool result.
fn conversation(turn: usize) -> Vec<Message> {
    let mut messages = vec![Message::user("Call noop until the script ends.")];
    for i in 0..turn {
        messages.push(Message::assistant(vec![mur_proto::message::Block::ToolCall {
            id: format!("call_{i}"),
            name: "noop".into(),
            input: json!({}),
        }]));
        messages.push(Message::tool_result(format!("call_{i}"), "ok", false));
    }
    messages
}

/// The request of task (b)'s shape over `messages`.
fn request<'a>(tools: &'a [ToolSpec], messages: &'a [Message], history_epoch: u64) -> ModelRequest<'a> {
    ModelRequest {
        model: "gpt-4o",
        system: "You are a benchmark. Call the noop tool until told otherwise.",
        messages,
        history_epoch,
        tools,
        max_tokens: 8192,
        task_text: "",
    }
}

/// A copy of `len` bytes into a fresh buffer: the floor of any body build.
fn long_body_copy(len: usize) -> Vec<u8> {
    let source = black_box(vec![b'x'; len]);
    let mut out = Vec::with_capacity(len);
    out.extend_from_slice(&source);
    out
}

/// Mean time of `f` over `reps` runs.
fn time<R>(reps: u32, mut f: impl FnMut() -> R) -> Duration {
    let t = Instant::now();
    for _ in 0..reps {
        black_box(f());
    }
    t.elapsed() / reps
}

/// (scripted turns, openai turns, runs of each task, smoke run?).
fn turns_from_env() -> (usize, usize, usize, bool) {
    match std::env::var("MUR_BENCH_TURNS").ok().and_then(|v| v.parse::<usize>().ok()).filter(|&n| n >= 2) {
        Some(n) => (n, n, 1, true),
        None if cfg!(debug_assertions) => (20, 20, 1, true),
        None => (1000, 200, 5, false),
    }
}

fn main() {
    mur_nats::tls::install_crypto_provider();
    let (scripted_turns, openai_turns, runs, smoke) = turns_from_env();
    println!(
        "session_loop: {} run ({scripted_turns} scripted turns, {openai_turns} openai turns, {runs} run(s) of \
         each task, per-turn medians; {} build)",
        if smoke { "smoke" } else { "full" },
        if cfg!(debug_assertions) { "debug" } else { "release" }
    );
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("tokio runtime");
    let dir = tempfile::tempdir().expect("tempdir");

    // (c) first: task (a) once with the heap counted, so that the process's peak RSS is
    // this task's; then (a) itself, timed with the counting off.
    let task_dir = |name: String| {
        let d = dir.path().join(name);
        std::fs::create_dir_all(&d).expect("task folder");
        d
    };
    let scripted_task = |name: String, estimator: Arc<dyn Estimator>| {
        let d = task_dir(name);
        let t = Instant::now();
        let calls = runtime.block_on(run_task(&d, scripted(scripted_turns), None, scripted_turns, estimator));
        (Figures::new(&calls, t.elapsed()), d)
    };
    let (_, heap_peak, heap_kept) =
        heap_during(|| scripted_task("scripted-memory".into(), tokens::for_model("scripted", None)));
    let hwm = vm_hwm();
    let mut trace_bytes = 0;
    let a = repeated(runs, |i| {
        let (f, d) = scripted_task(format!("scripted-{i}"), tokens::for_model("scripted", None));
        trace_bytes = std::fs::metadata(d.join("trace.jsonl")).map_or(0, |m| m.len());
        f
    });
    let (a_mean, a_ratio) = report("(a) scripted driver, no-op tool, trace to trace.jsonl", &a, "scripted driver time");
    println!(
        "  trace.jsonl                    {} bytes ({} per turn)",
        trace_bytes,
        trace_bytes / scripted_turns as u64
    );
    println!("\n(c) peak memory of task (a), run once more with the heap counted");
    println!("  heap peak above the start      {} (counting allocator, all threads)", mib(heap_peak));
    println!("  heap held after the task       {}", mib(heap_kept.max(0) as u64));
    println!("  VmHWM (peak RSS, process)      {}", hwm.map_or("unavailable".into(), mib));

    // The tokenizers' one-time load (task (b) counts with o200k_base): only `openai`
    // capsules with an OpenAI model pay it, once per process.
    println!("\n(e) tokenizer load, once per process (scripted and non-OpenAI models never load one)");
    for encoding in [tokens::Encoding::O200kBase, tokens::Encoding::Cl100kBase] {
        let t = Instant::now();
        let (_, _, kept) = heap_during(|| black_box(tokens::Tiktoken::new(encoding).count("hello world")));
        let took = t.elapsed();
        println!(
            "  {:<12} {:.1} ms, {} kept on the heap",
            encoding.name(),
            took.as_secs_f64() * 1e3,
            mib(kept.max(0) as u64)
        );
    }

    let message = serde_json::to_string(&Message::tool_result("call_17", "ok", false)).unwrap();
    let o200k = tokens::Tiktoken::new(tokens::Encoding::O200kBase);
    let count = time(1000, || o200k.count(&message));
    println!("  o200k_base count of one tool-result message ({} bytes): {}", message.len(), us(count));

    // (a) again with the real tokenizer (what (b) counts with), without a server beside
    // the loop: the loop's own cost with o200k_base, first turns against last.
    let a2 = repeated(runs, |i| {
        let o200k: Arc<dyn Estimator> = Arc::new(tokens::Tiktoken::new(tokens::Encoding::O200kBase));
        scripted_task(format!("scripted-o200k-{i}"), o200k).0
    });
    let (a2_mean, a2_ratio) = report("(a') as (a), estimating with o200k_base", &a2, "scripted driver time");

    // (b): the openai driver against the fake server over a real socket.
    let b = repeated(runs, |i| {
        let d = task_dir(format!("openai-{i}"));
        runtime.block_on(async {
            let mut replies: Vec<FakeReply> = (0..openai_turns - 1).map(tool_call_reply).collect();
            replies.push(FakeReply::text("done"));
            let fake = FakeOpenAi::start(replies);
            let driver: Arc<dyn Driver> = Arc::new(OpenAi::new(openai::Config {
                endpoint: fake.url(),
                api_key: Some("sk-bench".into()),
                stream: false,
                policy: Default::default(),
                max_tokens_param: MaxTokensParam::MaxTokens,
            }));
            let estimator = tokens::for_model("openai", Some("gpt-4o"));
            let t = Instant::now();
            let calls = run_task(&d, driver, Some("gpt-4o"), openai_turns, estimator).await;
            Figures::new(&calls, t.elapsed())
        })
    });
    let (b_mean, b_ratio) =
        report("(b) openai driver, fake server on 127.0.0.1, model gpt-4o", &b, "model time (HTTP round trip)");

    // (d): the request body, turn 1 against turn `openai_turns`, and per turn over the
    // whole task: the reference builder against the driver's cached encoder.
    println!("\n(d) baseline: building the request body (serialised), turn 1 vs turn {openai_turns}");
    let tools = NoopTools::new();
    let reps = if smoke { 20 } else { 200 };
    let long = conversation(openai_turns - 1);
    let (r1, rn) = (request(&tools.0, &long[..1], 0), request(&tools.0, &long, 0));
    let body_len = serde_json::to_vec(&openai::request_body(&rn, false, MaxTokensParam::MaxTokens)).unwrap().len();
    println!("  turn {openai_turns}: {} messages, {body_len} bytes", long.len());
    let tree1 =
        time(reps, || serde_json::to_vec(&openai::request_body(&r1, false, MaxTokensParam::MaxTokens)).unwrap());
    let treen =
        time(reps, || serde_json::to_vec(&openai::request_body(&rn, false, MaxTokensParam::MaxTokens)).unwrap());
    println!(
        "  request_body + to_vec (before)  turn 1 {}  turn {openai_turns} {}  ratio {:.1}",
        us(tree1),
        us(treen),
        ratio(treen, tree1)
    );
    let vec1 = time(reps, || serde_json::to_vec(&long[..1]).unwrap());
    let vecn = time(reps, || serde_json::to_vec(&long).unwrap());
    println!(
        "  to_vec of the messages alone   turn 1 {}  turn {openai_turns} {}  ratio {:.1}",
        us(vec1),
        us(vecn),
        ratio(vecn, vec1)
    );
    let body = serde_json::to_vec(&openai::request_body(&rn, false, MaxTokensParam::MaxTokens)).unwrap();
    let parse = time(reps, || serde_json::from_slice::<Value>(&body).unwrap());
    println!("  parsing it back to a Value (what the fake server does per request, in model time): {}", us(parse));
    let copyn = time(reps, || long_body_copy(body_len));
    println!("  memcpy of a {body_len}-byte body  {}", us(copyn));
    // Per turn, as in task (b): each request is the previous one plus two messages.
    let rounds = if smoke { 3 } else { 20 };
    let mut reference = vec![Duration::ZERO; openai_turns];
    let mut cached = vec![Duration::ZERO; openai_turns];
    // Separate passes, so that neither path runs on a heap and caches the other just used.
    for round in 0..rounds {
        for (k, r) in reference.iter_mut().enumerate() {
            let req = request(&tools.0, &long[..1 + 2 * k], 0);
            let t = Instant::now();
            black_box(serde_json::to_vec(&openai::request_body(&req, false, MaxTokensParam::MaxTokens)).unwrap());
            *r += t.elapsed();
        }
        let mut encoder = openai::RequestEncoder::new();
        for (k, c) in cached.iter_mut().enumerate() {
            let req = request(&tools.0, &long[..1 + 2 * k], 1000 + round);
            let t = Instant::now();
            black_box(encoder.encode(&req, false, MaxTokensParam::MaxTokens));
            *c += t.elapsed();
        }
    }
    let w = (openai_turns / 2).clamp(1, 100);
    for (label, per_turn) in
        [("request_body + to_vec (before)", &reference), ("RequestEncoder (now)          ", &cached)]
    {
        let per_turn: Vec<Duration> = per_turn.iter().map(|d| *d / rounds as u32).collect();
        let (first, last) = (mean(&per_turn[..w]), mean(&per_turn[openai_turns - w..]));
        println!(
            "  {label} per turn: first {w} {}  last {w} {}  ratio {:.2}  task total {:.2} ms",
            us(first),
            us(last),
            ratio(last, first),
            per_turn.iter().sum::<Duration>().as_secs_f64() * 1e3
        );
    }

    // (f) the tool-call journal (issue #34).
    let nats = mur_tests::nats::NatsServer::start();
    let (kv, js) = runtime.block_on(async {
        let client = async_nats::connect(nats.url()).await.expect("connect to nats-server");
        let js = async_nats::jetstream::new(client);
        let kv = js
            .create_key_value(async_nats::jetstream::kv::Config {
                bucket: "bench_sessions".into(),
                history: 1,
                ..Default::default()
            })
            .await
            .expect("create the bucket");
        (kv, js)
    });
    let journal = Arc::new(KvJournal { kv, js, pending: Mutex::new(Vec::new()), times: Mutex::new(Vec::new()) });
    let (mut with, mut without) = (Vec::new(), Vec::new());
    for i in 0..runs {
        for journaled in [false, true] {
            let d = task_dir(format!("journal-{i}-{journaled}"));
            let durable = Durable {
                takeover: None,
                checkpoints: Arc::new(NoCheckpoints),
                journal: journaled.then(|| journal.clone() as Arc<dyn Journal>),
                deadline: None,
                superseded: None,
            };
            let t = Instant::now();
            let calls = runtime.block_on(run_task_with(
                &d,
                scripted(scripted_turns),
                None,
                scripted_turns,
                tokens::for_model("scripted", None),
                Some(durable),
            ));
            let f = Figures::new(&calls, t.elapsed());
            if journaled { with.push(f) } else { without.push(f) }
        }
    }
    let (with, without) = (Figures::median(&with), Figures::median(&without));
    let p50 = |xs: &[Duration]| median(xs.to_vec());
    let appends = journal.times.lock().unwrap().clone();
    let (with_p50, without_p50) = (p50(&with.overhead), p50(&without.overhead));
    let per_call = with_p50.saturating_sub(without_p50);
    println!("\n(f) the tool-call journal, task (a) durable, to a real nats-server (one tool call per turn)");
    println!("  overhead per turn p50, no journal   {}", us(without_p50));
    println!("  overhead per turn p50, journaled    {}", us(with_p50));
    println!(
        "  journaling per tool call, p50       {} (3 entries: response, start, result; one sync)  ratio to no journal {:.2}",
        us(per_call),
        ratio(with_p50, without_p50)
    );
    println!(
        "  one sync's round trip              p50 {}  p90 {}  ({} syncs)",
        us(p50(&appends)),
        us({
            let mut a = appends.clone();
            a.sort();
            a.get(a.len() * 9 / 10).copied().unwrap_or_default()
        }),
        appends.len()
    );
    drop(nats);

    println!("\ntargets (issue #3){}", if smoke { " — smoke run, figures not meaningful" } else { "" });
    let check = |ok: bool| if ok { "met" } else { "MISSED" };
    for (label, mean, ratio) in [("(a) ", a_mean, a_ratio), ("(a')", a2_mean, a2_ratio), ("(b) ", b_mean, b_ratio)] {
        println!(
            "  {label} overhead per turn {} < 0.5 ms: {}   last/first {ratio:.2} <= 1.5: {}",
            us(mean),
            check(mean < Duration::from_micros(500)),
            check(ratio <= 1.5)
        );
    }
    println!("  (a)  peak heap {} < 50 MB: {}", mib(heap_peak), check(heap_peak < 50_000_000));
    println!(
        "  (f)  journaling per tool call p50 {} <= 0.5 ms (issue #34): {}",
        us(per_call),
        check(per_call <= Duration::from_micros(500))
    );
}
