//! `expertmesh plan` as a user runs it: the real binary on the example clusters and real files.
//! Placements it writes must pass `expertmesh validate`; an impossible fit exits 1 naming the
//! shortfall; skewed statistics are balanced; co-selection cuts fan-out; EPLB maps round-trip;
//! bench figures replace datasheet ones; a live change from the placement served now keeps
//! every device within memory; bad input exits 2 with a message, never a panic.

use serde_json::Value;
use std::path::Path;

use crate::support::{Run, run};

fn json(r: &Run) -> Value {
    serde_json::from_str(&r.stdout).unwrap_or_else(|e| panic!("not JSON ({e}):\n{}", r.stdout))
}

fn tmp(dir: &tempfile::TempDir, name: &str) -> String {
    dir.path().join(name).display().to_string()
}

/// Kimi K2's packed expert size (g32 bf16 scales), from the design brief: 3 * 7168 * 2048
/// parameters at 4.5 bits.
const K2_EXPERT_BYTES: u64 = 3 * 7168 * 2048 * 9 / 16;

#[test]
fn kimi_k2_plans_on_both_example_clusters_and_validates() {
    let dir = tempfile::tempdir().unwrap();
    for topo in ["examples/mi300x-4x8.toml", "examples/rx7900xtx-8x4.toml"] {
        let out = tmp(&dir, "k2.placement.toml");
        let r = run(&[
            "plan",
            "--topology",
            topo,
            "--model",
            "kimi-k2",
            "--out",
            &out,
        ]);
        assert_eq!(r.code, 0, "{topo}:\n{}{}", r.stdout, r.stderr);
        for section in [
            "experts/layer",
            "every device fits",
            "expected load per device",
            "traffic per token per MoE layer",
            "decode throughput, roofline",
            "bottleneck",
            "per million tokens",
        ] {
            assert!(
                r.stdout.contains(section),
                "{topo}: no {section:?}:\n{}",
                r.stdout
            );
        }
        let v = run(&["validate", topo, "--placement", &out]);
        assert_eq!(v.code, 0, "{topo}:\n{}{}", v.stdout, v.stderr);
        assert!(v.stdout.contains("every device fits"), "{}", v.stdout);

        let r = run(&["plan", "--topology", topo, "--model", "kimi-k2", "--json"]);
        assert_eq!(r.code, 0, "{}", r.stderr);
        let j = json(&r);
        assert_eq!(j["fits"], true);
        let devices = j["memory"]["devices"].as_array().unwrap();
        assert_eq!(devices.len(), 32);
        let mut experts = 0;
        for d in devices {
            // Bytes follow from the expert count alone; every device within its budget.
            let total = d["experts_total"].as_u64().unwrap();
            assert_eq!(d["used_bytes"].as_u64().unwrap(), total * K2_EXPERT_BYTES);
            assert!(
                d["used_bytes"].as_u64() <= d["budget_bytes"].as_u64(),
                "{d}"
            );
            experts += total;
        }
        assert_eq!(
            experts,
            60 * 384,
            "every expert of every layer, no replicas"
        );
        let rf = &j["roofline"];
        assert!(rf["tokens_per_s"].as_f64().unwrap() > 0.0);
        assert!(rf["usd_per_million_tokens"].as_f64().unwrap() > 0.0);
    }
}

#[test]
fn kimi_k2_on_two_consumer_gpus_does_not_fit() {
    let r = run(&[
        "plan",
        "--topology",
        "examples/rx7900xtx-1x2.toml",
        "--model",
        "kimi-k2",
    ]);
    assert_eq!(r.code, 1, "{}{}", r.stdout, r.stderr);
    // 570.76 GB of experts against 2 x 21 GiB.
    let budget = 2.0 * 21.0 * (1u64 << 30) as f64 / 1e9;
    let need = 60.0 * 384.0 * K2_EXPERT_BYTES as f64 / 1e9;
    assert!(r.stderr.contains("needs 570.76 GB"), "{}", r.stderr);
    assert!(
        r.stderr.contains(&format!("offer {budget:.2} GB")),
        "{}",
        r.stderr
    );
    for dev in ["xtx0/gpu0", "xtx0/gpu1"] {
        let line = r.stderr.lines().find(|l| l.contains(dev)).unwrap();
        let short = need / 2.0 - budget / 2.0;
        assert!(line.contains(&format!("short by {short:.2} GB")), "{line}");
    }
    let r = run(&[
        "plan",
        "--topology",
        "examples/rx7900xtx-1x2.toml",
        "--model",
        "kimi-k2",
        "--json",
    ]);
    assert_eq!(r.code, 1);
    let j = json(&r);
    assert_eq!(j["fits"], false);
    let s = &j["shortfall"];
    assert_eq!(
        s["short_bytes"].as_u64().unwrap(),
        s["need_bytes"].as_u64().unwrap() - s["usable_bytes"].as_u64().unwrap()
    );
    assert_eq!(s["devices"].as_array().unwrap().len(), 2);
}

