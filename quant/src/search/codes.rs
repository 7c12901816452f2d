//! Writing a searched group's codes and measuring what they lose, in one vector pass.
//!
//! Why this exists: once the search has chosen a group's scale and zero point, every weight
//! still needs its code under the stored rule (`q = clamp(round_half_even(w / d) + z, 0, 15)`,
//! the division in f32), and the converter reports each expert's relative error
//! `‖x − deq(x)‖ / ‖x‖`. Written per weight in scalar code (a division each) and measured by a
//! second pass that read the source again and dequantized it, the two took about a tenth of a
//! conversion's time. Here both come from one pass over the group, compiled for AVX-512 or
//! AVX2 where the CPU has them: the codes are bit for bit the scalar rule's (the division and
//! the rounding are IEEE operations, the same in every lane), and the sums are
//! [`SquaredError`]'s eight f64 partial sums, the same on every machine.

use crate::format::{BLOCK, BLOCK_BYTES};

/// Partial sums per [`SquaredError`]: element `i` of every 32-element block adds into sum
/// `i % LANES`.
const LANES: usize = 8;

/// The squared reconstruction error `Σ (x − deq(x))²` and the squared norm `Σ x²` of the
/// weights a quantizer has coded, in f64, each the sum of [`LANES`] partial sums (element `i`
/// of every block of 32 into partial `i % 8`, in row order, added up pairwise at the end): a
/// fixed order, so the same on every machine and instruction set.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SquaredError {
    diff: [f64; LANES],
    norm: [f64; LANES],
}

impl SquaredError {
    /// `Σ (x − deq(x))²`.
    pub fn diff(&self) -> f64 {
        pairwise(self.diff)
    }

    /// `Σ x²`.
    pub fn norm(&self) -> f64 {
        pairwise(self.norm)
    }

    /// `sqrt(diff / norm)` ([`super::relative_of`]).
    pub fn relative(&self) -> f64 {
        super::relative_of(self.diff(), self.norm())
    }

    /// Both matrices' sums together (partial by partial).
    pub fn add(&mut self, other: &SquaredError) {
        for i in 0..LANES {
            self.diff[i] += other.diff[i];
            self.norm[i] += other.norm[i];
        }
    }
}

fn pairwise(v: [f64; LANES]) -> f64 {
    ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]))
}

/// Writes searched groups' codes with the widest kernel this CPU runs (chosen once, when made).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum GroupWriter {
    #[cfg(target_arch = "x86_64")]
    Avx512,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    Plain,
}

impl GroupWriter {
    /// The widest kernel this CPU runs.
    pub(super) fn detect() -> Self {
        Self::available()[0]
    }

