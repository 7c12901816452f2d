//! Dispatch planning: which device receives which tokens, with which of their experts.
//!
//! Why this exists: the router must send each token's activations only to devices that own the
//! token's chosen experts, once per device however many of its experts live there, and pick a
//! replica when several devices own an expert. This module is pure (no I/O, no clock): routing
//! and ownership in, per-device plans out, so it is property-tested against its invariants.
//!
//! Replica choice for a (token, slot), in order of preference: a live owner that this token is
//! already being sent to (no extra copy of the activations); with per-node dedup, a live owner
//! on a node this token already goes to; a live owner on the router's own
//! node (locality); the live owner with the least outstanding work (`Replicas::load` plus what
//! this plan already assigned); ties go to the lower rank. Dead devices are never chosen.
//!
//! Per-node dedup ([`Replicas::node_dedup`]): after replica choice, the plans of every remote
//! node (not the router's own) that receives work on two or more devices are merged into one
//! plan for the lowest of those ranks, the node's leader for this batch; so a token crosses the
//! network once per node, and the leader fans its pairs out to the node's devices over shared
//! memory (the worker's `fanout`). The merged plan keeps token-major, slot-order pairs, so the
//! router places the leader's result rows exactly as it would place each device's.

use crate::gating::Routing;

/// Owners of every expert of one layer: `owners[e]` lists the mesh ranks holding expert `e`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LayerOwners {
    /// Per expert, the ranks holding it (non-empty in a valid placement).
    pub owners: Vec<Vec<u32>>,
}

/// Live state used to choose replicas.
#[derive(Clone, Debug)]
pub struct Replicas {
    /// Outstanding (token, expert) pairs per rank.
    pub load: Vec<u64>,
    /// False for ranks currently considered dead.
    pub alive: Vec<bool>,
    /// Node index of each rank.
    pub node: Vec<u32>,
    /// The router's node, for locality.
    pub local_node: Option<u32>,
    /// Merge the plans of each remote node into one for a leader device of that node (the
    /// workers fan out over shared memory).
    pub node_dedup: bool,
}

impl Replicas {
    /// All ranks alive, no load, no locality information.
    pub fn new(ranks: usize) -> Self {
        Self {
            load: vec![0; ranks],
            alive: vec![true; ranks],
            node: vec![0; ranks],
            local_node: None,
            node_dedup: false,
        }
    }
}

/// Everything one device receives for one batch.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DevicePlan {
    /// Destination rank.
    pub rank: u32,
    /// Batch token indices sent to this device, ascending.
    pub tokens: Vec<u32>,
    /// Number of (expert, weight) pairs for each token in `tokens`.
    pub counts: Vec<u32>,
    /// Expert of each pair, token-major, in slot order within a token.
    pub experts: Vec<u32>,
    /// Routing weight of each pair.
    pub weights: Vec<f32>,
    /// Slot index (0..k) of each pair within its token.
    pub slots: Vec<u32>,
}

impl DevicePlan {
    /// Number of (token, expert) pairs.
    pub fn pairs(&self) -> usize {
        self.experts.len()
    }

    /// Iterate pairs as (batch token, slot) in the plan's order (the worker's output-row order).
    pub fn pair_targets(&self) -> impl Iterator<Item = (u32, u32)> + '_ {
        self.tokens
            .iter()
            .zip(&self.counts)
            .flat_map(|(&t, &c)| std::iter::repeat_n(t, c as usize))
            .zip(self.slots.iter().copied())
    }
}

/// Why a plan could not be made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PlanError {
    /// An expert has no live owner.
    #[error(
        "expert {expert} has no live owner (owners: {owners:?}); the device(s) holding it are down and the placement has no other replica"
    )]
    NoLiveOwner {
        /// The expert.
        expert: u32,
        /// Its owners (all dead).
        owners: Vec<u32>,
    },
    /// An expert id outside the layer.
    #[error("expert {expert} is outside the layer's {experts} experts")]
    UnknownExpert {
        /// The expert.
        expert: u32,
        /// Experts in the layer.
        experts: usize,
    },
}

