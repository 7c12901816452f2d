//! AMX-INT8 exact kernel for compute-bound work (prefill, large decode batches), bit-identical
//! to the scalar contract.
//!
//! Why this exists: with many tokens per expert the VNNI kernels are bound by their
//! multiply-adds, and AMX does eight times as many per cycle. The contract still decides the
//! arithmetic: per 32-element block an exact i32 dot, then `(s·d)·f32(isum)` added to partial
//! `b % 16`, then the halving tree. So every block is its own K = 32 tile operation:
//!
//! ```text
//! per row block rb (16 output rows) and K block b, for up to 16 tokens:
//!   B (8 rows × 64 B, VNNI layout) = the R16 tile widened to i8 (code − zero point): rows 0..4
//!     are the low nibbles of the tile's four 64-byte chunks, rows 4..8 the high nibbles (the R16
//!     layout is already the VNNI order: chunk c, byte 4r+i = row r, element 4c+i / 16+4c+i)
//!   A (tokens × 32 B) = the tokens' int8 codes of block b, straight from their rows (stride)
//!   C (tokens × 16 i32) = 0; TDPBSSD C, A, B; TILESTORED C  → C[t][r] = the exact isum
//!   partial[t][b % 16][r] += (s[r]·d[t][b]) · f32(C[t][r])     (f32, the contract's order)
//! ```
//!
//! |isum| ≤ 32·15·128 < 2^16, so the i32 never wraps and its f32 conversion is exact; the f32
//! part is the same source for both tile implementations ([`tiles::Amx`] and
//! [`tiles::Emulator`]), so the emulator tests the kernel's tiling and arithmetic on any
//! machine and the hardware test compares both on AMX machines.
//!
//! PERF-CRITICAL: no allocation, no locking, no logging in this module.

pub mod tiles;

use crate::layout::{R16Matrix, ROWS};
use expertmesh_quant::contract::LANES;
use expertmesh_quant::format::{BLOCK, ScaleDtype};
use tiles::{Amx, AmxUnavailable, Emulator, TileCfg, Tiles};

/// Tokens per AMX call (the A tile's 16 rows).
pub const AMX_TOKEN_TILE: usize = 16;

/// Up to [`AMX_TOKEN_TILE`] tokens' quantized activations as the A tile reads them: token
/// `t`'s 32 int8 codes of block `b` at `q[t·q_stride + b·q_block..]` and its K/32 block scales
/// at `d[t·d_stride..]` (host memory). Row-major rows have `q_block` = 32 and `q_stride` ≥ K;
/// the backend gathers a tile block-major (`q_stride` = 32, `q_block` = 32·tokens) so each A
/// tile is one contiguous 512-byte read instead of 16 rows K bytes apart.
#[derive(Clone, Copy, Debug)]
pub struct TokenRows<'a> {
    /// int8 codes, token `t`'s block `b` at `t·q_stride + b·q_block`.
    pub q: &'a [i8],
    /// Bytes between two tokens' codes of one block.
    pub q_stride: usize,
    /// Bytes between one token's consecutive blocks.
    pub q_block: usize,
    /// Per-block f32 scales, token `t` at `t·d_stride`.
    pub d: &'a [f32],
    /// Floats between two tokens' scales.
    pub d_stride: usize,
    /// Tokens (1..=16).
    pub tokens: usize,
}

impl TokenRows<'_> {
    /// Panics unless `tokens` is 1..=16 and every token's `k` codes and `k/32` scales lie
    /// inside the slices (the kernel then reads without checks).
    fn check(&self, k: usize) {
        let t = self.tokens;
        assert!(
            (1..=AMX_TOKEN_TILE).contains(&t),
            "AMX kernel: {t} tokens (1..=16)"
        );
        assert!(
            self.q_block >= BLOCK
                && self.q.len() >= (t - 1) * self.q_stride + (k / BLOCK - 1) * self.q_block + BLOCK,
            "AMX kernel: codes too short"
        );
        assert!(
            self.d.len() >= (t - 1) * self.d_stride + k / BLOCK,
            "AMX kernel: scales too short"
        );
    }
}

