//! Runs that outlive their coordinator (issue #11 §Jobs that outlive their coordinator): the
//! leader scans `mur_fleets` every second for run records still `running` whose heartbeat
//! (`beat.<run id>`) stopped ([`fleet_store::RUN_DEAD_AFTER_MS`]: the coordinator carrying
//! them died) and takes each over with a compare-and-set on its record, so one coordinator
//! does it once:
//!
//! - a **loop** run is adopted: the job its dead coordinator had claimed (`running`, with
//!   one of the loop's iteration run ids) is failed with the reason — what its steps did is
//!   not known, and re-running it could do the work twice — and the loop goes on here
//!   from the next iteration, on its original clock, with its spend so far;
//! - a **one-shot** run (or one recorded by a version that kept no request) is failed:
//!   its `running` job is failed with the reason, the record ends `coordinator-lost`.
//!
//! Either way a `running` job of a dead run never stays `running` (the reference's lazy
//! 6 h orphan rule, ref §4, becomes an active one here: the run is known dead within
//! seconds, not guessed dead after hours). The reason is the same text on the job, the
//! channel and the run's notices.

use crate::fleet::machine::Run;
use crate::fleet::run::{self as fleet_run, Env, OverCache};
use async_nats::jetstream::kv;
use mur_nats::clock::{Clock, SystemClock};
use mur_proto::cluster::{ApiError, ErrorCode};
use mur_proto::fleet::{Fleet, JobStatus};
use mur_proto::fleet_store::{self, ChannelEvent, EventKind, Liveness, RunRecord};
use std::time::Duration;
use tokio::sync::watch;

/// How often the leader looks for dead runs.
const SCAN_EVERY: Duration = Duration::from_secs(1);

/// The stop label of a one-shot run whose coordinator died.
pub const COORDINATOR_LOST: &str = "coordinator-lost";

/// What becomes of a dead run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Adoption {
    /// A loop: goes on here.
    Resume,
    /// A one-shot run: its job fails and the run ends [`COORDINATOR_LOST`].
    Fail,
}

/// Whether `record` (with its last heartbeat `beat`, at `now`) is a run to take over, and
/// how: `None` while it is over or its heartbeat is fresh.
pub fn orphan(record: &RunRecord, beat: Option<u64>, now: u64) -> Option<Adoption> {
    match record.liveness(beat, now) {
        Liveness::Dead { .. } if record.request.as_ref().is_some_and(|r| r.looping) => Some(Adoption::Resume),
        Liveness::Dead { .. } => Some(Adoption::Fail),
        _ => None,
    }
}

/// Why a dead run's job failed: names the dead coordinator and this one.
pub fn reason(record: &RunRecord, instance: &str, adoption: Adoption) -> String {
    let what = match adoption {
        Adoption::Resume => format!("the loop was adopted by {instance}"),
        Adoption::Fail => format!("failed by {instance}"),
    };
    format!(
        "orphaned: {} stopped while running run {} (no heartbeat for {} s); {what}",
        record.coordinator,
        record.run_id,
        fleet_store::RUN_DEAD_AFTER_MS / 1000
    )
}

/// Looks for dead runs until `stopped` (the leader stepping down).
pub async fn serve(env: Env, mut stopped: watch::Receiver<bool>) -> &'static str {
    let mut over = OverCache::new();
    loop {
        over.expire();
        tokio::select! {
            _ = stopped.changed() => return "the fleet adoption loop",
            () = tokio::time::sleep(SCAN_EVERY) => {}
        }
        if let Err(e) = scan(&env, &mut over).await {
            tracing::warn!(instance = %env.instance, "looking for dead fleet runs: {e}");
        }
    }
}

