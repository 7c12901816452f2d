//! The direct search for symmetric groups with bfloat16 scales: every stored scale that can
//! win is evaluated outright, sixteen scales at a time in vector lanes.
//!
//! Why this exists: the breakpoint sweep ([`super::solve`]) sorts each group's code steps and
//! walks its segments in f64, and the search that replaced it for these groups filed the
//! steps under scale patterns and walked them with prefix sums: few operations, but all of
//! them scalar and data-dependent (about 13,000 cycles per group of 32 on an Intel Xeon),
//! which kept conversion at a hundredth of a disk read. Evaluating a scale directly costs four
//! vector operations per element, and sixteen scales share each element's load: the same
//! window costs a fraction of the time, with no branches on the data.
//!
//! # The search
//!
//! Both symmetric ranges are searched together: a positive stored scale
//! `d` gives the code magnitudes `min(rne(|v| / d), cap)` with a cap of 7 for positive and 8
//! for negative weights; a negative stored scale `−d` the other way round.
//!
//! 1. Sixteen patterns just below `absmax / 7.5`, where the optimum of ordinary groups lies
//!    most often, are evaluated first: their least error bounds the best one (`ub`).
//! 2. Upward, sixteen patterns at a time, until every larger scale provably costs more than
//!    `ub`: the elements smaller than the scale already do (`Σ min(|v|, d − |v|)²`, the
//!    sweep's bound above its window), or the scale passes `2·absmax` (every code 0).
//! 3. Downward likewise, until the clipping of the elements above their caps costs more
//!    (`Σ (|v| − cap·d)²` over them, at least the sweep's bound below its window).
//! 4. Every evaluated choice whose error can be within the margin of the least is a finalist;
//!    the finalists are ordered exactly by [`super::exact`] as the sweep's are. Usually there
//!    is one and nothing is recomputed.
//!
//! Steps 2 and 3 skip a block of sixteen patterns whose *range bound* already costs more than
//! `ub`: each element's distance from every magnitude a scale in the block can give it
//! ([`range_bounds`]). The bounds of the eight blocks above and the eight below the first
//! pass take one vector call with the blocks in the lanes (about the cost of two passes); on
//! Gaussian groups of 32 they skip 3.5 of the 8.3 blocks the search used to evaluate, the
//! cheaper ones (few elements near code 8 at the larger scales): about 15 % of the search's
//! time. (The same bound with the patterns in the lanes, one block per call, was measured and
//! dropped: it costs several evaluations per element.) The stopping tests of steps 2 and 3 are
//! taken only at blocks the range bounds leave: both tests only grow along the walk and as
//! `ub` falls, so the same blocks are evaluated as when every block was tested.
//!
//! # One evaluation and its margin
//!
//! In lane `j`, with the scale `d` (a bfloat16 value, exact in f32) and `inv = 1/d` rounded to
//! f32, an element's code magnitude is `k = min(rne(|v| · inv), cap)` and its error
//! `(|v| − d·k)²`, summed over the group in f32 (`d·k` is exact: at most 12 significant bits).
//! The model differs from the stored rule's exact error in two ways, both covered by the
//! bounds a pass records, `model · (1 ∓ 2^-16) ∓ (2^-19 · d · Σ|v| + 2^-120)` (twice the room
//! each source below needs, which also covers the f32 arithmetic that applies them):
//!
//! * Rounding: the residual rounds once, its square once, and the sum of `n ≤ 128`
//!   non-negative terms at most `n − 1` times: within `(n + 3) · 2^-24 < 2^-17` of the model;
//!   a square or sum that falls below f32's normal range is off by at most `2^-149` each.
//! * Codes: `|v| · inv` is within `2^-23` (relative) of `|v| / d`, as is the stored rule's f32
//!   division, so the two codes differ only where `|v| / d` is within `2^-22` of a half-integer
//!   `k + ½`. There the two codes' errors differ by `2d · ||v| − d(k + ½)| ≤ 2^-21 · d · |v|`.
//!
//! Elements that cannot reach code 8 anywhere in a pass (`|v| < 7.5 · (1 − 2^-20) · d_min`)
//! need no cap: both ranges give them the same code, computed once. The negative scale's
//! codes equal the positive one's unless some element reaches 8; where none can (the largest
//! `|v| · inv` below `7.5 · (1 − 2^-20)`), the negative scale would lose the tie and is not
//! offered.
//!
//! Groups whose largest magnitude lies outside `[2^-40, 2^40]` (where f32 sums could leave the
//! normal range) and windows of more than [`MAX_PASSES`] passes are left to the other searches:
//! [`Direct::solve`] returns `None`.

use super::exact::{self, Choice};
use super::grid::Grid;
use crate::format::ScaleDtype;

/// Scales evaluated per pass (one 512-bit vector of f32).
const LANES: usize = 16;
/// The largest group.
const MAX_GROUP: usize = 128;
/// Groups that need more passes than this (1,024 patterns) are left to the other searches.
const MAX_PASSES: usize = 64;
/// The first pass: patterns `anchor − FIRST_BELOW ..` with `anchor` the pattern of
/// `absmax / 7.5` (ordinary groups' optimum lies 5 to 30 patterns below it, most often 14).
const FIRST_BELOW: u16 = 20;
/// Blocks of sixteen patterns on each side of the first pass whose range bounds are computed
/// (in one vector call, [`range_bounds`]); the search rarely goes farther, and evaluates what
/// lies beyond them unbounded.
const NEAR: usize = LANES / 2;
/// Magnitudes at the lower end of `2^-20` of a code step: a largest `|v| · inv` below
/// `7.5 · CAP_SAFE` puts no code at 8 under either rounding.
const CAP_SAFE: f64 = 1.0 - 1.0 / (1u64 << 20) as f64;

/// Which vector instructions the passes are compiled for (detected once per search).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Level {
    #[cfg(target_arch = "x86_64")]
    Avx512,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    Plain,
}

