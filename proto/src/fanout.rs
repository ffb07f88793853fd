//! The cluster-wide fan-out cap's records and its one decision (issue #11 §The fan-out
//! cap, cluster-wide; the design's invariant 5; the JetStream patterns reference, §1.6 design
//! B, KV slot leases). Pure: the worker's `fanout` module does the IO.
//!
//! The semaphore lives in the KV bucket [`FANOUT_BUCKET`], whose max age is the lease
//! (`jetstream.fanout_lease_secs`): a key not rewritten within it expires, and the server
//! leaves a marker that watchers see as a purge.
//!
//! - `slot.<n>` — a permit, held by the step whose [`Holder`] it stores. A step whose cap
//!   is `c` may take slots `0..c` only, so no more than `c` steps of its cap hold permits
//!   at once, cluster-wide. Taken with *create* (only when absent), renewed with
//!   compare-and-set on the holder's revision every third of the lease, released with a
//!   delete that expects that revision: a late or repeated release (the slot expired and
//!   someone else holds it now) changes nothing, so the count never rises above the cap.
//! - `wait.<task id>` — a waiting step's ticket. Its revision (the stream sequence) is its
//!   place in line: waiters are served in ticket order ([`candidates`]), so a step that
//!   waits does not time out or starve because others hold permits.
//!
//! A crashed holder stops renewing; its slot expires within the lease and the next waiter
//! takes it. A dead waiter's ticket expires the same way.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

use crate::TaskId;

/// The KV bucket of the semaphore: `slot.<n>` permits and `wait.<task id>` tickets.
pub const FANOUT_BUCKET: &str = "mur_fanout";

/// The prefix of permit keys.
pub const SLOT_PREFIX: &str = "slot.";
/// The prefix of waiting tickets.
pub const WAIT_PREFIX: &str = "wait.";

/// The key of permit `n` (`slot.<n>`).
pub fn slot_key(n: u32) -> String {
    format!("{SLOT_PREFIX}{n}")
}

/// The key of `task_id`'s waiting ticket (`wait.<task id>`).
pub fn wait_key(task_id: &TaskId) -> String {
    format!("{WAIT_PREFIX}{task_id}")
}

/// What makes a task a delegated fleet step (issue #11): the coordinator's fleet run sets
/// it on the steps it submits, and the worker then runs the task only while it holds one
/// of the first `cap` permits.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FleetStep {
    /// The fleet the step works for.
    pub fleet: String,
    /// The run (iteration) it belongs to.
    pub run_id: String,
    /// The step: the member's name for broadcast and router plans, the step id for a
    /// procedure.
    pub step: String,
    /// The fan-out cap that applies to it (`fanout:`, `MUR_FLEET_FANOUT`, or 3:
    /// `fleet::resolve_fanout`), at least 1.
    pub cap: u32,
}

/// The value of a permit or a ticket: who holds it or waits.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Holder {
    /// The step's task (`tsk_…`).
    pub task_id: TaskId,
    /// The worker running (or about to run) it.
    pub worker: String,
    /// The fleet, run and step, with the cap.
    #[serde(flatten)]
    pub step: FleetStep,
    /// When it started holding or waiting, unix ms.
    pub since: u64,
}

/// The semaphore as a watcher sees it: live permits and tickets with their revisions.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct View {
    /// Held permits: slot number → revision of the holder's last write.
    pub held: BTreeMap<u32, u64>,
    /// Waiting tickets: task id → (revision, cap).
    pub waiting: BTreeMap<TaskId, (u64, u32)>,
}

impl View {
    /// Applies one KV entry: `key` written at `revision` (`value` present) or deleted,
    /// purged or expired (`value` absent). Keys that are neither slots nor tickets, and
    /// values that do not decode, are ignored (a ticket that does not decode counts with
    /// cap 1, so it still keeps its place).
    pub fn apply(&mut self, key: &str, revision: u64, value: Option<&[u8]>) {
        if let Some(n) = key.strip_prefix(SLOT_PREFIX).and_then(|n| n.parse::<u32>().ok()) {
            match value {
                Some(_) => self.held.insert(n, revision),
                None => self.held.remove(&n),
            };
        } else if let Some(task) = key.strip_prefix(WAIT_PREFIX) {
            match value {
                Some(v) => {
                    let cap = serde_json::from_slice::<Holder>(v).map_or(1, |h| h.step.cap.max(1));
                    self.waiting.insert(TaskId::unchecked(task), (revision, cap));
                }
                None => {
                    self.waiting.remove(task);
                }
            }
        }
    }
}

