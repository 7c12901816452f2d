//! Framed TCP connections for clients that are not ranks: serving frontends calling the router
//! service with [`LayerRequest`](crate::codec::LayerRequest) frames.
//!
//! Why this exists: only this crate touches sockets, so the router service and its client are
//! built on these types. They reuse the frame codec and the authenticated handshake of the mesh
//! (the client announces [`CLIENT_RANK`] and its frontend name; with credentials every frame
//! after the handshake is sealed with AES-256-GCM, see [`crypto`](crate::crypto)), but not its
//! credit window: a frontend connection is request/response and TCP's own backpressure bounds
//! it (the server reads the next request only when it is ready for it).
//!
//! Before authentication a listener holds little per connection: handshakes are limited per
//! source address and in total ([`FrontendConfig::handshake_gate`]), the first frames are
//! capped at [`PRE_AUTH_MAX_FRAME_BYTES`](crate::codec::PRE_AUTH_MAX_FRAME_BYTES), and an
//! authenticated connection reserves its buffers from [`FrontendConfig::memory_budget`]
//! (refused beyond it).
//!
//! Bad input: a frame whose header is intact but whose metadata or payload is invalid yields
//! [`FrontendError::BadFrame`] with `recoverable: true` (the server answers with an error frame
//! and goes on reading); a broken header (bad magic, checksum, oversized length) yields
//! `recoverable: false` and the connection must be closed, since the stream can no longer be
//! framed. A server-side read that stalls mid-frame past [`FrontendConfig::frame_timeout`]
//! fails, and every later read of that reader fails too (what follows is never taken for a
//! frame); [`FrameReader::shut_down`] ends the connection, and [`FrameWriter::progress`]
//! says how long a write has waited on a client that does not read.
//!
//! Layering: imports `tcp` (socket I/O and the handshake loop),
//! `link` (the buffer pool), [`protocol`](crate::protocol) and
//! [`codec`]; nothing in the crate imports it.

use crate::codec::{self, Body, CLIENT_RANK, CodecConfig, CodecError, ErrorCode, ErrorFrame};
use crate::crypto::{Credentials, IntegrityError};
use crate::link::{BufPool, random_nonce};
use crate::protocol::{Connection, ProtocolConfig, ProtocolError};
use crate::tcp::{
    Crypt, FrameIn, HandshakeGate, HandshakePermit, MemoryBudget, MemoryReservation, ReadError,
    SealBuf, handshake, log_refusal, read_frame, write_frame_sealed, write_vectored_all,
};
use expertmesh_quant::aligned::AlignedVec;
use std::net::SocketAddr;
use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};

/// Settings for frontend connections (both ends must agree on cluster, keys and codec).
#[derive(Clone, Debug)]
pub struct FrontendConfig {
    /// Cluster name.
    pub cluster: String,
    /// This end's credential: a frontend's (client) or its router's (server). `None`: no
    /// authentication and no encryption (insecure).
    pub credentials: Option<Arc<Credentials>>,
    /// Codec settings.
    pub codec: CodecConfig,
    /// Handshake deadline.
    pub handshake_timeout: Duration,
    /// Server side: the rank announced to clients (the router's instance; its frontends'
    /// keys are derived from that router's root). Clients accept any router's rank.
    pub server_rank: u32,
    /// Server side: while closed, clients are refused with the gate's reason (a fabric whose
    /// workers have not all connected yet). Open by default.
    pub gate: FrontendGate,
    /// Server side: limits on handshakes in progress (per source address and in total).
    pub handshake_gate: HandshakeGate,
    /// Server side: the bytes all authenticated connections may reserve for their buffers
    /// together; each reserves [`FrontendConfig::connection_reserve_bytes`].
    pub memory_budget: MemoryBudget,
    /// Server side: the open connections of each frontend name, capped at
    /// [`FrontendConfig::max_connections_per_frontend`] (clones share the counts), so that
    /// one frontend cannot take the whole memory budget from the others.
    pub per_frontend: FrontendConnections,
    /// Server side: most connections one frontend name may hold open at once (0: no limit).
    pub max_connections_per_frontend: u32,
    /// Server side: a connection with no request in flight that has neither sent a request
    /// nor had one answered for this long is closed (`None`: never). Heartbeats do not count.
    /// So is one whose client leaves an answer untaken this long (plus a second per
    /// [`FRAME_MIN_BYTES_PER_SECOND`] of it).
    pub idle_timeout: Option<Duration>,
    /// Server side: the frontend names whose connections may change the placement of a running
    /// fabric (`expertmesh rebalance` and `drain`), see [`FrontendConfig::may_change_placement`].
    pub placement_admins: Vec<String>,
    /// Server side: a frame begun (its header read) must arrive whole within this plus a
    /// second per [`FRAME_MIN_BYTES_PER_SECOND`] of its length ([`frame_deadline`]), or the
    /// read fails and the reader is done (`None`: no limit). A frontend that stopped
    /// mid-frame would otherwise hold its request's share of the router's capacity and its
    /// buffers for as long as its socket stays open. The router also gives each answer to a
    /// connection it no longer reads this long (plus the same per-size allowance, counted from
    /// when reading stopped) before it shuts the socket down ([`FrameReader::shut_down`]);
    /// while the connection is read, an answer waits for its client up to the idle timeout
    /// plus the same allowance ([`WriteProgress::overdue`]).
    pub frame_timeout: Option<Duration>,
}

/// Default [`FrontendConfig::frame_timeout`]: 30 seconds.
pub const DEFAULT_FRONTEND_FRAME_TIMEOUT: Duration = Duration::from_secs(30);

