//! A2A 0.3 wire objects, served for clients that speak the older method names
//! (`message/send`, `message/stream`, `tasks/get`, `tasks/cancel`, `tasks/resubscribe`),
//! as the official SDK's v0.3 compatibility layer does.
//!
//! Shapes follow the 0.3 JSON schema (as generated in `a2aproject/a2a-python`'s
//! `compat/v0_3/types.py`): objects carry a `kind` discriminator (`task`, `message`,
//! `status-update`, `artifact-update`; parts `text` / `file` / `data`), states are
//! kebab-case (`submitted`, `working`, `completed`, `failed`, `canceled`, `rejected`), roles
//! are `user` / `agent`, `message/send` returns the `Task` itself, and status-update events
//! carry `final`.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::intake::{RESULT_ARTIFACT_ID, TaskRecord, TaskUpdate};
use mur_proto::task::TaskState;

/// `Part`, discriminated by `kind`. Only text is produced; input parts of other kinds are
/// read as carrying no text.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Part {
    /// `{"kind":"text","text":…}`.
    Text {
        /// The text.
        text: String,
    },
    /// `{"kind":"file","file":{…}}`.
    File {
        /// The file (bytes or uri).
        file: Value,
    },
    /// `{"kind":"data","data":{…}}`.
    Data {
        /// The data.
        data: Value,
    },
}

/// `Message`, `kind: "message"`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename = "message", rename_all = "camelCase")]
pub struct Message {
    /// Set by the sender (required).
    pub message_id: String,
    /// The conversation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context_id: Option<String>,
    /// The task it belongs to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task_id: Option<String>,
    /// `user` or `agent`.
    pub role: String,
    /// The content.
    pub parts: Vec<Part>,
}

/// `TaskStatus`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TaskStatus {
    /// Kebab-case state.
    pub state: TaskState,
    /// A message about the status.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<Message>,
}

/// `Artifact`.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Artifact {
    /// Unique within the task.
    pub artifact_id: String,
    /// Human-readable name.
    pub name: String,
    /// The content.
    pub parts: Vec<Part>,
}

/// `Task`, `kind: "task"`.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "kind", rename = "task", rename_all = "camelCase")]
pub struct Task {
    /// Server-generated id.
    pub id: String,
    /// The conversation.
    pub context_id: String,
    /// Current status.
    pub status: TaskStatus,
    /// Outputs.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub artifacts: Vec<Artifact>,
    /// Messages of the task.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub history: Vec<Message>,
    /// Task metadata (`murmur`: origin, lane, source, states, exit status).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metadata: Option<Value>,
}

/// `TaskStatusUpdateEvent`, `kind: "status-update"`.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "kind", rename = "status-update", rename_all = "camelCase")]
pub struct TaskStatusUpdateEvent {
    /// The task.
    pub task_id: String,
    /// Its context.
    pub context_id: String,
    /// The new status.
    pub status: TaskStatus,
    /// Whether this is the stream's last event.
    #[serde(rename = "final")]
    pub is_final: bool,
}

/// `TaskArtifactUpdateEvent`, `kind: "artifact-update"`.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "kind", rename = "artifact-update", rename_all = "camelCase")]
pub struct TaskArtifactUpdateEvent {
    /// The task.
    pub task_id: String,
    /// Its context.
    pub context_id: String,
    /// The artifact.
    pub artifact: Artifact,
    /// Whether this is the artifact's last chunk.
    pub last_chunk: bool,
}

/// `MessageSendConfiguration`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MessageSendConfiguration {
    /// Wait for the task to end before answering (default: answer at once, as the
    /// original runtime did).
    #[serde(default)]
    pub blocking: Option<bool>,
    /// At most this many history messages in the answer.
    #[serde(default)]
    pub history_length: Option<i32>,
}

/// An incoming `Message`. Parts are read leniently: any part with a string `text` and a
/// `kind` of `text` (or no `kind`, as the original runtime's clients sent) is text.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct InboundMessage {
    /// Set by the sender (required).
    pub message_id: String,
    /// The conversation.
    #[serde(default)]
    pub context_id: Option<String>,
    /// The task it continues.
    #[serde(default)]
    pub task_id: Option<String>,
    /// The content.
    pub parts: Vec<Value>,
}

