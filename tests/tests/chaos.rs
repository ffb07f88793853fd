//! The cluster survives (issue #8): real `nats-server`, `mur coordinator` and `mur worker`
//! processes ([`Procs`]), killed with SIGKILL at chosen points; each test checks one of
//! the design's invariants 2, 3, 4, 7, 8 on what the cluster stored.

use mur_proto::cluster;
use mur_proto::task::{Origin, TaskState};
use mur_proto::{SessionId, TaskId};
use mur_tests::capsule::{TestCapsule, idempotent_shell_capsule, shell_capsule};
use mur_tests::procs::{Procs, proc_state, until};
use serde_json::Value;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(90);

/// A capsule whose task takes `turns` turns, each a shell command that appends its turn
/// number to `ran.txt` in the capsule folder and then sleeps `pause` seconds; the last
/// reply reports "finished".
fn stepper(name: &str, turns: u32, pause: &str) -> TestCapsule {
    let capsule = TestCapsule::new(&format!("name: {name}\nversion: 1.0.0\n"), &[]);
    let ran = capsule.dir().join("ran.txt");
    let mut replies = String::from("replies:\n");
    for t in 0..turns {
        replies.push_str(&format!(
            "  - tool_calls: [{{ name: sh, input: {{ command: \"echo {t} >> {} && sleep {pause}\" }} }}]\n",
            ran.display()
        ));
    }
    replies.push_str("  - text: finished\n");
    std::fs::write(capsule.dir().join("r.yaml"), replies).unwrap();
    std::fs::write(
        capsule.dir().join("murmur.yaml"),
        format!(
            "name: {name}\nversion: 1.0.0\ninference:\n  driver: scripted\n  script: r.yaml\n  max_turns: {}\ncapabilities:\n  shell:\n    allow: [sh]\n",
            turns + 5
        ),
    )
    .unwrap();
    capsule
}

fn ran_turns(capsule: &TestCapsule) -> Vec<u32> {
    std::fs::read_to_string(capsule.dir().join("ran.txt"))
        .unwrap_or_default()
        .lines()
        .map(|l| l.trim().parse().unwrap())
        .collect()
}

fn of_type<'a>(lines: &'a [Value], event_type: &str) -> Vec<&'a Value> {
    lines.iter().filter(|l| l["event_type"] == event_type).collect()
}

/// Invariants 3 and 4: a worker killed in the middle of a multi-turn task; another
/// finishes it from the checkpoint — no turn before the checkpoint runs again, one
/// `task_end`, one terminal record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_mid_task_is_taken_over_at_the_checkpointed_turn() {
    worker_killed_mid_task(Procs::start("jetstream:\n  ack_wait_secs: 2\n").await).await;
}

/// The same with authentication and TLS on (issue #31): `mur auth init --tls`'s server
/// configuration, each process with its role's credentials (the coordinator with its
/// identity connection too).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_with_tls_and_role_credentials_a_killed_worker_is_taken_over_at_the_checkpoint() {
    worker_killed_mid_task(Procs::start_secured("jetstream:\n  ack_wait_secs: 2\n").await).await;
}

async fn worker_killed_mid_task(cluster: Procs) {
    let coordinator = cluster.coordinator("coordinator-1");
    let mut first = cluster.worker("wkr-first", 1);
    let capsule = stepper("steps", 8, "0.3");
    cluster.push(capsule.dir()).await;
    cluster.wait_workers(1).await;
    let task_id = cluster.submit("steps", "go", Origin::User).await;

    // Kill the first worker once its checkpoint after turn 3 is stored.
    let js = async_nats::jetstream::new(cluster.client.clone());
    let sessions = js.get_key_value(cluster::SESSIONS_BUCKET).await.unwrap();
    until("the checkpoint after turn 3", WAIT, || async {
        sessions.get(cluster::checkpoint_key(&TaskId::unchecked(&task_id), 3)).await.ok().flatten()
    })
    .await;
    first.kill9();
    let before = cluster.record(&task_id).await.unwrap();
    assert_eq!((before.state, before.worker.as_deref()), (TaskState::Working, Some("wkr-first")));
    assert_eq!(before.attempt, 1);

    let second = cluster.worker("wkr-second", 1);
    let record = cluster.wait_record(&task_id, WAIT, |r| r.state.is_terminal()).await;
    assert_eq!(record.state, TaskState::Completed, "{record:?}");
    assert_eq!(record.result.as_deref(), Some("finished"));
    assert_eq!(record.worker.as_deref(), Some("wkr-second"));
    // Issue #29 item 9: the takeover is the task's second attempt (it stayed 1).
    assert_eq!(record.attempt, 2, "{record:?}");

    let trace = cluster.trace_of(&task_id).await;
    let takeovers = of_type(&trace, "task_takeover");
    assert_eq!(takeovers.len(), 1, "{takeovers:?}");
    let t = takeovers[0];
    let resumed_at = t["turn"].as_u64().unwrap() as u32;
    assert!(resumed_at >= 3, "resumed at {resumed_at}");
    assert_eq!(t["previous_worker"], "wkr-first");
    assert_eq!(t["previous_session_id"].as_str(), before.session_id.as_deref());
    assert_eq!(t["delivery"], 2);
    assert_eq!(Some(t["session_id"].as_str().unwrap()), record.session_id.as_deref());
    // The new session's turns start at the checkpointed turn: a model call, or the
    // response its journal held (issue #34).
    let turns_after: Vec<u64> = trace
        .iter()
        .filter(|l| {
            l["event_type"] == "inference" || (l["event_type"] == "journal_replay" && l["what"] == "model_response")
        })
        .filter(|l| l["session_id"] == t["session_id"])
        .map(|l| l["turn"].as_u64().unwrap())
        .collect();
    assert_eq!(turns_after.first().copied(), Some(u64::from(resumed_at)), "{turns_after:?}");
    assert_eq!(of_type(&trace, "task_end").len(), 1);
    let end = of_type(&trace, "task_end")[0];
    assert_eq!((end["exit_status"].as_str(), end["turns"].as_u64()), (Some("ok"), Some(9)));
    // The task counts every turn; the taking-over session's `session_end` only its own,
    // as many as its `inference` lines (`mur trace show` and `steps` agree).
    let session_id = t["session_id"].as_str().unwrap();
    let session = mur_tests::nats::stream_json(
        &cluster.client,
        cluster::TRACE_STREAM,
        Some(cluster::trace_subject(&SessionId::unchecked(session_id))),
    )
    .await;
    let ends = of_type(&session, "session_end");
    assert_eq!(ends.len(), 1, "{session:?}");
    assert_eq!(ends[0]["total_turns"].as_u64(), Some(turns_after.len() as u64), "{:?}", ends[0]);
    assert_eq!(ends[0]["total_tool_calls"].as_u64(), Some(turns_after.len() as u64 - 1), "{:?}", ends[0]);

    // Every turn's command ran once, the one in flight too: the journal replays or
    // reports it, never runs it twice (issue #34).
    let ran = ran_turns(&capsule);
    for turn in 0..8 {
        let times = ran.iter().filter(|&&t| t == turn).count();
        let in_doubt = of_type(&trace, "tool_call_in_doubt").iter().any(|l| l["turn"] == turn);
        assert!(times == 1 || (in_doubt && times == 0), "turn {turn} ran {times} times: {ran:?}");
    }
    // The finished task's checkpoints are gone.
    assert!(sessions.get(cluster::checkpoint_key(&TaskId::unchecked(&task_id), 3)).await.unwrap().is_none());
    // With credentials on, nothing the processes did was refused by the server.
    for log in [coordinator.log(), second.log()] {
        assert!(!log.contains("Permissions Violation"), "{log}");
    }
}

