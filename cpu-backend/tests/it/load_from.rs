//! Streaming load: experts handed over one at a time are packed as they arrive, a failing or
//! lying source fails the load with its reason, and a streamed load computes what a plain load
//! does, bit for bit.

use expertmesh_backend::{
    Activations, BackendError, BatchLimits, ExpertBackend, ExpertKey, ExpertShape, ExpertSource,
    GroupedBatch, Grouping, OutputLayout, VecSource,
};
use expertmesh_cpu_backend::CpuBackend;
use expertmesh_quant::contract::ComputeMode;
use expertmesh_quant::format::{ExpertWeights, QuantSpec};
use expertmesh_quant::synth::synthetic_expert;

pub(crate) fn experts() -> Vec<(ExpertKey, ExpertWeights)> {
    (0..4u32)
        .map(|e| {
            let w = synthetic_expert(QuantSpec::G32_BF16, 64, 32 * (1 + e as usize % 2), 5, 1, e)
                .unwrap();
            (
                ExpertKey {
                    layer: 1,
                    expert: e,
                },
                w,
            )
        })
        .collect()
}

pub(crate) const LIMITS: BatchLimits = BatchLimits {
    max_tokens: 4,
    max_pairs: 8,
};

/// A source that fails (or hands over the wrong expert) at index `bad`, or fails its final
/// check (`bad` past the end).
struct Faulty {
    inner: VecSource,
    bad: usize,
    lie: bool,
}

impl ExpertSource for Faulty {
    fn shapes(&self) -> &[ExpertShape] {
        self.inner.shapes()
    }
    fn expert(&mut self, i: usize) -> Result<ExpertWeights, BackendError> {
        let w = self.inner.expert(i)?;
        if i != self.bad {
            return Ok(w);
        }
        if self.lie {
            return Ok(synthetic_expert(QuantSpec::G32_BF16, 64, 96, 5, 1, 9).unwrap());
        }
        Err(BackendError::Source("shard damaged at expert 2".into()))
    }
    fn finish(&mut self) -> Result<(), BackendError> {
        if self.bad >= self.inner.shapes().len() {
            return Err(BackendError::Source("checksum mismatch".into()));
        }
        Ok(())
    }
}

pub(crate) fn run(b: &mut CpuBackend) -> Vec<u32> {
    run_pairs(b, &[(0, 0), (0, 3), (1, 1), (1, 2)]).unwrap()
}

/// One exact per-slot batch of two tokens over (token, expert) pairs (weight 0.5, rows in
/// pair order): the output bits, or the backend's error.
fn run_pairs(b: &mut CpuBackend, pairs: &[(u32, u32)]) -> Result<Vec<u32>, BackendError> {
    let x: Vec<f32> = (0..2 * 64)
        .map(|i| ((i * 37 % 17) as f32 - 8.0) / 8.0)
        .collect();
    let mut g = Grouping::with_capacity(pairs.len());
    for (row, &(t, e)) in pairs.iter().enumerate() {
        g.push(e, t, 0.5, row as u32);
    }
    let mut out = vec![0f32; pairs.len() * 64];
    g.with_groups(1, |groups| {
        let batch = GroupedBatch {
            mode: ComputeMode::Exact,
            hidden: 64,
            tokens: 2,
            input: Activations::F32(&x),
            groups,
            layout: OutputLayout::PerSlot,
        };
        b.execute(&batch, &mut out)
    })?;
    Ok(out.iter().map(|v| v.to_bits()).collect())
}

#[test]
fn a_streamed_load_computes_what_a_plain_load_does() {
    let mut plain = CpuBackend::new(1).unwrap();
    plain.load(experts(), LIMITS).unwrap();
    let mut streamed = CpuBackend::new(1).unwrap();
    streamed
        .load_from(&mut VecSource::new(experts()), LIMITS)
        .unwrap();
    assert_eq!(plain.loaded_bytes(), streamed.loaded_bytes());
    assert_eq!(run(&mut plain), run(&mut streamed));
}

#[test]
fn a_failing_or_lying_source_fails_the_load_with_its_reason() {
    for lie in [false, true] {
        let mut b = CpuBackend::new(1).unwrap();
        let mut src = Faulty {
            inner: VecSource::new(experts()),
            bad: 2,
            lie,
        };
        let e = b.load_from(&mut src, LIMITS).unwrap_err().to_string();
        let want = if lie { "announced as" } else { "shard damaged" };
        assert!(e.contains(want), "{e}");
    }
    // A source whose final check fails leaves the backend unloaded.
    let mut b = CpuBackend::new(1).unwrap();
    let mut src = Faulty {
        inner: VecSource::new(experts()),
        bad: 99,
        lie: false,
    };
    let e = b.load_from(&mut src, LIMITS).unwrap_err().to_string();
    assert!(e.contains("checksum mismatch"), "{e}");
    assert_eq!(b.loaded_bytes(), 0);
}

