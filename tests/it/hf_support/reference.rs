//! An independent f64 reference of one MoE block per supported family, for end-to-end tests.
//!
//! Why this exists: the converter and the fabric must compute what the Hugging Face model
//! computes. Comparing them with `router/src` (`gating.rs`, `reference.rs`) would only show that
//! the project agrees with itself, so this module is written from the published modeling code
//! (`huggingface/transformers`, v4.51–v4.57, and DeepSeek's own code) and shares nothing with
//! the router crate.
//!
//! Per family (`router_logits = gate · x`, computed here in f64 from the stored gate weights):
//!
//! * Qwen3-MoE, Qwen2-MoE (`Qwen{2,3}MoeSparseMoeBlock`), OLMoE (`OlmoeSparseMoeBlock`):
//!   `softmax(router_logits)` over all experts, `topk`, then `/= sum` only when `norm_topk_prob`
//!   (no epsilon). Qwen2-MoE's shared expert (`shared_expert`, an MLP of width
//!   `shared_expert_intermediate_size`) is gated per token:
//!   `sigmoid(shared_expert_gate(x)) * shared_expert(x)`, with `shared_expert_gate` a
//!   `Linear(hidden, 1, bias=False)` ([`MoeBlock::shared_gate`]), added to the routed output.
//! * Mixtral (`MixtralSparseMoeBlock`): softmax over all, `topk`, always `/= sum`.
//! * DeepSeek-V3, Kimi K2, GLM-4.5 (`DeepseekV3TopkRouter`, `Glm4MoeTopkRouter`, and the remote
//!   `MoEGate` with `topk_method = "noaux_tc"`): `scores = sigmoid(router_logits)`;
//!   `choice = scores + e_score_correction_bias` (the bias only chooses); group score = sum of
//!   the top-2 `choice` values of each of `n_group` equal groups; keep the `topk_group` best
//!   groups; `topk` of `choice` over kept groups; weights = the unbiased `scores` of the chosen,
//!   `/ (sum + 1e-20)` when `norm_topk_prob`, then `× routed_scaling_factor`. The shared
//!   expert's output is added with weight 1.
//!
//! Masking of dropped groups: transformers and the remote `modeling_deepseek.py` fill dropped
//! groups with `0.0` before the final `topk`; DeepSeek-V3's `inference/model.py` (and SGLang,
//! vLLM) fill them with `-inf`. This reference uses **`-inf`** (only kept groups are
//! candidates), the semantics the project serves (see `router/tests/it/hf_semantics.rs`). The two
//! agree exactly whenever the `top_k`-th best selection score among kept groups is positive;
//! [`Routing::zero_mask_agrees`] says whether that holds for a token, so tests can assert it
//! (the tiny checkpoints' biases are small enough that it holds for ordinary tokens).
//!
//! Expert FFN (every family): `down · (silu(gate · x) ⊙ (up · x))`, `silu(z) = z / (1 + e^-z)`.
//! Block output: `Σ_slots weight · expert(x)` plus the shared expert when present, with weight
//! `sigmoid(shared_gate · x)` when the block has a shared gate (Qwen2-MoE), else 1.

use expertmesh_checkpoint::hf_config::Family;
use expertmesh_quant::format::{ExpertWeights, GateUp, w13_row};

use super::tiny::TinyCheckpoint;

/// One dense SwiGLU MLP (a routed expert, a shared expert, or a dense layer's MLP), PyTorch
/// `Linear` layout: `gate` and `up` are `[inter × hidden]`, `down` is `[hidden × inter]`,
/// row-major.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct DenseExpert {
    /// Intermediate width.
    pub(crate) inter: usize,
    /// `gate_proj.weight` (Mixtral `w1`), `[inter × hidden]`.
    pub(crate) gate: Vec<f64>,
    /// `up_proj.weight` (Mixtral `w3`), `[inter × hidden]`.
    pub(crate) up: Vec<f64>,
    /// `down_proj.weight` (Mixtral `w2`), `[hidden × inter]`.
    pub(crate) down: Vec<f64>,
}

impl DenseExpert {
    /// An expert from f32 matrices in the layout above (e.g. weights read from a checkpoint).
    pub(crate) fn from_f32(inter: usize, gate: &[f32], up: &[f32], down: &[f32]) -> DenseExpert {
        let widen = |v: &[f32]| v.iter().map(|&x| f64::from(x)).collect::<Vec<f64>>();
        let e = DenseExpert {
            inter,
            gate: widen(gate),
            up: widen(up),
            down: widen(down),
        };
        e.check();
        e
    }

