//! Row-block kernels over the R16 layout: scalar, AVX2 and AVX-512 VNNI.
//!
//! Why this exists: this is the hot loop of the CPU backend. One call computes 16 output rows
//! (one row block) of one packed matrix for a few tokens, streaming the row block's weights
//! once and reusing every loaded tile for all the tokens (so an expert's weights are read once
//! per batch whatever the number of tokens that chose it).
//!
//! Exact mode follows `expertmesh_quant::contract` literally: per block an exact i32 dot
//! (`vpdpbusd` on VNNI, `pmaddubsw`+`pmaddwd` on AVX2 — both exact for u4 × i8), then
//! `(s·d)·f32(isum)` with two separate multiplies, added to partial `b % 16`, and the 8/4/2/1
//! halving tree at the end. Each SIMD lane is one output row, so every lane performs exactly the
//! scalar sequence: the three paths are bit-identical by construction and by test.
//!
//! Accurate mode (f32 activations) runs in the backend on the integer kernels: each activation
//! as [`ACCURATE_LEVELS`] int8 levels ([`quantize_levels`]), three kernel tokens whose
//! results add up ([`rowblock_levels`]), and a one-token streams kernel that unpacks each tile
//! once for the three levels ([`rowblocks_accurate_1`]); tolerance-tested against f64. The
//! f32 kernels ([`rowblock_accurate`]: each tile dequantized once for all its tokens, several
//! FMA chains per token) stay as the f32 reference path; they do about twice the
//! instructions per weight tile.
//!
//! PERF-CRITICAL: no allocation, no locking, no logging in this module.

use super::layout::{R16Matrix, ROWS};
use expertmesh_quant::contract::{self, LANES};
use expertmesh_quant::format::{BLOCK, ScaleDtype};

/// Instruction set used by the CPU kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Isa {
    /// Portable Rust.
    Scalar,
    /// AVX2 (`pmaddubsw` / `pmaddwd`).
    Avx2,
    /// AVX-512 F/BW + VNNI (`vpdpbusd`).
    Avx512Vnni,
    /// AVX-512 VNNI, plus AMX-INT8 tiles for exact-mode token tiles of many tokens
    /// ([`crate::amx`]; fewer tokens and accurate mode run the VNNI kernels).
    Amx,
}

impl Isa {
    /// The best ISA this CPU supports.
    pub fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            // The AVX2 kernels also use F16C (f16 scales) and FMA (accurate mode), which
            // every AVX2 CPU has; checked all the same. Every level above implies this one
            // (an AVX-512 CPU runs the AVX2 kernels too), so a VM whose CPUID hides one of
            // these gets no vector level at all rather than one that faults.
            let avx2 = std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("f16c")
                && std::arch::is_x86_feature_detected!("fma");
            if avx2
                && std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512bw")
                && std::arch::is_x86_feature_detected!("avx512vl")
                && std::arch::is_x86_feature_detected!("avx512vnni")
            {
                if crate::amx::tiles::amx_available().is_ok() {
                    return Isa::Amx;
                }
                return Isa::Avx512Vnni;
            }
            if avx2 {
                return Isa::Avx2;
            }
        }
        Isa::Scalar
    }

    /// Every ISA this CPU can run (for tests), best last.
    pub fn available() -> Vec<Isa> {
        let best = Isa::detect();
        let mut v = vec![Isa::Scalar];
        if best != Isa::Scalar {
            v.push(Isa::Avx2);
        }
        if matches!(best, Isa::Avx512Vnni | Isa::Amx) {
            v.push(Isa::Avx512Vnni);
        }
        if best == Isa::Amx {
            v.push(Isa::Amx);
        }
        v
    }

    /// Short name.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512Vnni => "avx512-vnni",
            Isa::Amx => "amx-int8",
        }
    }

    /// True if this CPU can run `self`.
    pub fn supported(self) -> bool {
        Isa::available().contains(&self)
    }
}

/// One token's quantized activation (contract §1) with per-block code sums, as the kernels
/// read it.
#[derive(Clone, Copy, Debug)]
pub struct TokenQ8<'a> {
    /// int8 codes `[K]`.
    pub q: &'a [i8],
    /// per-block scales `[K/32]`.
    pub d: &'a [f32],
    /// per-block `Σ q` `[K/32]` (for the zero-point term).
    pub qsum: &'a [i32],
}

/// Per-block code sums of a quantized vector.
pub fn block_sums(q: &[i8], qsum: &mut [i32]) {
    for (b, s) in qsum.iter_mut().enumerate() {
        *s = q[b * BLOCK..(b + 1) * BLOCK]
            .iter()
            .map(|&v| v as i32)
            .sum();
    }
}

/// Contract §1 for a whole vector (`x.len()` a multiple of 32): codes into `q`, block scales
/// into `d`, bit-identical to [`contract::quantize_activations`]. On AVX-512 sixteen blocks
/// at a time (each block two vectors), on AVX2 block by block (four vectors);
/// `vrndscaleps` / `vroundps` round half to even as `round_ties_even` does; a block with a
/// NaN, an infinity or an amax below the contract's minimum takes the scalar code.
pub fn quantize_activations(isa: Isa, x: &[f32], q: &mut [i8], d: &mut [f32]) {
    quantize_into::<false>(isa, x, q, d, &mut []);
}

/// [`quantize_activations`] and the per-block code sums ([`block_sums`]) in one pass: on
/// AVX-512 and AVX2 the sums come from the codes still in registers.
pub fn quantize_activations_sums(
    isa: Isa,
    x: &[f32],
    q: &mut [i8],
    d: &mut [f32],
    qsum: &mut [i32],
) {
    quantize_into::<true>(isa, x, q, d, qsum);
}

/// Both of the above: with `SUMS`, the block sums into `qsum` too (else `qsum` is unused).
fn quantize_into<const SUMS: bool>(
    isa: Isa,
    x: &[f32],
    q: &mut [i8],
    d: &mut [f32],
    qsum: &mut [i32],
) {
    assert!(
        x.len() % BLOCK == 0
            && q.len() == x.len()
            && d.len() == x.len() / BLOCK
            && (!SUMS || qsum.len() == d.len()),
        "quantize_activations: {} values, {} codes, {} scales, {} sums",
        x.len(),
        q.len(),
        d.len(),
        qsum.len()
    );
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni | Isa::Amx if Isa::Avx512Vnni.supported_cached() => {
            // SAFETY: AVX-512 F/BW supported; lengths asserted above.
            unsafe { x86::quantize_avx512::<SUMS>(x, q, d, qsum) }
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 if Isa::Avx2.supported_cached() => {
            // SAFETY: AVX2 supported; lengths asserted above.
            unsafe { x86::quantize_avx2::<SUMS>(x, q, d, qsum) }
        }
        _ => {
            contract::quantize_activations(x, q, d);
            if SUMS {
                block_sums(q, qsum);
            }
        }
    }
}

/// Int8 levels of an accurate-mode activation ([`quantize_levels`]).
pub const ACCURATE_LEVELS: usize = 3;

/// Accurate mode's activation for the integer kernels: `x` (a multiple of 32 floats) as a sum
/// of [`ACCURATE_LEVELS`] contract-§1 quantizations, each of what the levels before it left
/// over (`x ≈ Σ_l d_l·q_l` per block; level 1 is exactly [`quantize_activations`]'s). Each
/// level shrinks the block's error by at least 254×, so three leave at most amax·2⁻²⁴-ish,
/// f32's own rounding: the exact kernels then run accurate mode on the three levels as three
/// tokens (sharing each unpacked weight tile) and add the results, instead of dequantizing
/// every weight to f32 (about half the instructions per weight tile). Level `l` goes to
/// `q[l·stride..][..K]`, `d`/`qsum[l·block_stride..][..K/32]`.
///
/// Each level quantizes up to [`LEVEL_CHUNK`] blocks at once with `isa`'s
/// [`quantize_activations_sums`] (bit-identical to the contract's block quantizer on every
/// ISA) and, all but the last, subtracts what it took with [`subtract_level`] (a multiply,
/// then a subtraction), so the levels are the same on every machine; the residuals live in a
/// stack buffer.
pub fn quantize_levels(
    isa: Isa,
    x: &[f32],
    q: &mut [i8],
    d: &mut [f32],
    qsum: &mut [i32],
    stride: usize,
    block_stride: usize,
) {
    let (k, nb) = (x.len(), x.len() / BLOCK);
    assert!(k % BLOCK == 0 && stride >= k && block_stride >= nb);
    let last = ACCURATE_LEVELS - 1;
    assert!(q.len() >= last * stride + k && d.len() >= last * block_stride + nb);
    assert!(qsum.len() >= last * block_stride + nb);
    let mut residual = [0f32; LEVEL_CHUNK * BLOCK];
    for b0 in (0..nb).step_by(LEVEL_CHUNK) {
        let blocks = LEVEL_CHUNK.min(nb - b0);
        let (e0, n) = (b0 * BLOCK, blocks * BLOCK);
        let r = &mut residual[..n];
        r.copy_from_slice(&x[e0..e0 + n]);
        for l in 0..ACCURATE_LEVELS {
            let ql = &mut q[l * stride + e0..][..n];
            let dl = &mut d[l * block_stride + b0..][..blocks];
            let sl = &mut qsum[l * block_stride + b0..][..blocks];
            quantize_activations_sums(isa, r, ql, dl, sl);
            if l < last {
                subtract_level(isa, r, ql, dl);
            }
        }
    }
}

/// What a level leaves over: `r[i] -= d[b] · f32(q[i])` for every element `i` of block `b`,
/// a multiply then a subtraction (never fused), so the residuals, and the next level, are
/// the same on every ISA.
fn subtract_level(isa: Isa, r: &mut [f32], q: &[i8], d: &[f32]) {
    assert!(r.len() == q.len() && r.len() % BLOCK == 0 && r.len() / BLOCK == d.len());
    match isa {
        // AVX2 code on AVX-512 machines too: compiled for AVX-512 the same loop ran 2.4x slower.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni | Isa::Amx | Isa::Avx2 if Isa::Avx2.supported_cached() => {
            // SAFETY: AVX2 supported (every AVX-512 ISA here implies it).
            unsafe { x86::subtract_level_avx2(r, q, d) }
        }
        _ => subtract_level_body(r, q, d),
    }
}

/// [`subtract_level`]'s loop, compiled once per ISA (the `x86` wrappers) so the compiler
/// vectorizes it; Rust never contracts the multiply and the subtraction into an FMA.
#[inline(always)]
fn subtract_level_body(r: &mut [f32], q: &[i8], d: &[f32]) {
    for ((rb, qb), &db) in r.chunks_exact_mut(BLOCK).zip(q.chunks_exact(BLOCK)).zip(d) {
        for (ri, &qi) in rb.iter_mut().zip(qb) {
            *ri -= db * f32::from(qi);
        }
    }
}

/// Blocks per step of [`quantize_levels`] (its residual buffer: 2 KiB on the stack).
const LEVEL_CHUNK: usize = 16;

/// Maximum tokens computed together against one loaded weight tile.
pub const MAX_TOKEN_TILE: usize = 8;

