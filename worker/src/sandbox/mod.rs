//! The sandbox of a capsule's commands (issue #37): every process a sandboxed capsule starts
//! — shell commands, command tools, hooks — runs confined by the kernel, whatever it does.
//!
//! A session's [`Confinement`] is prepared once, before any command runs, from the
//! manifest's `sandbox:` block ([`mur_proto::manifest::Sandbox`]): the Landlock ruleset
//! (built by the `landlock` crate, kept as a descriptor) and the seccomp programs (compiled
//! by `seccompiler`). What the kernel cannot enforce fails the preparation, naming the rule
//! — never a silent run without it. Each command then gets, between fork and exec
//! ([`Confinement::confine`]): its control groups for `memory_mb` and `pids` ([`cgroup`])
//! and the session's fence for address rules ([`netfilter`]),
//! `RLIMIT_CPU` for `cpu_secs`, `no_new_privs`, the Landlock domain and the seccomp filters.
//! Only system calls run there (a `write(2)` per group, `setrlimit`, `prctl`,
//! `landlock_restrict_self`, `seccomp`): nothing allocates or locks, so it is safe in the
//! child of a multi-threaded process.
//!
//! What a command may touch:
//! - read and execute: the system's programs and libraries ([`SYSTEM_READ`]), the capsule
//!   folder, and `sandbox.read`;
//! - read and write: the folder commands run in, the session folder, and `sandbox.write`;
//!   `/dev/null`, `/dev/zero` and `/dev/full`;
//! - network ([`mur_proto::manifest::Network`]): `none` leaves no socket but `AF_UNIX`
//!   (seccomp) and no TCP bind or connect (Landlock); a list leaves TCP connections to its
//!   ports only (Landlock ABI 4) and no UDP or raw sockets (seccomp). Landlock restricts TCP
//!   by port, not by address, so `loopback` and entries naming an address (`127.0.0.1:8080`)
//!   are enforced by a fence ([`netfilter`]: nftables on the sockets of a cgroup v2 group
//!   the commands join); `loopback` leaves TCP and UDP sockets (seccomp) whose packets the
//!   fence lets reach loopback addresses only. Entries naming a host by name fail closed.
//!
//! Also, best effort (reported in the `sandbox` trace line, not asked by the manifest):
//! Landlock's scoping (ABI 6) keeps a command from signalling processes outside its domain
//! (the worker, other commands) and from reaching abstract Unix sockets made outside it.

pub mod cgroup;
pub mod netfilter;
mod seccomp;

use cgroup::Controller;
use landlock::{
    ABI, Access, AccessFs, AccessNet, CompatLevel, Compatible, NetPort, PathBeneath, PathFd, Ruleset, RulesetAttr,
    RulesetCreatedAttr, Scope,
};
use mur_proto::manifest::{Endpoint, Network, Sandbox};
use netfilter::{Allowed, Fence};
use seccompiler::BpfProgram;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Paths every sandboxed command may read and execute: where Debian and its kin keep
/// programs, shared libraries and the loader's and name service's configuration. Missing
/// ones are skipped.
pub const SYSTEM_READ: [&str; 23] = [
    "/bin",
    "/sbin",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/usr/bin",
    "/usr/sbin",
    "/usr/lib",
    "/usr/lib32",
    "/usr/lib64",
    "/usr/libexec",
    "/usr/local/bin",
    "/usr/local/lib",
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/alternatives",
    "/etc/localtime",
    "/etc/passwd",
    "/etc/group",
    "/etc/nsswitch.conf",
    "/etc/hosts",
];

/// Devices every sandboxed command may read and write.
const DEVICES_RW: [&str; 3] = ["/dev/null", "/dev/zero", "/dev/full"];

/// Devices every sandboxed command may read.
const DEVICES_READ: [&str; 2] = ["/dev/random", "/dev/urandom"];

/// The Landlock ABI whose filesystem rights the ruleset handles at least: ABI 3 (Linux 6.2)
/// is the first to govern truncation, without which a command could empty any file it
/// can name.
const MIN_FS_ABI: i32 = 3;

/// The Landlock ABI of TCP port rules (Linux 6.7).
const NET_ABI: i32 = 4;

/// Why a capsule's commands cannot run sandboxed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The kernel (or murmur's sandbox) cannot enforce a rule the manifest asks for.
    #[error("{rule} cannot be enforced on this machine: {why}")]
    Unenforceable {
        /// The manifest rule (`sandbox.network`, `sandbox.pids`, `sandbox.read` …).
        rule: String,
        /// What is missing.
        why: String,
    },
    /// The worker runs only sandboxed capsules (`mur worker --require-sandbox`).
    #[error(
        "this worker requires a sandbox (mur worker --require-sandbox) and capsule {capsule:?} has no sandbox: block"
    )]
    Required {
        /// The capsule's name.
        capsule: String,
    },
    /// The ruleset or the filters could not be built.
    #[error("cannot set up the sandbox: {0}")]
    Setup(String),
}

