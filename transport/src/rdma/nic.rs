//! The narrow NIC interface under the RDMA link: what a provider must do, nothing more.
//!
//! Why this exists: the RDMA link (ring records, credits, sequence order, record validation, the
//! completion poller: [`super`]) is written once; what differs between raw verbs (RoCE,
//! InfiniBand), libfabric (`tcp;ofi_rxm` here, `verbs;ofi_rxm` or `efa` on clusters) and the
//! in-process NIC of the tests is only this: register two rings, describe the endpoint to the
//! peer, connect, post a write with immediate, post receives, poll completions.
//!
//! Memory: each NIC owns two rings of [`Nic::ring_capacity`] bytes, host memory registered with
//! the provider: the *receive ring*, which the peer writes into remotely, and the *staging
//! ring*, from which this end's writes are read by the NIC. A write copies staging
//! `[off, off + len)` into the peer's receive ring at the same offset.

use super::RdmaError;

/// A completion taken from the NIC's completion queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Completion {
    /// A write of this end finished; its staging bytes may be reused (`wr_id` as posted).
    Sent {
        /// The id given to [`Nic::post_write`].
        wr_id: u64,
    },
    /// The peer's write with immediate `imm` landed in the receive ring and is visible.
    Received {
        /// The immediate (host order).
        imm: u32,
    },
    /// An operation failed (the text names the provider's status); the link is dead.
    Failed(String),
}

/// The outcome of posting a write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Posted {
    /// Accepted; a [`Completion::Sent`] will follow.
    Accepted,
    /// Not accepted now (the provider's queue is full or its connection not up yet): drive
    /// progress (poll) and post again.
    Again,
}

/// One endpoint of one RDMA link. Implementations serialise their own calls where the provider
/// requires it: the link's writer posts from an async task while its poller thread polls.
pub(crate) trait Nic: Send + Sync {
    /// This endpoint's description for the peer (provider address, ring base and key): opaque
    /// bytes the peer passes to [`Nic::connect`].
    fn local_info(&self) -> Vec<u8>;
    /// Connects to the peer described by its [`Nic::local_info`].
    fn connect(&self, peer: &[u8]) -> Result<(), RdmaError>;
    /// Bytes in each ring (a multiple of 64).
    fn ring_capacity(&self) -> usize;
    /// The receive ring (the peer writes it; read only after a [`Completion::Received`]).
    fn recv_ring(&self) -> *const u8;
    /// The staging ring (this end writes records there, then posts them).
    fn staging(&self) -> *mut u8;
    /// Posts one write with immediate of staging `[off, off + len)` to the peer's receive ring
    /// at `off`; its [`Completion::Sent`] carries `wr_id`.
    fn post_write(&self, off: usize, len: usize, imm: u32, wr_id: u64)
    -> Result<Posted, RdmaError>;
    /// Whether each received write consumes a posted receive (raw verbs; libfabric when its
    /// provider says `FI_RX_CQ_DATA`).
    fn needs_receives(&self) -> bool;
    /// Posts one receive for a write with immediate.
    fn post_recv(&self) -> Result<(), RdmaError>;
    /// Appends at most `max` completions to `out` (none when idle).
    fn poll(&self, out: &mut Vec<Completion>, max: usize) -> Result<(), RdmaError>;
}
