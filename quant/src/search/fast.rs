//! The fast exact search for symmetric groups: the error of every stored scale in the window,
//! from code changes bucketed by scale pattern instead of sorted.
//!
//! Why this exists: the breakpoint sweep ([`super::solve`]) sorts ~95 breakpoints per group of
//! 32 and bounds each segment with grid lookups (~45 scalar cycles per breakpoint), which made
//! conversion run at a hundredth of a disk read. This search finds the same choice (the least
//! in [`super::exact::order`]) without sorting and without per-segment grid lookups, for the
//! symmetric groups with bfloat16 scales that conversion writes by default.
//!
//! # The search
//!
//! Both symmetric ranges are searched together: a positive stored scale `d` gives the codes
//! `clamp(rne(v / d), −8, 7)`, a negative one `−d` the codes `clamp(rne(v / d), −7, 8)` times
//! `d` (division and half-even rounding are odd functions). In magnitudes, an element's code is
//! `min(k, cap)` with `k = rne(|v| / d)` and a cap of 7 or 8 by its sign and the range.
//!
//! 1. The zero scale and absmax's choice bound the best error (`ub`); the sweep's window
//!    (clipping below, the small elements' cost above) bounds the scales that can beat it.
//! 2. Each element's code at the window's largest pattern is computed with the stored rule;
//!    each later step `k → k + 1` (as the scale falls) is filed under the last pattern that
//!    has it: the largest pattern below `|v| / (k + ½)`, settled by the stored rule when the
//!    breakpoint lies within `2^-11` of a pattern step of a pattern (at least `2^-19` of the
//!    value: a tie, or the f32 division rounding across).
//!    The step adds `|v|` to `Σ|v|·k` and `2k + 1` to `Σk²` in each range whose cap allows it.
//! 3. Walking the patterns down, the prefix sums give each pattern's codes' sums, and its error
//!    `Σv² − 2d·Σ|v|k + d²·Σk²` in f64, exact to `2^-40` of the terms (the codes are the stored
//!    rule's, exactly). Every pattern within that margin of the least is a finalist, ordered
//!    exactly by [`super::exact`] as the sweep's are.
//!
//! The cost is one pass over the elements' steps (about three per element) and one over the
//! window's patterns (about a hundred for bfloat16), with no sort. f16 scales have eight times
//! as many patterns per binade; their windows, and groups whose window is wider than
//! [`MAX_WINDOW`] patterns, are left to the sweep: [`FastSym::solve`] returns `None`.

use super::exact::{self, Choice};
use super::grid::Grid;
use super::solve::{HALF, SLACK, upper_bound};
use crate::format::{ScaleDtype, quantize_group_sym_scale};

/// The largest group.
const MAX_GROUP: usize = 128;
/// Windows of more patterns than this are left to the sweep.
const MAX_WINDOW: usize = 512;
/// A finalist: a positive scale pattern (0: the zero scale), the range (`false`: codes
/// `−8 ..= 7`, a positive stored scale; `true`: `−7 ..= 8`, a negative one), its model error
/// and margin.
#[derive(Clone, Copy, Debug)]
struct Offer {
    bits: u16,
    negative: bool,
    model: f64,
    tau: f64,
}

/// The fast search's buffers, reused from group to group.
pub(super) struct FastSym {
    grid: Grid,
    dtype: ScaleDtype,
    /// Per pattern of the window: steps of `Σ|v|·k` and `Σk²` common to both ranges, and the
    /// steps `7 → 8` of each range.
    step_ve: [Vec<f64>; 2],
    step_ee: [Vec<f64>; 2],
    step8: Vec<u32>,
    /// Per range and pattern: the model error and its margin.
    model: [Vec<(f64, f64)>; 2],
    offers: Vec<Offer>,
    ub: f64,
    /// The group's magnitudes (for the window's upper bound).
    abs: [f64; MAX_GROUP],
}

