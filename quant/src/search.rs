//! The searched INT4 quantizer: per-group least-squares scale (and zero point) search.
//!
//! Why this exists: absmax round-to-nearest ([`PackedMatrix::quantize`]) maps each group's
//! largest element exactly onto a code, which wastes resolution on one outlier per group. The
//! checkpoint converter wants the lowest reconstruction error the canonical layout allows, as
//! llama.cpp's `make_qx_quants` / `make_qkx2_quants` get it: try several candidate scales around
//! the absmax one, re-fit the scale by least squares to the codes each candidate produces
//! (`d = Σ x·q / Σ q·q`), and keep the candidate with the least squared error.
//!
//! # What the search compares
//!
//! Every candidate is judged by the error it really gives in the stored format: its scale is
//! first rounded to the 16-bit [`ScaleDtype`] of the [`QuantSpec`], the codes are re-derived
//! from that rounded scale with exactly the rule of [`PackedMatrix::quantize`]
//! (`clamp(round_half_even(w / d) + z, 0, 15)`), and the squared error of `d · (q - z)` (computed
//! in f32 like every dequantizer, summed in f64) decides. The first candidate tried is the absmax
//! round-to-nearest choice itself, and a candidate replaces the best only when strictly better,
//! so no group ever comes out worse than [`PackedMatrix::quantize`] would make it. After the
//! candidate sweep, a short local search steps the winning scale by one 16-bit ulp at a time (and,
//! with zero points, the zero point by ±1 with a least-squares re-fit of the scale) while that
//! lowers the error.
//!
//! * **Symmetric** (zero point 8): candidates map the group's signed extreme `m` to codes near
//!   `-8` (`d ≈ m / -(7 ..= 9)`) and near `+7` (`d ≈ m / (6 ..= 8)`).
//! * **Zero points**: the range `[min(lo, 0), max(hi, 0)]` is mapped onto `14 ..= 16.4` code
//!   steps; the codes are fitted by two-parameter least squares `x ≈ a·q + b`, giving the scale
//!   `a` and both integer neighbours of the zero point `-b / a`, then the scale is re-fitted
//!   for each.
//!
//! # Output and limits
//!
//! The result is a [`PackedMatrix`] in the canonical layout, identical in shape to what
//! [`PackedMatrix::quantize`] writes, so the dequantizer and every kernel read it unchanged. The
//! quantizer is deterministic: its result is defined by the sequential search above with every
//! sum in element order, and is the same bit for bit on every machine and with or without the
//! vector kernels (`tests/it/search_oracle.rs` compares it with that straightforward
//! implementation). It allocates only the output, for 16-bit inputs one row of f32 scratch, and
//! an 8 KiB table.
//!
//! * An all-zero group gets scale 0 and codes equal to its zero point (so it dequantizes to 0).
//! * A NaN or infinite weight is an error ([`FormatError::NonFiniteWeight`]) naming its row and
//!   column.
//! * **Scales are clamped, never overflow**: a scale's magnitude is limited to [`max_scale`],
//!   the 16-bit type's largest finite value (f16: 65504), and a candidate whose dequantized
//!   values would overflow f32 is rejected (its error is infinite). Weights larger than what the
//!   clamped scale reaches (f16: `|w| > 8 · 65504` symmetric) are clipped to the nearest
//!   representable value instead of failing with [`FormatError::ScaleOverflow`] as
//!   [`PackedMatrix::quantize`] does. Tiny groups whose scale would round to zero try the
//!   smallest subnormal scales too, and keep whichever of those or zero is closer.

//! # How it is fast and still exact
//!
//! * **Each choice is evaluated once per group** (`Memo`): judging a `(scale, zero)` again can
//!   never change the result (the best error only goes down and a candidate must be strictly
//!   better), and its least-squares re-fit depends on it alone. One pass over the group yields
//!   the codes, `Σ v·e` and `Σ e²`, from which both the re-fit and the error follow.
//! * **Sums in any order where that is exact** (`sums_are_exact`): when every weight is a
//!   multiple of `2^-42` times a power of two above them all, every sum of `v·k` (`|k| ≤ 16`)
//!   is exact in f64, so vector lanes give the in-order result bit for bit. Otherwise (a weight
//!   below about `2^-18` of the largest with a full f32 mantissa, `2^-34` for bfloat16 weights)
//!   those sums are taken in element order.
//! * **Errors by bounds** (`Search::sums`, `Search::consider`): the search only compares
//!   errors, so each evaluation carries an interval holding its in-order error sum: from the
//!   exact sums, as `Σ v² - 2d·Σ v·e + d²·Σ e²` (exact in real arithmetic, every `d·e` being
//!   exact in f32) to within `2^-40·(Σ v² + 2|d·Σ v·e| + d²·Σ e²)`; otherwise from an f64 sum
//!   of the terms in any order, to within `2^-40` of it. A candidate whose interval lies below
//!   the best's wins, above it loses; only overlapping intervals (near-ties) are settled by
//!   summing both in element order.
//! * **AVX2 kernels** (detected at run time) compute the codes and sums eight weights at a time
//!   with the same IEEE operations as the scalar code.

use crate::format::{
    BLOCK, BLOCK_BYTES, DEFAULT_ZERO, FormatError, PackedMatrix, QuantSpec, ScaleDtype, check_len,
    quantize_group_asym,
};
use half::{bf16, f16};

/// Tensor name used in errors from the searched quantizer.
const WHAT: &str = "searched quantizer input";
/// Rounds of one-ulp local search after the candidate sweep.
const POLISH_ROUNDS: usize = 48;
/// Least-squares re-fits per candidate.
const REFIT_ROUNDS: usize = 3;

/// Quantize a dense row-major `[rows][cols]` f32 matrix with the searched quantizer.
///
/// Same layout as [`PackedMatrix::quantize`]; see the module docs for the search, the all-zero,
/// non-finite and scale-clamping rules.
pub fn quantize_matrix_searched(
    values: &[f32],
    rows: usize,
    cols: usize,
    spec: QuantSpec,
) -> Result<PackedMatrix, FormatError> {
    quantize_widened(values, rows, cols, spec)
}

/// [`quantize_matrix_searched`] from bfloat16 weights (each row widened to f32 exactly).
pub fn quantize_matrix_searched_bf16(
    values: &[bf16],
    rows: usize,
    cols: usize,
    spec: QuantSpec,
) -> Result<PackedMatrix, FormatError> {
    quantize_widened(values, rows, cols, spec)
}

/// [`quantize_matrix_searched`] from IEEE half weights (each row widened to f32 exactly).
pub fn quantize_matrix_searched_f16(
    values: &[f16],
    rows: usize,
    cols: usize,
    spec: QuantSpec,
) -> Result<PackedMatrix, FormatError> {
    quantize_widened(values, rows, cols, spec)
}

