//! `config.json` → `ModelSpec` on the published configs (fixtures under `tests/data/hf/`, one
//! folder per checkpoint, named as on the Hub) and on edits of them: every mapped field is
//! checked against expectations written independently of the mapping (the built-in presets,
//! which carry the published numbers, or literal values), and every refusal names its key.

use expertmesh_checkpoint::hf_config::{
    HfConfigError, express_layers, load_hf_model, model_from_hf_config, same_math,
};
use expertmesh_quant::format::QuantSpec;
use expertmesh_topology::model::{ModelSpec, Scoring, preset_by_name};
use expertmesh_topology::model_file::{model_from_toml_str, model_to_toml_string};
use proptest::prelude::*;
use serde_json::{Map, Value, json};
use std::path::{Path, PathBuf};

fn data(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/hf")
        .join(name)
}

/// The fixture's config as a JSON object.
fn fixture(name: &str) -> Map<String, Value> {
    let text = std::fs::read_to_string(data(name).join("config.json")).unwrap();
    match serde_json::from_str(&text).unwrap() {
        Value::Object(m) => m,
        _ => panic!("{name}: not an object"),
    }
}

/// `fixture` with `edits` applied (a null value removes the key).
fn edited(name: &str, edits: Value) -> Map<String, Value> {
    let mut cfg = fixture(name);
    for (k, v) in edits.as_object().unwrap() {
        if v.is_null() {
            cfg.remove(k);
        } else {
            cfg.insert(k.clone(), v.clone());
        }
    }
    cfg
}

fn map(cfg: &Map<String, Value>) -> Result<ModelSpec, Vec<String>> {
    model_from_hf_config(cfg, "test-model")
}

/// The refusal of `cfg`, as one string; fails the test if it was accepted.
fn refusal(cfg: &Map<String, Value>) -> String {
    match map(cfg) {
        Ok(m) => panic!("accepted: {m:?}"),
        Err(p) => p.join("\n"),
    }
}

/// `m` with the preset's name, description and toy flag: equal to the preset iff the math is.
fn as_preset(m: &ModelSpec, preset: &ModelSpec) -> ModelSpec {
    ModelSpec {
        name: preset.name.clone(),
        description: preset.description.clone(),
        toy: preset.toy,
        ..m.clone()
    }
}

#[test]
fn published_configs_match_the_presets_in_every_math_field() {
    for (dir, preset) in [
        ("Kimi-K2-Instruct", "kimi-k2"),
        ("DeepSeek-V3", "deepseek-v3"),
        ("Qwen3-30B-A3B", "qwen3-30b-a3b"),
        ("Mixtral-8x7B-v0.1", "mixtral-8x7b"),
        ("OLMoE-1B-7B-0924", "olmoe-1b-7b"),
        ("GLM-4.5", "glm-4.5"),
    ] {
        let m = load_hf_model(&data(dir)).unwrap_or_else(|e| panic!("{dir}: {e}"));
        let p = preset_by_name(preset).unwrap();
        assert_eq!(as_preset(&m, &p), p, "{dir} vs preset {preset}");
        assert!(same_math(&m, &p), "{dir}");
        assert_eq!(m.name, dir, "named after the folder");
        assert_eq!(m.moe_layer_ids(), p.moe_layer_ids(), "{dir}");
        assert!(m.check().is_empty(), "{dir}: {:?}", m.check());
    }
}

