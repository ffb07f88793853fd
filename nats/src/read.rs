//! Reads of a key-value bucket or a stream that leave no consumer behind (issue #29 item
//! 3). async-nats' `keys()`, `watch()` and `watch_with_history()` each create an
//! ephemeral consumer that outlives its reader by ~30 s (its inactive threshold): every
//! `cluster.status` left three or four of them, `task.list` and `fleet.jobs` one each, and
//! nats-server refuses new consumers past its limit, so ~35 status requests a second took
//! the cluster down.
//!
//! - One-pass reads ([`latest`], [`keys`], [`messages`]) create one pull consumer (no
//!   acks, in memory), read it up to the entry that was the last when it started, and
//!   delete it before returning — also when the read fails or its caller gives up
//!   (dropped: the delete is sent from a spawned task); a short inactive threshold removes
//!   the consumer of a process that died mid-read.
//! - Watches ([`watch`], [`watch_changes`]) are ordered push consumers under a name of
//!   their own, deleted by [`Watch::close`] or when the [`Watch`] is dropped (a replacement
//!   the client made after a gap included). A process that ends right after its watch
//!   (a CLI command) closes it, since its runtime may not run a task spawned at drop.

use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, ReplayPolicy, pull, push};
use async_nats::jetstream::{kv, stream};
use futures::StreamExt;
use std::time::Duration;

/// How long a reader's consumer lives on the server after its last pull when nobody
/// deletes it (its process died mid-read).
const INACTIVE_THRESHOLD: Duration = Duration::from_secs(5);
/// The most entries asked for in one pull.
const BATCH: usize = 256;
/// How long one pull waits for entries the consumer says are pending.
const PULL_WAIT: Duration = Duration::from_secs(5);

/// A read that failed.
#[derive(Debug, thiserror::Error)]
#[error("{bucket}: {what}: {source}")]
pub struct Error {
    /// The bucket (or, for [`messages`], the stream).
    pub bucket: String,
    /// What failed: `create the reader`, `pull`, `read an entry`.
    pub what: &'static str,
    /// The client's error.
    #[source]
    pub source: async_nats::Error,
}

/// Hands `visit` the latest entry of every key of `store` matching `keys` (a subject
/// filter over key names: `>` for all, `def.>`), deletes and purges included (see
/// [`kv::Entry::operation`]), in one pass; a key written during the pass may come again,
/// newer (keep the last of each key). Nothing is held here.
///
/// # Errors
/// [`Error`] when the reader cannot be created, or a pull fails or brings nothing while
/// entries are pending.
pub async fn latest(store: &kv::Store, keys: &str, visit: impl FnMut(kv::Entry)) -> Result<(), Error> {
    pass(store, keys, false, visit).await
}

/// The keys of `store` matching `keys` whose latest entry is a value (not a delete or
/// purge), in stream order; the values are not read (headers only).
///
/// # Errors
/// As [`latest`].
pub async fn keys(store: &kv::Store, keys: &str) -> Result<Vec<String>, Error> {
    let mut live = Vec::new();
    pass(store, keys, true, |entry| {
        live.retain(|k| *k != entry.key);
        if entry.operation == kv::Operation::Put {
            live.push(entry.key);
        }
    })
    .await?;
    Ok(live)
}

async fn pass(
    store: &kv::Store,
    keys: &str,
    headers_only: bool,
    mut visit: impl FnMut(kv::Entry),
) -> Result<(), Error> {
    let fail = |what: &'static str| {
        let bucket = store.name.clone();
        move |source: async_nats::Error| Error { bucket, what, source }
    };
    let config = pull::Config {
        filter_subject: format!("{}{keys}", store.prefix),
        deliver_policy: DeliverPolicy::LastPerSubject,
        ack_policy: AckPolicy::None,
        headers_only,
        memory_storage: true,
        num_replicas: 1,
        inactive_threshold: INACTIVE_THRESHOLD,
        description: Some("murmur: a one-pass read, deleted when done".into()),
        ..Default::default()
    };
    let consumer = store.stream.create_consumer(config).await.map_err(|e| fail("create the reader")(e.into()))?;
    let reader = Reader::new(&store.stream, consumer.cached_info().name.clone(), false);
    drain(consumer, reader, &store.name, ("read an entry", "entry"), |msg| {
        let entry = entry_of(store, &msg)?;
        let pending = entry.delta;
        visit(entry);
        Ok(pending)
    })
    .await
}

