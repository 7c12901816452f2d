//! The searched INT4 quantizer: for every group, the stored scale (and zero point) of least
//! squared error, over every finite 16-bit scale.
//!
//! Why this exists: absmax round-to-nearest ([`PackedMatrix::quantize`]) maps each group's
//! largest element exactly onto a code, which wastes resolution on one outlier per group, and
//! cannot reproduce weights that already lie on an INT4 grid unless the grid's largest code is
//! the absmax one (quantization-aware-trained models published in bf16 are like that: a
//! power-of-two scale whose largest code in a group may be anything from 4 to 7). The
//! checkpoint converter wants the lowest reconstruction error the canonical layout allows.
//!
//! # What is minimised
//!
//! A choice is a stored scale `d` (a finite f16 or bf16 value, either sign, or zero) and a zero
//! point `z` (8 without zero points). Its codes are those of [`PackedMatrix::quantize`]'s rule,
//! `q = clamp(round_half_even(w / d) + z, 0, 15)` with the division in f32, and its error is the
//! exact real sum `Σ (w − d·(q − z))²` of the values every dequantizer computes (in f32, where
//! `d·(q − z)` is exact). A choice whose dequantized values overflow f32 is not a choice. The
//! result is the least choice in [`choice_order`]: least exact error, ties to the smaller
//! scale magnitude, then the positive scale, then the smaller zero point. It is therefore the
//! same on every machine, the same as an exhaustive search over all 65,536 patterns (and
//! sixteen zero points) finds (`tests/it/search_oracle.rs`), never worse than absmax, and
//! exactly zero for a group that some choice reproduces exactly.
//!
//! [`solve`] says how it is found without trying every scale: a sweep over the breakpoints
//! of the group's error, which is a quadratic in the scale between them. Symmetric groups with
//! bfloat16 scales (what conversion writes by default) take [`direct`] first, which finds the
//! same choice several times faster by evaluating sixteen scales per vector operation over
//! the window the sweep's bounds leave; it leaves f16 scales, zero points and magnitudes
//! outside `[2^-40, 2^40]` to the sweep, which is also its test oracle.
//!
//! # Output and limits
//!
//! The result is a [`PackedMatrix`] in the canonical layout, identical in shape to what
//! [`PackedMatrix::quantize`] writes, so the dequantizer and every kernel read it unchanged.
//!
//! * An all-zero group gets scale 0 and codes equal to its zero point (8), so it dequantizes
//!   to 0.
//! * A NaN or infinite weight is an error ([`FormatError::NonFiniteWeight`]) naming its row and
//!   column.
//! * **Scales never overflow**: they range over the 16-bit type's finite values (f16: up to
//!   65504, [`max_scale`]), so weights beyond what the largest scale reaches (f16:
//!   `|w| > 8 · 65504`) are clipped to the nearest representable value instead of failing with
//!   [`FormatError::ScaleOverflow`] as [`PackedMatrix::quantize`] does.
//! * It allocates the output, one row of f32 scratch, and a few small buffers per call.

mod codes;
pub mod direct;
mod exact;
mod grid;
mod solve;

pub use codes::SquaredError;
pub use exact::{Choice, order as choice_order};

use crate::format::{FormatError, PackedMatrix, QuantSpec, ScaleDtype, check_len};
use half::{bf16, f16};

/// Tensor name used in errors from the searched quantizer.
const WHAT: &str = "searched quantizer input";

/// Quantize a dense row-major `[rows][cols]` f32 matrix with the searched quantizer.
///
/// Same layout as [`PackedMatrix::quantize`]; see the module docs for what is minimised and
/// the all-zero, non-finite and scale-range rules.
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
    fill_row: impl FnMut(usize, &mut [f32]),
) -> Result<PackedMatrix, FormatError> {
    quantize_rows_measured(rows, cols, spec, fill_row).map(|(m, _)| m)
}

