//! Model specs: the MoE shape of a model, built-in presets, and byte accounting.
//!
//! Why this exists: placement, the planner, the router's gating and the workers all need the
//! same facts about a model (layers, experts, top-k, hidden and intermediate sizes, scoring,
//! quantization). Presets carry the published numbers (sources in
//! `shared/research/placement_models_topology.md`, table B.1); anything else is a model TOML file.

use expertmesh_quant::format::QuantSpec;
use serde::{Deserialize, Serialize};

/// How router logits become expert choices and weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Scoring {
    /// Softmax over all routed experts, then top-k (Qwen3-MoE, OLMoE); renormalized over the k
    /// when `norm_topk_prob`.
    Softmax,
    /// Sigmoid scores plus a per-expert selection bias used only for choosing (DeepSeek-V3
    /// `noaux_tc`, Kimi K2, GLM-4.5), group-limited when `n_group > 1`; the unbiased scores of the
    /// chosen experts are renormalized when `norm_topk_prob` and scaled by
    /// `routed_scaling_factor`.
    SigmoidBias,
    /// Top-k on the raw logits, then softmax over the k chosen (Mixtral, gpt-oss).
    TopkSoftmax,
}

impl Scoring {
    /// The name used in model files.
    pub fn name(self) -> &'static str {
        match self {
            Scoring::Softmax => "softmax",
            Scoring::SigmoidBias => "sigmoid-bias",
            Scoring::TopkSoftmax => "topk-softmax",
        }
    }
}

/// The MoE shape of a model. Fields are public data; [`ModelSpec::check`] states the invariants.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelSpec {
    /// Preset or file name.
    pub name: String,
    /// One line saying what it is.
    pub description: String,
    /// Transformer layers in total (dense and MoE).
    pub num_layers: u32,
    /// Leading dense layers (`first_k_dense_replace`).
    pub first_dense_layers: u32,
    /// Every `moe_layer_step`-th layer after the dense prefix is MoE (1 = all of them).
    pub moe_layer_step: u32,
    /// Model hidden size H.
    pub hidden: u32,
    /// Routed experts per MoE layer E.
    pub routed_experts: u32,
    /// Experts chosen per token k.
    pub top_k: u32,
    /// Routed expert intermediate size F.
    pub moe_intermediate: u32,
    /// Shared (always-on) experts per MoE layer.
    pub shared_experts: u32,
    /// Intermediate size of each shared expert.
    pub shared_intermediate: u32,
    /// The shared experts' output is scaled per token by `sigmoid(shared_gate · x)`
    /// (Qwen2-MoE's `shared_expert_gate`) instead of added with weight 1.
    #[serde(default)]
    pub shared_expert_gate: bool,
    /// Router scoring family.
    pub scoring: Scoring,
    /// Renormalize the chosen experts' weights to sum to one.
    pub norm_topk_prob: bool,
    /// Multiplier applied to routed weights (DeepSeek/Kimi/GLM); 1.0 otherwise.
    pub routed_scaling_factor: f32,
    /// Expert groups for group-limited routing (1 = none).
    pub n_group: u32,
    /// Groups kept per token when `n_group > 1`.
    pub topk_group: u32,
    /// Packed INT4 format of the experts.
    pub quant: QuantSpec,
    /// True for the small presets meant for tests and the demo.
    #[serde(default)]
    pub toy: bool,
}

impl ModelSpec {
    /// The synthetic experts of this model for `seed` (what workers load without a checkpoint).
    pub fn synthetic(&self, seed: u64) -> expertmesh_quant::synth::SyntheticExperts {
        expertmesh_quant::synth::SyntheticExperts {
            quant: self.quant,
            hidden: self.hidden as usize,
            moe_intermediate: self.moe_intermediate as usize,
            shared_intermediate: self.shared_intermediate as usize,
            seed,
        }
    }
    /// Indices of the MoE layers, ascending.
    pub fn moe_layer_ids(&self) -> Vec<u32> {
        let step = self.moe_layer_step.max(1);
        (self.first_dense_layers..self.num_layers)
            .filter(|l| (l - self.first_dense_layers).is_multiple_of(step))
            .collect()
    }

    /// Number of MoE layers.
    pub fn moe_layers(&self) -> u32 {
        self.moe_layer_ids().len() as u32
    }

