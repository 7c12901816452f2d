//! What a worker holds during live placement changes: a sans-IO state machine.
//!
//! Why this exists: a device gains and loses experts while it serves
//! ([`expertmesh_router::rebalance`] has the protocol). The worker is the truth about its set:
//! it announces what routers may send it (`Holding`), and it must never free an expert that a
//! dispatch already on its way still names. This module decides, from a router's `Hold`, what
//! to load and what to announce, and from the routers' `Seen` confirmations when an expert
//! dropped from the announcement may really be freed: once every router connected when it was
//! dropped has confirmed a version without it (a `Seen` travels on the same link after every
//! dispatch planned on the older set, and the worker takes frames of one link in order), or its
//! link is gone (its queued dispatches were dropped with it). Versions are never reused: a
//! hold must be newer than every version committed or refused here, so a late confirmation of
//! one set never confirms another. The same confirmations settle
//! the version: once every such router confirmed it, no router routes by an older set of this
//! worker, and the worker says so (`Settled`; a change's next step waits for it, so that no
//! router ever sees an expert without an owner between a gain and a release). The compute
//! loop carries out the loads and frees on its backend.

use std::collections::BTreeSet;

/// One routed expert: (layer, expert).
pub type Expert = (u32, u32);

/// The announcement of `version`, awaiting the confirmation of every router in `waiting`;
/// the experts it dropped (maybe none) stay loaded until then.
#[derive(Debug, Clone)]
struct Pending {
    version: u64,
    experts: BTreeSet<Expert>,
    waiting: BTreeSet<u32>,
}

/// What a `Hold` asks of this worker once accepted ([`Holdings::plan`]): load `load`, then
/// [`Holdings::commit`] it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HoldPlan {
    /// The version of the hold.
    pub version: u64,
    /// Experts to load (neither served nor still loaded), ascending.
    pub load: Vec<Expert>,
    /// The set to serve.
    target: BTreeSet<Expert>,
}

/// The worker's set. See the module docs.
#[derive(Debug, Clone)]
pub struct Holdings {
    version: u64,
    /// The newest version this worker committed or refused: a new hold must be newer, so a
    /// router's confirmation of one version never confirms another set (module docs).
    newest: u64,
    serving: BTreeSet<Expert>,
    pending: Vec<Pending>,
}

/// What confirmations completed ([`Holdings::commit`], [`Holdings::on_seen`],
/// [`Holdings::on_router_lost`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Confirmed {
    /// Experts no router can send here any more: free them now. Ascending.
    pub free: Vec<Expert>,
    /// The highest version every router connected at its announcement has confirmed just
    /// now (announce `Settled` for it).
    pub settled: Option<u64>,
}

impl Holdings {
    /// A worker that loaded `serving` at start (version 0).
    pub fn new(serving: impl IntoIterator<Item = Expert>) -> Self {
        Self {
            version: 0,
            newest: 0,
            serving: serving.into_iter().collect(),
            pending: Vec::new(),
        }
    }

    /// The version of the set announced.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// The newest version committed or refused here: what this worker announces when asked
    /// (a survey, a new link), so that the next change is numbered above every version it
    /// has used.
    pub fn newest(&self) -> u64 {
        self.newest
    }

    /// A hold of `version` was refused (or failed): versions up to it are used.
    pub fn refused(&mut self, version: u64) {
        self.newest = self.newest.max(version);
    }

    /// The set announced: what routers may send here.
    pub fn serving(&self) -> Vec<Expert> {
        self.serving.iter().copied().collect()
    }

    /// Experts dropped from the announcement and not yet freed.
    pub fn releasing(&self) -> usize {
        self.pending.iter().map(|r| r.experts.len()).sum()
    }

    /// Every expert loaded now: served or still releasing.
    fn loaded(&self) -> BTreeSet<Expert> {
        let mut all = self.serving.clone();
        for r in &self.pending {
            all.extend(r.experts.iter().copied());
        }
        all
    }

    /// A router asks this worker to hold exactly `target` at `version`.
    ///
    /// # Errors
    /// A version not newer than every version committed or refused here, unless it repeats
    /// the hold served (the message for the refusal's announcement).
    pub fn plan(
        &self,
        version: u64,
        target: impl IntoIterator<Item = Expert>,
    ) -> Result<HoldPlan, String> {
        let target: BTreeSet<Expert> = target.into_iter().collect();
        let repeat = version == self.version && target == self.serving;
        if !repeat && version <= self.newest {
            return Err(format!(
                "a hold of version {version} is not newer than version {} used here (the set \
                 served is version {}); ask again from the current placement",
                self.newest, self.version
            ));
        }
        let loaded = self.loaded();
        Ok(HoldPlan {
            version,
            load: target.difference(&loaded).copied().collect(),
            target,
        })
    }

    /// `plan`'s gains are loaded: serve its set from now on (announce it to every router).
    /// What it drops is freed, and the version settled, once every router of `connected` has
    /// confirmed a version at least this one (at once when none is connected).
    pub fn commit(
        &mut self,
        plan: HoldPlan,
        connected: impl IntoIterator<Item = u32>,
    ) -> Confirmed {
        let dropped: BTreeSet<Expert> = self.serving.difference(&plan.target).copied().collect();
        // Anything asked for again is served again (it is still loaded).
        for r in &mut self.pending {
            r.experts.retain(|e| !plan.target.contains(e));
        }
        self.version = plan.version;
        self.newest = self.newest.max(plan.version);
        self.serving = plan.target;
        self.pending.push(Pending {
            version: plan.version,
            experts: dropped,
            waiting: connected.into_iter().collect(),
        });
        self.take_done()
    }

