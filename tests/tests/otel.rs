//! One task is one trace (issue #7 §Trace context): real `nats-server`, `mur coordinator`,
//! `mur worker` and `mur task send` processes export their spans over OTLP/HTTP to a fake
//! collector ([`FakeOtlp`]) on a real socket; the W3C `traceparent` travels in the NATS
//! headers from the client's submit through the coordinator to the worker.

use mur_proto::cluster::api;
use mur_proto::task::TaskState;
use mur_tests::capsule::TestCapsule;
use mur_tests::fake_otlp::{FakeOtlp, Span};
use mur_tests::procs::{Procs, until};
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(60);

/// OTLP `SpanKind` numbers (opentelemetry-proto trace.proto).
const SERVER: i32 = 2;
const CLIENT: i32 = 3;
const PRODUCER: i32 = 4;
const CONSUMER: i32 = 5;

/// A capsule whose task text is run as one shell command, then reported.
fn shell_capsule(name: &str) -> TestCapsule {
    TestCapsule::new(
        &format!(
            "name: {name}\nversion: 1.0.0\ninference:\n  driver: scripted\n  script: r.yaml\ncapabilities:\n  shell:\n    allow: [sh]\n"
        ),
        &[(
            "r.yaml",
            "replies:\n  - tool_calls: [{ name: sh, input: { command: \"{{task}}\" } }]\n  - text: \"ran: {{task}}\"\n",
        )],
    )
}

fn one<'a>(spans: &'a [Span], service: &str, name: &str) -> &'a Span {
    let found: Vec<&Span> = spans.iter().filter(|s| s.service == service && s.name == name).collect();
    assert_eq!(found.len(), 1, "one {name:?} span of {service}: {spans:#?}");
    found[0]
}

fn child_of(child: &Span, parent: &Span) {
    assert_eq!(
        (child.trace_id.as_str(), child.parent_span_id.as_str()),
        (parent.trace_id.as_str(), parent.span_id.as_str()),
        "{} ({}) is a child of {} ({})",
        child.name,
        child.service,
        parent.name,
        parent.service
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_is_one_trace_from_the_client_through_the_coordinator_to_the_worker() {
    let collector = FakeOtlp::start();
    let mut cluster = Procs::start("").await;
    cluster.set_env("OTEL_EXPORTER_OTLP_ENDPOINT", collector.url());
    // Long-running processes export a batch every 100 ms rather than every 5 s.
    cluster.set_env("OTEL_BSP_SCHEDULE_DELAY", "100");
    let _coordinator = cluster.coordinator("coordinator-1");
    let _worker = cluster.worker("wkr-traced", 1);
    let capsule = shell_capsule("traced");
    cluster.push(capsule.dir()).await;
    cluster.wait_workers(1).await;
    until("the coordinator answers", WAIT, || async {
        mur_coordinator::api::call::<serde_json::Value>(&cluster.client, api::CAPSULE_LIST, "").await.ok()
    })
    .await;

    let mut send = cluster.command();
    send.args(["task", "send", "traced", "echo traced", "--wait", "--json"]);
    let run = tokio::task::spawn_blocking(move || mur_tests::mur::Run::of(&mut send)).await.unwrap();
    assert_eq!(run.code, 0, "mur task send: {run:?}");
    let task_id = run.last_json()["task_id"].as_str().expect("task_id in the --json record").to_string();
    let record = cluster.wait_record(&task_id, WAIT, |r| r.state.is_terminal()).await;
    assert_eq!(record.state, TaskState::Completed, "{record:?}");

    let spans = until("the spans of every process", WAIT, || async {
        let spans = collector.spans();
        let has = |service: &str, name: &str| spans.iter().any(|s| s.service == service && s.name == name);
        (has("mur", "submit_task")
            && has("mur-coordinator", "process mur.api.task.submit")
            && has("mur-coordinator", "send mur.dispatch")
            && has("mur-worker", "process mur.dispatch")
            && has("mur-worker", "invoke_agent traced")
            && has("mur-worker", "execute_tool sh")
            && spans.iter().filter(|s| s.service == "mur-worker" && s.name.starts_with("chat ")).count() == 2)
            .then_some(spans)
    })
    .await;

    let submit = one(&spans, "mur", "submit_task");
    assert_eq!((submit.kind, submit.parent_span_id.as_str()), (CLIENT, ""), "the client's span is the root");
    assert_eq!(submit.attribute("mur.task_id"), Some(task_id.as_str()));
    let accept = one(&spans, "mur-coordinator", "process mur.api.task.submit");
    assert_eq!(accept.kind, SERVER);
    assert_eq!(accept.attribute("mur.task_id"), Some(task_id.as_str()));
    child_of(accept, submit);
    let send = one(&spans, "mur-coordinator", "send mur.dispatch");
    assert_eq!(send.kind, PRODUCER);
    child_of(send, accept);
    let process = one(&spans, "mur-worker", "process mur.dispatch");
    assert_eq!(process.kind, CONSUMER);
    assert_eq!(process.attribute("mur.task_id"), Some(task_id.as_str()));
    child_of(process, send);
    let agent = one(&spans, "mur-worker", "invoke_agent traced");
    assert_eq!(agent.attribute("mur.task_id"), Some(task_id.as_str()));
    child_of(agent, process);
    child_of(one(&spans, "mur-worker", "execute_tool sh"), agent);
    for chat in spans.iter().filter(|s| s.service == "mur-worker" && s.name.starts_with("chat ")) {
        child_of(chat, agent);
    }

    // The record keeps the coordinator's span, for a worker that finds no header.
    let stored = record.traceparent.as_deref().expect("the record's traceparent");
    assert_eq!(stored, format!("00-{}-{}-01", accept.trace_id, accept.span_id));
}