#[test]
fn too_many_replicas_exit_1_and_say_how_many_fit() {
    let r = run(&[
        "plan",
        "--topology",
        "examples/rx7900xtx-8x4.toml",
        "--model",
        "kimi-k2",
        "--redundant",
        "160",
    ]);
    assert_eq!(r.code, 1, "{}{}", r.stdout, r.stderr);
    assert!(
        r.stderr.contains("160 replica slots per layer"),
        "{}",
        r.stderr
    );
    assert!(r.stderr.contains("lower --redundant"), "{}", r.stderr);
}

/// Shared experts that overflow the device they are put on are named as the reason: fewer
/// replicas would not help, so the hint is to move them or raise that device's memory.
#[test]
fn shared_experts_that_overflow_their_device_are_named_not_the_replicas() {
    let dir = tempfile::tempdir().unwrap();
    let text = std::fs::read_to_string(crate::support::root().join("examples/single-host.toml"))
        .unwrap()
        .replacen("expert_memory = \"256 MiB\"", "expert_memory = \"2 MB\"", 1);
    let topo = tmp(&dir, "small-cpu0.toml");
    std::fs::write(&topo, text).unwrap();
    let r = run(&[
        "plan",
        "--topology",
        &topo,
        "--model",
        "demo-small",
        "--shared",
        "local/cpu0",
        "--redundant",
        "2",
    ]);
    assert_eq!(r.code, 1, "{}{}", r.stdout, r.stderr);
    let m = expertmesh_topology::model::preset_by_name("demo-small").unwrap();
    let shared = m.shared_experts as u64 * m.shared_expert_bytes();
    let named = format!(
        "the shared experts alone need {} on device \"local/cpu0\"",
        expertmesh_topology::units::format_bytes(shared * m.moe_layer_ids().len() as u64)
    );
    assert!(r.stderr.contains(&named), "{named}\n{}", r.stderr);
    assert!(r.stderr.contains("--shared router"), "{}", r.stderr);
    assert!(!r.stderr.contains("lower --redundant"), "{}", r.stderr);
}