/// The slowest transfer [`FrontendConfig::frame_timeout`] waits for beyond its base: 16 MiB/s
/// (a 64 MiB frame gets 4 more seconds).
pub const FRAME_MIN_BYTES_PER_SECOND: u64 = 16 << 20;

/// How long a frame of `bytes` may take to arrive or to be taken: `base` plus a second per
/// [`FRAME_MIN_BYTES_PER_SECOND`].
pub fn frame_deadline(base: Duration, bytes: usize) -> Duration {
    base + Duration::from_secs_f64(bytes as f64 / FRAME_MIN_BYTES_PER_SECOND as f64)
}

/// Default [`FrontendConfig::placement_admins`]: the frontend named "admin" (`expertmesh keys
/// issue --frontend admin` issues its credential).
pub const DEFAULT_PLACEMENT_ADMIN: &str = "admin";

/// Default [`FrontendConfig::memory_budget`]: 8 GiB.
pub const DEFAULT_FRONTEND_MEMORY_BUDGET: u64 = 8 << 30;
/// Default [`FrontendConfig::max_connections_per_frontend`]: 32 (with 64 MiB frames each
/// reserves 128 MiB, so one frontend holds at most half of the default budget and the others
/// always have the other half).
pub const DEFAULT_MAX_CONNECTIONS_PER_FRONTEND: u32 = 32;
/// Default [`FrontendConfig::idle_timeout`]: 5 minutes.
pub const DEFAULT_FRONTEND_IDLE_TIMEOUT: Duration = Duration::from_secs(300);

/// The open connections of each frontend name on one listener. Clones share the counts.
#[derive(Clone, Debug, Default)]
pub struct FrontendConnections(Arc<Mutex<std::collections::HashMap<String, u32>>>);

impl FrontendConnections {
    /// Counts a new connection of frontend `name`, or says why not (`limit` 0: no limit).
    pub fn open(&self, name: &str, limit: u32) -> Result<FrontendConnectionSlot, String> {
        let mut m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let n = m.entry(name.to_owned()).or_insert(0);
        if limit > 0 && *n >= limit {
            let who = if name.is_empty() {
                "frontends without a name (no credentials)".to_owned()
            } else {
                format!("frontend {name:?}")
            };
            return Err(format!(
                "{n} connections of {who} are already open to this router, the most one \
                 frontend may hold (router --max-connections-per-frontend); close idle ones or \
                 share fewer among more calls"
            ));
        }
        *n += 1;
        Ok(FrontendConnectionSlot {
            counts: self.clone(),
            name: name.to_owned(),
        })
    }

    /// Open connections of frontend `name`.
    pub fn count(&self, name: &str) -> u32 {
        let m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        m.get(name).copied().unwrap_or(0)
    }
}

/// One counted connection of a frontend; dropping it frees its place.
#[derive(Debug)]
pub struct FrontendConnectionSlot {
    counts: FrontendConnections,
    name: String,
}

impl Drop for FrontendConnectionSlot {
    fn drop(&mut self) {
        let mut m = self.counts.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = m.get_mut(&self.name) {
            *n -= 1;
            if *n == 0 {
                m.remove(&self.name);
            }
        }
    }
}

/// Whether a frontend listener lets clients in. Clones share one state.
#[derive(Clone, Debug, Default)]
pub struct FrontendGate(Arc<Mutex<Option<String>>>);

impl FrontendGate {
    /// A gate that refuses clients with `reason` until [`FrontendGate::open`].
    pub fn closed(reason: impl Into<String>) -> Self {
        Self(Arc::new(Mutex::new(Some(reason.into()))))
    }

    /// Refuse clients from now on with `reason`.
    pub fn close(&self, reason: impl Into<String>) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(reason.into());
    }

    /// Let clients in.
    pub fn open(&self) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }

    /// Why clients are refused now (`None`: open).
    pub fn reason(&self) -> Option<String> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

impl FrontendConfig {
    /// Defaults for `cluster`: no credentials, 64 MiB frames, 5 s handshake, 8 handshakes per
    /// source address and 64 in all, an 8 GiB connection memory budget, 32 connections per
    /// frontend name, idle connections closed after 5 minutes, placement changes from frontend
    /// "admin" only (where frontends are authenticated), 30 s for a frame begun.
    pub fn new(cluster: impl Into<String>) -> Self {
        Self {
            cluster: cluster.into(),
            credentials: None,
            codec: CodecConfig {
                max_frame_bytes: 64 << 20,
                payload_checksum: false,
            },
            handshake_timeout: Duration::from_secs(5),
            server_rank: 0,
            gate: FrontendGate::default(),
            handshake_gate: HandshakeGate::default(),
            memory_budget: MemoryBudget::new(DEFAULT_FRONTEND_MEMORY_BUDGET),
            per_frontend: FrontendConnections::default(),
            max_connections_per_frontend: DEFAULT_MAX_CONNECTIONS_PER_FRONTEND,
            idle_timeout: Some(DEFAULT_FRONTEND_IDLE_TIMEOUT),
            placement_admins: vec![DEFAULT_PLACEMENT_ADMIN.to_owned()],
            frame_timeout: Some(DEFAULT_FRONTEND_FRAME_TIMEOUT),
        }
    }

    /// Server side: whether the connection of frontend `name` (the name this server's handshake
    /// authenticated) may change the placement. With credentials only the frontends named in
    /// [`FrontendConfig::placement_admins`] may: serving frontends cannot move experts. Without
    /// credentials nothing is authenticated (loopback, or `--insecure`, where anyone who reaches
    /// the ports can also join the mesh), so every connection may. With the legacy shared secret
    /// the name is checked but only claimed (any holder can claim any name, as its start-up
    /// warning says).
    pub fn may_change_placement(&self, name: &str) -> bool {
        self.credentials.is_none() || self.placement_admins.iter().any(|a| a == name)
    }

