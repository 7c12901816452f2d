//! The rank-to-rank mesh: the [`Transport`] trait, and one engine that runs the sans-IO
//! [`protocol`](crate::protocol) over TCP, shared-memory or RoCE links.
//!
//! Why this exists: the fabric talks to ranks, not sockets. It sends a frame to a rank and
//! receives a stream of `(rank, frame)` events; which link carries them, how the handshake,
//! credits and heartbeats work, and how a dead peer is detected is the same for every driver and
//! lives here. Drivers only move frame bytes ([`FrameWriter`] and a reader that feeds
//! [`Link::on_frame`]).
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
//! receive window of unreleased frames (enforced by the protocol), so the event queue, although
//! an unbounded channel, holds at most `window` bytes per peer.

use crate::codec::{self, Body, CodecError, FrameHeader, PAYLOAD_ALIGN};
use crate::protocol::{Connection, Disposition, PeerInfo, ProtocolConfig, ProtocolError};
use bytes::Bytes;
use expertmesh_quant::aligned::AlignedVec;
use std::fmt;
use std::future::Future;
use std::net::SocketAddr;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};
use tokio::sync::{Notify, mpsc};

/// A rank in the cluster, `0..world_size`.
pub type Rank = u32;

/// Bytes of flow-control credit a frame of `frame_len` bytes costs: its ring record size (a
/// 64-byte record header plus the frame rounded up to 64 bytes), the same on every driver.
pub fn credit_cost(frame_len: usize) -> u64 {
    (PAYLOAD_ALIGN + codec::align_up(frame_len)) as u64
}

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
}

/// Where a rank listens and how to reach it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerAddress {
    /// TCP address the rank listens on (also the rendezvous for shm and RDMA links).
    pub addr: SocketAddr,
    /// Link to use when this node dials the rank.
    pub link: LinkKind,
}

/// Shared-memory driver settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShmConfig {
    /// Directory of the ring files (a tmpfs; `/dev/shm` by default).
    pub dir: PathBuf,
    /// Data bytes of each ring (one ring per direction per pair).
    pub ring_bytes: usize,
    /// How long a consumer whose ring is empty polls before it sleeps on the futex, in
    /// microseconds (0: sleep at once). Polling saves the futex wake-up (a few µs) on busy links;
    /// keep it short on hosts with few cores, where a polling thread competes with the workers.
    pub spin_us: u32,
}

impl Default for ShmConfig {
    fn default() -> Self {
        Self {
            dir: PathBuf::from("/dev/shm"),
            ring_bytes: 64 << 20,
            spin_us: 20,
        }
    }
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
    /// Lower ranks this rank dials (`None`: every lower rank, a full mesh). A star around
    /// rank 0 (workers that only talk to the router) sets `Some(vec![0])` on every other rank
    /// and `Some(vec![])` on rank 0; then only rank 0's address must be reachable.
    pub dial_ranks: Option<Vec<Rank>>,
}

impl MeshConfig {
    /// A configuration for `rank` of `peers.len()` ranks with default settings.
    pub fn new(cluster: impl Into<String>, rank: Rank, peers: Vec<PeerAddress>) -> Self {
        let world = peers.len() as u32;
        Self {
            protocol: ProtocolConfig::new(cluster, rank, world),
            peers,
            reconnect_initial: Duration::from_millis(20),
            reconnect_max: Duration::from_secs(2),
            shm: ShmConfig::default(),
            rdma_device: None,
            dial_ranks: None,
        }
    }
}

/// Why an operation on a peer failed. Always names the peer.
#[derive(Debug, Clone, thiserror::Error)]
#[error("rank {peer}: {kind}")]
pub struct PeerError {
    /// The peer.
    pub peer: Rank,
    /// What went wrong.
    pub kind: PeerErrorKind,
}

