//! A Hugging Face `config.json` → the [`ModelSpec`] that serves the same math, or a refusal.
//!
//! Why this exists: `expertmesh models --from-hf DIR` (and later `expertmesh convert`) start from
//! a checkpoint folder. The model description must be *exactly* the model the checkpoint was
//! trained as: a config whose math [`ModelSpec`] cannot express is refused with the key and value
//! that make it so, never approximated.
//!
//! Families and how they map (the semantics of the `transformers` modeling code; for the
//! DeepSeek family also the published remote code, `modeling_deepseek.py`):
//!
//! * `deepseek_v3`, `kimi_k2` (or `architectures` naming `DeepseekV3ForCausalLM`) and
//!   `glm4_moe`: layers `first_k_dense_replace..num_hidden_layers` are MoE (`moe_layer_freq`
//!   must be 1); `n_routed_experts` experts of width `moe_intermediate_size`, top
//!   `num_experts_per_tok`; the shared MLP is ONE expert of width
//!   `moe_intermediate_size × n_shared_experts` (what both implementations build); sigmoid
//!   scores plus `e_score_correction_bias` for choosing ([`Scoring::SigmoidBias`],
//!   `topk_method` `noaux_tc`; `greedy` is the same with a zero bias; both keys absent, as in
//!   configs written by transformers' own `DeepseekV3Config`, mean that), group-limited by
//!   `n_group`/`topk_group`, then `norm_topk_prob` and `routed_scaling_factor`. Multi-token
//!   prediction layers (`num_nextn_predict_layers`) come after `num_hidden_layers` and are not
//!   part of the served model.
//! * `qwen3_moe` and `qwen2_moe`: layer `l` is MoE iff it is not in
//!   `mlp_only_layers`, `num_experts > 0` and `(l + 1) % decoder_sparse_step == 0`; that set must
//!   be a dense prefix plus every n-th layer (`first_dense_layers`, `moe_layer_step`). Softmax
//!   over all experts, top-k, renormalized when `norm_topk_prob` ([`Scoring::Softmax`]).
//!   `qwen2_moe`'s shared expert (width `shared_expert_intermediate_size`, default 5632; 0 =
//!   none) is one shared expert whose output is scaled per token by
//!   `sigmoid(shared_expert_gate(x))` (`shared_expert_gate = true`).
//! * `mixtral`: every layer MoE, `num_local_experts` experts of width `intermediate_size`;
//!   softmax, top-k, renormalize — the same weights as softmax over the top-k logits
//!   ([`Scoring::TopkSoftmax`]).
//! * `olmoe`: every layer MoE, `num_experts` of width `intermediate_size`, softmax over all then
//!   top-k, renormalized when `norm_topk_prob` (default false).
//!
//! Anything else (`gpt_oss`, `llama4`, dense models, unknown types) is refused by name. Keys
//! whose defaults differ between implementations must be present; keys with a single
//! implementation take that implementation's default. The experts are described as packed INT4,
//! group 32 with bf16 scales ([`QuantSpec::G32_BF16`]), whatever the checkpoint stores.

use expertmesh_quant::format::QuantSpec;
use expertmesh_topology::model::{ModelSpec, Scoring, preset_by_name};
use expertmesh_topology::model_file::{MAX_DIM, MAX_EXPERTS, MAX_LAYERS, MAX_SHARED};
use expertmesh_topology::ranges::format_list;
use serde_json::{Map, Value};
use std::io::Read;
use std::path::{Path, PathBuf};

/// The config file inside a checkpoint folder.
pub const CONFIG_FILE: &str = "config.json";

/// Largest `config.json` read (real ones are a few KiB).
pub const MAX_CONFIG_BYTES: u64 = 16 << 20;

