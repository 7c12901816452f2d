//! The exact per-group search: the stored choice of least squared error, over every finite
//! 16-bit scale (and every zero point), found without trying them all.
//!
//! Why this exists: a group's error is not smooth in the scale, and the best scale can sit far
//! from the absmax one (a group quantized with a power-of-two scale whose largest code is 4 is
//! reproduced exactly only at absmax/4). Trying candidates around absmax/7 and refitting, as
//! llama.cpp and the earlier searcher did, misses such optima.
//!
//! # The problem
//!
//! Every choice is a positive scale `d` and a code range `lo ..= lo + 15` applied to the
//! group's own weights: a stored positive scale with zero point `z` is the range `-z ..= 15-z`,
//! a stored negative scale `-d` the range `z-15 ..= z` (the codes flip sign with the scale).
//! Symmetric groups (`z = 8`) have the two ranges `-8 ..= 7` and `-7 ..= 8`; groups with zero
//! points have the sixteen ranges `lo = -15 ..= 0` (a negative scale only repeats one of them,
//! and loses the tie-break). Plus the zero scale, whose error is `Σ v²`.
//!
//! # The sweep
//!
//! For a fixed range, as `d` falls each element's code moves away from zero one step at a time,
//! at the breakpoints `d = |v| / (k + 1/2)`. Between two consecutive breakpoints the codes `e`
//! are fixed and the error is the quadratic `E(d) = Σv² − 2d·Σv·e + d²·Σe²`; at a breakpoint
//! it is continuous (the moving element is exactly half a step from both codes). So the
//! search sorts the breakpoints and walks the segments, keeping `Σv·e` and `Σe²` up to date;
//! in each segment the quadratic's least value (its vertex, or the nearer end) bounds every
//! stored scale in it, and where that bound can still win, the stored scales next to the
//! vertex are offered: the quadratic is a symmetric parabola, so among the scales whose codes
//! are the segment's, the nearest to the vertex on either side are the best, exactly.
//!
//! Only a window of scales is swept, outside of which no scale can beat the best choice known:
//! below it, the largest weight of either sign is clipped by more than the best error
//! (`(P − hi·d)² > best`); above it, the elements smaller than `d` already cost more
//! (`Σ_{|v|<D} min(|v|, D − |v|)²`, which is at most the error of every `d ≥ D`). The absmax
//! choice of [`crate::format::PackedMatrix::quantize`] is the first best, so the result is never
//! worse than it.
//!
//! # Exactness
//!
//! The segment model is real arithmetic done in f64, and the stored rule divides in f32, so a
//! code can differ from the model's for an element within `2^-23` of a breakpoint, where the
//! two codes cost nearly the same. A stored scale that near an end of its segment is offered
//! with the segment (and so is the next one inward): it may belong to either side. Each offer
//! carries a margin `τ(d)` covering the model's rounding and that difference (see
//! [`Solver::tau`]); the search keeps `ub`, the least `model + τ` offered, and drops only what
//! provably costs more than `ub`. At the end every offer with `model − τ ≤ ub` is evaluated
//! with the stored rule and ordered by [`super::exact`] (exact error, then the tie-break): the
//! result is the minimum of that order over all stored choices, the same one an exhaustive
//! search finds.

use super::direct::Direct;
use super::exact::{self, Choice};
use super::grid::Grid;
use crate::format::{ScaleDtype, quantize_group_asym, quantize_group_sym_scale};

/// `2^-40`: the relative slack on rigorous bounds computed in f64.
const SLACK: f64 = 1.0 / (1u64 << 40) as f64;
/// `1 / (k + 1/2)` for `k = 0 ..= 15`: breakpoint `k → k+1` of an element is `|v| · HALF[k]`.
const HALF: [f64; 16] = {
    let mut t = [0.0; 16];
    let mut k = 0;
    while k < 16 {
        t[k] = 1.0 / (k as f64 + 0.5);
        k += 1;
    }
    t
};
/// `1.5 · 2^52`: adding and subtracting it rounds an f64 to an integer, half to even.
const MAGIC64: f64 = 6_755_399_441_055_744.0;