/// What this kernel offers, probed once per process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Kernel {
    /// The Landlock ABI version (`landlock_create_ruleset` with the version flag); 0
    /// when Landlock is missing or disabled.
    pub landlock_abi: i32,
    /// Whether seccomp filters can be installed.
    pub seccomp: bool,
}

impl Kernel {
    /// This kernel's features.
    pub fn probe() -> Kernel {
        // SAFETY: the version query passes no memory (a null attribute of size 0).
        let abi = unsafe {
            libc::syscall(libc::SYS_landlock_create_ruleset, std::ptr::null::<u8>(), 0usize, 1u32 /* VERSION */)
        };
        Kernel { landlock_abi: abi.max(0) as i32, seccomp: seccomp::available() }
    }
}

/// The folders of one session that its commands always reach.
#[derive(Clone, Debug)]
pub struct Folders {
    /// Where commands run: readable and writable; relative paths resolve against it.
    pub workdir: PathBuf,
    /// The session folder: readable and writable.
    pub session_dir: PathBuf,
    /// The capsule folder (its tools and hook programs): readable.
    pub capsule_dir: PathBuf,
}

impl Folders {
    /// The capsule home, `<workdir>/.capsule-home` (`$HOME` of shell commands): what `~`
    /// stands for in `sandbox.read` and `sandbox.write`.
    pub fn home(&self) -> PathBuf {
        self.workdir.join(crate::tools::shell::HOME_DIR)
    }

    /// What of the capsule folder commands may read: the folder, or, when the sessions'
    /// folders lie inside it (`mur run` keeps them in `<capsule>/workdir/`), each of its
    /// entries but the one holding them — other sessions' folders stay out of reach.
    fn capsule_paths(&self) -> Vec<PathBuf> {
        let holds = |p: &Path| self.workdir.starts_with(p) || self.session_dir.starts_with(p);
        if !holds(&self.capsule_dir) {
            return vec![self.capsule_dir.clone()];
        }
        let Ok(entries) = std::fs::read_dir(&self.capsule_dir) else { return Vec::new() };
        let mut paths: Vec<PathBuf> = entries.flatten().map(|e| e.path()).filter(|p| !holds(p)).collect();
        paths.sort();
        paths
    }

    /// Whether `path` is one of the folders.
    fn contains(&self, path: &Path) -> bool {
        [&self.workdir, &self.session_dir, &self.capsule_dir].iter().any(|f| f.as_path() == path)
    }

    /// `path` as written in the manifest, made absolute: `~` and `~/…` under the capsule
    /// home, a relative path under the workdir.
    pub fn resolve(&self, path: &str) -> PathBuf {
        if path == "~" {
            return self.home();
        }
        if let Some(rest) = path.strip_prefix("~/") {
            return self.home().join(rest);
        }
        let p = Path::new(path);
        if p.is_absolute() { p.to_path_buf() } else { self.workdir.join(p) }
    }
}

/// The rules a command runs under, for its `sandbox` trace line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Applied {
    /// Readable paths besides the system's: the capsule folder and `sandbox.read`, resolved
    /// (missing ones left out).
    pub read: Vec<String>,
    /// Writable paths: the workdir, the session folder and `sandbox.write`, resolved.
    pub write: Vec<String>,
    /// `sandbox.network` as written: `none`, `loopback` or the `[host:port, …]` list.
    pub network: String,
    /// `sandbox.memory_mb`.
    pub memory_mb: Option<u64>,
    /// `sandbox.pids`.
    pub pids: Option<u32>,
    /// `sandbox.cpu_secs`.
    pub cpu_secs: Option<u64>,
    /// The kernel's Landlock ABI.
    pub landlock_abi: u32,
    /// The mechanisms in force: `landlock`, `landlock-scope` (ABI 6),
    /// `seccomp`, `no_new_privs`, `rlimit-cpu`, `cgroup v1`/`cgroup v2`, `nftables`.
    pub enforced_by: Vec<String>,
}

/// A session's sandbox, ready to confine its commands.
#[derive(Debug)]
pub struct Confinement {
    /// The block it was prepared from, with the folders and kernel ([`Confinement::reaching`]).
    sandbox: Sandbox,
    folders: Folders,
    kernel: Kernel,
    /// The address rules' fence, when `network` has some.
    fence: Option<Fence>,
    ruleset: OwnedFd,
    filters: Arc<Vec<BpfProgram>>,
    memory_mb: Option<u64>,
    pids: Option<u32>,
    cpu_secs: Option<u64>,
    applied: Applied,
}

