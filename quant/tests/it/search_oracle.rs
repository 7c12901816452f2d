//! The searched quantizer's choice is the exhaustive optimum: for every group, the scale and
//! zero point it stores are the least, in the quantizer's order (exact squared error, then the
//! tie-break), over every finite 16-bit scale pattern of both signs and every zero point. The
//! oracle below tries them all; it shares with the quantizer only the exact comparison of two
//! choices (`choice_order`, tested against integer arithmetic in the crate's unit tests), used
//! to settle errors that agree to 40 bits.
//!
//! Groups: Gaussian, heavy-tailed, bfloat16-exact, all-zero, constant, one-sided, a single
//! nonzero weight, weights spanning many binades, and weights that lie exactly on an INT4 grid
//! (power-of-two scales whose largest code is anywhere from 1 to 8, full-range grids, grids
//! with zero points), at magnitudes from subnormal to near `f32::MAX`.

use expertmesh_quant::format::{PackedMatrix, QuantSpec, ScaleDtype};
use expertmesh_quant::search::{
    Choice, choice_order, quantize_matrix_searched, relative_error, search_group,
    search_group_sweep,
};
use expertmesh_quant::synth::{SplitMix64, half_step_group};
use half::bf16;
use std::cmp::Ordering;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering as AtomicOrdering};

/// The weight kinds, each at the magnitude `s`.
#[derive(Clone, Copy, Debug)]
enum Kind {
    Gaussian,
    Bf16Gaussian,
    HeavyTailed,
    Zero,
    Constant,
    OneSided,
    SingleNonzero,
    /// Every fifth weight `1e-12` of the others.
    Binades,
    /// `2^e · c` with integer codes `c` in `-m ..= m-1` (`m` from 1 to 8, the extreme used):
    /// a symmetric group some power-of-two scale reproduces exactly.
    PowerOfTwoGrid,
    /// `d · (q − z)` with `q` in `0 ..= 15` (both ends used), an arbitrary bf16 `d`.
    ZeroPointGrid,
}

const KINDS: [Kind; 10] = [
    Kind::Gaussian,
    Kind::Bf16Gaussian,
    Kind::HeavyTailed,
    Kind::Zero,
    Kind::Constant,
    Kind::OneSided,
    Kind::SingleNonzero,
    Kind::Binades,
    Kind::PowerOfTwoGrid,
    Kind::ZeroPointGrid,
];

/// One group of `gs` weights of `kind` at magnitude `s`.
fn group(rng: &mut SplitMix64, kind: Kind, gs: usize, s: f64) -> Vec<f32> {
    let mut w: Vec<f64> = (0..gs)
        .map(|i| {
            let z = rng.normal();
            match kind {
                Kind::Gaussian | Kind::PowerOfTwoGrid | Kind::ZeroPointGrid => z * s,
                Kind::Bf16Gaussian => bf16::from_f32((z * s) as f32).to_f32() as f64,
                Kind::HeavyTailed => {
                    let chi =
                        (rng.normal().powi(2) + rng.normal().powi(2) + rng.normal().powi(2)) / 3.0;
                    z / chi.sqrt().max(1e-3) * s
                }
                Kind::Zero => 0.0,
                Kind::Constant => s,
                Kind::OneSided => z.abs() * s + s,
                Kind::SingleNonzero if i == 5 => z * s,
                Kind::SingleNonzero => 0.0,
                Kind::Binades if i % 5 == 0 => z * s * 1e-12,
                Kind::Binades => z * s,
            }
        })
        .collect();
    match kind {
        Kind::PowerOfTwoGrid => {
            let m = 1 + (rng.next_u64() % 8) as i64;
            let d = 2f64.powi(s.log2().floor() as i32 - 2);
            for (i, x) in w.iter_mut().enumerate() {
                let c = (rng.next_u64() % (2 * m as u64)) as i64 - m;
                // The extreme of the grid is used, on either side.
                let c = if i == 3 {
                    [-m, m - 1][rng.next_u64() as usize % 2]
                } else {
                    c
                };
                *x = d * c as f64;
            }
        }
        Kind::ZeroPointGrid => {
            let d = bf16::from_f64(s / 4.0).to_f64();
            let z = (rng.next_u64() % 16) as i64;
            for (i, x) in w.iter_mut().enumerate() {
                let q = match i {
                    0 => 0,
                    1 => 15,
                    _ => (rng.next_u64() % 16) as i64,
                };
                *x = d * (q - z) as f64;
            }
        }
        _ => {}
    }
    w.into_iter()
        .map(|v| (v as f32).clamp(f32::MIN, f32::MAX))
        .collect()
}

/// Every stored choice of `spec` with its scale's value: every finite pattern of both signs
/// (the zero scale once, as `+0` with zero point 8) with every zero point (8 only, without
/// zero points).
fn all_choices(spec: QuantSpec) -> Vec<(Choice, f32)> {
    let zeros: Vec<u8> = if spec.zero_points {
        (0..16).collect()
    } else {
        vec![8]
    };
    let mut v = vec![(Choice { bits: 0, zero: 8 }, 0.0)];
    for bits in 1..=u16::MAX {
        let d = spec.scale_dtype.to_f32(bits);
        if bits == 0x8000 || !d.is_finite() {
            continue;
        }
        v.extend(zeros.iter().map(|&zero| (Choice { bits, zero }, d)));
    }
    v
}

