//! Memory budgets turned into expert slots: where shared experts go, how many routed experts
//! each device holds in each layer, and by how much a model misses when it does not fit.
//!
//! Why this exists: every placement the planner writes must respect each device's
//! `expert_memory` exactly. All experts of a model have the same packed size
//! ([`ModelSpec::expert_bytes`]), so a device's budget is a whole number of expert slots over all
//! layers once its shared experts are taken off. This module fixes, before any expert is chosen,
//! how many slots each device fills in each layer:
//!
//! - devices get slots in proportion to their memory bandwidth (the resource decode is bound
//!   by), capped by what their memory holds (water-filling, exact integers);
//! - a device's slots are spread over the layers as evenly as possible (each layer gets
//!   `floor` or `ceil` of its average, wrap-around rounding), so bytes and experts are fair per
//!   layer and over all layers, and every layer has exactly `E + R` slots.

use expertmesh_topology::model::ModelSpec;
use expertmesh_topology::placement::SharedLocation;
use expertmesh_topology::topology::{DeviceRank, Topology};

/// Where the shared experts of each MoE layer go.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SharedPolicy {
    /// On the router host (default): every token needs the shared experts, and the router
    /// combines anyway, so running them there costs no extra hop and no device memory.
    Router,
    /// On devices: each layer's shared experts go to the device with the most free expert
    /// memory at that point (ties: lower rank), counted against its budget.
    Spread,
    /// All on one device (by id), counted against its budget.
    Device(String),
}

/// One device that falls short, for a placement that cannot fit.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct DeviceShortfall {
    /// Device rank.
    pub rank: u32,
    /// Device id.
    pub device: String,
    /// Bytes its even share needs (routed experts in proportion to bandwidth, plus shared).
    pub need_bytes: u64,
    /// Its expert memory budget.
    pub budget_bytes: u64,
    /// `need - budget`.
    pub short_bytes: u64,
}

/// Why a model does not fit a topology, in bytes.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Shortfall {
    /// Bytes of all routed slots (experts and replicas) plus shared experts on devices.
    pub need_bytes: u64,
    /// Sum of the devices' expert memory budgets.
    pub budget_bytes: u64,
    /// Budget usable in whole expert slots (what a placement can actually use).
    pub usable_bytes: u64,
    /// `need - usable`.
    pub short_bytes: u64,
    /// Replica slots per layer that were asked for.
    pub redundant: u32,
    /// Most replica slots per layer that would fit (None: not even the model itself fits).
    pub max_redundant_that_fits: Option<u32>,
    /// The devices whose even share exceeds their budget.
    pub devices: Vec<DeviceShortfall>,
    /// The devices whose shared experts alone exceed their budget (`need_bytes`: the shared
    /// experts' bytes): no number of replicas, and no routed placement, makes those fit.
    pub shared_short: Vec<DeviceShortfall>,
}

/// The slot layout every algorithm fills.
#[derive(Clone, Debug, PartialEq)]
pub struct SlotLayout {
    /// `[MoE layer index]` → where its shared experts run.
    pub shared: Vec<SharedLocation>,
    /// Shared-expert bytes per device.
    pub shared_bytes: Vec<u64>,
    /// Routed slots per device over all layers, from its budget.
    pub capacity: Vec<u64>,
    /// `[MoE layer index][device rank]` → routed slots to fill.
    pub counts: Vec<Vec<u32>>,
}

