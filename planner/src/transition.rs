//! The order of a live placement change: which experts each device loads, when the routers
//! switch, and which experts each device frees, so that no device ever holds more than its
//! memory and no expert is ever without an owner.
//!
//! Why this exists: a running fabric changes placement (a rebalance for skewed traffic, a
//! device added or drained) while it serves. A device can load the experts it gains only into
//! memory it has free next to the ones it still serves, and may free an expert only once
//! another device serves it. When every gainer has room the change is one step: load every
//! gain, switch, free every loss. When some device is full, the change needs several steps
//! and sometimes a temporary replica on a third device that covers an expert while its owner
//! makes room ("free first, then load, with the replica that covers the gap").
//!
//! # The plan
//!
//! A [`Transition`] is a list of [`Step`]s from the old placement to the new one. Each step:
//!
//! 1. every device loads its step's experts (its gains that fit now, and any covering
//!    replicas) while serving what it holds;
//! 2. the routers switch, layer by layer, to the step's placement: every expert's owners are
//!    the devices that hold it after the loads, less the ones that free it in this step;
//! 3. once no part still needs them, the devices free the step's experts.
//!
//! So during a step a device holds what it held before plus its loads ([`Step::peak_slots`]
//! is at most its budget), and after it what the step's placement gives it. Every step's
//! placement gives every expert of every layer at least one owner.
//!
//! # How it is found
//!
//! Batched first: each step loads every gain that fits (gains whose expert another device
//! must free first, so that device can free it and make room), then frees every loss whose
//! expert keeps another owner. When neither is possible, a full device that waits to load
//! holds an expert that only it serves; a device with a free slot takes a covering replica
//! of it, so the waiting device frees it and loads its gain in the next step.
//!
//! When that runs out of room (free slots used up by gains before a swap needed them), one
//! expert at a time ([`one_at_a_time`]): drop every replica beyond one per expert, move each
//! expert that is not on a new owner through a free slot, then load the new placement's
//! other replicas. That finds an order whenever one exists: it is refused
//! ([`TransitionError::NoRoom`]) only when one replica per expert fills every slot, where no
//! expert can be loaded or freed at all. Tests replay every plan and compare feasibility with
//! a breadth-first search over single moves (load onto a free slot, or free an expert another
//! device holds) on small cases.
//!
//! # Moving fewer weights
//!
//! A plan made from load statistics knows nothing of what is served now: [`keep_in_place`]
//! changes it, before the transition is planned, so that devices keep the experts they hold
//! where the plan's balance allows (each device keeps its expert count; the busiest device
//! stays within a given slack of the plan's, [`REPACK_SLACK`] by default). `expertmesh plan
//! --from` does both (`--move-slack` sets the slack).
//!
//! Limits: shared experts stay where they are (a change of their location is an error), and
//! every routed expert costs the model's one expert size. The fabric does not apply these
//! steps to running workers and routers yet (issue 29).

use crate::stats::{CoSelection, LoadStats};
use expertmesh_topology::model::ModelSpec;
use expertmesh_topology::placement::{Placement, SharedLocation};
use expertmesh_topology::topology::{DeviceRank, Topology};
use std::collections::BTreeSet;

/// One expert on one device, in a step's loads or frees.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Move {
    /// The device.
    pub device: DeviceRank,
    /// The MoE layer id.
    pub layer: u32,
    /// The routed expert.
    pub expert: u32,
    /// A load of a temporary replica: the new placement does not give this device the expert,
    /// which it holds only until the expert's final owners have it (always false for frees).
    pub cover: bool,
}

/// One step of a transition (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Step {
    /// What the devices load before the switch.
    pub loads: Vec<Move>,
    /// What they free after it.
    pub frees: Vec<Move>,
    /// The routed experts of every layer the routers switch to: `[layer index][device rank]`
    /// → experts in ascending order (the layers are the model's MoE layers, in order).
    pub owners: Vec<Vec<Vec<u32>>>,
    /// Per device rank, routed-expert slots in use at the step's peak (after the loads,
    /// before the frees).
    pub peak_slots: Vec<u64>,
}

/// An ordered placement change (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Transition {
    /// The steps, in order; empty when the placements are equal.
    pub steps: Vec<Step>,
    /// Per device rank, how many routed experts fit next to its shared experts.
    pub slots: Vec<u64>,
    /// Per device rank, routed experts held before the change.
    pub before: Vec<u64>,
}

impl Transition {
    /// Expert loads over all steps (what moves over the fabric or from disk).
    pub fn loads(&self) -> usize {
        self.steps.iter().map(|s| s.loads.len()).sum()
    }

    /// Per device rank, the most routed experts held at once during the change (before it,
    /// or at a step's peak).
    pub fn peak_slots(&self) -> Vec<u64> {
        (0..self.slots.len())
            .map(|r| {
                let steps = self.steps.iter().map(|s| s.peak_slots[r]);
                steps.fold(self.before[r], u64::max)
            })
            .collect()
    }
}

/// Why a placement change cannot be planned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransitionError {
    /// The placements are not of the same model on the same devices.
    #[error("the placements differ in {what}: both must be of the same model and topology")]
    Mismatch {
        /// What differs.
        what: &'static str,
    },
    /// A live change keeps shared experts where they are.
    #[error(
        "layer {layer}'s shared experts move ({from} -> {to}): a live placement change keeps \
         shared experts in place; restart the fabric with the new placement instead"
    )]
    SharedMoved {
        /// The MoE layer id.
        layer: u32,
        /// The old location.
        from: String,
        /// The new location.
        to: String,
    },
    /// The old or the new placement gives a device more experts than its memory holds.
    #[error(
        "device rank {device} would hold {held} routed experts but has room for {slots}: the \
         {which} placement does not fit"
    )]
    DoesNotFit {
        /// The device.
        device: DeviceRank,
        /// Experts it would hold.
        held: u64,
        /// Experts it has room for.
        slots: u64,
        /// "old" or "new".
        which: &'static str,
    },
    /// A drained device runs shared experts, which a live change keeps in place.
    #[error(
        "device rank {device} runs layer {layer}'s shared experts: a live change keeps shared \
         experts in place, so it cannot be drained; restart the fabric with a placement that \
         runs them elsewhere"
    )]
    DrainsShared {
        /// The device.
        device: DeviceRank,
        /// The layer.
        layer: u32,
    },
    /// A drained device holds an expert no other device has room for.
    #[error(
        "layer {layer} expert {expert} is held only by the drained device rank {device} and no \
         other device has a free expert slot for it; free memory elsewhere (or add a device) first"
    )]
    NoRoomToDrain {
        /// The drained device.
        device: DeviceRank,
        /// The layer.
        layer: u32,
        /// The expert.
        expert: u32,
    },
    /// Every device is full and every expert that must move has one owner.
    #[error(
        "every device is full even with one replica per expert: device rank {device} must \
         free layer {layer} expert {expert} before it can load what it gains, and no other \
         device has a free expert slot to hold that expert meanwhile; free memory on some \
         device (or add one) and try again"
    )]
    NoRoom {
        /// A device that must free an expert.
        device: DeviceRank,
        /// The layer.
        layer: u32,
        /// The expert.
        expert: u32,
    },
}