    /// The expert a packed INT4 [`ExpertWeights`] serves: its W13 rows dequantized into gate
    /// and up (where [`w13_row`] places them) and its W2 into down. This is what the fabric
    /// computes with after conversion.
    pub(crate) fn from_packed(w: &ExpertWeights) -> DenseExpert {
        let (h, f) = (w.hidden(), w.inter());
        let w13 = w.w13().dequantize();
        let pick = |which| -> Vec<f32> {
            (0..f)
                .flat_map(|i| w13[w13_row(which, i) * h..][..h].iter().copied())
                .collect()
        };
        DenseExpert::from_f32(
            f,
            &pick(GateUp::Gate),
            &pick(GateUp::Up),
            &w.w2().dequantize(),
        )
    }

    /// The hidden size (`gate.len() / inter`).
    pub(crate) fn hidden(&self) -> usize {
        self.gate.len() / self.inter
    }

    /// Panics unless the three matrices have consistent shapes.
    fn check(&self) {
        let h = self.hidden();
        assert!(self.inter > 0 && h > 0, "empty expert");
        assert_eq!(self.gate.len(), self.inter * h, "gate shape");
        assert_eq!(self.up.len(), self.inter * h, "up shape");
        assert_eq!(self.down.len(), h * self.inter, "down shape");
    }

    /// `down · (silu(gate · x) ⊙ (up · x))` for one token `x` of length `hidden`.
    pub(crate) fn forward(&self, x: &[f64]) -> Vec<f64> {
        let h = self.hidden();
        assert_eq!(x.len(), h, "token length");
        let act: Vec<f64> = (0..self.inter)
            .map(|i| {
                let g = dot(&self.gate[i * h..][..h], x);
                let u = dot(&self.up[i * h..][..h], x);
                silu(g) * u
            })
            .collect();
        (0..h)
            .map(|n| dot(&self.down[n * self.inter..][..self.inter], &act))
            .collect()
    }
}

/// `z · sigmoid(z)`.
pub(crate) fn silu(z: f64) -> f64 {
    z / (1.0 + (-z).exp())
}

/// `1 / (1 + e^-z)`.
pub(crate) fn sigmoid(z: f64) -> f64 {
    1.0 / (1.0 + (-z).exp())
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// How a router turns logits into scores.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Scoring {
    /// Softmax over all experts (Qwen2/Qwen3-MoE, OLMoE, Mixtral).
    Softmax,
    /// Sigmoid scores, correction bias for choosing only, groups (DeepSeek-V3, Kimi K2, GLM-4.5).
    SigmoidBias,
}

impl Scoring {
    /// The scoring `family`'s router uses.
    pub(crate) fn of(family: Family) -> Scoring {
        match family {
            Family::DeepseekV3 | Family::Glm4Moe => Scoring::SigmoidBias,
            _ => Scoring::Softmax,
        }
    }
}

/// One MoE block's parameters, as the published model defines it.
#[derive(Clone, Debug)]
pub(crate) struct MoeBlock {
    /// Softmax or sigmoid with bias (must match the family given to [`moe_block_f64`]).
    pub(crate) scoring: Scoring,
    /// Experts per token (`num_experts_per_tok`).
    pub(crate) top_k: usize,
    /// Renormalize the chosen weights (ignored for Mixtral, which always does).
    pub(crate) norm_topk_prob: bool,
    /// Factor on the routed weights (sigmoid families; 1 elsewhere, where it is ignored).
    pub(crate) routed_scaling_factor: f64,
    /// Expert groups (sigmoid families; 1 = no grouping).
    pub(crate) n_group: usize,
    /// Groups kept per token (sigmoid families).
    pub(crate) topk_group: usize,
    /// Router weight `[experts × hidden]`.
    pub(crate) gate: Vec<f64>,
    /// `e_score_correction_bias` `[experts]` (zeros when the family has none).
    pub(crate) bias: Vec<f64>,
    /// The routed experts.
    pub(crate) experts: Vec<DenseExpert>,
    /// The shared expert, added with weight 1 (DeepSeek-V3 family) or gated (Qwen2-MoE).
    pub(crate) shared: Option<DenseExpert>,
    /// Qwen2-MoE's `shared_expert_gate.weight` `[hidden]`: the shared expert's output is scaled
    /// by `sigmoid(shared_gate · x)`. `None`: weight 1 (the DeepSeek-V3 family).
    pub(crate) shared_gate: Option<Vec<f64>>,
}

impl MoeBlock {
    /// The same block with other expert weights (e.g. dequantized from converted INT4 shards
    /// with [`DenseExpert::from_packed`]): routing parameters, gate and shared gate are kept.
    pub(crate) fn with_experts(
        &self,
        experts: Vec<DenseExpert>,
        shared: Option<DenseExpert>,
    ) -> MoeBlock {
        assert_eq!(experts.len(), self.experts.len(), "routed expert count");
        assert_eq!(
            shared.is_some(),
            self.shared.is_some(),
            "shared expert presence"
        );
        MoeBlock {
            experts,
            shared,
            ..self.clone()
        }
    }

