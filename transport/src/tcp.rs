//! The TCP driver: frames over a socket (vectored writes, reads into pooled aligned buffers),
//! the handshake and the link-setup step driven over a socket, and the reader and watcher tasks
//! of a link.
//!
//! Why this exists: TCP is the link that works everywhere, and every other link needs a
//! reliable, authenticated channel to exchange ring paths or queue pair numbers first. Sockets
//! get `TCP_NODELAY` (frames are latency-critical and already batched), frames are written with
//! one vectored write of header and payload (no copy into a staging buffer), and read directly
//! into 64-byte aligned pooled buffers.
//!
//! With credentials, every frame after an end's own auth answer is sealed
//! ([`crypto`]: AES-256-GCM, counter nonces): [`SealBuf`] encrypts a frame into
//! a staging buffer bounded by one chunk, [`FrameIn`] reads a sealed head, opens it, checks
//! the header and only then reads the payload straight into the pooled aligned buffer and
//! opens it in place. A frame that does not open closes the connection
//! ([`ReadError::Integrity`]). Before the peer has authenticated, frames are read with the
//! maximum size capped at [`PRE_AUTH_MAX_FRAME_BYTES`].
//!
//! Pre-authentication limits on the accepting side live here too ([`HandshakeGate`]: at most
//! a few handshakes per source address and in total; [`MemoryBudget`]: all connections'
//! receive buffers together), with the rate-limited log of refused handshakes
//! ([`log_refusal`]).
//!
//! This module only moves bytes: what to send and what the bytes mean during the handshake and
//! link setup is decided by the sans-IO [`Connection`]; which link to build is decided by
//! [`setup`](crate::setup). Layering: imports [`link`](crate::link), [`codec`],
//! [`crypto`] and [`protocol`](crate::protocol) only; used by `setup`, `mesh`
//! and `frontend`.

use crate::codec::{self, Body, CodecConfig, FrameHeader, HEADER_LEN, PRE_AUTH_MAX_FRAME_BYTES};
use crate::crypto::{self, IntegrityError, Key, Opener, SEALED_PREFIX_BYTES, Sealer, TAG_BYTES};
use crate::link::{BufPool, FrameSink, Link, SinkFuture, Storage};
use crate::protocol::{Connection, Event, PeerInfo, ProtocolError};
use expertmesh_quant::aligned::AlignedVec;
use std::io::IoSlice;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};

/// Writes `head` then `payload` with vectored writes until both are written.
pub(crate) async fn write_vectored_all<W: AsyncWrite + Unpin>(
    w: &mut W,
    head: &[u8],
    payload: &[u8],
) -> std::io::Result<()> {
    let mut bufs = [IoSlice::new(head), IoSlice::new(payload)];
    let mut slices: &mut [IoSlice<'_>] = &mut bufs;
    IoSlice::advance_slices(&mut slices, 0);
    while !slices.is_empty() {
        let n = w.write_vectored(slices).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        IoSlice::advance_slices(&mut slices, n);
    }
    Ok(())
}

/// Bytes of a TCP reader's buffer. A frame's header is read through it, which also takes up to
/// this many bytes of what follows; the rest of a larger frame is read straight into its
/// pooled buffer. Small enough that a large frame's bytes are rarely copied twice (with 64 KiB,
/// up to 64 KiB of every 115 KB 8-token frame were), large enough that a run of small frames
/// still costs few reads. On the Xeon VM, 8-token dispatch over TCP read more of the raw
/// stream in each of nine paired rounds (0.30–0.62 of it with 64 KiB, 0.56–0.72 with 16).
pub(crate) const READ_BUFFER_BYTES: usize = 16 << 10;

/// Why a frame could not be read from a stream.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ReadError {
    #[error("connection closed by peer")]
    Eof,
    #[error("read failed: {0}")]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Codec(#[from] codec::CodecError),
    #[error(transparent)]
    Integrity(#[from] IntegrityError),
}

impl ReadError {
    pub(crate) fn into_protocol(self) -> ProtocolError {
        match self {
            Self::Codec(c) => ProtocolError::Codec(c),
            Self::Integrity(e) => ProtocolError::Integrity(e),
            other => ProtocolError::Lost(other.to_string()),
        }
    }
}

/// The codec settings for frames read before the peer has authenticated: `cfg` with its
/// maximum frame size capped at [`PRE_AUTH_MAX_FRAME_BYTES`].
pub(crate) fn pre_auth_codec(cfg: &CodecConfig) -> CodecConfig {
    CodecConfig {
        max_frame_bytes: cfg.max_frame_bytes.min(PRE_AUTH_MAX_FRAME_BYTES),
        ..*cfg
    }
}

/// The sending direction's sealing state: the sealer and its staging buffer (about one
/// chunk; reused for every frame).
pub(crate) struct SealBuf {
    sealer: Sealer,
    buf: Vec<u8>,
}

impl std::fmt::Debug for SealBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.sealer.fmt(f)
    }
}

impl SealBuf {
    /// Seals with `key` from counter 0.
    pub(crate) fn new(key: &Key) -> Self {
        Self {
            sealer: Sealer::new(key),
            buf: Vec::new(),
        }
    }
}

