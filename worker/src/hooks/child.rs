//! Hook programs as child processes (issue #4; the runtime reference, §3): how one
//! is started, a one-shot run (one process per event: the event on stdin, then end of
//! file, the answer on stdout), a persistent process (one per session: one JSON line per
//! event in, one line per answer out), and the pump that copies a hook's stderr into its
//! log.
//!
//! A hook runs in the capsule folder, in its own process group (so a timeout kills
//! whatever it started), with no host environment (checklist H13): only `PATH`, `HOME`
//! (the capsule folder), `LANG=C.UTF-8`, `MURMUR_SESSION_ID`, `MURMUR_HOOK_NAME`,
//! `MURMUR_WORKDIR` (the session's workdir, when known) and,
//! when the runtime serves model calls for hooks, `MURMUR_INFERENCE_URL`. A process that
//! is killed is also waited for, so none is left a zombie.

use super::Error;
use super::log::HookLog;
use crate::tools::process::{self, GroupGuard};
use mur_proto::hook::Answer;
use mur_proto::manifest::Hook;
use std::ffi::OsString;
use std::io;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// The largest answer read from a hook, in bytes (one-shot stdout, or one persistent
/// line); a longer one is an [`Error::BadAnswer`].
pub(crate) const ANSWER_LIMIT: usize = 16 * 1024 * 1024;

/// How much of the end of a hook's stderr an [`Error::Exit`] or [`Error::Died`] carries,
/// in bytes.
pub(crate) const STDERR_TAIL: usize = 2 * 1024;

/// The longest stderr line copied to the log, in bytes; longer lines are split.
const LOG_LINE_LIMIT: usize = 4 * 1024;

/// `PATH` for hooks when the host has none.
const DEFAULT_PATH: &str = "/usr/local/bin:/usr/bin:/bin";

/// How long a hook that closed its stdout gets to exit on its own (so its exit code can be
/// reported), and how long the rest of its stderr is waited for once it is gone.
const GRACE: Duration = Duration::from_secs(1);

/// How long a killed process is waited for before it is left to the runtime's reaper.
const REAP_LIMIT: Duration = Duration::from_secs(5);

/// The event under way for a hook (its binding, `on-task-end`), shared with its stderr
/// pump so that stderr lines are logged under the event that produced them.
pub(crate) type Label = Arc<Mutex<String>>;

