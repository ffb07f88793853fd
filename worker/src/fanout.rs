//! The cluster-wide fan-out semaphore's IO (issue #11 §The fan-out cap, cluster-wide;
//! DESIGN.md invariant 5): taking, renewing and giving back permits in the KV bucket
//! [`fanout::FANOUT_BUCKET`]. The layout and the order in which waiters are served are in
//! [`mur_proto::fanout`]; this module only talks to JetStream.
//!
//! - [`Semaphore::acquire`] puts the step's ticket (`wait.<task>`), watches the bucket and,
//!   each time it has caught up with the bucket, tries the slots
//!   [`fanout::candidates`] offers with *create*. It renews its ticket every third of the
//!   lease while it waits, never gives up on its own (only a cancel ends the wait), and
//!   removes its ticket once it holds a permit or stops waiting.
//! - A [`Permit`] is renewed with compare-and-set on its revision ([`Permit::renew`], or
//!   in the background with [`Permit::keep_alive`]); a renewal that finds another
//!   revision means the lease was lost (the holder stalled past it and the slot expired),
//!   and [`Permit::lost`] fires so the step can stop.
//! - [`Permit::release`] deletes the slot expecting the holder's revision: a late or
//!   repeated release changes nothing.

use async_nats::jetstream::kv::{self, Operation};
use futures::StreamExt;
use mur_proto::fanout::{self, Holder, View};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Why a permit could not be had or kept.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The wait was cancelled (the task was cancelled, hit its deadline, or the worker is
    /// stopping) before a permit was free.
    #[error("cancelled while waiting for a fan-out permit")]
    Cancelled,
    /// The permit's slot holds another revision: it expired and was taken by another step.
    #[error("the fan-out permit {0} was lost: it expired and another step holds it now")]
    Lost(String),
    /// JetStream refused or could not be reached.
    #[error("fan-out semaphore: {0}")]
    Nats(String),
}

fn nats(e: impl std::fmt::Display) -> Error {
    Error::Nats(e.to_string())
}

/// A handle on the semaphore.
#[derive(Clone)]
pub struct Semaphore {
    kv: kv::Store,
    lease: Duration,
}

impl Semaphore {
    /// A handle on `kv` (the `mur_fanout` bucket), whose max age `lease` is the life of a
    /// permit or ticket without a renewal.
    pub fn new(kv: kv::Store, lease: Duration) -> Semaphore {
        Semaphore { kv, lease }
    }

    /// Opens the bucket and reads its lease (the bucket's max age).
    ///
    /// # Errors
    /// [`Error::Nats`] when the bucket is missing or cannot be read.
    pub async fn open(js: &async_nats::jetstream::Context) -> Result<Semaphore, Error> {
        let kv = js.get_key_value(fanout::FANOUT_BUCKET).await.map_err(nats)?;
        let mut stream = js.get_stream(format!("KV_{}", fanout::FANOUT_BUCKET)).await.map_err(nats)?;
        let lease = stream.info().await.map_err(nats)?.config.max_age;
        Ok(Semaphore::new(kv, if lease.is_zero() { Duration::from_secs(15) } else { lease }))
    }

    /// The life of a permit without a renewal.
    pub fn lease(&self) -> Duration {
        self.lease
    }

    /// Waits in line for one of the first `holder.step.cap` permits and takes it.
    ///
    /// # Errors
    /// [`Error::Cancelled`] when `cancel` fires first (the ticket is removed);
    /// [`Error::Nats`] when JetStream fails (the ticket expires on its own).
    pub async fn acquire(&self, holder: &Holder, cancel: &CancellationToken) -> Result<Permit, Error> {
        let value = serde_json::to_vec(holder).map_err(nats)?;
        let ticket_key = fanout::wait_key(&holder.task_id);
        let mut ticket = self.kv.put(&ticket_key, value.clone().into()).await.map_err(nats)?;
        let result = self.wait_in_line(holder, &value, &ticket_key, &mut ticket, cancel).await;
        // Leave the line, whatever happened; a ticket left behind expires within the lease.
        let _ = self.kv.delete_expect_revision(&ticket_key, Some(ticket)).await;
        result
    }

