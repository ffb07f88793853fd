//! `mur coordinator`, `mur worker` and `mur dev`: the cluster's processes (issue #7).
//! `mur dev` is the embedded default: one nats-server with JetStream, a coordinator and
//! workers in one process, the example capsules pushed before it reports ready.

use crate::nats::Connection;
use anyhow::{Context, Result, bail};
use mur_nats::clock::{Clock, SystemClock};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

/// `mur coordinator [--config FILE] [--http HOST:PORT]`
#[derive(clap::Args, Debug)]
pub struct CoordinatorArgs {
    /// The cluster configuration (YAML, the seed's `config.yaml`): JetStream settings.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Also take tasks over A2A HTTP on this address: one endpoint per capsule at
    /// `http://HOST:PORT/capsules/<name>/` (off by default).
    #[arg(long, value_name = "HOST:PORT")]
    http: Option<String>,
    /// The base URL the agent cards advertise (default: `http://` + the bound address),
    /// e.g. `https://agents.example.com` behind a proxy, or the host's address when bound
    /// to 0.0.0.0 in a container.
    #[arg(long, value_name = "URL", requires = "http")]
    public_url: Option<String>,
    #[command(flatten)]
    http_auth: HttpAuth,
    /// This coordinator's name in the leader lease and the logs (default: a fresh
    /// `crd_…`). Several coordinators may run: one leads, the others stand by.
    #[arg(long)]
    id: Option<String>,
    /// Serve `/metrics` (Prometheus text), `/healthz` and `/readyz` on this address (e.g.
    /// 127.0.0.1:9464, or port 0 for a free one: the bound address is said on stderr).
    #[arg(long, value_name = "HOST:PORT")]
    pub(crate) metrics: Option<String>,
    /// The identity file `mur auth init` writes (`identity.creds`): approvals, denials,
    /// `fleet stop`/`start` and jobs sent are then served on a second connection, as that
    /// file's user, so that nats-server states who sent each, and the name recorded is the
    /// caller's credential's (docs/security.md). Without it they record the name the caller
    /// gives.
    #[arg(long, env = "MUR_IDENTITY", value_name = "FILE")]
    identity: Option<PathBuf>,
    #[command(flatten)]
    conn: Connection,
}

/// `mur cluster …`
#[derive(clap::Subcommand, Debug)]
pub enum ClusterCommand {
    /// The queue per capsule and lane (pending, oldest age), tasks in flight with their
    /// worker and attempt, dead letters, workers with free slots, the leader and the
    /// coordinators standing by.
    Status {
        #[command(flatten)]
        conn: Connection,
        /// Print JSON (every worker, silent ones included, each with `live`).
        #[arg(long)]
        json: bool,
        /// List the silent workers too (no heartbeat within the worker timeout: stopped or
        /// killed ones stay registered until their entry ages out); counted otherwise.
        #[arg(long)]
        all: bool,
    },
}

/// Runs a `mur cluster` command.
pub fn cluster(cmd: ClusterCommand) -> Result<ExitCode> {
    let ClusterCommand::Status { conn, json, all } = cmd;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let status: mur_proto::cluster::ClusterStatus = rt.block_on(async {
        let client = conn.connect("mur cluster status").await?;
        mur_nats::api::call(&client, mur_proto::cluster::api::CLUSTER_STATUS, Vec::new())
            .await
            .context("mur cluster status")
    })?;
    if json {
        println!("{}", serde_json::to_string(&status)?);
        return Ok(ExitCode::SUCCESS);
    }
    print!("{}", render_status(&status, all));
    Ok(ExitCode::SUCCESS)
}

fn secs(ms: u64) -> String {
    format!("{:.1}s", ms as f64 / 1000.0)
}

