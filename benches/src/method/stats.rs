//! Statistics of repeated bench measurements: medians, p10–p90 spreads, paired ratios, the
//! repetitions a difference needs, and whether two sample sets differ beyond their noise.
//!
//! Why this exists: on a shared 2-core VM one measurement of a kernel or a link says little
//! (run-to-run ratios moved by 2× in issue 17). Every bench figure is therefore the median of
//! repeated, interleaved measurements of the thing and its limit, with the spread of those
//! repetitions reported next to it, and `bench compare` needs one rule for "outside noise".
//! Percentiles are nearest-rank ([`percentile`]: the one definition every bench uses).

use serde::{Deserialize, Serialize};

/// Median and p10–p90 of a set of samples.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Spread {
    /// Number of samples.
    pub n: usize,
    /// Median (mean of the two middle samples for an even count).
    pub median: f64,
    /// 10th percentile (nearest rank).
    pub p10: f64,
    /// 90th percentile (nearest rank).
    pub p90: f64,
}

impl Spread {
    /// The spread of `samples` (all zero for none; non-finite samples are ignored).
    pub fn of(samples: &[f64]) -> Spread {
        let mut s: Vec<f64> = samples.iter().copied().filter(|x| x.is_finite()).collect();
        s.sort_by(f64::total_cmp);
        Spread {
            n: s.len(),
            median: median_sorted(&s),
            p10: percentile(&s, 10.0),
            p90: percentile(&s, 90.0),
        }
    }

    /// (p90 − p10) relative to the median (0 when the median is 0).
    pub(crate) fn relative_width(&self) -> f64 {
        if self.median == 0.0 {
            0.0
        } else {
            (self.p90 - self.p10) / self.median.abs()
        }
    }
}

/// Median of sorted samples (0 for none).
pub(crate) fn median_sorted(s: &[f64]) -> f64 {
    match s.len() {
        0 => 0.0,
        n if n % 2 == 1 => s[n / 2],
        n => 0.5 * (s[n / 2 - 1] + s[n / 2]),
    }
}

/// Per-pair ratios `a[i] / b[i]` of interleaved measurements (pairs with a non-positive
/// limit are left out).
pub(crate) fn paired_ratios(achieved: &[f64], limit: &[f64]) -> Vec<f64> {
    achieved
        .iter()
        .zip(limit)
        .filter(|&(_, &l)| l > 0.0)
        .map(|(&a, &l)| a / l)
        .collect()
}

/// Repetitions per side for a two-sided test at 5% with 80% power to see a relative
/// difference `delta` (0.10 = 10%) between two runs whose samples spread like `s`: the normal
/// approximation n = 2·(1.96 + 0.84)²·(σ/δ)² with σ estimated robustly as
/// (p90 − p10) / 2.563 of the median (the width of ±1.2816σ of a normal distribution), plus
/// 15% for a rank test instead of a t-test. At least 3.
pub(crate) fn repetitions_for(s: &Spread, delta: f64) -> usize {
    let sigma = s.relative_width() / 2.563;
    let n = 2.0 * (1.96f64 + 0.8416).powi(2) * (sigma / delta).powi(2) * 1.15;
    (n.ceil() as usize).max(3)
}

/// Repetition counts [`repetitions_for_resampled`] tries.
pub(crate) const RESAMPLED_COUNTS: [usize; 9] = [3, 5, 7, 11, 15, 21, 31, 41, 61];

/// Resampled trials per repetition count in [`repetitions_for_resampled`].
const TRIALS: usize = 60;

/// The fewest repetitions per run ([`RESAMPLED_COUNTS`]) at which [`judge`]'s rank test sees a
/// relative change `delta` in at least 80% of trials, each trial comparing `n` samples drawn
/// (with replacement) from `samples` against `n` others scaled by `1 − delta`: an empirical
/// power analysis on the run's own noise, heavy tails and all. None with fewer than 5 samples
/// or when even the largest count is not enough. Deterministic (fixed seed).
pub(crate) fn repetitions_for_resampled(samples: &[f64], delta: f64) -> Option<usize> {
    let s: Vec<f64> = samples.iter().copied().filter(|x| x.is_finite()).collect();
    if s.len() < 5 {
        return None;
    }
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut draw = || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        s[((state >> 33) % s.len() as u64) as usize]
    };
    RESAMPLED_COUNTS.into_iter().find(|&n| {
        let hits = (0..TRIALS)
            .filter(|_| {
                let a: Vec<f64> = (0..n).map(|_| draw()).collect();
                let b: Vec<f64> = (0..n).map(|_| draw() * (1.0 - delta)).collect();
                mann_whitney_p(&a, &b) < ALPHA
            })
            .count();
        5 * hits >= 4 * TRIALS
    })
}

