//! Poison tasks (issue #8 §Poison tasks; the design, §Invariants 3): a dispatch that JetStream
//! delivered `max_deliver` times without an ack — every worker that took it died, or
//! failed to handle it — is given up. JetStream announces it with the advisory
//! `$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.MUR_DISPATCH.workers`; this loop reads the
//! dispatch at the advisory's stream sequence, ends the task's record `failed` with a
//! [`DeadLetter`] (compare-and-set; a record already terminal is left alone, so several
//! coordinators may all listen), and deletes the dispatch from the work-queue stream. The
//! lane goes on: the scheduler sees the record end like any other.
//!
//! Retries wait: redeliveries come after the ack wait (a worker that died), or after the
//! worker's growing nak delay (a worker that failed to handle it).

use async_nats::jetstream::{self, kv};
use futures::StreamExt;
use mur_nats::clock::{Clock, SystemClock};
use mur_proto::cluster::{self, DeadLetter, Dispatch};
use mur_proto::task::{ExitStatus, TaskState};
use serde::Deserialize;
use tokio::sync::watch;

/// The advisory subject for the dispatch consumer.
pub fn advisory_subject() -> String {
    format!("$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{}.{}", cluster::DISPATCH_STREAM, cluster::DISPATCH_CONSUMER)
}

/// The part of the advisory this loop reads.
#[derive(Debug, Deserialize)]
struct MaxDeliveries {
    stream_seq: u64,
    deliveries: u64,
}

/// Subscribes to the advisory and dead-letters each task it names, until `stopped`.
pub async fn run(
    client: async_nats::Client,
    tasks: kv::Store,
    instance: String,
    mut stopped: watch::Receiver<bool>,
) -> &'static str {
    let mut advisories = match client.subscribe(advisory_subject()).await {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(%instance, "subscribing to max-deliveries advisories: {e}");
            return "the dead-letter loop";
        }
    };
    let js = jetstream::new(client);
    loop {
        let msg = tokio::select! {
            _ = stopped.changed() => return "the dead-letter loop",
            msg = advisories.next() => match msg {
                Some(m) => m,
                None => return "the dead-letter loop",
            },
        };
        let Ok(advisory) = serde_json::from_slice::<MaxDeliveries>(&msg.payload) else {
            tracing::warn!(%instance, "a max-deliveries advisory that could not be read");
            continue;
        };
        if let Err(e) = give_up(&js, &tasks, &advisory).await {
            tracing::warn!(%instance, seq = advisory.stream_seq, "dead-lettering failed: {e}");
        }
    }
}

async fn give_up(js: &jetstream::Context, tasks: &kv::Store, advisory: &MaxDeliveries) -> Result<(), String> {
    let stream = js.get_stream(cluster::DISPATCH_STREAM).await.map_err(|e| e.to_string())?;
    let raw = stream.get_raw_message(advisory.stream_seq).await.map_err(|e| e.to_string())?;
    let dispatch: Dispatch = serde_json::from_slice(&raw.payload).map_err(|e| e.to_string())?;
    let reason = format!(
        "dead letter: the dispatch was delivered {} times and never finished (the workers that took it died or could not handle it)",
        advisory.deliveries
    );
    mark(tasks, &dispatch.task_id, &reason, advisory.deliveries).await.map_err(|e| e.to_string())?;
    tracing::warn!(task_id = %dispatch.task_id, deliveries = advisory.deliveries, "task dead-lettered");
    if let Err(e) = stream.delete_message(advisory.stream_seq).await {
        tracing::debug!(seq = advisory.stream_seq, "deleting the given-up dispatch: {e}");
    }
    Ok(())
}

/// Ends `task_id`'s record `failed` with a [`DeadLetter`] of `reason` unless it is
/// already terminal (compare-and-set, retried on a conflict).
///
/// # Errors
/// [`mur_nats::tasks::update`]'s: the bucket's error, or a record that is missing or not
/// JSON.
pub async fn mark(
    tasks: &kv::Store,
    task_id: &str,
    reason: &str,
    deliveries: u64,
) -> Result<(), mur_nats::tasks::Error> {
    mur_nats::tasks::update(tasks, task_id, None, |record| {
        if record.state.is_terminal() {
            return false;
        }
        let now = SystemClock.now_ms();
        record.state = TaskState::Failed;
        record.exit_status = Some(ExitStatus::Failed);
        record.result = Some(format!("error: {reason}"));
        record.error = Some(reason.to_string());
        record.ended_at = Some(now);
        record.dead_letter =
            Some(DeadLetter { reason: reason.to_string(), deliveries, last_worker: record.worker.clone(), at: now });
        true
    })
    .await
    .map(|written| {
        if let Some((record, _)) = written {
            mur_nats::metrics::dead_letter(&record.capsule);
            mur_nats::metrics::task_ended(&record);
        }
    })
}
