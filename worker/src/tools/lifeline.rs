//! Ties the process groups of this process's foreground children — shell and command tool
//! calls in progress, hooks, a process-transport model — to its life: when the process ends,
//! however it ends (`kill -9` included), every group still tied is killed.
//!
//! Children run in process groups of their own (`process_group(0)`, see `process.rs`), so a
//! signal to the worker does not reach them, and a worker that dies without cleaning up
//! would leave them running, adopted by init. For a cluster worker that is a duplicate run:
//! the task is taken over elsewhere and the turn in flight runs again (the design,
//! §Invariants 4 allows a turn to run again after a crash), its command started beside the
//! orphan. `PR_SET_PDEATHSIG` does not serve: it fires when the parent *thread* ends, and
//! tokio's blocking threads come and go.
//!
//! A detached command is untied when it moves to the background: its turn has carried on,
//! and of a runtime killed outright the session-loop seed, §What a resume reports says the
//! command "is left to run out on its own".
//!
//! The reaper is one small `sh` per process, started at the first spawn, in a process group
//! of its own (a Ctrl-C to the worker's group does not kill it first). It reads lines on its
//! stdin, whose only writers are this process and its children in the instant before they
//! exec; when the pipe closes — this process exited or was killed — it sends SIGKILL to every
//! group still tied, then exits. A reaper that dies (killed by someone) is replaced at once
//! by a thread that waits for it, and the new one is told every group tied. A group is untied once its leader has been reaped
//! (after which its id may be reused), so the reaper never signals a group that is not ours;
//! a stray background process that a finished command left in its group is not tied any
//! more.
//!
//! A child ties itself: [`spawn`] has it write `c <its pid>` to the reaper's pipe after the
//! fork and before the exec (one `write(2)` under `PIPE_BUF`, so whole), so a worker killed
//! in the instant between the child's start and the return of `spawn` still takes the
//! child with it. (Tying it only after `spawn` returned left that instant open: a loaded CI
//! machine once killed the worker in it, and the command outlived the worker.) The parent
//! then confirms with `k`, or, when the exec failed, takes the child's line back with `x`.
//! Spawns are serialised under the lifeline's lock, so the reaper reads each spawn's lines
//! together.

use std::collections::HashMap;
use std::io::{self, Write};
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};

/// The reaper: a POSIX `sh` program. `$g` holds the tied groups as ` 12 34 ` (an id once per
/// tie: a multiset), `$l` the group a child announced in the spawn going on. Lines:
/// - `c <pgid>` a child ties itself (written by the child before its exec);
/// - `k` its spawn succeeded: the tie stays;
/// - `x` its spawn failed: the tie the child wrote, if any, is taken back;
/// - `+ <pgid>` ties a group (a new reaper told the groups tied);
/// - `- <pgid>` unties one tie of a group.
const REAPER: &str = r#"g=' ' l=
while read -r op id; do
  case $op in
    c) g="$g$id " l=$id ;;
    k) l= ;;
    x) case $l in ?*) g="${g%%" $l "*} ${g#*" $l "}" ;; esac; l= ;;
    +) g="$g$id " ;;
    -) case $g in *" $id "*) g="${g%%" $id "*} ${g#*" $id "}" ;; esac ;;
  esac
done
for id in $g; do kill -s KILL -- "-$id" 2>/dev/null; done
exit 0
"#;

/// The reaper of this process and the groups tied now.
struct Lifeline {
    /// The running reaper; `None` when it could not be started (logged).
    reaper: Option<(Child, ChildStdin)>,
    /// The groups tied now, with how many ties each: told again to a reaper started after
    /// the last one died.
    tied: HashMap<u32, usize>,
}

/// The reaper's pipe (the write end), read by children between their fork and exec: -1 when
/// no reaper runs. Changed only under the lifeline's lock, which every spawn holds.
static REAPER_FD: AtomicI32 = AtomicI32::new(-1);