/// Writes one frame (`head` then `payload`): as it is without `seal`, else sealed, the payload
/// in chunks (one write per [`crypto::SEAL_CHUNK_BYTES`] at most).
pub(crate) async fn write_frame_sealed<W: AsyncWrite + Unpin>(
    w: &mut W,
    seal: Option<&mut SealBuf>,
    head: &[u8],
    payload: &[u8],
) -> std::io::Result<()> {
    let Some(s) = seal else {
        return write_vectored_all(w, head, payload).await;
    };
    let fail = |e: IntegrityError| std::io::Error::other(e.to_string());
    s.buf.clear();
    s.sealer.seal_head(head, &mut s.buf).map_err(fail)?;
    let mut off = 0;
    for n in crypto::payload_chunks(payload.len()) {
        if s.buf.len() + n + TAG_BYTES > crypto::SEAL_CHUNK_BYTES + TAG_BYTES + 4096 {
            w.write_all(&s.buf).await?;
            s.buf.clear();
        }
        s.sealer
            .seal_chunk(&payload[off..off + n], &mut s.buf)
            .map_err(fail)?;
        off += n;
    }
    w.write_all(&s.buf).await?;
    if s.buf.capacity() > 2 * crypto::SEAL_CHUNK_BYTES {
        s.buf = Vec::new();
    }
    Ok(())
}

/// Reads frames from a stream: plain, or (with an opener) sealed. The header
/// is read and checked (and, sealed, authenticated) first; the rest of the frame is read only
/// when asked ([`FrameIn::read_body`] or [`FrameIn::skip_body`]), so a reader can decide
/// from the header alone whether to take a frame.
pub(crate) struct FrameIn<R> {
    r: R,
    open: Option<Opener>,
    /// The head of the frame whose header was read (plain: the 32 header bytes; sealed: the
    /// whole opened head), reused between frames.
    head: Vec<u8>,
}

impl<R> std::fmt::Debug for FrameIn<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FrameIn")
            .field("sealed", &self.open.is_some())
            .finish()
    }
}

impl<R: AsyncRead + Unpin> FrameIn<R> {
    /// Reads from `r`, opening frames with `open` (`None`: plain frames).
    pub(crate) fn new(r: R, open: Option<Opener>) -> Self {
        Self {
            r,
            open,
            head: Vec::with_capacity(HEADER_LEN),
        }
    }

    /// The reader.
    pub(crate) fn get_ref(&self) -> &R {
        &self.r
    }

    /// The reader and its opener.
    pub(crate) fn into_parts(self) -> (R, Option<Opener>) {
        (self.r, self.open)
    }

    /// Reads and checks the next frame's header (sealed: its whole head, authenticated).
    pub(crate) async fn read_header(
        &mut self,
        cfg: &CodecConfig,
    ) -> Result<FrameHeader, ReadError> {
        let Some(open) = self.open.as_mut() else {
            self.head.resize(HEADER_LEN, 0);
            read_exact_or_eof(&mut self.r, &mut self.head).await?;
            return Ok(codec::decode_header(&self.head, cfg)?);
        };
        let mut prefix = [0u8; SEALED_PREFIX_BYTES];
        read_exact_or_eof(&mut self.r, &mut prefix).await?;
        let head_len = crypto::sealed_head_len(prefix, cfg)?;
        self.head.resize(head_len + TAG_BYTES, 0);
        self.r.read_exact(&mut self.head).await?;
        let header = crypto::open_head(open, prefix, &mut self.head, cfg)?;
        self.head.truncate(head_len);
        Ok(header)
    }

    /// Reads the rest of the frame whose header [`FrameIn::read_header`] returned into a
    /// pooled 64-byte aligned buffer (opened in place); the buffer holds the whole frame.
    pub(crate) async fn read_body(
        &mut self,
        header: &FrameHeader,
        pool: &BufPool,
    ) -> Result<AlignedVec<u8>, ReadError> {
        let len = header.frame_len as usize;
        let mut buf = pool.take(len);
        let have = self.head.len();
        buf[..have].copy_from_slice(&self.head);
        let Some(open) = self.open.as_mut() else {
            self.r.read_exact(&mut buf[have..len]).await?;
            return Ok(buf);
        };
        let mut off = have;
        for n in crypto::payload_chunks(header.payload_len as usize) {
            self.r.read_exact(&mut buf[off..off + n]).await?;
            let mut tag = [0u8; TAG_BYTES];
            self.r.read_exact(&mut tag).await?;
            open.open_separate(&mut buf[off..off + n], &tag)?;
            off += n;
        }
        Ok(buf)
    }

    /// Reads the metadata (and its padding) of the frame whose header was read, when a plain
    /// head does not hold it yet (a sealed head always does), unless it is longer than
    /// `max_meta` bytes. Returns the frame's bytes up to its payload (`None`: over `max_meta`,
    /// nothing read). [`FrameIn::read_body`] and [`FrameIn::skip_body`] go on from there.
    pub(crate) async fn read_meta(
        &mut self,
        header: &FrameHeader,
        max_meta: usize,
    ) -> Result<Option<&[u8]>, ReadError> {
        let end = header.payload_offset();
        let have = self.head.len();
        if have < end {
            if end - have > max_meta {
                return Ok(None);
            }
            self.head.resize(end, 0);
            self.r.read_exact(&mut self.head[have..]).await?;
        }
        Ok(Some(&self.head))
    }

    /// Reads past the rest of the frame whose header was read, keeping nothing of it.
    pub(crate) async fn skip_body(&mut self, header: &FrameHeader) -> Result<(), ReadError> {
        let rest = match self.open.as_mut() {
            None => header.frame_len as u64 - self.head.len() as u64,
            Some(open) => {
                let mut bytes = 0u64;
                for n in crypto::payload_chunks(header.payload_len as usize) {
                    open.skip()?;
                    bytes += (n + TAG_BYTES) as u64;
                }
                bytes
            }
        };
        let copied = tokio::io::copy(&mut (&mut self.r).take(rest), &mut tokio::io::sink()).await?;
        if copied < rest {
            return Err(ReadError::Eof);
        }
        Ok(())
    }

