//! The leader lease (issue #8 §Standby coordinators; the design, `mur_leader`): several
//! coordinators may run; the one holding the lease releases tasks, the others stand by.
//!
//! - The lease is the key [`cluster::LEADER_KEY`] of [`cluster::LEADER_BUCKET`], whose max
//!   age is the lease's time to live: a value not renewed within it expires, whoever wrote
//!   it.
//! - **Acquire**: create the key (only succeeds when it is absent: never held, or
//!   expired). The key's revision then is the holder's *term*, kept in the value.
//! - **Renew**: every third of the time to live, update the key with compare-and-set on
//!   the last revision the holder wrote. A failed compare-and-set means someone else
//!   wrote it: the lease is lost.
//! - **Fence**: the holder acts (releases a task) only while [`Held::is_valid`]: a
//!   renewal (or the acquisition) was *sent* less than three quarters of the time to live
//!   ago. The server ages the value from when it stored it, which is after the holder sent
//!   it, so the value cannot expire — and no standby can take the lease — while the holder
//!   still believes it valid. A holder that cannot renew in time (partitioned, stalled)
//!   stops acting before the lease can pass to another; two never act as leader at once.
//! - **Take back**: a value this very process wrote (its [`LeaderLease::process`]) found
//!   under the key when it tries to acquire is from a term of its own that is over (it
//!   stepped down: its renewals failed). It is replaced with a compare-and-set on its
//!   revision, a new term, rather than waited out. After a broker outage longer than the
//!   lease the value outlives the outage by up to a lease's time to live (the server ages
//!   it from its restart): a breaker saw ~14 s without a leader. Another process's value,
//!   even one under the same instance name (a restart), is waited out as before.

use async_nats::jetstream::kv;
use mur_nats::clock::{Clock, SystemClock};
use mur_proto::cluster::{self, LeaderLease, StandbyStatus};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// A coordinator's handle on the lease.
pub struct Lease {
    kv: kv::Store,
    instance: String,
    /// This process's id in the values it writes ([`LeaderLease::process`]).
    process: String,
    ttl: Duration,
}

/// The lease while this coordinator holds it.
pub struct Held {
    /// The term: the key's revision at acquisition.
    pub term: u64,
    since: u64,
    state: Mutex<(u64, Instant)>,
    valid_for: Duration,
}

impl Held {
    /// Whether this holder may act now (see the module docs: fencing).
    pub fn is_valid(&self) -> bool {
        self.state.lock().expect("lease lock").1.elapsed() < self.valid_for
    }

    fn revision(&self) -> u64 {
        self.state.lock().expect("lease lock").0
    }
}

/// Why the lease was given up.
#[derive(Debug, thiserror::Error)]
pub enum Lost {
    /// Another coordinator wrote the key (or it could not be read to tell).
    #[error("the lease was taken by another coordinator")]
    Taken,
    /// No renewal got through in time.
    #[error("the lease could not be renewed in time: {0}")]
    Expired(String),
}

impl Lease {
    /// A handle for `instance` on `kv` (the `mur_leader` bucket) with time to live `ttl`
    /// (the bucket's max age).
    pub fn new(kv: kv::Store, instance: impl Into<String>, ttl: Duration) -> Lease {
        Lease { kv, instance: instance.into(), process: uuid::Uuid::now_v7().to_string(), ttl }
    }

    /// How often the holder renews, and a standby tries to take the lease.
    pub fn renew_every(&self) -> Duration {
        self.ttl / 3
    }

    /// Tries once to take the lease; `Ok(None)` when another coordinator holds it.
    ///
    /// # Errors
    /// A NATS error other than "the key exists".
    pub async fn try_acquire(&self) -> Result<Option<Held>, String> {
        let sent = Instant::now();
        // The term is the revision the create gets; write it in a second step, fenced.
        let since = SystemClock.now_ms();
        match self.kv.create(cluster::LEADER_KEY, self.value(0, since).into()).await {
            Ok(revision) => self.stamp(revision, sent, since).await.map(Some),
            Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => self.take_back().await,
            Err(e) => Err(format!("{}: create: {e}", cluster::LEADER_BUCKET)),
        }
    }

    /// The value of a lease of term `term` taken at `since` (unix ms).
    fn value(&self, term: u64, since: u64) -> Vec<u8> {
        let lease = LeaderLease { instance: self.instance.clone(), term, since, process: Some(self.process.clone()) };
        serde_json::to_vec(&lease).expect("lease JSON")
    }

    /// The lease just taken at `revision` (its term; the write sent at `sent`): stamps the
    /// term into the value, a renewal.
    async fn stamp(&self, revision: u64, sent: Instant, since: u64) -> Result<Held, String> {
        let held =
            Held { term: revision, since, state: Mutex::new((revision, sent)), valid_for: self.ttl.mul_f64(0.75) };
        let sent = Instant::now();
        match self.kv.update(cluster::LEADER_KEY, self.value(revision, since).into(), revision).await {
            Ok(r) => *held.state.lock().expect("lease lock") = (r, sent),
            Err(e) => return Err(format!("{}: stamping the term: {e}", cluster::LEADER_BUCKET)),
        }
        Ok(held)
    }