/// Tile numbers: two sets (A activations, B widened weights, C i32 results), used by
/// alternate blocks so the next block's tile operations run while this block's results are
/// combined.
const SET0: (u8, u8, u8) = (0, 2, 4);
const SET1: (u8, u8, u8) = (1, 3, 5);

/// Partial sums `[token][b % 16][row]` of one call (16 KiB, on the stack).
/// Written lane by lane as lanes end ([`Glue::flush`]) and read only where written
/// ([`Glue::tree`]), so it is never zeroed.
type Partials = std::mem::MaybeUninit<[[[f32; ROWS]; LANES]; AMX_TOKEN_TILE]>;

/// The non-tile work of the kernel: widening a weight tile into the B staging and adding a
/// block's terms to the partials. Two implementations with the same arithmetic: [`Portable`]
/// (any CPU; with the emulator everywhere) and `Avx512` (with the instructions, and with the
/// emulator on AVX-512 machines).
trait Glue {
    /// The zero points of one group, replicated per B dword lane (byte `4r + i` = row `r`).
    type Z: Copy;
    /// The 16 row scales of one group as f32.
    type S: Copy;
    /// Group `g`'s zero points (8 without zero points).
    ///
    /// # Safety
    /// `z`, when present, holds at least `16g + 16` bytes; the CPU runs the implementation's
    /// instructions.
    unsafe fn zeros(z: Option<&[u8]>, g: usize) -> Self::Z;
    /// Group `g`'s scales.
    ///
    /// # Safety
    /// `scales` holds at least `16g + 16` values; the CPU runs the implementation's instructions.
    unsafe fn scales(dtype: ScaleDtype, scales: &[u16], g: usize) -> Self::S;
    /// B staging ← the R16 tile widened to i8 `code − z` (low nibbles, then high nibbles).
    ///
    /// # Safety
    /// The CPU runs the implementation's instructions.
    unsafe fn widen(tile: &[u8; 256], z: Self::Z, out: &mut [i8; 512]);
    /// One token's 16 row partials (a register on AVX-512).
    type V: Copy;
    /// Zero partials.
    ///
    /// # Safety
    /// The CPU runs the implementation's instructions.
    unsafe fn zero_acc() -> Self::V;
    /// `acc[t] += (s · d[t·d_stride]) · f32(c[t])` for every token `t < mt`.
    ///
    /// # Safety
    /// `d` points at `mt` floats `d_stride` apart (host memory); the CPU runs the
    /// implementation's instructions.
    unsafe fn combine(
        acc: &mut [Self::V; AMX_TOKEN_TILE],
        c: &[[i32; ROWS]; AMX_TOKEN_TILE],
        s: Self::S,
        d: *const f32,
        d_stride: usize,
        mt: usize,
    );
    /// The contract's halving tree over one token's 16 partials (lane `l` += lane `l + w`
    /// for w = 8, 4, 2, 1), row by row; lanes from `lanes` on were never written and count
    /// as +0.0, as the contract's zero-initialized partials do.
    ///
    /// # Safety
    /// `p` points at the token's `[16 lanes][16 rows]` f32 partials (host memory), lanes
    /// below `lanes` written; the CPU runs the implementation's instructions.
    unsafe fn tree(p: *const f32, lanes: usize) -> [f32; ROWS];
    /// Partials `[t][lane]` = `acc[t]` for `t < mt`, and the accumulators back to zero.
    ///
    /// # Safety
    /// `p` points at `[16 tokens][16 lanes][16 rows]` writable f32 (host memory); the CPU
    /// runs the implementation's instructions.
    unsafe fn flush(acc: &mut [Self::V; AMX_TOKEN_TILE], p: *mut f32, lane: usize, mt: usize);
}

