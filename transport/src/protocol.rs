//! The per-connection protocol state machine shared by every driver: the handshake with
//! authentication by per-principal credentials (a transcript MAC over both hellos, then
//! per-direction session keys), link setup, credit-based flow control, heartbeats and timeouts.
//!
//! Why this exists: TCP, shared memory and RoCE must behave identically (same handshake, same
//! flow-control window, same dead-peer detection), and the logic must be testable without
//! sockets or a clock. Following quinn-proto, [`Connection`] performs no I/O: the driver feeds it
//! received frames ([`Connection::handle_frame`]) and the current time
//! ([`Connection::handle_timeout`]), and drains what to send ([`Connection::poll_transmit`]),
//! what happened ([`Connection::poll_event`]) and when to wake it next
//! ([`Connection::poll_timeout`]). Drivers are thin loops around it.
//!
//! # Handshake
//!
//! Both ends send [`Hello`](crate::codec::Hello) at once (cluster name, rank, format version, receive window, a fresh
//! 32-byte nonce, whether they authenticate, the link they ask for, the sender process's
//! incarnation, the fingerprint of what its rank serves, and a frontend's name; with
//! credentials the incarnation and fingerprint are zero there and travel sealed in the auth
//! answer instead). Before the peer has authenticated, a frame larger than
//! [`PRE_AUTH_MAX_FRAME_BYTES`] is refused. On the peer's hello each end checks cluster,
//! version, rank and, without credentials, (when [`ProtocolConfig::peer_fingerprints`] is set)
//! that the peer serves the model, weights and experts expected of its rank (with
//! credentials: once its sealed identity has opened, after its MAC verified), then looks up
//! the key it shares with the rank or frontend the
//! peer claims ([`Credentials`](crate::crypto::Credentials): a rank holds a key only for pairs
//! that include itself, a router derives its frontends' keys) and answers with [`Auth`](crate::codec::Auth):
//! `HMAC-SHA256(key, "expertmesh-auth-v2" ‖ role ‖ transcript)`, the transcript being a hash
//! of both hellos ([`crypto::transcript`](crate::crypto::transcript)). A peer that claims a rank without holding that
//! rank's key cannot produce the MAC. Without credentials on both ends the answer is empty
//! (insecure mode); one end with credentials refuses a peer without. The connection is
//! established when the peer's answer verifies; from each end's own [`Auth`](crate::codec::Auth) on, every frame
//! it sends on TCP is sealed with its direction's session key ([`Connection::session_keys`],
//! HKDF over the pair key and the transcript; see [`crypto`](crate::crypto)). A refusal is sent as an
//! [`ErrorFrame`](crate::codec::ErrorFrame) with [`ErrorCode::AuthFailed`](crate::codec::ErrorCode::AuthFailed) (or `BadFrame`) before the driver closes the
//! connection, so the other side can say why.
//!
//! # Flow control
//!
//! Each end announces its receive window `W` (bytes of application frames, headers included).
//! A sender may have at most `W` bytes that the receiver's application has not yet released;
//! [`Connection::try_reserve`] takes credit before a frame is written, and the receiver returns
//! released bytes in [`Credit`](crate::codec::Credit) frames once at least `W/4` have accumulated. `W ≥ 2 ×
//! max_frame_bytes` guarantees this never deadlocks. A peer that sends beyond its credit is
//! closed with [`ProtocolError::CreditViolation`]: the receiver's memory stays bounded by `W`.
//!
//! # Link setup
//!
//! A hello's attachment only names the link its sender asks for ([`SHM_ATTACHMENT`] or
//! [`RDMA_ATTACHMENT`], or nothing for plain TCP); nothing is created for it before
//! authentication. When both hellos ask for the same shared-memory or RDMA link,
//! authentication is followed by a link-setup state ([`Event::LinkSetup`]): the driver creates
//! its side (a ring, a queue pair) and reports it with [`Connection::link_prepared`], which
//! sends a [`LinkInfo`](crate::codec::LinkInfo) frame (sealed) describing it, or an empty one when it cannot; the
//! peer's [`LinkInfo`](crate::codec::LinkInfo) is then in [`Connection::peer_link_info`]. If either side is empty, the
//! connection is established as a TCP link at once. Otherwise the driver sets up its side from
//! the peer's description and reports [`Connection::link_ready`] (or
//! [`Connection::link_setup_failed`]). A shared-memory link then exchanges one raw
//! [`SHM_SYNC_BYTE`] in each direction on the TCP connection, outside any frame
//! ([`Connection::poll_transmit_raw`], [`Connection::handle_raw`]): "I have mapped your ring",
//! after which each side may unlink its own ring file; an RDMA link needs no sync byte.
//!
//! # Queues
//!
//! The connection's internal queues are bounded by the protocol itself: at most one hello, one
//! auth answer, one link info, one heartbeat and one closing error are queued at a time, and a credit frame is
//! queued only per `W/4` bytes released, which the peer can only have sent with credit from
//! earlier credit frames (a handful at most); events are one `LinkSetup`, one `Established` and
//! one `Closed`.

//!
//! # Modules
//!
//! One concern per file, all of them parts of [`Connection`]:
//! `connection` (the state, the queues, closing, routing each received frame),
//! `handshake` (checking the peer's hello, the claimed identity's key, the transcript MAC),
//! `link_request` (the link both ends ask for and its setup), `credits` (flow control and its
//! invariants), `heartbeats` (the handshake deadline, heartbeats, the idle timeout), `config`
//! and `error`.

mod config;
mod connection;
mod credits;
mod error;
mod handshake;
mod heartbeats;
mod link_request;
#[cfg(test)]
mod tests;

pub use crate::codec::PRE_AUTH_MAX_FRAME_BYTES;
pub use config::{PeerInfo, ProtocolConfig};
pub use connection::{Connection, Disposition, Event};
pub use error::ProtocolError;
pub use handshake::{describe_claim, short_hex};
pub use link_request::{
    LinkKind, RDMA_ATTACHMENT, SHM_ATTACHMENT, SHM_SYNC_BYTE, UnknownLinkKind, requested_link,
};