impl FastSym {
    /// A search for `dtype` scales, or `None` for a type this search does not take (f16).
    pub(super) fn new(dtype: ScaleDtype) -> Option<Self> {
        if dtype != ScaleDtype::Bf16 {
            return None;
        }
        Some(Self {
            grid: Grid::new(dtype),
            dtype,
            step_ve: [vec![0.0; MAX_WINDOW], vec![0.0; MAX_WINDOW]],
            step_ee: [vec![0.0; MAX_WINDOW], vec![0.0; MAX_WINDOW]],
            step8: vec![0; MAX_WINDOW],
            model: [vec![(0.0, 0.0); MAX_WINDOW], vec![(0.0, 0.0); MAX_WINDOW]],
            offers: Vec::with_capacity(64),
            ub: 0.0,
            abs: [0.0; MAX_GROUP],
        })
    }

    /// The best stored choice for the symmetric group `w` (finite weights, at most 128), or
    /// `None` when the group is one the sweep must take.
    pub(super) fn solve(&mut self, w: &[f32]) -> Option<Choice> {
        if w.len() > MAX_GROUP || w.is_empty() {
            return None;
        }
        let (mut s_vv, mut p, mut q) = (0f64, 0f64, 0f64);
        for (a, &v) in self.abs.iter_mut().zip(w) {
            let v = v as f64;
            *a = v.abs();
            s_vv += v * v;
            p = if v > p { v } else { p };
            q = if -v > q { -v } else { q };
        }
        if s_vv == 0.0 {
            return Some(Choice { bits: 0, zero: 8 });
        }
        // Magnitudes far from 1 leave the f64 model's products near underflow or overflow.
        let m = p.max(q);
        if !(1e-30..=1e30).contains(&m) {
            return None;
        }
        self.offers.clear();
        self.ub = f64::INFINITY;
        self.offer(0, false, s_vv, s_vv * SLACK);
        let absmax = quantize_group_sym_scale(self.dtype, w);
        if absmax & 0x7FFF != 0
            && let Some(e) = exact::error_f64(w, self.dtype.to_f32(absmax), 8)
        {
            self.offer(absmax & 0x7FFF, absmax & 0x8000 != 0, e, e * SLACK);
        }
        let (g_lo, g_hi) = self.window(w, p, q)?;
        if g_lo <= g_hi {
            self.sweep(w, s_vv, g_lo, g_hi);
        }
        Some(self.pick(w))
    }

    /// The patterns `g_lo ..= g_hi` that can beat `ub`, or `None` for a window too wide.
    fn window(&self, w: &[f32], p: f64, q: f64) -> Option<(u16, u16)> {
        let r = (self.ub * (1.0 + SLACK)).sqrt() * (1.0 + SLACK);
        // Range −8..=7 clips positives at 7 and negatives at 8; range −7..=8 the other way.
        let lo_pos = ((p - r) / 7.0).max((q - r) / 8.0);
        let lo_neg = ((p - r) / 8.0).max((q - r) / 7.0);
        let d_lo = lo_pos.min(lo_neg).max(0.0) * (1.0 - SLACK);
        // With no bound below it, `2·max|v|`: from there every code is 0, the zero scale's error,
        // and the zero scale wins the tie.
        let d_hi = upper_bound(&self.abs[..w.len()], self.ub)
            .unwrap_or(2.0 * p.max(q))
            .min(self.grid.max_value());
        if d_lo > d_hi {
            return Some((1, 0));
        }
        let lo = self.grid.ceil(d_lo)?;
        let Some(hi) = self.grid.floor(d_hi) else {
            return Some((1, 0));
        };
        if hi >= lo && (hi - lo) as usize >= MAX_WINDOW {
            return None;
        }
        Some((lo, hi))
    }

    /// The stored rule's code magnitude of `x = |v|` at scale `d` (both f32), unclamped below 32.
    #[inline(always)]
    fn stored_code(x: f32, d: f32) -> u32 {
        const MAGIC32: f32 = 12_582_912.0;
        let y = x / d;
        (((if y < 32.0 { y } else { 32.0 }) + MAGIC32) - MAGIC32) as u32
    }

