//! The CPU backend: the embedded default, and the bit-exact twin of the HIP kernels.
//!
//! Why this exists: the demo, the tests and every machine without an AMD GPU run experts here,
//! so it must be fast for real (decode is memory-bound: the goal is the machine's read
//! bandwidth) and exact (bit-identical to [`expertmesh_quant::reference`] in exact mode on every ISA).
//!
//! How a batch runs:
//! 1. each input token is quantized once (contract §1) unless it arrived quantized;
//! 2. **stage 1**, work items (group, 32-row W13 tile): 16 gate rows and the matching 16 up rows
//!    for every token of the group, then `silu(g)·u` into the pair's intermediate `h`;
//! 3. each pair's `h` is quantized (exact mode);
//! 4. **stage 2**, work items (group, 64-row W2 tile): the expert outputs;
//! 5. per-slot rows are written in place, or pre-combined per token in output-row order.
//!
//! Work items are pulled from an atomic counter by every thread of a fixed-size pool (sized by
//! the topology's CPU device: no oversubscription), so large experts are split across threads
//! and small ones do not leave threads idle. Within an item, tokens are processed in tiles of
//! [`kernels::MAX_TOKEN_TILE`] against each loaded weight tile, and a row block's weights are
//! re-read only from cache for further token tiles (prefill blocking). All scratch buffers are
//! sized at `load` from [`BatchLimits`]; `execute` allocates nothing.

pub mod kernels;
pub mod layout;
pub mod membw;

use expertmesh_backend::{
    Activations, BackendError, BatchLimits, ExpertBackend, ExpertKey, GroupedBatch, OutputLayout,
};
use expertmesh_quant::aligned::AlignedVec;
use expertmesh_quant::contract::{self, ComputeMode};
use expertmesh_quant::format::{BLOCK, ExpertWeights};
use kernels::{Isa, MAX_TOKEN_TILE, TokenQ8};
use layout::{R16Matrix, ROWS};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};

/// W2 row blocks per stage-2 work item (64 rows).
const W2_TILE_ROW_BLOCKS: usize = 4;

/// One expert in the R16 layout.
#[derive(Debug)]
struct CpuExpert {
    inter: usize,
    w13: R16Matrix,
    w2: R16Matrix,
}

/// A raw pointer that may be shared across the pool's threads because every thread writes a
/// disjoint region (the work-item partition guarantees it).
#[derive(Clone, Copy)]
struct SharedMut<T>(*mut T);
// SAFETY: used only for disjoint writes coordinated by the work-item partition.
unsafe impl<T> Send for SharedMut<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for SharedMut<T> {}

impl<T> SharedMut<T> {
    /// The pointer (a method, so closures capture the whole Sync wrapper).
    #[inline(always)]
    fn ptr(self) -> *mut T {
        self.0
    }
}

/// Where the activations of a kernel's input rows live: row `r` is `q[r·stride..][..len]`,
/// `d`/`qsum` at `r·block_stride`, and `f32[r·stride..][..len]` (exact mode reads the first
/// three, accurate mode the last).
#[derive(Clone, Copy)]
struct RowSource<'a> {
    q: &'a [i8],
    d: &'a [f32],
    qsum: &'a [i32],
    f32: &'a [f32],
    stride: usize,
    len: usize,
}

