//! What the fabric puts on the wire for one MoE layer call: the bytes of its dispatch and
//! result frames, per frame, per token and per (token, expert) pair, for each numerical mode.
//!
//! Why this exists: the traffic model (`crate::evaluate`) is only as good as the bytes it
//! counts. The router sends one `Dispatch` frame per (micro-batch, device) — the tokens that
//! device needs, as q8 block-32 activations in exact mode (f32 in accurate mode), plus one
//! (expert id, weight) pair per routed expert — and each device answers with one `Result`
//! frame: one f32 row per (token, slot) in exact mode (the router combines in slot order, so
//! the bits do not depend on placement), one pre-combined row per token in the other modes.
//! With per-node deduplication ([`WireModel::node_dedup`]) the router merges a remote node's
//! parts into one for a leader device, which fans the pairs out to the node's devices over
//! shared memory and answers for the node: a token crosses the network once per node, and
//! pre-combined rows come back summed per node. The constructors here describe one copy per
//! device; the fabric's deployments dedup (`expertmesh_fabric::wire_bytes` sets the flag).
//!
//! [`WireModel`] states those bytes as a linear model per frame. The constructors here compute
//! them from the frame layout (`expertmesh_transport::codec`: a 32-byte header, kind-specific
//! metadata, padding to 64 bytes, the payload); the binary builds the model from the codec's
//! encoded lengths of real frames instead (`expertmesh_fabric::wire_bytes`) and a test there
//! holds the two equal, so a change to the frame format shows up here. The planner cannot
//! depend on the transport crate (layering), hence the copy of the arithmetic.
//!
//! TCP adds its own headers: [`tcp_payload_share`] is the share of an Ethernet line rate left
//! for the byte stream at a given MTU (IPv4 + TCP with timestamps, 52 bytes per segment;
//! Ethernet header, FCS, preamble and inter-frame gap, 38 bytes per frame).

use serde::Serialize;

/// Bytes of the frame header (transport codec).
const HEADER: f64 = 32.0;
/// Alignment of a frame's payload (transport codec).
const ALIGN: f64 = 64.0;
/// Fixed metadata of a dispatch frame: batch id, layer, part, tokens, hidden, dtype/mode/
/// layout bytes, pair count.
const DISPATCH_META: f64 = 8.0 + 4.0 * 4.0 + 4.0 + 4.0;
/// Metadata of a result frame.
const RESULT_META: f64 = 8.0 + 4.0 * 4.0 + 4.0;

/// How many rows a device's result carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ResultRows {
    /// One row per (token, expert) pair: the router combines (exact mode).
    PerSlot,
    /// One row per token: the device pre-combines its experts.
    PerToken,
}

/// The fabric's bytes on the wire per layer call, as a linear model per frame.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct WireModel {
    /// The numerical mode this describes ("exact", "accurate", ...).
    pub mode: String,
    /// Encoding of dispatched activations ("q8-block32", "f32", ...).
    pub dispatch_dtype: String,
    /// Encoding of result rows ("f32", "bf16").
    pub result_dtype: String,
    /// Fixed bytes of one dispatch frame (header, fixed metadata, mean padding).
    pub dispatch_frame_bytes: f64,
    /// Bytes per token in a dispatch frame (activations, scales, its pair count).
    pub dispatch_token_bytes: f64,
    /// Bytes per (token, expert) pair in a dispatch frame (expert id and routing weight).
    pub dispatch_pair_bytes: f64,
    /// Fixed bytes of one result frame.
    pub result_frame_bytes: f64,
    /// Bytes of one result row.
    pub result_row_bytes: f64,
    /// Rows per token and device: one per slot, or one pre-combined.
    pub result_rows: ResultRows,
    /// Whether a token crosses the network once per node (fanned out inside it by a leader
    /// device) and pre-combined results come back summed per node, rather than once per device.
    pub node_dedup: bool,
    /// Tokens per micro-batch: the router sends one frame per (micro-batch, device).
    pub micro_batch_tokens: usize,
    /// Where the figures come from.
    pub source: String,
}

fn align_up(x: f64) -> f64 {
    (x / ALIGN).ceil() * ALIGN
}

impl WireModel {
    /// Exact mode (the fabric's default): q8 block-32 activations (`H` int8 codes and `H/32`
    /// f32 scales per token), one f32 row per (token, slot) back.
    pub fn exact(hidden: u32, micro_batch_tokens: usize) -> WireModel {
        let h = hidden as f64;
        WireModel {
            mode: "exact".into(),
            dispatch_dtype: "q8-block32".into(),
            result_dtype: "f32".into(),
            result_rows: ResultRows::PerSlot,
            ..Self::common(h + h / 32.0 * 4.0, 4.0 * h, micro_batch_tokens)
        }
    }