/// Round half to even for `|x| ≤ 2^51` (and `+∞` stays `+∞`), inlined, without `rint`.
#[inline(always)]
fn rne64(x: f64) -> f64 {
    (x + MAGIC64) - MAGIC64
}

/// How near (relative) a stored scale must be to a breakpoint for an element's stored-rule code
/// to differ from the model's: the f32 division is within `2^-24`, the breakpoints within
/// `2^-40`; `2^-21` leaves room. Grid steps are `2^-10` (f16) and `2^-7` (bf16) or more apart,
/// so at most one scale lies this near each end of a segment.
const AMBIGUOUS: f64 = 1.0 / (1u64 << 21) as f64;

/// Low bits of an event key that carry the element (7 bits) and its code magnitude (4 bits).
const PAYLOAD: u64 = 0x7FF;

/// An offered choice: a positive scale pattern (0 for the zero scale) and a code range, its
/// model error and the margin within which the stored rule's error lies.
#[derive(Clone, Copy, Debug)]
struct Offer {
    bits: u16,
    lo: i8,
    model: f64,
    tau: f64,
}

/// The search's buffers, reused from group to group (allocated once per matrix).
pub(super) struct Solver {
    grid: Grid,
    dtype: ScaleDtype,
    zero_points: bool,
    /// Breakpoints of one range: key `d` (f64 bits, payload in the low 11 bits).
    events: Vec<u64>,
    offers: Vec<Offer>,
    /// The group's weights widened, and their magnitudes.
    v: Vec<f64>,
    abs: Vec<f64>,
    /// Code magnitudes during a sweep.
    codes: Vec<u8>,
    s_vv: f64,
    a_sum: f64,
    n: f64,
    /// The largest positive weight and the largest magnitude of a negative one.
    p_max: f64,
    n_max: f64,
    /// The least `model + τ` offered: no choice whose stored-rule error is above it can win.
    ub: f64,
    /// The direct search for symmetric groups (absent with zero points, or when the sweep
    /// alone is asked for).
    direct: Option<Direct>,
}

impl Solver {
    pub(super) fn new(dtype: ScaleDtype, zero_points: bool, group: usize) -> Self {
        let mut s = Self::sweep_only(dtype, zero_points, group);
        if !zero_points {
            s.direct = Direct::new(dtype);
        }
        s
    }

    /// A solver that always sweeps (the direct search's oracle in tests).
    pub(super) fn sweep_only(dtype: ScaleDtype, zero_points: bool, group: usize) -> Self {
        Self {
            grid: Grid::new(dtype),
            dtype,
            zero_points,
            events: Vec::with_capacity(group * 16),
            offers: Vec::with_capacity(128),
            v: Vec::with_capacity(group),
            abs: Vec::with_capacity(group),
            codes: Vec::with_capacity(group),
            s_vv: 0.0,
            a_sum: 0.0,
            n: group as f64,
            p_max: 0.0,
            n_max: 0.0,
            ub: 0.0,
            direct: None,
        }
    }