/// The kinds of [`PeerError`].
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum PeerErrorKind {
    /// No established link to the peer (never connected, or lost and not yet re-established).
    #[error("not connected{}", .0.as_deref().map(|e| format!(" (last error: {e})")).unwrap_or_default())]
    NotConnected(Option<String>),
    /// The link failed.
    #[error("link failed: {0}")]
    LinkFailed(String),
    /// The protocol closed the link.
    #[error("{0}")]
    Protocol(#[from] ProtocolError),
    /// The outgoing frame is invalid (never sent).
    #[error("frame not sent: {0}")]
    BadFrame(#[from] CodecError),
    /// The rank is outside the cluster or is this node.
    #[error("no such peer in a cluster of {0} ranks (or it is this node)")]
    NoSuchPeer(u32),
    /// The mesh was shut down.
    #[error("transport shut down")]
    Shutdown,
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

/// A frame to send: the body and its payload (shared, so one buffer can go to several peers).
#[derive(Debug, Clone)]
pub struct OutFrame {
    /// Kind-specific metadata.
    pub body: Body,
    /// Payload bytes (length must match what the body describes).
    pub payload: Bytes,
}

impl OutFrame {
    /// A frame without payload.
    pub fn new(body: Body) -> Self {
        Self {
            body,
            payload: Bytes::new(),
        }
    }

    /// A frame with a payload.
    pub fn with_payload(body: Body, payload: impl Into<Bytes>) -> Self {
        Self {
            body,
            payload: payload.into(),
        }
    }
}

/// Per-peer flow-control figures, for tests, metrics and the bench.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerStats {
    /// The link carrying the peer's frames.
    pub link: LinkKind,
    /// Bytes this node may still send before waiting for credit.
    pub send_credit: u64,
    /// The peer's receive window.
    pub peer_window: u64,
    /// Bytes of the peer's frames delivered here and not yet released (dropped).
    pub recv_outstanding: u64,
    /// This node's receive window.
    pub recv_window: u64,
    /// Bytes held in this link's receive buffer pool (allocated, idle or in use).
    pub recv_pool_bytes: u64,
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
    },
    /// A link to a peer failed; sends to it fail until it is back.
    PeerLost(PeerError),
}

/// Where a received frame's bytes live.
pub(crate) enum Storage {
    /// A pooled, 64-byte aligned heap buffer.
    Heap {
        buf: Option<AlignedVec<u8>>,
        pool: Weak<BufPool>,
    },
    /// A record in a shared-memory ring, released to the producer on drop.
    Shm(crate::shm::RingLease),
}

impl Storage {
    fn bytes(&self) -> &[u8] {
        match self {
            Self::Heap { buf, .. } => buf.as_deref().unwrap_or(&[]),
            Self::Shm(l) => l.bytes(),
        }
    }
}

/// A received application frame. Its payload is 64-byte aligned. Dropping it releases its
/// bytes to the peer's flow-control window (and its buffer to the pool): keep frames only as
/// long as needed, or the peer will wait.
pub struct RecvFrame {
    peer: Rank,
    body: Body,
    frame_len: usize,
    payload: Range<usize>,
    storage: Storage,
    link: Weak<Link>,
}

impl fmt::Debug for RecvFrame {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RecvFrame")
            .field("peer", &self.peer)
            .field("body", &self.body)
            .field("payload_len", &self.payload.len())
            .finish()
    }
}

impl RecvFrame {
    /// The sending rank.
    pub fn peer(&self) -> Rank {
        self.peer
    }

    /// The frame's metadata.
    pub fn body(&self) -> &Body {
        &self.body
    }

    /// The payload (64-byte aligned).
    pub fn payload(&self) -> &[u8] {
        &self.storage.bytes()[self.payload.clone()]
    }

    /// Total encoded length of the frame.
    pub fn frame_len(&self) -> usize {
        self.frame_len
    }
}

impl Drop for RecvFrame {
    fn drop(&mut self) {
        if let Storage::Heap { buf, pool } = &mut self.storage
            && let (Some(b), Some(p)) = (buf.take(), pool.upgrade())
        {
            p.put(b);
        }
        if let Some(link) = self.link.upgrade() {
            link.release(credit_cost(self.frame_len));
        }
    }
}

