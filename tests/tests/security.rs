//! A cluster you can put on a network (issue #31): TLS against a real nats-server with a
//! `tls { … }` block and certificates made in the test; every NATS authentication method
//! against a server that demands it; secrets never printed; a refused credential said once,
//! not retried.

use mur_nats::connect::Options;
use mur_proto::task::TaskState;
use mur_tests::capsule::shell_capsule;
use mur_tests::nats::NatsServer;
use mur_tests::procs::{Procs, until};
use mur_tests::tls::Pki;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(60);

/// The port of a server's URL, for `tls://127.0.0.1:PORT`.
fn port(nats: &NatsServer) -> String {
    nats.url().rsplit(':').next().expect("port").to_string()
}

/// A TLS server (`verify`: client certificates required), a client of the test's, and a
/// [`Procs`] whose `mur` processes trust the CA (`NATS_CA`) and, with `verify`, present the
/// client certificate (`NATS_CERT`, `NATS_KEY`).
async fn tls_cluster(pki: &Pki, verify: bool) -> Procs {
    let nats = NatsServer::start_with_config(&pki.server_block(verify));
    let mut options = Options { tls_ca: Some(pki.ca()), ..Options::default() };
    if verify {
        options.tls_client = Some(pki.client());
    }
    let client = nats.connect_with(&options).await;
    let mut cluster = Procs::start_on(nats, client, "");
    cluster.set_env("NATS_CA", &pki.ca().display().to_string());
    if verify {
        let (cert, key) = pki.client();
        cluster.set_env("NATS_CERT", &cert.display().to_string());
        cluster.set_env("NATS_KEY", &key.display().to_string());
    }
    cluster
}

/// The whole round trip over TLS: a coordinator and a worker started with `NATS_CA`, a
/// capsule pushed and a task sent with `mur`, its record read with `mur task status`. Before
/// issue #31 every `mur` process given a CA panicked (two rustls providers, none chosen).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_runs_end_to_end_over_tls_with_the_ca_from_tls_ca() {
    let pki = Pki::generate();
    let cluster = tls_cluster(&pki, false).await;
    let coordinator = cluster.coordinator("coordinator-1");
    let _worker = cluster.worker("wkr-tls", 1);
    let capsule = shell_capsule("tls-echo");
    let dir = capsule.dir().display().to_string();
    until("the coordinator's buckets", WAIT, || async {
        (cluster.mur(&["capsule", "push", &dir]).await.code == 0).then_some(())
    })
    .await;
    cluster.wait_workers(1).await;
    let sent = cluster.mur_ok(&["task", "send", "tls-echo", "echo over-tls", "--wait", "--json"]).await;
    let record = sent.last_json();
    assert_eq!(record["state"], "completed", "{sent:?}\ncoordinator:\n{}", coordinator.log());
    let id = record["task_id"].as_str().expect("task_id").to_string();
    let status = cluster.mur_ok(&["task", "status", &id, "--json"]).await;
    assert!(status.stdout.contains("over-tls"), "{status:?}");
    assert!(!coordinator.log().contains("panicked"), "{}", coordinator.log());
    let stored = cluster.record(&id).await.expect("record");
    assert_eq!(stored.state, TaskState::Completed);
}

/// A server that verifies clients: `--tls-cert` / `--tls-key` signed by its CA are
/// accepted; without them the handshake fails, reported as a TLS failure naming the options
/// to check, with no panic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_verifying_server_accepts_the_client_certificate_and_refuses_a_client_without_one() {
    let pki = Pki::generate();
    let cluster = tls_cluster(&pki, true).await;
    let _coordinator = cluster.coordinator("coordinator-1");
    let status = until("mur cluster status with a client certificate", WAIT, || async {
        let run = cluster.mur(&["cluster", "status", "--json"]).await;
        (run.code == 0).then_some(run)
    })
    .await;
    assert!(status.stdout.contains("leader"), "{status:?}");

    let mut bare = mur_tests::mur::mur();
    bare.args(["cluster", "status", "--server", &cluster.nats.url(), "--tls-ca"]).arg(pki.ca());
    let run = mur_tests::mur::run_blocking(bare).await;
    assert_ne!(run.code, 0, "{run:?}");
    assert_ne!(run.code, 101, "a panic: {run:?}");
    assert!(run.stderr.contains("TLS to NATS at nats://127.0.0.1:"), "{run:?}");
    assert!(run.stderr.contains("--tls-cert / --tls-key"), "{run:?}");
}

