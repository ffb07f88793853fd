//! Adversarial tests of the cluster-wide fan-out cap (issue #11 §The fan-out cap): real
//! worker processes stopped with SIGSTOP past their lease, steps cancelled or out of time
//! while they wait for a permit or hold one, and hostile `fleet_step` values submitted over
//! the NATS API.

use async_nats::jetstream::kv::{self, Operation};
use futures::StreamExt;
use mur_nats::clock::{Clock, SystemClock};
use mur_proto::TaskId;
use mur_proto::cluster::{SubmitReply, TaskRecord, api};
use mur_proto::fanout::{Holder, slot_key, wait_key};
use mur_proto::task::{ExitStatus, TaskState};
use mur_tests::capsule::shell_capsule;
use mur_tests::procs::{Proc, Procs, until};
use std::time::{Duration, Instant};

const WAIT: Duration = Duration::from_secs(120);

/// A cluster of one coordinator and one worker `worker` with `slots` slots, with the shell
/// capsule `m` pushed (its task's text is run as a shell command); `config` is the cluster
/// config.
async fn with_member_m(config: &str, worker: &str, slots: u32) -> (Procs, Proc, Proc) {
    let cluster = Procs::start(config).await;
    let coordinator = cluster.coordinator("coordinator-1");
    let worker = cluster.worker(worker, slots);
    let capsule = shell_capsule("m");
    cluster.push(capsule.dir()).await;
    cluster.wait_workers(1).await;
    (cluster, coordinator, worker)
}

/// How many run records `mur_fleets` holds.
async fn run_records(cluster: &Procs) -> usize {
    let js = async_nats::jetstream::new(cluster.client.clone());
    let defs = js.get_key_value(mur_proto::fleet_store::FLEETS_BUCKET).await.unwrap();
    defs.keys()
        .await
        .unwrap()
        .filter(|k| std::future::ready(k.as_ref().is_ok_and(|k| k.starts_with("run."))))
        .count()
        .await
}

/// Submits the raw JSON `body` over the NATS API (retrying while no coordinator answers);
/// the reply, or the service's refusal.
async fn submit_raw(cluster: &Procs, body: serde_json::Value) -> Result<String, mur_proto::cluster::ApiError> {
    let bytes = serde_json::to_vec(&body).unwrap();
    until("a coordinator answers the submission", Duration::from_secs(30), || async {
        match mur_nats::api::call::<SubmitReply>(&cluster.client, api::TASK_SUBMIT, bytes.clone()).await {
            Ok(r) => Some(Ok(r.task_id.into_string())),
            Err(e) if e.code == mur_proto::cluster::ErrorCode::Unavailable => None,
            Err(e) => Some(Err(e)),
        }
    })
    .await
}

/// A delegated step of capsule `m` running `text` with fan-out cap `cap`.
async fn step(cluster: &Procs, text: &str, cap: serde_json::Value, deadline_at: Option<u64>) -> String {
    let mut body = serde_json::json!({
        "capsule": "m", "text": text, "origin": "peer",
        "fleet_step": { "fleet": "f", "run_id": "r-0", "step": "m", "cap": cap },
    });
    if let Some(at) = deadline_at {
        body["deadline_at"] = at.into();
    }
    submit_raw(cluster, body).await.expect("the step is accepted")
}

async fn fanout_kv(cluster: &Procs) -> kv::Store {
    let js = async_nats::jetstream::new(cluster.client.clone());
    until("the fan-out bucket exists", Duration::from_secs(30), || async {
        js.get_key_value(mur_proto::fanout::FANOUT_BUCKET).await.ok()
    })
    .await
}

/// Whether `key` holds a live value.
async fn live(kv: &kv::Store, key: &str) -> bool {
    matches!(kv.entry(key).await, Ok(Some(e)) if e.operation == Operation::Put)
}

fn terminal(r: &TaskRecord) -> bool {
    r.state.is_terminal()
}