/// Exact mode: rows `16rb..16rb+16` of `m` for each token in `toks` (at most
/// [`MAX_TOKEN_TILE`]), written to `out[t]`.
pub fn rowblock_exact(
    isa: Isa,
    m: &R16Matrix,
    rb: usize,
    toks: &[TokenQ8<'_>],
    out: &mut [[f32; ROWS]],
) {
    assert!(toks.len() <= MAX_TOKEN_TILE && out.len() >= toks.len());
    assert!(rb < m.row_blocks(), "row block {rb} past the matrix");
    // The vector kernels read every token's codes, scales and sums unchecked: a safe function
    // checks them always (a few comparisons per row block of 16 x K).
    for t in toks {
        assert!(
            t.q.len() == m.cols() && t.d.len() == m.blocks() && t.qsum.len() == m.blocks(),
            "a token of {} codes, {} scales and {} sums against K = {}",
            t.q.len(),
            t.d.len(),
            t.qsum.len(),
            m.cols()
        );
    }
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni | Isa::Amx if Isa::Avx512Vnni.supported_cached() => {
            // SAFETY: the CPU supports AVX-512 F/BW/VNNI (checked above); slices are in bounds
            // (R16Matrix guarantees tile sizes, TokenQ8 lengths are asserted above).
            unsafe {
                match toks.len() {
                    1 => {
                        _ = x86::exact_vnni_jobs::<1, 1>(
                            &[RowBlockJob {
                                m,
                                rb,
                                toks: [toks[0]],
                            }],
                            out,
                        )
                    }
                    2 => x86::exact_vnni_multi::<2>(m, rb, toks, out),
                    3 => x86::exact_vnni_multi::<3>(m, rb, toks, out),
                    4 => x86::exact_vnni_multi::<4>(m, rb, toks, out),
                    5 => x86::exact_vnni_multi::<5>(m, rb, toks, out),
                    6 => x86::exact_vnni_multi::<6>(m, rb, toks, out),
                    7 => x86::exact_vnni_multi::<7>(m, rb, toks, out),
                    8 => x86::exact_vnni_multi::<8>(m, rb, toks, out),
                    _ => {}
                }
            }
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512Vnni | Isa::Amx if Isa::Avx2.supported_cached() => {
            // SAFETY: as above for AVX2.
            unsafe {
                match toks.len() {
                    1 => {
                        _ = x86::exact_avx2_jobs::<1, 1>(
                            &[RowBlockJob {
                                m,
                                rb,
                                toks: [toks[0]],
                            }],
                            out,
                        )
                    }
                    2 => x86::exact_avx2::<2>(m, rb, toks, out),
                    3 => x86::exact_avx2::<3>(m, rb, toks, out),
                    4 => x86::exact_avx2::<4>(m, rb, toks, out),
                    5 => x86::exact_avx2::<5>(m, rb, toks, out),
                    6 => x86::exact_avx2::<6>(m, rb, toks, out),
                    7 => x86::exact_avx2::<7>(m, rb, toks, out),
                    8 => x86::exact_avx2::<8>(m, rb, toks, out),
                    _ => {}
                }
            }
        }
        _ => exact_scalar(m, rb, toks, out),
    }
}

/// The most row blocks [`rowblocks_exact`] reads as interleaved streams.
pub const MAX_STREAMS: usize = 4;

/// The most tokens per job of [`rowblocks_exact`] (its stream kernels exist for 1 to 4).
pub const MAX_STREAM_TOKENS: usize = 4;

/// One row block of one matrix against `T` tokens: what [`rowblocks_exact`] computes.
#[derive(Clone, Copy, Debug)]
pub struct RowBlockJob<'a, const T: usize = 1> {
    /// The matrix.
    pub m: &'a R16Matrix,
    /// Its row block.
    pub rb: usize,
    /// The tokens (`m.cols()` codes each).
    pub toks: [TokenQ8<'a>; T],
}

/// One ISA's stream kernels for 4, 2 and 1 streams: each runs that many of the jobs it is
/// given (the first ones), writes their outputs and returns how many it ran.
#[cfg(target_arch = "x86_64")]
type StreamKernels<J> = [unsafe fn(&[J], &mut [[f32; ROWS]]) -> usize; 3];

/// A stream kernel generic over its stream count (and then the given further parameters),
/// as [`StreamKernels`] for 4, 2, 1.
#[cfg(target_arch = "x86_64")]
macro_rules! streams {
    ($($kernel:ident)::+ $(, $t:ident)?) => {
        [
            $($kernel)::+::<4 $(, $t)?> as _,
            $($kernel)::+::<2 $(, $t)?> as _,
            $($kernel)::+::<1 $(, $t)?> as _,
        ]
    };
}

/// Runs `jobs` in interleaved passes: from each first job, up to [`MAX_STREAMS`] consecutive
/// jobs that share its K and format, run by the widest of `kernels` that fits. Job `i`'s
/// outputs are `out[i·outs .. (i + 1)·outs]`.
///
/// # Safety
/// The CPU must support what `kernels` need; every job's row block must be inside its matrix
/// and its token(s) hold the matrix's K codes and K/32 scales and sums (the callers assert
/// it); `out` must hold `outs` entries per job.
#[cfg(target_arch = "x86_64")]
unsafe fn run_stream_passes<J>(
    jobs: &[J],
    out: &mut [[f32; ROWS]],
    outs: usize,
    matrix: impl Fn(&J) -> &R16Matrix,
    kernels: StreamKernels<J>,
) {
    let shape = |j: &J| (matrix(j).blocks(), matrix(j).spec());
    let mut i = 0;
    while i < jobs.len() {
        let first = shape(&jobs[i]);
        let run = jobs[i..]
            .iter()
            .take(MAX_STREAMS)
            .take_while(|j| shape(j) == first)
            .count();
        let kernel = match run {
            4.. => kernels[0],
            2 | 3 => kernels[1],
            _ => kernels[2],
        };
        // SAFETY: the first `run` jobs from `i` share K and the format (checked just above);
        // the rest is the caller's contract.
        i += unsafe { kernel(&jobs[i..], &mut out[i * outs..]) };
    }
}

/// Exact mode for `T` tokens per job (1 to [`MAX_STREAM_TOKENS`]): `out[i·T + t]` gets the
/// 16 rows of `jobs[i]` (rows `16rb..16rb+16` of its matrix) against its token `t`.
/// Bit-identical to [`rowblock_exact`] on each job. On AVX-512 VNNI and AVX2 up to
/// [`MAX_STREAMS`] jobs of the same K and format are read as interleaved streams (one stream
/// per core leaves DRAM bandwidth unused), each weight tile unpacked once for the job's `T`
/// tokens (decode: an expert with two to four tokens of a batch); each stream's prefetch runs
/// on into the next row block of its matrix, so a caller that walks each stream's matrix in
/// order (job `i` at row block `rb`, then `rb + 1` in its next call) keeps every stream
/// sequential. The scalar path runs the jobs one after the other. (The backend gives jobs of
/// more than one token only on AVX2: `form_units` in the crate root says why.)
pub fn rowblocks_exact<const T: usize>(
    isa: Isa,
    jobs: &[RowBlockJob<'_, T>],
    out: &mut [[f32; ROWS]],
) {
    const {
        assert!(
            T >= 1 && T <= MAX_STREAM_TOKENS,
            "the stream kernels take 1 to 4 tokens"
        )
    };
    assert!(
        out.len() >= jobs.len() * T,
        "{} outputs for {} jobs of {T} tokens",
        out.len(),
        jobs.len()
    );
    for j in jobs {
        assert!(
            j.rb < j.m.row_blocks(),
            "row block {} past the matrix",
            j.rb
        );
        // The kernels read every token's codes, scales and sums unchecked.
        for tok in &j.toks {
            assert!(
                tok.q.len() == j.m.cols()
                    && tok.d.len() == j.m.blocks()
                    && tok.qsum.len() == j.m.blocks(),
                "a token of {} codes, {} scales and {} sums against K = {}",
                tok.q.len(),
                tok.d.len(),
                tok.qsum.len(),
                j.m.cols()
            );
        }
    }
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni | Isa::Amx if Isa::Avx512Vnni.supported_cached() => {
            // SAFETY: the CPU supports AVX-512 F/BW/VNNI (checked above); every job's row block is
            // inside its matrix (asserted); the tokens' lengths are the backend's (checked before
            // any kernel runs, asserted in debug).
            unsafe { run_stream_passes(jobs, out, T, |j| j.m, streams!(x86::exact_vnni_jobs, T)) }
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512Vnni | Isa::Amx if Isa::Avx2.supported_cached() => {
            // SAFETY: the CPU supports AVX2 and F16C (checked above); every job's row block is
            // inside its matrix (asserted); the tokens' lengths are the backend's (checked before
            // any kernel runs, asserted in debug).
            unsafe { run_stream_passes(jobs, out, T, |j| j.m, streams!(x86::exact_avx2_jobs, T)) }
        }
        _ => {
            for (j, o) in jobs.iter().zip(out.chunks_mut(T)) {
                rowblock_exact(isa, j.m, j.rb, &j.toks, o);
            }
        }
    }
}

/// One row block of one matrix against one accurate-mode token (its
/// [`ACCURATE_LEVELS`] levels): what [`rowblocks_accurate_1`] computes.
#[derive(Clone, Copy, Debug)]
pub struct LevelsJob<'a> {
    /// The matrix.
    pub m: &'a R16Matrix,
    /// Its row block.
    pub rb: usize,
    /// The token's levels ([`quantize_levels`]), each `m.cols()` codes.
    pub levels: [TokenQ8<'a>; ACCURATE_LEVELS],
}

/// Accurate mode, one token per job: `out[i]` gets the 16 rows of `jobs[i]`, the levels' dots
/// added (within accurate mode's tolerance of the f64 dot of the token's activation; not the
/// exact contract's order). On AVX-512 VNNI up to [`MAX_STREAMS`] jobs of the same K and
/// format (on AVX2 up to two) are read as interleaved streams, each weight tile unpacked once
/// for the three levels and the sums kept in registers; the scalar path runs
/// [`rowblock_exact`] on the levels as three tokens.
pub fn rowblocks_accurate_1(isa: Isa, jobs: &[LevelsJob<'_>], out: &mut [[f32; ROWS]]) {
    assert!(
        out.len() >= jobs.len(),
        "{} outputs for {} jobs",
        out.len(),
        jobs.len()
    );
    for j in jobs {
        assert!(
            j.rb < j.m.row_blocks(),
            "row block {} past the matrix",
            j.rb
        );
        for l in &j.levels {
            assert!(l.q.len() == j.m.cols() && l.d.len() == j.m.blocks());
            assert!(l.qsum.len() == j.m.blocks());
        }
    }
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni | Isa::Amx if Isa::Avx512Vnni.supported_cached() => {
            // SAFETY: the CPU supports AVX-512 F/BW/VNNI (checked above); every job's row block is
            // inside its matrix and every level holds K codes and K/32 scales and sums (asserted).
            unsafe { run_stream_passes(jobs, out, 1, |j| j.m, streams!(x86::accurate_levels)) }
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512Vnni | Isa::Amx if Isa::Avx2.supported_cached() => {
            // At most two streams: four streams' accumulators, level sums and codes are more
            // than the sixteen ymm registers hold, and on an EPYC without AVX-512 two streams
            // read 8-11 % more at B = 1 and 5 % more at B = 4, the same at B = 16 (where a
            // unit's two-token groups make a pass of two jobs on one row block; BENCHMARKS.md,
            // session 53); rechecked with one accumulator per half (session 54): four streams
            // read 0.94-0.99 of two at B = 1.
            let kernels: StreamKernels<LevelsJob<'_>> = [
                x86::accurate_levels_avx2::<2> as _,
                x86::accurate_levels_avx2::<2> as _,
                x86::accurate_levels_avx2::<1> as _,
            ];
            // SAFETY: the CPU supports AVX2, F16C and FMA (checked above); every job's row block is
            // inside its matrix and every level holds K codes and K/32 scales and sums (asserted).
            unsafe { run_stream_passes(jobs, out, 1, |j| j.m, kernels) }
        }
        _ => {
            for (j, o) in jobs.iter().zip(out.iter_mut()) {
                rowblock_levels(isa, j.m, j.rb, &j.levels, std::slice::from_mut(o));
            }
        }
    }
}

/// Accurate mode on [`rowblock_exact`]: `toks` holds each token's [`ACCURATE_LEVELS`] levels
/// in turn (at most [`MAX_TOKEN_TILE`] rows), `out[t]` gets token `t`'s levels added.
pub fn rowblock_levels(
    isa: Isa,
    m: &R16Matrix,
    rb: usize,
    toks: &[TokenQ8<'_>],
    out: &mut [[f32; ROWS]],
) {
    let n = toks.len() / ACCURATE_LEVELS;
    assert!(toks.len() % ACCURATE_LEVELS == 0 && out.len() >= n);
    let mut lv = [[0f32; ROWS]; MAX_TOKEN_TILE];
    rowblock_exact(isa, m, rb, toks, &mut lv);
    for (o, l) in out[..n].iter_mut().zip(lv.chunks_exact(ACCURATE_LEVELS)) {
        for (r, or) in o.iter_mut().enumerate() {
            *or = (l[0][r] + l[1][r]) + l[2][r];
        }
    }
}

impl Isa {
    /// [`Isa::supported`] without allocating (cached detection), for hot paths.
    #[inline(always)]
    pub(crate) fn supported_cached(self) -> bool {
        use std::sync::OnceLock;
        static BEST: OnceLock<Isa> = OnceLock::new();
        let best = *BEST.get_or_init(Isa::detect);
        match self {
            Isa::Scalar => true,
            Isa::Avx2 => best != Isa::Scalar,
            Isa::Avx512Vnni => matches!(best, Isa::Avx512Vnni | Isa::Amx),
            Isa::Amx => best == Isa::Amx,
        }
    }
}

#[inline(always)]
fn scale_f32(dtype: ScaleDtype, bits: u16) -> f32 {
    dtype.to_f32(bits)
}

/// The portable path (also the fallback on non-x86 targets).
fn exact_scalar(m: &R16Matrix, rb: usize, toks: &[TokenQ8<'_>], out: &mut [[f32; ROWS]]) {
    let nib = m.row_block_nibbles(rb);
    let scales = m.row_block_scales(rb);
    let zeros = m.row_block_zeros(rb);
    let bpg = m.blocks_per_group();
    let dtype = m.spec().scale_dtype;
    for (t, tok) in toks.iter().enumerate() {
        let mut p = [[0f32; ROWS]; LANES];
        for b in 0..m.blocks() {
            let g = b / bpg;
            let tile = &nib[b * 256..(b + 1) * 256];
            let q = &tok.q[b * BLOCK..(b + 1) * BLOCK];
            for r in 0..ROWS {
                let mut isum = 0i32;
                for c in 0..4 {
                    for i in 0..4 {
                        let byte = tile[c * 64 + 4 * r + i];
                        isum += (byte & 0x0F) as i32 * q[4 * c + i] as i32;
                        isum += (byte >> 4) as i32 * q[16 + 4 * c + i] as i32;
                    }
                }
                let z = zeros.map_or(8, |z| z[g * ROWS + r]) as i32;
                isum -= z * tok.qsum[b];
                let s = scale_f32(dtype, scales[g * ROWS + r]);
                let term = (s * tok.d[b]) * isum as f32;
                p[b % LANES][r] += term;
            }
        }
        out[t] = halving_tree(&mut p);
    }
}

/// The contract's halving tree over 16 rows' partials (lane `l` += lane `l + w` for w = 8, 4,
/// 2, 1), row by row; returns lane 0.
pub(crate) fn halving_tree(p: &mut [[f32; ROWS]; LANES]) -> [f32; ROWS] {
    let mut w = LANES / 2;
    while w > 0 {
        for l in 0..w {
            for r in 0..ROWS {
                p[l][r] += p[l + w][r];
            }
        }
        w /= 2;
    }
    p[0]
}

/// `silu(g)·u` (the contract's SwiGLU) for whole rows of 16, in place of `g`: one call per
/// token tile (a call per row cost more than the arithmetic). Bit-identical to
/// [`contract::swiglu_contract`] on every ISA.
pub fn swiglu_rows(isa: Isa, g: &mut [[f32; ROWS]], u: &[[f32; ROWS]]) {
    assert_eq!(
        g.len(),
        u.len(),
        "swiglu_rows: gate and up row counts differ"
    );
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni | Isa::Amx if Isa::Avx512Vnni.supported_cached() => {
            // SAFETY: AVX-512 F is available; the row counts match (asserted).
            unsafe { x86::swiglu_rows_avx512(g, u) }
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 if Isa::Avx2.supported_cached() => {
            // SAFETY: AVX2 is available; the row counts match (asserted).
            unsafe { x86::swiglu_rows_avx2(g, u) }
        }
        _ => {
            for (gr, ur) in g.iter_mut().zip(u) {
                for (gv, &uv) in gr.iter_mut().zip(ur) {
                    *gv = contract::swiglu_contract(*gv, uv);
                }
            }
        }
    }
}

/// Accurate mode: rows `16rb..16rb+16` of `m` times f32 activations (one slice per token,
/// length K). Exact dequantization, f32 accumulation: per block `Σ (u-z)·x` then `· s`, summed
/// into one accumulator per row (order differs from exact mode; tolerance-tested).
pub fn rowblock_accurate(
    isa: Isa,
    m: &R16Matrix,
    rb: usize,
    toks: &[&[f32]],
    out: &mut [[f32; ROWS]],
) {
    assert!(toks.len() <= MAX_TOKEN_TILE && out.len() >= toks.len());
    assert!(rb < m.row_blocks(), "row block {rb} past the matrix");
    // The vector kernels read K values of each token unchecked.
    for x in toks {
        assert_eq!(x.len(), m.cols(), "a token of {} values against K", x.len());
    }
    // One token alone gets four FMA chains, two or three tokens two each: enough independent
    // chains to cover the FMA latency (four or more tokens are already that many chains).
    macro_rules! by_tokens {
        ($module:ident :: $kernel:ident) => {
            match toks.len() {
                0 => {}
                1 => $module::$kernel::<1, 4>(m, rb, toks, out),
                2 => $module::$kernel::<2, 2>(m, rb, toks, out),
                3 => $module::$kernel::<3, 2>(m, rb, toks, out),
                4 => $module::$kernel::<4, 1>(m, rb, toks, out),
                5 => $module::$kernel::<5, 1>(m, rb, toks, out),
                6 => $module::$kernel::<6, 1>(m, rb, toks, out),
                7 => $module::$kernel::<7, 1>(m, rb, toks, out),
                _ => $module::$kernel::<8, 1>(m, rb, toks, out),
            }
        };
    }
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni | Isa::Amx if Isa::Avx512Vnni.supported_cached() && x86::fma_f16c() => {
            // SAFETY: AVX-512 F/BW, FMA and F16C supported; `toks` holds at most
            // MAX_TOKEN_TILE (8) slices of K floats and `out` as many rows (asserted above).
            unsafe { by_tokens!(x86::accurate_avx512) }
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512Vnni | Isa::Amx
            if Isa::Avx2.supported_cached() && x86::fma_f16c() =>
        {
            // SAFETY: AVX2, FMA and F16C supported; slices as above.
            unsafe { by_tokens!(x86::accurate_avx2) }
        }
        _ => accurate_scalar(m, rb, toks, out),
    }
}

fn accurate_scalar(m: &R16Matrix, rb: usize, toks: &[&[f32]], out: &mut [[f32; ROWS]]) {
    let nib = m.row_block_nibbles(rb);
    let scales = m.row_block_scales(rb);
    let zeros = m.row_block_zeros(rb);
    let bpg = m.blocks_per_group();
    let dtype = m.spec().scale_dtype;
    for (t, x) in toks.iter().enumerate() {
        let mut acc = [0f32; ROWS];
        for b in 0..m.blocks() {
            let g = b / bpg;
            let tile = &nib[b * 256..(b + 1) * 256];
            let xb = &x[b * BLOCK..(b + 1) * BLOCK];
            for r in 0..ROWS {
                let z = zeros.map_or(8, |z| z[g * ROWS + r]) as i32;
                let mut s = 0f32;
                for c in 0..4 {
                    for i in 0..4 {
                        let byte = tile[c * 64 + 4 * r + i];
                        s += ((byte & 0x0F) as i32 - z) as f32 * xb[4 * c + i];
                        s += ((byte >> 4) as i32 - z) as f32 * xb[16 + 4 * c + i];
                    }
                }
                acc[r] += scale_f32(dtype, scales[g * ROWS + r]) * s;
            }
        }
        out[t] = acc;
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    //! x86-64 SIMD implementations; see the parent module for the contract they follow.
    use super::{ACCURATE_LEVELS, LevelsJob, R16Matrix, ROWS, RowBlockJob, TokenQ8};
    use expertmesh_quant::contract::LANES;
    use expertmesh_quant::format::{BLOCK, ScaleDtype};
    use std::arch::x86_64::*;

    /// The 16 row scales at `p` widened to f32.
    ///
    /// # Safety
    /// The CPU must support AVX-512 F (and F16C for f16 scales); `p` must point at 16 readable
    /// `u16` values (no alignment required).
    #[inline(always)]
    pub(crate) unsafe fn scales16_512(dtype: ScaleDtype, p: *const u16) -> __m512 {
        // SAFETY: caller guarantees 16 readable u16 at p.
        unsafe {
            let raw = _mm256_loadu_si256(p.cast());
            match dtype {
                ScaleDtype::Bf16 => {
                    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16))
                }
                ScaleDtype::F16 => _mm512_cvtph_ps(raw),
            }
        }
    }

    /// One row block's unpacked weights for one K block: low and high nibbles of the four
    /// 64-byte chunks, and the 16 row scales as f32.
    struct Tile512 {
        lo: [__m512i; 4],
        hi: [__m512i; 4],
        s: __m512,
        z: Option<__m512i>,
    }

    /// Load and unpack tile `b` (scale group `g`) of a row block.
    ///
    /// # Safety
    /// The CPU must support AVX-512 F/BW; `nib` must point at a row block's nibbles with tile `b`
    /// (256 bytes at `b·256`) inside it, `scales` at its scales with group `g` (16 `u16` at
    /// `g·16`) inside them, and `zeros`, when present, must hold at least `g·16 + 16` bytes.
    #[inline(always)]
    unsafe fn load_tile512(
        nib: *const u8,
        scales: *const u16,
        zeros: Option<&[u8]>,
        dtype: ScaleDtype,
        b: usize,
        g: usize,
    ) -> Tile512 {
        // SAFETY: the caller guarantees tile b and group g are inside the row block.
        unsafe {
            let mask = _mm512_set1_epi8(0x0F);
            let tile = nib.add(b * 256);
            let mut lo = [_mm512_setzero_si512(); 4];
            let mut hi = [_mm512_setzero_si512(); 4];
            for c in 0..4 {
                let w = _mm512_loadu_si512(tile.add(c * 64).cast());
                lo[c] = _mm512_and_si512(w, mask);
                hi[c] = _mm512_and_si512(_mm512_srli_epi16(w, 4), mask);
            }
            let s = scales16_512(dtype, scales.add(g * ROWS));
            let z = zeros
                .map(|z| _mm512_cvtepu8_epi32(_mm_loadu_si128(z.as_ptr().add(g * ROWS).cast())));
            Tile512 { lo, hi, s, z }
        }
    }

    /// The contract's term for one token and one K block: the exact i32 dot of the 16 rows
    /// (the zero-point correction folded into the accumulator's initial value), then
    /// `(s·d)·f32(isum)`.
    ///
    /// # Safety
    /// The CPU must support AVX-512 F/VNNI; `q` must point at the block's 32 readable codes
    /// (8 `i32`, no alignment required).
    #[inline(always)]
    unsafe fn term512(w: &Tile512, q: *const i32, qsum: i32, d: f32) -> __m512 {
        // SAFETY: q points at the block's 32 codes (8 dwords).
        unsafe {
            let corr = match w.z {
                None => _mm512_set1_epi32(-(qsum << 3)),
                Some(z) => _mm512_sub_epi32(
                    _mm512_setzero_si512(),
                    _mm512_mullo_epi32(z, _mm512_set1_epi32(qsum)),
                ),
            };
            let mut acc = corr;
            for c in 0..4 {
                acc =
                    _mm512_dpbusd_epi32(acc, w.lo[c], _mm512_set1_epi32(q.add(c).read_unaligned()));
            }
            for c in 0..4 {
                acc = _mm512_dpbusd_epi32(
                    acc,
                    w.hi[c],
                    _mm512_set1_epi32(q.add(4 + c).read_unaligned()),
                );
            }
            let sd = _mm512_mul_ps(w.s, _mm512_set1_ps(d));
            _mm512_mul_ps(sd, _mm512_cvtepi32_ps(acc))
        }
    }

    #[inline]
    #[target_feature(enable = "avx512f")]
    fn tree512(p: &mut [__m512; LANES]) -> __m512 {
        let mut w = LANES / 2;
        while w > 0 {
            for l in 0..w {
                p[l] = _mm512_add_ps(p[l], p[l + w]);
            }
            w /= 2;
        }
        p[0]
    }

    /// [`super::swiglu_rows`] on AVX-512: the contract's `exp` sequence, lane by lane.
    ///
    /// # Safety
    /// The CPU must support AVX-512 F; `u` as long as `g`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn swiglu_rows_avx512(g: &mut [[f32; ROWS]], u: &[[f32; ROWS]]) {
        for (gr, ur) in g.iter_mut().zip(u) {
            // SAFETY: AVX-512 F (the caller).
            unsafe { swiglu16_avx512(gr, ur) };
        }
    }

    /// One row of [`swiglu_rows_avx512`], in place.
    ///
    /// # Safety
    /// The CPU must support AVX-512 F.
    #[inline(always)]
    unsafe fn swiglu16_avx512(g: &mut [f32; ROWS], u: &[f32; ROWS]) {
        use expertmesh_quant::contract::{EXP_MAX, EXP_MIN, EXP_POLY, LN2_HI, LN2_LO, LOG2E};
        // SAFETY: g and u are 16 floats.
        unsafe {
            let gv = _mm512_loadu_ps(g.as_ptr());
            let uv = _mm512_loadu_ps(u.as_ptr());
            // v = -g (exact sign flip), clamped with max then min like the scalar code
            let sign = _mm512_set1_epi32(i32::MIN);
            let mut v = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(gv), sign));
            v = _mm512_min_ps(
                _mm512_max_ps(v, _mm512_set1_ps(EXP_MIN)),
                _mm512_set1_ps(EXP_MAX),
            );
            let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                _mm512_mul_ps(v, _mm512_set1_ps(LOG2E)),
            );
            let mut r = _mm512_sub_ps(v, _mm512_mul_ps(n, _mm512_set1_ps(LN2_HI)));
            r = _mm512_sub_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(LN2_LO)));
            let z = _mm512_mul_ps(r, r);
            let mut p = _mm512_set1_ps(EXP_POLY[0]);
            for &c in &EXP_POLY[1..] {
                p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(c));
            }
            p = _mm512_mul_ps(p, z);
            p = _mm512_add_ps(p, r);
            p = _mm512_add_ps(p, _mm512_set1_ps(1.0));
            let pow2 = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(
                _mm512_cvtps_epi32(n),
                _mm512_set1_epi32(127),
            )));
            let e = _mm512_mul_ps(p, pow2);
            let silu = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0), e));
            _mm512_storeu_ps(g.as_mut_ptr(), _mm512_mul_ps(silu, uv));
        }
    }

    /// [`super::swiglu_rows`] on AVX2: [`swiglu16_avx512`]'s sequence (the contract's `exp`,
    /// unfused multiplies and additions) on two 8-row halves of each row.
    ///
    /// # Safety
    /// The CPU must support AVX2; `u` as long as `g`.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn swiglu_rows_avx2(g: &mut [[f32; ROWS]], u: &[[f32; ROWS]]) {
        for (gr, ur) in g.iter_mut().zip(u) {
            // SAFETY: AVX2 (the caller).
            unsafe { swiglu16_avx2(gr, ur) };
        }
    }

    /// One row of [`swiglu_rows_avx2`], in place.
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[inline(always)]
    unsafe fn swiglu16_avx2(g: &mut [f32; ROWS], u: &[f32; ROWS]) {
        use expertmesh_quant::contract::{EXP_MAX, EXP_MIN, EXP_POLY, LN2_HI, LN2_LO, LOG2E};
        for half in 0..2 {
            // SAFETY: g and u are 16 floats.
            unsafe {
                let gv = _mm256_loadu_ps(g.as_ptr().add(8 * half));
                let uv = _mm256_loadu_ps(u.as_ptr().add(8 * half));
                // v = -g (exact sign flip), clamped with max then min like the scalar code
                // (a NaN becomes EXP_MIN in both: `maxps` returns its second operand).
                let mut v = _mm256_xor_ps(gv, _mm256_set1_ps(-0.0));
                v = _mm256_min_ps(
                    _mm256_max_ps(v, _mm256_set1_ps(EXP_MIN)),
                    _mm256_set1_ps(EXP_MAX),
                );
                let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                    _mm256_mul_ps(v, _mm256_set1_ps(LOG2E)),
                );
                let mut r = _mm256_sub_ps(v, _mm256_mul_ps(n, _mm256_set1_ps(LN2_HI)));
                r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(LN2_LO)));
                let z = _mm256_mul_ps(r, r);
                let mut p = _mm256_set1_ps(EXP_POLY[0]);
                for &c in &EXP_POLY[1..] {
                    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(c));
                }
                p = _mm256_mul_ps(p, z);
                p = _mm256_add_ps(p, r);
                p = _mm256_add_ps(p, _mm256_set1_ps(1.0));
                let pow2 = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
                    _mm256_cvtps_epi32(n),
                    _mm256_set1_epi32(127),
                )));
                let e = _mm256_mul_ps(p, pow2);
                let silu = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0), e));
                _mm256_storeu_ps(g.as_mut_ptr().add(8 * half), _mm256_mul_ps(silu, uv));
            }
        }
    }

    /// [`super::subtract_level`] compiled for AVX2.
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn subtract_level_avx2(r: &mut [f32], q: &[i8], d: &[f32]) {
        super::subtract_level_body(r, q, d);
    }

    /// [`super::quantize_activations`] on AVX2, and with `SUMS` [`super::block_sums`] into
    /// `qsum` from the codes still in registers; block by block (blocks with a NaN, an
    /// infinity or a tiny amax take the scalar code). Eight blocks at a time in registers (as
    /// AVX-512 does sixteen) was measured: 1.6x faster alone, 1-4 % slower inside a prefill
    /// (sixteen vector registers: the eight blocks' values spill to a stack the kernels'
    /// streaming has evicted).
    ///
    /// # Safety
    /// The CPU must support AVX2; `x.len()` is a multiple of 32, `q` as long, `d`
    /// `x.len() / 32` long, and with `SUMS` `qsum` as long as `d`.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn quantize_avx2<const SUMS: bool>(
        x: &[f32],
        q: &mut [i8],
        d: &mut [f32],
        qsum: &mut [i32],
    ) {
        for b in 0..d.len() {
            // SAFETY: block b exists in x, q, d (and qsum with SUMS): the caller's lengths.
            unsafe { block_avx2::<SUMS>(x, q, d, qsum, b) };
        }
    }

    /// The 32 codes of one block from its four vectors of `x · inv` inputs (`v`), packed to
    /// bytes in order (the packs work within 128-bit lanes; one dword permute restores the
    /// order) and stored at `qb`; returns the sum of the codes as eight i32 lanes.
    ///
    /// # Safety
    /// The CPU must support AVX2; `qb` must point at 32 writable bytes.
    #[inline(always)]
    unsafe fn codes_avx2(v: &[__m256; 4], inv: __m256, qb: *mut i8) -> __m256i {
        // SAFETY: the caller's contract.
        unsafe {
            let (lo, hi) = (_mm256_set1_ps(-127.0), _mm256_set1_ps(127.0));
            let c: [__m256i; 4] = std::array::from_fn(|i| {
                let r = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                    _mm256_mul_ps(v[i], inv),
                );
                _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi))
            });
            let bytes = _mm256_packs_epi16(
                _mm256_packs_epi32(c[0], c[1]),
                _mm256_packs_epi32(c[2], c[3]),
            );
            let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
            _mm256_storeu_si256(qb.cast(), _mm256_permutevar8x32_epi32(bytes, order));
            _mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3]))
        }
    }

    /// Block `b` of [`quantize_avx2`].
    ///
    /// # Safety
    /// The CPU must support AVX2; block `b` exists in `x`, `q`, `d` (and `qsum` with `SUMS`).
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn block_avx2<const SUMS: bool>(
        x: &[f32],
        q: &mut [i8],
        d: &mut [f32],
        qsum: &mut [i32],
        b: usize,
    ) {
        use expertmesh_quant::contract::MIN_BLOCK_AMAX;
        let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
        let (xb, qb) = (&x[b * BLOCK..][..BLOCK], &mut q[b * BLOCK..][..BLOCK]);
        // SAFETY: xb holds 32 floats and qb 32 bytes.
        unsafe {
            let v: [__m256; 4] = std::array::from_fn(|i| _mm256_loadu_ps(xb.as_ptr().add(8 * i)));
            let unordered = _mm256_or_ps(
                _mm256_cmp_ps::<_CMP_UNORD_Q>(v[0], v[1]),
                _mm256_cmp_ps::<_CMP_UNORD_Q>(v[2], v[3]),
            );
            let nan = _mm256_movemask_ps(unordered) != 0;
            let m = _mm256_max_ps(
                _mm256_max_ps(_mm256_and_ps(v[0], abs), _mm256_and_ps(v[1], abs)),
                _mm256_max_ps(_mm256_and_ps(v[2], abs), _mm256_and_ps(v[3], abs)),
            );
            let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
            let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
            let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps::<1>(m, m)));
            if nan || !amax.is_finite() || amax < MIN_BLOCK_AMAX {
                d[b] = quantize_block_cold(xb, qb);
                if SUMS {
                    qsum[b] = qb.iter().map(|&v| i32::from(v)).sum();
                }
                return;
            }
            d[b] = amax / 127.0;
            let sum = codes_avx2(&v, _mm256_set1_ps(127.0 / amax), qb.as_mut_ptr());
            if SUMS {
                let s = _mm_add_epi32(
                    _mm256_castsi256_si128(sum),
                    _mm256_extracti128_si256::<1>(sum),
                );
                let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
                let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
                qsum[b] = _mm_cvtsi128_si32(s);
            }
        }
    }

    /// [`super::quantize_activations`] on AVX-512, and with `SUMS` [`super::block_sums`] into
    /// `qsum` from the codes still in registers (a second pass over the codes cost half as
    /// much again as quantizing them). Sixteen blocks at a time ([`chunk16`]: 1.8x faster than
    /// block by block, with the sums), block by block in a chunk with an odd block and in the
    /// tail.
    ///
    /// # Safety
    /// The CPU must support AVX-512 F/BW; `x.len()` is a multiple of 32, `q` as long, `d`
    /// `x.len() / 32` long, and with `SUMS` `qsum` as long as `d`.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn quantize_avx512<const SUMS: bool>(
        x: &[f32],
        q: &mut [i8],
        d: &mut [f32],
        qsum: &mut [i32],
    ) {
        let blocks = d.len();
        let mut b0 = 0;
        while b0 < blocks {
            let end = blocks.min(b0 + LANES);
            // SAFETY: blocks b0..end exist in x, q, d (and qsum with SUMS): the caller's
            // lengths.
            unsafe {
                if end - b0 < LANES || !chunk16::<SUMS>(x, q, d, qsum, b0) {
                    for b in b0..end {
                        block512::<SUMS>(x, q, d, qsum, b);
                    }
                }
            }
            b0 = end;
        }
    }

    /// Block `b` of [`quantize_avx512`] on its own (the scalar code for a NaN, an infinity or
    /// a tiny amax).
    ///
    /// # Safety
    /// The CPU must support AVX-512 F/BW; block `b` exists in `x`, `q`, `d` (and `qsum`
    /// with `SUMS`).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn block512<const SUMS: bool>(
        x: &[f32],
        q: &mut [i8],
        d: &mut [f32],
        qsum: &mut [i32],
        b: usize,
    ) {
        use expertmesh_quant::contract::MIN_BLOCK_AMAX;
        let abs = _mm512_set1_epi32(0x7fff_ffff);
        let (lo, hi) = (_mm512_set1_ps(-127.0), _mm512_set1_ps(127.0));
        let (xb, qb) = (&x[b * BLOCK..][..BLOCK], &mut q[b * BLOCK..][..BLOCK]);
        // SAFETY: xb holds 32 floats and qb 32 bytes.
        unsafe {
            let v = [
                _mm512_loadu_ps(xb.as_ptr()),
                _mm512_loadu_ps(xb.as_ptr().add(16)),
            ];
            let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v[0], v[1]) != 0;
            let a = |v| _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), abs));
            let amax = _mm512_reduce_max_ps(_mm512_max_ps(a(v[0]), a(v[1])));
            if nan || !amax.is_finite() || amax < MIN_BLOCK_AMAX {
                d[b] = quantize_block_cold(xb, qb);
                if SUMS {
                    qsum[b] = qb.iter().map(|&v| i32::from(v)).sum();
                }
                return;
            }
            d[b] = amax / 127.0;
            let inv = _mm512_set1_ps(127.0 / amax);
            let mut sum = _mm512_setzero_si512();
            for (h, v) in v.into_iter().enumerate() {
                let r = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                    _mm512_mul_ps(v, inv),
                );
                let c = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(r, lo), hi));
                if SUMS {
                    sum = _mm512_add_epi32(sum, c);
                }
                _mm_storeu_si128(qb.as_mut_ptr().add(16 * h).cast(), _mm512_cvtepi32_epi8(c));
            }
            if SUMS {
                qsum[b] = _mm512_reduce_add_epi32(sum);
            }
        }
    }

    /// Sixteen blocks from `b0` at once, every value in registers: the blocks' 16-lane maxima
    /// folded into one vector of amaxes ([`fold16`]), the scales and reciprocals as two vector
    /// divisions, the code sums folded likewise. Writes nothing and returns false when a block
    /// needs the scalar code (NaN, infinity, tiny amax).
    ///
    /// # Safety
    /// The CPU must support AVX-512 F/BW; blocks `b0..b0 + 16` exist in `x`, `q`, `d` (and
    /// `qsum` with `SUMS`).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn chunk16<const SUMS: bool>(
        x: &[f32],
        q: &mut [i8],
        d: &mut [f32],
        qsum: &mut [i32],
        b0: usize,
    ) -> bool {
        use expertmesh_quant::contract::MIN_BLOCK_AMAX;
        // SAFETY: the caller's contract.
        unsafe {
            let xb = x.as_ptr().add(b0 * BLOCK);
            let abs = _mm512_set1_epi32(0x7fff_ffff);
            let a = |v| _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), abs));
            let mut nan: u32 = 0;
            let m: [__m512; LANES] = std::array::from_fn(|j| {
                let v0 = _mm512_loadu_ps(xb.add(j * BLOCK));
                let v1 = _mm512_loadu_ps(xb.add(j * BLOCK + 16));
                nan |= u32::from(_mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v0, v1));
                _mm512_max_ps(a(v0), a(v1))
            });
            let amax = fold16(&m, |p, q| _mm512_max_ps(p, q));
            let ok = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(amax, _mm512_set1_ps(MIN_BLOCK_AMAX))
                & _mm512_cmp_ps_mask::<_CMP_LT_OQ>(amax, _mm512_set1_ps(f32::INFINITY));
            if nan != 0 || ok != u16::MAX {
                return false;
            }
            _mm512_storeu_ps(
                d.as_mut_ptr().add(b0),
                _mm512_div_ps(amax, _mm512_set1_ps(127.0)),
            );
            let inv = _mm512_div_ps(_mm512_set1_ps(127.0), amax);
            let (lo, hi) = (_mm512_set1_ps(-127.0), _mm512_set1_ps(127.0));
            let qb = q.as_mut_ptr().add(b0 * BLOCK);
            let sums: [__m512; LANES] = std::array::from_fn(|j| {
                let invj = _mm512_permutexvar_ps(_mm512_set1_epi32(j as i32), inv);
                let mut sum = _mm512_setzero_si512();
                for h in 0..2 {
                    let v = _mm512_loadu_ps(xb.add(j * BLOCK + 16 * h));
                    let r = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                        _mm512_mul_ps(v, invj),
                    );
                    let c = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(r, lo), hi));
                    if SUMS {
                        sum = _mm512_add_epi32(sum, c);
                    }
                    _mm_storeu_si128(qb.add(j * BLOCK + 16 * h).cast(), _mm512_cvtepi32_epi8(c));
                }
                _mm512_castsi512_ps(sum)
            });
            if SUMS {
                let total = fold16(&sums, |p, q| {
                    _mm512_castsi512_ps(_mm512_add_epi32(
                        _mm512_castps_si512(p),
                        _mm512_castps_si512(q),
                    ))
                });
                _mm512_storeu_si512(qsum.as_mut_ptr().add(b0).cast(), _mm512_castps_si512(total));
            }
            true
        }
    }

    /// Lane `j` of the result is `op` folded over the sixteen lanes of `v[j]` (`op` exact,
    /// commutative and associative on the values it meets: max of magnitudes, i32 sums): a
    /// 16 × 16 transpose and reduction in four rounds of shuffles, about three operations per
    /// vector (reducing each vector on its own takes eight, in a long dependency chain).
    ///
    /// # Safety
    /// The CPU must support AVX-512 F.
    #[inline(always)]
    unsafe fn fold16(v: &[__m512; LANES], op: impl Fn(__m512, __m512) -> __m512) -> __m512 {
        // SAFETY: AVX-512 F (the caller).
        unsafe {
            // Round 1: vector i holds halves of v[2i] (lanes 0..8) and v[2i + 1] (8..16).
            let r: [__m512; 8] = std::array::from_fn(|i| {
                let (a, b) = (v[2 * i], v[2 * i + 1]);
                op(
                    _mm512_shuffle_f32x4::<0x44>(a, b),
                    _mm512_shuffle_f32x4::<0xEE>(a, b),
                )
            });
            // Round 2: 128-bit chunk c of vector i holds 4 partials of v[4i + c].
            let s: [__m512; 4] = std::array::from_fn(|i| {
                let (a, b) = (r[2 * i], r[2 * i + 1]);
                op(
                    _mm512_shuffle_f32x4::<0x88>(a, b),
                    _mm512_shuffle_f32x4::<0xDD>(a, b),
                )
            });
            // Round 3: chunk c of vector i holds 2 partials of v[8i + c], then 2 of v[8i + 4 + c].
            let t: [__m512; 2] = std::array::from_fn(|i| {
                let (a, b) = (_mm512_castps_pd(s[2 * i]), _mm512_castps_pd(s[2 * i + 1]));
                op(
                    _mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                    _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)),
                )
            });
            // Round 4: lane 4c + k holds v[c + 4k]; one permutation puts v[j] at lane j.
            let u = op(
                _mm512_shuffle_ps::<0x88>(t[0], t[1]),
                _mm512_shuffle_ps::<0xDD>(t[0], t[1]),
            );
            let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
            _mm512_permutexvar_ps(order, u)
        }
    }

    /// The contract's block quantizer for the blocks [`quantize_avx512`] leaves to it (NaN,
    /// infinite or tiny): out of line, so the compiler does not hoist its 32 scalar loads (and
    /// their spills) above the branch into every block, as it did when inlined (then 2/3 of
    /// the quantizer's time).
    #[cold]
    #[inline(never)]
    fn quantize_block_cold(x: &[f32], q: &mut [i8]) -> f32 {
        expertmesh_quant::contract::quantize_block(x, q)
    }

    /// Whether this CPU has FMA and F16C (every AVX2 CPU so far; checked, not assumed).
    pub(super) fn fma_f16c() -> bool {
        std::arch::is_x86_feature_detected!("fma") && std::arch::is_x86_feature_detected!("f16c")
    }

    /// Tiles prefetched ahead of use (16 tiles = 4 KiB).
    const PREFETCH_BLOCKS: usize = 16;
    /// Tiles the AVX2 stream kernels prefetch ahead in each stream, exact and accurate: much
    /// nearer than [`PREFETCH_BLOCKS`] (measured with one token per stream). On an EPYC without AVX-512 (Zen 3
    /// class, where the AVX2 path is the default) decode read 3-4 % more GB/s with 2 than
    /// with 4 tiles and 10-19 % more than with 16 in exact mode, 8 % more with 4 than with 16
    /// in accurate mode (a probe alternating the distances in one process, Qwen3 and Kimi K2
    /// shapes, memory-sized pools; BENCHMARKS.md, session 53). A likely reason: four streams'
    /// far prefetches (16 tiles × 4 lines each) are more than that core's L2 miss queue holds.
    /// The AVX-512 paths, measured on Zen 4 and Xeon VMs, keep [`PREFETCH_BLOCKS`].
    const AVX2_EXACT_PREFETCH_BLOCKS: usize = 2;
    /// See [`AVX2_EXACT_PREFETCH_BLOCKS`].
    const AVX2_ACCURATE_PREFETCH_BLOCKS: usize = 4;

    /// The software prefetch of weight tiles goes to L2 only (`prefetcht1`), not L1. An L1
    /// prefetch holds one of the core's few L1 miss buffers for its whole trip to DRAM and
    /// lands 4 KiB of every stream in L1 ahead of use, where it evicts the activation codes,
    /// sums and scales the kernel reads beside the weights (four streams against four
    /// different tokens or pairs: stage 2 always, stage 1 at B > 1); an L2 prefetch is tracked
    /// by the L2's larger queue, and the loads then find the tile in L2. On the EPYC Zen 4 VM
    /// decode read 10–35 % more GB/s with it (the AVX2 streams kernels up to 50 %; BENCHMARKS.md,
    /// "Decode kernels prefetch weights into L2"), and the read probes gained as much from it
    /// (`membw`'s `-l2` kernels, so the limit keeps up).
    const WEIGHT_PREFETCH: i32 = _MM_HINT_T1;

    /// Prefetch ([`WEIGHT_PREFETCH`]) the four lines of tile `tile` counted from the row block
    /// at `nib`, unless it is past the `tiles_left` tiles left in the matrix (`wrapping_add`
    /// keeps the arithmetic defined; prefetches never fault).
    #[inline(always)]
    fn prefetch_tile(nib: *const u8, tiles_left: usize, tile: usize) {
        if tile < tiles_left {
            let pf = nib.wrapping_add(tile * 256);
            for line in 0..4 {
                // SAFETY: a prefetch is a hint; the address lies inside the matrix.
                unsafe { _mm_prefetch::<WEIGHT_PREFETCH>(pf.wrapping_add(64 * line).cast()) };
            }
        }
    }

    /// Software prefetch `PREFETCH_BLOCKS` tiles ahead within one row block's matrix:
    /// addresses past the row block continue into the next one (row blocks are contiguous);
    /// nothing past the matrix is touched; `wrapping_add` keeps the arithmetic defined and
    /// prefetches never fault.
    #[derive(Clone, Copy)]
    struct Ahead {
        /// The row block's first nibble byte.
        nib: *const u8,
        /// Tiles from the row block's start to the end of the matrix.
        tiles_left: usize,
    }

    impl Ahead {
        #[inline(always)]
        fn new(m: &R16Matrix, rb: usize) -> Self {
            Self {
                nib: m.row_block_nibbles(rb).as_ptr(),
                tiles_left: (m.row_blocks() - rb) * m.blocks(),
            }
        }

        /// Prefetch the tile `PREFETCH_BLOCKS` after tile `b` of the row block.
        #[inline(always)]
        fn tile(self, b: usize) {
            prefetch_tile(self.nib, self.tiles_left, b + PREFETCH_BLOCKS);
        }
    }

    /// The contract's term for one token, one K block and one tile of 16 rows, with fewer
    /// instructions than [`term512`] (the single-token kernel has no other token to share
    /// the unpacking with): the high nibbles are masked in place (`w & 0xF0` = 16·code), so
    /// their dot is 16 times the wanted one and one exact arithmetic shift recovers it; the
    /// two dots run as two independent chains, each tile chunk masked where it is used.
    /// Integer sums are exact, so `isum` and the float steps after it are [`term512`]'s, bit
    /// for bit. [`term512_n`] for one token read 5-15 % fewer GB/s from cache on the EPYC
    /// Zen 4 VM (its masks all done first: more live registers across the unrolled loop).
    ///
    /// # Safety
    /// The CPU must support AVX-512 F/BW/VNNI; `tile` must point at 256 readable bytes and
    /// `q` at the block's 32 codes (8 `i32`, no alignment required).
    #[inline(always)]
    unsafe fn term512_1(
        tile: *const u8,
        s: __m512,
        corr: __m512i,
        q: *const i32,
        d: f32,
    ) -> __m512 {
        // SAFETY: the caller guarantees the tile's 256 bytes and the block's 32 codes.
        unsafe {
            let mlo = _mm512_set1_epi8(0x0F);
            let mhi = _mm512_set1_epi8(0xF0u8 as i8);
            let mut w = [_mm512_setzero_si512(); 4];
            for (c, wc) in w.iter_mut().enumerate() {
                *wc = _mm512_loadu_si512(tile.add(c * 64).cast());
            }
            // Σ over one block of 16·code·q (16 high-nibble codes per row) is at most
            // 16·15·128·16 < 2^31 in magnitude: no wrap-around, and it is a multiple of 16,
            // so the shift is an exact division.
            let mut lo = corr;
            for (c, wc) in w.iter().enumerate() {
                let qc = _mm512_set1_epi32(q.add(c).read_unaligned());
                lo = _mm512_dpbusd_epi32(lo, _mm512_and_si512(*wc, mlo), qc);
            }
            let mut hi = _mm512_setzero_si512();
            for (c, wc) in w.iter().enumerate() {
                let qc = _mm512_set1_epi32(q.add(4 + c).read_unaligned());
                hi = _mm512_dpbusd_epi32(hi, _mm512_and_si512(*wc, mhi), qc);
            }
            let isum = _mm512_add_epi32(lo, _mm512_srai_epi32::<4>(hi));
            let sd = _mm512_mul_ps(s, _mm512_set1_ps(d));
            _mm512_mul_ps(sd, _mm512_cvtepi32_ps(isum))
        }
    }

    /// The zero-point correction a block's integer dot starts from, `-(z · qs)` per row for
    /// code sum `qs`: `z` the rows' zero points with `Z`, the symmetric midpoint 8 without
    /// (`z` unused).
    ///
    /// # Safety
    /// The CPU must support AVX-512 F.
    #[inline(always)]
    unsafe fn zero_corr512<const Z: bool>(z: __m512i, qs: i32) -> __m512i {
        // SAFETY: AVX-512 F is the caller's precondition; no memory is touched.
        unsafe {
            if Z {
                _mm512_sub_epi32(
                    _mm512_setzero_si512(),
                    _mm512_mullo_epi32(z, _mm512_set1_epi32(qs)),
                )
            } else {
                _mm512_set1_epi32(-(qs << 3))
            }
        }
    }

    /// The 16 rows' zero points of group `g` at `zeros` widened to i32 with `Z` (zero
    /// otherwise, `zeros` unread).
    ///
    /// # Safety
    /// The CPU must support AVX-512 F; with `Z`, `zeros` must hold `16g + 16` bytes.
    #[inline(always)]
    unsafe fn zeros512<const Z: bool>(zeros: *const u8, g: usize) -> __m512i {
        // SAFETY: the caller's contract.
        unsafe {
            if Z {
                _mm512_cvtepu8_epi32(_mm_loadu_si128(zeros.add(g * ROWS).cast()))
            } else {
                _mm512_setzero_si512()
            }
        }
    }

    /// A tile's four 64-byte chunks masked in place: the low nibbles (codes) and the high
    /// nibbles (16·codes), for kernels that use each for several dots ([`term512_n`], the
    /// accurate levels).
    ///
    /// # Safety
    /// The CPU must support AVX-512 F; `tile` must point at 256 readable bytes.
    #[inline(always)]
    unsafe fn mask_tile512(tile: *const u8) -> ([__m512i; 4], [__m512i; 4]) {
        // SAFETY: the caller guarantees the tile's 256 bytes.
        unsafe {
            let (mlo, mhi) = (_mm512_set1_epi8(0x0F), _mm512_set1_epi8(0xF0u8 as i8));
            let mut lo = [_mm512_setzero_si512(); 4];
            let mut hi = [_mm512_setzero_si512(); 4];
            for c in 0..4 {
                let w = _mm512_loadu_si512(tile.add(c * 64).cast());
                lo[c] = _mm512_and_si512(w, mlo);
                hi[c] = _mm512_and_si512(w, mhi);
            }
            (lo, hi)
        }
    }

    /// [`term512_1`] for `T` tokens (two or more; on AVX-512 only [`super::rowblocks_exact`]'s
    /// direct callers, tests and the criterion bench give jobs of several tokens: the backend
    /// keeps one stream per token there): the tile is loaded and masked once for them,
    /// the high nibbles masked in place (`w & 0xF0` = 16·code), so their dot is 16 times the
    /// wanted one and one exact arithmetic shift recovers it; each token's two dots run as
    /// two independent chains, the first starting from its zero-point correction `corr[t]`.
    /// Integer sums are exact, so `isum` and the float steps after it are [`term512`]'s, bit
    /// for bit.
    ///
    /// # Safety
    /// The CPU must support AVX-512 F/BW/VNNI; `tile` must point at 256 readable bytes and
    /// each `q[t]` at the block's 32 codes of token `t` (8 `i32`, no alignment required).
    #[inline(always)]
    unsafe fn term512_n<const T: usize>(
        tile: *const u8,
        s: __m512,
        corr: [__m512i; T],
        q: [*const i32; T],
        d: [f32; T],
    ) -> [__m512; T] {
        // SAFETY: the caller guarantees the tile's 256 bytes and the blocks' 32 codes.
        unsafe {
            let (lo_codes, hi_codes) = mask_tile512(tile);
            // Plain loops, not `array::from_fn`: its closures are not always inlined into a
            // `target_feature` function, and a closure call per intrinsic made this kernel ten
            // times slower.
            let mut terms = [_mm512_setzero_ps(); T];
            for (t, term) in terms.iter_mut().enumerate() {
                // Σ over one block of 16·code·q (16 high-nibble codes per row) is at most
                // 16·15·128·16 < 2^31 in magnitude: no wrap-around, and it is a multiple of
                // 16, so the shift is an exact division.
                let mut lo = corr[t];
                for (c, wc) in lo_codes.iter().enumerate() {
                    let qc = _mm512_set1_epi32(q[t].add(c).read_unaligned());
                    lo = _mm512_dpbusd_epi32(lo, *wc, qc);
                }
                let mut hi = _mm512_setzero_si512();
                for (c, wc) in hi_codes.iter().enumerate() {
                    let qc = _mm512_set1_epi32(q[t].add(4 + c).read_unaligned());
                    hi = _mm512_dpbusd_epi32(hi, *wc, qc);
                }
                let isum = _mm512_add_epi32(lo, _mm512_srai_epi32::<4>(hi));
                let sd = _mm512_mul_ps(s, _mm512_set1_ps(d[t]));
                *term = _mm512_mul_ps(sd, _mm512_cvtepi32_ps(isum));
            }
            terms
        }
    }

    /// [`exact_vnni_streams`] for the first `S` jobs of `T` tokens each, dispatched once per
    /// call on the format (zero points, scale type) so the block loop has no branch on it.
    /// Returns `S`.
    ///
    /// # Safety
    /// As [`exact_vnni_streams`].
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub(super) unsafe fn exact_vnni_jobs<const S: usize, const T: usize>(
        jobs: &[RowBlockJob<'_, T>],
        out: &mut [[f32; ROWS]],
    ) -> usize {
        // SAFETY: forwarded from the caller.
        unsafe { by_format!(exact_vnni_streams::<S, T>(jobs, out)) };
        S
    }

    /// Calls `kernel::<S, .., Z, F16>(jobs, out)` with `Z` and `F16` the format of `jobs[0]`'s
    /// matrix (zero points, f16 scales): one branch per call, none in the block loop.
    macro_rules! by_format {
        ($kernel:ident::<$($g:ident),+>($jobs:expr, $out:expr)) => {{
            let spec = $jobs[0].m.spec();
            match (spec.zero_points, spec.scale_dtype) {
                (false, ScaleDtype::Bf16) => $kernel::<$($g),+, false, false>($jobs, $out),
                (false, ScaleDtype::F16) => $kernel::<$($g),+, false, true>($jobs, $out),
                (true, ScaleDtype::Bf16) => $kernel::<$($g),+, true, false>($jobs, $out),
                (true, ScaleDtype::F16) => $kernel::<$($g),+, true, true>($jobs, $out),
            }
        }};
    }
    use by_format;

    /// The scale type a kernel's `F16` parameter stands for.
    #[inline(always)]
    fn scale_dtype<const F16: bool>() -> ScaleDtype {
        if F16 {
            ScaleDtype::F16
        } else {
            ScaleDtype::Bf16
        }
    }

    /// Where the `S` streams of an accurate-mode kernel read: each job's row block (as a
    /// [`Stream`], with its first level as the token) and every level's codes, sums and scales.
    struct LevelStreams<const S: usize> {
        st: [Stream<1>; S],
        q: [[*const i32; ACCURATE_LEVELS]; S],
        qsum: [[*const i32; ACCURATE_LEVELS]; S],
        d: [[*const f32; ACCURATE_LEVELS]; S],
    }

    impl<const S: usize> LevelStreams<S> {
        /// The first `S` of `jobs`.
        fn new(jobs: &[LevelsJob<'_>]) -> Self {
            let lv = |s: usize, l: usize| &jobs[s].levels[l];
            LevelStreams {
                st: std::array::from_fn(|s| Stream::new(jobs[s].m, jobs[s].rb, &[*lv(s, 0)])),
                q: std::array::from_fn(|s| std::array::from_fn(|l| lv(s, l).q.as_ptr().cast())),
                qsum: std::array::from_fn(|s| std::array::from_fn(|l| lv(s, l).qsum.as_ptr())),
                d: std::array::from_fn(|s| std::array::from_fn(|l| lv(s, l).d.as_ptr())),
            }
        }
    }

    /// Where one stream of [`exact_vnni_streams`] reads: its row block's nibbles, scales,
    /// zero points (null without) and `T` tokens, and how many tiles are left in its matrix.
    struct Stream<const T: usize> {
        nib: *const u8,
        scales: *const u16,
        zeros: *const u8,
        q: [*const i32; T],
        qsum: [*const i32; T],
        d: [*const f32; T],
        tiles_left: usize,
    }

    impl<const T: usize> Stream<T> {
        /// Row block `rb` of `m` against `toks`.
        fn new(m: &R16Matrix, rb: usize, toks: &[TokenQ8<'_>; T]) -> Self {
            Stream {
                nib: m.row_block_nibbles(rb).as_ptr(),
                scales: m.row_block_scales(rb).as_ptr(),
                zeros: m
                    .row_block_zeros(rb)
                    .map_or(std::ptr::null(), |z| z.as_ptr()),
                q: std::array::from_fn(|t| toks[t].q.as_ptr().cast::<i32>()),
                qsum: std::array::from_fn(|t| toks[t].qsum.as_ptr()),
                d: std::array::from_fn(|t| toks[t].d.as_ptr()),
                tiles_left: (m.row_blocks() - rb) * m.blocks(),
            }
        }

        /// Prefetch the stream's tile `tile` (counted from its row block's start, on into the
        /// next row blocks), unless it is past the matrix.
        #[inline(always)]
        fn prefetch(&self, tile: usize) {
            prefetch_tile(self.nib, self.tiles_left, tile);
        }
    }

    /// AVX-512 VNNI exact kernel for `T` tokens per job (decode) over `S` jobs, read as `S`
    /// interleaved streams: block `b` of every job's row block, then block `b + 1`. One core
    /// reading one stream leaves DRAM bandwidth unused (the hardware prefetcher follows few
    /// pages at a time); `S` streams keep more in flight. Each tile is loaded and masked once
    /// for the job's `T` tokens ([`term512_n`]); each token keeps its own 16 partials, so each
    /// row's arithmetic is exactly the scalar contract's. Blocks are in natural
    /// order; the block loop is unrolled by 16 so each partial index is a constant. Software
    /// prefetch runs [`PREFETCH_BLOCKS`] tiles ahead in each stream and, past a row block's
    /// end, on into the next row block of the same matrix, never past the matrix.
    ///
    /// # Safety
    /// The CPU must support AVX-512 F/BW/VNNI; `jobs` must hold at least `S` entries and
    /// `out` `S·T`; the first `S` jobs must share K and the format (`Z`, `F16` matching it),
    /// each row block inside its matrix, each token with `cols` codes and `blocks` scales and
    /// sums (read unchecked).
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn exact_vnni_streams<const S: usize, const T: usize, const Z: bool, const F16: bool>(
        jobs: &[RowBlockJob<'_, T>],
        out: &mut [[f32; ROWS]],
    ) {
        let m0 = jobs[0].m;
        let blocks = m0.blocks();
        // Groups are 32, 64 or 128 columns: blocks per group is a power of two.
        let shift = m0.blocks_per_group().trailing_zeros();
        let dtype = scale_dtype::<F16>();
        let st: [Stream<T>; S] =
            std::array::from_fn(|s| Stream::new(jobs[s].m, jobs[s].rb, &jobs[s].toks));
        // The partials (16 per token, 4 KiB per token at four streams, so in memory) are not
        // zeroed first: the first sixteen blocks write `+0.0 + term` (as [`exact_vnni_multi`]);
        // a stage-2 row block of a Qwen3-sized expert has only 24 blocks per call.
        let zero = _mm512_setzero_ps();
        let mut pu = std::mem::MaybeUninit::<[[[__m512; LANES]; T]; S]>::uninit();
        let at = pu.as_mut_ptr().cast::<__m512>();
        let mut b = 0;
        macro_rules! step {
            ($j:expr, $put:expr) => {{
                let bb = b + $j;
                let g = bb >> shift;
                let ahead = bb + PREFETCH_BLOCKS;
                for s in 0..S {
                    let st = &st[s];
                    // SAFETY: bb < blocks and g < groups: every read below is inside the
                    // stream's row block or its tokens (see the function's contract); the
                    // prefetch address stays inside the matrix (and prefetches never fault).
                    unsafe {
                        st.prefetch(ahead);
                        let sc = scales16_512(dtype, st.scales.add(g * ROWS));
                        let z = zeros512::<Z>(st.zeros, g);
                        if T == 1 {
                            let corr = zero_corr512::<Z>(z, *st.qsum[0].add(bb));
                            let term = term512_1(
                                st.nib.add(bb * 256),
                                sc,
                                corr,
                                st.q[0].add(bb * 8),
                                *st.d[0].add(bb),
                            );
                            $put(s, 0, $j, term);
                            continue;
                        }
                        let mut corr = [_mm512_setzero_si512(); T];
                        let mut q = [std::ptr::null::<i32>(); T];
                        let mut d = [0f32; T];
                        for t in 0..T {
                            corr[t] = zero_corr512::<Z>(z, *st.qsum[t].add(bb));
                            q[t] = st.q[t].add(bb * 8);
                            d[t] = *st.d[t].add(bb);
                        }
                        let terms = term512_n::<T>(st.nib.add(bb * 256), sc, corr, q, d);
                        for (t, term) in terms.into_iter().enumerate() {
                            $put(s, t, $j, term);
                        }
                    }
                }
            }};
        }
        let head = blocks.min(LANES);
        let init = |s: usize, t: usize, l: usize, term| {
            // SAFETY: s < S, t < T and l < LANES: inside the partials.
            unsafe {
                at.add((s * T + t) * LANES + l)
                    .write(_mm512_add_ps(zero, term))
            }
        };
        if head == LANES {
            step!(0, init);
            step!(1, init);
            step!(2, init);
            step!(3, init);
            step!(4, init);
            step!(5, init);
            step!(6, init);
            step!(7, init);
            step!(8, init);
            step!(9, init);
            step!(10, init);
            step!(11, init);
            step!(12, init);
            step!(13, init);
            step!(14, init);
            step!(15, init);
        } else {
            for j in 0..head {
                step!(j, init);
            }
        }
        for i in 0..S * T {
            for l in head..LANES {
                // SAFETY: inside the partials, as above.
                unsafe { at.add(i * LANES + l).write(zero) };
            }
        }
        // SAFETY: every partial of every stream was written just above.
        let p = unsafe { pu.assume_init_mut() };
        b = head;
        let mut acc = |s: usize, t: usize, l: usize, term| {
            p[s][t][l] = _mm512_add_ps(p[s][t][l], term);
        };
        while b + LANES <= blocks {
            step!(0, acc);
            step!(1, acc);
            step!(2, acc);
            step!(3, acc);
            step!(4, acc);
            step!(5, acc);
            step!(6, acc);
            step!(7, acc);
            step!(8, acc);
            step!(9, acc);
            step!(10, acc);
            step!(11, acc);
            step!(12, acc);
            step!(13, acc);
            step!(14, acc);
            step!(15, acc);
            b += LANES;
        }
        // Tail (blocks % 16 != 0): partial index is still b % 16 = j.
        for j in 0..blocks - b {
            step!(j, acc);
        }
        for (s, ps) in p.iter_mut().enumerate() {
            for (t, pt) in ps.iter_mut().enumerate() {
                // SAFETY: out[s·T + t] is 16 f32.
                unsafe { _mm512_storeu_ps(out[s * T + t].as_mut_ptr(), tree512(pt)) };
            }
        }
    }

    /// [`accurate_levels_streams`] for the first `S` jobs, dispatched once per call on the
    /// format. Returns `S`.
    ///
    /// # Safety
    /// As [`accurate_levels_streams`].
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub(super) unsafe fn accurate_levels<const S: usize>(
        jobs: &[LevelsJob<'_>],
        out: &mut [[f32; ROWS]],
    ) -> usize {
        // SAFETY: forwarded from the caller.
        unsafe { by_format!(accurate_levels_streams::<S>(jobs, out)) };
        S
    }

    /// AVX-512 VNNI accurate kernel for one token per job over `S` jobs read as interleaved
    /// streams (as [`exact_vnni_streams`]): each tile's nibbles are masked once and serve the
    /// token's three levels (three exact i32 dots, the high nibbles masked in place and shifted
    /// back as in [`term512_n`]); per block `Σ_l d_l·f32(isum_l)` (two FMAs), then one FMA with
    /// the row scales into one of two accumulators per stream (accurate mode has no
    /// prescribed order), so every sum stays in registers.
    ///
    /// # Safety
    /// As [`exact_vnni_streams`], with each level of each job's token holding `cols` codes and
    /// `blocks` scales and sums.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn accurate_levels_streams<const S: usize, const Z: bool, const F16: bool>(
        jobs: &[LevelsJob<'_>],
        out: &mut [[f32; ROWS]],
    ) {
        let m0 = jobs[0].m;
        let blocks = m0.blocks();
        let shift = m0.blocks_per_group().trailing_zeros();
        let dtype = scale_dtype::<F16>();
        let LevelStreams {
            st,
            q: lq,
            qsum: lqs,
            d: ld,
        } = LevelStreams::<S>::new(jobs);
        let mut acc = [[_mm512_setzero_ps(); 2]; S];
        for bb in 0..blocks {
            let g = bb >> shift;
            let ahead = bb + PREFETCH_BLOCKS;
            for s in 0..S {
                let st = &st[s];
                // SAFETY: bb < blocks and g < groups: every read is inside the stream's row
                // block or its token's levels (the function's contract); the prefetch address
                // stays inside the matrix.
                unsafe {
                    st.prefetch(ahead);
                    let (lo, hi) = mask_tile512(st.nib.add(bb * 256));
                    let z = zeros512::<Z>(st.zeros, g);
                    let mut sum = _mm512_setzero_ps();
                    for l in 0..ACCURATE_LEVELS {
                        let q = lq[s][l].add(bb * 8);
                        let mut a = zero_corr512::<Z>(z, *lqs[s][l].add(bb));
                        let mut b = _mm512_setzero_si512();
                        for c in 0..4 {
                            let qc = _mm512_set1_epi32(q.add(c).read_unaligned());
                            a = _mm512_dpbusd_epi32(a, lo[c], qc);
                        }
                        for c in 0..4 {
                            let qc = _mm512_set1_epi32(q.add(4 + c).read_unaligned());
                            b = _mm512_dpbusd_epi32(b, hi[c], qc);
                        }
                        let isum = _mm512_add_epi32(a, _mm512_srai_epi32::<4>(b));
                        let d = _mm512_set1_ps(*ld[s][l].add(bb));
                        sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), d, sum);
                    }
                    let sc = scales16_512(dtype, st.scales.add(g * ROWS));
                    let k = bb & 1;
                    acc[s][k] = _mm512_fmadd_ps(sc, sum, acc[s][k]);
                }
            }
        }
        for (s, a) in acc.iter().enumerate() {
            // SAFETY: out[s] is 16 f32.
            unsafe { _mm512_storeu_ps(out[s].as_mut_ptr(), _mm512_add_ps(a[0], a[1])) };
        }
    }

    /// AVX-512 VNNI exact kernel for `T` tokens (2..=8): natural block order (a sequential
    /// stream the hardware prefetcher follows, plus software prefetch ahead), the weight tile
    /// unpacked once and used by all T tokens, each token's 16 partials kept in an L1-resident
    /// array (too many for registers).
    ///
    /// # Safety
    /// The CPU must support AVX-512 F/BW/VNNI; `rb` must be a row block of `m`; `toks` and
    /// `out` must hold at least `T` entries, each token with `m.cols()` codes and `m.blocks()`
    /// scales and block sums (read unchecked).
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub(super) unsafe fn exact_vnni_multi<const T: usize>(
        m: &R16Matrix,
        rb: usize,
        toks: &[TokenQ8<'_>],
        out: &mut [[f32; ROWS]],
    ) {
        let nib = m.row_block_nibbles(rb).as_ptr();
        let scales = m.row_block_scales(rb).as_ptr();
        let zeros = m.row_block_zeros(rb);
        // Groups are 32, 64 or 128 columns: blocks per group is a power of two.
        let shift = m.blocks_per_group().trailing_zeros();
        let dtype = m.spec().scale_dtype;
        let blocks = m.blocks();
        let ahead = Ahead::new(m, rb);
        let mut q = [std::ptr::null::<i32>(); T];
        for t in 0..T {
            q[t] = toks[t].q.as_ptr().cast::<i32>();
        }
        // Block `b`'s term for every token, each handed to `$add(t, l, term)` (`l = b % 16`).
        macro_rules! block_terms {
            ($b:expr, $add:expr) => {{
                let b = $b;
                ahead.tile(b);
                // SAFETY: b < blocks; see `load_tile512` and `term512`.
                unsafe {
                    let w = load_tile512(nib, scales, zeros, dtype, b, b >> shift);
                    for t in 0..T {
                        let tk = toks.get_unchecked(t);
                        let term = term512(
                            &w,
                            q[t].add(b * 8),
                            *tk.qsum.get_unchecked(b),
                            *tk.d.get_unchecked(b),
                        );
                        $add(t, b % LANES, term);
                    }
                }
            }};
        }
        // The partials (16 per token: 8 KiB at 8 tokens, so in memory) are not zeroed first:
        // the first sixteen blocks write `+0.0 + term`, the contract's first addition to a
        // partial that starts at +0.0 (so a -0.0 term still gives +0.0), and partials of a
        // matrix with fewer blocks are set to +0.0. Zeroing them took 6 % of a Qwen3-shaped
        // prefill (K = 768: 24 blocks per call).
        let zero = _mm512_setzero_ps();
        let mut p = std::mem::MaybeUninit::<[[__m512; LANES]; T]>::uninit();
        let at = p.as_mut_ptr().cast::<__m512>();
        let head = blocks.min(LANES);
        for b in 0..head {
            // t < T and l < LANES: inside `p` (the macro's unsafe block covers the write).
            block_terms!(b, |t: usize, l: usize, term| at
                .add(t * LANES + l)
                .write(_mm512_add_ps(zero, term)));
        }
        for t in 0..T {
            for l in head..LANES {
                // SAFETY: as above.
                unsafe { at.add(t * LANES + l).write(zero) };
            }
        }
        // SAFETY: every partial of every token was written just above.
        let p = unsafe { p.assume_init_mut() };
        for b in LANES..blocks {
            block_terms!(b, |t: usize, l: usize, term| p[t][l] =
                _mm512_add_ps(p[t][l], term));
        }
        for t in 0..T {
            // SAFETY: out[t] is 16 f32.
            unsafe { _mm512_storeu_ps(out[t].as_mut_ptr(), tree512(&mut p[t])) };
        }
    }

    /// The 8 row scales at `p` widened to f32.
    ///
    /// # Safety
    /// The CPU must support AVX2 and F16C; `p` must point at 8 readable `u16` values.
    #[inline(always)]
    unsafe fn scales8(dtype: ScaleDtype, p: *const u16) -> __m256 {
        // SAFETY: caller guarantees 8 readable u16 at p.
        unsafe {
            let raw = _mm_loadu_si128(p.cast());
            match dtype {
                ScaleDtype::Bf16 => {
                    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16))
                }
                ScaleDtype::F16 => _mm256_cvtph_ps(raw),
            }
        }
    }

    /// The 8 row zero points at `p` widened to i32.
    ///
    /// # Safety
    /// The CPU must support AVX2; `p` must point at 8 readable bytes.
    #[inline(always)]
    unsafe fn zeros8(p: *const u8) -> __m256i {
        // SAFETY: caller guarantees 8 readable bytes at p.
        unsafe { _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.cast())) }
    }

    /// The zero-point term a block's integer sums lose per row: `z · Σq` (`z` = 8 without zero
    /// points, the symmetric code's midpoint), `qs` being the block's code sum.
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[inline(always)]
    unsafe fn zero_term8(z: Option<__m256i>, qs: i32) -> __m256i {
        // SAFETY: AVX2 is the caller's precondition; no memory is touched.
        unsafe {
            match z {
                None => _mm256_set1_epi32(qs << 3),
                Some(z) => _mm256_mullo_epi32(z, _mm256_set1_epi32(qs)),
            }
        }
    }

    /// [`exact_avx2_streams`] for the first `S` jobs of `T` tokens each, dispatched once per
    /// call on the format (zero points, scale type) so the block loop has no branch on it.
    /// Returns `S`.
    ///
    /// # Safety
    /// As [`exact_avx2_streams`].
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn exact_avx2_jobs<const S: usize, const T: usize>(
        jobs: &[RowBlockJob<'_, T>],
        out: &mut [[f32; ROWS]],
    ) -> usize {
        // SAFETY: forwarded from the caller.
        unsafe { by_format!(exact_avx2_streams::<S, T>(jobs, out)) };
        S
    }

    /// The zero-point term of `Z`-format rows for code sum `qs`: `z · qs` from the 8 zero
    /// points at `zeros` with zero points, `8 · qs` (the symmetric midpoint) without.
    ///
    /// # Safety
    /// The CPU must support AVX2; with `Z`, `zeros` must point at 8 readable bytes.
    #[inline(always)]
    unsafe fn zero_term8_at<const Z: bool>(zeros: *const u8, qs: i32) -> __m256i {
        // SAFETY: forwarded from the caller.
        unsafe {
            if Z {
                _mm256_mullo_epi32(zeros8(zeros), _mm256_set1_epi32(qs))
            } else {
                _mm256_set1_epi32(qs << 3)
            }
        }
    }

    /// AVX2 exact kernel for `T` tokens per job (decode) over `S` jobs read as interleaved
    /// streams, as [`exact_vnni_streams`] does: block `b` of every job's row block, then block
    /// `b + 1`, prefetching ahead in each stream. Per job and block both 8-row halves in one
    /// pass, each 32-byte chunk unpacked once for the job's `T` tokens (the code broadcasts,
    /// block scale and zero-point term serve both halves); each row's arithmetic is exactly
    /// [`exact_avx2`]'s (integer sums are exact; the float steps and the partial index
    /// `b % 16` are the same), so the two agree bit for bit.
    ///
    /// # Safety
    /// The CPU must support AVX2 and F16C; otherwise as [`exact_vnni_streams`].
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn exact_avx2_streams<const S: usize, const T: usize, const Z: bool, const F16: bool>(
        jobs: &[RowBlockJob<'_, T>],
        out: &mut [[f32; ROWS]],
    ) {
        let m0 = jobs[0].m;
        let blocks = m0.blocks();
        let shift = m0.blocks_per_group().trailing_zeros();
        let dtype = scale_dtype::<F16>();
        let st: [Stream<T>; S] =
            std::array::from_fn(|s| Stream::new(jobs[s].m, jobs[s].rb, &jobs[s].toks));
        let mask = _mm256_set1_epi8(0x0F);
        let ones = _mm256_set1_epi16(1);
        // The partials (16 per token and half: 16 KiB at four streams of four tokens) are not
        // zeroed first: the first sixteen blocks write `+0.0 + term` (as
        // [`exact_vnni_streams`]), and only the partials of a row block shorter than that
        // are zeroed.
        let zero = _mm256_setzero_ps();
        let mut pu = std::mem::MaybeUninit::<[[[[__m256; LANES]; 2]; T]; S]>::uninit();
        let at = pu.as_mut_ptr().cast::<__m256>();
        let slot = |s: usize, t: usize, half: usize, l: usize| ((s * T + t) * 2 + half) * LANES + l;
        macro_rules! block {
            ($bb:expr, $put:expr) => {{
                let bb = $bb;
                let g = bb >> shift;
                let ahead = bb + AVX2_EXACT_PREFETCH_BLOCKS;
                for s in 0..S {
                    let st = &st[s];
                    // SAFETY: bb < blocks and g < groups: every read is inside the stream's row
                    // block (tile `bb` is 256 bytes; 16 scales and zero points per group) or its
                    // tokens (8 i32 of codes, one scale and one sum per block); the prefetch
                    // address stays inside the matrix; `$put` writes inside the partials.
                    unsafe {
                        st.prefetch(ahead);
                        let tile = st.nib.add(bb * 256);
                        // Plain loops, not `array::from_fn` (see `term512_n`).
                        let mut q = [std::ptr::null::<i32>(); T];
                        for t in 0..T {
                            q[t] = st.q[t].add(bb * 8);
                        }
                        // Σ over 8 pmaddubsw results stays within i16 (see `exact_avx2`).
                        let mut s16 = [[_mm256_setzero_si256(); 2]; T];
                        for c in 0..4 {
                            let mut ql = [_mm256_setzero_si256(); T];
                            let mut qh = [_mm256_setzero_si256(); T];
                            for t in 0..T {
                                ql[t] = _mm256_set1_epi32(q[t].add(c).read_unaligned());
                                qh[t] = _mm256_set1_epi32(q[t].add(4 + c).read_unaligned());
                            }
                            for half in 0..2 {
                                let w = _mm256_loadu_si256(tile.add(c * 64 + half * 32).cast());
                                let lo = _mm256_and_si256(w, mask);
                                let hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), mask);
                                for t in 0..T {
                                    let acc = &mut s16[t][half];
                                    *acc = _mm256_add_epi16(*acc, _mm256_maddubs_epi16(lo, ql[t]));
                                    *acc = _mm256_add_epi16(*acc, _mm256_maddubs_epi16(hi, qh[t]));
                                }
                            }
                        }
                        for half in 0..2 {
                            let row0 = g * ROWS + half * 8;
                            let sc = scales8(dtype, st.scales.add(row0));
                            let z = if Z {
                                Some(zeros8(st.zeros.add(row0)))
                            } else {
                                None
                            };
                            for t in 0..T {
                                let d = _mm256_set1_ps(*st.d[t].add(bb));
                                let corr = zero_term8(z, *st.qsum[t].add(bb));
                                let isum =
                                    _mm256_sub_epi32(_mm256_madd_epi16(s16[t][half], ones), corr);
                                let term =
                                    _mm256_mul_ps(_mm256_mul_ps(sc, d), _mm256_cvtepi32_ps(isum));
                                $put(slot(s, t, half, bb % LANES), term);
                            }
                        }
                    }
                }
            }};
        }
        let head = blocks.min(LANES);
        // `put` runs inside `block!`'s unsafe block: slot(..) < S·T·2·LANES, inside the
        // partials.
        for bb in 0..head {
            block!(bb, |i: usize, term| {
                at.add(i).write(_mm256_add_ps(zero, term));
            });
        }
        for i in 0..S * T * 2 {
            for l in head..LANES {
                // SAFETY: inside the partials, as above.
                unsafe { at.add(i * LANES + l).write(zero) };
            }
        }
        // SAFETY: every partial of every stream was written just above.
        let p = unsafe { pu.assume_init_mut() };
        let pf = p.as_mut_ptr().cast::<__m256>();
        for bb in head..blocks {
            // As above; the partials are initialized.
            block!(bb, |i: usize, term| {
                let v = pf.add(i);
                v.write(_mm256_add_ps(v.read(), term));
            });
        }
        for (s, ps) in p.iter_mut().enumerate() {
            for (t, pt) in ps.iter_mut().enumerate() {
                for (half, ph) in pt.iter_mut().enumerate() {
                    let mut w = LANES / 2;
                    while w > 0 {
                        for l in 0..w {
                            ph[l] = _mm256_add_ps(ph[l], ph[l + w]);
                        }
                        w /= 2;
                    }
                    // SAFETY: out[s·T + t] has 16 f32; this half writes 8 of them.
                    unsafe { _mm256_storeu_ps(out[s * T + t].as_mut_ptr().add(half * 8), ph[0]) };
                }
            }
        }
    }

    /// [`accurate_levels_avx2_streams`] for the first `S` jobs, dispatched once per call on
    /// the format. Returns `S`.
    ///
    /// # Safety
    /// As [`accurate_levels_avx2_streams`].
    #[target_feature(enable = "avx2,f16c,fma")]
    pub(super) unsafe fn accurate_levels_avx2<const S: usize>(
        jobs: &[LevelsJob<'_>],
        out: &mut [[f32; ROWS]],
    ) -> usize {
        // SAFETY: forwarded from the caller.
        unsafe { by_format!(accurate_levels_avx2_streams::<S>(jobs, out)) };
        S
    }

    /// AVX2 accurate kernel for one token per job over `S` jobs read as interleaved streams
    /// (as [`accurate_levels_streams`] on AVX-512): each 32-byte half-chunk of a tile is loaded
    /// and unpacked once and serves the token's three levels (three exact i32 dots per 8-row
    /// half, `pmaddubsw` + `pmaddwd` as in [`exact_avx2`]); per block `Σ_l d_l·f32(isum_l)`
    /// (FMAs), then one FMA with the row scales into the half's accumulator (accurate mode has
    /// no prescribed order). One accumulator per half, not two alternating: a block's work is
    /// far longer than an FMA's latency, and the second set only took registers (the probe of
    /// BENCHMARKS 2026-12-06: 1-5 % faster at one token).
    ///
    /// # Safety
    /// The CPU must support AVX2, F16C and FMA; otherwise as [`accurate_levels_streams`].
    #[target_feature(enable = "avx2,f16c,fma")]
    unsafe fn accurate_levels_avx2_streams<const S: usize, const Z: bool, const F16: bool>(
        jobs: &[LevelsJob<'_>],
        out: &mut [[f32; ROWS]],
    ) {
        const LV: usize = ACCURATE_LEVELS;
        let m0 = jobs[0].m;
        let blocks = m0.blocks();
        let shift = m0.blocks_per_group().trailing_zeros();
        let dtype = scale_dtype::<F16>();
        let LevelStreams {
            st,
            q: lq,
            qsum: lqs,
            d: ld,
        } = LevelStreams::<S>::new(jobs);
        let mask = _mm256_set1_epi8(0x0F);
        let ones = _mm256_set1_epi16(1);
        let mut acc = [[_mm256_setzero_ps(); 2]; S];
        for bb in 0..blocks {
            let g = bb >> shift;
            let ahead = bb + AVX2_ACCURATE_PREFETCH_BLOCKS;
            for s in 0..S {
                let st = &st[s];
                // SAFETY: bb < blocks and g < groups: every read is inside the stream's row
                // block or its token's levels (the function's contract); the prefetch address
                // stays inside the matrix.
                unsafe {
                    st.prefetch(ahead);
                    let tile = st.nib.add(bb * 256);
                    let q: [*const i32; LV] = std::array::from_fn(|l| lq[s][l].add(bb * 8));
                    // Per level and half, Σ over 8 pmaddubsw results (within i16).
                    let mut s16 = [[_mm256_setzero_si256(); 2]; LV];
                    for c in 0..4 {
                        let ql: [__m256i; LV] = std::array::from_fn(|l| {
                            _mm256_set1_epi32(q[l].add(c).read_unaligned())
                        });
                        let qh: [__m256i; LV] = std::array::from_fn(|l| {
                            _mm256_set1_epi32(q[l].add(4 + c).read_unaligned())
                        });
                        for half in 0..2 {
                            let w = _mm256_loadu_si256(tile.add(c * 64 + half * 32).cast());
                            let lo = _mm256_and_si256(w, mask);
                            let hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), mask);
                            for l in 0..LV {
                                let a = _mm256_add_epi16(
                                    _mm256_maddubs_epi16(lo, ql[l]),
                                    _mm256_maddubs_epi16(hi, qh[l]),
                                );
                                s16[l][half] = _mm256_add_epi16(s16[l][half], a);
                            }
                        }
                    }
                    for half in 0..2 {
                        let at = g * ROWS + half * 8;
                        let mut sum = _mm256_setzero_ps();
                        for l in 0..LV {
                            let qs = *lqs[s][l].add(bb);
                            let corr = zero_term8_at::<Z>(st.zeros.wrapping_add(at), qs);
                            let isum =
                                _mm256_sub_epi32(_mm256_madd_epi16(s16[l][half], ones), corr);
                            let d = _mm256_set1_ps(*ld[s][l].add(bb));
                            sum = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), d, sum);
                        }
                        let sc = scales8(dtype, st.scales.add(at));
                        acc[s][half] = _mm256_fmadd_ps(sc, sum, acc[s][half]);
                    }
                }
            }
        }
        for (s, a) in acc.iter().enumerate() {
            for (half, &ah) in a.iter().enumerate() {
                // SAFETY: out[s] has 16 f32; this half writes 8 of them.
                unsafe { _mm256_storeu_ps(out[s].as_mut_ptr().add(half * 8), ah) };
            }
        }
    }

    /// AVX2 exact kernel for `T` tokens: each block's two 8-row halves in turn, so the row
    /// block is read once, in order (the partial sums of both halves stay live).
    ///
    /// # Safety
    /// The CPU must support AVX2 and F16C; `rb` must be a row block of `m`; `toks` and `out`
    /// must hold at least `T` entries, each token with `m.cols()` codes and `m.blocks()` scales
    /// and block sums (read unchecked).
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn exact_avx2<const T: usize>(
        m: &R16Matrix,
        rb: usize,
        toks: &[TokenQ8<'_>],
        out: &mut [[f32; ROWS]],
    ) {
        let nib = m.row_block_nibbles(rb).as_ptr();
        let scales = m.row_block_scales(rb).as_ptr();
        let zeros = m.row_block_zeros(rb);
        let bpg = m.blocks_per_group();
        let dtype = m.spec().scale_dtype;
        let blocks = m.blocks();
        let mask = _mm256_set1_epi8(0x0F);
        let ones = _mm256_set1_epi16(1);
        // Block `b`'s term for every token and half, each handed to
        // `$add(t, half, l, term)` (`l = b % 16`).
        macro_rules! block_terms {
            ($b:expr, $add:expr) => {{
                let b = $b;
                let g = b / bpg;
                for half in 0..2 {
                    // SAFETY: as in `exact_vnni`; each half reads 32 of the 64 bytes of a chunk.
                    unsafe {
                        let tile = nib.add(b * 256 + half * 32);
                        let mut lo = [_mm256_setzero_si256(); 4];
                        let mut hi = [_mm256_setzero_si256(); 4];
                        for c in 0..4 {
                            let w = _mm256_loadu_si256(tile.add(c * 64).cast());
                            lo[c] = _mm256_and_si256(w, mask);
                            hi[c] = _mm256_and_si256(_mm256_srli_epi16(w, 4), mask);
                        }
                        let s = scales8(dtype, scales.add(g * ROWS + half * 8));
                        let z = zeros.map(|z| zeros8(z.as_ptr().add(g * ROWS + half * 8)));
                        for t in 0..T {
                            let q = toks[t].q.as_ptr().cast::<i32>().add(b * 8);
                            // Σ over 8 pmaddubsw results stays within i16: each is at most
                            // 2·15·127 = 3810 in magnitude, eight of them 30480 < 32767.
                            let mut s16 = _mm256_setzero_si256();
                            for c in 0..4 {
                                let ql = _mm256_set1_epi32(q.add(c).read_unaligned());
                                let qh = _mm256_set1_epi32(q.add(4 + c).read_unaligned());
                                s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(lo[c], ql));
                                s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(hi[c], qh));
                            }
                            let acc = _mm256_madd_epi16(s16, ones);
                            let corr = zero_term8(z, *toks[t].qsum.get_unchecked(b));
                            let isum = _mm256_sub_epi32(acc, corr);
                            let sd = _mm256_mul_ps(s, _mm256_set1_ps(*toks[t].d.get_unchecked(b)));
                            let term = _mm256_mul_ps(sd, _mm256_cvtepi32_ps(isum));
                            $add(t, half, b % LANES, term);
                        }
                    }
                }
            }};
        }
        // The partials are not zeroed first (8 KiB at 8 tokens): as in `exact_vnni_multi`,
        // the first sixteen blocks write `+0.0 + term` and missing ones are set to +0.0.
        let zero = _mm256_setzero_ps();
        let mut p = std::mem::MaybeUninit::<[[[__m256; LANES]; 2]; T]>::uninit();
        let at = p.as_mut_ptr().cast::<__m256>();
        let head = blocks.min(LANES);
        for b in 0..head {
            // Inside `p` (t < T, half < 2, l < LANES); the macro's unsafe block covers it.
            block_terms!(b, |t: usize, half: usize, l: usize, term| at
                .add((t * 2 + half) * LANES + l)
                .write(_mm256_add_ps(zero, term)));
        }
        for i in 0..T * 2 {
            for l in head..LANES {
                // SAFETY: as above.
                unsafe { at.add(i * LANES + l).write(zero) };
            }
        }
        // SAFETY: every partial of every token and half was written just above.
        let p = unsafe { p.assume_init_mut() };
        for b in LANES..blocks {
            block_terms!(b, |t: usize, half: usize, l: usize, term| {
                let slot: &mut __m256 = &mut p[t][half][l];
                *slot = _mm256_add_ps(*slot, term);
            });
        }
        for t in 0..T {
            for half in 0..2 {
                let pt = &mut p[t][half];
                let mut w = LANES / 2;
                while w > 0 {
                    for l in 0..w {
                        pt[l] = _mm256_add_ps(pt[l], pt[l + w]);
                    }
                    w /= 2;
                }
                // SAFETY: out[t] has 16 f32; this half writes 8 of them.
                unsafe { _mm256_storeu_ps(out[t].as_mut_ptr().add(half * 8), pt[0]) };
            }
        }
        let _ = BLOCK;
    }

    /// The accurate kernels' per-token accumulator chains: `CH` independent FMA chains per
    /// token break the block's 32-FMA dependency chain when few tokens share the tile (one
    /// token alone would otherwise wait on FMA latency, not on memory).
    ///
    /// AVX-512 accurate kernel for `NT` tokens with `CH` chains each: each nibble lane
    /// dequantized to f32 once per block (`vpermps` from a 16-entry table), FMA with the
    /// broadcast activation for every token, the block's chains summed, then scaled.
    ///
    /// # Safety
    /// The CPU must support AVX-512 F/BW, F16C and FMA; `rb` must be a row block of `m`;
    /// `toks` and `out` must hold at least `NT` entries, each token slice `m.cols()` floats
    /// (read unchecked).
    #[target_feature(enable = "avx512f,avx512bw,f16c,fma")]
    pub(super) unsafe fn accurate_avx512<const NT: usize, const CH: usize>(
        m: &R16Matrix,
        rb: usize,
        toks: &[&[f32]],
        out: &mut [[f32; ROWS]],
    ) {
        let nib = m.row_block_nibbles(rb).as_ptr();
        let scales = m.row_block_scales(rb).as_ptr();
        let zeros = m.row_block_zeros(rb);
        let bpg = m.blocks_per_group();
        let dtype = m.spec().scale_dtype;
        let blocks = m.blocks();
        let ahead = Ahead::new(m, rb);
        // f32(u - 8) for every code u: `vpermps` looks a lane's low 4 bits up in this table, so
        // a nibble becomes its centred float in one instruction (no mask, no convert).
        let table = _mm512_setr_ps(
            -8.0, -7.0, -6.0, -5.0, -4.0, -3.0, -2.0, -1.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0,
        );
        let mut x = [std::ptr::null::<f32>(); NT];
        for t in 0..NT {
            x[t] = toks[t].as_ptr();
        }
        let mut acc = [_mm512_setzero_ps(); NT];
        for b in 0..blocks {
            let g = b / bpg;
            ahead.tile(b);
            // SAFETY: as in `exact_vnni_streams`; each token slice holds K floats.
            unsafe {
                let tile = nib.add(b * 256);
                let s = scales16_512(dtype, scales.add(g * ROWS));
                let mut bs = [[_mm512_setzero_ps(); CH]; NT];
                for c in 0..4 {
                    let w = _mm512_loadu_si512(tile.add(c * 64).cast());
                    for i in 0..4 {
                        let sh = _mm512_srl_epi32(w, _mm_cvtsi32_si128((8 * i) as i32));
                        let lo = _mm512_permutexvar_ps(sh, table);
                        let hi = _mm512_permutexvar_ps(_mm512_srli_epi32(sh, 4), table);
                        let k = (4 * c + i) % CH;
                        for t in 0..NT {
                            let xb = x[t].add(b * BLOCK);
                            let xl = _mm512_set1_ps(*xb.add(4 * c + i));
                            let xh = _mm512_set1_ps(*xb.add(16 + 4 * c + i));
                            bs[t][k] = _mm512_fmadd_ps(lo, xl, bs[t][k]);
                            bs[t][k] = _mm512_fmadd_ps(hi, xh, bs[t][k]);
                        }
                    }
                }
                // Σ(u - z)·x = Σ(u - 8)·x + (8 - z)·Σx: zero points add one term per block.
                let zc = zeros.map(|z| {
                    _mm512_sub_ps(
                        _mm512_set1_ps(8.0),
                        _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(
                            z.as_ptr().add(g * ROWS).cast(),
                        ))),
                    )
                });
                for t in 0..NT {
                    let mut sum = bs[t][0];
                    for ch in 1..CH {
                        sum = _mm512_add_ps(sum, bs[t][ch]);
                    }
                    if let Some(zc) = zc {
                        let xs = block_sum(x[t].add(b * BLOCK));
                        sum = _mm512_fmadd_ps(zc, _mm512_set1_ps(xs), sum);
                    }
                    acc[t] = _mm512_fmadd_ps(s, sum, acc[t]);
                }
            }
        }
        for t in 0..NT {
            // SAFETY: out[t] is 16 f32.
            unsafe { _mm512_storeu_ps(out[t].as_mut_ptr(), acc[t]) };
        }
    }

    /// Σ of the block's 32 activations at `x`.
    ///
    /// # Safety
    /// `x` must point at 32 readable floats.
    #[inline(always)]
    unsafe fn block_sum(x: *const f32) -> f32 {
        // SAFETY: the caller guarantees 32 floats at x.
        unsafe { std::slice::from_raw_parts(x, BLOCK) }.iter().sum()
    }

    /// AVX2 accurate kernel for `NT` tokens with `CH` chains each: both 8-row halves of each
    /// block in turn (the row block is read once, in order); a nibble becomes `f32(u - 8)`
    /// exactly by placing it in the mantissa of 2^23 and subtracting 2^23 + 8.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; otherwise as [`accurate_avx512`].
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn accurate_avx2<const NT: usize, const CH: usize>(
        m: &R16Matrix,
        rb: usize,
        toks: &[&[f32]],
        out: &mut [[f32; ROWS]],
    ) {
        let nib = m.row_block_nibbles(rb).as_ptr();
        let scales = m.row_block_scales(rb).as_ptr();
        let zeros = m.row_block_zeros(rb);
        let bpg = m.blocks_per_group();
        let dtype = m.spec().scale_dtype;
        let blocks = m.blocks();
        let ahead = Ahead::new(m, rb);
        let mask = _mm256_set1_epi32(0x0F);
        let magic = _mm256_set1_epi32(0x4B00_0000);
        let bias = _mm256_set1_ps(8_388_616.0); // 2^23 + 8
        let mut x = [std::ptr::null::<f32>(); NT];
        for t in 0..NT {
            x[t] = toks[t].as_ptr();
        }
        let mut acc = [[_mm256_setzero_ps(); 2]; NT];
        for b in 0..blocks {
            let g = b / bpg;
            ahead.tile(b);
            let mut xs = [0f32; NT];
            if zeros.is_some() {
                for t in 0..NT {
                    // SAFETY: each token slice holds K floats.
                    xs[t] = unsafe { block_sum(x[t].add(b * BLOCK)) };
                }
            }
            for half in 0..2 {
                // SAFETY: tile `b` is 256 bytes of the row block, this half reads 32 of each
                // 64-byte chunk; scales and zeros hold 16 per group; tokens hold K floats.
                unsafe {
                    let tile = nib.add(b * 256 + half * 32);
                    let mut bs = [[_mm256_setzero_ps(); CH]; NT];
                    for c in 0..4 {
                        let w = _mm256_loadu_si256(tile.add(c * 64).cast());
                        for i in 0..4 {
                            let sh = _mm256_srl_epi32(w, _mm_cvtsi32_si128((8 * i) as i32));
                            let to_f32 = |v: __m256i| {
                                let m = _mm256_or_si256(_mm256_and_si256(v, mask), magic);
                                _mm256_sub_ps(_mm256_castsi256_ps(m), bias)
                            };
                            let lo = to_f32(sh);
                            let hi = to_f32(_mm256_srli_epi32(sh, 4));
                            let k = (4 * c + i) % CH;
                            for t in 0..NT {
                                let xb = x[t].add(b * BLOCK);
                                let xl = _mm256_broadcast_ss(&*xb.add(4 * c + i));
                                let xh = _mm256_broadcast_ss(&*xb.add(16 + 4 * c + i));
                                bs[t][k] = _mm256_fmadd_ps(lo, xl, bs[t][k]);
                                bs[t][k] = _mm256_fmadd_ps(hi, xh, bs[t][k]);
                            }
                        }
                    }
                    let s = scales8(dtype, scales.add(g * ROWS + half * 8));
                    let zc = zeros.map(|z| {
                        let z = zeros8(z.as_ptr().add(g * ROWS + half * 8));
                        _mm256_sub_ps(_mm256_set1_ps(8.0), _mm256_cvtepi32_ps(z))
                    });
                    for t in 0..NT {
                        let mut sum = bs[t][0];
                        for ch in 1..CH {
                            sum = _mm256_add_ps(sum, bs[t][ch]);
                        }
                        if let Some(zc) = zc {
                            sum = _mm256_fmadd_ps(zc, _mm256_set1_ps(xs[t]), sum);
                        }
                        acc[t][half] = _mm256_fmadd_ps(s, sum, acc[t][half]);
                    }
                }
            }
        }
        for t in 0..NT {
            for half in 0..2 {
                // SAFETY: out[t] has 16 f32; this half writes 8 of them.
                unsafe { _mm256_storeu_ps(out[t].as_mut_ptr().add(half * 8), acc[t][half]) };
            }
        }
    }
}
