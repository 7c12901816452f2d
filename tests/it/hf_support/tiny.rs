//! Tiny Hugging Face MoE checkpoint folders, written the way the published checkpoints are, for
//! end-to-end tests of the checkpoint converter.
//!
//! Why this exists: real checkpoints are hundreds of GiB; a converter test needs a folder with a
//! real-looking `config.json` (the keys `hf_config.rs` reads, per family), real-looking
//! safetensors files (single or sharded with `model.safetensors.index.json`) in every weight
//! format the converter reads (BF16, F16, F32, block-scaled FP8, compressed-tensors
//! `pack-quantized` INT4, GPTQ and AWQ INT4), and — to build references — the values as stored, after the
//! dtype's rounding or quantization, in f64 ([`TinyCheckpoint`]).
//!
//! What is written per family (PyTorch `Linear` layout `[out, in]`):
//!
//! * `model.embed_tokens.weight` `[16, hidden]`.
//! * Dense layers (the first `first_dense`): `model.layers.L.mlp.{gate,up,down}_proj.weight`
//!   of width `dense_inter` (`intermediate_size`).
//! * MoE layers: the router `model.layers.L.mlp.gate.weight` `[E, hidden]` (Mixtral
//!   `block_sparse_moe.gate.weight`), always BF16; DeepSeek-V3/Kimi/GLM also
//!   `mlp.gate.e_score_correction_bias` `[E]` F32 and, when `shared`,
//!   `mlp.shared_experts.{gate,up,down}_proj.weight` of width `moe_inter × n_shared_experts`
//!   (`n_shared_experts = 1`); Qwen2-MoE, when `shared` ([`TinySpec::qwen2_with_shared`]),
//!   `mlp.shared_expert.{gate,up,down}_proj.weight` of width `shared_expert_intermediate_size`
//!   and `mlp.shared_expert_gate.weight` `[1, hidden]` (BF16); the routed experts under the
//!   names of `expertmesh_checkpoint::experts::expert_tensor_names`.
//!
//! Formats: [`WeightFormat::Fp8Block`] stores the experts and dense MLPs as `F8_E4M3` with a
//! `…weight_scale_inv` F32 grid per 128×128 block (scale = block absmax / 448, value =
//! `e4m3(code) × scale` in f32, as DeepSeek-V3); the router and embeddings stay BF16.
//! [`WeightFormat::PackQuantized`] stores only the routed experts as compressed-tensors
//! `pack-quantized` INT4 (`weight_packed` I32 `[rows, cols/8]`, LSB-first codes `q + 8`;
//! `weight_scale` BF16 `[rows, cols/32]`, scale = bf16(group absmax / 7); `weight_shape` I32
//! `[2]`), everything else BF16, as Kimi K2-Thinking. [`WeightFormat::Gptq`] and
//! [`WeightFormat::Awq`] store only the routed experts as asymmetric INT4 with F16 scales in
//! groups of 32, 64 or 128 input features (random zero points, 1..=15 for GPTQ v1 which stores
//! `zero − 1`, else 0..=15; value = `scale × (code − zero)`), everything else BF16, with the
//! `quantization_config` AutoGPTQ / AutoAWQ write. For a weight `X.weight` `[out, in]`:
//!
//! * GPTQ (AutoGPTQ): `X.qweight` I32 `[in/8, out]`, packed along the input dimension (word
//!   `(w, o)` holds inputs `8w..8w+8`, input `8w + i` in bits `4i`); `X.qzeros` I32
//!   `[in/group, out/8]` packed along the output dimension (output `8w + i` in bits `4i`; v1
//!   `zero − 1`, v2 the zero point); `X.scales` F16 `[in/group, out]`; `X.g_idx` I32 `[in]`,
//!   `k / group`.
//! * AWQ (AutoAWQ GEMM): `X.qweight` I32 `[in, out/8]` and `X.qzeros` I32 `[in/group, out/8]`,
//!   both packed along the output dimension with bits `4i` of word `w` holding output
//!   `8w + AWQ_ORDER[i]`; `X.scales` F16 `[in/group, out]`.
//!
//! Random weights have standard deviation `1/sqrt(fan_in)` from a seeded SplitMix64, in tensor
//! order (GPTQ/AWQ zero points are drawn from it too, after their matrix).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use expertmesh_checkpoint::experts::{ExpertRef, expert_tensor_names};
use expertmesh_checkpoint::hf_config::Family;
use expertmesh_checkpoint::safetensors::{
    Dtype, INDEX_FILE, SINGLE_FILE, TensorData, write_safetensors,
};
use expertmesh_quant::fp8::{e4m3_to_f32, f32_to_e4m3};
use expertmesh_quant::synth::SplitMix64;
use half::{bf16, f16};
use serde_json::{Value, json};

use super::reference::DenseExpert;

/// Rows of `model.embed_tokens.weight`.
pub(crate) const VOCAB: usize = 16;

/// Rows and columns of one FP8 `weight_scale_inv` block (DeepSeek-V3's).
pub(crate) const FP8_BLOCK: usize = 128;

/// How [`WeightFormat::Fp8Block`] stores each weight's scales (scale = absmax / 448 of the
/// weights it covers, F32; value = `e4m3(code) × scale`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Fp8Layout {
    /// `…weight_scale_inv` per block of `[rows, cols]` weights, named by `weight_block_size`
    /// in a `quant_method` `fp8` config (DeepSeek-V3: 128 × 128; transformers' fine-grained
    /// FP8 takes others).
    ScaleInv([usize; 2]),
    /// compressed-tensors `float-quantized`, strategy `block`: `…weight_scale` per block of
    /// `block_structure`.
    CompressedBlock([usize; 2]),
    /// compressed-tensors `float-quantized`, strategy `channel`: `…weight_scale` `[rows, 1]`.
    CompressedChannel,
    /// compressed-tensors `float-quantized`, strategy `group` of this many inputs:
    /// `…weight_scale` `[rows, cols / group]`.
    CompressedGroup(usize),
    /// compressed-tensors `float-quantized`, strategy `tensor`: `…weight_scale` `[1]`.
    CompressedTensor,
}

/// Columns per scale group of the `pack-quantized` INT4 format written here.
pub(crate) const PACK_GROUP: usize = 32;

/// Qwen2-MoE's `shared_expert_intermediate_size` over `moe_intermediate_size` in the tiny
/// checkpoints (Qwen1.5-MoE-A2.7B ships 4, Qwen2-57B-A14B 8; 2 keeps them small but distinct).
pub(crate) const QWEN2_SHARED_MULT: usize = 2;

/// AutoAWQ's nibble order: bits `4i..4i+4` of a word hold output `8w + AWQ_ORDER[i]`.
pub(crate) const AWQ_ORDER: [usize; 8] = [0, 2, 4, 6, 1, 3, 5, 7];

