//! A2A 1.0 wire objects (JSON binding) and the mapping of intake records onto them.
//!
//! Names follow the normative `specification/a2a.proto` of `a2aproject/A2A` and the 1.0
//! specification: camelCase fields (§5.5), enums as their proto names (`TASK_STATE_WORKING`,
//! `ROLE_USER`; §5.5, ProtoJSON), `Part` as one object with a `text` / `raw` / `url` / `data`
//! member (§4.1.6), streaming results wrapped as `{"task"|"message"|"statusUpdate"|
//! "artifactUpdate": …}` (§3.2.3 `StreamResponse`) and `SendMessage` results as
//! `{"task"|"message": …}` (§9.4.1 `SendMessageResponse`). Unknown fields are ignored on
//! input (§5.7).

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::intake::{TaskRecord, TaskUpdate};
use mur_proto::task::TaskState as State;

/// `TaskState` (§4.1.3).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum TaskState {
    /// Unknown.
    #[serde(rename = "TASK_STATE_UNSPECIFIED")]
    Unspecified,
    /// Accepted, not started.
    #[serde(rename = "TASK_STATE_SUBMITTED")]
    Submitted,
    /// Running.
    #[serde(rename = "TASK_STATE_WORKING")]
    Working,
    /// Finished successfully (terminal).
    #[serde(rename = "TASK_STATE_COMPLETED")]
    Completed,
    /// Finished with an error (terminal).
    #[serde(rename = "TASK_STATE_FAILED")]
    Failed,
    /// Canceled (terminal).
    #[serde(rename = "TASK_STATE_CANCELED")]
    Canceled,
    /// Waits for the user (interrupted).
    #[serde(rename = "TASK_STATE_INPUT_REQUIRED")]
    InputRequired,
    /// Refused (terminal).
    #[serde(rename = "TASK_STATE_REJECTED")]
    Rejected,
    /// Waits for authentication (interrupted).
    #[serde(rename = "TASK_STATE_AUTH_REQUIRED")]
    AuthRequired,
}

impl TaskState {
    /// Completed, failed, canceled or rejected.
    pub fn is_terminal(self) -> bool {
        matches!(self, TaskState::Completed | TaskState::Failed | TaskState::Canceled | TaskState::Rejected)
    }

    /// Terminal, or interrupted (input or auth required): where a blocking `SendMessage`
    /// returns (§3.2.2).
    pub fn is_settled(self) -> bool {
        self.is_terminal() || matches!(self, TaskState::InputRequired | TaskState::AuthRequired)
    }
}

impl From<State> for TaskState {
    fn from(state: State) -> TaskState {
        match state {
            State::Submitted => TaskState::Submitted,
            State::Working => TaskState::Working,
            State::Completed => TaskState::Completed,
            State::Failed => TaskState::Failed,
            State::Canceled => TaskState::Canceled,
            State::Rejected => TaskState::Rejected,
        }
    }
}

/// `Role` (§4.1.5).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Role {
    /// Unspecified.
    #[serde(rename = "ROLE_UNSPECIFIED")]
    Unspecified,
    /// From the client.
    #[serde(rename = "ROLE_USER")]
    User,
    /// From the agent.
    #[serde(rename = "ROLE_AGENT")]
    Agent,
}

/// `Part` (§4.1.6): exactly one of `text`, `raw`, `url`, `data`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Part {
    /// Text content.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    /// File bytes, base64.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub raw: Option<String>,
    /// A URL to the content.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// Structured JSON content.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<Value>,
    /// Part metadata.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<Value>,
    /// File name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub filename: Option<String>,
    /// MIME type.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub media_type: Option<String>,
}

impl Part {
    /// A text part.
    pub fn text(text: impl Into<String>) -> Part {
        Part { text: Some(text.into()), ..Part::default() }
    }
}

/// `Message` (§4.1.4).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Message {
    /// Set by the message's creator (required).
    pub message_id: String,
    /// The conversation the message belongs to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context_id: Option<String>,
    /// The task the message continues or reports on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task_id: Option<String>,
    /// Who sent it (required).
    pub role: Role,
    /// The content (required).
    pub parts: Vec<Part>,
    /// Message metadata.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<Value>,
}

/// `TaskStatus` (§4.1.2).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TaskStatus {
    /// The state.
    pub state: TaskState,
    /// A message about the status.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<Message>,
    /// ISO 8601 UTC time of the status.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timestamp: Option<String>,
}

/// `Artifact` (§4.1.7).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Artifact {
    /// Unique within the task.
    pub artifact_id: String,
    /// Human-readable name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Human-readable description.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// The content, at least one part.
    pub parts: Vec<Part>,
}

