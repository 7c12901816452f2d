//! `expertmesh bench` and every command's `--help` as a user runs them: the real binary.
//! Every command's help states its exit codes; `bench --help` describes the bench JSON (no
//! reference to a document outside the repository); `bench kernels --seconds` shrinks the whole
//! run and records what it did; every bench result says which way its ratio is good. No timing
//! is asserted.

use serde_json::Value;

mod common;

use common::run;

fn read_json(path: &std::path::Path) -> Value {
    let text = std::fs::read_to_string(path).expect("bench JSON written");
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}):\n{text}"))
}

#[test]
fn every_help_states_exit_codes() {
    let cases: &[(&[&str], &[&str])] = &[
        (&["--help"], &["infer", "0 output written", "bench ..."]),
        (&["models", "--help"], &["1 the model file has problems"]),
        (&["validate", "--help"], &["1 problems found"]),
        (&["plan", "--help"], &["1 does not fit", "Statistics files"]),
        (&["plan", "-h"], &["1 the model does not fit"]),
        (&["bench", "--help"], &["0 measured"]),
        (&["bench", "kernels", "--help"], &["0 measured"]),
        (&["bench", "transport", "--help"], &["0 measured"]),
        (&["bench", "fabric", "--help"], &["0 measured"]),
        (&["demo", "--help"], &["1 mismatched or failed responses"]),
        (&["up", "--help"], &["0 stopped cleanly"]),
        (&["worker", "--help"], &["0 stopped cleanly"]),
        (&["router", "--help"], &["0 stopped cleanly"]),
        // infer keeps its own help (how to make an input) and gains its exit codes.
        (
            &["infer", "--help"],
            &["Make one with NumPy", "1 the router answered"],
        ),
        (
            &["infer", "-h"],
            &["Make one with NumPy", "1 the router answered"],
        ),
    ];
    for (args, wants) in cases {
        let r = run(args);
        assert_eq!(r.code, 0, "{args:?}: {}", r.stderr);
        for want in ["Exit codes", "2 "].iter().chain(wants.iter()) {
            assert!(
                r.stdout.contains(want),
                "{args:?}: want {want:?} in\n{}",
                r.stdout
            );
        }
        assert!(!r.stdout.contains("DESIGN.md"), "{args:?}:\n{}", r.stdout);
    }
}

#[test]
fn bench_help_describes_the_json_format() {
    let r = run(&["bench", "--help"]);
    assert_eq!(r.code, 0);
    for want in [
        "\"machine\"",
        "\"results\"",
        "\"ratio\"",
        "\"better\": \"higher\" | \"lower\"",
        "\"device_kind\": \"cpu\"",
        "BENCHMARKS.md",
    ] {
        assert!(r.stdout.contains(want), "want {want:?} in\n{}", r.stdout);
    }
    for target in ["kernels", "fabric", "transport"] {
        let r = run(&["bench", target, "--help"]);
        assert!(
            r.stdout.contains("format: `expertmesh bench --help`"),
            "{target}:\n{}",
            r.stdout
        );
    }
}

#[test]
fn a_short_kernel_bench_shrinks_the_run_and_records_it() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("kernels.json");
    let r = run(&[
        "bench",
        "kernels",
        "--seconds",
        "0.05",
        "--threads",
        "1",
        "--models",
        "demo-small",
        "--batches",
        "1,4",
        "--prefill-tokens",
        "0",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    assert!(
        r.stdout.contains("short run (--seconds 0.05 < 1)"),
        "{}",
        r.stdout
    );
    assert!(r.stdout.contains("higher is better"), "{}", r.stdout);
    let v = read_json(&json);
    let m = &v["machine"];
    assert_eq!(m["device_kind"], "cpu", "{m}");
    assert!(
        m["backend"].as_str().is_some_and(|b| b.starts_with("cpu")),
        "{m}"
    );
    let s = &m["settings"];
    assert_eq!(s["seconds"], 0.05, "{s}");
    assert_eq!(s["short_run"], true, "{s}");
    assert_eq!(s["probe_passes"], 3, "{s}");
    assert_eq!(s["min_calls_per_case"], 3, "{s}");
    let num = |k: &str| s[k].as_u64().unwrap_or_else(|| panic!("{k} in {s}"));
    assert!(num("pool_bytes") < num("full_pool_bytes"), "{s}");
    assert!(num("probe_bytes") < num("full_probe_bytes"), "{s}");
    assert_eq!(s["batches"], serde_json::json!([1, 4]));
    let results = v["results"].as_array().unwrap();
    let batches: Vec<u64> = results
        .iter()
        .filter(|r| r["name"] == "decode-exact demo-small H1024 F512")
        .map(|r| r["batch"].as_u64().unwrap())
        .collect();
    assert_eq!(batches, [1, 4]);
    for r in results {
        assert_eq!(r["better"], "higher", "{r}");
    }
}

#[test]
fn transport_results_say_which_way_each_ratio_is_good() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("transport.json");
    let r = run(&[
        "bench",
        "transport",
        "--seconds",
        "0.002",
        "--round-trips",
        "20",
        "--link",
        "shm",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    for want in ["direction", "higher is better", "lower is better"] {
        assert!(r.stdout.contains(want), "want {want:?} in\n{}", r.stdout);
    }
    let v = read_json(&json);
    let results = v["results"].as_array().unwrap();
    assert_eq!(results.len(), 4 * 3);
    for r in results {
        let want = match r["unit"].as_str().unwrap() {
            "us" => "lower",
            "GB/s" => "higher",
            other => panic!("unexpected unit {other}: {r}"),
        };
        assert_eq!(r["better"], want, "{r}");
        // Each row's limit is positive, in the row's unit, and says what it is.
        assert!(r["limit"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["limit_is"].as_str().is_some(), "{r}");
    }
}