/// The dense input paths (f32, bf16, f16): each row widened to f32 exactly, then searched.
fn quantize_widened<T: Copy + Into<f32>>(
    values: &[T],
    rows: usize,
    cols: usize,
    spec: QuantSpec,
) -> Result<PackedMatrix, FormatError> {
    check_len(WHAT, rows * cols, values.len())?;
    quantize_rows_searched(rows, cols, spec, |n, out| {
        for (o, &v) in out.iter_mut().zip(&values[n * cols..(n + 1) * cols]) {
            *o = v.into();
        }
    })
}

/// The searched quantizer over a generic row source: `fill_row(n, out)` writes row `n`'s `cols`
/// weights into `out` (rows are requested once each, in order `0..rows`).
///
/// Lets a checkpoint converter stream rows from any storage without widening a whole tensor.
pub fn quantize_rows_searched(
    rows: usize,
    cols: usize,
    spec: QuantSpec,
    mut fill_row: impl FnMut(usize, &mut [f32]),
) -> Result<PackedMatrix, FormatError> {
    let mut m = PackedMatrix::zeroed(WHAT, spec, rows, cols)?;
    let mut row = vec![0f32; cols];
    let mut memo = Memo::new();
    for n in 0..rows {
        fill_row(n, &mut row);
        quantize_row(&mut m, n, &row, &mut memo, false)?;
    }
    Ok(m)
}

/// `‖x − deq(x)‖₂ / ‖x‖₂` in f64, with `deq` the exact dequantization of `packed`.
///
/// Returns 0 when both norms are zero and infinity when only `‖x‖₂` is.
///
/// # Panics
///
/// When `original.len()` is not `rows · cols` of `packed`.
pub fn relative_error(original: &[f32], packed: &PackedMatrix) -> f64 {
    let cols = packed.cols();
    assert_eq!(
        original.len(),
        packed.rows() * cols,
        "relative_error: original length"
    );
    let mut deq = vec![0f32; cols];
    let (mut diff, mut norm) = (0f64, 0f64);
    for n in 0..packed.rows() {
        packed.dequantize_row(n, &mut deq);
        for (&x, &y) in original[n * cols..(n + 1) * cols].iter().zip(&deq) {
            let r = x as f64 - y as f64;
            diff += r * r;
            norm += x as f64 * x as f64;
        }
    }
    if norm == 0.0 {
        if diff == 0.0 { 0.0 } else { f64::INFINITY }
    } else {
        (diff / norm).sqrt()
    }
}

/// Bit pattern of the largest scale magnitude the searched quantizer stores for `dtype`: the
/// type's largest finite value (f16: 65504 = `0x7BFF`; bf16: about `3.39e38` = `0x7F7F`).
///
/// Candidates are clamped to it. A candidate whose dequantized values `d · (q - z)` would
/// overflow f32 (only possible with bf16 scales near the top of the f32 range) has infinite
/// error and is never chosen, so every dequantizer reads finite values.
pub fn max_scale(dtype: ScaleDtype) -> u16 {
    match dtype {
        ScaleDtype::F16 => f16::MAX.to_bits(),
        ScaleDtype::Bf16 => bf16::MAX.to_bits(),
    }
}

/// Quantize one row (all its groups) into row `n` of `m`, with the [`Portable`] kernels when
/// `portable` or when the CPU has no faster ones (the results are the same).
fn quantize_row(
    m: &mut PackedMatrix,
    n: usize,
    row: &[f32],
    memo: &mut Memo,
    portable: bool,
) -> Result<(), FormatError> {
    if let Some(col) = row.iter().position(|v| !v.is_finite()) {
        return Err(FormatError::NonFiniteWeight {
            what: WHAT,
            row: n,
            col,
            value: row[col],
        });
    }
    #[cfg(target_arch = "x86_64")]
    if let Some(k) = Avx2::detect().filter(|_| !portable) {
        // SAFETY: an `Avx2` exists only where the CPU supports AVX2.
        unsafe { search_row_avx2(m, n, row, memo, k) };
        return Ok(());
    }
    search_row(m, n, row, memo, Portable);
    Ok(())
}

/// [`search_row`] with the AVX2 kernels, compiled for AVX2 (the same operations as
/// [`Portable`], so the same results).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn search_row_avx2(m: &mut PackedMatrix, n: usize, row: &[f32], memo: &mut Memo, k: Avx2) {
    search_row(m, n, row, memo, k);
}

/// Search every group of a (finite) row and store the winners into row `n` of `m`.
#[inline(always)]
fn search_row<K: Kernels>(m: &mut PackedMatrix, n: usize, row: &[f32], memo: &mut Memo, k: K) {
    match m.spec().group() {
        32 => search_groups::<32, K>(m, n, row, memo, k),
        64 => search_groups::<64, K>(m, n, row, memo, k),
        128 => search_groups::<128, K>(m, n, row, memo, k),
        g => unreachable!("group size {g} passed QuantSpec::validate"),
    }
}

/// [`search_row`] for groups of `N` elements.
#[inline(always)]
fn search_groups<const N: usize, K: Kernels>(
    m: &mut PackedMatrix,
    n: usize,
    row: &[f32],
    memo: &mut Memo,
    k: K,
) {
    let spec = m.spec();
    let groups = m.groups_per_row();
    for (g, w) in row.chunks_exact(N).enumerate() {
        let w: &[f32; N] = w.try_into().expect("chunks_exact(N)");
        memo.clear();
        let mut s = Search::new(spec.scale_dtype, w, memo, k);
        if spec.zero_points {
            s.search_asym();
        } else {
            s.search_sym();
        }
        let (bits, zero) = (s.best.bits, s.best.zero);
        m.scales_mut()[n * groups + g] = bits;
        m.set_zero(n, g, zero);
        write_codes(m, n, g, w, spec.scale_dtype.to_f32(bits), zero);
    }
}

/// Store the codes of group `g` of row `n` (weights `w`, scale `d`, zero point `z`) in the
/// canonical nibble order: each 32-element block is 16 bytes, element `j` in the low nibble of
/// byte `j` and element `j + 16` in its high nibble (see [`crate::format`]).
#[inline(always)]
fn write_codes<const N: usize>(
    m: &mut PackedMatrix,
    n: usize,
    g: usize,
    w: &[f32; N],
    d: f32,
    z: u8,
) {
    let start = n * m.row_bytes() + g * N / 2;
    let bytes = &mut m.nibbles_mut()[start..start + N / 2];
    for (out, w) in bytes
        .chunks_exact_mut(BLOCK_BYTES)
        .zip(w.chunks_exact(BLOCK))
    {
        for j in 0..BLOCK_BYTES {
            out[j] = code(w[j], d, z) | code(w[j + BLOCK_BYTES], d, z) << 4;
        }
    }
}

