//! The cluster end to end (issue #7): a real nats-server, a coordinator and workers in
//! process ([`Sandbox`]), capsules pushed as bundles, tasks submitted over the NATS API.

use mur_proto::TaskId;
use mur_proto::cluster::TaskRecord;
use mur_proto::task::{ExitStatus, Origin, TaskState};
use mur_tests::capsule::TestCapsule;
use mur_tests::sandbox::Sandbox;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(90);

/// A capsule that runs its task as a shell command, then reports the command's output.
fn shell_capsule(name: &str, lifecycle: &str) -> TestCapsule {
    TestCapsule::new(
        &format!(
            "name: {name}\nversion: 1.0.0\ninference:\n  driver: scripted\n  script: r.yaml\ncapabilities:\n  shell:\n    allow: [sh]\n{lifecycle}"
        ),
        &[(
            "r.yaml",
            "replies:\n  - tool_calls: [{ name: sh, input: { command: \"{{task}}\" } }]\n  - text: \"{{tool_result}}\"\n",
        )],
    )
}

fn stdout_of(r: &TaskRecord) -> String {
    let text = r.result.clone().unwrap_or_default();
    text.split("Stdout:\n").nth(1).and_then(|s| s.split("\nStderr:").next()).unwrap_or_default().trim().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lane_order_holds_under_contention() {
    let sb = Sandbox::start(1, 1).await;
    let c = shell_capsule("lanes", "");
    sb.push(c.dir()).await;
    let order = c.dir().join("order.txt");
    let o = order.display();
    // The only slot is held by a slow task while the others queue.
    let blocker = sb.submit("lanes", "sleep 2", Origin::User).await;
    // Wait until it runs, so the rest really wait behind it.
    let deadline = std::time::Instant::now() + WAIT;
    while sb.record(&blocker).await.state == TaskState::Submitted {
        assert!(std::time::Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut ids = vec![blocker];
    for (label, origin) in [
        ("bg1", Origin::Event),
        ("peer1", Origin::Peer),
        ("user1", Origin::User),
        ("bg2", Origin::Schedule),
        ("user2", Origin::User),
    ] {
        ids.push(sb.submit("lanes", &format!("echo {label} >> {o}"), origin).await);
    }
    let records = sb.wait_all(&ids, WAIT).await;
    assert!(records.iter().all(|r| r.state == TaskState::Completed), "{records:?}");
    let ran = std::fs::read_to_string(&order).unwrap();
    assert_eq!(ran.lines().collect::<Vec<_>>(), ["user1", "user2", "peer1", "bg1", "bg2"]);
    sb.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_queue_capsule_runs_one_task_at_a_time_while_single_capsules_run_in_parallel() {
    let sb = Sandbox::start(3, 1).await;
    let queue = shell_capsule("serial", "lifecycle:\n  task_acceptance: queue\n  after_task: sleep\n");
    let single = shell_capsule("parallel", "");
    sb.push(queue.dir()).await;
    sb.push(single.dir()).await;
    let log = queue.dir().join("spans.txt");
    let l = log.display();
    let mut serial = Vec::new();
    for i in 0..3 {
        serial.push(
            sb.submit("serial", &format!("echo start{i} >> {l}; sleep 0.5; echo end{i} >> {l}"), Origin::User).await,
        );
    }
    let records = sb.wait_all(&serial, WAIT).await;
    assert!(records.iter().all(|r| r.state == TaskState::Completed));
    let lines: Vec<String> = std::fs::read_to_string(&log).unwrap().lines().map(str::to_string).collect();
    for pair in lines.chunks(2) {
        assert!(
            pair[0].starts_with("start") && pair[1].starts_with("end") && pair[0][5..] == pair[1][3..],
            "interleaved: {lines:?}"
        );
    }
    let mut parallel = Vec::new();
    for _ in 0..3 {
        parallel.push(sb.submit("parallel", "sleep 1", Origin::User).await);
    }
    let records = sb.wait_all(&parallel, WAIT).await;
    let spans: Vec<(u64, u64)> = records.iter().map(|r| (r.started_at.unwrap(), r.ended_at.unwrap())).collect();
    let overlapping = spans.iter().enumerate().any(|(i, a)| spans.iter().skip(i + 1).any(|b| a.0 < b.1 && b.0 < a.1));
    assert!(overlapping, "single capsules ran one at a time: {spans:?}");
    let workers: std::collections::HashSet<_> = records.iter().map(|r| r.worker.clone()).collect();
    assert!(workers.len() >= 2, "{workers:?}");
    sb.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hundred_tasks_over_three_workers_complete_once_with_their_results() {
    let sb = Sandbox::start(3, 4).await;
    let c = shell_capsule("many", "");
    sb.push(c.dir()).await;
    let mut ids = Vec::new();
    for i in 0..100 {
        ids.push(sb.submit("many", &format!("echo result-{i}"), Origin::User).await);
    }
    let records = sb.wait_all(&ids, WAIT).await;
    for (i, r) in records.iter().enumerate() {
        assert_eq!((r.state, r.exit_status), (TaskState::Completed, Some(ExitStatus::Ok)), "{r:?}");
        assert_eq!(stdout_of(r), format!("result-{i}"));
        assert!(r.session_id.as_deref().unwrap_or("").starts_with("ses_"));
    }
    // Each task ended exactly once: one task_end line per task on the trace stream.
    let sessions: std::collections::HashSet<_> = records.iter().map(|r| r.session_id.clone().unwrap()).collect();
    assert_eq!(sessions.len(), 100, "one session per task run");
    sb.shutdown().await;
}

/// Serves the coordinator's A2A endpoint on a free port; returns its base URL.
async fn serve_http(sb: &Sandbox, stop: tokio_util::sync::CancellationToken) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let client = sb.client.clone();
    tokio::spawn(async move {
        mur_coordinator::http::serve(client, listener, async move { stop.cancelled().await }).await.unwrap();
    });
    base
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tasks_sent_over_a2a_http_run_in_the_cluster_and_a_claimed_user_origin_is_not_believed() {
    use futures::StreamExt;
    use mur_a2a::client::{self, SendOptions};
    use mur_a2a::v1::{StreamResponse, TaskState as A2aState};
    use mur_proto::task::Lane;

    let sb = Sandbox::start(1, 1).await;
    let c = shell_capsule("httpecho", "");
    sb.push(c.dir()).await;
    let stop = tokio_util::sync::CancellationToken::new();
    let base = serve_http(&sb, stop.clone()).await;
    let url = format!("{base}/capsules/httpecho/");

    let card: serde_json::Value =
        reqwest::get(format!("{url}.well-known/agent-card.json")).await.unwrap().json().await.unwrap();
    assert_eq!(card["name"], "httpecho");
    assert_eq!(card["url"], url.as_str());

    let wait = Some(Duration::from_millis(100));
    let user = SendOptions { origin: Some(Origin::User), ..Default::default() };
    let task = tokio::time::timeout(WAIT, client::send_task(&url, "echo hi", &user, wait)).await.unwrap().unwrap();
    assert_eq!(task.status.state, A2aState::Completed, "{task:?}");
    assert!(task.artifact_text().contains("hi"), "{task:?}");
    let record = sb.record(&task.id).await;
    assert_eq!((record.origin, record.lane), (Origin::Event, Lane::Bg));
    assert_eq!(stdout_of(&record), "hi");

    let peer = SendOptions { origin: Some(Origin::Peer), ..Default::default() };
    let task = tokio::time::timeout(WAIT, client::send_task(&url, "echo peer", &peer, wait)).await.unwrap().unwrap();
    assert_eq!(task.status.state, A2aState::Completed, "{task:?}");
    let record = sb.record(&task.id).await;
    assert_eq!((record.origin, record.lane), (Origin::Peer, Lane::Peer));
    assert_eq!(stdout_of(&record), "peer");

    // Streaming: the task, then its updates from the record in the bucket, the result
    // artifact before the final `completed`.
    let http = client::Client::new(&url);
    let events = tokio::time::timeout(WAIT, async {
        http.send_streaming("echo streamed", &peer).await.unwrap().collect::<Vec<_>>().await
    })
    .await
    .expect("the stream ends after the terminal status");
    let events: Vec<StreamResponse> = events.into_iter().map(Result::unwrap).collect();
    assert!(matches!(events.first(), Some(StreamResponse::Task(_))), "{events:?}");
    // The result comes as an artifact update, or inside the task when it had already ended
    // by the time the stream began (a loaded machine).
    let artifact: String = events
        .iter()
        .map(|e| match e {
            StreamResponse::ArtifactUpdate(a) => a.artifact.parts.iter().filter_map(|p| p.text.clone()).collect(),
            StreamResponse::Task(t) => t.artifact_text(),
            _ => String::new(),
        })
        .collect();
    assert!(artifact.contains("streamed"), "{events:?}");
    let last = match events.last() {
        Some(StreamResponse::StatusUpdate(s)) => s.status.state,
        Some(StreamResponse::Task(t)) => t.status.state,
        other => panic!("{other:?}"),
    };
    assert_eq!(last, A2aState::Completed, "{events:?}");

    // An unknown capsule: the task is rejected with the coordinator's not_found message.
    let task = client::send_task(&format!("{base}/capsules/nosuch/"), "echo x", &peer, None).await.unwrap();
    assert_eq!(task.status.state, A2aState::Rejected, "{task:?}");
    let why = task.status_text().unwrap_or_default();
    assert!(why.contains("not_found"), "{why}");

    // A task of another capsule is not found under this one.
    let other = client::Client::new(format!("{base}/capsules/nosuch/"));
    assert!(other.get(&record.task_id).await.is_err());

    stop.cancel();
    sb.shutdown().await;
}

/// Issue #29 item 6, the A2A gaps of the cluster endpoint, over real HTTP: the card's
/// description is the manifest's; a task's replies carry its history (the caller's
/// message, with its `messageId`, as a standalone capsule's do); `ListTasks` lists this
/// capsule's tasks only, most recent first; push-notification config methods answer
/// -32003 (the card says `pushNotifications: false`).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_cluster_endpoint_lists_tasks_keeps_their_history_and_describes_the_capsule_as_its_manifest() {
    use serde_json::{Value, json};
    let sb = Sandbox::start(1, 2).await;
    let described = shell_capsule("described", "description: Runs one shell command per task.\n");
    let other = shell_capsule("other", "");
    sb.push(described.dir()).await;
    sb.push(other.dir()).await;
    let stop = tokio_util::sync::CancellationToken::new();
    let base = serve_http(&sb, stop.clone()).await;
    let url = format!("{base}/capsules/described/");
    let http = reqwest::Client::new();
    let rpc = |method: &str, params: Value| {
        let request = http
            .post(&url)
            .header("A2A-Version", "1.0")
            .json(&json!({ "jsonrpc": "2.0", "id": 1, "method": method, "params": params }));
        async move { request.send().await.unwrap().json::<Value>().await.unwrap() }
    };

    let card: Value = http.get(format!("{url}.well-known/agent-card.json")).send().await.unwrap().json().await.unwrap();
    assert_eq!(card["description"], "Runs one shell command per task.");
    let plain: Value = http
        .get(format!("{base}/capsules/other/.well-known/agent-card.json"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(plain["description"], "murmur capsule other, run by the cluster", "no description in the manifest");

    let mut ids = Vec::new();
    for n in 0..2 {
        let params = json!({
            "message": { "role": "ROLE_USER", "parts": [{ "text": format!("echo {n}") }], "messageId": format!("msg-{n}") },
        });
        let sent = tokio::time::timeout(WAIT, rpc("SendMessage", params)).await.unwrap();
        assert_eq!(sent["result"]["task"]["status"]["state"], "TASK_STATE_COMPLETED", "{sent}");
        assert_eq!(sent["result"]["task"]["history"][0]["messageId"], format!("msg-{n}"), "{sent}");
        ids.push(sent["result"]["task"]["id"].as_str().unwrap().to_string());
    }
    // A task of another capsule is not listed under this one.
    sb.submit("other", "echo elsewhere", Origin::User).await;

    let got = rpc("GetTask", json!({ "id": ids[0], "historyLength": 5 })).await;
    let history = got["result"]["history"].as_array().unwrap_or_else(|| panic!("no history: {got}"));
    assert_eq!(history.len(), 1, "{got}");
    assert_eq!((history[0]["messageId"].as_str(), history[0]["role"].as_str()), (Some("msg-0"), Some("ROLE_USER")));
    assert_eq!(history[0]["parts"][0]["text"], "echo 0");

    let listed = rpc("ListTasks", json!({ "pageSize": 10, "historyLength": 1 })).await;
    let tasks: Vec<&str> =
        listed["result"]["tasks"].as_array().unwrap().iter().map(|t| t["id"].as_str().unwrap()).collect();
    assert_eq!(tasks, [ids[1].as_str(), ids[0].as_str()], "{listed}");
    assert_eq!(
        (listed["result"]["totalSize"].as_i64(), listed["result"]["nextPageToken"].as_str()),
        (Some(2), Some(""))
    );
    assert_eq!(listed["result"]["tasks"][0]["history"][0]["messageId"], "msg-1");
    assert!(listed["result"]["tasks"][0].get("artifacts").is_none(), "{listed}");

    let push =
        rpc("CreateTaskPushNotificationConfig", json!({ "taskId": ids[0], "url": "https://example.com/hook" })).await;
    assert_eq!(push["error"]["code"], -32003, "{push}");

    stop.cancel();
    sb.shutdown().await;
}

/// Issue #7 §Lifecycle on the cluster (the session-loop seed, §Detached shell): a shell
/// command still running after the grace period moves to the background of its worker;
/// when it ends, its completion is submitted to the coordinator as a `completion` task
/// (bg lane) for the same capsule and context, its log goes to the object store, and the
/// original session's trace gets `shell_completed` naming the completion task.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_detached_command_comes_back_as_a_completion_task_in_the_same_context() {
    let sb = Sandbox::start(2, 2).await;
    let c = TestCapsule::new(
        "name: bg\nversion: 1.0.0\ninference:\n  driver: scripted\n  script: r.yaml\ncapabilities:\n  shell:\n    allow: [sh]\nlifecycle:\n  shell_grace_secs: 1\n",
        &[(
            "r.yaml",
            "replies:\n  - tool_calls: [{ name: sh, input: { command: \"{{task}}\" } }]\n  - text: \"{{tool_result}}\"\n",
        )],
    );
    sb.push(c.dir()).await;
    let first = sb.submit("bg", "sleep 2; echo bg-$((40+2))", Origin::User).await;
    let record = sb.wait_all(std::slice::from_ref(&first), WAIT).await.remove(0);
    assert_eq!(record.state, TaskState::Completed, "{record:?}");
    let handle = record.result.clone().unwrap();
    assert!(handle.contains("wrk_"), "the tool result names the handle: {handle}");

    // The completion task appears and runs.
    let deadline = std::time::Instant::now() + WAIT;
    let completion = loop {
        let all = sb.tasks().await;
        if let Some(r) = all.into_iter().find(|r| r.origin == Origin::Completion && r.state.is_terminal()) {
            break r;
        }
        assert!(std::time::Instant::now() < deadline, "no completion task");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!((completion.capsule.as_str(), completion.lane), ("bg", mur_proto::Lane::Bg));
    assert_eq!(completion.context_id, record.context_id);
    assert!(completion.text.starts_with("A detached shell command has ended.\nwork_id: wrk_"), "{}", completion.text);
    assert!(completion.text.contains("status: ok\nexit_code: 0\n"), "{}", completion.text);
    assert!(!completion.text.contains("bg-42"), "the output is never in the text");
    let work_id = completion.text.lines().nth(1).unwrap().trim_start_matches("work_id: ").to_string();

    // The log is in the object store.
    let js = async_nats::jetstream::new(sb.client.clone());
    let store = js.get_object_store(mur_proto::cluster::CAPSULES_STORE).await.unwrap();
    let mut object = store.get(format!("logs/{work_id}.log").as_str()).await.unwrap();
    let mut log = String::new();
    tokio::io::AsyncReadExt::read_to_string(&mut object, &mut log).await.unwrap();
    assert_eq!(log, "bg-42\n");

    // The first session's trace: shell_detached, then shell_completed naming the task.
    let session = record.session_id.clone().unwrap();
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let lines = trace_of_session(&sb, &session).await;
        let types: Vec<&str> = lines.iter().filter_map(|l| l["event_type"].as_str()).collect();
        if let Some(done) = lines.iter().find(|l| l["event_type"] == "shell_completed") {
            assert!(types.contains(&"shell_detached"));
            assert_eq!(done["completion_task_id"], completion.task_id.as_str());
            assert_eq!(done["work_id"], work_id.as_str());
            assert_eq!(done["exit_code"], 0);
            break;
        }
        assert!(std::time::Instant::now() < deadline, "no shell_completed in {types:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    sb.shutdown().await;
}

/// Every line of `mur.trace.<session>` in `MUR_TRACE`.
async fn trace_of_session(sb: &Sandbox, session: &str) -> Vec<serde_json::Value> {
    let subject = mur_proto::cluster::trace_subject(session);
    mur_tests::nats::stream_json(&sb.client, mur_proto::cluster::TRACE_STREAM, Some(subject)).await
}

/// `mur coordinator --http ADDR --public-url URL`: agent cards advertise the public URL,
/// not the bound address, and a capsule never pushed has none (404); `GET /healthz`
/// answers 200 while NATS is connected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_cards_advertise_the_public_url_and_healthz_answers() {
    let sb = Sandbox::start(1, 1).await;
    sb.push(shell_capsule("pub", "").dir()).await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let bound = format!("http://{}", listener.local_addr().unwrap());
    let stop = tokio_util::sync::CancellationToken::new();
    let client = sb.client.clone();
    let until = stop.clone();
    let server = tokio::spawn(async move {
        mur_coordinator::http::serve_at(client, listener, "https://agents.example.com/".into(), async move {
            until.cancelled().await
        })
        .await
        .unwrap();
    });
    let card: serde_json::Value =
        reqwest::get(format!("{bound}/capsules/pub/.well-known/agent-card.json")).await.unwrap().json().await.unwrap();
    assert_eq!(card["url"], "https://agents.example.com/capsules/pub/");
    // No card for a capsule never pushed.
    let none = reqwest::get(format!("{bound}/capsules/nope/.well-known/agent-card.json")).await.unwrap();
    assert_eq!(none.status(), 404);
    assert_eq!(none.text().await.unwrap(), "no capsule named \"nope\" (push it with `mur capsule push`)\n");
    let health = reqwest::get(format!("{bound}/healthz")).await.unwrap();
    assert_eq!(health.status(), 200);
    assert_eq!(health.text().await.unwrap(), "ok\n");
    stop.cancel();
    server.await.unwrap();
    sb.shutdown().await;
}

/// Issue #7 §Worker: a worker restores the conversation of the task's context id. A
/// `threaded` capsule's second task in a context is sent to the model with the first
/// task's messages ahead of its own, whichever worker runs it; a task of another context
/// starts empty. The model is the fake OpenAI server, over a real socket.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_threaded_capsule_continues_its_context_across_workers() {
    use mur_tests::fake_openai::{FakeOpenAi, FakeReply};
    let fake = FakeOpenAi::start(vec![FakeReply::text("one done"), FakeReply::text("two done"), FakeReply::text("x")]);
    let sb = Sandbox::start(2, 1).await;
    let c = threaded_capsule(&fake.url());
    sb.push(c.dir()).await;
    for (text, context) in [("first", "conv-a"), ("second", "conv-a"), ("other", "conv-b")] {
        let id = submit_in_context(&sb.client, "thread", text, context).await;
        let r = sb.wait_all(&[id], WAIT).await.remove(0);
        assert_eq!(r.state, TaskState::Completed, "{r:?}");
    }
    let requests = fake.requests();
    let texts = |i: usize| -> Vec<(String, String)> {
        requests[i]["messages"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|m| m["role"] != "system")
            .map(|m| (m["role"].as_str().unwrap().to_string(), m["content"].as_str().unwrap_or_default().to_string()))
            .collect()
    };
    let pair = |r: &str, t: &str| (r.to_string(), t.to_string());
    assert_eq!(texts(0), [pair("user", "first")]);
    assert_eq!(texts(1), [pair("user", "first"), pair("assistant", "one done"), pair("user", "second")]);
    assert_eq!(texts(2), [pair("user", "other")]);
    sb.shutdown().await;
}

/// The capsule `thread`: a threaded conversation with the model at `url` (a fake OpenAI).
fn threaded_capsule(url: &str) -> TestCapsule {
    TestCapsule::new(
        &format!(
            "name: thread\nversion: 1.0.0\ninference:\n  driver: openai\n  endpoint: {url}\n  model: fake-model\nlifecycle:\n  conversation: threaded\n"
        ),
        &[],
    )
}

/// Submits `text` to `capsule` in conversation `context`; returns the task id.
async fn submit_in_context(client: &async_nats::Client, capsule: &str, text: &str, context: &str) -> String {
    use mur_proto::cluster::{SubmitReply, SubmitRequest, api};
    let request = SubmitRequest { context_id: Some(context.into()), ..SubmitRequest::new(capsule, text, Origin::User) };
    let reply: SubmitReply =
        mur_nats::api::call(client, api::TASK_SUBMIT, serde_json::to_vec(&request).unwrap()).await.unwrap();
    reply.task_id.into_string()
}

/// A threaded conversation longer than one message (the server's 1 MiB `max_payload`) is
/// kept in parts: the next task of the context is sent to the model with every earlier
/// message, and a rewrite removes the parts of the conversation it replaces. (It was not
/// kept at all: the next task lost the context.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_threaded_conversation_larger_than_a_message_is_kept_in_parts() {
    use mur_proto::cluster::{self, StoredConversation};
    use mur_tests::fake_openai::{FakeOpenAi, FakeReply};
    let fake = FakeOpenAi::start((0..4).map(|_| FakeReply::text("noted")).collect());
    let sb = Sandbox::start(1, 1).await;
    let c = threaded_capsule(&fake.url());
    sb.push(c.dir()).await;
    let big: Vec<String> = (0..3).map(|i| format!("{i}{}", "w".repeat(400_000))).collect();
    let js = async_nats::jetstream::new(sb.client.clone());
    let sessions = js.get_key_value(cluster::SESSIONS_BUCKET).await.unwrap();
    let key = cluster::context_key("thread", "conv-big");
    let head = || async {
        let bytes = sessions.get(&key).await.unwrap().expect("the conversation is stored");
        serde_json::from_slice::<StoredConversation>(&bytes).unwrap()
    };
    for text in &big {
        let id = submit_in_context(&sb.client, "thread", text, "conv-big").await;
        let r = sb.wait_all(&[id], WAIT).await.remove(0);
        assert_eq!(r.state, TaskState::Completed, "{r:?}");
    }
    let first_head = head().await;
    let first_parts = first_head.part_keys(&key);
    assert!(first_parts.len() >= 2, "{first_head:?}");
    let id = submit_in_context(&sb.client, "thread", "fourth", "conv-big").await;
    assert_eq!(sb.wait_all(&[id], WAIT).await.remove(0).state, TaskState::Completed);
    let requests = fake.requests();
    let sent: Vec<String> = requests[3]["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["role"] == "user")
        .map(|m| m["content"].as_str().unwrap_or_default().to_string())
        .collect();
    assert_eq!(sent, [big[0].as_str(), big[1].as_str(), big[2].as_str(), "fourth"]);
    // Written again after the fourth task: new parts, the first write's removed.
    let second_head = head().await;
    assert_ne!(second_head, first_head);
    for part in &first_parts {
        assert!(sessions.get(part).await.unwrap().is_none(), "{part} is left behind");
    }
    let kept = mur_worker::service::read_conversation(&sessions, &key).await.unwrap();
    assert_eq!(kept.len(), 8);
    sb.shutdown().await;
}

/// Two tasks of one threaded context that ran at once: the second to end does not
/// overwrite the first's exchange (its compare-and-set on the conversation it started from
/// fails, it reads the newer one and appends what it added), and no part of a replaced or
/// losing write is left in the bucket. Messages of 400 KB put every write in parts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_tasks_of_a_threaded_context_keep_both_exchanges_and_leave_no_parts() {
    use futures::TryStreamExt;
    use mur_proto::cluster;
    use mur_proto::message::Message;
    use mur_worker::service::{read_conversation, read_conversation_at, write_conversation};
    let sb = Sandbox::start(1, 1).await;
    let js = async_nats::jetstream::new(sb.client.clone());
    let sessions = js.get_key_value(cluster::SESSIONS_BUCKET).await.unwrap();
    let max = sb.client.server_info().max_payload;
    let key = cluster::context_key("thread", "conv-race");
    let big = |tag: &str| Message::user(format!("{tag}{}", "q".repeat(400_000)));
    let first = vec![big("u1"), big("a1")];
    write_conversation(&sessions, &key, first.clone(), None, max).await.unwrap();

    // Both start from the same conversation …
    let base = read_conversation_at(&sessions, &key).await.unwrap();
    assert_eq!(base.messages, first);
    let mut a = first.clone();
    a.extend([big("uA"), Message::user("aA")]);
    let mut b = first.clone();
    b.extend([Message::user("uB"), big("aB")]);
    // … A ends first, then B.
    write_conversation(&sessions, &key, a, Some(&base), max).await.unwrap();
    write_conversation(&sessions, &key, b, Some(&base), max).await.unwrap();

    let kept = read_conversation(&sessions, &key).await.unwrap();
    let tags: Vec<String> = kept.iter().map(|m| m.text().chars().take(2).collect()).collect();
    assert_eq!(tags, ["u1", "a1", "uA", "aA", "uB", "aB"]);
    let head: cluster::StoredConversation =
        serde_json::from_slice(&sessions.get(&key).await.unwrap().unwrap()).unwrap();
    let mut parts: Vec<String> = sessions
        .keys()
        .await
        .unwrap()
        .try_collect::<Vec<String>>()
        .await
        .unwrap()
        .into_iter()
        .filter(|k| k.starts_with(&format!("{key}=")))
        .collect();
    parts.sort();
    let mut named = head.part_keys(&key);
    named.sort();
    assert_eq!(parts, named, "only the parts the head names are left");
    sb.shutdown().await;
}

/// A dispatch published again for a task that is already running — as a republish past
/// `MUR_DISPATCH`'s two-minute duplicate window would be — is dropped by the worker that
/// gets it: the running session is not taken over (that is for a redelivery of the running
/// message, after its worker died), and the task ends once, from its first session.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_second_dispatch_of_a_running_task_is_dropped_not_taken_over() {
    use async_nats::jetstream::message::PublishMessage;
    use mur_proto::cluster::{self, Dispatch};

    let sb = Sandbox::start(2, 2).await;
    let c = shell_capsule("gated", "");
    sb.push(c.dir()).await;
    let gate = tempfile::tempdir().unwrap();
    let gate = gate.path().join("open");
    let command = format!("while [ ! -e {} ]; do sleep 0.05; done; echo through", gate.display());
    let id = sb.submit("gated", &command, Origin::User).await;
    let first = mur_tests::procs::until("the task working", WAIT, || async {
        Some(sb.record(&id).await).filter(|r| r.state == TaskState::Working)
    })
    .await;
    let running_seq = first.dispatch_seq.expect("the working record names its dispatch message");

    let js = async_nats::jetstream::new(sb.client.clone());
    // Two duplicates: one as a coordinator republishes it, carrying the record as the
    // release stored it (`submitted`, an older revision), and one bare (the worker reads
    // the record).
    let tasks = js.get_key_value(cluster::TASKS_BUCKET).await.unwrap();
    let revision = tasks.entry(&id).await.unwrap().expect("the record").revision;
    let mut as_released = first.clone();
    (as_released.state, as_released.session_id, as_released.worker, as_released.dispatch_seq) =
        (TaskState::Submitted, None, None, None);
    let carried = cluster::Released { revision: revision - 1, record: as_released };
    for (n, released) in [Some(carried), None].into_iter().enumerate() {
        let dispatch = Dispatch { task_id: TaskId::unchecked(id.clone()), attempt: first.attempt, released };
        let duplicate = PublishMessage::build()
            .payload(serde_json::to_vec(&dispatch).unwrap().into())
            .message_id(format!("{}:again-{n}", dispatch.msg_id()));
        let ack = js.send_publish(cluster::DISPATCH_SUBJECT, duplicate).await.unwrap().await.unwrap();
        assert_ne!(ack.sequence, running_seq);
    }
    // Messages left in the work queue (acked ones are removed).
    let left = || async { Some(js.get_stream(cluster::DISPATCH_STREAM).await.ok()?.cached_info().state.messages) };
    // The duplicates are delivered and acked (a work queue then drops them), or — the bug
    // this guards against — taken for a takeover, which gives the record a new session.
    let outcome = mur_tests::procs::until("the duplicates dropped or one taken over", WAIT, || async {
        let record = sb.record(&id).await;
        if record.session_id != first.session_id {
            return Some(Err(record));
        }
        (left().await? == 1).then_some(Ok(()))
    })
    .await;
    if let Err(record) = outcome {
        panic!("the duplicate dispatch took the running task over: {record:?}");
    }

    std::fs::write(&gate, b"").unwrap();
    let done = sb.wait_all(std::slice::from_ref(&id), WAIT).await.remove(0);
    assert_eq!((done.state, done.exit_status), (TaskState::Completed, Some(ExitStatus::Ok)), "{done:?}");
    assert_eq!(stdout_of(&done), "through");
    assert_eq!((done.session_id, done.worker, done.dispatch_seq), (first.session_id, first.worker, Some(running_seq)));
    mur_tests::procs::until("the running dispatch acked", WAIT, || async { (left().await? == 0).then_some(()) }).await;
    sb.shutdown().await;
}

/// A worker keeps its newest finished session folders (`mur worker --keep-sessions N`,
/// default 1000) and removes older ones as sessions finish, so a long-lived worker's disk
/// stays bounded: with N = 2, after four tasks the folders of the last two remain. A
/// worker started again on the same workdir counts the folders the earlier process left:
/// its first task's end removes the older of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_keeps_its_newest_session_folders_and_removes_older_ones() {
    use mur_tests::procs::{Procs, until};
    let cluster = Procs::start("").await;
    let _coordinator = cluster.coordinator("coordinator-1");
    let mut worker = cluster.worker_with("wkr-keep", 1, &["--keep-sessions", "2"]);
    let capsule = TestCapsule::new(
        "name: brief\nversion: 1.0.0\ninference:\n  driver: scripted\n  script: r.yaml\n",
        &[("r.yaml", "replies:\n  - text: done\n")],
    );
    cluster.push(capsule.dir()).await;
    cluster.wait_workers(1).await;
    let mut sessions = Vec::new();
    for i in 0..4 {
        let id = cluster.submit("brief", &format!("task {i}"), Origin::User).await;
        let record = cluster.wait_record(&id, Duration::from_secs(60), |r| r.state.is_terminal()).await;
        assert_eq!(record.state, TaskState::Completed, "{record:?}");
        sessions.push(record.session_id.unwrap());
    }
    let dir = cluster.dir().join("wkr-keep").join("sessions");
    let kept = || {
        let mut names: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|name| !name.starts_with('.'))
            .collect();
        names.sort();
        names
    };
    until("the two oldest folders are removed", Duration::from_secs(30), || async {
        (kept() == sessions[2..]).then_some(())
    })
    .await;

    assert_eq!(worker.terminate(Duration::from_secs(30)), Some(0));
    let _again = cluster.worker_with("wkr-keep", 1, &["--keep-sessions", "2"]);
    let id = cluster.submit("brief", "after the restart", Origin::User).await;
    let record = cluster.wait_record(&id, Duration::from_secs(60), |r| r.state.is_terminal()).await;
    sessions.push(record.session_id.unwrap());
    until("the older folder the earlier process left is removed", Duration::from_secs(30), || async {
        (kept() == sessions[3..]).then_some(())
    })
    .await;
}

/// A result too large for its task record (a message over the server's `max_payload`, 1 MiB)
/// is clipped to fit, with a note: the task ends at once, where the record the server
/// refused used to leave it `working` until its dispatch dead-lettered, run five times.
/// The whole result stays in the session folder's `out/result.txt`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_result_larger_than_a_message_is_clipped_to_fit_the_task_record() {
    use mur_tests::procs::Procs;
    let cluster = Procs::start("").await;
    let _coordinator = cluster.coordinator("coordinator-1");
    let _worker = cluster.worker("wkr-big", 1);
    let capsule = TestCapsule::new(
        "name: echo10\nversion: 1.0.0\ninference:\n  driver: scripted\n  script: r.yaml\n",
        &[("r.yaml", &format!("replies:\n  - text: \"{}\"\n", "{{task}}".repeat(10)))],
    );
    cluster.push(capsule.dir()).await;
    cluster.wait_workers(1).await;
    let id = cluster.submit("echo10", &"y".repeat(110_000), Origin::User).await;
    let record = cluster.wait_record(&id, Duration::from_secs(60), |r| r.state.is_terminal()).await;
    assert_eq!((record.state, record.attempt), (TaskState::Completed, 1), "{:?}", record.dead_letter);
    let result = record.result.unwrap();
    let note = "\n… [clipped: 1100000 bytes in all; the whole is in out/result.txt]";
    assert!(result.ends_with(note), "{}", &result[result.len().saturating_sub(200)..]);
    assert!(result.len() > 800_000 && result[..result.len() - note.len()].bytes().all(|b| b == b'y'));
    let whole = cluster.dir().join("wkr-big/sessions").join(record.session_id.unwrap()).join("out/result.txt");
    assert_eq!(std::fs::read_to_string(whole).unwrap().len(), 1_100_000);
}