    async fn wait_in_line(
        &self,
        holder: &Holder,
        value: &[u8],
        ticket_key: &str,
        ticket: &mut u64,
        cancel: &CancellationToken,
    ) -> Result<Permit, Error> {
        let mut watch = self.kv.watch_with_history(">").await.map_err(nats)?;
        let mut view = View::default();
        let renew_every = self.lease / 3;
        let mut renew = tokio::time::interval_at(tokio::time::Instant::now() + renew_every, renew_every);
        let mut caught_up = false;
        loop {
            if caught_up {
                for slot in fanout::candidates(&view, &holder.task_id, holder.step.cap) {
                    let key = fanout::slot_key(slot);
                    match self.kv.create(&key, value.to_vec().into()).await {
                        Ok(revision) => {
                            return Ok(Permit {
                                kv: self.kv.clone(),
                                key,
                                slot,
                                value: value.to_vec(),
                                revision: AtomicU64::new(revision),
                                lease: self.lease,
                                lost: CancellationToken::new(),
                            });
                        }
                        // Taken meanwhile: the watch will say by whom.
                        Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => {}
                        Err(e) => return Err(nats(e)),
                    }
                }
            }
            tokio::select! {
                _ = cancel.cancelled() => return Err(Error::Cancelled),
                _ = renew.tick() => {
                    // Keep the place in line; a ticket that expired meanwhile (this worker
                    // stalled past the lease) goes to the back.
                    *ticket = match self.kv.update(ticket_key, value.to_vec().into(), *ticket).await {
                        Ok(rev) => rev,
                        Err(_) => self.kv.put(ticket_key, value.to_vec().into()).await.map_err(nats)?,
                    };
                    caught_up = true;
                }
                entry = watch.next() => {
                    let entry = match entry {
                        Some(Ok(e)) => e,
                        Some(Err(e)) => return Err(nats(e)),
                        None => return Err(Error::Nats("the semaphore watch ended".into())),
                    };
                    let value = (entry.operation == Operation::Put).then_some(entry.value.as_ref());
                    view.apply(&entry.key, entry.revision, value);
                    caught_up = entry.delta == 0;
                }
            }
        }
    }
}

/// Reads permits in use, holders and waiting steps (for `mur cluster status` and
/// `mur fleet status`, issue #11 §The fan-out cap).
///
/// # Errors
/// [`Error::Nats`] when the bucket cannot be read.
pub async fn status(kv: &kv::Store) -> Result<fanout::FanoutStatus, Error> {
    let mut keys = kv.keys().await.map_err(nats)?;
    let mut entries = Vec::new();
    while let Some(key) = keys.next().await {
        let key = key.map_err(nats)?;
        if let Some(entry) = kv.entry(&key).await.map_err(nats)?
            && entry.operation == Operation::Put
        {
            entries.push((key, entry.revision, entry.value.to_vec()));
        }
    }
    Ok(fanout::FanoutStatus::build(&entries))
}

/// A held permit: slot `slot` of the semaphore at revision `revision`.
pub struct Permit {
    kv: kv::Store,
    key: String,
    slot: u32,
    value: Vec<u8>,
    revision: AtomicU64,
    lease: Duration,
    lost: CancellationToken,
}

impl Permit {
    /// The slot number.
    pub fn slot(&self) -> u32 {
        self.slot
    }

    /// The revision of the holder's last write: its fencing token.
    pub fn revision(&self) -> u64 {
        self.revision.load(Ordering::SeqCst)
    }

    /// Fires when a renewal found the permit lost.
    pub fn lost(&self) -> CancellationToken {
        self.lost.clone()
    }

    /// Renews the permit once (compare-and-set on its revision).
    ///
    /// # Errors
    /// [`Error::Lost`] (and [`Permit::lost`] fires) when the slot holds another revision;
    /// [`Error::Nats`] when JetStream cannot be reached (the permit may still be held).
    pub async fn renew(&self) -> Result<(), Error> {
        match self.kv.update(&self.key, self.value.clone().into(), self.revision()).await {
            Ok(rev) => {
                self.revision.store(rev, Ordering::SeqCst);
                Ok(())
            }
            Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => {
                self.lost.cancel();
                Err(Error::Lost(self.key.clone()))
            }
            Err(e) => Err(nats(e)),
        }
    }

    /// Renews the permit every third of the lease until the returned handle is aborted or
    /// the permit is lost. A renewal that fails for a broker outage is retried at the next
    /// tick; one that outlives the lease finds the permit lost.
    pub fn keep_alive(self: &Arc<Self>) -> tokio::task::JoinHandle<()> {
        let permit = self.clone();
        tokio::spawn(async move {
            let every = permit.lease / 3;
            let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
            loop {
                tick.tick().await;
                match permit.renew().await {
                    Ok(()) => {}
                    Err(Error::Lost(key)) => {
                        tracing::warn!(%key, "fan-out permit lost: the step stops");
                        return;
                    }
                    Err(e) => tracing::warn!(error = %e, "renewing a fan-out permit failed; retrying"),
                }
            }
        })
    }

    /// Gives the permit back. Only the holder's revision is deleted: when the slot expired
    /// and another step took it, this changes nothing and says so with `Ok(false)`.
    ///
    /// # Errors
    /// [`Error::Nats`] when JetStream cannot be reached (the permit then expires within
    /// the lease).
    pub async fn release(&self) -> Result<bool, Error> {
        match self.kv.delete_expect_revision(&self.key, Some(self.revision())).await {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == kv::DeleteErrorKind::WrongLastRevision => Ok(false),
            Err(e) => Err(nats(e)),
        }
    }
}
