//! The built-in shell tools: one tool per binary in `capabilities.shell.allow`, named after
//! the binary, taking `{"command": "..."}` (the runtime reference, §5, "Shell
//! tools"). Interpreters (sh, bash, zsh, fish, dash, ksh) get `-c <command>`; other
//! binaries get the command split into arguments with shell-word rules. A non-zero exit is
//! a successful call whose text reports the code. Each stream is cut at 16 KiB in the
//! result, with the full output in a log file under the workdir and its path in the text.
//!
//! A command runs in the workdir with stdin closed, `HOME` set to `<workdir>/.capsule-home`,
//! in its own process group (so the whole group can be signalled). Both streams are read
//! while the command runs, keeping only their heads in memory; a stream that outgrows
//! [`STREAM_LIMIT`] is spilled to a file next to the log and folded into the log at the end.
//!
//! With a grace period ([`Shell::with_detach`], `lifecycle.shell_grace_secs`), a command
//! still running when it is up moves to the background (the session-loop seed, §Detached
//! shell): the call returns at once a result of constant size naming its `wrk_` handle, its
//! output goes to `logs/<work_id>.log`, and its end is reported through the
//! [`DetachSink`] (see [`super::background`]).

use super::background::{self, DetachSink, Foreground, Handover, Journal};
use super::process::{self, Capture, Captured, GroupGuard, Spill};
use super::{CallContext, DetachedWork, Outcome, ShellRun};
use crate::driver::ToolSpec;
use crate::session::detach::cut;
use mur_proto::ids::{Id, IdKind};
use serde_json::{Value, json};
use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::io;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::io::AsyncWriteExt;
use tokio::process::{Child, ChildStderr, ChildStdout, Command};

/// Bytes of each stream kept in the tool result (16 KiB); the rest goes to the log file.
pub const STREAM_LIMIT: usize = 16 * 1024;

/// Binaries that take the command as one script (`-c <command>`) rather than as split
/// arguments (the runtime reference, §5).
pub const INTERPRETERS: [&str; 6] = ["sh", "bash", "zsh", "fish", "dash", "ksh"];

/// The folder under the workdir that commands get as `HOME`.
pub const HOME_DIR: &str = ".capsule-home";

/// Characters of the command repeated in a demoted call's result.
pub const DETACHED_COMMAND_CHARS: usize = 200;

/// The shell tools of one capsule.
pub struct Shell {
    allow: Vec<String>,
    detach: Option<(Duration, DetachSink)>,
}

impl Shell {
    /// Tools for the binaries in `allow`; commands are waited for to their end.
    pub fn new(allow: Vec<String>) -> Self {
        Shell { allow, detach: None }
    }

    /// Moves a command still running after `grace` to the background and reports it to
    /// `sink` (the session-loop seed, §Detached shell; zero demotes at the first check
    /// unless the command has already exited).
    pub fn with_detach(mut self, grace: Duration, sink: DetachSink) -> Self {
        self.detach = Some((grace, sink));
        self
    }

    /// Whether `binary` is allowed (and so is a tool name).
    pub fn allows(&self, binary: &str) -> bool {
        self.allow.iter().any(|b| b == binary)
    }

    /// One spec per allowed binary.
    pub fn specs(&self) -> Vec<ToolSpec> {
        self.allow
            .iter()
            .map(|b| ToolSpec {
                name: b.clone(),
                description: format!("Run {b}. Input: {{\"command\": \"...\"}}."),
                parameters: json!({
                    "type": "object",
                    "properties": {"command": {"type": "string"}},
                    "required": ["command"]
                }),
            })
            .collect()
    }

