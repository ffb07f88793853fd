//! The A2A endpoint over real HTTP: requests built from the A2A 1.0 specification's examples
//! (§6.1, §9.4) and from the 0.3 shapes, against an [`Intake`] whose runner is simulated by
//! a tokio task that takes `next()` tasks and finishes them.
//!
//! Checklist items covered (the runtime reference, §8): L1 (single rejects while
//! busy), L2 (none answers -32601), L3 (queue depth), L6–L7 (lanes, origin header), L9
//! (unknown task -32001).

use futures::StreamExt;
use mur_a2a::client::{self, Client, SendOptions};
use mur_a2a::intake::Intake;
use mur_a2a::v1::StreamResponse;
use mur_a2a::{AgentInfo, Server, v1};
use mur_proto::manifest::TaskAcceptance;
use mur_proto::task::TaskState;
use mur_proto::{ExitStatus, Lane, Origin};
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, mpsc};

const DEADLINE: Duration = Duration::from_secs(10);

/// A simulated session loop: takes tasks in lane order, reports each taken id, then waits
/// for a `start` permit (before `working`) and a `finish` permit (or a cancel) per task.
/// Text starting with `fail` ends `max_turns_reached`; anything else `ok` with
/// `done: <text>`.
struct Runner {
    start: Arc<Semaphore>,
    finish: Arc<Semaphore>,
    taken: mpsc::UnboundedReceiver<String>,
}

impl Runner {
    fn spawn(intake: Arc<Intake>, gated: bool) -> Runner {
        let permits = if gated { 0 } else { Semaphore::MAX_PERMITS };
        let start = Arc::new(Semaphore::new(permits));
        let finish = Arc::new(Semaphore::new(permits));
        let (taken_tx, taken) = mpsc::unbounded_channel();
        let (start_gate, finish_gate) = (start.clone(), finish.clone());
        tokio::spawn(async move {
            while let Some(task) = intake.next().await {
                let _ = taken_tx.send(task.id.clone());
                start_gate.acquire().await.expect("gate open").forget();
                intake.mark_working(&task.id).expect("handed out");
                tokio::select! {
                    permit = finish_gate.acquire() => {
                        permit.expect("gate open").forget();
                        let (exit, text) = if task.text.starts_with("fail") {
                            (ExitStatus::MaxTurnsReached, "error: max turns".to_string())
                        } else {
                            (ExitStatus::Ok, format!("done: {}", task.text))
                        };
                        intake.finish(&task.id, exit, &text).expect("running");
                    }
                    () = intake.cancelled(&task.id) => {
                        intake.finish(&task.id, ExitStatus::Canceled, "").expect("running");
                    }
                }
            }
        });
        Runner { start, finish, taken }
    }

    /// Lets `n` more tasks start and finish.
    fn release(&self, n: usize) {
        self.start.add_permits(n);
        self.finish.add_permits(n);
    }

    /// Waits until the runner has taken a task; returns its id.
    async fn taken(&mut self) -> String {
        tokio::time::timeout(DEADLINE, self.taken.recv())
            .await
            .expect("a task within the deadline")
            .expect("runner alive")
    }
}

struct Fixture {
    server: Server,
    intake: Arc<Intake>,
    http: reqwest::Client,
}

async fn start(acceptance: TaskAcceptance, queue_depth: u32) -> Fixture {
    let intake = Arc::new(Intake::new(acceptance, queue_depth));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let info =
        AgentInfo { name: "echo".into(), description: "echoes tasks".into(), version: "1.2.3".into(), url: None };
    let server = Server::start(listener, intake.clone(), info).unwrap();
    mur_nats::tls::install_crypto_provider();
    Fixture { server, intake, http: reqwest::Client::new() }
}

impl Fixture {
    fn url(&self) -> &str {
        self.server.url()
    }

    fn post(&self, version: Option<&str>, origin: Option<&str>, body: &Value) -> reqwest::RequestBuilder {
        let mut request = self.http.post(self.url()).json(body);
        if let Some(v) = version {
            request = request.header("A2A-Version", v);
        }
        if let Some(o) = origin {
            request = request.header("x-murmur-task-origin", o);
        }
        request
    }

    /// One JSON-RPC call; the whole response body.
    async fn rpc(&self, version: Option<&str>, method: &str, params: Value) -> Value {
        self.rpc_from(version, None, method, params).await
    }

    async fn rpc_from(&self, version: Option<&str>, origin: Option<&str>, method: &str, params: Value) -> Value {
        let body = json!({ "jsonrpc": "2.0", "id": 1, "method": method, "params": params });
        let response = self.post(version, origin, &body).send().await.unwrap();
        assert_eq!(response.status(), 200);
        response.json().await.unwrap()
    }
}

