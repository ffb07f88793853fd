//! The cluster as MCP tools (issue #35 §murmur as an MCP server), for MCP clients (coding
//! agents, desktop assistants), spoken with the official SDK (`rmcp`) over the
//! coordinator's NATS API — the client the other cluster commands use. `mur mcp serve`
//! serves [`Cluster`] on stdio; the coordinator's `--http` listener serves it at `/mcp`
//! (streamable HTTP). Neither the CLI nor the coordinator owns it, so the coordinator does
//! not depend on the worker for it: the fleet tools' work is [`mur_nats::fleet_tools`].
//!
//! Tools (arguments → result, JSON text):
//! - `task_send {capsule, text, wait?, context_id?}` → `{task_id, state}`, or with `wait`
//!   the task's record once it ended;
//! - `task_status {task_id}`, `task_cancel {task_id}` → the record;
//! - `task_list {state?, limit?}` → a page of records;
//! - `capsule_list {}` → the capsules pushed;
//! - `fleet_send {fleet, text}`, `fleet_run {fleet, …}`, `job_status {run_id, wait_secs?}`:
//!   the built-in fleet tools capsules have ([`mur_nats::fleet_tools`]), same arguments;
//! - `fleet_stop {fleet, by?, drain?}` → the fleet's state (the kill-switch).
//!
//! A refusal (a missing capsule, a bad argument, no coordinator) is an `isError` result
//! naming it. A call that waits (`task_send` with `wait`, `job_status` with `wait_secs`)
//! sends a progress notification every [`PROGRESS_EVERY`] when the client asked for
//! progress (a `progressToken`), with the seconds waited and the task's state.

use mur_nats::fleet_tools::{self, FleetAccess};
use mur_proto::cluster::{SubmitReply, SubmitRequest, TaskRecord, api};
use mur_proto::fleet_store::{self, StopRequest};
use mur_proto::manifest::BUILTIN_TOOLS;
use mur_proto::task::Origin;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, ListToolsResult, PaginatedRequestParams,
    ProgressNotificationParam, ServerCapabilities, ServerConfig, Tool,
};
use rmcp::service::RequestContext;
use rmcp::{ErrorData, RoleServer, ServerHandler};
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How often a waiting call reports progress.
pub const PROGRESS_EVERY: Duration = Duration::from_secs(1);

/// How long `task_send` goes on sending a submission no coordinator answered.
pub const SUBMIT_PATIENCE: Duration = Duration::from_secs(30);

/// The MCP server: one per connection.
#[derive(Clone)]
pub struct Cluster {
    client: async_nats::Client,
}

/// Why a tool call failed: the text of its `isError` result (a bad argument named, the
/// coordinator's refusal, no coordinator).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ToolError(String);

impl From<String> for ToolError {
    fn from(message: String) -> ToolError {
        ToolError(message)
    }
}

impl Cluster {
    /// A server reaching the cluster with `client`.
    pub fn new(client: async_nats::Client) -> Self {
        Cluster { client }
    }

    fn access(&self) -> FleetAccess {
        FleetAccess {
            client: self.client.clone(),
            source: "mcp".to_string(),
            permit: None,
            cancel: tokio_util::sync::CancellationToken::new(),
        }
    }

    /// Every tool, in the order of the issue.
    pub fn tools(&self) -> Vec<Tool> {
        let obj = |v: Value| match v {
            Value::Object(m) => Arc::new(m),
            _ => unreachable!("schemas are objects"),
        };
        let task_id = json!({"type": "object", "properties": {"task_id": {"type": "string"}}, "required": ["task_id"]});
        let mut tools = vec![
            Tool::new(
                "task_send",
                "Send a task to a capsule on the cluster. With wait: true, wait for it to end and return its record \
                 (result, exit status); else return its id at once.",
                obj(json!({
                    "type": "object",
                    "properties": {
                        "capsule": {"type": "string", "description": "the capsule's name (capsule_list)"},
                        "text": {"type": "string", "description": "the task"},
                        "wait": {"type": "boolean", "description": "wait for the task to end (default false)"},
                        "context_id": {"type": "string", "description": "continue this conversation"},
                    },
                    "required": ["capsule", "text"],
                })),
            ),
            Tool::new("task_status", "A task's record: state, exit status, result.", obj(task_id.clone())),
            Tool::new(
                "task_list",
                "The cluster's tasks, newest first.",
                obj(json!({
                    "type": "object",
                    "properties": {
                        "state": {"type": "string", "description": "only tasks in this state (submitted, running, completed, failed, canceled)"},
                        "limit": {"type": "integer", "minimum": 1},
                    },
                })),
            ),
            Tool::new("task_cancel", "Cancel a task; returns its record.", obj(task_id)),
            Tool::new(
                "capsule_list",
                "The capsules pushed to the cluster.",
                obj(json!({"type": "object", "properties": {}})),
            ),
        ];
        for b in BUILTIN_TOOLS {
            tools.push(Tool::new(b, fleet_tools::default_description(b), obj(fleet_tools::parameters(b))));
        }
        tools.push(Tool::new(
            "fleet_stop",
            "Stop a fleet (the kill-switch): no iteration or step starts, running steps are canceled (unless drain), its runs end stopped.",
            obj(json!({
                "type": "object",
                "properties": {
                    "fleet": {"type": "string"},
                    "by": {"type": "string", "description": "who stops it (default mcp)"},
                    "drain": {"type": "boolean", "description": "let running steps finish (default false)"},
                },
                "required": ["fleet"],
            })),
        ));
        tools
    }