/// Plain Rust glue.
struct Portable;

impl Glue for Portable {
    type Z = [i8; 64];
    type S = [f32; ROWS];

    #[inline(always)]
    unsafe fn zeros(z: Option<&[u8]>, g: usize) -> Self::Z {
        std::array::from_fn(|i| z.map_or(8, |z| z[g * ROWS + i / 4]) as i8)
    }

    #[inline(always)]
    unsafe fn scales(dtype: ScaleDtype, scales: &[u16], g: usize) -> Self::S {
        std::array::from_fn(|r| dtype.to_f32(scales[g * ROWS + r]))
    }

    #[inline(always)]
    unsafe fn widen(tile: &[u8; 256], z: Self::Z, out: &mut [i8; 512]) {
        for i in 0..256 {
            out[i] = (tile[i] & 0x0F) as i8 - z[i % 64];
            out[256 + i] = (tile[i] >> 4) as i8 - z[i % 64];
        }
    }

    type V = [f32; ROWS];

    #[inline(always)]
    unsafe fn tree(p: *const f32, lanes: usize) -> [f32; ROWS] {
        let mut p: [[f32; ROWS]; LANES] = std::array::from_fn(|l| {
            if l < lanes {
                // SAFETY: lanes below `lanes` are written (caller).
                unsafe { p.add(l * ROWS).cast::<[f32; ROWS]>().read() }
            } else {
                [0.0; ROWS]
            }
        });
        crate::kernels::halving_tree(&mut p)
    }

    #[inline(always)]
    unsafe fn zero_acc() -> Self::V {
        [0.0; ROWS]
    }

    #[inline(always)]
    unsafe fn combine(
        acc: &mut [Self::V; AMX_TOKEN_TILE],
        c: &[[i32; ROWS]; AMX_TOKEN_TILE],
        s: Self::S,
        d: *const f32,
        d_stride: usize,
        mt: usize,
    ) {
        for (t, (at, ct)) in acc.iter_mut().zip(c).take(mt).enumerate() {
            // SAFETY: t < mt (caller's bound on `d`).
            let dt = unsafe { *d.add(t * d_stride) };
            for r in 0..ROWS {
                at[r] += (s[r] * dt) * ct[r] as f32;
            }
        }
    }