/// A bounded pool of aligned receive buffers for one link.
#[derive(Debug)]
pub(crate) struct BufPool {
    free: Mutex<Vec<AlignedVec<u8>>>,
    allocated: AtomicU64,
    max_idle_bytes: u64,
}

impl BufPool {
    pub(crate) fn new(max_idle_bytes: u64) -> Arc<Self> {
        Arc::new(Self {
            free: Mutex::new(Vec::new()),
            allocated: AtomicU64::new(0),
            max_idle_bytes,
        })
    }

    /// A buffer of at least `len` bytes (its first `len` bytes are what the caller fills).
    pub(crate) fn take(&self, len: usize) -> AlignedVec<u8> {
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = free
            .iter()
            .position(|b| b.len() >= len && b.len() <= (2 * len).max(4096))
        {
            return free.swap_remove(i);
        }
        drop(free);
        let cap = len.next_power_of_two().max(4096);
        self.allocated.fetch_add(cap as u64, Ordering::Relaxed);
        AlignedVec::zeroed(cap)
    }

    fn put(&self, b: AlignedVec<u8>) {
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        let idle: u64 = free.iter().map(|b| b.len() as u64).sum();
        if idle + b.len() as u64 <= self.max_idle_bytes {
            free.push(b);
        } else {
            self.allocated.fetch_sub(b.len() as u64, Ordering::Relaxed);
        }
    }

    fn allocated_bytes(&self) -> u64 {
        self.allocated.load(Ordering::Relaxed)
    }
}

/// The sending half of a link, per driver.
pub(crate) enum FrameWriter {
    Tcp(tokio::net::tcp::OwnedWriteHalf),
    Shm(crate::shm::RingProducer),
    #[cfg(feature = "rdma")]
    Rdma(crate::rdma::RdmaWriter),
}

impl FrameWriter {
    async fn write_frame(&mut self, head: &[u8], payload: &[u8]) -> Result<(), String> {
        match self {
            Self::Tcp(w) => crate::tcp::write_vectored_all(w, head, payload)
                .await
                .map_err(|e| format!("TCP write: {e}")),
            Self::Shm(p) => p
                .write_frame(head, payload)
                .await
                .map_err(|e| e.to_string()),
            #[cfg(feature = "rdma")]
            Self::Rdma(r) => r
                .write_frame(head, payload)
                .await
                .map_err(|e| e.to_string()),
        }
    }

    async fn shutdown(&mut self) {
        match self {
            Self::Tcp(w) => {
                use tokio::io::AsyncWriteExt;
                let _ = w.shutdown().await;
            }
            Self::Shm(p) => p.close(),
            #[cfg(feature = "rdma")]
            Self::Rdma(r) => r.close(),
        }
    }
}

/// One established link to one peer.
pub(crate) struct Link {
    pub(crate) peer: Rank,
    pub(crate) kind: LinkKind,
    codec: codec::CodecConfig,
    proto: Mutex<Connection>,
    credit: Notify,
    ctrl: Notify,
    writer: tokio::sync::Mutex<FrameWriter>,
    closed: AtomicBool,
    pub(crate) closed_notify: Notify,
    pub(crate) pool: Arc<BufPool>,
    mesh: Weak<MeshInner>,
    tasks: Mutex<Vec<tokio::task::AbortHandle>>,
    recv_window: u64,
}

impl Link {
    pub(crate) fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    fn lock_proto(&self) -> std::sync::MutexGuard<'_, Connection> {
        self.proto.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn err(&self, kind: PeerErrorKind) -> PeerError {
        PeerError {
            peer: self.peer,
            kind,
        }
    }

    fn close_error(&self) -> PeerError {
        match self.lock_proto().close_reason() {
            Some(e) => self.err(PeerErrorKind::Protocol(e.clone())),
            None => self.err(PeerErrorKind::LinkFailed("link closed".into())),
        }
    }

