//! Synthetic routing statistics: Zipf-skewed expert loads and clustered co-selection, seeded and
//! deterministic.
//!
//! Why this exists: real router statistics come later (the router exports them in the
//! [`stats`](crate::stats) formats); until then, and in tests, the planner needs skewed
//! workloads whose shape is known. Real MoE routing is skewed (a few hot experts per layer, hot
//! ones differing between layers) and clustered (experts that serve one domain are chosen
//! together); these generators produce both, reproducibly from a seed.

use crate::stats::{CoSelection, LayerPairs, LoadStats};
use expertmesh_quant::synth::{SplitMix64, mix_seed};
use expertmesh_topology::model::ModelSpec;

/// A random permutation of `0..n`.
fn permutation(n: usize, rng: &mut SplitMix64) -> Vec<u32> {
    let mut p: Vec<u32> = (0..n as u32).collect();
    for i in (1..n).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        p.swap(i, j);
    }
    p
}

/// Zipf-distributed expert loads: in each MoE layer the expert of popularity rank `i` (a random
/// permutation per layer) gets a share proportional to `1 / (i + 1)^exponent` of the
/// `tokens * top_k` selections — capped so no expert is chosen by more than every token (see
/// [`inclusion`](crate::stats::inclusion)) — rounded to whole counts.
pub fn zipf_load(model: &ModelSpec, exponent: f64, tokens: u64, seed: u64) -> LoadStats {
    let e = model.routed_experts as usize;
    let ids = model.moe_layer_ids();
    let weights: Vec<f64> = (0..e)
        .map(|i| 1.0 / ((i + 1) as f64).powf(exponent))
        .collect();
    // No expert is in more than every token: the share of the hottest is capped at 1/k.
    let pi = crate::stats::inclusion(&weights, model.top_k);
    let counts = ids
        .iter()
        .map(|&layer| {
            let mut rng = SplitMix64::new(mix_seed(&[seed, layer as u64, 0x21bf]));
            let perm = permutation(e, &mut rng);
            let mut c = vec![0.0; e];
            for (rank, &x) in perm.iter().enumerate() {
                c[x as usize] = (tokens as f64 * pi[rank]).round();
            }
            Some(c)
        })
        .collect();
    LoadStats::new(model, counts)
        .expect("generated counts are finite, non-negative, one per expert")
        .with_tokens(tokens as f64)
}

/// Tokens whose experts come mostly from one of a few clusters.
///
/// Per MoE layer the experts are split at random into `clusters` clusters of (nearly) equal
/// size. A token picks a cluster (Zipf with `cluster_skew`; 0 = uniform), then its `top_k`
/// distinct experts: each from the token's cluster with probability `locality`, else from all
/// experts, uniformly among those not yet chosen.
#[derive(Clone, Debug)]
pub struct ClusteredRouting {
    experts: usize,
    top_k: usize,
    /// `[MoE layer index][cluster]` → experts.
    clusters: Vec<Vec<Vec<u32>>>,
    cluster_cdf: Vec<f64>,
    locality: f64,
    seed: u64,
}

impl ClusteredRouting {
    /// Set up clusters for every MoE layer of `model`.
    pub fn new(
        model: &ModelSpec,
        clusters: usize,
        locality: f64,
        cluster_skew: f64,
        seed: u64,
    ) -> ClusteredRouting {
        let e = model.routed_experts as usize;
        let clusters = clusters.clamp(1, e.max(1));
        let layers = model
            .moe_layer_ids()
            .iter()
            .map(|&layer| {
                let mut rng = SplitMix64::new(mix_seed(&[seed, layer as u64, 0xc105]));
                let perm = permutation(e, &mut rng);
                (0..clusters)
                    .map(|c| perm[c * e / clusters..(c + 1) * e / clusters].to_vec())
                    .collect()
            })
            .collect();
        let w: Vec<f64> = (0..clusters)
            .map(|i| 1.0 / ((i + 1) as f64).powf(cluster_skew))
            .collect();
        let total: f64 = w.iter().sum();
        let mut acc = 0.0;
        let cluster_cdf = w
            .iter()
            .map(|x| {
                acc += x / total;
                acc
            })
            .collect();
        ClusteredRouting {
            experts: e,
            top_k: model.top_k as usize,
            clusters: layers,
            cluster_cdf,
            locality: locality.clamp(0.0, 1.0),
            seed,
        }
    }

