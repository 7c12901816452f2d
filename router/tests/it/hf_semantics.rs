//! Exact Hugging Face semantics of the router (issue 10, item 4).
//!
//! Each reference below re-implements, in f64 and without any code from `gating.rs`, the
//! published router of one model family, and [`expertmesh_router::gating::route`] is compared
//! with it on seeded random logits (well-separated, near-tie and, for the sigmoid families,
//! very negative logits) for every preset of that family. A token must get the same set of
//! experts (compared sorted, since `torch.topk(..., sorted=False)` fixes no order) and the same
//! combine weight per expert within 1e-6 relative.
//!
//! The references follow `huggingface/transformers` v4.51 to v4.57 (`DeepseekV3TopkRouter`
//! checked line by line against `src/transformers/models/deepseek_v3/modeling_deepseek_v3.py`
//! at commits `00b676f8` and `f5a9ec51`):
//!
//! * [`hf_softmax_topk`] — `Qwen2MoeSparseMoeBlock`, `Qwen3MoeSparseMoeBlock`,
//!   `OlmoeSparseMoeBlock`: `softmax(logits, dtype=float)` over all experts, `torch.topk` of the
//!   probabilities, then `routing_weights /= routing_weights.sum(-1)` only when
//!   `norm_topk_prob` (no epsilon). OLMoE ships `norm_topk_prob = false`.
//! * [`hf_mixtral`] — `MixtralSparseMoeBlock`: the same, always renormalized (no epsilon).
//! * [`hf_gpt_oss`] — `GptOssTopKRouter`: `torch.topk` of the logits, softmax over the k.
//! * [`hf_noaux_tc`] — `DeepseekV3TopkRouter` (DeepSeek-V3/R1) and `Glm4MoeTopkRouter`
//!   (GLM-4.5, the same code); Kimi K2 ships DeepSeek-V3's remote `MoEGate` (`noaux_tc`), the
//!   same steps (with `n_group = 1` its masking never applies):
//!   `scores = sigmoid(logits)`; `scores_for_choice = scores + e_score_correction_bias`;
//!   group score = sum of the top-2 `scores_for_choice` of each of `n_group` groups; keep the
//!   `topk_group` best groups; `scores_for_choice.masked_fill(~score_mask, 0.0)`; `torch.topk`
//!   of that; weights = the unbiased `scores` of the chosen; if `norm_topk_prob`,
//!   `/= sum + 1e-20`; then `* routed_scaling_factor`.
//!
//! Two findings, both pinned by tests here:
//!
//! * The `+ 1e-20` in the sigmoid-bias denominator is visible in f32 whenever the chosen
//!   scores are tiny (logits below about -35), and turns an all-zero selection into zero
//!   weights instead of NaN. `gating.rs` lacked it; it now adds it (sigmoid-bias only, since
//!   the softmax families have no epsilon).
//! * transformers masks dropped groups with **0.0**, not `-inf`. With a negative correction
//!   bias, a kept expert's selection score can be negative; then every expert of a dropped group
//!   (all exactly 0.0) outranks it, and transformers routes to dropped-group experts, picking
//!   among exact 0.0 ties in an order `torch.topk` leaves unspecified. DeepSeek's own inference
//!   code (`deepseek-ai/DeepSeek-V3` `inference/model.py`, `Gate.forward`) masks with `-inf`
//!   (and has no `1e-20`). `gating.rs` keeps the `-inf` semantics (only kept groups are
//!   candidates): the two agree exactly whenever the k-th best kept selection score is
//!   positive, which the random runs check against the 0.0 reference, and
//!   [`negative_bias_masking_follows_deepseek_inference_not_transformers`] pins the regime
//!   where they part.
//!
//! The worst weight error seen is about 7e-7 relative (wide softmax logits, where f32 rounds
//! `logit - max` before `exp`, as torch does too).
//!
//! f32 cannot order scores closer than its rounding, and there torch's own order is
//! unspecified too: tokens whose reference decision has a gap under [`MARGIN`] at a selection
//! or group boundary are not compared, and a run fails if more than a tenth of its tokens
//! are such.