/// The 1.0 `SendMessage` params of §6.1, with `returnImmediately` as given.
fn send_v1(text: &str, return_immediately: bool) -> Value {
    json!({
        "message": { "role": "ROLE_USER", "parts": [{ "text": text }], "messageId": "msg-uuid" },
        "configuration": { "returnImmediately": return_immediately }
    })
}

/// The 0.3 `message/send` params.
fn send_v03(text: &str) -> Value {
    json!({
        "message": {
            "kind": "message",
            "role": "user",
            "parts": [{ "kind": "text", "text": text }],
            "messageId": "9229e770-767c-417b-a0b0-f0741243c589"
        }
    })
}

fn error_code(response: &Value) -> i64 {
    response["error"]["code"].as_i64().unwrap_or_else(|| panic!("expected an error, got {response}"))
}

/// The `data:` payloads of an SSE body, one JSON value per event.
fn sse_events(body: &str) -> Vec<Value> {
    body.replace("\r\n", "\n")
        .split("\n\n")
        .filter_map(|block| {
            let data: Vec<&str> = block
                .lines()
                .filter_map(|line| line.strip_prefix("data:"))
                .map(|d| d.strip_prefix(' ').unwrap_or(d))
                .collect();
            (!data.is_empty()).then(|| serde_json::from_str(&data.join("\n")).unwrap())
        })
        .collect()
}

#[tokio::test]
async fn agent_card_lists_both_protocol_versions_text_modes_and_streaming() {
    let f = start(TaskAcceptance::Queue, 4).await;
    let card: Value =
        f.http.get(format!("{}.well-known/agent-card.json", f.url())).send().await.unwrap().json().await.unwrap();
    assert_eq!(card["name"], "echo");
    assert_eq!(card["description"], "echoes tasks");
    assert_eq!(card["version"], "1.2.3");
    assert_eq!(
        card["supportedInterfaces"],
        json!([
            { "url": f.url(), "protocolBinding": "JSONRPC", "protocolVersion": "1.0" },
            { "url": f.url(), "protocolBinding": "JSONRPC", "protocolVersion": "0.3" }
        ])
    );
    assert_eq!(card["capabilities"]["streaming"], true);
    assert_eq!(card["defaultInputModes"], json!(["text/plain"]));
    assert_eq!(card["defaultOutputModes"], json!(["text/plain"]));
    let skill = &card["skills"][0];
    for field in ["id", "name", "description"] {
        assert!(skill[field].is_string(), "skill.{field}");
    }
    assert!(skill["tags"].as_array().is_some_and(|t| !t.is_empty()));
    // The 0.3 fields the official SDK adds for older clients.
    assert_eq!((card["url"].as_str(), card["protocolVersion"].as_str()), (Some(f.url()), Some("1.0")));
    assert_eq!(card["preferredTransport"], "JSONRPC");
}

#[tokio::test]
async fn send_message_waits_for_the_task_and_answers_the_result_artifact() {
    let f = start(TaskAcceptance::Queue, 4).await;
    let _runner = Runner::spawn(f.intake.clone(), false);
    let mut params = send_v1("What is the weather today?", false);
    params["message"]["contextId"] = json!("context-uuid");
    params["configuration"] = json!({});
    let body = json!({ "jsonrpc": "2.0", "id": 1, "method": "SendMessage", "params": params });
    let response = f.post(Some("1.0"), None, &body).send().await.unwrap();
    assert_eq!(response.headers()["a2a-version"], "1.0");
    let response: Value = response.json().await.unwrap();
    assert_eq!(response["id"], 1);
    let task = &response["result"]["task"];
    assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED", "{response}");
    assert_eq!(task["contextId"], "context-uuid", "a caller's contextId is echoed");
    assert!(task["id"].as_str().unwrap().starts_with("tsk_"));
    assert_eq!(task["artifacts"][0]["parts"][0]["text"], "done: What is the weather today?");
    assert_eq!(task["history"][0]["messageId"], "msg-uuid");
    assert_eq!(task["history"][0]["role"], "ROLE_USER");
}

#[tokio::test]
async fn send_message_returning_immediately_then_get_task_follows_it_to_completion() {
    let f = start(TaskAcceptance::Queue, 4).await;
    let mut runner = Runner::spawn(f.intake.clone(), true);
    let response = f.rpc(Some("1.0"), "SendMessage", send_v1("later", true)).await;
    let task = &response["result"]["task"];
    assert_eq!(task["status"]["state"], "TASK_STATE_SUBMITTED", "{response}");
    let id = task["id"].as_str().unwrap().to_string();
    assert_eq!(runner.taken().await, id);

    let polled = f.rpc(Some("1.0"), "GetTask", json!({ "id": id, "historyLength": 0 })).await;
    assert_eq!(polled["result"]["status"]["state"], "TASK_STATE_SUBMITTED");
    assert!(polled["result"].get("history").is_none(), "historyLength 0 omits the history");

    runner.release(1);
    assert!(f.intake.wait_idle(DEADLINE).await);
    let done = f.rpc(Some("1.0"), "GetTask", json!({ "id": id })).await;
    assert_eq!(done["result"]["status"]["state"], "TASK_STATE_COMPLETED");
    assert_eq!(done["result"]["metadata"]["murmur"]["states"], json!(["submitted", "working", "completed"]));
    assert_eq!(done["result"]["metadata"]["murmur"]["exitStatus"], "ok");
    assert_eq!(done["result"]["artifacts"][0]["parts"][0]["text"], "done: later");
}

