//! `expertmesh bench` and every command's `--help` as a user runs them: the real binary.
//! Every command's help states its exit codes; `bench --help` describes the bench JSON (no
//! reference to a document outside the repository); `bench kernels --seconds` shrinks the whole
//! run, bounds it, and records what it did; results carry their spreads and raw samples;
//! `--report` writes a page with plots; `bench compare` flags changes outside noise. No speed
//! is asserted: the one time check is that `--seconds` bounds the run.

use serde_json::Value;

use crate::support::run;

fn read_json(path: &std::path::Path) -> Value {
    let text = std::fs::read_to_string(path).expect("bench JSON written");
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}):\n{text}"))
}

#[test]
fn every_help_states_exit_codes() {
    let _machine = crate::support::shared();
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
        (&["bench", "rebalance", "--help"], &["0 measured"]),
        (
            &["bench", "compare", "--help"],
            &["0 measured", "outside noise"],
        ),
        (&["demo", "--help"], &["1 mismatched or failed responses"]),
        (
            &["up", "--help"],
            &["0 stopped cleanly", "--auto-rebalance-every"],
        ),
        (&["worker", "--help"], &["0 stopped cleanly"]),
        (
            &["router", "--help"],
            &["0 stopped cleanly", "--auto-rebalance-every"],
        ),
        (
            &["rebalance", "--help"],
            &["0 the placement is served", "--drain"],
        ),
        (
            &["drain", "--help"],
            &["0 the placement is served", "--device", "--from"],
        ),
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
    let _machine = crate::support::shared();
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
    let _machine = crate::support::shared();
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("kernels.json");
    let report = dir.path().join("report");
    // 20 s is still a short run (the pools shrink) but leaves the demo-small rows time on a
    // loaded 2-core machine running a debug build.
    let r = run(&[
        "bench",
        "kernels",
        "--seconds",
        "20",
        "--repeats",
        "3",
        "--threads",
        "1",
        "--models",
        "demo-small",
        "--batches",
        "1,4",
        "--prefill-tokens",
        "8",
        "--json",
        json.to_str().unwrap(),
        "--report",
        report.to_str().unwrap(),
    ]);
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    assert!(
        r.stdout.contains("short run (--seconds 20)"),
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
    // The portable machine description and the limits' own measurements.
    for k in [
        "cpu_flags",
        "kernel_version",
        "build_profile",
        "git_revision",
        "read_bandwidth_probes",
        "read_bandwidth_probe_best",
        "int8_peak_tops_median",
        "loadavg_end",
    ] {
        assert!(m.get(k).is_some(), "machine.{k} missing: {m}");
    }
    let s = &m["settings"];
    assert_eq!(s["seconds"], 20.0, "{s}");
    assert_eq!(s["short_run"], true, "{s}");
    assert_eq!(s["repetitions"], 3, "{s}");
    let num = |k: &str| s[k].as_u64().unwrap_or_else(|| panic!("{k} in {s}"));
    assert!(num("pool_bytes") < num("full_pool_bytes"), "{s}");
    assert!(num("probe_bytes") <= num("full_probe_bytes"), "{s}");
    assert_eq!(s["batches"], serde_json::json!([1, 4]));
    assert!(s["memory_budget_bytes"].as_u64().is_some(), "{s}");
    // What the bench guarantees on any machine: the first case is measured; every other is a
    // result or a skipped case with its reason (whether the time sufficed is the machine's).
    let results = v["results"].as_array().unwrap();
    let batches: Vec<u64> = results
        .iter()
        .filter(|r| r["name"] == "decode-exact demo-small H1024 F512")
        .map(|r| r["batch"].as_u64().unwrap())
        .collect();
    assert!(batches.contains(&1), "{results:?}");
    let skipped = m["skipped_cases"].as_array().unwrap();
    assert!(
        skipped.iter().all(|c| c["why"].as_str().is_some()),
        "{skipped:?}"
    );
    // Decode 1 and 4, accurate, prefill 8.
    assert_eq!(results.len() + skipped.len(), 4, "{results:?} {skipped:?}");
    for r in results {
        assert_eq!(r["better"], "higher", "{r}");
        // Median of interleaved repetitions, with the spread and the raw samples.
        let reps = r["repetitions"].as_u64().unwrap();
        assert!((1..=3).contains(&reps), "{r}");
        assert_eq!(
            r["samples"]["achieved"].as_array().unwrap().len() as u64,
            reps
        );
        assert_eq!(r["samples"]["limit"].as_array().unwrap().len() as u64, reps);
        assert!(r["ratio_p10"].as_f64().unwrap() <= r["ratio_p90"].as_f64().unwrap());
        assert!(r["limit_kind"].as_str().is_some(), "{r}");
    }
    let html = std::fs::read_to_string(report.join("index.html")).expect("report page");
    assert!(html.contains("<svg") && html.contains("Roofline"), "{html}");
}

#[test]
fn seconds_bound_the_whole_kernel_run() {
    let _machine = crate::support::shared();
    // Far more repetitions than fit: the run must stop on time and say so.
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("kernels.json");
    let t0 = std::time::Instant::now();
    let r = run(&[
        "bench",
        "kernels",
        "--seconds",
        "3",
        "--repeats",
        "100000",
        "--threads",
        "1",
        "--models",
        "demo-small,qwen3-30b-a3b",
        "--batches",
        "1,8",
        "--prefill-tokens",
        "0",
        "--json",
        json.to_str().unwrap(),
    ]);
    let wall = t0.elapsed().as_secs_f64();
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    // It stops early and says why: repetitions were cut short by --seconds, or (on a slow or
    // loaded machine) the probes left no time for the second model's pool. How much fitted
    // in 3 s is the machine's business; that the run stopped and said so is the bench's.
    assert!(
        r.stdout.contains("--seconds 3 reached") || r.stdout.contains("no time left"),
        "{}",
        r.stdout
    );
    let s = &read_json(&json)["machine"]["settings"];
    assert!(s["repetitions_done"].as_u64().unwrap() < 100000, "{s}");
    let elapsed = s["elapsed_s"].as_f64().unwrap();
    let over = s["over_time_s"].as_f64().unwrap();
    assert!((over - (elapsed - 3.0).max(0.0)).abs() < 1e-9, "{s}");
    if over > 0.0 {
        assert!(r.stdout.contains("--seconds 3 exceeded"), "{}", r.stdout);
    }
    // Bounded at all: far from 100000 repetitions (loose: a debug build on a busy machine,
    // with the first case's pool loaded whatever the clock says).
    assert!(wall < 3.0 + 60.0, "the process took {wall} s");
}

#[test]
fn compare_flags_what_moved_beyond_noise_and_plots_it() {
    let _machine = crate::support::shared();
    let dir = tempfile::tempdir().unwrap();
    // Two runs of the same figures: one unchanged (noise only), one 20% lower.
    let run_file = |name: &str, shift: f64| {
        let rows: Vec<Value> = [("steady", 1.0), ("moved", shift)]
            .iter()
            .map(|(n, f)| {
                let achieved: Vec<f64> = (0..9)
                    .map(|i| 8.0 * f * (1.0 + 0.01 * ((i * 5 % 9) as f64 - 4.0)))
                    .collect();
                let limit = vec![10.0; 9];
                let med = {
                    let mut a = achieved.clone();
                    a.sort_by(f64::total_cmp);
                    a[4]
                };
                serde_json::json!({
                    "name": n, "batch": 1, "achieved": med, "limit": 10.0, "unit": "GB/s",
                    "ratio": med / 10.0, "better": "higher",
                    "samples": {"achieved": achieved, "limit": limit},
                })
            })
            .collect();
        let path = dir.path().join(name);
        let v = serde_json::json!({"machine": {"cpus": 2}, "results": rows});
        std::fs::write(&path, v.to_string()).unwrap();
        path
    };
    let (a, b) = (run_file("a.json", 1.0), run_file("b.json", 0.8));
    let page = dir.path().join("cmp");
    let r = run(&[
        "bench",
        "compare",
        a.to_str().unwrap(),
        b.to_str().unwrap(),
        "--report",
        page.to_str().unwrap(),
    ]);
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    let line = |n: &str| {
        r.stdout
            .lines()
            .find(|l| l.starts_with(n))
            .unwrap_or_else(|| panic!("{n} in\n{}", r.stdout))
            .to_owned()
    };
    assert!(
        line("moved").contains("* worse, outside noise"),
        "{}",
        r.stdout
    );
    assert!(line("steady").contains("within noise"), "{}", r.stdout);
    assert!(
        r.stdout
            .contains("2 figures compared, 1 outside noise (1 worse)")
    );
    let html = std::fs::read_to_string(page.join("index.html")).expect("compare page");
    assert!(html.contains("<svg") && html.contains("class=out"));
    // A file that is not a bench report is a usage error with a message.
    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, "{}").unwrap();
    let r = run(&[
        "bench",
        "compare",
        a.to_str().unwrap(),
        bad.to_str().unwrap(),
    ]);
    assert_eq!(r.code, 2, "{}{}", r.stdout, r.stderr);
    assert!(r.stderr.contains("not a bench report"), "{}", r.stderr);
}

