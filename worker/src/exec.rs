//! The worker's half of the dispatch protocol: one `Dispatch` frame in, one result frame out.
//!
//! Why this exists: a worker receives a token batch with, per token, the list of its local
//! experts; it must group the rows by expert, run its backend once per batch, and return either
//! one row per (token, expert) pair or one pre-combined row per token (this device's slots
//! summed in slot order in f32), in f32 or rounded to bf16 as the dispatch asks
//! (`Dispatch::result_dtype`). The worker process
//! (`expertmesh worker`) is a thin loop around [`DispatchExecutor`], and the simulated cluster
//! tests (`worker/tests/it/core_sim.rs`) drive it against the router core in process.
//!
//! Copies and allocations: a q8 payload is read in place (zero-copy view), other dtypes are
//! decoded once into a preallocated buffer; grouping reuses its buffers; the result rows are
//! encoded once into a result buffer that is reclaimed when the previous result frame has been
//! sent. After the first dispatch at the largest size, `execute` allocates nothing.

use bytes::{Bytes, BytesMut};
use expertmesh_backend::{
    Activations, BackendError, BatchLimits, ExpertBackend, GroupedBatch, Grouping, OutputLayout,
};
use expertmesh_quant::contract::ComputeMode;
use expertmesh_transport::codec::{Dispatch, ErrorCode, ExpertResult};
use expertmesh_transport::dtype::{self, ActivationDtype, OutputDtype};

/// Runs dispatches on a backend with buffers sized once.
pub struct DispatchExecutor {
    backend: Box<dyn ExpertBackend>,
    hidden: usize,
    limits: BatchLimits,
    /// Decoded f32 input `[max_tokens][hidden]` (dtypes the kernels cannot read in place).
    x: Vec<f32>,
    /// Backend output `[max(max_pairs, max_tokens)][hidden]`.
    out: Vec<f32>,
    grouping: Grouping,
    /// Result payload bytes; each result is split off and frozen, and the allocation is
    /// reclaimed by the next `reserve` once that frame has been sent and dropped.
    result: BytesMut,
}

impl std::fmt::Debug for DispatchExecutor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DispatchExecutor")
            .field("backend", &self.backend.name())
            .field("hidden", &self.hidden)
            .field("limits", &self.limits)
            .finish()
    }
}

/// Why a dispatch was not executed: the code and message of the error frame to answer with.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{code:?}: {message}")]
pub struct ExecError {
    /// Stable error code for the router.
    pub code: ErrorCode,
    /// What went wrong and what to do.
    pub message: String,
}

impl ExecError {
    fn new(code: ErrorCode, message: String) -> Self {
        Self { code, message }
    }
}

impl DispatchExecutor {
    /// An executor over an already loaded backend, for batches up to `limits`.
    pub fn new(backend: Box<dyn ExpertBackend>, hidden: usize, limits: BatchLimits) -> Self {
        let rows = limits.max_pairs.max(limits.max_tokens);
        Self {
            backend,
            hidden,
            limits,
            x: vec![0.0; limits.max_tokens * hidden],
            out: vec![0.0; rows * hidden],
            grouping: Grouping::with_capacity(limits.max_pairs),
            result: BytesMut::with_capacity(rows * hidden * 4),
        }
    }

    /// The backend's name.
    pub fn backend_name(&self) -> String {
        self.backend.name()
    }

    /// The backend, to change its experts between dispatches (a live placement change).
    pub fn backend_mut(&mut self) -> &mut dyn ExpertBackend {
        &mut *self.backend
    }

    /// Run one dispatch. Errors name the problem; the caller answers with an error frame.
    pub fn execute(
        &mut self,
        d: &Dispatch,
        payload: &[u8],
    ) -> Result<(ExpertResult, Bytes), ExecError> {
        let pairs = self.check(d, payload)?;
        let (h, t) = (self.hidden, d.tokens as usize);
        let (mode, layout) = (d.mode, d.layout);
        let rows = match layout {
            OutputLayout::PerSlot => pairs,
            OutputLayout::PreCombined => t,
        };
        let input = input_view(d, mode, h, payload, &mut self.x)?;
        // Pairs are numbered token-major in slot order: pair p is output row p.
        self.grouping.clear();
        let mut p = 0usize;
        for (tok, &c) in d.expert_counts.iter().enumerate() {
            for _ in 0..c {
                self.grouping
                    .push(d.experts[p], tok as u32, d.weights[p], p as u32);
                p += 1;
            }
        }
        let (backend, out) = (&mut self.backend, &mut self.out[..rows * h]);
        self.grouping
            .with_groups(d.layer, |groups| {
                let batch = GroupedBatch {
                    mode,
                    hidden: h,
                    tokens: t,
                    input,
                    groups,
                    layout,
                };
                backend.execute(&batch, out)
            })
            .map_err(backend_error)?;
        let bytes = self.encode_result(rows * h, d.result_dtype)?;
        let res = ExpertResult {
            batch_id: d.batch_id,
            layer: d.layer,
            part: d.part,
            layout: d.layout,
            rows: rows as u32,
            hidden: h as u32,
            dtype: d.result_dtype,
        };
        Ok((res, bytes))
    }