/// The human form of `mur cluster status`: silent workers are counted, and listed only
/// with `all` (`--all`).
fn render_status(s: &mur_proto::cluster::ClusterStatus, all: bool) -> String {
    use comfy_table::{Table, presets::NOTHING};
    let mut out = String::new();
    match &s.leader {
        Some(l) => out.push_str(&format!("leader    {} (term {})\n", l.instance, l.term)),
        None => out.push_str("leader    none (no coordinator holds the lease)\n"),
    }
    if !s.standbys.is_empty() {
        let names: Vec<&str> = s.standbys.iter().map(|c| c.instance.as_str()).collect();
        out.push_str(&format!("standby   {}\n", names.join(", ")));
    }
    let table = |header: Vec<&str>, rows: Vec<Vec<String>>| {
        let mut t = Table::new();
        t.load_preset(NOTHING).set_header(header);
        for r in rows {
            t.add_row(r);
        }
        format!("{t}\n")
    };
    out.push_str(&format!("\nqueue     {} waiting\n", s.lanes.iter().map(|l| l.pending).sum::<u64>()));
    if !s.lanes.is_empty() {
        out.push_str(&table(
            vec!["CAPSULE", "LANE", "PENDING", "OLDEST"],
            s.lanes
                .iter()
                .map(|l| vec![l.capsule.clone(), l.lane.to_string(), l.pending.to_string(), secs(l.oldest_age_ms)])
                .collect(),
        ));
    }
    out.push_str(&format!("\nin flight {}\n", s.in_flight.len()));
    if !s.in_flight.is_empty() {
        out.push_str(&table(
            vec!["TASK", "CAPSULE", "LANE", "STATE", "WORKER", "ATTEMPT", "AGE"],
            s.in_flight
                .iter()
                .map(|t| {
                    let state = if t.cancel_requested {
                        format!("{} (cancel)", t.state.as_str())
                    } else {
                        t.state.as_str().to_string()
                    };
                    vec![
                        t.task_id.to_string(),
                        t.capsule.clone(),
                        t.lane.to_string(),
                        state,
                        t.worker.clone().unwrap_or_else(|| "-".into()),
                        t.attempt.to_string(),
                        secs(t.age_ms),
                    ]
                })
                .collect(),
        ));
    }
    out.push_str(&format!("\ndead letters {}\n", s.dead_letters.len()));
    if !s.dead_letters.is_empty() {
        out.push_str(&table(
            vec!["TASK", "CAPSULE", "DELIVERIES", "REASON"],
            s.dead_letters
                .iter()
                .map(|d| {
                    vec![
                        d.task_id.to_string(),
                        d.capsule.clone(),
                        d.dead_letter.deliveries.to_string(),
                        d.dead_letter.reason.clone(),
                    ]
                })
                .collect(),
        ));
    }
    out.push_str(&workers_line(&s.workers));
    let listed: Vec<_> = s.workers.iter().filter(|w| all || w.live).collect();
    if !listed.is_empty() {
        out.push_str(&table(
            vec!["WORKER", "SLOTS", "FREE", "HEARTBEAT"],
            listed
                .iter()
                .map(|w| {
                    vec![
                        w.worker_id.clone(),
                        w.slots.to_string(),
                        w.free.to_string(),
                        format!("{} ago{}", secs(w.heartbeat_age_ms), if w.live { "" } else { " (silent)" }),
                    ]
                })
                .collect(),
        ));
    }
    out.push_str(&render_permits(&s.fanout));
    out
}

/// The workers' summary line: the live ones and their free slots; silent ones (no
/// heartbeat within the coordinator's worker timeout, so given no task) counted apart.
fn workers_line(workers: &[mur_proto::cluster::WorkerStatus]) -> String {
    let live = workers.iter().filter(|w| w.live);
    let (count, free, slots) = live.fold((0, 0u32, 0u32), |(n, f, s), w| (n + 1, f + w.free, s + w.slots));
    let silent = workers.len() - count;
    let silent = if silent > 0 { format!(", {silent} silent (--all lists them)") } else { String::new() };
    format!("\nworkers   {count} live ({free} of {slots} slots free){silent}\n")
}

