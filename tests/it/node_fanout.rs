//! Per-node dedup end to end: the router sends a remote node one dispatch per micro-batch, and
//! that node's leader worker shares it with the node's other device over shared memory
//! (tests/data/three-nodes.toml: router + cpu0 on node a; cpu1, cpu2 on node b; cpu3 on node c,
//! holding replicas of cpu2's experts; experts 16-23 only on cpu1).
//!
//! Checks: exact-mode answers bit-identical to the in-process reference while the router sends
//! node b at most one part per micro-batch; with cpu2 (not the leader) down, answers stay
//! bit-identical (its experts come from cpu3), and nothing wrong is ever returned while it goes
//! down; with the leader cpu1 down, requests that need experts 16-23 fail with an error naming
//! the device within their deadline and the others stay exact; once restarted, everything is
//! exact again. Through the fan-out, exact-bf16 stays bit-identical to its rounded reference
//! and serving mode (pre-combined rows summed by the leader) within its tolerance of f64.

use crate::support::{bits, root, rt};
use expertmesh_cpu_backend::CpuBackend;
use expertmesh_fabric::local::{LocalFabric, LocalFabricOptions};
use expertmesh_quant::contract::ComputeMode;
use expertmesh_router::client::{ClientError, RouterClient};
use expertmesh_router::core::{LayerMode, RouterConfig};
use expertmesh_router::reference::{self, ExpertRounding};
use expertmesh_topology::topology::DeviceRank;
use expertmesh_transport::mesh::LinkKind;
use std::path::PathBuf;
use std::time::{Duration, Instant};

fn start() -> LocalFabric {
    start_in(LayerMode::Exact)
}

fn start_in(mode: LayerMode) -> LocalFabric {
    start_with(mode, "tests/data/three-nodes-demo-small.placement.toml")
}

pub(crate) fn start_with(mode: LayerMode, placement: &str) -> LocalFabric {
    LocalFabric::start(options(mode, placement)).expect("three-node fabric starts")
}

fn options(mode: LayerMode, placement: &str) -> LocalFabricOptions {
    let mut o = LocalFabricOptions::new(
        root().join("tests/data/three-nodes.toml"),
        "demo-small",
        root().join(placement),
    );
    o.exe = PathBuf::from(env!("CARGO_BIN_EXE_expertmesh"));
    o.ephemeral_ports = true;
    o.link = LinkKind::Tcp;
    o.router = mode.apply(RouterConfig {
        batch_window: Duration::from_micros(50),
        micro_batch_tokens: 16,
        default_deadline: Duration::from_secs(10),
        ..RouterConfig::default()
    });
    o.connect_timeout = Duration::from_secs(60);
    o
}

struct Reference {
    backend: CpuBackend,
}

impl Reference {
    fn new(fabric: &LocalFabric) -> Self {
        let dep = fabric.deployment();
        let backend = expertmesh_worker::weights::reference_backend(
            &dep.spec,
            dep.seed,
            &dep.spec.moe_layer_ids(),
            1,
            64,
        )
        .unwrap();
        Self { backend }
    }

    /// (experts chosen per token, output bits)
    fn layer(&mut self, fabric: &LocalFabric, layer: u32, x: &[f32]) -> (Vec<u32>, Vec<u32>) {
        let dep = fabric.deployment();
        let gate = reference::synthetic_gate(&dep.spec, dep.seed, layer);
        let (r, out) = reference::moe_layer_backend(
            &dep.spec,
            &gate,
            layer,
            &mut self.backend,
            x,
            ComputeMode::Exact,
        )
        .unwrap();
        (r.experts, out.iter().map(|v| v.to_bits()).collect())
    }
}