    /// Number of routed experts.
    pub(crate) fn num_experts(&self) -> usize {
        self.experts.len()
    }

    /// The hidden size (`gate.len() / experts`).
    pub(crate) fn hidden(&self) -> usize {
        self.gate.len() / self.experts.len()
    }

    /// The weight of the shared expert's output for one token: `sigmoid(shared_gate · x)`, or 1
    /// without a shared gate.
    pub(crate) fn shared_weight(&self, x: &[f64]) -> f64 {
        match &self.shared_gate {
            Some(g) => {
                assert_eq!(g.len(), x.len(), "shared gate length");
                sigmoid(dot(g, x))
            }
            None => 1.0,
        }
    }

    /// `router_logits = gate · x` for one token.
    pub(crate) fn logits(&self, x: &[f64]) -> Vec<f64> {
        let h = self.hidden();
        assert_eq!(x.len(), h, "token length");
        (0..self.num_experts())
            .map(|e| dot(&self.gate[e * h..][..h], x))
            .collect()
    }
}

/// One token's routing decision.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Routing {
    /// Chosen experts, best selection score first (ties to the lower index; `torch.topk` fixes
    /// no order, so compare as sets).
    pub(crate) experts: Vec<usize>,
    /// Combine weight of each chosen expert (same order).
    pub(crate) weights: Vec<f64>,
    /// Smallest gap at a decision boundary: between the `k`-th and `k+1`-th candidate (logits
    /// for softmax families, which order probabilities the same; selection scores for sigmoid
    /// families) and, when groups are dropped, between the last kept and first dropped group
    /// score. Infinite when nothing was left out. A token whose margin is below the tested
    /// arithmetic's rounding may be routed differently by a correct implementation.
    pub(crate) margin: f64,
    /// True when masking dropped groups with `0.0` (transformers) would choose the same experts
    /// as `-inf` (this reference): no group was dropped, or the `top_k`-th chosen selection score
    /// is positive.
    pub(crate) zero_mask_agrees: bool,
}

/// Indices of the `k` largest `scores` (ties to the lower index) and the gap between the `k`-th
/// and the `k+1`-th (infinite when `k` covers all).
fn topk(scores: &[f64], k: usize) -> (Vec<usize>, f64) {
    let mut idx: Vec<usize> = (0..scores.len()).collect();
    idx.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    let gap = match idx.get(k) {
        Some(&next) => scores[idx[k - 1]] - scores[next],
        None => f64::INFINITY,
    };
    idx.truncate(k);
    (idx, gap)
}

/// Softmax families: `softmax` over all experts, top-k, renormalized when `renormalize`.
fn route_softmax(logits: &[f64], top_k: usize, renormalize: bool) -> Routing {
    let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let ex: Vec<f64> = logits.iter().map(|l| (l - max).exp()).collect();
    let total: f64 = ex.iter().sum();
    let probs: Vec<f64> = ex.iter().map(|v| v / total).collect();
    let (experts, _) = topk(&probs, top_k);
    // Probabilities order like logits; the logit gap is the scale-free margin.
    let (_, margin) = topk(logits, top_k);
    let mut weights: Vec<f64> = experts.iter().map(|&e| probs[e]).collect();
    if renormalize {
        let sum: f64 = weights.iter().sum();
        weights.iter_mut().for_each(|w| *w /= sum);
    }
    Routing {
        experts,
        weights,
        margin,
        zero_mask_agrees: true,
    }
}

