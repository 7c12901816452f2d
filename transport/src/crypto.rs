//! Link security: the cluster's key hierarchy, per-principal credentials, the handshake's
//! transcript MACs and session keys, and the AES-256-GCM record layer that seals every frame
//! on a TCP link after authentication.
//!
//! Why this exists: one shared secret let any holder claim any rank (and a frontend join the
//! mesh), and only the handshake was authenticated. Here every principal holds only its own
//! keys, derived from a cluster master key that never leaves the operator's machine:
//!
//! * mesh ranks `a`, `b` share `k(a,b) = HMAC-SHA256(master, "expertmesh-pair-v1" ‖ cluster ‖
//!   min(a,b) ‖ max(a,b))`: a worker's credential file holds `k(a,·)` for its own rank `a`
//!   only, so it cannot authenticate as another rank;
//! * router `i` holds `fr_i = HMAC(master, "expertmesh-frontend-root-v1" ‖ cluster ‖ i)` and
//!   derives any frontend's key `k(NAME, i) = HMAC(fr_i, "expertmesh-frontend-v1" ‖ NAME)`;
//!   a frontend's file holds `k(NAME, i)` per router. Mesh keys and frontend keys are
//!   domain-separated (different labels, different key chains), so a frontend credential
//!   cannot join the mesh.
//!
//! The handshake ([`crate::protocol`]) answers with `HMAC(k, "expertmesh-auth-v2" ‖ role ‖
//! transcript)`, where the transcript hashes both hellos (cluster, ranks, world size,
//! incarnations, fingerprints, link requests, frontend name, nonces), and derives one
//! AES-256-GCM key per direction with HKDF-SHA256 (salt: the transcript, which holds both
//! nonces). [`Sealer`] and [`Opener`] number their records with a 96-bit counter nonce, so a
//! tampered, replayed, reordered or truncated record fails to open.
//!
//! Sealed frame layout on the wire (all lengths little endian):
//!
//! ```text
//! 4 bytes            head_len: header + metadata + padding of the frame (multiple of 64)
//! head_len + 16      sealed head (AAD: the 4 length bytes), counter n
//! chunk + 16         the payload in chunks of SEAL_CHUNK_BYTES (the last one shorter),
//!                    each sealed on its own, counters n+1, n+2, …
//! ```
//!
//! The payload's length comes from the authenticated head, so a receiver reads the head
//! (bounded by [`MAX_SEALED_HEAD_BYTES`]), opens it, checks the header, and only then reads
//! the payload straight into its pooled aligned buffer and opens it in place chunk by chunk
//! (each tag read aside). Chunking bounds the sender's staging buffer (a shared payload is
//! copied once into it to be encrypted) to about [`SEAL_CHUNK_BYTES`] per connection.
//!
//! Layering: imports [`codec`] only; used by `protocol`, `tcp` and `frontend`.

use crate::codec::{self, CodecConfig, CodecError, FrameHeader, HEADER_LEN, PAYLOAD_ALIGN};
use hmac::{Hmac, KeyInit, Mac};
use ring::aead::{AES_256_GCM, Aad, LessSafeKey, Nonce, UnboundKey};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;

/// Bytes of every key (master, pair, frontend, session).
pub const KEY_BYTES: usize = 32;
/// Bytes of an AES-GCM tag.
pub const TAG_BYTES: usize = 16;
/// Bytes of the length prefix of a sealed frame.
pub const SEALED_PREFIX_BYTES: usize = 4;
/// Largest head (header + metadata + padding) a sealed frame may announce.
pub const MAX_SEALED_HEAD_BYTES: usize = codec::MAX_HEAD_BYTES;
/// Bytes of payload per sealed record.
pub const SEAL_CHUNK_BYTES: usize = 256 << 10;

/// The lengths of the sealed records a payload of `payload_len` bytes is cut into.
pub fn payload_chunks(payload_len: usize) -> impl Iterator<Item = usize> {
    let full = payload_len / SEAL_CHUNK_BYTES;
    let rest = payload_len % SEAL_CHUNK_BYTES;
    std::iter::repeat_n(SEAL_CHUNK_BYTES, full).chain((rest > 0).then_some(rest))
}

const PAIR_LABEL: &[u8] = b"expertmesh-pair-v1";
const FRONTEND_ROOT_LABEL: &[u8] = b"expertmesh-frontend-root-v1";
const FRONTEND_LABEL: &[u8] = b"expertmesh-frontend-v1";
const LEGACY_LABEL: &[u8] = b"expertmesh-shared-secret-v1";
const AUTH_LABEL: &[u8] = b"expertmesh-auth-v2";
const SESSION_LABEL: &[u8] = b"expertmesh-session-v2";
const IDENTITY_LABEL: &[u8] = b"expertmesh-identity-v1";
const CRED_HEADER: &str = "# expertmesh credential v1";
const MASTER_HEADER: &str = "# expertmesh cluster master key v1";

/// A 32-byte secret key. Its bytes never appear in `Debug` output and are zeroed on drop.
#[derive(Clone, PartialEq, Eq)]
pub struct Key([u8; KEY_BYTES]);

impl Key {
    /// A key from raw bytes.
    pub fn from_bytes(b: [u8; KEY_BYTES]) -> Self {
        Self(b)
    }

    /// A fresh random key (from `/dev/urandom` through ring's system RNG).
    pub fn random() -> Result<Self, KeyError> {
        use ring::rand::SecureRandom;
        let mut b = [0u8; KEY_BYTES];
        ring::rand::SystemRandom::new()
            .fill(&mut b)
            .map_err(|_| KeyError::Random)?;
        Ok(Self(b))
    }