/// A worker stopped (SIGSTOP) while its step holds the one permit loses it when the lease
/// ends; another step takes it. Woken (SIGCONT), the first worker must stop its step and
/// write no end for it (its renewal finds the permit lost): the step runs again once it
/// holds a permit and ends `completed`, never `canceled`. The count never exceeds 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_stopped_past_its_lease_writes_no_end_and_its_step_still_completes() {
    let (cluster, _coordinator, stalled) =
        with_member_m("jetstream:\n  ack_wait_secs: 60\n  fanout_lease_secs: 2\n", "wkr-stalled", 1).await;
    let kv = fanout_kv(&cluster).await;
    let seen = mur_tests::permits::watch(kv.clone()).await;

    let a = step(&cluster, "sleep 6; echo a-done", 1.into(), None).await;
    cluster.wait_record(&a, WAIT, |r| r.state == TaskState::Working).await;
    until("a holds the permit", WAIT, || async {
        (seen.lock().unwrap().held.get("slot.0").map(|h| &h.task_id) == Some(&TaskId::unchecked(&a))).then_some(())
    })
    .await;
    stalled.pause();
    // The lease ends; the permit expires.
    until("a's permit expires", WAIT, || async { (!live(&kv, &slot_key(0)).await).then_some(()) }).await;
    // Another worker and step take it meanwhile.
    let _other = cluster.worker("wkr-other", 1);
    let b = step(&cluster, "echo b-done", 1.into(), None).await;
    let b = cluster.wait_record(&b, WAIT, terminal).await;
    assert_eq!(b.exit_status, Some(ExitStatus::Ok), "{b:?}");
    stalled.resume();

    let a = cluster.wait_record(&a, WAIT, terminal).await;
    assert_eq!((a.state, a.exit_status), (TaskState::Completed, Some(ExitStatus::Ok)), "{a:?}\n{}", stalled.log());
    assert!(stalled.log().contains("fan-out permit lost"), "{}", stalled.log());
    assert_eq!(seen.lock().unwrap().max_held, 1, "never more than the cap of 1");
}

/// Cancelling a step that waits for a permit removes its ticket and ends it `canceled`;
/// cancelling the step that holds the permit gives it back at once (well within its 30 s
/// lease) and ends it `canceled`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_a_waiting_step_and_a_holding_step_ends_both_canceled_and_frees_the_permit_at_once() {
    let (cluster, _coordinator, _worker) =
        with_member_m("jetstream:\n  ack_wait_secs: 30\n  fanout_lease_secs: 30\n", "wkr-1", 2).await;
    let kv = fanout_kv(&cluster).await;

    let holder = step(&cluster, "sleep 60", 1.into(), None).await;
    cluster.wait_record(&holder, WAIT, |r| r.state == TaskState::Working).await;
    let waiter = step(&cluster, "echo never", 1.into(), None).await;
    until("the waiter's ticket", WAIT, || async {
        live(&kv, &wait_key(&TaskId::unchecked(&waiter))).await.then_some(())
    })
    .await;
    let cancel = |id: &str| {
        let out = cluster.command().args(["task", "cancel", id]).output().unwrap();
        assert!(out.status.success(), "mur task cancel {id}: {}", String::from_utf8_lossy(&out.stderr));
    };

    cancel(&waiter);
    let w = cluster.wait_record(&waiter, WAIT, terminal).await;
    assert_eq!((w.state, w.exit_status), (TaskState::Canceled, Some(ExitStatus::Canceled)), "{w:?}");
    until("the waiter's ticket is gone", WAIT, || async {
        (!live(&kv, &wait_key(&TaskId::unchecked(&waiter))).await).then_some(())
    })
    .await;

    assert!(live(&kv, &slot_key(0)).await, "the holder still holds its permit");
    let asked = Instant::now();
    cancel(&holder);
    let h = cluster.wait_record(&holder, WAIT, terminal).await;
    assert_eq!((h.state, h.exit_status), (TaskState::Canceled, Some(ExitStatus::Canceled)), "{h:?}");
    until("the permit is back", WAIT, || async { (!live(&kv, &slot_key(0)).await).then_some(()) }).await;
    let freed = asked.elapsed();
    assert!(freed < Duration::from_secs(15), "the permit came back {freed:?} after the cancel, not at once");
}

/// A step whose deadline passes while it waits for a permit ends `deadline_exceeded`, and
/// its ticket leaves the line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_whose_deadline_passes_while_it_waits_ends_deadline_exceeded_without_a_ticket() {
    let (cluster, _coordinator, _worker) =
        with_member_m("jetstream:\n  ack_wait_secs: 30\n  fanout_lease_secs: 30\n", "wkr-1", 2).await;
    let kv = fanout_kv(&cluster).await;

    let holder = step(&cluster, "sleep 60", 1.into(), None).await;
    cluster.wait_record(&holder, WAIT, |r| r.state == TaskState::Working).await;
    let late = step(&cluster, "echo never", 1.into(), Some(SystemClock.now_ms() + 3_000)).await;
    until("the late step's ticket", WAIT, || async {
        live(&kv, &wait_key(&TaskId::unchecked(&late))).await.then_some(())
    })
    .await;
    let r = cluster.wait_record(&late, WAIT, terminal).await;
    let ended = Instant::now();
    assert_eq!((r.state, r.exit_status), (TaskState::Failed, Some(ExitStatus::DeadlineExceeded)), "{r:?}");
    assert_eq!(r.started_at, None, "it never started");
    // The ticket leaves the line with the step, not a 30 s lease later: while it stays it
    // keeps its place, and a freed permit would wait for it.
    until("the ticket is gone", WAIT, || async {
        (!live(&kv, &wait_key(&TaskId::unchecked(&late))).await).then_some(())
    })
    .await;
    let gone = ended.elapsed();
    assert!(gone < Duration::from_secs(5), "the ticket stayed {gone:?} after the step ended");
}

