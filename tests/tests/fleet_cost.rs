//! Issue #11 §Cost, end to end with real processes: a coordinator started with a cluster
//! config holding `prices:`, a worker, and capsules on the `openai` driver against the fake
//! OpenAI server (the real wire format, `usage` with `prompt_tokens_details.cached_tokens`
//! or no `usage` at all). Spend comes from the tasks' terminal records; the budget is
//! checked before each iteration with the reference's projection.

use mur_proto::cluster::{TaskRecord, api};
use mur_tests::capsule::TestCapsule;
use mur_tests::fake_anthropic::{AnthropicReply, FakeAnthropic};
use mur_tests::fake_openai::{FakeOpenAi, FakeReply};
use mur_tests::mur::Run;
use mur_tests::procs::Procs;
use serde_json::{Value, json};

const PRICES: &str = "jetstream:\n  ack_wait_secs: 5\nprices:\n  gpt-x: {input: 1.0, output: 2.0, cached_input: 0.5}\n";

fn openai_capsule(name: &str, model: &str, fake: &FakeOpenAi) -> TestCapsule {
    TestCapsule::new(
        &format!(
            "name: {name}\nversion: 1.0.0\ninference:\n  driver: openai\n  endpoint: {}\n  model: {model}\n",
            fake.url()
        ),
        &[],
    )
}

/// `mur ARGS` against the cluster, run off the async runtime.
async fn mur(procs: &Procs, args: &[&str]) -> Run {
    procs.mur(args).await
}

async fn create_fleet(procs: &Procs, yaml: &str) {
    let path = procs.dir().join("fleet.yaml");
    std::fs::write(&path, yaml).unwrap();
    let run = mur(procs, &["fleet", "create", path.to_str().unwrap()]).await;
    assert_eq!(run.code, 0, "{run:?}");
}

async fn status_json(procs: &Procs, run_id: &str) -> Value {
    let status = mur(procs, &["job", "status", run_id, "--json"]).await;
    assert_eq!(status.code, 0, "{status:?}");
    status.last_json()
}

/// Each call reports 2,000,000 prompt tokens of which 1,000,000 cached, and 1,000,000
/// completion tokens: at $1 / $0.50 cached / $2 per 1,000 that is 1,000 + 500 + 2,000 =
/// $3,500 (a cached token priced as input would make it $4,000). One member at $2 per
/// 1,000 output tokens projects the first iteration at 3.5 M × 2 / 1,000 = $7,000; with
/// `--budget-usd 10000`: iteration 0 (0 + 7,000), iteration 1 (3,500 + 3,500) run, and
/// iteration 2 (7,000 + 3,500 > 10,000) is refused before any model call: stop `budget`,
/// the third job still queued.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_budget_stops_a_metered_loop_before_the_iteration_it_cannot_afford_and_cached_tokens_are_priced_apart() {
    let fake = FakeOpenAi::repeating(FakeReply::text_with_usage("done", 2_000_000, 1_000_000, 1_000_000));
    let procs = Procs::start(PRICES).await;
    let _c = procs.coordinator("coordinator-1");
    let _w = procs.worker("wkr-1", 2);
    procs.wait_workers(1).await;
    procs.push(openai_capsule("coder", "gpt-x", &fake).dir()).await;
    create_fleet(&procs, "name: metered\nmembers: [coder]\nloop:\n  done_when: queue-empty\n").await;
    for text in ["one", "two", "three"] {
        assert_eq!(mur(&procs, &["fleet", "send", "metered", text]).await.code, 0);
    }
    let run = mur(&procs, &["fleet", "run", "metered", "--loop", "--budget-usd", "10000", "--deadline", "5m"]).await;
    assert_eq!(run.code, 1, "{run:?}");
    let run_id = run.run_id();
    assert!(
        run.stderr.contains(&format!(
            "run {run_id} ended: budget after 2 iterations; spent $7000.0000 (4000000 in, 2000000 cached, 2000000 out)"
        )),
        "{}",
        run.stderr
    );
    assert!(!run.stderr.contains("notice:"), "a metered fleet gets no local notice: {}", run.stderr);
    assert_eq!(fake.served(), 2, "the unaffordable iteration made no model call");

    let jobs: Value =
        serde_json::from_str(mur(&procs, &["fleet", "jobs", "metered", "--all", "--json"]).await.stdout.trim())
            .unwrap();
    let status_of = |t: &str| jobs.as_array().unwrap().iter().find(|j| j["text"] == t).unwrap()["status"].clone();
    assert_eq!(
        (status_of("one"), status_of("two"), status_of("three")),
        (json!("done"), json!("done"), json!("queued"))
    );

    let v = status_json(&procs, &run_id).await;
    assert_eq!((v["state"].as_str(), v["stop"].as_str()), (Some("failed"), Some("budget")));
    let spend = json!({"usd": 7000.0, "input_tokens": 4_000_000, "output_tokens": 2_000_000,
                       "cached_tokens": 2_000_000, "cache_write_tokens": 0, "estimated": false});
    assert_eq!(v["spend"], spend);
    assert_eq!(v["members"], json!({"coder": spend}));
    let per_job = json!({"usd": 3500.0, "input_tokens": 2_000_000, "output_tokens": 1_000_000,
                         "cached_tokens": 1_000_000, "cache_write_tokens": 0, "estimated": false});
    let job_spend: Vec<&Value> = v["jobs"].as_object().unwrap().values().collect();
    assert_eq!(job_spend, [&per_job, &per_job]);
    assert_eq!((v["budget_usd"].as_f64(), v["guard_rate"].as_f64()), (Some(10000.0), Some(2.0)));
    let text = mur(&procs, &["job", "status", &run_id]).await.stdout;
    assert!(
        text.contains("spend      $7000.0000 (4000000 in, 2000000 cached, 2000000 out) of a $10000.0000 budget\n"),
        "{text}"
    );
    assert!(text.contains("  member coder $7000.0000 (4000000 in, 2000000 cached, 2000000 out)\n"), "{text}");

    // The channel carries the spend of each iteration and the total at the stop.
    let log = mur(&procs, &["fleet", "log", "metered"]).await.stdout;
    assert!(
        log.contains(&format!(
            "system note: spend: iteration {run_id}-1 $3500.0000 (2000000 in, 1000000 cached, 1000000 out); \
             run {run_id} $7000.0000; members: coder $7000.0000"
        )),
        "{log}"
    );
    assert!(
        log.contains(&format!(
            "system stop: run {run_id} stopped: budget; spent $7000.0000 (4000000 in, 2000000 cached, 2000000 out)"
        )),
        "{log}"
    );
}