    /// The raw bytes.
    pub fn bytes(&self) -> &[u8; KEY_BYTES] {
        &self.0
    }

    fn hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    fn from_hex(s: &str) -> Option<Self> {
        let s = s.trim();
        if s.len() != 2 * KEY_BYTES {
            return None;
        }
        let mut b = [0u8; KEY_BYTES];
        for (i, out) in b.iter_mut().enumerate() {
            *out = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
        }
        Some(Self(b))
    }
}

impl Drop for Key {
    fn drop(&mut self) {
        // Best effort: volatile writes so the compiler keeps the wipe.
        for b in self.0.iter_mut() {
            // SAFETY: `b` is a valid, aligned, exclusive reference to a byte.
            unsafe { std::ptr::write_volatile(b, 0) };
        }
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Key(<redacted>)")
    }
}

/// Why keys or credentials could not be made, read or used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The system random number generator failed.
    #[error("the system random number generator failed")]
    Random,
    /// A key or credential file could not be read or written.
    #[error("{path}: {error}")]
    Io {
        /// The file.
        path: String,
        /// Cause.
        error: std::io::Error,
    },
    /// A key or credential file is malformed.
    #[error("{path}: line {line}: {what}")]
    Parse {
        /// The file.
        path: String,
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        what: String,
    },
    /// A credential file is readable by other users.
    #[error(
        "{path} is readable by other users (mode {mode:o}); run `chmod 600 {path}` (it holds secret keys)"
    )]
    Permissions {
        /// The file.
        path: String,
        /// Its mode bits.
        mode: u32,
    },
}

fn hmac(key: &[u8], parts: &[&[u8]]) -> [u8; KEY_BYTES] {
    let mut m = Hmac::<Sha256>::new_from_slice(key).expect("HMAC takes any key length");
    for p in parts {
        m.update(p);
    }
    m.finalize().into_bytes().into()
}

/// A length-prefixed string for key derivation inputs (no ambiguity between fields).
fn lp(s: &str) -> Vec<u8> {
    let mut v = (s.len() as u32).to_le_bytes().to_vec();
    v.extend_from_slice(s.as_bytes());
    v
}

/// The key mesh ranks `a` and `b` share.
pub fn pair_key(master: &Key, cluster: &str, a: u32, b: u32) -> Key {
    let (lo, hi) = (a.min(b), a.max(b));
    Key(hmac(
        &master.0,
        &[
            PAIR_LABEL,
            &lp(cluster),
            &lo.to_le_bytes(),
            &hi.to_le_bytes(),
        ],
    ))
}

/// Router `router`'s root for frontend keys.
pub fn frontend_root(master: &Key, cluster: &str, router: u32) -> Key {
    Key(hmac(
        &master.0,
        &[FRONTEND_ROOT_LABEL, &lp(cluster), &router.to_le_bytes()],
    ))
}

/// The key frontend `name` shares with the router whose frontend root is `root`.
pub fn frontend_key(root: &Key, name: &str) -> Key {
    Key(hmac(&root.0, &[FRONTEND_LABEL, &lp(name)]))
}

/// Who a credential belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Identity {
    /// A mesh rank (a router `0..R` or a device `R..`).
    Rank(u32),
    /// A named frontend (serving client).
    Frontend(String),
    /// The legacy shared secret: every holder can act as any rank or frontend.
    SharedSecret,
}

/// One principal's keys, as issued by `expertmesh keys issue` (or derived from the legacy
/// shared secret).
#[derive(Clone)]
pub struct Credentials {
    cluster: String,
    identity: Identity,
    /// Mesh: the key shared with each peer rank.
    pairs: BTreeMap<u32, Key>,
    /// Router: the root from which each frontend's key is derived.
    frontend_root: Option<Key>,
    /// Frontend: the key shared with each router rank.
    routers: BTreeMap<u32, Key>,
    /// Legacy shared secret: derives anything.
    master: Option<Key>,
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Credentials")
            .field("cluster", &self.cluster)
            .field("identity", &self.identity)
            .field("pair_keys", &self.pairs.len())
            .field("frontend_root", &self.frontend_root.is_some())
            .field("router_keys", &self.routers.len())
            .finish()
    }
}

impl Credentials {
    /// A mesh rank's credential: its key with every other rank of `0..world_size`, and for a
    /// router (`rank < routers`) its frontend root.
    pub fn issue_rank(
        master: &Key,
        cluster: &str,
        rank: u32,
        world_size: u32,
        routers: u32,
    ) -> Self {
        let pairs = (0..world_size)
            .filter(|&b| b != rank)
            .map(|b| (b, pair_key(master, cluster, rank, b)))
            .collect();
        Self {
            cluster: cluster.to_owned(),
            identity: Identity::Rank(rank),
            pairs,
            frontend_root: (rank < routers).then(|| frontend_root(master, cluster, rank)),
            routers: BTreeMap::new(),
            master: None,
        }
    }

    /// Frontend `name`'s credential: its key with each router `0..routers`.
    pub fn issue_frontend(master: &Key, cluster: &str, name: &str, routers: u32) -> Self {
        let keys = (0..routers)
            .map(|i| (i, frontend_key(&frontend_root(master, cluster, i), name)))
            .collect();
        Self {
            cluster: cluster.to_owned(),
            identity: Identity::Frontend(name.to_owned()),
            pairs: BTreeMap::new(),
            frontend_root: None,
            routers: keys,
            master: None,
        }
    }