use expertmesh_router::gating::{self, Routing};
use expertmesh_topology::model::{ModelSpec, Scoring, preset_by_name};

/// Smallest decision gap (relative for probabilities, absolute for sigmoid selection and group
/// scores) at which f32 and f64 must agree on the chosen set.
const MARGIN: f64 = 1e-5;

/// Relative tolerance on combine weights (f32 against f64).
const REL_TOL: f64 = 1e-6;

/// SplitMix64: a seeded, dependency-free source of test inputs.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Standard normal (Box-Muller).
    fn normal(&mut self) -> f64 {
        let u = 1.0 - self.uniform();
        let v = self.uniform();
        (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
    fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            v.swap(i, self.below(i + 1));
        }
    }
}

// ----------------------------------------------------------------------------------------------
// References (f64, written from the published code, no gating.rs code).
// ----------------------------------------------------------------------------------------------

/// One token's reference decision: (expert, combine weight) per slot, in no particular order,
/// and the smallest gap at any boundary the decision crossed.
#[derive(Debug)]
struct Decision {
    slots: Vec<(usize, f64)>,
    margin: f64,
}

/// `torch.topk(scores, k)` indices (ties to the lower index, one valid torch order) and the
/// gap between the k-th and the (k+1)-th score (infinite when nothing is left out).
fn topk(scores: &[f64], k: usize) -> (Vec<usize>, f64) {
    let mut idx: Vec<usize> = (0..scores.len()).collect();
    idx.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    let gap = if k < idx.len() {
        scores[idx[k - 1]] - scores[idx[k]]
    } else {
        f64::INFINITY
    };
    idx.truncate(k);
    (idx, gap)
}

/// `F.softmax(logits, dim=-1)` in f64.
fn softmax(l: &[f64]) -> Vec<f64> {
    let max = l.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let ex: Vec<f64> = l.iter().map(|v| (v - max).exp()).collect();
    let sum: f64 = ex.iter().sum();
    ex.iter().map(|v| v / sum).collect()
}

fn widen(l: &[f32]) -> Vec<f64> {
    l.iter().map(|&v| v as f64).collect()
}

/// Relative gap of the top-k boundary of probabilities.
fn relative(gap: f64, kth: f64) -> f64 {
    if gap.is_infinite() { gap } else { gap / kth }
}

/// Qwen2-MoE / Qwen3-MoE / OLMoE: softmax over all, top-k, optional renormalization.
fn hf_softmax_topk(l: &[f32], k: usize, norm_topk_prob: bool) -> Decision {
    let p = softmax(&widen(l));
    let (idx, gap) = topk(&p, k);
    let mut w: Vec<f64> = idx.iter().map(|&i| p[i]).collect();
    if norm_topk_prob {
        let s: f64 = w.iter().sum();
        w.iter_mut().for_each(|v| *v /= s);
    }
    Decision {
        margin: relative(gap, p[idx[k - 1]]),
        slots: idx.into_iter().zip(w).collect(),
    }
}

/// Mixtral: softmax over all, top-k, always renormalized.
fn hf_mixtral(l: &[f32], k: usize) -> Decision {
    hf_softmax_topk(l, k, true)
}

/// gpt-oss: top-k of the logits, softmax over the k chosen logits.
fn hf_gpt_oss(l: &[f32], k: usize) -> Decision {
    let l = widen(l);
    let (idx, gap) = topk(&l, k);
    let chosen: Vec<f64> = idx.iter().map(|&i| l[i]).collect();
    let w = softmax(&chosen);
    Decision {
        margin: gap, // a logit gap is a relative probability gap to first order
        slots: idx.into_iter().zip(w).collect(),
    }
}

/// What dropped groups are filled with before the final top-k.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Mask {
    /// transformers `DeepseekV3TopkRouter` / `Glm4MoeTopkRouter`: `masked_fill(.., 0.0)`.
    Zero,
    /// DeepSeek-V3 `inference/model.py` `Gate`: `masked_fill_(.., float("-inf"))`.
    NegInf,
}