/// Issue #33 (the design's invariant 4; deploy/chaos step 5, a partitioned worker): a
/// worker stopped (SIGSTOP) past its ack wait mid-task; the task is taken over by another
/// worker and finished there. Woken (SIGCONT), the first worker finds its session
/// superseded: it stops it with a `session_superseded` line and writes no `task_end` and
/// no terminal record. Exactly one `task_end` (the taker's, `ok`) is published on the
/// trace subjects, as a live follower (`mur trace tail`) sees them, and stored in
/// MUR_TRACE; the record is the taker's: `completed`, attempt 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_woken_after_its_task_was_taken_over_and_finished_publishes_no_second_task_end() {
    let cluster = Procs::start("jetstream:\n  ack_wait_secs: 2\n").await;
    let _coordinator = cluster.coordinator("coordinator-1");
    let cut = cluster.worker("wkr-cut", 1);
    let capsule = stepper("steps", 14, "0.3");
    cluster.push(capsule.dir()).await;
    cluster.wait_workers(1).await;
    // Every trace line as published (the core subjects, not only what MUR_TRACE keeps:
    // the stream drops a second `task_end` only within its duplicate window).
    let published = std::sync::Arc::new(std::sync::Mutex::new(Vec::<Value>::new()));
    let mut sub = cluster.client.subscribe(cluster::TRACE_SUBJECTS).await.unwrap();
    cluster.client.flush().await.unwrap();
    let follower = tokio::spawn({
        let published = published.clone();
        async move {
            use futures::StreamExt;
            while let Some(m) = sub.next().await {
                if let Ok(line) = serde_json::from_slice::<Value>(&m.payload) {
                    published.lock().unwrap().push(line);
                }
            }
        }
    });
    let task_id = cluster.submit("steps", "go", Origin::User).await;

    let js = async_nats::jetstream::new(cluster.client.clone());
    let sessions = js.get_key_value(cluster::SESSIONS_BUCKET).await.unwrap();
    until("the checkpoint after turn 2", WAIT, || async {
        sessions.get(cluster::checkpoint_key(&TaskId::unchecked(&task_id), 2)).await.ok().flatten()
    })
    .await;
    cut.pause();
    let before = cluster.record(&task_id).await.unwrap();
    assert_eq!((before.state, before.worker.as_deref()), (TaskState::Working, Some("wkr-cut")));
    let cut_session = before.session_id.clone().unwrap().to_string();

    let _taker = cluster.worker("wkr-taker", 1);
    let record = cluster.wait_record(&task_id, WAIT, |r| r.state.is_terminal()).await;
    assert_eq!((record.state, record.worker.as_deref()), (TaskState::Completed, Some("wkr-taker")), "{record:?}");
    cut.resume();

    // The woken worker's session ends (its `session_end`, on its own subject).
    let of_session = |event_type: &str| {
        published
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l["session_id"] == cut_session.as_str() && l["event_type"] == event_type)
            .cloned()
            .collect::<Vec<_>>()
    };
    until("the woken worker's session to end", WAIT, || async {
        (!of_session("session_end").is_empty()).then_some(())
    })
    .await;
    let superseded = of_session("session_superseded");
    assert_eq!(superseded.len(), 1, "{}", cut.log());
    assert_eq!(superseded[0]["task_id"], task_id.as_str());
    assert_eq!(of_session("session_end")[0]["exit_status"], "canceled");
    assert!(of_session("task_end").is_empty(), "{:?}", of_session("task_end"));
    // The worker is done with the dispatch (its slot is free) before the counts.
    until("the woken worker to let the dispatch go", WAIT, || async {
        cut.log().contains("a superseded session stopped").then_some(())
    })
    .await;

    let ends: Vec<Value> = published
        .lock()
        .unwrap()
        .iter()
        .filter(|l| l["event_type"] == "task_end" && l["task_id"] == task_id.as_str())
        .cloned()
        .collect();
    assert_eq!(ends.len(), 1, "task_end published: {ends:?}");
    assert_eq!(ends[0]["exit_status"], "ok");
    assert_eq!(ends[0]["session_id"].as_str(), record.session_id.as_deref());
    let stored = cluster.trace_of(&task_id).await;
    let stored_ends = of_type(&stored, "task_end");
    assert_eq!(stored_ends.len(), 1, "{stored_ends:?}");
    assert_eq!(stored_ends[0]["exit_status"], "ok");
    // The record is the taker's, unchanged by the woken worker.
    let after = cluster.record(&task_id).await.unwrap();
    assert_eq!(
        (after.state, after.exit_status, after.worker.as_deref(), after.attempt, after.result.as_deref()),
        (TaskState::Completed, Some(mur_proto::task::ExitStatus::Ok), Some("wkr-taker"), 2, Some("finished")),
        "{after:?}"
    );
    assert_eq!(after.session_id, record.session_id);
    follower.abort();
}

/// Issue #8 §Cancel: `mur task cancel` of a running task stops it within one progress
/// interval (a third of the 3 s ack wait here); no tool call starts after the cancel, and
/// it ends `canceled` with one `task_end`. A task cancelled while waiting never starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_reaches_a_running_task_within_one_progress_interval() {
    let cluster = Procs::start("jetstream:\n  ack_wait_secs: 3\n").await;
    let _coordinator = cluster.coordinator("coordinator-1");
    let _worker = cluster.worker("wkr-1", 1);
    let capsule = stepper("long", 40, "0.5");
    cluster.push(capsule.dir()).await;
    cluster.wait_workers(1).await;
    let running = cluster.submit("long", "go", Origin::User).await;
    let waiting = cluster.submit("long", "later", Origin::User).await;
    until("two turns ran", WAIT, || async { (ran_turns(&capsule).len() >= 2).then_some(()) }).await;

    let out = mur_tests::mur::Run::of(
        mur_tests::mur::mur().args(["task", "cancel", &waiting, "--json"]).env("NATS_URL", cluster.nats.url()),
    );
    assert_eq!(out.code, 0, "{out:?}");
    assert_eq!(out.last_json()["state"], "canceled");
    let asked = std::time::Instant::now();
    let out = mur_tests::mur::Run::of(
        mur_tests::mur::mur().args(["task", "cancel", &running, "--json"]).env("NATS_URL", cluster.nats.url()),
    );
    assert_eq!(out.code, 0, "{out:?}");
    assert_eq!(out.last_json()["state"], "working");
    assert!(out.last_json()["cancel_requested_at"].is_u64());
    let ran_at_cancel = ran_turns(&capsule).len();

    let record = cluster.wait_record(&running, WAIT, |r| r.state.is_terminal()).await;
    let took = asked.elapsed();
    assert!(took < Duration::from_secs(1) + Duration::from_millis(900), "the cancel took {took:?}");
    assert_eq!((record.state, record.result.as_deref()), (TaskState::Canceled, Some("canceled")));
    let trace = cluster.trace_of(&running).await;
    let ends = of_type(&trace, "task_end");
    assert_eq!(ends.len(), 1);
    assert_eq!(ends[0]["exit_status"], "canceled");
    // At most the command already under way when the cancel came was counted after it.
    assert!(ran_turns(&capsule).len() <= ran_at_cancel + 1, "{:?}", ran_turns(&capsule));
    let tool_calls = of_type(&trace, "tool_call").len();
    assert!(tool_calls <= ran_at_cancel + 1, "{tool_calls} tool calls after {ran_at_cancel} turns");

    // The task cancelled while it waited never started.
    let w = cluster.record(&waiting).await.unwrap();
    assert_eq!((w.state, w.session_id, w.started_at), (TaskState::Canceled, None, None));
}

/// Issue #8 §Cancel with a hook under way: a task cancelled while its `on-task-start` hook
/// runs ends `canceled` within one progress interval; the hook's process group is killed and
/// the session's `on-session-end` hook does not hold the end up either (each is one
/// `hook_dispatch_error`, "the task was cancelled").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_reaches_a_task_whose_hook_is_running() {
    let cluster = Procs::start("jetstream:\n  ack_wait_secs: 3\n").await;
    let _coordinator = cluster.coordinator("coordinator-1");
    let _worker = cluster.worker("wkr-1", 1);
    let hook = "  - name: {name}\n    binding: {binding}\n    command: [sh, -c, 'cat > /dev/null; echo $$ >> pids; sleep 60 & sleep 60']\n    timeout_secs: 200\n";
    let capsule = TestCapsule::new(
        &format!(
            "name: hooked\nversion: 1.0.0\ninference:\n  driver: scripted\n  script: r.yaml\nhooks:\n{}{}",
            hook.replace("{name}", "start").replace("{binding}", "on-task-start"),
            hook.replace("{name}", "end").replace("{binding}", "on-session-end")
        ),
        &[("r.yaml", "replies:\n  - text: never\n")],
    );
    let pids = capsule.dir().join("pids");
    cluster.push(capsule.dir()).await;
    cluster.wait_workers(1).await;
    let task = cluster.submit("hooked", "go", Origin::User).await;
    // The hook runs in the worker's copy of the bundle, not in this folder: find its pid file.
    let hook_pid: u32 = until("the on-task-start hook runs", WAIT, || async {
        walk(cluster.dir())
            .into_iter()
            .find(|p| p.ends_with("pids"))
            .and_then(|p| std::fs::read_to_string(p).ok())
            .and_then(|t| t.lines().next().and_then(|l| l.trim().parse().ok()))
    })
    .await;
    let asked = std::time::Instant::now();
    cluster.mur_ok(&["task", "cancel", &task]).await;
    let record = cluster.wait_record(&task, WAIT, |r| r.state.is_terminal()).await;
    let took = asked.elapsed();
    assert!(took < Duration::from_secs(1) + Duration::from_millis(900), "the cancel took {took:?}");
    assert_eq!((record.state, record.result.as_deref()), (TaskState::Canceled, Some("canceled")));
    until("the hook's process is gone", WAIT, || async {
        matches!(proc_state(hook_pid), None | Some('Z')).then_some(())
    })
    .await;
    // The session's lines (hook lines carry the session id, not the task id).
    let session = record.session_id.clone().unwrap();
    let all = mur_tests::nats::stream_json(&cluster.client, cluster::TRACE_STREAM, None).await;
    let trace: Vec<Value> = all.into_iter().filter(|l| l["session_id"] == session.as_str()).collect();
    let errors: Vec<(&str, &str)> = of_type(&trace, "hook_dispatch_error")
        .iter()
        .map(|l| (l["hook_name"].as_str().unwrap(), l["message"].as_str().unwrap()))
        .collect();
    let types: Vec<&str> = trace.iter().map(|l| l["event_type"].as_str().unwrap_or("?")).collect();
    assert_eq!(errors.len(), 2, "{errors:?} {types:?}");
    assert!(errors.iter().all(|(_, m)| m.contains("the task was cancelled")), "{errors:?}");
    assert_eq!(of_type(&trace, "inference").len(), 0, "no model call after the cancel");
    assert!(!pids.exists(), "the hooks ran in the worker's bundle copy");
}

