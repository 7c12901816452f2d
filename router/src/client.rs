//! `RouterClient`: what a serving frontend links to call the router once per MoE layer.
//!
//! Why this exists: the attention/dense half of a model server should not know about frames,
//! dtypes or request ids. One call sends a layer's hidden states (and optionally the router
//! logits it already computed) and returns the combined expert output, or an error that says
//! what the router refused and why.

use expertmesh_transport::codec::{Body, ErrorCode, LayerRequest, align_up};
use expertmesh_transport::dtype::{self, ActivationDtype};
use expertmesh_transport::frontend::{FrameConnection, FrontendConfig, FrontendError};
use std::net::SocketAddr;
use std::time::Duration;

/// Largest payload of a [`RouterClient::check_shape`] probe: it asks about at most this many
/// bytes of fp8 activations, so the router decodes a few MiB at most.
pub const SHAPE_PROBE_BYTES: usize = 8 << 20;

/// Why a call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// The connection failed. (Its cause is part of the message, not a separate source, so
    /// that printing the error chain says it once.)
    #[error("router connection: {0}")]
    Transport(FrontendError),
    /// The router answered with an error.
    #[error("router refused request {request_id} ({code:?}): {message}")]
    Server {
        /// The request.
        request_id: u64,
        /// Stable error code.
        code: ErrorCode,
        /// The router's explanation.
        message: String,
    },
    /// The input cannot be encoded (shape, NaN for fp8, ...).
    #[error("cannot encode the request: {0}")]
    Input(String),
    /// The router answered something that is not a response to this call.
    #[error("protocol error: {0}")]
    Protocol(String),
}

impl From<FrontendError> for ClientError {
    fn from(e: FrontendError) -> Self {
        ClientError::Transport(e)
    }
}

impl ClientError {
    /// The router's error code, when the router refused the call.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            ClientError::Server { code, .. } => Some(*code),
            _ => None,
        }
    }
}

/// A connection to the router service. One call at a time; open several clients for
/// concurrency.
#[derive(Debug)]
pub struct RouterClient {
    conn: FrameConnection,
    next_id: u64,
}

impl RouterClient {
    /// Connect (and authenticate, when `cfg` carries a secret).
    pub async fn connect(addr: SocketAddr, cfg: &FrontendConfig) -> Result<Self, ClientError> {
        Ok(Self {
            conn: FrameConnection::connect(addr, cfg).await?,
            next_id: 1,
        })
    }

    /// One MoE layer call with f32 hidden states `x` (`[tokens][hidden]`), sent as f32.
    pub async fn call(
        &mut self,
        layer: u32,
        x: &[f32],
        hidden: usize,
        logits: Option<&[f32]>,
        deadline: Option<Duration>,
    ) -> Result<Vec<f32>, ClientError> {
        self.call_as(layer, x, hidden, ActivationDtype::F32, logits, deadline)
            .await
    }

    /// One MoE layer call, sending the hidden states encoded as `dtype`.
    pub async fn call_as(
        &mut self,
        layer: u32,
        x: &[f32],
        hidden: usize,
        dtype: ActivationDtype,
        logits: Option<&[f32]>,
        deadline: Option<Duration>,
    ) -> Result<Vec<f32>, ClientError> {
        if hidden == 0 || x.len() % hidden != 0 {
            return Err(ClientError::Input(format!(
                "{} values are not whole rows of {hidden}",
                x.len()
            )));
        }
        let tokens = x.len() / hidden;
        let hb = dtype.payload_bytes(tokens, hidden).ok_or_else(|| {
            ClientError::Input(format!(
                "{tokens} x {hidden} cannot be sent as {}",
                dtype.name()
            ))
        })? as usize;
        let logit_experts = match logits {
            None => 0,
            Some(l) => {
                if l.len() % tokens != 0 {
                    return Err(ClientError::Input(format!(
                        "{} logits for {tokens} tokens",
                        l.len()
                    )));
                }
                l.len() / tokens
            }
        };
        let total = if logit_experts > 0 {
            align_up(hb) + tokens * logit_experts * 4
        } else {
            hb
        };
        let mut payload = vec![0u8; total];
        dtype::encode_activations(dtype, tokens, hidden, x, &mut payload[..hb])
            .map_err(|e| ClientError::Input(e.to_string()))?;
        if let Some(l) = logits {
            let off = align_up(hb);
            for (o, v) in payload[off..].chunks_exact_mut(4).zip(l) {
                o.copy_from_slice(&v.to_le_bytes());
            }
        }
        self.send_raw(
            layer,
            tokens,
            hidden,
            dtype,
            logit_experts,
            &payload,
            deadline,
        )
        .await
    }

