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
    c.env_remove("NATS_URL").env("MUR_LOG", "warn");
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

/// The lines of a `trace.jsonl`.
pub fn trace_lines(session_dir: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(session_dir.join("trace.jsonl")).expect("read trace.jsonl");
    text.lines().map(|l| serde_json::from_str(l).expect("trace line is JSON")).collect()
}

/// The `event_type` of each line.
pub fn event_types(lines: &[Value]) -> Vec<String> {
    lines.iter().map(|l| l["event_type"].as_str().unwrap_or("").to_string()).collect()
}