    /// Marks the link failed: wakes every waiting send, emits `PeerLost`, stops its tasks.
    pub(crate) fn fail(self: &Arc<Self>, err: ProtocolError) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        self.lock_proto().transport_failed(err.clone());
        let reason = self.lock_proto().close_reason().cloned().unwrap_or(err);
        tracing::warn!(
            peer = self.peer,
            link = self.kind.name(),
            "link closed: {reason}"
        );
        self.credit.notify_waiters();
        self.ctrl.notify_one();
        self.closed_notify.notify_waiters();
        if let Some(mesh) = self.mesh.upgrade() {
            mesh.link_closed(self, PeerErrorKind::Protocol(reason));
        }
        let me = Arc::clone(self);
        tokio_spawn_detached(async move {
            me.writer.lock().await.shutdown().await;
            for t in me.tasks.lock().unwrap_or_else(|e| e.into_inner()).drain(..) {
                t.abort();
            }
        });
    }

    pub(crate) fn add_task(&self, h: tokio::task::AbortHandle) {
        self.tasks.lock().unwrap_or_else(|e| e.into_inner()).push(h);
    }

    fn release(&self, cost: u64) {
        let mut p = self.lock_proto();
        p.release(cost);
        if p.has_transmit() {
            drop(p);
            self.ctrl.notify_one();
        }
    }

    /// Handles one frame read by the driver: protocol frames are consumed, application frames
    /// returned for delivery. An error means the link must close.
    pub(crate) fn on_frame(
        self: &Arc<Self>,
        header: &FrameHeader,
        storage: Storage,
    ) -> Result<Option<RecvFrame>, ProtocolError> {
        let bytes = storage.bytes();
        let (body, payload) =
            codec::decode_with_header(header, &bytes[..header.frame_len as usize])?;
        let frame_len = header.frame_len as usize;
        let disp = {
            let mut p = self.lock_proto();
            let d = p.handle_frame(Instant::now(), &body, credit_cost(frame_len));
            if p.has_transmit() {
                self.ctrl.notify_one();
            }
            d?
        };
        match disp {
            Disposition::Consumed => {
                if matches!(body, Body::Credit(_)) {
                    self.credit.notify_waiters();
                }
                // Dropping `storage` returns a heap buffer to the pool; shm leases release.
                recycle(storage);
                Ok(None)
            }
            Disposition::Deliver => Ok(Some(RecvFrame {
                peer: self.peer,
                body,
                frame_len,
                payload,
                storage,
                link: Arc::downgrade(self),
            })),
        }
    }

    /// Delivers a frame to the mesh's event queue.
    pub(crate) fn deliver(&self, frame: RecvFrame) {
        if let Some(mesh) = self.mesh.upgrade() {
            let _ = mesh.events.send(TransportEvent::Frame(frame));
        }
    }

    async fn send(self: &Arc<Self>, frame: &OutFrame, head: &mut Vec<u8>) -> Result<(), PeerError> {
        let len = codec::encode_head(&frame.body, &frame.payload, &self.codec, head)
            .map_err(|e| self.err(PeerErrorKind::BadFrame(e)))?;
        let cost = credit_cost(len);
        loop {
            let notified = self.credit.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.is_closed() {
                return Err(self.close_error());
            }
            match self.lock_proto().try_reserve(cost) {
                Ok(true) => break,
                Ok(false) => {}
                Err(e) => return Err(self.err(PeerErrorKind::Protocol(e))),
            }
            notified.await;
        }
        let mut w = self.writer.lock().await;
        if self.is_closed() {
            return Err(self.close_error());
        }
        // A send cancelled mid-frame would leave a torn frame on the wire: fail the link.
        let guard = TornWriteGuard { link: Some(self) };
        let r = w.write_frame(head, &frame.payload).await;
        std::mem::forget(guard);
        drop(w);
        match r {
            Ok(()) => {
                self.lock_proto().on_transmit(Instant::now());
                Ok(())
            }
            Err(e) => {
                self.fail(ProtocolError::Closed(e.clone()));
                Err(self.err(PeerErrorKind::LinkFailed(e)))
            }
        }
    }

    /// Writes pending protocol frames (credits, heartbeats, a closing error).
    async fn flush_control(self: &Arc<Self>, head: &mut Vec<u8>) -> Result<(), String> {
        let mut w = self.writer.lock().await;
        loop {
            let Some(body) = self.lock_proto().poll_transmit() else {
                return Ok(());
            };
            if codec::encode_head(&body, &[], &self.codec, head).is_ok() {
                w.write_frame(head, &[]).await?;
                self.lock_proto().on_transmit(Instant::now());
            }
        }
    }

    /// The per-link control task: timers (heartbeats, idle timeout) and control frames.
    pub(crate) async fn control_loop(self: Arc<Self>) {
        let mut head = Vec::with_capacity(256);
        loop {
            let deadline = self.lock_proto().poll_timeout();
            let sleep = async {
                match deadline {
                    Some(d) => tokio::time::sleep_until(tokio::time::Instant::from_std(d)).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = self.ctrl.notified() => {}
                _ = sleep => {}
            }
            self.lock_proto().handle_timeout(Instant::now());
            if let Err(e) = self.flush_control(&mut head).await {
                self.fail(ProtocolError::Closed(e));
                return;
            }
            let reason = self.lock_proto().close_reason().cloned();
            if let Some(r) = reason {
                self.fail(r);
                return;
            }
            if self.is_closed() {
                return;
            }
        }
    }

    fn stats(&self) -> PeerStats {
        let p = self.lock_proto();
        PeerStats {
            link: self.kind,
            send_credit: p.send_credit(),
            peer_window: p.peer().map_or(0, |i| i.recv_window_bytes),
            recv_outstanding: p.recv_outstanding(),
            recv_window: self.recv_window,
            recv_pool_bytes: self.pool.allocated_bytes(),
        }
    }
}

