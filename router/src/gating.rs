//! Gating: router logits to top-k expert choices and routing weights, for every scoring family.
//!
//! Why this exists: which experts a token visits decides where its activations travel, and the
//! routing weights scale what comes back. The router service runs exactly this code, and so does
//! the in-process reference layer, so both make the same choices bit for bit.
//!
//! Deterministic tie-breaking everywhere: a higher score wins; equal scores go to the lower
//! expert (or group) index. Slots are emitted in that order (descending selection score), which
//! is also the order in which the combine sums them.

use expertmesh_topology::model::{ModelSpec, Scoring};

/// Errors from gating.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum GatingError {
    /// A logit (or the input that produced it) is NaN or infinite.
    #[error(
        "token {token}: router logit for expert {expert} is not finite ({value}); check the hidden states for NaN/Inf"
    )]
    NonFinite {
        /// Token index in the batch.
        token: usize,
        /// Expert index.
        expert: usize,
        /// The value.
        value: f32,
    },
    /// Logits or bias have the wrong length.
    #[error("{what}: expected {expected} values, got {got}")]
    Shape {
        /// Which input.
        what: &'static str,
        /// Expected length.
        expected: usize,
        /// Supplied length.
        got: usize,
    },
}

/// A layer's router parameters: the gate matrix `[E][H]` and a per-expert bias `[E]` (the
/// selection-only correction bias for `sigmoid-bias`; ignored by the other families).
#[derive(Clone, Debug, PartialEq)]
pub struct GateWeights {
    /// Routed experts E.
    pub experts: usize,
    /// Hidden size H.
    pub hidden: usize,
    /// Row-major `[E][H]`.
    pub weight: Vec<f32>,
    /// `[E]`.
    pub bias: Vec<f32>,
    /// `[H]`: Qwen2-MoE's `shared_expert_gate` (the shared experts' output of token `x` is
    /// scaled by `sigmoid(shared_gate · x)`); `None` adds them with weight 1.
    pub shared_gate: Option<Vec<f32>>,
}

impl GateWeights {
    /// Logits `[T][E]` for `tokens` hidden vectors `x` (`[T][H]`). Each dot product keeps 8
    /// partial sums (element `i` goes to partial `i % 8`, in order), then adds them pairwise
    /// ((p0+p1)+(p2+p3))+((p4+p5)+(p6+p7)): a fixed order, so the router and the in-process
    /// reference (both call this) agree bit for bit, and one the compiler vectorizes.
    pub fn logits(&self, x: &[f32]) -> Vec<f32> {
        assert_eq!(
            x.len() % self.hidden,
            0,
            "input is not a whole number of tokens"
        );
        let mut out = vec![0f32; x.len() / self.hidden * self.experts];
        self.logits_into(x, &mut out);
        out
    }

    /// [`GateWeights::logits`] into a caller's buffer of `[tokens][experts]`.
    ///
    /// Every logit is [`dot8`] of its expert's row and the token, bit for bit: four experts'
    /// dot products run side by side (each token chunk loaded once for four rows), each in its
    /// own fixed order, with separate multiplies and adds (never fused), so the wider vectors
    /// of an AVX build change nothing but the speed.
    pub fn logits_into(&self, x: &[f32], out: &mut [f32]) {
        let tokens = x.len() / self.hidden;
        assert_eq!(out.len(), tokens * self.experts, "logits buffer shape");
        assert_eq!(
            self.weight.len(),
            self.experts * self.hidden,
            "gate weights shape"
        );
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx") {
            // SAFETY: AVX was detected on this CPU.
            unsafe { logits_avx(&self.weight, self.hidden, x, out) };
            return;
        }
        logits_body(&self.weight, self.hidden, x, out);
    }
}

/// [`GateWeights::logits_into`] compiled for AVX (256-bit vectors; no FMA: the adds stay
/// separate).
///
/// # Safety
/// The CPU must have AVX.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn logits_avx(weight: &[f32], hidden: usize, x: &[f32], out: &mut [f32]) {
    logits_body(weight, hidden, x, out);
}

