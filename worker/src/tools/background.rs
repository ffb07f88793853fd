//! The process side of detached shell commands (the session-loop seed, §Detached shell):
//! the foreground wait that demotes a command still running after its grace period, the
//! background task that then drains its output into `logs/<work_id>.log` and reports its
//! end, and the [`DetachSink`] through which the session hears about both and can kill
//! what still runs.
//!
//! Every command starts in the foreground and the clock decides: a command that has not
//! exited when the grace period is up (checked with `try_wait` first, so a grace of zero
//! demotes at the first check unless the command has already exited) moves to the
//! background. From then on its process group belongs to the sink: dropping the tool's
//! future, the sink or the notices' receiver kills nothing (the seed: the command "is left
//! to run out on its own"); only [`DetachSink::kill`] and [`DetachSink::kill_all`] do, with
//! SIGKILL to the whole group, grandchildren included, after which the group leader is
//! reaped here and any grandchild by init (or the nearest subreaper), as for any orphan.
//! The command's streams are pipes to this process: once the runtime itself is gone, its
//! further writes fail (`EPIPE`, or `SIGPIPE` for a command that does not ignore it).
//!
//! The log holds stdout and stderr interleaved in the order they were read, everything the
//! command printed from its start (what the foreground read before the demotion included).
//! A command is over when its leader has exited and both streams have ended, as in the
//! foreground. The bookkeeping of what the session does with the notices (completion
//! tasks, `shell_abandoned`) is the pure [`crate::session::detach`].

use super::DetachedWork;
use super::process::{self, Capture, Captured};
use std::io;
use std::path::PathBuf;
use std::process::ExitStatus;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWriteExt};
use tokio::process::{Child, ChildStderr, ChildStdout};
use tokio::sync::{mpsc, watch};

/// Bytes of combined output the foreground keeps in memory for a possible demotion before
/// it starts writing them to the work's log file (64 KiB).
pub const JOURNAL_MEMORY: usize = 64 * 1024;

/// What a shell tool tells the session about a command it moved to the background.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DetachNotice {
    /// The command was demoted; sent before the tool call returns, and always before the
    /// command's `Completed`.
    Detached(DetachedWork),
    /// The command ended (its leader exited and both its streams ended).
    Completed {
        /// `wrk_…`.
        work_id: String,
        /// Exit code; 128+signal when a signal killed it, -1 when its status could not be
        /// read.
        exit_code: i32,
        /// Wall time from its start to its exit, ms.
        duration_ms: u64,
        /// The log, relative to the workdir when under it (`logs/<work_id>.log`).
        output_path: String,
        /// Bytes written to the log (all of its output, unless writing the log failed).
        output_bytes: u64,
    },
}

/// A command in the background, as the sink tracks it until its end.
struct Live {
    work_id: String,
    pgid: u32,
    /// The command's [`process::REAP_MARK_VAR`] value.
    mark: String,
    /// Turns true once the group leader has been reaped.
    reaped: watch::Receiver<bool>,
}

/// Where shell tools report detached commands, and the handle to kill them. Cheap to clone;
/// every clone shares the same channel and the same set of running commands.
#[derive(Clone)]
pub struct DetachSink {
    tx: mpsc::UnboundedSender<DetachNotice>,
    live: Arc<Mutex<Vec<Live>>>,
}

impl DetachSink {
    /// A sink and the receiver of its notices.
    pub fn channel() -> (DetachSink, mpsc::UnboundedReceiver<DetachNotice>) {
        let (tx, rx) = mpsc::unbounded_channel();
        (DetachSink { tx, live: Arc::default() }, rx)
    }

    /// The work ids of the commands still running in the background, oldest first.
    pub fn running(&self) -> Vec<String> {
        self.lock().iter().map(|l| l.work_id.clone()).collect()
    }