    #[inline(always)]
    unsafe fn flush(acc: &mut [Self::V; AMX_TOKEN_TILE], p: *mut f32, lane: usize, mt: usize) {
        for (t, at) in acc.iter_mut().enumerate().take(mt) {
            // SAFETY: inside the partials (caller).
            unsafe {
                p.add((t * LANES + lane) * ROWS)
                    .cast::<[f32; ROWS]>()
                    .write(*at)
            };
            *at = [0.0; ROWS];
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    //! The glue on AVX-512 F/BW: every lane performs [`super::Portable`]'s operations.
    use super::{AMX_TOKEN_TILE, Glue, LANES, ROWS};
    use expertmesh_quant::format::ScaleDtype;
    use std::arch::x86_64::*;

    /// Callable only from code compiled with AVX-512 F/BW enabled on a CPU that has them.
    pub(super) struct Avx512;

    impl Glue for Avx512 {
        type Z = __m512i;
        type S = __m512;

        #[inline(always)]
        unsafe fn zeros(z: Option<&[u8]>, g: usize) -> __m512i {
            // SAFETY: z holds 16g + 16 bytes (caller); AVX-512 F (caller).
            unsafe {
                match z {
                    None => _mm512_set1_epi8(8),
                    Some(z) => _mm512_mullo_epi32(
                        _mm512_cvtepu8_epi32(_mm_loadu_si128(z.as_ptr().add(g * ROWS).cast())),
                        _mm512_set1_epi32(0x0101_0101),
                    ),
                }
            }
        }

        #[inline(always)]
        unsafe fn scales(dtype: ScaleDtype, scales: &[u16], g: usize) -> __m512 {
            debug_assert!(scales.len() >= g * ROWS + ROWS);
            // SAFETY: 16 values at 16g (caller).
            unsafe { crate::kernels::x86::scales16_512(dtype, scales.as_ptr().add(g * ROWS)) }
        }

        #[inline(always)]
        unsafe fn widen(tile: &[u8; 256], z: __m512i, out: &mut [i8; 512]) {
            // SAFETY: 256 bytes in, 512 out; AVX-512 F/BW (caller).
            unsafe {
                let mask = _mm512_set1_epi8(0x0F);
                for c in 0..4 {
                    let w = _mm512_loadu_si512(tile.as_ptr().add(64 * c).cast());
                    let lo = _mm512_sub_epi8(_mm512_and_si512(w, mask), z);
                    let hi = _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(w, 4), mask), z);
                    _mm512_storeu_si512(out.as_mut_ptr().add(64 * c).cast(), lo);
                    _mm512_storeu_si512(out.as_mut_ptr().add(256 + 64 * c).cast(), hi);
                }
            }
        }

        type V = __m512;

        #[inline(always)]
        unsafe fn tree(p: *const f32, lanes: usize) -> [f32; ROWS] {
            // SAFETY: AVX-512 F (caller); lanes below `lanes` are written 16-float rows.
            unsafe {
                let mut v: [__m512; LANES] = std::array::from_fn(|l| {
                    if l < lanes {
                        _mm512_loadu_ps(p.add(l * ROWS))
                    } else {
                        _mm512_setzero_ps()
                    }
                });
                let mut w = LANES / 2;
                while w > 0 {
                    for l in 0..w {
                        v[l] = _mm512_add_ps(v[l], v[l + w]);
                    }
                    w /= 2;
                }
                let mut out = [0f32; ROWS];
                _mm512_storeu_ps(out.as_mut_ptr(), v[0]);
                out
            }
        }

        #[inline(always)]
        unsafe fn zero_acc() -> __m512 {
            // SAFETY: AVX-512 F (caller).
            unsafe { _mm512_setzero_ps() }
        }

        #[inline(always)]
        unsafe fn combine(
            acc: &mut [__m512; AMX_TOKEN_TILE],
            c: &[[i32; ROWS]; AMX_TOKEN_TILE],
            s: __m512,
            d: *const f32,
            d_stride: usize,
            mt: usize,
        ) {
            // SAFETY: t < mt ≤ 16 (caller's bound on `d`); rows of 16 values; AVX-512 F.
            // The loop has a constant trip count so it unrolls and `acc` stays in registers.
            unsafe {
                for t in 0..AMX_TOKEN_TILE {
                    if t < mt {
                        let ct = _mm512_loadu_si512(c[t].as_ptr().cast());
                        let sd = _mm512_mul_ps(s, _mm512_set1_ps(*d.add(t * d_stride)));
                        acc[t] = _mm512_add_ps(acc[t], _mm512_mul_ps(sd, _mm512_cvtepi32_ps(ct)));
                    }
                }
            }
        }

        #[inline(always)]
        unsafe fn flush(acc: &mut [__m512; AMX_TOKEN_TILE], p: *mut f32, lane: usize, mt: usize) {
            // SAFETY: 16 floats per (token, lane) inside the partials (caller); AVX-512 F.
            unsafe {
                for t in 0..AMX_TOKEN_TILE {
                    if t < mt {
                        _mm512_storeu_ps(p.add((t * LANES + lane) * ROWS), acc[t]);
                        acc[t] = _mm512_setzero_ps();
                    }
                }
            }
        }
    }
}

/// Widened B tiles in flight: block `b` is widened [`AHEAD`] iterations before its tile
/// load, so the load finds the stores committed (a tile load right after the vector stores
/// that wrote its bytes waits for them).
const RING: usize = 4;
/// Blocks widened ahead of the one whose tiles are issued next (`AHEAD + 2 ≤ RING`).
const AHEAD: usize = 2;