/// A provider that reports no `usage`: the task's record carries the runtime's estimates
/// (the `inference` line's `input_tokens` / `output_tokens`) marked `estimated`, and the
/// spend is priced from them and marked too. A fleet whose model has no price is told at
/// its start that its deadline bounds it, and its budget is not applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn missing_usage_is_estimated_and_marked_and_a_local_fleet_is_told_its_deadline_bounds_it() {
    let fake = FakeOpenAi::repeating(FakeReply::text("an answer without usage"));
    let procs = Procs::start(PRICES).await;
    let _c = procs.coordinator("coordinator-1");
    let _w = procs.worker("wkr-1", 2);
    procs.wait_workers(1).await;
    procs.push(openai_capsule("coder", "gpt-x", &fake).dir()).await;
    procs.push(openai_capsule("llama", "llama-local", &fake).dir()).await;

    create_fleet(&procs, "name: est\ngoal: Say something.\nmembers: [coder]\n").await;
    let run = mur(&procs, &["fleet", "run", "est"]).await;
    assert_eq!(run.code, 0, "{run:?}");
    let run_id = run.run_id();
    let tasks = mur_nats::api::call::<mur_proto::page::Page<TaskRecord>>(&procs.client, api::TASK_LIST, "")
        .await
        .unwrap()
        .items;
    assert_eq!(tasks.len(), 1);
    let usage = tasks[0].usage.clone().expect("the terminal record carries usage");
    let trace = procs.trace_of(&tasks[0].task_id).await;
    let inference = trace.iter().find(|l| l["event_type"] == "inference").expect("an inference line");
    assert!(inference.get("input_tokens_actual").is_none(), "the provider reported nothing: {inference}");
    assert_eq!(
        (usage.model.as_deref(), usage.input_tokens, usage.output_tokens, usage.cached_tokens, usage.estimated),
        (
            Some("gpt-x"),
            inference["input_tokens"].as_u64().unwrap(),
            inference["output_tokens"].as_u64().unwrap(),
            0,
            true
        )
    );
    assert!(usage.input_tokens > 0 && usage.output_tokens > 0, "{usage:?}");
    let v = status_json(&procs, &run_id).await;
    let usd = (usage.input_tokens as f64 * 1.0 + usage.output_tokens as f64 * 2.0) / 1000.0;
    assert_eq!(
        v["spend"],
        json!({"usd": usd, "input_tokens": usage.input_tokens, "output_tokens": usage.output_tokens,
               "cached_tokens": 0, "cache_write_tokens": 0, "estimated": true})
    );
    let text = mur(&procs, &["job", "status", &run_id]).await.stdout;
    assert!(text.contains(&format!("spend      ${usd:.4} (")) && text.contains(" out, estimated)\n"), "{text}");

    create_fleet(&procs, "name: localf\ngoal: Say something.\nmembers: [llama]\n").await;
    let local = mur(&procs, &["fleet", "run", "localf", "--budget-usd", "1", "--deadline", "5m"]).await;
    assert_eq!(local.code, 0, "the budget does not bound a local fleet: {local:?}");
    let notice = "fleet 'localf' runs on models with no price (local): it is bounded by its deadline 5m; \
                  the budget 1 ← --budget-usd is ignored";
    assert!(local.stderr.contains(&format!("notice: {notice}\n")), "{}", local.stderr);
    let v = status_json(&procs, &local.run_id()).await;
    assert_eq!((v["notices"].clone(), v["budget_usd"].clone()), (json!([notice]), Value::Null));
    assert_eq!((v["spend"]["usd"].as_f64(), v["spend"]["estimated"].as_bool()), (Some(0.0), Some(true)));
    let log = mur(&procs, &["fleet", "log", "localf"]).await.stdout;
    assert!(log.contains(&format!("system note: notice: {notice}")), "{log}");
}

