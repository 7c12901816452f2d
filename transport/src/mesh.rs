//! The rank-to-rank mesh: the [`Transport`] trait, and one engine that runs the sans-IO
//! [`protocol`](crate::protocol) over TCP, shared-memory or RoCE links.
//!
//! Why this exists: the fabric talks to ranks, not sockets. It sends a frame to a rank and
//! receives a stream of `(rank, frame)` events; which link carries them, how the handshake,
//! credits and heartbeats work, and how a dead peer is detected is the same for every driver.
//! This module owns connection management and the per-rank state; the per-link engine is
//! `link`, link setup is `setup`, and drivers only move frame
//! bytes.
//!
//! Connection management: every rank listens on its configured address; rank `i` dials every
//! rank `j < i` and redials with exponential backoff after a failure, so a restarted peer is
//! reconnected without operator action. The link kind of a pair is chosen by the dialer's
//! configuration ([`PeerAddress::link`]); the acceptor follows the dialer's hello.
//!
//! Failure semantics: when a link fails (I/O error, protocol violation, idle timeout, peer
//! exit), every send waiting on it returns a [`PeerError`] naming the rank, one
//! [`TransportEvent::PeerLost`] is emitted, and later sends fail fast with
//! [`PeerErrorKind::NotConnected`] until the link is re-established
//! ([`TransportEvent::PeerUp`]). Frames already written but not yet processed by the peer are
//! lost; requests above this layer carry deadlines.
//!
//! Memory bounds: receive buffers come from a per-link pool; a peer can have at most its
//! receive window of unreleased frames (enforced by the protocol). The event queue is a bounded
//! channel sized by that credit bound: every peer's whole window of smallest frames plus
//! [`NOTICES_PER_PEER`] peer notices, so a link's frames always fit while the application keeps
//! up. It can only fill when the application stops draining [`MeshEvents`] while links are
//! re-established (each new link brings a new window); then the delivering link is closed with
//! an error saying so, and a peer notice that does not fit is dropped with an error log (the
//! mesh's own state, [`Mesh::is_connected`] and send errors, stays exact).
//!
//! Layering: `mesh` is the top of the crate: it imports `setup`,
//! `link`, [`protocol`](crate::protocol) and [`codec`](crate::codec) (not the
//! drivers themselves), and nothing in the crate imports it.

use crate::codec::{Body, ErrorCode, ErrorFrame, HEADER_LEN};
use crate::link::{Link, LinkOwner, NewLink};
pub use crate::link::{
    LinkKind, OutFrame, PeerError, PeerErrorKind, PeerStats, Rank, RecvFrame, credit_cost,
    process_incarnation,
};
use crate::protocol::{ProtocolConfig, ProtocolError};
use crate::setup::{self, Established, SetupEnv};
pub use crate::shm::ShmConfig;
use std::fmt;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, mpsc};

/// Peer notices ([`TransportEvent::PeerUp`] / [`TransportEvent::PeerLost`]) the event queue
/// holds per peer on top of the peer's frames.
pub const NOTICES_PER_PEER: usize = 64;

/// Capacity of the event queue: for every peer, the most frames its receive window admits
/// (window / the credit cost of the smallest frame) plus [`NOTICES_PER_PEER`].
fn event_queue_capacity(cfg: &MeshConfig) -> usize {
    let per_link = cfg.protocol.recv_window_bytes / credit_cost(HEADER_LEN);
    let per_peer = usize::try_from(per_link)
        .unwrap_or(usize::MAX)
        .saturating_add(NOTICES_PER_PEER);
    let peers = cfg.peers.len().saturating_sub(1).max(1);
    peers
        .saturating_mul(per_peer)
        .clamp(1, tokio::sync::Semaphore::MAX_PERMITS)
}

/// Where a rank listens and how to reach it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerAddress {
    /// TCP address the rank listens on (also the rendezvous for shm and RDMA links).
    pub addr: SocketAddr,
    /// Link to use when this node dials the rank.
    pub link: LinkKind,
}

