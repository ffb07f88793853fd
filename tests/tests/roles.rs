//! `mur auth init DIR --tls` (issue #31): nats-server started with the configuration it
//! wrote, TLS on; the round trip with each role's credentials, and every forbidden action of
//! the table below refused by the server itself (a permissions violation), one test per row.

use mur_nats::connect::{Auth, Options};
use mur_tests::capsule::shell_capsule;
use mur_tests::nats::NatsServer;
use mur_tests::procs::{Procs, until};
use std::path::{Path, PathBuf};
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(60);

/// `mur auth init DIR --tls --host murmur.example` into a fresh folder.
fn auth_init() -> tempfile::TempDir {
    let dir = tempfile::Builder::new().prefix("mur-auth-").tempdir().unwrap();
    let out = mur_tests::mur::mur()
        .args(["auth", "init"])
        .arg(dir.path())
        .args(["--tls", "--host", "murmur.example", "--json"])
        .output()
        .expect("mur auth init");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    dir
}

/// nats-server with the configuration `mur auth init` wrote.
fn server(dir: &Path) -> NatsServer {
    NatsServer::start_with_config(&std::fs::read_to_string(dir.join("nats-server.conf")).unwrap())
}

fn creds(dir: &Path, role: &str) -> PathBuf {
    dir.join(format!("{role}.creds"))
}

/// The options of `role`: its credentials file and the CA.
fn role_options(dir: &Path, role: &str) -> Options {
    Options { creds: Some(creds(dir, role)), tls_ca: Some(dir.join("ca.pem")), ..Options::default() }
}

/// Admin pushes a capsule, a client sends a task, a worker runs it, the client reads the
/// record: each process with its own role's credentials, over TLS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_round_trip_works_over_tls_with_each_roles_credentials() {
    let dir = auth_init();
    let dir = dir.path();
    for file in ["coordinator.creds", "worker.creds", "client.creds", "approver.creds", "admin.creds", "server-key.pem"]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.join(file)).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "{file} is readable by its owner only");
    }
    let nats = server(dir);
    let admin = nats.connect_with(&role_options(dir, "admin")).await;
    let mut cluster = Procs::start_on(nats, admin, "");
    cluster.set_env("NATS_CA", &dir.join("ca.pem").display().to_string());
    cluster.set_env("NATS_CREDS", &creds(dir, "coordinator").display().to_string());
    let coordinator = cluster.coordinator("coordinator-1");
    cluster.set_env("NATS_CREDS", &creds(dir, "worker").display().to_string());
    let worker = cluster.worker("wkr-role", 1);
    cluster.set_env("NATS_CREDS", &creds(dir, "admin").display().to_string());
    let capsule = shell_capsule("role-echo");
    let capsule_dir = capsule.dir().display().to_string();
    until("admin pushes the capsule", WAIT, || async {
        (cluster.mur(&["capsule", "push", &capsule_dir]).await.code == 0).then_some(())
    })
    .await;
    cluster.wait_workers(1).await;
    cluster.set_env("NATS_CREDS", &creds(dir, "client").display().to_string());
    let sent = cluster.mur(&["task", "send", "role-echo", "echo by-roles", "--wait", "--json"]).await;
    let record = sent.last_json();
    assert_eq!(
        record["state"],
        "completed",
        "{sent:?}\ncoordinator:\n{}\nworker:\n{}",
        coordinator.log(),
        worker.log()
    );
    let id = record["task_id"].as_str().unwrap().to_string();
    let status = cluster.mur_ok(&["task", "status", &id, "--json"]).await;
    assert!(status.stdout.contains("by-roles"), "{status:?}");
    // The client's other API calls.
    cluster.mur_ok(&["cluster", "status", "--json"]).await;
    cluster.mur_ok(&["fleet", "ls", "--json"]).await;
    let violations = format!("{}{}", coordinator.log(), worker.log());
    assert!(!violations.contains("Permissions Violation"), "{violations}");
}