/// Every `model_type` [`TinySpec::for_model_type`] knows, one per supported family (Kimi K2 is
/// DeepSeek-V3's family under its own model type).
pub(crate) const MODEL_TYPES: [&str; 7] = [
    "deepseek_v3",
    "kimi_k2",
    "glm4_moe",
    "qwen3_moe",
    "qwen2_moe",
    "mixtral",
    "olmoe",
];

/// How the checkpoint stores its expert (and dense MLP) weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum WeightFormat {
    /// Everything BF16.
    Bf16,
    /// Weights F16 (the router stays BF16).
    F16,
    /// Weights F32 (the router stays BF16).
    F32,
    /// DeepSeek-V3 FP8: `F8_E4M3` weights with 128×128 `weight_scale_inv` F32 blocks.
    Fp8Block,
    /// Kimi K2-Thinking: routed experts compressed-tensors `pack-quantized` INT4 (group 32,
    /// BF16 scales), the rest BF16.
    PackQuantized,
    /// AutoGPTQ / GPTQModel: routed experts asymmetric INT4 with F16 scales in groups of
    /// `group` (32, 64 or 128) input features, `checkpoint_format` `"gptq_v2"` when `v2`
    /// (zero points stored as they are) else `"gptq"` (stored minus one); the rest BF16.
    Gptq {
        /// `checkpoint_format` `"gptq_v2"`.
        v2: bool,
        /// `group_size`.
        group: usize,
    },
    /// AutoAWQ GEMM: routed experts asymmetric INT4 with F16 scales in groups of `group`
    /// (32, 64 or 128) input features; the rest BF16.
    Awq {
        /// `group_size`.
        group: usize,
    },
}

impl WeightFormat {
    /// Every format (GPTQ and AWQ with group 32, which fits the default sizes).
    pub(crate) const ALL: [WeightFormat; 8] = [
        WeightFormat::Bf16,
        WeightFormat::F16,
        WeightFormat::F32,
        WeightFormat::Fp8Block,
        WeightFormat::PackQuantized,
        WeightFormat::Gptq {
            v2: false,
            group: 32,
        },
        WeightFormat::Gptq {
            v2: true,
            group: 32,
        },
        WeightFormat::Awq { group: 32 },
    ];

    /// The `torch_dtype` of the config.
    fn torch_dtype(self) -> &'static str {
        match self {
            WeightFormat::F16 => "float16",
            WeightFormat::F32 => "float32",
            _ => "bfloat16",
        }
    }

    /// True when the routed experts are stored INT4 (pack-quantized, GPTQ or AWQ): the
    /// converter imports them losslessly.
    pub(crate) fn is_int4(self) -> bool {
        matches!(
            self,
            WeightFormat::PackQuantized | WeightFormat::Gptq { .. } | WeightFormat::Awq { .. }
        )
    }

    /// The INT4 group size along the input dimension (pack-quantized 32, GPTQ/AWQ theirs);
    /// `None` for float and FP8 formats.
    pub(crate) fn int4_group(self) -> Option<usize> {
        match self {
            WeightFormat::PackQuantized => Some(PACK_GROUP),
            WeightFormat::Gptq { group, .. } | WeightFormat::Awq { group } => Some(group),
            _ => None,
        }
    }

    /// The format of non-routed weights (dense MLPs, shared experts, embeddings): the same,
    /// except that only routed experts are ever INT4 (those are BF16).
    fn non_routed(self) -> WeightFormat {
        if self.is_int4() {
            WeightFormat::Bf16
        } else {
            self
        }
    }
}

/// The shape of a tiny checkpoint. Fields are public: adjust after [`TinySpec::new`].
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct TinySpec {
    /// The model family.
    pub(crate) family: Family,
    /// `config.json` `model_type` (`kimi_k2` and `deepseek_v3` are one family).
    pub(crate) model_type: &'static str,
    /// `hidden_size` (a multiple of the INT4 group for pack-quantized, GPTQ and AWQ).
    pub(crate) hidden: usize,
    /// Routed expert width (`moe_intermediate_size`; Mixtral/OLMoE `intermediate_size`; a
    /// multiple of the INT4 group for pack-quantized, GPTQ and AWQ).
    pub(crate) moe_inter: usize,
    /// Dense layers' MLP width (`intermediate_size`; unused by Mixtral/OLMoE).
    pub(crate) dense_inter: usize,
    /// Routed experts per MoE layer.
    pub(crate) routed_experts: usize,
    /// `num_experts_per_tok`.
    pub(crate) top_k: usize,
    /// `num_hidden_layers`.
    pub(crate) num_layers: usize,
    /// Dense layers before the first MoE layer (DeepSeek `first_k_dense_replace`, Qwen
    /// `mlp_only_layers = [0, .., first_dense)`; 0 for Mixtral/OLMoE).
    pub(crate) first_dense: usize,
    /// One shared expert per MoE layer: DeepSeek-V3/Kimi/GLM `n_shared_experts = 1`
    /// (`mlp.shared_experts`, width `moe_inter`); Qwen2-MoE the gated `mlp.shared_expert` of
    /// width [`QWEN2_SHARED_MULT`] × `moe_inter` with its `mlp.shared_expert_gate` (see
    /// [`TinySpec::qwen2_with_shared`]). Other families have none.
    pub(crate) shared: bool,
    /// `n_group` (sigmoid families).
    pub(crate) n_group: usize,
    /// `topk_group` (sigmoid families).
    pub(crate) topk_group: usize,
    /// `norm_topk_prob` (not written for Mixtral, which always renormalizes).
    pub(crate) norm_topk_prob: bool,
    /// `routed_scaling_factor` (sigmoid families).
    pub(crate) routed_scaling_factor: f64,
    /// Random `e_score_correction_bias` in [-0.1, 0.1) instead of zeros (sigmoid families).
    pub(crate) nonzero_bias: bool,
    /// How weights are stored.
    pub(crate) dtype: WeightFormat,
    /// 1: `model.safetensors`; n > 1: `model-0000i-of-0000n.safetensors` plus the index.
    pub(crate) files: usize,
    /// Routed experts stored fused, as transformers v5 saves them: per MoE layer
    /// `mlp.experts.gate_up_proj` `[E, 2F, H]` and `mlp.experts.down_proj` `[E, H, F]` (BF16,
    /// F16 or F32), the same values as the per-expert tensors of the same seed.
    pub(crate) fused_experts: bool,
    /// Seed of the weights.
    pub(crate) seed: u64,
    /// How FP8 weights keep their scales ([`WeightFormat::Fp8Block`] only).
    pub(crate) fp8: Fp8Layout,
    /// FP8 only: every FP8 weight written instead as F32 of the values it stores, without
    /// scales or quantization config: the same checkpoint as a float reader of it sees it (the
    /// same random draws, so the same values).
    pub(crate) fp8_as_f32: bool,
}