    /// Runs `binary` with `input.command` and waits for it to finish, or, with a grace
    /// period, until the grace period is up.
    ///
    /// The text is `$ <command>\nExit code: <n>\nStdout:\n<stdout>\nStderr:\n<stderr>`; a
    /// non-zero exit is still a successful call. A demoted command's text is
    /// `still running in the background as wrk_… (<binary>: <command, cut to 200
    /// characters>); its output goes to logs/wrk_….log; you will get a completion task when
    /// it ends`, with [`Outcome::detached`] set and no [`ShellRun`]. Errors (an [`Outcome`]
    /// with `is_error`, and no [`ShellRun`]): `command` missing or not a string, a command
    /// that does not split into words, a binary that cannot be started. The caller checks `binary` against the
    /// allow-list ([`Shell::allows`]); this method does not.
    pub async fn run(&self, binary: &str, input: &Value, ctx: &CallContext) -> Outcome {
        let command = match input.get("command") {
            Some(Value::String(c)) => c.clone(),
            Some(other) => {
                return Outcome::error(format!("input field \"command\" must be a string, got {other}"));
            }
            None => return Outcome::error("missing input field \"command\" (a string)"),
        };
        let args = match arguments(binary, &command) {
            Ok(args) => args,
            Err(e) => {
                return Outcome::error(format!("cannot split the command into arguments for {binary}: {e}"));
            }
        };
        let resolved = super::which(binary);
        let home = ctx.workdir.join(HOME_DIR);
        if let Err(e) = tokio::fs::create_dir_all(&home).await {
            return Outcome::error(format!("cannot create {}: {e}", home.display()));
        }

        let mark = process::reap_mark();
        let mut program = Command::new(resolved.as_deref().unwrap_or(Path::new(binary)));
        program
            .args(&args)
            .current_dir(&ctx.workdir)
            .env("HOME", &home)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if let Some(key) = &ctx.tool_call_id {
            program.env(mur_proto::cluster::TOOL_CALL_ID_VAR, key);
        }
        // Timed from before the spawn: on a loaded machine the child can run for a while before
        // the spawn returns, and a duration taken after it came out short of the command's own
        // (a `sleep 3` measured 2,991 ms).
        let started = Instant::now();
        let (mut child, mut guard) = match GroupGuard::spawn_marked(&mut program, &mark, ctx.sandbox.as_deref()) {
            Ok(spawned) => spawned,
            Err(e) => return Outcome::error(format!("cannot start {binary}: {e}")),
        };
        let shown_binary = resolved.map_or_else(|| binary.to_string(), |p| p.display().to_string());

        let stem = log_stem();
        let stdout = child.stdout.take().expect("stdout is piped");
        let stderr = child.stderr.take().expect("stderr is piped");
        let (status, out, err) = match wait(&mut child, stdout, stderr, &stem, ctx, self.detach.as_ref()).await {
            Waited::Exited(status, out, err) => (status, out, err),
            Waited::Demoted { work_id, log, handover, out, err } => {
                let (grace, sink) = self.detach.as_ref().expect("only a grace period demotes");
                let work = DetachedWork {
                    work_id,
                    binary: shown_binary,
                    command,
                    grace_ms: grace.as_millis() as u64,
                    running_ms: started.elapsed().as_millis() as u64,
                    output_path: shown_path(ctx, &log),
                };
                // The guard stays armed until the sink holds the group: a run dropped before
                // that still kills its command; from here on nothing kills it on drop.
                let log_error = sink.adopt(child, handover, started, &work, mark).await;
                guard.disarm();
                remove_parts(&out, &err).await;
                let mut outcome = demoted(binary, work, log_error);
                outcome.sandbox = ctx.sandbox.as_ref().map(|s| s.applied().clone());
                return outcome;
            }
        };
        guard.disarm();
        let exit_code = match status {
            Ok(status) => process::exit_code(status),
            Err(e) => {
                remove_parts(&out, &err).await;
                return Outcome::error(format!("waiting for {binary} failed: {e}"));
            }
        };

        let log = if out.truncated() || err.truncated() {
            let path = ctx.logs_dir.join(format!("{stem}.log"));
            Some(write_log(&path, &command, exit_code, &out, &err).await)
        } else {
            None
        };
        remove_parts(&out, &err).await;

        let mut text = format!("$ {command}\nExit code: {exit_code}\nStdout:\n");
        push_stream(&mut text, &out, log.as_ref());
        text.push_str("\nStderr:\n");
        push_stream(&mut text, &err, log.as_ref());
        Outcome {
            text,
            is_error: false,
            shell: Some(ShellRun {
                binary: shown_binary,
                command,
                exit_code,
                stdout_bytes: out.total,
                stderr_bytes: err.total,
            }),
            detached: None,
            sandbox: ctx.sandbox.as_ref().map(|s| s.applied().clone()),
            mcp_server: None,
        }
    }
}

/// The arguments `binary` gets for `command`: `-c <command>` for an interpreter, else the
/// command split with shell-word rules (quotes and backslashes, no expansion).
///
/// # Errors
/// A command that does not split (an unterminated quote, a trailing backslash).
fn arguments(binary: &str, command: &str) -> Result<Vec<String>, shell_words::ParseError> {
    if INTERPRETERS.contains(&binary) {
        Ok(vec!["-c".to_string(), command.to_string()])
    } else {
        shell_words::split(command)
    }
}

/// How [`wait`] ended.
enum Waited {
    /// The command exited and both streams ended.
    Exited(io::Result<ExitStatus>, Captured, Captured),
    /// The grace period was up with the command still running.
    Demoted {
        /// Its `wrk_` id.
        work_id: String,
        /// Its log, `<logs_dir>/<work_id>.log`.
        log: PathBuf,
        /// Its streams and what was read of them, for the background.
        handover: Box<Handover>,
        /// stdout as far as it was read (its spill file is to be removed).
        out: Captured,
        /// stderr as far as it was read.
        err: Captured,
    },
}

