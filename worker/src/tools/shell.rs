//! The built-in shell tools: one tool per binary in `capabilities.shell.allow`, named after
//! the binary, taking `{"command": "..."}` (`reference/murmur-runtime.md` §5, "Shell
//! tools"). Interpreters (sh, bash, zsh, fish, dash, ksh) get `-c <command>`; other
//! binaries get the command split into arguments with shell-word rules. A non-zero exit is
//! a successful call whose text reports the code. Each stream is cut at 16 KiB in the
//! result, with the full output in a log file under the workdir and its path in the text.

use super::{CallContext, Outcome};
use crate::driver::ToolSpec;
use serde_json::{Value, json};

/// Bytes of each stream kept in the tool result.
pub const STREAM_LIMIT: usize = 16 * 1024;

/// The shell tools of one capsule.
pub struct Shell {
    allow: Vec<String>,
}

impl Shell {
    /// Tools for the binaries in `allow`.
    pub fn new(allow: Vec<String>) -> Self {
        Shell { allow }
    }

    /// Whether `binary` is allowed (and so is a tool name).
    pub fn allows(&self, binary: &str) -> bool {
        self.allow.iter().any(|b| b == binary)
    }

    /// One spec per allowed binary.
    pub fn specs(&self) -> Vec<ToolSpec> {
        self.allow
            .iter()
            .map(|b| ToolSpec {
                name: b.clone(),
                description: format!("Run {b}. Input: {{\"command\": \"...\"}}."),
                parameters: json!({
                    "type": "object",
                    "properties": {"command": {"type": "string"}},
                    "required": ["command"]
                }),
            })
            .collect()
    }

    /// Runs `binary` with `input.command`.
    pub async fn run(&self, binary: &str, input: &Value, ctx: &CallContext) -> Outcome {
        let _ = (binary, input, ctx);
        Outcome::error("shell tool not implemented yet")
    }
}
