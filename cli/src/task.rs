//! `mur task …`: send a task to a capsule and follow it. With `--url` the capsule is an A2A
//! endpoint (a capsule run by `mur run`, or a coordinator's HTTP endpoint); the cluster's
//! NATS API follows with issue #7.

use crate::nats::Connection;
use anyhow::{Context, Result, bail};
use mur_a2a::client::{self, SendOptions};
use mur_a2a::v1;
use mur_nats::api::SUBMIT_PATIENCE;
use mur_proto::TaskId;
use mur_proto::cluster::{ApiError, ErrorCode, SubmitReply, SubmitRequest, TaskRecord, api};
use mur_proto::page::Page;
use mur_proto::task::Origin;
use serde_json::json;
use std::process::ExitCode;
use std::time::Duration;
use tracing::Instrument;

/// `mur task …`
#[derive(clap::Subcommand, Debug)]
pub enum Command {
    /// Send a task: `mur task send CAPSULE "text"` (cluster) or `mur task send --url URL "text"` (A2A).
    Send(SendArgs),
    /// Print a task's record.
    Status {
        /// The task id.
        id: String,
        #[command(flatten)]
        conn: Connection,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Cancel a task: a waiting one never starts; a running one stops within one progress
    /// interval and ends `canceled`. Prints the record after the request.
    Cancel {
        /// The task id.
        id: String,
        #[command(flatten)]
        conn: Connection,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// List tasks, newest first.
    Ls {
        /// Only tasks in this state.
        #[arg(long, value_parser = ["submitted", "working", "completed", "failed", "canceled", "rejected"])]
        state: Option<String>,
        /// At most N tasks, the newest (1 to 1000).
        #[arg(long, value_name = "N", default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..=1000))]
        limit: u64,
        #[command(flatten)]
        conn: Connection,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
}

/// `mur task send [CAPSULE] TEXT --url URL [--origin O] [--context ID] [--wait] [--json]`
#[derive(clap::Args, Debug)]
pub struct SendArgs {
    /// The task's text (with `--url`), or the capsule then the text (cluster). A text of
    /// `-` is read from stdin (a text too long for an argument: `mur task send CAPSULE - <
    /// task.md`).
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
    #[command(flatten)]
    conn: Connection,
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
        Command::Send(args) if args.url.is_none() => send_cluster(args),
        Command::Send(args) => send(args),
        Command::Status { id, conn, json } => {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            let rec: TaskRecord = rt.block_on(async {
                let client = conn.connect("mur task status").await?;
                call(&client, api::TASK_GET, id.into_bytes()).await
            })?;
            print_record(&rec, json);
            Ok(ExitCode::SUCCESS)
        }
        Command::Cancel { id, conn, json } => {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            let rec: TaskRecord = rt.block_on(async {
                let client = conn.connect("mur task cancel").await?;
                call(&client, api::TASK_CANCEL, id.into_bytes()).await
            })?;
            print_record(&rec, json);
            Ok(ExitCode::SUCCESS)
        }
        Command::Ls { state, limit, conn, json } => {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            let body = serde_json::to_vec(&json!({"state": state, "limit": limit}))?;
            let page: Page<TaskRecord> = rt.block_on(async {
                let client = conn.connect("mur task ls").await?;
                call(&client, api::TASK_LIST, body).await
            })?;
            page_notes(
                &page,
                "tasks",
                "older ones were left out; narrow the list with --state",
                Some("mur task status ID"),
            );
            let recs = page.items;
            if json {
                println!("{}", serde_json::to_string(&recs)?);
            } else {
                let mut t = comfy_table::Table::new();
                t.load_preset(comfy_table::presets::NOTHING)
                    .set_header(vec!["TASK", "CAPSULE", "LANE", "STATE", "EXIT", "TEXT"]);
                for r in recs {
                    // One line per task: the text's first line, cut at 40 characters.
                    let first = r.text.lines().next().unwrap_or_default();
                    let mut text = crate::text::cell(first, 40);
                    if first.len() < r.text.trim_end().len() && !text.ends_with('…') {
                        text.push('…');
                    }
                    t.add_row(vec![
                        r.task_id.into_string(),
                        r.capsule,
                        r.lane.to_string(),
                        r.state.as_str().to_string(),
                        r.exit_status.map(|e| e.to_string()).unwrap_or_default(),
                        text,
                    ]);
                }
                println!("{t}");
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// Ids a note names at most.
const NOTE_IDS: usize = 5;

/// Says on stderr what a list reply left out: the items that did not fit (`more`) and the
/// ones whose long fields were clipped (see `proto/src/page.rs`).
pub fn page_notes<T>(page: &Page<T>, what: &str, narrow: &str, whole: Option<&str>) {
    if page.more {
        eprintln!("note: only {} {what} fit in one reply; {narrow}", page.items.len());
    }
    if !page.clipped.is_empty() {
        let whole = whole.map(|w| format!("; `{w}` shows one whole")).unwrap_or_default();
        // A few ids say which; hundreds would bury the list itself.
        let shown = page.clipped.iter().take(NOTE_IDS).map(String::as_str).collect::<Vec<_>>().join(", ");
        let more = page.clipped.len().saturating_sub(NOTE_IDS);
        let more = if more > 0 { format!(" and {more} more") } else { String::new() };
        eprintln!(
            "note: long texts cut after {} bytes (then `…`) in {} of them: {shown}{more}{whole}",
            mur_proto::page::FIELD_BYTES,
            page.clipped.len(),
        );
    }
}

/// Calls the coordinator's API at `subject`.
///
/// # Errors
/// The coordinator's refusal (its `ApiError`), or no coordinator answering.
pub async fn call<T: serde::de::DeserializeOwned>(
    client: &async_nats::Client,
    subject: &str,
    body: Vec<u8>,
) -> Result<T> {
    // The refusal itself, not its text: `--json` reports its code ([`crate::report`]).
    Ok(mur_nats::api::call(client, subject, body).await?)
}

fn print_record(rec: &TaskRecord, json: bool) {
    if json {
        println!("{}", serde_json::to_string(rec).unwrap_or_default());
        return;
    }
    println!("task      {}", rec.task_id);
    println!("capsule   {} ({})", rec.capsule, &rec.capsule_digest[..rec.capsule_digest.len().min(12)]);
    println!("lane      {} (origin {})", rec.lane, rec.origin);
    println!("state     {}", rec.state.as_str());
    if let Some(e) = rec.exit_status {
        println!("exit      {e}");
    }
    if let Some(s) = &rec.session_id {
        println!("session   {s}");
    }
    if let Some(w) = &rec.worker {
        println!("worker    {w}");
    }
    if rec.cancel_requested_at.is_some() && !rec.state.is_terminal() {
        println!("cancel    requested; the worker stops it within one progress interval");
    }
    if let Some(r) = &rec.result {
        println!("result\n{}", crate::text::printable(r));
    }
    if let Some(e) = &rec.error {
        println!("error     {}", crate::text::printable(e));
    }
}

/// A text argument as given, or stdin's when it is `-` (`what` names it in an error).
pub fn text_or_stdin(word: &str, what: &str) -> Result<String> {
    if word == "-" {
        return std::io::read_to_string(std::io::stdin()).with_context(|| format!("reading {what} from stdin"));
    }
    Ok(word.to_string())
}

/// `mur task send CAPSULE TEXT`: submits over the coordinator's NATS API; the caller is
/// an authenticated client and may state any origin (default `user`).
fn send_cluster(args: SendArgs) -> Result<ExitCode> {
    let [capsule, text] = args.words.as_slice() else {
        return Err(crate::Invalid(
            "give the capsule then the text: mur task send CAPSULE \"text\" (or --url URL \"text\" for an A2A endpoint)"
                .into(),
        )
        .into());
    };
    let origin: Origin = args.origin.parse().map_err(|e| crate::Invalid(format!("--origin: {e}")))?;
    let mut request = SubmitRequest {
        context_id: args.context.clone(),
        // Minted here: a submission sent again (below) is the same task, run once.
        task_id: Some(TaskId::generate()),
        message_id: None,
        ..SubmitRequest::new(capsule.clone(), text_or_stdin(text, "the task's text")?, origin)
    };
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async {
        // One patience for the whole send: a broker restarting (issue #29 item 7) as a
        // coordinator restarting; the task id is minted, so the task runs once.
        let give_up = tokio::time::Instant::now() + SUBMIT_PATIENCE;
        let id = request.task_id.clone().unwrap_or_default();
        let client = args
            .conn
            .connect_until("mur task send", give_up, |e, delay| {
                eprintln!(
                    "mur: {}; trying again in {} ms (task {id}: it runs once however often it is sent)",
                    crate::text::printable(&format!("{e:#}")),
                    delay.as_millis()
                );
            })
            .await?;
        let patience = give_up.saturating_duration_since(tokio::time::Instant::now());
        let reply = match submit_until_answered(&client, &mut request, patience).await {
            Ok(reply) => reply,
            // An unknown capsule: the names there are, the closest first (issue #29).
            Err(mut e) if e.code == ErrorCode::NotFound => {
                if let Some(names) = crate::capsule::names(&client).await
                    && !names.contains(capsule)
                {
                    e.message.push_str(&crate::capsule::unknown_hint(capsule, &names));
                }
                return Err(e.into());
            }
            Err(e) => return Err(e.into()),
        };
        if !args.wait {
            if args.json {
                println!("{}", json!({"task_id": reply.task_id, "state": reply.state}));
            } else {
                println!("{}", reply.task_id);
            }
            return Ok(ExitCode::SUCCESS);
        }
        let hint = format!(" (mur task status {})", reply.task_id);
        let rec = match wait_for_end(&reply.task_id, &hint, wait_for(&client, &reply.task_id)).await? {
            Ok(rec) => rec,
            Err(code) => return Ok(code),
        };
        print_record(&rec, args.json);
        Ok(if rec.exit_status == Some(mur_proto::task::ExitStatus::Ok) { ExitCode::SUCCESS } else { ExitCode::FAILURE })
    })
}

/// `--wait` on an accepted task: says it waits, then waits with `wait`. Ctrl-C stops the
/// wait, not the task (`mur: interrupted; task … goes on{hint}`, exit 130; the handler is
/// in place before the line that invites it); a wait that fails is exit 1 — the task was
/// accepted, its end is unknown — not the 2 of a send that reached nobody (README §exit
/// codes).
///
/// # Errors
/// The interrupt handler cannot be installed.
async fn wait_for_end<T, E: std::fmt::Display>(
    task_id: &str,
    hint: &str,
    wait: impl std::future::Future<Output = Result<T, E>>,
) -> Result<Result<T, ExitCode>> {
    let mut interrupt = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())?;
    eprintln!("task {task_id} submitted; waiting for it to end");
    tokio::select! {
        waited = wait => Ok(waited.map_err(|e| {
            let why = format!("{e:#}");
            let why = crate::text::printable(&why);
            eprintln!("mur: task {task_id} was accepted, but its end is unknown: {why}");
            ExitCode::FAILURE
        })),
        _ = interrupt.recv() => {
            eprintln!("mur: interrupted; task {task_id} goes on{hint}");
            Ok(Err(ExitCode::from(130)))
        }
    }
}

/// Submits `request` with [`mur_nats::api::submit`] (sent again, the same task, while no
/// coordinator answers, for up to `patience`, saying so on stderr each time), in
/// a `submit_task` span whose W3C `traceparent` goes along in the request headers, so the
/// task's spans on the coordinator and the worker join its trace (issue #7 §Trace context).
///
/// # Errors
/// The coordinator's refusal, or the last `unavailable` error once the patience is spent.
async fn submit_until_answered(
    client: &async_nats::Client,
    request: &mut SubmitRequest,
    patience: std::time::Duration,
) -> Result<SubmitReply, ApiError> {
    let span = tracing::info_span!(
        "submit_task",
        otel.kind = "client",
        messaging.system = "nats",
        messaging.operation.type = "send",
        messaging.destination.name = api::TASK_SUBMIT,
        gen_ai.agent.name = %request.capsule,
        mur.task_id = tracing::field::Empty,
    );
    let id = request.task_id.as_ref().map_or_else(|| "(the coordinator's)".to_string(), ToString::to_string);
    let reply = mur_nats::api::submit(client, request, patience, |e, delay| {
        eprintln!(
            "mur: {}; sending it again in {} ms (task {id}: it runs once however often it is sent)",
            crate::text::printable(&e.message),
            delay.as_millis()
        );
    })
    .instrument(span.clone())
    .await?;
    span.record("mur.task_id", reply.task_id.as_str());
    Ok(reply)
}

/// Follows a task's record in the tasks bucket until it is terminal.
async fn wait_for(client: &async_nats::Client, task_id: &str) -> Result<TaskRecord> {
    use futures::StreamExt;
    let js = async_nats::jetstream::new(client.clone());
    let kv = js.get_key_value(mur_proto::cluster::TASKS_BUCKET).await.context("the tasks bucket")?;
    let mut watch = kv.watch_with_history(task_id).await.context("watching the task")?;
    while let Some(entry) = watch.next().await {
        let entry = entry.context("watching the task")?;
        if let Ok(rec) = serde_json::from_slice::<TaskRecord>(&entry.value)
            && rec.state.is_terminal()
        {
            return Ok(rec);
        }
    }
    bail!("the watch on task {task_id} ended before the task did")
}

fn send(args: SendArgs) -> Result<ExitCode> {
    let origin: Origin = args.origin.parse().map_err(|e| crate::Invalid(format!("--origin: {e}")))?;
    let Some(url) = args.url.clone() else { unreachable!("send_cluster handles sends without --url") };
    let [text] = args.words.as_slice() else {
        return Err(crate::Invalid("with --url give only the task's text (the endpoint is the capsule)".into()).into());
    };
    let text = &text_or_stdin(text, "the task's text")?;
    let options = SendOptions { origin: Some(origin), context_id: args.context.clone() };
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    // As on the NATS path: the endpoint's spans join this one's trace (its `traceparent`
    // goes in the HTTP headers).
    let span = tracing::info_span!("submit_task", otel.kind = "client", url.full = %url);
    let client = client::Client::new(&url);
    let task = runtime
        .block_on(client.send(text, &options).instrument(span.clone()))
        .with_context(|| format!("sending to {url}"))?;
    let task = if args.wait && !task.status.state.is_settled() {
        let wait = client.wait(&task.id, Duration::from_millis(200)).instrument(span);
        match runtime.block_on(wait_for_end(&task.id, "", wait))? {
            Ok(task) => task,
            Err(code) => return Ok(code),
        }
    } else {
        task
    };
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
    if task.status.state == v1::TaskState::Rejected {
        // A refusal: nothing was done (README §exit codes).
        let why = rec["status_message"].as_str().unwrap_or("the capsule did not take the task");
        return Ok(crate::refused(args.json, None, "mur: ", &format!("rejected: {}", crate::text::printable(why))));
    }
    let ok = !args.wait || task.status.state == v1::TaskState::Completed;
    Ok(if ok { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}