impl TinySpec {
    /// The default tiny model of `family` (`deepseek_v3` for [`Family::DeepseekV3`]): hidden 64,
    /// experts of width 32, 8 experts top-2, 3 layers, BF16, one file.
    pub(crate) fn new(family: Family) -> TinySpec {
        let model_type = match family {
            Family::DeepseekV3 => "deepseek_v3",
            Family::Glm4Moe => "glm4_moe",
            Family::Qwen3Moe => "qwen3_moe",
            Family::Qwen2Moe => "qwen2_moe",
            Family::Mixtral => "mixtral",
            Family::Olmoe => "olmoe",
        };
        TinySpec::for_model_type(model_type)
    }

    /// The default tiny model of a `model_type` of [`MODEL_TYPES`], shaped like its real
    /// models: DeepSeek-V3 4 groups keep 2, scaling 2.5; Kimi K2 one group, scaling 2.827;
    /// GLM-4.5 one group, scaling 2.5 (these three: a dense first layer, a shared expert and a
    /// non-zero bias); Qwen3 a dense first layer (`mlp_only_layers = [0]`), renormalized; Qwen2
    /// and OLMoE not renormalized; Mixtral and OLMoE all layers MoE.
    pub(crate) fn for_model_type(model_type: &str) -> TinySpec {
        let family = Family::from_model_type(model_type)
            .unwrap_or_else(|| panic!("unknown model_type {model_type}"));
        let model_type = MODEL_TYPES
            .into_iter()
            .find(|t| *t == model_type)
            .expect("a listed model type");
        let sigmoid = matches!(family, Family::DeepseekV3 | Family::Glm4Moe);
        let (n_group, topk_group, rsf) = match model_type {
            "deepseek_v3" => (4, 2, 2.5),
            "kimi_k2" => (1, 1, 2.827),
            "glm4_moe" => (1, 1, 2.5),
            _ => (1, 1, 1.0),
        };
        TinySpec {
            family,
            model_type,
            hidden: 64,
            moe_inter: 32,
            dense_inter: 64,
            routed_experts: 8,
            top_k: 2,
            num_layers: 3,
            first_dense: usize::from(sigmoid || family == Family::Qwen3Moe),
            shared: sigmoid,
            n_group,
            topk_group,
            norm_topk_prob: !matches!(family, Family::Qwen2Moe | Family::Olmoe),
            routed_scaling_factor: rsf,
            nonzero_bias: sigmoid,
            dtype: WeightFormat::Bf16,
            files: 1,
            fused_experts: false,
            seed: 0x7111_0000 ^ family as u64,
            fp8: Fp8Layout::ScaleInv([FP8_BLOCK; 2]),
            fp8_as_f32: false,
        }
    }

    /// Qwen2-MoE with its gated shared expert (as Qwen1.5-MoE-A2.7B and Qwen2-57B-A14B ship):
    /// `shared_expert_intermediate_size` = [`QWEN2_SHARED_MULT`] × `moe_inter`, tensors
    /// `mlp.shared_expert.{gate,up,down}_proj.weight` and `mlp.shared_expert_gate.weight`
    /// `[1, hidden]`, all BF16 (F16/F32 with those formats); not renormalized. The same as
    /// `TinySpec::for_model_type("qwen2_moe")` with `shared = true`.
    pub(crate) fn qwen2_with_shared() -> TinySpec {
        let mut s = TinySpec::for_model_type("qwen2_moe");
        s.shared = true;
        s
    }

    /// The same spec stored as FP8 with scales laid out as `layout`.
    pub(crate) fn with_fp8(mut self, layout: Fp8Layout) -> TinySpec {
        self.dtype = WeightFormat::Fp8Block;
        self.fp8 = layout;
        self
    }

    /// The same spec stored as `dtype`. INT4 formats round `hidden` and `moe_inter` up to
    /// multiples of their group (GPTQ/AWQ group 128: hidden 128, experts of width 128).
    pub(crate) fn with_dtype(mut self, dtype: WeightFormat) -> TinySpec {
        self.dtype = dtype;
        if let Some(g) = dtype.int4_group() {
            self.hidden = self.hidden.next_multiple_of(g);
            self.moe_inter = self.moe_inter.next_multiple_of(g);
        }
        self
    }

    /// The same spec written to `files` safetensors files.
    pub(crate) fn with_files(mut self, files: usize) -> TinySpec {
        self.files = files;
        self
    }

    /// True for DeepSeek-V3, Kimi K2 and GLM-4.5 (sigmoid router with correction bias).
    pub(crate) fn is_sigmoid(&self) -> bool {
        matches!(self.family, Family::DeepseekV3 | Family::Glm4Moe)
    }

    /// Whether layer `l` is an MoE layer (every layer from `first_dense` on).
    pub(crate) fn is_moe(&self, l: usize) -> bool {
        l >= self.first_dense && l < self.num_layers
    }

    /// The MoE layer indices.
    pub(crate) fn moe_layers(&self) -> Vec<usize> {
        (self.first_dense..self.num_layers).collect()
    }

    /// Shared expert width (`moe_inter × n_shared_experts`; Qwen2-MoE
    /// `shared_expert_intermediate_size` = [`QWEN2_SHARED_MULT`] × `moe_inter`), 0 without one.
    pub(crate) fn shared_inter(&self) -> usize {
        match (self.shared, self.family) {
            (false, _) => 0,
            (true, Family::Qwen2Moe) => QWEN2_SHARED_MULT * self.moe_inter,
            (true, _) => self.moe_inter,
        }
    }

    /// True for Qwen2-MoE with a shared expert: its output is scaled per token by
    /// `sigmoid(shared_expert_gate · x)`.
    pub(crate) fn gated_shared(&self) -> bool {
        self.shared && self.family == Family::Qwen2Moe
    }

    /// Panics when the spec cannot be written as its family's checkpoint.
    fn check(&self) {
        assert!(self.first_dense < self.num_layers, "no MoE layer");
        assert!(
            self.top_k >= 1 && self.top_k <= self.routed_experts,
            "top_k"
        );
        assert!(self.files >= 1, "files");
        if self.fused_experts {
            assert!(
                matches!(
                    self.dtype,
                    WeightFormat::Bf16 | WeightFormat::F16 | WeightFormat::F32
                ),
                "fused experts are written in BF16, F16 or F32"
            );
        }
        if matches!(self.family, Family::Mixtral | Family::Olmoe) {
            assert_eq!(self.first_dense, 0, "{:?}: every layer is MoE", self.family);
        }
        if self.shared {
            assert!(
                self.family.has_shared_expert() || self.family == Family::Qwen2Moe,
                "{:?}: no shared expert",
                self.family
            );
        }
        if self.is_sigmoid() {
            assert!(
                self.n_group >= 1 && self.routed_experts % self.n_group == 0,
                "n_group"
            );
            assert!(
                self.topk_group >= 1 && self.topk_group <= self.n_group,
                "topk_group"
            );
        }
        if let Some(g) = self.dtype.int4_group() {
            assert!(matches!(g, 32 | 64 | 128), "INT4 group {g}");
            let ok = self.hidden % g == 0 && self.moe_inter % g == 0;
            assert!(
                ok,
                "{:?} needs hidden and moe_inter multiples of {g}",
                self.dtype
            );
        }
    }
}