impl InboundMessage {
    /// The text of each text part, in order.
    pub fn texts(&self) -> Vec<String> {
        self.parts
            .iter()
            .filter(|p| matches!(p.get("kind").and_then(Value::as_str), None | Some("text")))
            .filter_map(|p| p.get("text").and_then(Value::as_str).map(str::to_string))
            .collect()
    }
}

/// `MessageSendParams`: params of `message/send` and `message/stream`.
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct MessageSendParams {
    /// The message.
    pub message: InboundMessage,
    /// Options.
    #[serde(default)]
    pub configuration: Option<MessageSendConfiguration>,
}

/// `TaskQueryParams`: params of `tasks/get`.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TaskQueryParams {
    /// The task id.
    pub id: String,
    /// At most this many history messages.
    #[serde(default)]
    pub history_length: Option<i32>,
}

/// `TaskIdParams`: params of `tasks/cancel` and `tasks/resubscribe`.
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct TaskIdParams {
    /// The task id.
    pub id: String,
}

fn text_part(text: &str) -> Part {
    Part::Text { text: text.to_string() }
}

fn status_message(task_id: &str, context_id: &str, text: &str) -> Message {
    Message {
        message_id: super::v1::status_message_id(task_id),
        context_id: Some(context_id.to_string()),
        task_id: Some(task_id.to_string()),
        role: "agent".to_string(),
        parts: vec![text_part(text)],
    }
}

/// A task record as a 0.3 `Task`.
pub fn task(record: &TaskRecord, history_length: Option<i32>) -> Task {
    let artifacts = match (&record.result, record.state) {
        (Some(text), TaskState::Completed) => vec![Artifact {
            artifact_id: RESULT_ARTIFACT_ID.to_string(),
            name: RESULT_ARTIFACT_ID.to_string(),
            parts: vec![text_part(text)],
        }],
        _ => Vec::new(),
    };
    let mut history: Vec<Message> = record
        .message_id
        .iter()
        .map(|id| Message {
            message_id: id.clone(),
            context_id: Some(record.context_id.clone()),
            task_id: Some(record.id.clone()),
            role: "user".to_string(),
            parts: vec![text_part(&record.text)],
        })
        .collect();
    if let Some(n) = history_length {
        history.drain(..history.len().saturating_sub(n.max(0) as usize));
    }
    Task {
        id: record.id.clone(),
        context_id: record.context_id.clone(),
        status: TaskStatus {
            state: record.state,
            message: record.status_message.as_deref().map(|t| status_message(&record.id, &record.context_id, t)),
        },
        artifacts,
        history,
        metadata: Some(super::v1::murmur_metadata(record)),
    }
}

/// An intake update as a 0.3 stream event (`status-update` with `final`, or
/// `artifact-update`), as a JSON value.
pub fn stream_event(update: &TaskUpdate) -> Value {
    let event = match update {
        TaskUpdate::Status { task_id, context_id, state, message } => serde_json::to_value(TaskStatusUpdateEvent {
            task_id: task_id.clone(),
            context_id: context_id.clone(),
            status: TaskStatus {
                state: *state,
                message: message.as_deref().map(|t| status_message(task_id, context_id, t)),
            },
            is_final: state.is_terminal(),
        }),
        TaskUpdate::Artifact { task_id, context_id, artifact_id, name, text } => {
            serde_json::to_value(TaskArtifactUpdateEvent {
                task_id: task_id.clone(),
                context_id: context_id.clone(),
                artifact: Artifact {
                    artifact_id: artifact_id.clone(),
                    name: name.clone(),
                    parts: vec![text_part(text)],
                },
                last_chunk: true,
            })
        }
    };
    event.unwrap_or(Value::Null)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn objects_carry_their_kind_and_kebab_case_states() {
        let params: MessageSendParams = serde_json::from_value(json!({
            "message": {
                "kind": "message",
                "role": "user",
                "parts": [{ "kind": "text", "text": "hello" }],
                "messageId": "m1"
            }
        }))
        .unwrap();
        assert_eq!(params.message.texts(), ["hello"]);
        let event = TaskStatusUpdateEvent {
            task_id: "t".into(),
            context_id: "c".into(),
            status: TaskStatus { state: TaskState::Completed, message: None },
            is_final: true,
        };
        assert_eq!(
            serde_json::to_value(event).unwrap(),
            json!({"kind":"status-update","taskId":"t","contextId":"c","status":{"state":"completed"},"final":true})
        );
    }
}