/// What a role tries.
enum Try {
    /// Publish one message on the subject.
    Publish(&'static str),
    /// Subscribe to the subject.
    Subscribe(&'static str),
}

/// Connects as `role` with the seed of its credentials file over TLS (the CA `mur auth init`
/// wrote); the server's events (a permissions violation among them) arrive on the channel.
async fn connect_as(
    dir: &std::path::Path,
    nats: &NatsServer,
    role: &str,
) -> (async_nats::Client, tokio::sync::mpsc::UnboundedReceiver<String>) {
    let Auth::Nkey { seed, .. } = Auth::from_creds_file(&creds(dir, role)).unwrap() else {
        panic!("mur auth init writes nkey seeds")
    };
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<String>();
    mur_nats::tls::install_crypto_provider();
    let client = async_nats::ConnectOptions::with_nkey(seed)
        .add_root_certificates(dir.join("ca.pem"))
        .event_callback(move |event| {
            let tx = tx.clone();
            async move {
                let _ = tx.send(event.to_string());
            }
        })
        .connect(nats.url())
        .await
        .unwrap_or_else(|e| panic!("{role} connects: {e}"));
    (client, rx)
}

/// Connects as `role` (its seed from its credentials file) and does `attempt`; returns once
/// the server has said it is a permissions violation, with its message, or fails the test.
async fn refused(role: &str, attempt: Try) -> String {
    let dir = auth_init();
    let nats = server(dir.path());
    let (client, mut rx) = connect_as(dir.path(), &nats, role).await;
    let (what, subject) = match attempt {
        Try::Publish(subject) => {
            client.publish(subject, "forged".into()).await.unwrap();
            ("Publish to", subject)
        }
        Try::Subscribe(subject) => {
            let _sub = client.subscribe(subject).await.unwrap();
            ("Subscription to", subject)
        }
    };
    client.flush().await.unwrap();
    let expected = format!("Permissions Violation for {what} \"{subject}\"");
    tokio::time::timeout(WAIT, async {
        while let Some(event) = rx.recv().await {
            if event.contains(&expected) {
                return event;
            }
        }
        panic!("the event stream ended before the server refused {role}: {expected}")
    })
    .await
    .unwrap_or_else(|_| panic!("the server did not refuse {role}: {expected}"))
}

/// One test per row: role, the forbidden action, what it stands for.
macro_rules! forbidden {
    ($($name:ident: $role:literal, $try:expr;)*) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            let said = refused($role, $try).await;
            assert!(said.contains("Permissions Violation"), "{said}");
        }
    )*};
}

forbidden! {
    // A client: the API and reading, nothing else.
    a_client_cannot_write_a_task_record: "client", Try::Publish("$KV.mur_tasks.tsk_forged");
    a_client_cannot_publish_a_dispatch: "client", Try::Publish("mur.dispatch");
    a_client_cannot_publish_a_trace_line: "client", Try::Publish("mur.trace.ses_forged");
    a_client_cannot_push_a_capsule_chunk: "client", Try::Publish("$O.mur_capsules.C.forged");
    a_client_cannot_write_the_capsule_index: "client", Try::Publish("$KV.mur_capsule_index.hello");
    a_client_cannot_pull_the_workers_dispatches: "client", Try::Publish("$JS.API.CONSUMER.MSG.NEXT.MUR_DISPATCH.workers");
    a_client_cannot_read_dispatches_in_flight: "client", Try::Subscribe("mur.dispatch");
    a_client_cannot_approve_a_step: "client", Try::Publish("mur.api.fleet.approve");
    a_client_cannot_deny_a_step: "client", Try::Publish("mur.api.fleet.deny");
    a_client_cannot_take_the_leader_lease: "client", Try::Publish("$KV.mur_leader.leader");
    a_client_cannot_delete_a_stream: "client", Try::Publish("$JS.API.STREAM.DELETE.KV_mur_tasks");
    // A worker: its tasks' records, traces, checkpoints, permits; not capsules, the lease, fleets.
    a_worker_cannot_push_a_capsule_chunk: "worker", Try::Publish("$O.mur_capsules.C.forged");
    a_worker_cannot_write_the_capsule_index: "worker", Try::Publish("$KV.mur_capsule_index.hello");
    a_worker_cannot_take_the_leader_lease: "worker", Try::Publish("$KV.mur_leader.leader");
    a_worker_cannot_write_a_fleet_definition: "worker", Try::Publish("$KV.mur_fleets.release");
    a_worker_cannot_stop_a_fleet: "worker", Try::Publish("mur.api.fleet.stop");
    a_worker_cannot_approve_a_step: "worker", Try::Publish("mur.api.fleet.approve");
    a_worker_cannot_delete_a_stream: "worker", Try::Publish("$JS.API.STREAM.DELETE.KV_mur_tasks");
    a_worker_cannot_purge_the_task_records: "worker", Try::Publish("$JS.API.STREAM.PURGE.KV_mur_tasks");
    // An approver: a client that may also approve and deny.
    an_approver_cannot_write_a_task_record: "approver", Try::Publish("$KV.mur_tasks.tsk_forged");
    an_approver_cannot_push_a_capsule_chunk: "approver", Try::Publish("$O.mur_capsules.C.forged");
}