/// The `config.json` of `spec`: the keys `hf_config.rs` reads for its family (with the values
/// that make the model `spec`), a few keys every real config has, and the
/// `quantization_config` of FP8 and pack-quantized checkpoints.
pub(crate) fn config_json(spec: &TinySpec) -> Value {
    let mut c = json!({
        "model_type": spec.model_type,
        "architectures": [architecture(spec.family)],
        "hidden_size": spec.hidden,
        "num_hidden_layers": spec.num_layers,
        "num_experts_per_tok": spec.top_k,
        "hidden_act": "silu",
        "vocab_size": VOCAB,
        "tie_word_embeddings": false,
        "torch_dtype": spec.dtype.torch_dtype(),
    });
    let m = c.as_object_mut().expect("an object");
    let family_keys = match spec.family {
        Family::DeepseekV3 | Family::Glm4Moe => deepseek_keys(spec),
        Family::Qwen3Moe | Family::Qwen2Moe => qwen_keys(spec),
        Family::Mixtral => json!({
            "num_local_experts": spec.routed_experts,
            "intermediate_size": spec.moe_inter,
        }),
        Family::Olmoe => json!({
            "num_experts": spec.routed_experts,
            "intermediate_size": spec.moe_inter,
            "norm_topk_prob": spec.norm_topk_prob,
        }),
    };
    m.extend(family_keys.as_object().expect("an object").clone());
    match spec.dtype {
        WeightFormat::Fp8Block if spec.fp8_as_f32 => {}
        WeightFormat::Fp8Block => {
            m.insert("quantization_config".into(), fp8_config(spec));
        }
        WeightFormat::PackQuantized => {
            m.insert("quantization_config".into(), pack_quantized_config(spec));
        }
        WeightFormat::Gptq { v2, group } => {
            let format = if v2 { "gptq_v2" } else { "gptq" };
            m.insert(
                "quantization_config".into(),
                json!({
                    "quant_method": "gptq",
                    "bits": 4,
                    "group_size": group,
                    "sym": false,
                    "desc_act": false,
                    "checkpoint_format": format,
                }),
            );
        }
        WeightFormat::Awq { group } => {
            m.insert(
                "quantization_config".into(),
                json!({
                    "quant_method": "awq",
                    "bits": 4,
                    "group_size": group,
                    "zero_point": true,
                    "version": "gemm",
                }),
            );
        }
        _ => {}
    }
    c
}

fn architecture(family: Family) -> &'static str {
    match family {
        Family::DeepseekV3 => "DeepseekV3ForCausalLM",
        Family::Glm4Moe => "Glm4MoeForCausalLM",
        Family::Qwen3Moe => "Qwen3MoeForCausalLM",
        Family::Qwen2Moe => "Qwen2MoeForCausalLM",
        Family::Mixtral => "MixtralForCausalLM",
        Family::Olmoe => "OlmoeForCausalLM",
    }
}

/// DeepSeek-V3 / Kimi K2 / GLM-4.5 keys (GLM's real configs omit `scoring_func` and
/// `topk_method`, so they are omitted here too).
fn deepseek_keys(spec: &TinySpec) -> Value {
    let mut v = json!({
        "first_k_dense_replace": spec.first_dense,
        "intermediate_size": spec.dense_inter,
        "moe_intermediate_size": spec.moe_inter,
        "n_routed_experts": spec.routed_experts,
        "n_shared_experts": usize::from(spec.shared),
        "n_group": spec.n_group,
        "topk_group": spec.topk_group,
        "norm_topk_prob": spec.norm_topk_prob,
        "routed_scaling_factor": spec.routed_scaling_factor,
        "moe_layer_freq": 1,
        "num_nextn_predict_layers": 0,
    });
    if spec.family == Family::DeepseekV3 {
        let m = v.as_object_mut().expect("an object");
        m.insert("scoring_func".into(), "sigmoid".into());
        m.insert("topk_method".into(), "noaux_tc".into());
    }
    v
}

/// Qwen3-MoE / Qwen2-MoE keys (Qwen2's `shared_expert_intermediate_size` is 0 without a shared
/// expert).
fn qwen_keys(spec: &TinySpec) -> Value {
    let mut v = json!({
        "num_experts": spec.routed_experts,
        "moe_intermediate_size": spec.moe_inter,
        "intermediate_size": spec.dense_inter,
        "decoder_sparse_step": 1,
        "mlp_only_layers": (0..spec.first_dense).collect::<Vec<_>>(),
        "norm_topk_prob": spec.norm_topk_prob,
    });
    if spec.family == Family::Qwen2Moe {
        let m = v.as_object_mut().expect("an object");
        m.insert(
            "shared_expert_intermediate_size".into(),
            spec.shared_inter().into(),
        );
    }
    v
}

/// The `quantization_config` of an FP8 checkpoint in `spec.fp8`'s layout: transformers'
/// fine-grained FP8 (DeepSeek-V3's), or compressed-tensors `float-quantized` as llm-compressor
/// writes it (FP8 weights, dynamic per-token FP8 activations, the router and `lm_head`
/// ignored).
fn fp8_config(spec: &TinySpec) -> Value {
    let strategy = match spec.fp8 {
        Fp8Layout::ScaleInv(block) => {
            return json!({
                "quant_method": "fp8",
                "fmt": "e4m3",
                "activation_scheme": "dynamic",
                "weight_block_size": block,
            });
        }
        Fp8Layout::CompressedBlock(_) => "block",
        Fp8Layout::CompressedChannel => "channel",
        Fp8Layout::CompressedGroup(_) => "group",
        Fp8Layout::CompressedTensor => "tensor",
    };
    let mut weights = json!({
        "num_bits": 8,
        "type": "float",
        "symmetric": true,
        "strategy": strategy,
        "dynamic": false,
        "group_size": null,
        "block_structure": null,
        "actorder": null,
        "observer": "minmax",
    });
    match spec.fp8 {
        Fp8Layout::CompressedBlock(block) => weights["block_structure"] = json!(block),
        Fp8Layout::CompressedGroup(group) => weights["group_size"] = json!(group),
        _ => {}
    }
    let mut ignore = vec!["lm_head".to_string()];
    for l in spec.moe_layers() {
        ignore.push(router_name(spec, l).trim_end_matches(".weight").to_string());
    }
    json!({
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": {
                    "num_bits": 8,
                    "type": "float",
                    "symmetric": true,
                    "strategy": "token",
                    "dynamic": true,
                },
                "output_activations": null,
                "format": "float-quantized",
            }
        },
        "ignore": ignore,
        "kv_cache_scheme": null,
    })
}

