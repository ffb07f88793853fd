//! Operating a cluster (issue #32): the `--metrics` listener of real `mur coordinator`,
//! `mur worker` and `mur dev` processes against a real nats-server — `/healthz`,
//! `/readyz` as the server goes and comes back, `/metrics` after real tasks.

use mur_tests::procs::{Procs, until};
use serde_json::Value;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(60);

/// `GET url`: the status code and the body (`None` when nothing answers).
async fn get(url: &str) -> Option<(u16, String)> {
    let client = reqwest::Client::builder().timeout(Duration::from_secs(5)).build().ok()?;
    let response = client.get(url).send().await.ok()?;
    let status = response.status().as_u16();
    Some((status, response.text().await.ok()?))
}

/// Waits until `/readyz` under `base` answers `status`; its JSON body.
async fn readyz(base: &str, status: u16) -> Value {
    until(&format!("{base}/readyz answers {status}"), WAIT, || async {
        let (code, body) = get(&format!("{base}/readyz")).await?;
        (code == status).then(|| serde_json::from_str(&body).expect("readyz: JSON body"))
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_turns_unready_when_nats_server_stops_and_ready_again_when_it_returns() {
    let mut cluster = Procs::start("").await;
    let leader = cluster.coordinator_with("coordinator-1", &["--metrics", "127.0.0.1:0"]);
    let leader_url = leader.metrics_url().await;
    let worker = cluster.worker_with("wkr-ready", 1, &["--metrics", "127.0.0.1:0"]);
    let worker_url = worker.metrics_url().await;

    let ready = until("coordinator-1 leads", WAIT, || async {
        let body = readyz(&leader_url, 200).await;
        (body["role"] == "leading").then_some(body)
    })
    .await;
    assert_eq!((ready["ready"].as_bool(), ready["nats"].as_str()), (Some(true), Some("connected")), "{ready}");
    assert_eq!(ready["leader"], "coordinator-1", "{ready}");
    assert_eq!(ready["missing"], serde_json::json!([]), "{ready}");
    let ready = readyz(&worker_url, 200).await;
    assert!(ready.get("role").is_none(), "a worker has no role: {ready}");

    // A second coordinator stands by, and is ready too: it answers the API.
    let standby = cluster.coordinator_with("coordinator-2", &["--metrics", "127.0.0.1:0"]);
    let standby_url = standby.metrics_url().await;
    let body = readyz(&standby_url, 200).await;
    assert_eq!(
        (body["role"].as_str(), body["leader"].as_str()),
        (Some("standing_by"), Some("coordinator-1")),
        "{body}"
    );

    cluster.nats.stop();
    for url in [&leader_url, &worker_url, &standby_url] {
        let body = readyz(url, 503).await;
        assert_eq!(body["ready"], false, "{body}");
        assert_ne!(body["nats"], "connected", "{body}");
        let (code, alive) = get(&format!("{url}/healthz")).await.expect("healthz answers");
        assert_eq!((code, alive.trim()), (200, "ok"), "the process is alive while NATS is away");
    }

    cluster.nats.resume();
    for url in [&leader_url, &worker_url, &standby_url] {
        let body = readyz(url, 200).await;
        assert_eq!(body["nats"], "connected", "{body}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mur_dev_json_reports_its_metrics_listener() {
    let dir = tempfile::tempdir().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut dev = mur_tests::mur::Background::spawn(mur_tests::mur::mur().args([
        "dev",
        "--json",
        "--port",
        &port.to_string(),
        "--workers",
        "1",
        "--data-dir",
        &dir.path().to_string_lossy(),
        "--capsules",
        &dir.path().join("none").to_string_lossy(),
        "--metrics",
        "127.0.0.1:0",
    ]));
    let ready = dev.next_json(WAIT);
    let base = ready["metrics"].as_str().expect("metrics in mur dev --json").to_string();
    assert!(base.starts_with("http://127.0.0.1:"), "{ready}");
    let body = readyz(&base, 200).await;
    assert_eq!(body["role"], "leading", "{body}");
    let (code, text) = get(&format!("{base}/metrics")).await.expect("metrics answer");
    assert_eq!(code, 200, "{text}");
    assert!(text.contains("target_info{"), "the Prometheus exporter's resource line: {text}");
}
