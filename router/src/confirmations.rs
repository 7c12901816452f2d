//! When a router may confirm a worker's announcement (`Seen`): after every dispatch it began
//! sending that worker before it heard the announcement, however busy the link stays.
//!
//! Why this exists: a worker frees an expert it dropped, and settles a change, once every
//! router confirmed the set without it ([`crate::rebalance`]). The confirmation must go on the
//! link behind every dispatch planned on the older set; a dispatch waiting for link credit is
//! still unwritten, and a smaller frame could take the credit first. Waiting until no dispatch
//! to the worker is unwritten at all would be enough, but under steady pipelined load that
//! moment may never come. So each worker's sends are counted in two halves, as in a read-copy-
//! update grace period: confirming flips new sends into the other half and waits only for the
//! half they left, which no new send joins. Confirmations that arrive during a grace period
//! wait for the next one. The driver calls [`Confirmations::ready`] after carrying out the
//! core's actions of a pass, so every dispatch planned before the announcement has begun.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// A dispatch send under way: counted in its worker's half until dropped (when written, or
/// failed).
#[derive(Debug)]
pub struct SendGuard {
    unsent: Arc<[AtomicUsize]>,
    slot: usize,
}

impl Drop for SendGuard {
    fn drop(&mut self) {
        self.unsent[self.slot].fetch_sub(1, Ordering::AcqRel);
    }
}

/// Confirmations (of any frame type `F`) waiting for their grace period, per worker rank.
#[derive(Debug)]
pub struct Confirmations<F> {
    /// Per rank, two counters (rank × 2 + half): sends begun in that half and not finished.
    unsent: Arc<[AtomicUsize]>,
    /// Per rank: the half new sends are counted in.
    half: Vec<usize>,
    /// Per rank: the half a grace period waits to drain.
    grace: Vec<Option<usize>>,
    /// (rank, frame, whether it waits for the grace period under way), in arrival order.
    waiting: Vec<(u32, F, bool)>,
}

impl<F> Confirmations<F> {
    /// Nothing waiting, for mesh ranks `0..ranks`.
    pub fn new(ranks: usize) -> Self {
        Self {
            unsent: (0..ranks * 2).map(|_| AtomicUsize::new(0)).collect(),
            half: vec![0; ranks],
            grace: vec![None; ranks],
            waiting: Vec::new(),
        }
    }

    /// A send to `rank` begins; it counts until the guard is dropped. A rank out of range is
    /// not counted (a guard on a spare slot).
    pub fn begin_send(&self, rank: u32) -> Option<SendGuard> {
        let half = *self.half.get(rank as usize)?;
        let slot = rank as usize * 2 + half;
        self.unsent[slot].fetch_add(1, Ordering::AcqRel);
        Some(SendGuard {
            unsent: Arc::clone(&self.unsent),
            slot,
        })
    }

    /// `frame` confirms an announcement `rank` made: send it once every send to `rank` begun
    /// before now has finished.
    pub fn push(&mut self, rank: u32, frame: F) {
        self.waiting.push((rank, frame, false));
    }

    /// Whether a confirmation waits.
    pub fn pending(&self) -> bool {
        !self.waiting.is_empty()
    }

    /// The confirmations that may be sent now, in arrival order per rank.
    pub fn ready(&mut self) -> Vec<(u32, F)> {
        let mut ranks: Vec<u32> = self.waiting.iter().map(|w| w.0).collect();
        ranks.sort_unstable();
        ranks.dedup();
        let mut out = Vec::new();
        for rank in ranks {
            let r = rank as usize;
            if r >= self.half.len() {
                // Not a rank of this fabric: nothing to wait for.
                self.take(rank, |_| true, &mut out);
                continue;
            }
            loop {
                if let Some(h) = self.grace[r] {
                    if self.unsent[r * 2 + h].load(Ordering::Acquire) > 0 {
                        break;
                    }
                    self.grace[r] = None;
                    self.take(rank, |stamped| stamped, &mut out);
                } else if self.waiting.iter().any(|w| w.0 == rank && !w.2) {
                    for w in self.waiting.iter_mut().filter(|w| w.0 == rank) {
                        w.2 = true;
                    }
                    self.grace[r] = Some(self.half[r]);
                    self.half[r] ^= 1;
                } else {
                    break;
                }
            }
        }
        out
    }

    /// Moves `rank`'s confirmations that `pick` (by whether they wait for the grace period
    /// under way) to `out`.
    fn take(&mut self, rank: u32, pick: impl Fn(bool) -> bool, out: &mut Vec<(u32, F)>) {
        let mut i = 0;
        while i < self.waiting.len() {
            if self.waiting[i].0 == rank && pick(self.waiting[i].2) {
                let (rank, frame, _) = self.waiting.remove(i);
                out.push((rank, frame));
            } else {
                i += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_confirmation_waits_for_earlier_sends_only_not_for_sends_begun_after_it() {
        let mut c = Confirmations::new(3);
        let early = c.begin_send(1).unwrap();
        let other = c.begin_send(2).unwrap();
        c.push(1, "seen v1");
        assert!(
            c.ready().is_empty(),
            "an earlier send to rank 1 is unwritten"
        );
        // Steady load: sends begun after the confirmation never hold it back.
        let late = c.begin_send(1).unwrap();
        assert!(c.ready().is_empty());
        drop(early);
        assert_eq!(c.ready(), vec![(1, "seen v1")]);
        assert!(!c.pending());
        // A send to another rank never mattered; a rank with nothing unwritten goes at once.
        drop(other);
        c.push(2, "seen v2");
        assert_eq!(c.ready(), vec![(2, "seen v2")]);
        drop(late);
    }

    #[test]
    fn a_confirmation_during_a_grace_period_waits_for_the_next_one() {
        let mut c = Confirmations::new(2);
        let a = c.begin_send(0).unwrap();
        c.push(0, 1);
        assert!(c.ready().is_empty());
        // Sent after the first confirmation, before the second: the second waits for it.
        let b = c.begin_send(0).unwrap();
        c.push(0, 2);
        assert!(c.ready().is_empty());
        drop(a);
        assert_eq!(c.ready(), vec![(0, 1)]);
        assert!(c.pending());
        let later = c.begin_send(0).unwrap();
        drop(b);
        assert_eq!(c.ready(), vec![(0, 2)]);
        drop(later);
        // A rank outside the fabric is not held back.
        c.push(9, 3);
        assert_eq!(c.ready(), vec![(9, 3)]);
        assert!(c.begin_send(9).is_none());
    }
}
