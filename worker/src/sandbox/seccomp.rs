//! The seccomp filters of a sandboxed command, compiled by `seccompiler` before the fork and
//! installed in the child between fork and exec (installing is two system calls, see
//! [`seccompiler::apply_filter`]).
//!
//! One filter refuses with `EPERM` what a sandboxed command never needs (issue #37): tracing
//! other processes, mounting, entering or making namespaces, kernel modules and keyrings,
//! BPF and perf, handle-based opens that skip path checks, the clock, the host name, swap,
//! reboot and kexec; under a restricted `network`, sockets of other families or types than
//! the rule allows (`none`: `AF_UNIX` only; `loopback`: also TCP and UDP; a list: also TCP)
//! and, under a list, TCP Fast Open (which connects without `connect(2)`). A second one
//! makes `clone3` fail with `ENOSYS`, as container runtimes do, so that C libraries fall back
//! to `clone`, whose namespace flags the first filter can see (`clone3` passes them in
//! memory a filter cannot read).

use mur_proto::manifest::Network;
use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen as Len, SeccompCmpOp as Op, SeccompCondition as Cond, SeccompFilter,
    SeccompRule, TargetArch,
};
use std::collections::BTreeMap;

/// The system calls refused outright.
const DENIED: &[libc::c_long] = &[
    libc::SYS_ptrace,
    libc::SYS_process_vm_readv,
    libc::SYS_process_vm_writev,
    libc::SYS_mount,
    libc::SYS_umount2,
    libc::SYS_pivot_root,
    libc::SYS_chroot,
    libc::SYS_move_mount,
    libc::SYS_open_tree,
    libc::SYS_fsopen,
    libc::SYS_fsconfig,
    libc::SYS_fsmount,
    libc::SYS_fspick,
    libc::SYS_mount_setattr,
    libc::SYS_setns,
    libc::SYS_unshare,
    libc::SYS_init_module,
    libc::SYS_finit_module,
    libc::SYS_delete_module,
    libc::SYS_kexec_load,
    libc::SYS_kexec_file_load,
    libc::SYS_add_key,
    libc::SYS_request_key,
    libc::SYS_keyctl,
    libc::SYS_bpf,
    libc::SYS_perf_event_open,
    libc::SYS_userfaultfd,
    libc::SYS_open_by_handle_at,
    libc::SYS_name_to_handle_at,
    libc::SYS_fanotify_init,
    libc::SYS_reboot,
    libc::SYS_swapon,
    libc::SYS_swapoff,
    libc::SYS_acct,
    libc::SYS_quotactl,
    libc::SYS_syslog,
    libc::SYS_settimeofday,
    libc::SYS_clock_settime,
    libc::SYS_clock_adjtime,
    libc::SYS_adjtimex,
    libc::SYS_sethostname,
    libc::SYS_setdomainname,
    libc::SYS_vhangup,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_iopl,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_ioperm,
];

/// Namespace flags `clone(2)` may not take.
const NAMESPACE_FLAGS: [libc::c_int; 7] = [
    libc::CLONE_NEWNS,
    libc::CLONE_NEWCGROUP,
    libc::CLONE_NEWUTS,
    libc::CLONE_NEWIPC,
    libc::CLONE_NEWUSER,
    libc::CLONE_NEWPID,
    libc::CLONE_NEWNET,
];

/// Socket types an inet socket may not have under a port list (all but `SOCK_STREAM`;
/// under `loopback`, all but `SOCK_STREAM` and `SOCK_DGRAM`).
const NON_STREAM_TYPES: [libc::c_int; 6] = [
    libc::SOCK_DGRAM,
    libc::SOCK_RAW,
    libc::SOCK_RDM,
    libc::SOCK_SEQPACKET,
    libc::SOCK_DCCP,
    10, /* SOCK_PACKET */
];

/// Why a filter could not be compiled (a defect of the rules below, or an architecture
/// seccompiler does not know).
#[derive(Debug, thiserror::Error)]
#[error("cannot compile the seccomp filter: {0}")]
pub struct CompileError(String);