/// Plan the live change from `old` to `new`, two placements of `model` on `topology`.
pub fn transition(
    topology: &Topology,
    model: &ModelSpec,
    old: &Placement,
    new: &Placement,
) -> Result<Transition, TransitionError> {
    let layers = check_same(old, new)?;
    let slots = routed_slots(topology, model, old);
    let (state, target) = (
        held_sets(topology, old, &layers),
        held_sets(topology, new, &layers),
    );
    for (which, p) in [("old", &state), ("new", &target)] {
        for (r, &room) in slots.iter().enumerate() {
            let n = count(p, r);
            if n > room {
                return Err(TransitionError::DoesNotFit {
                    device: DeviceRank(r as u32),
                    held: n,
                    slots: room,
                    which,
                });
            }
        }
    }
    // Batched first (fewest steps); if that runs out of room, one expert at a time, which
    // finds an order whenever one exists.
    let steps = plan_steps(&layers, &slots, &state, &target)
        .or_else(|_| one_at_a_time(&layers, &slots, &state, &target))?;
    let before = (0..slots.len()).map(|r| count(&state, r)).collect();
    Ok(Transition {
        steps,
        slots,
        before,
    })
}

/// The batched steps from `state` to `target`, or an error where they run out of room (the
/// caller then goes one expert at a time).
fn plan_steps(
    layers: &[u32],
    slots: &[u64],
    state: &[Vec<BTreeSet<u32>>],
    target: &[Vec<BTreeSet<u32>>],
) -> Result<Vec<Step>, TransitionError> {
    let mut state = state.to_vec();
    let mut steps = Vec::new();
    // Progress: a step loads a gain, or frees a loss, or covers an expert so that a full
    // device can load a gain in the next step; a plan longer than this has stalled.
    let limit = 4 * (total(&state) + total(target)) as usize + 4;
    while state != target {
        if steps.len() > limit {
            let (li, r, e) = stuck_loss(slots, &state, target).unwrap_or((0, 0, 0));
            return Err(TransitionError::NoRoom {
                device: DeviceRank(r as u32),
                layer: layers[li],
                expert: e,
            });
        }
        let step = next_step(layers, slots, &state, target)?;
        apply(&mut state, &step, layers);
        steps.push(step);
    }
    Ok(steps)
}

/// What a live change sends for `owners` (`[layer index][device] → experts`, a step's or a
/// placement's): (mesh rank, layer, expert), the routers being mesh ranks `0..routers` and
/// device `d` mesh rank `routers + d`.
pub fn mesh_entries(
    topology: &Topology,
    model: &ModelSpec,
    owners: &[Vec<Vec<u32>>],
) -> Vec<(u32, u32, u32)> {
    let routers = (topology.routers().len() as u32).max(1);
    let mut out = Vec::new();
    for (layer, per_device) in model.moe_layer_ids().into_iter().zip(owners) {
        for (d, experts) in per_device.iter().enumerate() {
            out.extend(experts.iter().map(|&e| (routers + d as u32, layer, e)));
        }
    }
    out
}

/// [`mesh_entries`] of every device's experts in `placement`.
pub fn placement_mesh_entries(
    topology: &Topology,
    model: &ModelSpec,
    placement: &Placement,
) -> Vec<(u32, u32, u32)> {
    let owners: Vec<Vec<Vec<u32>>> = model
        .moe_layer_ids()
        .into_iter()
        .map(|l| {
            topology
                .devices()
                .iter()
                .map(|d| placement.experts_on(d.rank(), l).to_vec())
                .collect()
        })
        .collect();
    mesh_entries(topology, model, &owners)
}

/// `new` changed so that as many experts as possible stay on the device that serves them in
/// `old`, and a live change moves fewer weights, with each device keeping the same count (so
/// the same memory) and, `within_nodes`, each node the same experts (so the same traffic:
/// what a hierarchical plan chose). `load` and `coselect` are the statistics `new` was planned
/// with (uniform without).
///
/// Per layer and node (or the whole cluster), the better of two, by experts kept in place:
///
/// * **Swapped lists:** devices are interchangeable when they share a node, kind,
///   architecture and memory bandwidth and hold as many experts in the layer; their lists are
///   reassigned greedily by overlap with what each holds now. This changes no device's load
///   per unit of bandwidth.
/// * **Repacked:** each device keeps what it holds that the new plan still needs (heaviest
///   first, while its load stays under the cap below), the other replicas go, heaviest first,
///   to the device whose load per unit of bandwidth ends up lowest (never two replicas of an
///   expert on one device), and while the busiest device is over the cap its heaviest replica
///   is swapped for a lighter one elsewhere. Taken only if the busiest device stays within
///   `slack` (relative, e.g. [`REPACK_SLACK`]) of the plan's busiest; 0 takes a repack only
///   where it is no busier than the plan.
///
/// Errors as [`transition`] for placements of different models or clusters.
pub fn keep_in_place(
    topology: &Topology,
    model: &ModelSpec,
    old: &Placement,
    new: &Placement,
    how: &Keep<'_>,
) -> Result<Placement, TransitionError> {
    let Keep {
        load,
        coselect,
        within_nodes,
        slack,
    } = *how;
    let layers = check_same(old, new)?;
    let devices = topology.devices();
    let speed: Vec<f64> = devices.iter().map(|d| d.memory_bandwidth_gb_s()).collect();
    // Devices alike in all but their lists: node, kind and architecture, bandwidth.
    let alike: Vec<(usize, String, u64)> = devices
        .iter()
        .map(|d| {
            let kind = format!("{:?}/{}", d.kind(), d.arch());
            (d.node_index(), kind, d.memory_bandwidth_gb_s().to_bits())
        })
        .collect();
    let all_held = held_sets(topology, old, &layers);
    let mut slots = Vec::with_capacity(layers.len());
    for (li, &layer) in layers.iter().enumerate() {
        let lists: Vec<Vec<u32>> = devices
            .iter()
            .map(|d| new.experts_on(d.rank(), layer).to_vec())
            .collect();
        let held = &all_held[li];
        let mut out = swap_lists(&alike, &lists, held);
        // Per replica of each expert: its load shared by its replicas.
        let loads = crate::layer_loads(model, load, coselect, li);
        let mut replicas = vec![0u32; loads.len()];
        for &e in lists.iter().flatten() {
            replicas[e as usize] += 1;
        }
        let weight = |e: u32| loads[e as usize] / replicas[e as usize].max(1) as f64;
        // The whole cluster at once where a plan chose no node sets; then node by node (what
        // a hierarchical plan allows, and a second chance for a global one).
        let whole = (!within_nodes).then(|| (0..devices.len()).collect::<Vec<usize>>());
        let nodes = (0..topology.nodes().len()).map(|n| {
            (0..devices.len())
                .filter(|&r| devices[r].node_index() == n)
                .collect()
        });
        for members in whole.into_iter().chain(nodes) {
            let members: Vec<usize> = members;
            let busiest = |l: &[Vec<u32>]| -> f64 {
                let per = members
                    .iter()
                    .map(|&r| l[r].iter().map(|&e| weight(e)).sum::<f64>() / speed[r]);
                per.fold(0.0, f64::max)
            };
            let moved = |l: &[Vec<u32>]| -> usize {
                members
                    .iter()
                    .map(|&r| l[r].iter().filter(|e| !held[r].contains(e)).count())
                    .sum()
            };
            let cap = busiest(&lists) * (1.0 + slack.max(0.0));
            let Some(repacked) = repack_node(&members, &lists, held, &weight, &speed, cap) else {
                continue;
            };
            let mut candidate = out.clone();
            for (&r, list) in members.iter().zip(repacked) {
                candidate[r] = list;
            }
            if busiest(&candidate) <= cap && moved(&candidate) < moved(&out) {
                out = candidate;
            }
        }
        for list in &mut out {
            list.sort_unstable();
        }
        slots.push(out);
    }
    let shared = layers
        .iter()
        .filter_map(|&l| new.shared_location(l))
        .collect();
    let description = new.description().to_owned();
    Ok(Placement::new(topology, model, slots, shared, &description)
        .expect("each node keeps its experts and each device its count: still valid"))
}

