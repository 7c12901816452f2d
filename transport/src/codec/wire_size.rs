//! Wire-size accounting: the bytes one destination device costs per token, measured on frames
//! the codec encodes.
//!
//! Why this exists: the planner's traffic model, the router's report and the benches all need
//! each serving mode's bytes on the wire; restating the frame layout in each would drift from
//! it. [`wire_bytes_per_token`] encodes a real dispatch and a real result frame with
//! the codec and divides by the tokens, so every change of the frame format is followed. The
//! codec re-exports it; nothing in the data path calls it.

use super::{
    Body, CodecConfig, CodecError, ComputeMode, Dispatch, ExpertResult, MAX_MAX_FRAME_BYTES,
    OutputLayout, encode_head,
};
use crate::dtype::{ActivationDtype, OutputDtype};

/// How one device's share of a layer call travels: the dispatch's activation encoding and the
/// result's layout and encoding (a serving mode's wire, e.g. exact mode = q8-block32 out,
/// per-slot f32 back).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct WireFormat {
    /// Encoding of the dispatched activations.
    pub dispatch: ActivationDtype,
    /// Result rows: one per (token, slot) or one per token.
    pub layout: OutputLayout,
    /// Encoding of the result rows.
    pub result: OutputDtype,
}

/// Bytes per token that one destination device costs on the wire, averaged over a frame of
/// `tokens` tokens: the dispatch frame out and the result frame back, headers, metadata and
/// padding included (transport-level overhead such as TCP/IP headers and credit frames is not).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WireBytes {
    /// Dispatch frame bytes per token (router → device).
    pub dispatch: f64,
    /// Result frame bytes per token (device → router).
    pub result: f64,
}

impl WireBytes {
    /// Both directions together.
    pub fn total(&self) -> f64 {
        self.dispatch + self.result
    }
}

/// The bytes the fabric actually sends per token to and from one destination device, for a
/// frame of `tokens` tokens of hidden size `hidden`, each with `slots_per_token` of this
/// device's experts, in wire format `wire`. Measured by encoding a real dispatch and a real
/// result frame with this codec (so it follows every change of the frame format), then dividing
/// by `tokens`. A token routed to `d` devices costs the sum over its destinations; the planner's
/// traffic model and the benches call this rather than restating the layout.
pub fn wire_bytes_per_token(
    wire: WireFormat,
    hidden: usize,
    tokens: usize,
    slots_per_token: usize,
) -> Result<WireBytes, CodecError> {
    let tokens = tokens.max(1);
    let cfg = CodecConfig {
        max_frame_bytes: MAX_MAX_FRAME_BYTES,
        payload_checksum: false,
    };
    let pairs = tokens * slots_per_token;
    let dispatch = Body::Dispatch(Dispatch {
        batch_id: 1,
        layer: 0,
        part: 0,
        tokens: tokens as u32,
        hidden: hidden as u32,
        dtype: wire.dispatch,
        mode: ComputeMode::Exact,
        layout: wire.layout,
        result_dtype: wire.result,
        expert_counts: vec![slots_per_token as u16; tokens],
        experts: vec![0; pairs],
        weights: vec![0.0; pairs],
    });
    let rows = match wire.layout {
        OutputLayout::PerSlot => pairs,
        OutputLayout::PreCombined => tokens,
    };
    let result = Body::Result(ExpertResult {
        batch_id: 1,
        layer: 0,
        part: 0,
        layout: wire.layout,
        rows: rows as u32,
        hidden: hidden as u32,
        dtype: wire.result,
    });
    let mut head = Vec::new();
    let mut encoded = |body: &Body| -> Result<usize, CodecError> {
        let payload = vec![0u8; body.expected_payload_len()? as usize];
        encode_head(body, &payload, &cfg, &mut head)
    };
    let (d, r) = (encoded(&dispatch)?, encoded(&result)?);
    Ok(WireBytes {
        dispatch: d as f64 / tokens as f64,
        result: r as f64 / tokens as f64,
    })
}

