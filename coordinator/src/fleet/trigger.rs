//! Triggers firing unattended (issue #10 §Runs and loops, the fleet-loops seed, §Unattended
//! runs, ref §5 "autorun"; issue #36): every second the leader looks at each fleet's
//! `loop.trigger` and hands what it sees to the pure [`crate::fleet::schedule::step`], then
//! carries out what it says — a loop run started as `mur fleet run NAME --loop` would with
//! no flags, a run asked to stop (`cancel_previous`), a line on the fleet's channel.
//! Scheduled occurrences count only when all of these hold (fail closed):
//!
//! - autorun is on: `MUR_FLEET_AUTORUN` is `1`, `true` or `yes` (any case) on the
//!   coordinator, or the cluster config has `fleet.autorun: true` (default off);
//! - the kill-switch is clear (a sentinel that cannot be read counts as set);
//! - the trigger is not paused after failures; the fleet's bounds resolve (else the start
//!   is refused, and that counts as a failed run).
//!
//! An occurrence asked for by `mur fleet trigger` counts with autorun off and while paused.
//! A run of the fleet in progress (one run per fleet at a time, ref §8 (f)) meets
//! `loop.overlap`.
//!
//! The trigger's state is `mur_fleets` key `lastrun.<fleet>` ([`fleet_schedule::State`],
//! JSON). Every change is a compare-and-set on the revision read, written before anything
//! is carried out: an occurrence is claimed (with its run id) before its run starts, so of
//! two coordinators that saw it due one claims it and the other does nothing, and a leader
//! that dies between claim and start leaves a claim the next one starts under the same id.

use crate::fleet::run::{self as fleet_run, Env, OverCache};
use crate::fleet::schedule::{self as fleet_schedule, Action, Outcome, Seen, State};
use async_nats::jetstream::kv;
use mur_nats::clock::{Clock, SystemClock};
use mur_proto::fleet::{self, Fleet, Trigger};
use mur_proto::fleet_store::{self, ChannelEvent, EventKind, RunRecord, RunRequest};
use std::collections::BTreeMap;
use std::time::Duration;
use tokio::sync::watch;

/// How often the leader looks at the triggers.
const TICK: Duration = Duration::from_secs(1);

/// A trigger state as read, with the revision a write must match (`None`: no key yet).
#[derive(Clone, Debug, Default)]
pub struct Stored {
    /// The key's revision (a delete marker's too), `None` when it never existed.
    pub revision: Option<u64>,
    /// The state (default when absent, deleted or unreadable).
    pub state: State,
}

/// Why a trigger state was not written.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    /// Another writer changed it since it was read (another coordinator claimed the
    /// occurrence, `mur fleet trigger` or `start` wrote meanwhile): nothing was written.
    #[error("lastrun.{0} changed since it was read")]
    Changed(String),
    /// The bucket refused.
    #[error("lastrun.{fleet}: {error}")]
    Store {
        /// The fleet.
        fleet: String,
        /// What the bucket said.
        error: String,
    },
}

/// Reads `fleet`'s trigger state.
///
/// # Errors
/// The bucket cannot be read.
pub async fn read_state(defs: &kv::Store, fleet: &str) -> Result<Stored, kv::EntryError> {
    let Some(entry) = defs.entry(fleet_store::last_run_key(fleet)).await? else { return Ok(Stored::default()) };
    let state = if entry.operation == kv::Operation::Put {
        State::decode(&entry.value).unwrap_or_else(|e| {
            tracing::warn!(fleet, "lastrun.{fleet} does not parse ({e}); starting from an empty state");
            State::default()
        })
    } else {
        State::default()
    };
    Ok(Stored { revision: Some(entry.revision), state })
}

/// Writes `state` for `fleet` if the key is still at `revision` (a compare-and-set; `None`
/// creates it), and returns the new revision.
///
/// # Errors
/// [`WriteError::Changed`] when another write came first; [`WriteError::Store`].
pub async fn write_state(
    defs: &kv::Store,
    fleet: &str,
    revision: Option<u64>,
    state: &State,
) -> Result<u64, WriteError> {
    let key = fleet_store::last_run_key(fleet);
    let value = state.encode().into();
    let store = |e: String| WriteError::Store { fleet: fleet.to_string(), error: e };
    match revision {
        Some(rev) => defs.update(&key, value, rev).await.map_err(|e| match e.kind() {
            kv::UpdateErrorKind::WrongLastRevision => WriteError::Changed(fleet.to_string()),
            _ => store(e.to_string()),
        }),
        None => defs.create(&key, value).await.map_err(|e| match e.kind() {
            kv::CreateErrorKind::AlreadyExists => WriteError::Changed(fleet.to_string()),
            _ => store(e.to_string()),
        }),
    }
}

/// Fires due triggers until `stopped` (the leader stepping down).
pub async fn serve(env: Env, mut stopped: watch::Receiver<bool>) -> &'static str {
    let enabled = fleet::autorun_enabled(&|k| std::env::var(k).ok(), env.settings.autorun);
    tracing::info!(instance = %env.instance, enabled, "fleet triggers");
    let mut over = OverCache::new();
    loop {
        over.expire();
        tokio::select! {
            _ = stopped.changed() => return "the fleet trigger loop",
            () = tokio::time::sleep(TICK) => {}
        }
        if let Err(e) = tick(&env, &mut over, enabled).await {
            tracing::warn!(instance = %env.instance, "fleet triggers: {e}");
        }
    }
}