/// Logits of every token of `x` (`[T][hidden]`) against every row of `weight`
/// (`[E][hidden]`) into `out` (`[T][E]`), four rows at a time.
#[inline(always)]
fn logits_body(weight: &[f32], hidden: usize, x: &[f32], out: &mut [f32]) {
    let experts = weight.len() / hidden;
    for (xt, o) in x
        .chunks_exact(hidden)
        .zip(out.chunks_exact_mut(experts.max(1)))
    {
        let mut rows = weight.chunks_exact(hidden);
        let mut quads = o.chunks_exact_mut(4);
        for q in &mut quads {
            let w: [&[f32]; 4] = std::array::from_fn(|_| rows.next().expect("a row per logit"));
            q.copy_from_slice(&dot8x4(w, xt));
        }
        for (l, w) in quads.into_remainder().iter_mut().zip(rows) {
            *l = dot8(w, xt);
        }
    }
}

/// [`dot8`] of four rows `w` with one `x`, side by side: each the same operations in the same
/// order as alone.
#[inline(always)]
fn dot8x4(w: [&[f32]; 4], x: &[f32]) -> [f32; 4] {
    let mut p = [[0f32; 8]; 4];
    let full = x.len() / 8 * 8;
    for c in (0..full).step_by(8) {
        let xc = &x[c..c + 8];
        for (pi, wi) in p.iter_mut().zip(&w) {
            let wc = &wi[c..c + 8];
            for j in 0..8 {
                pi[j] += wc[j] * xc[j];
            }
        }
    }
    for (pi, wi) in p.iter_mut().zip(&w) {
        for (j, (a, b)) in wi[full..].iter().zip(&x[full..]).enumerate() {
            pi[j] += a * b;
        }
    }
    p.map(tree8)
}

/// The fixed pairwise sum of [`dot8`]'s eight partial sums.
#[inline(always)]
fn tree8(p: [f32; 8]) -> f32 {
    ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]))
}

impl GateWeights {
    /// The weight of the shared experts' output for each of the `x.len() / hidden` tokens of
    /// `x`: `sigmoid(shared_gate · x)` (same dot product as the logits, so the router and the
    /// in-process reference agree bit for bit), or 1 without a shared gate.
    pub fn shared_weights(&self, x: &[f32]) -> Vec<f32> {
        let tokens = x.len() / self.hidden;
        match &self.shared_gate {
            None => vec![1.0; tokens],
            Some(g) => (0..tokens)
                .map(|t| {
                    let z = dot8(g, &x[t * self.hidden..(t + 1) * self.hidden]);
                    1.0 / (1.0 + (-z).exp())
                })
                .collect(),
        }
    }
}

/// The gate's dot product: 8 interleaved partial sums, then a fixed pairwise tree.
#[inline(always)]
fn dot8(a: &[f32], b: &[f32]) -> f32 {
    let mut p = [0f32; 8];
    let mut ca = a.chunks_exact(8);
    let mut cb = b.chunks_exact(8);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for j in 0..8 {
            p[j] += x[j] * y[j];
        }
    }
    for (j, (x, y)) in ca.remainder().iter().zip(cb.remainder()).enumerate() {
        p[j] += x * y;
    }
    tree8(p)
}

/// The router's decision for a batch: `top_k` (expert, weight) slots per token.
#[derive(Clone, Debug, PartialEq)]
pub struct Routing {
    /// Slots per token.
    pub top_k: usize,
    /// `[T][k]` expert ids, in slot order.
    pub experts: Vec<u32>,
    /// `[T][k]` routing weights (after renormalization and scaling).
    pub weights: Vec<f32>,
}

impl Routing {
    /// Number of tokens.
    pub fn tokens(&self) -> usize {
        self.experts.len() / self.top_k.max(1)
    }
    /// Expert ids of token `t`.
    pub fn experts_of(&self, t: usize) -> &[u32] {
        &self.experts[t * self.top_k..(t + 1) * self.top_k]
    }
    /// Weights of token `t`.
    pub fn weights_of(&self, t: usize) -> &[f32] {
        &self.weights[t * self.top_k..(t + 1) * self.top_k]
    }
}

