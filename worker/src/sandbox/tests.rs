//! The fail-closed rules on made-up kernels, and real confined commands on this one.

use super::*;
use mur_proto::manifest::Endpoint;

const FULL: Kernel = Kernel { landlock_abi: 7, seccomp: true };

fn sandbox(network: Network) -> Sandbox {
    Sandbox { read: vec![], write: vec![], network, memory_mb: None, pids: None, cpu_secs: None }
}

fn no_cgroups(c: Controller) -> Result<&'static str, String> {
    Err(format!("no {c:?} hierarchy"))
}

fn unenforceable(r: Result<Vec<String>, Error>) -> String {
    match r {
        Err(e @ Error::Unenforceable { .. }) => e.to_string(),
        other => panic!("expected a rule that cannot be enforced, got {other:?}"),
    }
}

#[test]
fn a_kernel_without_landlock_abi_3_fails_closed_naming_the_filesystem_rules() {
    let e = unenforceable(check(&sandbox(Network::None), Kernel { landlock_abi: 2, seccomp: true }, no_cgroups));
    assert_eq!(
        e,
        "sandbox (its filesystem rules) cannot be enforced on this machine: Landlock ABI 3 (Linux 6.2) is needed, the \
         kernel offers ABI 2"
    );
    let e = unenforceable(check(&sandbox(Network::None), Kernel { landlock_abi: 0, seccomp: true }, no_cgroups));
    assert!(e.ends_with("the kernel offers no Landlock"), "{e}");
}

#[test]
fn port_rules_need_landlock_abi_4_and_a_kernel_without_seccomp_fails_closed() {
    let ports = sandbox(Network::Allow(vec![Endpoint::parse("*:443").unwrap()]));
    let e = unenforceable(check(&ports, Kernel { landlock_abi: 3, seccomp: true }, no_cgroups));
    assert_eq!(
        e,
        "sandbox.network cannot be enforced on this machine: TCP port rules need Landlock ABI 4 (Linux 6.7), the kernel \
         offers ABI 3"
    );
    assert!(check(&sandbox(Network::None), Kernel { landlock_abi: 3, seccomp: true }, no_cgroups).is_ok());
    let e = unenforceable(check(&sandbox(Network::None), Kernel { landlock_abi: 7, seccomp: false }, no_cgroups));
    assert_eq!(
        e,
        "sandbox (its system call filter) cannot be enforced on this machine: the kernel takes no seccomp filters"
    );
}

#[test]
fn loopback_and_address_entries_are_fenced_and_host_names_fail_closed() {
    let by = check(&sandbox(Network::Loopback), FULL, no_cgroups).unwrap();
    assert_eq!(by, ["landlock", "seccomp", "no_new_privs", "landlock-scope", "nftables"]);
    let list = vec![Endpoint::parse("*:443").unwrap(), Endpoint::parse("127.0.0.1:8080").unwrap()];
    let by = check(&sandbox(Network::Allow(list)), FULL, no_cgroups).unwrap();
    assert_eq!(by.last().map(String::as_str), Some("nftables"));
    // Ports alone need no fence: Landlock enforces them.
    let by = check(&sandbox(Network::Allow(vec![Endpoint::parse("*:443").unwrap()])), FULL, no_cgroups).unwrap();
    assert!(!by.contains(&"nftables".to_string()), "{by:?}");
    let list = vec![Endpoint::parse("[::1]:80").unwrap(), Endpoint::parse("api.example.com:443").unwrap()];
    let e = unenforceable(check(&sandbox(Network::Allow(list)), FULL, no_cgroups));
    assert_eq!(
        e,
        "sandbox.network[1] (api.example.com:443) cannot be enforced on this machine: the kernel's rules match \
         addresses, not names, and a sandboxed command gets no DNS; write the host's address (or *:PORT for the port \
         on every host)"
    );
}