/// Every local `task_start` line of `task_id` in the workers' session folders under `dir`.
fn local_task_starts(dir: &std::path::Path, task_id: &str) -> Vec<Value> {
    let mut out = Vec::new();
    for trace in walk(dir).into_iter().filter(|p| p.ends_with("trace.jsonl")) {
        for line in std::fs::read_to_string(&trace).unwrap_or_default().lines() {
            let v: Value = serde_json::from_str(line).unwrap_or(Value::Null);
            if v["event_type"] == "task_start" && v["task_id"] == task_id {
                out.push(v);
            }
        }
    }
    out.sort_by_key(|v| v["timestamp"].as_u64());
    out
}

fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

/// Invariants 3 and 7, issue #8 §Poison tasks: a task that kills every worker that runs
/// it is delivered `max_deliver` (3) times, an ack wait apart, then ends `failed` in the
/// dead letters with the reason; a task behind it in the same lane still runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_that_kills_its_workers_ends_in_the_dead_letters_and_its_lane_flows() {
    let cluster = Procs::start("jetstream:\n  ack_wait_secs: 2\n  max_deliver: 3\n").await;
    let _coordinator = cluster.coordinator("coordinator-1");
    // Its command runs again at each takeover (issue #34: declared idempotent).
    let capsule = idempotent_shell_capsule("risky");
    cluster.push(capsule.dir()).await;
    let mut started = 0;
    let mut worker = cluster.worker("wkr-0", 1);
    cluster.wait_workers(1).await;
    // The shell command's parent is the worker process itself.
    let poison = cluster.submit("risky", "kill -9 $PPID", Origin::User).await;
    let fine = cluster.submit("risky", "echo fine", Origin::User).await;

    // A supervisor: a worker that died is replaced, as a process manager would.
    let record = until("the poison task is terminal", WAIT, || {
        if !worker.is_running() {
            started += 1;
            worker = cluster.worker(&format!("wkr-{started}"), 1);
        }
        async { cluster.record(&poison).await.filter(|r| r.state.is_terminal()) }
    })
    .await;
    assert_eq!((record.state, record.exit_status), (TaskState::Failed, Some(mur_proto::ExitStatus::Failed)));
    let dead = record.dead_letter.clone().expect("a dead letter");
    assert_eq!(dead.deliveries, 3);
    assert!(dead.reason.contains("delivered 3 times"), "{}", dead.reason);
    assert_eq!(record.error.as_deref(), Some(dead.reason.as_str()));

    // Three deliveries, each after the previous one's ack wait (2 s), never at once.
    let starts = local_task_starts(cluster.dir(), &poison);
    assert_eq!(starts.len(), 3, "{starts:?}");
    for pair in starts.windows(2) {
        let gap = pair[1]["timestamp"].as_u64().unwrap() - pair[0]["timestamp"].as_u64().unwrap();
        assert!(gap >= 1_500, "deliveries {gap} ms apart");
    }

    // `mur task status` shows it with the reason.
    let out = mur_tests::mur::Run::of(
        mur_tests::mur::mur().args(["task", "status", &poison]).env("NATS_URL", cluster.nats.url()),
    );
    assert!(out.stdout.contains("dead letter: the dispatch was delivered 3 times"), "{out:?}");
    // `mur cluster status` lists it, names the leader, and the workers.
    let out = mur_tests::mur::Run::of(
        mur_tests::mur::mur().args(["cluster", "status", "--json"]).env("NATS_URL", cluster.nats.url()),
    );
    assert_eq!(out.code, 0, "{out:?}");
    let status = out.last_json();
    assert_eq!(status["leader"]["instance"], "coordinator-1");
    assert_eq!(status["dead_letters"][0]["task_id"], poison.as_str());
    assert_eq!(status["dead_letters"][0]["dead_letter"]["deliveries"], 3);
    let out =
        mur_tests::mur::Run::of(mur_tests::mur::mur().args(["cluster", "status"]).env("NATS_URL", cluster.nats.url()));
    assert!(out.stdout.contains("leader    coordinator-1"), "{out:?}");
    assert!(out.stdout.contains("dead letters 1"), "{out:?}");

    if !worker.is_running() {
        worker = cluster.worker("wkr-last", 1);
    }
    let after = cluster.wait_record(&fine, WAIT, |r| r.state.is_terminal()).await;
    assert_eq!((after.state, after.result.as_deref()), (TaskState::Completed, Some("ran: echo fine")));
    drop(worker);
}

/// Issue #29 item 1: a task given up while no coordinator runs is not lost. The poison
/// task is taken by the one worker (one slot), the coordinator is killed, and the task
/// uses its `max_deliver` (2) deliveries with no coordinator up; JetStream's notice is kept
/// in `MUR_DEAD_LETTERS`, and once a coordinator leads the task ends `failed` with its
/// dead letter, the notice is consumed, and the slot it held takes a new task. Before, the
/// notice was a core NATS message nobody heard: the task stayed `working` and held the
/// slot for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_given_up_while_no_coordinator_runs_is_dead_lettered_once_one_leads_and_frees_its_slot() {
    let cluster = Procs::start("jetstream:\n  ack_wait_secs: 2\n  max_deliver: 2\n").await;
    let mut first = cluster.coordinator("coordinator-1");
    // Its command runs again at each takeover (issue #34: declared idempotent).
    let capsule = idempotent_shell_capsule("risky");
    cluster.push(capsule.dir()).await;
    let mut started = 0;
    let mut worker = cluster.worker("wkr-0", 1);
    cluster.wait_workers(1).await;
    // The shell command's parent is the worker process itself.
    let poison = cluster.submit("risky", "kill -9 $PPID", Origin::User).await;
    cluster.wait_record(&poison, WAIT, |r| r.state == TaskState::Working).await;
    first.kill9();

    // A supervisor replaces each worker the task kills, until JetStream has given the
    // dispatch up: delivered twice, none of them acked, nothing left to deliver.
    let js = async_nats::jetstream::new(cluster.client.clone());
    let dispatch = js.get_stream(cluster::DISPATCH_STREAM).await.unwrap();
    until("the dispatch's deliveries are used up", WAIT, || {
        if !worker.is_running() {
            started += 1;
            worker = cluster.worker(&format!("wkr-{started}"), 1);
        }
        let starts = local_task_starts(cluster.dir(), &poison).len();
        let dispatch = &dispatch;
        async move {
            let info = dispatch.consumer_info(cluster::DISPATCH_CONSUMER).await.ok()?;
            (starts == 2 && info.num_ack_pending == 0 && info.num_pending == 0).then_some(())
        }
    })
    .await;
    let notices = until("the notice is kept while no coordinator runs", WAIT, || async {
        let mut stream = js.get_stream(cluster::DEAD_LETTER_STREAM).await.ok()?;
        let messages = stream.info().await.ok()?.state.messages;
        (messages > 0).then_some(messages)
    })
    .await;
    assert_eq!(notices, 1);
    let before = cluster.record(&poison).await.unwrap();
    assert_eq!(before.state, TaskState::Working, "{before:?}");

    let _second = cluster.coordinator("coordinator-2");
    let record = cluster.wait_record(&poison, WAIT, |r| r.state.is_terminal()).await;
    assert_eq!((record.state, record.exit_status), (TaskState::Failed, Some(mur_proto::ExitStatus::Failed)));
    let dead = record.dead_letter.clone().expect("a dead letter");
    assert_eq!(dead.deliveries, 2);
    assert!(dead.reason.contains("delivered 2 times"), "{}", dead.reason);
    until("the notice is consumed", WAIT, || async {
        let mut stream = js.get_stream(cluster::DEAD_LETTER_STREAM).await.ok()?;
        (stream.info().await.ok()?.state.messages == 0).then_some(())
    })
    .await;

    // The one slot is free again: a new task runs on it.
    if !worker.is_running() {
        worker = cluster.worker("wkr-last", 1);
    }
    let fine = cluster.submit("risky", "echo fine", Origin::User).await;
    let after = cluster.wait_record(&fine, WAIT, |r| r.state.is_terminal()).await;
    assert_eq!((after.state, after.result.as_deref()), (TaskState::Completed, Some("ran: echo fine")));
    drop(worker);
}

/// Invariants 3 and 8: a task that outlives several ack waits while its worker is alive
/// and sends in-progress acks is never delivered to a second worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_task_with_a_live_worker_is_never_delivered_twice() {
    let cluster = Procs::start("jetstream:\n  ack_wait_secs: 2\n").await;
    let _coordinator = cluster.coordinator("coordinator-1");
    let _a = cluster.worker("wkr-a", 1);
    let _b = cluster.worker("wkr-b", 1);
    let capsule = shell_capsule("slow");
    cluster.push(capsule.dir()).await;
    cluster.wait_workers(2).await;
    // 7 s: three and a half ack waits.
    let task = cluster.submit("slow", "sleep 7", Origin::User).await;
    let record = cluster.wait_record(&task, WAIT, |r| r.state.is_terminal()).await;
    assert_eq!(record.state, TaskState::Completed, "{record:?}");
    let starts = local_task_starts(cluster.dir(), &task);
    assert_eq!(starts.len(), 1, "{starts:?}");
    let trace = cluster.trace_of(&task).await;
    assert!(of_type(&trace, "task_takeover").is_empty());
    assert_eq!(of_type(&trace, "task_start").len(), 1);
    assert_eq!(of_type(&trace, "task_end").len(), 1);
}