    /// Reads one whole frame.
    pub(crate) async fn read_frame(
        &mut self,
        cfg: &CodecConfig,
        pool: &BufPool,
    ) -> Result<(FrameHeader, AlignedVec<u8>), ReadError> {
        let header = self.read_header(cfg).await?;
        let buf = self.read_body(&header, pool).await?;
        Ok((header, buf))
    }
}

/// `read_exact`, with a clean end of stream before the first byte reported as [`ReadError::Eof`].
async fn read_exact_or_eof<R: AsyncRead + Unpin>(
    r: &mut R,
    buf: &mut [u8],
) -> Result<(), ReadError> {
    match r.read_exact(buf).await {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Err(ReadError::Eof),
        Err(e) => Err(ReadError::Io(e)),
    }
}

/// The sealing state of a connection's two directions (both `None`: plain, insecure mode).
#[derive(Debug, Default)]
pub(crate) struct Crypt {
    /// Seals what this end writes (set after this end's auth answer).
    pub(crate) seal: Option<SealBuf>,
    /// Opens what this end reads (set after the peer's auth answer).
    pub(crate) open: Option<Opener>,
}

/// Reads one frame: header first (validated against the maximum size before any allocation),
/// then the rest into a pooled 64-byte aligned buffer.
pub(crate) async fn read_frame<R: AsyncRead + Unpin>(
    r: &mut R,
    codec: &CodecConfig,
    pool: &BufPool,
) -> Result<(FrameHeader, AlignedVec<u8>), ReadError> {
    let mut hdr = [0u8; HEADER_LEN];
    match r.read_exact(&mut hdr).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Err(ReadError::Eof),
        Err(e) => return Err(ReadError::Io(e)),
    }
    let header = codec::decode_header(&hdr, codec)?;
    let len = header.frame_len as usize;
    let mut buf = pool.take(len);
    buf[..HEADER_LEN].copy_from_slice(&hdr);
    r.read_exact(&mut buf[HEADER_LEN..len]).await?;
    Ok((header, buf))
}

/// Writes a protocol frame (no payload), sealed when `seal` is set.
async fn write_body<W: AsyncWrite + Unpin>(
    w: &mut W,
    body: &Body,
    codec: &CodecConfig,
    seal: Option<&mut SealBuf>,
) -> std::io::Result<()> {
    let bytes = codec::encode_frame(body, &[], codec)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    write_frame_sealed(w, seal, &bytes, &[]).await
}

/// Writes the protocol's queued frames; after this end's own auth answer, every later frame
/// is sealed.
async fn flush_transmit(
    stream: &mut TcpStream,
    conn: &mut Connection,
    codec: &CodecConfig,
    crypt: &mut Crypt,
) -> std::io::Result<()> {
    while let Some(b) = conn.poll_transmit() {
        write_body(stream, &b, codec, crypt.seal.as_mut()).await?;
        if Connection::seals_after(&b) {
            crypt.seal = conn.session_keys().map(|k| SealBuf::new(&k.send));
        }
    }
    Ok(())
}

/// Reads one handshake frame: plain and capped at the pre-authentication size until the
/// peer's auth answer, sealed after it.
async fn read_handshake_frame(
    stream: &mut TcpStream,
    codec: &CodecConfig,
    crypt: &mut Crypt,
) -> Result<(FrameHeader, AlignedVec<u8>), ReadError> {
    let pool = BufPool::new(0);
    match crypt.open.take() {
        None => read_frame(stream, &pre_auth_codec(codec), &pool).await,
        Some(open) => {
            let mut r = FrameIn::new(&mut *stream, Some(open));
            let f = r.read_frame(codec, &pool).await;
            crypt.open = r.into_parts().1;
            f
        }
    }
}

/// Feeds one handshake frame to the protocol; after the peer's auth answer, frames are
/// opened with the receiving session key.
fn feed_handshake_frame(
    conn: &mut Connection,
    crypt: &mut Crypt,
    header: &FrameHeader,
    buf: &[u8],
) -> Result<(), ProtocolError> {
    let (body, _) = codec::decode_with_header(header, &buf[..header.frame_len as usize])?;
    conn.handle_frame(Instant::now(), &body, header.frame_len as u64)?;
    if Connection::seals_after(&body) {
        crypt.open = conn.session_keys().map(|k| Opener::new(&k.recv));
    }
    Ok(())
}

/// Runs the handshake over `stream` until established or until the protocol asks for link
/// setup ([`Event::LinkSetup`]; then [`drive_link_setup`] follows), flushing a refusal to the
/// peer on failure. `first` is a frame already read (the acceptor peeks the dialer's hello).
pub(crate) async fn handshake(
    stream: &mut TcpStream,
    conn: &mut Connection,
    codec: &CodecConfig,
    first: Option<(FrameHeader, AlignedVec<u8>)>,
    deadline: Duration,
    crypt: &mut Crypt,
) -> Result<PeerInfo, ProtocolError> {
    let run = async {
        let mut pending = first;
        loop {
            flush_transmit(stream, conn, codec, crypt)
                .await
                .map_err(|e| ProtocolError::Lost(format!("handshake write: {e}")))?;
            match conn.poll_event() {
                Some(Event::Established(p)) | Some(Event::LinkSetup { peer: p, .. }) => {
                    return Ok(p);
                }
                Some(Event::Closed(e)) => return Err(e),
                None => {}
            }
            if let Some(e) = conn.close_reason() {
                return Err(e.clone());
            }
            let (header, buf) = match pending.take() {
                Some(f) => f,
                None => read_handshake_frame(stream, codec, crypt)
                    .await
                    .map_err(handshake_read_error)?,
            };
            if let Err(e) = feed_handshake_frame(conn, crypt, &header, &buf) {
                // Flush the refusal so the peer learns why.
                let _ = flush_transmit(stream, conn, codec, crypt).await;
                return Err(e);
            }
        }
    };
    match tokio::time::timeout(deadline, run).await {
        Ok(r) => r,
        Err(_) => Err(ProtocolError::HandshakeTimeout(deadline)),
    }
}

