//! A2A endpoints authenticate (issue #31): tokens made with `mur auth token create`, stored
//! hashed in the cluster, listed without secrets, revoked; the coordinator's `--http` and
//! `mur run`'s endpoint checking `Authorization: Bearer`.

use mur_tests::capsule::{TestCapsule, shell_capsule};
use mur_tests::mur::{Background, mur, run_blocking};
use mur_tests::procs::{Procs, until};
use serde_json::{Value, json};
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(60);

/// `mur auth token create NAME ARGS --json` against `cluster`: the token.
async fn make_token(cluster: &Procs, name: &str, args: &[&str]) -> String {
    let mut all = vec!["auth", "token", "create", name, "--json"];
    all.extend_from_slice(args);
    let made = cluster.mur_ok(&all).await;
    made.last_json()["token"].as_str().expect("token").to_string()
}

/// A JSON-RPC request (1.0 names) to `url` with `token` as bearer: the status, the
/// `WWW-Authenticate` header and the body.
async fn call(
    http: &reqwest::Client,
    url: &str,
    token: Option<&str>,
    method: &str,
    params: Value,
) -> (u16, String, Value) {
    let body = json!({ "jsonrpc": "2.0", "id": 7, "method": method, "params": params });
    let mut request = http.post(url).header("A2A-Version", "1.0").json(&body);
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    let response = request.send().await.expect("request");
    let status = response.status().as_u16();
    let challenge = response
        .headers()
        .get("www-authenticate")
        .map(|v| v.to_str().unwrap_or_default().to_string())
        .unwrap_or_default();
    let body = response.json().await.unwrap_or(Value::Null);
    (status, challenge, body)
}

fn send_params(text: &str) -> Value {
    json!({
        "message": { "messageId": uuid_like(), "role": "ROLE_USER", "parts": [{ "text": text }] },
        "configuration": { "returnImmediately": true }
    })
}

fn uuid_like() -> String {
    format!("msg-{}", std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos())
}

/// A token is printed once; the cluster keeps its SHA-256 only; `ls` shows names and grants,
/// never a token or a hash; a name is used once; `revoke` removes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_is_printed_once_stored_hashed_listed_without_secrets_and_revoked() {
    let cluster = Procs::start("").await;
    let made = cluster.mur_ok(&["auth", "token", "create", "ci", "--capsule", "echo", "--json"]).await;
    let token = made.last_json()["token"].as_str().expect("token").to_string();
    assert!(token.starts_with("mur_") && token.len() == 68, "{made:?}");

    let js = async_nats::jetstream::new(cluster.client.clone());
    let stored = js.get_key_value("mur_tokens").await.unwrap().get("ci").await.unwrap().expect("record");
    let stored = String::from_utf8(stored.to_vec()).unwrap();
    let sha = mur_nats::tokens::digest(&token).iter().map(|b| format!("{b:02x}")).collect::<String>();
    assert!(stored.contains(&sha), "{stored}");
    assert!(!stored.contains(&token), "the token itself is stored: {stored}");

    let ls = cluster.mur_ok(&["auth", "token", "ls", "--json"]).await;
    let rows = ls.last_json();
    assert_eq!(rows[0]["name"], "ci", "{ls:?}");
    assert_eq!(rows[0]["capsules"], serde_json::json!(["echo"]));
    assert_eq!(rows[0]["scope"], "admin");
    let human = cluster.mur_ok(&["auth", "token", "ls"]).await;
    for run in [&ls, &human] {
        let all = format!("{}{}", run.stdout, run.stderr);
        assert!(!all.contains(&token) && !all.contains(&sha), "a secret in ls: {run:?}");
    }

    let again = cluster.mur(&["auth", "token", "create", "ci"]).await;
    assert_eq!(again.code, 2, "{again:?}");
    assert!(again.stderr.contains("a token named \"ci\" exists"), "{again:?}");
    let bad = cluster.mur(&["auth", "token", "create", "Not.A.Name"]).await;
    assert_eq!(bad.code, 2, "{bad:?}");
    assert!(bad.stderr.contains("must be 1-64 characters"), "{bad:?}");

    cluster.mur_ok(&["auth", "token", "revoke", "ci"]).await;
    let ls = cluster.mur_ok(&["auth", "token", "ls", "--json"]).await;
    assert_eq!(ls.last_json(), serde_json::json!([]), "{ls:?}");
    let gone = cluster.mur(&["auth", "token", "revoke", "ci"]).await;
    assert_eq!(gone.code, 2, "{gone:?}");
    assert!(gone.stderr.contains("no token named \"ci\""), "{gone:?}");
}

