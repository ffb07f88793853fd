//! Capsules as MCP clients (issue #35): `mur run` with the scripted driver calling the tools
//! of the testkit's MCP server (written with `rmcp`) over stdio — the `mcp-test-server`
//! binary — and over streamable HTTP on a real socket; the exact trace and results.

use mur_tests::capsule::TestCapsule;
use mur_tests::mur::{Run, mur, run_blocking, trace_lines};
use serde_json::{Value, json};
use std::path::PathBuf;

const SERVER: &str = env!("CARGO_BIN_EXE_mcp-test-server");

/// A scripted capsule with `mcp_servers` (YAML lines, indented two spaces) whose model
/// makes `replies` (YAML list items, indented two spaces); every tool output is traced.
fn capsule(mcp_servers: &str, replies: &str) -> TestCapsule {
    TestCapsule::new(
        &format!(
            "name: mcp-user\nversion: 1.0.0\ninference:\n  driver: scripted\n  script: r.yaml\ntrace:\n  capture: \
             content\nmcp_servers:\n{mcp_servers}"
        ),
        &[("r.yaml", &format!("replies:\n{replies}"))],
    )
}

fn stdio_server(extra: &str) -> String {
    format!("  - name: t\n    command: [{SERVER:?}]\n{extra}")
}

fn run(capsule: &TestCapsule, task: &str) -> (Run, Value, PathBuf) {
    let run = Run::of(mur().arg("run").arg(capsule.dir()).args(["--json", "--task", task]));
    let json = run.last_json();
    let dir = PathBuf::from(json["session_dir"].as_str().unwrap_or_else(|| panic!("{run:?}")));
    (run, json, dir)
}

/// A `mur run --json` that failed: the run and its error message.
fn failed_run(capsule: &TestCapsule) -> (Run, String) {
    let run = Run::of(mur().arg("run").arg(capsule.dir()).args(["--json", "--task", "go"]));
    assert_ne!(run.code, 0, "{run:?}");
    let line = run.stderr.lines().last().unwrap_or_default();
    let error: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {run:?}"));
    let error = error["error"].as_str().unwrap_or_else(|| panic!("{run:?}")).to_string();
    (run, error)
}

fn tool_calls(lines: &[Value]) -> Vec<&Value> {
    lines.iter().filter(|l| l["event_type"] == "tool_call").collect()
}

