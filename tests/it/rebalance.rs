//! Live placement changes of a running fabric (issue 29): `expertmesh rebalance` run as its
//! own process against a fabric of real processes (two routers sharing two CPU workers),
//! while clients of both routers pipeline calls that are each checked bit for bit against the
//! in-process reference (exact mode).
//!
//! Checks: a change that moves most experts completes with 0 wrong and 0 failed calls, is
//! reported with the experts loaded and released, reaches both routers, and is served (a
//! change back loads exactly what the first released); a change that does not fit a gaining
//! device's memory is refused by that device and undone, the router's answer names why, and
//! calls go on unharmed; a change the router cannot start (an unknown device rank in a
//! placement for another topology, say) is refused before anything moves; with the served
//! placement a change is applied in steps that each fit memory; a drained device serves
//! nothing and its worker stops with no call failing; a device declared in the topology but
//! holding nothing joins the running fabric and takes experts; router 0's automatic
//! rebalancing moves a lopsided placement to one planned from the load it routed.

use crate::support::{bits, root, rt};
use expertmesh_fabric::local::{LocalFabric, LocalFabricOptions};
use expertmesh_router::client::RouterClient;
use expertmesh_router::core::LayerMode;
use expertmesh_transport::frontend::FrontendConfig;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

/// (layer, input, expected output bits) by the in-process reference.
type Cases = Arc<crate::support::RefCases>;

fn cases(fabric: &LocalFabric) -> Cases {
    let dep = fabric.deployment();
    Arc::new(crate::support::reference_cases(
        &dep.spec,
        dep.seed,
        &[1, 6, 24],
        7,
    ))
}

/// Pipelined checked calls against `addr` until `stop`: (right, wrong, failed) with the
/// first failure's message. Returns once the first calls were answered, so the load is
/// under way.
fn drive(addr: SocketAddr, cfg: FrontendConfig, cases: Cases, stop: Arc<AtomicBool>) -> Load {
    let started = Arc::new(std::sync::Barrier::new(2));
    let go = Arc::clone(&started);
    let answered = Arc::new(AtomicUsize::new(0));
    let count = Arc::clone(&answered);
    let h = std::thread::spawn(move || {
        let mut go = Some(go);
        let rt = rt();
        let mut client = rt.block_on(RouterClient::connect(addr, &cfg)).unwrap();
        let hidden = 1024; // demo-small
        let (mut ok, mut wrong, mut failed, mut first) = (0, 0, 0, None);
        while !stop.load(Ordering::Relaxed) {
            for chunk in cases.chunks(4) {
                let mut handles = Vec::new();
                for (layer, x, want) in chunk {
                    let d = Some(Duration::from_secs(20));
                    match rt.block_on(client.submit(*layer, x, hidden, None, d)) {
                        Ok(hd) => handles.push((hd, want)),
                        Err(e) => {
                            failed += 1;
                            first.get_or_insert(e.to_string());
                        }
                    }
                }
                for (hd, want) in handles {
                    match rt.block_on(client.wait(hd)) {
                        Ok(got) if bits(&got) == **want => {
                            ok += 1;
                            count.fetch_add(1, Ordering::Relaxed);
                        }
                        Ok(_) => wrong += 1,
                        Err(e) => {
                            failed += 1;
                            first.get_or_insert(e.to_string());
                        }
                    }
                }
                if let Some(g) = go.take() {
                    g.wait();
                }
            }
        }
        (ok, wrong, failed, first)
    });
    started.wait();
    Load {
        thread: h,
        answered,
    }
}

/// A load thread of [`drive`], and how many of its calls were answered right so far.
struct Load {
    thread: JoinHandle<(usize, usize, usize, Option<String>)>,
    answered: Arc<AtomicUsize>,
}

impl Load {
    /// Waits until `n` more calls were answered right (from now): calls did go on after what
    /// the test just did (a sleep alone would pass with none).
    fn answers_more(&self, n: usize) {
        let at = self.answered.load(Ordering::Relaxed);
        crate::support::wait_for(
            &format!("{n} calls answered after the change (had {at})"),
            Duration::from_millis(10),
            || self.answered.load(Ordering::Relaxed) >= at + n,
        );
    }
}

/// Stops the load `drive` started and checks it: calls answered, none wrong, none failed.
fn stop_and_check(stop: &AtomicBool, load: Load) {
    stop.store(true, Ordering::Relaxed);
    let (ok, wrong, failed, first) = load.thread.join().unwrap();
    assert!(ok > 0, "no call answered");
    assert_eq!((wrong, failed), (0, 0), "{first:?}");
}

