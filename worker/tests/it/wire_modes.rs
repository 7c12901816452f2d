//! The serving modes' result wires against the router core and simulated workers (the real
//! dispatch executor and CPU backend, in process): exact-bf16 bit-identical to the reference
//! whose expert outputs are rounded to bf16 whatever the placement, every mode within its
//! stated tolerance of the independent f64 reference, the result bytes each mode sends, and the
//! batch window closing as soon as every connected frontend has a request pending.
//!
//! Tolerances (error measures of `reference`: worst element / RMS of the f64 output, and RMS
//! of the error / RMS of the f64 output), stated per mode:
//! * exact (W4A8): RMS < 2%, worst < 12% (the kernels' contract, measured ≈1.2% and ≤7%).
//! * exact-bf16 and serving: the same bounds vs f64, and vs the exact mode's output (the bf16
//!   rounding alone: each rounded value moves by at most 2^-9 of itself, and an expert output
//!   or a device's partial sum can be several times the output RMS): RMS < 0.5%, worst
//!   element < 3% of the output RMS.
//! * accurate (W4A16, f32 pre-combined): worst element < 1e-4 of the output RMS.

use crate::support::{bits, with_executors};
use expertmesh_quant::contract::ComputeMode;
use expertmesh_router::core::{LayerMode, RouterConfig, SharedSite};
use expertmesh_router::gating;
use expertmesh_router::reference::{self, ExpertRounding};
use expertmesh_router::sim::Sim;
use expertmesh_topology::model::{ModelSpec, preset_by_name};
use std::collections::HashMap;
use std::time::Duration;

const SEED: u64 = 91;

/// `assign[d]` = routed experts of device d (mesh rank d + 1), every layer; shared experts on
/// the router run with the exact scalar oracle (what the CPU backend computes bit for bit).
fn build(spec: &ModelSpec, assign: &[Vec<u32>], shared: SharedSite, cfg: RouterConfig) -> Sim {
    with_executors(
        Sim::builder(spec, assign)
            .shared(shared)
            .config(cfg)
            .seed(SEED),
    )
}

/// One layer call of `x` through the fabric from client 1 (window 0: dispatched at once).
fn call(sim: &mut Sim, id: u64, layer: u32, x: &[f32]) -> Vec<f32> {
    let (_, answer) = sim.call(id, layer, x.to_vec());
    answer.unwrap_or_else(|(_, message)| panic!("request failed: {message}"))
}

/// Submit `x` for `layer` as request `id` of frontend `client`, due in 5 s (not pumped).
fn submit(sim: &mut Sim, client: u64, id: u64, layer: u32, x: &[f32]) {
    sim.submit(client, id, layer, x.to_vec(), Duration::from_secs(5));
}

fn cfg(mode: LayerMode) -> RouterConfig {
    mode.apply(RouterConfig {
        batch_window: Duration::ZERO,
        micro_batch_tokens: 5,
        ..RouterConfig::default()
    })
}

/// Placements of toy-grouped's 16 experts: one device, two halves, four interleaved with
/// replicas, and a skewed split.
fn placements() -> Vec<Vec<Vec<u32>>> {
    vec![
        vec![(0..16).collect()],
        vec![(0..8).collect(), (8..16).collect()],
        vec![
            (0..16).step_by(4).collect(),
            (1..16).step_by(4).chain([0, 6]).collect(),
            (2..16).step_by(4).collect(),
            (3..16).step_by(4).chain([2]).collect(),
        ],
        vec![vec![3], (0..16).filter(|&e| e != 3).collect()],
    ]
}

/// The in-process reference of `layer` for `x` with expert outputs rounded per `rounding`.
fn reference_out(spec: &ModelSpec, x: &[f32], layer: u32, rounding: ExpertRounding) -> Vec<f32> {
    let mut be =
        expertmesh_worker::weights::reference_backend(spec, SEED, &[layer], 1, 64).unwrap();
    let gate = reference::synthetic_gate(spec, SEED, layer);
    let (_, out) = reference::moe_layer_backend_rounded(
        spec,
        &gate,
        layer,
        &mut be,
        x,
        ComputeMode::Exact,
        rounding,
    )
    .unwrap();
    out
}

#[test]
fn exact_bf16_is_bit_identical_to_the_rounded_reference_whatever_the_placement() {
    let spec = preset_by_name("toy-grouped").unwrap();
    let h = spec.hidden as usize;
    let tokens = 13;
    for layer in spec.moe_layer_ids() {
        let x = reference::synthetic_hidden(layer as u64 + 3, tokens, h);
        let want = reference_out(&spec, &x, layer, ExpertRounding::Bf16);
        let unrounded = reference_out(&spec, &x, layer, ExpertRounding::None);
        assert_ne!(
            bits(&want),
            bits(&unrounded),
            "the rounding must show in the bits"
        );
        for (p, assign) in placements().iter().enumerate() {
            for shared in [SharedSite::Router, SharedSite::Rank(1)] {
                let mut sim = build(&spec, assign, shared, cfg(LayerMode::ExactBf16));
                let got = call(&mut sim, 1, layer, &x);
                assert_eq!(
                    bits(&got),
                    bits(&want),
                    "layer {layer}, placement {p}, shared {shared:?}"
                );
            }
        }
    }
}

