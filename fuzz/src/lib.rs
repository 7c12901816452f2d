//! Shared harness of the handshake and reader fuzz targets, and of the seed generator.
//!
//! Why this exists: the handshake authenticates over a transcript of both hellos and their
//! nonces, so a seed can only get past authentication if the fuzzed end's nonce, keys and
//! hello are fixed. This module fixes them (a known master key, fixed nonces, incarnation 0)
//! and drives a sans-IO [`Connection`] over a byte stream exactly as the TCP driver does:
//! plaintext frames, capped at [`PRE_AUTH_MAX_FRAME_BYTES`], until the peer's [`Auth`]; sealed
//! records (opened with the session's receive key) after it; on link setup this end's
//! [`LinkInfo`](expertmesh_transport::codec::LinkInfo) and, for shared memory, one raw sync
//! byte. The seed generator runs an honest peer against the same fixed end and records what
//! the peer sends, so the seeds are authenticated transcripts that replay exactly.

use expertmesh_transport::codec::{
    self, Auth, Body, CLIENT_RANK, CodecConfig, HEADER_LEN, PRE_AUTH_MAX_FRAME_BYTES,
};
use expertmesh_transport::crypto::{self, Credentials, Key, Opener, Sealer};
use expertmesh_transport::protocol::{
    Connection, Event, LinkKind, ProtocolConfig, SHM_ATTACHMENT, requested_link,
};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Cluster name of every harness connection.
pub const CLUSTER: &str = "fuzz";
/// Nonce of the fuzzed end (fixed, so authenticated seeds replay).
pub const FUZZED_NONCE: [u8; 32] = [1; 32];
/// Nonce of the honest peer that recorded the seeds.
pub const PEER_NONCE: [u8; 32] = [2; 32];
/// Name of the frontend in the frontend seeds.
pub const FRONTEND_NAME: &str = "fe-fuzz";
/// Mesh world: rank 0 (router) and two workers.
pub const WORLD: u32 = 3;
/// Largest frame after authentication.
pub const MAX_FRAME: usize = 1 << 16;

/// The cluster's master key (fixed: the fuzzer must be able to replay authenticated seeds).
pub fn master() -> Key {
    Key::from_bytes([7; 32])
}

fn codec() -> CodecConfig {
    CodecConfig {
        max_frame_bytes: MAX_FRAME,
        payload_checksum: false,
    }
}

fn base(rank: u32, world: u32, creds: Credentials) -> ProtocolConfig {
    let mut p = ProtocolConfig::new(CLUSTER, rank, world);
    p.credentials = Some(Arc::new(creds));
    p.codec = codec();
    p.recv_window_bytes = 2 * MAX_FRAME as u64;
    p.handshake_timeout = Duration::from_secs(5);
    p
}

/// The router's side of a frontend connection (rank 0 of a 1-router cluster, accepting
/// clients), as the router service runs it.
pub fn frontend_server_config() -> ProtocolConfig {
    let mut p = base(0, 1, Credentials::issue_rank(&master(), CLUSTER, 0, 1, 1));
    p.accept_clients = true;
    p
}

/// Frontend [`FRONTEND_NAME`]'s side.
pub fn frontend_client_config() -> ProtocolConfig {
    base(
        CLIENT_RANK,
        1,
        Credentials::issue_frontend(&master(), CLUSTER, FRONTEND_NAME, 1),
    )
}

/// Mesh rank `rank`'s side (rank 0 is the router).
pub fn mesh_config(rank: u32) -> ProtocolConfig {
    base(
        rank,
        WORLD,
        Credentials::issue_rank(&master(), CLUSTER, rank, WORLD, 1),
    )
}

/// The fuzzed end closed the connection (a refusal, a bad frame, a record that did not open):
/// the driver would close the socket here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Closed;

/// What the fuzzed end saw of one input.
#[derive(Debug, Default, Clone, Copy)]
pub struct Outcome {
    /// The handshake completed.
    pub established: bool,
    /// Application frames delivered after it.
    pub delivered: usize,
}

/// The fuzzed end: a [`Connection`] fed a byte stream as the TCP driver feeds it.
pub struct Fuzzed {
    conn: Connection,
    buf: Vec<u8>,
    opener: Option<Opener>,
    /// The receive key and the records opened with it (a record cut short is opened again
    /// from a fresh opener advanced past them, as a driver would wait for the rest).
    recv: Option<(Key, u64)>,
    /// What this end sends, sealed after its own auth answer (what the peer reads).
    pub sent: Vec<u8>,
    sealer: Option<Sealer>,
    now: Instant,
    /// The attachment this end reports at link setup (`None`: plain TCP).
    link_attachment: Option<Vec<u8>>,
    outcome: Outcome,
}

