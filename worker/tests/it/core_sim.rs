//! The router core against simulated workers running the real dispatch executor and CPU
//! backend, in process and with a virtual clock: bit-identical to the reference layer in exact
//! mode whatever the placement, failover to replicas, errors within deadlines, bad input.

use crate::support::{bits, with_executors};
use expertmesh_quant::contract::ComputeMode;
use expertmesh_router::core::{LayerMode, RouterConfig, SharedSite};
use expertmesh_router::plan::Replicas;
use expertmesh_router::reference::{self, LayerWeights};
use expertmesh_router::sim::Sim;
use expertmesh_topology::model::{ModelSpec, preset_by_name};
use expertmesh_transport::codec::{ErrorCode, LayerRequest};
use expertmesh_transport::dtype::ActivationDtype;
use std::collections::HashMap;
use std::time::Duration;

const SEED: u64 = 77;

/// `assign[d]` = experts of device d (mesh rank d + 1) for every layer; the cluster and its
/// weights.
fn build(
    spec: &ModelSpec,
    assign: &[Vec<u32>],
    shared: SharedSite,
    cfg: RouterConfig,
) -> (Sim, HashMap<u32, LayerWeights>) {
    build_with(spec, assign, shared, cfg, |_| {})
}

/// [`build`], with the router's replica state adjusted by `tweak` (nodes, dedup).
fn build_with(
    spec: &ModelSpec,
    assign: &[Vec<u32>],
    shared: SharedSite,
    cfg: RouterConfig,
    tweak: impl FnOnce(&mut Replicas) + 'static,
) -> (Sim, HashMap<u32, LayerWeights>) {
    let builder = Sim::builder(spec, assign)
        .shared(shared)
        .config(cfg)
        .seed(SEED)
        .replicas(tweak);
    let sim = with_executors(builder);
    let layers = sim.layers.clone();
    (sim, layers)
}

/// The default settings (exact mode) without a batch window: requests go out at once.
fn at_once() -> RouterConfig {
    RouterConfig {
        batch_window: Duration::ZERO,
        ..RouterConfig::default()
    }
}

fn run_exact_case(spec_name: &str, assign: Vec<Vec<u32>>, shared: SharedSite) {
    let spec = preset_by_name(spec_name).unwrap();
    let cfg = RouterConfig {
        micro_batch_tokens: 3,
        ..at_once()
    };
    let (mut sim, layers) = build(&spec, &assign, shared, cfg);
    let h = spec.hidden as usize;
    for (i, layer) in spec.moe_layer_ids().into_iter().enumerate() {
        for tokens in [1usize, 5, 11] {
            let x = reference::synthetic_hidden(i as u64 * 100 + tokens as u64, tokens, h);
            let id = (layer as u64) << 16 | tokens as u64;
            sim.request(id, layer, &x);
            let got = sim.take(id).expect("answered").expect("succeeded");
            let (_, want) =
                reference::moe_layer(&spec, &layers[&layer], &x, ComputeMode::Exact).unwrap();
            assert_eq!(
                bits(&got),
                bits(&want),
                "{spec_name} layer {layer} tokens {tokens}: fabric != reference"
            );
        }
    }
}

#[test]
fn exact_mode_is_bit_identical_to_the_reference_for_any_placement() {
    // toy-grouped: 16 experts in 4 groups, top-4, one shared expert.
    let one: Vec<Vec<u32>> = vec![(0..16).collect()];
    let split: Vec<Vec<u32>> = vec![(0..8).collect(), (8..16).collect()];
    let scattered: Vec<Vec<u32>> = vec![
        vec![0, 5, 9, 13, 2],
        vec![1, 6, 10, 14, 3, 7],
        vec![4, 8, 11, 12, 15, 0, 5],
    ];
    run_exact_case("toy-grouped", one, SharedSite::Router);
    run_exact_case("toy-grouped", split.clone(), SharedSite::Rank(2));
    run_exact_case("toy-grouped", scattered, SharedSite::Rank(1));
    run_exact_case(
        "toy-softmax",
        vec![(0..4).collect(), (4..8).collect()],
        SharedSite::None,
    );
    run_exact_case(
        "toy-mixtral",
        vec![vec![0, 1], vec![2, 3], vec![1, 2]],
        SharedSite::None,
    );
}