impl Level {
    /// Every level this CPU can run, the best first.
    #[cfg(test)]
    fn available() -> Vec<Self> {
        let mut v = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            let fma = std::arch::is_x86_feature_detected!("fma");
            if fma && std::arch::is_x86_feature_detected!("avx512f") {
                v.push(Level::Avx512);
            }
            if fma && std::arch::is_x86_feature_detected!("avx2") {
                v.push(Level::Avx2);
            }
        }
        v.push(Level::Plain);
        v
    }

    fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            if !std::arch::is_x86_feature_detected!("fma") {
                return Level::Plain;
            }
            if std::arch::is_x86_feature_detected!("avx512f") {
                return Level::Avx512;
            }
            if std::arch::is_x86_feature_detected!("avx2") {
                return Level::Avx2;
            }
        }
        Level::Plain
    }
}

/// Call kernel `$f` compiled for `$level`.
macro_rules! at_level {
    ($level:expr, $f:ident($($arg:expr),*)) => {
        match $level {
            // SAFETY: the level was detected on this CPU (AVX-512F and FMA).
            #[cfg(target_arch = "x86_64")]
            Level::Avx512 => unsafe { avx512::$f($($arg),*) },
            // SAFETY: as above (AVX2 and FMA).
            #[cfg(target_arch = "x86_64")]
            Level::Avx2 => unsafe { avx2::$f($($arg),*) },
            // SAFETY: no target features.
            Level::Plain => unsafe { plain::$f($($arg),*) },
        }
    };
}

/// One group's elements split for a pass: the ones that may reach code 8 (magnitude and the
/// positive scale's cap; the negative one's is `15 −` it) and the ones that cannot.
struct Split<'a> {
    big: &'a [f32],
    cap_a: &'a [f32],
    small: &'a [f32],
}

/// A pass's results: per lane, lower bounds of the stored rule's error in both ranges
/// (infinite where the negative scale is not a choice); over the lanes, the least lower and
/// the least upper bound; and the pass's first pattern (its lanes are the next sixteen).
#[derive(Clone, Copy)]
struct Bounds {
    lower: [[f32; LANES]; 2],
    least_lower: f32,
    upper: f32,
    g0: u16,
}

/// The direct search's buffers, reused from group to group.
pub(super) struct Direct {
    grid: Grid,
    level: Level,
    /// The group's magnitudes, and their caps under a positive scale (7 for positive
    /// weights, 8 for the others; a negative scale's are `15 −` these).
    abs: [f32; MAX_GROUP],
    cap_a: [f32; MAX_GROUP],
    /// The current split (see [`Split`]).
    big: [f32; MAX_GROUP],
    big_cap_a: [f32; MAX_GROUP],
    small: [f32; MAX_GROUP],
    n_big: usize,
    n_small: usize,
    /// This group's passes so far (the first `n_passes`; they never overlap), and the
    /// finalists among them.
    passes: Vec<Bounds>,
    n_passes: usize,
    /// This group's blocks of sixteen patterns the range bounds skipped, unevaluated: those
    /// the walk passed, and those it skipped on its way to the evaluated block where its
    /// stopping test held (the tests run only at evaluated blocks; see `solve`).
    n_pruned: usize,
    /// Where this group's skipped blocks start (tests check each against the exact errors).
    #[cfg(test)]
    skipped_at: Vec<u16>,
    finalists: Vec<Choice>,
    /// `2^-19 · Σ|v|`, rounded up: times a scale, the codes' share of the margin.
    slack: f32,
    /// The least upper bound of a choice's error so far.
    ub: f32,
}

/// Relative margins of the model (see the module docs), with room for the f32 arithmetic that
/// applies them.
const LOWER: f32 = 1.0 - 1.0 / 65_536.0;
const UPPER: f32 = 1.0 + 1.0 / 65_536.0;
/// `2^-120`: the absolute margin (sums that leave f32's normal range).
const TINY: f32 = 7.523_164e-37;

impl Direct {
    /// A search for `dtype` scales, or `None` for a type this search does not take (f16).
    pub(super) fn new(dtype: ScaleDtype) -> Option<Self> {
        if dtype != ScaleDtype::Bf16 {
            return None;
        }
        Some(Self {
            grid: Grid::new(dtype),
            level: Level::detect(),
            abs: [0.0; MAX_GROUP],
            cap_a: [0.0; MAX_GROUP],
            big: [0.0; MAX_GROUP],
            big_cap_a: [0.0; MAX_GROUP],
            small: [0.0; MAX_GROUP],
            n_big: 0,
            n_small: 0,
            passes: vec![
                Bounds {
                    lower: [[0.0; LANES]; 2],
                    least_lower: 0.0,
                    upper: 0.0,
                    g0: 0,
                };
                MAX_PASSES
            ],
            n_passes: 0,
            n_pruned: 0,
            #[cfg(test)]
            skipped_at: Vec::new(),
            finalists: Vec::with_capacity(2 * LANES),
            slack: 0.0,
            ub: 0.0,
        })
    }

