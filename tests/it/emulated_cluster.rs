//! The emulated cluster end to end (`expertmesh bench cluster --quick`): three nodes as network
//! namespaces with tc-shaped NICs, two worker processes each (a remote node's leader fans
//! dispatches out), one router and then one router per node, frontends in the routers'
//! namespaces; once in exact mode, once in serving mode, each at a line rate low enough that
//! the emulated network, not a 2-core machine's CPU, is what binds. Asserts that every answer across the
//! namespaces is bit-identical to the in-process reference in exact mode and within tolerance
//! in serving mode (the bench exits 1 otherwise), that no call failed,
//! that measured tokens/s is within a loose band of `expertmesh plan`'s prediction for the same
//! topology, and that the namespaces are gone afterwards. Timings are not asserted beyond that
//! band, and a throughput that falls short while the machine's CPU was busy (by the cluster or
//! by anything else on a shared machine) is printed as "not checked", not failed: it measured
//! the CPU, not the plan.
//!
//! Needs root (CI runs as root) and iproute2; where `ip netns add` is refused it prints
//! "skipped: network namespaces, bridges, veth or tc not permitted" and passes.

use serde_json::Value;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Whether this machine lets us build what the emulated cluster needs (and `ip` and `tc`
/// exist): a network namespace holding a bridge and a veth pair shaped by `tc tbf`. A
/// restricted container may allow the namespace and refuse the rest.
fn namespaces_permitted() -> Result<(), String> {
    let name = format!("emc-probe-{}", std::process::id());
    let run = |args: &[&str]| -> Result<(), String> {
        let out = Command::new(args[0])
            .args(&args[1..])
            .output()
            .map_err(|e| format!("cannot run {}: {e}", args[0]))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(format!(
                "{}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            ))
        }
    };
    run(&["ip", "netns", "add", &name])?;
    let inside = (|| {
        run(&["ip", "-n", &name, "link", "add", "br0", "type", "bridge"])?;
        run(&[
            "ip", "-n", &name, "link", "add", "a0", "type", "veth", "peer", "name", "b0",
        ])?;
        run(&[
            "ip", "netns", "exec", &name, "tc", "qdisc", "add", "dev", "a0", "root", "tbf", "rate",
            "1mbit", "burst", "2048", "latency", "10ms",
        ])
    })();
    let _ = Command::new("ip").args(["netns", "del", &name]).output();
    inside
}

/// The namespaces whose names start with `prefix`.
fn namespaces_with(prefix: &str) -> Vec<String> {
    let out = Command::new("ip").args(["netns", "list"]).output();
    let text = out.map(|o| String::from_utf8_lossy(&o.stdout).into_owned());
    text.unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| n.starts_with(prefix))
        .map(str::to_owned)
        .collect()
}

/// Deletes the bench's namespaces if it left any (it should not), so a failing run does not
/// leave them behind.
struct Leftovers(String);

impl Drop for Leftovers {
    fn drop(&mut self) {
        for ns in namespaces_with(&self.0) {
            let _ = Command::new("ip").args(["netns", "del", &ns]).output();
        }
    }
}

/// NIC line rate of the exact-mode run, Mbit/s. With three routers at batch 1 the cluster's
/// processes then need about 1.4 of this 2-core machine's cores (measured: 676 tokens/s took
/// 1.82 cores at 40 Mbit/s), so the emulated network, not the CPU, binds.
const EXACT_MBIT: f64 = 30.0;
/// Serving mode's line rate: its wire is ~2.5x leaner, so at the exact run's 40 Mbit/s three
/// routers were predicted 1449 tokens/s and the 2-core machine ran out of CPU at ~840 (ratio
/// 0.58, CPU 94% busy). At 12 Mbit/s it carries about as many tokens/s as exact at 30 does.
const SERVING_MBIT: f64 = 12.0;

/// Run `expertmesh bench cluster --quick --mode MODE --line-rate-mbit MBIT`; its JSON report.
/// Asserts it exited 0 (every answer correct, no failed call) and left no namespace behind.
fn run_quick(mode: &str, mbit: f64) -> Value {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("cluster.json");
    let mut child = Command::new(env!("CARGO_BIN_EXE_expertmesh"))
        .args([
            "bench", "cluster", "--quick", "--nice", "-5", "--mode", mode, "--json",
        ])
        .arg(&json)
        .arg("--line-rate-mbit")
        .arg(mbit.to_string())
        .arg("--dir")
        .arg(dir.path().join("files"))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run expertmesh");
    let prefix = format!("emc-{}-", child.id());
    let _cleanup = Leftovers(prefix.clone());
    let until = Instant::now() + Duration::from_secs(150);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > until {
            // SIGTERM: the bench removes its namespaces and exits.
            let _ = Command::new("kill").arg(child.id().to_string()).status();
            std::thread::sleep(Duration::from_secs(3));
            let _ = child.kill();
            panic!("bench cluster --quick took more than 150 s");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = child.wait_with_output().unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    println!("{stdout}{stderr}");
    assert_eq!(out.status.code(), Some(0), "{stdout}{stderr}");
    assert!(
        namespaces_with(&prefix).is_empty(),
        "namespaces left behind: {:?}",
        namespaces_with(&prefix)
    );
    serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap()
}

/// Machine CPU busy fraction from which a row measured the CPU rather than the network.
const CPU_SATURATED: f64 = 0.85;

/// The rows of a quick run: 1 router and one per node, batches 1 and 8; 2 workers per node, so
/// remote nodes get one dispatch per micro-batch and fan it out. Every answer correct, every
/// measured/predicted ratio in a loose band, more tokens/s with a router per node.
fn check_rows(report: &Value) {
    let results = report["results"].as_array().unwrap();
    assert_eq!(
        results.len(),
        4,
        "one row per router count and batch size: {report}"
    );
    let row = |routers: u64, batch: u64| {
        results
            .iter()
            .find(|r| r["routers"] == routers && r["batch"] == batch)
            .unwrap()
    };
    let tps = |routers: u64, batch: u64| row(routers, batch)["achieved"].as_f64().unwrap();
    let busy = |routers: u64, batch: u64| cpu_was_busy(row(routers, batch));
    // Network-bound: one router per node moves more tokens than one router.
    expect_unless_busy(
        tps(3, 8) > 1.5 * tps(1, 8),
        busy(3, 8) || busy(1, 8),
        &format!(
            "three routers at batch 8 moved {:.0} tokens/s, one router {:.0} (expected over 1.5x)",
            tps(3, 8),
            tps(1, 8)
        ),
        report,
    );
    for r in results {
        assert_eq!(r["mismatches"], 0, "{r}");
        assert_eq!(r["errors"], 0, "{r}");
        assert!(r["calls"].as_u64().unwrap() > 10, "{r}");
        assert_eq!(r["bottleneck"], "network", "{r}");
        // measured / predicted: the target is 0.8-1.2; a loaded CI machine gets a looser band.
        // The prediction is the network's. Too fast is always wrong; too slow is wrong only
        // where the CPU had room: a row whose machine ran out of CPU (three routers, six
        // workers and the shapers on 2 cores can, and so can other work on a shared machine)
        // may have measured the CPU, not the plan.
        let ratio = r["ratio"].as_f64().unwrap();
        assert!(ratio <= 1.4, "measured/predicted {ratio}: {r}");
        expect_unless_busy(
            ratio >= 0.6,
            cpu_was_busy(r),
            &format!(
                "measured/predicted {ratio:.2} of {} routers batch {}",
                r["routers"], r["batch"]
            ),
            r,
        );
    }
}

/// Whether the machine's CPU was at least [`CPU_SATURATED`] busy during a row (the cluster's
/// own processes or anything else on the machine: the bench reads `/proc/stat`).
fn cpu_was_busy(row: &Value) -> bool {
    row["cpu_busy"].as_f64().unwrap_or(0.0) >= CPU_SATURATED
}

/// Asserts `holds`, a claim about throughput, unless the CPU was busy while it was measured
/// (`busy`): then a miss says nothing about the fabric or the plan, and is printed ("not
/// checked: ...") instead of failing. A claim that holds on a busy machine still passes.
fn expect_unless_busy(holds: bool, busy: bool, claim: &str, context: &Value) {
    if holds {
        return;
    }
    if busy {
        crate::support::say(&format!(
            "not checked: {claim}: the CPU was over {:.0}% busy, so the network was not \
             what limited it",
            100.0 * CPU_SATURATED
        ));
        return;
    }
    panic!("{claim}, with CPU to spare: {context}");
}

/// Exact mode: every answer across the namespaces bit-identical to the in-process reference.
#[test]
fn emulated_cluster_answers_exactly_and_matches_the_plan() {
    let _machine = crate::support::alone();
    if let Err(why) = namespaces_permitted() {
        crate::support::say(&format!(
            "skipped: network namespaces, bridges, veth or tc not permitted ({why})"
        ));
        return;
    }
    let report = run_quick("exact", EXACT_MBIT);
    assert_eq!(report["machine"]["mode"], "exact");
    check_rows(&report);
    // Serving mode (the default of `up`): bf16 rows pre-combined per device, within tolerance,
    // and the planner counts its leaner wire: more tokens/s per Mbit/s of NIC than exact.
    let serving = run_quick("serving", SERVING_MBIT);
    assert_eq!(serving["machine"]["mode"], "serving");
    check_rows(&serving);
    let per_mbit = |j: &Value| {
        let rate = j["machine"]["line_rate_mbit"].as_f64().unwrap();
        j["results"][0]["achieved"].as_f64().unwrap() / rate
    };
    // Row 0 (one router, batch 1) of each run.
    let first_busy = |j: &Value| cpu_was_busy(&j["results"][0]);
    expect_unless_busy(
        per_mbit(&serving) > 1.5 * per_mbit(&report),
        first_busy(&serving) || first_busy(&report),
        &format!(
            "tokens/s per Mbit/s: serving {:.2}, exact {:.2} (expected over 1.5x)",
            per_mbit(&serving),
            per_mbit(&report)
        ),
        &serving,
    );
}
