//! The CPU backend: the embedded default, and the bit-exact twin of the HIP kernels.
//!
//! Why this exists: the demo, the tests and every machine without an AMD GPU run experts here,
//! so it must be fast for real (decode is memory-bound: the goal is the machine's read
//! bandwidth) and exact (bit-identical to [`expertmesh_quant::reference`] in exact mode on every ISA).
//!
//! How a batch runs:
//! 1. each input token is quantized once (contract §1) unless it arrived quantized; with
//!    [`Isa::Amx`], the codes of the tokens that run on the AMX kernel (whole 16-token tiles of
//!    one expert, [`AMX_MIN_TOKENS`], against matrices of at least [`AMX_MIN_COLS`] columns)
//!    are then gathered block-major per tile (one contiguous A-tile read per block);
//! 2. **stage 1**, work items (unit, 32-row W13 tile): 16 gate rows and the matching 16 up rows
//!    for every token of the unit, then `silu(g)·u` into the pair's intermediate `h`;
//! 3. each pair's `h` is quantized (exact mode);
//! 4. **stage 2**, work items (unit, 64-row W2 tile): the expert outputs;
//! 5. per-slot rows are written in place, or pre-combined per token in output-row order.
//!
//! A unit is one group, or several groups of the same shape whose row blocks are read as
//! interleaved streams, each walking its expert's matrix in order, because one core reading
//! one stream leaves DRAM bandwidth unused ([`form_units`]): on AVX2 in exact mode up to
//! [`kernels::MAX_STREAMS`] groups of the same token count, one to
//! [`kernels::MAX_STREAM_TOKENS`], one stream per group with each weight tile unpacked once
//! for its tokens ([`kernels::rowblocks_exact`]); otherwise consecutive groups of one or two
//! tokens, one stream per token, [`kernels::MAX_STREAMS`] in all (decode: most experts get one
//! token or two; [`kernels::rowblocks_accurate_1`] in accurate mode, where AVX2 reads at most
//! two streams per pass).
//!
//! Accurate mode runs on the same integer kernels: each activation (input and intermediate)
//! is quantized into [`ACCURATE_LEVELS`] int8 levels that add back up to it within f32
//! rounding ([`kernels::quantize_levels`]), and a token's result is the sum of its levels'.
//!
//! Work items are claimed in runs of consecutive items from an atomic counter by every thread
//! of a fixed-size pool (sized by the topology's CPU device: no oversubscription; the caller's
//! thread is one of them, and the others spin between the steps of a call instead of
//! sleeping: [`pool`]), so large experts are split across threads, small ones do not leave
//! threads idle, and each thread's reads stay sequential. Within an item, tokens are
//! processed in tiles of [`kernels::MAX_TOKEN_TILE`] kernel tokens against each loaded weight
//! tile, and a row block's weights are re-read only from cache for further token tiles
//! (prefill blocking; stage 2 runs a token tile against all four row blocks of its item
//! before the next tile, so those re-reads come from L1 or L2: 27 KiB of weights at F = 768,
//! 72 KiB at F = 2048). All scratch buffers are sized at `load` from [`BatchLimits`] (the
//! activation codes for three levels per token or pair, accurate mode's); `execute`
//! allocates nothing.

pub mod amx;
pub mod kernels;
pub mod layout;
pub mod membw;
mod pool;
pub mod tile_cache;

use amx::{AMX_TOKEN_TILE, TokenRows};
use expertmesh_backend::{
    Activations, BackendError, BatchLimits, ContentId, ExpertBackend, ExpertGroup, ExpertKey,
    ExpertShape, ExpertSource, ExpertStager, GroupedBatch, OutputLayout, StagedExperts, VecSource,
};
use expertmesh_quant::aligned::AlignedVec;
use expertmesh_quant::contract::ComputeMode;
use expertmesh_quant::format::{BLOCK, ExpertWeights, PackedRows, QuantSpec};
use kernels::{ACCURATE_LEVELS, Isa, LevelsJob, MAX_TOKEN_TILE, RowBlockJob, TokenQ8};
use layout::MatrixDims;
use layout::{R16Matrix, ROWS};
use pool::SpinPool;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};

/// The most tokens a group may have to run in a [`UnitKind::PerToken`] unit (each token a
/// stream of its own, reading the group's row block again from cache): beyond it the
/// multi-token kernel, which unpacks each weight tile once for all the group's tokens, does
/// less work per byte.
const PER_TOKEN_GROUP_TOKENS: usize = 2;

/// The most outputs of one row block of a streams unit: a stream per group, its tokens each.
const MAX_UNIT_SLOTS: usize = kernels::MAX_STREAMS * kernels::MAX_STREAM_TOKENS;

/// Tokens per accurate-mode token tile: each token is [`ACCURATE_LEVELS`] kernel tokens.
const ACCURATE_TOKEN_TILE: usize = MAX_TOKEN_TILE / ACCURATE_LEVELS;

/// W2 row blocks per stage-2 work item (64 rows).
const W2_TILE_ROW_BLOCKS: usize = 4;

/// With [`Isa::Amx`], each full tile of this many tokens of one expert runs on the AMX kernel
/// and the rest (fewer than 16) on the VNNI kernels: measured on a 2-vCPU Xeon, AMX gains
/// only from about 12 tokens per tile (a K = 32 tile operation, its load and its store cost
/// about as much for 4 tokens as for 16).
pub const AMX_MIN_TOKENS: usize = AMX_TOKEN_TILE;

/// With [`Isa::Amx`], the AMX kernel runs only for matrices of at least this many columns:
/// its fixed cost per call (tile configuration, pipeline fill, the partials' tree; about
/// 0.35 µs) outweighs its gain over VNNI on short rows (measured on a 2-vCPU Xeon, 16 tokens,
/// same process: 1.2-1.8x VNNI from K = 768, mixed at 256-512).
pub const AMX_MIN_COLS: usize = 768;

/// One expert in the R16 layout.
#[derive(Debug)]
struct CpuExpert {
    inter: usize,
    /// Bytes of its packed weights (the format's accounting, as `loaded_bytes` counts).
    bytes: u64,
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

/// Where the quantized activations of a kernel's input rows live: row `r` is
/// `q[r·stride..][..len]`, `d`/`qsum` at `r·stride/32` (in accurate mode token or pair `r`
/// is rows `3r..3r + 3`, its levels).
#[derive(Clone, Copy)]
struct RowSource<'a> {
    q: &'a [i8],
    d: &'a [f32],
    qsum: &'a [i32],
    stride: usize,
    len: usize,
}

impl<'a> RowSource<'a> {
    /// Row `r` as one exact-mode token.
    fn token(&self, r: usize) -> TokenQ8<'a> {
        let (s, len, bs, nb) = (self.stride, self.len, self.stride / BLOCK, self.len / BLOCK);
        TokenQ8 {
            q: &self.q[r * s..r * s + len],
            d: &self.d[r * bs..r * bs + nb],
            qsum: &self.qsum[r * bs..r * bs + nb],
        }
    }
}

/// How a unit's groups run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum UnitKind {
    /// One group on the multi-token (or AMX) kernels.
    Own,
    /// Consecutive groups of up to [`PER_TOKEN_GROUP_TOKENS`] tokens, [`kernels::MAX_STREAMS`]
    /// tokens in all, one interleaved stream per token (two tokens of one group read the same
    /// row block, the second from cache): accurate mode ([`kernels::rowblocks_accurate_1`]),
    /// and exact mode on every ISA but AVX2 ([`kernels::rowblocks_exact`] of one token).
    PerToken,
    /// Up to [`kernels::MAX_STREAMS`] groups of the same token count `T` (1 to
    /// [`kernels::MAX_STREAM_TOKENS`]), one interleaved stream per group, each tile unpacked
    /// once for its `T` tokens ([`kernels::rowblocks_exact`] of `T`): exact mode on AVX2.
    PerGroup(u32),
}

/// A unit of work items: one group, or groups of the same expert shape whose row blocks the
/// kernels read as interleaved streams ([`form_units`], [`UnitKind`]).
#[derive(Clone, Copy, Debug)]
struct Unit {
    /// The unit's groups: the first `len`.
    groups: [u32; kernels::MAX_STREAMS],
    len: u32,
    kind: UnitKind,
    /// The outputs of one of its row blocks ([`unit_slots`]): its groups' tokens.
    slots: u32,
}

impl Unit {
    /// The unit's first group (its only one if it is [`UnitKind::Own`]).
    fn first(self) -> u32 {
        self.groups[0]
    }
}

