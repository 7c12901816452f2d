//! The RDMA link: frames written NIC to NIC into the peer's registered receive ring with one
//! write-with-immediate each, over any provider behind the narrow [`nic::Nic`] interface.
//!
//! Why this exists: between hosts with RDMA NICs, activations should move NIC to NIC without
//! kernel sockets. The protocol (handshake, authentication, credits, heartbeats) is the same
//! sans-IO core as on TCP and shared memory; this module moves frame bytes, written once for
//! every provider:
//! * `verbs` (feature `rdma`): raw ibverbs RC queue pairs, RoCE or InfiniBand;
//! * `fabric` (feature `libfabric`): libfabric RDM endpoints, `fi_writedata` with remote CQ
//!   data: `tcp;ofi_rxm` on any host (the CI runs it), `verbs;ofi_rxm` (RoCE) or `efa` (AWS);
//! * [`sim`]: an in-process NIC with fault injection, for tests (links between meshes of one
//!   process only).
//!
//! Set-up: the endpoint and its two rings are created after authentication; the provider tag and
//! the endpoint description travel in the sealed link-info frame over the TCP connection, which
//! then stays open for dead-peer detection. Both ends must use the same provider.
//!
//! Data path: the sender copies a frame into its staging ring at the offset it will occupy in the
//! peer's ring (a 64-byte record header holding the frame length and the record's sequence
//! number, then the frame) and posts one write with immediate = record offset / 64. The peer's
//! poller takes the completion, validates the record like any untrusted bytes, copies the frame
//! into a pooled aligned buffer and hands frames to the link in sequence order (providers such
//! as efa may complete out of order; a gap or a repeated sequence number is a link error, so a
//! frame is never delivered twice or out of order). Credits (record sizes, see
//! [`credit_cost`](crate::link::credit_cost)) bound the bytes in the peer's ring; send completions, taken in
//! sequence order, bound staging reuse; at most [`SEND_WRS`] writes are in flight.
//!
//! Layering: imports [`link`] (the link it feeds and the [`FrameSink`] interface
//! it implements), [`codec`] and [`protocol`](crate::protocol); link setup (`setup`) calls it.

use crate::codec::{self, CodecConfig, FrameHeader, HEADER_LEN, PAYLOAD_ALIGN};
use crate::link::{self, FrameSink, Link, SinkFuture, Storage};
use crate::protocol::{ProtocolError, RDMA_ATTACHMENT};
use nic::{Completion, Nic, Posted};
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

#[cfg(feature = "libfabric")]
mod fabric;
pub(crate) mod nic;
pub mod sim;
#[cfg(feature = "rdma")]
mod verbs;
pub mod wire;

/// Bytes of a record header in the ring: frame length (u64), sequence number (u64), padding.
const RECORD_HEADER: usize = PAYLOAD_ALIGN;
/// Receives posted per endpoint (providers that need them).
pub(crate) const RECV_WRS: u32 = 512;
/// Writes in flight per link (send queue depth; also bounds the receiver's reorder buffer).
pub(crate) const SEND_WRS: u32 = 512;
/// Completions taken per poll.
const POLL_BATCH: usize = 32;

/// Which NIC implementation carries RDMA links.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum RdmaProvider {
    /// Raw ibverbs RC queue pairs (RoCE, InfiniBand; feature `rdma`).
    #[default]
    Verbs,
    /// libfabric RDM endpoints (feature `libfabric`) of the named provider: `tcp;ofi_rxm`
    /// (any host), `verbs;ofi_rxm` (RoCE), `efa` (AWS).
    Libfabric(String),
    /// The in-process NIC of the tests ([`sim`]): links between meshes of one process only.
    InProcess(sim::SimFaults),
}

/// The libfabric provider used when `--rdma-provider libfabric` names none.
pub const DEFAULT_LIBFABRIC_PROVIDER: &str = "tcp;ofi_rxm";

impl RdmaProvider {
    /// `verbs`, `libfabric:<provider>` or `in-process`.
    pub fn name(&self) -> String {
        match self {
            Self::Verbs => "verbs".into(),
            Self::Libfabric(p) => format!("libfabric:{p}"),
            Self::InProcess(_) => "in-process".into(),
        }
    }