/// The filters for `network`, in the order they are installed.
///
/// # Errors
/// [`CompileError`] on an architecture seccompiler does not support.
pub fn filters(network: &Network) -> Result<Vec<BpfProgram>, CompileError> {
    let arch = TargetArch::try_from(std::env::consts::ARCH).map_err(|e| CompileError(e.to_string()))?;
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = DENIED.iter().map(|&nr| (nr, Vec::new())).collect();
    rules.insert(
        libc::SYS_clone,
        NAMESPACE_FLAGS.iter().map(|&flag| rule(vec![masked(0, Len::Qword, flag as u64)])).collect(),
    );
    match network {
        // Sockets of no family but AF_UNIX (pairs and pathname sockets).
        Network::None => {
            rules.insert(libc::SYS_socket, vec![rule(vec![cond(0, Op::Ne, libc::AF_UNIX as u64)])]);
        }
        // TCP and UDP over IPv4/IPv6 (and AF_UNIX); the fence (nftables) then lets their
        // packets reach loopback addresses only. No raw or packet sockets, which could
        // forge what the fence matches or bypass netfilter.
        Network::Loopback => {
            let mut socket = vec![rule(vec![
                cond(0, Op::Ne, libc::AF_UNIX as u64),
                cond(0, Op::Ne, libc::AF_INET as u64),
                cond(0, Op::Ne, libc::AF_INET6 as u64),
            ])];
            for family in [libc::AF_INET, libc::AF_INET6] {
                for ty in NON_STREAM_TYPES.iter().filter(|&&t| t != libc::SOCK_DGRAM) {
                    socket.push(rule(vec![cond(0, Op::Eq, family as u64), of_type(*ty)]));
                }
            }
            rules.insert(libc::SYS_socket, socket);
        }
        // TCP over IPv4/IPv6 (and AF_UNIX); Landlock then allows only the listed ports.
        Network::Allow(_) => {
            let mut socket = vec![rule(vec![
                cond(0, Op::Ne, libc::AF_UNIX as u64),
                cond(0, Op::Ne, libc::AF_INET as u64),
                cond(0, Op::Ne, libc::AF_INET6 as u64),
            ])];
            for family in [libc::AF_INET, libc::AF_INET6] {
                for ty in NON_STREAM_TYPES {
                    socket.push(rule(vec![cond(0, Op::Eq, family as u64), of_type(ty)]));
                }
                // SOCK_STREAM with a protocol other than TCP (MPTCP, SCTP).
                socket.push(rule(vec![
                    cond(0, Op::Eq, family as u64),
                    cond(2, Op::Ne, 0),
                    cond(2, Op::Ne, libc::IPPROTO_TCP as u64),
                ]));
            }
            rules.insert(libc::SYS_socket, socket);
            let fast_open = libc::MSG_FASTOPEN as u64;
            rules.insert(libc::SYS_sendto, vec![rule(vec![masked(3, Len::Dword, fast_open)])]);
            rules.insert(libc::SYS_sendmsg, vec![rule(vec![masked(2, Len::Dword, fast_open)])]);
            rules.insert(libc::SYS_sendmmsg, vec![rule(vec![masked(3, Len::Dword, fast_open)])]);
        }
    }
    let refuse = SeccompFilter::new(rules, SeccompAction::Allow, SeccompAction::Errno(libc::EPERM as u32), arch)
        .map_err(|e| CompileError(e.to_string()))?;
    let clone3 = SeccompFilter::new(
        BTreeMap::from([(libc::SYS_clone3, Vec::new())]),
        SeccompAction::Allow,
        SeccompAction::Errno(libc::ENOSYS as u32),
        arch,
    )
    .map_err(|e| CompileError(e.to_string()))?;
    [refuse, clone3].into_iter().map(|f| BpfProgram::try_from(f).map_err(|e| CompileError(e.to_string()))).collect()
}

fn rule(conditions: Vec<Cond>) -> SeccompRule {
    SeccompRule::new(conditions).expect("a rule has conditions")
}

/// `socket(2)`'s type argument is `ty`: its low bits (`SOCK_NONBLOCK` and `SOCK_CLOEXEC`
/// sit above them).
fn of_type(ty: libc::c_int) -> Cond {
    Cond::new(1, Len::Dword, Op::MaskedEq(0xf), ty as u64).expect("argument 1")
}

/// Argument `arg` (a 32-bit int) compared with `value`.
fn cond(arg: u8, op: Op, value: u64) -> Cond {
    Cond::new(arg, Len::Dword, op, value).expect("arguments are numbered 0-5")
}

/// Argument `arg` has every bit of `bits` set.
fn masked(arg: u8, len: Len, bits: u64) -> Cond {
    Cond::new(arg, len, Op::MaskedEq(bits), bits).expect("arguments are numbered 0-5")
}

/// Whether this kernel takes seccomp filters: `prctl(PR_GET_SECCOMP)` answers 0 (not
/// filtered) or 2 (filtered already, and filters stack) rather than `EINVAL`.
pub fn available() -> bool {
    // SAFETY: PR_GET_SECCOMP reads a flag of this process; no memory is passed.
    let mode = unsafe { libc::prctl(libc::PR_GET_SECCOMP, 0, 0, 0, 0) };
    mode == 0 || mode == 2
}