#[test]
fn stdio_tools_are_offered_called_with_arguments_and_traced_with_their_server() {
    let capsule = capsule(
        &stdio_server("    env: { MCP_GREETING: hello }\n"),
        "  - tool_calls:\n      - { name: mcp__t__add, input: { a: 2, b: 40 } }\n      - { name: mcp__t__echo, input: { \
         text: \"{{task}}\" } }\n  - tool_calls: [{ name: mcp__t__where, input: {} }]\n  - text: \"{{tool_result}}\"\n",
    );
    let (run, json, dir) = run(&capsule, "say this");
    assert_eq!(json["exit_status"], "ok", "{run:?}");
    let home = dir.join(".capsule-home");
    assert_eq!(json["result"], format!("{}\n{}\nhello", dir.display(), home.display()));

    let lines = trace_lines(&dir);
    let start = &lines[0];
    assert_eq!(
        start["tools_declared"],
        json!([
            "mcp__t__echo",
            "mcp__t__add",
            "mcp__t__fail",
            "mcp__t__where",
            "mcp__t__crash",
            "mcp__t__hang",
            "mcp__t__grow"
        ])
    );
    let calls = tool_calls(&lines);
    let seen: Vec<(&str, &str, &str, &str)> = calls
        .iter()
        .map(|c| {
            (
                c["tool_name"].as_str().unwrap(),
                c["mcp_server"].as_str().unwrap(),
                c["status"].as_str().unwrap(),
                c["output"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(seen[..2], [("mcp__t__add", "t", "ok", "42"), ("mcp__t__echo", "t", "ok", "say this")]);
    assert_eq!(seen[2].0, "mcp__t__where");
    assert_eq!(calls[0]["input"], json!({"a": 2, "b": 40}));
    // The server's stderr is kept in the folder's logs.
    let log = std::fs::read_to_string(dir.join("logs/mcp-t.log")).unwrap();
    assert_eq!(log, "mcp-test-server ready\n");
}

#[test]
fn an_is_error_result_is_a_tool_error_the_model_sees_and_the_task_goes_on() {
    let capsule = capsule(
        &stdio_server(""),
        "  - tool_calls: [{ name: mcp__t__fail, input: { reason: no such branch } }]\n  - text: \"model saw: \
         {{tool_result}}\"\n",
    );
    let (run, json, dir) = run(&capsule, "go");
    assert_eq!(
        (json["exit_status"].as_str(), json["result"].as_str()),
        (Some("ok"), Some("model saw: no such branch"))
    );
    let lines = trace_lines(&dir);
    let call = tool_calls(&lines)[0];
    assert_eq!((call["status"].as_str(), call["mcp_server"].as_str()), (Some("error"), Some("t")), "{run:?}");
}

#[test]
fn a_server_that_crashes_mid_session_fails_the_call_and_the_next_turn_sees_why() {
    let capsule = capsule(
        &stdio_server(""),
        "  - tool_calls: [{ name: mcp__t__echo, input: { text: before } }]\n  - tool_calls: [{ name: mcp__t__crash, input: \
         {} }]\n  - tool_calls: [{ name: mcp__t__echo, input: { text: after } }]\n  - text: \"{{tool_result}}\"\n",
    );
    let (run, json, dir) = run(&capsule, "go");
    assert_eq!(json["exit_status"], "ok", "{run:?}");
    let lines = trace_lines(&dir);
    let calls = tool_calls(&lines);
    let statuses: Vec<&str> = calls.iter().map(|c| c["status"].as_str().unwrap()).collect();
    assert_eq!(statuses, ["ok", "error", "error"]);
    // The call after the crash names the server, how it ended and its last stderr lines.
    let result = json["result"].as_str().unwrap();
    assert!(result.starts_with("MCP server \"t\" has exited (exit code 3); the call of \"echo\" failed: "), "{result}");
    assert!(result.ends_with("its stderr ended with:\nmcp-test-server ready\ncrashing on purpose"), "{result}");
}

#[test]
fn a_call_the_server_never_answers_ends_at_its_timeout_as_a_tool_error() {
    let capsule = capsule(
        &stdio_server("    timeout_secs: 1\n"),
        "  - tool_calls: [{ name: mcp__t__hang, input: {} }]\n  - tool_calls: [{ name: mcp__t__echo, input: { text: \
         still here } }]\n  - text: \"{{tool_result}}\"\n",
    );
    let (run, json, dir) = run(&capsule, "go");
    assert_eq!((json["exit_status"].as_str(), json["result"].as_str()), (Some("ok"), Some("still here")), "{run:?}");
    let lines = trace_lines(&dir);
    let hang = tool_calls(&lines)[0];
    assert_eq!(hang["status"], "error");
    assert_eq!(
        hang["output"],
        "MCP server \"t\" did not answer the call of \"hang\" within 1 s (timeout_secs); the call was cancelled"
    );
    let ms = hang["duration_ms"].as_u64().unwrap();
    assert!((1000..5000).contains(&ms), "{ms}");
}

#[test]
fn a_tool_list_change_is_offered_at_the_next_turn() {
    let capsule = capsule(
        &stdio_server(""),
        "  - tool_calls: [{ name: mcp__t__grow, input: {} }]\n  - tool_calls: [{ name: mcp__t__extra, input: {} }]\n  - \
         text: \"{{tool_result}}\"\n",
    );
    let (run, json, _) = run(&capsule, "go");
    assert_eq!((json["exit_status"].as_str(), json["result"].as_str()), (Some("ok"), Some("extra tool")), "{run:?}");
}

#[test]
fn an_allow_list_offers_only_the_tools_it_names() {
    let capsule = capsule(
        &stdio_server("    tools: [echo]\n"),
        "  - tool_calls: [{ name: mcp__t__add, input: { a: 1, b: 1 } }]\n  - text: \"{{tool_result}}\"\n",
    );
    let (run, json, dir) = run(&capsule, "go");
    assert_eq!(json["result"], "unknown tool \"mcp__t__add\"; available tools: mcp__t__echo", "{run:?}");
    assert_eq!(trace_lines(&dir)[0]["tools_declared"], json!(["mcp__t__echo"]));
}

#[test]
fn a_server_that_fails_to_start_fails_the_run_naming_it_and_its_stderr() {
    let capsule = capsule(&format!("  - name: db\n    command: [{SERVER:?}, --fail-start]\n"), "  - text: never\n");
    let (run, error) = failed_run(&capsule);
    assert!(error.starts_with("MCP server \"db\" failed to initialize: "), "{run:?}");
    assert!(error.ends_with("; its stderr ended with:\nloading the index\nfatal: cannot open the database"), "{run:?}");
    // Nothing ran: no model call was made.
    assert_eq!(run.stdout, "");
}

#[test]
fn a_missing_program_says_the_worker_machine_must_have_it() {
    let capsule = capsule("  - name: git\n    command: [mcp-server-nowhere-to-be-found]\n", "  - text: never\n");
    let (run, error) = failed_run(&capsule);
    assert_eq!(
        error,
        "MCP server \"git\": program \"mcp-server-nowhere-to-be-found\" not found on this machine (the worker machine \
         must have it: a capsule bundle ships only the server's declaration)",
        "{run:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamable_http_tools_are_listed_and_called_over_a_real_socket() {
    let server = mur_tests::mcp::serve_http().await;
    let capsule = capsule(
        &format!("  - name: web\n    url: {}\n    headers: {{ X-Test: yes }}\n", server.url),
        "  - tool_calls: [{ name: mcp__web__add, input: { a: 20, b: 22 } }]\n  - tool_calls: [{ name: mcp__web__fail, \
         input: { reason: nope } }]\n  - text: \"{{tool_result}}\"\n",
    );
    let mut cmd = mur();
    cmd.arg("run").arg(capsule.dir()).args(["--json", "--task", "go"]);
    let run = run_blocking(cmd).await;
    let json = run.last_json();
    assert_eq!((json["exit_status"].as_str(), json["result"].as_str()), (Some("ok"), Some("nope")), "{run:?}");
    let lines = trace_lines(&PathBuf::from(json["session_dir"].as_str().unwrap()));
    let calls = tool_calls(&lines);
    let seen: Vec<(&str, &str, &str)> = calls
        .iter()
        .map(|c| (c["mcp_server"].as_str().unwrap(), c["status"].as_str().unwrap(), c["output"].as_str().unwrap()))
        .collect();
    assert_eq!(seen, [("web", "ok", "42"), ("web", "error", "nope")]);
}

/// The same capsule on the cluster (an in-process coordinator and worker, a real
/// nats-server): pushed as a bundle, its server started by the worker in the session's
/// folder; a server the worker machine lacks fails the task before any model call.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_same_capsule_runs_on_the_cluster_and_a_missing_server_fails_its_task() {
    use mur_proto::task::{ExitStatus, Origin, TaskState};
    let sb = mur_tests::sandbox::Sandbox::start(1, 2).await;
    let good = capsule(
        &stdio_server(""),
        "  - tool_calls: [{ name: mcp__t__add, input: { a: 2, b: 40 } }]\n  - text: \"sum {{tool_result}}\"\n",
    );
    sb.push(good.dir()).await;
    let missing = TestCapsule::new(
        "name: lacking\nversion: 1.0.0\ninference:\n  driver: scripted\n  script: r.yaml\nmcp_servers:\n  - name: git\n    \
         command: [mcp-server-nowhere-to-be-found]\n",
        &[("r.yaml", "replies:\n  - text: never\n")],
    );
    sb.push(missing.dir()).await;
    let ids = [sb.submit("mcp-user", "go", Origin::User).await, sb.submit("lacking", "go", Origin::User).await];
    let records = sb.wait_all(&ids, std::time::Duration::from_secs(90)).await;
    assert_eq!(
        (records[0].state, records[0].exit_status, records[0].result.as_deref()),
        (TaskState::Completed, Some(ExitStatus::Ok), Some("sum 42")),
        "{records:?}"
    );
    assert_eq!(records[1].exit_status, Some(ExitStatus::Failed), "{records:?}");
    assert_eq!(
        records[1].result.as_deref(),
        Some(
            "error: MCP server \"git\": program \"mcp-server-nowhere-to-be-found\" not found on this machine (the worker \
             machine must have it: a capsule bundle ships only the server's declaration)"
        )
    );
    sb.shutdown().await;
}

/// The client side of `mur mcp serve` tests: records the progress notifications it gets.
#[derive(Clone, Default)]
struct ProgressClient {
    seen: std::sync::Arc<std::sync::Mutex<Vec<rmcp::model::ProgressNotificationParam>>>,
}

impl rmcp::ClientHandler for ProgressClient {
    async fn on_progress(
        &self,
        params: rmcp::model::ProgressNotificationParam,
        _context: rmcp::service::NotificationContext<rmcp::RoleClient>,
    ) {
        self.seen.lock().unwrap().push(params);
    }
}

/// A tool call's result: (is_error, its text).
async fn call_tool(
    client: &rmcp::service::RunningService<rmcp::RoleClient, ProgressClient>,
    name: &'static str,
    args: Value,
) -> (bool, String) {
    let Value::Object(args) = args else { panic!("arguments are an object") };
    let mut params = rmcp::model::CallToolRequestParams::new(name);
    params.arguments = Some(args);
    let result = client.peer().call_tool(params).await.unwrap_or_else(|e| panic!("{name}: {e}"));
    let text = result
        .content
        .iter()
        .filter_map(|c| match c {
            rmcp::model::ContentBlock::Text(t) => Some(t.text.clone()),
            _ => None,
        })
        .collect::<Vec<_>>()
        .join("\n");
    (result.is_error == Some(true), text)
}

/// A cluster for the MCP server tests: a capsule `slow` that answers `done <task>` after
/// 2.5 s, and a fleet `pair` of it.
async fn cluster_for_mcp() -> mur_tests::sandbox::Sandbox {
    let sb = mur_tests::sandbox::Sandbox::start(1, 4).await;
    let slow = TestCapsule::new(
        "name: slow\nversion: 1.0.0\ninference:\n  driver: scripted\n  script: r.yaml\n",
        &[("r.yaml", "replies:\n  - text: \"done {{task}}\"\n    delay_ms: 2500\n")],
    );
    sb.push(slow.dir()).await;
    let dir = tempfile::tempdir().unwrap();
    let pair = dir.path().join("pair.yaml");
    std::fs::write(&pair, "name: pair\ngoal: Answer the question.\nmembers: [slow]\n").unwrap();
    sb.fleet_ok(&["create", pair.to_str().unwrap()]);

    sb
}

/// `mur mcp serve` (a real child process on stdio) driven by the `rmcp` client against a
/// cluster in this process: every tool, progress notifications of a long wait, and an error
/// for a missing capsule.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mur_mcp_serve_drives_the_cluster_with_every_tool() {
    use rmcp::ServiceExt;
    let sb = cluster_for_mcp().await;
    let mut child = tokio::process::Command::new(mur_tests::mur::bin("mur"))
        .args(["mcp", "serve", "--server", &sb.nats.url()])
        .env_remove("NATS_URL")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let transport = (child.stdout.take().unwrap(), child.stdin.take().unwrap());
    let handler = ProgressClient::default();
    let client = handler.clone().serve(transport).await.expect("initialize");

    every_tool(&client, &handler).await;
    client.cancel().await.unwrap();
    sb.shutdown().await;
}

/// The coordinator's `--http` listener serves the same MCP server at `/mcp` (issue #35):
/// the `rmcp` client over streamable HTTP on a real socket, every tool, progress, and an
/// error for a missing capsule; a `Host` that is neither loopback nor the public URL's is
/// refused (rmcp's DNS-rebinding check).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_coordinators_http_endpoint_serves_mcp_at_slash_mcp() {
    use rmcp::ServiceExt;
    let sb = cluster_for_mcp().await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let stop = tokio_util::sync::CancellationToken::new();
    let (nats, stopped) = (sb.client.clone(), stop.clone());
    let served = tokio::spawn(async move {
        mur_coordinator::http::serve(nats, listener, async move { stopped.cancelled().await }).await
    });
    let transport = rmcp::transport::StreamableHttpClientTransport::from_uri(format!("{base}/mcp"));
    let handler = ProgressClient::default();
    let client = handler.clone().serve(transport).await.expect("initialize over HTTP");
    every_tool(&client, &handler).await;
    client.cancel().await.unwrap();

    let foreign = reqwest::Client::new()
        .post(format!("{base}/mcp"))
        .header("Host", "attacker.example")
        .header("Accept", "application/json, text/event-stream")
        .json(&json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {}}))
        .send()
        .await
        .unwrap();
    assert_eq!(foreign.status(), 403, "a foreign Host is refused");

    stop.cancel();
    tokio::time::timeout(std::time::Duration::from_secs(10), served)
        .await
        .expect("the listener stops with its MCP sessions")
        .unwrap()
        .unwrap();
    sb.shutdown().await;
}

