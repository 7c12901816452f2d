//! The searched INT4 quantizer: lower error than absmax round-to-nearest (overall and per
//! group), same layout, edge cases (zero groups, non-finite input, tiny and huge magnitudes).

use expertmesh_quant::format::{FormatError, PackedMatrix, QuantSpec, ScaleDtype};
use expertmesh_quant::search::{
    self, max_scale, quantize_matrix_searched, quantize_matrix_searched_bf16,
    quantize_matrix_searched_f16, relative_error,
};
use expertmesh_quant::synth::{self, SplitMix64};
use half::{bf16, f16};

fn spec(group_size: u32, scale_dtype: ScaleDtype, zero_points: bool) -> QuantSpec {
    QuantSpec {
        group_size,
        scale_dtype,
        zero_points,
    }
}

fn all_specs() -> Vec<QuantSpec> {
    let mut v = Vec::new();
    for g in [32, 64, 128] {
        for dt in [ScaleDtype::Bf16, ScaleDtype::F16] {
            for zp in [false, true] {
                v.push(spec(g, dt, zp));
            }
        }
    }
    v
}

/// Student-t-like heavy tails (3 degrees of freedom): a normal over the root mean square of
/// three more normals.
fn heavy_tailed(rng: &mut SplitMix64, n: usize, scale: f64) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let z = rng.normal();
            let chi = (rng.normal().powi(2) + rng.normal().powi(2) + rng.normal().powi(2)) / 3.0;
            (z / chi.sqrt().max(1e-3) * scale) as f32
        })
        .collect()
}

/// Squared error of every group, in f64.
fn group_errors(x: &[f32], m: &PackedMatrix) -> Vec<f64> {
    let deq = m.dequantize();
    let gs = m.spec().group();
    x.chunks(gs)
        .zip(deq.chunks(gs))
        .map(|(a, b)| {
            a.iter()
                .zip(b)
                .map(|(&p, &q)| (p as f64 - q as f64).powi(2))
                .sum()
        })
        .collect()
}

fn ratio(x: &[f32], rows: usize, cols: usize, s: QuantSpec) -> (f64, f64) {
    let base = PackedMatrix::quantize("t", s, rows, cols, x).unwrap();
    let searched = quantize_matrix_searched(x, rows, cols, s).unwrap();
    let (eb, es) = (relative_error(x, &base), relative_error(x, &searched));
    (es / eb, es)
}

/// Relative error of the searched quantizer over absmax round-to-nearest's, per spec. Measured:
/// 0.938 ..= 0.954 on Gaussian and 0.931 ..= 0.968 on t3 weights. A 0.9 bound is out of reach
/// for any quantizer of this format: the searched choice is the per-group optimum over every
/// stored scale and zero point (`search_oracle.rs` checks it against an exhaustive search).
#[test]
fn searched_error_beats_absmax_by_a_measured_margin() {
    let (rows, cols) = (64, 512);
    for (name, heavy) in [("gaussian", false), ("heavy-tailed t3", true)] {
        let mut rng = SplitMix64::new(0x5EA2C4 + heavy as u64);
        let x = if heavy {
            heavy_tailed(&mut rng, rows * cols, 0.02)
        } else {
            synth::normal_vec(&mut rng, rows * cols, 0.02)
        };
        for s in all_specs() {
            let (r, es) = ratio(&x, rows, cols, s);
            println!("{name:16} {s:32} searched/absmax = {r:.4} (searched rel. error {es:.5})");
            let bound = if heavy { 0.975 } else { 0.96 };
            assert!(r <= bound, "{name} {s}: ratio {r}");
        }
    }
}