    /// What one authenticated connection reserves from the memory budget: two maximum-size
    /// frames (one being read, one held by the server).
    pub fn connection_reserve_bytes(&self) -> u64 {
        2 * self.codec.max_frame_bytes as u64
    }

    fn protocol(&self, server: bool) -> ProtocolConfig {
        let mut p = ProtocolConfig::new(
            self.cluster.clone(),
            if server {
                self.server_rank
            } else {
                CLIENT_RANK
            },
            self.server_rank.saturating_add(1),
        );
        p.credentials = self.credentials.clone();
        p.codec = self.codec;
        p.recv_window_bytes = 2 * self.codec.max_frame_bytes as u64;
        p.handshake_timeout = self.handshake_timeout;
        p.accept_clients = server;
        p.clients_only = server;
        p
    }
}

/// Why a frontend connection operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FrontendError {
    /// Socket-level failure.
    #[error("{peer}: {source}")]
    Io {
        /// The other end.
        peer: SocketAddr,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// The handshake failed (wrong cluster, authentication, version, timeout).
    #[error("{peer}: handshake failed: {source}")]
    Handshake {
        /// The other end.
        peer: SocketAddr,
        /// Cause.
        #[source]
        source: ProtocolError,
    },
    /// A frame could not be decoded.
    #[error("{peer}: bad frame{}: {error}", if *.recoverable { "" } else { " (connection unusable)" })]
    BadFrame {
        /// The other end.
        peer: SocketAddr,
        /// Whether the stream is still framed (answer with an error frame and continue).
        recoverable: bool,
        /// Request id from the metadata, when it could be read.
        request_id: Option<u64>,
        /// Cause.
        error: CodecError,
    },
    /// The other end closed the connection.
    #[error("{peer}: connection closed")]
    Closed {
        /// The other end.
        peer: SocketAddr,
    },
    /// A sealed frame did not open (tampered, replayed, reordered or truncated): the
    /// connection is unusable and must be closed.
    #[error("{peer}: {error}; connection closed")]
    Integrity {
        /// The other end.
        peer: SocketAddr,
        /// Cause.
        error: IntegrityError,
    },
    /// The address answered as a mesh port (a worker's, or the router's port for workers), not
    /// as the router's frontend port.
    #[error(
        "{peer} is {what}, not the router's frontend port; connect to the frontend address that `expertmesh up` or `expertmesh router` prints (the topology's [router] port)"
    )]
    NotFrontend {
        /// The other end.
        peer: SocketAddr,
        /// What answered ("a worker's mesh port (device rank 0)", ...).
        what: String,
    },
}

/// A frame read from a frontend connection; the payload is 64-byte aligned.
pub struct ClientFrame {
    body: Body,
    buf: AlignedVec<u8>,
    payload: Range<usize>,
}

impl std::fmt::Debug for ClientFrame {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientFrame")
            .field("body", &self.body)
            .field("payload_len", &self.payload.len())
            .finish()
    }
}

impl ClientFrame {
    /// The frame's metadata.
    pub fn body(&self) -> &Body {
        &self.body
    }

    /// The payload.
    pub fn payload(&self) -> &[u8] {
        &self.buf[self.payload.clone()]
    }
}

/// Listens for frontend clients.
#[derive(Debug)]
pub struct FrameListener {
    listener: TcpListener,
    cfg: Arc<FrontendConfig>,
}