    /// Ask the router whether it accepts a request of this shape (`tokens` × `hidden` for
    /// `layer`) without sending the data, so that a caller can refuse a huge input before
    /// reading it. Returns how many tokens the router was asked about and accepts
    /// (`tokens`, or [`SHAPE_PROBE_BYTES`]` / hidden` when that is fewer), or
    /// [`ClientError::Server`] with the router's reason: an unknown layer, a wrong hidden size,
    /// or more tokens than its per-request limit (said for `tokens`).
    ///
    /// How: the router checks a request's layer, hidden size and token count, then decodes the
    /// payload and refuses non-finite values before anything is computed. The probe is an fp8
    /// request of NaNs: refused as non-finite exactly when its shape is acceptable.
    pub async fn check_shape(
        &mut self,
        layer: u32,
        tokens: usize,
        hidden: usize,
    ) -> Result<usize, ClientError> {
        let t = tokens.min((SHAPE_PROBE_BYTES / hidden.max(1)).max(1));
        let dtype = ActivationDtype::Fp8E4m3;
        let bytes = dtype.payload_bytes(t, hidden).ok_or_else(|| {
            ClientError::Input(format!("{t} x {hidden} cannot be sent as {}", dtype.name()))
        })?;
        let payload = vec![0xffu8; bytes as usize]; // fp8 NaN codes, NaN scales
        match self
            .send_raw(layer, t, hidden, dtype, 0, &payload, None)
            .await
        {
            Err(ClientError::Server { code, message, .. })
                if code == ErrorCode::InvalidInput
                    && message.ends_with(crate::core::NON_FINITE_INPUT) =>
            {
                Ok(t)
            }
            Err(ClientError::Server {
                request_id,
                code,
                message,
            }) => {
                // The router names the probe's token count; say the caller's.
                let message = match message.strip_prefix(&format!("{t} tokens:")) {
                    Some(rest) => format!("{tokens} tokens:{rest}"),
                    None => message,
                };
                Err(ClientError::Server {
                    request_id,
                    code,
                    message,
                })
            }
            Err(e) => Err(e),
            Ok(_) => Err(ClientError::Protocol(
                "the router computed a request of NaNs".into(),
            )),
        }
    }

    /// Send an already encoded payload (hidden states in `dtype`, then optional f32 logits at
    /// the next 64-byte boundary) and wait for the answer.
    #[allow(clippy::too_many_arguments)]
    pub async fn send_raw(
        &mut self,
        layer: u32,
        tokens: usize,
        hidden: usize,
        dtype: ActivationDtype,
        logit_experts: usize,
        payload: &[u8],
        deadline: Option<Duration>,
    ) -> Result<Vec<f32>, ClientError> {
        let request_id = self.next_id;
        self.next_id += 1;
        let body = Body::LayerRequest(LayerRequest {
            request_id,
            layer,
            tokens: tokens as u32,
            hidden: hidden as u32,
            dtype,
            logit_experts: logit_experts as u32,
            deadline_us: deadline.map_or(0, |d| d.as_micros().max(1) as u64),
        });
        self.conn.write_frame(&body, payload).await?;
        loop {
            let frame = self.conn.read_frame().await?;
            match frame.body() {
                Body::LayerResponse(r) if r.request_id == request_id => {
                    let n = r.tokens as usize * r.hidden as usize;
                    let mut out = vec![0f32; n];
                    dtype::decode_output(r.dtype, frame.payload(), &mut out)
                        .map_err(|e| ClientError::Protocol(e.to_string()))?;
                    return Ok(out);
                }
                Body::Error(e) if e.request_id == request_id || e.request_id == 0 => {
                    return Err(ClientError::Server {
                        request_id,
                        code: e.code,
                        message: e.message.clone(),
                    });
                }
                Body::Heartbeat(_) => continue,
                // A stale answer to an earlier call that was abandoned: skip it.
                Body::LayerResponse(_) | Body::Error(_) => continue,
                other => return Err(ClientError::Protocol(format!("unexpected frame {other:?}"))),
            }
        }
    }

    /// Write raw bytes on the connection (tests of the router's handling of malformed frames).
    #[doc(hidden)]
    pub async fn write_raw(&mut self, bytes: &[u8]) -> Result<(), ClientError> {
        Ok(self.conn.write_raw(bytes).await?)
    }
}
