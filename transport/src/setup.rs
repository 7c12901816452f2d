//! Link setup: turns an accepted or dialled TCP connection into an established link of the
//! right kind (TCP, shared memory or RDMA), ready for the mesh to install.
//!
//! Why this exists: a shared-memory or RDMA link is prepared before the hello (its description
//! travels as the hello's attachment), finished from the peer's attachment after
//! authentication, and confirmed (shared memory: one sync byte each way) before it carries
//! frames. The protocol core decides every step ([`Connection`]: the hello, authentication,
//! the link kind both ends agree on, the sync byte and its deadline); this module calls the
//! driver that owns each link kind for the local work ([`shm`](crate::shm) creates and maps
//! rings, `rdma` creates and connects queue pairs) and lets [`tcp`] move the bytes.
//! A local set-up failure on the accepting side degrades to TCP with a warning; on the dialling
//! side it is an error starting with "link setup", after which the mesh redials over TCP.
//!
//! Layering: imports the drivers ([`tcp`], [`shm`](crate::shm), `rdma`),
//! [`link`](crate::link), [`protocol`](crate::protocol) and [`codec`]; only
//! [`mesh`](crate::mesh) imports it.

use crate::codec;
use crate::link::{FrameWriter, Link, LinkKind, NewLink, Rank, nonce};
use crate::protocol::{Connection, ProtocolConfig, ProtocolError, requested_link};
use crate::shm::{RingConsumer, RingProducer, ShmConfig};
use crate::tcp::{self, ReadError, TcpSink};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Instant;
use tokio::net::TcpStream;

/// What link setup needs to know about this rank.
pub(crate) struct SetupEnv {
    /// Protocol settings of this rank.
    pub(crate) proto: Arc<ProtocolConfig>,
    /// Shared-memory settings (ring size also sizes RDMA rings).
    pub(crate) shm: ShmConfig,
    /// RDMA device name (`None`: the first device).
    pub(crate) rdma_device: Option<String>,
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
    /// The socket's read half.
    Tcp(tokio::net::tcp::OwnedReadHalf),
    /// This end's ring, and the TCP connection whose closing means the peer is gone.
    Shm(RingConsumer, TcpStream),
    /// The queue pair's completions, and the TCP connection as for shared memory.
    #[cfg(feature = "rdma")]
    Rdma(crate::rdma::RdmaReader, TcpStream),
}

impl Reader {
    /// Starts reading frames into `link` (and, for shared memory and RDMA, watching the TCP
    /// connection for the peer's exit).
    pub(crate) fn start(self, link: &Arc<Link>, codec: codec::CodecConfig) {
        match self {
            Self::Tcp(read) => tcp::spawn_reader(link, read, codec),
            Self::Shm(ring, control) => {
                crate::shm::spawn_consumer(Arc::clone(link), ring, codec);
                tcp::spawn_control_watch(link, control);
            }
            #[cfg(feature = "rdma")]
            Self::Rdma(reader, control) => {
                crate::rdma::spawn_poller(Arc::clone(link), reader, codec);
                tcp::spawn_control_watch(link, control);
            }
        }
    }
}

/// This end's side of a link, prepared before the hello.
enum Prepared {
    None,
    Shm(RingConsumer),
    #[cfg(feature = "rdma")]
    Rdma(crate::rdma::RdmaPrepared),
}

impl Prepared {
    /// The hello attachment describing this side (empty for TCP).
    fn attachment(&self) -> Vec<u8> {
        match self {
            Self::None => Vec::new(),
            Self::Shm(ring) => ring.attachment(),
            #[cfg(feature = "rdma")]
            Self::Rdma(p) => p.attachment(),
        }
    }
}

/// Accepts a connection: peeks the dialer's hello (its attachment decides the link kind), then
/// sets up that link.
pub(crate) async fn accept(
    env: &SetupEnv,
    mut stream: TcpStream,
) -> Result<Established, ProtocolError> {
    let _ = stream.set_nodelay(true);
    let codec = env.proto.codec;
    let deadline = env.proto.handshake_timeout;
    let pool = crate::link::BufPool::new(0);
    let first = tokio::time::timeout(deadline, tcp::read_frame(&mut stream, &codec, &pool))
        .await
        .map_err(|_| ProtocolError::HandshakeTimeout(deadline))?
        .map_err(ReadError::into_protocol)?;
    let (body, _) = codec::decode_with_header(&first.0, &first.1[..first.0.frame_len as usize])?;
    let (kind, peer_rank) = requested_link(&body);
    establish(env, stream, None, kind, Some(first), peer_rank).await
}

