//! The cluster's JetStream layer against real `nats-server` processes: the testkit's
//! server (start, crash, restart on the same port and store).
//!
//! Each test starts a server of its own. With `MUR_TEST_NATS_URL` set they share one and
//! touch the same fixed resource names: run them with `--test-threads 1` then.

use anyhow::Result;
use async_nats::jetstream::stream::{self, StorageType};
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