/// Most slots [`candidates`] offers at once: the caller tries them in order and takes
/// the first it can create, so a few are enough; a lost race is seen on the watch and the
/// slots are offered again.
pub const MAX_CANDIDATES: usize = 16;

/// The slots `task_id` may try to take now, best first (at most [`MAX_CANDIDATES`]);
/// empty when it must wait.
///
/// Waiters are served in ticket order: each waiter ahead of `task_id` (a smaller ticket
/// revision) is given the lowest free slot below its own cap, if any; `task_id` gets the
/// free slots below `cap` that are left. So a step never overtakes one that waited longer
/// and could use the same slot, and a waiter with a small cap does not hold back one with
/// a larger cap when the free slot is above the small cap. A task with no ticket in the
/// view is served after every ticket.
///
/// The free slots are walked lazily: the work is bounded by the permits held and the
/// waiters ahead, never by `cap`, so a hostile cap (`u32::MAX` from a submission, a huge
/// `fanout:`) costs nothing.
pub fn candidates(view: &View, task_id: &TaskId, cap: u32) -> Vec<u32> {
    let mine = view.waiting.get(task_id).map_or(u64::MAX, |&(rev, _)| rev);
    let mut ahead: Vec<(u64, &str, u32)> = view
        .waiting
        .iter()
        .filter(|(id, (rev, _))| *rev < mine && *id != task_id)
        .map(|(id, &(rev, c))| (rev, id.as_str(), c))
        .collect();
    ahead.sort_unstable();
    // The free slots in ascending order; each waiter ahead takes the lowest one if it is
    // below its cap (a lower free slot is always the first such slot).
    let mut free = (0..u32::MAX).filter(|n| !view.held.contains_key(n)).peekable();
    for (_, _, their_cap) in ahead {
        free.next_if(|&n| n < their_cap);
    }
    free.take_while(|&n| n < cap).take(MAX_CANDIDATES).collect()
}

/// Permits in use, holders and waiting steps, for `mur cluster status` and
/// `mur fleet status` (issue #11 §The fan-out cap).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FanoutStatus {
    /// Permits held now.
    pub in_use: usize,
    /// Who holds them, by slot.
    pub holders: Vec<SlotHolder>,
    /// Steps waiting for a permit, in the order they will be served.
    pub waiting: Vec<Holder>,
}

/// One held permit.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlotHolder {
    /// The slot number.
    pub slot: u32,
    /// Its holder.
    #[serde(flatten)]
    pub holder: Holder,
}

impl FanoutStatus {
    /// Builds the status from the bucket's live entries `(key, revision, value)`.
    pub fn build(entries: &[(String, u64, Vec<u8>)]) -> FanoutStatus {
        let mut holders = Vec::new();
        let mut waiting = Vec::new();
        for (key, revision, value) in entries {
            let Ok(holder) = serde_json::from_slice::<Holder>(value) else { continue };
            if let Some(slot) = key.strip_prefix(SLOT_PREFIX).and_then(|n| n.parse().ok()) {
                holders.push(SlotHolder { slot, holder });
            } else if key.starts_with(WAIT_PREFIX) {
                waiting.push((*revision, holder));
            }
        }
        holders.sort_by_key(|h| h.slot);
        waiting.sort_by_key(|(rev, _)| *rev);
        FanoutStatus { in_use: holders.len(), holders, waiting: waiting.into_iter().map(|(_, h)| h).collect() }
    }