/// Where shared experts go, and their bytes per device. `Err` names a bad device id.
pub fn place_shared(
    topology: &Topology,
    model: &ModelSpec,
    policy: &SharedPolicy,
) -> Result<(Vec<SharedLocation>, Vec<u64>), String> {
    let n_layers = model.moe_layer_ids().len();
    let n_dev = topology.devices().len();
    let mut bytes = vec![0u64; n_dev];
    if model.shared_experts == 0 {
        return Ok((Vec::new(), bytes));
    }
    let per_layer = (model.shared_experts as u64).saturating_mul(model.shared_expert_bytes());
    let locs = match policy {
        SharedPolicy::Router => vec![SharedLocation::Router; n_layers],
        SharedPolicy::Device(id) => {
            let d = topology.device_by_id(id).ok_or_else(|| {
                format!(
                    "unknown device \"{id}\" for the shared experts; use a device id (\"node/device\") from the topology, \"router\" or \"spread\""
                )
            })?;
            bytes[d.rank().index()] = per_layer.saturating_mul(n_layers as u64);
            vec![SharedLocation::Device(d.rank()); n_layers]
        }
        SharedPolicy::Spread => {
            let mut free: Vec<i128> = topology
                .devices()
                .iter()
                .map(|d| d.expert_memory_bytes() as i128)
                .collect();
            // Each device's routed share is taken off first, so the shared experts land where
            // memory is left over rather than where the budget is merely large.
            let share = even_routed_share(topology, model, 0);
            for (f, s) in free.iter_mut().zip(&share) {
                *f -= *s as i128 * model.expert_bytes() as i128;
            }
            (0..n_layers)
                .map(|_| {
                    let best = (0..n_dev)
                        .max_by_key(|&r| (free[r], -(r as i64)))
                        .unwrap_or(0);
                    free[best] -= per_layer as i128;
                    bytes[best] = bytes[best].saturating_add(per_layer);
                    SharedLocation::Device(DeviceRank(best as u32))
                })
                .collect()
        }
    };
    Ok((locs, bytes))
}

/// Routed slots over all layers each device would hold in an even (bandwidth-proportional,
/// uncapped) split of `L * (E + redundant)` slots.
fn even_routed_share(topology: &Topology, model: &ModelSpec, redundant: u32) -> Vec<u64> {
    let total =
        model.moe_layer_ids().len() as u64 * (model.routed_experts as u64 + redundant as u64);
    let weights: Vec<f64> = topology
        .devices()
        .iter()
        .map(|d| d.memory_bandwidth_gb_s())
        .collect();
    water_fill(total, &weights, &vec![u64::MAX; weights.len()]).unwrap_or_default()
}

/// Split `total` units in proportion to `weights`, each part at most its cap; exact integers
/// (largest remainder). None when the caps hold less than `total`.
pub fn water_fill(total: u64, weights: &[f64], caps: &[u64]) -> Option<Vec<u64>> {
    let n = weights.len();
    if caps.iter().fold(0u128, |a, &c| a + c as u128) < total as u128 {
        return None;
    }
    let mut out = vec![0u64; n];
    let mut active: Vec<usize> = (0..n).filter(|&i| caps[i] > 0).collect();
    let mut left = total;
    loop {
        if left == 0 || active.is_empty() {
            break;
        }
        let wsum: f64 = active.iter().map(|&i| weights[i].max(0.0)).sum();
        let share = |i: usize| {
            if wsum > 0.0 {
                left as f64 * weights[i].max(0.0) / wsum
            } else {
                left as f64 / active.len() as f64
            }
        };
        // Parts whose proportional share reaches their cap are fixed at the cap.
        let capped: Vec<usize> = active
            .iter()
            .copied()
            .filter(|&i| share(i) >= caps[i] as f64)
            .collect();
        if !capped.is_empty() {
            for &i in &capped {
                out[i] = caps[i];
                left -= caps[i];
            }
            active.retain(|i| !capped.contains(i));
            continue;
        }
        // Everyone below the cap: floors, then the remainder by largest fraction.
        let shares: Vec<(usize, f64)> = active.iter().map(|&i| (i, share(i))).collect();
        let mut given = 0u64;
        for &(i, s) in &shares {
            let f = (s.floor() as u64).min(caps[i]);
            out[i] = f;
            given += f;
        }
        let mut rest = left.saturating_sub(given);
        let mut order: Vec<(usize, f64)> =
            shares.iter().map(|&(i, s)| (i, s - s.floor())).collect();
        order.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        // Float rounding can leave a few units over; hand them out round-robin below the caps.
        while rest > 0 {
            let mut progressed = false;
            for &(i, _) in &order {
                if rest == 0 {
                    break;
                }
                if out[i] < caps[i] {
                    out[i] += 1;
                    rest -= 1;
                    progressed = true;
                }
            }
            if !progressed {
                return None;
            }
        }
        break;
    }
    (out.iter().sum::<u64>() == total).then_some(out)
}

