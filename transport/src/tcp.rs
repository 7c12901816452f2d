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
//! This module only moves bytes: what to send and what the bytes mean during the handshake and
//! link setup is decided by the sans-IO [`Connection`]; which link to build is decided by
//! [`setup`](crate::setup). Layering: imports [`link`](crate::link), [`codec`] and
//! [`protocol`](crate::protocol) only; used by `setup`, `mesh` and `frontend`.

use crate::codec::{self, Body, CodecConfig, FrameHeader, HEADER_LEN};
use crate::link::{BufPool, FrameSink, Link, SinkFuture, Storage};
use crate::protocol::{Connection, Event, PeerInfo, ProtocolError};
use expertmesh_quant::aligned::AlignedVec;
use std::io::IoSlice;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
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

/// Runs the handshake over `stream` until established or until the protocol asks for link
/// setup ([`Event::LinkSetup`]; then [`drive_link_setup`] follows), flushing a refusal to the
/// peer on failure. `first` is a frame already read (the acceptor peeks the dialer's hello).
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

/// Dials `addr` with `TCP_NODELAY` set.
pub(crate) async fn connect(addr: std::net::SocketAddr) -> Result<TcpStream, ProtocolError> {
    let stream = TcpStream::connect(addr)
        .await
        .map_err(|e| ProtocolError::Closed(format!("connect to {addr}: {e}")))?;
    let _ = stream.set_nodelay(true);
    Ok(stream)
}

/// The sending half of a TCP link.
pub(crate) struct TcpSink(pub(crate) OwnedWriteHalf);

impl FrameSink for TcpSink {
    fn write_frame<'a>(
        &'a mut self,
        head: &'a [u8],
        payload: &'a [u8],
    ) -> SinkFuture<'a, Result<(), String>> {
        Box::pin(async move {
            write_vectored_all(&mut self.0, head, payload)
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

/// Starts the reader task of a TCP link.
pub(crate) fn spawn_reader(link: &Arc<Link>, read: OwnedReadHalf, codec: CodecConfig) {
    let reader = tokio::spawn(tcp_reader(Arc::clone(link), read, codec));
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
    link.fail(ProtocolError::Closed(why));
}

/// Reads frames from the socket into `link` until it fails.
async fn tcp_reader(link: Arc<Link>, read: OwnedReadHalf, codec: CodecConfig) {
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