/// The order blocks are visited in: lane by lane (`b % 16` = 0, then 1, ...), ascending
/// within a lane, so one lane's partials stay in registers until the lane ends; `None` after
/// the last block.
#[derive(Clone, Copy)]
struct Visit {
    /// The block, and its position in the visiting order.
    b: usize,
    i: usize,
}

impl Visit {
    #[inline(always)]
    fn next(self, blocks: usize) -> Option<Visit> {
        let b = if self.b + LANES < blocks {
            self.b + LANES
        } else if self.b % LANES + 1 < LANES.min(blocks) {
            self.b % LANES + 1
        } else {
            return None;
        };
        Some(Visit { b, i: self.i + 1 })
    }
}

/// Widen block `v.b` (if any) into ring slot `v.i % RING`.
///
/// # Safety
/// The CPU runs `G`'s instructions.
#[inline(always)]
unsafe fn widen<G: Glue>(
    nib: &[u8],
    zeros: Option<&[u8]>,
    bpg: usize,
    v: Option<Visit>,
    ring: &mut [[i8; 512]; RING],
) {
    if let Some(v) = v {
        let tile: &[u8; 256] = nib[v.b * 256..][..256].try_into().expect("256-byte tile");
        // SAFETY: the caller's contract; the zero points of block b's group exist.
        unsafe { G::widen(tile, G::zeros(zeros, v.b / bpg), &mut ring[v.i % RING]) };
    }
}

/// Issue block `b`'s tile operations on set `(A, B, C)`: B from its ring slot, the i32
/// results stored to `c`.
///
/// # Safety
/// As for [`exact_tiles`]; tiles `A`, `B`, `C` are configured as the kernel configures them,
/// and block `b` exists and has been widened.
#[inline(always)]
unsafe fn issue<T: Tiles, const A: u8, const B: u8, const C: u8>(
    t: &mut T,
    x: &TokenRows<'_>,
    v: Visit,
    ring: &[[i8; 512]; RING],
    c: &mut [[i32; ROWS]; AMX_TOKEN_TILE],
) {
    // SAFETY: the caller's contract; A reads `tokens` rows of 32 bytes at stride q_stride
    // starting inside the codes (checked by `TokenRows::check`); B reads a 512-byte slot;
    // C writes tokens × 64 bytes into `c` (16 × 64 bytes).
    unsafe {
        t.zero::<C>();
        t.load::<A>(x.q.as_ptr().add(v.b * x.q_block).cast(), x.q_stride);
        t.load::<B>(ring[v.i % RING].as_ptr().cast(), 64);
        t.dpbssd::<C, A, B>();
        t.store::<C>(c.as_mut_ptr().cast(), ROWS * 4);
    }
}

/// 64-byte aligned per-call staging: the ring of widened B tiles and one stored C tile per
/// tile set.
#[repr(C, align(64))]
struct Stage {
    ring: [[i8; 512]; RING],
    c: [[[i32; ROWS]; AMX_TOKEN_TILE]; 2],
}

/// The tiles of both sets for `tokens` tokens: A `tokens × 32` bytes, B 8 × 64 (a widened
/// block of 16 rows, VNNI layout), C `tokens × 16` i32.
fn tile_config(tokens: usize) -> TileCfg {
    let (rows, c_colsb) = (tokens as u8, (ROWS * 4) as u16);
    TileCfg::palette1()
        .tile(SET0.0, rows, BLOCK as u16)
        .tile(SET1.0, rows, BLOCK as u16)
        .tile(SET0.1, 8, 64)
        .tile(SET1.1, 8, 64)
        .tile(SET0.2, rows, c_colsb)
        .tile(SET1.2, rows, c_colsb)
}

