//! Issue #11 §Jobs that outlive their coordinator, with real processes: two coordinators
//! and a worker; the leader is killed with SIGKILL while a fleet run's step is working. The
//! standby takes the lease, finds the run's heartbeat stopped, and takes the run over: a
//! one-shot run's job is failed with the reason and the run ends `coordinator-lost`; a
//! loop is adopted (its in-flight job failed with the reason) and drains the rest of the
//! queue on the new leader. `mur job status` says so, and the client following the run
//! sees the end.

use mur_proto::cluster::{self, TaskRecord, api};
use mur_proto::task::TaskState;
use mur_tests::mur::Run;
use mur_tests::procs::{Proc, Procs, until};
use serde_json::Value;
use std::path::Path;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(60);

fn example(path: &str) -> String {
    mur_tests::mur::example(path).to_string_lossy().into_owned()
}

async fn mur(procs: &Procs, args: &[&str]) -> Run {
    procs.mur(args).await
}

/// Two coordinators (the first leading), one worker, the `builder` example fleet.
async fn cluster() -> (Procs, Proc, Proc, Proc) {
    let procs = Procs::start("jetstream:\n  ack_wait_secs: 3\n  leader_lease_secs: 2\n").await;
    let first = procs.coordinator("coordinator-1");
    let js = async_nats::jetstream::new(procs.client.clone());
    let leader = until("coordinator-1 leads", WAIT, || async {
        let kv = js.get_key_value(cluster::LEADER_BUCKET).await.ok()?;
        mur_coordinator::lease::Lease::holder(&kv).await.ok().flatten()
    })
    .await;
    assert_eq!(leader.instance, "coordinator-1");
    let second = procs.coordinator("coordinator-2");
    let worker = procs.worker("wkr-1", 2);
    procs.wait_workers(1).await;
    procs.push(Path::new(&example("examples/builder"))).await;
    let created = mur(&procs, &["fleet", "create", &example("examples/fleets/builder.yaml")]).await;
    assert_eq!(created.code, 0, "{created:?}");
    (procs, first, second, worker)
}

async fn send(procs: &Procs, text: &str) -> String {
    let sent = mur(procs, &["fleet", "send", "builder", text]).await;
    assert_eq!(sent.code, 0, "{sent:?}");
    sent.sent_job_id()
}

async fn job(procs: &Procs, id: &str) -> Value {
    let jobs = mur(procs, &["fleet", "jobs", "builder", "--all", "--json"]).await;
    let jobs: Value = serde_json::from_str(jobs.stdout.trim()).unwrap_or(Value::Null);
    jobs.as_array().and_then(|a| a.iter().find(|j| j["id"] == id).cloned()).unwrap_or(Value::Null)
}