/// The code of weight `v` under scale `d` and zero point `z`: [`PackedMatrix::quantize`]'s rule.
///
/// Rounding uses the `1.5 · 2^23` trick (exactly round-half-even for `|x| ≤ 2^22`, and fast
/// without SSE4.1) after clamping `v / d` to `±32`, which cannot change a code in `0..=15`.
#[inline(always)]
fn code(v: f32, d: f32, z: u8) -> u8 {
    if d == 0.0 {
        z
    } else {
        code_f32(v, d, z as f32) as u8
    }
}

/// [`code`] for a nonzero `d`, as an integer-valued f32 in `0.0..=15.0` (branch-free).
#[inline(always)]
fn code_f32(v: f32, d: f32, zf: f32) -> f32 {
    (rne32((v / d).clamp(-32.0, 32.0)) + zf).clamp(0.0, 15.0)
}

/// `1.5 · 2^23`: adding and subtracting it rounds an f32 to an integer, half to even.
const MAGIC32: f32 = 12_582_912.0;
/// `1.5 · 2^52`: adding and subtracting it rounds an f64 to an integer, half to even.
const MAGIC64: f64 = 6_755_399_441_055_744.0;

/// Round half to even for `|x| ≤ 2^22`.
#[inline(always)]
fn rne32(x: f32) -> f32 {
    (x + MAGIC32) - MAGIC32
}

/// Round half to even for `|x| ≤ 2^51`.
#[inline(always)]
fn rne64(x: f64) -> f64 {
    (x + MAGIC64) - MAGIC64
}

/// Element terms of an evaluation of scale `d` (nonzero, finite) and zero point `zf` for the
/// weight `v` (`v64` widened): the squared error `(v - d·e)²` (the dequantized value computed
/// in f32, as every dequantizer does) and the least-squares terms `v·e` and `e²`, with
/// `e = code - zf`.
#[inline(always)]
fn eval_terms(v: f32, v64: f64, d: f32, zf: f32) -> [f64; 3] {
    let e = code_f32(v, d, zf) - zf;
    let r = v64 - (d * e) as f64;
    let e = e as f64;
    [r * r, v64 * e, e * e]
}

/// Element terms of a symmetric candidate with inverse scale `inv`: `v·l` and `l²` for the
/// level `l = round(inv·v)` clamped to `-8..=7`.
#[inline(always)]
fn sym_terms(v64: f64, inv: f64) -> [f64; 2] {
    let l = rne64((inv * v64).clamp(-8.0, 7.0));
    [v64 * l, l * l]
}

/// Element terms of a zero-point candidate with inverse scale `inv` from `lo`: `l`, `l²` and
/// `v·l` for the level `l = round(inv·(v - lo))` clamped to `0..=15`.
#[inline(always)]
fn asym_terms(v64: f64, inv: f64, lo: f64) -> [f64; 3] {
    let l = rne64((inv * (v64 - lo)).clamp(0.0, 15.0));
    [l, l * l, v64 * l]
}

/// The lane sums of `N` elements' terms: term `k` of element `i` (from `f(i)`) goes into lane
/// `i % 8` of sum `k`, each lane adding in element order from `+0.0`, then the lanes are added
/// as [`lanes8`] does. A fixed order that vectorizes, unlike [`seq_sums`].
#[inline(always)]
fn lane_sums<const N: usize, const K: usize>(f: impl Fn(usize) -> [f64; K]) -> [f64; K] {
    let mut acc = [[0f64; 8]; K];
    for i in 0..N {
        let t = f(i);
        for k in 0..K {
            acc[k][i % 8] += t[k];
        }
    }
    acc.map(lanes8)
}

/// The total of eight lanes: `((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7))`.
#[inline(always)]
fn lanes8(a: [f64; 8]) -> f64 {
    ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))
}

/// The sums of `N` elements' terms (as [`lane_sums`]) in element order from `+0.0`: the order
/// the search's sums are defined by.
#[inline(always)]
fn seq_sums<const N: usize, const K: usize>(f: impl Fn(usize) -> [f64; K]) -> [f64; K] {
    let mut acc = [0f64; K];
    for i in 0..N {
        let t = f(i);
        for k in 0..K {
            acc[k] += t[k];
        }
    }
    acc
}

/// Whether every sum of products `v · k` over the group (integers `|k| ≤ 16`, at most 128
/// terms) is exact in f64 in any order, so that [`lane_sums`] equal [`seq_sums`] bit for bit.
///
/// With `2^hi` above every `|v|`, every partial sum is below `128 · 16 · 2^hi = 2^53 · 2^(hi-42)`;
/// when every weight is an integer multiple of `2^(hi-42)`, so is every term and every partial
/// sum, which is then representable: every addition is exact (and a zero sum is `+0.0` in any
/// order, starting from `+0.0`).
#[inline(always)]
fn sums_are_exact<const N: usize>(top: u32, w64: &[f64; N]) -> bool {
    // `top` is the largest |v|'s bit pattern: |v| < 2^(E - 126) for its biased exponent E
    // (subnormals included); scale by 2^(168 - E).
    let e = (top >> 23) as u64;
    let unit = f64::from_bits((168 + 1023 - e) << 52);
    w64.iter().fold(true, |ok, &v| {
        let x = v * unit;
        ok & (rne64(x) == x)
    })
}

/// [`ScaleDtype::from_f32`] for a value that is not NaN, inlined; bfloat16 rounds to nearest
/// even by the carry of `0x7FFF` plus the kept part's lowest bit, branch-free.
#[inline(always)]
fn scale_bits(dtype: ScaleDtype, v: f32) -> u16 {
    match dtype {
        ScaleDtype::F16 => f16::from_f32(v).to_bits(),
        ScaleDtype::Bf16 => {
            let x = v.to_bits();
            ((x + 0x7FFF + ((x >> 16) & 1)) >> 16) as u16
        }
    }
}

/// [`ScaleDtype::to_f32`] for bits that are not a NaN, inlined.
#[inline(always)]
fn scale_value(dtype: ScaleDtype, bits: u16) -> f32 {
    match dtype {
        ScaleDtype::F16 => f16::from_bits(bits).to_f32(),
        ScaleDtype::Bf16 => f32::from_bits((bits as u32) << 16),
    }
}

/// The sums of one evaluation: bounds `lo ..= hi` on the in-order sum of its squared errors,
/// and the least-squares sums `Σ v·e` and `Σ e²` (in any order; see [`Search::finish`]).
#[derive(Clone, Copy, Default, Debug)]
struct Sums {
    lo: f64,
    hi: f64,
    sxe: f64,
    see: f64,
}