/// Spread each device's `quota` slots over `layers` layers so that every layer gets exactly
/// `per_layer` slots and each device gets `floor` or `ceil` of its average in every layer
/// (McNaughton's wrap-around). Requires `sum(quota) == layers * per_layer`.
pub fn spread_over_layers(quota: &[u64], layers: usize, per_layer: u64) -> Vec<Vec<u32>> {
    let l = layers as u64;
    let base: Vec<u64> = quota.iter().map(|q| q / l).collect();
    let mut counts = vec![base.iter().map(|&b| b as u32).collect::<Vec<u32>>(); layers];
    debug_assert_eq!(quota.iter().sum::<u64>(), l * per_layer);
    // Extras: device d has quota % L units, at most one per layer; laid end to end and wrapped
    // over the layers, consecutive units land on consecutive (distinct) layers.
    let mut pos = 0u64;
    for (d, &q) in quota.iter().enumerate() {
        for _ in 0..q % l {
            counts[(pos % l) as usize][d] += 1;
            pos += 1;
        }
    }
    counts
}

/// Routed slots over all layers a device can hold: its budget less its shared experts, in whole
/// experts.
pub fn slot_capacity(budget: u64, shared: u64, expert_bytes: u64) -> u64 {
    budget.saturating_sub(shared) / expert_bytes.max(1)
}

/// Lay out the slots for `redundant` replica slots per layer, or say by how much it misses.
pub fn layout(
    topology: &Topology,
    model: &ModelSpec,
    shared: &SharedPolicy,
    redundant: u32,
) -> Result<Result<SlotLayout, Shortfall>, String> {
    let (shared_locs, shared_bytes) = place_shared(topology, model, shared)?;
    let n_layers = model.moe_layer_ids().len();
    let e = model.routed_experts as u64;
    let s_bytes = model.expert_bytes();
    let capacity: Vec<u64> = topology
        .devices()
        .iter()
        .zip(&shared_bytes)
        .map(|(d, &sh)| slot_capacity(d.expert_memory_bytes(), sh, s_bytes))
        .collect();
    // A device holds each expert at most once per layer.
    let caps: Vec<u64> = capacity
        .iter()
        .map(|&c| c.min(n_layers as u64 * e))
        .collect();
    let per_layer = e + redundant as u64;
    let total = (n_layers as u64).saturating_mul(per_layer);
    let weights: Vec<f64> = topology
        .devices()
        .iter()
        .map(|d| d.memory_bandwidth_gb_s())
        .collect();
    let shared_overflow = topology
        .devices()
        .iter()
        .zip(&shared_bytes)
        .any(|(d, &sh)| sh > d.expert_memory_bytes());
    match water_fill(total, &weights, &caps).filter(|_| !shared_overflow) {
        Some(quota) => Ok(Ok(SlotLayout {
            shared: shared_locs,
            shared_bytes,
            counts: spread_over_layers(&quota, n_layers, per_layer),
            capacity,
        })),
        None => Ok(Err(shortfall(
            topology,
            model,
            &shared_bytes,
            &caps,
            redundant,
        ))),
    }
}

/// A 128-bit byte count as u64, saturating.
fn saturate(bytes: u128) -> u64 {
    u64::try_from(bytes).unwrap_or(u64::MAX)
}