    /// Router `router` confirmed it routes by this worker's set of `version` (or later).
    pub fn on_seen(&mut self, router: u32, version: u64) -> Confirmed {
        for r in self.pending.iter_mut().filter(|r| r.version <= version) {
            r.waiting.remove(&router);
        }
        self.take_done()
    }

    /// The link to `router` is gone (its queued dispatches with it).
    pub fn on_router_lost(&mut self, router: u32) -> Confirmed {
        for r in &mut self.pending {
            r.waiting.remove(&router);
        }
        self.take_done()
    }

    fn take_done(&mut self) -> Confirmed {
        let mut out = Confirmed::default();
        self.pending.retain(|r| {
            let done = r.waiting.is_empty();
            if done {
                out.free.extend(r.experts.iter().copied());
                out.settled = out.settled.max(Some(r.version));
            }
            !done
        });
        out.free.sort_unstable();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(v: &[u32]) -> Vec<Expert> {
        v.iter().map(|&e| (1, e)).collect()
    }

    #[test]
    fn a_dropped_expert_is_freed_only_after_every_connected_router_confirmed() {
        let mut h = Holdings::new(set(&[0, 1]));
        // Step 1: gain 2 (nothing dropped).
        let p = h.plan(1, set(&[0, 1, 2])).unwrap();
        assert_eq!(p.load, set(&[2]));
        assert_eq!(h.commit(p, [0, 1]), Confirmed::default());
        // Step 2: drop 0 and 1.
        let p = h.plan(2, set(&[2])).unwrap();
        assert!(p.load.is_empty());
        assert_eq!(h.commit(p, [0, 1]), Confirmed::default());
        assert_eq!((h.version(), h.serving(), h.releasing()), (2, set(&[2]), 2));
        // Router 0 confirms version 1: not settled (router 1 has not); then version 2.
        assert_eq!(h.on_seen(0, 1), Confirmed::default());
        assert_eq!(h.on_seen(0, 2), Confirmed::default());
        // Router 1 confirms version 1: settled, nothing to free.
        let one = Confirmed {
            free: vec![],
            settled: Some(1),
        };
        assert_eq!(h.on_seen(1, 1), one);
        // Router 1's link is lost: its queued work is gone, so the experts are freed.
        let two = Confirmed {
            free: set(&[0, 1]),
            settled: Some(2),
        };
        assert_eq!(h.on_router_lost(1), two);
        assert_eq!(h.releasing(), 0);
    }

    #[test]
    fn an_expert_asked_back_while_releasing_is_served_again_without_a_load() {
        let mut h = Holdings::new(set(&[0, 1]));
        let p = h.plan(1, set(&[0])).unwrap();
        assert_eq!(h.commit(p, [0]), Confirmed::default());
        let p = h.plan(2, set(&[0, 1])).unwrap();
        assert!(p.load.is_empty(), "{p:?}");
        assert_eq!(h.commit(p, [0]), Confirmed::default());
        // The confirmation frees nothing: 1 is served again. It settles both versions.
        let settled = h.on_seen(0, 2);
        assert_eq!((settled.free, settled.settled), (vec![], Some(2)));
        assert_eq!((h.serving(), h.releasing()), (set(&[0, 1]), 0));
        // With no router connected, a drop is freed and settled at once.
        let p = h.plan(3, set(&[1])).unwrap();
        let now = h.commit(p, []);
        assert_eq!((now.free, now.settled), (set(&[0]), Some(3)));
    }

    #[test]
    fn an_older_hold_or_another_set_at_the_same_version_is_refused() {
        let mut h = Holdings::new(set(&[0]));
        let p = h.plan(4, set(&[0, 1])).unwrap();
        assert_eq!(h.commit(p, []).settled, Some(4));
        assert!(h.plan(3, set(&[0])).unwrap_err().contains("not newer"));
        assert!(h.plan(4, set(&[1])).is_err());
        // The same hold again (a repeated message) is accepted and changes nothing.
        let p = h.plan(4, set(&[0, 1])).unwrap();
        assert!(p.load.is_empty());
        assert_eq!(h.commit(p, [0]), Confirmed::default());
        assert_eq!((h.version(), h.serving()), (4, set(&[0, 1])));
    }

    #[test]
    fn a_refused_version_is_never_used_again_so_an_old_confirmation_confirms_nothing_new() {
        let mut h = Holdings::new(set(&[0, 1]));
        // Version 5 refused (say, no room): the set stays at version 0.
        assert!(h.plan(5, set(&[0, 1, 2])).is_ok());
        h.refused(5);
        assert_eq!((h.version(), h.newest()), (0, 5));
        // A later change numbered 5 again (a restarted coordinator) is refused too ...
        assert!(
            h.plan(5, set(&[1]))
                .unwrap_err()
                .contains("not newer than version 5")
        );
        // ... and one above it is taken; a router's confirmation of the refused version 5
        // (sent for the refusal's announcement) does not confirm it.
        let p = h.plan(6, set(&[1])).unwrap();
        assert_eq!(h.commit(p, [0]), Confirmed::default());
        assert_eq!(h.on_seen(0, 5), Confirmed::default());
        assert_eq!(h.releasing(), 1);
        let done = h.on_seen(0, 6);
        assert_eq!((done.free, done.settled), (set(&[0]), Some(6)));
        assert_eq!((h.version(), h.newest()), (6, 6));
    }
}