    /// Accurate mode: f32 activations, one pre-combined f32 row per (token, device) back.
    pub fn accurate(hidden: u32, micro_batch_tokens: usize) -> WireModel {
        let h = hidden as f64;
        WireModel {
            mode: "accurate".into(),
            dispatch_dtype: "f32".into(),
            result_dtype: "f32".into(),
            result_rows: ResultRows::PerToken,
            ..Self::common(4.0 * h, 4.0 * h, micro_batch_tokens)
        }
    }

    /// The fields every mode shares; `act` and `row` are the activation bytes per token and
    /// the bytes of one result row.
    fn common(act: f64, row: f64, micro_batch_tokens: usize) -> WireModel {
        WireModel {
            mode: String::new(),
            dispatch_dtype: String::new(),
            result_dtype: String::new(),
            // Header and fixed metadata, padded to 64 bytes: half the alignment on average.
            dispatch_frame_bytes: HEADER + DISPATCH_META + ALIGN / 2.0,
            dispatch_token_bytes: act + 2.0,
            dispatch_pair_bytes: 8.0,
            result_frame_bytes: align_up(HEADER + RESULT_META),
            result_row_bytes: row,
            result_rows: ResultRows::PerSlot,
            node_dedup: false,
            micro_batch_tokens: micro_batch_tokens.max(1),
            source: "frame layout (transport codec arithmetic)".into(),
        }
    }

    /// Expected frames per device for a call of `batch` tokens when each token goes to the
    /// device with probability `p`: one per micro-batch that has at least one such token.
    pub fn frames(&self, batch: f64, p: f64) -> f64 {
        let m = self.micro_batch_tokens.max(1) as f64;
        let full = (batch / m).floor();
        let rest = batch - full * m;
        let hit = |n: f64| 1.0 - (1.0 - p.clamp(0.0, 1.0)).powf(n);
        full * hit(m) + if rest > 0.0 { hit(rest) } else { 0.0 }
    }

    /// Dispatch bytes to one destination for a call of `batch` tokens, when a token goes there
    /// with probability `p` and sends `pairs` (token, expert) pairs there on average.
    pub fn dispatch_bytes(&self, batch: f64, p: f64, pairs: f64) -> f64 {
        self.frames(batch, p) * self.dispatch_frame_bytes
            + batch * (p * self.dispatch_token_bytes + pairs * self.dispatch_pair_bytes)
    }

    /// Result bytes from one destination for a call of `batch` tokens (same `p` and `pairs`).
    pub fn result_bytes(&self, batch: f64, p: f64, pairs: f64) -> f64 {
        let rows = match self.result_rows {
            ResultRows::PerSlot => pairs,
            ResultRows::PerToken => p,
        };
        self.frames(batch, p) * self.result_frame_bytes + batch * rows * self.result_row_bytes
    }
}

/// Share of an Ethernet line rate a TCP byte stream gets at `mtu` bytes: per segment of
/// `mtu − 52` payload bytes (IPv4 20, TCP 20 + 12 of timestamps) the wire carries `mtu + 38`
/// (Ethernet header 14, FCS 4, preamble 8, inter-frame gap 12).
pub fn tcp_payload_share(mtu: u32) -> f64 {
    let mtu = f64::from(mtu.max(576));
    (mtu - 52.0) / (mtu + 38.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_bytes_per_token_and_frames() {
        let w = WireModel::exact(1024, 32);
        assert_eq!(w.dispatch_token_bytes, 1024.0 + 128.0 + 2.0);
        assert_eq!(w.result_row_bytes, 4096.0);
        // One token to a device with one pair: one frame each way.
        let d = w.dispatch_bytes(1.0, 1.0, 1.0);
        assert_eq!(d, w.dispatch_frame_bytes + 1154.0 + 8.0);
        assert_eq!(w.result_bytes(1.0, 1.0, 1.0), 64.0 + 4096.0);
        // 64 tokens all to one device: two micro-batches, two frames.
        assert!((w.frames(64.0, 1.0) - 2.0).abs() < 1e-12);
        assert!((w.frames(40.0, 1.0) - 2.0).abs() < 1e-12);
        assert_eq!(w.frames(10.0, 0.0), 0.0);
    }

    #[test]
    fn accurate_precombines() {
        let w = WireModel::accurate(64, 16);
        // Three pairs but one row per token.
        assert_eq!(w.result_bytes(1.0, 1.0, 3.0), 64.0 + 256.0);
    }

    #[test]
    fn tcp_share() {
        assert!((tcp_payload_share(1500) - 1448.0 / 1538.0).abs() < 1e-12);
        assert!(tcp_payload_share(9000) > 0.99);
    }
}
