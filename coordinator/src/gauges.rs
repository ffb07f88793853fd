//! The leader's cluster-wide gauges (issue #32 §Metrics: "the leader reports cluster-wide
//! gauges"): every [`EVERY`] the scheduler's actor hands its [`Scheduler::load`] to
//! [`Refresh::publish`], which reads the oldest waiting task's record of each capsule and
//! lane (its `submitted_at`: the scheduler keeps arrival order, not times) and the fan-out
//! semaphore's holders, off the actor, and publishes the whole with
//! [`mur_nats::metrics::publish_cluster`].
//!
//! Nothing is done unless metrics are on ([`mur_nats::metrics::enabled`]); a refresh still
//! under way when the next is due is not doubled.

use crate::scheduler::Scheduler;
use async_nats::jetstream::{self, kv};
use mur_nats::clock::{Clock, SystemClock};
use mur_nats::metrics::{ClusterGauges, Waiting};
use mur_proto::cluster::TaskRecord;
use std::time::Duration;

/// How often the gauges are refreshed.
pub const EVERY: Duration = Duration::from_secs(5);

/// The refresh of a leader's gauges, owned by its scheduler's actor.
pub struct Refresh {
    tick: Option<tokio::time::Interval>,
    js: jetstream::Context,
    tasks: kv::Store,
    under_way: Option<tokio::task::JoinHandle<()>>,
}

impl Refresh {
    /// A refresh reading `tasks` (`mur_tasks`) and the fan-out bucket through `js`; it
    /// never ticks when metrics are off.
    pub fn new(js: &jetstream::Context, tasks: &kv::Store) -> Refresh {
        let tick = mur_nats::metrics::enabled().then(|| {
            let mut tick = tokio::time::interval(EVERY);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick
        });
        Refresh { tick, js: js.clone(), tasks: tasks.clone(), under_way: None }
    }

    /// Resolves when the next refresh is due (never when metrics are off).
    pub async fn tick(&mut self) {
        match &mut self.tick {
            Some(tick) => {
                tick.tick().await;
            }
            None => std::future::pending().await,
        }
    }

    /// Publishes `scheduler`'s load, with the ages and permits read in a task of its own.
    pub fn publish(&mut self, scheduler: &Scheduler) {
        if self.under_way.as_ref().is_some_and(|t| !t.is_finished()) {
            return;
        }
        let load = scheduler.load();
        let (js, tasks) = (self.js.clone(), self.tasks.clone());
        self.under_way = Some(tokio::spawn(async move {
            let now = SystemClock.now_ms();
            let mut waiting = Vec::with_capacity(load.waiting.len());
            for (capsule, lane, tasks_waiting, oldest) in load.waiting {
                let submitted_at = match tasks.get(&oldest).await {
                    Ok(Some(value)) => serde_json::from_slice::<TaskRecord>(&value).ok().map(|r| r.submitted_at),
                    _ => None,
                };
                waiting.push(Waiting {
                    capsule,
                    lane: lane.as_str().to_string(),
                    tasks: tasks_waiting as u64,
                    oldest_age_secs: submitted_at.map_or(0.0, |at| now.saturating_sub(at) as f64 / 1000.0),
                });
            }
            let (mut permits_in_use, mut permits_cap) = (0, 0);
            if let Ok(bucket) = js.get_key_value(mur_proto::fanout::FANOUT_BUCKET).await
                && let Ok(status) = mur_nats::fanout::status(&bucket).await
            {
                permits_in_use = status.in_use as u64;
                let caps = status.holders.iter().map(|h| &h.holder).chain(&status.waiting).map(|h| h.step.cap);
                permits_cap = caps.max().map_or(0, u64::from);
            }
            mur_nats::metrics::publish_cluster(ClusterGauges {
                waiting,
                in_flight: load.in_flight.into_iter().map(|(capsule, n)| (capsule, n as u64)).collect(),
                workers: load.workers as u64,
                slots: load.total_slots,
                free_slots: load.free_slots,
                permits_in_use,
                permits_cap,
            });
        }));
    }
}
