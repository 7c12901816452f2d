//! `expertmesh bench convert --quick` as a user runs it: the real binary writes its JSON with
//! the three kinds of figures (conversion and worker load, repacking and from the tile cache,
//! against a raw read of the same files, the searched quantizer's error against absmax round-to-nearest), each a finite,
//! positive ratio against a finite, positive limit measured in the same run. No timing is
//! asserted.

use serde_json::Value;

use crate::support::run;

#[test]
fn bench_convert_help_states_exit_codes_and_format() {
    let _machine = crate::support::shared();
    let r = run(&["bench", "convert", "--help"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    for want in [
        "Exit codes",
        "0 measured",
        "format: `expertmesh bench --help`",
        "--quick",
    ] {
        assert!(r.stdout.contains(want), "want {want:?} in\n{}", r.stdout);
    }
}

#[test]
fn bench_convert_quick_reports_every_kind() {
    let _machine = crate::support::shared();
    let dir = tempfile::tempdir().expect("a temporary folder");
    let json = dir.path().join("convert.json");
    let json_arg = json.to_str().expect("a UTF-8 path");
    let r = run(&["bench", "convert", "--quick", "--json", json_arg]);
    assert_eq!(r.code, 0, "{}\n{}", r.stdout, r.stderr);
    let text = std::fs::read_to_string(&json).expect("bench JSON written");
    let v: Value =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}):\n{text}"));
    let results = v["results"].as_array().expect("results");
    let kind = |r: &Value| r["kind"].as_str().unwrap_or_default().to_owned();
    for r in results {
        let (ratio, limit) = (r["ratio"].as_f64(), r["limit"].as_f64());
        let ok = |x: Option<f64>| x.is_some_and(|x| x.is_finite() && x > 0.0);
        assert!(ok(ratio) && ok(limit), "not a positive finite figure: {r}");
        let better = r["better"].as_str().expect("better");
        let want = if kind(r) == "quant_error" {
            "lower"
        } else {
            "higher"
        };
        assert_eq!(better, want, "{r}");
        assert!(r["limit_kind"].is_string(), "{r}");
        if kind(r) != "quant_error" {
            // The read limit is the fastest of its reads, run by run (two threads' only for a
            // step on two): its median is at least each included read's median.
            let (file, mapped, pair) = (
                r["limit_file_read"].as_f64(),
                r["limit_mapped_read"].as_f64(),
                r["limit_mapped_read_two_threads"].as_f64(),
            );
            assert!(
                ok(file) && ok(mapped) && ok(pair),
                "every raw read recorded: {r}"
            );
            let mut fastest = file.unwrap_or(0.0).max(mapped.unwrap_or(0.0));
            if kind(r) != "convert" || r["batch"].as_u64() >= Some(2) {
                fastest = fastest.max(pair.unwrap_or(0.0));
            }
            assert!(limit.unwrap_or(0.0) >= fastest * (1.0 - 1e-9), "{r}");
        }
        if kind(r) == "load" {
            let fresh = r["fresh_copy"].as_f64();
            assert!(ok(fresh) && ok(r["ratio_of_fresh_copy"].as_f64()), "{r}");
        }
        if kind(r) == "load_tile_cache" {
            assert!(r["mapped"].is_boolean(), "{r}");
            assert!(ok(r["first_load_keeping_tiles"].as_f64()), "{r}");
            assert!(ok(r["tile_cache_bytes"].as_f64()), "{r}");
        }
    }
    let count = |k: &str| results.iter().filter(|r| kind(r) == k).count();
    // Conversion with 2 and 1 threads, the worker load repacking and from the tile cache, and
    // output and weight error for each of the three weight distributions.
    assert_eq!(count("convert"), 2, "{text}");
    assert_eq!(count("load"), 1, "{text}");
    assert_eq!(count("load_tile_cache"), 1, "{text}");
    assert_eq!(count("quant_error"), 6, "{text}");
    for dist in ["gaussian", "student_t4", "outlier_columns"] {
        for what in ["output", "weight"] {
            let name = format!("quant_{what}_rel_error_{dist}");
            assert!(
                results.iter().any(|r| r["name"] == name.as_str()),
                "no {name} in\n{text}"
            );
        }
    }
    let settings = &v["machine"]["settings"];
    assert_eq!(settings["hidden"], 256, "{settings}");
    assert!(v["machine"]["cpus"].as_u64().unwrap_or(0) >= 1);
    // The temporary checkpoint folder is gone.
    let used = settings["dir"].as_str().expect("dir recorded");
    assert!(!std::path::Path::new(used).exists(), "{used} left behind");
}