/// `served` with device `device` emptied, for draining it from a running fabric: every
/// expert only it holds goes to another device with a free expert slot (the one holding the
/// fewest of that layer's experts, then the fewest overall, then the lower rank); every other
/// device keeps what it holds. Its shared experts cannot move live (an error).
pub fn drained(
    topology: &Topology,
    model: &ModelSpec,
    served: &Placement,
    device: DeviceRank,
) -> Result<Placement, TransitionError> {
    let layers = model.moe_layer_ids();
    let d = device.index();
    let n = topology.devices().len();
    if d >= n {
        return Err(TransitionError::Mismatch {
            what: "device count (the drained device is not in the topology)",
        });
    }
    let slots = routed_slots(topology, model, served);
    let mut lists: Vec<Vec<Vec<u32>>> = layers
        .iter()
        .map(|&l| {
            topology
                .devices()
                .iter()
                .map(|x| served.experts_on(x.rank(), l).to_vec())
                .collect()
        })
        .collect();
    let mut used: Vec<u64> = (0..n)
        .map(|r| lists.iter().map(|l| l[r].len() as u64).sum())
        .collect();
    for (li, &layer) in layers.iter().enumerate() {
        if served.shared_location(layer) == Some(SharedLocation::Device(device)) {
            return Err(TransitionError::DrainsShared { device, layer });
        }
        for e in std::mem::take(&mut lists[li][d]) {
            used[d] -= 1;
            if lists[li].iter().any(|list| list.contains(&e)) {
                continue;
            }
            let to = (0..n)
                .filter(|&r| r != d && used[r] < slots[r])
                .min_by_key(|&r| (lists[li][r].len(), used[r], r))
                .ok_or(TransitionError::NoRoomToDrain {
                    device,
                    layer,
                    expert: e,
                })?;
            lists[li][to].push(e);
            used[to] += 1;
        }
    }
    let shared = layers
        .iter()
        .filter_map(|&l| served.shared_location(l))
        .collect();
    let description = format!("{} (device rank {} drained)", served.description(), d);
    Ok(Placement::new(topology, model, lists, shared, &description)
        .expect("every device stays within its slots and every expert keeps an owner"))
}

/// How much busier (relative) than the plan's the busiest device may get by default when a
/// plan is repacked to keep experts in place.
pub const REPACK_SLACK: f64 = 0.02;

/// What [`keep_in_place`] keeps to: the statistics the new plan was made with (uniform
/// without), whether each node keeps the plan's experts (what a hierarchical plan chose), and
/// the balance slack.
#[derive(Clone, Copy, Debug)]
pub struct Keep<'a> {
    /// Expert-load statistics.
    pub load: Option<&'a LoadStats>,
    /// Co-selection statistics.
    pub coselect: Option<&'a CoSelection>,
    /// Keep each node's experts as the plan has them.
    pub within_nodes: bool,
    /// How much busier (relative) than the plan's busiest device any device may get.
    pub slack: f64,
}

/// `lists` reassigned among interchangeable devices (equal in `alike`: node, kind and
/// architecture, memory bandwidth; and holding as many) greedily by overlap with `held`, never
/// keeping fewer in place.
fn swap_lists(
    alike: &[(usize, String, u64)],
    lists: &[Vec<u32>],
    held: &[BTreeSet<u32>],
) -> Vec<Vec<u32>> {
    let n = lists.len();
    let class = |r: usize| (&alike[r], lists[r].len());
    let mut out = lists.to_vec();
    let mut done = vec![false; n];
    for r in 0..n {
        if done[r] {
            continue;
        }
        let members: Vec<usize> = (0..n).filter(|&o| class(o) == class(r)).collect();
        for &m in &members {
            done[m] = true;
        }
        // (overlap, receiving device, list's device), largest overlap first.
        let mut pairs: Vec<(usize, usize, usize)> = Vec::new();
        for (i, &a) in members.iter().enumerate() {
            for (j, &b) in members.iter().enumerate() {
                let overlap = lists[b].iter().filter(|e| held[a].contains(e)).count();
                if overlap > 0 {
                    pairs.push((overlap, i, j));
                }
            }
        }
        pairs.sort_unstable_by(|a, b| b.cmp(a));
        let (mut given, mut taken) = (vec![None; members.len()], vec![false; members.len()]);
        for (_, i, j) in pairs {
            if given[i].is_none() && !taken[j] {
                given[i] = Some(j);
                taken[j] = true;
            }
        }
        let mut rest = (0..members.len()).filter(|&j| !taken[j]);
        let pick: Vec<usize> = given
            .iter()
            .map(|g| g.unwrap_or_else(|| rest.next().expect("as many lists as devices")))
            .collect();
        // Greedy matching is not optimal: never keep fewer in place than the plan as given.
        let kept = |j: &dyn Fn(usize) -> usize| -> usize {
            (0..members.len())
                .map(|i| {
                    lists[members[j(i)]]
                        .iter()
                        .filter(|e| held[members[i]].contains(e))
                        .count()
                })
                .sum()
        };
        if kept(&|i| pick[i]) >= kept(&|i| i) {
            for (i, &j) in pick.iter().enumerate() {
                out[members[i]] = lists[members[j]].clone();
            }
        }
    }
    out
}

