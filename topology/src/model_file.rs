//! Model TOML files, and [`resolve_model`]: a preset name or a model file path to a [`ModelSpec`].
//!
//! Why this exists: the presets cover the published models, but a cluster builder evaluating a
//! fine-tune, a new release or a different quantization writes the same facts in a file. The file
//! has exactly the fields of [`ModelSpec`] (plus `format = 1`), is validated by
//! [`ModelSpec::check`], and follows the same rules as the other files of this crate: every
//! problem in one run, unknown keys with the nearest valid key, syntax errors with line:column.
//!
//! # Format 1
//!
//! ```toml
//! format = 1
//! name = "kimi-k2"                 # letters, digits, '.', '_', '-'
//! description = "Moonshot Kimi K2" # optional
//! num_layers = 61                  # all transformer layers
//! first_dense_layers = 1           # optional, default 0
//! moe_layer_step = 1               # optional, default 1 (every layer after the dense prefix)
//! hidden = 7168
//! routed_experts = 384
//! top_k = 8
//! moe_intermediate = 2048
//! shared_experts = 1               # optional, default 0
//! shared_intermediate = 2048       # required when shared_experts > 0
//! shared_expert_gate = false       # optional: scale shared output by sigmoid(gate · x)
//!                                  # per token (Qwen2-MoE); needs shared_experts > 0
//! scoring = "sigmoid-bias"         # "softmax" | "sigmoid-bias" | "topk-softmax"
//! norm_topk_prob = true            # optional, default true
//! routed_scaling_factor = 2.827    # optional, default 1.0
//! n_group = 1                      # optional, default 1
//! topk_group = 1                   # optional, default 1
//! toy = false                      # optional: a small test/demo model
//! overrides_preset = false         # optional: see below
//!
//! [quant]                          # optional, default group_size 32, bf16 scales, symmetric
//! group_size = 32                  # 32 | 64 | 128
//! scale_dtype = "bf16"             # "bf16" | "f16"
//! zero_points = false
//! ```
//!
//! A file whose `name` is a preset's (`"kimi-k2"`) must describe that preset: a file that
//! differs from it in any size, routing or quantization field is refused, naming the fields,
//! unless it says `overrides_preset = true` (then its numbers are used under the preset's name).
//! Renaming the model is usually the better fix.

use crate::diag::{
    Ctx, Field, FileError, Foreign, Problem, Schema, check_format, fields_of, nearest, span_of,
    split, text_or_default,
};
use crate::model::{ModelSpec, Scoring, preset_by_name, presets};
use expertmesh_quant::format::{QuantSpec, ScaleDtype};
use serde::Deserialize;
use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

/// The only model file format version this build reads.
pub const MODEL_FORMAT: i64 = 1;

/// Most transformer layers a model file may declare.
pub const MAX_LAYERS: u32 = 4096;
/// Most routed experts per layer a model file may declare.
pub const MAX_EXPERTS: u32 = 65_536;
/// Largest hidden or intermediate size a model file may declare.
pub const MAX_DIM: u32 = 1 << 20;
/// Most shared experts per layer a model file may declare.
pub const MAX_SHARED: u32 = 64;

/// Why [`resolve_model`] found no model.
#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    /// Not a preset name, and does not look like a file path.
    #[error(
        "unknown model preset \"{name}\"{}; run `expertmesh models` for the list, or pass a model TOML file",
        suggestion.as_ref().map(|s| format!(" (did you mean \"{s}\"?)")).unwrap_or_default()
    )]
    UnknownPreset {
        /// What was asked for.
        name: String,
        /// The nearest preset name, if any is close.
        suggestion: Option<String>,
    },
    /// A model file that could not be read or is invalid.
    #[error(transparent)]
    File(#[from] FileError),
}

impl ResolveError {
    /// True for usage/I-O failures (unknown preset, unreadable file), false when a model file was
    /// read and is invalid.
    pub fn is_usage(&self) -> bool {
        match self {
            ResolveError::UnknownPreset { .. } => true,
            ResolveError::File(f) => f.is_io(),
        }
    }
}