#[test]
fn transport_results_say_which_way_each_ratio_is_good() {
    let _machine = crate::support::shared();
    // Two rings, each smaller than a worker's.
    let Some(_shm) = crate::support::shm_room(2) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("transport.json");
    let r = run(&[
        "bench",
        "transport",
        "--seconds",
        "20",
        "--repeats",
        "2",
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
        // Two interleaved repetitions asked for, kept raw; the --seconds budget may stop the
        // run after the first on a slow or busy machine, and the row records what it ran.
        let reps = r["repetitions"].as_u64().unwrap();
        assert!((1..=2).contains(&reps), "{r}");
        assert_eq!(
            r["samples"]["limit"].as_array().unwrap().len() as u64,
            reps,
            "{r}"
        );
    }
}

/// `bench fabric`'s limits do the work the fabric does: the clients' concurrent batches of
/// distinct tokens as one in-process batch in the router's micro-batches (an ideal batcher), and for latency the in-process 1-token layer as the
/// floor (a raw TCP round trip is recorded beside it, not added to it). Structure only: the
/// figures depend on the machine.
#[test]
fn fabric_limits_do_the_same_work_as_the_fabric() {
    let _machine = crate::support::shared();
    let Some(_shm) = crate::support::shm_room(crate::support::FABRIC_RINGS) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("fabric.json");
    let r = run(&[
        "bench",
        "fabric",
        "--seconds",
        "0.3",
        "--batches",
        "1,8",
        "--clients",
        "3",
        "--link",
        "shm",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    let v = read_json(&json);
    let results = v["results"].as_array().unwrap();
    let (mut throughput, mut floors) = (0, Vec::new());
    for row in results {
        let limit_is = row["limit_is"].as_str().unwrap();
        match row["unit"].as_str().unwrap() {
            "tokens/s" => {
                let b = row["batch"].as_u64().unwrap();
                assert!(
                    limit_is.contains(&format!(
                        "(distinct tokens) as one batch of {} tokens",
                        3 * b
                    )),
                    "{row}"
                );
                // The router batches every client's largest call at once (8 x 3 here), so
                // its one micro-batch holds what the limit runs.
                assert!(limit_is.contains("in micro-batches of 24,"), "{row}");
                let (before, after) = (
                    row["limit_before"].as_f64().unwrap(),
                    row["limit_after"].as_f64().unwrap(),
                );
                assert_eq!(row["limit"].as_f64().unwrap(), before.max(after), "{row}");
                throughput += 1;
            }
            "us" => {
                assert_eq!(row["better"], "lower", "{row}");
                assert!(limit_is.starts_with("a floor"), "{row}");
                assert!(
                    row["raw_tcp_round_trip_us_p50"].as_f64().unwrap() > 0.0,
                    "{row}"
                );
                floors.push(row["limit"].as_f64().unwrap());
            }
            other => panic!("unit {other}: {row}"),
        }
    }
    assert_eq!(throughput, 2);
    assert_eq!(floors.len(), 4);
    assert!(
        floors.iter().all(|&f| f > 0.0 && f == floors[0]),
        "{floors:?}"
    );
}

/// `bench rebalance` measures before and after a live change planned for its skewed traffic:
/// a gain row per batch against the predicted gain (a reference, not a bound), the p99 while
/// the change is applied, and the change itself (experts loaded, bytes, seconds). Structure
/// and the deterministic prediction only: the figures depend on the machine.
#[test]
fn rebalance_bench_records_the_change_and_the_predicted_gain() {
    let _machine = crate::support::shared();
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("rebalance.json");
    let r = run(&[
        "bench",
        "rebalance",
        "--model",
        "demo-small",
        "--seconds",
        "0.3",
        "--batches",
        "4,8",
        "--clients",
        "2",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    let v = read_json(&json);
    let m = &v["machine"];
    // Zipf traffic whose hot experts sit on one device: the plan spreads them.
    let predicted = m["predicted_gain"].as_f64().unwrap();
    assert!(predicted > 1.2, "{m}");
    assert!(m["experts_loaded"].as_u64().unwrap() > 0, "{m}");
    assert_eq!(
        m["bytes_loaded"].as_u64().unwrap(),
        m["experts_loaded"].as_u64().unwrap() * 884_736,
        "{m}"
    );
    let results = v["results"].as_array().unwrap();
    let gains: Vec<_> = results
        .iter()
        .filter(|r| r["name"].as_str().unwrap().starts_with("rebalance-gain"))
        .collect();
    assert_eq!(gains.len(), 2);
    for row in gains {
        // The machine's figure is the pairs model's; each row's reference is the device-time
        // model with the costs measured in the run (its value depends on those costs, so
        // only its form is checked).
        assert_eq!(
            row["pairs_predicted_gain"].as_f64().unwrap(),
            predicted,
            "{row}"
        );
        let model = row["predicted_gain"].as_f64().unwrap();
        assert!(model > 0.0 && model.is_finite(), "{row}");
        let before = row["before_tokens_per_s"].as_f64().unwrap();
        assert!(before > 0.0, "{row}");
        let limit = row["limit"].as_f64().unwrap();
        assert!((limit - before * model).abs() <= 1e-6 * limit, "{row}");
    }
    assert!(m["expert_stream_s"].as_f64().unwrap() > 0.0, "{m}");
    assert!(m["expert_pair_s"].as_f64().unwrap() > 0.0, "{m}");
    let during: Vec<_> = results
        .iter()
        .filter(|r| {
            r["name"]
                .as_str()
                .unwrap()
                .starts_with("rebalance-p99-during")
        })
        .collect();
    assert_eq!(during.len(), 1);
    assert_eq!(during[0]["batch"].as_u64(), Some(8));
    assert!(
        during[0]["calls_during"].as_u64().unwrap() >= 2,
        "{}",
        during[0]
    );
}

/// `bench kernels --isa` takes only an instruction set this CPU runs, and says which it has.
#[test]
fn kernel_bench_isa_is_checked() {
    let r = run(&["bench", "kernels", "--isa", "avx9"]);
    assert_eq!(r.code, 2, "{}{}", r.stdout, r.stderr);
    assert!(
        r.stderr.contains("one of scalar, avx2, avx512-vnni"),
        "{}",
        r.stderr
    );
}
