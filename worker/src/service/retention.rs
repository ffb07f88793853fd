//! Which finished session folders a worker keeps: its newest [`Config::keep_sessions`]
//! (default 1000), so a long-lived worker's disk and inodes stay bounded — every task makes
//! a folder (`MURMUR.md`, `trace.jsonl`, `out/`, `logs/`), and the cluster keeps what
//! matters elsewhere (the trace in `MUR_TRACE`, checkpoints and conversations in
//! `mur_sessions`, detached commands' logs in the object store).
//!
//! A folder is *finished* when its session has ended and no detached command of it still
//! runs (a command's log is written in the folder until it ends). Folders are removed one
//! at a time, oldest first, as others finish: never a bulk removal, which on a journal-less
//! ext4 slows the file creations of the next minute (`docs/ARCHITECTURE.md` §Speed). The
//! removals run on one thread of their own at the lowest CPU priority (nice 19), so on a
//! busy machine they wait for idle moments rather than slow the tasks. Only
//! folders this worker process finished are counted and removed: another worker on the
//! same machine may share the workdir, and its running sessions are not ours to judge.
//!
//! Folders an earlier worker process left (a restart on the same workdir) are counted
//! too, when no other worker uses the workdir: every worker holds a shared lock on
//! `<workdir>/sessions/.lock` while it runs, and one that starts and gets it exclusively
//! is alone, so every folder there is finished; it adopts them, oldest first (session ids
//! are time-ordered), before it makes one of its own ([`Retention::adopt`]). A backlog is
//! worked off two folders per finished session, never at once.
//!
//! [`Config::keep_sessions`]: super::Config::keep_sessions

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};

/// The finished folders kept, oldest first.
#[derive(Debug)]
pub struct Retention {
    keep: usize,
    finished: Mutex<VecDeque<PathBuf>>,
}

impl Retention {
    /// Keeps the newest `keep` finished folders (0: none).
    pub fn new(keep: usize) -> Retention {
        Retention { keep, finished: Mutex::new(VecDeque::new()) }
    }

    /// Records `dir` as finished and returns the folders past the limit, oldest first, for
    /// the caller to remove: at most two, so a backlog of adopted folders goes a little
    /// at a time.
    pub fn finish(&self, dir: PathBuf) -> Vec<PathBuf> {
        let mut finished = self.finished.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        finished.push_back(dir);
        let over = finished.len().saturating_sub(self.keep).min(MAX_REMOVED_PER_FINISH);
        finished.drain(..over).collect()
    }

    /// Counts `dirs`, an earlier process's finished folders, oldest first, as finished
    /// before any of this process's; nothing is removed until a session finishes.
    pub fn adopt(&self, dirs: Vec<PathBuf>) {
        let mut finished = self.finished.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        for dir in dirs.into_iter().rev() {
            finished.push_front(dir);
        }
    }

    /// [`Retention::finish`], then hands what falls past the limit to the remover thread
    /// (a failure there is logged, the folder stays).
    pub fn finished(&self, dir: PathBuf) {
        for old in self.finish(dir) {
            if remover().send(old).is_err() {
                tracing::warn!("the session-folder remover is gone; old folders stay");
            }
        }
    }
}

/// Folders removed at most per finished session (one is the steady state).
const MAX_REMOVED_PER_FINISH: usize = 2;

/// The file whose lock says which workers use a workdir's `sessions/` folder.
const LOCK_FILE: &str = ".lock";

/// Takes the workdir's lock on `sessions` (the folder of session folders) for the life of
/// the returned file: shared, after adopting — when the lock could be had exclusively, no
/// other worker using the folder — every session folder (`ses_…`) already there into
/// `retention`; nothing else there is touched.
/// Returns how many were adopted.
///
/// # Errors
/// The folder or its lock file cannot be made or locked.
pub fn lock_and_adopt(sessions: &std::path::Path, retention: &Retention) -> std::io::Result<(std::fs::File, usize)> {
    std::fs::create_dir_all(sessions)?;
    let file = std::fs::OpenOptions::new().create(true).truncate(false).write(true).open(sessions.join(LOCK_FILE))?;
    let mut adopted = 0;
    match file.try_lock() {
        Ok(()) => {
            let mut dirs: Vec<PathBuf> = std::fs::read_dir(sessions)?
                .filter_map(Result::ok)
                .filter(|e| {
                    e.file_type().is_ok_and(|t| t.is_dir()) && e.file_name().to_string_lossy().starts_with("ses_")
                })
                .map(|e| e.path())
                .collect();
            dirs.sort();
            adopted = dirs.len();
            retention.adopt(dirs);
        }
        Err(std::fs::TryLockError::WouldBlock) => {}
        Err(std::fs::TryLockError::Error(e)) => return Err(e),
    }
    // Exclusive → shared on the same file (flock converts it), or shared beside the others.
    file.lock_shared()?;
    Ok((file, adopted))
}

