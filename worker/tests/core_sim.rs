//! The router core against simulated workers running the real dispatch executor and CPU
//! backend, in process and with a virtual clock: bit-identical to the reference layer in exact
//! mode whatever the placement, failover to replicas, errors within deadlines, bad input.

use expertmesh_backend::{BatchLimits, ExpertBackend, ExpertKey};
use expertmesh_cpu_backend::CpuBackend;
use expertmesh_quant::contract::ComputeMode;
use expertmesh_router::core::{
    Action, LayerSetup, Request, RouterConfig, RouterCore, SharedRunner, SharedSite,
};
use expertmesh_router::plan::{LayerOwners, Replicas};
use expertmesh_router::ranks::RankNames;
use expertmesh_router::reference::{self, LayerWeights};
use expertmesh_router::service::fresh_incarnation;
use expertmesh_topology::model::{ModelSpec, preset_by_name};
use expertmesh_transport::codec::{Body, ErrorCode, LayerRequest};
use expertmesh_transport::dtype::ActivationDtype;
use expertmesh_worker::exec::DispatchExecutor;
use std::collections::HashMap;
use std::time::{Duration, Instant};

const SEED: u64 = 77;

/// A simulated cluster: mesh rank 0 is the router, ranks 1.. are workers.
struct Sim {
    core: RouterCore,
    workers: HashMap<u32, DispatchExecutor>,
    down: Vec<u32>,
    /// Workers that receive frames but never answer.
    silent: Vec<u32>,
    /// Node leaders that cannot reach their node peers: a dispatch holding experts they do not
    /// own is answered with PeerUnavailable (as `worker::fanout` does).
    cut_off_leaders: Vec<u32>,
    now: Instant,
    responses: HashMap<u64, Result<Vec<f32>, (ErrorCode, String)>>,
}

struct RouterShared {
    spec: ModelSpec,
    layers: HashMap<u32, LayerWeights>,
}

impl SharedRunner for RouterShared {
    fn run(
        &mut self,
        layer: u32,
        x: &[f32],
        tokens: usize,
        _mode: ComputeMode,
        out: &mut [f32],
    ) -> Result<(), expertmesh_backend::BackendError> {
        let h = self.spec.hidden as usize;
        let lw = &self.layers[&layer];
        let s = lw.shared.len();
        for t in 0..tokens {
            let qa = expertmesh_quant::reference::QuantizedVec::new(&x[t * h..(t + 1) * h]);
            for (i, w) in lw.shared.iter().enumerate() {
                expertmesh_quant::reference::expert_ffn_exact_quantized(
                    w,
                    &qa,
                    &mut out[(t * s + i) * h..(t * s + i + 1) * h],
                );
            }
        }
        Ok(())
    }
}

/// `assign[d]` = experts of device d (mesh rank d + 1) for every layer.
fn build(
    spec: &ModelSpec,
    assign: &[Vec<u32>],
    shared: SharedSite,
    mode: ComputeMode,
    cfg: RouterConfig,
) -> (Sim, HashMap<u32, LayerWeights>) {
    build_with(spec, assign, shared, mode, cfg, |_| {})
}

