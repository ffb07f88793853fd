//! The kill-switch as a run in flight sees it (issue #29 item 4; the fleet-loops seed,
//! §Kill-switch): stop means stop. While a run is carried out, [`watch`] reads its fleet's
//! sentinel every [`POLL`] and raises the run's [`HaltFlag`]; the executor reads the
//! sentinel itself ([`read`]) right before it submits a step's task — so no step starts
//! once `mur fleet stop` has answered — checks the flag before every iteration, rank and
//! attempt, and while it waits for a step (with [`Halt::Cancel`] the step's task is
//! canceled through the task API, which kills its commands as `mur task cancel` does).
//! A run that saw the flag raised ends `stopped`, whatever its iteration came to.
//!
//! The sentinel is read with a direct get (no consumer is created). A sentinel that does
//! not parse cancels (fail closed, the design's invariant 6); a read that fails changes
//! nothing here — the check before the next iteration treats it as a stop, as before.

use crate::fleet::api::Fleets;
use mur_proto::fleet_store::{self, Sentinel};
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;
use tokio_util::task::AbortOnDropHandle;

/// How often a running run reads its fleet's sentinel.
pub(super) const POLL: Duration = Duration::from_millis(250);

/// What the kill-switch asks of a run in flight; it only ever rises.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Halt {
    /// Not stopped.
    Go = 0,
    /// `mur fleet stop --drain`: nothing new starts; running steps finish.
    Drain = 1,
    /// `mur fleet stop`: nothing new starts; running steps are canceled.
    Cancel = 2,
}

/// A run's [`Halt`], shared by its executor and its [`watch`].
#[derive(Clone, Debug, Default)]
pub(super) struct HaltFlag(Arc<AtomicU8>);

impl HaltFlag {
    /// The halt asked for so far.
    pub(super) fn get(&self) -> Halt {
        match self.0.load(Ordering::Acquire) {
            0 => Halt::Go,
            1 => Halt::Drain,
            _ => Halt::Cancel,
        }
    }

    /// Whether anything was asked: no iteration, rank, step or attempt may start.
    pub(super) fn raised(&self) -> bool {
        self.get() != Halt::Go
    }

    /// Raises the flag to `halt` (never lowers it: a `mur fleet start` during the run does
    /// not undo a stop the run has begun to carry out).
    pub(super) fn raise(&self, halt: Halt) {
        self.0.fetch_max(halt as u8, Ordering::AcqRel);
    }
}

/// The halt a sentinel key's value asks for: none when absent, [`Halt::Drain`] for a
/// `--drain` sentinel, [`Halt::Cancel`] for any other value, one that does not parse
/// included.
pub(super) fn halt_of(value: Option<&[u8]>) -> Halt {
    match value.map(serde_json::from_slice::<Sentinel>) {
        None => Halt::Go,
        Some(Ok(Sentinel { drain: true, .. })) => Halt::Drain,
        Some(_) => Halt::Cancel,
    }
}

/// Reads `fleet`'s sentinel now and raises `flag` by it; whether anything was asked so
/// far. A read that fails changes nothing.
pub(super) async fn read(fleets: &Fleets, fleet: &str, flag: &HaltFlag) -> bool {
    match fleets.defs().get(fleet_store::stopped_key(fleet)).await {
        Ok(value) => {
            let halt = halt_of(value.as_deref());
            if halt > flag.get() {
                tracing::info!(fleet, ?halt, "the kill-switch was set: stopping the run");
            }
            flag.raise(halt);
        }
        Err(e) => tracing::debug!(fleet, "reading the kill-switch: {e}"),
    }
    flag.raised()
}

/// Reads `fleet`'s sentinel every [`POLL`] and raises `flag` by it, until the returned
/// handle is dropped.
pub(super) fn watch(fleets: Fleets, fleet: String, flag: HaltFlag) -> AbortOnDropHandle<()> {
    AbortOnDropHandle::new(tokio::spawn(async move {
        let mut tick = tokio::time::interval(POLL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            read(&fleets, &fleet, &flag).await;
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sentinel_drains_only_when_it_says_so_and_an_unparsable_one_cancels() {
        assert_eq!(halt_of(None), Halt::Go);
        assert_eq!(halt_of(Some(br#"{"at":1,"by":"ann"}"#)), Halt::Cancel);
        assert_eq!(halt_of(Some(br#"{"at":1,"by":"ann","drain":true}"#)), Halt::Drain);
        assert_eq!(halt_of(Some(b"stopped")), Halt::Cancel);
    }

    #[test]
    fn the_flag_only_rises() {
        let flag = HaltFlag::default();
        assert!(!flag.raised());
        flag.raise(Halt::Drain);
        assert_eq!(flag.get(), Halt::Drain);
        flag.raise(Halt::Cancel);
        flag.raise(Halt::Drain);
        flag.raise(Halt::Go);
        assert_eq!(flag.get(), Halt::Cancel);
    }
}