/// Invariant 3 with the broker itself killed: nats-server is killed (SIGKILL) and started
/// again on the same store while 30 tasks flow through two workers; every task reaches
/// one terminal record, `completed`, and the workers and coordinator go on by themselves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_task_finishes_across_a_nats_server_restart() {
    let mut cluster = Procs::start("jetstream:\n  ack_wait_secs: 3\n").await;
    let _coordinator = cluster.coordinator("coordinator-1");
    let _a = cluster.worker("wkr-a", 4);
    let _b = cluster.worker("wkr-b", 4);
    let capsule = shell_capsule("steady");
    cluster.push(capsule.dir()).await;
    cluster.wait_workers(2).await;
    let mut ids = Vec::new();
    for i in 0..30 {
        ids.push(cluster.submit("steady", &format!("sleep 0.2; echo {i}"), Origin::User).await);
    }
    // Restart the server once some tasks have finished and others are running or waiting.
    until("5 tasks done", WAIT, || async {
        let mut done = 0;
        for id in &ids {
            if cluster.record(id).await.is_some_and(|r| r.state.is_terminal()) {
                done += 1;
            }
        }
        (done >= 5).then_some(())
    })
    .await;
    cluster.nats.restart();
    for (i, id) in ids.iter().enumerate() {
        let r = cluster.wait_record(id, WAIT, |r| r.state.is_terminal()).await;
        assert_eq!(r.state, TaskState::Completed, "{r:?}");
        assert_eq!(r.result.as_deref(), Some(format!("ran: sleep 0.2; echo {i}").as_str()));
    }
    for id in &ids {
        let ends = of_type(&cluster.trace_of(id).await, "task_end").len();
        assert!(ends <= 1, "{id}: {ends} task_end lines");
    }
}

/// Invariants 3 and 2 across a coordinator failover (issue #8 §Standby coordinators): two
/// coordinators, one leads; SIGKILL the leader while 50 tasks are queued; the standby
/// takes the lease when it expires, restores from the buckets, and all 50 tasks reach one
/// terminal record, `completed`, each run once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_standby_takes_over_when_the_leader_is_killed_and_all_50_tasks_finish_once() {
    standby_takes_over(Procs::start("jetstream:\n  ack_wait_secs: 3\n  leader_lease_secs: 2\n").await).await;
}

/// The same with authentication and TLS on (issue #31), each process with its role's
/// credentials.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_with_tls_and_role_credentials_the_standby_takes_over_from_a_killed_leader() {
    standby_takes_over(Procs::start_secured("jetstream:\n  ack_wait_secs: 3\n  leader_lease_secs: 2\n").await).await;
}

async fn standby_takes_over(cluster: Procs) {
    let mut first = cluster.coordinator("coordinator-1");
    let js = async_nats::jetstream::new(cluster.client.clone());
    let leader = until("coordinator-1 leads", WAIT, || async {
        let kv = js.get_key_value(cluster::LEADER_BUCKET).await.ok()?;
        mur_coordinator::lease::Lease::holder(&kv).await.ok().flatten()
    })
    .await;
    assert_eq!(leader.instance, "coordinator-1");
    let second = cluster.coordinator("coordinator-2");
    let capsule = shell_capsule("many");
    cluster.push(capsule.dir()).await;
    // No worker yet: the 50 tasks queue up behind the leader.
    let mut ids = Vec::new();
    for i in 0..50 {
        ids.push(
            cluster
                .submit("many", &format!("echo {i} >> {}", capsule.dir().join("ran.txt").display()), Origin::User)
                .await,
        );
    }
    first.kill9();
    let w1 = cluster.worker("wkr-1", 4);
    let w2 = cluster.worker("wkr-2", 4);
    for id in &ids {
        let r = cluster.wait_record(id, WAIT, |r| r.state.is_terminal()).await;
        assert_eq!(r.state, TaskState::Completed, "{r:?}");
    }
    let kv = js.get_key_value(cluster::LEADER_BUCKET).await.unwrap();
    let now = mur_coordinator::lease::Lease::holder(&kv).await.unwrap().expect("a leader");
    assert_eq!(now.instance, "coordinator-2");
    assert!(now.term > leader.term);
    // Each task ran exactly once.
    let mut ran = ran_turns(&capsule);
    ran.sort_unstable();
    assert_eq!(ran, (0..50).collect::<Vec<u32>>());
    // With credentials on, nothing the processes did was refused by the server.
    for log in [second.log(), w1.log(), w2.log()] {
        assert!(!log.contains("Permissions Violation"), "{log}");
    }
}

/// A task cancelled while a new leader restores (the API answers during the restore) is
/// not replayed as waiting: the restore takes each record's last entry, and a release
/// refused because the record has ended gives its slot back; a task sent after runs on the
/// one slot there is, and nothing is left waiting or in flight. Before, a record
/// written during the replay was restored from its earlier `submitted` entry (its
/// `canceled` one dropped as ended); the scheduler released it, the release was refused,
/// and its slot stayed taken for good: nothing else ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tasks_cancelled_during_a_restore_are_not_replayed_and_hold_no_slot() {
    use mur_proto::cluster::{TaskRef, api};
    let cluster = Procs::start("jetstream:\n  ack_wait_secs: 3\n").await;
    let mut first = cluster.coordinator("coordinator-1");
    let capsule = shell_capsule("shx");
    cluster.push(capsule.dir()).await;
    let mut waiting = Vec::new();
    for i in 0..3 {
        waiting.push(cluster.submit("shx", &format!("echo {i}"), Origin::User).await);
    }
    assert_eq!(first.terminate(WAIT), Some(0));
    // A store whose replay takes a while: 1500 ended tasks with 100 KB results.
    let js = async_nats::jetstream::new(cluster.client.clone());
    let tasks = js.get_key_value(cluster::TASKS_BUCKET).await.unwrap();
    mur_tests::procs::store_ended_tasks(&tasks, 1500, 100_000).await;
    let second = cluster.coordinator("coordinator-2");
    until("coordinator-2 leads", WAIT, || async { second.log().contains(" leading (term ").then_some(()) }).await;
    for id in &waiting {
        let body = serde_json::to_vec(&TaskRef { task_id: TaskId::unchecked(id.clone()) }).unwrap();
        let record: cluster::TaskRecord =
            mur_nats::api::call(&cluster.client, api::TASK_CANCEL, body).await.expect("cancel");
        assert_eq!(record.state, TaskState::Canceled);
    }
    until("coordinator-2 restores", WAIT, || async { second.log().contains("coordinator restored").then_some(()) })
        .await;
    // One slot: a cancelled task replayed as waiting would take it for good.
    let _worker = cluster.worker("wkr-1", 1);
    let after = cluster.submit("shx", "echo after", Origin::User).await;
    let done = cluster.wait_record(&after, WAIT, |r| r.state.is_terminal()).await;
    assert_eq!(done.state, TaskState::Completed, "{done:?}");
    let status = until("nothing waiting or in flight", WAIT, || async {
        let out = mur_tests::mur::Run::of(cluster.command().args(["cluster", "status", "--json"]));
        let v = out.last_json();
        (v["lanes"] == serde_json::json!([]) && v["in_flight"] == serde_json::json!([])).then_some(v)
    })
    .await;
    assert_eq!(status["workers"][0]["free"], 1, "{status}");
}

/// A submission that carries its own task id (`task_id`, as `mur task send` mints one) is
/// one task however often it is sent: sent again, it is answered with the stored task (its
/// state now) and runs once; the same id with another text is refused (`conflict`) and
/// changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_submission_sent_twice_with_its_own_task_id_runs_once() {
    use mur_proto::cluster::{SubmitReply, SubmitRequest, api};
    let cluster = Procs::start("jetstream:\n  ack_wait_secs: 3\n").await;
    let _coordinator = cluster.coordinator("coordinator-1");
    let capsule = shell_capsule("once");
    cluster.push(capsule.dir()).await;
    let ran = capsule.dir().join("ran.txt");
    let id = mur_proto::Id::generate(mur_proto::IdKind::Task).to_string();
    let request = |text: String| SubmitRequest {
        task_id: Some(TaskId::unchecked(id.clone())),
        ..SubmitRequest::new("once", text, Origin::User)
    };
    let text = format!("echo ran >> {}", ran.display());
    let send = |request: SubmitRequest| {
        let client = cluster.client.clone();
        async move {
            mur_nats::api::call::<SubmitReply>(&client, api::TASK_SUBMIT, serde_json::to_vec(&request).unwrap()).await
        }
    };
    // Sent until the coordinator answers (it may not serve yet): the same task each time.
    let first = until("the coordinator answers", WAIT, || async { send(request(text.clone())).await.ok() }).await;
    assert_eq!((first.task_id.as_str(), first.state), (id.as_str(), TaskState::Submitted));
    let again = send(request(text.clone())).await.expect("the same submission again");
    assert_eq!(again.task_id, id);
    let _worker = cluster.worker("wkr-1", 2);
    let done = cluster.wait_record(&id, WAIT, |r| r.state.is_terminal()).await;
    assert_eq!(done.state, TaskState::Completed, "{done:?}");
    let late = send(request(text.clone())).await.expect("the same submission once it has ended");
    assert_eq!((late.task_id.as_str(), late.state), (id.as_str(), TaskState::Completed));
    let other = send(request("echo other".into())).await.expect_err("another task under a taken id");
    assert_eq!(other.code, mur_proto::cluster::ErrorCode::Conflict);
    assert_eq!(
        other.message,
        format!(
            "task_id: {id} is another task's (capsule \"once\", submitted at {} unix ms); mint a new id",
            done.submitted_at
        )
    );
    assert_eq!(cluster.record(&id).await.unwrap(), done, "the refused one changed nothing");
    assert_eq!(std::fs::read_to_string(&ran).unwrap(), "ran\n", "the task ran once");
    let runs = cluster.trace_of(&id).await.into_iter().filter(|l| l["event_type"] == "task_start").count();
    assert_eq!(runs, 1);
}

