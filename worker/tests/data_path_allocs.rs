//! Allocations and copies per MoE layer call on the data path, counted by a global allocator.
//!
//! What the design claims (ARCHITECTURE.md, "Copies and allocations"):
//! * the worker's `DispatchExecutor::execute` allocates nothing once warm (zero-copy q8 view,
//!   preallocated decode/output buffers, reusable grouping, a reclaimed result buffer);
//! * the router-side shared-expert runner allocates nothing once warm;
//! * the router core allocates a fixed number of buffers per layer call and per part, however
//!   many tokens the call carries (no per-token allocation, no growth reallocations), and the bytes it allocates are the batch's own
//!   buffers: one decoded input, the logits and routing, the q8 activations, the per-slot rows,
//!   one payload per part and one output per request — one copy in and one copy out per frame,
//!   no intermediate rows.
//!
//! Counting is per thread (a thread-local counter), so tests running in parallel do not mix.

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
use expertmesh_transport::codec::Body;
use expertmesh_worker::exec::DispatchExecutor;
use expertmesh_worker::shared::CpuSharedRunner;
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::collections::HashMap;
use std::time::{Duration, Instant};

struct Counting;

thread_local! {
    /// (allocations, bytes) made by this thread.
    static COUNT: Cell<(u64, u64)> = const { Cell::new((0, 0)) };
}

fn note(bytes: usize) {
    let _ = COUNT.try_with(|c| {
        let (n, b) = c.get();
        c.set((n + 1, b + bytes as u64));
    });
}

// SAFETY: every call forwards to the system allocator with the caller's arguments; the
// bookkeeping touches only a const-initialized thread-local `Cell` (no allocation, no panic).
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: forwarded unchanged; the caller upholds `alloc`'s contract.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size);
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Allocations and bytes made by `f` on this thread.
fn counted<R>(f: impl FnOnce() -> R) -> (R, u64, u64) {
    let (n0, b0) = COUNT.with(|c| c.get());
    let r = f();
    let (n1, b1) = COUNT.with(|c| c.get());
    (r, n1 - n0, b1 - b0)
}

const SEED: u64 = 5;
const MAX_TOKENS: usize = 64;

/// A router core and two workers (experts split in halves), in process.
struct Cluster {
    spec: ModelSpec,
    core: RouterCore,
    workers: HashMap<u32, DispatchExecutor>,
    now: Instant,
    /// Allocations / bytes counted inside the workers' `execute` during the last call.
    worker_allocs: (u64, u64),
}

fn cluster(mode: ComputeMode, shared_on_router: bool) -> Cluster {
    let spec = preset_by_name("demo-small").unwrap();
    let layers: Vec<u32> = spec.moe_layer_ids();
    let lw: HashMap<u32, LayerWeights> = layers
        .iter()
        .map(|&l| (l, reference::synthetic_layer(&spec, SEED, l).unwrap()))
        .collect();
    let e = spec.routed_experts;
    let halves = [(0..e / 2).collect::<Vec<u32>>(), (e / 2..e).collect()];
    let mut owners = vec![Vec::new(); e as usize];
    let mut workers = HashMap::new();
    for (d, experts) in halves.iter().enumerate() {
        let rank = d as u32 + 1;
        let mut list = Vec::new();
        for &l in &layers {
            for &x in experts {
                owners[x as usize].push(rank);
                let key = ExpertKey {
                    layer: l,
                    expert: x,
                };
                list.push((key, lw[&l].experts[x as usize].clone()));
            }
        }
        let limits = BatchLimits {
            max_tokens: MAX_TOKENS,
            max_pairs: MAX_TOKENS * spec.top_k as usize,
        };
        let mut be = CpuBackend::new(1).unwrap();
        be.load(list, limits).unwrap();
        let exec = DispatchExecutor::new(Box::new(be), spec.hidden as usize, limits);
        workers.insert(rank, exec);
    }
    for o in &mut owners {
        o.dedup();
    }
    let site = if shared_on_router {
        SharedSite::Router
    } else {
        SharedSite::None
    };
    let setups = layers
        .iter()
        .map(|&l| LayerSetup {
            layer: l,
            gate: lw[&l].gate.clone(),
            owners: LayerOwners {
                owners: owners.clone(),
            },
            shared: site,
        })
        .collect();
    let runner = shared_on_router.then(|| {
        let mut keyed = Vec::new();
        for &l in &layers {
            for (i, w) in lw[&l].shared.iter().enumerate() {
                let key = ExpertKey {
                    layer: l,
                    expert: e + i as u32,
                };
                keyed.push((key, w.clone()));
            }
        }
        let s = spec.shared_experts as usize;
        let mut be = CpuBackend::new(1).unwrap();
        let limits = BatchLimits {
            max_tokens: MAX_TOKENS,
            max_pairs: MAX_TOKENS * s,
        };
        be.load(keyed, limits).unwrap();
        let r = CpuSharedRunner::new(be, e, s as u32, spec.hidden as usize, MAX_TOKENS);
        Box::new(r) as Box<dyn SharedRunner>
    });
    let mut replicas = Replicas::new(3);
    replicas.alive[0] = false;
    let cfg = RouterConfig {
        mode: mode.into(),
        batch_window: Duration::ZERO,
        max_batch_tokens: MAX_TOKENS,
        micro_batch_tokens: MAX_TOKENS,
        ..RouterConfig::default()
    };
    let names = vec!["router".into(), "dev0".into(), "dev1".into()];
    let core = RouterCore::new(
        spec.clone(),
        cfg,
        setups,
        replicas,
        RankNames::new(names, 1),
        runner,
        fresh_incarnation(),
    );
    Cluster {
        spec,
        core,
        workers,
        now: Instant::now(),
        worker_allocs: (0, 0),
    }
}

