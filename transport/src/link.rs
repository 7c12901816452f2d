//! The link layer: one established link to one peer, whatever driver carries it, and the types
//! every driver and the mesh share (ranks, received frames and their storage, the receive
//! buffer pool, the frame writer interface, the wait for room in a full ring, peer errors).
//!
//! Why this exists: the drivers ([`tcp`](crate::tcp), [`shm`](crate::shm), `rdma`) and the
//! [`mesh`](crate::mesh) all need these types, and the drivers must not depend on the mesh (nor
//! on each other). A driver moves frame bytes only: it implements [`FrameSink`] for its sending
//! half and feeds what it reads to [`Link::on_frame`]; a link reports frames and its own failure
//! to its owner (the mesh) through [`LinkOwner`], so this module knows nothing of the mesh.
//!
//! Memory bounds: received frames are bounded by the receive window (the protocol closes a peer
//! that sends beyond its credit); frames live in pooled heap buffers ([`BufPool`], at most
//! `max_idle_bytes` kept idle) or in place in a driver's shared region ([`Lease`]).

use crate::codec::{self, Body, CodecError, FrameHeader, PAYLOAD_ALIGN};
pub use crate::protocol::LinkKind;
use crate::protocol::{Connection, Disposition, PeerInfo, ProtocolError};
use bytes::Bytes;
use expertmesh_quant::aligned::AlignedVec;
use std::fmt;
use std::future::Future;
use std::ops::Range;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};
use tokio::sync::Notify;

/// A rank in the cluster, `0..world_size`.
pub type Rank = u32;

/// Bytes of flow-control credit a frame of `frame_len` bytes costs: its ring record size (a
/// 64-byte record header plus the frame rounded up to 64 bytes), the same on every driver.
pub fn credit_cost(frame_len: usize) -> u64 {
    (PAYLOAD_ALIGN + codec::align_up(frame_len)) as u64
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
    /// The frame was bound to a link of the peer that has since been replaced by a newer
    /// connection (the peer restarted): it belongs to the old one and is not sent.
    #[error(
        "the link this frame belongs to (generation {0}) was replaced by a newer connection; not sent"
    )]
    LinkReplaced(u64),
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

/// Where a received frame's bytes live.
pub(crate) enum Storage {
    /// A pooled, 64-byte aligned heap buffer.
    Heap {
        buf: Option<AlignedVec<u8>>,
        pool: Weak<BufPool>,
    },
    /// A record in place in a driver's shared region (a shared-memory ring), released to the
    /// producer on drop.
    Lease(Lease),
}

impl Storage {
    fn bytes(&self) -> &[u8] {
        match self {
            Self::Heap { buf, .. } => buf.as_deref().unwrap_or(&[]),
            Self::Lease(l) => l.bytes(),
        }
    }
}

/// A region of memory shared with the peer in which received frames are handed out in place.
pub(crate) trait Region: Send + Sync {
    /// The `len` bytes at `off`. Called only for the frame of a live [`Lease`]: the region
    /// guarantees those bytes stay unchanged until the lease is released.
    fn frame(&self, off: usize, len: usize) -> &[u8];
    /// The lease of the record starting at `record_pos` was dropped.
    fn release(&self, record_pos: u64);
}

/// A received frame in place in a [`Region`]; its record is released when the lease is dropped.
pub(crate) struct Lease {
    region: Arc<dyn Region>,
    record_pos: u64,
    frame_off: usize,
    frame_len: usize,
}

impl Lease {
    /// Leases the frame of `frame_len` bytes at `frame_off` of the record at `record_pos`.
    pub(crate) fn new(
        region: Arc<dyn Region>,
        record_pos: u64,
        frame_off: usize,
        frame_len: usize,
    ) -> Self {
        Self {
            region,
            record_pos,
            frame_off,
            frame_len,
        }
    }

