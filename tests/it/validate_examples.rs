//! The real `expertmesh` binary on real files: every file in `examples/` validates (exit 0), the
//! deliberately broken files in `tests/data/` are rejected with every problem listed (exit 1),
//! and unreadable files or bad arguments are usage errors (exit 2) — never a panic or backtrace.

use crate::support::root;
use expertmesh_topology::PlacementFile;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn expertmesh(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_expertmesh"))
        .args(args)
        .current_dir(root())
        // A backtrace would show up in stderr if anything panicked.
        .env("RUST_BACKTRACE", "1")
        .output()
        .expect("run expertmesh")
}

struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

fn run(args: &[&str]) -> Run {
    let o = expertmesh(args);
    let r = Run {
        code: o.status.code().expect("exited normally, not by a signal"),
        stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
    };
    for bad in ["panicked", "stack backtrace", "RUST_BACKTRACE"] {
        assert!(
            !r.stderr.contains(bad) && !r.stdout.contains(bad),
            "{args:?} printed {bad:?}:\n{}{}",
            r.stdout,
            r.stderr
        );
    }
    r
}

fn example_files() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(root().join("examples"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "toml"))
        .collect();
    files.sort();
    files
}

fn rel(p: &Path) -> String {
    p.strip_prefix(root()).unwrap().display().to_string()
}

#[test]
fn every_example_file_validates() {
    let files = example_files();
    let (mut topologies, mut placements, mut models) = (0, 0, 0);
    for f in &files {
        let name = f.file_name().unwrap().to_str().unwrap();
        let path = rel(f);
        if name.ends_with(".placement.toml") {
            // The placement names its cluster; the topology file is examples/CLUSTER.toml.
            let text = std::fs::read_to_string(f).unwrap();
            let file =
                PlacementFile::from_toml_str(&text).unwrap_or_else(|p| panic!("{path}: {p:?}"));
            let topo = format!("examples/{}.toml", file.cluster_name());
            assert!(
                root().join(&topo).exists(),
                "{path} is for cluster {} but {topo} does not exist",
                file.cluster_name()
            );
            for args in [
                vec!["validate", topo.as_str(), "--placement", path.as_str()],
                vec![
                    "validate",
                    topo.as_str(),
                    "--placement",
                    path.as_str(),
                    "--model",
                    file.model_name(),
                ],
            ] {
                let r = run(&args);
                assert_eq!(r.code, 0, "{args:?}:\n{}{}", r.stdout, r.stderr);
                assert!(r.stdout.contains("every device fits"), "{}", r.stdout);
                assert!(r.stdout.trim_end().ends_with("valid"), "{}", r.stdout);
            }
            placements += 1;
        } else if name.ends_with(".model.toml") {
            let r = run(&["models", &path]);
            assert_eq!(r.code, 0, "{path}:\n{}", r.stderr);
            let r = run(&["validate", "examples/mi300x-4x8.toml", "--model", &path]);
            assert_eq!(r.code, 0, "{path}:\n{}{}", r.stdout, r.stderr);
            models += 1;
        } else {
            let r = run(&["validate", &path]);
            assert_eq!(r.code, 0, "{path}:\n{}{}", r.stdout, r.stderr);
            assert!(r.stdout.trim_end().ends_with("valid"), "{}", r.stdout);
            assert!(r.stderr.is_empty(), "{}", r.stderr);
            topologies += 1;
        }
    }
    // The files the design asks for are all there.
    assert!(
        topologies >= 4 && placements >= 2 && models >= 1,
        "{files:?}"
    );
    for required in [
        "single-host.toml",
        "single-host-demo-small.placement.toml",
        "mi300x-4x8.toml",
        "mi300x-4x8-kimi-k2.placement.toml",
        "rx7900xtx-8x4.toml",
        "mi210-4x4.toml",
    ] {
        assert!(
            root().join("examples").join(required).exists(),
            "{required}"
        );
    }
}