/// Plan a batch. `only` restricts planning to the given (token, slot) pairs (for re-dispatching
/// the share of a failed device); `None` plans every pair of `routing`.
pub fn plan_dispatch(
    routing: &Routing,
    owners: &LayerOwners,
    replicas: &Replicas,
    only: Option<&[(u32, u32)]>,
) -> Result<Vec<DevicePlan>, PlanError> {
    let ranks = replicas.alive.len();
    let k = routing.top_k;
    let all = routing.tokens() as u32;
    let pairs = || -> Box<dyn Iterator<Item = (u32, u32)> + '_> {
        match only {
            Some(list) => Box::new(list.iter().copied()),
            None => Box::new((0..all).flat_map(move |t| (0..k as u32).map(move |s| (t, s)))),
        }
    };
    // Pass 1: the destination of every pair, and per rank its pair and token counts.
    let n_pairs = only.map_or(all as usize * k, <[_]>::len);
    let mut dest: Vec<u32> = Vec::with_capacity(n_pairs);
    let mut extra = vec![0u64; ranks];
    let mut last_token = vec![u32::MAX; ranks];
    let mut token_count = vec![0usize; ranks];
    // Destinations already chosen for the current token (small: at most k).
    let mut token_dests: Vec<u32> = Vec::with_capacity(k);
    let mut current_token = u32::MAX;
    for (t, s) in pairs() {
        if t != current_token {
            current_token = t;
            token_dests.clear();
        }
        let expert = routing.experts_of(t as usize)[s as usize];
        let chosen = choose_owner(expert, owners, replicas, &extra, &token_dests)?;
        extra[chosen as usize] += 1;
        if !token_dests.contains(&chosen) {
            token_dests.push(chosen);
        }
        if last_token[chosen as usize] != t {
            last_token[chosen as usize] = t;
            token_count[chosen as usize] += 1;
        }
        dest.push(chosen);
    }
    // Pass 2: fill plans sized exactly, in ascending rank order.
    let mut plan_of: Vec<Option<usize>> = vec![None; ranks];
    let mut plans: Vec<DevicePlan> = Vec::with_capacity(extra.iter().filter(|&&n| n > 0).count());
    for r in (0..ranks).filter(|&r| extra[r] > 0) {
        plan_of[r] = Some(plans.len());
        let (p, tk) = (extra[r] as usize, token_count[r]);
        plans.push(DevicePlan {
            rank: r as u32,
            tokens: Vec::with_capacity(tk),
            counts: Vec::with_capacity(tk),
            experts: Vec::with_capacity(p),
            weights: Vec::with_capacity(p),
            slots: Vec::with_capacity(p),
        });
    }
    for ((t, s), &r) in pairs().zip(&dest) {
        let p = &mut plans[plan_of[r as usize].expect("counted in pass 1")];
        if p.tokens.last() != Some(&t) {
            p.tokens.push(t);
            p.counts.push(0);
        }
        *p.counts.last_mut().expect("pushed above") += 1;
        p.experts.push(routing.experts_of(t as usize)[s as usize]);
        p.weights.push(routing.weights_of(t as usize)[s as usize]);
        p.slots.push(s);
    }
    if replicas.node_dedup {
        plans = merge_per_node(plans, replicas);
    }
    Ok(plans)
}

/// Merges the plans of each remote node with two or more planned devices into one plan for
/// the lowest of those ranks; plans stay in ascending rank order.
fn merge_per_node(plans: Vec<DevicePlan>, replicas: &Replicas) -> Vec<DevicePlan> {
    let node_of = |r: u32| replicas.node.get(r as usize).copied();
    let remote =
        |p: &DevicePlan| node_of(p.rank).is_some() && node_of(p.rank) != replicas.local_node;
    let shares_node = |p: &DevicePlan, all: &[DevicePlan]| {
        all.iter()
            .any(|q| q.rank != p.rank && node_of(q.rank) == node_of(p.rank))
    };
    if !plans.iter().any(|p| remote(p) && shares_node(p, &plans)) {
        return plans;
    }
    let mut out: Vec<DevicePlan> = Vec::with_capacity(plans.len());
    let mut groups: Vec<(u32, Vec<DevicePlan>)> = Vec::new();
    for p in plans {
        if !remote(&p) {
            out.push(p);
            continue;
        }
        let n = node_of(p.rank).expect("remote plans have a node");
        match groups.iter_mut().find(|(gn, _)| *gn == n) {
            Some((_, g)) => g.push(p),
            None => groups.push((n, vec![p])),
        }
    }
    for (_, g) in groups {
        out.push(if g.len() == 1 {
            g.into_iter().next().expect("one plan")
        } else {
            merge_plans(&g)
        });
    }
    out.sort_by_key(|p| p.rank);
    out
}