impl Fuzzed {
    /// An end accepting (`expected` = `None`) or dialling with configuration `cfg`, asking
    /// for a shared-memory link when `shm`.
    pub fn new(cfg: ProtocolConfig, expected: Option<u32>, nonce: [u8; 32], shm: bool) -> Self {
        let now = Instant::now();
        let attachment = if shm {
            SHM_ATTACHMENT.to_vec()
        } else {
            Vec::new()
        };
        let conn = Connection::new(Arc::new(cfg), expected, nonce, attachment, now);
        let mut f = Self {
            conn,
            buf: Vec::new(),
            opener: None,
            recv: None,
            sent: Vec::new(),
            sealer: None,
            now,
            link_attachment: shm.then(|| b"shm:/dev/shm/expertmesh-fuzz-ring".to_vec()),
            outcome: Outcome::default(),
        };
        f.flush();
        f
    }

    /// The connection.
    pub fn conn(&self) -> &Connection {
        &self.conn
    }

    /// What happened so far.
    pub fn outcome(&self) -> Outcome {
        self.outcome
    }

    /// Encodes what the connection wants to send into [`Fuzzed::sent`], and reacts to its
    /// events (link setup: report this end's side; established: count it).
    fn flush(&mut self) {
        loop {
            while let Some(b) = self.conn.poll_transmit() {
                let mut head = Vec::new();
                if codec::encode_head(&b, &[], &codec(), &mut head).is_err() {
                    continue;
                }
                match self.sealer.as_mut() {
                    Some(s) => {
                        let mut out = Vec::new();
                        if s.seal_frame(&head, &[], &mut out).is_ok() {
                            self.sent.extend_from_slice(&out);
                        }
                    }
                    None => self.sent.extend_from_slice(&head),
                }
                if Connection::seals_after(&b) {
                    self.sealer = self.conn.session_keys().map(|k| Sealer::new(&k.send));
                }
            }
            if let Some(b) = self.conn.poll_transmit_raw() {
                self.sent.push(b);
            }
            let Some(ev) = self.conn.poll_event() else {
                break;
            };
            match ev {
                Event::LinkSetup { .. } => {
                    let a = self.link_attachment.clone().unwrap_or_default();
                    self.conn.link_prepared(a);
                }
                Event::Established(_) => self.outcome.established = true,
                Event::Closed(_) => {}
            }
        }
        if self.conn.peer_link_info().is_some() && self.conn.pending_link().is_some() {
            self.conn.link_ready(self.now);
            self.flush();
        }
    }

    /// Feeds `bytes` as they arrive on the socket; `Err` once the connection is closed (the
    /// driver would close the socket).
    pub fn push(&mut self, bytes: &[u8]) -> Result<(), Closed> {
        self.buf.extend_from_slice(bytes);
        loop {
            if self.conn.close_reason().is_some() {
                return Err(Closed);
            }
            if self.conn.awaits_raw() && !self.conn.awaits_link_info() {
                let Some(&b) = self.buf.first() else {
                    return Ok(());
                };
                self.buf.remove(0);
                if self.conn.handle_raw(&[b]).is_err() {
                    return Err(Closed);
                }
                self.flush();
                continue;
            }
            let Some((body, frame_len)) = self.next_frame()? else {
                return Ok(());
            };
            self.now += Duration::from_millis(3);
            let seals = Connection::seals_after(&body);
            match self.conn.handle_frame(self.now, &body, frame_len as u64) {
                Ok(_) => {}
                Err(_) => {
                    self.flush();
                    return Err(Closed);
                }
            }
            if body.kind().is_application() {
                self.outcome.delivered += 1;
                if self.conn.recv_outstanding() > 0 {
                    self.conn.release(frame_len as u64);
                }
            }
            if seals {
                self.recv = self.conn.session_keys().map(|k| (k.recv.clone(), 0));
                self.opener = self.recv.as_ref().map(|(k, _)| Opener::new(k));
            }
            self.flush();
        }
    }