/// The session's confinement: `None` for a capsule without a `sandbox:` block (unless
/// `require` — `mur worker --require-sandbox` — refuses it), else [`Confinement::prepare`]
/// on this kernel.
///
/// # Errors
/// [`Error::Required`]; the errors of [`Confinement::prepare`].
pub fn for_session(
    manifest: &mur_proto::Manifest,
    folders: &Folders,
    require: bool,
) -> Result<Option<Arc<Confinement>>, Error> {
    match &manifest.sandbox {
        None if require => Err(Error::Required { capsule: manifest.name.clone() }),
        None => Ok(None),
        Some(sandbox) => Confinement::prepare(sandbox, folders, Kernel::probe()).map(|c| Some(Arc::new(c))),
    }
}

/// Checks that `kernel` (and this host's control groups, through `cgroups`) can enforce
/// every rule of `sandbox`; returns the mechanisms that will.
///
/// # Errors
/// [`Error::Unenforceable`] naming the first rule that cannot be enforced.
pub fn check(
    sandbox: &Sandbox,
    kernel: Kernel,
    cgroups: impl Fn(Controller) -> Result<&'static str, String>,
) -> Result<Vec<String>, Error> {
    let fail = |rule: &str, why: String| Error::Unenforceable { rule: rule.to_string(), why };
    if kernel.landlock_abi < MIN_FS_ABI {
        return Err(fail(
            "sandbox (its filesystem rules)",
            format!("Landlock ABI {MIN_FS_ABI} (Linux 6.2) is needed, the kernel offers {}", abi_text(kernel)),
        ));
    }
    if !kernel.seccomp {
        return Err(fail("sandbox (its system call filter)", "the kernel takes no seccomp filters".into()));
    }
    let fence = fence_of(&sandbox.network)?;
    if matches!(sandbox.network, Network::Allow(_)) && kernel.landlock_abi < NET_ABI {
        return Err(fail(
            "sandbox.network",
            format!("TCP port rules need Landlock ABI {NET_ABI} (Linux 6.7), the kernel offers {}", abi_text(kernel)),
        ));
    }
    let mut by = vec!["landlock".to_string(), "seccomp".to_string(), "no_new_privs".to_string()];
    if kernel.landlock_abi >= 6 {
        by.push("landlock-scope".into());
    }
    if sandbox.cpu_secs.is_some() {
        by.push("rlimit-cpu".into());
    }
    for (asked, controller, rule) in [
        (sandbox.memory_mb.is_some(), Controller::Memory, "sandbox.memory_mb"),
        (sandbox.pids.is_some(), Controller::Pids, "sandbox.pids"),
    ] {
        if asked {
            let how = cgroups(controller).map_err(|why| fail(rule, why))?;
            if let Some((net_rule, _)) = &fence
                && how == "cgroup v2"
            {
                // A process is in one cgroup v2 group: the command's own (for the limit) or
                // the session's fence (for the address rule), not both.
                return Err(fail(
                    net_rule,
                    format!(
                        "its address rule needs the session's cgroup v2 group and {rule} a group per command in the \
                         same hierarchy; run the worker where the pids and memory controllers are in a v1 hierarchy, \
                         or list ports (*:PORT) instead"
                    ),
                ));
            }
            if !by.iter().any(|b| b == how) {
                by.push(how.to_string());
            }
        }
    }
    if fence.is_some() {
        by.push("nftables".into());
    }
    Ok(by)
}

/// The fence ([`netfilter`]) `network` needs — the rule it enforces (for errors) and what
/// it lets through — or `None` when Landlock and seccomp enforce it alone (`none`, a list
/// of `*:PORT` only).
///
/// # Errors
/// [`Error::Unenforceable`] for an entry naming a host by name: the kernel matches
/// addresses, and a sandboxed command has no DNS (no UDP) to find them.
pub fn fence_of(network: &Network) -> Result<Option<(String, Allowed)>, Error> {
    match network {
        Network::None => Ok(None),
        Network::Loopback => Ok(Some(("sandbox.network: loopback".into(), Allowed::Loopback))),
        Network::Allow(list) => {
            let mut allowed = Vec::with_capacity(list.len());
            for (i, e) in list.iter().enumerate() {
                if e.any_host() {
                    allowed.push((None, e.port));
                    continue;
                }
                let addr = e.host.parse::<IpAddr>().map_err(|_| Error::Unenforceable {
                    rule: format!("sandbox.network[{i}] ({e})"),
                    why: "the kernel's rules match addresses, not names, and a sandboxed command gets no DNS; write \
                          the host's address (or *:PORT for the port on every host)"
                        .into(),
                })?;
                allowed.push((Some(addr), e.port));
            }
            if allowed.iter().all(|(host, _)| host.is_none()) {
                return Ok(None);
            }
            Ok(Some(("sandbox.network".into(), Allowed::Tcp(allowed))))
        }
    }
}