impl FrameListener {
    /// Binds `addr`.
    pub async fn bind(addr: SocketAddr, cfg: FrontendConfig) -> std::io::Result<Self> {
        cfg.codec
            .validate()
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
        Ok(Self {
            listener: TcpListener::bind(addr).await?,
            cfg: Arc::new(cfg),
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Accepts the next TCP connection; run [`IncomingClient::handshake`] on it (in its own
    /// task, so a slow client cannot stall accepting). A connection over the handshake limits
    /// ([`FrontendConfig::handshake_gate`]) is closed at once, unread, and logged.
    pub async fn accept(&self) -> std::io::Result<IncomingClient> {
        loop {
            let (stream, peer) = self.listener.accept().await?;
            let permit = match self.cfg.handshake_gate.try_enter(peer.ip()) {
                Ok(p) => p,
                Err(why) => {
                    log_refusal("frontend client", peer, None, &why);
                    continue;
                }
            };
            let _ = stream.set_nodelay(true);
            return Ok(IncomingClient {
                stream,
                peer,
                cfg: Arc::clone(&self.cfg),
                permit,
            });
        }
    }
}

/// An accepted, not yet authenticated client connection.
#[derive(Debug)]
pub struct IncomingClient {
    stream: TcpStream,
    peer: SocketAddr,
    cfg: Arc<FrontendConfig>,
    /// Its place among the handshakes in progress, freed when the handshake ends.
    permit: HandshakePermit,
}

impl IncomingClient {
    /// The client's address.
    pub fn peer_addr(&self) -> SocketAddr {
        self.peer
    }

    /// Runs the server side of the handshake; a client that fails it is refused and logged.
    pub async fn handshake(mut self) -> Result<FrameConnection, FrontendError> {
        if let Some(reason) = self.cfg.gate.reason() {
            return Err(self.refuse(reason).await);
        }
        let proto = Arc::new(self.cfg.protocol(true));
        let hello = random_nonce().map_err(|e| FrontendError::Io {
            peer: self.peer,
            source: std::io::Error::other(e),
        })?;
        let mut conn = Connection::new(proto, None, hello, Vec::new(), Instant::now());
        let peer = self.peer;
        let mut crypt = Crypt::default();
        let r = tokio::select! {
            r = handshake(
                &mut self.stream,
                &mut conn,
                &self.cfg.codec,
                None,
                self.cfg.handshake_timeout,
                &mut crypt,
            ) => r,
            () = self.permit.evicted() => Err(ProtocolError::Closed(crate::tcp::EVICTED_REASON.into())),
        };
        drop(self.permit);
        let refused = |source: ProtocolError| {
            log_refusal(
                "frontend client",
                peer,
                conn.claimed_peer(),
                &source.to_string(),
            );
            FrontendError::Handshake { peer, source }
        };
        let client = match r {
            Ok(client) => client,
            Err(source) => return Err(refused(source)),
        };
        let admitted = self
            .cfg
            .per_frontend
            .open(&client.identity, self.cfg.max_connections_per_frontend)
            .and_then(|slot| {
                let budget = self
                    .cfg
                    .memory_budget
                    .reserve(self.cfg.connection_reserve_bytes());
                budget.map(|reservation| (slot, reservation))
            });
        let mut c = FrameConnection::from_stream(self.stream, peer, self.cfg.codec, crypt);
        c.reader.frame_timeout = self.cfg.frame_timeout;
        match admitted {
            Ok((slot, reservation)) => {
                c.reader.reservation = Some(reservation);
                c.reader.frontend_slot = Some(slot);
                c.reader.frontend = client.identity;
                Ok(c)
            }
            Err(why) => {
                // Tell the (authenticated) client why before closing.
                let _ = c.write_frame_error(ErrorCode::Overloaded, &why).await;
                Err(refused(ProtocolError::Closed(why)))
            }
        }
    }
}

impl IncomingClient {
    /// Refuse the client with an error frame carrying `reason` (the client's handshake reports
    /// it). The client's hello is read first, so that closing the socket does not reset the
    /// connection before the client has read the refusal.
    async fn refuse(mut self, reason: String) -> FrontendError {
        use tokio::io::AsyncWriteExt;
        let peer = self.peer;
        let pool = BufPool::new(0);
        let _ = tokio::time::timeout(
            self.cfg.handshake_timeout,
            read_frame(
                &mut self.stream,
                &crate::tcp::pre_auth_codec(&self.cfg.codec),
                &pool,
            ),
        )
        .await;
        let body = Body::Error(ErrorFrame {
            request_id: 0,
            part: None,
            code: ErrorCode::PeerUnavailable,
            message: reason.clone(),
        });
        let mut head = Vec::new();
        if codec::encode_head(&body, &[], &self.cfg.codec, &mut head).is_ok() {
            let _ = write_vectored_all(&mut self.stream, &head, &[]).await;
            let _ = self.stream.shutdown().await;
        }
        // Only while the gate is closed (workers still joining): an expected refusal, at info
        // level and at most a few lines a second however many clients retry.
        log_gate_refusal(peer, &reason);
        FrontendError::Handshake {
            peer,
            source: ProtocolError::Refused {
                code: ErrorCode::PeerUnavailable,
                message: reason,
            },
        }
    }
}

/// Logs a refusal of the closed gate ([`FrontendConfig::gate`]): at most one line a second,
/// with how many were not logged since.
fn log_gate_refusal(peer: SocketAddr, reason: &str) {
    static THROTTLE: crate::tcp::LogThrottle = crate::tcp::LogThrottle::new(1);
    if let Some(quiet) = THROTTLE.admit() {
        tracing::info!(%peer, quiet, "refused frontend client: {reason}");
    }
}

/// What a client's failed handshake says about the port it reached: a mesh port announces a
/// rank other than the router's frontend rank, or a receive window sized for mesh frames.
fn not_frontend(
    peer: SocketAddr,
    cfg: &FrontendConfig,
    e: &ProtocolError,
) -> Option<FrontendError> {
    let what = match e {
        ProtocolError::UnexpectedRank { got, .. } if *got != cfg.server_rank => {
            format!(
                "a worker's mesh port (device rank {})",
                got.saturating_sub(1)
            )
        }
        ProtocolError::Config(m) if m.contains("receive window") => {
            "a mesh port (where workers connect)".to_owned()
        }
        ProtocolError::Refused { message, .. }
            if message.contains(&format!("rank {CLIENT_RANK}")) =>
        {
            "a mesh port (it refuses frontend clients)".to_owned()
        }
        _ => return None,
    };
    Some(FrontendError::NotFrontend { peer, what })
}

/// An established framed connection (client or server side).
#[derive(Debug)]
pub struct FrameConnection {
    reader: FrameReader,
    writer: FrameWriter,
}

impl FrameConnection {
    /// Connects to a router service at `addr` as a client and runs the handshake.
    pub async fn connect(addr: SocketAddr, cfg: &FrontendConfig) -> Result<Self, FrontendError> {
        let mut stream = TcpStream::connect(addr)
            .await
            .map_err(|source| FrontendError::Io { peer: addr, source })?;
        #[cfg(unix)]
        crate::fork_close::note_client_socket(std::os::fd::AsRawFd::as_raw_fd(&stream));
        let _ = stream.set_nodelay(true);
        let proto = Arc::new(cfg.protocol(false));
        // Any router may answer: its hello's rank says which, and picks the key.
        let hello = random_nonce().map_err(|e| FrontendError::Io {
            peer: addr,
            source: std::io::Error::other(e),
        })?;
        let mut conn = Connection::new(proto, None, hello, Vec::new(), Instant::now());
        let mut crypt = Crypt::default();
        handshake(
            &mut stream,
            &mut conn,
            &cfg.codec,
            None,
            cfg.handshake_timeout,
            &mut crypt,
        )
        .await
        .map_err(|source| {
            not_frontend(addr, cfg, &source)
                .unwrap_or(FrontendError::Handshake { peer: addr, source })
        })?;
        Ok(Self::from_stream(stream, addr, cfg.codec, crypt))
    }

    fn from_stream(stream: TcpStream, peer: SocketAddr, codec: CodecConfig, crypt: Crypt) -> Self {
        let (r, w) = stream.into_split();
        Self {
            reader: FrameReader {
                read: FrameIn::new(
                    tokio::io::BufReader::with_capacity(crate::tcp::READ_BUFFER_BYTES, r),
                    crypt.open,
                ),
                peer,
                codec,
                pool: BufPool::new(4 * codec.max_frame_bytes as u64),
                reservation: None,
                frontend_slot: None,
                frontend: String::new(),
                frame_timeout: None,
                stalled: None,
            },
            writer: FrameWriter {
                write: w,
                peer,
                codec,
                head: Vec::with_capacity(256),
                seal: crypt.seal,
                progress: WriteProgress::default(),
            },
        }
    }

    /// Writes a connection-level error frame (request id 0), bounded by a short timeout.
    async fn write_frame_error(
        &mut self,
        code: ErrorCode,
        message: &str,
    ) -> Result<(), FrontendError> {
        let w = self.writer.write_error(0, code, message);
        match tokio::time::timeout(Duration::from_secs(1), w).await {
            Ok(r) => r,
            Err(_) => Ok(()),
        }
    }

    /// Whether frames on this connection are sealed (authenticated and encrypted).
    pub fn is_encrypted(&self) -> bool {
        self.writer.seal.is_some()
    }

    /// The other end's address.
    pub fn peer_addr(&self) -> SocketAddr {
        self.reader.peer
    }

    /// Reads the next frame.
    pub async fn read_frame(&mut self) -> Result<ClientFrame, FrontendError> {
        self.reader.read_frame().await
    }

    /// Writes one frame.
    pub async fn write_frame(&mut self, body: &Body, payload: &[u8]) -> Result<(), FrontendError> {
        self.writer.write_frame(body, payload).await
    }

    /// Writes raw bytes as they are: for tests of how a server handles malformed frames.
    #[doc(hidden)]
    pub async fn write_raw(&mut self, bytes: &[u8]) -> Result<(), FrontendError> {
        use tokio::io::AsyncWriteExt;
        let peer = self.writer.peer;
        self.writer
            .write
            .write_all(bytes)
            .await
            .map_err(|source| FrontendError::Io { peer, source })
    }

    /// Splits into halves for concurrent reading and writing (pipelined requests).
    pub fn split(self) -> (FrameReader, FrameWriter) {
        (self.reader, self.writer)
    }
}

/// Reading half of a [`FrameConnection`].
#[derive(Debug)]
pub struct FrameReader {
    /// The socket, opening sealed frames when the connection is encrypted.
    read: FrameIn<tokio::io::BufReader<OwnedReadHalf>>,
    peer: SocketAddr,
    codec: CodecConfig,
    pool: Arc<BufPool>,
    /// Server side: this connection's share of the listener's memory budget.
    reservation: Option<MemoryReservation>,
    /// Server side: this connection's place among its frontend's connections.
    frontend_slot: Option<FrontendConnectionSlot>,
    /// Server side: the frontend name the client authenticated as.
    frontend: String,
    /// Server side: [`FrontendConfig::frame_timeout`] for the rest of a frame begun.
    frame_timeout: Option<Duration>,
    /// Why reading stopped mid-frame (the stream is no longer framed): every later read
    /// fails with it. Holds [`ABANDONED`] while the rest of a frame is being read, so that a
    /// read whose future is dropped leaves the reader unframed too.
    stalled: Option<std::borrow::Cow<'static, str>>,
}

impl FrameReader {
    /// Server side: the frontend name the client authenticated as (claimed, without
    /// credentials).
    pub fn frontend(&self) -> &str {
        &self.frontend
    }

    /// Reads the next application frame (heartbeats are skipped).
    pub async fn read_frame(&mut self) -> Result<ClientFrame, FrontendError> {
        loop {
            let peer = self.peer;
            self.check_framed()?;
            let header = match self.read.read_header(&self.codec).await {
                Ok(h) => h,
                Err(e) => return Err(read_error(peer, e)),
            };
            self.stalled = Some(ABANDONED.into());
            let body = self.read.read_body(&header, &self.pool);
            let body = within(self.frame_timeout, peer, header.frame_len as usize, body).await;
            let buf = mark_stalled(&mut self.stalled, body, peer)?;
            match codec::decode_with_header(&header, &buf[..header.frame_len as usize]) {
                Ok((Body::Heartbeat(_), _)) => continue,
                Ok((body, payload)) => return Ok(ClientFrame { body, buf, payload }),
                Err(error) => {
                    // The header was valid, so the stream is still framed. Recover the request
                    // id (first 8 metadata bytes of every request-carrying kind) for the reply.
                    let meta = &buf[header.meta_range()];
                    let request_id = (header.kind.is_application() && meta.len() >= 8).then(|| {
                        let mut a = [0u8; 8];
                        a.copy_from_slice(&meta[..8]);
                        u64::from_le_bytes(a)
                    });
                    return Err(FrontendError::BadFrame {
                        peer,
                        recoverable: true,
                        request_id,
                        error,
                    });
                }
            }
        }
    }
}

/// Largest metadata [`FrameReader::read_head`] reads before a frame's payload (a
/// `LayerRequest`'s is under 64 bytes); a frame with more metadata has its head read only when
/// it is taken ([`FrameReader::read_payload`]).
pub const MAX_HEAD_META_BYTES: usize = 4096;

/// A frame's header and metadata, read before its payload ([`FrameReader::read_head`]):
/// enough to decide whether to take the frame ([`FrameReader::read_payload`]) or to pass over
/// it ([`FrameReader::skip_payload`]) without ever holding its payload. The server sheds
/// requests this way when it is at capacity.
#[derive(Debug)]
pub struct FrameHead {
    header: codec::FrameHeader,
    body: Option<Result<Body, CodecError>>,
    request_id: Option<u64>,
}

impl FrameHead {
    /// The frame's kind.
    pub fn kind(&self) -> codec::FrameKind {
        self.header.kind
    }

    /// The whole frame's length in bytes (header, metadata, padding and payload).
    pub fn frame_len(&self) -> usize {
        self.header.frame_len as usize
    }

    /// The payload's length in bytes (not read yet).
    pub fn payload_len(&self) -> usize {
        self.header.payload_len as usize
    }

    /// The metadata, decoded: `None` when it is longer than [`MAX_HEAD_META_BYTES`] (not read
    /// yet), `Some(Err(..))` when it does not decode (the stream is still framed).
    pub fn body(&self) -> Option<&Result<Body, CodecError>> {
        self.body.as_ref()
    }

    /// The request id in the metadata (also from metadata that does not decode: the first 8
    /// bytes of every request-carrying kind), when it was read.
    pub fn request_id(&self) -> Option<u64> {
        self.request_id
    }
}

/// The request id in the first 8 metadata bytes of a request-carrying frame kind.
fn meta_request_id(header: &codec::FrameHeader, meta: &[u8]) -> Option<u64> {
    (header.kind.is_application() && meta.len() >= 8).then(|| {
        let mut a = [0u8; 8];
        a.copy_from_slice(&meta[..8]);
        u64::from_le_bytes(a)
    })
}

/// A failed read as the connection's error (a broken header leaves the stream unframed).
fn read_error(peer: SocketAddr, e: ReadError) -> FrontendError {
    match e {
        ReadError::Eof => FrontendError::Closed { peer },
        ReadError::Io(source) => FrontendError::Io { peer, source },
        ReadError::Integrity(error) => FrontendError::Integrity { peer, error },
        ReadError::Codec(error) => FrontendError::BadFrame {
            peer,
            recoverable: false,
            request_id: None,
            error,
        },
    }
}

impl FrameReader {
    /// Reads the next frame's header and metadata, not its payload. Follow with
    /// [`FrameReader::read_payload`] or [`FrameReader::skip_payload`] before the next call.
    /// Heartbeats are returned too (their payload is empty).
    pub async fn read_head(&mut self) -> Result<FrameHead, FrontendError> {
        let peer = self.peer;
        self.check_framed()?;
        let header = self
            .read
            .read_header(&self.codec)
            .await
            .map_err(|e| read_error(peer, e))?;
        self.stalled = Some(ABANDONED.into());
        let meta = self.read.read_meta(&header, MAX_HEAD_META_BYTES);
        let meta = within(self.frame_timeout, peer, header.frame_len as usize, meta).await;
        let head = mark_stalled(&mut self.stalled, meta, peer)?;
        let (body, request_id) = match head {
            None => (None, None),
            Some(bytes) => {
                let meta = &bytes[header.meta_range()];
                let body = Body::decode_meta(header.kind, meta);
                let id = match &body {
                    Ok(b) => b.request_id(),
                    Err(_) => meta_request_id(&header, meta),
                };
                (Some(body), id)
            }
        };
        Ok(FrameHead {
            header,
            body,
            request_id,
        })
    }

    /// Reads the payload of the frame whose head [`FrameReader::read_head`] returned and
    /// decodes the whole frame (payload checksum and length included). A frame whose header is
    /// intact but whose content is bad is [`FrontendError::BadFrame`] with `recoverable: true`.
    pub async fn read_payload(&mut self, head: FrameHead) -> Result<ClientFrame, FrontendError> {
        let peer = self.peer;
        let header = head.header;
        self.check_framed()?;
        self.stalled = Some(ABANDONED.into());
        let body = self.read.read_body(&header, &self.pool);
        let body = within(self.frame_timeout, peer, header.frame_len as usize, body).await;
        let buf = mark_stalled(&mut self.stalled, body, peer)?;
        match codec::decode_with_header(&header, &buf[..header.frame_len as usize]) {
            Ok((body, payload)) => Ok(ClientFrame { body, buf, payload }),
            Err(error) => Err(FrontendError::BadFrame {
                peer,
                recoverable: true,
                request_id: meta_request_id(&header, &buf[header.meta_range()]),
                error,
            }),
        }
    }

    /// Reads past the payload of the frame whose head [`FrameReader::read_head`] returned,
    /// through a small fixed buffer: nothing of the size the header announces is allocated.
    pub async fn skip_payload(&mut self, head: FrameHead) -> Result<(), FrontendError> {
        let peer = self.peer;
        self.check_framed()?;
        self.stalled = Some(ABANDONED.into());
        let skip = self.read.skip_body(&head.header);
        let skip = within(self.frame_timeout, peer, head.frame_len(), skip).await;
        mark_stalled(&mut self.stalled, skip, peer)
    }

    /// An error when an earlier read stopped mid-frame: the stream is no longer framed, and
    /// what follows (the client's bytes) must never be read as a frame.
    fn check_framed(&self) -> Result<(), FrontendError> {
        match &self.stalled {
            None => Ok(()),
            Some(why) => Err(FrontendError::Io {
                peer: self.peer,
                source: std::io::Error::other(why.to_string()),
            }),
        }
    }

    /// Shuts the connection's socket down both ways: a write waiting on a client that does
    /// not read fails at once, and so does every later read and write. The router does this
    /// when an answer has waited too long for a client that does not read it
    /// ([`WriteProgress::overdue`]).
    pub fn shut_down(&self) {
        self.shut_down_handle().shut_down();
    }

    /// A handle that shuts this connection's socket down ([`FrameReader::shut_down`]) while
    /// the reader is borrowed elsewhere. Use it only while this reader lives: it names the
    /// socket by its descriptor, which is reused once the reader is dropped.
    pub fn shut_down_handle(&self) -> ShutDown {
        use std::os::fd::AsRawFd;
        ShutDown(self.read.get_ref().get_ref().as_ref().as_raw_fd())
    }
}

/// Shuts a frontend connection's socket down ([`FrameReader::shut_down_handle`]).
#[derive(Clone, Copy, Debug)]
pub struct ShutDown(std::os::fd::RawFd);

impl ShutDown {
    /// Shuts the socket down both ways (reads and writes under way fail at once).
    pub fn shut_down(self) {
        // SAFETY: shutdown on a descriptor number, no memory passed; the handle's contract
        // (used only while its reader lives) makes it this connection's socket.
        unsafe { libc::shutdown(self.0, libc::SHUT_RDWR) };
    }
}

/// `read` (a [`within`] result) as the connection's result: `stalled` (what
/// [`FrameReader::check_framed`] reads) cleared when the read ended whole and in time, set to
/// why when it stalled or failed part-way (the stream is then no longer framed).
fn mark_stalled<T>(
    stalled: &mut Option<std::borrow::Cow<'static, str>>,
    read: Result<Result<T, ReadError>, FrontendError>,
    peer: SocketAddr,
) -> Result<T, FrontendError> {
    let read = read.and_then(|r| r.map_err(|e| read_error(peer, e)));
    *stalled = match &read {
        Ok(_) => None,
        Err(FrontendError::Io { source, .. }) => Some(source.to_string().into()),
        Err(e) => Some(e.to_string().into()),
    };
    read
}

/// What a reader says when a read of a frame's rest was abandoned (its future dropped) before
/// it ended: the stream is no longer framed. Set before each such read, cleared when it ends.
const ABANDONED: &str = "a read was abandoned in the middle of a frame; the connection is no \
                         longer read";

/// Runs `io`, reading the rest of a frame of `frame_bytes` from `peer`, within
/// [`frame_deadline`] of `base` (no limit without one): past it, an error naming the stall.
/// The stream is then no longer framed ([`mark_stalled`]).
async fn within<T>(
    base: Option<Duration>,
    peer: SocketAddr,
    frame_bytes: usize,
    io: impl std::future::Future<Output = T>,
) -> Result<T, FrontendError> {
    let Some(base) = base else {
        return Ok(io.await);
    };
    let limit = frame_deadline(base, frame_bytes);
    tokio::time::timeout(limit, io).await.map_err(|_| {
        let source = std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!(
                "the rest of a frame of {frame_bytes} bytes did not arrive within {limit:.1?} \
                 (the frontend stopped sending mid-frame; router --frontend-frame-timeout-s): \
                 the connection is no longer read"
            ),
        );
        FrontendError::Io { peer, source }
    })
}

/// How long a [`FrameWriter`]'s current write has waited, and how large it is, and when its
/// last write ended, readable without the writer (which the waiting write holds): the router
/// closes a connection whose client takes no answer ([`WriteProgress::overdue`]), and counts a
/// connection's idleness from its last answer too ([`WriteProgress::since_last_write`]).
/// Clones share it.
#[derive(Clone, Debug, Default)]
pub struct WriteProgress(Arc<[std::sync::atomic::AtomicU64; 3]>);

impl WriteProgress {
    /// Nanoseconds since a process-wide start, never 0 (0 means no write under way).
    fn now() -> u64 {
        static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
        let start = *START.get_or_init(Instant::now);
        (start.elapsed().as_nanos() as u64).max(1)
    }

    /// Marks a write of `bytes` begun until the guard is dropped (written, failed or
    /// cancelled).
    fn begin(&self, bytes: usize) -> impl Drop + '_ {
        use std::sync::atomic::Ordering;
        struct Ends<'a>(&'a WriteProgress);
        impl Drop for Ends<'_> {
            fn drop(&mut self) {
                self.0.0[2].store(WriteProgress::now(), Ordering::Release);
                self.0.0[0].store(0, Ordering::Release);
            }
        }
        self.0[1].store(bytes as u64, Ordering::Release);
        self.0[0].store(Self::now(), Ordering::Release);
        Ends(self)
    }