/// A hostile `fleet_step.cap` (the largest u32, or a huge `fanout:`) must neither take the
/// worker down nor stall the line: the semaphore computes the slots to try without
/// materialising `0..cap`. Both the huge-cap step and a cap-1 step behind it complete.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_with_the_largest_cap_runs_and_does_not_take_down_the_worker() {
    let cluster = Procs::start("jetstream:\n  ack_wait_secs: 30\n  fanout_lease_secs: 10\n").await;
    let _coordinator = cluster.coordinator("coordinator-1");
    let mut worker = cluster.worker("wkr-1", 2);
    let capsule = shell_capsule("m");
    cluster.push(capsule.dir()).await;
    cluster.wait_workers(1).await;

    let big = step(&cluster, "echo big", u32::MAX.into(), None).await;
    let small = step(&cluster, "echo small", 1.into(), None).await;
    for id in [&big, &small] {
        let r = cluster.wait_record(id, WAIT, terminal).await;
        assert_eq!(r.exit_status, Some(ExitStatus::Ok), "{r:?}\n{}", worker.log());
    }
    assert!(worker.is_running(), "{}", worker.log());
}

/// Bad `fleet_step` values over the NATS API are refused naming the field, and no task is
/// stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_fleet_steps_over_the_nats_api_are_refused_naming_the_field_and_nothing_is_stored() {
    let cluster = Procs::start("jetstream:\n  ack_wait_secs: 30\n").await;
    let _coordinator = cluster.coordinator("coordinator-1");
    let base = |step: serde_json::Value| serde_json::json!({ "capsule": "m", "text": "t", "fleet_step": step });
    let cases = [
        (base(serde_json::json!({ "fleet": "f", "run_id": "r", "step": "s", "cap": 0 })), "fleet_step.cap"),
        (base(serde_json::json!({ "fleet": "f", "run_id": "r", "step": "s", "cap": "3" })), "fleet_step"),
        (base(serde_json::json!({ "fleet": "f", "run_id": "r", "step": "s", "cap": -1 })), "fleet_step"),
        (base(serde_json::json!({ "fleet": "f", "run_id": "r", "step": "s" })), "fleet_step"),
        (base(serde_json::json!("f")), "fleet_step"),
        (base(serde_json::json!({ "fleet": "f", "run_id": "r", "step": "s", "cap": 3, "capp": 9 })), "fleet_step.capp"),
        (base(serde_json::json!({ "fleet": "", "run_id": "r", "step": "s", "cap": 3 })), "fleet_step.fleet"),
    ];
    for (body, field) in cases {
        let err = submit_raw(&cluster, body.clone()).await.expect_err("refused");
        assert_eq!(err.code, mur_proto::cluster::ErrorCode::InvalidRequest, "{body}: {err:?}");
        assert!(err.message.starts_with(field), "{body}: {}", err.message);
    }
    let js = async_nats::jetstream::new(cluster.client.clone());
    let tasks = js.get_key_value(mur_proto::cluster::TASKS_BUCKET).await.unwrap();
    assert_eq!(tasks.keys().await.unwrap().count().await, 0, "no task was stored");
}