/// The fan-out semaphore's lines of `mur cluster status` and `mur fleet status` (issue
/// #11): permits in use, then a table of holders and one of waiting steps, oldest first.
pub(crate) fn render_permits(f: &mur_proto::fanout::FanoutStatus) -> String {
    use comfy_table::{Table, presets::NOTHING};
    let now = SystemClock.now_ms();
    let mut out = format!(
        "
permits   {} in use, {} waiting
",
        f.in_use,
        f.waiting.len()
    );
    let mut rows = |header: &str, rows: Vec<(String, &mur_proto::fanout::Holder)>| {
        if rows.is_empty() {
            return;
        }
        let mut t = Table::new();
        t.load_preset(NOTHING).set_header(vec![header, "TASK", "FLEET", "RUN", "STEP", "WORKER", "CAP", "FOR"]);
        for (first, h) in rows {
            t.add_row(vec![
                first,
                h.task_id.to_string(),
                h.step.fleet.clone(),
                h.step.run_id.clone(),
                h.step.step.clone(),
                h.worker.clone(),
                h.step.cap.to_string(),
                secs(now.saturating_sub(h.since)),
            ]);
        }
        out.push_str(&format!("{t}\n"));
    };
    rows("SLOT", f.holders.iter().map(|h| (h.slot.to_string(), &h.holder)).collect());
    rows("WAITING", f.waiting.iter().enumerate().map(|(i, h)| ((i + 1).to_string(), h)).collect());
    out
}

/// `mur worker [--slots N] [--workdir DIR] [--require-sandbox]`
#[derive(clap::Args, Debug)]
pub struct WorkerArgs {
    /// Concurrent sessions (agents are I/O-bound: default 8, not the core count).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..))]
    slots: u32,
    /// Where bundles are cached and sessions write their files.
    #[arg(long, value_name = "DIR")]
    workdir: Option<PathBuf>,
    /// This worker's id (default: a fresh `wkr_…`).
    #[arg(long)]
    id: Option<String>,
    /// Finished session folders kept under DIR/sessions (the newest); older ones are
    /// removed as sessions finish. A worker alone on DIR counts those an earlier worker
    /// left there too.
    #[arg(long, value_name = "N", default_value_t = mur_worker::service::KEEP_SESSIONS)]
    keep_sessions: usize,
    /// Refuse tasks of capsules without a `sandbox:` block: such a task fails with that
    /// reason and none of its commands runs.
    #[arg(long)]
    require_sandbox: bool,
    /// Serve `/metrics` (Prometheus text), `/healthz` and `/readyz` on this address (e.g.
    /// 127.0.0.1:9464, or port 0 for a free one: the bound address is said on stderr).
    #[arg(long, value_name = "HOST:PORT")]
    pub(crate) metrics: Option<String>,
    #[command(flatten)]
    conn: Connection,
}

/// `mur dev [--port 4222] [--data-dir DIR] [--workers N] [--capsules DIR] [--http HOST:PORT]`
#[derive(clap::Args, Debug)]
pub struct DevArgs {
    /// The NATS port on 127.0.0.1.
    #[arg(long, default_value_t = 4222)]
    port: u16,
    /// Where JetStream and the workers keep their files (kept across restarts).
    #[arg(long, value_name = "DIR")]
    data_dir: Option<PathBuf>,
    /// Workers to run in this process.
    #[arg(long, default_value_t = 2)]
    workers: u32,
    /// Slots per worker.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..))]
    slots: u32,
    /// Capsule folders to push before reporting ready: every subfolder holding murmur.yaml.
    #[arg(long, value_name = "DIR", default_value = "examples")]
    capsules: PathBuf,
    /// Print one JSON line {"url", "http", "metrics", "capsules", "workers"} when ready
    /// (`http`, `metrics`: base URLs, or null).
    #[arg(long)]
    json: bool,
    /// Also take tasks over A2A HTTP on this address (e.g. 127.0.0.1:0): one endpoint per
    /// capsule at `http://HOST:PORT/capsules/<name>/` (off by default).
    #[arg(long, value_name = "HOST:PORT")]
    http: Option<String>,
    #[command(flatten)]
    http_auth: HttpAuth,
    /// Serve `/metrics` (Prometheus text), `/healthz` and `/readyz` on this address (e.g.
    /// 127.0.0.1:9464, or port 0 for a free one: the bound address is said on stderr).
    #[arg(long, value_name = "HOST:PORT")]
    pub(crate) metrics: Option<String>,
}