#[test]
fn summary_table_reports_devices_memory_and_fit() {
    let r = run(&[
        "validate",
        "examples/mi300x-4x8.toml",
        "--placement",
        "examples/mi300x-4x8-kimi-k2.placement.toml",
    ]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(
        r.stdout
            .contains("4 nodes, 32 devices (32 gpu), expert memory 5120.00 GB in total"),
        "{}",
        r.stdout
    );
    // rank 0 holds 12 experts + 1 replica in each of 60 layers: 13 x 60 x 24,772,608 B.
    let row = r.stdout.lines().find(|l| l.contains("node0/gpu0")).unwrap();
    let cells: Vec<&str> = row.split_whitespace().collect();
    assert_eq!(cells[0], "0", "{row}");
    assert!(cells.contains(&"13"), "{row}");
    assert!(
        row.contains(&format!("{:.2} GB", 13.0 * 60.0 * 24_772_608.0 / 1e9)),
        "{row}"
    );
    assert!(row.trim_end().ends_with("ok"), "{row}");
    assert!(
        r.stdout.contains("routed experts 570.76 GB"),
        "{}",
        r.stdout
    );
}

#[test]
fn broken_topology_lists_every_problem() {
    let r = run(&["validate", "tests/data/broken-topology.toml"]);
    assert_eq!(r.code, 1, "{}{}", r.stdout, r.stderr);
    assert!(r.stdout.is_empty(), "{}", r.stdout);
    let p = "tests/data/broken-topology.toml";
    for needle in [
        format!("{p}:6:8: [router]: unknown node \"nod0\"; did you mean \"node0\"?"),
        format!("{p}:9:1: device type \"mi300x\": missing `memory_bandwidth_gb_s`"),
        format!(
            "{p}:13:1: device type \"mi300x\": unknown key \"memory_bandwith_gb_s\"; did you mean \"memory_bandwidth_gb_s\"?"
        ),
        format!("{p}:17:1: node \"node0\": missing `address`"),
        format!("{p}:19:1: node \"node0\": unknown key \"adress\"; did you mean \"address\"?"),
        format!("{p}:22:14: node \"node0\": intra_link \"nvlink\" is not one of"),
        format!(
            "{p}:25:80: node \"node0\" NIC \"mlx5_0\": gid_ipv4 \"10.1.0.300\" is not an IPv4 address"
        ),
        format!(
            "{p}:30:27: node \"node0\" device \"gpu1\": unknown device type \"mi300\"; did you mean \"mi300x\"?"
        ),
        format!(
            "{p}:31:43: node \"node0\" device \"gpu2\": unknown NIC \"mlx5_2\"; did you mean \"mlx5_0\"?"
        ),
        format!("{p}:31:69: node \"node0\" device \"gpu2\": expert_memory: unknown unit \"GiBs\""),
        format!("{p}:32:3: node \"node0\" device \"cpu0\": missing `threads`"),
        format!("{p}:32:3: node \"node0\" device \"cpu0\": missing `nic`; this node has 2 NICs"),
    ] {
        assert!(
            r.stderr.contains(&needle),
            "missing {needle:?} in\n{}",
            r.stderr
        );
    }
    assert!(
        r.stderr.contains("invalid: 12 problems found"),
        "{}",
        r.stderr
    );
}

#[test]
fn syntax_and_type_errors_carry_line_and_column() {
    let r = run(&["validate", "tests/data/syntax-error.toml"]);
    assert_eq!(r.code, 1);
    assert!(
        r.stderr
            .starts_with("tests/data/syntax-error.toml:4:29: TOML syntax error:"),
        "{}",
        r.stderr
    );
    let r = run(&["validate", "tests/data/type-error.toml"]);
    assert_eq!(r.code, 1);
    assert!(
        r.stderr.starts_with(
            "tests/data/type-error.toml:9:13: node \"n0\": `data_port`: wrong type: string \"7200\", expected an integer"
        ),
        "{}",
        r.stderr
    );
}

#[test]
fn broken_placement_lists_parse_and_cross_check_problems_together() {
    let r = run(&[
        "validate",
        "examples/single-host.toml",
        "--placement",
        "tests/data/broken-placement.toml",
    ]);
    assert_eq!(r.code, 1, "{}{}", r.stdout, r.stderr);
    let p = "tests/data/broken-placement.toml";
    for needle in [
        format!(
            "{p}:8:10: assignment #1: unknown device \"local/cpu2\"; did you mean \"local/cpu0\"?"
        ),
        format!("{p}:14:11: assignment #2: expert 32 does not exist; demo-small has experts 0-31"),
        format!(
            "{p}:19:11: assignment #3: experts 20,21 in layers 1,2 are already on device \"local/cpu1\" (by assignment #2)"
        ),
        format!("{p}:21:1: assignment #4: missing `experts`"),
        format!("{p}:24:1: assignment #4: unknown key \"expert\"; did you mean \"experts\"?"),
        format!("{p}: layers 0-3: experts 0-15 have no owner; assign them to a device"),
        format!("{p}: layers 0-3: no location for the shared expert(s) of demo-small"),
    ] {
        assert!(
            r.stderr.contains(&needle),
            "missing {needle:?} in\n{}",
            r.stderr
        );
    }
    assert!(
        r.stderr.contains("invalid: 7 problems found"),
        "{}",
        r.stderr
    );
}

#[test]
fn over_budget_names_device_need_and_shortfall() {
    let r = run(&[
        "validate",
        "tests/data/tiny-budget.toml",
        "--placement",
        "examples/single-host-demo-small.placement.toml",
    ]);
    assert_eq!(r.code, 1, "{}{}", r.stdout, r.stderr);
    assert!(
        r.stderr.contains(
            "device \"local/cpu0\" (rank 0): experts need 70.78 MB (80 routed experts x 0.88 MB) but expert_memory is 50.00 MB; short by 20.78 MB"
        ),
        "{}",
        r.stderr
    );
}

#[test]
fn model_that_cannot_fit_the_cluster_is_invalid() {
    let r = run(&[
        "validate",
        "examples/single-host.toml",
        "--model",
        "kimi-k2",
    ]);
    assert_eq!(r.code, 1, "{}{}", r.stdout, r.stderr);
    assert!(
        r.stderr.contains("model \"kimi-k2\" needs 570.76 GB for its routed experts but the 2 devices offer 536.87 MB"),
        "{}",
        r.stderr
    );
}

#[test]
fn broken_model_file_lists_every_problem() {
    let r = run(&[
        "validate",
        "examples/single-host.toml",
        "--model",
        "tests/data/broken-model.toml",
    ]);
    assert_eq!(r.code, 1, "{}{}", r.stdout, r.stderr);
    let p = "tests/data/broken-model.toml";
    for needle in [
        format!(
            "{p}:5:10: model \"broken-model\": hidden (1000) must be a positive multiple of 32"
        ),
        format!(
            "{p}:7:9: model \"broken-model\": top_k (9) must be between 1 and routed_experts (8)"
        ),
        format!("{p}:9:11: model \"broken-model\": scoring \"softmx\" is not one of"),
        format!(
            "{p}:10:1: top level: unknown key \"routed_scaling\"; did you mean \"routed_scaling_factor\"?"
        ),
    ] {
        assert!(
            r.stderr.contains(&needle),
            "missing {needle:?} in\n{}",
            r.stderr
        );
    }
    // `models FILE` validates the same way.
    let r = run(&["models", "tests/data/broken-model.toml"]);
    assert_eq!(r.code, 1);
    assert!(r.stderr.contains("top_k (9)"), "{}", r.stderr);
}

#[test]
fn usage_and_io_errors_exit_2() {
    for args in [
        vec!["validate", "examples/does-not-exist.toml"],
        vec![
            "validate",
            "examples/single-host.toml",
            "--model",
            "kimi-k3",
        ],
        vec![
            "validate",
            "examples/single-host.toml",
            "--model",
            "no/such/model.toml",
        ],
        vec![
            "validate",
            "examples/single-host.toml",
            "--placement",
            "no-such-placement.toml",
        ],
        vec!["validate"],
        vec!["validate", "a.toml", "--bogus"],
        vec!["models", "kimi-k3"],
    ] {
        let r = run(&args);
        assert_eq!(r.code, 2, "{args:?}:\n{}{}", r.stdout, r.stderr);
        assert!(!r.stderr.is_empty(), "{args:?}");
    }
    let r = run(&["validate", "examples/does-not-exist.toml"]);
    assert!(
        r.stderr
            .contains("cannot read examples/does-not-exist.toml"),
        "{}",
        r.stderr
    );
    let r = run(&["models", "kimi-k3"]);
    assert!(
        r.stderr.contains("did you mean \"kimi-k2\"?"),
        "{}",
        r.stderr
    );
}

#[test]
fn placement_for_a_non_preset_model_needs_model() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("p.toml");
    let text =
        std::fs::read_to_string(root().join("examples/single-host-demo-small.placement.toml"))
            .unwrap()
            .replace("model = \"demo-small\"", "model = \"my-model\"");
    std::fs::write(&path, text).unwrap();
    let r = run(&[
        "validate",
        "examples/single-host.toml",
        "--placement",
        path.to_str().unwrap(),
    ]);
    assert_eq!(r.code, 2, "{}{}", r.stdout, r.stderr);
    assert!(
        r.stderr
            .contains("is for model \"my-model\", which is not a built-in preset; pass --model"),
        "{}",
        r.stderr
    );
}