/// The approver may approve where a client may not: the same publish, no violation (the
/// server answers nothing within a round trip of the connection).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approver_may_publish_an_approval() {
    may_publish_an_approval("approver").await;
}

/// Admin may approve too (approving is the approver's and admin's permission).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admin_may_publish_an_approval() {
    may_publish_an_approval("admin").await;
}

/// `role` publishes an approval on a connection subscribed to the subject: the message
/// comes back, so the server took the publish (a permissions violation drops it).
async fn may_publish_an_approval(role: &str) {
    use futures::StreamExt;
    let dir = auth_init();
    let nats = server(dir.path());
    let (client, _events) = connect_as(dir.path(), &nats, role).await;
    let mut approvals = client.subscribe("mur.api.fleet.approve").await.unwrap();
    client.flush().await.unwrap();
    client.publish("mur.api.fleet.approve", "{}".into()).await.unwrap();
    let message = tokio::time::timeout(WAIT, approvals.next()).await.expect("the approval comes back");
    assert_eq!(message.map(|m| m.payload), Some("{}".into()), "{role}'s approval was delivered");
}

/// `mur auth init` into a folder it wrote before refuses (new keys would lock out every
/// holder of the old files) unless `--force`, which writes new keys.
#[test]
fn auth_init_does_not_overwrite_keys_without_force() {
    let dir = auth_init();
    let before = std::fs::read_to_string(creds(dir.path(), "worker")).unwrap();
    let again = mur_tests::mur::mur().args(["auth", "init"]).arg(dir.path()).output().unwrap();
    assert_eq!(again.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&again.stderr);
    assert!(stderr.contains("nats-server.conf exists: pass --force to write new keys"), "{stderr}");
    assert_eq!(std::fs::read_to_string(creds(dir.path(), "worker")).unwrap(), before);
    let forced = mur_tests::mur::mur().args(["auth", "init", "--force"]).arg(dir.path()).output().unwrap();
    assert!(forced.status.success(), "{}", String::from_utf8_lossy(&forced.stderr));
    assert_ne!(std::fs::read_to_string(creds(dir.path(), "worker")).unwrap(), before);
}