#[tokio::test]
async fn a_failed_task_reports_its_exit_status_in_the_status_message() {
    let f = start(TaskAcceptance::Queue, 4).await;
    let _runner = Runner::spawn(f.intake.clone(), false);
    let response = f.rpc(Some("1.0"), "SendMessage", send_v1("fail please", false)).await;
    let status = &response["result"]["task"]["status"];
    assert_eq!(status["state"], "TASK_STATE_FAILED", "{response}");
    assert_eq!(status["message"]["role"], "ROLE_AGENT");
    assert_eq!(status["message"]["parts"][0]["text"], "max_turns_reached: error: max turns");
}

#[tokio::test]
async fn send_streaming_message_streams_the_task_then_its_updates_until_completed() {
    let f = start(TaskAcceptance::Queue, 4).await;
    let runner = Runner::spawn(f.intake.clone(), true);
    let body = json!({ "jsonrpc": "2.0", "id": "s-1", "method": "SendStreamingMessage", "params": send_v1("stream me", false) });
    let response = f.post(Some("1.0"), None, &body).send().await.unwrap();
    assert!(response.headers()["content-type"].to_str().unwrap().starts_with("text/event-stream"));
    assert_eq!(response.headers()["a2a-version"], "1.0");
    // The stream is subscribed by the time its headers arrive: let the task run now.
    runner.release(1);
    let events = sse_events(&tokio::time::timeout(DEADLINE, response.text()).await.unwrap().unwrap());
    assert!(events.iter().all(|e| e["jsonrpc"] == "2.0" && e["id"] == "s-1"), "{events:?}");
    let results: Vec<&Value> = events.iter().map(|e| &e["result"]).collect();
    assert_eq!(results.len(), 4, "{results:?}");
    assert_eq!(results[0]["task"]["status"]["state"], "TASK_STATE_SUBMITTED");
    let id = results[0]["task"]["id"].clone();
    assert_eq!(results[1]["statusUpdate"]["status"]["state"], "TASK_STATE_WORKING");
    assert_eq!(results[1]["statusUpdate"]["taskId"], id);
    assert_eq!(results[2]["artifactUpdate"]["artifact"]["parts"][0]["text"], "done: stream me");
    assert_eq!(results[2]["artifactUpdate"]["lastChunk"], true);
    assert_eq!(results[3]["statusUpdate"]["status"]["state"], "TASK_STATE_COMPLETED");
    // Every frame parses as a 1.0 StreamResponse.
    for result in results {
        serde_json::from_value::<StreamResponse>(result.clone()).unwrap();
    }
}