/// Hands `visit` every message of `stream` on `subject` (a subject filter), oldest first,
/// in one pass up to the message that was the last when it started.
///
/// # Errors
/// As [`latest`]; [`Error::bucket`] names the stream.
pub async fn messages(
    stream: &stream::Stream,
    subject: &str,
    mut visit: impl FnMut(async_nats::jetstream::Message),
) -> Result<(), Error> {
    let name = stream.cached_info().config.name.clone();
    let fail = |what: &'static str| {
        let bucket = name.clone();
        move |source: async_nats::Error| Error { bucket, what, source }
    };
    let config = pull::Config {
        filter_subject: subject.to_string(),
        deliver_policy: DeliverPolicy::All,
        ack_policy: AckPolicy::None,
        memory_storage: true,
        num_replicas: 1,
        inactive_threshold: INACTIVE_THRESHOLD,
        description: Some("murmur: a one-pass read, deleted when done".into()),
        ..Default::default()
    };
    let consumer = stream.create_consumer(config).await.map_err(|e| fail("create the reader")(e.into()))?;
    let reader = Reader::new(stream, consumer.cached_info().name.clone(), false);
    drain(consumer, reader, &name, ("read a message", "message"), |msg| {
        let pending = msg.info().map_err(|e| async_nats::Error::from(e.to_string()))?.pending;
        visit(msg);
        Ok(pending)
    })
    .await
}

/// Pulls `consumer` until nothing is pending — the count its info gives at the start,
/// then the count `each` returns for each message it is handed (the message's own
/// pending count) — and deletes it. `what` names a failure of `each` in the [`Error`]
/// and `noun` the thing a pull brought nothing of.
async fn drain(
    mut consumer: async_nats::jetstream::consumer::PullConsumer,
    reader: Reader,
    bucket: &str,
    (what, noun): (&'static str, &str),
    mut each: impl FnMut(async_nats::jetstream::Message) -> Result<u64, async_nats::Error>,
) -> Result<(), Error> {
    let fail = |what: &'static str, source: async_nats::Error| Error { bucket: bucket.to_string(), what, source };
    let mut pending = consumer.cached_info().num_pending;
    if pending == 0 {
        // Asked again: the info the create returned may predate the consumer's first look.
        pending = consumer.info().await.map_err(|e| fail("read the reader", e.into()))?.num_pending;
    }
    while pending > 0 {
        let want = usize::try_from(pending).unwrap_or(BATCH).min(BATCH);
        let mut batch = consumer
            .fetch()
            .max_messages(want)
            .expires(PULL_WAIT)
            .messages()
            .await
            .map_err(|e| fail("pull", e.into()))?;
        let mut got = 0;
        while let Some(msg) = batch.next().await {
            pending = each(msg.map_err(|e| fail("pull", e))?).map_err(|e| fail(what, e))?;
            got += 1;
        }
        if got == 0 {
            return Err(fail("pull", format!("no {noun} within {PULL_WAIT:?} while {pending} are pending").into()));
        }
    }
    reader.delete().await;
    Ok(())
}

/// The KV entry a message of `store`'s stream is; its `delta` is what the consumer still
/// has pending after it.
fn entry_of(store: &kv::Store, msg: &async_nats::jetstream::Message) -> Result<kv::Entry, async_nats::Error> {
    let info = msg.info().map_err(|e| e.to_string())?;
    Ok(kv::Entry {
        bucket: store.name.clone(),
        key: msg.subject.strip_prefix(store.prefix.as_str()).unwrap_or(&msg.subject).to_string(),
        revision: info.stream_sequence,
        delta: info.pending,
        created: info.published,
        operation: operation(msg.headers.as_ref()),
        seen_current: info.pending == 0,
        value: msg.payload.clone(),
    })
}

/// A live watch of a bucket ([`watch`], [`watch_changes`]). Its consumer is deleted by
/// [`Watch::close`], or in the background when the watch is dropped.
pub struct Watch {
    store: kv::Store,
    messages: push::Ordered,
    reader: Reader,
}

/// Watches the keys of `store` matching `keys` as async-nats' `watch_with_history` does
/// (an ordered consumer: the latest entry of each key, then every change, re-created by
/// the client after a gap), under a name of its own so that closing or dropping the
/// [`Watch`] deletes it, rather than leaving it on the server for its 30 s inactive
/// threshold: a fan-out step's wait for a permit left one behind each time, and so did
/// every `mur task send --wait` and `mur fleet run` (issue #29 item 3).
///
/// # Errors
/// [`Error`] when the consumer cannot be created.
pub async fn watch(store: &kv::Store, keys: &str) -> Result<Watch, Error> {
    watch_from(store, keys, DeliverPolicy::LastPerSubject).await
}

/// As [`watch`], but only the changes made from now on (async-nats' `watch`).
///
/// # Errors
/// As [`watch`].
pub async fn watch_changes(store: &kv::Store, keys: &str) -> Result<Watch, Error> {
    watch_from(store, keys, DeliverPolicy::New).await
}

async fn watch_from(store: &kv::Store, keys: &str, deliver_policy: DeliverPolicy) -> Result<Watch, Error> {
    let fail = |what: &'static str| {
        let bucket = store.name.clone();
        move |source: async_nats::Error| Error { bucket, what, source }
    };
    let token = uuid::Uuid::now_v7().simple().to_string();
    let name = format!("mur_watch_{token}");
    let config = push::OrderedConfig {
        name: Some(name.clone()),
        deliver_subject: format!("_INBOX.mur_watch.{token}"),
        description: Some("murmur: a watch, deleted when dropped".into()),
        filter_subject: format!("{}{keys}", store.prefix),
        replay_policy: ReplayPolicy::Instant,
        deliver_policy,
        ..Default::default()
    };
    let consumer = store.stream.create_consumer(config).await.map_err(|e| fail("create the watch")(e.into()))?;
    let reader = Reader::new(&store.stream, name, true);
    let messages = consumer.messages().await.map_err(|e| fail("create the watch")(e.into()))?;
    Ok(Watch { store: store.clone(), messages, reader })
}