/// compressed-tensors `pack-quantized` W4A16 group 32, every `Linear` but the ignored ones:
/// dense MLPs, routers, shared experts and `lm_head` (as Kimi K2-Thinking).
fn pack_quantized_config(spec: &TinySpec) -> Value {
    let mut ignore = vec!["lm_head".to_string()];
    for l in 0..spec.num_layers {
        let p = format!("model.layers.{l}");
        if !spec.is_moe(l) {
            ignore.extend(["gate", "up", "down"].map(|w| format!("{p}.mlp.{w}_proj")));
            continue;
        }
        ignore.push(router_name(spec, l).trim_end_matches(".weight").to_string());
        if spec.shared {
            let names = shared_expert_names(spec.family, l);
            ignore.extend(names.map(|n| n.trim_end_matches(".weight").to_string()));
        }
        if spec.gated_shared() {
            ignore.push(format!("{p}.mlp.shared_expert_gate"));
        }
    }
    json!({
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 4,
                    "type": "int",
                    "symmetric": true,
                    "strategy": "group",
                    "group_size": PACK_GROUP,
                    "dynamic": false,
                },
                "input_activations": null,
                "output_activations": null,
            }
        },
        "ignore": ignore,
    })
}

/// The router weight name of MoE layer `l` (Mixtral's `block_sparse_moe` is `mlp` where the
/// experts are fused: transformers v5 renames the whole block).
pub(crate) fn router_name(spec: &TinySpec, l: usize) -> String {
    match spec.family {
        Family::Mixtral if !spec.fused_experts => {
            format!("model.layers.{l}.block_sparse_moe.gate.weight")
        }
        _ => format!("model.layers.{l}.mlp.gate.weight"),
    }
}

/// The correction bias name of MoE layer `l` (sigmoid families).
pub(crate) fn bias_name(l: usize) -> String {
    format!("model.layers.{l}.mlp.gate.e_score_correction_bias")
}

/// The shared expert names `[gate, up, down]` of MoE layer `l`, written here from the
/// published layouts: Qwen2-MoE `mlp.shared_expert.{gate,up,down}_proj.weight`, DeepSeek-V3 /
/// Kimi / GLM `mlp.shared_experts.{gate,up,down}_proj.weight`.
pub(crate) fn shared_expert_names(family: Family, l: usize) -> [String; 3] {
    let module = match family {
        Family::Qwen2Moe => "shared_expert",
        _ => "shared_experts",
    };
    ["gate", "up", "down"].map(|w| format!("model.layers.{l}.mlp.{module}.{w}_proj.weight"))
}

/// Qwen2-MoE's shared expert gate `Linear(hidden, 1, bias=False)` of MoE layer `l` (`[1, H]`).
pub(crate) fn shared_gate_name(l: usize) -> String {
    format!("model.layers.{l}.mlp.shared_expert_gate.weight")
}

/// The dense MLP names `[gate, up, down]` of dense layer `l`.
pub(crate) fn dense_mlp_names(l: usize) -> [String; 3] {
    ["gate", "up", "down"].map(|w| format!("model.layers.{l}.mlp.{w}_proj.weight"))
}

/// One tensor written: where and how.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct TensorEntry {
    /// Tensor name.
    pub(crate) name: String,
    /// Stored dtype.
    pub(crate) dtype: Dtype,
    /// Stored shape.
    pub(crate) shape: Vec<usize>,
    /// File name inside the folder.
    pub(crate) file: String,
}

/// One MoE layer's values as stored, in f64.
#[derive(Clone, Debug)]
pub(crate) struct TinyMoe {
    /// Router weight `[E × hidden]` (BF16 values).
    pub(crate) gate: Vec<f64>,
    /// `e_score_correction_bias` `[E]` (F32 values; sigmoid families only).
    pub(crate) bias: Option<Vec<f64>>,
    /// Routed experts, dequantized as stored (FP8 scaled, pack-quantized `(code − 8) × scale`,
    /// GPTQ/AWQ `scale × (code − zero)`), exact.
    pub(crate) experts: Vec<DenseExpert>,
    /// The shared expert (width [`TinySpec::shared_inter`]).
    pub(crate) shared: Option<DenseExpert>,
    /// Qwen2-MoE's `shared_expert_gate.weight` `[hidden]` (BF16 values): the shared expert's
    /// output is scaled by `sigmoid(shared_gate · x)`. `None` elsewhere (weight 1).
    pub(crate) shared_gate: Option<Vec<f64>>,
}

/// One layer's MLP as stored.
#[derive(Clone, Debug)]
pub(crate) enum TinyLayer {
    /// A dense layer's MLP (width `dense_inter`).
    Dense(DenseExpert),
    /// An MoE layer.
    Moe(TinyMoe),
}

/// A written tiny checkpoint: where it is, what it holds, and every value as stored (f64).
#[derive(Clone, Debug)]
pub(crate) struct TinyCheckpoint {
    /// The checkpoint folder.
    pub(crate) dir: PathBuf,
    /// What was written.
    pub(crate) spec: TinySpec,
    /// `config.json` as written.
    pub(crate) config: Value,
    /// `model.embed_tokens.weight` `[16 × hidden]`.
    pub(crate) embed: Vec<f64>,
    /// Per layer index.
    pub(crate) layers: Vec<TinyLayer>,
    /// Every tensor written, in writing order.
    pub(crate) tensors: Vec<TensorEntry>,
    /// The safetensors file names, in order.
    pub(crate) files: Vec<String>,
}

impl TinyCheckpoint {
    /// MoE layer `l` (panics for a dense layer).
    pub(crate) fn moe(&self, l: usize) -> &TinyMoe {
        match &self.layers[l] {
            TinyLayer::Moe(m) => m,
            TinyLayer::Dense(_) => panic!("layer {l} is dense"),
        }
    }

    /// Dense layer `l`'s MLP (panics for an MoE layer).
    pub(crate) fn dense(&self, l: usize) -> &DenseExpert {
        match &self.layers[l] {
            TinyLayer::Dense(d) => d,
            TinyLayer::Moe(_) => panic!("layer {l} is MoE"),
        }
    }

    /// One expert of MoE layer `l` as stored (panics when it does not exist).
    pub(crate) fn expert(&self, l: usize, which: ExpertRef) -> &DenseExpert {
        let m = self.moe(l);
        match which {
            ExpertRef::Routed(e) => &m.experts[e as usize],
            ExpertRef::Shared => m.shared.as_ref().expect("a shared expert"),
        }
    }

    /// The entry of tensor `name`, if written.
    pub(crate) fn entry(&self, name: &str) -> Option<&TensorEntry> {
        self.tensors.iter().find(|t| t.name == name)
    }
}

/// `n` tokens of `hidden` standard-normal activations, each exactly representable in BF16 (so a
/// frontend can send them as f32 or bf16 without changing them), row-major.
pub(crate) fn random_tokens(n: usize, hidden: usize, seed: u64) -> Vec<f64> {
    let mut rng = SplitMix64::new(seed);
    (0..n * hidden)
        .map(|_| bf16::from_f64(rng.normal()).to_f64())
        .collect()
}

/// A tensor to write: `(name, dtype, shape, bytes)`.
type Owned = (String, Dtype, Vec<usize>, Vec<u8>);