    /// The last pattern (largest, within `g_lo ..= g_hi`) at which `x`'s code is at least
    /// `k + 1`, or `None` if none in the window is.
    #[inline(always)]
    fn step_pattern(&self, x: f32, k: u32, g_lo: u16, g_hi: u16) -> Option<u16> {
        let b = (x as f64 * HALF[k as usize]) as f32;
        // The bfloat16 pattern at or below `b` (rounded to f32: within 2^-24) and where `b`
        // lies between it and the next, in 2^-16 of the step. A step is at least 2^-8 of the
        // value, so 32 units are more than 2^-20 + 2^-24 of it: outside them, the pattern is
        // the last with the higher code, whatever the f32 division does.
        let bits = b.to_bits();
        let (mut g, frac) = ((bits >> 16) as u16, bits & 0xFFFF);
        if g > g_hi || !(32..=0xFFFF - 32).contains(&frac) {
            // Settle by the stored rule: the code falls as the scale grows.
            g = g.min(g_hi);
            let at = |g: u16| Self::stored_code(x, bf16_value(g) as f32) > k;
            if g < g_hi && at(g + 1) {
                g += 1;
            } else if !at(g) {
                g = g.checked_sub(1)?;
            }
        }
        (g >= g_lo).then_some(g)
    }

    /// Every pattern of `g_lo ..= g_hi` in both ranges: file the steps, then walk down.
    fn sweep(&mut self, w: &[f32], s_vv: f64, g_lo: u16, g_hi: u16) {
        let width = (g_hi - g_lo) as usize + 1;
        let [ve0, ve1] = &mut self.step_ve;
        let [ee0, ee1] = &mut self.step_ee;
        for s in [ve0, ve1, ee0, ee1] {
            s[..width].fill(0.0);
        }
        self.step8[..width].fill(0);
        let d_top = bf16_value(g_hi) as f32;
        // Sums at the top pattern per range, and the elements whose codes differ between the
        // ranges there (a code of 8 or more before the cap).
        let (mut ve, mut ee) = ([0f64; 2], [0f64; 2]);
        let mut differ = 0u32;
        for &v in w {
            let x = v.abs();
            if x == 0.0 {
                continue;
            }
            // The range (0: codes −8..=7, 1: −7..=8) whose cap for this sign is 8.
            let wide = usize::from(v > 0.0);
            let k_top = Self::stored_code(x, d_top);
            for r in 0..2 {
                let c = k_top.min(7 + (r == wide) as u32) as f64;
                ve[r] += x as f64 * c;
                ee[r] += c * c;
            }
            differ += (k_top >= 8) as u32;
            for k in k_top..8 {
                let Some(g) = self.step_pattern(x, k, g_lo, g_hi) else {
                    break;
                };
                let i = (g - g_lo) as usize;
                if k < 7 {
                    for r in 0..2 {
                        self.step_ve[r][i] += x as f64;
                        self.step_ee[r][i] += (2 * k + 1) as f64;
                    }
                } else {
                    // 7 → 8 only in the range whose cap for this sign is 8.
                    self.step_ve[wide][i] += x as f64;
                    self.step_ee[wide][i] += 15.0;
                    self.step8[i] += 1;
                }
            }
        }
        // Each pattern's model error, from the top down (prefix sums of the steps); a negative
        // scale whose codes equal the positive one's loses the tie and is not a choice.
        let mut ub = self.ub;
        for i in (0..width).rev() {
            for r in 0..2 {
                ve[r] += self.step_ve[r][i];
                ee[r] += self.step_ee[r][i];
            }
            differ += self.step8[i];
            let d = bf16_value(g_lo + i as u16);
            for r in 0..2 {
                let (a, b) = (2.0 * d * ve[r], d * d * ee[r]);
                let model = if r == 1 && differ == 0 {
                    f64::INFINITY
                } else {
                    (s_vv - a) + b
                };
                let tau = ((s_vv + a) + b) * SLACK;
                self.model[r][i] = (model, tau);
                // A select, not `f64::min`: no NaN here, and the select is cheaper.
                ub = if model + tau < ub { model + tau } else { ub };
            }
        }
        self.ub = ub;
        for i in 0..width {
            for r in 0..2 {
                let (model, tau) = self.model[r][i];
                if model - tau <= ub {
                    self.offer(g_lo + i as u16, r == 1, model, tau);
                }
            }
        }
    }

    fn offer(&mut self, bits: u16, negative: bool, model: f64, tau: f64) {
        if model + tau < self.ub {
            self.ub = model + tau;
        }
        self.offers.push(Offer {
            bits,
            negative,
            model,
            tau,
        });
        if self.offers.len() >= 48 {
            let ub = self.ub;
            self.offers.retain(|o| o.model - o.tau <= ub);
        }
    }

