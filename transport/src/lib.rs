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
//! - [`shm`], `rdma` (feature `rdma`): driver internals and their error types.
//!
//! # Example: two ranks exchange a dispatch and a result
//!
//! ```no_run
//! use expertmesh_transport::codec::{Body, Dispatch, ExpertResult, OutputLayout, WireComputeMode};
//! use expertmesh_transport::{dtype, ActivationDtype, LinkKind, Mesh, MeshConfig, OutFrame,
//!     OutputDtype, PeerAddress, Transport, TransportEvent};
//! use std::time::Duration;
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let addrs = ["127.0.0.1:7100".parse()?, "127.0.0.1:7101".parse()?];
//! let peers: Vec<PeerAddress> =
//!     addrs.iter().map(|&addr| PeerAddress { addr, link: LinkKind::Shm }).collect();
//! let mut cfg = MeshConfig::new("my-cluster", 0, peers);
//! cfg.protocol.secret = Some(std::sync::Arc::from(&b"shared secret"[..]));
//! let (mesh, mut events) = Mesh::start(cfg).await?;
//! mesh.wait_connected(&[1], Duration::from_secs(10)).await?;
//!
//! // Router side: two tokens for rank 1, token 0 → experts 5 and 9, token 1 → expert 9.
//! let (tokens, hidden) = (2usize, 7168usize);
//! let x = vec![0.5f32; tokens * hidden];
//! let dtype = ActivationDtype::Bf16;
//! let mut payload = vec![0u8; dtype.payload_bytes(tokens, hidden).unwrap() as usize];
//! dtype::encode_activations(dtype, tokens, hidden, &x, &mut payload)?;
//! let body = Body::Dispatch(Dispatch {
//!     request_id: 42, layer: 3, micro_batch: 0, tokens: 2, hidden: 7168, dtype,
//!     mode: WireComputeMode::Exact, layout: OutputLayout::PerSlot,
//!     expert_counts: vec![2, 1], experts: vec![5, 9, 9], weights: vec![0.7, 0.3, 1.0],
//! });
//! mesh.send(1, &OutFrame::with_payload(body, payload)).await?; // waits for credit
//!
//! while let Some(ev) = events.recv().await {
//!     match ev {
//!         TransportEvent::Frame(f) => match f.body() {
//!             Body::Result(r) => {
//!                 let mut rows = vec![0f32; (r.rows * r.hidden) as usize];
//!                 dtype::decode_output(r.dtype, f.payload(), &mut rows)?;
//!                 break; // dropping `f` returns its bytes to rank 1's credit window
//!             }
//!             Body::Error(e) => eprintln!("request {} failed: {}", e.request_id, e.message),
//!             _ => {}
//!         },
//!         TransportEvent::PeerLost(err) => eprintln!("{err}"), // "rank 1: ..." → reroute
//!         TransportEvent::PeerUp { .. } => {}
//!     }
//! }
//! # let _ = (ExpertResult { request_id: 0, layer: 0, micro_batch: 0,
//! #   layout: OutputLayout::PerSlot, rows: 0, hidden: 0, dtype: OutputDtype::F32 },);
//! # Ok(()) }
//! ```

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