    /// The next whole frame in the buffer: plaintext (capped small) before the peer's auth
    /// answer, a sealed record after it.
    fn next_frame(&mut self) -> Result<Option<(Body, usize)>, Closed> {
        match self.opener.as_mut() {
            None => {
                if self.buf.len() < HEADER_LEN {
                    return Ok(None);
                }
                let pre = CodecConfig {
                    max_frame_bytes: PRE_AUTH_MAX_FRAME_BYTES,
                    payload_checksum: false,
                };
                let h = codec::decode_header(&self.buf, &pre).map_err(|_| Closed)?;
                let len = h.frame_len as usize;
                if self.buf.len() < len {
                    return Ok(None);
                }
                let (body, _) =
                    codec::decode_with_header(&h, &self.buf[..len]).map_err(|_| Closed)?;
                self.buf.drain(..len);
                Ok(Some((body, len)))
            }
            Some(opener) => match crypto::open_frame(opener, &self.buf, &codec()) {
                Ok((plain, used)) => {
                    self.buf.drain(..used);
                    let (body, range) =
                        codec::decode_frame(&plain, &codec()).map_err(|_| Closed)?;
                    if let Some((_, n)) = self.recv.as_mut() {
                        *n += 1 + u64::from(!range.is_empty());
                    }
                    Ok(Some((body, plain.len())))
                }
                Err(crypto::OpenError::Truncated { .. }) => {
                    // Not all there yet: rewind the opener to the first unopened record.
                    if let Some((k, n)) = &self.recv {
                        let mut o = Opener::new(k);
                        for _ in 0..*n {
                            o.skip().map_err(|_| Closed)?;
                        }
                        *opener = o;
                    }
                    Ok(None)
                }
                Err(_) => Err(Closed),
            },
        }
    }

    /// Advances the clock to `now` (timeouts).
    pub fn tick(&mut self, by: Duration) {
        self.now += by;
        self.conn.handle_timeout(self.now);
        self.flush();
    }
}

/// Runs an honest peer (configuration `peer`, expecting `expected`) against a fuzzed end
/// `fuzzed` until both are established or one closes; returns what the peer sent (the seed
/// prefix), the peer (to seal further frames) and whether it worked.
pub fn honest_exchange(fuzzed: &mut Fuzzed, peer: &mut Fuzzed) -> (Vec<u8>, bool) {
    let mut recorded = Vec::new();
    for _ in 0..16 {
        let to_fuzzed = std::mem::take(&mut peer.sent);
        recorded.extend_from_slice(&to_fuzzed);
        let a = fuzzed.push(&to_fuzzed);
        let to_peer = std::mem::take(&mut fuzzed.sent);
        let b = peer.push(&to_peer);
        if a.is_err() || b.is_err() {
            return (recorded, false);
        }
        if fuzzed.outcome().established && peer.outcome().established && peer.sent.is_empty() {
            return (recorded, true);
        }
    }
    (recorded, false)
}

impl Fuzzed {
    /// Seals one application frame as this (established) end would send it.
    pub fn seal_app(&mut self, body: &Body, payload: &[u8]) -> Vec<u8> {
        let mut head = Vec::new();
        codec::encode_head(body, payload, &codec(), &mut head).expect("valid frame");
        let mut out = Vec::new();
        self.sealer
            .as_mut()
            .expect("established with credentials")
            .seal_frame(&head, payload, &mut out)
            .expect("seal");
        out
    }
}

/// An auth answer without a MAC (for seeds that claim to run without credentials).
pub fn empty_auth() -> Body {
    Body::Auth(Auth {
        mac: None,
        identity: None,
    })
}

/// Runs one `frontend_handshake` input (first byte: chunk size and clock ticks; the rest: what
/// a client sends) against the router's side; returns the fuzzed end.
pub fn run_frontend_input(data: &[u8]) -> Option<Fuzzed> {
    let (&ctl, rest) = data.split_first()?;
    let mut f = Fuzzed::new(frontend_server_config(), None, FUZZED_NONCE, false);
    feed(&mut f, ctl, rest);
    Some(f)
}

/// Runs one `mesh_handshake` input against rank 0's side, which asks for the link the
/// dialer's first hello asks for (as the mesh does); returns the fuzzed end.
pub fn run_mesh_input(data: &[u8]) -> Option<Fuzzed> {
    let (&ctl, rest) = data.split_first()?;
    let pre = CodecConfig {
        max_frame_bytes: PRE_AUTH_MAX_FRAME_BYTES,
        payload_checksum: false,
    };
    let first = codec::decode_header(rest, &pre).ok().and_then(|h| {
        let frame = rest.get(..h.frame_len as usize)?;
        codec::decode_with_header(&h, frame).ok()
    });
    let shm = first.is_some_and(|(b, _)| requested_link(&b).0 == LinkKind::Shm);
    let mut f = Fuzzed::new(mesh_config(0), None, FUZZED_NONCE, shm);
    feed(&mut f, ctl, rest);
    Some(f)
}

/// Feeds `rest` in chunks of `(ctl & 0x3f) + 1` bytes, advancing the clock by 700 ms after
/// each chunk when `ctl & 0x80` (timeouts).
fn feed(f: &mut Fuzzed, ctl: u8, rest: &[u8]) {
    let chunk = (ctl as usize & 0x3f) + 1;
    for piece in rest.chunks(chunk) {
        if f.push(piece).is_err() {
            break;
        }
        if ctl & 0x80 != 0 {
            f.tick(Duration::from_millis(700));
        }
    }
}