    /// Takes the lease back when the value under the key is this process's own, from a
    /// term that is over (see the module docs); `Ok(None)` when it is another's, or moved
    /// on meanwhile. Called only between terms: a process tries to acquire only while it
    /// does not lead.
    async fn take_back(&self) -> Result<Option<Held>, String> {
        let entry =
            self.kv.entry(cluster::LEADER_KEY).await.map_err(|e| format!("{}: read: {e}", cluster::LEADER_BUCKET))?;
        let Some(entry) = entry.filter(|e| e.operation == kv::Operation::Put) else { return Ok(None) };
        let ours = serde_json::from_slice::<LeaderLease>(&entry.value)
            .is_ok_and(|lease| lease.instance == self.instance && lease.process.as_deref() == Some(&self.process));
        if !ours {
            return Ok(None);
        }
        let (sent, since) = (Instant::now(), SystemClock.now_ms());
        match self.kv.update(cluster::LEADER_KEY, self.value(0, since).into(), entry.revision).await {
            Ok(revision) => {
                tracing::info!(instance = %self.instance, "taking back this process's own lease of an earlier term");
                self.stamp(revision, sent, since).await.map(Some)
            }
            Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => Ok(None),
            Err(e) => Err(format!("{}: taking back: {e}", cluster::LEADER_BUCKET)),
        }
    }

    /// Renews `held` once.
    ///
    /// # Errors
    /// [`Lost::Taken`] when the key moved on; [`Lost::Expired`] when the renewal failed
    /// and the lease is no longer valid.
    pub async fn renew(&self, held: &Held) -> Result<(), Lost> {
        let sent = Instant::now();
        let value = self.value(held.term, held.since);
        match self.kv.update(cluster::LEADER_KEY, value.into(), held.revision()).await {
            Ok(revision) => {
                *held.state.lock().expect("lease lock") = (revision, sent);
                Ok(())
            }
            // The key moved on: another holder wrote it, or it expired unrenewed (this holder
            // stalled past the lease) and nobody took it yet: either way it is lost.
            Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => match Lease::holder(&self.kv).await {
                Ok(None) => Err(Lost::Expired("the lease expired before it was renewed".into())),
                _ => Err(Lost::Taken),
            },
            Err(e) if held.is_valid() => {
                tracing::warn!(instance = %self.instance, "renewing the lease failed, will retry: {e}");
                Ok(())
            }
            Err(e) => Err(Lost::Expired(e.to_string())),
        }
    }

    /// Keeps `held` renewed until it is lost (returns why) — never returns otherwise.
    pub async fn keep(&self, held: &Held) -> Lost {
        let mut tick = tokio::time::interval(self.renew_every());
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tick.tick().await;
            if let Err(lost) = self.renew(held).await {
                return lost;
            }
            if !held.is_valid() {
                return Lost::Expired("renewals are late".into());
            }
        }
    }

    /// Gives the lease up at once (a clean shutdown), so a standby need not wait for it
    /// to expire. Only deletes the key if this holder wrote its last revision.
    pub async fn release(&self, held: &Held) {
        if let Err(e) = self.kv.delete_expect_revision(cluster::LEADER_KEY, Some(held.revision())).await {
            tracing::debug!(instance = %self.instance, "giving up the lease: {e}");
        }
    }

    /// Says this coordinator stands by: writes its [`StandbyStatus`] under
    /// `standby.<process>` ([`cluster::STANDBY_KEY_PREFIX`]). A standby writes it every
    /// renewal interval; the bucket's max age (the lease's time to live) drops it once
    /// it stops.
    ///
    /// # Errors
    /// The bucket's error.
    pub async fn stand_by(&self) -> Result<(), String> {
        let value = StandbyStatus { instance: self.instance.clone(), at: SystemClock.now_ms() };
        let value = serde_json::to_vec(&value).expect("standby JSON");
        self.kv
            .put(self.standby_key(), value.into())
            .await
            .map(|_| ())
            .map_err(|e| format!("{}: {e}", cluster::LEADER_BUCKET))
    }

    /// Stops saying this coordinator stands by (it took the lease, or stops): purges its
    /// key. Best effort: a key left behind ages out with the bucket's max age.
    pub async fn stop_standing_by(&self) {
        if let Err(e) = self.kv.purge(self.standby_key()).await {
            tracing::debug!(instance = %self.instance, "{}: removing the standby key: {e}", cluster::LEADER_BUCKET);
        }
    }

    fn standby_key(&self) -> String {
        format!("{}{}", cluster::STANDBY_KEY_PREFIX, self.process)
    }

    /// The coordinators standing by, by instance name then time, without the process that
    /// holds the lease (`leader`; its key may outlive its taking the lease by a moment).
    ///
    /// # Errors
    /// The bucket's error.
    pub async fn standbys(kv: &kv::Store, leader: Option<&LeaderLease>) -> Result<Vec<StandbyStatus>, String> {
        let keys = mur_nats::read::keys(kv, ">").await.map_err(|e| e.to_string())?;
        let mut standbys = Vec::new();
        for key in keys {
            let Some(process) = key.strip_prefix(cluster::STANDBY_KEY_PREFIX) else { continue };
            if leader.and_then(|l| l.process.as_deref()) == Some(process) {
                continue;
            }
            if let Some(v) = kv.get(&key).await.map_err(|e| e.to_string())?
                && let Ok(standby) = serde_json::from_slice::<StandbyStatus>(&v)
            {
                standbys.push(standby);
            }
        }
        standbys.sort_by(|a, b| (&a.instance, a.at).cmp(&(&b.instance, b.at)));
        Ok(standbys)
    }

    /// Who holds the lease now, if anyone.
    ///
    /// # Errors
    /// The bucket's error.
    pub async fn holder(kv: &kv::Store) -> Result<Option<LeaderLease>, String> {
        match kv.get(cluster::LEADER_KEY).await.map_err(|e| e.to_string())? {
            Some(v) if !v.is_empty() => Ok(serde_json::from_slice(&v).ok()),
            _ => Ok(None),
        }
    }
}