    /// How long the write under way has waited and its size in bytes (`None`: no write under
    /// way).
    pub fn waiting(&self) -> Option<(Duration, usize)> {
        use std::sync::atomic::Ordering;
        loop {
            let began = self.0[0].load(Ordering::Acquire);
            if began == 0 {
                return None;
            }
            let bytes = self.0[1].load(Ordering::Acquire) as usize;
            // The same write still (not one that began between the two loads).
            if self.0[0].load(Ordering::Acquire) == began {
                return Some((
                    Duration::from_nanos(Self::now().saturating_sub(began)),
                    bytes,
                ));
            }
        }
    }

    /// How long ago the last write ended (written, failed or cancelled); `None` before the
    /// first.
    pub fn since_last_write(&self) -> Option<Duration> {
        use std::sync::atomic::Ordering;
        let ended = self.0[2].load(Ordering::Acquire);
        (ended != 0).then(|| Duration::from_nanos(Self::now().saturating_sub(ended)))
    }

    /// Whether the write under way has waited past [`frame_deadline`] of `base` for its
    /// size: a client taking it slowly but steadily gets a second per
    /// [`FRAME_MIN_BYTES_PER_SECOND`] beyond `base`.
    pub fn overdue(&self, base: Duration) -> bool {
        self.overdue_since(base, None)
    }