/// Everything a rank needs to join the mesh. The fabric maps topology devices to ranks and
/// fills `peers` (index = rank, this node's own entry included).
#[derive(Debug, Clone)]
pub struct MeshConfig {
    /// Protocol settings (cluster, rank, world size, secret, window, timeouts, codec).
    pub protocol: ProtocolConfig,
    /// Address of every rank, indexed by rank.
    pub peers: Vec<PeerAddress>,
    /// First redial delay after a failed or lost connection.
    pub reconnect_initial: Duration,
    /// Longest redial delay (the delay doubles up to this).
    pub reconnect_max: Duration,
    /// Shared-memory settings.
    pub shm: ShmConfig,
    /// RDMA device name (`None`: the first device) and the IPv4 address whose GID to use.
    pub rdma_device: Option<String>,
    /// Which NIC implementation carries RDMA links (default: raw verbs).
    pub rdma_provider: crate::rdma::RdmaProvider,
    /// Lower ranks this rank dials (`None`: every lower rank, a full mesh). A star around
    /// rank 0 (workers that only talk to the router) sets `Some(vec![0])` on every other rank
    /// and `Some(vec![])` on rank 0; then only rank 0's address must be reachable.
    pub dial_ranks: Option<Vec<Rank>>,
    /// Limits on handshakes in progress on this rank's listener (per source address and in
    /// total; connections over them are closed at once or evict the oldest handshake). It
    /// trusts the addresses of `peers` (set by [`MeshConfig::new`]): their handshakes are
    /// never displaced by other addresses'.
    pub handshake_gate: crate::tcp::HandshakeGate,
}

impl MeshConfig {
    /// A configuration for `rank` of `peers.len()` ranks with default settings.
    pub fn new(cluster: impl Into<String>, rank: Rank, peers: Vec<PeerAddress>) -> Self {
        let world = peers.len() as u32;
        let handshake_gate =
            crate::tcp::HandshakeGate::default().trusting(peers.iter().map(|p| p.addr.ip()));
        Self {
            protocol: ProtocolConfig::new(cluster, rank, world),
            peers,
            reconnect_initial: Duration::from_millis(20),
            reconnect_max: Duration::from_secs(1),
            shm: ShmConfig::default(),
            rdma_device: None,
            rdma_provider: crate::rdma::RdmaProvider::default(),
            dial_ranks: None,
            handshake_gate,
        }
    }
}

/// Why the mesh could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StartError {
    /// Invalid configuration.
    #[error("invalid mesh configuration: {0}")]
    Config(String),
    /// The listen address could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// Address.
        addr: SocketAddr,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// Peers did not connect in time.
    #[error("ranks {missing:?} not connected within {timeout:?}")]
    ConnectTimeout {
        /// Ranks still missing.
        missing: Vec<Rank>,
        /// Time waited.
        timeout: Duration,
    },
}

/// What the mesh reports to its owner.
#[derive(Debug)]
pub enum TransportEvent {
    /// An application frame from a peer.
    Frame(RecvFrame),
    /// A link to a peer was established (again).
    PeerUp {
        /// The peer.
        peer: Rank,
        /// Its link kind.
        link: LinkKind,
        /// The peer process's incarnation (changes when the peer restarts).
        incarnation: u64,
    },
    /// A link to a peer failed; sends to it fail until it is back. (A link replaced by a new
    /// connection from the same rank is reported lost just before the new one's `PeerUp`;
    /// sends already go on the new link then.)
    PeerLost(PeerError),
}

/// The link to one peer (if any) and why the last one failed.
struct PeerSlot {
    current: Mutex<Option<Arc<Link>>>,
    last_error: Mutex<Option<String>>,
    /// Links installed for this rank so far (the last one's generation).
    generations: AtomicU64,
    /// Second connections refused for this rank: when a refusal was last logged, and how many
    /// since.
    refusals: Mutex<(Option<Instant>, u64)>,
}

impl PeerSlot {
    fn new() -> Self {
        Self {
            current: Mutex::new(None),
            last_error: Mutex::new(None),
            generations: AtomicU64::new(0),
            refusals: Mutex::new((None, 0)),
        }
    }
}

/// Least time between two logged refusals of a second connection for the same rank (each
/// refusal is counted; the log line says how many there were).
const REFUSAL_LOG_EVERY: Duration = Duration::from_secs(5);

/// The state of a running mesh, shared by its handle, its tasks and (weakly) its links.
pub(crate) struct MeshInner {
    cfg: MeshConfig,
    proto_cfg: Arc<ProtocolConfig>,
    setup: SetupEnv,
    peers: Vec<PeerSlot>,
    events: mpsc::Sender<TransportEvent>,
    event_capacity: usize,
    shutdown: AtomicBool,
    shutdown_notify: Notify,
    tasks: Mutex<Vec<tokio::task::AbortHandle>>,
    local_addr: Mutex<Option<SocketAddr>>,
}