    /// True when `layer` is a MoE layer of this model.
    pub fn is_moe_layer(&self, layer: u32) -> bool {
        layer >= self.first_dense_layers
            && layer < self.num_layers
            && (layer - self.first_dense_layers).is_multiple_of(self.moe_layer_step.max(1))
    }

    /// Packed bytes of one routed expert.
    pub fn expert_bytes(&self) -> u64 {
        self.quant
            .expert_bytes(self.hidden as u64, self.moe_intermediate as u64)
    }

    /// Packed bytes of one shared expert (same format as the routed ones).
    pub fn shared_expert_bytes(&self) -> u64 {
        self.quant
            .expert_bytes(self.hidden as u64, self.shared_intermediate as u64)
    }

    /// Parameters of one routed expert (3·H·F).
    pub fn expert_params(&self) -> u64 {
        3 * self.hidden as u64 * self.moe_intermediate as u64
    }

    /// Packed bytes of all routed experts of one MoE layer (saturating; [`ModelSpec::check`]
    /// refuses a model whose byte counts do not fit in 64 bits).
    pub fn layer_routed_bytes(&self) -> u64 {
        self.expert_bytes()
            .saturating_mul(self.routed_experts as u64)
    }

    /// Packed bytes of all routed experts of the model (saturating, as
    /// [`ModelSpec::layer_routed_bytes`]).
    pub fn routed_bytes(&self) -> u64 {
        self.checked_routed_bytes().unwrap_or(u64::MAX)
    }

    /// Packed bytes of all shared experts of the model (saturating, as
    /// [`ModelSpec::layer_routed_bytes`]).
    pub fn shared_bytes(&self) -> u64 {
        self.checked_shared_bytes().unwrap_or(u64::MAX)
    }

    /// Packed bytes of all routed experts, or `None` when they do not fit in 64 bits.
    pub fn checked_routed_bytes(&self) -> Option<u64> {
        self.expert_bytes()
            .checked_mul(self.routed_experts as u64)?
            .checked_mul(self.moe_layers() as u64)
    }

    /// Packed bytes of all shared experts, or `None` when they do not fit in 64 bits.
    pub fn checked_shared_bytes(&self) -> Option<u64> {
        self.shared_expert_bytes()
            .checked_mul(self.shared_experts as u64)?
            .checked_mul(self.moe_layers() as u64)
    }

    /// Bytes of one token's hidden vector in bf16 (the dispatch payload per destination).
    pub fn token_bytes_bf16(&self) -> u64 {
        2 * self.hidden as u64
    }

    /// Check internal consistency; every problem is returned, each naming the field and what to
    /// change.
    pub fn check(&self) -> Vec<String> {
        let mut p = Vec::new();
        self.check_layers(&mut p);
        self.check_sizes(&mut p);
        self.check_quant(&mut p);
        self.check_routing(&mut p);
        if p.is_empty() {
            self.check_bytes(&mut p);
        }
        p
    }

    /// Check step: the byte counts fit in 64 bits (so that no sum or product of them wraps).
    fn check_bytes(&self, p: &mut Vec<String>) {
        // The packed size of one matrix is only computed for sizes that cannot overflow it.
        const DIM_LIMIT: u32 = 1 << 24;
        for (key, v) in [
            ("hidden", self.hidden),
            ("moe_intermediate", self.moe_intermediate),
            ("shared_intermediate", self.shared_intermediate),
        ] {
            if v > DIM_LIMIT {
                p.push(format!(
                    "{key} ({v}) is too large to count its bytes; use at most {DIM_LIMIT}"
                ));
                return;
            }
        }
        let layers = self.moe_layers() as u128;
        let routed = self.expert_bytes() as u128 * self.routed_experts as u128 * layers;
        let shared = self.shared_expert_bytes() as u128 * self.shared_experts as u128 * layers;
        let what = "more than 2^64 bytes (18.45 EB), which this build cannot count";
        if routed > u64::MAX as u128 {
            p.push(format!(
                "routed_experts ({}) x {layers} MoE layers x {} B per expert = {routed} B of routed experts, {what}; lower routed_experts, num_layers, hidden or moe_intermediate",
                self.routed_experts,
                self.expert_bytes()
            ));
        } else if shared > u64::MAX as u128 || routed + shared > u64::MAX as u128 {
            p.push(format!(
                "shared_experts ({}) x {layers} MoE layers x {} B per expert = {shared} B of shared experts, which with the routed experts' {routed} B is {what}; lower shared_experts, shared_intermediate or num_layers",
                self.shared_experts,
                self.shared_expert_bytes()
            ));
        }
    }