/// Collects tensors and draws their random values in writing order.
struct Writer {
    rng: SplitMix64,
    tensors: Vec<Owned>,
    fp8: Fp8Layout,
    fp8_as_f32: bool,
}

impl Writer {
    fn push(&mut self, name: &str, dtype: Dtype, shape: &[usize], bytes: Vec<u8>) {
        assert!(
            !self.tensors.iter().any(|t| t.0 == name),
            "tensor {name} written twice"
        );
        self.tensors
            .push((name.into(), dtype, shape.to_vec(), bytes));
    }

    /// `n` values of standard deviation `std`.
    fn gaussian(&mut self, n: usize, std: f64) -> Vec<f64> {
        (0..n).map(|_| self.rng.normal() * std).collect()
    }

    /// A random `[rows, cols]` weight (std `1/sqrt(cols)`) stored as `format`; its stored values.
    fn linear(&mut self, name: &str, rows: usize, cols: usize, format: WeightFormat) -> Vec<f64> {
        let x = self.gaussian(rows * cols, 1.0 / (cols as f64).sqrt());
        let shape = [rows, cols];
        match format {
            WeightFormat::Bf16 => self.float(name, Dtype::BF16, &shape, &x),
            WeightFormat::F16 => self.float(name, Dtype::F16, &shape, &x),
            WeightFormat::F32 => self.float(name, Dtype::F32, &shape, &x),
            WeightFormat::Fp8Block => self.fp8(name, rows, cols, &x),
            WeightFormat::PackQuantized => self.packed(name, rows, cols, &x),
            WeightFormat::Gptq { v2, group } => {
                let q = self.int4_asym(&x, [rows, cols], group, u8::from(!v2));
                self.push_gptq(name, &q, v2);
                q.stored
            }
            WeightFormat::Awq { group } => {
                let q = self.int4_asym(&x, [rows, cols], group, 0);
                self.push_awq(name, &q);
                q.stored
            }
        }
    }

    /// `x` rounded to `dtype` (BF16, F16 or F32); the stored values.
    fn float(&mut self, name: &str, dtype: Dtype, shape: &[usize], x: &[f64]) -> Vec<f64> {
        let (bytes, stored): (Vec<Vec<u8>>, Vec<f64>) = match dtype {
            Dtype::BF16 => x
                .iter()
                .map(|&v| bf16::from_f64(v))
                .map(|b| (b.to_le_bytes().to_vec(), b.to_f64()))
                .unzip(),
            Dtype::F16 => x
                .iter()
                .map(|&v| f16::from_f64(v))
                .map(|b| (b.to_le_bytes().to_vec(), b.to_f64()))
                .unzip(),
            Dtype::F32 => x
                .iter()
                .map(|&v| v as f32)
                .map(|b| (b.to_le_bytes().to_vec(), f64::from(b)))
                .unzip(),
            d => panic!("not a float dtype: {d}"),
        };
        self.push(name, dtype, shape, bytes.concat());
        stored
    }

    /// FP8 in `self.fp8`'s layout: per block of weights `scale = absmax / 448` (f32), code =
    /// `e4m3(x / scale)`; writes `name` and its scales (`{name}_scale_inv` or
    /// `{name}_scale`); the stored values `e4m3(code) × scale` in f32 (what a reader
    /// computes).
    fn fp8(&mut self, name: &str, rows: usize, cols: usize, x: &[f64]) -> Vec<f64> {
        let (suffix, [b0, b1]) = match self.fp8 {
            Fp8Layout::ScaleInv(b) => ("_scale_inv", b),
            Fp8Layout::CompressedBlock(b) => ("_scale", b),
            Fp8Layout::CompressedChannel => ("_scale", [1, cols]),
            Fp8Layout::CompressedGroup(group) => ("_scale", [1, group]),
            Fp8Layout::CompressedTensor => ("_scale", [rows, cols]),
        };
        let grid = [rows.div_ceil(b0), cols.div_ceil(b1)];
        let block = |i: usize| (i / cols / b0) * grid[1] + (i % cols) / b1;
        let mut amax = vec![0f32; grid[0] * grid[1]];
        for (i, &v) in x.iter().enumerate() {
            amax[block(i)] = amax[block(i)].max((v as f32).abs());
        }
        let scales: Vec<f32> = amax
            .iter()
            .map(|&a| if a > 0.0 { a / 448.0 } else { 1.0 })
            .collect();
        let codes: Vec<u8> = (0..x.len())
            .map(|i| f32_to_e4m3(x[i] as f32 / scales[block(i)]))
            .collect();
        let stored: Vec<f64> = (0..x.len())
            .map(|i| f64::from(e4m3_to_f32(codes[i]) * scales[block(i)]))
            .collect();
        if self.fp8_as_f32 {
            let bytes = stored
                .iter()
                .flat_map(|&v| (v as f32).to_le_bytes())
                .collect();
            self.push(name, Dtype::F32, &[rows, cols], bytes);
            return stored;
        }
        self.push(name, Dtype::F8E4M3, &[rows, cols], codes);
        let scale_shape = match self.fp8 {
            Fp8Layout::CompressedTensor => vec![1],
            _ => grid.to_vec(),
        };
        let scale_bytes = scales.iter().flat_map(|s| s.to_le_bytes()).collect();
        self.push(
            &format!("{name}{suffix}"),
            Dtype::F32,
            &scale_shape,
            scale_bytes,
        );
        stored
    }

    /// compressed-tensors `pack-quantized` INT4 (see the module docs); the stored values
    /// `(code − 8) × scale`, exact.
    fn packed(&mut self, name: &str, rows: usize, cols: usize, x: &[f64]) -> Vec<f64> {
        assert!(cols % PACK_GROUP == 0, "{name}: {cols} columns");
        let base = name.strip_suffix(".weight").expect("a .weight name");
        let mut codes = Vec::with_capacity(rows * cols);
        let mut scales = Vec::with_capacity(rows * cols / PACK_GROUP);
        let mut stored = Vec::with_capacity(rows * cols);
        for group in x.chunks_exact(PACK_GROUP) {
            let amax = group.iter().fold(0f64, |m, v| m.max(v.abs()));
            let scale = bf16::from_f64(if amax > 0.0 { amax / 7.0 } else { 1.0 });
            scales.push(scale);
            for &v in group {
                let q = (v / scale.to_f64()).round().clamp(-8.0, 7.0);
                codes.push((q as i32 + 8) as u32);
                stored.push(q * scale.to_f64());
            }
        }
        let words: Vec<u8> = codes
            .chunks_exact(8)
            .map(|c| {
                c.iter()
                    .enumerate()
                    .fold(0u32, |w, (i, &q)| w | q << (4 * i))
            })
            .flat_map(|w| (w as i32).to_le_bytes())
            .collect();
        self.push(
            &format!("{base}.weight_packed"),
            Dtype::I32,
            &[rows, cols / 8],
            words,
        );
        let scale_bytes = scales.iter().flat_map(|s| s.to_le_bytes()).collect();
        let scale_shape = [rows, cols / PACK_GROUP];
        self.push(
            &format!("{base}.weight_scale"),
            Dtype::BF16,
            &scale_shape,
            scale_bytes,
        );
        let shape_bytes = [rows as i32, cols as i32]
            .iter()
            .flat_map(|d| d.to_le_bytes())
            .collect();
        self.push(
            &format!("{base}.weight_shape"),
            Dtype::I32,
            &[2],
            shape_bytes,
        );
        stored
    }

