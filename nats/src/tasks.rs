//! Typed access to the task records in `mur_tasks`: one record per task, every write a
//! compare-and-set on the revision read, so a task reaches exactly one terminal record
//! (docs/ARCHITECTURE.md, §The cluster). [`read`] reads a record with its revision;
//! [`update`] and [`try_update`] are the one compare-and-set loop every writer uses.

use async_nats::jetstream::kv;
use mur_proto::TaskId;
use mur_proto::cluster::{ApiError, ErrorCode, TaskRecord};

/// How many times [`update`] writes before it gives up on a record other writers keep
/// changing.
pub const CAS_ATTEMPTS: usize = 10;

/// Why a task record could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No record of that task (never submitted, or deleted).
    #[error("task: no task {0}")]
    NotFound(String),
    /// Other writers changed the record under each of [`CAS_ATTEMPTS`] writes.
    #[error("task {0}: changed too often to write ({CAS_ATTEMPTS} compare-and-set attempts lost), retry")]
    Conflict(String),
    /// The stored record is not a [`TaskRecord`].
    #[error("task record {task_id} is not valid JSON: {reason}")]
    Malformed {
        /// The task.
        task_id: String,
        /// The decoding error.
        reason: String,
    },
    /// JetStream did not answer the read or the write.
    #[error("mur_tasks: {what}: {source}")]
    Unavailable {
        /// `read <task id>`, `update <task id>`.
        what: String,
        /// The client's error.
        source: async_nats::Error,
    },
}

impl From<Error> for ApiError {
    /// The API's code for each: `not_found`, `unavailable` (a conflict too: retrying helps),
    /// `internal` for a malformed record.
    fn from(e: Error) -> ApiError {
        let code = match &e {
            Error::NotFound(_) => ErrorCode::NotFound,
            Error::Conflict(_) | Error::Unavailable { .. } => ErrorCode::Unavailable,
            Error::Malformed { .. } => ErrorCode::Internal,
        };
        ApiError::new(code, e.to_string())
    }
}

/// `task_id`'s record and its revision; `None` when there is none (or it was deleted).
///
/// # Errors
/// [`Error::Unavailable`], [`Error::Malformed`].
pub async fn read(tasks: &kv::Store, task_id: &TaskId) -> Result<Option<(TaskRecord, u64)>, Error> {
    let entry = tasks
        .entry(task_id)
        .await
        .map_err(|e| Error::Unavailable { what: format!("read {task_id}"), source: e.into() })?;
    let Some(entry) = entry.filter(|e| e.operation == kv::Operation::Put) else {
        return Ok(None);
    };
    let record = serde_json::from_slice(&entry.value)
        .map_err(|e| Error::Malformed { task_id: task_id.to_string(), reason: e.to_string() })?;
    Ok(Some((record, entry.revision)))
}

/// Applies `change` to `task_id`'s record with compare-and-set on its revision: starting
/// from `known` (a record and revision the caller holds) or a fresh [`read`], and reading
/// again after each conflict, up to [`CAS_ATTEMPTS`] writes. `change` returns false to
/// leave the record as it is: then `Ok(None)`; else the record written and its new revision.
///
/// # Errors
/// [`Error::NotFound`], [`Error::Conflict`], [`Error::Unavailable`], [`Error::Malformed`].
pub async fn update(
    tasks: &kv::Store,
    task_id: &TaskId,
    known: Option<(TaskRecord, u64)>,
    mut change: impl FnMut(&mut TaskRecord) -> bool,
) -> Result<Option<(TaskRecord, u64)>, Error> {
    try_update(tasks, task_id, known, |record| Ok::<_, Error>(change(record))).await
}

/// [`update`] with a `change` that may refuse: its error ends the loop and is returned.
///
/// # Errors
/// `change`'s error, or [`update`]'s.
pub async fn try_update<E: From<Error>>(
    tasks: &kv::Store,
    task_id: &TaskId,
    mut known: Option<(TaskRecord, u64)>,
    mut change: impl FnMut(&mut TaskRecord) -> Result<bool, E>,
) -> Result<Option<(TaskRecord, u64)>, E> {
    for _ in 0..CAS_ATTEMPTS {
        let (mut record, revision) = match known.take() {
            Some(current) => current,
            None => read(tasks, task_id).await?.ok_or_else(|| Error::NotFound(task_id.to_string()))?,
        };
        if !change(&mut record)? {
            return Ok(None);
        }
        let json = serde_json::to_vec(&record).expect("a task record serializes");
        match tasks.update(task_id, json.into(), revision).await {
            Ok(revision) => return Ok(Some((record, revision))),
            Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => {
                tracing::debug!(%task_id, "task record compare-and-set lost; reading it again");
            }
            Err(e) => return Err(Error::Unavailable { what: format!("update {task_id}"), source: e.into() }.into()),
        }
    }
    Err(Error::Conflict(task_id.to_string()).into())
}