    async fn api<T: serde::de::DeserializeOwned>(&self, subject: &str, body: Vec<u8>) -> Result<T, ToolError> {
        mur_nats::api::call(&self.client, subject, body).await.map_err(|e| ToolError(e.to_string()))
    }

    async fn dispatch(&self, name: &str, args: &serde_json::Map<String, Value>) -> Result<Value, ToolError> {
        let text = |k: &str| -> Result<String, ToolError> {
            args.get(k)
                .and_then(Value::as_str)
                .map(str::to_string)
                .ok_or_else(|| ToolError(format!("{k}: required, a string")))
        };
        match name {
            "task_send" => {
                let capsule = text("capsule")?;
                let mut request = SubmitRequest::new(capsule.clone(), text("text")?, Origin::User);
                request.context_id = args.get("context_id").and_then(Value::as_str).map(str::to_string);
                // Sent again while no coordinator answers, as `mur task send` does; it runs once.
                let reply: SubmitReply = mur_nats::api::submit(&self.client, &mut request, SUBMIT_PATIENCE, |_, _| {})
                    .await
                    .map_err(|e| ToolError(e.to_string()))?;
                if args.get("wait").and_then(Value::as_bool).unwrap_or(false) {
                    let rec = self.wait_for(&reply.task_id).await?;
                    Ok(serde_json::to_value(rec).map_err(|e| ToolError(e.to_string()))?)
                } else {
                    Ok(json!({"task_id": reply.task_id, "state": reply.state}))
                }
            }
            "task_status" => self.api::<Value>(api::TASK_GET, text("task_id")?.into_bytes()).await,
            "task_cancel" => self.api::<Value>(api::TASK_CANCEL, text("task_id")?.into_bytes()).await,
            "task_list" => {
                let body = json!({"state": args.get("state"), "limit": args.get("limit")});
                self.api::<Value>(api::TASK_LIST, body.to_string().into_bytes()).await
            }
            "capsule_list" => self.api::<Value>(api::CAPSULE_LIST, Vec::new()).await,
            "fleet_stop" => {
                let by = args.get("by").and_then(Value::as_str).unwrap_or("mcp").to_string();
                let drain = args.get("drain").and_then(Value::as_bool).unwrap_or(false);
                let body = serde_json::to_vec(&StopRequest { fleet: text("fleet")?, by, drain })
                    .map_err(|e| ToolError(e.to_string()))?;
                self.api::<Value>(fleet_store::api::STOP, body).await
            }
            builtin if BUILTIN_TOOLS.contains(&builtin) => {
                fleet_tools::call(builtin, &self.access(), &Value::Object(args.clone()))
                    .await
                    .map_err(|e| ToolError(e.to_string()))
            }
            other => Err(ToolError(format!("no tool {other:?}"))),
        }
    }

    /// Follows `task_id`'s record in the tasks bucket until it is terminal. The watch's
    /// consumer is deleted when the wait ends (or, dropped on a cancel, right after; issue
    /// #29 item 3).
    async fn wait_for(&self, task_id: &str) -> Result<TaskRecord, ToolError> {
        use futures::StreamExt;
        let js = async_nats::jetstream::new(self.client.clone());
        let kv = js
            .get_key_value(mur_proto::cluster::TASKS_BUCKET)
            .await
            .map_err(|e| ToolError(format!("the tasks bucket: {e}")))?;
        let mut watch =
            mur_nats::read::watch(&kv, task_id).await.map_err(|e| ToolError(format!("watching the task: {e}")))?;
        let ended = loop {
            match watch.next().await {
                Some(Ok(entry)) => {
                    if let Ok(rec) = serde_json::from_slice::<TaskRecord>(&entry.value)
                        && rec.state.is_terminal()
                    {
                        break Ok(rec);
                    }
                }
                Some(Err(e)) => break Err(ToolError(format!("watching the task: {e}"))),
                None => break Err(ToolError(format!("the watch on task {task_id} ended before the task did"))),
            }
        };
        watch.close().await;
        ended
    }
}

impl ServerHandler for Cluster {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(rmcp::model::Implementation::new("murmur", env!("CARGO_PKG_VERSION")))
            .with_instructions("murmur's cluster: send tasks to capsules, follow them, drive fleets.")
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        Ok(ListToolsResult { tools: self.tools(), ..Default::default() })
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let name = request.name.to_string();
        if !self.tools().iter().any(|t| t.name == name) {
            return Err(ErrorData::invalid_params(format!("no tool {name:?}"), None));
        }
        let args = request.arguments.unwrap_or_default();
        let token = context.meta.get_progress_token();
        let call = self.dispatch(&name, &args);
        tokio::pin!(call);
        let started = Instant::now();
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + PROGRESS_EVERY, PROGRESS_EVERY);
        let result = loop {
            tokio::select! {
                r = &mut call => break r,
                _ = tick.tick(), if token.is_some() => {
                    let waited = started.elapsed().as_secs_f64().floor();
                    let token = token.clone().expect("checked");
                    let _ = context
                        .peer
                        .notify_progress(
                            ProgressNotificationParam::new(token, waited)
                                .with_message(format!("{name}: waiting, {waited} s")),
                        )
                        .await;
                }
            }
        };
        Ok(match result {
            Ok(v) => CallToolResult::success(vec![ContentBlock::text(v.to_string())]),
            Err(e) => CallToolResult::error(vec![ContentBlock::text(format!("{name}: {e}"))]),
        }
        .into())
    }
}