/// The inputs of one token tile, gathered once and used for every row block of the tile (a
/// stack value built per tile, so the variants' size difference costs nothing).
#[allow(clippy::large_enum_variant)]
enum TileInputs<'a> {
    Exact([TokenQ8<'a>; MAX_TOKEN_TILE]),
    Accurate([&'a [f32]; MAX_TOKEN_TILE]),
}

impl<'a> TileInputs<'a> {
    fn gather(mode: ComputeMode, src: &RowSource<'a>, rows: impl Iterator<Item = usize>) -> Self {
        let (s, len, bs, nb) = (src.stride, src.len, src.stride / BLOCK, src.len / BLOCK);
        match mode {
            ComputeMode::Exact => {
                let mut t = [TokenQ8 {
                    q: &[],
                    d: &[],
                    qsum: &[],
                }; MAX_TOKEN_TILE];
                for (j, r) in rows.enumerate() {
                    t[j] = TokenQ8 {
                        q: &src.q[r * s..r * s + len],
                        d: &src.d[r * bs..r * bs + nb],
                        qsum: &src.qsum[r * bs..r * bs + nb],
                    };
                }
                TileInputs::Exact(t)
            }
            ComputeMode::Accurate => {
                let mut t: [&[f32]; MAX_TOKEN_TILE] = [&[]; MAX_TOKEN_TILE];
                for (j, r) in rows.enumerate() {
                    t[j] = &src.f32[r * s..r * s + len];
                }
                TileInputs::Accurate(t)
            }
        }
    }

    /// Rows `16rb..16rb+16` of `m` for the first `n` tokens of the tile.
    fn run(&self, isa: Isa, m: &R16Matrix, rb: usize, n: usize, out: &mut [[f32; ROWS]]) {
        match self {
            TileInputs::Exact(t) => kernels::rowblock_exact(isa, m, rb, &t[..n], out),
            TileInputs::Accurate(t) => kernels::rowblock_accurate(isa, m, rb, &t[..n], out),
        }
    }
}

/// Preallocated per-batch state.
#[derive(Debug)]
struct Scratch {
    hidden: usize,
    max_inter: usize,
    /// Input codes `[max_tokens][H]`, scales, block sums.
    xq: AlignedVec<i8>,
    xd: AlignedVec<f32>,
    xqs: AlignedVec<i32>,
    /// Intermediate per pair `[max_pairs][F_max]` and its quantization.
    h: AlignedVec<f32>,
    hq: AlignedVec<i8>,
    hd: AlignedVec<f32>,
    hqs: AlignedVec<i32>,
    /// Per-pair outputs for pre-combining `[max_pairs][H]`.
    pair_out: AlignedVec<f32>,
    /// (group, tile) work items.
    items: Vec<(u32, u32)>,
    /// First pair index of each group.
    group_pair0: Vec<u32>,
    /// Expert index of each group.
    group_expert: Vec<u32>,
    /// (token, out_row, pair, group) for pre-combining.
    combine: Vec<(u32, u32, u32, u32)>,
}

/// The CPU expert backend.
pub struct CpuBackend {
    isa: Isa,
    threads: usize,
    pool: Option<rayon::ThreadPool>,
    index: HashMap<ExpertKey, usize>,
    experts: Vec<CpuExpert>,
    limits: BatchLimits,
    scratch: Option<Scratch>,
    loaded_bytes: u64,
}

impl std::fmt::Debug for CpuBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuBackend")
            .field("isa", &self.isa)
            .field("threads", &self.threads)
            .field("experts", &self.experts.len())
            .finish()
    }
}

impl CpuBackend {
    /// A backend using the best ISA of this CPU and `threads` worker threads (at least 1).
    pub fn new(threads: usize) -> Result<Self, BackendError> {
        Self::with_isa(threads, Isa::detect())
    }

    /// A backend forced to `isa` (which must be supported by this CPU).
    pub fn with_isa(threads: usize, isa: Isa) -> Result<Self, BackendError> {
        if !isa.supported() {
            return Err(BackendError::NoDevice {
                backend: "cpu",
                detail: format!("this CPU does not support {}", isa.name()),
            });
        }
        let threads = threads.max(1);
        let pool = if threads > 1 {
            Some(
                rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .thread_name(|i| format!("expert-cpu-{i}"))
                    .build()
                    .map_err(|e| BackendError::Device {
                        backend: "cpu",
                        detail: format!("cannot start {threads} threads: {e}"),
                    })?,
            )
        } else {
            None
        };
        Ok(Self {
            isa,
            threads,
            pool,
            index: HashMap::new(),
            experts: Vec::new(),
            limits: BatchLimits {
                max_tokens: 0,
                max_pairs: 0,
            },
            scratch: None,
            loaded_bytes: 0,
        })
    }

    /// The ISA in use.
    pub fn isa(&self) -> Isa {
        self.isa
    }

    /// Worker threads.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Run `n` work items on every thread of the pool (or inline with one thread).
    fn run_items(pool: Option<&rayon::ThreadPool>, n: usize, f: impl Fn(usize) + Sync) {
        if n == 0 {
            return;
        }
        match pool {
            None => (0..n).for_each(f),
            Some(pool) => {
                let next = AtomicUsize::new(0);
                pool.broadcast(|_| {
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= n {
                            break;
                        }
                        f(i);
                    }
                });
            }
        }
    }
}

