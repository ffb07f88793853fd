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

/// `mur health URL` (issue #32 §Health, for images without curl): exit 0 while a real
/// coordinator's `/readyz` answers 200, 1 once nats-server is stopped (and when nothing
/// listens), 0 again when it is back; 2 for a URL that is not one to ask. The URL it
/// prints has no password or query.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mur_health_exits_0_when_ready_1_when_nats_server_is_away_and_0_when_it_returns() {
    let mut cluster = Procs::start("").await;
    let coordinator = cluster.coordinator_with("coordinator-1", &["--metrics", "127.0.0.1:0"]);
    let base = coordinator.metrics_url().await;
    let url = format!("{base}/readyz");
    readyz(&base, 200).await;

    let ready = cluster.mur(&["health", &url, "--json"]).await;
    assert_eq!(ready.code, 0, "{ready:?}");
    let answer = ready.last_json();
    assert_eq!((answer["ready"].as_bool(), answer["status"].as_u64()), (Some(true), Some(200)), "{answer}");
    assert_eq!((answer["url"].as_str(), answer["body"]["nats"].as_str()), (Some(url.as_str()), Some("connected")));
    let said = cluster.mur(&["health", &url]).await;
    assert_eq!((said.code, said.stdout.as_str()), (0, ""), "{said:?}");
    assert_eq!(said.stderr, format!("ready: {url} answered 200\n"));
    let alive = cluster.mur(&["health", &format!("{base}/healthz"), "--json"]).await;
    assert_eq!((alive.code, &alive.last_json()["body"]), (0, &Value::from("ok")), "{alive:?}");

    cluster.nats.stop();
    readyz(&base, 503).await;
    let away = cluster.mur(&["health", &url, "--json"]).await;
    assert_eq!(away.code, 1, "{away:?}");
    let answer = away.last_json();
    assert_eq!((answer["ready"].as_bool(), answer["status"].as_u64()), (Some(false), Some(503)), "{answer}");
    assert_ne!(answer["body"]["nats"], "connected", "{answer}");
    let said = cluster.mur(&["health", &url]).await;
    assert_eq!(said.code, 1, "{said:?}");
    assert!(said.stderr.starts_with(&format!("mur health: not ready: {url} answered 503: {{")), "{said:?}");

    cluster.nats.resume();
    readyz(&base, 200).await;
    assert_eq!(cluster.mur(&["health", &url]).await.code, 0);

    // Nothing listening: not ready, with the reason.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let nothing = cluster.mur(&["health", &format!("http://127.0.0.1:{port}/readyz"), "--json"]).await;
    assert_eq!(nothing.code, 1, "{nothing:?}");
    let answer = nothing.last_json();
    assert_eq!(answer["ready"], false, "{answer}");
    assert!(answer["error"].as_str().is_some_and(|e| !e.is_empty()), "{answer}");

    // The secret parts of a URL are not printed.
    let secret = base.replace("http://", "http://probe:s3cret@") + "/readyz?token=t0ken";
    let quiet = cluster.mur(&["health", &secret, "--json"]).await;
    assert_eq!(quiet.code, 0, "{quiet:?}");
    assert!(!quiet.stdout.contains("s3cret") && !quiet.stdout.contains("t0ken"), "{quiet:?}");
    assert_eq!(quiet.last_json()["url"], url.as_str());

    let bad = cluster.mur(&["health", "ftp://127.0.0.1/readyz"]).await;
    assert_eq!((bad.code, bad.stdout.as_str()), (2, ""), "{bad:?}");
    assert!(bad.stderr.starts_with("mur health: URL: must be an http:// or https:// URL"), "{bad:?}");
    let bad = cluster.mur(&["health", "readyz"]).await;
    assert!(bad.code == 2 && bad.stderr.starts_with("mur health: URL: "), "{bad:?}");
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

/// One sample line of a Prometheus text scrape.
#[derive(Debug)]
struct Sample {
    name: String,
    labels: std::collections::BTreeMap<String, String>,
    value: f64,
}