    /// The legacy shared secret (`EXPERTMESH_SECRET`): every holder derives every key, so
    /// any holder can claim any rank or frontend name. Links are still encrypted.
    pub fn shared_secret(secret: &[u8]) -> Self {
        let master = Key(hmac(secret, &[LEGACY_LABEL]));
        Self {
            cluster: String::new(),
            identity: Identity::SharedSecret,
            pairs: BTreeMap::new(),
            frontend_root: None,
            routers: BTreeMap::new(),
            master: Some(master),
        }
    }

    /// Whom this credential belongs to.
    pub fn identity(&self) -> &Identity {
        &self.identity
    }

    /// The cluster it was issued for (empty for the legacy shared secret).
    pub fn cluster(&self) -> &str {
        &self.cluster
    }

    /// The frontend name this credential authenticates (`None` for ranks and shared secret).
    pub fn frontend_name(&self) -> Option<&str> {
        match &self.identity {
            Identity::Frontend(n) => Some(n),
            _ => None,
        }
    }

    /// Checks that this credential may act as `rank` of `cluster` (ranks' and routers'
    /// credentials are bound to their rank; the shared secret may act as any).
    pub fn check_rank(&self, cluster: &str, rank: u32) -> Result<(), String> {
        self.check_cluster(cluster)?;
        match &self.identity {
            Identity::Rank(r) if *r == rank => Ok(()),
            Identity::SharedSecret => Ok(()),
            Identity::Rank(r) => Err(format!(
                "the credential is for mesh rank {r}, not rank {rank}; issue one for this process with `expertmesh keys issue`"
            )),
            Identity::Frontend(n) => Err(format!(
                "the credential is frontend {n:?}'s, which cannot join the mesh; issue one for this device or router"
            )),
        }
    }

    /// Checks that this credential is a frontend's (or the shared secret) of `cluster`.
    pub fn check_frontend(&self, cluster: &str) -> Result<(), String> {
        self.check_cluster(cluster)?;
        match &self.identity {
            Identity::Frontend(_) | Identity::SharedSecret => Ok(()),
            Identity::Rank(r) => Err(format!(
                "the credential is mesh rank {r}'s; a frontend needs its own (`expertmesh keys issue --frontend NAME`)"
            )),
        }
    }

    fn check_cluster(&self, cluster: &str) -> Result<(), String> {
        if self.master.is_none() && self.cluster != cluster {
            return Err(format!(
                "the credential was issued for cluster {:?}, not {cluster:?}",
                self.cluster
            ));
        }
        Ok(())
    }

    /// The key this rank `local` shares with mesh rank `peer` (`None`: it holds none).
    pub fn rank_key(&self, cluster: &str, local: u32, peer: u32) -> Option<Key> {
        if let Some(m) = &self.master {
            return Some(pair_key(m, cluster, local, peer));
        }
        match self.identity {
            Identity::Rank(r) if r == local => self.pairs.get(&peer).cloned(),
            _ => None,
        }
    }

    /// The key router `local` shares with frontend `name` (`None`: not a router's credential).
    pub fn client_key(&self, cluster: &str, local: u32, name: &str) -> Option<Key> {
        if let Some(m) = &self.master {
            return Some(frontend_key(&frontend_root(m, cluster, local), name));
        }
        match self.identity {
            Identity::Rank(r) if r == local => self
                .frontend_root
                .as_ref()
                .map(|root| frontend_key(root, name)),
            _ => None,
        }
    }

    /// The key this frontend shares with router rank `router`.
    pub fn router_key(&self, cluster: &str, router: u32, name: &str) -> Option<Key> {
        if let Some(m) = &self.master {
            return Some(frontend_key(&frontend_root(m, cluster, router), name));
        }
        self.routers.get(&router).cloned()
    }

    /// The credential file's text.
    pub fn to_file_text(&self) -> String {
        let mut s = format!("{CRED_HEADER}\ncluster = {}\n", self.cluster);
        match &self.identity {
            Identity::Rank(r) => s += &format!("rank = {r}\n"),
            Identity::Frontend(n) => s += &format!("frontend = {n}\n"),
            Identity::SharedSecret => {}
        }
        for (b, k) in &self.pairs {
            s += &format!("pair {b} = {}\n", k.hex());
        }
        if let Some(k) = &self.frontend_root {
            s += &format!("frontend-root = {}\n", k.hex());
        }
        for (i, k) in &self.routers {
            s += &format!("router {i} = {}\n", k.hex());
        }
        s
    }

    /// Parses a credential file's text (`path` names it in errors).
    pub fn parse(text: &str, path: &str) -> Result<Self, KeyError> {
        let mut c = Self {
            cluster: String::new(),
            identity: Identity::SharedSecret,
            pairs: BTreeMap::new(),
            frontend_root: None,
            routers: BTreeMap::new(),
            master: None,
        };
        let mut identity = None;
        let mut cluster = None;
        for (i, raw) in text.lines().enumerate() {
            let err = |what: String| KeyError::Parse {
                path: path.to_owned(),
                line: i + 1,
                what,
            };
            let line = raw.trim();
            if i == 0 && line != CRED_HEADER {
                return Err(err(format!(
                    "not an expertmesh credential file (first line must be {CRED_HEADER:?}; make one with `expertmesh keys issue`)"
                )));
            }
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let (k, v) = line
                .split_once('=')
                .map(|(k, v)| (k.trim(), v.trim()))
                .ok_or_else(|| err("expected `name = value`".into()))?;
            let key =
                |v: &str| Key::from_hex(v).ok_or_else(|| err("expected 64 hex digits".into()));
            let num = |s: &str| {
                s.parse::<u32>()
                    .map_err(|_| err(format!("bad number {s:?}")))
            };
            match k.split_once(' ') {
                Some(("pair", b)) => {
                    c.pairs.insert(num(b.trim())?, key(v)?);
                }
                Some(("router", r)) => {
                    c.routers.insert(num(r.trim())?, key(v)?);
                }
                _ => match k {
                    "cluster" => cluster = Some(v.to_owned()),
                    "rank" => identity = Some(Identity::Rank(num(v)?)),
                    "frontend" => identity = Some(Identity::Frontend(v.to_owned())),
                    "frontend-root" => c.frontend_root = Some(key(v)?),
                    _ => return Err(err(format!("unknown field {k:?}"))),
                },
            }
        }
        let whole = |what: &str| KeyError::Parse {
            path: path.to_owned(),
            line: 0,
            what: what.to_owned(),
        };
        c.cluster = cluster.ok_or_else(|| whole("no `cluster = ...` line"))?;
        c.identity = identity.ok_or_else(|| whole("no `rank = ...` or `frontend = ...` line"))?;
        Ok(c)
    }

