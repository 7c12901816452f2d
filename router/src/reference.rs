//! The in-process reference MoE layer: gate → top-k → experts → combine in slot order → + shared.
//!
//! Why this exists: it is the oracle the fabric is checked against (the demo checks every
//! response with it, the integration tests compare bit for bit in exact mode), and until the
//! fabric exists it is the whole main job. It follows `expertmesh_quant::contract` §5 for
//! the combine, so its bits do not depend on where experts live.

use crate::gating::{self, GateWeights, GatingError, Routing};
use expertmesh_backend::{
    Activations, BackendError, ExpertBackend, GroupedBatch, Grouping, OutputLayout,
};
use expertmesh_quant::contract::ComputeMode;
use expertmesh_quant::format::{ExpertWeights, FormatError};
use expertmesh_quant::reference::{
    QuantizedVec, expert_ffn_accurate, expert_ffn_exact_quantized, expert_ffn_f64,
};
use expertmesh_quant::synth::{self, SplitMix64};
use expertmesh_topology::model::ModelSpec;

/// Identifier mixed into the seed for gate weights (experts use their own index).
const GATE_STREAM: u64 = 0x6761_7465; // "gate"

/// Why the backend-run reference layer failed.
#[derive(Debug, thiserror::Error)]
pub enum ReferenceError {
    /// Gating refused the logits.
    #[error(transparent)]
    Gating(#[from] GatingError),
    /// The backend refused the batch.
    #[error("reference backend: {0}")]
    Backend(#[from] BackendError),
}

/// All weights of one MoE layer held in memory (only sensible for small models and tests; the
/// fabric never materializes a whole layer in one place).
#[derive(Clone, Debug)]
pub struct LayerWeights {
    /// Layer index.
    pub layer: u32,
    /// Router parameters.
    pub gate: GateWeights,
    /// Routed experts, by expert id.
    pub experts: Vec<ExpertWeights>,
    /// Shared experts, in order.
    pub shared: Vec<ExpertWeights>,
}

/// The deterministic synthetic gate of `(seed, layer)`: weights `N(0, 1/H)`, selection bias
/// uniform in [-0.05, 0.05) for `sigmoid-bias` models (zero otherwise).
pub fn synthetic_gate(spec: &ModelSpec, seed: u64, layer: u32) -> GateWeights {
    let (e, h) = (spec.routed_experts as usize, spec.hidden as usize);
    let mut rng = SplitMix64::new(synth::mix_seed(&[seed, layer as u64, GATE_STREAM]));
    let weight = synth::normal_vec(&mut rng, e * h, 1.0 / (h as f64).sqrt());
    let bias = match spec.scoring {
        expertmesh_topology::model::Scoring::SigmoidBias => {
            (0..e).map(|_| rng.uniform(-0.05, 0.05) as f32).collect()
        }
        _ => vec![0.0; e],
    };
    let shared_gate = spec
        .shared_expert_gate
        .then(|| synth::normal_vec(&mut rng, h, 1.0 / (h as f64).sqrt()));
    GateWeights {
        experts: e,
        hidden: h,
        weight,
        bias,
        shared_gate,
    }
}

/// Every weight of one MoE layer, generated synthetically.
pub fn synthetic_layer(
    spec: &ModelSpec,
    seed: u64,
    layer: u32,
) -> Result<LayerWeights, FormatError> {
    let synth = spec.synthetic(seed);
    let experts = (0..spec.routed_experts)
        .map(|e| synth.routed(layer, e))
        .collect::<Result<_, _>>()?;
    let shared = (0..spec.shared_experts)
        .map(|i| synth.shared(layer, i))
        .collect::<Result<_, _>>()?;
    Ok(LayerWeights {
        layer,
        gate: synthetic_gate(spec, seed, layer),
        experts,
        shared,
    })
}

/// Combine per-slot expert outputs and shared-expert outputs for one token, per contract §5:
/// `acc = +0; acc = acc + w[s] * y[s]` in slot order, then `acc + shared[0] + shared[1] ...`
/// (`acc + g * shared[i]` when the model gates its shared experts: `shared_gate = Some(g)`).
pub fn combine_token(
    weights: &[f32],
    slot_outputs: &[&[f32]],
    shared_outputs: &[&[f32]],
    shared_gate: Option<f32>,
    out: &mut [f32],
) {
    out.fill(0.0);
    for (w, y) in weights.iter().zip(slot_outputs) {
        for (o, v) in out.iter_mut().zip(y.iter()) {
            *o += w * v;
        }
    }
    for y in shared_outputs {
        match shared_gate {
            Some(g) => out.iter_mut().zip(y.iter()).for_each(|(o, v)| *o += g * v),
            None => out.iter_mut().zip(y.iter()).for_each(|(o, v)| *o += v),
        }
    }
}

/// Run one MoE layer in process for `x` (`[T][H]` f32). Returns the routing and `[T][H]`.
pub fn moe_layer(
    spec: &ModelSpec,
    lw: &LayerWeights,
    x: &[f32],
    mode: ComputeMode,
) -> Result<(Routing, Vec<f32>), GatingError> {
    let logits = lw.gate.logits(x);
    let routing = gating::route(spec, &logits, &lw.gate.bias)?;
    let out = moe_layer_routed(lw, x, &routing, mode);
    Ok((routing, out))
}

/// The expert half of [`moe_layer`] for a given routing.
pub fn moe_layer_routed(
    lw: &LayerWeights,
    x: &[f32],
    routing: &Routing,
    mode: ComputeMode,
) -> Vec<f32> {
    let h = lw.gate.hidden;
    let tokens = x.len() / h;
    let k = routing.top_k;
    let mut out = vec![0f32; tokens * h];
    let mut slot_y = vec![0f32; k * h];
    let mut shared_y = vec![0f32; lw.shared.len() * h];
    let shared_w = lw.gate.shared_weights(x);
    let gated = lw.gate.shared_gate.is_some();
    for t in 0..tokens {
        let xt = &x[t * h..(t + 1) * h];
        let run = |w: &ExpertWeights, qa: &QuantizedVec, y: &mut [f32]| match mode {
            ComputeMode::Exact => expert_ffn_exact_quantized(w, qa, y),
            ComputeMode::Accurate => expert_ffn_accurate(w, xt, y),
        };
        let qa = QuantizedVec::new(xt);
        for (s, &e) in routing.experts_of(t).iter().enumerate() {
            run(
                &lw.experts[e as usize],
                &qa,
                &mut slot_y[s * h..(s + 1) * h],
            );
        }
        for (i, w) in lw.shared.iter().enumerate() {
            run(w, &qa, &mut shared_y[i * h..(i + 1) * h]);
        }
        let slots: Vec<&[f32]> = slot_y.chunks(h).collect();
        let shared: Vec<&[f32]> = shared_y.chunks(h).collect();
        combine_token(
            routing.weights_of(t),
            &slots,
            &shared,
            gated.then(|| shared_w[t]),
            &mut out[t * h..(t + 1) * h],
        );
    }
    out
}

/// [`moe_layer`] with the experts run by a backend instead of the scalar oracle (the backends
/// are bit-identical to it in exact mode; this is the fast in-process reference the demo and
/// benches use). Experts are keyed `(layer, e)`, shared experts `(layer, E + i)`.
pub fn moe_layer_backend(
    spec: &ModelSpec,
    gate: &GateWeights,
    layer: u32,
    backend: &mut dyn ExpertBackend,
    x: &[f32],
    mode: ComputeMode,
) -> Result<(Routing, Vec<f32>), ReferenceError> {
    moe_layer_backend_rounded(spec, gate, layer, backend, x, mode, ExpertRounding::None)
}

/// What happens to each expert output (routed and shared) before the combine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertRounding {
    /// Kept in f32 (exact and accurate modes).
    None,
    /// Rounded to the nearest bf16, ties to even (the exact-bf16 serving mode's contract, as
    /// GPU MoE kernels emit bf16 expert outputs).
    Bf16,
}

/// [`moe_layer_backend`] with every expert output rounded per `rounding` before the slot-order
/// combine: the reference the exact-bf16 mode is bit-identical to.
pub fn moe_layer_backend_rounded(
    spec: &ModelSpec,
    gate: &GateWeights,
    layer: u32,
    backend: &mut dyn ExpertBackend,
    x: &[f32],
    mode: ComputeMode,
    rounding: ExpertRounding,
) -> Result<(Routing, Vec<f32>), ReferenceError> {
    let logits = gate.logits(x);
    moe_layer_backend_from_logits(spec, gate, layer, backend, x, &logits, mode, rounding)
}

/// [`moe_layer_backend_rounded`] from the gate's logits of `x` computed by the caller
/// (`[tokens][experts]`, as [`GateWeights::logits`] gives them): a caller that computes them
/// on several threads (`bench fabric`'s in-process limit) runs the rest of the same layer.
#[allow(clippy::too_many_arguments)]
pub fn moe_layer_backend_from_logits(
    spec: &ModelSpec,
    gate: &GateWeights,
    layer: u32,
    backend: &mut dyn ExpertBackend,
    x: &[f32],
    logits: &[f32],
    mode: ComputeMode,
    rounding: ExpertRounding,
) -> Result<(Routing, Vec<f32>), ReferenceError> {
    let h = gate.hidden;
    let tokens = x.len() / h;
    let expected = tokens * gate.experts;
    if x.len() % h != 0 || logits.len() != expected {
        let (what, expected, got) = match x.len() % h {
            0 => ("router logits", expected, logits.len()),
            _ => ("hidden states", (tokens + 1) * h, x.len()),
        };
        return Err(GatingError::Shape {
            what,
            expected,
            got,
        }
        .into());
    }
    let routing = gating::route(spec, logits, &gate.bias)?;
    let k = routing.top_k;
    let s = spec.shared_experts as usize;
    let slots = k + s;
    // Output row of (token t, slot) = t * slots + slot; shared experts take the last slots.
    let mut grouping = Grouping::with_capacity(tokens * slots);
    for t in 0..tokens {
        let routed = routing.experts_of(t).iter().zip(routing.weights_of(t));
        for (slot, (&e, &w)) in routed.enumerate() {
            grouping.push(e, t as u32, w, (t * slots + slot) as u32);
        }
        for i in 0..s {
            let e = spec.routed_experts + i as u32;
            grouping.push(e, t as u32, 1.0, (t * slots + k + i) as u32);
        }
    }
    let mut rows = vec![0f32; tokens * slots * h];
    grouping.with_groups(layer, |groups| {
        let batch = GroupedBatch {
            mode,
            hidden: h,
            tokens,
            input: Activations::F32(x),
            groups,
            layout: OutputLayout::PerSlot,
        };
        backend.execute(&batch, &mut rows)
    })?;
    if rounding == ExpertRounding::Bf16 {
        expertmesh_transport::dtype::round_to_bf16(&mut rows);
    }
    let mut out = vec![0f32; tokens * h];
    let shared_w = gate.shared_weights(x);
    let gated = gate.shared_gate.is_some();
    for t in 0..tokens {
        let slot_rows: Vec<&[f32]> = (0..k)
            .map(|sl| &rows[(t * slots + sl) * h..(t * slots + sl + 1) * h])
            .collect();
        let shared_rows: Vec<&[f32]> = (k..slots)
            .map(|sl| &rows[(t * slots + sl) * h..(t * slots + sl + 1) * h])
            .collect();
        combine_token(
            routing.weights_of(t),
            &slot_rows,
            &shared_rows,
            gated.then(|| shared_w[t]),
            &mut out[t * h..(t + 1) * h],
        );
    }
    Ok((routing, out))
}

/// The f64 version of [`moe_layer_routed`]: same routing, experts in f64 with exactly
/// dequantized weights, f64 combine. The truth that tolerances are measured against.
pub fn moe_layer_f64(lw: &LayerWeights, x: &[f32], routing: &Routing) -> Vec<f64> {
    let h = lw.gate.hidden;
    let tokens = x.len() / h;
    let mut out = vec![0f64; tokens * h];
    let mut y = vec![0f64; h];
    for t in 0..tokens {
        let xt: Vec<f64> = x[t * h..(t + 1) * h].iter().map(|&v| v as f64).collect();
        let o = &mut out[t * h..(t + 1) * h];
        for (&e, &w) in routing.experts_of(t).iter().zip(routing.weights_of(t)) {
            expert_ffn_f64(&lw.experts[e as usize], &xt, &mut y);
            for (a, b) in o.iter_mut().zip(&y) {
                *a += w as f64 * b;
            }
        }
        // Qwen2-MoE: sigmoid(shared_gate · x) in f64; weight 1 otherwise.
        let g = lw.gate.shared_gate.as_ref().map_or(1.0, |g| {
            let z: f64 = g.iter().zip(&xt).map(|(&a, &b)| f64::from(a) * b).sum();
            1.0 / (1.0 + (-z).exp())
        });
        for w in &lw.shared {
            expert_ffn_f64(w, &xt, &mut y);
            for (a, b) in o.iter_mut().zip(&y) {
                *a += g * b;
            }
        }
    }
    out
}

/// Deterministic synthetic hidden states `[T][H]`, `N(0, 1)`.
pub fn synthetic_hidden(seed: u64, tokens: usize, hidden: usize) -> Vec<f32> {
    let mut rng = SplitMix64::new(synth::mix_seed(&[seed, 0x6869_6464])); // "hidd"
    synth::normal_vec(&mut rng, tokens * hidden, 1.0)
}

/// Largest absolute difference divided by the RMS of the reference: the error measure that
/// tolerances in this project are stated in.
pub fn rel_error_vs_rms(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let rms = (want.iter().map(|v| v * v).sum::<f64>() / want.len().max(1) as f64).sqrt();
    let max = got
        .iter()
        .zip(want)
        .map(|(&a, &b)| (a as f64 - b).abs())
        .fold(0.0, f64::max);
    if rms == 0.0 { max } else { max / rms }
}

/// RMS of the difference divided by the RMS of the reference.
pub fn rms_error(got: &[f32], want: &[f64]) -> f64 {
    let rms = (want.iter().map(|v| v * v).sum::<f64>() / want.len().max(1) as f64).sqrt();
    let err = (got
        .iter()
        .zip(want)
        .map(|(&a, &b)| (a as f64 - b).powi(2))
        .sum::<f64>()
        / want.len().max(1) as f64)
        .sqrt();
    if rms == 0.0 { err } else { err / rms }
}

#[cfg(test)]
mod tests {
    use super::*;
    use expertmesh_topology::model::preset_by_name;

