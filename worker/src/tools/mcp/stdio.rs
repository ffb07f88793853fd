//! A stdio MCP server's process: started like a command tool (in the folder commands run
//! in, `HOME` as shell commands have it, its own process group tied to the worker's life,
//! confined by the session's sandbox), its stderr kept (the last [`TAIL_LINES`] lines in
//! memory for error messages, all of it in `logs/mcp-<server>.log`), and its end watched.

use super::StartError;
use crate::tools::process::{self, GroupGuard};
use crate::tools::shell::HOME_DIR;
use crate::tools::{CallContext, command, which};
use std::collections::{BTreeMap, VecDeque};
use std::path::Path;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
use tokio::process::{ChildStdin, ChildStdout, Command};
use tokio::sync::watch;
use tokio_util::sync::{CancellationToken, DropGuard};

/// Lines of a server's stderr kept for error messages.
pub const TAIL_LINES: usize = 20;

/// Characters of one stderr line kept for error messages.
const LINE_LIMIT: usize = 400;

/// How long a server that failed to start has to write its last words and exit.
const LAST_WORDS: Duration = Duration::from_secs(1);

/// A running (or ended) stdio server.
pub(super) struct Child {
    transport: Option<(ChildStdout, ChildStdin)>,
    tail: Arc<Mutex<VecDeque<String>>>,
    /// `None` while it runs, then how it ended (`exit code 3`, `killed by signal 9`).
    exit: watch::Receiver<Option<String>>,
    stderr_done: watch::Receiver<bool>,
    /// Dropped or cancelled: its process group is killed.
    kill: CancellationToken,
    _kill_on_drop: DropGuard,
}

impl Child {
    /// Starts `command` for server `server`.
    ///
    /// # Errors
    /// [`StartError::MissingProgram`] when the program is not on this machine;
    /// [`StartError::Failed`] when it cannot be started (or sandboxed).
    pub fn spawn(
        server: &str,
        command: &[String],
        env: &BTreeMap<String, String>,
        ctx: &CallContext,
    ) -> Result<Child, StartError> {
        let failed = |what: String| StartError::Failed { server: server.to_string(), what, stderr: vec![] };
        let missing = || StartError::MissingProgram { server: server.to_string(), program: command[0].clone() };
        let (program, args) = command.split_first().ok_or_else(|| failed("has an empty command".into()))?;
        let program = if program.contains('/') {
            let p = command::resolve_program(program, &ctx.capsule_dir)
                .map_err(|e| failed(format!("cannot resolve {program:?}: {e}")))?;
            if !p.exists() {
                return Err(missing());
            }
            p
        } else {
            which(program).ok_or_else(missing)?
        };
        let home = ctx.workdir.join(HOME_DIR);
        std::fs::create_dir_all(&home).map_err(|e| failed(format!("cannot create {}: {e}", home.display())))?;
        let mark = process::reap_mark();
        let mut cmd = Command::new(&program);
        cmd.args(args)
            .current_dir(&ctx.workdir)
            .env("HOME", &home)
            .envs(env)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let (mut child, guard) = GroupGuard::spawn_marked(&mut cmd, &mark, ctx.sandbox.as_deref())
            .map_err(|e| failed(format!("could not be started ({}): {e}", program.display())))?;
        let stdout = child.stdout.take().expect("stdout is piped");
        let stdin = child.stdin.take().expect("stdin is piped");
        let stderr = child.stderr.take().expect("stderr is piped");

        let tail = Arc::new(Mutex::new(VecDeque::new()));
        let (done_tx, stderr_done) = watch::channel(false);
        let log = ctx.logs_dir.join(format!("mcp-{server}.log"));
        tokio::spawn(keep_stderr(stderr, tail.clone(), log, done_tx));

        let (exit_tx, exit) = watch::channel(None);
        let kill = CancellationToken::new();
        let pgid = child.id();
        tokio::spawn({
            let kill = kill.clone();
            let mut guard = guard;
            async move {
                let status = tokio::select! {
                    status = child.wait() => status,
                    () = kill.cancelled() => {
                        // Kills the group and what left it (the guard's drop), then reaps.
                        drop(guard);
                        let status = child.wait().await;
                        let _ = exit_tx.send(Some(describe(status)));
                        return;
                    }
                };
                // Whatever it started goes with it; its group id is not ours any more.
                if let Some(pgid) = pgid {
                    let _ = process::kill_group(pgid);
                }
                guard.disarm();
                let _ = exit_tx.send(Some(describe(status)));
                process::kill_marked(&mark);
            }
        });
        Ok(Child {
            transport: Some((stdout, stdin)),
            tail,
            exit,
            stderr_done,
            _kill_on_drop: kill.clone().drop_guard(),
            kill,
        })
    }