    /// The best stored choice for the symmetric group `w` (finite weights, at most 128), or
    /// `None` when the group is one the other searches must take.
    pub(super) fn solve(&mut self, w: &[f32]) -> Option<Choice> {
        let n = w.len();
        // The kernels take whole vectors of elements (groups are 32, 64 or 128).
        if n > MAX_GROUP || n == 0 || n % LANES != 0 {
            return None;
        }
        let l = at_level!(
            self.level,
            load(w, &mut self.abs[..n], &mut self.cap_a[..n])
        );
        let absmax = if l.p > l.q { l.p } else { l.q };
        if absmax == 0.0 {
            return Some(Choice { bits: 0, zero: 8 });
        }
        if !(2f32.powi(-40)..=2f32.powi(40)).contains(&absmax) {
            return None;
        }
        // `2^-20 · Σ|v|` from an f32 sum (within `n · 2^-24`), doubled for room.
        self.slack = l.sum_abs * (1.0 / 524_288.0) * UPPER;
        // The zero scale's error bounds the best one (`Σv²` summed in f32 like a model).
        let zero_upper = l.s_vv * UPPER + TINY;
        let zero_lower = l.s_vv * LOWER - TINY;
        self.ub = zero_upper;
        // The first pass: sixteen patterns below absmax / 7.5.
        let anchor = ((absmax / 7.5).to_bits() >> 16) as u16;
        let first_lo = anchor.saturating_sub(FIRST_BELOW).max(1);
        let first_hi = first_lo + LANES as u16 - 1;
        self.n_passes = 0;
        self.n_pruned = 0;
        #[cfg(test)]
        self.skipped_at.clear();
        self.split(n, self.grid.value(first_lo) as f32);
        self.pass(first_lo);
        // Upward, while a scale of the next pass can beat `ub`: elements smaller than it
        // already cost more (see `beyond`), and from `2·absmax` on every code is 0 (the zero
        // scale's error, and the zero scale wins the tie).
        let top = self.grid.floor(2.0 * absmax as f64).unwrap_or(0);
        // Skipped: the blocks among the eight above and the eight below the first pass
        // whose range bound already costs more than `ub` ([`range_bounds`]).
        // The stopping tests (`beyond` upward, `clipped` downward) are taken only at blocks
        // the range bounds leave: both only grow as the search moves away from the first pass
        // and as `ub` falls, so one that holds at a skipped block holds at the next evaluated
        // one too, and the same passes run as when every block was tested (those calls were
        // about a tenth of a conversion's samples).
        let ranges = self.near_ranges(n, first_lo);
        let mut g = first_hi + 1;
        let mut i = 0;
        while g <= top {
            if i < NEAR && ranges[i] * LOWER - TINY > self.ub {
                self.skipped(g);
            } else {
                if self.beyond(n, g) {
                    break;
                }
                if self.n_passes == MAX_PASSES {
                    return None;
                }
                self.pass(g);
            }
            g += LANES as u16;
            i += 1;
        }
        // Downward, while the clipping of the next pass's largest scale does not cost more.
        let mut g = first_lo;
        let mut split_at = first_lo;
        let mut i = 0;
        while g > LANES as u16 {
            i += 1;
            if i <= NEAR && ranges[NEAR + i - 1] * LOWER - TINY > self.ub {
                g -= LANES as u16;
                self.skipped(g);
                continue;
            }
            if self.clipped(n, g - 1) {
                break;
            }
            g -= LANES as u16;
            if self.n_passes == MAX_PASSES {
                return None;
            }
            if g < split_at {
                // Split for this pass and the next few below it.
                split_at = g.saturating_sub(4 * LANES as u16).max(1);
                self.split(n, self.grid.value(split_at) as f32);
            }
            self.pass(g);
        }
        Some(self.pick(w, zero_lower))
    }

    /// The range bounds ([`range_bounds`]) of the [`NEAR`] blocks of sixteen patterns above
    /// the first pass (from `first_lo`) and the `NEAR` below it, nearest first: lane `i`
    /// upward, lane `NEAR + i` downward. Blocks that would start below pattern 1 start at it
    /// (never visited: the downward search stops above them).
    fn near_ranges(&self, n: usize, first_lo: u16) -> [f32; LANES] {
        let (mut lo, mut hi) = ([0f32; LANES], [0f32; LANES]);
        for i in 0..NEAR {
            let up = first_lo + ((i + 1) * LANES) as u16;
            let down = first_lo.saturating_sub(((i + 1) * LANES) as u16).max(1);
            (lo[i], hi[i]) = (bf16_value(up), bf16_value(up + LANES as u16 - 1));
            let down_hi = bf16_value(down + LANES as u16 - 1);
            (lo[NEAR + i], hi[NEAR + i]) = (bf16_value(down), down_hi);
        }
        at_level!(self.level, range_bounds(&self.abs[..n], &lo, &hi))
    }

    /// Count the block of sixteen patterns from `g0` as skipped (tests also keep where it
    /// starts).
    fn skipped(&mut self, g0: u16) {
        self.n_pruned += 1;
        #[cfg(test)]
        self.skipped_at.push(g0);
        #[cfg(not(test))]
        let _ = g0;
    }

    /// Whether every scale of at least pattern `g`'s provably costs more than `ub`: see
    /// [`beyond_sum`].
    fn beyond(&self, n: usize, g: u16) -> bool {
        let d = bf16_value(g);
        at_level!(self.level, beyond_sum(&self.abs[..n], d)) * LOWER > self.ub
    }

    /// Whether every scale of at most pattern `g`'s provably costs more than `ub` in both
    /// ranges: see [`clipped_sums`].
    fn clipped(&self, n: usize, g: u16) -> bool {
        let d = bf16_value(g);
        let sums = at_level!(
            self.level,
            clipped_sums(&self.abs[..n], &self.cap_a[..n], d)
        );
        sums[0] * LOWER > self.ub && sums[1] * LOWER > self.ub
    }

    /// Split the elements for passes whose smallest scale is `d_min`: those that cannot reach
    /// code 8 there (`|v| < 7.5 · (1 − 2^-20) · d_min`, one ulp of room) need no cap.
    fn split(&mut self, n: usize, d_min: f32) {
        let limit = (7.5 * CAP_SAFE * d_min as f64) as f32;
        let limit = f32::from_bits(limit.to_bits().saturating_sub(1));
        #[cfg(target_arch = "x86_64")]
        if self.level == Level::Avx512 {
            let lists = (&mut self.big, &mut self.big_cap_a, &mut self.small);
            // SAFETY: the level was detected on this CPU (AVX-512F).
            (self.n_big, self.n_small) =
                unsafe { split_avx512(&self.abs[..n], &self.cap_a[..n], limit, lists) };
            return;
        }
        let (mut nb, mut ns) = (0, 0);
        // Branch-free: each element is written to both lists, and counted in one.
        for i in 0..n {
            let (a, c) = (self.abs[i], self.cap_a[i]);
            self.small[ns] = a;
            self.big[nb] = a;
            self.big_cap_a[nb] = c;
            let small = usize::from(a < limit);
            ns += small;
            nb += 1 - small;
        }
        (self.n_big, self.n_small) = (nb, ns);
    }

    /// Evaluate the sixteen patterns from `g0` (each at least the current split's `d_min`)
    /// with the current split.
    fn pass(&mut self, g0: u16) {
        let mut d = [0f32; LANES];
        for (j, d) in d.iter_mut().enumerate() {
            *d = bf16_value(g0 + j as u16);
        }
        let split = Split {
            big: &self.big[..self.n_big],
            cap_a: &self.big_cap_a[..self.n_big],
            small: &self.small[..self.n_small],
        };
        let b = &mut self.passes[self.n_passes];
        at_level!(self.level, pass_bounds(&split, &d, self.slack, b));
        b.g0 = g0;
        self.ub = if b.upper < self.ub { b.upper } else { self.ub };
        self.n_passes += 1;
    }

