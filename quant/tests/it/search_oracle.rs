//! The searched quantizer's output is bit-identical to the straightforward implementation it
//! replaced (kept below as the oracle, module `old`): every scale, zero point and code, on
//! Gaussian, heavy-tailed, bfloat16-exact, all-zero, constant, one-sided, tiny (down to
//! subnormal) and huge (up to near `f32::MAX`) groups, groups whose weights span many binades,
//! with and without zero points, f16 and bf16 scales, groups of 32, 64 and 128.

use expertmesh_quant::format::{PackedMatrix, QuantSpec, ScaleDtype};
use expertmesh_quant::search::quantize_matrix_searched;
use expertmesh_quant::synth::SplitMix64;
use half::bf16;

/// The weight kinds of the comparison, each at the magnitude `s`.
#[derive(Clone, Copy, Debug)]
enum Kind {
    Gaussian,
    Bf16Gaussian,
    HeavyTailed,
    Zero,
    Constant,
    OneSided,
    SingleNonzero,
    /// Every fifth weight `1e-12` of the others: least-squares sums not exact in f64.
    Binades,
}

const KINDS: [Kind; 8] = [
    Kind::Gaussian,
    Kind::Bf16Gaussian,
    Kind::HeavyTailed,
    Kind::Zero,
    Kind::Constant,
    Kind::OneSided,
    Kind::SingleNonzero,
    Kind::Binades,
];

fn weight(rng: &mut SplitMix64, kind: Kind, i: usize, s: f64) -> f32 {
    let z = rng.normal();
    let v = match kind {
        Kind::Gaussian => z * s,
        Kind::Bf16Gaussian => bf16::from_f32((z * s) as f32).to_f32() as f64,
        Kind::HeavyTailed => {
            let chi = (rng.normal().powi(2) + rng.normal().powi(2) + rng.normal().powi(2)) / 3.0;
            z / chi.sqrt().max(1e-3) * s
        }
        Kind::Zero => 0.0,
        Kind::Constant => s,
        Kind::OneSided => z.abs() * s + s,
        Kind::SingleNonzero if i == 5 => z * s,
        Kind::SingleNonzero => 0.0,
        Kind::Binades if i % 5 == 0 => z * s * 1e-12,
        Kind::Binades => z * s,
    };
    (v as f32).clamp(f32::MIN, f32::MAX)
}

/// Rows of groups cycling through every kind and magnitude.
fn weights(seed: u64, rows: usize, cols: usize, gs: usize) -> Vec<f32> {
    let scales = [1e-40, 1e-30, 1e-7, 0.02, 1.0, 500.0, 4e5, 1e30, 1e37];
    let mut rng = SplitMix64::new(seed);
    let mut x = Vec::with_capacity(rows * cols);
    for g in 0..rows * cols / gs {
        let kind = KINDS[g % KINDS.len()];
        let s = scales[(g / KINDS.len()) % scales.len()];
        x.extend((0..gs).map(|i| weight(&mut rng, kind, i, s)));
    }
    x
}

/// The first group whose scale, zero point or codes differ, as a readable message.
fn first_difference(new: &PackedMatrix, old: &PackedMatrix, x: &[f32]) -> String {
    let (cols, gs) = (new.cols(), new.spec().group());
    for n in 0..new.rows() {
        for g in 0..cols / gs {
            let same = new.scales()[n * (cols / gs) + g] == old.scales()[n * (cols / gs) + g]
                && new.zero(n, g) == old.zero(n, g)
                && (g * gs..(g + 1) * gs).all(|k| new.code(n, k) == old.code(n, k));
            if !same {
                return format!(
                    "row {n} group {g}: new scale {:#06x} zero {}, old {:#06x} zero {}, weights {:?}",
                    new.scales()[n * (cols / gs) + g],
                    new.zero(n, g),
                    old.scales()[n * (cols / gs) + g],
                    old.zero(n, g),
                    &x[n * cols + g * gs..n * cols + (g + 1) * gs]
                );
            }
        }
    }
    "no group differs".into()
}

