//! MCP servers for tests, written with the official SDK (`rmcp`), speaking the real wire
//! format: over stdio (the `mcp-test-server` binary of this package) or streamable HTTP on a
//! real socket ([`serve_http`]).
//!
//! Tools of [`TestServer`]:
//! - `echo {text}`: returns `text`;
//! - `add {a, b}`: returns `a + b` (integers);
//! - `fail {reason}`: an `isError` result with `reason`;
//! - `where`: the folder it runs in, then `HOME` and `MCP_GREETING`, one per line;
//! - `crash`: writes `crashing on purpose` to stderr and exits with code 3 (stdio only);
//! - `hang`: never answers;
//! - `grow`: adds the tool `extra` (returns `extra tool`) and sends `tools/list_changed`.

use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, ListToolsResult, PaginatedRequestParams,
    ServerCapabilities, ServerConfig, Tool,
};
use rmcp::service::RequestContext;
use rmcp::{ErrorData, RoleServer, ServerHandler};
use serde_json::{Value, json};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// The test server's state (one per connection).
#[derive(Clone, Default)]
pub struct TestServer {
    grown: Arc<AtomicBool>,
}

fn tool(name: &'static str, description: &'static str, schema: Value) -> Tool {
    let Value::Object(map) = schema else { panic!("a schema is an object") };
    Tool::new(name, description, Arc::new(map))
}

fn text(t: impl Into<String>) -> CallToolResult {
    CallToolResult::success(vec![ContentBlock::text(t.into())])
}

impl TestServer {
    /// The tools it lists now.
    pub fn tools(&self) -> Vec<Tool> {
        let mut tools = vec![
            tool(
                "echo",
                "Returns its text.",
                json!({"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}),
            ),
            tool(
                "add",
                "Adds two integers.",
                json!({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}),
            ),
            tool("fail", "Always fails.", json!({"type": "object", "properties": {"reason": {"type": "string"}}})),
            tool("where", "Where it runs.", json!({"type": "object", "properties": {}})),
            tool("crash", "Exits at once.", json!({"type": "object", "properties": {}})),
            tool("hang", "Never answers.", json!({"type": "object", "properties": {}})),
            tool("grow", "Adds the tool extra.", json!({"type": "object", "properties": {}})),
        ];
        if self.grown.load(Ordering::SeqCst) {
            tools.push(tool("extra", "Added by grow.", json!({"type": "object", "properties": {}})));
        }
        tools
    }
}

impl ServerHandler for TestServer {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().enable_tool_list_changed().build())
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
        let args = request.arguments.unwrap_or_default();
        let result = match request.name.as_ref() {
            "echo" => text(args.get("text").and_then(Value::as_str).unwrap_or_default()),
            "add" => {
                let n = |k: &str| args.get(k).and_then(Value::as_i64).unwrap_or(0);
                text((n("a") + n("b")).to_string())
            }
            "fail" => CallToolResult::error(vec![ContentBlock::text(
                args.get("reason").and_then(Value::as_str).unwrap_or("failed").to_string(),
            )]),
            "where" => {
                let cwd = std::env::current_dir().map(|d| d.display().to_string()).unwrap_or_default();
                let var = |k: &str| std::env::var(k).unwrap_or_default();
                text(format!("{cwd}\n{}\n{}", var("HOME"), var("MCP_GREETING")))
            }
            "crash" => {
                eprintln!("crashing on purpose");
                std::process::exit(3);
            }
            "hang" => std::future::pending().await,
            "grow" => {
                self.grown.store(true, Ordering::SeqCst);
                let _ = context.peer.notify_tool_list_changed().await;
                text("grown")
            }
            "extra" if self.grown.load(Ordering::SeqCst) => text("extra tool"),
            other => return Err(ErrorData::invalid_params(format!("no tool {other}"), None)),
        };
        Ok(result.into())
    }
}

/// A streamable-HTTP MCP server of [`TestServer`]s on `127.0.0.1`, at `/mcp`; stops when
/// dropped.
pub struct HttpServer {
    /// `http://127.0.0.1:<port>/mcp`.
    pub url: String,
    stop: tokio_util::sync::CancellationToken,
}

impl Drop for HttpServer {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Starts an [`HttpServer`] (the listener is bound when this returns).
pub async fn serve_http() -> HttpServer {
    use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
    use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
    let stop = tokio_util::sync::CancellationToken::new();
    let service = StreamableHttpService::new(
        || Ok(TestServer::default()),
        Arc::new(LocalSessionManager::default()),
        StreamableHttpServerConfig::default().with_cancellation_token(stop.child_token()),
    );
    let router = axum::Router::new().nest_service("/mcp", service);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://127.0.0.1:{}/mcp", listener.local_addr().expect("addr").port());
    let stopped = stop.clone();
    tokio::spawn(async move {
        let _ = axum::serve(listener, router).with_graceful_shutdown(async move { stopped.cancelled().await }).await;
    });
    HttpServer { url, stop }
}
