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

use crate::contract::round_half_even_small;
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

    /// `sqrt(diff / norm)`: 0 for an all-zero source reproduced exactly, infinite for one
    /// reproduced inexactly.
    pub fn relative(&self) -> f64 {
        let (diff, norm) = (self.diff(), self.norm());
        if norm == 0.0 {
            if diff == 0.0 { 0.0 } else { f64::INFINITY }
        } else {
            (diff / norm).sqrt()
        }
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

/// Writes the codes of group `w` (a multiple of 32 finite weights) under scale `d` (the stored
/// scale's f32 value) and zero point `z` into `out` (`w.len() / 2` bytes, the canonical nibble
/// order: element `j` of each block in the low nibble of byte `j`, element `j + 16` in its
/// high nibble), and adds the group's reconstruction error and norm to `sums`.
pub(super) fn write_group(w: &[f32], d: f32, z: u8, out: &mut [u8], sums: &mut SquaredError) {
    assert_eq!(w.len() % BLOCK, 0, "write_group: a group is whole blocks");
    assert_eq!(out.len(), w.len() / 2, "write_group: output length");
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F.
            return unsafe { write_group_avx512(w, d, z, out, sums) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2.
            return unsafe { write_group_avx2(w, d, z, out, sums) };
        }
    }
    write_group_plain(w, d, z, out, sums)
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
                // The scalar rule's steps (`super::code`), in the same order.
                let t = round_half_even_small((v / d).clamp(-32.0, 32.0));
                let q = (t + zf).clamp(0.0, 15.0);
                // SAFETY: `q` is finite and in 0..=15 (a finite `v` over a non-zero finite `d`
                // is not NaN, and both clamps keep it finite); unlike `as`, this converts in
                // vector registers (no saturation fix-ups per lane).
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

    #[cfg(target_arch = "x86_64")]
    type Kernel = unsafe fn(&[f32], f32, u8, &mut [u8], &mut SquaredError);

    /// Groups and scales of every kind: ordinary, half-steps of the scale (where the rounding
    /// decides), clipped weights, zero points, and a zero scale.
    fn cases() -> Vec<(Vec<f32>, f32, u8)> {
        let mut rng = SplitMix64::new(0xC0DE5);
        let mut out = Vec::new();
        for gs in [32usize, 64, 128] {
            for s in [1e-6, 0.02, 3.0] {
                let w: Vec<f32> = (0..gs).map(|_| (rng.normal() * s) as f32).collect();
                let amax = w.iter().fold(0f32, |m, v| m.max(v.abs()));
                for (d, z) in [(amax / 7.0, 8), (amax / 4.0, 8), (amax / 15.0, 3), (0.0, 8)] {
                    out.push((w.clone(), d, z));
                }
                let d = 0.125f32;
                let halves: Vec<f32> = (0..gs)
                    .map(|i| d * ((i % 19) as f32 - 9.5) + if i % 3 == 0 { 1e-9 } else { 0.0 })
                    .collect();
                out.push((halves, d, 8));
            }
        }
        out
    }

    /// The scalar rule's bytes and an f64 reference of the sums, element by element.
    fn reference(w: &[f32], d: f32, z: u8) -> (Vec<u8>, f64, f64) {
        let codes: Vec<u8> = w.iter().map(|&v| super::super::code(v, d, z)).collect();
        let mut bytes = Vec::new();
        for block in codes.chunks_exact(BLOCK) {
            for j in 0..BLOCK_BYTES {
                bytes.push(block[j] | block[j + BLOCK_BYTES] << 4);
            }
        }
        let (mut diff, mut norm) = (0f64, 0f64);
        for (&v, &q) in w.iter().zip(&codes) {
            let y = super::super::exact::dequantized(v, d, z);
            assert_eq!(
                y,
                if d == 0.0 {
                    0.0
                } else {
                    d * (q as f32 - z as f32)
                }
            );
            diff += (f64::from(v) - f64::from(y)).powi(2);
            norm += f64::from(v).powi(2);
        }
        (bytes, diff, norm)
    }

    /// Every level the CPU runs writes the scalar rule's codes, and the same sums bit for bit
    /// as the portable body; the sums agree with an element-order f64 reference to 1e-12.
    #[test]
    fn every_level_writes_the_scalar_rule_and_the_same_sums() {
        for (w, d, z) in cases() {
            let (want, diff, norm) = reference(&w, d, z);
            let mut plain = (vec![0u8; w.len() / 2], SquaredError::default());
            write_group_plain(&w, d, z, &mut plain.0, &mut plain.1);
            assert_eq!(plain.0, want, "plain codes, d {d:e} z {z}: {w:?}");
            let close = |a: f64, b: f64| (a - b).abs() <= 1e-12 * b.abs().max(f64::MIN_POSITIVE);
            assert!(close(plain.1.diff(), diff), "{} vs {diff}", plain.1.diff());
            assert!(close(plain.1.norm(), norm), "{} vs {norm}", plain.1.norm());
            let mut got = (vec![0u8; w.len() / 2], SquaredError::default());
            write_group(&w, d, z, &mut got.0, &mut got.1);
            assert_eq!(got, plain, "the detected level against the portable body");
            #[cfg(target_arch = "x86_64")]
            for (level, run) in [
                ("avx512f", write_group_avx512 as Kernel),
                ("avx2", write_group_avx2 as Kernel),
            ] {
                if !std::is_x86_feature_detected!("avx512f") && level == "avx512f"
                    || !std::is_x86_feature_detected!("avx2") && level == "avx2"
                {
                    eprintln!("skipped: {level} (this CPU has none)");
                    continue;
                }
                let mut got = (vec![0u8; w.len() / 2], SquaredError::default());
                // SAFETY: the CPU has the level's features (checked above).
                unsafe { run(&w, d, z, &mut got.0, &mut got.1) };
                assert_eq!(got, plain, "{level} against the portable body");
            }
        }
    }

    #[test]
    fn relative_error_of_zero_sources() {
        let mut s = SquaredError::default();
        assert_eq!(s.relative(), 0.0);
        let mut out = [0u8; 16];
        write_group(&[0.0; 32], 0.5, 8, &mut out, &mut s);
        assert_eq!((s.relative(), out), (0.0, [0x88; 16]));
        write_group(&[1.0; 32], 0.0, 8, &mut out, &mut s);
        assert_eq!(s.diff(), 32.0);
        assert_eq!(s.relative(), 1.0);
    }
}
