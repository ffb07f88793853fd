//! Tools declared in the manifest's `tools:` as commands: the call's input JSON goes to the
//! command's stdin, its stdout is the result; a non-zero exit is an error result.

use super::{CallContext, Outcome};
use crate::driver::ToolSpec;
use mur_proto::manifest::ToolDecl;
use serde_json::Value;

/// One declared tool.
pub struct CommandTool {
    decl: ToolDecl,
}

impl CommandTool {
    /// The tool for `decl`.
    pub fn new(decl: ToolDecl) -> Self {
        CommandTool { decl }
    }

    /// Its name.
    pub fn name(&self) -> &str {
        &self.decl.name
    }

    /// Its spec for the model.
    pub fn spec(&self) -> ToolSpec {
        ToolSpec {
            name: self.decl.name.clone(),
            description: self.decl.description.clone().unwrap_or_default(),
            parameters: self.decl.parameters.clone(),
        }
    }

    /// Runs the command with `input` on stdin.
    pub async fn run(&self, input: &Value, ctx: &CallContext) -> Outcome {
        let _ = (input, ctx);
        Outcome::error("command tools not implemented yet")
    }
}
