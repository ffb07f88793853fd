//! A real `nats-server` with JetStream for one test: spawned on a free loopback port with a
//! store folder of its own, killed and removed on drop. No mock of NATS anywhere (the design,
//! §Tests); the shape follows `nats-io/nats.rs:nats-server/src/lib.rs` (the conventions, §1,
//! §7 item 10).
//!
//! Where the server comes from, first match wins:
//! 1. `MUR_TEST_NATS_URL`: reuse that running server. Every test then shares it, so
//!    resources with fixed names (the coordinator's streams and buckets) are shared too: run
//!    such tests with `--test-threads 1`. Such a handle cannot be killed or restarted:
//!    [`NatsServer::kill`], [`NatsServer::restart`] and [`NatsServer::store_dir`] panic, and
//!    chaos tests check [`NatsServer::is_external`] first.
//! 2. `NATS_SERVER_BIN`: the binary at that path.
//! 3. `nats-server` on `PATH`.
//! 4. The one `scripts/find-nats-server` (run by `scripts/demo`) installs in its virtual
//!    environment: `$MUR_VENV/bin/nats-server`, default
//!    `${XDG_CACHE_HOME:-~/.cache}/murmur/venv/bin/nats-server` — so `cargo test` works
//!    right after the demo with nothing exported.
//!
//! A missing binary panics with an install hint. testcontainers is not used: the CI
//! machines reach no image registry (the JetStream patterns reference, §0 item 7).
//!
//! The port is learnt from the ports file the server writes once it is ready
//! (`--ports_file_dir`), waiting with a deadline; a restart reuses the same port and store
//! folder, so clients reconnect to the same URL and find the same streams.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long a server may take to write its ports file (a loaded 2-core CI box included).
const START_DEADLINE: Duration = Duration::from_secs(30);
/// How long a graceful stop may take before the server is killed.
const STOP_DEADLINE: Duration = Duration::from_secs(10);
/// The environment variable naming a running server to reuse.
pub const URL_VAR: &str = "MUR_TEST_NATS_URL";
/// The environment variable naming the `nats-server` binary.
pub const BIN_VAR: &str = mur_nats::server_bin::BIN_VAR;

/// A JetStream-enabled NATS server for a test.
pub struct NatsServer {
    inner: Inner,
}

enum Inner {
    /// `MUR_TEST_NATS_URL`: someone else's server.
    External { url: String },
    /// A server process of our own.
    Spawned(Spawned),
}

struct Spawned {
    bin: PathBuf,
    /// Holds the store folder, the log and the ports files; removed on drop.
    dir: tempfile::TempDir,
    /// `None` while the server is down (after [`NatsServer::kill`] or [`NatsServer::stop`]).
    child: Option<Child>,
    /// Chosen by the first start (`-p -1`), reused by every restart.
    port: u16,
}

impl NatsServer {
    /// Starts a server of this test's own (or reuses `MUR_TEST_NATS_URL`) and returns once it
    /// accepts connections.
    ///
    /// # Panics
    /// When no `nats-server` binary is found (with an install hint), or when the server does
    /// not come up within 30 s (with the tail of its log).
    pub fn start() -> NatsServer {
        Self::start_with_config("")
    }

    /// [`NatsServer::start`] with a server configuration (`tls { … }`, `authorization { … }`,
    /// `accounts { … }`), written to `server.conf` in the server's folder and given with
    /// `-c`; the command line's port, store and log options win over it. Never reuses
    /// `MUR_TEST_NATS_URL`: that server has its own configuration.
    ///
    /// # Panics
    /// As [`NatsServer::start`]; also when `config` is not empty and `MUR_TEST_NATS_URL` is
    /// set, since that server cannot take it.
    pub fn start_with_config(config: &str) -> NatsServer {
        mur_nats::tls::install_crypto_provider();
        if let Some(url) = std::env::var(URL_VAR).ok().filter(|u| !u.trim().is_empty()) {
            assert!(config.is_empty(), "a test with its own nats-server configuration cannot run against {URL_VAR}");
            return NatsServer { inner: Inner::External { url } };
        }
        let bin = find_binary();
        let dir = tempfile::Builder::new().prefix("mur-nats-").tempdir().expect("temp dir for nats-server");
        if !config.is_empty() {
            std::fs::write(dir.path().join("server.conf"), config).expect("write server.conf");
        }
        let mut spawned = Spawned { bin, dir, child: None, port: 0 };
        spawned.launch();
        NatsServer { inner: Inner::Spawned(spawned) }
    }

    /// The server process's id: `None` for someone else's server (`MUR_TEST_NATS_URL`) or
    /// while ours is down.
    pub fn pid(&self) -> Option<u32> {
        match &self.inner {
            Inner::External { .. } => None,
            Inner::Spawned(s) => s.child.as_ref().map(Child::id),
        }
    }

