//! Checks and decodes frontend requests before they reach the core.
//!
//! Why this exists: a request is checked twice outside the core thread — its metadata before
//! its payload is read (so a refused request costs no memory), then its payload as it is
//! decoded — by the service's connection tasks, which hold a cheap clone of what the core knows
//! about shapes ([`RequestValidator`]). A refusal is a [`Rejection`]: the code and message of
//! the error frame the frontend gets.

use super::ClientId;
use expertmesh_topology::model::ModelSpec;
use expertmesh_transport::codec::{ErrorCode, LayerRequest};
use expertmesh_transport::dtype::{self, ActivationDtype};
use std::time::{Duration, Instant};

/// Checks and decodes frontend requests: a cheap clone of what the core knows about shapes.
#[derive(Clone, Debug)]
pub struct RequestValidator {
    pub(super) spec: ModelSpec,
    /// The layers served, ascending.
    pub(super) layers: Vec<u32>,
    pub(super) max_request_tokens: usize,
    pub(super) default_deadline: Duration,
    pub(super) max_deadline: Duration,
    /// Where refusals are counted ([`RequestValidator::metrics`]).
    pub(super) metrics: std::sync::Arc<crate::metrics::RouterMetrics>,
}

/// The end of the message refusing a non-finite hidden state: the refusal that comes after every
/// shape check passed (`RouterClient::check_shape` relies on that order).
pub const NON_FINITE_INPUT: &str = "inputs must be finite";

/// Why a frontend request was refused: the code and message of its error frame.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{code:?}: {message}")]
pub struct Rejection {
    /// Stable error code.
    pub code: ErrorCode,
    /// What is wrong and what to do.
    pub message: String,
}

fn reject<T>(code: ErrorCode, message: String) -> Result<T, Rejection> {
    Err(Rejection { code, message })
}

impl RequestValidator {
    /// The router's metrics, where the service counts the requests it refuses.
    pub fn metrics(&self) -> &crate::metrics::RouterMetrics {
        &self.metrics
    }

    /// Validate a frontend `LayerRequest` and decode its payload, or say what is wrong.
    pub fn validate(
        &self,
        client: ClientId,
        req: &LayerRequest,
        payload: &[u8],
        now: Instant,
    ) -> Result<Request, Rejection> {
        self.check_shape(req)?;
        let (t, h) = (req.tokens as usize, self.spec.hidden as usize);
        let range = req.hidden_range();
        let logits_end = req.logits_range().map_or(range.end, |r| r.end);
        if payload.len() < logits_end {
            let msg = format!(
                "payload has {} bytes, the request describes {logits_end}",
                payload.len()
            );
            return reject(ErrorCode::BadFrame, msg);
        }
        // One copy in: the payload is decoded once, into the buffer the batch will use.
        let mut x = vec![0f32; t * h];
        if let Err(e) = dtype::decode_activations(req.dtype, t, h, &payload[range], &mut x) {
            return reject(ErrorCode::InvalidInput, e.to_string());
        }
        if let Some(i) = x.iter().position(|v| !v.is_finite()) {
            let msg = format!(
                "hidden state of token {} element {} is {}; {NON_FINITE_INPUT}",
                i / h,
                i % h,
                x[i]
            );
            return reject(ErrorCode::InvalidInput, msg);
        }
        let logits = match req.logits_range() {
            None => None,
            Some(r) => Some(self.decode_logits(req, &payload[r])?),
        };
        let deadline = now + self.deadline_of(req);
        Ok(Request {
            client,
            request_id: req.request_id,
            layer: req.layer,
            tokens: t,
            x,
            logits,
            deadline,
        })
    }

    /// How long `req` may take: its own deadline (or the default when it gives none), cut to
    /// the router's maximum.
    pub fn deadline_of(&self, req: &LayerRequest) -> Duration {
        let asked = match req.deadline_us {
            0 => self.default_deadline,
            us => Duration::from_micros(us),
        };
        asked.min(self.max_deadline)
    }

    /// The checks a request's metadata alone allows (layer, hidden size, token count, dtype),
    /// made before its payload is read.
    pub fn check(&self, req: &LayerRequest) -> Result<(), Rejection> {
        self.check_shape(req)
    }

    /// Layer, hidden size, token count and dtype against what this router serves.
    fn check_shape(&self, req: &LayerRequest) -> Result<(), Rejection> {
        let spec = &self.spec;
        if self.layers.binary_search(&req.layer).is_err() {
            let l = &self.layers;
            let what = if req.layer < spec.num_layers && !spec.is_moe_layer(req.layer) {
                "a dense layer (its MLP is not a mixture of experts: run it in the frontend)"
            } else if req.layer < spec.num_layers {
                "a MoE layer this router does not serve"
            } else {
                "past the model's last layer"
            };
            let msg = format!(
                "layer {} of model {} is {what}; the router serves MoE layers {}..={} (decoder layer indices)",
                req.layer,
                spec.name,
                l.first().copied().unwrap_or(0),
                l.last().copied().unwrap_or(0)
            );
            return reject(ErrorCode::NotFound, msg);
        }
        if req.hidden != spec.hidden {
            let msg = format!(
                "hidden size {} does not match model {} (hidden {})",
                req.hidden, spec.name, spec.hidden
            );
            return reject(ErrorCode::InvalidInput, msg);
        }
        let t = req.tokens as usize;
        if t == 0 || t > self.max_request_tokens {
            let msg = format!(
                "{t} tokens: a request carries 1 to {} tokens; split larger batches",
                self.max_request_tokens
            );
            return reject(ErrorCode::InvalidInput, msg);
        }
        if req.dtype == ActivationDtype::Q8Block32 {
            let msg = "q8-block32 is a worker dispatch format; send hidden states as f32, bf16, f16 or fp8";
            return reject(ErrorCode::Unsupported, msg.into());
        }
        Ok(())
    }

    /// The frontend's router logits `[tokens][experts]` (f32 little-endian), checked finite.
    fn decode_logits(&self, req: &LayerRequest, bytes: &[u8]) -> Result<Vec<f32>, Rejection> {
        let spec = &self.spec;
        if req.logit_experts != spec.routed_experts {
            let msg = format!(
                "router logits have {} columns but model {} has {} routed experts",
                req.logit_experts, spec.name, spec.routed_experts
            );
            return reject(ErrorCode::InvalidInput, msg);
        }
        let l: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        if let Some(i) = l.iter().position(|v| !v.is_finite()) {
            let e = spec.routed_experts as usize;
            let msg = format!(
                "router logit of token {} expert {} is {}; logits must be finite",
                i / e,
                i % e,
                l[i]
            );
            return reject(ErrorCode::InvalidInput, msg);
        }
        Ok(l)
    }
}

/// A validated frontend request.
#[derive(Clone, Debug)]
pub struct Request {
    /// The connection it came from.
    pub client: ClientId,
    /// The client's request id.
    pub request_id: u64,
    /// MoE layer.
    pub layer: u32,
    /// Number of tokens.
    pub tokens: usize,
    /// Hidden states `[tokens][hidden]`.
    pub x: Vec<f32>,
    /// Router logits `[tokens][experts]`, when the frontend computed them.
    pub logits: Option<Vec<f32>>,
    /// When it must be answered.
    pub deadline: Instant,
}
