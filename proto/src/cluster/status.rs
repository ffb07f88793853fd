//! `mur cluster status`: the cluster's lanes, tasks in flight, dead letters and workers.

use super::*;

/// What `mur cluster status` shows (issue #8 §Observability of the queue): the queue per
/// capsule and lane, what is in flight and where, the dead letters, the workers, the
/// leader. Ages are milliseconds at `at` (unix ms).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterStatus {
    /// When it was read.
    pub at: u64,
    /// The leading coordinator, if any holds the lease.
    pub leader: Option<LeaderLease>,
    /// The coordinators standing by, by instance name (issue #29 item 14); empty from a
    /// coordinator that did not say.
    #[serde(default)]
    pub standbys: Vec<StandbyStatus>,
    /// Waiting tasks per capsule and lane, in lane order (`user`, `peer`, `bg`).
    pub lanes: Vec<LaneStatus>,
    /// Released or running tasks, oldest first.
    pub in_flight: Vec<InFlight>,
    /// Tasks given up after every delivery failed, newest first.
    pub dead_letters: Vec<DeadLetterEntry>,
    /// Registered workers.
    pub workers: Vec<WorkerStatus>,
    /// The fan-out semaphore: permits in use, holders, waiting steps (issue #11).
    #[serde(default)]
    pub fanout: crate::fanout::FanoutStatus,
}

/// One capsule's lane.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LaneStatus {
    /// The capsule.
    pub capsule: String,
    /// The lane.
    pub lane: Lane,
    /// Tasks waiting in it.
    pub pending: u64,
    /// How long its oldest task has waited, ms.
    pub oldest_age_ms: u64,
}

/// A released or running task.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct InFlight {
    /// `tsk_…`.
    pub task_id: TaskId,
    /// The capsule.
    pub capsule: String,
    /// Its lane.
    pub lane: Lane,
    /// `submitted` (released, not started yet) or `working`.
    pub state: TaskState,
    /// The worker that holds it (once started).
    pub worker: Option<String>,
    /// Its dispatch attempt.
    pub attempt: u32,
    /// How long since it was started (or submitted, while not started), ms.
    pub age_ms: u64,
    /// A cancel was asked for.
    pub cancel_requested: bool,
}

/// A dead letter, as listed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeadLetterEntry {
    /// `tsk_…`.
    pub task_id: TaskId,
    /// The capsule.
    pub capsule: String,
    /// Why, and how many deliveries.
    pub dead_letter: DeadLetter,
}

/// A registered worker.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerStatus {
    /// Its id.
    pub worker_id: String,
    /// Its slots.
    pub slots: u32,
    /// Slots free at its last heartbeat.
    pub free: u32,
    /// How long since its last heartbeat, ms.
    pub heartbeat_age_ms: u64,
    /// Whether that heartbeat is within the coordinator's worker timeout: a silent worker
    /// (stopped, killed, cut off) gets no dispatch and its slots count for nothing. Its
    /// registration stays in `mur_workers` until it beats again or is removed. `true` in
    /// a reply from a coordinator that did not say.
    #[serde(default = "heard_from")]
    pub live: bool,
}

fn heard_from() -> bool {
    true
}

impl ClusterStatus {
    /// Builds the status from every task record, every worker registration and the
    /// lease, at `now` (unix ms); a worker whose last heartbeat is more than
    /// `worker_timeout_ms` old is not [`WorkerStatus::live`]. Pure: the coordinator reads
    /// the buckets, this sorts.
    pub fn build(
        records: &[TaskRecord],
        workers: &[WorkerInfo],
        leader: Option<LeaderLease>,
        now: u64,
        worker_timeout_ms: u64,
    ) -> Self {
        let mut lanes: Vec<LaneStatus> = Vec::new();
        let mut in_flight = Vec::new();
        let mut dead_letters = Vec::new();
        for r in records {
            match r.state {
                TaskState::Submitted if r.attempt == 0 => {
                    let age = now.saturating_sub(r.submitted_at);
                    match lanes.iter_mut().find(|l| l.capsule == r.capsule && l.lane == r.lane) {
                        Some(l) => {
                            l.pending += 1;
                            l.oldest_age_ms = l.oldest_age_ms.max(age);
                        }
                        None => lanes.push(LaneStatus {
                            capsule: r.capsule.clone(),
                            lane: r.lane,
                            pending: 1,
                            oldest_age_ms: age,
                        }),
                    }
                }
                TaskState::Submitted | TaskState::Working => in_flight.push(InFlight {
                    task_id: r.task_id.clone(),
                    capsule: r.capsule.clone(),
                    lane: r.lane,
                    state: r.state,
                    worker: r.worker.clone().filter(|_| r.state == TaskState::Working),
                    attempt: r.attempt,
                    age_ms: now.saturating_sub(r.started_at.unwrap_or(r.submitted_at)),
                    cancel_requested: r.cancel_requested_at.is_some(),
                }),
                _ => {
                    if let Some(d) = &r.dead_letter {
                        dead_letters.push(DeadLetterEntry {
                            task_id: r.task_id.clone(),
                            capsule: r.capsule.clone(),
                            dead_letter: d.clone(),
                        });
                    }
                }
            }
        }
        lanes.sort_by(|a, b| (&a.capsule, a.lane).cmp(&(&b.capsule, b.lane)));
        in_flight.sort_by(|a, b| b.age_ms.cmp(&a.age_ms).then_with(|| a.task_id.cmp(&b.task_id)));
        dead_letters.sort_by_key(|d| std::cmp::Reverse(d.dead_letter.at));
        let mut workers: Vec<WorkerStatus> = workers
            .iter()
            .map(|w| WorkerStatus {
                worker_id: w.worker_id.clone(),
                slots: w.slots,
                free: w.slots.saturating_sub(w.busy),
                heartbeat_age_ms: now.saturating_sub(w.heartbeat_at),
                live: !heartbeat_expired(w.heartbeat_at, now, worker_timeout_ms),
            })
            .collect();
        workers.sort_by(|a, b| a.worker_id.cmp(&b.worker_id));
        ClusterStatus {
            at: now,
            leader,
            standbys: Vec::new(),
            lanes,
            in_flight,
            dead_letters,
            workers,
            fanout: Default::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_worker_silent_past_the_timeout_is_not_live_in_the_status() {
        let info = |id: &str, heartbeat_at| WorkerInfo {
            worker_id: id.into(),
            slots: 4,
            busy: 1,
            started_at: 0,
            heartbeat_at,
            version: "0".into(),
        };
        let workers = [info("b-silent", 89_999), info("a-live", 90_000)];
        let status = ClusterStatus::build(&[], &workers, None, 100_000, 10_000);
        let seen: Vec<_> =
            status.workers.iter().map(|w| (w.worker_id.as_str(), w.free, w.heartbeat_age_ms, w.live)).collect();
        assert_eq!(seen, [("a-live", 3, 10_000, true), ("b-silent", 3, 10_001, false)]);
        // A reply from a coordinator that did not say reads as live.
        let old: WorkerStatus =
            serde_json::from_str(r#"{"worker_id":"w","slots":1,"free":1,"heartbeat_age_ms":5}"#).unwrap();
        assert!(old.live);
    }
}