impl Cluster {
    /// One layer call of `x` (built outside the counted region by the caller); returns the
    /// output. Worker-side allocations are counted separately into `worker_allocs`.
    fn call(&mut self, id: u64, x: Vec<f32>) -> Vec<f32> {
        let tokens = x.len() / self.spec.hidden as usize;
        let req = Request {
            client: 1,
            request_id: id,
            layer: self.spec.moe_layer_ids()[0],
            tokens,
            x,
            logits: None,
            deadline: self.now + Duration::from_secs(60),
        };
        self.worker_allocs = (0, 0);
        self.core.submit(req, self.now);
        for _ in 0..16 {
            let mut actions = std::iter::from_fn(|| self.core.poll_action()).collect::<Vec<_>>();
            if actions.is_empty() && self.core.has_deferred() {
                self.core.run_deferred(self.now);
                actions = std::iter::from_fn(|| self.core.poll_action()).collect::<Vec<_>>();
            }
            for a in actions {
                match a {
                    Action::Send { rank, frame, .. } => {
                        let Body::Dispatch(d) = &frame.body else {
                            panic!("router sent {:?}", frame.body)
                        };
                        let w = self.workers.get_mut(&rank).unwrap();
                        let (res, n, b) = counted(|| w.execute(d, &frame.payload));
                        self.worker_allocs.0 += n;
                        self.worker_allocs.1 += b;
                        let (res, bytes) = res.unwrap();
                        self.core.on_result(rank, &res, &bytes, self.now);
                    }
                    Action::Respond { output, .. } => return output,
                    Action::Fail { message, .. } => panic!("layer call failed: {message}"),
                }
            }
        }
        panic!("no response");
    }
}

/// Runs warm-up calls at the largest size, then counts one call of `tokens` tokens.
/// Returns (router-side allocations, router-side bytes, worker allocations, essential bytes).
fn measure(c: &mut Cluster, tokens: usize) -> (u64, u64, u64, u64) {
    let h = c.spec.hidden as usize;
    for w in 0..2 {
        let x = reference::synthetic_hidden(100 + w, MAX_TOKENS, h);
        c.call(w, x);
    }
    let x = reference::synthetic_hidden(7, tokens, h);
    let (out, n, b) = counted(|| c.call(9, x));
    assert_eq!(out.len(), tokens * h);
    let (wn, wb) = c.worker_allocs;
    // The workers ran inside the counted region too: take them out.
    let (n, b) = (n - wn, b - wb);
    let (k, e) = (c.spec.top_k as usize, c.spec.routed_experts as usize);
    let essential = (tokens * e * 4  // logits
        + tokens * k * 8             // routing (expert ids and weights)
        + tokens * h * 9 / 8         // q8 activations (codes and block scales)
        + tokens * k * h * 4         // per-slot rows (exact) or partial rows (accurate)
        + tokens * h * 9 / 8 * 2     // dispatch payloads (each token goes to ≤ 2 devices)
        + tokens * h * 4) as u64; // the request's output
    (n, b, wn, essential)
}

#[test]
fn workers_allocate_nothing_per_dispatch_once_warm() {
    for mode in [ComputeMode::Exact, ComputeMode::Accurate] {
        let mut c = cluster(mode, true);
        for tokens in [1, 8, 64] {
            let (_, _, worker_allocs, _) = measure(&mut c, tokens);
            assert_eq!(
                worker_allocs, 0,
                "{mode:?}, {tokens} tokens: DispatchExecutor::execute allocated"
            );
        }
    }
}

#[test]
fn router_allocations_do_not_grow_with_tokens() {
    for mode in [ComputeMode::Exact, ComputeMode::Accurate] {
        for shared_on_router in [false, true] {
            let mut c = cluster(mode, shared_on_router);
            // 16, 32 and 64 tokens of demo-small (32 experts, top-4, split over two devices)
            // all reach both devices: the same parts, so the same allocations.
            let counts: Vec<u64> = [16, 32, 64].iter().map(|&t| measure(&mut c, t).0).collect();
            assert!(
                counts.windows(2).all(|w| w[0] == w[1]),
                "{mode:?} shared_on_router={shared_on_router}: allocations per call for 16/32/64 tokens: {counts:?}"
            );
            // A fixed set per call and per part (two parts here).
            assert!(
                counts[2] <= 64,
                "{mode:?}: {} allocations per layer call",
                counts[2]
            );
        }
    }
}

#[test]
fn router_allocates_only_the_batch_buffers() {
    for mode in [ComputeMode::Exact, ComputeMode::Accurate] {
        let mut c = cluster(mode, false);
        let (_, bytes, _, essential) = measure(&mut c, 64);
        // The batch's own buffers plus a small slack for growth of small vectors; an extra
        // intermediate copy of the result rows or of the output would exceed it.
        let slack = 64 << 10;
        assert!(
            bytes <= essential * 5 / 4 + slack,
            "{mode:?}: {bytes} bytes allocated per 64-token layer call, essential {essential}"
        );
    }
}
