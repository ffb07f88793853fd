//! Read-only calls and fleet iterations leave no JetStream consumers behind (issue #29
//! item 3): a flood of `cluster.status`, `task.list` and `fleet.jobs` requests while a
//! fleet loop iterates keeps the server's consumer count near its resting level, and no
//! request and no step fails. Before, each status request left three or four consumers
//! alive for ~30 s and each list one, until nats-server refused new ones.

use mur_proto::cluster::api;
use mur_proto::fleet_store::{self, JobsRequest};
use mur_tests::capsule::TestCapsule;
use mur_tests::mur::{Run, mur};
use mur_tests::sandbox::Sandbox;
use serde_json::Value;
use std::time::Instant;

/// How long the loop runs (and the flood goes on): short enough for a loaded 2-core
/// machine, long enough for a few hundred requests and many iterations.
const LOOP_SECS: u64 = 15;
/// Requests of each kind sent at once.
const AT_ONCE: usize = 4;
/// The most consumers above the resting level allowed at any sample: the run's own two
/// watches, and a few passes and permit waits in progress (measured: 4 above; before the
/// fix, 2,194 above).
const BOUND: usize = 8;

/// The consumers on the server now (every stream of the account).
async fn consumers(js: &async_nats::jetstream::Context) -> usize {
    js.query_account().await.expect("account info").consumers
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_status_flood_during_a_fleet_loop_leaves_no_consumers_behind_and_nothing_fails() {
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
    let resting = consumers(&js).await;

    let url = sb.nats.url();
    let run = tokio::task::spawn_blocking(move || {
        let deadline = format!("{LOOP_SECS}s");
        Run::of(mur().args(["fleet", "run", "spin", "--loop", "--deadline", &deadline]).env("NATS_URL", url))
    });
    let jobs = serde_json::to_vec(&JobsRequest { fleet: "spin".into(), all: true, ..JobsRequest::default() }).unwrap();
    let calls: [(&str, Vec<u8>); 3] =
        [(api::CLUSTER_STATUS, Vec::new()), (api::TASK_LIST, Vec::new()), (fleet_store::api::JOBS, jobs)];
    let (mut requests, mut most) = (0usize, resting);
    let started = Instant::now();
    while !run.is_finished() {
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
    }
    let elapsed = started.elapsed();
    let run = run.await.unwrap();
    // The loop ends at its deadline (exit 1), never on a failed step.
    assert_eq!(run.code, 1, "{run:?}");
    assert!(run.stderr.contains("ended: deadline"), "{}", run.stderr);
    let iterations: Value = serde_json::from_str(sb.fleet_ok(&["log", "spin", "--json"]).stdout.trim()).unwrap();
    let stop = iterations.as_array().unwrap().iter().rev().find(|e| e["kind"] == "stop").expect("a stop event");
    let iterations = stop["stop"]["iterations"].as_u64().unwrap();
    let tasks = sb.tasks().await;
    let failed: Vec<_> = tasks.iter().filter(|t| t.state != mur_proto::task::TaskState::Completed).collect();
    assert!(failed.is_empty(), "steps that did not complete: {failed:?}");
    eprintln!(
        "{requests} requests and {iterations} iterations ({} tasks) in {elapsed:?}: consumers at rest {resting}, at most \
         {most}, after {}",
        tasks.len(),
        consumers(&js).await
    );
    assert!(iterations >= 5, "{iterations} iterations");
    assert!(most <= resting + BOUND, "{most} consumers at one point, {resting} at rest");
    sb.shutdown().await;
}
