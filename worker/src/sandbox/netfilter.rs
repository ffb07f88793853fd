//! The address rules of `sandbox.network` (`loopback`, and `host:port` entries naming an
//! address): Landlock restricts TCP by port only, so these are enforced by nftables on the
//! sockets of a cgroup v2 group that the session's commands join ([`Fence`]).
//!
//! A fence is one group `<cgroup v2 mount><worker's group>/mur-<pid>/net-<n>/` and one
//! table `inet mur_<pid>_<n>` whose `output` chain sends every packet of a socket made
//! inside the group (`socket cgroupv2 level L "<path>"`: the socket's group or an ancestor
//! at depth L is the fence) to a chain that accepts the allowed destinations and rejects
//! the rest (`reject with icmpx admin-prohibited`: a TCP connect fails at once with
//! `EHOSTUNREACH`, "No route to host"). The cgroup v2 hierarchy needs no controller for
//! this, so it serves hosts in hybrid mode too. A command joins the group between fork and
//! exec (one `write(2)` to `cgroup.procs`, opened before the fork), so every socket it or
//! its children make is matched; a sandboxed command cannot leave it (it cannot write
//! anywhere under `/sys`, Landlock).
//!
//! Why nftables: the kernel's other per-process address filters are a cgroup BPF
//! `connect4`/`connect6` program (a BPF toolchain and loader on the worker for a few
//! comparisons) and seccomp user notification (the worker would read the address from the
//! command's memory after the check: racy, not enforcement). The `nft` program is driven
//! with its text syntax: its JSON input (1.0.6, Debian 12) has no `socket cgroupv2` key,
//! and the netlink crates (`rustables`) have no socket expression. `nft` names a group by
//! its path under `/sys/fs/cgroup` and takes its inode number as the id the kernel
//! compares.
//!
//! A fence is made once per session (a few ms: one `nft` run), not per command: joining it
//! costs a command one `write(2)`. Dropping it removes the group and the table once the
//! group is empty; a group still busy (a detached command) keeps its table and is removed
//! by a later sweep. Those of a worker that was killed are removed when the next one
//! starts ([`sweep`]).

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::net::IpAddr;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

/// Where `nft` resolves the cgroup paths of `socket cgroupv2` rules.
const NFT_CGROUP_ROOT: &str = "/sys/fs/cgroup";

/// What a fence lets a command's sockets send to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Allowed {
    /// The loopback addresses (127.0.0.0/8 and ::1), any protocol.
    Loopback,
    /// TCP to these destinations: an address and port, or (`None`) the port on any host.
    Tcp(Vec<(Option<IpAddr>, u16)>),
}

/// The nftables ruleset (`nft -f` text) of a fence: table `inet <table>` whose output
/// chain sends the packets of sockets in the group at `path` (under `/sys/fs/cgroup`,
/// depth `level` in the cgroup v2 hierarchy) to a chain accepting `allowed` and rejecting
/// the rest.
pub fn ruleset(table: &str, path: &str, level: usize, allowed: &Allowed) -> String {
    let mut fence = String::new();
    match allowed {
        Allowed::Loopback => {
            fence.push_str("    ip daddr 127.0.0.0/8 accept\n    ip6 daddr ::1 accept\n");
        }
        Allowed::Tcp(list) => {
            for (host, port) in list {
                match host {
                    None => fence.push_str(&format!("    meta l4proto tcp th dport {port} accept\n")),
                    Some(IpAddr::V4(a)) => fence.push_str(&format!("    ip daddr {a} tcp dport {port} accept\n")),
                    Some(IpAddr::V6(a)) => fence.push_str(&format!("    ip6 daddr {a} tcp dport {port} accept\n")),
                }
            }
        }
    }
    format!(
        "table inet {table} {{\n  chain output {{\n    type filter hook output priority 0; policy accept;\n    \
         socket cgroupv2 level {level} \"{path}\" jump fence\n  }}\n  chain fence {{\n{fence}    \
         reject with icmpx admin-prohibited\n  }}\n}}\n"
    )
}

/// A session's fence: its group (which the session's commands join) and its table.
#[derive(Debug)]
pub struct Fence {
    dir: PathBuf,
    table: String,
    procs: File,
}

