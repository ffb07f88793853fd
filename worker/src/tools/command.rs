//! Tools declared in the manifest's `tools:` as commands: the call's input JSON goes to the
//! command's stdin, its stdout is the result; a non-zero exit is an error result.
//!
//! The program (`command[0]`) is taken relative to the capsule folder when it contains a
//! `/` and is not absolute, else looked up on `PATH`. It runs in the workdir, in its own
//! process group; past `timeout_secs` the whole group is killed and the call fails. Each
//! output stream is cut at [`STREAM_LIMIT`] bytes on a character boundary.

use super::process::{self, Captured, GroupGuard};
use super::shell::STREAM_LIMIT;
use super::{CallContext, Outcome};
use crate::driver::ToolSpec;
use mur_proto::manifest::ToolDecl;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tokio::process::Command;

/// One declared tool.
pub struct CommandTool {
    decl: ToolDecl,
}

impl CommandTool {
    /// The tool for `decl`.
    pub fn new(decl: ToolDecl) -> Self {
        CommandTool { decl }
    }

    /// Its name.
    pub fn name(&self) -> &str {
        &self.decl.name
    }

    /// Its spec for the model.
    pub fn spec(&self) -> ToolSpec {
        ToolSpec {
            name: self.decl.name.clone(),
            description: self.decl.description.clone().unwrap_or_default(),
            parameters: self.decl.parameters.clone(),
        }
    }

    /// Runs the command with `input` on stdin (compact JSON and a newline, then end of
    /// file) and returns its stdout.
    ///
    /// Errors (an [`Outcome`] with `is_error`): a program that cannot be started; a non-zero
    /// exit, as `exit code <n>: <stderr>` (128 + signal when a signal ended it); running past
    /// `timeout_secs`, after which the process group has been killed.
    pub async fn run(&self, input: &Value, ctx: &CallContext) -> Outcome {
        let name = &self.decl.name;
        let Some((program, args)) = self.decl.command.split_first() else {
            return Outcome::error(format!("tool {name:?} has an empty command"));
        };
        let program = match resolve_program(program, &ctx.capsule_dir) {
            Ok(p) => p,
            Err(e) => {
                return Outcome::error(format!("tool {name:?}: cannot resolve {program:?}: {e}"));
            }
        };
        let mark = process::reap_mark();
        let mut command = Command::new(&program);
        command
            .args(args)
            .current_dir(&ctx.workdir)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if let Some(key) = &ctx.tool_call_id {
            command.env(mur_proto::cluster::TOOL_CALL_ID_VAR, key);
        }
        let (mut child, mut guard) = match GroupGuard::spawn_marked(&mut command, &mark, ctx.sandbox.as_deref()) {
            Ok(spawned) => spawned,
            Err(e) => {
                return Outcome::error(format!("tool {name:?}: cannot start {}: {e}", program.display()));
            }
        };
        let pgid = child.id();
        let applied = ctx.sandbox.as_ref().map(|s| s.applied().clone());

        let mut payload = serde_json::to_vec(input).expect("a JSON value serializes");
        payload.push(b'\n');
        let mut stdin = child.stdin.take().expect("stdin is piped");
        let feed = async move {
            // A tool that ignores its input may exit before reading it: a broken pipe is fine.
            if let Err(e) = stdin.write_all(&payload).await {
                tracing::debug!(error = %e, "writing a command tool's input failed");
            }
            drop(stdin);
        };
        let stdout = process::capture(child.stdout.take().expect("stdout is piped"), STREAM_LIMIT, None);
        let stderr = process::capture(child.stderr.take().expect("stderr is piped"), STREAM_LIMIT, None);
        let timeout = Duration::from_secs(self.decl.timeout_secs);
        let finished = tokio::time::timeout(timeout, async {
            let ((), status, out, err) = tokio::join!(feed, child.wait(), stdout, stderr);
            (status, out, err)
        })
        .await;

        let Ok((status, out, err)) = finished else {
            // The tool's own process may have exited already, its output held open by a
            // process it started (`setsid cmd &` leaves its group, and escapes the kill).
            let exited = matches!(child.try_wait(), Ok(Some(_)));
            let escaped = process::kill_marked(&mark);
            let killed = pgid.is_some_and(|pgid| match process::kill_group(pgid) {
                Ok(()) => true,
                Err(e) => {
                    tracing::warn!(pgid, error = %e, "cannot kill a timed-out command tool");
                    false
                }
            });
            guard.disarm();
            let _ = child.wait().await;
            let secs = self.decl.timeout_secs;
            return Outcome::error(match (exited, killed, escaped > 0) {
                (false, ..) => format!("tool {name:?} timed out after {secs} s and was killed"),
                (true, true, _) => format!(
                    "tool {name:?} timed out after {secs} s: it had exited, but a process it started held its \
                     output open; its process group was killed"
                ),
                (true, false, true) => format!(
                    "tool {name:?} timed out after {secs} s: it had exited, but a process it started outside its \
                     process group (setsid) held its output open; it was killed"
                ),
                (true, false, false) => format!(
                    "tool {name:?} timed out after {secs} s: it had exited, but a process it started outside its \
                     process group (setsid) held its output open, and was not killed"
                ),
            });
        };
        guard.disarm();
        let status = match status {
            Ok(status) => status,
            Err(e) => return Outcome::error(format!("tool {name:?}: waiting failed: {e}")),
        };
        if status.success() {
            Outcome {
                text: capped(&out),
                is_error: false,
                shell: None,
                detached: None,
                sandbox: applied,
                mcp_server: None,
            }
        } else {
            let stderr = capped(&err);
            Outcome {
                sandbox: applied,
                ..Outcome::error(format!("exit code {}: {}", process::exit_code(status), stderr.trim_end()))
            }
        }
    }
}