/// Mann–Whitney U test of two sample sets: the two-sided p-value from the normal
/// approximation with tie correction (1 when either side has fewer than 2 samples).
pub(crate) fn mann_whitney_p(a: &[f64], b: &[f64]) -> f64 {
    let (n1, n2) = (a.len(), b.len());
    if n1 < 2 || n2 < 2 {
        return 1.0;
    }
    let mut all: Vec<(f64, bool)> = a
        .iter()
        .map(|&x| (x, true))
        .chain(b.iter().map(|&x| (x, false)))
        .collect();
    all.sort_by(|x, y| x.0.total_cmp(&y.0));
    let n = all.len();
    let (mut r1, mut ties, mut i) = (0.0, 0.0, 0);
    while i < n {
        let mut j = i;
        while j + 1 < n && all[j + 1].0 == all[i].0 {
            j += 1;
        }
        let rank = (i + j) as f64 / 2.0 + 1.0;
        let t = (j - i + 1) as f64;
        ties += t * t * t - t;
        r1 += rank * all[i..=j].iter().filter(|x| x.1).count() as f64;
        i = j + 1;
    }
    let (n1f, n2f, nf) = (n1 as f64, n2 as f64, n as f64);
    let u = r1 - n1f * (n1f + 1.0) / 2.0;
    let mean = n1f * n2f / 2.0;
    let var = n1f * n2f / 12.0 * ((nf + 1.0) - ties / (nf * (nf - 1.0)));
    if var <= 0.0 {
        return 1.0;
    }
    let z = ((u - mean).abs() - 0.5).max(0.0) / var.sqrt();
    2.0 * (1.0 - normal_cdf(z))
}

/// Standard normal CDF (Abramowitz–Stegun 7.1.26 erf, error < 1.5e-7).
fn normal_cdf(z: f64) -> f64 {
    let x = z.abs() / std::f64::consts::SQRT_2;
    let t = 1.0 / (1.0 + 0.3275911 * x);
    let poly = t
        * (0.254829592
            + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))));
    let erf = 1.0 - poly * (-x * x).exp();
    if z >= 0.0 {
        0.5 * (1.0 + erf)
    } else {
        0.5 * (1.0 - erf)
    }
}

/// How two measurements of one figure compare.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// The difference is within the noise of the two runs.
    WithinNoise,
    /// The difference is outside the noise (see [`judge`]).
    Outside,
    /// Not enough samples on either side to tell.
    Unknown,
}

/// Significance level of [`judge`]'s rank test.
pub(crate) const ALPHA: f64 = 0.01;

/// Whether samples `b` differ from samples `a` beyond noise: with raw samples on both sides
/// (at least 3 each), a Mann–Whitney test at [`ALPHA`]; with spreads only, whether the p10–p90
/// ranges are disjoint; otherwise unknown.
pub fn judge(a: &[f64], b: &[f64], sa: Option<&Spread>, sb: Option<&Spread>) -> Verdict {
    if a.len() >= 3 && b.len() >= 3 {
        return if mann_whitney_p(a, b) < ALPHA {
            Verdict::Outside
        } else {
            Verdict::WithinNoise
        };
    }
    match (sa, sb) {
        (Some(x), Some(y)) if x.n >= 2 && y.n >= 2 => {
            if x.p90 < y.p10 || y.p90 < x.p10 {
                Verdict::Outside
            } else {
                Verdict::WithinNoise
            }
        }
        _ => Verdict::Unknown,
    }
}

/// Percentile (nearest rank) of sorted samples; 0 for none.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

#[cfg(test)]
mod tests {
    use super::*;
    use quant_rng::Rng;

    /// A tiny deterministic generator for the synthetic sample sets.
    mod quant_rng {
        pub(super) struct Rng(pub(super) u64);
        impl Rng {
            pub(super) fn uniform(&mut self) -> f64 {
                self.0 = self
                    .0
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (self.0 >> 11) as f64 / (1u64 << 53) as f64
            }
            /// Normal by Box–Muller.
            pub(super) fn normal(&mut self, mean: f64, sd: f64) -> f64 {
                let (u, v) = (self.uniform().max(1e-12), self.uniform());
                mean + sd * (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
            }
        }
    }

    /// Brute-force nearest-rank percentile: the smallest sample with at least p% of the
    /// samples at or below it.
    fn oracle_percentile(s: &[f64], p: f64) -> f64 {
        let n = s.len() as f64;
        let mut c: Vec<f64> = s.to_vec();
        c.sort_by(f64::total_cmp);
        *c.iter()
            .find(|&&x| s.iter().filter(|&&y| y <= x).count() as f64 >= p / 100.0 * n - 1e-9)
            .unwrap()
    }

    /// Brute-force k-th smallest (1-based): the smallest sample with at least k samples at
    /// or below it.
    fn oracle_kth(s: &[f64], k: usize) -> f64 {
        s.iter()
            .copied()
            .filter(|&x| s.iter().filter(|&&y| y <= x).count() >= k)
            .fold(f64::MAX, f64::min)
    }