#[tokio::test]
async fn message_stream_0_3_uses_kind_discriminators_and_a_final_flag() {
    let f = start(TaskAcceptance::Queue, 4).await;
    let runner = Runner::spawn(f.intake.clone(), true);
    let body = json!({ "jsonrpc": "2.0", "id": 3, "method": "message/stream", "params": send_v03("old style") });
    let response = f.post(None, None, &body).send().await.unwrap();
    assert_eq!(response.headers()["a2a-version"], "0.3");
    runner.release(1);
    let events = sse_events(&tokio::time::timeout(DEADLINE, response.text()).await.unwrap().unwrap());
    let results: Vec<&Value> = events.iter().map(|e| &e["result"]).collect();
    let kinds: Vec<&str> = results.iter().map(|r| r["kind"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["task", "status-update", "artifact-update", "status-update"]);
    assert_eq!(results[0]["status"]["state"], "submitted");
    assert_eq!((&results[1]["status"]["state"], &results[1]["final"]), (&json!("working"), &json!(false)));
    assert_eq!(results[2]["artifact"]["parts"][0], json!({ "kind": "text", "text": "done: old style" }));
    assert_eq!((&results[3]["status"]["state"], &results[3]["final"]), (&json!("completed"), &json!(true)));
}

#[tokio::test]
async fn message_send_and_tasks_get_0_3_answer_kebab_case_tasks() {
    let f = start(TaskAcceptance::Queue, 4).await;
    let runner = Runner::spawn(f.intake.clone(), true);
    let sent = f.rpc(None, "message/send", send_v03("hello")).await;
    let task = &sent["result"];
    assert_eq!((&task["kind"], &task["status"]["state"]), (&json!("task"), &json!("submitted")), "{sent}");
    assert!(task["contextId"].as_str().unwrap().starts_with("ctx_"));
    let id = task["id"].as_str().unwrap().to_string();
    runner.release(1);
    assert!(f.intake.wait_idle(DEADLINE).await);
    let got = f.rpc(Some("0.3"), "tasks/get", json!({ "id": id })).await;
    assert_eq!(got["result"]["status"]["state"], "completed", "{got}");
    assert_eq!(got["result"]["artifacts"][0]["parts"][0]["text"], "done: hello");
    assert_eq!(got["result"]["history"][0]["kind"], "message");
    assert_eq!(got["result"]["history"][0]["role"], "user");
}

#[tokio::test]
async fn cancel_task_cancels_queued_and_running_tasks_and_refuses_ended_ones() {
    let f = start(TaskAcceptance::Queue, 4).await;
    let mut runner = Runner::spawn(f.intake.clone(), true);
    let running = f.rpc(Some("1.0"), "SendMessage", send_v1("first", true)).await["result"]["task"]["id"].clone();
    assert_eq!(json!(runner.taken().await), running);
    let queued = f.rpc(Some("1.0"), "SendMessage", send_v1("second", true)).await["result"]["task"]["id"].clone();

    // §9.4.5's request.
    let canceled = f.rpc(Some("1.0"), "CancelTask", json!({ "id": queued })).await;
    assert_eq!(canceled["result"]["status"]["state"], "TASK_STATE_CANCELED", "{canceled}");
    let again = f.rpc(Some("1.0"), "CancelTask", json!({ "id": queued })).await;
    assert_eq!(error_code(&again), -32002);

    // A running task: the cancel is a request the runner acts on.
    let asked = f.rpc(None, "tasks/cancel", json!({ "id": running })).await;
    assert_eq!(asked["result"]["kind"], "task", "{asked}");
    assert!(f.intake.is_cancel_requested(running.as_str().unwrap()));
    runner.start.add_permits(1);
    assert!(f.intake.wait_idle(DEADLINE).await);
    let ended = f.rpc(None, "tasks/get", json!({ "id": running })).await;
    assert_eq!(ended["result"]["status"]["state"], "canceled");
    assert_eq!(error_code(&f.rpc(None, "tasks/cancel", json!({ "id": running })).await), -32002);
}

#[tokio::test]
async fn unknown_tasks_are_task_not_found_in_both_versions() {
    let f = start(TaskAcceptance::Queue, 4).await;
    let got = f.rpc(Some("1.0"), "GetTask", json!({ "id": "task-uuid", "historyLength": 10 })).await;
    assert_eq!(error_code(&got), -32001);
    assert_eq!(got["error"]["data"]["taskId"], "task-uuid");
    assert_eq!(error_code(&f.rpc(Some("1.0"), "CancelTask", json!({ "id": "task-uuid" })).await), -32001);
    assert_eq!(error_code(&f.rpc(None, "tasks/get", json!({ "id": "nope" })).await), -32001);
    assert_eq!(error_code(&f.rpc(None, "tasks/cancel", json!({ "id": "nope" })).await), -32001);
    assert_eq!(error_code(&f.rpc(Some("1.0"), "SubscribeToTask", json!({ "id": "nope" })).await), -32001);
}

#[tokio::test]
async fn a_claimed_user_origin_waits_in_bg_and_peers_go_first() {
    let f = start(TaskAcceptance::Queue, 8).await;
    let mut runner = Runner::spawn(f.intake.clone(), true);
    let send = |origin: Option<&'static str>, text: &'static str| {
        let f = &f;
        async move {
            let response = f.rpc_from(Some("1.0"), origin, "SendMessage", send_v1(text, true)).await;
            response["result"]["task"]["id"].as_str().unwrap().to_string()
        }
    };
    let busy = send(None, "occupies the runner").await;
    assert_eq!(runner.taken().await, busy);
    let claimed_user = send(Some("user"), "claims user").await;
    let none = send(None, "no header").await;
    let peer = send(Some("peer"), "a peer").await;
    let completion = send(Some("completion"), "a completion").await;

    let origin_of = |id: &str| f.intake.get(id).unwrap().origin;
    assert_eq!(origin_of(&claimed_user), Origin::Event);
    assert_eq!(f.intake.get(&claimed_user).unwrap().lane(), Lane::Bg);
    assert_eq!(origin_of(&none), Origin::Event);
    assert_eq!(origin_of(&peer), Origin::Peer);
    assert_eq!(origin_of(&completion), Origin::Completion);
    assert_eq!(f.intake.waiting_ids(), [peer.clone(), claimed_user.clone(), none.clone(), completion.clone()]);
    // Over the wire too: the task's metadata names its origin and lane.
    let seen = f.rpc(Some("1.0"), "GetTask", json!({ "id": claimed_user })).await;
    assert_eq!(seen["result"]["metadata"]["murmur"]["origin"], "event", "{seen}");
    assert_eq!(seen["result"]["metadata"]["murmur"]["lane"], "bg");
    let seen = f.rpc(None, "tasks/get", json!({ "id": peer })).await;
    assert_eq!(seen["result"]["metadata"]["murmur"]["lane"], "peer", "{seen}");

    runner.release(5);
    let mut order = Vec::new();
    for _ in 0..4 {
        order.push(runner.taken().await);
    }
    assert_eq!(order, [peer, claimed_user, none, completion]);
}

#[tokio::test]
async fn acceptance_none_answers_method_not_found_to_every_send() {
    let f = start(TaskAcceptance::None, 4).await;
    for (version, method, params) in [
        (Some("1.0"), "SendMessage", send_v1("x", true)),
        (Some("1.0"), "SendStreamingMessage", send_v1("x", false)),
        (None, "message/send", send_v03("x")),
        (None, "message/stream", send_v03("x")),
    ] {
        let response = f.rpc(version, method, params).await;
        assert_eq!(error_code(&response), -32601, "{method}: {response}");
    }
    assert_eq!(error_code(&f.rpc(Some("1.0"), "GetTask", json!({ "id": "tsk_x" })).await), -32001);
}

#[tokio::test]
async fn acceptance_single_rejects_a_second_task_while_busy() {
    let f = start(TaskAcceptance::Single, 4).await;
    let mut runner = Runner::spawn(f.intake.clone(), true);
    let first = f.rpc(Some("1.0"), "SendMessage", send_v1("the one", true)).await;
    assert_eq!(first["result"]["task"]["status"]["state"], "TASK_STATE_SUBMITTED");
    runner.taken().await;

    let second = f.rpc(Some("1.0"), "SendMessage", send_v1("another", false)).await;
    let status = &second["result"]["task"]["status"];
    assert_eq!(status["state"], "TASK_STATE_REJECTED", "a result, not an error: {second}");
    assert!(status["message"]["parts"][0]["text"].as_str().unwrap().contains("single"));
    let rejected_id = second["result"]["task"]["id"].clone();
    let got = f.rpc(Some("1.0"), "GetTask", json!({ "id": rejected_id })).await;
    assert_eq!(got["result"]["status"]["state"], "TASK_STATE_REJECTED");

    let old = f.rpc(None, "message/send", send_v03("yet another")).await;
    assert_eq!(old["result"]["status"]["state"], "rejected");
}

#[tokio::test]
async fn a_full_queue_answers_a_rejected_task() {
    let f = start(TaskAcceptance::Queue, 1).await; // no runner: nothing leaves the queue
    let first = f.rpc(Some("1.0"), "SendMessage", send_v1("waits", true)).await;
    assert_eq!(first["result"]["task"]["status"]["state"], "TASK_STATE_SUBMITTED");
    let second = f.rpc(Some("1.0"), "SendMessage", send_v1("overflows", true)).await;
    assert_eq!(second["result"]["task"]["status"]["state"], "TASK_STATE_REJECTED", "{second}");
    assert_eq!(
        second["result"]["task"]["status"]["message"]["parts"][0]["text"],
        "queue full: 1 tasks already waiting"
    );

    // Streaming a send into a full queue: the rejected task, then the stream ends.
    let body = json!({ "jsonrpc": "2.0", "id": 9, "method": "SendStreamingMessage", "params": send_v1("x", false) });
    let text = f.post(Some("1.0"), None, &body).send().await.unwrap().text().await.unwrap();
    let events = sse_events(&text);
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0]["result"]["task"]["status"]["state"], "TASK_STATE_REJECTED");
}