async fn tick(env: &Env, over: &mut OverCache, autorun: bool) -> Result<(), String> {
    let defs = env.fleets.defs().clone();
    let keys = mur_nats::read::keys(&defs, ">").await.map_err(|e| e.to_string())?;
    let (mut fleets, mut runs) = (Vec::new(), Vec::new());
    for key in keys {
        if let Some(name) = fleet_store::fleet_of_def_key(&key) {
            fleets.push(name.to_string());
        } else if key.starts_with("run.") && !over.contains(&key) {
            runs.push(key);
        }
    }
    // The run in progress of each fleet that has one (running, alive or not yet taken over).
    let mut going = BTreeMap::new();
    for key in runs {
        if let Ok(Some(v)) = defs.get(&key).await
            && let Ok(r) = serde_json::from_slice::<RunRecord>(&v)
        {
            if r.is_over() {
                over.insert(key);
            } else {
                going.insert(r.fleet, r.run_id);
            }
        }
    }
    for name in fleets {
        if let Err(e) = fleet_tick(env, &name, going.get(&name).map(String::as_str), autorun).await {
            tracing::warn!(fleet = %name, "trigger: {e}");
        }
    }
    Ok(())
}

/// One fleet's tick: read, step, claim (compare-and-set), carry out.
async fn fleet_tick(env: &Env, name: &str, going: Option<&str>, autorun: bool) -> Result<(), String> {
    let defs = env.fleets.defs();
    let Ok((_, text)) = env.fleets.definition(name).await else { return Ok(()) };
    let Ok(f) = Fleet::load_stored(&text) else { return Ok(()) };
    if env.fleets.stop_state(name).await.is_stopped() {
        return Ok(());
    }
    let stored = read_state(defs, name).await.map_err(|e| e.to_string())?;
    let state = &stored.state;
    let manual_only = !autorun || matches!(f.r#loop.trigger, Trigger::Manual | Trigger::Never(_));
    if manual_only && state.manual.is_none() && state.claim.is_none() && state.running.is_none() {
        return Ok(());
    }
    // The trigger's run: the claimed one, else the one it saw start.
    let ours = state.claim.as_ref().map(|c| c.run_id.as_str()).or(state.running.as_deref());
    let record = match ours {
        Some(id) => defs
            .get(fleet_store::run_key(id))
            .await
            .map_err(|e| e.to_string())?
            .and_then(|v| serde_json::from_slice::<RunRecord>(&v).ok()),
        None => None,
    };
    let claim_started = state.claim.is_some() && record.is_some();
    let ended = match (&record, state.claim.is_some()) {
        (Some(r), _) if r.is_over() => Some(if r.state == "failed" { Outcome::Failed } else { Outcome::Ok }),
        (Some(_), _) | (None, true) => None,
        (None, false) => ours.map(|_| Outcome::Ok), // its record is gone
    };
    let fresh = fleet::loop_run_id(name, uuid::Uuid::now_v7());
    let seen = Seen { now: SystemClock.now_ms(), autorun, going, ended, claim_started, fresh_run_id: &fresh };
    let (next, actions) = fleet_schedule::step(state, &f.r#loop, &seen);
    let mut revision = stored.revision;
    if &next != state {
        match write_state(defs, name, revision, &next).await {
            Ok(rev) => revision = Some(rev),
            // Someone else wrote first: carry nothing out; the next tick reads theirs.
            Err(WriteError::Changed(_)) => return Ok(()),
            Err(e) => return Err(e.to_string()),
        }
    }
    let mut state = next;
    for action in actions {
        match action {
            Action::Note(text) => note(env, name, text).await,
            Action::Cancel { run_id } => {
                if let Err(e) =
                    defs.put(fleet_store::cancel_key(&run_id), SystemClock.now_ms().to_string().into()).await
                {
                    tracing::warn!(fleet = %name, run = %run_id, "asking the run to stop: {e}");
                }
            }
            Action::Start { occurrence, run_id } => {
                let request = RunRequest {
                    fleet: name.to_string(),
                    job: None,
                    looping: true,
                    deadline: None,
                    budget_usd: None,
                    run_id: Some(run_id.clone()),
                };
                match fleet_run::launch(env, request, None).await {
                    Ok(r) => tracing::info!(
                        fleet = %name, run = %r.run_id, occurrence,
                        "trigger {} fired", f.r#loop.trigger.as_text()
                    ),
                    Err(e) => {
                        tracing::warn!(fleet = %name, "trigger {}: run refused: {e}", f.r#loop.trigger.as_text());
                        let (refused, notes) =
                            fleet_schedule::start_refused(&state, &f.r#loop, SystemClock.now_ms(), &e.to_string());
                        match write_state(defs, name, revision, &refused).await {
                            Ok(rev) => revision = Some(rev),
                            Err(e) => return Err(e.to_string()),
                        }
                        state = refused;
                        for n in notes {
                            if let Action::Note(text) = n {
                                note(env, name, text).await;
                            }
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

/// A trigger's line on the fleet's channel (a skipped occurrence, a pause …), logged too.
async fn note(env: &Env, fleet: &str, text: String) {
    tracing::info!(fleet, "trigger: {text}");
    let event = ChannelEvent::system(EventKind::Note, format!("trigger: {text}"), SystemClock.now_ms());
    if let Err(e) = env.fleets.publish(fleet, &event).await {
        tracing::warn!(fleet, "channel event not written: {e}");
    }
}