async fn scan(env: &Env, over: &mut OverCache) -> Result<(), String> {
    let defs = env.fleets.defs().clone();
    let keys = mur_nats::read::keys(&defs, "run.>").await.map_err(|e| e.to_string())?;
    let runs: Vec<String> = keys.into_iter().filter(|key| !over.contains(key)).collect();
    for key in runs {
        let Ok(Some(entry)) = defs.entry(&key).await else { continue };
        if entry.operation != kv::Operation::Put {
            continue;
        }
        let Ok(record) = serde_json::from_slice::<RunRecord>(&entry.value) else { continue };
        if record.is_over() {
            over.insert(key);
            continue;
        }
        if env.active.lock().expect("active runs poisoned").contains(&record.run_id) {
            continue;
        }
        let beat = mur_nats::fleet::read_beat(&defs, &record.run_id).await;
        if let Some(adoption) = orphan(&record, beat, SystemClock.now_ms()) {
            take_over(env, &defs, &key, entry.revision, record, adoption).await;
        }
    }
    Ok(())
}

async fn take_over(env: &Env, defs: &kv::Store, key: &str, revision: u64, dead: RunRecord, adoption: Adoption) {
    let reason = reason(&dead, &env.instance, adoption);
    let now = SystemClock.now_ms();
    let mut record = dead.clone();
    record.coordinator = env.instance.clone();
    record.updated_at = now;
    record.notices.push(reason.clone());
    // The fleet, for a loop to go on with; a fleet removed or broken meanwhile fails the run.
    let fleet = match adoption {
        Adoption::Resume => match env.fleets.definition(&dead.fleet).await {
            Ok((_, text)) => Fleet::load_stored(&text).ok(),
            Err(_) => None,
        },
        Adoption::Fail => None,
    };
    let adoption = if fleet.is_some() { adoption } else { Adoption::Fail };
    if adoption == Adoption::Fail {
        record.state = "ended".into();
        record.stop = Some(COORDINATOR_LOST.into());
        record.ended_at = Some(now);
    }
    // The compare-and-set makes this coordinator the only one taking it over.
    let Ok(json) = serde_json::to_vec(&record) else { return };
    if let Err(e) = defs.update(key, json.into(), revision).await {
        tracing::info!(run = %dead.run_id, "dead run taken over elsewhere: {e}");
        return;
    }
    tracing::warn!(instance = %env.instance, run = %dead.run_id, ?adoption, "{reason}");
    let mut in_flight = false;
    if let Ok(jobs) = env.fleets.jobs_of(&dead.fleet).await {
        for (_, job) in jobs {
            let ours = job.run_id.as_deref().is_some_and(|r| fleet_store_run_of(r, &dead.run_id));
            if job.status != JobStatus::Running || !ours {
                continue;
            }
            in_flight = true;
            let failed = env
                .fleets
                .update_job(&dead.fleet, &job.id, |j| {
                    if j.status != JobStatus::Running {
                        return Ok(());
                    }
                    j.transition(JobStatus::Failed, SystemClock.now_ms())
                        .map_err(|e| ApiError::new(ErrorCode::Conflict, e.to_string()))?;
                    j.error = Some(reason.clone());
                    Ok(())
                })
                .await;
            if let Err(e) = failed {
                tracing::warn!(run = %dead.run_id, job = %job.id, "failing an orphaned job: {e}");
            }
            event(env, &dead, EventKind::StateChange, format!("job {} failed: {reason}", job.id), Some(&job.id)).await;
        }
    }
    match adoption {
        Adoption::Fail => {
            let text = format!("run {} stopped: {COORDINATOR_LOST}; {reason}", dead.run_id);
            event(env, &dead, EventKind::Stop, text, None).await;
        }
        Adoption::Resume => {
            // `orphan` resumes only a run whose record has its request.
            let (Some(fleet), Some(request)) = (fleet, dead.request.clone()) else { return };
            // The iteration in flight is over (its job failed): the loop goes on after it.
            if in_flight {
                record.iterations += 1;
            }
            let spec = fleet_run::spec_of(env, &fleet, &request, dead.run_id.clone(), None, dead.started_at).await;
            let spec = match spec {
                Ok((mut spec, _, _)) => {
                    // The budget and rate the run started with stay.
                    spec.budget_usd = dead.budget_usd;
                    spec.guard_rate = dead.guard_rate;
                    spec
                }
                Err(e) => {
                    tracing::warn!(run = %dead.run_id, "an adopted loop's bounds no longer resolve: {e}");
                    record.state = "ended".into();
                    record.stop = Some(COORDINATOR_LOST.into());
                    record.ended_at = Some(SystemClock.now_ms());
                    let _ = fleet_run::put_record(&env.fleets, &record).await;
                    return;
                }
            };
            event(env, &dead, EventKind::StateChange, format!("run {} adopted: {reason}", dead.run_id), None).await;
            let run = Run::resume(spec, record.iterations, record.spend.usd);
            fleet_run::resume(env, run, record);
        }
    }
}

