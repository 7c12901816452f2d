//! The shared-memory driver: one single-producer single-consumer byte ring per direction per
//! pair of ranks on one host, in a file under `/dev/shm` mapped by both processes.
//!
//! Why this exists: between processes on one host a socket costs two copies and several
//! syscalls per frame; a mapped ring costs one copy in (the producer writes the frame straight
//! into the ring) and none out (the consumer hands out the frame in place, 64-byte aligned,
//! and releases its bytes when the application drops it).
//!
//! # Segment layout
//!
//! ```text
//! 0     magic "EMSHRNG1", version, creator pid, capacity, max frame
//! 64    head   (u64, producer: bytes published, monotonic)
//! 128   tail   (u64, consumer: bytes released, monotonic)
//! 192   data_seq (futex word), consumer_sleeping
//! 256   space_seq (futex word), producer_sleeping
//! 320   producer_closed, consumer_closed
//! 4096  data[capacity]   records: 64-byte record header (frame length or WRAP), frame
//! ```
//!
//! Records start at 64-byte aligned offsets and never straddle the end of the ring (a WRAP
//! record skips the tail end), so every frame is contiguous and its payload 64-byte aligned.
//! A producer that finds the ring empty past its first 256 KiB also starts over at offset 0
//! (a WRAP record again): an idle or lightly loaded link keeps its records in cache.
//! The consumer spins briefly when the ring is empty, then sleeps on a futex that the producer
//! wakes only when the consumer has announced that it sleeps: an idle link burns no CPU.
//!
//! The ring's contents are untrusted: every record length and frame header is validated
//! before use, and a corrupt ring closes that link with an error. The segment file is created
//! with `posix_fallocate`, so a full `/dev/shm` is an `ENOSPC` error at set-up (the mesh then
//! falls back to TCP) instead of a `SIGBUS` later, and it is unlinked as soon as both sides have
//! mapped it. Its creator holds an exclusive `flock` on it while it lives: a file whose
//! creator's id runs nothing here and whose lock is free is a dead process's leftover, refused
//! by a producer and removed at start-up. A live creator in another PID namespace (containers
//! sharing `/dev/shm`) keeps its lock, so its ring is neither refused nor removed.
//!
//! Layering: this driver imports only `link` (the link it feeds and the
//! `FrameSink` / `Region` interfaces it implements), [`codec`] and
//! [`protocol`](crate::protocol); link setup (`setup`) calls it.

use crate::codec::{self, CodecConfig, HEADER_LEN, PAYLOAD_ALIGN};
use crate::link::{self, FrameSink, Lease, Link, Rank, Region, SinkFuture, Storage, nonce};
use crate::protocol::{ProtocolError, SHM_ATTACHMENT};
use std::collections::VecDeque;
use std::fs::OpenOptions;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering, fence};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const SEG_MAGIC: u64 = u64::from_le_bytes(*b"EMSHRNG1");
const SEG_VERSION: u32 = 1;
const DATA_OFFSET: usize = 4096;
const RECORD_HEADER: usize = PAYLOAD_ALIGN;
const WRAP: u64 = u64::MAX;
const FILE_PREFIX: &str = "expertmesh-";
/// Past this offset a producer that finds the ring empty starts its next record at offset 0
/// again (a WRAP record skips the rest): a link that is not backed up keeps reusing the same
/// few hundred KiB, which stay in cache, instead of walking the whole ring through memory
/// (`bench transport` on the EPYC VM: round trip at 8 tokens 17-23 -> 7.2-7.6 of the
/// in-memory ping-pong, at 256 tokens 2.5-2.8 -> 1.8; throughput at 64 tokens 0.33-0.37 ->
/// 0.39-0.45 of memcpy).
const RESTART_AFTER: usize = 256 << 10;

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

/// Why a shared-memory ring could not be set up or used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ShmError {
    /// The shared-memory filesystem has no room for the ring.
    #[error(
        "no space in {dir} for a {bytes}-byte ring (is /dev/shm full or too small? enlarge it or lower shm.ring_bytes; the link falls back to TCP)"
    )]
    NoSpace {
        /// Directory.
        dir: PathBuf,
        /// Bytes requested.
        bytes: u64,
    },
    /// Another I/O failure creating, opening or mapping the ring.
    #[error("{what} {path}: {source}")]
    Io {
        /// Operation.
        what: &'static str,
        /// File.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// The file is not a live ring of this version (stale, foreign or truncated).
    #[error("{path} is not a usable ring: {why}")]
    BadSegment {
        /// File.
        path: PathBuf,
        /// What is wrong.
        why: String,
    },
    /// The consumer side has closed the ring.
    #[error("shared-memory peer closed the ring (process exited?)")]
    PeerClosed,
    /// The consumer's release position in the shared header is not one it can have reached:
    /// past what was sent, or more than a ring behind it (the peer process is broken or wrote
    /// over the header).
    #[error(
        "shared-memory peer's release position {tail} is impossible with {head} bytes sent into a ring of {capacity} (the peer process wrote over the ring's header); the write fails and the link closes"
    )]
    CorruptTail {
        /// The consumer's release position.
        tail: u64,
        /// Bytes the producer has sent.
        head: u64,
        /// Ring capacity.
        capacity: u64,
    },
    /// A frame larger than half the ring.
    #[error("frame of {len} bytes does not fit a ring of {capacity} bytes")]
    TooLarge {
        /// Frame bytes.
        len: usize,
        /// Ring capacity.
        capacity: usize,
    },
}