/// The replicas `lists` gives the devices `members`, repacked: each device keeps what it
/// `held` that is still to be placed (heaviest first, up to its count, while its load per unit
/// of `speed` stays at most `cap`), then the rest go heaviest first to the device with room
/// whose load per unit of speed ends up lowest, never two replicas of an expert on one device.
/// `None` if the greedy corners itself.
fn repack_node(
    members: &[usize],
    lists: &[Vec<u32>],
    held: &[BTreeSet<u32>],
    weight: &dyn Fn(u32) -> f64,
    speed: &[f64],
    cap: f64,
) -> Option<Vec<Vec<u32>>> {
    let mut left: std::collections::BTreeMap<u32, u32> = std::collections::BTreeMap::new();
    for &r in members {
        for &e in &lists[r] {
            *left.entry(e).or_default() += 1;
        }
    }
    let heavier = |a: &u32, b: &u32| weight(*b).total_cmp(&weight(*a)).then(a.cmp(b));
    let mut out: Vec<Vec<u32>> = vec![Vec::new(); members.len()];
    let mut sum = vec![0f64; members.len()];
    for (i, &r) in members.iter().enumerate() {
        let mut keep: Vec<u32> = held[r]
            .iter()
            .copied()
            .filter(|e| left.contains_key(e))
            .collect();
        keep.sort_by(heavier);
        for e in keep {
            let n = left.get_mut(&e)?;
            if out[i].len() < lists[r].len() && *n > 0 && (sum[i] + weight(e)) / speed[r] <= cap {
                *n -= 1;
                out[i].push(e);
                sum[i] += weight(e);
            }
        }
    }
    let mut rest: Vec<u32> = left
        .iter()
        .flat_map(|(&e, &n)| std::iter::repeat_n(e, n as usize))
        .collect();
    rest.sort_by(heavier);
    for e in rest {
        let i = (0..members.len())
            .filter(|&i| out[i].len() < lists[members[i]].len() && !out[i].contains(&e))
            .min_by(|&a, &b| {
                let at = |i: usize| (sum[i] + weight(e)) / speed[members[i]];
                at(a).total_cmp(&at(b))
            })?;
        out[i].push(e);
        sum[i] += weight(e);
    }
    settle(&mut out, &mut sum, members, weight, speed, cap);
    Some(out)
}

/// Swap replicas off the busiest device while it is above `cap`: its heaviest replica for a
/// lighter one of the device whose load ends lowest, when both end below the busiest's load
/// (counts unchanged, never two replicas of an expert on one device; at most one pass of
/// swaps per replica).
fn settle(
    out: &mut [Vec<u32>],
    sum: &mut [f64],
    members: &[usize],
    weight: &dyn Fn(u32) -> f64,
    speed: &[f64],
    cap: f64,
) {
    let norm = |sum: &[f64], i: usize| sum[i] / speed[members[i]];
    for _ in 0..out.iter().map(Vec::len).sum::<usize>() {
        let b = (0..out.len())
            .max_by(|&x, &y| norm(sum, x).total_cmp(&norm(sum, y)))
            .expect("members");
        let top = norm(sum, b);
        if top <= cap {
            return;
        }
        // The best swap: (new max of the pair, device, index on b, index on d).
        let mut best: Option<(f64, usize, usize, usize)> = None;
        for (xi, &x) in out[b].iter().enumerate() {
            for d in (0..out.len()).filter(|&d| d != b && !out[d].contains(&x)) {
                for (yi, &y) in out[d].iter().enumerate() {
                    let dw = weight(x) - weight(y);
                    if dw <= 0.0 || out[b].contains(&y) {
                        continue;
                    }
                    let pair =
                        ((sum[b] - dw) / speed[members[b]]).max((sum[d] + dw) / speed[members[d]]);
                    if pair < top && best.is_none_or(|bst| pair < bst.0) {
                        best = Some((pair, d, xi, yi));
                    }
                }
            }
        }
        let Some((_, d, xi, yi)) = best else {
            return;
        };
        let (x, y) = (out[b][xi], out[d][yi]);
        let dw = weight(x) - weight(y);
        (out[b][xi], out[d][yi]) = (y, x);
        sum[b] -= dw;
        sum[d] += dw;
    }
}

/// Per MoE layer (`layers`, in order) and device rank, the routed experts `p` places there.
fn held_sets(topology: &Topology, p: &Placement, layers: &[u32]) -> Vec<Vec<BTreeSet<u32>>> {
    let devices = topology.devices();
    let on = |l: u32| -> Vec<BTreeSet<u32>> {
        let sets = devices
            .iter()
            .map(|d| p.experts_on(d.rank(), l).iter().copied());
        sets.map(|s| s.collect()).collect()
    };
    layers.iter().map(|&l| on(l)).collect()
}

/// The MoE layers of two placements of the same model on the same devices, with the same
/// shared experts' locations.
fn check_same(old: &Placement, new: &Placement) -> Result<Vec<u32>, TransitionError> {
    let mismatch = |what| Err(TransitionError::Mismatch { what });
    if old.model_name() != new.model_name() {
        return mismatch("model");
    }
    if old.cluster_name() != new.cluster_name() || old.device_count() != new.device_count() {
        return mismatch("cluster");
    }
    if old.layers() != new.layers() || old.routed_experts() != new.routed_experts() {
        return mismatch("layers");
    }
    for &layer in old.layers() {
        let (from, to) = (old.shared_location(layer), new.shared_location(layer));
        if from != to {
            let name = |s: Option<_>| s.map_or("none".to_owned(), |s| format!("{s}"));
            return Err(TransitionError::SharedMoved {
                layer,
                from: name(from),
                to: name(to),
            });
        }
    }
    Ok(old.layers().to_vec())
}

/// Per device rank, the routed experts that fit next to the shared experts placed on it.
fn routed_slots(topology: &Topology, model: &ModelSpec, p: &Placement) -> Vec<u64> {
    let expert = model.expert_bytes().max(1);
    p.usage(topology, model)
        .iter()
        .map(|u| u.budget_bytes.saturating_sub(u.shared_bytes) / expert)
        .collect()
}

fn count(held: &[Vec<BTreeSet<u32>>], rank: usize) -> u64 {
    held.iter().map(|l| l[rank].len() as u64).sum()
}

fn total(held: &[Vec<BTreeSet<u32>>]) -> u64 {
    held.iter().flatten().map(|s| s.len() as u64).sum()
}

