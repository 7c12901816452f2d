//! The positive 16-bit scale grid: every finite positive value a stored scale can take.
//!
//! Why this exists: the search works on real-valued scales (a group's error is piecewise
//! quadratic in the scale) and must then name the stored values next to a real one. Positive
//! f16 and bf16 values are ordered like their bit patterns, so "the largest stored scale at or
//! below `x`" is a bit pattern found by rounding and one or two steps.

use crate::format::ScaleDtype;
use half::f16;

/// The positive finite values of one 16-bit scale type, by bit pattern `1 ..= max_bits`.
#[derive(Clone, Copy, Debug)]
pub(super) struct Grid {
    dtype: ScaleDtype,
    max_bits: u16,
    max_value: f64,
    min_value: f64,
}

impl Grid {
    pub(super) fn new(dtype: ScaleDtype) -> Self {
        let max_bits = super::max_scale(dtype);
        let mut g = Self {
            dtype,
            max_bits,
            max_value: 0.0,
            min_value: 0.0,
        };
        g.max_value = g.value(max_bits);
        g.min_value = g.value(1);
        g
    }

    /// The largest positive value (the type's largest finite value).
    #[inline(always)]
    pub(super) fn max_value(self) -> f64 {
        self.max_value
    }

    /// The value of the positive pattern `bits` (`1 ..= max_bits`), exactly.
    #[inline(always)]
    pub(super) fn value(self, bits: u16) -> f64 {
        match self.dtype {
            ScaleDtype::F16 => f16::from_bits(bits).to_f64(),
            ScaleDtype::Bf16 => f32::from_bits((bits as u32) << 16) as f64,
        }
    }

    /// The pattern of the largest positive value `≤ x`, if there is one (`x` not NaN).
    #[inline]
    pub(super) fn floor(self, x: f64) -> Option<u16> {
        if x >= self.max_value {
            return Some(self.max_bits);
        }
        if x < self.min_value {
            return None;
        }
        let mut b = self.near(x);
        while self.value(b) > x {
            b -= 1;
        }
        while b < self.max_bits && self.value(b + 1) <= x {
            b += 1;
        }
        Some(b)
    }

    /// The pattern of the smallest positive value `≥ x`, if there is one (`x` not NaN).
    #[inline]
    pub(super) fn ceil(self, x: f64) -> Option<u16> {
        if x > self.max_value {
            return None;
        }
        if x <= self.min_value {
            return Some(1);
        }
        let mut b = self.near(x);
        while self.value(b) < x {
            b += 1;
        }
        while b > 1 && self.value(b - 1) >= x {
            b -= 1;
        }
        Some(b)
    }

    /// A pattern within one step of `x` (`min_value ≤ x < max_value`).
    #[inline(always)]
    fn near(self, x: f64) -> u16 {
        let f = x as f32;
        let b = match self.dtype {
            ScaleDtype::F16 => f16::from_f32(f).to_bits(),
            ScaleDtype::Bf16 => (f.to_bits() >> 16) as u16,
        };
        b.clamp(1, self.max_bits)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Floor and ceil against a scan of every pattern, at every value, between values and
    /// outside the range.
    #[test]
    fn floor_and_ceil_match_a_scan() {
        for dtype in [ScaleDtype::F16, ScaleDtype::Bf16] {
            let g = Grid::new(dtype);
            let values: Vec<f64> = (1..=g.max_bits).map(|b| g.value(b)).collect();
            assert!(
                values.windows(2).all(|w| w[0] < w[1]),
                "{dtype:?} not ordered"
            );
            let scan_floor = |x: f64| values.iter().rposition(|&v| v <= x).map(|i| i as u16 + 1);
            let scan_ceil = |x: f64| values.iter().position(|&v| v >= x).map(|i| i as u16 + 1);
            let mut probes = vec![0.0, f64::MIN_POSITIVE, 1e300, f64::INFINITY];
            for (i, &v) in values.iter().enumerate().step_by(7) {
                probes.extend([v, v * (1.0 + 1e-9), v * (1.0 - 1e-9)]);
                if i + 1 < values.len() {
                    probes.push((v + values[i + 1]) / 2.0);
                }
            }
            for x in probes {
                assert_eq!(g.floor(x), scan_floor(x), "{dtype:?} floor({x:e})");
                assert_eq!(g.ceil(x), scan_ceil(x), "{dtype:?} ceil({x:e})");
            }
        }
    }
}