    /// Asymmetric INT4 of `x` (`[rows, cols]`) in groups of `group` input features, as GPTQ and
    /// AWQ store it: per output row and group a random zero point in `min_zero..=15` (GPTQ v1
    /// stores `zero − 1`, so its zero points start at 1), an F16 scale making `scale × (q −
    /// zero)` span the group's values, codes `q = clamp(round(x / scale) + zero, 0, 15)`.
    fn int4_asym(
        &mut self,
        x: &[f64],
        [rows, cols]: [usize; 2],
        group: usize,
        min_zero: u8,
    ) -> Int4 {
        assert!(
            cols % group == 0 && rows % 8 == 0 && cols % 8 == 0,
            "{rows}×{cols}"
        );
        let groups = cols / group;
        let mut q = Int4 {
            rows,
            cols,
            group,
            codes: vec![0; rows * cols],
            zeros: vec![0; groups * rows],
            scales: vec![f16::ZERO; groups * rows],
            stored: vec![0.0; rows * cols],
        };
        for o in 0..rows {
            for g in 0..groups {
                let z = min_zero + self.rng.below(u64::from(16 - min_zero)) as u8;
                let at = o * cols + g * group;
                let (lo, hi) = x[at..][..group]
                    .iter()
                    .fold((0f64, 0f64), |(l, h), &v| (l.min(v), h.max(v)));
                let below = if z > 0 { -lo / f64::from(z) } else { 0.0 };
                let above = if z < 15 { hi / f64::from(15 - z) } else { 0.0 };
                let s = below.max(above);
                let scale = f16::from_f64(if s > 0.0 { s } else { 1.0 });
                q.zeros[g * rows + o] = z;
                q.scales[g * rows + o] = scale;
                for k in at..at + group {
                    let code = ((x[k] / scale.to_f64()).round() + f64::from(z)).clamp(0.0, 15.0);
                    q.codes[k] = code as u8;
                    q.stored[k] = scale.to_f64() * (code - f64::from(z));
                }
            }
        }
        q
    }

    /// `X.scales` F16 `[in/group, out]` of `q` under prefix `base`.
    fn push_scales(&mut self, base: &str, q: &Int4) {
        let bytes = q.scales.iter().flat_map(|s| s.to_le_bytes()).collect();
        let shape = [q.cols / q.group, q.rows];
        self.push(&format!("{base}.scales"), Dtype::F16, &shape, bytes);
    }

    /// AutoGPTQ layout of `q` for weight `name` (see the module docs): `qweight`, `qzeros`
    /// (v1: `zero − 1`), `scales`, trivial `g_idx`.
    fn push_gptq(&mut self, name: &str, q: &Int4, v2: bool) {
        let base = name.strip_suffix(".weight").expect("a .weight name");
        let (rows, cols) = (q.rows, q.cols);
        let mut qweight = vec![0u32; cols / 8 * rows];
        for o in 0..rows {
            for k in 0..cols {
                qweight[(k / 8) * rows + o] |= u32::from(q.codes[o * cols + k]) << (4 * (k % 8));
            }
        }
        let stored_zeros: Vec<u8> = q
            .zeros
            .iter()
            .map(|&z| if v2 { z } else { z - 1 })
            .collect();
        let qzeros = pack_outputs(&stored_zeros, rows, |j| j);
        self.push(
            &format!("{base}.qweight"),
            Dtype::I32,
            &[cols / 8, rows],
            words(&qweight),
        );
        let zshape = [cols / q.group, rows / 8];
        self.push(
            &format!("{base}.qzeros"),
            Dtype::I32,
            &zshape,
            words(&qzeros),
        );
        self.push_scales(base, q);
        let g_idx = (0..cols)
            .flat_map(|k| ((k / q.group) as i32).to_le_bytes())
            .collect();
        self.push(&format!("{base}.g_idx"), Dtype::I32, &[cols], g_idx);
    }

    /// AutoAWQ GEMM layout of `q` for weight `name` (see the module docs): `qweight`,
    /// `qzeros`, `scales`.
    fn push_awq(&mut self, name: &str, q: &Int4) {
        let base = name.strip_suffix(".weight").expect("a .weight name");
        let (rows, cols) = (q.rows, q.cols);
        let nibble = |j: usize| AWQ_ORDER.iter().position(|&o| o == j).expect("0..8");
        // Transposed codes `[in, out]`, packed along the output dimension like the zeros.
        let by_input: Vec<u8> = (0..cols * rows)
            .map(|i| q.codes[(i % rows) * cols + i / rows])
            .collect();
        let qweight = pack_outputs(&by_input, rows, nibble);
        let qzeros = pack_outputs(&q.zeros, rows, nibble);
        self.push(
            &format!("{base}.qweight"),
            Dtype::I32,
            &[cols, rows / 8],
            words(&qweight),
        );
        let zshape = [cols / q.group, rows / 8];
        self.push(
            &format!("{base}.qzeros"),
            Dtype::I32,
            &zshape,
            words(&qzeros),
        );
        self.push_scales(base, q);
    }

    /// A SwiGLU MLP of width `inter` under `names` (`[gate, up, down]`), stored as `format`.
    fn mlp(
        &mut self,
        names: &[String; 3],
        inter: usize,
        hidden: usize,
        format: WeightFormat,
    ) -> DenseExpert {
        let gate = self.linear(&names[0], inter, hidden, format);
        let up = self.linear(&names[1], inter, hidden, format);
        let down = self.linear(&names[2], hidden, inter, format);
        DenseExpert {
            inter,
            gate,
            up,
            down,
        }
    }
}

/// One matrix quantized asymmetrically to INT4 (weight `[rows = out, cols = in]`).
struct Int4 {
    rows: usize,
    cols: usize,
    group: usize,
    /// Codes 0..=15, `[rows × cols]`.
    codes: Vec<u8>,
    /// Zero points (the real ones), `[groups × rows]`.
    zeros: Vec<u8>,
    /// Scales, `[groups × rows]`.
    scales: Vec<f16>,
    /// `scale × (code − zero)`, `[rows × cols]`, exact.
    stored: Vec<f64>,
}

/// Nibbles `[n × out]` (`n` rows of `out` outputs each) packed along the output dimension:
/// output `8w + j` of a row goes to bits `4·slot(j)` of word `w` (GPTQ `qzeros`: `slot(j) = j`;
/// AWQ: the `i` with `AWQ_ORDER[i] = j`).
fn pack_outputs(nibbles: &[u8], out: usize, slot: impl Fn(usize) -> usize) -> Vec<u32> {
    let mut words = vec![0u32; nibbles.len() / 8];
    for (i, &v) in nibbles.iter().enumerate() {
        let (row, o) = (i / out, i % out);
        words[row * out / 8 + o / 8] |= u32::from(v) << (4 * slot(o % 8));
    }
    words
}

