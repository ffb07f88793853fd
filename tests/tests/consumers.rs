//! Read-only calls and fleet iterations leave no JetStream consumers behind (issue #29
//! item 3): a flood of `cluster.status`, `task.list` and `fleet.jobs` requests while a
//! fleet loop runs 2,000 iterations keeps the server's consumer count near its resting
//! level, and no request and no step fails. Before, each status request left three or four
//! consumers alive for ~30 s and each list one, until nats-server refused new ones.

use mur_proto::cluster::{TaskRecord, api};
use mur_proto::fleet_store::{self, JobsRequest, RunRecord};
use mur_proto::task::TaskState;
use mur_tests::capsule::TestCapsule;
use mur_tests::mur::{Run, mur};
use mur_tests::sandbox::Sandbox;
use serde_json::Value;
use std::time::{Duration, Instant};

/// The iterations the loop runs before the test stops it (the count).
const ITERATIONS: u64 = 2_000;
/// Requests of each kind sent in one round of the flood.
const AT_ONCE: usize = 2;
/// One round of the flood starts this often (a round that takes longer is followed at
/// once): 3 kinds × [`AT_ONCE`] every 100 ms is the 60 requests a second at which 1,333
/// of 3,331 requests failed before, each status request leaving 3 consumers and each list
/// one for ~30 s (~2,400 at once, past the server's 1,000 a stream).
const ROUND_EVERY: Duration = Duration::from_millis(100);
/// The most consumers above the resting level allowed at any sample: the run's follower's
/// two watches, and a few passes and permit waits in progress (measured: 4 and 5 above; before
/// the fix, 2,194 above).
const BOUND: usize = 8;
/// The longest the whole run may take (2,000 iterations took ~97 s on a loaded 2-core
/// machine in a debug build).
const PATIENCE: Duration = Duration::from_secs(300);

