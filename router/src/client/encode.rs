//! The payload of a `LayerRequest`: hidden states in the caller's encoding, then the optional
//! router logits.
//!
//! Layout (the transport codec's, see [`LayerRequest::logits_range`]): the hidden states in
//! their dtype's layout, then, when logits are given, zero padding to the next 64-byte boundary
//! and `[tokens][experts]` little-endian f32 logits.
//!
//! [`LayerRequest::logits_range`]: expertmesh_transport::codec::LayerRequest::logits_range

use super::ClientError;
use expertmesh_transport::codec::align_up;
use expertmesh_transport::dtype::{self, ActivationDtype};

/// The hidden states of one layer call (`[tokens][hidden]`, row-major), in the encoding the
/// caller holds them. `&[f32]` and `&Vec<f32>` convert into [`HiddenStates::F32`].
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub enum HiddenStates<'a> {
    /// f32 values, sent as f32 (lossless).
    F32(&'a [f32]),
    /// f32 values, converted to the given dtype on the way (what
    /// [`RouterClient::call_as`](super::RouterClient::call_as) sends): bf16 and f16 round to
    /// nearest even, fp8 e4m3 scales each token by its absolute maximum.
    F32As(&'a [f32], ActivationDtype),
    /// bfloat16 bit patterns (a serving frontend's bf16 activations), sent unchanged.
    Bf16Bits(&'a [u16]),
    /// IEEE binary16 bit patterns, sent unchanged.
    F16Bits(&'a [u16]),
}

impl<'a> From<&'a [f32]> for HiddenStates<'a> {
    fn from(x: &'a [f32]) -> Self {
        HiddenStates::F32(x)
    }
}

impl<'a> From<&'a Vec<f32>> for HiddenStates<'a> {
    fn from(x: &'a Vec<f32>) -> Self {
        HiddenStates::F32(x)
    }
}

impl HiddenStates<'_> {
    /// Number of values (`tokens × hidden`).
    pub fn len(&self) -> usize {
        match self {
            HiddenStates::F32(x) | HiddenStates::F32As(x, _) => x.len(),
            HiddenStates::Bf16Bits(x) | HiddenStates::F16Bits(x) => x.len(),
        }
    }

    /// Whether there are no values.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The dtype the request carries them in.
    pub fn dtype(&self) -> ActivationDtype {
        match self {
            HiddenStates::F32(_) => ActivationDtype::F32,
            HiddenStates::F32As(_, d) => *d,
            HiddenStates::Bf16Bits(_) => ActivationDtype::Bf16,
            HiddenStates::F16Bits(_) => ActivationDtype::F16,
        }
    }
}

/// The shape of one request's payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Layout {
    /// Tokens.
    pub(super) tokens: usize,
    /// Hidden size.
    pub(super) hidden: usize,
    /// Encoding of the hidden states.
    pub(super) dtype: ActivationDtype,
    /// Bytes of the hidden states.
    pub(super) hidden_bytes: usize,
    /// Logit columns (0: no logits).
    pub(super) logit_experts: usize,
    /// Bytes of the whole payload.
    pub(super) total: usize,
}

impl Layout {
    /// Refuses a payload that no frame of `max_frame` bytes can carry, before anything is
    /// copied for it (a request of millions of tokens was copied whole, then refused by the
    /// encoder), saying how many tokens a request may have.
    pub(super) fn check_frame(&self, max_frame: usize) -> Result<(), ClientError> {
        if self.total <= max_frame {
            return Ok(()); // the frame's header is checked when it is encoded
        }
        let per_token = self.total.div_ceil(self.tokens.max(1)).max(1);
        if per_token >= max_frame {
            return Err(ClientError::Input(format!(
                "one token of this request is {per_token} bytes, which exceeds the configured \
                 maximum frame of {max_frame} bytes alone: no split of it can be sent"
            )));
        }
        Err(ClientError::Input(format!(
            "a request of {} tokens is {} bytes, which exceeds the configured maximum frame of \
             {max_frame} bytes: split it into requests of at most {} tokens",
            self.tokens,
            self.total,
            (max_frame / per_token).saturating_sub(1).max(1)
        )))
    }

    /// The layout of `x` (`[tokens][hidden]`) with optional `logits` (`[tokens][experts]`),
    /// or why it cannot be sent.
    pub(super) fn of(
        x: &HiddenStates<'_>,
        hidden: usize,
        logits: Option<&[f32]>,
    ) -> Result<Self, ClientError> {
        let n = x.len();
        if hidden == 0 || n % hidden != 0 {
            return Err(ClientError::Input(format!(
                "{n} values are not whole rows of {hidden}"
            )));
        }
        let tokens = n / hidden;
        let dtype = x.dtype();
        let hidden_bytes = dtype.payload_bytes(tokens, hidden).ok_or_else(|| {
            ClientError::Input(format!(
                "{tokens} x {hidden} cannot be sent as {}",
                dtype.name()
            ))
        })? as usize;
        let logit_experts = match logits {
            None => 0,
            Some(l) if tokens == 0 || l.len() % tokens != 0 => {
                return Err(ClientError::Input(format!(
                    "{} logits for {tokens} tokens",
                    l.len()
                )));
            }
            Some(l) => l.len() / tokens,
        };
        let total = if logit_experts > 0 {
            align_up(hidden_bytes) + tokens * logit_experts * 4
        } else {
            hidden_bytes
        };
        Ok(Self {
            tokens,
            hidden,
            dtype,
            hidden_bytes,
            logit_experts,
            total,
        })
    }
}

