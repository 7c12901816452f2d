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

/// A faulty source: it hands over `substitute` instead of what it declared (a buggy source), or
/// fails its check after the last expert (a damaged shard read to the end).
#[cfg_attr(not(feature = "hip"), allow(dead_code))] // the stand-in tests run with `hip`
struct Faulty {
    inner: expertmesh_backend::VecSource,
    substitute: Option<expertmesh_quant::format::ExpertWeights>,
}

impl expertmesh_backend::ExpertSource for Faulty {
    fn shapes(&self) -> &[expertmesh_backend::ExpertShape] {
        self.inner.shapes()
    }
    fn expert(
        &mut self,
        i: usize,
    ) -> Result<expertmesh_quant::format::ExpertWeights, expertmesh_backend::BackendError> {
        match &self.substitute {
            Some(w) => Ok(w.clone()),
            None => self.inner.expert(i),
        }
    }
    fn finish(&mut self) -> Result<(), expertmesh_backend::BackendError> {
        match self.substitute {
            Some(_) => Ok(()),
            None => Err(expertmesh_backend::BackendError::Source(
                "checksum mismatch (planted)".into(),
            )),
        }
    }
}

/// A live placement change on `hip` (issue 29): a device loaded with half of a case's experts
/// gains the rest while loaded, serves the whole case bit-identical to `CpuBackend`, refuses
/// bad gains and releases with nothing changed, releases two experts (their batches then fail),
/// gains them back into the freed slots and matches again. Ok(batches checked).
#[cfg_attr(not(feature = "hip"), allow(dead_code))] // the stand-in tests run with `hip`
pub(crate) fn check_live_changes(hip: &mut HipBackend) -> Result<usize, String> {
    use expertmesh_backend::{BackendError, VecSource};
    let p = CaseParams::random_codes(spec(32, ScaleDtype::Bf16, true), (256, 128), 8, 6, 2);
    let c = testvec::generate_case(&p, 7_100).map_err(|e| e.to_string())?;
    let key = |e: u32| ExpertKey {
        layer: 0,
        expert: e,
    };
    let all: Vec<(ExpertKey, _)> = (0..8)
        .map(|e| (key(e), c.experts[e as usize].clone()))
        .collect();
    let some = |keys: &[u32]| -> Vec<(ExpertKey, _)> {
        keys.iter().map(|&e| all[e as usize].clone()).collect()
    };
    let bytes =
        |keys: &[u32]| -> u64 { keys.iter().map(|&e| all[e as usize].1.bytes() as u64).sum() };
    let limits = BatchLimits {
        max_tokens: c.tokens,
        max_pairs: c.pairs(),
    };
    let mut cpu = CpuBackend::new(1).map_err(|e| e.to_string())?;
    cpu.load(all.clone(), limits).map_err(|e| e.to_string())?;
    hip.load(some(&[0, 1, 2, 3]), limits)
        .map_err(|e| format!("HIP load: {e}"))?;
    let cb = super::kernel_host::CaseBatch::new(&c);
    let groups = cb.groups(&c);
    let used: Vec<u32> = c
        .groups
        .iter()
        .filter(|g| g.count > 0)
        .map(|g| g.expert)
        .collect();
    let (Some(&gained), true) = (used.iter().find(|&&e| e >= 4), used.len() >= 2) else {
        return Err(format!(
            "the case routes to {used:?}: no gained expert in use"
        ));
    };
    let batch = GroupedBatch {
        mode: ComputeMode::Exact,
        hidden: c.hidden,
        tokens: c.tokens,
        input: Activations::F32(&c.x),
        groups: &groups,
        layout: OutputLayout::PerSlot,
    };
    let mut want = vec![0f32; batch.output_len()];
    cpu.execute(&batch, &mut want).map_err(|e| e.to_string())?;
    let mut checked = 0;
    let mut matches = |hip: &mut HipBackend, when: &str| -> Result<(), String> {
        let mut got = vec![f32::NAN; want.len()];
        hip.execute(&batch, &mut got)
            .map_err(|e| format!("{when}: HIP execute: {e}"))?;
        let differ = (0..want.len())
            .filter(|&i| got[i].to_bits() != want[i].to_bits())
            .count();
        checked += 1;
        match differ {
            0 => Ok(()),
            n => Err(format!(
                "{when}: {n} of {} outputs differ from CpuBackend",
                want.len()
            )),
        }
    };
    let unknown = |hip: &mut HipBackend, when: &str| -> Result<(), String> {
        let mut got = vec![0f32; want.len()];
        match hip.execute(&batch, &mut got) {
            Err(BackendError::UnknownExpert(_)) => Ok(()),
            other => Err(format!(
                "{when}: expected an unknown-expert error, got {other:?}"
            )),
        }
    };
    unknown(hip, &format!("before expert {gained} is gained"))?;
    hip.add_experts(&mut VecSource::new(some(&[4, 5, 6, 7])))
        .map_err(|e| format!("gaining experts 4..8: {e}"))?;
    if hip.loaded_bytes() != bytes(&[0, 1, 2, 3, 4, 5, 6, 7]) {
        return Err(format!(
            "after the gain loaded_bytes is {}",
            hip.loaded_bytes()
        ));
    }
    matches(hip, "after gaining experts 4..8 (the device table grew)")?;
    // Refused, nothing changed: a key loaded already, another shape, a source failing its
    // check, a release naming a key not loaded.
    let other = testvec::generate_case(
        &CaseParams::random_codes(spec(32, ScaleDtype::Bf16, true), (512, 128), 1, 1, 1),
        7_101,
    )
    .map_err(|e| e.to_string())?;
    let cpu_stager = cpu.stager().ok_or("the CPU backend has no stager")?;
    type Change<'a> = Box<dyn Fn(&mut HipBackend) -> Result<(), BackendError> + 'a>;
    let refusals: [(&str, Change<'_>); 7] = [
        (
            "a key loaded already",
            Box::new(|h| h.add_experts(&mut VecSource::new(some(&[2])))),
        ),
        (
            "another hidden size",
            Box::new(|h| {
                h.add_experts(&mut VecSource::new(vec![(
                    key(9),
                    other.experts[0].clone(),
                )]))
            }),
        ),
        (
            "a source failing its check",
            Box::new(|h| {
                h.add_experts(&mut Faulty {
                    inner: VecSource::new(vec![(key(8), all[1].1.clone())]),
                    substitute: None,
                })
            }),
        ),
        (
            "weights of another shape than the source declared",
            Box::new(|h| {
                h.add_experts(&mut Faulty {
                    inner: VecSource::new(vec![(key(10), all[0].1.clone())]),
                    substitute: Some(other.experts[0].clone()),
                })
            }),
        ),
        (
            "staged weights of another shape than the source declared",
            Box::new(|h| {
                let stager = h.stager().expect("the HIP backend has a stager");
                let staged = stager.stage(&mut Faulty {
                    inner: VecSource::new(vec![(key(10), all[0].1.clone())]),
                    substitute: Some(other.experts[0].clone()),
                })?;
                h.install(staged)
            }),
        ),
        (
            "experts another backend staged",
            Box::new(|h| {
                let staged =
                    cpu_stager.stage(&mut VecSource::new(vec![(key(11), all[0].1.clone())]))?;
                h.install(staged)
            }),
        ),
        (
            "a release of a key not loaded",
            Box::new(|h| h.release_experts(&[key(0), key(99)])),
        ),
    ];
    for (what, refused) in &refusals {
        if refused(hip).is_ok() {
            return Err(format!("{what} was accepted"));
        }
        if hip.loaded_bytes() != bytes(&[0, 1, 2, 3, 4, 5, 6, 7]) {
            return Err(format!(
                "{what}: refused, but loaded_bytes is {}",
                hip.loaded_bytes()
            ));
        }
        matches(hip, &format!("after refusing {what}"))?;
    }
    // Release two experts in use: their batches fail; gained back into the freed slots, the
    // case matches again.
    let (a, b) = (used[0], used[1]);
    hip.release_experts(&[key(a), key(b)])
        .map_err(|e| format!("releasing {a} and {b}: {e}"))?;
    let rest: Vec<u32> = (0..8).filter(|&e| e != a && e != b).collect();
    if hip.loaded_bytes() != bytes(&rest) {
        return Err(format!(
            "after the release loaded_bytes is {}",
            hip.loaded_bytes()
        ));
    }
    unknown(hip, "after releasing two experts in use")?;
    // Back into the freed slots, with the key refused above for its source's check (not
    // loaded, so it can be gained now; a copy of expert 1) into a new one: through the stager,
    // as a worker gains them (read on its loader thread, installed between batches).
    let mut back = some(&[a, b]);
    back.push((key(8), all[1].1.clone()));
    let stager = hip.stager().ok_or("the HIP backend has no stager")?;
    let staged = std::thread::spawn(move || stager.stage(&mut VecSource::new(back)))
        .join()
        .map_err(|_| "the staging thread panicked".to_owned())?
        .map_err(|e| format!("staging {a}, {b} and 8: {e}"))?;
    hip.install(staged)
        .map_err(|e| format!("installing {a}, {b} and 8: {e}"))?;
    if hip.loaded_bytes() != bytes(&[0, 1, 2, 3, 4, 5, 6, 7, 1]) {
        return Err(format!(
            "after gaining back loaded_bytes is {}",
            hip.loaded_bytes()
        ));
    }
    matches(hip, "after gaining the released experts back")?;
    Ok(checked)
}