/// The nats-server crashes (SIGKILL, back on the same port and store) while steps hold
/// permits and others wait: every step still completes exactly once, and no watcher,
/// before or after the crash, sees more permits held than the cap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_step_completes_across_a_nats_server_crash_while_permits_are_held() {
    let mut cluster = Procs::start("jetstream:\n  ack_wait_secs: 10\n  fanout_lease_secs: 3\n").await;
    let _coordinator = cluster.coordinator("coordinator-1");
    let _workers = [cluster.worker("wkr-1", 3), cluster.worker("wkr-2", 3)];
    let capsule = shell_capsule("m");
    cluster.push(capsule.dir()).await;
    cluster.wait_workers(2).await;
    let kv = fanout_kv(&cluster).await;
    let before = mur_tests::permits::watch(kv.clone()).await;

    let mut steps = Vec::new();
    for n in 0..5 {
        steps.push(step(&cluster, &format!("sleep 3; echo step-{n}"), 2.into(), None).await);
    }
    until("2 permits held and a step waiting", WAIT, || async {
        let held = before.lock().unwrap().held.len();
        let waiting = kv
            .keys()
            .await
            .ok()?
            .filter(|k| std::future::ready(k.as_ref().is_ok_and(|k| k.starts_with("wait."))))
            .count()
            .await;
        (held == 2 && waiting > 0).then_some(())
    })
    .await;
    cluster.nats.restart();
    let after = mur_tests::permits::watch(fanout_kv(&cluster).await).await;

    for id in &steps {
        let r = cluster.wait_record(id, WAIT, terminal).await;
        assert_eq!((r.state, r.exit_status), (TaskState::Completed, Some(ExitStatus::Ok)), "{r:?}");
    }
    assert!(before.lock().unwrap().max_held <= 2, "{} held before the crash", before.lock().unwrap().max_held);
    assert!(after.lock().unwrap().max_held <= 2, "{} held after the crash", after.lock().unwrap().max_held);
    assert!(after.lock().unwrap().max_held >= 1, "steps took permits after the crash");
}

/// A broker error while a step waits for its fan-out permit does not use up a delivery
/// (issue #29 item 3: each failed wait was a nak, and a status flood that made the broker
/// refuse consumers dead-lettered 18 of 44 steps). Here the fan-out bucket's stream takes
/// one consumer and the test holds it, so the step's watch is refused; the worker waits
/// again within the same delivery, and once the test lets go the step completes with no
/// dispatch delivered twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_error_while_a_step_waits_for_its_permit_does_not_use_up_a_delivery() {
    let cluster = Procs::start("jetstream:\n  ack_wait_secs: 10\n").await;
    let js = async_nats::jetstream::new(cluster.client.clone());
    // The stream as the coordinator makes it (so it finds nothing to change), but for its
    // consumer limit, which the coordinator does not look at.
    let settings = mur_coordinator::Settings::default();
    let config = async_nats::jetstream::stream::Config {
        max_age: Duration::from_secs(settings.fanout_lease_secs),
        allow_message_ttl: true,
        subject_delete_marker_ttl: Some(Duration::from_secs(1)),
        max_consumers: 1,
        ..settings.kv_stream(
            mur_proto::fanout::FANOUT_BUCKET,
            "murmur: fan-out permits (slot.<n>) and waiting steps (wait.<task>)",
            1,
        )
    };
    let stream = js.create_stream(config).await.expect("the fan-out bucket's stream");
    stream
        .create_consumer(async_nats::jetstream::consumer::pull::Config {
            durable_name: Some("held".into()),
            ..Default::default()
        })
        .await
        .expect("the one consumer allowed");
    let _coordinator = cluster.coordinator("coordinator-1");
    let worker = cluster.worker("wkr-1", 2);
    let capsule = shell_capsule("m");
    cluster.push(capsule.dir()).await;
    cluster.wait_workers(1).await;
    let id = step(&cluster, "echo stepped", 1.into(), None).await;
    until("the step's wait is refused twice", WAIT, || async {
        (worker.log().matches("waiting for a fan-out permit failed").count() >= 2).then_some(())
    })
    .await;
    stream.delete_consumer("held").await.expect("letting go of the consumer");
    let r = cluster.wait_record(&id, WAIT, terminal).await;
    assert_eq!((r.state, r.exit_status), (TaskState::Completed, Some(ExitStatus::Ok)), "{r:?}");
    let dispatch = js.get_stream(mur_proto::cluster::DISPATCH_STREAM).await.unwrap();
    let info = dispatch.consumer_info(mur_proto::cluster::DISPATCH_CONSUMER).await.unwrap();
    // One dispatch, delivered once: each delivery takes a consumer sequence number.
    assert_eq!(
        (info.delivered.stream_sequence, info.delivered.consumer_sequence),
        (1, 1),
        "deliveries used up by the refused waits: {info:?}"
    );
}

