//! The cluster's JetStream layer against real `nats-server` processes: the testkit's
//! server (start, crash, restart on the same port and store), the coordinator's resources
//! (created, checked, updated idempotently), and capsule bundles (push, list, fetch by
//! digest, cache).
//!
//! Each test starts a server of its own. With `MUR_TEST_NATS_URL` set they share one and
//! touch the same fixed resource names: run them with `--test-threads 1` then.

use anyhow::Result;
use async_nats::jetstream::consumer::AckPolicy;
use async_nats::jetstream::stream::{self, RetentionPolicy, StorageType};
use futures::{StreamExt, TryStreamExt};
use mur_coordinator::resources::{self, Action, Error, Settings, Storage};
use mur_coordinator::service;
use mur_nats::api;
use mur_nats::clock::{Clock, SystemClock};
use mur_proto::TaskId;
use mur_proto::cluster::{self, TaskRecord};
use mur_proto::task::TaskState;
use mur_proto::{ExitStatus, Id, IdKind};
use mur_tests::capsule::TestCapsule;
use mur_tests::nats::NatsServer;
use mur_worker::bundle;
use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

// ---------------------------------------------------------------------------------------
// The testkit's server.

#[tokio::test]
async fn a_spawned_server_serves_jetstream_publish_and_get() -> Result<()> {
    let server = NatsServer::start();
    assert!(server.url().starts_with("nats://"), "{}", server.url());
    let js = server.jetstream().await;
    let stream = js
        .create_stream(stream::Config { name: "SMOKE".into(), subjects: vec!["smoke.>".into()], ..Default::default() })
        .await?;
    let ack = js.publish("smoke.one", "hello".into()).await?.await?;
    assert_eq!((ack.stream.as_str(), ack.sequence), ("SMOKE", 1));
    let msg = stream.get_raw_message(ack.sequence).await?;
    assert_eq!((msg.subject.as_str(), &msg.payload[..]), ("smoke.one", &b"hello"[..]));
    Ok(())
}

#[tokio::test]
async fn a_restarted_server_keeps_its_port_and_its_streams() -> Result<()> {
    let mut server = NatsServer::start();
    if server.is_external() {
        eprintln!("skipped: MUR_TEST_NATS_URL is set, and a shared server cannot be restarted");
        return Ok(());
    }
    let url = server.url();
    let client = server.connect().await;
    let js = async_nats::jetstream::new(client.clone());
    js.create_stream(stream::Config {
        name: "DURABLE".into(),
        subjects: vec!["durable.>".into()],
        storage: StorageType::File,
        ..Default::default()
    })
    .await?;
    js.publish("durable.before", "kept".into()).await?.await?;
    assert!(server.store_dir().join("jetstream").is_dir());

    server.restart(); // SIGKILL, then start on the same port and store folder
    assert_eq!(server.url(), url);
    let fresh = async_nats::jetstream::new(server.connect().await);
    let msg = fresh.get_stream("DURABLE").await?.get_raw_message(1).await?;
    assert_eq!(&msg.payload[..], b"kept");

    // The first client reconnects by itself and can publish again.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let ack = loop {
        match js.publish("durable.after", "again".into()).await {
            Ok(ack) => match ack.await {
                Ok(ack) => break ack,
                Err(e) if tokio::time::Instant::now() < deadline => eprintln!("retrying after reconnect: {e}"),
                Err(e) => return Err(e.into()),
            },
            Err(e) if tokio::time::Instant::now() < deadline => eprintln!("retrying after reconnect: {e}"),
            Err(e) => return Err(e.into()),
        }
    };
    assert_eq!(ack.sequence, 2);

    // A clean stop and start keeps both messages. A new client reads them: a request sent
    // by an old one in the instant its socket closes is lost and times out, which is the
    // client's business, not the server's.
    server.restart_graceful();
    let after = server.jetstream().await;
    let info = after.get_stream("DURABLE").await?.get_info().await?;
    assert_eq!(info.state.messages, 2);
    Ok(())
}

// ---------------------------------------------------------------------------------------
// The coordinator's resources.

#[tokio::test]
async fn ensure_creates_every_resource_with_the_configured_settings() -> Result<()> {
    let server = NatsServer::start();
    let js = server.jetstream().await;
    let settings = Settings { ack_wait_secs: 42, max_deliver: 7, trace_max_age_secs: 3600, ..Settings::default() };
    let res = resources::ensure(&js, &settings).await?;
    let resources: Vec<(&str, Action)> = res.outcomes.iter().map(|o| (o.resource.as_str(), o.action)).collect();
    assert_eq!(
        resources,
        [
            ("MUR_DISPATCH", Action::Created),
            ("MUR_TRACE", Action::Created),
            ("MUR_DEAD_LETTERS", Action::Created),
            ("KV_mur_tasks", Action::Created),
            ("KV_mur_workers", Action::Created),
            ("KV_mur_sessions", Action::Created),
            ("KV_mur_capsule_index", Action::Created),
            ("KV_mur_leader", Action::Created),
            ("KV_mur_fanout", Action::Created),
            ("OBJ_mur_capsules", Action::Created),
            ("KV_mur_fleets", Action::Created),
            ("KV_mur_jobs", Action::Created),
            ("KV_mur_tokens", Action::Created),
            ("MUR_FLEET", Action::Created),
            ("MUR_DISPATCH/workers", Action::Created),
            ("MUR_DEAD_LETTERS/coordinators", Action::Created),
        ]
    );
    // The leader's lease lives `leader_lease_secs` (10) without a renewal.
    let leader = js.get_stream("KV_mur_leader").await?.get_info().await?.config;
    assert_eq!((leader.max_age, leader.max_messages_per_subject), (Duration::from_secs(10), 1));
    // A fan-out permit lives `fanout_lease_secs` (15); its expiry leaves a marker.
    let fanout = js.get_stream("KV_mur_fanout").await?.get_info().await?.config;
    assert_eq!(
        (fanout.max_age, fanout.max_messages_per_subject, fanout.subject_delete_marker_ttl),
        (Duration::from_secs(15), 1, Some(Duration::from_secs(1)))
    );

    let dispatch = js.get_stream(cluster::DISPATCH_STREAM).await?.get_info().await?.config;
    assert_eq!(dispatch.subjects, [cluster::DISPATCH_SUBJECT]);
    assert_eq!((dispatch.retention, dispatch.storage), (RetentionPolicy::WorkQueue, StorageType::File));
    assert_eq!(dispatch.duplicate_window, Duration::from_secs(120));
    let consumer = js.get_stream(cluster::DISPATCH_STREAM).await?.consumer_info(cluster::DISPATCH_CONSUMER).await?;
    assert_eq!(consumer.config.durable_name.as_deref(), Some("workers"));
    assert_eq!(consumer.config.ack_policy, AckPolicy::Explicit);
    assert_eq!((consumer.config.ack_wait, consumer.config.max_deliver), (Duration::from_secs(42), 7));
    assert_eq!(consumer.config.max_ack_pending, 10_000);

    let trace = js.get_stream(cluster::TRACE_STREAM).await?.get_info().await?.config;
    assert_eq!(
        (trace.subjects.as_slice(), trace.max_age),
        (&["mur.trace.>".to_string()][..], Duration::from_secs(3600))
    );

    let fleet = js.get_stream(mur_proto::fleet_store::FLEET_STREAM).await?.get_info().await?.config;
    assert_eq!(
        (fleet.subjects.as_slice(), fleet.retention),
        (&["mur.fleet.>".to_string()][..], RetentionPolicy::Limits)
    );

    for (bucket, history) in [
        ("mur_tasks", 5),
        ("mur_workers", 1),
        ("mur_sessions", 1),
        ("mur_capsule_index", 64),
        ("mur_fleets", 5),
        ("mur_jobs", 5),
        ("mur_tokens", 1),
    ] {
        let status = js.get_key_value(bucket).await?.status().await?;
        assert_eq!(status.history(), history, "{bucket}");
    }
    // The handles work: a KV round trip and an object store listing.
    res.tasks.put("tsk_1", "{}".into()).await?;
    assert_eq!(res.tasks.get("tsk_1").await?.as_deref(), Some(&b"{}"[..]));
    assert_eq!(res.capsules.list().await?.try_collect::<Vec<_>>().await?.len(), 0);
    assert_eq!(res.dispatch_consumer.cached_info().name, "workers");
    Ok(())
}

#[tokio::test]
async fn ensure_twice_changes_nothing_and_a_changed_setting_is_applied() -> Result<()> {
    let server = NatsServer::start();
    let js = server.jetstream().await;
    let settings = Settings::default();
    resources::ensure(&js, &settings).await?;
    let again = resources::ensure(&js, &settings).await?;
    assert!(again.outcomes.iter().all(|o| o.action == Action::Unchanged), "{:?}", again.outcomes);

    let changed = Settings { ack_wait_secs: 90, trace_max_age_secs: 60, ..settings };
    let res = resources::ensure(&js, &changed).await?;
    let updated: Vec<&str> =
        res.outcomes.iter().filter(|o| o.action == Action::Updated).map(|o| o.resource.as_str()).collect();
    assert_eq!(updated, ["MUR_TRACE", "MUR_DISPATCH/workers"]);
    let consumer = js.get_stream(cluster::DISPATCH_STREAM).await?.consumer_info(cluster::DISPATCH_CONSUMER).await?;
    assert_eq!(consumer.config.ack_wait, Duration::from_secs(90));
    let trace = js.get_stream(cluster::TRACE_STREAM).await?.get_info().await?.config;
    assert_eq!(trace.max_age, Duration::from_secs(60));
    let third = resources::ensure(&js, &changed).await?;
    assert!(third.outcomes.iter().all(|o| o.action == Action::Unchanged), "{:?}", third.outcomes);
    Ok(())
}

#[tokio::test]
async fn a_setting_the_server_cannot_change_fails_naming_the_resource() -> Result<()> {
    let server = NatsServer::start();
    let js = server.jetstream().await;
    resources::ensure(&js, &Settings::default()).await?;
    let err = resources::ensure(&js, &Settings { storage: Storage::Memory, ..Settings::default() }).await.unwrap_err();
    assert!(matches!(&err, Error::Request { resource, action: "update", .. } if resource == "MUR_DISPATCH"), "{err}");
    assert!(err.to_string().starts_with("MUR_DISPATCH: update failed: "), "{err}");
    let kept = js.get_stream(cluster::DISPATCH_STREAM).await?.get_info().await?.config;
    assert_eq!(kept.storage, StorageType::File);
    Ok(())
}

