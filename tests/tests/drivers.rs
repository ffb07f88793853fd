//! `mur run` against fake providers over real sockets: the retry log reaches the trace, and
//! spent retries end the task `failed` with the provider's error in `out/result.txt`.

use mur_tests::capsule::TestCapsule;
use mur_tests::fake_openai::{FakeOpenAi, FakeReply};
use mur_tests::mur::{Run, event_types, mur, trace_lines};
use std::path::PathBuf;

fn openai_capsule(url: &str, extra: &str) -> TestCapsule {
    TestCapsule::new(
        &format!(
            "name: remote\nversion: 0.1.0\ninference:\n  driver: openai\n  endpoint: {url}\n  model: fake-model\n  api_key: ${{FAKE_KEY}}\n{extra}"
        ),
        &[],
    )
}

async fn run(capsule: &TestCapsule) -> (Run, serde_json::Value, PathBuf) {
    let dir = capsule.dir().to_path_buf();
    let run = tokio::task::spawn_blocking(move || {
        Run::of(mur().arg("run").arg(&dir).args(["--task", "say hi", "--json"]).env("FAKE_KEY", "sk-fake"))
    })
    .await
    .unwrap();
    let json = run.last_json();
    let session_dir = PathBuf::from(json["session_dir"].as_str().unwrap());
    (run, json, session_dir)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_retried_call_leaves_one_model_attempt_line_per_attempt() {
    let fake = FakeOpenAi::start(vec![FakeReply::Status(503, "busy".into()), FakeReply::text("hello there")]);
    let capsule = openai_capsule(&fake.url(), "");
    let (run, json, dir) = run(&capsule).await;
    assert_eq!(run.code, 0, "{run:?}");
    assert_eq!(json["result"], "hello there");
    let lines = trace_lines(&dir);
    assert_eq!(
        event_types(&lines),
        ["session_start", "task_start", "model_attempt", "model_attempt", "inference", "task_end", "session_end"]
    );
    assert_eq!((lines[2]["attempt"].as_u64(), lines[2]["status"].as_u64()), (Some(1), Some(503)));
    assert_eq!((lines[3]["attempt"].as_u64(), lines[3]["status"].as_u64()), (Some(2), Some(200)));
    assert_eq!(lines[0]["model"], "fake-model");
    assert_eq!(lines[0]["driver"], "openai");
    let sent = fake.received();
    assert_eq!(sent.len(), 2);
    assert_eq!(sent[1].body["model"], "fake-model");
    assert_eq!(sent[1].body["max_tokens"], 8192);
}

#[tokio::test(flavor = "multi_thread")]
async fn spent_retries_fail_the_task_with_the_providers_error() {
    let fake = FakeOpenAi::start(vec![
        FakeReply::Status(500, "upstream exploded".into()),
        FakeReply::Status(500, "upstream exploded".into()),
    ]);
    let capsule = openai_capsule(&fake.url(), "  max_retries: 1\n");
    let (run, json, dir) = run(&capsule).await;
    assert_eq!(run.code, 1, "{run:?}");
    assert_eq!(json["exit_status"], "failed");
    let result = std::fs::read_to_string(dir.join("out/result.txt")).unwrap();
    assert!(result.starts_with("error: provider returned HTTP 500"), "{result}");
    assert!(result.contains("upstream exploded"), "{result}");
    let lines = trace_lines(&dir);
    assert_eq!(
        event_types(&lines),
        ["session_start", "task_start", "model_attempt", "model_attempt", "task_end", "session_end"]
    );
    assert_eq!(lines[4]["exit_status"], "failed");
    assert_eq!(lines[4]["turns"], 0);
}

#[test]
fn process_transport_passes_the_task_on_stdin_and_takes_stdout_as_the_result() {
    let capsule = TestCapsule::example("process-agent");
    let run = Run::of(mur().arg("run").arg(capsule.dir()).args(["--task", "fix the build", "--json"]));
    assert_eq!(run.code, 0, "{run:?}");
    let json = run.last_json();
    assert_eq!(json["result"], "TASK RECEIVED: FIX THE BUILD\n");
    let lines = trace_lines(std::path::Path::new(json["session_dir"].as_str().unwrap()));
    assert_eq!(event_types(&lines), ["session_start", "task_start", "inference", "task_end", "session_end"]);
    assert_eq!(lines[0]["driver"], "process");
    assert_eq!(lines[2]["decision"], "end_turn");
    assert_eq!(lines[3]["turns"], 1);
}

#[test]
fn process_transport_failure_and_timeout_fail_the_task() {
    let failing = TestCapsule::new(
        "name: p\nversion: 1\ninference:\n  transport: process\n  command: [./agent.sh]\n",
        &[("agent.sh", "#!/bin/sh\ncat >/dev/null\necho 'model quota exhausted' >&2\nexit 3\n")],
    );
    let run = Run::of(mur().arg("run").arg(failing.dir()).args(["--task", "x", "--json"]));
    assert_eq!(run.code, 1, "{run:?}");
    assert_eq!(run.last_json()["result"], "error: agent program exited with code 3: model quota exhausted");

    let slow = TestCapsule::new(
        "name: p\nversion: 1\ninference:\n  transport: process\n  command: [./agent.sh]\n  timeout_secs: 1\n",
        &[("agent.sh", "#!/bin/sh\nsleep 30 &\nwait\n")],
    );
    let started = std::time::Instant::now();
    let run = Run::of(mur().arg("run").arg(slow.dir()).args(["--task", "x", "--json"]));
    assert!(started.elapsed() < std::time::Duration::from_secs(20), "the group was killed at the timeout");
    assert_eq!(run.code, 1, "{run:?}");
    assert_eq!(run.last_json()["result"], "error: agent program timed out after 1 s and was killed");
}