    /// `tokens` tokens' expert choices for the `li`-th MoE layer.
    pub fn sample(&self, li: usize, tokens: usize) -> Vec<Vec<u32>> {
        let mut rng = SplitMix64::new(mix_seed(&[self.seed, li as u64, 0x70c3]));
        let k = self.top_k.min(self.experts);
        (0..tokens)
            .map(|_| {
                let u = rng.next_f64();
                let c = self
                    .cluster_cdf
                    .iter()
                    .position(|&x| u < x)
                    .unwrap_or(self.cluster_cdf.len() - 1);
                let own = &self.clusters[li][c];
                let mut chosen: Vec<u32> = Vec::with_capacity(k);
                while chosen.len() < k {
                    let from_own =
                        rng.next_f64() < self.locality && own.iter().any(|x| !chosen.contains(x));
                    let x = if from_own {
                        own[rng.below(own.len() as u64) as usize]
                    } else {
                        rng.below(self.experts as u64) as u32
                    };
                    if !chosen.contains(&x) {
                        chosen.push(x);
                    }
                }
                chosen
            })
            .collect()
    }

    /// Load and co-selection statistics of `tokens` sampled tokens per MoE layer.
    pub fn statistics(&self, model: &ModelSpec, tokens: usize) -> (LoadStats, CoSelection) {
        let e = self.experts;
        let mut loads = Vec::with_capacity(self.clusters.len());
        let mut pairs = Vec::with_capacity(self.clusters.len());
        for li in 0..self.clusters.len() {
            let mut load = vec![0.0; e];
            let mut co: std::collections::HashMap<(u32, u32), f64> = Default::default();
            for t in self.sample(li, tokens) {
                for (i, &a) in t.iter().enumerate() {
                    load[a as usize] += 1.0;
                    for &b in &t[i + 1..] {
                        *co.entry((a.min(b), a.max(b))).or_default() += 1.0;
                    }
                }
            }
            let raw: Vec<(u32, u32, f64)> = co.into_iter().map(|((a, b), c)| (a, b, c)).collect();
            loads.push(Some(load));
            pairs.push(Some(LayerPairs::from_raw(tokens as f64, raw)));
        }
        (
            LoadStats::new(model, loads)
                .expect("sampled counts are valid")
                .with_tokens(tokens as f64),
            CoSelection::new(model, pairs).expect("sampled pairs are valid"),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use expertmesh_topology::model::preset_by_name;

    #[test]
    fn zipf_is_skewed_and_reproducible() {
        let m = preset_by_name("kimi-k2").unwrap();
        let a = zipf_load(&m, 1.0, 100_000, 1);
        let b = zipf_load(&m, 1.0, 100_000, 1);
        assert_eq!(a, b);
        let l0 = a.layer(0).unwrap();
        let max = l0.iter().copied().fold(0.0, f64::max);
        let mean = l0.iter().sum::<f64>() / l0.len() as f64;
        // Zipf(1) over 384: the top expert would have 384 / H(384) ≈ 59x the mean, more than
        // every token (48x the mean for top-8): capped at one selection per token.
        assert_eq!(max, 100_000.0);
        assert!((max / mean - 48.0).abs() < 0.01, "{}", max / mean);
        let sum: f64 = l0.iter().sum();
        assert!((sum - 800_000.0).abs() / 800_000.0 < 0.01);
        assert_ne!(a.layer(0), a.layer(1), "hot experts differ between layers");
    }

    #[test]
    fn clustered_tokens_choose_distinct_experts_mostly_from_one_cluster() {
        let m = preset_by_name("deepseek-v3").unwrap();
        let r = ClusteredRouting::new(&m, 8, 0.9, 0.0, 3);
        let toks = r.sample(0, 500);
        let clusters = &r.clusters[0];
        let mut same = 0usize;
        for t in &toks {
            assert_eq!(t.len(), 8);
            let mut s = t.clone();
            s.sort();
            s.dedup();
            assert_eq!(s.len(), 8);
            // The cluster holding most of the token's experts.
            let best = clusters
                .iter()
                .map(|c| t.iter().filter(|x| c.contains(x)).count())
                .max()
                .unwrap();
            same += best;
        }
        let share = same as f64 / (8.0 * toks.len() as f64);
        assert!(share > 0.8, "{share}");
        let (load, co) = r.statistics(&m, 200);
        assert_eq!(load.layer(0).unwrap().iter().sum::<f64>(), 1600.0);
        let pairs: f64 = co.layer(0).unwrap().pairs.iter().map(|p| p.2).sum();
        assert_eq!(pairs, 200.0 * 28.0);
    }
}