/// [`quantize_rows_searched`], also returning what the quantization lost: the squared error
/// of the dequantized matrix against the rows as they were read, and their squared norm
/// ([`SquaredError`], measured while the codes are written: no second read of the source).
pub fn quantize_rows_measured(
    rows: usize,
    cols: usize,
    spec: QuantSpec,
    mut fill_row: impl FnMut(usize, &mut [f32]),
) -> Result<(PackedMatrix, SquaredError), FormatError> {
    let mut m = PackedMatrix::zeroed(WHAT, spec, rows, cols)?;
    let mut row = vec![0f32; cols];
    let gs = spec.group();
    let mut solver = solve::Solver::new(spec.scale_dtype, spec.zero_points, gs);
    let mut sums = SquaredError::default();
    let writer = codes::GroupWriter::detect();
    for n in 0..rows {
        fill_row(n, &mut row);
        if let Some(col) = row.iter().position(|v| !v.is_finite()) {
            return Err(FormatError::NonFiniteWeight {
                what: WHAT,
                row: n,
                col,
                value: row[col],
            });
        }
        let groups = m.groups_per_row();
        let row_start = n * m.row_bytes();
        for (g, w) in row.chunks_exact(gs).enumerate() {
            let c = solver.solve(w);
            m.scales_mut()[n * groups + g] = c.bits;
            m.set_zero(n, g, c.zero);
            let start = row_start + g * gs / 2;
            let out = &mut m.nibbles_mut()[start..start + gs / 2];
            writer.write(w, spec.scale_dtype.to_f32(c.bits), c.zero, out, &mut sums);
        }
    }
    Ok((m, sums))
}

/// The best stored choice for one group of finite weights (`w.len()` is 32, 64 or 128), as
/// [`quantize_matrix_searched`] stores it.
pub fn search_group(w: &[f32], spec: QuantSpec) -> Choice {
    solve::Solver::new(spec.scale_dtype, spec.zero_points, w.len()).solve(w)
}

/// [`search_group`] by the breakpoint sweep alone, never the direct symmetric search: the
/// oracle the direct search is tested against (same result by definition, slower).
#[doc(hidden)]
pub fn search_group_sweep(w: &[f32], spec: QuantSpec) -> Choice {
    solve::Solver::sweep_only(spec.scale_dtype, spec.zero_points, w.len()).solve(w)
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
    relative_of(diff, norm)
}

/// `sqrt(diff / norm)` for a squared error `diff` and squared norm `norm`: 0 for an all-zero
/// source reproduced exactly, infinite for one reproduced inexactly.
pub fn relative_of(diff: f64, norm: f64) -> f64 {
    if norm == 0.0 {
        if diff == 0.0 { 0.0 } else { f64::INFINITY }
    } else {
        (diff / norm).sqrt()
    }
}

/// Bit pattern of the largest scale magnitude the searched quantizer stores for `dtype`: the
/// type's largest finite value (f16: 65504 = `0x7BFF`; bf16: about `3.39e38` = `0x7F7F`).
pub fn max_scale(dtype: ScaleDtype) -> u16 {
    match dtype {
        ScaleDtype::F16 => f16::MAX.to_bits(),
        ScaleDtype::Bf16 => bf16::MAX.to_bits(),
    }
}

/// The code of weight `v` under scale `d` and zero point `z`: [`PackedMatrix::quantize`]'s rule
/// (clamping `v / d` to `±32` first cannot change a code in `0..=15`).
#[inline(always)]
pub(super) fn code(v: f32, d: f32, z: u8) -> u8 {
    if d == 0.0 {
        z
    } else {
        code_value(v, d, z as f32) as u8
    }
}

/// [`code`] under a non-zero scale `d`, as an f32 holding a whole number in `0..=15` whatever
/// `v` and `d` are (NaN gives 0): `v / d` in f32, clamped to `±32` and rounded half to even in
/// two additions (no `rintf` call), plus the zero point `zf`, clamped to the codes.
#[inline(always)]
pub(super) fn code_value(v: f32, d: f32, zf: f32) -> f32 {
    let q = crate::contract::round_half_even_small((v / d).clamp(-32.0, 32.0));
    // `max` then `min`, not `clamp`: they take the number over a NaN, so the result is always
    // in range.
    #[allow(clippy::manual_clamp)]
    (q + zf).max(0.0).min(15.0)
}
