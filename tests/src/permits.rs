//! A watcher of the fan-out semaphore (`mur_fanout`, issue #11): every permit taken,
//! renewed, given back or expired, in the order the server stored them, so a test samples
//! the permit count at every change rather than now and then.

use async_nats::jetstream::kv::{self, Operation};
use futures::StreamExt;
use mur_proto::fanout::{Holder, SLOT_PREFIX};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// What the watcher has seen so far.
#[derive(Default)]
pub struct Seen {
    /// Permits held now: slot key (`slot.<n>`) → its holder.
    pub held: BTreeMap<String, Holder>,
    /// The most permits held at once.
    pub max_held: usize,
    /// Every change: when, the slot key, and the holder (`None`: given back or expired).
    pub events: Vec<(Instant, String, Option<Holder>)>,
}

/// Watches `kv` (the `mur_fanout` bucket) from its start until the test ends.
///
/// # Panics
/// When the watch cannot be opened.
pub async fn watch(kv: kv::Store) -> Arc<Mutex<Seen>> {
    let seen = Arc::new(Mutex::new(Seen::default()));
    let mut watch = kv.watch_with_history(">").await.expect("watch mur_fanout");
    let out = seen.clone();
    tokio::spawn(async move {
        while let Some(Ok(entry)) = watch.next().await {
            if !entry.key.starts_with(SLOT_PREFIX) {
                continue;
            }
            let mut s = out.lock().expect("permit watch");
            let holder = (entry.operation == Operation::Put)
                .then(|| serde_json::from_slice::<Holder>(&entry.value).ok())
                .flatten();
            match &holder {
                Some(h) => s.held.insert(entry.key.clone(), h.clone()),
                None => s.held.remove(&entry.key),
            };
            s.events.push((Instant::now(), entry.key.clone(), holder));
            s.max_held = s.max_held.max(s.held.len());
        }
    });
    seen
}