    /// Whether this build can open it.
    pub fn compiled(&self) -> Result<(), String> {
        match self {
            Self::Verbs if !cfg!(feature = "rdma") => Err(
                "the verbs RDMA provider needs a build with feature `rdma` (libibverbs)".into(),
            ),
            Self::Libfabric(_) if !cfg!(feature = "libfabric") => Err(
                "the libfabric RDMA provider needs a build with feature `libfabric` (libfabric-dev)"
                    .into(),
            ),
            _ => Ok(()),
        }
    }

    fn tag(&self) -> u8 {
        match self {
            Self::Verbs => 1,
            Self::Libfabric(_) => 2,
            Self::InProcess(_) => 3,
        }
    }
}

impl std::str::FromStr for RdmaProvider {
    type Err = String;

    /// `verbs`, `libfabric` (= `libfabric:tcp;ofi_rxm`) or `libfabric:<provider>`.
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "verbs" => Ok(Self::Verbs),
            "libfabric" => Ok(Self::Libfabric(DEFAULT_LIBFABRIC_PROVIDER.into())),
            _ => match s.strip_prefix("libfabric:") {
                Some(p) if !p.is_empty() && p.is_ascii() => Ok(Self::Libfabric(p.into())),
                _ => Err(format!(
                    "unknown RDMA provider {s:?}: use verbs, libfabric or libfabric:<provider> (e.g. \
                     libfabric:verbs;ofi_rxm)"
                )),
            },
        }
    }
}

/// Why the RDMA driver could not be set up or used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RdmaError {
    /// No RDMA device (or not the configured one).
    #[error("no RDMA device{}", .0.as_deref().map(|n| format!(" named {n:?}")).unwrap_or_default())]
    NoDevice(Option<String>),
    /// A verbs call failed.
    #[error("{call} failed: {source}")]
    Verbs {
        /// The verbs function.
        call: &'static str,
        /// errno.
        #[source]
        source: std::io::Error,
    },
    /// No GID of the port matches this rank's IPv4 address.
    #[error(
        "no GID on port {port} matches IPv4 {ip}; configure the rank's address to the NIC's IP (GIDs: {candidates})"
    )]
    NoGid {
        /// Port.
        port: u8,
        /// Address sought.
        ip: String,
        /// The IPv4 GIDs found.
        candidates: String,
    },
    /// A libfabric or in-process NIC call failed.
    #[error("{provider}: {detail}")]
    Provider {
        /// The provider.
        provider: String,
        /// What failed.
        detail: String,
    },
    /// The provider is not compiled into this build.
    #[error("{0}")]
    NotCompiled(String),
    /// The peer's endpoint description is malformed or from another provider.
    #[error("malformed RDMA endpoint description from the peer: {0}")]
    BadPeerInfo(String),
    /// The link is closed.
    #[error("RDMA link closed")]
    Closed,
}

/// Opens an endpoint of `provider` with two rings of `ring_bytes` (rounded up to 64) each;
/// `device` and `ip` select the NIC port for verbs (and the local address for libfabric).
fn open(
    provider: &RdmaProvider,
    device: Option<&str>,
    ip: IpAddr,
    ring_bytes: usize,
) -> Result<Arc<dyn Nic>, RdmaError> {
    provider.compiled().map_err(RdmaError::NotCompiled)?;
    let capacity = codec::align_up(ring_bytes.max(2 * RECORD_HEADER));
    match provider {
        #[cfg(feature = "rdma")]
        RdmaProvider::Verbs => Ok(Arc::new(verbs::VerbsNic::new(device, ip, capacity)?)),
        #[cfg(feature = "libfabric")]
        RdmaProvider::Libfabric(p) => Ok(Arc::new(fabric::FabricNic::new(p, ip, capacity)?)),
        RdmaProvider::InProcess(faults) => Ok(Arc::new(sim::SimNic::new(capacity, faults.clone()))),
        #[allow(unreachable_patterns)]
        _ => {
            let _ = (device, ip);
            Err(RdmaError::NotCompiled(provider.name()))
        }
    }
}

/// An endpoint prepared before the link infos are exchanged.
pub(crate) struct RdmaPrepared {
    nic: Arc<dyn Nic>,
    tag: u8,
}

