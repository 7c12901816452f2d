//! The router core under device faults, against simulated workers (the real dispatch executor
//! and CPU backend) that answer after a per-device latency on a virtual clock: adaptive hedge
//! timing, quarantine with probing, answers of another router incarnation, error answers
//! failed over to replicas.

use expertmesh_backend::{BatchLimits, ExpertBackend, ExpertKey};
use expertmesh_cpu_backend::CpuBackend;
use expertmesh_quant::contract::ComputeMode;
use expertmesh_router::core::{Action, LayerSetup, Request, RouterConfig, RouterCore, SharedSite};
use expertmesh_router::health::HedgePolicy;
use expertmesh_router::plan::{LayerOwners, Replicas};
use expertmesh_router::ranks::RankNames;
use expertmesh_router::reference::{self, LayerWeights};
use expertmesh_router::service::fresh_incarnation;
use expertmesh_topology::model::{ModelSpec, preset_by_name};
use expertmesh_transport::codec::{Body, ErrorCode, ExpertResult};
use expertmesh_worker::exec::DispatchExecutor;
use std::collections::HashMap;
use std::time::{Duration, Instant};

const SEED: u64 = 91;

/// A worker's answer waiting to be delivered.
struct InFlight {
    at: Instant,
    rank: u32,
    batch: u64,
    answer: Result<(ExpertResult, Vec<u8>), (ErrorCode, String)>,
}

/// A request's answer as its client got it: output rows, or the error code and message.
type Answer = Result<Vec<f32>, (ErrorCode, String)>;

/// Mesh rank 0 is the router, ranks 1.. are workers answering after `latency[rank]`.
struct Sim {
    core: RouterCore,
    workers: HashMap<u32, DispatchExecutor>,
    latency: HashMap<u32, Duration>,
    /// Workers that take frames and never answer (SIGSTOPped).
    silent: Vec<u32>,
    /// Workers that answer every dispatch with this error.
    erroring: HashMap<u32, ErrorCode>,
    queue: Vec<InFlight>,
    now: Instant,
    /// Per request: the answer and when it came.
    responses: HashMap<u64, (Instant, Answer)>,
    /// Dispatches sent, per rank.
    sent: HashMap<u32, usize>,
}

/// `assign[d]` = experts of device d (mesh rank d + 1) in every layer.
fn build(spec: &ModelSpec, assign: &[Vec<u32>]) -> (Sim, HashMap<u32, LayerWeights>) {
    let layers: HashMap<u32, LayerWeights> = spec
        .moe_layer_ids()
        .into_iter()
        .map(|l| (l, reference::synthetic_layer(spec, SEED, l).unwrap()))
        .collect();
    let mut owners = vec![Vec::new(); spec.routed_experts as usize];
    for (d, experts) in assign.iter().enumerate() {
        for &x in experts {
            owners[x as usize].push(d as u32 + 1);
        }
    }
    let setups = layers
        .iter()
        .map(|(&l, lw)| LayerSetup {
            layer: l,
            gate: lw.gate.clone(),
            owners: LayerOwners {
                owners: owners.clone(),
            },
            shared: SharedSite::None,
        })
        .collect();
    let limits = BatchLimits {
        max_tokens: 64,
        max_pairs: 64 * 8,
    };
    let mut workers = HashMap::new();
    for (d, experts) in assign.iter().enumerate() {
        let mut list = Vec::new();
        for (&l, lw) in &layers {
            for &x in experts {
                let key = ExpertKey {
                    layer: l,
                    expert: x,
                };
                list.push((key, lw.experts[x as usize].clone()));
            }
        }
        let mut be = CpuBackend::new(1).unwrap();
        be.load(list, limits).unwrap();
        let exec = DispatchExecutor::new(Box::new(be), spec.hidden as usize, limits);
        workers.insert(d as u32 + 1, exec);
    }
    let ranks = assign.len() + 1;
    let names = (0..ranks)
        .map(|r| match r {
            0 => "router".to_string(),
            _ => format!("node0/dev{}", r - 1),
        })
        .collect();
    let mut replicas = Replicas::new(ranks);
    replicas.alive[0] = false;
    let cfg = RouterConfig {
        batch_window: Duration::ZERO,
        micro_batch_tokens: 64,
        straggler_timeout: Duration::from_secs(3),
        default_deadline: Duration::from_secs(10),
        ..RouterConfig::default()
    };
    let core = RouterCore::new(
        spec.clone(),
        cfg,
        setups,
        replicas,
        RankNames::new(names, 1),
        None,
        fresh_incarnation(),
    );
    let sim = Sim {
        core,
        workers,
        latency: (1..ranks as u32)
            .map(|r| (r, Duration::from_millis(2)))
            .collect(),
        silent: Vec::new(),
        erroring: HashMap::new(),
        queue: Vec::new(),
        now: Instant::now(),
        responses: HashMap::new(),
        sent: HashMap::new(),
    };
    (sim, layers)
}