/// The process's remover: a thread at nice 19 removing the folders it is sent, in order.
fn remover() -> std::sync::mpsc::Sender<PathBuf> {
    static REMOVER: OnceLock<Mutex<std::sync::mpsc::Sender<PathBuf>>> = OnceLock::new();
    REMOVER
        .get_or_init(|| {
            let (tx, rx) = std::sync::mpsc::channel::<PathBuf>();
            let spawned = std::thread::Builder::new().name("mur-retention".into()).spawn(move || {
                // SAFETY: setpriority(2) on this thread's own id (Linux gives threads their
                // own nice value); it touches no memory of ours.
                unsafe {
                    let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
                    libc::setpriority(libc::PRIO_PROCESS, tid, 19);
                }
                for old in rx {
                    if let Err(e) = std::fs::remove_dir_all(&old)
                        && e.kind() != std::io::ErrorKind::NotFound
                    {
                        tracing::warn!(dir = %old.display(), error = %e, "removing an old session folder failed");
                    }
                }
            });
            if let Err(e) = spawned {
                tracing::warn!(error = %e, "cannot start the session-folder remover; old folders stay");
            }
            Mutex::new(tx)
        })
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_newest_folders_are_kept_and_the_oldest_given_back_one_by_one() {
        let r = Retention::new(2);
        assert!(r.finish("a".into()).is_empty());
        assert!(r.finish("b".into()).is_empty());
        assert_eq!(r.finish("c".into()), [PathBuf::from("a")]);
        assert_eq!(r.finish("d".into()), [PathBuf::from("b")]);
        let none = Retention::new(0);
        assert_eq!(none.finish("a".into()), [PathBuf::from("a")]);
    }

    #[test]
    fn adopted_folders_go_first_two_per_finished_session() {
        let r = Retention::new(1);
        r.adopt(vec!["old1".into(), "old2".into(), "old3".into()]);
        assert_eq!(r.finish("a".into()), [PathBuf::from("old1"), PathBuf::from("old2")]);
        assert_eq!(r.finish("b".into()), [PathBuf::from("old3"), PathBuf::from("a")]);
        assert_eq!(r.finish("c".into()), [PathBuf::from("b")]);
    }

    #[test]
    fn a_worker_alone_on_its_workdir_adopts_the_folders_there_and_one_beside_another_does_not() {
        let root = tempfile::tempdir().unwrap();
        let sessions = root.path().join("sessions");
        for name in ["ses_2", "ses_1", ".hidden", "notes"] {
            std::fs::create_dir_all(sessions.join(name)).unwrap();
        }
        std::fs::write(sessions.join("stray-file"), "").unwrap();
        let first = Retention::new(0);
        let (held, adopted) = lock_and_adopt(&sessions, &first).unwrap();
        assert_eq!(adopted, 2);
        assert_eq!(first.finish(sessions.join("ses_3")), [sessions.join("ses_1"), sessions.join("ses_2")]);
        // Another worker on the same workdir while the first runs: nothing is adopted.
        let second = Retention::new(0);
        let (_also, adopted) = lock_and_adopt(&sessions, &second).unwrap();
        assert_eq!(adopted, 0);
        assert_eq!(second.finish(sessions.join("ses_4")), [sessions.join("ses_4")]);
        drop(held);
    }

    #[test]
    fn a_folder_past_the_limit_is_removed_from_disk() {
        let root = tempfile::tempdir().unwrap();
        let dirs: Vec<PathBuf> = (0..3).map(|i| root.path().join(format!("ses_{i}"))).collect();
        for d in &dirs {
            std::fs::create_dir_all(d.join("out")).unwrap();
            std::fs::write(d.join("trace.jsonl"), "{}\n").unwrap();
        }
        let r = Retention::new(2);
        for d in &dirs {
            r.finished(d.clone());
        }
        let end = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while dirs[0].exists() {
            assert!(std::time::Instant::now() < end, "the oldest folder was not removed");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(dirs[1].exists() && dirs[2].exists(), "the newest two stay");
    }
}