/// Who may call the `--http` endpoint, and over what (issue #31): bearer tokens from
/// `mur auth token create` (required on a non-loopback address; on loopback, once one
/// exists), HTTPS with a certificate of the operator's.
#[derive(clap::Args, Debug, Clone)]
pub struct HttpAuth {
    /// Serve --http without checking tokens, on any address (anyone who reaches it may run
    /// tasks: only behind an authenticating proxy).
    #[arg(long)]
    pub(crate) insecure_no_auth: bool,
    /// Serve --http over HTTPS with this certificate chain (PEM), with --http-tls-key.
    #[arg(long, value_name = "FILE", requires = "http_tls_key")]
    pub(crate) http_tls_cert: Option<PathBuf>,
    /// The private key (PEM) of --http-tls-cert.
    #[arg(long, value_name = "FILE", requires = "http_tls_cert")]
    pub(crate) http_tls_key: Option<PathBuf>,
}

impl HttpAuth {
    /// The TLS configuration, when asked for.
    pub(crate) fn tls(&self) -> Result<Option<std::sync::Arc<rustls::ServerConfig>>> {
        match (&self.http_tls_cert, &self.http_tls_key) {
            (Some(cert), Some(key)) => Ok(Some(mur_a2a::tls::server_config(cert, key)?)),
            _ => Ok(None),
        }
    }
}

/// Binds `addr` and serves the coordinator's A2A endpoint from a spawned task until
/// `stop` is cancelled; returns the base URL (`http://<bound address>`).
async fn start_http(
    client: async_nats::Client,
    addr: &str,
    public_url: Option<&str>,
    auth: &HttpAuth,
    stop: tokio_util::sync::CancellationToken,
) -> Result<(String, tokio::task::JoinHandle<()>)> {
    use mur_a2a::auth::{Guard, Mode};
    let tls = auth.tls()?;
    let listener = tokio::net::TcpListener::bind(addr).await.with_context(|| format!("--http {addr}"))?;
    let bound = listener.local_addr()?;
    let guard = if auth.insecure_no_auth {
        if !bound.ip().is_loopback() {
            eprintln!("warning: --http {bound} serves without authentication (--insecure-no-auth)");
        }
        Guard::off()
    } else {
        let store = mur_nats::tokens::store(&async_nats::jetstream::new(client.clone())).await?;
        let keyring = mur_nats::tokens::follow(store, stop.clone()).await?;
        if !bound.ip().is_loopback() && keyring.is_empty() {
            bail!(
                "--http {addr}: not a loopback address, and no A2A token exists to check requests against: make one \
                 with `mur auth token create NAME` (senders pass it with --token-file FILE or MUR_A2A_TOKEN), or pass \
                 --insecure-no-auth to serve without authentication (only behind an authenticating proxy)"
            );
        }
        Guard::new(if bound.ip().is_loopback() { Mode::WhenTokens } else { Mode::Required }, keyring)
    };
    let scheme = if tls.is_some() { "https" } else { "http" };
    let base = match public_url {
        Some(url) => url.trim_end_matches('/').to_string(),
        None => format!("{scheme}://{bound}"),
    };
    let served = base.clone();
    let task = tokio::spawn(async move {
        let stopped = async move { stop.cancelled().await };
        if let Err(e) = mur_coordinator::http::serve_with(client, listener, served, guard, tls, stopped).await {
            eprintln!("a2a http: {e}");
        }
    });
    Ok((base, task))
}