    /// Its stdout and stdin, for the MCP transport (taken once).
    pub fn take_transport(&mut self) -> (ChildStdout, ChildStdin) {
        self.transport.take().expect("the transport is taken once")
    }

    /// How it ended, if it has.
    pub fn exited(&self) -> Option<String> {
        self.exit.borrow().clone()
    }

    /// How it ended, waiting up to [`LAST_WORDS`] for it to end and for its stderr to be
    /// read to its end (a connection that closed: the process is going); `None` when it
    /// still runs.
    pub async fn ended(&self) -> Option<String> {
        let mut exit = self.exit.clone();
        let _ = tokio::time::timeout(LAST_WORDS, exit.wait_for(Option::is_some)).await;
        let ended = self.exited()?;
        let mut done = self.stderr_done.clone();
        let _ = tokio::time::timeout(LAST_WORDS, done.wait_for(|d| *d)).await;
        Some(ended)
    }

    /// The last lines of its stderr so far, oldest first.
    pub fn stderr_tail(&self) -> Vec<String> {
        self.tail.lock().expect("tail lock").iter().cloned().collect()
    }

    /// For a server that failed to start: gives it [`LAST_WORDS`] to exit, kills it if it
    /// has not, and returns the last lines of its stderr once read to its end (or the
    /// deadline passed).
    pub async fn stopped_stderr(&self) -> Vec<String> {
        self.stop(LAST_WORDS).await;
        let mut done = self.stderr_done.clone();
        let _ = tokio::time::timeout(LAST_WORDS, done.wait_for(|d| *d)).await;
        self.stderr_tail()
    }

    /// Waits up to `grace` for it to exit (its stdin closed), then kills its process group
    /// and waits for it to be reaped.
    pub async fn stop(&self, grace: Duration) {
        let mut exit = self.exit.clone();
        if tokio::time::timeout(grace, exit.wait_for(Option::is_some)).await.is_err() {
            self.kill.cancel();
            let _ = exit.wait_for(Option::is_some).await;
        }
    }
}

fn describe(status: std::io::Result<std::process::ExitStatus>) -> String {
    use std::os::unix::process::ExitStatusExt;
    match status {
        Ok(s) => match (s.code(), s.signal()) {
            (Some(code), _) => format!("exit code {code}"),
            (None, Some(sig)) => format!("killed by signal {sig}"),
            _ => "ended".to_string(),
        },
        Err(e) => format!("could not be waited for: {e}"),
    }
}

/// Reads `stderr` by lines to its end: the last [`TAIL_LINES`] in `tail`, every byte in
/// `log` (best effort: a log that cannot be written is skipped, logged).
async fn keep_stderr(
    stderr: tokio::process::ChildStderr,
    tail: Arc<Mutex<VecDeque<String>>>,
    log: std::path::PathBuf,
    done: watch::Sender<bool>,
) {
    let mut file = match open_log(&log).await {
        Ok(f) => Some(f),
        Err(e) => {
            tracing::warn!(path = %log.display(), error = %e, "cannot write an MCP server's stderr log");
            None
        }
    };
    let mut lines = tokio::io::BufReader::new(stderr).split(b'\n');
    while let Ok(Some(line)) = lines.next_segment().await {
        if let Some(f) = &mut file
            && (f.write_all(&line).await.is_err() || f.write_all(b"\n").await.is_err())
        {
            file = None;
        }
        let text: String = String::from_utf8_lossy(&line).trim_end().chars().take(LINE_LIMIT).collect();
        let mut tail = tail.lock().expect("tail lock");
        if tail.len() == TAIL_LINES {
            tail.pop_front();
        }
        tail.push_back(text);
    }
    if let Some(mut f) = file {
        let _ = f.flush().await;
    }
    let _ = done.send(true);
}

async fn open_log(path: &Path) -> std::io::Result<tokio::fs::File> {
    if let Some(dir) = path.parent() {
        tokio::fs::create_dir_all(dir).await?;
    }
    tokio::fs::OpenOptions::new().create(true).append(true).open(path).await
}
