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

/// Issue #32 §Spans: a `chat` span carries the provider's usage and response (`id`,
/// `model`, finish reason) and the server it went to; a task that does not end `ok` marks
/// its `invoke_agent` span `ERROR` with `error.type` = its exit status; the submit spans
/// carry `messaging.*`; no span carries `code.*`, `thread.*` or `busy_ns`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_spans_carry_usage_and_response_and_a_task_not_ok_is_an_error() {
    use mur_tests::capsule::TestCapsule;
    use mur_tests::fake_openai::{FakeOpenAi, FakeReply};
    let collector = FakeOtlp::start();
    let FakeReply::Json(mut reply) = FakeReply::text_with_usage("done", 120, 7, 100) else { unreachable!() };
    reply["model"] = "fake-model-2026".into();
    let fake = FakeOpenAi::start(vec![FakeReply::Json(reply)]);
    let (cluster, _procs, _, _capsule) = traced_cluster(&collector).await;
    let chatty = TestCapsule::new(
        &format!(
            "name: chatty\nversion: 1.0.0\ninference:\n  driver: openai\n  endpoint: {}\n  model: fake-model\n",
            fake.url()
        ),
        &[],
    );
    cluster.push(chatty.dir()).await;
    // One turn allowed, and the first reply asks for a tool: `max_turns_reached`.
    let short = TestCapsule::new(
        "name: short\nversion: 1.0.0\ninference:\n  driver: scripted\n  script: r.yaml\n  max_turns: 1\ncapabilities:\n  shell:\n    allow: [sh]\n",
        &[("r.yaml", "replies:\n  - tool_calls: [{ name: sh, input: { command: \"true\" } }]\n  - text: \"never\"\n")],
    );
    cluster.push(short.dir()).await;

    let ok = send(&cluster, &["chatty", "say done"]).await;
    let not_ok = cluster.submit("short", "go", mur_proto::task::Origin::User).await;
    let record = cluster.wait_record(&not_ok, WAIT, |r| r.state.is_terminal()).await;
    assert_eq!(record.exit_status, Some(mur_proto::ExitStatus::MaxTurnsReached), "{record:?}");

    let spans = until("the spans of both tasks", WAIT, || async {
        let spans = collector.spans();
        let has = |name: &str| spans.iter().any(|s| s.service == "mur-worker" && s.name == name);
        (has("invoke_agent chatty") && has("invoke_agent short") && has("chat fake-model")).then_some(spans)
    })
    .await;
    let chat = one(&spans, "mur-worker", "chat fake-model");
    let attr = |key: &str| chat.attribute(key).unwrap_or_else(|| panic!("{key} on the chat span: {chat:#?}"));
    assert_eq!(attr("gen_ai.usage.input_tokens"), "120");
    assert_eq!(attr("gen_ai.usage.output_tokens"), "7");
    assert_eq!(attr("gen_ai.response.id"), "chatcmpl-fake");
    assert_eq!(attr("gen_ai.response.model"), "fake-model-2026");
    assert_eq!(attr("gen_ai.response.finish_reasons"), "end_turn");
    assert_eq!(attr("server.address"), "127.0.0.1");
    let port = fake.url().split(':').nth(2).and_then(|rest| rest.split('/').next()).map(str::to_string);
    assert_eq!(Some(attr("server.port").to_string()), port, "{}", fake.url());
    assert_eq!(chat.status_code, 0, "a call that succeeded leaves the status unset");
    let fine = one(&spans, "mur-worker", "invoke_agent chatty");
    assert_eq!((fine.status_code, fine.attribute("error.type")), (0, None), "{fine:#?}");
    assert_eq!(fine.attribute("mur.task_id"), Some(ok.as_str()));
    let failed = one(&spans, "mur-worker", "invoke_agent short");
    assert_eq!((failed.status_code, failed.attribute("error.type")), (2, Some("max_turns_reached")), "{failed:#?}");

    let accept = spans.iter().find(|s| s.name == "process mur.api.task.submit").expect("the submit's server span");
    assert_eq!(accept.attribute("messaging.system"), Some("nats"), "{accept:#?}");
    assert_eq!(accept.attribute("messaging.destination.name"), Some(api::TASK_SUBMIT));
    assert_eq!(accept.attribute("messaging.operation.type"), Some("process"));
    let submit = one(&spans, "mur", "submit_task");
    assert_eq!(submit.attribute("messaging.operation.type"), Some("send"), "{submit:#?}");
    for span in &spans {
        let noise = span
            .attributes
            .iter()
            .find(|(k, _)| k.starts_with("code.") || k.starts_with("thread.") || k == "busy_ns" || k == "idle_ns");
        assert!(noise.is_none(), "{noise:?} on {} ({})", span.name, span.service);
    }
}