/// `mur task send` with no coordinator answering (one restarting, or not yet up) says so
/// and sends the submission again, with the task id it minted, until one answers: the
/// task is accepted and runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mur_task_send_sends_again_until_a_coordinator_answers_and_the_task_runs_once() {
    let cluster = Procs::start("jetstream:\n  ack_wait_secs: 3\n").await;
    let js = async_nats::jetstream::new(cluster.client.clone());
    mur_coordinator::ensure(&js, &mur_coordinator::Settings::default()).await.expect("resources");
    let capsule = shell_capsule("late");
    cluster.push(capsule.dir()).await;
    let ran = capsule.dir().join("ran.txt");
    let err = cluster.dir().join("send.err");
    let mut send = cluster.command();
    send.args(["task", "send", "late", &format!("echo ran >> {}", ran.display())]);
    let send = send
        .stdout(std::process::Stdio::piped())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .expect("spawn mur task send");
    let retrying = until("the send says it sends again", WAIT, || async {
        let text = std::fs::read_to_string(&err).unwrap_or_default();
        text.contains("sending it again").then_some(text)
    })
    .await;
    let said = "mur: mur.api.task.submit: no coordinator answers (no responders); start one with `mur coordinator`, \
                or `mur dev` for a cluster on this machine; sending it again in ";
    assert!(retrying.starts_with(said), "{retrying}");
    // The first wait is 250 ms plus jitter of up to as much again (issue #30: one backoff).
    let (ms, rest) = retrying[said.len()..].split_once(" ms ").expect("a wait in ms");
    assert!((250..500).contains(&ms.parse::<u64>().unwrap()), "{retrying}");
    assert!(rest.starts_with("(task tsk_"), "{retrying}");
    let _coordinator = cluster.coordinator("coordinator-1");
    let _worker = cluster.worker("wkr-1", 1);
    let out = tokio::task::spawn_blocking(move || send.wait_with_output()).await.unwrap().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", std::fs::read_to_string(&err).unwrap());
    let id = String::from_utf8(out.stdout).unwrap().trim().to_string();
    assert!(retrying.contains(&format!("(task {id}: it runs once however often it is sent)")), "{retrying}");
    let done = cluster.wait_record(&id, WAIT, |r| r.state.is_terminal()).await;
    assert_eq!(done.state, TaskState::Completed, "{done:?}");
    assert_eq!(std::fs::read_to_string(&ran).unwrap(), "ran\n");
}

/// `mur task send` rides out a nats-server restart (issue #29 item 7): sends whose request
/// is in flight when the server is killed (the coordinator is paused, so none is answered
/// yet), sends started while it is down (each says it tries again) and sends started while
/// the clients reconnect all end accepted (exit 0), each with the id it minted, and each
/// is one task: the store holds exactly one record per send. Before, a send that could not
/// reach the server exited 2 at once (`cannot reach NATS`), though the README promised 30 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mur_task_send_rides_out_a_nats_server_restart_and_each_send_is_one_task() {
    use futures::StreamExt;
    let mut cluster = Procs::start("jetstream:\n  ack_wait_secs: 3\n").await;
    let coordinator = cluster.coordinator("coordinator-1");
    let capsule = shell_capsule("sent");
    cluster.push(capsule.dir()).await;
    cluster.submit("sent", "echo warm", Origin::User).await;
    // The test sees each submission the server carries to the coordinator.
    let mut seen = cluster.client.subscribe(cluster::api::TASK_SUBMIT).await.unwrap();
    cluster.client.flush().await.unwrap();
    let send = |cluster: &Procs, i: usize| {
        let err = cluster.dir().join(format!("send-{i}.err"));
        let child = cluster
            .command()
            .args(["task", "send", "sent", &format!("echo {i}")])
            .stdout(std::process::Stdio::piped())
            .stderr(std::fs::File::create(&err).unwrap())
            .spawn()
            .expect("spawn mur task send");
        (child, err)
    };
    let said = |err: &std::path::Path| std::fs::read_to_string(err).unwrap_or_default();
    // Five in flight as the server dies, five while it is down, five as clients reconnect.
    coordinator.pause();
    let mut sends: Vec<_> = (0..5).map(|i| send(&cluster, i)).collect();
    let in_flight = tokio::time::timeout(WAIT, (&mut seen).take(5).count()).await.expect("five submissions sent");
    assert_eq!(in_flight, 5);
    cluster.nats.kill();
    coordinator.resume();
    sends.extend((5..10).map(|i| send(&cluster, i)));
    until("the sends started while the server is down try again (or end)", WAIT, || {
        let trying = sends[5..].iter().all(|(_, err)| said(err).contains("; trying again in "));
        let ended = sends[5..].iter_mut().any(|(child, _)| child.try_wait().unwrap().is_some());
        async move { (trying || ended).then_some(()) }
    })
    .await;
    let down = said(&sends[5].1);
    assert!(down.starts_with("mur: cannot reach NATS at nats://127.0.0.1:"), "{down}");
    assert!(down.contains("(task tsk_"), "{down}");
    cluster.nats.resume();
    sends.extend((10..15).map(|i| send(&cluster, i)));

    let mut ids = Vec::new();
    for (i, (child, err)) in sends.into_iter().enumerate() {
        let out = tokio::task::spawn_blocking(move || child.wait_with_output()).await.unwrap().unwrap();
        assert_eq!(out.status.code(), Some(0), "send {i}: {}", said(&err));
        let id = String::from_utf8(out.stdout).unwrap().trim().to_string();
        let record = cluster.record(&id).await.unwrap_or_else(|| panic!("send {i}: no record of {id}"));
        assert_eq!(record.text, format!("echo {i}"));
        ids.push(id);
    }
    let js = async_nats::jetstream::new(cluster.client.clone());
    let tasks = js.get_key_value(cluster::TASKS_BUCKET).await.unwrap();
    let mut stored: Vec<String> = tasks.keys().await.unwrap().map(|k| k.unwrap()).collect().await;
    stored.sort();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 15);
    assert_eq!(stored.len(), 16, "one record per send, and the warm-up's: {stored:?}");
    assert!(ids.iter().all(|id| stored.contains(id)));
}

/// A new leader restores its scheduler from every record (a replay of seconds over a store
/// of gigabytes) while the API is answered and the lease renewed: a question asked as the
/// restore starts (`leading` in the log) is answered before it ends (`coordinator
/// restored`). Before, the API waited for the whole replay (222 ms over 300 MB in a release
/// build, `MUR_BENCH_PHASES=restore`) and the lease went unrenewed through it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_coordinator_answers_the_api_while_it_restores_a_big_store() {
    let cluster = Procs::start("jetstream:\n  ack_wait_secs: 3\n").await;
    let js = async_nats::jetstream::new(cluster.client.clone());
    let res = mur_coordinator::ensure(&js, &mur_coordinator::Settings::default()).await.expect("resources");
    // 1500 ended tasks with 100 KB results: the replay reads each (~150 MB).
    mur_tests::procs::store_ended_tasks(&res.tasks, 1500, 100_000).await;
    let coordinator = cluster.coordinator("coordinator-1");
    until("the coordinator leads", WAIT, || async { coordinator.log().contains(" leading (term ").then_some(()) })
        .await;
    let capsules: Vec<cluster::CapsuleEntry> =
        mur_nats::api::call(&cluster.client, cluster::api::CAPSULE_LIST, "").await.expect("capsule.list");
    assert!(capsules.is_empty(), "{capsules:?}");
    assert!(
        !coordinator.log().contains("coordinator restored"),
        "the question was answered only after the restore:\n{}",
        coordinator.log()
    );
    until("the coordinator restores", WAIT, || async {
        coordinator.log().contains("coordinator restored").then_some(())
    })
    .await;
}