    /// The least finalist in the exact order (the only one, usually, with no exact sums).
    fn pick(&self, w: &[f32]) -> Choice {
        let choice = |o: &Offer| match (o.bits, o.negative) {
            (0, _) => Choice { bits: 0, zero: 8 },
            (g, false) => Choice { bits: g, zero: 8 },
            (g, true) => Choice {
                bits: g | 0x8000,
                zero: 8,
            },
        };
        let mut finalists = self.offers.iter().filter(|o| o.model - o.tau <= self.ub);
        let first = finalists.next().map_or(Choice { bits: 0, zero: 8 }, choice);
        let mut rest = finalists.peekable();
        if rest.peek().is_none() {
            return first;
        }
        exact::least(
            w,
            self.dtype,
            std::iter::once(first).chain(rest.map(choice)),
        )
    }
}

/// The value of a positive bfloat16 pattern.
#[inline(always)]
fn bf16_value(g: u16) -> f64 {
    f32::from_bits((g as u32) << 16) as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synth::SplitMix64;

    /// Ordinary groups take the fast path (the oracle tests compare its choices; this checks
    /// they are its own, not the sweep's).
    #[test]
    fn ordinary_groups_take_the_fast_path() {
        let mut rng = SplitMix64::new(3);
        let mut f = FastSym::new(ScaleDtype::Bf16).expect("bf16 scales");
        for gs in [32, 64, 128] {
            for s in [1e-7, 0.02, 1.0, 4e5] {
                for _ in 0..50 {
                    let w: Vec<f32> = (0..gs).map(|_| (rng.normal() * s) as f32).collect();
                    assert!(f.solve(&w).is_some(), "group of {gs} at {s:e}");
                }
            }
        }
    }

    /// f16 scales, and magnitudes whose model products leave f64's comfortable range, go to
    /// the sweep.
    #[test]
    fn f16_scales_and_extreme_magnitudes_go_to_the_sweep() {
        assert!(FastSym::new(ScaleDtype::F16).is_none());
        let mut f = FastSym::new(ScaleDtype::Bf16).expect("bf16 scales");
        for s in [1e-35f32, 1e35] {
            let w: Vec<f32> = (0..32).map(|i| s * (i as f32 - 15.5)).collect();
            assert!(f.solve(&w).is_none(), "magnitude {s:e}");
        }
        // An all-zero group is the zero scale at once.
        assert_eq!(f.solve(&[0.0; 32]), Some(Choice { bits: 0, zero: 8 }));
    }

    /// Where a code step is filed, against the stored rule at every pattern of the window:
    /// weights on a breakpoint (`(k + ½)·d`, a half-even tie) and a few ulps off it, where the
    /// f32 division decides, and random ones.
    #[test]
    fn steps_are_filed_where_the_stored_rule_takes_them() {
        let f = FastSym::new(ScaleDtype::Bf16).expect("bf16 scales");
        let mut rng = SplitMix64::new(11);
        let (g_lo, g_hi) = (0x3C00u16, 0x3E00u16);
        let brute = |x: f32, k: u32| {
            (g_lo..=g_hi)
                .rev()
                .find(|&g| FastSym::stored_code(x, bf16_value(g) as f32) > k)
        };
        let mut settled = 0;
        for case in 0..20_000u32 {
            let k = (rng.next_u64() % 8) as u32;
            let g = g_lo + (rng.next_u64() % (g_hi - g_lo) as u64) as u16;
            let x = match case % 3 {
                0 => ((k as f64 + 0.5) * bf16_value(g)) as f32,
                1 => {
                    let v = ((k as f64 + 0.5) * bf16_value(g)) as f32;
                    let ulps = (rng.next_u64() % 7) as i32 - 3;
                    f32::from_bits((v.to_bits() as i32 + ulps) as u32)
                }
                _ => (rng.normal().abs() * 0.05) as f32,
            };
            let want = brute(x, k);
            let got = f.step_pattern(x, k, g_lo, g_hi);
            settled += usize::from(case % 3 != 2 && got.is_some());
            assert_eq!(
                got,
                want,
                "x {x:e} ({:#x}), step {k} -> {}",
                x.to_bits(),
                k + 1
            );
        }
        assert!(
            settled > 1000,
            "the tie cases landed in the window: {settled}"
        );
    }
}