/// Why a checkpoint folder gave no model.
#[derive(Debug, thiserror::Error)]
pub enum HfConfigError {
    /// `config.json` could not be read (missing folder or file, permissions).
    #[error("cannot read {}: {source}", path.display())]
    Io {
        /// The config file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// `config.json` is not a JSON object (not JSON, not UTF-8, or too large).
    #[error("{} is not a Hugging Face config: {reason}", path.display())]
    NotConfig {
        /// The config file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// The config was read, but its model cannot be served exactly; every line names the key
    /// and value responsible.
    #[error("{}", problems.iter().map(|p| format!("{}: {p}", path.display())).collect::<Vec<_>>().join("\n"))]
    Unservable {
        /// The config file.
        path: PathBuf,
        /// What makes it unservable.
        problems: Vec<String>,
    },
}

impl HfConfigError {
    /// True when the config could not be read as JSON at all (exit code 2 in the CLI); false when
    /// it was read and cannot be served (exit code 1).
    pub fn is_usage(&self) -> bool {
        !matches!(self, HfConfigError::Unservable { .. })
    }

    /// The problems, when the config was read and cannot be served (empty otherwise).
    pub fn problems(&self) -> &[String] {
        match self {
            HfConfigError::Unservable { problems, .. } => problems,
            _ => &[],
        }
    }
}

/// The model of the checkpoint folder `dir` (or of the config file `dir` itself): its
/// `config.json` mapped by [`model_from_hf_config`], named after the folder.
pub fn load_hf_model(dir: &Path) -> Result<ModelSpec, HfConfigError> {
    load_hf_model_and_family(dir).map(|(m, _)| m)
}

/// [`load_hf_model`] and the checkpoint's [`Family`] (which tensor names the converter reads).
pub fn load_hf_model_and_family(dir: &Path) -> Result<(ModelSpec, Family), HfConfigError> {
    let (folder, path) = if dir.is_file() {
        (dir.parent().unwrap_or(Path::new(".")), dir.to_path_buf())
    } else {
        (dir, dir.join(CONFIG_FILE))
    };
    let config = read_config(&path)?;
    let name = model_name(folder, &config);
    let unservable = |problems| HfConfigError::Unservable {
        path: path.clone(),
        problems,
    };
    let family = family(&Cfg(&config)).map_err(|e| unservable(vec![e]))?;
    let spec = model_from_hf_config(&config, &name).map_err(unservable)?;
    Ok((spec, family))
}

/// Whether the checkpoint folder `dir`'s `config.json` says `topk_method = "greedy"`: top-k
/// with a zero selection bias, whose checkpoints store no `e_score_correction_bias` (an
/// unreadable config says no; loading the model reports it).
pub fn greedy_topk(dir: &Path) -> bool {
    read_config(&dir.join(CONFIG_FILE))
        .is_ok_and(|c| c.get("topk_method").and_then(Value::as_str) == Some("greedy"))
}

/// The first [`MAX_CONFIG_BYTES`] + 1 bytes of `path`: a configuration file whole, or enough
/// to tell it is larger than one can be (every reader of `config.json` and
/// `quantize_config.json` reads through this).
pub(crate) fn read_bounded(path: &Path) -> std::io::Result<Vec<u8>> {
    let mut bytes = Vec::new();
    std::fs::File::open(path)?
        .take(MAX_CONFIG_BYTES + 1)
        .read_to_end(&mut bytes)?;
    Ok(bytes)
}

/// Read `path` as a JSON object, bounded by [`MAX_CONFIG_BYTES`].
fn read_config(path: &Path) -> Result<Map<String, Value>, HfConfigError> {
    let io = |source| HfConfigError::Io {
        path: path.to_path_buf(),
        source,
    };
    let not = |reason: String| HfConfigError::NotConfig {
        path: path.to_path_buf(),
        reason,
    };
    let bytes = read_bounded(path).map_err(io)?;
    if bytes.len() as u64 > MAX_CONFIG_BYTES {
        return Err(not(format!(
            "larger than {MAX_CONFIG_BYTES} bytes; a config.json is a few KiB"
        )));
    }
    match serde_json::from_slice::<Value>(&bytes) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(other) => Err(not(format!(
            "the top level is {}, not a JSON object",
            kind_of(&other)
        ))),
        Err(e) => Err(not(format!("not JSON ({e})"))),
    }
}

/// The model name: the checkpoint folder's name, or the last part of `_name_or_path` when the
/// folder is a Hugging Face cache snapshot (a commit hash) or has no usable name; made a valid
/// model name (letters, digits, `.`, `_`, `-`; at most 64).
pub fn model_name(folder: &Path, config: &Map<String, Value>) -> String {
    let folder = std::fs::canonicalize(folder).unwrap_or_else(|_| folder.to_path_buf());
    let from_folder = folder
        .file_name()
        .map(|n| sanitize_name(&n.to_string_lossy()))
        .unwrap_or_default();
    let is_hash = from_folder.len() == 40 && from_folder.bytes().all(|b| b.is_ascii_hexdigit());
    if !from_folder.is_empty() && !is_hash {
        return from_folder;
    }
    let from_config = config
        .get("_name_or_path")
        .and_then(Value::as_str)
        .and_then(|p| p.trim_end_matches(['/', '\\']).rsplit(['/', '\\']).next())
        .map(sanitize_name)
        .unwrap_or_default();
    if from_config.is_empty() {
        "hf-model".into()
    } else {
        from_config
    }
}

/// `raw` as a valid model name: other characters become `-`, at most 64 of them.
fn sanitize_name(raw: &str) -> String {
    let s: String = raw
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '-'
            }
        })
        .take(64)
        .collect();
    let trimmed = s.trim_matches(['-', '.']);
    trimmed.to_owned()
}