fn lifeline() -> MutexGuard<'static, Lifeline> {
    static LIFELINE: OnceLock<Mutex<Lifeline>> = OnceLock::new();
    LIFELINE
        .get_or_init(|| {
            let reaper = start_reaper();
            Mutex::new(Lifeline { reaper, tied: HashMap::new() })
        })
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Starts a reaper and points [`REAPER_FD`] at its pipe. Called under the lifeline's lock
/// (or before it exists).
fn start_reaper() -> Option<(Child, ChildStdin)> {
    let started = Command::new("sh")
        .args(["-c", REAPER])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn();
    let reaper = match started {
        // Waited for by its watcher only when it has died: it exits after this process.
        Ok(mut child) => {
            watch_reaper(child.id());
            child.stdin.take().map(|stdin| (child, stdin))
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot start the reaper: child processes will outlive a killed worker");
            None
        }
    };
    REAPER_FD.store(reaper.as_ref().map_or(-1, |(_, stdin)| stdin.as_raw_fd()), Ordering::SeqCst);
    reaper
}

/// Waits, on a thread of its own, for the reaper `pid` to exit, then replaces it at once,
/// the new one told every group tied: a reaper killed by someone would otherwise leave the
/// commands running now untied until the next spawn or untie (a breaker's finding: a worker
/// busy with long commands, its reaper killed, then the worker killed: the commands lived).
fn watch_reaper(pid: u32) {
    let watching = std::thread::Builder::new().name("mur-reaper-watch".into()).spawn(move || {
        let mut status = 0;
        // SAFETY: waitpid(2) on a child of ours, into a status of ours.
        while unsafe { libc::waitpid(pid as libc::pid_t, &mut status, 0) } == -1
            && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted
        {}
        let mut line = lifeline();
        // Not when a failed write has replaced it already.
        if line.reaper.as_ref().is_some_and(|(child, _)| child.id() == pid) {
            tracing::warn!(pid, "the reaper died; starting another");
            REAPER_FD.store(-1, Ordering::SeqCst);
            line.reaper = None;
            line.write("");
        }
    });
    if let Err(e) = watching {
        tracing::warn!(error = %e, "cannot watch the reaper: a killed reaper is replaced only at the next spawn");
    }
}

/// Runs in a child between its fork and its exec: writes `c <pid>` to the reaper's pipe,
/// ignoring every error (a dead reaper is the parent's to replace). Only async-signal-safe
/// calls: an atomic load, `getpid(2)`, `write(2)`, no allocation.
fn announce() -> io::Result<()> {
    announce_to(REAPER_FD.load(Ordering::SeqCst));
    Ok(())
}

/// [`announce`] to the pipe `fd` (nothing when it is negative).
fn announce_to(fd: i32) {
    if fd < 0 {
        return;
    }
    let mut line = [0u8; 16];
    // SAFETY: getpid(2) has no preconditions; signal(2) only sets this process's
    // disposition (a dead reaper's pipe must not kill the child with SIGPIPE: std resets
    // SIGPIPE to its default in children), restored after; `line[..len]` is initialised
    // memory of ours, and a bad or closed `fd` is an error return.
    unsafe {
        let len = announce_line(libc::getpid().unsigned_abs(), &mut line);
        let before = libc::signal(libc::SIGPIPE, libc::SIG_IGN);
        libc::write(fd, line.as_ptr().cast(), len);
        if before != libc::SIG_ERR {
            libc::signal(libc::SIGPIPE, before);
        }
    }
}

/// Writes `c <pid>\n` into `buf`, returning its length (at most 13 bytes: a pid has at most
/// 10 digits). No allocation (`itoa` formats on the stack): it runs between fork and exec.
fn announce_line(pid: u32, buf: &mut [u8; 16]) -> usize {
    let mut digits = itoa::Buffer::new();
    let digits = digits.format(pid).as_bytes();
    let n = digits.len();
    buf[..2].copy_from_slice(b"c ");
    buf[2..2 + n].copy_from_slice(digits);
    buf[2 + n] = b'\n';
    3 + n
}

/// Starts `cmd` (in a process group of its own: the caller sets `process_group(0)`) with its
/// group tied to this process's life from before its exec, returning the child and the
/// [`Tie`] (`None` when the child has no pid any more).
///
/// `cmd` is spawned once: each call adds its `pre_exec` hook to the command.
///
/// # Errors
/// The OS error of the spawn; the group the child tied, if it got that far, is untied.
pub(crate) fn spawn(cmd: &mut tokio::process::Command) -> io::Result<(tokio::process::Child, Option<Tie>)> {
    let mut line = lifeline();
    if line.reaper.is_none() {
        // None could be started before: try again for this child (told what is tied).
        line.write("");
    }
    // SAFETY: `announce` makes only async-signal-safe calls (see there).
    unsafe { cmd.pre_exec(announce) };
    match cmd.spawn() {
        Ok(child) => {
            let tie = child.id().map(|pgid| {
                *line.tied.entry(pgid).or_default() += 1;
                Tie { pgid }
            });
            line.write("k\n");
            Ok((child, tie))
        }
        Err(e) => {
            line.write("x\n");
            Err(e)
        }
    }
}