#[test]
fn published_configs_literal_expectations() {
    let k2 = load_hf_model(&data("Kimi-K2-Instruct")).unwrap();
    assert_eq!(k2.moe_layers(), 60);
    assert_eq!(k2.routed_bytes(), 570_760_888_320);
    assert_eq!(k2.routed_scaling_factor, 2.827f32);
    assert_eq!((k2.n_group, k2.topk_group), (1, 1));
    let v3 = load_hf_model(&data("DeepSeek-V3")).unwrap();
    assert_eq!(v3.moe_layer_ids(), (3..61).collect::<Vec<u32>>());
    assert_eq!((v3.shared_experts, v3.shared_intermediate), (1, 2048));
    assert_eq!((v3.n_group, v3.topk_group), (8, 4));
    assert!(
        v3.description.contains("1 MTP layer(s)"),
        "{}",
        v3.description
    );
    let mix = load_hf_model(&data("Mixtral-8x7B-v0.1")).unwrap();
    assert_eq!(
        (mix.routed_experts, mix.top_k, mix.moe_intermediate),
        (8, 2, 14336)
    );
    assert_eq!(mix.scoring, Scoring::TopkSoftmax);
    let olmoe = load_hf_model(&data("OLMoE-1B-7B-0924")).unwrap();
    assert!(!olmoe.norm_topk_prob);
    assert_eq!(olmoe.scoring, Scoring::Softmax);
}

#[test]
fn glm_4_5_air() {
    let m = load_hf_model(&data("GLM-4.5-Air")).unwrap();
    let want = ModelSpec {
        name: "GLM-4.5-Air".into(),
        description: m.description.clone(),
        num_layers: 46,
        first_dense_layers: 1,
        moe_layer_step: 1,
        hidden: 4096,
        routed_experts: 128,
        top_k: 8,
        moe_intermediate: 1408,
        shared_experts: 1,
        shared_intermediate: 1408,
        shared_expert_gate: false,
        scoring: Scoring::SigmoidBias,
        norm_topk_prob: true,
        routed_scaling_factor: 1.0,
        n_group: 1,
        topk_group: 1,
        quant: QuantSpec::G32_BF16,
        toy: false,
    };
    assert_eq!(m, want);
    assert_eq!(m.moe_layers(), 45);
    assert!(m.description.contains("glm4_moe"), "{}", m.description);
}

#[test]
fn every_accepted_config_round_trips_through_a_model_file() {
    for dir in [
        "Kimi-K2-Instruct",
        "DeepSeek-V3",
        "Qwen3-30B-A3B",
        "Mixtral-8x7B-v0.1",
        "OLMoE-1B-7B-0924",
        "GLM-4.5",
        "GLM-4.5-Air",
    ] {
        let m = load_hf_model(&data(dir)).unwrap();
        let back = model_from_toml_str(&model_to_toml_string(&m))
            .unwrap_or_else(|p| panic!("{dir}: {p:?}"));
        assert_eq!(back, m, "{dir}");
    }
}

#[test]
fn qwen1_5_moe_maps_its_gated_shared_expert() {
    let m = load_hf_model(&data("Qwen1.5-MoE-A2.7B")).unwrap();
    assert_eq!(
        (m.routed_experts, m.top_k, m.moe_intermediate),
        (60, 4, 1408)
    );
    assert_eq!((m.shared_experts, m.shared_intermediate), (1, 5632));
    assert!(m.shared_expert_gate);
    assert_eq!(m.scoring, Scoring::Softmax);
    assert!(!m.norm_topk_prob);
    // Without the key transformers' default (5632) applies.
    let d = map(&edited(
        "Qwen1.5-MoE-A2.7B",
        json!({"shared_expert_intermediate_size": null}),
    ))
    .unwrap();
    assert_eq!((d.shared_experts, d.shared_intermediate), (1, 5632));
    // A zero-width shared expert adds nothing: the routed part maps like Qwen3.
    let m = map(&edited(
        "Qwen1.5-MoE-A2.7B",
        json!({"shared_expert_intermediate_size": 0}),
    ))
    .unwrap();
    assert_eq!((m.shared_experts, m.scoring), (0, Scoring::Softmax));
    assert!(!m.shared_expert_gate);
    // The model file says so and reads back to the same model.
    let m = load_hf_model(&data("Qwen1.5-MoE-A2.7B")).unwrap();
    let text = model_to_toml_string(&m);
    assert!(text.contains("shared_expert_gate = true"), "{text}");
    assert_eq!(model_from_toml_str(&text).unwrap(), m);
}