/// A scrape: the `# TYPE` of each metric family, and every sample.
struct Scrape {
    text: String,
    types: std::collections::BTreeMap<String, String>,
    samples: Vec<Sample>,
}

impl Scrape {
    /// Parses the text format (0.0.4): `# TYPE name type` lines and `name{k="v",…} value`
    /// samples (label values here hold no `"`, `,` or `}`).
    fn parse(text: String) -> Scrape {
        let mut types = std::collections::BTreeMap::new();
        let mut samples = Vec::new();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, kind) = rest.split_once(' ').expect("# TYPE name type");
                types.insert(name.to_string(), kind.to_string());
                continue;
            }
            if line.starts_with('#') || line.is_empty() {
                continue;
            }
            let (series, value) = line.rsplit_once(' ').expect("sample: series value");
            let (name, labels) = match series.split_once('{') {
                Some((name, rest)) => {
                    let labels = rest.trim_end_matches('}').split(',').filter(|p| !p.is_empty()).map(|pair| {
                        let (k, v) = pair.split_once('=').expect("label k=v");
                        (k.to_string(), v.trim_matches('"').to_string())
                    });
                    (name.to_string(), labels.collect())
                }
                None => (series.to_string(), Default::default()),
            };
            samples.push(Sample { name, labels, value: value.parse().expect("sample value") });
        }
        Scrape { text, types, samples }
    }

    /// The sum of the samples of `name` whose labels include every pair of `with`.
    fn sum(&self, name: &str, with: &[(&str, &str)]) -> f64 {
        self.samples
            .iter()
            .filter(|s| s.name == name && with.iter().all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v)))
            .map(|s| s.value)
            .sum()
    }

    /// The label names of the samples of `name`.
    fn label_names(&self, name: &str) -> std::collections::BTreeSet<String> {
        self.samples.iter().filter(|s| s.name == name).flat_map(|s| s.labels.keys().cloned()).collect()
    }

    fn assert_type(&self, family: &str, kind: &str) {
        assert_eq!(self.types.get(family).map(String::as_str), Some(kind), "# TYPE {family}:\n{}", self.text);
    }
}

async fn scrape(base: &str) -> Scrape {
    let (code, text) = get(&format!("{base}/metrics")).await.expect("/metrics answers");
    assert_eq!(code, 200, "{text}");
    Scrape::parse(text)
}