    /// The client URL, `nats://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        match &self.inner {
            Inner::External { url } => url.clone(),
            Inner::Spawned(s) => format!("nats://127.0.0.1:{}", s.port),
        }
    }

    /// Whether this handle reuses `MUR_TEST_NATS_URL` (no kill, restart or store folder).
    pub fn is_external(&self) -> bool {
        matches!(self.inner, Inner::External { .. })
    }

    /// The JetStream store folder (`--store_dir`); it survives restarts.
    ///
    /// # Panics
    /// With `MUR_TEST_NATS_URL` set: that server's store is not ours.
    pub fn store_dir(&self) -> PathBuf {
        self.spawned("store_dir").dir.path().join("store")
    }

    /// The server's log file.
    ///
    /// # Panics
    /// With `MUR_TEST_NATS_URL` set.
    pub fn log_path(&self) -> PathBuf {
        self.spawned("log_path").dir.path().join("nats.log")
    }

    /// Kills the server with SIGKILL (a crash: no flush, no goodbye to clients) and waits
    /// for it to exit. It stays down until [`NatsServer::resume`] or a restart.
    ///
    /// # Panics
    /// With `MUR_TEST_NATS_URL` set.
    pub fn kill(&mut self) {
        self.spawned_mut("kill").kill();
    }

    /// Stops the server gracefully (SIGTERM: JetStream flushes its store), waiting up to
    /// 10 s before killing it. It stays down until [`NatsServer::resume`].
    ///
    /// # Panics
    /// With `MUR_TEST_NATS_URL` set.
    pub fn stop(&mut self) {
        self.spawned_mut("stop").stop();
    }

    /// Starts a stopped or killed server again on the same port and store folder; returns
    /// once it accepts connections. Does nothing if it is running.
    ///
    /// # Panics
    /// With `MUR_TEST_NATS_URL` set, or when the server does not come back within 30 s.
    pub fn resume(&mut self) {
        let s = self.spawned_mut("resume");
        if s.child.is_none() {
            s.launch();
        }
    }

    /// Crash and come back: [`NatsServer::kill`] then [`NatsServer::resume`], same port,
    /// same store folder.
    ///
    /// # Panics
    /// With `MUR_TEST_NATS_URL` set.
    pub fn restart(&mut self) {
        self.kill();
        self.resume();
    }

    /// A clean restart: [`NatsServer::stop`] then [`NatsServer::resume`].
    ///
    /// # Panics
    /// With `MUR_TEST_NATS_URL` set.
    pub fn restart_graceful(&mut self) {
        self.stop();
        self.resume();
    }

    /// A client connected to this server. It reconnects by itself after a restart.
    ///
    /// # Panics
    /// When the connection fails.
    pub async fn connect(&self) -> async_nats::Client {
        let url = self.url();
        async_nats::ConnectOptions::new()
            .retry_on_initial_connect()
            .connection_timeout(Duration::from_secs(5))
            .connect(&url)
            .await
            .unwrap_or_else(|e| panic!("connect to {url}: {e}"))
    }

    /// A client connected with `options` (its server list replaced by this server's URL):
    /// credentials, TLS.
    ///
    /// # Panics
    /// When the connection fails.
    pub async fn connect_with(&self, options: &mur_nats::connect::Options) -> async_nats::Client {
        let options = mur_nats::connect::Options { servers: self.url(), ..options.clone() };
        options.connect("mur-tests").await.unwrap_or_else(|e| panic!("connect with {options:?}: {e}"))
    }

    /// A JetStream context over a fresh client (see [`NatsServer::connect`]).
    pub async fn jetstream(&self) -> async_nats::jetstream::Context {
        async_nats::jetstream::new(self.connect().await)
    }

    fn spawned(&self, what: &str) -> &Spawned {
        match &self.inner {
            Inner::Spawned(s) => s,
            Inner::External { .. } => panic!("NatsServer::{what} needs a server of the test's own; {URL_VAR} is set"),
        }
    }

    fn spawned_mut(&mut self, what: &str) -> &mut Spawned {
        match &mut self.inner {
            Inner::Spawned(s) => s,
            Inner::External { .. } => panic!("NatsServer::{what} needs a server of the test's own; {URL_VAR} is set"),
        }
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        if let Inner::Spawned(s) = &mut self.inner {
            s.kill();
        }
    }
}