impl ExpertBackend for CpuBackend {
    fn name(&self) -> String {
        format!("cpu-{}x{}", self.isa.name(), self.threads)
    }

    fn load(
        &mut self,
        experts: Vec<(ExpertKey, ExpertWeights)>,
        limits: BatchLimits,
    ) -> Result<(), BackendError> {
        let hidden = experts.first().map_or(0, |(_, w)| w.hidden());
        let mut index = HashMap::with_capacity(experts.len());
        let mut list = Vec::with_capacity(experts.len());
        let mut bytes = 0u64;
        let mut max_inter = 0;
        for (key, w) in &experts {
            if w.hidden() != hidden {
                return Err(BackendError::Shape(format!(
                    "{key} has hidden size {} but other experts have {hidden}",
                    w.hidden()
                )));
            }
            if index.insert(*key, index.len()).is_some() {
                return Err(BackendError::Shape(format!("{key} was given twice")));
            }
            bytes += w.bytes() as u64;
            max_inter = max_inter.max(w.inter());
        }
        // One arena for every matrix of the device (huge pages, one stream of allocations).
        let mats: Vec<&expertmesh_quant::format::PackedMatrix> = experts
            .iter()
            .flat_map(|(_, w)| [w.w13(), w.w2()])
            .collect();
        let mut packed = R16Matrix::pack_all(&mats).into_iter();
        for (_, w) in &experts {
            let (Some(w13), Some(w2)) = (packed.next(), packed.next()) else {
                unreachable!("two matrices were packed per expert")
            };
            list.push(CpuExpert {
                inter: w.inter(),
                w13,
                w2,
            });
        }
        drop(experts);
        let (t, p) = (limits.max_tokens, limits.max_pairs);
        let max_items_per_group =
            (2 * max_inter / 32).max(hidden.div_ceil(ROWS * W2_TILE_ROW_BLOCKS));
        let max_groups = p.min(list.len());
        self.scratch = Some(Scratch {
            hidden,
            max_inter,
            xq: AlignedVec::zeroed(t * hidden),
            xd: AlignedVec::zeroed(t * hidden / BLOCK),
            xqs: AlignedVec::zeroed(t * hidden / BLOCK),
            h: AlignedVec::zeroed(p * max_inter),
            hq: AlignedVec::zeroed(p * max_inter),
            hd: AlignedVec::zeroed(p * max_inter / BLOCK),
            hqs: AlignedVec::zeroed(p * max_inter / BLOCK),
            pair_out: AlignedVec::zeroed(p * hidden),
            items: Vec::with_capacity(max_groups * max_items_per_group),
            group_pair0: Vec::with_capacity(max_groups + 1),
            group_expert: Vec::with_capacity(max_groups),
            combine: Vec::with_capacity(p),
        });
        self.index = index;
        self.experts = list;
        self.limits = limits;
        self.loaded_bytes = bytes;
        Ok(())
    }