/// OTLP `SpanKind` of an internal span.
const INTERNAL: i32 = 1;

/// A cluster exporting to `collector` with the `pair` fleet (router `planner`, members
/// `builder` and `reviewer`) defined; a worker with a slot for every step at once.
async fn traced_fleet(collector: &FakeOtlp) -> (Procs, Vec<Proc>) {
    let mut cluster = Procs::start("").await;
    cluster.set_env("OTEL_EXPORTER_OTLP_ENDPOINT", collector.url());
    cluster.set_env("OTEL_BSP_SCHEDULE_DELAY", "100");
    let coordinator = cluster.coordinator("coordinator-1");
    let worker = cluster.worker("wkr-fleet", 4);
    for capsule in ["examples/builder", "examples/planner", "examples/reviewer"] {
        cluster.push(&mur_tests::mur::example(capsule)).await;
    }
    cluster.wait_workers(1).await;
    until("the coordinator answers", WAIT, || async {
        mur_nats::api::call::<serde_json::Value>(&cluster.client, api::CAPSULE_LIST, "").await.ok()
    })
    .await;
    let pair = mur_tests::mur::example("examples/fleets/pair.yaml");
    cluster.mur_ok(&["fleet", "create", pair.to_str().unwrap()]).await;
    (cluster, vec![coordinator, worker])
}

/// The spans of the iteration of `run_id` once its `steps` steps' tasks have their
/// `invoke_agent` spans: the iteration span, then everything in its trace.
async fn iteration_trace(collector: &FakeOtlp, run_id: &str, steps: usize) -> (Span, Vec<Span>) {
    until("the iteration's spans", WAIT, || async {
        let spans = collector.spans();
        let iteration =
            spans.iter().find(|s| s.name == "iteration pair" && s.attribute("mur.run_id") == Some(run_id))?;
        let trace: Vec<Span> = spans.iter().filter(|s| s.trace_id == iteration.trace_id).cloned().collect();
        let agents = trace.iter().filter(|s| s.service == "mur-worker" && s.name.starts_with("invoke_agent ")).count();
        let children = trace.iter().filter(|s| s.parent_span_id == iteration.span_id).count();
        (agents == steps && children == steps).then(|| (iteration.clone(), trace))
    })
    .await
}

/// Checks the iteration's children are `names` (`plan planner`, `delegate builder`, …, in
/// name order), each the parent of its task's submission on the coordinator, whose task
/// runs on the worker in the same trace.
fn check_steps(iteration: &Span, trace: &[Span], expected: &[&str]) {
    let mut names: Vec<&str> =
        trace.iter().filter(|s| s.parent_span_id == iteration.span_id).map(|s| s.name.as_str()).collect();
    names.sort_unstable();
    assert_eq!(names, expected, "{trace:#?}");
    for step in trace.iter().filter(|s| s.parent_span_id == iteration.span_id) {
        assert_eq!((step.service.as_str(), step.kind), ("mur-coordinator", INTERNAL), "{step:#?}");
        assert_eq!(step.attribute("mur.fleet"), Some("pair"));
        let capsule = step.name.split(' ').nth(1).unwrap();
        assert_eq!(step.attribute("gen_ai.agent.name"), Some(capsule));
        let task_id = step.attribute("mur.task_id").unwrap_or_else(|| panic!("mur.task_id on {step:#?}"));
        let accept = trace
            .iter()
            .find(|s| s.name == "process mur.api.task.submit" && s.attribute("mur.task_id") == Some(task_id))
            .unwrap_or_else(|| panic!("the submission of {task_id} in the trace: {trace:#?}"));
        child_of(accept, step);
        let agent = trace
            .iter()
            .find(|s| s.name == format!("invoke_agent {capsule}") && s.attribute("mur.task_id") == Some(task_id))
            .unwrap_or_else(|| panic!("the worker's span of {task_id} in the trace: {trace:#?}"));
        assert_eq!(agent.service, "mur-worker");
    }
}