#[test]
fn an_address_rule_with_limits_in_cgroup_v2_fails_closed_naming_the_network_rule() {
    let mut s = sandbox(Network::Loopback);
    s.pids = Some(16);
    let e = unenforceable(check(&s, FULL, |_| Ok("cgroup v2")));
    assert!(
        e.starts_with(
            "sandbox.network: loopback cannot be enforced on this machine: its address rule needs the session's cgroup \
             v2 group and sandbox.pids a group per command in the same hierarchy"
        ),
        "{e}"
    );
    let by = check(&s, FULL, |_| Ok("cgroup v1")).unwrap();
    assert_eq!(by, ["landlock", "seccomp", "no_new_privs", "landlock-scope", "cgroup v1", "nftables"]);
}

#[test]
fn memory_and_pids_need_a_control_group_and_name_the_rule_when_there_is_none() {
    let mut s = sandbox(Network::None);
    s.pids = Some(16);
    let e = unenforceable(check(&s, FULL, no_cgroups));
    assert_eq!(e, "sandbox.pids cannot be enforced on this machine: no Pids hierarchy");
    s.pids = None;
    s.memory_mb = Some(64);
    let e = unenforceable(check(&s, FULL, no_cgroups));
    assert_eq!(e, "sandbox.memory_mb cannot be enforced on this machine: no Memory hierarchy");
    s.cpu_secs = Some(5);
    let by = check(&s, FULL, |_| Ok("cgroup v1")).unwrap();
    assert_eq!(by, ["landlock", "seccomp", "no_new_privs", "landlock-scope", "rlimit-cpu", "cgroup v1"]);
}

#[test]
fn paths_resolve_against_the_workdir_and_the_capsule_home() {
    let f = Folders { workdir: "/w".into(), session_dir: "/w/s".into(), capsule_dir: "/c".into() };
    assert_eq!(f.resolve("~"), Path::new("/w/.capsule-home"));
    assert_eq!(f.resolve("~/.cargo"), Path::new("/w/.capsule-home/.cargo"));
    assert_eq!(f.resolve("data"), Path::new("/w/data"));
    assert_eq!(f.resolve("/usr"), Path::new("/usr"));
}

/// Runs `script` under `sh` confined by `c`, returning its exit code and output.
async fn run(c: &Confinement, dir: &Path, script: &str) -> (i32, String) {
    let mut cmd = tokio::process::Command::new("/bin/sh");
    cmd.args(["-c", script]).current_dir(dir);
    let _group = c.confine(&mut cmd).unwrap();
    let out = cmd.output().await.unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.code().unwrap_or(-1), text)
}

#[tokio::test]
async fn a_confined_command_reads_its_folders_and_nothing_else() {
    let kernel = Kernel::probe();
    let (root, outside) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let folders = Folders {
        workdir: root.path().join("work"),
        session_dir: root.path().join("work"),
        capsule_dir: root.path().join("capsule"),
    };
    for d in [&folders.workdir, &folders.capsule_dir] {
        std::fs::create_dir_all(d).unwrap();
    }
    std::fs::write(outside.path().join("secret"), "s3cret").unwrap();
    std::fs::write(folders.workdir.join("mine"), "mine").unwrap();
    let c = match Confinement::prepare(&sandbox(Network::None), &folders, kernel) {
        Ok(c) => c,
        Err(e) => {
            println!("this kernel cannot sandbox ({kernel:?}); proved the fail-closed path instead: {e}");
            return;
        }
    };
    let secret = outside.path().join("secret");
    let (code, text) = run(&c, &folders.workdir, &format!("cat {}", secret.display())).await;
    assert_ne!(code, 0, "{text}");
    assert!(text.contains("Permission denied"), "{text}");
    let (code, text) = run(&c, &folders.workdir, "cat mine && echo new > made && cat made").await;
    assert_eq!((code, text.as_str()), (0, "minenew\n"));
    assert_eq!(c.applied().network, "none");
    assert!(c.applied().write.contains(&folders.workdir.display().to_string()));
}