/// A preset name (see [`presets`]) or the path of a model TOML file.
///
/// A preset name wins over a file of the same name in the current directory; write `./name` to
/// force the file.
pub fn resolve_model(name_or_path: &str) -> Result<ModelSpec, ResolveError> {
    if let Some(m) = preset_by_name(name_or_path) {
        return Ok(m);
    }
    let path = Path::new(name_or_path);
    let looks_like_path = name_or_path.contains('/')
        || name_or_path.contains('\\')
        || name_or_path.ends_with(".toml")
        || path.exists();
    if looks_like_path {
        return Ok(load_model(path)?);
    }
    let names: Vec<String> = presets().into_iter().map(|m| m.name).collect();
    Err(ResolveError::UnknownPreset {
        name: name_or_path.to_owned(),
        suggestion: nearest(name_or_path, names.iter().map(String::as_str)).map(str::to_owned),
    })
}

/// Read and validate a model file.
pub fn load_model(path: &Path) -> Result<ModelSpec, FileError> {
    let text = crate::diag::read_text(path)?;
    model_from_toml_str(&text).map_err(|problems| FileError::Invalid {
        path: PathBuf::from(path),
        problems,
    })
}

/// Parse and validate model text; every problem is returned.
pub fn model_from_toml_str(text: &str) -> Result<ModelSpec, Vec<Problem>> {
    let mut ctx = Ctx::new(text);
    let schema = Schema::new("", fields_of::<RawModel>(), None)
        .table(
            "quant",
            Schema::new("[quant]", fields_of::<RawQuant>(), None),
        )
        .root(
            "model file",
            vec![
                Foreign {
                    what: "topology file",
                    keys: crate::topology::top_level_keys(),
                    hint: "pass it as the topology (the first argument)",
                },
                Foreign {
                    what: "placement file",
                    keys: crate::placement::top_level_keys(),
                    hint: "pass it with --placement",
                },
            ],
        );
    let Some(raw) = ctx.parse::<RawModel>(&schema) else {
        return Err(ctx.into_problems());
    };
    match validate(&mut ctx, &raw) {
        Some(m) if !ctx.has_problems() => Ok(m),
        _ => Err(ctx.into_problems()),
    }
}

/// Write a model as a format-1 model file (every field explicit), e.g. to start a custom model
/// from a preset. [`model_from_toml_str`] reads it back to an equal [`ModelSpec`].
pub fn model_to_toml_string(m: &ModelSpec) -> String {
    let s = |v: &str| toml::Value::String(v.to_owned()).to_string();
    format!(
        "format = {MODEL_FORMAT}\n\
         name = {}\n\
         description = {}\n\
         num_layers = {}\n\
         first_dense_layers = {}\n\
         moe_layer_step = {}\n\
         hidden = {}\n\
         routed_experts = {}\n\
         top_k = {}\n\
         moe_intermediate = {}\n\
         shared_experts = {}\n\
         shared_intermediate = {}\n\
         shared_expert_gate = {}\n\
         scoring = {}\n\
         norm_topk_prob = {}\n\
         routed_scaling_factor = {}\n\
         n_group = {}\n\
         topk_group = {}\n\
         toy = {}\n\
         \n\
         [quant]\n\
         group_size = {}\n\
         scale_dtype = {}\n\
         zero_points = {}\n",
        s(&m.name),
        s(&m.description),
        m.num_layers,
        m.first_dense_layers,
        m.moe_layer_step,
        m.hidden,
        m.routed_experts,
        m.top_k,
        m.moe_intermediate,
        m.shared_experts,
        m.shared_intermediate,
        m.shared_expert_gate,
        s(m.scoring.name()),
        m.norm_topk_prob,
        toml_f32(m.routed_scaling_factor),
        m.n_group,
        m.topk_group,
        m.toy,
        m.quant.group_size,
        s(&m.quant.scale_dtype.to_string()),
        m.quant.zero_points,
    )
}

/// An `f32` as a TOML float in its shortest round-trip form (`2.827`, not the widened f64's
/// `2.8269999027252197`).
fn toml_f32(v: f32) -> String {
    if v.is_nan() {
        return "nan".into();
    }
    if v.is_infinite() {
        return if v > 0.0 { "inf" } else { "-inf" }.into();
    }
    let s = v.to_string();
    if s.contains(['.', 'e', 'E']) {
        s
    } else {
        format!("{s}.0")
    }
}

/// The top-level keys of a model file (to recognize one passed as another kind of file).
pub(crate) fn top_level_keys() -> &'static [&'static str] {
    fields_of::<RawModel>()
}