impl Fence {
    /// Makes a group and a table letting its sockets reach `allowed` only.
    ///
    /// # Errors
    /// Why it cannot be made, for the `Unenforceable` error naming the rule: no cgroup v2
    /// hierarchy (or one `nft` cannot name), no `nft`, or `nft` refused the table (it needs
    /// root, or `CAP_NET_ADMIN`).
    pub fn make(allowed: &Allowed) -> Result<Fence, String> {
        let v2 = hierarchy()?;
        sweep_busy();
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir = v2.base.join(format!("net-{n}"));
        std::fs::create_dir_all(&v2.base).map_err(|e| format!("cannot make {} ({e})", v2.base.display()))?;
        std::fs::create_dir(&dir).map_err(|e| format!("cannot make {} ({e})", dir.display()))?;
        let table = format!("mur_{}_{n}", std::process::id());
        let made = (|| {
            let procs = dir.join("cgroup.procs");
            let procs = OpenOptions::new()
                .write(true)
                .custom_flags(libc::O_CLOEXEC)
                .open(&procs)
                .map_err(|e| format!("{}: {e}", procs.display()))?;
            let path = dir.strip_prefix(NFT_CGROUP_ROOT).map_err(|_| {
                format!(
                    "nft names cgroups by their path under {NFT_CGROUP_ROOT} and the cgroup v2 hierarchy is mounted at {}",
                    v2.mount.display()
                )
            })?;
            let level = dir.strip_prefix(&v2.mount).map(|p| p.components().count()).unwrap_or(0);
            nft(&ruleset(&table, &path.display().to_string(), level, allowed))?;
            Ok(procs)
        })();
        match made {
            Ok(procs) => Ok(Fence { dir, table, procs }),
            Err(e) => {
                let _ = std::fs::remove_dir(&dir);
                Err(e)
            }
        }
    }

    /// The group's `cgroup.procs` descriptor the child writes `0` to.
    pub fn procs_fd(&self) -> RawFd {
        self.procs.as_raw_fd()
    }

    /// The table's name (`mur_<pid>_<n>`).
    pub fn table(&self) -> &str {
        &self.table
    }
}

impl Drop for Fence {
    fn drop(&mut self) {
        if std::fs::remove_dir(&self.dir).is_ok() {
            let _ = nft(&format!("delete table inet {}\n", self.table));
        } else if self.dir.exists() {
            // Processes remain (a detached command): they stay fenced until a sweep.
            busy().lock().unwrap_or_else(|e| e.into_inner()).push((self.dir.clone(), self.table.clone()));
        }
    }
}

/// Groups left busy when their fence was dropped, with their tables.
fn busy() -> &'static Mutex<Vec<(PathBuf, String)>> {
    static BUSY: Mutex<Vec<(PathBuf, String)>> = Mutex::new(Vec::new());
    &BUSY
}

/// Removes the busy groups that have emptied, and their tables.
fn sweep_busy() {
    let mut busy = busy().lock().unwrap_or_else(|e| e.into_inner());
    busy.retain(|(dir, table)| {
        if std::fs::remove_dir(dir).is_ok() || !dir.exists() {
            let _ = nft(&format!("delete table inet {table}\n"));
            false
        } else {
            true
        }
    });
}

/// The cgroup v2 hierarchy fences go in.
#[derive(Debug)]
struct V2 {
    /// Its mount point.
    mount: PathBuf,
    /// `<mount><worker's group>/mur-<pid>`.
    base: PathBuf,
}

/// Finds it once (and removes the fences of dead workers there).
fn hierarchy() -> Result<&'static V2, String> {
    static V2: OnceLock<Result<V2, String>> = OnceLock::new();
    V2.get_or_init(|| {
        let (mount, own) = find_v2()?;
        // The depth nft is given counts from the true root: refuse a mount of a subtree
        // (a cgroup namespace's), whose root is an ordinary group with a `cgroup.type`.
        if mount.join("cgroup.type").exists() {
            return Err(format!(
                "the cgroup v2 hierarchy at {} is mounted below its root (a cgroup namespace?), so the depth \
                 nftables compares cannot be known",
                mount.display()
            ));
        }
        let parent = mount.join(own.trim_start_matches('/'));
        sweep_dead(&parent);
        Ok(V2 { base: parent.join(format!("mur-{}", std::process::id())), mount })
    })
    .as_ref()
    .map_err(Clone::clone)
}

/// The cgroup v2 mount point and the worker's group in it.
fn find_v2() -> Result<(PathBuf, String), String> {
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let own = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    let mount = mounts
        .lines()
        .find_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            (right.split_whitespace().next()? == "cgroup2").then(|| left.split_whitespace().nth(4)).flatten()
        })
        .map(|m| PathBuf::from(super::cgroup::unescape(m)))
        .ok_or("no cgroup v2 hierarchy is mounted")?;
    let path = super::cgroup::own_path(&own, str::is_empty).ok_or("this process has no cgroup v2 group")?;
    Ok((mount, path))
}

/// The `nft` program: `$MUR_NFT`, else the first of `nft` on `PATH`, `/usr/sbin/nft`,
/// `/sbin/nft`.
fn nft_program() -> Result<PathBuf, String> {
    if let Some(p) = std::env::var_os("MUR_NFT") {
        let p = PathBuf::from(p);
        return if p.is_file() { Ok(p) } else { Err(format!("$MUR_NFT names {}, which is not a file", p.display())) };
    }
    let on_path = std::env::var_os("PATH").into_iter().flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>());
    on_path
        .map(|d| d.join("nft"))
        .chain([PathBuf::from("/usr/sbin/nft"), PathBuf::from("/sbin/nft")])
        .find(|p| p.is_file())
        .ok_or_else(|| "the nft program (Debian's nftables package) is not installed".to_string())
}