/// Waits until the router sees device `d` (topology rank) connected or not.
fn wait_router_sees(fabric: &LocalFabric, d: u32, connected: bool) {
    let rank = fabric.deployment().mesh_rank(DeviceRank(d));
    let t0 = Instant::now();
    while fabric.service().is_connected(rank) != connected {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "device {d} connected={connected}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_remote_node_gets_one_dispatch_and_answers_bit_identically() {
    let _machine = crate::support::shared();
    remote_node_exact(start());
}

#[test]
fn a_shared_expert_on_a_remote_node_is_forwarded_too() {
    let _machine = crate::support::shared();
    // The shared expert lives on b/cpu2, not on node b's leader.
    remote_node_exact(start_with(
        LayerMode::Exact,
        "tests/data/three-nodes-demo-small-shared-b.placement.toml",
    ));
}

fn remote_node_exact(fabric: LocalFabric) {
    one_part_per_node_exact(&fabric);
    fabric.shutdown();
}

/// Sequential calls of 1, 5 and 16 tokens to every MoE layer: each answer bit-identical to
/// the in-process reference, and each batch sent as at most one part per node (per-node
/// dedup: a remote node's devices are reached through its leader).
pub(crate) fn one_part_per_node_exact(fabric: &LocalFabric) {
    let spec = fabric.deployment().spec.clone();
    let h = spec.hidden as usize;
    let mut reference = Reference::new(fabric);
    let rt = rt();
    let mut client = rt
        .block_on(RouterClient::connect(
            fabric.frontend_addr(),
            &fabric.frontend_config(),
        ))
        .unwrap();
    let before = fabric.service().stats();
    let mut calls = 0;
    for (i, layer) in spec.moe_layer_ids().into_iter().enumerate() {
        for tokens in [1usize, 5, 16] {
            let x = reference::synthetic_hidden(i as u64 * 31 + tokens as u64, tokens, h);
            let got = rt.block_on(client.call(layer, &x, h, None, None)).unwrap();
            let (_, want) = reference.layer(fabric, layer, &x);
            assert_eq!(bits(&got), want, "layer {layer} tokens {tokens}");
            calls += 1;
        }
    }
    let s = fabric.service().stats();
    let (batches, parts) = (s.batches - before.batches, s.parts_sent - before.parts_sent);
    assert_eq!(
        batches, calls,
        "one batch (one micro-batch) per sequential call"
    );
    // Four devices on three nodes: with per-node dedup a batch has at most one part per node.
    assert!(parts <= 3 * batches, "{parts} parts for {batches} batches");
    assert_eq!(s.failures, 0, "{s:?}");
}

/// Sends `n` calls of `tokens` tokens to the first MoE layer; returns (exact, wrong, errors with their messages).
fn round(
    fabric: &LocalFabric,
    reference: &mut Reference,
    rt: &tokio::runtime::Runtime,
    client: &mut RouterClient,
    salt: u64,
    n: usize,
    tokens: usize,
) -> (usize, usize, Vec<(Vec<u32>, String)>) {
    let spec = fabric.deployment().spec.clone();
    let h = spec.hidden as usize;
    let layer = spec.moe_layer_ids()[0];
    let (mut ok, mut wrong, mut errs) = (0, 0, Vec::new());
    for i in 0..n {
        let x = reference::synthetic_hidden(salt * 1000 + i as u64, tokens, h);
        let (experts, want) = reference.layer(fabric, layer, &x);
        let t0 = Instant::now();
        // A deadline a loaded machine cannot miss: rounds that must be served whole assert
        // so, and a device that is down is answered for at once (no owner, or a lost link).
        match rt.block_on(client.call(layer, &x, h, None, Some(Duration::from_secs(20)))) {
            Ok(got) if bits(&got) == want => ok += 1,
            Ok(_) => wrong += 1,
            Err(e @ ClientError::Server { .. }) => errs.push((experts, e.to_string())),
            Err(e) => panic!("the connection itself failed: {e}"),
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "call {i} hung past its deadline"
        );
    }
    (ok, wrong, errs)
}

#[test]
fn fan_out_with_a_device_down() {
    let _machine = crate::support::shared();
    let mut fabric = start();
    let mut reference = Reference::new(&fabric);
    let rt = rt();
    let mut client = rt
        .block_on(RouterClient::connect(
            fabric.frontend_addr(),
            &fabric.frontend_config(),
        ))
        .unwrap();
    // cpu2 (node b, not the leader) goes down: nothing wrong while it goes, then all exact
    fabric.kill_worker(2).unwrap();
    let (_, wrong, _) = round(&fabric, &mut reference, &rt, &mut client, 1, 10, 8);
    assert_eq!(wrong, 0);
    wait_router_sees(&fabric, 2, false);
    let (ok, wrong, errs) = round(&fabric, &mut reference, &rt, &mut client, 2, 20, 8);
    assert_eq!(
        (ok, wrong),
        (20, 0),
        "with cpu2 down its experts come from cpu3: {errs:?}"
    );
    // the leader cpu1 goes down: experts 16-23 have no other home (1-token calls: about a
    // third of them need none of 16-23)
    fabric.kill_worker(1).unwrap();
    wait_router_sees(&fabric, 1, false);
    let (ok, wrong, errs) = round(&fabric, &mut reference, &rt, &mut client, 3, 30, 1);
    assert_eq!(wrong, 0);
    assert!(
        ok > 0 && !errs.is_empty(),
        "some calls need 16-23, some not: {ok} ok, {errs:?}"
    );
    for (experts, msg) in &errs {
        assert!(
            experts.iter().any(|e| (16..24).contains(e)),
            "{experts:?}: {msg}"
        );
        assert!(msg.contains("16") || msg.contains("b/cpu1"), "{msg}");
    }
    // both come back: exact again
    fabric.restart_worker(1).unwrap();
    fabric.restart_worker(2).unwrap();
    wait_router_sees(&fabric, 1, true);
    wait_router_sees(&fabric, 2, true);
    let (ok, wrong, errs) = round(&fabric, &mut reference, &rt, &mut client, 4, 20, 8);
    assert_eq!((ok, wrong), (20, 0), "after the restarts: {errs:?}");
    fabric.shutdown();
}

#[test]
fn leaner_modes_through_the_fan_out() {
    let _machine = crate::support::shared();
    let spec = expertmesh_topology::model::preset_by_name("demo-small").unwrap();
    let h = spec.hidden as usize;
    let layer = spec.moe_layer_ids()[1];
    let x = reference::synthetic_hidden(77, 16, h);
    let mut be = expertmesh_worker::weights::reference_backend(&spec, 42, &[layer], 1, 64).unwrap();
    let gate = reference::synthetic_gate(&spec, 42, layer);
    let (m, r) = (ComputeMode::Exact, ExpertRounding::Bf16);
    let (routing, want_bf16) =
        reference::moe_layer_backend_rounded(&spec, &gate, layer, &mut be, &x, m, r).unwrap();
    let truth = reference::moe_layer_f64(
        &reference::synthetic_layer(&spec, 42, layer).unwrap(),
        &x,
        &routing,
    );
    let rt = rt();
    for mode in [LayerMode::ExactBf16, LayerMode::Serving] {
        let fabric = start_in(mode);
        let mut c = rt
            .block_on(RouterClient::connect(
                fabric.frontend_addr(),
                &fabric.frontend_config(),
            ))
            .unwrap();
        let got = rt.block_on(c.call(layer, &x, h, None, None)).unwrap();
        let s = fabric.service().stats();
        assert!(s.parts_sent <= 3 * s.batches, "{s:?}");
        if mode == LayerMode::ExactBf16 {
            assert_eq!(
                bits(&got),
                bits(&want_bf16),
                "exact-bf16 through the fan-out"
            );
        } else {
            let worst = reference::rel_error_vs_rms(&got, &truth);
            let rms = reference::rms_error(&got, &truth);
            assert!(
                worst < 0.12 && rms < 0.02,
                "serving: worst {worst}, rms {rms}"
            );
        }
        fabric.shutdown();
    }
}

/// demo-small on three-nodes with experts 16-23 only on b/cpu1 (node b's leader) and 24-31
/// only on b/cpu2: a call that needs both is computed partly by the leader and partly by the
/// share it forwards to cpu2.
const NO_REPLICA_ON_C: &str = r#"format = 1
model = "demo-small"
cluster = "three-nodes"

[[assign]]
layers = "all"
device = "a/cpu0"
experts = "0-15"

[[assign]]
layers = "all"
device = "b/cpu1"
experts = "16-23"

[[assign]]
layers = "all"
device = "b/cpu2"
experts = "24-31"

[[assign]]
layers = "all"
device = "c/cpu3"
experts = "0-7"

[[shared]]
layers = "all"
device = "router"
"#;

/// A node's leader told to stop (SIGTERM) while a dispatch it forwarded waits for its node
/// peer (stopped with SIGSTOP) keeps reading the peer's answer, answers the router, then
/// exits: the call that needs both devices of the node is answered bit for bit. (It used to
/// return once its queue was empty, and the call failed naming the leader.)
#[test]
fn a_leader_told_to_stop_finishes_what_its_node_peer_still_computes() {
    let _machine = crate::support::shared();
    let dir = tempfile::tempdir().unwrap();
    let placement = dir.path().join("placement.toml");
    std::fs::write(&placement, NO_REPLICA_ON_C).unwrap();
    let mut o = options(LayerMode::Exact, placement.to_str().unwrap());
    let leader_metrics = std::net::SocketAddr::from(([127, 0, 0, 1], crate::support::free_port()));
    // Device ranks: a/cpu0, b/cpu1, b/cpu2, c/cpu3; only the leader's endpoint is read.
    o.worker_metrics = (0..4)
        .map(|d| {
            if d == 1 {
                leader_metrics
            } else {
                std::net::SocketAddr::from(([127, 0, 0, 1], crate::support::free_port()))
            }
        })
        .collect();
    let fabric = LocalFabric::start(o).expect("three-node fabric starts");
    let url = format!("http://{leader_metrics}/metrics");
    let dispatches = || {
        let (_, text) = crate::metrics::http_get(&url);
        crate::metrics::Scrape::parse(&text).sum("expertmesh_worker_dispatches_total", &[])
    };
    let spec = fabric.deployment().spec.clone();
    let h = spec.hidden as usize;
    let layer = spec.moe_layer_ids()[0];
    let mut reference = Reference::new(&fabric);
    // Tokens that need experts of both devices of node b.
    let (x, want) = (0..64)
        .find_map(|seed| {
            let x = reference::synthetic_hidden(7000 + seed, 8, h);
            let (experts, want) = reference.layer(&fabric, layer, &x);
            let needs = |r: std::ops::Range<u32>| experts.iter().any(|e| r.contains(e));
            (needs(16..24) && needs(24..32)).then_some((x, want))
        })
        .expect("8 tokens that need experts 16-23 and 24-31");
    let addr = fabric.frontend_addr();
    let cfg = fabric.frontend_config();
    let rt = rt();
    let mut client = rt.block_on(RouterClient::connect(addr, &cfg)).unwrap();
    let warm = rt.block_on(client.call(layer, &x, h, None, None)).unwrap();
    assert_eq!(bits(&warm), want);
    let before = dispatches();
    fabric.signal_worker(2, libc::SIGSTOP).unwrap();
    drop(client);
    // On a runtime of its own, which this thread does not block.
    let call = std::thread::spawn(move || {
        let deadline = Some(Duration::from_secs(30));
        crate::support::rt().block_on(async {
            let mut client = RouterClient::connect(addr, &cfg).await?;
            client.call(layer, &x, h, None, deadline).await
        })
    });
    // The leader has run its own share, so the peer's is on its way to the stopped cpu2.
    let t0 = Instant::now();
    while dispatches() <= before {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the leader never ran its share"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    fabric.signal_worker(1, libc::SIGTERM).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    fabric.signal_worker(2, libc::SIGCONT).unwrap();
    let got = call.join().unwrap();
    let got = got.unwrap_or_else(|e| panic!("the call through the stopping leader failed: {e}"));
    assert_eq!(bits(&got), want, "bit for bit through the stopping leader");
    fabric.shutdown();
}