impl Sim {
    fn request(&mut self, request_id: u64, layer: u32, x: &[f32], tokens: usize) {
        let req = Request {
            client: 1,
            request_id,
            layer,
            tokens,
            x: x.to_vec(),
            logits: None,
            deadline: self.now + Duration::from_secs(10),
        };
        self.core.submit(req, self.now);
        self.pump();
    }

    /// Carry out the core's actions: dispatches are computed at once and answered after the
    /// device's latency.
    fn pump(&mut self) {
        loop {
            let actions = std::iter::from_fn(|| self.core.poll_action()).collect::<Vec<_>>();
            if actions.is_empty() {
                return;
            }
            for a in actions {
                match a {
                    Action::Send { rank, frame, .. } => {
                        *self.sent.entry(rank).or_default() += 1;
                        if self.silent.contains(&rank) {
                            continue;
                        }
                        let Body::Dispatch(d) = &frame.body else {
                            panic!("router sent {:?}", frame.body)
                        };
                        let answer = match self.erroring.get(&rank) {
                            Some(&code) => Err((code, "expert not loaded here".to_string())),
                            None => self
                                .workers
                                .get_mut(&rank)
                                .unwrap()
                                .execute(d, &frame.payload)
                                .map(|(res, bytes)| (res, bytes.to_vec()))
                                .map_err(|e| (e.code, e.message)),
                        };
                        self.queue.push(InFlight {
                            at: self.now + self.latency[&rank],
                            rank,
                            batch: d.batch_id,
                            answer,
                        });
                    }
                    Action::Respond {
                        request_id, output, ..
                    } => {
                        self.responses.insert(request_id, (self.now, Ok(output)));
                    }
                    Action::Fail {
                        request_id,
                        code,
                        message,
                        ..
                    } => {
                        self.responses
                            .insert(request_id, (self.now, Err((code, message))));
                    }
                }
            }
        }
    }

    /// Run the virtual clock to `until`: answers are delivered and timers fire in time order.
    fn run_until(&mut self, until: Instant) {
        loop {
            let answer = self.queue.iter().map(|f| f.at).min();
            let timer = self.core.next_timeout();
            let next = [answer, timer]
                .into_iter()
                .flatten()
                .filter(|&t| t <= until)
                .min();
            let Some(t) = next else {
                self.now = until;
                self.core.on_tick(until);
                self.pump();
                return;
            };
            self.now = self.now.max(t);
            if answer == Some(t) {
                let i = self.queue.iter().position(|f| f.at == t).unwrap();
                let f = self.queue.swap_remove(i);
                match f.answer {
                    Ok((res, bytes)) => self.core.on_result(f.rank, &res, &bytes, self.now),
                    Err((code, msg)) => self
                        .core
                        .on_worker_error(f.rank, f.batch, code, &msg, self.now),
                }
            } else {
                self.core.on_tick(self.now);
            }
            self.pump();
        }
    }