#[test]
fn models_lists_presets_and_writes_usable_model_files() {
    let r = run(&["models"]);
    assert_eq!(r.code, 0);
    for name in [
        "kimi-k2",
        "deepseek-v3",
        "qwen3-235b-a22b",
        "qwen3-30b-a3b",
        "mixtral-8x7b",
        "mixtral-8x22b",
        "glm-4.5",
        "gpt-oss-120b",
        "olmoe-1b-7b",
        "demo-small",
    ] {
        assert!(
            r.stdout.lines().any(|l| l.starts_with(&format!("{name} "))),
            "{name} missing:\n{}",
            r.stdout
        );
    }
    // A preset written as a model file is accepted wherever a model is asked for.
    let r = run(&["models", "qwen3-30b-a3b", "--toml"]);
    assert_eq!(r.code, 0);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("qwen.toml");
    std::fs::write(&path, &r.stdout).unwrap();
    let from_file = run(&[
        "validate",
        "examples/mi210-4x4.toml",
        "--model",
        path.to_str().unwrap(),
    ]);
    let from_preset = run(&[
        "validate",
        "examples/mi210-4x4.toml",
        "--model",
        "qwen3-30b-a3b",
    ]);
    assert_eq!(from_file.code, 0, "{}", from_file.stderr);
    assert_eq!(from_file.stdout, from_preset.stdout);
}