    #[test]
    fn reference_layer_agrees_with_f64() {
        for name in ["toy-softmax", "toy-grouped", "toy-mixtral", "demo-small"] {
            let spec = preset_by_name(name).unwrap();
            for layer in spec.moe_layer_ids() {
                let lw = synthetic_layer(&spec, 11, layer).unwrap();
                let x = synthetic_hidden(layer as u64, 7, spec.hidden as usize);
                let (routing, exact) = moe_layer(&spec, &lw, &x, ComputeMode::Exact).unwrap();
                let (_, accurate) = moe_layer(&spec, &lw, &x, ComputeMode::Accurate).unwrap();
                let truth = moe_layer_f64(&lw, &x, &routing);
                let e_exact = rel_error_vs_rms(&exact, &truth);
                let e_acc = rel_error_vs_rms(&accurate, &truth);
                // Stated tolerances. Exact mode (W4A8) quantizes the input and the intermediate
                // to 8 bits per 32-block: RMS error under 2% of the output RMS, worst element
                // under 12% of it (measured ≈1.2% and ≤7%). Accurate mode only has f32 rounding:
                // worst element under 1e-4 of the output RMS.
                let r_exact = rms_error(&exact, &truth);
                assert!(
                    r_exact < 0.02,
                    "{name} layer {layer}: exact RMS error {r_exact}"
                );
                assert!(
                    e_exact < 0.12,
                    "{name} layer {layer}: exact max error {e_exact}"
                );
                assert!(e_acc < 1e-4, "{name} layer {layer}: accurate error {e_acc}");
            }
        }
    }

    #[test]
    fn combine_is_slot_ordered() {
        let a = [1e8f32];
        let b = [1.0f32];
        let c = [-1e8f32];
        let mut out = [0f32];
        combine_token(&[1.0, 1.0, 1.0], &[&a, &b, &c], &[], None, &mut out);
        assert_eq!(out[0], 0.0); // (1e8 + 1) rounds to 1e8, then - 1e8
        combine_token(&[1.0, 1.0, 1.0], &[&a, &c, &b], &[], None, &mut out);
        assert_eq!(out[0], 1.0);
    }
}
