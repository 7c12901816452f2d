//! Fair scheduling of dispatches from several routers on one worker.
//!
//! Why this exists: many routers share one expert pool, and a worker runs one batch at a time.
//! Served in arrival order, a router that keeps its whole credit window full would put every
//! other router's dispatch behind all of its own. [`FairQueue`] keeps one FIFO per sender and
//! hands out the next item round robin over the senders that have work, so each router waits
//! for at most one batch of every other router per batch of its own. It holds no more than the
//! senders put in, and the mesh's per-link credit window bounds that (a frame keeps its credit
//! until it is dropped), so the queue is bounded by the sum of the routers' windows.
//!
//! [`FairQueue`] is a plain data structure (tested against a brute-force model) owned by the
//! worker's compute loop, which fills it from the mesh's events and drains it.

use std::collections::VecDeque;

/// Per-sender FIFOs served round robin.
#[derive(Debug)]
pub struct FairQueue<T> {
    queues: Vec<VecDeque<T>>,
    /// The sender served last; the next pop starts after it.
    last: usize,
    len: usize,
}

impl<T> FairQueue<T> {
    /// A queue for senders `0..senders` (more are added on demand).
    pub fn new(senders: usize) -> Self {
        Self {
            queues: (0..senders.max(1)).map(|_| VecDeque::new()).collect(),
            last: senders.max(1) - 1,
            len: 0,
        }
    }

    /// Queues `item` from `sender`.
    pub fn push(&mut self, sender: usize, item: T) {
        if sender >= self.queues.len() {
            self.queues.resize_with(sender + 1, VecDeque::new);
        }
        self.queues[sender].push_back(item);
        self.len += 1;
    }

    /// The oldest item of the next sender (round robin, starting after the last one served)
    /// that has any.
    pub fn pop(&mut self) -> Option<(usize, T)> {
        if self.len == 0 {
            return None;
        }
        let n = self.queues.len();
        for step in 1..=n {
            let s = (self.last + step) % n;
            if let Some(item) = self.queues[s].pop_front() {
                self.last = s;
                self.len -= 1;
                return Some((s, item));
            }
        }
        None
    }

    /// Items queued from every sender.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Drops everything queued from `sender` (its link is gone: nobody would read the
    /// results) and returns how many items that was.
    pub fn drop_sender(&mut self, sender: usize) -> usize {
        let n = self.queues.get_mut(sender).map_or(0, |q| {
            let n = q.len();
            q.clear();
            n
        });
        self.len -= n;
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_busy_sender_does_not_starve_another() {
        let mut q = FairQueue::new(2);
        for i in 0..10 {
            q.push(0, i);
        }
        q.push(1, 100);
        // sender 1's single item is served right after sender 0's first
        assert_eq!(q.pop(), Some((0, 0)));
        assert_eq!(q.pop(), Some((1, 100)));
        for i in 1..10 {
            assert_eq!(q.pop(), Some((0, i)));
        }
        assert_eq!(q.pop(), None);
    }

    #[test]
    fn dropping_a_sender_forgets_only_its_items() {
        let mut q = FairQueue::new(3);
        q.push(0, 'a');
        q.push(2, 'b');
        q.push(2, 'c');
        assert_eq!(q.drop_sender(2), 2);
        assert_eq!(q.len(), 1);
        assert_eq!(q.pop(), Some((0, 'a')));
        assert!(q.is_empty());
    }

    /// Brute-force model: scan senders after the last served, take the first non-empty FIFO.
    fn model(ops: &[(bool, usize)], senders: usize) -> Vec<(usize, u32)> {
        let mut qs: Vec<Vec<u32>> = vec![Vec::new(); senders];
        let mut last = senders - 1;
        let mut out = Vec::new();
        for (i, &(is_push, s)) in ops.iter().enumerate() {
            if is_push {
                qs[s].push(i as u32);
            } else if let Some(s2) = (1..=senders)
                .map(|k| (last + k) % senders)
                .find(|&s2| !qs[s2].is_empty())
            {
                last = s2;
                out.push((s2, qs[s2].remove(0)));
            }
        }
        out
    }

    proptest! {
        #[test]
        fn matches_round_robin_model(
            ops in proptest::collection::vec((any::<bool>(), 0usize..4), 0..200)
        ) {
            let mut q = FairQueue::new(4);
            let mut got = Vec::new();
            for (i, &(is_push, s)) in ops.iter().enumerate() {
                if is_push {
                    q.push(s, i as u32);
                } else if let Some(x) = q.pop() {
                    got.push(x);
                }
            }
            prop_assert_eq!(got, model(&ops, 4));
        }

        /// Fairness bound: between two services of a sender that always has work, every other
        /// sender is served at most once.
        #[test]
        fn waits_at_most_one_item_per_other_sender(
            others in proptest::collection::vec(0usize..20, 3)
        ) {
            let mut q = FairQueue::new(4);
            for _ in 0..5 { q.push(0, 0u32); }
            for (s, &n) in others.iter().enumerate() {
                for _ in 0..n { q.push(s + 1, 0); }
            }
            let mut since = [0usize; 4];
            while let Some((s, _)) = q.pop() {
                if s == 0 {
                    prop_assert!(since.iter().skip(1).all(|&c| c <= 1));
                    since = [0; 4];
                } else {
                    since[s] += 1;
                }
            }
        }
    }
}