#[test]
fn zipf_load_file_is_balanced_by_replication() {
    let dir = tempfile::tempdir().unwrap();
    let topo = "examples/mi300x-4x8.toml";
    // The generator writes the file; the plan then reads it back like router statistics.
    for name in ["zipf.load.csv", "zipf.load.json"] {
        let file = tmp(&dir, name);
        let r = run(&[
            "plan",
            "--topology",
            topo,
            "--model",
            "kimi-k2",
            "--synthetic-load",
            "zipf:1.1:7",
            "--write-load",
            &file,
        ]);
        assert_eq!(r.code, 0, "{}", r.stderr);
        let out = tmp(&dir, "zipf.placement.toml");
        let r = run(&[
            "plan",
            "--topology",
            topo,
            "--model",
            "kimi-k2",
            "--load",
            &file,
            "--out",
            &out,
            "--json",
        ]);
        assert_eq!(r.code, 0, "{}", r.stderr);
        let j = json(&r);
        let before = j["load"]["before"]["max_over_mean"].as_f64().unwrap();
        let after = j["load"]["after"]["max_over_mean"].as_f64().unwrap();
        assert!(before > 3.0, "Zipf 1.1 unbalanced: {before}");
        assert!(after < 1.05, "after load-aware replication: {after}");
        assert_eq!(j["redundant_per_layer"], 32);
        let v = run(&["validate", topo, "--placement", &out]);
        assert_eq!(v.code, 0, "{}{}", v.stdout, v.stderr);
        assert!(v.stdout.contains("(1920 replicas)"), "{}", v.stdout);
    }
    // The human report shows both.
    let r = run(&[
        "plan",
        "--topology",
        topo,
        "--model",
        "kimi-k2",
        "--load",
        "examples/../examples/demo-small-zipf.load.csv",
    ]);
    assert_eq!(r.code, 2, "a demo-small file for kimi-k2 is a usage error");
    assert!(
        r.stderr.contains("is not a MoE layer") || r.stderr.contains("expert"),
        "{}",
        r.stderr
    );
    let r = run(&[
        "plan",
        "--topology",
        "examples/single-host.toml",
        "--model",
        "demo-small",
        "--load",
        "examples/demo-small-zipf.load.csv",
    ]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let before = r
        .stdout
        .lines()
        .find(|l| l.contains("before (balanced"))
        .unwrap();
    let after = r
        .stdout
        .lines()
        .find(|l| l.contains("after  (this plan)"))
        .unwrap();
    let ratio = |l: &str| -> f64 {
        l.split(':')
            .nth(1)
            .unwrap()
            .split_whitespace()
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    assert!(ratio(before) > ratio(after), "{before}\n{after}");
}

#[test]
fn coselection_file_cuts_nodes_per_token() {
    let dir = tempfile::tempdir().unwrap();
    let file = tmp(&dir, "k2.coselect.csv");
    let topo = "examples/mi300x-4x8.toml";
    let r = run(&[
        "plan",
        "--topology",
        topo,
        "--model",
        "kimi-k2",
        "--synthetic-coselect",
        "clustered:16:0.85:3",
        "--write-coselect",
        &file,
    ]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let out = tmp(&dir, "local.placement.toml");
    let r = run(&[
        "plan",
        "--topology",
        topo,
        "--model",
        "kimi-k2",
        "--coselect",
        &file,
        "--out",
        &out,
        "--json",
    ]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let j = json(&r);
    assert_eq!(j["strategy"], "hierarchical-locality");
    let with = j["traffic"]["nodes_per_token"].as_f64().unwrap();
    let without = j["traffic_without_coselection_placement"]["nodes_per_token"]
        .as_f64()
        .unwrap();
    assert!(with < 0.8 * without, "{with} vs {without}");
    let bytes = j["traffic"]["network_bytes_per_token"].as_f64().unwrap();
    let dispatch = j["traffic"]["network_dispatch_bytes_per_token"]
        .as_f64()
        .unwrap();
    let result = j["traffic"]["network_result_bytes_per_token"]
        .as_f64()
        .unwrap();
    // The serving mode's wire (plan's default, as `up`'s), deduplicated per node: q8
    // activations (7168 + 896 + 2 bytes) out and one pre-combined bf16 row (14336 bytes) back
    // per remote node touched.
    assert!((bytes - dispatch - result).abs() < 1e-6 * bytes, "{bytes}");
    let rows = result / dispatch;
    assert!(rows > 1.7 && rows < 1.8, "{dispatch} {result}");
    assert_eq!(j["traffic"]["wire"]["mode"], "serving");
    assert!(j["load"]["after"]["max_over_mean"].as_f64().unwrap() < 1.25);
    let v = run(&["validate", topo, "--placement", &out]);
    assert_eq!(v.code, 0, "{}{}", v.stdout, v.stderr);
}

#[test]
fn eplb_maps_round_trip_and_duplicates_merge() {
    let dir = tempfile::tempdir().unwrap();
    let topo = "examples/rx7900xtx-8x4.toml";
    let (map, a, b) = (
        tmp(&dir, "map.json"),
        tmp(&dir, "a.toml"),
        tmp(&dir, "b.toml"),
    );
    let r = run(&[
        "plan",
        "--topology",
        topo,
        "--model",
        "kimi-k2",
        "--synthetic-load",
        "zipf:1.0",
        "--export-eplb",
        &map,
        "--out",
        &a,
    ]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let m: Value = serde_json::from_str(&std::fs::read_to_string(&map).unwrap()).unwrap();
    let rows = m["physical_to_logical_map"].as_array().unwrap();
    assert_eq!(rows.len(), 61, "SGLang rows: every layer");
    assert_eq!(rows[1].as_array().unwrap().len(), 384 + 32);
    let r = run(&[
        "plan",
        "--topology",
        topo,
        "--model",
        "kimi-k2",
        "--import-eplb",
        &map,
        "--out",
        &b,
    ]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let body = |p: &str| -> Vec<String> {
        std::fs::read_to_string(p)
            .unwrap()
            .lines()
            .filter(|l| !l.starts_with('#') && !l.starts_with("description"))
            .map(str::to_owned)
            .collect()
    };
    assert_eq!(body(&a), body(&b));
    let v = run(&["validate", topo, "--placement", &b]);
    assert_eq!(v.code, 0, "{}{}", v.stdout, v.stderr);

    // Two replicas of one expert on one device (DeepSeek EPLB allows it): merged, warned.
    let dup = tmp(&dir, "dup.json");
    let rows: Vec<String> = (0..4)
        .map(|_| {
            let mut slots: Vec<u32> = (0..32).collect();
            // 36 slots, 18 per device: device 1 holds 18-31, 0, 0, 1, 2 (expert 0 twice).
            slots.extend([0, 0, 1, 2]);
            format!("{:?}", slots)
        })
        .collect();
    std::fs::write(&dup, format!("{{\"phy2log\": [{}]}}", rows.join(","))).unwrap();
    let out = tmp(&dir, "dup.toml");
    let r = run(&[
        "plan",
        "--topology",
        "examples/single-host.toml",
        "--model",
        "demo-small",
        "--import-eplb",
        &dup,
        "--out",
        &out,
    ]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(
        r.stderr.contains("warning:") && r.stderr.contains("merged"),
        "{}",
        r.stderr
    );
    let v = run(&["validate", "examples/single-host.toml", "--placement", &out]);
    assert_eq!(v.code, 0, "{}{}", v.stdout, v.stderr);
}

#[test]
fn calibration_replaces_datasheet_bandwidth() {
    let dir = tempfile::tempdir().unwrap();
    let bench = tmp(&dir, "kernels.json");
    // Half the MI300X datasheet bandwidth, measured on GPUs at batch 64 for Kimi K2's expert
    // shape.
    std::fs::write(
        &bench,
        r#"{"machine": {"cpu": "test", "device_kind": "gpu"}, "results": [
            {"name": "decode-exact kimi-k2 H7168 F2048", "batch": 64, "achieved": 2650.0,
             "limit": 5300.0, "unit": "GB/s", "ratio": 0.5},
            {"name": "prefill-exact kimi-k2 H7168 F2048", "batch": 256, "achieved": 100.0,
             "limit": 200.0, "unit": "TOPS", "ratio": 0.5}
        ]}"#,
    )
    .unwrap();
    let args = |cal: bool| {
        let mut a = vec![
            "plan",
            "--topology",
            "examples/mi300x-4x8.toml",
            "--model",
            "kimi-k2",
            "--batch",
            "256",
            "--json",
        ];
        if cal {
            a.extend(["--calibrate", bench.as_str()]);
        }
        run(&a)
    };
    let (plain, cal) = (args(false), args(true));
    assert_eq!(cal.code, 0, "{}", cal.stderr);
    let (p, c) = (json(&plain), json(&cal));
    assert_eq!(p["roofline"]["bottleneck"], "memory");
    let mem = |j: &Value| j["roofline"]["terms"]["memory_ms"].as_f64().unwrap();
    // Memory time scales with 1 / bandwidth.
    assert!(
        (mem(&c) / mem(&p) - 2.0).abs() < 1e-9,
        "{} {}",
        mem(&c),
        mem(&p)
    );
    let figures = c["figures"].to_string();
    assert!(
        figures.contains("bench: decode-exact kimi-k2 H7168 F2048 (batch 64)"),
        "{figures}"
    );
}

/// A kernels.json as `bench kernels` writes it on a CPU (11 GB/s), as the examples README uses.
const CPU_KERNELS: &str = r#"{"machine": {"device_kind": "cpu", "backend": "cpu-avx2x2"},
    "results": [
        {"name": "decode-exact kimi-k2 H7168 F2048", "batch": 64, "achieved": 11.0,
         "limit": 12.0, "unit": "GB/s", "ratio": 0.9, "better": "higher"},
        {"name": "decode-exact demo-small H1024 F512", "batch": 64, "achieved": 11.0,
         "limit": 12.0, "unit": "GB/s", "ratio": 0.9, "better": "higher"}
    ]}"#;

#[test]
fn a_cpu_calibration_changes_only_cpu_devices_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let bench = tmp(&dir, "kernels.json");
    std::fs::write(&bench, CPU_KERNELS).unwrap();
    // An older file without machine.device_kind is taken as a CPU run too.
    let old = tmp(&dir, "old-kernels.json");
    std::fs::write(
        &old,
        CPU_KERNELS.replace(
            r#""device_kind": "cpu", "backend": "cpu-avx2x2""#,
            r#""cpus": 2"#,
        ),
    )
    .unwrap();
    let plan = |topo: &str, model: &str, extra: &[&str]| {
        let mut a = vec!["plan", "--topology", topo, "--model", model];
        a.extend(extra);
        let r = run(&a);
        assert_eq!(r.code, 0, "{a:?}: {}", r.stderr);
        r
    };
    let mi300x = "examples/mi300x-4x8.toml";
    let plain = json(&plan(mi300x, "kimi-k2", &["--json"]));
    for file in [&bench, &old] {
        let cal = json(&plan(mi300x, "kimi-k2", &["--json", "--calibrate", file]));
        // The MI300X cluster keeps its HBM figures: same throughput as without calibration.
        assert_eq!(cal["roofline"], plain["roofline"], "{file}");
        let c = &cal["calibration"];
        assert_eq!(c["changed"].as_array().unwrap().len(), 0, "{c}");
        let mem = c["left_alone"]
            .as_array()
            .unwrap()
            .iter()
            .find(|i| i["figure"] == "memory bandwidth")
            .unwrap_or_else(|| panic!("no memory bandwidth left alone: {c}"));
        assert_eq!(mem["value"], 5300.0);
        assert_eq!(mem["applies_to"], "32 gpu devices of type mi300x");
        assert!(
            mem["why"]
                .as_str()
                .unwrap()
                .contains("measured cpu devices"),
            "{mem}"
        );
    }
    let text = plan(mi300x, "kimi-k2", &["--calibrate", &bench]).stdout;
    for want in [
        "calibration (--calibrate):",
        "changed: nothing",
        "left alone: memory bandwidth for 32 gpu devices of type mi300x: 5300 GB/s",
        "left alone: network bandwidth per roce NIC for 32 roce NICs on 4 nodes: 50 GB/s",
    ] {
        assert!(text.contains(want), "want {want:?} in\n{text}");
    }
    // On CPU workers the same file applies, and the report says from what to what.
    let single = "examples/single-host.toml";
    let cal = json(&plan(
        single,
        "demo-small",
        &["--json", "--calibrate", &bench],
    ));
    let changed = &cal["calibration"]["changed"][0];
    assert_eq!(changed["figure"], "memory bandwidth", "{cal}");
    assert_eq!(
        (changed["was"].as_f64(), changed["value"].as_f64()),
        (Some(20.0), Some(11.0))
    );
    let text = plan(single, "demo-small", &["--calibrate", &bench]).stdout;
    assert!(
        text.contains("changed: memory bandwidth for 2 cpu devices (arch cpu): local/cpu0, local/cpu1: 20 -> 11 GB/s"),
        "{text}"
    );
    // Without --calibrate there is no calibration section.
    assert!(plain["calibration"].is_null());
}

#[test]
fn concurrency_hides_latency() {
    let tps = |c: &str| {
        let r = run(&[
            "plan",
            "--topology",
            "examples/mi300x-4x8.toml",
            "--model",
            "kimi-k2",
            "--batch",
            "1",
            "--concurrency",
            c,
            "--json",
        ]);
        assert_eq!(r.code, 0, "{}", r.stderr);
        let j = json(&r);
        assert_eq!(
            j["roofline"]["concurrency"].as_u64().unwrap().to_string(),
            c
        );
        j["roofline"]["tokens_per_s"].as_f64().unwrap()
    };
    // Batch 1 is latency-bound: four calls in flight overlap their hops.
    let (one, four) = (tps("1"), tps("4"));
    assert!(four > 3.0 * one, "{one} {four}");
}

#[test]
fn bad_input_exits_2_with_a_message() {
    let dir = tempfile::tempdir().unwrap();
    let bad_csv = tmp(&dir, "bad.csv");
    std::fs::write(&bad_csv, "layer,expert,tokens\n1,5,12\n1,x,3\n").unwrap();
    let bad_json = tmp(&dir, "bad.json");
    std::fs::write(&bad_json, "{\"layers\": [{\"layer\": 1, \"counts\": [1, 2,").unwrap();
    let base = [
        "plan",
        "--topology",
        "examples/mi300x-4x8.toml",
        "--model",
        "kimi-k2",
    ];
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["--load", &bad_csv],
            "bad.csv: 3:3: expert \"x\" is not an integer",
        ),
        (vec!["--load", &bad_json], "bad.json: 1:"),
        (
            vec!["--load", "/nonexistent/load.csv"],
            "cannot read /nonexistent/load.csv",
        ),
        (vec!["--coselect", &bad_csv], "expected the header line"),
        (
            vec!["--synthetic-load", "pareto:2"],
            "expected zipf:EXPONENT",
        ),
        (vec!["--synthetic-coselect", "clustered:0:0.5"], "CLUSTERS"),
        (
            vec!["--shared", "node9/gpu0"],
            "unknown device \"node9/gpu0\"",
        ),
        (vec!["--calibrate", &bad_json], "not a bench JSON file"),
        (vec!["--import-eplb", &bad_csv], "not JSON"),
        (vec!["--batch", "0"], "at least 1"),
        (vec!["--redundant", "99999"], "more replicas than"),
    ];
    for (extra, want) in cases {
        let mut args: Vec<&str> = base.to_vec();
        args.extend(extra.iter().copied());
        let r = run(&args);
        assert_eq!(r.code, 2, "{extra:?}:\n{}{}", r.stdout, r.stderr);
        assert!(
            r.stderr.contains(want),
            "{extra:?}: want {want:?} in\n{}",
            r.stderr
        );
    }
    let r = run(&[
        "plan",
        "--topology",
        "tests/data/broken-topology.toml",
        "--model",
        "kimi-k2",
    ]);
    assert_eq!(r.code, 2);
    assert!(r.stderr.contains("expertmesh validate"), "{}", r.stderr);
    let r = run(&[
        "plan",
        "--topology",
        "examples/mi300x-4x8.toml",
        "--model",
        "kimi-k3",
    ]);
    assert_eq!(r.code, 2);
    assert!(
        r.stderr.contains("did you mean \"kimi-k2\""),
        "{}",
        r.stderr
    );
    let r = run(&["plan", "--topology", "examples/mi300x-4x8.toml"]);
    assert_eq!(r.code, 2, "missing --model is a usage error");
    // Nothing written on failure.
    assert!(!Path::new(&tmp(&dir, "never.toml")).exists());
}

/// `--from`: the order of a live change from a served placement to a Zipf-balanced one. Every
/// expert the new placement adds to a device is loaded, fewer are added than by the same plan
/// made from scratch, no device's peak passes its room, the same plan from its own output
/// moves nothing, and a placement of another model is a usage error.
#[test]
fn a_live_change_from_the_served_placement_stays_within_memory() {
    use expertmesh_topology::{Placement, Topology, model::preset_by_name};
    let dir = tempfile::tempdir().unwrap();
    let topo = "examples/single-host.toml";
    let (old, new) = (tmp(&dir, "old.toml"), tmp(&dir, "new.toml"));
    let r = run(&[
        "plan",
        "--topology",
        topo,
        "--model",
        "demo-small",
        "--out",
        &old,
    ]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let zipf_from = |from: &str, out: &str| -> Vec<String> {
        let args = ["plan", "--topology", topo, "--model", "demo-small"];
        let more = [
            "--synthetic-load",
            "zipf:1.2:3",
            "--from",
            from,
            "--out",
            out,
        ];
        args.iter().chain(&more).map(|s| s.to_string()).collect()
    };
    let args = zipf_from(&old, &new);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let r = run(&[&args[..], &["--json"]].concat());
    assert_eq!(r.code, 0, "{}", r.stderr);
    let live = &json(&r)["live_change"];
    assert_eq!(live["possible"], true, "{live}");
    // Expert loads the change needs at least: what each device gains, from the two files.
    let (t, m) = (
        Topology::load(Path::new(topo)).unwrap(),
        preset_by_name("demo-small").unwrap(),
    );
    let (po, pn) = (
        Placement::load(Path::new(&old), &t, &m).unwrap(),
        Placement::load(Path::new(&new), &t, &m).unwrap(),
    );
    // Experts a placement gives a device that `po` does not.
    let gains_over_old = |p: &Placement| -> usize {
        let pairs = po
            .layers()
            .iter()
            .flat_map(|&l| t.devices().iter().map(move |d| (l, d.rank())));
        pairs
            .map(|(l, r)| {
                p.experts_on(r, l)
                    .iter()
                    .filter(|e| !po.experts_on(r, l).contains(e))
                    .count()
            })
            .sum()
    };
    let gains = gains_over_old(&pn);
    assert!(gains > 0, "the Zipf plan differs from the uniform one");
    assert!(
        live["loads"].as_u64().unwrap() >= gains as u64,
        "{live} vs {gains} gains"
    );
    // Fewer than the same plan made without --from would move.
    let scratch = tmp(&dir, "scratch.toml");
    let r = run(&[
        "plan",
        "--topology",
        topo,
        "--model",
        "demo-small",
        "--synthetic-load",
        "zipf:1.2:3",
        "--out",
        &scratch,
    ]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let ps = Placement::load(Path::new(&scratch), &t, &m).unwrap();
    let scratch_gains = gains_over_old(&ps);
    assert!(
        gains < scratch_gains,
        "{gains} gains kept in place vs {scratch_gains} from scratch"
    );
    assert!(live["steps"].as_u64().unwrap() >= 1, "{live}");
    let (peak, slots) = (
        live["peak_slots"].as_array().unwrap(),
        live["slots"].as_array().unwrap(),
    );
    assert_eq!(peak.len(), t.devices().len());
    for (p, s) in peak.iter().zip(slots) {
        assert!(p.as_u64().unwrap() <= s.as_u64().unwrap(), "{live}");
    }
    let r = run(&args);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(r.stdout.contains("live change from"), "{}", r.stdout);
    // The same plan again, from what it wrote: it keeps every expert in place.
    let again = tmp(&dir, "again.toml");
    let again_args = zipf_from(&new, &again);
    let again_args: Vec<&str> = again_args.iter().map(String::as_str).collect();
    let r = run(&[&again_args[..], &["--json"]].concat());
    assert_eq!(r.code, 0, "{}", r.stderr);
    let live = &json(&r)["live_change"];
    assert_eq!(
        (live["loads"].as_u64(), live["steps"].as_u64()),
        (Some(0), Some(0)),
        "{live}"
    );
    // With no balance slack, keeping in place leaves the busiest device as the plan has it
    // (per layer, within rounding), and a negative slack is a usage error.
    let balance = |extra: &[&str]| -> f64 {
        let args = ["plan", "--topology", topo, "--model", "demo-small"];
        let r = run(&[
            &args[..],
            &["--synthetic-load", "zipf:1.2:3", "--json"],
            extra,
        ]
        .concat());
        assert_eq!(r.code, 0, "{}", r.stderr);
        json(&r)["load"]["after"]["max_over_mean"].as_f64().unwrap()
    };
    let (plain, strict) = (
        balance(&[]),
        balance(&["--from", &old, "--move-slack", "0"]),
    );
    assert!(
        strict <= plain * (1.0 + 1e-9),
        "{strict} vs the plan's {plain}"
    );
    let r = run(&[
        "plan",
        "--topology",
        topo,
        "--model",
        "demo-small",
        "--move-slack=-1",
    ]);
    assert_eq!(r.code, 2, "{}", r.stdout);
    assert!(r.stderr.contains("--move-slack"), "{}", r.stderr);
    // A placement of another model is refused with the option's name.
    let r = run(&[
        "plan",
        "--topology",
        topo,
        "--model",
        "toy-mixtral",
        "--from",
        &old,
    ]);
    assert_eq!(r.code, 2, "{}{}", r.stdout, r.stderr);
    assert!(r.stderr.contains("--from"), "{}", r.stderr);
}