impl LinkOwner for MeshInner {
    fn deliver(&self, link: &Arc<Link>, frame: RecvFrame) {
        match self.events.try_send(TransportEvent::Frame(frame)) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(_)) => link.fail(ProtocolError::Closed(format!(
                "mesh event queue full ({} events): the application is not draining MeshEvents",
                self.event_capacity
            ))),
            Err(mpsc::error::TrySendError::Closed(_)) => {} // events receiver dropped
        }
    }

    fn link_closed(&self, link: &Arc<Link>, kind: PeerErrorKind) {
        MeshInner::link_closed(self, link, kind);
    }
}

impl MeshInner {
    /// Queues a peer notice; one that does not fit the bounded queue is dropped with an error.
    fn notify(&self, ev: TransportEvent) {
        if let Err(mpsc::error::TrySendError::Full(ev)) = self.events.try_send(ev) {
            tracing::error!(
                capacity = self.event_capacity,
                "mesh event queue full (the application is not draining MeshEvents); dropped {ev:?}"
            );
        }
    }

    /// Whether [`Mesh::shutdown`] was called.
    fn is_shutdown(&self) -> bool {
        self.shutdown.load(Ordering::Acquire)
    }

    /// How recently a link must have heard from its peer to count as live: two heartbeat
    /// intervals (a live peer sends something at least once per interval).
    fn live_window(&self) -> Duration {
        self.proto_cfg.heartbeat_interval * 2
    }

    /// Installs an established link for its peer, replacing an older one that has failed or
    /// gone silent. A new connection claiming a rank whose link is live (heard from within
    /// [`MeshInner::live_window`]) is refused, whatever incarnation its hello claims: told why,
    /// closed, and logged (rate-limited); the live link stays.
    ///
    /// The incarnation is not trusted here: it travels in the hello before authentication, so
    /// anyone who saw it can send it, and a second process holding the rank's credential (a
    /// stolen file, a duplicate started from a copied deployment) that claimed the live
    /// process's incarnation used to be taken for that process reconnecting and swapped in
    /// (issue 27). The live process itself never needs to displace a live link: a process that
    /// gives a link up closes its socket (the close ends the link here), and a link whose peer
    /// can no longer reach it falls silent and stops counting as live within the window, so a
    /// genuine redial is accepted at most one window later.
    fn install(self: &Arc<Self>, new: NewLink, from: Option<SocketAddr>) -> Option<Arc<Link>> {
        let rank = new.peer.rank;
        let kind = new.kind;
        let incarnation = new.peer.incarnation;
        let owner: std::sync::Weak<dyn LinkOwner> = Arc::downgrade(self) as _;
        let slot = &self.peers[rank as usize];
        let mut cur = slot.current.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(live) = cur.as_ref()
            && !live.is_closed()
            && live.last_heard().elapsed() < self.live_window()
        {
            let theirs = live.peer_incarnation().unwrap_or(0);
            drop(cur);
            self.refuse_second(new, from, theirs, owner);
            return None;
        }
        let generation = slot.generations.fetch_add(1, Ordering::AcqRel) + 1;
        let link = Arc::new(Link::new(new, self.proto_cfg.codec, owner, generation));
        let old = cur.replace(Arc::clone(&link));
        drop(cur);
        if let Some(old) = old {
            let why = "superseded by a new connection from the same rank; what was sent on the \
                       old link is lost";
            old.fail(ProtocolError::Closed(why.into()));
            // The old link's own closing reports nothing (its successor is in place): the loss
            // is reported here, before the new link's PeerUp, so the application learns that
            // what it sent on the old link will not be answered (it re-sends or fails it)
            // rather than waiting for those answers until their deadlines.
            if !self.is_shutdown() {
                self.notify(TransportEvent::PeerLost(PeerError {
                    peer: rank,
                    kind: PeerErrorKind::LinkFailed(why.into()),
                }));
            }
        }
        let ctl = tokio::spawn(Arc::clone(&link).control_loop());
        link.add_task(ctl.abort_handle());
        tracing::info!(
            peer = rank,
            link = kind.name(),
            incarnation = format_args!("{incarnation:016x}"),
            "link established"
        );
        self.notify(TransportEvent::PeerUp {
            peer: rank,
            link: kind,
            incarnation,
        });
        Some(link)
    }