    /// [`WriteProgress::overdue`], counting the wait from `since` at the earliest (when the
    /// connection stopped being read: what waited before had the idle rule's allowance).
    pub fn overdue_since(&self, base: Duration, since: Option<Instant>) -> bool {
        self.waiting().is_some_and(|(waited, bytes)| {
            let waited = since.map_or(waited, |t| waited.min(t.elapsed()));
            waited >= frame_deadline(base, bytes)
        })
    }
}

/// Writing half of a [`FrameConnection`].
#[derive(Debug)]
pub struct FrameWriter {
    write: OwnedWriteHalf,
    peer: SocketAddr,
    codec: CodecConfig,
    head: Vec<u8>,
    /// Seals every frame when the connection is encrypted.
    seal: Option<SealBuf>,
    /// The write under way ([`FrameWriter::progress`]).
    progress: WriteProgress,
}

impl FrameWriter {
    /// Writes one frame (one vectored write of header and payload).
    pub async fn write_frame(&mut self, body: &Body, payload: &[u8]) -> Result<(), FrontendError> {
        let peer = self.peer;
        codec::encode_head(body, payload, &self.codec, &mut self.head).map_err(|error| {
            FrontendError::BadFrame {
                peer,
                recoverable: true,
                request_id: body.request_id(),
                error,
            }
        })?;
        let progress = self.progress.clone();
        let _writing = progress.begin(self.head.len() + payload.len());
        write_frame_sealed(&mut self.write, self.seal.as_mut(), &self.head, payload)
            .await
            .map_err(|source| FrontendError::Io { peer, source })
    }