/// `mur fleet run --json` detached with SIGINT the moment its first line (the `run` record)
/// is out: it exits 0, every line it printed is JSON with a `type`, and the run goes on
/// without it to `completed`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigint_right_after_the_run_line_detaches_with_exit_0_and_the_run_goes_on() {
    use std::io::BufRead;
    let (cluster, _coordinator, _worker) = with_member_m("jetstream:\n  ack_wait_secs: 10\n", "wkr-1", 2).await;
    let dir = tempfile::tempdir().unwrap();
    let yaml = dir.path().join("f.yaml");
    std::fs::write(&yaml, "name: solo\ngoal: Work.\nmembers: [m]\n").unwrap();
    let mur = |args: &[&str]| cluster.mur_sync(args);
    mur(&["fleet", "create", yaml.to_str().unwrap()]);
    mur(&["fleet", "send", "solo", "sleep 3; echo solo-done"]);

    let mut run = cluster
        .command()
        .args(["fleet", "run", "solo", "--json"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let pid = run.id();
    let mut stdout = std::io::BufReader::new(run.stdout.take().unwrap());
    let (first, rest, status, stderr) = tokio::task::spawn_blocking(move || {
        let mut first = String::new();
        stdout.read_line(&mut first).unwrap();
        mur_worker::signal::signal_pid(pid, libc::SIGINT).unwrap();
        let mut rest = String::new();
        std::io::Read::read_to_string(&mut stdout, &mut rest).unwrap();
        let out = run.wait_with_output().unwrap();
        (first, rest, out.status, String::from_utf8_lossy(&out.stderr).into_owned())
    })
    .await
    .unwrap();
    assert_eq!(status.code(), Some(0), "a detach exits 0: {status:?}\n{stderr}");
    assert!(stderr.contains("detached; run "), "{stderr}");
    let run_line: serde_json::Value = serde_json::from_str(&first).unwrap();
    assert_eq!(run_line["type"], "run", "{first}");
    for line in rest.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{line:?}: {e}"));
        assert!(v["type"].is_string(), "{line}");
    }
    let run_id = run_line["run_id"].as_str().unwrap().to_string();
    until("the detached run completes", WAIT, || async {
        let out = cluster.command().args(["job", "status", &run_id, "--json"]).output().ok()?;
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
        (v["state"] == "done").then_some(())
    })
    .await;
    let jobs: serde_json::Value = serde_json::from_str(&mur(&["fleet", "jobs", "solo", "--all", "--json"])).unwrap();
    assert_eq!(jobs[0]["status"], "done", "{jobs}");
}

/// A second `mur fleet run --run-id X` while run X is still running is refused (it would
/// share and overwrite X's record), naming the flag; a bad id is refused with the rule
/// stated once; the first run completes untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_id_still_running_or_malformed_is_refused_and_the_running_run_is_untouched() {
    let (cluster, _coordinator, _worker) = with_member_m("jetstream:\n  ack_wait_secs: 10\n", "wkr-1", 2).await;
    let dir = tempfile::tempdir().unwrap();
    let yaml = dir.path().join("f.yaml");
    std::fs::write(&yaml, "name: solo\ngoal: Work.\nmembers: [m]\n").unwrap();
    let mur = |args: &[&str]| cluster.mur_sync(args);
    mur(&["fleet", "create", yaml.to_str().unwrap()]);
    mur(&["fleet", "send", "solo", "sleep 4; echo first-done"]);
    mur(&["fleet", "send", "solo", "echo second"]);

    let mut first = cluster.command();
    first.args(["fleet", "run", "solo", "--run-id", "dup"]);
    let first = tokio::task::spawn_blocking(move || first.output());
    let status = |id: &str| {
        let out = cluster.command().args(["job", "status", id, "--json"]).output().unwrap();
        serde_json::from_slice::<serde_json::Value>(&out.stdout).ok()
    };
    until("run dup is running", WAIT, || async { status("dup").filter(|v| v["state"] == "running") }).await;
    let started_at = status("dup").unwrap()["started_at"].clone();

    let again = cluster.command().args(["fleet", "run", "solo", "--run-id", "dup"]).output().unwrap();
    let err = String::from_utf8_lossy(&again.stderr);
    assert_eq!(again.status.code(), Some(2), "{err}");
    assert!(err.contains("--run-id: run dup is still running"), "{err}");
    let bad = cluster.command().args(["fleet", "run", "solo", "--run-id", "a b"]).output().unwrap();
    let err = String::from_utf8_lossy(&bad.stderr);
    assert_eq!(bad.status.code(), Some(2), "{err}");
    assert_eq!(err.matches("--run-id:").count(), 1, "the rule is stated once: {err}");
    assert!(err.contains("must be 1-96 letters, digits, '-' or '_', got \"a b\""), "{err}");

    let first = first.await.unwrap().unwrap();
    assert!(first.status.success(), "{}", String::from_utf8_lossy(&first.stderr));
    let done = status("dup").unwrap();
    assert_eq!((done["state"].as_str(), &done["started_at"]), (Some("done"), &started_at), "{done}");
    let jobs: serde_json::Value = serde_json::from_str(&mur(&["fleet", "jobs", "solo", "--all", "--json"])).unwrap();
    let statuses: Vec<&str> = jobs.as_array().unwrap().iter().map(|j| j["status"].as_str().unwrap()).collect();
    assert_eq!(statuses.iter().filter(|s| **s == "done").count(), 1, "only the first run ran a job: {jobs}");
}

