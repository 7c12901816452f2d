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

fn experts() -> Vec<(ExpertKey, ExpertWeights)> {
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

const LIMITS: BatchLimits = BatchLimits {
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

fn run(b: &mut CpuBackend) -> Vec<u32> {
    let x: Vec<f32> = (0..2 * 64)
        .map(|i| ((i * 37 % 17) as f32 - 8.0) / 8.0)
        .collect();
    let mut g = Grouping::with_capacity(8);
    for t in 0..2u32 {
        for (s, e) in [(0, t), (1, 3 - t)] {
            g.push(e, t, 0.5, t * 2 + s);
        }
    }
    let mut out = vec![0f32; 4 * 64];
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
    })
    .unwrap();
    out.iter().map(|v| v.to_bits()).collect()
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
