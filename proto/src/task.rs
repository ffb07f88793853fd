//! The task vocabulary: origins and the lanes they wait in (the session-loop seed,
//! §Queue lanes), exit statuses (the session-loop seed, the context seed) and the
//! A2A task states they map to.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// A task as the loop receives it.
#[derive(Clone, Debug, PartialEq)]
pub struct TaskSpec {
    /// `tsk_…`.
    pub task_id: String,
    /// `ctx_…`.
    pub context_id: String,
    /// The task's text: the first user message.
    pub text: String,
    /// Where it came from.
    pub origin: Origin,
    /// `cli`, `task_md`, `a2a`, …
    pub source: String,
}

impl TaskSpec {
    /// The lane the task waited in.
    pub fn lane(&self) -> Lane {
        self.origin.lane()
    }
}

/// Where a task came from (the session-loop seed, §Queue lanes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Origin {
    /// A person.
    User,
    /// Another capsule, blocked on the answer.
    Peer,
    /// A trigger.
    Schedule,
    /// An inbound request nobody vouches for.
    Event,
    /// A detached command's completion, or a resume's loss report.
    Completion,
    /// The runtime itself.
    System,
}

impl Origin {
    /// Every origin, in the seed's order.
    pub const ALL: [Origin; 6] =
        [Origin::User, Origin::Peer, Origin::Schedule, Origin::Event, Origin::Completion, Origin::System];

    /// The lane a task of this origin waits in: `user`←user, `peer`←peer, `bg`←the rest.
    pub const fn lane(self) -> Lane {
        match self {
            Origin::User => Lane::User,
            Origin::Peer => Lane::Peer,
            Origin::Schedule | Origin::Event | Origin::Completion | Origin::System => Lane::Bg,
        }
    }

    /// The origin an inbound HTTP request gets from its `x-murmur-task-origin` header:
    /// only `peer` and `completion` are believed; anything else, or no header, is `event`
    /// (the session-loop seed, §Queue lanes, last paragraph).
    pub fn from_http_header(value: Option<&str>) -> Origin {
        match value.map(str::trim) {
            Some("peer") => Origin::Peer,
            Some("completion") => Origin::Completion,
            _ => Origin::Event,
        }
    }

    /// The wire name (`"user"`, …).
    pub const fn as_str(self) -> &'static str {
        match self {
            Origin::User => "user",
            Origin::Peer => "peer",
            Origin::Schedule => "schedule",
            Origin::Event => "event",
            Origin::Completion => "completion",
            Origin::System => "system",
        }
    }
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An origin name that is not one of the six.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("origin: must be one of user, peer, schedule, event, completion, system, got {0:?}")]
pub struct UnknownOrigin(pub String);

impl FromStr for Origin {
    type Err = UnknownOrigin;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Origin::ALL.into_iter().find(|o| o.as_str() == s).ok_or_else(|| UnknownOrigin(s.to_string()))
    }
}

/// A queue lane, highest priority first (the session-loop seed, §Queue lanes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Lane {
    /// A person waits.
    User,
    /// Another capsule waits.
    Peer,
    /// Nothing waits.
    Bg,
}

impl Lane {
    /// Every lane, highest priority first.
    pub const ALL: [Lane; 3] = [Lane::User, Lane::Peer, Lane::Bg];

    /// The wire name (`"user"`, `"peer"`, `"bg"`).
    pub const fn as_str(self) -> &'static str {
        match self {
            Lane::User => "user",
            Lane::Peer => "peer",
            Lane::Bg => "bg",
        }
    }
}

impl fmt::Display for Lane {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How a task (or a session) ended. Spellings are the seeds'.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ExitStatus {
    /// The model ended its turn (`end_turn` or `max_tokens`).
    Ok,
    /// A driver, tool-protocol or hook error ended the task.
    Failed,
    /// `inference.max_turns` model calls were made (the session-loop seed, §Turn limit).
    MaxTurnsReached,
    /// A hook still wanted to reopen with no budget left (the session-loop seed, §Task reopening).
    ReopenBudgetExhausted,
    /// A spend ceiling refused a model call (the context seed).
    SpendCeilingReached,
    /// The task was cancelled, or interrupted by a shutdown.
    Canceled,
    /// The task outlived the deadline it inherited from its fleet loop (the fleet-loops seed,
    /// §The bounds: "Every member the loop delegates to inherits the remaining time"): the
    /// worker stopped it and its tools.
    DeadlineExceeded,
}

