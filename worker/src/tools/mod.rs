//! Tools the model may call: the built-in shell tools (one per allowed binary) and tools
//! declared in the manifest as commands. The loop sees them through [`Tools`]. A shell
//! command that outlives its grace period moves to the background ([`background`]).

pub mod background;
pub mod command;
pub mod fleet;
pub(crate) mod lifeline;
pub mod mcp;
pub(crate) mod process;
pub mod shell;

use crate::driver::ToolSpec;
use async_trait::async_trait;
use mur_proto::Manifest;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// Where a tool call runs.
#[derive(Clone, Debug)]
pub struct CallContext {
    /// The capsule folder (declared tools' commands are relative to it).
    pub capsule_dir: PathBuf,
    /// The accessible workdir: commands run here.
    pub workdir: PathBuf,
    /// Where full outputs of truncated streams go (`<workdir>/logs`).
    pub logs_dir: PathBuf,
    /// The session's sandbox (`sandbox:`): shell commands and command tools start confined
    /// by it; `None` runs them unconfined.
    pub sandbox: Option<std::sync::Arc<crate::sandbox::Confinement>>,
    /// The call's idempotency key (issue #34, `mur_proto::cluster::tool_call_key`), set
    /// per call by the loop: shell commands and command tools get it as
    /// `MUR_TOOL_CALL_ID`. `None` outside a call.
    pub tool_call_id: Option<String>,
}

/// What a shell command did, for the `shell` trace line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShellRun {
    /// Resolved absolute path of the binary, or its bare name.
    pub binary: String,
    /// The command as the model gave it.
    pub command: String,
    /// Exit code; 128+signal when killed by a signal.
    pub exit_code: i32,
    /// Bytes written to stdout.
    pub stdout_bytes: u64,
    /// Bytes written to stderr.
    pub stderr_bytes: u64,
}

/// A shell command that outlived its grace period and moved to the background, for the
/// `shell_detached` trace line (the session-loop seed, §Detached shell).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DetachedWork {
    /// `wrk_…`, the handle the turn was given.
    pub work_id: String,
    /// Resolved absolute path of the binary, or its bare name.
    pub binary: String,
    /// The command as the model gave it.
    pub command: String,
    /// The grace period it outlived, ms.
    pub grace_ms: u64,
    /// Time from its start to its demotion, ms.
    pub running_ms: u64,
    /// Where its output goes, relative to the workdir when the logs are under it
    /// (`logs/<work_id>.log`).
    pub output_path: String,
}

/// The result of one tool call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Outcome {
    /// The text fed back to the model.
    pub text: String,
    /// Whether the call failed (unknown tool, refused binary, bad input, tool error).
    pub is_error: bool,
    /// Set when a shell command ran to its end in the foreground.
    pub shell: Option<ShellRun>,
    /// Set instead of `shell` when the command moved to the background.
    pub detached: Option<DetachedWork>,
    /// The rules the call's command ran under, when it ran sandboxed (the `sandbox` trace
    /// line).
    pub sandbox: Option<crate::sandbox::Applied>,
    /// The MCP server that served the call, for a tool of `mcp_servers:` (the
    /// `tool_call` line's `mcp_server`).
    pub mcp_server: Option<String>,
}

impl Outcome {
    /// A failed call with `text` as its message.
    pub fn error(text: impl Into<String>) -> Self {
        Outcome { text: text.into(), is_error: true, shell: None, detached: None, sandbox: None, mcp_server: None }
    }
}

/// A set of tools.
#[async_trait]
pub trait Tools: Send + Sync {
    /// The tools offered to the model now, in order (they may change between turns, see
    /// [`Tools::refresh`]).
    fn specs(&self) -> Arc<[ToolSpec]>;

    /// Runs tool `name` with `input`. Never fails: every problem becomes an error
    /// [`Outcome`] that the model sees, and the loop goes on.
    async fn call(&self, name: &str, input: &Value, ctx: &CallContext) -> Outcome;