    /// Check a dispatch's shape against this worker and its own counts; returns its pairs.
    fn check(&self, d: &Dispatch, payload: &[u8]) -> Result<usize, ExecError> {
        let h = self.hidden;
        let t = d.tokens as usize;
        if d.hidden as usize != h {
            let msg = format!(
                "dispatch hidden size {} but this worker's experts have {h}",
                d.hidden
            );
            return Err(ExecError::new(ErrorCode::InvalidInput, msg));
        }
        if d.expert_counts.len() != t {
            let msg = format!("{} expert counts for {t} tokens", d.expert_counts.len());
            return Err(ExecError::new(ErrorCode::BadFrame, msg));
        }
        let pairs: usize = d.expert_counts.iter().map(|&c| c as usize).sum();
        if pairs != d.experts.len() || pairs != d.weights.len() {
            let msg = format!(
                "expert counts sum to {pairs} but {} experts and {} weights were sent",
                d.experts.len(),
                d.weights.len()
            );
            return Err(ExecError::new(ErrorCode::BadFrame, msg));
        }
        if t > self.limits.max_tokens || pairs > self.limits.max_pairs {
            let msg = format!(
                "{t} tokens / {pairs} pairs exceed this worker's batch limits ({} / {})",
                self.limits.max_tokens, self.limits.max_pairs
            );
            return Err(ExecError::new(ErrorCode::Overloaded, msg));
        }
        let expected = d.dtype.payload_bytes(t, h).unwrap_or(u64::MAX);
        if payload.len() as u64 != expected {
            let msg = format!(
                "payload has {} bytes, {t} tokens of {} need {expected}",
                payload.len(),
                d.dtype.name()
            );
            return Err(ExecError::new(ErrorCode::BadFrame, msg));
        }
        Ok(pairs)
    }

    /// One copy out: the first `n` output values, encoded in `dt` into the reusable result
    /// buffer (bf16: each f32 value rounded to nearest even, after the backend's combine).
    fn encode_result(&mut self, n: usize, dt: OutputDtype) -> Result<Bytes, ExecError> {
        self.result.clear();
        self.result.reserve(n * dt.elem_bytes());
        match (dt, dtype::f32_as_le_bytes(&self.out[..n])) {
            (OutputDtype::F32, Some(bytes)) => self.result.extend_from_slice(bytes),
            _ => {
                self.result.resize(n * dt.elem_bytes(), 0);
                dtype::encode_output(dt, &self.out[..n], &mut self.result)
                    .map_err(|e| ExecError::new(ErrorCode::Internal, e.to_string()))?;
            }
        }
        Ok(self.result.split().freeze())
    }
}

/// The kernels' input for a checked dispatch: a zero-copy view where the payload already is
/// what the kernels read (q8 in exact mode), else the payload decoded once into `x`.
fn input_view<'a>(
    d: &Dispatch,
    mode: ComputeMode,
    h: usize,
    payload: &'a [u8],
    x: &'a mut [f32],
) -> Result<Activations<'a>, ExecError> {
    let t = d.tokens as usize;
    if (d.dtype, mode) == (ActivationDtype::Q8Block32, ComputeMode::Exact)
        && let Some((q, d)) = dtype::q8_view(t, h, payload)
    {
        return Ok(Activations::Q8 { q, d });
    }
    let x = &mut x[..t * h];
    dtype::decode_activations(d.dtype, t, h, payload, x)
        .map_err(|e| ExecError::new(ErrorCode::BadFrame, e.to_string()))?;
    Ok(Activations::F32(x))
}

/// The error frame for a backend failure.
fn backend_error(e: BackendError) -> ExecError {
    match e {
        BackendError::UnknownExpert(k) => ExecError::new(
            ErrorCode::NotFound,
            format!(
                "{k} is not pinned on this worker; the router's placement does not match the worker's"
            ),
        ),
        other => ExecError::new(ErrorCode::Internal, other.to_string()),
    }
}
