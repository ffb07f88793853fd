//! One task is one trace (issue #7 §Trace context): real `nats-server`, `mur coordinator`,
//! `mur worker` and `mur task send` processes export their spans over OTLP/HTTP to a fake
//! collector ([`FakeOtlp`]) on a real socket; the W3C `traceparent` travels in the NATS
//! headers from the client's submit through the coordinator to the worker.

use mur_proto::cluster::api;
use mur_proto::task::TaskState;
use mur_tests::capsule::{TestCapsule, shell_capsule};
use mur_tests::fake_otlp::{FakeOtlp, Span};
use mur_tests::procs::{Proc, Procs, until};
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(60);

/// OTLP `SpanKind` numbers (opentelemetry-proto trace.proto).
const SERVER: i32 = 2;
const CLIENT: i32 = 3;
const PRODUCER: i32 = 4;
const CONSUMER: i32 = 5;

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

/// A cluster whose processes export to `collector`, with the capsule `traced` pushed; the
/// coordinator's A2A endpoint base URL.
async fn traced_cluster(collector: &FakeOtlp) -> (Procs, Vec<Proc>, String, TestCapsule) {
    let mut cluster = Procs::start("").await;
    cluster.set_env("OTEL_EXPORTER_OTLP_ENDPOINT", collector.url());
    // Long-running processes export a batch every 100 ms rather than every 5 s.
    cluster.set_env("OTEL_BSP_SCHEDULE_DELAY", "100");
    // Set and empty, as deploy/docker-compose.yml passes them when they are unset there.
    cluster.set_env("OTEL_EXPORTER_OTLP_HEADERS", "");
    cluster.set_env("OTEL_RESOURCE_ATTRIBUTES", "");
    let (coordinator, base) = cluster.coordinator_with_http("coordinator-1").await;
    let worker = cluster.worker("wkr-traced", 1);
    let capsule = shell_capsule("traced");
    cluster.push(capsule.dir()).await;
    cluster.wait_workers(1).await;
    until("the coordinator answers", WAIT, || async {
        mur_nats::api::call::<serde_json::Value>(&cluster.client, api::CAPSULE_LIST, "").await.ok()
    })
    .await;
    (cluster, vec![coordinator, worker], base, capsule)
}

/// Runs `mur task send ARGS --wait --json` with the cluster's environment; the task id.
async fn send(cluster: &Procs, args: &[&str]) -> String {
    let mut send = cluster.command();
    send.args(["task", "send"]).args(args).args(["--wait", "--json"]);
    let run = tokio::task::spawn_blocking(move || mur_tests::mur::Run::of(&mut send)).await.unwrap();
    assert_eq!(run.code, 0, "mur task send: {run:?}");
    run.last_json()["task_id"].as_str().expect("task_id in the --json record").to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_is_one_trace_from_the_client_through_the_coordinator_to_the_worker() {
    let collector = FakeOtlp::start();
    let (cluster, _procs, _, _capsule) = traced_cluster(&collector).await;

    let task_id = send(&cluster, &["traced", "echo traced"]).await;
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

    // The trace names the trace, for finding the task on a dashboard.
    let lines = cluster.trace_of(&task_id).await;
    let start = lines.iter().find(|l| l["event_type"] == "task_start").expect("a task_start line");
    assert_eq!(start["trace_id"], submit.trace_id.as_str(), "{start}");

    // The record keeps the coordinator's span, for a worker that finds no header.
    let stored = record.traceparent.as_deref().expect("the record's traceparent");
    assert_eq!(stored, format!("00-{}-{}-01", accept.trace_id, accept.span_id));
}

/// Over the A2A endpoint: the client's `traceparent` HTTP header is honoured, so the
/// endpoint's request span, the submit and the worker's spans are in the client's trace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_send_message_over_http_joins_the_callers_trace() {
    let collector = FakeOtlp::start();
    let (cluster, _procs, base, _capsule) = traced_cluster(&collector).await;

    let url = format!("{base}/capsules/traced/");
    let task_id = send(&cluster, &["--url", &url, "echo over http"]).await;
    let record = cluster.wait_record(&task_id, WAIT, |r| r.state.is_terminal()).await;
    assert_eq!(record.state, TaskState::Completed, "{record:?}");

    // The request span ends after its child, the submit, and may be exported in a later
    // batch: it is waited for too (the wait's own requests have spans of the same name).
    let spans = until("the spans of every process", WAIT, || async {
        let spans = collector.spans();
        let has = |service: &str, name: &str| spans.iter().any(|s| s.service == service && s.name == name);
        let accept = spans.iter().find(|s| s.service == "mur-coordinator" && s.name == "process mur.api.task.submit");
        let request = accept.is_some_and(|a| spans.iter().any(|s| s.span_id == a.parent_span_id));
        (has("mur", "submit_task") && request && has("mur-worker", "invoke_agent traced")).then_some(spans)
    })
    .await;
    let submit = one(&spans, "mur", "submit_task");
    let accept = one(&spans, "mur-coordinator", "process mur.api.task.submit");
    let request = spans
        .iter()
        .find(|s| s.span_id == accept.parent_span_id)
        .unwrap_or_else(|| panic!("the parent of the coordinator's submit span: {spans:#?}"));
    assert_eq!((request.service.as_str(), request.name.as_str()), ("mur-coordinator", "POST /capsules/{name}/"));
    assert_eq!(request.kind, SERVER);
    child_of(request, submit);
    let agent = one(&spans, "mur-worker", "invoke_agent traced");
    assert_eq!(agent.trace_id, submit.trace_id, "the worker's spans are in the client's trace");
}
