//! Link setup: turns an accepted or dialled TCP connection into an established link of the
//! right kind (TCP, shared memory or RDMA), ready for the mesh to install.
//!
//! Why this exists: a shared-memory or RDMA link is asked for in the hello, created only after
//! authentication (so an unauthenticated peer cannot make this process create a 32 MiB ring
//! file or a queue pair), described to the peer in a sealed link-info frame, finished from
//! the peer's description, and confirmed (shared memory: one sync byte each way) before it
//! carries frames. The protocol core decides every step ([`Connection`]: the hello,
//! authentication, the link kind both ends agree on, the link infos, the sync byte and its
//! deadline); this module calls the driver that owns each link kind for the local work
//! ([`shm`](crate::shm) creates and maps rings, `rdma` creates and connects queue pairs) and
//! lets [`tcp`] move the bytes. A side that cannot create its part of the link says so in its
//! link info and both ends carry frames over TCP (with a warning); a failure after the infos
//! are exchanged is an error starting with "link setup", after which the mesh redials over
//! TCP.
//!
//! Layering: imports the drivers ([`tcp`], [`shm`](crate::shm), `rdma`),
//! [`link`](crate::link), [`protocol`](crate::protocol) and [`codec`]; only
//! [`mesh`](crate::mesh) imports it.

use crate::codec;
use crate::crypto::Opener;
use crate::link::{FrameWriter, Link, LinkKind, NewLink, Rank, random_nonce};
use crate::protocol::{Connection, ProtocolConfig, ProtocolError, describe_claim, requested_link};
use crate::shm::{RingConsumer, RingProducer, ShmConfig};
use crate::tcp::{self, Crypt, TcpSink};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Instant;
use tokio::net::TcpStream;

/// What link setup needs to know about this rank.
#[derive(Clone)]
pub(crate) struct SetupEnv {
    /// Protocol settings of this rank.
    pub(crate) proto: Arc<ProtocolConfig>,
    /// Shared-memory settings (ring size also sizes RDMA rings).
    pub(crate) shm: ShmConfig,
    /// RDMA device name (`None`: the first device).
    pub(crate) rdma_device: Option<String>,
    /// Which NIC implementation carries RDMA links.
    pub(crate) rdma_provider: crate::rdma::RdmaProvider,
    /// This rank's listen address, whose GID an RDMA link uses.
    pub(crate) local_ip: IpAddr,
}

/// A handshaken link of some kind, not yet installed.
pub(crate) struct Established {
    /// What the mesh installs.
    pub(crate) new: NewLink,
    /// How frames of the link are read once it is installed.
    pub(crate) reader: Reader,
}

/// The receiving half of an established link, started once the link is installed.
pub(crate) enum Reader {
    /// The socket's read half (and its opener when the link is sealed).
    Tcp(tokio::net::tcp::OwnedReadHalf, Option<Box<Opener>>),
    /// This end's ring, and the TCP connection whose closing means the peer is gone.
    Shm(RingConsumer, TcpStream),
    /// The queue pair's completions, and the TCP connection as for shared memory.
    Rdma(crate::rdma::RdmaReader, TcpStream),
}

impl Reader {
    /// Starts reading frames into `link` (and, for shared memory and RDMA, watching the TCP
    /// connection for the peer's exit).
    pub(crate) fn start(self, link: &Arc<Link>, codec: codec::CodecConfig) {
        match self {
            Self::Tcp(read, open) => tcp::spawn_reader(link, read, open.map(|o| *o), codec),
            Self::Shm(ring, control) => {
                crate::shm::spawn_consumer(Arc::clone(link), ring, codec);
                tcp::spawn_control_watch(link, control);
            }
            Self::Rdma(reader, control) => {
                crate::rdma::spawn_poller(Arc::clone(link), reader, codec);
                tcp::spawn_control_watch(link, control);
            }
        }
    }
}

/// This end's side of a link, created after authentication.
enum Prepared {
    None,
    Shm(RingConsumer),
    Rdma(crate::rdma::RdmaPrepared),
}

impl Prepared {
    /// The link info describing this side (empty: none).
    fn attachment(&self) -> Vec<u8> {
        match self {
            Self::None => Vec::new(),
            Self::Shm(ring) => ring.attachment(),
            Self::Rdma(p) => p.attachment(),
        }
    }
}

/// A refused incoming handshake: why, and who the peer's hello claimed to be.
#[derive(Debug)]
pub(crate) struct Refused {
    /// Who the peer claimed to be ("rank 3", "frontend \"fe\""), when its hello arrived.
    pub(crate) claimed: Option<String>,
    /// Why it was refused.
    pub(crate) error: ProtocolError,
}