/// Reads a [`Label`].
pub(crate) fn label_text(label: &Label) -> String {
    label.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// A signal to abandon calls under way: the hooks are being stopped, or the task the call
/// serves was cancelled. Once raised, a call kills its process, waits for it and returns
/// nothing.
#[derive(Clone)]
pub(crate) struct Stop {
    /// Raised when the hooks are stopped (drain, shutdown).
    hooks: watch::Receiver<bool>,
    /// Fired when the task the calls serve is cancelled (or runs out of time).
    task: Option<CancellationToken>,
}

impl Stop {
    /// Stops with the hooks only.
    pub fn hooks(hooks: watch::Receiver<bool>) -> Stop {
        Stop { hooks, task: None }
    }

    /// Stops with the hooks or when `task` fires.
    pub fn task(hooks: watch::Receiver<bool>, task: CancellationToken) -> Stop {
        Stop { hooks, task: Some(task) }
    }

    /// Resolves once stopping is asked for; never when the sender is gone without asking
    /// and no task token fires.
    pub async fn stopped(&mut self) {
        let hooks = async {
            if self.hooks.wait_for(|stop| *stop).await.is_err() {
                std::future::pending::<()>().await;
            }
        };
        match &self.task {
            Some(task) => tokio::select! {
                () = hooks => {}
                () = task.cancelled() => {}
            },
            None => hooks.await,
        }
    }
}

/// How to start one hook's program.
pub(crate) struct Launch {
    program: PathBuf,
    args: Vec<String>,
    capsule_dir: PathBuf,
    pub(crate) env: Vec<(&'static str, OsString)>,
    /// The session's sandbox, if any: the program starts confined by it.
    pub(crate) sandbox: Option<Arc<crate::sandbox::Confinement>>,
}

impl Launch {
    /// The launch of `hook` for session `session_id`. `command[0]` is taken relative to
    /// `capsule_dir` when it contains a `/` and is not absolute, else looked up on `PATH`
    /// (the same rule as command tools).
    ///
    /// # Errors
    /// [`Error::Spawn`] for an empty command or a capsule folder that cannot be made
    /// absolute.
    pub fn new(
        hook: &Hook,
        capsule_dir: &Path,
        session_id: &str,
        inference_url: Option<String>,
    ) -> Result<Self, Error> {
        let (program, args) =
            hook.command.split_first().ok_or_else(|| Error::Spawn("the hook has an empty command".into()))?;
        let capsule_dir = std::path::absolute(capsule_dir)
            .map_err(|e| Error::Spawn(format!("cannot resolve the capsule folder {}: {e}", capsule_dir.display())))?;
        let path = Path::new(program);
        let program =
            if path.is_absolute() || !program.contains('/') { path.to_path_buf() } else { capsule_dir.join(path) };
        let host_path = std::env::var_os("PATH").filter(|p| !p.is_empty());
        let mut env = vec![
            ("PATH", host_path.unwrap_or_else(|| DEFAULT_PATH.into())),
            ("HOME", capsule_dir.clone().into_os_string()),
            ("LANG", "C.UTF-8".into()),
            ("MURMUR_SESSION_ID", session_id.into()),
            ("MURMUR_HOOK_NAME", hook.name.clone().into()),
        ];
        if let Some(url) = inference_url {
            env.push(("MURMUR_INFERENCE_URL", url.into()));
        }
        Ok(Launch { program, args: args.to_vec(), capsule_dir, env, sandbox: None })
    }

    /// Starts the program with all three streams piped, in its own process group, marked
    /// with `mark` ([`process::REAP_MARK_VAR`]) so that what it starts outside its group
    /// is killed with it.
    ///
    /// # Errors
    /// [`Error::Spawn`] naming the program and the OS error.
    fn spawn(&self, mark: &str) -> Result<(Child, GroupGuard), Error> {
        let mut command = Command::new(&self.program);
        command
            .args(&self.args)
            .current_dir(&self.capsule_dir)
            .env_clear()
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        GroupGuard::spawn_marked(&mut command, mark, self.sandbox.as_deref())
            .map_err(|e| Error::Spawn(format!("{}: {e}", self.program.display())))
    }
}

/// One-shot mode: starts the program, writes `input` to its stdin and closes it, reads
/// stdout and stderr concurrently to their ends, and waits for the exit, all within
/// `timeout_secs` (a background process still holding stdout or stderr keeps the call
/// waiting, up to that deadline).
///
/// Exit 0 parses stdout with [`Answer::parse`] ([`Error::BadAnswer`] when it is not an
/// answer); any other exit is [`Error::Exit`] with the end of stderr; running past the
/// deadline kills the process group and is [`Error::Timeout`]. `None` when `stop` was
/// raised first (the group is killed too).
pub(crate) async fn run_once(
    launch: &Launch,
    input: &[u8],
    timeout_secs: u64,
    log: &HookLog,
    label: &Label,
    stop: &mut Stop,
) -> Option<Result<Answer, Error>> {
    let mark = process::reap_mark();
    let (mut child, mut guard) = match launch.spawn(&mark) {
        Ok(spawned) => spawned,
        Err(e) => return Some(Err(e)),
    };
    let pgid = child.id();
    let mut pump = StderrPump::start(child.stderr.take().expect("stderr is piped"), log.clone(), label.clone());
    let mut stdin = child.stdin.take().expect("stdin is piped");
    let stdout = child.stdout.take().expect("stdout is piped");

    let ended = {
        let feed = async move {
            // A hook that ignores its input may exit before reading it: a broken pipe is fine.
            if let Err(e) = stdin.write_all(input).await {
                tracing::debug!(error = %e, "writing a hook's event failed");
            }
            drop(stdin);
        };
        let work = async {
            let ((), out, status, ()) =
                tokio::join!(feed, process::capture(stdout, ANSWER_LIMIT, None), child.wait(), pump.finished());
            (out, status)
        };
        tokio::select! {
            r = tokio::time::timeout(Duration::from_secs(timeout_secs), work) => r.ok(),
            () = stop.stopped() => {
                kill_and_reap(&mut child, pgid, &mut guard, &mark).await;
                pump.finished_within(GRACE).await;
                return None;
            }
        }
    };
    let Some((out, status)) = ended else {
        kill_and_reap(&mut child, pgid, &mut guard, &mark).await;
        pump.finished_within(GRACE).await;
        return Some(Err(Error::Timeout(timeout_secs)));
    };
    guard.disarm();
    let status = match status {
        Ok(status) => status,
        Err(e) => return Some(Err(Error::Exit { code: -1, stderr: format!("waiting for the hook failed: {e}") })),
    };
    if !status.success() {
        return Some(Err(Error::Exit { code: process::exit_code(status), stderr: pump.take_tail() }));
    }
    if out.truncated() {
        return Some(Err(Error::BadAnswer(format!("the answer is longer than {ANSWER_LIMIT} bytes"))));
    }
    Some(Answer::parse(&String::from_utf8_lossy(out.head())).map_err(Error::BadAnswer))
}

/// Kills group `pgid` and waits for `child` (at most [`REAP_LIMIT`]).
async fn kill_and_reap(child: &mut Child, pgid: Option<u32>, guard: &mut GroupGuard, mark: &str) {
    // What it started outside its group (`setsid cmd &`) first, while the group's members
    // are still there to be found by their mark too.
    process::kill_marked(mark);
    if let Some(pgid) = pgid
        && let Err(e) = process::kill_group(pgid)
        && e.raw_os_error() != Some(libc::ESRCH)
    {
        tracing::warn!(pgid, error = %e, "cannot kill a hook's process group");
    }
    guard.disarm();
    if tokio::time::timeout(REAP_LIMIT, child.wait()).await.is_err() {
        tracing::warn!(pid = ?pgid, "a killed hook did not exit; leaving it to the reaper");
    }
}

/// What one exchange with a persistent process gave.
pub(crate) enum Exchanged {
    /// An answer line (empty: none).
    Answer(Answer),
    /// A line that is not an answer; the process is still usable.
    Bad(String),
    /// A line longer than [`ANSWER_LIMIT`]: the stream is out of step, the process must go.
    Overlong,
    /// Its stdin or stdout closed (it died); the cause.
    Closed(String),
}

/// Persistent mode: one process kept across events, talking JSON lines.
pub(crate) struct Persistent {
    child: Child,
    pgid: Option<u32>,
    guard: GroupGuard,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    pump: StderrPump,
    log: HookLog,
    label: Label,
    /// Its [`process::REAP_MARK_VAR`] value.
    mark: String,
}

impl Persistent {
    /// Starts the process; its stderr goes to `log` under the current `label`.
    ///
    /// # Errors
    /// [`Error::Spawn`].
    pub fn start(launch: &Launch, log: HookLog, label: Label) -> Result<Self, Error> {
        let mark = process::reap_mark();
        let (mut child, guard) = launch.spawn(&mark)?;
        let pgid = child.id();
        let stdin = child.stdin.take().expect("stdin is piped");
        let stdout = BufReader::new(child.stdout.take().expect("stdout is piped"));
        let pump = StderrPump::start(child.stderr.take().expect("stderr is piped"), log.clone(), label.clone());
        Ok(Persistent { child, pgid, guard, stdin, stdout, pump, log, label, mark })
    }

    /// Reads, without waiting, the lines the process wrote after its last answer (a hook
    /// that answers with more than one line): they answer no event, and left there the
    /// next event would read one of them as its answer. Each is logged (kind `stray`)
    /// and dropped.
    fn drop_stray_lines(&mut self) {
        use futures::FutureExt;
        let mut stray = Vec::new();
        while let Some(Ok(line)) = read_line(&mut self.stdout, ANSWER_LIMIT).now_or_never() {
            match line {
                Line::Text(bytes) => stray.push(format!(
                    "a line written after the last answer, not an answer to this event: dropped: {}",
                    String::from_utf8_lossy(&bytes)
                )),
                Line::Overlong => stray
                    .push(format!("a line written after the last answer, longer than {ANSWER_LIMIT} bytes: dropped")),
                Line::Eof => break,
            }
        }
        if !stray.is_empty() {
            let event = self.label.lock().map(|l| l.clone()).unwrap_or_default();
            self.log.write_all(&event, "stray", stray.iter().map(String::as_str));
        }
    }

    /// Writes `line` (one JSON object and `\n`) and reads one answer line. Has no deadline
    /// of its own: the caller bounds it.
    pub async fn exchange(&mut self, line: &[u8]) -> Exchanged {
        self.pump.take_tail();
        self.drop_stray_lines();
        if let Err(e) = async {
            self.stdin.write_all(line).await?;
            self.stdin.flush().await
        }
        .await
        {
            return Exchanged::Closed(format!("writing the event failed: {e}"));
        }
        match read_line(&mut self.stdout, ANSWER_LIMIT).await {
            Err(e) => Exchanged::Closed(format!("reading the answer failed: {e}")),
            Ok(Line::Eof) => Exchanged::Closed("it closed its stdout".into()),
            Ok(Line::Overlong) => Exchanged::Overlong,
            Ok(Line::Text(bytes)) => match Answer::parse(&String::from_utf8_lossy(&bytes)) {
                Ok(answer) => Exchanged::Answer(answer),
                Err(e) => Exchanged::Bad(e),
            },
        }
    }

    /// After [`Exchanged::Closed`]: gives the process a moment to exit, stops it, and says
    /// what became of it (`cause; exited with code 3; stderr: …`).
    pub async fn died(mut self, cause: &str) -> String {
        let exited = tokio::time::timeout(GRACE, self.child.wait()).await.ok().and_then(Result::ok);
        let killed = self.stop_inner().await;
        let status = exited.or(killed);
        let mut message = cause.to_string();
        if let Some(status) = status {
            message.push_str(&format!("; exited with code {}", process::exit_code(status)));
        }
        let tail = self.pump.take_tail();
        if !tail.is_empty() {
            message.push_str(&format!("; stderr: {tail}"));
        }
        message
    }

    /// Kills the process group and waits for the process (no zombie is left).
    pub async fn stop(mut self) {
        self.stop_inner().await;
    }

    async fn stop_inner(&mut self) -> Option<ExitStatus> {
        kill_and_reap(&mut self.child, self.pgid, &mut self.guard, &self.mark).await;
        self.pump.finished_within(GRACE).await;
        self.child.try_wait().ok().flatten()
    }
}

/// One line read from a persistent hook.
enum Line {
    /// The line, without its `\n`.
    Text(Vec<u8>),
    /// End of file before a complete line.
    Eof,
    /// More than the limit without a line break.
    Overlong,
}

/// Reads up to and including the next `\n`, keeping at most `limit` bytes.
async fn read_line<R: AsyncRead + Unpin>(reader: &mut BufReader<R>, limit: usize) -> io::Result<Line> {
    let mut line = Vec::new();
    loop {
        let buf = reader.fill_buf().await?;
        if buf.is_empty() {
            return Ok(Line::Eof);
        }
        if let Some(i) = buf.iter().position(|b| *b == b'\n') {
            line.extend_from_slice(&buf[..i]);
            reader.consume(i + 1);
            return Ok(if line.len() > limit { Line::Overlong } else { Line::Text(line) });
        }
        let n = buf.len();
        line.extend_from_slice(buf);
        reader.consume(n);
        if line.len() > limit {
            return Ok(Line::Overlong);
        }
    }
}

/// Copies a hook's stderr, line by line, into its log (kind `stderr`), keeping the last
/// [`STDERR_TAIL`] bytes for error messages.
pub(crate) struct StderrPump {
    task: Option<JoinHandle<()>>,
    tail: Arc<Mutex<Vec<u8>>>,
}

impl StderrPump {
    /// Starts copying `stderr` in a task of its own.
    pub fn start<R: AsyncRead + Unpin + Send + 'static>(mut stderr: R, log: HookLog, label: Label) -> Self {
        let tail = Arc::new(Mutex::new(Vec::new()));
        let kept = tail.clone();
        let task = tokio::spawn(async move {
            let mut buf = vec![0u8; 8 * 1024];
            let mut pending: Vec<u8> = Vec::new();
            loop {
                let n = match stderr.read(&mut buf).await {
                    Ok(0) => break,
                    Ok(n) => n,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(_) => break,
                };
                {
                    let mut tail = kept.lock().unwrap_or_else(|e| e.into_inner());
                    tail.extend_from_slice(&buf[..n]);
                    let excess = tail.len().saturating_sub(STDERR_TAIL);
                    tail.drain(..excess);
                }
                pending.extend_from_slice(&buf[..n]);
                let lines = split_lines(&mut pending);
                if !lines.is_empty() {
                    log.write_all(&label_text(&label), "stderr", lines.iter().map(String::as_str));
                }
            }
            if !pending.is_empty() {
                let last = String::from_utf8_lossy(&pending).into_owned();
                log.write(&label_text(&label), "stderr", &last);
            }
        });
        StderrPump { task: Some(task), tail }
    }

    /// Waits until stderr is at its end (every process holding it has closed it).
    pub async fn finished(&mut self) {
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }

    /// Like [`StderrPump::finished`], but waits at most `limit`; the copy goes on in the
    /// background after that.
    pub async fn finished_within(&mut self, limit: Duration) {
        if let Some(task) = &mut self.task
            && tokio::time::timeout(limit, task).await.is_ok()
        {
            self.task = None;
        }
    }

    /// The stderr kept since the last call, as text, without trailing whitespace; at most
    /// [`STDERR_TAIL`] bytes, not starting inside a character.
    pub fn take_tail(&self) -> String {
        let bytes = std::mem::take(&mut *self.tail.lock().unwrap_or_else(|e| e.into_inner()));
        let start = bytes.iter().position(|b| b & 0b1100_0000 != 0b1000_0000).unwrap_or(bytes.len());
        String::from_utf8_lossy(&bytes[start..]).trim_end().to_string()
    }
}

/// Takes the complete lines out of `pending` (without their `\n`), and splits off pieces of
/// [`LOG_LINE_LIMIT`] bytes while the rest is that long without a line break.
fn split_lines(pending: &mut Vec<u8>) -> Vec<String> {
    let mut lines = Vec::new();
    while let Some(i) = pending.iter().position(|b| *b == b'\n') {
        let line: Vec<u8> = pending.drain(..=i).collect();
        lines.push(String::from_utf8_lossy(&line[..i]).trim_end_matches('\r').to_string());
    }
    while pending.len() > LOG_LINE_LIMIT {
        let cut = process::char_boundary_cut(pending, LOG_LINE_LIMIT).max(1);
        let piece: Vec<u8> = pending.drain(..cut).collect();
        lines.push(String::from_utf8_lossy(&piece).into_owned());
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stderr_is_split_into_lines_and_long_runs_into_pieces() {
        let mut pending = b"one\r\ntwo\nthr".to_vec();
        assert_eq!(split_lines(&mut pending), ["one", "two"]);
        assert_eq!(pending, b"thr");
        let mut long = "é".repeat(LOG_LINE_LIMIT).into_bytes();
        let lines = split_lines(&mut long);
        assert_eq!(lines.len(), 1);
        assert_eq!(lines[0], "é".repeat(LOG_LINE_LIMIT / 2));
        assert_eq!(long.len(), LOG_LINE_LIMIT);
    }

    #[tokio::test]
    async fn a_persistent_answer_line_is_read_up_to_its_break_and_capped() {
        let mut r = BufReader::new(&b"{\"action\":\"none\"}\n\nrest"[..]);
        assert!(matches!(read_line(&mut r, 100).await.unwrap(), Line::Text(t) if t == b"{\"action\":\"none\"}"));
        assert!(matches!(read_line(&mut r, 100).await.unwrap(), Line::Text(t) if t.is_empty()));
        assert!(matches!(read_line(&mut r, 100).await.unwrap(), Line::Eof));
        let mut r = BufReader::new(&b"0123456789\n"[..]);
        assert!(matches!(read_line(&mut r, 5).await.unwrap(), Line::Overlong));
    }
}