/// Little-endian I32 bytes of `w`.
fn words(w: &[u32]) -> Vec<u8> {
    w.iter().flat_map(|v| (*v as i32).to_le_bytes()).collect()
}

/// Writes the tiny checkpoint `spec` into `dir` (created if needed): `config.json` and its
/// safetensors file(s). Returns what was written, with every value as stored.
pub(crate) fn write_tiny_checkpoint(dir: &Path, spec: &TinySpec) -> TinyCheckpoint {
    spec.check();
    std::fs::create_dir_all(dir).expect("create the checkpoint folder");
    let mut w = Writer {
        rng: SplitMix64::new(spec.seed),
        tensors: Vec::new(),
        fp8: spec.fp8,
        fp8_as_f32: spec.fp8_as_f32,
    };
    let h = spec.hidden;
    // Embeddings are never quantized (FP8 and INT4 checkpoints keep them BF16).
    let embed_format = match spec.dtype {
        WeightFormat::F16 | WeightFormat::F32 => spec.dtype,
        _ => WeightFormat::Bf16,
    };
    let embed = w.linear("model.embed_tokens.weight", VOCAB, h, embed_format);
    let layers = (0..spec.num_layers)
        .map(|l| {
            if spec.is_moe(l) {
                TinyLayer::Moe(write_moe_layer(&mut w, spec, l))
            } else {
                let names = dense_mlp_names(l);
                TinyLayer::Dense(w.mlp(&names, spec.dense_inter, h, spec.dtype.non_routed()))
            }
        })
        .collect();
    let config = config_json(spec);
    let text = serde_json::to_string_pretty(&config).expect("serialize config.json");
    std::fs::write(dir.join("config.json"), text).expect("write config.json");
    let (tensors, files) = write_files(dir, &w.tensors, spec.files);
    TinyCheckpoint {
        dir: dir.to_path_buf(),
        spec: spec.clone(),
        config,
        embed,
        layers,
        tensors,
        files,
    }
}

/// One MoE layer's tensors: router (BF16), bias (F32, sigmoid families), routed experts in
/// `spec.dtype`, shared expert in the non-routed format, Qwen2-MoE's shared expert gate (BF16).
fn write_moe_layer(w: &mut Writer, spec: &TinySpec, l: usize) -> TinyMoe {
    let (h, e) = (spec.hidden, spec.routed_experts);
    let gate = w.linear(&router_name(spec, l), e, h, WeightFormat::Bf16);
    let bias = spec.is_sigmoid().then(|| {
        let b: Vec<f64> = if spec.nonzero_bias {
            (0..e).map(|_| w.rng.uniform(-0.1, 0.1)).collect()
        } else {
            vec![0.0; e]
        };
        w.float(&bias_name(l), Dtype::F32, &[e], &b)
    });
    let layer = l as u32;
    let first = w.tensors.len();
    let experts = (0..e as u32)
        .map(|x| {
            let names = expert_tensor_names(spec.family, layer, ExpertRef::Routed(x))
                .expect("routed expert names");
            w.mlp(&names, spec.moe_inter, h, spec.dtype)
        })
        .collect();
    if spec.fused_experts {
        fuse_experts(w, first, spec, l);
    }
    let shared = spec.shared.then(|| {
        let names = shared_expert_names(spec.family, l);
        w.mlp(&names, spec.shared_inter(), h, spec.dtype.non_routed())
    });
    let shared_gate = spec
        .gated_shared()
        .then(|| w.linear(&shared_gate_name(l), 1, h, WeightFormat::Bf16));
    TinyMoe {
        gate,
        bias,
        experts,
        shared,
        shared_gate,
    }
}

/// Replaces the per-expert tensors of layer `l` (`w.tensors[first..]`: gate, up, down per
/// expert) by the two fused ones of transformers v5: each expert's gate rows then its up rows
/// in `gate_up_proj`, its down in `down_proj`, experts in order.
fn fuse_experts(w: &mut Writer, first: usize, spec: &TinySpec, l: usize) {
    let per_expert: Vec<Owned> = w.tensors.drain(first..).collect();
    let dtype = per_expert[0].1;
    let (e, f, h) = (spec.routed_experts, spec.moe_inter, spec.hidden);
    let mut gate_up = Vec::new();
    let mut down = Vec::new();
    for x in per_expert.chunks(3) {
        gate_up.extend_from_slice(&x[0].3);
        gate_up.extend_from_slice(&x[1].3);
        down.extend_from_slice(&x[2].3);
    }
    let home = format!("model.layers.{l}.mlp.experts");
    w.push(
        &format!("{home}.gate_up_proj"),
        dtype,
        &[e, 2 * f, h],
        gate_up,
    );
    w.push(&format!("{home}.down_proj"), dtype, &[e, h, f], down);
}

/// Writes `tensors` as `model.safetensors`, or in `files` contiguous runs as
/// `model-0000i-of-0000n.safetensors` plus `model.safetensors.index.json` (a weight and its
/// scale tensors may land in different files, as in real sharded checkpoints).
fn write_files(dir: &Path, tensors: &[Owned], files: usize) -> (Vec<TensorEntry>, Vec<String>) {
    assert!(files <= tensors.len(), "more files than tensors");
    let metadata = BTreeMap::from([("format".to_string(), "pt".to_string())]);
    let names: Vec<String> = if files == 1 {
        vec![SINGLE_FILE.to_string()]
    } else {
        (1..=files)
            .map(|i| format!("model-{i:05}-of-{files:05}.safetensors"))
            .collect()
    };
    let mut entries = Vec::with_capacity(tensors.len());
    let mut weight_map = serde_json::Map::new();
    let mut total = 0usize;
    for (i, file) in names.iter().enumerate() {
        let run = &tensors[i * tensors.len() / files..(i + 1) * tensors.len() / files];
        let data: Vec<TensorData<'_>> = run
            .iter()
            .map(|(n, d, s, b)| (n.as_str(), *d, s.as_slice(), b.as_slice()))
            .collect();
        write_safetensors(dir.join(file), &data, &metadata).expect("write safetensors");
        for (name, dtype, shape, bytes) in run {
            total += bytes.len();
            weight_map.insert(name.clone(), file.clone().into());
            entries.push(TensorEntry {
                name: name.clone(),
                dtype: *dtype,
                shape: shape.clone(),
                file: file.clone(),
            });
        }
    }
    if files > 1 {
        let index = json!({ "metadata": { "total_size": total }, "weight_map": weight_map });
        let text = serde_json::to_string_pretty(&index).expect("serialize the index");
        std::fs::write(dir.join(INDEX_FILE), text).expect("write the index");
    }
    (entries, names)
}
