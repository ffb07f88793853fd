//! A lane-ordered queue: what waits to run, and which waiting item runs next
//! (the session-loop seed, §Queue lanes; the runtime reference, §5, checklist L6).
//!
//! The rule: take the front of the highest non-empty lane, `user` before `peer` before `bg`;
//! within one lane, arrival order. The queue only orders what waits: a running item is not
//! in it, so lanes decide which item starts next and never which one stops.
//!
//! Pure: no IO, no async, no clock. The capsule's task intake and the cluster coordinator
//! both keep their waiting work in a [`Lanes`].

use crate::task::Lane;
use std::collections::VecDeque;

/// Items waiting in three FIFO lanes, dispatched highest lane first.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lanes<T> {
    /// One queue per lane, indexed by [`lane_index`], front = oldest.
    queues: [VecDeque<T>; 3],
}

/// Position of `lane` in dispatch order (`user` = 0, `peer` = 1, `bg` = 2).
const fn lane_index(lane: Lane) -> usize {
    match lane {
        Lane::User => 0,
        Lane::Peer => 1,
        Lane::Bg => 2,
    }
}

impl<T> Default for Lanes<T> {
    fn default() -> Self {
        Lanes { queues: [VecDeque::new(), VecDeque::new(), VecDeque::new()] }
    }
}

impl<T> Lanes<T> {
    /// An empty queue.
    pub fn new() -> Self {
        Self::default()
    }

    /// Queues `item` at the back of `lane`.
    pub fn push(&mut self, lane: Lane, item: T) {
        self.queues[lane_index(lane)].push_back(item);
    }

    /// Takes the item that runs next: the front of the highest non-empty lane. `None` when
    /// nothing waits.
    pub fn pop(&mut self) -> Option<T> {
        self.pop_with_lane().map(|(_, item)| item)
    }

    /// Like [`Lanes::pop`], also telling which lane the item waited in.
    pub fn pop_with_lane(&mut self) -> Option<(Lane, T)> {
        Lane::ALL.into_iter().find_map(|lane| self.queues[lane_index(lane)].pop_front().map(|item| (lane, item)))
    }

    /// The item [`Lanes::pop`] would take, without taking it.
    pub fn peek(&self) -> Option<&T> {
        self.queues.iter().find_map(VecDeque::front)
    }

    /// How many items wait, all lanes together.
    pub fn len(&self) -> usize {
        self.queues.iter().map(VecDeque::len).sum()
    }

    /// Whether nothing waits.
    pub fn is_empty(&self) -> bool {
        self.queues.iter().all(VecDeque::is_empty)
    }

    /// How many items wait in `lane`.
    pub fn len_of(&self, lane: Lane) -> usize {
        self.queues[lane_index(lane)].len()
    }

    /// Takes out the first item, in dispatch order, for which `pred` holds (cancelling a
    /// queued task). The others keep their order. `None` when no item matches.
    pub fn remove(&mut self, mut pred: impl FnMut(&T) -> bool) -> Option<T> {
        for queue in &mut self.queues {
            if let Some(at) = queue.iter().position(&mut pred) {
                return queue.remove(at);
            }
        }
        None
    }

    /// Every waiting item in dispatch order: the order successive [`Lanes::pop`]s would
    /// return them.
    pub fn iter(&self) -> impl Iterator<Item = &T> {
        self.queues.iter().flatten()
    }