impl Sums {
    /// From an f64 sum `err` of the squared-error terms in any order: the in-order sum lies
    /// within `γ₁₂₇ ≈ 1.4e-14` (relative) of the exact sum, as `err` does (non-negative terms),
    /// so within `2^-40` of `err`.
    #[inline(always)]
    fn from_f64(err: f64, sxe: f64, see: f64) -> Self {
        Self {
            lo: err * ERR_LO,
            hi: err * ERR_HI,
            sxe,
            see,
        }
    }
}

/// `format::quantize_group_sym_scale` of a group whose first weight of the largest magnitude is `m`.
#[inline(always)]
fn absmax_scale(dtype: ScaleDtype, m: f32) -> u16 {
    let bits = scale_bits(dtype, m / -8.0);
    if scale_value(dtype, bits) == 0.0 {
        0
    } else {
        bits
    }
}

/// The vector kernels of the search. They may sum in any order: their sums are used only
/// where that is exact, or the caller sums again in order.
trait Kernels: Copy {
    /// `[Σ v·e, Σ e²]` with `e = code - zf` under scale `d` (nonzero, finite): see
    /// [`eval_terms`].
    fn codes<const N: usize>(self, w: &[f32; N], w64: &[f64; N], d: f32, zf: f32) -> [f64; 2];
    /// Sums of [`sym_terms`].
    fn sym<const N: usize>(self, w64: &[f64; N], inv: f64) -> [f64; 2];
    /// Sums of [`asym_terms`].
    fn asym<const N: usize>(self, w64: &[f64; N], inv: f64, lo: f64) -> [f64; 3];
}

/// [`Kernels`] in plain Rust.
#[derive(Clone, Copy)]
struct Portable;

impl Kernels for Portable {
    #[inline(always)]
    fn codes<const N: usize>(self, w: &[f32; N], w64: &[f64; N], d: f32, zf: f32) -> [f64; 2] {
        let [_, sxe, see] = lane_sums::<N, 3>(|i| eval_terms(w[i], w64[i], d, zf));
        [sxe, see]
    }

    #[inline(always)]
    fn sym<const N: usize>(self, w64: &[f64; N], inv: f64) -> [f64; 2] {
        lane_sums::<N, 2>(|i| sym_terms(w64[i], inv))
    }

    #[inline(always)]
    fn asym<const N: usize>(self, w64: &[f64; N], inv: f64, lo: f64) -> [f64; 3] {
        lane_sums::<N, 3>(|i| asym_terms(w64[i], inv, lo))
    }
}

/// [`Kernels`] with AVX2 intrinsics; a value exists only where the CPU supports AVX2.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct Avx2(());

#[cfg(target_arch = "x86_64")]
impl Avx2 {
    fn detect() -> Option<Self> {
        std::arch::is_x86_feature_detected!("avx2").then_some(Avx2(()))
    }
}

#[cfg(target_arch = "x86_64")]
impl Kernels for Avx2 {
    #[inline(always)]
    fn codes<const N: usize>(self, w: &[f32; N], w64: &[f64; N], d: f32, zf: f32) -> [f64; 2] {
        // SAFETY: `self` proves the CPU supports AVX2.
        unsafe { avx2::codes(w, w64, d, zf) }
    }

    #[inline(always)]
    fn sym<const N: usize>(self, w64: &[f64; N], inv: f64) -> [f64; 2] {
        // SAFETY: as above.
        unsafe { avx2::sym(w64, inv) }
    }

    #[inline(always)]
    fn asym<const N: usize>(self, w64: &[f64; N], inv: f64, lo: f64) -> [f64; 3] {
        // SAFETY: as above.
        unsafe { avx2::asym(w64, inv, lo) }
    }
}

/// The AVX2 kernels: eight elements per step, each operation the one [`eval_terms`],
/// [`sym_terms`] or [`asym_terms`] does.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// Round to nearest, ties to even (what the `1.5 · 2^23` / `1.5 · 2^52` tricks of
    /// [`super::rne32`] and [`super::rne64`] compute on the clamped ranges used here).
    const ROUND: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

    /// The sum of the four lanes of `lo` and of `hi`.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn total(lo: __m256d, hi: __m256d) -> f64 {
        let v = _mm256_add_pd(lo, hi);
        let s = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd::<1>(v));
        _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)))
    }

    /// The sum of the eight lanes of `v`.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn total32(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
    }

    /// Elements `8c..8c + 8` of `w64` as two vectors.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn load64<const N: usize>(w64: &[f64; N], c: usize) -> [__m256d; 2] {
        assert!(8 * c + 8 <= N);
        // SAFETY: the eight f64 at 8c lie inside `w64` (asserted).
        unsafe {
            let p = w64.as_ptr().add(8 * c);
            [_mm256_loadu_pd(p), _mm256_loadu_pd(p.add(4))]
        }
    }

    /// [`super::Kernels::codes`]. `Σ e²` (integers up to `128 · 225`) is exact in f32.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(super) fn codes<const N: usize>(w: &[f32; N], w64: &[f64; N], d: f32, zf: f32) -> [f64; 2] {
        let vd = _mm256_set1_ps(d);
        let (lim, neg) = (_mm256_set1_ps(32.0), _mm256_set1_ps(-32.0));
        // `clamp(round(x) + zf, 0, 15) - zf`, all exact small integers, is this clamp.
        let (lo, hi) = (_mm256_set1_ps(-zf), _mm256_set1_ps(15.0 - zf));
        let mut ee = _mm256_setzero_ps();
        let mut xe = [_mm256_setzero_pd(); 2];
        for c in 0..N / 8 {
            assert!(8 * c + 8 <= N);
            // SAFETY: the eight f32 at 8c lie inside `w` (asserted).
            let v = unsafe { _mm256_loadu_ps(w.as_ptr().add(8 * c)) };
            let x = _mm256_min_ps(_mm256_max_ps(_mm256_div_ps(v, vd), neg), lim);
            let e = _mm256_round_ps::<ROUND>(x);
            let e = _mm256_min_ps(_mm256_max_ps(e, lo), hi);
            ee = _mm256_add_ps(ee, _mm256_mul_ps(e, e));
            let halves = [_mm256_castps256_ps128(e), _mm256_extractf128_ps::<1>(e)];
            for (h, (v64, e)) in load64(w64, c).into_iter().zip(halves).enumerate() {
                xe[h] = _mm256_add_pd(xe[h], _mm256_mul_pd(v64, _mm256_cvtps_pd(e)));
            }
        }
        [total(xe[0], xe[1]), total32(ee) as f64]
    }

    /// [`super::Kernels::sym`].
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(super) fn sym<const N: usize>(w64: &[f64; N], inv: f64) -> [f64; 2] {
        let vi = _mm256_set1_pd(inv);
        let (lo, hi) = (_mm256_set1_pd(-8.0), _mm256_set1_pd(7.0));
        let mut acc = [_mm256_setzero_pd(); 4];
        for c in 0..N / 8 {
            for (h, v) in load64(w64, c).into_iter().enumerate() {
                let l = _mm256_min_pd(_mm256_max_pd(_mm256_mul_pd(vi, v), lo), hi);
                let l = _mm256_round_pd::<ROUND>(l);
                acc[h] = _mm256_add_pd(acc[h], _mm256_mul_pd(v, l));
                acc[2 + h] = _mm256_add_pd(acc[2 + h], _mm256_mul_pd(l, l));
            }
        }
        [total(acc[0], acc[1]), total(acc[2], acc[3])]
    }

    /// [`super::Kernels::asym`].
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(super) fn asym<const N: usize>(w64: &[f64; N], inv: f64, lo: f64) -> [f64; 3] {
        let (vi, vlo) = (_mm256_set1_pd(inv), _mm256_set1_pd(lo));
        let top = _mm256_set1_pd(15.0);
        let mut acc = [_mm256_setzero_pd(); 6];
        for c in 0..N / 8 {
            for (h, v) in load64(w64, c).into_iter().enumerate() {
                let l = _mm256_mul_pd(vi, _mm256_sub_pd(v, vlo));
                let l = _mm256_min_pd(_mm256_max_pd(l, _mm256_setzero_pd()), top);
                let l = _mm256_round_pd::<ROUND>(l);
                acc[h] = _mm256_add_pd(acc[h], l);
                acc[2 + h] = _mm256_add_pd(acc[2 + h], _mm256_mul_pd(l, l));
                acc[4 + h] = _mm256_add_pd(acc[4 + h], _mm256_mul_pd(v, l));
            }
        }
        [
            total(acc[0], acc[1]),
            total(acc[2], acc[3]),
            total(acc[4], acc[5]),
        ]
    }
}

