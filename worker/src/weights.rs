//! Weight loading: which experts a device pins, and the in-process reference backend.
//!
//! Why this exists: a worker (and the router, for shared experts it runs itself) must load
//! exactly the (layer, expert) weights the placement gives it, once, at start. Weights are
//! synthetic from the deployment's seed until checkpoint loading lands; this module is the one
//! to extend. The in-process reference backend (every expert of some layers on one CPU
//! backend) lives here too: it is the only other place that builds a concrete backend.

use crate::deploy::Deployment;
use anyhow::Context;
use expertmesh_backend::{BackendError, BatchLimits, ExpertBackend, ExpertKey};
use expertmesh_cpu_backend::CpuBackend;
use expertmesh_quant::format::{ExpertWeights, FormatError};
use expertmesh_topology::model::ModelSpec;
use expertmesh_topology::placement::SharedLocation;
use expertmesh_topology::topology::DeviceRank;

/// Why the reference backend could not be built.
#[derive(Debug, thiserror::Error)]
pub enum ReferenceError {
    /// Generating a synthetic expert failed.
    #[error("generating synthetic experts: {0}")]
    Weights(#[from] FormatError),
    /// The CPU backend refused the experts or the limits.
    #[error("loading the reference CPU backend: {0}")]
    Backend(#[from] BackendError),
}

/// The experts a device pins: its routed experts of every layer, plus the shared experts of the
/// layers whose shared experts it runs (keys `routed_experts + i`). Synthetic from the seed for
/// now; checkpoint loading replaces this one function.
pub fn load_device_experts(
    dep: &Deployment,
    d: DeviceRank,
) -> anyhow::Result<Vec<(ExpertKey, ExpertWeights)>> {
    let spec = &dep.spec;
    let mut out = Vec::new();
    for layer in spec.moe_layer_ids() {
        for &e in dep.placement.experts_on(d, layer) {
            let w = spec
                .synthetic(dep.seed)
                .routed(layer, e)
                .with_context(|| format!("generating layer {layer} expert {e}"))?;
            out.push((ExpertKey { layer, expert: e }, w));
        }
        if matches!(dep.placement.shared_location(layer), Some(SharedLocation::Device(x)) if x == d)
        {
            push_shared(dep, layer, &mut out)?;
        }
    }
    Ok(out)
}

/// The shared experts the router runs itself.
pub fn load_router_shared_experts(
    dep: &Deployment,
) -> anyhow::Result<Vec<(ExpertKey, ExpertWeights)>> {
    let mut out = Vec::new();
    for layer in dep.spec.moe_layer_ids() {
        if !matches!(
            dep.placement.shared_location(layer),
            Some(SharedLocation::Device(_))
        ) {
            push_shared(dep, layer, &mut out)?;
        }
    }
    Ok(out)
}

/// Append `layer`'s shared experts (keys `routed_experts + i`).
fn push_shared(
    dep: &Deployment,
    layer: u32,
    out: &mut Vec<(ExpertKey, ExpertWeights)>,
) -> anyhow::Result<()> {
    let spec = &dep.spec;
    for i in 0..spec.shared_experts {
        let w = spec
            .synthetic(dep.seed)
            .shared(layer, i)
            .with_context(|| format!("generating layer {layer} shared expert {i}"))?;
        out.push((
            ExpertKey {
                layer,
                expert: spec.routed_experts + i,
            },
            w,
        ));
    }
    Ok(())
}

/// Every expert of `layers`, keyed the way backends and workers key them: routed experts
/// `(layer, e)`, shared experts `(layer, routed_experts + i)`.
pub fn synthetic_keyed_experts(
    spec: &ModelSpec,
    seed: u64,
    layers: &[u32],
) -> Result<Vec<(ExpertKey, ExpertWeights)>, FormatError> {
    let synth = spec.synthetic(seed);
    let mut all = Vec::new();
    for &layer in layers {
        for e in 0..spec.routed_experts {
            all.push((ExpertKey { layer, expert: e }, synth.routed(layer, e)?));
        }
        for i in 0..spec.shared_experts {
            let key = ExpertKey {
                layer,
                expert: spec.routed_experts + i,
            };
            all.push((key, synth.shared(layer, i)?));
        }
    }
    Ok(all)
}

/// The fast in-process reference: one CPU backend (bit-identical to the scalar oracle in exact
/// mode) holding every expert of `layers`, for batches up to `max_tokens`; run layers on it
/// with `expertmesh_router::reference::moe_layer_backend`.
pub fn reference_backend(
    spec: &ModelSpec,
    seed: u64,
    layers: &[u32],
    threads: usize,
    max_tokens: usize,
) -> Result<CpuBackend, ReferenceError> {
    let experts = synthetic_keyed_experts(spec, seed, layers)?;
    let mut backend = CpuBackend::new(threads)?;
    let slots = (spec.top_k + spec.shared_experts) as usize;
    backend.load(
        experts,
        BatchLimits {
            max_tokens,
            max_pairs: max_tokens * slots,
        },
    )?;
    Ok(backend)
}