impl RdmaPrepared {
    /// Opens an endpoint of `provider` (see [`open`]) and posts its receives.
    pub(crate) fn new(
        provider: &RdmaProvider,
        device: Option<&str>,
        ip: IpAddr,
        ring_bytes: usize,
    ) -> Result<Self, RdmaError> {
        let nic = open(provider, device, ip, ring_bytes)?;
        if nic.needs_receives() {
            for _ in 0..RECV_WRS {
                nic.post_recv()?;
            }
        }
        Ok(Self {
            nic,
            tag: provider.tag(),
        })
    }

    /// The link info describing this endpoint: [`RDMA_ATTACHMENT`], the provider tag, the
    /// ring capacity and the provider's endpoint description.
    pub(crate) fn attachment(&self) -> Vec<u8> {
        let mut a = RDMA_ATTACHMENT.to_vec();
        let endpoint = self.nic.local_info();
        wire::LinkInfo {
            provider_tag: self.tag,
            ring_capacity: self.nic.ring_capacity() as u64,
            endpoint: &endpoint,
        }
        .encode(&mut a);
        a
    }

    /// Connects to the peer described by its link info (without the attachment prefix); a
    /// write refused for `post_deadline` (the link's idle timeout) ends the link.
    pub(crate) fn connect(
        self,
        info: &[u8],
        post_deadline: Duration,
    ) -> Result<(RdmaWriter, RdmaReader), RdmaError> {
        let peer = wire::decode_link_info(info)?;
        if peer.provider_tag != self.tag {
            return Err(RdmaError::BadPeerInfo(format!(
                "the peer uses RDMA provider {}, this end {}: configure the same --rdma-provider on both",
                peer.provider_tag, self.tag
            )));
        }
        if peer.ring_capacity != self.nic.ring_capacity() as u64 {
            return Err(RdmaError::BadPeerInfo(format!(
                "ring of {} bytes, this end {}: configure the same ring size on both",
                peer.ring_capacity,
                self.nic.ring_capacity()
            )));
        }
        self.nic.connect(peer.endpoint)?;
        let shared = Arc::new(Shared {
            send_done: AtomicU64::new(0),
            sends_completed: AtomicU64::new(0),
            ends: (0..SEND_WRS).map(|_| AtomicU64::new(0)).collect(),
            closed: AtomicBool::new(false),
        });
        Ok((
            RdmaWriter {
                nic: Arc::clone(&self.nic),
                head: 0,
                seq: 0,
                shared: Arc::clone(&shared),
                post_deadline,
            },
            RdmaReader {
                nic: self.nic,
                shared,
            },
        ))
    }
}

/// State shared by a link's writer and its poller.
struct Shared {
    /// Staging bytes (in the writer's `head` units) whose writes have all completed.
    send_done: AtomicU64,
    /// Writes completed, counted contiguously from the first.
    sends_completed: AtomicU64,
    /// `head` after write `seq`, at `seq % SEND_WRS`.
    ends: Vec<AtomicU64>,
    closed: AtomicBool,
}

/// Sending half: staging ring + one write with immediate per frame.
pub(crate) struct RdmaWriter {
    nic: Arc<dyn Nic>,
    head: u64,
    seq: u64,
    shared: Arc<Shared>,
    /// How long a write may stay refused (`Again`) before the link is declared dead: a
    /// provider whose peer died keeps answering "try again" (libfabric over `tcp;ofi_rxm`). The
    /// link's idle timeout, the protocol's one bound on a peer making no progress: a
    /// connection that is slow to come up on a busy machine is not called dead sooner.
    post_deadline: Duration,
}

impl RdmaWriter {
    /// Waits for room in the staging ring and the send queue; returns the record's offset and
    /// the bytes skipped to wrap.
    async fn reserve(&self, record: u64) -> Result<(usize, u64), RdmaError> {
        let cap = self.nic.ring_capacity() as u64;
        let mut waiting_since = None;
        loop {
            if self.shared.closed.load(Ordering::Acquire) {
                return Err(RdmaError::Closed);
            }
            let off = self.head % cap;
            let wrap = if off + record > cap { cap - off } else { 0 };
            let done = self.shared.send_done.load(Ordering::Acquire);
            let completed = self.shared.sends_completed.load(Ordering::Acquire);
            if self.head + wrap + record - done <= cap && self.seq - completed < SEND_WRS as u64 {
                return Ok((if wrap > 0 { 0 } else { off as usize }, wrap));
            }
            link::wait_for_room(&mut waiting_since, Duration::from_micros(50)).await;
        }
    }