/// The API calls that record who called (an approval, `fleet stop`/`start`, a job's source)
/// record the caller's credential's name, as nats-server states it, never the name the
/// request gives, nor a `Nats-Request-Info` header the caller forges: the coordinator
/// serves them on its identity connection (`--identity identity.creds`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_is_recorded_with_its_credentials_name_not_the_name_it_claims() {
    use mur_proto::fleet::{Approval, Decision, Job, JobStatus};
    use mur_proto::fleet_store::{self, Sentinel};
    let dir = auth_init();
    let dir = dir.path();
    let nats = server(dir);
    let admin = nats.connect_with(&role_options(dir, "admin")).await;
    let mut cluster = Procs::start_on(nats, admin.clone(), "");
    cluster.set_env("NATS_CA", &dir.join("ca.pem").display().to_string());
    cluster.set_env("NATS_CREDS", &creds(dir, "coordinator").display().to_string());
    cluster.set_env("MUR_IDENTITY", &dir.join("identity.creds").display().to_string());
    let coordinator = cluster.coordinator("coordinator-1");
    cluster.set_env("NATS_CREDS", &creds(dir, "admin").display().to_string());
    let fleet_file = dir.join("pair.yaml");
    std::fs::write(&fleet_file, "name: pair\ngoal: Answer the question.\nmembers: [writer, critic]\n").unwrap();
    until("admin creates the fleet", WAIT, || async {
        (cluster.mur(&["fleet", "create", fleet_file.to_str().unwrap()]).await.code == 0).then_some(())
    })
    .await;
    let js = async_nats::jetstream::new(admin.clone());
    let fleets = js.get_key_value(fleet_store::FLEETS_BUCKET).await.unwrap();
    let jobs = js.get_key_value(fleet_store::JOBS_BUCKET).await.unwrap();

    // `mur fleet stop --by security-officer` with the approver's credentials.
    cluster.set_env("NATS_CREDS", &creds(dir, "approver").display().to_string());
    let stop = cluster.mur_ok(&["fleet", "stop", "pair", "--by", "security-officer"]).await;
    let sentinel: Sentinel =
        serde_json::from_slice(&fleets.get(fleet_store::stopped_key("pair")).await.unwrap().unwrap()).unwrap();
    assert_eq!(sentinel.by, "approver", "{stop:?}\n{}", coordinator.log());
    // `fleet start` names its caller on the channel.
    cluster.set_env("NATS_CREDS", &creds(dir, "admin").display().to_string());
    cluster.mur_ok(&["fleet", "start", "pair"]).await;
    let log = cluster.mur_ok(&["fleet", "log", "pair"]).await;
    assert!(log.stdout.contains("stopped by approver") && log.stdout.contains("started by admin"), "{log:?}");
    assert!(!log.stdout.contains("security-officer"), "{log:?}");

    // A client sends a job claiming another source, with a forged header naming the admin's key.
    let (client, _) = connect_as(dir, &cluster.nats, "client").await;
    let admin_key = std::fs::read_to_string(dir.join("identity.creds"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_suffix(" admin").map(str::to_string))
        .expect("identity.creds names the admin's key");
    let mut forged = async_nats::HeaderMap::new();
    forged.insert("Nats-Request-Info", format!(r#"{{"acc":"MUR","user":"{admin_key}"}}"#).as_str());
    let job: Job = mur_nats::api::call_with_headers(
        &client,
        fleet_store::api::SEND,
        forged.clone(),
        r#"{"fleet":"pair","text":"ship it","source":"security-officer"}"#,
    )
    .await
    .unwrap();
    assert_eq!(job.source, "client");

    // A job awaiting approval; the approver answers claiming to be someone else.
    let mut blocked = Job::new("release", "cli", 1);
    blocked.status = JobStatus::Blocked;
    blocked.approval = Some(Approval { steps: vec!["release".into()], decision: None, by: None, at: None });
    jobs.create(fleet_store::job_key("pair", &blocked.id), serde_json::to_vec(&blocked).unwrap().into()).await.unwrap();
    let (approver, _) = connect_as(dir, &cluster.nats, "approver").await;
    let body = serde_json::json!({ "fleet": "pair", "job": blocked.id, "by": "security-officer" }).to_string();
    let answered: Job =
        mur_nats::api::call_with_headers(&approver, fleet_store::api::APPROVE, forged, body).await.unwrap();
    let approval = answered.approval.unwrap();
    assert_eq!((approval.decision, approval.by.as_deref()), (Some(Decision::Approved), Some("approver")));
}