#[test]
fn accurate_mode_is_within_tolerance_of_f64() {
    let spec = preset_by_name("toy-grouped").unwrap();
    let assign: Vec<Vec<u32>> = vec![(0..8).collect(), (8..16).collect()];
    let cfg = RouterConfig {
        mode: LayerMode::Accurate,
        ..at_once()
    };
    let (mut sim, layers) = build(&spec, &assign, SharedSite::Rank(1), cfg);
    let h = spec.hidden as usize;
    let layer = spec.moe_layer_ids()[0];
    let x = reference::synthetic_hidden(3, 9, h);
    sim.request(1, layer, &x);
    let got = sim.take(1).unwrap().unwrap();
    let lw = &layers[&layer];
    let logits = lw.gate.logits(&x);
    let routing = expertmesh_router::gating::route(&spec, &logits, &lw.gate.bias).unwrap();
    let truth = reference::moe_layer_f64(lw, &x, &routing);
    let err = reference::rel_error_vs_rms(&got, &truth);
    assert!(err < 1e-4, "accurate fabric error {err}");
}

#[test]
fn requests_close_together_are_batched() {
    let spec = preset_by_name("toy-softmax").unwrap();
    let assign: Vec<Vec<u32>> = vec![(0..8).collect()];
    let cfg = RouterConfig {
        batch_window: Duration::from_millis(1),
        ..RouterConfig::default()
    };
    let (mut sim, layers) = build(&spec, &assign, SharedSite::None, cfg);
    let h = spec.hidden as usize;
    let xa = reference::synthetic_hidden(1, 2, h);
    let xb = reference::synthetic_hidden(2, 3, h);
    sim.request(1, 0, &xa);
    sim.request(2, 0, &xb);
    assert!(
        sim.replies.is_empty(),
        "nothing is sent before the window closes"
    );
    sim.advance(Duration::from_millis(2));
    assert_eq!(
        sim.core.stats().batches,
        1,
        "both requests went out as one batch"
    );
    for (id, x) in [(1u64, &xa), (2, &xb)] {
        let got = sim.take(id).unwrap().unwrap();
        let (_, want) = reference::moe_layer(&spec, &layers[&0], x, ComputeMode::Exact).unwrap();
        assert_eq!(bits(&got), bits(&want));
    }
}

#[test]
fn a_dead_worker_fails_over_to_a_replica_with_identical_bits() {
    let spec = preset_by_name("toy-softmax").unwrap();
    // every expert on both workers
    let assign: Vec<Vec<u32>> = vec![(0..8).collect(), (0..8).collect()];
    let cfg = at_once();
    let (mut sim, layers) = build(&spec, &assign, SharedSite::None, cfg);
    let h = spec.hidden as usize;
    let x = reference::synthetic_hidden(9, 16, h);
    let (_, want) = reference::moe_layer(&spec, &layers[&1], &x, ComputeMode::Exact).unwrap();
    // worker rank 1 dies before the send completes
    sim.down.push(1);
    sim.request(1, 1, &x);
    let got = sim.take(1).unwrap().expect("completed through the replica");
    assert_eq!(bits(&got), bits(&want));
    // the link loss is noticed: later batches avoid rank 1 from the start
    sim.core.on_peer_lost(1, sim.now);
    sim.request(2, 1, &x);
    assert_eq!(bits(&sim.take(2).unwrap().unwrap()), bits(&want));
    // it comes back and is used again
    sim.down.clear();
    sim.core.on_peer_up(1);
    sim.request(3, 1, &x);
    assert_eq!(bits(&sim.take(3).unwrap().unwrap()), bits(&want));
}