/// Indices of the `k` largest `scores` among `candidates`, by descending score, ties to the lower
/// index, into `best` (cleared first). `candidates` must be ascending.
fn top_k_into(
    scores: &[f32],
    candidates: impl Iterator<Item = usize>,
    k: usize,
    best: &mut Vec<usize>,
) {
    best.clear();
    for i in candidates {
        // Insert i keeping `best` sorted by (score desc, index asc); since candidates ascend,
        // an equal score never displaces an earlier index.
        let pos = best
            .iter()
            .position(|&j| scores[i] > scores[j])
            .unwrap_or(best.len());
        if pos < k {
            best.insert(pos, i);
            best.truncate(k);
        }
    }
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// Per-batch scratch of [`route`]: sized once, reused for every token (no per-token allocation).
struct Scratch {
    scores: Vec<f32>,
    select: Vec<f32>,
    chosen: Vec<usize>,
    weights: Vec<f32>,
    top2: Vec<usize>,
    group_score: Vec<f32>,
    kept: Vec<usize>,
}

impl Scratch {
    fn new(experts: usize, k: usize, groups: usize) -> Self {
        Self {
            scores: vec![0f32; experts],
            select: vec![0f32; experts],
            chosen: Vec::with_capacity(k + 1),
            weights: Vec::with_capacity(k),
            top2: Vec::with_capacity(3),
            group_score: Vec::with_capacity(groups),
            kept: Vec::with_capacity(groups + 1),
        }
    }
}

/// Route a batch: `logits` is `[T][E]`; `bias` is the model's selection bias (`[E]`, used by
/// `sigmoid-bias` only).
pub fn route(spec: &ModelSpec, logits: &[f32], bias: &[f32]) -> Result<Routing, GatingError> {
    let e = spec.routed_experts as usize;
    let k = spec.top_k as usize;
    if logits.len() % e != 0 {
        return Err(GatingError::Shape {
            what: "router logits",
            expected: e * (logits.len() / e + 1),
            got: logits.len(),
        });
    }
    if spec.scoring == Scoring::SigmoidBias && bias.len() != e {
        return Err(GatingError::Shape {
            what: "selection bias",
            expected: e,
            got: bias.len(),
        });
    }
    let tokens = logits.len() / e;
    let mut experts = Vec::with_capacity(tokens * k);
    let mut weights = Vec::with_capacity(tokens * k);
    let mut sc = Scratch::new(e, k, spec.n_group.max(1) as usize);
    for t in 0..tokens {
        let l = &logits[t * e..(t + 1) * e];
        if let Some(i) = l.iter().position(|v| !v.is_finite()) {
            return Err(GatingError::NonFinite {
                token: t,
                expert: i,
                value: l[i],
            });
        }
        route_token(spec, l, bias, &mut sc);
        experts.extend(sc.chosen.iter().map(|&i| i as u32));
        weights.extend_from_slice(&sc.weights);
    }
    Ok(Routing {
        top_k: k,
        experts,
        weights,
    })
}

/// One token's experts (`sc.chosen`) and combine weights (`sc.weights`) from its logits `l`.
fn route_token(spec: &ModelSpec, l: &[f32], bias: &[f32], sc: &mut Scratch) {
    let e = l.len();
    let k = spec.top_k as usize;
    sc.weights.clear();
    match spec.scoring {
        Scoring::Softmax => {
            let max = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0f32;
            for (s, &v) in sc.scores.iter_mut().zip(l) {
                *s = (v - max).exp();
                sum += *s;
            }
            for s in sc.scores.iter_mut() {
                *s /= sum;
            }
            top_k_into(&sc.scores, 0..e, k, &mut sc.chosen);
            sc.weights.extend(sc.chosen.iter().map(|&i| sc.scores[i]));
        }
        Scoring::TopkSoftmax => {
            top_k_into(l, 0..e, k, &mut sc.chosen);
            let max = l[sc.chosen[0]];
            sc.weights
                .extend(sc.chosen.iter().map(|&i| (l[i] - max).exp()));
            let sum: f32 = sc.weights.iter().sum();
            for v in sc.weights.iter_mut() {
                *v /= sum;
            }
        }
        Scoring::SigmoidBias => {
            for i in 0..e {
                sc.scores[i] = sigmoid(l[i]);
                sc.select[i] = sc.scores[i] + bias[i];
            }
            if spec.n_group > 1 {
                let groups = spec.n_group as usize;
                let per = e / groups;
                sc.group_score.clear();
                for g in 0..groups {
                    top_k_into(&sc.select, g * per..(g + 1) * per, 2, &mut sc.top2);
                    let score = sc.top2.iter().map(|&i| sc.select[i]).sum::<f32>();
                    sc.group_score.push(score);
                }
                let topk_group = spec.topk_group as usize;
                top_k_into(&sc.group_score, 0..groups, topk_group, &mut sc.kept);
                sc.kept.sort_unstable();
                let candidates = sc.kept.iter().flat_map(|&g| g * per..(g + 1) * per);
                top_k_into(&sc.select, candidates, k, &mut sc.chosen);
            } else {
                top_k_into(&sc.select, 0..e, k, &mut sc.chosen);
            }
            sc.weights.extend(sc.chosen.iter().map(|&i| sc.scores[i]));
        }
    }
    if spec.norm_topk_prob && spec.scoring != Scoring::TopkSoftmax {
        let sum: f32 = sc.weights.iter().sum();
        // transformers' DeepseekV3TopkRouter / Glm4MoeTopkRouter divide by `sum + 1e-20` (it
        // shows once the chosen scores are tiny, and turns 0/0 into 0); the softmax blocks
        // (Qwen2/Qwen3-MoE, OLMoE) divide by the bare sum.
        let denominator = match spec.scoring {
            Scoring::SigmoidBias => sum + 1e-20,
            _ => sum,
        };
        for v in sc.weights.iter_mut() {
            *v /= denominator;
        }
    }
    if spec.routed_scaling_factor != 1.0 {
        for v in sc.weights.iter_mut() {
            *v *= spec.routed_scaling_factor;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use expertmesh_topology::model::preset_by_name;
    use proptest::prelude::*;

    /// Brute-force oracle: sort every allowed candidate by (score descending, index ascending)
    /// and take the first k.
    fn brute_top_k(scores: &[f32], allowed: &[usize], k: usize) -> Vec<usize> {
        let mut all = allowed.to_vec();
        all.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
        all.truncate(k);
        all
    }

    fn spec_for(name: &str) -> ModelSpec {
        preset_by_name(name).unwrap()
    }

    fn coarse_logits(max_len: usize) -> impl Strategy<Value = Vec<f32>> {
        // Coarse values make ties frequent.
        prop::collection::vec((-8i32..8).prop_map(|v| v as f32 * 0.25), max_len)
    }

    proptest! {
        /// The blocked logits (four rows side by side, AVX where the CPU has it) are the
        /// one-row dot products bit for bit, for any hidden size and expert count.
        #[test]
        fn blocked_logits_are_the_one_row_dot_products(
            hidden in 1usize..80,
            experts in 1usize..12,
            tokens in 1usize..4,
            seed in any::<u64>(),
        ) {
            let mut s = seed | 1;
            let mut next = || {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                // Wide magnitudes and both signs: rounding differences would show.
                let m = (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                m * f32::powi(2.0, (s % 17) as i32 - 8)
            };
            let weight: Vec<f32> = (0..experts * hidden).map(|_| next()).collect();
            let x: Vec<f32> = (0..tokens * hidden).map(|_| next()).collect();
            let g = GateWeights {
                experts,
                hidden,
                weight: weight.clone(),
                bias: vec![0.0; experts],
                shared_gate: None,
            };
            let got = g.logits(&x);
            for t in 0..tokens {
                for e in 0..experts {
                    let want = dot8(
                        &weight[e * hidden..(e + 1) * hidden],
                        &x[t * hidden..(t + 1) * hidden],
                    );
                    prop_assert_eq!(got[t * experts + e].to_bits(), want.to_bits(), "token {} expert {}", t, e);
                }
            }
        }

        #[test]
        fn softmax_matches_brute_force(logits in coarse_logits(8)) {
            let spec = spec_for("toy-softmax");
            let r = route(&spec, &logits, &[]).unwrap();
            let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let ex: Vec<f64> = logits.iter().map(|&v| ((v - max) as f64).exp()).collect();
            let sum: f64 = ex.iter().sum();
            let probs: Vec<f32> = ex.iter().map(|v| (v / sum) as f32).collect();
            let all: Vec<usize> = (0..8).collect();
            let want = brute_top_k(&logits, &all, 2);
            let got: Vec<usize> = r.experts_of(0).iter().map(|&e| e as usize).collect();
            prop_assert_eq!(&got, &want);
            let wsum: f64 = want.iter().map(|&i| probs[i] as f64).sum();
            for (s, &i) in want.iter().enumerate() {
                prop_assert!((r.weights_of(0)[s] as f64 - probs[i] as f64 / wsum).abs() < 1e-5);
            }
        }

        #[test]
        fn topk_softmax_matches_brute_force(logits in coarse_logits(4)) {
            let spec = spec_for("toy-mixtral");
            let r = route(&spec, &logits, &[]).unwrap();
            let all: Vec<usize> = (0..4).collect();
            let want = brute_top_k(&logits, &all, 2);
            let got: Vec<usize> = r.experts_of(0).iter().map(|&e| e as usize).collect();
            prop_assert_eq!(&got, &want);
            let a = (logits[want[0]] as f64).exp();
            let b = (logits[want[1]] as f64).exp();
            prop_assert!((r.weights_of(0)[0] as f64 - a / (a + b)).abs() < 1e-6);
            prop_assert!((r.weights_of(0)[1] as f64 - b / (a + b)).abs() < 1e-6);
        }

        #[test]
        fn grouped_sigmoid_bias_matches_brute_force(
            logits in coarse_logits(16),
            bias in prop::collection::vec((-2i32..3).prop_map(|v| v as f32 * 0.125), 16),
        ) {
            let spec = spec_for("toy-grouped"); // 16 experts, 4 groups of 4, keep 2 groups, top-4
            let r = route(&spec, &logits, &bias).unwrap();
            let scores: Vec<f32> = logits.iter().map(|&v| sigmoid(v)).collect();
            let select: Vec<f32> = scores.iter().zip(&bias).map(|(s, b)| s + b).collect();
            // Brute force groups: every pair of groups, by the sum of each group's top-2.
            let gscore: Vec<f32> = (0..4).map(|g| {
                let idx: Vec<usize> = (g * 4..g * 4 + 4).collect();
                let t = brute_top_k(&select, &idx, 2);
                select[t[0]] + select[t[1]]
            }).collect();
            let groups: Vec<usize> = (0..4).collect();
            let mut kept = brute_top_k(&gscore, &groups, 2);
            kept.sort();
            let allowed: Vec<usize> = kept.iter().flat_map(|&g| g * 4..g * 4 + 4).collect();
            let want = brute_top_k(&select, &allowed, 4);
            let got: Vec<usize> = r.experts_of(0).iter().map(|&e| e as usize).collect();
            prop_assert_eq!(&got, &want);
            let wsum: f64 = want.iter().map(|&i| scores[i] as f64).sum();
            for (s, &i) in want.iter().enumerate() {
                let w = scores[i] as f64 / wsum * 2.5;
                prop_assert!((r.weights_of(0)[s] as f64 - w).abs() < 1e-5, "slot {} {} vs {}", s, r.weights_of(0)[s], w);
            }
        }
    }

    #[test]
    fn ungrouped_sigmoid_bias_uses_bias_for_selection_only() {
        let spec = spec_for("kimi-k2");
        let mut logits = vec![0f32; 384];
        logits[20] = 3.0; // highest raw score, but no bias
        let mut bias = vec![0f32; 384];
        for (i, b) in bias.iter_mut().enumerate().take(8) {
            *b = 1.0 + i as f32 * 0.01; // experts 0..8 win selection through the bias
        }
        let r = route(&spec, &logits, &bias).unwrap();
        let got: Vec<u32> = r.experts_of(0).to_vec();
        assert_eq!(got, vec![7, 6, 5, 4, 3, 2, 1, 0]);
        // weights come from unbiased sigmoid scores, renormalized and scaled by 2.827
        let s: Vec<f64> = got
            .iter()
            .map(|&i| 1.0 / (1.0 + (-(logits[i as usize] as f64)).exp()))
            .collect();
        let sum: f64 = s.iter().sum();
        for (slot, &w) in r.weights_of(0).iter().enumerate() {
            assert!((w as f64 - s[slot] / sum * 2.827).abs() < 1e-5);
        }
        let total: f32 = r.weights_of(0).iter().sum();
        assert!((total - 2.827).abs() < 1e-5);
    }

    #[test]
    fn olmoe_does_not_renormalize() {
        let spec = spec_for("olmoe-1b-7b");
        let logits: Vec<f32> = (0..64).map(|i| (i as f32 * 0.37).sin()).collect();
        let r = route(&spec, &logits, &[]).unwrap();
        let total: f32 = r.weights_of(0).iter().sum();
        assert!(
            total < 0.99,
            "OLMoE weights must stay unnormalized, got sum {total}"
        );
    }

    #[test]
    fn nan_logit_is_named() {
        let spec = spec_for("toy-softmax");
        let mut logits = vec![0.0f32; 16];
        logits[11] = f32::NAN;
        let e = route(&spec, &logits, &[]).unwrap_err();
        assert!(
            matches!(
                e,
                GatingError::NonFinite {
                    token: 1,
                    expert: 3,
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("token 1"));
    }
}
