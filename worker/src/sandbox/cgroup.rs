//! Control groups for `sandbox.memory_mb` and `sandbox.pids`: one group per command, so the
//! limits hold for all the processes of that command together — the honest meaning of "per
//! command". (`RLIMIT_NPROC` counts every process of the user, and root ignores it;
//! `RLIMIT_AS` limits each process's address space, not its memory, and breaks programs
//! that reserve large mappings.)
//!
//! Both hierarchies are served: cgroup v1 (a `pids` and a `memory` hierarchy, as on hosts
//! booted in hybrid mode) and cgroup v2 when the worker's own group delegates the
//! controllers to its children. The worker makes `<its group>/mur-<pid>/` once, then
//! `cmd-<n>/` per command with the limits written; the child joins the group between fork
//! and exec by writing `0` to the `cgroup.procs` file opened for it before the fork (one
//! `write(2)`), so nothing it runs escapes the limits. A group whose processes are gone
//! goes back to a pool and serves a later command with the same limits (making and
//! removing a group costs more than the rest of the sandbox: see `tests/benches/sandbox.rs`);
//! one still busy (a detached command) is removed by a later sweep.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

/// A resource controller.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Controller {
    /// `pids`: processes and threads.
    Pids,
    /// `memory`: resident memory and swap.
    Memory,
}

impl Controller {
    fn name(self) -> &'static str {
        match self {
            Controller::Pids => "pids",
            Controller::Memory => "memory",
        }
    }
}

/// Where the groups of one controller go.
#[derive(Clone, Debug)]
struct Hierarchy {
    /// `<mount><own group>/mur-<pid>`.
    parent: PathBuf,
    /// cgroup v2 (`memory.max`) rather than v1 (`memory.limit_in_bytes`).
    v2: bool,
}

/// The cgroup hierarchies this process can make command groups in, found once.
#[derive(Debug)]
pub struct Groups {
    pids: Result<Hierarchy, String>,
    memory: Result<Hierarchy, String>,
    /// Groups left busy when their command was done with (detached commands).
    leftovers: Mutex<Vec<PathBuf>>,
    /// Empty groups ready for another command, with their limits.
    pool: Mutex<Vec<(Limits, Vec<PathBuf>)>>,
}

/// The limits a group was made with: `memory_mb`, `pids`.
type Limits = (Option<u64>, Option<u32>);

/// How many empty groups the pool keeps; more are removed.
const POOL: usize = 64;

/// The groups of this process (probed at first use).
pub fn groups() -> &'static Groups {
    static GROUPS: OnceLock<Groups> = OnceLock::new();
    GROUPS.get_or_init(|| {
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let own = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
        Groups {
            pids: hierarchy(Controller::Pids, &mounts, &own),
            memory: hierarchy(Controller::Memory, &mounts, &own),
            leftovers: Mutex::new(Vec::new()),
            pool: Mutex::new(Vec::new()),
        }
    })
}

impl Groups {
    /// `Ok` with `v1` or `v2` when commands can get a group with `controller`, else why not.
    ///
    /// # Errors
    /// Why no group can be made: no hierarchy has the controller, or it is not writable.
    pub fn check(&self, controller: Controller) -> Result<&'static str, String> {
        let h = self.of(controller).as_ref().map_err(Clone::clone)?;
        Ok(if h.v2 { "cgroup v2" } else { "cgroup v1" })
    }

    fn of(&self, controller: Controller) -> &Result<Hierarchy, String> {
        match controller {
            Controller::Pids => &self.pids,
            Controller::Memory => &self.memory,
        }
    }

    /// Makes a group per controller asked for, with the limits set, and opens their
    /// `cgroup.procs` for the child to join.
    ///
    /// # Errors
    /// A message naming the file that could not be made or written.
    pub fn make(&self, memory_mb: Option<u64>, pids: Option<u32>) -> Result<CommandGroup, String> {
        let limits = (memory_mb, pids);
        if let Some(group) = self.reuse(limits) {
            return Ok(group);
        }
        self.sweep();
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let name = format!("cmd-{}", NEXT.fetch_add(1, Ordering::Relaxed));
        let mut group = CommandGroup { dirs: Vec::new(), procs: Vec::new(), limits };
        // The same directory serves both controllers when they share a hierarchy (v2).
        let mut add = |controller: Controller, limits: &[(&str, String)]| -> Result<(), String> {
            let h = self.of(controller).as_ref().map_err(Clone::clone)?;
            let dir = h.parent.join(&name);
            if !group.dirs.contains(&dir) {
                std::fs::create_dir(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
                group.dirs.push(dir.clone());
                group.procs.push(open_procs(&dir)?);
            }
            for (file, value) in limits {
                let path = dir.join(file);
                if file.contains("swap") || file.contains("memsw") {
                    // Present only when the kernel accounts swap.
                    if !path.exists() {
                        continue;
                    }
                }
                std::fs::write(&path, value).map_err(|e| format!("{}: {e}", path.display()))?;
            }
            Ok(())
        };
        if let Some(mb) = memory_mb {
            let bytes = (mb * 1024 * 1024).to_string();
            let v2 = self.memory.as_ref().is_ok_and(|h| h.v2);
            let limits: Vec<(&str, String)> = if v2 {
                vec![("memory.max", bytes), ("memory.swap.max", "0".into())]
            } else {
                vec![("memory.limit_in_bytes", bytes.clone()), ("memory.memsw.limit_in_bytes", bytes)]
            };
            add(Controller::Memory, &limits)?;
        }
        if let Some(n) = pids {
            add(Controller::Pids, &[("pids.max", n.to_string())])?;
        }
        Ok(group)
    }

    /// A pooled group made with `limits`, its `cgroup.procs` opened again.
    fn reuse(&self, limits: Limits) -> Option<CommandGroup> {
        let dirs = {
            let mut pool = self.pool.lock().unwrap_or_else(|e| e.into_inner());
            let i = pool.iter().position(|(l, _)| *l == limits)?;
            pool.swap_remove(i).1
        };
        let procs: Result<Vec<File>, String> = dirs.iter().map(|d| open_procs(d)).collect();
        match procs {
            Ok(procs) => Some(CommandGroup { dirs, procs, limits }),
            Err(_) => {
                for d in dirs {
                    let _ = std::fs::remove_dir(d);
                }
                None
            }
        }
    }

    /// Removes the groups left busy earlier whose processes are gone.
    fn sweep(&self) {
        let mut left = self.leftovers.lock().unwrap_or_else(|e| e.into_inner());
        left.retain(|dir| std::fs::remove_dir(dir).is_err() && dir.exists());
    }
}