    /// Submit one request and run until it is answered (at most 10 s of virtual time);
    /// returns how long it took and its outcome.
    fn call(
        &mut self,
        id: u64,
        x: &[f32],
        tokens: usize,
    ) -> (Duration, Result<Vec<f32>, (ErrorCode, String)>) {
        let start = self.now;
        self.request(id, 0, x, tokens);
        let mut step = start;
        while !self.responses.contains_key(&id) {
            assert!(
                step < start + Duration::from_secs(11),
                "request {id} never answered"
            );
            step += Duration::from_millis(1);
            self.run_until(step);
        }
        let (at, out) = self.responses.remove(&id).unwrap();
        (at - start, out)
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn a_paused_replica_is_hedged_in_milliseconds_then_quarantined_then_probed_back() {
    let spec = preset_by_name("toy-softmax").unwrap();
    let all: Vec<u32> = (0..spec.routed_experts).collect();
    let (mut sim, layers) = build(&spec, &[all.clone(), all]);
    let h = spec.hidden as usize;
    let want = |x: &[f32]| {
        let (_, y) = reference::moe_layer(&spec, &layers[&0], x, ComputeMode::Exact).unwrap();
        bits(&y)
    };
    // Warm up: both devices answer in 2 ms; the hedge timeout settles at the floor.
    for i in 0..40 {
        let x = reference::synthetic_hidden(i, 4, h);
        let (took, out) = sim.call(i, &x, 4);
        assert_eq!(bits(&out.unwrap()), want(&x));
        assert!(took <= Duration::from_millis(3), "{took:?}");
    }
    let floor = HedgePolicy::default().floor;
    assert_eq!(sim.core.hedge_after(1, 0), floor);
    assert_eq!(sim.core.hedge_after(2, 0), floor);

    // Device 1 pauses (SIGSTOP): calls are hedged to device 2 after ~10 ms, not 3 s.
    sim.silent.push(1);
    let mut slow = 0;
    for i in 100..120 {
        let x = reference::synthetic_hidden(i, 4, h);
        let (took, out) = sim.call(i, &x, 4);
        assert_eq!(bits(&out.unwrap()), want(&x), "hedged answers are exact");
        assert!(
            took <= floor + Duration::from_millis(5),
            "call {i} took {took:?}"
        );
        slow += usize::from(took > Duration::from_millis(3));
    }
    let st = sim.core.stats().clone();
    assert!(st.hedges >= 1 && slow >= 1, "{st:?}");
    // ... and after a few straggles it is out of rotation: calls no longer wait on it.
    assert_eq!(st.quarantines, 1, "{st:?}");
    assert_eq!(sim.core.quarantined(), vec![1]);
    assert!(slow <= 5, "quarantine stops the hedging: {slow} slow calls");
    let sent_before = sim.sent.get(&1).copied().unwrap_or(0);
    for i in 200..210 {
        let x = reference::synthetic_hidden(i, 4, h);
        let (took, _) = sim.call(i, &x, 4);
        assert!(took <= Duration::from_millis(3), "{took:?}");
    }
    assert_eq!(
        sim.sent.get(&1).copied().unwrap_or(0),
        sent_before,
        "nothing sent to a quarantined device before its probe"
    );

    // Still paused when the quarantine runs out: the probe goes unanswered, calls do not wait,
    // and the quarantine doubles.
    let period = HedgePolicy::default().backoff_initial;
    sim.run_until(sim.now + period);
    let x = reference::synthetic_hidden(300, 4, h);
    let (took, _) = sim.call(300, &x, 4);
    assert!(
        took <= Duration::from_millis(3),
        "a probe never delays a call: {took:?}"
    );
    assert_eq!(sim.core.stats().probes, 1);
    sim.run_until(sim.now + HedgePolicy::default().probe_timeout);
    assert_eq!(sim.core.stats().quarantines, 2);
    assert_eq!(sim.core.stats().quarantine_releases, 0);

    // Resumed: the next probe (after the doubled period) is answered and it is back.
    sim.silent.clear();
    sim.run_until(sim.now + period * 2);
    let x = reference::synthetic_hidden(301, 4, h);
    let _ = sim.call(301, &x, 4);
    sim.run_until(sim.now + Duration::from_millis(5));
    assert_eq!(sim.core.stats().probes, 2);
    assert_eq!(sim.core.stats().quarantine_releases, 1);
    assert!(sim.core.quarantined().is_empty());
    let before = sim.sent.get(&1).copied().unwrap_or(0);
    for i in 400..410 {
        let x = reference::synthetic_hidden(i, 4, h);
        let (_, out) = sim.call(i, &x, 4);
        assert_eq!(bits(&out.unwrap()), want(&x));
    }
    assert!(sim.sent[&1] > before, "back in replica choice");
}

#[test]
fn a_quarantined_sole_owner_is_still_used_for_its_own_experts() {
    let spec = preset_by_name("toy-softmax").unwrap();
    // device 1 holds experts 0-3 alone, device 2 holds everything
    let (mut sim, layers) = build(&spec, &[(0..4).collect(), (0..8).collect()]);
    let h = spec.hidden as usize;
    let t0 = sim.now;
    // a flapping link: lost and back three times
    for k in 0..3u32 {
        sim.core
            .on_peer_lost(1, t0 + Duration::from_millis(100 * k as u64));
        sim.core.on_peer_up(1);
    }
    assert_eq!(
        sim.core.quarantined(),
        vec![1],
        "a link that keeps failing is benched"
    );
    for i in 0..10 {
        let x = reference::synthetic_hidden(i, 8, h);
        let (_, out) = sim.call(i, &x, 8);
        let (_, y) = reference::moe_layer(&spec, &layers[&0], &x, ComputeMode::Exact).unwrap();
        assert_eq!(bits(&out.unwrap()), bits(&y));
    }
    assert_eq!(
        sim.sent.get(&1).copied().unwrap_or(0),
        0,
        "device 2 holds every expert"
    );

    // with device 2 gone, device 1 is the only owner of experts 0-3 and is used
    sim.core.on_peer_lost(2, sim.now);
    let lw = &layers[&0];
    let x = (0..200)
        .map(|s| reference::synthetic_hidden(s, 1, h))
        .find(|x| {
            let r =
                expertmesh_router::gating::route(&spec, &lw.gate.logits(x), &lw.gate.bias).unwrap();
            r.experts.iter().all(|&e| e < 4)
        })
        .unwrap();
    let (_, out) = sim.call(50, &x, 1);
    let (_, y) = reference::moe_layer(&spec, lw, &x, ComputeMode::Exact).unwrap();
    assert_eq!(bits(&out.unwrap()), bits(&y));
    assert!(sim.sent[&1] >= 1);
}

#[test]
fn answers_to_another_router_incarnation_are_dropped_and_counted() {
    let spec = preset_by_name("toy-softmax").unwrap();
    let all: Vec<u32> = (0..spec.routed_experts).collect();
    let (mut old, layers) = build(&spec, std::slice::from_ref(&all));
    let (mut new, _) = build(&spec, &[all]);
    old.core.set_incarnation(0x1111);
    new.core.set_incarnation(0x2222);
    let h = spec.hidden as usize;
    // The old router dispatches batch 1 of its incarnation; the worker computes it.
    let x_old = reference::synthetic_hidden(1, 3, h);
    old.request(1, 0, &x_old, 3);
    let stale = old.queue.pop().unwrap();
    assert_eq!(stale.batch, 0x1111_0000_0001);
    // The restarted router has its own batch 1 in flight (another input) when the old
    // answer reaches it: dropped, counted, and the live batch is answered right.
    new.latency.insert(1, Duration::from_millis(50));
    let x_new = reference::synthetic_hidden(2, 3, h);
    new.request(7, 0, &x_new, 3);
    let Ok((res, bytes)) = &stale.answer else {
        panic!("the worker answered")
    };
    new.core.on_result(1, res, bytes, new.now);
    new.core
        .on_worker_error(1, stale.batch, ErrorCode::Internal, "old", new.now);
    assert_eq!(new.core.stats().stale_results, 2);
    assert!(
        new.responses.is_empty(),
        "the stale answer completed nothing"
    );
    // its own answer completes it exactly
    new.run_until(new.now + Duration::from_millis(60));
    let (_, out) = new.responses.remove(&7).expect("answered");
    let (_, y) = reference::moe_layer(&spec, &layers[&0], &x_new, ComputeMode::Exact).unwrap();
    assert_eq!(bits(&out.unwrap()), bits(&y));
}

#[test]
fn an_error_answer_goes_to_a_replica_when_one_holds_the_experts() {
    let spec = preset_by_name("toy-softmax").unwrap();
    let all: Vec<u32> = (0..spec.routed_experts).collect();
    let (mut sim, layers) = build(&spec, &[all.clone(), all]);
    let h = spec.hidden as usize;
    // device 1 says its experts are not loaded (a worker started with another placement)
    sim.erroring.insert(1, ErrorCode::NotFound);
    for i in 0..10 {
        sim.run_until(sim.now + Duration::from_millis(25));
        let x = reference::synthetic_hidden(i, 4, h);
        let (_, out) = sim.call(i, &x, 4);
        let (_, y) = reference::moe_layer(&spec, &layers[&0], &x, ComputeMode::Exact).unwrap();
        assert_eq!(bits(&out.expect("failed over")), bits(&y));
    }
    assert_eq!(sim.core.quarantined(), vec![1]);

    // without a replica the device's error is the answer
    let (mut sim, _) = build(&spec, &[(0..8).collect()]);
    sim.erroring.insert(1, ErrorCode::NotFound);
    let x = reference::synthetic_hidden(3, 2, h);
    let (_, out) = sim.call(1, &x, 2);
    let (code, msg) = out.unwrap_err();
    assert_eq!(code, ErrorCode::NotFound);
    assert!(msg.contains("node0/dev0"), "{msg}");
}
