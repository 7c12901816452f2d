//! What the search minimises, evaluated exactly: a choice's squared error under the stored rule,
//! and the total order on choices (error, then a tie-break) that defines the searched result.
//!
//! Why this exists: "the optimum" is only well defined if two choices whose errors differ in
//! the last bit of an f64 sum (or not at all) are ordered the same way on every machine and by
//! every implementation, the exhaustive test oracle included. The search and the oracle both
//! compare errors here: an f64 sum first (all terms are non-negative, so it is within `2^-45`
//! of the exact value), and only when two sums are that close, the exact real sums as
//! floating-point expansions (Shewchuk's error-free sums and products), which never round.

use crate::format::ScaleDtype;
use std::cmp::Ordering;

/// A stored choice for one group: the scale's 16-bit pattern (sign included) and the zero
/// point (8 for symmetric groups).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Choice {
    /// The scale's bit pattern in the spec's [`crate::format::ScaleDtype`].
    pub bits: u16,
    /// The zero point, `0 ..= 15`.
    pub zero: u8,
}

impl Choice {
    /// The tie-break among choices of equal error: the smaller scale magnitude, then a
    /// positive scale, then the smaller zero point. A zero scale (`+0` or `-0`) is first.
    pub(super) fn tie_key(self) -> (u16, u16, u8) {
        let mag = self.bits & 0x7FFF;
        if mag == 0 {
            (0, 0, 0)
        } else {
            (mag, self.bits >> 15, self.zero)
        }
    }
}

/// The dequantized value of weight `v` under scale `d` (f32, stored value) and zero point `z`:
/// `d · (q - z)` with `q = clamp(round_half_even(v / d) + z, 0, 15)` (`q = z` when `d = 0`),
/// computed in f32 as every dequantizer does. Exact: `d` has at most 11 significant bits and
/// `|q - z| ≤ 15`, so the product rounds only when it overflows.
#[inline(always)]
pub(super) fn dequantized(v: f32, d: f32, z: u8) -> f32 {
    d * (super::code(v, d, z) as f32 - z as f32)
}

/// The squared error of `choice` on group `w` as an f64 sum in element order (within `2^-45`
/// of the exact sum, all terms being non-negative and each rounded at most three times), or
/// `None` when a dequantized value overflows f32 (such a choice is never stored).
pub(super) fn error_f64(w: &[f32], d: f32, zero: u8) -> Option<f64> {
    let mut sum = 0f64;
    for &v in w {
        let y = dequantized(v, d, zero);
        if !y.is_finite() {
            return None;
        }
        let r = v as f64 - y as f64;
        sum += r * r;
    }
    Some(sum)
}

/// The order the search minimises: the exact squared error of each choice on `w` (a choice
/// whose dequantized values overflow f32 is above every other), then [`Choice`]'s tie-break.
///
/// The scales are patterns of `dtype`; NaN and infinite patterns are not choices (they order as
/// overflowing ones).
pub fn order(w: &[f32], dtype: ScaleDtype, a: Choice, b: Choice) -> Ordering {
    let (da, db) = (dtype.to_f32(a.bits), dtype.to_f32(b.bits));
    let by_error = match (error_f64(w, da, a.zero), error_f64(w, db, b.zero)) {
        (None, None) => Ordering::Equal,
        (None, Some(_)) => Ordering::Greater,
        (Some(_), None) => Ordering::Less,
        (Some(ea), Some(eb)) => compare_errors(w, (da, a.zero, ea), (db, b.zero, eb)),
    };
    by_error.then_with(|| a.tie_key().cmp(&b.tie_key()))
}

/// The least of `choices` in [`order`] on `w` (choices whose dequantized values overflow are
/// skipped), or the zero scale when none is left: how both searches settle their finalists.
pub(super) fn least(w: &[f32], dtype: ScaleDtype, choices: impl Iterator<Item = Choice>) -> Choice {
    let mut best: Option<(Choice, f32, f64)> = None;
    for c in choices {
        let d = dtype.to_f32(c.bits);
        let Some(e) = error_f64(w, d, c.zero) else {
            continue;
        };
        let better = match best {
            None => true,
            Some((b, bd, be)) => match compare_errors(w, (d, c.zero, e), (bd, b.zero, be)) {
                Ordering::Less => true,
                Ordering::Greater => false,
                Ordering::Equal => c.tie_key() < b.tie_key(),
            },
        };
        if better {
            best = Some((c, d, e));
        }
    }
    best.map_or(Choice { bits: 0, zero: 8 }, |b| b.0)
}

