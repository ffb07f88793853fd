//! What the A2A endpoint serves: a [`Backend`] that admits, reports on and cancels tasks.
//! The capsule's [`Intake`] is one; the cluster coordinator can be another.

use async_trait::async_trait;

use crate::intake::{self, Intake, Rejected, Submission, Subscription, TaskFilter, TaskRecord};

/// The task operations behind the A2A methods.
#[async_trait]
pub trait Backend: Send + Sync + 'static {
    /// Offers a message as a task (`SendMessage`). Refusals follow the capsule's acceptance
    /// rule; [`Rejected::NotAccepting`] becomes JSON-RPC -32601, every other refusal a task
    /// in state `rejected`.
    async fn submit(&self, submission: Submission) -> Result<TaskRecord, Rejected>;

    /// The task's current snapshot (`GetTask`); `None` when unknown.
    async fn get(&self, id: &str) -> Option<TaskRecord>;

    /// Cancels the task (`CancelTask`): [`intake::Error::NotFound`] and
    /// [`intake::Error::NotCancelable`] become -32001 and -32002.
    async fn cancel(&self, id: &str) -> Result<TaskRecord, intake::Error>;

    /// The task's snapshot and its later updates (streaming); `None` when unknown.
    async fn subscribe(&self, id: &str) -> Option<Subscription>;

    /// The tasks `filter` matches (`ListTasks`), most recently updated first; the server
    /// pages them. [`intake::Error::Unavailable`] becomes -32603.
    async fn list(&self, filter: &TaskFilter) -> Result<Vec<TaskRecord>, intake::Error>;
}

#[async_trait]
impl Backend for Intake {
    async fn submit(&self, submission: Submission) -> Result<TaskRecord, Rejected> {
        Intake::submit(self, submission)
    }

    async fn get(&self, id: &str) -> Option<TaskRecord> {
        Intake::get(self, id)
    }

    async fn cancel(&self, id: &str) -> Result<TaskRecord, intake::Error> {
        Intake::cancel(self, id)
    }

    async fn subscribe(&self, id: &str) -> Option<Subscription> {
        Intake::subscribe(self, id)
    }

    async fn list(&self, filter: &TaskFilter) -> Result<Vec<TaskRecord>, intake::Error> {
        Ok(Intake::list(self, filter))
    }
}
