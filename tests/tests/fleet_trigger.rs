//! Issue #10 §Runs and loops, unattended: `loop.trigger: interval:1s` fires on the leading
//! coordinator (started with `fleet.autorun: true` in its cluster config) with nobody
//! calling `mur fleet run`; a stopped fleet's trigger does not fire until it is started;
//! a fleet's triggered loops never overlap (one run per fleet at a time), each occurrence
//! that finds a run going is skipped on the channel (issue #36); `mur fleet trigger` fires
//! one occurrence with autorun off; a trigger pauses itself after failed runs in a row and
//! `mur fleet start` resumes it.

use mur_proto::fleet_store::{self, RunRecord};
use mur_tests::mur::Run;
use mur_tests::procs::{Procs, until};
use serde_json::Value;
use std::path::Path;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(60);

fn example(path: &str) -> String {
    mur_tests::mur::example(path).to_string_lossy().into_owned()
}

async fn mur(procs: &Procs, args: &[&str]) -> Run {
    procs.mur_ok(args).await
}

async fn job_status(procs: &Procs, fleet: &str, id: &str) -> Value {
    let jobs: Value =
        serde_json::from_str(mur(procs, &["fleet", "jobs", fleet, "--all", "--json"]).await.stdout.trim()).unwrap();
    jobs.as_array().unwrap().iter().find(|j| j["id"] == id).unwrap().clone()
}

/// Every run record of `fleet`, oldest first.
async fn runs_of(procs: &Procs, fleet: &str) -> Vec<RunRecord> {
    use futures::StreamExt;
    let js = async_nats::jetstream::new(procs.client.clone());
    let kv = js.get_key_value(fleet_store::FLEETS_BUCKET).await.unwrap();
    let keys: Vec<String> = kv.keys().await.unwrap().filter_map(|k| async { k.ok() }).collect().await;
    let mut runs = Vec::new();
    for key in keys.into_iter().filter(|k| k.starts_with("run.")) {
        if let Some(v) = kv.get(&key).await.unwrap()
            && let Ok(r) = serde_json::from_slice::<RunRecord>(&v)
            && r.fleet == fleet
        {
            runs.push(r);
        }
    }
    runs.sort_by_key(|r| r.started_at);
    runs
}

fn fleet_file(procs: &Procs, name: &str) -> String {
    fleet_file_with(procs, name, "")
}

/// A builder fleet triggered every second, with `extra` lines in its `loop:` block.
fn fleet_file_with(procs: &Procs, name: &str, extra: &str) -> String {
    let path = procs.dir().join(format!("{name}.yaml"));
    std::fs::write(
        &path,
        format!("name: {name}\nmembers: [builder]\nloop:\n  trigger: interval:1s\n  done_when: queue-empty\n{extra}"),
    )
    .unwrap();
    path.to_string_lossy().into_owned()
}