/// The cluster config (`--config`): `jetstream:` (streams and buckets), `prices:` (USD per
/// 1,000 tokens per model, issue #11 §Cost), `fleet: {autorun}` (issue #10 §Unattended
/// runs) and `limits:` (the cluster's scope of §The bounds: `deadline`, `stuck`,
/// `cost_usd`). Unknown keys, bad prices and bad limits are refused naming the field.
fn settings(config: Option<&Path>) -> Result<(mur_coordinator::Settings, mur_coordinator::fleet::cost::FleetSettings)> {
    let Some(path) = config else { return Ok(Default::default()) };
    let text = std::fs::read_to_string(path).with_context(|| format!("--config {}", path.display()))?;
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct File {
        #[serde(default)]
        jetstream: Option<mur_coordinator::Settings>,
        #[serde(default)]
        prices: mur_proto::cost::Prices,
        #[serde(default)]
        fleet: FleetBlock,
        #[serde(default)]
        limits: Option<serde_yaml_ng::Value>,
    }
    #[derive(serde::Deserialize, Default)]
    #[serde(deny_unknown_fields)]
    struct FleetBlock {
        #[serde(default)]
        autorun: bool,
    }
    let file: File = serde_yaml_ng::from_str(mur_proto::without_bom(&text))
        .with_context(|| format!("--config {}", path.display()))?;
    file.prices.validate().map_err(|e| anyhow::anyhow!("--config {}: {e}", path.display()))?;
    let limits = mur_proto::fleet::LimitsBlock::from_config(file.limits)
        .map_err(|e| anyhow::anyhow!("--config {}: {}", path.display(), e.join("; ")))?;
    let fleet =
        mur_coordinator::fleet::cost::FleetSettings { prices: file.prices, autorun: file.fleet.autorun, limits };
    Ok((file.jetstream.unwrap_or_default(), fleet))
}

fn default_data_dir() -> PathBuf {
    std::env::var_os("XDG_DATA_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".local/share")))
        .unwrap_or_else(|| PathBuf::from("."))
        .join("murmur/dev")
}

pub fn coordinator(args: CoordinatorArgs, registry: Option<prometheus::Registry>) -> Result<ExitCode> {
    let (settings, fleet) = settings(args.config.as_deref())?;
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        let client = args.conn.connect_patiently("mur coordinator").await?;
        eprintln!("coordinator connected to {}", mur_nats::connect::redacted(&args.conn.server));
        let stop = tokio_util::sync::CancellationToken::new();
        let id = args.id.clone().unwrap_or_else(|| format!("crd_{}", uuid::Uuid::now_v7().simple()));
        if let Some(addr) = &args.metrics {
            let probe = mur_nats::health::Probe::coordinator(client.clone(), id.clone());
            crate::observe::serve(addr, registry, probe, stop.clone()).await?;
        }
        let http = match &args.http {
            Some(addr) => {
                let (base, task) =
                    start_http(client.clone(), addr, args.public_url.as_deref(), &args.http_auth, stop.clone()).await?;
                eprintln!("a2a endpoints at {base}/capsules/<name>/");
                Some(task)
            }
            None => None,
        };
        let identity = match &args.identity {
            Some(path) => {
                let names = mur_nats::identity::Identities::from_file(path)?;
                let mut conn = args.conn.clone();
                conn.creds = Some(path.clone());
                (conn.nkey, conn.user, conn.password, conn.token) = (None, None, None, None);
                let client = conn.connect_patiently("mur coordinator (identity)").await?;
                Some(mur_coordinator::service::Identity { client, names })
            }
            None => {
                if args.conn.options().auth().is_ok_and(|a| a != mur_nats::connect::Auth::None) {
                    eprintln!(
                        "warning: no --identity: approvals, fleet stop/start and jobs record the name their caller \
                         gives, unverified (docs/security.md)"
                    );
                }
                None
            }
        };
        let mut config = mur_coordinator::service::Config::new(settings, id);
        config.fleet = fleet;
        let result =
            mur_coordinator::service::run_with_identity(client, identity, config, crate::run::shutdown_signal()).await;
        stop.cancel();
        if let Some(task) = http {
            let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
        }
        result?;
        Ok(ExitCode::SUCCESS)
    })
}

