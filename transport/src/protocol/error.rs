//! Why a connection was closed by the protocol, and the error code the peer is told.
//!
//! Why this exists: every refusal and failure of the protocol core is one [`ProtocolError`]
//! variant with an operator-facing message; the code sent in the closing error frame is derived
//! from it in one place.

use crate::codec::{CodecError, ErrorCode, FORMAT_VERSION, FrameKind, PRE_AUTH_MAX_FRAME_BYTES};
use crate::crypto;
use std::time::Duration;

/// Why a connection was closed by the protocol.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProtocolError {
    /// A frame could not be decoded.
    #[error("bad frame: {0}")]
    Codec(#[from] CodecError),
    /// The peer belongs to another cluster.
    #[error(
        "peer belongs to cluster {theirs:?}, this node to {ours:?}; check the cluster name in both configurations"
    )]
    ClusterMismatch {
        /// Our cluster name.
        ours: String,
        /// The peer's.
        theirs: String,
    },
    /// The peer speaks another frame format version.
    #[error(
        "peer speaks frame format version {theirs}, this build {FORMAT_VERSION}; run the same version on both"
    )]
    VersionMismatch {
        /// The peer's version.
        theirs: u8,
    },
    /// The peer announced a rank we did not expect.
    #[error(
        "peer announced rank {got}, expected {expected}; check the rank addresses in the configuration"
    )]
    UnexpectedRank {
        /// The rank dialled.
        expected: u32,
        /// The rank announced.
        got: u32,
    },
    /// The peer announced an impossible rank.
    #[error("peer announced rank {rank}, outside 0..{world_size} or equal to this node's rank")]
    BadRank {
        /// The rank announced.
        rank: u32,
        /// Cluster size.
        world_size: u32,
    },
    /// Authentication failed.
    #[error("authentication failed: {0}")]
    AuthFailed(String),
    /// A sealed frame did not open (tampered, replayed, reordered, truncated).
    #[error("{0}; closing the connection")]
    Integrity(#[from] crypto::IntegrityError),
    /// A frame before authentication larger than [`PRE_AUTH_MAX_FRAME_BYTES`].
    #[error(
        "a {len}-byte frame before authentication (at most {PRE_AUTH_MAX_FRAME_BYTES} bytes are accepted before the peer has authenticated)"
    )]
    PreAuthTooLarge {
        /// The frame's length.
        len: u64,
    },
    /// The peer serves other weights, another model or another placement than this node
    /// expects of its rank.
    #[error(
        "rank {rank} serves other weights or another placement (fingerprint {theirs}…, expected {expected}…); start it with the same model, weights and placement files as the rest of the cluster"
    )]
    FingerprintMismatch {
        /// The peer's rank.
        rank: u32,
        /// The first bytes of the fingerprint it announced, hex.
        theirs: String,
        /// The first bytes of the fingerprint expected for that rank, hex.
        expected: String,
    },
    /// The peer refused us with an error frame during the handshake.
    #[error("peer refused the connection ({code:?}): {message}")]
    Refused {
        /// Code sent by the peer.
        code: ErrorCode,
        /// Message sent by the peer.
        message: String,
    },
    /// A frame that is not allowed in the current state.
    #[error("unexpected {kind:?} frame {state}")]
    UnexpectedFrame {
        /// Kind received.
        kind: FrameKind,
        /// Where in the protocol.
        state: &'static str,
    },
    /// The peer sent more than its credit allows.
    #[error(
        "peer exceeded its flow-control credit: {outstanding} bytes unreleased with a window of {window}"
    )]
    CreditViolation {
        /// Bytes received and not yet released.
        outstanding: u64,
        /// Our receive window.
        window: u64,
    },
    /// A frame larger than the peer's whole receive window.
    #[error("a frame of {len} bytes can never fit the peer's receive window of {window} bytes")]
    FrameExceedsWindow {
        /// Frame length.
        len: u64,
        /// The peer's window.
        window: u64,
    },
    /// Nothing received for too long.
    #[error("peer silent for {0:?} (dead or partitioned)")]
    IdleTimeout(Duration),
    /// The handshake did not complete in time.
    #[error("handshake not completed within {0:?}")]
    HandshakeTimeout(Duration),
    /// Invalid configuration.
    #[error("invalid protocol configuration: {0}")]
    Config(String),
    /// Closed locally (shutdown, a superseded or refused link, a local limit).
    #[error("connection closed locally: {0}")]
    Closed(String),
    /// Failed from the peer's or the network's side: the peer closed the connection or its
    /// process ended, a read or write failed, the peer's ring or records were corrupt, a dial
    /// failed. A fault, logged as a warning.
    #[error("connection failed: {0}")]
    Lost(String),
}

impl ProtocolError {
    pub(super) fn wire_code(&self) -> ErrorCode {
        match self {
            Self::AuthFailed(_) => ErrorCode::AuthFailed,
            Self::Codec(_)
            | Self::UnexpectedFrame { .. }
            | Self::CreditViolation { .. }
            | Self::Integrity(_)
            | Self::PreAuthTooLarge { .. } => ErrorCode::BadFrame,
            _ => ErrorCode::Unsupported,
        }
    }
}