/// Runs `nft -f -` on `rules`.
fn nft(rules: &str) -> Result<(), String> {
    let program = nft_program()?;
    let mut child = Command::new(&program)
        .args(["-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run {} ({e})", program.display()))?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin.write_all(rules.as_bytes()).map_err(|e| format!("{}: {e}", program.display()))?;
    }
    let out = child.wait_with_output().map_err(|e| format!("{}: {e}", program.display()))?;
    if out.status.success() {
        return Ok(());
    }
    let err = String::from_utf8_lossy(&out.stderr);
    let first = err.lines().find(|l| !l.trim().is_empty()).unwrap_or("no message");
    Err(format!("nft refused the rules ({}: {first}); it needs root or CAP_NET_ADMIN", out.status))
}

/// Removes the fences of workers that are gone: under `parent` (the worker's cgroup v2
/// group), each `mur-<pid>/net-<n>/` of a dead pid — its processes killed (`cgroup.kill`)
/// — and then `mur-<pid>/` when empty, and the tables `mur_<pid>_<n>` of dead pids.
fn sweep_dead(parent: &Path) {
    let dead = |pid: &str| pid.parse::<u32>().is_ok_and(|p| !Path::new(&format!("/proc/{p}")).exists());
    if let Ok(entries) = std::fs::read_dir(parent) {
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(pid) = name.to_str().and_then(|n| n.strip_prefix("mur-")) else { continue };
            if !dead(pid) {
                continue;
            }
            let Ok(children) = std::fs::read_dir(entry.path()) else { continue };
            for child in children.flatten().filter(|c| c.file_name().to_string_lossy().starts_with("net-")) {
                let _ = std::fs::write(child.path().join("cgroup.kill"), "1");
                let _ = std::fs::remove_dir(child.path());
            }
            let _ = std::fs::remove_dir(entry.path());
        }
    }
    let Ok(program) = nft_program() else { return };
    let Ok(out) = Command::new(program).args(["list", "tables", "inet"]).stderr(Stdio::null()).output() else {
        return;
    };
    let mut delete = String::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Some(table) = line.trim().strip_prefix("table inet ") else { continue };
        let Some(pid) = table.strip_prefix("mur_").and_then(|t| t.split('_').next()) else { continue };
        // Its group gone (a group still dying keeps its table until the next sweep).
        let n = table.rsplit('_').next().unwrap_or("");
        if dead(pid) && !parent.join(format!("mur-{pid}/net-{n}")).exists() {
            delete.push_str(&format!("delete table inet {table}\n"));
        }
    }
    if !delete.is_empty() {
        let _ = nft(&delete);
    }
}

/// Whether this host can make fences: `Ok` after making and removing one, else why not
/// (the reason an address rule would fail closed with).
///
/// # Errors
/// Those of [`Fence::make`].
pub fn available() -> Result<(), String> {
    Fence::make(&Allowed::Loopback).map(drop)
}

/// Removes what killed workers left (their fences' groups and tables); a no-op where no
/// fence can be made. Called when a worker starts.
pub fn sweep() {
    let _ = hierarchy();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_loopback_ruleset_accepts_loopback_destinations_and_rejects_the_rest() {
        let text = ruleset("mur_1_0", "unified/mur-1/net-0", 2, &Allowed::Loopback);
        assert_eq!(
            text,
            "table inet mur_1_0 {\n  chain output {\n    type filter hook output priority 0; policy accept;\n    \
             socket cgroupv2 level 2 \"unified/mur-1/net-0\" jump fence\n  }\n  chain fence {\n    \
             ip daddr 127.0.0.0/8 accept\n    ip6 daddr ::1 accept\n    reject with icmpx admin-prohibited\n  }\n}\n"
        );
    }

    #[test]
    fn an_endpoint_list_accepts_tcp_to_each_address_and_port_or_the_port_anywhere() {
        let list = vec![(Some("127.0.0.1".parse().unwrap()), 8080), (Some("::1".parse().unwrap()), 80), (None, 443)];
        let text = ruleset("t", "p", 1, &Allowed::Tcp(list));
        let fence: Vec<&str> = text.lines().skip_while(|l| !l.contains("chain fence")).skip(1).collect();
        assert_eq!(
            fence,
            [
                "    ip daddr 127.0.0.1 tcp dport 8080 accept",
                "    ip6 daddr ::1 tcp dport 80 accept",
                "    meta l4proto tcp th dport 443 accept",
                "    reject with icmpx admin-prohibited",
                "  }",
                "}"
            ]
        );
    }
}