/// The texts of the fleet's channel events.
async fn channel(procs: &Procs, fleet: &str) -> Vec<String> {
    let log: Value = serde_json::from_str(mur(procs, &["fleet", "log", fleet, "--json"]).await.stdout.trim()).unwrap();
    log.as_array().unwrap().iter().map(|e| e["text"].as_str().unwrap_or_default().to_string()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_interval_trigger_fires_on_the_leader_not_while_stopped_and_never_overlaps_its_own_loop() {
    let procs = Procs::start("jetstream:\n  ack_wait_secs: 3\nfleet:\n  autorun: true\n").await;
    let _c = procs.coordinator("coordinator-1");
    let _w = procs.worker("wkr-1", 4);
    procs.wait_workers(1).await;
    procs.push(Path::new(&example("examples/builder"))).await;
    for name in ["ticker", "slow"] {
        mur(&procs, &["fleet", "create", &fleet_file(&procs, name)]).await;
    }
    // Nobody runs anything: the triggers do.
    let tick = mur(&procs, &["fleet", "send", "ticker", "echo tick-1"]).await.sent_job_id();
    let slow = mur(&procs, &["fleet", "send", "slow", "sleep 3 && echo slow-done"]).await.sent_job_id();
    let done = until("the ticker's job done by a triggered run", WAIT, || async {
        let j = job_status(&procs, "ticker", &tick).await;
        (j["status"] == "done").then_some(j)
    })
    .await;
    assert!(done["run_id"].as_str().unwrap().starts_with("fleet-ticker-"), "{done}");
    assert!(done["result"].as_str().unwrap().contains("tick-1"), "{done}");

    // The slow fleet's loop takes 3 s while its trigger is due every second: its runs,
    // started by the trigger one after another, never overlap.
    until("the slow job done and three more slow runs after it", WAIT, || async {
        let j = job_status(&procs, "slow", &slow).await;
        let runs = runs_of(&procs, "slow").await;
        (j["status"] == "done" && runs.len() >= 4 && runs.iter().all(RunRecord::is_over)).then_some(())
    })
    .await;
    let runs = runs_of(&procs, "slow").await;
    for pair in runs.windows(2) {
        let ended = pair[0].ended_at.expect("over");
        assert!(
            pair[1].started_at >= ended,
            "run {} started before {} ended: {runs:#?}",
            pair[1].run_id,
            pair[0].run_id
        );
    }
    assert_eq!(runs[0].stop.as_deref(), Some("queue-drained"));
    // The occurrences that came while the 3 s run went on were skipped, each said so.
    let skipped: Vec<String> = channel(&procs, "slow")
        .await
        .into_iter()
        .filter(|t| t.starts_with("trigger: occurrence ") && t.ends_with("is still going (loop.overlap: skip)"))
        .collect();
    assert!(!skipped.is_empty(), "no skipped occurrence on the channel");

    // Stopped: the ticker's trigger does not fire while the slow fleet's goes on.
    mur(&procs, &["fleet", "stop", "ticker"]).await;
    let settled = until("no ticker run in progress", WAIT, || async {
        let runs = runs_of(&procs, "ticker").await;
        runs.iter().all(RunRecord::is_over).then_some(runs.len())
    })
    .await;
    let queued = mur(&procs, &["fleet", "send", "ticker", "echo tick-2"]).await.sent_job_id();
    let before = runs_of(&procs, "slow").await.len();
    until("three more slow runs", WAIT, || async { (runs_of(&procs, "slow").await.len() >= before + 3).then_some(()) })
        .await;
    assert_eq!(runs_of(&procs, "ticker").await.len(), settled, "a stopped fleet's trigger fired");
    assert_eq!(job_status(&procs, "ticker", &queued).await["status"], "queued");

    // Started again: the trigger picks the job up.
    mur(&procs, &["fleet", "start", "ticker"]).await;
    until("the second ticker job done", WAIT, || async {
        (job_status(&procs, "ticker", &queued).await["status"] == "done").then_some(())
    })
    .await;
}

/// Autorun is off by default (ref §5, `MUR_FLEET_AUTORUN` / `fleet.autorun`): a leader
/// started without either does not fire a due trigger — a manual run of another fleet
/// that takes over two trigger periods ends with the triggered fleet's job still queued —
/// and the next leader, started with `fleet.autorun: true`, fires it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_trigger_does_not_fire_unless_autorun_is_on() {
    let procs = Procs::start("jetstream:\n  ack_wait_secs: 3\n  leader_lease_secs: 2\n").await;
    let mut first = procs.coordinator("coordinator-1");
    let _w = procs.worker("wkr-1", 4);
    procs.wait_workers(1).await;
    procs.push(Path::new(&example("examples/builder"))).await;
    mur(&procs, &["fleet", "create", &fleet_file(&procs, "ticker")]).await;
    mur(&procs, &["fleet", "create", &example("examples/fleets/builder.yaml")]).await;
    let queued = mur(&procs, &["fleet", "send", "ticker", "echo tick"]).await.sent_job_id();
    mur(&procs, &["fleet", "send", "builder", "sleep 2.5 && echo witness"]).await;
    let witness = mur(&procs, &["fleet", "run", "builder"]).await;
    assert!(witness.stderr.contains("done (converged) after 1 iteration"), "{witness:?}");
    assert_eq!(job_status(&procs, "ticker", &queued).await["status"], "queued");
    assert!(runs_of(&procs, "ticker").await.is_empty(), "no run without autorun");

    first.kill9();
    std::fs::write(
        procs.dir().join("config.yaml"),
        "jetstream:\n  ack_wait_secs: 3\n  leader_lease_secs: 2\nfleet:\n  autorun: true\n",
    )
    .unwrap();
    let _second = procs.coordinator("coordinator-2");
    until("the ticker's job done once autorun is on", WAIT, || async {
        // Until coordinator-2 serves the API, `mur fleet jobs` finds no responder.
        let mut cmd = procs.command();
        cmd.args(["fleet", "jobs", "ticker", "--all", "--json"]);
        let jobs = tokio::task::spawn_blocking(move || Run::of(&mut cmd)).await.unwrap();
        let jobs: Value = serde_json::from_str(jobs.stdout.trim()).ok()?;
        jobs.as_array()?.iter().any(|j| j["id"] == queued.as_str() && j["status"] == "done").then_some(())
    })
    .await;
}

/// Issue #36: `mur fleet trigger NAME` fires one occurrence now, even with autorun off (the
/// leader's trigger takes it and starts a loop run under the id it claimed), and says
/// which run it started.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mur_fleet_trigger_fires_one_occurrence_now_with_autorun_off() {
    let procs = Procs::start("jetstream:\n  ack_wait_secs: 3\n").await;
    let _c = procs.coordinator("coordinator-1");
    let _w = procs.worker("wkr-1", 4);
    procs.wait_workers(1).await;
    procs.push(Path::new(&example("examples/builder"))).await;
    mur(&procs, &["fleet", "create", &fleet_file(&procs, "ticker")]).await;
    let queued = mur(&procs, &["fleet", "send", "ticker", "echo by-hand"]).await.sent_job_id();
    let fired = mur(&procs, &["fleet", "trigger", "ticker"]).await;
    let run = fired.stdout.trim().strip_prefix("triggered fleet ticker: run ").expect("a run started").to_string();
    assert!(run.starts_with("fleet-ticker-"), "{fired:?}");
    let done = until("the job done by the triggered run", WAIT, || async {
        let j = job_status(&procs, "ticker", &queued).await;
        (j["status"] == "done").then_some(j)
    })
    .await;
    assert!(done["run_id"].as_str().unwrap().starts_with(&run), "{done}");
    let runs = runs_of(&procs, "ticker").await;
    assert_eq!(runs.iter().map(|r| r.run_id.as_str()).collect::<Vec<_>>(), [run.as_str()], "exactly one run");
    // A stopped fleet is refused.
    mur(&procs, &["fleet", "stop", "ticker"]).await;
    let refused = procs.mur(&["fleet", "trigger", "ticker"]).await;
    assert_eq!(refused.code, 2, "{refused:?}");
    assert!(refused.stderr.contains("fleet 'ticker' is stopped (`mur fleet start ticker` clears it)"), "{refused:?}");
}