/// The MoE families this crate reads (the model mapping here, tensor names in
/// [`crate::experts`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// DeepSeek-V3 and Kimi K2 (one modeling code).
    DeepseekV3,
    /// GLM-4.5 (`glm4_moe`).
    Glm4Moe,
    /// Qwen3-MoE.
    Qwen3Moe,
    /// Qwen2-MoE / Qwen1.5-MoE.
    Qwen2Moe,
    /// Mixtral.
    Mixtral,
    /// OLMoE.
    Olmoe,
}

/// Map a parsed `config.json` to the [`ModelSpec`] computing the same math, named `name`, or
/// every reason it cannot be served exactly (each naming the key and value).
pub fn model_from_hf_config(
    config: &Map<String, Value>,
    name: &str,
) -> Result<ModelSpec, Vec<String>> {
    let cfg = Cfg(config);
    let family = family(&cfg).map_err(|e| vec![e])?;
    let mut m = base(&cfg, family).map_err(|e| vec![e])?;
    match family {
        Family::DeepseekV3 | Family::Glm4Moe => map_deepseek(&cfg, family, &mut m),
        Family::Qwen3Moe | Family::Qwen2Moe => map_qwen(&cfg, family, &mut m),
        Family::Mixtral => map_mixtral(&cfg, &mut m),
        Family::Olmoe => map_olmoe(&cfg, &mut m),
    }
    .map_err(|e| vec![e])?;
    m.name = name.to_owned();
    if let Some(preset) = preset_by_name(name)
        && !same_math(&m, &preset)
    {
        // A model file named like a preset must be that preset; this one is not.
        m.name = format!("{}-hf", &name[..name.len().min(61)]);
    }
    finish(m)
}

/// True when `a` and `b` describe the same model math (all but name, description and `toy`).
pub fn same_math(a: &ModelSpec, b: &ModelSpec) -> bool {
    let mut a = a.clone();
    a.name.clone_from(&b.name);
    a.description.clone_from(&b.description);
    a.toy = b.toy;
    a == *b
}

impl Family {
    /// The family of a `config.json` `model_type`, or `None` for one this crate does not read
    /// (a config with architectures `DeepseekV3ForCausalLM` and another model type is
    /// DeepSeek-V3 too: [`model_from_hf_config`] handles that).
    pub fn from_model_type(model_type: &str) -> Option<Family> {
        Some(match model_type {
            "deepseek_v3" | "kimi_k2" => Family::DeepseekV3,
            "glm4_moe" => Family::Glm4Moe,
            "qwen3_moe" => Family::Qwen3Moe,
            "qwen2_moe" => Family::Qwen2Moe,
            "mixtral" => Family::Mixtral,
            "olmoe" => Family::Olmoe,
            _ => return None,
        })
    }

    /// Whether the family's checkpoints can have a shared expert per MoE layer (Qwen2-MoE's
    /// is gated per token: `ModelSpec::shared_expert_gate`).
    pub fn has_shared_expert(self) -> bool {
        matches!(
            self,
            Family::DeepseekV3 | Family::Glm4Moe | Family::Qwen2Moe
        )
    }
}