    /// How long this writer's write under way has waited and how large it is, readable while
    /// that write holds the writer.
    pub fn progress(&self) -> WriteProgress {
        self.progress.clone()
    }

    /// Writes raw bytes as they are: for tests of how a server handles malformed frames.
    #[doc(hidden)]
    pub async fn write_raw(&mut self, bytes: &[u8]) -> Result<(), FrontendError> {
        use tokio::io::AsyncWriteExt;
        let peer = self.peer;
        self.write
            .write_all(bytes)
            .await
            .map_err(|source| FrontendError::Io { peer, source })
    }

    /// Writes an error frame for `request_id`.
    pub async fn write_error(
        &mut self,
        request_id: u64,
        code: ErrorCode,
        message: &str,
    ) -> Result<(), FrontendError> {
        let mut message = message.to_owned();
        if message.len() > codec::MAX_ERROR_MESSAGE_BYTES {
            let mut cut = codec::MAX_ERROR_MESSAGE_BYTES;
            while !message.is_char_boundary(cut) {
                cut -= 1;
            }
            message.truncate(cut);
        }
        let body = Body::Error(ErrorFrame {
            request_id,
            part: None,
            code,
            message,
        });
        self.write_frame(&body, &[]).await
    }
}

#[cfg(test)]
mod placement_admin_tests {
    use super::*;
    use crate::crypto::Key;

