//! Packed-format properties: quantization round-trip error bounds, exact (Level 0)
//! dequantization, byte accounting.

use expertmesh_quant::format::{
    ExpertWeights, FormatError, GateUp, PackedMatrix, QuantSpec, ScaleDtype, w13_row,
};
use expertmesh_quant::synth::{self, SplitMix64};
use proptest::prelude::*;

fn spec_strategy() -> impl Strategy<Value = QuantSpec> {
    (
        prop::sample::select(vec![32u32, 64, 128]),
        prop::sample::select(vec![ScaleDtype::F16, ScaleDtype::Bf16]),
        any::<bool>(),
    )
        .prop_map(|(group_size, scale_dtype, zero_points)| QuantSpec {
            group_size,
            scale_dtype,
            zero_points,
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Round-to-nearest: every element is within half a quantization step of its original
    /// (one full step for the single value a symmetric group cannot reach, +8·d, and the
    /// extremes of an asymmetric group whose zero point had to be clamped).
    #[test]
    fn quantization_error_is_bounded(spec in spec_strategy(), rows in 1usize..6, gpr in 1usize..5, scale in 1e-3f64..1e2, seed in any::<u64>()) {
        let cols = gpr * spec.group_size as usize;
        let mut rng = SplitMix64::new(seed);
        let dense = synth::normal_vec(&mut rng, rows * cols, scale);
        let m = PackedMatrix::quantize("t", spec, rows, cols, &dense).unwrap();
        let deq = m.dequantize();
        let gs = spec.group_size as usize;
        for n in 0..rows {
            for k in 0..cols {
                let g = k / gs;
                let d = m.scale(n, g).abs() as f64;
                let w = dense[n * cols + k] as f64;
                let err = (deq[n * cols + k] as f64 - w).abs();
                let group = &dense[n * cols + g * gs..n * cols + (g + 1) * gs];
                let amax = group.iter().fold(0f32, |a, v| a.max(v.abs())) as f64;
                // half a step (+ the f32 rounding of w/d), or one step at a clamped extreme
                let half = 0.5 * d * (1.0 + 1e-5) + 1e-30;
                let code = m.code(n, k);
                let clamped = code == 0 || code == 15;
                prop_assert!(err <= half || (clamped && err <= d * 1.01 + amax * 0.01),
                    "row {} col {}: w {} deq {} step {}", n, k, w, deq[n * cols + k], d);
            }
        }
    }

    /// Asymmetric round-to-nearest on groups of one sign (weights far from 0, all positive or
    /// all negative): every element is within one quantization step of its original, as
    /// anywhere else (the range holds 0, so the zero point is never clamped off the weights;
    /// a range of [min, max] alone put every code at 15 and lost ~90 % of a group in [10, 11]).
    #[test]
    fn asymmetric_groups_of_one_sign_stay_within_a_step(rows in 1usize..4, gpr in 1usize..4, offset in prop::sample::select(vec![-10.0f32, 10.0, 1e3]), seed in any::<u64>()) {
        let spec = QuantSpec { group_size: 32, scale_dtype: ScaleDtype::Bf16, zero_points: true };
        let cols = gpr * 32;
        let mut rng = SplitMix64::new(seed);
        let dense: Vec<f32> = synth::normal_vec(&mut rng, rows * cols, 0.3)
            .into_iter()
            .map(|v| v + offset)
            .collect();
        let m = PackedMatrix::quantize("t", spec, rows, cols, &dense).unwrap();
        let deq = m.dequantize();
        for n in 0..rows {
            for k in 0..cols {
                let d = m.scale(n, k / 32).abs() as f64;
                let (w, got) = (dense[n * cols + k] as f64, deq[n * cols + k] as f64);
                prop_assert!((got - w).abs() <= d * 1.01, "row {} col {}: w {} deq {} step {}", n, k, w, got, d);
            }
        }
    }

    /// Level 0 of the contract: u4 × 16-bit scale is exact in f32, so the f32 dequantized value
    /// equals the f64 product.
    #[test]
    fn dequantization_is_exact(spec in spec_strategy(), rows in 1usize..5, gpr in 1usize..4, seed in any::<u64>()) {
        let cols = gpr * spec.group_size as usize;
        let mut rng = SplitMix64::new(seed);
        let m = synth::random_packed("t", spec, rows, cols, &mut rng).unwrap();
        let deq = m.dequantize();
        for n in 0..rows {
            for k in 0..cols {
                let g = k / spec.group_size as usize;
                let exact = spec.scale_dtype.to_f32(m.row_scales(n)[g]) as f64 * (m.code(n, k) as f64 - m.zero(n, g) as f64);
                prop_assert_eq!(deq[n * cols + k] as f64, exact);
                prop_assert_eq!(m.value(n, k).to_bits(), deq[n * cols + k].to_bits());
            }
        }
        prop_assert_eq!(m.bytes() as u64, spec.matrix_bytes(rows as u64, cols as u64));
    }
}

#[test]
fn expert_quantize_places_gate_and_up_rows() {
    let (h, f) = (64usize, 32usize);
    let gate: Vec<f32> = (0..f * h).map(|i| (i / h) as f32 + 1.0).collect();
    let up: Vec<f32> = (0..f * h).map(|i| -((i / h) as f32) - 1.0).collect();
    let down = vec![0.5f32; h * f];
    let e = ExpertWeights::quantize(QuantSpec::G32_BF16, h, f, &gate, &up, &down).unwrap();
    let mut row = vec![0f32; h];
    for i in 0..f {
        e.w13().dequantize_row(w13_row(GateUp::Gate, i), &mut row);
        assert!(
            row.iter().all(|&v| v == i as f32 + 1.0),
            "gate row {i}: {:?}",
            &row[..4]
        );
        e.w13().dequantize_row(w13_row(GateUp::Up, i), &mut row);
        assert!(row.iter().all(|&v| v == -(i as f32) - 1.0), "up row {i}");
    }
    assert_eq!(
        e.bytes() as u64,
        QuantSpec::G32_BF16.expert_bytes(h as u64, f as u64)
    );
    // an intermediate size that is not a multiple of 32 is refused
    let odd = vec![0f32; 48 * h];
    let e = ExpertWeights::quantize(QuantSpec::G32_BF16, h, 48, &odd, &odd, &odd);
    assert!(e.unwrap_err().to_string().contains("48"));
}

#[test]
fn f16_scale_overflow_is_reported() {
    let dense = vec![1e6f32; 32];
    let spec = QuantSpec {
        group_size: 32,
        scale_dtype: ScaleDtype::F16,
        zero_points: false,
    };
    let e = PackedMatrix::quantize("W2", spec, 1, 32, &dense).unwrap_err();
    assert!(e.to_string().contains("bf16"), "{e}");
    // bf16 has the range
    let spec = QuantSpec {
        scale_dtype: ScaleDtype::Bf16,
        ..spec
    };
    assert!(PackedMatrix::quantize("W2", spec, 1, 32, &dense).is_ok());
}

/// An expert's two matrices must share one spec: mixing is refused, naming both.
#[test]
fn an_expert_of_two_specs_is_refused() {
    let (h, f) = (64, 32);
    let sym = QuantSpec::default();
    let asym = QuantSpec {
        zero_points: true,
        ..sym
    };
    let w13 = PackedMatrix::zeroed("W13", sym, 2 * f, h).unwrap();
    let w2 = PackedMatrix::zeroed("W2", asym, h, f).unwrap();
    let e = ExpertWeights::new(w13, w2).unwrap_err();
    assert!(matches!(e, FormatError::MixedSpecs { .. }), "{e}");
    let w13 = PackedMatrix::zeroed("W13", asym, 2 * f, h).unwrap();
    let w2 = PackedMatrix::zeroed("W2", asym, h, f).unwrap();
    assert_eq!(ExpertWeights::new(w13, w2).unwrap().spec(), asym);
}
