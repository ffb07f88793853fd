//! The cluster's JetStream layer against real `nats-server` processes: the testkit's
//! server (start, crash, restart on the same port and store) and the coordinator's
//! resources (created, checked, updated idempotently).
//!
//! Each test starts a server of its own. With `MUR_TEST_NATS_URL` set they share one and
//! touch the same fixed resource names: run them with `--test-threads 1` then.

use anyhow::Result;
use async_nats::jetstream::consumer::AckPolicy;
use async_nats::jetstream::stream::{self, RetentionPolicy, StorageType};
use futures::TryStreamExt;
use mur_coordinator::resources::{self, Action, Error, Settings, Storage};
use mur_proto::cluster;
use mur_tests::nats::NatsServer;
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
