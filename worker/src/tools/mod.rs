//! Tools the model may call: the built-in shell tools (one per allowed binary) and tools
//! declared in the manifest as commands. The loop sees them through [`Tools`].

pub mod command;
mod process;
pub mod shell;

use crate::driver::ToolSpec;
use async_trait::async_trait;
use mur_proto::Manifest;
use serde_json::Value;
use std::path::{Path, PathBuf};

/// Where a tool call runs.
#[derive(Clone, Debug)]
pub struct CallContext {
    /// The capsule folder (declared tools' commands are relative to it).
    pub capsule_dir: PathBuf,
    /// The accessible workdir: commands run here.
    pub workdir: PathBuf,
    /// Where full outputs of truncated streams go (`<workdir>/logs`).
    pub logs_dir: PathBuf,
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

/// The result of one tool call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Outcome {
    /// The text fed back to the model.
    pub text: String,
    /// Whether the call failed (unknown tool, refused binary, bad input, tool error).
    pub is_error: bool,
    /// Set when a shell command ran.
    pub shell: Option<ShellRun>,
}

impl Outcome {
    /// A failed call with `text` as its message.
    pub fn error(text: impl Into<String>) -> Self {
        Outcome {
            text: text.into(),
            is_error: true,
            shell: None,
        }
    }
}

/// A set of tools.
#[async_trait]
pub trait Tools: Send + Sync {
    /// The tools offered to the model, in order.
    fn specs(&self) -> &[ToolSpec];

    /// Runs tool `name` with `input`. Never fails: every problem becomes an error
    /// [`Outcome`] that the model sees, and the loop goes on.
    async fn call(&self, name: &str, input: &Value, ctx: &CallContext) -> Outcome;
}

/// The tools a manifest declares: shell tools for `capabilities.shell.allow` (in that
/// order), then `tools:` entries.
pub struct Toolbox {
    specs: Vec<ToolSpec>,
    shell: shell::Shell,
    commands: Vec<command::CommandTool>,
}

impl Toolbox {
    /// The toolbox of `manifest`.
    pub fn from_manifest(manifest: &Manifest) -> Self {
        let shell = shell::Shell::new(manifest.capabilities.shell_allow.clone());
        let commands: Vec<_> = manifest
            .tools
            .iter()
            .cloned()
            .map(command::CommandTool::new)
            .collect();
        let mut specs = shell.specs();
        specs.extend(commands.iter().map(command::CommandTool::spec));
        Toolbox {
            specs,
            shell,
            commands,
        }
    }

    /// Whether `name` is one of the shell tools.
    pub fn is_shell(&self, name: &str) -> bool {
        self.shell.allows(name)
    }
}

#[async_trait]
impl Tools for Toolbox {
    fn specs(&self) -> &[ToolSpec] {
        &self.specs
    }

    async fn call(&self, name: &str, input: &Value, ctx: &CallContext) -> Outcome {
        if self.shell.allows(name) {
            return self.shell.run(name, input, ctx).await;
        }
        if let Some(tool) = self.commands.iter().find(|t| t.name() == name) {
            return tool.run(input, ctx).await;
        }
        let known: Vec<&str> = self.specs.iter().map(|s| s.name.as_str()).collect();
        Outcome::error(format!(
            "unknown tool {name:?}; available tools: {}",
            known.join(", ")
        ))
    }
}

/// Resolves `binary` on `PATH` to an absolute path, if it can be found.
pub fn which(binary: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(binary))
        .find(|p| is_executable(p))
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    p.metadata()
        .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}