    /// Refuses `new`, a connection claiming a rank that has a live link from another process
    /// (incarnation `live`): the newcomer gets an error frame saying why, then the connection
    /// closes; the refusal is logged at most every [`REFUSAL_LOG_EVERY`] per rank.
    fn refuse_second(
        &self,
        new: NewLink,
        from: Option<SocketAddr>,
        live: u64,
        owner: std::sync::Weak<dyn LinkOwner>,
    ) {
        let rank = new.peer.rank;
        let incarnation = new.peer.incarnation;
        let from_s = from.map_or_else(|| "?".to_owned(), |a| a.to_string());
        let message = format!(
            "rank {rank} is already served by a live process (incarnation {live:016x}); this \
             connection from {from_s} (claiming incarnation {incarnation:016x}) is refused: two \
             processes were started for the same rank (check the --device of every worker), or the \
             live one's link was not yet given up (it is redialled)"
        );
        {
            let slot = &self.peers[rank as usize];
            let mut r = slot.refusals.lock().unwrap_or_else(|e| e.into_inner());
            r.1 += 1;
            if r.0.is_none_or(|t| t.elapsed() >= REFUSAL_LOG_EVERY) {
                tracing::warn!(
                    peer = rank, from = %from_s, refused = r.1,
                    "refused a second connection for a rank with a live link: {message}"
                );
                *r = (Some(Instant::now()), 0);
            }
        }
        // Never installed: its closing reports nothing (the live link is the rank's).
        let link = Arc::new(Link::new(new, self.proto_cfg.codec, owner, 0));
        let frame = OutFrame::new(Body::Error(ErrorFrame {
            request_id: 0,
            part: None,
            code: ErrorCode::PeerUnavailable,
            message: message.clone(),
        }));
        tokio::spawn(async move {
            let mut head = Vec::with_capacity(256);
            let _ =
                tokio::time::timeout(Duration::from_secs(1), link.send(&frame, &mut head)).await;
            link.fail(ProtocolError::Closed(message));
        });
    }

    /// Installs a link fresh from setup (accepted from `from`, or dialled) and starts reading
    /// its frames; a refused second connection is closed instead.
    fn adopt(self: &Arc<Self>, est: Established, from: Option<SocketAddr>) {
        let Established { new, reader } = est;
        if let Some(link) = self.install(new, from) {
            reader.start(&link, self.proto_cfg.codec);
        }
    }

    /// Forgets a failed link (unless already superseded) and reports it.
    fn link_closed(&self, link: &Arc<Link>, kind: PeerErrorKind) {
        let slot = &self.peers[link.peer as usize];
        {
            let mut cur = slot.current.lock().unwrap_or_else(|e| e.into_inner());
            if cur.as_ref().is_some_and(|l| Arc::ptr_eq(l, link)) {
                *cur = None;
            } else {
                return; // superseded link: its successor is already in place
            }
        }
        *slot.last_error.lock().unwrap_or_else(|e| e.into_inner()) = Some(kind.to_string());
        if !self.is_shutdown() {
            self.notify(TransportEvent::PeerLost(PeerError {
                peer: link.peer,
                kind,
            }));
        }
    }

    /// Records why the last attempt to reach `peer` failed (shown by later send errors).
    fn record_error(&self, peer: Rank, msg: String) {
        if let Some(slot) = self.peers.get(peer as usize) {
            *slot.last_error.lock().unwrap_or_else(|e| e.into_inner()) = Some(msg);
        }
    }

    /// Registers a task to abort on shutdown.
    fn add_task(&self, h: tokio::task::AbortHandle) {
        self.tasks.lock().unwrap_or_else(|e| e.into_inner()).push(h);
    }

    /// The established link to `peer`, if any.
    fn current(&self, peer: Rank) -> Option<Arc<Link>> {
        self.peers
            .get(peer as usize)?
            .current
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

/// The rank-to-rank transport the fabric uses. Implemented by [`Mesh`] for every driver.
pub trait Transport: Send + Sync + 'static {
    /// This node's rank.
    fn local_rank(&self) -> Rank;
    /// Number of ranks.
    fn world_size(&self) -> u32;
    /// Sends one frame to `peer`, waiting for flow-control credit. Returns once the frame is
    /// handed to the link (socket buffer, ring, or posted work request). Fails with an error
    /// naming the peer when the link is down or fails while this send waits.
    fn send(
        &self,
        peer: Rank,
        frame: &OutFrame,
    ) -> impl Future<Output = Result<(), PeerError>> + Send;
    /// Whether an established link to `peer` exists now.
    fn is_connected(&self, peer: Rank) -> bool;
}

/// Receiving side of a [`Mesh`]: frames from every peer, and peer up/down notices.
#[derive(Debug)]
pub struct MeshEvents {
    rx: mpsc::Receiver<TransportEvent>,
}

impl MeshEvents {
    /// The next event; `None` after the mesh is shut down and drained.
    pub async fn recv(&mut self) -> Option<TransportEvent> {
        self.rx.recv().await
    }

