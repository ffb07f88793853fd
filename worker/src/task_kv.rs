//! The compare-and-set of a task record in `mur_tasks` that the worker and the coordinator
//! both make, with the expiry of an ended record: a record written ended is kept for the
//! cluster's `ended_task_max_age_secs`, then the server removes it.
//!
//! A plain KV update cannot carry a per-key TTL (async-nats 0.51 has no public
//! `update_with_ttl`; `reference/jetstream-patterns.md` §1.5), so an ended record is
//! published to the key's subject with the headers the client's own update sends
//! (`Nats-Expected-Last-Subject-Sequence`) plus `Nats-TTL` and `Nats-Rollup: sub`. The
//! rollup removes the key's earlier revisions as the ended one is stored: were they kept,
//! the key would read as its last revision before the end (`working`) once the ended one
//! expired, and a restarting coordinator would take that for a running task.

use async_nats::HeaderMap;
use async_nats::header::{NATS_EXPECTED_LAST_SUBJECT_SEQUENCE, NATS_MESSAGE_TTL, NATS_ROLLUP};
use async_nats::jetstream::{self, kv};
use bytes::Bytes;
use std::time::Duration;

/// Compare-and-sets `key` in `tasks` to `value` on `revision` and returns the new revision.
/// When `ended` is true and `max_age` is `Some`, the record is an ended one kept for
/// `max_age` (whole seconds, at least 1; the server removes it then), its earlier revisions
/// rolled up; otherwise this is [`kv::Store::update`].
///
/// `tasks` must be a bucket of `js`'s account and domain (no JetStream prefix of its own).
///
/// # Errors
/// [`kv::UpdateError`] as [`kv::Store::update`] gives it:
/// [`kv::UpdateErrorKind::WrongLastRevision`] when the record moved on from `revision`.
pub async fn update(
    js: &jetstream::Context,
    tasks: &kv::Store,
    key: &str,
    value: Bytes,
    revision: u64,
    ended: bool,
    max_age: Option<Duration>,
) -> Result<u64, kv::UpdateError> {
    let Some(max_age) = max_age.filter(|_| ended) else {
        return tasks.update(key, value, revision).await;
    };
    let subject = format!("{}{key}", tasks.put_prefix.as_deref().unwrap_or(&tasks.prefix));
    let mut headers = HeaderMap::new();
    headers.insert(NATS_EXPECTED_LAST_SUBJECT_SEQUENCE, revision.to_string().as_str());
    headers.insert(NATS_MESSAGE_TTL, max_age.as_secs().max(1).to_string().as_str());
    headers.insert(NATS_ROLLUP, "sub");
    let ack = js.publish_with_headers(subject, headers, value).await.map_err(kv::UpdateError::from)?;
    ack.await.map(|ack| ack.sequence).map_err(kv::UpdateError::from)
}
