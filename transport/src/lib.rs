//! Activation transport: the sans-IO frame codec and protocol core, and the TCP, shared-memory
//! and RoCE drivers built around them.
//!
//! Why this crate exists: it is the only crate that touches sockets, shared memory and verbs.
//! Everything above it exchanges typed frames with ranks and never sees a file descriptor.
//!
//! - [`codec`]: the versioned frame format (bytes in, frames out; no I/O, no clock).
//! - [`dtype`]: payload encodings (bf16, f16, f32, fp8 e4m3, q8-block32) and conversions.
//! - [`protocol`]: the per-connection state machine shared by every driver (handshake and
//!   authentication, credit flow control, heartbeats and timeouts), quinn-proto style.
//! - [`mesh`]: the [`Transport`] trait and the rank-to-rank mesh that runs the protocol over
//!   TCP, shared memory or (feature `rdma`) RoCE links.
//! - [`frontend`]: framed connections for clients that are not ranks (serving frontends).

pub mod codec;
pub mod dtype;
pub mod frontend;
pub mod mesh;
pub mod protocol;
#[cfg(feature = "rdma")]
pub mod rdma;
pub mod shm;
mod tcp;

pub use codec::{Body, CodecConfig, CodecError, FrameKind};
pub use dtype::{ActivationDtype, OutputDtype};
pub use mesh::{
    LinkKind, Mesh, MeshConfig, MeshEvents, OutFrame, PeerAddress, PeerError, PeerErrorKind,
    PeerStats, Rank, RecvFrame, ShmConfig, StartError, Transport, TransportEvent,
};
pub use protocol::ProtocolConfig;