/// The family named by `model_type` (or by a DeepSeek-V3 architecture).
fn family(cfg: &Cfg<'_>) -> Result<Family, String> {
    let model_type = cfg.str_opt("model_type")?;
    let family = model_type.and_then(Family::from_model_type);
    if let Some(f) = family {
        return Ok(f);
    }
    let deepseek_arch = cfg
        .0
        .get("architectures")
        .and_then(Value::as_array)
        .is_some_and(|a| a.iter().any(|v| v == "DeepseekV3ForCausalLM"));
    if deepseek_arch {
        return Ok(Family::DeepseekV3);
    }
    const SUPPORTED: &str =
        "supported: deepseek_v3, kimi_k2, glm4_moe, qwen3_moe, qwen2_moe, mixtral, olmoe";
    Err(match model_type {
        None => format!("missing `model_type`; cannot tell the model family ({SUPPORTED})"),
        Some("gpt_oss") => format!(
            "model_type = \"gpt_oss\" is not supported: its experts have biases and a clamped SwiGLU (swiglu_limit) that ModelSpec cannot express ({SUPPORTED})"
        ),
        Some("llama4" | "llama4_text") => format!(
            "model_type = \"{}\" is not supported: its router scales the expert input by sigmoid(score) and its MoE layers interleave with dense ones (interleave_moe_layer_step), which ModelSpec cannot express ({SUPPORTED})",
            model_type.unwrap_or_default()
        ),
        Some(t) => format!("model_type = \"{t}\" is not a supported MoE family ({SUPPORTED})"),
    })
}

/// The fields every family shares (layers, hidden size, activation), the rest at their
/// "nothing special" values for the family mapper to set.
fn base(cfg: &Cfg<'_>, family: Family) -> Result<ModelSpec, String> {
    let num_layers = cfg.u32_req("num_hidden_layers")?;
    cap("num_hidden_layers", num_layers, MAX_LAYERS)?;
    let hidden = cfg.u32_req("hidden_size")?;
    cap("hidden_size", hidden, MAX_DIM)?;
    if let Some(act) = cfg.str_opt("hidden_act")?
        && act != "silu"
    {
        return Err(format!(
            "hidden_act = \"{act}\" changes the expert math; the experts are SwiGLU with SiLU (\"silu\")"
        ));
    }
    let expected = match family {
        Family::DeepseekV3 | Family::Glm4Moe => "sigmoid",
        _ => "softmax",
    };
    // The DeepSeek family requires the key (its implementations' defaults differ); the others
    // do not read it, so a value that says otherwise is a config that means something else.
    if family != Family::DeepseekV3
        && let Some(s) = cfg.str_opt("scoring_func")?
        && s != expected
    {
        return Err(format!(
            "scoring_func = \"{s}\" is not supported for this family (its router is {expected})"
        ));
    }
    let model_type = cfg.str_opt("model_type")?.unwrap_or("deepseek_v3");
    let arch = cfg
        .0
        .get("architectures")
        .and_then(Value::as_array)
        .and_then(|a| a.first())
        .and_then(Value::as_str)
        .map(|a| format!("{a}, "))
        .unwrap_or_default();
    Ok(ModelSpec {
        name: String::new(),
        description: format!("{arch}model_type {model_type}, from a Hugging Face config.json"),
        num_layers,
        first_dense_layers: 0,
        moe_layer_step: 1,
        hidden,
        routed_experts: 0,
        top_k: 0,
        moe_intermediate: 0,
        shared_experts: 0,
        shared_intermediate: 0,
        shared_expert_gate: false,
        scoring: Scoring::Softmax,
        norm_topk_prob: true,
        routed_scaling_factor: 1.0,
        n_group: 1,
        topk_group: 1,
        quant: QuantSpec::G32_BF16,
        toy: false,
    })
}

