//! Who may join, through real processes (examples/single-host.toml, demo-small, exact mode, so
//! every answer has a golden value): a worker started with other weights (another `--seed`) or
//! another placement is refused at join and never serves a call; a second worker process for
//! a device whose worker is live is refused (the live one keeps serving, no flapping); a
//! restarted router (new incarnation, new links) answers bit for bit at once.
//!
//! The fault suite (tests/it/faults.rs) covers kills, pauses and partitions; this file checks the
//! identity and incarnation rules those rely on.

use crate::support::{bits, root, rt};
use expertmesh_fabric::local::{LocalFabric, LocalFabricOptions};
use expertmesh_quant::contract::ComputeMode;
use expertmesh_router::client::RouterClient;
use expertmesh_router::core::RouterConfig;
use expertmesh_transport::mesh::LinkKind;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

fn start() -> LocalFabric {
    let mut o = LocalFabricOptions::new(
        root().join("examples/single-host.toml"),
        "demo-small",
        root().join("examples/single-host-demo-small.placement.toml"),
    );
    o.exe = PathBuf::from(env!("CARGO_BIN_EXE_expertmesh"));
    o.ephemeral_ports = true;
    o.link = LinkKind::Tcp;
    o.router = RouterConfig {
        mode: ComputeMode::Exact.into(),
        batch_window: Duration::ZERO,
        micro_batch_tokens: 16,
        default_deadline: Duration::from_secs(20),
        ..RouterConfig::default()
    };
    o.connect_timeout = Duration::from_secs(60);
    LocalFabric::start(o).expect("fabric starts")
}

/// (layer, input, reference output bits) for every MoE layer and a few token counts.
fn cases(fabric: &LocalFabric) -> Vec<(u32, Vec<f32>, Vec<u32>)> {
    let dep = fabric.deployment();
    crate::support::reference_cases(&dep.spec, dep.seed, &[1, 7, 20], 900)
}

/// Runs every case once through router 0; returns (bit-identical, wrong, errors).
fn run_cases(fabric: &LocalFabric, cases: &[(u32, Vec<f32>, Vec<u32>)]) -> (usize, usize, usize) {
    let rt = rt();
    let cfg = fabric.frontend_config();
    let mut client = rt
        .block_on(RouterClient::connect(fabric.frontend_addr(), &cfg))
        .expect("client connects");
    let h = fabric.deployment().spec.hidden as usize;
    let (mut ok, mut wrong, mut err) = (0, 0, 0);
    for (layer, x, want) in cases {
        let d = Some(Duration::from_secs(10));
        match rt.block_on(client.call(*layer, x, h, None, d)) {
            Ok(got) if bits(&got) == *want => ok += 1,
            Ok(_) => wrong += 1,
            Err(_) => err += 1,
        }
    }
    (ok, wrong, err)
}

/// Waits until `log` contains `needle` (a refusal the process logged), or fails showing the log.
fn wait_for_log(log: &Path, needle: &str, within: Duration) {
    let t0 = Instant::now();
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        if text.contains(needle) {
            return;
        }
        assert!(
            t0.elapsed() < within,
            "{} does not say {needle:?} after {within:?}:\n{text}",
            log.display()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

struct Reaper(Child);

impl Drop for Reaper {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn workers_with_other_weights_or_placement_and_second_workers_are_refused() {
    let _machine = crate::support::shared();
    let mut fabric = start();
    let cases = cases(&fabric);
    let n = cases.len();
    assert_eq!(run_cases(&fabric, &cases), (n, 0, 0));
    let ups = fabric.service().stats().peer_ups;

    // A second process for live device 0: refused, told why; the live worker keeps serving.
    let (extra, log) = fabric.spawn_extra_worker(0, &[]).unwrap();
    let extra = Reaper(extra);
    wait_for_log(
        &log,
        "already served by a live process",
        Duration::from_secs(30),
    );
    std::thread::sleep(Duration::from_secs(2)); // its redials are refused too
    assert_eq!(run_cases(&fabric, &cases), (n, 0, 0));
    assert_eq!(
        fabric.service().stats().peer_ups,
        ups,
        "the live link was never replaced"
    );
    drop(extra);

    // Device 0's worker dies; one with other weights (seed) or another placement takes its
    // place: refused at join, so calls fail over to device 1's replicas or fail cleanly,
    // never answer wrong.
    fabric.kill_worker(0).unwrap();
    let placement = fabric.log_dir().join("other.placement.toml");
    let text =
        std::fs::read_to_string(root().join("examples/single-host-demo-small.placement.toml"))
            .unwrap()
            .replace("experts = \"0-19\"", "experts = \"0-15\"");
    std::fs::write(&placement, text).unwrap();
    let misfits: [&[(&str, &str)]; 2] = [
        &[("--seed", "7")],
        &[("--placement", placement.to_str().unwrap())],
    ];
    for overrides in misfits {
        let (w, log) = fabric.spawn_extra_worker(0, overrides).unwrap();
        let w = Reaper(w);
        wait_for_log(
            &log,
            "serves other weights or another placement",
            Duration::from_secs(60),
        );
        let (ok, wrong, err) = run_cases(&fabric, &cases);
        assert_eq!(wrong, 0, "{overrides:?}: a refused worker never answers");
        assert_eq!(ok + err, n);
        assert_eq!(
            fabric.service().stats().peer_ups,
            ups,
            "{overrides:?} was taken up"
        );
        drop(w);
    }

    // The right worker comes back and serves again.
    fabric.restart_worker(0).unwrap();
    assert_eq!(run_cases(&fabric, &cases), (n, 0, 0));
}

#[test]
fn a_restarted_router_answers_bit_for_bit_at_once() {
    let _machine = crate::support::shared();
    let mut fabric = start();
    let cases = cases(&fabric);
    let n = cases.len();
    assert_eq!(run_cases(&fabric, &cases), (n, 0, 0));
    for _ in 0..3 {
        let t0 = Instant::now();
        fabric.restart_router(0).unwrap();
        let rejoined = t0.elapsed();
        assert!(
            rejoined < Duration::from_secs(60),
            "workers rejoined the restarted router after {rejoined:?}"
        );
        assert_eq!(run_cases(&fabric, &cases), (n, 0, 0));
        assert_eq!(fabric.service().stats().stale_results, 0);
    }
}