/// A leader whose restore fails on the broker stands by and tries again rather than ending
/// the process: here the task bucket's stream allows one consumer and the test holds it, so
/// the broker refuses the restore's watch; once the test lets go, the coordinator leads
/// and a task runs. (Seen on a cold nats-server over a 1.5 GB store: creating the watch
/// took 12.8 s, past the client's 10 s timeout, and the coordinator exited.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_coordinator_whose_restore_fails_stands_by_and_tries_again() {
    let cluster = Procs::start("jetstream:\n  ack_wait_secs: 3\n").await;
    let js = async_nats::jetstream::new(cluster.client.clone());
    // The stream as the coordinator makes it (so it finds nothing to change), but for its
    // consumer limit, which the coordinator does not look at.
    let config = async_nats::jetstream::stream::Config {
        max_consumers: 1,
        ..mur_coordinator::Settings::default().tasks_stream()
    };
    let stream = js.create_stream(config).await.expect("the task bucket's stream");
    stream
        .create_consumer(async_nats::jetstream::consumer::pull::Config {
            durable_name: Some("held".into()),
            ..Default::default()
        })
        .await
        .expect("the one consumer allowed");
    let mut coordinator = cluster.coordinator("coordinator-1");
    until("the restore's watch is refused", WAIT, || async {
        coordinator.log().contains("mur_tasks: watch").then_some(())
    })
    .await;
    assert!(coordinator.is_running(), "the coordinator ended:\n{}", coordinator.log());
    assert!(coordinator.log().contains("restoring failed, standing by to try again"), "{}", coordinator.log());
    stream.delete_consumer("held").await.expect("letting go of the consumer");
    until("the coordinator restores", WAIT, || async {
        coordinator.log().contains("coordinator restored").then_some(())
    })
    .await;
    let _worker = cluster.worker("wkr-1", 1);
    let capsule = shell_capsule("after");
    cluster.push(capsule.dir()).await;
    let task = cluster.submit("after", "echo ran", Origin::User).await;
    let record = cluster.wait_record(&task, WAIT, |r| r.state.is_terminal()).await;
    assert_eq!(record.state, TaskState::Completed, "{record:?}");
    assert!(coordinator.is_running(), "the coordinator ended:\n{}", coordinator.log());
}

/// Issue #8 §Observability of the queue: `mur cluster status --json` shows each capsule's
/// lane with its pending count and oldest age, what is in flight with its worker and
/// attempt, the workers' free slots and the leader.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_status_shows_lanes_in_flight_workers_and_the_leader() {
    let cluster = Procs::start("jetstream:\n  ack_wait_secs: 3\n").await;
    let _coordinator = cluster.coordinator("coordinator-1");
    let _worker = cluster.worker("wkr-1", 1);
    let capsule = shell_capsule("busy");
    cluster.push(capsule.dir()).await;
    cluster.wait_workers(1).await;
    let running = cluster.submit("busy", "sleep 30", Origin::User).await;
    cluster.wait_record(&running, WAIT, |r| r.state == TaskState::Working).await;
    for origin in [Origin::User, Origin::Peer, Origin::Peer, Origin::Event] {
        cluster.submit("busy", "echo later", origin).await;
    }
    let status = until("a status with the worker's slot taken", WAIT, || async {
        let out = mur_tests::mur::Run::of(
            mur_tests::mur::mur().args(["cluster", "status", "--json"]).env("NATS_URL", cluster.nats.url()),
        );
        let v = out.last_json();
        (v["workers"][0]["free"] == 0).then_some(v)
    })
    .await;
    assert_eq!(status["leader"]["instance"], "coordinator-1");
    let lanes: Vec<(String, String, u64)> = status["lanes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| {
            (l["capsule"].as_str().unwrap().into(), l["lane"].as_str().unwrap().into(), l["pending"].as_u64().unwrap())
        })
        .collect();
    assert_eq!(
        lanes,
        [("busy".into(), "user".into(), 1), ("busy".into(), "peer".into(), 2), ("busy".into(), "bg".into(), 1)]
    );
    assert!(status["lanes"][0]["oldest_age_ms"].is_u64());
    let in_flight = status["in_flight"].as_array().unwrap();
    assert_eq!(in_flight.len(), 1);
    assert_eq!(
        (in_flight[0]["task_id"].as_str(), in_flight[0]["worker"].as_str(), in_flight[0]["attempt"].as_u64()),
        (Some(running.as_str()), Some("wkr-1"), Some(1))
    );
    assert_eq!(status["workers"][0]["worker_id"], "wkr-1");
    assert_eq!(status["workers"][0]["slots"], 1);
    assert_eq!(status["workers"][0]["live"], true);
    assert_eq!(status["dead_letters"], serde_json::json!([]));
}

/// Invariant 2 across a takeover: a `queue` capsule's worker is killed in the middle of its
/// first task; the task is taken over on the other worker, and no other task of the
/// capsule starts until it has ended — every run's "start" is followed by its own "end",
/// but for the killed one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_capsule_runs_one_task_at_a_time_through_a_worker_kill() {
    let cluster = Procs::start("jetstream:\n  ack_wait_secs: 2\n").await;
    let _coordinator = cluster.coordinator("coordinator-1");
    let capsule = TestCapsule::new(
        "name: serial\nversion: 1.0.0\ninference:\n  driver: scripted\n  script: r.yaml\ncapabilities:\n  shell:\n    allow: [sh]\n    idempotent: true\nlifecycle:\n  task_acceptance: queue\n",
        &[],
    );
    let log = capsule.dir().join("log.txt");
    let (pids, go) = (capsule.dir().join("pids.txt"), capsule.dir().join("go"));
    // Each run notes its shell's pid and "start N", then holds until the test says go: the
    // killed run cannot reach "end 1" before its worker is killed, however loaded the box.
    std::fs::write(
        capsule.dir().join("r.yaml"),
        format!(
            "replies:\n  - tool_calls: [{{ name: sh, input: {{ command: \"echo $$ >> {p} && echo start {{{{task}}}} >> {l} && while [ ! -e {g} ]; do sleep 0.05; done && echo end {{{{task}}}} >> {l}\" }} }}]\n  - text: done\n",
            p = pids.display(),
            l = log.display(),
            g = go.display(),
        ),
    )
    .unwrap();
    cluster.push(capsule.dir()).await;
    let mut first = cluster.worker("wkr-first", 2);
    cluster.wait_workers(1).await;
    let mut ids = Vec::new();
    for i in 1..=3 {
        ids.push(cluster.submit("serial", &i.to_string(), Origin::User).await);
    }
    until("task 1 started", WAIT, || async {
        std::fs::read_to_string(&log).ok().filter(|t| t.contains("start 1")).map(drop)
    })
    .await;
    first.kill9();
    // Its command dies with it (the lifeline); only then may the runs go on.
    let pid: u32 = std::fs::read_to_string(&pids).unwrap().lines().next().unwrap().trim().parse().unwrap();
    // (When task 2 overtook task 1, its command had detached before the kill and ran on.)
    until_gone(&[pid], WAIT, &first).await;
    std::fs::write(&go, "").unwrap();
    let _second = cluster.worker("wkr-second", 2);
    for id in &ids {
        let r = cluster.wait_record(id, WAIT, |r| r.state.is_terminal()).await;
        assert_eq!(r.state, TaskState::Completed, "{r:?}");
    }
    let text = std::fs::read_to_string(&log).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    // The killed worker's command died with it (it never wrote "end 1"); the takeover ran
    // it again (in doubt, declared idempotent: issue #34); then every run is "start N" and its own "end N", in order: never two at once.
    assert_eq!(lines, ["start 1", "start 1", "end 1", "start 2", "end 2", "start 3", "end 3"]);
}