/// The groups of one command: joined by the child, removed when dropped (or swept later
/// while processes remain).
#[derive(Debug)]
pub struct CommandGroup {
    dirs: Vec<PathBuf>,
    procs: Vec<File>,
    limits: Limits,
}

impl CommandGroup {
    /// The `cgroup.procs` descriptors the child writes `0` to.
    pub fn procs_fds(&self) -> Vec<RawFd> {
        self.procs.iter().map(AsRawFd::as_raw_fd).collect()
    }

    /// The peak process count of the group (`pids.peak`), when the kernel keeps it.
    pub fn pids_peak(&self) -> Option<u64> {
        self.dirs.iter().find_map(|d| std::fs::read_to_string(d.join("pids.peak")).ok()?.trim().parse().ok())
    }
}

impl Drop for CommandGroup {
    fn drop(&mut self) {
        self.procs.clear();
        let empty = self.dirs.iter().all(|d| std::fs::read(d.join("cgroup.procs")).is_ok_and(|p| p.is_empty()));
        if empty {
            let mut pool = groups().pool.lock().unwrap_or_else(|e| e.into_inner());
            if pool.len() < POOL {
                pool.push((self.limits, std::mem::take(&mut self.dirs)));
                return;
            }
        }
        for dir in self.dirs.drain(..) {
            if std::fs::remove_dir(&dir).is_err() && dir.exists() {
                groups().leftovers.lock().unwrap_or_else(|e| e.into_inner()).push(dir);
            }
        }
    }
}

/// Opens `<dir>/cgroup.procs` for writing (closed on exec).
fn open_procs(dir: &Path) -> Result<File, String> {
    let procs = dir.join("cgroup.procs");
    OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(&procs)
        .map_err(|e| format!("{}: {e}", procs.display()))
}