/// Waits until `job` is running and its step's task is working on the worker.
async fn wait_step_working(procs: &Procs, job_id: &str) -> String {
    until("the job's step is working", WAIT, || async {
        let j = job(procs, job_id).await;
        if j["status"] != "running" {
            return None;
        }
        let tasks = mur_nats::api::call::<mur_proto::page::Page<TaskRecord>>(&procs.client, api::TASK_LIST, "")
            .await
            .ok()?
            .items;
        tasks.iter().any(|t| t.state == TaskState::Working).then(|| j["run_id"].as_str().unwrap().to_string())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_one_shot_runs_job_is_failed_with_the_reason_when_its_coordinator_is_killed() {
    let (procs, mut first, _second, _worker) = cluster().await;
    let job_id = send(&procs, "sleep 5 && echo slow").await;
    let client = {
        let mut cmd = procs.command();
        cmd.args(["fleet", "run", "builder"]);
        tokio::task::spawn_blocking(move || Run::of(&mut cmd))
    };
    let run_id = wait_step_working(&procs, &job_id).await;
    first.kill9();

    let failed = until("the orphaned job failed", WAIT, || async {
        let j = job(&procs, &job_id).await;
        (j["status"] == "failed").then_some(j)
    })
    .await;
    let reason = format!(
        "orphaned: coordinator-1 stopped while running run {run_id} (no heartbeat for 10 s); failed by coordinator-2"
    );
    assert_eq!(failed["error"].as_str(), Some(reason.as_str()));
    let followed = client.await.unwrap();
    assert_eq!(followed.code, 1, "{followed:?}");
    assert!(followed.stderr.contains(&format!("run {run_id} ended: coordinator-lost")), "{}", followed.stderr);
    let status = mur(&procs, &["job", "status", &run_id]).await;
    assert_eq!(status.code, 0, "{status:?}");
    for line in ["state      ended (coordinator-lost)\n", "liveness   over\n", "coordinator coordinator-2\n"] {
        assert!(status.stdout.contains(line), "{line:?} in\n{}", status.stdout);
    }
    assert!(status.stdout.contains(&format!("notice     {reason}\n")), "{}", status.stdout);
    let log = mur(&procs, &["fleet", "log", "builder"]).await.stdout;
    assert!(log.contains(&format!("system stop: run {run_id} stopped: coordinator-lost; {reason}")), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_loop_whose_coordinator_is_killed_is_adopted_by_the_new_leader_and_drains_the_queue() {
    let (procs, mut first, _second, _worker) = cluster().await;
    let slow = send(&procs, "sleep 5 && echo one").await;
    let next = send(&procs, "echo two").await;
    let client = {
        let mut cmd = procs.command();
        cmd.args(["fleet", "run", "builder", "--loop", "--deadline", "5m"]);
        tokio::task::spawn_blocking(move || Run::of(&mut cmd))
    };
    let iteration = wait_step_working(&procs, &slow).await;
    let run_id = iteration.strip_suffix("-0").expect("the loop's first iteration").to_string();
    first.kill9();

    let done = until("the next job done on the new leader", WAIT, || async {
        let j = job(&procs, &next).await;
        (j["status"] == "done").then_some(j)
    })
    .await;
    assert_eq!(done["run_id"].as_str(), Some(format!("{run_id}-1").as_str()));
    assert!(done["result"].as_str().unwrap().contains("two"), "{done}");
    let reason = format!(
        "orphaned: coordinator-1 stopped while running run {run_id} (no heartbeat for 10 s); \
         the loop was adopted by coordinator-2"
    );
    let orphaned = job(&procs, &slow).await;
    assert_eq!((orphaned["status"].as_str(), orphaned["error"].as_str()), (Some("failed"), Some(reason.as_str())));

    let followed = client.await.unwrap();
    assert_eq!(followed.code, 0, "{followed:?}");
    assert!(
        followed.stderr.contains(&format!("run {run_id} done (queue-drained) after 2 iterations")),
        "{}",
        followed.stderr
    );
    let v = mur(&procs, &["job", "status", &run_id, "--json"]).await.last_json();
    assert_eq!(
        (v["state"].as_str(), v["stop"].as_str(), v["coordinator"].as_str()),
        (Some("done"), Some("queue-drained"), Some("coordinator-2"))
    );
    let local = "fleet 'builder' runs on models with no price (local): it is bounded by its deadline 5m";
    assert_eq!(v["notices"], serde_json::json!([local, reason]));
    let log = mur(&procs, &["fleet", "log", "builder"]).await.stdout;
    assert!(log.contains(&format!("system state-change: run {run_id} adopted: {reason}")), "{log}");
}

/// A leader that only looked dead (SIGSTOP past the lease and the run's heartbeat) and
/// wakes after the standby adopted its loop leaves the run alone: the adopter's record
/// stands (completed, by coordinator-2) and the woken executor says it left. (One job
/// only: the adopter needs no task API call while the paused coordinator still holds its
/// share of the API's queue group.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_leader_that_wakes_after_its_loop_was_adopted_leaves_the_run_to_the_adopter() {
    let (procs, first, _second, _worker) = cluster().await;
    let slow = send(&procs, "sleep 4 && echo one").await;
    let client = {
        let mut cmd = procs.command();
        cmd.args(["fleet", "run", "builder", "--loop", "--deadline", "5m"]);
        tokio::task::spawn_blocking(move || Run::of(&mut cmd))
    };
    let iteration = wait_step_working(&procs, &slow).await;
    let run_id = iteration.strip_suffix("-0").expect("the loop's first iteration").to_string();
    first.pause();
    let followed = client.await.unwrap();
    assert_eq!(followed.code, 0, "{followed:?}");
    assert!(followed.stderr.contains("done (queue-drained) after 1 iteration"), "{}", followed.stderr);
    first.resume();
    until("the woken coordinator leaves the run", WAIT, || async {
        first.log().contains("another coordinator took the run over: leaving it").then_some(())
    })
    .await;
    let v = mur(&procs, &["job", "status", &run_id, "--json"]).await.last_json();
    assert_eq!(
        (v["state"].as_str(), v["stop"].as_str(), v["coordinator"].as_str(), v["iterations"].as_u64()),
        (Some("done"), Some("queue-drained"), Some("coordinator-2"), Some(1))
    );
    let orphaned = job(&procs, &slow).await;
    assert_eq!(orphaned["status"], "failed", "the woken executor did not end the job again: {orphaned}");
}