#[test]
fn every_group_is_no_worse_than_absmax() {
    let (rows, cols) = (16, 384);
    for (i, s) in all_specs().into_iter().enumerate() {
        for scale in [1e-6f64, 0.02, 3.0, 500.0] {
            let mut rng = SplitMix64::new(i as u64 * 977 + scale.to_bits());
            let mut x = heavy_tailed(&mut rng, rows * cols, scale);
            x.extend(synth::normal_vec(&mut rng, rows * cols, scale));
            // A group with all weights of one sign, and a constant group.
            x[..32].iter_mut().for_each(|v| *v = v.abs() + scale as f32);
            x[384..384 + 32].fill(scale as f32);
            let base = PackedMatrix::quantize("t", s, 2 * rows, cols, &x).unwrap();
            let searched = quantize_matrix_searched(&x, 2 * rows, cols, s).unwrap();
            let (eb, es) = (group_errors(&x, &base), group_errors(&x, &searched));
            for (g, (b, e)) in eb.iter().zip(&es).enumerate() {
                assert!(
                    e <= b,
                    "{s} scale {scale}: group {g} searched {e} > absmax {b}"
                );
            }
        }
    }
}

#[test]
fn layout_round_trips_through_the_dequantizer() {
    let (rows, cols) = (8, 256);
    for s in all_specs() {
        let mut rng = SplitMix64::new(7);
        let x = heavy_tailed(&mut rng, rows * cols, 0.1);
        let m = quantize_matrix_searched(&x, rows, cols, s).unwrap();
        assert_eq!(m.bytes() as u64, s.matrix_bytes(rows as u64, cols as u64));
        // Rebuild from the raw arrays and decode the bytes by hand (Q4_0 nibble order).
        let again =
            PackedMatrix::from_parts("t", s, rows, cols, m.nibbles(), m.scales(), m.zeros())
                .unwrap();
        assert_eq!(again, m);
        let deq = m.dequantize();
        let gs = s.group();
        let zrow = (cols / gs).div_ceil(2);
        for n in 0..rows {
            for k in 0..cols {
                let (b, j) = (k / 32, k % 32);
                let byte = m.nibbles()[n * cols / 2 + b * 16 + j % 16];
                let q = if j < 16 { byte & 15 } else { byte >> 4 } as i32;
                let g = k / gs;
                let z = m.zeros().map_or(8, |zs| {
                    let zb = zs[n * zrow + g / 2];
                    if g % 2 == 0 { zb & 15 } else { zb >> 4 }
                }) as i32;
                let d = s.scale_dtype.to_f32(m.scales()[n * (cols / gs) + g]);
                let want = d * (q - z) as f32;
                assert_eq!(deq[n * cols + k].to_bits(), want.to_bits());
                assert_eq!(m.value(n, k).to_bits(), want.to_bits());
            }
        }
        // Deterministic.
        assert_eq!(quantize_matrix_searched(&x, rows, cols, s).unwrap(), m);
    }
}

#[test]
fn zero_groups_dequantize_to_zero() {
    for s in all_specs() {
        let cols = 2 * s.group();
        let mut rng = SplitMix64::new(3);
        let mut x = synth::normal_vec(&mut rng, 2 * cols, 1.0);
        x[..s.group()].fill(0.0);
        x[cols + s.group()..].fill(-0.0);
        let m = quantize_matrix_searched(&x, 2, cols, s).unwrap();
        let deq = m.dequantize();
        for (n, g) in [(0, 0), (1, 1)] {
            assert_eq!(m.scale(n, g), 0.0);
            assert_eq!(m.scales()[n * 2 + g], 0, "zero scale is stored as +0");
            let gs = s.group();
            assert!(
                deq[n * cols + g * gs..n * cols + (g + 1) * gs]
                    .iter()
                    .all(|&v| v == 0.0)
            );
        }
        let all_zero = quantize_matrix_searched(&vec![0.0; cols], 1, cols, s).unwrap();
        assert_eq!(relative_error(&vec![0.0; cols], &all_zero), 0.0);
    }
}

