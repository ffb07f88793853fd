//! The tools of the manifest's `mcp_servers:` (issue #35): a session's connections to its
//! MCP servers, spoken to with the official SDK (`rmcp`), and their tools offered to the
//! model as `mcp__<server>__<tool>`.
//!
//! Lifecycle (issue #35 §Capsules as MCP clients): [`Mcp::start`] connects every server
//! before the session's first model call — a stdio server is started in the folder commands
//! run in, with the session's environment (`HOME` as shell commands have it, the entry's
//! `env`), confined by the session's sandbox and tied to the worker's life like shell
//! commands ([`super::process::GroupGuard`]); a streamable-HTTP server is reached at its
//! `url` with its `headers`. A server that cannot start or initialize fails the start with
//! an error naming it and its stderr's last lines. [`Mcp::refresh`] re-lists, between turns,
//! the tools of servers that declared `tools.listChanged` or sent
//! `notifications/tools/list_changed`. [`Mcp::shutdown`]
//! closes every connection at the session's end (a stdio server gets its stdin closed, then
//! [`SHUTDOWN_GRACE`], then SIGKILL to its process group).
//!
//! A call's content comes back as text: text blocks verbatim, a resource's text, other
//! blocks (images, audio, binary resources, links) as one bracketed line naming them, since
//! a tool result to the model is text. `isError` results are tool errors the model sees;
//! a call past the server's `timeout_secs`, or to a server that died, is one too.

mod stdio;

use super::{CallContext, Outcome};
use crate::driver::ToolSpec;
use mur_proto::manifest::{MCP_TOOL_PREFIX, McpServer, McpTransport};
use rmcp::model::{CallToolRequestParams, CallToolResult, ContentBlock, ResourceContents, Tool};
use rmcp::service::{NotificationContext, Peer, RunningService};
use rmcp::{ClientHandler, RoleClient, ServiceExt};
use serde_json::Value;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use tracing::Instrument;

/// Bytes of a call's result text kept for the model (64 KiB); the rest is cut with a note.
pub const RESULT_LIMIT: usize = 64 * 1024;

/// How long a stdio server has to exit once its stdin is closed at the session's end,
/// before its process group is killed (the MCP stdio transport's shutdown).
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);

/// How long starting and initializing one server may take at most: its `timeout_secs`,
/// capped here so a session does not wait minutes for a server that never answers.
pub const START_LIMIT: Duration = Duration::from_secs(60);

/// Why the session's MCP servers could not be started; the task fails before any model
/// call.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The stdio server's program is not on this machine.
    #[error(
        "MCP server {server:?}: program {program:?} not found on this machine (the worker machine must have it: a \
         capsule bundle ships only the server's declaration)"
    )]
    MissingProgram {
        /// The server's name.
        server: String,
        /// `command[0]`.
        program: String,
    },
    /// The server could not be started, or did not initialize.
    #[error("MCP server {server:?} {what}{}", stderr_note(.stderr))]
    Failed {
        /// The server's name.
        server: String,
        /// What failed, with the cause.
        what: String,
        /// The last lines its stderr wrote (stdio servers), oldest first.
        stderr: Vec<String>,
    },
}

fn stderr_note(lines: &[String]) -> String {
    if lines.is_empty() { String::new() } else { format!("; its stderr ended with:\n{}", lines.join("\n")) }
}

/// The MCP servers of one session.
pub struct Mcp {
    decls: Vec<McpServer>,
    live: tokio::sync::RwLock<Vec<Arc<Live>>>,
}

/// One connected server.
struct Live {
    decl: McpServer,
    peer: Peer<RoleClient>,
    service: tokio::sync::Mutex<Option<RunningService<RoleClient, Handler>>>,
    /// Its offered tools (after the allow-list), in the server's order.
    tools: std::sync::Mutex<Vec<Tool>>,
    /// Set by `notifications/tools/list_changed`.
    changed: Arc<AtomicBool>,
    /// The server declared `tools.listChanged` at initialization.
    declares_list_changed: bool,
    /// The child of a stdio server.
    child: Option<stdio::Child>,
}

/// The client side's handler: notes tool-list changes.
struct Handler {
    changed: Arc<AtomicBool>,
}

impl ClientHandler for Handler {
    async fn on_tool_list_changed(&self, _context: NotificationContext<RoleClient>) {
        self.changed.store(true, Ordering::SeqCst);
    }
}

impl Mcp {
    /// The servers `decls` declare, not started.
    pub fn new(decls: Vec<McpServer>) -> Self {
        Mcp { decls, live: tokio::sync::RwLock::new(Vec::new()) }
    }

    /// Whether the manifest declares no server.
    pub fn is_empty(&self) -> bool {
        self.decls.is_empty()
    }