/// The dequantized value of `v` under scale `d` and zero point `z`, by the format's rule.
fn dequantized(v: f32, d: f32, z: u8) -> f32 {
    let q = if d == 0.0 {
        z
    } else {
        ((v / d).round_ties_even() + z as f32).clamp(0.0, 15.0) as u8
    };
    d * (q as f32 - z as f32)
}

/// The squared error of a choice by the format's rule (the dequantizer's f32 values), in f64
/// and in element order, or infinity once the partial sum passes `stop` (the terms are not
/// negative, so the whole sum would too) or a dequantized value overflows.
fn error(w: &[f32], d: f32, z: u8, stop: f64) -> f64 {
    let mut e = 0f64;
    for &v in w {
        let y = dequantized(v, d, z);
        if !y.is_finite() {
            return f64::INFINITY;
        }
        e += (v as f64 - y as f64).powi(2);
        if e > stop {
            return f64::INFINITY;
        }
    }
    e
}

/// The least choice by trying all: the least f64 error, then every choice within `2^-40` of it
/// ordered exactly.
fn exhaustive(w: &[f32], spec: QuantSpec, choices: &[(Choice, f32)]) -> Choice {
    let near = |e: f64| e * (1.0 + 2f64.powi(-40));
    // One pass: every choice within 2^-40 of the least so far is kept (the least only falls,
    // so every choice within 2^-40 of the final least is among them), then filtered below.
    let mut least = f64::INFINITY;
    let mut kept: Vec<(Choice, f32, f64)> = Vec::new();
    for &(c, d) in choices {
        let e = error(w, d, c.zero, near(least));
        if e.is_finite() {
            least = least.min(e);
            kept.push((c, d, e));
        }
    }
    // The tie-break: the zero scale first, then the smaller magnitude, the positive sign, the
    // smaller zero point.
    let key = |c: &Choice| match c.bits & 0x7FFF {
        0 => (0, 0, 0),
        mag => (mag, c.bits >> 15, c.zero),
    };
    // Choices within 2^-40 of the least, one per distinct dequantized group (those have the
    // same exact error: the tie-break alone orders them), then ordered exactly.
    let mut by_output: HashMap<Vec<u32>, Choice> = HashMap::new();
    let mut out = Vec::with_capacity(w.len());
    for &(c, d, e) in &kept {
        if e > near(least) {
            continue;
        }
        out.clear();
        out.extend(w.iter().map(|&v| dequantized(v, d, c.zero).to_bits()));
        match by_output.get_mut(&out) {
            Some(slot) if key(&c) < key(slot) => *slot = c,
            Some(_) => {}
            None => {
                by_output.insert(out.clone(), c);
            }
        }
    }
    by_output
        .into_values()
        .min_by(|a, b| choice_order(w, spec.scale_dtype, *a, *b))
        .expect("the zero scale is always a choice")
}

/// Checks every group against the oracle, the groups shared among the machine's cores (the
/// oracle tries every 16-bit scale of each group: most of this binary's run time). A failure
/// in any thread fails the test with that group's message.
fn check_groups(spec: QuantSpec, groups: &[Vec<f32>]) {
    let choices = all_choices(spec);
    let next = AtomicUsize::new(0);
    // At most 8 threads: each holds up to every choice of a group (25 MB for an all-zero
    // group with zero points) while it orders them.
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(8)
        .min(groups.len());
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| {
                    loop {
                        let i = next.fetch_add(1, AtomicOrdering::Relaxed);
                        let Some(w) = groups.get(i) else { break };
                        check_group(spec, &choices, i, w);
                    }
                })
            })
            .collect();
        for w in workers {
            if let Err(panic) = w.join() {
                std::panic::resume_unwind(panic);
            }
        }
    });
}

fn check_group(spec: QuantSpec, choices: &[(Choice, f32)], i: usize, w: &[f32]) {
    let want = exhaustive(w, spec, choices);
    let got = search_group(w, spec);
    assert_eq!(
        choice_order(w, spec.scale_dtype, got, want),
        Ordering::Equal,
        "{spec} group {i}: searched {got:?} (error {:e}), exhaustive {want:?} (error {:e}), \
         weights {w:?}",
        error(
            w,
            spec.scale_dtype.to_f32(got.bits),
            got.zero,
            f64::INFINITY
        ),
        error(
            w,
            spec.scale_dtype.to_f32(want.bits),
            want.zero,
            f64::INFINITY
        ),
    );
    assert_eq!(got, want, "{spec} group {i}");
}