/// DeepSeek-V3 / Kimi K2 / GLM-4.5: dense prefix, sigmoid with correction bias, groups, one
/// shared MLP of `moe_intermediate_size × n_shared_experts`.
fn map_deepseek(cfg: &Cfg<'_>, family: Family, m: &mut ModelSpec) -> Result<(), String> {
    let freq = cfg.u32_opt("moe_layer_freq", 1)?;
    if freq != 1 {
        return Err(format!(
            "moe_layer_freq = {freq} is not supported: the implementations disagree on it (transformers ignores it, the published remote code makes only every {freq}-th layer MoE), so the layer set is ambiguous; only 1 is served"
        ));
    }
    // transformers' own DeepseekV3Config writes neither key (its router is sigmoid + noaux_tc
    // whatever the config says); published checkpoints write both. Absent: transformers' math.
    if family == Family::DeepseekV3
        && let Some(scoring) = cfg.str_opt("scoring_func")?
        && scoring != "sigmoid"
    {
        return Err(format!(
            "scoring_func = \"{scoring}\" is not supported for DeepSeek-V3-style models (only \"sigmoid\")"
        ));
    }
    let method = cfg.str_opt("topk_method")?;
    match method {
        None | Some("noaux_tc") => {}
        Some("greedy") => m
            .description
            .push_str("; topk_method greedy: zero selection bias"),
        Some(t) => {
            return Err(format!(
                "topk_method = \"{t}\" is not supported (only \"noaux_tc\", or \"greedy\" = noaux_tc with a zero bias)"
            ));
        }
    }
    m.first_dense_layers = cfg.u32_req("first_k_dense_replace")?;
    if m.first_dense_layers >= m.num_layers {
        return Err(format!(
            "first_k_dense_replace = {} with num_hidden_layers = {} leaves no MoE layer",
            m.first_dense_layers, m.num_layers
        ));
    }
    m.routed_experts = cfg.u32_req("n_routed_experts")?;
    m.top_k = cfg.u32_req("num_experts_per_tok")?;
    m.moe_intermediate = cfg.u32_req("moe_intermediate_size")?;
    let n_shared = cfg.u32_req("n_shared_experts")?;
    if n_shared > 0 {
        m.shared_experts = 1;
        m.shared_intermediate = m.moe_intermediate.checked_mul(n_shared).ok_or_else(|| {
            format!("moe_intermediate_size x n_shared_experts ({n_shared}) does not fit in 32 bits")
        })?;
    }
    m.scoring = Scoring::SigmoidBias;
    m.n_group = cfg.u32_req("n_group")?;
    m.topk_group = cfg.u32_req("topk_group")?;
    m.norm_topk_prob = cfg.bool_req("norm_topk_prob")?;
    m.routed_scaling_factor = cfg.f32_req("routed_scaling_factor")?;
    if family == Family::DeepseekV3 && m.top_k == 1 && m.norm_topk_prob {
        return Err(
            "num_experts_per_tok = 1 with norm_topk_prob = true is ambiguous: transformers renormalizes the single weight to 1, the published remote code does not"
                .into(),
        );
    }
    let mtp = cfg.u32_opt("num_nextn_predict_layers", 0)?;
    if mtp > 0 {
        m.description.push_str(&format!(
            "; {mtp} MTP layer(s) after the last layer excluded"
        ));
    }
    Ok(())
}

/// Qwen3-MoE / Qwen2-MoE: softmax, top-k, the MoE layer set from `decoder_sparse_step` and
/// `mlp_only_layers`; Qwen2-MoE's shared expert with its per-token sigmoid gate.
fn map_qwen(cfg: &Cfg<'_>, family: Family, m: &mut ModelSpec) -> Result<(), String> {
    if family == Family::Qwen2Moe {
        // transformers' Qwen2MoeConfig default.
        let shared = cfg.u32_opt("shared_expert_intermediate_size", 5632)?;
        if shared > 0 {
            m.shared_experts = 1;
            m.shared_intermediate = shared;
            m.shared_expert_gate = true;
        }
    }
    m.routed_experts = experts_qwen(cfg)?;
    if m.routed_experts == 0 {
        return Err("num_experts = 0 makes every layer dense; this is not an MoE model".into());
    }
    m.top_k = cfg.u32_req("num_experts_per_tok")?;
    m.moe_intermediate = cfg.u32_req("moe_intermediate_size")?;
    m.scoring = Scoring::Softmax;
    m.norm_topk_prob = cfg.bool_opt("norm_topk_prob", false)?;
    let step = cfg.u32_opt("decoder_sparse_step", 1)?;
    if step == 0 {
        return Err("decoder_sparse_step = 0 is not valid; it must be at least 1".into());
    }
    let mlp_only = cfg.u32_list_opt("mlp_only_layers")?;
    let ids: Vec<u32> = (0..m.num_layers)
        .filter(|l| !mlp_only.contains(l) && (l + 1) % step == 0)
        .collect();
    let what = || {
        format!(
            "mlp_only_layers = {:?} with decoder_sparse_step = {step} and num_hidden_layers = {}",
            mlp_only, m.num_layers
        )
    };
    if ids.is_empty() {
        return Err(format!("{} leaves no MoE layer", what()));
    }
    let Some((first, every)) = express_layers(&ids, m.num_layers) else {
        let culprit = if mlp_only.is_empty() {
            "decoder_sparse_step"
        } else {
            "mlp_only_layers"
        };
        return Err(format!(
            "{culprit}: {} makes layers {} MoE, which is not a dense prefix followed by every n-th layer (first_dense_layers + moe_layer_step), so it cannot be served exactly",
            what(),
            format_list(&ids)
        ));
    };
    m.first_dense_layers = first;
    m.moe_layer_step = every;
    Ok(())
}

