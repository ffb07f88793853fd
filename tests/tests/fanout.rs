//! The cluster-wide fan-out cap (issue #11 §The fan-out cap; the design's invariant 5): the
//! semaphore in `mur_fanout` against a real nats-server, and a chaos run of a real fleet
//! across real worker processes killed with SIGKILL.

use async_nats::jetstream::kv::{self, Operation};
use futures::StreamExt;
use mur_coordinator::{Settings, resources};
use mur_nats::fanout::{Error as FanoutError, Semaphore};
use mur_proto::TaskId;
use mur_proto::fanout::{FleetStep, Holder, SLOT_PREFIX, slot_key};
use mur_tests::capsule::shell_capsule;
use mur_tests::nats::NatsServer;
use mur_tests::procs::{Procs, until};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(120);

fn holder(task: &str, cap: u32) -> Holder {
    Holder {
        task_id: TaskId::unchecked(task),
        worker: format!("wkr-{task}"),
        step: FleetStep { fleet: "f".into(), run_id: "run-1".into(), step: task.into(), cap },
        since: 0,
    }
}

async fn semaphore(lease_secs: u64) -> (NatsServer, Semaphore, kv::Store) {
    let server = NatsServer::start();
    let js = server.jetstream().await;
    let settings = Settings { fanout_lease_secs: lease_secs, ..Settings::default() };
    let res = resources::ensure(&js, &settings).await.unwrap();
    let sem = Semaphore::open(&js).await.unwrap();
    assert_eq!(sem.lease(), Duration::from_secs(lease_secs));
    (server, sem, res.fanout)
}

/// A holder stalls past its lease (stops renewing), another step takes the permit, and
/// the first one's late renewal and release change nothing: never more than the cap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_stalled_past_its_lease_loses_the_permit_and_its_late_release_changes_nothing() {
    let (_server, sem, kv) = semaphore(2).await;
    let seen = mur_tests::permits::watch(kv.clone()).await;
    let never = CancellationToken::new();

    let stalled = sem.acquire(&holder("a", 1), &never).await.unwrap();
    assert_eq!(stalled.slot(), 0);
    let taken_at = Instant::now();
    // No keep-alive: `a` stalls. `b` waits in line, and gets the slot once `a`'s expires.
    let b = sem.acquire(&holder("b", 1), &never).await.unwrap();
    let waited = taken_at.elapsed();
    assert_eq!(b.slot(), 0);
    assert!(waited >= Duration::from_millis(1500), "b took the slot after {waited:?}, before a's lease ended");

    assert!(matches!(stalled.renew().await, Err(FanoutError::Lost(key)) if key == "slot.0"));
    assert!(stalled.lost().is_cancelled());
    assert!(!stalled.release().await.unwrap(), "a late release must not free b's permit");
    assert!(!stalled.release().await.unwrap(), "nor a repeated one");
    let entry = kv.entry(slot_key(0)).await.unwrap().unwrap();
    assert_eq!((entry.operation, entry.revision), (Operation::Put, b.revision()));

    // `c` waits while `b` holds the one permit, and gets it once `b` gives it back.
    let c = tokio::spawn({
        let sem = sem.clone();
        async move { sem.acquire(&holder("c", 1), &CancellationToken::new()).await }
    });
    until("c's ticket is in line", WAIT, || async { kv.get("wait.c").await.ok().flatten() }).await;
    b.renew().await.unwrap();
    assert!(b.release().await.unwrap());
    let c = c.await.unwrap().unwrap();
    assert_eq!(c.slot(), 0);
    assert!(c.release().await.unwrap());
    assert_eq!(seen.lock().unwrap().max_held, 1, "never more than the cap of 1");
}

