//! The TCP driver: listening, dialling with backoff, the handshake over a socket, and the frame
//! reader. Also the rendezvous for shared-memory and RDMA links, which are negotiated over the
//! authenticated TCP connection.
//!
//! Why this exists: TCP is the link that works everywhere, and every other link needs a
//! reliable, authenticated channel to exchange ring paths or queue pair numbers first. Sockets
//! get `TCP_NODELAY` (frames are latency-critical and already batched), frames are written with
//! one vectored write of header and payload (no copy into a staging buffer), and read directly
//! into 64-byte aligned pooled buffers.

use crate::codec::{self, Body, CodecConfig, FrameHeader, HEADER_LEN};
use crate::mesh::{BufPool, FrameWriter, LinkKind, MeshInner, NewLink, Rank, StartError, Storage};
use crate::protocol::{Connection, Event, PeerInfo, ProtocolConfig, ProtocolError};
use expertmesh_quant::aligned::AlignedVec;
use std::io::IoSlice;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Prefix of a shared-memory attachment in a hello (followed by the ring file path).
pub(crate) const SHM_ATTACHMENT: &[u8] = b"shm:";
/// Prefix of an RDMA attachment in a hello (followed by the queue pair description).
pub(crate) const RDMA_ATTACHMENT: &[u8] = b"rdma:";

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

/// Why a frame could not be read from a stream.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ReadError {
    #[error("connection closed by peer")]
    Eof,
    #[error("read failed: {0}")]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Codec(#[from] codec::CodecError),
}

impl ReadError {
    pub(crate) fn into_protocol(self) -> ProtocolError {
        match self {
            Self::Codec(c) => ProtocolError::Codec(c),
            other => ProtocolError::Closed(other.to_string()),
        }
    }
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

/// Writes a protocol frame (no payload).
async fn write_body<W: AsyncWrite + Unpin>(
    w: &mut W,
    body: &Body,
    codec: &CodecConfig,
) -> std::io::Result<()> {
    let bytes = codec::encode_frame(body, &[], codec)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    w.write_all(&bytes).await
}

/// Fresh random bytes for a hello nonce.
pub(crate) fn nonce() -> [u8; 32] {
    let mut n = [0u8; 32];
    if let Ok(mut f) = std::fs::File::open("/dev/urandom") {
        use std::io::Read;
        if f.read_exact(&mut n).is_ok() {
            return n;
        }
    }
    // No /dev/urandom: fall back to time and address entropy (still unique per connection).
    let t = Instant::now();
    let mix = format!("{t:?}{:p}{}", &n, std::process::id());
    let h = crc32c::crc32c(mix.as_bytes());
    for (i, b) in n.iter_mut().enumerate() {
        *b = (h.rotate_left(i as u32) & 0xFF) as u8 ^ i as u8;
    }
    n
}

/// Runs the handshake over `stream` until established, flushing a refusal to the peer on
/// failure. `first` is a frame already read (the acceptor peeks the dialer's hello).
pub(crate) async fn handshake(
    stream: &mut TcpStream,
    conn: &mut Connection,
    codec: &CodecConfig,
    first: Option<(FrameHeader, AlignedVec<u8>)>,
    deadline: Duration,
) -> Result<PeerInfo, ProtocolError> {
    let pool = BufPool::new(0);
    let run = async {
        let mut pending = first;
        loop {
            while let Some(b) = conn.poll_transmit() {
                write_body(stream, &b, codec)
                    .await
                    .map_err(|e| ProtocolError::Closed(format!("handshake write: {e}")))?;
            }
            match conn.poll_event() {
                Some(Event::Established(p)) => return Ok(p),
                Some(Event::Closed(e)) => return Err(e),
                None => {}
            }
            if let Some(e) = conn.close_reason() {
                return Err(e.clone());
            }
            let (header, buf) = match pending.take() {
                Some(f) => f,
                None => read_frame(stream, codec, &pool).await.map_err(|e| match e {
                    ReadError::Eof => ProtocolError::Closed(
                        "peer closed the connection during the handshake (did it refuse us? check its log)".into(),
                    ),
                    other => other.into_protocol(),
                })?,
            };
            let (body, _) = codec::decode_with_header(&header, &buf[..header.frame_len as usize])?;
            if let Err(e) = conn.handle_frame(Instant::now(), &body, 0) {
                // Flush the refusal so the peer learns why.
                while let Some(b) = conn.poll_transmit() {
                    let _ = write_body(stream, &b, codec).await;
                }
                return Err(e);
            }
        }
    };
    match tokio::time::timeout(deadline, run).await {
        Ok(r) => r,
        Err(_) => Err(ProtocolError::HandshakeTimeout(deadline)),
    }
}

pub(crate) async fn start_listener(inner: &Arc<MeshInner>) -> Result<(), StartError> {
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
        let inner2 = Arc::clone(&inner);
        tokio::spawn(async move {
            if let Err(e) = accept_one(&inner2, stream).await {
                tracing::warn!(%from, "refused incoming connection: {e}");
            }
        });
    }
}