/// Dials `peer` at `addr` and sets up a link of `kind`.
pub(crate) async fn dial(
    env: &SetupEnv,
    addr: SocketAddr,
    peer: Rank,
    kind: LinkKind,
) -> Result<Established, ProtocolError> {
    let stream = tcp::connect(addr).await?;
    establish(env, stream, Some(peer), kind, None, peer).await
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
    peer_hint: Rank,
) -> Result<Established, ProtocolError> {
    let codec = env.proto.codec;
    let (prepared, cfg) = prepare(env, kind, expected.is_some(), peer_hint)?;
    let recv_window = cfg.recv_window_bytes;
    let attachment = prepared.attachment();
    let mut conn = Connection::new(cfg, expected, nonce(), attachment, Instant::now());
    let deadline = env.proto.handshake_timeout;
    let peer = tcp::handshake(&mut stream, &mut conn, &codec, first, deadline).await?;
    let pending = conn.pending_link();
    let (kind, writer, reader) = match prepared {
        Prepared::Shm(ring) if pending == Some(LinkKind::Shm) => {
            let writer = finish_shm(env, &mut stream, &mut conn, &ring).await?;
            (LinkKind::Shm, writer, Reader::Shm(ring, stream))
        }
        #[cfg(feature = "rdma")]
        Prepared::Rdma(p) if pending == Some(LinkKind::Rdma) => {
            let (writer, reader) = finish_rdma(&mut stream, &mut conn, p).await?;
            (LinkKind::Rdma, writer, Reader::Rdma(reader, stream))
        }
        _ => {
            // Plain TCP (requested, or one side could not set up shm/RDMA): the protocol
            // established the connection right after authentication.
            if kind != LinkKind::Tcp {
                tracing::warn!(
                    peer = peer.rank,
                    "{} not available on both sides; using TCP",
                    kind.name()
                );
            }
            let (read, write) = stream.into_split();
            (
                LinkKind::Tcp,
                FrameWriter::new(TcpSink(write)),
                Reader::Tcp(read),
            )
        }
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

/// Prepares this end's side of a `kind` link before the hello, and the protocol settings to
/// announce (a ring caps the receive window). A failure degrades to TCP when accepting and is
/// a "link setup" error when dialling (the dialer then retries over TCP).
fn prepare(
    env: &SetupEnv,
    kind: LinkKind,
    dialing: bool,
    peer_hint: Rank,
) -> Result<(Prepared, Arc<ProtocolConfig>), ProtocolError> {
    let fail_or_tcp = |what: &str, e: String| {
        if dialing {
            return Err(ProtocolError::Closed(format!("link setup: {e}")));
        }
        tracing::warn!(
            peer = peer_hint,
            "{what} unavailable ({e}); answering with TCP"
        );
        Ok((Prepared::None, Arc::clone(&env.proto)))
    };
    match kind {
        LinkKind::Tcp => Ok((Prepared::None, Arc::clone(&env.proto))),
        LinkKind::Shm => {
            let me = env.proto.local_rank;
            match RingConsumer::create(&env.shm, &env.proto.cluster, peer_hint, me) {
                Ok(ring) => {
                    let mut c = (*env.proto).clone();
                    c.recv_window_bytes = c.recv_window_bytes.min(ring.usable_window(&c.codec));
                    Ok((Prepared::Shm(ring), Arc::new(c)))
                }
                Err(e) => fail_or_tcp("shared memory", e.to_string()),
            }
        }
        #[cfg(feature = "rdma")]
        LinkKind::Rdma => {
            let ring_bytes = env.shm.ring_bytes;
            match crate::rdma::RdmaPrepared::new(
                env.rdma_device.as_deref(),
                env.local_ip,
                ring_bytes,
            ) {
                Ok(p) => Ok((Prepared::Rdma(p), Arc::clone(&env.proto))),
                Err(e) => fail_or_tcp("RDMA", e.to_string()),
            }
        }
        #[cfg(not(feature = "rdma"))]
        LinkKind::Rdma => {
            let _ = (&env.rdma_device, env.local_ip);
            if dialing {
                return Err(ProtocolError::Closed(
                    "link setup: this build lacks feature `rdma`".into(),
                ));
            }
            Ok((Prepared::None, Arc::clone(&env.proto)))
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
    let attachment = conn
        .peer()
        .map(|p| p.attachment.clone())
        .unwrap_or_default();
    let producer = match RingProducer::open_attachment(&attachment, &env.shm) {
        Ok(p) => p,
        Err(e) => return Err(conn.link_setup_failed(e)),
    };
    conn.link_ready(Instant::now());
    tcp::drive_link_setup(stream, conn).await?;
    ring.unlink();
    Ok(FrameWriter::new(producer))
}

/// Connects the queue pair to the peer's (no sync byte: the protocol establishes at once).
#[cfg(feature = "rdma")]
async fn finish_rdma(
    stream: &mut TcpStream,
    conn: &mut Connection,
    prepared: crate::rdma::RdmaPrepared,
) -> Result<(FrameWriter, crate::rdma::RdmaReader), ProtocolError> {
    let attachment = conn
        .peer()
        .map(|p| p.attachment.clone())
        .unwrap_or_default();
    let info = attachment
        .strip_prefix(crate::protocol::RDMA_ATTACHMENT)
        .unwrap_or_default();
    let (writer, reader) = match prepared.connect(info) {
        Ok(wr) => wr,
        Err(e) => return Err(conn.link_setup_failed(e)),
    };
    conn.link_ready(Instant::now());
    tcp::drive_link_setup(stream, conn).await?;
    Ok((FrameWriter::new(writer), reader))
}
