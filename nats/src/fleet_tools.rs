//! The built-in fleet tools' work (issue #11 §Agents drive fleets too), shared by the
//! worker (a capsule's `builtin:fleet_send`, `builtin:fleet_run`, `builtin:job_status`
//! tools) and the MCP server of the cluster (issue #35, `mur mcp serve` and the
//! coordinator's `/mcp`): each call goes through the same coordinator API as `mur fleet
//! send`, `mur fleet run` and `mur job status`.
//!
//! - `fleet_send {fleet, text}` → `{"job_id", "status"}` (the job is queued, nothing runs).
//! - `fleet_run {fleet, job?, loop?, deadline?, budget_usd?, run_id?}` → `{"run_id",
//!   "bounds"}` at once, as the seed's `fleet_run` tool does; the run goes on on the
//!   leading coordinator.
//! - `job_status {run_id, wait_secs?}` → the run's state plus its liveness verdict (the
//!   seed's `mur_job_status`). With `wait_secs` (0–3600, default 0) it first waits until the
//!   run is over or the time is up. A fleet step that waits gives its fan-out permit back
//!   meanwhile and takes one again before it goes on, so a step that delegates cannot
//!   deadlock the cap.

use crate::fanout::StepPermit;
use crate::fleet::{base_run_id, run_status};
use async_nats::jetstream::kv;
use futures::StreamExt;
use mur_proto::fleet_store::{self, RunRecord, RunRequest, SendRequest};
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// The longest `job_status` wait, seconds.
pub const MAX_WAIT_SECS: u64 = 3600;

/// What a fleet tool call reaches the cluster with.
#[derive(Clone)]
pub struct FleetAccess {
    /// The NATS connection.
    pub client: async_nats::Client,
    /// Who queues jobs: `capsule:<name>`, or `mcp`.
    pub source: String,
    /// The step's fan-out permit, when the call comes from a delegated fleet step.
    pub permit: Option<Arc<StepPermit>>,
    /// The caller's stop: a wait ends when it fires.
    pub cancel: CancellationToken,
}

/// Why a fleet tool call failed, for the model or the MCP client: a bad argument (named),
/// a refusal of the coordinator, or no answer.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct FleetToolError(String);

impl From<String> for FleetToolError {
    fn from(message: String) -> FleetToolError {
        FleetToolError(message)
    }
}

/// Carries out the built-in `builtin` (one of [`mur_proto::manifest::BUILTIN_TOOLS`]) with
/// `input`; its JSON result.
///
/// # Errors
/// [`FleetToolError`] naming the argument or the refusal.
pub async fn call(builtin: &str, access: &FleetAccess, input: &Value) -> Result<Value, FleetToolError> {
    let result = match builtin {
        "fleet_send" => send(access, input).await,
        "fleet_run" => run(access, input).await,
        "job_status" => status(access, input).await,
        other => Err(format!("no built-in fleet tool {other:?}")),
    };
    result.map_err(FleetToolError)
}

/// The description a built-in gets when its declaration gives none.
pub fn default_description(builtin: &str) -> &'static str {
    match builtin {
        "fleet_send" => "Queue a job (a piece of work) on a fleet. Nothing runs until the fleet runs.",
        "fleet_run" => "Start a run of a fleet on the cluster; returns its run id at once. Follow it with job_status.",
        _ => "A fleet run's state and liveness verdict; wait_secs waits (up to an hour) for it to end first.",
    }
}

/// The JSON schema of a built-in's arguments.
pub fn parameters(builtin: &str) -> Value {
    match builtin {
        "fleet_send" => json!({
            "type": "object",
            "properties": {"fleet": {"type": "string"}, "text": {"type": "string", "description": "the job"}},
            "required": ["fleet", "text"],
        }),
        "fleet_run" => json!({
            "type": "object",
            "properties": {
                "fleet": {"type": "string"},
                "job": {"type": "string", "description": "a queued job's id or prefix; default the oldest"},
                "loop": {"type": "boolean", "description": "keep going until the loop ends"},
                "deadline": {"type": "string", "description": "a duration such as 30m"},
                "budget_usd": {"type": "number"},
                "run_id": {"type": "string", "description": "letters, digits, - and _, at most 96"},
            },
            "required": ["fleet"],
        }),
        _ => json!({
            "type": "object",
            "properties": {
                "run_id": {"type": "string"},
                "wait_secs": {"type": "integer", "minimum": 0, "maximum": MAX_WAIT_SECS},
            },
            "required": ["run_id"],
        }),
    }
}

fn field<'a>(input: &'a Value, name: &str) -> Result<&'a str, String> {
    match input.get(name) {
        Some(Value::String(s)) if !s.trim().is_empty() => Ok(s),
        Some(Value::String(_)) | None | Some(Value::Null) => Err(format!("{name}: required")),
        Some(other) => Err(format!("{name}: must be a string, got {other}")),
    }
}

fn optional<'a>(input: &'a Value, name: &str) -> Result<Option<&'a str>, String> {
    match input.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(_) => field(input, name).map(Some),
    }
}