#[derive(Deserialize)]
struct RawModel {
    format: Field<i64>,
    name: Field<String>,
    description: Field<String>,
    num_layers: Field<i64>,
    first_dense_layers: Field<i64>,
    moe_layer_step: Field<i64>,
    hidden: Field<i64>,
    routed_experts: Field<i64>,
    top_k: Field<i64>,
    moe_intermediate: Field<i64>,
    shared_experts: Field<i64>,
    shared_intermediate: Field<i64>,
    shared_expert_gate: Field<bool>,
    scoring: Field<String>,
    norm_topk_prob: Field<bool>,
    routed_scaling_factor: Field<f64>,
    n_group: Field<i64>,
    topk_group: Field<i64>,
    toy: Field<bool>,
    overrides_preset: Field<bool>,
    quant: Field<RawQuant>,
}

#[derive(Deserialize)]
struct RawQuant {
    group_size: Field<i64>,
    scale_dtype: Field<String>,
    zero_points: Field<bool>,
}

const SCORINGS: &[(&str, Scoring)] = &[
    ("softmax", Scoring::Softmax),
    ("sigmoid-bias", Scoring::SigmoidBias),
    ("topk-softmax", Scoring::TopkSoftmax),
];

/// The integer sizes of a model file.
struct Sizes {
    num_layers: u32,
    first_dense_layers: u32,
    moe_layer_step: u32,
    hidden: u32,
    routed_experts: u32,
    top_k: u32,
    moe_intermediate: u32,
    shared_experts: u32,
    shared_intermediate: u32,
    n_group: u32,
    topk_group: u32,
}

/// Reads the keys of one model file: where each key is (for locating later messages), and
/// whether every size is usable.
struct Keys {
    item: String,
    spans: HashMap<&'static str, Range<usize>>,
    ok: bool,
}

impl Keys {
    /// An integer key as `u32`: its value, `default` when absent, or 0 after reporting it
    /// missing or out of range (which makes the sizes unusable).
    fn int(
        &mut self,
        ctx: &mut Ctx<'_>,
        f: &Field<i64>,
        key: &'static str,
        default: Option<u32>,
    ) -> u32 {
        let (v, span) = match split(f) {
            (None, _) => {
                if default.is_none() {
                    ctx.at(None, &self.item, format!("missing `{key}`"));
                    self.ok = false;
                }
                return default.unwrap_or(0);
            }
            (Some(v), span) => (v, span),
        };
        if let Some(s) = span.clone() {
            self.spans.insert(key, s);
        }
        u32::try_from(v).unwrap_or_else(|_| {
            ctx.at(
                span,
                &self.item,
                format!("{key} = {v} must be a non-negative integer below 2^32"),
            );
            self.ok = false;
            0
        })
    }
}

/// Check a parsed model file step by step, reporting every problem into `ctx`.
fn validate(ctx: &mut Ctx<'_>, raw: &RawModel) -> Option<ModelSpec> {
    check_format(ctx, &raw.format, "model", MODEL_FORMAT);
    let name = validate_model_name(ctx, &raw.name);
    let mut keys = Keys {
        item: format!("model \"{name}\""),
        spans: HashMap::new(),
        ok: true,
    };
    let sizes = read_sizes(ctx, &mut keys, raw);
    let scoring = validate_scoring(ctx, &keys.item, &raw.scoring);
    let routed_scaling_factor = match split(&raw.routed_scaling_factor) {
        (None, _) => 1.0,
        (Some(v), span) => {
            if let Some(s) = span {
                keys.spans.insert("routed_scaling_factor", s);
            }
            v as f32
        }
    };
    let quant = validate_quant(ctx, &raw.quant, &mut keys.spans);
    check_caps(ctx, &sizes, &mut keys);
    // Without every size the consistency checks below would only produce noise. Problems with
    // the name, scoring or quantization are already recorded and fail the file in the caller.
    if !keys.ok {
        return None;
    }
    let spec = ModelSpec {
        name,
        description: text_or_default(&raw.description),
        num_layers: sizes.num_layers,
        first_dense_layers: sizes.first_dense_layers,
        moe_layer_step: sizes.moe_layer_step,
        hidden: sizes.hidden,
        routed_experts: sizes.routed_experts,
        top_k: sizes.top_k,
        moe_intermediate: sizes.moe_intermediate,
        shared_experts: sizes.shared_experts,
        shared_intermediate: sizes.shared_intermediate,
        shared_expert_gate: raw
            .shared_expert_gate
            .as_ref()
            .is_some_and(|b| *b.get_ref()),
        scoring,
        norm_topk_prob: raw.norm_topk_prob.as_ref().is_none_or(|b| *b.get_ref()),
        routed_scaling_factor,
        n_group: sizes.n_group,
        topk_group: sizes.topk_group,
        quant,
        toy: raw.toy.as_ref().is_some_and(|b| *b.get_ref()),
    };
    report_consistency(ctx, &spec, &keys);
    check_preset_name(ctx, &spec, raw);
    Some(spec)
}