/// DeepSeek-V3 `noaux_tc` (and Kimi K2, GLM-4.5), see the module docs.
fn hf_noaux_tc(spec: &ModelSpec, l: &[f32], bias: &[f32], mask: Mask) -> Decision {
    let e = l.len();
    let k = spec.top_k as usize;
    let n_group = spec.n_group as usize;
    let per = e / n_group;
    let scores: Vec<f64> = l
        .iter()
        .map(|&v| 1.0 / (1.0 + (-(v as f64)).exp()))
        .collect();
    let choice: Vec<f64> = scores
        .iter()
        .zip(bias)
        .map(|(s, &b)| s + b as f64)
        .collect();
    let group_scores: Vec<f64> = (0..n_group)
        .map(|g| {
            topk(&choice[g * per..(g + 1) * per], 2)
                .0
                .iter()
                .map(|&i| choice[g * per + i])
                .sum()
        })
        .collect();
    let (kept, group_gap) = topk(&group_scores, spec.topk_group as usize);
    let fill = match mask {
        Mask::Zero => 0.0,
        Mask::NegInf => f64::NEG_INFINITY,
    };
    let masked: Vec<f64> = (0..e)
        .map(|i| {
            if kept.contains(&(i / per)) {
                choice[i]
            } else {
                fill
            }
        })
        .collect();
    let (idx, gap) = topk(&masked, k);
    let mut w: Vec<f64> = idx.iter().map(|&i| scores[i]).collect();
    if spec.norm_topk_prob {
        let denominator = w.iter().sum::<f64>() + 1e-20;
        w.iter_mut().for_each(|v| *v /= denominator);
    }
    let scale = spec.routed_scaling_factor as f64;
    w.iter_mut().for_each(|v| *v *= scale);
    Decision {
        slots: idx.into_iter().zip(w).collect(),
        margin: gap.min(group_gap),
    }
}

/// The published reference for `spec`'s family.
fn reference(spec: &ModelSpec, l: &[f32], bias: &[f32]) -> Decision {
    let k = spec.top_k as usize;
    match spec.scoring {
        Scoring::Softmax => hf_softmax_topk(l, k, spec.norm_topk_prob),
        Scoring::TopkSoftmax if spec.name.starts_with("gpt-oss") => hf_gpt_oss(l, k),
        Scoring::TopkSoftmax => hf_mixtral(l, k),
        Scoring::SigmoidBias => hf_noaux_tc(spec, l, bias, Mask::Zero),
    }
}

// ----------------------------------------------------------------------------------------------
// Comparison.
// ----------------------------------------------------------------------------------------------

/// Token `t` of `got` against `want`: same expert set, weights matched by expert.
fn compare(got: &Routing, t: usize, want: &Decision) -> Result<f64, String> {
    let mut g: Vec<(usize, f64)> = got
        .experts_of(t)
        .iter()
        .zip(got.weights_of(t))
        .map(|(&e, &w)| (e as usize, w as f64))
        .collect();
    let mut w = want.slots.clone();
    g.sort_by_key(|s| s.0);
    w.sort_by_key(|s| s.0);
    let ge: Vec<usize> = g.iter().map(|s| s.0).collect();
    let we: Vec<usize> = w.iter().map(|s| s.0).collect();
    if ge != we {
        return Err(format!(
            "experts {ge:?}, reference {we:?} (margin {:e})",
            want.margin
        ));
    }
    let mut worst = 0f64;
    for (&(e, gw), &(_, rw)) in g.iter().zip(&w) {
        let rel = (gw - rw).abs() / rw.abs().max(f64::MIN_POSITIVE);
        if rel > REL_TOL || rel.is_nan() {
            return Err(format!(
                "expert {e}: weight {gw:e}, reference {rw:e} (relative {rel:e})"
            ));
        }
        worst = worst.max(rel);
    }
    Ok(worst)
}

