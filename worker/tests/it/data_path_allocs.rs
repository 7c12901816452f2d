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
//! The counting allocator is the global allocator of this whole test binary (`it`): every test
//! in it runs under it, at the cost of one thread-local add per allocation, and each test runs
//! on its own thread, so the other tests' allocations never show in these counts. That is why
//! this file is a module of the crate's one test binary rather than a binary of its own.
//!
//! The router's side runs on the shared simulated cluster (`expertmesh_router::sim`), whose
//! pump allocates nothing once warm (the core's action queue and the answer log keep their
//! capacity), so what is counted is the core's own work.

use crate::support::ExecWorker;
use expertmesh_backend::{BatchLimits, ExpertBackend, ExpertKey};
use expertmesh_cpu_backend::CpuBackend;
use expertmesh_quant::contract::ComputeMode;
use expertmesh_router::core::{RouterConfig, SharedRunner, SharedSite};
use expertmesh_router::reference;
use expertmesh_router::sim::{Sim, SimWorker, WorkerAnswer};
use expertmesh_topology::model::{ModelSpec, preset_by_name};
use expertmesh_transport::codec::Dispatch;
use expertmesh_worker::shared::CpuSharedRunner;
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::rc::Rc;
use std::time::Duration;

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

/// The router core and two devices (experts split in halves) of the simulated cluster.
struct Cluster {
    spec: ModelSpec,
    sim: Sim,
    /// Allocations / bytes counted inside the devices' `execute` during the last call.
    worker_allocs: Rc<Cell<(u64, u64)>>,
}

/// A device whose executor's allocations are counted apart (into `allocs`).
struct Counted {
    exec: ExecWorker,
    allocs: Rc<Cell<(u64, u64)>>,
}

impl SimWorker for Counted {
    fn answer(&mut self, d: &Dispatch, payload: &[u8]) -> WorkerAnswer {
        let (answer, n, b) = counted(|| self.exec.answer(d, payload));
        let (n0, b0) = self.allocs.get();
        self.allocs.set((n0 + n, b0 + b));
        answer
    }
}

fn cluster(mode: ComputeMode, shared_on_router: bool) -> Cluster {
    cluster_on(mode, shared_on_router, || CpuBackend::new(1).unwrap())
}

/// [`cluster`] with each device's backend made by `backend` (one thread: its work runs on
/// the caller's thread, where it is counted).
fn cluster_on(mode: ComputeMode, shared_on_router: bool, backend: fn() -> CpuBackend) -> Cluster {
    let spec = preset_by_name("demo-small").unwrap();
    let e = spec.routed_experts;
    let halves = [(0..e / 2).collect::<Vec<u32>>(), (e / 2..e).collect()];
    let site = if shared_on_router {
        SharedSite::Router
    } else {
        SharedSite::None
    };
    let cfg = RouterConfig {
        mode: mode.into(),
        batch_window: Duration::ZERO,
        max_batch_tokens: MAX_TOKENS,
        micro_batch_tokens: MAX_TOKENS,
        ..RouterConfig::default()
    };
    let (h, s) = (spec.hidden as usize, spec.shared_experts as usize);
    // The router's shared experts on the CPU backend, as the router process runs them.
    let runner = move |lw: &std::collections::HashMap<u32, reference::LayerWeights>| {
        let mut keyed = Vec::new();
        for (&layer, w) in lw {
            for (i, w) in w.shared.iter().enumerate() {
                let key = ExpertKey {
                    layer,
                    expert: e + i as u32,
                };
                keyed.push((key, w.clone()));
            }
        }
        let mut be = CpuBackend::new(1).unwrap();
        let limits = BatchLimits {
            max_tokens: MAX_TOKENS,
            max_pairs: MAX_TOKENS * s,
        };
        be.load(keyed, limits).unwrap();
        let r = CpuSharedRunner::new(be, e, s as u32, h, MAX_TOKENS);
        Box::new(r) as Box<dyn SharedRunner>
    };
    let worker_allocs = Rc::new(Cell::new((0, 0)));
    let allocs = Rc::clone(&worker_allocs);
    let mut sim = Sim::builder(&spec, &halves)
        .shared(site)
        .config(cfg)
        .seed(SEED)
        .router_shared(runner)
        .build(move |_, experts| {
            let exec = ExecWorker::on(backend(), h, experts);
            let allocs = Rc::clone(&allocs);
            Box::new(Counted { exec, allocs })
        });
    sim.deadline = Duration::from_secs(60);
    Cluster {
        spec,
        sim,
        worker_allocs,
    }
}

impl Cluster {
    /// One layer call of `x` (built outside the counted region by the caller); returns the
    /// output. Worker-side allocations are counted separately into `worker_allocs`.
    fn call(&mut self, id: u64, x: Vec<f32>) -> Vec<f32> {
        self.worker_allocs.set((0, 0));
        let layer = self.spec.moe_layer_ids()[0];
        let (_, answer) = self.sim.call(id, layer, x);
        answer.unwrap_or_else(|(_, message)| panic!("layer call failed: {message}"))
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
    let (wn, wb) = c.worker_allocs.get();
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

/// The same on the AMX kernel's scheduling (token tiles of 16 gathered block-major, the tile
/// emulator in place of the instructions, so every machine runs it; an AMX machine runs the
/// instructions in the test above): calls whose tokens all route alike, so each chosen expert
/// gets every token, whole tiles of 16 included.
#[test]
fn workers_allocate_nothing_per_dispatch_on_the_amx_scheduling() {
    for mode in [ComputeMode::Exact, ComputeMode::Accurate] {
        let mut c = cluster_on(mode, true, || CpuBackend::with_amx_emulated(1).unwrap());
        let h = c.spec.hidden as usize;
        let alike =
            |seed: u64, tokens: usize| reference::synthetic_hidden(seed, 1, h).repeat(tokens);
        for w in 0..2 {
            c.call(w, alike(100 + w, MAX_TOKENS));
        }
        for tokens in [16, 64] {
            let x = alike(7, tokens);
            let out = c.call(9, x);
            assert_eq!(out.len(), tokens * h);
            let (worker_allocs, _) = c.worker_allocs.get();
            assert_eq!(
                worker_allocs, 0,
                "{mode:?}, {tokens} tokens on the AMX scheduling: DispatchExecutor::execute allocated"
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