/// Write the payload of `x` and `logits` laid out as `layout` into `out`, which is
/// `layout.total` bytes of zeros.
pub(super) fn write_payload(
    x: &HiddenStates<'_>,
    logits: Option<&[f32]>,
    layout: &Layout,
    out: &mut [u8],
) -> Result<(), ClientError> {
    debug_assert_eq!(out.len(), layout.total);
    let (states, rest) = out.split_at_mut(layout.hidden_bytes);
    match x {
        HiddenStates::F32(v) | HiddenStates::F32As(v, _) => {
            dtype::encode_activations(layout.dtype, layout.tokens, layout.hidden, v, states)
                .map_err(|e| ClientError::Input(e.to_string()))?;
        }
        HiddenStates::Bf16Bits(v) | HiddenStates::F16Bits(v) => {
            for (o, b) in states.chunks_exact_mut(2).zip(v.iter()) {
                o.copy_from_slice(&b.to_le_bytes());
            }
        }
    }
    if let Some(l) = logits.filter(|_| layout.logit_experts > 0) {
        let gap = align_up(layout.hidden_bytes) - layout.hidden_bytes;
        for (o, v) in rest[gap..].chunks_exact_mut(4).zip(l) {
            o.copy_from_slice(&v.to_le_bytes());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use expertmesh_transport::codec::LayerRequest;

    fn payload(x: HiddenStates<'_>, hidden: usize, logits: Option<&[f32]>) -> (Layout, Vec<u8>) {
        let layout = Layout::of(&x, hidden, logits).unwrap();
        let mut out = vec![0u8; layout.total];
        write_payload(&x, logits, &layout, &mut out).unwrap();
        (layout, out)
    }

    #[test]
    fn bf16_and_f16_bits_are_sent_unchanged_and_equal_the_converted_f32() {
        let x: Vec<f32> = (0..6 * 32).map(|i| (i as f32 - 90.0) * 0.37).collect();
        for dtype in [ActivationDtype::Bf16, ActivationDtype::F16] {
            let (_, converted) = payload(HiddenStates::F32As(&x, dtype), 32, None);
            let bits: Vec<u16> = converted
                .chunks_exact(2)
                .map(|b| u16::from_le_bytes([b[0], b[1]]))
                .collect();
            let typed = match dtype {
                ActivationDtype::Bf16 => HiddenStates::Bf16Bits(&bits),
                _ => HiddenStates::F16Bits(&bits),
            };
            let (layout, raw) = payload(typed, 32, None);
            assert_eq!(layout.dtype, dtype);
            assert_eq!(raw, converted);
        }
    }

    #[test]
    fn logits_follow_at_the_codecs_offset_after_zero_padding() {
        let x = vec![1.5f32; 3 * 8];
        let logits: Vec<f32> = (0..3 * 5).map(|i| i as f32).collect();
        let (layout, out) = payload(
            HiddenStates::Bf16Bits(&[0x3f80; 24]),
            8,
            Some(logits.as_slice()),
        );
        assert_eq!((layout.tokens, layout.logit_experts), (3, 5));
        let req = LayerRequest {
            request_id: 1,
            layer: 0,
            tokens: 3,
            hidden: 8,
            dtype: layout.dtype,
            logit_experts: 5,
            deadline_us: 0,
        };
        let r = req.logits_range().unwrap();
        assert_eq!(r.end, out.len());
        assert!(out[req.hidden_range().end..r.start].iter().all(|&b| b == 0));
        let got: Vec<f32> = out[r]
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        assert_eq!(got, logits);
        let (_, f32_payload) = payload(HiddenStates::from(&x), 8, None);
        assert_eq!(f32_payload.len(), 3 * 8 * 4);
    }

    #[test]
    fn bad_shapes_are_refused_before_anything_is_sent() {
        let x = vec![0f32; 10];
        let msg = |r: Result<Layout, ClientError>| r.unwrap_err().to_string();
        assert!(msg(Layout::of(&HiddenStates::F32(&x), 3, None)).contains("whole rows of 3"));
        assert!(msg(Layout::of(&HiddenStates::F32(&x), 0, None)).contains("whole rows"));
        assert!(msg(Layout::of(&HiddenStates::F32(&x), 5, Some(&[0.0; 3]))).contains("3 logits"));
        assert!(msg(Layout::of(&HiddenStates::F32(&[]), 5, Some(&[0.0; 3]))).contains("0 tokens"));
        let q8 = HiddenStates::F32As(&x, ActivationDtype::Q8Block32);
        assert!(msg(Layout::of(&q8, 5, None)).contains("cannot be sent as q8-block32"));
    }
}