    pub(crate) async fn write_frame(
        &mut self,
        head: &[u8],
        payload: &[u8],
    ) -> Result<(), RdmaError> {
        let len = head.len() + payload.len();
        let record = (RECORD_HEADER + codec::align_up(len)) as u64;
        if record > self.nic.ring_capacity() as u64 {
            return Err(RdmaError::Provider {
                provider: "rdma".into(),
                detail: format!(
                    "a {len}-byte frame does not fit the {}-byte ring",
                    self.nic.ring_capacity()
                ),
            });
        }
        let (off, wrap) = self.reserve(record).await?;
        let staging = self.nic.staging();
        // SAFETY: [off, off + record) of the staging ring is free: every write that used it has
        // completed (send_done), and the ring holds `capacity` bytes.
        unsafe {
            std::ptr::write_unaligned(staging.add(off) as *mut u64, len as u64);
            std::ptr::write_unaligned(staging.add(off + 8) as *mut u64, self.seq);
            let dst = staging.add(off + RECORD_HEADER);
            std::ptr::copy_nonoverlapping(head.as_ptr(), dst, head.len());
            std::ptr::copy_nonoverlapping(payload.as_ptr(), dst.add(head.len()), payload.len());
        }
        self.head += wrap + record;
        self.shared.ends[(self.seq % SEND_WRS as u64) as usize].store(self.head, Ordering::Release);
        let imm = (off / PAYLOAD_ALIGN) as u32;
        let t0 = Instant::now();
        let mut waiting_since = None;
        loop {
            if self.shared.closed.load(Ordering::Acquire) {
                return Err(RdmaError::Closed);
            }
            match self.nic.post_write(off, record as usize, imm, self.seq)? {
                Posted::Accepted => break,
                Posted::Again if t0.elapsed() < self.post_deadline => {
                    link::wait_for_room(&mut waiting_since, Duration::from_micros(50)).await
                }
                Posted::Again => {
                    return Err(RdmaError::Provider {
                        provider: "rdma".into(),
                        detail: format!(
                            "a write was refused for {:?}, the link's idle timeout (the peer is gone or not progressing)",
                            self.post_deadline
                        ),
                    });
                }
            }
        }
        self.seq += 1;
        Ok(())
    }

    pub(crate) fn close(&self) {
        self.shared.closed.store(true, Ordering::Release);
    }
}

impl FrameSink for RdmaWriter {
    fn write_frame<'a>(
        &'a mut self,
        head: &'a [u8],
        payload: &'a [u8],
    ) -> SinkFuture<'a, Result<(), String>> {
        Box::pin(async move {
            RdmaWriter::write_frame(self, head, payload)
                .await
                .map_err(|e| e.to_string())
        })
    }

    fn shutdown(&mut self) -> SinkFuture<'_, ()> {
        self.close();
        Box::pin(std::future::ready(()))
    }
}

/// Receiving half, run by the completion polling thread.
pub(crate) struct RdmaReader {
    nic: Arc<dyn Nic>,
    shared: Arc<Shared>,
}

/// Starts the completion polling thread of a link.
pub(crate) fn spawn_poller(link: Arc<Link>, reader: RdmaReader, codec: CodecConfig) {
    let handle = tokio::runtime::Handle::current();
    let spawned = std::thread::Builder::new()
        .name(format!("rdma-cq-{}", link.peer))
        .spawn(move || {
            let _rt = handle.enter();
            let mut poller = Poller::new(&reader, codec);
            let ended = poller.run(&link);
            // However the poller ends (an error, or the link failed elsewhere), no completion
            // is processed any more: a writer waiting for room must stop waiting.
            reader.shared.closed.store(true, Ordering::Release);
            if let Err(e) = ended {
                link.fail(e);
            }
        });
    if let Err(e) = spawned {
        tracing::error!("cannot spawn RDMA completion thread: {e}");
    }
}