    /// The next event if one is ready.
    pub fn try_recv(&mut self) -> Option<TransportEvent> {
        self.rx.try_recv().ok()
    }

    /// The next application frame, skipping peer notices, waiting at most `timeout`.
    pub async fn recv_frame(&mut self, timeout: Duration) -> Option<RecvFrame> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            match tokio::time::timeout_at(deadline, self.rx.recv()).await {
                Ok(Some(TransportEvent::Frame(f))) => return Some(f),
                Ok(Some(_)) => continue,
                _ => return None,
            }
        }
    }
}

/// A rank's membership in the mesh: sends to peers, owns the listener and links. Cheap to clone.
#[derive(Clone)]
pub struct Mesh {
    inner: Arc<MeshInner>,
}

impl fmt::Debug for Mesh {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Mesh")
            .field("rank", &self.inner.proto_cfg.local_rank)
            .field("world_size", &self.inner.proto_cfg.world_size)
            .finish()
    }
}

impl Mesh {
    /// Starts this rank: binds its listen address, dials lower ranks in the background (with
    /// backoff) and returns at once. Use [`Mesh::wait_connected`] to wait for peers.
    pub async fn start(cfg: MeshConfig) -> Result<(Mesh, MeshEvents), StartError> {
        cfg.protocol
            .validate()
            .map_err(|e| StartError::Config(e.to_string()))?;
        let world = cfg.peers.len();
        if cfg.protocol.world_size as usize != world || cfg.protocol.local_rank as usize >= world {
            return Err(StartError::Config(format!(
                "rank {} and world size {} do not match {} peer addresses",
                cfg.protocol.local_rank, cfg.protocol.world_size, world
            )));
        }
        if cfg.peers.iter().any(|p| p.link == LinkKind::Rdma) {
            cfg.rdma_provider.compiled().map_err(|e| {
                StartError::Config(format!(
                    "an RDMA link is configured but {e}; rebuild with that feature, choose another \
                     --rdma-provider, or use tcp"
                ))
            })?;
        }
        let shm_need = 2 * crate::shm::record_bytes(cfg.protocol.codec.max_frame_bytes);
        let ringed = |p: &PeerAddress| matches!(p.link, LinkKind::Shm | LinkKind::Rdma);
        if cfg.peers.iter().any(ringed) && cfg.shm.ring_bytes < shm_need {
            return Err(StartError::Config(format!(
                "shm.ring_bytes {} (also the RDMA ring size) must be at least twice max_frame_bytes \
                 rounded up to 64, plus 128 ({shm_need})",
                cfg.shm.ring_bytes
            )));
        }
        let event_capacity = event_queue_capacity(&cfg);
        let (tx, rx) = mpsc::channel(event_capacity);
        let mut proto = cfg.protocol.clone();
        if proto.incarnation == 0 {
            proto.incarnation = crate::link::process_incarnation();
        }
        let proto_cfg = Arc::new(proto);
        let setup = SetupEnv {
            proto: Arc::clone(&proto_cfg),
            shm: cfg.shm.clone(),
            rdma_device: cfg.rdma_device.clone(),
            rdma_provider: cfg.rdma_provider.clone(),
            local_ip: cfg.peers[cfg.protocol.local_rank as usize].addr.ip(),
        };
        let inner = Arc::new(MeshInner {
            proto_cfg,
            setup,
            event_capacity,
            peers: (0..world).map(|_| PeerSlot::new()).collect(),
            events: tx,
            shutdown: AtomicBool::new(false),
            shutdown_notify: Notify::new(),
            tasks: Mutex::new(Vec::new()),
            local_addr: Mutex::new(None),
            cfg,
        });
        start_listener(&inner).await?;
        for peer in 0..inner.cfg.protocol.local_rank {
            if inner
                .cfg
                .dial_ranks
                .as_ref()
                .is_some_and(|d| !d.contains(&peer))
            {
                continue;
            }
            let h = tokio::spawn(dial_loop(Arc::clone(&inner), peer));
            inner.add_task(h.abort_handle());
        }
        Ok((Mesh { inner }, MeshEvents { rx }))
    }