/// The kernel over any tile and glue implementation; see the module docs for the sequence.
/// Blocks alternate between two tile sets: block `b + 1`'s tile operations are issued before
/// block `b`'s results are combined, and weights are widened [`AHEAD`] blocks earlier still.
///
/// # Safety
/// `x` must have passed [`TokenRows::check`] for `m.cols()`, and `rb` must be a row block of
/// `m`; with [`Amx`] the caller must hold one (permission granted); the CPU must run `G`'s
/// instructions.
#[inline(always)]
unsafe fn exact_tiles<T: Tiles, G: Glue>(
    t: &mut T,
    m: &R16Matrix,
    rb: usize,
    x: &TokenRows<'_>,
    out: &mut [[f32; ROWS]],
) {
    let mt = x.tokens;
    let cfg = tile_config(mt);
    let nib = m.row_block_nibbles(rb);
    let scales = m.row_block_scales(rb);
    let zeros = m.row_block_zeros(rb);
    let (bpg, blocks) = (m.blocks_per_group(), m.blocks());
    let dtype = m.spec().scale_dtype;
    let mut partials = Partials::uninit();
    let p = partials.as_mut_ptr().cast::<f32>();
    let mut st = Stage {
        ring: [[0; 512]; RING],
        c: [[[0; ROWS]; AMX_TOKEN_TILE]; 2],
    };
    let Stage { ring, c } = &mut st;
    let [c0, c1] = c;
    let d = x.d.as_ptr();
    // SAFETY: the CPU runs G's instructions (caller).
    let mut acc = [unsafe { G::zero_acc() }; AMX_TOKEN_TILE];
    let adv = |v: Option<Visit>| v.and_then(|v| v.next(blocks));
    let first = Some(Visit { b: 0, i: 0 });
    let mut wv = first;
    // Cursors in visiting order: the block to widen, to issue, to combine.
    // SAFETY: the configuration is valid (rows ≤ 16, colsb ≤ 64); the caller holds the
    // tiles; blocks are < `blocks` and are widened before they are issued; `d` of block b
    // holds `mt` scales `d_stride` apart (checked).
    unsafe {
        t.config(&cfg);
        for _ in 0..=AHEAD {
            widen::<G>(nib, zeros, bpg, wv, ring);
            wv = adv(wv);
        }
        let mut cv = first;
        issue::<T, { SET0.0 }, { SET0.1 }, { SET0.2 }>(t, x, Visit { b: 0, i: 0 }, ring, c0);
        // One visit: widen ahead, issue the next visit's tiles on the other set, combine this
        // visit's stored results (on `$c`), and store the partials when its lane ends.
        macro_rules! visit {
            ($v:expr, $next_set:expr, $c:expr, $c_next:expr) => {{
                let v: Visit = $v;
                let next = v.next(blocks);
                widen::<G>(nib, zeros, bpg, wv, ring);
                wv = adv(wv);
                if let Some(n) = next {
                    issue::<T, { $next_set.0 }, { $next_set.1 }, { $next_set.2 }>(
                        t, x, n, ring, $c_next,
                    );
                }
                let s = G::scales(dtype, scales, v.b / bpg);
                G::combine(&mut acc, $c, s, d.add(v.b), x.d_stride, mt);
                if next.is_none_or(|n| n.b % LANES != v.b % LANES) {
                    G::flush(&mut acc, p, v.b % LANES, mt);
                }
                next
            }};
        }
        // Two visits per iteration: set 0's results are combined while set 1 computes, and
        // the other way round (tile numbers are constants, so the sets alternate by code).
        while let Some(v0) = cv {
            let Some(v1) = visit!(v0, SET1, c0, c1) else {
                break;
            };
            cv = visit!(v1, SET0, c1, c0);
        }
        t.release();
    }
    for (t, o) in out.iter_mut().enumerate().take(mt) {
        // SAFETY: every lane below min(16, blocks) of tokens < mt was flushed; the CPU runs
        // G's instructions (caller).
        *o = unsafe { G::tree(p.add(t * LANES * ROWS), LANES.min(blocks)) };
    }
}

