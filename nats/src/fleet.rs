//! A fleet run as `mur_fleets` holds it: its record with the liveness verdict and fan-out
//! permits ([`run_status`], shared by the `job_status` tool and `mur job status`), and the
//! heartbeat of the coordinator running it ([`read_beat`], which the coordinator's adoption
//! reads too).

use async_nats::jetstream::kv;
use mur_proto::fleet_store::{self, RunRecord, RunStatus};

/// The run id whose record `id` names: `id` itself, or the run of a loop iteration
/// `<run id>-<n>`.
///
/// # Errors
/// `mur_fleets` cannot be read.
pub async fn base_run_id(defs: &kv::Store, id: &str) -> Result<String, String> {
    if defs.get(fleet_store::run_key(id)).await.map_err(|e| format!("mur_fleets: {e}"))?.is_some() {
        return Ok(id.to_string());
    }
    // `-1` is no iteration of anything (and `run.` no key).
    match id.rsplit_once('-').filter(|(base, n)| !base.is_empty() && n.parse::<u64>().is_ok()) {
        Some((base, _)) => Ok(base.to_string()),
        None => Ok(id.to_string()),
    }
}

/// A run's record, liveness verdict at `now` (unix ms) and fan-out permits: the record of `id`, or of the
/// loop whose iteration `id` is (`<run id>-<n>`); `None` when there is neither. Shared by
/// `job_status` and `mur job status`.
///
/// # Errors
/// `mur_fleets` cannot be read.
pub async fn run_status(js: &async_nats::jetstream::Context, id: &str, now: u64) -> Result<Option<RunStatus>, String> {
    let defs = &js.get_key_value(fleet_store::FLEETS_BUCKET).await.map_err(|e| format!("mur_fleets: {e}"))?;
    let run_id = base_run_id(defs, id).await?;
    let Some(bytes) = defs.get(fleet_store::run_key(&run_id)).await.map_err(|e| format!("mur_fleets: {e}"))? else {
        return Ok(None);
    };
    let record: RunRecord = serde_json::from_slice(&bytes).map_err(|e| format!("run {run_id}: {e}"))?;
    let beat = read_beat(defs, &record.run_id).await;
    let liveness = record.liveness(beat, now);
    let fanout = match js.get_key_value(mur_proto::fanout::FANOUT_BUCKET).await {
        Ok(kv) => crate::fanout::status(&kv).await.unwrap_or_default().of_fleet(&record.fleet),
        Err(_) => Default::default(),
    };
    Ok(Some(RunStatus { record, liveness, fanout }))
}

/// The last heartbeat (unix ms) of the coordinator running `run_id` (`beat.<run id>` in
/// `mur_fleets`); `None` when there is none or it cannot be read.
pub async fn read_beat(defs: &kv::Store, run_id: &str) -> Option<u64> {
    let v = defs.get(fleet_store::beat_key(run_id)).await.ok().flatten()?;
    std::str::from_utf8(&v).ok()?.parse().ok()
}
