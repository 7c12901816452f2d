//! The worker crate's side of the router-core harness: simulated devices that compute for
//! real.
//!
//! The harness itself — the cluster, the pump, the virtual clock, devices that stall, fail or
//! lag — is `expertmesh_router::sim`, shared with the router's own tests (which cannot depend
//! on this crate). What only this crate can add is a device running the real dispatch executor
//! on a CPU backend ([`ExecWorker`]), so the core's answers can be checked bit for bit against
//! the in-process reference.

use expertmesh_backend::{BatchLimits, ExpertBackend, ExpertKey};
use expertmesh_cpu_backend::CpuBackend;
use expertmesh_quant::format::ExpertWeights;
use expertmesh_router::sim::{Sim, SimBuilder, SimWorker, WorkerAnswer};
use expertmesh_transport::codec::Dispatch;
use expertmesh_worker::exec::DispatchExecutor;

/// Batch limits of every simulated device (the tests' batches stay within them).
pub(crate) const LIMITS: BatchLimits = BatchLimits {
    max_tokens: 64,
    max_pairs: 64 * 8,
};

/// A device running the real dispatch executor on a one-thread CPU backend.
pub(crate) struct ExecWorker(DispatchExecutor);

impl ExecWorker {
    /// A device holding `experts`, for rows of `hidden` values.
    pub(crate) fn new(hidden: usize, experts: Vec<(ExpertKey, ExpertWeights)>) -> Self {
        Self::on(CpuBackend::new(1).unwrap(), hidden, experts)
    }

    /// [`ExecWorker::new`] on backend `be`.
    pub(crate) fn on(
        mut be: CpuBackend,
        hidden: usize,
        experts: Vec<(ExpertKey, ExpertWeights)>,
    ) -> Self {
        be.load(experts, LIMITS).unwrap();
        Self(DispatchExecutor::new(Box::new(be), hidden, LIMITS))
    }
}

impl SimWorker for ExecWorker {
    fn answer(&mut self, d: &Dispatch, payload: &[u8]) -> WorkerAnswer {
        self.0.execute(d, payload).map_err(|e| (e.code, e.message))
    }
}

/// The cluster of `builder` with an [`ExecWorker`] on every device.
pub(crate) fn with_executors(builder: SimBuilder) -> Sim {
    let hidden = builder.spec().hidden as usize;
    builder.build(|_, experts| Box::new(ExecWorker::new(hidden, experts)))
}

/// The bits of `v`, for bit-for-bit comparisons.
pub(crate) fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}