/// A CA that did not sign the server's certificate: refused as a TLS failure at once, by a
/// command and by `mur coordinator`, which exits instead of retrying every second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_certificate_the_ca_did_not_sign_is_refused_and_the_coordinator_exits() {
    let pki = Pki::generate();
    let nats = NatsServer::start_with_config(&pki.server_block(false));
    let mut cmd = mur_tests::mur::mur();
    cmd.args(["task", "ls", "--json", "--server", &nats.url(), "--tls-ca"]).arg(pki.other_ca());
    let run = mur_tests::mur::run_blocking(cmd).await;
    assert_ne!(run.code, 0, "{run:?}");
    assert_ne!(run.code, 101, "a panic: {run:?}");
    assert!(run.stderr.contains("TLS to NATS at"), "{run:?}");
    assert!(run.stderr.contains("invalid peer certificate: UnknownIssuer"), "{run:?}");

    let mut coordinator = mur_tests::mur::mur();
    coordinator.args(["coordinator", "--server", &nats.url(), "--tls-ca"]).arg(pki.other_ca());
    let run = tokio::time::timeout(WAIT, mur_tests::mur::run_blocking(coordinator))
        .await
        .expect("the coordinator exits instead of retrying a TLS failure");
    assert_eq!(run.code, 2, "mur's exit status for a failed command: {run:?}");
    assert_eq!(run.stderr.matches("TLS to NATS at").count(), 1, "said once: {run:?}");
}

/// `--tls-required` refuses a server without TLS; a `tls://` URL reaches a TLS server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_required_refuses_a_plaintext_server_and_a_tls_url_reaches_a_tls_server() {
    let plain = NatsServer::start();
    let mut cmd = mur_tests::mur::mur();
    cmd.args(["task", "ls", "--tls-required", "--server", &plain.url()]);
    let run = mur_tests::mur::run_blocking(cmd).await;
    assert_ne!(run.code, 0, "{run:?}");
    assert_ne!(run.code, 101, "a panic: {run:?}");
    assert!(run.stderr.contains("TLS to NATS at") || run.stderr.contains("cannot reach NATS"), "{run:?}");

    let pki = Pki::generate();
    let cluster = tls_cluster(&pki, false).await;
    let _coordinator = cluster.coordinator("coordinator-1");
    let url = format!("tls://127.0.0.1:{}", port(&cluster.nats));
    let run = until("mur task ls over a tls:// URL", WAIT, || async {
        let run = cluster.mur(&["task", "ls", "--json", "--server", &url, "--tls-required"]).await;
        (run.code == 0).then_some(run)
    })
    .await;
    assert!(run.stdout.trim_start().starts_with('['), "{run:?}");
}

/// A server that demands credentials: user `alice` with a password, and an nkey user.
/// Returns the server, a client of the test's (as alice), and the nkey user's seed.
async fn auth_server() -> (NatsServer, async_nats::Client, String) {
    let nkey = nkeys::KeyPair::new_user();
    let config = format!(
        "authorization {{\n  users = [\n    {{ user: alice, password: \"{PASSWORD}\" }}\n    {{ nkey: {} }}\n  ]\n}}\n",
        nkey.public_key()
    );
    let nats = NatsServer::start_with_config(&config);
    let options = Options { user: Some("alice".into()), password: Some(PASSWORD.into()), ..Options::default() };
    let client = nats.connect_with(&options).await;
    (nats, client, nkey.seed().expect("seed"))
}

/// A password no output may show.
const PASSWORD: &str = "pw-Zq8sEcret";

/// `nats://alice:PASSWORD@host:port`.
fn with_user(nats: &NatsServer, user: &str, password: &str) -> String {
    nats.url().replacen("nats://", &format!("nats://{user}:{password}@"), 1)
}

/// Every way to give a user and password or an nkey works against a server that demands
/// them: the password in the URL (the coordinator; issue #31: refused before, since the
/// client ignores a URL's user part), `NATS_USER` / `NATS_PASSWORD`, `--nkey FILE`, and a
/// `--creds` file holding the seed alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_password_in_the_url_or_the_options_an_nkey_and_a_seed_creds_file_all_authenticate() {
    let (nats, client, seed) = auth_server().await;
    let url = with_user(&nats, "alice", PASSWORD);
    let cluster = Procs::start_on(nats, client, "");
    let mut coordinator = cluster.command();
    coordinator.env("NATS_URL", &url).env("MUR_LOG", "debug").args(["coordinator", "--id", "c-url"]);
    let log = cluster.dir().join("c-url.log");
    let mut child = coordinator
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .expect("spawn mur coordinator");

    let status = |args: Vec<String>, envs: Vec<(&'static str, String)>| {
        let mut cmd = mur_tests::mur::mur();
        cmd.args(["cluster", "status", "--json", "--server", &cluster.nats.url()]).args(args).envs(envs);
        mur_tests::mur::run_blocking(cmd)
    };
    let by_env = until("mur cluster status with NATS_USER / NATS_PASSWORD", WAIT, || async {
        let run = status(vec![], vec![("NATS_USER", "alice".into()), ("NATS_PASSWORD", PASSWORD.into())]).await;
        (run.code == 0).then_some(run)
    })
    .await;
    assert!(by_env.stdout.contains("c-url"), "the coordinator, on a URL with a password, leads: {by_env:?}");

    let dir = tempfile::tempdir().unwrap();
    let seed_file = dir.path().join("user.nk");
    std::fs::write(&seed_file, format!("{seed}\n")).unwrap();
    let run = status(vec!["--nkey".into(), seed_file.display().to_string()], vec![]).await;
    assert_eq!(run.code, 0, "--nkey: {run:?}");
    let creds = dir.path().join("user.creds");
    std::fs::write(&creds, format!("-----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n"))
        .unwrap();
    let run = status(vec![], vec![("NATS_CREDS", creds.display().to_string())]).await;
    assert_eq!(run.code, 0, "NATS_CREDS with a seed: {run:?}");

    let _ = child.kill();
    let _ = child.wait();
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains("coordinator connected to nats://alice:***@127.0.0.1:"), "{text}");
    assert!(!text.contains(PASSWORD), "the password, in a debug-level log: {text}");
}