    /// Starts and initializes every server in declaration order, and lists its tools; the
    /// servers already started are shut down when one fails.
    ///
    /// # Errors
    /// [`StartError`] naming the first server that could not be started, with its stderr's
    /// last lines.
    pub async fn start(&self, ctx: &CallContext) -> Result<(), StartError> {
        let mut live = self.live.write().await;
        for decl in &self.decls {
            match connect(decl, ctx).await {
                Ok(l) => live.push(Arc::new(l)),
                Err(e) => {
                    for l in live.drain(..) {
                        l.shutdown().await;
                    }
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    /// The tools offered now, server by server in declaration order.
    pub async fn specs(&self) -> Vec<ToolSpec> {
        let live = self.live.read().await;
        let mut specs = Vec::new();
        for l in live.iter() {
            for t in l.tools.lock().expect("tools lock").iter() {
                specs.push(spec(&l.decl.name, t));
            }
        }
        specs
    }

    /// Lists again the tools of every server whose list may have changed — one that
    /// declared `tools.listChanged` (listed at every turn: its notification is handled on a
    /// task of the SDK's own, so a flag it sets could still be on its way when the turn
    /// starts), or one that sent `notifications/tools/list_changed` undeclared; returns
    /// whether any list changed. A server that cannot list keeps its former tools (its
    /// calls will say why).
    pub async fn refresh(&self) -> bool {
        let live = self.live.read().await;
        let mut any = false;
        for l in live.iter() {
            let notified = l.changed.swap(false, Ordering::SeqCst);
            if notified || l.declares_list_changed {
                match list_tools(&l.peer, &l.decl).await {
                    Ok(tools) => {
                        let mut held = l.tools.lock().expect("tools lock");
                        if *held != tools {
                            *held = tools;
                            any = true;
                        }
                    }
                    Err(e) => {
                        tracing::warn!(server = %l.decl.name, error = %e, "re-listing an MCP server's tools failed")
                    }
                }
            }
        }
        any
    }

    /// Calls the tool the model named `name`, if it is one of these servers'
    /// (`mcp__<server>__<tool>`); `None` when it is not.
    pub async fn call(&self, name: &str, input: &Value) -> Option<Outcome> {
        let (server, tool) = name.strip_prefix(MCP_TOOL_PREFIX)?.split_once("__")?;
        let live = self.live.read().await.iter().find(|l| l.decl.name == server).cloned()?;
        if !live.tools.lock().expect("tools lock").iter().any(|t| t.name == tool) {
            return None;
        }
        Some(live.call(tool, input).await)
    }

    /// Closes every connection (see [`SHUTDOWN_GRACE`]).
    pub async fn shutdown(&self) {
        let live: Vec<Arc<Live>> = self.live.write().await.drain(..).collect();
        for l in live {
            l.shutdown().await;
        }
    }
}

/// The name `tool` of `server` is offered under.
pub fn offered_name(server: &str, tool: &str) -> String {
    format!("{MCP_TOOL_PREFIX}{server}__{tool}")
}

fn spec(server: &str, t: &Tool) -> ToolSpec {
    ToolSpec {
        name: offered_name(server, &t.name),
        description: t.description.as_deref().unwrap_or_default().to_string(),
        parameters: Value::Object((*t.input_schema).clone()),
    }
}

/// Whether a model provider takes `name` as a tool name (`^[a-zA-Z0-9_-]{1,64}$`, the
/// narrowest of the drivers' rules).
fn is_offerable(name: &str) -> bool {
    !name.is_empty() && name.len() <= 64 && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

async fn connect(decl: &McpServer, ctx: &CallContext) -> Result<Live, StartError> {
    let changed = Arc::new(AtomicBool::new(false));
    let handler = Handler { changed: changed.clone() };
    let limit = Duration::from_secs(decl.timeout_secs).min(START_LIMIT);
    let failed = |what: String, stderr: Vec<String>| StartError::Failed { server: decl.name.clone(), what, stderr };
    let span = tracing::info_span!(
        "mcp.initialize",
        otel.name = "initialize",
        otel.kind = "client",
        mcp.method.name = "initialize",
        mcp.server.name = %decl.name,
    );
    let (service, child) = match &decl.transport {
        McpTransport::Stdio { command, env } => {
            let mut child = stdio::Child::spawn(&decl.name, command, env, ctx)?;
            let transport = child.take_transport();
            match tokio::time::timeout(limit, handler.serve(transport)).instrument(span).await {
                Ok(Ok(service)) => (service, Some(child)),
                Ok(Err(e)) => {
                    let stderr = child.stopped_stderr().await;
                    return Err(failed(format!("failed to initialize: {e}"), stderr));
                }
                Err(_) => {
                    let stderr = child.stopped_stderr().await;
                    return Err(failed(format!("did not initialize within {} s", limit.as_secs()), stderr));
                }
            }
        }
        McpTransport::Http { url, headers } => {
            use rmcp::transport::StreamableHttpClientTransport;
            use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
            let mut map = std::collections::HashMap::new();
            for (k, v) in headers {
                let name = reqwest::header::HeaderName::try_from(k.as_str())
                    .map_err(|e| failed(format!("has a bad header name {k:?}: {e}"), vec![]))?;
                // The value may hold a secret: never shown.
                let mut value = reqwest::header::HeaderValue::try_from(v.as_str())
                    .map_err(|_| failed(format!("has a bad value for header {k:?}"), vec![]))?;
                value.set_sensitive(true);
                map.insert(name, value);
            }
            let config = StreamableHttpClientTransportConfig::with_uri(url.as_str()).custom_headers(map);
            mur_nats::tls::install_crypto_provider();
            let transport = StreamableHttpClientTransport::with_client(reqwest::Client::new(), config);
            match tokio::time::timeout(limit, handler.serve(transport)).instrument(span).await {
                Ok(Ok(service)) => (service, None),
                Ok(Err(e)) => return Err(failed(format!("at {} failed to initialize: {e}", redact(url)), vec![])),
                Err(_) => {
                    return Err(failed(
                        format!("at {} did not initialize within {} s", redact(url), limit.as_secs()),
                        vec![],
                    ));
                }
            }
        }
    };
    let peer = service.peer().clone();
    let tools = match tokio::time::timeout(limit, list_tools(&peer, decl)).await.unwrap_or(Err(ListError::Elapsed)) {
        Ok(tools) => tools,
        Err(e) => {
            let stderr = match &child {
                Some(c) => c.stopped_stderr().await,
                None => vec![],
            };
            return Err(failed(format!("failed to list its tools: {e}"), stderr));
        }
    };
    let declares_list_changed = peer
        .peer_info()
        .and_then(|info| info.capabilities.tools.as_ref().and_then(|t| t.list_changed))
        .unwrap_or(false);
    Ok(Live {
        declares_list_changed,
        decl: decl.clone(),
        peer,
        service: tokio::sync::Mutex::new(Some(service)),
        tools: std::sync::Mutex::new(tools),
        changed,
        child,
    })
}

/// Why listing a server's tools failed.
#[derive(Debug, thiserror::Error)]
enum ListError {
    #[error("{0}")]
    Service(#[from] rmcp::ServiceError),
    #[error("timed out")]
    Elapsed,
}

impl From<tokio::time::error::Elapsed> for ListError {
    fn from(_: tokio::time::error::Elapsed) -> Self {
        ListError::Elapsed
    }
}

/// The server's tools that are offered: in its allow-list (when it has one) and with a name
/// a provider takes (others are skipped, logged).
async fn list_tools(peer: &Peer<RoleClient>, decl: &McpServer) -> Result<Vec<Tool>, ListError> {
    let span = tracing::info_span!(
        "mcp.tools_list",
        otel.name = "tools/list",
        otel.kind = "client",
        mcp.method.name = "tools/list",
        mcp.server.name = %decl.name,
    );
    let all =
        tokio::time::timeout(Duration::from_secs(decl.timeout_secs), peer.list_all_tools()).instrument(span).await??;
    Ok(all
        .into_iter()
        .filter(|t| decl.tools.as_ref().is_none_or(|allow| allow.iter().any(|a| *a == t.name)))
        .filter(|t| {
            let ok = is_offerable(&offered_name(&decl.name, &t.name));
            if !ok {
                tracing::warn!(server = %decl.name, tool = %t.name, "an MCP tool whose offered name a model provider refuses is skipped");
            }
            ok
        })
        .collect())
}

impl Live {
    async fn call(&self, tool: &str, input: &Value) -> Outcome {
        let server = &self.decl.name;
        let offered = offered_name(server, tool);
        let arguments = match input {
            Value::Object(map) => Some(map.clone()),
            Value::Null => None,
            other => {
                return self
                    .outcome(Outcome::error(format!("tool {offered:?}: the input must be an object, got {other}")));
            }
        };
        let mut params = CallToolRequestParams::new(tool.to_string());
        params.arguments = arguments;
        let span = tracing::info_span!(
            "mcp.tools_call",
            otel.name = %format!("tools/call {tool}"),
            otel.kind = "client",
            mcp.method.name = "tools/call",
            gen_ai.tool.name = %tool,
            gen_ai.operation.name = "execute_tool",
            mcp.server.name = %server,
            network.transport = if self.child.is_some() { "pipe" } else { "tcp" },
        );
        let timeout = Duration::from_secs(self.decl.timeout_secs);
        let called = tokio::time::timeout(timeout, self.peer.call_tool(params)).instrument(span).await;
        let outcome = match called {
            Ok(Ok(result)) => from_result(&result),
            Ok(Err(e)) => {
                let mut text = format!("MCP server {server:?} failed the call of {tool:?}: {e}");
                let closed = matches!(e, rmcp::ServiceError::TransportClosed | rmcp::ServiceError::TransportSend(_));
                if let Some(child) = &self.child
                    && let Some(exit) = if closed { child.ended().await } else { child.exited() }
                {
                    text = format!("MCP server {server:?} has exited ({exit}); the call of {tool:?} failed: {e}");
                    text.push_str(&stderr_note(&child.stderr_tail()));
                }
                Outcome::error(text)
            }
            Err(_) => Outcome::error(format!(
                "MCP server {server:?} did not answer the call of {tool:?} within {} s (timeout_secs); the call was \
                 cancelled",
                timeout.as_secs()
            )),
        };
        self.outcome(outcome)
    }

    fn outcome(&self, outcome: Outcome) -> Outcome {
        Outcome { mcp_server: Some(self.decl.name.clone()), ..outcome }
    }

    async fn shutdown(&self) {
        if let Some(mut service) = self.service.lock().await.take() {
            // Cancelling drops the transport: a stdio server's stdin closes.
            let _ = service.close_with_timeout(SHUTDOWN_GRACE).await;
        }
        if let Some(child) = &self.child {
            child.stop(SHUTDOWN_GRACE).await;
        }
    }
}

/// A call's result as the model sees it.
fn from_result(result: &CallToolResult) -> Outcome {
    let mut parts: Vec<String> = result.content.iter().map(content_text).collect();
    if parts.is_empty()
        && let Some(structured) = &result.structured_content
    {
        parts.push(structured.to_string());
    }
    let text = cap(parts.join("\n"));
    if result.is_error == Some(true) {
        Outcome::error(text)
    } else {
        Outcome { is_error: false, ..Outcome::error(text) }
    }
}

fn content_text(block: &ContentBlock) -> String {
    match block {
        ContentBlock::Text(t) => t.text.clone(),
        ContentBlock::Image(i) => format!("[image: {}, {} bytes of base64]", i.mime_type, i.data.len()),
        ContentBlock::Audio(a) => format!("[audio: {}, {} bytes of base64]", a.mime_type, a.data.len()),
        ContentBlock::Resource(r) => match &r.resource {
            ResourceContents::TextResourceContents { text, .. } => text.clone(),
            ResourceContents::BlobResourceContents { uri, mime_type, blob, .. } => format!(
                "[resource {uri}: {}, {} bytes of base64]",
                mime_type.as_deref().unwrap_or("application/octet-stream"),
                blob.len()
            ),
            _ => "[a resource of a kind murmur does not know]".to_string(),
        },
        ContentBlock::ResourceLink(l) => format!("[resource link: {}]", l.uri),
        _ => "[content of a kind murmur does not know]".to_string(),
    }
}

/// `text` cut at [`RESULT_LIMIT`] bytes on a character boundary, with a note when cut.
fn cap(text: String) -> String {
    if text.len() <= RESULT_LIMIT {
        return text;
    }
    let cut = super::process::char_boundary_cut(text.as_bytes(), RESULT_LIMIT);
    format!("{}\n[truncated: {} bytes]", &text[..cut], text.len())
}

/// `url` without its user info and query (they may hold secrets).
fn redact(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(mut u) => {
            let _ = u.set_username("");
            let _ = u.set_password(None);
            u.set_query(None);
            u.to_string()
        }
        Err(_) => "<the url>".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offered_names_join_server_and_tool_and_refuse_what_providers_refuse() {
        assert_eq!(offered_name("git", "git_status"), "mcp__git__git_status");
        assert!(is_offerable("mcp__git__git_status"));
        assert!(!is_offerable("mcp__fs__read.file"));
        assert!(!is_offerable(&offered_name("s", &"x".repeat(60))));
    }

    #[test]
    fn results_become_text_and_is_error_a_tool_error() {
        let ok = CallToolResult::success(vec![ContentBlock::text("one"), ContentBlock::text("two")]);
        assert_eq!(from_result(&ok), Outcome { is_error: false, ..Outcome::error("one\ntwo") });
        let bad = CallToolResult::error(vec![ContentBlock::text("no such file")]);
        assert_eq!(from_result(&bad), Outcome::error("no such file"));
        let long = CallToolResult::success(vec![ContentBlock::text("é".repeat(RESULT_LIMIT))]);
        let text = from_result(&long).text;
        assert!(text.ends_with(&format!("\n[truncated: {} bytes]", 2 * RESULT_LIMIT)), "{}", &text[text.len() - 40..]);
    }

    #[test]
    fn urls_are_shown_without_credentials_or_query() {
        assert_eq!(redact("https://u:p@mcp.example.com/mcp?token=s"), "https://mcp.example.com/mcp");
    }
}
