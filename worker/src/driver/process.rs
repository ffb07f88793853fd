//! `inference.transport: process`: an agent program that owns its own conversation
//! (issue #3). The task's text goes to its stdin (then stdin is closed), its stdout is the
//! result, exit code 0 is success. One task is one turn: the program is run once, and the
//! loop sees an `end_turn` reply carrying its stdout. Per the seeds nothing is seeded under
//! this transport (the session-loop seed, §Context seeding, first row).
//!
//! The program runs in the session's workdir, in its own process group, with the host
//! environment (an agent CLI needs its own credentials) plus `MURMUR_CAPSULE_DIR`; past
//! `inference.timeout_secs` the whole group is killed and the call fails.

use super::{Driver, Error, ModelRequest, ModelResponse, StopReason};
use crate::tools::command::resolve_program;
use crate::tools::process::{self, GroupGuard};
use async_trait::async_trait;
use mur_proto::message::Block;
use mur_proto::trace::ProviderUsage;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tokio::process::Command;

/// Bytes of stdout kept as the result.
pub const RESULT_LIMIT: usize = 4 * 1024 * 1024;

/// Settings of the process transport.
#[derive(Clone, Debug)]
pub struct Config {
    /// `inference.command`: the program and its arguments.
    pub command: Vec<String>,
    /// The capsule folder: a program path containing `/` resolves here.
    pub capsule_dir: PathBuf,
    /// Where the program runs.
    pub workdir: PathBuf,
    /// `inference.timeout_secs`.
    pub timeout: Duration,
}

/// The process transport as a driver.
pub struct ProcessAgent {
    config: Config,
}

impl ProcessAgent {
    /// A driver running `config.command`.
    pub fn new(config: Config) -> Self {
        ProcessAgent { config }
    }
}

#[async_trait]
impl Driver for ProcessAgent {
    fn kind(&self) -> &'static str {
        "process"
    }

    /// Runs the program once with the task on stdin.
    ///
    /// # Errors
    /// [`Error::Process`] when it cannot start, exits non-zero (with the end of its
    /// stderr) or runs past the timeout.
    async fn call(&self, request: &ModelRequest<'_>) -> Result<ModelResponse, Error> {
        let cfg = &self.config;
        let (program, args) =
            cfg.command.split_first().ok_or_else(|| Error::Process("inference.command is empty".into()))?;
        let path = resolve_program(program, &cfg.capsule_dir).map_err(|e| Error::Process(format!("{program}: {e}")))?;
        let mut command = Command::new(&path);
        command
            .args(args)
            .current_dir(&cfg.workdir)
            .env("MURMUR_CAPSULE_DIR", &cfg.capsule_dir)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let (mut child, mut guard) = GroupGuard::spawn(&mut command)
            .map_err(|e| Error::Process(format!("cannot start {}: {e}", path.display())))?;
        let pgid = child.id();
        let mut stdin = child.stdin.take().expect("stdin is piped");
        let task = request.task_text.as_bytes().to_vec();
        let feed = async move {
            let _ = stdin.write_all(&task).await;
            drop(stdin);
        };
        let out = process::capture(child.stdout.take().expect("stdout is piped"), RESULT_LIMIT, None);
        let err = process::capture(child.stderr.take().expect("stderr is piped"), 2048, None);
        let finished = tokio::time::timeout(cfg.timeout, async {
            let ((), status, out, err) = tokio::join!(feed, child.wait(), out, err);
            (status, out, err)
        })
        .await;
        let Ok((status, out, err)) = finished else {
            if let Some(pgid) = pgid {
                let _ = process::kill_group(pgid);
            }
            guard.disarm();
            let _ = child.wait().await;
            return Err(Error::Process(format!(
                "agent program timed out after {} s and was killed",
                cfg.timeout.as_secs()
            )));
        };
        guard.disarm();
        let status = status.map_err(|e| Error::Process(format!("waiting for the agent program: {e}")))?;
        let code = process::exit_code(status);
        if code != 0 {
            let stderr = err.kept_text();
            return Err(Error::Process(format!("agent program exited with code {code}: {}", stderr.trim_end())));
        }
        let text = out.kept_text();
        Ok(ModelResponse {
            content: if text.is_empty() { Vec::new() } else { vec![Block::Text { text }] },
            stop: StopReason::EndTurn,
            usage: ProviderUsage::default(),
        })
    }
}