impl ExitStatus {
    /// The wire name (`"ok"`, `"max_turns_reached"`, …).
    pub const fn as_str(self) -> &'static str {
        match self {
            ExitStatus::Ok => "ok",
            ExitStatus::Failed => "failed",
            ExitStatus::MaxTurnsReached => "max_turns_reached",
            ExitStatus::ReopenBudgetExhausted => "reopen_budget_exhausted",
            ExitStatus::SpendCeilingReached => "spend_ceiling_reached",
            ExitStatus::Canceled => "canceled",
            ExitStatus::DeadlineExceeded => "deadline_exceeded",
        }
    }

    /// The A2A task state a finished task reports: `ok` → `completed`, `canceled` →
    /// `canceled`, everything else → `failed`.
    pub const fn task_state(self) -> TaskState {
        match self {
            ExitStatus::Ok => TaskState::Completed,
            ExitStatus::Canceled => TaskState::Canceled,
            _ => TaskState::Failed,
        }
    }
}

impl fmt::Display for ExitStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A task's state in the A2A vocabulary.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TaskState {
    /// Accepted, waiting to start.
    Submitted,
    /// Running.
    Working,
    /// Ended with exit status `ok`.
    Completed,
    /// Ended with any other exit status.
    Failed,
    /// Cancelled before or while running.
    Canceled,
    /// Refused at admission (a full queue, a capsule that accepts nothing).
    Rejected,
}

impl TaskState {
    /// Whether the state is final.
    pub const fn is_terminal(self) -> bool {
        !matches!(self, TaskState::Submitted | TaskState::Working)
    }

    /// The wire name.
    pub const fn as_str(self) -> &'static str {
        match self {
            TaskState::Submitted => "submitted",
            TaskState::Working => "working",
            TaskState::Completed => "completed",
            TaskState::Failed => "failed",
            TaskState::Canceled => "canceled",
            TaskState::Rejected => "rejected",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn origins_map_to_the_seed_lanes() {
        let lanes: Vec<_> = Origin::ALL.iter().map(|o| (o.as_str(), o.lane().as_str())).collect();
        assert_eq!(
            lanes,
            [
                ("user", "user"),
                ("peer", "peer"),
                ("schedule", "bg"),
                ("event", "bg"),
                ("completion", "bg"),
                ("system", "bg")
            ]
        );
    }

    #[test]
    fn http_header_believes_only_peer_and_completion() {
        assert_eq!(Origin::from_http_header(Some("peer")), Origin::Peer);
        assert_eq!(Origin::from_http_header(Some("completion")), Origin::Completion);
        assert_eq!(Origin::from_http_header(Some("user")), Origin::Event);
        assert_eq!(Origin::from_http_header(Some("system")), Origin::Event);
        assert_eq!(Origin::from_http_header(None), Origin::Event);
        assert_eq!(Origin::from_http_header(Some("user")).lane(), Lane::Bg);
    }

    #[test]
    fn exit_statuses_use_the_seed_spellings() {
        let json = serde_json::to_string(&[
            ExitStatus::Ok,
            ExitStatus::Failed,
            ExitStatus::MaxTurnsReached,
            ExitStatus::ReopenBudgetExhausted,
            ExitStatus::SpendCeilingReached,
        ])
        .unwrap();
        assert_eq!(json, r#"["ok","failed","max_turns_reached","reopen_budget_exhausted","spend_ceiling_reached"]"#);
        assert_eq!(ExitStatus::MaxTurnsReached.task_state(), TaskState::Failed);
        assert_eq!(ExitStatus::Ok.task_state(), TaskState::Completed);
    }

    #[test]
    fn unknown_origin_is_refused_with_the_allowed_values() {
        let err = "admin".parse::<Origin>().unwrap_err();
        assert_eq!(
            err.to_string(),
            r#"origin: must be one of user, peer, schedule, event, completion, system, got "admin""#
        );
    }
}
