//! Running the built `mur` binary and reading what it leaves behind.
//!
//! The binary is found in `MUR_BIN`, else next to the test executable's target folder
//! (`target/<profile>/mur`); `cargo test --workspace` builds it because the `mur-cli`
//! package has an integration test of its own.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// Path of a binary of this workspace (`mur`, later `mur-worker`, `mur-coordinator`).
pub fn bin(name: &str) -> PathBuf {
    if let Some(p) = std::env::var_os(format!("{}_BIN", name.to_uppercase().replace('-', "_"))) {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().expect("current exe");
    // target/<profile>/deps/integration-<hash> → target/<profile>/<name>
    let profile_dir = exe.parent().and_then(Path::parent).expect("target profile dir");
    let p = profile_dir.join(name);
    assert!(
        p.is_file(),
        "{} not found: build it with `cargo build --workspace --bins` (or run `cargo test --workspace`)",
        p.display()
    );
    p
}

/// A `mur` command ready to run.
pub fn mur() -> Command {
    let mut c = Command::new(bin("mur"));
    c.env("MUR_LOG", "warn");
    // The connection comes from each test alone, never from the environment it runs in.
    for var in [
        "NATS_URL",
        "NATS_CREDS",
        "NATS_NKEY",
        "NATS_USER",
        "NATS_PASSWORD",
        "NATS_TOKEN",
        "NATS_CA",
        "NATS_CERT",
        "NATS_KEY",
        "MUR_IDENTITY",
    ] {
        c.env_remove(var);
    }
    c
}

/// The outcome of one `mur` invocation.
#[derive(Debug)]
pub struct Run {
    /// Exit code (-1 when killed by a signal).
    pub code: i32,
    /// Standard output.
    pub stdout: String,
    /// Standard error.
    pub stderr: String,
}

impl Run {
    /// Runs `cmd` to completion.
    pub fn of(cmd: &mut Command) -> Run {
        let Output { status, stdout, stderr } = cmd.output().expect("spawn mur");
        Run {
            code: status.code().unwrap_or(-1),
            stdout: String::from_utf8_lossy(&stdout).into_owned(),
            stderr: String::from_utf8_lossy(&stderr).into_owned(),
        }
    }

    /// The last stdout line, parsed as JSON.
    pub fn last_json(&self) -> Value {
        let line =
            self.stdout.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or_else(|| panic!("no stdout: {self:?}"));
        serde_json::from_str(line).unwrap_or_else(|e| panic!("last line is not JSON ({e}): {line}\n{self:?}"))
    }
}

impl Run {
    /// The job id in what `mur fleet send` printed: `queued job <id> in fleet <name>`.
    pub fn sent_job_id(&self) -> String {
        let line = self.stdout.trim_end();
        line.strip_prefix("queued job ")
            .and_then(|rest| rest.split(' ').next())
            .unwrap_or_else(|| panic!("not a `queued job` line: {self:?}"))
            .to_string()
    }

    /// The run id in what `mur fleet run` printed first on stdout: `run <id> started …`.
    pub fn run_id(&self) -> String {
        let line = self.stdout.lines().next().unwrap_or_default();
        line.strip_prefix("run ")
            .and_then(|rest| rest.split(' ').next())
            .unwrap_or_else(|| panic!("not a `run … started` line: {self:?}"))
            .to_string()
    }
}

/// A file of the repository (`examples/fleets/builder.yaml`, say), by its path from the
/// repository's root.
pub fn example(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(path)
}

/// Runs `cmd` to completion off the async runtime's threads (a cluster in this process
/// keeps running meanwhile).
pub async fn run_blocking(mut cmd: Command) -> Run {
    tokio::task::spawn_blocking(move || Run::of(&mut cmd)).await.expect("the mur command's thread")
}

/// The lines of a `trace.jsonl`.
pub fn trace_lines(session_dir: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(session_dir.join("trace.jsonl")).expect("read trace.jsonl");
    text.lines().map(|l| serde_json::from_str(l).expect("trace line is JSON")).collect()
}

/// The `event_type` of each line.
pub fn event_types(lines: &[Value]) -> Vec<String> {
    lines.iter().map(|l| l["event_type"].as_str().unwrap_or("").to_string()).collect()
}

/// A `mur` process running in the background (a `mur run` serving its A2A endpoint).
pub struct Background {
    child: std::process::Child,
    lines: std::sync::mpsc::Receiver<String>,
    /// Every stdout line read so far.
    pub seen: Vec<String>,
}

impl Background {
    /// Spawns `cmd` with stdout piped; stdout lines are collected by a thread.
    pub fn spawn(cmd: &mut Command) -> Background {
        use std::io::BufRead;
        let mut child =
            cmd.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped()).spawn().expect("spawn mur");
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Background { child, lines: rx, seen: Vec::new() }
    }

    /// The next stdout line as JSON, waiting at most `timeout`.
    pub fn next_json(&mut self, timeout: std::time::Duration) -> Value {
        let line =
            self.lines.recv_timeout(timeout).unwrap_or_else(|e| panic!("no stdout line within {timeout:?}: {e}"));
        self.seen.push(line.clone());
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"))
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends `signal` (e.g. `libc::SIGTERM`) to the process; panics on an error other than
    /// the process being gone already.
    pub fn signal(&self, signal: i32) {
        mur_worker::signal::signal_pid(self.child.id(), signal)
            .unwrap_or_else(|e| panic!("signal {signal} to pid {}: {e}", self.child.id()));
    }

    /// Waits for the exit, at most `timeout`; returns the exit code and stderr.
    pub fn wait(mut self, timeout: std::time::Duration) -> (Option<i32>, String) {
        use std::io::Read;
        let deadline = std::time::Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                let mut err = String::new();
                if let Some(mut e) = self.child.stderr.take() {
                    let _ = e.read_to_string(&mut err);
                }
                return (status.code(), err);
            }
            assert!(std::time::Instant::now() < deadline, "mur did not exit within {timeout:?}");
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