/// `mur task send` to a capsule that does not exist names the closest ones and the list
/// (issue #29: it said only `no capsule named …`); the refusal's code stays `not_found`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_capsule_name_is_answered_with_the_closest_names_and_the_list() {
    let sb = Sandbox::start(0, 1).await;
    sb.push(shell_capsule("hello", "").dir()).await;
    sb.push(shell_capsule("two-tools", "").dir()).await;
    let send = |capsule: &'static str, json: bool| {
        let mut cmd = mur_tests::mur::mur();
        cmd.args(["task", "send", capsule, "echo hi"]).env("NATS_URL", sb.nats.url());
        if json {
            cmd.arg("--json");
        }
        mur_tests::mur::run_blocking(cmd)
    };
    let run = send("helo", false).await;
    assert_eq!(
        (run.code, run.stdout.as_str(), run.stderr.as_str()),
        (
            2,
            "",
            "mur: not_found: capsule: no capsule named \"helo\" (push it with `mur capsule push`); did you mean \
             \"hello\"? capsules on this cluster: hello, two-tools\n"
        )
    );
    let run = send("builder", true).await;
    let said: serde_json::Value = serde_json::from_str(&run.stderr).expect("one JSON object");
    assert_eq!(
        said,
        serde_json::json!({"code": "not_found", "error": "not_found: capsule: no capsule named \"builder\" (push it \
                           with `mur capsule push`); capsules on this cluster: hello, two-tools"})
    );
    sb.shutdown().await;
}
