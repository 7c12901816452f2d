//! The worker's half of the dispatch protocol: one `Dispatch` frame in, one result frame out.
//!
//! Why this exists: a worker receives a token batch with, per token, the list of its local
//! experts; it must group the rows by expert, run its backend once per batch, and return either
//! one row per (token, expert) pair or one pre-combined row per token. Keeping this next to the
//! router's core lets one test suite drive both halves in process, with the real CPU backend,
//! while the worker process (`expertmesh worker`) is a thin loop around [`DispatchExecutor`].

use bytes::Bytes;
use expertmesh_backend::{
    Activations, BackendError, BatchLimits, ExpertBackend, GroupedBatch, Grouping, OutputLayout,
};
use expertmesh_quant::contract::ComputeMode;
use expertmesh_transport::codec::{
    Dispatch, ErrorCode, ExpertResult, OutputLayout as WireLayout, WireComputeMode, align_up,
};
use expertmesh_transport::dtype::{self, ActivationDtype, OutputDtype};

/// Runs dispatches on a backend with buffers sized once.
pub struct DispatchExecutor {
    backend: Box<dyn ExpertBackend>,
    hidden: usize,
    limits: BatchLimits,
    x: Vec<f32>,
    out: Vec<f32>,
    grouping: Grouping,
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

type ExecError = (ErrorCode, String);

impl DispatchExecutor {
    /// An executor over an already loaded backend, for batches up to `limits`.
    pub fn new(backend: Box<dyn ExpertBackend>, hidden: usize, limits: BatchLimits) -> Self {
        let p = limits.max_pairs;
        Self {
            backend,
            hidden,
            limits,
            x: vec![0.0; limits.max_tokens * hidden],
            out: vec![0.0; limits.max_pairs.max(limits.max_tokens) * hidden],
            grouping: Grouping::with_capacity(p),
        }
    }

    /// The backend's name.
    pub fn backend_name(&self) -> String {
        self.backend.name()
    }

    /// Run one dispatch. Errors name the problem; the caller answers with an error frame.
    pub fn execute(
        &mut self,
        d: &Dispatch,
        payload: &[u8],
    ) -> Result<(ExpertResult, Bytes), ExecError> {
        let h = self.hidden;
        let t = d.tokens as usize;
        if d.hidden as usize != h {
            return Err((
                ErrorCode::InvalidInput,
                format!(
                    "dispatch hidden size {} but this worker's experts have {h}",
                    d.hidden
                ),
            ));
        }
        if d.expert_counts.len() != t {
            return Err((
                ErrorCode::BadFrame,
                format!("{} expert counts for {t} tokens", d.expert_counts.len()),
            ));
        }
        let pairs: usize = d.expert_counts.iter().map(|&c| c as usize).sum();
        if pairs != d.experts.len() || pairs != d.weights.len() {
            return Err((
                ErrorCode::BadFrame,
                format!(
                    "expert counts sum to {pairs} but {} experts and {} weights were sent",
                    d.experts.len(),
                    d.weights.len()
                ),
            ));
        }
        if t > self.limits.max_tokens || pairs > self.limits.max_pairs {
            return Err((
                ErrorCode::Overloaded,
                format!(
                    "{t} tokens / {pairs} pairs exceed this worker's batch limits ({} / {})",
                    self.limits.max_tokens, self.limits.max_pairs
                ),
            ));
        }
        let expected = d.dtype.payload_bytes(t, h).unwrap_or(u64::MAX);
        if payload.len() as u64 != expected {
            return Err((
                ErrorCode::BadFrame,
                format!(
                    "payload has {} bytes, {t} tokens of {} need {expected}",
                    payload.len(),
                    d.dtype.name()
                ),
            ));
        }
        let mode = match d.mode {
            WireComputeMode::Exact => ComputeMode::Exact,
            WireComputeMode::Accurate => ComputeMode::Accurate,
        };
        let layout = match d.layout {
            WireLayout::PerSlot => OutputLayout::PerSlot,
            WireLayout::PreCombined => OutputLayout::PreCombined,
        };
        // Zero-copy views where the payload already is what the kernels read.
        let input = match (d.dtype, mode) {
            (ActivationDtype::Q8Block32, ComputeMode::Exact) => {
                let n = t * h;
                let (codes, rest) = payload.split_at(align_up(n));
                // SAFETY: i8 and u8 have the same size and alignment.
                let q: &[i8] = unsafe { std::slice::from_raw_parts(codes.as_ptr().cast(), n) };
                // SAFETY: f32 has no invalid bit patterns; `align_to` only yields the aligned
                // middle part.
                let (pre, d32, _) = unsafe { rest[..n / 32 * 4].align_to::<f32>() };
                if pre.is_empty() && d32.len() == n / 32 && cfg!(target_endian = "little") {
                    Activations::Q8 { q, d: d32 }
                } else {
                    dtype::decode_activations(d.dtype, t, h, payload, &mut self.x[..n])
                        .map_err(|e| (ErrorCode::BadFrame, e.to_string()))?;
                    Activations::F32(&self.x[..n])
                }
            }
            _ => {
                dtype::decode_activations(d.dtype, t, h, payload, &mut self.x[..t * h])
                    .map_err(|e| (ErrorCode::BadFrame, e.to_string()))?;
                Activations::F32(&self.x[..t * h])
            }
        };
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
        let n_out = match layout {
            OutputLayout::PerSlot => pairs * h,
            OutputLayout::PreCombined => t * h,
        };
        let (backend, out) = (&mut self.backend, &mut self.out[..n_out]);
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
            .map_err(|e| match e {
                BackendError::UnknownExpert(k) => (
                    ErrorCode::NotFound,
                    format!("{k} is not pinned on this worker; the router's placement does not match the worker's"),
                ),
                other => (ErrorCode::Internal, other.to_string()),
            })?;
        let rows = match layout {
            OutputLayout::PerSlot => pairs,
            OutputLayout::PreCombined => t,
        };
        let mut bytes = vec![0u8; n_out * 4];
        dtype::encode_output(OutputDtype::F32, &self.out[..n_out], &mut bytes)
            .map_err(|e| (ErrorCode::Internal, e.to_string()))?;
        Ok((
            ExpertResult {
                request_id: d.request_id,
                layer: d.layer,
                micro_batch: d.micro_batch,
                layout: d.layout,
                rows: rows as u32,
                hidden: h as u32,
                dtype: OutputDtype::F32,
            },
            Bytes::from(bytes),
        ))
    }
}
