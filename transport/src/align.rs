//! Payload alignment shared by the frame codec and the payload encodings.
//!
//! Why this exists: both [`codec`](crate::codec) (where a payload starts inside a frame) and
//! [`dtype`](crate::dtype) (where the scale block of an fp8 or q8 payload starts) round to the
//! same 64-byte boundary. Keeping the rule in this leaf module lets `codec` depend on `dtype`
//! without `dtype` depending back on `codec`. Both items are re-exported from `codec`.

/// Alignment of the payload inside a frame, in bytes.
pub const PAYLOAD_ALIGN: usize = 64;

/// Rounds `n` up to a multiple of [`PAYLOAD_ALIGN`] (saturating instead of overflowing).
pub const fn align_up(n: usize) -> usize {
    n.saturating_add(PAYLOAD_ALIGN - 1) & !(PAYLOAD_ALIGN - 1)
}