fn recycle(storage: Storage) {
    if let Storage::Heap { mut buf, pool } = storage
        && let (Some(b), Some(p)) = (buf.take(), pool.upgrade())
    {
        p.put(b);
    }
}

struct TornWriteGuard<'a> {
    link: Option<&'a Arc<Link>>,
}

impl Drop for TornWriteGuard<'_> {
    fn drop(&mut self) {
        if let Some(l) = self.link.take() {
            l.fail(ProtocolError::Closed(
                "a send was cancelled in the middle of a frame".into(),
            ));
        }
    }
}

fn tokio_spawn_detached<F: Future<Output = ()> + Send + 'static>(f: F) {
    if let Ok(h) = tokio::runtime::Handle::try_current() {
        h.spawn(f);
    }
}

/// What a driver hands the mesh after a successful handshake.
pub(crate) struct NewLink {
    pub(crate) peer: PeerInfo,
    pub(crate) kind: LinkKind,
    pub(crate) proto: Connection,
    pub(crate) writer: FrameWriter,
    pub(crate) recv_window: u64,
}

struct PeerSlot {
    current: Mutex<Option<Arc<Link>>>,
    last_error: Mutex<Option<String>>,
}

pub(crate) struct MeshInner {
    pub(crate) cfg: MeshConfig,
    pub(crate) proto_cfg: Arc<ProtocolConfig>,
    peers: Vec<PeerSlot>,
    events: mpsc::UnboundedSender<TransportEvent>,
    pub(crate) shutdown: AtomicBool,
    pub(crate) shutdown_notify: Notify,
    tasks: Mutex<Vec<tokio::task::AbortHandle>>,
    pub(crate) local_addr: Mutex<Option<SocketAddr>>,
}

impl MeshInner {
    pub(crate) fn is_shutdown(&self) -> bool {
        self.shutdown.load(Ordering::Acquire)
    }