    /// Reads a credential file, refusing one that other users can read.
    pub fn load(path: &Path) -> Result<Self, KeyError> {
        let text = read_secret_file(path)?;
        Self::parse(&text, &path.display().to_string())
    }
}

/// Refuses a file holding secret keys that group or others may read.
pub fn check_private(path: &Path) -> Result<(), KeyError> {
    use std::os::unix::fs::PermissionsExt;
    let shown = path.display().to_string();
    let meta = std::fs::metadata(path).map_err(|error| KeyError::Io {
        path: shown.clone(),
        error,
    })?;
    let mode = meta.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(KeyError::Permissions { path: shown, mode });
    }
    Ok(())
}

/// The legacy shared secret from `EXPERTMESH_SECRET`, or else the file named by
/// `EXPERTMESH_SECRET_FILE` (refused when other users may read it, or when it is empty;
/// trailing white space trimmed). `None` when neither is set.
pub fn legacy_secret_from_env() -> Result<Option<Vec<u8>>, KeyError> {
    if let Ok(s) = std::env::var("EXPERTMESH_SECRET")
        && !s.is_empty()
    {
        return Ok(Some(s.into_bytes()));
    }
    let Ok(p) = std::env::var("EXPERTMESH_SECRET_FILE") else {
        return Ok(None);
    };
    check_private(Path::new(&p))?;
    let bytes = std::fs::read(&p).map_err(|error| KeyError::Io {
        path: format!("EXPERTMESH_SECRET_FILE {p}"),
        error,
    })?;
    let trimmed = bytes.trim_ascii_end();
    if trimmed.is_empty() {
        return Err(KeyError::Parse {
            path: format!("EXPERTMESH_SECRET_FILE {p}"),
            line: 1,
            what: "the file is empty; it must hold the cluster's shared secret".into(),
        });
    }
    Ok(Some(trimmed.to_vec()))
}

/// Reads a file holding secret keys, refusing one readable by group or others.
fn read_secret_file(path: &Path) -> Result<String, KeyError> {
    check_private(path)?;
    std::fs::read_to_string(path).map_err(|error| KeyError::Io {
        path: path.display().to_string(),
        error,
    })
}

/// Writes `text` to a new file of mode 0600, refusing to overwrite an existing one.
pub fn write_secret_file(path: &Path, text: &str) -> Result<(), KeyError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let shown = path.display().to_string();
    let io = |error| KeyError::Io {
        path: shown.clone(),
        error,
    };
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(io)?;
    f.write_all(text.as_bytes()).map_err(io)?;
    f.sync_all().map_err(io)
}

/// The master key file's text.
pub fn master_key_text(master: &Key) -> String {
    format!("{MASTER_HEADER}\n{}\n", master.hex())
}

/// Reads a cluster master key file (refusing one readable by other users).
pub fn load_master_key(path: &Path) -> Result<Key, KeyError> {
    let text = read_secret_file(path)?;
    parse_master_key(&text, &path.display().to_string())
}

/// Parses a cluster master key file's text (`path` names it in errors). Any text gives a key
/// or an error, never a panic (the `credential_files` fuzz target's entry point).
pub fn parse_master_key(text: &str, path: &str) -> Result<Key, KeyError> {
    let shown = path.to_owned();
    let mut lines = text.lines();
    if lines.next().map(str::trim) != Some(MASTER_HEADER) {
        return Err(KeyError::Parse {
            path: shown,
            line: 1,
            what: format!(
                "not a cluster master key (first line must be {MASTER_HEADER:?}; make one with `expertmesh keys init`)"
            ),
        });
    }
    lines
        .next()
        .and_then(Key::from_hex)
        .ok_or_else(|| KeyError::Parse {
            path: shown,
            line: 2,
            what: "expected 64 hex digits".into(),
        })
}

/// Which end of a connection: the one that dialled, or the one that accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Dialled the connection (a worker to a router, a frontend to its router).
    Dialer,
    /// Accepted it.
    Acceptor,
}

impl Role {
    fn label(self) -> &'static [u8] {
        match self {
            Self::Dialer => b"dialer",
            Self::Acceptor => b"acceptor",
        }
    }

    /// The other end's role.
    pub fn peer(self) -> Self {
        match self {
            Self::Dialer => Self::Acceptor,
            Self::Acceptor => Self::Dialer,
        }
    }
}

/// The handshake transcript: SHA-256 over both hellos' encoded metadata, the dialer's first.
pub fn transcript(dialer_hello_meta: &[u8], acceptor_hello_meta: &[u8]) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(b"expertmesh-transcript-v2");
    h.update((dialer_hello_meta.len() as u32).to_le_bytes());
    h.update(dialer_hello_meta);
    h.update((acceptor_hello_meta.len() as u32).to_le_bytes());
    h.update(acceptor_hello_meta);
    h.finalize().into()
}