/// Slots of the [`Memo`] table (a power of two).
const MEMO_SLOTS: usize = 1024;
/// An in-order sum of squared errors lies between [`ERR_LO`] and [`ERR_HI`] times any other
/// f64 sum of the same terms; see [`Sums::from_f64`].
const ERR_HI: f64 = 1.0 + 1.0 / 1_099_511_627_776.0; // 1 + 2^-40
/// See [`ERR_HI`].
const ERR_LO: f64 = 1.0 - 1.0 / 1_099_511_627_776.0;
/// Scales below which no dequantized value `d·e` (`|e| ≤ 15`) overflows f32: `2^120`.
const FORMULA_MAX_SCALE: f32 = f32::from_bits((127 + 120) << 23);
/// Most candidate scales of a sweep: 17 symmetric, 2 × 13 with zero points.
const MAX_STARTS: usize = 26;

/// What evaluating one choice gives; it depends on the group and the choice alone.
#[derive(Clone, Copy, Default)]
struct Eval {
    /// Bounds on the in-order sum of its squared errors (both infinite when it is).
    lo: f64,
    /// See [`Eval::lo`].
    hi: f64,
    /// The least-squares re-fit of the scale to its codes, if the re-fit goes on.
    next: Option<u16>,
}

/// Every `(bits, zero)` choice judged for the current group (as far as it holds them), with
/// its re-fit ([`Eval::next`]).
///
/// Judging a choice again can never change the search's result (the best error only goes down,
/// and a candidate must be strictly better), and the re-fit depends on the choice alone, so
/// both are looked up instead of recomputed. A direct-mapped table indexed by the key's low
/// bits (nearby scales land apart); a collision evicts, and an evicted choice is evaluated
/// again if it comes up again (same results, more work). An entry packs the group's stamp,
/// the key and the re-fit, so clearing the table is one increment.
struct Memo {
    slots: Box<[u64; MEMO_SLOTS]>,
    stamp: u64,
}

/// Bits of a [`Memo`] entry below its tag (the re-fit: 16 bits and a flag).
const MEMO_NEXT_BITS: u32 = 17;
/// Bits of a [`key`].
const MEMO_KEY_BITS: u32 = 20;
/// Groups a [`Memo`] stamp tells apart before the table is wiped.
const MEMO_STAMPS: u64 = 1 << (64 - MEMO_NEXT_BITS - MEMO_KEY_BITS);

impl Memo {
    fn new() -> Self {
        Self {
            slots: Box::new([0; MEMO_SLOTS]),
            stamp: 0,
        }
    }

    /// Forget every entry (start a new group). Stamp 0 is never current, so zeroed slots
    /// match nothing.
    #[inline(always)]
    fn clear(&mut self) {
        self.stamp += 1;
        if self.stamp == MEMO_STAMPS {
            self.slots.fill(0);
            self.stamp = 1;
        }
    }

    /// The tag of `key` in the current group.
    #[inline(always)]
    fn tag(&self, key: u32) -> u64 {
        self.stamp << MEMO_KEY_BITS | key as u64
    }

    /// The re-fit recorded for `key`, if it is recorded.
    #[inline(always)]
    fn find(&self, key: u32) -> Option<Option<u16>> {
        let e = self.slots[key as usize & (MEMO_SLOTS - 1)];
        (e >> MEMO_NEXT_BITS == self.tag(key)).then(|| (e & 1 << 16 != 0).then_some(e as u16))
    }

    /// Record `key` with its re-fit `next` (evicting whatever shared its slot).
    #[inline(always)]
    fn insert(&mut self, key: u32, next: Option<u16>) {
        let next = next.map_or(0, |b| 1 << 16 | b as u64);
        self.slots[key as usize & (MEMO_SLOTS - 1)] = self.tag(key) << MEMO_NEXT_BITS | next;
    }
}

/// The memo key of scale bits `bits` with zero point `zero` (`zero < 16`).
#[inline(always)]
fn key(bits: u16, zero: u8) -> u32 {
    (bits as u32) << 4 | zero as u32
}

/// The best choice so far: bounds on its in-order error, and that error once computed.
#[derive(Clone, Copy, Debug)]
struct Best {
    bits: u16,
    zero: u8,
    lo: f64,
    hi: f64,
    exact: Option<f64>,
}