    /// Every kernel this CPU runs, the widest first.
    fn available() -> Vec<Self> {
        let mut v = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                v.push(Self::Avx512);
            }
            if std::arch::is_x86_feature_detected!("avx2") {
                v.push(Self::Avx2);
            }
        }
        v.push(Self::Plain);
        v
    }

    /// Writes the codes of group `w` (whole blocks of 32 weights) under scale `d` (the stored
    /// scale's f32 value, either sign, or zero) and zero point `z` into `out` (`w.len() / 2`
    /// bytes, the canonical nibble order: element `j` of each block in the low nibble of byte
    /// `j`, element `j + 16` in its high nibble), and adds the group's reconstruction error and
    /// norm to `sums`. The codes are [`super::code`]'s for every input.
    pub(super) fn write(self, w: &[f32], d: f32, z: u8, out: &mut [u8], sums: &mut SquaredError) {
        assert_eq!(
            w.len() % BLOCK,
            0,
            "GroupWriter::write: a group is whole blocks"
        );
        assert_eq!(out.len(), w.len() / 2, "GroupWriter::write: output length");
        match self {
            // SAFETY: `available` found AVX-512F on this CPU.
            #[cfg(target_arch = "x86_64")]
            Self::Avx512 => unsafe { write_group_avx512(w, d, z, out, sums) },
            // SAFETY: `available` found AVX2 on this CPU.
            #[cfg(target_arch = "x86_64")]
            Self::Avx2 => unsafe { write_group_avx2(w, d, z, out, sums) },
            Self::Plain => write_group_plain(w, d, z, out, sums),
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn write_group_avx512(w: &[f32], d: f32, z: u8, out: &mut [u8], sums: &mut SquaredError) {
    write_group_plain(w, d, z, out, sums)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn write_group_avx2(w: &[f32], d: f32, z: u8, out: &mut [u8], sums: &mut SquaredError) {
    write_group_plain(w, d, z, out, sums)
}

/// The portable body every level compiles (no fused multiply-add: Rust never contracts).
#[inline(always)]
fn write_group_plain(w: &[f32], d: f32, z: u8, out: &mut [u8], sums: &mut SquaredError) {
    let zf = z as f32;
    for (block, bytes) in w.chunks_exact(BLOCK).zip(out.chunks_exact_mut(BLOCK_BYTES)) {
        let block: &[f32; BLOCK] = block.try_into().expect("a block");
        // Integers, not bytes, until the nibbles are joined: a float's cast to `u8` does not
        // vectorize.
        let mut codes = [i32::from(z); BLOCK];
        if d != 0.0 {
            for (c, &v) in codes.iter_mut().zip(block) {
                let q = super::code_value(v, d, zf);
                // SAFETY: `code_value` is a whole number in 0..=15 for every input (NaN
                // included); unlike `as`, this converts in vector registers (no saturation
                // fix-ups per lane).
                *c = unsafe { q.to_int_unchecked::<i32>() };
            }
        }
        for chunk in 0..BLOCK / LANES {
            for l in 0..LANES {
                let i = chunk * LANES + l;
                let x = block[i];
                // `d · (q − z)` in f32 as every dequantizer computes it (0 for a zero scale).
                let y = d * (codes[i] - i32::from(z)) as f32;
                let r = f64::from(x) - f64::from(y);
                sums.diff[l] += r * r;
                sums.norm[l] += f64::from(x) * f64::from(x);
            }
        }
        for j in 0..BLOCK_BYTES {
            bytes[j] = (codes[j] | codes[j + BLOCK_BYTES] << 4) as u8;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synth::SplitMix64;

    /// Groups, scales and zero points of every kind: ordinary weights under scales of either
    /// sign, zero (both signs) and subnormal; quotients past `±32` (the pre-clamp); zero points
    /// 0, 3, 8 and 15; weights on the scale's half-steps and one ulp either side of them; NaN
    /// and infinite weights.
    fn cases() -> Vec<(Vec<f32>, f32, u8)> {
        let mut rng = SplitMix64::new(0xC0DE5);
        let mut out = Vec::new();
        for gs in [32usize, 64, 128] {
            for s in [1e-6, 0.02, 3.0] {
                let w: Vec<f32> = (0..gs).map(|_| (rng.normal() * s) as f32).collect();
                let amax = w.iter().fold(0f32, |m, v| m.max(v.abs()));
                for (d, z) in [
                    (amax / 7.0, 8),
                    (-amax / 7.0, 8),
                    (amax / 4.0, 8),
                    (amax / 15.0, 3),
                    (-amax / 9.0, 0),
                    (amax / 20.0, 15),
                    (amax / 100.0, 8),
                    (1e-40, 8),
                    (0.0, 8),
                    (-0.0, 8),
                ] {
                    out.push((w.clone(), d, z));
                }
            }
            let d = 0.125f32;
            for nudge in [0i32, 1, -1] {
                let halves: Vec<f32> = (0..gs)
                    .map(|i| {
                        let v = d * ((i % 19) as f32 - 9.5);
                        match nudge {
                            1 => v.next_up(),
                            -1 => v.next_down(),
                            _ => v,
                        }
                    })
                    .collect();
                out.push((halves.clone(), d, 8));
                out.push((halves, -d, 8));
            }
            let mut odd: Vec<f32> = (0..gs).map(|i| i as f32 - 7.0).collect();
            odd[1] = f32::NAN;
            odd[2] = f32::INFINITY;
            odd[3] = f32::NEG_INFINITY;
            out.push((odd, 1.0, 8));
        }
        out
    }

    /// The scalar rule's bytes, and the sums in the documented order: element `i` into partial
    /// `i % 8`, in order, then pairwise.
    fn reference(w: &[f32], d: f32, z: u8) -> (Vec<u8>, SquaredError) {
        let codes: Vec<u8> = w.iter().map(|&v| super::super::code(v, d, z)).collect();
        let mut bytes = Vec::new();
        for block in codes.chunks_exact(BLOCK) {
            for j in 0..BLOCK_BYTES {
                bytes.push(block[j] | block[j + BLOCK_BYTES] << 4);
            }
        }
        let mut sums = SquaredError::default();
        for (i, &v) in w.iter().enumerate() {
            let y = super::super::exact::dequantized(v, d, z);
            sums.diff[i % LANES] += (f64::from(v) - f64::from(y)).powi(2);
            sums.norm[i % LANES] += f64::from(v).powi(2);
        }
        (bytes, sums)
    }

    /// Bit patterns of the partial sums (NaN compares equal to itself).
    fn bits(s: &SquaredError) -> Vec<u64> {
        s.diff.iter().chain(&s.norm).map(|v| v.to_bits()).collect()
    }

    /// Every kernel the CPU runs writes the scalar rule's codes and the documented sums, bit for
    /// bit; the sums also agree with a plain element-order f64 sum to 1e-12.
    #[test]
    fn every_kernel_writes_the_scalar_rule_and_the_documented_sums() {
        let kernels = GroupWriter::available();
        // On the real stderr: the harness captures `eprint!` of passing tests.
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), "ran: code writers {kernels:?}");
        if kernels.len() == 1 {
            let _ = writeln!(
                std::io::stderr(),
                "skipped: the vector code writers (this CPU has no AVX2)"
            );
        }
        for (w, d, z) in cases() {
            let (want, want_sums) = reference(&w, d, z);
            for &k in &kernels {
                let mut got = (vec![0u8; w.len() / 2], SquaredError::default());
                k.write(&w, d, z, &mut got.0, &mut got.1);
                assert_eq!(got.0, want, "{k:?} codes, d {d:e} z {z}: {w:?}");
                assert_eq!(bits(&got.1), bits(&want_sums), "{k:?} sums, d {d:e} z {z}");
            }
            if w.iter().all(|v| v.is_finite()) {
                let (diff, norm) = w.iter().fold((0f64, 0f64), |(a, b), &v| {
                    let y = super::super::exact::dequantized(v, d, z);
                    (
                        a + (f64::from(v) - f64::from(y)).powi(2),
                        b + f64::from(v).powi(2),
                    )
                });
                let close = |a: f64, b: f64| (a - b).abs() <= 1e-12 * b.abs();
                assert!(
                    close(want_sums.diff(), diff),
                    "{} vs {diff}",
                    want_sums.diff()
                );
                assert!(
                    close(want_sums.norm(), norm),
                    "{} vs {norm}",
                    want_sums.norm()
                );
            }
        }
    }

    /// Groups add up across calls and matrices, and the relative error follows.
    #[test]
    fn sums_add_across_groups_and_matrices() {
        let k = GroupWriter::detect();
        let mut s = SquaredError::default();
        assert_eq!(s.relative(), 0.0);
        let mut out = [0u8; 16];
        k.write(&[0.0; 32], 0.5, 8, &mut out, &mut s);
        assert_eq!((s.relative(), out), (0.0, [0x88; 16]));
        k.write(&[1.0; 32], 0.0, 8, &mut out, &mut s);
        assert_eq!((s.diff(), s.norm(), s.relative()), (32.0, 32.0, 1.0));
        let mut t = SquaredError::default();
        k.write(&[3.0; 32], 2.0, 8, &mut out, &mut t);
        // 3 / 2 = 1.5 rounds to 2: each weight comes back as 4.
        assert_eq!((t.diff(), t.norm()), (32.0, 288.0));
        s.add(&t);
        assert_eq!((s.diff(), s.norm()), (64.0, 320.0));
        assert_eq!(s.relative(), (64f64 / 320.0).sqrt());
    }
}