fn handshake_read_error(e: ReadError) -> ProtocolError {
    match e {
        ReadError::Eof => ProtocolError::Lost(
            "peer closed the connection during the handshake (did it refuse us? check its log)"
                .into(),
        ),
        other => other.into_protocol(),
    }
}

/// After [`Connection::link_prepared`]: sends this end's link info and reads the peer's
/// (sealed with credentials), within the handshake deadline. Returns once the peer's info is
/// in, or the connection fell back to TCP (then [`Connection::is_established`]).
pub(crate) async fn exchange_link_info(
    stream: &mut TcpStream,
    conn: &mut Connection,
    codec: &CodecConfig,
    crypt: &mut Crypt,
    deadline: Duration,
) -> Result<(), ProtocolError> {
    let run = async {
        loop {
            flush_transmit(stream, conn, codec, crypt)
                .await
                .map_err(|e| ProtocolError::Closed(format!("link setup write: {e}")))?;
            if let Some(e) = conn.close_reason() {
                return Err(e.clone());
            }
            if !conn.awaits_link_info() || conn.is_established() {
                return Ok(());
            }
            let (header, buf) = read_handshake_frame(stream, codec, crypt)
                .await
                .map_err(handshake_read_error)?;
            if let Err(e) = feed_handshake_frame(conn, crypt, &header, &buf) {
                let _ = flush_transmit(stream, conn, codec, crypt).await;
                return Err(e);
            }
        }
    };
    match tokio::time::timeout(deadline, run).await {
        Ok(r) => r,
        Err(_) => Err(ProtocolError::HandshakeTimeout(deadline)),
    }
}

/// Drives the link-setup state of `conn` over the TCP connection until established: writes the
/// raw bytes the protocol queues (the shared-memory sync byte) and feeds it the bytes that
/// arrive, within the protocol's deadline.
pub(crate) async fn drive_link_setup(
    stream: &mut TcpStream,
    conn: &mut Connection,
) -> Result<PeerInfo, ProtocolError> {
    loop {
        if let Some(b) = conn.poll_transmit_raw()
            && let Err(e) = stream.write_all(&[b]).await
        {
            conn.transport_failed(ProtocolError::Closed(format!(
                "link setup: shm sync write: {e}"
            )));
        }
        while let Some(ev) = conn.poll_event() {
            match ev {
                Event::Established(p) => return Ok(p),
                Event::Closed(e) => return Err(e),
                Event::LinkSetup { .. } => {}
            }
        }
        if let Some(e) = conn.close_reason() {
            return Err(e.clone());
        }
        if !conn.awaits_raw() {
            return Err(conn.link_setup_failed("driver did not finish its side of the link"));
        }
        let mut b = [0u8; 1];
        let read = match conn.poll_timeout() {
            Some(d) => {
                let d = tokio::time::Instant::from_std(d);
                tokio::time::timeout_at(d, stream.read_exact(&mut b)).await
            }
            None => Ok(stream.read_exact(&mut b).await),
        };
        match read {
            Err(_elapsed) => conn.handle_timeout(Instant::now()),
            Ok(Err(e)) => conn.transport_failed(ProtocolError::Closed(format!(
                "link setup: peer could not map the shared-memory ring ({e})"
            ))),
            Ok(Ok(_)) => {
                conn.handle_raw(&b)?;
            }
        }
    }
}

/// How long a TCP connect may take before the dialer gives up (and redials after its backoff).
pub(crate) const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_millis(500);

/// Dials `addr` with `TCP_NODELAY` set.
pub(crate) async fn connect(addr: std::net::SocketAddr) -> Result<TcpStream, ProtocolError> {
    // Bounded: a SYN lost in a partition would otherwise wait out the kernel's retransmission
    // schedule (tens of seconds) before the dialer's next, jittered attempt.
    let stream = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(addr))
        .await
        .map_err(|_| {
            ProtocolError::Lost(format!(
                "connect to {addr}: no answer within {CONNECT_TIMEOUT:?}"
            ))
        })?
        .map_err(|e| ProtocolError::Lost(format!("connect to {addr}: {e}")))?;
    let _ = stream.set_nodelay(true);
    Ok(stream)
}

/// The sending half of a TCP link (sealing every frame when the link is encrypted).
pub(crate) struct TcpSink(pub(crate) OwnedWriteHalf, pub(crate) Option<SealBuf>);

impl FrameSink for TcpSink {
    fn write_frame<'a>(
        &'a mut self,
        head: &'a [u8],
        payload: &'a [u8],
    ) -> SinkFuture<'a, Result<(), String>> {
        Box::pin(async move {
            write_frame_sealed(&mut self.0, self.1.as_mut(), head, payload)
                .await
                .map_err(|e| format!("TCP write: {e}"))
        })
    }

    fn shutdown(&mut self) -> SinkFuture<'_, ()> {
        Box::pin(async move {
            let _ = self.0.shutdown().await;
        })
    }
}

/// Starts the reader task of a TCP link (opening sealed frames with `open`).
pub(crate) fn spawn_reader(
    link: &Arc<Link>,
    read: OwnedReadHalf,
    open: Option<Opener>,
    codec: CodecConfig,
) {
    let reader = tokio::spawn(tcp_reader(Arc::clone(link), read, open, codec));
    link.add_task(reader.abort_handle());
}