    /// The least finalist in the exact order among the zero scale (whose error is at least
    /// `zero_lower`) and the patterns evaluated.
    fn pick(&mut self, w: &[f32], zero_lower: f32) -> Choice {
        let ub = self.ub;
        let zero = Choice { bits: 0, zero: 8 };
        self.finalists.clear();
        if zero_lower <= ub {
            self.finalists.push(zero);
        }
        for b in self.passes[..self.n_passes]
            .iter()
            .filter(|b| b.least_lower <= ub)
        {
            for j in 0..LANES {
                for r in 0..2 {
                    if b.lower[r][j] <= ub {
                        self.finalists.push(Choice {
                            bits: (b.g0 + j as u16) | (r as u16) << 15,
                            zero: 8,
                        });
                    }
                }
            }
        }
        match self.finalists[..] {
            [] => zero,
            [only] => only,
            _ => exact::least(w, ScaleDtype::Bf16, self.finalists.iter().copied()),
        }
    }
}

/// [`Direct::split`] sixteen elements at a time (`abs.len()` a multiple of sixteen): each
/// vector's small and big elements compressed, in order, to the ends of their lists; returns
/// the lists' lengths `(big, small)`. The same lists as the scalar split (about a twentieth of
/// a conversion's samples there).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn split_avx512(
    abs: &[f32],
    cap_a: &[f32],
    limit: f32,
    (big, big_cap_a, small): (
        &mut [f32; MAX_GROUP],
        &mut [f32; MAX_GROUP],
        &mut [f32; MAX_GROUP],
    ),
) -> (usize, usize) {
    use std::arch::x86_64::{
        _CMP_LT_OQ, _mm512_cmp_ps_mask, _mm512_loadu_ps, _mm512_maskz_compress_ps, _mm512_set1_ps,
        _mm512_storeu_ps,
    };
    assert!(abs.len() <= MAX_GROUP && abs.len() % LANES == 0 && cap_a.len() == abs.len());
    let lim = _mm512_set1_ps(limit);
    let (mut nb, mut ns) = (0, 0);
    for (i, (a, c)) in abs
        .chunks_exact(LANES)
        .zip(cap_a.chunks_exact(LANES))
        .enumerate()
    {
        // SAFETY: both chunks hold sixteen f32.
        let (va, vc) = unsafe { (_mm512_loadu_ps(a.as_ptr()), _mm512_loadu_ps(c.as_ptr())) };
        let is_small = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(va, lim);
        let is_big = !is_small;
        debug_assert!(ns <= LANES * i && nb <= LANES * i);
        // SAFETY: each store writes sixteen lanes from `ns` or `nb`, both at most `16 · i` (the
        // elements of the vectors before this one), so it ends by `16 · (i + 1) ≤ abs.len() ≤
        // MAX_GROUP`; lanes past a list's new length are scratch, overwritten or never read.
        unsafe {
            _mm512_storeu_ps(
                small.as_mut_ptr().add(ns),
                _mm512_maskz_compress_ps(is_small, va),
            );
            _mm512_storeu_ps(
                big.as_mut_ptr().add(nb),
                _mm512_maskz_compress_ps(is_big, va),
            );
            _mm512_storeu_ps(
                big_cap_a.as_mut_ptr().add(nb),
                _mm512_maskz_compress_ps(is_big, vc),
            );
        }
        let k = is_small.count_ones() as usize;
        ns += k;
        nb += LANES - k;
    }
    (nb, ns)
}

/// Round half to even, `c − a·b` and `a·b + c`: fused and with a rounding instruction where
/// the pass is compiled for FMA (`FUSED`), else in separate steps (`a·b` is exact wherever
/// `c − a·b` is used, so both give the same value there).
#[inline(always)]
fn rne<const FUSED: bool>(x: f32) -> f32 {
    if FUSED {
        x.round_ties_even()
    } else {
        crate::contract::round_half_even_small(x)
    }
}

#[inline(always)]
fn sub_mul<const FUSED: bool>(c: f32, a: f32, b: f32) -> f32 {
    if FUSED { (-a).mul_add(b, c) } else { c - a * b }
}

#[inline(always)]
fn add_sq<const FUSED: bool>(acc: f32, r: f32) -> f32 {
    if FUSED {
        r.mul_add(r, acc)
    } else {
        acc + r * r
    }
}

/// One pass over the elements for sixteen scales `d`: each lane's bounds of the stored rule's
/// error in both ranges (`slack`: the codes' share of the margin per unit of scale).
#[inline(always)]
fn pass_body<const FUSED: bool>(s: &Split<'_>, d: &[f32; LANES], slack: f32, out: &mut Bounds) {
    let mut inv = [0f32; LANES];
    for j in 0..LANES {
        inv[j] = 1.0 / d[j];
    }
    let mut ea = [0f32; LANES];
    let mut eb = [0f32; LANES];
    let mut tmax = [0f32; LANES];
    for (&a, &ca) in s.big.iter().zip(s.cap_a) {
        let cb = 15.0 - ca;
        for j in 0..LANES {
            let t = a * inv[j];
            let t = if t < 32.0 { t } else { 32.0 };
            let k = rne::<FUSED>(t);
            let ka = if k < ca { k } else { ca };
            let kb = if k < cb { k } else { cb };
            ea[j] = add_sq::<FUSED>(ea[j], sub_mul::<FUSED>(a, d[j], ka));
            eb[j] = add_sq::<FUSED>(eb[j], sub_mul::<FUSED>(a, d[j], kb));
            tmax[j] = if t > tmax[j] { t } else { tmax[j] };
        }
    }
    // Four independent sums (the additions' latency, not their count, bounds one sum).
    let mut es = [[0f32; LANES]; 4];
    let quads = s.small.chunks_exact(4);
    let rest = quads.remainder();
    for quad in quads {
        for (acc, &a) in es.iter_mut().zip(quad) {
            for j in 0..LANES {
                let k = rne::<FUSED>(a * inv[j]);
                acc[j] = add_sq::<FUSED>(acc[j], sub_mul::<FUSED>(a, d[j], k));
            }
        }
    }
    for (acc, &a) in es.iter_mut().zip(rest) {
        for j in 0..LANES {
            let k = rne::<FUSED>(a * inv[j]);
            acc[j] = add_sq::<FUSED>(acc[j], sub_mul::<FUSED>(a, d[j], k));
        }
    }
    let eight = (7.5 * CAP_SAFE) as f32;
    let mut lower = [[0f32; LANES]; 2];
    let mut upper = [0f32; LANES];
    let mut least = [0f32; LANES];
    for j in 0..LANES {
        let small = (es[0][j] + es[1][j]) + (es[2][j] + es[3][j]);
        let tol = d[j] * slack + TINY;
        let (ma, mb) = (ea[j] + small, eb[j] + small);
        // The negative scale's codes differ from the positive one's only if one can be 8.
        let b_differs = tmax[j] >= eight;
        let (la, lb) = (ma * LOWER - tol, mb * LOWER - tol);
        lower[0][j] = la;
        lower[1][j] = if b_differs { lb } else { f32::INFINITY };
        let (ua, ub) = (ma * UPPER + tol, mb * UPPER + tol);
        upper[j] = if b_differs && ub < ua { ub } else { ua };
        least[j] = if b_differs && lb < la { lb } else { la };
    }
    out.lower = lower;
    out.least_lower = min_tree(least);
    out.upper = min_tree(upper);
}

