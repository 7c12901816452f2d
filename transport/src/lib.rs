//! Activation transport: the sans-IO frame codec and protocol core, and the TCP, shared-memory
//! and RoCE drivers built around them.
//!
//! Why this crate exists: it is the only crate that touches sockets, shared memory and verbs.
//! Everything above it exchanges typed frames with ranks and never sees a file descriptor.
//!
//! - [`codec`]: the versioned frame format (bytes in, frames out; no I/O, no clock).
//! - [`dtype`]: payload encodings (bf16, f16, f32, fp8 e4m3, q8-block32) and conversions.
//! - [`crypto`]: link security: cluster keys and per-principal credentials, the handshake's
//!   transcript MACs and session keys, and the AES-256-GCM record layer of TCP links.
//! - [`protocol`]: the per-connection state machine shared by every driver (handshake and
//!   authentication, the link kind both ends agree on and the shared-memory sync byte, credit
//!   flow control, heartbeats and timeouts), quinn-proto style.
//! - `link` (internal): one established link whatever its driver, and the types drivers and
//!   the mesh share (re-exported from [`mesh`]).
//! - `tcp` (internal), [`shm`], [`rdma`]: the drivers; each moves frame bytes for its link kind.
//!   [`rdma`] is one link over a narrow NIC interface with three providers: raw verbs (feature
//!   `rdma`), libfabric (feature `libfabric`) and an in-process NIC with fault injection (tests).
//! - `setup` (internal): turns a TCP connection into an established link of the agreed kind,
//!   calling the driver that owns it.
//! - [`mesh`]: the [`Transport`] trait and the rank-to-rank mesh that runs the protocol over
//!   TCP, shared memory or RDMA links: listening, dialling, the event queue.
//! - [`frontend`]: framed connections for clients that are not ranks (serving frontends).
//! - `fork_close` (Unix): a `fork()` child's copies of client connections closed at once, so
//!   the parent's close ends them (turned on by the Python binding; imports nothing of this
//!   crate).
//! - [`signals`]: resets stop handlers that linked RDMA libraries install at load time, before
//!   a process registers its own (imports nothing of this crate).
//! - [`ports`]: free loopback ports below the ephemeral range for the processes a local
//!   fabric, bench or test starts (imports nothing of this crate).
//!
//! # Module layering
//!
//! Each module imports only modules on lower layers (no import cycles):
//!
//! ```text
//! mesh        frontend        top: connection management, frontend connections
//!   |          |     \
//! setup        |      \       link setup: picks and finishes the link kind
//!   |   \      |       |
//!   |  tcp    shm    rdma     drivers (never import each other, `setup` or `mesh`)
//!   |   |      |       |
//! link ------------------      the established link and shared link-level types
//!   |
//! protocol                    sans-IO connection state machine (no I/O, no clock)
//!   |
//! codec   crypto              frame format; keys, transcript MACs, sealed records
//!   |
//! dtype                       payload encodings
//!   |
//! align                       the 64-byte payload alignment rule
//! ```
//!
//! `mesh` imports `setup`, `link`, `protocol`, `codec` and (for [`ShmConfig`]) `shm`;
//! `frontend` imports `tcp`, `link`, `protocol`, `codec`; `setup` imports the drivers, `link`,
//! `protocol`, `codec`; a driver imports `link`, `protocol`, `codec`; `link` imports `protocol`
//! and `codec`; `protocol` imports `codec`; `codec`
//! imports `dtype` and `align`; `dtype` imports `align`.
//!
//! # Example: two ranks exchange a dispatch and a result
//!
//! ```no_run
//! use expertmesh_transport::codec::{Body, ComputeMode, Dispatch, ExpertResult, OutputLayout};
//! use expertmesh_transport::{dtype, ActivationDtype, LinkKind, Mesh, MeshConfig, OutFrame,
//!     OutputDtype, PeerAddress, Transport, TransportEvent};
//! use std::time::Duration;
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let addrs = ["127.0.0.1:7100".parse()?, "127.0.0.1:7101".parse()?];
//! let peers: Vec<PeerAddress> =
//!     addrs.iter().map(|&addr| PeerAddress { addr, link: LinkKind::Shm }).collect();
//! let mut cfg = MeshConfig::new("my-cluster", 0, peers);
//! // Each rank's own credential, issued by `expertmesh keys issue` (it encrypts every frame).
//! cfg.protocol.credentials = Some(std::sync::Arc::new(
//!     expertmesh_transport::crypto::Credentials::load("rank0.cred".as_ref())?,
//! ));
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
//!     batch_id: 42, layer: 3, part: 0, tokens: 2, hidden: 7168, dtype,
//!     mode: ComputeMode::Exact, layout: OutputLayout::PerSlot, result_dtype: OutputDtype::F32,
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
//! # let _ = (ExpertResult { batch_id: 0, layer: 0, part: 0,
//! #   layout: OutputLayout::PerSlot, rows: 0, hidden: 0, dtype: OutputDtype::F32 },);
//! # Ok(()) }
//! ```

mod align;
pub mod codec;
pub mod crypto;
pub mod dtype;
#[cfg(unix)]
pub mod fork_close;
pub mod frontend;
mod link;
pub mod mesh;
pub mod ports;
pub mod protocol;
pub mod rdma;
mod setup;
pub mod shm;
pub mod signals;
mod tcp;

pub use codec::{Body, CodecConfig, CodecError, FrameKind};
pub use dtype::{ActivationDtype, OutputDtype};
pub use mesh::{
    LinkKind, Mesh, MeshConfig, MeshEvents, OutFrame, PeerAddress, PeerError, PeerErrorKind,
    PeerStats, Rank, RecvFrame, ShmConfig, StartError, Transport, TransportEvent,
};
pub use protocol::ProtocolConfig;
pub use tcp::{
    EVICTED_REASON, HANDSHAKE_EVICT_AFTER, HANDSHAKES_PER_SOURCE, HANDSHAKES_TOTAL, HandshakeGate,
    HandshakePermit, MemoryBudget, MemoryReservation, REFUSAL_LOGS_PER_SECOND, log_refusal,
};