/// Search state of one group of `N` weights.
///
/// The search is a fixed sequence of judgements ([`Search::try_bits`]) whose order decides
/// ties; the evaluations behind them are pure functions of the group and the choice.
struct Search<'a, const N: usize, K> {
    w: &'a [f32; N],
    /// The weights widened to f64.
    w64: [f64; N],
    /// [`sums_are_exact`] for the weights.
    exact: bool,
    /// The bit pattern of the largest `|v|`.
    top: u32,
    /// `Σ v²` in any order (each term exact in f64).
    sum_sq: f64,
    dtype: ScaleDtype,
    max_mag: u16,
    /// [`Search::max_mag`] as a value.
    max_val: f64,
    best: Best,
    memo: &'a mut Memo,
    k: K,
}

impl<'a, const N: usize, K: Kernels> Search<'a, N, K> {
    #[inline(always)]
    fn new(dtype: ScaleDtype, w: &'a [f32; N], memo: &'a mut Memo, k: K) -> Self {
        let max_mag = max_scale(dtype);
        let w64 = w.map(|v| v as f64);
        let top = w.iter().fold(0u32, |m, v| m.max(v.to_bits() & 0x7FFF_FFFF));
        Self {
            w,
            w64,
            exact: sums_are_exact(top, &w64),
            top,
            sum_sq: lane_sums::<N, 1>(|i| [w64[i] * w64[i]])[0],
            dtype,
            max_mag,
            max_val: dtype.to_f32(max_mag) as f64,
            best: Best {
                bits: 0,
                zero: DEFAULT_ZERO,
                lo: f64::INFINITY,
                hi: f64::INFINITY,
                exact: Some(f64::INFINITY),
            },
            memo,
            k,
        }
    }

    /// Judge stored scale bits `bits` with zero point `zero` (keep it if strictly better), and
    /// return its least-squares re-fit (see [`Search::evaluate`]).
    #[inline(always)]
    fn try_bits(&mut self, bits: u16, zero: u8) -> Option<u16> {
        let key = key(bits, zero);
        if let Some(next) = self.memo.find(key) {
            return next;
        }
        let eval = self.evaluate(bits, zero);
        self.memo.insert(key, eval.next);
        self.consider(bits, zero, eval);
        eval.next
    }

    /// The [`Eval`] of `(bits, zero)`: bounds on its in-order error, and the least-squares
    /// re-fit of the scale to its codes: `None` where the re-fit stops (zero or non-finite
    /// scale, all codes at the zero point, or the re-fit rounds back to `bits`).
    #[inline(always)]
    fn evaluate(&self, bits: u16, zero: u8) -> Eval {
        self.finish(bits, zero, self.sums(bits, zero))
    }

    /// The kernel part of [`Search::evaluate`].
    ///
    /// With exact least-squares sums `A = Σ v·e`, `B = Σ e²` (`sums_are_exact`) and nothing
    /// near overflow, the error follows from them: every `d·e` is exact in f32 (at most 11 + 4
    /// significant bits, a multiple of `2^-149`), so the exact error is `C - 2dA + d²B` with
    /// `C = Σ v²`. In f64 that is within `(γ₁₂₇ + 3u)·K` of it, `K = C + 2|dA| + d²B ≥ T/2`;
    /// and the in-order sum of the rounded error terms lies within `(γ₁₂₇ + 3u)·T` of the exact
    /// error `T`. Both together are far inside the `2^-40·K` allowed here. Otherwise the error
    /// terms are summed in f64 (in any order; see [`Sums::from_f64`]).
    #[inline(always)]
    fn sums(&self, bits: u16, zero: u8) -> Sums {
        let d = scale_value(self.dtype, bits);
        if !d.is_finite() {
            Sums::default() // unused: see `finish`
        } else if d == 0.0 {
            Sums::from_f64(self.sum_sq, 0.0, 0.0)
        } else if self.exact && d.abs() < FORMULA_MAX_SCALE {
            let [a, b] = self.k.codes(self.w, &self.w64, d, zero as f32);
            let d = d as f64;
            let (da, dd) = (d * a, d * d * b);
            let err = (self.sum_sq - 2.0 * da) + dd;
            let slack = (self.sum_sq + 2.0 * da.abs() + dd) * (ERR_HI - 1.0);
            Sums {
                lo: err - slack,
                hi: err + slack,
                sxe: a,
                see: b,
            }
        } else {
            let zf = zero as f32;
            let [err, sxe, see] = lane_sums::<N, 3>(|i| eval_terms(self.w[i], self.w64[i], d, zf));
            Sums::from_f64(err, sxe, see)
        }
    }

    /// The rest of [`Search::evaluate`], from the kernel's sums `s`.
    #[inline(always)]
    fn finish(&self, bits: u16, zero: u8, s: Sums) -> Eval {
        let d = scale_value(self.dtype, bits);
        if !d.is_finite() {
            // Infinite error, never better; no re-fit.
            return Eval {
                lo: f64::INFINITY,
                hi: f64::INFINITY,
                next: None,
            };
        }
        let mut eval = Eval {
            lo: s.lo,
            hi: s.hi,
            next: None,
        };
        if s.see != 0.0 {
            let sxe = if self.exact {
                s.sxe
            } else {
                seq_sums::<N, 3>(|i| eval_terms(self.w[i], self.w64[i], d, zero as f32))[1]
            };
            let next = self.round_scale(sxe / s.see);
            eval.next = (next != bits).then_some(next);
        }
        eval
    }

    /// The squared error of `(bits, zero)` (finite scale), summed in element order.
    fn seq_err(&self, bits: u16, zero: u8) -> f64 {
        let d = scale_value(self.dtype, bits);
        if d == 0.0 {
            seq_sums::<N, 1>(|i| [self.w64[i] * self.w64[i]])[0]
        } else {
            seq_sums::<N, 3>(|i| eval_terms(self.w[i], self.w64[i], d, zero as f32))[0]
        }
    }

    /// Keep `(bits, zero)` if the in-order sum of its squared errors is strictly below the
    /// best's. Decided by the bounds where they do not overlap; otherwise (near-ties, rare) by
    /// both in-order sums. An infinite error is never better.
    #[inline(always)]
    fn consider(&mut self, bits: u16, zero: u8, eval: Eval) {
        let best = self.best;
        if eval.lo == f64::INFINITY {
            // Never strictly below anything.
        } else if eval.hi < best.lo {
            self.best = Best {
                bits,
                zero,
                lo: eval.lo,
                hi: eval.hi,
                exact: None,
            };
        } else if eval.lo < best.hi {
            self.consider_exactly(bits, zero);
        }
    }

    /// [`Search::consider`] for a near-tie: compare the in-order sums.
    #[cold]
    #[inline(never)]
    fn consider_exactly(&mut self, bits: u16, zero: u8) {
        let best = self.best;
        let best_err = best
            .exact
            .unwrap_or_else(|| self.seq_err(best.bits, best.zero));
        self.best.exact = Some(best_err);
        let err = self.seq_err(bits, zero);
        if err < best_err {
            self.best = Best {
                bits,
                zero,
                lo: err,
                hi: err,
                exact: Some(err),
            };
        }
    }

