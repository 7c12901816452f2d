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
use expertmesh_quant::format::BLOCK;
use tiles::{Amx, AmxUnavailable, Emulator, TileCfg, Tiles};

/// Tokens per AMX call (the A tile's 16 rows).
pub const AMX_TOKEN_TILE: usize = 16;

/// Tile numbers: A (activations), B (widened weights), C (i32 results).
const TA: u8 = 0;
const TB: u8 = 2;
const TC: u8 = 4;

/// Up to [`AMX_TOKEN_TILE`] tokens' quantized activations as the A tile reads them: token `t`'s
/// K int8 codes at `q[t·q_stride..]` and its K/32 block scales at `d[t·d_stride..]` (host
/// memory; rows need not be contiguous, only evenly strided).
#[derive(Clone, Copy, Debug)]
pub struct TokenRows<'a> {
    /// int8 codes, token `t` at `t·q_stride`.
    pub q: &'a [i8],
    /// Bytes between two tokens' codes.
    pub q_stride: usize,
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
            self.q.len() >= (t - 1) * self.q_stride + k,
            "AMX kernel: codes too short"
        );
        assert!(
            self.d.len() >= (t - 1) * self.d_stride + k / BLOCK,
            "AMX kernel: scales too short"
        );
    }
}

/// 64-byte aligned per-call staging: the widened B tile and the stored C tile.
#[repr(C, align(64))]
struct Stage {
    b: [i8; 512],
    c: [[i32; ROWS]; AMX_TOKEN_TILE],
}

/// The kernel over any tile implementation; see the module docs for the sequence.
///
/// # Safety
/// `x` must have passed [`TokenRows::check`] for `m.cols()`, and `rb` must be a row block of
/// `m`; with [`Amx`] the caller must hold one (permission granted) and the CPU must run the
/// AVX-512 code this is inlined into.
#[inline(always)]
unsafe fn exact_tiles<T: Tiles>(
    t: &mut T,
    m: &R16Matrix,
    rb: usize,
    x: &TokenRows<'_>,
    out: &mut [[f32; ROWS]],
) {
    let mt = x.tokens;
    let cfg = TileCfg::palette1()
        .tile(TA, mt as u8, BLOCK as u16)
        .tile(TB, 8, 64)
        .tile(TC, mt as u8, (ROWS * 4) as u16);
    let nib = m.row_block_nibbles(rb);
    let scales = m.row_block_scales(rb);
    let zeros = m.row_block_zeros(rb);
    let bpg = m.blocks_per_group();
    let dtype = m.spec().scale_dtype;
    let mut p = [[[0f32; ROWS]; LANES]; AMX_TOKEN_TILE];
    let mut st = Stage {
        b: [0; 512],
        c: [[0; ROWS]; AMX_TOKEN_TILE],
    };
    let mut zrep = [8i8; 64];
    let mut s = [0f32; ROWS];
    // SAFETY: the configuration is valid (rows ≤ 16, colsb ≤ 64); the caller holds the tiles.
    unsafe { t.config(&cfg) };
    for b in 0..m.blocks() {
        let g = b / bpg;
        if b % bpg == 0 {
            for (r, sr) in s.iter_mut().enumerate() {
                *sr = dtype.to_f32(scales[g * ROWS + r]);
            }
            if let Some(z) = zeros {
                for (i, zr) in zrep.iter_mut().enumerate() {
                    *zr = z[g * ROWS + i / 4] as i8;
                }
            }
        }
        let tile: &[u8; 256] = nib[b * 256..][..256].try_into().expect("256-byte tile");
        for i in 0..256 {
            let byte = tile[i];
            st.b[i] = (byte & 0x0F) as i8 - zrep[i % 64];
            st.b[256 + i] = (byte >> 4) as i8 - zrep[i % 64];
        }
        // SAFETY: A reads `mt` rows of 32 bytes at stride q_stride starting inside the codes
        // (checked by `TokenRows::check`); B reads 8 × 64 staged bytes; C writes mt × 64 bytes
        // into `st.c` (16 × 64 bytes).
        unsafe {
            t.zero::<TC>();
            t.load::<TA>(x.q.as_ptr().add(b * BLOCK).cast(), x.q_stride);
            t.load::<TB>(st.b.as_ptr().cast(), 64);
            t.dpbssd::<TC, TA, TB>();
            t.store::<TC>(st.c.as_mut_ptr().cast(), ROWS * 4);
        }
        let lane = b % LANES;
        for (tok, (pt, c)) in p.iter_mut().zip(&st.c).take(mt).enumerate() {
            // SAFETY: tok < tokens and b < K/32: inside the scales (checked).
            let d = unsafe { *x.d.get_unchecked(tok * x.d_stride + b) };
            let acc = &mut pt[lane];
            for r in 0..ROWS {
                acc[r] += (s[r] * d) * c[r] as f32;
            }
        }
    }
    // SAFETY: as for `config`.
    unsafe { t.release() };
    for (o, pt) in out.iter_mut().zip(p.iter_mut()).take(mt) {
        let mut w = LANES / 2;
        while w > 0 {
            for l in 0..w {
                for r in 0..ROWS {
                    pt[l][r] += pt[l + w][r];
                }
            }
            w /= 2;
        }
        *o = pt[0];
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
        if crate::kernels::Isa::Avx512Vnni.supported() {
            // SAFETY: AMX permission is held (`amx`), AVX-512 F/BW are present (checked), `x`
            // was checked against K and `rb` is in range.
            unsafe { exact_amx_avx512(&mut amx, m, rb, x, out) };
            return Ok(());
        }
    }
    // SAFETY: as above, without the AVX-512 code generation.
    unsafe { exact_tiles(&mut amx, m, rb, x, out) };
    Ok(())
}

/// [`exact_tiles`] on the instructions, compiled with AVX-512 so the widening and the f32
/// combine are vectorized.
///
/// # Safety
/// As for [`exact_tiles`] with [`Amx`]; the CPU must support AVX-512 F/BW.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn exact_amx_avx512(
    amx: &mut Amx,
    m: &R16Matrix,
    rb: usize,
    x: &TokenRows<'_>,
    out: &mut [[f32; ROWS]],
) {
    // SAFETY: forwarded from the caller.
    unsafe { exact_tiles(amx, m, rb, x, out) }
}

/// Exact mode through the tile emulator: the same kernel source as [`rowblock_exact_amx`],
/// runnable on any machine (slow; for tests).
pub fn rowblock_exact_emulated(
    m: &R16Matrix,
    rb: usize,
    x: &TokenRows<'_>,
    out: &mut [[f32; ROWS]],
) {
    x.check(m.cols());
    assert!(rb < m.row_blocks() && out.len() >= x.tokens);
    let mut emu = Emulator::new();
    // SAFETY: `x` was checked against K and `rb` is in range; the emulator checks its own
    // shapes and panics where the hardware would fault.
    unsafe { exact_tiles(&mut emu, m, rb, x, out) }
}