/// Accepts a connection: peeks the dialer's hello (at most the pre-authentication frame
/// size) for the link it asks for, then authenticates and sets up that link.
pub(crate) async fn accept(env: &SetupEnv, mut stream: TcpStream) -> Result<Established, Refused> {
    let _ = stream.set_nodelay(true);
    let codec = env.proto.codec;
    let deadline = env.proto.handshake_timeout;
    let pool = crate::link::BufPool::new(0);
    let refused = |claimed, error| Refused { claimed, error };
    let first = tokio::time::timeout(
        deadline,
        tcp::read_frame(&mut stream, &tcp::pre_auth_codec(&codec), &pool),
    )
    .await
    .map_err(|_| refused(None, ProtocolError::HandshakeTimeout(deadline)))?
    .map_err(|e| refused(None, e.into_protocol()))?;
    let (body, _) = codec::decode_with_header(&first.0, &first.1[..first.0.frame_len as usize])
        .map_err(|e| refused(None, e.into()))?;
    let claimed = match &body {
        codec::Body::Hello(h) => Some(describe_claim(h)),
        _ => None,
    };
    let (kind, _) = requested_link(&body);
    establish(env, stream, None, kind, Some(first))
        .await
        .map_err(|error| refused(claimed, error))
}

/// Dials `peer` at `addr` and sets up a link of `kind`.
pub(crate) async fn dial(
    env: &SetupEnv,
    addr: SocketAddr,
    peer: Rank,
    kind: LinkKind,
) -> Result<Established, ProtocolError> {
    let stream = tcp::connect(addr).await?;
    establish(env, stream, Some(peer), kind, None).await
}

/// The protocol settings to announce when asking for `kind`: a shared-memory or RDMA ring caps
/// the receive window (the ring itself is created after authentication; RDMA rings have the
/// shared-memory ring's size and record format).
fn announce(env: &SetupEnv, kind: LinkKind) -> Arc<ProtocolConfig> {
    if kind == LinkKind::Tcp {
        return Arc::clone(&env.proto);
    }
    let mut c = (*env.proto).clone();
    let ring_window = crate::shm::usable_window(&env.shm, &c.codec);
    c.recv_window_bytes = c.recv_window_bytes.min(ring_window);
    Arc::new(c)
}

/// Handshakes over `stream` and finishes a link of `kind` (TCP, or shm/RDMA set up over it).
async fn establish(
    env: &SetupEnv,
    mut stream: TcpStream,
    expected: Option<Rank>,
    kind: LinkKind,
    first: Option<(
        codec::FrameHeader,
        expertmesh_quant::aligned::AlignedVec<u8>,
    )>,
) -> Result<Established, ProtocolError> {
    let codec = env.proto.codec;
    let cfg = announce(env, kind);
    let recv_window = cfg.recv_window_bytes;
    let request = kind.attachment_prefix().to_vec();
    let hello = random_nonce().map_err(ProtocolError::Closed)?;
    let mut conn = Connection::new(cfg, expected, hello, request, Instant::now());
    let deadline = env.proto.handshake_timeout;
    let mut crypt = Crypt::default();
    let peer = tcp::handshake(&mut stream, &mut conn, &codec, first, deadline, &mut crypt).await?;
    let (kind, writer, reader) = match conn.pending_link() {
        Some(kind) => {
            let prepared = prepare(env, kind, peer.rank).await;
            conn.link_prepared(prepared.attachment());
            tcp::exchange_link_info(&mut stream, &mut conn, &codec, &mut crypt, deadline).await?;
            finish(env, stream, &mut conn, prepared, crypt).await?
        }
        None => tcp_link(stream, crypt),
    };
    let new = NewLink {
        peer,
        kind,
        proto: conn,
        writer,
        recv_window,
    };
    Ok(Established { new, reader })
}

/// The halves of a TCP link.
fn tcp_link(stream: TcpStream, crypt: Crypt) -> (LinkKind, FrameWriter, Reader) {
    let (read, write) = stream.into_split();
    (
        LinkKind::Tcp,
        FrameWriter::new(TcpSink(write, crypt.seal)),
        Reader::Tcp(read, crypt.open.map(Box::new)),
    )
}