#[tokio::test]
async fn versions_must_match_the_method_generation() {
    let f = start(TaskAcceptance::Queue, 4).await;
    // No header means 0.3 (§3.6.2), which has no `SendMessage`.
    let bare = f.rpc(None, "SendMessage", send_v1("x", true)).await;
    assert_eq!(error_code(&bare), -32009, "{bare}");
    assert_eq!(error_code(&f.rpc(Some("1.0"), "message/send", send_v03("x")).await), -32009);
    assert_eq!(error_code(&f.rpc(Some("0.5"), "SendMessage", send_v1("x", true)).await), -32009);
    // Patch numbers are ignored; the version may come as a request parameter (§3.6.1).
    let patched = f.rpc(Some("1.0.1"), "SendMessage", send_v1("x", true)).await;
    assert_eq!(patched["result"]["task"]["status"]["state"], "TASK_STATE_SUBMITTED", "{patched}");
    let body = json!({ "jsonrpc": "2.0", "id": 1, "method": "SendMessage", "params": send_v1("x", true) });
    let query: Value =
        f.http.post(format!("{}?A2A-Version=1.0", f.url())).json(&body).send().await.unwrap().json().await.unwrap();
    assert_eq!(query["result"]["task"]["status"]["state"], "TASK_STATE_SUBMITTED", "{query}");
}