/// Worst element and RMS of `got − truth`, over the RMS of `truth`.
fn errors(got: &[f32], truth: &[f64]) -> (f64, f64) {
    (
        reference::rel_error_vs_rms(got, truth),
        reference::rms_error(got, truth),
    )
}

#[test]
fn every_mode_is_within_its_stated_tolerance_of_f64() {
    for name in ["toy-grouped", "demo-small"] {
        let spec = preset_by_name(name).unwrap();
        let h = spec.hidden as usize;
        let tokens = 9;
        let layer = spec.moe_layer_ids()[0];
        let lw = reference::synthetic_layer(&spec, SEED, layer).unwrap();
        let x = reference::synthetic_hidden(7, tokens, h);
        let routing = gating::route(&spec, &lw.gate.logits(&x), &lw.gate.bias).unwrap();
        let truth = reference::moe_layer_f64(&lw, &x, &routing);
        let truth32: Vec<f64> = reference_out(&spec, &x, layer, ExpertRounding::None)
            .iter()
            .map(|&v| v as f64)
            .collect();
        let e = spec.routed_experts;
        let assign = vec![(0..e).step_by(2).collect(), (1..e).step_by(2).collect()];
        for mode in LayerMode::ALL {
            for shared in [SharedSite::Router, SharedSite::Rank(2)] {
                let mut sim = build(&spec, &assign, shared, cfg(mode));
                let got = call(&mut sim, 1, layer, &x);
                let (worst, rms) = errors(&got, &truth);
                let what = format!(
                    "{name} {} shared {shared:?}: worst {worst:.2e}, rms {rms:.2e}",
                    mode.name()
                );
                match mode {
                    LayerMode::Accurate => assert!(worst < 1e-4, "{what}"),
                    _ => assert!(worst < 0.12 && rms < 0.02, "{what}"),
                }
                if matches!(mode, LayerMode::ExactBf16 | LayerMode::Serving) {
                    let (worst, rms) = errors(&got, &truth32);
                    let what = format!("{what}; vs exact: worst {worst:.2e}, rms {rms:.2e}");
                    assert!(worst < 0.03 && rms < 0.005, "{what}");
                    assert!(worst > 0.0, "{what}: bf16 rounding must show");
                    eprintln!("{what}");
                } else {
                    eprintln!("{what}");
                }
            }
        }
    }
}

#[test]
fn result_bytes_per_mode_follow_the_wire() {
    let spec = preset_by_name("demo-small").unwrap();
    let h = spec.hidden as usize;
    let tokens = 8;
    let x = reference::synthetic_hidden(5, tokens, h);
    let assign = vec![(0..32).collect::<Vec<u32>>()];
    let mut bytes = HashMap::new();
    for mode in LayerMode::ALL {
        let mut sim = build(&spec, &assign, SharedSite::Router, cfg(mode));
        call(&mut sim, 1, 0, &x);
        bytes.insert(mode.name(), sim.core.stats().result_payload_bytes);
    }
    // One device owns every expert: per-slot rows are top-4 per token, pre-combined rows one.
    let per_slot_f32 = (tokens * 4 * h * 4) as u64;
    assert_eq!(bytes["exact"], per_slot_f32);
    assert_eq!(bytes["exact-bf16"], per_slot_f32 / 2);
    assert_eq!(bytes["accurate"], per_slot_f32 / 4);
    assert_eq!(bytes["serving"], per_slot_f32 / 8);
}

#[test]
fn the_window_closes_when_every_connected_frontend_has_a_request_pending() {
    let spec = preset_by_name("toy-grouped").unwrap();
    let h = spec.hidden as usize;
    let x = reference::synthetic_hidden(1, 2, h);
    let window = Duration::from_millis(50);
    let mut config = cfg(LayerMode::Exact);
    config.batch_window = window;
    let mut sim = build(&spec, &[(0..16).collect()], SharedSite::Router, config);
    let (l0, l1) = (spec.moe_layer_ids()[0], spec.moe_layer_ids()[1]);
    // Unknown frontend count: the window decides.
    submit(&mut sim, 1, 1, l0, &x);
    sim.pump();
    assert!(sim.replies.is_empty(), "waits for the window");
    sim.now += window;
    sim.core.on_tick(sim.now);
    sim.pump();
    assert!(sim.answered(1));
    // Two frontends connected: the first request waits, the second closes the window.
    sim.core.set_frontends(2, sim.now);
    submit(&mut sim, 1, 2, l0, &x);
    submit(&mut sim, 1, 3, l0, &x); // the same frontend again: still waiting for the other
    sim.pump();
    assert!(!sim.answered(2));
    submit(&mut sim, 2, 4, l0, &x);
    sim.pump();
    for id in [2, 3, 4] {
        assert!(sim.answered(id), "request {id} answered without the window");
    }
    // A lone frontend never waits; a batch pending when a frontend leaves goes at once.
    sim.core.set_frontends(1, sim.now);
    submit(&mut sim, 1, 5, l1, &x);
    sim.pump();
    assert!(sim.answered(5));
    sim.core.set_frontends(2, sim.now);
    submit(&mut sim, 2, 6, l1, &x);
    sim.pump();
    assert!(!sim.answered(6));
    sim.core.set_frontends(1, sim.now);
    sim.pump();
    assert!(sim.answered(6));
}