/// Sends a request to the coordinator API; an error reply (the NATS micro error headers)
/// becomes its text.
async fn request<T: serde::de::DeserializeOwned>(
    client: &async_nats::Client,
    subject: &str,
    body: Vec<u8>,
) -> Result<T, String> {
    let reply = client.request(subject.to_string(), body.into()).await.map_err(|e| format!("{subject}: {e}"))?;
    if let Some(err) = reply.headers.as_ref().and_then(|h| h.get("Nats-Service-Error")) {
        return Err(err.to_string());
    }
    serde_json::from_slice(&reply.payload).map_err(|e| format!("{subject}: unexpected reply: {e}"))
}

async fn send(access: &FleetAccess, input: &Value) -> Result<Value, String> {
    let req = SendRequest {
        fleet: field(input, "fleet")?.to_string(),
        text: field(input, "text")?.to_string(),
        source: Some(access.source.clone()),
    };
    let job: mur_proto::fleet::Job =
        request(&access.client, fleet_store::api::SEND, serde_json::to_vec(&req).map_err(|e| e.to_string())?).await?;
    Ok(json!({"job_id": job.id, "status": job.status}))
}

async fn run(access: &FleetAccess, input: &Value) -> Result<Value, String> {
    let looping = match input.get("loop") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(other) => return Err(format!("loop: must be true or false, got {other}")),
    };
    let budget_usd = match input.get("budget_usd") {
        None | Some(Value::Null) => None,
        Some(Value::Number(n)) => n.as_f64(),
        Some(other) => return Err(format!("budget_usd: must be a number, got {other}")),
    };
    let req = RunRequest {
        fleet: field(input, "fleet")?.to_string(),
        job: optional(input, "job")?.map(str::to_string),
        looping,
        deadline: optional(input, "deadline")?.map(str::to_string),
        budget_usd,
        run_id: match input.get("run_id") {
            None | Some(Value::Null) => None,
            Some(_) => Some(run_id_field(input)?.to_string()),
        },
    };
    let started: RunRecord =
        request(&access.client, fleet_store::RUN_SUBJECT, serde_json::to_vec(&req).map_err(|e| e.to_string())?).await?;
    Ok(json!({"run_id": started.run_id, "bounds": started.bounds}))
}

/// A `run_id` input: the `--run-id` rule (`fleet::check_run_id`), or a loop iteration's
/// id `<run id>-<n>`, which follows the same rule; named as the tool's field.
fn run_id_field(input: &Value) -> Result<&str, String> {
    let id = field(input, "run_id")?;
    if mur_proto::fleet::is_run_ref(id) {
        return Ok(id);
    }
    mur_proto::fleet::check_run_id(id).map(|()| id).map_err(|rule| rule.replacen("--run-id", "run_id", 1))
}

async fn status(access: &FleetAccess, input: &Value) -> Result<Value, String> {
    let run_id = run_id_field(input)?;
    let wait = match input.get("wait_secs") {
        None | Some(Value::Null) => 0,
        Some(Value::Number(n)) if n.as_u64().is_some_and(|w| w <= MAX_WAIT_SECS) => n.as_u64().unwrap_or(0),
        Some(other) => return Err(format!("wait_secs: must be a whole number from 0 to {MAX_WAIT_SECS}, got {other}")),
    };
    let js = async_nats::jetstream::new(access.client.clone());
    let defs = js.get_key_value(fleet_store::FLEETS_BUCKET).await.map_err(|e| format!("mur_fleets: {e}"))?;
    if wait > 0 {
        let waiting = wait_until_over(&defs, run_id, Duration::from_secs(wait));
        match &access.permit {
            Some(permit) => permit.while_away(&access.cancel, waiting).await.map_err(|e| e.to_string())??,
            None => waiting.await?,
        }
    }
    let status = run_status(&js, run_id, crate::clock::Clock::now_ms(&crate::clock::SystemClock))
        .await?
        .ok_or_else(|| format!("no run {run_id}"))?;
    serde_json::to_value(status).map_err(|e| e.to_string())
}

/// Waits until `run_id`'s record says it is over, or `wait` has passed. The watch's
/// consumer is deleted when the wait ends (issue #29 item 3).
async fn wait_until_over(defs: &kv::Store, run_id: &str, wait: Duration) -> Result<(), String> {
    let run_id = base_run_id(defs, run_id).await?;
    let key = fleet_store::run_key(&run_id);
    let mut watch = crate::read::watch(defs, &key).await.map_err(|e| format!("mur_fleets: {e}"))?;
    let give_up = tokio::time::sleep(wait);
    tokio::pin!(give_up);
    let over = loop {
        tokio::select! {
            () = &mut give_up => break Ok(()),
            entry = watch.next() => match entry {
                Some(Ok(e)) => {
                    if serde_json::from_slice::<RunRecord>(&e.value).is_ok_and(|r| r.state != "running") {
                        break Ok(());
                    }
                }
                Some(Err(e)) => break Err(format!("mur_fleets: {e}")),
                None => break Ok(()),
            },
        }
    };
    watch.close().await;
    over
}