/// Starts the task that fails a shared-memory or RDMA link when its TCP connection closes.
pub(crate) fn spawn_control_watch(link: &Arc<Link>, control: TcpStream) {
    let watcher = tokio::spawn(watch_control_socket(Arc::clone(link), control));
    link.add_task(watcher.abort_handle());
}

/// For shm and RDMA links: the TCP connection carries nothing after setup; its closing means
/// the peer process is gone.
async fn watch_control_socket(link: Arc<Link>, mut stream: TcpStream) {
    let mut b = [0u8; 64];
    let why = match stream.read(&mut b).await {
        Ok(0) => "peer closed its control connection (process exited?)".to_string(),
        Ok(n) => format!("{n} unexpected bytes on the control connection"),
        Err(e) => format!("control connection failed: {e}"),
    };
    link.fail(ProtocolError::Lost(why));
}

/// Reads frames from the socket into `link` until it fails.
async fn tcp_reader(
    link: Arc<Link>,
    read: OwnedReadHalf,
    open: Option<Opener>,
    codec: CodecConfig,
) {
    let mut r = FrameIn::new(BufReader::with_capacity(READ_BUFFER_BYTES, read), open);
    loop {
        let (header, buf) = match r.read_frame(&codec, &link.pool).await {
            Ok(f) => f,
            Err(e) => {
                link.fail(e.into_protocol());
                return;
            }
        };
        let storage = Storage::Heap {
            buf: Some(buf),
            pool: Arc::downgrade(&link.pool),
        };
        match link.on_frame(&header, storage) {
            Ok(Some(frame)) => link.deliver(frame),
            Ok(None) => {}
            Err(e) => {
                // Give the control task a moment to send the error frame, then close.
                tokio::time::sleep(Duration::from_millis(5)).await;
                link.fail(e);
                return;
            }
        }
    }
}

/// Limits on handshakes in progress on one listener: at most `per_source` from one IP address
/// and `total` in all. A connection over the per-source limit is closed at once, before
/// anything is read from it. When all `total` places are taken, a new connection takes the
/// place of the oldest handshake from another address that has been in progress for at least
/// [`HANDSHAKE_EVICT_AFTER`] (an honest handshake takes milliseconds, a slow-loris holds its
/// place for the whole handshake timeout): that one is told to stop
/// ([`HandshakePermit::evicted`]) and closed. Handshakes from `trusted` addresses (a mesh
/// listener trusts the addresses its topology names) are evicted only for another trusted
/// one, and only after every untrusted one. So a few addresses trickling bytes cannot keep
/// honest connections out (issue 27): at worst they slow each other down. Clones share the
/// counts.
#[derive(Clone, Debug)]
pub struct HandshakeGate {
    inner: Arc<std::sync::Mutex<GateState>>,
    per_source: u32,
    total: u32,
    trusted: Arc<std::collections::HashSet<std::net::IpAddr>>,
}

#[derive(Debug, Default)]
struct GateState {
    by_source: std::collections::HashMap<std::net::IpAddr, u32>,
    /// Handshakes in progress, by permit id.
    pending: std::collections::HashMap<u64, Pending>,
    next_id: u64,
    evictions: u64,
}

#[derive(Debug)]
struct Pending {
    ip: std::net::IpAddr,
    since: Instant,
    eviction: Arc<Eviction>,
}

/// The signal an evicted handshake waits on.
#[derive(Debug, Default)]
struct Eviction {
    evicted: std::sync::atomic::AtomicBool,
    notify: tokio::sync::Notify,
}

/// Default limit of concurrent handshakes from one source address.
pub const HANDSHAKES_PER_SOURCE: u32 = 8;
/// Default limit of concurrent handshakes on one listener.
pub const HANDSHAKES_TOTAL: u32 = 64;
/// How long a handshake is safe from eviction by newer connections ([`HandshakeGate`]).
pub const HANDSHAKE_EVICT_AFTER: Duration = Duration::from_millis(250);

impl Default for HandshakeGate {
    fn default() -> Self {
        Self::new(HANDSHAKES_PER_SOURCE, HANDSHAKES_TOTAL)
    }
}

impl HandshakeGate {
    /// A gate admitting `per_source` handshakes per address and `total` in all.
    pub fn new(per_source: u32, total: u32) -> Self {
        Self {
            inner: Arc::default(),
            per_source,
            total,
            trusted: Arc::default(),
        }
    }

    /// The same limits, with handshakes from `ips` evicted last (a mesh listener's known
    /// peers). The counts start afresh.
    pub fn trusting(self, ips: impl IntoIterator<Item = std::net::IpAddr>) -> Self {
        Self {
            inner: Arc::default(),
            trusted: Arc::new(ips.into_iter().collect()),
            ..self
        }
    }

    /// Admits a handshake from `ip`, or says which limit it hit.
    pub fn try_enter(&self, ip: std::net::IpAddr) -> Result<HandshakePermit, String> {
        self.try_enter_at(ip, Instant::now())
    }