/// The program to start for `program` as written in the manifest: an absolute path as is, a
/// path with a `/` under `capsule_dir` (made absolute, since the child runs elsewhere), a
/// bare name as is (the OS looks it up on `PATH`).
///
/// # Errors
/// The current directory cannot be read while making a relative capsule folder absolute.
pub(crate) fn resolve_program(program: &str, capsule_dir: &Path) -> std::io::Result<PathBuf> {
    let p = Path::new(program);
    if p.is_absolute() || !program.contains('/') {
        Ok(p.to_path_buf())
    } else {
        std::path::absolute(capsule_dir.join(p))
    }
}

/// A stream's kept text, followed by `[truncated: <total> bytes]` on its own line when cut.
fn capped(c: &Captured) -> String {
    let mut text = c.kept_text();
    if c.truncated() {
        if !text.ends_with('\n') {
            text.push('\n');
        }
        text.push_str(&format!("[truncated: {} bytes]", c.total));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::os::unix::fs::PermissionsExt;
    use std::time::Instant;

    fn context(dir: &Path) -> CallContext {
        let ctx = CallContext {
            capsule_dir: dir.join("capsule"),
            workdir: dir.join("workdir"),
            logs_dir: dir.join("workdir/logs"),
            sandbox: None,
            tool_call_id: None,
        };
        std::fs::create_dir_all(&ctx.workdir).unwrap();
        std::fs::create_dir_all(ctx.capsule_dir.join("tools")).unwrap();
        ctx
    }

    /// Writes an executable script at `tools/<name>` in the capsule folder.
    fn script(ctx: &CallContext, name: &str, body: &str) -> String {
        let path = ctx.capsule_dir.join("tools").join(name);
        std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        format!("tools/{name}")
    }

    fn tool(command: &[&str], timeout_secs: u64) -> CommandTool {
        CommandTool::new(ToolDecl {
            name: "probe".into(),
            description: None,
            command: command.iter().map(|s| s.to_string()).collect(),
            parameters: json!({"type": "object", "properties": {}}),
            timeout_secs,
            idempotent: false,
        })
    }

    /// Runs `tool`, starting again while exec fails with ETXTBSY: a script just written in
    /// this multi-threaded test process can be briefly held open by a sibling test's fork.
    async fn run(tool: &CommandTool, input: &Value, ctx: &CallContext) -> Outcome {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let out = tool.run(input, ctx).await;
            if !out.text.contains("Text file busy") || Instant::now() > deadline {
                return out;
            }
            tokio::task::yield_now().await;
        }
    }

    /// Whether a process other than a zombie is still in process group `pgid`.
    fn group_has_live_members(pgid: i32) -> bool {
        let Ok(entries) = std::fs::read_dir("/proc") else {
            return false;
        };
        entries.flatten().any(|e| {
            let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else {
                return false;
            };
            // After the `(comm)` field: state, ppid, pgrp.
            let Some(rest) = stat.rfind(')').map(|i| &stat[i + 1..]) else {
                return false;
            };
            let fields: Vec<&str> = rest.split_whitespace().collect();
            fields.len() > 2 && fields[2] == pgid.to_string() && !matches!(fields[0], "Z" | "X")
        })
    }

    #[tokio::test]
    async fn the_input_json_arrives_on_stdin_and_stdout_is_the_result() {
        let dir = tempfile::tempdir().unwrap();
        let ctx = context(dir.path());
        let echo = script(&ctx, "echo.sh", "cat; pwd -P >&2");
        let input = json!({"path": "a b.txt", "n": 3, "nested": {"ok": true}});
        let out = run(&tool(&[&echo], 30), &input, &ctx).await;
        assert!(!out.is_error, "{}", out.text);
        assert_eq!(out.text, format!("{input}\n"));
        assert_eq!(serde_json::from_str::<Value>(&out.text).unwrap(), input);
        assert_eq!(out.shell, None);
    }

    #[tokio::test]
    async fn the_command_runs_in_the_workdir_with_its_arguments() {
        let dir = tempfile::tempdir().unwrap();
        let ctx = context(dir.path());
        let probe = script(&ctx, "probe.sh", r#"pwd -P; printf '%s|' "$@""#);
        let out = run(&tool(&[&probe, "one", "two words"], 30), &json!({}), &ctx).await;
        let workdir = ctx.workdir.canonicalize().unwrap();
        assert_eq!(out.text, format!("{}\none|two words|", workdir.display()));
    }

    #[tokio::test]
    async fn the_calls_idempotency_key_is_in_the_commands_environment() {
        let dir = tempfile::tempdir().unwrap();
        let mut ctx = context(dir.path());
        let probe = script(&ctx, "key.sh", r#"printf '%s' "${MUR_TOOL_CALL_ID-unset}""#);
        assert_eq!(run(&tool(&[&probe], 30), &json!({}), &ctx).await.text, "unset");
        ctx.tool_call_id = Some("tsk_1.2.0".into());
        assert_eq!(run(&tool(&[&probe], 30), &json!({}), &ctx).await.text, "tsk_1.2.0");
    }

    #[tokio::test]
    async fn a_bare_program_name_is_looked_up_on_path() {
        let dir = tempfile::tempdir().unwrap();
        let ctx = context(dir.path());
        let out = run(&tool(&["cat"], 30), &json!({"x": 1}), &ctx).await;
        assert!(!out.is_error, "{}", out.text);
        assert_eq!(out.text, "{\"x\":1}\n");
    }

    #[tokio::test]
    async fn a_non_zero_exit_is_an_error_carrying_stderr() {
        let dir = tempfile::tempdir().unwrap();
        let ctx = context(dir.path());
        let fail = script(&ctx, "fail.sh", "echo ignored; echo bad input >&2; exit 2");
        let out = run(&tool(&[&fail], 30), &json!({}), &ctx).await;
        assert!(out.is_error);
        assert_eq!(out.text, "exit code 2: bad input");
    }

    #[tokio::test]
    async fn a_program_that_cannot_start_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let ctx = context(dir.path());
        let out = run(&tool(&["tools/missing.sh"], 30), &json!({}), &ctx).await;
        assert!(out.is_error);
        assert!(out.text.contains("cannot start"), "{}", out.text);
        assert!(out.text.contains("tools/missing.sh"), "{}", out.text);
    }

    #[tokio::test]
    async fn stdout_is_cut_at_16_kib_on_a_char_boundary() {
        let dir = tempfile::tempdir().unwrap();
        let ctx = context(dir.path());
        let big = format!("ab{}", "€".repeat(6000));
        std::fs::write(ctx.workdir.join("big.txt"), &big).unwrap();
        let out = run(&tool(&["cat", "big.txt"], 30), &json!({}), &ctx).await;
        assert!(!out.is_error);
        assert_eq!(out.text, format!("ab{}\n[truncated: {} bytes]", "€".repeat(5460), big.len()));
    }

    #[tokio::test]
    async fn a_timeout_kills_the_whole_process_group() {
        let dir = tempfile::tempdir().unwrap();
        let ctx = context(dir.path());
        let slow = script(&ctx, "slow.sh", "echo $$ > pid; sleep 30; echo late");
        let started = Instant::now();
        let out = run(&tool(&[&slow], 1), &json!({}), &ctx).await;
        let took = started.elapsed();
        assert!(out.is_error);
        assert_eq!(out.text, "tool \"probe\" timed out after 1 s and was killed");
        assert!(took < Duration::from_secs(5), "took {took:?}");

        // The script led its own group; it and its `sleep` die (zombies aside) shortly after.
        let pgid: i32 = std::fs::read_to_string(ctx.workdir.join("pid")).unwrap().trim().parse().unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        while group_has_live_members(pgid) {
            assert!(Instant::now() < deadline, "process group {pgid} still alive");
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test]
    async fn a_timeout_after_the_tool_exited_says_what_held_its_output() {
        let dir = tempfile::tempdir().unwrap();
        let ctx = context(dir.path());
        // In its group: killed with it.
        let held = script(&ctx, "held.sh", "(sleep 30) & echo done");
        let out = run(&tool(&[&held], 1), &json!({}), &ctx).await;
        assert_eq!(
            out.text,
            "tool \"probe\" timed out after 1 s: it had exited, but a process it started held its output open; \
             its process group was killed"
        );
        // Out of its group: found by its mark (MURMUR_REAP_MARK) and killed too.
        let escaped = script(&ctx, "escaped.sh", "setsid sh -c 'echo $$ > escaped.pid; sleep 30' & echo done");
        let out = run(&tool(&[&escaped], 1), &json!({}), &ctx).await;
        assert_eq!(
            out.text,
            "tool \"probe\" timed out after 1 s: it had exited, but a process it started outside its process \
             group (setsid) held its output open; it was killed"
        );
        let pid: i32 = std::fs::read_to_string(ctx.workdir.join("escaped.pid")).unwrap().trim().parse().unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        while process::is_running(pid) {
            assert!(Instant::now() < deadline, "the escaped process {pid} still runs");
            tokio::task::yield_now().await;
        }
    }
}
