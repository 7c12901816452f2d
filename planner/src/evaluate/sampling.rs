//! Token sampling and touch probabilities: how often a device or node receives a token.
//!
//! Why this exists: with co-selection statistics or group-limited routing, a token's experts are
//! not independent draws, so the traffic model samples tokens (seeded per layer, so every
//! placement is judged on the same tokens); without them it uses the closed form of `k` distinct
//! draws. Both live here.

use expertmesh_quant::synth::{SplitMix64, mix_seed};
use expertmesh_topology::placement::Placement;

/// Tokens sampled per layer to estimate fan-out from co-selection statistics.
pub const SAMPLED_TOKENS: usize = 512;

/// Sampling in proportion to fixed weights: cumulative sums and a binary search.
pub(super) struct Cdf {
    /// `(item, cumulative weight up to and including it)`, positive weights only.
    pub(super) cum: Vec<(u32, f64)>,
}

impl Cdf {
    pub(super) fn new(items: impl IntoIterator<Item = (u32, f64)>) -> Cdf {
        let mut acc = 0.0;
        let cum = items
            .into_iter()
            .filter(|&(_, w)| w > 0.0 && w.is_finite())
            .map(|(x, w)| {
                acc += w;
                (x, acc)
            })
            .collect();
        Cdf { cum }
    }

    /// An item not in `taken` (rejection sampling, then a scan); None when all are taken.
    pub(super) fn pick(&self, taken: &[u32], rng: &mut SplitMix64) -> Option<u32> {
        let total = self.cum.last()?.1;
        for _ in 0..32 {
            let u = rng.next_f64() * total;
            let i = self
                .cum
                .partition_point(|&(_, c)| c <= u)
                .min(self.cum.len() - 1);
            let x = self.cum[i].0;
            if !taken.contains(&x) {
                return Some(x);
            }
        }
        // Most of the mass is taken: draw among what is left.
        let left: Vec<(u32, f64)> = self
            .cum
            .iter()
            .scan(0.0, |prev, &(x, c)| {
                let w = c - *prev;
                *prev = c;
                Some((x, w))
            })
            .filter(|(x, _)| !taken.contains(x))
            .collect();
        if left.is_empty() {
            return None;
        }
        Cdf::new(left).pick(&[], rng)
    }
}

/// A token's experts from co-selection counts: the first in proportion to load, the others in
/// proportion to how often each was chosen together with the first (the anchor); in proportion
/// to load when the anchor's recorded partners run out.
pub(super) struct AnchorTokens {
    pub(super) partners: Vec<Cdf>,
    pub(super) by_load: Cdf,
    pub(super) k: usize,
    pub(super) experts: usize,
}

impl AnchorTokens {
    pub(super) fn new(lp: &crate::stats::LayerPairs, pi: &[f64], k: usize) -> AnchorTokens {
        let e = pi.len();
        let mut rows: Vec<Vec<(u32, f64)>> = vec![Vec::new(); e];
        for &(a, b, c) in &lp.pairs {
            rows[a as usize].push((b, c));
            rows[b as usize].push((a, c));
        }
        AnchorTokens {
            partners: rows.into_iter().map(Cdf::new).collect(),
            by_load: Cdf::new(pi.iter().enumerate().map(|(x, &w)| (x as u32, w))),
            k: k.min(e),
            experts: e,
        }
    }

    pub(super) fn draw(&self, rng: &mut SplitMix64, chosen: &mut Vec<u32>) {
        chosen.clear();
        while chosen.len() < self.k {
            let x = match chosen.first() {
                Some(&anchor) => self.partners[anchor as usize].pick(chosen, rng),
                None => None,
            }
            .or_else(|| self.by_load.pick(chosen, rng))
            .or_else(|| (0..self.experts as u32).find(|x| !chosen.contains(x)));
            match x {
                Some(x) => chosen.push(x),
                None => break,
            }
        }
    }
}

/// A token's experts under group-limited routing: `topk_group` distinct groups in proportion
/// to their load, then `k` distinct experts among those groups' in proportion to load.
pub(super) struct GroupTokens {
    pub(super) pi: Vec<f64>,
    pub(super) groups: Cdf,
    pub(super) by_load: Cdf,
    pub(super) group_size: usize,
    pub(super) topk_group: usize,
    pub(super) k: usize,
}

impl GroupTokens {
    pub(super) fn new(pi: &[f64], n_group: usize, topk_group: usize, k: usize) -> GroupTokens {
        let gs = pi.len() / n_group.max(1);
        GroupTokens {
            pi: pi.to_vec(),
            groups: Cdf::new(
                (0..n_group).map(|g| (g as u32, pi[g * gs..(g + 1) * gs].iter().sum())),
            ),
            by_load: Cdf::new(pi.iter().enumerate().map(|(x, &w)| (x as u32, w))),
            group_size: gs,
            topk_group: topk_group.min(n_group),
            k: k.min(pi.len()),
        }
    }