/// The order that exists whenever any does: drop every replica beyond one per expert (the
/// one kept is a new owner where one holds it), move the experts that are not on a new owner
/// one per step through a free slot, then load the new placement's other replicas. With one
/// replica per expert and no free slot anywhere nothing can move at all, so that is the only
/// refusal ([`TransitionError::NoRoom`]). A move goes to a free slot on the expert's new owner;
/// when no new owner has one, every device that is owed an expert is full and so holds an
/// expert that leaves it, which a free slot elsewhere covers: the next step fills the slot
/// that frees.
fn one_at_a_time(
    layers: &[u32],
    slots: &[u64],
    state: &[Vec<BTreeSet<u32>>],
    target: &[Vec<BTreeSet<u32>>],
) -> Result<Vec<Step>, TransitionError> {
    let devices = slots.len();
    let mut state = state.to_vec();
    let mut steps = Vec::new();
    let push = |steps: &mut Vec<Step>, state: &mut Vec<Vec<BTreeSet<u32>>>, loads, frees| {
        let step = step_of(layers, state, loads, frees);
        apply(state, &step, layers);
        steps.push(step);
    };
    let frees = extra_replicas(layers, &state, target);
    if !frees.is_empty() {
        push(&mut steps, &mut state, Vec::new(), frees);
    }
    loop {
        let held: Vec<u64> = (0..devices).map(|r| count(&state, r)).collect();
        let misplaced = misplaced(&state, target);
        let Some(&(li, e, from, _)) = misplaced.first() else {
            break;
        };
        let (li, e, from, to, cover) =
            if let Some(&(li, e, from, to)) = misplaced.iter().find(|m| held[m.3] < slots[m.3]) {
                (li, e, from, to, false)
            } else {
                let Some(hole) = (0..devices).find(|&r| held[r] < slots[r]) else {
                    return Err(TransitionError::NoRoom {
                        device: DeviceRank(from as u32),
                        layer: layers[li],
                        expert: e,
                    });
                };
                // Cover an expert that sits on a device owed another one.
                let &(li, e, from, _) = misplaced
                    .iter()
                    .find(|m| misplaced.iter().any(|n| n.3 == m.2))
                    .expect("a full device owed an expert holds one that leaves it");
                (li, e, from, hole, true)
            };
        let (load, free) = (mv(to, layers[li], e, cover), mv(from, layers[li], e, false));
        push(&mut steps, &mut state, vec![load], vec![free]);
    }
    let loads: Vec<Move> = target
        .iter()
        .enumerate()
        .flat_map(|(li, layer)| {
            let state = &state;
            layer.iter().enumerate().flat_map(move |(r, want)| {
                want.difference(&state[li][r])
                    .map(move |&e| mv(r, layers[li], e, false))
            })
        })
        .collect();
    if !loads.is_empty() {
        push(&mut steps, &mut state, loads, Vec::new());
    }
    Ok(steps)
}

/// The frees that leave one owner per expert: a new owner where one holds it, else the first.
fn extra_replicas(
    layers: &[u32],
    state: &[Vec<BTreeSet<u32>>],
    target: &[Vec<BTreeSet<u32>>],
) -> Vec<Move> {
    let mut frees = Vec::new();
    for (li, layer) in state.iter().enumerate() {
        let experts: BTreeSet<u32> = layer.iter().flatten().copied().collect();
        for e in experts {
            let owners: Vec<usize> = (0..layer.len())
                .filter(|&r| layer[r].contains(&e))
                .collect();
            let keep = owners
                .iter()
                .copied()
                .find(|&r| target[li][r].contains(&e))
                .unwrap_or(owners[0]);
            let drop = owners.iter().filter(|&&r| r != keep);
            frees.extend(drop.map(|&r| mv(r, layers[li], e, false)));
        }
    }
    frees
}

/// Experts held by a device the new placement does not give them to, as (layer index,
/// expert, the device, a new owner).
fn misplaced(
    state: &[Vec<BTreeSet<u32>>],
    target: &[Vec<BTreeSet<u32>>],
) -> Vec<(usize, u32, usize, usize)> {
    let mut out = Vec::new();
    for (li, layer) in state.iter().enumerate() {
        for (r, held) in layer.iter().enumerate() {
            for &e in held.difference(&target[li][r]) {
                let to = (0..layer.len())
                    .find(|&t| target[li][t].contains(&e))
                    .expect("the new placement owns every expert");
                out.push((li, e, r, to));
            }
        }
    }
    out
}

/// A step of `loads` then `frees` from `state`, with its placement and peak.
fn step_of(
    layers: &[u32],
    state: &[Vec<BTreeSet<u32>>],
    loads: Vec<Move>,
    frees: Vec<Move>,
) -> Step {
    let mut after = state.to_vec();
    let li = |layer: u32| {
        layers
            .iter()
            .position(|&l| l == layer)
            .expect("a MoE layer")
    };
    for m in &loads {
        after[li(m.layer)][m.device.index()].insert(m.expert);
    }
    let devices = state.first().map_or(0, Vec::len);
    let peak_slots = (0..devices).map(|r| count(&after, r)).collect();
    for m in &frees {
        after[li(m.layer)][m.device.index()].remove(&m.expert);
    }
    Step {
        loads,
        frees,
        owners: after
            .iter()
            .map(|l| l.iter().map(|s| s.iter().copied().collect()).collect())
            .collect(),
        peak_slots,
    }
}

/// The next step from `state` towards `target` (see the module docs).
fn next_step(
    layers: &[u32],
    slots: &[u64],
    state: &[Vec<BTreeSet<u32>>],
    target: &[Vec<BTreeSet<u32>>],
) -> Result<Step, TransitionError> {
    let devices = slots.len();
    let mut used: Vec<u64> = (0..devices).map(|r| count(state, r)).collect();
    let mut after = state.to_vec();
    let mut loads = Vec::new();
    // Gains whose expert another device must free come first: loading one lets that device
    // free it and so makes room there.
    let mut gains: Vec<(bool, usize, usize, u32)> = Vec::new();
    for (li, layer) in target.iter().enumerate() {
        for (r, want) in layer.iter().enumerate() {
            for &e in want.difference(&state[li][r]) {
                let frees_one = (0..devices)
                    .any(|o| o != r && state[li][o].contains(&e) && !target[li][o].contains(&e));
                gains.push((!frees_one, li, r, e));
            }
        }
    }
    gains.sort_unstable();
    for (_, li, r, e) in gains {
        if used[r] < slots[r] {
            used[r] += 1;
            after[li][r].insert(e);
            loads.push(mv(r, layers[li], e, false));
        }
    }
    let mut frees = free_losses(layers, state, &mut after, target);
    if loads.is_empty() && frees.is_empty() {
        // Stuck: cover one expert whose only owner must free it to make room for a gain, on
        // a device with room.
        let (li, r, e) = stuck_loss(slots, state, target).expect("a full device has a loss");
        let Some(c) = (0..devices).find(|&c| used[c] < slots[c] && !after[li][c].contains(&e))
        else {
            return Err(TransitionError::NoRoom {
                device: DeviceRank(r as u32),
                layer: layers[li],
                expert: e,
            });
        };
        used[c] += 1;
        after[li][c].insert(e);
        loads.push(mv(c, layers[li], e, true));
        frees = free_losses(layers, state, &mut after, target);
    }
    Ok(step_of(layers, state, loads, frees))
}