/// Qwen's expert count: `num_experts`, or `num_local_experts`; both must agree when both are
/// given.
fn experts_qwen(cfg: &Cfg<'_>) -> Result<u32, String> {
    match (cfg.has("num_experts"), cfg.has("num_local_experts")) {
        (true, true) => {
            let (a, b) = (
                cfg.u32_req("num_experts")?,
                cfg.u32_req("num_local_experts")?,
            );
            if a != b {
                return Err(format!(
                    "num_experts = {a} and num_local_experts = {b} disagree; give one of them"
                ));
            }
            Ok(a)
        }
        (false, true) => cfg.u32_req("num_local_experts"),
        _ => cfg.u32_req("num_experts"),
    }
}

/// Mixtral: every layer MoE; softmax then top-k then renormalize = softmax of the top-k logits.
fn map_mixtral(cfg: &Cfg<'_>, m: &mut ModelSpec) -> Result<(), String> {
    m.routed_experts = cfg.u32_req("num_local_experts")?;
    m.top_k = cfg.u32_req("num_experts_per_tok")?;
    m.moe_intermediate = cfg.u32_req("intermediate_size")?;
    m.scoring = Scoring::TopkSoftmax;
    m.norm_topk_prob = true;
    Ok(())
}

/// OLMoE: every layer MoE; softmax over all experts then top-k, renormalized when
/// `norm_topk_prob`.
fn map_olmoe(cfg: &Cfg<'_>, m: &mut ModelSpec) -> Result<(), String> {
    m.routed_experts = cfg.u32_req("num_experts")?;
    m.top_k = cfg.u32_req("num_experts_per_tok")?;
    m.moe_intermediate = cfg.u32_req("intermediate_size")?;
    m.scoring = Scoring::Softmax;
    m.norm_topk_prob = cfg.bool_opt("norm_topk_prob", false)?;
    Ok(())
}

/// The `(first_dense_layers, moe_layer_step)` whose MoE layers are exactly `ids` (ascending,
/// non-empty) in a model of `num_layers`, if any.
pub fn express_layers(ids: &[u32], num_layers: u32) -> Option<(u32, u32)> {
    let first = *ids.first()?;
    let step = match ids.get(1) {
        Some(second) => second - first,
        None => num_layers.checked_sub(first)?.max(1),
    };
    let spec: Vec<u32> = (first..num_layers)
        .filter(|l| (l - first) % step == 0)
        .collect();
    (spec == ids).then_some((first, step))
}

/// The plausibility caps of model files, and [`ModelSpec::check`].
fn finish(m: ModelSpec) -> Result<ModelSpec, Vec<String>> {
    let mut problems = Vec::new();
    for (key, value, max) in [
        (
            "n_routed_experts / num_experts",
            m.routed_experts,
            MAX_EXPERTS,
        ),
        ("moe_intermediate_size", m.moe_intermediate, MAX_DIM),
        ("shared expert intermediate", m.shared_intermediate, MAX_DIM),
        ("shared experts", m.shared_experts, MAX_SHARED),
    ] {
        if let Err(e) = cap(key, value, max) {
            problems.push(e);
        }
    }
    if problems.is_empty() {
        problems.extend(
            m.check()
                .into_iter()
                .map(|p| format!("the mapped model is invalid: {p}")),
        );
    }
    if problems.is_empty() {
        Ok(m)
    } else {
        Err(problems)
    }
}

/// `key = value` is at most `max`.
fn cap(key: &str, value: u32, max: u32) -> Result<(), String> {
    if value > max {
        return Err(format!(
            "{key} = {value} is implausibly large; this build accepts at most {max}"
        ));
    }
    Ok(())
}