/// A token server: the token as `TOKEN@` in the URL and as `NATS_TOKEN` authenticates; a
/// wrong one is refused without being printed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_in_the_url_or_nats_token_authenticates_and_a_wrong_one_is_refused_unprinted() {
    const TOKEN: &str = "tok-Lm3ZsEcret";
    let nats = NatsServer::start_with_config(&format!("authorization {{\n  token: \"{TOKEN}\"\n}}\n"));
    let client = nats.connect_with(&Options { token: Some(TOKEN.into()), ..Options::default() }).await;
    let cluster = Procs::start_on(nats, client, "");
    let mut coordinator = cluster.command();
    let url = cluster.nats.url().replacen("nats://", &format!("nats://{TOKEN}@"), 1);
    coordinator.env("NATS_URL", &url).args(["coordinator", "--id", "c-token"]);
    let mut child =
        coordinator.stdout(std::process::Stdio::null()).stderr(std::process::Stdio::null()).spawn().unwrap();
    let run = until("mur cluster status with NATS_TOKEN", WAIT, || async {
        let mut cmd = mur_tests::mur::mur();
        cmd.args(["cluster", "status", "--json", "--server", &cluster.nats.url()]).env("NATS_TOKEN", TOKEN);
        let run = mur_tests::mur::run_blocking(cmd).await;
        (run.code == 0).then_some(run)
    })
    .await;
    assert!(run.stdout.contains("c-token"), "{run:?}");
    let _ = child.kill();
    let _ = child.wait();

    let wrong = "tok-wrongSecret";
    let mut cmd = mur_tests::mur::mur();
    cmd.args(["cluster", "status", "--server", &cluster.nats.url()]).env("NATS_TOKEN", wrong);
    let run = mur_tests::mur::run_blocking(cmd).await;
    assert_eq!(run.code, 2, "{run:?}");
    assert!(run.stderr.contains("refused the connection: authorization violation; it was offered a token"), "{run:?}");
    assert!(!run.stderr.contains(wrong) && !run.stdout.contains(wrong), "{run:?}");
}

/// Wrong credentials and none: refused, said once with what was offered and what to check,
/// no secret in the output (a `MUR_LOG=debug` log included); `mur coordinator` and `mur
/// worker` exit instead of retrying the same refused credentials every second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_credentials_are_said_once_without_the_secret_and_the_services_exit() {
    let (nats, _client, _seed) = auth_server().await;
    let wrong = "pw-WrongSecret9";
    let url = with_user(&nats, "alice", wrong);
    for service in ["coordinator", "worker"] {
        let mut cmd = mur_tests::mur::mur();
        cmd.env("MUR_LOG", "debug").env("NATS_URL", &url).arg(service);
        if service == "worker" {
            let dir = tempfile::tempdir().unwrap();
            cmd.arg("--workdir").arg(dir.path().join("w"));
        }
        let run = tokio::time::timeout(WAIT, mur_tests::mur::run_blocking(cmd))
            .await
            .unwrap_or_else(|_| panic!("mur {service} kept retrying refused credentials"));
        assert_eq!(run.code, 2, "{service}: {run:?}");
        assert_eq!(run.stderr.matches("refused the connection").count(), 1, "{service}, said once: {run:?}");
        assert!(
            run.stderr.contains(&format!(
                "NATS at nats://alice:***@127.0.0.1:{} refused the connection: authorization violation; it was \
                 offered user \"alice\" and a password: check --creds",
                port(&nats)
            )),
            "{service}: {run:?}"
        );
        assert!(!run.stderr.contains(wrong) && !run.stdout.contains(wrong), "{service}, the password: {run:?}");
    }

    let mut anonymous = mur_tests::mur::mur();
    anonymous.args(["task", "ls", "--json", "--server", &nats.url()]);
    let run = mur_tests::mur::run_blocking(anonymous).await;
    assert_eq!(run.code, 2, "{run:?}");
    assert!(run.stderr.contains("authorization violation; it was offered no credentials"), "{run:?}");
}