    /// [`HandshakeGate::try_enter`] at time `now` (tests pass their own clock).
    pub fn try_enter_at(
        &self,
        ip: std::net::IpAddr,
        now: Instant,
    ) -> Result<HandshakePermit, String> {
        let mut st = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let n = st.by_source.get(&ip).copied().unwrap_or(0);
        if n >= self.per_source {
            return Err(format!(
                "{n} handshakes from {ip} already in progress (limit {})",
                self.per_source
            ));
        }
        if st.pending.len() as u32 >= self.total {
            let Some(victim) = self.victim(&st, ip, now) else {
                return Err(format!(
                    "{} handshakes already in progress (limit {}), none older than {:?} from another address",
                    st.pending.len(),
                    self.total,
                    HANDSHAKE_EVICT_AFTER
                ));
            };
            if let Some(p) = Self::remove(&mut st, victim) {
                p.eviction
                    .evicted
                    .store(true, std::sync::atomic::Ordering::Release);
                p.eviction.notify.notify_one();
                st.evictions += 1;
            }
        }
        *st.by_source.entry(ip).or_insert(0) += 1;
        let id = st.next_id;
        st.next_id += 1;
        let eviction = Arc::new(Eviction::default());
        st.pending.insert(
            id,
            Pending {
                ip,
                since: now,
                eviction: Arc::clone(&eviction),
            },
        );
        Ok(HandshakePermit {
            gate: self.clone(),
            id,
            eviction,
        })
    }

    /// The handshake a newcomer from `ip` may take the place of: the oldest one from another
    /// address in progress for at least [`HANDSHAKE_EVICT_AFTER`], untrusted ones first; a
    /// newcomer from an untrusted address never displaces a trusted one.
    fn victim(&self, st: &GateState, ip: std::net::IpAddr, now: Instant) -> Option<u64> {
        let newcomer_trusted = self.trusted.contains(&ip);
        st.pending
            .iter()
            .filter(|(_, p)| {
                p.ip != ip && now.saturating_duration_since(p.since) >= HANDSHAKE_EVICT_AFTER
            })
            .filter(|(_, p)| newcomer_trusted || !self.trusted.contains(&p.ip))
            .min_by_key(|(id, p)| (self.trusted.contains(&p.ip), p.since, **id))
            .map(|(id, _)| *id)
    }

    fn remove(st: &mut GateState, id: u64) -> Option<Pending> {
        let p = st.pending.remove(&id)?;
        if let Some(n) = st.by_source.get_mut(&p.ip) {
            *n -= 1;
            if *n == 0 {
                st.by_source.remove(&p.ip);
            }
        }
        Some(p)
    }

    /// Handshakes in progress now.
    pub fn in_progress(&self) -> u32 {
        self.inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pending
            .len() as u32
    }

    /// Handshakes evicted so far to make room for newer connections.
    pub fn evictions(&self) -> u64 {
        self.inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .evictions
    }
}

/// One admitted handshake; dropping it frees its place.
#[derive(Debug)]
pub struct HandshakePermit {
    gate: HandshakeGate,
    id: u64,
    eviction: Arc<Eviction>,
}

impl HandshakePermit {
    /// Completes when a newer connection has taken this handshake's place (see
    /// [`HandshakeGate`]): the handshake is to be abandoned and its connection closed.
    pub async fn evicted(&self) {
        loop {
            let notified = self.eviction.notify.notified();
            if self
                .eviction
                .evicted
                .load(std::sync::atomic::Ordering::Acquire)
            {
                return;
            }
            notified.await;
        }
    }

    /// Whether a newer connection has taken this handshake's place.
    pub fn is_evicted(&self) -> bool {
        self.eviction
            .evicted
            .load(std::sync::atomic::Ordering::Acquire)
    }
}

/// Why an evicted handshake ended (for logs and errors).
pub const EVICTED_REASON: &str = "handshake evicted: every handshake place was taken and this one was the oldest (a slow or stalled hello); connect again";

impl Drop for HandshakePermit {
    fn drop(&mut self) {
        let mut st = self.gate.inner.lock().unwrap_or_else(|e| e.into_inner());
        HandshakeGate::remove(&mut st, self.id);
    }
}

/// A budget of bytes that all connections of a listener may hold for receive buffers
/// together. Each authenticated connection reserves its worst case (its receive window) and
/// returns it on close; one beyond the budget is refused with a clear error. Clones share it.
#[derive(Clone, Debug)]
pub struct MemoryBudget {
    used: Arc<std::sync::atomic::AtomicU64>,
    limit: u64,
}

impl MemoryBudget {
    /// A budget of `limit` bytes.
    pub fn new(limit: u64) -> Self {
        Self {
            used: Arc::default(),
            limit,
        }
    }

    /// Reserves `bytes`, or explains why not.
    pub fn reserve(&self, bytes: u64) -> Result<MemoryReservation, String> {
        use std::sync::atomic::Ordering;
        let mut cur = self.used.load(Ordering::Relaxed);
        loop {
            let next = cur.saturating_add(bytes);
            if next > self.limit {
                return Err(format!(
                    "connection memory budget exhausted: {} MiB of {} MiB reserved by open connections, this one needs {} MiB; close idle connections or raise the budget",
                    cur >> 20,
                    self.limit >> 20,
                    bytes.div_ceil(1 << 20)
                ));
            }
            match self
                .used
                .compare_exchange_weak(cur, next, Ordering::AcqRel, Ordering::Relaxed)
            {
                Ok(_) => {
                    return Ok(MemoryReservation {
                        used: Arc::clone(&self.used),
                        bytes,
                    });
                }
                Err(now) => cur = now,
            }
        }
    }

    /// Bytes reserved now.
    pub fn used(&self) -> u64 {
        self.used.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The budget.
    pub fn limit(&self) -> u64 {
        self.limit
    }
}

/// Bytes reserved from a [`MemoryBudget`]; returned on drop.
#[derive(Debug)]
pub struct MemoryReservation {
    used: Arc<std::sync::atomic::AtomicU64>,
    bytes: u64,
}

impl Drop for MemoryReservation {
    fn drop(&mut self) {
        self.used
            .fetch_sub(self.bytes, std::sync::atomic::Ordering::AcqRel);
    }
}

/// A process-wide limit on how many lines a second a log site prints: [`LogThrottle::admit`]
/// says whether this line may be printed, and how many were held back since the last one.
pub(crate) struct LogThrottle {
    /// The current one-second window's start and the lines printed in it.
    window: std::sync::Mutex<(Option<Instant>, u32)>,
    suppressed: std::sync::atomic::AtomicU64,
    per_second: u32,
}

impl LogThrottle {
    /// At most `per_second` lines a second.
    pub(crate) const fn new(per_second: u32) -> Self {
        Self {
            window: std::sync::Mutex::new((None, 0)),
            suppressed: std::sync::atomic::AtomicU64::new(0),
            per_second,
        }
    }