/// Compare two choices' exact errors, given their f64 sums from [`error_f64`].
pub(super) fn compare_errors(w: &[f32], a: (f32, u8, f64), b: (f32, u8, f64)) -> Ordering {
    // Each sum is within 2^-45 (relative) of its exact value.
    const NEAR: f64 = 1.0 / (1u64 << 43) as f64;
    let (ea, eb) = (a.2, b.2);
    if ea < eb - NEAR * eb {
        return Ordering::Less;
    }
    if eb < ea - NEAR * ea {
        return Ordering::Greater;
    }
    let mut diff = Expansion::default();
    for &v in w {
        diff.add_square(v as f64, dequantized(v, a.0, a.1) as f64, 1.0);
        diff.add_square(v as f64, dequantized(v, b.0, b.1) as f64, -1.0);
    }
    diff.sign()
}

/// `(a + b, the rounding error of a + b)`: exact, `s + e = a + b` (Knuth's TwoSum).
#[inline(always)]
fn two_sum(a: f64, b: f64) -> (f64, f64) {
    let s = a + b;
    let bb = s - a;
    (s, (a - (s - bb)) + (b - bb))
}

/// `(a · b, the rounding error of a · b)`: exact when the product neither overflows nor comes
/// within `2^-969` of underflow (products of f32-sized values here are far from both).
#[inline(always)]
fn two_prod(a: f64, b: f64) -> (f64, f64) {
    let p = a * b;
    (p, a.mul_add(b, -p))
}

/// A real number held exactly as a sum of non-overlapping f64 components in increasing
/// magnitude, zeros removed (Shewchuk's `GROW-EXPANSION-ZEROELIM`); its sign is its largest
/// component's.
#[derive(Default, Debug)]
pub(super) struct Expansion(Vec<f64>);

impl Expansion {
    /// Add `x` exactly.
    pub(super) fn add(&mut self, x: f64) {
        let mut q = x;
        let mut kept = 0;
        for i in 0..self.0.len() {
            let (s, h) = two_sum(q, self.0[i]);
            q = s;
            if h != 0.0 {
                self.0[kept] = h;
                kept += 1;
            }
        }
        self.0.truncate(kept);
        if q != 0.0 {
            self.0.push(q);
        }
    }

    /// Add `sign · (v - y)²` exactly, for f32-sized `v` and `y` given as f64.
    pub(super) fn add_square(&mut self, v: f64, y: f64, sign: f64) {
        let (s, t) = two_sum(v, -y);
        for (p, e) in [two_prod(s, s), two_prod(2.0 * s, t), two_prod(t, t)] {
            self.add(sign * p);
            self.add(sign * e);
        }
    }

    /// The sign of the exact value.
    pub(super) fn sign(&self) -> Ordering {
        match self.0.last() {
            None => Ordering::Equal,
            Some(&x) => x.partial_cmp(&0.0).expect("finite components"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An exact reference on integer-valued weights and dequantized values (|x| < 2^40):
    /// squares and sums in i128.
    fn exact_i128(pairs: &[(f64, f64)]) -> i128 {
        pairs
            .iter()
            .map(|&(v, y)| {
                let r = v as i128 - y as i128;
                r * r
            })
            .sum()
    }

    #[test]
    fn expansion_signs_match_integer_arithmetic() {
        let mut rng = crate::synth::SplitMix64::new(5);
        for case in 0..2000 {
            let n = 1 + case % 40;
            // Two sets of (v, y) with nearly equal sums: the second set perturbs one term.
            let a: Vec<(f64, f64)> = (0..n)
                .map(|_| {
                    let v = (rng.normal() * 1e6).round();
                    (v, (v + (rng.normal() * 1e3).round()))
                })
                .collect();
            let mut b = a.clone();
            b.reverse();
            let k = case % n;
            b[k].1 += [0.0, 1.0, -1.0][case % 3];
            let mut e = Expansion::default();
            for &(v, y) in &a {
                e.add_square(v, y, 1.0);
            }
            for &(v, y) in &b {
                e.add_square(v, y, -1.0);
            }
            assert_eq!(e.sign(), exact_i128(&a).cmp(&exact_i128(&b)), "case {case}");
        }
    }

    #[test]
    fn tiny_differences_on_large_values_are_seen() {
        // (2^30 + 1)² - (2^30)² needs more than f64's 53 bits next to 2^60.
        let mut e = Expansion::default();
        e.add_square(2f64.powi(30) + 1.0, 0.0, 1.0);
        e.add_square(2f64.powi(30), 0.0, -1.0);
        e.add(-(2f64.powi(31)));
        assert_eq!(e.sign(), Ordering::Greater);
        e.add(-1.0);
        assert_eq!(e.sign(), Ordering::Equal);
        // Magnitudes near the f32 extremes.
        let mut e = Expansion::default();
        e.add_square(f32::MAX as f64, 0.0, 1.0);
        e.add_square(f32::MAX as f64, 2f64.powi(-149), -1.0);
        assert_eq!(e.sign(), Ordering::Greater);
    }
}