impl Lifeline {
    /// Writes `text` to the reaper. A reaper found dead (killed by someone), or none, is
    /// replaced by a new one told every group tied (which stands for `text`).
    fn write(&mut self, text: &str) {
        if let Some((dead, stdin)) = self.reaper.as_mut() {
            let Err(e) = stdin.write_all(text.as_bytes()) else { return };
            tracing::warn!(error = %e, "the reaper is gone; starting another");
            let _ = dead.try_wait();
        }
        self.reaper = start_reaper();
        let all: String = self
            .tied
            .iter()
            .flat_map(|(pgid, &ties)| std::iter::repeat_n(pgid, ties))
            .map(|pgid| format!("+ {pgid}\n"))
            .collect();
        if let Some((_, stdin)) = self.reaper.as_mut()
            && let Err(e) = stdin.write_all(all.as_bytes())
        {
            tracing::warn!(error = %e, "the new reaper is gone too: child processes will outlive a killed worker");
            self.reaper = None;
            REAPER_FD.store(-1, Ordering::SeqCst);
        }
    }
}

/// A process group tied to this process's life, from [`spawn`] until dropped. Drop it once
/// the group's leader has been reaped (or the group killed).
#[derive(Debug)]
pub(crate) struct Tie {
    pgid: u32,
}

impl Drop for Tie {
    fn drop(&mut self) {
        let mut line = lifeline();
        if let Some(ties) = line.tied.get_mut(&self.pgid) {
            *ties -= 1;
            if *ties == 0 {
                line.tied.remove(&self.pgid);
            }
        }
        line.write(&format!("- {}\n", self.pgid));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    fn alive(pid: u32) -> bool {
        // A zombie counts as gone: it has exited and waits only to be reaped.
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|s| s.rsplit_once(") ").and_then(|(_, rest)| rest.chars().next()))
            .is_some_and(|state| state != 'Z')
    }

    fn until(what: &str, mut done: impl FnMut() -> bool) {
        let end = Instant::now() + Duration::from_secs(10);
        while !done() {
            assert!(Instant::now() < end, "timed out waiting until {what}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn group(script: &str) -> std::process::Child {
        Command::new("sh").args(["-c", script]).process_group(0).spawn().unwrap()
    }

    /// Runs the reaper program by hand, as this process runs it, with a pipe this test can
    /// close as a killed worker's would close.
    fn reaper_process() -> std::process::Child {
        Command::new("sh").args(["-c", REAPER]).stdin(Stdio::piped()).process_group(0).spawn().unwrap()
    }

    #[test]
    fn groups_still_tied_die_when_the_reapers_pipe_closes_and_untied_ones_live() {
        let mut reaper = reaper_process();
        let mut tied = group("sleep 60 & sleep 60; :");
        let mut untied = group("sleep 60");
        let (tied_pid, untied_pid) = (tied.id(), untied.id());
        {
            let stdin = reaper.stdin.as_mut().unwrap();
            write!(stdin, "+ {tied_pid}\n+ {untied_pid}\n+ 99999999\n- {untied_pid}\n").unwrap();
        }
        // The tied group's background `sleep` (a grandchild) is a member too.
        let grandchild = || {
            std::fs::read_to_string(format!("/proc/{tied_pid}/task/{tied_pid}/children"))
                .ok()
                .and_then(|s| s.split_whitespace().next().and_then(|p| p.parse::<u32>().ok()))
        };
        until("the tied command has forked", || grandchild().is_some());
        let sleeper = grandchild().unwrap();
        drop(reaper.stdin.take()); // as when the worker dies
        assert!(reaper.wait().unwrap().success());
        until("the tied group is dead", || tied.try_wait().unwrap().is_some() && !alive(sleeper));
        assert!(alive(untied_pid), "an untied group is left alone");
        untied.kill().unwrap();
        untied.wait().unwrap();
    }

    /// The reaper's lines, each spawn's as the children and the parent write them; what it
    /// would kill is printed (`kill` is a function here) rather than killed.
    #[test]
    fn a_spawn_keeps_the_tie_its_child_wrote_and_a_failed_one_takes_it_back() {
        let mut reaper = Command::new("sh")
            .args(["-c", &format!("kill() {{ shift 3; echo \"$1\"; }}\n{REAPER}")])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let lines = concat!(
            "c 11\nk\n",             // a spawn that succeeded
            "c 12\nx\n",             // an exec that failed after the child wrote
            "x\n",                   // a fork that failed: nothing written, nothing taken back
            "+ 13\n- 13\n",          // told, then untied
            "c 14\nk\n+ 14\n- 14\n", // tied twice (a new reaper told it), untied once
        );
        reaper.stdin.take().unwrap().write_all(lines.as_bytes()).unwrap();
        let out = reaper.wait_with_output().unwrap();
        assert!(out.status.success());
        assert_eq!(String::from_utf8(out.stdout).unwrap(), "-11\n-14\n");
    }

    /// The race this module's child-side tie closes: the parent never writes (killed right
    /// after the fork), and the child's group still dies when the pipe closes.
    #[test]
    fn a_child_that_tied_itself_dies_with_a_parent_killed_before_spawn_returned() {
        let mut reaper = reaper_process();
        let fd = reaper.stdin.as_ref().unwrap().as_raw_fd();
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "sleep 60 & sleep 60; :"]).process_group(0);
        // SAFETY: announce_to makes only async-signal-safe calls.
        unsafe {
            cmd.pre_exec(move || {
                announce_to(fd);
                Ok(())
            })
        };
        let mut child = cmd.spawn().unwrap();
        drop(reaper.stdin.take()); // as when the worker dies: nothing written by the parent
        assert!(reaper.wait().unwrap().success());
        until("the child's group is dead", || child.try_wait().unwrap().is_some());
    }