    /// Starts dialing `peer` (with backoff and redials, as for the configured
    /// [`MeshConfig::dial_ranks`]) when it was left out of them: a rank that must reach some
    /// peers before others (a worker joins its node peers before the routers) dials the rest
    /// later. Must be called from within the mesh's runtime; `peer` must be a lower rank not
    /// already dialed.
    pub fn dial(&self, peer: Rank) {
        if peer as usize >= self.inner.peers.len() || peer >= self.inner.cfg.protocol.local_rank {
            return;
        }
        let h = tokio::spawn(dial_loop(Arc::clone(&self.inner), peer));
        self.inner.add_task(h.abort_handle());
    }

    /// The address this rank actually listens on (useful with port 0).
    pub fn local_addr(&self) -> Option<SocketAddr> {
        *self
            .inner
            .local_addr
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// Waits until every rank in `peers` has an established link, or fails naming the missing.
    pub async fn wait_connected(
        &self,
        peers: &[Rank],
        timeout: Duration,
    ) -> Result<(), StartError> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let missing: Vec<Rank> = peers
                .iter()
                .copied()
                .filter(|&p| self.inner.current(p).is_none())
                .collect();
            if missing.is_empty() {
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(StartError::ConnectTimeout { missing, timeout });
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    /// Flow-control figures of the link to `peer`, if connected.
    pub fn peer_stats(&self, peer: Rank) -> Option<PeerStats> {
        self.inner.current(peer).map(|l| l.stats())
    }

    /// The link kind to `peer`, if connected.
    pub fn link_kind(&self, peer: Rank) -> Option<LinkKind> {
        self.inner.current(peer).map(|l| l.kind)
    }

    /// Closes the link to `peer` (it will be redialled if this rank is the dialer).
    pub fn disconnect(&self, peer: Rank, reason: &str) {
        if let Some(l) = self.inner.current(peer) {
            l.fail(ProtocolError::Closed(reason.to_owned()));
        }
    }

    /// Stops listening and dialling and closes every link; pending sends fail with
    /// [`PeerErrorKind::Shutdown`] or a closed-link error.
    pub fn shutdown(&self) {
        if self.inner.shutdown.swap(true, Ordering::AcqRel) {
            return;
        }
        self.inner.shutdown_notify.notify_waiters();
        for t in self
            .inner
            .tasks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
        {
            t.abort();
        }
        for p in 0..self.inner.peers.len() as u32 {
            if let Some(l) = self.inner.current(p) {
                l.fail(ProtocolError::Closed("transport shut down".into()));
            }
        }
    }
}

impl Transport for Mesh {
    fn local_rank(&self) -> Rank {
        self.inner.proto_cfg.local_rank
    }

    fn world_size(&self) -> u32 {
        self.inner.proto_cfg.world_size
    }

    async fn send(&self, peer: Rank, frame: &OutFrame) -> Result<(), PeerError> {
        let link = self.link_to(peer)?;
        let mut head = Vec::with_capacity(256);
        link.send(frame, &mut head).await
    }

    fn is_connected(&self, peer: Rank) -> bool {
        self.inner.current(peer).is_some()
    }
}

impl Mesh {
    /// Sends one frame to `peer` over the link of generation `generation` only (the one a
    /// frame being answered came on: [`RecvFrame::link_generation`]). Fails with
    /// [`PeerErrorKind::LinkReplaced`] when the peer's link has since been replaced (the peer
    /// restarted: the answer belongs to its previous process), otherwise as
    /// [`Transport::send`].
    pub async fn send_on(
        &self,
        peer: Rank,
        generation: u64,
        frame: &OutFrame,
    ) -> Result<(), PeerError> {
        let link = self.link_to(peer)?;
        if link.generation != generation {
            return Err(PeerError {
                peer,
                kind: PeerErrorKind::LinkReplaced(generation),
            });
        }
        let mut head = Vec::with_capacity(256);
        link.send(frame, &mut head).await
    }

    /// The generation of the link to `peer` now, if connected (1 for its first link, counting
    /// up as links replace each other).
    pub fn link_generation(&self, peer: Rank) -> Option<u64> {
        self.inner.current(peer).map(|l| l.generation)
    }

    /// The established link to `peer`, or the error a send to it fails with.
    fn link_to(&self, peer: Rank) -> Result<Arc<Link>, PeerError> {
        if peer >= self.world_size() || peer == self.local_rank() {
            return Err(PeerError {
                peer,
                kind: PeerErrorKind::NoSuchPeer(self.world_size()),
            });
        }
        if self.inner.is_shutdown() {
            return Err(PeerError {
                peer,
                kind: PeerErrorKind::Shutdown,
            });
        }
        let Some(link) = self.inner.current(peer) else {
            let last = self.inner.peers[peer as usize]
                .last_error
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone();
            return Err(PeerError {
                peer,
                kind: PeerErrorKind::NotConnected(last),
            });
        };
        Ok(link)
    }
}

/// Binds this rank's listen address and starts accepting.
async fn start_listener(inner: &Arc<MeshInner>) -> Result<(), StartError> {
    let me = inner.cfg.protocol.local_rank as usize;
    let addr = inner.cfg.peers[me].addr;
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|source| StartError::Bind { addr, source })?;
    *inner.local_addr.lock().unwrap_or_else(|e| e.into_inner()) = listener.local_addr().ok();
    let h = tokio::spawn(accept_loop(Arc::clone(inner), listener));
    inner.add_task(h.abort_handle());
    Ok(())
}

/// Accepts connections until shutdown, setting each up on its own task. A connection over
/// the handshake limits ([`MeshConfig::handshake_gate`]) is closed at once, unread.
async fn accept_loop(inner: Arc<MeshInner>, listener: TcpListener) {
    loop {
        let (stream, from) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        if inner.is_shutdown() {
            return;
        }
        let permit = match inner.cfg.handshake_gate.try_enter(from.ip()) {
            Ok(p) => p,
            Err(why) => {
                crate::tcp::log_refusal("mesh connection", from, None, &why);
                drop(stream);
                continue;
            }
        };
        let inner2 = Arc::clone(&inner);
        tokio::spawn(async move {
            if let Err(r) = accept_one(&inner2, stream, permit).await {
                let reason = r.error.to_string();
                crate::tcp::log_refusal("mesh connection", from, r.claimed.as_deref(), &reason);
            }
        });
    }
}

/// Sets up a link from an accepted connection and installs it (the handshake's place under
/// the gate is freed once authenticated; `install` decides whether a rank that is already
/// connected is replaced or refused).
async fn accept_one(
    inner: &Arc<MeshInner>,
    stream: TcpStream,
    permit: crate::tcp::HandshakePermit,
) -> Result<(), setup::Refused> {
    let from = stream.peer_addr().ok();
    let est = tokio::select! {
        est = setup::accept(&inner.setup, stream) => est?,
        () = permit.evicted() => {
            return Err(setup::Refused {
                claimed: None,
                error: ProtocolError::Closed(crate::tcp::EVICTED_REASON.into()),
            });
        }
    };
    drop(permit);
    inner.adopt(est, from);
    Ok(())
}

/// Dials `peer` forever (until shutdown), redialling after a failure or a lost link with
/// jittered exponential backoff (from `reconnect_initial`, doubling up to `reconnect_max`,
/// each wait drawn from its upper half so restarted peers do not redial in step). A link that
/// dies young (the peer refused it as a second connection for this rank, or it failed at
/// once) does not reset the backoff: a peer that keeps closing the link is not redialled in a
/// tight loop. TCP connects give up after a connect timeout, so a SYN lost in a partition is
/// retried within about a second of the heal, not on the kernel's retransmission schedule.
/// A shared-memory or RDMA setup failure falls back to TCP for the next try.
async fn dial_loop(inner: Arc<MeshInner>, peer: Rank) {
    let mut redial = Redial::new(
        inner.cfg.reconnect_initial,
        inner.cfg.reconnect_max,
        u64::from(peer) ^ inner.proto_cfg.incarnation,
    );
    let mut fallback_tcp = false;
    let mut failures = 0u32;
    let mut linked_at: Option<Instant> = None;
    while !inner.is_shutdown() {
        if let Some(link) = inner.current(peer) {
            let closed = link.closed_notify.notified();
            tokio::pin!(closed);
            closed.as_mut().enable();
            if !link.is_closed() {
                closed.await;
            }
            let lived = linked_at.take().map_or(Duration::MAX, |t| t.elapsed());
            if lived >= inner.cfg.reconnect_max * 2 {
                redial.reset();
                continue;
            }
            // A young link's loss: wait before redialling, as after a failed dial.
            if !sleep_or_shutdown(&inner, redial.wait()).await {
                return;
            }
            redial.grow();
            continue;
        }
        let spec = inner.cfg.peers[peer as usize].clone();
        let kind = if fallback_tcp {
            LinkKind::Tcp
        } else {
            spec.link
        };
        match setup::dial(&inner.setup, spec.addr, peer, kind).await {
            Ok(est) => {
                inner.adopt(est, None);
                linked_at = Some(Instant::now());
                failures = 0;
            }
            Err(e) => {
                failures += 1;
                let wait = redial.wait();
                let msg = format!("dial {} ({}): {e}", spec.addr, kind.name());
                if failures == 1 || failures.is_multiple_of(20) {
                    tracing::warn!(peer, attempt = failures, "{msg}; retrying in {wait:?}");
                } else {
                    tracing::debug!(peer, attempt = failures, "{msg}");
                }
                inner.record_error(peer, msg);
                if kind != LinkKind::Tcp
                    && matches!(e, ProtocolError::Closed(ref m) if m.starts_with("link setup"))
                {
                    tracing::warn!(
                        peer,
                        "{} link setup failed; falling back to TCP",
                        kind.name()
                    );
                    fallback_tcp = true;
                    continue;
                }
                if !sleep_or_shutdown(&inner, wait).await {
                    return;
                }
                redial.grow();
            }
        }
    }
}

/// Sleeps `d`; false when the mesh shut down meanwhile.
async fn sleep_or_shutdown(inner: &MeshInner, d: Duration) -> bool {
    let shut = inner.shutdown_notify.notified();
    tokio::pin!(shut);
    shut.as_mut().enable();
    if inner.is_shutdown() {
        return false;
    }
    tokio::select! {
        _ = tokio::time::sleep(d) => true,
        _ = shut => false,
    }
}

/// The redial schedule of one dialled peer: a wait drawn from the upper half of the current
/// backoff (xorshift64*, seeded per peer and process, so restarted peers do not redial in
/// step), the backoff doubling from `initial` up to `max` after each wait, back to `initial`
/// after a link that lived. Apart from the clock so its bound is tested exactly: no wait is
/// longer than `max`, however long the peer stays away.
struct Redial {
    initial: Duration,
    max: Duration,
    backoff: Duration,
    state: u64,
}

impl Redial {
    fn new(initial: Duration, max: Duration, seed: u64) -> Self {
        let initial = initial.min(max);
        Self {
            initial,
            max,
            backoff: initial,
            state: seed | 1,
        }
    }

