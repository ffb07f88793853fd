//! Which finished session folders a worker keeps: its newest [`Config::keep_sessions`]
//! (default 1000), so a long-lived worker's disk and inodes stay bounded — every task makes
//! a folder (`MURMUR.md`, `trace.jsonl`, `out/`, `logs/`), and the cluster keeps what
//! matters elsewhere (the trace in `MUR_TRACE`, checkpoints and conversations in
//! `mur_sessions`, detached commands' logs in the object store).
//!
//! A folder is *finished* when its session has ended and no detached command of it still
//! runs (a command's log is written in the folder until it ends). Folders are removed one
//! at a time, oldest first, as others finish: never a bulk removal, which on a journal-less
//! ext4 slows the file creations of the next minute (`docs/ARCHITECTURE.md` §Speed). Only
//! folders this worker process finished are counted and removed: another worker on the
//! same machine may share the workdir, and its running sessions are not ours to judge.
//!
//! [`Config::keep_sessions`]: super::Config::keep_sessions

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::Mutex;

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
    /// the caller to remove.
    pub fn finish(&self, dir: PathBuf) -> Vec<PathBuf> {
        let mut finished = self.finished.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        finished.push_back(dir);
        let over = finished.len().saturating_sub(self.keep);
        finished.drain(..over).collect()
    }

    /// [`Retention::finish`], then removes what falls past the limit (on a blocking thread;
    /// a failure is logged, the folder stays).
    pub async fn finished(&self, dir: PathBuf) {
        for old in self.finish(dir) {
            let removed = tokio::task::spawn_blocking({
                let old = old.clone();
                move || std::fs::remove_dir_all(old)
            })
            .await;
            if let Ok(Err(e)) = removed
                && e.kind() != std::io::ErrorKind::NotFound
            {
                tracing::warn!(dir = %old.display(), error = %e, "removing an old session folder failed");
            }
        }
    }
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

    #[tokio::test]
    async fn a_folder_past_the_limit_is_removed_from_disk() {
        let root = tempfile::tempdir().unwrap();
        let dirs: Vec<PathBuf> = (0..3).map(|i| root.path().join(format!("ses_{i}"))).collect();
        for d in &dirs {
            std::fs::create_dir_all(d.join("out")).unwrap();
            std::fs::write(d.join("trace.jsonl"), "{}\n").unwrap();
        }
        let r = Retention::new(2);
        for d in &dirs {
            r.finished(d.clone()).await;
        }
        assert_eq!(dirs.iter().map(|d| d.exists()).collect::<Vec<_>>(), [false, true, true]);
        // A folder already gone is not an error.
        std::fs::remove_dir_all(&dirs[1]).unwrap();
        r.finished(root.path().join("ses_3")).await;
    }
}