/// The built-in fleet tools refuse hostile inputs naming the field, and start nothing:
/// `job_status` with `wait_secs` -1, 99999 or "x", or a `run_id` with a space or a
/// wildcard; `fleet_run` on a fleet that does not exist, or with a bad `run_id`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fleet_tools_refuse_bad_inputs_naming_the_field_and_start_nothing() {
    let cluster = Procs::start("jetstream:\n  ack_wait_secs: 10\n").await;
    let _coordinator = cluster.coordinator("coordinator-1");
    let _worker = cluster.worker("wkr-1", 2);
    let prober = mur_tests::capsule::TestCapsule::new(
        "name: prober\nversion: 1.0.0\ninference:\n  driver: scripted\n  script: r.yaml\ntrace:\n  capture: content\n\
         tools:\n  - name: fleet_run\n    command: builtin:fleet_run\n  - name: job_status\n    command: builtin:job_status\n",
        &[(
            "r.yaml",
            "replies:\n  - tool_calls:\n\
             \x20     - { name: job_status, input: { run_id: r1, wait_secs: -1 } }\n\
             \x20     - { name: job_status, input: { run_id: r1, wait_secs: 99999 } }\n\
             \x20     - { name: job_status, input: { run_id: r1, wait_secs: \"x\" } }\n\
             \x20     - { name: job_status, input: { run_id: \"a b\" } }\n\
             \x20     - { name: job_status, input: { run_id: \"run.>\", wait_secs: 5 } }\n\
             \x20     - { name: job_status, input: { run_id: nope } }\n\
             \x20     - { name: fleet_run, input: { fleet: nope } }\n\
             \x20     - { name: fleet_run, input: { fleet: nope, run_id: \"*\" } }\n\
             \x20 - text: probed\n",
        )],
    );
    cluster.push(prober.dir()).await;
    cluster.wait_workers(1).await;
    let task = cluster.submit("prober", "probe", mur_proto::task::Origin::User).await;
    let r = cluster.wait_record(&task, WAIT, terminal).await;
    assert_eq!(r.exit_status, Some(ExitStatus::Ok), "{r:?}");
    let trace = cluster.trace_of(&task).await;
    let outputs: Vec<String> = trace
        .iter()
        .filter(|l| l["event_type"] == "tool_call")
        .map(|l| l["output"].as_str().unwrap_or_default().to_string())
        .collect();
    let expected = [
        "job_status: wait_secs: must be a whole number from 0 to 3600, got -1",
        "job_status: wait_secs: must be a whole number from 0 to 3600, got 99999",
        "job_status: wait_secs: must be a whole number from 0 to 3600, got \"x\"",
        "job_status: run_id: must be 1-96 letters, digits, '-' or '_', got \"a b\"",
        "job_status: run_id: must be 1-96 letters, digits, '-' or '_', got \"run.>\"",
        "job_status: no run nope",
    ];
    assert_eq!(outputs.len(), 8, "{outputs:#?}");
    for (got, want) in outputs.iter().zip(expected) {
        assert!(got.contains(want), "{got:?} does not say {want:?}");
    }
    assert!(outputs[6].starts_with("fleet_run: ") && outputs[6].contains("nope"), "{:?}", outputs[6]);
    assert!(outputs[7].contains("run_id: must be 1-96 letters"), "{:?}", outputs[7]);
    assert_eq!(run_records(&cluster).await, 0, "no run was started");
}

