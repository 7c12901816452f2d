//! Shared experts run on the router host, and the router core built around them.
//!
//! Why this exists: models with shared experts (DeepSeek-V3, Kimi K2, Qwen2-MoE) apply them to
//! every token. When the placement keeps them on the router, the router core runs them through
//! [`SharedRunner`] while the workers compute the routed experts. This is the production
//! runner: a CPU backend holding the router's shared experts, fed through the same
//! [`Grouping`] as every other backend call.

use crate::deploy::Deployment;
use crate::weights;
use anyhow::anyhow;
use expertmesh_backend::{
    Activations, BackendError, BatchLimits, ExpertBackend, GroupedBatch, Grouping, OutputLayout,
};
use expertmesh_cpu_backend::CpuBackend;
use expertmesh_quant::contract::ComputeMode;
use expertmesh_router::core::{RouterConfig, RouterCore, SharedRunner};

/// Runs the router's shared experts on a CPU backend in the router process.
#[derive(Debug)]
pub struct CpuSharedRunner {
    backend: CpuBackend,
    routed_experts: u32,
    shared_experts: u32,
    hidden: usize,
    grouping: Grouping,
}

impl CpuSharedRunner {
    /// A runner over a backend that already holds the shared experts (keys
    /// `routed_experts + i`), for batches up to `max_tokens`.
    pub fn new(
        backend: CpuBackend,
        routed_experts: u32,
        shared_experts: u32,
        hidden: usize,
        max_tokens: usize,
    ) -> Self {
        Self {
            backend,
            routed_experts,
            shared_experts,
            hidden,
            grouping: Grouping::with_capacity(max_tokens * shared_experts as usize),
        }
    }
}

impl SharedRunner for CpuSharedRunner {
    fn run(
        &mut self,
        layer: u32,
        x: &[f32],
        tokens: usize,
        mode: ComputeMode,
        out: &mut [f32],
    ) -> Result<(), BackendError> {
        let s = self.shared_experts;
        self.grouping.clear();
        for t in 0..tokens as u32 {
            for i in 0..s {
                self.grouping
                    .push(self.routed_experts + i, t, 1.0, t * s + i);
            }
        }
        let (backend, hidden) = (&mut self.backend, self.hidden);
        self.grouping.with_groups(layer, |groups| {
            let batch = GroupedBatch {
                mode,
                hidden,
                tokens,
                input: Activations::F32(x),
                groups,
                layout: OutputLayout::PerSlot,
            };
            backend.execute(&batch, out)
        })
    }
}

/// Build the router core for a deployment, with the shared experts that live on the router
/// loaded here onto a CPU backend of `threads` threads.
pub fn router_core(
    dep: &Deployment,
    cfg: RouterConfig,
    threads: usize,
) -> anyhow::Result<RouterCore> {
    let runner: Option<Box<dyn SharedRunner>> = if dep.shared_on_router() {
        let experts = weights::load_router_shared_experts(dep)?;
        let mut backend = CpuBackend::new(threads).map_err(|e| anyhow!("{e}"))?;
        let s = dep.spec.shared_experts as usize;
        backend
            .load(
                experts,
                BatchLimits {
                    max_tokens: cfg.max_batch_tokens,
                    max_pairs: cfg.max_batch_tokens * s,
                },
            )
            .map_err(|e| anyhow!("{e}"))?;
        Some(Box::new(CpuSharedRunner::new(
            backend,
            dep.spec.routed_experts,
            s as u32,
            dep.spec.hidden as usize,
            cfg.max_batch_tokens,
        )))
    } else {
        None
    };
    Ok(RouterCore::new(
        dep.spec.clone(),
        cfg,
        dep.layer_setups()?,
        dep.replicas(),
        dep.rank_names(),
        runner,
    ))
}