/// The most tokens one frame pair can carry to and from one device in wire format `wire`
/// (hidden size `hidden`, every token with `slots_per_token` of the device's experts, the worst
/// case of a part) such that both the dispatch and the result frame are at most
/// `max_frame_bytes` and their heads within [`MAX_HEAD_BYTES`](crate::codec::MAX_HEAD_BYTES),
/// measured on encoded frames as [`wire_bytes_per_token`] is. A router must not cut
/// micro-batches larger than this: their frames would be refused as too large.
pub fn max_tokens_per_frame(
    wire: WireFormat,
    hidden: usize,
    slots_per_token: usize,
    max_frame_bytes: usize,
) -> usize {
    let fits = |tokens: usize| {
        wire_bytes_per_token(wire, hidden, tokens, slots_per_token).is_ok_and(|w| {
            let largest = w.dispatch.max(w.result) * tokens as f64;
            largest <= max_frame_bytes as f64
        })
    };
    // The frames grow with the tokens: the largest count that fits, by bisection.
    let (mut lo, mut hi) = (0usize, 1usize);
    while fits(hi) {
        lo = hi;
        if hi >= 1 << 24 {
            return hi;
        }
        hi *= 2;
    }
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if fits(mid) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The limit is the last token count whose frames fit, checked against the encoded
    /// lengths one token either side.
    #[test]
    fn max_tokens_per_frame_is_the_last_count_that_fits() {
        for (hidden, slots, limit) in [
            (1024, 4, 16usize << 20),
            (7168, 9, 16 << 20),
            (2048, 8, 1 << 20),
        ] {
            let t = max_tokens_per_frame(Q8_F32_SLOTS, hidden, slots, limit);
            let largest = |n: usize| {
                let w = wire_bytes_per_token(Q8_F32_SLOTS, hidden, n, slots).unwrap();
                w.dispatch.max(w.result) * n as f64
            };
            assert!(t >= 1, "one token fits");
            assert!(largest(t) <= limit as f64, "{t} tokens fit");
            assert!(largest(t + 1) > limit as f64, "{} tokens do not", t + 1);
        }
        // Kimi K2's shape in exact mode: a part of 9 slots per token (8 routed + 1 shared) is
        // 258,048 bytes of per-slot f32 rows per token; 16 MiB carries 65 of them (and the
        // result frame's 64-byte head), not 66.
        assert_eq!(max_tokens_per_frame(Q8_F32_SLOTS, 7168, 9, 16 << 20), 65);
    }

    /// With a small hidden size the dispatch metadata (74 bytes a token with nine slots)
    /// reaches the head limit a sealed peer opens long before the rows reach the frame limit:
    /// the count stops there, and one token more is refused by the encoder, not the peer.
    #[test]
    fn frames_keep_their_head_within_what_a_sealed_peer_opens() {
        let t = max_tokens_per_frame(Q8_F32_SLOTS, 32, 9, 64 << 20);
        assert!(wire_bytes_per_token(Q8_F32_SLOTS, 32, t, 9).is_ok());
        let over = wire_bytes_per_token(Q8_F32_SLOTS, 32, t + 1, 9);
        assert!(
            matches!(over, Err(CodecError::HeadTooLarge { max, .. }) if max == crate::crypto::MAX_SEALED_HEAD_BYTES),
            "{over:?}"
        );
        // 1 MiB of head at 74 bytes a token, less the header and the fixed metadata.
        assert!((14_000..14_170).contains(&t), "{t}");
    }

    const Q8_F32_SLOTS: WireFormat = WireFormat {
        dispatch: ActivationDtype::Q8Block32,
        layout: OutputLayout::PerSlot,
        result: OutputDtype::F32,
    };

    #[test]
    fn wire_bytes_are_the_encoded_frame_lengths() {
        // One token of hidden 1024 with 2 slots: q8 payload 1024 + 32·4 scales; head 32 + meta
        // (40 + 2 + 16) = 90 → 128. Result: 2 rows of 1024 f32 = 8192, head 32 + 24 → 64.
        let w = wire_bytes_per_token(Q8_F32_SLOTS, 1024, 1, 2).unwrap();
        assert_eq!(w.dispatch, (128 + 1024 + 128) as f64);
        assert_eq!(w.result, (64 + 8192) as f64);
        let bf16 = WireFormat {
            result: OutputDtype::Bf16,
            ..Q8_F32_SLOTS
        };
        assert_eq!(
            wire_bytes_per_token(bf16, 1024, 1, 2).unwrap().result,
            (64 + 4096) as f64
        );
        let combined = WireFormat {
            layout: OutputLayout::PreCombined,
            ..bf16
        };
        let c = wire_bytes_per_token(combined, 1024, 1, 2).unwrap();
        assert_eq!(c.result, (64 + 2048) as f64);
        assert_eq!(c.total(), c.dispatch + c.result);
    }
}