/// Step: a file named like a preset must be that preset, or say `overrides_preset = true`.
fn check_preset_name(ctx: &mut Ctx<'_>, spec: &ModelSpec, raw: &RawModel) {
    let Some(preset) = preset_by_name(&spec.name) else {
        return;
    };
    if raw.overrides_preset.as_ref().is_some_and(|b| *b.get_ref()) {
        return;
    }
    let differing = differing_fields(spec, &preset);
    if differing.is_empty() {
        return;
    }
    ctx.at(
        span_of(&raw.name),
        "top level",
        format!(
            "model name \"{}\" is a built-in preset, but this file differs from it in {}; rename the model, or add `overrides_preset = true` to use these numbers under the preset's name",
            spec.name,
            differing.join(", ")
        ),
    );
}

/// `key (file value, preset P)` for every field (other than name, description and `toy`) in
/// which `m` differs from `preset`.
fn differing_fields(m: &ModelSpec, preset: &ModelSpec) -> Vec<String> {
    let fields: [(&str, String, String); 17] = [
        (
            "num_layers",
            m.num_layers.to_string(),
            preset.num_layers.to_string(),
        ),
        (
            "first_dense_layers",
            m.first_dense_layers.to_string(),
            preset.first_dense_layers.to_string(),
        ),
        (
            "moe_layer_step",
            m.moe_layer_step.to_string(),
            preset.moe_layer_step.to_string(),
        ),
        ("hidden", m.hidden.to_string(), preset.hidden.to_string()),
        (
            "routed_experts",
            m.routed_experts.to_string(),
            preset.routed_experts.to_string(),
        ),
        ("top_k", m.top_k.to_string(), preset.top_k.to_string()),
        (
            "moe_intermediate",
            m.moe_intermediate.to_string(),
            preset.moe_intermediate.to_string(),
        ),
        (
            "shared_experts",
            m.shared_experts.to_string(),
            preset.shared_experts.to_string(),
        ),
        (
            "shared_intermediate",
            m.shared_intermediate.to_string(),
            preset.shared_intermediate.to_string(),
        ),
        (
            "shared_expert_gate",
            m.shared_expert_gate.to_string(),
            preset.shared_expert_gate.to_string(),
        ),
        (
            "scoring",
            m.scoring.name().to_owned(),
            preset.scoring.name().to_owned(),
        ),
        (
            "norm_topk_prob",
            m.norm_topk_prob.to_string(),
            preset.norm_topk_prob.to_string(),
        ),
        (
            "routed_scaling_factor",
            m.routed_scaling_factor.to_string(),
            preset.routed_scaling_factor.to_string(),
        ),
        ("n_group", m.n_group.to_string(), preset.n_group.to_string()),
        (
            "topk_group",
            m.topk_group.to_string(),
            preset.topk_group.to_string(),
        ),
        (
            "quant.group_size",
            m.quant.group_size.to_string(),
            preset.quant.group_size.to_string(),
        ),
        ("quant", m.quant.to_string(), preset.quant.to_string()),
    ];
    fields
        .into_iter()
        .filter(|(_, a, b)| a != b)
        // group_size also shows in the quant format; name it once.
        .filter(|(k, _, _)| *k != "quant" || m.quant.group_size == preset.quant.group_size)
        .map(|(k, a, b)| format!("{k} ({a}, preset {b})"))
        .collect()
}