#[test]
fn searched_output_is_bit_identical_to_the_oracle() {
    for gs in [32, 64, 128] {
        for scale_dtype in [ScaleDtype::Bf16, ScaleDtype::F16] {
            for zero_points in [false, true] {
                let spec = QuantSpec {
                    group_size: gs as u32,
                    scale_dtype,
                    zero_points,
                };
                let cols = 512;
                // Every kind at every magnitude at least twice per seed.
                let rows = 2 * KINDS.len() * 9 * gs / cols + 1;
                for seed in 0..3 {
                    let x = weights(seed * 1000 + gs as u64, rows, cols, gs);
                    let new = quantize_matrix_searched(&x, rows, cols, spec).unwrap();
                    let old = old::quantize_matrix_searched(&x, rows, cols, spec).unwrap();
                    assert!(new == old, "{spec}: {}", first_difference(&new, &old, &x));
                }
            }
        }
    }
}

/// Realistic weights (Gaussian of standard deviation `1/sqrt(fan_in)`, read from bfloat16, as
/// the converter sees them) in bulk.
#[test]
fn searched_output_is_bit_identical_on_checkpoint_like_weights() {
    let (rows, cols) = (96, 1024);
    let mut rng = SplitMix64::new(0xB1D);
    let x: Vec<f32> = (0..rows * cols)
        .map(|_| bf16::from_f32((rng.normal() / 32.0) as f32).to_f32())
        .collect();
    for gs in [32, 128] {
        for zero_points in [false, true] {
            for scale_dtype in [ScaleDtype::Bf16, ScaleDtype::F16] {
                let spec = QuantSpec {
                    group_size: gs,
                    scale_dtype,
                    zero_points,
                };
                let new = quantize_matrix_searched(&x, rows, cols, spec).unwrap();
                let old = old::quantize_matrix_searched(&x, rows, cols, spec).unwrap();
                assert!(new == old, "{spec}: {}", first_difference(&new, &old, &x));
            }
        }
    }
}

/// The implementation before the speed-up, verbatim but for the crate-private helpers it
/// used (copied at the end).
mod old {
    use expertmesh_quant::format::{
        DEFAULT_ZERO, FormatError, PackedMatrix, QuantSpec, ScaleDtype,
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

    /// The searched quantizer as it was before the speed-up, over a dense f32 matrix.
    pub(super) fn quantize_matrix_searched(
        values: &[f32],
        rows: usize,
        cols: usize,
        spec: QuantSpec,
    ) -> Result<PackedMatrix, FormatError> {
        assert_eq!(rows * cols, values.len());
        quantize_rows_searched(rows, cols, spec, |n, out| {
            out.copy_from_slice(&values[n * cols..(n + 1) * cols])
        })
    }

    /// The searched quantizer over a generic row source: `fill_row(n, out)` writes row `n`'s `cols`
    /// weights into `out` (rows are requested once each, in order `0..rows`).
    ///
    /// Lets a checkpoint converter stream rows from any storage without widening a whole tensor.
    fn quantize_rows_searched(
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

    /// Bit pattern of the largest scale magnitude the searched quantizer stores for `dtype`: the
    /// type's largest finite value (f16: 65504 = `0x7BFF`; bf16: about `3.39e38` = `0x7F7F`).
    ///
    /// Candidates are clamped to it. A candidate whose dequantized values `d · (q - z)` would
    /// overflow f32 (only possible with bf16 scales near the top of the f32 range) has infinite
    /// error and is never chosen, so every dequantizer reads finite values.
    fn max_scale(dtype: ScaleDtype) -> u16 {
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

    /// Copy of the crate-private `format::quantize_group_sym_scale`.
    fn quantize_group_sym_scale(dtype: ScaleDtype, w: &[f32]) -> u16 {
        let mut m = 0f32;
        for &v in w {
            if v.abs() > m.abs() {
                m = v;
            }
        }
        let bits = dtype.from_f32(m / -8.0);
        if dtype.to_f32(bits) == 0.0 { 0 } else { bits }
    }

    /// Copy of the crate-private `format::quantize_group_asym`.
    fn quantize_group_asym(dtype: ScaleDtype, w: &[f32]) -> (u16, u8) {
        let min = w.iter().copied().fold(f32::INFINITY, f32::min);
        let max = w.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        if max == min {
            return (quantize_group_sym_scale(dtype, w), DEFAULT_ZERO);
        }
        let bits = dtype.from_f32((max - min) / 15.0);
        let d = dtype.to_f32(bits);
        if d == 0.0 {
            return (0, DEFAULT_ZERO);
        }
        let z = (-min / d).round_ties_even().clamp(0.0, 15.0) as u8;
        (bits, z)
    }
}