/// Every kind at every magnitude (groups of 32 without zero points and bf16 scales; a fraction
/// of the kind × magnitude pairs otherwise, each kind still at several magnitudes), symmetric and
/// with zero points, groups of 32, 64 and 128, for one scale type.
fn exhaustive_optimum(scale_dtype: ScaleDtype) {
    let magnitudes = [1e-40, 1e-30, 1e-7, 0.02, 1.0, 500.0, 4e5, 1e30, 1e37];
    for zero_points in [false, true] {
        for gs in [32u32, 64, 128] {
            let spec = QuantSpec {
                group_size: gs,
                scale_dtype,
                zero_points,
            };
            let mut rng = SplitMix64::new(gs as u64 * 31 + zero_points as u64);
            let mut groups = Vec::new();
            // Zero points cost 16 times as much to search exhaustively, larger groups more
            // per group.
            // f16 scales cannot reach the largest magnitudes: every choice near the largest
            // scale then errs about alike and the oracle orders them exactly, which is slow.
            let f16 = (scale_dtype == ScaleDtype::F16) as usize;
            let every = match (zero_points, gs) {
                (false, 32) => 1 + f16,
                (false, _) => 4 + 2 * f16,
                (true, 32) => 5 + 2 * f16,
                (true, _) => 0,
            };
            if every > 0 {
                for (k, &kind) in KINDS.iter().enumerate() {
                    for (m, &s) in magnitudes.iter().enumerate() {
                        if (k + m) % every == 0 {
                            groups.push(group(&mut rng, kind, gs as usize, s));
                        }
                    }
                }
            } else {
                groups.push(group(&mut rng, Kind::HeavyTailed, gs as usize, 1.0));
                groups.push(group(&mut rng, Kind::ZeroPointGrid, gs as usize, 1.0));
            }
            check_groups(spec, &groups);
        }
    }
}

#[test]
fn searched_choice_is_the_exhaustive_optimum_bf16_scales() {
    exhaustive_optimum(ScaleDtype::Bf16);
}

#[test]
fn searched_choice_is_the_exhaustive_optimum_f16_scales() {
    exhaustive_optimum(ScaleDtype::F16);
}

/// Weights on an INT4 grid come back exactly: symmetric power-of-two grids whose largest code
/// is 4, 5, 6 or 7 (absmax maps it to 8 and misses them), full-range grids, and grids with
/// zero points; each with its error 0.
#[test]
fn grid_weights_are_reproduced_exactly() {
    let mut rng = SplitMix64::new(0x9A1D);
    for scale_dtype in [ScaleDtype::Bf16, ScaleDtype::F16] {
        for (zero_points, kind) in [
            (false, Kind::PowerOfTwoGrid),
            (true, Kind::PowerOfTwoGrid),
            (true, Kind::ZeroPointGrid),
        ] {
            let spec = QuantSpec {
                group_size: 32,
                scale_dtype,
                zero_points,
            };
            let (rows, cols) = (8, 256);
            let mut x = Vec::new();
            for _ in 0..rows * cols / 32 {
                x.extend(group(&mut rng, kind, 32, 0.02));
            }
            let m = quantize_matrix_searched(&x, rows, cols, spec).unwrap();
            assert_eq!(relative_error(&x, &m), 0.0, "{spec} {kind:?}");
            let absmax = PackedMatrix::quantize("t", spec, rows, cols, &x).unwrap();
            println!(
                "{spec} {kind:?}: searched error 0, absmax {:.4}",
                relative_error(&x, &absmax)
            );
        }
    }
}

/// The direct symmetric search (bfloat16 scales; f16 ones and zero points always sweep) and
/// the breakpoint sweep choose alike on many groups of every kind, magnitude and size (the
/// sweep is itself checked against the exhaustive oracle above, on fewer groups).
#[test]
fn direct_search_matches_the_sweep() {
    let magnitudes = [1e-40, 1e-30, 1e-7, 0.02, 1.0, 500.0, 4e5, 1e30, 1e37];
    let mut rng = SplitMix64::new(0xFA57);
    for scale_dtype in [ScaleDtype::Bf16] {
        for gs in [32usize, 64, 128] {
            let spec = QuantSpec {
                group_size: gs as u32,
                scale_dtype,
                zero_points: false,
            };
            let reps = 4096 / gs;
            for (k, &kind) in KINDS.iter().enumerate() {
                for (m, &s) in magnitudes.iter().enumerate() {
                    for r in 0..reps / 8 + usize::from((k + m) % 3 == 0) * reps {
                        let w = group(&mut rng, kind, gs, s);
                        let (got, want) = (search_group(&w, spec), search_group_sweep(&w, spec));
                        assert_eq!(
                            got, want,
                            "{spec} {kind:?} magnitude {s:e} repetition {r}: direct {got:?}, \
                             sweep {want:?}, weights {w:?}"
                        );
                    }
                }
            }
            // Weights on the breakpoints of a bfloat16 scale (`(c + ½)·d`, where the code is a
            // half-even tie), and a few ulps off them: the cases where the f32 division decides.
            for r in 0..512 {
                let w = half_step_group(&mut rng, gs, r % 2 == 1);
                let (got, want) = (search_group(&w, spec), search_group_sweep(&w, spec));
                assert_eq!(got, want, "{spec} half-step group {r}: weights {w:?}");
            }
        }
    }
}