/// Steps waiting for a permit are served in the order they came, and a cancelled wait
/// leaves the line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_steps_are_served_in_the_order_they_came_and_a_cancelled_one_leaves_the_line() {
    let (_server, sem, kv) = semaphore(10).await;
    let seen = mur_tests::permits::watch(kv.clone()).await;
    let never = CancellationToken::new();
    let first = sem.acquire(&holder("first", 2), &never).await.unwrap();
    let second = sem.acquire(&holder("second", 2), &never).await.unwrap();
    assert_eq!((first.slot(), second.slot()), (0, 1));

    // Each waiter reports what its wait ended with.
    let (served_tx, mut served) = tokio::sync::mpsc::unbounded_channel();
    let quitter = CancellationToken::new();
    for name in ["w1", "quitter", "w2", "w3"] {
        let sem = sem.clone();
        let tx = served_tx.clone();
        let cancel = if name == "quitter" { quitter.clone() } else { CancellationToken::new() };
        tokio::spawn(async move { tx.send((name, sem.acquire(&holder(name, 2), &cancel).await)).unwrap() });
        // The next waiter comes once this one's ticket is in line.
        let key = format!("wait.{name}");
        until(&format!("{name}'s ticket"), WAIT, || async { kv.get(&key).await.ok().flatten() }).await;
    }
    quitter.cancel();
    let (name, result) = tokio::time::timeout(WAIT, served.recv()).await.unwrap().unwrap();
    assert_eq!(name, "quitter");
    assert!(matches!(result, Err(FanoutError::Cancelled)));
    assert_eq!(kv.get("wait.quitter").await.unwrap(), None, "a cancelled wait leaves the line");

    let mut order = Vec::new();
    let mut held = vec![first, second];
    for _ in 0..3 {
        let oldest = held.remove(0);
        assert!(oldest.release().await.unwrap());
        let (name, permit) = tokio::time::timeout(WAIT, served.recv()).await.unwrap().unwrap();
        let permit = permit.unwrap();
        assert_eq!(permit.slot(), oldest.slot(), "the freed slot goes to the next in line");
        order.push(name);
        held.push(permit);
    }
    assert_eq!(order, ["w1", "w2", "w3"]);
    assert_eq!(seen.lock().unwrap().max_held, 2);
}