    pub(super) fn draw(&self, rng: &mut SplitMix64, chosen: &mut Vec<u32>) {
        let mut groups: Vec<u32> = Vec::with_capacity(self.topk_group);
        while groups.len() < self.topk_group {
            match self.groups.pick(&groups, rng) {
                Some(g) => groups.push(g),
                None => break,
            }
        }
        let gs = self.group_size;
        let allowed = Cdf::new(groups.iter().flat_map(|&g| {
            (g as usize * gs..(g as usize + 1) * gs).map(|x| (x as u32, self.pi[x]))
        }));
        chosen.clear();
        while chosen.len() < self.k {
            match allowed
                .pick(chosen, rng)
                .or_else(|| self.by_load.pick(chosen, rng))
            {
                Some(x) => chosen.push(x),
                None => break,
            }
        }
    }
}

/// Fan-out by sampling [`SAMPLED_TOKENS`] tokens from `draw` (seeded by the layer, so every
/// placement is judged on the same tokens): per-device and per-node touch probabilities and
/// P(any remote node). Replica choice as the router makes it: a replica on a device the token
/// already goes to, else on a node it already goes to, else the replicas take turns.
pub(super) fn sampled_touch(
    placement: &Placement,
    layer: u32,
    node_of: &[usize],
    n_nodes: usize,
    router_node: usize,
    mut draw: impl FnMut(&mut SplitMix64, &mut Vec<u32>),
) -> (Vec<f64>, Vec<f64>, f64) {
    let n_dev = node_of.len();
    let mut rng = SplitMix64::new(mix_seed(&[layer as u64, 0x5a3b1e]));
    let (mut dev_hits, mut node_hits, mut remote_hits) =
        (vec![0u32; n_dev], vec![0u32; n_nodes], 0u32);
    let mut chosen: Vec<u32> = Vec::new();
    let mut dev_stamp = vec![u32::MAX; n_dev];
    let mut node_stamp = vec![u32::MAX; n_nodes];
    for t in 0..SAMPLED_TOKENS as u32 {
        draw(&mut rng, &mut chosen);
        let mut remote = false;
        for (slot, &x) in chosen.iter().enumerate() {
            let owners = placement.owners(layer, x);
            if owners.is_empty() {
                continue;
            }
            let d = owners
                .iter()
                .find(|r| dev_stamp[r.index()] == t)
                .or_else(|| owners.iter().find(|r| node_stamp[node_of[r.index()]] == t))
                .unwrap_or(&owners[(t as usize + slot) % owners.len()])
                .index();
            if dev_stamp[d] != t {
                dev_stamp[d] = t;
                dev_hits[d] += 1;
            }
            let n = node_of[d];
            if node_stamp[n] != t {
                node_stamp[n] = t;
                node_hits[n] += 1;
                remote |= n != router_node;
            }
        }
        remote_hits += remote as u32;
    }
    let f = |x: u32| x as f64 / SAMPLED_TOKENS as f64;
    (
        dev_hits.into_iter().map(f).collect(),
        node_hits.into_iter().map(f).collect(),
        f(remote_hits),
    )
}

/// P(a set holding `pairs` expected (token, expert) pairs per token is missed by a token's
/// `k` distinct experts out of `e`): `prod_{j<k} (1 - m / (e - j))` with `m = pairs * e / k`
/// experts' worth of load (exact for uniform load: `C(e - m, k) / C(e, k)`).
pub(super) fn untouched(pairs: f64, e: usize, k: usize) -> f64 {
    let (ef, m) = (e as f64, pairs * e as f64 / k.max(1) as f64);
    (0..k.min(e))
        .map(|j| (1.0 - m / (ef - j as f64)).clamp(0.0, 1.0))
        .product()
}

/// P(touched by a token) per device and per node, and P(any node other than the router's),
/// from each device's expected pairs per token ([`untouched`]).
pub(super) fn distinct_draw_touch(
    pairs: &[f64],
    e: usize,
    k: usize,
    node_of: &[usize],
    n_nodes: usize,
    router_node: usize,
) -> (Vec<f64>, Vec<f64>, f64) {
    let mut node_pairs = vec![0.0; n_nodes];
    for (d, &p) in pairs.iter().enumerate() {
        node_pairs[node_of[d]] += p;
    }
    let remote: f64 = (0..n_nodes)
        .filter(|&n| n != router_node)
        .map(|n| node_pairs[n])
        .sum();
    (
        pairs.iter().map(|&p| 1.0 - untouched(p, e, k)).collect(),
        node_pairs
            .iter()
            .map(|&p| 1.0 - untouched(p, e, k))
            .collect(),
        if n_nodes > 1 {
            1.0 - untouched(remote, e, k)
        } else {
            0.0
        },
    )
}