    /// `Some(lines held back since the last printed)` when this line may be printed.
    pub(crate) fn admit(&self) -> Option<u64> {
        use std::sync::atomic::Ordering;
        let now = Instant::now();
        {
            let mut w = self.window.lock().unwrap_or_else(|e| e.into_inner());
            match w.0 {
                Some(t) if now.duration_since(t) < Duration::from_secs(1) => {
                    if w.1 >= self.per_second {
                        self.suppressed.fetch_add(1, Ordering::Relaxed);
                        return None;
                    }
                    w.1 += 1;
                }
                _ => *w = (Some(now), 1),
            }
        }
        Some(self.suppressed.swap(0, Ordering::Relaxed))
    }
}

/// Logs a refused handshake at warn level: the peer's address, who it claimed to be, and
/// why. At most [`REFUSAL_LOGS_PER_SECOND`] lines a second over the whole process; the next
/// line printed says how many were suppressed meanwhile.
pub fn log_refusal(what: &str, from: std::net::SocketAddr, claimed: Option<&str>, reason: &str) {
    static THROTTLE: LogThrottle = LogThrottle::new(REFUSAL_LOGS_PER_SECOND);
    let Some(suppressed) = THROTTLE.admit() else {
        return;
    };
    let claimed = claimed.unwrap_or("(no hello)");
    if suppressed > 0 {
        tracing::warn!(%from, claimed, suppressed, "refused {what}: {reason} ({suppressed} more refusals not logged)");
    } else {
        tracing::warn!(%from, claimed, "refused {what}: {reason}");
    }
}

/// Refused handshakes logged per second at most (see [`log_refusal`]).
pub const REFUSAL_LOGS_PER_SECOND: u32 = 5;

#[cfg(test)]
mod tests {
    use super::*;