/// A demo-small placement for examples/single-host-2routers.toml: cpu0 and cpu1 with these
/// expert ranges on every layer, the shared expert on the router.
fn placement(dir: &Path, name: &str, cpu0: &str, cpu1: &str) -> PathBuf {
    placement_of(
        dir,
        name,
        "single-host",
        &[("local/cpu0", cpu0), ("local/cpu1", cpu1)],
    )
}

/// A demo-small placement file `name` in `dir` for topology `cluster`: each (device, expert
/// ranges) on every layer, the shared expert on the router.
fn placement_of(dir: &Path, name: &str, cluster: &str, assign: &[(&str, &str)]) -> PathBuf {
    let mut text = format!("format = 1\nmodel = \"demo-small\"\ncluster = \"{cluster}\"\n\n");
    for (device, experts) in assign {
        text += &format!(
            "[[assign]]\nlayers = \"all\"\ndevice = \"{device}\"\nexperts = \"{experts}\"\n\n"
        );
    }
    text += "[[shared]]\nlayers = \"all\"\ndevice = \"router\"\n";
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

/// Runs `expertmesh rebalance` against `router`.
fn rebalance(router: SocketAddr, topology: &Path, placement: &Path) -> crate::support::Run {
    rebalance_with(
        router,
        topology,
        &["--placement".as_ref(), placement.as_os_str()],
    )
}

/// Runs `expertmesh rebalance` against `router` to `placement` and checks that it applied,
/// its answer naming `expect` (experts loaded and released, say).
fn rebalance_applied(router: SocketAddr, topology: &Path, placement: &Path, expect: &str) {
    let r = rebalance(router, topology, placement);
    crate::support::say(&r.stdout);
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    assert!(r.stdout.contains(expect), "{}", r.stdout);
}

/// Runs `expertmesh rebalance` against `router` with `args` after the common ones.
fn rebalance_with(
    router: SocketAddr,
    topology: &Path,
    args: &[&std::ffi::OsStr],
) -> crate::support::Run {
    command_with("rebalance", router, topology, args)
}

/// `expertmesh COMMAND` (`rebalance` or `drain`) against `router` with `args`.
fn command_with(
    command: &str,
    router: SocketAddr,
    topology: &Path,
    args: &[&std::ffi::OsStr],
) -> crate::support::Run {
    let o = Command::new(crate::support::bin())
        .args([
            command,
            "--router",
            &router.to_string(),
            "--model",
            "demo-small",
        ])
        .arg("--topology")
        .arg(topology)
        .args(args)
        .args(["--timeout-s", "60"])
        .current_dir(root())
        .env("RUST_BACKTRACE", "1")
        .output()
        .expect("run expertmesh rebalance");
    let r = crate::support::Run {
        code: o.status.code().expect("exited normally"),
        stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
    };
    assert!(!r.stderr.contains("panicked"), "{}", r.stderr);
    r
}

/// A two-router fabric on `topology` (demo-small, exact mode, TCP) with `expert_memory` per
/// device, from the shipped topology.
fn fabric(dir: &Path, expert_memory: &str) -> (LocalFabric, PathBuf) {
    fabric_serving(dir, expert_memory, None)
}

/// [`fabric`], started with `placement` instead of the shipped demo-small placement.
fn fabric_serving(
    dir: &Path,
    expert_memory: &str,
    placement: Option<PathBuf>,
) -> (LocalFabric, PathBuf) {
    let text = std::fs::read_to_string(root().join("examples/single-host-2routers.toml"))
        .unwrap()
        .replace(
            "expert_memory = \"256 MiB\"",
            &format!("expert_memory = \"{expert_memory}\""),
        );
    let topology = dir.join("topology.toml");
    std::fs::write(&topology, text).unwrap();
    let mut o: LocalFabricOptions = crate::support::demo_options(
        "single-host-2routers.toml",
        expertmesh_transport::mesh::LinkKind::Tcp,
    );
    o.topology = topology.clone();
    o.log_dir = Some(dir.join("logs"));
    if let Some(p) = placement {
        o.placement = p;
    }
    (LocalFabric::start(o).expect("the fabric starts"), topology)
}

#[test]
fn a_live_change_under_load_from_both_routers_has_no_failed_and_no_wrong_call() {
    let _machine = crate::support::shared();
    let dir = tempfile::tempdir().unwrap();
    let (fabric, topology) = fabric(dir.path(), "256 MiB");
    let cases = cases(&fabric);
    let addrs: Vec<SocketAddr> = fabric.frontend_addrs().into_iter().flatten().collect();
    assert_eq!(addrs.len(), 2);
    let stop = Arc::new(AtomicBool::new(false));
    let load: Vec<_> = addrs
        .iter()
        .map(|&a| {
            drive(
                a,
                fabric.frontend_config(),
                Arc::clone(&cases),
                Arc::clone(&stop),
            )
        })
        .collect();
    let holdings_before: Vec<u64> = (0..2)
        .map(|i| fabric.router(i).unwrap().stats().holdings)
        .collect();
    // cpu0 0-19 / cpu1 16-31,0-3  ->  cpu0 12-31 / cpu1 0-15: per layer cpu0 gains 12 and
    // loses 12, cpu1 gains 12 and loses 16.
    let new = placement(dir.path(), "new.toml", "12-31", "0-15");
    let r = rebalance(addrs[0], &topology, &new);
    crate::support::say(&r.stdout);
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    assert!(
        r.stdout
            .contains("version 2: 96 experts loaded, 112 released"),
        "{}",
        r.stdout
    );
    // Router 1 does not coordinate: it refuses and names router 0.
    let old = root().join("examples/single-host-demo-small.placement.toml");
    let r = rebalance(addrs[1], &topology, &old);
    assert_eq!(r.code, 1, "{}{}", r.stdout, r.stderr);
    assert!(
        r.stderr.contains("coordinates live placement changes"),
        "{}",
        r.stderr
    );
    // Back again: exactly what was released is loaded.
    let r = rebalance(addrs[0], &topology, &old);
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    assert!(
        r.stdout
            .contains("version 4: 112 experts loaded, 96 released"),
        "{}",
        r.stdout
    );
    for l in &load {
        l.answers_more(8);
    }
    stop.store(true, Ordering::Relaxed);
    for (i, l) in load.into_iter().enumerate() {
        let (ok, wrong, failed, first) = l.thread.join().unwrap();
        crate::support::say(&format!(
            "router {i}: {ok} calls right, {wrong} wrong, {failed} failed"
        ));
        assert!(ok > 0, "router {i}: no call answered");
        assert_eq!((wrong, failed), (0, 0), "router {i}: {first:?}");
    }
    // Both routers take every announcement: 2 workers x 2 steps x 2 changes (the router that
    // did not coordinate may take the last ones just after the answer).
    for (i, before) in holdings_before.into_iter().enumerate() {
        let router = fabric.router(i).unwrap();
        crate::support::wait_for(
            &format!("router {i} never heard 8 announcements more than its {before}"),
            Duration::from_millis(10),
            || router.stats().holdings >= before + 8,
        );
    }
}

#[test]
fn a_change_a_device_has_no_room_for_is_undone_and_calls_go_on() {
    let _machine = crate::support::shared();
    let dir = tempfile::tempdir().unwrap();
    // 80 experts of 0.88 MB fit in 80 MiB, the 128 of old and new sets together do not.
    let (fabric, topology) = fabric(dir.path(), "80 MiB");
    let cases = cases(&fabric);
    let addr = fabric.frontend_addr();
    let stop = Arc::new(AtomicBool::new(false));
    let load = drive(addr, fabric.frontend_config(), cases, Arc::clone(&stop));
    let new = placement(dir.path(), "new.toml", "12-31", "0-15");
    let r = rebalance(addr, &topology, &new);
    assert_eq!(r.code, 1, "{}{}", r.stdout, r.stderr);
    assert!(
        r.stderr.contains("undone") && r.stderr.contains("expert_memory"),
        "{}",
        r.stderr
    );
    // A placement naming a device the fabric does not have is refused before anything moves
    // (checked against the topology here, so sent with a topology of three devices).
    let three = dir.path().join("three.toml");
    let text = std::fs::read_to_string(&topology).unwrap().replace(
        "devices = [\n",
        "devices = [\n  { name = \"cpu9\", kind = \"cpu\", arch = \"cpu\", threads = 1, expert_memory = \"80 MiB\", memory_bandwidth_gb_s = 20, numa = 0 },\n",
    );
    std::fs::write(&three, text).unwrap();
    let r = rebalance(
        addr,
        &three,
        &placement(dir.path(), "p3.toml", "0-19", "16-31"),
    );
    assert_eq!(r.code, 1, "{}{}", r.stdout, r.stderr);
    assert!(r.stderr.contains("not a worker"), "{}", r.stderr);
    // Given the served placement, the same change is planned in steps that each fit, and
    // applied one after the other.
    let served = root().join("examples/single-host-demo-small.placement.toml");
    let r = rebalance_with(
        addr,
        &topology,
        &[
            "--from".as_ref(),
            served.as_os_str(),
            "--placement".as_ref(),
            new.as_os_str(),
        ],
    );
    crate::support::say(&r.stdout);
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    assert!(
        r.stdout.contains(" steps)") && r.stdout.contains("step 2 of"),
        "{}",
        r.stdout
    );
    // Draining a device whose experts the other has no room for is refused before anything
    // is sent.
    let r = rebalance_with(
        addr,
        &topology,
        &[
            "--from".as_ref(),
            new.as_os_str(),
            "--drain".as_ref(),
            "local/cpu1".as_ref(),
        ],
    );
    assert_eq!(r.code, 2, "{}{}", r.stdout, r.stderr);
    assert!(
        r.stderr.contains("no other device has a free expert slot"),
        "{}",
        r.stderr
    );
    load.answers_more(8);
    stop_and_check(&stop, load);
}

#[test]
fn a_drained_device_serves_nothing_and_its_worker_stops_with_no_call_failing() {
    let _machine = crate::support::shared();
    let dir = tempfile::tempdir().unwrap();
    let (mut fabric, topology) = fabric(dir.path(), "256 MiB");
    let cases = cases(&fabric);
    let addr = fabric.frontend_addr();
    let stop = Arc::new(AtomicBool::new(false));
    let load = drive(addr, fabric.frontend_config(), cases, Arc::clone(&stop));
    let served = root().join("examples/single-host-demo-small.placement.toml");
    let out = dir.path().join("drained.toml");
    let r = command_with(
        "drain",
        addr,
        &topology,
        &[
            "--from".as_ref(),
            served.as_os_str(),
            "--device".as_ref(),
            "local/cpu1".as_ref(),
            "--out".as_ref(),
            out.as_os_str(),
        ],
    );
    crate::support::say(&r.stdout);
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    // cpu1 held 16-31 and 0-3 of each layer; 20-31 only it: 12 x 4 layers move to cpu0.
    assert!(
        r.stdout.contains("local/cpu1 drained is served")
            && r.stdout
                .contains("local/cpu1 serves nothing now: stop its worker"),
        "{}",
        r.stdout
    );
    assert!(
        r.stdout.contains("48 experts loaded, 80 released"),
        "{}",
        r.stdout
    );
    let written = std::fs::read_to_string(&out).unwrap();
    assert!(written.contains("local/cpu0"), "{written}");
    // Its worker stops; calls go on, every one right.
    fabric.kill_worker(1).unwrap();
    load.answers_more(8);
    stop_and_check(&stop, load);
}

#[test]
fn a_device_that_joins_a_running_fabric_takes_experts_with_no_call_failing() {
    let _machine = crate::support::shared();
    let dir = tempfile::tempdir().unwrap();
    // A third device declared in the topology, holding nothing in the served placement.
    let topology = crate::support::with_third_cpu(
        &root().join("examples/single-host-2routers.toml"),
        &dir.path().join("topology.toml"),
    );
    let mut o: LocalFabricOptions = crate::support::demo_options(
        "single-host-2routers.toml",
        expertmesh_transport::mesh::LinkKind::Tcp,
    );
    o.topology = topology.clone();
    o.log_dir = Some(dir.path().join("logs"));
    let mut fabric = LocalFabric::start(o).expect("the fabric starts");
    // The spare's worker is down, then joins while calls run.
    fabric.kill_worker(2).unwrap();
    let cases = cases(&fabric);
    let addr = fabric.frontend_addr();
    let stop = Arc::new(AtomicBool::new(false));
    let load = drive(addr, fabric.frontend_config(), cases, Arc::clone(&stop));
    let announced = fabric.router(0).unwrap().stats().holdings;
    fabric.restart_worker(2).unwrap();
    crate::support::wait_for(
        "the joined worker never announced",
        Duration::from_millis(10),
        || fabric.router(0).unwrap().stats().holdings != announced,
    );
    let path = placement_of(
        dir.path(),
        "three.toml",
        "single-host",
        &[
            ("local/cpu0", "0-10"),
            ("local/cpu1", "11-21"),
            ("local/cpu2", "22-31"),
        ],
    );
    // Per layer cpu2 gains 22-31 and cpu1 gains 11-15: 15 x 4 layers.
    rebalance_applied(addr, &topology, &path, "60 experts loaded");
    load.answers_more(8);
    stop_and_check(&stop, load);
}

#[test]
fn a_router_restarted_during_a_change_routes_by_what_the_workers_hold() {
    let _machine = crate::support::shared();
    let dir = tempfile::tempdir().unwrap();
    let (mut fabric, topology) = fabric(dir.path(), "256 MiB");
    let cases = cases(&fabric);
    let addrs: Vec<SocketAddr> = fabric.frontend_addrs().into_iter().flatten().collect();
    // Load on router 1, which keeps running.
    let stop = Arc::new(AtomicBool::new(false));
    let load = drive(
        addrs[1],
        fabric.frontend_config(),
        Arc::clone(&cases),
        Arc::clone(&stop),
    );
    let new = placement(dir.path(), "new.toml", "12-31", "0-15");
    let announced = fabric.router(0).unwrap().stats().holdings;
    let change = Command::new(crate::support::bin())
        .args(["rebalance", "--router", &addrs[0].to_string()])
        .args(["--model", "demo-small", "--timeout-s", "60"])
        .arg("--topology")
        .arg(&topology)
        .arg("--placement")
        .arg(&new)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Router 0, the coordinator, restarts with its placement file (the old placement) once
    // the change is under way (the workers answered its survey).
    crate::support::wait_for("the change never started", Duration::from_millis(1), || {
        fabric.router(0).unwrap().stats().holdings >= announced + 2
    });
    fabric.restart_router(0).unwrap();
    let o = change.wait_with_output().unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    crate::support::say(&format!("the change during the restart: {said}"));
    // Done before the restart (0), or cut off with its connection (2); never half-served.
    assert!(matches!(o.status.code(), Some(0 | 2)), "{said}");
    // The restarted router answers right at once: it routes by the workers' announcements,
    // not by its file.
    let rt = rt();
    let mut client = rt
        .block_on(RouterClient::connect(addrs[0], &fabric.frontend_config()))
        .unwrap();
    for (layer, x, want) in cases.iter() {
        let got = rt
            .block_on(client.call(*layer, x, 1024, None, Some(Duration::from_secs(20))))
            .unwrap();
        assert_eq!(bits(&got), *want, "layer {layer}");
    }
    // Asked again, the change completes from what the workers hold.
    let r = rebalance(addrs[0], &topology, &new);
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    stop_and_check(&stop, load);
}

#[test]
fn automatic_rebalancing_follows_the_routed_load_with_no_failed_and_no_wrong_call() {
    use expertmesh_fabric::auto_rebalance::{AutoOptions, AutoRebalancer, Round};
    let _machine = crate::support::shared();
    let dir = tempfile::tempdir().unwrap();
    // A lopsided start: cpu0 serves 28 of each layer's 32 experts.
    let lopsided = placement(dir.path(), "lopsided.toml", "0-27", "28-31");
    let (fabric, _) = fabric_serving(dir.path(), "256 MiB", Some(lopsided));
    let cases = cases(&fabric);
    let addr = fabric.frontend_addr();
    let stop = Arc::new(AtomicBool::new(false));
    let load = drive(addr, fabric.frontend_config(), cases, Arc::clone(&stop));
    let router = fabric.router(0).unwrap();
    let dep = fabric.deployment();
    let opts = AutoOptions {
        every: Duration::from_millis(500),
        min_gain: 1.2,
        // Enough tokens per window for the case mix to show, however slowly they come.
        min_tokens: 400,
        timeout: Duration::from_secs(60),
    };
    let auto = AutoRebalancer::start(
        opts,
        router.placement_handle(),
        Arc::clone(router.metrics()),
        dep.topology.clone(),
        dep.spec.clone(),
        dep.placement.clone(),
    )
    .unwrap();
    // Until a change was applied and a round after it decided (bounded, not timed: the
    // rounds come as fast as the machine routes tokens).
    let until = std::time::Instant::now() + Duration::from_secs(180);
    let (rounds, at) = loop {
        let rounds = auto.rounds();
        let at = rounds
            .iter()
            .position(|r| matches!(r, Round::Applied { .. }));
        if let Some(at) = at
            && rounds[at + 1..]
                .iter()
                .any(|r| matches!(r, Round::Kept { .. } | Round::Applied { .. }))
        {
            break (rounds, at);
        }
        assert!(
            std::time::Instant::now() < until,
            "no change applied and decided after: {rounds:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    drop(auto);
    stop.store(true, Ordering::Relaxed);
    let (ok, wrong, failed, first) = load.thread.join().unwrap();
    crate::support::say(&format!(
        "automatic rebalancing: {rounds:?}; {ok} calls right, {wrong} wrong, {failed} failed"
    ));
    assert!(ok > 0);
    assert_eq!((wrong, failed), (0, 0), "{first:?}");
    assert!(
        !rounds.iter().any(|r| matches!(r, Round::Failed { .. })),
        "{rounds:?}"
    );
    // A window with too little traffic grows into the next round's.
    for w in rounds.windows(2) {
        if let [
            Round::TooLittleTraffic { tokens: a },
            Round::TooLittleTraffic { tokens: b },
        ] = w
        {
            assert!(b >= a, "{rounds:?}");
        }
    }
    let Round::Applied {
        predicted_gain,
        loaded,
        released,
        ..
    } = rounds[at]
    else {
        unreachable!("found above")
    };
    assert!(
        predicted_gain >= 1.2 && loaded > 0 && released > 0,
        "{rounds:?}"
    );
    // The next decision, on the load routed since, predicts less than the change did.
    let next = rounds[at + 1..]
        .iter()
        .find_map(|r| match r {
            Round::Kept { predicted_gain } | Round::Applied { predicted_gain, .. } => {
                Some(*predicted_gain)
            }
            _ => None,
        })
        .unwrap();
    assert!(next < predicted_gain, "{rounds:?}");
}

/// Live changes on a node that fans dispatches out to its devices (per-node dedup): experts
/// move between node b's two devices and onto node b from node a, under checked pipelined
/// load, and back. The node's devices tell each other what they serve, so its leader forwards
/// by the new sets; a pair that reaches the leader before the announcement goes back to the
/// router, which sends it to its owner directly. Then the node's leader is drained and its
/// worker stopped. No call fails, none is wrong, and a batch is still one part per node.
#[test]
fn live_changes_on_a_fanning_out_node_have_no_failed_and_no_wrong_call() {
    let _machine = crate::support::shared();
    let dir = tempfile::tempdir().unwrap();
    let mut fabric = crate::node_fanout::start_with(
        LayerMode::Exact,
        "tests/data/three-nodes-demo-small.placement.toml",
    );
    let topology = root().join("tests/data/three-nodes.toml");
    let cases = cases(&fabric);
    let addr = fabric.frontend_addr();
    let stop = Arc::new(AtomicBool::new(false));
    let load = drive(
        addr,
        fabric.frontend_config(),
        Arc::clone(&cases),
        Arc::clone(&stop),
    );
    // a/cpu0 0-15, b/cpu1 16-23, b/cpu2 24-31, c/cpu3 24-31  ->  a/cpu0 0-11,
    // b/cpu1 12-15 and 24-31, b/cpu2 16-23: per layer cpu1 gains 12 and loses 8, cpu2 gains
    // 8 and loses 8, cpu0 loses 4.
    let new = placement_of(
        dir.path(),
        "moved.toml",
        "three-nodes",
        &[
            ("a/cpu0", "0-11"),
            ("b/cpu1", "12-15,24-31"),
            ("b/cpu2", "16-23"),
            ("c/cpu3", "24-31"),
        ],
    );
    rebalance_applied(addr, &topology, &new, "80 experts loaded, 80 released");
    let old = root().join("tests/data/three-nodes-demo-small.placement.toml");
    rebalance_applied(addr, &topology, &old, "80 experts loaded, 80 released");
    rebalance_applied(addr, &topology, &new, "80 experts loaded, 80 released");
    // Drain node b's leader (the lowest device of the node a router plans for): its experts
    // move away, node b is reached through b/cpu2 alone, and its worker stops.
    let r = command_with(
        "drain",
        addr,
        &topology,
        &[
            "--from".as_ref(),
            new.as_os_str(),
            "--device".as_ref(),
            "b/cpu1".as_ref(),
        ],
    );
    crate::support::say(&r.stdout);
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    assert!(
        r.stdout.contains("b/cpu1 serves nothing now"),
        "{}",
        r.stdout
    );
    fabric.kill_worker(1).unwrap();
    load.answers_more(8);
    stop_and_check(&stop, load);
    // Sequential calls now: exact, one part per node.
    crate::node_fanout::one_part_per_node_exact(&fabric);
    fabric.shutdown();
}
