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
use futures::TryStreamExt;
use mur_coordinator::resources::{self, Action, Error, Settings, Storage};
use mur_proto::cluster;
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
            ("KV_mur_tasks", Action::Created),
            ("KV_mur_workers", Action::Created),
            ("KV_mur_sessions", Action::Created),
            ("KV_mur_capsule_index", Action::Created),
            ("OBJ_mur_capsules", Action::Created),
            ("MUR_DISPATCH/workers", Action::Created),
        ]
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

    for (bucket, history) in [("mur_tasks", 5), ("mur_workers", 1), ("mur_sessions", 1), ("mur_capsule_index", 64)] {
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
            ("replies.yaml", "- text: hi\n"),
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
        &[("replies.yaml", "- text: hi\n")],
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

    fn now_ms() -> u64 {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64
    }

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
            let request =
                SubmitRequest { capsule: capsule.into(), text: text.into(), origin: Origin::User, context_id: None };
            let mut record = TaskRecord::submitted(task_id.clone(), request, digest.into(), now_ms());
            let revision = self.res.tasks.create(&task_id, serde_json::to_vec(&record)?.into()).await?;
            record.attempt += 1;
            self.res.tasks.update(&task_id, serde_json::to_vec(&record)?.into(), revision).await?;
            let dispatch = Dispatch { task_id: task_id.clone(), attempt: record.attempt };
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
        let worker = c.worker(Config { progress_every: Duration::from_millis(500), ..config(workdir.path(), 2) });
        let task_id = c.submit("echoer", &digest, "wait").await?;
        let record = c.terminal(&task_id).await?;
        assert_eq!((record.state, record.result.as_deref()), (TaskState::Completed, Some("patient")));
        let info = dispatch_settled(&c).await?;
        assert_eq!((info.delivered.consumer_sequence, info.num_redelivered), (1, 0), "delivered once");
        let sessions = std::fs::read_dir(workdir.path().join("sessions"))?.count();
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