    /// A loopback listener with an accept backlog of 0, filled: the kernel drops every further
    /// SYN to it, as a partition does (Linux).
    #[cfg(target_os = "linux")]
    fn black_hole() -> (std::net::TcpListener, Vec<std::net::TcpStream>) {
        use std::os::fd::FromRawFd;
        // SAFETY: plain socket calls on a descriptor made here and owned by the listener.
        let listener = unsafe {
            let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
            assert!(fd >= 0);
            let mut sa: libc::sockaddr_in = std::mem::zeroed();
            sa.sin_family = libc::AF_INET as libc::sa_family_t;
            sa.sin_addr.s_addr = u32::from(std::net::Ipv4Addr::LOCALHOST).to_be();
            let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
            assert_eq!(
                libc::bind(fd, (&sa as *const libc::sockaddr_in).cast(), len),
                0
            );
            assert_eq!(libc::listen(fd, 0), 0);
            std::net::TcpListener::from_raw_fd(fd)
        };
        let addr = listener.local_addr().unwrap();
        // Connects complete until the accept queue is full; then they wait. Full once two
        // connects in a row time out (2 s each: far beyond what a loopback connect takes; a
        // stall of this machine would have to outlast both).
        let mut held = Vec::new();
        let mut timed_out = 0;
        while timed_out < 2 {
            match std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2)) {
                Ok(s) => {
                    held.push(s);
                    timed_out = 0;
                }
                Err(_) => timed_out += 1,
            }
            assert!(held.len() < 64, "the backlog never filled");
        }
        (listener, held)
    }

    /// A dial whose SYNs go unanswered ends with the dialer's own connect timeout, not the
    /// kernel's SYN retries (minutes): what lets a partitioned peer be redialled soon after
    /// the heal. The outcome is asserted (the error names the timeout), with a hang guard.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_connect_nobody_answers_ends_at_the_connect_timeout() {
        let (listener, _held) = black_hole();
        let addr = listener.local_addr().unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let got = rt.block_on(async {
            tokio::time::timeout(Duration::from_secs(60), connect(addr))
                .await
                .expect("the dial waited for the kernel's SYN retries (hang guard)")
        });
        match got {
            Err(ProtocolError::Lost(m)) => {
                assert!(m.contains("no answer within"), "{m}");
            }
            Err(other) => panic!("{other}"),
            Ok(_) => panic!("a connect to a full backlog succeeded"),
        }
    }

    #[test]
    fn the_handshake_gate_limits_per_source_and_in_total() {
        let g = HandshakeGate::new(2, 3);
        let a: std::net::IpAddr = "10.0.0.1".parse().unwrap();
        let b: std::net::IpAddr = "10.0.0.2".parse().unwrap();
        let p1 = g.try_enter(a).unwrap();
        let _p2 = g.try_enter(a).unwrap();
        assert!(g.try_enter(a).unwrap_err().contains("from 10.0.0.1"));
        let _p3 = g.try_enter(b).unwrap();
        assert!(g.try_enter(b).unwrap_err().contains("limit 3"));
        drop(p1);
        assert_eq!(g.in_progress(), 2);
        assert!(g.try_enter(a).is_ok(), "a freed place is reused");
    }

    #[test]
    fn a_full_gate_evicts_the_oldest_handshake_of_another_address_once_old_enough() {
        let g = HandshakeGate::new(2, 3);
        let ip = |s: &str| -> std::net::IpAddr { s.parse().unwrap() };
        let t0 = Instant::now();
        let old = g.try_enter_at(ip("10.0.0.1"), t0).unwrap();
        let mid = g
            .try_enter_at(ip("10.0.0.1"), t0 + Duration::from_millis(10))
            .unwrap();
        let young = g
            .try_enter_at(ip("10.0.0.2"), t0 + Duration::from_millis(20))
            .unwrap();
        // Full, and nothing is old enough yet: refused.
        let soon = t0 + HANDSHAKE_EVICT_AFTER / 2;
        assert!(
            g.try_enter_at(ip("10.0.0.3"), soon)
                .unwrap_err()
                .contains("limit 3")
        );
        // Later, the oldest (from another address) makes room.
        let later = t0 + HANDSHAKE_EVICT_AFTER + Duration::from_millis(5);
        let newcomer = g.try_enter_at(ip("10.0.0.3"), later).unwrap();
        assert!(old.is_evicted() && !mid.is_evicted() && !young.is_evicted());
        assert_eq!((g.in_progress(), g.evictions()), (3, 1));
        // A newcomer from 10.0.0.2 takes the place of another address's old enough
        // handshake (10.0.0.1's `mid`), never its own address's.
        let again = g
            .try_enter_at(ip("10.0.0.2"), later + Duration::from_millis(30))
            .unwrap();
        assert!(mid.is_evicted() && !young.is_evicted() && !newcomer.is_evicted());
        drop(old);
        drop(mid);
        assert_eq!(
            g.in_progress(),
            3,
            "an evicted permit's drop frees nothing twice"
        );
        drop((young, newcomer, again));
        assert_eq!(g.in_progress(), 0);
    }

    #[test]
    fn untrusted_addresses_never_displace_trusted_handshakes() {
        let ip = |s: &str| -> std::net::IpAddr { s.parse().unwrap() };
        let g = HandshakeGate::new(4, 2).trusting([ip("10.0.0.1"), ip("10.0.0.2")]);
        let t0 = Instant::now();
        let later = t0 + 2 * HANDSHAKE_EVICT_AFTER;
        let peer = g.try_enter_at(ip("10.0.0.1"), t0).unwrap();
        let rogue = g
            .try_enter_at(ip("10.9.0.1"), t0 + Duration::from_millis(1))
            .unwrap();
        // An untrusted newcomer may only take an untrusted place.
        let rogue2 = g.try_enter_at(ip("10.9.0.2"), later).unwrap();
        assert!(rogue.is_evicted() && !peer.is_evicted());
        let e = g.try_enter_at(ip("10.9.0.3"), later).unwrap_err();
        assert!(e.contains("limit 2"), "{e}");
        // A trusted newcomer takes an untrusted place before an older trusted one.
        let at = later + HANDSHAKE_EVICT_AFTER;
        let peer2 = g.try_enter_at(ip("10.0.0.2"), at).unwrap();
        assert!(rogue2.is_evicted() && !peer.is_evicted() && !peer2.is_evicted());
        // Then, with only trusted ones left, the oldest of another address.
        let peer3 = g
            .try_enter_at(ip("10.0.0.2"), at + Duration::from_millis(1))
            .unwrap();
        assert!(peer.is_evicted() && !peer2.is_evicted() && !peer3.is_evicted());
    }

    #[tokio::test]
    async fn an_evicted_permit_wakes_its_waiter() {
        let g = HandshakeGate::new(1, 1);
        let ip = |s: &str| -> std::net::IpAddr { s.parse().unwrap() };
        let t0 = Instant::now();
        let first = g.try_enter_at(ip("10.0.0.1"), t0).unwrap();
        let wait = tokio::spawn(async move {
            first.evicted().await;
            first.is_evicted()
        });
        tokio::task::yield_now().await;
        let _second = g
            .try_enter_at(ip("10.0.0.2"), t0 + HANDSHAKE_EVICT_AFTER)
            .unwrap();
        let woke = tokio::time::timeout(Duration::from_secs(5), wait).await;
        assert!(woke.expect("woken within 5 s").unwrap());
    }

    #[test]
    fn the_memory_budget_refuses_beyond_its_limit_and_returns_on_drop() {
        let m = MemoryBudget::new(100 << 20);
        let r1 = m.reserve(60 << 20).unwrap();
        let e = m.reserve(60 << 20).unwrap_err();
        assert!(
            e.contains("budget exhausted") && e.contains("60 MiB of 100 MiB"),
            "{e}"
        );
        drop(r1);
        assert_eq!(m.used(), 0);
        let _r2 = m.reserve(60 << 20).unwrap();
    }

    #[test]
    fn a_pre_auth_header_announcing_a_huge_frame_is_refused_unread() {
        let cfg = pre_auth_codec(&CodecConfig::default());
        let body = Body::Credit(codec::Credit { bytes: 1 });
        let mut frame = codec::encode_frame(&body, &[], &CodecConfig::default()).unwrap();
        // Announce a 16 MiB frame (header checksum fixed up, as an attacker would).
        frame[8..12].copy_from_slice(&(16u32 << 20).to_le_bytes());
        let crc = crc32c::crc32c(&frame[..24]);
        frame[24..28].copy_from_slice(&crc.to_le_bytes());
        let e = codec::decode_header(&frame, &cfg).unwrap_err();
        assert!(
            matches!(
                e,
                codec::CodecError::TooLarge {
                    max: PRE_AUTH_MAX_FRAME_BYTES,
                    ..
                }
            ),
            "{e}"
        );
    }
}