/// Waits until every process of `pids` (a killed worker's commands) is gone, a zombie
/// counting as gone, at most `within`. A miss fails with what it needs to be understood:
/// every process left (`ps`: group, parent, state, command line) and the worker's log.
async fn until_gone(pids: &[u32], within: Duration, worker: &mur_tests::procs::Proc) {
    let deadline = tokio::time::Instant::now() + within;
    while !pids.iter().all(|&p| matches!(proc_state(p), None | Some('Z'))) {
        if tokio::time::Instant::now() >= deadline {
            let ps = std::process::Command::new("ps")
                .args(["-eo", "pid,pgid,ppid,stat,etime,args"])
                .output()
                .map_or_else(|e| format!("ps: {e}"), |o| String::from_utf8_lossy(&o.stdout).into_owned());
            panic!(
                "the killed worker's commands {pids:?} still run after {within:?}:\n{ps}\nits log:\n{}",
                worker.log()
            );
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// Invariant 4 (a turn may run again after a crash, not twice at once): a worker killed
/// with SIGKILL in the middle of a shell command takes the command's whole process group with
/// it — the command and what it started in the background — so a takeover's run would be
/// the only one. A command already detached is left to run out on its own, as the
/// session-loop seed says of a runtime killed outright (§What a resume reports).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_workers_foreground_command_dies_with_it_and_a_detached_one_runs_on() {
    let cluster = Procs::start("jetstream:\n  ack_wait_secs: 2\n").await;
    let _coordinator = cluster.coordinator("coordinator-1");
    let capsule = TestCapsule::new(
        "name: lingering\nversion: 1.0.0\ninference:\n  driver: scripted\n  script: r.yaml\ncapabilities:\n  shell:\n    allow: [sh]\nlifecycle:\n  shell_grace_secs: 3\n",
        &[],
    );
    let pids = capsule.dir().join("pids.txt");
    // Turn 1 detaches after the grace period; turn 2 is in the foreground when the kill comes.
    let command = |tag: &str| format!("sleep 60 & echo {tag} $$ $! >> {} && sleep 60", pids.display());
    std::fs::write(
        capsule.dir().join("r.yaml"),
        format!(
            "replies:\n  - tool_calls: [{{ name: sh, input: {{ command: \"{}\" }} }}]\n  - tool_calls: [{{ name: sh, input: {{ command: \"{}\" }} }}]\n  - text: done\n",
            command("detached"),
            command("foreground")
        ),
    )
    .unwrap();
    cluster.push(capsule.dir()).await;
    let mut worker = cluster.worker("wkr-doomed", 1);
    cluster.wait_workers(1).await;
    let task_id = cluster.submit("lingering", "go", Origin::User).await;
    let started = |tag: &'static str| {
        let pids = pids.clone();
        move || {
            let pids = pids.clone();
            async move {
                let text = std::fs::read_to_string(&pids).ok()?;
                let line = text.lines().find(|l| l.starts_with(tag))?;
                Some(line.split_whitespace().skip(1).map(|p| p.parse().unwrap()).collect::<Vec<u32>>())
            }
        }
    };
    let detached = until("the first command has started", WAIT, started("detached")).await;
    let foreground = until("the second command has started", WAIT, started("foreground")).await;
    let running = |pids: &[u32]| pids.iter().all(|&p| matches!(proc_state(p), Some(s) if s != 'Z'));
    assert!(running(&foreground) && running(&detached), "the shells and their background sleeps run before the kill");
    worker.kill9();
    // Within 45 s: the commands' own `sleep 60` ending must not pass for the kill.
    until_gone(&foreground, Duration::from_secs(45), &worker).await;
    assert!(running(&detached), "the detached command runs on");
    // Nothing else ran the task: the record still names the killed worker's run.
    let record = cluster.record(&task_id).await.unwrap();
    assert_eq!((record.state, record.worker.as_deref()), (TaskState::Working, Some("wkr-doomed")));
    // SAFETY: kill(2) takes plain integers; the group is the detached command's own.
    unsafe { libc::kill(-(detached[0] as libc::pid_t), libc::SIGKILL) };
}

/// Invariant 7 with a crash in the middle: a malformed dispatch (not JSON) and a dispatch
/// naming no task are terminated without touching any record; the worker that met them
/// is then killed, and the tasks around them still complete on another worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_dispatches_are_dropped_and_change_nothing_stored() {
    let cluster = Procs::start("jetstream:\n  ack_wait_secs: 2\n").await;
    let _coordinator = cluster.coordinator("coordinator-1");
    let mut first = cluster.worker("wkr-first", 1);
    let capsule = shell_capsule("plain");
    cluster.push(capsule.dir()).await;
    cluster.wait_workers(1).await;
    let before = cluster.submit("plain", "echo before", Origin::User).await;
    cluster.wait_record(&before, WAIT, |r| r.state.is_terminal()).await;
    let stored_before = cluster.record(&before).await.unwrap();

    let js = async_nats::jetstream::new(cluster.client.clone());
    for payload in [&b"{not json"[..], br#"{"task_id":"tsk_00000000000000000000000000000000","attempt":1}"#] {
        js.publish(cluster::DISPATCH_SUBJECT, payload.to_vec().into()).await.unwrap().await.unwrap();
    }
    // Both are taken off the work queue (terminated), not redelivered forever.
    let stream = js.get_stream(cluster::DISPATCH_STREAM).await.unwrap();
    until("the malformed dispatches are gone", WAIT, || {
        let mut stream = stream.clone();
        async move { (stream.info().await.ok()?.state.messages == 0).then_some(()) }
    })
    .await;
    first.kill9();
    let _second = cluster.worker("wkr-second", 1);
    let after = cluster.submit("plain", "echo after", Origin::User).await;
    let r = cluster.wait_record(&after, WAIT, |r| r.state.is_terminal()).await;
    assert_eq!((r.state, r.result.as_deref()), (TaskState::Completed, Some("ran: echo after")));
    assert_eq!(cluster.record(&before).await.unwrap(), stored_before, "nothing stored changed");
    let out = mur_tests::mur::Run::of(
        mur_tests::mur::mur().args(["task", "ls", "--json"]).env("NATS_URL", cluster.nats.url()),
    );
    assert_eq!(out.last_json().as_array().unwrap().len(), 2, "no record was made for the bogus dispatches");
}

/// Invariant 7 for `mur capsule push`: every folder is packed and checked before anything is
/// sent, so a broken capsule is refused for what it is even with no server to reach, and a
/// push of several folders of which one is broken stores none of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capsule_push_checks_every_folder_before_it_sends_anything() {
    let broken =
        TestCapsule::new("name: broken\nversion: 1.0.0\ninference:\n  driver: scripted\n  script: gone.yaml\n", &[]);
    let good = TestCapsule::new(
        "name: good\nversion: 1.0.0\ninference:\n  driver: scripted\n  script: r.yaml\n",
        &[("r.yaml", "replies:\n  - text: hi\n")],
    );
    let (good_dir, broken_dir) = (good.dir().to_str().unwrap(), broken.dir().to_str().unwrap());

    // No server listens on port 9: the capsule's own error comes first.
    let mut offline = mur_tests::mur::mur();
    offline.args(["capsule", "push", broken_dir, "--server", "nats://127.0.0.1:9"]);
    let run = mur_tests::mur::run_blocking(offline).await;
    assert_eq!(run.code, 2, "{run:?}");
    assert!(run.stderr.contains("inference.script"), "{run:?}");
    assert!(!run.stderr.contains("127.0.0.1:9"), "no connection was tried: {run:?}");

    let cluster = Procs::start("").await;
    let _coordinator = cluster.coordinator("coordinator-1");
    let listed = || async {
        let run = cluster.mur(&["capsule", "ls", "--json"]).await;
        (run.code == 0).then(|| serde_json::from_str::<Value>(run.stdout.trim()).unwrap())
    };
    assert_eq!(until("the cluster's resources exist", WAIT, listed).await, serde_json::json!([]));
    let run = cluster.mur(&["capsule", "push", good_dir, broken_dir]).await;
    assert_eq!(run.code, 2, "{run:?}");
    assert!(run.stderr.contains("inference.script"), "{run:?}");
    assert_eq!(listed().await.unwrap(), serde_json::json!([]), "nothing was pushed, the good folder neither");
    let run = cluster.mur_ok(&["capsule", "push", good_dir, "--json"]).await;
    assert_eq!(run.last_json()["name"], "good");
    assert_eq!(listed().await.unwrap().as_array().unwrap().len(), 1);
}

/// Issue #29 item 14: a standby coordinator said nothing a user could see (its "standing
/// by" line was at `info`, under the default `warn` filter), and `mur cluster status`
/// named the leader only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_coordinator_says_it_stands_by_and_cluster_status_lists_it() {
    let cluster = Procs::start("jetstream:\n  leader_lease_secs: 3\n").await;
    let first = cluster.coordinator_with_default_logs("coordinator-1");
    until("coordinator-1 says it leads", WAIT, || async {
        first.log().contains("coordinator coordinator-1 leading (term ").then_some(())
    })
    .await;
    let second = cluster.coordinator_with_default_logs("coordinator-2");
    until("coordinator-2 says it stands by", WAIT, || async {
        second.log().contains("coordinator coordinator-2 standing by: coordinator-1 leads").then_some(())
    })
    .await;
    let status = until("cluster status lists the standby", WAIT, || async {
        let run = cluster.mur_ok(&["cluster", "status", "--json"]).await;
        let status: Value = serde_json::from_str(&run.stdout).expect("status JSON");
        (status["standbys"].as_array().map(Vec::len) == Some(1)).then_some(status)
    })
    .await;
    assert_eq!(status["leader"]["instance"], "coordinator-1");
    assert_eq!(status["standbys"][0]["instance"], "coordinator-2", "{status}");
    let human = cluster.mur_ok(&["cluster", "status"]).await.stdout;
    assert!(human.starts_with("leader    coordinator-1 (term "), "{human}");
    assert!(human.contains("\nstandby   coordinator-2\n"), "{human}");
    // A standby that stops is no longer listed once its key ages out (the lease's 3 s).
    drop(second);
    until("the stopped standby is gone from the status", WAIT, || async {
        let run = cluster.mur_ok(&["cluster", "status", "--json"]).await;
        let status: Value = serde_json::from_str(&run.stdout).ok()?;
        (status["standbys"].as_array().map(Vec::len) == Some(0)).then_some(())
    })
    .await;
    drop(first);
}

/// What [`journal_chaos`] counted.
#[derive(Debug, Default)]
struct JournalCounts {
    /// Kills at (a) response journaled, (b) tool running, (c) tool ended, (d) model call.
    kills: [u32; 4],
    /// Lines in the outside file that repeat a key.
    duplicates: usize,
    /// `tool_call_in_doubt` lines, and how many of them were `rerun`.
    in_doubt: usize,
    reruns: usize,
    /// `journal_replay` lines: responses and results reused.
    replayed_responses: usize,
    replayed_results: usize,
    /// Requests the fake model server saw, and turns it was asked twice (a call in flight).
    requests: usize,
    asked_twice: usize,
}