fn abi_text(kernel: Kernel) -> String {
    if kernel.landlock_abi == 0 { "no Landlock".into() } else { format!("ABI {}", kernel.landlock_abi) }
}

impl Confinement {
    /// Checks `sandbox` against `kernel` ([`check`]) and builds its ruleset and filters
    /// for the session whose folders are `folders` (which must exist).
    ///
    /// # Errors
    /// [`Error::Unenforceable`] naming the rule; [`Error::Setup`] when the ruleset or a
    /// filter cannot be built (a path that cannot be opened is skipped, not an error).
    pub fn prepare(sandbox: &Sandbox, folders: &Folders, kernel: Kernel) -> Result<Confinement, Error> {
        let enforced_by = check(sandbox, kernel, |c| cgroup::groups().check(c))?;
        let setup = |e: &dyn std::fmt::Display| Error::Setup(e.to_string());

        let mut ruleset = Ruleset::default()
            .set_compatibility(CompatLevel::HardRequirement)
            .handle_access(AccessFs::from_all(ABI::V3))
            .map_err(|e| setup(&e))?
            // Device ioctls (ABI 5) and scoping (ABI 6) where the kernel has them.
            .set_compatibility(CompatLevel::BestEffort)
            .handle_access(AccessFs::from_all(ABI::V5))
            .map_err(|e| setup(&e))?
            .scope(Scope::AbstractUnixSocket | Scope::Signal)
            .map_err(|e| setup(&e))?
            .set_compatibility(CompatLevel::HardRequirement);
        if matches!(sandbox.network, Network::None | Network::Allow(_)) && kernel.landlock_abi >= NET_ABI {
            ruleset = ruleset.handle_access(AccessNet::from_all(ABI::V4)).map_err(|e| setup(&e))?;
        }
        let mut created = ruleset.create().map_err(|e| setup(&e))?;

        let read_rights = AccessFs::from_read(ABI::V5);
        // Everything but making device nodes: root could make one for a disk.
        let write_rights = AccessFs::from_all(ABI::V5) & !(AccessFs::MakeChar | AccessFs::MakeBlock);
        let device_rights = AccessFs::ReadFile | AccessFs::WriteFile | AccessFs::Truncate;
        let mut applied = Applied {
            read: Vec::new(),
            write: Vec::new(),
            network: sandbox.network.to_string(),
            memory_mb: sandbox.memory_mb,
            pids: sandbox.pids,
            cpu_secs: sandbox.cpu_secs,
            landlock_abi: kernel.landlock_abi as u32,
            enforced_by,
        };

        let system = SYSTEM_READ.iter().map(PathBuf::from);
        let devices_read = DEVICES_READ.iter().map(PathBuf::from);
        let read: Vec<PathBuf> = sandbox.read.iter().map(|p| folders.resolve(p)).collect();
        let write: Vec<PathBuf> = [folders.workdir.clone(), folders.session_dir.clone()]
            .into_iter()
            .chain(sandbox.write.iter().map(|p| folders.resolve(p)))
            .collect();
        applied.read.push(folders.capsule_dir.display().to_string());
        for (paths, rights, shown) in [
            (system.chain(devices_read).collect::<Vec<_>>(), read_rights, None),
            (DEVICES_RW.iter().map(PathBuf::from).collect(), device_rights, None),
            (folders.capsule_paths(), read_rights, None),
            (read, read_rights, Some(&mut applied.read)),
            (write, write_rights, Some(&mut applied.write)),
        ] {
            let mut shown = shown;
            for path in paths {
                // A path missing on this host allows nothing: skipped. The session's own
                // folders must be there.
                let fd = match PathFd::new(&path) {
                    Ok(fd) => fd,
                    Err(e) if folders.contains(&path) => return Err(setup(&format_args!("{}: {e}", path.display()))),
                    Err(_) => continue,
                };
                let rights = if path.is_dir() { rights } else { rights & AccessFs::from_file(ABI::V5) };
                created = created.add_rule(PathBeneath::new(fd, rights)).map_err(|e| setup(&e))?;
                if let Some(shown) = shown.as_deref_mut() {
                    let text = path.display().to_string();
                    if !shown.contains(&text) {
                        shown.push(text);
                    }
                }
            }
        }
        if let Network::Allow(list) = &sandbox.network {
            for e in list {
                created = created.add_rule(NetPort::new(e.port, AccessNet::ConnectTcp)).map_err(|e| setup(&e))?;
            }
        }
        let ruleset: Option<OwnedFd> = created.into();
        let ruleset = ruleset.ok_or_else(|| Error::Setup("Landlock made no ruleset".into()))?;
        let filters = seccomp::filters(&sandbox.network).map_err(|e| setup(&e))?;
        let fence = match fence_of(&sandbox.network)? {
            Some((rule, allowed)) => Some(Fence::make(&allowed).map_err(|why| Error::Unenforceable { rule, why })?),
            None => None,
        };
        Ok(Confinement {
            sandbox: sandbox.clone(),
            folders: folders.clone(),
            kernel,
            fence,
            ruleset,
            filters: Arc::new(filters),
            memory_mb: sandbox.memory_mb,
            pids: sandbox.pids,
            cpu_secs: sandbox.cpu_secs,
            applied,
        })
    }

