//! The real `expertmesh` binary on files a first-time user got wrong (issue 14, part A): byte
//! totals past 64 bits, sockets reached twice under different spellings, a model file named like
//! a preset, ports without line:column or out of range, follow-on problems, a file of the wrong
//! kind, a misspelled keyword, huge files, and sizes shown in the units they were written in.
//! Exit codes: 0 valid, 1 invalid, 2 usage or I/O.

use std::time::Duration;

use crate::support::{Run, root, run, run_cpu_time};

/// Exit 1 with exactly these problems (each line contains its needle), in this order.
fn invalid_with(args: &[&str], needles: &[&str]) -> Run {
    let r = run(args);
    assert_eq!(r.code, 1, "{args:?}:\n{}{}", r.stdout, r.stderr);
    let lines: Vec<&str> = r.stderr.lines().collect();
    assert_eq!(lines.len(), needles.len() + 1, "{args:?}:\n{}", r.stderr);
    for (line, needle) in lines.iter().zip(needles) {
        assert!(line.contains(needle), "{needle:?} not in {line:?}");
    }
    r
}

#[test]
fn byte_totals_past_64_bits_are_invalid_not_wrapped() {
    let p = "tests/data/overflow-memory.toml";
    invalid_with(
        &["validate", p],
        &[&format!(
            "{p}:16:77: node \"n0\" device \"cpu1\": expert_memory 8589934592.00 GiB brings the devices' total to more than 2^64 bytes (18.45 EB), which this build cannot count; lower expert_memory"
        )],
    );
    // `plan` refuses the same topology instead of "every device fits".
    let r = run(&["plan", "--topology", p, "--model", "demo-small"]);
    assert_ne!(r.code, 0, "{}", r.stdout);
    assert!(r.stderr.contains("more than 2^64 bytes"), "{}", r.stderr);

    let m = "tests/data/overflow-model.toml";
    invalid_with(
        &["validate", "examples/single-host.toml", "--model", m],
        &[&format!(
            "{m}:7:18: model \"huge\": routed_experts (65536) x 4096 MoE layers x 1855425871872 B per expert = 498062089990157893632 B of routed experts, more than 2^64 bytes"
        )],
    );
    let r = run(&["models", m]);
    assert_eq!(r.code, 1, "{}{}", r.stdout, r.stderr);
}

#[test]
fn addresses_that_reach_one_socket_collide_with_line_and_column() {
    let p = "tests/data/same-socket.toml";
    invalid_with(
        &["validate", p],
        &[
            &format!(
                "{p}:9:8: [router]: the router port uses port 7200 on 127.0.0.1, which device \"a/cpu0\" data port already uses; give it another port"
            ),
            &format!(
                "{p}:22:16: node \"b\": node \"b\" control_port uses port 7100 on localhost, which node \"a\" control_port already uses on 127.0.0.1 (localhost resolves to 127.0.0.1: the same socket)"
            ),
            &format!(
                "{p}:32:13: node \"c\" device \"cpu0\": device \"c/cpu0\" data port uses port 7200 on 127.0.0.1, which device \"a/cpu0\" data port already uses"
            ),
        ],
    );
}

