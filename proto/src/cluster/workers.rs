//! A worker's registration in `mur_workers` and its heartbeat.

use super::*;

/// A worker's registration, refreshed by its heartbeat, in [`WORKERS_BUCKET`] (key =
/// `worker_id`). Times are unix milliseconds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerInfo {
    /// The worker's id, unique in the cluster.
    pub worker_id: String,
    /// How many tasks it runs at once.
    pub slots: u32,
    /// How many of its slots are taken.
    pub busy: u32,
    /// When the worker process started.
    pub started_at: u64,
    /// When it last said it was alive.
    pub heartbeat_at: u64,
    /// Its murmur version.
    pub version: String,
}

/// Whether a worker whose last heartbeat was at `heartbeat_at` is silent at `now` (both
/// unix ms): more than `timeout_ms` has passed. The scheduler gives a silent worker no
/// dispatch and `cluster.status` shows it so; one rule for both.
pub fn heartbeat_expired(heartbeat_at: u64, now: u64, timeout_ms: u64) -> bool {
    now.saturating_sub(heartbeat_at) > timeout_ms
}