/// The consumers on the server now (every stream of the account).
async fn consumers(js: &async_nats::jetstream::Context) -> usize {
    js.query_account().await.expect("account info").consumers
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_status_flood_during_2000_fleet_iterations_leaves_no_consumers_behind_and_nothing_fails() {
    let sb = Sandbox::start(1, 2).await;
    let member = TestCapsule::new(
        "name: spinner\nversion: 1.0.0\ninference:\n  driver: scripted\n  script: r.yaml\n",
        &[("r.yaml", "replies:\n  - text: \"{{task}}\"\n")],
    );
    sb.push(member.dir()).await;
    let dir = tempfile::tempdir().unwrap();
    let yaml = dir.path().join("spin.yaml");
    std::fs::write(&yaml, "name: spin\ngoal: Spin.\nmembers: [spinner]\nloop:\n  done_when: \"marker:NEVER\"\n")
        .unwrap();
    sb.fleet_ok(&["create", yaml.to_str().unwrap()]);
    let js = async_nats::jetstream::new(sb.client.clone());
    let defs = js.get_key_value(fleet_store::FLEETS_BUCKET).await.unwrap();
    let resting = consumers(&js).await;

    let url = sb.nats.url();
    let run = tokio::task::spawn_blocking(move || {
        Run::of(
            mur()
                .args(["fleet", "run", "spin", "--loop", "--deadline", "10m", "--run-id", "spin-flood"])
                .env("NATS_URL", url),
        )
    });
    let jobs = serde_json::to_vec(&JobsRequest { fleet: "spin".into(), all: true, ..JobsRequest::default() }).unwrap();
    let calls: [(&str, Vec<u8>); 3] =
        [(api::CLUSTER_STATUS, Vec::new()), (api::TASK_LIST, Vec::new()), (fleet_store::api::JOBS, jobs)];
    let (mut requests, mut most, mut stopped) = (0usize, resting, false);
    let started = Instant::now();
    let mut rounds = tokio::time::interval(ROUND_EVERY);
    rounds.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while !run.is_finished() {
        assert!(started.elapsed() < PATIENCE, "{ITERATIONS} iterations not run within {PATIENCE:?}");
        rounds.tick().await;
        let client = &sb.client;
        let round = calls.iter().flat_map(|(subject, body)| {
            (0..AT_ONCE).map(move |_| mur_nats::api::call::<Value>(client, subject, body.clone()))
        });
        for (i, answer) in futures::future::join_all(round).await.into_iter().enumerate() {
            if let Err(e) = answer {
                panic!("request {} ({}) failed: {e}", requests + i, calls[i / AT_ONCE].0);
            }
        }
        requests += calls.len() * AT_ONCE;
        most = most.max(consumers(&js).await);
        let iterations = match defs.get(fleet_store::run_key("spin-flood")).await.unwrap() {
            Some(v) => serde_json::from_slice::<RunRecord>(&v).unwrap().iterations,
            None => 0,
        };
        if !stopped && iterations >= ITERATIONS {
            // Drained: the step under way finishes, no iteration starts after it.
            sb.fleet_ok(&["stop", "spin", "--drain"]);
            stopped = true;
        }
    }
    let elapsed = started.elapsed();
    let run = run.await.unwrap();
    assert!(stopped, "the run ended before {ITERATIONS} iterations: {run:?}");
    // Ended by the stop (exit 1), never on a failed step.
    assert_eq!(run.code, 1, "{run:?}");
    assert!(run.stderr.contains("ended: stopped"), "{}", run.stderr);
    let record: RunRecord =
        serde_json::from_slice(&defs.get(fleet_store::run_key("spin-flood")).await.unwrap().unwrap()).unwrap();
    // Every step's record (task.list answers the newest 1,000 only).
    let (mut steps, mut failed) = (0, Vec::new());
    let tasks = js.get_key_value(mur_proto::cluster::TASKS_BUCKET).await.unwrap();
    mur_nats::read::latest(&tasks, ">", |entry| {
        let t: TaskRecord = serde_json::from_slice(&entry.value).unwrap();
        steps += 1;
        if t.state != TaskState::Completed {
            failed.push(t);
        }
    })
    .await
    .unwrap();
    assert!(failed.is_empty(), "steps that did not complete: {failed:?}");
    assert_eq!(steps, record.iterations, "one step an iteration");
    eprintln!(
        "{requests} requests and {} iterations in {elapsed:?}: consumers at rest {resting}, at most {most}, after {}",
        record.iterations,
        consumers(&js).await
    );
    assert!(record.iterations >= ITERATIONS, "{} iterations", record.iterations);
    assert!(most <= resting + BOUND, "{most} consumers at one point, {resting} at rest");
    sb.shutdown().await;
}

/// The server's consumers, `stream/name (description)`.
async fn consumer_list(js: &async_nats::jetstream::Context) -> std::collections::BTreeSet<String> {
    use futures::StreamExt;
    let mut out = std::collections::BTreeSet::new();
    let mut streams = js.stream_names();
    while let Some(Ok(name)) = streams.next().await {
        let Ok(stream) = js.get_stream(&name).await else { continue };
        let mut infos = stream.consumers();
        while let Some(Ok(info)) = infos.next().await {
            out.insert(format!("{name}/{} ({})", info.name, info.config.description.unwrap_or_default()));
        }
    }
    out
}

/// Asserts that within 5 s (a consumer left behind lives 30 s) the server has no consumer
/// that was not there at `baseline`, and so no more than then (the setup's own may have
/// expired meanwhile); names those left when it does not.
async fn back_to(js: &async_nats::jetstream::Context, baseline: &std::collections::BTreeSet<String>, after: &str) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let now = consumer_list(js).await;
        let new: Vec<&String> = now.difference(baseline).collect();
        if new.is_empty() {
            assert!(consumers(js).await <= baseline.len(), "after {after}: {now:#?}");
            return;
        }
        assert!(Instant::now() < deadline, "after {after}, consumers left: {new:#?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The text of an MCP tool call's result; panics on a tool error.
async fn tool(client: &rmcp::service::RunningService<rmcp::RoleClient, ()>, name: &'static str, args: Value) -> String {
    let Value::Object(args) = args else { panic!("arguments are an object") };
    let mut params = rmcp::model::CallToolRequestParams::new(name);
    params.arguments = Some(args);
    let result = client.peer().call_tool(params).await.unwrap_or_else(|e| panic!("{name}: {e}"));
    let text: String = result
        .content
        .iter()
        .filter_map(|c| match c {
            rmcp::model::ContentBlock::Text(t) => Some(t.text.clone()),
            _ => None,
        })
        .collect();
    assert_ne!(result.is_error, Some(true), "{name}: {text}");
    text
}

/// The commands that follow something live — `mur task send --wait`, `mur fleet run`
/// (and `mur trace steps --server`, which reads a session back in one pass)
/// (its task and permit watches), the MCP server's `task_send` with `wait` and
/// `job_status` with `wait_secs` (the fleet tools' watch of a run's record, which a
/// capsule's fleet tools share), and the coordinator's A2A stream of a task — leave the
/// server's consumer count where it was once they end. Each left its watch's consumer on
/// the server for ~30 s (issue #29 item 3).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn commands_that_watch_leave_the_consumer_count_at_its_baseline_when_they_end() {
    use rmcp::ServiceExt;
    let sb = Sandbox::start(1, 2).await;
    let member = TestCapsule::new(
        "name: echo\nversion: 1.0.0\ninference:\n  driver: scripted\n  script: r.yaml\n",
        &[("r.yaml", "replies:\n  - text: \"echo {{task}}\"\n    delay_ms: 300\n")],
    );
    sb.push(member.dir()).await;
    let dir = tempfile::tempdir().unwrap();
    let yaml = dir.path().join("once.yaml");
    std::fs::write(&yaml, "name: once\ngoal: Say it.\nmembers: [echo]\n").unwrap();
    sb.fleet_ok(&["create", yaml.to_str().unwrap()]);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let stop = tokio_util::sync::CancellationToken::new();
    let (nats, stopped) = (sb.client.clone(), stop.clone());
    let served = tokio::spawn(async move {
        mur_coordinator::http::serve(nats, listener, async move { stopped.cancelled().await }).await
    });
    let js = async_nats::jetstream::new(sb.client.clone());
    // The worker fetches the capsule's bundle first (an object store read, whose consumer
    // lives on: once per bundle and worker, the bundle is cached on disk).
    let first = sb.submit("echo", "warm", mur_proto::task::Origin::User).await;
    sb.wait_all(&[first], Duration::from_secs(30)).await;
    let baseline = consumer_list(&js).await;

    let url = sb.nats.url();
    let sent = tokio::task::spawn_blocking(move || {
        Run::of(mur().args(["task", "send", "--wait", "echo", "hi"]).env("NATS_URL", url))
    })
    .await
    .unwrap();
    assert_eq!(sent.code, 0, "{sent:?}");
    back_to(&js, &baseline, "mur task send --wait").await;
    // Its session read back from the trace stream (a one-pass read).
    let url = sb.nats.url();
    let steps =
        tokio::task::spawn_blocking(move || Run::of(mur().args(["trace", "steps", "--json", "--server", &url])))
            .await
            .unwrap();
    assert_eq!(steps.code, 0, "{steps:?}");
    assert_eq!(serde_json::from_str::<Value>(&steps.stdout).unwrap()["turns"], 1, "{steps:?}");
    back_to(&js, &baseline, "mur trace steps --server").await;

    let run = sb.fleet_blocking(&["run", "once"]).await;
    assert_eq!(run.code, 0, "{run:?}");
    back_to(&js, &baseline, "mur fleet run").await;

    let transport = rmcp::transport::StreamableHttpClientTransport::from_uri(format!("{base}/mcp"));
    let mcp = ().serve(transport).await.expect("initialize over HTTP");
    let waited = tool(&mcp, "task_send", serde_json::json!({"capsule": "echo", "text": "mcp", "wait": true})).await;
    assert!(waited.contains("echo mcp"), "{waited}");
    back_to(&js, &baseline, "the MCP task_send with wait").await;
    let runs = tool(&mcp, "fleet_run", serde_json::json!({"fleet": "once"})).await;
    let run_id = serde_json::from_str::<Value>(&runs).unwrap()["run_id"].as_str().unwrap().to_string();
    let status = tool(&mcp, "job_status", serde_json::json!({"run_id": run_id, "wait_secs": 60})).await;
    assert!(!status.contains("\"running\""), "{status}");
    back_to(&js, &baseline, "the MCP job_status with wait_secs").await;
    mcp.cancel().await.unwrap();

    let a2a = mur_a2a::client::Client::new(format!("{base}/capsules/echo/"));
    let options = mur_a2a::client::SendOptions::default();
    let events: Vec<_> = futures::StreamExt::collect(a2a.send_streaming("streamed", &options).await.unwrap()).await;
    assert!(events.len() > 1, "{events:?}");
    back_to(&js, &baseline, "an A2A stream").await;

    stop.cancel();
    served.await.unwrap().unwrap();
    sb.shutdown().await;
}