/// Issue #32 §Fleet runs traced: a job queued with `mur fleet send` and worked on by a
/// loop's iteration is one trace: the client's `send_job`, the coordinator's span taking
/// it, the iteration (fleet, run id, job), the router's plan and judgment and every
/// member's step under it, and each step's task on the coordinator and the worker. The
/// iteration links to the `mur fleet run` that started the loop (whose own trace holds the
/// request and its answer).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_iteration_is_one_trace_from_the_queued_job_through_its_steps_to_the_worker() {
    let collector = FakeOtlp::start();
    let (cluster, _procs) = traced_fleet(&collector).await;

    let sent = cluster.mur_ok(&["fleet", "send", "pair", "echo traced", "--json"]).await;
    let job_id = sent.last_json()["id"].as_str().expect("the job's id").to_string();
    let run = cluster.mur(&["fleet", "run", "pair", "--loop", "--deadline", "5m", "--json"]).await;
    assert_eq!(run.code, 0, "{run:?}");
    let run_id = run
        .stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find_map(|v| (v["type"] == "run").then(|| v["run_id"].as_str().map(str::to_string)).flatten());
    let run_id = run_id.unwrap_or_else(|| panic!("the run's id in {run:?}"));

    let (iteration, trace) = iteration_trace(&collector, &run_id, 4).await;
    assert_eq!((iteration.service.as_str(), iteration.kind), ("mur-coordinator", INTERNAL));
    assert_eq!(iteration.attribute("mur.fleet"), Some("pair"));
    assert_eq!(iteration.attribute("mur.job_id"), Some(job_id.as_str()));
    assert!(
        iteration.attribute("mur.iteration_run_id").is_some_and(|id| id.starts_with(run_id.as_str())),
        "{iteration:#?}"
    );
    assert_eq!(iteration.status_code, 0, "the job got done: {iteration:#?}");
    check_steps(&iteration, &trace, &["delegate builder", "delegate reviewer", "judge planner", "plan planner"]);

    // The trace starts at the client that queued the job.
    let send = one(&trace, "mur", "send_job");
    assert_eq!((send.kind, send.parent_span_id.as_str()), (CLIENT, ""), "{send:#?}");
    assert_eq!(send.attribute("mur.job_id"), Some(job_id.as_str()));
    let queued = one(&trace, "mur-coordinator", "process mur.api.fleet.send");
    assert_eq!((queued.kind, queued.attribute("mur.job_id")), (SERVER, Some(job_id.as_str())));
    child_of(queued, send);
    child_of(&iteration, queued);

    // `mur fleet run`'s request is a trace of its own, which the iteration links to.
    let spans = until("the run request's spans", WAIT, || async {
        let spans = collector.spans();
        let has = |service: &str, name: &str| spans.iter().any(|s| s.service == service && s.name == name);
        (has("mur", "run_fleet") && has("mur-coordinator", "process mur.leader.fleet.run")).then_some(spans)
    })
    .await;
    let asked = one(&spans, "mur", "run_fleet");
    assert_eq!((asked.kind, asked.parent_span_id.as_str()), (CLIENT, ""), "{asked:#?}");
    assert_eq!(asked.attribute("mur.run_id"), Some(run_id.as_str()));
    let answered = one(&spans, "mur-coordinator", "process mur.leader.fleet.run");
    child_of(answered, asked);
    assert_eq!(answered.attribute("mur.run_id"), Some(run_id.as_str()));
    assert_eq!(iteration.links, [(answered.trace_id.clone(), answered.span_id.clone())], "{iteration:#?}");
}

/// A one-shot run without a job is one trace under the `mur fleet run` that started it:
/// the client's span, the coordinator's answer, the iteration and its steps.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_one_shot_fleet_run_is_one_trace_under_mur_fleet_run() {
    let collector = FakeOtlp::start();
    let (cluster, _procs) = traced_fleet(&collector).await;

    let run = cluster.mur(&["fleet", "run", "pair", "--json"]).await;
    let run_id = run
        .stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find_map(|v| (v["type"] == "run").then(|| v["run_id"].as_str().map(str::to_string)).flatten());
    let run_id = run_id.unwrap_or_else(|| panic!("the run's id in {run:?}"));

    // A one-shot run converges with its iteration: the router plans, and is not asked to
    // judge.
    let (iteration, trace) = iteration_trace(&collector, &run_id, 3).await;
    assert_eq!(iteration.attribute("mur.job_id"), None, "{iteration:#?}");
    assert!(iteration.links.is_empty(), "{iteration:#?}");
    check_steps(&iteration, &trace, &["delegate builder", "delegate reviewer", "plan planner"]);
    let asked = one(&trace, "mur", "run_fleet");
    assert_eq!((asked.kind, asked.parent_span_id.as_str()), (CLIENT, ""), "{asked:#?}");
    let answered = one(&trace, "mur-coordinator", "process mur.leader.fleet.run");
    child_of(answered, asked);
    child_of(&iteration, answered);
}