    /// Brute-force median from [`oracle_kth`].
    fn oracle_median(s: &[f64]) -> f64 {
        let n = s.len();
        if n % 2 == 1 {
            oracle_kth(s, n.div_ceil(2))
        } else {
            0.5 * (oracle_kth(s, n / 2) + oracle_kth(s, n / 2 + 1))
        }
    }

    #[test]
    fn spread_matches_brute_force_oracles() {
        let mut rng = Rng(7);
        for n in 1..40 {
            let s: Vec<f64> = (0..n).map(|_| (rng.uniform() * 20.0).floor()).collect();
            let sp = Spread::of(&s);
            assert_eq!(sp.n, n);
            assert_eq!(sp.p10, oracle_percentile(&s, 10.0), "{s:?}");
            assert_eq!(sp.p90, oracle_percentile(&s, 90.0), "{s:?}");
            assert_eq!(sp.median, oracle_median(&s), "{s:?}");
            assert!(sp.p10 <= sp.median && sp.median <= sp.p90);
        }
        assert_eq!(Spread::of(&[]).n, 0);
        assert_eq!(Spread::of(&[f64::NAN, 2.0]).median, 2.0);
    }

    #[test]
    fn paired_ratios_skip_empty_limits() {
        assert_eq!(
            paired_ratios(&[2.0, 3.0, 4.0], &[4.0, 0.0, 2.0]),
            [0.5, 2.0]
        );
    }

    #[test]
    fn judge_flags_a_real_shift_and_not_noise() {
        let mut rng = Rng(11);
        let mut draw = |mean: f64| (0..15).map(|_| rng.normal(mean, 0.03)).collect::<Vec<_>>();
        let (a, same, shifted) = (draw(1.0), draw(1.0), draw(1.10));
        assert_eq!(judge(&a, &same, None, None), Verdict::WithinNoise);
        assert_eq!(judge(&a, &shifted, None, None), Verdict::Outside);
        // Spreads only: disjoint p10–p90 ranges are outside noise, overlapping ones are not.
        let (sa, sb) = (Spread::of(&a), Spread::of(&shifted));
        assert_eq!(judge(&[], &[], Some(&sa), Some(&sb)), Verdict::Outside);
        assert_eq!(judge(&[], &[], Some(&sa), Some(&sa)), Verdict::WithinNoise);
        assert_eq!(judge(&[1.0], &[2.0], None, None), Verdict::Unknown);
    }

    #[test]
    fn mann_whitney_p_is_small_only_for_separated_sets() {
        let a: Vec<f64> = (0..10).map(f64::from).collect();
        let b: Vec<f64> = (100..110).map(f64::from).collect();
        assert!(mann_whitney_p(&a, &b) < 0.001);
        assert!(mann_whitney_p(&a, &a) > 0.9);
        // all ties: no evidence of a difference
        assert_eq!(mann_whitney_p(&[1.0; 5], &[1.0; 5]), 1.0);
    }

    #[test]
    fn resampled_repetitions_grow_with_the_noise() {
        let mut rng = Rng(3);
        let mut set = |sd: f64| (0..40).map(|_| rng.normal(1.0, sd)).collect::<Vec<_>>();
        let (quiet, mid, loud) = (set(0.005), set(0.05), set(0.5));
        let q = repetitions_for_resampled(&quiet, 0.1).unwrap();
        let m = repetitions_for_resampled(&mid, 0.1).unwrap();
        assert!(q <= 7, "{q}");
        assert!(q < m, "{q} {m}");
        assert_eq!(repetitions_for_resampled(&loud, 0.1), None);
        assert_eq!(repetitions_for_resampled(&quiet[..4], 0.1), None);
    }

    #[test]
    fn repetitions_grow_with_the_noise() {
        let s = |w: f64| Spread {
            n: 10,
            median: 1.0,
            p10: 1.0 - w / 2.0,
            p90: 1.0 + w / 2.0,
        };
        assert_eq!(repetitions_for(&s(0.0), 0.1), 3);
        let (quiet, noisy) = (repetitions_for(&s(0.1), 0.1), repetitions_for(&s(0.3), 0.1));
        assert!(quiet < noisy, "{quiet} {noisy}");
        // σ = 0.3 / 2.563 = 0.117 → 2·7.85·1.37·1.15 ≈ 24.8
        assert_eq!(noisy, 25);
    }

    #[test]
    fn percentile_is_nearest_rank() {
        let s: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&s, 50.0), 50.0);
        assert_eq!(percentile(&s, 99.0), 99.0);
        assert_eq!(percentile(&s, 100.0), 100.0);
        assert_eq!(percentile(&[7.0], 99.0), 7.0);
    }
}
