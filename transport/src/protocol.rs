//! The per-connection protocol state machine shared by every driver: handshake and shared-secret
//! authentication, credit-based flow control, heartbeats and timeouts.
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
//! Both ends send [`Hello`] at once (cluster name, rank, format version, receive window, a fresh
//! 32-byte nonce, whether they require authentication, a driver attachment). On the peer's
//! hello each end checks cluster, version and rank, then answers with [`Auth`]: with a shared
//! secret, `HMAC-SHA256(secret, "expertmesh-auth-v1" ‖ cluster ‖ peer_nonce ‖ own_nonce ‖
//! own_rank)`; without one, an empty answer. The connection is established when the peer's answer
//! verifies. A refusal is sent as an [`ErrorFrame`] with [`ErrorCode::AuthFailed`] (or
//! `BadFrame`) before the driver closes the connection, so the other side can say why.
//!
//! # Flow control
//!
//! Each end announces its receive window `W` (bytes of application frames, headers included).
//! A sender may have at most `W` bytes that the receiver's application has not yet released;
//! [`Connection::try_reserve`] takes credit before a frame is written, and the receiver returns
//! released bytes in [`Credit`] frames once at least `W/4` have accumulated. `W ≥ 2 ×
//! max_frame_bytes` guarantees this never deadlocks. A peer that sends beyond its credit is
//! closed with [`ProtocolError::CreditViolation`]: the receiver's memory stays bounded by `W`.

use crate::codec::{
    Auth, Body, CLIENT_RANK, CodecConfig, CodecError, Credit, ErrorCode, ErrorFrame,
    FORMAT_VERSION, FrameKind, Heartbeat, Hello, NONCE_BYTES,
};
use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

const AUTH_LABEL: &[u8] = b"expertmesh-auth-v1";

/// Settings of one end of a connection.
#[derive(Clone)]
pub struct ProtocolConfig {
    /// Cluster name; peers of another cluster are refused.
    pub cluster: String,
    /// This end's rank ([`CLIENT_RANK`] for a frontend client).
    pub local_rank: u32,
    /// Number of ranks in the cluster.
    pub world_size: u32,
    /// Shared secret for HMAC authentication (`None`: no authentication).
    pub secret: Option<Arc<[u8]>>,
    /// Bytes of application frames this end buffers before the peer must wait for credit.
    pub recv_window_bytes: u64,
    /// Send a heartbeat after this long without sending anything.
    pub heartbeat_interval: Duration,
    /// Close the connection after this long without receiving anything.
    pub idle_timeout: Duration,
    /// Close the connection if the handshake takes longer than this.
    pub handshake_timeout: Duration,
    /// Whether peers announcing [`CLIENT_RANK`] (frontends) are accepted.
    pub accept_clients: bool,
    /// Frame codec settings.
    pub codec: CodecConfig,
}

impl std::fmt::Debug for ProtocolConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProtocolConfig")
            .field("cluster", &self.cluster)
            .field("local_rank", &self.local_rank)
            .field("world_size", &self.world_size)
            .field("secret", &self.secret.as_ref().map(|_| "<redacted>"))
            .field("recv_window_bytes", &self.recv_window_bytes)
            .field("heartbeat_interval", &self.heartbeat_interval)
            .field("idle_timeout", &self.idle_timeout)
            .field("handshake_timeout", &self.handshake_timeout)
            .field("accept_clients", &self.accept_clients)
            .field("codec", &self.codec)
            .finish()
    }
}

impl ProtocolConfig {
    /// A configuration with defaults: 64 MiB receive window, 16 MiB frames, 1 s heartbeats,
    /// 10 s idle timeout, 5 s handshake timeout, no secret.
    pub fn new(cluster: impl Into<String>, local_rank: u32, world_size: u32) -> Self {
        Self {
            cluster: cluster.into(),
            local_rank,
            world_size,
            secret: None,
            recv_window_bytes: 64 << 20,
            heartbeat_interval: Duration::from_secs(1),
            idle_timeout: Duration::from_secs(10),
            handshake_timeout: Duration::from_secs(5),
            accept_clients: false,
            codec: CodecConfig::default(),
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
    /// The peer's rank ([`CLIENT_RANK`] for a frontend).
    pub rank: u32,
    /// The peer's receive window (our initial send credit).
    pub recv_window_bytes: u64,
    /// The peer's driver attachment.
    pub attachment: Vec<u8>,
}

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
    /// Closed locally.
    #[error("connection closed locally: {0}")]
    Closed(String),
}

impl ProtocolError {
    fn wire_code(&self) -> ErrorCode {
        match self {
            Self::AuthFailed(_) => ErrorCode::AuthFailed,
            Self::Codec(_) | Self::UnexpectedFrame { .. } | Self::CreditViolation { .. } => {
                ErrorCode::BadFrame
            }
            _ => ErrorCode::Unsupported,
        }
    }
}

/// Something that happened on the connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// Handshake and authentication completed.
    Established(PeerInfo),
    /// The connection is closed; no further frames are accepted or produced.
    Closed(ProtocolError),
}