/// Free, from `after`, every expert a device held before the step (`state`: a covering
/// replica loaded in this step stays for its switch) but the target does not give it, while
/// another device still holds it; the frees made.
fn free_losses(
    layers: &[u32],
    state: &[Vec<BTreeSet<u32>>],
    after: &mut [Vec<BTreeSet<u32>>],
    target: &[Vec<BTreeSet<u32>>],
) -> Vec<Move> {
    let mut frees = Vec::new();
    for (li, layer) in after.iter_mut().enumerate() {
        for r in 0..layer.len() {
            let losses: Vec<u32> = state[li][r].difference(&target[li][r]).copied().collect();
            for e in losses {
                let owners = layer.iter().filter(|s| s.contains(&e)).count();
                if owners >= 2 {
                    layer[r].remove(&e);
                    frees.push(mv(r, layers[li], e, false));
                }
            }
        }
    }
    frees
}

/// When no gain is loaded and no loss can be freed: an expert that a full device with a
/// pending gain must free, as (layer index, rank, expert). Such a device exists (with no gain
/// pending, the state would hold the whole target and every loss would have another owner; a
/// device with room loads its gains), and being full it holds more than the target leaves it:
/// a loss, its expert's only owner. Freeing it makes room for the gain in the next step.
fn stuck_loss(
    slots: &[u64],
    state: &[Vec<BTreeSet<u32>>],
    target: &[Vec<BTreeSet<u32>>],
) -> Option<(usize, usize, u32)> {
    let gaining = (0..slots.len()).find(|&r| {
        count(state, r) == slots[r]
            && state
                .iter()
                .zip(target)
                .any(|(s, t)| t[r].difference(&s[r]).next().is_some())
    })?;
    state.iter().enumerate().find_map(|(li, layer)| {
        layer[gaining]
            .difference(&target[li][gaining])
            .next()
            .map(|&e| (li, gaining, e))
    })
}

/// The state after a step: its loads added, its frees removed.
fn apply(state: &mut [Vec<BTreeSet<u32>>], step: &Step, layers: &[u32]) {
    let li = |layer: u32| {
        layers
            .iter()
            .position(|&l| l == layer)
            .expect("a MoE layer")
    };
    for m in &step.loads {
        state[li(m.layer)][m.device.index()].insert(m.expert);
    }
    for m in &step.frees {
        state[li(m.layer)][m.device.index()].remove(&m.expert);
    }
}

