//! The backend conformance check shared by the HIP-CPU stand-in tests (`standin.rs`) and the
//! real-GPU test (`kernel_host::hip_backend_on_this_machine`): a backend under test against
//! `CpuBackend`, exact bit for bit and accurate within tolerance, over a set of cases covering the
//! shapes and formats the kernels must handle.

use expertmesh_backend::{
    Activations, BatchLimits, ExpertBackend, ExpertGroup, ExpertKey, GroupedBatch, OutputLayout,
};
use expertmesh_cpu_backend::CpuBackend;
use expertmesh_hip_kernels::hip::HipBackend;
use expertmesh_hip_kernels::testvec::{self, CaseParams, VectorCase};
use expertmesh_quant::contract::ComputeMode;
use expertmesh_quant::format::{QuantSpec, ScaleDtype};
use std::sync::OnceLock;

fn spec(group_size: u32, scale_dtype: ScaleDtype, zero_points: bool) -> QuantSpec {
    QuantSpec {
        group_size,
        scale_dtype,
        zero_points,
    }
}

/// The conformance set: the standard vectors (g32 / g64 / g128, f16 / bf16, zero points, edge
/// blocks, empty experts, a prefill group past one tile), decode batches of 1 to 16 tokens, and
/// prefill batches (groups of 8 to 40 tokens, several 16-token items per group).
pub(crate) fn conformance_cases() -> &'static [VectorCase] {
    static CASES: OnceLock<Vec<VectorCase>> = OnceLock::new();
    CASES.get_or_init(|| {
        let mut cases = testvec::standard_cases(super::kernel_host::SEED).expect("standard cases");
        let sweep = [
            (1, spec(32, ScaleDtype::Bf16, false)),
            (2, spec(64, ScaleDtype::F16, true)),
            (3, spec(128, ScaleDtype::Bf16, true)),
            (5, spec(32, ScaleDtype::F16, false)),
            (8, spec(64, ScaleDtype::Bf16, false)),
            (12, spec(32, ScaleDtype::Bf16, true)),
            (16, spec(128, ScaleDtype::F16, false)),
        ];
        for (i, (tokens, s)) in sweep.into_iter().enumerate() {
            // 8 experts, top-2: at most 16·2/8·... tokens per expert stay under the prefill
            // threshold for the small batches and cross it for the larger ones.
            let p = CaseParams::random_codes(s, (256, 128), 8, tokens, 2);
            cases.push(testvec::generate_case(&p, 7_000 + i as u64).expect("sweep case"));
        }
        for (i, (tokens, experts, s)) in [
            (40, 2, spec(32, ScaleDtype::Bf16, false)),
            (24, 1, spec(64, ScaleDtype::F16, true)),
        ]
        .into_iter()
        .enumerate()
        {
            let p = CaseParams::random_codes(s, (512, 192), experts, tokens, 1);
            cases.push(testvec::generate_case(&p, 8_000 + i as u64).expect("prefill case"));
        }
        cases
    })
}

/// One Kimi-K2-sized expert (H 7168, F 2048, g32 bf16): one token (decode) and 8 tokens
/// (prefill).
pub(crate) fn kimi_cases() -> &'static [VectorCase] {
    static CASES: OnceLock<Vec<VectorCase>> = OnceLock::new();
    CASES.get_or_init(|| {
        [1, 8]
            .into_iter()
            .map(|tokens| {
                let p = CaseParams::random_codes(
                    spec(32, ScaleDtype::Bf16, false),
                    (7168, 2048),
                    1,
                    tokens,
                    1,
                );
                testvec::generate_case(&p, 9_000 + tokens as u64).expect("Kimi case")
            })
            .collect()
    })
}