#[test]
fn unsupported_families_are_named() {
    let e = load_hf_model(&data("gpt-oss-120b")).unwrap_err();
    assert!(!e.is_usage());
    assert!(e.to_string().contains("model_type = \"gpt_oss\""), "{e}");
    assert!(e.to_string().contains("swiglu_limit"), "{e}");
    let llama4 = json!({"model_type": "llama4", "hidden_size": 5120, "num_hidden_layers": 48});
    let s = refusal(llama4.as_object().unwrap());
    assert!(s.contains("model_type = \"llama4\""), "{s}");
    let s = refusal(&edited("Mixtral-8x7B-v0.1", json!({"model_type": "llama"})));
    assert!(
        s.contains("model_type = \"llama\" is not a supported MoE family"),
        "{s}"
    );
    let s = refusal(&edited("Mixtral-8x7B-v0.1", json!({"model_type": null})));
    assert!(s.contains("missing `model_type`"), "{s}");
}

#[test]
fn a_deepseek_architecture_without_a_known_model_type_maps_as_deepseek_v3() {
    let m = map(&edited(
        "Kimi-K2-Instruct",
        json!({"model_type": "kimi_k2_custom"}),
    ))
    .unwrap();
    let p = preset_by_name("kimi-k2").unwrap();
    assert!(same_math(&m, &p));
}

#[test]
fn qwen3_expert_count_key_variants() {
    let base = load_hf_model(&data("Qwen3-30B-A3B")).unwrap();
    let m = map(&edited(
        "Qwen3-30B-A3B",
        json!({"num_experts": null, "num_local_experts": 128}),
    ))
    .unwrap();
    assert!(same_math(&m, &base));
    let m = map(&edited("Qwen3-30B-A3B", json!({"num_local_experts": 128}))).unwrap();
    assert!(same_math(&m, &base));
    let s = refusal(&edited("Qwen3-30B-A3B", json!({"num_local_experts": 64})));
    assert!(
        s.contains("num_experts = 128 and num_local_experts = 64 disagree"),
        "{s}"
    );
    let s = refusal(&edited("Qwen3-30B-A3B", json!({"num_experts": null})));
    assert!(s.contains("missing `num_experts`"), "{s}");
    let s = refusal(&edited("Qwen3-30B-A3B", json!({"num_experts": 0})));
    assert!(s.contains("num_experts = 0"), "{s}");
}

#[test]
fn qwen3_layer_patterns() {
    // A leading dense prefix.
    let m = map(&edited(
        "Qwen3-30B-A3B",
        json!({"mlp_only_layers": [0, 1, 2]}),
    ))
    .unwrap();
    assert_eq!((m.first_dense_layers, m.moe_layer_step), (3, 1));
    assert_eq!(m.moe_layer_ids(), (3..48).collect::<Vec<u32>>());
    // Every second layer: layers 1, 3, ..., 47 ((l + 1) % 2 == 0).
    let m = map(&edited("Qwen3-30B-A3B", json!({"decoder_sparse_step": 2}))).unwrap();
    assert_eq!((m.first_dense_layers, m.moe_layer_step), (1, 2));
    assert_eq!(m.moe_layer_ids(), (1..48).step_by(2).collect::<Vec<u32>>());
    assert_eq!(m.moe_layers(), 24);
    // Step 2 plus layer 1 dense: 3, 5, ..., 47.
    let m = map(&edited(
        "Qwen3-30B-A3B",
        json!({"decoder_sparse_step": 2, "mlp_only_layers": [1]}),
    ))
    .unwrap();
    assert_eq!(m.moe_layer_ids(), (3..48).step_by(2).collect::<Vec<u32>>());
    // A trailing dense layer, or a hole, cannot be expressed.
    for (layers, shown) in [(json!([47]), "[47]"), (json!([10]), "[10]")] {
        let s = refusal(&edited("Qwen3-30B-A3B", json!({"mlp_only_layers": layers})));
        assert!(
            s.starts_with(&format!("mlp_only_layers: mlp_only_layers = {shown}")),
            "{s}"
        );
        assert!(s.contains("cannot be served exactly"), "{s}");
    }
    // null means no dense layers (transformers: None -> []).
    let m = map(&edited(
        "Qwen3-30B-A3B",
        json!({"mlp_only_layers": Value::Null}),
    ))
    .unwrap();
    assert_eq!(m.moe_layers(), 48);
    let s = refusal(&edited("Qwen3-30B-A3B", json!({"decoder_sparse_step": 0})));
    assert!(s.contains("decoder_sparse_step = 0"), "{s}");
    let s = refusal(&edited("Qwen3-30B-A3B", json!({"decoder_sparse_step": 49})));
    assert!(s.contains("leaves no MoE layer"), "{s}");
    // norm_topk_prob defaults to false (transformers' Qwen3MoeConfig).
    let m = map(&edited("Qwen3-30B-A3B", json!({"norm_topk_prob": null}))).unwrap();
    assert!(!m.norm_topk_prob);
}