/// Issue #36: `loop.pause_after_failures: 2` — two triggered runs that fail in a row (each
/// outlives its 2 s deadline: a run ended `deadline` is `failed`) pause
/// the trigger (the channel and `mur fleet status` say so, and the third job stays queued
/// while the trigger would fire every second); `mur fleet start` resumes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_trigger_pauses_after_failed_runs_in_a_row_and_start_resumes_it() {
    let procs = Procs::start("jetstream:\n  ack_wait_secs: 3\nfleet:\n  autorun: true\n").await;
    let _c = procs.coordinator("coordinator-1");
    let _w = procs.worker("wkr-1", 4);
    procs.wait_workers(1).await;
    procs.push(Path::new(&example("examples/builder"))).await;
    // Stopped while the jobs are queued, so the first run finds all three.
    let file = fleet_file_with(&procs, "flaky", "  pause_after_failures: 2\n");
    std::fs::write(&file, std::fs::read_to_string(&file).unwrap() + "limits:\n  deadline: 2s\n").unwrap();
    mur(&procs, &["fleet", "create", &file]).await;
    mur(&procs, &["fleet", "stop", "flaky"]).await;
    let jobs: Vec<String> = {
        let mut ids = Vec::new();
        for n in 1..=3 {
            ids.push(
                mur(&procs, &["fleet", "send", "flaky", &format!("sleep 30 && echo late-{n}")]).await.sent_job_id(),
            );
        }
        ids
    };
    mur(&procs, &["fleet", "start", "flaky"]).await;
    let paused = until("the trigger paused", WAIT, || async {
        channel(&procs, "flaky").await.into_iter().find(|t| t.starts_with("trigger: trigger paused"))
    })
    .await;
    assert_eq!(
        paused,
        "trigger: trigger paused after 2 failed runs in a row (loop.pause_after_failures); `mur fleet start` resumes it"
    );
    let runs = runs_of(&procs, "flaky").await;
    assert_eq!(runs.len(), 2, "{runs:#?}");
    assert!(runs.iter().all(|r| r.state == "failed" && r.stop.as_deref() == Some("deadline")), "{runs:#?}");
    // A manual run of another fleet that takes over two trigger periods: the paused one
    // starts nothing meanwhile.
    mur(&procs, &["fleet", "create", &example("examples/fleets/builder.yaml")]).await;
    mur(&procs, &["fleet", "send", "builder", "sleep 2.5 && echo witness"]).await;
    mur(&procs, &["fleet", "run", "builder"]).await;
    assert_eq!(runs_of(&procs, "flaky").await.len(), 2, "a paused trigger fired");
    assert_eq!(job_status(&procs, "flaky", &jobs[2]).await["status"], "queued");
    let status = procs.mur(&["fleet", "status", "flaky"]).await;
    assert!(status.stdout.contains("after 2 failed runs in a row: `mur fleet start flaky` resumes it"), "{status:?}");
    // Resumed: the trigger takes the third job.
    let started = mur(&procs, &["fleet", "start", "flaky"]).await;
    assert!(started.stdout.contains("pauses after 2 failed runs in a row (0 so far)"), "{started:?}");
    until("the third job taken after the resume", WAIT, || async {
        (job_status(&procs, "flaky", &jobs[2]).await["status"] != "queued").then_some(())
    })
    .await;
}