/// `promtool check metrics` on `text` (Debian's `prometheus` package); skipped, saying
/// why, when promtool is not installed (`.ci/run` installs it).
fn promtool_check(what: &str, text: &str) {
    use std::io::Write;
    let child = std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) => {
            eprintln!("skipping `promtool check metrics` on the {what}'s scrape: promtool: {e}");
            return;
        }
    };
    child.stdin.take().expect("stdin").write_all(text.as_bytes()).expect("write to promtool");
    let out = child.wait_with_output().expect("promtool");
    assert!(
        out.status.success(),
        "promtool check metrics on the {what}'s scrape: {}{}\n{text}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_of_a_real_coordinator_and_worker_count_the_tasks_they_ran() {
    use mur_proto::task::{Origin, TaskState};
    let cluster = Procs::start("").await;
    let coordinator = cluster.coordinator_with("coordinator-1", &["--metrics", "127.0.0.1:0"]);
    let coordinator_url = coordinator.metrics_url().await;
    let capsule = mur_tests::capsule::shell_capsule("metered");
    cluster.push(capsule.dir()).await;

    // No worker yet: two tasks wait in the user lane, one in the peer lane.
    let mut sent = Vec::new();
    for (text, origin) in [("echo one", Origin::User), ("echo two", Origin::User), ("echo three", Origin::Peer)] {
        sent.push(cluster.submit("metered", text, origin).await);
    }
    let waiting = until("the leader's gauges show the waiting tasks", WAIT, || async {
        let s = scrape(&coordinator_url).await;
        let user = s.sum("mur_tasks_waiting", &[("capsule", "metered"), ("lane", "user")]);
        let peer = s.sum("mur_tasks_waiting", &[("capsule", "metered"), ("lane", "peer")]);
        (user == 2.0 && peer == 1.0).then_some(s)
    })
    .await;
    waiting.assert_type("mur_tasks_waiting", "gauge");
    waiting.assert_type("mur_tasks_waiting_oldest_age_seconds", "gauge");
    let age = waiting.sum("mur_tasks_waiting_oldest_age_seconds", &[("capsule", "metered"), ("lane", "user")]);
    assert!(age > 0.0 && age < 120.0, "the oldest waiting task's age in seconds: {age}");
    assert_eq!(waiting.sum("mur_workers_alive", &[]), 0.0, "{}", waiting.text);
    assert_eq!(waiting.sum("mur_leader_changes_total", &[("to", "leading")]), 1.0, "{}", waiting.text);
    waiting.assert_type("mur_leader_changes_total", "counter");
    promtool_check("coordinator", &waiting.text);

    let worker = cluster.worker_with("wkr-metered", 2, &["--metrics", "127.0.0.1:0"]);
    let worker_url = worker.metrics_url().await;
    for task_id in &sent {
        let record = cluster.wait_record(task_id, WAIT, |r| r.state.is_terminal()).await;
        assert_eq!(record.state, TaskState::Completed, "{record:?}");
    }

    let s = scrape(&worker_url).await;
    promtool_check("worker", &s.text);
    if std::env::var_os("MUR_TEST_SHOW_SCRAPE").is_some() {
        eprintln!("{}", s.text);
    }
    // Every task ended ok, counted once, by capsule and exit status.
    s.assert_type("mur_task_ends_total", "counter");
    assert_eq!(s.sum("mur_task_ends_total", &[("capsule", "metered"), ("exit_status", "ok")]), 3.0, "{}", s.text);
    assert_eq!(s.sum("mur_task_ends_total", &[]), 3.0, "no other end: {}", s.text);
    assert_eq!(
        s.label_names("mur_task_ends_total"),
        ["capsule", "exit_status"].map(String::from).into(),
        "bounded labels, no task id"
    );
    // Dispatch latency: one observation per task, by lane.
    s.assert_type("mur_task_dispatch_latency_seconds", "histogram");
    assert_eq!(s.sum("mur_task_dispatch_latency_seconds_count", &[("lane", "user")]), 2.0, "{}", s.text);
    assert_eq!(s.sum("mur_task_dispatch_latency_seconds_count", &[("lane", "peer")]), 1.0, "{}", s.text);
    // Two model calls per task (the tool call, then the answer), by provider and model.
    s.assert_type("gen_ai_client_operation_duration_seconds", "histogram");
    let chat = [("gen_ai_operation_name", "chat"), ("gen_ai_provider_name", "scripted")];
    assert_eq!(s.sum("gen_ai_client_operation_duration_seconds_count", &chat), 6.0, "{}", s.text);
    s.assert_type("gen_ai_client_token_usage", "histogram");
    let input = [("gen_ai_token_type", "input"), ("gen_ai_operation_name", "chat")];
    assert_eq!(s.sum("gen_ai_client_token_usage_count", &input), 6.0, "{}", s.text);
    assert!(s.sum("gen_ai_client_token_usage_sum", &input) > 0.0, "{}", s.text);
    assert_eq!(s.sum("gen_ai_client_token_usage_count", &[("gen_ai_token_type", "output")]), 6.0, "{}", s.text);
    // One `sh` tool call per task.
    s.assert_type("mur_tool_duration_seconds", "histogram");
    assert_eq!(s.sum("mur_tool_duration_seconds_count", &[("gen_ai_tool_name", "sh")]), 3.0, "{}", s.text);
    // Nothing was redelivered or taken over.
    assert_eq!(s.sum("mur_task_redeliveries_total", &[]) + s.sum("mur_task_takeovers_total", &[]), 0.0);

    // The leader's gauges: one live worker with two slots, nothing waiting or in flight.
    let s = until("the leader's gauges show the worker", WAIT, || async {
        let s = scrape(&coordinator_url).await;
        let idle = s.sum("mur_tasks_waiting", &[]) == 0.0 && s.sum("mur_tasks_in_flight", &[]) == 0.0;
        (idle && s.sum("mur_workers_alive", &[]) == 1.0).then_some(s)
    })
    .await;
    assert_eq!((s.sum("mur_workers_slots", &[]), s.sum("mur_workers_slots_free", &[])), (2.0, 2.0), "{}", s.text);
    s.assert_type("mur_fanout_permits_in_use", "gauge");
    promtool_check("coordinator", &s.text);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_are_exported_over_otlp_when_the_metrics_endpoint_is_set() {
    use mur_proto::task::{Origin, TaskState};
    use mur_tests::fake_otlp::FakeOtlp;
    let collector = FakeOtlp::start();
    let mut cluster = Procs::start("").await;
    // The signal's own variable is the whole URL; no `--metrics` listener.
    cluster.set_env("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", &format!("{}/v1/metrics", collector.url()));
    cluster.set_env("OTEL_METRIC_EXPORT_INTERVAL", "200");
    let _coordinator = cluster.coordinator("coordinator-1");
    let _worker = cluster.worker("wkr-otlp", 1);
    let capsule = mur_tests::capsule::shell_capsule("exported");
    cluster.push(capsule.dir()).await;
    let task_id = cluster.submit("exported", "echo exported", Origin::User).await;
    let record = cluster.wait_record(&task_id, WAIT, |r| r.state.is_terminal()).await;
    assert_eq!(record.state, TaskState::Completed, "{record:?}");

    let points = until("the worker's task end and the leader's gauges exported", WAIT, || async {
        let points = collector.points();
        let ended = points.iter().any(|p| {
            p.service == "mur-worker"
                && p.metric == "mur.task.ends"
                && p.kind == "sum"
                && p.attribute("exit_status") == Some("ok")
                && p.value == 1.0
        });
        let gauges =
            points.iter().any(|p| p.service == "mur-coordinator" && p.metric == "mur.workers.alive" && p.value == 1.0);
        (ended && gauges).then_some(points)
    })
    .await;
    let chat = points
        .iter()
        .find(|p| p.service == "mur-worker" && p.metric == "gen_ai.client.operation.duration")
        .expect("the model calls' durations exported");
    assert_eq!((chat.kind, chat.unit.as_str()), ("histogram", "s"), "{chat:?}");
    assert_eq!(chat.attribute("gen_ai.provider.name"), Some("scripted"), "{chat:?}");
    let leader = points.iter().find(|p| p.metric == "mur.leader.changes").expect("the leader change exported");
    assert_eq!((leader.service.as_str(), leader.attribute("to")), ("mur-coordinator", Some("leading")), "{leader:?}");
    assert!(collector.spans().is_empty(), "no span export without a traces endpoint");
}

/// The metric families `docs/observe.md` lists (its tables' first cells), each with whether
/// it is a histogram, and every label name its tables name.
fn documented_metrics() -> (std::collections::BTreeMap<String, bool>, std::collections::BTreeSet<String>) {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let doc = std::fs::read_to_string(root.join("docs/observe.md")).expect("docs/observe.md");
    let mut families = std::collections::BTreeMap::new();
    let mut labels = std::collections::BTreeSet::new();
    for row in doc.lines().filter(|l| l.starts_with("| `")) {
        let cells: Vec<&str> = row.split(" | ").collect();
        let ticked = |cell: &str| -> Vec<String> { cell.split('`').skip(1).step_by(2).map(str::to_string).collect() };
        let names = ticked(cells[0]);
        if !names.iter().all(|n| n.starts_with("mur_") || n.starts_with("gen_ai_")) {
            continue; // the listener's paths
        }
        for name in names {
            families.insert(name, row.contains("| histogram |"));
        }
        for cell in &cells[1..] {
            labels.extend(ticked(cell).into_iter().filter(|l| l.chars().all(|c| c.is_ascii_lowercase() || c == '_')));
        }
    }
    (families, labels)
}

/// Issue #32 §A dashboard: `deploy/grafana/murmur.json` is a well-formed Grafana
/// dashboard (unique panel ids, every panel placed, with queries on the dashboard's
/// Prometheus variable) whose queries name only metrics `docs/observe.md` lists (a
/// histogram's `_bucket`, `_sum` and `_count` series included) and group only by labels it
/// lists, and that shows what an operator watches: lanes, throughput and outcomes,
/// dispatch latency, permits, workers, tokens and spend.
#[test]
fn the_grafana_dashboard_queries_only_the_documented_metrics() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let text = std::fs::read_to_string(root.join("deploy/grafana/murmur.json")).expect("deploy/grafana/murmur.json");
    let dashboard: Value = serde_json::from_str(&text).expect("the dashboard is JSON");
    let (families, labels) = documented_metrics();
    assert!(families.len() >= 15, "{families:?}");
    assert!(dashboard["title"].is_string() && dashboard["uid"].is_string(), "title and uid");
    let variables = dashboard["templating"]["list"].as_array().expect("templating.list");
    assert!(
        variables.iter().any(|v| v["name"] == "datasource" && v["type"] == "datasource" && v["query"] == "prometheus"),
        "a Prometheus data source variable: {variables:?}"
    );
    let panels = dashboard["panels"].as_array().expect("panels");
    let mut ids = std::collections::BTreeSet::new();
    let mut used = std::collections::BTreeSet::new();
    for panel in panels {
        let title = panel["title"].as_str().expect("a panel title");
        assert!(ids.insert(panel["id"].as_u64().expect("a panel id")), "panel ids are unique: {title}");
        for key in ["x", "y", "w", "h"] {
            assert!(panel["gridPos"][key].is_u64(), "{title}: gridPos.{key}");
        }
        assert_eq!(panel["datasource"]["uid"], "${datasource}", "{title}");
        let targets = panel["targets"].as_array().filter(|t| !t.is_empty()).expect("queries");
        let ref_ids: std::collections::BTreeSet<_> = targets.iter().map(|t| t["refId"].as_str().unwrap()).collect();
        assert_eq!(ref_ids.len(), targets.len(), "{title}: refIds are unique");
        for target in targets {
            let expr = target["expr"].as_str().expect("expr");
            let words = expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'));
            for word in words.filter(|w| w.starts_with("mur_") || w.starts_with("gen_ai_client_")) {
                let family = ["_bucket", "_sum", "_count"]
                    .iter()
                    .find_map(|s| word.strip_suffix(s).filter(|base| families.get(*base) == Some(&true)))
                    .unwrap_or(word);
                assert!(families.contains_key(family), "{title}: {word} is not in docs/observe.md: {expr}");
                used.insert(family.to_string());
            }
            // The labels it groups by.
            for group in expr.split("by (").skip(1) {
                for label in group.split(')').next().unwrap().split(',').map(str::trim) {
                    assert!(
                        label == "le" || labels.contains(label),
                        "{title}: label {label} is not documented: {expr}"
                    );
                }
            }
        }
    }
    for wanted in [
        "mur_tasks_waiting",
        "mur_tasks_waiting_oldest_age_seconds",
        "mur_task_ends_total",
        "mur_task_dispatch_latency_seconds",
        "mur_fanout_permits_in_use",
        "mur_fanout_permits_cap",
        "mur_workers_alive",
        "mur_workers_slots_free",
        "gen_ai_client_token_usage",
        "mur_fleet_spend_usd_total",
    ] {
        assert!(used.contains(wanted), "the dashboard shows {wanted}: {used:?}");
    }
}
