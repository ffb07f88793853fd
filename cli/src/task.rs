//! `mur task …`: send a task to a capsule and follow it. With `--url` the capsule is an A2A
//! endpoint (a capsule run by `mur run`, or a coordinator's HTTP endpoint); the cluster's
//! NATS API follows with issue #7.

use anyhow::{Context, Result, bail};
use mur_proto::task::Origin;
use mur_worker::a2a::client::{self, SendOptions};
use mur_worker::a2a::v1;
use serde_json::json;
use std::process::ExitCode;
use std::time::Duration;

/// `mur task …`
#[derive(clap::Subcommand, Debug)]
pub enum Command {
    /// Send a task: `mur task send --url URL "text"`.
    Send(SendArgs),
}

/// `mur task send [CAPSULE] TEXT --url URL [--origin O] [--context ID] [--wait] [--json]`
#[derive(clap::Args, Debug)]
pub struct SendArgs {
    /// The task's text (with `--url`), or the capsule then the text (cluster).
    #[arg(num_args = 1..=2, required = true, value_name = "[CAPSULE] TEXT")]
    words: Vec<String>,
    /// An A2A endpoint to send to (the `url` printed by `mur run --json`).
    #[arg(long, value_name = "URL")]
    url: Option<String>,
    /// The task's origin: user, peer, schedule, event, completion, system. Over HTTP only
    /// peer and completion are believed; anything else waits in the bg lane as `event`.
    #[arg(long, value_name = "ORIGIN", default_value = "user")]
    origin: String,
    /// Continue this conversation (context id).
    #[arg(long, value_name = "ID")]
    context: Option<String>,
    /// Wait until the task ends and print its record.
    #[arg(long)]
    wait: bool,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

/// The state name of an A2A task (`completed`, …).
fn state_name(state: v1::TaskState) -> String {
    serde_json::to_value(state)
        .ok()
        .and_then(|v| v.as_str().map(|s| s.trim_start_matches("TASK_STATE_").to_lowercase().replace('_', "-")))
        .unwrap_or_default()
}

fn record(task: &v1::Task) -> serde_json::Value {
    let meta = task.metadata.as_ref().and_then(|m| m.get("murmur")).cloned().unwrap_or(json!({}));
    json!({
        "task_id": task.id,
        "context_id": task.context_id,
        "state": state_name(task.status.state),
        "exit_status": meta.get("exitStatus").cloned(),
        "lane": meta.get("lane").cloned(),
        "origin": meta.get("origin").cloned(),
        "result": if task.artifacts.is_empty() { serde_json::Value::Null } else { json!(task.artifact_text()) },
        "status_message": task.status_text(),
    })
}

pub fn run(cmd: Command) -> Result<ExitCode> {
    match cmd {
        Command::Send(args) => send(args),
    }
}

fn send(args: SendArgs) -> Result<ExitCode> {
    let origin: Origin = args.origin.parse().map_err(|e| anyhow::anyhow!("--origin: {e}"))?;
    let Some(url) = args.url.clone() else {
        bail!("sending to a cluster capsule needs the cluster (issue #7); give --url URL for an A2A endpoint");
    };
    let [text] = args.words.as_slice() else {
        bail!("with --url give only the task's text (the endpoint is the capsule)");
    };
    let options = SendOptions { origin: Some(origin), context_id: args.context.clone() };
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let task = runtime
        .block_on(client::send_task(&url, text, &options, args.wait.then_some(Duration::from_millis(200))))
        .with_context(|| format!("sending to {url}"))?;
    let rec = record(&task);
    if args.json {
        if args.wait {
            println!("{rec}");
        } else {
            println!("{}", json!({"task_id": rec["task_id"], "state": rec["state"]}));
        }
    } else if args.wait {
        println!("{}", rec["result"].as_str().or(rec["status_message"].as_str()).unwrap_or(""));
        eprintln!("task {} {}", task.id, rec["state"].as_str().unwrap_or(""));
    } else {
        println!("{}", task.id);
        eprintln!("task {} {}", task.id, rec["state"].as_str().unwrap_or(""));
    }
    let ok = !args.wait || task.status.state == v1::TaskState::Completed;
    Ok(if ok && task.status.state != v1::TaskState::Rejected { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}