/// Sigmoid families (`noaux_tc`): see the module docs.
fn route_sigmoid_bias(block: &MoeBlock, logits: &[f64]) -> Routing {
    let e = logits.len();
    assert_eq!(block.bias.len(), e, "bias length");
    let (n_group, topk_group) = (block.n_group.max(1), block.topk_group.max(1));
    assert_eq!(
        e % n_group,
        0,
        "experts must split into n_group equal groups"
    );
    let per = e / n_group;
    let scores: Vec<f64> = logits.iter().map(|&l| sigmoid(l)).collect();
    let choice: Vec<f64> = scores.iter().zip(&block.bias).map(|(s, b)| s + b).collect();
    let group_scores: Vec<f64> = (0..n_group)
        .map(|g| {
            let members = &choice[g * per..][..per];
            topk(members, 2.min(per))
                .0
                .iter()
                .map(|&i| members[i])
                .sum()
        })
        .collect();
    let (kept, group_gap) = topk(&group_scores, topk_group);
    let masked: Vec<f64> = (0..e)
        .map(|i| {
            if kept.contains(&(i / per)) {
                choice[i]
            } else {
                f64::NEG_INFINITY
            }
        })
        .collect();
    let (experts, gap) = topk(&masked, block.top_k);
    let kth = choice[experts[block.top_k - 1]];
    let mut weights: Vec<f64> = experts.iter().map(|&i| scores[i]).collect();
    if block.norm_topk_prob {
        let denominator = weights.iter().sum::<f64>() + 1e-20;
        weights.iter_mut().for_each(|w| *w /= denominator);
    }
    weights
        .iter_mut()
        .for_each(|w| *w *= block.routed_scaling_factor);
    Routing {
        experts,
        weights,
        // A gap to a masked (-inf) candidate is infinite: nothing else could be chosen.
        margin: gap.min(group_gap),
        zero_mask_agrees: kept.len() == n_group || kth > 0.0,
    }
}

/// The routing of one token with router logits `logits` by `family`'s published router.
pub(crate) fn route_f64(block: &MoeBlock, family: Family, logits: &[f64]) -> Routing {
    assert_eq!(
        block.scoring,
        Scoring::of(family),
        "block scoring does not match {family:?}"
    );
    assert!(
        (1..=logits.len()).contains(&block.top_k),
        "top_k {} with {} experts",
        block.top_k,
        logits.len()
    );
    match family {
        Family::DeepseekV3 | Family::Glm4Moe => route_sigmoid_bias(block, logits),
        Family::Mixtral => route_softmax(logits, block.top_k, true),
        Family::Qwen3Moe | Family::Qwen2Moe | Family::Olmoe => {
            route_softmax(logits, block.top_k, block.norm_topk_prob)
        }
    }
}

/// The routing of each of `tokens` rows of `x` (`[tokens × hidden]`).
pub(crate) fn route_tokens(
    block: &MoeBlock,
    family: Family,
    x: &[f64],
    tokens: usize,
) -> Vec<Routing> {
    let h = block.hidden();
    assert_eq!(x.len(), tokens * h, "x must be [tokens × hidden]");
    x.chunks_exact(h)
        .map(|t| route_f64(block, family, &block.logits(t)))
        .collect()
}

/// The MoE block's output for `tokens` rows of `x` (`[tokens × hidden]`, row-major):
/// `Σ weight · expert(x)` over each token's chosen experts plus the shared expert (weight 1, or
/// `sigmoid(shared_gate · x)` with a shared gate), following `family`'s published code (see the
/// module docs).
pub(crate) fn moe_block_f64(
    block: &MoeBlock,
    family: Family,
    x: &[f64],
    tokens: usize,
) -> Vec<f64> {
    let h = block.hidden();
    let routings = route_tokens(block, family, x, tokens);
    let mut out = vec![0f64; tokens * h];
    for ((t, row), routing) in x.chunks_exact(h).enumerate().zip(&routings) {
        let acc = &mut out[t * h..][..h];
        for (&e, &w) in routing.experts.iter().zip(&routing.weights) {
            for (a, y) in acc.iter_mut().zip(block.experts[e].forward(row)) {
                *a += w * y;
            }
        }
        if let Some(shared) = &block.shared {
            let w = block.shared_weight(row);
            for (a, y) in acc.iter_mut().zip(shared.forward(row)) {
                *a += w * y;
            }
        }
    }
    out
}

/// The MoE block of layer `layer` of a tiny checkpoint, from its values as stored (router,
/// bias, routed and shared experts, Qwen2-MoE's shared expert gate) and its spec's routing
/// parameters. Substitute other
/// experts (e.g. the converted INT4 shards) with [`MoeBlock::with_experts`].
pub(crate) fn block_from_tiny(ck: &TinyCheckpoint, layer: usize) -> MoeBlock {
    let spec = &ck.spec;
    let moe = ck.moe(layer);
    let sigmoid = spec.is_sigmoid();
    MoeBlock {
        scoring: Scoring::of(spec.family),
        top_k: spec.top_k,
        norm_topk_prob: spec.norm_topk_prob,
        routed_scaling_factor: if sigmoid {
            spec.routed_scaling_factor
        } else {
            1.0
        },
        n_group: if sigmoid { spec.n_group } else { 1 },
        topk_group: if sigmoid { spec.topk_group } else { 1 },
        gate: moe.gate.clone(),
        bias: moe
            .bias
            .clone()
            .unwrap_or_else(|| vec![0.0; spec.routed_experts]),
        experts: moe.experts.clone(),
        shared: moe.shared.clone(),
        shared_gate: moe.shared_gate.clone(),
    }
}