pub fn worker(args: WorkerArgs, registry: Option<prometheus::Registry>) -> Result<ExitCode> {
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        let client = args.conn.connect_patiently("mur worker").await?;
        let stop = tokio_util::sync::CancellationToken::new();
        if let Some(addr) = &args.metrics {
            crate::observe::serve(addr, registry, mur_nats::health::Probe::worker(client.clone()), stop.clone())
                .await?;
        }
        let workdir = args.workdir.unwrap_or_else(|| default_data_dir().join("worker"));
        let mut config = mur_worker::service::Config::new(workdir);
        config.slots = args.slots;
        config.keep_sessions = args.keep_sessions;
        config.require_sandbox = args.require_sandbox;
        if let Some(id) = args.id {
            config.worker_id = id;
        }
        eprintln!(
            "worker {} with {} slots connected to {}",
            config.worker_id,
            config.slots,
            mur_nats::connect::redacted(&args.conn.server)
        );
        let result = mur_worker::service::run(client, config, crate::run::shutdown_signal()).await;
        stop.cancel();
        result?;
        Ok(ExitCode::SUCCESS)
    })
}

/// The nats-server binary: `NATS_SERVER_BIN`, else `PATH`, else `scripts/find-nats-server`'s
/// virtual environment ([`mur_nats::server_bin`]).
fn nats_server_bin() -> Result<PathBuf> {
    Ok(mur_nats::server_bin::find()?)
}