#[tokio::test]
async fn invalid_settings_are_refused_before_anything_is_created() -> Result<()> {
    let server = NatsServer::start();
    let js = server.jetstream().await;
    let err = resources::ensure(&js, &Settings { max_deliver: 0, ..Settings::default() }).await.unwrap_err();
    assert_eq!(err.to_string(), "settings: max_deliver: must be at least 1, got 0");
    let names: Vec<String> = js.stream_names().try_collect().await?;
    assert!(names.is_empty(), "{names:?}");
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Capsule bundles.

const MANIFEST: &str = "name: greeter\nversion: 1.0.0\ninference:\n  driver: scripted\n  script: replies.yaml\n";

fn greeter(prompt: &str) -> TestCapsule {
    TestCapsule::new(
        MANIFEST,
        &[
            ("replies.yaml", "replies:\n  - text: hi\n"),
            ("prompt.md", prompt),
            ("hooks/gate.sh", "#!/bin/sh\necho '{\"action\": \"none\"}'\n"),
            ("workdir/ses_1/left-behind.txt", "not packed"),
        ],
    )
}

fn mode(path: &std::path::Path) -> u32 {
    std::fs::metadata(path).unwrap().permissions().mode() & 0o777
}

#[tokio::test]
async fn push_list_and_fetch_round_trip_restores_files_and_exec_bits() -> Result<()> {
    let server = NatsServer::start();
    let res = resources::ensure(&server.jetstream().await, &Settings::default()).await?;
    let capsule = greeter("be kind");
    let packed = bundle::pack(capsule.dir())?;
    assert_eq!(bundle::pack(capsule.dir())?.digest, packed.digest, "packing is deterministic");

    let receipt = bundle::push(&res.capsules, &res.capsule_index, &packed).await?;
    assert_eq!((receipt.name.as_str(), receipt.version.as_str()), ("greeter", "1.0.0"));
    assert_eq!((receipt.digest.as_str(), receipt.bytes), (packed.digest.as_str(), packed.archive.len() as u64));

    let listed = bundle::list(&res.capsule_index).await?;
    assert_eq!(listed.len(), 1);
    assert_eq!((listed[0].name.as_str(), listed[0].digest.as_str()), ("greeter", packed.digest.as_str()));
    assert_eq!((listed[0].version.as_str(), listed[0].bytes), ("1.0.0", receipt.bytes));
    assert!(listed[0].pushed_at > 1_600_000_000_000);

    let cache = tempfile::tempdir()?;
    let dir = bundle::fetch(&res.capsules, "greeter", &packed.digest, cache.path()).await?;
    assert_eq!(dir, cache.path().join("greeter").join(&packed.digest));
    assert_eq!(std::fs::read_to_string(dir.join("prompt.md"))?, "be kind");
    assert_eq!(std::fs::read_to_string(dir.join("murmur.yaml"))?, MANIFEST);
    assert_eq!((mode(&dir.join("hooks/gate.sh")), mode(&dir.join("prompt.md"))), (0o755, 0o644));
    assert!(!dir.join("workdir").exists(), "workdir/ is not part of a bundle");
    let leftovers: Vec<_> = std::fs::read_dir(cache.path().join("greeter"))?.map(|e| e.unwrap().file_name()).collect();
    assert_eq!(leftovers, [std::ffi::OsString::from(&packed.digest)], "no temporary folder is left");

    // Once unpacked, the cache answers without the store: delete the object, fetch again.
    res.capsules.delete(cluster::bundle_object("greeter", &packed.digest)).await?;
    assert_eq!(bundle::fetch(&res.capsules, "greeter", &packed.digest, cache.path()).await?, dir);
    let other_cache = tempfile::tempdir()?;
    let err = bundle::fetch(&res.capsules, "greeter", &packed.digest, other_cache.path()).await.unwrap_err();
    assert_eq!(err.to_string(), format!("capsule bundle greeter/{} not found", packed.digest));
    Ok(())
}

#[tokio::test]
async fn a_second_push_keeps_the_first_digest_fetchable() -> Result<()> {
    let server = NatsServer::start();
    let res = resources::ensure(&server.jetstream().await, &Settings::default()).await?;
    let capsule = greeter("first");
    let first = bundle::pack(capsule.dir())?;
    bundle::push(&res.capsules, &res.capsule_index, &first).await?;
    std::fs::write(capsule.dir().join("prompt.md"), "second")?;
    // Other content is a new version (issue #31: versions are immutable).
    let manifest = std::fs::read_to_string(capsule.dir().join("murmur.yaml"))?;
    std::fs::write(capsule.dir().join("murmur.yaml"), manifest.replacen("version: ", "version: 9", 1))?;
    let second = bundle::pack(capsule.dir())?;
    assert_ne!(first.digest, second.digest);
    bundle::push(&res.capsules, &res.capsule_index, &second).await?;
    // Pushing the latest again changes nothing.
    bundle::push(&res.capsules, &res.capsule_index, &second).await?;

    let latest = bundle::latest(&res.capsule_index, "greeter").await?.expect("pushed");
    assert_eq!(latest.digest, second.digest);
    let history: Vec<String> =
        bundle::history(&res.capsule_index, "greeter").await?.into_iter().map(|e| e.digest).collect();
    assert_eq!(history, [first.digest.clone(), second.digest.clone()]);

    let cache = tempfile::tempdir()?;
    let old = bundle::fetch(&res.capsules, "greeter", &first.digest, cache.path()).await?;
    let new = bundle::fetch(&res.capsules, "greeter", &second.digest, cache.path()).await?;
    assert_eq!(std::fs::read_to_string(old.join("prompt.md"))?, "first");
    assert_eq!(std::fs::read_to_string(new.join("prompt.md"))?, "second");
    Ok(())
}

#[tokio::test]
async fn a_malformed_manifest_is_refused_at_pack_and_nothing_is_stored() -> Result<()> {
    let server = NatsServer::start();
    let res = resources::ensure(&server.jetstream().await, &Settings::default()).await?;
    let good = greeter("ok");
    let receipt = bundle::push(&res.capsules, &res.capsule_index, &bundle::pack(good.dir())?).await?;

    let bad = TestCapsule::new(
        "name: greeter\nversion: 2.0.0\ninference:\n  driver: scripted\n  script: replies.yaml\n  max_turns: 0\n",
        &[("replies.yaml", "replies:\n  - text: hi\n")],
    );
    let err = bundle::pack(bad.dir()).unwrap_err();
    assert!(err.to_string().ends_with("murmur.yaml: inference.max_turns: must be at least 1, got 0"), "{err}");

    let listed = bundle::list(&res.capsule_index).await?;
    assert_eq!(
        listed.iter().map(|e| (e.name.as_str(), e.digest.as_str())).collect::<Vec<_>>(),
        [("greeter", receipt.digest.as_str())]
    );
    let objects: Vec<String> = res.capsules.list().await?.map_ok(|o| o.name).try_collect().await?;
    assert_eq!(objects, [cluster::bundle_object("greeter", &receipt.digest)]);
    Ok(())
}

#[tokio::test]
async fn a_bundle_whose_content_does_not_match_its_digest_is_refused() -> Result<()> {
    let server = NatsServer::start();
    let res = resources::ensure(&server.jetstream().await, &Settings::default()).await?;
    let claimed = "0".repeat(64);
    res.capsules.put(cluster::bundle_object("greeter", &claimed).as_str(), &mut &b"not a tar archive"[..]).await?;
    let cache = tempfile::tempdir()?;
    let err = bundle::fetch(&res.capsules, "greeter", &claimed, cache.path()).await.unwrap_err();
    assert!(matches!(err, bundle::Error::DigestMismatch { .. }), "{err}");
    assert!(!cache.path().join("greeter").join(&claimed).exists());

    let err = bundle::fetch(&res.capsules, "greeter", "../../etc", cache.path()).await.unwrap_err();
    assert_eq!(err.to_string(), r#"bundle digest "../../etc" is not 64 lowercase hex digits"#);
    let err = bundle::fetch(&res.capsules, "../greeter", &claimed, cache.path()).await.unwrap_err();
    assert_eq!(err.to_string(), r#"capsule name "../greeter" is not valid"#);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_pushes_of_one_capsule_both_land_in_the_index_history() -> Result<()> {
    let server = NatsServer::start();
    let res = resources::ensure(&server.jetstream().await, &Settings::default()).await?;
    let (a, b) = (greeter("from a"), greeter("from b"));
    // Two versions: one version with two contents is refused (issue #31).
    let manifest = std::fs::read_to_string(b.dir().join("murmur.yaml"))?;
    std::fs::write(b.dir().join("murmur.yaml"), manifest.replacen("version: ", "version: 9", 1))?;
    let (a, b) = (bundle::pack(a.dir())?, bundle::pack(b.dir())?);
    let (ra, rb) = tokio::join!(
        bundle::push(&res.capsules, &res.capsule_index, &a),
        bundle::push(&res.capsules, &res.capsule_index, &b)
    );
    let (ra, rb) = (ra?, rb?);
    let mut history: Vec<String> =
        bundle::history(&res.capsule_index, "greeter").await?.into_iter().map(|e| e.digest).collect();
    let latest = bundle::latest(&res.capsule_index, "greeter").await?.expect("pushed").digest;
    assert_eq!(history.last(), Some(&latest), "the latest is the last revision");
    history.sort();
    let mut pushed = vec![ra.digest, rb.digest];
    pushed.sort();
    assert_eq!(history, pushed, "each compare-and-set landed once");
    Ok(())
}

// ---------------------------------------------------------------------------------------
// The worker service. The tests play the coordinator: they create the resources, push a
// bundle, create the task record, bump its attempt and publish the dispatch.

mod worker_service {
    use super::*;
    use async_nats::jetstream::message::PublishMessage;
    use mur_proto::cluster::{Dispatch, SubmitRequest, TaskRecord, WorkerInfo};
    use mur_proto::ids::{Id, IdKind};
    use mur_proto::task::{ExitStatus, Origin, TaskState};
    use mur_worker::service::{self, Config};
    use std::future::Future;
    use tokio::sync::oneshot;
    use tokio::task::JoinHandle;

    const DEADLINE: Duration = Duration::from_secs(30);

    /// A scripted capsule answering `text` after `delay_ms`.
    fn scripted(text: &str, delay_ms: u64) -> TestCapsule {
        TestCapsule::new(
            "name: echoer\nversion: 1.0.0\ninference:\n  driver: scripted\n  script: replies.yaml\n",
            &[("replies.yaml", &format!("replies:\n  - text: {text}\n    delay_ms: {delay_ms}\n"))],
        )
    }

    struct Cluster {
        _server: NatsServer,
        client: async_nats::Client,
        js: async_nats::jetstream::Context,
        res: resources::Resources,
    }

    async fn cluster(settings: Settings) -> Result<Cluster> {
        let server = NatsServer::start();
        let client = server.connect().await;
        let js = async_nats::jetstream::new(client.clone());
        let res = resources::ensure(&js, &settings).await?;
        Ok(Cluster { _server: server, client, js, res })
    }

    impl Cluster {
        async fn push(&self, capsule: &TestCapsule) -> Result<String> {
            let packed = bundle::pack(capsule.dir())?;
            Ok(bundle::push(&self.res.capsules, &self.res.capsule_index, &packed).await?.digest)
        }

        /// Creates the record, bumps its attempt and publishes the dispatch, as the
        /// coordinator does. Returns the task id.
        async fn submit(&self, capsule: &str, digest: &str, text: &str) -> Result<String> {
            let task_id = Id::generate(IdKind::Task);
            let request = SubmitRequest::new(capsule, text, Origin::User);
            let mut record =
                TaskRecord::submitted(TaskId::unchecked(task_id.clone()), request, digest.into(), SystemClock.now_ms());
            let revision = self.res.tasks.create(&task_id, serde_json::to_vec(&record)?.into()).await?;
            record.attempt += 1;
            self.res.tasks.update(&task_id, serde_json::to_vec(&record)?.into(), revision).await?;
            let dispatch = Dispatch::bare(TaskId::unchecked(task_id.clone()), record.attempt);
            let msg =
                PublishMessage::build().payload(serde_json::to_vec(&dispatch)?.into()).message_id(dispatch.msg_id());
            self.js.send_publish(cluster::DISPATCH_SUBJECT, msg).await?.await?;
            Ok(task_id)
        }

        async fn record(&self, task_id: &str) -> Result<TaskRecord> {
            let bytes = self.res.tasks.get(task_id).await?.expect("the record exists");
            Ok(serde_json::from_slice(&bytes)?)
        }

        /// Waits for the record to reach a terminal state.
        async fn terminal(&self, task_id: &str) -> Result<TaskRecord> {
            let mut watch = self.res.tasks.watch_with_history(task_id).await?;
            let found = tokio::time::timeout(DEADLINE, async {
                while let Some(entry) = watch.try_next().await? {
                    let record: TaskRecord = serde_json::from_slice(&entry.value)?;
                    if record.state.is_terminal() {
                        return Ok(record);
                    }
                }
                anyhow::bail!("the watch ended")
            })
            .await;
            found.map_err(|_| anyhow::anyhow!("task {task_id} did not end within {DEADLINE:?}"))?
        }

        fn worker(&self, config: Config) -> Worker {
            let (stop, stopped) = oneshot::channel::<()>();
            let id = config.worker_id.clone();
            let handle = tokio::spawn(service::run(self.client.clone(), config, async move {
                let _ = stopped.await;
            }));
            Worker { id, stop, handle }
        }
    }

    struct Worker {
        id: String,
        stop: oneshot::Sender<()>,
        handle: JoinHandle<Result<(), service::Error>>,
    }

    impl Worker {
        async fn shutdown(self) -> Result<()> {
            let _ = self.stop.send(());
            tokio::time::timeout(DEADLINE, self.handle).await???;
            Ok(())
        }
    }

    fn config(workdir: &std::path::Path, slots: u32) -> Config {
        Config { slots, shutdown_grace: Duration::from_secs(5), ..Config::new(workdir) }
    }

    /// Polls `check` until it holds or the deadline passes.
    async fn until<F, Fut>(what: &str, mut check: F) -> Result<()>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<bool>>,
    {
        let deadline = tokio::time::Instant::now() + DEADLINE;
        let mut every = tokio::time::interval(Duration::from_millis(50));
        loop {
            every.tick().await;
            if check().await? {
                return Ok(());
            }
            if tokio::time::Instant::now() > deadline {
                anyhow::bail!("{what}: not within {DEADLINE:?}");
            }
        }
    }

    async fn dispatch_settled(c: &Cluster) -> Result<async_nats::jetstream::consumer::Info> {
        let mut consumer = c.res.dispatch_consumer.clone();
        until("the dispatch is acked", || {
            let mut consumer = consumer.clone();
            async move {
                let info = consumer.info().await?;
                Ok(info.num_ack_pending == 0 && info.num_pending == 0)
            }
        })
        .await?;
        Ok(consumer.info().await?.clone())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_worker_runs_a_dispatched_task_and_publishes_its_trace() -> Result<()> {
        let c = cluster(Settings { storage: Storage::Memory, ..Settings::default() }).await?;
        let capsule = scripted("all done", 0);
        let digest = c.push(&capsule).await?;
        let workdir = tempfile::tempdir()?;
        let worker = c.worker(config(workdir.path(), 2));
        let task_id = c.submit("echoer", &digest, "say done").await?;

        let record = c.terminal(&task_id).await?;
        assert_eq!(record.state, TaskState::Completed, "{record:?}");
        assert_eq!(record.exit_status, Some(ExitStatus::Ok));
        assert_eq!(record.result.as_deref(), Some("all done"));
        assert_eq!(record.worker.as_deref(), Some(worker.id.as_str()));
        assert_eq!(record.attempt, 1);
        assert!(record.started_at.is_some() && record.ended_at >= record.started_at, "{record:?}");
        let session_id = record.session_id.clone().expect("a session id");

        // The local trace and the published one are the same lines.
        let session_dir = workdir.path().join("sessions").join(&session_id);
        assert_eq!(std::fs::read_to_string(session_dir.join("out/result.txt"))?, "all done");
        assert!(session_dir.join("MURMUR.md").is_file());
        let local = std::fs::read_to_string(session_dir.join("trace.jsonl"))?;
        let local: Vec<&str> = local.lines().collect();
        assert!(local.len() >= 4, "{local:?}");
        let first: serde_json::Value = serde_json::from_str(local[0])?;
        assert_eq!(first["event_type"], "session_start");
        assert!(local.iter().any(|l| l.contains("\"task_start\"") && l.contains("\"cluster\"")), "{local:?}");
        let trace = c.js.get_stream(cluster::TRACE_STREAM).await?;
        until("every trace line is in MUR_TRACE", || {
            let mut trace = trace.clone();
            let want = local.len() as u64;
            async move { Ok(trace.info().await?.state.messages == want) }
        })
        .await?;
        for (seq, line) in local.iter().enumerate() {
            let msg = trace.get_raw_message(seq as u64 + 1).await?;
            assert_eq!(msg.subject.as_str(), cluster::trace_subject(&session_id));
            assert_eq!(std::str::from_utf8(&msg.payload)?, *line);
        }
        let info = dispatch_settled(&c).await?;
        assert_eq!((info.delivered.consumer_sequence, info.num_redelivered), (1, 0));
        worker.shutdown().await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_worker_with_two_slots_runs_two_slow_tasks_at_once() -> Result<()> {
        let c = cluster(Settings { storage: Storage::Memory, ..Settings::default() }).await?;
        let digest = c.push(&scripted("slow", 1500)).await?;
        let workdir = tempfile::tempdir()?;
        let worker = c.worker(config(workdir.path(), 2));
        let a = c.submit("echoer", &digest, "one").await?;
        let b = c.submit("echoer", &digest, "two").await?;
        let (a, b) = (c.terminal(&a).await?, c.terminal(&b).await?);
        for r in [&a, &b] {
            assert_eq!((r.state, r.result.as_deref()), (TaskState::Completed, Some("slow")), "{r:?}");
        }
        // Each started before the other ended.
        assert!(a.started_at < b.ended_at && b.started_at < a.ended_at, "{a:?}\n{b:?}");
        assert_ne!(a.session_id, b.session_id);
        worker.shutdown().await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_task_whose_bundle_is_missing_fails_with_the_reason_and_is_acked() -> Result<()> {
        let c = cluster(Settings { storage: Storage::Memory, ..Settings::default() }).await?;
        let workdir = tempfile::tempdir()?;
        let worker = c.worker(config(workdir.path(), 1));
        let missing = "f".repeat(64);
        let task_id = c.submit("echoer", &missing, "hello").await?;
        let record = c.terminal(&task_id).await?;
        assert_eq!((record.state, record.exit_status), (TaskState::Failed, Some(ExitStatus::Failed)), "{record:?}");
        let reason = format!("error: fetching capsule echoer: capsule bundle echoer/{missing} not found");
        assert_eq!(record.result.as_deref(), Some(reason.as_str()));
        assert_eq!(record.error.as_deref(), Some(reason.as_str()));
        assert_eq!(record.worker.as_deref(), Some(worker.id.as_str()));
        let info = dispatch_settled(&c).await?;
        assert_eq!((info.delivered.consumer_sequence, info.num_redelivered), (1, 0), "not redelivered");
        assert_eq!(c.res.dispatch.clone().info().await?.state.messages, 0, "the work queue is empty");
        worker.shutdown().await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn in_progress_acks_keep_a_task_past_the_ack_wait() -> Result<()> {
        let c = cluster(Settings { storage: Storage::Memory, ack_wait_secs: 2, ..Settings::default() }).await?;
        let digest = c.push(&scripted("patient", 5000)).await?;
        let workdir = tempfile::tempdir()?;
        let worker = c.worker(Config { progress_every: Some(Duration::from_millis(500)), ..config(workdir.path(), 2) });
        let task_id = c.submit("echoer", &digest, "wait").await?;
        let record = c.terminal(&task_id).await?;
        assert_eq!((record.state, record.result.as_deref()), (TaskState::Completed, Some("patient")));
        let info = dispatch_settled(&c).await?;
        assert_eq!((info.delivered.consumer_sequence, info.num_redelivered), (1, 0), "delivered once");
        // Session folders, not the workdir's `.lock`.
        let sessions = std::fs::read_dir(workdir.path().join("sessions"))?
            .filter(|e| e.as_ref().is_ok_and(|e| !e.file_name().to_string_lossy().starts_with('.')))
            .count();
        assert_eq!(sessions, 1, "one session ran");
        assert_eq!(c.record(&task_id).await?.session_id, record.session_id);
        worker.shutdown().await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_task_still_running_after_the_shutdown_grace_ends_canceled() -> Result<()> {
        let c = cluster(Settings { storage: Storage::Memory, ..Settings::default() }).await?;
        let digest = c.push(&scripted("never", 60_000)).await?;
        let workdir = tempfile::tempdir()?;
        let worker = c.worker(Config { shutdown_grace: Duration::from_millis(200), ..config(workdir.path(), 1) });
        let task_id = c.submit("echoer", &digest, "stall").await?;
        until("the task is working", || {
            let tasks = c.res.tasks.clone();
            let id = task_id.clone();
            async move {
                let bytes = tasks.get(&id).await?.expect("the record exists");
                Ok(serde_json::from_slice::<TaskRecord>(&bytes)?.state == TaskState::Working)
            }
        })
        .await?;
        worker.shutdown().await?;
        let record = c.record(&task_id).await?;
        assert_eq!((record.state, record.exit_status), (TaskState::Canceled, Some(ExitStatus::Canceled)), "{record:?}");
        let info = dispatch_settled(&c).await?;
        assert_eq!(info.delivered.consumer_sequence, 1);
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_worker_registers_heartbeats_and_unregisters_on_shutdown() -> Result<()> {
        let c = cluster(Settings { storage: Storage::Memory, ..Settings::default() }).await?;
        let workdir = tempfile::tempdir()?;
        let worker = c.worker(config(workdir.path(), 3));
        let id = worker.id.clone();
        let read = |workers: async_nats::jetstream::kv::Store, id: String| async move {
            let info: Option<WorkerInfo> = match workers.get(&id).await? {
                Some(b) => Some(serde_json::from_slice(&b)?),
                None => None,
            };
            anyhow::Ok(info)
        };
        until("the worker registers", || {
            futures::TryFutureExt::map_ok(read(c.res.workers.clone(), id.clone()), |i| i.is_some())
        })
        .await?;
        let first = read(c.res.workers.clone(), id.clone()).await?.expect("registered");
        assert_eq!((first.worker_id.as_str(), first.slots, first.busy), (id.as_str(), 3, 0));
        assert!(first.started_at <= first.heartbeat_at);
        until("the heartbeat refreshes the entry", || {
            let (workers, id) = (c.res.workers.clone(), id.clone());
            let before = first.heartbeat_at;
            async move { Ok(read(workers, id).await?.is_some_and(|i| i.heartbeat_at > before)) }
        })
        .await?;
        worker.shutdown().await?;
        assert!(read(c.res.workers.clone(), id).await?.is_none(), "unregistered");
        Ok(())
    }
}

// The coordinator's service: intake, queries, lane-ordered dispatch, restarts.
//
// No real worker: `SimWorker` registers in `mur_workers`, pulls from the `workers`
// consumer and writes the task records the way the worker contract says.

/// How long a test waits for something that should happen.
const WAIT: Duration = Duration::from_secs(20);
/// How long a test watches for something that should not happen.
const QUIET: Duration = Duration::from_millis(1500);

/// A coordinator running in this process on its own connection.
struct Coordinator {
    client: async_nats::Client,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    handle: tokio::task::JoinHandle<Result<(), service::Error>>,
}

impl Coordinator {
    async fn start(server: &NatsServer, name: &str) -> Coordinator {
        let client = server.connect().await;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        // A short lease, so a crashed coordinator's successor takes over soon.
        let config = service::Config::new(Settings { leader_lease_secs: 2, ..Settings::default() }, name);
        let handle = tokio::spawn(service::run(client.clone(), config, async move {
            let _ = stopped.await;
        }));
        // Ready once it answers.
        let probe = server.connect().await;
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            match api::call::<Vec<cluster::CapsuleEntry>>(&probe, cluster::api::CAPSULE_LIST, "").await {
                Ok(_) => break,
                Err(e) if tokio::time::Instant::now() < deadline && e.code == cluster::ErrorCode::Unavailable => {}
                Err(e) => panic!("coordinator {name} did not come up: {e}"),
            }
            assert!(!handle.is_finished(), "coordinator {name} stopped while starting");
        }
        Coordinator { client, stop: Some(stop), handle }
    }

    /// A clean stop: the shutdown future resolves, `run` returns.
    async fn stop(mut self) -> Result<(), service::Error> {
        let _ = self.stop.take().expect("running").send(());
        self.handle.await.expect("the coordinator task does not panic")
    }

    /// A crash: the task is dropped mid-way and its connection closed.
    async fn crash(self) {
        self.handle.abort();
        let _ = self.handle.await;
        self.client.drain().await.expect("drain");
    }
}

/// A worker simulated over NATS, following the worker contract by hand.
struct SimWorker {
    id: String,
    res: resources::Resources,
}

impl SimWorker {
    async fn new(server: &NatsServer, id: &str) -> Result<SimWorker> {
        let res = resources::ensure(&server.jetstream().await, &Settings::default()).await?;
        Ok(SimWorker { id: id.to_string(), res })
    }

    async fn register(&self, slots: u32) -> Result<()> {
        self.register_at(slots, SystemClock.now_ms()).await
    }

    async fn register_at(&self, slots: u32, now: u64) -> Result<()> {
        let info = cluster::WorkerInfo {
            worker_id: self.id.clone(),
            slots,
            busy: 0,
            started_at: now,
            heartbeat_at: now,
            version: "test".into(),
        };
        self.res.workers.put(&self.id, serde_json::to_vec(&info)?.into()).await?;
        Ok(())
    }

    /// The next dispatch within `within`, acked; `None` if none came.
    async fn next_dispatch(&self, within: Duration) -> Result<Option<cluster::Dispatch>> {
        let deadline = tokio::time::Instant::now() + within;
        while tokio::time::Instant::now() < deadline {
            let left = deadline - tokio::time::Instant::now();
            let expires = left.clamp(Duration::from_millis(100), Duration::from_millis(500));
            let mut batch = self.res.dispatch_consumer.batch().max_messages(1).expires(expires).messages().await?;
            if let Some(message) = batch.next().await {
                let message = message.map_err(|e| anyhow::anyhow!("{e}"))?;
                message.ack().await.map_err(|e| anyhow::anyhow!("{e}"))?;
                return Ok(Some(serde_json::from_slice(&message.payload)?));
            }
        }
        Ok(None)
    }

    async fn expect_dispatch(&self) -> Result<cluster::Dispatch> {
        self.next_dispatch(WAIT).await?.ok_or_else(|| anyhow::anyhow!("no dispatch within {WAIT:?}"))
    }

    /// Compare-and-sets the record with `change`.
    async fn write(&self, task_id: &str, change: impl Fn(&mut TaskRecord)) -> Result<TaskRecord> {
        let entry = self.res.tasks.entry(task_id).await?.expect("the record exists");
        let mut record: TaskRecord = serde_json::from_slice(&entry.value)?;
        change(&mut record);
        self.res.tasks.update(task_id, serde_json::to_vec(&record)?.into(), entry.revision).await?;
        Ok(record)
    }

    async fn start(&self, dispatch: &cluster::Dispatch) -> Result<TaskRecord> {
        let worker = self.id.clone();
        let record = self
            .write(&dispatch.task_id, |r| {
                r.state = TaskState::Working;
                r.worker = Some(worker.clone());
                r.session_id = Some(Id::generate(IdKind::Session));
                r.started_at = Some(SystemClock.now_ms());
            })
            .await?;
        assert_eq!(record.attempt, dispatch.attempt, "the record carries the dispatch's attempt");
        Ok(record)
    }

    async fn finish(&self, task_id: &str) -> Result<TaskRecord> {
        self.write(task_id, |r| {
            r.state = TaskState::Completed;
            r.exit_status = Some(ExitStatus::Ok);
            r.result = Some("done".into());
            r.ended_at = Some(SystemClock.now_ms());
        })
        .await
    }
}

const QUEUE_MANIFEST: &str = "name: serial\nversion: 1.0.0\ninference:\n  driver: scripted\n  script: replies.yaml\n\
                              lifecycle:\n  task_acceptance: queue\n";

/// A server with both capsules pushed, coordinator `c1` leading, a client, and worker
/// `w1` registered with one slot; the last item is greeter's digest.
async fn one_slot_cluster() -> Result<(NatsServer, Coordinator, async_nats::Client, SimWorker, String)> {
    cluster_with_slots(1).await
}

/// [`one_slot_cluster`] with `slots` slots for `w1`.
async fn cluster_with_slots(slots: u32) -> Result<(NatsServer, Coordinator, async_nats::Client, SimWorker, String)> {
    let server = NatsServer::start();
    let digest = push_capsules(&server).await?;
    let coordinator = Coordinator::start(&server, "c1").await;
    let client = server.connect().await;
    let worker = SimWorker::new(&server, "w1").await?;
    worker.register(slots).await?;
    Ok((server, coordinator, client, worker, digest))
}

/// Pushes the `greeter` capsule (single) and the `serial` one (queue); returns greeter's digest.
async fn push_capsules(server: &NatsServer) -> Result<String> {
    let res = resources::ensure(&server.jetstream().await, &Settings::default()).await?;
    let greeter = bundle::pack(greeter("hi").dir())?;
    assert!(!greeter.queue);
    bundle::push(&res.capsules, &res.capsule_index, &greeter).await?;
    let serial = bundle::pack(TestCapsule::new(QUEUE_MANIFEST, &[("replies.yaml", "replies:\n  - text: hi\n")]).dir())?;
    assert!(serial.queue, "task_acceptance: queue is recorded at pack");
    bundle::push(&res.capsules, &res.capsule_index, &serial).await?;
    Ok(greeter.digest)
}

async fn submit(client: &async_nats::Client, capsule: &str, text: &str, origin: &str) -> Result<String> {
    let body = serde_json::json!({"capsule": capsule, "text": text, "origin": origin}).to_string();
    let reply: cluster::SubmitReply = api::call(client, cluster::api::TASK_SUBMIT, body).await?;
    assert_eq!(reply.state, TaskState::Submitted);
    Ok(reply.task_id.into_string())
}

async fn get(client: &async_nats::Client, task_id: &str) -> Result<TaskRecord, cluster::ApiError> {
    api::call(client, cluster::api::TASK_GET, serde_json::json!({ "task_id": task_id }).to_string()).await
}

async fn task_keys(server: &NatsServer) -> Result<Vec<String>> {
    let res = resources::ensure(&server.jetstream().await, &Settings::default()).await?;
    Ok(res.tasks.keys().await?.try_collect().await?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn submit_refuses_bad_requests_with_their_error_and_stores_nothing() -> Result<()> {
    let server = NatsServer::start();
    push_capsules(&server).await?;
    let coordinator = Coordinator::start(&server, "c1").await;
    let client = server.connect().await;
    let refuse = |body: Vec<u8>| {
        let client = client.clone();
        async move {
            api::call::<cluster::SubmitReply>(&client, cluster::api::TASK_SUBMIT, body).await.expect_err("refused")
        }
    };

    let err = refuse(br#"{"capsule":"nope","text":"hi"}"#.to_vec()).await;
    assert_eq!(err.code, cluster::ErrorCode::NotFound);
    assert_eq!(err.message, r#"capsule: no capsule named "nope" (push it with `mur capsule push`)"#);

    let err = refuse(br#"{"capsule":"greeter","text":"hi","origin":"admin"}"#.to_vec()).await;
    assert_eq!(err.code, cluster::ErrorCode::InvalidRequest);
    assert_eq!(err.message, r#"origin: must be one of user, peer, schedule, event, completion, system, got "admin""#);

    let err = refuse(b"{\"capsule\":\"greeter\",\"text\":\"\xff\"}".to_vec()).await;
    assert_eq!(err.code, cluster::ErrorCode::InvalidRequest);
    assert_eq!(err.message, "request: invalid UTF-8 at byte 29");

    let err = refuse(br#"{"capsule":"greeter","text":""}"#.to_vec()).await;
    assert_eq!((err.code, err.message.as_str()), (cluster::ErrorCode::InvalidRequest, "text: must not be empty"));
    // Issue #29: a NUL was accepted, and the task ended completed/ok with "cannot start sh".
    let err = refuse(br#"{"capsule":"greeter","text":"echo a\u0000b"}"#.to_vec()).await;
    assert_eq!(
        (err.code, err.message.as_str()),
        (
            cluster::ErrorCode::InvalidRequest,
            "text: must not contain a NUL character (U+0000: no command's argument can carry one), found at byte 6"
        )
    );

    // One byte over the limit: the request itself is over the server's 1 MiB max_payload,
    // so the client refuses to send it (the service-side rule is proto's unit test).
    let over = serde_json::json!({"capsule": "greeter", "text": "a".repeat(cluster::MAX_TASK_BYTES + 1)});
    let over = serde_json::to_vec(&over)?;
    let size = over.len();
    let err = refuse(over).await;
    assert_eq!(err.code, cluster::ErrorCode::InvalidRequest, "{err}");
    assert_eq!(
        err.message,
        format!(
            "mur.api.task.submit: request not sent: it is {size} bytes, over this cluster's max_payload of 1048576 bytes \
             (in JSON a text's quotes, backslashes and control characters take two bytes or more each)"
        )
    );

    // A text the request carries but whose record would leave no room for the result
    // (under the server's 1 MiB max_payload): refused with the most this cluster takes.
    let near = serde_json::json!({"capsule": "greeter", "text": "a".repeat(1_040_000)});
    let err = refuse(serde_json::to_vec(&near)?).await;
    assert_eq!(err.code, cluster::ErrorCode::InvalidRequest, "{err}");
    let most: usize = err
        .message
        .strip_prefix("text: at most about ")
        .and_then(|m| m.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{}", err.message));
    assert!(
        err.message.ends_with(
            " bytes on this cluster (its nats-server's max_payload is 1048576 bytes, and a task's record keeps \
             16384 of them for the result), got 1040000"
        ),
        "{}",
        err.message
    );
    assert!((1_000_000..1_040_000).contains(&most), "{most}");
    let fits = serde_json::json!({"capsule": "greeter", "text": "a".repeat(most)});
    api::call::<cluster::SubmitReply>(&client, cluster::api::TASK_SUBMIT, serde_json::to_vec(&fits)?).await?;
    let stored = task_keys(&server).await?;
    assert_eq!(stored.len(), 1, "only the text that fits was stored");
    for key in stored {
        let js = async_nats::jetstream::new(client.clone());
        js.get_key_value(cluster::TASKS_BUCKET).await?.purge(key).await?;
    }

    // The error travels as micro service error headers too.
    let raw = client.request(cluster::api::TASK_SUBMIT, r#"{"capsule":"nope","text":"hi"}"#.into()).await?;
    let headers = raw.headers.expect("error headers");
    assert_eq!(headers.get("Nats-Service-Error-Code").map(|v| v.as_str()), Some("404"));
    assert!(headers.get("Nats-Service-Error").unwrap().as_str().starts_with("not_found: capsule: no capsule"));

    assert!(task_keys(&server).await?.is_empty(), "nothing was stored");
    // The service is discoverable.
    let info = client.request("$SRV.INFO.mur", "".into()).await?;
    let info: serde_json::Value = serde_json::from_slice(&info.payload)?;
    assert_eq!(info["name"], "mur");
    let subjects: Vec<&str> =
        info["endpoints"].as_array().unwrap().iter().map(|e| e["subject"].as_str().unwrap()).collect();
    assert!(subjects.contains(&cluster::api::TASK_SUBMIT), "{subjects:?}");
    coordinator.stop().await?;
    Ok(())
}

/// Issue #29 item 10: a refusal was sent as an OK reply with error headers, so `nats micro
/// stats` showed `errors=0` after refusals.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_request_counts_as_an_error_in_the_service_stats_and_keeps_its_api_error() -> Result<()> {
    let server = NatsServer::start();
    push_capsules(&server).await?;
    let coordinator = Coordinator::start(&server, "c1").await;
    let client = server.connect().await;

    let err =
        api::call::<cluster::SubmitReply>(&client, cluster::api::TASK_SUBMIT, r#"{"capsule":"nope","text":"hi"}"#)
            .await
            .expect_err("refused");
    assert_eq!(err.code, cluster::ErrorCode::NotFound);
    assert_eq!(err.message, r#"capsule: no capsule named "nope" (push it with `mur capsule push`)"#);
    submit(&client, "greeter", "hi", "user").await?;

    let stats = client.request("$SRV.STATS.mur", "".into()).await?;
    let stats: serde_json::Value = serde_json::from_slice(&stats.payload)?;
    let endpoint = stats["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["subject"] == cluster::api::TASK_SUBMIT)
        .unwrap_or_else(|| panic!("{stats}"))
        .clone();
    assert_eq!((endpoint["num_requests"].as_u64(), endpoint["num_errors"].as_u64()), (Some(2), Some(1)), "{endpoint}");
    let last = endpoint["last_error"].as_str().unwrap_or_default();
    assert!(last.contains(r#"not_found: capsule: no capsule named "nope""#), "{endpoint}");
    coordinator.stop().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_is_dispatched_only_once_a_worker_with_a_free_slot_registers() -> Result<()> {
    let server = NatsServer::start();
    let digest = push_capsules(&server).await?;
    let coordinator = Coordinator::start(&server, "c1").await;
    let client = server.connect().await;
    let worker = SimWorker::new(&server, "w1").await?;

    let task = submit(&client, "greeter", "hello", "user").await?;
    let record = get(&client, &task).await?;
    assert_eq!(
        (record.state, record.attempt, record.capsule_digest.as_str()),
        (TaskState::Submitted, 0, digest.as_str())
    );
    assert!(worker.next_dispatch(QUIET).await?.is_none(), "no worker, no dispatch");
    assert_eq!(get(&client, &task).await?.attempt, 0);

    // A worker with no free slot does not count either.
    worker.register(0).await?;
    assert!(worker.next_dispatch(QUIET).await?.is_none(), "a 0-slot worker gets nothing");

    worker.register(1).await?;
    let dispatch = worker.expect_dispatch().await?;
    assert_eq!((dispatch.task_id.as_str(), dispatch.attempt), (task.as_str(), 1));
    // It carries the record as released, at the revision the record has now.
    let released = dispatch.released.clone().expect("the release's record");
    assert_eq!(released.record, get(&client, &task).await?);
    let record = get(&client, &task).await?;
    assert_eq!((record.state, record.attempt), (TaskState::Submitted, 1));
    worker.start(&dispatch).await?;
    worker.finish(&task).await?;
    assert_eq!(get(&client, &task).await?.state, TaskState::Completed);
    coordinator.stop().await?;
    Ok(())
}

/// Admission at submit (issue #9): with a slot free the record is stored released
/// (attempt 1) and dispatched at once; with none free the next task waits at attempt 0
/// and is released when the slot frees.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_submitted_while_a_slot_is_free_is_stored_released_and_the_next_one_waits() -> Result<()> {
    let (_server, coordinator, client, worker, _digest) = one_slot_cluster().await?;
    let (first, record) = admitted(&client, &worker, "one").await;
    assert_eq!((record.state, record.attempt), (TaskState::Submitted, 1), "stored released at submit");
    let dispatch = worker.expect_dispatch().await?;
    assert_eq!((dispatch.task_id.as_str(), dispatch.attempt), (first.as_str(), 1));
    assert_eq!(dispatch.released.as_ref().expect("the record").record, record);

    let second = submit(&client, "greeter", "two", "user").await?;
    assert_eq!(get(&client, &second).await?.attempt, 0, "no free slot: it waits");
    assert!(worker.next_dispatch(QUIET).await?.is_none());
    worker.start(&dispatch).await?;
    worker.finish(&first).await?;
    let next = worker.expect_dispatch().await?;
    assert_eq!((next.task_id.as_str(), next.attempt), (second.as_str(), 1));
    coordinator.stop().await?;
    Ok(())
}

/// A release whose record is written but whose dispatch cannot be published (here the
/// dispatch stream is gone) keeps publishing until it goes out: the record, already
/// released, is not left for a coordinator restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dispatch_that_fails_to_publish_after_its_record_is_released_goes_out_once_it_can() -> Result<()> {
    let server = NatsServer::start();
    push_capsules(&server).await?;
    let coordinator = Coordinator::start(&server, "c1").await;
    let client = server.connect().await;
    let js = server.jetstream().await;
    // No worker yet: the task waits at attempt 0.
    let task = submit(&client, "greeter", "later", "user").await?;
    assert_eq!(get(&client, &task).await?.attempt, 0);
    let worker = SimWorker::new(&server, "w1").await?;
    js.delete_stream(cluster::DISPATCH_STREAM).await?;
    worker.register(1).await?;
    // The release writes the record, then fails to publish, and tries again.
    mur_tests::procs::until("the record released", WAIT, || async {
        (get(&client, &task).await.ok()?.attempt == 1).then_some(())
    })
    .await;
    resources::ensure(&js, &Settings::default()).await?;
    let dispatch = worker.expect_dispatch().await?;
    assert_eq!((dispatch.task_id.as_str(), dispatch.attempt), (task.as_str(), 1));
    coordinator.stop().await?;
    Ok(())
}

/// Submits tasks until one is admitted at submit (the coordinator has counted the worker's
/// free slot). A task that waited instead is released as soon as the slot is counted: its
/// dispatch is taken and the task finished, so nothing is left behind. Returns the
/// admitted task and its record.
async fn admitted(client: &async_nats::Client, worker: &SimWorker, text: &str) -> (String, TaskRecord) {
    mur_tests::procs::until("a task admitted at submit", WAIT, || async {
        let id = submit(client, "greeter", text, "user").await.ok()?;
        let record = get(client, &id).await.ok()?;
        if record.attempt == 1 {
            return Some((id, record));
        }
        let dispatch = worker.expect_dispatch().await.ok()?;
        worker.start(&dispatch).await.ok()?;
        worker.finish(&dispatch.task_id).await.ok()?;
        None
    })
    .await
}

/// A record another coordinator stored released and never dispatched (it lost its lease
/// or died between the two) after this one took the lead: this one learns of the task, holds
/// its slot, and dispatches it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_stored_released_by_another_coordinator_is_dispatched_and_holds_its_slot() -> Result<()> {
    let (_server, coordinator, client, worker, digest) = one_slot_cluster().await?;
    // A task of this coordinator's holds the one slot.
    let (probe, _) = admitted(&client, &worker, "probe").await;
    let running = worker.expect_dispatch().await?;
    assert_eq!(running.task_id, probe);
    worker.start(&running).await?;

    let foreign = Id::generate(IdKind::Task);
    let mut record = cluster::TaskRecord::submitted(
        TaskId::unchecked(foreign.clone()),
        cluster::SubmitRequest::new("greeter", "from the old leader", mur_proto::task::Origin::User),
        digest,
        SystemClock.now_ms(),
    );
    record.attempt = 1;
    worker.res.tasks.create(foreign.as_str(), serde_json::to_vec(&record)?.into()).await?;
    let dispatch = worker.expect_dispatch().await?;
    assert_eq!((dispatch.task_id.as_str(), dispatch.attempt), (foreign.as_str(), 1));

    // Its slot is held: once the probe ends, a new task still waits until it ends too.
    let waiting = submit(&client, "greeter", "next", "user").await?;
    assert_eq!(get(&client, &waiting).await?.attempt, 0);
    worker.finish(&probe).await?;
    assert!(worker.next_dispatch(QUIET).await?.is_none(), "the foreign task holds the one slot");
    worker.start(&dispatch).await?;
    worker.finish(foreign.as_str()).await?;
    let next = worker.expect_dispatch().await?;
    assert_eq!(next.task_id.as_str(), waiting.as_str());
    coordinator.stop().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_with_a_stale_heartbeat_gets_no_dispatch_until_it_beats_again() -> Result<()> {
    let server = NatsServer::start();
    push_capsules(&server).await?;
    let coordinator = Coordinator::start(&server, "c1").await;
    let client = server.connect().await;
    let worker = SimWorker::new(&server, "w1").await?;

    // A heartbeat older than the worker timeout (10 s) does not count.
    worker.register_at(1, SystemClock.now_ms() - 60_000).await?;
    let first = submit(&client, "greeter", "first", "user").await?;
    assert!(worker.next_dispatch(QUIET).await?.is_none(), "a stale worker gets nothing");

    worker.register(1).await?;
    let dispatch = worker.expect_dispatch().await?;
    assert_eq!(dispatch.task_id, first);
    // (A deleted key's WorkerGone reaches the scheduler through another watcher than the
    // task records, so its order against a later submit is not observable from here.)
    coordinator.stop().await?;
    Ok(())
}

/// Runs the queue to its end on a 1-slot worker: finishes the running task, takes the next
/// dispatch, starts it; returns the texts in dispatch order.
async fn drain_in_order(
    client: &async_nats::Client,
    worker: &SimWorker,
    mut running: String,
    count: usize,
) -> Result<Vec<String>> {
    let mut seen = std::collections::HashSet::new();
    let mut order = Vec::new();
    for _ in 0..count {
        worker.finish(&running).await?;
        let dispatch = worker.expect_dispatch().await?;
        assert!(seen.insert(dispatch.msg_id()), "dispatched twice: {dispatch:?}");
        let record = worker.start(&dispatch).await?;
        order.push(record.text.clone());
        running = dispatch.task_id.into_string();
    }
    worker.finish(&running).await?;
    assert!(worker.next_dispatch(QUIET).await?.is_none(), "nothing else is dispatched");
    let _ = client;
    Ok(order)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tasks_waiting_for_a_busy_worker_are_dispatched_user_then_peer_then_bg() -> Result<()> {
    let (_server, coordinator, client, worker, _digest) = one_slot_cluster().await?;

    let blocker = submit(&client, "greeter", "blocker", "user").await?;
    let dispatch = worker.expect_dispatch().await?;
    assert_eq!(dispatch.task_id, blocker);
    worker.start(&dispatch).await?;

    for (text, origin) in
        [("bg-1", "schedule"), ("peer-1", "peer"), ("user-1", "user"), ("bg-2", "event"), ("user-2", "user")]
    {
        submit(&client, "greeter", text, origin).await?;
    }
    let order = drain_in_order(&client, &worker, blocker, 5).await?;
    assert_eq!(order, ["user-1", "user-2", "peer-1", "bg-1", "bg-2"]);
    coordinator.stop().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_capsule_never_has_two_tasks_dispatched_and_not_ended() -> Result<()> {
    let (_server, coordinator, client, worker, _digest) = cluster_with_slots(3).await?;

    let first = submit(&client, "serial", "s-1", "user").await?;
    let second = submit(&client, "serial", "s-2", "user").await?;
    let dispatch = worker.expect_dispatch().await?;
    assert_eq!(dispatch.task_id, first);
    // A single capsule's task behind it is not held up.
    let other = submit(&client, "greeter", "g-1", "schedule").await?;
    assert_eq!(worker.expect_dispatch().await?.task_id, other);
    assert!(worker.next_dispatch(QUIET).await?.is_none(), "serial's second task waits while its first runs");
    assert_eq!(get(&client, &second).await?.attempt, 0);

    worker.start(&dispatch).await?;
    assert!(worker.next_dispatch(QUIET).await?.is_none(), "still running");
    worker.finish(&first).await?;
    assert_eq!(worker.expect_dispatch().await?.task_id, second);
    coordinator.stop().await?;
    Ok(())
}

/// A waiting task keeps the `queue` flag of the bundle it runs, though its capsule was
/// pushed again as `single` before a restarted coordinator (which remembers no bundles)
/// looked at it: the flag comes from the index's history, not from the latest push (it did,
/// and the old bundle's waiting tasks all started at once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_task_keeps_its_own_bundles_queue_flag_across_a_push_and_a_restart() -> Result<()> {
    let (server, first, client, worker, _digest) = cluster_with_slots(3).await?;

    let running = submit(&client, "serial", "s-1", "user").await?;
    let waiting = submit(&client, "serial", "s-2", "user").await?;
    let dispatch = worker.expect_dispatch().await?;
    assert_eq!(dispatch.task_id, running);
    worker.start(&dispatch).await?;

    // `serial` again, now `single`: a new bundle under the same name.
    let res = resources::ensure(&server.jetstream().await, &Settings::default()).await?;
    let single = QUEUE_MANIFEST
        .replace("task_acceptance: queue", "task_acceptance: single")
        .replace("version: 1.0.0", "version: 1.1.0");
    let single = bundle::pack(TestCapsule::new(&single, &[("replies.yaml", "replies:\n  - text: hi\n")]).dir())?;
    assert!(!single.queue);
    bundle::push(&res.capsules, &res.capsule_index, &single).await?;
    first.crash().await;

    let second = Coordinator::start(&server, "c2").await;
    // A task of the new bundle is not held up by the old one's.
    let newer = submit(&client, "serial", "s-3", "user").await?;
    let dispatch = worker.expect_dispatch().await?;
    assert_eq!(dispatch.task_id, newer);
    worker.start(&dispatch).await?;
    assert!(worker.next_dispatch(QUIET).await?.is_none(), "s-2 waits while s-1 of its queue bundle runs");
    assert_eq!(get(&client, &waiting).await?.attempt, 0);
    // The queue rule counts the capsule's tasks in flight by name (scheduler rule 2): s-2
    // goes once both have ended.
    worker.finish(&running).await?;
    worker.finish(&newer).await?;
    assert_eq!(worker.expect_dispatch().await?.task_id, waiting);
    second.stop().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_coordinator_keeps_lane_order_and_dispatches_nothing_twice() -> Result<()> {
    let server = NatsServer::start();
    push_capsules(&server).await?;
    let first = Coordinator::start(&server, "c1").await;
    let client = server.connect().await;
    let worker = SimWorker::new(&server, "w1").await?;
    worker.register(1).await?;

    // The blocker is released (its dispatch waits in the stream) when the coordinator dies.
    let blocker = submit(&client, "greeter", "blocker", "user").await?;
    let deadline = tokio::time::Instant::now() + WAIT;
    while get(&client, &blocker).await?.attempt == 0 {
        assert!(tokio::time::Instant::now() < deadline, "the blocker was never released");
        tokio::task::yield_now().await;
    }
    for (text, origin) in [("bg-1", "schedule"), ("peer-1", "peer"), ("user-1", "user")] {
        submit(&client, "greeter", text, origin).await?;
    }
    // An ended task in the store: the restart's replay passes over it.
    let canceled = submit(&client, "greeter", "canceled", "user").await?;
    let _: TaskRecord = api::call(&client, cluster::api::TASK_CANCEL, canceled).await?;
    first.crash().await;

    let second = Coordinator::start(&server, "c2").await;
    for (text, origin) in [("bg-2", "event"), ("user-2", "user")] {
        submit(&client, "greeter", text, origin).await?;
    }
    // The blocker's dispatch is delivered once, though the new coordinator published it again.
    let dispatch = worker.expect_dispatch().await?;
    assert_eq!((dispatch.task_id.as_str(), dispatch.attempt), (blocker.as_str(), 1));
    worker.start(&dispatch).await?;
    assert!(worker.next_dispatch(QUIET).await?.is_none(), "the blocker's dispatch is not repeated");

    let order = drain_in_order(&client, &worker, blocker, 5).await?;
    assert_eq!(order, ["user-1", "user-2", "peer-1", "bg-1", "bg-2"]);
    second.stop().await?;
    Ok(())
}

/// A list reply is one NATS message (1 MiB at most here) while one task's text may be
/// nearly that: `task.list` clips long texts to `page::FIELD_BYTES` and says which, so three
/// tasks of 900 KB each still list (they did not: the reply was refused by the server and
/// `mur task ls` timed out), and `task.get` still gives each one whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tasks_with_texts_near_the_payload_limit_are_listed_clipped_and_got_whole() -> Result<()> {
    let server = NatsServer::start();
    push_capsules(&server).await?;
    let _coordinator = Coordinator::start(&server, "c1").await;
    let client = server.connect().await;
    let big = "é".repeat(450_000);
    let mut ids = Vec::new();
    for _ in 0..3 {
        ids.push(submit(&client, "greeter", &big, "user").await?);
    }
    let small = submit(&client, "greeter", "small", "user").await?;
    let page: mur_proto::page::Page<TaskRecord> = api::call(&client, cluster::api::TASK_LIST, "").await?;
    assert!(!page.more);
    let listed: Vec<&str> = page.items.iter().map(|r| r.task_id.as_str()).collect();
    assert_eq!(listed, [small.as_str(), ids[2].as_str(), ids[1].as_str(), ids[0].as_str()]);
    let clipped: Vec<&str> = ids.iter().rev().map(String::as_str).collect();
    assert_eq!(page.clipped, clipped);
    for r in &page.items[1..] {
        assert_eq!(r.text, format!("{}…", "é".repeat(mur_proto::page::FIELD_BYTES / 2)));
    }
    assert_eq!(page.items[0].text, "small");
    assert_eq!(get(&client, &ids[0]).await?.text, big, "a task is got whole");
    Ok(())
}

/// `task.list` reads the records in one pass and keeps only the newest `limit` that match
/// as it goes (clipped as they are read): over 40 stored records, 7 of them `failed`, the
/// newest 3 failed ones come back newest first, with the clipped ones named; `cluster.status`
/// over the same store counts the waiting ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn task_list_keeps_the_newest_matching_records_over_a_store_of_many() -> Result<()> {
    let server = NatsServer::start();
    push_capsules(&server).await?;
    let _coordinator = Coordinator::start(&server, "c1").await;
    let client = server.connect().await;
    let js = server.jetstream().await;
    let kv = js.get_key_value(cluster::TASKS_BUCKET).await?;
    let mut failed = Vec::new();
    // Stored out of submit order: the list orders by `submitted_at`, not by key or revision.
    for i in (0..40u64).rev() {
        let id = Id::generate(IdKind::Task);
        let request = cluster::SubmitRequest::new("greeter", "hi", mur_proto::task::Origin::User);
        let mut record =
            TaskRecord::submitted(TaskId::unchecked(id.clone()), request, "0f".repeat(32), 1_700_000_000_000 + i);
        if i % 6 == 0 {
            record.state = TaskState::Failed;
            record.result = Some("x".repeat(if i == 36 { 10_000 } else { 10 }));
            failed.push((i, id.clone()));
        } else if i % 2 == 0 {
            record.state = TaskState::Completed;
        }
        kv.put(id.as_str(), serde_json::to_vec(&record)?.into()).await?;
    }
    assert_eq!(failed.len(), 7);
    failed.sort();
    let newest: Vec<&str> = failed.iter().rev().take(3).map(|(_, id)| id.as_str()).collect();
    let page: mur_proto::page::Page<TaskRecord> =
        api::call(&client, cluster::api::TASK_LIST, r#"{"state":"failed","limit":3}"#).await?;
    assert_eq!(page.items.iter().map(|r| r.task_id.as_str()).collect::<Vec<_>>(), newest);
    assert_eq!(page.clipped, [newest[0]], "the 10 KB result of the newest failed one is clipped");
    assert_eq!(page.items[0].result.as_deref().map(str::len), Some(mur_proto::page::FIELD_BYTES + "…".len()));
    assert!(!page.more);
    let all: mur_proto::page::Page<TaskRecord> = api::call(&client, cluster::api::TASK_LIST, "").await?;
    assert_eq!(all.items.len(), 40);
    let status: cluster::ClusterStatus = api::call(&client, cluster::api::CLUSTER_STATUS, "").await?;
    let waiting: u64 = status.lanes.iter().map(|l| l.pending).sum();
    assert_eq!(waiting, 20, "the 20 odd ones wait");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn task_get_list_and_cancel_answer_from_the_records() -> Result<()> {
    let server = NatsServer::start();
    push_capsules(&server).await?;
    let coordinator = Coordinator::start(&server, "c1").await;
    let client = server.connect().await;

    let a = submit(&client, "greeter", "a", "user").await?;
    let b = submit(&client, "greeter", "b", "peer").await?;
    let c = submit(&client, "serial", "c", "user").await?;
    let record = get(&client, &b).await?;
    assert_eq!((record.text.as_str(), record.lane, record.state), ("b", mur_proto::Lane::Peer, TaskState::Submitted));
    // The bare id works too.
    let bare: TaskRecord = api::call(&client, cluster::api::TASK_GET, a.clone()).await?;
    assert_eq!(bare.task_id, a);
    let unknown = Id::generate(IdKind::Task);
    let err = get(&client, &unknown).await.unwrap_err();
    assert_eq!((err.code, err.message), (cluster::ErrorCode::NotFound, format!("task: no task {unknown}")));
    let err = get(&client, "../etc").await.unwrap_err();
    assert_eq!(err.code, cluster::ErrorCode::InvalidRequest);

    // Cancel a waiting task; a second cancel is a conflict.
    let canceled: TaskRecord =
        api::call(&client, cluster::api::TASK_CANCEL, serde_json::json!({ "task_id": a }).to_string()).await?;
    assert_eq!((canceled.state, canceled.exit_status), (TaskState::Canceled, Some(ExitStatus::Canceled)));
    assert_eq!(canceled.result.as_deref(), Some("canceled"));
    assert!(canceled.ended_at.is_some());
    let err = api::call::<TaskRecord>(&client, cluster::api::TASK_CANCEL, a.clone()).await.unwrap_err();
    assert_eq!(err.code, cluster::ErrorCode::Conflict);

    let list = api::call::<mur_proto::page::Page<TaskRecord>>(&client, cluster::api::TASK_LIST, "").await?.items;
    let ids: Vec<&str> = list.iter().map(|r| r.task_id.as_str()).collect();
    assert_eq!(ids, [c.as_str(), b.as_str(), a.as_str()], "newest first");
    let waiting =
        api::call::<mur_proto::page::Page<TaskRecord>>(&client, cluster::api::TASK_LIST, r#"{"state":"submitted"}"#)
            .await?
            .items;
    assert_eq!(waiting.iter().map(|r| r.task_id.as_str()).collect::<Vec<_>>(), [c.as_str(), b.as_str()]);
    let err = api::call::<mur_proto::page::Page<TaskRecord>>(&client, cluster::api::TASK_LIST, r#"{"state":"bogus"}"#)
        .await
        .unwrap_err();
    assert_eq!(err.code, cluster::ErrorCode::InvalidRequest);
    // `limit`: the newest N; 0 or over 1000 is refused naming the field.
    let newest =
        api::call::<mur_proto::page::Page<TaskRecord>>(&client, cluster::api::TASK_LIST, r#"{"limit":2}"#).await?.items;
    assert_eq!(newest.iter().map(|r| r.task_id.as_str()).collect::<Vec<_>>(), [c.as_str(), b.as_str()]);
    for bad in [0, 1001] {
        let body = format!(r#"{{"limit":{bad}}}"#);
        let err =
            api::call::<mur_proto::page::Page<TaskRecord>>(&client, cluster::api::TASK_LIST, body).await.unwrap_err();
        assert_eq!(
            (err.code, err.message),
            (cluster::ErrorCode::InvalidRequest, format!("limit: must be 1 to 1000, got {bad}"))
        );
    }

    // The canceled task is never dispatched; a released one gets a cancel request and a
    // note on mur.cancel.<task_id>, and stays where it is until its worker ends it.
    let worker = SimWorker::new(&server, "w1").await?;
    worker.register(1).await?;
    let dispatch = worker.expect_dispatch().await?;
    assert_eq!(dispatch.task_id, c, "user lane first; the canceled user task is skipped");
    let mut notes = client.subscribe(cluster::cancel_subject(&TaskId::unchecked(&c))).await?;
    client.flush().await?;
    let requested: TaskRecord = api::call(&client, cluster::api::TASK_CANCEL, c.clone()).await?;
    assert_eq!((requested.state, requested.attempt), (TaskState::Submitted, 1));
    assert!(requested.cancel_requested_at.is_some());
    assert_eq!(get(&client, &c).await?.cancel_requested_at, requested.cancel_requested_at);
    let note = tokio::time::timeout(Duration::from_secs(10), notes.next()).await?.expect("a cancel note");
    assert_eq!(note.subject.as_str(), format!("mur.cancel.{c}"));
    worker.start(&dispatch).await?;
    worker.finish(&c).await?;
    assert_eq!(worker.expect_dispatch().await?.task_id, b);

    let capsules: Vec<cluster::CapsuleEntry> = api::call(&client, cluster::api::CAPSULE_LIST, "").await?;
    assert_eq!(capsules.iter().map(|e| e.name.as_str()).collect::<Vec<_>>(), ["greeter", "serial"]);
    coordinator.stop().await?;
    Ok(())
}

/// A free TCP port on 127.0.0.1 (bound, then let go).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// `mur dev` holds its data folder: a second one on the same folder is refused (two
/// nats-servers on one JetStream store hung the cluster and lost task records), so is one
/// whose port is taken (it reported ready and joined the other cluster); once the first
/// has exited, the folder can be used again.
#[test]
fn mur_dev_refuses_a_data_folder_or_port_another_mur_dev_holds() {
    use mur_tests::mur::{Background, Run, mur};
    let data = tempfile::tempdir().unwrap();
    let other = tempfile::tempdir().unwrap();
    let capsules = tempfile::tempdir().unwrap();
    let dev = |port: u16, dir: &std::path::Path| {
        let mut c = mur();
        c.args(["dev", "--port", &port.to_string(), "--json", "--capsules"]).arg(capsules.path()).arg("--data-dir");
        c.arg(dir);
        c
    };
    let port = free_port();
    // In a process group of its own, as a terminal runs it: Ctrl-C goes to the group.
    let mut first =
        Background::spawn(std::os::unix::process::CommandExt::process_group(&mut dev(port, data.path()), 0));
    let ready = first.next_json(Duration::from_secs(60));
    assert_eq!(ready["url"], format!("nats://127.0.0.1:{port}"));

    let same_folder = Run::of(&mut dev(free_port(), data.path()));
    assert_eq!(same_folder.code, 2, "{same_folder:?}");
    let expected = format!("--data-dir {}: in use by another mur dev (process {})", data.path().display(), first.pid());
    assert!(same_folder.stderr.contains(&expected), "{same_folder:?}");

    let same_port = Run::of(&mut dev(port, other.path()));
    assert_eq!(same_port.code, 2, "{same_port:?}");
    assert!(same_port.stderr.contains(&format!("--port {port}: 127.0.0.1:{port} is taken")), "{same_port:?}");

    // Ctrl-C: the whole group gets SIGINT; nats-server, in a group of its own, is stopped
    // by `mur dev` after its coordinator and workers (they used to time out on a server
    // that was already gone, for ~20 s).
    let group = libc::pid_t::try_from(first.pid()).unwrap();
    assert!(group > 1);
    // SAFETY: kill(2) with plain integers; the group is `mur dev`'s own (process_group(0)).
    assert_eq!(unsafe { libc::kill(-group, libc::SIGINT) }, 0);
    let (code, stderr) = first.wait(Duration::from_secs(30));
    assert_eq!(code, Some(0), "{stderr}");
    assert!(!stderr.contains("failed"), "{stderr}");
    let mut again = Background::spawn(&mut dev(free_port(), data.path()));
    assert!(again.next_json(Duration::from_secs(60))["url"].is_string());
    again.signal(15);
    assert_eq!(again.wait(Duration::from_secs(30)).0, Some(0));
}

/// A nats-server of the test's own with the coordinator's resources, the lease's time to
/// live `ttl_secs`, and a handle on the lease for `instance` (the server lives as long as
/// the first value).
async fn lease_of(
    ttl_secs: u64,
    instance: &str,
) -> (mur_tests::nats::NatsServer, async_nats::jetstream::kv::Store, mur_coordinator::lease::Lease) {
    let nats = mur_tests::nats::NatsServer::start();
    let js = nats.jetstream().await;
    let settings = mur_coordinator::Settings { leader_lease_secs: ttl_secs, ..mur_coordinator::Settings::default() };
    let res = mur_coordinator::ensure(&js, &settings).await.unwrap();
    let lease = mur_coordinator::lease::Lease::new(res.leader.clone(), instance, Duration::from_secs(ttl_secs));
    (nats, res.leader, lease)
}

/// A holder whose lease key expired unrenewed (it stalled past the lease) is told so when
/// it next renews — `expired`, not `taken` — and one whose expired lease another
/// coordinator took since is told it was taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_renewed_after_it_expired_is_lost_as_expired_or_as_taken_once_another_holds_it() {
    use mur_coordinator::lease::{Lease, Lost};
    let (_nats, leader, first) = lease_of(2, "coordinator-1").await;
    let held = first.try_acquire().await.unwrap().expect("a free lease is taken");
    let expired = || async { Lease::holder(&leader).await.unwrap().is_none().then_some(()) };
    mur_tests::procs::until("the lease expires", Duration::from_secs(30), expired).await;
    match first.renew(&held).await {
        Err(Lost::Expired(why)) => assert_eq!(why, "the lease expired before it was renewed"),
        other => panic!("expected the lease lost as expired, got {other:?}"),
    }
    let second = Lease::new(leader.clone(), "coordinator-2", Duration::from_secs(2));
    let _taken = second.try_acquire().await.unwrap().expect("an expired lease is taken");
    assert!(matches!(first.renew(&held).await, Err(Lost::Taken)), "another holds it now");
}

/// A process that finds its own lease value under the key after its term ended (it stepped
/// down, as after a broker outage longer than the lease, when the value outlives the outage)
/// takes the lease back at once, a new term; another process, even under the same instance
/// name (a restart), waits until the value expires.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_takes_back_its_own_lease_of_an_ended_term_and_a_namesake_waits() {
    use mur_coordinator::lease::Lease;
    let (_nats, leader, first) = lease_of(60, "coordinator-1").await;
    let ended = first.try_acquire().await.unwrap().expect("a free lease is taken");
    let namesake = Lease::new(leader.clone(), "coordinator-1", Duration::from_secs(60));
    assert!(namesake.try_acquire().await.unwrap().is_none(), "another process's value is waited out");
    let old_term = ended.term; // that term is over from here: never renewed again
    let again = first.try_acquire().await.unwrap().expect("its own value is taken back");
    assert!(again.term > old_term, "a new term: {} after {old_term}", again.term);
    assert!(again.is_valid());
    let stored = Lease::holder(&leader).await.unwrap().expect("a holder");
    assert_eq!((stored.instance.as_str(), stored.term), ("coordinator-1", again.term));
    first.renew(&again).await.expect("the new term renews");
    assert!(namesake.try_acquire().await.unwrap().is_none(), "the other process still stands by");
}

/// With no coordinator on the server, `mur cluster status --json` says so as a JSON error
/// with the API's code `unavailable` (it had `null`: the refusal was flattened to text), and
/// what to start (issue #29: it named no remedy).
#[test]
fn cluster_status_without_a_coordinator_is_a_json_error_coded_unavailable() {
    use mur_tests::mur::{Run, mur};
    let server = NatsServer::start();
    let out = Run::of(mur().args(["cluster", "status", "--json"]).env("NATS_URL", server.url()));
    assert_eq!((out.code, out.stdout.as_str()), (2, ""), "{out:?}");
    let said: serde_json::Value = serde_json::from_str(&out.stderr).expect("one JSON object");
    assert_eq!(
        said,
        serde_json::json!({"code": "unavailable",
                           "error": "mur cluster status: unavailable: mur.api.cluster.status: no coordinator answers \
                                     (no responders); start one with `mur coordinator`, or `mur dev` for a cluster \
                                     on this machine"})
    );
}

/// A `mur dev` whose start fails once its coordinator and workers run (here its `--http`
/// address is taken) says why, exits 2, and stops them before its nats-server: no worker
/// is left pulling from a server gone under it (`409: Server Shutdown` warnings before).
#[test]
fn a_failed_mur_dev_start_names_the_cause_and_stops_its_workers_before_the_server() {
    use mur_tests::mur::{Run, mur};
    let data = tempfile::tempdir().unwrap();
    let capsules = tempfile::tempdir().unwrap();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let http = taken.local_addr().unwrap().to_string();
    let mut c = mur();
    c.args(["dev", "--port", &free_port().to_string(), "--http", &http, "--capsules"]).arg(capsules.path());
    c.arg("--data-dir").arg(data.path());
    let out = Run::of(&mut c);
    assert_eq!(out.code, 2, "{out:?}");
    assert!(out.stderr.ends_with(&format!("mur: --http {http}: Address already in use (os error 98)\n")), "{out:?}");
    assert!(!out.stderr.contains("WARN"), "{}", out.stderr);
}

/// A worker killed without deregistering is listed silent by `mur cluster status`, and
/// forgotten once `silent_worker_secs` (here the least, 30 s) have passed since its last heartbeat:
/// `mur_workers`' max age. A live worker's heartbeats keep it listed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_worker_is_listed_silent_then_forgotten_after_silent_worker_secs() {
    let cluster = mur_tests::procs::Procs::start("jetstream:\n  silent_worker_secs: 30\n").await;
    let _coordinator = cluster.coordinator("coordinator-1");
    let _live = cluster.worker("wkr-live", 1);
    let mut killed = cluster.worker("wkr-killed", 1);
    cluster.wait_workers(2).await;
    killed.kill9();
    let workers = || async {
        let out = mur_tests::mur::Run::of(
            mur_tests::mur::mur().args(["cluster", "status", "--json"]).env("NATS_URL", cluster.nats.url()),
        );
        let mut listed: Vec<(String, bool)> = out.last_json()["workers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|w| (w["worker_id"].as_str().unwrap().to_string(), w["live"].as_bool().unwrap()))
            .collect();
        listed.sort();
        listed
    };
    let pair = |id: &str, live: bool| (id.to_string(), live);
    mur_tests::procs::until("the killed worker listed silent", Duration::from_secs(60), || async {
        (workers().await == [pair("wkr-killed", false), pair("wkr-live", true)]).then_some(())
    })
    .await;
    let silent_at = std::time::Instant::now();
    mur_tests::procs::until("the killed worker forgotten", Duration::from_secs(60), || async {
        (workers().await == [pair("wkr-live", true)]).then_some(())
    })
    .await;
    // Silent 10 s after its last heartbeat (the coordinator's worker timeout), forgotten
    // 30 s after it: listed silent for about 20 s.
    let listed_silent = silent_at.elapsed();
    assert!(listed_silent > Duration::from_secs(12) && listed_silent < Duration::from_secs(28), "{listed_silent:?}");
    let js = async_nats::jetstream::new(cluster.client.clone());
    let info = js.get_stream(format!("KV_{}", cluster::WORKERS_BUCKET)).await.unwrap().cached_info().clone();
    assert_eq!(info.config.max_age, Duration::from_secs(30));
}

// ---------------------------------------------------------------------------------------
// A detached command's completion on the cluster.

/// Issue #29 item 2 (issue #30: one API client): a detached command's completion sent
/// while no coordinator takes it — one answering `unavailable`, then none answering at
/// all — is sent again, the same task, and arrives, once, when a coordinator starts. It
/// was sent once, and lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_sent_while_no_coordinator_answers_arrives_once_one_starts() -> Result<()> {
    use mur_worker::service::detached;
    use mur_worker::tools::DetachedWork;
    use mur_worker::tools::background::{DetachNotice, DetachSink};

    let server = NatsServer::start();
    push_capsules(&server).await?;
    let res = resources::ensure(&server.jetstream().await, &Settings::default()).await?;
    // Connected before it returns, so its subscription is in place before the first send.
    let client = async_nats::connect(server.url()).await?;
    // Stands in for a coordinator whose JetStream fails: it answers the first send
    // `unavailable`, then goes away.
    let mut stand_in = client.subscribe(cluster::api::TASK_SUBMIT).await?;
    client.flush().await?;

    let session = tempfile::tempdir()?;
    let work_id = Id::generate(IdKind::Work).to_string();
    let output_path = format!("logs/{work_id}.log");
    std::fs::create_dir_all(session.path().join("logs"))?;
    std::fs::write(session.path().join(&output_path), "done\n")?;
    let context_id = Id::generate(IdKind::Context).to_string();
    let host = detached::Host {
        client: server.connect().await,
        store: res.capsules.clone(),
        capsule: "greeter".into(),
        task_id: Id::generate(IdKind::Task).to_string(),
        context_id: context_id.clone(),
        session_id: Id::generate(IdKind::Session).to_string(),
        session_dir: session.path().to_path_buf(),
    };
    let (notify, notices) = tokio::sync::mpsc::unbounded_channel();
    let (sink, _sink_notices) = DetachSink::channel();
    let (session_done, stop) = (tokio_util::sync::CancellationToken::new(), tokio_util::sync::CancellationToken::new());
    let serving = tokio::spawn(host.serve(notices, sink, session_done.clone(), stop.clone()));
    notify.send(DetachNotice::Detached(DetachedWork {
        work_id: work_id.clone(),
        binary: "sleep".into(),
        command: "sleep 60".into(),
        grace_ms: 1000,
        running_ms: 1000,
        output_path: output_path.clone(),
    }))?;
    notify.send(DetachNotice::Completed {
        work_id: work_id.clone(),
        exit_code: 0,
        duration_ms: 61_000,
        output_path: output_path.clone(),
        output_bytes: 5,
    })?;
    session_done.cancel();

    let first = tokio::time::timeout(WAIT, stand_in.next()).await?.expect("the completion is sent");
    let sent: cluster::SubmitRequest = serde_json::from_slice(&first.payload)?;
    let task_id = sent.task_id.clone().expect("the client names the task, so a send again is the same task");
    let (headers, body) =
        api::error_reply(&cluster::ApiError::new(cluster::ErrorCode::Unavailable, "mur_tasks: broker restarting"));
    client.publish_with_headers(first.reply.expect("a request"), headers, body).await?;
    stand_in.unsubscribe().await?;
    client.flush().await?;

    // Until the coordinator is up nobody answers (no responders); then the next send lands.
    let mut arrivals = res.tasks.watch_with_history(&task_id).await?;
    let coordinator = Coordinator::start(&server, "c1").await;
    let arrived = tokio::time::timeout(WAIT, arrivals.next()).await?.expect("the watch goes on")?;
    let record: TaskRecord = serde_json::from_slice(&arrived.value)?;
    assert_eq!((record.capsule.as_str(), record.origin), ("greeter", mur_proto::task::Origin::Completion));
    assert_eq!(record.context_id, context_id);
    assert!(
        record.text.starts_with(&format!("A detached shell command has ended.\nwork_id: {work_id}\n")),
        "{}",
        record.text
    );
    // Once: the only task in the bucket.
    assert_eq!(task_keys(&server).await?, vec![task_id.clone()]);
    // The host is done (the session ended, its one command reported) and the session's
    // trace names the completion task.
    tokio::time::timeout(WAIT, serving).await??;
    let trace = std::fs::read_to_string(session.path().join("trace.jsonl"))?;
    let completed: serde_json::Value = serde_json::from_str(trace.lines().last().expect("a trace line"))?;
    assert_eq!(completed["event_type"], "shell_completed", "{trace}");
    assert_eq!(completed["completion_task_id"], task_id.as_str(), "{trace}");
    coordinator.stop().await?;
    Ok(())
}

/// Issue #30: a client tells an older coordinator from the API version its errors carry,
/// not from their text. A refusal without `api_version` of a submission naming its task
/// id (a coordinator older than the field) is sent again without the id; a refusal from a
/// coordinator of this API is the answer, sent once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_submission_is_sent_again_without_its_task_id_only_to_a_coordinator_older_than_the_api_version() -> Result<()>
{
    let server = NatsServer::start();
    // A send that meets no subscriber yet ("no responders") is sent again: the patience.
    let client = server.connect().await;
    let stand_in = server.connect().await;
    let mut requests = stand_in.subscribe(cluster::api::TASK_SUBMIT).await?;
    stand_in.flush().await?;
    // The old coordinator's refusal: micro service error headers and an `ApiError` body
    // with no version.
    let old_refusal = |reply: async_nats::Subject| {
        let stand_in = stand_in.clone();
        async move {
            let mut headers = async_nats::HeaderMap::new();
            headers.insert("Nats-Service-Error", "invalid_request: task_id: unknown field");
            headers.insert("Nats-Service-Error-Code", "400");
            let body = r#"{"code":"invalid_request","message":"task_id: unknown field"}"#;
            stand_in.publish_with_headers(reply, headers, body.into()).await.unwrap();
        }
    };

    let mut request = cluster::SubmitRequest::new("greeter", "hi", mur_proto::task::Origin::User);
    let sending = tokio::spawn({
        let client = client.clone();
        async move {
            let reply = api::submit(&client, &mut request, WAIT, |_, _| {}).await;
            (reply, request)
        }
    });
    let first = tokio::time::timeout(WAIT, requests.next()).await?.expect("sent");
    let first_body: cluster::SubmitRequest = serde_json::from_slice(&first.payload)?;
    assert!(first_body.task_id.is_some(), "the client names the task");
    old_refusal(first.reply.expect("a request")).await;
    let second = tokio::time::timeout(WAIT, requests.next()).await?.expect("sent again");
    let second_body: cluster::SubmitRequest = serde_json::from_slice(&second.payload)?;
    assert_eq!(second_body.task_id, None);
    let accepted =
        cluster::SubmitReply { task_id: TaskId::unchecked("tsk_from_the_old_one"), state: TaskState::Submitted };
    stand_in.publish(second.reply.expect("a request"), serde_json::to_vec(&accepted)?.into()).await?;
    let (reply, request) = sending.await?;
    assert_eq!(reply.expect("accepted").task_id, "tsk_from_the_old_one");
    assert_eq!(request.task_id, None);

    // A coordinator of this API refuses with its version: that is the answer.
    let mut request = cluster::SubmitRequest::new("greeter", "", mur_proto::task::Origin::User);
    let sending = tokio::spawn({
        let client = client.clone();
        async move { api::submit(&client, &mut request, WAIT, |_, _| {}).await }
    });
    let only = tokio::time::timeout(WAIT, requests.next()).await?.expect("sent");
    let (headers, body) = api::error_reply(&cluster::ApiError::invalid("text: must not be empty"));
    stand_in.publish_with_headers(only.reply.expect("a request"), headers, body).await?;
    let err = sending.await?.expect_err("refused");
    assert_eq!(
        (err.code, err.message.as_str(), err.api_version),
        (cluster::ErrorCode::InvalidRequest, "text: must not be empty", Some(cluster::api::VERSION))
    );
    stand_in.flush().await?;
    assert!(
        tokio::time::timeout(QUIET, requests.next()).await.is_err(),
        "a refusal of this API's coordinator is not sent again"
    );
    Ok(())
}
