//! The worker's registration in `mur_workers`, re-put every [`HEARTBEAT_EVERY`].

use super::*;

/// The worker's entry in `mur_workers`.
#[derive(Clone)]
pub(super) struct Registration {
    pub(super) workers: kv::Store,
    pub(super) slots: Arc<Semaphore>,
    pub(super) info: WorkerInfo,
}

impl Registration {
    pub(super) async fn put(&self) -> Result<(), String> {
        let mut info = self.info.clone();
        info.busy = info.slots.saturating_sub(self.slots.available_permits() as u32);
        info.heartbeat_at = SystemClock.now_ms();
        let json = serde_json::to_vec(&info).map_err(|e| e.to_string())?;
        self.workers.put(&info.worker_id, json.into()).await.map(drop).map_err(|e| e.to_string())
    }

    pub(super) async fn beat(self, stop: CancellationToken) {
        let mut every = tokio::time::interval_at(tokio::time::Instant::now() + HEARTBEAT_EVERY, HEARTBEAT_EVERY);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                _ = every.tick() => {}
            }
            if let Err(e) = self.put().await {
                tracing::warn!(error = %e, "worker heartbeat failed");
            }
        }
    }
}