/// Route `tokens` with `gating::route` and compare every resolvable token with the published
/// reference; returns how many tokens were compared.
fn check(spec: &ModelSpec, case: &str, tokens: &[Vec<f32>], bias: &[f32]) -> usize {
    let flat: Vec<f32> = tokens.concat();
    let got = gating::route(spec, &flat, bias).expect("route");
    let (mut compared, mut worst) = (0usize, 0f64);
    let mut failures = Vec::new();
    for (t, l) in tokens.iter().enumerate() {
        let want = reference(spec, l, bias);
        if want.margin < MARGIN {
            continue;
        }
        compared += 1;
        match compare(&got, t, &want) {
            Ok(w) => worst = worst.max(w),
            Err(e) => failures.push(format!("token {t}: {e}")),
        }
    }
    assert!(
        failures.is_empty(),
        "{} / {case}: {} of {compared} tokens differ from the published router; first: {:?}",
        spec.name,
        failures.len(),
        &failures[..failures.len().min(3)]
    );
    assert!(
        compared * 10 >= tokens.len() * 9,
        "{} / {case}: only {compared} of {} tokens are resolvable in f32",
        spec.name,
        tokens.len()
    );
    eprintln!(
        "{:>16} / {case:<14} {compared:>5} of {:>5} tokens match, worst weight error {worst:.2e}",
        spec.name,
        tokens.len()
    );
    compared
}

// ----------------------------------------------------------------------------------------------
// Inputs.
// ----------------------------------------------------------------------------------------------

/// Mian-Chowla sequence: every pairwise sum distinct, so near-tied groups built from it never
/// tie exactly.
const SIDON: [u32; 18] = [
    1, 2, 4, 8, 13, 21, 31, 45, 66, 81, 97, 123, 148, 182, 204, 252, 290, 361,
];

fn normal_logits(rng: &mut Rng, e: usize, mean: f64, scale: f64) -> Vec<f32> {
    (0..e)
        .map(|_| (mean + scale * rng.normal()) as f32)
        .collect()
}

/// Softmax families: a cluster of 2k+2 experts above the rest, 1e-4 apart in logit, so the
/// top-k boundary falls between near-tied experts.
fn near_tie_logits(rng: &mut Rng, e: usize, k: usize) -> Vec<f32> {
    let mut l = normal_logits(rng, e, 0.0, 1.0);
    let top = l.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let mut idx: Vec<usize> = (0..e).collect();
    rng.shuffle(&mut idx);
    let m = (2 * k + 2).min(e);
    let mut ranks: Vec<usize> = (0..m).collect();
    rng.shuffle(&mut ranks);
    for (&i, &r) in idx[..m].iter().zip(&ranks) {
        l[i] = (top + 0.5 + r as f64 * 1e-4) as f32;
    }
    l
}

/// A correction bias in [lo, hi): a shuffled even spread (no two experts closer than
/// (hi-lo)/2E), so the bias alone never produces a near-tie.
fn spread_bias(rng: &mut Rng, e: usize, lo: f64, hi: f64) -> Vec<f32> {
    let mut b: Vec<f32> = (0..e)
        .map(|i| (lo + (hi - lo) * (i as f64 + 0.5 * rng.uniform()) / e as f64) as f32)
        .collect();
    rng.shuffle(&mut b);
    b
}

/// Sigmoid families: a cluster of experts whose *selection* scores (sigmoid + bias) sit at
/// 0.65 + 2e-5 * a Sidon value; two per group when grouped (so group scores are near-tied
/// too), 2k+2 anywhere otherwise. The rest sit lower (logits around -2).
fn near_tie_selection(rng: &mut Rng, spec: &ModelSpec, bias: &[f32]) -> Vec<f32> {
    let e = spec.routed_experts as usize;
    let mut l = normal_logits(rng, e, -2.0, 1.0);
    let members: Vec<usize> = if spec.n_group > 1 {
        let per = e / spec.n_group as usize;
        (0..spec.n_group as usize)
            .flat_map(|g| {
                let a = rng.below(per);
                let b = (a + 1 + rng.below(per - 1)) % per;
                [g * per + a, g * per + b]
            })
            .collect()
    } else {
        let mut idx: Vec<usize> = (0..e).collect();
        rng.shuffle(&mut idx);
        idx.truncate(2 * spec.top_k as usize + 2);
        idx
    };
    let mut ranks = SIDON[..members.len()].to_vec();
    rng.shuffle(&mut ranks);
    for (&i, &r) in members.iter().zip(&ranks) {
        let p = 0.65 + 2e-5 * r as f64 - bias[i] as f64; // wanted sigmoid(logit)
        l[i] = (p / (1.0 - p)).ln() as f32;
    }
    l
}