/// What the driver should do with a frame it passed to [`Connection::handle_frame`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Disposition {
    /// A protocol frame, fully handled.
    Consumed,
    /// An application frame: deliver it, and call [`Connection::release`] with its length once
    /// the application is done with it.
    Deliver,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    AwaitHello,
    AwaitAuth,
    Established,
    Closed(ProtocolError),
}

/// One end of one connection, without I/O.
#[derive(Debug)]
pub struct Connection {
    cfg: Arc<ProtocolConfig>,
    expected_peer: Option<u32>,
    state: State,
    local_nonce: [u8; NONCE_BYTES],
    peer: Option<PeerInfo>,
    peer_nonce: [u8; NONCE_BYTES],
    send_credit: u64,
    recv_outstanding: u64,
    release_pending: u64,
    started: Instant,
    last_rx: Instant,
    last_tx: Instant,
    heartbeat_seq: u64,
    heartbeat_queued: bool,
    transmit: VecDeque<Body>,
    events: VecDeque<Event>,
}

/// Computes the authentication MAC a responder sends for a challenger's nonce.
pub fn auth_mac(
    secret: &[u8],
    cluster: &str,
    challenger_nonce: &[u8; NONCE_BYTES],
    responder_nonce: &[u8; NONCE_BYTES],
    responder_rank: u32,
) -> [u8; NONCE_BYTES] {
    let out = mac_state(
        secret,
        cluster,
        challenger_nonce,
        responder_nonce,
        responder_rank,
    )
    .finalize()
    .into_bytes();
    let mut a = [0u8; NONCE_BYTES];
    a.copy_from_slice(&out);
    a
}

fn mac_state(
    secret: &[u8],
    cluster: &str,
    challenger_nonce: &[u8; NONCE_BYTES],
    responder_nonce: &[u8; NONCE_BYTES],
    responder_rank: u32,
) -> Hmac<Sha256> {
    // HMAC accepts keys of any length; the expect cannot fire.
    let mut mac = Hmac::<Sha256>::new_from_slice(secret).expect("HMAC takes any key length");
    mac.update(AUTH_LABEL);
    mac.update(&[cluster.len() as u8]);
    mac.update(cluster.as_bytes());
    mac.update(challenger_nonce);
    mac.update(responder_nonce);
    mac.update(&responder_rank.to_le_bytes());
    mac
}

impl Connection {
    /// A new connection end. `expected_peer` is the rank dialled (`None` when accepting);
    /// `nonce` must be fresh random bytes; `attachment` goes into our hello. Queues our hello.
    pub fn new(
        cfg: Arc<ProtocolConfig>,
        expected_peer: Option<u32>,
        nonce: [u8; NONCE_BYTES],
        attachment: Vec<u8>,
        now: Instant,
    ) -> Self {
        let hello = Body::Hello(Hello {
            format_version: FORMAT_VERSION,
            cluster: cfg.cluster.clone(),
            rank: cfg.local_rank,
            world_size: cfg.world_size,
            recv_window_bytes: cfg.recv_window_bytes,
            auth_required: cfg.secret.is_some(),
            nonce,
            attachment,
        });
        let mut transmit = VecDeque::with_capacity(8);
        transmit.push_back(hello);
        Self {
            cfg,
            expected_peer,
            state: State::AwaitHello,
            local_nonce: nonce,
            peer: None,
            peer_nonce: [0; NONCE_BYTES],
            send_credit: 0,
            recv_outstanding: 0,
            release_pending: 0,
            started: now,
            last_rx: now,
            last_tx: now,
            heartbeat_seq: 0,
            heartbeat_queued: false,
            transmit,
            events: VecDeque::with_capacity(4),
        }
    }

    /// Whether the handshake has completed and the connection is open.
    pub fn is_established(&self) -> bool {
        self.state == State::Established
    }