fn shortfall(
    topology: &Topology,
    model: &ModelSpec,
    shared_bytes: &[u64],
    caps: &[u64],
    redundant: u32,
) -> Shortfall {
    let n_layers = model.moe_layer_ids().len() as u64;
    let s = model.expert_bytes();
    // Byte totals are summed in 128 bits and reported saturated at u64::MAX: a need past 2^64
    // bytes is short of any budget, and must not wrap around to a small number that fits.
    let slots = n_layers as u128 * (model.routed_experts as u128 + redundant as u128);
    let shared_total: u128 = shared_bytes.iter().map(|&b| b as u128).sum();
    let need = saturate(slots * s as u128 + shared_total);
    // Shared experts count as usable only as far as their device's budget goes.
    let usable = saturate(
        caps.iter().map(|&c| c as u128 * s as u128).sum::<u128>()
            + topology
                .devices()
                .iter()
                .zip(shared_bytes)
                .map(|(d, &sh)| sh.min(d.expert_memory_bytes()) as u128)
                .sum::<u128>(),
    );
    let budget = topology.total_expert_memory();
    let cap_slots: u128 = caps.iter().map(|&c| c as u128).sum();
    let max_r = cap_slots
        .checked_div(n_layers as u128)
        .and_then(|per_layer| per_layer.checked_sub(model.routed_experts as u128))
        .map(|r| r.min(u32::MAX as u128) as u32);
    let shared_short: Vec<DeviceShortfall> = topology
        .devices()
        .iter()
        .zip(shared_bytes)
        .filter(|(d, sh)| **sh > d.expert_memory_bytes())
        .map(|(d, &sh)| DeviceShortfall {
            rank: d.rank().0,
            device: d.id().to_owned(),
            need_bytes: sh,
            budget_bytes: d.expert_memory_bytes(),
            short_bytes: sh - d.expert_memory_bytes(),
        })
        .collect();
    let share = even_routed_share(topology, model, redundant);
    let devices = topology
        .devices()
        .iter()
        .zip(share)
        .zip(shared_bytes)
        .filter_map(|((d, sh), &shb)| {
            let need = sh.saturating_mul(s).saturating_add(shb);
            let budget = d.expert_memory_bytes();
            (need > budget).then(|| DeviceShortfall {
                rank: d.rank().0,
                device: d.id().to_owned(),
                need_bytes: need,
                budget_bytes: budget,
                short_bytes: need - budget,
            })
        })
        .collect();
    Shortfall {
        need_bytes: need,
        budget_bytes: budget,
        usable_bytes: usable,
        // Shared experts that overflow their device are short even when other devices have
        // room for routed experts.
        short_bytes: need.saturating_sub(usable).max(
            topology
                .devices()
                .iter()
                .zip(shared_bytes)
                .map(|(d, &sh)| sh.saturating_sub(d.expert_memory_bytes()))
                .fold(0u64, u64::saturating_add),
        ),
        redundant,
        // Fewer replicas do not help shared experts that overflow their device.
        max_redundant_that_fits: max_r.filter(|_| shared_short.is_empty()),
        devices,
        shared_short,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn water_fill_caps_and_proportions() {
        assert_eq!(water_fill(10, &[1.0, 1.0], &[100, 100]), Some(vec![5, 5]));
        assert_eq!(water_fill(10, &[3.0, 1.0], &[4, 100]), Some(vec![4, 6]));
        assert_eq!(water_fill(10, &[1.0, 1.0], &[4, 5]), None);
        assert_eq!(
            water_fill(7, &[1.0, 1.0, 1.0], &[9, 9, 9]),
            Some(vec![3, 2, 2])
        );
    }

    proptest! {
        #[test]
        fn water_fill_is_exact_and_capped(
            total in 0u64..10_000,
            parts in prop::collection::vec((0.1f64..10.0, 0u64..5_000), 1..12),
        ) {
            let (w, caps): (Vec<f64>, Vec<u64>) = parts.into_iter().unzip();
            match water_fill(total, &w, &caps) {
                None => prop_assert!(caps.iter().sum::<u64>() < total),
                Some(q) => {
                    prop_assert_eq!(q.iter().sum::<u64>(), total);
                    for (x, c) in q.iter().zip(&caps) {
                        prop_assert!(x <= c);
                    }
                }
            }
        }

        #[test]
        fn spread_is_even_and_exact(
            quota_avg in prop::collection::vec(0u64..40, 1..10),
            layers in 1usize..20,
        ) {
            // Build quotas whose sum is a multiple of the layer count.
            let mut quota: Vec<u64> = quota_avg.iter().map(|q| q * layers as u64 / 3 + q).collect();
            let rem = quota.iter().sum::<u64>() % layers as u64;
            if rem != 0 { quota[0] += layers as u64 - rem; }
            let per_layer = quota.iter().sum::<u64>() / layers as u64;
            let counts = spread_over_layers(&quota, layers, per_layer);
            for row in &counts {
                prop_assert_eq!(row.iter().map(|&c| c as u64).sum::<u64>(), per_layer);
            }
            for (d, &q) in quota.iter().enumerate() {
                let col: Vec<u64> = counts.iter().map(|r| r[d] as u64).collect();
                prop_assert_eq!(col.iter().sum::<u64>(), q);
                let lo = q / layers as u64;
                prop_assert!(col.iter().all(|&c| c == lo || c == lo + 1));
            }
        }
    }
}