    /// Starts what the tools need for the session (its MCP servers), before the first
    /// model call. Default: nothing to start.
    ///
    /// # Errors
    /// [`mcp::StartError`] naming the server that could not be started.
    async fn start(&self, _ctx: &CallContext) -> Result<(), mcp::StartError> {
        Ok(())
    }

    /// Takes in tool-list changes (an MCP server's `list_changed`), between turns.
    async fn refresh(&self) {}

    /// Stops what [`Tools::start`] started, at the session's end.
    async fn shutdown(&self) {}
}

/// The tools a manifest declares: shell tools for `capabilities.shell.allow` (in that
/// order), then `tools:` entries.
pub struct Toolbox {
    /// The tools offered now: `base`, then the MCP servers' tools.
    specs: std::sync::RwLock<Arc<[ToolSpec]>>,
    /// Shell tools, then `tools:` entries.
    base: Vec<ToolSpec>,
    mcp: mcp::Mcp,
    shell: shell::Shell,
    commands: Vec<command::CommandTool>,
    fleet_tools: Vec<fleet::FleetTool>,
    fleet_access: Option<fleet::FleetAccess>,
}

impl Toolbox {
    /// The toolbox of `manifest`: its shell tools, then its `tools:` entries in order
    /// (commands, or the built-in fleet tools, [`fleet`]), then, once started
    /// ([`Tools::start`]), the tools of its `mcp_servers:` ([`mcp`]).
    pub fn from_manifest(manifest: &Manifest) -> Self {
        let shell = shell::Shell::new(manifest.capabilities.shell_allow.clone());
        let mut specs = shell.specs();
        let (mut commands, mut fleet_tools) = (Vec::new(), Vec::new());
        for decl in &manifest.tools {
            match fleet::FleetTool::from_decl(decl) {
                Some(tool) => {
                    specs.push(tool.spec());
                    fleet_tools.push(tool);
                }
                None => {
                    let tool = command::CommandTool::new(decl.clone());
                    specs.push(tool.spec());
                    commands.push(tool);
                }
            }
        }
        Toolbox {
            specs: std::sync::RwLock::new(specs.clone().into()),
            base: specs,
            mcp: mcp::Mcp::new(manifest.mcp_servers.clone()),
            shell,
            commands,
            fleet_tools,
            fleet_access: None,
        }
    }

    /// Gives the built-in fleet tools their way to the cluster (a worker's sessions).
    pub fn with_fleet_access(mut self, access: fleet::FleetAccess) -> Self {
        self.fleet_access = Some(access);
        self
    }

    /// Moves shell commands still running after `grace` to the background, reporting them
    /// to `sink` (`lifecycle.shell_grace_secs`; zero demotes at the first check). Without
    /// this, shell commands are waited for to their end.
    pub fn with_detach(mut self, grace: Duration, sink: background::DetachSink) -> Self {
        self.shell = self.shell.with_detach(grace, sink);
        self
    }

    /// Whether `name` is one of the shell tools.
    pub fn is_shell(&self, name: &str) -> bool {
        self.shell.allows(name)
    }

    /// Offers the MCP servers' tools as they are now after the others.
    async fn offer_mcp(&self) {
        let mut all = self.base.clone();
        all.extend(self.mcp.specs().await);
        *self.specs.write().expect("specs lock") = all.into();
    }
}

#[async_trait]
impl Tools for Toolbox {
    fn specs(&self) -> Arc<[ToolSpec]> {
        self.specs.read().expect("specs lock").clone()
    }

    async fn start(&self, ctx: &CallContext) -> Result<(), mcp::StartError> {
        if self.mcp.is_empty() {
            return Ok(());
        }
        self.mcp.start(ctx).await?;
        self.offer_mcp().await;
        Ok(())
    }

    async fn refresh(&self) {
        if self.mcp.refresh().await {
            self.offer_mcp().await;
        }
    }

    async fn shutdown(&self) {
        self.mcp.shutdown().await;
    }