    /// Round an f64 scale to the 16-bit type, clamping its magnitude to [`max_scale`]; a scale
    /// that rounds to zero becomes +0.
    #[inline(always)]
    fn round_scale(&self, s: f64) -> u16 {
        let bits = scale_bits(self.dtype, s.abs().min(self.max_val) as f32);
        let bits = bits.min(self.max_mag);
        if bits == 0 {
            0
        } else if s < 0.0 {
            bits | 0x8000
        } else {
            bits
        }
    }

    /// Least-squares re-fit of the scale for fixed codes and zero `z`, repeated while the
    /// rounded scale changes: `next` is the re-fit of the choice tried last.
    #[inline(always)]
    fn refit(&mut self, mut next: Option<u16>, z: u8) {
        for _ in 0..REFIT_ROUNDS {
            let Some(bits) = next else {
                return;
            };
            next = self.try_bits(bits, z);
        }
    }

    /// Local search: step the best scale by one ulp (and, when `free_zero`, the zero point by
    /// ±1 with a re-fit) while that strictly lowers the error.
    #[inline(always)]
    fn polish(&mut self, free_zero: bool) {
        for _ in 0..POLISH_ROUNDS {
            let start = self.best;
            let (mag, z) = (start.bits & 0x7FFF, start.zero);
            let sign = start.bits & 0x8000;
            if mag == 0 {
                self.try_bits(1, z);
                self.try_bits(0x8001, z);
            } else {
                let down = mag - 1;
                self.try_bits(if down == 0 { 0 } else { sign | down }, z);
                if mag < self.max_mag {
                    self.try_bits(sign | (mag + 1), z);
                }
            }
            if free_zero && mag != 0 {
                for nz in [z.wrapping_sub(1), z + 1] {
                    if nz < 16 {
                        let next = self.try_bits(start.bits, nz);
                        self.refit(next, nz);
                    }
                }
            }
            if self.best.bits == start.bits && self.best.zero == start.zero {
                return;
            }
        }
    }

    /// Symmetric search (zero point 8); see the module docs.
    #[inline(always)]
    fn search_sym(&mut self) {
        let w = self.w;
        // The first weight of the largest magnitude.
        let m = w[w
            .iter()
            .position(|v| v.to_bits() & 0x7FFF_FFFF == self.top)
            .unwrap_or(0)];
        // Absmax round-to-nearest first, so the result is never worse than it.
        self.try_bits(absmax_scale(self.dtype, m), DEFAULT_ZERO);
        if m == 0.0 {
            return;
        }
        self.try_bits(0, DEFAULT_ZERO);
        // Map m near code -8 (targets -7.0 ..= -9.0) and near code +7 (targets 6.0 ..= 8.0).
        let targets = (0..=10)
            .map(|i| -(7.0 + 0.2 * i as f64))
            .chain((0..=5).map(|i| 6.0 + 0.4 * i as f64));
        let mut scales = [f64::NAN; 17];
        for (s, t) in scales.iter_mut().zip(targets) {
            let inv = t / m as f64;
            let [mut sxl, sll] = self.k.sym(&self.w64, inv);
            if sll > 0.0 {
                if !self.exact {
                    sxl = seq_sums::<N, 2>(|i| sym_terms(self.w64[i], inv))[0];
                }
                *s = sxl / sll;
            }
        }
        self.sweep(scales.map(|s| (s, DEFAULT_ZERO)));
        self.polish(false);
    }

    /// Try each least-squares scale `(scale, zero)` in order (non-finite scales skipped), each
    /// followed by its re-fit chain ([`Search::refit`]).
    #[inline(always)]
    fn sweep<const M: usize>(&mut self, cands: [(f64, u8); M]) {
        // A start equal to the previous one repeats its whole chain: nothing new to judge.
        let mut starts = [None; MAX_STARTS];
        let mut last = None;
        for (f, (s, z)) in starts.iter_mut().zip(cands) {
            if s.is_finite() {
                let start = Some((self.round_scale(s), z));
                if start != last {
                    *f = start;
                }
                last = start;
            }
        }
        for (bits, z) in starts.into_iter().flatten() {
            let next = self.try_bits(bits, z);
            self.refit(next, z);
        }
    }