#[test]
fn deepseek_keys_that_change_the_math_are_refused() {
    let cases = [
        (json!({"moe_layer_freq": 2}), "moe_layer_freq = 2"),
        (
            json!({"scoring_func": "softmax"}),
            "scoring_func = \"softmax\"",
        ),
        (
            json!({"topk_method": "group_limited_greedy"}),
            "topk_method = \"group_limited_greedy\"",
        ),
        (json!({"n_group": null}), "missing `n_group`"),
        (
            json!({"routed_scaling_factor": "2.5"}),
            "routed_scaling_factor = \"2.5\" must be a finite number",
        ),
        (
            json!({"n_routed_experts": 256.5}),
            "n_routed_experts = 256.5 must be a non-negative integer",
        ),
        (json!({"hidden_act": "gelu"}), "hidden_act = \"gelu\""),
        (
            json!({"first_k_dense_replace": 61}),
            "first_k_dense_replace = 61 with num_hidden_layers = 61 leaves no MoE layer",
        ),
        (
            json!({"num_experts_per_tok": 1}),
            "num_experts_per_tok = 1 with norm_topk_prob = true is ambiguous",
        ),
        // Groups that do not divide the experts: ModelSpec's own validation.
        (
            json!({"n_group": 7}),
            "the mapped model is invalid: n_group (7)",
        ),
    ];
    for (edit, want) in cases {
        let s = refusal(&edited("DeepSeek-V3", edit.clone()));
        assert!(s.contains(want), "{edit}: want {want:?} in {s}");
    }
    let s = refusal(&edited("GLM-4.5-Air", json!({"scoring_func": "softmax"})));
    assert!(s.contains("scoring_func = \"softmax\""), "{s}");
    let s = refusal(&edited(
        "Mixtral-8x7B-v0.1",
        json!({"scoring_func": "sigmoid"}),
    ));
    assert!(s.contains("scoring_func = \"sigmoid\""), "{s}");
}

#[test]
fn deepseek_v3_config_written_by_transformers_maps_to_its_math() {
    // transformers' DeepseekV3Config writes no scoring_func / topk_method: its router is
    // sigmoid + noaux_tc whatever they say, so their absence means exactly that.
    let full = map(&edited("DeepSeek-V3", json!({}))).unwrap();
    let bare = map(&edited(
        "DeepSeek-V3",
        json!({"scoring_func": null, "topk_method": null}),
    ))
    .unwrap();
    assert_eq!(bare.scoring, Scoring::SigmoidBias);
    assert_eq!(bare, full);
}

#[test]
fn deepseek_variants_that_are_exact() {
    // Two shared experts: DeepSeek's shared MLP is ONE MLP of moe_intermediate_size x 2.
    let m = map(&edited("DeepSeek-V3", json!({"n_shared_experts": 2}))).unwrap();
    assert_eq!((m.shared_experts, m.shared_intermediate), (1, 4096));
    let m = map(&edited("DeepSeek-V3", json!({"n_shared_experts": 0}))).unwrap();
    assert_eq!((m.shared_experts, m.shared_intermediate), (0, 0));
    // greedy = noaux_tc with a zero bias.
    let m = map(&edited(
        "Kimi-K2-Instruct",
        json!({"topk_method": "greedy"}),
    ))
    .unwrap();
    assert_eq!(m.scoring, Scoring::SigmoidBias);
    assert!(
        m.description.contains("zero selection bias"),
        "{}",
        m.description
    );
    // moe_layer_freq absent = 1 in every implementation.
    let m = map(&edited("DeepSeek-V3", json!({"moe_layer_freq": null}))).unwrap();
    assert!(same_math(&m, &preset_by_name("deepseek-v3").unwrap()));
}