    /// The best stored choice for group `w` (finite weights, at most 128).
    pub(super) fn solve(&mut self, w: &[f32]) -> Choice {
        debug_assert!(w.len() <= 128);
        if let Some(c) = self.direct.as_mut().and_then(|d| d.solve(w)) {
            return c;
        }
        self.load(w);
        if self.s_vv == 0.0 {
            return Choice { bits: 0, zero: 8 };
        }
        self.offers.clear();
        self.ub = f64::INFINITY;
        // The zero scale, then the absmax choice: the first bests.
        let tau = self.s_vv * SLACK;
        self.offer(0, -8, self.s_vv, tau);
        let first = if self.zero_points {
            let (bits, zero) = quantize_group_asym(self.dtype, w);
            Choice { bits, zero }
        } else {
            let bits = quantize_group_sym_scale(self.dtype, w);
            Choice { bits, zero: 8 }
        };
        let mag = first.bits & 0x7FFF;
        if mag != 0
            && let Some(e) = exact::error_f64(w, self.dtype.to_f32(first.bits), first.zero)
        {
            self.offer(mag, self.range_of(first), e, e * SLACK);
        }
        let d_hi = upper_bound(&self.abs, self.ub)
            .map_or(self.grid.max_value(), |d| d.min(self.grid.max_value()));
        if self.zero_points {
            // The ranges in order of promise: nearest the one that fits [min, max] first.
            let fit = -(15.0 * self.n_max / (self.p_max + self.n_max)).round() as i32;
            for step in 0..32 {
                let lo = fit
                    + if step % 2 == 0 {
                        step / 2
                    } else {
                        -(step / 2 + 1)
                    };
                if (-15..=0).contains(&lo) {
                    self.range(lo, d_hi);
                }
            }
        } else {
            self.range(-8, d_hi);
            self.range(-7, d_hi);
        }
        self.pick(w)
    }

    /// Widen the group and take its sums and extremes.
    fn load(&mut self, w: &[f32]) {
        self.v.clear();
        self.abs.clear();
        self.codes.clear();
        let (mut s_vv, mut a_sum, mut p, mut n) = (0.0, 0.0, 0f64, 0f64);
        for &x in w {
            let v = x as f64;
            self.v.push(v);
            self.abs.push(v.abs());
            self.codes.push(0);
            s_vv += v * v;
            a_sum += v.abs();
            p = p.max(v);
            n = n.max(-v);
        }
        (self.s_vv, self.a_sum, self.p_max, self.n_max) = (s_vv, a_sum, p, n);
        self.n = w.len() as f64;
    }

    /// The stored choice of an offer.
    fn choice(&self, o: &Offer) -> Choice {
        if o.bits == 0 {
            Choice { bits: 0, zero: 8 }
        } else if self.zero_points {
            Choice {
                bits: o.bits,
                zero: (-o.lo) as u8,
            }
        } else if o.lo == -8 {
            Choice {
                bits: o.bits,
                zero: 8,
            }
        } else {
            Choice {
                bits: o.bits | 0x8000,
                zero: 8,
            }
        }
    }

    /// The code range (its `lo`) of a stored choice, for a positive scale.
    fn range_of(&self, c: Choice) -> i8 {
        if c.bits & 0x8000 != 0 {
            c.zero as i8 - 15
        } else {
            -(c.zero as i8)
        }
    }

    /// How far the stored rule's error of a scale `d` can lie from the model's: the codes of
    /// elements within `2^-22` of a breakpoint (each off by at most `2d·|v|·2^-22`, summed
    /// `2^-20·d·Σ|v|` with room), and the f64 rounding of the sums and of the model
    /// (`2^-40` of the largest magnitude involved, `Σv² + 2d·|Σv·e| + d²·Σe²`).
    #[inline(always)]
    fn tau(&self, d: f64) -> f64 {
        const R20: f64 = 1.0 / (1u64 << 20) as f64;
        R20 * d * self.a_sum + SLACK * (self.s_vv + 32.0 * d * self.a_sum + 256.0 * self.n * d * d)
    }

    #[inline(always)]
    fn offer(&mut self, bits: u16, lo: i8, model: f64, tau: f64) {
        self.offers.push(Offer {
            bits,
            lo,
            model,
            tau,
        });
        self.ub = self.ub.min(model + tau);
        if self.offers.len() >= 256 {
            let ub = self.ub;
            self.offers.retain(|o| o.model - o.tau <= ub);
        }
    }

