//! The manifest's `mcp_servers:` block (issue #35): the MCP servers whose tools a capsule's
//! model may call, each reached over stdio (`command`) or streamable HTTP (`url`). This
//! module checks the block's shape and values; starting and calling the servers is the
//! worker's (`worker/src/tools/mcp`).

use super::{Argv, Int, NAME_RULE, Rules, is_valid_name, resolve_env};
use serde::Deserialize;
use std::collections::{BTreeMap, BTreeSet};

/// The separator of an offered tool's name: a server `git`'s tool `git_status` is offered
/// to the model as `mcp__git__git_status` (issue #35).
pub const MCP_TOOL_PREFIX: &str = "mcp__";

/// Default per-call deadline of an MCP tool call, seconds (the `tools:` default).
pub const DEFAULT_MCP_TIMEOUT_SECS: u64 = 300;

/// One validated entry of `mcp_servers:`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct McpServer {
    /// Unique among the block's entries: 1–64 chars of `a-z 0-9 - _` ([`is_valid_name`]).
    pub name: String,
    /// How the server is reached.
    pub transport: McpTransport,
    /// The tools offered (allow-list, by the server's own tool names); `None`: all of them.
    pub tools: Option<Vec<String>>,
    /// Deadline of one tool call, seconds; default [`DEFAULT_MCP_TIMEOUT_SECS`].
    pub timeout_secs: u64,
    /// The tools declared idempotent (by the server's own tool names; default none): a
    /// call of one found in doubt at a takeover runs again; any other is reported to the
    /// model (issue #34).
    pub idempotent: Vec<String>,
}

/// How an MCP server is reached.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum McpTransport {
    /// A program the session starts, speaking MCP on its stdin and stdout.
    Stdio {
        /// argv: a program relative to the capsule folder when it holds a `/` and is not
        /// absolute, else looked up on the worker machine's `PATH`.
        command: Vec<String>,
        /// Extra environment variables of the program, `${VAR}` resolved at load.
        env: BTreeMap<String, String>,
    },
    /// A server at an URL, spoken to with MCP's streamable HTTP transport.
    Http {
        /// `https` to any host, `http` to a loopback host only ([`super::check_endpoint`]).
        url: String,
        /// Extra request headers, `${VAR}` resolved at load (secrets: never printed).
        headers: BTreeMap<String, String>,
    },
}

/// The block's entry as written.
#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping")]
pub(super) struct RawMcpServer {
    name: Option<String>,
    command: Option<Argv>,
    env: Option<BTreeMap<String, String>>,
    url: Option<String>,
    headers: Option<BTreeMap<String, String>>,
    tools: Option<Vec<String>>,
    timeout_secs: Option<Int>,
    idempotent: Option<Vec<String>>,
}

/// Checks every entry (`mcp_servers[i].<field>: <rule>`): a valid, unique name; exactly one
/// of `command` (with `env`) and `url` (with `headers`); `${VAR}` in `env`, `url` and
/// `headers` resolved by `env_var`; `timeout_secs` at least 1; `idempotent` names tools
/// once each, among `tools` when that is given.
pub(super) fn validate(
    raw: Vec<RawMcpServer>,
    env_var: &dyn Fn(&str) -> Option<String>,
    r: &mut Rules,
) -> Vec<McpServer> {
    let mut names = BTreeSet::new();
    let mut out = Vec::with_capacity(raw.len());
    for (i, s) in raw.into_iter().enumerate() {
        let path = |f: &str| format!("mcp_servers[{i}].{f}");
        let name = match s.name {
            None => {
                r.fail(&path("name"), "required");
                String::new()
            }
            Some(n) => {
                if !is_valid_name(&n) {
                    r.fail(&path("name"), format_args!("{NAME_RULE}, got {n:?}"));
                } else if !names.insert(n.clone()) {
                    r.fail(&path("name"), format_args!("duplicate MCP server name {n:?}"));
                }
                n
            }
        };
        let transport = match (s.command.map(Argv::into_vec), s.url) {
            (Some(_), Some(_)) => {
                r.fail(&path("command"), "give command (stdio) or url (streamable HTTP), not both");
                None
            }
            (None, None) => {
                r.fail(&path("command"), "required: give command (stdio) or url (streamable HTTP)");
                None
            }
            (Some(command), None) => {
                if command.is_empty() || command[0].is_empty() {
                    r.fail(&path("command"), "must name a program");
                }
                if s.headers.is_some() {
                    r.fail(&path("headers"), "allowed only with url");
                }
                let env = resolve_map(&path("env"), s.env, env_var, r);
                Some(McpTransport::Stdio { command, env })
            }
            (None, Some(url)) => {
                if s.env.is_some() {
                    r.fail(&path("env"), "allowed only with command (a server at an url has its own)");
                }
                let url = match resolve_env(&url, env_var) {
                    Ok(u) => u,
                    Err(rule) => {
                        r.fail(&path("url"), rule);
                        url
                    }
                };
                if let Err(rule) = super::check_endpoint(&url) {
                    r.fail(&path("url"), rule);
                }
                let headers = resolve_map(&path("headers"), s.headers, env_var, r);
                Some(McpTransport::Http { url, headers })
            }
        };
        if let Some(tools) = &s.tools {
            let mut seen = BTreeSet::new();
            for (j, t) in tools.iter().enumerate() {
                if t.is_empty() {
                    r.fail(&format!("mcp_servers[{i}].tools[{j}]"), "must be a tool name, got \"\"");
                } else if !seen.insert(t) {
                    r.fail(&format!("mcp_servers[{i}].tools[{j}]"), format_args!("duplicate tool {t:?}"));
                }
            }
        }
        let idempotent = s.idempotent.unwrap_or_default();
        let mut seen = BTreeSet::new();
        for (j, t) in idempotent.iter().enumerate() {
            let at = format!("mcp_servers[{i}].idempotent[{j}]");
            if t.is_empty() {
                r.fail(&at, "must be a tool name, got \"\"");
            } else if !seen.insert(t) {
                r.fail(&at, format_args!("duplicate tool {t:?}"));
            } else if s.tools.as_ref().is_some_and(|offered| !offered.contains(t)) {
                r.fail(&at, format_args!("must be one of the tools offered (mcp_servers[{i}].tools), got {t:?}"));
            }
        }
        let timeout_secs = r.int(&path("timeout_secs"), s.timeout_secs, 1, DEFAULT_MCP_TIMEOUT_SECS as i64) as u64;
        if let Some(transport) = transport {
            out.push(McpServer { name, transport, tools: s.tools, timeout_secs, idempotent });
        }
    }
    out
}

/// `map` with `${VAR}` resolved in each value; an unresolvable one fails `<path>.<key>`.
fn resolve_map(
    path: &str,
    map: Option<BTreeMap<String, String>>,
    env_var: &dyn Fn(&str) -> Option<String>,
    r: &mut Rules,
) -> BTreeMap<String, String> {
    let mut resolved = BTreeMap::new();
    for (k, v) in map.unwrap_or_default() {
        match resolve_env(&v, env_var) {
            Ok(v) => {
                resolved.insert(k, v);
            }
            Err(rule) => r.fail(&format!("{path}.{k}"), rule),
        }
    }
    resolved
}