#[test]
fn experts_gained_and_released_while_loaded_compute_what_a_fresh_load_does() {
    let all = experts();
    let mut whole = CpuBackend::new(1).unwrap();
    whole.load(all.clone(), LIMITS).unwrap();
    // Start with experts 0 and 3, gain 1 and 2 (a live placement change), in another order.
    let mut live = CpuBackend::new(1).unwrap();
    live.load(vec![all[3].clone(), all[0].clone()], LIMITS)
        .unwrap();
    live.add_experts(&mut VecSource::new(vec![all[2].clone(), all[1].clone()]))
        .unwrap();
    assert_eq!(live.loaded_bytes(), whole.loaded_bytes());
    assert_eq!(run(&mut live), run(&mut whole));
    // A key already loaded, or a hidden size unlike the loaded experts', is refused, and the
    // set is unchanged.
    let again = live
        .add_experts(&mut VecSource::new(vec![all[1].clone()]))
        .unwrap_err();
    assert!(again.to_string().contains("given twice"), "{again}");
    let key = ExpertKey {
        layer: 2,
        expert: 0,
    };
    let wide = synthetic_expert(QuantSpec::G32_BF16, 128, 32, 5, 2, 0).unwrap();
    let e = live
        .add_experts(&mut VecSource::new(vec![(key, wide)]))
        .unwrap_err();
    assert!(e.to_string().contains("hidden size 128"), "{e}");
    assert_eq!(run(&mut live), run(&mut whole));
    // Releasing one expert: the batch naming it fails naming it, the others' outputs are
    // unchanged, and its bytes are returned; an unknown key releases nothing.
    let before = live.loaded_bytes();
    let e = live
        .release_experts(&[
            all[1].0,
            ExpertKey {
                layer: 1,
                expert: 9,
            },
        ])
        .unwrap_err();
    assert!(
        matches!(e, BackendError::UnknownExpert(k) if k.expert == 9),
        "{e}"
    );
    assert_eq!(live.loaded_bytes(), before);
    live.release_experts(&[all[1].0]).unwrap();
    let one_bytes = QuantSpec::G32_BF16.expert_bytes(64, 64);
    assert_eq!(live.loaded_bytes(), before - one_bytes);
    let err = run_pairs(&mut live, &[(0, 1)]).unwrap_err();
    assert!(
        matches!(err, BackendError::UnknownExpert(k) if k.expert == 1),
        "{err}"
    );
    // Experts 0, 2, 3 against a backend loaded with exactly those.
    let mut rest = CpuBackend::new(1).unwrap();
    rest.load(vec![all[0].clone(), all[2].clone(), all[3].clone()], LIMITS)
        .unwrap();
    let without_1 = [(0, 0), (0, 2), (1, 3), (1, 2)];
    assert_eq!(
        run_pairs(&mut live, &without_1).unwrap(),
        run_pairs(&mut rest, &without_1).unwrap()
    );
}

#[test]
fn a_backend_loaded_with_nothing_gains_experts_of_any_hidden_size() {
    let all = experts();
    let mut whole = CpuBackend::new(1).unwrap();
    whole.load(all.clone(), LIMITS).unwrap();
    // A spare device: loaded with no experts, then given all of them live.
    let mut spare = CpuBackend::new(1).unwrap();
    spare.load(Vec::new(), LIMITS).unwrap();
    assert_eq!(spare.loaded_bytes(), 0);
    spare.add_experts(&mut VecSource::new(all)).unwrap();
    assert_eq!(spare.loaded_bytes(), whole.loaded_bytes());
    assert_eq!(run(&mut spare), run(&mut whole));
}

#[test]
fn experts_staged_on_another_thread_and_installed_compute_what_a_fresh_load_does() {
    use expertmesh_backend::StagedExperts;
    let all = experts();
    let mut whole = CpuBackend::new(1).unwrap();
    whole.load(all.clone(), LIMITS).unwrap();
    let mut live = CpuBackend::new(1).unwrap();
    live.load(vec![all[0].clone(), all[3].clone()], LIMITS)
        .unwrap();
    let stager = live.stager().expect("the CPU backend stages");
    let gains = vec![all[1].clone(), all[2].clone()];
    let staged = std::thread::spawn(move || stager.stage(&mut VecSource::new(gains)).unwrap())
        .join()
        .unwrap();
    assert_eq!(staged.keys, vec![all[1].0, all[2].0]);
    // Nothing changes until it is installed.
    assert_eq!(live.loaded_bytes() + staged.bytes, whole.loaded_bytes());
    live.install(staged).unwrap();
    assert_eq!(run(&mut live), run(&mut whole));
    // Staged again, the same keys are refused; so is another backend's staging.
    let stager = live.stager().unwrap();
    let again = stager
        .stage(&mut VecSource::new(vec![all[1].clone()]))
        .unwrap();
    let e = live.install(again).unwrap_err();
    assert!(e.to_string().contains("given twice"), "{e}");
    let foreign = StagedExperts {
        keys: vec![],
        bytes: 0,
        packed: Box::new(7u32),
    };
    let e = live.install(foreign).unwrap_err();
    assert!(e.to_string().contains("another backend"), "{e}");
    assert_eq!(run(&mut live), run(&mut whole));
}
