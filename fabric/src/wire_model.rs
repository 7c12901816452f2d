//! The planner's wire model ([`expertmesh_planner::wire::WireModel`]) measured on the
//! transport codec's encoded frames, for a serving mode.
//!
//! Why this exists: the planner may not depend on the transport crate (layering), so it states
//! the frame arithmetic itself; `expertmesh plan` and `bench cluster` use this module instead,
//! which reads the bytes off real dispatch and result frames
//! (`expertmesh_transport::codec::wire_bytes_per_token` on the mode's `WireFormat`), so the
//! prediction follows every change of the frame format. A test holds the planner's own
//! arithmetic equal to it.

use crate::FabricError;
use expertmesh_planner::wire::{ResultRows, WireModel};
use expertmesh_router::core::{LayerMode, RouterConfig};
use expertmesh_transport::codec::{OutputLayout, WireBytes, WireFormat, wire_bytes_per_token};

/// The wire model of `mode` for hidden size `hidden` and micro-batches of `micro_batch`
/// tokens, from encoded frames: per-frame, per-token and per-pair (or per-row) bytes are the
/// differences between frames of different sizes.
pub fn wire_model(
    mode: LayerMode,
    hidden: u32,
    micro_batch: usize,
) -> Result<WireModel, FabricError> {
    let format = mode.apply(RouterConfig::default()).wire_format();
    let h = hidden as usize;
    // Total frame bytes for `tokens` tokens with `slots` slots each.
    let total = |tokens: usize, slots: usize| -> Result<(f64, f64), FabricError> {
        let WireBytes { dispatch, result } =
            wire_bytes_per_token(format, h, tokens, slots).map_err(FabricError::Wire)?;
        Ok((dispatch * tokens as f64, result * tokens as f64))
    };
    // Sizes that are whole multiples of 64 bytes everywhere, so padding cancels out.
    let (d1, r1) = total(64, 4)?;
    let (d_pairs, r_pairs) = total(64, 8)?;
    let (d_tokens, r_tokens) = total(128, 4)?;
    let pair = (d_pairs - d1) / 256.0;
    let token = (d_tokens - d1) / 64.0 - 4.0 * pair;
    let (rows, row) = match format.layout {
        OutputLayout::PerSlot => (ResultRows::PerSlot, (r_pairs - r1) / 256.0),
        OutputLayout::PreCombined => (ResultRows::PerToken, (r_tokens - r1) / 64.0),
    };
    // Fixed bytes per frame: a one-token, one-slot frame less its token, pair and row.
    let (d_one, r_one) = total(1, 1)?;
    Ok(WireModel {
        mode: mode.name().to_owned(),
        dispatch_dtype: format.dispatch.name().to_owned(),
        result_dtype: match format.result.elem_bytes() {
            2 => "bf16".to_owned(),
            _ => "f32".to_owned(),
        },
        dispatch_frame_bytes: d_one - token - pair,
        dispatch_token_bytes: token,
        dispatch_pair_bytes: pair,
        result_frame_bytes: r_one - row,
        result_row_bytes: row,
        result_rows: rows,
        // The router merges each remote node's parts into one for a leader device, which fans
        // them out over shared memory (`Replicas::node_dedup`, set by every deployment).
        node_dedup: true,
        micro_batch_tokens: micro_batch.max(1),
        source: "transport codec: encoded dispatch and result frames".to_owned(),
    })
}

/// The wire format of `mode` (for reports).
pub fn wire_format(mode: LayerMode) -> WireFormat {
    mode.apply(RouterConfig::default()).wire_format()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The planner's frame arithmetic agrees with the codec: per token, per pair and per row
    /// exactly; per frame within the padding the planner averages.
    #[test]
    fn planner_arithmetic_matches_the_codec() {
        for hidden in [1024u32, 2048, 7168] {
            for (name, planner) in [
                (LayerMode::Exact, WireModel::exact(hidden, 32)),
                (LayerMode::Accurate, WireModel::accurate(hidden, 32)),
            ] {
                let codec = wire_model(name, hidden, 32).unwrap();
                assert_eq!(
                    codec.dispatch_token_bytes, planner.dispatch_token_bytes,
                    "{name}"
                );
                assert_eq!(
                    codec.dispatch_pair_bytes, planner.dispatch_pair_bytes,
                    "{name}"
                );
                assert_eq!(codec.result_row_bytes, planner.result_row_bytes, "{name}");
                assert_eq!(codec.result_rows, planner.result_rows, "{name}");
                assert_eq!(
                    codec.result_frame_bytes, planner.result_frame_bytes,
                    "{name}"
                );
                assert!(codec.node_dedup && !planner.node_dedup, "{name}");
                assert!(
                    (codec.dispatch_frame_bytes - planner.dispatch_frame_bytes).abs() <= 64.0,
                    "{name}: {} vs {}",
                    codec.dispatch_frame_bytes,
                    planner.dispatch_frame_bytes
                );
            }
        }
    }

    /// Serving sends q8 out and one bf16 row per (token, device) back; exact-bf16 one bf16 row
    /// per slot.
    #[test]
    fn serving_and_exact_bf16_halve_the_rows() {
        let s = wire_model(LayerMode::Serving, 2048, 32).unwrap();
        assert_eq!(s.result_rows, ResultRows::PerToken);
        assert_eq!(s.result_row_bytes, 4096.0);
        assert_eq!(s.dispatch_token_bytes, 2048.0 + 256.0 + 2.0);
        let e = wire_model(LayerMode::ExactBf16, 2048, 32).unwrap();
        assert_eq!(e.result_rows, ResultRows::PerSlot);
        assert_eq!(e.result_row_bytes, 4096.0);
    }
}