    /// Check step: the layer counts.
    fn check_layers(&self, p: &mut Vec<String>) {
        need(
            p,
            self.num_layers > 0,
            "num_layers must be at least 1".into(),
        );
        need(
            p,
            self.first_dense_layers < self.num_layers,
            format!(
                "first_dense_layers ({}) must be below num_layers ({}) so at least one layer is MoE",
                self.first_dense_layers, self.num_layers
            ),
        );
        need(
            p,
            self.moe_layer_step >= 1,
            "moe_layer_step must be at least 1".into(),
        );
    }

    /// Check step: expert counts and matrix sizes.
    fn check_sizes(&self, p: &mut Vec<String>) {
        need(
            p,
            self.routed_experts >= 1,
            "routed_experts must be at least 1".into(),
        );
        need(
            p,
            self.top_k >= 1 && self.top_k <= self.routed_experts,
            format!(
                "top_k ({}) must be between 1 and routed_experts ({})",
                self.top_k, self.routed_experts
            ),
        );
        need(
            p,
            positive_multiple_of_32(self.hidden),
            format!("hidden ({}) must be a positive multiple of 32", self.hidden),
        );
        need(
            p,
            positive_multiple_of_32(self.moe_intermediate),
            format!(
                "moe_intermediate ({}) must be a positive multiple of 32",
                self.moe_intermediate
            ),
        );
        need(
            p,
            self.shared_experts == 0 || positive_multiple_of_32(self.shared_intermediate),
            format!(
                "shared_intermediate ({}) must be a positive multiple of 32 when shared_experts > 0",
                self.shared_intermediate
            ),
        );
        need(
            p,
            !self.shared_expert_gate || self.shared_experts > 0,
            "shared_expert_gate = true needs shared_experts > 0".into(),
        );
    }

    /// Check step: the quantization format, and that its groups tile the expert matrices.
    fn check_quant(&self, p: &mut Vec<String>) {
        if let Err(e) = self.quant.validate() {
            p.push(format!("quant: {e}"));
            return;
        }
        // The shared experts' down projection has shared_intermediate columns.
        let shared =
            (self.shared_experts > 0).then_some(("shared_intermediate", self.shared_intermediate));
        for (what, k) in [
            ("hidden", self.hidden),
            ("moe_intermediate", self.moe_intermediate),
        ]
        .into_iter()
        .chain(shared)
        {
            need(
                p,
                k.is_multiple_of(self.quant.group_size),
                format!(
                    "{what} ({k}) is not a multiple of quant.group_size ({}); use group_size 32",
                    self.quant.group_size
                ),
            );
        }
    }

    /// Check step: the router's scaling and (group-limited) routing.
    fn check_routing(&self, p: &mut Vec<String>) {
        need(
            p,
            self.routed_scaling_factor.is_finite() && self.routed_scaling_factor > 0.0,
            format!(
                "routed_scaling_factor ({}) must be a positive finite number",
                self.routed_scaling_factor
            ),
        );
        need(
            p,
            self.n_group >= 1 && self.routed_experts.is_multiple_of(self.n_group.max(1)),
            format!(
                "n_group ({}) must be at least 1 and divide routed_experts ({})",
                self.n_group, self.routed_experts
            ),
        );
        need(
            p,
            self.topk_group >= 1 && self.topk_group <= self.n_group,
            format!(
                "topk_group ({}) must be between 1 and n_group ({})",
                self.topk_group, self.n_group
            ),
        );
        if self.n_group <= 1 {
            return;
        }
        need(
            p,
            self.scoring == Scoring::SigmoidBias,
            "group-limited routing (n_group > 1) is only defined for scoring = \"sigmoid-bias\""
                .into(),
        );
        let per_group = self.routed_experts / self.n_group.max(1);
        need(
            p,
            self.topk_group as u64 * per_group as u64 >= self.top_k as u64,
            format!(
                "topk_group ({}) x experts per group ({per_group}) must be at least top_k ({})",
                self.topk_group, self.top_k
            ),
        );
        need(
            p,
            per_group >= 2,
            format!(
                "each of the {} groups needs at least 2 experts (group score = sum of the top 2)",
                self.n_group
            ),
        );
    }
}