/// Joins the groups: writes `0` (this process) to each `cgroup.procs` descriptor. Runs in
/// the child between fork and exec: one `write(2)` each, no allocation.
///
/// # Errors
/// The OS error of a write.
pub fn join(fds: &[RawFd]) -> io::Result<()> {
    for &fd in fds {
        // SAFETY: a write of a static byte to a descriptor of ours.
        if unsafe { libc::write(fd, b"0".as_ptr().cast(), 1) } != 1 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Finds where `controller`'s command groups go: its v1 hierarchy if one is mounted, else
/// the v2 hierarchy when the worker's group offers the controller to its children; makes
/// `mur-<pid>/` there (sweeping those of dead workers).
fn hierarchy(controller: Controller, mountinfo: &str, own: &str) -> Result<Hierarchy, String> {
    let name = controller.name();
    let (mount, path, v2) = find(name, mountinfo, own).ok_or_else(|| {
        format!("no cgroup hierarchy offers the {name} controller (none is mounted, or cgroup v2 does not delegate it)")
    })?;
    let base = mount.join(path.trim_start_matches('/'));
    if v2 {
        let offered = std::fs::read_to_string(base.join("cgroup.subtree_control")).unwrap_or_default();
        if !offered.split_whitespace().any(|c| c == name) {
            // Offer it to the children: refused while the worker's own group holds
            // processes (cgroup v2's no-internal-process rule) unless it is the root.
            std::fs::write(base.join("cgroup.subtree_control"), format!("+{name}")).map_err(|e| {
                format!(
                    "the worker's cgroup {} does not delegate the {name} controller and cannot be made to ({e}); \
                     start the worker in a cgroup whose subtree is delegated",
                    base.display()
                )
            })?;
        }
    }
    let parent = base.join(format!("mur-{}", std::process::id()));
    sweep_dead_workers(&base);
    match std::fs::create_dir(&parent) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(format!("cannot make {} ({e})", parent.display())),
    }
    if v2 {
        let _ = std::fs::write(parent.join("cgroup.subtree_control"), format!("+{name}"));
    }
    Ok(Hierarchy { parent, v2 })
}

/// The mount point, the worker's group path in it, and whether it is v2.
fn find(controller: &str, mountinfo: &str, own: &str) -> Option<(PathBuf, String, bool)> {
    let mut v2_mount = None;
    for line in mountinfo.lines() {
        // `… <mount point> <options> … - <fstype> <source> <super options>`
        let Some((left, right)) = line.split_once(" - ") else { continue };
        let Some(mount_point) = left.split_whitespace().nth(4) else { continue };
        let mut right = right.split_whitespace();
        let fstype = right.next().unwrap_or("");
        let options = right.nth(1).unwrap_or("");
        if fstype == "cgroup" && options.split(',').any(|o| o == controller) {
            let path = own_path(own, |ctrls| ctrls.split(',').any(|c| c == controller))?;
            return Some((PathBuf::from(unescape(mount_point)), path, false));
        }
        if fstype == "cgroup2" && v2_mount.is_none() {
            v2_mount = Some(PathBuf::from(unescape(mount_point)));
        }
    }
    let mount = v2_mount?;
    let path = own_path(own, str::is_empty)?;
    let offered = std::fs::read_to_string(mount.join(path.trim_start_matches('/')).join("cgroup.controllers")).ok()?;
    offered.split_whitespace().any(|c| c == controller).then_some((mount, path, true))
}

/// The worker's group path in the hierarchy whose controller list matches, from
/// `/proc/self/cgroup` lines `<id>:<controllers>:<path>`.
pub(super) fn own_path(own: &str, matches: impl Fn(&str) -> bool) -> Option<String> {
    own.lines().find_map(|line| {
        let mut parts = line.splitn(3, ':');
        let (_, ctrls, path) = (parts.next()?, parts.next()?, parts.next()?);
        matches(ctrls).then(|| path.to_string())
    })
}

/// Mount points in `mountinfo` escape spaces and the like as `\040`.
pub(super) fn unescape(s: &str) -> String {
    s.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")
}

/// Removes the empty `mur-<pid>/` groups (and their empty `cmd-*/`) of workers that are gone.
fn sweep_dead_workers(base: &Path) {
    let Ok(entries) = std::fs::read_dir(base) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.strip_prefix("mur-")).and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        if let Ok(children) = std::fs::read_dir(entry.path()) {
            for child in children.flatten() {
                if child.path().is_dir() {
                    let _ = std::fs::remove_dir(child.path());
                }
            }
        }
        let _ = std::fs::remove_dir(entry.path());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MOUNTS: &str = "\
30 25 0:26 / /sys/fs/cgroup rw - tmpfs tmpfs rw,mode=755
31 30 0:27 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
32 30 0:28 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
33 30 0:29 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
";

    #[test]
    fn a_v1_hierarchy_is_found_with_the_workers_own_path() {
        let own = "8:pids:/\n4:memory:/process_api/abc\n0::/\n";
        let (mount, path, v2) = find("memory", MOUNTS, own).unwrap();
        assert_eq!((mount, path.as_str(), v2), (PathBuf::from("/sys/fs/cgroup/memory"), "/process_api/abc", false));
        let (mount, path, _) = find("pids", MOUNTS, own).unwrap();
        assert_eq!((mount, path.as_str()), (PathBuf::from("/sys/fs/cgroup/pids"), "/"));
    }

    #[test]
    fn an_empty_group_serves_the_next_command_with_the_same_limits_and_a_busy_one_does_not() {
        let g = groups();
        if let Err(e) = g.check(Controller::Pids) {
            println!("no pids hierarchy on this host ({e}): the fail-closed path is tested in sandbox::tests");
            return;
        }
        let first = g.make(None, Some(7)).unwrap();
        let dirs = first.dirs.clone();
        drop(first);
        let second = g.make(None, Some(7)).unwrap();
        assert_eq!(second.dirs, dirs, "reused");
        let other = g.make(None, Some(9)).unwrap();
        assert_ne!(other.dirs, dirs);
        assert_eq!(std::fs::read_to_string(other.dirs[0].join("pids.max")).unwrap().trim(), "9");
        // A process still in the group (a detached command) keeps it out of the pool.
        let mut child = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        std::fs::write(second.dirs[0].join("cgroup.procs"), child.id().to_string()).unwrap();
        drop(second);
        let third = g.make(None, Some(7)).unwrap();
        assert_ne!(third.dirs, dirs, "a busy group is not handed out again");
        child.kill().unwrap();
        child.wait().unwrap();
    }

    #[test]
    fn own_path_reads_the_line_of_the_matching_hierarchy() {
        let own = "9:name=systemd:/\n8:pids,foo:/a\n0::/b\n";
        assert_eq!(own_path(own, |c| c.split(',').any(|x| x == "pids")).as_deref(), Some("/a"));
        assert_eq!(own_path(own, str::is_empty).as_deref(), Some("/b"));
    }
}
