//! The JetStream resources and subjects the coordinator and workers share (the design,
//! §JetStream resources), and the NATS API's subjects ([`api`]).

use super::*;

/// The dispatch work queue: tasks released to workers, one message per attempt
/// ([`Dispatch`]). WorkQueue retention: a message is gone once a worker acks it.
pub const DISPATCH_STREAM: &str = "MUR_DISPATCH";
/// The one subject of [`DISPATCH_STREAM`].
pub const DISPATCH_SUBJECT: &str = "mur.dispatch";
/// The durable pull consumer on [`DISPATCH_STREAM`] that every worker shares.
pub const DISPATCH_CONSUMER: &str = "workers";

/// The dead-letter notices: JetStream's max-deliveries advisories for
/// [`DISPATCH_STREAM`]'s [`DISPATCH_CONSUMER`] ([`DEAD_LETTER_SUBJECT`]), stored until the
/// leading coordinator has ended their tasks, so that a dispatch given up while no
/// coordinator runs still ends its task (issue #29 item 1). WorkQueue retention: a notice
/// is gone once acked.
pub const DEAD_LETTER_STREAM: &str = "MUR_DEAD_LETTERS";
/// The subject JetStream publishes a max-deliveries advisory for the dispatch consumer on,
/// the one subject of [`DEAD_LETTER_STREAM`].
pub const DEAD_LETTER_SUBJECT: &str = "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.MUR_DISPATCH.workers";
/// The durable pull consumer on [`DEAD_LETTER_STREAM`] the leading coordinator reads.
pub const DEAD_LETTER_CONSUMER: &str = "coordinators";

/// The trace stream: every trace event of every session, the cluster's `trace.jsonl`.
pub const TRACE_STREAM: &str = "MUR_TRACE";
/// The subjects of [`TRACE_STREAM`]: `mur.trace.<session_id>`.
pub const TRACE_SUBJECTS: &str = "mur.trace.>";
/// The prefix of [`trace_subject`], dot included.
pub const TRACE_SUBJECT_PREFIX: &str = "mur.trace.";

/// KV bucket of task records ([`TaskRecord`]); key = task id (`tsk_…`).
pub const TASKS_BUCKET: &str = "mur_tasks";
/// KV bucket of worker registrations and heartbeats ([`WorkerInfo`]); key = worker id.
pub const WORKERS_BUCKET: &str = "mur_workers";
/// KV bucket of session checkpoints (history and counters after each turn).
pub const SESSIONS_BUCKET: &str = "mur_sessions";
/// Object store of capsule bundles; object name = `<capsule>/<digest>` ([`bundle_object`]).
pub const CAPSULES_STORE: &str = "mur_capsules";
/// KV bucket naming each capsule's latest bundle; key = capsule name, value =
/// [`CapsuleIndexEntry`]. Its revision history keeps earlier digests listed.
pub const CAPSULE_INDEX_BUCKET: &str = "mur_capsule_index";

/// Every KV bucket the cluster uses.
pub const KV_BUCKETS: [&str; 5] = [TASKS_BUCKET, WORKERS_BUCKET, SESSIONS_BUCKET, CAPSULE_INDEX_BUCKET, LEADER_BUCKET];
/// The leading coordinator's lease (key [`LEADER_KEY`], value [`LeaderLease`]); the
/// bucket's max age is the lease's time to live.
pub const LEADER_BUCKET: &str = "mur_leader";
/// The lease's key in [`LEADER_BUCKET`].
pub const LEADER_KEY: &str = "leader";
/// The prefix of the keys of [`LEADER_BUCKET`] under which each standby coordinator says
/// it stands by (`standby.<process>`, value [`StandbyStatus`]), written every renewal
/// interval: the bucket's max age drops the key of one that stopped (issue #29 item 14).
pub const STANDBY_KEY_PREFIX: &str = "standby.";

/// A coordinator standing by (not holding the lease), as `mur cluster status` lists it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StandbyStatus {
    /// Its instance name.
    pub instance: String,
    /// When it last said it stands by, unix milliseconds.
    pub at: u64,
}

