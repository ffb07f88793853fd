//! The cluster-wide fan-out semaphore's IO (issue #11 §The fan-out cap, cluster-wide;
//! the design's invariant 5): taking, renewing and giving back permits in the KV bucket
//! [`fanout::FANOUT_BUCKET`]. The layout and the order in which waiters are served are in
//! [`mur_proto::fanout`]; this module only talks to JetStream.
//!
//! - [`Semaphore::acquire`] puts the step's ticket (`wait.<task>`), watches the bucket and,
//!   each time it has caught up with the bucket, tries the slots
//!   [`fanout::candidates`] offers with *create*. It renews its ticket every third of the
//!   lease while it waits, never gives up on its own (only a cancel ends the wait), and
//!   removes its ticket once it holds a permit or stops waiting.
//! - A [`Permit`] is renewed with compare-and-set on its revision ([`Permit::renew`]; a
//!   step's [`StepPermit`] does it in the background); a renewal that finds another
//!   revision means the lease was lost (the holder stalled past it and the slot expired),
//!   and [`Permit::lost`] fires so the step can stop.
//! - [`Permit::release`] deletes the slot expecting the holder's revision: a late or
//!   repeated release changes nothing.

use async_nats::jetstream::kv::{self, Operation};
use futures::StreamExt;
use mur_proto::fanout::{self, Holder, View};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
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
        let revision = self.kv.put(&ticket_key, value.clone().into()).await.map_err(nats)?;
        let mut ticket = Ticket { kv: self.kv.clone(), key: ticket_key, revision, left: false };
        let result = self.wait_in_line(holder, &value, &mut ticket, cancel).await;
        // Leave the line, whatever happened (a wait dropped before this line leaves it from
        // `Ticket`'s drop); a ticket left behind anyway expires within the lease.
        ticket.leave().await;
        result
    }

    async fn wait_in_line(
        &self,
        holder: &Holder,
        value: &[u8],
        ticket: &mut Ticket,
        cancel: &CancellationToken,
    ) -> Result<Permit, Error> {
        // Deleted when the wait ends (issue #29 item 3).
        let mut watch = crate::read::watch(&self.kv, ">").await.map_err(nats)?;
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
                                lost: CancellationToken::new(),
                                released: AtomicBool::new(false),
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
                    ticket.revision = match self.kv.update(&ticket.key, value.to_vec().into(), ticket.revision).await {
                        Ok(rev) => rev,
                        Err(_) => self.kv.put(&ticket.key, value.to_vec().into()).await.map_err(nats)?,
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

/// A waiting step's ticket (`wait.<task id>`) at `revision`. Left with [`Ticket::leave`];
/// a wait dropped before that (its task's call was dropped on a cancel or a deadline)
/// leaves the line from `drop`, in the background, so the ticket does not keep its place,
/// and hold back a freed permit, until its lease runs out.
struct Ticket {
    kv: kv::Store,
    key: String,
    revision: u64,
    left: bool,
}

impl Ticket {
    async fn leave(mut self) {
        let _ = self.kv.delete_expect_revision(&self.key, Some(self.revision)).await;
        self.left = true;
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if self.left {
            return;
        }
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let (kv, key, revision) = (self.kv.clone(), std::mem::take(&mut self.key), self.revision);
            rt.spawn(async move {
                let _ = kv.delete_expect_revision(&key, Some(revision)).await;
            });
        }
    }
}

/// The permit of one running step, for its whole life: taken before the step starts,
/// renewed in the background, given back for as long as the step waits on another fleet
/// (so that a step that delegates cannot deadlock the cap: issue #11), taken again before
/// it goes on, and released at its end.
pub struct StepPermit {
    sem: Semaphore,
    holder: Holder,
    current: tokio::sync::Mutex<Option<Permit>>,
    lost: CancellationToken,
    renewer: tokio::task::JoinHandle<()>,
}

impl StepPermit {
    /// Waits in line for a permit for `holder` (see [`Semaphore::acquire`]) and starts
    /// renewing it every third of the lease.
    ///
    /// # Errors
    /// As [`Semaphore::acquire`].
    pub async fn acquire(
        sem: &Semaphore,
        holder: Holder,
        cancel: &CancellationToken,
    ) -> Result<Arc<StepPermit>, Error> {
        let permit = sem.acquire(&holder, cancel).await?;
        Ok(Arc::new_cyclic(|me: &std::sync::Weak<StepPermit>| {
            let me = me.clone();
            let every = sem.lease / 3;
            let renewer = tokio::spawn(async move {
                let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
                loop {
                    tick.tick().await;
                    let Some(step) = me.upgrade() else { return };
                    let current = step.current.lock().await;
                    let Some(permit) = current.as_ref() else { continue };
                    match permit.renew().await {
                        Ok(()) => {}
                        Err(Error::Lost(key)) => {
                            tracing::warn!(%key, task_id = %step.holder.task_id, "fan-out permit lost: the step stops");
                            step.lost.cancel();
                            return;
                        }
                        Err(e) => tracing::warn!(error = %e, "renewing a fan-out permit failed; retrying"),
                    }
                }
            });
            StepPermit {
                sem: sem.clone(),
                holder,
                current: tokio::sync::Mutex::new(Some(permit)),
                lost: CancellationToken::new(),
                renewer,
            }
        }))
    }

    /// Fires when the permit was lost (the worker stalled past the lease): the step must
    /// stop, and its end must not be written.
    pub fn lost(&self) -> CancellationToken {
        self.lost.clone()
    }

    /// Whether the step may still write its end: `false` when the permit was lost (the
    /// worker stalled past the lease and the slot expired, whether or not another step took
    /// it since). Checks with one renewal now, so a step whose work ended while its worker
    /// was stopped does not write an end it ran without a permit for. A renewal that cannot
    /// reach JetStream counts as held (the terminal write retries through an outage).
    pub async fn still_held(&self) -> bool {
        if self.lost.is_cancelled() {
            return false;
        }
        let current = self.current.lock().await;
        match current.as_ref() {
            None => true,
            Some(permit) => match permit.renew().await {
                Err(Error::Lost(_)) => {
                    self.lost.cancel();
                    false
                }
                Ok(()) | Err(_) => true,
            },
        }
    }

    /// The slot held now, if any.
    pub async fn slot(&self) -> Option<u32> {
        self.current.lock().await.as_ref().map(Permit::slot)
    }

    /// Gives the permit back while `work` runs (the step waits on another fleet and makes
    /// no model call meanwhile), then waits in line for one again.
    ///
    /// # Errors
    /// [`Error::Cancelled`] when `cancel` fires while waiting to take a permit again; the
    /// step must then stop. [`Error::Nats`] as [`Semaphore::acquire`].
    pub async fn while_away<F: std::future::Future>(
        &self,
        cancel: &CancellationToken,
        work: F,
    ) -> Result<F::Output, Error> {
        {
            let mut current = self.current.lock().await;
            if let Some(permit) = current.take()
                && let Err(e) = permit.release().await
            {
                tracing::warn!(error = %e, "giving back a fan-out permit failed; it expires with its lease");
            }
        }
        let out = work.await;
        let permit = self.sem.acquire(&self.holder, cancel).await?;
        *self.current.lock().await = Some(permit);
        Ok(out)
    }

    /// Stops renewing and gives the permit back (a permit that was lost meanwhile is left
    /// to its new holder).
    pub async fn release(&self) {
        self.renewer.abort();
        if let Some(permit) = self.current.lock().await.take()
            && let Err(e) = permit.release().await
        {
            tracing::warn!(error = %e, "giving back a fan-out permit failed; it expires with its lease");
        }
    }
}

/// Reads permits in use, holders and waiting steps (for `mur cluster status` and
/// `mur fleet status`, issue #11 §The fan-out cap).
///
/// # Errors
/// [`Error::Nats`] when the bucket cannot be read.
pub async fn status(kv: &kv::Store) -> Result<fanout::FanoutStatus, Error> {
    let mut latest: std::collections::BTreeMap<String, (u64, Vec<u8>)> = std::collections::BTreeMap::new();
    crate::read::latest(kv, ">", |entry| {
        if entry.operation == Operation::Put {
            latest.insert(entry.key, (entry.revision, entry.value.to_vec()));
        } else {
            latest.remove(&entry.key);
        }
    })
    .await
    .map_err(|e| Error::Nats(e.to_string()))?;
    let entries: Vec<(String, u64, Vec<u8>)> = latest.into_iter().map(|(k, (r, v))| (k, r, v)).collect();
    Ok(fanout::FanoutStatus::build(&entries))
}

/// A held permit: slot `slot` of the semaphore at revision `revision`.
pub struct Permit {
    kv: kv::Store,
    key: String,
    slot: u32,
    value: Vec<u8>,
    revision: AtomicU64,
    lost: CancellationToken,
    /// Set once [`Permit::release`] went through: a drop then has nothing to give back.
    released: AtomicBool,
}

/// A permit dropped without [`Permit::release`] (its holder's future was dropped between
/// taking it and keeping it, e.g. `job_status` taking its permit back when its call is
/// dropped on a cancel) gives it back from the drop, in the background, instead of leaving
/// it unrenewed until the lease ends. Expecting the holder's revision, this changes
/// nothing when the permit was lost or given back already.
impl Drop for Permit {
    fn drop(&mut self) {
        if self.released.load(Ordering::SeqCst) {
            return;
        }
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let (kv, key, revision) = (self.kv.clone(), std::mem::take(&mut self.key), self.revision());
            rt.spawn(async move {
                let _ = kv.delete_expect_revision(&key, Some(revision)).await;
            });
        }
    }
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

    /// Gives the permit back. Only the holder's revision is deleted: when the slot expired
    /// and another step took it, this changes nothing and says so with `Ok(false)`.
    ///
    /// # Errors
    /// [`Error::Nats`] when JetStream cannot be reached (the permit then expires within
    /// the lease).
    pub async fn release(&self) -> Result<bool, Error> {
        match self.kv.delete_expect_revision(&self.key, Some(self.revision())).await {
            Ok(()) => {
                self.released.store(true, Ordering::SeqCst);
                Ok(true)
            }
            Err(e) if e.kind() == kv::DeleteErrorKind::WrongLastRevision => {
                self.released.store(true, Ordering::SeqCst);
                Ok(false)
            }
            Err(e) => Err(nats(e)),
        }
    }
}