/// `--budget-usd nan` / `inf` / `1e400` looked like a ceiling and reached the coordinator as
/// no value (JSON has no NaN): `mur fleet run` ran unbounded and `set-loop` said "give at
/// least one of …". Each is refused naming the flag, no run starts and the fleet is unchanged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_budget_of_nan_or_infinity_is_refused_naming_the_flag_and_nothing_changes() {
    let cluster = Procs::start("jetstream:\n  ack_wait_secs: 10\n").await;
    let _coordinator = cluster.coordinator("coordinator-1");
    let dir = tempfile::tempdir().unwrap();
    let yaml = dir.path().join("f.yaml");
    std::fs::write(&yaml, "name: solo\ngoal: Work.\nmembers: [m]\n").unwrap();
    let out = until("the fleet is created", WAIT, || async {
        let out = cluster.command().args(["fleet", "create", yaml.to_str().unwrap()]).output().ok()?;
        out.status.success().then_some(out)
    })
    .await;
    assert!(out.status.success());
    let show = || {
        String::from_utf8_lossy(&cluster.command().args(["fleet", "show", "solo"]).output().unwrap().stdout)
            .into_owned()
    };
    let before = show();
    for value in ["nan", "NaN", "inf", "-inf", "1e400"] {
        for args in [
            vec!["fleet", "run", "solo", "--budget-usd", value],
            vec!["fleet", "set-loop", "solo", "--budget-usd", value],
        ] {
            let out = cluster.command().args(&args).output().unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
            assert!(
                err.contains(&format!("--budget-usd: must be a finite number of USD, got \"{value}\"")),
                "{args:?}: {err}"
            );
        }
    }
    // A negative number reaches the validator (not the argument parser), which says why.
    let out = cluster.command().args(["fleet", "set-loop", "solo", "--budget-usd", "-5"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("--budget-usd: must be a non-negative number (0 for no ceiling), got -5"), "{err}");
    assert_eq!(show(), before, "the fleet is unchanged");
    assert_eq!(run_records(&cluster).await, 0, "no run was started");
}

/// A `deadline_at` as far ahead as a u64 goes (accepted by the API: a whole number of unix
/// ms) must not panic the worker's clock arithmetic: the step, and a plain task, run and
/// complete.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadline_at_the_end_of_time_runs_the_task_instead_of_panicking_the_worker() {
    let (cluster, _coordinator, worker) =
        with_member_m("jetstream:\n  ack_wait_secs: 10\n  fanout_lease_secs: 10\n", "wkr-1", 2).await;
    let fleet_step = step(&cluster, "echo far-step", 1.into(), Some(u64::MAX)).await;
    let plain = submit_raw(
        &cluster,
        serde_json::json!({ "capsule": "m", "text": "echo far-plain", "origin": "peer", "deadline_at": u64::MAX }),
    )
    .await
    .expect("accepted");
    for id in [&fleet_step, &plain] {
        let r = cluster.wait_record(id, Duration::from_secs(60), terminal).await;
        assert_eq!(r.exit_status, Some(ExitStatus::Ok), "{r:?}\n{}", worker.log());
    }
    assert!(!worker.log().contains("panicked"), "{}", worker.log());
}

/// A wait for a permit that is dropped mid-way (a tool call dropped when its session is
/// cancelled or out of time, e.g. `job_status` taking its permit back) leaves the line at
/// once, not a lease later: its ticket would otherwise keep its place and hold back a
/// freed permit from the steps behind it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_wait_leaves_the_line_at_once_and_the_next_waiter_gets_the_freed_permit() {
    let server = mur_tests::nats::NatsServer::start();
    let js = server.jetstream().await;
    let settings = mur_coordinator::Settings { fanout_lease_secs: 30, ..mur_coordinator::Settings::default() };
    let res = mur_coordinator::resources::ensure(&js, &settings).await.unwrap();
    let sem = mur_nats::fanout::Semaphore::open(&js).await.unwrap();
    let kv = res.fanout;
    let holder = |task: &str| Holder {
        task_id: TaskId::unchecked(task),
        worker: "wkr".into(),
        step: mur_proto::fanout::FleetStep { fleet: "f".into(), run_id: "r".into(), step: task.into(), cap: 1 },
        since: 0,
    };
    let never = tokio_util::sync::CancellationToken::new();
    let first = sem.acquire(&holder("first"), &never).await.unwrap();
    let dropped = tokio::spawn({
        let (sem, h, never) = (sem.clone(), holder("dropped"), never.clone());
        async move { sem.acquire(&h, &never).await.map(|p| p.slot()) }
    });
    until("the dropped wait's ticket", WAIT, || async {
        live(&kv, &wait_key(&TaskId::unchecked("dropped"))).await.then_some(())
    })
    .await;
    let next = tokio::spawn({
        let (sem, h, never) = (sem.clone(), holder("next"), never.clone());
        async move { sem.acquire(&h, &never).await.map(|p| p.slot()) }
    });
    until("the next waiter's ticket", WAIT, || async {
        live(&kv, &wait_key(&TaskId::unchecked("next"))).await.then_some(())
    })
    .await;
    dropped.abort();
    let asked = Instant::now();
    until("the dropped wait's ticket is gone", WAIT, || async {
        (!live(&kv, &wait_key(&TaskId::unchecked("dropped"))).await).then_some(())
    })
    .await;
    assert!(asked.elapsed() < Duration::from_secs(5), "the ticket stayed {:?}", asked.elapsed());
    assert!(first.release().await.unwrap());
    let slot = tokio::time::timeout(Duration::from_secs(5), next).await.expect("the next waiter is served at once");
    assert_eq!(slot.unwrap().unwrap(), 0);
}