/// The coordinator's `--http` endpoint once tokens exist: a valid token sends end to end
/// (`mur task send --token-file`, and `MUR_A2A_TOKEN`); no token, a wrong one, a revoked
/// one are 401 with a `Bearer` challenge and a JSON-RPC error saying which; a token for
/// another capsule and a read-only token sending are 403; the card, served without a
/// token, declares the scheme; `/mcp` is refused without a cluster-wide token; `/healthz`
/// stays open; no token appears in any output.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_coordinator_endpoint_takes_valid_tokens_only_within_their_capsules_and_scope() {
    let cluster = Procs::start("").await;
    let admin = make_token(&cluster, "sender", &["--capsule", "echo"]).await;
    let other = make_token(&cluster, "elsewhere", &["--capsule", "other"]).await;
    let viewer = make_token(&cluster, "console", &["--scope", "read"]).await;
    let revoked = make_token(&cluster, "old", &[]).await;
    let (coordinator, base) = cluster.coordinator_with_http("coordinator-1").await;
    let capsule = shell_capsule("echo");
    cluster.push(capsule.dir()).await;
    let _worker = cluster.worker("wkr-auth", 1);
    cluster.wait_workers(1).await;
    let url = format!("{base}/capsules/echo/");
    mur_nats::tls::install_crypto_provider();
    let http = reqwest::Client::new();

    // The revoked token works until the revocation, then not.
    let (status, _, _) = call(&http, &url, Some(&revoked), "ListTasks", json!({})).await;
    assert_eq!(status, 200);
    cluster.mur_ok(&["auth", "token", "revoke", "old"]).await;
    let (status, challenge, body) = until("the coordinator sees the revocation", WAIT, || async {
        let answer = call(&http, &url, Some(&revoked), "ListTasks", json!({})).await;
        (answer.0 == 401).then_some(answer)
    })
    .await;
    assert_eq!(status, 401);
    assert!(challenge.starts_with("Bearer realm=\"murmur\""), "{challenge}");
    assert_eq!(body["error"]["code"], -32031, "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("unknown or revoked token"), "{body}");

    let (status, challenge, body) = call(&http, &url, None, "SendMessage", send_params("echo x")).await;
    assert_eq!((status, challenge.starts_with("Bearer")), (401, true), "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("no bearer token"), "{body}");
    let (status, _, body) = call(&http, &url, Some("mur_wrong"), "SendMessage", send_params("echo x")).await;
    assert_eq!(status, 401, "{body}");
    assert!(!body.to_string().contains("mur_wrong"), "the token echoed: {body}");
    let (status, _, body) = call(&http, &url, Some(&other), "SendMessage", send_params("echo x")).await;
    assert_eq!(status, 403, "{body}");
    assert_eq!(body["error"]["code"], -32032, "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("not valid for capsule \"echo\""), "{body}");
    let (status, _, body) = call(&http, &url, Some(&viewer), "SendMessage", send_params("echo x")).await;
    assert_eq!(status, 403, "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("read-only"), "{body}");
    let (status, _, body) = call(&http, &url, Some(&viewer), "ListTasks", json!({})).await;
    assert_eq!(status, 200, "a read-only token lists: {body}");

    // The card needs no token and declares the scheme, in the 1.0 and the 0.3 shapes.
    let card: Value = http.get(format!("{url}.well-known/agent-card.json")).send().await.unwrap().json().await.unwrap();
    assert_eq!(card["securitySchemes"]["bearer"]["httpAuthSecurityScheme"]["scheme"], "Bearer", "{card}");
    assert_eq!(card["securitySchemes"]["bearer"]["type"], "http", "{card}");
    assert_eq!(card["securityRequirements"], json!([{ "schemes": { "bearer": { "list": [] } } }]), "{card}");
    assert_eq!(card["security"], json!([{ "bearer": [] }]), "{card}");

    // /mcp: nothing without a token, nor with one limited to a capsule; /healthz is open.
    let mcp = http.post(format!("{base}/mcp")).header("accept", "application/json, text/event-stream");
    let initialize = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {}});
    let response = mcp.try_clone().unwrap().json(&initialize).send().await.unwrap();
    assert_eq!(response.status().as_u16(), 401);
    let response = mcp.bearer_auth(&admin).json(&initialize).send().await.unwrap();
    assert_eq!(response.status().as_u16(), 403);
    assert!(response.text().await.unwrap().contains("limited to capsules"));
    assert_eq!(http.get(format!("{base}/healthz")).send().await.unwrap().status().as_u16(), 200);

    // The CLI: a token file, the environment, and nothing.
    let file = cluster.dir().join("sender.token");
    std::fs::write(&file, format!("{admin}\n")).unwrap();
    let file = file.display().to_string();
    let sent = cluster
        .mur_ok(&["task", "send", "--url", &url, "--token-file", &file, "echo by-file", "--wait", "--json"])
        .await;
    assert_eq!(sent.last_json()["state"], "completed", "{sent:?}\n{}", coordinator.log());
    assert!(sent.last_json()["result"].as_str().unwrap().contains("by-file"), "{sent:?}");
    let mut by_env = cluster.command();
    by_env.env("MUR_A2A_TOKEN", &admin).args(["task", "send", "--url", &url, "echo by-env", "--json"]);
    let by_env = run_blocking(by_env).await;
    assert_eq!(by_env.code, 0, "{by_env:?}");
    let bare = cluster.mur(&["task", "send", "--url", &url, "echo none"]).await;
    assert_eq!(bare.code, 2, "{bare:?}");
    assert!(bare.stderr.contains("http 401") && bare.stderr.contains("no bearer token"), "{bare:?}");

    let outputs =
        format!("{}{}{}{}{}{}", sent.stdout, sent.stderr, by_env.stdout, by_env.stderr, bare.stderr, coordinator.log());
    for token in [&admin, &other, &viewer, &revoked] {
        assert!(!outputs.contains(token.as_str()), "a token in the output:\n{outputs}");
    }
}