/// Waits for the command to exit and for both its streams to reach their end, reading them
/// concurrently. This is the one place a run waits on its child: with a grace period
/// (`detach`), only until it is up ([`background::foreground`]). A stream that outgrows
/// [`STREAM_LIMIT`] spills to `<logs_dir>/<stem>.<stream>.part`.
async fn wait(
    child: &mut Child,
    stdout: ChildStdout,
    stderr: ChildStderr,
    stem: &str,
    ctx: &CallContext,
    detach: Option<&(Duration, DetachSink)>,
) -> Waited {
    let part = |stream: &str| Some(ctx.logs_dir.join(format!("{stem}.{stream}.part")));
    let Some((grace, _)) = detach else {
        let (status, out, err) = tokio::join!(
            child.wait(),
            process::capture(stdout, STREAM_LIMIT, part("stdout")),
            process::capture(stderr, STREAM_LIMIT, part("stderr")),
        );
        return Waited::Exited(status, out, err);
    };
    let work_id = Id::generate(IdKind::Work);
    let log = ctx.logs_dir.join(format!("{work_id}.log"));
    let out = Capture::new(STREAM_LIMIT, part("stdout"));
    let err = Capture::new(STREAM_LIMIT, part("stderr"));
    match background::foreground(child, stdout, stderr, *grace, out, err, Journal::new(log.clone())).await {
        Foreground::Exited { status, out, err } => Waited::Exited(status, out, err),
        Foreground::Demoted { handover, out, err } => Waited::Demoted { work_id, log, handover, out, err },
    }
}

/// The result of a demoted call: constant in size whatever the command prints.
fn demoted(binary: &str, work: DetachedWork, log_error: Option<String>) -> Outcome {
    let command = cut(&work.command, DETACHED_COMMAND_CHARS);
    let output = match log_error {
        None => format!("its output goes to {}", work.output_path),
        Some(e) => format!("its output cannot be saved ({e})"),
    };
    Outcome {
        text: format!(
            "still running in the background as {} ({binary}: {command}); {output}; you will get a \
             completion task when it ends",
            work.work_id
        ),
        is_error: false,
        shell: None,
        detached: Some(work),
        sandbox: None,
        mcp_server: None,
    }
}

/// `path` relative to the workdir when it lies under it (`logs/wrk_….log`), else as is.
fn shown_path(ctx: &CallContext, path: &Path) -> String {
    path.strip_prefix(&ctx.workdir).unwrap_or(path).display().to_string()
}

/// A fresh log name, `shell-<unix-ms>-<6 hex digits>`: the digits hash the pid, a
/// per-process counter and a random seed.
fn log_stem() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let ms = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis());
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let h = RandomState::new().hash_one((std::process::id(), n));
    format!("shell-{ms}-{:06x}", h & 0xff_ffff)
}

/// Writes the whole run to `path` (a new file): the command, its exit code, then each
/// stream under a `--- stdout (<n> bytes) ---` label. A spilled stream is copied from its
/// spill file, a short one from memory.
///
/// # Errors
/// A message naming the file that could not be written (the log or a stream's spill).
async fn write_log(
    path: &Path,
    command: &str,
    exit_code: i32,
    out: &Captured,
    err: &Captured,
) -> Result<PathBuf, String> {
    let fail = |p: &Path, e: io::Error| format!("{}: {e}", p.display());
    let mut file = process::create_new(path).await.map_err(|e| fail(path, e))?;
    let header = format!("$ {command}\nExit code: {exit_code}\n");
    file.write_all(header.as_bytes()).await.map_err(|e| fail(path, e))?;
    for (name, c) in [("stdout", out), ("stderr", err)] {
        let label = format!("--- {name} ({} bytes) ---\n", c.total);
        file.write_all(label.as_bytes()).await.map_err(|e| fail(path, e))?;
        let ends_with_newline = match &c.spill {
            Spill::File(part) => {
                let mut src = tokio::fs::File::open(part).await.map_err(|e| fail(part, e))?;
                tokio::io::copy(&mut src, &mut file).await.map_err(|e| fail(path, e))?;
                last_byte(part).await == Some(b'\n')
            }
            Spill::Failed(message) => return Err(message.clone()),
            Spill::None => {
                file.write_all(c.head()).await.map_err(|e| fail(path, e))?;
                c.head().last() == Some(&b'\n')
            }
        };
        if c.total > 0 && !ends_with_newline {
            file.write_all(b"\n").await.map_err(|e| fail(path, e))?;
        }
    }
    file.flush().await.map_err(|e| fail(path, e))?;
    Ok(path.to_path_buf())
}

async fn last_byte(path: &Path) -> Option<u8> {
    use tokio::io::{AsyncReadExt, AsyncSeekExt, SeekFrom};
    let mut f = tokio::fs::File::open(path).await.ok()?;
    f.seek(SeekFrom::End(-1)).await.ok()?;
    let mut b = [0u8; 1];
    f.read_exact(&mut b).await.ok()?;
    Some(b[0])
}

/// Removes the streams' spill files (their content is in the log by now, or lost).
async fn remove_parts(out: &Captured, err: &Captured) {
    for c in [out, err] {
        if let Spill::File(part) = &c.spill
            && let Err(e) = tokio::fs::remove_file(part).await
        {
            tracing::warn!(path = %part.display(), error = %e, "cannot remove a shell spill file");
        }
    }
}