    /// Sweep the range `lo ..= lo + 15` over the scales its clipping bound leaves below `d_hi`.
    fn range(&mut self, lo: i32, d_hi: f64) {
        let hi = lo + 15;
        let r = (self.ub * (1.0 + SLACK)).sqrt() * (1.0 + SLACK);
        let mut d_lo = 0f64;
        for (m, cap) in [(self.p_max, hi), (self.n_max, -lo)] {
            if m > 0.0 {
                if cap == 0 {
                    // This sign is clipped to zero at every scale.
                    if m * m * (1.0 - SLACK) > self.ub {
                        return;
                    }
                } else {
                    d_lo = d_lo.max((m - r) / cap as f64);
                }
            }
        }
        let d_lo = d_lo * (1.0 - SLACK);
        if d_lo > d_hi {
            return;
        }
        self.sweep(lo, d_lo, d_hi);
    }

    /// Walk the segments of range `lo` between `d_lo` and `d_hi`, from the top.
    fn sweep(&mut self, lo: i32, d_lo: f64, d_hi: f64) {
        let hi = lo + 15;
        self.events.clear();
        let (mut s_ve, mut s_ee) = (0f64, 0f64);
        // The model's codes at the window's ends (an element within rounding of a breakpoint
        // there may start on either side: the two codes cost the same, within `τ`).
        let inv_hi = 1.0 / d_hi;
        let inv_lo = if d_lo > 0.0 {
            1.0 / d_lo
        } else {
            f64::INFINITY
        };
        for i in 0..self.v.len() {
            let (v, a) = (self.v[i], self.abs[i]);
            let cap = if v > 0.0 { hi } else { -lo };
            if v == 0.0 || cap <= 0 {
                self.codes[i] = 0;
                continue;
            }
            let cap = cap as f64;
            let top = rne64(a * inv_hi).min(cap);
            let bottom = rne64((a * inv_lo).min(cap));
            self.codes[i] = top as u8;
            s_ve += a * top;
            s_ee += top * top;
            for k in top as usize..bottom as usize {
                let d = a * HALF[k];
                self.events
                    .push((d.to_bits() & !PAYLOAD) | (i as u64) << 4 | k as u64);
            }
        }
        self.events.sort_unstable();
        let mut top = d_hi;
        for j in (0..=self.events.len()).rev() {
            let key = if j > 0 { self.events[j - 1] } else { 0 };
            let b = if j > 0 {
                f64::from_bits(key & !PAYLOAD).min(top)
            } else {
                d_lo.min(top)
            };
            self.segment(lo, b, top, s_ve, s_ee);
            if j > 0 {
                let (i, k) = (((key & PAYLOAD) >> 4) as usize, key & 15);
                s_ve += self.abs[i];
                s_ee += (2 * k + 1) as f64;
                self.codes[i] = k as u8 + 1;
            }
            top = b;
        }
    }