/// Record `msg` unless the condition it states holds.
fn need(p: &mut Vec<String>, ok: bool, msg: String) {
    if !ok {
        p.push(msg);
    }
}

/// A positive multiple of 32.
fn positive_multiple_of_32(v: u32) -> bool {
    v > 0 && v.is_multiple_of(32)
}

#[allow(clippy::too_many_arguments)]
fn preset(
    name: &str,
    description: &str,
    (num_layers, first_dense_layers): (u32, u32),
    hidden: u32,
    (routed_experts, top_k, moe_intermediate): (u32, u32, u32),
    (shared_experts, shared_intermediate): (u32, u32),
    scoring: Scoring,
    norm_topk_prob: bool,
    routed_scaling_factor: f32,
    (n_group, topk_group): (u32, u32),
    toy: bool,
) -> ModelSpec {
    ModelSpec {
        name: name.into(),
        description: description.into(),
        num_layers,
        first_dense_layers,
        moe_layer_step: 1,
        hidden,
        routed_experts,
        top_k,
        moe_intermediate,
        shared_experts,
        shared_intermediate,
        shared_expert_gate: false,
        scoring,
        norm_topk_prob,
        routed_scaling_factor,
        n_group,
        topk_group,
        quant: QuantSpec::G32_BF16,
        toy,
    }
}

/// Every built-in preset, in display order (real models first, then the small ones).
// long-fn: one table of preset data, one entry per model
pub fn presets() -> Vec<ModelSpec> {
    use Scoring::*;
    vec![
        preset(
            "kimi-k2",
            "Moonshot Kimi K2 (1T total, 32B active), native INT4 g32",
            (61, 1),
            7168,
            (384, 8, 2048),
            (1, 2048),
            SigmoidBias,
            true,
            2.827,
            (1, 1),
            false,
        ),
        preset(
            "deepseek-v3",
            "DeepSeek-V3 / R1 (671B), MTP layer excluded",
            (61, 3),
            7168,
            (256, 8, 2048),
            (1, 2048),
            SigmoidBias,
            true,
            2.5,
            (8, 4),
            false,
        ),
        preset(
            "qwen3-235b-a22b",
            "Qwen3-235B-A22B",
            (94, 0),
            4096,
            (128, 8, 1536),
            (0, 0),
            Softmax,
            true,
            1.0,
            (1, 1),
            false,
        ),
        preset(
            "qwen3-30b-a3b",
            "Qwen3-30B-A3B",
            (48, 0),
            2048,
            (128, 8, 768),
            (0, 0),
            Softmax,
            true,
            1.0,
            (1, 1),
            false,
        ),
        preset(
            "mixtral-8x7b",
            "Mixtral 8x7B",
            (32, 0),
            4096,
            (8, 2, 14336),
            (0, 0),
            TopkSoftmax,
            true,
            1.0,
            (1, 1),
            false,
        ),
        preset(
            "mixtral-8x22b",
            "Mixtral 8x22B",
            (56, 0),
            6144,
            (8, 2, 16384),
            (0, 0),
            TopkSoftmax,
            true,
            1.0,
            (1, 1),
            false,
        ),
        preset(
            "glm-4.5",
            "GLM-4.5 (355B-A32B), MTP layer excluded",
            (92, 3),
            5120,
            (160, 8, 1536),
            (1, 1536),
            SigmoidBias,
            true,
            2.5,
            (1, 1),
            false,
        ),
        preset(
            "gpt-oss-120b",
            "gpt-oss-120b (expert biases and swiglu clamp not modeled)",
            (36, 0),
            2880,
            (128, 4, 2880),
            (0, 0),
            TopkSoftmax,
            true,
            1.0,
            (1, 1),
            false,
        ),
        preset(
            "olmoe-1b-7b",
            "OLMoE-1B-7B",
            (16, 0),
            2048,
            (64, 8, 1024),
            (0, 0),
            Softmax,
            false,
            1.0,
            (1, 1),
            false,
        ),
        preset(
            "toy-softmax",
            "test preset: 2 layers, 8 experts, top-2 softmax, H 64",
            (2, 0),
            64,
            (8, 2, 32),
            (0, 0),
            Softmax,
            true,
            1.0,
            (1, 1),
            true,
        ),
        preset(
            "toy-grouped",
            "test preset: 3 layers (1 dense), 16 experts in 4 groups, sigmoid-bias, 1 shared, H 128",
            (3, 1),
            128,
            (16, 4, 64),
            (1, 64),
            SigmoidBias,
            true,
            2.5,
            (4, 2),
            true,
        ),
        preset(
            "toy-mixtral",
            "test preset: 2 layers, 4 experts, top-2 of logits, H 96",
            (2, 0),
            96,
            (4, 2, 64),
            (0, 0),
            TopkSoftmax,
            true,
            1.0,
            (1, 1),
            true,
        ),
        preset(
            "demo-small",
            "demo preset: 4 MoE layers, 32 experts top-4 + 1 shared, sigmoid-bias, H 1024, F 512",
            (4, 0),
            1024,
            (32, 4, 512),
            (1, 512),
            SigmoidBias,
            true,
            2.5,
            (1, 1),
            true,
        ),
    ]
}