#[test]
fn a_model_file_named_like_a_preset_must_say_it_overrides() {
    let p = "tests/data/preset-name-model.toml";
    invalid_with(
        &["validate", "examples/single-host.toml", "--model", p],
        &[&format!(
            "{p}:3:8: top level: model name \"kimi-k2\" is a built-in preset, but this file differs from it in num_layers (8, preset 61), first_dense_layers (0, preset 1), hidden (1024, preset 7168), routed_experts (16, preset 384)"
        )],
    );
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("override.toml");
    let text = std::fs::read_to_string(root().join(p)).unwrap();
    std::fs::write(&path, format!("overrides_preset = true\n{text}")).unwrap();
    let r = run(&[
        "validate",
        "examples/single-host.toml",
        "--model",
        path.to_str().unwrap(),
    ]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(
        r.stdout
            .contains("model \"kimi-k2\": 8 MoE layers x 16 experts"),
        "{}",
        r.stdout
    );
}

#[test]
fn ports_out_of_range_and_follow_on_problems() {
    let p = "tests/data/port-out-of-range.toml";
    invalid_with(
        &["validate", p],
        &[&format!(
            "{p}:8:16: node \"n0\": `control_port`: 99999999999999999999 is out of range for a port; use 1 to 65535"
        )],
    );
    // The misspelled node name is reported; the router's node = "local" is not called unknown.
    let p = "tests/data/misspelled-node-name.toml";
    let r = invalid_with(
        &["validate", p],
        &[
            &format!("{p}:10:1: node #1: missing `name`"),
            &format!("{p}:11:1: node #1: unknown key \"nmae\"; did you mean \"name\"?"),
        ],
    );
    assert!(!r.stderr.contains("unknown node"), "{}", r.stderr);
}

#[test]
fn a_file_of_the_wrong_kind_is_named_not_flooded() {
    invalid_with(
        &["validate", "examples/single-host-demo-small.placement.toml"],
        &[
            "examples/single-host-demo-small.placement.toml:1:1: top level: this looks like a placement file (it has `assign`, `cluster`, `model`, `shared`), not a topology file; pass it with --placement",
        ],
    );
    invalid_with(
        &["validate", "examples/glm-4.5-air.model.toml"],
        &["examples/glm-4.5-air.model.toml:1:1: top level: this looks like a model file (it has "],
    );
    let r = run(&["validate", "examples/glm-4.5-air.model.toml"]);
    assert!(r.stderr.contains("pass it with --model"), "{}", r.stderr);
    invalid_with(
        &[
            "validate",
            "examples/single-host.toml",
            "--model",
            "examples/single-host.toml",
        ],
        &[
            "this looks like a topology file (it has `nodes`, `router`), not a model file; pass it as the topology (the first argument)",
        ],
    );
}

#[test]
fn a_misspelled_keyword_is_suggested() {
    let p = "tests/data/layers-All.placement.toml";
    let r = run(&["validate", "examples/single-host.toml", "--placement", p]);
    assert_eq!(r.code, 1, "{}{}", r.stdout, r.stderr);
    assert!(
        r.stderr.contains(&format!(
            "{p}:7:10: assignment #1: layers: \"All\" is not a list of numbers; did you mean \"all\"?"
        )),
        "{}",
        r.stderr
    );
}

/// One node with `n` CPU devices, written as a topology file; `threads` left out when asked.
fn big_topology(n: usize, threads: bool) -> String {
    let mut s = String::from(
        "format = 1\nname = \"big\"\n[[nodes]]\nname = \"n0\"\naddress = \"127.0.0.1\"\n\
         control_port = 1000\ndata_port = 1001\nintra_link = \"shm\"\nintra_bandwidth_gb_s = 10\n\
         nics = [{ name = \"lo\", kind = \"tcp\", speed_gbit_s = 100, mtu = 65536 }]\ndevices = [\n",
    );
    let t = if threads { "threads = 1, " } else { "" };
    for i in 0..n {
        s.push_str(&format!(
            "  {{ name = \"c{i}\", kind = \"cpu\", arch = \"cpu\", {t}expert_memory = \"1 GB\", memory_bandwidth_gb_s = 10 }},\n"
        ));
    }
    s.push_str("]\n");
    s
}

/// The least CPU time (user and system, of the `validate` process alone, from `wait4`) of two
/// `validate` runs of `path`, and the last run's result. CPU time, not wall time: a busy
/// machine delays a process without adding to the work it does, so the ratio of two such
/// figures moves far less with what else runs beside the test (caches and clock speed still
/// move it a little: the limit below leaves 4x).
fn least_cpu_validate(path: &std::path::Path) -> (Duration, Run) {
    let mut best = Duration::MAX;
    let mut last = None;
    for _ in 0..2 {
        let (r, cpu) = run_cpu_time(&["validate", path.to_str().unwrap()]);
        best = best.min(cpu);
        last = Some(r);
    }
    (best, last.expect("ran"))
}

/// Validation grows linearly with the file (quadratic work took minutes at 60,000 devices):
/// asserted as how the CPU time grows from 6,000 to 60,000 devices, measured in the same run,
/// not as a budget this machine's speed decides (linear: about 10x; quadratic: about 100x).
#[test]
fn big_files_are_fast_and_repeated_problems_are_capped() {
    let dir = tempfile::tempdir().unwrap();
    let (small, path) = (dir.path().join("small.toml"), dir.path().join("big.toml"));
    std::fs::write(&small, big_topology(6_000, false)).unwrap();
    std::fs::write(&path, big_topology(60_000, false)).unwrap();
    let (small_took, _) = least_cpu_validate(&small);
    let (took, r) = least_cpu_validate(&path);
    let growth = took.as_secs_f64() / small_took.as_secs_f64().max(1e-3);
    println!("validate: 6,000 devices {small_took:?} of CPU, 60,000 {took:?} ({growth:.1}x)");
    assert!(
        growth < 40.0,
        "ten times the devices took {growth:.1} times as long ({small_took:?}, then {took:?}): \
         not linear"
    );
    assert_eq!(r.code, 1);
    let lines: Vec<&str> = r.stderr.lines().collect();
    assert_eq!(lines.len(), 12, "{}", r.stderr);
    assert!(
        lines[9].contains("device \"c9\": missing `threads`"),
        "{}",
        lines[9]
    );
    assert!(
        lines[10].ends_with(": ... and 59,990 more like this"),
        "{}",
        lines[10]
    );
    assert_eq!(lines[11], "invalid: 60,000 problems found");

    std::fs::write(&small, big_topology(6_000, true)).unwrap();
    std::fs::write(&path, big_topology(60_000, true)).unwrap();
    let (small_took, _) = least_cpu_validate(&small);
    let (took, r) = least_cpu_validate(&path);
    let growth = took.as_secs_f64() / small_took.as_secs_f64().max(1e-3);
    println!(
        "validate (valid): 6,000 devices {small_took:?} of CPU, 60,000 {took:?} ({growth:.1}x)"
    );
    assert!(growth < 40.0, "not linear: {growth:.1}x");
    assert_eq!(r.code, 0, "{}", r.stderr);
}

#[test]
fn sizes_show_in_the_units_they_were_written_in() {
    let r = run(&[
        "validate",
        "examples/single-host.toml",
        "--model",
        "demo-small",
    ]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(
        r.stdout.contains("expert memory 512.00 MiB in total"),
        "{}",
        r.stdout
    );
    let row = r.stdout.lines().find(|l| l.contains("local/cpu0")).unwrap();
    assert!(row.contains("256.00 MiB"), "{row}");
    // Decimal sizes stay decimal.
    let r = run(&["validate", "examples/mi300x-4x8.toml"]);
    assert!(
        r.stdout.contains("expert memory 5120.00 GB in total"),
        "{}",
        r.stdout
    );

    // Floats print as the f32 they are, and read back to the same model.
    let r = run(&["models", "kimi-k2", "--toml"]);
    assert_eq!(r.code, 0);
    assert!(
        r.stdout.contains("\nrouted_scaling_factor = 2.827\n"),
        "{}",
        r.stdout
    );
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("k2.toml");
    std::fs::write(&path, &r.stdout).unwrap();
    let back = run(&["models", path.to_str().unwrap()]);
    let preset = run(&["models", "kimi-k2"]);
    assert_eq!(back.code, 0, "{}", back.stderr);
    assert_eq!(back.stdout, preset.stdout);
}