/// The chaos test: 20 delegated steps (two fleets of the same 10 members, one job
/// each, run at once) with a cap of 3 across 3 workers with 4 slots each, while a worker
/// holding a permit is killed twice. The permit count, sampled at every change, never
/// exceeds 3; every step finishes; each killed holder's permit comes back within its lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_steps_across_three_workers_never_hold_more_than_three_permits_while_workers_die() {
    let lease = Duration::from_secs(3);
    let cluster = Procs::start("jetstream:\n  ack_wait_secs: 3\n  fanout_lease_secs: 3\n").await;
    let _coordinator = cluster.coordinator("coordinator-1");
    let mut workers: Vec<_> = (1..=3).map(|n| cluster.worker(&format!("wkr-{n}"), 4)).collect();
    let members: Vec<String> = (0..10).map(|n| format!("m{n}")).collect();
    let mut capsules = Vec::new();
    for m in &members {
        let capsule = shell_capsule(m);
        cluster.push(capsule.dir()).await;
        capsules.push(capsule);
    }
    cluster.wait_workers(3).await;
    let js = async_nats::jetstream::new(cluster.client.clone());
    let kv = js.get_key_value(mur_proto::fanout::FANOUT_BUCKET).await.unwrap();
    let seen = mur_tests::permits::watch(kv.clone()).await;

    let dir = tempfile::tempdir().unwrap();
    let mur = |args: &[&str]| cluster.mur_sync(args);
    let mut runs = Vec::new();
    for name in ["east", "west"] {
        let yaml = dir.path().join(format!("{name}.yaml"));
        std::fs::write(&yaml, format!("name: {name}\ngoal: Work.\nmembers: [{}]\n", members.join(", "))).unwrap();
        mur(&["fleet", "create", yaml.to_str().unwrap()]);
        mur(&["fleet", "send", name, "sleep 2"]);
        let run = cluster
            .command()
            .args(["fleet", "run", name, "--json"])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        runs.push((name, run));
    }

    // `mur cluster status` and `mur fleet status` show the permits in use, their holders
    // and the steps waiting: 20 steps, 3 permits.
    let status = until("3 permits in use and steps waiting", WAIT, || async {
        let out = cluster.command().args(["cluster", "status", "--json"]).output().ok()?;
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
        (v["fanout"]["in_use"] == 3 && !v["fanout"]["waiting"].as_array()?.is_empty()).then_some(v)
    })
    .await;
    let holders = status["fanout"]["holders"].as_array().unwrap();
    assert_eq!(holders.iter().map(|h| h["slot"].as_u64().unwrap()).collect::<Vec<_>>(), [0, 1, 2]);
    assert!(holders.iter().all(|h| (h["fleet"] == "east" || h["fleet"] == "west") && h["cap"] == 3), "{status}");
    let waiting = status["fanout"]["waiting"].as_array().unwrap();
    assert!(waiting.iter().all(|w| w["task_id"].as_str().unwrap().starts_with("tsk_")), "{status}");
    let text = mur(&["fleet", "status", "east"]);
    assert!(text.contains("\npermits   "), "{text}");

    // Kill a worker while it holds a permit, twice; a fresh worker replaces each.
    let mut kills = Vec::new();
    for round in 0..2 {
        let (index, slot) = until("a worker holding a permit", WAIT, || {
            let seen = seen.clone();
            let workers = &workers;
            async move {
                let s = seen.lock().unwrap();
                s.held
                    .iter()
                    .find_map(|(slot, h)| workers.iter().position(|p| p.name == h.worker).map(|i| (i, slot.clone())))
            }
        })
        .await;
        let victim = workers[index].name.clone();
        workers[index].kill9();
        kills.push((Instant::now(), slot, victim));
        workers[index] = cluster.worker(&format!("wkr-new-{round}"), 4);
    }

    for (name, run) in runs {
        let run = tokio::task::spawn_blocking(move || run.wait_with_output()).await.unwrap().unwrap();
        assert!(run.status.success(), "run of {name} did not complete: {run:?}");
        // The live view (`--json`): the run, its milestones and status lines, then its end.
        let lines: Vec<serde_json::Value> =
            String::from_utf8_lossy(&run.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert_eq!(lines.first().unwrap()["type"], "run");
        let end = lines.last().unwrap();
        assert_eq!((end["type"].as_str(), end["state"].as_str()), (Some("end"), Some("done")), "{end}");
        let statuses: Vec<&serde_json::Value> = lines.iter().filter(|l| l["type"] == "status").collect();
        let most = statuses.iter().map(|s| s["permits_in_use"].as_u64().unwrap()).max().unwrap();
        // The spend is known from the first line on (the shell capsules' runs cost $0).
        assert!(statuses.iter().all(|s| s["spend_usd"] == 0.0), "{statuses:?}");
        assert!((1..=3).contains(&most), "the view showed {most} permits in use");
        assert!(
            statuses.iter().any(|s| s["members"].as_array().unwrap().iter().any(|m| m["state"] == "running")),
            "a member was seen running"
        );
        let last = statuses.last().unwrap()["members"].as_array().unwrap();
        assert_eq!(last.len(), 10);
        assert!(last.iter().all(|m| m["state"] == "done" && m["steps_done"] == 1), "{last:?}");
        assert!(lines.iter().any(|l| l["type"] == "event" && l["kind"] == "stop"));

        let jobs: serde_json::Value = serde_json::from_str(&mur(&["fleet", "jobs", name, "--all", "--json"])).unwrap();
        assert_eq!(jobs[0]["status"], "done", "{jobs}");
        let replies = mur(&["fleet", "log", name]);
        for m in &members {
            let done = replies.matches(&format!("member:{m} reply:")).count();
            assert_eq!(done, 1, "every step of {name} finished:\n{replies}");
        }
    }

    let s = seen.lock().unwrap();
    assert!(s.max_held <= 3, "{} permits were held at once", s.max_held);
    assert_eq!(s.max_held, 3, "the cap was reached: 20 steps compete for 3 permits");
    for (killed_at, slot, victim) in &kills {
        // The victim's permit is removed (expired) or taken by another step within its
        // lease of its last renewal; allow the server's expiry timer one second.
        let back = s
            .events
            .iter()
            .find(|(at, key, h)| at > killed_at && key == slot && h.as_ref().is_none_or(|h| &h.worker != victim));
        let (at, _, _) = back.unwrap_or_else(|| panic!("{victim}'s permit {slot} never came back"));
        let after = at.duration_since(*killed_at);
        assert!(after <= lease + Duration::from_secs(1), "{victim}'s permit came back {after:?} after the kill");
    }
    assert!(
        s.events.iter().all(|(_, key, _)| key.strip_prefix(SLOT_PREFIX).unwrap().parse::<u32>().unwrap() < 3),
        "only slots 0-2 exist with a cap of 3"
    );
}

