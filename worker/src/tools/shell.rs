//! The built-in shell tools: one tool per binary in `capabilities.shell.allow`, named after
//! the binary, taking `{"command": "..."}` (`reference/murmur-runtime.md` §5, "Shell
//! tools"). Interpreters (sh, bash, zsh, fish, dash, ksh) get `-c <command>`; other
//! binaries get the command split into arguments with shell-word rules. A non-zero exit is
//! a successful call whose text reports the code. Each stream is cut at 16 KiB in the
//! result, with the full output in a log file under the workdir and its path in the text.
//!
//! A command runs in the workdir with stdin closed, `HOME` set to `<workdir>/.capsule-home`,
//! in its own process group (so the whole group can be signalled). Both streams are read
//! while the command runs, keeping only their heads in memory; a stream that outgrows
//! [`STREAM_LIMIT`] is spilled to a file next to the log and folded into the log at the end.

use super::process::{self, Captured, GroupGuard, Spill};
use super::{CallContext, Outcome, ShellRun};
use crate::driver::ToolSpec;
use serde_json::{Value, json};
use std::collections::hash_map::RandomState;
use std::future::Future;
use std::hash::BuildHasher;
use std::io;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};
use tokio::io::AsyncWriteExt;
use tokio::process::{Child, Command};

/// Bytes of each stream kept in the tool result (16 KiB); the rest goes to the log file.
pub const STREAM_LIMIT: usize = 16 * 1024;

/// Binaries that take the command as one script (`-c <command>`) rather than as split
/// arguments (`reference/murmur-runtime.md` §5).
pub const INTERPRETERS: [&str; 6] = ["sh", "bash", "zsh", "fish", "dash", "ksh"];

/// The folder under the workdir that commands get as `HOME`.
pub const HOME_DIR: &str = ".capsule-home";

/// The shell tools of one capsule.
pub struct Shell {
    allow: Vec<String>,
}

impl Shell {
    /// Tools for the binaries in `allow`.
    pub fn new(allow: Vec<String>) -> Self {
        Shell { allow }
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

    /// Runs `binary` with `input.command` and waits for it to finish.
    ///
    /// The text is `$ <command>\nExit code: <n>\nStdout:\n<stdout>\nStderr:\n<stderr>`; a
    /// non-zero exit is still a successful call. Errors (an [`Outcome`] with `is_error`, and
    /// no [`ShellRun`]): `command` missing or not a string, a command that does not split into
    /// words, a binary that cannot be started. The caller checks `binary` against the
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

        let mut child = match Command::new(resolved.as_deref().unwrap_or(Path::new(binary)))
            .args(&args)
            .current_dir(&ctx.workdir)
            .env("HOME", &home)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .spawn()
        {
            Ok(child) => child,
            Err(e) => return Outcome::error(format!("cannot start {binary}: {e}")),
        };
        let mut guard = GroupGuard::new(child.id());

        let stem = log_stem();
        let part = |stream: &str| Some(ctx.logs_dir.join(format!("{stem}.{stream}.part")));
        let stdout = child.stdout.take().expect("stdout is piped");
        let stderr = child.stderr.take().expect("stderr is piped");
        let (status, out, err) = wait(
            &mut child,
            process::capture(stdout, STREAM_LIMIT, part("stdout")),
            process::capture(stderr, STREAM_LIMIT, part("stderr")),
        )
        .await;
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
                binary: resolved.map_or_else(|| binary.to_string(), |p| p.display().to_string()),
                command,
                exit_code,
                stdout_bytes: out.total,
                stderr_bytes: err.total,
            }),
            detached: None,
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

/// Waits for the command to exit and for both its streams to reach their end, reading them
/// concurrently. This is the one place a run waits on its child (a grace period, after which
/// the command would move to the background, belongs here).
async fn wait(
    child: &mut Child,
    stdout: impl Future<Output = Captured>,
    stderr: impl Future<Output = Captured>,
) -> (io::Result<ExitStatus>, Captured, Captured) {
    tokio::join!(child.wait(), stdout, stderr)
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
        CallContext { capsule_dir: dir.join("capsule"), logs_dir: workdir.join("logs"), workdir }
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
}