/// The MAC the end of role `sender` sends over the transcript.
pub fn auth_mac(key: &Key, sender: Role, transcript: &[u8; 32]) -> [u8; 32] {
    hmac(&key.0, &[AUTH_LABEL, sender.label(), transcript])
}

/// Checks a received MAC in constant time.
pub fn verify_auth_mac(key: &Key, sender: Role, transcript: &[u8; 32], mac: &[u8]) -> bool {
    let mut m = Hmac::<Sha256>::new_from_slice(&key.0).expect("HMAC takes any key length");
    m.update(AUTH_LABEL);
    m.update(sender.label());
    m.update(transcript);
    m.verify_slice(mac).is_ok()
}

/// The two directions' keys of one connection, from this end's point of view.
#[derive(Clone, Debug)]
pub struct SessionKeys {
    /// Seals what this end sends.
    pub send: Key,
    /// Opens what this end receives.
    pub recv: Key,
}

/// HKDF-SHA256 (RFC 5869) with one output block per direction.
pub fn session_keys(pair: &Key, transcript: &[u8; 32], me: Role) -> SessionKeys {
    let prk = hmac(transcript, &[&pair.0]);
    let dir = |from: Role| Key(hmac(&prk, &[SESSION_LABEL, from.label(), &[1u8]]));
    SessionKeys {
        send: dir(me),
        recv: dir(me.peer()),
    }
}

/// A sealed record failed to open: tampered, replayed, reordered, truncated or forged.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum IntegrityError {
    /// The record's tag does not verify.
    #[error(
        "integrity check failed on sealed record {counter}: the frame was tampered with, replayed, reordered or truncated (or the peer uses other keys)"
    )]
    BadTag {
        /// The record's number in this direction.
        counter: u64,
    },
    /// The record announces an impossible head length.
    #[error(
        "sealed frame announces a head of {len} bytes (must be a multiple of 64 in 32..={max})"
    )]
    BadHeadLength {
        /// Announced length.
        len: usize,
        /// Largest allowed.
        max: usize,
    },
    /// The opened head is not a valid frame header, or disagrees with the record.
    #[error("sealed frame's header is invalid: {0}")]
    Header(CodecError),
    /// 2^64 records in one direction: the connection must be re-established.
    #[error("nonce counter exhausted; reconnect")]
    Exhausted,
}

fn nonce(counter: u64) -> Nonce {
    let mut n = [0u8; 12];
    n[4..].copy_from_slice(&counter.to_le_bytes());
    Nonce::assume_unique_for_key(n)
}

/// The key that seals `sender`'s identity (incarnation and fingerprint) in its auth answer:
/// derived like the session keys from the pair key and the transcript, with its own label, so
/// it is used for that one record only (nonce 0).
fn identity_key(pair: &Key, transcript: &[u8; 32], sender: Role) -> LessSafeKey {
    let prk = hmac(transcript, &[&pair.0]);
    aead_key(&Key(hmac(&prk, &[IDENTITY_LABEL, sender.label()])))
}

/// Seals what a hello no longer carries in the clear when credentials are configured: the
/// sender's process incarnation and the fingerprint of what its rank serves (issue 27: a
/// value anyone can read must not say who a process is). Only the holder of the pair key
/// opens it, and only for this handshake (the transcript is both the key's salt and the AAD).
pub fn seal_identity(
    pair: &Key,
    transcript: &[u8; 32],
    sender: Role,
    incarnation: u64,
    fingerprint: &[u8; codec::FINGERPRINT_BYTES],
) -> [u8; codec::SEALED_IDENTITY_BYTES] {
    let mut out = [0u8; codec::SEALED_IDENTITY_BYTES];
    let (body, tag) = out.split_at_mut(8 + codec::FINGERPRINT_BYTES);
    body[..8].copy_from_slice(&incarnation.to_le_bytes());
    body[8..].copy_from_slice(fingerprint);
    let t = identity_key(pair, transcript, sender)
        .seal_in_place_separate_tag(nonce(0), Aad::from(transcript), body)
        .expect("one 40-byte record under a fresh key");
    tag.copy_from_slice(t.as_ref());
    out
}

/// Opens a sealed identity ([`seal_identity`]): `(incarnation, fingerprint)`, or `None` when it
/// was not sealed under this pair key, transcript and sender.
pub fn open_identity(
    pair: &Key,
    transcript: &[u8; 32],
    sender: Role,
    sealed: &[u8; codec::SEALED_IDENTITY_BYTES],
) -> Option<(u64, [u8; codec::FINGERPRINT_BYTES])> {
    let mut buf = *sealed;
    let plain = identity_key(pair, transcript, sender)
        .open_in_place(nonce(0), Aad::from(transcript), &mut buf)
        .ok()?;
    let incarnation = u64::from_le_bytes(plain[..8].try_into().ok()?);
    let fingerprint = plain[8..8 + codec::FINGERPRINT_BYTES].try_into().ok()?;
    Some((incarnation, fingerprint))
}

fn aead_key(k: &Key) -> LessSafeKey {
    LessSafeKey::new(UnboundKey::new(&AES_256_GCM, &k.0).expect("32-byte AES-256 key"))
}

/// Seals records in one direction (AES-256-GCM, counter nonces from 0).
pub struct Sealer {
    key: LessSafeKey,
    counter: u64,
}

impl fmt::Debug for Sealer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Sealer(counter {})", self.counter)
    }
}

impl Sealer {
    /// A sealer for the direction keyed by `key`.
    pub fn new(key: &Key) -> Self {
        Self {
            key: aead_key(key),
            counter: 0,
        }
    }