/// Whether the job run id `job_run` belongs to run `run_id`: the run itself (one-shot) or
/// one of its iterations (`<run id>-<n>`).
fn fleet_store_run_of(job_run: &str, run_id: &str) -> bool {
    job_run == run_id
        || job_run
            .strip_prefix(run_id)
            .and_then(|rest| rest.strip_prefix('-'))
            .is_some_and(|n| n.parse::<u64>().is_ok())
}

async fn event(env: &Env, run: &RunRecord, kind: EventKind, text: String, job: Option<&str>) {
    let mut e = ChannelEvent::system(kind, text, SystemClock.now_ms());
    e.run_id = Some(run.run_id.clone());
    e.job_id = job.map(str::to_string);
    if let Err(err) = env.fleets.publish(&run.fleet, &e).await {
        tracing::warn!(fleet = %run.fleet, "channel event not written: {err}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(looping: Option<bool>) -> RunRecord {
        let mut r: RunRecord = serde_json::from_value(serde_json::json!({
            "run_id": "fleet-b-1", "fleet": "b", "state": "running", "bounds": "", "coordinator": "c1",
            "iterations": 2, "started_at": 0, "updated_at": 1_000,
        }))
        .unwrap();
        r.request = looping.map(|l| fleet_store::RunRequest {
            fleet: "b".into(),
            job: None,
            looping: l,
            deadline: None,
            budget_usd: None,
            run_id: None,
        });
        r
    }

    #[test]
    fn a_dead_loop_is_resumed_and_a_dead_one_shot_run_is_failed_and_a_live_one_is_left_alone() {
        assert_eq!(orphan(&record(Some(true)), Some(5_000), 15_001), Some(Adoption::Resume));
        assert_eq!(orphan(&record(Some(false)), Some(5_000), 15_001), Some(Adoption::Fail));
        assert_eq!(orphan(&record(None), None, 11_001), Some(Adoption::Fail));
        assert_eq!(orphan(&record(Some(true)), Some(5_000), 15_000), None, "10 s is not dead yet");
        let mut over = record(Some(true));
        over.state = "done".into();
        assert_eq!(orphan(&over, None, 99_999), None);
    }

    #[test]
    fn the_reason_names_both_coordinators_and_the_run() {
        assert_eq!(
            reason(&record(Some(false)), "c2", Adoption::Fail),
            "orphaned: c1 stopped while running run fleet-b-1 (no heartbeat for 10 s); failed by c2"
        );
        assert_eq!(
            reason(&record(Some(true)), "c2", Adoption::Resume),
            "orphaned: c1 stopped while running run fleet-b-1 (no heartbeat for 10 s); the loop was adopted by c2"
        );
    }

    #[test]
    fn a_job_belongs_to_its_run_or_one_of_its_iterations() {
        assert!(fleet_store_run_of("run-1", "run-1"));
        assert!(fleet_store_run_of("fleet-b-1-3", "fleet-b-1"));
        assert!(!fleet_store_run_of("fleet-b-12", "fleet-b-1"));
        assert!(!fleet_store_run_of("fleet-b-1-x", "fleet-b-1"));
    }
}