/// `Task` (§4.1.1).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Task {
    /// Server-generated id.
    pub id: String,
    /// The task's conversation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context_id: Option<String>,
    /// Current status.
    pub status: TaskStatus,
    /// Outputs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub artifacts: Vec<Artifact>,
    /// Messages of the task.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub history: Vec<Message>,
    /// Task metadata.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<Value>,
}

impl Task {
    /// The text of every artifact's text parts, joined by `\n`.
    pub fn artifact_text(&self) -> String {
        self.artifacts.iter().flat_map(|a| &a.parts).filter_map(|p| p.text.as_deref()).collect::<Vec<_>>().join("\n")
    }

    /// The text of the status message, if any.
    pub fn status_text(&self) -> Option<String> {
        let message = self.status.message.as_ref()?;
        Some(message.parts.iter().filter_map(|p| p.text.as_deref()).collect::<Vec<_>>().join("\n"))
    }
}

/// `TaskStatusUpdateEvent` (§4.2.1).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TaskStatusUpdateEvent {
    /// The task.
    pub task_id: String,
    /// Its context.
    pub context_id: String,
    /// The new status.
    pub status: TaskStatus,
}

/// `TaskArtifactUpdateEvent` (§4.2.2).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TaskArtifactUpdateEvent {
    /// The task.
    pub task_id: String,
    /// Its context.
    pub context_id: String,
    /// The artifact (whole, or a chunk).
    pub artifact: Artifact,
    /// Whether to append to an artifact sent before with the same id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub append: Option<bool>,
    /// Whether this is the artifact's last chunk.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_chunk: Option<bool>,
}

/// `StreamResponse` (§3.2.3): one per SSE event of `SendStreamingMessage`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum StreamResponse {
    /// The task's state (first event).
    Task(Task),
    /// A direct message.
    Message(Message),
    /// A status change.
    StatusUpdate(TaskStatusUpdateEvent),
    /// An artifact.
    ArtifactUpdate(TaskArtifactUpdateEvent),
}

/// `SendMessageResponse` (§9.4.1).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum SendMessageResponse {
    /// The task created for the message.
    Task(Task),
    /// A direct answer.
    Message(Message),
}

/// `SendMessageConfiguration` (§3.2.2).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SendMessageConfiguration {
    /// Media types the client accepts.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub accepted_output_modes: Vec<String>,
    /// At most this many history messages in the answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub history_length: Option<i32>,
    /// Return once the task exists instead of waiting for a terminal or interrupted state
    /// (the default is to wait).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub return_immediately: Option<bool>,
}

/// `SendMessageRequest` (§3.2.1): params of `SendMessage` and `SendStreamingMessage`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SendMessageRequest {
    /// Routing tenant (unused here).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// The message.
    pub message: Message,
    /// Options.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub configuration: Option<SendMessageConfiguration>,
    /// Request metadata.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<Value>,
}

/// Params of `GetTask` (§3.1.3).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GetTaskRequest {
    /// The task id.
    pub id: String,
    /// At most this many history messages.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub history_length: Option<i32>,
}

/// Params of `ListTasks` (§3.1.4; the 0.3-named `tasks/list` takes them too). Every
/// field is optional; `status` is a `TaskState` name (`TASK_STATE_WORKING`, or the 0.3
/// spelling `working`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ListTasksRequest {
    /// Routing tenant (unused here).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// Only tasks of this context.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context_id: Option<String>,
    /// Only tasks in this state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<String>,
    /// At most this many tasks (1 to 100; 50 when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub page_size: Option<i32>,
    /// The `nextPageToken` of the previous page.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub page_token: Option<String>,
    /// At most this many history messages per task.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub history_length: Option<i32>,
    /// Only tasks whose status changed at or after this ISO 8601 time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status_timestamp_after: Option<String>,
    /// Whether tasks carry their artifacts (false when absent: the field is left out).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub include_artifacts: Option<bool>,
}

/// Params of `CancelTask` (§3.1.5) and `SubscribeToTask` (§3.1.6).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TaskIdRequest {
    /// The task id.
    pub id: String,
}

/// The id of the agent message carrying a task's status text: `msg_` + the task id's hex
/// (stable across reads), or `<task id>-status` for ids without the `tsk_` prefix.
pub fn status_message_id(task_id: &str) -> String {
    task_id.strip_prefix("tsk_").map_or_else(|| format!("{task_id}-status"), |hex| format!("msg_{hex}"))
}

fn status_of(record: &TaskRecord) -> TaskStatus {
    TaskStatus {
        state: record.state.into(),
        message: record.status_message.as_ref().map(|text| Message {
            message_id: status_message_id(&record.id),
            context_id: Some(record.context_id.clone()),
            task_id: Some(record.id.clone()),
            role: Role::Agent,
            parts: vec![Part::text(text.clone())],
            metadata: None,
        }),
        timestamp: None,
    }
}

