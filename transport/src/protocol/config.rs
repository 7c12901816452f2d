//! The settings of one connection end, and what a peer says about itself.
//!
//! Why this exists: drivers, the mesh and frontends build a [`ProtocolConfig`] once and share it
//! between connections; its checks ([`ProtocolConfig::validate`]) keep the flow-control window
//! deadlock-free and the timers sane before any connection starts.

use super::error::ProtocolError;
use super::handshake::short_hex;
use crate::codec::{CodecConfig, FINGERPRINT_BYTES};
use crate::crypto::Credentials;
use std::sync::Arc;
use std::time::Duration;

/// Settings of one end of a connection.
#[derive(Clone)]
pub struct ProtocolConfig {
    /// Cluster name; peers of another cluster are refused.
    pub cluster: String,
    /// This end's rank ([`CLIENT_RANK`](crate::codec::CLIENT_RANK) for a frontend client).
    pub local_rank: u32,
    /// Number of ranks in the cluster.
    pub world_size: u32,
    /// This end's keys (`None`: no authentication and no encryption, insecure mode).
    pub credentials: Option<Arc<Credentials>>,
    /// Bytes of application frames this end buffers before the peer must wait for credit.
    pub recv_window_bytes: u64,
    /// Send a heartbeat after this long without sending anything.
    pub heartbeat_interval: Duration,
    /// Close the connection after this long without receiving anything.
    pub idle_timeout: Duration,
    /// Close the connection if the handshake takes longer than this.
    pub handshake_timeout: Duration,
    /// Whether peers announcing [`CLIENT_RANK`](crate::codec::CLIENT_RANK) (frontends) are accepted.
    pub accept_clients: bool,
    /// This end is a router's frontend listener: only frontends may connect. A mesh rank's
    /// hello is refused before authentication (its pair key with this router would otherwise
    /// authenticate whatever frontend name its hello claims, an admin's included).
    pub clients_only: bool,
    /// Frame codec settings.
    pub codec: CodecConfig,
    /// This process's incarnation, sent in the hello (random per start; 0 for frontends).
    pub incarnation: u64,
    /// What this rank serves (model, weights and its experts), sent in the hello.
    pub fingerprint: [u8; FINGERPRINT_BYTES],
    /// The fingerprint each rank must announce, indexed by rank (`None`: not checked). A
    /// peer whose hello differs is refused with [`ProtocolError::FingerprintMismatch`].
    pub peer_fingerprints: Option<Arc<[[u8; FINGERPRINT_BYTES]]>>,
}

impl std::fmt::Debug for ProtocolConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProtocolConfig")
            .field("cluster", &self.cluster)
            .field("local_rank", &self.local_rank)
            .field("world_size", &self.world_size)
            .field("credentials", &self.credentials)
            .field("recv_window_bytes", &self.recv_window_bytes)
            .field("heartbeat_interval", &self.heartbeat_interval)
            .field("idle_timeout", &self.idle_timeout)
            .field("handshake_timeout", &self.handshake_timeout)
            .field("accept_clients", &self.accept_clients)
            .field("clients_only", &self.clients_only)
            .field("codec", &self.codec)
            .field("incarnation", &self.incarnation)
            .field("fingerprint", &short_hex(&self.fingerprint))
            .field(
                "peer_fingerprints",
                &self.peer_fingerprints.as_ref().map(|t| t.len()),
            )
            .finish()
    }
}

impl ProtocolConfig {
    /// A configuration with defaults: 64 MiB receive window, 16 MiB frames, 1 s heartbeats,
    /// 10 s idle timeout, 5 s handshake timeout, no credentials.
    pub fn new(cluster: impl Into<String>, local_rank: u32, world_size: u32) -> Self {
        Self {
            cluster: cluster.into(),
            local_rank,
            world_size,
            credentials: None,
            recv_window_bytes: 64 << 20,
            heartbeat_interval: Duration::from_secs(1),
            idle_timeout: Duration::from_secs(10),
            handshake_timeout: Duration::from_secs(5),
            accept_clients: false,
            clients_only: false,
            codec: CodecConfig::default(),
            incarnation: 0,
            fingerprint: [0; FINGERPRINT_BYTES],
            peer_fingerprints: None,
        }
    }

    /// Checks the settings against each other.
    pub fn validate(&self) -> Result<(), ProtocolError> {
        self.codec.validate().map_err(ProtocolError::Codec)?;
        if self.cluster.len() > crate::codec::MAX_CLUSTER_NAME_BYTES {
            return Err(ProtocolError::Config(
                "cluster name longer than 255 bytes".into(),
            ));
        }
        if self.recv_window_bytes < 2 * self.codec.max_frame_bytes as u64 {
            return Err(ProtocolError::Config(format!(
                "recv_window_bytes {} must be at least twice max_frame_bytes {}",
                self.recv_window_bytes, self.codec.max_frame_bytes
            )));
        }
        if self.heartbeat_interval.is_zero() || self.idle_timeout <= self.heartbeat_interval {
            return Err(ProtocolError::Config(
                "idle_timeout must exceed a non-zero heartbeat_interval".into(),
            ));
        }
        Ok(())
    }
}

/// What the peer told us about itself in its hello.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerInfo {
    /// The peer's rank ([`CLIENT_RANK`](crate::codec::CLIENT_RANK) for a frontend).
    pub rank: u32,
    /// The peer's receive window (our initial send credit).
    pub recv_window_bytes: u64,
    /// The peer's driver attachment.
    pub attachment: Vec<u8>,
    /// The peer process's incarnation (random per start).
    pub incarnation: u64,
    /// A frontend peer's name (empty for ranks).
    pub identity: String,
}
