//! `mur mcp serve` (issue #35 §murmur as an MCP server): the cluster as MCP tools on stdio
//! ([`mur_mcp::Cluster`]; the coordinator's `--http` serves the same at `/mcp`).

use anyhow::Result;
use mur_mcp::Cluster;
use rmcp::ServiceExt;
use std::process::ExitCode;

/// `mur mcp …`.
#[derive(clap::Subcommand, Debug)]
pub enum Command {
    /// Serve the cluster to an MCP client on stdin and stdout: task_send, task_status,
    /// task_list, task_cancel, capsule_list, fleet_send, fleet_run, job_status, fleet_stop.
    Serve(ServeArgs),
}

/// `mur mcp serve`.
#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    conn: crate::nats::Connection,
}

/// Runs `mur mcp serve` until the client closes stdin.
///
/// # Errors
/// The cluster cannot be reached, or the client's first messages are not MCP.
pub fn run(cmd: Command) -> Result<ExitCode> {
    let Command::Serve(args) = cmd;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(async {
        let client = args.conn.connect("mur mcp serve").await?;
        let service = Cluster::new(client).serve(rmcp::transport::stdio()).await?;
        service.waiting().await?;
        Ok(ExitCode::SUCCESS)
    })
}