    /// Encrypts `buf` in place and returns its tag.
    pub fn seal(&mut self, aad: &[u8], buf: &mut [u8]) -> Result<[u8; TAG_BYTES], IntegrityError> {
        let n = self.counter;
        self.counter = n.checked_add(1).ok_or(IntegrityError::Exhausted)?;
        let tag = self
            .key
            .seal_in_place_separate_tag(nonce(n), Aad::from(aad), buf)
            .map_err(|_| IntegrityError::Exhausted)?;
        let mut t = [0u8; TAG_BYTES];
        t.copy_from_slice(tag.as_ref());
        Ok(t)
    }

    /// Appends the sealed head record of a frame (`head`: header, metadata and padding) to
    /// `out`: the length prefix, the encrypted head and its tag.
    pub fn seal_head(&mut self, head: &[u8], out: &mut Vec<u8>) -> Result<(), IntegrityError> {
        let prefix = (head.len() as u32).to_le_bytes();
        out.extend_from_slice(&prefix);
        let start = out.len();
        out.extend_from_slice(head);
        let tag = self.seal(&prefix, &mut out[start..])?;
        out.extend_from_slice(&tag);
        Ok(())
    }

    /// Appends one sealed payload record (a chunk of at most [`SEAL_CHUNK_BYTES`]) to `out`.
    pub fn seal_chunk(&mut self, chunk: &[u8], out: &mut Vec<u8>) -> Result<(), IntegrityError> {
        let start = out.len();
        out.extend_from_slice(chunk);
        let tag = self.seal(&[], &mut out[start..])?;
        out.extend_from_slice(&tag);
        Ok(())
    }

    /// Seals one whole frame (head, then `payload` in chunks) into `out` (cleared first).
    pub fn seal_frame(
        &mut self,
        head: &[u8],
        payload: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<(), IntegrityError> {
        out.clear();
        self.seal_head(head, out)?;
        let mut off = 0;
        for n in payload_chunks(payload.len()) {
            self.seal_chunk(&payload[off..off + n], out)?;
            off += n;
        }
        Ok(())
    }
}

/// Opens records in one direction; each record must carry the next counter.
pub struct Opener {
    key: LessSafeKey,
    counter: u64,
}

impl fmt::Debug for Opener {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Opener(counter {})", self.counter)
    }
}

impl Opener {
    /// An opener for the direction keyed by `key`.
    pub fn new(key: &Key) -> Self {
        Self {
            key: aead_key(key),
            counter: 0,
        }
    }

    /// Decrypts `buf` (ciphertext then tag) in place; returns the plaintext length.
    pub fn open(&mut self, aad: &[u8], buf: &mut [u8]) -> Result<usize, IntegrityError> {
        let n = self.counter;
        self.counter = n.checked_add(1).ok_or(IntegrityError::Exhausted)?;
        let plain = self
            .key
            .open_in_place(nonce(n), Aad::from(aad), buf)
            .map_err(|_| IntegrityError::BadTag { counter: n })?;
        Ok(plain.len())
    }

    /// Decrypts `buf` in place with its `tag` read aside (a payload chunk straight in the
    /// receive buffer).
    pub fn open_separate(
        &mut self,
        buf: &mut [u8],
        tag: &[u8; TAG_BYTES],
    ) -> Result<(), IntegrityError> {
        let n = self.counter;
        self.counter = n.checked_add(1).ok_or(IntegrityError::Exhausted)?;
        let tag = ring::aead::Tag::from(*tag);
        self.key
            .open_in_place_separate_tag(nonce(n), Aad::empty(), tag, buf, 0..)
            .map_err(|_| IntegrityError::BadTag { counter: n })?;
        Ok(())
    }

    /// Skips one record without opening it (a receiver discarding a frame's payload unread);
    /// keeps the counter in step so the next record still opens.
    pub fn skip(&mut self) -> Result<(), IntegrityError> {
        self.counter = self
            .counter
            .checked_add(1)
            .ok_or(IntegrityError::Exhausted)?;
        Ok(())
    }
}

/// Checks a sealed frame's length prefix: the head length it announces.
pub fn sealed_head_len(
    prefix: [u8; SEALED_PREFIX_BYTES],
    cfg: &CodecConfig,
) -> Result<usize, IntegrityError> {
    let len = u32::from_le_bytes(prefix) as usize;
    let max = MAX_SEALED_HEAD_BYTES.min(codec::align_up(cfg.max_frame_bytes));
    if len < HEADER_LEN || len > max || len % PAYLOAD_ALIGN != 0 {
        return Err(IntegrityError::BadHeadLength { len, max });
    }
    Ok(len)
}

/// Opens a sealed head (`buf`: `head_len` ciphertext bytes then the tag) in place and checks
/// the frame header in it against the record: returns the header.
pub fn open_head(
    opener: &mut Opener,
    prefix: [u8; SEALED_PREFIX_BYTES],
    buf: &mut [u8],
    cfg: &CodecConfig,
) -> Result<FrameHeader, IntegrityError> {
    let n = opener.open(&prefix, buf)?;
    let header = codec::decode_header(&buf[..n], cfg).map_err(IntegrityError::Header)?;
    if header.payload_offset() != n {
        return Err(IntegrityError::Header(CodecError::InconsistentLengths {
            frame_len: header.frame_len,
            meta_len: header.meta_len,
            payload_len: header.payload_len,
        }));
    }
    Ok(header)
}