/// The history a task shows: the caller's message, limited by `history_length` (§3.2.4:
/// unset = all, 0 = none).
fn history_of(record: &TaskRecord, history_length: Option<i32>) -> Vec<Message> {
    let mut history: Vec<Message> = record
        .message_id
        .iter()
        .map(|message_id| Message {
            message_id: message_id.clone(),
            context_id: Some(record.context_id.clone()),
            task_id: Some(record.id.clone()),
            role: Role::User,
            parts: vec![Part::text(record.text.clone())],
            metadata: None,
        })
        .collect();
    if let Some(n) = history_length {
        history.drain(..history.len().saturating_sub(n.max(0) as usize));
    }
    history
}

/// A task record as a 1.0 `Task`: the final text becomes the `result` artifact once
/// completed; the status message carries the refusal or failure reason.
pub fn task(record: &TaskRecord, history_length: Option<i32>) -> Task {
    let artifacts = match (&record.result, record.state) {
        (Some(text), State::Completed) => vec![Artifact {
            artifact_id: crate::intake::RESULT_ARTIFACT_ID.to_string(),
            name: Some(crate::intake::RESULT_ARTIFACT_ID.to_string()),
            description: None,
            parts: vec![Part::text(text.clone())],
        }],
        _ => Vec::new(),
    };
    Task {
        id: record.id.clone(),
        context_id: Some(record.context_id.clone()),
        status: status_of(record),
        artifacts,
        history: history_of(record, history_length),
        metadata: Some(murmur_metadata(record)),
    }
}

/// The murmur-specific facts a task shows under `metadata.murmur`: origin, lane, source,
/// every state so far (checklist L8–L9) and the exit status once it ended.
pub fn murmur_metadata(record: &TaskRecord) -> Value {
    let states: Vec<&str> = record.states.iter().map(|s| s.as_str()).collect();
    let mut murmur = serde_json::json!({
        "origin": record.origin.as_str(),
        "lane": record.lane().as_str(),
        "source": record.source,
        "states": states,
    });
    if let Some(exit) = record.exit_status {
        murmur["exitStatus"] = Value::from(exit.as_str());
    }
    serde_json::json!({ "murmur": murmur })
}

/// An intake update as a 1.0 stream event.
pub fn stream_event(update: &TaskUpdate) -> StreamResponse {
    match update {
        TaskUpdate::Status { task_id, context_id, state, message } => {
            StreamResponse::StatusUpdate(TaskStatusUpdateEvent {
                task_id: task_id.clone(),
                context_id: context_id.clone(),
                status: TaskStatus {
                    state: (*state).into(),
                    message: message.as_ref().map(|text| Message {
                        message_id: status_message_id(task_id),
                        context_id: Some(context_id.clone()),
                        task_id: Some(task_id.clone()),
                        role: Role::Agent,
                        parts: vec![Part::text(text.clone())],
                        metadata: None,
                    }),
                    timestamp: None,
                },
            })
        }
        TaskUpdate::Artifact { task_id, context_id, artifact_id, name, text } => {
            StreamResponse::ArtifactUpdate(TaskArtifactUpdateEvent {
                task_id: task_id.clone(),
                context_id: context_id.clone(),
                artifact: Artifact {
                    artifact_id: artifact_id.clone(),
                    name: Some(name.clone()),
                    description: None,
                    parts: vec![Part::text(text.clone())],
                },
                append: None,
                last_chunk: Some(true),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_specification_send_example_parses() {
        // §6.1's request body, as JSON-RPC params.
        let params = json!({
            "message": {
                "role": "ROLE_USER",
                "parts": [{ "text": "What is the weather today?" }],
                "messageId": "msg-uuid"
            }
        });
        let req: SendMessageRequest = serde_json::from_value(params).unwrap();
        assert_eq!(req.message.role, Role::User);
        assert_eq!(req.message.parts[0].text.as_deref(), Some("What is the weather today?"));
    }

    #[test]
    fn wire_shapes_follow_proto_json() {
        let event = StreamResponse::StatusUpdate(TaskStatusUpdateEvent {
            task_id: "t".into(),
            context_id: "c".into(),
            status: TaskStatus { state: TaskState::Completed, message: None, timestamp: None },
        });
        assert_eq!(
            serde_json::to_value(&event).unwrap(),
            json!({"statusUpdate": {"taskId": "t", "contextId": "c", "status": {"state": "TASK_STATE_COMPLETED"}}})
        );
        let back: StreamResponse = serde_json::from_value(serde_json::to_value(&event).unwrap()).unwrap();
        assert_eq!(back, event);
        assert_eq!(status_message_id("tsk_0123"), "msg_0123");
        assert_eq!(status_message_id("job-9"), "job-9-status");
    }
}