/// Look a preset up by name.
pub fn preset_by_name(name: &str) -> Option<ModelSpec> {
    presets().into_iter().find(|m| m.name == name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_are_consistent() {
        for m in presets() {
            assert!(m.check().is_empty(), "{}: {:?}", m.name, m.check());
        }
    }

    /// Every matrix the quantizer packs has whole groups along K: the shared experts' down
    /// projection (`shared_intermediate` columns) as much as the routed ones'.
    #[test]
    fn every_packed_width_must_be_a_multiple_of_the_group_size() {
        let mut m = preset_by_name("kimi-k2").unwrap();
        m.quant.group_size = 128;
        assert!(m.check().is_empty(), "{:?}", m.check());
        m.shared_intermediate = 96;
        let p = m.check();
        assert_eq!(p.len(), 1, "{p:?}");
        assert!(
            p[0].contains("shared_intermediate (96) is not a multiple of quant.group_size (128)"),
            "{p:?}"
        );
        m.shared_experts = 0;
        assert!(m.check().is_empty(), "no shared expert: {:?}", m.check());
        m.moe_intermediate = 2048 + 32;
        assert!(m.check()[0].contains("moe_intermediate"), "{:?}", m.check());
    }

    #[test]
    fn kimi_k2_routed_bytes() {
        let k2 = preset_by_name("kimi-k2").unwrap();
        assert_eq!(k2.moe_layers(), 60);
        assert_eq!(k2.expert_params(), 44_040_192);
        // 60 x 384 x 24,772,608 B = 570.76 GB (research note B.4)
        assert_eq!(k2.routed_bytes(), 570_760_888_320);
        let gb = k2.routed_bytes() as f64 / 1e9;
        assert!((gb - 570.8).abs() < 0.05, "{gb}");
    }

    #[test]
    fn byte_counts_past_64_bits_are_refused_not_wrapped() {
        let mut m = preset_by_name("kimi-k2").unwrap();
        m.num_layers = 4096;
        m.routed_experts = 65_536;
        m.hidden = 1 << 20;
        m.moe_intermediate = 1 << 20;
        m.shared_intermediate = 1 << 20;
        let p = m.check();
        assert_eq!(p.len(), 1, "{p:?}");
        assert!(
            p[0].starts_with("routed_experts (65536) x 4095 MoE layers x "),
            "{p:?}"
        );
        assert!(p[0].contains("more than 2^64 bytes"), "{p:?}");
        assert_eq!(m.checked_routed_bytes(), None);
        // Saturates rather than wrapping to a small number.
        assert_eq!(m.routed_bytes(), u64::MAX);
    }

    #[test]
    fn deepseek_v3_routed_bytes() {
        let v3 = preset_by_name("deepseek-v3").unwrap();
        assert_eq!(v3.moe_layers(), 58);
        let gb = v3.routed_bytes() as f64 / 1e9;
        assert!((gb - 367.82).abs() < 0.01, "{gb}");
    }
}