#[test]
fn a_silent_worker_is_hedged_to_a_replica_then_a_lone_owner_fails_by_the_deadline() {
    let spec = preset_by_name("toy-softmax").unwrap();
    let cfg = RouterConfig {
        straggler_timeout: Duration::from_millis(100),
        default_deadline: Duration::from_millis(500),
        ..at_once()
    };
    // replicated: rank 1 silent, rank 2 answers after the straggler timeout
    let (mut sim, layers) = build(
        &spec,
        &[(0..8).collect(), (0..8).collect()],
        SharedSite::None,
        cfg.clone(),
    );
    let h = spec.hidden as usize;
    let x = reference::synthetic_hidden(4, 8, h);
    sim.silent.push(1);
    sim.core.on_peer_up(1);
    // make rank 1 the preferred owner by loading rank 2
    sim.request(1, 0, &x);
    if !sim.answered(1) {
        sim.advance(Duration::from_millis(150));
    }
    let got = sim.take(1).unwrap().expect("hedged to the replica");
    assert!(
        sim.core.stats().parts_redispatched > 0,
        "the silent worker's share was re-sent"
    );
    let (_, want) = reference::moe_layer(&spec, &layers[&0], &x, ComputeMode::Exact).unwrap();
    assert_eq!(bits(&got), bits(&want));

    // single owner that never answers: error by the deadline, naming the device
    let (mut sim, _) = build(&spec, &[(0..8).collect()], SharedSite::None, cfg);
    sim.silent.push(1);
    sim.submit(1, 7, 0, x.clone(), Duration::from_millis(500));
    sim.pump();
    sim.advance(Duration::from_millis(200));
    assert!(
        sim.replies.is_empty(),
        "no replica: keep waiting until the deadline"
    );
    sim.advance(Duration::from_millis(400));
    let (code, msg) = sim.take(7).unwrap().unwrap_err();
    assert_eq!(code, ErrorCode::DeadlineExceeded);
    assert!(msg.contains("node0/dev0"), "{msg}");
    assert_eq!(sim.core.inflight(), 0, "nothing left hanging");
}

#[test]
fn no_live_owner_fails_at_once_and_others_are_unaffected() {
    let spec = preset_by_name("toy-softmax").unwrap();
    let assign: Vec<Vec<u32>> = vec![(0..4).collect(), (4..8).collect()];
    let cfg = at_once();
    let (mut sim, layers) = build(&spec, &assign, SharedSite::None, cfg);
    let h = spec.hidden as usize;
    sim.core.on_peer_lost(2, sim.now);
    sim.down.push(2);
    // find a token whose experts are all on rank 1 and one that needs rank 2
    let lw = &layers[&0];
    let mut good = None;
    let mut bad = None;
    for seed in 0..200 {
        let x = reference::synthetic_hidden(seed, 1, h);
        let r =
            expertmesh_router::gating::route(&spec, &lw.gate.logits(&x), &lw.gate.bias).unwrap();
        if r.experts.iter().all(|&e| e < 4) {
            good.get_or_insert(x);
        } else if r.experts.iter().any(|&e| e >= 4) {
            bad.get_or_insert(x);
        }
    }
    let (good, bad) = (good.unwrap(), bad.unwrap());
    sim.request(1, 0, &bad);
    sim.request(2, 0, &good);
    let (code, msg) = sim.take(1).unwrap().unwrap_err();
    assert_eq!(code, ErrorCode::PeerUnavailable);
    assert!(
        msg.contains("node0/dev1") && msg.contains("no other replica"),
        "{msg}"
    );
    let got = sim.take(2).unwrap().expect("the other request is served");
    let (_, want) = reference::moe_layer(&spec, lw, &good, ComputeMode::Exact).unwrap();
    assert_eq!(bits(&got), bits(&want));
}

#[test]
fn bad_requests_are_refused_with_named_problems() {
    let spec = preset_by_name("toy-softmax").unwrap();
    let (sim, _) = build(
        &spec,
        &[(0..8).collect()],
        SharedSite::None,
        RouterConfig::default(),
    );
    let h = spec.hidden;
    let req = |layer: u32, tokens: u32, hidden: u32| LayerRequest {
        request_id: 5,
        layer,
        tokens,
        hidden,
        dtype: ActivationDtype::F32,
        logit_experts: 0,
        deadline_us: 0,
    };
    let payload = |n: usize, v: f32| -> Vec<u8> { (0..n).flat_map(|_| v.to_le_bytes()).collect() };
    let now = sim.now;
    let e = sim
        .core
        .validate(1, &req(9, 1, h), &payload(h as usize, 0.1), now)
        .unwrap_err();
    assert_eq!(e.code, ErrorCode::NotFound);
    assert!(e.message.contains("layer 9"), "{}", e.message);
    let e = sim
        .core
        .validate(1, &req(0, 1, h + 32), &payload(h as usize + 32, 0.1), now)
        .unwrap_err();
    assert!(e.message.contains("hidden size"), "{}", e.message);
    let e = sim
        .core
        .validate(1, &req(0, 100_000, h), &payload(h as usize, 0.1), now)
        .unwrap_err();
    assert!(e.message.contains("100000 tokens"), "{}", e.message);
    let mut p = payload(2 * h as usize, 0.5);
    p[(h as usize + 3) * 4..(h as usize + 4) * 4].copy_from_slice(&f32::NAN.to_le_bytes());
    let e = sim.core.validate(1, &req(0, 2, h), &p, now).unwrap_err();
    assert_eq!(e.code, ErrorCode::InvalidInput);
    assert!(e.message.contains("token 1 element 3"), "{}", e.message);
    let mut r = req(0, 1, h);
    r.logit_experts = 3;
    let e = sim
        .core
        .validate(1, &r, &payload(h as usize + 64, 0.1), now)
        .unwrap_err();
    assert!(e.message.contains("logits"), "{}", e.message);
    assert!(
        sim.core
            .validate(1, &req(0, 2, h), &payload(2 * h as usize, 0.5), now)
            .is_ok()
    );
}

