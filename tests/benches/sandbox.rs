//! `cargo bench -p mur-tests --bench sandbox`: what sandboxing a command costs (issue #37,
//! "Speed"). The shell tool runs `true` N times (1,000 in a release build, 20 in a debug
//! build — CI's smoke run — or `MUR_BENCH_COMMANDS=N`) through the worker's real path
//! (`Toolbox::call`: spawn in a process group tied to the worker, output captured, exit
//! reaped), in three variants interleaved command by command in this one process, so their
//! figures compare as ratios:
//!
//! - plain: no `sandbox:` block (the baseline);
//! - sandboxed: `network: none` and `cpu_secs` — Landlock, seccomp, `no_new_privs`,
//!   `RLIMIT_CPU`, applied between fork and exec;
//! - with cgroups: also `memory_mb` and `pids` — a control group made, joined and removed
//!   per command (skipped, and said so, where this host has no writable cgroup);
//! - address rule: `network: ['127.0.0.1:9']` and `cpu_secs` — as sandboxed, with the TCP
//!   port rule and the session's fence (nftables on a cgroup v2 group) that each command
//!   joins (skipped, and said so, where no fence can be made). The fence itself is made once
//!   per session, before the loop; its cost is printed apart.
//!
//! Printed: the median wall time per command of each variant, the median added cost per
//! command against plain (target: at most 1 ms), and the ratio.

use mur_proto::Manifest;
use mur_worker::sandbox::{Confinement, Folders, Kernel};
use mur_worker::tools::{CallContext, Toolbox, Tools};
use serde_json::json;
use std::sync::Arc;
use std::time::{Duration, Instant};

const MANIFEST: &str = "name: bench\nversion: 1.0.0\ninference:\n  driver: scripted\n  script: r.yaml\n\
                        capabilities:\n  shell:\n    allow: ['true']\n";

fn median(v: &mut [Duration]) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn sandbox(block: &str) -> mur_proto::manifest::Sandbox {
    let yaml = format!("{MANIFEST}sandbox:\n{block}");
    Manifest::from_yaml(&yaml, &|_| None).expect("manifest").sandbox.expect("a sandbox block")
}

fn main() {
    mur_nats::tls::install_crypto_provider();
    let commands = std::env::var("MUR_BENCH_COMMANDS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|&n| n >= 1)
        .unwrap_or(if cfg!(debug_assertions) { 20 } else { 1_000 });
    let dir = tempfile::tempdir().unwrap();
    let workdir = dir.path().join("session");
    let capsule = dir.path().join("capsule");
    std::fs::create_dir_all(&workdir).unwrap();
    std::fs::create_dir_all(&capsule).unwrap();
    let folders = Folders { workdir: workdir.clone(), session_dir: workdir.clone(), capsule_dir: capsule.clone() };
    let kernel = Kernel::probe();
    println!(
        "sandbox bench ({} build): `true` × {commands} per variant, interleaved; kernel: Landlock ABI {}, seccomp {}",
        if cfg!(debug_assertions) { "debug" } else { "release" },
        kernel.landlock_abi,
        if kernel.seccomp { "yes" } else { "no" },
    );
    let plain = CallContext {
        capsule_dir: capsule.clone(),
        workdir: workdir.clone(),
        logs_dir: workdir.join("logs"),
        sandbox: None,
        tool_call_id: None,
    };
    let mut variants = vec![("plain", plain.clone())];
    match Confinement::prepare(&sandbox("  network: none\n  cpu_secs: 60\n"), &folders, kernel) {
        Ok(c) => variants.push(("sandboxed", CallContext { sandbox: Some(Arc::new(c)), ..plain.clone() })),
        Err(e) => println!("sandboxed: not measured, this kernel cannot sandbox: {e}"),
    }
    match Confinement::prepare(
        &sandbox("  network: none\n  cpu_secs: 60\n  memory_mb: 256\n  pids: 64\n"),
        &folders,
        kernel,
    ) {
        Ok(c) => variants.push(("with cgroups", CallContext { sandbox: Some(Arc::new(c)), ..plain.clone() })),
        Err(e) => println!("with cgroups: not measured: {e}"),
    }
    let made = Instant::now();
    match Confinement::prepare(&sandbox("  network: ['127.0.0.1:9']\n  cpu_secs: 60\n"), &folders, kernel) {
        Ok(c) => {
            println!(
                "address rule: the session's confinement with its fence made in {:.1} ms (once per session)",
                made.elapsed().as_secs_f64() * 1e3
            );
            variants.push(("address rule", CallContext { sandbox: Some(Arc::new(c)), ..plain.clone() }));
        }
        Err(e) => println!("address rule: not measured, no fence on this host: {e}"),
    }

    let tools = Toolbox::from_manifest(&Manifest::from_yaml(MANIFEST, &|_| None).unwrap());
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    let mut times: Vec<Vec<Duration>> = vec![Vec::with_capacity(commands); variants.len()];
    runtime.block_on(async {
        // Warm-up: the reaper, the cgroup hierarchy, the page cache.
        for (_, ctx) in &variants {
            let out = tools.call("true", &json!({"command": ""}), ctx).await;
            assert!(!out.is_error && out.text.contains("Exit code: 0"), "{}", out.text);
        }
        for _ in 0..commands {
            for (i, (_, ctx)) in variants.iter().enumerate() {
                let start = Instant::now();
                let out = tools.call("true", &json!({"command": ""}), ctx).await;
                times[i].push(start.elapsed());
                assert!(!out.is_error && out.text.contains("Exit code: 0"), "{}", out.text);
            }
        }
    });
    let base = median(&mut times[0]);
    println!("plain          median {:8.1} µs per command", micros(base));
    for (i, (name, _)) in variants.iter().enumerate().skip(1) {
        let m = median(&mut times[i]);
        let added = micros(m) - micros(base);
        println!(
            "{name:<14} median {:8.1} µs per command: {added:+.1} µs added ({:.2}× plain; target ≤ 1000 µs added)",
            micros(m),
            m.as_secs_f64() / base.as_secs_f64()
        );
    }
}