/// Exact mode on the AMX instructions: rows `16rb..16rb+16` of `m` for each token of `x`,
/// written to `out[t]`. Bit-identical to [`crate::kernels::rowblock_exact`] on every ISA.
///
/// Errors when this process cannot run AMX (then use another [`crate::kernels::Isa`]).
pub fn rowblock_exact_amx(
    m: &R16Matrix,
    rb: usize,
    x: &TokenRows<'_>,
    out: &mut [[f32; ROWS]],
) -> Result<(), AmxUnavailable> {
    let mut amx = Amx::new()?;
    x.check(m.cols());
    assert!(rb < m.row_blocks() && out.len() >= x.tokens);
    #[cfg(target_arch = "x86_64")]
    {
        if crate::kernels::Isa::Avx512Vnni.supported_cached() {
            // SAFETY: AMX permission is held (`amx`), AVX-512 F/BW are present (checked), `x`
            // was checked against K and `rb` is in range.
            unsafe { exact_avx512(&mut amx, m, rb, x, out) };
            return Ok(());
        }
    }
    // SAFETY: as above, with the portable glue.
    unsafe { exact_tiles::<_, Portable>(&mut amx, m, rb, x, out) };
    Ok(())
}

/// [`exact_tiles`] with the AVX-512 glue, on either tile implementation.
///
/// # Safety
/// As for [`exact_tiles`]; the CPU must support AVX-512 F/BW (and F16C, which every AVX-512
/// CPU has, for f16 scales).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
unsafe fn exact_avx512<T: Tiles>(
    t: &mut T,
    m: &R16Matrix,
    rb: usize,
    x: &TokenRows<'_>,
    out: &mut [[f32; ROWS]],
) {
    // SAFETY: forwarded from the caller.
    unsafe { exact_tiles::<_, avx512::Avx512>(t, m, rb, x, out) }
}

/// Which glue [`rowblock_exact_emulated`] runs with the emulator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EmulatedGlue {
    /// Plain Rust (any CPU).
    Portable,
    /// The AVX-512 glue the instructions run with (AVX-512 CPUs only; falls back to portable
    /// elsewhere). Returns whether it ran.
    Avx512,
}

/// Exact mode through the tile emulator: the same kernel source as [`rowblock_exact_amx`],
/// runnable on any machine (slow; for tests). Returns the glue that ran.
pub fn rowblock_exact_emulated(
    m: &R16Matrix,
    rb: usize,
    x: &TokenRows<'_>,
    out: &mut [[f32; ROWS]],
    glue: EmulatedGlue,
) -> EmulatedGlue {
    x.check(m.cols());
    assert!(rb < m.row_blocks() && out.len() >= x.tokens);
    let mut emu = Emulator::new();
    #[cfg(target_arch = "x86_64")]
    {
        if glue == EmulatedGlue::Avx512 && crate::kernels::Isa::Avx512Vnni.supported_cached() {
            // SAFETY: AVX-512 F/BW present (checked); `x` was checked against K and `rb` is
            // in range; the emulator checks its own shapes and panics where hardware faults.
            unsafe { exact_avx512(&mut emu, m, rb, x, out) };
            return EmulatedGlue::Avx512;
        }
    }
    let _ = glue;
    // SAFETY: as above, with the portable glue.
    unsafe { exact_tiles::<_, Portable>(&mut emu, m, rb, x, out) };
    EmulatedGlue::Portable
}

/// int8 operations (2 per multiply-add) one iteration of [`contract_loop`] does: one block of
/// 16 tokens × 16 rows × 32.
pub const CONTRACT_LOOP_OPS: u64 = 2 * (AMX_TOKEN_TILE * ROWS * BLOCK) as u64;

