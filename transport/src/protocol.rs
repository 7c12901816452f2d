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
//! 32-byte nonce, whether they authenticate, the link they ask for, the sender process's
//! incarnation, the fingerprint of what its rank serves, and a frontend's name). Before the
//! peer has authenticated, a frame larger than [`PRE_AUTH_MAX_FRAME_BYTES`] is refused. On the
//! peer's hello each end checks cluster, version, rank and (when
//! [`ProtocolConfig::peer_fingerprints`] is set) that the peer serves the model, weights and
//! experts expected of its rank, then looks up the key it shares with the rank or frontend the
//! peer claims ([`Credentials`](crate::crypto::Credentials): a rank holds a key only for pairs
//! that include itself, a router derives its frontends' keys) and answers with [`Auth`]:
//! `HMAC-SHA256(key, "expertmesh-auth-v2" ‖ role ‖ transcript)`, the transcript being a hash
//! of both hellos ([`crypto::transcript`]). A peer that claims a rank without holding that
//! rank's key cannot produce the MAC. Without credentials on both ends the answer is empty
//! (insecure mode); one end with credentials refuses a peer without. The connection is
//! established when the peer's answer verifies; from each end's own [`Auth`] on, every frame
//! it sends on TCP is sealed with its direction's session key ([`Connection::session_keys`],
//! HKDF over the pair key and the transcript; see [`crypto`]). A refusal is sent as an
//! [`ErrorFrame`] with [`ErrorCode::AuthFailed`] (or `BadFrame`) before the driver closes the
//! connection, so the other side can say why.
//!
//! # Flow control
//!
//! Each end announces its receive window `W` (bytes of application frames, headers included).
//! A sender may have at most `W` bytes that the receiver's application has not yet released;
//! [`Connection::try_reserve`] takes credit before a frame is written, and the receiver returns
//! released bytes in [`Credit`] frames once at least `W/4` have accumulated. `W ≥ 2 ×
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
//! sends a [`LinkInfo`] frame (sealed) describing it, or an empty one when it cannot; the
//! peer's [`LinkInfo`] is then in [`Connection::peer_link_info`]. If either side is empty, the
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

pub use crate::codec::PRE_AUTH_MAX_FRAME_BYTES;
use crate::codec::{
    Auth, Body, CLIENT_RANK, CodecConfig, CodecError, Credit, ErrorCode, ErrorFrame,
    FINGERPRINT_BYTES, FORMAT_VERSION, FrameKind, Heartbeat, Hello, LinkInfo, NONCE_BYTES,
};
use crate::crypto::{self, Credentials, Key, Role, SessionKeys};
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Prefix of a shared-memory attachment in a hello (followed by the ring file path).
pub const SHM_ATTACHMENT: &[u8] = b"shm:";
/// Prefix of an RDMA attachment in a hello (followed by the queue pair description).
pub const RDMA_ATTACHMENT: &[u8] = b"rdma:";
/// The raw byte each end of a shared-memory link writes on the TCP connection once it has
/// mapped the peer's ring. Any byte is accepted on receipt (only its arrival matters).
pub const SHM_SYNC_BYTE: u8 = 1;

/// Which driver carries the frames of a pair of ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LinkKind {
    /// TCP (any two hosts).
    Tcp,
    /// Shared-memory rings (ranks on one host); the TCP connection stays open for the
    /// handshake and dead-peer detection.
    Shm,
    /// RoCE / InfiniBand RC queue pair (feature `rdma`); set up over the TCP connection.
    Rdma,
}

impl LinkKind {
    /// Name used in logs and reports.
    pub fn name(self) -> &'static str {
        match self {
            Self::Tcp => "tcp",
            Self::Shm => "shm",
            Self::Rdma => "rdma",
        }
    }

    /// The link a hello attachment asks for.
    pub fn of_attachment(attachment: &[u8]) -> Self {
        if attachment.starts_with(SHM_ATTACHMENT) {
            Self::Shm
        } else if attachment.starts_with(RDMA_ATTACHMENT) {
            Self::Rdma
        } else {
            Self::Tcp
        }
    }

    /// The attachment prefix of this link kind (empty for TCP).
    pub fn attachment_prefix(self) -> &'static [u8] {
        match self {
            Self::Tcp => b"",
            Self::Shm => SHM_ATTACHMENT,
            Self::Rdma => RDMA_ATTACHMENT,
        }
    }
}

impl LinkKind {
    /// Every link kind, in the order help texts list them.
    pub const ALL: [LinkKind; 3] = [LinkKind::Tcp, LinkKind::Shm, LinkKind::Rdma];
}

/// A link kind name that is not `tcp`, `shm` or `rdma`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown link kind {0:?}: give tcp, shm or rdma")]
pub struct UnknownLinkKind(pub String);

impl std::str::FromStr for LinkKind {
    type Err = UnknownLinkKind;

    /// The kind named `s` ([`LinkKind::name`]: `tcp`, `shm`, `rdma`; case-insensitive).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|k| k.name().eq_ignore_ascii_case(s.trim()))
            .ok_or_else(|| UnknownLinkKind(s.to_owned()))
    }
}

impl std::fmt::Display for LinkKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The link kind and rank a dialer's first frame asks for: the acceptor asks for the same
/// link in its hello (nothing is created before authentication). A frame that is not a hello
/// asks for TCP from rank `u32::MAX` (the handshake then refuses it).
pub fn requested_link(first: &Body) -> (LinkKind, u32) {
    match first {
        Body::Hello(h) => (LinkKind::of_attachment(&h.attachment), h.rank),
        _ => (LinkKind::Tcp, u32::MAX),
    }
}

/// The link both ends use: the one both hellos ask for, else TCP.
fn negotiate(local: LinkKind, peer_attachment: &[u8]) -> LinkKind {
    if local == LinkKind::of_attachment(peer_attachment) {
        local
    } else {
        LinkKind::Tcp
    }
}