    fn execute(&mut self, batch: &GroupedBatch<'_>, out: &mut [f32]) -> Result<(), BackendError> {
        let Some(sc) = self.scratch.as_mut() else {
            return Err(BackendError::NotLoaded);
        };
        batch.validate(&self.limits, out.len())?;
        let h = batch.hidden;
        if batch.groups.is_empty() {
            out.fill(0.0);
            return Ok(());
        }
        if h != sc.hidden {
            return Err(BackendError::Shape(format!(
                "batch hidden size {h} but experts were loaded with {}",
                sc.hidden
            )));
        }
        // Resolve experts and lay out pairs group-major.
        sc.group_pair0.clear();
        sc.group_expert.clear();
        let mut pair = 0u32;
        for g in batch.groups {
            let Some(&e) = self.index.get(&g.key) else {
                return Err(BackendError::UnknownExpert(g.key));
            };
            sc.group_pair0.push(pair);
            sc.group_expert.push(e as u32);
            pair += g.tokens.len() as u32;
        }
        sc.group_pair0.push(pair);
        let mode = batch.mode;
        let isa = self.isa;
        let experts = &self.experts;
        let pool = self.pool.as_ref();
        let max_inter = sc.max_inter;

        // 1. Quantize the input once per token (exact mode).
        let (xq, xd, xqs): (&[i8], &[f32], &[i32]) = match (mode, batch.input) {
            (ComputeMode::Exact, Activations::F32(x)) => {
                let nb = h / BLOCK;
                for t in 0..batch.tokens {
                    let q = &mut sc.xq[t * h..(t + 1) * h];
                    let d = &mut sc.xd[t * nb..(t + 1) * nb];
                    contract::quantize_activations(&x[t * h..(t + 1) * h], q, d);
                    kernels::block_sums(q, &mut sc.xqs[t * nb..(t + 1) * nb]);
                }
                (
                    &sc.xq[..batch.tokens * h],
                    &sc.xd[..batch.tokens * nb],
                    &sc.xqs[..batch.tokens * nb],
                )
            }
            (ComputeMode::Exact, Activations::Q8 { q, d }) => {
                let nb = h / BLOCK;
                for t in 0..batch.tokens {
                    kernels::block_sums(&q[t * h..(t + 1) * h], &mut sc.xqs[t * nb..(t + 1) * nb]);
                }
                (q, d, &sc.xqs[..batch.tokens * nb])
            }
            _ => (&[][..], &[][..], &[][..]),
        };
        let xf: &[f32] = match batch.input {
            Activations::F32(x) => x,
            Activations::Q8 { .. } => &[],
        };

        // 2. Stage 1 items: (group, 32-row W13 tile).
        sc.items.clear();
        for (gi, &e) in sc.group_expert.iter().enumerate() {
            for tile in 0..experts[e as usize].inter / 16 {
                sc.items.push((gi as u32, tile as u32));
            }
        }
        let xsrc = RowSource {
            q: xq,
            d: xd,
            qsum: xqs,
            f32: xf,
            stride: h,
            len: h,
        };
        let hbuf = SharedMut(sc.h.as_mut_ptr());
        {
            let items = &sc.items;
            let group_pair0 = &sc.group_pair0;
            let group_expert = &sc.group_expert;
            Self::run_items(pool, items.len(), |i| {
                let (gi, tile) = items[i];
                let g = &batch.groups[gi as usize];
                let ex = &experts[group_expert[gi as usize] as usize];
                let p0 = group_pair0[gi as usize] as usize;
                let mut gate = [[0f32; ROWS]; MAX_TOKEN_TILE];
                let mut up = [[0f32; ROWS]; MAX_TOKEN_TILE];
                for (ci, toks) in g.tokens.chunks(MAX_TOKEN_TILE).enumerate() {
                    let n = toks.len();
                    let inputs = TileInputs::gather(mode, &xsrc, toks.iter().map(|&t| t as usize));
                    inputs.run(isa, &ex.w13, 2 * tile as usize, n, &mut gate);
                    inputs.run(isa, &ex.w13, 2 * tile as usize + 1, n, &mut up);
                    for j in 0..n {
                        let pair = p0 + ci * MAX_TOKEN_TILE + j;
                        // SAFETY: (pair, tile) is written by exactly this item; the buffer holds
                        // max_pairs × max_inter floats and pair < pairs ≤ max_pairs.
                        let dst = unsafe {
                            std::slice::from_raw_parts_mut(
                                hbuf.ptr().add(pair * max_inter + tile as usize * 16),
                                16,
                            )
                        };
                        kernels::swiglu16(isa, &gate[j], &up[j], dst);
                    }
                }
            });
        }

        // 3. Quantize each pair's intermediate (exact mode).
        let pairs = *sc.group_pair0.last().unwrap_or(&0) as usize;
        if mode == ComputeMode::Exact {
            let (hq, hd, hqs) = (
                SharedMut(sc.hq.as_mut_ptr()),
                SharedMut(sc.hd.as_mut_ptr()),
                SharedMut(sc.hqs.as_mut_ptr()),
            );
            let hsrc = &sc.h;
            let group_pair0 = &sc.group_pair0;
            let group_expert = &sc.group_expert;
            // Quantizing is cheap: only worth waking the pool for many pairs.
            let qpool = if pairs * max_inter >= 1 << 16 {
                pool
            } else {
                None
            };
            Self::run_items(qpool, pairs, |p| {
                let gi = group_pair0.partition_point(|&p0| p0 as usize <= p) - 1;
                let f = experts[group_expert[gi] as usize].inter;
                let nbm = max_inter / BLOCK;
                // SAFETY: each pair owns its rows of hq/hd/hqs.
                let (q, d, s) = unsafe {
                    (
                        std::slice::from_raw_parts_mut(hq.ptr().add(p * max_inter), f),
                        std::slice::from_raw_parts_mut(hd.ptr().add(p * nbm), f / BLOCK),
                        std::slice::from_raw_parts_mut(hqs.ptr().add(p * nbm), f / BLOCK),
                    )
                };
                contract::quantize_activations(&hsrc[p * max_inter..p * max_inter + f], q, d);
                kernels::block_sums(q, s);
            });
        }

        // 4. Stage 2 items: (group, 64-row W2 tile).
        sc.items.clear();
        let w2_tiles = (h.div_ceil(ROWS)).div_ceil(W2_TILE_ROW_BLOCKS);
        for gi in 0..batch.groups.len() {
            for tile in 0..w2_tiles {
                sc.items.push((gi as u32, tile as u32));
            }
        }
        let per_slot = batch.layout == OutputLayout::PerSlot;
        let ybuf = if per_slot {
            SharedMut(out.as_mut_ptr())
        } else {
            SharedMut(sc.pair_out.as_mut_ptr())
        };
        {
            let items = &sc.items;
            let group_pair0 = &sc.group_pair0;
            let group_expert = &sc.group_expert;
            let (hf, hq, hd, hqs) = (&sc.h, &sc.hq, &sc.hd, &sc.hqs);
            Self::run_items(pool, items.len(), |i| {
                let (gi, tile) = items[i];
                let g = &batch.groups[gi as usize];
                let ex = &experts[group_expert[gi as usize] as usize];
                let p0 = group_pair0[gi as usize] as usize;
                let f = ex.inter;
                let rb0 = tile as usize * W2_TILE_ROW_BLOCKS;
                let rb1 = (rb0 + W2_TILE_ROW_BLOCKS).min(h.div_ceil(ROWS));
                let mut y = [[0f32; ROWS]; MAX_TOKEN_TILE];
                for rb in rb0..rb1 {
                    for (ci, toks) in g.tokens.chunks(MAX_TOKEN_TILE).enumerate() {
                        let n = toks.len();
                        let pb = p0 + ci * MAX_TOKEN_TILE;
                        let hsrc = RowSource {
                            q: hq,
                            d: hd,
                            qsum: hqs,
                            f32: hf,
                            stride: max_inter,
                            len: f,
                        };
                        TileInputs::gather(mode, &hsrc, pb..pb + n).run(isa, &ex.w2, rb, n, &mut y);
                        let rows = ROWS.min(h - rb * ROWS);
                        for j in 0..n {
                            let local = ci * MAX_TOKEN_TILE + j;
                            let row = if per_slot {
                                g.out_rows[local] as usize
                            } else {
                                pb + j
                            };
                            // SAFETY: (row, rb) is written by exactly this item; the output holds
                            // pairs × H floats (validated) and pair_out max_pairs × H.
                            let dst = unsafe {
                                std::slice::from_raw_parts_mut(
                                    ybuf.ptr().add(row * h + rb * ROWS),
                                    rows,
                                )
                            };
                            dst.copy_from_slice(&y[j][..rows]);
                        }
                    }
                }
            });
        }

        // 5. Pre-combine per token in output-row order (contract §5).
        if !per_slot {
            sc.combine.clear();
            for (gi, g) in batch.groups.iter().enumerate() {
                let p0 = sc.group_pair0[gi];
                for (i, (&t, &r)) in g.tokens.iter().zip(g.out_rows).enumerate() {
                    sc.combine.push((t, r, p0 + i as u32, gi as u32));
                }
            }
            sc.combine.sort_unstable();
            out.fill(0.0);
            for &(t, _, p, gi) in &sc.combine {
                let g = &batch.groups[gi as usize];
                let local = p - sc.group_pair0[gi as usize];
                let w = g.weights[local as usize];
                let y = &sc.pair_out[p as usize * h..(p as usize + 1) * h];
                let o = &mut out[t as usize * h..(t as usize + 1) * h];
                for (a, &b) in o.iter_mut().zip(y) {
                    *a += w * b;
                }
            }
        }
        Ok(())
    }

    fn loaded_bytes(&self) -> u64 {
        self.loaded_bytes
    }
}