/// The limit of any exact AMX kernel under the contract, run for `iters` blocks on this
/// thread: per block what the contract cannot do without (zero C, load A and B from L1, one
/// K = 32 `TDPBSSD`, store C, and per token the f32 combine `acc += (s·d)·f32(isum)`), two
/// tile sets alternating as in the kernel, and nothing the kernel also does (no weight
/// widening, no streaming from memory). Returns the blocks done (`iters` rounded up to even;
/// [`CONTRACT_LOOP_OPS`] each) and a value the optimizer must keep. Benches measure it beside
/// the kernel (`bench kernels`: the compute limit of the rows the AMX kernel runs).
pub fn contract_loop(iters: usize) -> Result<(u64, f32), AmxUnavailable> {
    let mut amx = Amx::new()?;
    #[cfg(target_arch = "x86_64")]
    {
        if crate::kernels::Isa::Avx512Vnni.supported_cached() {
            // SAFETY: AMX permission is held (`amx`); AVX-512 F/BW present (checked).
            let sink = unsafe { contract_loop_avx512(&mut amx, iters) };
            return Ok((2 * iters.div_ceil(2) as u64, sink));
        }
    }
    let _ = (&mut amx, iters);
    Err(AmxUnavailable::NoCpuSupport)
}

/// [`contract_loop`] with the AVX-512 glue.
///
/// # Safety
/// The caller holds `amx`; the CPU supports AVX-512 F/BW.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
unsafe fn contract_loop_avx512(amx: &mut Amx, iters: usize) -> f32 {
    use avx512::Avx512 as G;
    #[repr(C, align(64))]
    struct Inputs {
        a: [[i8; 512]; 2],
        ring: [[i8; 512]; RING],
        c: [[[i32; ROWS]; AMX_TOKEN_TILE]; 2],
    }
    let mut st = Inputs {
        a: [[3; 512]; 2],
        ring: [[5; 512]; RING],
        c: [[[0; ROWS]; AMX_TOKEN_TILE]; 2],
    };
    let d = [0.5f32; AMX_TOKEN_TILE];
    let mut partials = [[[0f32; ROWS]; LANES]; AMX_TOKEN_TILE];
    let p = partials.as_mut_ptr().cast::<f32>();
    let cfg = tile_config(AMX_TOKEN_TILE);
    let Inputs { a, ring, c } = &mut st;
    let [c0, c1] = c;
    // Two A tiles (16 tokens × 32 B, contiguous), `q_block` 512: blocks 0 and 1 alternate.
    let x = TokenRows {
        q: a.as_flattened(),
        q_stride: BLOCK,
        q_block: 512,
        d: &d,
        d_stride: 1,
        tokens: AMX_TOKEN_TILE,
    };
    // SAFETY: AVX-512 and `amx` (caller); every tile op reads or writes the 64-byte aligned
    // buffers above (A: 16 rows × 32 B of `a[v.b]`, B: a ring slot, C: `c0`/`c1`).
    unsafe {
        let scales = [0x3f80u16; ROWS]; // bf16 1.0
        let s = G::scales(ScaleDtype::Bf16, &scales, 0);
        let mut acc = [G::zero_acc(); AMX_TOKEN_TILE];
        amx.config(&cfg);
        for i in 0..iters.div_ceil(2) {
            let v0 = Visit { b: 0, i: 2 * i };
            let v1 = Visit { b: 1, i: 2 * i + 1 };
            issue::<Amx, { SET1.0 }, { SET1.1 }, { SET1.2 }>(amx, &x, v1, ring, c1);
            G::combine(&mut acc, c0, s, d.as_ptr(), 1, AMX_TOKEN_TILE);
            issue::<Amx, { SET0.0 }, { SET0.1 }, { SET0.2 }>(amx, &x, v0, ring, c0);
            G::combine(&mut acc, c1, s, d.as_ptr(), 1, AMX_TOKEN_TILE);
            if i % LANES == LANES - 1 {
                G::flush(&mut acc, p, i / LANES % LANES, AMX_TOKEN_TILE);
            }
        }
        amx.release();
        G::flush(&mut acc, p, 0, AMX_TOKEN_TILE);
    }
    partials.iter().flatten().flatten().sum()
}
