//! Hooks: programs bound to session events (issue #4; the session-loop seed, §Task
//! reopening and §Context seeding; the context seed). The loop sees them through
//! [`Hooks`]; [`process::ProcessHooks`] runs hook programs as child processes speaking the
//! JSON protocol of `mur_proto::hook`, and hands `builtin:*` commands to [`Builtin`]s.
//!
//! Rules the dispatcher keeps (the runtime reference, §3, checklist H1–H9):
//! blocking hooks run in manifest order and every matching hook is called; a hook with no
//! binding receives every event except `on-stage`; async hooks get a bounded FIFO queue
//! each, never run concurrently with themselves, and are drained at session end within one
//! shared deadline; overflow and stragglers are reported as faults. A hook error (non-zero
//! exit, an answer outside the schema, a timeout) is one line in `logs/hook-<name>.log` and
//! a fault; the caller decides what a fault means for the session.

pub mod builtin;
mod child;
mod gate;
mod log;
pub mod process;
#[cfg(test)]
mod tests;

use async_trait::async_trait;
use mur_proto::hook::{Answer, Envelope, Event};
use mur_proto::message::Message;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Why a hook produced no answer.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// The program could not be started.
    #[error("could not start hook: {0}")]
    Spawn(String),
    /// It exited non-zero.
    #[error("hook exited with code {code}: {stderr}")]
    Exit {
        /// Exit code (128+signal when killed).
        code: i32,
        /// The end of its stderr (at most 2 KiB).
        stderr: String,
    },
    /// It ran past `timeout_secs` and was killed.
    #[error("hook timed out after {0} s")]
    Timeout(u64),
    /// Its stdout was not an answer.
    #[error("{0}")]
    BadAnswer(String),
    /// A persistent hook died; it is restarted for the next event.
    #[error("persistent hook died: {0}")]
    Died(String),
    /// A built-in hook failed.
    #[error("{0}")]
    Builtin(String),
    /// The task the event belongs to was cancelled: the hook was killed, or not started
    /// ([`Hooks::dispatch_until`]).
    #[error("stopped: the task was cancelled")]
    Canceled,
}

impl Error {
    /// The `arm` recorded on `hook_dispatch_error`: `timeout` for a timeout, `error`
    /// otherwise.
    pub fn arm(&self) -> &'static str {
        match self {
            Error::Timeout(_) => "timeout",
            _ => "error",
        }
    }
}

/// The answer of one blocking hook to one event.
#[derive(Clone, Debug, PartialEq)]
pub struct Reply {
    /// The hook's name.
    pub hook: String,
    /// Its answer, or why there is none.
    pub answer: Result<Answer, Error>,
    /// Whether a spend ceiling refused one of this hook's model calls during the event
    /// (the context seed: the hook's error then ends the session
    /// `spend_ceiling_reached`).
    pub spend_refused: bool,
}

/// Something that went wrong outside a blocking answer: an async hook's error, a queue
/// overflow, a straggler at the drain deadline.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fault {
    /// The hook's name.
    pub hook: String,
    /// The binding of the event (`on-inference`), or `drain`.
    pub event: String,
    /// `error`, `timeout`, `queue-overflow`.
    pub arm: String,
    /// What happened.
    pub message: String,
}

/// A hook program started sandboxed (issue #37), for its `sandbox` trace line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sandboxed {
    /// The hook's name.
    pub hook: String,
    /// The binding of the event it was started for (`on-task-start`).
    pub event: String,
    /// The rules it runs under.
    pub rules: crate::sandbox::Applied,
}

/// The hooks of one session.
#[async_trait]
pub trait Hooks: Send + Sync {
    /// Delivers `event` to every hook bound to it: blocking hooks one after another in
    /// manifest order (their replies returned in that order), async hooks enqueued.
    async fn dispatch(&self, session_id: &str, event: &Event) -> Vec<Reply> {
        self.dispatch_until(session_id, event, &CancellationToken::new()).await
    }

    /// [`Hooks::dispatch`] for a task that may be cancelled: once `cancel` fires, the
    /// blocking hook under way is killed (its whole process group) and no further one
    /// starts; each of them replies [`Error::Canceled`]. A cancel
    /// reaches a running task within one progress interval (issue #8 §Cancel), hooks
    /// included.
    async fn dispatch_until(&self, session_id: &str, event: &Event, cancel: &CancellationToken) -> Vec<Reply>;

    /// Faults of async hooks collected since the last call.
    fn take_faults(&self) -> Vec<Fault>;

    /// The hook programs started sandboxed since the last call, in start order.
    fn take_sandboxed(&self) -> Vec<Sandboxed> {
        Vec::new()
    }

    /// Waits for the async queues to empty, at most `deadline` in all; stragglers become
    /// `timeout` faults. Stops persistent processes.
    async fn drain(&self, deadline: Duration) -> Vec<Fault>;
}

/// No hooks at all.
pub struct NoHooks;

#[async_trait]
impl Hooks for NoHooks {
    async fn dispatch_until(&self, _: &str, _: &Event, _: &CancellationToken) -> Vec<Reply> {
        Vec::new()
    }
    fn take_faults(&self) -> Vec<Fault> {
        Vec::new()
    }
    async fn drain(&self, _: Duration) -> Vec<Fault> {
        Vec::new()
    }
}

/// A hook implemented inside the runtime (`builtin:compact`, `builtin:memory`).
#[async_trait]
pub trait Builtin: Send + Sync {
    /// Answers one event.
    ///
    /// # Errors
    /// A message that becomes [`Error::Builtin`].
    async fn handle(&self, event: &Envelope) -> Result<Answer, String>;
}

/// One model call made on a hook's behalf (served to hook programs over HTTP at
/// `$MURMUR_INFERENCE_URL`).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct InferenceRequest {
    /// System prompt (default: the compaction prompt, else none).
    #[serde(default)]
    pub system: Option<String>,
    /// The conversation to complete.
    pub messages: Vec<Message>,
    /// Output cap (default `inference.max_tokens`).
    #[serde(default)]
    pub max_tokens: Option<u32>,
}

/// Why a hook's model call was not made or failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum InferenceError {
    /// A spend ceiling refused the call before it was sent.
    #[error("spend ceiling reached: {0}")]
    SpendCeiling(String),
    /// The driver failed.
    #[error("{0}")]
    Driver(String),
}

/// Makes model calls for hooks with the capsule's own driver, under the spend ceilings,
/// tracing each as an `inference` line with origin `hook:<name>`.
#[async_trait]
pub trait InferenceGate: Send + Sync {
    /// One completion for hook `hook`; returns the reply's text.
    ///
    /// # Errors
    /// [`InferenceError`].
    async fn run_inference(&self, hook: &str, request: InferenceRequest) -> Result<String, InferenceError>;
}