// ----------------------------------------------------------------------------------------------
// Tests.
// ----------------------------------------------------------------------------------------------

const TOKENS: usize = 600;

fn spec(name: &str) -> ModelSpec {
    preset_by_name(name).unwrap_or_else(|| panic!("no preset {name}"))
}

/// A Qwen2-MoE shaped spec (transformers `Qwen2MoeSparseMoeBlock`): Qwen1.5-MoE-A2.7B routes
/// 60 experts top-4, Qwen2-57B-A14B 64 experts top-8, both with `norm_topk_prob = false`.
fn qwen2_moe(experts: u32, top_k: u32) -> ModelSpec {
    let mut m = spec("qwen3-30b-a3b");
    m.name = format!("qwen2-moe-{experts}x{top_k}");
    m.routed_experts = experts;
    m.top_k = top_k;
    m.norm_topk_prob = false;
    m
}

/// Softmax-then-top-k and top-k-softmax families on normal, wide and near-tied logits.
fn check_softmax_like(m: &ModelSpec, rng: &mut Rng) {
    let e = m.routed_experts as usize;
    let k = m.top_k as usize;
    let normal: Vec<Vec<f32>> = (0..TOKENS)
        .map(|_| normal_logits(rng, e, 0.0, 1.0))
        .collect();
    let wide: Vec<Vec<f32>> = (0..TOKENS)
        .map(|_| normal_logits(rng, e, 0.0, 3.0))
        .collect();
    let tied: Vec<Vec<f32>> = (0..TOKENS).map(|_| near_tie_logits(rng, e, k)).collect();
    check(m, "normal", &normal, &[]);
    check(m, "wide", &wide, &[]);
    check(m, "near-tie", &tied, &[]);
}

#[test]
fn softmax_families_match_transformers() {
    let mut rng = Rng(0x5EED_0001);
    let names = [
        "qwen3-30b-a3b",
        "qwen3-235b-a22b",
        "olmoe-1b-7b",
        "toy-softmax",
    ];
    let mut specs: Vec<ModelSpec> = names.iter().map(|n| spec(n)).collect();
    specs.extend([qwen2_moe(60, 4), qwen2_moe(64, 8)]);
    for m in &specs {
        assert_eq!(m.scoring, Scoring::Softmax, "{}", m.name);
        check_softmax_like(m, &mut rng);
    }
}

#[test]
fn topk_softmax_families_match_transformers() {
    let mut rng = Rng(0x5EED_0002);
    for name in [
        "mixtral-8x7b",
        "mixtral-8x22b",
        "gpt-oss-120b",
        "toy-mixtral",
    ] {
        let m = spec(name);
        assert_eq!(m.scoring, Scoring::TopkSoftmax, "{name}");
        check_softmax_like(&m, &mut rng);
    }
}

/// Sigmoid-bias families on normal, near-tied and very negative logits, with a correction bias
/// of both signs.
fn check_sigmoid_bias(m: &ModelSpec, rng: &mut Rng) {
    let e = m.routed_experts as usize;
    let bias = spread_bias(rng, e, -0.3, 0.3);
    let normal: Vec<Vec<f32>> = (0..TOKENS)
        .map(|_| normal_logits(rng, e, 0.0, 1.0))
        .collect();
    check(m, "normal", &normal, &bias);
    let tied: Vec<Vec<f32>> = (0..TOKENS)
        .map(|_| near_tie_selection(rng, m, &bias))
        .collect();
    check(m, "near-tie", &tied, &bias);
    // Chosen sigmoid scores of 1e-20..1e-15: here transformers' `+ 1e-20` moves the weights.
    let tiny: Vec<Vec<f32>> = (0..TOKENS)
        .map(|_| normal_logits(rng, e, -40.0, 3.0))
        .collect();
    check(m, "very-negative", &tiny, &bias);
    // Mostly negative selection scores, still with at least top_k positive among kept groups.
    let negative = spread_bias(rng, e, -0.45, 0.05);
    check(m, "negative-bias", &normal, &negative);
}