    /// One segment `[b0, b1]` where the codes are fixed (`Σv·e = s_ve`, `Σe² = s_ee`).
    #[inline(always)]
    fn segment(&mut self, lo: i32, b0: f64, b1: f64, s_ve: f64, s_ee: f64) {
        const BIG: f64 = f32::MAX as f64 / 16.0;
        let mut b1 = b1;
        if b1 > BIG {
            // Scales whose dequantized values `d·e` would overflow f32 are not choices.
            let emax = self.codes.iter().copied().max().unwrap_or(0);
            if emax > 0 {
                b1 = b1.min(f32::MAX as f64 / emax as f64);
            }
        }
        if b0.is_nan() || b1.is_nan() || b0 > b1 {
            return;
        }
        let lo8 = lo as i8;
        let s_vv = self.s_vv;
        let model = move |d: f64| s_vv - 2.0 * d * s_ve + d * d * s_ee;
        // The least of the quadratic on the segment (constant Σv² when every code is zero:
        // the smallest scale then ties first), and where.
        let (x, least) = if s_ee == 0.0 || s_ve <= b0 * s_ee {
            (b0, model(b0))
        } else if s_ve >= b1 * s_ee {
            (b1, model(b1))
        } else {
            let x = s_ve / s_ee;
            (x, s_vv - s_ve * x)
        };
        if least > self.ub + self.tau(b1) {
            return;
        }
        // Every stored scale whose stored-rule codes are this segment's has the error of this
        // quadratic, exactly in real arithmetic, so the ones nearest the vertex win among them
        // (a symmetric parabola: farther is strictly worse). Only a scale within AMBIGUOUS of
        // an end may have an element's code from the next segment (the f32 division): those
        // are offered too, and the next scale inward in case the nearest one is such.
        let near = |d: f64| (d - b0).abs() <= AMBIGUOUS * b0 || (d - b1).abs() <= AMBIGUOUS * b1;
        let mut picks = [0u16; 8];
        let mut n = 0;
        let floor = self
            .grid
            .floor(x)
            .filter(|&g| s_ee != 0.0 && self.grid.value(g) >= b0);
        let ceil = self.grid.ceil(x).filter(|&g| self.grid.value(g) <= b1);
        if let Some(g) = floor {
            picks[n] = g;
            n += 1;
            if near(self.grid.value(g)) && g > 1 && self.grid.value(g - 1) >= b0 {
                picks[n] = g - 1;
                n += 1;
            }
        }
        if let Some(g) = ceil {
            picks[n] = g;
            n += 1;
            let next = g + 1;
            if near(self.grid.value(g)) && self.grid.value(next) <= b1 {
                picks[n] = next;
                n += 1;
            }
        }
        for b in [b0, b1] {
            for g in [self.grid.floor(b), self.grid.ceil(b)]
                .into_iter()
                .flatten()
            {
                if (self.grid.value(g) - b).abs() <= AMBIGUOUS * b {
                    picks[n] = g;
                    n += 1;
                }
            }
        }
        for &g in &picks[..n] {
            let d = self.grid.value(g);
            let (e, tau) = (model(d), self.tau(d));
            if e - tau <= self.ub {
                self.offer(g, lo8, e, tau);
            }
        }
    }

    /// The least offer in the order of [`exact::order`], among those that can still be it.
    fn pick(&mut self, w: &[f32]) -> Choice {
        let ub = self.ub;
        let finalists = self.offers.iter().filter(|o| o.model - o.tau <= ub);
        exact::least(w, self.dtype, finalists.map(|o| self.choice(o)))
    }
}

/// A scale above which no choice beats `ub`, for a group of magnitudes `abs`: the least `D`
/// found by bisection (rounded up) with `Σ_{|v|<D} min(|v|, D − |v|)² > ub` (every element
/// smaller than a scale at least `D` costs that much), or `None` when even `2·max|v|` is not
/// such a bound.
fn upper_bound(abs: &[f64], ub: f64) -> Option<f64> {
    let beyond = |d: f64| {
        // Branch-free in four lanes: an element at or above `d` gives `min(a, d − a) ≤ 0`,
        // clamped to 0.
        let mut acc = [0f64; 4];
        let quads = abs.chunks_exact(4);
        let rest = quads.remainder();
        // `min(a, d − a)` clamped at 0, with comparisons (no NaN here: plain selects).
        let cost = |a: f64| {
            let t = if a < d - a { a } else { d - a };
            if t > 0.0 { t * t } else { 0.0 }
        };
        for a4 in quads {
            for l in 0..4 {
                acc[l] += cost(a4[l]);
            }
        }
        for (l, &a) in rest.iter().enumerate() {
            acc[l] += cost(a);
        }
        ((acc[0] + acc[1]) + (acc[2] + acc[3])) * (1.0 - SLACK) > ub
    };
    let top = 2.0 * abs.iter().fold(0f64, |m, &a| m.max(a));
    if !beyond(top) {
        return None;
    }
    let (mut lo, mut hi) = (0.0, top);
    for _ in 0..10 {
        let mid = 0.5 * (lo + hi);
        if beyond(mid) {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    Some(hi)
}