    /// Who may change the placement: with credentials only the named admins (none when the
    /// list is empty), without credentials everyone (nothing is authenticated there).
    #[test]
    fn only_named_admins_change_the_placement_where_frontends_are_authenticated() {
        let mut cfg = FrontendConfig::new("c");
        for name in ["", "admin", "fe-1"] {
            assert!(
                cfg.may_change_placement(name),
                "no credentials: {name:?} may"
            );
        }
        let master = Key::from_bytes([7; crate::crypto::KEY_BYTES]);
        cfg.credentials = Some(Arc::new(Credentials::issue_frontend(
            &master, "c", "router", 1,
        )));
        assert!(cfg.may_change_placement(DEFAULT_PLACEMENT_ADMIN));
        for name in ["", "fe-1", "Admin", "admin "] {
            assert!(!cfg.may_change_placement(name), "{name:?} may not");
        }
        cfg.placement_admins = vec!["ops".into(), "fe-1".into()];
        assert!(cfg.may_change_placement("fe-1") && cfg.may_change_placement("ops"));
        assert!(!cfg.may_change_placement("admin"));
        cfg.placement_admins.clear();
        assert!(!cfg.may_change_placement("admin") && !cfg.may_change_placement(""));
    }
}

#[cfg(test)]
mod write_progress_tests {
    use super::*;

    /// A write under way is seen waiting with its size; once it ends, whatever its outcome,
    /// nothing waits and the end is remembered (none before the first write).
    #[test]
    fn a_write_is_seen_while_under_way_and_its_end_is_remembered() {
        let p = WriteProgress::default();
        assert!(p.waiting().is_none() && p.since_last_write().is_none());
        {
            let _writing = p.begin(4096);
            let (waited, bytes) = p.waiting().expect("a write under way");
            assert_eq!(bytes, 4096);
            assert!(waited < Duration::from_secs(3600));
            assert!(p.since_last_write().is_none(), "not ended yet");
        }
        assert!(p.waiting().is_none());
        let since = p.since_last_write().expect("the write ended");
        std::thread::sleep(Duration::from_millis(2));
        assert!(
            p.since_last_write().unwrap() > since,
            "counted from the end, not now"
        );
        // A clone sees the same.
        assert!(p.clone().since_last_write().is_some());
    }
}