/// Settings of one end of a connection.
#[derive(Clone)]
pub struct ProtocolConfig {
    /// Cluster name; peers of another cluster are refused.
    pub cluster: String,
    /// This end's rank ([`CLIENT_RANK`] for a frontend client).
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
    /// Whether peers announcing [`CLIENT_RANK`] (frontends) are accepted.
    pub accept_clients: bool,
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
    /// The peer's rank ([`CLIENT_RANK`] for a frontend).
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

/// The first bytes of a fingerprint in hex, for messages and logs.
pub fn short_hex(fp: &[u8; FINGERPRINT_BYTES]) -> String {
    fp[..6].iter().map(|b| format!("{b:02x}")).collect()
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
    /// Closed locally.
    #[error("connection closed locally: {0}")]
    Closed(String),
}

impl ProtocolError {
    fn wire_code(&self) -> ErrorCode {
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

/// Something that happened on the connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// Authenticated, and both hellos asked for a shared-memory or RDMA link: the driver must
    /// set up its side from the peer's attachment, then call [`Connection::link_ready`] or
    /// [`Connection::link_setup_failed`].
    LinkSetup {
        /// The link to set up.
        kind: LinkKind,
        /// The peer (its attachment describes its side of the link).
        peer: PeerInfo,
    },
    /// Handshake, authentication and any link setup completed.
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
    /// Authenticated; the shared-memory or RDMA link is being set up.
    LinkSetup(Setup),
    Established,
    Closed(ProtocolError),
}

/// Progress of the link-setup state.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Setup {
    kind: LinkKind,
    /// When link setup began (the link infos are due within the handshake timeout).
    since: Instant,
    /// This end's link info was queued (`Some(false)`: this end cannot set the link up).
    local_info: Option<bool>,
    /// The peer's link info, once received.
    peer_info: Option<Vec<u8>>,
    /// When this end finished its own setup (`None`: not yet): the peer's sync byte is due
    /// within the handshake timeout from then.
    local_ready_at: Option<Instant>,
    /// The peer's sync byte arrived.
    peer_ready: bool,
}

/// One end of one connection, without I/O.
#[derive(Debug)]
pub struct Connection {
    cfg: Arc<ProtocolConfig>,
    expected_peer: Option<u32>,
    state: State,
    peer: Option<PeerInfo>,
    send_credit: u64,
    recv_outstanding: u64,
    release_pending: u64,
    started: Instant,
    last_rx: Instant,
    last_tx: Instant,
    heartbeat_seq: u64,
    heartbeat_queued: bool,
    transmit: VecDeque<Body>,
    transmit_raw: Option<u8>,
    events: VecDeque<Event>,
    local_link: LinkKind,
    role: Role,
    local_hello_meta: Vec<u8>,
    /// The key shared with the peer, once its hello named who it is (credentials only).
    pair_key: Option<Key>,
    transcript: [u8; 32],
    session: Option<SessionKeys>,
    /// Who the peer's hello claimed to be, for refusal logs.
    claimed: Option<String>,
}

/// Who a hello claims to be, for logs ("rank 3", "frontend \"fe-1\"").
pub fn describe_claim(h: &Hello) -> String {
    if h.rank == CLIENT_RANK {
        format!("frontend {:?}", h.identity)
    } else {
        format!("rank {}", h.rank)
    }
}

impl Connection {
    /// A new connection end. `expected_peer` is the rank dialled (`None` when accepting, and
    /// for a frontend client, which serves under whichever router rank answers);
    /// `nonce` must be fresh random bytes; `attachment` goes into our hello. Queues our hello.
    pub fn new(
        cfg: Arc<ProtocolConfig>,
        expected_peer: Option<u32>,
        nonce: [u8; NONCE_BYTES],
        attachment: Vec<u8>,
        now: Instant,
    ) -> Self {
        let local_link = LinkKind::of_attachment(&attachment);
        let identity = cfg
            .credentials
            .as_ref()
            .and_then(|c| c.frontend_name())
            .filter(|_| cfg.local_rank == CLIENT_RANK)
            .unwrap_or_default()
            .to_owned();
        let hello = Hello {
            format_version: FORMAT_VERSION,
            cluster: cfg.cluster.clone(),
            rank: cfg.local_rank,
            world_size: cfg.world_size,
            recv_window_bytes: cfg.recv_window_bytes,
            auth_required: cfg.credentials.is_some(),
            nonce,
            attachment,
            incarnation: cfg.incarnation,
            fingerprint: cfg.fingerprint,
            identity,
        };
        let local_hello_meta = crate::codec::hello_meta(&hello);
        // A frontend client always dials (it takes whichever router answers).
        let role = if expected_peer.is_some() || cfg.local_rank == CLIENT_RANK {
            Role::Dialer
        } else {
            Role::Acceptor
        };
        let mut transmit = VecDeque::with_capacity(8);
        transmit.push_back(Body::Hello(hello));
        Self {
            cfg,
            expected_peer,
            state: State::AwaitHello,
            peer: None,
            send_credit: 0,
            recv_outstanding: 0,
            release_pending: 0,
            started: now,
            last_rx: now,
            last_tx: now,
            heartbeat_seq: 0,
            heartbeat_queued: false,
            transmit,
            transmit_raw: None,
            events: VecDeque::with_capacity(4),
            local_link,
            role,
            local_hello_meta,
            pair_key: None,
            transcript: [0; 32],
            session: None,
            claimed: None,
        }
    }

    /// This connection's per-direction session keys, once the peer's hello is in (with
    /// credentials only). The driver seals every frame it writes after this end's [`Auth`],
    /// and opens every frame it reads after the peer's [`Auth`], with them.
    pub fn session_keys(&self) -> Option<&SessionKeys> {
        self.session.as_ref()
    }

    /// Whether frames after `body` on the wire are sealed (it is an [`Auth`] with a MAC).
    pub fn seals_after(body: &Body) -> bool {
        matches!(body, Body::Auth(Auth { mac: Some(_) }))
    }