    /// Keeps only the permits and waiters of `fleet`.
    pub fn of_fleet(mut self, fleet: &str) -> FanoutStatus {
        self.holders.retain(|h| h.holder.step.fleet == fleet);
        self.waiting.retain(|h| h.step.fleet == fleet);
        self.in_use = self.holders.len();
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ticket(cap: u32) -> Vec<u8> {
        serde_json::to_vec(&Holder {
            task_id: TaskId::unchecked("t"),
            worker: "w".into(),
            step: FleetStep { fleet: "f".into(), run_id: "r".into(), step: "s".into(), cap },
            since: 0,
        })
        .unwrap()
    }

    #[test]
    fn a_lone_waiter_may_take_every_free_slot_below_its_cap() {
        let mut v = View::default();
        v.apply("slot.1", 4, Some(b"{}"));
        v.apply("wait.a", 5, Some(&ticket(3)));
        assert_eq!(candidates(&v, &TaskId::unchecked("a"), 3), [0, 2]);
    }

    #[test]
    fn waiters_are_served_in_ticket_order() {
        let mut v = View::default();
        v.apply("slot.0", 1, Some(b"{}"));
        v.apply("slot.1", 2, Some(b"{}"));
        v.apply("wait.late", 9, Some(&ticket(3)));
        v.apply("wait.early", 7, Some(&ticket(3)));
        assert_eq!(candidates(&v, &TaskId::unchecked("early"), 3), [2]);
        assert_eq!(
            candidates(&v, &TaskId::unchecked("late"), 3),
            Vec::<u32>::new(),
            "the one free slot is the earlier waiter's"
        );
        v.apply("slot.1", 10, None);
        assert_eq!(candidates(&v, &TaskId::unchecked("late"), 3), [2], "a second free slot serves the next in line");
    }

    #[test]
    fn a_waiter_ahead_with_a_smaller_cap_does_not_hold_back_a_slot_it_cannot_use() {
        let mut v = View::default();
        for n in 0..3 {
            v.apply(&slot_key(n), u64::from(n) + 1, Some(b"{}"));
        }
        v.apply("wait.small", 5, Some(&ticket(3)));
        v.apply("wait.big", 6, Some(&ticket(5)));
        assert_eq!(candidates(&v, &TaskId::unchecked("small"), 3), Vec::<u32>::new());
        assert_eq!(candidates(&v, &TaskId::unchecked("big"), 5), [3, 4]);
    }

    #[test]
    fn the_largest_cap_costs_no_more_than_a_small_one() {
        let mut v = View::default();
        v.apply("slot.0", 1, Some(b"{}"));
        v.apply("wait.huge", 2, Some(&ticket(u32::MAX)));
        v.apply("wait.me", 3, Some(&ticket(u32::MAX)));
        let started = std::time::Instant::now();
        assert_eq!(candidates(&v, &TaskId::unchecked("huge"), u32::MAX), (1..=16).collect::<Vec<u32>>());
        assert_eq!(
            candidates(&v, &TaskId::unchecked("me"), u32::MAX),
            (2..=17).collect::<Vec<u32>>(),
            "slot 1 is the earlier waiter's"
        );
        assert_eq!(candidates(&v, &TaskId::unchecked("me"), 2), Vec::<u32>::new());
        assert!(started.elapsed() < std::time::Duration::from_secs(1), "took {:?}", started.elapsed());
    }

    #[test]
    fn a_slot_above_the_cap_is_never_a_candidate() {
        let v = View::default();
        assert_eq!(candidates(&v, &TaskId::unchecked("a"), 1), [0]);
        assert_eq!(candidates(&v, &TaskId::unchecked("a"), 3), [0, 1, 2]);
    }

    #[test]
    fn an_expired_ticket_leaves_the_line() {
        let mut v = View::default();
        v.apply("slot.0", 1, Some(b"{}"));
        v.apply("wait.dead", 2, Some(&ticket(2)));
        v.apply("wait.me", 3, Some(&ticket(2)));
        assert!(candidates(&v, &TaskId::unchecked("me"), 2).is_empty());
        v.apply("wait.dead", 4, None);
        assert_eq!(candidates(&v, &TaskId::unchecked("me"), 2), [1]);
    }

    #[test]
    fn status_lists_holders_by_slot_and_waiters_in_ticket_order() {
        let h = |task: &str, fleet: &str| Holder {
            task_id: TaskId::unchecked(task),
            worker: "w1".into(),
            step: FleetStep { fleet: fleet.into(), run_id: "r".into(), step: "s".into(), cap: 3 },
            since: 1,
        };
        let json = |h: &Holder| serde_json::to_vec(h).unwrap();
        let entries = vec![
            ("slot.2".to_string(), 3, json(&h("t2", "a"))),
            ("slot.0".to_string(), 1, json(&h("t0", "b"))),
            ("wait.t9".to_string(), 9, json(&h("t9", "a"))),
            ("wait.t5".to_string(), 5, json(&h("t5", "a"))),
        ];
        let s = FanoutStatus::build(&entries);
        assert_eq!(s.in_use, 2);
        assert_eq!(s.holders.iter().map(|h| h.slot).collect::<Vec<_>>(), [0, 2]);
        assert_eq!(s.waiting.iter().map(|h| h.task_id.as_str()).collect::<Vec<_>>(), ["t5", "t9"]);
        let a = s.of_fleet("a");
        assert_eq!((a.in_use, a.holders[0].holder.task_id.as_str(), a.waiting.len()), (1, "t2", 2));
        let v = serde_json::to_value(&a.holders[0]).unwrap();
        assert_eq!(v["slot"], 2);
        assert_eq!(v["fleet"], "a");
        assert_eq!(v["cap"], 3);
    }
}