impl Watch {
    /// Stops watching and deletes the consumer, waiting for the server's answer: for a
    /// process about to end, whose runtime may not run a delete spawned at drop.
    pub async fn close(mut self) {
        std::mem::replace(&mut self.reader, Reader::done()).delete().await;
    }
}

impl futures::Stream for Watch {
    type Item = Result<kv::Entry, Error>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        let this = &mut *self;
        match this.messages.poll_next_unpin(cx) {
            std::task::Poll::Ready(Some(Ok(msg))) => {
                let entry = entry_of(&this.store, &msg).map_err(|source| Error {
                    bucket: this.store.name.clone(),
                    what: "read an entry",
                    source,
                });
                std::task::Poll::Ready(Some(entry))
            }
            std::task::Poll::Ready(Some(Err(e))) => std::task::Poll::Ready(Some(Err(Error {
                bucket: this.store.name.clone(),
                what: "watch",
                source: e.into(),
            }))),
            std::task::Poll::Ready(None) => std::task::Poll::Ready(None),
            std::task::Poll::Pending => std::task::Poll::Pending,
        }
    }
}

/// What a KV entry's headers say it is: a value, unless `KV-Operation` says `DEL` or
/// `PURGE`, or it is a server's delete marker (`Nats-Marker-Reason`: `Remove` is a delete,
/// `MaxAge` and `Purge` a purge) — the rules of async-nats' own watcher.
fn operation(headers: Option<&async_nats::HeaderMap>) -> kv::Operation {
    let Some(headers) = headers else { return kv::Operation::Put };
    if let Some(op) = headers.get("KV-Operation") {
        return match op.as_str() {
            "DEL" => kv::Operation::Delete,
            "PURGE" => kv::Operation::Purge,
            _ => kv::Operation::Put,
        };
    }
    match headers.get("Nats-Marker-Reason").map(|r| r.as_str()) {
        Some("Remove") => kv::Operation::Delete,
        Some("MaxAge" | "Purge") => kv::Operation::Purge,
        _ => kv::Operation::Put,
    }
}

/// A reader's consumer, deleted by [`Reader::delete`] or, when the read ends early, on
/// drop. For a watch (`ordered`), the client replaces the consumer after a gap with one
/// named `<name>_<n>`: when `name` is gone, those are looked for and deleted.
struct Reader {
    stream: Option<stream::Stream>,
    name: String,
    ordered: bool,
}

impl Reader {
    fn new(stream: &stream::Stream, name: String, ordered: bool) -> Reader {
        Reader { stream: Some(stream.clone()), name, ordered }
    }

    /// One deleted already.
    fn done() -> Reader {
        Reader { stream: None, name: String::new(), ordered: false }
    }

    async fn delete(mut self) {
        if let Some(stream) = self.stream.take() {
            delete(stream, std::mem::take(&mut self.name), self.ordered).await;
        }
    }
}

async fn delete(stream: stream::Stream, name: String, ordered: bool) {
    let Err(e) = stream.delete_consumer(&name).await else { return };
    if !ordered {
        tracing::debug!(consumer = %name, "deleting a reader's consumer: {e}");
        return;
    }
    // Replaced by the client after a gap (its old one deleted): the replacement goes.
    let replacement = format!("{name}_");
    let mut names = stream.consumer_names();
    let mut found = Vec::new();
    while let Some(Ok(n)) = names.next().await {
        if n.strip_prefix(&replacement).is_some_and(|serial| serial.bytes().all(|b| b.is_ascii_digit())) {
            found.push(n);
        }
    }
    for n in found {
        if let Err(e) = stream.delete_consumer(&n).await {
            tracing::debug!(consumer = %n, "deleting a watch's consumer: {e}");
        }
    }
}

impl Drop for Reader {
    fn drop(&mut self) {
        let Some(stream) = self.stream.take() else { return };
        let (name, ordered) = (std::mem::take(&mut self.name), self.ordered);
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(delete(stream, name, ordered));
        }
    }
}