/// Opens one whole sealed frame held in `bytes` (sans-IO: tests and fuzzing). Returns the
/// plaintext frame (header, metadata, padding, payload) and how many bytes were used.
pub fn open_frame(
    opener: &mut Opener,
    bytes: &[u8],
    cfg: &CodecConfig,
) -> Result<(Vec<u8>, usize), OpenError> {
    let need = |n: usize| {
        if bytes.len() < n {
            Err(OpenError::Truncated {
                needed: n,
                have: bytes.len(),
            })
        } else {
            Ok(())
        }
    };
    need(SEALED_PREFIX_BYTES)?;
    let prefix: [u8; 4] = bytes[..4].try_into().expect("4 bytes");
    let head_len = sealed_head_len(prefix, cfg)?;
    let head_end = SEALED_PREFIX_BYTES + head_len + TAG_BYTES;
    need(head_end)?;
    let mut head = bytes[SEALED_PREFIX_BYTES..head_end].to_vec();
    let header = open_head(opener, prefix, &mut head, cfg)?;
    head.truncate(head_len);
    let mut pos = head_end;
    for n in payload_chunks(header.payload_len as usize) {
        need(pos + n + TAG_BYTES)?;
        let start = head.len();
        head.extend_from_slice(&bytes[pos..pos + n]);
        let tag: [u8; TAG_BYTES] = bytes[pos + n..pos + n + TAG_BYTES].try_into().expect("16");
        opener.open_separate(&mut head[start..], &tag)?;
        pos += n + TAG_BYTES;
    }
    Ok((head, pos))
}