/// As above, but the pause also outlives the dispatch's ack wait: another worker takes the
/// step over while the first is stopped (it waits in line for the permit meanwhile). Woken,
/// the first worker must not end the step: it completes once, on the worker that holds the
/// permit, and the count never exceeds the cap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_taken_over_while_its_first_worker_is_stopped_completes_on_the_permit_holder() {
    let (cluster, _coordinator, stalled) =
        with_member_m("jetstream:\n  ack_wait_secs: 2\n  fanout_lease_secs: 2\n", "wkr-stalled", 1).await;
    let kv = fanout_kv(&cluster).await;
    let seen = mur_tests::permits::watch(kv.clone()).await;

    let a = step(&cluster, "sleep 5; echo a-done", 1.into(), None).await;
    cluster.wait_record(&a, WAIT, |r| r.state == TaskState::Working).await;
    until("a holds the permit", WAIT, || async {
        (seen.lock().unwrap().held.get("slot.0").map(|h| &h.task_id) == Some(&TaskId::unchecked(&a))).then_some(())
    })
    .await;
    stalled.pause();
    let other = cluster.worker("wkr-other", 1);
    // The other worker takes the step over (the record names it) and then holds the permit.
    cluster.wait_record(&a, WAIT, |r| r.worker.as_deref() == Some("wkr-other") || r.state.is_terminal()).await;
    stalled.resume();
    let a = cluster.wait_record(&a, WAIT, terminal).await;
    assert_eq!((a.state, a.exit_status), (TaskState::Completed, Some(ExitStatus::Ok)), "{a:?}\n{}", stalled.log());
    assert_eq!(a.worker.as_deref(), Some("wkr-other"), "{a:?}\n{}\n{}", stalled.log(), other.log());
    assert_eq!(seen.lock().unwrap().max_held, 1, "never more than the cap of 1");
}

/// A permit dropped without a release (its holder's future dropped between taking it and
/// keeping it) gives its slot back at once, not when its 30 s lease ends; a permit that was
/// released or lost is not touched by its drop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permit_dropped_without_a_release_gives_its_slot_back_at_once() {
    let server = mur_tests::nats::NatsServer::start();
    let js = server.jetstream().await;
    let settings = mur_coordinator::Settings { fanout_lease_secs: 30, ..mur_coordinator::Settings::default() };
    let res = mur_coordinator::resources::ensure(&js, &settings).await.unwrap();
    let sem = mur_nats::fanout::Semaphore::open(&js).await.unwrap();
    let kv = res.fanout;
    let holder = |task: &str| Holder {
        task_id: TaskId::unchecked(task),
        worker: "wkr".into(),
        step: mur_proto::fanout::FleetStep { fleet: "f".into(), run_id: "r".into(), step: task.into(), cap: 1 },
        since: 0,
    };
    let never = tokio_util::sync::CancellationToken::new();
    let dropped = sem.acquire(&holder("dropped"), &never).await.unwrap();
    drop(dropped);
    let asked = Instant::now();
    until("the dropped permit's slot is free", WAIT, || async { (!live(&kv, &slot_key(0)).await).then_some(()) }).await;
    assert!(asked.elapsed() < Duration::from_secs(5), "the slot stayed {:?}", asked.elapsed());

    let released = sem.acquire(&holder("released"), &never).await.unwrap();
    assert!(released.release().await.unwrap());
    let next = sem.acquire(&holder("next"), &never).await.unwrap();
    drop(released);
    let rev = next.revision();
    // The next holder's permit stays (a drop's delete would expect the dropped permit's
    // revision, so it could not remove another holder's either).
    next.renew().await.unwrap();
    assert!(next.revision() > rev);
    let entry = kv.entry(slot_key(0)).await.unwrap().unwrap();
    assert_eq!((entry.operation, entry.revision), (Operation::Put, next.revision()));
}
