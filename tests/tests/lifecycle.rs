//! Capsule lifecycle over real HTTP (issue #5): task acceptance, lanes, idle exit and
//! shutdown of a capsule run by `mur run`, driven through its A2A endpoint.

use mur_proto::task::Origin;
use mur_tests::capsule::TestCapsule;
use mur_tests::mur::{Background, mur, trace_lines};
use mur_worker::a2a::client::{Client, SendOptions};
use mur_worker::a2a::v1::TaskState;
use serde_json::Value;
use std::path::Path;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(30);

fn manifest(acceptance: &str, extra: &str) -> String {
    format!(
        "name: life\nversion: 1.0.0\ninference:\n  driver: scripted\n  script: r.yaml\nlifecycle:\n  task_acceptance: {acceptance}\n{extra}"
    )
}

/// Starts `mur run --json` on `capsule` with `args`; returns the process and its URL.
fn start(capsule: &TestCapsule, args: &[&str]) -> (Background, Value) {
    let mut bg = Background::spawn(mur().arg("run").arg(capsule.dir()).arg("--json").args(args));
    let first = bg.next_json(WAIT);
    assert!(first["url"].as_str().unwrap().starts_with("http://127.0.0.1:"), "{first}");
    assert!(first["session_id"].as_str().unwrap().starts_with("ses_"));
    (bg, first)
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

fn send(url: &str, text: &str, origin: Option<Origin>) -> mur_worker::a2a::v1::Task {
    rt().block_on(Client::new(url).send(text, &SendOptions { origin, context_id: None })).unwrap()
}

#[test]
fn queued_tasks_start_in_lane_order_whatever_their_arrival() {
    // The first task (given at launch, origin user) is slow; meanwhile five arrive over HTTP.
    let replies = "replies:\n  - text: first\n    delay_ms: 3000\n  - text: a\n  - text: b\n  - text: c\n  - text: d\n  - text: e\n";
    let c = TestCapsule::new(&manifest("queue", "  after_task: exit\n  queue_depth: 10\n"), &[("r.yaml", replies)]);
    let (mut bg, first) = start(&c, &["--task", "launch task"]);
    let url = first["url"].as_str().unwrap().to_string();
    for (text, origin) in [
        ("b1", None),
        ("b2", Some(Origin::Completion)),
        ("p1", Some(Origin::Peer)),
        ("b3", Some(Origin::User)), // a claimed user origin is read as event
        ("p2", Some(Origin::Peer)),
    ] {
        let task = send(&url, text, origin);
        assert_eq!(task.status.state, TaskState::Submitted, "{text}");
    }
    let last = bg.next_json(WAIT);
    assert_eq!(last["tasks"], 6);
    assert_eq!(last["stopped"], "done");
    let lines = trace_lines(Path::new(last["session_dir"].as_str().unwrap()));
    let starts: Vec<(String, String, String)> = lines
        .iter()
        .filter(|l| l["event_type"] == "task_start")
        .map(|l| {
            (
                l["lane"].as_str().unwrap().into(),
                l["origin"].as_str().unwrap().into(),
                l["source"].as_str().unwrap().into(),
            )
        })
        .collect();
    let expect = |lane: &str, origin: &str, source: &str| (lane.to_string(), origin.to_string(), source.to_string());
    assert_eq!(
        starts,
        [
            expect("user", "user", "cli"),
            expect("peer", "peer", "a2a"),
            expect("peer", "peer", "a2a"),
            expect("bg", "event", "a2a"),
            expect("bg", "completion", "a2a"),
            expect("bg", "event", "a2a"),
        ]
    );
    assert_eq!(lines.iter().filter(|l| l["event_type"] == "session_start").count(), 1, "one session frames every task");
    assert_eq!(bg.wait(WAIT).0, Some(0));
}

#[test]
fn acceptance_none_rejects_every_message_and_runs_only_the_launch_task() {
    let c = TestCapsule::new(&manifest("none", ""), &[("r.yaml", "replies:\n  - text: ran\n    delay_ms: 3000\n")]);
    let (mut bg, first) = start(&c, &["--task", "the only task"]);
    let url = first["url"].as_str().unwrap();
    let err = rt().block_on(Client::new(url).send("please", &SendOptions::default())).unwrap_err();
    assert!(err.to_string().contains("-32601"), "{err}");
    let last = bg.next_json(WAIT);
    assert_eq!((last["tasks"].as_u64(), last["result"].as_str()), (Some(1), Some("ran")));
}

#[test]
fn acceptance_single_rejects_a_second_task_while_busy_then_exits() {
    let c = TestCapsule::new(
        &manifest("single", ""),
        &[("r.yaml", "replies:\n  - text: one\n    delay_ms: 3000\n  - text: two\n")],
    );
    let (mut bg, first) = start(&c, &[]);
    let url = first["url"].as_str().unwrap();
    let one = send(url, "first", None);
    assert_eq!(one.status.state, TaskState::Submitted);
    let two = send(url, "second", None);
    assert_eq!(two.status.state, TaskState::Rejected, "a rejection is a result, not an error");
    // `mur task send` says so and exits 2: nothing was done.
    let three = mur_tests::mur::Run::of(mur().args(["task", "send", "--url", url, "third"]));
    assert_eq!(three.code, 2, "{three:?}");
    assert!(
        three.stderr.ends_with("\nmur: rejected: task acceptance is single: a task is already waiting or running\n"),
        "{three:?}"
    );
    let last = bg.next_json(WAIT);
    assert_eq!((last["tasks"].as_u64(), last["result"].as_str()), (Some(1), Some("one")));
    assert_eq!(bg.wait(WAIT).0, Some(0));
}

#[test]
fn idle_exit_ends_an_idle_queue_capsule_cleanly() {
    let c = TestCapsule::new(&manifest("queue", "  after_task: sleep\n"), &[("r.yaml", "replies:\n  - text: done\n")]);
    let (mut bg, first) = start(&c, &["--idle-exit", "1"]);
    let url = first["url"].as_str().unwrap();
    let t = rt()
        .block_on(mur_worker::a2a::client::send_task(
            url,
            "go",
            &SendOptions::default(),
            Some(Duration::from_millis(50)),
        ))
        .unwrap();
    assert_eq!(t.status.state, TaskState::Completed);
    let last = bg.next_json(WAIT);
    assert_eq!(last["stopped"], "idle");
    let lines = trace_lines(Path::new(last["session_dir"].as_str().unwrap()));
    assert_eq!(lines.last().unwrap()["event_type"], "session_end");
    assert_eq!(bg.wait(WAIT).0, Some(0));
}

/// SIGTERM cancels the running task; the session still ends cleanly, its `on-session-end`
/// hook included (a cancelled task's stop reaches no hook after the task: only the cluster,
/// whose session is the task's, ends its session under the task's cancel).
#[test]
fn sigterm_interrupts_the_running_task_and_writes_session_end() {
    let c = TestCapsule::new(
        &manifest(
            "queue",
            "  after_task: sleep\nhooks:\n  - name: bye\n    binding: on-session-end\n    command: [sh, bye.sh]\n",
        ),
        &[
            ("r.yaml", "replies:\n  - text: never\n    delay_ms: 60000\n"),
            ("bye.sh", "cat > /dev/null\ntouch ended\necho '{\"action\":\"none\"}'\n"),
        ],
    );
    let (mut bg, first) = start(&c, &["--task", "long"]);
    let dir = first["session_dir"].as_str().unwrap().to_string();
    // Wait until the task has started, then stop the host.
    let deadline = std::time::Instant::now() + WAIT;
    while !std::fs::read_to_string(Path::new(&dir).join("trace.jsonl")).unwrap_or_default().contains("\"task_start\"") {
        assert!(std::time::Instant::now() < deadline, "task never started");
        std::thread::sleep(Duration::from_millis(20));
    }
    bg.signal(15);
    let last = bg.next_json(WAIT);
    assert_eq!((last["stopped"].as_str(), last["exit_status"].as_str()), (Some("shutdown"), Some("canceled")));
    let lines = trace_lines(Path::new(&dir));
    let end = lines.iter().find(|l| l["event_type"] == "task_end").unwrap();
    assert_eq!(end["exit_status"], "canceled");
    assert_eq!(lines.last().unwrap()["event_type"], "session_end");
    assert!(c.dir().join("ended").exists(), "the on-session-end hook ran");
    assert!(lines.iter().all(|l| l["event_type"] != "hook_dispatch_error"), "{lines:?}");
    assert_eq!(bg.wait(WAIT).0, Some(1));
}

/// A stop while an `on-task-end` hook judges the task (a gate that would reopen it) ends
/// the task `canceled`: the hook's verdict never came, so the task must not end `ok` as if
/// it had passed (it did, skipping the gate).
#[test]
fn a_stop_while_the_on_task_end_gate_runs_ends_the_task_canceled() {
    let c = TestCapsule::new(
        &manifest(
            "queue",
            "  after_task: sleep\n  max_task_reopens: 1\nhooks:\n  - name: gate\n    binding: on-task-end\n    \
             command: [sh, gate.sh]\n    timeout_secs: 120\n",
        ),
        &[
            ("r.yaml", "replies:\n  - text: looks done\n  - text: again\n"),
            (
                "gate.sh",
                "cat > /dev/null\ntouch gate-started\nsleep 60\necho '{\"action\":\"reopen-task\",\"reason\":\"no\"}'\n",
            ),
        ],
    );
    let (mut bg, first) = start(&c, &["--task", "work"]);
    let dir = first["session_dir"].as_str().unwrap().to_string();
    let marker = c.dir().join("gate-started");
    let deadline = std::time::Instant::now() + WAIT;
    while !marker.exists() {
        assert!(std::time::Instant::now() < deadline, "the on-task-end hook never started");
        std::thread::sleep(Duration::from_millis(20));
    }
    bg.signal(15);
    let last = bg.next_json(WAIT);
    assert_eq!(
        (last["stopped"].as_str(), last["exit_status"].as_str()),
        (Some("shutdown"), Some("canceled")),
        "{last}"
    );
    assert_eq!(last["result"], "canceled");
    let lines = trace_lines(Path::new(&dir));
    let end = lines.iter().find(|l| l["event_type"] == "task_end").unwrap();
    assert_eq!(end["exit_status"], "canceled");
    assert_eq!(bg.wait(WAIT).0, Some(1));
}

/// A second signal while the session ends stops its `on-session-end` hook: `mur run`
/// does not wait out a hook that hangs (here for a minute), and still writes `session_end`.
#[test]
fn a_second_signal_stops_a_hanging_on_session_end_hook() {
    let c = TestCapsule::new(
        &manifest(
            "queue",
            "  after_task: sleep\nhooks:\n  - name: bye\n    binding: on-session-end\n    command: [sh, bye.sh]\n    \
             timeout_secs: 120\n",
        ),
        &[
            ("r.yaml", "replies:\n  - text: done\n"),
            ("bye.sh", "cat > /dev/null\ntouch hook-started\nsleep 60\necho '{\"action\":\"none\"}'\n"),
        ],
    );
    let (mut bg, first) = start(&c, &[]);
    let dir = first["session_dir"].as_str().unwrap().to_string();
    bg.signal(15);
    let marker = c.dir().join("hook-started");
    let deadline = std::time::Instant::now() + WAIT;
    while !marker.exists() {
        assert!(std::time::Instant::now() < deadline, "the on-session-end hook never started");
        std::thread::sleep(Duration::from_millis(20));
    }
    let interrupted = std::time::Instant::now();
    bg.signal(15);
    let last = bg.next_json(WAIT);
    // Idle when the first signal came: stopped by it, with no task cut short.
    assert_eq!((last["stopped"].as_str(), last["exit_status"].as_str()), (Some("shutdown"), Some("ok")), "{last}");
    let (code, stderr) = bg.wait(WAIT);
    assert!(interrupted.elapsed() < Duration::from_secs(30), "took {:?}", interrupted.elapsed());
    assert!(stderr.contains("mur run: interrupted while the session ends; its hooks are stopped"), "{stderr}");
    assert_eq!(code, Some(0), "{stderr}");
    let lines = trace_lines(Path::new(&dir));
    assert_eq!(lines.last().unwrap()["event_type"], "session_end", "{lines:?}");
}

#[test]
fn mur_task_send_reaches_a_running_capsule() {
    let c = TestCapsule::new(
        &manifest("queue", "  after_task: sleep\n"),
        &[("r.yaml", "replies:\n  - text: \"got: {{task}}\"\n  - text: \"got: {{task}}\"\n")],
    );
    let (bg, first) = start(&c, &["--idle-exit", "5"]);
    let url = first["url"].as_str().unwrap();
    let run = mur_tests::mur::Run::of(mur().args([
        "task",
        "send",
        "--url",
        url,
        "hello there",
        "--wait",
        "--json",
        "--origin",
        "peer",
    ]));
    assert_eq!(run.code, 0, "{run:?}");
    let rec = run.last_json();
    assert_eq!((rec["state"].as_str(), rec["result"].as_str()), (Some("completed"), Some("got: hello there")));
    assert_eq!(
        (rec["lane"].as_str(), rec["origin"].as_str(), rec["exit_status"].as_str()),
        (Some("peer"), Some("peer"), Some("ok"))
    );
    // A text of `-` is read from stdin.
    let mut send = mur();
    send.args(["task", "send", "--url", url, "-", "--wait", "--json"]);
    let mut child = send.stdin(std::process::Stdio::piped()).stdout(std::process::Stdio::piped()).spawn().unwrap();
    std::io::Write::write_all(&mut child.stdin.take().unwrap(), b"from stdin\n").unwrap();
    let out = child.wait_with_output().unwrap();
    let rec: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(rec["result"], "got: from stdin\n", "{rec}");
    drop(bg);
}