/// Run every case through `hip` and the CPU backend: exact bit for bit (f32 and pre-quantized
/// input, both layouts, fused and two-phase decode), accurate within `ACCURATE_REL_TOL` of f64.
/// `full = false` (the Kimi-sized expert, to stay fast): fused decode, exact per-slot and accurate
/// only. Ok(batches checked) or Err(the first difference).
pub(crate) fn check_against_cpu(
    hip: &mut HipBackend,
    cases: &[VectorCase],
    full: bool,
) -> Result<usize, String> {
    let mut cpu = CpuBackend::new(1).map_err(|e| e.to_string())?;
    let mut batches = 0;
    for (ci, c) in cases.iter().enumerate() {
        let experts: Vec<(ExpertKey, _)> = c
            .experts
            .iter()
            .enumerate()
            .map(|(i, w)| {
                (
                    ExpertKey {
                        layer: 0,
                        expert: i as u32,
                    },
                    w.clone(),
                )
            })
            .collect();
        let limits = BatchLimits {
            max_tokens: c.tokens,
            max_pairs: c.pairs(),
        };
        let what = format!(
            "case {ci} (H {}, F {}, {}, {} experts, {} tokens, {} pairs)",
            c.hidden,
            c.inter,
            c.spec,
            c.experts.len(),
            c.tokens,
            c.pairs()
        );
        hip.load(experts.clone(), limits)
            .map_err(|e| format!("{what}: HIP load: {e}"))?;
        cpu.load(experts, limits)
            .map_err(|e| format!("{what}: CPU load: {e}"))?;
        let cb = super::kernel_host::CaseBatch::new(c);
        let groups: Vec<ExpertGroup<'_>> = cb.groups(c);
        let all = [
            (ComputeMode::Exact, OutputLayout::PerSlot, false),
            (ComputeMode::Exact, OutputLayout::PreCombined, false),
            (ComputeMode::Exact, OutputLayout::PerSlot, true),
            (ComputeMode::Accurate, OutputLayout::PerSlot, false),
        ];
        let (fused_modes, combos): (&[bool], &[_]) = if full {
            (&[true, false], &all)
        } else {
            (&[true], &[all[0], all[3]])
        };
        for &fused in fused_modes {
            hip.set_fused_decode(fused);
            for &(mode, layout, q8) in combos {
                let batch = GroupedBatch {
                    mode,
                    hidden: c.hidden,
                    tokens: c.tokens,
                    input: if q8 {
                        Activations::Q8 { q: &c.xq, d: &c.xd }
                    } else {
                        Activations::F32(&c.x)
                    },
                    groups: &groups,
                    layout,
                };
                let what = format!(
                    "{what}, {mode:?} {layout:?}{}, fused {fused}",
                    if q8 { " q8" } else { "" }
                );
                let mut got = vec![f32::NAN; batch.output_len()];
                hip.execute(&batch, &mut got)
                    .map_err(|e| format!("{what}: HIP execute: {e}"))?;
                batches += 1;
                if mode == ComputeMode::Accurate {
                    let err = testvec::accurate_error(&got, &c.y_f64, c.hidden);
                    if err.is_nan() || err > testvec::ACCURATE_REL_TOL {
                        return Err(format!(
                            "{what}: accurate error {err:.3e} past the tolerance {:.1e}",
                            testvec::ACCURATE_REL_TOL
                        ));
                    }
                    continue;
                }
                let mut want = vec![0f32; batch.output_len()];
                cpu.execute(&batch, &mut want)
                    .map_err(|e| format!("{what}: CPU execute: {e}"))?;
                if let Some(i) = (0..want.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
                    let differ = (0..want.len())
                        .filter(|&i| got[i].to_bits() != want[i].to_bits())
                        .count();
                    return Err(format!(
                        "{what}: {differ} of {} outputs differ from CpuBackend; first at {i} (row {}, col {}): \
                         {} ({:#010x}) against {} ({:#010x})",
                        want.len(),
                        i / c.hidden,
                        i % c.hidden,
                        got[i],
                        got[i].to_bits(),
                        want[i],
                        want[i].to_bits()
                    ));
                }
            }
        }
    }
    Ok(batches)
}