/// A router capsule drives another fleet with the built-in tools (issue #11 §Agents drive
/// fleets too): its planning step starts fleet `inner` with `fleet_run` and waits for it
/// with `job_status`. The cap is 1 (`MUR_FLEET_FANOUT=1`) and the router's step holds the
/// one permit, so `inner`'s step can only run because a step that waits on another fleet
/// gives its permit back meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_starts_another_fleet_with_fleet_run_and_waits_for_it_with_job_status() {
    let mut cluster = Procs::start("jetstream:\n  ack_wait_secs: 5\n  fanout_lease_secs: 3\n").await;
    cluster.set_env("MUR_FLEET_FANOUT", "1");
    let _coordinator = cluster.coordinator("coordinator-1");
    let _workers = [cluster.worker("wkr-1", 4), cluster.worker("wkr-2", 4)];
    let chief = mur_tests::capsule::TestCapsule::new(
        "name: chief\nversion: 1.0.0\ninference:\n  driver: scripted\n  script: r.yaml\ntrace:\n  capture: content\n\
         tools:\n  - name: fleet_run\n    command: builtin:fleet_run\n  - name: job_status\n    command: builtin:job_status\n",
        &[(
            "r.yaml",
            "replies:\n  - tool_calls: [{ name: fleet_run, input: { fleet: inner, run_id: inner-run } }]\n\
             \x20 - tool_calls: [{ name: job_status, input: { run_id: inner-run, wait_secs: 90 } }]\n\
             \x20 - text: \"inner is done; everyone do the job\"\n",
        )],
    );
    let members: Vec<_> = ["a", "b", "c"].iter().map(|m| shell_capsule(m)).collect();
    cluster.push(chief.dir()).await;
    for m in &members {
        cluster.push(m.dir()).await;
    }
    cluster.wait_workers(2).await;
    let js = async_nats::jetstream::new(cluster.client.clone());
    let seen = mur_tests::permits::watch(js.get_key_value(mur_proto::fanout::FANOUT_BUCKET).await.unwrap()).await;

    let dir = tempfile::tempdir().unwrap();
    let boss = dir.path().join("boss.yaml");
    std::fs::write(&boss, "name: boss\ngoal: Lead.\nmembers: [a, b]\nrouter: chief\n").unwrap();
    let inner = dir.path().join("inner.yaml");
    std::fs::write(&inner, "name: inner\ngoal: Help.\nmembers: [c]\n").unwrap();
    let mur = |args: &[&str]| cluster.mur_sync(args);
    mur(&["fleet", "create", boss.to_str().unwrap()]);
    mur(&["fleet", "create", inner.to_str().unwrap()]);
    mur(&["fleet", "send", "inner", "echo inner-work"]);
    mur(&["fleet", "send", "boss", "echo outer-work"]);
    let run = cluster.command().args(["fleet", "run", "boss"]).output().unwrap();
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));

    // The inner run completed, and the router saw it completed.
    let inner_status: serde_json::Value =
        serde_json::from_str(&mur(&["job", "status", "inner-run", "--json"])).unwrap();
    assert_eq!((inner_status["state"].as_str(), inner_status["fleet"].as_str()), (Some("done"), Some("inner")));
    let inner_jobs: serde_json::Value =
        serde_json::from_str(&mur(&["fleet", "jobs", "inner", "--all", "--json"])).unwrap();
    assert_eq!(inner_jobs[0]["status"], "done");
    assert!(inner_jobs[0]["result"].as_str().unwrap().contains("inner-work"), "{inner_jobs}");

    let tasks = js.get_key_value(mur_proto::cluster::TASKS_BUCKET).await.unwrap();
    let mut keys = tasks.keys().await.unwrap();
    let mut chief_task = None;
    while let Some(Ok(key)) = keys.next().await {
        let record: mur_proto::cluster::TaskRecord =
            serde_json::from_slice(&tasks.get(&key).await.unwrap().unwrap()).unwrap();
        if record.capsule == "chief" {
            chief_task = Some(record);
        }
    }
    let chief_task = chief_task.expect("the router's planning task");
    assert_eq!(chief_task.state, mur_proto::task::TaskState::Completed, "{chief_task:?}");
    let step = chief_task.fleet_step.as_ref().unwrap();
    assert_eq!((step.fleet.as_str(), step.cap), ("boss", 1));
    let trace = cluster.trace_of(&chief_task.task_id).await;
    let calls: Vec<&serde_json::Value> = trace.iter().filter(|l| l["event_type"] == "tool_call").collect();
    assert_eq!(calls.len(), 2, "{trace:?}");
    let started: serde_json::Value = serde_json::from_str(calls[0]["output"].as_str().unwrap()).unwrap();
    assert_eq!(started["run_id"], "inner-run");
    let waited: serde_json::Value = serde_json::from_str(calls[1]["output"].as_str().unwrap()).unwrap();
    assert_eq!((waited["state"].as_str(), waited["liveness"]["verdict"].as_str()), (Some("done"), Some("over")));
    assert!(calls[1]["duration_ms"].as_u64().unwrap() < 60_000, "job_status waited for the run, not its time limit");
    assert_eq!(seen.lock().unwrap().max_held, 1, "the cap of 1 held throughout");
}