/// The value of a positive bfloat16 pattern, in f32 (exact).
#[inline(always)]
fn bf16_value(g: u16) -> f32 {
    f32::from_bits((g as u32) << 16)
}

/// What [`load`] takes from a group: f32 sums of `v²` and `|v|` (each within `n · 2^-24` of the
/// real one, squares that leave the normal range aside), the largest positive weight and the
/// largest magnitude of a negative one.
struct Loaded {
    s_vv: f32,
    sum_abs: f32,
    p: f32,
    q: f32,
}

/// Fill the magnitudes and the positive scale's caps (7 for positive weights, 8 for the others)
/// of group `w` (a multiple of sixteen elements, as every kernel here takes), and take its
/// sums and extremes.
#[inline(always)]
fn load(w: &[f32], abs: &mut [f32], cap_a: &mut [f32]) -> Loaded {
    let (mut s_vv, mut sum_abs, mut p, mut q) =
        ([0f32; LANES], [0f32; LANES], [0f32; LANES], [0f32; LANES]);
    for ((w, abs), cap_a) in w
        .chunks_exact(LANES)
        .zip(abs.chunks_exact_mut(LANES))
        .zip(cap_a.chunks_exact_mut(LANES))
    {
        for (l, &v) in w.iter().enumerate() {
            let a = v.abs();
            abs[l] = a;
            cap_a[l] = if v > 0.0 { 7.0 } else { 8.0 };
            s_vv[l] += v * v;
            sum_abs[l] += a;
            p[l] = if v > p[l] { v } else { p[l] };
            q[l] = if -v > q[l] { -v } else { q[l] };
        }
    }
    Loaded {
        s_vv: sum_tree(s_vv),
        sum_abs: sum_tree(sum_abs),
        p: max_tree(p),
        q: max_tree(q),
    }
}

/// `Σ min(|v|, d − |v|)²` over the elements below `d`, in f32 (within `(n + 2) · 2^-24`): at
/// every scale of at least `d` an element smaller than it has code 0 or 1, so costs at least
/// its term. A lower bound of the error of every such scale once lowered by `2^-16`.
#[inline(always)]
fn beyond_sum(abs: &[f32], d: f32) -> f32 {
    let mut acc = [0f32; LANES];
    for chunk in abs.chunks_exact(LANES) {
        for (acc, &a) in acc.iter_mut().zip(chunk) {
            let t = if a < d - a { a } else { d - a };
            let t = if t > 0.0 { t } else { 0.0 };
            *acc += t * t;
        }
    }
    sum_tree(acc)
}

/// `Σ (|v| − cap·d)²` over the elements above their cap, in both ranges (caps `cap_a` and
/// `15 − cap_a`), in f32 (`cap·d` is exact): at every scale of at most `d` each such element
/// is clipped at least that much. Lower bounds once lowered by `2^-16`.
#[inline(always)]
fn clipped_sums(abs: &[f32], cap_a: &[f32], d: f32) -> [f32; 2] {
    let mut acc = [[0f32; LANES]; 2];
    for (chunk, caps) in abs.chunks_exact(LANES).zip(cap_a.chunks_exact(LANES)) {
        for (l, (&a, &ca)) in chunk.iter().zip(caps).enumerate() {
            let (ea, eb) = (a - ca * d, a - (15.0 - ca) * d);
            let (ea, eb) = (
                if ea > 0.0 { ea } else { 0.0 },
                if eb > 0.0 { eb } else { 0.0 },
            );
            acc[0][l] += ea * ea;
            acc[1][l] += eb * eb;
        }
    }
    acc.map(sum_tree)
}

/// For sixteen blocks of sixteen patterns at once (lane `j`: the scales `lo[j]..=hi[j]`):
/// `Σ min over d ∈ [lo, hi], k ∈ 0..=8 of (|v| − k·d)²`, in f32 (within `(n + 3) · 2^-24`,
/// squares that leave the normal range aside). Every stored scale of either sign in a block
/// gives each element some code magnitude `k ≤ 8` ([`range_gap`]), so costs at least the
/// block's sum: once lowered by `2^-16`, a lower bound of every error in the block. A block
/// whose bound exceeds the best error so far is not evaluated; the bounds of sixteen blocks
/// cost about as much as evaluating two of them.
#[inline(always)]
fn range_bounds(abs: &[f32], lo: &[f32; LANES], hi: &[f32; LANES]) -> [f32; LANES] {
    let mut inv = [0f32; LANES];
    for j in 0..LANES {
        inv[j] = 1.0 / lo[j];
    }
    // Four independent sums (the additions' latency, not their count, bounds one sum).
    let mut acc = [[0f32; LANES]; 4];
    for quad in abs.chunks_exact(4) {
        for (acc, &a) in acc.iter_mut().zip(quad) {
            for j in 0..LANES {
                let r = range_gap(a, inv[j], lo[j], hi[j]);
                acc[j] += r * r;
            }
        }
    }
    let mut out = [0f32; LANES];
    for j in 0..LANES {
        out[j] = (acc[0][j] + acc[1][j]) + (acc[2][j] + acc[3][j]);
    }
    out
}