#[repr(C)]
struct SegHeader {
    magic: u64,
    version: u32,
    creator_pid: u32,
    capacity: u64,
    max_frame: u64,
    _pad0: [u8; 32],
    head: AtomicU64,
    _pad1: [u8; 56],
    tail: AtomicU64,
    _pad2: [u8; 56],
    data_seq: AtomicU32,
    consumer_sleeping: AtomicU32,
    _pad3: [u8; 56],
    space_seq: AtomicU32,
    producer_sleeping: AtomicU32,
    _pad4: [u8; 56],
    producer_closed: AtomicU32,
    consumer_closed: AtomicU32,
}

const _: () = assert!(std::mem::size_of::<SegHeader>() <= DATA_OFFSET);
const _: () = assert!(std::mem::offset_of!(SegHeader, head) == 64);
const _: () = assert!(std::mem::offset_of!(SegHeader, tail) == 128);

/// A mapped ring segment.
struct Segment {
    map: memmap2::MmapRaw,
    capacity: usize,
}

// SAFETY: the mapping is shared memory accessed through atomics (header) and through byte copies
// of regions the SPSC protocol hands to exactly one side at a time.
unsafe impl Send for Segment {}
// SAFETY: as above.
unsafe impl Sync for Segment {}

impl Segment {
    fn header(&self) -> &SegHeader {
        // SAFETY: the mapping is at least DATA_OFFSET bytes, page aligned, and SegHeader is
        // plain integers and atomics valid for any bit pattern.
        unsafe { &*(self.map.as_ptr() as *const SegHeader) }
    }

    fn data(&self) -> *mut u8 {
        // SAFETY: DATA_OFFSET is inside the mapping (checked at creation/open).
        unsafe { self.map.as_mut_ptr().add(DATA_OFFSET) }
    }
}

fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: FUTEX_WAIT on a valid, aligned u32 in a shared mapping; the kernel only reads it.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
        );
    }
}

fn futex_wake(word: &AtomicU32) {
    // SAFETY: FUTEX_WAKE on a valid, aligned u32; wakes at most one waiter.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, 1);
    }
}

fn sanitize(s: &str) -> String {
    s.chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .take(48)
        .collect()
}

/// Removes ring files left in `dir` by dead processes of this cluster: their creator's id
/// runs no process here and no process holds them locked ([`expertmesh_files`]).
pub fn remove_stale_segments(dir: &Path, cluster: &str) -> usize {
    let prefix = format!("{FILE_PREFIX}{}-", sanitize(cluster));
    // name: <prefix><from>to<to>-<pid>-<nonce>
    let owner = |name: &str| name.strip_prefix(&prefix)?.split('-').nth(1)?.parse().ok();
    let removed = expertmesh_files::remove_left_by_gone_processes(dir, owner);
    for path in &removed {
        tracing::warn!(path = %path.display(), "removed stale shared-memory segment of a dead process");
    }
    removed.len()
}

/// Ring bytes a frame of `frame_len` bytes takes: a 64-byte record header and the frame
/// rounded up to 64 bytes. A ring takes records of at most half its size.
pub(crate) fn record_bytes(frame_len: usize) -> usize {
    RECORD_HEADER + codec::align_up(frame_len)
}

/// The largest receive window a ring of `cfg.ring_bytes` supports (known before the ring is
/// created, so a hello can announce it): wrap waste of one record never blocks a sender that
/// holds credit while the receiver drops frames in order. Ring space is freed in order, so a
/// frame held while later ones are dropped keeps their space too: the sender then waits for it
/// even with credit left. That is backpressure, unless the receiver keeps the old frame until
/// later frames of the same link arrive: once the frames from the old one on fill the ring,
/// both ends wait.
pub(crate) fn usable_window(cfg: &ShmConfig, codec: &CodecConfig) -> u64 {
    let max_record = record_bytes(codec.max_frame_bytes);
    codec::align_up(cfg.ring_bytes).saturating_sub(max_record) as u64
}

/// The receiving end of a ring: owns (creates) the segment.
pub(crate) struct RingConsumer {
    seg: Arc<Segment>,
    path: PathBuf,
    spin_us: u32,
    /// The ring file, locked for this consumer's life: its lock says the creator lives.
    _held: expertmesh_files::Held,
}

