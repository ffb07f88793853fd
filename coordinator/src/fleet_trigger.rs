//! Triggers firing unattended (issue #10 §Runs and loops, the fleet-loops seed, §Unattended
//! runs, ref §5 "autorun"): every second the leader looks at each fleet's `loop.trigger` and
//! starts a loop run (as `mur fleet run NAME --loop` would, with no flags) for each fleet
//! that is due. All of these must hold (fail closed):
//!
//! - autorun is on: `MUR_FLEET_AUTORUN` is `1`, `true` or `yes` (any case) on the
//!   coordinator, or the cluster config has `fleet.autorun: true` (default off);
//! - the kill-switch is clear (a sentinel that cannot be read counts as set);
//! - no run of the fleet is in progress (one run per fleet at a time: a trigger never
//!   starts a loop beside another, ref §8 (f));
//! - the trigger is due ([`due`]); the fleet's bounds resolve (else the run is refused and
//!   the refusal logged).
//!
//! The last firing is kept in `mur_fleets` key `lastrun.<fleet>` (unix ms), stamped before
//! the launch, so a new leader goes on from it.

use crate::fleet_run::{self, Env, OverCache};
use crate::fleets::now_ms;
use futures::StreamExt;
use mur_proto::fleet::{self, Fleet, Trigger};
use mur_proto::fleet_store::{self, RunRecord, RunRequest};
use std::collections::BTreeSet;
use std::time::Duration;
use tokio::sync::watch;

/// How often the leader looks at the triggers.
const TICK: Duration = Duration::from_secs(1);

/// A cron trigger's last run is never taken as older than this, so downtime does not
/// replay missed boundaries (ref §5), ms.
const CRON_CATCH_UP_MS: u64 = 90_000;

/// What a trigger says at `now` given when it last fired (unix ms).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Due {
    /// Start a run.
    Fire,
    /// A cron trigger seen for the first time: stamp now as its baseline, fire at the next
    /// boundary (never on enable).
    Baseline,
    /// Nothing to do.
    No,
}

/// The due rules of ref §5: `interval:<d>` fires when it never ran or `d` has passed since
/// it last did; `cron:` fires when a boundary passed since it last did (its last run
/// clamped to 90 s ago); `manual` and a stored trigger that no longer parses never fire.
pub fn due(trigger: &Trigger, last_run: Option<u64>, now: u64) -> Due {
    match (trigger, last_run) {
        (Trigger::Interval(d), None) if !d.duration.is_zero() => Due::Fire,
        (Trigger::Interval(d), Some(last)) if !d.duration.is_zero() => {
            if now.saturating_sub(last) >= d.duration.as_millis() as u64 { Due::Fire } else { Due::No }
        }
        (Trigger::Cron(_), None) => Due::Baseline,
        (Trigger::Cron(cron), Some(last)) => {
            let from = last.max(now.saturating_sub(CRON_CATCH_UP_MS));
            match cron.next_after(from) {
                Some(next) if next <= now => Due::Fire,
                _ => Due::No,
            }
        }
        _ => Due::No,
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
        if enabled && let Err(e) = tick(&env, &mut over).await {
            tracing::warn!(instance = %env.instance, "fleet triggers: {e}");
        }
    }
}

async fn tick(env: &Env, over: &mut OverCache) -> Result<(), String> {
    let defs = env.fleets.defs().clone();
    let mut keys = defs.keys().await.map_err(|e| e.to_string())?;
    let (mut fleets, mut runs) = (Vec::new(), Vec::new());
    while let Some(Ok(key)) = keys.next().await {
        if let Some(name) = fleet_store::fleet_of_def_key(&key) {
            fleets.push(name.to_string());
        } else if key.starts_with("run.") && !over.contains(&key) {
            runs.push(key);
        }
    }
    // Fleets with a run in progress (running, alive or not yet taken over).
    let mut busy = BTreeSet::new();
    for key in runs {
        if let Ok(Some(v)) = defs.get(&key).await
            && let Ok(r) = serde_json::from_slice::<RunRecord>(&v)
        {
            if r.is_over() {
                over.insert(key);
            } else {
                busy.insert(r.fleet);
            }
        }
    }
    let now = now_ms();
    for name in fleets {
        if busy.contains(&name) {
            continue;
        }
        let Ok((_, text)) = env.fleets.definition(&name).await else { continue };
        let Ok(f) = Fleet::load_stored(&text) else { continue };
        if matches!(f.r#loop.trigger, Trigger::Manual | Trigger::Never(_)) {
            continue;
        }
        if env.fleets.stop_state(&name).await.is_stopped() {
            continue;
        }
        let key = fleet_store::last_run_key(&name);
        let last = defs.get(&key).await.ok().flatten().and_then(|v| std::str::from_utf8(&v).ok()?.parse::<u64>().ok());
        match due(&f.r#loop.trigger, last, now) {
            Due::No => {}
            Due::Baseline => {
                let _ = defs.put(&key, now.to_string().into()).await;
            }
            Due::Fire => {
                // Stamped before the launch: a launch that fails is not retried every tick.
                if let Err(e) = defs.put(&key, now.to_string().into()).await {
                    tracing::warn!(fleet = %name, "stamping the trigger's run: {e}");
                    continue;
                }
                let request = RunRequest {
                    fleet: name.clone(),
                    job: None,
                    looping: true,
                    deadline: None,
                    budget_usd: None,
                    run_id: None,
                };
                match fleet_run::launch(env, request).await {
                    Ok(r) => {
                        tracing::info!(fleet = %name, run = %r.run_id, "trigger {} fired", f.r#loop.trigger.as_text())
                    }
                    Err(e) => tracing::warn!(fleet = %name, "trigger {}: run refused: {e}", f.r#loop.trigger.as_text()),
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_interval_fires_when_never_run_or_once_its_duration_has_passed() {
        let t = Trigger::parse("interval:10s").unwrap();
        assert_eq!(due(&t, None, 5_000), Due::Fire);
        assert_eq!(due(&t, Some(5_000), 14_999), Due::No);
        assert_eq!(due(&t, Some(5_000), 15_000), Due::Fire);
        assert_eq!(due(&t, Some(20_000), 15_000), Due::No, "a last run in the future (clock skew)");
        assert_eq!(due(&Trigger::Manual, None, 5_000), Due::No);
        assert_eq!(due(&Trigger::Never("cron:0 9 31 2 *".into()), None, 5_000), Due::No);
    }

    #[test]
    fn a_cron_first_stamps_a_baseline_then_fires_at_each_boundary_without_replaying_downtime() {
        let t = Trigger::parse("cron:0 * * * *").unwrap();
        let hour = 3_600_000;
        let base = 1_000 * hour + 60_000; // 1 minute past an hour boundary
        assert_eq!(due(&t, None, base), Due::Baseline);
        assert_eq!(due(&t, Some(base), base + 30_000), Due::No);
        assert_eq!(due(&t, Some(base), base + hour - 60_000), Due::Fire, "the next boundary");
        // Down for a day: the missed boundaries are not replayed; the next one fires.
        let later = base + 24 * hour + 10 * 60_000;
        assert_eq!(due(&t, Some(base), later), Due::No);
        assert_eq!(due(&t, Some(base), later + 50 * 60_000), Due::Fire);
    }
}