    /// The frame's bytes.
    pub(crate) fn bytes(&self) -> &[u8] {
        self.region.frame(self.frame_off, self.frame_len)
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.region.release(self.record_pos);
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
    generation: u64,
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

    /// Which link of its peer carried the frame (see [`crate::mesh::Mesh::send_on`]): work
    /// answered with `send_on` and this generation never reaches a newer connection of the
    /// peer (a restarted router gets no answers to its predecessor's dispatches).
    pub fn link_generation(&self) -> u64 {
        self.generation
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
    /// A pool that keeps at most `max_idle_bytes` of idle buffers.
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

/// A boxed future of a [`FrameSink`] method.
pub(crate) type SinkFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The sending half of a link, implemented by each driver (TCP socket, shared-memory ring,
/// RDMA queue pair).
pub(crate) trait FrameSink: Send {
    /// Writes one frame (`head` then `payload`), waiting for room if the driver needs to.
    fn write_frame<'a>(
        &'a mut self,
        head: &'a [u8],
        payload: &'a [u8],
    ) -> SinkFuture<'a, Result<(), String>>;
    /// Closes the sending half (best effort).
    fn shutdown(&mut self) -> SinkFuture<'_, ()>;
}

/// The sending half of a link, whatever its driver.
pub(crate) struct FrameWriter(Box<dyn FrameSink>);

impl FrameWriter {
    /// Wraps a driver's sending half.
    pub(crate) fn new(sink: impl FrameSink + 'static) -> Self {
        Self(Box::new(sink))
    }

    async fn write_frame(&mut self, head: &[u8], payload: &[u8]) -> Result<(), String> {
        self.0.write_frame(head, payload).await
    }

    async fn shutdown(&mut self) {
        self.0.shutdown().await
    }
}

/// The owner of established links (the mesh): receives their frames and hears of their failure.
pub(crate) trait LinkOwner: Send + Sync {
    /// An application frame arrived on `link`.
    fn deliver(&self, link: &Arc<Link>, frame: RecvFrame);
    /// `link` failed; `kind` says why.
    fn link_closed(&self, link: &Arc<Link>, kind: PeerErrorKind);
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
    owner: Weak<dyn LinkOwner>,
    tasks: Mutex<Vec<tokio::task::AbortHandle>>,
    recv_window: u64,
    /// Which link of its peer this is: the mesh numbers a rank's links 1, 2, ... as they are
    /// installed, and sends bound to one ([`crate::mesh::Mesh::send_on`]) fail on another.
    pub(crate) generation: u64,
    /// When the link was made, and microseconds after that when a frame (any, heartbeats
    /// included) last arrived.
    created: Instant,
    heard_us: AtomicU64,
}

impl Link {
    /// A link for a completed handshake, reporting to `owner`. Its receive buffer pool keeps at
    /// most the receive window (capped at 256 MiB) of idle buffers.
    pub(crate) fn new(
        new: NewLink,
        codec: codec::CodecConfig,
        owner: Weak<dyn LinkOwner>,
        generation: u64,
    ) -> Self {
        let pool_idle = new.recv_window.min(256 << 20);
        Link {
            peer: new.peer.rank,
            kind: new.kind,
            codec,
            proto: Mutex::new(new.proto),
            credit: Notify::new(),
            ctrl: Notify::new(),
            writer: tokio::sync::Mutex::new(new.writer),
            closed: AtomicBool::new(false),
            closed_notify: Notify::new(),
            pool: BufPool::new(pool_idle),
            owner,
            tasks: Mutex::new(Vec::new()),
            recv_window: new.recv_window,
            generation,
            created: Instant::now(),
            heard_us: AtomicU64::new(0),
        }
    }

    /// The bytes of credit this end grants its peer (what the peer may have in flight here).
    pub(crate) fn recv_window(&self) -> u64 {
        self.recv_window
    }

    /// Whether the link has failed or been closed.
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
        if matches!(reason, ProtocolError::Closed(_)) {
            // Closed on purpose by this side (shutdown): not a fault.
            tracing::info!(
                peer = self.peer,
                link = self.kind.name(),
                "link closed: {reason}"
            );
        } else {
            tracing::warn!(
                peer = self.peer,
                link = self.kind.name(),
                "link closed: {reason}"
            );
        }
        self.credit.notify_waiters();
        self.ctrl.notify_one();
        self.closed_notify.notify_waiters();
        if let Some(owner) = self.owner.upgrade() {
            owner.link_closed(self, PeerErrorKind::Protocol(reason));
        }
        let me = Arc::clone(self);
        tokio_spawn_detached(async move {
            me.writer.lock().await.shutdown().await;
            for t in me.tasks.lock().unwrap_or_else(|e| e.into_inner()).drain(..) {
                t.abort();
            }
        });
    }

    /// Registers a task (reader, watcher, control loop) to abort when the link closes.
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
        let now = Instant::now();
        let heard = now.saturating_duration_since(self.created).as_micros();
        self.heard_us.store(heard as u64, Ordering::Relaxed);
        let disp = {
            let mut p = self.lock_proto();
            let d = p.handle_frame(now, &body, credit_cost(frame_len));
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
                generation: self.generation,
            })),
        }
    }

    /// Delivers a frame to the link's owner (the mesh's event queue).
    pub(crate) fn deliver(self: &Arc<Self>, frame: RecvFrame) {
        if let Some(owner) = self.owner.upgrade() {
            owner.deliver(self, frame);
        }
    }

    /// Sends one application frame: waits for credit, then writes it. Fails naming the peer.
    pub(crate) async fn send(
        self: &Arc<Self>,
        frame: &OutFrame,
        head: &mut Vec<u8>,
    ) -> Result<(), PeerError> {
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
        // Credit taken for a frame not yet written: a send cancelled while it waits for the
        // writer gives it back (otherwise every such cancellation shrinks the window for good).
        let mut reserved = ReservedCredit {
            link: self,
            cost: Some(cost),
        };
        // A link that fails while this frame waits for room (a frozen or partitioned peer whose
        // socket buffers are full) ends the write: a blocked write would hold the writer, and
        // the link's shutdown with it, for as long as the peer's kernel answers TCP's window
        // probes (for ever, for a frozen process).
        let closed = self.closed_notify.notified();
        tokio::pin!(closed);
        closed.as_mut().enable();
        let mut w = self.writer.lock().await;
        if self.is_closed() {
            return Err(self.close_error());
        }
        reserved.cost = None;
        // A send cancelled mid-frame would leave a torn frame on the wire: fail the link.
        let guard = TornWriteGuard { link: Some(self) };
        let written = tokio::select! {
            r = w.write_frame(head, &frame.payload) => Some(r),
            () = &mut closed => None,
        };
        std::mem::forget(guard);
        drop(w);
        let Some(r) = written else {
            return Err(self.close_error());
        };
        match r {
            Ok(()) => {
                self.lock_proto().on_transmit(Instant::now());
                Ok(())
            }
            Err(e) => {
                self.fail(ProtocolError::Lost(e.clone()));
                Err(self.err(PeerErrorKind::LinkFailed(e)))
            }
        }
    }

    /// Writes pending protocol frames (credits, heartbeats, a closing error).
    /// Ends early, with nothing more written, when the link fails meanwhile (see [`Self::send`]).
    async fn flush_control(self: &Arc<Self>, head: &mut Vec<u8>) -> Result<(), String> {
        let closed = self.closed_notify.notified();
        tokio::pin!(closed);
        closed.as_mut().enable();
        let mut w = self.writer.lock().await;
        loop {
            if self.is_closed() {
                return Ok(());
            }
            let Some(body) = self.lock_proto().poll_transmit() else {
                return Ok(());
            };
            if codec::encode_head(&body, &[], &self.codec, head).is_ok() {
                tokio::select! {
                    r = w.write_frame(head, &[]) => r?,
                    () = &mut closed => return Ok(()),
                }
                self.lock_proto().on_transmit(Instant::now());
            }
        }
    }

    /// The per-link control task: timers (heartbeats, idle timeout) and control frames.
    pub(crate) async fn control_loop(self: Arc<Self>) {
        let mut head = Vec::with_capacity(256);
        loop {
            tokio::select! {
                _ = self.ctrl.notified() => {}
                _ = self.next_timer(Instant::now()) => {}
            }
            self.lock_proto().handle_timeout(Instant::now());
            let closing = self.lock_proto().close_reason().is_some();
            // The timers keep running while the control frames wait for the writer or for
            // room: a send blocked on a frozen peer's full socket or ring holds the writer,
            // and only the idle timeout (which fails the link and so ends that write) can
            // free it. A closing error frame gets [`CLOSE_FLUSH_GRACE`] to go out.
            // (A heartbeat queued behind a busy writer leaves its timer due: the timer is
            // looked at again a millisecond later at the soonest, not in a spin.)
            let flush = self.flush_control(&mut head);
            tokio::pin!(flush);
            let grace = tokio::time::sleep(CLOSE_FLUSH_GRACE);
            tokio::pin!(grace);
            let mut not_before = Instant::now();
            let flushed = loop {
                tokio::select! {
                    r = &mut flush => break Some(r),
                    _ = self.next_timer(not_before), if !closing => {
                        let now = Instant::now();
                        self.lock_proto().handle_timeout(now);
                        if self.lock_proto().close_reason().is_some() {
                            break None;
                        }
                        not_before = now + Duration::from_millis(1);
                    }
                    _ = &mut grace, if closing => break None,
                }
            };
            if let Some(Err(e)) = flushed {
                self.fail(ProtocolError::Lost(e));
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

    /// Resolves at the protocol's next timer (heartbeat, idle timeout), but not before
    /// `not_before`; never if it has none.
    async fn next_timer(&self, not_before: Instant) {
        let deadline = self.lock_proto().poll_timeout();
        match deadline {
            Some(d) => {
                let at = d.max(not_before);
                tokio::time::sleep_until(tokio::time::Instant::from_std(at)).await
            }
            None => std::future::pending().await,
        }
    }

    /// When a frame from the peer last arrived (the link's creation before the first).
    pub(crate) fn last_heard(&self) -> Instant {
        self.created + std::time::Duration::from_micros(self.heard_us.load(Ordering::Relaxed))
    }

    /// The peer process's incarnation, as its hello announced it.
    pub(crate) fn peer_incarnation(&self) -> Option<u64> {
        self.lock_proto().peer().map(|p| p.incarnation)
    }

    /// Flow-control figures of this link.
    pub(crate) fn stats(&self) -> PeerStats {
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

/// Returns a consumed frame's heap buffer to its pool.
fn recycle(storage: Storage) {
    if let Storage::Heap { mut buf, pool } = storage
        && let (Some(b), Some(p)) = (buf.take(), pool.upgrade())
    {
        p.put(b);
    }
}

/// Send credit taken by [`Link::send`] for a frame that has not reached the writer: dropped
/// with `cost` set (the send was cancelled), it returns the credit and wakes the senders
/// waiting for some.
struct ReservedCredit<'a> {
    link: &'a Arc<Link>,
    cost: Option<u64>,
}

impl Drop for ReservedCredit<'_> {
    fn drop(&mut self) {
        if let Some(cost) = self.cost.take() {
            self.link.lock_proto().unreserve(cost);
            self.link.credit.notify_waiters();
        }
    }
}

/// A frame being written: dropped before it is forgotten (a send cancelled mid-frame), it fails
/// the link.
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

/// How long a closing link waits for its closing error frame to be written before it closes
/// anyway (the peer may be the reason it closes: frozen, not reading).
const CLOSE_FLUSH_GRACE: Duration = Duration::from_secs(1);

/// How long a driver polls (yielding to other tasks) for room in a full ring or send queue
/// before it sleeps: the peer usually frees room within microseconds, and a timer sleep lasts
/// at least a millisecond whatever it asks for.
const ROOM_POLL: Duration = Duration::from_micros(100);

/// One step of a driver's wait for room: yields to other tasks while the wait (begun at
/// `since`, set on the first call) is younger than [`ROOM_POLL`], then sleeps `nap`.
pub(crate) async fn wait_for_room(since: &mut Option<Instant>, nap: Duration) {
    let began = *since.get_or_insert_with(Instant::now);
    if began.elapsed() < ROOM_POLL {
        tokio::task::yield_now().await;
    } else {
        tokio::time::sleep(nap).await;
    }
}

/// Spawns `f` on the current runtime, if there is one (a link may fail after it shut down).
fn tokio_spawn_detached<F: Future<Output = ()> + Send + 'static>(f: F) {
    if let Ok(h) = tokio::runtime::Handle::try_current() {
        h.spawn(f);
    }
}

/// What link setup hands the mesh after a successful handshake.
pub(crate) struct NewLink {
    pub(crate) peer: PeerInfo,
    pub(crate) kind: LinkKind,
    pub(crate) proto: Connection,
    pub(crate) writer: FrameWriter,
    pub(crate) recv_window: u64,
}

/// This process's incarnation: drawn once, at random, nonzero. Every mesh of the process
/// announces it in its hellos unless its configuration sets another, so peers tell a
/// restarted process from its previous life.
pub fn process_incarnation() -> u64 {
    static INCARNATION: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *INCARNATION.get_or_init(|| {
        let n = nonce();
        u64::from_le_bytes(n[..8].try_into().expect("8 bytes")).max(1)
    })
}

/// Fresh random bytes from the system's source (`getrandom`: no file to open, so a process at
/// its descriptor limit still gets them), for a handshake's hello nonce. No fallback: a
/// handshake whose transcript is not fresh could be replayed, so it fails instead.
pub(crate) fn random_nonce() -> Result<[u8; 32], String> {
    let mut n = [0u8; 32];
    ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut n)
        .map_err(|_| "the system's random source (getrandom) failed".to_owned())?;
    Ok(n)
}

/// Bytes that differ per call and per process, to name shared-memory rings, seed RDMA PSNs
/// and tell process lives apart: [`random_nonce`], or where the system's source fails, time
/// and address bits (unique, not secret). Never for a handshake.
pub(crate) fn nonce() -> [u8; 32] {
    if let Ok(n) = random_nonce() {
        return n;
    }
    let mut n = [0u8; 32];
    let t = Instant::now();
    let mix = format!("{t:?}{:p}{}", &n, std::process::id());
    let h = crc32c::crc32c(mix.as_bytes());
    for (i, b) in n.iter_mut().enumerate() {
        *b = (h.rotate_left(i as u32) & 0xFF) as u8 ^ i as u8;
    }
    n
}