/// [`build`], with the router's replica state adjusted by `tweak` (nodes, dedup).
fn build_with(
    spec: &ModelSpec,
    assign: &[Vec<u32>],
    shared: SharedSite,
    mode: ComputeMode,
    cfg: RouterConfig,
    tweak: impl FnOnce(&mut Replicas),
) -> (Sim, HashMap<u32, LayerWeights>) {
    let layers: HashMap<u32, LayerWeights> = spec
        .moe_layer_ids()
        .into_iter()
        .map(|l| (l, reference::synthetic_layer(spec, SEED, l).unwrap()))
        .collect();
    let e = spec.routed_experts as usize;
    let mut owners = vec![Vec::new(); e];
    for (d, experts) in assign.iter().enumerate() {
        for &x in experts {
            owners[x as usize].push(d as u32 + 1);
        }
    }
    let setups: Vec<LayerSetup> = layers
        .iter()
        .map(|(&l, lw)| LayerSetup {
            layer: l,
            gate: lw.gate.clone(),
            owners: LayerOwners {
                owners: owners.clone(),
            },
            shared,
        })
        .collect();
    let mut workers = HashMap::new();
    for (d, experts) in assign.iter().enumerate() {
        let rank = d as u32 + 1;
        let mut list = Vec::new();
        for (&l, lw) in &layers {
            for &x in experts {
                list.push((
                    ExpertKey {
                        layer: l,
                        expert: x,
                    },
                    lw.experts[x as usize].clone(),
                ));
            }
            if shared == SharedSite::Rank(rank) {
                for (i, w) in lw.shared.iter().enumerate() {
                    list.push((
                        ExpertKey {
                            layer: l,
                            expert: spec.routed_experts + i as u32,
                        },
                        w.clone(),
                    ));
                }
            }
        }
        let limits = BatchLimits {
            max_tokens: 64,
            max_pairs: 64 * 8,
        };
        let mut be = CpuBackend::new(1).unwrap();
        be.load(list, limits).unwrap();
        workers.insert(
            rank,
            DispatchExecutor::new(Box::new(be), spec.hidden as usize, limits),
        );
    }
    let ranks = assign.len() + 1;
    let names = (0..ranks)
        .map(|r| {
            if r == 0 {
                "router".into()
            } else {
                format!("node0/dev{}", r - 1)
            }
        })
        .collect();
    let runner: Option<Box<dyn SharedRunner>> = (shared == SharedSite::Router).then(|| {
        Box::new(RouterShared {
            spec: spec.clone(),
            layers: layers.clone(),
        }) as Box<dyn SharedRunner>
    });
    let mut replicas = Replicas::new(ranks);
    replicas.alive[0] = false; // the router itself owns nothing
    tweak(&mut replicas);
    let core = RouterCore::new(
        spec.clone(),
        RouterConfig {
            mode: mode.into(),
            ..cfg
        },
        setups,
        replicas,
        RankNames::new(names, 1),
        runner,
        fresh_incarnation(),
    );
    (
        Sim {
            core,
            workers,
            down: Vec::new(),
            silent: Vec::new(),
            cut_off_leaders: Vec::new(),
            now: Instant::now(),
            responses: HashMap::new(),
        },
        layers,
    )
}

impl Sim {
    fn request(&mut self, request_id: u64, layer: u32, x: &[f32], tokens: usize) {
        self.request_within(request_id, layer, x, tokens, Duration::from_secs(5));
    }

    fn request_within(
        &mut self,
        request_id: u64,
        layer: u32,
        x: &[f32],
        tokens: usize,
        deadline: Duration,
    ) {
        let req = Request {
            client: 1,
            request_id,
            layer,
            tokens,
            x: x.to_vec(),
            logits: None,
            deadline: self.now + deadline,
        };
        self.core.submit(req, self.now);
    }

    /// Deliver every pending action; workers answer immediately unless down or silent.
    fn pump(&mut self) {
        for _ in 0..100 {
            let mut actions = std::iter::from_fn(|| self.core.poll_action()).collect::<Vec<_>>();
            if actions.is_empty() && self.core.has_deferred() {
                self.core.run_deferred(self.now);
                actions = std::iter::from_fn(|| self.core.poll_action()).collect::<Vec<_>>();
            }
            if actions.is_empty() {
                return;
            }
            for a in actions {
                match a {
                    Action::Send {
                        rank,
                        frame,
                        batch,
                        part,
                    } => {
                        if self.down.contains(&rank) {
                            self.core.on_send_failed(rank, batch, part, self.now);
                            continue;
                        }
                        if self.silent.contains(&rank) {
                            continue;
                        }
                        let Body::Dispatch(d) = &frame.body else {
                            panic!("router sent {:?}", frame.body)
                        };
                        let w = self.workers.get_mut(&rank).unwrap();
                        let result = w.execute(d, &frame.payload);
                        let result = match result {
                            Err(e)
                                if e.code == ErrorCode::NotFound
                                    && self.cut_off_leaders.contains(&rank) =>
                            {
                                Err(expertmesh_worker::exec::ExecError {
                                    code: ErrorCode::PeerUnavailable,
                                    message: "a node peer is not connected to this leader".into(),
                                })
                            }
                            other => other,
                        };
                        match result {
                            Ok((res, bytes)) => self.core.on_result(rank, &res, &bytes, self.now),
                            Err(e) => self.core.on_worker_error(
                                rank,
                                d.batch_id,
                                e.code,
                                &e.message,
                                Instant::now(),
                            ),
                        }
                    }
                    Action::Respond {
                        request_id, output, ..
                    } => {
                        self.responses.insert(request_id, Ok(output));
                    }
                    Action::Fail {
                        request_id,
                        code,
                        message,
                        ..
                    } => {
                        self.responses.insert(request_id, Err((code, message)));
                    }
                }
            }
        }
        panic!("router did not settle");
    }

