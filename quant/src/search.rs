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
//! quantizer is deterministic (sequential, no floating-point reassociation) and allocates only
//! the output and, for 16-bit inputs, one row of f32 scratch.
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

use crate::format::{
    DEFAULT_ZERO, FormatError, PackedMatrix, QuantSpec, ScaleDtype, check_len, quantize_group_asym,
    quantize_group_sym_scale,
};
use half::{bf16, f16};

/// Tensor name used in errors from the searched quantizer.
const WHAT: &str = "searched quantizer input";
/// Rounds of one-ulp local search after the candidate sweep.
const POLISH_ROUNDS: usize = 48;
/// Size of the ring of recently evaluated candidates.
const SEEN: usize = 32;
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
    for n in 0..rows {
        fill_row(n, &mut row);
        quantize_row(&mut m, n, &row)?;
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

/// Quantize one row (all its groups) into row `n` of `m`.
fn quantize_row(m: &mut PackedMatrix, n: usize, row: &[f32]) -> Result<(), FormatError> {
    if let Some(col) = row.iter().position(|v| !v.is_finite()) {
        return Err(FormatError::NonFiniteWeight {
            what: WHAT,
            row: n,
            col,
            value: row[col],
        });
    }
    let spec = m.spec();
    let gs = spec.group();
    let groups = m.groups_per_row();
    for (g, w) in row.chunks_exact(gs).enumerate() {
        let best = if spec.zero_points {
            search_asym(spec.scale_dtype, w)
        } else {
            search_sym(spec.scale_dtype, w)
        };
        let d = spec.scale_dtype.to_f32(best.bits);
        m.scales_mut()[n * groups + g] = best.bits;
        m.set_zero(n, g, best.zero);
        for (i, &v) in w.iter().enumerate() {
            m.set_code(n, g * gs + i, code(v, d, best.zero));
        }
    }
    Ok(())
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
        (rne32((v / d).clamp(-32.0, 32.0)) + z as f32).clamp(0.0, 15.0) as u8
    }
}

/// Round half to even for `|x| ≤ 2^22`.
#[inline(always)]
fn rne32(x: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 · 2^23
    (x + MAGIC) - MAGIC
}

/// Round half to even for `|x| ≤ 2^51`.
#[inline(always)]
fn rne64(x: f64) -> f64 {
    const MAGIC: f64 = 6_755_399_441_055_744.0; // 1.5 · 2^52
    (x + MAGIC) - MAGIC
}

/// Squared error (f64) of a group stored with scale `d` and zero point `z`.
fn group_error(w: &[f32], d: f32, z: u8) -> f64 {
    if !d.is_finite() {
        return f64::INFINITY;
    }
    let zf = z as f32;
    let mut err = 0f64;
    for &v in w {
        let deq = d * (code(v, d, z) as f32 - zf);
        let r = v as f64 - deq as f64;
        err += r * r;
    }
    err
}

/// One stored choice for a group and the squared error it gives.
#[derive(Clone, Copy, Debug)]
struct Choice {
    bits: u16,
    zero: u8,
    err: f64,
}

/// Search state of one group: its weights and the best choice so far.
struct Search<'a> {
    w: &'a [f32],
    dtype: ScaleDtype,
    max_mag: u16,
    best: Choice,
    /// Recently evaluated `(bits, zero)` pairs (a ring), so repeats cost no pass over `w`.
    seen: [(u16, u8); SEEN],
    seen_len: usize,
}

impl<'a> Search<'a> {
    fn new(dtype: ScaleDtype, w: &'a [f32]) -> Self {
        Self {
            w,
            dtype,
            max_mag: max_scale(dtype),
            best: Choice {
                bits: 0,
                zero: DEFAULT_ZERO,
                err: f64::INFINITY,
            },
            seen: [(0, 0); SEEN],
            seen_len: 0,
        }
    }

    /// Evaluate stored scale bits `bits` with zero point `zero`; keep it if strictly better.
    fn try_bits(&mut self, bits: u16, zero: u8) {
        let filled = self.seen_len.min(SEEN);
        if self.seen[..filled].contains(&(bits, zero)) {
            return;
        }
        self.seen[self.seen_len % SEEN] = (bits, zero);
        self.seen_len += 1;
        let err = group_error(self.w, self.dtype.to_f32(bits), zero);
        if err < self.best.err {
            self.best = Choice { bits, zero, err };
        }
    }