#[test]
fn names_from_the_folder_and_preset_names() {
    let tmp = tempfile::tempdir().unwrap();
    let k2 = tmp.path().join("kimi-k2");
    std::fs::create_dir(&k2).unwrap();
    std::fs::copy(
        data("Kimi-K2-Instruct").join("config.json"),
        k2.join("config.json"),
    )
    .unwrap();
    // Same math as the preset: the preset's name is fine.
    assert_eq!(load_hf_model(&k2).unwrap().name, "kimi-k2");
    // Different math under a preset's name would not load back as a model file: renamed.
    let cfg = edited("Kimi-K2-Instruct", json!({"n_routed_experts": 256}));
    std::fs::write(k2.join("config.json"), Value::Object(cfg).to_string()).unwrap();
    let m = load_hf_model(&k2).unwrap();
    assert_eq!(m.name, "kimi-k2-hf");
    assert!(model_from_toml_str(&model_to_toml_string(&m)).is_ok());
    // The config file itself may be given.
    let m = load_hf_model(&data("Mixtral-8x7B-v0.1").join("config.json")).unwrap();
    assert_eq!(m.name, "Mixtral-8x7B-v0.1");
}

#[test]
fn unreadable_configs_are_usage_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let e = load_hf_model(&tmp.path().join("nope")).unwrap_err();
    assert!(matches!(e, HfConfigError::Io { .. }) && e.is_usage(), "{e}");
    assert!(e.to_string().contains("config.json"), "{e}");
    let e = load_hf_model(tmp.path()).unwrap_err();
    assert!(e.is_usage(), "{e}");
    std::fs::write(tmp.path().join("config.json"), "{ not json").unwrap();
    let e = load_hf_model(tmp.path()).unwrap_err();
    assert!(matches!(e, HfConfigError::NotConfig { .. }), "{e}");
    assert!(e.to_string().contains("not JSON"), "{e}");
    std::fs::write(tmp.path().join("config.json"), "[1, 2]").unwrap();
    let e = load_hf_model(tmp.path()).unwrap_err();
    assert!(e.to_string().contains("not a JSON object"), "{e}");
    assert!(e.problems().is_empty());
}

/// transformers' Qwen3-MoE rule, written out independently.
fn qwen_moe_layers(num_layers: u32, step: u32, mlp_only: &[u32]) -> Vec<u32> {
    let mut v = Vec::new();
    for l in 0..num_layers {
        let sparse = (l + 1) % step == 0;
        if sparse && !mlp_only.contains(&l) {
            v.push(l);
        }
    }
    v
}

proptest! {
    /// Any decoder_sparse_step / mlp_only_layers pattern is either served with exactly the
    /// MoE layers transformers builds, or refused naming one of the two keys.
    #[test]
    fn qwen_layer_sets_are_exact_or_refused(
        num_layers in 1u32..40,
        step in 1u32..6,
        mlp_only in proptest::collection::vec(0u32..45, 0..5),
    ) {
        let cfg = edited("Qwen3-30B-A3B", json!({
            "num_hidden_layers": num_layers,
            "decoder_sparse_step": step,
            "mlp_only_layers": mlp_only,
        }));
        let want = qwen_moe_layers(num_layers, step, &mlp_only);
        match map(&cfg) {
            Ok(m) => prop_assert_eq!(m.moe_layer_ids(), want),
            Err(p) => {
                let s = p.join("\n");
                prop_assert!(
                    want.is_empty() || express_layers(&want, num_layers).is_none(),
                    "refused an expressible set {:?}: {}", want, s
                );
                prop_assert!(
                    s.contains("mlp_only_layers") || s.contains("decoder_sparse_step"),
                    "{}", s
                );
            }
        }
    }
}
