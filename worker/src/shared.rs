//! Shared experts run on the router host, and the router core built around them.
//!
//! Why this exists: models with shared experts (DeepSeek-V3, Kimi K2, Qwen2-MoE) apply them to
//! every token. When the placement keeps them on the router, the router core runs them through
//! [`SharedRunner`] while the workers compute the routed experts. Two production runners:
//! [`CpuSharedRunner`], a CPU backend holding packed-INT4 shared experts, fed through the same
//! [`Grouping`] as every other backend call; and [`DenseSharedRunner`], for converted weights
//! that keep the shared experts at the checkpoint's precision (an INT4 checkpoint with BF16
//! shared experts, served losslessly).

use crate::deploy::Deployment;
use crate::process::WorkerError;
use crate::weights::{self, WeightsError};
use expertmesh_backend::{
    Activations, BackendError, BatchLimits, ExpertBackend, GroupedBatch, Grouping, OutputLayout,
};
use expertmesh_cpu_backend::CpuBackend;
use expertmesh_quant::contract::ComputeMode;
use expertmesh_router::core::{RouterConfig, RouterCore, SharedRunner};
use expertmesh_router::ranks::RankNames;

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

/// One dense expert in f32 (widened exactly from the checkpoint's BF16/F16/F32): gate and up
/// `[F][H]`, down `[H][F]`.
#[derive(Clone, Debug)]
pub struct DenseExpert {
    inter: usize,
    gate: Vec<f32>,
    up: Vec<f32>,
    down: Vec<f32>,
}

impl DenseExpert {
    /// `down(silu(gate·x) ⊙ up·x)` in f32, in a fixed order (the same bits on every run and
    /// in the in-process reference); `h` is scratch of `inter` values.
    pub fn forward(&self, x: &[f32], h: &mut [f32], y: &mut [f32]) {
        let hidden = x.len();
        for f in 0..self.inter {
            let g = dot(&self.gate[f * hidden..(f + 1) * hidden], x);
            let u = dot(&self.up[f * hidden..(f + 1) * hidden], x);
            h[f] = g / (1.0 + (-g).exp()) * u;
        }
        for (n, yn) in y.iter_mut().enumerate() {
            *yn = dot(
                &self.down[n * self.inter..(n + 1) * self.inter],
                &h[..self.inter],
            );
        }
    }
}

/// f32 dot product in eight fixed lanes, then the lanes in order (vectorizes; deterministic).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut sum = acc.iter().sum::<f32>();
    for (x, y) in ra.iter().zip(rb) {
        sum += x * y;
    }
    sum
}

/// Runs shared experts kept dense at the checkpoint's precision. Both modes compute them the
/// same way (f32): they have no W4A8 form.
#[derive(Debug)]
pub struct DenseSharedRunner {
    routed_experts: u32,
    layers: std::collections::HashMap<u32, Vec<DenseExpert>>,
    scratch: Vec<f32>,
}

impl DenseSharedRunner {
    /// Every layer's dense shared experts from the router file of `dep`'s converted weights.
    pub fn load(dep: &Deployment) -> Result<Self, WeightsError> {
        let f = weights::open_shard(dep, None)?;
        let spec = &dep.spec;
        let (h, inter) = (spec.hidden as usize, spec.shared_intermediate as usize);
        let mut layers = std::collections::HashMap::new();
        for layer in spec.moe_layer_ids() {
            let mut experts = Vec::new();
            for i in 0..spec.shared_experts {
                let [g, u, d] = expertmesh_shard::shared_dense_names(layer, i).map(|n| {
                    f.tensor_f32(&n)
                        .map_err(WeightsError::Shard)
                        .and_then(|(shape, v)| {
                            if v.len() == h * inter {
                                Ok(v)
                            } else {
                                Err(WeightsError::DenseSharedShape {
                                    name: n,
                                    shape,
                                    inter,
                                    hidden: h,
                                })
                            }
                        })
                });
                experts.push(DenseExpert {
                    inter,
                    gate: g?,
                    up: u?,
                    down: d?,
                });
            }
            layers.insert(layer, experts);
        }
        Ok(Self {
            routed_experts: spec.routed_experts,
            layers,
            scratch: vec![0.0; inter],
        })
    }

    /// The dense shared experts of `layer` (for in-process references).
    pub fn experts(&self, layer: u32) -> Option<&[DenseExpert]> {
        self.layers.get(&layer).map(Vec::as_slice)
    }
}

impl SharedRunner for DenseSharedRunner {
    fn run(
        &mut self,
        layer: u32,
        x: &[f32],
        tokens: usize,
        _mode: ComputeMode,
        out: &mut [f32],
    ) -> Result<(), BackendError> {
        let experts = self.layers.get(&layer).ok_or(BackendError::UnknownExpert(
            expertmesh_backend::ExpertKey {
                layer,
                expert: self.routed_experts,
            },
        ))?;
        let hidden = x.len() / tokens.max(1);
        let s = experts.len();
        if out.len() < tokens * s * hidden {
            return Err(BackendError::Shape(format!(
                "shared output has {} values, need {}",
                out.len(),
                tokens * s * hidden
            )));
        }
        for t in 0..tokens {
            let xt = &x[t * hidden..(t + 1) * hidden];
            for (i, e) in experts.iter().enumerate() {
                let row = (t * s + i) * hidden;
                e.forward(xt, &mut self.scratch, &mut out[row..row + hidden]);
            }
        }
        Ok(())
    }
}

/// Build the router core for a deployment, with the shared experts that live on the router
/// loaded here, as router `instance` of the topology (packed INT4 onto a CPU backend of `threads` threads, or dense).
pub fn router_core(
    dep: &Deployment,
    cfg: RouterConfig,
    threads: usize,
    instance: u32,
) -> Result<RouterCore, WorkerError> {
    dep.check_router_instance(instance)?;
    let runner: Option<Box<dyn SharedRunner>> = if dep.shared_dense() {
        Some(Box::new(DenseSharedRunner::load(dep)?))
    } else if dep.shared_on_router() {
        let experts = weights::load_router_shared_experts(dep)?;
        let mut backend = CpuBackend::new(threads).map_err(WorkerError::Backend)?;
        let s = dep.spec.shared_experts as usize;
        backend
            .load(
                experts,
                BatchLimits {
                    max_tokens: cfg.max_batch_tokens,
                    max_pairs: cfg.max_batch_tokens * s,
                },
            )
            .map_err(WorkerError::Backend)?;
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
        dep.replicas(instance),
        RankNames::new(dep.rank_names(), dep.router_count()),
        runner,
        expertmesh_router::service::fresh_incarnation(),
    ))
}