/// Kills the child on drop.
struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        // SIGTERM first so JetStream flushes its store, then make sure.
        let termed = mur_worker::signal::signal_pid(self.0.id(), libc::SIGTERM)
            .inspect_err(|e| eprintln!("nats-server (pid {}): SIGTERM failed ({e}); killing it", self.0.id()))
            .is_ok();
        let deadline = std::time::Instant::now() + Duration::from_secs(if termed { 10 } else { 0 });
        while std::time::Instant::now() < deadline {
            if matches!(self.0.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Takes `<data>/mur-dev.lock` (an exclusive lock held while the file stays open) and
/// writes this process's id in it.
///
/// # Errors
/// The data folder is in use by another `mur dev` (its process id named), or the file
/// cannot be opened.
fn lock_data_dir(data: &std::path::Path) -> Result<std::fs::File> {
    use std::io::{Read, Seek, Write};
    let path = data.join("mur-dev.lock");
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .with_context(|| format!("--data-dir: opening {}", path.display()))?;
    if let Err(e) = file.try_lock() {
        let mut holder = String::new();
        let _ = file.read_to_string(&mut holder);
        let holder = holder.trim();
        let by = if holder.is_empty() { String::new() } else { format!(" (process {holder})") };
        bail!(
            "--data-dir {}: in use by another mur dev{by} ({e}); stop it, or give another --data-dir",
            data.display()
        );
    }
    file.set_len(0)?;
    file.rewind()?;
    write!(file, "{}", std::process::id())?;
    Ok(file)
}

pub fn dev(args: DevArgs, registry: Option<prometheus::Registry>) -> Result<ExitCode> {
    let data = args.data_dir.clone().unwrap_or_else(default_data_dir);
    std::fs::create_dir_all(data.join("nats")).with_context(|| format!("--data-dir {}", data.display()))?;
    // Held until `mur dev` exits: two nats-servers on one JetStream store corrupt it.
    let _lock = lock_data_dir(&data)?;
    // A nats-server already there would answer for ours (which exits): refuse instead.
    if let Err(e) = std::net::TcpListener::bind(("127.0.0.1", args.port)) {
        bail!(
            "--port {}: 127.0.0.1:{} is taken ({e}); is another `mur dev` or nats-server running? \
             Stop it or give another --port",
            args.port,
            args.port
        );
    }
    let bin = nats_server_bin()?;
    let url = format!("nats://127.0.0.1:{}", args.port);
    let log = std::fs::File::create(data.join("nats-server.log"))?;
    use std::os::unix::process::CommandExt;
    // Named, so that the server answering on the port is known to be this one (two
    // `mur dev` started at once both find the port free; the second server exits).
    let server_name = format!("mur-dev-{}", std::process::id());
    let mut command = std::process::Command::new(&bin);
    command
        .args(["-js", "-a", "127.0.0.1", "-p", &args.port.to_string(), "-n", &server_name, "--store_dir"])
        .arg(data.join("nats"))
        .stdout(log.try_clone()?)
        .stderr(log)
        // Out of the terminal's process group: a Ctrl-C reaches `mur dev` alone, which stops
        // its coordinator and workers while the server still answers, then the server.
        .process_group(0);
    // SAFETY: prctl(2) with plain integers, async-signal-safe, between fork and exec: the
    // server gets SIGTERM when `mur dev` dies without stopping it (SIGKILL).
    unsafe {
        command.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) == -1 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let server = Child(command.spawn().with_context(|| format!("starting {}", bin.display()))?);
    eprintln!("nats-server (JetStream) starting on {url}, store in {}", data.join("nats").display());
    let rt = tokio::runtime::Runtime::new()?;
    let code = rt.block_on(async {
        let deadline = std::time::Instant::now() + Duration::from_secs(15);
        let client = loop {
            match async_nats::ConnectOptions::new().name("mur dev").connect(url.as_str()).await {
                Ok(c) => break c,
                Err(e) if std::time::Instant::now() > deadline => {
                    bail!("nats-server did not come up on {url}: {e} (see {})", data.join("nats-server.log").display())
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        };
        if client.server_info().server_name != server_name {
            bail!(
                "--port {}: another server answers there ({}), not the one this mur dev started (see {})",
                args.port,
                client.server_info().server_name,
                data.join("nats-server.log").display()
            );
        }
        let js = async_nats::jetstream::new(client.clone());
        mur_coordinator::ensure(&js, &mur_coordinator::Settings::default()).await?;
        let shutdown = tokio_util::sync::CancellationToken::new();
        let mut tasks = Vec::new();
        let stop = shutdown.clone();
        let c = client.clone();
        tasks.push(tokio::spawn(async move {
            let config = mur_coordinator::service::Config::default();
            if let Err(e) = mur_coordinator::service::run(c, config, async move { stop.cancelled().await }).await {
                eprintln!("coordinator: {e:#}");
            }
        }));
        for i in 0..args.workers {
            let stop = shutdown.clone();
            let c = client.clone();
            let mut config = mur_worker::service::Config::new(data.join(format!("worker-{i}")));
            config.worker_id = format!("dev-worker-{i}");
            config.slots = args.slots;
            tasks.push(tokio::spawn(async move {
                if let Err(e) = mur_worker::service::run(c, config, async move { stop.cancelled().await }).await {
                    eprintln!("worker: {e:#}");
                }
            }));
        }
        // Once the coordinator and workers run, any way out stops them before the server
        // (a failed start too: they would otherwise lose it under them, pulls and all).
        let started = async {
            let mut pushed = Vec::new();
            if !args.capsules.is_dir() {
                eprintln!(
                    "note: --capsules {}: no such folder here, so no capsule is pushed (run from the repository's root \
                     for its examples, or give --capsules DIR)",
                    args.capsules.display()
                );
            } else {
                let mut dirs: Vec<PathBuf> = std::fs::read_dir(&args.capsules)?
                    .flatten()
                    .map(|e| e.path())
                    .filter(|p| p.join("murmur.yaml").is_file())
                    .collect();
                dirs.sort();
                for dir in dirs {
                    match crate::capsule::push_dir(&client, &dir).await {
                        Ok(r) => pushed.push(r.name),
                        Err(e) => eprintln!("skipping {}: {e:#}", dir.display()),
                    }
                }
            }
            // Ready means the coordinator answers: wait for it (with a deadline). The capsule
            // list is the cheap question (the task list reads every record).
            let deadline = std::time::Instant::now() + Duration::from_secs(30);
            while mur_nats::api::call::<serde_json::Value>(&client, mur_proto::cluster::api::CAPSULE_LIST, Vec::new())
                .await
                .is_err()
            {
                if std::time::Instant::now() > deadline {
                    bail!("the coordinator did not answer within 30 s");
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            let http = match &args.http {
                Some(addr) => {
                    let (base, task) =
                        start_http(client.clone(), addr, None, &args.http_auth, shutdown.clone()).await?;
                    tasks.push(task);
                    Some(base)
                }
                None => None,
            };
            let metrics = match &args.metrics {
                Some(addr) => {
                    // The dev coordinator's instance name is `Config::default()`'s.
                    let instance = mur_coordinator::service::Config::default().instance;
                    let probe = mur_nats::health::Probe::coordinator(client.clone(), instance);
                    let (bound, task) = crate::observe::serve(addr, registry, probe, shutdown.clone()).await?;
                    tasks.push(task);
                    Some(format!("http://{bound}"))
                }
                None => None,
            };
            if args.json {
                println!(
                    "{}",
                    serde_json::json!({
                        "url": url, "http": http, "metrics": metrics, "capsules": pushed, "workers": args.workers
                    })
                );
            } else {
                println!("{url}");
            }
            let endpoints = http.as_ref().map_or(String::new(), |base| format!("; a2a at {base}/capsules/<name>/"));
            eprintln!(
                "ready: coordinator and {} worker(s) × {} slots; capsules: {}{endpoints}. Ctrl-C stops.",
                args.workers,
                args.slots,
                pushed.join(", ")
            );
            anyhow::Ok(())
        }
        .await;
        if started.is_ok() {
            crate::run::shutdown_signal().await;
            eprintln!("stopping");
        }
        shutdown.cancel();
        for t in tasks {
            let _ = tokio::time::timeout(Duration::from_secs(35), t).await;
        }
        started?;
        anyhow::Ok(ExitCode::SUCCESS)
    });
    drop(server);
    code
}

#[cfg(test)]
mod tests {
    use super::*;
    use mur_proto::cluster::WorkerStatus;

    fn worker(id: &str, slots: u32, free: u32, live: bool) -> WorkerStatus {
        WorkerStatus { worker_id: id.into(), slots, free, heartbeat_age_ms: 1000, live }
    }

    #[test]
    fn silent_workers_are_counted_apart_and_their_slots_are_not_free() {
        let workers = [worker("a", 4, 2, true), worker("b", 4, 4, false), worker("c", 4, 4, false)];
        assert_eq!(workers_line(&workers), "\nworkers   1 live (2 of 4 slots free), 2 silent (--all lists them)\n");
        assert_eq!(workers_line(&workers[..1]), "\nworkers   1 live (2 of 4 slots free)\n");
        assert_eq!(workers_line(&[]), "\nworkers   0 live (0 of 0 slots free)\n");
    }

    /// Issue #29 item 9: 33 killed workers stayed listed as silent for an hour.
    #[test]
    fn silent_workers_are_listed_only_with_all() {
        let status = mur_proto::cluster::ClusterStatus {
            workers: vec![worker("a", 4, 2, true), worker("b", 4, 4, false), worker("c", 4, 4, false)],
            ..mur_proto::cluster::ClusterStatus::build(&[], &[], None, 0, 0)
        };
        let rows = |out: &str| -> Vec<String> {
            let names = out.lines().filter_map(|l| l.split_whitespace().next());
            names.filter(|w| ["a", "b", "c"].contains(w)).map(str::to_string).collect()
        };
        let short = render_status(&status, false);
        assert!(short.contains("\nworkers   1 live (2 of 4 slots free), 2 silent (--all lists them)\n"), "{short}");
        assert_eq!(rows(&short), ["a"], "{short}");
        assert!(!short.contains("(silent)"), "{short}");
        let long = render_status(&status, true);
        assert_eq!(rows(&long), ["a", "b", "c"], "{long}");
        assert_eq!(long.matches("1.0s ago (silent)").count(), 2, "{long}");
    }
}