/// A request without an `id` member is a notification: carried out, never answered
/// (JSON-RPC 2.0 §4.1) — HTTP 204 with an empty body, for a good one and a failing one
/// alike. An `id` of null is an id, answered.
#[tokio::test]
async fn a_notification_is_carried_out_and_not_answered() {
    let f = start(TaskAcceptance::Queue, 4).await;
    let notify = |method: &'static str, params: Value| {
        let f = &f;
        async move {
            let body = json!({ "jsonrpc": "2.0", "method": method, "params": params });
            let response = f.post(Some("1.0"), None, &body).send().await.unwrap();
            (response.status().as_u16(), response.text().await.unwrap())
        }
    };
    assert_eq!(notify("SendMessage", send_v1("told", true)).await, (204, String::new()));
    // A send that waits for its task's end (nothing runs it here) is answered at once too.
    let waiting = tokio::time::timeout(DEADLINE, notify("SendMessage", send_v1("blocking", false))).await;
    assert_eq!(waiting.expect("answered without waiting for the task"), (204, String::new()));
    let admitted = tokio::time::timeout(DEADLINE, async {
        while f.intake.waiting() < 2 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    });
    admitted.await.expect("both notifications' tasks are admitted");
    assert_eq!(notify("GetTask", json!({ "id": "tsk_nope" })).await, (204, String::new()));
    assert_eq!(notify("NoSuchMethod", json!({})).await, (204, String::new()));
    let body = json!({ "jsonrpc": "2.0", "id": null, "method": "GetTask", "params": { "id": "tsk_nope" } });
    let answered: Value = f.post(Some("1.0"), None, &body).send().await.unwrap().json().await.unwrap();
    assert_eq!((answered["id"].clone(), error_code(&answered)), (Value::Null, -32001), "{answered}");
}