/// Issue #28 item 3: an Anthropic reply with cache writes and cache reads. The call reports
/// 1,000 plain input tokens, 4,000 read from the cache, 2,000 written to it, and 500 output
/// tokens; at $3 input, $0.25 cache read, $3.75 cache write and $15 output per 1,000 that is
/// (3,000 + 1,000 + 7,500 + 7,500) / 1,000 = $19.00 (cache writes at the input rate made it
/// $17.50). The counts show apart on the task's usage, the spend, `mur job status` and the
/// trace's `inference` line.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cache_writes_are_priced_at_their_own_rate_and_counted_apart() {
    let usage = json!({"input_tokens": 1000, "output_tokens": 500,
                       "cache_read_input_tokens": 4000, "cache_creation_input_tokens": 2000});
    let fake = FakeAnthropic::start(vec![AnthropicReply::text("done", usage)]);
    let prices = "jetstream:\n  ack_wait_secs: 5\nprices:\n  \
                  claude-x: {input: 3, output: 15, cached_input: 0.25, cache_write: 3.75}\n";
    let procs = Procs::start(prices).await;
    let _c = procs.coordinator("coordinator-1");
    let _w = procs.worker("wkr-1", 2);
    procs.wait_workers(1).await;
    let capsule = TestCapsule::new(
        &format!(
            "name: writer\nversion: 1.0.0\ninference:\n  driver: anthropic\n  endpoint: {}\n  model: claude-x\n",
            fake.url()
        ),
        &[],
    );
    procs.push(capsule.dir()).await;
    create_fleet(&procs, "name: cached\ngoal: Say something.\nmembers: [writer]\n").await;
    let run = mur(&procs, &["fleet", "run", "cached"]).await;
    assert_eq!(run.code, 0, "{run:?}");
    assert_eq!(fake.requests().len(), 1);

    let v = status_json(&procs, &run.run_id()).await;
    let spend = json!({"usd": 19.0, "input_tokens": 7000, "output_tokens": 500, "cached_tokens": 4000,
                       "cache_write_tokens": 2000, "estimated": false});
    assert_eq!(v["spend"], spend);
    assert_eq!(v["members"], json!({"writer": spend}));
    let text = mur(&procs, &["job", "status", &run.run_id()]).await.stdout;
    assert!(text.contains("spend      $19.0000 (7000 in, 4000 cached, 2000 cache-write, 500 out)\n"), "{text}");

    let tasks = mur_nats::api::call::<mur_proto::page::Page<TaskRecord>>(&procs.client, api::TASK_LIST, "")
        .await
        .unwrap()
        .items;
    assert_eq!(tasks.len(), 1);
    let usage = tasks[0].usage.clone().expect("the terminal record carries usage");
    assert_eq!(
        (usage.input_tokens, usage.cached_tokens, usage.cache_write_tokens, usage.output_tokens),
        (7000, 4000, 2000, 500)
    );
    let trace = procs.trace_of(&tasks[0].task_id).await;
    let inference = trace.iter().find(|l| l["event_type"] == "inference").expect("an inference line");
    assert_eq!(
        (&inference["input_tokens_actual"], &inference["cached_tokens"], &inference["cache_write_tokens"]),
        (&json!(1000), &json!(4000), &json!(2000))
    );
}
