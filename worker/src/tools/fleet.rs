//! The built-in fleet tools (issue #11 §Agents drive fleets too): a capsule whose manifest
//! lists `command: builtin:fleet_send`, `builtin:fleet_run` or `builtin:job_status` in
//! `tools:` can queue a job on a fleet, start a run, and follow it, through the same
//! coordinator API as `mur fleet send`, `mur fleet run` and `mur job status`.
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
//!
//! They need the cluster: a capsule run by `mur run` gets an error result saying so. The
//! work itself is [`mur_nats::fleet_tools`] (the cluster's MCP server runs it too).

use super::{CallContext, Outcome};
use crate::driver::ToolSpec;
use mur_nats::fleet_tools;
use mur_proto::manifest::ToolDecl;
use serde_json::Value;

pub use mur_nats::fleet_tools::{FleetAccess, MAX_WAIT_SECS};

/// One built-in fleet tool.
pub struct FleetTool {
    name: String,
    builtin: &'static str,
    description: String,
}

impl FleetTool {
    /// The tool for `decl` when its command is `builtin:<one of the three>`.
    pub fn from_decl(decl: &ToolDecl) -> Option<FleetTool> {
        let b = decl.command.first()?.strip_prefix("builtin:")?;
        let builtin = mur_proto::manifest::BUILTIN_TOOLS.into_iter().find(|t| *t == b)?;
        let description =
            decl.description.clone().unwrap_or_else(|| fleet_tools::default_description(builtin).to_string());
        Some(FleetTool { name: decl.name.clone(), builtin, description })
    }

    /// Its name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its spec for the model.
    pub fn spec(&self) -> ToolSpec {
        ToolSpec {
            name: self.name.clone(),
            description: self.description.clone(),
            parameters: fleet_tools::parameters(self.builtin),
        }
    }

    /// Runs the call. Errors (a refused request, a missing run, no cluster) are error
    /// outcomes the model sees.
    pub async fn run(&self, input: &Value, access: Option<&FleetAccess>, _ctx: &CallContext) -> Outcome {
        let Some(access) = access else {
            return Outcome::error(format!(
                "{}: fleet tools need the cluster (run the capsule on a worker)",
                self.name
            ));
        };
        match fleet_tools::call(self.builtin, access, input).await {
            Ok(v) => Outcome {
                text: v.to_string(),
                is_error: false,
                shell: None,
                detached: None,
                sandbox: None,
                mcp_server: None,
            },
            Err(e) => Outcome::error(format!("{}: {e}", self.name)),
        }
    }
}