#[tokio::test]
async fn malformed_requests_get_the_json_rpc_error_codes() {
    let f = start(TaskAcceptance::Queue, 4).await;
    let raw = |body: &'static str| {
        let f = &f;
        async move {
            let response =
                f.http.post(f.url()).header("content-type", "application/json").body(body).send().await.unwrap();
            response.json::<Value>().await.unwrap()
        }
    };
    assert_eq!(error_code(&raw("{oops").await), -32700);
    assert_eq!(error_code(&raw(r#"{"jsonrpc":"2.0","id":1}"#).await), -32600);
    assert_eq!(error_code(&raw(r#"[{"jsonrpc":"2.0","id":1,"method":"GetTask"}]"#).await), -32600);
    assert_eq!(error_code(&f.rpc(Some("1.0"), "tasks/send", json!({})).await), -32601);
    assert_eq!(error_code(&f.rpc(Some("1.0"), "GetTask", json!({ "historyLength": 1 })).await), -32602);
    let no_parts = json!({ "message": { "role": "ROLE_USER", "parts": [], "messageId": "m" } });
    assert_eq!(error_code(&f.rpc(Some("1.0"), "SendMessage", no_parts).await), -32602);
    let data_only = json!({ "message": { "role": "ROLE_USER", "parts": [{ "data": { "a": 1 } }], "messageId": "m" } });
    assert_eq!(error_code(&f.rpc(Some("1.0"), "SendMessage", data_only).await), -32005);
}

#[tokio::test]
async fn the_client_sends_waits_gets_cancels_and_streams() {
    let f = start(TaskAcceptance::Queue, 4).await;
    let mut runner = Runner::spawn(f.intake.clone(), true);
    let client = Client::new(f.url());

    let card = client.agent_card().await.unwrap();
    assert!(card.interface("JSONRPC", "1.0").is_some());

    let options = SendOptions { origin: Some(Origin::Peer), context_id: Some("ctx-7".into()) };
    let task = client.send("ping", &options).await.unwrap();
    assert_eq!((task.status.state, task.context_id.as_deref()), (v1::TaskState::Submitted, Some("ctx-7")));
    assert_eq!(f.intake.get(&task.id).unwrap().origin, Origin::Peer);
    assert_eq!(runner.taken().await, task.id);
    runner.release(1);
    let done = tokio::time::timeout(DEADLINE, client.wait(&task.id, Duration::from_millis(20))).await.unwrap().unwrap();
    assert_eq!((done.status.state, done.artifact_text()), (v1::TaskState::Completed, "done: ping".to_string()));

    let queued = client.send("to cancel", &SendOptions::default()).await.unwrap();
    runner.taken().await;
    let second = client.send("queued", &SendOptions::default()).await.unwrap();
    let canceled = client.cancel(&second.id).await.unwrap();
    assert_eq!(canceled.status.state, v1::TaskState::Canceled);
    match client.get("tsk_missing").await {
        Err(client::Error::Rpc(e)) => assert_eq!(e.code, -32001),
        other => panic!("expected task not found, got {other:?}"),
    }
    runner.release(1);
    let finished =
        tokio::time::timeout(DEADLINE, client.wait(&queued.id, Duration::from_millis(20))).await.unwrap().unwrap();
    assert_eq!(finished.status.state, v1::TaskState::Completed);

    let mut events = client.send_streaming("live", &SendOptions::default()).await.unwrap();
    runner.release(1);
    let mut last = None;
    while let Some(event) = tokio::time::timeout(DEADLINE, events.next()).await.unwrap() {
        last = Some(event.unwrap());
    }
    match last {
        Some(StreamResponse::StatusUpdate(update)) => assert_eq!(update.status.state, v1::TaskState::Completed),
        other => panic!("expected a final status update, got {other:?}"),
    }

    // `mur task send --wait` in one call.
    runner.release(1);
    let every = Some(Duration::from_millis(20));
    let waited =
        tokio::time::timeout(DEADLINE, client::send_task(f.url(), "all at once", &SendOptions::default(), every))
            .await
            .unwrap()
            .unwrap();
    assert_eq!(waited.artifact_text(), "done: all at once");
    assert_eq!(f.intake.get(&waited.id).unwrap().state, TaskState::Completed);
    f.server.shutdown().await.unwrap();
}

#[tokio::test]
async fn the_client_reports_json_rpc_errors_before_a_stream() {
    let f = start(TaskAcceptance::None, 1).await;
    let client = Client::new(f.url());
    match client.send_streaming("x", &SendOptions::default()).await {
        Err(client::Error::Rpc(e)) => assert_eq!(e.code, -32601),
        Err(other) => panic!("expected method not found, got {other:?}"),
        Ok(_) => panic!("expected method not found, got a stream"),
    }
    match client.send("x", &SendOptions::default()).await {
        Err(client::Error::Rpc(e)) => assert_eq!(e.code, -32601),
        other => panic!("expected method not found, got {other:?}"),
    }
}

#[tokio::test]
async fn subscribe_to_task_streams_a_running_task_and_refuses_an_ended_one() {
    let f = start(TaskAcceptance::Queue, 4).await;
    let mut runner = Runner::spawn(f.intake.clone(), true);
    let id = f.rpc(Some("1.0"), "SendMessage", send_v1("watch me", true)).await["result"]["task"]["id"].clone();
    runner.taken().await;
    // §9.4.6's request.
    let body = json!({ "jsonrpc": "2.0", "id": 5, "method": "SubscribeToTask", "params": { "id": id } });
    let response = f.post(Some("1.0"), None, &body).send().await.unwrap();
    runner.release(1);
    let events = sse_events(&tokio::time::timeout(DEADLINE, response.text()).await.unwrap().unwrap());
    let first = &events.first().expect("a first event")["result"];
    assert_eq!(first["task"]["id"], id, "the stream starts with the task: {events:?}");
    let last = &events.last().unwrap()["result"];
    assert_eq!(last["statusUpdate"]["status"]["state"], "TASK_STATE_COMPLETED", "{events:?}");

    let ended = f.rpc(Some("1.0"), "SubscribeToTask", json!({ "id": id })).await;
    assert_eq!(error_code(&ended), -32004);
    assert_eq!(error_code(&f.rpc(None, "tasks/resubscribe", json!({ "id": id })).await), -32004);
}

/// An endpoint nobody listens on: the error names the URL once and the causes after it
/// (it repeated reqwest's `error sending request for url (…)` twice).
#[tokio::test]
async fn a_refused_connection_names_the_url_once_and_the_cause() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let url = format!("http://127.0.0.1:{port}/");
    let err = Client::new(&url).send("x", &SendOptions::default()).await.unwrap_err().to_string();
    let prefix = format!("a2a request to {url} failed: ");
    assert!(err.starts_with(&prefix), "{err}");
    assert!(err.ends_with("Connection refused (os error 111)"), "{err}");
    assert_eq!(err.matches(&url).count(), 1, "{err}");
    assert!(!err.contains("error sending request"), "{err}");
}

/// `ListTasks` (1.0 §3.1.4) over real HTTP: most recently updated first, paged with a
/// `nextPageToken` that is `""` on the last page, filtered by context and status, tasks
/// without artifacts unless asked; a bad page size is -32602 naming the field; the 0.3
/// name answers the same object with 0.3 tasks.
#[tokio::test]
async fn list_tasks_pages_most_recent_first_filters_and_leaves_artifacts_out_unless_asked() {
    let f = start(TaskAcceptance::Queue, 8).await;
    let _runner = Runner::spawn(f.intake.clone(), false);
    let mut ids = Vec::new();
    for (n, context) in ["ctx-a", "ctx-b", "ctx-a"].iter().enumerate() {
        let mut params = send_v1(&format!("job {n}"), false);
        params["message"]["contextId"] = json!(context);
        let sent = f.rpc(Some("1.0"), "SendMessage", params).await;
        assert_eq!(sent["result"]["task"]["status"]["state"], "TASK_STATE_COMPLETED", "{sent}");
        ids.push(sent["result"]["task"]["id"].as_str().unwrap().to_string());
    }
    let first = f.rpc(Some("1.0"), "ListTasks", json!({ "pageSize": 2 })).await;
    let page = &first["result"];
    let listed: Vec<&str> = page["tasks"].as_array().unwrap().iter().map(|t| t["id"].as_str().unwrap()).collect();
    assert_eq!(listed, [ids[2].as_str(), ids[1].as_str()], "{first}");
    assert_eq!((page["pageSize"].as_i64(), page["totalSize"].as_i64()), (Some(2), Some(3)));
    assert_eq!(page["nextPageToken"], ids[1].as_str());
    assert!(page["tasks"][0].get("artifacts").is_none(), "artifacts are left out by default: {first}");
    assert_eq!(page["tasks"][0]["history"][0]["messageId"], "msg-uuid");
    let second = f.rpc(Some("1.0"), "ListTasks", json!({ "pageSize": 2, "pageToken": ids[1] })).await;
    assert_eq!(second["result"]["tasks"][0]["id"], ids[0].as_str(), "{second}");
    assert_eq!(second["result"]["nextPageToken"], "", "the last page's token is empty");

    let in_a = f
        .rpc(
            Some("1.0"),
            "ListTasks",
            json!({ "contextId": "ctx-a", "status": "TASK_STATE_COMPLETED", "includeArtifacts": true }),
        )
        .await;
    let tasks = in_a["result"]["tasks"].as_array().unwrap();
    assert_eq!(tasks.len(), 2, "{in_a}");
    assert_eq!(tasks[0]["artifacts"][0]["parts"][0]["text"], "done: job 2");
    let working = f.rpc(Some("1.0"), "ListTasks", json!({ "status": "TASK_STATE_WORKING" })).await;
    assert_eq!(working["result"]["tasks"], json!([]), "{working}");
    assert_eq!(working["result"]["totalSize"], 0);

    let bad = f.rpc(Some("1.0"), "ListTasks", json!({ "pageSize": 500 })).await;
    assert_eq!(error_code(&bad), -32602);
    assert!(bad["error"]["message"].as_str().unwrap().contains("pageSize: must be 1 to 100"), "{bad}");
    let bad = f.rpc(Some("1.0"), "ListTasks", json!({ "status": "sleeping" })).await;
    assert!(bad["error"]["message"].as_str().unwrap().contains("status: must be a task state"), "{bad}");

    let old = f.rpc(None, "tasks/list", json!({ "status": "completed" })).await;
    assert_eq!(old["result"]["tasks"][0]["kind"], "task", "{old}");
    assert_eq!(old["result"]["tasks"][0]["status"]["state"], "completed");
    assert_eq!(old["result"]["totalSize"], 3);
}

/// The card says `pushNotifications: false`, so every push-notification config method,
/// in both generations of names, answers -32003 `PushNotificationNotSupportedError`
/// (1.0 §3.3.4), not -32601.
#[tokio::test]
async fn push_notification_config_methods_answer_push_notification_not_supported() {
    let f = start(TaskAcceptance::Queue, 4).await;
    let card: Value =
        f.http.get(format!("{}.well-known/agent-card.json", f.url())).send().await.unwrap().json().await.unwrap();
    assert_eq!(card["capabilities"]["pushNotifications"], false);
    let params = json!({ "taskId": "tsk_0", "id": "cfg", "url": "https://example.com/hook" });
    for method in [
        "CreateTaskPushNotificationConfig",
        "GetTaskPushNotificationConfig",
        "ListTaskPushNotificationConfigs",
        "DeleteTaskPushNotificationConfig",
    ] {
        assert_eq!(error_code(&f.rpc(Some("1.0"), method, params.clone()).await), -32003, "{method}");
    }
    for method in ["set", "get", "list", "delete"] {
        let method = format!("tasks/pushNotificationConfig/{method}");
        assert_eq!(error_code(&f.rpc(None, &method, params.clone()).await), -32003, "{method}");
    }
}