    /// Installs an established link for its peer, replacing an older one.
    pub(crate) fn install(self: &Arc<Self>, new: NewLink) -> Arc<Link> {
        let rank = new.peer.rank;
        let pool_idle = new.recv_window.min(256 << 20);
        let link = Arc::new(Link {
            peer: rank,
            kind: new.kind,
            codec: self.proto_cfg.codec,
            proto: Mutex::new(new.proto),
            credit: Notify::new(),
            ctrl: Notify::new(),
            writer: tokio::sync::Mutex::new(new.writer),
            closed: AtomicBool::new(false),
            closed_notify: Notify::new(),
            pool: BufPool::new(pool_idle),
            mesh: Arc::downgrade(self),
            tasks: Mutex::new(Vec::new()),
            recv_window: new.recv_window,
        });
        let old = {
            let slot = &self.peers[rank as usize];
            let mut cur = slot.current.lock().unwrap_or_else(|e| e.into_inner());
            cur.replace(Arc::clone(&link))
        };
        if let Some(old) = old {
            old.fail(ProtocolError::Closed(
                "superseded by a new connection from the same rank".into(),
            ));
        }
        let ctl = tokio::spawn(Arc::clone(&link).control_loop());
        link.add_task(ctl.abort_handle());
        tracing::info!(peer = rank, link = new.kind.name(), "link established");
        let _ = self.events.send(TransportEvent::PeerUp {
            peer: rank,
            link: new.kind,
        });
        link
    }

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
            let _ = self.events.send(TransportEvent::PeerLost(PeerError {
                peer: link.peer,
                kind,
            }));
        }
    }

    pub(crate) fn record_error(&self, peer: Rank, msg: String) {
        if let Some(slot) = self.peers.get(peer as usize) {
            *slot.last_error.lock().unwrap_or_else(|e| e.into_inner()) = Some(msg);
        }
    }

    pub(crate) fn add_task(&self, h: tokio::task::AbortHandle) {
        self.tasks.lock().unwrap_or_else(|e| e.into_inner()).push(h);
    }

    pub(crate) fn current(&self, peer: Rank) -> Option<Arc<Link>> {
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
    rx: mpsc::UnboundedReceiver<TransportEvent>,
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
    pub(crate) inner: Arc<MeshInner>,
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
        if cfg.peers.iter().any(|p| p.link == LinkKind::Rdma) && !cfg!(feature = "rdma") {
            return Err(StartError::Config(
                "an RDMA link is configured but this build lacks feature `rdma`; rebuild with --features rdma or use tcp".into(),
            ));
        }
        let shm_need = cfg.protocol.codec.max_frame_bytes * 2 + 2 * PAYLOAD_ALIGN;
        if cfg.peers.iter().any(|p| p.link == LinkKind::Shm) && cfg.shm.ring_bytes < shm_need {
            return Err(StartError::Config(format!(
                "shm.ring_bytes {} must be at least twice max_frame_bytes plus 128 ({shm_need})",
                cfg.shm.ring_bytes
            )));
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let proto_cfg = Arc::new(cfg.protocol.clone());
        let inner = Arc::new(MeshInner {
            proto_cfg,
            peers: (0..world)
                .map(|_| PeerSlot {
                    current: Mutex::new(None),
                    last_error: Mutex::new(None),
                })
                .collect(),
            events: tx,
            shutdown: AtomicBool::new(false),
            shutdown_notify: Notify::new(),
            tasks: Mutex::new(Vec::new()),
            local_addr: Mutex::new(None),
            cfg,
        });
        crate::tcp::start_listener(&inner).await?;
        for peer in 0..inner.cfg.protocol.local_rank {
            if inner
                .cfg
                .dial_ranks
                .as_ref()
                .is_some_and(|d| !d.contains(&peer))
            {
                continue;
            }
            let h = tokio::spawn(crate::tcp::dial_loop(Arc::clone(&inner), peer));
            inner.add_task(h.abort_handle());
        }
        Ok((Mesh { inner }, MeshEvents { rx }))
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
        let mut head = Vec::with_capacity(256);
        link.send(frame, &mut head).await
    }

    fn is_connected(&self, peer: Rank) -> bool {
        self.inner.current(peer).is_some()
    }
}
