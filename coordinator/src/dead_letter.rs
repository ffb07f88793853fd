//! Poison tasks (issue #8 §Poison tasks; the design, §Invariants 3): a dispatch that JetStream
//! delivered `max_deliver` times without an ack — every worker that took it died, or
//! failed to handle it — is given up. JetStream announces it with the advisory
//! [`cluster::DEAD_LETTER_SUBJECT`], which the stream [`cluster::DEAD_LETTER_STREAM`]
//! stores (issue #29 item 1: as a core NATS message it was lost while no coordinator ran,
//! and the task stayed `working`, holding its slot, for good). The leader's loop here reads
//! each stored notice through the durable consumer [`cluster::DEAD_LETTER_CONSUMER`] — the
//! ones given while no coordinator ran first, as soon as one leads — reads the dispatch at
//! the notice's stream sequence, ends the task's record `failed` with a [`DeadLetter`]
//! (compare-and-set; a record already terminal is left alone), deletes the dispatch from
//! the work-queue stream and acks the notice. A notice that could not be handled because
//! the broker failed is not acked: it comes again. The lane goes on: the scheduler sees
//! the record end like any other, and the slot is free.
//!
//! Retries wait: redeliveries come after the ack wait (a worker that died), or after the
//! worker's growing nak delay (a worker that failed to handle it).

use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::stream::LastRawMessageErrorKind;
use async_nats::jetstream::{self, AckKind, kv};
use futures::StreamExt;
use mur_nats::clock::{Clock, SystemClock};
use mur_proto::TaskId;
use mur_proto::cluster::{self, DeadLetter, Dispatch};
use mur_proto::task::{ExitStatus, TaskState};
use serde::Deserialize;
use std::time::Duration;
use tokio::sync::watch;

/// The name the loop ends with (the leader's loops report which one stopped).
const LOOP: &str = "the dead-letter loop";
/// The most notices asked for at once.
const BATCH: usize = 16;
/// How long one pull waits for a notice before it asks again.
const PULL_WAIT: Duration = Duration::from_secs(5);
/// The wait before a notice that could not be handled (the broker failed) comes again, and
/// before a pull that failed is sent again.
const RETRY_DELAY: Duration = Duration::from_secs(1);

/// The part of the advisory this loop reads.
#[derive(Debug, Deserialize)]
struct MaxDeliveries {
    stream_seq: u64,
    deliveries: u64,
}

/// What became of one notice.
enum Handled {
    /// The task's record ended (or had ended): ack the notice.
    Done,
    /// The notice can never be handled (it is malformed, its dispatch is gone, the record
    /// is missing): ack it, saying why.
    Unusable(String),
    /// The broker failed: the notice comes again.
    Retry(String),
}

/// Reads the stored max-deliveries notices through `notices` (the
/// [`cluster::DEAD_LETTER_CONSUMER`] consumer) and dead-letters each task they name, until
/// `stopped`.
pub async fn run(
    js: jetstream::Context,
    notices: PullConsumer,
    tasks: kv::Store,
    instance: String,
    mut stopped: watch::Receiver<bool>,
) -> &'static str {
    loop {
        let pulled = tokio::select! {
            _ = stopped.changed() => return LOOP,
            pulled = notices.fetch().max_messages(BATCH).expires(PULL_WAIT).messages() => pulled,
        };
        let mut batch = match pulled {
            Ok(batch) => batch,
            Err(e) => {
                tracing::debug!(%instance, "pulling dead-letter notices: {e}");
                tokio::select! {
                    _ = stopped.changed() => return LOOP,
                    () = tokio::time::sleep(RETRY_DELAY) => continue,
                }
            }
        };
        loop {
            let msg = tokio::select! {
                _ = stopped.changed() => return LOOP,
                msg = batch.next() => msg,
            };
            let msg = match msg {
                None => break,
                Some(Ok(msg)) => msg,
                Some(Err(e)) => {
                    tracing::debug!(%instance, "reading dead-letter notices: {e}");
                    break;
                }
            };
            let handled = match serde_json::from_slice::<MaxDeliveries>(&msg.payload) {
                Ok(advisory) => give_up(&js, &tasks, &advisory).await,
                Err(e) => Handled::Unusable(format!("a max-deliveries advisory that could not be read: {e}")),
            };
            let answered = match handled {
                Handled::Done => msg.ack().await,
                Handled::Unusable(why) => {
                    tracing::warn!(%instance, "dead-letter notice dropped: {why}");
                    msg.ack().await
                }
                Handled::Retry(why) => {
                    tracing::warn!(%instance, "dead-lettering failed, to be tried again: {why}");
                    msg.ack_with(AckKind::Nak(Some(RETRY_DELAY))).await
                }
            };
            if let Err(e) = answered {
                tracing::debug!(%instance, "answering a dead-letter notice: {e}");
            }
        }
    }
}

async fn give_up(js: &jetstream::Context, tasks: &kv::Store, advisory: &MaxDeliveries) -> Handled {
    let seq = advisory.stream_seq;
    let stream = match js.get_stream(cluster::DISPATCH_STREAM).await {
        Ok(stream) => stream,
        Err(e) => return Handled::Retry(format!("{}: {e}", cluster::DISPATCH_STREAM)),
    };
    let raw = match stream.get_raw_message(seq).await {
        Ok(raw) => raw,
        Err(e) if gone(&e) => {
            return Handled::Unusable(format!(
                "dispatch {seq} is no longer in {} (dead-lettered already)",
                cluster::DISPATCH_STREAM
            ));
        }
        Err(e) => return Handled::Retry(format!("{} message {seq}: {e}", cluster::DISPATCH_STREAM)),
    };
    let dispatch: Dispatch = match serde_json::from_slice(&raw.payload) {
        Ok(dispatch) => dispatch,
        Err(e) => return Handled::Unusable(format!("dispatch {seq} is not a dispatch: {e}")),
    };
    let reason = format!(
        "dead letter: the dispatch was delivered {} times and never finished (the workers that took it died or could not handle it)",
        advisory.deliveries
    );
    match mark(tasks, &dispatch.task_id, &reason, advisory.deliveries).await {
        Ok(()) => {}
        Err(e @ (mur_nats::tasks::Error::Conflict(_) | mur_nats::tasks::Error::Unavailable { .. })) => {
            return Handled::Retry(e.to_string());
        }
        Err(e) => return Handled::Unusable(e.to_string()),
    }
    tracing::warn!(task_id = %dispatch.task_id, deliveries = advisory.deliveries, "task dead-lettered");
    if let Err(e) = stream.delete_message(seq).await {
        tracing::debug!(seq, "deleting the given-up dispatch: {e}");
    }
    Handled::Done
}

/// Whether a message read failed because the message is not there.
fn gone(e: &jetstream::stream::RawMessageError) -> bool {
    match e.kind() {
        LastRawMessageErrorKind::NoMessageFound => true,
        LastRawMessageErrorKind::JetStream(js) => js.error_code() == jetstream::ErrorCode::NO_MESSAGE_FOUND,
        _ => false,
    }
}

/// Ends `task_id`'s record `failed` with a [`DeadLetter`] of `reason` unless it is
/// already terminal (compare-and-set, retried on a conflict).
///
/// # Errors
/// [`mur_nats::tasks::update`]'s: the bucket's error, or a record that is missing or not
/// JSON.
pub async fn mark(
    tasks: &kv::Store,
    task_id: &TaskId,
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