    /// Like [`Lanes::iter`], with the lane of each item.
    pub fn iter_with_lanes(&self) -> impl Iterator<Item = (Lane, &T)> {
        Lane::ALL.into_iter().flat_map(move |lane| self.queues[lane_index(lane)].iter().map(move |item| (lane, item)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pops_user_before_peer_before_bg_whatever_the_arrival_order() {
        let mut lanes = Lanes::new();
        lanes.push(Lane::Bg, "bg1");
        lanes.push(Lane::Peer, "peer1");
        lanes.push(Lane::Bg, "bg2");
        lanes.push(Lane::User, "user1");
        lanes.push(Lane::Peer, "peer2");
        lanes.push(Lane::User, "user2");
        assert_eq!(lanes.len(), 6);
        assert_eq!((lanes.len_of(Lane::User), lanes.len_of(Lane::Peer), lanes.len_of(Lane::Bg)), (2, 2, 2));
        assert_eq!(lanes.iter().copied().collect::<Vec<_>>(), ["user1", "user2", "peer1", "peer2", "bg1", "bg2"]);
        let mut popped = Vec::new();
        while let Some(item) = lanes.pop() {
            popped.push(item);
        }
        assert_eq!(popped, ["user1", "user2", "peer1", "peer2", "bg1", "bg2"]);
        assert!(lanes.is_empty());
        assert_eq!(lanes.pop(), None);
    }

    #[test]
    fn a_later_user_item_overtakes_waiting_bg_items() {
        let mut lanes = Lanes::new();
        lanes.push(Lane::Bg, 1);
        lanes.push(Lane::Bg, 2);
        assert_eq!(lanes.pop_with_lane(), Some((Lane::Bg, 1)));
        lanes.push(Lane::User, 3);
        assert_eq!(lanes.peek(), Some(&3));
        assert_eq!(lanes.pop_with_lane(), Some((Lane::User, 3)));
        assert_eq!(lanes.pop_with_lane(), Some((Lane::Bg, 2)));
    }

    #[test]
    fn remove_takes_the_first_match_and_keeps_the_rest_in_order() {
        let mut lanes = Lanes::new();
        lanes.push(Lane::Peer, "a");
        lanes.push(Lane::Bg, "b");
        lanes.push(Lane::Peer, "c");
        lanes.push(Lane::Bg, "b");
        assert_eq!(lanes.remove(|x| *x == "b"), Some("b"));
        assert_eq!(lanes.remove(|x| *x == "zzz"), None);
        assert_eq!(
            lanes.iter_with_lanes().map(|(l, x)| (l, *x)).collect::<Vec<_>>(),
            [(Lane::Peer, "a"), (Lane::Peer, "c"), (Lane::Bg, "b")]
        );
        assert_eq!(lanes.len_of(Lane::Bg), 1);
    }

    /// SplitMix64: a tiny seeded generator, so the property test is reproducible without a
    /// dependency.
    struct SplitMix(u64);

    impl SplitMix {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }

        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
    }

    /// For random push / pop / remove sequences, every pop returns the waiting item with the
    /// smallest (lane rank, arrival number): no item ever pops while an item of a higher lane
    /// waits, and items of one lane pop in arrival order. Checked against a plain list model
    /// after every step.
    #[test]
    fn random_sequences_always_pop_the_highest_lane_oldest_item() {
        for seed in 0..200u64 {
            let mut rng = SplitMix(seed);
            let mut lanes: Lanes<(Lane, u64)> = Lanes::new();
            let mut model: Vec<(Lane, u64)> = Vec::new();
            let mut arrival = 0u64;
            for _ in 0..300 {
                match rng.below(10) {
                    0..=4 => {
                        let lane = Lane::ALL[rng.below(3) as usize];
                        arrival += 1;
                        lanes.push(lane, (lane, arrival));
                        model.push((lane, arrival));
                    }
                    5..=8 => {
                        let expected = model.iter().copied().min();
                        if let Some(e) = expected {
                            model.retain(|x| *x != e);
                        }
                        let got = lanes.pop_with_lane();
                        assert_eq!(got.map(|(_, item)| item), expected, "seed {seed}");
                        if let Some((lane, (item_lane, _))) = got {
                            assert_eq!(lane, item_lane, "seed {seed}");
                        }
                    }
                    _ => {
                        if !model.is_empty() {
                            let victim = model[rng.below(model.len() as u64) as usize];
                            assert_eq!(lanes.remove(|x| *x == victim), Some(victim), "seed {seed}");
                            model.retain(|x| *x != victim);
                        }
                    }
                }
                let mut sorted = model.clone();
                sorted.sort();
                assert_eq!(lanes.iter().copied().collect::<Vec<_>>(), sorted, "seed {seed}");
                assert_eq!(lanes.len(), model.len(), "seed {seed}");
                for lane in Lane::ALL {
                    assert_eq!(lanes.len_of(lane), model.iter().filter(|(l, _)| *l == lane).count(), "seed {seed}");
                }
            }
        }
    }
}