async fn accept_one(inner: &Arc<MeshInner>, mut stream: TcpStream) -> Result<(), ProtocolError> {
    let _ = stream.set_nodelay(true);
    let codec = inner.proto_cfg.codec;
    let deadline = inner.proto_cfg.handshake_timeout;
    let pool = BufPool::new(0);
    // Peek the dialer's hello: its attachment decides the link kind.
    let first = tokio::time::timeout(deadline, read_frame(&mut stream, &codec, &pool))
        .await
        .map_err(|_| ProtocolError::HandshakeTimeout(deadline))?
        .map_err(ReadError::into_protocol)?;
    let (body, _) = codec::decode_with_header(&first.0, &first.1[..first.0.frame_len as usize])?;
    let (kind, peer_rank) = match &body {
        Body::Hello(h) if h.attachment.starts_with(SHM_ATTACHMENT) => (LinkKind::Shm, h.rank),
        Body::Hello(h) if h.attachment.starts_with(RDMA_ATTACHMENT) => (LinkKind::Rdma, h.rank),
        Body::Hello(h) => (LinkKind::Tcp, h.rank),
        _ => (LinkKind::Tcp, u32::MAX),
    };
    establish(inner, stream, None, kind, Some(first), peer_rank).await
}

/// Dials `peer` forever (until shutdown), redialling with exponential backoff after a failure
/// or a lost link. A shared-memory or RDMA setup failure falls back to TCP for the next try.
pub(crate) async fn dial_loop(inner: Arc<MeshInner>, peer: Rank) {
    let mut backoff = inner.cfg.reconnect_initial;
    let mut fallback_tcp = false;
    let mut failures = 0u32;
    while !inner.is_shutdown() {
        if let Some(link) = inner.current(peer) {
            let closed = link.closed_notify.notified();
            tokio::pin!(closed);
            closed.as_mut().enable();
            if !link.is_closed() {
                closed.await;
            }
            backoff = inner.cfg.reconnect_initial;
            continue;
        }
        let spec = inner.cfg.peers[peer as usize].clone();
        let kind = if fallback_tcp {
            LinkKind::Tcp
        } else {
            spec.link
        };
        let attempt = async {
            let stream = TcpStream::connect(spec.addr)
                .await
                .map_err(|e| ProtocolError::Closed(format!("connect to {}: {e}", spec.addr)))?;
            let _ = stream.set_nodelay(true);
            establish(&inner, stream, Some(peer), kind, None, peer).await
        };
        match attempt.await {
            Ok(()) => {
                failures = 0;
                backoff = inner.cfg.reconnect_initial;
            }
            Err(e) => {
                failures += 1;
                let msg = format!("dial {} ({}): {e}", spec.addr, kind.name());
                if failures == 1 || failures.is_multiple_of(20) {
                    tracing::warn!(peer, attempt = failures, "{msg}; retrying in {backoff:?}");
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
                let sleep = tokio::time::sleep(backoff);
                tokio::select! {
                    _ = sleep => {}
                    _ = inner.shutdown_notify.notified() => return,
                }
                backoff = (backoff * 2).min(inner.cfg.reconnect_max);
            }
        }
    }
}

/// Handshakes over `stream` and installs a link of `kind` (TCP, or shm/RDMA set up over it).
async fn establish(
    inner: &Arc<MeshInner>,
    mut stream: TcpStream,
    expected: Option<Rank>,
    kind: LinkKind,
    first: Option<(FrameHeader, AlignedVec<u8>)>,
    peer_hint: Rank,
) -> Result<(), ProtocolError> {
    let codec = inner.proto_cfg.codec;
    let deadline = inner.proto_cfg.handshake_timeout;
    let me = inner.proto_cfg.local_rank;
    // Prepare the receive side of a shm/RDMA link before the hello, so its description can be
    // attached. A failure here degrades to TCP (with a warning), never to a crash.
    let mut prepared = Prepared::None;
    let mut attachment = Vec::new();
    let mut cfg: Arc<ProtocolConfig> = Arc::clone(&inner.proto_cfg);
    match kind {
        LinkKind::Tcp => {}
        LinkKind::Shm => match crate::shm::RingConsumer::create(
            &inner.cfg.shm,
            &inner.cfg.protocol.cluster,
            peer_hint,
            me,
        ) {
            Ok(ring) => {
                attachment.extend_from_slice(SHM_ATTACHMENT);
                attachment.extend_from_slice(ring.path().as_os_str().as_encoded_bytes());
                let mut c = (*inner.proto_cfg).clone();
                c.recv_window_bytes = c.recv_window_bytes.min(ring.usable_window(&codec));
                cfg = Arc::new(c);
                prepared = Prepared::Shm(ring);
            }
            Err(e) => {
                if expected.is_some() {
                    return Err(ProtocolError::Closed(format!("link setup: {e}")));
                }
                tracing::warn!(
                    peer = peer_hint,
                    "shared memory unavailable ({e}); answering with TCP"
                );
            }
        },
        LinkKind::Rdma => {
            #[cfg(feature = "rdma")]
            match crate::rdma::RdmaPrepared::new(inner) {
                Ok(p) => {
                    attachment.extend_from_slice(RDMA_ATTACHMENT);
                    attachment.extend_from_slice(&p.local_info());
                    prepared = Prepared::Rdma(p);
                }
                Err(e) => {
                    if expected.is_some() {
                        return Err(ProtocolError::Closed(format!("link setup: {e}")));
                    }
                    tracing::warn!(
                        peer = peer_hint,
                        "RDMA unavailable ({e}); answering with TCP"
                    );
                }
            }
            #[cfg(not(feature = "rdma"))]
            {
                if expected.is_some() {
                    return Err(ProtocolError::Closed(
                        "link setup: this build lacks feature `rdma`".into(),
                    ));
                }
            }
        }
    }
    let recv_window = cfg.recv_window_bytes;
    let mut conn = Connection::new(
        Arc::clone(&cfg),
        expected,
        nonce(),
        attachment,
        Instant::now(),
    );
    let peer = handshake(&mut stream, &mut conn, &codec, first, deadline).await?;
    let peer_shm = peer.attachment.strip_prefix(SHM_ATTACHMENT);
    let peer_rdma = peer.attachment.strip_prefix(RDMA_ATTACHMENT);
    match (prepared, peer_shm, peer_rdma) {
        (Prepared::Shm(ring), Some(path), _) => {
            let path = std::path::PathBuf::from(std::str::from_utf8(path).map_err(|_| {
                ProtocolError::Closed("link setup: peer ring path not UTF-8".into())
            })?);
            let producer = crate::shm::RingProducer::open(&path, &inner.cfg.shm)
                .map_err(|e| ProtocolError::Closed(format!("link setup: {e}")))?;
            // Tell the peer its ring is mapped; wait for the same about ours, then unlink ours
            // so no segment outlives the processes.
            stream
                .write_all(&[1])
                .await
                .map_err(|e| ProtocolError::Closed(format!("link setup: shm sync write: {e}")))?;
            let mut b = [0u8; 1];
            tokio::time::timeout(deadline, stream.read_exact(&mut b))
                .await
                .map_err(|_| ProtocolError::HandshakeTimeout(deadline))?
                .map_err(|e| {
                    ProtocolError::Closed(format!(
                        "link setup: peer could not map the shared-memory ring ({e})"
                    ))
                })?;
            ring.unlink();
            let new = NewLink {
                peer,
                kind: LinkKind::Shm,
                proto: conn,
                writer: FrameWriter::Shm(producer),
                recv_window,
            };
            let link = inner.install(new);
            crate::shm::spawn_consumer(Arc::clone(&link), ring, codec);
            let watcher = tokio::spawn(watch_control_socket(Arc::clone(&link), stream));
            link.add_task(watcher.abort_handle());
            Ok(())
        }
        #[cfg(feature = "rdma")]
        (Prepared::Rdma(p), _, Some(info)) => {
            let (writer, reader) = p
                .connect(info)
                .map_err(|e| ProtocolError::Closed(format!("link setup: {e}")))?;
            let new = NewLink {
                peer,
                kind: LinkKind::Rdma,
                proto: conn,
                writer: FrameWriter::Rdma(writer),
                recv_window,
            };
            let link = inner.install(new);
            crate::rdma::spawn_poller(Arc::clone(&link), reader, codec);
            let watcher = tokio::spawn(watch_control_socket(Arc::clone(&link), stream));
            link.add_task(watcher.abort_handle());
            Ok(())
        }
        (_, _, _) => {
            // Plain TCP (requested, or one side could not set up shm/RDMA).
            if kind != LinkKind::Tcp {
                tracing::warn!(
                    peer = peer.rank,
                    "{} not available on both sides; using TCP",
                    kind.name()
                );
            }
            let (read, write) = stream.into_split();
            let new = NewLink {
                peer,
                kind: LinkKind::Tcp,
                proto: conn,
                writer: FrameWriter::Tcp(write),
                recv_window,
            };
            let link = inner.install(new);
            let reader = tokio::spawn(tcp_reader(Arc::clone(&link), read, codec));
            link.add_task(reader.abort_handle());
            Ok(())
        }
    }
}

enum Prepared {
    None,
    Shm(crate::shm::RingConsumer),
    #[cfg(feature = "rdma")]
    Rdma(crate::rdma::RdmaPrepared),
}

/// For shm and RDMA links: the TCP connection carries nothing after setup; its closing means
/// the peer process is gone.
async fn watch_control_socket(link: Arc<crate::mesh::Link>, mut stream: TcpStream) {
    let mut b = [0u8; 64];
    let why = match stream.read(&mut b).await {
        Ok(0) => "peer closed its control connection (process exited?)".to_string(),
        Ok(n) => format!("{n} unexpected bytes on the control connection"),
        Err(e) => format!("control connection failed: {e}"),
    };
    link.fail(ProtocolError::Closed(why));
}

async fn tcp_reader(
    link: Arc<crate::mesh::Link>,
    read: tokio::net::tcp::OwnedReadHalf,
    codec: CodecConfig,
) {
    let mut r = tokio::io::BufReader::with_capacity(64 << 10, read);
    loop {
        let (header, buf) = match read_frame(&mut r, &codec, &link.pool).await {
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