/// Step: the model's name, reported when missing or malformed (kept either way, for messages).
fn validate_model_name(ctx: &mut Ctx<'_>, f: &Field<String>) -> String {
    let top = "top level";
    match split(f) {
        (None, _) => {
            ctx.at(None, top, "missing `name`; give the model a name");
            String::new()
        }
        (Some(n), span) => {
            let bad = n.is_empty()
                || n.len() > 64
                || n.chars()
                    .any(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')));
            if bad {
                ctx.at(
                    span,
                    top,
                    format!("model name \"{n}\" must be 1 to 64 letters, digits, '.', '_' or '-'"),
                );
            }
            n
        }
    }
}

/// Step: the integer sizes, with their defaults.
fn read_sizes(ctx: &mut Ctx<'_>, keys: &mut Keys, raw: &RawModel) -> Sizes {
    Sizes {
        num_layers: keys.int(ctx, &raw.num_layers, "num_layers", None),
        first_dense_layers: keys.int(ctx, &raw.first_dense_layers, "first_dense_layers", Some(0)),
        moe_layer_step: keys.int(ctx, &raw.moe_layer_step, "moe_layer_step", Some(1)),
        hidden: keys.int(ctx, &raw.hidden, "hidden", None),
        routed_experts: keys.int(ctx, &raw.routed_experts, "routed_experts", None),
        top_k: keys.int(ctx, &raw.top_k, "top_k", None),
        moe_intermediate: keys.int(ctx, &raw.moe_intermediate, "moe_intermediate", None),
        shared_experts: keys.int(ctx, &raw.shared_experts, "shared_experts", Some(0)),
        shared_intermediate: keys.int(
            ctx,
            &raw.shared_intermediate,
            "shared_intermediate",
            Some(0),
        ),
        n_group: keys.int(ctx, &raw.n_group, "n_group", Some(1)),
        topk_group: keys.int(ctx, &raw.topk_group, "topk_group", Some(1)),
    }
}

/// Step: the router scoring function (a missing or unknown one is reported, and stands in as
/// sigmoid-bias, which lets the other checks run: it allows group-limited routing).
fn validate_scoring(ctx: &mut Ctx<'_>, item: &str, f: &Field<String>) -> Scoring {
    let (s, span) = match split(f) {
        (None, _) => {
            ctx.at(
                None,
                item,
                "missing `scoring`; use \"softmax\", \"sigmoid-bias\" or \"topk-softmax\"",
            );
            return Scoring::SigmoidBias;
        }
        (Some(s), span) => (s, span),
    };
    if let Some((_, v)) = SCORINGS.iter().find(|(n, _)| *n == s) {
        return *v;
    }
    let hint = nearest(&s, SCORINGS.iter().map(|(n, _)| *n))
        .map(|n| format!("; did you mean \"{n}\"?"))
        .unwrap_or_default();
    ctx.at(
        span,
        item,
        format!(
            "scoring \"{s}\" is not one of \"softmax\", \"sigmoid-bias\", \"topk-softmax\"{hint}"
        ),
    );
    Scoring::SigmoidBias
}

/// Step: the optional `[quant]` table over the default (group 32, bf16 scales, symmetric).
fn validate_quant(
    ctx: &mut Ctx<'_>,
    raw: &Field<RawQuant>,
    spans: &mut HashMap<&'static str, Range<usize>>,
) -> QuantSpec {
    let mut quant = QuantSpec::G32_BF16;
    let Some(q) = raw else {
        return quant;
    };
    let q = q.get_ref();
    if let (Some(g), span) = split(&q.group_size) {
        if let Some(s) = span.clone() {
            spans.insert("quant", s);
        }
        match u32::try_from(g) {
            Ok(g) => quant.group_size = g,
            Err(_) => {
                ctx.at(
                    span,
                    "[quant]",
                    format!("group_size = {g} must be 32, 64 or 128"),
                );
            }
        }
    }
    if let (Some(d), span) = split(&q.scale_dtype) {
        match d.as_str() {
            "bf16" => quant.scale_dtype = ScaleDtype::Bf16,
            "f16" => quant.scale_dtype = ScaleDtype::F16,
            _ => {
                ctx.at(
                    span,
                    "[quant]",
                    format!("scale_dtype \"{d}\" is not \"bf16\" or \"f16\""),
                );
            }
        }
    }
    if let (Some(z), _) = split(&q.zero_points) {
        quant.zero_points = z;
    }
    quant
}

/// Step: plausibility caps, far above any real model: they keep a typo (or a hostile file)
/// from making later layer/expert tables exhaust memory.
fn check_caps(ctx: &mut Ctx<'_>, s: &Sizes, keys: &mut Keys) {
    for (key, value, cap) in [
        ("num_layers", s.num_layers, MAX_LAYERS),
        ("routed_experts", s.routed_experts, MAX_EXPERTS),
        ("hidden", s.hidden, MAX_DIM),
        ("moe_intermediate", s.moe_intermediate, MAX_DIM),
        ("shared_intermediate", s.shared_intermediate, MAX_DIM),
        ("shared_experts", s.shared_experts, MAX_SHARED),
    ] {
        if value > cap {
            ctx.at(
                keys.spans.get(key).cloned(),
                &keys.item,
                format!("{key} = {value} is implausibly large; this build accepts at most {cap}"),
            );
            keys.ok = false;
        }
    }
}

/// Step: [`ModelSpec::check`]'s problems, each located at the key its message names first.
fn report_consistency(ctx: &mut Ctx<'_>, spec: &ModelSpec, keys: &Keys) {
    for msg in spec.check() {
        let key = msg
            .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .next()
            .unwrap_or("");
        let span = keys.spans.get(key).cloned().or(None);
        ctx.at(span, &keys.item, msg);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_preset_round_trips_through_a_file() {
        for m in presets() {
            let text = model_to_toml_string(&m);
            let back = model_from_toml_str(&text).unwrap_or_else(|p| panic!("{}: {p:?}", m.name));
            assert_eq!(back, m, "{text}");
        }
    }

    #[test]
    fn floats_are_written_as_the_f32_they_are() {
        let k2 = preset_by_name("kimi-k2").unwrap();
        let text = model_to_toml_string(&k2);
        assert!(text.contains("routed_scaling_factor = 2.827\n"), "{text}");
        assert_eq!(toml_f32(1.0), "1.0");
        assert_eq!(toml_f32(2.5), "2.5");
        assert_eq!(toml_f32(1e-7), "0.0000001");
    }

    #[test]
    fn a_file_named_like_a_preset_must_match_it_or_say_it_overrides() {
        let k2 = preset_by_name("kimi-k2").unwrap();
        let text = model_to_toml_string(&k2)
            .replace("routed_experts = 384", "routed_experts = 512")
            .replace("hidden = 7168", "hidden = 4096");
        let p = model_from_toml_str(&text).unwrap_err();
        assert_eq!(p.len(), 1, "{p:?}");
        let s = p[0].to_string();
        assert!(
            s.starts_with("2:8: top level: model name \"kimi-k2\" is a built-in preset, but this file differs from it in hidden (4096, preset 7168), routed_experts (512, preset 384); rename the model, or add `overrides_preset = true`"),
            "{s}"
        );
        let m = model_from_toml_str(&format!("overrides_preset = true\n{text}")).unwrap();
        assert_eq!(m.routed_experts, 512);
    }

    #[test]
    fn minimal_file_takes_defaults() {
        let m = model_from_toml_str(
            "format = 1\nname = \"tiny\"\nnum_layers = 2\nhidden = 64\nrouted_experts = 4\n\
             top_k = 2\nmoe_intermediate = 32\nscoring = \"softmax\"\n",
        )
        .unwrap();
        assert_eq!(m.quant, QuantSpec::G32_BF16);
        assert_eq!(m.moe_layer_ids(), vec![0, 1]);
        assert!(m.norm_topk_prob);
        assert_eq!(m.routed_scaling_factor, 1.0);
        assert_eq!(m.expert_bytes(), QuantSpec::G32_BF16.expert_bytes(64, 32));
    }

    #[test]
    fn all_problems_at_once_with_locations() {
        let text = "format = 1\nname = \"bad\"\nnum_layers = 2\nhiden = 64\nrouted_experts = 4\n\
                    top_k = 9\nmoe_intermediate = 30\nscoring = \"sigmoid\"\n\
                    [quant]\ngroup_size = 48\nscale_type = \"bf16\"\n";
        let p = model_from_toml_str(text).unwrap_err();
        let all: Vec<String> = p.iter().map(|p| p.to_string()).collect();
        let joined = all.join("\n");
        // unknown keys with suggestions and line:column
        assert!(
            joined.contains("4:1: top level: unknown key \"hiden\"; did you mean \"hidden\"?"),
            "{joined}"
        );
        assert!(
            joined.contains(
                "11:1: [quant]: unknown key \"scale_type\"; did you mean \"scale_dtype\"?"
            ),
            "{joined}"
        );
        // missing hidden (the typo), bad scoring with suggestion
        assert!(joined.contains("missing `hidden`"), "{joined}");
        assert!(
            joined.contains("8:11: model \"bad\": scoring \"sigmoid\""),
            "{joined}"
        );
        assert!(
            joined.contains("did you mean \"sigmoid-bias\"?"),
            "{joined}"
        );
    }

    #[test]
    fn check_problems_are_located_on_their_key() {
        let text = "format = 1\nname = \"bad\"\nnum_layers = 2\nhidden = 64\nrouted_experts = 4\n\
                    top_k = 9\nmoe_intermediate = 30\nscoring = \"softmax\"\n";
        let p = model_from_toml_str(text).unwrap_err();
        let joined: Vec<String> = p.iter().map(|p| p.to_string()).collect();
        let joined = joined.join("\n");
        assert!(
            joined
                .contains("6:9: model \"bad\": top_k (9) must be between 1 and routed_experts (4)"),
            "{joined}"
        );
        assert!(
            joined.contains("7:20: model \"bad\": moe_intermediate (30)"),
            "{joined}"
        );
    }

    #[test]
    fn implausible_sizes_are_rejected() {
        let text = "format = 1\nname = \"huge\"\nnum_layers = 4000000000\nhidden = 64\n\
                    routed_experts = 100000\ntop_k = 2\nmoe_intermediate = 32\nscoring = \"softmax\"\n";
        let p = model_from_toml_str(text).unwrap_err();
        let all: Vec<String> = p.iter().map(|p| p.to_string()).collect();
        assert_eq!(all.len(), 2, "{all:?}");
        assert!(
            all[0]
                .starts_with("3:14: model \"huge\": num_layers = 4000000000 is implausibly large"),
            "{all:?}"
        );
        assert!(
            all[1].starts_with("5:18: model \"huge\": routed_experts = 100000"),
            "{all:?}"
        );
    }

    #[test]
    fn huge_group_counts_do_not_overflow() {
        // topk_group x experts-per-group used to overflow u32 in ModelSpec::check.
        let text = "format = 1\nname = \"g\"\nnum_layers = 2\nhidden = 64\nrouted_experts = 4\n\
                    top_k = 2\nmoe_intermediate = 32\nscoring = \"sigmoid-bias\"\nn_group = 2\n\
                    topk_group = 3000000000\n";
        let p = model_from_toml_str(text).unwrap_err();
        assert_eq!(p.len(), 1, "{p:?}");
        assert!(
            p[0].to_string().starts_with(
                "10:14: model \"g\": topk_group (3000000000) must be between 1 and n_group (2)"
            ),
            "{}",
            p[0]
        );
    }

    #[test]
    fn type_errors_carry_line_and_column() {
        let text = "format = 1\nname = \"t\"\nnum_layers = \"two\"\n";
        let p = model_from_toml_str(text).unwrap_err();
        assert_eq!(p.len(), 1, "{p:?}");
        let s = p[0].to_string();
        assert!(
            s.starts_with("3:14: top level: `num_layers`: wrong type"),
            "{s}"
        );
    }

    #[test]
    fn syntax_errors_carry_line_and_column() {
        let p = model_from_toml_str("format = 1\nname = \"t\nhidden = 3\n").unwrap_err();
        assert_eq!(p.len(), 1);
        let loc = p[0].location().unwrap();
        assert_eq!(loc.line(), 2, "{}", p[0]);
        assert!(p[0].message().starts_with("TOML syntax error"), "{}", p[0]);
    }

    #[test]
    fn resolve_presets_files_and_unknowns() {
        assert_eq!(resolve_model("kimi-k2").unwrap().routed_experts, 384);
        match resolve_model("kimi-k3") {
            Err(ResolveError::UnknownPreset { suggestion, .. }) => {
                assert_eq!(suggestion.as_deref(), Some("kimi-k2"))
            }
            other => panic!("{other:?}"),
        }
        let e = resolve_model("/nonexistent/dir/model.toml").unwrap_err();
        assert!(e.is_usage(), "{e}");
        let dir = std::env::temp_dir().join(format!("em-model-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("m.toml");
        let preset = preset_by_name("qwen3-30b-a3b").unwrap();
        std::fs::write(&path, model_to_toml_string(&preset)).unwrap();
        assert_eq!(resolve_model(path.to_str().unwrap()).unwrap(), preset);
        std::fs::write(&path, "format = 2\n").unwrap();
        let e = resolve_model(path.to_str().unwrap()).unwrap_err();
        assert!(!e.is_usage());
        assert!(e.to_string().contains("unsupported format 2"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