    async fn call(&self, name: &str, input: &Value, ctx: &CallContext) -> Outcome {
        if self.shell.allows(name) {
            return self.shell.run(name, input, ctx).await;
        }
        if let Some(tool) = self.commands.iter().find(|t| t.name() == name) {
            return tool.run(input, ctx).await;
        }
        if let Some(tool) = self.fleet_tools.iter().find(|t| t.name() == name) {
            return tool.run(input, self.fleet_access.as_ref(), ctx).await;
        }
        if name.starts_with(mur_proto::manifest::MCP_TOOL_PREFIX)
            && let Some(outcome) = self.mcp.call(name, input).await
        {
            return outcome;
        }
        let specs = self.specs();
        let known: Vec<&str> = specs.iter().map(|s| s.name.as_str()).collect();
        Outcome::error(format!("unknown tool {name:?}; available tools: {}", known.join(", ")))
    }
}

/// Resolves `binary` on `PATH` to an absolute path, if it can be found.
pub fn which(binary: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|dir| dir.join(binary)).find(|p| is_executable(p))
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    p.metadata().is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const MANIFEST: &str = r#"
name: toolbox
version: 1.0.0
inference:
  driver: scripted
  script: replies.yaml
capabilities:
  shell:
    allow: [sh, printf]
tools:
  - name: lookup
    description: Look a word up.
    command: [tools/lookup.sh]
    parameters:
      type: object
      properties:
        word: {type: string}
  - name: stamp
    command: date
"#;

    fn toolbox() -> Toolbox {
        Toolbox::from_manifest(&Manifest::from_yaml(MANIFEST, &|_| None).unwrap())
    }

    fn context(dir: &Path) -> CallContext {
        let workdir = dir.join("workdir");
        std::fs::create_dir_all(&workdir).unwrap();
        CallContext {
            capsule_dir: dir.join("capsule"),
            logs_dir: workdir.join("logs"),
            workdir,
            sandbox: None,
            tool_call_id: None,
        }
    }

    #[test]
    fn specs_list_shell_tools_in_allow_list_order_then_declared_tools() {
        let tools = toolbox();
        let specs = tools.specs();
        let names: Vec<&str> = specs.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["sh", "printf", "lookup", "stamp"]);
        let lookup = &tools.specs()[2];
        assert_eq!(lookup.description, "Look a word up.");
        assert_eq!(lookup.parameters["properties"]["word"]["type"], "string");
        assert_eq!(tools.specs()[0].parameters["required"], json!(["command"]));
        assert!(tools.is_shell("sh") && tools.is_shell("printf"));
        assert!(!tools.is_shell("lookup") && !tools.is_shell("rm"));
    }

    #[tokio::test]
    async fn a_binary_outside_the_allow_list_is_refused_and_nothing_runs() {
        let dir = tempfile::tempdir().unwrap();
        let ctx = context(dir.path());
        let victim = ctx.workdir.join("keep.txt");
        std::fs::write(&victim, "precious").unwrap();
        let out = toolbox().call("rm", &json!({"command": "-f keep.txt"}), &ctx).await;
        assert!(out.is_error);
        assert_eq!(out.text, "unknown tool \"rm\"; available tools: sh, printf, lookup, stamp");
        assert_eq!(out.shell, None);
        assert!(victim.exists());
        assert!(!ctx.workdir.join(shell::HOME_DIR).exists(), "nothing ran");
    }

    #[tokio::test]
    async fn an_allowed_binary_is_called_as_a_shell_tool() {
        let dir = tempfile::tempdir().unwrap();
        let ctx = context(dir.path());
        let out = toolbox().call("printf", &json!({"command": "'%s' hi"}), &ctx).await;
        assert!(!out.is_error, "{}", out.text);
        assert_eq!(out.text, "$ '%s' hi\nExit code: 0\nStdout:\nhi\nStderr:\n");
        assert!(out.shell.is_some());
    }
}