/// The completion poller of one link: send completions in sequence order, received records
/// validated and handed to the link in sequence order.
struct Poller<'a> {
    reader: &'a RdmaReader,
    codec: CodecConfig,
    /// Sends completed out of order, waiting for the ones before them.
    sent: BTreeSet<u64>,
    /// Received frames waiting for the ones before them.
    held: BTreeMap<u64, (FrameHeader, Storage)>,
    /// The credit cost of the application frames in `held`: a peer sends within its credit,
    /// so more than the receive window held out of order is a peer breaking it.
    held_bytes: u64,
    /// The next sequence number to hand to the link.
    expected: u64,
}

fn closed(why: impl std::fmt::Display) -> ProtocolError {
    ProtocolError::Lost(why.to_string())
}

impl<'a> Poller<'a> {
    fn new(reader: &'a RdmaReader, codec: CodecConfig) -> Self {
        Self {
            reader,
            codec,
            sent: BTreeSet::new(),
            held: BTreeMap::new(),
            held_bytes: 0,
            expected: 0,
        }
    }

    fn run(&mut self, link: &Arc<Link>) -> Result<(), ProtocolError> {
        let nic = &self.reader.nic;
        let mut done = Vec::with_capacity(POLL_BATCH);
        let mut idle = 0u32;
        loop {
            if link.is_closed() || self.reader.shared.closed.load(Ordering::Acquire) {
                return Ok(());
            }
            done.clear();
            nic.poll(&mut done, POLL_BATCH).map_err(closed)?;
            if done.is_empty() {
                idle += 1;
                if idle > 64 {
                    std::thread::sleep(Duration::from_micros(50));
                } else {
                    std::hint::spin_loop();
                }
                continue;
            }
            idle = 0;
            for c in done.drain(..) {
                match c {
                    Completion::Sent { wr_id } => self.on_sent(wr_id)?,
                    Completion::Failed(why) => {
                        return Err(closed(format!("RDMA completion failed: {why}")));
                    }
                    Completion::Received { imm } => {
                        if nic.needs_receives() {
                            nic.post_recv().map_err(closed)?;
                        }
                        let (seq, header, storage) = self.take_record(link, imm)?;
                        self.on_received(link, seq, header, storage)?;
                    }
                }
            }
        }
    }

    /// A send completed: advance the staging watermark over every contiguous completion.
    fn on_sent(&mut self, seq: u64) -> Result<(), ProtocolError> {
        let shared = &self.reader.shared;
        let mut next = shared.sends_completed.load(Ordering::Acquire);
        if seq < next || seq >= next + SEND_WRS as u64 || !self.sent.insert(seq) {
            return Err(closed(format!(
                "RDMA send completion for write {seq} not in flight"
            )));
        }
        while self.sent.remove(&next) {
            let end = shared.ends[(next % SEND_WRS as u64) as usize].load(Ordering::Acquire);
            shared.send_done.store(end, Ordering::Release);
            next += 1;
            shared.sends_completed.store(next, Ordering::Release);
        }
        Ok(())
    }

    /// Validates the record at immediate `imm` and copies its frame out of the ring.
    fn take_record(
        &self,
        link: &Arc<Link>,
        imm: u32,
    ) -> Result<(u64, FrameHeader, Storage), ProtocolError> {
        let nic = &self.reader.nic;
        let cap = nic.ring_capacity();
        let off = imm as usize * PAYLOAD_ALIGN;
        if off + RECORD_HEADER > cap {
            return Err(closed(format!(
                "RDMA record offset {off} outside the {cap}-byte ring"
            )));
        }
        let base = nic.recv_ring();
        // SAFETY: off + 16 <= cap (checked); the provider made the record visible before
        // reporting its completion.
        let (len, seq) = unsafe {
            (
                std::ptr::read_unaligned(base.add(off) as *const u64) as usize,
                std::ptr::read_unaligned(base.add(off + 8) as *const u64),
            )
        };
        if len < HEADER_LEN || len > self.codec.max_frame_bytes || off + RECORD_HEADER + len > cap {
            return Err(closed(format!(
                "corrupt RDMA record of {len} bytes at {off}"
            )));
        }
        // SAFETY: [off + 64, off + 64 + len) lies in the ring (checked above).
        let frame = unsafe { std::slice::from_raw_parts(base.add(off + RECORD_HEADER), len) };
        let header = codec::decode_header(frame, &self.codec)?;
        if header.frame_len as usize != len {
            return Err(closed("RDMA record length differs from frame header"));
        }
        let mut buf = link.pool.take(len);
        buf[..len].copy_from_slice(frame);
        let storage = Storage::Heap {
            buf: Some(buf),
            pool: Arc::downgrade(&link.pool),
        };
        Ok((seq, header, storage))
    }