fn mv(rank: usize, layer: u32, expert: u32, cover: bool) -> Move {
    Move {
        device: DeviceRank(rank as u32),
        layer,
        expert,
        cover,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use expertmesh_topology::model::preset_by_name;
    use proptest::prelude::*;
    use std::collections::{HashSet, VecDeque};

    /// `toy-mixtral` (4 experts) with `layers` MoE layers.
    fn model(layers: u32) -> ModelSpec {
        let mut m = preset_by_name("toy-mixtral").expect("preset");
        m.num_layers = layers;
        m.first_dense_layers = 0;
        m
    }

    /// One node of devices with room for `slots[r]` routed experts each.
    fn topology(m: &ModelSpec, slots: &[u64]) -> Topology {
        let devices: Vec<(u64, u64, u32)> = slots.iter().map(|&s| (s, 0, 100)).collect();
        crate::tests::cluster(&[devices], m.expert_bytes())
    }

    /// A placement from `[layer][device]` bitmasks of experts.
    fn placement(t: &Topology, m: &ModelSpec, masks: &[Vec<u8>]) -> Placement {
        let slots = masks
            .iter()
            .map(|l| {
                l.iter()
                    .map(|&b| (0..m.routed_experts).filter(|e| b >> e & 1 == 1).collect())
                    .collect()
            })
            .collect();
        Placement::new(t, m, slots, Vec::new(), "test").expect("a valid placement")
    }

    /// Replay `plan` from `old`: each step's loads are new and fit, its frees are held, its
    /// placement is what the loads and frees leave and owns every expert; the end is `new`.
    fn replay(
        t: &Topology,
        m: &ModelSpec,
        old: &Placement,
        new: &Placement,
        plan: &Transition,
    ) -> Result<(), TestCaseError> {
        let layers = old.layers().to_vec();
        let devices = old.device_count();
        let held = |p: &Placement| held_sets(t, p, &layers);
        let mut state = held(old);
        for (i, step) in plan.steps.iter().enumerate() {
            prop_assert!(
                !step.loads.is_empty() || !step.frees.is_empty(),
                "step {} is empty",
                i
            );
            for mv in &step.loads {
                let li = layers.iter().position(|&l| l == mv.layer).unwrap();
                prop_assert!(
                    state[li][mv.device.index()].insert(mv.expert),
                    "step {}: {:?} already held",
                    i,
                    mv
                );
            }
            for r in 0..devices {
                let n: usize = state.iter().map(|l| l[r].len()).sum();
                prop_assert!(
                    n as u64 <= plan.slots[r],
                    "step {}: device {} holds {} of {}",
                    i,
                    r,
                    n,
                    plan.slots[r]
                );
                prop_assert_eq!(n as u64, step.peak_slots[r]);
            }
            for mv in &step.frees {
                let li = layers.iter().position(|&l| l == mv.layer).unwrap();
                prop_assert!(
                    state[li][mv.device.index()].remove(&mv.expert),
                    "step {}: {:?} not held",
                    i,
                    mv
                );
            }
            for (li, layer) in state.iter().enumerate() {
                for e in 0..m.routed_experts {
                    prop_assert!(
                        layer.iter().any(|s| s.contains(&e)),
                        "step {}: layer {} expert {} has no owner",
                        i,
                        li,
                        e
                    );
                }
                let owners: Vec<Vec<u32>> =
                    layer.iter().map(|s| s.iter().copied().collect()).collect();
                prop_assert_eq!(&owners, &step.owners[li]);
            }
            let valid = Placement::new(t, m, step.owners.clone(), Vec::new(), "step");
            prop_assert!(valid.is_ok(), "step {}: {:?}", i, valid);
        }
        prop_assert_eq!(state, held(new));
        Ok(())
    }

    /// Whether `new` can be reached from `old` (one layer) by single moves: load an expert on
    /// a device with a free slot, or free one that another device holds.
    fn reachable(slots: &[u64], experts: u32, old: &[u8], new: &[u8]) -> bool {
        let covered = |s: &[u8]| s.iter().fold(0u8, |a, &b| a | b) == (1 << experts) - 1;
        let mut seen = HashSet::from([old.to_vec()]);
        let mut queue = VecDeque::from([old.to_vec()]);
        while let Some(s) = queue.pop_front() {
            if s == new {
                return true;
            }
            for r in 0..s.len() {
                for e in 0..experts {
                    let mut n = s.clone();
                    n[r] ^= 1 << e;
                    let ok = if s[r] >> e & 1 == 0 {
                        (n[r].count_ones() as u64) <= slots[r]
                    } else {
                        covered(&n)
                    };
                    if ok && seen.insert(n.clone()) {
                        queue.push_back(n);
                    }
                }
            }
        }
        false
    }

    /// A random placement as `[layer][device]` bitmasks of four experts: each expert on a
    /// device with room, then extra replicas where there is room; `None` if the slots cannot
    /// hold every expert.
    fn random_masks(slots: &[u64], layers: usize, seed: u64) -> Option<Vec<Vec<u8>>> {
        let mut rng = seed | 1;
        let mut next = move |n: u64| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng % n
        };
        let mut used = vec![0u64; slots.len()];
        let mut masks = vec![vec![0u8; slots.len()]; layers];
        for layer in masks.iter_mut() {
            for e in 0..4 {
                let room: Vec<usize> = (0..slots.len()).filter(|&r| used[r] < slots[r]).collect();
                let r = *room.get(next(room.len().max(1) as u64) as usize)?;
                layer[r] |= 1 << e;
                used[r] += 1;
            }
        }
        for layer in masks.iter_mut() {
            for (r, mask) in layer.iter_mut().enumerate() {
                for e in 0..4 {
                    if *mask >> e & 1 == 0 && used[r] < slots[r] && next(3) == 0 {
                        *mask |= 1 << e;
                        used[r] += 1;
                    }
                }
            }
        }
        Some(masks)
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

        /// One layer, two to four devices: a plan exactly when single moves can get there,
        /// and every plan replays.
        #[test]
        fn one_layer_plans_exactly_when_moves_can_reach_the_new_placement(
            slots in prop::collection::vec(0u64..4, 2..5),
            seeds in any::<(u64, u64)>(),
        ) {
            let (Some(old), Some(new)) = (random_masks(&slots, 1, seeds.0), random_masks(&slots, 1, seeds.1)) else {
                return Ok(());
            };
            let m = model(1);
            let t = topology(&m, &slots);
            let (po, pn) = (placement(&t, &m, &old), placement(&t, &m, &new));
            let plan = transition(&t, &m, &po, &pn);
            prop_assert_eq!(plan.is_ok(), reachable(&slots, 4, &old[0], &new[0]), "{:?}", plan);
            match plan {
                Ok(plan) => replay(&t, &m, &po, &pn, &plan)?,
                Err(e) => prop_assert!(matches!(e, TransitionError::NoRoom { .. }), "{}", e),
            }
        }

        /// Two layers share each device's memory: every plan replays, and a change is refused
        /// exactly when nothing can move: one replica per expert fills every slot.
        #[test]
        fn two_layer_plans_replay_and_are_refused_only_when_nothing_can_move(
            slots in prop::collection::vec(0u64..7, 2..5),
            seeds in any::<(u64, u64)>(),
        ) {
            let (Some(old), Some(new)) = (random_masks(&slots, 2, seeds.0), random_masks(&slots, 2, seeds.1)) else {
                return Ok(());
            };
            let m = model(2);
            let t = topology(&m, &slots);
            let (po, pn) = (placement(&t, &m, &old), placement(&t, &m, &new));
            let stuck = old != new && slots.iter().sum::<u64>() == 2 * 4;
            match transition(&t, &m, &po, &pn) {
                Ok(plan) => {
                    prop_assert!(!stuck, "a plan where nothing can move: {:?}", plan);
                    replay(&t, &m, &po, &pn, &plan)?;
                }
                Err(e) => prop_assert!(stuck, "refused though a slot is free: {}", e),
            }
        }

        /// Draining a device empties it, keeps every other device's experts, stays within
        /// every device's slots, keeps an owner per expert, and is refused exactly when the
        /// other devices' free slots are fewer than the experts only the drained one holds.
        #[test]
        fn a_drain_moves_only_the_drained_devices_sole_experts_and_fails_only_without_room(
            slots in prop::collection::vec(0u64..7, 2..5),
            seed in any::<u64>(),
            which in any::<prop::sample::Index>(),
        ) {
            let Some(old) = random_masks(&slots, 2, seed) else {
                return Ok(());
            };
            let m = model(2);
            let t = topology(&m, &slots);
            let po = placement(&t, &m, &old);
            let d = which.index(slots.len());
            let layers = m.moe_layer_ids();
            let held = held_sets(&t, &po, &layers);
            let sole: usize = held
                .iter()
                .map(|l| l[d].iter().filter(|e| (0..slots.len()).all(|r| r == d || !l[r].contains(e))).count())
                .sum();
            let free: u64 = (0..slots.len())
                .filter(|&r| r != d)
                .map(|r| slots[r] - count(&held, r))
                .sum();
            match drained(&t, &m, &po, DeviceRank(d as u32)) {
                Ok(p) => {
                    prop_assert!(free >= sole as u64);
                    let after = held_sets(&t, &p, &layers);
                    prop_assert_eq!(count(&after, d), 0);
                    for (li, l) in after.iter().enumerate() {
                        for r in (0..slots.len()).filter(|&r| r != d) {
                            prop_assert!(held[li][r].is_subset(&l[r]));
                        }
                        for e in 0..m.routed_experts {
                            prop_assert!(l.iter().any(|s| s.contains(&e)));
                        }
                    }
                    for (r, &room) in slots.iter().enumerate() {
                        prop_assert!(count(&after, r) <= room);
                    }
                    let moved: u64 = (0..slots.len()).map(|r| count(&after, r)).sum::<u64>()
                        - (0..slots.len()).filter(|&r| r != d).map(|r| count(&held, r)).sum::<u64>();
                    prop_assert_eq!(moved, sole as u64);
                }
                Err(e) => {
                    prop_assert!(free < sole as u64, "refused with {} free slots for {} experts: {}", free, sole, e);
                    prop_assert!(matches!(e, TransitionError::NoRoomToDrain { .. }), "{}", e);
                }
            }
        }
    }

    /// Lists swapped between interchangeable devices go back where the old placement has
    /// them: nothing moves; and keeping in place never moves more than the plan as given.
    #[test]
    fn keeping_in_place_undoes_a_relabelling_among_equal_devices() {
        let m = model(2);
        let t = topology(&m, &[4, 4, 4]);
        let old = placement(
            &t,
            &m,
            &[vec![0b0011, 0b1100, 0b0010], vec![0b0001, 0b0010, 0b1100]],
        );
        let swapped = placement(
            &t,
            &m,
            &[vec![0b1100, 0b0011, 0b0010], vec![0b0010, 0b0001, 0b1100]],
        );
        assert!(transition(&t, &m, &old, &swapped).expect("a plan").loads() > 0);
        let kept = keep_in_place(
            &t,
            &m,
            &old,
            &swapped,
            &Keep {
                load: None,
                coselect: None,
                within_nodes: true,
                slack: REPACK_SLACK,
            },
        )
        .expect("same model");
        assert_eq!(kept, old);
        assert_eq!(
            transition(&t, &m, &old, &kept).expect("no change").loads(),
            0
        );
        let mut rng = 7u64;
        for seed in 0..200u64 {
            let slots = [3, 3, 2 + seed % 3];
            let t = topology(&m, &slots);
            let (Some(a), Some(b)) = (
                random_masks(&slots, 2, seed),
                random_masks(&slots, 2, seed ^ rng),
            ) else {
                continue;
            };
            rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1);
            let (pa, pb) = (placement(&t, &m, &a), placement(&t, &m, &b));
            let kept = keep_in_place(
                &t,
                &m,
                &pa,
                &pb,
                &Keep {
                    load: None,
                    coselect: None,
                    within_nodes: seed % 2 == 0,
                    slack: REPACK_SLACK,
                },
            )
            .expect("same model");
            let moves = |p: &Placement| {
                transition(&t, &m, &pa, p).map(|x| {
                    x.loads()
                        - x.steps
                            .iter()
                            .flat_map(|s| &s.loads)
                            .filter(|l| l.cover)
                            .count()
                })
            };
            if let (Ok(direct), Ok(kept_moves)) = (moves(&pb), moves(&kept)) {
                assert!(kept_moves <= direct, "seed {seed}: {kept_moves} > {direct}");
            }
        }
    }

    /// With skewed loads, keeping in place never leaves a device busier (load per unit of
    /// bandwidth) than the plan's busiest times `1 + REPACK_SLACK`, never keeps fewer experts
    /// in place than the plan as given, and keeps every device's count.
    #[test]
    fn keeping_in_place_stays_within_the_balance_slack() {
        let m = model(2);
        for seed in 0..300u64 {
            let slots = [3, 4, 3 + seed % 2];
            let t = topology(&m, &slots);
            let (Some(a), Some(b)) = (
                random_masks(&slots, 2, seed),
                random_masks(&slots, 2, !seed),
            ) else {
                continue;
            };
            let (pa, pb) = (placement(&t, &m, &a), placement(&t, &m, &b));
            let skew = |e: usize| (1 + (seed as usize + 3 * e) % 7) as f64;
            let counts = (0..2).map(|_| Some((0..4).map(skew).collect())).collect();
            let stats = LoadStats::new(&m, counts).expect("valid statistics");
            let how = Keep {
                load: Some(&stats),
                coselect: None,
                within_nodes: seed % 2 == 0,
                slack: REPACK_SLACK,
            };
            let kept = keep_in_place(&t, &m, &pa, &pb, &how).expect("same model");
            for (li, &layer) in pb.layers().iter().enumerate() {
                let loads = crate::layer_loads(&m, Some(&stats), None, li);
                let busiest = |p: &Placement| {
                    let mut replicas = [0u32; 4];
                    for d in t.devices() {
                        for &e in p.experts_on(d.rank(), layer) {
                            replicas[e as usize] += 1;
                        }
                    }
                    t.devices()
                        .iter()
                        .map(|d| {
                            let l: f64 = p
                                .experts_on(d.rank(), layer)
                                .iter()
                                .map(|&e| loads[e as usize] / replicas[e as usize] as f64)
                                .sum();
                            l / d.memory_bandwidth_gb_s()
                        })
                        .fold(0.0, f64::max)
                };
                assert!(
                    busiest(&kept) <= busiest(&pb) * (1.0 + REPACK_SLACK) + 1e-12,
                    "seed {seed} layer {layer}"
                );
                for d in t.devices() {
                    assert_eq!(
                        kept.experts_on(d.rank(), layer).len(),
                        pb.experts_on(d.rank(), layer).len()
                    );
                }
            }
            let in_place = |p: &Placement| -> usize {
                pa.layers()
                    .iter()
                    .map(|&l| {
                        t.devices()
                            .iter()
                            .map(|d| {
                                p.experts_on(d.rank(), l)
                                    .iter()
                                    .filter(|e| pa.experts_on(d.rank(), l).contains(e))
                                    .count()
                            })
                            .sum::<usize>()
                    })
                    .sum()
            };
            assert!(in_place(&kept) >= in_place(&pb), "seed {seed}");
        }
    }

    /// Two full devices swapping their experts need the third's free slot for covering
    /// replicas; without it the change cannot be made live, and the error names a device and
    /// an expert.
    #[test]
    fn a_swap_between_full_devices_goes_through_a_cover_or_is_refused() {
        let m = model(1);
        let t = topology(&m, &[2, 2, 1]);
        let old = placement(&t, &m, &[vec![0b0011, 0b1100, 0]]);
        let new = placement(&t, &m, &[vec![0b1100, 0b0011, 0]]);
        let plan = transition(&t, &m, &old, &new).expect("a plan through the free slot");
        assert!(
            plan.steps.iter().flat_map(|s| &s.loads).any(|l| l.cover),
            "{plan:?}"
        );
        replay(&t, &m, &old, &new, &plan).expect("the plan replays");
        let t = topology(&m, &[2, 2, 0]);
        let old = placement(&t, &m, &[vec![0b0011, 0b1100, 0]]);
        let new = placement(&t, &m, &[vec![0b1100, 0b0011, 0]]);
        let err = transition(&t, &m, &old, &new).expect_err("no free slot");
        assert!(matches!(err, TransitionError::NoRoom { .. }), "{err}");
        assert!(err.to_string().contains("every device is full"), "{err}");
    }

    /// With room everywhere, the change is one step: load every gain, switch, free every loss.
    #[test]
    fn with_room_everywhere_the_change_is_one_step() {
        let m = model(2);
        let t = topology(&m, &[8, 8]);
        let old = placement(&t, &m, &[vec![0b0011, 0b1100], vec![0b1111, 0]]);
        let new = placement(&t, &m, &[vec![0b1100, 0b0011], vec![0, 0b1111]]);
        let plan = transition(&t, &m, &old, &new).expect("a plan");
        assert_eq!(plan.steps.len(), 1, "{plan:?}");
        assert_eq!(plan.loads(), 8);
        replay(&t, &m, &old, &new, &plan).expect("the plan replays");
        assert!(
            transition(&t, &m, &old, &old)
                .expect("no change")
                .steps
                .is_empty()
        );
    }
}