/// Appends a stream's kept text and, when it was cut, the line
/// `[truncated: <total> bytes; full output in <path>]`.
fn push_stream(text: &mut String, c: &Captured, log: Option<&Result<PathBuf, String>>) {
    text.push_str(&c.kept_text());
    if !c.truncated() {
        return;
    }
    if !text.ends_with('\n') {
        text.push('\n');
    }
    match log {
        Some(Ok(path)) => text.push_str(&format!("[truncated: {} bytes; full output in {}]", c.total, path.display())),
        Some(Err(e)) => text.push_str(&format!("[truncated: {} bytes; full output not saved: {e}]", c.total)),
        None => text.push_str(&format!("[truncated: {} bytes]", c.total)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn context(dir: &Path) -> CallContext {
        let workdir = dir.join("workdir");
        std::fs::create_dir_all(&workdir).unwrap();
        CallContext {
            capsule_dir: dir.join("capsule"),
            logs_dir: workdir.join("logs"),
            workdir,
            sandbox: None,
            tool_call_id: None,
        }
    }

    async fn run(binary: &str, command: &str, ctx: &CallContext) -> Outcome {
        Shell::new(vec![binary.to_string()]).run(binary, &json!({ "command": command }), ctx).await
    }

    /// The path in a `[truncated: …; full output in <path>]` line.
    fn log_path(text: &str) -> PathBuf {
        let start = text.find("full output in ").expect("a log path") + "full output in ".len();
        let end = start + text[start..].find(']').unwrap();
        PathBuf::from(&text[start..end])
    }

    #[tokio::test]
    async fn echo_via_sh_reports_stdout_and_exit_code() {
        let dir = tempfile::tempdir().unwrap();
        let ctx = context(dir.path());
        let out = run("sh", "echo hello", &ctx).await;
        assert!(!out.is_error, "{}", out.text);
        assert_eq!(out.text, "$ echo hello\nExit code: 0\nStdout:\nhello\n\nStderr:\n");
        let shell = out.shell.unwrap();
        assert!(Path::new(&shell.binary).is_absolute(), "{}", shell.binary);
        assert!(shell.binary.ends_with("/sh"), "{}", shell.binary);
        assert_eq!(shell.command, "echo hello");
        assert_eq!(shell.exit_code, 0);
        assert_eq!((shell.stdout_bytes, shell.stderr_bytes), (6, 0));
    }

    #[tokio::test]
    async fn a_shell_command_gets_the_calls_idempotency_key() {
        let dir = tempfile::tempdir().unwrap();
        let mut ctx = context(dir.path());
        ctx.tool_call_id = Some("tsk_1.0.3".into());
        let out = run("sh", "printf %s \"$MUR_TOOL_CALL_ID\"", &ctx).await;
        assert_eq!(out.text, "$ printf %s \"$MUR_TOOL_CALL_ID\"\nExit code: 0\nStdout:\ntsk_1.0.3\nStderr:\n");
    }

    #[tokio::test]
    async fn non_zero_exit_is_a_successful_call_reporting_the_code() {
        let dir = tempfile::tempdir().unwrap();
        let ctx = context(dir.path());
        let out = run("sh", "echo partial; exit 3", &ctx).await;
        assert!(!out.is_error);
        assert_eq!(out.text, "$ echo partial; exit 3\nExit code: 3\nStdout:\npartial\n\nStderr:\n");
        assert_eq!(out.shell.unwrap().exit_code, 3);
    }

    #[tokio::test]
    async fn a_command_killed_by_a_signal_exits_with_128_plus_the_signal() {
        let dir = tempfile::tempdir().unwrap();
        let ctx = context(dir.path());
        let out = run("sh", "kill -9 $$", &ctx).await;
        assert!(!out.is_error);
        assert!(out.text.contains("Exit code: 137\n"), "{}", out.text);
        assert_eq!(out.shell.unwrap().exit_code, 137);
    }

    #[tokio::test]
    async fn stderr_is_captured() {
        let dir = tempfile::tempdir().unwrap();
        let ctx = context(dir.path());
        let out = run("sh", "echo out; echo oops >&2", &ctx).await;
        assert_eq!(out.text, "$ echo out; echo oops >&2\nExit code: 0\nStdout:\nout\n\nStderr:\noops\n");
        assert_eq!(out.shell.unwrap().stderr_bytes, 5);
    }

    #[tokio::test]
    async fn a_non_interpreter_binary_gets_shell_word_splitting() {
        let dir = tempfile::tempdir().unwrap();
        let ctx = context(dir.path());
        let out = run("printf", r#"'%s|' 'a b' "c d" e\ f $HOME"#, &ctx).await;
        assert!(!out.is_error, "{}", out.text);
        // Quotes group words; nothing is expanded (no shell in between).
        assert!(out.text.contains("Stdout:\na b|c d|e f|$HOME|\nStderr:\n"), "{}", out.text);
        assert!(out.shell.unwrap().binary.ends_with("/printf"));
    }

    #[tokio::test]
    async fn a_command_that_does_not_split_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let ctx = context(dir.path());
        let out = run("printf", "'unterminated", &ctx).await;
        assert!(out.is_error);
        assert!(out.text.contains("cannot split"), "{}", out.text);
        assert_eq!(out.shell, None);
    }

    #[tokio::test]
    async fn a_missing_or_non_string_command_is_an_error_naming_the_field() {
        let dir = tempfile::tempdir().unwrap();
        let ctx = context(dir.path());
        let shell = Shell::new(vec!["sh".into()]);
        for input in [json!({}), json!({"command": 5}), json!({"cmd": "ls"})] {
            let out = shell.run("sh", &input, &ctx).await;
            assert!(out.is_error, "{input}");
            assert!(out.text.contains("\"command\""), "{}", out.text);
            assert_eq!(out.shell, None);
        }
    }

    #[tokio::test]
    async fn an_unknown_binary_is_an_error_with_the_os_reason() {
        let dir = tempfile::tempdir().unwrap();
        let ctx = context(dir.path());
        let out = run("no-such-binary-murmur", "--help", &ctx).await;
        assert!(out.is_error);
        assert!(out.text.starts_with("cannot start no-such-binary-murmur: "), "{}", out.text);
        assert!(out.text.contains("No such file"), "{}", out.text);
        assert_eq!(out.shell, None);
    }

    #[tokio::test]
    async fn commands_run_in_the_workdir_with_the_capsule_home_in_their_own_group() {
        let dir = tempfile::tempdir().unwrap();
        let ctx = context(dir.path());
        let out = run("sh", r#"pwd -P; echo "$HOME"; echo $$; cut -d' ' -f5 /proc/$$/stat"#, &ctx).await;
        let stdout = out.text.split("Stdout:\n").nth(1).unwrap();
        let lines: Vec<&str> = stdout.lines().collect();
        let workdir = ctx.workdir.canonicalize().unwrap();
        assert_eq!(lines[0], workdir.to_str().unwrap());
        assert_eq!(lines[1], ctx.workdir.join(HOME_DIR).to_str().unwrap());
        assert!(ctx.workdir.join(HOME_DIR).is_dir());
        assert_eq!(lines[2], lines[3], "the command leads its own process group");
    }

    #[tokio::test]
    async fn stdin_is_closed() {
        let dir = tempfile::tempdir().unwrap();
        let ctx = context(dir.path());
        let out = run("sh", "cat; echo done", &ctx).await;
        assert!(out.text.contains("Stdout:\ndone\n"), "{}", out.text);
    }

    #[tokio::test]
    async fn a_long_stream_is_cut_at_16_kib_on_a_char_boundary_with_the_full_output_logged() {
        let dir = tempfile::tempdir().unwrap();
        let ctx = context(dir.path());
        // "ab" then three-byte characters: byte 16384 falls inside one of them.
        let big = format!("ab{}", "€".repeat(6000));
        assert!(!big.is_char_boundary(STREAM_LIMIT));
        std::fs::write(ctx.workdir.join("big.txt"), &big).unwrap();
        let out = run("sh", "cat big.txt; echo small >&2", &ctx).await;
        assert!(!out.is_error, "{}", out.text);

        let kept = format!("ab{}", "€".repeat(5460));
        assert_eq!(kept.len(), STREAM_LIMIT - 2);
        let path = log_path(&out.text);
        assert_eq!(
            out.text,
            format!(
                "$ cat big.txt; echo small >&2\nExit code: 0\nStdout:\n{kept}\n\
                 [truncated: {} bytes; full output in {}]\nStderr:\nsmall\n",
                big.len(),
                path.display()
            )
        );
        assert!(path.starts_with(&ctx.logs_dir));
        let name = path.file_name().unwrap().to_str().unwrap();
        assert!(name.starts_with("shell-") && name.ends_with(".log"), "{name}");
        let log = std::fs::read_to_string(&path).unwrap();
        assert_eq!(
            log,
            format!(
                "$ cat big.txt; echo small >&2\nExit code: 0\n--- stdout ({} bytes) ---\n{big}\n\
                 --- stderr (6 bytes) ---\nsmall\n",
                big.len()
            )
        );
        let shell = out.shell.unwrap();
        assert_eq!(shell.stdout_bytes, big.len() as u64);
        assert_eq!(shell.stderr_bytes, 6);
        // Only the log is left behind, no spill files.
        let files: Vec<_> = std::fs::read_dir(&ctx.logs_dir).unwrap().collect();
        assert_eq!(files.len(), 1);
    }

    #[tokio::test]
    async fn output_that_fits_writes_no_log() {
        let dir = tempfile::tempdir().unwrap();
        let ctx = context(dir.path());
        let out = run("sh", &format!("head -c {STREAM_LIMIT} /dev/zero"), &ctx).await;
        assert!(!out.text.contains("[truncated"));
        assert_eq!(out.shell.unwrap().stdout_bytes, STREAM_LIMIT as u64);
        assert!(!ctx.logs_dir.exists());
    }

    #[tokio::test]
    async fn a_mebibyte_on_each_stream_does_not_deadlock() {
        let dir = tempfile::tempdir().unwrap();
        let ctx = context(dir.path());
        // stderr first: a reader that drained stdout to its end first would wait forever.
        let command = "head -c 1048576 /dev/zero | tr '\\0' e >&2; head -c 1048576 /dev/zero | tr '\\0' o";
        let out = tokio::time::timeout(Duration::from_secs(60), run("sh", command, &ctx))
            .await
            .expect("the command finishes");
        assert!(!out.is_error, "{}", out.text);
        let shell = out.shell.unwrap();
        assert_eq!((shell.stdout_bytes, shell.stderr_bytes), (1 << 20, 1 << 20));
        assert_eq!(out.text.matches("[truncated: 1048576 bytes; full output in ").count(), 2);
        let log = std::fs::read_to_string(log_path(&out.text)).unwrap();
        let o = "o".repeat(1 << 20);
        let e = "e".repeat(1 << 20);
        assert_eq!(
            log,
            format!(
                "$ {command}\nExit code: 0\n--- stdout (1048576 bytes) ---\n{o}\n\
                 --- stderr (1048576 bytes) ---\n{e}\n"
            )
        );
    }

    mod detached {
        use super::*;
        use crate::session::detach::{Detached, Work};
        use crate::tools::background::DetachNotice;
        use mur_proto::trace::CallStatus;
        use tokio::sync::mpsc::UnboundedReceiver;

        const PATIENCE: Duration = Duration::from_secs(20);

        fn detaching(grace: Duration) -> (Shell, DetachSink, UnboundedReceiver<DetachNotice>) {
            let (sink, rx) = DetachSink::channel();
            (Shell::new(vec!["sh".into()]).with_detach(grace, sink.clone()), sink, rx)
        }

        async fn sh(shell: &Shell, command: &str, ctx: &CallContext) -> Outcome {
            shell.run("sh", &json!({ "command": command }), ctx).await
        }

        async fn next(rx: &mut UnboundedReceiver<DetachNotice>) -> DetachNotice {
            tokio::time::timeout(PATIENCE, rx.recv()).await.expect("a notice in time").expect("the sink is open")
        }

        /// The `Completed` notice of `work_id`, skipping others; (exit code, duration, path, bytes).
        async fn completion(rx: &mut UnboundedReceiver<DetachNotice>, work_id: &str) -> (i32, u64, String, u64) {
            loop {
                if let DetachNotice::Completed { work_id: id, exit_code, duration_ms, output_path, output_bytes } =
                    next(rx).await
                    && id == work_id
                {
                    return (exit_code, duration_ms, output_path, output_bytes);
                }
            }
        }

        /// Pids of the processes in group `pgid`, with their state letter.
        fn group(pgid: u32) -> Vec<(u32, char)> {
            let mut found = Vec::new();
            for entry in std::fs::read_dir("/proc").unwrap().flatten() {
                let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
                let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { continue };
                let Some((_, rest)) = stat.rsplit_once(") ") else { continue };
                let fields: Vec<&str> = rest.split(' ').collect();
                if fields.get(2).and_then(|g| g.parse::<u32>().ok()) == Some(pgid) {
                    found.push((pid, fields[0].chars().next().unwrap_or('?')));
                }
            }
            found
        }

        async fn until(what: &str, mut done: impl FnMut() -> bool) {
            let end = std::time::Instant::now() + PATIENCE;
            while !done() {
                assert!(std::time::Instant::now() < end, "timed out waiting until {what}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }

        fn detached(out: &Outcome) -> &DetachedWork {
            out.detached.as_ref().unwrap_or_else(|| panic!("not detached: {}", out.text))
        }

        #[tokio::test]
        async fn a_command_outliving_the_grace_period_returns_a_handle_and_completes_later_with_its_full_log() {
            let dir = tempfile::tempdir().unwrap();
            let ctx = context(dir.path());
            let (shell, _sink, mut rx) = detaching(Duration::from_secs(1));
            let started = std::time::Instant::now();
            let out = sh(&shell, "echo before; sleep 3; echo after >&2", &ctx).await;
            let elapsed = started.elapsed();
            // Not before the grace period; and the command was still running when the
            // tool returned (its end has not been reported), however loaded the machine.
            assert!(elapsed >= Duration::from_secs(1), "{elapsed:?}");
            let first = rx.try_recv().expect("the demotion is reported before the tool returns");
            assert!(rx.try_recv().is_err(), "no completion before the command ends");

            assert!(!out.is_error);
            assert_eq!(out.shell, None);
            let work = detached(&out).clone();
            assert!(Id::is_valid(IdKind::Work, &work.work_id), "{}", work.work_id);
            assert_eq!(work.output_path, format!("logs/{}.log", work.work_id));
            assert!(work.binary.ends_with("/sh"), "{}", work.binary);
            assert_eq!((work.command.as_str(), work.grace_ms), ("echo before; sleep 3; echo after >&2", 1000));
            assert_eq!(
                out.text,
                format!(
                    "still running in the background as {id} (sh: echo before; sleep 3; echo after >&2); its output \
                     goes to logs/{id}.log; you will get a completion task when it ends",
                    id = work.work_id
                )
            );
            assert!(!out.text.contains("before\n"), "the turn never sees the output");

            assert_eq!(first, DetachNotice::Detached(work.clone()));
            let (exit_code, duration_ms, output_path, output_bytes) = completion(&mut rx, &work.work_id).await;
            assert_eq!((exit_code, output_path.as_str(), output_bytes), (0, work.output_path.as_str(), 13));
            assert!(duration_ms >= 3000, "{duration_ms}");
            let log = std::fs::read_to_string(ctx.workdir.join(&work.output_path)).unwrap();
            assert_eq!(log, "before\nafter\n");
            // Only the log is left: no spill or journal files besides it.
            let files: Vec<_> = std::fs::read_dir(&ctx.logs_dir).unwrap().collect();
            assert_eq!(files.len(), 1);
        }

        #[tokio::test]
        async fn a_command_ending_within_the_grace_period_returns_its_output_as_without_one() {
            let dir = tempfile::tempdir().unwrap();
            let ctx = context(dir.path());
            let (shell, _sink, mut rx) = detaching(Duration::from_secs(10));
            let out = sh(&shell, "echo hello; echo oops >&2; exit 2", &ctx).await;
            assert_eq!(
                out.text,
                "$ echo hello; echo oops >&2; exit 2\nExit code: 2\nStdout:\nhello\n\nStderr:\noops\n"
            );
            assert_eq!(out.detached, None);
            assert_eq!(out.shell.unwrap().exit_code, 2);
            assert!(rx.try_recv().is_err(), "no notice");
            assert!(!ctx.logs_dir.exists(), "no log");
        }

        #[tokio::test]
        async fn a_long_foreground_output_is_logged_even_when_the_journal_spilled() {
            let dir = tempfile::tempdir().unwrap();
            let ctx = context(dir.path());
            let (shell, _sink, _rx) = detaching(Duration::from_secs(30));
            let out = sh(&shell, "head -c 200000 /dev/zero | tr '\\0' a", &ctx).await;
            assert_eq!(out.detached, None);
            assert_eq!(out.shell.unwrap().stdout_bytes, 200_000);
            let log = std::fs::read_to_string(log_path(&out.text)).unwrap();
            assert!(log.contains(&"a".repeat(200_000)));
            // The truncation log only: the journal of the finished command was removed.
            let files: Vec<_> = std::fs::read_dir(&ctx.logs_dir).unwrap().collect();
            assert_eq!(files.len(), 1);
        }

        #[tokio::test]
        async fn grace_zero_demotes_a_running_command_at_once() {
            let dir = tempfile::tempdir().unwrap();
            let ctx = context(dir.path());
            let (shell, sink, mut rx) = detaching(Duration::ZERO);
            let started = std::time::Instant::now();
            let out = sh(&shell, "sleep 30", &ctx).await;
            assert!(started.elapsed() < Duration::from_secs(1), "{:?}", started.elapsed());
            let work = detached(&out).clone();
            assert_eq!(work.grace_ms, 0);
            assert_eq!(sink.running(), [work.work_id.as_str()]);
            assert_eq!(sink.kill_all().await, [work.work_id.as_str()]);
            assert_eq!(completion(&mut rx, &work.work_id).await.0, 137);
            assert!(sink.running().is_empty());
        }

        #[tokio::test]
        async fn a_failing_detached_command_completes_with_its_exit_code_and_status_error() {
            let dir = tempfile::tempdir().unwrap();
            let ctx = context(dir.path());
            let (shell, _sink, mut rx) = detaching(Duration::ZERO);
            let out = sh(&shell, "sleep 0.5; echo $((6 * 7)); exit 3", &ctx).await;
            let work = detached(&out).clone();

            let mut registry = Detached::new();
            registry
                .detach(Work {
                    work_id: work.work_id.clone(),
                    binary: work.binary.clone(),
                    command: work.command.clone(),
                    task_id: "tsk_1".into(),
                    context_id: "ctx_1".into(),
                    started_at_ms: 0,
                    detached_at_ms: 0,
                })
                .unwrap();
            let (exit_code, duration_ms, output_path, output_bytes) = completion(&mut rx, &work.work_id).await;
            assert_eq!((exit_code, output_bytes), (3, 3));
            let done = registry.complete(&work.work_id, exit_code, duration_ms, &output_path, output_bytes).unwrap();
            assert_eq!(done.status, CallStatus::Error);
            assert!(done.task.text.contains("status: error\nexit_code: 3\n"), "{}", done.task.text);
            assert!(!done.task.text.lines().any(|l| l.trim() == "42"), "never the output: {}", done.task.text);
        }

        #[tokio::test]
        async fn a_detached_command_killed_by_a_signal_reports_128_plus_the_signal() {
            let dir = tempfile::tempdir().unwrap();
            let ctx = context(dir.path());
            let (shell, sink, mut rx) = detaching(Duration::ZERO);
            let out = sh(&shell, "sleep 30", &ctx).await;
            let work = detached(&out).clone();
            let pgid = sink.pgid(&work.work_id).expect("running");
            process::kill_group(pgid).unwrap();
            assert_eq!(completion(&mut rx, &work.work_id).await.0, 137);
        }

        #[tokio::test]
        async fn two_detached_commands_each_get_their_own_completion() {
            let dir = tempfile::tempdir().unwrap();
            let ctx = context(dir.path());
            let (shell, _sink, mut rx) = detaching(Duration::ZERO);
            let (a, b) = tokio::join!(sh(&shell, "sleep 0.5; echo one", &ctx), sh(&shell, "sleep 0.7; echo two", &ctx));
            let (a, b) = (detached(&a).clone(), detached(&b).clone());
            assert_ne!(a.work_id, b.work_id);
            let mut ended = std::collections::HashMap::new();
            while ended.len() < 2 {
                if let DetachNotice::Completed { work_id, exit_code, output_path, .. } = next(&mut rx).await {
                    assert!(ended.insert(work_id, (exit_code, output_path)).is_none(), "one completion each");
                }
            }
            for (work, text) in [(&a, "one\n"), (&b, "two\n")] {
                let (exit_code, path) = &ended[&work.work_id];
                assert_eq!(*exit_code, 0);
                assert_eq!(std::fs::read_to_string(ctx.workdir.join(path)).unwrap(), text);
            }
        }

        #[tokio::test]
        async fn kill_all_kills_grandchildren_and_leaves_no_zombie() {
            let dir = tempfile::tempdir().unwrap();
            let ctx = context(dir.path());
            let (shell, sink, mut rx) = detaching(Duration::ZERO);
            let out = sh(&shell, "sleep 60 & sleep 60", &ctx).await;
            let work = detached(&out).clone();
            let pgid = sink.pgid(&work.work_id).expect("running");
            until("both sleeps run", || group(pgid).len() >= 2).await;

            assert_eq!(sink.kill_all().await, [work.work_id.as_str()]);
            assert_eq!(completion(&mut rx, &work.work_id).await.0, 137);
            until("the group is gone, zombies included", || group(pgid).is_empty()).await;
        }

        #[tokio::test]
        async fn killing_a_detached_command_kills_what_it_started_outside_its_group() {
            let dir = tempfile::tempdir().unwrap();
            let ctx = context(dir.path());
            let (shell, sink, mut rx) = detaching(Duration::ZERO);
            let out = sh(&shell, "setsid sh -c 'echo $$ > escaped.pid; exec sleep 300' & sleep 300", &ctx).await;
            let work = detached(&out).clone();
            let pid_file = ctx.workdir.join("escaped.pid");
            until("the escaped process writes its pid", || {
                std::fs::read_to_string(&pid_file).is_ok_and(|t| t.ends_with('\n'))
            })
            .await;
            let pid: i32 = std::fs::read_to_string(&pid_file).unwrap().trim().parse().unwrap();
            assert!(process::is_running(pid));
            assert!(sink.kill(&work.work_id).await);
            assert_eq!(completion(&mut rx, &work.work_id).await.0, 137);
            until("the escaped process is gone", || !process::is_running(pid)).await;
        }

        #[tokio::test]
        async fn dropping_everything_does_not_kill_a_detached_command() {
            let dir = tempfile::tempdir().unwrap();
            let ctx = context(dir.path());
            let (shell, sink, rx) = detaching(Duration::ZERO);
            let out = sh(&shell, "sleep 1; echo alive > alive.txt; sleep 60", &ctx).await;
            let work = detached(&out).clone();
            let pgid = sink.pgid(&work.work_id).expect("running");
            drop((shell, sink, rx, out));

            // Still running a second later: it wrote its file after every handle was dropped.
            let alive = ctx.workdir.join("alive.txt");
            until("the command writes alive.txt", || alive.exists()).await;
            assert!(group(pgid).iter().any(|(_, state)| *state != 'Z'));
            process::kill_group(pgid).unwrap();
            until("the group is gone", || group(pgid).is_empty()).await;
        }

        #[tokio::test]
        async fn a_demoted_result_is_constant_in_size_with_the_command_cut_to_200_characters() {
            let dir = tempfile::tempdir().unwrap();
            let ctx = context(dir.path());
            let (shell, sink, _rx) = detaching(Duration::ZERO);
            let command = format!("sleep 30; echo {}", "€".repeat(500));
            let out = sh(&shell, &command, &ctx).await;
            let work = detached(&out).clone();
            assert_eq!(work.command, command, "the trace keeps the whole command");
            let shown: String = command.chars().take(DETACHED_COMMAND_CHARS).collect();
            assert!(out.text.contains(&format!("(sh: {shown}…); its output")), "{}", out.text);
            assert!(out.text.chars().count() < 400, "{}", out.text);
            sink.kill_all().await;
        }
    }
}