    /// The error that closed the connection, if it is closed.
    pub fn close_reason(&self) -> Option<&ProtocolError> {
        match &self.state {
            State::Closed(e) => Some(e),
            _ => None,
        }
    }

    /// The peer's hello, once received.
    pub fn peer(&self) -> Option<&PeerInfo> {
        self.peer.as_ref()
    }

    /// Bytes this end may still send before it must wait for credit.
    pub fn send_credit(&self) -> u64 {
        self.send_credit
    }

    /// Bytes of application frames received and not yet released.
    pub fn recv_outstanding(&self) -> u64 {
        self.recv_outstanding
    }

    fn fail(&mut self, err: ProtocolError, notify_peer: bool) -> ProtocolError {
        if let State::Closed(e) = &self.state {
            return e.clone();
        }
        if notify_peer {
            self.transmit.clear();
            self.transmit.push_back(Body::Error(ErrorFrame {
                request_id: 0,
                code: err.wire_code(),
                message: err.to_string(),
            }));
        } else {
            self.transmit.clear();
        }
        self.state = State::Closed(err.clone());
        self.events.push_back(Event::Closed(err.clone()));
        err
    }

    /// Closes the connection locally (no frame is sent).
    pub fn close(&mut self, reason: impl Into<String>) {
        self.fail(ProtocolError::Closed(reason.into()), false);
    }

    /// Records that the transport itself failed (I/O error, peer gone).
    pub fn transport_failed(&mut self, err: ProtocolError) {
        self.fail(err, false);
    }

    /// Feeds one received, decoded frame of `frame_len` bytes.
    pub fn handle_frame(
        &mut self,
        now: Instant,
        body: &Body,
        frame_len: u64,
    ) -> Result<Disposition, ProtocolError> {
        self.last_rx = now;
        match (&self.state, body) {
            (State::Closed(e), _) => Err(e.clone()),
            (_, Body::Error(e)) if !self.is_established() => Err(self.fail(
                ProtocolError::Refused {
                    code: e.code,
                    message: e.message.clone(),
                },
                false,
            )),
            (State::AwaitHello, Body::Hello(h)) => {
                self.on_hello(h)?;
                Ok(Disposition::Consumed)
            }
            (State::AwaitAuth, Body::Auth(a)) => {
                self.on_auth(a)?;
                Ok(Disposition::Consumed)
            }
            (State::Established, Body::Heartbeat(_)) => Ok(Disposition::Consumed),
            (State::Established, Body::Credit(c)) => {
                self.send_credit = self.send_credit.saturating_add(c.bytes);
                let window = self.peer.as_ref().map_or(0, |p| p.recv_window_bytes);
                if self.send_credit > window {
                    // More credit than the window: a broken peer; cap instead of trusting it.
                    self.send_credit = window;
                }
                Ok(Disposition::Consumed)
            }
            (State::Established, b) if b.kind().is_application() => {
                self.recv_outstanding = self.recv_outstanding.saturating_add(frame_len);
                if self.recv_outstanding > self.cfg.recv_window_bytes {
                    let err = ProtocolError::CreditViolation {
                        outstanding: self.recv_outstanding,
                        window: self.cfg.recv_window_bytes,
                    };
                    return Err(self.fail(err, true));
                }
                Ok(Disposition::Deliver)
            }
            (state, b) => {
                let where_ = match state {
                    State::AwaitHello => "before the peer's hello",
                    State::AwaitAuth => "while waiting for authentication",
                    _ => "after the handshake",
                };
                Err(self.fail(
                    ProtocolError::UnexpectedFrame {
                        kind: b.kind(),
                        state: where_,
                    },
                    true,
                ))
            }
        }
    }

