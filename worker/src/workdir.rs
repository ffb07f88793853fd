//! Where a session's files go (the runtime reference, §5, "Result / workdir";
//! issue #2): with `--workdir DIR` the accessible workdir is `DIR` and the session folder
//! `DIR/.murmur/<session_id>/`, so several sessions can share one workdir; without it both
//! are `<capsule dir>/workdir/<session_id>/`.

use std::path::{Path, PathBuf};

/// The paths of one session.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    /// Where commands run and `task.md` lives.
    pub workdir: PathBuf,
    /// `MURMUR.md`, `trace.jsonl`, `out/`, `logs/`.
    pub session_dir: PathBuf,
}

impl Layout {
    /// The layout of `session_id` for a capsule in `capsule_dir`.
    pub fn new(capsule_dir: &Path, workdir: Option<&Path>, session_id: &str) -> Self {
        match workdir {
            Some(dir) => Layout { workdir: dir.to_path_buf(), session_dir: dir.join(".murmur").join(session_id) },
            None => {
                let dir = capsule_dir.join("workdir").join(session_id);
                Layout { workdir: dir.clone(), session_dir: dir }
            }
        }
    }

    /// Creates the folders.
    ///
    /// # Errors
    /// The IO error, with the path.
    pub fn create(&self) -> std::io::Result<()> {
        let (out, logs, workdir_logs) = (self.out_dir(), self.logs_dir(), self.workdir_logs());
        let mut made: Vec<&Path> = Vec::with_capacity(5);
        // Each folder once (the workdir is the session folder without `--workdir`, and
        // their `logs/` then one): every mkdir of a new inode costs (issue #9).
        for d in [&self.workdir, &self.session_dir, &out, &logs, &workdir_logs] {
            if made.contains(&d.as_path()) {
                continue;
            }
            std::fs::create_dir_all(d).map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", d.display())))?;
            made.push(d);
        }
        Ok(())
    }

    /// `<session>/trace.jsonl`.
    pub fn trace(&self) -> PathBuf {
        self.session_dir.join("trace.jsonl")
    }

    /// `<session>/out`.
    pub fn out_dir(&self) -> PathBuf {
        self.session_dir.join("out")
    }

    /// `<session>/out/result.txt`.
    pub fn result(&self) -> PathBuf {
        self.out_dir().join("result.txt")
    }

    /// `<session>/logs`.
    pub fn logs_dir(&self) -> PathBuf {
        self.session_dir.join("logs")
    }

    /// `<workdir>/logs`: full outputs of truncated shell streams.
    pub fn workdir_logs(&self) -> PathBuf {
        self.workdir.join("logs")
    }

    /// `<session>/MURMUR.md`.
    pub fn murmur_md(&self) -> PathBuf {
        self.session_dir.join("MURMUR.md")
    }
}

/// Finds a session's folder under `workdir` by SESSION as `mur trace` accepts it: `None`
/// for the latest, a path (contains `/` or ends `.jsonl`) to a folder or its
/// `trace.jsonl`, a full id, or a unique suffix. Looks in `<workdir>/<id>/` and
/// `<workdir>/.murmur/<id>/`. Returns the session folder.
///
/// # Errors
/// A message saying what was not found or was ambiguous.
pub fn find_session(workdir: &Path, session: Option<&str>) -> Result<PathBuf, String> {
    if let Some(s) = session
        && (s.contains('/') || s.ends_with(".jsonl"))
    {
        let p = PathBuf::from(s);
        let dir = if p.is_dir() { p } else { p.parent().map(Path::to_path_buf).unwrap_or_default() };
        if dir.join("trace.jsonl").is_file() {
            return Ok(dir);
        }
        return Err(format!("no trace.jsonl at {s}"));
    }
    let mut sessions: Vec<(String, PathBuf)> = Vec::new();
    for base in [workdir.to_path_buf(), workdir.join(".murmur")] {
        let Ok(entries) = std::fs::read_dir(&base) else {
            continue;
        };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with("ses_") && e.path().join("trace.jsonl").is_file() {
                sessions.push((name, e.path()));
            }
        }
    }
    sessions.sort();
    match session {
        None => sessions.pop().map(|(_, p)| p).ok_or_else(|| format!("no sessions under {}", workdir.display())),
        Some(s) => {
            let matches: Vec<_> = sessions.iter().filter(|(id, _)| id == s || id.ends_with(s)).collect();
            match matches.as_slice() {
                [] => Err(format!("no session matching {s:?} under {}", workdir.display())),
                [(_, p)] => Ok(p.clone()),
                many => Err(format!(
                    "{s:?} matches {} sessions ({}); give more characters",
                    many.len(),
                    many.iter().map(|(id, _)| id.as_str()).collect::<Vec<_>>().join(", ")
                )),
            }
        }
    }
}