/// The distance from `a = |v|` to the magnitudes a scale in `[lo, hi]` can give it,
/// `∪ k·[lo, hi]` over `k ∈ 0..=8` (`inv`: `1 / lo` in f32).
///
/// With `k = ⌊a / lo⌋` (at most 8), `a` lies in `k·[lo, hi]` or in the gap above it, whose
/// distance is `min(a − k·hi, (k + 1)·lo − a)` (`k + 1 = 9` only lowers it). A quotient
/// rounded across an integer gives a `k` one off, whose distance is then `≤ 0`: counted as 0,
/// never more than the true distance. `k·lo` and `k·hi` are exact (`k ≤ 9`, bfloat16 values)
/// and each difference rounds once.
#[inline(always)]
fn range_gap(a: f32, inv: f32, lo: f32, hi: f32) -> f32 {
    let k = (a * inv).floor();
    let k = if k < 8.0 { k } else { 8.0 };
    let above = a - k * hi;
    let below = (k + 1.0) * lo - a;
    let gap = if below < above { below } else { above };
    if gap > 0.0 { gap } else { 0.0 }
}

/// Sixteen lanes folded by `f`, halving (a tree of vector operations, not a chain of scalar
/// ones).
#[inline(always)]
fn fold_tree(mut v: [f32; LANES], f: impl Fn(f32, f32) -> f32) -> f32 {
    let mut w = LANES / 2;
    while w > 0 {
        for j in 0..w {
            v[j] = f(v[j], v[j + w]);
        }
        w /= 2;
    }
    v[0]
}

#[inline(always)]
fn sum_tree(v: [f32; LANES]) -> f32 {
    fold_tree(v, |a, b| a + b)
}

/// Selects, not `f32::min`/`max`: no NaN here, and a select is one instruction.
#[inline(always)]
fn min_tree(v: [f32; LANES]) -> f32 {
    fold_tree(v, |a, b| if b < a { b } else { a })
}

#[inline(always)]
fn max_tree(v: [f32; LANES]) -> f32 {
    fold_tree(v, |a, b| if b > a { b } else { a })
}