    /// Hands `seq` and every held frame after it to the link, in order.
    fn on_received(
        &mut self,
        link: &Arc<Link>,
        seq: u64,
        header: FrameHeader,
        storage: Storage,
    ) -> Result<(), ProtocolError> {
        if seq < self.expected || seq >= self.expected + SEND_WRS as u64 {
            return Err(closed(format!(
                "RDMA record {seq} outside the window of records expected from {}",
                self.expected
            )));
        }
        let cost = |h: &FrameHeader| {
            if h.kind.is_application() {
                crate::link::credit_cost(h.frame_len as usize)
            } else {
                0
            }
        };
        if seq != self.expected {
            // Held until the ones before it come: counted against the window now, with what
            // the link already holds (handed over, not released), since the link's own
            // credit check sees it only when it is handed over.
            let held = self.held_bytes + cost(&header);
            let outstanding = held.saturating_add(link.stats().recv_outstanding);
            if outstanding > link.recv_window() {
                return Err(ProtocolError::CreditViolation {
                    outstanding,
                    window: link.recv_window(),
                });
            }
            self.held_bytes = held;
        }
        if self.held.insert(seq, (header, storage)).is_some() {
            return Err(closed(format!("RDMA record {seq} received twice")));
        }
        while let Some((header, storage)) = self.held.remove(&self.expected) {
            if self.expected != seq {
                self.held_bytes -= cost(&header);
            }
            self.expected += 1;
            if let Some(f) = link.on_frame(&header, storage)? {
                link.deliver(f);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A write the provider refuses for ever fails once the link's bound has passed (here 50
    /// ms), naming that bound; it neither hangs nor fails before it (the first refusals are
    /// retried).
    #[tokio::test]
    async fn a_write_refused_past_the_deadline_fails_naming_it() {
        let provider = |again_first| {
            RdmaProvider::InProcess(sim::SimFaults {
                again_first,
                ..Default::default()
            })
        };
        let ip = IpAddr::from([127, 0, 0, 1]);
        let a = RdmaPrepared::new(&provider(u32::MAX), None, ip, 4096).unwrap();
        let b = RdmaPrepared::new(&provider(0), None, ip, 4096).unwrap();
        let info =
            |p: &RdmaPrepared| p.attachment()[crate::protocol::RDMA_ATTACHMENT.len()..].to_vec();
        let (a_info, b_info) = (info(&a), info(&b));
        let deadline = Duration::from_millis(50);
        let (mut writer, _reader) = a.connect(&b_info, deadline).unwrap();
        let _b = b.connect(&a_info, deadline).unwrap();
        let t0 = Instant::now();
        let err = writer.write_frame(&[0u8; 64], &[]).await.unwrap_err();
        assert!(t0.elapsed() >= deadline, "gave up after {:?}", t0.elapsed());
        assert!(
            err.to_string()
                .contains("refused for 50ms, the link's idle timeout"),
            "{err}"
        );
    }

    #[test]
    fn providers_parse_and_name_themselves() {
        assert_eq!("verbs".parse::<RdmaProvider>(), Ok(RdmaProvider::Verbs));
        assert_eq!(
            "libfabric".parse::<RdmaProvider>(),
            Ok(RdmaProvider::Libfabric("tcp;ofi_rxm".into()))
        );
        let efa: RdmaProvider = "libfabric:efa".parse().unwrap();
        assert_eq!(efa.name(), "libfabric:efa");
        let err = "roce".parse::<RdmaProvider>().unwrap_err();
        assert!(err.contains("verbs, libfabric"), "{err}");
    }
}