/// One plan holding every pair of `plans` (all for one node), addressed to the lowest rank:
/// tokens ascending, each token's pairs in slot order.
fn merge_plans(plans: &[DevicePlan]) -> DevicePlan {
    // (token, slot, expert, weight) of every pair; a (token, slot) is in exactly one plan.
    let mut pairs: Vec<(u32, u32, u32, f32)> =
        Vec::with_capacity(plans.iter().map(DevicePlan::pairs).sum());
    for p in plans {
        for (i, (t, s)) in p.pair_targets().enumerate() {
            pairs.push((t, s, p.experts[i], p.weights[i]));
        }
    }
    pairs.sort_unstable_by_key(|&(t, s, _, _)| (t, s));
    let mut m = DevicePlan {
        rank: plans.iter().map(|p| p.rank).min().expect("non-empty"),
        ..DevicePlan::default()
    };
    for (t, s, e, w) in pairs {
        if m.tokens.last() != Some(&t) {
            m.tokens.push(t);
            m.counts.push(0);
        }
        *m.counts.last_mut().expect("pushed above") += 1;
        m.experts.push(e);
        m.weights.push(w);
        m.slots.push(s);
    }
    m
}

/// The rank that receives `expert` for the current token (see the module docs for the order of
/// preference); `extra` is what this plan already assigned per rank.
fn choose_owner(
    expert: u32,
    owners: &LayerOwners,
    replicas: &Replicas,
    extra: &[u64],
    token_dests: &[u32],
) -> Result<u32, PlanError> {
    let ranks = replicas.alive.len();
    let Some(cands) = owners.owners.get(expert as usize) else {
        return Err(PlanError::UnknownExpert {
            expert,
            experts: owners.owners.len(),
        });
    };
    let live = || {
        cands
            .iter()
            .copied()
            .filter(|&r| (r as usize) < ranks && replicas.alive[r as usize])
    };
    let least_loaded = |r: &u32| (replicas.load[*r as usize] + extra[*r as usize], *r);
    let node = |r: u32| replicas.node.get(r as usize).copied();
    live()
        .find(|r| token_dests.contains(r))
        .or_else(|| {
            // with per-node dedup, a node this token already goes to costs no extra copy
            if !replicas.node_dedup {
                return None;
            }
            live()
                .filter(|&r| token_dests.iter().any(|&d| node(d) == node(r)))
                .min_by_key(least_loaded)
        })
        .or_else(|| {
            let local = replicas.local_node.and_then(|n| {
                live()
                    .filter(|&r| replicas.node[r as usize] == n)
                    .min_by_key(least_loaded)
            });
            local.or_else(|| live().min_by_key(least_loaded))
        })
        .ok_or_else(|| PlanError::NoLiveOwner {
            expert,
            owners: cands.clone(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn routing_strategy(experts: u32, k: usize) -> impl Strategy<Value = Routing> {
        (1usize..20).prop_flat_map(move |tokens| {
            prop::collection::vec(
                prop::sample::subsequence((0..experts).collect::<Vec<_>>(), k).prop_shuffle(),
                tokens,
            )
            .prop_map(move |sets| Routing {
                top_k: k,
                experts: sets.concat(),
                weights: (0..sets.len() * k).map(|i| i as f32 * 0.5).collect(),
            })
        })
    }

    fn owners_strategy(experts: u32, ranks: u32) -> impl Strategy<Value = LayerOwners> {
        prop::collection::vec(
            prop::sample::subsequence((0..ranks).collect::<Vec<_>>(), 1..=2),
            experts as usize,
        )
        .prop_map(|owners| LayerOwners { owners })
    }

    proptest! {
        #[test]
        fn every_pair_planned_once_to_a_live_owner(
            routing in routing_strategy(12, 3),
            owners in owners_strategy(12, 5),
            dead in prop::collection::vec(any::<bool>(), 5),
            load in prop::collection::vec(0u64..10, 5),
        ) {
            let mut rep = Replicas::new(5);
            rep.alive = dead.iter().map(|d| !d).collect();
            rep.load = load;
            let any_unplaceable = routing.experts.iter().any(|&e| owners.owners[e as usize].iter().all(|&r| !rep.alive[r as usize]));
            match plan_dispatch(&routing, &owners, &rep, None) {
                Err(PlanError::NoLiveOwner { expert, .. }) => {
                    prop_assert!(any_unplaceable);
                    prop_assert!(owners.owners[expert as usize].iter().all(|&r| !rep.alive[r as usize]));
                }
                Err(e) => prop_assert!(false, "unexpected {e}"),
                Ok(plans) => {
                    prop_assert!(!any_unplaceable);
                    let mut seen = vec![false; routing.experts.len()];
                    for p in &plans {
                        prop_assert!(rep.alive[p.rank as usize]);
                        // tokens ascending and unique per device
                        prop_assert!(p.tokens.windows(2).all(|w| w[0] < w[1]));
                        prop_assert_eq!(p.counts.iter().sum::<u32>() as usize, p.pairs());
                        let mut last = (u32::MAX, 0u32);
                        for (i, (t, s)) in p.pair_targets().enumerate() {
                            let idx = t as usize * routing.top_k + s as usize;
                            prop_assert!(!seen[idx], "pair planned twice");
                            seen[idx] = true;
                            prop_assert_eq!(p.experts[i], routing.experts[idx]);
                            prop_assert_eq!(p.weights[i], routing.weights[idx]);
                            prop_assert!(owners.owners[p.experts[i] as usize].contains(&p.rank));
                            // slot order within a token
                            if last.0 == t { prop_assert!(s > last.1); }
                            last = (t, s);
                        }
                    }
                    prop_assert!(seen.iter().all(|&s| s), "a pair was not planned");
                    // dedup: a token goes to a device only if no already-chosen device of that
                    // token could have served the expert (checked for the first-choice rule)
                    prop_assert!(plans.windows(2).all(|w| w[0].rank < w[1].rank));
                }
            }
        }
    }

    #[test]
    fn replicas_balance_by_load_and_prefer_local() {
        let routing = Routing {
            top_k: 1,
            experts: vec![0, 0, 0, 0],
            weights: vec![1.0; 4],
        };
        let owners = LayerOwners {
            owners: vec![vec![0, 1]],
        };
        let mut rep = Replicas::new(2);
        let plans = plan_dispatch(&routing, &owners, &rep, None).unwrap();
        assert_eq!(
            plans.len(),
            2,
            "four tokens on a replicated expert spread over both owners"
        );
        assert_eq!(plans[0].pairs(), 2);
        rep.load = vec![10, 0];
        let plans = plan_dispatch(&routing, &owners, &rep, None).unwrap();
        assert_eq!(plans.len(), 1);
        assert_eq!(plans[0].rank, 1, "the loaded replica is avoided");
        rep.load = vec![0, 0];
        rep.node = vec![0, 1];
        rep.local_node = Some(1);
        let plans = plan_dispatch(&routing, &owners, &rep, None).unwrap();
        assert_eq!(plans.len(), 1);
        assert_eq!(
            plans[0].rank, 1,
            "the replica on the router's node is preferred"
        );
        rep.alive = vec![true, false];
        let plans = plan_dispatch(&routing, &owners, &rep, None).unwrap();
        assert_eq!(plans[0].rank, 0, "a dead replica is never chosen");
    }

    #[test]
    fn a_token_is_sent_once_per_device() {
        // token 0 chooses experts 0 and 1, both on rank 2 (and expert 1 also on rank 0)
        let routing = Routing {
            top_k: 2,
            experts: vec![0, 1],
            weights: vec![0.6, 0.4],
        };
        let owners = LayerOwners {
            owners: vec![vec![2], vec![0, 2]],
        };
        let plans = plan_dispatch(&routing, &owners, &Replicas::new(3), None).unwrap();
        assert_eq!(plans.len(), 1);
        assert_eq!(plans[0].rank, 2);
        assert_eq!(plans[0].tokens, vec![0]);
        assert_eq!(plans[0].counts, vec![2]);
        assert_eq!(plans[0].slots, vec![0, 1]);
    }

    #[test]
    fn replan_only_the_failed_share() {
        let routing = Routing {
            top_k: 2,
            experts: vec![0, 1, 1, 0],
            weights: vec![1.0; 4],
        };
        let owners = LayerOwners {
            owners: vec![vec![0], vec![1, 2]],
        };
        let mut rep = Replicas::new(3);
        rep.load = vec![0, 0, 5];
        let plans = plan_dispatch(&routing, &owners, &rep, None).unwrap();
        let failed = plans.iter().find(|p| p.rank == 1).unwrap();
        let share: Vec<(u32, u32)> = failed.pair_targets().collect();
        rep.alive[1] = false;
        let again = plan_dispatch(&routing, &owners, &rep, Some(&share)).unwrap();
        assert_eq!(again.len(), 1);
        assert_eq!(again[0].rank, 2);
        assert_eq!(again[0].pair_targets().collect::<Vec<_>>(), share);
    }

    proptest! {
        /// Per-node dedup: every pair still planned exactly once to a live owner's node, at
        /// most one plan per remote node (addressed to one of that node's planned devices),
        /// tokens ascending and each token's slots ascending in every plan.
        #[test]
        fn node_dedup_sends_each_remote_node_one_plan(
            routing in routing_strategy(12, 3),
            owners in owners_strategy(12, 6),
            dead in prop::collection::vec(any::<bool>(), 6),
        ) {
            let mut rep = Replicas::new(6);
            rep.alive = dead.iter().map(|d| !d).collect();
            rep.node = vec![0, 0, 1, 1, 2, 2];
            rep.local_node = Some(0);
            rep.node_dedup = true;
            let Ok(plans) = plan_dispatch(&routing, &owners, &rep, None) else {
                return Ok(());
            };
            let mut seen = std::collections::HashSet::new();
            let mut remote_nodes = std::collections::HashSet::new();
            for p in &plans {
                prop_assert!(rep.alive[p.rank as usize]);
                let n = rep.node[p.rank as usize];
                if n != 0 {
                    prop_assert!(remote_nodes.insert(n), "two plans for node {}", n);
                }
                prop_assert!(p.tokens.windows(2).all(|w| w[0] < w[1]));
                let mut i = 0;
                for (&t, &c) in p.tokens.iter().zip(&p.counts) {
                    let slots = &p.slots[i..i + c as usize];
                    prop_assert!(slots.windows(2).all(|w| w[0] < w[1]));
                    for (j, &sl) in slots.iter().enumerate() {
                        let e = p.experts[i + j];
                        prop_assert_eq!(e, routing.experts_of(t as usize)[sl as usize]);
                        prop_assert_eq!(p.weights[i + j], routing.weights_of(t as usize)[sl as usize]);
                        // a live owner of the expert is on the plan's node
                        let on_node = owners.owners[e as usize]
                            .iter()
                            .any(|&o| rep.alive[o as usize] && rep.node[o as usize] == n);
                        prop_assert!(on_node);
                        prop_assert!(seen.insert((t, sl)));
                    }
                    i += c as usize;
                }
            }
            prop_assert_eq!(seen.len(), routing.tokens() * routing.top_k);
        }
    }

    #[test]
    fn node_dedup_merges_one_tokens_pairs_on_a_remote_node() {
        // token 0: experts 0 (rank 2) and 1 (rank 3), both on remote node 1
        let routing = Routing {
            top_k: 2,
            experts: vec![0, 1],
            weights: vec![0.75, 0.25],
        };
        let owners = LayerOwners {
            owners: vec![vec![2], vec![3]],
        };
        let mut rep = Replicas::new(4);
        rep.node = vec![0, 0, 1, 1];
        rep.local_node = Some(0);
        let plain = plan_dispatch(&routing, &owners, &rep, None).unwrap();
        assert_eq!(plain.len(), 2, "without dedup one plan per device");
        rep.node_dedup = true;
        let merged = plan_dispatch(&routing, &owners, &rep, None).unwrap();
        assert_eq!(merged.len(), 1);
        assert_eq!(merged[0].rank, 2, "the lowest planned rank leads");
        assert_eq!(merged[0].experts, vec![0, 1]);
        assert_eq!(merged[0].slots, vec![0, 1]);
        assert_eq!(merged[0].weights, vec![0.75, 0.25]);
        // the router's own node is never merged
        rep.local_node = Some(1);
        assert_eq!(
            plan_dispatch(&routing, &owners, &rep, None).unwrap().len(),
            2
        );
    }
}