#[test]
fn overload_is_refused_not_queued_forever() {
    let spec = preset_by_name("toy-softmax").unwrap();
    let cfg = RouterConfig {
        max_inflight_batches: 2,
        ..at_once()
    };
    let (mut sim, _) = build(&spec, &[(0..8).collect()], SharedSite::None, cfg);
    sim.silent.push(1);
    let x = reference::synthetic_hidden(1, 1, spec.hidden as usize);
    for id in 0..3 {
        sim.request(id, 0, &x);
    }
    let (code, _) = sim.take(2).unwrap().unwrap_err();
    assert_eq!(code, ErrorCode::Overloaded);
    assert_eq!(sim.core.inflight(), 2);
}

#[test]
fn a_dense_layer_is_refused_as_dense() {
    // toy-grouped: 3 decoder layers, layer 0 dense, layers 1-2 MoE.
    let spec = preset_by_name("toy-grouped").unwrap();
    assert!(!spec.is_moe_layer(0) && spec.is_moe_layer(1));
    let e = spec.routed_experts;
    let (sim, _) = build(
        &spec,
        &[(0..e).collect()],
        SharedSite::None,
        RouterConfig::default(),
    );
    let h = spec.hidden;
    let req = |layer: u32| LayerRequest {
        request_id: 5,
        layer,
        tokens: 1,
        hidden: h,
        dtype: ActivationDtype::F32,
        logit_experts: 0,
        deadline_us: 0,
    };
    let payload: Vec<u8> = (0..h).flat_map(|_| 0.1f32.to_le_bytes()).collect();
    let dense = sim
        .core
        .validate(1, &req(0), &payload, sim.now)
        .unwrap_err();
    assert_eq!(dense.code, ErrorCode::NotFound);
    assert!(dense.message.contains("dense layer"), "{}", dense.message);
    let past = sim
        .core
        .validate(1, &req(3), &payload, sim.now)
        .unwrap_err();
    assert!(
        past.message.contains("past the model's last layer"),
        "{}",
        past.message
    );
    assert!(sim.core.validate(1, &req(1), &payload, sim.now).is_ok());
}

#[test]
fn a_node_leader_that_cannot_reach_a_peer_gets_its_share_sent_directly() {
    let spec = preset_by_name("toy-softmax").unwrap();
    // two devices on a remote node (node 1; the router is on node 0), experts split
    let assign: Vec<Vec<u32>> = vec![(0..4).collect(), (4..8).collect()];
    let cfg = at_once();
    let (mut sim, layers) = build_with(&spec, &assign, SharedSite::None, cfg, |r| {
        r.node = vec![0, 1, 1];
        r.local_node = Some(0);
        r.node_dedup = true;
    });
    let h = spec.hidden as usize;
    let x = reference::synthetic_hidden(21, 16, h);
    let (_, want) = reference::moe_layer(&spec, &layers[&1], &x, ComputeMode::Exact).unwrap();
    sim.cut_off_leaders.push(1);
    sim.request(1, 1, &x);
    let got = sim
        .take(1)
        .unwrap()
        .expect("sent again straight to the devices");
    assert_eq!(bits(&got), bits(&want));
    assert!(sim.core.stats().parts_redispatched >= 1);
}