/// A JSON value's kind, for messages.
fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Typed reads of a config's keys; each error names the key and its value. `null` counts as
/// absent (as transformers' `None`).
struct Cfg<'a>(&'a Map<String, Value>);

impl Cfg<'_> {
    /// The key's value, `None` when absent or null.
    fn get(&self, key: &str) -> Option<&Value> {
        self.0.get(key).filter(|v| !v.is_null())
    }

    /// True when the key is present and not null.
    fn has(&self, key: &str) -> bool {
        self.get(key).is_some()
    }

    /// A required key.
    fn req(&self, key: &str) -> Result<&Value, String> {
        self.get(key).ok_or_else(|| {
            format!("missing `{key}`; it decides the model's math and has no agreed default")
        })
    }

    /// A required non-negative integer below 2^32.
    fn u32_req(&self, key: &str) -> Result<u32, String> {
        as_u32(key, self.req(key)?)
    }

    /// An optional non-negative integer below 2^32.
    fn u32_opt(&self, key: &str, default: u32) -> Result<u32, String> {
        self.get(key).map_or(Ok(default), |v| as_u32(key, v))
    }

    /// A required boolean.
    fn bool_req(&self, key: &str) -> Result<bool, String> {
        let v = self.req(key)?;
        v.as_bool()
            .ok_or_else(|| format!("{key} = {v} must be true or false"))
    }

    /// An optional boolean.
    fn bool_opt(&self, key: &str, default: bool) -> Result<bool, String> {
        match self.get(key) {
            None => Ok(default),
            Some(_) => self.bool_req(key),
        }
    }

    /// A required finite number, as the `f32` the router computes with.
    fn f32_req(&self, key: &str) -> Result<f32, String> {
        let v = self.req(key)?;
        match v.as_f64() {
            Some(x) if (x as f32).is_finite() => Ok(x as f32),
            _ => Err(format!("{key} = {v} must be a finite number")),
        }
    }

    /// An optional string.
    fn str_opt(&self, key: &str) -> Result<Option<&str>, String> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(format!("{key} = {v} must be a string")),
        }
    }

    /// An optional list of non-negative integers (empty when absent).
    fn u32_list_opt(&self, key: &str) -> Result<Vec<u32>, String> {
        match self.get(key) {
            None => Ok(Vec::new()),
            Some(Value::Array(a)) => a.iter().map(|v| as_u32(key, v)).collect(),
            Some(v) => Err(format!("{key} = {v} must be a list of layer indices")),
        }
    }
}

/// `v` as a non-negative integer below 2^32.
fn as_u32(key: &str, v: &Value) -> Result<u32, String> {
    v.as_u64()
        .and_then(|x| u32::try_from(x).ok())
        .ok_or_else(|| format!("{key} = {v} must be a non-negative integer below 2^32"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_patterns() {
        assert_eq!(express_layers(&[0, 1, 2, 3], 4), Some((0, 1)));
        assert_eq!(express_layers(&[1, 3, 5], 7), Some((1, 2)));
        assert_eq!(express_layers(&[1, 3, 5], 6), Some((1, 2)));
        assert_eq!(express_layers(&[3], 8), Some((3, 5)));
        assert_eq!(express_layers(&[7], 8), Some((7, 1)));
        // A trailing dense layer, or a hole, is not expressible.
        assert_eq!(express_layers(&[0, 1, 2], 4), None);
        assert_eq!(express_layers(&[0, 1, 3], 4), None);
        assert_eq!(express_layers(&[], 4), None);
    }

    #[test]
    fn names() {
        let cfg = Map::new();
        assert_eq!(
            model_name(Path::new("/x/Qwen3-30B-A3B"), &cfg),
            "Qwen3-30B-A3B"
        );
        assert_eq!(model_name(Path::new("/x/my model!"), &cfg), "my-model");
        let mut cfg = Map::new();
        cfg.insert("_name_or_path".into(), "deepseek-ai/DeepSeek-V3".into());
        let snap = "/c/snapshots/0123456789abcdef0123456789abcdef01234567";
        assert_eq!(model_name(Path::new(snap), &cfg), "DeepSeek-V3");
        assert_eq!(model_name(Path::new("/"), &Map::new()), "hf-model");
    }
}