impl Spawned {
    /// Spawns the server (on `self.port`, or a free port when 0) and waits for its ports
    /// file.
    fn launch(&mut self) {
        let root = self.dir.path();
        // A ports file left by a killed server must not be mistaken for the new one's.
        remove_ports_files(root);
        let port = if self.port == 0 { "-1".to_string() } else { self.port.to_string() };
        let log = root.join("nats.log");
        let mut cmd = Command::new(&self.bin);
        let conf = root.join("server.conf");
        if conf.is_file() {
            cmd.arg("-c").arg(&conf);
        }
        let child = cmd
            .args(["-js", "-a", "127.0.0.1", "-p", &port])
            .arg("--store_dir")
            .arg(root.join("store"))
            .arg("--ports_file_dir")
            .arg(root)
            .arg("-l")
            .arg(&log)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {}: {e}", self.bin.display()));
        let pid = child.id();
        self.child = Some(child);
        let ports_file = root.join(format!("nats-server_{pid}.ports"));
        let deadline = Instant::now() + START_DEADLINE;
        let port = loop {
            if let Some(port) = read_port(&ports_file) {
                break port;
            }
            if let Some(status) = self.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                self.child = None;
                panic!("nats-server exited with {status} before it was ready\n{}", log_tail(&log));
            }
            if Instant::now() > deadline {
                self.kill();
                panic!("nats-server wrote no ports file within {START_DEADLINE:?}\n{}", log_tail(&log));
            }
            // Polling a file the server writes once ready; the deadline above bounds it.
            std::thread::sleep(Duration::from_millis(10));
        };
        assert!(self.port == 0 || self.port == port, "nats-server came back on port {port}, not {}", self.port);
        self.port = port;
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    fn stop(&mut self) {
        let Some(mut child) = self.child.take() else { return };
        let pid = libc::pid_t::try_from(child.id()).expect("pid fits pid_t");
        // SAFETY: kill(2) on the pid of our own child, which has not been reaped yet.
        unsafe { libc::kill(pid, libc::SIGTERM) };
        let deadline = Instant::now() + STOP_DEADLINE;
        loop {
            match child.try_wait() {
                Ok(Some(_)) | Err(_) => return,
                Ok(None) if Instant::now() > deadline => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return;
                }
                // Polling for the exit; the deadline above bounds it.
                Ok(None) => std::thread::sleep(Duration::from_millis(10)),
            }
        }
    }
}

/// The binary by [`mur_nats::server_bin`]'s rule (`mur dev`'s): `NATS_SERVER_BIN`, else
/// `nats-server` on `PATH`, else the demo's virtual environment's; panics with where it looked.
fn find_binary() -> PathBuf {
    mur_nats::server_bin::find().unwrap_or_else(|e| panic!("{e} (or set {URL_VAR} to a running server with JetStream)"))
}

/// The client port from a ports file (`{"nats":["nats://127.0.0.1:4222"]}`), or `None`
/// while it is absent or half written.
fn read_port(path: &Path) -> Option<u16> {
    let text = std::fs::read_to_string(path).ok()?;
    let json: serde_json::Value = serde_json::from_str(&text).ok()?;
    let url = json["nats"].as_array()?.first()?.as_str()?;
    url.rsplit(':').next()?.parse().ok()
}

fn remove_ports_files(dir: &Path) {
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if entry.file_name().to_string_lossy().ends_with(".ports") {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// The last lines of the server's log, for a failure message.
fn log_tail(log: &Path) -> String {
    match std::fs::read_to_string(log) {
        Ok(text) => {
            let lines: Vec<&str> = text.lines().collect();
            let from = lines.len().saturating_sub(30);
            format!("--- {} (last lines)\n{}", log.display(), lines[from..].join("\n"))
        }
        Err(e) => format!("(no log at {}: {e})", log.display()),
    }
}

/// Every message of `stream` (only `filter` subjects when given), in stream order, parsed
/// as JSON (`null` for what is not): an ordered consumer read until nothing is pending.
///
/// # Panics
/// When the stream cannot be read.
pub async fn stream_json(client: &async_nats::Client, stream: &str, filter: Option<String>) -> Vec<serde_json::Value> {
    use async_nats::jetstream::consumer::pull;
    use futures::StreamExt;
    let js = async_nats::jetstream::new(client.clone());
    let stream = js.get_stream(stream).await.expect("stream");
    let config = pull::OrderedConfig { filter_subject: filter.unwrap_or_default(), ..Default::default() };
    let mut consumer = stream.create_consumer(config).await.expect("ordered consumer");
    let mut out = Vec::new();
    if consumer.info().await.expect("consumer info").num_pending == 0 {
        return out;
    }
    let mut messages = consumer.messages().await.expect("messages");
    while let Some(Ok(msg)) = messages.next().await {
        out.push(serde_json::from_slice(&msg.payload).unwrap_or(serde_json::Value::Null));
        if msg.info().map(|i| i.pending).unwrap_or(0) == 0 {
            break;
        }
    }
    out
}