    /// Asymmetric search (scale and u4 zero point); see the module docs.
    #[inline(always)]
    fn search_asym(&mut self) {
        let w = self.w;
        let (bits, zero) = quantize_group_asym(self.dtype, w);
        self.try_bits(bits, zero);
        let lo = w.iter().copied().fold(0f32, f32::min) as f64;
        let hi = w.iter().copied().fold(0f32, f32::max) as f64;
        if hi == lo {
            return;
        }
        self.try_bits(0, DEFAULT_ZERO);
        let n = N as f64;
        let [sx] = if self.exact {
            lane_sums::<N, 1>(|i| [self.w64[i]])
        } else {
            seq_sums::<N, 1>(|i| [self.w64[i]])
        };
        let mut cands = [(f64::NAN, 0); 26];
        for (i, c) in cands.chunks_exact_mut(2).enumerate() {
            let inv = (14.0 + 0.2 * i as f64) / (hi - lo);
            let [sl, sll, mut sxl] = self.k.asym(&self.w64, inv, lo);
            if !self.exact {
                sxl = seq_sums::<N, 3>(|j| asym_terms(self.w64[j], inv, lo))[2];
            }
            let det = n * sll - sl * sl;
            if det <= 0.0 {
                continue;
            }
            let a = (n * sxl - sl * sx) / det;
            let b = (sll * sx - sl * sxl) / det;
            if !(a > 0.0 && a.is_finite()) {
                continue;
            }
            let d = scale_value(self.dtype, self.round_scale(a)) as f64;
            if d == 0.0 {
                continue;
            }
            // Both integer neighbours of the real zero point, each with a re-fitted scale.
            let zr = (-b / d).clamp(0.0, 15.0);
            c[0] = (a, zr.floor() as u8);
            c[1] = (a, zr.ceil() as u8);
        }
        self.sweep(cands);
        self.polish(true);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::quantize_group_sym_scale;
    use crate::synth::{self, SplitMix64};

    /// [`quantize_matrix_searched`] with the [`Portable`] kernels.
    fn quantize_portable(x: &[f32], rows: usize, cols: usize, spec: QuantSpec) -> PackedMatrix {
        let mut m = PackedMatrix::zeroed(WHAT, spec, rows, cols).unwrap();
        let mut memo = Memo::new();
        for n in 0..rows {
            quantize_row(&mut m, n, &x[n * cols..(n + 1) * cols], &mut memo, true).unwrap();
        }
        m
    }

    /// Groups of every kind the search treats apart: Gaussian at scales from subnormal to near
    /// the top of f32, all-zero, constant, one-sided, a single nonzero weight, bfloat16-exact
    /// weights, and weights spanning many binades (least-squares sums not exact in f64).
    fn mixed_groups(rng: &mut SplitMix64, groups: usize, gs: usize) -> Vec<f32> {
        let scales = [1e-39, 1e-30, 1e-7, 0.02, 1.0, 500.0, 4e5, 1e30, 1e37];
        let mut x = Vec::with_capacity(groups * gs);
        for g in 0..groups {
            let s = scales[g % scales.len()];
            for i in 0..gs {
                let v = rng.normal() * s;
                x.push(match (g / scales.len()) % 6 {
                    0 => v as f32,
                    1 => 0.0,
                    2 => s as f32,
                    3 => (v.abs() + s) as f32,
                    4 if i % 5 == 0 => (v * 1e-12) as f32,
                    4 => v as f32,
                    _ => bf16::from_f32(v as f32).to_f32(),
                });
            }
        }
        x
    }

    #[test]
    fn portable_and_vector_kernels_agree() {
        for g in [32, 64, 128] {
            for scale_dtype in [ScaleDtype::Bf16, ScaleDtype::F16] {
                for zero_points in [false, true] {
                    let spec = QuantSpec {
                        group_size: g,
                        scale_dtype,
                        zero_points,
                    };
                    let mut rng = SplitMix64::new(g as u64 + zero_points as u64);
                    let cols = 4 * g as usize;
                    let x = mixed_groups(&mut rng, 27 * 4, g as usize);
                    let rows = x.len() / cols;
                    let fast = quantize_matrix_searched(&x, rows, cols, spec).unwrap();
                    assert_eq!(fast, quantize_portable(&x, rows, cols, spec), "{spec}");
                }
            }
        }
    }

    #[test]
    fn absmax_scale_is_the_format_rule() {
        let mut rng = SplitMix64::new(5);
        for dtype in [ScaleDtype::Bf16, ScaleDtype::F16] {
            for scale in [0.0, 1e-42, 1e-9, 0.3, 7e4, 1e38] {
                for _ in 0..50 {
                    let mut w = synth::normal_vec(&mut rng, 32, scale);
                    w[3] = -w[7]; // a tie in magnitude
                    let top = w.iter().map(|v| v.to_bits() & 0x7FFF_FFFF).max().unwrap();
                    let m = w[w
                        .iter()
                        .position(|v| v.to_bits() & 0x7FFF_FFFF == top)
                        .unwrap()];
                    assert_eq!(absmax_scale(dtype, m), quantize_group_sym_scale(dtype, &w));
                }
            }
        }
    }

    #[test]
    fn scale_conversions_are_the_half_crate_ones() {
        let mut rng = SplitMix64::new(6);
        for dtype in [ScaleDtype::Bf16, ScaleDtype::F16] {
            for _ in 0..20_000 {
                let v = f32::from_bits(rng.next_u64() as u32 & 0x7FFF_FFFF);
                if !v.is_nan() {
                    assert_eq!(scale_bits(dtype, v), dtype.from_f32(v), "{v:e}");
                }
                let b = rng.next_u64() as u16;
                let x = dtype.to_f32(b);
                if !x.is_nan() {
                    assert_eq!(scale_value(dtype, b).to_bits(), x.to_bits());
                }
            }
        }
    }

    #[test]
    fn exact_sums_are_detected_soundly() {
        // One weight 2^-43 of the largest: products with it are not multiples of 2^(hi - 42).
        let mut w = [1.0f32; 32];
        w[4] = 1.0 / (1u64 << 43) as f32;
        let top = 1f32.to_bits();
        assert!(!sums_are_exact(top, &w.map(|v| v as f64)));
        w[4] = 1.0 / (1u64 << 40) as f32;
        assert!(sums_are_exact(top, &w.map(|v| v as f64)));
        assert!(sums_are_exact(0, &[0f64; 32]));
    }

    /// The bounds of every evaluation path contain the in-order error sum they stand for.
    #[test]
    fn error_bounds_contain_the_in_order_sum() {
        check_bounds(Portable);
        #[cfg(target_arch = "x86_64")]
        if let Some(k) = Avx2::detect() {
            check_bounds(k);
        }
    }

    fn check_bounds<K: Kernels>(k: K) {
        let mut rng = SplitMix64::new(8);
        let mut memo = Memo::new();
        for dtype in [ScaleDtype::Bf16, ScaleDtype::F16] {
            let x = mixed_groups(&mut rng, 27 * 6, 32);
            for w in x.chunks_exact(32) {
                let w: &[f32; 32] = w.try_into().unwrap();
                memo.clear();
                let s = Search::new(dtype, w, &mut memo, k);
                let m = w.iter().fold(0f32, |m, v| m.max(v.abs()));
                for _ in 0..8 {
                    let d = m as f64 / (rng.normal() * 4.0);
                    let (bits, zero) = (s.round_scale(d), (rng.next_u64() % 16) as u8);
                    if !scale_value(dtype, bits).is_finite() {
                        continue;
                    }
                    let (sums, err) = (s.sums(bits, zero), s.seq_err(bits, zero));
                    assert!(sums.lo <= err && err <= sums.hi, "{sums:?} {err:e}");
                }
            }
        }
    }

    /// Overlapping bounds fall back to the in-order sums: the strictly smaller one wins.
    #[test]
    fn near_ties_are_decided_by_the_in_order_sums() {
        let mut rng = SplitMix64::new(9);
        let w: [f32; 32] = std::array::from_fn(|_| rng.normal() as f32);
        let mut memo = Memo::new();
        let mut s = Search::new(ScaleDtype::Bf16, &w, &mut memo, Portable);
        let (a, b) = (s.round_scale(0.3), s.round_scale(0.31));
        let (ea, eb) = (s.seq_err(a, 8), s.seq_err(b, 8));
        let (worse, better) = if ea < eb { (b, a) } else { (a, b) };
        let wide = Eval {
            lo: 0.0,
            hi: 1e30,
            next: None,
        };
        for (first, second, winner) in [(worse, better, better), (better, worse, better)] {
            s.best.exact = Some(f64::INFINITY);
            s.best.hi = f64::INFINITY;
            s.best.lo = f64::INFINITY;
            s.consider(first, 8, wide);
            assert_eq!(s.best.bits, first);
            s.consider(second, 8, wide);
            assert_eq!(s.best.bits, winner);
            s.consider(first, 8, wide); // a repeat or an equal error never replaces
            assert_eq!(s.best.bits, winner);
        }
    }
}
