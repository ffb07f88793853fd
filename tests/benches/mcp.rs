//! `cargo bench -p mur-tests --bench mcp`: what a call to an MCP server's tool costs against
//! a command tool's (issue #35). One `Toolbox` (the worker's real path, `Tools::call`) holds
//! both: a command tool running `cat` (a process spawned per call, its input on stdin, its
//! stdout the result — the baseline) and the testkit's stdio MCP server (`mcp-test-server`,
//! written with `rmcp`, started once for the session), whose `echo` tool returns its text.
//! N calls of each (1,000 in a release build, 20 in a debug build — CI's smoke run — or
//! `MUR_BENCH_CALLS=N`), interleaved call by call in this one process, so the figures
//! compare as a ratio. Printed: the median wall time per call of each, the ratio, and what
//! starting and initializing the server once per session cost.

use mur_proto::Manifest;
use mur_worker::tools::{CallContext, Toolbox, Tools};
use serde_json::json;
use std::time::{Duration, Instant};

fn median(v: &mut [Duration]) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

#[tokio::main]
async fn main() {
    mur_nats::tls::install_crypto_provider();
    let calls = std::env::var("MUR_BENCH_CALLS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|&n| n >= 1)
        .unwrap_or(if cfg!(debug_assertions) { 20 } else { 1_000 });
    let server = env!("CARGO_BIN_EXE_mcp-test-server");
    let yaml = format!(
        "name: bench\nversion: 1.0.0\ninference:\n  driver: scripted\n  script: r.yaml\ntools:\n  - name: cat\n    \
         command: [cat]\nmcp_servers:\n  - name: t\n    command: [{server:?}]\n    tools: [echo]\n"
    );
    let manifest = Manifest::from_yaml(&yaml, &|_| None).expect("manifest");
    let dir = tempfile::tempdir().unwrap();
    let workdir = dir.path().join("session");
    std::fs::create_dir_all(&workdir).unwrap();
    let ctx = CallContext {
        capsule_dir: dir.path().to_path_buf(),
        logs_dir: workdir.join("logs"),
        workdir,
        sandbox: None,
        tool_call_id: None,
    };
    let tools = Toolbox::from_manifest(&manifest);
    let t0 = Instant::now();
    tools.start(&ctx).await.expect("the MCP server starts");
    let start = t0.elapsed();
    println!(
        "mcp bench ({} build): {calls} calls per tool, interleaved; a command tool (`cat`) vs an MCP tool (stdio, rmcp)",
        if cfg!(debug_assertions) { "debug" } else { "release" },
    );
    let input = json!({"text": "hello"});
    let (mut command, mut mcp) = (Vec::with_capacity(calls), Vec::with_capacity(calls));
    for _ in 0..calls {
        let t = Instant::now();
        let out = tools.call("cat", &input, &ctx).await;
        command.push(t.elapsed());
        assert!(!out.is_error, "{}", out.text);
        let t = Instant::now();
        let out = tools.call("mcp__t__echo", &input, &ctx).await;
        mcp.push(t.elapsed());
        assert_eq!((out.is_error, out.text.as_str()), (false, "hello"));
    }
    tools.shutdown().await;
    let (command, mcp) = (median(&mut command), median(&mut mcp));
    println!("  command tool: median {:.0} µs per call", micros(command));
    println!("  MCP tool:     median {:.0} µs per call", micros(mcp));
    println!("  ratio MCP / command: {:.3}", mcp.as_secs_f64() / command.as_secs_f64());
    println!("  starting and initializing the server (once per session): {:.1} ms", start.as_secs_f64() * 1e3);
}