    fn advance(&mut self, d: Duration) {
        self.now += d;
        self.core.on_tick(self.now);
        self.pump();
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn run_exact_case(spec_name: &str, assign: Vec<Vec<u32>>, shared: SharedSite) {
    let spec = preset_by_name(spec_name).unwrap();
    let cfg = RouterConfig {
        micro_batch_tokens: 3,
        batch_window: Duration::ZERO,
        ..RouterConfig::default()
    };
    let (mut sim, layers) = build(&spec, &assign, shared, ComputeMode::Exact, cfg);
    let h = spec.hidden as usize;
    for (i, layer) in spec.moe_layer_ids().into_iter().enumerate() {
        for tokens in [1usize, 5, 11] {
            let x = reference::synthetic_hidden(i as u64 * 100 + tokens as u64, tokens, h);
            let id = (layer as u64) << 16 | tokens as u64;
            sim.request(id, layer, &x, tokens);
            sim.pump();
            let got = sim
                .responses
                .remove(&id)
                .expect("answered")
                .expect("succeeded");
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
        batch_window: Duration::ZERO,
        ..RouterConfig::default()
    };
    let (mut sim, layers) = build(
        &spec,
        &assign,
        SharedSite::Rank(1),
        ComputeMode::Accurate,
        cfg,
    );
    let h = spec.hidden as usize;
    let layer = spec.moe_layer_ids()[0];
    let x = reference::synthetic_hidden(3, 9, h);
    sim.request(1, layer, &x, 9);
    sim.pump();
    let got = sim.responses.remove(&1).unwrap().unwrap();
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
    let (mut sim, layers) = build(&spec, &assign, SharedSite::None, ComputeMode::Exact, cfg);
    let h = spec.hidden as usize;
    let xa = reference::synthetic_hidden(1, 2, h);
    let xb = reference::synthetic_hidden(2, 3, h);
    sim.request(1, 0, &xa, 2);
    sim.request(2, 0, &xb, 3);
    sim.pump();
    assert!(
        sim.responses.is_empty(),
        "nothing is sent before the window closes"
    );
    sim.advance(Duration::from_millis(2));
    assert_eq!(
        sim.core.stats().batches,
        1,
        "both requests went out as one batch"
    );
    for (id, x) in [(1u64, &xa), (2, &xb)] {
        let got = sim.responses.remove(&id).unwrap().unwrap();
        let (_, want) = reference::moe_layer(&spec, &layers[&0], x, ComputeMode::Exact).unwrap();
        assert_eq!(bits(&got), bits(&want));
    }
}

#[test]
fn a_dead_worker_fails_over_to_a_replica_with_identical_bits() {
    let spec = preset_by_name("toy-softmax").unwrap();
    // every expert on both workers
    let assign: Vec<Vec<u32>> = vec![(0..8).collect(), (0..8).collect()];
    let cfg = RouterConfig {
        batch_window: Duration::ZERO,
        ..RouterConfig::default()
    };
    let (mut sim, layers) = build(&spec, &assign, SharedSite::None, ComputeMode::Exact, cfg);
    let h = spec.hidden as usize;
    let x = reference::synthetic_hidden(9, 16, h);
    let (_, want) = reference::moe_layer(&spec, &layers[&1], &x, ComputeMode::Exact).unwrap();
    // worker rank 1 dies before the send completes
    sim.down.push(1);
    sim.request(1, 1, &x, 16);
    sim.pump();
    let got = sim
        .responses
        .remove(&1)
        .unwrap()
        .expect("completed through the replica");
    assert_eq!(bits(&got), bits(&want));
    // the link loss is noticed: later batches avoid rank 1 from the start
    sim.core.on_peer_lost(1, sim.now);
    sim.request(2, 1, &x, 16);
    sim.pump();
    assert_eq!(
        bits(&sim.responses.remove(&2).unwrap().unwrap()),
        bits(&want)
    );
    // it comes back and is used again
    sim.down.clear();
    sim.core.on_peer_up(1);
    sim.request(3, 1, &x, 16);
    sim.pump();
    assert_eq!(
        bits(&sim.responses.remove(&3).unwrap().unwrap()),
        bits(&want)
    );
}

#[test]
fn a_silent_worker_is_hedged_to_a_replica_then_a_lone_owner_fails_by_the_deadline() {
    let spec = preset_by_name("toy-softmax").unwrap();
    let cfg = RouterConfig {
        batch_window: Duration::ZERO,
        straggler_timeout: Duration::from_millis(100),
        default_deadline: Duration::from_millis(500),
        ..RouterConfig::default()
    };
    // replicated: rank 1 silent, rank 2 answers after the straggler timeout
    let (mut sim, layers) = build(
        &spec,
        &[(0..8).collect(), (0..8).collect()],
        SharedSite::None,
        ComputeMode::Exact,
        cfg.clone(),
    );
    let h = spec.hidden as usize;
    let x = reference::synthetic_hidden(4, 8, h);
    sim.silent.push(1);
    sim.core.on_peer_up(1);
    // make rank 1 the preferred owner by loading rank 2
    sim.request(1, 0, &x, 8);
    sim.pump();
    if !sim.responses.contains_key(&1) {
        sim.advance(Duration::from_millis(150));
    }
    let got = sim
        .responses
        .remove(&1)
        .unwrap()
        .expect("hedged to the replica");
    assert!(
        sim.core.stats().parts_redispatched > 0,
        "the silent worker's share was re-sent"
    );
    let (_, want) = reference::moe_layer(&spec, &layers[&0], &x, ComputeMode::Exact).unwrap();
    assert_eq!(bits(&got), bits(&want));

    // single owner that never answers: error by the deadline, naming the device
    let (mut sim, _) = build(
        &spec,
        &[(0..8).collect()],
        SharedSite::None,
        ComputeMode::Exact,
        cfg,
    );
    sim.silent.push(1);
    sim.request_within(7, 0, &x, 8, Duration::from_millis(500));
    sim.pump();
    sim.advance(Duration::from_millis(200));
    assert!(
        sim.responses.is_empty(),
        "no replica: keep waiting until the deadline"
    );
    sim.advance(Duration::from_millis(400));
    let (code, msg) = sim.responses.remove(&7).unwrap().unwrap_err();
    assert_eq!(code, ErrorCode::DeadlineExceeded);
    assert!(msg.contains("node0/dev0"), "{msg}");
    assert_eq!(sim.core.inflight(), 0, "nothing left hanging");
}

#[test]
fn no_live_owner_fails_at_once_and_others_are_unaffected() {
    let spec = preset_by_name("toy-softmax").unwrap();
    let assign: Vec<Vec<u32>> = vec![(0..4).collect(), (4..8).collect()];
    let cfg = RouterConfig {
        batch_window: Duration::ZERO,
        ..RouterConfig::default()
    };
    let (mut sim, layers) = build(&spec, &assign, SharedSite::None, ComputeMode::Exact, cfg);
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
    sim.request(1, 0, &bad, 1);
    sim.request(2, 0, &good, 1);
    sim.pump();
    let (code, msg) = sim.responses.remove(&1).unwrap().unwrap_err();
    assert_eq!(code, ErrorCode::PeerUnavailable);
    assert!(
        msg.contains("node0/dev1") && msg.contains("no other replica"),
        "{msg}"
    );
    let got = sim
        .responses
        .remove(&2)
        .unwrap()
        .expect("the other request is served");
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
        ComputeMode::Exact,
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
        batch_window: Duration::ZERO,
        max_inflight_batches: 2,
        ..RouterConfig::default()
    };
    let (mut sim, _) = build(
        &spec,
        &[(0..8).collect()],
        SharedSite::None,
        ComputeMode::Exact,
        cfg,
    );
    sim.silent.push(1);
    let x = reference::synthetic_hidden(1, 1, spec.hidden as usize);
    for id in 0..3 {
        sim.request(id, 0, &x, 1);
    }
    sim.pump();
    let (code, _) = sim.responses.remove(&2).unwrap().unwrap_err();
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
        ComputeMode::Exact,
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
    let cfg = RouterConfig {
        batch_window: Duration::ZERO,
        ..RouterConfig::default()
    };
    let (mut sim, layers) = build_with(
        &spec,
        &assign,
        SharedSite::None,
        ComputeMode::Exact,
        cfg,
        |r| {
            r.node = vec![0, 1, 1];
            r.local_node = Some(0);
            r.node_dedup = true;
        },
    );
    let h = spec.hidden as usize;
    let x = reference::synthetic_hidden(21, 16, h);
    let (_, want) = reference::moe_layer(&spec, &layers[&1], &x, ComputeMode::Exact).unwrap();
    sim.cut_off_leaders.push(1);
    sim.request(1, 1, &x, 16);
    sim.pump();
    let got = sim
        .responses
        .remove(&1)
        .unwrap()
        .expect("sent again straight to the devices");
    assert_eq!(bits(&got), bits(&want));
    assert!(sim.core.stats().parts_redispatched >= 1);
}