/// The value of the leader's lease.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaderLease {
    /// The leading coordinator's instance name.
    pub instance: String,
    /// Its term: the key's revision when it took the lease (renewals keep it).
    pub term: u64,
    /// When it took the lease, unix milliseconds.
    pub since: u64,
    /// The holding process's own id (a UUID minted when it started), absent in leases of
    /// earlier versions: a process that finds its own value under the key after it stepped
    /// down knows that term is over, and takes the lease back without waiting for the value
    /// to age out (`coordinator/src/lease.rs`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub process: Option<String>,
}

/// The name of the coordinator's NATS micro service.
pub const SERVICE_NAME: &str = "mur";

/// The coordinator's request subjects (NATS micro service endpoints). Each takes a JSON
/// request and answers JSON: the reply type on success, an [`ApiError`] otherwise.
pub mod api {
    /// The group every endpoint sits in.
    pub const PREFIX: &str = "mur.api";
    /// The API's version, carried in every error the coordinator answers
    /// ([`super::ApiError::api_version`]), so a client tells what the coordinator
    /// understands from a number, never from an error's text. 1: the first versioned API
    /// (a submission may name its [`super::SubmitRequest::task_id`]).
    pub const VERSION: u32 = 1;
    /// [`super::SubmitRequest`] → [`super::SubmitReply`].
    pub const TASK_SUBMIT: &str = "mur.api.task.submit";
    /// [`super::TaskRef`] → [`super::TaskRecord`].
    pub const TASK_GET: &str = "mur.api.task.get";
    /// Empty request, or `{"state": …, "limit": …}` → a [`crate::page::Page`] of
    /// [`super::TaskRecord`]s, newest first, fitted into one message.
    pub const TASK_LIST: &str = "mur.api.task.list";
    /// [`super::TaskRef`] → [`super::TaskRecord`] (its state after the cancel).
    pub const TASK_CANCEL: &str = "mur.api.task.cancel";
    /// Empty request → a JSON array of [`super::CapsuleEntry`].
    pub const CAPSULE_LIST: &str = "mur.api.capsule.list";
    /// Empty request → [`super::ClusterStatus`] (issue #8 §Observability of the queue).
    pub const CLUSTER_STATUS: &str = "mur.api.cluster.status";
}

/// `mur.cancel.<task_id>`: the core subject on which the coordinator tells workers that a
/// task's record now has `cancel_requested_at`, so the worker running it stops at once
/// rather than at its next progress tick (issue #8 §Cancel).
pub fn cancel_subject(task_id: &TaskId) -> String {
    format!("{CANCEL_SUBJECT_PREFIX}{task_id}")
}

/// The prefix of [`cancel_subject`]; workers subscribe to `mur.cancel.*`.
pub const CANCEL_SUBJECT_PREFIX: &str = "mur.cancel.";

/// The subject a session's trace events go to: `mur.trace.<session_id>`.
pub fn trace_subject(session_id: &str) -> String {
    format!("{TRACE_SUBJECT_PREFIX}{session_id}")
}

/// The object name of a capsule bundle: `<capsule>/<digest>`.
pub fn bundle_object(capsule: &str, digest: &str) -> String {
    format!("{capsule}/{digest}")
}

/// Whether `digest` is a bundle digest: 64 lowercase hex digits (SHA-256).
pub fn is_valid_digest(digest: &str) -> bool {
    digest.len() == 64 && digest.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

// ---------------------------------------------------------------------------------------

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_subjects_are_the_documented_ones() {
        assert_eq!(trace_subject("ses_1"), "mur.trace.ses_1");
        assert_eq!(Dispatch::bare(TaskId::unchecked("tsk_1"), 2).msg_id(), "tsk_1:2");
        assert_eq!(bundle_object("hello", "ab"), "hello/ab");
        assert!(is_valid_digest(&"0f".repeat(32)));
        assert!(!is_valid_digest(&"0F".repeat(32)));
        assert!(!is_valid_digest("../etc"));
        for subject in [api::TASK_SUBMIT, api::TASK_GET, api::TASK_LIST, api::TASK_CANCEL, api::CAPSULE_LIST] {
            assert!(subject.starts_with(api::PREFIX), "{subject}");
        }
    }
}