/// Why [`open_frame`] failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum OpenError {
    /// Fewer bytes than the record announces.
    #[error("truncated sealed frame: need {needed} bytes, have {have}")]
    Truncated {
        /// Bytes needed.
        needed: usize,
        /// Bytes present.
        have: usize,
    },
    /// The record did not open.
    #[error(transparent)]
    Integrity(#[from] IntegrityError),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::{Body, Heartbeat, LayerResponse};
    use crate::dtype::OutputDtype;

    fn master() -> Key {
        Key::from_bytes([7; 32])
    }

    #[test]
    fn pair_keys_are_symmetric_and_distinct() {
        let m = master();
        assert_eq!(pair_key(&m, "c", 1, 4), pair_key(&m, "c", 4, 1));
        assert_ne!(pair_key(&m, "c", 1, 4), pair_key(&m, "c", 1, 5));
        assert_ne!(pair_key(&m, "c", 1, 4), pair_key(&m, "d", 1, 4));
        // Domain separation: a frontend root never equals a pair key of the same numbers.
        assert_ne!(frontend_root(&m, "c", 0).0, pair_key(&m, "c", 0, 0).0);
    }

    #[test]
    fn a_rank_credential_holds_only_its_own_pairs() {
        let m = master();
        let w = Credentials::issue_rank(&m, "c", 3, 5, 1);
        assert_eq!(w.rank_key("c", 3, 0), Some(pair_key(&m, "c", 3, 0)));
        assert_eq!(w.rank_key("c", 2, 0), None, "cannot act as rank 2");
        assert_eq!(
            w.client_key("c", 3, "fe"),
            None,
            "a worker derives no frontend key"
        );
        assert!(w.check_rank("c", 3).is_ok());
        assert!(w.check_rank("c", 2).unwrap_err().contains("rank 3"));
        assert!(w.check_rank("x", 3).unwrap_err().contains("cluster"));
        let r = Credentials::issue_rank(&m, "c", 0, 5, 1);
        let f = Credentials::issue_frontend(&m, "c", "fe", 1);
        assert_eq!(r.client_key("c", 0, "fe"), f.router_key("c", 0, "fe"));
        assert!(
            f.check_rank("c", 0).is_err(),
            "a frontend cannot join the mesh"
        );
        assert!(f.check_frontend("c").is_ok());
    }

    #[test]
    fn credential_files_round_trip_and_refuse_garbage() {
        let m = master();
        for c in [
            Credentials::issue_rank(&m, "c", 0, 3, 1),
            Credentials::issue_frontend(&m, "c", "fe-1", 2),
        ] {
            let text = c.to_file_text();
            let back = Credentials::parse(&text, "f").unwrap();
            assert_eq!(back.to_file_text(), text);
            assert_eq!(back.identity(), c.identity());
        }
        let e = Credentials::parse("hello\n", "f").unwrap_err().to_string();
        assert!(e.contains("not an expertmesh credential"), "{e}");
        let e = Credentials::parse(
            &format!("{CRED_HEADER}\ncluster = c\nrank = 1\npair 0 = zz\n"),
            "f",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("line 4") && e.contains("hex"), "{e}");
    }

    #[test]
    fn session_keys_mirror_and_differ_per_direction() {
        let k = Key::from_bytes([1; 32]);
        let t = [9u8; 32];
        let d = session_keys(&k, &t, Role::Dialer);
        let a = session_keys(&k, &t, Role::Acceptor);
        assert_eq!(d.send, a.recv);
        assert_eq!(d.recv, a.send);
        assert_ne!(d.send, d.recv);
        let other = session_keys(&k, &[8u8; 32], Role::Dialer);
        assert_ne!(other.send, d.send, "keys bind the transcript (nonces)");
    }

    fn frame(body: &Body, payload: &[u8]) -> (Vec<u8>, Vec<u8>) {
        let mut head = Vec::new();
        codec::encode_head(body, payload, &CodecConfig::default(), &mut head).unwrap();
        (head, payload.to_vec())
    }

    fn response() -> (Vec<u8>, Vec<u8>) {
        let body = Body::LayerResponse(LayerResponse {
            request_id: 5,
            tokens: 2,
            hidden: 4,
            dtype: OutputDtype::F32,
        });
        frame(&body, &(0..32u8).collect::<Vec<_>>())
    }

    fn sealed_pair() -> (Sealer, Opener) {
        let k = Key::from_bytes([3; 32]);
        (Sealer::new(&k), Opener::new(&k))
    }

    #[test]
    fn sealed_frames_round_trip_and_hide_the_payload() {
        let (mut s, mut o) = sealed_pair();
        let cfg = CodecConfig::default();
        let (head, payload) = response();
        let mut wire = Vec::new();
        for _ in 0..3 {
            s.seal_frame(&head, &payload, &mut wire).unwrap();
            assert!(
                !wire.windows(payload.len()).any(|w| w == payload),
                "plaintext on the wire"
            );
            let (plain, used) = open_frame(&mut o, &wire, &cfg).unwrap();
            assert_eq!(used, wire.len());
            assert_eq!(&plain[..head.len()], &head[..]);
            assert_eq!(&plain[head.len()..], &payload[..]);
            let (body, _) = codec::decode_frame(&plain, &cfg).unwrap();
            assert!(matches!(body, Body::LayerResponse(r) if r.request_id == 5));
        }
        // A frame without payload is one record.
        let (hb, _) = frame(
            &Body::Heartbeat(Heartbeat {
                seq: 1,
                sent_at_us: 2,
            }),
            &[],
        );
        s.seal_frame(&hb, &[], &mut wire).unwrap();
        assert_eq!(wire.len(), 4 + hb.len() + TAG_BYTES);
        assert_eq!(open_frame(&mut o, &wire, &cfg).unwrap().0, hb);
        // A payload over several chunks: dropping a middle chunk's record fails.
        let big: Vec<u8> = (0..(2 * SEAL_CHUNK_BYTES + 100)).map(|i| i as u8).collect();
        let body = Body::LayerResponse(LayerResponse {
            request_id: 6,
            tokens: 1,
            hidden: (big.len() / 4) as u32,
            dtype: OutputDtype::F32,
        });
        let (h, p) = frame(&body, &big);
        s.seal_frame(&h, &p, &mut wire).unwrap();
        assert_eq!(
            payload_chunks(p.len()).collect::<Vec<_>>(),
            [SEAL_CHUNK_BYTES, SEAL_CHUNK_BYTES, 100]
        );
        let mut o2 = Opener::new(&Key::from_bytes([3; 32]));
        o2.counter = o.counter;
        let (plain, _) = open_frame(&mut o, &wire, &cfg).unwrap();
        assert_eq!(&plain[h.len()..], &big[..]);
        let chunk = SEAL_CHUNK_BYTES + TAG_BYTES;
        let cut = 4 + h.len() + TAG_BYTES;
        let mut dropped = wire[..cut + chunk].to_vec();
        dropped.extend_from_slice(&wire[cut + 2 * chunk..]);
        dropped.extend_from_slice(&wire[cut + chunk..cut + 2 * chunk]);
        assert!(
            open_frame(&mut o2, &dropped, &cfg).is_err(),
            "reordered chunks"
        );
    }

    #[test]
    fn every_flipped_bit_is_caught() {
        let cfg = CodecConfig::default();
        let (head, payload) = response();
        let (mut s, _) = sealed_pair();
        let mut wire = Vec::new();
        s.seal_frame(&head, &payload, &mut wire).unwrap();
        for i in 0..wire.len() {
            let mut bad = wire.clone();
            bad[i] ^= 0x10;
            let (_, mut o) = sealed_pair();
            let r = open_frame(&mut o, &bad, &cfg);
            assert!(r.is_err(), "flip at byte {i} went unnoticed");
        }
    }

    #[test]
    fn replayed_reordered_and_truncated_frames_fail() {
        let cfg = CodecConfig::default();
        let (head, payload) = response();
        let (mut s, mut o) = sealed_pair();
        let (mut f1, mut f2) = (Vec::new(), Vec::new());
        s.seal_frame(&head, &payload, &mut f1).unwrap();
        s.seal_frame(&head, &payload, &mut f2).unwrap();
        // Reordered: the second frame first.
        assert!(matches!(
            open_frame(&mut o, &f2, &cfg),
            Err(OpenError::Integrity(IntegrityError::BadTag { counter: 0 }))
        ));
        // Replayed: the first frame twice.
        let (_, mut o) = sealed_pair();
        open_frame(&mut o, &f1, &cfg).unwrap();
        assert!(open_frame(&mut o, &f1, &cfg).is_err());
        // Truncated: any prefix.
        for cut in [0, 3, 10, f1.len() - 1] {
            let (_, mut o) = sealed_pair();
            assert!(open_frame(&mut o, &f1[..cut], &cfg).is_err(), "cut {cut}");
        }
        // A swapped payload record (from another frame) fails too.
        let mut spliced = f1.clone();
        let tail = f1.len() - (payload.len() + TAG_BYTES);
        assert_eq!(payload_chunks(payload.len()).count(), 1);
        spliced[tail..].copy_from_slice(&f2[tail..]);
        let (_, mut o) = sealed_pair();
        assert!(open_frame(&mut o, &spliced, &cfg).is_err());
    }

    #[test]
    fn a_huge_announced_head_is_refused_before_reading() {
        let cfg = CodecConfig::default();
        let e = sealed_head_len((u32::MAX).to_le_bytes(), &cfg).unwrap_err();
        assert!(matches!(e, IntegrityError::BadHeadLength { .. }));
        assert!(sealed_head_len(40u32.to_le_bytes(), &cfg).is_err());
        assert_eq!(sealed_head_len(64u32.to_le_bytes(), &cfg).unwrap(), 64);
    }
}