    /// The rules its commands run under.
    pub fn applied(&self) -> &Applied {
        &self.applied
    }

    /// The confinement of the session's hook programs, which must reach the hooks'
    /// inference endpoint at `gate` (on a loopback address, see `hooks::gate`): the same
    /// rules with TCP to `gate` allowed too — `none` becomes `[gate]`, a list gets `gate`
    /// added — or `None` when the session's rules reach it already (`loopback`, or the
    /// entry is listed).
    ///
    /// # Errors
    /// Those of [`Confinement::prepare`]: allowing one address needs the fence
    /// ([`netfilter`]), so a host where it cannot be made names `sandbox.network`.
    pub fn reaching(&self, gate: SocketAddr) -> Result<Option<Confinement>, Error> {
        let entry = Endpoint { host: gate.ip().to_string(), port: gate.port() };
        let list = match &self.sandbox.network {
            Network::Loopback if gate.ip().is_loopback() => return Ok(None),
            Network::Allow(list)
                if list.iter().any(|e| e.port == gate.port() && (e.any_host() || e.host == entry.host)) =>
            {
                return Ok(None);
            }
            Network::Allow(list) => list.iter().cloned().chain([entry]).collect(),
            Network::None | Network::Loopback => vec![entry],
        };
        let sandbox = Sandbox { network: Network::Allow(list), ..self.sandbox.clone() };
        Confinement::prepare(&sandbox, &self.folders, self.kernel).map(Some)
    }

    /// Makes `cmd` start confined: its control groups are made now (returned: keep them
    /// until the command's processes are gone), the rest is applied by the child between
    /// fork and exec. `cmd` must be spawned once.
    ///
    /// # Errors
    /// A control group that cannot be made (the command must not run).
    pub fn confine(&self, cmd: &mut tokio::process::Command) -> io::Result<Option<cgroup::CommandGroup>> {
        let group = if self.memory_mb.is_some() || self.pids.is_some() {
            Some(cgroup::groups().make(self.memory_mb, self.pids).map_err(io::Error::other)?)
        } else {
            None
        };
        let mut procs: Vec<RawFd> = group.as_ref().map(cgroup::CommandGroup::procs_fds).unwrap_or_default();
        procs.extend(self.fence.as_ref().map(Fence::procs_fd));
        let ruleset = self.ruleset.as_raw_fd();
        let filters = self.filters.clone();
        let cpu = self.cpu_secs;
        // SAFETY: the hook makes only system calls on memory it owns (built before the fork)
        // or on the stack; it allocates nothing and takes no lock (see the module doc).
        unsafe {
            cmd.pre_exec(move || {
                cgroup::join(&procs)?;
                if let Some(secs) = cpu {
                    // SIGXCPU at the limit, SIGKILL a second later.
                    let limit = libc::rlimit { rlim_cur: secs, rlim_max: secs + 1 };
                    if libc::setrlimit(libc::RLIMIT_CPU, &limit) != 0 {
                        return Err(io::Error::last_os_error());
                    }
                }
                if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
                    return Err(io::Error::last_os_error());
                }
                if libc::syscall(libc::SYS_landlock_restrict_self, ruleset, 0u32) != 0 {
                    return Err(io::Error::last_os_error());
                }
                for filter in filters.iter() {
                    if seccompiler::apply_filter(filter).is_err() {
                        return Err(io::Error::last_os_error());
                    }
                }
                Ok(())
            });
        }
        Ok(group)
    }
}

#[cfg(test)]
mod tests;