    fn on_hello(&mut self, h: &Hello) -> Result<(), ProtocolError> {
        if h.format_version != FORMAT_VERSION {
            return Err(self.fail(
                ProtocolError::VersionMismatch {
                    theirs: h.format_version,
                },
                true,
            ));
        }
        if h.cluster != self.cfg.cluster {
            let e = ProtocolError::ClusterMismatch {
                ours: self.cfg.cluster.clone(),
                theirs: h.cluster.clone(),
            };
            return Err(self.fail(e, true));
        }
        if let Some(expected) = self.expected_peer
            && h.rank != expected
        {
            return Err(self.fail(
                ProtocolError::UnexpectedRank {
                    expected,
                    got: h.rank,
                },
                true,
            ));
        }
        let client_ok = h.rank == CLIENT_RANK && self.cfg.accept_clients;
        let server_ok = self.cfg.local_rank == CLIENT_RANK && h.rank < h.world_size;
        if !client_ok
            && !server_ok
            && (h.rank >= self.cfg.world_size || h.rank == self.cfg.local_rank)
        {
            return Err(self.fail(
                ProtocolError::BadRank {
                    rank: h.rank,
                    world_size: self.cfg.world_size,
                },
                true,
            ));
        }
        if !client_ok && !server_ok && h.world_size != self.cfg.world_size {
            return Err(self.fail(
                ProtocolError::Config(format!(
                    "rank {} is configured for {} ranks, this node for {}; use the same rank list everywhere",
                    h.rank, h.world_size, self.cfg.world_size
                )),
                true,
            ));
        }
        if h.auth_required && self.cfg.secret.is_none() {
            return Err(self.fail(
                ProtocolError::AuthFailed(format!(
                    "rank {} requires a shared secret and none is configured here",
                    h.rank
                )),
                true,
            ));
        }
        if h.recv_window_bytes < self.cfg.codec.max_frame_bytes as u64 {
            return Err(self.fail(
                ProtocolError::Config(format!(
                    "peer's receive window {} is smaller than max_frame_bytes {}",
                    h.recv_window_bytes, self.cfg.codec.max_frame_bytes
                )),
                true,
            ));
        }
        self.peer_nonce = h.nonce;
        self.peer = Some(PeerInfo {
            rank: h.rank,
            recv_window_bytes: h.recv_window_bytes,
            attachment: h.attachment.clone(),
        });
        let mac = self.cfg.secret.as_ref().map(|s| {
            auth_mac(
                s,
                &self.cfg.cluster,
                &h.nonce,
                &self.local_nonce,
                self.cfg.local_rank,
            )
        });
        self.transmit.push_back(Body::Auth(Auth { mac }));
        self.state = State::AwaitAuth;
        Ok(())
    }

    fn on_auth(&mut self, a: &Auth) -> Result<(), ProtocolError> {
        let Some(peer) = self.peer.clone() else {
            return Err(self.fail(
                ProtocolError::UnexpectedFrame {
                    kind: FrameKind::Auth,
                    state: "before the peer's hello",
                },
                true,
            ));
        };
        if let Some(secret) = self.cfg.secret.clone() {
            let Some(mac) = a.mac else {
                return Err(self.fail(
                    ProtocolError::AuthFailed(format!(
                        "rank {} sent no authentication but this node requires a shared secret",
                        peer.rank
                    )),
                    true,
                ));
            };
            let state = mac_state(
                &secret,
                &self.cfg.cluster,
                &self.local_nonce,
                &self.peer_nonce,
                peer.rank,
            );
            // Constant-time comparison.
            if state.verify_slice(&mac).is_err() {
                return Err(self.fail(
                    ProtocolError::AuthFailed(format!(
                        "rank {} answered the challenge with a wrong MAC (different shared secret?)",
                        peer.rank
                    )),
                    true,
                ));
            }
        }
        self.send_credit = peer.recv_window_bytes;
        self.state = State::Established;
        self.events.push_back(Event::Established(peer));
        Ok(())
    }

    /// Takes `frame_len` bytes of send credit for an application frame. `Ok(false)`: wait for
    /// credit (retry after the next received frame); `Err`: the connection is closed or the frame
    /// can never fit.
    pub fn try_reserve(&mut self, frame_len: u64) -> Result<bool, ProtocolError> {
        match &self.state {
            State::Closed(e) => return Err(e.clone()),
            State::Established => {}
            _ => {
                return Err(ProtocolError::Closed(
                    "connection not established yet".into(),
                ));
            }
        }
        let window = self.peer.as_ref().map_or(0, |p| p.recv_window_bytes);
        if frame_len > window {
            return Err(ProtocolError::FrameExceedsWindow {
                len: frame_len,
                window,
            });
        }
        if self.send_credit >= frame_len {
            self.send_credit -= frame_len;
            Ok(true)
        } else {
            Ok(false)
        }
    }

    /// Returns credit taken by [`Self::try_reserve`] for a frame that was not sent after all.
    pub fn unreserve(&mut self, frame_len: u64) {
        self.send_credit = self.send_credit.saturating_add(frame_len);
    }