/// After the link infos: a TCP link when either side fell back, else this end's side of the
/// shared-memory or RDMA link finished from the peer's link info.
async fn finish(
    env: &SetupEnv,
    mut stream: TcpStream,
    conn: &mut Connection,
    prepared: Prepared,
    crypt: Crypt,
) -> Result<(LinkKind, FrameWriter, Reader), ProtocolError> {
    if conn.is_established() {
        if !matches!(prepared, Prepared::None) || conn.peer_link_info().is_none() {
            tracing::warn!(
                peer = conn.peer().map_or(0, |p| p.rank),
                "shared memory or RDMA not available on both sides; using TCP"
            );
        }
        return Ok(tcp_link(stream, crypt));
    }
    match prepared {
        Prepared::Shm(ring) => {
            let writer = finish_shm(env, &mut stream, conn, &ring).await?;
            Ok((LinkKind::Shm, writer, Reader::Shm(ring, stream)))
        }
        Prepared::Rdma(p) => {
            let idle_timeout = env.proto.idle_timeout;
            let (writer, reader) = finish_rdma(&mut stream, conn, p, idle_timeout).await?;
            Ok((
                LinkKind::Rdma,
                FrameWriter::new(writer),
                Reader::Rdma(reader, stream),
            ))
        }
        Prepared::None => Err(conn.link_setup_failed("no local side of the link")),
    }
}

/// Creates this end's side of a `kind` link after authentication (`Prepared::None`, with a
/// warning, when it cannot: the link info then says so and both ends use TCP).
///
/// A ring file or a NIC endpoint takes system calls of milliseconds (a libfabric endpoint
/// with its registered ring, tens of them): they run on a blocking thread, so the runtime's
/// threads go on carrying every other link's frames and timers meanwhile (many links set up
/// at once on a small host once starved those long enough for a peer to give up).
async fn prepare(env: &SetupEnv, kind: LinkKind, peer: Rank) -> Prepared {
    if kind == LinkKind::Tcp {
        return Prepared::None;
    }
    let env = env.clone();
    match tokio::task::spawn_blocking(move || prepare_blocking(&env, kind, peer)).await {
        Ok(p) => p,
        Err(e) => {
            tracing::warn!(
                peer,
                "preparing the {} link failed ({e}); falling back to TCP",
                kind.name()
            );
            Prepared::None
        }
    }
}

/// [`prepare`]'s work, on the calling thread.
fn prepare_blocking(env: &SetupEnv, kind: LinkKind, peer: Rank) -> Prepared {
    let unavailable = |what: &str, e: String| {
        tracing::warn!(peer, "{what} unavailable ({e}); falling back to TCP");
        Prepared::None
    };
    match kind {
        LinkKind::Tcp => Prepared::None,
        LinkKind::Shm => {
            let me = env.proto.local_rank;
            match RingConsumer::create(&env.shm, &env.proto.cluster, peer, me) {
                Ok(ring) => Prepared::Shm(ring),
                Err(e) => unavailable("shared memory", e.to_string()),
            }
        }
        LinkKind::Rdma => {
            match crate::rdma::RdmaPrepared::new(
                &env.rdma_provider,
                env.rdma_device.as_deref(),
                env.local_ip,
                env.shm.ring_bytes,
            ) {
                Ok(p) => Prepared::Rdma(p),
                Err(e) => unavailable("RDMA", e.to_string()),
            }
        }
    }
}

/// Maps the peer's ring, exchanges the sync byte (driven by the protocol), then unlinks this
/// end's ring file so no segment outlives the processes.
async fn finish_shm(
    env: &SetupEnv,
    stream: &mut TcpStream,
    conn: &mut Connection,
    ring: &RingConsumer,
) -> Result<FrameWriter, ProtocolError> {
    let info = conn.peer_link_info().unwrap_or_default().to_vec();
    let producer = match RingProducer::open_attachment(&info, &env.shm) {
        Ok(p) => p,
        Err(e) => return Err(conn.link_setup_failed(e)),
    };
    conn.link_ready(Instant::now());
    tcp::drive_link_setup(stream, conn).await?;
    ring.unlink();
    Ok(FrameWriter::new(producer))
}

/// Connects the queue pair to the peer's (no sync byte: the protocol establishes at once).
async fn finish_rdma(
    stream: &mut TcpStream,
    conn: &mut Connection,
    prepared: crate::rdma::RdmaPrepared,
    idle_timeout: std::time::Duration,
) -> Result<(crate::rdma::RdmaWriter, crate::rdma::RdmaReader), ProtocolError> {
    let info = conn.peer_link_info().unwrap_or_default().to_vec();
    let info = info
        .strip_prefix(crate::protocol::RDMA_ATTACHMENT)
        .unwrap_or_default();
    let (writer, reader) = match prepared.connect(info, idle_timeout) {
        Ok(wr) => wr,
        Err(e) => return Err(conn.link_setup_failed(e)),
    };
    conn.link_ready(Instant::now());
    tcp::drive_link_setup(stream, conn).await?;
    Ok((writer, reader))
}