impl RingConsumer {
    /// Creates a ring file for frames from `from` to `to` and maps it.
    pub(crate) fn create(
        cfg: &ShmConfig,
        cluster: &str,
        from: Rank,
        to: Rank,
    ) -> Result<RingConsumer, ShmError> {
        remove_stale_segments(&cfg.dir, cluster);
        let capacity = codec::align_up(cfg.ring_bytes);
        let total = (DATA_OFFSET + capacity) as u64;
        let nonce = nonce();
        let path = cfg.dir.join(format!(
            "{FILE_PREFIX}{}-{from}to{to}-{}-{:02x}{:02x}{:02x}{:02x}",
            sanitize(cluster),
            std::process::id(),
            nonce[0],
            nonce[1],
            nonce[2],
            nonce[3]
        ));
        let file =
            expertmesh_files::create_locked(&path, Some(0o600)).map_err(|source| ShmError::Io {
                what: "create ring file",
                path: path.clone(),
                source,
            })?;
        // Reserve the pages now: on a full tmpfs this fails with ENOSPC instead of the first
        // write into the mapping raising SIGBUS.
        // SAFETY: valid fd, offset 0, positive length.
        let r = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, total as libc::off_t) };
        if r != 0 {
            let _ = std::fs::remove_file(&path);
            if r == libc::ENOSPC {
                return Err(ShmError::NoSpace {
                    dir: cfg.dir.clone(),
                    bytes: total,
                });
            }
            return Err(ShmError::Io {
                what: "reserve ring space in",
                path,
                source: std::io::Error::from_raw_os_error(r),
            });
        }
        let map = memmap2::MmapOptions::new()
            .len(total as usize)
            .map_raw(&*file)
            .map_err(|source| {
                let _ = std::fs::remove_file(&path);
                ShmError::Io {
                    what: "map ring",
                    path: path.clone(),
                    source,
                }
            })?;
        let seg = Arc::new(Segment { map, capacity });
        // SAFETY: freshly mapped, zero-filled, exclusively ours until the path is shared.
        unsafe {
            let h = seg.map.as_mut_ptr() as *mut SegHeader;
            (*h).version = SEG_VERSION;
            (*h).creator_pid = std::process::id();
            (*h).capacity = capacity as u64;
            (*h).max_frame = 0;
            fence(Ordering::Release);
            (*h).magic = SEG_MAGIC;
        }
        Ok(RingConsumer {
            seg,
            path,
            spin_us: cfg.spin_us,
            _held: file,
        })
    }

    /// The ring file's path.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// The hello attachment describing this ring: [`SHM_ATTACHMENT`] and the file path.
    pub(crate) fn attachment(&self) -> Vec<u8> {
        let mut a = SHM_ATTACHMENT.to_vec();
        a.extend_from_slice(self.path().as_os_str().as_encoded_bytes());
        a
    }

    /// Removes the ring's file (the mappings stay valid).
    pub(crate) fn unlink(&self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

impl Drop for RingConsumer {
    fn drop(&mut self) {
        self.seg
            .header()
            .consumer_closed
            .store(1, Ordering::Release);
        self.unlink();
    }
}

/// A consumer's ring as a [`Region`]: frames are leased in place and released in order.
struct RingRegion {
    seg: Arc<Segment>,
    releaser: Releaser,
}

impl Region for RingRegion {
    fn frame(&self, off: usize, len: usize) -> &[u8] {
        // SAFETY: the producer does not write this record until the consumer's tail passes it,
        // which happens only after its lease is dropped (SPSC protocol); offset and length were
        // validated against the capacity before the lease was made.
        unsafe { std::slice::from_raw_parts(self.seg.data().add(off), len) }
    }

    fn release(&self, record_pos: u64) {
        self.releaser.release(&self.seg, record_pos);
    }
}

/// In-order release of ring records that the application may drop in any order.
struct Releaser {
    pending: Mutex<VecDeque<(u64, u64, bool)>>,
}

impl Releaser {
    /// Queues the record `start..end`; returns where the oldest record not yet released starts
    /// (this side's own account of the ring's tail, kept in private memory).
    fn push(&self, start: u64, end: u64, released: bool) -> u64 {
        let mut q = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        q.push_back((start, end, released));
        q.front().map_or(start, |e| e.0)
    }

    fn release(&self, seg: &Segment, start: u64) {
        if let Some(t) = self.released_through(start) {
            publish_tail(seg, t);
        }
    }

    /// Marks the record at `start` released; the new tail when that grew the released prefix.
    fn released_through(&self, start: u64) -> Option<u64> {
        let mut q = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(e) = q.iter_mut().find(|e| e.0 == start) {
            e.2 = true;
        }
        let mut new_tail = None;
        while let Some(&(_, end, true)) = q.front() {
            new_tail = Some(end);
            q.pop_front();
        }
        new_tail
    }
}

/// Moves the ring's tail to `t` (never back) and wakes a producer waiting for room.
///
/// Releases run on several threads (the application dropping frames, this side's consumer
/// releasing control frames), each computing its tail under the lock and publishing it after:
/// one that took an earlier prefix may publish after one that took a later one, and the tail
/// must never move back (the producer would take it for corruption, or wait for room already
/// freed).
fn publish_tail(seg: &Segment, t: u64) {
    let h = seg.header();
    h.tail.fetch_max(t, Ordering::Release);
    fence(Ordering::SeqCst);
    if h.producer_sleeping.load(Ordering::SeqCst) != 0 {
        h.space_seq.fetch_add(1, Ordering::SeqCst);
        futex_wake(&h.space_seq);
    }
}

/// Runs the consumer of `ring` on its own thread, feeding frames to `link`.
pub(crate) fn spawn_consumer(link: Arc<Link>, ring: RingConsumer, codec: CodecConfig) {
    let handle = tokio::runtime::Handle::current();
    let name = format!("shm-rx-{}", link.peer);
    let link_for_error = Arc::clone(&link);
    let spawned = std::thread::Builder::new().name(name).spawn(move || {
        let _rt = handle.enter();
        if let Err(e) = consumer_loop(&link, &ring, &codec) {
            link.fail(e);
        }
    });
    if let Err(e) = spawned {
        // Without a reader the link would stay up until the peer gave up on it.
        link_for_error.fail(ProtocolError::Lost(format!(
            "cannot start the shared-memory reader thread: {e}"
        )));
    }
}

fn corrupt(why: String) -> ProtocolError {
    ProtocolError::Lost(format!("corrupt shared-memory ring: {why}"))
}

fn consumer_loop(
    link: &Arc<Link>,
    ring: &RingConsumer,
    codec: &CodecConfig,
) -> Result<(), ProtocolError> {
    let seg = &ring.seg;
    let h = seg.header();
    let cap = seg.capacity as u64;
    let region = Arc::new(RingRegion {
        seg: Arc::clone(seg),
        releaser: Releaser {
            pending: Mutex::new(VecDeque::new()),
        },
    });
    let releaser = &region.releaser;
    let mut read_pos: u64 = 0;
    loop {
        if link.is_closed() {
            return Ok(());
        }
        let head = h.head.load(Ordering::Acquire);
        if head == read_pos {
            wait_for_data(h, read_pos, ring.spin_us, link);
            continue;
        }
        if head < read_pos
            || head - read_pos > cap
            || !read_pos.is_multiple_of(PAYLOAD_ALIGN as u64)
        {
            return Err(corrupt(format!(
                "head {head} inconsistent with read position {read_pos}"
            )));
        }
        let off = (read_pos % cap) as usize;
        // SAFETY: off + 8 <= cap because records are 64-aligned and cap is a multiple of 64;
        // the bytes before `head` were published by the producer (Acquire above).
        let len = unsafe { std::ptr::read_unaligned(seg.data().add(off) as *const u64) };
        if len == WRAP {
            let skip = cap - off as u64;
            if off == 0 || read_pos + skip > head {
                return Err(corrupt("misplaced wrap record".into()));
            }
            let oldest_held = releaser.push(read_pos, read_pos + skip, false);
            if read_pos + skip - oldest_held > cap {
                return Err(corrupt(format!(
                    "the producer wrote over records still held (a wrap record from \
                     {oldest_held} to {})",
                    read_pos + skip
                )));
            }
            releaser.release(seg, read_pos);
            read_pos += skip;
            continue;
        }
        if len < HEADER_LEN as u64 || len > codec.max_frame_bytes as u64 {
            return Err(corrupt(format!("record of {len} bytes at offset {off}")));
        }
        let frame_len = len as usize;
        let record = record_bytes(frame_len) as u64;
        if off as u64 + record > cap || read_pos + record > head {
            return Err(corrupt(format!("record of {len} bytes at offset {off}")));
        }
        let frame_off = off + RECORD_HEADER;
        // SAFETY: validated above to lie within the published part of the ring.
        let hdr_bytes =
            unsafe { std::slice::from_raw_parts(seg.data().add(frame_off), HEADER_LEN) };
        let header = codec::decode_header(hdr_bytes, codec)?;
        if header.frame_len as usize != frame_len {
            return Err(corrupt("record length differs from frame header".into()));
        }
        // An honest producer never writes past what this side has released (its tail), so
        // the records from the oldest one still held to this one fit in the ring: a producer
        // that wrote more has written over frames the application still reads.
        let oldest_held = releaser.push(read_pos, read_pos + record, false);
        if read_pos + record - oldest_held > cap {
            return Err(corrupt(format!(
                "the producer wrote over records still held (from {oldest_held} to {})",
                read_pos + record
            )));
        }
        let lease = Lease::new(
            Arc::clone(&region) as Arc<dyn Region>,
            read_pos,
            frame_off,
            frame_len,
        );
        read_pos += record;
        if let Some(frame) = link.on_frame(&header, Storage::Lease(lease))? {
            link.deliver(frame)
        }
    }
}

fn wait_for_data(h: &SegHeader, read_pos: u64, spin_us: u32, link: &Link) {
    if spin_us > 0 {
        let until = std::time::Instant::now() + Duration::from_micros(spin_us as u64);
        let mut i = 0u32;
        loop {
            if h.head.load(Ordering::Acquire) != read_pos {
                return;
            }
            i = i.wrapping_add(1);
            if i.is_multiple_of(32) {
                if std::time::Instant::now() >= until {
                    break;
                }
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    }
    let seq = h.data_seq.load(Ordering::SeqCst);
    h.consumer_sleeping.store(1, Ordering::SeqCst);
    fence(Ordering::SeqCst);
    if h.head.load(Ordering::Acquire) == read_pos && !link.is_closed() {
        futex_wait(&h.data_seq, seq, Duration::from_millis(20));
    }
    h.consumer_sleeping.store(0, Ordering::SeqCst);
}

/// Where the producer's next record of `record` bytes goes, with the producer at `head` and
/// the consumer's releases at `tail` in a ring of `cap` bytes: `Some((offset, skipped))` (the
/// bytes a WRAP record skips first), or `None` while the ring has no room for it.
///
/// A record never straddles the end; and once the consumer has released everything (the ring
/// is empty) past [`RESTART_AFTER`], the next record starts over at the ring's first bytes,
/// which are still in cache, but only where the skipped end leaves room for it
/// (`off >= record`: otherwise an empty ring would never have room).
fn record_place(head: u64, tail: u64, cap: u64, record: u64) -> Option<(usize, u64)> {
    let off = head % cap;
    let restart = tail == head && off >= (RESTART_AFTER as u64).max(record);
    let wrap = if off + record > cap || restart {
        cap - off
    } else {
        0
    };
    (head + wrap + record - tail <= cap).then_some((off as usize, wrap))
}

/// The sending end of a ring (maps the peer's segment).
pub(crate) struct RingProducer {
    seg: Arc<Segment>,
    head: u64,
}

impl RingProducer {
    /// Opens the ring described by the peer's hello `attachment` ([`SHM_ATTACHMENT`] and a
    /// path). The error is a one-line reason.
    pub(crate) fn open_attachment(
        attachment: &[u8],
        cfg: &ShmConfig,
    ) -> Result<RingProducer, String> {
        let path = attachment
            .strip_prefix(SHM_ATTACHMENT)
            .unwrap_or(attachment);
        let path = std::str::from_utf8(path).map_err(|_| "peer ring path not UTF-8".to_string())?;
        Self::open(Path::new(path), cfg).map_err(|e| e.to_string())
    }

    /// Opens and validates the peer's ring file.
    pub(crate) fn open(path: &Path, cfg: &ShmConfig) -> Result<RingProducer, ShmError> {
        let bad = |why: String| ShmError::BadSegment {
            path: path.to_path_buf(),
            why,
        };
        if path.parent() != Some(cfg.dir.as_path()) {
            return Err(bad(format!(
                "not inside the configured directory {}",
                cfg.dir.display()
            )));
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|source| ShmError::Io {
                what: "open peer ring",
                path: path.to_path_buf(),
                source,
            })?;
        let meta = file.metadata().map_err(|source| ShmError::Io {
            what: "stat peer ring",
            path: path.to_path_buf(),
            source,
        })?;
        {
            use std::os::unix::fs::MetadataExt;
            // SAFETY: geteuid has no preconditions and cannot fail.
            let me = unsafe { libc::geteuid() };
            if meta.uid() != me || meta.mode() & 0o077 != 0 {
                return Err(bad(format!(
                    "owned by uid {} with mode {:o}; a ring must belong to this user (uid {me}) with mode 0600",
                    meta.uid(),
                    meta.mode() & 0o777
                )));
            }
        }
        let size = meta.len() as usize;
        if size < DATA_OFFSET + 2 * PAYLOAD_ALIGN {
            return Err(bad(format!("file of {size} bytes is too small")));
        }
        let map = memmap2::MmapOptions::new()
            .len(size)
            .map_raw(&file)
            .map_err(|source| ShmError::Io {
                what: "map peer ring",
                path: path.to_path_buf(),
                source,
            })?;
        let seg = Segment { map, capacity: 0 };
        let h = seg.header();
        if h.magic != SEG_MAGIC || h.version != SEG_VERSION {
            return Err(bad("wrong magic or version (stale or foreign file)".into()));
        }
        let capacity = h.capacity as usize;
        if capacity.checked_add(DATA_OFFSET) != Some(size)
            || !capacity.is_multiple_of(PAYLOAD_ALIGN)
        {
            return Err(bad(format!(
                "capacity {capacity} does not match file size {size}"
            )));
        }
        // Gone only when both say so: a creator in another PID namespace has an id that
        // means nothing here, but holds the file's lock.
        if expertmesh_files::process_gone(h.creator_pid)
            && !expertmesh_files::held_by_another(&file)
        {
            return Err(bad(format!(
                "creator process {} is gone and holds no lock on it (stale segment)",
                h.creator_pid
            )));
        }
        if h.head.load(Ordering::Acquire) != 0 || h.consumer_closed.load(Ordering::Acquire) != 0 {
            return Err(bad("ring already in use (stale segment)".into()));
        }
        let seg = Segment {
            map: seg.map,
            capacity,
        };
        Ok(RingProducer {
            seg: Arc::new(seg),
            head: 0,
        })
    }

    /// Copies one frame (`head` then `payload`) into the ring, waiting for space if needed.
    pub(crate) async fn write_frame(
        &mut self,
        head: &[u8],
        payload: &[u8],
    ) -> Result<(), ShmError> {
        let len = head.len() + payload.len();
        let cap = self.seg.capacity as u64;
        let record = record_bytes(len) as u64;
        if record > cap / 2 {
            return Err(ShmError::TooLarge {
                len,
                capacity: self.seg.capacity,
            });
        }
        let mut waiting_since = None;
        let (off, wrap) = loop {
            let h = self.seg.header();
            if h.consumer_closed.load(Ordering::Acquire) != 0 {
                return Err(ShmError::PeerClosed);
            }
            let tail = h.tail.load(Ordering::Acquire);
            // A consumer releases only what was sent, and at most a ring was ever sent ahead
            // of it: anything else would underflow the room computed below.
            if tail > self.head || self.head - tail > cap {
                return Err(ShmError::CorruptTail {
                    tail,
                    head: self.head,
                    capacity: cap,
                });
            }
            if let Some(at) = record_place(self.head, tail, cap, record) {
                break at;
            }
            // Out of space (the application holds old frames): poll briefly, then wait
            // without burning a core.
            link::wait_for_room(&mut waiting_since, Duration::from_micros(200)).await;
        };
        let data = self.seg.data();
        // SAFETY: the region [head, head + wrap + record) is free (checked against tail above)
        // and only the producer writes it until it publishes `head`.
        unsafe {
            let mut off = off;
            if wrap > 0 {
                std::ptr::write_unaligned(data.add(off) as *mut u64, WRAP);
                off = 0;
            }
            std::ptr::write_unaligned(data.add(off) as *mut u64, len as u64);
            let dst = data.add(off + RECORD_HEADER);
            std::ptr::copy_nonoverlapping(head.as_ptr(), dst, head.len());
            std::ptr::copy_nonoverlapping(payload.as_ptr(), dst.add(head.len()), payload.len());
        }
        self.head += wrap + record;
        let h = self.seg.header();
        h.head.store(self.head, Ordering::Release);
        fence(Ordering::SeqCst);
        if h.consumer_sleeping.load(Ordering::SeqCst) != 0 {
            h.data_seq.fetch_add(1, Ordering::SeqCst);
            futex_wake(&h.data_seq);
        }
        Ok(())
    }

    /// Marks the producer side closed.
    pub(crate) fn close(&self) {
        self.seg
            .header()
            .producer_closed
            .store(1, Ordering::Release);
    }
}

impl FrameSink for RingProducer {
    fn write_frame<'a>(
        &'a mut self,
        head: &'a [u8],
        payload: &'a [u8],
    ) -> SinkFuture<'a, Result<(), String>> {
        Box::pin(async move {
            RingProducer::write_frame(self, head, payload)
                .await
                .map_err(|e| e.to_string())
        })
    }

    fn shutdown(&mut self) -> SinkFuture<'_, ()> {
        self.close();
        Box::pin(std::future::ready(()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The record header at data offset `at` (a frame length, or WRAP).
    fn header_at(seg: &Segment, at: usize) -> u64 {
        // SAFETY: test-only read of our own mapping, inside the data region.
        unsafe { std::ptr::read_unaligned(seg.data().add(at) as *const u64) }
    }

    /// A ring of `ring_bytes` in a fresh folder of /dev/shm, its producer, and a runtime for
    /// the producer's writes; the folder is removed when the first value is dropped.
    fn ring_pair(
        ring_bytes: usize,
    ) -> (
        tempfile::TempDir,
        RingConsumer,
        RingProducer,
        tokio::runtime::Runtime,
    ) {
        let dir = tempfile::tempdir_in("/dev/shm").unwrap();
        let cfg = ShmConfig {
            dir: dir.path().to_path_buf(),
            ring_bytes,
            spin_us: 0,
        };
        let ring = RingConsumer::create(&cfg, "w", 0, 1).unwrap();
        let p = RingProducer::open(ring.path(), &cfg).unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        (dir, ring, p, rt)
    }

    #[test]
    fn an_empty_ring_starts_over_at_its_first_bytes_past_256_kib() {
        let (_dir, ring, mut p, rt) = ring_pair(4 << 20);
        let head = [7u8; 32];
        let payload = vec![1u8; 100 << 10];
        let record = record_bytes(32 + payload.len()) as u64;
        let release_all =
            |p: &RingProducer| ring.seg.header().tail.store(p.head, Ordering::Release);
        // Three records back to back while the consumer holds them (not released).
        for _ in 0..3 {
            rt.block_on(p.write_frame(&head, &payload)).unwrap();
        }
        assert_eq!(p.head, 3 * record);
        // All released with the producer 300 KiB in: the next record starts over at offset 0,
        // behind a WRAP record where it would have gone.
        release_all(&p);
        rt.block_on(p.write_frame(&head, &payload)).unwrap();
        let cap = ring.seg.capacity as u64;
        assert_eq!(p.head, cap + record, "one lap skipped, then one record");
        assert_eq!(header_at(&ring.seg, 3 * record as usize), WRAP);
        assert_eq!(header_at(&ring.seg, 0), 32 + payload.len() as u64);
        // Held frames keep the producer moving forward: no restart while the ring is not empty.
        rt.block_on(p.write_frame(&head, &payload)).unwrap();
        assert_eq!(p.head, cap + 2 * record);
        // Below 256 KiB an empty ring does not restart either.
        release_all(&p);
        rt.block_on(p.write_frame(&head, &payload)).unwrap();
        assert_eq!(p.head, cap + 3 * record);
    }

    /// A release position the consumer cannot have reached (past what was sent, or more than
    /// a ring behind) fails the write with a clear error; it made the room computation
    /// underflow (a panic with overflow checks, a wait for room for ever without).
    #[test]
    fn an_impossible_release_position_fails_the_write() {
        let (_dir, ring, mut p, rt) = ring_pair(4 << 20);
        let (head, payload) = ([7u8; 32], vec![1u8; 256 << 10]);
        let cap = ring.seg.capacity as u64;
        // More than a lap sent (each frame released at once), so a position more than a
        // ring behind exists.
        while p.head <= cap + (64 << 10) {
            rt.block_on(p.write_frame(&head, &payload)).unwrap();
            ring.seg.header().tail.store(p.head, Ordering::Release);
        }
        for tail in [p.head + 64, u64::MAX, p.head - cap - 64] {
            ring.seg.header().tail.store(tail, Ordering::Release);
            let e = rt.block_on(p.write_frame(&head, &payload)).unwrap_err();
            assert!(
                matches!(e, ShmError::CorruptTail { tail: t, capacity, .. } if t == tail && capacity == cap),
                "{e}"
            );
        }
        // Released in order again, the ring takes frames again.
        ring.seg.header().tail.store(p.head, Ordering::Release);
        rt.block_on(p.write_frame(&head, &payload)).unwrap();
    }

    /// Two releases whose tails are published in the opposite order (the thread that took the
    /// earlier prefix publishing last) leave the tail at the later one: it never moves back.
    #[test]
    fn a_tail_published_late_never_moves_the_tail_back() {
        let (_dir, ring, _p, _rt) = ring_pair(1 << 16);
        let r = Releaser {
            pending: Mutex::new(VecDeque::new()),
        };
        assert_eq!(r.push(0, 128, false), 0);
        assert_eq!(r.push(128, 256, false), 0, "the oldest record held");
        let first = r.released_through(0);
        let second = r.released_through(128);
        assert_eq!((first, second), (Some(128), Some(256)));
        publish_tail(&ring.seg, 256);
        publish_tail(&ring.seg, 128);
        assert_eq!(ring.seg.header().tail.load(Ordering::Acquire), 256);
        assert_eq!(r.push(256, 320, false), 256, "nothing older held");
    }

    #[test]
    fn where_the_next_record_goes() {
        let (cap, kib) = (8u64 << 20, 1u64 << 10);
        // In place while the consumer holds records, however far in.
        assert_eq!(
            record_place(300 * kib, 0, cap, 100 * kib),
            Some((300 << 10, 0))
        );
        // Empty past 256 KiB: over at offset 0, skipping the rest.
        assert_eq!(
            record_place(300 * kib, 300 * kib, cap, 100 * kib),
            Some((300 << 10, cap - 300 * kib))
        );
        // Empty before 256 KiB: in place.
        assert_eq!(
            record_place(200 * kib, 200 * kib, cap, 100 * kib),
            Some((200 << 10, 0))
        );
        // Empty past 256 KiB but the record is larger than the offset: in place (restarting
        // would count the skipped end as used and an empty ring would never have room).
        assert_eq!(
            record_place(300 * kib, 300 * kib, cap, 1024 * kib),
            Some((300 << 10, 0))
        );
        // A record that would cross the end wraps; one that finds no room waits.
        assert_eq!(
            record_place(cap - kib, cap - kib, cap, 4 * kib),
            Some(((cap - kib) as usize, kib))
        );
        assert_eq!(record_place(cap, 0, cap, 64), None);
    }

    #[test]
    fn an_empty_ring_restarts_only_where_the_record_fits_before_the_skipped_end() {
        let (_dir, ring, mut p, rt) = ring_pair(8 << 20);
        let head = [7u8; 32];
        let small = vec![1u8; 300 << 10];
        let large = vec![1u8; 1 << 20];
        rt.block_on(p.write_frame(&head, &small)).unwrap();
        let at = p.head;
        ring.seg.header().tail.store(p.head, Ordering::Release);
        // Past 256 KiB with the ring empty, but a 1 MiB record would not fit in the 300 KiB
        // the restart has room for (the skipped end counts as used until the consumer passes
        // it): it goes on in place, and the write completes instead of waiting forever.
        // A guard against a hang only (the write itself takes microseconds).
        let wrote = rt.block_on(async {
            tokio::time::timeout(Duration::from_secs(60), p.write_frame(&head, &large)).await
        });
        assert!(wrote.is_ok(), "the write waited for room in an empty ring");
        assert_eq!(header_at(&ring.seg, at as usize), 32 + large.len() as u64);
    }

    #[test]
    fn full_shm_dir_is_a_clear_error() {
        let dir = tempfile::tempdir_in("/dev/shm").unwrap();
        let cfg = ShmConfig {
            dir: dir.path().to_path_buf(),
            ring_bytes: 1 << 50, // 1 PiB: no tmpfs has room
            spin_us: 0,
        };
        let err = RingConsumer::create(&cfg, "t", 0, 1)
            .err()
            .expect("must fail");
        assert!(
            matches!(err, ShmError::NoSpace { .. } | ShmError::Io { .. }),
            "{err}"
        );
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            0,
            "no file left behind"
        );
    }

    #[test]
    fn stale_and_foreign_segments_are_refused() {
        let dir = tempfile::tempdir_in("/dev/shm").unwrap();
        let cfg = ShmConfig {
            dir: dir.path().to_path_buf(),
            ring_bytes: 1 << 16,
            spin_us: 0,
        };
        // A foreign file.
        let foreign = dir.path().join("expertmesh-x-0to1-1-00");
        std::fs::write(&foreign, vec![7u8; 8192]).unwrap();
        assert!(matches!(
            RingProducer::open(&foreign, &cfg),
            Err(ShmError::BadSegment { .. })
        ));
        // A file outside the directory.
        let outside = Path::new("/etc/hostname");
        assert!(matches!(
            RingProducer::open(outside, &cfg),
            Err(ShmError::BadSegment { .. })
        ));
        // A ring whose creator's id runs nothing here (another PID namespace) but which it
        // holds locked: a live creator, opened.
        let ring = RingConsumer::create(&cfg, "x", 0, 1).unwrap();
        let gone = 0x3FFF_FFF0u32;
        // SAFETY: test-only write to our own mapping.
        unsafe { (*(ring.seg.map.as_mut_ptr() as *mut SegHeader)).creator_pid = gone };
        assert!(RingProducer::open(ring.path(), &cfg).is_ok());
        // The same bytes in a file nobody holds: its creator is dead.
        let copy = dir.path().join(format!("{FILE_PREFIX}x-0to1-{gone}-cd"));
        // SAFETY: reads our own mapping of `map.len()` bytes.
        let bytes =
            unsafe { std::slice::from_raw_parts(ring.seg.map.as_ptr(), ring.seg.map.len()) };
        std::fs::write(&copy, bytes).unwrap();
        std::fs::set_permissions(&copy, std::os::unix::fs::PermissionsExt::from_mode(0o600))
            .unwrap();
        let err = RingProducer::open(&copy, &cfg).err().unwrap();
        assert!(err.to_string().contains("stale"), "{err}");
        // Stale-file sweep removes files of dead pids, not a locked one.
        let dead = dir.path().join(format!("{FILE_PREFIX}x-0to1-{gone}-ab"));
        std::fs::write(&dead, b"old").unwrap();
        let held = dir.path().join(format!("{FILE_PREFIX}x-0to1-{gone}-ef"));
        let lock = expertmesh_files::create_locked(&held, Some(0o600)).unwrap();
        assert_eq!(remove_stale_segments(dir.path(), "x"), 2);
        assert!(!dead.exists() && !copy.exists());
        assert!(held.exists(), "a locked segment was removed");
        drop(lock);
        // A capacity the file cannot hold, near the top of the integers: refused, not an
        // overflow.
        let ring = RingConsumer::create(&cfg, "y", 0, 1).unwrap();
        // SAFETY: test-only write to our own mapping.
        unsafe { (*(ring.seg.map.as_mut_ptr() as *mut SegHeader)).capacity = u64::MAX - 8 };
        let err = RingProducer::open(ring.path(), &cfg).err().unwrap();
        assert!(matches!(err, ShmError::BadSegment { .. }), "{err}");
        assert!(
            err.to_string().contains("does not match file size"),
            "{err}"
        );
    }
}