    /// The application is done with a delivered frame of `frame_len` bytes; may queue a
    /// [`Credit`] frame.
    pub fn release(&mut self, frame_len: u64) {
        self.recv_outstanding = self.recv_outstanding.saturating_sub(frame_len);
        if !self.is_established() {
            return;
        }
        self.release_pending += frame_len;
        if self.release_pending >= self.cfg.recv_window_bytes / 4 {
            self.transmit.push_back(Body::Credit(Credit {
                bytes: self.release_pending,
            }));
            self.release_pending = 0;
        }
    }

    /// The next protocol frame to send (hello, auth, credit, heartbeat, or an error before
    /// closing). Application frames are sent by the driver directly after [`Self::try_reserve`].
    pub fn poll_transmit(&mut self) -> Option<Body> {
        let b = self.transmit.pop_front();
        if matches!(b, Some(Body::Heartbeat(_))) {
            self.heartbeat_queued = false;
        }
        b
    }

    /// Whether protocol frames are waiting in [`Self::poll_transmit`].
    pub fn has_transmit(&self) -> bool {
        !self.transmit.is_empty()
    }

    /// Records that a frame was written at `now` (postpones the next heartbeat).
    pub fn on_transmit(&mut self, now: Instant) {
        self.last_tx = now;
    }

    /// The next event.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// When [`Self::handle_timeout`] must next be called.
    pub fn poll_timeout(&self) -> Option<Instant> {
        match self.state {
            State::Closed(_) => None,
            State::AwaitHello | State::AwaitAuth => Some(self.started + self.cfg.handshake_timeout),
            State::Established => Some(
                (self.last_tx + self.cfg.heartbeat_interval)
                    .min(self.last_rx + self.cfg.idle_timeout),
            ),
        }
    }