/// The inputs of one token tile, gathered once and used for every row block of the tile (a
/// stack value built per tile, so the variants' size difference costs nothing).
#[allow(clippy::large_enum_variant)]
enum TileInputs<'a> {
    Exact([TokenQ8<'a>; MAX_TOKEN_TILE]),
    /// Accurate mode: each token's [`ACCURATE_LEVELS`] levels ([`kernels::quantize_levels`]),
    /// consecutive.
    Levels([TokenQ8<'a>; MAX_TOKEN_TILE]),
    /// Up to 16 tokens whose rows are evenly strided (pairs in group order), for AMX (on
    /// the tile emulator when the flag is set).
    Amx(TokenRows<'a>, bool),
}

impl<'a> TileInputs<'a> {
    /// The tile of `rows` (at most [`MAX_TOKEN_TILE`] in exact mode, [`ACCURATE_TOKEN_TILE`]
    /// in accurate mode, where row `r`'s levels are rows `3r..3r + 3` of `src`).
    fn gather(mode: ComputeMode, src: &RowSource<'a>, rows: impl Iterator<Item = usize>) -> Self {
        let mut t = [TokenQ8 {
            q: &[],
            d: &[],
            qsum: &[],
        }; MAX_TOKEN_TILE];
        match mode {
            ComputeMode::Exact => {
                for (j, r) in rows.enumerate() {
                    t[j] = src.token(r);
                }
                TileInputs::Exact(t)
            }
            ComputeMode::Accurate => {
                for (j, r) in rows.enumerate() {
                    for l in 0..ACCURATE_LEVELS {
                        t[ACCURATE_LEVELS * j + l] = src.token(ACCURATE_LEVELS * r + l);
                    }
                }
                TileInputs::Levels(t)
            }
        }
    }

    /// Rows `first..first + n` of `src` as one AMX token tile: row-major (`blocked` false:
    /// row `r` at `r·stride`) or gathered block-major ([`gather_amx_rows`]: block `b` of the
    /// tile's token `t` at `first·stride + (b·n + t)·32`).
    fn amx(src: &RowSource<'a>, first: usize, n: usize, blocked: bool, emulated: bool) -> Self {
        let bs = src.stride / BLOCK;
        let (q_stride, q_block) = if blocked {
            (BLOCK, BLOCK * n)
        } else {
            (src.stride, BLOCK)
        };
        TileInputs::Amx(
            TokenRows {
                q: &src.q[first * src.stride..],
                q_stride,
                q_block,
                d: &src.d[first * bs..],
                d_stride: bs,
                tokens: n,
            },
            emulated,
        )
    }

    /// Rows `16rb..16rb+16` of `m` for the first `n` tokens of the tile.
    fn run(&self, isa: Isa, m: &R16Matrix, rb: usize, n: usize, out: &mut [[f32; ROWS]]) {
        match self {
            TileInputs::Exact(t) => kernels::rowblock_exact(isa, m, rb, &t[..n], out),
            TileInputs::Levels(t) => {
                kernels::rowblock_levels(isa, m, rb, &t[..ACCURATE_LEVELS * n], out);
            }
            TileInputs::Amx(x, true) => {
                amx::rowblock_exact_emulated(m, rb, x, out, amx::EmulatedGlue::Avx512);
            }
            TileInputs::Amx(x, false) => amx::rowblock_exact_amx(m, rb, x, out)
                .expect("Isa::Amx is only in use where AMX is available (CpuBackend::with_isa)"),
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
    /// Input codes and scales gathered per pair, for the AMX kernel's strided rows
    /// (`[max_pairs][H]`, `[max_pairs][H/32]`; empty unless the ISA is [`Isa::Amx`]).
    xg: AlignedVec<i8>,
    xgd: AlignedVec<f32>,
    /// (unit, tile) work items.
    items: Vec<(u32, u32)>,
    /// The batch's groups as work units.
    units: Vec<Unit>,
    /// First pair index of each group.
    group_pair0: Vec<u32>,
    /// Expert index of each group.
    group_expert: Vec<u32>,
    /// (token, out_row, pair, group) for pre-combining.
    combine: Vec<(u32, u32, u32, u32)>,
    /// Output rows already claimed, for the batch check (`GroupedBatch::validate_with`).
    seen_rows: Vec<bool>,
}

/// The CPU expert backend.
pub struct CpuBackend {
    isa: Isa,
    /// Run the AMX kernel through the tile emulator (tests; [`CpuBackend::with_amx_emulated`]).
    amx_emulated: bool,
    /// Fewest matrix columns for the AMX kernel ([`AMX_MIN_COLS`]; tests lower it).
    amx_min_cols: usize,
    threads: usize,
    /// The CPUs the worker threads are pinned to (`None`: unpinned).
    pinned: Option<Vec<usize>>,
    pool: Option<SpinPool>,
    index: HashMap<ExpertKey, usize>,
    experts: Vec<CpuExpert>,
    limits: BatchLimits,
    scratch: Option<Scratch>,
    loaded_bytes: u64,
    /// Hidden size of every loaded expert.
    hidden: usize,
    /// Where `load_from` keeps and finds repacked arenas (`None`: it always repacks).
    tile_cache: Option<tile_cache::TileCache>,
    /// What the last `load_from` did with the tile cache.
    tile_cache_use: tile_cache::TileCacheUse,
    /// The thread writing the tiles the last `load_from` repacked, until taken.
    tile_cache_writer: Option<TileCacheWriter>,
}

/// A thread writing a repacked arena to the tile cache; it returns the outcome.
pub type TileCacheWriter = std::thread::JoinHandle<tile_cache::TileCacheUse>;

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
        Self::with_isa_pinned(threads, isa, None)
    }

    /// A backend whose helper thread `i` (`1 .. threads`; the caller's thread is the
    /// `threads`-th worker and is never pinned) is pinned to CPU `pin[i % pin.len()]` (`None`
    /// or an empty list: unpinned, wherever the OS schedules them). Pinning is best effort: a
    /// CPU outside the process's affinity mask leaves that thread unpinned; with one thread the
    /// work runs inline on the caller's thread and nothing is pinned. Pin only when this
    /// process owns those CPUs: two pinned processes on one CPU cannot move apart.
    pub fn with_isa_pinned(
        threads: usize,
        isa: Isa,
        pin: Option<Vec<usize>>,
    ) -> Result<Self, BackendError> {
        if !isa.supported() {
            return Err(BackendError::NoDevice {
                backend: "cpu",
                detail: format!("this CPU does not support {}", isa.name()),
            });
        }
        Self::build(threads, isa, pin, false)
    }

    /// For tests on any machine: [`Isa::Amx`]'s scheduling (token tiles of 16, rows gathered in
    /// pair order) with the AMX kernel run through the tile emulator
    /// ([`amx::rowblock_exact_emulated`]; slow) and the best available kernels elsewhere.
    #[doc(hidden)]
    pub fn with_amx_emulated(threads: usize) -> Result<Self, BackendError> {
        Self::build(threads, Isa::Amx, None, true)
    }

    fn build(
        threads: usize,
        isa: Isa,
        pin: Option<Vec<usize>>,
        amx_emulated: bool,
    ) -> Result<Self, BackendError> {
        let threads = threads.max(1);
        // One thread runs the work inline on the caller's thread, which is never pinned.
        let pin = pin.filter(|cpus| !cpus.is_empty() && threads > 1);
        let pinned = pin.clone();
        let pool = if threads > 1 {
            let on_start = move |i: usize| {
                if let Some(cpus) = &pin {
                    membw::pin_to(cpus[i % cpus.len()]);
                }
            };
            Some(
                SpinPool::new(threads, on_start).map_err(|e| BackendError::Device {
                    backend: "cpu",
                    detail: format!("cannot start {threads} threads: {e}"),
                })?,
            )
        } else {
            None
        };
        Ok(Self {
            isa,
            amx_emulated,
            amx_min_cols: if amx_emulated { 0 } else { AMX_MIN_COLS },
            threads,
            pinned,
            pool,
            index: HashMap::new(),
            experts: Vec::new(),
            limits: BatchLimits {
                max_tokens: 0,
                max_pairs: 0,
            },
            scratch: None,
            loaded_bytes: 0,
            hidden: 0,
            tile_cache: None,
            tile_cache_use: tile_cache::TileCacheUse::Unused,
            tile_cache_writer: None,
        })
    }

    /// Keep each device arena `load_from` repacks in `cache`, and map it from there instead of
    /// repacking when the same source (by its content id) is loaded again ([`tile_cache`]).
    /// `None`: always repack.
    pub fn set_tile_cache(&mut self, cache: Option<tile_cache::TileCache>) {
        self.tile_cache = cache;
    }

    /// What the last `load_from` did with the tile cache.
    pub fn tile_cache_use(&self) -> &tile_cache::TileCacheUse {
        &self.tile_cache_use
    }

    /// The thread writing the tiles the last `load_from` repacked (with
    /// [`tile_cache::TileCacheUse::Writing`]): join it for the outcome. A process that exits
    /// before it ends leaves a temporary file, which the next write removes.
    pub fn take_tile_cache_writer(&mut self) -> Option<TileCacheWriter> {
        self.tile_cache_writer.take()
    }

    /// For tests: run the AMX kernel (with [`Isa::Amx`]) on matrices of at least `cols`
    /// columns instead of [`AMX_MIN_COLS`], so small test shapes reach it.
    #[doc(hidden)]
    pub fn with_amx_min_cols(mut self, cols: usize) -> Self {
        self.amx_min_cols = cols;
        self
    }

    /// The ISA in use.
    pub fn isa(&self) -> Isa {
        self.isa
    }

    /// Worker threads.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// The CPUs the worker threads are pinned to (`None`: unpinned).
    pub fn pinned_cpus(&self) -> Option<&[usize]> {
        self.pinned.as_deref()
    }

    /// Run `n` work items on every thread of the pool (or inline with one thread).
    ///
    /// Threads claim runs of consecutive items (about an eighth of a thread's share, so the
    /// last runs still balance the load): consecutive items read consecutive row blocks, so a
    /// thread's weight reads stay one long stream its prefetches run ahead in, rather than
    /// hopping over the row blocks another thread reads.
    fn run_items(pool: Option<&SpinPool>, n: usize, f: impl Fn(usize) + Sync) {
        if n == 0 {
            return;
        }
        match pool {
            None => (0..n).for_each(f),
            Some(pool) => {
                let run = n.div_ceil(8 * pool.threads()).max(1);
                let next = AtomicUsize::new(0);
                pool.run(&|_| {
                    loop {
                        let first = next.fetch_add(run, Ordering::Relaxed);
                        if first >= n {
                            break;
                        }
                        (first..(first + run).min(n)).for_each(&f);
                    }
                });
            }
        }
    }
}

/// The error for an expert that differs from what its source announced.
fn mismatch(s: &ExpertShape, rows: usize, cols: usize, spec: QuantSpec) -> BackendError {
    BackendError::Source(format!(
        "{} was announced as hidden {} intermediate {} {} but has a {rows}x{cols} {spec} matrix",
        s.key, s.hidden, s.inter, s.quant
    ))
}

impl Scratch {
    /// Every buffer a batch up to `limits` needs, for `experts` experts of at most
    /// `max_inter` intermediate size.
    fn new(hidden: usize, max_inter: usize, experts: usize, limits: BatchLimits, isa: Isa) -> Self {
        let (t, p) = (limits.max_tokens, limits.max_pairs);
        // Rows per token or pair: accurate mode's levels.
        let lv = ACCURATE_LEVELS;
        let gp = if isa == Isa::Amx { p } else { 0 };
        let max_items_per_group =
            (2 * max_inter / 32).max(hidden.div_ceil(ROWS * W2_TILE_ROW_BLOCKS));
        let max_groups = p.min(experts);
        Scratch {
            hidden,
            max_inter,
            xq: AlignedVec::zeroed(lv * t * hidden),
            xd: AlignedVec::zeroed(lv * t * hidden / BLOCK),
            xqs: AlignedVec::zeroed(lv * t * hidden / BLOCK),
            h: AlignedVec::zeroed(p * max_inter),
            hq: AlignedVec::zeroed(lv * p * max_inter),
            hd: AlignedVec::zeroed(lv * p * max_inter / BLOCK),
            hqs: AlignedVec::zeroed(lv * p * max_inter / BLOCK),
            pair_out: AlignedVec::zeroed(p * hidden),
            xg: AlignedVec::zeroed(gp * hidden),
            xgd: AlignedVec::zeroed(gp * hidden / BLOCK),
            items: Vec::with_capacity(max_groups * max_items_per_group),
            units: Vec::with_capacity(max_groups),
            group_pair0: Vec::with_capacity(max_groups + 1),
            group_expert: Vec::with_capacity(max_groups),
            combine: Vec::with_capacity(p),
            seen_rows: Vec::with_capacity(p),
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
        self.load_from(&mut VecSource::new(experts), limits)
    }

    /// Packs each expert into the device arena as the source hands it over: the canonical
    /// set is never in memory whole (a worker loading a shard holds one expert at a time).
    fn load_from(
        &mut self,
        source: &mut dyn ExpertSource,
        limits: BatchLimits,
    ) -> Result<(), BackendError> {
        self.tile_cache_use = tile_cache::TileCacheUse::Unused;
        self.tile_cache_writer = None;
        let packed = match (&self.tile_cache, source.content_id()) {
            (Some(cache), Some(id)) => {
                // The check of a kept file runs on the device's threads, at least two: a
                // repacking load also checks its shard on a second thread beside the repack.
                let (packed, used, writer) = load_cached(cache, &id, source, self.threads.max(2))?;
                self.tile_cache_use = used;
                self.tile_cache_writer = writer;
                packed
            }
            (cache, _) => {
                self.tile_cache_use = if cache.is_some() {
                    tile_cache::TileCacheUse::NoContentId
                } else {
                    tile_cache::TileCacheUse::Unused
                };
                pack_source(source, None)?
            }
        };
        self.index = packed
            .keys
            .iter()
            .enumerate()
            .map(|(i, &k)| (k, i))
            .collect();
        self.experts = packed.experts;
        self.limits = limits;
        self.loaded_bytes = packed.bytes;
        self.hidden = packed.hidden;
        self.resize_scratch();
        Ok(())
    }

    fn execute(&mut self, batch: &GroupedBatch<'_>, out: &mut [f32]) -> Result<(), BackendError> {
        let Some(sc) = self.scratch.as_mut() else {
            return Err(BackendError::NotLoaded);
        };
        batch.validate_with(&self.limits, out.len(), &mut sc.seen_rows)?;
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
        resolve_groups(
            &self.index,
            batch,
            &mut sc.group_pair0,
            &mut sc.group_expert,
        )?;
        let pass = Pass {
            batch,
            experts: &self.experts,
            pool: self.pool.as_ref(),
            isa: self.isa,
            amx_emulated: self.amx_emulated,
            amx_min_cols: self.amx_min_cols,
            mode: batch.mode,
            max_inter: sc.max_inter,
            group_pair0: &sc.group_pair0,
            group_expert: &sc.group_expert,
            units: &[],
        };
        form_units(&pass, &mut sc.units);
        let pass = Pass {
            units: &sc.units,
            ..pass
        };

        // 1. Quantize the input once per token (exact mode).
        let xsrc = quantize_inputs(
            batch,
            self.isa,
            self.pool.as_ref(),
            &mut sc.xq,
            &mut sc.xd,
            &mut sc.xqs,
        );
        // 1b. Rows in pair order for the AMX groups (their A tiles need evenly strided rows).
        let xg = gather_amx_rows(&pass, &xsrc, &mut sc.xg, &mut sc.xgd);
        // 2. Stage 1 items: (group, 32-row W13 tile).
        stage1(&pass, &mut sc.items, &xsrc, &xg, &mut sc.h);
        // 3. Quantize each pair's intermediate (accurate mode: its levels).
        quantize_intermediate(&pass, &sc.h, &mut sc.hq, &mut sc.hd, &mut sc.hqs);
        // 4. Stage 2 items: (group, 64-row W2 tile).
        let per_slot = batch.layout == OutputLayout::PerSlot;
        let hsrc = RowSource {
            q: &sc.hq,
            d: &sc.hd,
            qsum: &sc.hqs,
            stride: sc.max_inter,
            len: sc.max_inter,
        };
        let y: &mut [f32] = if per_slot {
            &mut *out
        } else {
            &mut sc.pair_out
        };
        stage2(&pass, &mut sc.items, &hsrc, y, per_slot);
        // 5. Pre-combine per token in output-row order (contract §5).
        if !per_slot {
            precombine(batch, &sc.group_pair0, &mut sc.combine, &sc.pair_out, out);
        }
        Ok(())
    }

    fn loaded_bytes(&self) -> u64 {
        self.loaded_bytes
    }

    /// Packs the new experts into an arena of their own (the loaded ones are untouched and
    /// keep serving), then adds them; the scratch buffers grow with the expert count.
    fn add_experts(&mut self, source: &mut dyn ExpertSource) -> Result<(), BackendError> {
        if self.scratch.is_none() {
            return Err(BackendError::NotLoaded);
        }
        // A device that holds nothing yet takes the hidden size of what it gains.
        let loaded = (!self.experts.is_empty()).then_some((&self.index, self.hidden));
        let packed = pack_source(source, loaded)?;
        self.append(packed)
    }

    fn stager(&self) -> Option<Box<dyn ExpertStager>> {
        Some(Box::new(CpuStager))
    }

    fn install(&mut self, staged: StagedExperts) -> Result<(), BackendError> {
        if self.scratch.is_none() {
            return Err(BackendError::NotLoaded);
        }
        let packed = staged.packed.downcast::<PackedSet>().map_err(|_| {
            BackendError::Source("these experts were staged by another backend".into())
        })?;
        self.append(*packed)
    }

    /// Drops the experts; an arena's memory returns once none of its experts is left.
    fn release_experts(&mut self, keys: &[ExpertKey]) -> Result<(), BackendError> {
        if let Some(k) = keys.iter().find(|k| !self.index.contains_key(k)) {
            return Err(BackendError::UnknownExpert(*k));
        }
        let gone: std::collections::HashSet<usize> = keys.iter().map(|k| self.index[k]).collect();
        let mut order: Vec<(usize, ExpertKey)> = self.index.iter().map(|(&k, &i)| (i, k)).collect();
        order.sort_unstable();
        let experts = std::mem::take(&mut self.experts);
        self.index.clear();
        for ((i, key), e) in order.into_iter().zip(experts) {
            if gone.contains(&i) {
                self.loaded_bytes -= e.bytes;
                continue;
            }
            self.index.insert(key, self.experts.len());
            self.experts.push(e);
        }
        self.resize_scratch();
        Ok(())
    }
}

/// The CPU backend's stager: packs on the calling thread into an arena of its own.
struct CpuStager;

impl ExpertStager for CpuStager {
    fn stage(&self, source: &mut dyn ExpertSource) -> Result<StagedExperts, BackendError> {
        let packed = pack_source(source, None)?;
        Ok(StagedExperts {
            keys: packed.keys.clone(),
            bytes: packed.bytes,
            packed: Box::new(packed),
        })
    }
}

impl CpuBackend {
    /// Adds packed experts next to the loaded ones: refused (nothing added) when one is
    /// loaded already or their hidden size differs (a device holding nothing takes theirs).
    fn append(&mut self, packed: PackedSet) -> Result<(), BackendError> {
        if !self.experts.is_empty() && !packed.keys.is_empty() && packed.hidden != self.hidden {
            return Err(BackendError::Shape(format!(
                "{} has hidden size {} but the loaded experts have {}",
                packed.keys[0], packed.hidden, self.hidden
            )));
        }
        if let Some(k) = packed.keys.iter().find(|k| self.index.contains_key(k)) {
            return Err(BackendError::Shape(format!("{k} was given twice")));
        }
        if !packed.keys.is_empty() {
            self.hidden = packed.hidden;
        }
        for (k, e) in packed.keys.into_iter().zip(packed.experts) {
            self.index.insert(k, self.experts.len());
            self.experts.push(e);
        }
        self.loaded_bytes += packed.bytes;
        self.resize_scratch();
        Ok(())
    }

    /// Buffers for batches up to the limits over the experts loaded now (a load, or a live
    /// change of the set: never on the data path).
    fn resize_scratch(&mut self) {
        let max_inter = self.experts.iter().map(|e| e.inter).max().unwrap_or(0);
        self.scratch = Some(Scratch::new(
            self.hidden,
            max_inter,
            self.experts.len(),
            self.limits,
            self.isa,
        ));
    }
}

/// Experts packed from a source ([`pack_source`]), in the source's order.
struct PackedSet {
    keys: Vec<ExpertKey>,
    experts: Vec<CpuExpert>,
    hidden: usize,
    bytes: u64,
}

/// The shapes of `source`'s experts, checked: one hidden size (`loaded`'s, with experts
/// already loaded, whose keys must not come again), shapes the format can hold, no key twice.
/// Returns the hidden size, the canonical bytes and the matrices to pack (W13, W2 per expert).
fn checked_shapes(
    shapes: &[ExpertShape],
    loaded: Option<(&HashMap<ExpertKey, usize>, usize)>,
) -> Result<(usize, u64, Vec<MatrixDims>), BackendError> {
    let hidden = loaded.map_or_else(|| shapes.first().map_or(0, |s| s.hidden), |(_, h)| h);
    let mut seen = std::collections::HashSet::with_capacity(shapes.len());
    for s in shapes {
        if s.hidden != hidden {
            return Err(BackendError::Shape(format!(
                "{} has hidden size {} but other experts have {hidden}",
                s.key, s.hidden
            )));
        }
        s.quant
            .check_shape("W13", s.hidden)
            .and_then(|()| s.quant.check_shape("W2", s.inter))
            .map_err(|e| BackendError::Shape(format!("{}: {e}", s.key)))?;
        if !seen.insert(s.key) || loaded.is_some_and(|(index, _)| index.contains_key(&s.key)) {
            return Err(BackendError::Shape(format!("{} was given twice", s.key)));
        }
    }
    let bytes: u64 = shapes
        .iter()
        .map(|s| s.quant.expert_bytes(s.hidden as u64, s.inter as u64))
        .sum();
    let dims: Vec<MatrixDims> = shapes
        .iter()
        .flat_map(|s| {
            [
                (2 * s.inter, s.hidden, s.quant),
                (s.hidden, s.inter, s.quant),
            ]
        })
        .collect();
    Ok((hidden, bytes, dims))
}

/// The experts of `shapes` over their packed matrices (W13, W2 per expert, in order).
fn assemble(
    shapes: &[ExpertShape],
    matrices: Vec<R16Matrix>,
    hidden: usize,
    bytes: u64,
) -> PackedSet {
    let mut packed = matrices.into_iter();
    let mut experts = Vec::with_capacity(shapes.len());
    for s in shapes {
        let (Some(w13), Some(w2)) = (packed.next(), packed.next()) else {
            unreachable!("two matrices were packed per expert")
        };
        experts.push(CpuExpert {
            inter: s.inter,
            bytes: s.quant.expert_bytes(s.hidden as u64, s.inter as u64),
            w13,
            w2,
        });
    }
    PackedSet {
        keys: shapes.iter().map(|s| s.key).collect(),
        experts,
        hidden,
        bytes,
    }
}

/// The experts of `source` from `cache` when it holds a checked arena of the source's content
/// (`content`): the source hands over nothing and is not finished. Otherwise packed from the
/// source (which checks its data at `finish`), and only then the arena written to the cache
/// for the next load, by the thread returned. A cache failure never fails the load; what
/// happened is returned.
fn load_cached(
    cache: &tile_cache::TileCache,
    content: &ContentId,
    source: &mut dyn ExpertSource,
    threads: usize,
) -> Result<(PackedSet, tile_cache::TileCacheUse, Option<TileCacheWriter>), BackendError> {
    use tile_cache::TileCacheUse;
    let shapes: Vec<ExpertShape> = source.shapes().to_vec();
    let (hidden, bytes, dims) = checked_shapes(&shapes, None)?;
    let description = tile_cache::description(content, &shapes, &dims);
    if shapes.is_empty() {
        // Nothing to keep (a device that holds no experts yet).
        return Ok((
            pack_checked(source, &shapes, hidden, bytes, &dims)?,
            TileCacheUse::Unused,
            None,
        ));
    }
    let miss = match cache.open(&content.place, &description, &dims, threads) {
        Ok((matrices, file, lock_error)) => {
            let packed = assemble(&shapes, matrices, hidden, bytes);
            return Ok((packed, TileCacheUse::Reused { file, lock_error }, None));
        }
        Err(miss) => miss,
    };
    let packed = pack_checked(source, &shapes, hidden, bytes, &dims)?;
    let Some(arena) = packed
        .experts
        .first()
        .map(|e| std::sync::Arc::clone(e.w13.arena()))
    else {
        return Ok((packed, TileCacheUse::Unused, None));
    };
    // Written beside the serving, not before it: the load does not wait for the disk.
    let file = cache.file_for(&content.place);
    let (cache, place, found) = (cache.clone(), content.place.clone(), miss.clone());
    let write = move || {
        let t0 = std::time::Instant::now();
        match cache.store(&place, &description, &arena, &found) {
            Ok(file) => TileCacheUse::Written {
                file,
                miss: found.why,
                write_s: t0.elapsed().as_secs_f64(),
            },
            Err(error) => TileCacheUse::NotWritten {
                miss: found.why,
                error,
            },
        }
    };
    match std::thread::Builder::new()
        .name("tile-cache-write".into())
        .spawn(write)
    {
        Ok(writer) => Ok((
            packed,
            TileCacheUse::Writing {
                file,
                miss: miss.why,
            },
            Some(writer),
        )),
        Err(e) => Ok((
            packed,
            TileCacheUse::NotWritten {
                miss: miss.why,
                error: format!("cannot start the thread that writes it: {e}"),
            },
            None,
        )),
    }
}

/// Packs every expert of `source` into one arena (huge pages, one stream of allocations),
/// each as the source hands it over. With `loaded` (the index and hidden size of experts
/// already loaded) the new ones must have that hidden size and keys not loaded yet.
fn pack_source(
    source: &mut dyn ExpertSource,
    loaded: Option<(&HashMap<ExpertKey, usize>, usize)>,
) -> Result<PackedSet, BackendError> {
    let shapes: Vec<ExpertShape> = source.shapes().to_vec();
    let (hidden, bytes, dims) = checked_shapes(&shapes, loaded)?;
    pack_checked(source, &shapes, hidden, bytes, &dims)
}

/// [`pack_source`] of `shapes` (the source's, checked) into the matrices `dims`.
fn pack_checked(
    source: &mut dyn ExpertSource,
    shapes: &[ExpertShape],
    hidden: usize,
    bytes: u64,
    dims: &[MatrixDims],
) -> Result<PackedSet, BackendError> {
    let mut pending_w2: Option<expertmesh_quant::format::PackedMatrix> = None;
    let packed = R16Matrix::pack_streamed(dims, |i, write| {
        let (s, d) = (&shapes[i / 2], dims[i]);
        // In place when the source can (a mapped shard): no copy before the repack.
        if let Some(r) = source.expert_ref(i / 2) {
            let (w13, w2) = r?;
            let m: &dyn PackedRows = if i % 2 == 0 { &w13 } else { &w2 };
            if (m.rows(), m.cols(), m.spec()) != d {
                return Err(mismatch(s, m.rows(), m.cols(), m.spec()));
            }
            write(m);
            return Ok(());
        }
        if i % 2 == 1 {
            let w2 = pending_w2.take().expect("W2 follows its W13");
            write(&w2);
            return Ok(());
        }
        let w = source.expert(i / 2)?;
        if (w.hidden(), w.inter(), w.spec()) != (s.hidden, s.inter, s.quant) {
            return Err(mismatch(s, 2 * w.inter(), w.hidden(), w.spec()));
        }
        let (w13, w2) = w.into_parts();
        write(&w13);
        pending_w2 = Some(w2);
        Ok(())
    })?;
    source.finish()?;
    Ok(assemble(shapes, packed, hidden, bytes))
}

/// What every step of one `execute` shares: the batch, the loaded experts, the pool and the
/// group-major pair layout (borrowed from the scratch, so the steps allocate nothing).
struct Pass<'a, 'b> {
    batch: &'a GroupedBatch<'b>,
    experts: &'a [CpuExpert],
    pool: Option<&'a SpinPool>,
    isa: Isa,
    amx_emulated: bool,
    amx_min_cols: usize,
    mode: ComputeMode,
    max_inter: usize,
    /// First pair index of each group, and the total pair count last.
    group_pair0: &'a [u32],
    /// Expert index of each group.
    group_expert: &'a [u32],
    /// The groups as work units.
    units: &'a [Unit],
}

impl<'a, 'b> Pass<'a, 'b> {
    /// How many of a group's `n` tokens run on the AMX kernel against a matrix of `k`
    /// columns (whole tiles of 16, first).
    #[inline(always)]
    fn amx_tokens(&self, n: usize, k: usize) -> usize {
        if self.isa == Isa::Amx
            && self.mode == ComputeMode::Exact
            && n >= AMX_MIN_TOKENS
            && k >= self.amx_min_cols
        {
            n / AMX_TOKEN_TILE * AMX_TOKEN_TILE
        } else {
            0
        }
    }

    /// A group's token tiles: `(first, len, amx)` in token order, the AMX tiles of 16 first,
    /// then tiles of up to [`MAX_TOKEN_TILE`] for the VNNI (or AVX2, scalar) kernels.
    #[inline(always)]
    fn token_tiles(&self, n: usize, k: usize) -> impl Iterator<Item = (usize, usize, bool)> {
        let amx = self.amx_tokens(n, k);
        let tile = match self.mode {
            ComputeMode::Exact => MAX_TOKEN_TILE,
            ComputeMode::Accurate => ACCURATE_TOKEN_TILE,
        };
        let big = (0..amx).step_by(AMX_TOKEN_TILE);
        let small = (amx..n).step_by(tile);
        big.map(|f| (f, AMX_TOKEN_TILE, true))
            .chain(small.map(move |f| (f, tile.min(n - f), false)))
    }

    /// Group `gi` of a work item: the group, its expert and its first pair index.
    #[inline(always)]
    fn item_group(&self, gi: u32) -> (&'a ExpertGroup<'b>, &'a CpuExpert, usize) {
        let gi = gi as usize;
        (
            &self.batch.groups[gi],
            &self.experts[self.group_expert[gi] as usize],
            self.group_pair0[gi] as usize,
        )
    }
}

/// Step 0b: the batch's groups as work units ([`UnitKind`]): exact mode on AVX2 in units of
/// equal groups ([`form_units_per_group`]), otherwise in units of consecutive small groups
/// ([`form_units_per_token`]); every other group (more tokens, or none) is a unit of its own.
///
/// Why two: per token, the per-group streams kernel does less work (in L2, one core, K =
/// 2048, four streams of 2/3/4 tokens: 1.25/1.27/1.31× the weight bytes per second of a stream
/// per token on AVX2, 1.18/1.4/1.4× on AVX-512), and AVX2 decode is held by the kernels'
/// arithmetic: Qwen3-30B-A3B decode through the backend read 1.4/5.6/8.7 % more at 4/16/64
/// tokens with it (in-process, alternating the two, EPYC Zen 4 VM). On AVX-512 the same read
/// 4-7 % *less* at 16-64 tokens (there the reads bind, four experts of several tokens per core
/// are more streams in flight than one expert's two, and groups of three or more tokens run
/// faster on the multi-token kernel), so AVX-512 keeps per-token units. BENCHMARKS.md,
/// "Decode streams of several tokens" (session 60).
fn form_units(pass: &Pass<'_, '_>, units: &mut Vec<Unit>) {
    units.clear();
    let groups = pass.batch.groups;
    let tokens = |gi: u32| groups[gi as usize].tokens.len();
    let inter = |gi: u32| pass.experts[pass.group_expert[gi as usize] as usize].inter;
    if pass.mode == ComputeMode::Exact && pass.isa == Isa::Avx2 {
        form_units_per_group(groups.len(), tokens, inter, units);
    } else {
        form_units_per_token(groups.len(), tokens, inter, units);
    }
}

/// A unit of the one group `gi`, on the multi-token kernels.
fn own_unit(gi: u32) -> Unit {
    Unit {
        groups: [gi; kernels::MAX_STREAMS],
        len: 1,
        kind: UnitKind::Own,
        slots: 0,
    }
}

/// [`UnitKind::PerToken`] units of the `n` groups (group `gi` has `tokens(gi)` tokens and an
/// expert of intermediate size `inter(gi)`): runs of consecutive groups of one to
/// [`PER_TOKEN_GROUP_TOKENS`] tokens of the same intermediate size, at most
/// [`kernels::MAX_STREAMS`] tokens each.
fn form_units_per_token(
    n: usize,
    tokens: impl Fn(u32) -> usize,
    inter: impl Fn(u32) -> usize,
    units: &mut Vec<Unit>,
) {
    // A group without tokens (allowed: nothing to compute) stays a unit of its own.
    let streams = |gi: u32| (1..=PER_TOKEN_GROUP_TOKENS).contains(&tokens(gi));
    let mut gi = 0;
    while (gi as usize) < n {
        if !streams(gi) {
            units.push(own_unit(gi));
            gi += 1;
            continue;
        }
        let mut unit = Unit {
            kind: UnitKind::PerToken,
            slots: tokens(gi) as u32,
            ..own_unit(gi)
        };
        while ((gi + unit.len) as usize) < n {
            let next = gi + unit.len;
            let slots = unit.slots as usize + tokens(next);
            if !streams(next) || slots > kernels::MAX_STREAMS || inter(next) != inter(gi) {
                break;
            }
            unit.groups[unit.len as usize] = next;
            unit.len += 1;
            unit.slots = slots as u32;
        }
        units.push(unit);
        gi += unit.len;
    }
}

/// [`UnitKind::PerGroup`] units of the `n` groups (as [`form_units_per_token`]'s): walking
/// the groups in batch order, each group of one to [`kernels::MAX_STREAM_TOKENS`] tokens
/// joins the open unit of its token count, which is emitted once it holds
/// [`kernels::MAX_STREAMS`] groups or the next group of that count has another intermediate
/// size; the open units are emitted at the end. In batch order, not sorted by token count:
/// heavy (more tokens) and light units stay mixed along the work list, so the threads' runs
/// mix arithmetic and reads (sorted, the heaviest units would all come last, where the last
/// runs should even the threads out; `bench kernels` could not tell the two orders apart on
/// the EPYC Zen 4 VM).
fn form_units_per_group(
    n: usize,
    tokens: impl Fn(u32) -> usize,
    inter: impl Fn(u32) -> usize,
    units: &mut Vec<Unit>,
) {
    // The open unit of each token count (index: tokens − 1).
    let mut open: [Option<Unit>; kernels::MAX_STREAM_TOKENS] = [None; kernels::MAX_STREAM_TOKENS];
    for gi in 0..n as u32 {
        let tokens = tokens(gi);
        if !(1..=kernels::MAX_STREAM_TOKENS).contains(&tokens) {
            units.push(own_unit(gi));
            continue;
        }
        let slot = &mut open[tokens - 1];
        if let Some(u) = slot.take_if(|u| inter(u.first()) != inter(gi)) {
            units.push(u);
        }
        let u = slot.get_or_insert(Unit {
            len: 0,
            kind: UnitKind::PerGroup(tokens as u32),
            ..own_unit(gi)
        });
        u.groups[u.len as usize] = gi;
        u.len += 1;
        u.slots += tokens as u32;
        if u.len as usize == kernels::MAX_STREAMS {
            units.extend(slot.take());
        }
    }
    units.extend(open.into_iter().flatten());
}

/// The slots of a streams unit: (group, token within the group) for each of its
/// [`Unit::slots`] outputs, group-major (slots past them repeat the last).
fn unit_slots(pass: &Pass<'_, '_>, unit: Unit) -> [(u32, usize); MAX_UNIT_SLOTS] {
    let mut slots = [(unit.first(), 0); MAX_UNIT_SLOTS];
    let mut n = 0;
    for &gi in &unit.groups[..unit.len as usize] {
        for local in 0..pass.batch.groups[gi as usize].tokens.len() {
            slots[n] = (gi, local);
            n += 1;
        }
    }
    let last = slots[n.max(1) - 1];
    slots[n..].fill(last);
    slots
}

/// Rebuild the (unit, tile) work items: `tiles(gi)` tiles for each of the `groups` groups.
fn fill_items(items: &mut Vec<(u32, u32)>, groups: usize, tiles: impl Fn(usize) -> usize) {
    items.clear();
    for gi in 0..groups {
        for tile in 0..tiles(gi) {
            items.push((gi as u32, tile as u32));
        }
    }
}

/// Step 0: resolve each group's expert and lay out pairs group-major.
fn resolve_groups(
    index: &HashMap<ExpertKey, usize>,
    batch: &GroupedBatch<'_>,
    group_pair0: &mut Vec<u32>,
    group_expert: &mut Vec<u32>,
) -> Result<(), BackendError> {
    group_pair0.clear();
    group_expert.clear();
    let mut pair = 0u32;
    for g in batch.groups {
        let Some(&e) = index.get(&g.key) else {
            return Err(BackendError::UnknownExpert(g.key));
        };
        group_pair0.push(pair);
        group_expert.push(e as u32);
        pair += g.tokens.len() as u32;
    }
    group_pair0.push(pair);
    Ok(())
}

/// The pool to quantize `values` activations on: quantizing is cheap, only worth waking the
/// pool for many values (2^16 or more).
fn quantize_pool(pool: Option<&SpinPool>, values: usize) -> Option<&SpinPool> {
    pool.filter(|_| values >= 1 << 16)
}

/// Step 1: quantize the input once per token (exact mode) into the scratch, and describe where
/// the kernels read each token's row. Tokens are spread over the pool when there are many
/// (a 256-token prefill's inputs took 2-4 % of the call on one thread while the other waited).
fn quantize_inputs<'a>(
    batch: &GroupedBatch<'a>,
    batch_isa: Isa,
    pool: Option<&SpinPool>,
    xq: &'a mut [i8],
    xd: &'a mut [f32],
    xqs: &'a mut [i32],
) -> RowSource<'a> {
    let h = batch.hidden;
    let nb = h / BLOCK;
    let qpool = quantize_pool(pool, batch.tokens * h);
    let (q, d, qsum): (&[i8], &[f32], &[i32]) = match (batch.mode, batch.input) {
        (ComputeMode::Exact, Activations::F32(x)) => {
            let (sq, sd, ss) = (
                SharedMut(xq.as_mut_ptr()),
                SharedMut(xd.as_mut_ptr()),
                SharedMut(xqs.as_mut_ptr()),
            );
            assert!(xq.len() >= batch.tokens * h && xd.len().min(xqs.len()) >= batch.tokens * nb);
            CpuBackend::run_items(qpool, batch.tokens, |t| {
                // SAFETY: token t owns codes t·H.. and blocks t·nb.. of the scratch (its
                // lengths asserted above); no other item writes them.
                let (q, d, s) = unsafe {
                    (
                        std::slice::from_raw_parts_mut(sq.ptr().add(t * h), h),
                        std::slice::from_raw_parts_mut(sd.ptr().add(t * nb), nb),
                        std::slice::from_raw_parts_mut(ss.ptr().add(t * nb), nb),
                    )
                };
                kernels::quantize_activations_sums(batch_isa, &x[t * h..(t + 1) * h], q, d, s);
            });
            (
                &xq[..batch.tokens * h],
                &xd[..batch.tokens * nb],
                &xqs[..batch.tokens * nb],
            )
        }
        (ComputeMode::Accurate, Activations::F32(x)) => {
            let rows = ACCURATE_LEVELS * batch.tokens;
            let (sq, sd, ss) = (
                SharedMut(xq.as_mut_ptr()),
                SharedMut(xd.as_mut_ptr()),
                SharedMut(xqs.as_mut_ptr()),
            );
            assert!(xq.len() >= rows * h && xd.len().min(xqs.len()) >= rows * nb);
            CpuBackend::run_items(qpool, batch.tokens, |t| {
                let (r, rb) = (ACCURATE_LEVELS * t * h, ACCURATE_LEVELS * t * nb);
                // SAFETY: token t owns its ACCURATE_LEVELS rows of codes and blocks (lengths
                // asserted above); no other item writes them.
                let (q, d, s) = unsafe {
                    (
                        std::slice::from_raw_parts_mut(sq.ptr().add(r), ACCURATE_LEVELS * h),
                        std::slice::from_raw_parts_mut(sd.ptr().add(rb), ACCURATE_LEVELS * nb),
                        std::slice::from_raw_parts_mut(ss.ptr().add(rb), ACCURATE_LEVELS * nb),
                    )
                };
                kernels::quantize_levels(batch_isa, &x[t * h..(t + 1) * h], q, d, s, h, nb);
            });
            (&xq[..rows * h], &xd[..rows * nb], &xqs[..rows * nb])
        }
        (ComputeMode::Exact, Activations::Q8 { q, d }) => {
            for t in 0..batch.tokens {
                kernels::block_sums(&q[t * h..(t + 1) * h], &mut xqs[t * nb..(t + 1) * nb]);
            }
            (q, d, &xqs[..batch.tokens * nb])
        }
        _ => (&[][..], &[][..], &[][..]),
    };
    RowSource {
        q,
        d,
        qsum,
        stride: h,
        len: h,
    }
}

/// Step 1b: copy the input codes of the AMX token tiles into pair order, block-major within
/// each tile of 16 (block `b` of the tile's token `t` at `tile_start·H + (16b + t)·32`, so an A
/// tile is one contiguous 512-byte read), and their block scales row by row; returns where
/// they are (indexed by pair).
fn gather_amx_rows<'a>(
    pass: &Pass<'_, '_>,
    xsrc: &RowSource<'_>,
    xg: &'a mut [i8],
    xgd: &'a mut [f32],
) -> RowSource<'a> {
    let (h, nb) = (pass.batch.hidden, pass.batch.hidden / BLOCK);
    for (gi, g) in pass.batch.groups.iter().enumerate() {
        let p0 = pass.group_pair0[gi] as usize;
        let amx = pass.amx_tokens(g.tokens.len(), h);
        for (i, &t) in g.tokens[..amx].iter().enumerate() {
            let (t, p) = (t as usize, p0 + i);
            let tile = &mut xg[(p - i % AMX_TOKEN_TILE) * h..][..AMX_TOKEN_TILE * h];
            let row = &xsrc.q[t * h..(t + 1) * h];
            for (b, codes) in row.chunks_exact(BLOCK).enumerate() {
                let at = (b * AMX_TOKEN_TILE + i % AMX_TOKEN_TILE) * BLOCK;
                tile[at..at + BLOCK].copy_from_slice(codes);
            }
            xgd[p * nb..(p + 1) * nb].copy_from_slice(&xsrc.d[t * nb..(t + 1) * nb]);
        }
    }
    RowSource {
        q: xg,
        d: xgd,
        qsum: &[],
        stride: h,
        len: h,
    }
}

/// Step 2: stage 1 over (group, 32-row W13 tile) items: gate and up rows, then `silu(g)·u`
/// into each pair's intermediate row of `hbuf` (`[max_pairs][max_inter]`).
fn stage1(
    pass: &Pass<'_, '_>,
    items: &mut Vec<(u32, u32)>,
    xsrc: &RowSource<'_>,
    xg: &RowSource<'_>,
    hbuf: &mut [f32],
) {
    let &Pass {
        experts,
        pool,
        isa,
        mode,
        max_inter,
        group_expert,
        ..
    } = pass;
    let units = pass.units;
    fill_items(items, units.len(), |u| {
        experts[group_expert[units[u].first() as usize] as usize].inter / 16
    });
    let hbuf = SharedMut(hbuf.as_mut_ptr());
    let items = &*items;
    CpuBackend::run_items(pool, items.len(), |i| {
        let (u, tile) = items[i];
        let unit = units[u as usize];
        if unit.kind != UnitKind::Own {
            stage1_streams(pass, unit, tile as usize, xsrc, hbuf);
            return;
        }
        let (g, ex, p0) = pass.item_group(unit.first());
        let mut gate = [[0f32; ROWS]; AMX_TOKEN_TILE];
        let mut up = [[0f32; ROWS]; AMX_TOKEN_TILE];
        for (first, n, amx) in pass.token_tiles(g.tokens.len(), ex.w13.cols()) {
            let inputs = if amx {
                TileInputs::amx(xg, p0 + first, n, true, pass.amx_emulated)
            } else {
                let toks = &g.tokens[first..first + n];
                TileInputs::gather(mode, xsrc, toks.iter().map(|&t| t as usize))
            };
            inputs.run(isa, &ex.w13, 2 * tile as usize, n, &mut gate);
            inputs.run(isa, &ex.w13, 2 * tile as usize + 1, n, &mut up);
            kernels::swiglu_rows(isa, &mut gate[..n], &up[..n]);
            for (j, hj) in gate[..n].iter().enumerate() {
                // SAFETY: (pair, tile) is written by exactly this item; the buffer holds
                // max_pairs × max_inter floats and pair < pairs ≤ max_pairs.
                unsafe { put_row_block(hbuf, p0 + first + j, tile as usize, max_inter, hj) };
            }
        }
    });
}

/// A stage-1 item of a streams unit: W13 tile `tile` (gate row block `2·tile`, then up
/// `2·tile + 1`) of each group's expert against its tokens, the groups' row blocks read as
/// interleaved streams; `silu(g)·u` into each pair's intermediate row.
fn stage1_streams(
    pass: &Pass<'_, '_>,
    unit: Unit,
    tile: usize,
    xsrc: &RowSource<'_>,
    hbuf: SharedMut<f32>,
) {
    let slots = unit_slots(pass, unit);
    let n = unit.slots as usize;
    let mut jobs = StreamJobs::new(pass.mode, unit, |s| {
        let (gi, local) = slots[s];
        let (g, ex, _) = pass.item_group(gi);
        (&ex.w13, *xsrc, g.tokens[local] as usize)
    });
    let mut gate = [[0f32; ROWS]; MAX_UNIT_SLOTS];
    let mut up = [[0f32; ROWS]; MAX_UNIT_SLOTS];
    jobs.run(pass.isa, 2 * tile, &mut gate);
    jobs.run(pass.isa, 2 * tile + 1, &mut up);
    kernels::swiglu_rows(pass.isa, &mut gate[..n], &up[..n]);
    for (hs, &(gi, local)) in gate[..n].iter().zip(&slots[..n]) {
        let pair = pass.item_group(gi).2 + local;
        // SAFETY: (pair, tile) is written by exactly this item; the buffer holds
        // max_pairs × max_inter floats and pair < pairs ≤ max_pairs.
        unsafe { put_row_block(hbuf, pair, tile, pass.max_inter, hs) };
    }
}

/// The kernel jobs of a streams unit in the pass's mode, built once per work item: slot `s`
/// ([`unit_slots`]) is a row block of matrix `m` against row `r` of `src`. A
/// [`UnitKind::PerGroup`] unit: one job per group with its `T` tokens
/// ([`kernels::rowblocks_exact`]); a [`UnitKind::PerToken`] unit: one job per slot (accurate
/// mode: the row's levels, [`kernels::rowblocks_accurate_1`]). [`StreamJobs::run`] sets the
/// row block and runs them, each slot's output at its index. A stack value per item, so the
/// variants' size difference costs nothing.
#[allow(clippy::large_enum_variant)]
enum StreamJobs<'m> {
    Exact1([RowBlockJob<'m, 1>; kernels::MAX_STREAMS], usize),
    Exact2([RowBlockJob<'m, 2>; kernels::MAX_STREAMS], usize),
    Exact3([RowBlockJob<'m, 3>; kernels::MAX_STREAMS], usize),
    Exact4([RowBlockJob<'m, 4>; kernels::MAX_STREAMS], usize),
    Accurate([LevelsJob<'m>; kernels::MAX_STREAMS], usize),
}

/// A streams unit's exact-mode jobs of `T` tokens each: job `k` is slots `k·T .. k·T + T`.
fn exact_jobs<'m, const T: usize>(
    job: &impl Fn(usize) -> (&'m R16Matrix, RowSource<'m>, usize),
) -> [RowBlockJob<'m, T>; kernels::MAX_STREAMS] {
    std::array::from_fn(|k| RowBlockJob {
        m: job(k * T).0,
        rb: 0,
        toks: std::array::from_fn(|t| {
            let (_, src, r) = job(k * T + t);
            src.token(r)
        }),
    })
}

/// Row block `rb` of every job's matrix into `out` (`T` outputs per job).
fn run_exact<const T: usize>(
    isa: Isa,
    jobs: &mut [RowBlockJob<'_, T>],
    rb: usize,
    out: &mut [[f32; ROWS]],
) {
    for j in jobs.iter_mut() {
        j.rb = rb;
    }
    kernels::rowblocks_exact(isa, jobs, out);
}

impl<'m> StreamJobs<'m> {
    /// The jobs of `unit`, slot `s` being `job(s) = (m, src, r)` (for every slot index below
    /// [`MAX_UNIT_SLOTS`]: past the unit's slots, its last one).
    fn new(
        mode: ComputeMode,
        unit: Unit,
        job: impl Fn(usize) -> (&'m R16Matrix, RowSource<'m>, usize),
    ) -> Self {
        let groups = unit.len as usize;
        match (mode, unit.kind) {
            (ComputeMode::Exact, UnitKind::PerGroup(1)) => {
                StreamJobs::Exact1(exact_jobs(&job), groups)
            }
            (ComputeMode::Exact, UnitKind::PerGroup(2)) => {
                StreamJobs::Exact2(exact_jobs(&job), groups)
            }
            (ComputeMode::Exact, UnitKind::PerGroup(3)) => {
                StreamJobs::Exact3(exact_jobs(&job), groups)
            }
            (ComputeMode::Exact, UnitKind::PerGroup(4)) => {
                StreamJobs::Exact4(exact_jobs(&job), groups)
            }
            (ComputeMode::Exact, UnitKind::PerGroup(t)) => {
                unreachable!("a unit of {t}-token groups: form_units makes 1 to 4")
            }
            (_, UnitKind::Own) => unreachable!("a unit of its own runs on the multi-token kernels"),
            (ComputeMode::Exact, UnitKind::PerToken) => {
                StreamJobs::Exact1(exact_jobs(&job), unit.slots as usize)
            }
            (ComputeMode::Accurate, UnitKind::PerGroup(_)) => {
                unreachable!("accurate mode runs per-token units")
            }
            (ComputeMode::Accurate, UnitKind::PerToken) => StreamJobs::Accurate(
                std::array::from_fn(|s| {
                    let (m, src, r) = job(s);
                    LevelsJob {
                        m,
                        rb: 0,
                        levels: std::array::from_fn(|l| src.token(ACCURATE_LEVELS * r + l)),
                    }
                }),
                unit.slots as usize,
            ),
        }
    }

    /// Row block `rb` of every job's matrix into `out`, slot by slot.
    fn run(&mut self, isa: Isa, rb: usize, out: &mut [[f32; ROWS]]) {
        match self {
            StreamJobs::Exact1(jobs, n) => run_exact(isa, &mut jobs[..*n], rb, out),
            StreamJobs::Exact2(jobs, n) => run_exact(isa, &mut jobs[..*n], rb, out),
            StreamJobs::Exact3(jobs, n) => run_exact(isa, &mut jobs[..*n], rb, out),
            StreamJobs::Exact4(jobs, n) => run_exact(isa, &mut jobs[..*n], rb, out),
            StreamJobs::Accurate(jobs, n) => {
                for j in jobs[..*n].iter_mut() {
                    j.rb = rb;
                }
                kernels::rowblocks_accurate_1(isa, &jobs[..*n], out);
            }
        }
    }
}

/// Step 3: quantize each pair's intermediate `hsrc` row into `hq`/`hd`/`hqs` (exact mode).
fn quantize_intermediate(
    pass: &Pass<'_, '_>,
    hsrc: &[f32],
    hq: &mut [i8],
    hd: &mut [f32],
    hqs: &mut [i32],
) {
    let &Pass {
        experts,
        pool,
        max_inter,
        group_pair0,
        group_expert,
        ..
    } = pass;
    let pairs = *group_pair0.last().unwrap_or(&0) as usize;
    let (hq, hd, hqs) = (
        SharedMut(hq.as_mut_ptr()),
        SharedMut(hd.as_mut_ptr()),
        SharedMut(hqs.as_mut_ptr()),
    );
    let qpool = quantize_pool(pool, pairs * max_inter);
    let exact = pass.mode == ComputeMode::Exact;
    CpuBackend::run_items(qpool, pairs, |p| {
        let gi = group_pair0.partition_point(|&p0| p0 as usize <= p) - 1;
        let f = experts[group_expert[gi] as usize].inter;
        let nbm = max_inter / BLOCK;
        let x = &hsrc[p * max_inter..p * max_inter + f];
        // Rows of this pair: one, or its levels in accurate mode.
        let (rows, r0) = if exact {
            (1, p)
        } else {
            (ACCURATE_LEVELS, ACCURATE_LEVELS * p)
        };
        let (qn, dn) = ((rows - 1) * max_inter + f, (rows - 1) * nbm + f / BLOCK);
        // SAFETY: each pair owns its rows r0..r0 + rows of hq/hd/hqs (sized for the levels).
        let (q, d, s) = unsafe {
            (
                std::slice::from_raw_parts_mut(hq.ptr().add(r0 * max_inter), qn),
                std::slice::from_raw_parts_mut(hd.ptr().add(r0 * nbm), dn),
                std::slice::from_raw_parts_mut(hqs.ptr().add(r0 * nbm), dn),
            )
        };
        if exact {
            kernels::quantize_activations_sums(pass.isa, x, q, d, s);
        } else {
            kernels::quantize_levels(pass.isa, x, q, d, s, max_inter, nbm);
        }
    });
}

/// Step 4: stage 2 over (group, 64-row W2 tile) items: each pair's expert output into `ybuf`,
/// at the slot's output row (`per_slot`) or at the pair's row of the pre-combine buffer.
fn stage2(
    pass: &Pass<'_, '_>,
    items: &mut Vec<(u32, u32)>,
    hsrc: &RowSource<'_>,
    ybuf: &mut [f32],
    per_slot: bool,
) {
    let &Pass {
        batch,
        pool,
        isa,
        mode,
        ..
    } = pass;
    let h = batch.hidden;
    let w2_tiles = (h.div_ceil(ROWS)).div_ceil(W2_TILE_ROW_BLOCKS);
    let units = pass.units;
    fill_items(items, units.len(), |_| w2_tiles);
    let ybuf = SharedMut(ybuf.as_mut_ptr());
    let items = &*items;
    CpuBackend::run_items(pool, items.len(), |i| {
        let (u, tile) = items[i];
        let unit = units[u as usize];
        let rb0 = tile as usize * W2_TILE_ROW_BLOCKS;
        let rb1 = (rb0 + W2_TILE_ROW_BLOCKS).min(h.div_ceil(ROWS));
        if unit.kind != UnitKind::Own {
            stage2_streams(pass, unit, rb0..rb1, hsrc, ybuf, per_slot);
            return;
        }
        let (g, ex, p0) = pass.item_group(unit.first());
        let f = ex.inter;
        let mut y = [[0f32; ROWS]; AMX_TOKEN_TILE];
        // Token tiles outer: a tile's inputs are gathered once for the item's row blocks,
        // and each output row gets the item's row blocks one after another.
        for (first, n, amx) in pass.token_tiles(g.tokens.len(), f) {
            let pb = p0 + first;
            let hsrc = RowSource { len: f, ..*hsrc };
            let inputs = if amx {
                TileInputs::amx(&hsrc, pb, n, false, pass.amx_emulated)
            } else {
                TileInputs::gather(mode, &hsrc, pb..pb + n)
            };
            for rb in rb0..rb1 {
                inputs.run(isa, &ex.w2, rb, n, &mut y);
                for (j, yj) in y[..n].iter().enumerate() {
                    let row = if per_slot {
                        g.out_rows[first + j] as usize
                    } else {
                        pb + j
                    };
                    // SAFETY: (row, rb) is written by exactly this item; the output holds
                    // pairs × H floats (validated) and pair_out max_pairs × H.
                    unsafe { put_row_block(ybuf, row, rb, h, yj) };
                }
            }
        }
    });
}

/// Writes row block `rb` of row `row` (`h` floats per row: an output or an intermediate)
/// from `y`: a whole row block as one fixed-size copy (no `memmove` call for 64 bytes), the
/// last one cut at `h`.
///
/// # Safety
/// Row `row` of `ybuf` must hold `h` floats, and no other thread may access this row block.
#[inline(always)]
unsafe fn put_row_block(ybuf: SharedMut<f32>, row: usize, rb: usize, h: usize, y: &[f32; ROWS]) {
    let rows = ROWS.min(h - rb * ROWS);
    // SAFETY: the caller's contract; `rows` floats from `row·h + 16·rb` stay in the row.
    unsafe {
        let dst = ybuf.ptr().add(row * h + rb * ROWS);
        if rows == ROWS {
            dst.cast::<[f32; ROWS]>().write_unaligned(*y);
        } else {
            std::ptr::copy_nonoverlapping(y.as_ptr(), dst, rows);
        }
    }
}

/// A stage-2 item of a streams unit: W2 row blocks `rbs` of each group's expert against its
/// pair's intermediate, the groups' row blocks read as interleaved streams (each stream walks
/// its matrix in order); into the slot's output row (`per_slot`) or the pair's row.
fn stage2_streams(
    pass: &Pass<'_, '_>,
    unit: Unit,
    rbs: std::ops::Range<usize>,
    hsrc: &RowSource<'_>,
    ybuf: SharedMut<f32>,
    per_slot: bool,
) {
    let slots = unit_slots(pass, unit);
    let n = unit.slots as usize;
    let h = pass.batch.hidden;
    let mut jobs = StreamJobs::new(pass.mode, unit, |s| {
        let (gi, local) = slots[s];
        let (_, ex, p0) = pass.item_group(gi);
        let hsrc = RowSource {
            len: ex.inter,
            ..*hsrc
        };
        (&ex.w2, hsrc, p0 + local)
    });
    // Each stream's output row: the slot's (`per_slot`) or the pair's.
    let rows: [usize; MAX_UNIT_SLOTS] = std::array::from_fn(|s| {
        let (gi, local) = slots[s];
        let (g, _, p0) = pass.item_group(gi);
        if per_slot {
            g.out_rows[local] as usize
        } else {
            p0 + local
        }
    });
    let mut y = [[0f32; ROWS]; MAX_UNIT_SLOTS];
    for rb in rbs {
        jobs.run(pass.isa, rb, &mut y);
        for (ys, &row) in y[..n].iter().zip(&rows) {
            // SAFETY: (row, rb) is written by exactly this item; the output holds pairs × H
            // floats (validated) and pair_out max_pairs × H.
            unsafe { put_row_block(ybuf, row, rb, h, ys) };
        }
    }
}

/// Step 5: pre-combine the per-pair outputs per token in output-row order (contract §5).
fn precombine(
    batch: &GroupedBatch<'_>,
    group_pair0: &[u32],
    combine: &mut Vec<(u32, u32, u32, u32)>,
    pair_out: &[f32],
    out: &mut [f32],
) {
    let h = batch.hidden;
    combine.clear();
    for (gi, g) in batch.groups.iter().enumerate() {
        let p0 = group_pair0[gi];
        for (i, (&t, &r)) in g.tokens.iter().zip(g.out_rows).enumerate() {
            combine.push((t, r, p0 + i as u32, gi as u32));
        }
    }
    combine.sort_unstable();
    out.fill(0.0);
    for &(t, _, p, gi) in combine.iter() {
        let g = &batch.groups[gi as usize];
        let local = p - group_pair0[gi as usize];
        let w = g.weights[local as usize];
        let y = &pair_out[p as usize * h..(p as usize + 1) * h];
        let o = &mut out[t as usize * h..(t as usize + 1) * h];
        for (a, &b) in o.iter_mut().zip(y) {
            *a += w * b;
        }
    }
}

#[cfg(test)]
mod unit_tests {
    use super::*;
    use proptest::prelude::*;

    /// The rules every partition of groups into units keeps: each group in exactly one unit
    /// (units of [`form_units_per_group`] in any order, of [`form_units_per_token`] in batch
    /// order); a streams unit's groups have one intermediate size and its slots are their
    /// tokens.
    fn check(units: &[Unit], tokens: &[usize], inter: &[usize]) -> Result<(), TestCaseError> {
        let mut seen = vec![0u32; tokens.len()];
        for u in units {
            let gs = &u.groups[..u.len as usize];
            prop_assert!(!gs.is_empty());
            for &g in gs {
                seen[g as usize] += 1;
                prop_assert_eq!(inter[g as usize], inter[gs[0] as usize], "{:?}", u);
            }
            let slots: usize = gs.iter().map(|&g| tokens[g as usize]).sum();
            match u.kind {
                UnitKind::Own => {
                    prop_assert_eq!(gs.len(), 1);
                }
                UnitKind::PerToken => {
                    prop_assert_eq!(u.slots as usize, slots);
                    prop_assert!(slots <= kernels::MAX_STREAMS, "{:?}", u);
                    for &g in gs {
                        prop_assert!((1..=PER_TOKEN_GROUP_TOKENS).contains(&tokens[g as usize]));
                    }
                    // Consecutive groups.
                    for w in gs.windows(2) {
                        prop_assert_eq!(w[1], w[0] + 1);
                    }
                }
                UnitKind::PerGroup(t) => {
                    prop_assert_eq!(u.slots as usize, slots);
                    prop_assert!(gs.len() <= kernels::MAX_STREAMS);
                    for &g in gs {
                        prop_assert_eq!(tokens[g as usize], t as usize);
                    }
                }
            }
        }
        prop_assert!(seen.iter().all(|&c| c == 1), "{:?}", seen);
        Ok(())
    }

    proptest! {
        /// Both partitions keep the rules; a group that could stream (1 to 4 tokens for per
        /// group, 1 or 2 for per token) is never a unit of its own; per-token units keep the
        /// groups' batch order, and a per-token unit is cut only where the next group could
        /// not join it.
        #[test]
        fn units_partition_the_groups(
            groups in prop::collection::vec((0usize..7, prop::bool::ANY), 0..40)
        ) {
            let tokens: Vec<usize> = groups.iter().map(|g| g.0).collect();
            let inter: Vec<usize> = groups.iter().map(|g| if g.1 { 768 } else { 512 }).collect();
            let (t, i) = (|g: u32| tokens[g as usize], |g: u32| inter[g as usize]);
            let mut units = Vec::new();
            form_units_per_group(tokens.len(), t, i, &mut units);
            check(&units, &tokens, &inter)?;
            for u in &units {
                if u.kind == UnitKind::Own {
                    prop_assert!(!(1..=kernels::MAX_STREAM_TOKENS).contains(&tokens[u.first() as usize]));
                }
            }
            let mut units = Vec::new();
            form_units_per_token(tokens.len(), t, i, &mut units);
            check(&units, &tokens, &inter)?;
            let order: Vec<u32> = units.iter().flat_map(|u| u.groups[..u.len as usize].to_vec()).collect();
            prop_assert_eq!(order, (0..tokens.len() as u32).collect::<Vec<_>>());
            for w in units.windows(2) {
                let (a, b) = (w[0], w[1]);
                if a.kind == UnitKind::PerToken && b.kind == UnitKind::PerToken {
                    let next = b.first() as usize;
                    prop_assert!(
                        a.slots as usize + tokens[next] > kernels::MAX_STREAMS
                            || inter[next] != inter[a.first() as usize],
                        "{:?} could have taken group {}", a, next
                    );
                }
                if a.kind == UnitKind::Own {
                    prop_assert!(!(1..=PER_TOKEN_GROUP_TOKENS).contains(&tokens[a.first() as usize]));
                }
            }
        }
    }

    /// Per group: equal groups fill units of four; a group of another intermediate size closes
    /// the open unit of its token count.
    #[test]
    fn per_group_units_fill_up_and_close_on_another_shape() {
        let tokens = [2, 1, 2, 2, 2, 2, 1, 2];
        let inter = [768, 768, 768, 768, 768, 512, 768, 768];
        let mut units = Vec::new();
        form_units_per_group(8, |g| tokens[g as usize], |g| inter[g as usize], &mut units);
        let got: Vec<(UnitKind, Vec<u32>)> = units
            .iter()
            .map(|u| (u.kind, u.groups[..u.len as usize].to_vec()))
            .collect();
        assert_eq!(
            got,
            [
                (UnitKind::PerGroup(2), vec![0, 2, 3, 4]),
                (UnitKind::PerGroup(2), vec![5]),
                (UnitKind::PerGroup(1), vec![1, 6]),
                (UnitKind::PerGroup(2), vec![7]),
            ]
        );
    }
}

#[cfg(test)]
mod pin_tests {
    use super::*;

    /// The CPU each helper thread of the pool runs on (index 1 ..), read by the thread itself
    /// (the caller, index 0, works on jobs too but is the caller's thread, never pinned).
    #[cfg(target_os = "linux")]
    fn pool_cpus(b: &CpuBackend) -> Vec<i32> {
        let pool = b.pool.as_ref().expect("a pool for 3 threads");
        let cpus: Vec<std::sync::atomic::AtomicI32> = (0..pool.threads())
            .map(|_| std::sync::atomic::AtomicI32::new(-1))
            .collect();
        // SAFETY: sched_getcpu takes no arguments and only reads the calling thread's CPU.
        pool.run(&|i| cpus[i].store(unsafe { libc::sched_getcpu() }, Ordering::Relaxed));
        cpus[1..]
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .collect()
    }

    #[test]
    #[cfg(target_os = "linux")]
    fn pinned_threads_run_only_on_their_cpu() {
        let allowed = membw::allowed_cpus();
        let Some(&last) = allowed.last() else {
            use std::io::Write as _;
            let _ = writeln!(
                std::io::stderr(),
                "skipped: this process's affinity mask could not be read"
            );
            return;
        };
        // Both helpers on the last allowed CPU: neither may run anywhere else, every call.
        let b = CpuBackend::with_isa_pinned(3, Isa::detect(), Some(vec![last])).unwrap();
        assert_eq!(b.pinned_cpus(), Some(&[last][..]));
        for _ in 0..20 {
            assert_eq!(pool_cpus(&b), vec![last as i32; 2]);
        }
    }

    #[test]
    fn unpinned_and_single_thread_backends_pin_nothing() {
        let b = CpuBackend::with_isa_pinned(2, Isa::detect(), None).unwrap();
        assert_eq!(b.pinned_cpus(), None);
        // One thread works inline on the caller's thread, which must not be pinned.
        let b = CpuBackend::with_isa_pinned(1, Isa::detect(), Some(vec![0])).unwrap();
        assert_eq!(b.pinned_cpus(), None);
        let b = CpuBackend::with_isa_pinned(2, Isa::detect(), Some(Vec::new())).unwrap();
        assert_eq!(b.pinned_cpus(), None);
    }
}