/// Instantiate the kernels (`load`, `pass_bounds`, `beyond_sum`, `clipped_sums`,
/// `range_bounds`) in a module,
/// compiled with the given target features and fused or separate arithmetic.
macro_rules! kernels {
    ($(#[$attr:meta])* $module:ident, $fused:literal) => {
        mod $module {
            use super::*;
            $(#[$attr])*
            pub(super) unsafe fn load(w: &[f32], abs: &mut [f32], cap_a: &mut [f32]) -> Loaded {
                super::load(w, abs, cap_a)
            }
            $(#[$attr])*
            pub(super) unsafe fn pass_bounds(s: &Split<'_>, d: &[f32; LANES], slack: f32, out: &mut Bounds) {
                pass_body::<$fused>(s, d, slack, out)
            }
            $(#[$attr])*
            pub(super) unsafe fn beyond_sum(abs: &[f32], d: f32) -> f32 {
                super::beyond_sum(abs, d)
            }
            $(#[$attr])*
            pub(super) unsafe fn clipped_sums(abs: &[f32], cap_a: &[f32], d: f32) -> [f32; 2] {
                super::clipped_sums(abs, cap_a, d)
            }
            $(#[$attr])*
            pub(super) unsafe fn range_bounds(abs: &[f32], lo: &[f32; LANES], hi: &[f32; LANES]) -> [f32; LANES] {
                super::range_bounds(abs, lo, hi)
            }
        }
    };
}

#[cfg(target_arch = "x86_64")]
kernels!(
    #[target_feature(enable = "avx512f,fma")]
    avx512,
    true
);
#[cfg(target_arch = "x86_64")]
kernels!(
    #[target_feature(enable = "avx2,fma")]
    avx2,
    true
);
kernels!(plain, false);

#[cfg(test)]
mod tests {
    use super::super::solve::Solver;
    use super::*;
    use crate::synth::SplitMix64;

    /// A search at `level`.
    fn at(level: Level) -> Direct {
        let mut d = Direct::new(ScaleDtype::Bf16).expect("bf16 scales");
        d.level = level;
        d
    }

    /// Groups of every kind the direct search must take: Gaussian and heavy-tailed weights at
    /// ordinary magnitudes, weights on power-of-two INT4 grids (error 0 is reachable), and
    /// weights on or a few ulps off half-steps of a bfloat16 scale (where the f32 division and
    /// the model's product can round to different codes).
    fn groups(rng: &mut SplitMix64, gs: usize) -> Vec<Vec<f32>> {
        let mut out = Vec::new();
        for s in [1e-7, 0.02, 1.0, 4e5] {
            for _ in 0..24 {
                out.push((0..gs).map(|_| (rng.normal() * s) as f32).collect());
                out.push(
                    (0..gs)
                        .map(|_| {
                            let chi = (rng.normal().powi(2) + rng.normal().powi(2)) / 2.0;
                            (rng.normal() / chi.sqrt().max(1e-3) * s) as f32
                        })
                        .collect(),
                );
            }
        }
        for m in 1..=8i64 {
            let d = 2f64.powi((rng.next_u64() % 20) as i32 - 10);
            out.push(
                (0..gs)
                    .map(|i| {
                        let c = if i == 0 {
                            -m
                        } else {
                            (rng.next_u64() % (2 * m as u64)) as i64 - m
                        };
                        (d * c as f64) as f32
                    })
                    .collect(),
            );
        }
        for r in 0..64 {
            out.push(crate::synth::half_step_group(rng, gs, r % 2 == 1));
        }
        out
    }

    /// Every level this CPU runs takes these groups itself and chooses as the breakpoint sweep
    /// does (the sweep is checked against the exhaustive oracle in `tests/it`).
    #[test]
    fn every_level_takes_ordinary_groups_and_matches_the_sweep() {
        let levels = Level::available();
        // On the real stderr: the harness captures `print!` of passing tests.
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), "ran: direct search levels {levels:?}");
        if !levels.iter().any(|l| *l != Level::Plain) {
            let _ = writeln!(
                std::io::stderr(),
                "skipped: the vector levels (this CPU has no AVX2 with FMA)"
            );
        }
        let mut rng = SplitMix64::new(0xD1EC7);
        for gs in [32usize, 64, 128] {
            let mut sweep = Solver::sweep_only(ScaleDtype::Bf16, false, gs);
            let groups = groups(&mut rng, gs);
            let want: Vec<Choice> = groups.iter().map(|w| sweep.solve(w)).collect();
            for &level in &levels {
                let mut direct = at(level);
                for (w, want) in groups.iter().zip(&want) {
                    let got = direct.solve(w);
                    assert_eq!(got, Some(*want), "{level:?}, group of {gs}: {w:?}");
                }
            }
        }
    }

    /// A pass's bounds hold the stored rule's exact error between them, lane by lane, at every
    /// level: each lower bound is at most the error, and the least upper bound at least the
    /// least error (including on half-steps, where the codes can differ).
    #[test]
    fn pass_bounds_hold_the_exact_error() {
        let mut rng = SplitMix64::new(0xB0B);
        for &level in &Level::available() {
            let mut direct = at(level);
            for w in groups(&mut rng, 32) {
                if direct.solve(&w).is_none() {
                    continue;
                }
                for b in &direct.passes[..direct.n_passes] {
                    let mut least = f64::INFINITY;
                    for j in 0..LANES {
                        let d = bf16_value(b.g0 + j as u16);
                        let errors = [d, -d].map(|d| exact::error_f64(&w, d, 8).expect("finite"));
                        if b.lower[1][j] == f32::INFINITY {
                            // Not offered: its codes are the positive scale's.
                            let codes = |d: f32| {
                                w.iter()
                                    .map(|&v| (v / d).round_ties_even().clamp(-8.0, 7.0) * d)
                                    .collect::<Vec<f32>>()
                            };
                            assert_eq!(
                                codes(d),
                                codes(-d),
                                "{level:?}: negative {d:e} dropped: {w:?}"
                            );
                        }
                        for (r, &e) in errors.iter().enumerate() {
                            least = least.min(e);
                            assert!(
                                b.lower[r][j] == f32::INFINITY || b.lower[r][j] as f64 <= e,
                                "{level:?}: lower {} above the error {e} at {d:e}, range {r}: {w:?}",
                                b.lower[r][j]
                            );
                        }
                    }
                    assert!(
                        b.upper as f64 >= least,
                        "{level:?}: upper {} < {least}",
                        b.upper
                    );
                }
            }
        }
    }

    /// Range bounds, lowered by the margins, are at most the stored rule's exact error at
    /// every pattern of their block in both ranges, at every level: sixteen blocks per call
    /// from well below to well above the optimum (grid and half-step groups included, where a
    /// bound can be 0 and the f32 quotient can round across an integer); and on Gaussian
    /// groups they skip blocks.
    #[test]
    fn range_bounds_hold_the_exact_error_and_skip_blocks() {
        let mut rng = SplitMix64::new(0x5A9E);
        for &level in &Level::available() {
            let mut direct = at(level);
            for w in groups(&mut rng, 32) {
                let absmax = w.iter().fold(0f32, |m, v| m.max(v.abs()));
                if absmax == 0.0 || direct.solve(&w).is_none() {
                    continue;
                }
                let anchor = ((absmax / 7.5).to_bits() >> 16) as u16;
                for start in [
                    anchor.saturating_sub(100).max(1),
                    anchor.saturating_sub(30).max(1),
                ] {
                    // Blocks of 16 patterns, overlapping (each starts 7 after the last).
                    let g0 = |j: usize| start + 7 * j as u16;
                    let lo = std::array::from_fn(|j| bf16_value(g0(j)));
                    let hi = std::array::from_fn(|j| bf16_value(g0(j) + LANES as u16 - 1));
                    let sums = at_level!(level, range_bounds(&direct.abs[..32], &lo, &hi));
                    for (j, &sum) in sums.iter().enumerate() {
                        let bound = f64::from(sum * LOWER - TINY);
                        for p in 0..LANES as u16 {
                            let d = bf16_value(g0(j) + p);
                            for d in [d, -d] {
                                let e = exact::error_f64(&w, d, 8).expect("finite");
                                assert!(
                                    bound <= e,
                                    "{level:?}: range bound {bound} above the error {e} at \
                                     {d:e} (block {:e}..{:e}): {w:?}",
                                    lo[j],
                                    hi[j]
                                );
                            }
                        }
                    }
                }
            }
            // Every block the search itself skipped (the lanes it took, the `ub` it had) holds
            // only choices strictly worse than the one it returned, on every kind of group.
            for gs in [32usize, 64, 128] {
                for w in groups(&mut rng, gs) {
                    let Some(best) = direct.solve(&w) else {
                        continue;
                    };
                    let value = |c: Choice| {
                        let d = bf16_value(c.bits & 0x7FFF);
                        if c.bits & 0x8000 != 0 { -d } else { d }
                    };
                    let least = exact::error_f64(&w, value(best), 8).expect("finite");
                    for &g0 in &direct.skipped_at {
                        for p in 0..LANES as u16 {
                            let d = bf16_value(g0 + p);
                            for d in [d, -d] {
                                let e = exact::error_f64(&w, d, 8).expect("finite");
                                assert!(
                                    e > least,
                                    "{level:?}: skipped {d:e} (block from pattern {g0}) has error \
                                     {e}, the choice {least}: {w:?}"
                                );
                            }
                        }
                    }
                }
            }
            // Gaussian groups: about 3.5 of about 8 blocks are skipped (see BENCHMARKS.md; the
            // count also holds blocks skipped past where the walk stops).
            let (mut pruned, mut passes) = (0, 0);
            for _ in 0..200 {
                let w: Vec<f32> = (0..32).map(|_| rng.normal() as f32).collect();
                direct.solve(&w).expect("an ordinary group");
                (pruned, passes) = (pruned + direct.n_pruned, passes + direct.n_passes);
            }
            println!("{level:?}: {passes} blocks evaluated, {pruned} skipped in 200 groups");
            assert!(
                pruned >= 200,
                "{level:?}: only {pruned} blocks skipped in 200 groups"
            );
        }
    }

    /// The walk of `solve` as it was before its stopping tests were moved to evaluated blocks:
    /// `beyond` / `clipped` before every block, skipped or not. Returns the first pattern of
    /// each pass it evaluates, in order (after `solve` ran the first pass).
    fn passes_testing_every_block(d: &mut Direct, n: usize, absmax: f32) -> Vec<u16> {
        let anchor = ((absmax / 7.5).to_bits() >> 16) as u16;
        let first_lo = anchor.saturating_sub(FIRST_BELOW).max(1);
        let first_hi = first_lo + LANES as u16 - 1;
        d.n_passes = 0;
        d.split(n, d.grid.value(first_lo) as f32);
        d.pass(first_lo);
        let top = d.grid.floor(2.0 * absmax as f64).unwrap_or(0);
        let ranges = d.near_ranges(n, first_lo);
        let (mut g, mut i) = (first_hi + 1, 0);
        while g <= top && !d.beyond(n, g) {
            if !(i < NEAR && ranges[i] * LOWER - TINY > d.ub) {
                d.pass(g);
            }
            g += LANES as u16;
            i += 1;
        }
        let (mut g, mut split_at, mut i) = (first_lo, first_lo, 0);
        while g > LANES as u16 && !d.clipped(n, g - 1) {
            g -= LANES as u16;
            i += 1;
            if i <= NEAR && ranges[NEAR + i - 1] * LOWER - TINY > d.ub {
                continue;
            }
            if g < split_at {
                split_at = g.saturating_sub(4 * LANES as u16).max(1);
                d.split(n, d.grid.value(split_at) as f32);
            }
            d.pass(g);
        }
        d.passes[..d.n_passes].iter().map(|b| b.g0).collect()
    }

    /// `solve` evaluates exactly the passes of the walk that tests every block
    /// ([`passes_testing_every_block`]), in the same order, at every level: its stopping tests
    /// run only at evaluated blocks, and that changes nothing but the work.
    #[test]
    fn the_stopping_tests_at_evaluated_blocks_run_the_same_passes() {
        let mut rng = SplitMix64::new(0x57095);
        let mut compared = 0;
        for &level in &Level::available() {
            let mut d = at(level);
            for gs in [32usize, 64, 128] {
                for w in groups(&mut rng, gs) {
                    let absmax = w.iter().fold(0f32, |m, v| m.max(v.abs()));
                    let Some(_) = d.solve(&w).filter(|_| absmax > 0.0) else {
                        continue;
                    };
                    let got: Vec<u16> = d.passes[..d.n_passes].iter().map(|b| b.g0).collect();
                    // The reference starts from the zero scale's bound, as `solve` does.
                    let l = at_level!(d.level, load(&w, &mut d.abs[..gs], &mut d.cap_a[..gs]));
                    d.ub = l.s_vv * UPPER + TINY;
                    let want = passes_testing_every_block(&mut d, gs, absmax);
                    assert_eq!(got, want, "{level:?}, group of {gs}: {w:?}");
                    compared += 1;
                }
            }
        }
        assert!(compared > 100, "only {compared} groups compared");
    }

    /// Every level splits a group into the same lists, in the same order (the AVX-512 level
    /// compresses vectors; the others go element by element), for groups of every size, with
    /// every element small, every one big, and mixed, elements at the split's limit and one
    /// ulp either side of it included.
    #[test]
    fn every_level_splits_alike() {
        let levels = Level::available();
        // On the real stderr: the harness captures `print!` of passing tests.
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), "ran: split at levels {levels:?}");
        #[cfg(target_arch = "x86_64")]
        if !levels.contains(&Level::Avx512) {
            let _ = writeln!(
                std::io::stderr(),
                "skipped: the AVX-512 split (this CPU has no AVX-512F with FMA)"
            );
        }
        let mut rng = SplitMix64::new(0x5B117);
        let lists = |d: &Direct| {
            (
                d.big[..d.n_big].to_vec(),
                d.big_cap_a[..d.n_big].to_vec(),
                d.small[..d.n_small].to_vec(),
            )
        };
        let mut plain = at(Level::Plain);
        for n in [16usize, 32, 48, 64, 128] {
            let mut w: Vec<f32> = (0..n).map(|_| rng.normal() as f32).collect();
            // The limit `split` takes for `d_min` 0.2, and its neighbours, either sign.
            let limit = (7.5 * CAP_SAFE * 0.2f32 as f64) as f32;
            let limit = f32::from_bits(limit.to_bits() - 1);
            for (i, v) in [limit, limit.next_up(), limit.next_down()]
                .iter()
                .enumerate()
            {
                w[3 * i] = *v;
                w[3 * i + 1] = -*v;
            }
            for &level in &levels {
                let mut d = at(level);
                for d_min in [0.0f32, 1e-3, 0.1, 0.2, 0.5, 1e3] {
                    for s in [&mut d, &mut plain] {
                        at_level!(s.level, load(&w, &mut s.abs[..n], &mut s.cap_a[..n]));
                        s.split(n, d_min);
                    }
                    assert_eq!(lists(&d), lists(&plain), "{level:?}, {n} elements, {d_min}");
                    assert_eq!(d.n_big + d.n_small, n);
                }
            }
        }
    }

    /// Magnitudes outside `[2^-40, 2^40]` are left to the other searches; an all-zero group is
    /// the zero scale at once.
    #[test]
    fn extreme_magnitudes_are_left_to_the_other_searches() {
        let mut direct = at(Level::detect());
        for s in [1e-20f32, 1e20] {
            let w: Vec<f32> = (0..32).map(|i| s * (i as f32 - 15.5)).collect();
            assert_eq!(direct.solve(&w), None, "magnitude {s:e}");
        }
        assert_eq!(direct.solve(&[0.0; 32]), Some(Choice { bits: 0, zero: 8 }));
    }
}