/// A capsule that takes A2A tasks and idles meanwhile.
fn serving_capsule() -> TestCapsule {
    TestCapsule::new(
        "name: served\nversion: 1.0.0\ninference:\n  driver: scripted\n  script: r.yaml\nlifecycle:\n  task_acceptance: queue\n  after_task: sleep\n",
        &[("r.yaml", "replies:\n  - text: done\n")],
    )
}

/// A non-loopback address without a token is refused, saying how to set one up, by `mur
/// run` and by `mur coordinator --http`; `--insecure-no-auth` lets `mur run` through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_non_loopback_endpoint_without_auth_is_refused_unless_insecure_no_auth() {
    let capsule = serving_capsule();
    let mut cmd = mur();
    cmd.arg("run").arg(capsule.dir()).args(["--bind", "0.0.0.0:0", "--json"]);
    let refused = run_blocking(cmd).await;
    assert_eq!(refused.code, 2, "{refused:?}");
    assert!(refused.stderr.contains("not a loopback address"), "{refused:?}");
    assert!(refused.stderr.contains("--token-file") && refused.stderr.contains("--insecure-no-auth"), "{refused:?}");

    let mut open = Background::spawn(mur().arg("run").arg(capsule.dir()).args([
        "--bind",
        "0.0.0.0:0",
        "--json",
        "--insecure-no-auth",
    ]));
    let first = open.next_json(WAIT);
    assert!(first["url"].as_str().unwrap().starts_with("http://0.0.0.0:"), "{first}");
    drop(open);

    let cluster = Procs::start("").await;
    let config = cluster.dir().join("config.yaml").display().to_string();
    let mut coordinator = cluster.command();
    coordinator.args(["coordinator", "--config", &config, "--http", "0.0.0.0:0"]);
    let run = tokio::time::timeout(WAIT, run_blocking(coordinator)).await.expect("the coordinator exits");
    assert_eq!(run.code, 2, "{run:?}");
    assert!(run.stderr.contains("no A2A token exists") && run.stderr.contains("mur auth token create"), "{run:?}");
}

/// `mur run --token-file` over HTTPS (`--http-tls-cert/--http-tls-key`): a real client
/// trusting the test CA reads the card without a token, is refused without one, and sends
/// with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_endpoint_serves_https_and_takes_the_token_of_its_token_file() {
    let pki = mur_tests::tls::Pki::generate();
    let capsule = serving_capsule();
    let token = mur_nats::tokens::generate().unwrap();
    let file = pki.dir().join("token");
    std::fs::write(&file, &token).unwrap();
    let mut run = mur();
    run.arg("run").arg(capsule.dir()).args(["--json", "--token-file"]).arg(&file);
    run.arg("--http-tls-cert").arg(pki.dir().join("server-cert.pem"));
    run.arg("--http-tls-key").arg(pki.dir().join("server-key.pem"));
    let mut served = Background::spawn(&mut run);
    let first = served.next_json(WAIT);
    let url = first["url"].as_str().unwrap().to_string();
    assert!(url.starts_with("https://127.0.0.1:"), "{first}");

    mur_nats::tls::install_crypto_provider();
    let ca = reqwest::Certificate::from_pem(&std::fs::read(pki.ca()).unwrap()).unwrap();
    let http = reqwest::Client::builder().add_root_certificate(ca).build().unwrap();
    let card: Value = http.get(format!("{url}.well-known/agent-card.json")).send().await.unwrap().json().await.unwrap();
    assert_eq!(card["securitySchemes"]["bearer"]["httpAuthSecurityScheme"]["scheme"], "Bearer", "{card}");
    let (status, _, body) = call(&http, &url, None, "SendMessage", send_params("hello")).await;
    assert_eq!(status, 401, "{body}");
    let (status, _, body) = call(&http, &url, Some(&token), "SendMessage", send_params("hello")).await;
    assert_eq!(status, 200, "{body}");
    assert!(body["result"]["task"]["id"].as_str().is_some(), "{body}");
    served.signal(libc::SIGTERM);
    let (_, stderr) = served.wait(WAIT);
    assert!(!stderr.contains(&token), "{stderr}");
}