    /// Round an f64 scale to the 16-bit type, clamping its magnitude to [`max_scale`]; a scale
    /// that rounds to zero becomes +0.
    fn round_scale(&self, s: f64) -> u16 {
        let max = self.dtype.to_f32(self.max_mag) as f64;
        let bits = self.dtype.from_f32(s.abs().min(max) as f32);
        let bits = bits.min(self.max_mag);
        if bits == 0 {
            0
        } else if s < 0.0 {
            bits | 0x8000
        } else {
            bits
        }
    }

    /// Try the least-squares scale `s` with zero point `z`, then re-fit it to its own codes.
    fn try_scale(&mut self, s: f64, z: u8) {
        if !s.is_finite() {
            return;
        }
        let bits = self.round_scale(s);
        self.try_bits(bits, z);
        self.refit(bits, z);
    }

    /// Least-squares re-fit of the scale for fixed codes (derived from `bits`) and zero `z`,
    /// repeated while the rounded scale changes.
    fn refit(&mut self, mut bits: u16, z: u8) {
        for _ in 0..REFIT_ROUNDS {
            let d = self.dtype.to_f32(bits);
            if d == 0.0 || !d.is_finite() {
                return;
            }
            let (mut sxe, mut see) = (0f64, 0f64);
            for &v in self.w {
                let e = code(v, d, z) as f64 - z as f64;
                sxe += v as f64 * e;
                see += e * e;
            }
            if see == 0.0 {
                return;
            }
            let next = self.round_scale(sxe / see);
            if next == bits {
                return;
            }
            self.try_bits(next, z);
            bits = next;
        }
    }

    /// Local search: step the best scale by one ulp (and, when `free_zero`, the zero point by
    /// ±1 with a re-fit) while that strictly lowers the error.
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
                        self.try_bits(start.bits, nz);
                        self.refit(start.bits, nz);
                    }
                }
            }
            if self.best.bits == start.bits && self.best.zero == start.zero {
                return;
            }
        }
    }
}

/// Symmetric search (zero point 8); see the module docs.
fn search_sym(dtype: ScaleDtype, w: &[f32]) -> Choice {
    let mut s = Search::new(dtype, w);
    // Absmax round-to-nearest first, so the result is never worse than it.
    s.try_bits(quantize_group_sym_scale(dtype, w), DEFAULT_ZERO);
    let mut m = 0f32;
    for &v in w {
        if v.abs() > m.abs() {
            m = v;
        }
    }
    if m == 0.0 {
        return s.best;
    }
    s.try_bits(0, DEFAULT_ZERO);
    // Map m near code -8 (targets -7.0 ..= -9.0) and near code +7 (targets 6.0 ..= 8.0).
    let targets = (0..=10)
        .map(|i| -(7.0 + 0.2 * i as f64))
        .chain((0..=5).map(|i| 6.0 + 0.4 * i as f64));
    for t in targets {
        let inv = t / m as f64;
        let (mut sxl, mut sll) = (0f64, 0f64);
        for &v in w {
            let l = rne64((inv * v as f64).clamp(-8.0, 7.0));
            sxl += v as f64 * l;
            sll += l * l;
        }
        if sll > 0.0 {
            s.try_scale(sxl / sll, DEFAULT_ZERO);
        }
    }
    s.polish(false);
    s.best
}

/// Asymmetric search (scale and u4 zero point); see the module docs.
fn search_asym(dtype: ScaleDtype, w: &[f32]) -> Choice {
    let mut s = Search::new(dtype, w);
    let (bits, zero) = quantize_group_asym(dtype, w);
    s.try_bits(bits, zero);
    let lo = w.iter().copied().fold(0f32, f32::min) as f64;
    let hi = w.iter().copied().fold(0f32, f32::max) as f64;
    if hi == lo {
        return s.best;
    }
    s.try_bits(0, DEFAULT_ZERO);
    let n = w.len() as f64;
    for i in 0..=12 {
        let inv = (14.0 + 0.2 * i as f64) / (hi - lo);
        let (mut sl, mut sll, mut sx, mut sxl) = (0f64, 0f64, 0f64, 0f64);
        for &v in w {
            let l = rne64((inv * (v as f64 - lo)).clamp(0.0, 15.0));
            sl += l;
            sll += l * l;
            sx += v as f64;
            sxl += v as f64 * l;
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
        let d = dtype.to_f32(s.round_scale(a)) as f64;
        if d == 0.0 {
            continue;
        }
        // Both integer neighbours of the real zero point, each with a re-fitted scale.
        let zr = (-b / d).clamp(0.0, 15.0);
        s.try_scale(a, zr.floor() as u8);
        s.try_scale(a, zr.ceil() as u8);
    }
    s.polish(true);
    s.best
}