#[test]
fn sigmoid_bias_families_match_transformers() {
    let mut rng = Rng(0x5EED_0003);
    for name in [
        "kimi-k2",
        "deepseek-v3",
        "glm-4.5",
        "toy-grouped",
        "demo-small",
    ] {
        let m = spec(name);
        assert_eq!(m.scoring, Scoring::SigmoidBias, "{name}");
        check_sigmoid_bias(&m, &mut rng);
    }
}

#[test]
fn sidon_ranks_have_distinct_pair_sums() {
    let mut sums = Vec::new();
    for i in 0..SIDON.len() {
        for j in i + 1..SIDON.len() {
            sums.push(SIDON[i] + SIDON[j]);
        }
    }
    let n = sums.len();
    sums.sort_unstable();
    sums.dedup();
    assert_eq!(sums.len(), n);
}

/// transformers' `+ 1e-20`: when every chosen score underflows to 0 in f32, the weights are 0
/// (transformers: 0 / (0 + 1e-20)), never NaN (0 / 0).
#[test]
fn underflowed_scores_give_zero_weights_like_transformers() {
    for name in ["kimi-k2", "deepseek-v3", "glm-4.5", "toy-grouped"] {
        let m = spec(name);
        let e = m.routed_experts as usize;
        let bias = spread_bias(&mut Rng(7), e, -0.3, 0.3);
        let logits = vec![-200f32; e];
        let got = gating::route(&m, &logits, &bias).unwrap();
        let want = hf_noaux_tc(&m, &logits, &bias, Mask::Zero);
        assert!(
            got.weights_of(0).iter().all(|&w| w == 0.0),
            "{name}: {:?}",
            got.weights_of(0)
        );
        assert!(
            want.slots.iter().all(|&(_, w)| (0.0..1e-60).contains(&w)),
            "{name}"
        );
    }
}

/// Where transformers and DeepSeek's inference code part: every selection score negative.
/// transformers fills dropped groups with 0.0, which then outranks every kept expert, so its
/// `DeepseekV3TopkRouter` routes the token *only* to experts of dropped groups (ties among
/// them in unspecified order). `gating::route` follows DeepSeek-V3 `inference/model.py`
/// (`-inf`): only kept groups are candidates.
#[test]
fn negative_bias_masking_follows_deepseek_inference_not_transformers() {
    let mut rng = Rng(0x5EED_0004);
    for name in ["deepseek-v3", "toy-grouped"] {
        let m = spec(name);
        let e = m.routed_experts as usize;
        let bias = spread_bias(&mut rng, e, -1.5, -1.2);
        let tokens: Vec<Vec<f32>> = (0..TOKENS)
            .map(|_| normal_logits(&mut rng, e, 0.0, 1.0))
            .collect();
        let got = gating::route(&m, &tokens.concat(), &bias).unwrap();
        let per = e / m.n_group as usize;
        for (t, l) in tokens.iter().enumerate() {
            let inference = hf_noaux_tc(&m, l, &bias, Mask::NegInf);
            assert!(inference.margin >= MARGIN, "{name} token {t}: unresolvable");
            compare(&got, t, &inference).unwrap_or_else(|e| panic!("{name} token {t}: {e}"));
            let hf = hf_noaux_tc(&m, l, &bias, Mask::Zero);
            let groups = |experts: &mut dyn Iterator<Item = usize>| {
                let mut g: Vec<usize> = experts.map(|i| i / per).collect();
                g.sort_unstable();
                g.dedup();
                g
            };
            let ours = groups(&mut got.experts_of(t).iter().map(|&i| i as usize));
            let theirs = groups(&mut hf.slots.iter().map(|s| s.0));
            assert!(
                ours.iter().all(|g| !theirs.contains(g)),
                "{name} token {t}: transformers picked groups {theirs:?}, we {ours:?}"
            );
        }
    }
}
