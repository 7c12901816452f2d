//! `expertmesh models --from-hf DIR [--toml]` as a user runs it: the real binary on the
//! published configs under `checkpoint/tests/data/hf/`. Exit 0 with the same output as for the
//! matching preset; exit 1 naming the key when a config cannot be served exactly; exit 2 when
//! `config.json` is missing or not JSON.

use crate::support::run;

const HF: &str = "checkpoint/tests/data/hf";

fn dir(name: &str) -> String {
    format!("{HF}/{name}")
}

#[test]
fn a_published_config_prints_like_its_preset() {
    for (folder, preset) in [
        ("Kimi-K2-Instruct", "kimi-k2"),
        ("DeepSeek-V3", "deepseek-v3"),
        ("Qwen3-30B-A3B", "qwen3-30b-a3b"),
        ("Mixtral-8x7B-v0.1", "mixtral-8x7b"),
        ("OLMoE-1B-7B-0924", "olmoe-1b-7b"),
    ] {
        let r = run(&["models", "--from-hf", &dir(folder)]);
        assert_eq!(r.code, 0, "{folder}: {}", r.stderr);
        let p = run(&["models", preset]);
        assert_eq!(p.code, 0);
        // Everything after the title line (name — description) is the same.
        let body = |s: &str| s.lines().skip(1).collect::<Vec<_>>().join("\n");
        assert_eq!(body(&r.stdout), body(&p.stdout), "{folder} vs {preset}");
        assert!(
            r.stdout.starts_with(&format!("{folder} — ")),
            "{}",
            r.stdout
        );
    }
    let r = run(&["models", "--from-hf", &dir("DeepSeek-V3")]);
    assert!(r.stdout.contains("61 (58 MoE: 3-60)"), "{}", r.stdout);
    assert!(r.stdout.contains("8 groups, keep 4"), "{}", r.stdout);
}

#[test]
fn toml_output_is_a_model_file_that_validates() {
    let r = run(&["models", "--from-hf", &dir("GLM-4.5-Air"), "--toml"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    for want in [
        "name = \"GLM-4.5-Air\"\n",
        "num_layers = 46\n",
        "first_dense_layers = 1\n",
        "routed_experts = 128\n",
        "moe_intermediate = 1408\n",
        "shared_experts = 1\n",
        "shared_intermediate = 1408\n",
        "scoring = \"sigmoid-bias\"\n",
        "group_size = 32\n",
        "scale_dtype = \"bf16\"\n",
    ] {
        assert!(r.stdout.contains(want), "want {want:?} in\n{}", r.stdout);
    }
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("glm-air.toml");
    std::fs::write(&file, &r.stdout).unwrap();
    let v = run(&["models", file.to_str().unwrap()]);
    assert_eq!(v.code, 0, "{}", v.stderr);
    assert!(v.stdout.contains("46 (45 MoE: 1-45)"), "{}", v.stdout);
    // Same TOML as the preset for a config that matches one, but for name and description.
    let r = run(&["models", "--from-hf", &dir("Kimi-K2-Instruct"), "--toml"]);
    let p = run(&["models", "kimi-k2", "--toml"]);
    let math = |s: &str| {
        s.lines()
            .filter(|l| !l.starts_with("name") && !l.starts_with("description"))
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    assert_eq!(math(&r.stdout), math(&p.stdout));
}

#[test]
fn configs_that_cannot_be_served_exactly_exit_1_naming_the_key() {
    let cases = [(
        "gpt-oss-120b",
        &["model_type = \"gpt_oss\"", "not supported"][..],
    )];
    for (folder, wants) in cases {
        let r = run(&["models", "--from-hf", &dir(folder)]);
        assert_eq!(r.code, 1, "{folder}: {}{}", r.stdout, r.stderr);
        assert!(r.stdout.is_empty(), "{}", r.stdout);
        assert!(r.stderr.contains("config.json: "), "{}", r.stderr);
        for want in wants {
            assert!(
                r.stderr.contains(want),
                "{folder}: want {want:?} in {}",
                r.stderr
            );
        }
    }
    // An edited config: a trailing dense layer in Qwen3.
    let tmp = tempfile::tempdir().unwrap();
    let text = std::fs::read_to_string(format!("{HF}/Qwen3-30B-A3B/config.json")).unwrap();
    let text = text.replace("\"mlp_only_layers\": []", "\"mlp_only_layers\": [47]");
    std::fs::write(tmp.path().join("config.json"), text).unwrap();
    let r = run(&["models", "--from-hf", tmp.path().to_str().unwrap()]);
    assert_eq!(r.code, 1, "{}", r.stderr);
    assert!(r.stderr.contains("mlp_only_layers = [47]"), "{}", r.stderr);
}

#[test]
fn missing_or_broken_config_exits_2() {
    let tmp = tempfile::tempdir().unwrap();
    let r = run(&["models", "--from-hf", tmp.path().to_str().unwrap()]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(r.stderr.starts_with("error: cannot read "), "{}", r.stderr);
    assert!(r.stderr.contains("config.json"), "{}", r.stderr);
    std::fs::write(tmp.path().join("config.json"), "{\"model_type\": ").unwrap();
    let r = run(&["models", "--from-hf", tmp.path().to_str().unwrap()]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(r.stderr.contains("not JSON"), "{}", r.stderr);
    // --from-hf and a model name together, or --toml alone: usage errors.
    let r = run(&["models", "kimi-k2", "--from-hf", &dir("DeepSeek-V3")]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    let r = run(&["models", "--toml"]);
    assert_eq!(r.code, 2, "{}", r.stderr);
}