#[test]
fn non_finite_weights_are_named() {
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let mut x = vec![0.5f32; 3 * 64];
        x[2 * 64 + 37] = bad;
        for zp in [false, true] {
            let e = quantize_matrix_searched(&x, 3, 64, spec(32, ScaleDtype::Bf16, zp));
            match e {
                Err(FormatError::NonFiniteWeight { row, col, .. }) => {
                    assert_eq!((row, col), (2, 37));
                }
                other => panic!("expected NonFiniteWeight, got {other:?}"),
            }
        }
    }
    let e = quantize_matrix_searched(&[0.0; 31], 1, 32, QuantSpec::G32_BF16).unwrap_err();
    assert!(matches!(e, FormatError::LengthMismatch { .. }), "{e}");
    let e = quantize_matrix_searched(&[0.0; 48], 1, 48, QuantSpec::G32_BF16).unwrap_err();
    assert!(matches!(e, FormatError::ColsNotMultiple { .. }), "{e}");
}

#[test]
fn huge_magnitudes_clamp_the_scale_instead_of_overflowing() {
    let mut rng = SplitMix64::new(11);
    for zp in [false, true] {
        // f16 scales: absmax would need a scale of ~1.25e5 > 65504.
        let s = spec(32, ScaleDtype::F16, zp);
        let x = synth::normal_vec(&mut rng, 4 * 64, 4e5);
        assert!(matches!(
            PackedMatrix::quantize("t", s, 4, 64, &x),
            Err(FormatError::ScaleOverflow { .. })
        ));
        let m = quantize_matrix_searched(&x, 4, 64, s).unwrap();
        assert!(
            m.scales()
                .iter()
                .all(|&b| b & 0x7FFF <= max_scale(ScaleDtype::F16))
        );
        assert!(m.dequantize().iter().all(|v| v.is_finite()));
        assert!(relative_error(&x, &m) < 1.0);
        // bf16 scales near the top of f32: every dequantized value stays finite.
        let s = spec(32, ScaleDtype::Bf16, zp);
        let mut x: Vec<f32> = (0..64)
            .map(|i| (i as f32 - 31.5) / 31.5 * f32::MAX)
            .collect();
        x[5] = f32::MAX;
        x[40] = f32::MIN;
        let m = quantize_matrix_searched(&x, 1, 64, s).unwrap();
        assert!(m.dequantize().iter().all(|v| v.is_finite()));
        assert!(relative_error(&x, &m) < 0.2, "{}", relative_error(&x, &m));
    }
}

#[test]
fn tiny_magnitudes_are_no_worse_than_absmax() {
    let mut rng = SplitMix64::new(12);
    for s in all_specs() {
        for scale in [1e-7, 1e-9, 1e-30, 1e-39] {
            let x = synth::normal_vec(&mut rng, 2 * 128, scale);
            let base = PackedMatrix::quantize("t", s, 2, 128, &x).unwrap();
            let m = quantize_matrix_searched(&x, 2, 128, s).unwrap();
            let (eb, es) = (relative_error(&x, &base), relative_error(&x, &m));
            assert!(es <= eb, "{s} scale {scale}: {es} > {eb}");
            assert!(es.is_finite());
        }
    }
}

#[test]
fn half_precision_inputs_match_their_f32_values() {
    let mut rng = SplitMix64::new(13);
    let x = heavy_tailed(&mut rng, 4 * 128, 0.05);
    for s in all_specs() {
        let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
        let wide: Vec<f32> = xb.iter().map(|v| v.to_f32()).collect();
        assert_eq!(
            quantize_matrix_searched_bf16(&xb, 4, 128, s).unwrap(),
            quantize_matrix_searched(&wide, 4, 128, s).unwrap()
        );
        let xh: Vec<f16> = x.iter().map(|&v| f16::from_f32(v)).collect();
        let wide: Vec<f32> = xh.iter().map(|v| v.to_f32()).collect();
        assert_eq!(
            quantize_matrix_searched_f16(&xh, 4, 128, s).unwrap(),
            quantize_matrix_searched(&wide, 4, 128, s).unwrap()
        );
        let streamed = search::quantize_rows_searched(4, 128, s, |n, out| {
            out.copy_from_slice(&wide[n * 128..(n + 1) * 128])
        })
        .unwrap();
        assert_eq!(
            streamed,
            quantize_matrix_searched(&wide, 4, 128, s).unwrap()
        );
    }
}