    #[test]
    fn announce_line_is_c_space_the_pid_and_a_newline() {
        let mut buf = [0u8; 16];
        for (pid, line) in [(0, "c 0\n"), (7, "c 7\n"), (4_194_304, "c 4194304\n"), (u32::MAX, "c 4294967295\n")] {
            let len = announce_line(pid, &mut buf);
            assert_eq!(std::str::from_utf8(&buf[..len]).unwrap(), line);
        }
    }

    fn reaper_pid() -> Option<u32> {
        lifeline().reaper.as_ref().map(|(child, _)| child.id())
    }

    fn ties(pgid: u32) -> usize {
        lifeline().tied.get(&pgid).copied().unwrap_or(0)
    }

    fn sleeper() -> tokio::process::Command {
        let mut cmd = tokio::process::Command::new("sleep");
        cmd.arg("60").process_group(0);
        cmd
    }

    #[tokio::test]
    async fn a_spawn_ties_its_child_until_the_tie_drops_and_a_failed_one_ties_nothing() {
        let (mut child, tie) = spawn(&mut sleeper()).unwrap();
        let pid = child.id().unwrap();
        assert_eq!(ties(pid), 1);
        // (Other tests spawn beside this one: only this test's own tie is looked at.)
        let err = spawn(&mut tokio::process::Command::new("/nonexistent/mur-test-program")).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::NotFound);
        assert_eq!(ties(pid), 1, "a failed spawn's take-back leaves the other ties alone");
        child.kill().await.unwrap();
        drop(tie);
        assert_eq!(ties(pid), 0);
    }

    #[tokio::test]
    async fn a_killed_reaper_is_replaced_at_once_without_waiting_for_a_spawn() {
        let (mut first, tied) = spawn(&mut sleeper()).unwrap();
        let old = reaper_pid().expect("a reaper runs");
        // SAFETY: kill(2) with plain integers; the pid is our own child's.
        unsafe { libc::kill(old as libc::pid_t, libc::SIGKILL) };
        until("another reaper runs", || reaper_pid().is_some_and(|new| new != old && alive(new)));
        assert!(!alive(old));
        assert_eq!(ties(first.id().unwrap()), 1, "the first group is still tied (and was told the new reaper)");
        // Spawns go on with the new one.
        let (mut second, also) = spawn(&mut sleeper()).unwrap();
        for child in [&mut first, &mut second] {
            child.kill().await.unwrap();
        }
        drop((tied, also));
    }
}