/// Issue #34: one task of `calls` tool calls on real worker processes, SIGKILLed `kills`
/// times spread over four points — (a) after the model's response is journaled, before its
/// tool starts (an `on-inference` hook holds there), (b) while the tool runs (the tool
/// holds after its line), (c) after the tool ended, before the next model call (an
/// `on-tool-call` hook holds), (d) during the next model call (the fake model server
/// holds it) — each time another worker takes over. The tools append their
/// `MUR_TOOL_CALL_ID` to a file outside the session; `pay` is not idempotent, `notify` is
/// (and deduplicates on the key). The task completes once, the file has one line per call,
/// the model saw each turn once but for calls in flight, and the trace shows the replay.
async fn journal_chaos(calls: u32, kills: u32) -> JournalCounts {
    use mur_tests::fake_openai::{FakeOpenAi, FakeReply};
    use std::sync::{Arc, Mutex};
    let outside = tempfile::tempdir().unwrap();
    let dir = outside.path().to_path_buf();
    let log = dir.join("calls.txt");
    // Whether the next model request stalls; the turns whose request stalled.
    let stall: Arc<Mutex<(bool, Vec<u32>)>> = Arc::default();
    let fake = FakeOpenAi::responding({
        let stall = stall.clone();
        move |body| {
            let turn =
                body["messages"].as_array().map_or(0, |m| m.iter().filter(|m| m["role"] == "tool").count()) as u32;
            let mut s = stall.lock().unwrap();
            if s.0 {
                s.0 = false;
                s.1.push(turn);
                return FakeReply::Stall(Vec::new());
            }
            if turn >= calls {
                return FakeReply::text("finished");
            }
            // Every third call is the idempotent one, so that (b) hits both over the kills.
            let tool = if turn.is_multiple_of(3) { "notify" } else { "pay" };
            FakeReply::Json(serde_json::json!({
                "id": "chatcmpl-fake",
                "object": "chat.completion",
                "choices": [{
                    "index": 0,
                    "message": {"role": "assistant", "content": null, "tool_calls": [{
                        "id": format!("call_{turn}"), "type": "function",
                        "function": {"name": tool, "arguments": format!("{{\"n\":{turn}}}")},
                    }]},
                    "finish_reason": "tool_calls",
                }],
            }))
        }
    });
    let d = dir.display();
    let l = log.display();
    let hold =
        |name: &str| format!("if [ -e {d}/hold-{name} ]; then rm {d}/hold-{name}; touch {d}/held-{name}; sleep 60; fi");
    let manifest = format!(
        "name: ledger\nversion: 1.0.0\ninference:\n  driver: openai\n  endpoint: {url}\n  model: fake-model\n  max_turns: {max}\n\
         tools:\n  - name: pay\n    command: [sh, -c, 'cat > /dev/null; echo \"$MUR_TOOL_CALL_ID\" >> {l}; {b}; echo paid']\n\
         \x20 - name: notify\n    idempotent: true\n    command: [sh, -c, 'cat > /dev/null; grep -qx \"$MUR_TOOL_CALL_ID\" {l} || echo \"$MUR_TOOL_CALL_ID\" >> {l}; {b}; echo sent']\n\
         hooks:\n  - name: after-inference\n    binding: on-inference\n    command: [sh, -c, 'cat > /dev/null; {a}']\n    timeout_secs: 120\n\
         \x20 - name: after-tool\n    binding: on-tool-call\n    command: [sh, -c, 'cat > /dev/null; {c}']\n    timeout_secs: 120\n",
        url = fake.url(),
        max = calls + 5,
        a = hold("a"),
        b = hold("b"),
        c = hold("c"),
    );
    let capsule = TestCapsule::new(&manifest, &[]);
    let cluster = Procs::start("jetstream:\n  ack_wait_secs: 2\n  max_deliver: 100\n").await;
    let _coordinator = cluster.coordinator("coordinator-1");
    cluster.push(capsule.dir()).await;
    let mut started = 0;
    let mut worker = cluster.worker("wkr-0", 1);
    cluster.wait_workers(1).await;
    let task = cluster.submit("ledger", "go", Origin::User).await;

    let mut counts = JournalCounts::default();
    for i in 0..kills {
        let point = (i % 4) as usize;
        let stalled_before = stall.lock().unwrap().1.len();
        match point {
            0 => std::fs::write(dir.join("hold-a"), "").unwrap(),
            1 => std::fs::write(dir.join("hold-b"), "").unwrap(),
            2 => std::fs::write(dir.join("hold-c"), "").unwrap(),
            _ => stall.lock().unwrap().0 = true,
        }
        let held = ["held-a", "held-b", "held-c"].map(|f| dir.join(f));
        let hit = until("the kill point", WAIT, || {
            let (held, stall, cluster, task) = (&held, &stall, &cluster, &task);
            async move {
                let at = match point {
                    3 => stall.lock().unwrap().1.len() > stalled_before,
                    p => held[p].exists(),
                };
                if at {
                    return Some(true);
                }
                cluster.record(task).await.filter(|r| r.state.is_terminal()).map(|_| false)
            }
        })
        .await;
        if !hit {
            break;
        }
        worker.kill9();
        counts.kills[point] += 1;
        for f in &held {
            let _ = std::fs::remove_file(f);
        }
        started += 1;
        worker = cluster.worker(&format!("wkr-{started}"), 1);
    }
    for f in ["hold-a", "hold-b", "hold-c"] {
        let _ = std::fs::remove_file(dir.join(f));
    }
    stall.lock().unwrap().0 = false;

    let record = cluster.wait_record(&task, WAIT, |r| r.state.is_terminal()).await;
    assert_eq!((record.state, record.result.as_deref()), (TaskState::Completed, Some("finished")), "{record:?}");
    let trace = cluster.trace_of(&task).await;
    assert_eq!(of_type(&trace, "task_end").len(), 1);

    // One line per distinct call, every call's key once.
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    let distinct: std::collections::BTreeSet<&str> = lines.iter().copied().collect();
    counts.duplicates = lines.len() - distinct.len();
    let expected: std::collections::BTreeSet<String> =
        (0..calls).map(|t| cluster::tool_call_key(&task, t, 0)).collect();
    assert_eq!(distinct.iter().map(|s| s.to_string()).collect::<std::collections::BTreeSet<_>>(), expected);
    assert_eq!(counts.duplicates, 0, "{lines:?}");

    // The model saw each turn once, but a request in flight at a kill (d): twice.
    let requests = fake.requests();
    counts.requests = requests.len();
    let stalled = stall.lock().unwrap().1.clone();
    for turn in 0..=calls {
        let seen = requests
            .iter()
            .filter(|b| {
                b["messages"].as_array().map_or(0, |m| m.iter().filter(|m| m["role"] == "tool").count()) as u32 == turn
            })
            .count();
        let in_flight = stalled.iter().filter(|&&t| t == turn).count();
        assert_eq!(seen, 1 + in_flight, "turn {turn} was asked {seen} times ({in_flight} in flight at a kill)");
        counts.asked_twice += in_flight;
    }

    // The trace shows the replay: each (b) kill left one call in doubt — the idempotent
    // tool's rerun with its key, the other's reported to the model.
    let in_doubt = of_type(&trace, "tool_call_in_doubt");
    counts.in_doubt = in_doubt.len();
    counts.reruns = in_doubt.iter().filter(|l| l["action"] == "rerun").count();
    for l in &in_doubt {
        let expected = if l["tool_name"] == "notify" { "rerun" } else { "reported" };
        assert_eq!(l["action"], expected, "{l}");
        assert!(l["previous_worker"].as_str().unwrap().starts_with("wkr-"), "{l}");
    }
    assert_eq!(counts.in_doubt, counts.kills[1] as usize, "{in_doubt:?}");
    assert_eq!(record.tool_calls_in_doubt as usize, counts.in_doubt);
    let replays = of_type(&trace, "journal_replay");
    counts.replayed_responses = replays.iter().filter(|l| l["what"] == "model_response").count();
    counts.replayed_results = replays.iter().filter(|l| l["what"] == "tool_result").count();
    // A reused response brings its tokens (billed once, by the worker that died).
    for l in replays.iter().filter(|l| l["what"] == "model_response") {
        assert!(l["tokens"]["input_tokens"].as_u64().is_some_and(|n| n > 0), "{l}");
    }
    // (a), (b), (c) each leave the turn's response journaled; (c) its result too.
    assert!(counts.replayed_responses >= (counts.kills[0] + counts.kills[1] + counts.kills[2]) as usize, "{counts:?}");
    assert!(counts.replayed_results >= counts.kills[2] as usize, "{counts:?}");
    println!("journal chaos: {calls} calls, {counts:?}");
    drop(worker);
    counts
}

/// Issue #34, the CI version: one kill at each of the four points.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_no_tool_call_runs_twice_when_its_worker_is_killed_at_any_point() {
    let counts = journal_chaos(6, 4).await;
    assert_eq!(counts.kills, [1, 1, 1, 1], "{counts:?}");
}

/// Issue #34, the long version: 20 kills spread over the four points (about two minutes).
/// `cargo test -p mur-tests --test integration chaos_twenty -- --ignored --nocapture`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "long: 20 worker kills; run with --ignored"]
async fn chaos_twenty_kills_over_the_four_points_duplicate_no_tool_call() {
    let counts = journal_chaos(30, 20).await;
    assert_eq!(counts.kills.iter().sum::<u32>(), 20, "{counts:?}");
}