    /// Kills the process group of `work_id` with SIGKILL and waits until its leader has been
    /// reaped. Returns whether the command was running. Its `Completed` notice follows, with
    /// exit code 137 unless it had exited by itself.
    pub async fn kill(&self, work_id: &str) -> bool {
        let target =
            self.lock().iter().find(|l| l.work_id == work_id).map(|l| (l.pgid, l.mark.clone(), l.reaped.clone()));
        match target {
            Some((pgid, mark, reaped)) => {
                kill_and_reap(work_id, pgid, &mark, reaped).await;
                true
            }
            None => false,
        }
    }

    /// Kills every command still running in the background (a cancelled task, a timeout)
    /// as [`DetachSink::kill`] does, and returns their work ids, oldest first.
    pub async fn kill_all(&self) -> Vec<String> {
        let targets: Vec<(String, u32, String, watch::Receiver<bool>)> =
            self.lock().iter().map(|l| (l.work_id.clone(), l.pgid, l.mark.clone(), l.reaped.clone())).collect();
        for (work_id, pgid, mark, reaped) in &targets {
            kill_and_reap(work_id, *pgid, mark, reaped.clone()).await;
        }
        targets.into_iter().map(|(work_id, ..)| work_id).collect()
    }

    /// The process group of `work_id`, while it runs (tests signal it themselves).
    #[cfg(test)]
    pub(crate) fn pgid(&self, work_id: &str) -> Option<u32> {
        self.lock().iter().find(|l| l.work_id == work_id).map(|l| l.pgid)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Live>> {
        // The set stays consistent even if a holder panicked: every change is one push or
        // one remove.
        self.live.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Takes over a demoted command: opens its log (writing what the foreground captured),
    /// registers its group, sends [`DetachNotice::Detached`] and starts draining it in a
    /// background task. Returns the error that kept the log from being created, if any (the
    /// output is then read and dropped).
    pub(crate) async fn adopt(
        &self,
        child: Child,
        handover: Box<Handover>,
        started: Instant,
        work: &DetachedWork,
        mark: String,
    ) -> Option<String> {
        let Handover { stdout, stderr, mut journal } = *handover;
        journal.open().await;
        let log_error = journal.failed.clone();
        let (reaped_tx, reaped) = watch::channel(false);
        if let Some(pgid) = child.id() {
            self.lock().push(Live { work_id: work.work_id.clone(), pgid, mark, reaped });
        }
        let _ = self.tx.send(DetachNotice::Detached(work.clone()));
        let drain = Drain {
            sink: self.clone(),
            work_id: work.work_id.clone(),
            output_path: work.output_path.clone(),
            started,
            reaped: reaped_tx,
        };
        tokio::spawn(drain.run(child, stdout, stderr, journal));
        log_error
    }
}

/// Sends SIGKILL to group `pgid` and to what it started outside the group (its `mark`),
/// and waits for its leader to be reaped by the drain task.
async fn kill_and_reap(work_id: &str, pgid: u32, mark: &str, mut reaped: watch::Receiver<bool>) {
    process::kill_marked(mark);
    if let Err(e) = process::kill_group(pgid)
        && e.raw_os_error() != Some(libc::ESRCH)
    {
        tracing::warn!(work_id, pgid, error = %e, "cannot kill a detached command's process group");
        return;
    }
    // An error means the drain task is gone (the runtime is shutting down); nothing to wait for.
    let _ = reaped.wait_for(|r| *r).await;
}

/// The background half of one command: drains its streams into the log, reaps it, reports.
struct Drain {
    sink: DetachSink,
    work_id: String,
    output_path: String,
    started: Instant,
    reaped: watch::Sender<bool>,
}

impl Drain {
    async fn run(
        self,
        mut child: Child,
        mut stdout: Option<ChildStdout>,
        mut stderr: Option<ChildStderr>,
        mut journal: Journal,
    ) {
        let mut out_buf = vec![0u8; 64 * 1024];
        let mut err_buf = vec![0u8; 64 * 1024];
        let mut exit: Option<(i32, u64)> = None;
        while exit.is_none() || stdout.is_some() || stderr.is_some() {
            tokio::select! {
                biased;
                n = next_chunk(&mut stdout, &mut out_buf), if stdout.is_some() => match n {
                    Some(n) => journal.push(&out_buf[..n]).await,
                    None => stdout = None,
                },
                n = next_chunk(&mut stderr, &mut err_buf), if stderr.is_some() => match n {
                    Some(n) => journal.push(&err_buf[..n]).await,
                    None => stderr = None,
                },
                status = child.wait(), if exit.is_none() => {
                    let code = match status {
                        Ok(status) => process::exit_code(status),
                        Err(e) => {
                            let work_id = &self.work_id;
                            tracing::warn!(work_id, error = %e, "waiting for a detached command failed");
                            -1
                        }
                    };
                    exit = Some((code, self.started.elapsed().as_millis() as u64));
                    let _ = self.reaped.send(true);
                }
            }
        }
        journal.finish().await;
        self.sink.lock().retain(|l| l.work_id != self.work_id);
        let (exit_code, duration_ms) = exit.unwrap_or((-1, 0));
        // A receiver that is gone stopped listening (the session ended): nothing to do.
        let _ = self.sink.tx.send(DetachNotice::Completed {
            work_id: self.work_id,
            exit_code,
            duration_ms,
            output_path: self.output_path,
            output_bytes: journal.in_file,
        });
    }
}

/// The next chunk of an open stream (`None` at its end); pending forever for a closed one.
async fn next_chunk<R: AsyncRead + Unpin>(stream: &mut Option<R>, buf: &mut [u8]) -> Option<usize> {
    match stream {
        Some(r) => process::read_chunk(r, buf).await,
        None => std::future::pending().await,
    }
}

/// A command's combined output in the order it was read, bound for `logs/<work_id>.log`:
/// kept in memory up to [`JOURNAL_MEMORY`] bytes while the command may still finish in the
/// foreground, then written to the file (created new, its directory too).
pub(crate) struct Journal {
    path: PathBuf,
    mem: Vec<u8>,
    file: Option<tokio::fs::File>,
    /// Bytes written to the file so far.
    in_file: u64,
    /// Why the file could not be written, once it could not; later output is dropped.
    failed: Option<String>,
}

impl Journal {
    /// An empty journal for `path`; nothing is created yet.
    pub fn new(path: PathBuf) -> Self {
        Journal { path, mem: Vec::new(), file: None, in_file: 0, failed: None }
    }

    /// Appends a chunk of output.
    async fn push(&mut self, chunk: &[u8]) {
        if self.failed.is_some() {
            return;
        }
        if self.file.is_none() && self.mem.len() + chunk.len() <= JOURNAL_MEMORY {
            self.mem.extend_from_slice(chunk);
            return;
        }
        self.open().await;
        self.write(chunk).await;
    }

    /// Creates the file if it is not open yet and writes what memory holds to it.
    async fn open(&mut self) {
        if self.file.is_some() || self.failed.is_some() {
            return;
        }
        match process::create_new(&self.path).await {
            Ok(f) => self.file = Some(f),
            Err(e) => {
                self.fail(e);
                return;
            }
        }
        let mem = std::mem::take(&mut self.mem);
        self.write(&mem).await;
    }

    async fn write(&mut self, bytes: &[u8]) {
        let Some(f) = &mut self.file else { return };
        match f.write_all(bytes).await {
            Ok(()) => self.in_file += bytes.len() as u64,
            Err(e) => self.fail(e),
        }
    }

    fn fail(&mut self, e: io::Error) {
        let message = format!("{}: {e}", self.path.display());
        tracing::warn!(error = %message, "cannot write a detached command's log; its output is dropped");
        self.failed = Some(message);
        self.file = None;
        self.mem = Vec::new();
    }

    /// Flushes the file.
    async fn finish(&mut self) {
        if let Some(f) = &mut self.file
            && let Err(e) = f.flush().await
        {
            self.fail(e);
        }
    }

    /// The command finished in the foreground: the journal is not needed, and a file it
    /// had started is removed.
    async fn discard(mut self) {
        if self.file.take().is_some()
            && let Err(e) = tokio::fs::remove_file(&self.path).await
        {
            tracing::warn!(path = %self.path.display(), error = %e, "cannot remove an unused shell journal");
        }
    }
}

/// How long an exited command's open streams get to end once the grace period is up before
/// the command is demoted anyway (a child it left in the background holds them).
pub(crate) const DRAIN: Duration = Duration::from_millis(250);

/// What the foreground hands to the background at a demotion: the streams still open and
/// everything read so far.
pub(crate) struct Handover {
    stdout: Option<ChildStdout>,
    stderr: Option<ChildStderr>,
    journal: Journal,
}

/// How the foreground wait ended.
pub(crate) enum Foreground {
    /// The command exited and both streams ended within the grace period.
    Exited {
        /// Its exit status.
        status: io::Result<ExitStatus>,
        /// Its stdout.
        out: Captured,
        /// Its stderr.
        err: Captured,
    },
    /// The command was still running when the grace period was up. The per-stream
    /// captures are returned so their spill files can be removed: the journal has it all.
    Demoted {
        /// What the background needs.
        handover: Box<Handover>,
        /// stdout as far as it was read.
        out: Captured,
        /// stderr as far as it was read.
        err: Captured,
    },
}

/// Waits for `child` in the foreground for at most `grace`, reading both streams into
/// `out`, `err` and (combined, in order) `journal`. When the grace period is up — at once
/// for zero — the command is demoted unless `try_wait` finds it exited; an exited command
/// whose streams are still open (a child it started in the background holds them:
/// `server & echo started`) gets [`DRAIN`] more for them to end, and is demoted after it:
/// its output goes on to the background, and the turn carries on (the session-loop seed,
/// §Detached shell). Dropped before it returns, it leaves the child to its caller (whose
/// group guard kills it).
pub(crate) async fn foreground(
    child: &mut Child,
    stdout: ChildStdout,
    stderr: ChildStderr,
    grace: Duration,
    mut out: Capture,
    mut err: Capture,
    mut journal: Journal,
) -> Foreground {
    let mut stdout = Some(stdout);
    let mut stderr = Some(stderr);
    let mut status: Option<io::Result<ExitStatus>> = None;
    let mut out_buf = vec![0u8; 64 * 1024];
    let mut err_buf = vec![0u8; 64 * 1024];
    let deadline = tokio::time::sleep(grace);
    tokio::pin!(deadline);
    let mut checked = false;
    // Armed at the check when the command has exited but its streams are still open.
    let drain = tokio::time::sleep(Duration::MAX);
    tokio::pin!(drain);
    let mut draining = false;
    loop {
        if !checked && (grace.is_zero() || deadline.is_elapsed()) {
            checked = true;
            match child.try_wait() {
                Ok(Some(s)) => status = Some(Ok(s)),
                Ok(None) if status.is_none() => break,
                Ok(None) => {}
                Err(e) => status = Some(Err(e)),
            }
            draining = true;
            drain.as_mut().reset(tokio::time::Instant::now() + DRAIN);
        }
        if stdout.is_none()
            && stderr.is_none()
            && let Some(status) = status.take()
        {
            journal.discard().await;
            return Foreground::Exited { status, out: out.finish().await, err: err.finish().await };
        }
        tokio::select! {
            biased;
            n = next_chunk(&mut stdout, &mut out_buf), if stdout.is_some() => match n {
                Some(n) => {
                    out.push(&out_buf[..n]).await;
                    journal.push(&out_buf[..n]).await;
                }
                None => stdout = None,
            },
            n = next_chunk(&mut stderr, &mut err_buf), if stderr.is_some() => match n {
                Some(n) => {
                    err.push(&err_buf[..n]).await;
                    journal.push(&err_buf[..n]).await;
                }
                None => stderr = None,
            },
            s = child.wait(), if status.is_none() => status = Some(s),
            () = &mut deadline, if !checked => {}
            // Its exit status stays with `child` (tokio keeps it): the background reads it.
            () = &mut drain, if draining => break,
        }
    }
    Foreground::Demoted {
        handover: Box::new(Handover { stdout, stderr, journal }),
        out: out.finish().await,
        err: err.finish().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Stdio;
    use tokio::process::Command;

    fn spawn(script: &str) -> Child {
        Command::new("sh")
            .args(["-c", script])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .spawn()
            .unwrap()
    }

    /// The state letter of `pid` in `/proc/<pid>/stat` (`Z` for a zombie), `None` once gone.
    fn proc_state(pid: u32) -> Option<char> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        stat.rsplit_once(") ").and_then(|(_, rest)| rest.chars().next())
    }

    async fn until(what: &str, deadline: Duration, mut done: impl FnMut() -> bool) {
        let end = Instant::now() + deadline;
        while !done() {
            assert!(Instant::now() < end, "timed out waiting until {what}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    async fn run_foreground(child: &mut Child, grace: Duration, dir: &std::path::Path) -> Foreground {
        let stdout = child.stdout.take().unwrap();
        let stderr = child.stderr.take().unwrap();
        let journal = Journal::new(dir.join("wrk_test.log"));
        foreground(child, stdout, stderr, grace, Capture::new(1024, None), Capture::new(1024, None), journal).await
    }

    #[tokio::test]
    async fn grace_zero_keeps_a_command_that_has_already_exited_in_the_foreground() {
        let dir = tempfile::tempdir().unwrap();
        let mut child = spawn("echo done; echo oops >&2; exit 4");
        let pid = child.id().unwrap();
        // Exited but not reaped yet: the first check must see it.
        until("the command has exited", Duration::from_secs(10), || proc_state(pid) == Some('Z')).await;
        let Foreground::Exited { status, out, err } = run_foreground(&mut child, Duration::ZERO, dir.path()).await
        else {
            panic!("an exited command was demoted");
        };
        assert_eq!(process::exit_code(status.unwrap()), 4);
        assert_eq!((out.kept_text().as_str(), err.kept_text().as_str()), ("done\n", "oops\n"));
        assert!(!dir.path().join("wrk_test.log").exists(), "no journal file for a foreground run");
    }

    #[tokio::test]
    async fn grace_zero_demotes_a_running_command_at_the_first_check() {
        let dir = tempfile::tempdir().unwrap();
        let mut child = spawn("sleep 30");
        let pgid = child.id().unwrap();
        let started = Instant::now();
        let demoted = run_foreground(&mut child, Duration::ZERO, dir.path()).await;
        assert!(started.elapsed() < Duration::from_secs(2), "{:?}", started.elapsed());
        assert!(matches!(demoted, Foreground::Demoted { .. }));
        process::kill_group(pgid).unwrap();
        child.wait().await.unwrap();
    }

    #[tokio::test]
    async fn an_exited_command_whose_background_child_holds_its_streams_is_demoted_after_the_drain() {
        let dir = tempfile::tempdir().unwrap();
        let mut child = spawn("(sleep 30; echo late) & echo started");
        let pgid = child.id().unwrap();
        let started = Instant::now();
        let grace = Duration::from_millis(300);
        let demoted = run_foreground(&mut child, grace, dir.path()).await;
        let took = started.elapsed();
        assert!(took >= grace + DRAIN && took < Duration::from_secs(5), "{took:?}");
        let Foreground::Demoted { out, .. } = demoted else { panic!("a command whose output goes on was kept") };
        assert_eq!(out.kept_text(), "started\n");
        // The shell's exit status is still there for the background to read.
        assert!(child.wait().await.unwrap().success());
        process::kill_group(pgid).unwrap();
    }

    #[tokio::test]
    async fn the_journal_keeps_small_output_in_memory_and_spills_the_rest_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("logs/wrk_j.log");
        let mut j = Journal::new(path.clone());
        j.push(b"ab").await;
        assert!(!path.exists());
        let big = vec![b'x'; JOURNAL_MEMORY];
        j.push(&big).await;
        j.push(b"cd").await;
        j.finish().await;
        let mut expected = b"ab".to_vec();
        expected.extend_from_slice(&big);
        expected.extend_from_slice(b"cd");
        assert_eq!(std::fs::read(&path).unwrap(), expected);
        assert_eq!(j.in_file, expected.len() as u64);
        j.discard().await;
        assert!(!path.exists());
    }
}