/// Every tool of the cluster's MCP server through `client`, which records progress in
/// `handler`.
async fn every_tool(
    client: &rmcp::service::RunningService<rmcp::RoleClient, ProgressClient>,
    handler: &ProgressClient,
) {
    let tools = client.peer().list_all_tools().await.unwrap();
    let names: Vec<&str> = tools.iter().map(|t| t.name.as_ref()).collect();
    assert_eq!(
        names,
        [
            "task_send",
            "task_status",
            "task_list",
            "task_cancel",
            "capsule_list",
            "fleet_send",
            "fleet_run",
            "job_status",
            "fleet_stop"
        ]
    );

    let (err, capsules) = call_tool(client, "capsule_list", json!({})).await;
    assert!(!err && capsules.contains("\"slow\""), "{capsules}");

    // A missing capsule is a tool error naming it.
    let (err, text) = call_tool(client, "task_send", json!({"capsule": "nope", "text": "x"})).await;
    assert!(err, "{text}");
    assert!(text.starts_with("task_send: ") && text.contains("nope"), "{text}");

    // Sent without waiting: its id at once; then its status, and a cancel of it.
    let (err, sent) = call_tool(client, "task_send", json!({"capsule": "slow", "text": "later"})).await;
    assert!(!err, "{sent}");
    let sent: Value = serde_json::from_str(&sent).unwrap();
    let later = sent["task_id"].as_str().unwrap().to_string();
    let (err, status) = call_tool(client, "task_status", json!({"task_id": later})).await;
    assert!(!err, "{status}");
    assert_eq!(serde_json::from_str::<Value>(&status).unwrap()["task_id"], later.as_str());
    let (err, canceled) = call_tool(client, "task_cancel", json!({"task_id": later})).await;
    assert!(!err, "{canceled}");
    assert_eq!(serde_json::from_str::<Value>(&canceled).unwrap()["task_id"], later.as_str());

    // A long wait reports progress to a client that asked for it.
    let mut params = rmcp::model::CallToolRequestParams::new("task_send");
    params.arguments = json!({"capsule": "slow", "text": "now", "wait": true}).as_object().cloned();
    let handle = client
        .send_cancellable_request(
            rmcp::model::ClientRequest::CallToolRequest(rmcp::model::Request::new(params)),
            rmcp::service::PeerRequestOptions::no_options(),
        )
        .await
        .unwrap();
    let token = handle.progress_token.clone();
    let rmcp::model::ServerResult::CallToolResult(result) = handle.await_response().await.unwrap() else {
        panic!("not a tool result")
    };
    let rmcp::model::ContentBlock::Text(t) = &result.content[0] else { panic!("not text") };
    let record: Value = serde_json::from_str(&t.text).unwrap();
    assert_eq!((record["exit_status"].as_str(), record["result"].as_str()), (Some("ok"), Some("done now")));
    let seen = handler.seen.lock().unwrap().clone();
    assert!(!seen.is_empty(), "no progress notification");
    assert_eq!(seen[0].progress_token, token);
    assert_eq!((seen[0].progress, seen[0].message.as_deref()), (1.0, Some("task_send: waiting, 1 s")));

    let (err, list) = call_tool(client, "task_list", json!({})).await;
    assert!(!err, "{list}");
    assert!(list.contains(&later) && list.contains(record["task_id"].as_str().unwrap()), "{list}");

    // The fleet tools: queue a job, start a run, read it, stop the fleet.
    let (err, queued) = call_tool(client, "fleet_send", json!({"fleet": "pair", "text": "a job"})).await;
    assert!(!err, "{queued}");
    assert!(serde_json::from_str::<Value>(&queued).unwrap()["job_id"].is_string(), "{queued}");
    let (err, run) = call_tool(client, "fleet_run", json!({"fleet": "pair"})).await;
    assert!(!err, "{run}");
    let run_id = serde_json::from_str::<Value>(&run).unwrap()["run_id"].as_str().unwrap().to_string();
    let (err, status) = call_tool(client, "job_status", json!({"run_id": run_id})).await;
    assert!(!err, "{status}");
    assert!(status.contains(&run_id), "{status}");
    let (err, stopped) = call_tool(client, "fleet_stop", json!({"fleet": "pair", "by": "tester"})).await;
    assert!(!err, "{stopped}");
    assert!(stopped.contains("\"stopped\""), "{stopped}");
    let (err, text) = call_tool(client, "fleet_stop", json!({"fleet": "nope"})).await;
    assert!(err && text.contains("nope"), "{text}");
}

#[test]
fn the_mcp_example_looks_a_term_up_in_its_shipped_server() {
    let capsule = TestCapsule::example("mcp");
    let run = Run::of(mur().arg("run").arg(capsule.dir()).args(["--json", "--task", "fleet"]));
    let json = run.last_json();
    assert_eq!(
        (json["exit_status"].as_str(), json["result"].as_str()),
        (Some("ok"), Some("fleet: A named group of capsules that work a queue of jobs together on the cluster.")),
        "{run:?}"
    );
    let dir = PathBuf::from(json["session_dir"].as_str().unwrap());
    let lines = trace_lines(&dir);
    assert_eq!(lines[0]["tools_declared"], json!(["mcp__glossary__define", "mcp__glossary__terms"]));
    let call = tool_calls(&lines)[0];
    assert_eq!(
        (call["tool_name"].as_str(), call["mcp_server"].as_str()),
        (Some("mcp__glossary__define"), Some("glossary"))
    );
    assert_eq!(std::fs::read_to_string(dir.join("logs/mcp-glossary.log")).unwrap(), "glossary: ready\n");
}