    /// Who the peer's hello claimed to be ("rank 3", "frontend \"fe\""), once received.
    pub fn claimed_peer(&self) -> Option<&str> {
        self.claimed.as_deref()
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
        self.transmit_raw = None;
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
        if matches!(self.state, State::AwaitHello | State::AwaitAuth)
            && frame_len > PRE_AUTH_MAX_FRAME_BYTES as u64
        {
            return Err(self.fail(ProtocolError::PreAuthTooLarge { len: frame_len }, true));
        }
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
            (State::LinkSetup(s), Body::LinkInfo(l)) if s.peer_info.is_none() => {
                self.on_link_info(l)?;
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
                    State::LinkSetup(_) => "during link setup",
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

    /// The checks a peer's hello must pass before it is answered: version, cluster, rank,
    /// world size, receive window and (when configured) the fingerprint of what it serves.
    fn check_hello(&self, h: &Hello) -> Result<(), ProtocolError> {
        if h.format_version != FORMAT_VERSION {
            return Err(ProtocolError::VersionMismatch {
                theirs: h.format_version,
            });
        }
        if h.cluster != self.cfg.cluster {
            let e = ProtocolError::ClusterMismatch {
                ours: self.cfg.cluster.clone(),
                theirs: h.cluster.clone(),
            };
            return Err(e);
        }
        if let Some(expected) = self.expected_peer
            && h.rank != expected
        {
            return Err(ProtocolError::UnexpectedRank {
                expected,
                got: h.rank,
            });
        }
        // A frontend client takes whichever router answers: a router's frontend listener
        // announces its instance as the last rank of its world. A mesh port announces the
        // whole mesh; one of a rank other than 0 (a worker's, typically) is refused here with
        // the rank it announced, so the client can say which port it reached.
        if self.cfg.local_rank == CLIENT_RANK
            && self.expected_peer.is_none()
            && h.rank != 0
            && h.rank.checked_add(1) != Some(h.world_size)
        {
            return Err(ProtocolError::UnexpectedRank {
                expected: h.world_size.saturating_sub(1),
                got: h.rank,
            });
        }
        let client_ok = h.rank == CLIENT_RANK && self.cfg.accept_clients;
        let server_ok = self.cfg.local_rank == CLIENT_RANK && h.rank < h.world_size;
        if !client_ok
            && !server_ok
            && (h.rank >= self.cfg.world_size || h.rank == self.cfg.local_rank)
        {
            return Err(ProtocolError::BadRank {
                rank: h.rank,
                world_size: self.cfg.world_size,
            });
        }
        if !client_ok && !server_ok && h.world_size != self.cfg.world_size {
            return Err(ProtocolError::Config(format!(
                "rank {} is configured for {} ranks, this node for {}; use the same rank list everywhere",
                h.rank, h.world_size, self.cfg.world_size
            )));
        }
        if h.recv_window_bytes < self.cfg.codec.max_frame_bytes as u64 {
            return Err(ProtocolError::Config(format!(
                "peer's receive window {} is smaller than max_frame_bytes {}",
                h.recv_window_bytes, self.cfg.codec.max_frame_bytes
            )));
        }
        if let Some(table) = &self.cfg.peer_fingerprints
            && let Some(expected) = table.get(h.rank as usize)
            && *expected != h.fingerprint
        {
            let e = ProtocolError::FingerprintMismatch {
                rank: h.rank,
                theirs: short_hex(&h.fingerprint),
                expected: short_hex(expected),
            };
            return Err(e);
        }
        Ok(())
    }

    fn on_hello(&mut self, h: &Hello) -> Result<(), ProtocolError> {
        self.claimed = Some(describe_claim(h));
        if let Err(e) = self.check_hello(h) {
            return Err(self.fail(e, true));
        }
        self.peer = Some(PeerInfo {
            rank: h.rank,
            recv_window_bytes: h.recv_window_bytes,
            attachment: h.attachment.clone(),
            incarnation: h.incarnation,
            identity: h.identity.clone(),
        });
        let mac = match self.peer_key(h) {
            Ok(None) => None,
            Ok(Some(key)) => {
                let peer_meta = crate::codec::hello_meta(h);
                let (d, a) = match self.role {
                    Role::Dialer => (&self.local_hello_meta, &peer_meta),
                    Role::Acceptor => (&peer_meta, &self.local_hello_meta),
                };
                self.transcript = crypto::transcript(d, a);
                self.session = Some(crypto::session_keys(&key, &self.transcript, self.role));
                let mac = crypto::auth_mac(&key, self.role, &self.transcript);
                self.pair_key = Some(key);
                Some(mac)
            }
            Err(e) => return Err(self.fail(e, true)),
        };
        self.transmit.push_back(Body::Auth(Auth { mac }));
        self.state = State::AwaitAuth;
        Ok(())
    }

    /// The key shared with the peer the hello claims to be: `Ok(None)` in insecure mode (both
    /// ends without credentials); an error when one end has credentials and the other not, or
    /// this end holds no key for the claimed rank or frontend.
    fn peer_key(&self, h: &Hello) -> Result<Option<Key>, ProtocolError> {
        let claim = describe_claim(h);
        let Some(creds) = &self.cfg.credentials else {
            if h.auth_required {
                return Err(ProtocolError::AuthFailed(format!(
                    "{claim} authenticates with credentials and this node has none; give it --credentials"
                )));
            }
            return Ok(None);
        };
        if !h.auth_required {
            return Err(ProtocolError::AuthFailed(format!(
                "{claim} runs without credentials (insecure) and this node requires authentication; give it --credentials"
            )));
        }
        let cluster = &self.cfg.cluster;
        let me = self.cfg.local_rank;
        let key = if me == CLIENT_RANK {
            let name = creds.frontend_name().unwrap_or_default();
            creds.router_key(cluster, h.rank, name)
        } else if h.rank == CLIENT_RANK {
            if h.identity.is_empty() && *creds.identity() != crypto::Identity::SharedSecret {
                return Err(ProtocolError::AuthFailed(
                    "a frontend without a name (its credential is not a frontend's)".into(),
                ));
            }
            creds.client_key(cluster, me, &h.identity)
        } else {
            creds.rank_key(cluster, me, h.rank)
        };
        key.map(Some).ok_or_else(|| {
            ProtocolError::AuthFailed(format!(
                "this node's credential holds no key for {claim} (is it the right credential for rank {me}?)"
            ))
        })
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
        if let Some(key) = self.pair_key.clone() {
            let claim = self.claimed.clone().unwrap_or_default();
            let Some(mac) = a.mac else {
                return Err(self.fail(
                    ProtocolError::AuthFailed(format!(
                        "{claim} sent no authentication but this node requires it"
                    )),
                    true,
                ));
            };
            if !crypto::verify_auth_mac(&key, self.role.peer(), &self.transcript, &mac) {
                return Err(self.fail(
                    ProtocolError::AuthFailed(format!(
                        "{claim} answered with a wrong MAC: it does not hold that identity's key (another rank's or another cluster's credential), or the handshake was tampered with"
                    )),
                    true,
                ));
            }
        }
        self.send_credit = peer.recv_window_bytes;
        let kind = negotiate(self.local_link, &peer.attachment);
        if kind == LinkKind::Tcp {
            self.state = State::Established;
            self.events.push_back(Event::Established(peer));
        } else {
            self.state = State::LinkSetup(Setup {
                kind,
                since: self.last_rx,
                local_info: None,
                peer_info: None,
                local_ready_at: None,
                peer_ready: false,
            });
            self.events.push_back(Event::LinkSetup { kind, peer });
        }
        Ok(())
    }

    /// This end has created its side of the link being set up: `attachment` describes it
    /// (the link prefix and a ring path or queue pair), or is empty when this end could not
    /// create it (the connection then carries frames over TCP). Queues a [`LinkInfo`] frame.
    pub fn link_prepared(&mut self, attachment: Vec<u8>) {
        let State::LinkSetup(s) = &mut self.state else {
            return;
        };
        if s.local_info.is_some() {
            return;
        }
        s.local_info = Some(!attachment.is_empty());
        self.transmit
            .push_back(Body::LinkInfo(LinkInfo { attachment }));
        self.maybe_tcp_fallback();
    }

    fn on_link_info(&mut self, l: &LinkInfo) -> Result<(), ProtocolError> {
        if let State::LinkSetup(s) = &mut self.state {
            let kind = s.kind;
            if !l.attachment.is_empty() && LinkKind::of_attachment(&l.attachment) != kind {
                let e = ProtocolError::Config(format!(
                    "the peer described a {} link where both asked for {}",
                    LinkKind::of_attachment(&l.attachment).name(),
                    kind.name()
                ));
                return Err(self.fail(e, true));
            }
            s.peer_info = Some(l.attachment.clone());
        }
        self.maybe_tcp_fallback();
        Ok(())
    }

    /// The peer's description of its side of the link being set up (its [`LinkInfo`]), once
    /// received and usable.
    pub fn peer_link_info(&self) -> Option<&[u8]> {
        match &self.state {
            State::LinkSetup(s) => s.peer_info.as_deref().filter(|a| !a.is_empty()),
            _ => None,
        }
    }

    /// Whether this end waits for the peer's [`LinkInfo`].
    pub fn awaits_link_info(&self) -> bool {
        matches!(&self.state, State::LinkSetup(s) if s.peer_info.is_none())
    }

    /// Either side could not set the link up: the connection is a TCP link from now on.
    fn maybe_tcp_fallback(&mut self) {
        let State::LinkSetup(s) = &self.state else {
            return;
        };
        let local_failed = s.local_info == Some(false);
        let peer_failed = s.peer_info.as_ref().is_some_and(|a| a.is_empty());
        if (local_failed && s.peer_info.is_some()) || (peer_failed && s.local_info.is_some()) {
            self.state = State::Established;
            if let Some(peer) = self.peer.clone() {
                self.events.push_back(Event::Established(peer));
            }
        }
    }

    /// The link being set up, while this end has not finished its own setup.
    pub fn pending_link(&self) -> Option<LinkKind> {
        match &self.state {
            State::LinkSetup(s) if s.local_ready_at.is_none() => Some(s.kind),
            _ => None,
        }
    }

    /// Whether the connection waits for raw setup bytes from the peer ([`Self::handle_raw`]).
    pub fn awaits_raw(&self) -> bool {
        matches!(&self.state, State::LinkSetup(s) if s.kind == LinkKind::Shm && !s.peer_ready)
    }

    /// This end has set up its side of the link (mapped the peer's ring, connected the queue
    /// pair) after both [`LinkInfo`]s were exchanged. A shared-memory link queues its sync
    /// byte; an RDMA link is established.
    pub fn link_ready(&mut self, now: Instant) {
        let State::LinkSetup(s) = &mut self.state else {
            return;
        };
        let infos_ok =
            s.local_info == Some(true) && s.peer_info.as_ref().is_some_and(|a| !a.is_empty());
        if s.local_ready_at.is_some() || !infos_ok {
            return;
        }
        s.local_ready_at = Some(now);
        if s.kind == LinkKind::Shm {
            self.transmit_raw = Some(SHM_SYNC_BYTE);
        }
        self.maybe_established();
    }

    /// This end could not set up its side of the link: closes without notifying the peer (it
    /// learns from the closed connection). The error starts with "link setup".
    pub fn link_setup_failed(&mut self, why: impl std::fmt::Display) -> ProtocolError {
        self.fail(ProtocolError::Closed(format!("link setup: {why}")), false)
    }

    /// Raw bytes to write on the stream outside any frame (the shared-memory sync byte).
    pub fn poll_transmit_raw(&mut self) -> Option<u8> {
        self.transmit_raw.take()
    }

    /// Feeds raw bytes read from the stream during link setup; returns how many were used (at
    /// most one: the peer's sync byte).
    pub fn handle_raw(&mut self, bytes: &[u8]) -> Result<usize, ProtocolError> {
        if let State::Closed(e) = &self.state {
            return Err(e.clone());
        }
        if bytes.is_empty() {
            return Ok(0);
        }
        if !self.awaits_raw() {
            let e = ProtocolError::Closed(format!(
                "{} unexpected raw bytes outside the shared-memory link setup",
                bytes.len()
            ));
            return Err(self.fail(e, false));
        }
        if let State::LinkSetup(s) = &mut self.state {
            s.peer_ready = true;
        }
        self.maybe_established();
        Ok(1)
    }

    /// Completes link setup once both ends are ready (an RDMA link needs no sync byte).
    fn maybe_established(&mut self) {
        let State::LinkSetup(s) = &self.state else {
            return;
        };
        if s.local_ready_at.is_some() && (s.peer_ready || s.kind != LinkKind::Shm) {
            self.state = State::Established;
            if let Some(peer) = self.peer.clone() {
                self.events.push_back(Event::Established(peer));
            }
        }
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
            State::LinkSetup(ref s) => {
                Some(s.local_ready_at.unwrap_or(s.since) + self.cfg.handshake_timeout)
            }
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
            State::LinkSetup(ref s) => {
                if now >= s.local_ready_at.unwrap_or(s.since) + self.cfg.handshake_timeout {
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

    #[test]
    fn every_link_kind_parses_from_its_name() {
        for k in LinkKind::ALL {
            assert_eq!(k.name().parse::<LinkKind>(), Ok(k));
            assert_eq!(k.to_string().to_uppercase().parse::<LinkKind>(), Ok(k));
        }
        let err = "ib".parse::<LinkKind>().unwrap_err();
        assert!(err.to_string().contains("tcp, shm or rdma"), "{err}");
    }

    fn cfg(rank: u32, secret: Option<&[u8]>) -> Arc<ProtocolConfig> {
        let mut c = ProtocolConfig::new("test", rank, 4);
        c.credentials = secret.map(|s| Arc::new(Credentials::shared_secret(s)));
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
                attachment: vec![7],
                incarnation: 0,
                identity: String::new(),
            })
        );
        assert!(matches!(b.poll_event(), Some(Event::Established(p)) if p.rank == 0));
        assert_eq!(a.send_credit(), 1 << 20);
    }

    /// Ends whose fingerprint tables say what every rank serves: rank `r` announces
    /// `[r + own_offset; 32]`, and each end expects `[r; 32]` of rank `r`.
    fn fingerprinted(rank: u32, own_offset: u8, incarnation: u64) -> Arc<ProtocolConfig> {
        let mut c = (*cfg(rank, Some(b"s"))).clone();
        c.fingerprint = [rank as u8 + own_offset; 32];
        c.incarnation = incarnation;
        c.peer_fingerprints = Some((0..4u8).map(|r| [r; 32]).collect());
        Arc::new(c)
    }

    #[test]
    fn matching_fingerprints_establish_and_carry_the_incarnation() {
        let now = Instant::now();
        let mut a = Connection::new(fingerprinted(0, 0, 11), Some(1), [1; 32], vec![], now);
        let mut b = Connection::new(fingerprinted(1, 0, 22), None, [2; 32], vec![], now);
        pump(&mut a, &mut b, now).unwrap();
        assert!(matches!(a.poll_event(), Some(Event::Established(p)) if p.incarnation == 22));
        assert!(matches!(b.poll_event(), Some(Event::Established(p)) if p.incarnation == 11));
    }

    #[test]
    fn a_rank_serving_other_weights_is_refused_on_both_sides() {
        let now = Instant::now();
        // Rank 1 announces [2; 32] where everyone expects [1; 32] (another seed or placement).
        let mut a = Connection::new(fingerprinted(0, 0, 1), Some(1), [1; 32], vec![], now);
        let mut b = Connection::new(fingerprinted(1, 1, 2), None, [2; 32], vec![], now);
        let r = pump(&mut a, &mut b, now);
        assert!(r.is_err(), "a mismatched rank must not establish");
        assert!(!a.is_established() && !b.is_established());
        let ea = a.close_reason().expect("rank 0 closed").to_string();
        assert!(ea.contains("rank 1 serves other weights"), "{ea}");
        assert!(ea.contains("020202") && ea.contains("010101"), "{ea}");
        // The refused side learns why from the refusal frame rank 0 queued.
        let refusal = a.poll_transmit().expect("a refusal frame");
        let Body::Error(e) = &refusal else {
            panic!("expected an error frame, got {refusal:?}")
        };
        b.handle_frame(now, &refusal, 0).ok();
        let eb = b.close_reason().expect("rank 1 closed").to_string();
        assert!(eb.contains("serves other weights"), "{eb} / {}", e.message);
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
            batch_id: 1,
            layer: 0,
            part: 0,
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

    /// Handshakes two ends whose hellos carry `att_a` and `att_b`.
    fn pair_with(att_a: &[u8], att_b: &[u8], now: Instant) -> (Connection, Connection) {
        let mut a = Connection::new(cfg(0, Some(b"k")), Some(1), [1; 32], att_a.to_vec(), now);
        let mut b = Connection::new(cfg(1, Some(b"k")), None, [2; 32], att_b.to_vec(), now);
        pump(&mut a, &mut b, now).unwrap();
        (a, b)
    }

    /// Both ends create their side after authentication and swap link infos.
    fn exchange_infos(a: &mut Connection, b: &mut Connection, ia: &[u8], ib: &[u8], now: Instant) {
        a.link_prepared(ia.to_vec());
        b.link_prepared(ib.to_vec());
        pump(a, b, now).unwrap();
    }

    #[test]
    fn shm_link_setup_exchanges_one_sync_byte_each_way() {
        let t0 = Instant::now();
        let (mut a, mut b) = pair_with(b"shm:", b"shm:", t0);
        for c in [&mut a, &mut b] {
            match c.poll_event() {
                Some(Event::LinkSetup { kind, peer }) => {
                    assert_eq!(kind, LinkKind::Shm);
                    assert_eq!(peer.attachment, b"shm:", "the hello only asks for the link");
                }
                other => panic!("expected LinkSetup, got {other:?}"),
            }
            assert!(!c.is_established() && c.pending_link() == Some(LinkKind::Shm));
            assert_eq!(c.poll_timeout(), Some(t0 + Duration::from_secs(5)));
            assert!(
                c.try_reserve(64).is_err(),
                "no application frames before the link is up"
            );
            assert!(c.awaits_link_info() && c.peer_link_info().is_none());
            c.link_ready(t0);
            assert_eq!(
                c.poll_transmit_raw(),
                None,
                "not ready before the link infos"
            );
        }
        exchange_infos(&mut a, &mut b, b"shm:/dev/shm/a", b"shm:/dev/shm/b", t0);
        assert_eq!(a.peer_link_info(), Some(&b"shm:/dev/shm/b"[..]));
        assert_eq!(b.peer_link_info(), Some(&b"shm:/dev/shm/a"[..]));
        // a finishes first: it owes its sync byte and waits for b's.
        a.link_ready(t0);
        assert_eq!(a.poll_transmit_raw(), Some(SHM_SYNC_BYTE));
        assert_eq!(a.poll_transmit_raw(), None);
        assert!(a.awaits_raw() && a.pending_link().is_none());
        assert_eq!(a.poll_timeout(), Some(t0 + Duration::from_secs(5)));
        // a's byte reaches b before b has mapped a's ring: b remembers it.
        assert_eq!(b.handle_raw(&[SHM_SYNC_BYTE, 9]).unwrap(), 1);
        assert!(!b.is_established());
        b.link_ready(t0);
        assert_eq!(b.poll_transmit_raw(), Some(SHM_SYNC_BYTE));
        assert!(b.is_established());
        assert!(matches!(b.poll_event(), Some(Event::Established(p)) if p.rank == 0));
        assert_eq!(a.handle_raw(&[SHM_SYNC_BYTE]).unwrap(), 1);
        assert!(a.is_established());
        assert!(matches!(a.poll_event(), Some(Event::Established(p)) if p.rank == 1));
        assert!(a.try_reserve(64).unwrap());
        // After setup a raw byte is a protocol violation.
        assert!(a.handle_raw(&[1]).is_err());
    }

    #[test]
    fn a_side_that_cannot_create_its_ring_makes_both_use_tcp() {
        let t0 = Instant::now();
        for (ia, ib) in [(&b""[..], &b"shm:/b"[..]), (b"shm:/a", b"")] {
            let (mut a, mut b) = pair_with(b"shm:", b"shm:", t0);
            exchange_infos(&mut a, &mut b, ia, ib, t0);
            for c in [&mut a, &mut b] {
                assert!(c.is_established(), "{ia:?} / {ib:?}");
                assert!(matches!(c.poll_event(), Some(Event::LinkSetup { .. })));
                assert!(matches!(c.poll_event(), Some(Event::Established(_))));
                assert_eq!(c.poll_transmit_raw(), None, "no sync byte on TCP");
            }
        }
        // A description of another link kind is a protocol violation.
        let (mut a, mut b) = pair_with(b"shm:", b"shm:", t0);
        a.link_prepared(b"shm:/a".to_vec());
        b.link_prepared(b"rdma:x".to_vec());
        assert!(pump(&mut a, &mut b, t0).is_err());
        assert!(
            a.close_reason()
                .is_some_and(|e| e.to_string().contains("rdma link"))
        );
    }

    #[test]
    fn link_kind_falls_back_to_tcp_unless_both_hellos_agree() {
        let now = Instant::now();
        for (x, y) in [
            (&b"shm:"[..], &b""[..]),
            (b"", b"shm:"),
            (b"rdma:", b"shm:"),
            (b"", b""),
        ] {
            let (mut a, mut b) = pair_with(x, y, now);
            assert!(a.is_established() && b.is_established(), "{x:?} / {y:?}");
            assert!(matches!(a.poll_event(), Some(Event::Established(_))));
            assert_eq!(a.pending_link(), None);
            assert_eq!(b.poll_transmit_raw(), None);
        }
        assert_eq!(LinkKind::of_attachment(b"rdma:x"), LinkKind::Rdma);
        let hello = |att: &[u8]| {
            let mut c = Connection::new(cfg(2, None), None, [0; 32], att.to_vec(), now);
            c.poll_transmit().unwrap()
        };
        assert_eq!(requested_link(&hello(b"shm:")), (LinkKind::Shm, 2));
        assert_eq!(requested_link(&hello(b"")), (LinkKind::Tcp, 2));
        let credit = Body::Credit(Credit { bytes: 1 });
        assert_eq!(requested_link(&credit), (LinkKind::Tcp, u32::MAX));
    }

    #[test]
    fn rdma_link_setup_needs_no_sync_byte() {
        let now = Instant::now();
        let (mut a, mut b) = pair_with(b"rdma:", b"rdma:", now);
        assert!(matches!(
            a.poll_event(),
            Some(Event::LinkSetup {
                kind: LinkKind::Rdma,
                ..
            })
        ));
        exchange_infos(&mut a, &mut b, b"rdma:qp-a", b"rdma:qp-b", now);
        assert!(!a.awaits_raw());
        a.link_ready(now);
        assert_eq!(a.poll_transmit_raw(), None);
        assert!(a.is_established());
        assert!(matches!(a.poll_event(), Some(Event::Established(_))));
    }

    #[test]
    fn link_setup_times_out_or_fails_without_a_frame() {
        let t0 = Instant::now();
        let (mut a, mut b) = pair_with(b"shm:", b"shm:", t0);
        exchange_infos(&mut a, &mut b, b"shm:/a", b"shm:/b", t0);
        a.link_ready(t0);
        a.handle_timeout(t0 + Duration::from_millis(4999));
        assert!(a.close_reason().is_none());
        a.handle_timeout(t0 + Duration::from_secs(5));
        assert!(matches!(
            a.close_reason(),
            Some(ProtocolError::HandshakeTimeout(_))
        ));
        assert_eq!(
            a.poll_transmit_raw(),
            None,
            "a closed connection sends no sync byte"
        );
        assert!(a.handle_raw(&[1]).is_err());

        let (mut b, _a) = pair_with(b"shm:", b"shm:", t0);
        let e = b.link_setup_failed("cannot map ring");
        assert!(matches!(e, ProtocolError::Closed(ref m) if m == "link setup: cannot map ring"));
        assert!(
            b.poll_transmit().is_none(),
            "the peer learns from the closed connection"
        );
        assert!(b.poll_transmit_raw().is_none());
        // A frame during link setup is refused.
        let (mut c, _d) = pair_with(b"shm:", b"shm:", t0);
        let hb = Body::Heartbeat(Heartbeat {
            seq: 1,
            sent_at_us: 0,
        });
        let err = c.handle_frame(t0, &hb, 64).unwrap_err();
        assert!(matches!(
            err,
            ProtocolError::UnexpectedFrame {
                state: "during link setup",
                ..
            }
        ));
    }

    #[test]
    fn data_before_handshake_is_rejected() {
        let now = Instant::now();
        let mut a = Connection::new(cfg(0, None), None, [1; 32], vec![], now);
        let body = Body::Credit(Credit { bytes: 5 });
        assert!(a.handle_frame(now, &body, 64).is_err());
        assert!(matches!(a.poll_transmit(), Some(Body::Error(_))));
    }

    // ----- Identity, transcript binding and pre-auth bounds -----

    fn master(b: u8) -> Key {
        Key::from_bytes([b; 32])
    }

    /// An end of cluster "test" (4 ranks, rank 0 the router) holding `creds`.
    fn with_creds(rank: u32, creds: Option<Credentials>) -> Arc<ProtocolConfig> {
        let mut c = (*cfg(rank, None)).clone();
        c.credentials = creds.map(Arc::new);
        c.accept_clients = rank == 0;
        Arc::new(c)
    }

    fn issued(m: &Key, rank: u32) -> Credentials {
        Credentials::issue_rank(m, "test", rank, 4, 1)
    }

    /// Dialer `a` (expecting rank 0) against acceptor `b`.
    fn handshake(
        a: Arc<ProtocolConfig>,
        b: Arc<ProtocolConfig>,
    ) -> (Connection, Connection, Result<(), ProtocolError>) {
        let now = Instant::now();
        let mut a = Connection::new(a, Some(0), [1; 32], vec![], now);
        let mut b = Connection::new(b, None, [2; 32], vec![], now);
        let r = pump_each(&mut a, &mut b, now);
        (a, b, r)
    }

    /// Moves one frame at a time each way (as drivers do: each end answers before it reads
    /// on), ignoring failures, until both ends are quiet; `Err` if either end closed.
    fn pump_each(
        a: &mut Connection,
        b: &mut Connection,
        now: Instant,
    ) -> Result<(), ProtocolError> {
        loop {
            let mut moved = false;
            if let Some(f) = a.poll_transmit() {
                moved = true;
                let _ = b.handle_frame(now, &f, 64);
            }
            if let Some(f) = b.poll_transmit() {
                moved = true;
                let _ = a.handle_frame(now, &f, 64);
            }
            if !moved {
                break;
            }
        }
        match (a.close_reason(), b.close_reason()) {
            (Some(e), _) | (_, Some(e)) => Err(e.clone()),
            _ => Ok(()),
        }
    }

    fn auth_failure(c: &Connection) -> String {
        match c.close_reason() {
            Some(ProtocolError::AuthFailed(m)) => m.clone(),
            other => panic!("expected an authentication failure, got {other:?}"),
        }
    }

    #[test]
    fn issued_credentials_authenticate_and_agree_on_session_keys() {
        let m = master(1);
        let (a, b, r) = handshake(
            with_creds(2, Some(issued(&m, 2))),
            with_creds(0, Some(issued(&m, 0))),
        );
        r.unwrap();
        assert!(a.is_established() && b.is_established());
        let (ka, kb) = (a.session_keys().unwrap(), b.session_keys().unwrap());
        assert_eq!(ka.send, kb.recv);
        assert_eq!(ka.recv, kb.send);
        // A frame sealed by one end opens at the other.
        let mut s = crypto::Sealer::new(&ka.send);
        let mut o = crypto::Opener::new(&kb.recv);
        let head = crate::codec::encode_frame(
            &Body::Credit(Credit { bytes: 3 }),
            &[],
            &CodecConfig::default(),
        )
        .unwrap();
        let mut wire = Vec::new();
        s.seal_frame(&head, &[], &mut wire).unwrap();
        assert_eq!(
            crypto::open_frame(&mut o, &wire, &CodecConfig::default())
                .unwrap()
                .0,
            head
        );
    }

    #[test]
    fn a_rank_claimed_with_another_ranks_keys_is_refused() {
        let m = master(1);
        // The holder of rank 2's file relabels it as rank 1's and claims rank 1.
        let text = issued(&m, 2).to_file_text().replace("rank = 2", "rank = 1");
        let forged = Credentials::parse(&text, "forged").unwrap();
        let (a, b, r) = handshake(
            with_creds(1, Some(forged)),
            with_creds(0, Some(issued(&m, 0))),
        );
        assert!(r.is_err() && !b.is_established() && !a.is_established());
        let why = auth_failure(&b);
        assert!(why.contains("rank 1") && why.contains("wrong MAC"), "{why}");
        // Its own file cannot act as rank 1 at all.
        let (a, _b, r) = handshake(
            with_creds(1, Some(issued(&m, 2))),
            with_creds(0, Some(issued(&m, 0))),
        );
        assert!(r.is_err());
        assert!(auth_failure(&a).contains("holds no key"));
    }

    #[test]
    fn another_clusters_key_is_refused() {
        let (_a, b, r) = handshake(
            with_creds(2, Some(issued(&master(9), 2))),
            with_creds(0, Some(issued(&master(1), 0))),
        );
        assert!(r.is_err());
        assert!(auth_failure(&b).contains("wrong MAC"));
    }

    #[test]
    fn a_frontend_credential_cannot_join_the_mesh() {
        let m = master(1);
        let fe = Credentials::issue_frontend(&m, "test", "fe", 1);
        // As a mesh rank, the frontend's credential holds no pair key.
        let (a, _b, r) = handshake(
            with_creds(2, Some(fe.clone())),
            with_creds(0, Some(issued(&m, 0))),
        );
        assert!(r.is_err());
        assert!(auth_failure(&a).contains("holds no key"));
        // Its frontend key passed off as a pair key does not verify either.
        let key_hex: String = fe
            .router_key("test", 0, "fe")
            .unwrap()
            .bytes()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        let text =
            format!("# expertmesh credential v1\ncluster = test\nrank = 2\npair 0 = {key_hex}\n");
        let forged = Credentials::parse(&text, "forged").unwrap();
        let (_a, b, r) = handshake(
            with_creds(2, Some(forged)),
            with_creds(0, Some(issued(&m, 0))),
        );
        assert!(r.is_err());
        assert!(auth_failure(&b).contains("wrong MAC"));
        // As a frontend it authenticates with the router (and only under its own name).
        let mut client = (*with_creds(CLIENT_RANK, Some(fe))).clone();
        client.world_size = 1;
        let (a, b, r) = handshake(Arc::new(client), with_creds(0, Some(issued(&m, 0))));
        r.unwrap();
        assert!(a.is_established() && b.is_established());
        assert_eq!(b.peer().unwrap().identity, "fe");
        // A worker does not accept frontends (it derives no frontend key).
        let mut worker = (*with_creds(3, Some(issued(&m, 3)))).clone();
        worker.accept_clients = true;
        let mut c2 = (*with_creds(
            CLIENT_RANK,
            Some(Credentials::issue_frontend(&m, "test", "fe", 4)),
        ))
        .clone();
        c2.world_size = 4;
        let now = Instant::now();
        let mut a = Connection::new(Arc::new(c2), Some(3), [1; 32], vec![], now);
        let mut b = Connection::new(Arc::new(worker), None, [2; 32], vec![], now);
        assert!(pump_each(&mut a, &mut b, now).is_err());
        assert!(auth_failure(&b).contains("holds no key"));
    }

    /// Runs a handshake with `tamper` applied to the acceptor's hello on its way to the dialer.
    fn tampered(tamper: impl Fn(&mut Hello)) -> (Connection, Connection) {
        let m = master(1);
        let now = Instant::now();
        let mut a = Connection::new(
            with_creds(2, Some(issued(&m, 2))),
            Some(0),
            [1; 32],
            vec![],
            now,
        );
        let mut b = Connection::new(
            with_creds(0, Some(issued(&m, 0))),
            None,
            [2; 32],
            vec![],
            now,
        );
        for _ in 0..4 {
            while let Some(f) = a.poll_transmit() {
                let _ = b.handle_frame(now, &f, 64);
            }
            while let Some(mut f) = b.poll_transmit() {
                if let Body::Hello(h) = &mut f {
                    tamper(h);
                }
                let _ = a.handle_frame(now, &f, 64);
            }
        }
        (a, b)
    }

    #[test]
    fn the_auth_mac_covers_every_hello_field() {
        let (a, b) = tampered(|_| {});
        assert!(
            a.is_established() && b.is_established(),
            "untampered handshake"
        );
        type Tamper<'a> = (&'a str, &'a dyn Fn(&mut Hello));
        let fields: [Tamper<'_>; 6] = [
            ("nonce", &|h| h.nonce[0] ^= 1),
            ("incarnation", &|h| h.incarnation ^= 1),
            ("fingerprint", &|h| h.fingerprint[5] ^= 1),
            ("window", &|h| h.recv_window_bytes += 64 << 10),
            ("link request", &|h| h.attachment = b"shm:".to_vec()),
            ("name", &|h| h.identity = "x".into()),
        ];
        for (what, f) in fields {
            let (a, b) = tampered(f);
            assert!(
                !a.is_established() && !b.is_established(),
                "tampered {what} went unnoticed"
            );
        }
    }

    #[test]
    fn credentials_on_one_side_only_are_refused() {
        let m = master(1);
        let (a, b, r) = handshake(with_creds(2, None), with_creds(0, Some(issued(&m, 0))));
        assert!(r.is_err() && !a.is_established() && !b.is_established());
        assert!(auth_failure(&b).contains("insecure"));
        let (a, b, r) = handshake(with_creds(2, Some(issued(&m, 2))), with_creds(0, None));
        assert!(r.is_err() && !a.is_established());
        assert!(auth_failure(&b).contains("this node has none"));
    }

    #[test]
    fn frames_larger_than_the_pre_auth_cap_are_refused_before_authentication() {
        let now = Instant::now();
        let mut a = Connection::new(cfg(0, Some(b"k")), None, [1; 32], vec![], now);
        let hb = Body::Heartbeat(Heartbeat {
            seq: 1,
            sent_at_us: 0,
        });
        let err = a
            .handle_frame(now, &hb, PRE_AUTH_MAX_FRAME_BYTES as u64 + 1)
            .unwrap_err();
        assert!(
            matches!(err, ProtocolError::PreAuthTooLarge { .. }),
            "{err}"
        );
        assert!(err.to_string().contains("before authentication"));
    }

    #[test]
    fn a_frontend_authenticates_with_whichever_router_answers() {
        let m = master(1);
        let fe = Credentials::issue_frontend(&m, "test", "fe", 2);
        for router in 0..2u32 {
            let mut server = (*cfg(router, None)).clone();
            server.credentials = Some(Arc::new(Credentials::issue_rank(&m, "test", router, 4, 2)));
            server.accept_clients = true;
            // As a router's frontend listener announces itself: the last rank of its world.
            server.world_size = router + 1;
            let mut client = (*cfg(CLIENT_RANK, None)).clone();
            client.world_size = 1;
            client.credentials = Some(Arc::new(fe.clone()));
            let now = Instant::now();
            let mut a = Connection::new(Arc::new(client), None, [1; 32], vec![], now);
            let mut b = Connection::new(Arc::new(server), None, [2; 32], vec![], now);
            pump_each(&mut a, &mut b, now).unwrap();
            assert!(a.is_established() && b.is_established(), "router {router}");
            assert_eq!(a.peer().unwrap().rank, router);
        }
    }
}