    /// Advances timers to `now`: handshake deadline, idle timeout, heartbeats.
    pub fn handle_timeout(&mut self, now: Instant) {
        match self.state {
            State::Closed(_) => {}
            State::AwaitHello | State::AwaitAuth => {
                if now >= self.started + self.cfg.handshake_timeout {
                    self.fail(
                        ProtocolError::HandshakeTimeout(self.cfg.handshake_timeout),
                        false,
                    );
                }
            }
            State::Established => {
                let idle = now.saturating_duration_since(self.last_rx);
                if idle >= self.cfg.idle_timeout {
                    self.fail(ProtocolError::IdleTimeout(idle), false);
                    return;
                }
                if now.saturating_duration_since(self.last_tx) >= self.cfg.heartbeat_interval
                    && !self.heartbeat_queued
                {
                    self.heartbeat_seq += 1;
                    let us = now.saturating_duration_since(self.started).as_micros() as u64;
                    self.transmit.push_back(Body::Heartbeat(Heartbeat {
                        seq: self.heartbeat_seq,
                        sent_at_us: us,
                    }));
                    self.heartbeat_queued = true;
                    // Count the heartbeat as sent now, so the timer does not fire again at once.
                    self.last_tx = now;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::{ExpertResult, OutputLayout};
    use crate::dtype::OutputDtype;

    fn cfg(rank: u32, secret: Option<&[u8]>) -> Arc<ProtocolConfig> {
        let mut c = ProtocolConfig::new("test", rank, 4);
        c.secret = secret.map(Arc::from);
        c.recv_window_bytes = 1 << 20;
        c.codec.max_frame_bytes = 256 << 10;
        c.validate().unwrap();
        Arc::new(c)
    }

    /// Shuttles protocol frames between two ends until both are quiet.
    fn pump(a: &mut Connection, b: &mut Connection, now: Instant) -> Result<(), ProtocolError> {
        loop {
            let mut moved = false;
            while let Some(f) = a.poll_transmit() {
                moved = true;
                b.handle_frame(now, &f, 64)?;
            }
            while let Some(f) = b.poll_transmit() {
                moved = true;
                a.handle_frame(now, &f, 64)?;
            }
            if !moved {
                return Ok(());
            }
        }
    }

    fn pair(
        sa: Option<&[u8]>,
        sb: Option<&[u8]>,
    ) -> (Connection, Connection, Result<(), ProtocolError>) {
        let now = Instant::now();
        let mut a = Connection::new(cfg(0, sa), Some(1), [1; 32], vec![], now);
        let mut b = Connection::new(cfg(1, sb), None, [2; 32], vec![7], now);
        let r = pump(&mut a, &mut b, now);
        (a, b, r)
    }

    #[test]
    fn handshake_with_matching_secret_establishes() {
        let (mut a, mut b, r) = pair(Some(b"s3cret"), Some(b"s3cret"));
        r.unwrap();
        assert!(a.is_established() && b.is_established());
        assert_eq!(
            a.poll_event().unwrap(),
            Event::Established(PeerInfo {
                rank: 1,
                recv_window_bytes: 1 << 20,
                attachment: vec![7]
            })
        );
        assert!(matches!(b.poll_event(), Some(Event::Established(p)) if p.rank == 0));
        assert_eq!(a.send_credit(), 1 << 20);
    }

    #[test]
    fn wrong_secret_is_refused_on_both_sides() {
        let (a, b, r) = pair(Some(b"one"), Some(b"two"));
        assert!(
            matches!(
                r,
                Err(ProtocolError::AuthFailed(_))
                    | Err(ProtocolError::Refused {
                        code: ErrorCode::AuthFailed,
                        ..
                    })
            ),
            "{r:?}"
        );
        assert!(!a.is_established() || !b.is_established());
        let reasons = [a.close_reason(), b.close_reason()];
        assert!(
            reasons
                .iter()
                .flatten()
                .any(|e| matches!(e, ProtocolError::AuthFailed(m) if m.contains("wrong MAC"))),
            "{reasons:?}"
        );
    }

    #[test]
    fn missing_secret_is_refused() {
        let (_a, b, r) = pair(None, Some(b"two"));
        assert!(r.is_err());
        assert!(!b.is_established());
    }

    #[test]
    fn credit_window_bounds_sends_and_is_returned() {
        let (mut a, mut b, r) = pair(None, None);
        r.unwrap();
        let now = Instant::now();
        let frame = 100 << 10;
        let body = Body::Result(ExpertResult {
            request_id: 1,
            layer: 0,
            micro_batch: 0,
            layout: OutputLayout::PerSlot,
            rows: 0,
            hidden: 0,
            dtype: OutputDtype::F32,
        });
        let mut sent = 0;
        while a.try_reserve(frame).unwrap() {
            assert_eq!(
                b.handle_frame(now, &body, frame).unwrap(),
                Disposition::Deliver
            );
            sent += 1;
        }
        assert_eq!(
            sent,
            (1 << 20) / frame,
            "window admits exactly floor(W / len) frames"
        );
        assert_eq!(b.recv_outstanding(), sent * frame);
        // A frame beyond the window is a violation.
        let err = b.handle_frame(now, &body, frame).unwrap_err();
        assert!(matches!(err, ProtocolError::CreditViolation { .. }));
        // Fresh pair: releasing returns credit.
        let (mut a, mut b, _) = pair(None, None);
        while a.try_reserve(frame).unwrap() {
            b.handle_frame(now, &body, frame).unwrap();
        }
        for _ in 0..3 {
            b.release(frame);
        }
        let credit = b.poll_transmit().expect("credit after W/4 released");
        a.handle_frame(now, &credit, 64).unwrap();
        assert!(a.try_reserve(frame).unwrap());
    }

    #[test]
    fn heartbeats_and_idle_timeout() {
        let (mut a, _b, r) = pair(None, None);
        r.unwrap();
        let t0 = Instant::now();
        a.handle_timeout(t0 + Duration::from_millis(1100));
        assert!(matches!(a.poll_transmit(), Some(Body::Heartbeat(_))));
        a.handle_timeout(t0 + Duration::from_secs(11));
        assert!(matches!(
            a.close_reason(),
            Some(ProtocolError::IdleTimeout(_))
        ));
    }

    #[test]
    fn world_size_mismatch_is_refused() {
        let now = Instant::now();
        let mut a = Connection::new(cfg(0, None), Some(1), [1; 32], vec![], now);
        let mut other = ProtocolConfig::new("test", 1, 5);
        other.recv_window_bytes = 1 << 20;
        other.codec.max_frame_bytes = 256 << 10;
        let mut b = Connection::new(Arc::new(other), None, [2; 32], vec![], now);
        let r = pump(&mut a, &mut b, now);
        assert!(
            matches!(r, Err(ProtocolError::Config(ref m)) if m.contains("ranks")),
            "{r:?}"
        );
    }

    #[test]
    fn data_before_handshake_is_rejected() {
        let now = Instant::now();
        let mut a = Connection::new(cfg(0, None), None, [1; 32], vec![], now);
        let body = Body::Credit(Credit { bytes: 5 });
        assert!(a.handle_frame(now, &body, 64).is_err());
        assert!(matches!(a.poll_transmit(), Some(Body::Error(_))));
    }
}
