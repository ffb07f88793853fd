//! Ties the process groups of this process's foreground children — shell and command tool
//! calls in progress, hooks, a process-transport model — to its life: when the process ends,
//! however it ends (`kill -9` included), every group still tied is killed.
//!
//! Children run in process groups of their own (`process_group(0)`, see `process.rs`), so a
//! signal to the worker does not reach them, and a worker that dies without cleaning up
//! would leave them running, adopted by init. For a cluster worker that is a duplicate run:
//! the task is taken over elsewhere and the turn in flight runs again (`DESIGN.md`
//! §Invariants 4 allows a turn to run again after a crash), its command started beside the
//! orphan. `PR_SET_PDEATHSIG` does not serve: it fires when the parent *thread* ends, and
//! tokio's blocking threads come and go.
//!
//! A detached command is untied when it moves to the background: its turn has carried on,
//! and of a runtime killed outright `seeds/session-loop.md` §What a resume reports says the
//! command "is left to run out on its own".
//!
//! The reaper is one small `sh` per process, started at the first tie, in a process group of
//! its own (a Ctrl-C to the worker's group does not kill it first). It reads `+ <pgid>` and
//! `- <pgid>` lines on its stdin, whose only writer is this process; when the pipe closes —
//! this process exited or was killed — it sends SIGKILL to every group still tied, then
//! exits. A reaper found dead (killed by someone) at the next tie or untie is replaced and
//! told every group tied. A group is untied once its leader has been reaped (after which its id may be
//! reused), so the reaper never signals a group that is not ours; a stray background
//! process that a finished command left in its group is not tied any more.

use std::collections::HashSet;
use std::io::Write;
use std::os::unix::process::CommandExt;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{Mutex, OnceLock};

/// The reaper: a POSIX `sh` program. `$g` holds the tied groups as ` 12 34 `.
const REAPER: &str = r#"g=' '
while read -r op id; do
  case $op in
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
    /// The groups tied now: told again to a reaper started after the last one died.
    tied: HashSet<u32>,
}

fn lifeline() -> &'static Mutex<Lifeline> {
    static LIFELINE: OnceLock<Mutex<Lifeline>> = OnceLock::new();
    LIFELINE.get_or_init(|| Mutex::new(Lifeline { reaper: start_reaper(), tied: HashSet::new() }))
}

fn start_reaper() -> Option<(Child, ChildStdin)> {
    let started = Command::new("sh")
        .args(["-c", REAPER])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn();
    match started {
        // The child is waited for only when it has died: it exits after this process.
        Ok(mut child) => child.stdin.take().map(|stdin| (child, stdin)),
        Err(e) => {
            tracing::warn!(error = %e, "cannot start the reaper: child processes will outlive a killed worker");
            None
        }
    }
}

/// Applies `+ pgid` or `- pgid` to the tied set and tells the reaper; a reaper found dead
/// (killed by someone) is reaped and replaced, and the new one is told every group tied.
fn tell(tie: bool, pgid: u32) {
    let mut line = lifeline().lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    if tie {
        line.tied.insert(pgid);
    } else {
        line.tied.remove(&pgid);
    }
    let sign = if tie { '+' } else { '-' };
    let told = line.reaper.as_mut().map(|(_, stdin)| stdin.write_all(format!("{sign} {pgid}\n").as_bytes()));
    if let Some(Err(e)) = told {
        tracing::warn!(error = %e, "the reaper is gone; starting another");
        if let Some((mut dead, _)) = line.reaper.take() {
            let _ = dead.try_wait();
        }
        line.reaper = start_reaper();
        let all: String = line.tied.iter().map(|g| format!("+ {g}\n")).collect();
        if let Some((_, stdin)) = line.reaper.as_mut()
            && let Err(e) = stdin.write_all(all.as_bytes())
        {
            tracing::warn!(error = %e, "the new reaper is gone too: child processes will outlive a killed worker");
            line.reaper = None;
        }
    }
}

/// A process group tied to this process's life, from [`tie`] until dropped. Drop it once
/// the group's leader has been reaped (or the group killed).
#[derive(Debug)]
pub(crate) struct Tie {
    pgid: u32,
}

/// Ties group `pgid` (a child's pid, the child started with `process_group(0)`) to this
/// process's life: if this process ends while the [`Tie`] lives, the group is killed.
pub(crate) fn tie(pgid: u32) -> Tie {
    tell(true, pgid);
    Tie { pgid }
}

impl Drop for Tie {
    fn drop(&mut self) {
        tell(false, self.pgid);
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

    fn reaper_pid() -> Option<u32> {
        lifeline().lock().unwrap().reaper.as_ref().map(|(child, _)| child.id())
    }

    #[test]
    fn a_killed_reaper_is_replaced_at_the_next_tie() {
        let mut first = group("sleep 60");
        let tied = tie(first.id());
        let old = reaper_pid().expect("a reaper runs");
        // SAFETY: kill(2) with plain integers; the pid is our own child's.
        unsafe { libc::kill(old as libc::pid_t, libc::SIGKILL) };
        until("the old reaper has died", || !alive(old));
        let mut second = group("sleep 60");
        let also = tie(second.id());
        let new = reaper_pid().expect("a new reaper runs");
        assert_ne!(new, old);
        assert!(alive(new));
        assert!(lifeline().lock().unwrap().tied.contains(&first.id()), "the new reaper was told the first group");
        drop((tied, also));
        for child in [&mut first, &mut second] {
            child.kill().unwrap();
            child.wait().unwrap();
        }
    }
}
