//! The driver-neutral conversation model: messages made of content blocks, as the runtime
//! keeps them (the runtime reference, §4). Drivers translate to and from their
//! provider's wire format; checkpoints and hook events carry this form.

use schemars::JsonSchema;
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::Value;

/// Who wrote a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// The task, feedback, seeds: what the model is asked.
    User,
    /// The model's reply: text and tool calls.
    Assistant,
    /// The result of one tool call; carries `tool_call_id`.
    Tool,
}

/// One content block of a message.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Block {
    /// Plain text.
    Text {
        /// The text, verbatim.
        text: String,
    },
    /// A tool call requested by the model. `input` is a JSON object.
    ToolCall {
        /// The provider's call id; the matching tool message carries it as `tool_call_id`.
        id: String,
        /// The tool's name as the model gave it (may name no tool).
        name: String,
        /// The arguments (a JSON object when the model sent valid JSON).
        input: Value,
    },
}

/// One message of the conversation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Message {
    /// Author.
    pub role: Role,
    /// Content blocks, in order. On input a plain string is accepted and becomes one
    /// text block (the context seed, step 4: "a plain summary string or an array of
    /// content blocks").
    #[serde(deserialize_with = "content_string_or_blocks")]
    #[schemars(schema_with = "content_schema")]
    pub content: Vec<Block>,
    /// For `tool` messages: the id of the call this answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// For `tool` messages: whether the call failed.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub is_error: bool,
}

impl Message {
    /// A user message holding one text block.
    pub fn user(text: impl Into<String>) -> Self {
        Message {
            role: Role::User,
            content: vec![Block::Text { text: text.into() }],
            tool_call_id: None,
            is_error: false,
        }
    }

    /// An assistant message with the given blocks.
    pub fn assistant(content: Vec<Block>) -> Self {
        Message { role: Role::Assistant, content, tool_call_id: None, is_error: false }
    }

    /// The result of the tool call `call_id`.
    pub fn tool_result(call_id: impl Into<String>, text: impl Into<String>, is_error: bool) -> Self {
        Message {
            role: Role::Tool,
            content: vec![Block::Text { text: text.into() }],
            tool_call_id: Some(call_id.into()),
            is_error,
        }
    }

    /// The text blocks joined with `\n` (the seeds' "final text" rule).
    pub fn text(&self) -> String {
        join_text(&self.content)
    }

    /// The tool calls of this message, in order.
    pub fn tool_calls(&self) -> impl Iterator<Item = (&str, &str, &Value)> {
        self.content.iter().filter_map(|b| match b {
            Block::ToolCall { id, name, input } => Some((id.as_str(), name.as_str(), input)),
            Block::Text { .. } => None,
        })
    }
}

/// Text blocks joined with `\n`; tool calls are skipped.
pub fn join_text(blocks: &[Block]) -> String {
    let mut out = String::new();
    for b in blocks {
        if let Block::Text { text } = b {
            if !out.is_empty() {
                out.push('\n');
            }
            out.push_str(text);
        }
    }
    out
}

fn content_string_or_blocks<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Block>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Content {
        Text(String),
        Blocks(Vec<Block>),
    }
    Ok(match Content::deserialize(d)? {
        Content::Text(text) => vec![Block::Text { text }],
        Content::Blocks(blocks) => blocks,
    })
}

/// The schema of `content`: always an array of blocks as the runtime writes it; a string
/// or an array of blocks as it reads it (see [`content_string_or_blocks`]).
fn content_schema(generator: &mut schemars::SchemaGenerator) -> schemars::Schema {
    let blocks = generator.subschema_for::<Vec<Block>>();
    if generator.contract().is_serialize() {
        return blocks;
    }
    schemars::json_schema!({
        "anyOf": [
            {"type": "string", "description": "A plain text, read as one text block."},
            blocks,
        ]
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_may_be_a_plain_string() {
        let m: Message = serde_json::from_str(r#"{"role":"user","content":"summary"}"#).unwrap();
        assert_eq!(m, Message::user("summary"));
    }

    #[test]
    fn tool_message_round_trips() {
        let m = Message::tool_result("call_1", "out", true);
        let json = serde_json::to_string(&m).unwrap();
        assert_eq!(
            json,
            r#"{"role":"tool","content":[{"type":"text","text":"out"}],"tool_call_id":"call_1","is_error":true}"#
        );
        assert_eq!(serde_json::from_str::<Message>(&json).unwrap(), m);
    }

    #[test]
    fn text_joins_text_blocks_with_newline() {
        let m = Message::assistant(vec![
            Block::Text { text: "a".into() },
            Block::ToolCall { id: "1".into(), name: "sh".into(), input: Value::Null },
            Block::Text { text: "b".into() },
        ]);
        assert_eq!(m.text(), "a\nb");
    }
}