    /// The next wait, drawn uniformly from `[backoff / 2, backoff]`.
    fn wait(&mut self) -> Duration {
        self.state ^= self.state >> 12;
        self.state ^= self.state << 25;
        self.state ^= self.state >> 27;
        let r = self.state.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11; // 53 random bits
        let unit = r as f64 / (1u64 << 53) as f64;
        self.backoff.mul_f64(0.5 + 0.5 * unit)
    }

    /// After a wait: the next one may be twice as long, up to `max`.
    fn grow(&mut self) {
        self.backoff = (self.backoff * 2).min(self.max);
    }

    /// After a link that lived: start again from `initial`.
    fn reset(&mut self) {
        self.backoff = self.initial;
    }
}

#[cfg(test)]
mod redial_tests {
    use super::Redial;
    use std::time::Duration;

    #[test]
    fn waits_double_from_the_initial_up_to_the_cap_and_never_pass_it() {
        let (initial, max) = (Duration::from_millis(20), Duration::from_secs(1));
        for seed in 0..64u64 {
            let mut r = Redial::new(initial, max, seed.wrapping_mul(0x9E37_79B9_7F4A_7C15));
            let mut bound = initial;
            // A peer away for a long outage: thousands of failed dials.
            for _ in 0..5_000 {
                let w = r.wait();
                assert!(
                    w >= bound / 2 && w <= bound,
                    "{w:?} outside [{bound:?}/2, {bound:?}]"
                );
                assert!(w <= max, "{w:?} past the cap");
                r.grow();
                bound = (bound * 2).min(max);
            }
            // Capped: every wait now lies in [max/2, max].
            assert_eq!(r.backoff, max);
            r.reset();
            let w = r.wait();
            assert!(
                w <= initial,
                "after a link that lived the wait starts over: {w:?}"
            );
        }
    }

    #[test]
    fn waits_are_spread_so_restarted_peers_do_not_redial_in_step() {
        let max = Duration::from_secs(1);
        let mut r = Redial::new(max, max, 7);
        let waits: Vec<Duration> = (0..200).map(|_| r.wait()).collect();
        let low = waits.iter().filter(|w| **w < max * 3 / 4).count();
        // Uniform over [max/2, max]: about half below 3/4 of the cap (binomial, 200 draws).
        assert!(
            (50..=150).contains(&low),
            "{low} of 200 waits in the lower half"
        );
        let mut other = Redial::new(max, max, 8);
        assert_ne!(
            waits[..4],
            (0..4).map(|_| other.wait()).collect::<Vec<_>>()[..]
        );
    }
}
