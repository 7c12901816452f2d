//! The wire format of every frame: a fixed, versioned header, kind-specific metadata, and a
//! 64-byte aligned payload. Sans-IO: bytes in, frames out; frames in, bytes out; no I/O, no clock.
//!
//! Why this exists: every driver (TCP, shared memory, RoCE) and every fuzz target shares one
//! definition of what a valid frame is, so a frame that decodes on one transport decodes the
//! same way on all of them, and garbage is rejected in one place.
//!
//! # Layout (all integers little endian)
//!
//! ```text
//! offset  size  field
//!  0       4    magic            0x464D_4D45 ("EMMF" read as little-endian bytes)
//!  4       1    format version   FORMAT_VERSION
//!  5       1    kind             FrameKind
//!  6       2    flags            bit 0: payload carries a crc32c
//!  8       4    frame_len        total bytes, header + metadata + padding + payload
//! 12       4    meta_len         bytes of kind-specific metadata starting at offset 32
//! 16       4    payload_len      bytes of payload
//! 20       4    payload_crc32c   crc32c of metadata then payload when flag bit 0 is set, else 0
//! 24       4    header_crc32c    crc32c of bytes 0..24 (catches garbage and torn headers)
//! 28       4    reserved         must be 0
//! 32       …    metadata         meta_len bytes
//!  …       …    zero padding     up to payload_offset = align_up(32 + meta_len, 64)
//!  payload_offset  payload       payload_len bytes; frame_len = payload_offset + payload_len
//! ```
//!
//! The payload offset is a multiple of [`PAYLOAD_ALIGN`] so that a frame received into a
//! 64-byte aligned buffer exposes its activations for SIMD loads and device copies without
//! copying them again. Every length in the header and the metadata is checked against the
//! configured maximum frame size and against the bytes actually present before anything is
//! allocated; decoding arbitrary bytes returns an error and never panics (fuzzed, see `fuzz/`).
//!
//! A dispatch's compute mode and result layout are the exact-mode contract's own
//! [`ComputeMode`] and [`OutputLayout`] (re-exported here), one byte each on the wire. The
//! bytes each serving mode costs per token are measured on encoded frames by the `wire_size`
//! submodule ([`wire_bytes_per_token`]).

pub use crate::align::{PAYLOAD_ALIGN, align_up};
use crate::dtype::{ActivationDtype, OutputDtype};
/// The numerical contract a dispatch asks for and the layout of its results: one definition in
/// the exact-mode contract, shared by the backends and the wire (a dispatch's mode byte is 0
/// exact, 1 accurate; its layout byte 0 per slot, 1 pre-combined).
pub use expertmesh_quant::contract::{ComputeMode, OutputLayout};
use std::ops::Range;

mod wire_size;
pub use wire_size::{WireBytes, WireFormat, max_tokens_per_frame, wire_bytes_per_token};

/// Magic number at the start of every frame ("EMMF" as little-endian bytes).
pub const MAGIC: u32 = 0x464D_4D45;
/// Version of the frame format; a peer with another version is refused at the handshake.
pub const FORMAT_VERSION: u8 = 4;
/// Bytes of the fixed header.
pub const HEADER_LEN: usize = 32;
/// Smallest maximum frame size a configuration may ask for.
pub const MIN_MAX_FRAME_BYTES: usize = 4096;
/// Largest maximum frame size a configuration may ask for (frame lengths are u32 on the wire).
pub const MAX_MAX_FRAME_BYTES: usize = 1 << 31;
/// Longest cluster name in a hello frame, in bytes.
pub const MAX_CLUSTER_NAME_BYTES: usize = 255;
/// Longest driver attachment in a hello frame (a shared-memory path, RDMA queue pair info).
pub const MAX_ATTACHMENT_BYTES: usize = 1024;
/// Longest message in an error frame, in bytes.
pub const MAX_ERROR_MESSAGE_BYTES: usize = 4096;
/// An error frame's part field when the error names no part ([`ErrorFrame::part`] `None`).
pub const NO_PART: u32 = u32::MAX;
/// Length of a hello nonce and of an authentication MAC (HMAC-SHA256).
pub const NONCE_BYTES: usize = 32;
/// Longest frontend name in a hello, in bytes.
pub const MAX_IDENTITY_BYTES: usize = 255;
/// Largest frame accepted before the peer has authenticated (its hello, auth answer or a
/// refusal): a header announcing more is refused before anything is allocated for it.
pub const PRE_AUTH_MAX_FRAME_BYTES: usize = 8192;
/// Largest head (header, metadata and padding) a frame may have: a sealed frame's head is
/// opened whole before its payload is read, so a receiver bounds it
/// (`crypto::MAX_SEALED_HEAD_BYTES`), and every frame keeps to that bound so sealing never
/// turns an encodable frame into one the peer refuses. About 14,000 tokens of dispatch
/// metadata with nine slots each.
pub const MAX_HEAD_BYTES: usize = 1 << 20;

const FLAG_PAYLOAD_CRC: u16 = 1;
const KNOWN_FLAGS: u16 = FLAG_PAYLOAD_CRC;

/// Why bytes are not a valid frame, or a frame cannot be encoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CodecError {
    /// Fewer bytes than the header or the announced frame length.
    #[error("truncated frame: need {needed} bytes, have {have}")]
    Truncated {
        /// Bytes the frame needs.
        needed: usize,
        /// Bytes available.
        have: usize,
    },
    /// The first four bytes are not [`MAGIC`]: the stream is not an ExpertMesh frame stream.
    #[error(
        "bad magic 0x{found:08x}: not an ExpertMesh frame (is the peer speaking another protocol?)"
    )]
    BadMagic {
        /// The four bytes found, read little endian.
        found: u32,
    },
    /// A frame of another format version.
    #[error(
        "unsupported frame format version {found} (this build speaks {FORMAT_VERSION}); upgrade the older side"
    )]
    UnsupportedVersion {
        /// The version byte found.
        found: u8,
    },
    /// The header checksum does not match: corrupt or garbage bytes.
    #[error("header checksum mismatch (corrupt or garbage bytes)")]
    HeaderChecksum,
    /// An unknown frame kind.
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    /// Unknown flag bits or a non-zero reserved field.
    #[error("unknown header flags 0x{flags:04x} or non-zero reserved field")]
    BadFlags {
        /// The flags found.
        flags: u16,
    },
    /// The frame is larger than the configured maximum.
    #[error("frame of {len} bytes exceeds the configured maximum of {max} bytes")]
    TooLarge {
        /// Frame length announced or required.
        len: u64,
        /// Configured maximum.
        max: usize,
    },
    /// A frame's head (header, metadata, padding) past [`MAX_HEAD_BYTES`].
    #[error(
        "a frame head of {len} bytes (header and metadata) exceeds the limit of {max} bytes: \
         send fewer tokens per frame"
    )]
    HeadTooLarge {
        /// The head's length.
        len: usize,
        /// [`MAX_HEAD_BYTES`].
        max: usize,
    },
    /// The header's lengths contradict each other.
    #[error(
        "inconsistent lengths: frame_len {frame_len}, meta_len {meta_len}, payload_len {payload_len}"
    )]
    InconsistentLengths {
        /// Announced frame length.
        frame_len: u32,
        /// Announced metadata length.
        meta_len: u32,
        /// Announced payload length.
        payload_len: u32,
    },
    /// The metadata-and-payload checksum does not match.
    #[error("payload crc32c mismatch: header says 0x{expected:08x}, payload has 0x{actual:08x}")]
    PayloadChecksum {
        /// Checksum in the header.
        expected: u32,
        /// Checksum of the bytes received.
        actual: u32,
    },
    /// The metadata of a kind is malformed.
    #[error("malformed {kind:?} metadata: {what}")]
    BadMetadata {
        /// Kind of the frame.
        kind: FrameKind,
        /// What is wrong.
        what: String,
    },
    /// The payload length does not match what the metadata describes.
    #[error("{kind:?} payload is {actual} bytes but its metadata describes {expected} bytes")]
    PayloadLength {
        /// Kind of the frame.
        kind: FrameKind,
        /// Bytes the metadata implies.
        expected: u64,
        /// Bytes present.
        actual: u64,
    },
    /// A configuration value is out of range.
    #[error("invalid codec configuration: {0}")]
    BadConfig(String),
}

/// Codec settings shared by both ends of a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CodecConfig {
    /// Largest frame accepted or produced, header included.
    pub max_frame_bytes: usize,
    /// Whether encoded frames carry a crc32c of their payload (decoding always verifies a
    /// checksum that is present).
    pub payload_checksum: bool,
}

impl Default for CodecConfig {
    fn default() -> Self {
        Self {
            max_frame_bytes: 16 << 20,
            payload_checksum: false,
        }
    }
}

impl CodecConfig {
    /// Checks the limits; call once at start-up.
    pub fn validate(&self) -> Result<(), CodecError> {
        if !(MIN_MAX_FRAME_BYTES..=MAX_MAX_FRAME_BYTES).contains(&self.max_frame_bytes) {
            return Err(CodecError::BadConfig(format!(
                "max_frame_bytes {} outside {MIN_MAX_FRAME_BYTES}..={MAX_MAX_FRAME_BYTES}",
                self.max_frame_bytes
            )));
        }
        Ok(())
    }
}

/// The kind of a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum FrameKind {
    /// Connection hello: cluster, rank, version, nonce, receive window.
    Hello = 1,
    /// Authentication answer to the peer's nonce.
    Auth = 2,
    /// Router → worker: tokens and their experts for one layer.
    Dispatch = 3,
    /// Worker → router: expert outputs.
    Result = 4,
    /// An error for one request.
    Error = 5,
    /// Liveness probe.
    Heartbeat = 6,
    /// Flow-control credit returned to the sender.
    Credit = 7,
    /// Frontend → router service: one MoE layer call.
    LayerRequest = 8,
    /// Router service → frontend: the combined layer output.
    LayerResponse = 9,
    /// After authentication: this end's side of a shared-memory or RDMA link (sealed on the
    /// TCP connection, so ring paths and queue pairs are never exchanged before it).
    LinkInfo = 10,
    /// A live placement change: router → worker (hold exactly these experts), worker → every
    /// router (what it holds now), router → worker (seen), frontend → router (apply this
    /// placement) and router → frontend (applied). See [`Placement`].
    Placement = 11,
}

impl FrameKind {
    /// The kind for a wire byte.
    pub fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            1 => Self::Hello,
            2 => Self::Auth,
            3 => Self::Dispatch,
            4 => Self::Result,
            5 => Self::Error,
            6 => Self::Heartbeat,
            7 => Self::Credit,
            8 => Self::LayerRequest,
            9 => Self::LayerResponse,
            10 => Self::LinkInfo,
            11 => Self::Placement,
            _ => return None,
        })
    }

    /// Whether frames of this kind belong to the application (delivered to the receiver and
    /// counted against flow control) rather than to the connection protocol.
    pub fn is_application(self) -> bool {
        !matches!(
            self,
            Self::Hello | Self::Auth | Self::Heartbeat | Self::Credit | Self::LinkInfo
        )
    }
}

/// The validated fixed header of a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    /// Kind of the frame.
    pub kind: FrameKind,
    /// Total frame length in bytes.
    pub frame_len: u32,
    /// Metadata length in bytes.
    pub meta_len: u32,
    /// Payload length in bytes.
    pub payload_len: u32,
    /// Payload checksum, when the frame carries one.
    pub payload_crc: Option<u32>,
}

impl FrameHeader {
    /// Offset of the payload from the start of the frame.
    pub fn payload_offset(&self) -> usize {
        align_up(HEADER_LEN + self.meta_len as usize)
    }

    /// Byte range of the metadata inside the frame.
    pub fn meta_range(&self) -> Range<usize> {
        HEADER_LEN..HEADER_LEN + self.meta_len as usize
    }

    /// Byte range of the payload inside the frame.
    pub fn payload_range(&self) -> Range<usize> {
        let off = self.payload_offset();
        off..off + self.payload_len as usize
    }
}

/// Parses and validates the fixed header at the start of `bytes` (only the first
/// [`HEADER_LEN`] bytes are read). On success the caller knows exactly how many bytes the whole
/// frame has, and that this is within `cfg.max_frame_bytes`.
pub fn decode_header(bytes: &[u8], cfg: &CodecConfig) -> Result<FrameHeader, CodecError> {
    if bytes.len() < HEADER_LEN {
        return Err(CodecError::Truncated {
            needed: HEADER_LEN,
            have: bytes.len(),
        });
    }
    let u32_at =
        |o: usize| u32::from_le_bytes([bytes[o], bytes[o + 1], bytes[o + 2], bytes[o + 3]]);
    let magic = u32_at(0);
    if magic != MAGIC {
        return Err(CodecError::BadMagic { found: magic });
    }
    if bytes[4] != FORMAT_VERSION {
        return Err(CodecError::UnsupportedVersion { found: bytes[4] });
    }
    if crc32c::crc32c(&bytes[..24]) != u32_at(24) {
        return Err(CodecError::HeaderChecksum);
    }
    let kind = FrameKind::from_u8(bytes[5]).ok_or(CodecError::UnknownKind(bytes[5]))?;
    let flags = u16::from_le_bytes([bytes[6], bytes[7]]);
    if flags & !KNOWN_FLAGS != 0 || u32_at(28) != 0 {
        return Err(CodecError::BadFlags { flags });
    }
    let frame_len = u32_at(8);
    let meta_len = u32_at(12);
    let payload_len = u32_at(16);
    let crc = u32_at(20);
    if frame_len as usize > cfg.max_frame_bytes {
        return Err(CodecError::TooLarge {
            len: frame_len as u64,
            max: cfg.max_frame_bytes,
        });
    }
    let expected = align_up(HEADER_LEN + meta_len as usize) as u64 + payload_len as u64;
    if expected != frame_len as u64 {
        return Err(CodecError::InconsistentLengths {
            frame_len,
            meta_len,
            payload_len,
        });
    }
    let payload_crc = if flags & FLAG_PAYLOAD_CRC != 0 {
        Some(crc)
    } else if crc != 0 {
        return Err(CodecError::BadFlags { flags });
    } else {
        None
    };
    Ok(FrameHeader {
        kind,
        frame_len,
        meta_len,
        payload_len,
        payload_crc,
    })
}

/// Length of the header, metadata and padding that [`encode_head`] writes for `body`.
pub fn head_len(body: &Body) -> usize {
    align_up(HEADER_LEN + body.meta_len())
}

/// Total encoded length of `body` with a payload of `payload_len` bytes.
pub fn frame_len(body: &Body, payload_len: usize) -> usize {
    head_len(body).saturating_add(payload_len)
}

/// Writes the header, metadata and padding of a frame into `out` (cleared first); the payload
/// follows these bytes on the wire. Checks that `payload` has the length the metadata describes
/// and that the frame fits `cfg.max_frame_bytes`. Returns the frame's total length.
pub fn encode_head(
    body: &Body,
    payload: &[u8],
    cfg: &CodecConfig,
    out: &mut Vec<u8>,
) -> Result<usize, CodecError> {
    body.validate()?;
    let expected = body.expected_payload_len()?;
    if expected != payload.len() as u64 {
        return Err(CodecError::PayloadLength {
            kind: body.kind(),
            expected,
            actual: payload.len() as u64,
        });
    }
    let meta_len = body.meta_len();
    let head = align_up(HEADER_LEN + meta_len);
    if head > MAX_HEAD_BYTES {
        return Err(CodecError::HeadTooLarge {
            len: head,
            max: MAX_HEAD_BYTES,
        });
    }
    let total = head as u64 + payload.len() as u64;
    if total > cfg.max_frame_bytes as u64 {
        return Err(CodecError::TooLarge {
            len: total,
            max: cfg.max_frame_bytes,
        });
    }
    out.clear();
    out.reserve(head);
    let flags = if cfg.payload_checksum {
        FLAG_PAYLOAD_CRC
    } else {
        0
    };
    out.extend_from_slice(&MAGIC.to_le_bytes());
    out.push(FORMAT_VERSION);
    out.push(body.kind() as u8);
    out.extend_from_slice(&flags.to_le_bytes());
    out.extend_from_slice(&(total as u32).to_le_bytes());
    out.extend_from_slice(&(meta_len as u32).to_le_bytes());
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    out.extend_from_slice(&[0u8; 12]); // crc, header crc, reserved: patched below
    body.write_meta(out);
    debug_assert_eq!(out.len(), HEADER_LEN + meta_len);
    if cfg.payload_checksum {
        let crc = crc32c::crc32c_append(crc32c::crc32c(&out[HEADER_LEN..]), payload);
        out[20..24].copy_from_slice(&crc.to_le_bytes());
    }
    let hcrc = crc32c::crc32c(&out[..24]);
    out[24..28].copy_from_slice(&hcrc.to_le_bytes());
    out.resize(head, 0);
    Ok(total as usize)
}

/// Encodes a whole frame into a new buffer (header, metadata, padding, payload).
pub fn encode_frame(body: &Body, payload: &[u8], cfg: &CodecConfig) -> Result<Vec<u8>, CodecError> {
    let mut out = Vec::new();
    encode_head(body, payload, cfg, &mut out)?;
    out.extend_from_slice(payload);
    Ok(out)
}

/// Decodes one complete frame occupying exactly `frame` (as announced by its header). Returns
/// the body and the payload's byte range inside `frame`; the payload is verified against its
/// checksum when one is present.
pub fn decode_frame(frame: &[u8], cfg: &CodecConfig) -> Result<(Body, Range<usize>), CodecError> {
    let header = decode_header(frame, cfg)?;
    decode_with_header(&header, frame)
}

/// Like [`decode_frame`] with a header already validated by [`decode_header`].
pub fn decode_with_header(
    header: &FrameHeader,
    frame: &[u8],
) -> Result<(Body, Range<usize>), CodecError> {
    if frame.len() != header.frame_len as usize {
        return Err(CodecError::Truncated {
            needed: header.frame_len as usize,
            have: frame.len(),
        });
    }
    let payload_range = header.payload_range();
    // Padding must be zero: a cheap extra guard against misframed streams.
    if frame[HEADER_LEN + header.meta_len as usize..payload_range.start]
        .iter()
        .any(|&b| b != 0)
    {
        return Err(CodecError::BadMetadata {
            kind: header.kind,
            what: "non-zero padding between metadata and payload".into(),
        });
    }
    let payload = &frame[payload_range.clone()];
    if let Some(expected) = header.payload_crc {
        let actual = crc32c::crc32c_append(crc32c::crc32c(&frame[header.meta_range()]), payload);
        if actual != expected {
            return Err(CodecError::PayloadChecksum { expected, actual });
        }
    }
    let body = Body::decode_meta(header.kind, &frame[header.meta_range()])?;
    let expected = body.expected_payload_len()?;
    if expected != payload.len() as u64 {
        return Err(CodecError::PayloadLength {
            kind: header.kind,
            expected,
            actual: payload.len() as u64,
        });
    }
    Ok((body, payload_range))
}

/// A streaming decoder: feed arbitrary chunks of a byte stream, take complete frames out.
/// Used by tests and the fuzz target; drivers read frames directly into aligned buffers.
#[derive(Debug)]
pub struct StreamDecoder {
    cfg: CodecConfig,
    buf: Vec<u8>,
}

impl StreamDecoder {
    /// A decoder enforcing `cfg`.
    pub fn new(cfg: CodecConfig) -> Self {
        Self {
            cfg,
            buf: Vec::new(),
        }
    }

    /// Appends bytes received from the stream. The buffer never holds more than one maximum
    /// frame plus the chunk: call [`Self::next_frame`] after each push.
    pub fn push(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// The next complete frame (body and owned payload), `Ok(None)` when more bytes are needed,
    /// or the error that makes the rest of the stream unusable.
    #[allow(clippy::type_complexity)]
    pub fn next_frame(&mut self) -> Result<Option<(Body, Vec<u8>)>, CodecError> {
        if self.buf.len() < HEADER_LEN {
            return Ok(None);
        }
        let header = decode_header(&self.buf, &self.cfg)?;
        let len = header.frame_len as usize;
        if self.buf.len() < len {
            return Ok(None);
        }
        let (body, range) = decode_with_header(&header, &self.buf[..len])?;
        let payload = self.buf[range].to_vec();
        self.buf.drain(..len);
        Ok(Some((body, payload)))
    }
}

// ---------------------------------------------------------------------------------------------
// Bodies
// ---------------------------------------------------------------------------------------------

/// Stable error codes carried by error frames (never renumbered; operators grep for them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    /// An internal failure of the sender.
    Internal,
    /// A frame could not be decoded or violated the protocol.
    BadFrame,
    /// A valid request the receiver does not support (layer, dtype, mode).
    Unsupported,
    /// Input rejected: wrong shape, NaN or infinity.
    InvalidInput,
    /// The receiver is overloaded; retry later or elsewhere.
    Overloaded,
    /// The request's deadline passed.
    DeadlineExceeded,
    /// A device needed for the request is unavailable.
    PeerUnavailable,
    /// Authentication failed.
    AuthFailed,
    /// The layer or expert is not loaded here.
    NotFound,
    /// The receiver is shutting down.
    ShuttingDown,
    /// The sender is authenticated but may not do this (a placement change from a frontend
    /// that is not one of the router's placement admins).
    NotPermitted,
    /// A code this build does not know, preserved.
    Other(u16),
}

impl ErrorCode {
    /// The stable wire number.
    pub fn to_u16(self) -> u16 {
        match self {
            Self::Internal => 1,
            Self::BadFrame => 2,
            Self::Unsupported => 3,
            Self::InvalidInput => 4,
            Self::Overloaded => 5,
            Self::DeadlineExceeded => 6,
            Self::PeerUnavailable => 7,
            Self::AuthFailed => 8,
            Self::NotFound => 9,
            Self::ShuttingDown => 10,
            Self::NotPermitted => 11,
            Self::Other(v) => v,
        }
    }

    /// The code for a wire number.
    pub fn from_u16(v: u16) -> Self {
        match v {
            1 => Self::Internal,
            2 => Self::BadFrame,
            3 => Self::Unsupported,
            4 => Self::InvalidInput,
            5 => Self::Overloaded,
            6 => Self::DeadlineExceeded,
            7 => Self::PeerUnavailable,
            8 => Self::AuthFailed,
            9 => Self::NotFound,
            10 => Self::ShuttingDown,
            11 => Self::NotPermitted,
            other => Self::Other(other),
        }
    }
}

/// Connection hello. `rank` is [`CLIENT_RANK`] for a frontend client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    /// Frame format version the sender speaks.
    pub format_version: u8,
    /// Cluster name; peers of different clusters refuse each other.
    pub cluster: String,
    /// Sender's rank.
    pub rank: u32,
    /// Number of ranks the sender believes the cluster has.
    pub world_size: u32,
    /// Bytes of application frames the sender accepts before it returns credit.
    pub recv_window_bytes: u64,
    /// Whether the sender requires shared-secret authentication.
    pub auth_required: bool,
    /// Fresh random challenge for the peer's authentication answer.
    pub nonce: [u8; NONCE_BYTES],
    /// Driver-specific attachment (shared-memory ring path, RDMA queue pair info).
    pub attachment: Vec<u8>,
    /// The sender process's incarnation: random per process start, so a restarted router or
    /// worker is told apart from its previous life (0 for frontends).
    pub incarnation: u64,
    /// What the sender serves: a digest of model, weights and the experts its rank holds
    /// (all zeros for frontends). Peers refuse a rank whose fingerprint differs from theirs
    /// for it.
    pub fingerprint: [u8; FINGERPRINT_BYTES],
    /// A frontend's name (whose key the router derives); empty for ranks.
    pub identity: String,
}

/// After authentication, this end's side of the link both hellos asked for: a shared-memory
/// ring path or RDMA queue pair description ([`LinkInfo::attachment`] empty: this end cannot
/// set it up, and the connection carries frames over TCP instead).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinkInfo {
    /// The attachment (link prefix and description), or empty.
    pub attachment: Vec<u8>,
}

/// The encoded metadata of a hello (what the handshake transcript hashes).
pub fn hello_meta(h: &Hello) -> Vec<u8> {
    let b = Body::Hello(h.clone());
    let mut out = Vec::with_capacity(b.meta_len());
    b.write_meta(&mut out);
    out
}

/// Bytes of a hello's weights-and-placement fingerprint (a SHA-256 digest).
pub const FINGERPRINT_BYTES: usize = 32;

/// The rank a frontend client announces in its hello.
pub const CLIENT_RANK: u32 = u32::MAX;

/// Bytes of a sealed identity in an [`Auth`]: incarnation (8) and fingerprint (32) under
/// AES-256-GCM (16-byte tag).
pub const SEALED_IDENTITY_BYTES: usize = 8 + FINGERPRINT_BYTES + 16;

/// Authentication answer: HMAC-SHA256 keyed with the pair's key over the handshake transcript
/// (absent when the sender runs without credentials), and the sender's identity sealed under a
/// key only the pair holds ([`crate::crypto::seal_identity`]; with credentials the hello
/// carries a zero incarnation and fingerprint).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Auth {
    /// The MAC, or `None` when the sender has no credentials configured.
    pub mac: Option<[u8; NONCE_BYTES]>,
    /// The sealed incarnation and fingerprint (with credentials only).
    pub identity: Option<[u8; SEALED_IDENTITY_BYTES]>,
}

/// Router → worker: tokens of one micro-batch and, per token, this device's experts.
#[derive(Debug, Clone, PartialEq)]
pub struct Dispatch {
    /// The router's batch id (on the wire: the frame's request-id field).
    pub batch_id: u64,
    /// MoE layer index.
    pub layer: u32,
    /// Part of the batch: one (micro-batch, device) share (on the wire: the micro-batch field).
    pub part: u32,
    /// Number of tokens.
    pub tokens: u32,
    /// Hidden size.
    pub hidden: u32,
    /// Encoding of the payload activations.
    pub dtype: ActivationDtype,
    /// Numerical contract to apply.
    pub mode: ComputeMode,
    /// Result layout wanted.
    pub layout: OutputLayout,
    /// Encoding of the result rows wanted (on the wire: the byte after the layout, once
    /// reserved: 0 = f32, so frames of older routers ask for f32; 1 = bf16). A bf16 result is
    /// each f32 row value rounded to nearest-even bf16 by the worker after its own combine.
    pub result_dtype: OutputDtype,
    /// Per token, how many (expert, weight) pairs follow in `experts` / `weights`.
    pub expert_counts: Vec<u16>,
    /// Flat expert ids, token by token.
    pub experts: Vec<u32>,
    /// Flat routing weights, parallel to `experts`.
    pub weights: Vec<f32>,
}

impl Dispatch {
    /// The (expert, weight) pairs of token `t` (empty when out of range).
    pub fn token_experts(&self, t: usize) -> impl Iterator<Item = (u32, f32)> + '_ {
        let start: usize = self.expert_counts.iter().take(t).map(|&c| c as usize).sum();
        let n = self.expert_counts.get(t).copied().unwrap_or(0) as usize;
        let end = (start + n).min(self.experts.len());
        let start = start.min(end);
        self.experts[start..end]
            .iter()
            .copied()
            .zip(self.weights[start..end].iter().copied())
    }
}

/// Worker → router: expert outputs for one dispatch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertResult {
    /// Batch id of the dispatch it answers.
    pub batch_id: u64,
    /// MoE layer index.
    pub layer: u32,
    /// Part id of the dispatch it answers.
    pub part: u32,
    /// Row layout of the payload.
    pub layout: OutputLayout,
    /// Number of rows (slots for per-slot, tokens for pre-combined).
    pub rows: u32,
    /// Hidden size (row length).
    pub hidden: u32,
    /// Encoding of the rows.
    pub dtype: OutputDtype,
}

/// An error for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ErrorFrame {
    /// Request the error belongs to (0 when it belongs to none).
    pub request_id: u64,
    /// The part of a dispatch the error answers (`request_id` is its batch id), as a result
    /// names it ([`ExpertResult::part`]); `None` for an error that names no part (a frontend's
    /// request, a link refusal). A router can hold several parts of one batch on one device (a
    /// part only that device serves beside a quarantine probe mirrored to it), and tells
    /// them apart by this. On the wire a u32, [`NO_PART`] for `None`.
    pub part: Option<u32>,
    /// Stable error code.
    pub code: ErrorCode,
    /// Human-readable message (UTF-8, at most [`MAX_ERROR_MESSAGE_BYTES`]).
    pub message: String,
}

/// Liveness probe.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Heartbeat {
    /// Sequence number.
    pub seq: u64,
    /// Sender's monotonic timestamp in microseconds (opaque to the receiver).
    pub sent_at_us: u64,
}

/// Flow-control credit: the receiver has released this many bytes of application frames.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Credit {
    /// Bytes returned to the sender's window.
    pub bytes: u64,
}

/// Frontend → router service: one MoE layer call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerRequest {
    /// Request id chosen by the client.
    pub request_id: u64,
    /// MoE layer index.
    pub layer: u32,
    /// Number of tokens.
    pub tokens: u32,
    /// Hidden size.
    pub hidden: u32,
    /// Encoding of the hidden states.
    pub dtype: ActivationDtype,
    /// Number of router-logit columns that follow the hidden states (0: none, the router gates).
    pub logit_experts: u32,
    /// Deadline relative to receipt, in microseconds (0: none).
    pub deadline_us: u64,
}

impl LayerRequest {
    /// Byte range of the hidden states inside the payload.
    pub fn hidden_range(&self) -> Range<usize> {
        0..self
            .dtype
            .payload_bytes(self.tokens as usize, self.hidden as usize)
            .unwrap_or(0) as usize
    }

    /// Byte range of the f32 router logits `[tokens][logit_experts]` inside the payload, if any.
    pub fn logits_range(&self) -> Option<Range<usize>> {
        if self.logit_experts == 0 {
            return None;
        }
        let start = align_up(self.hidden_range().end);
        let len = self.tokens as usize * self.logit_experts as usize * 4;
        Some(start..start + len)
    }
}

/// Router service → frontend: the combined output `[tokens][hidden]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerResponse {
    /// Request id of the call.
    pub request_id: u64,
    /// Number of tokens.
    pub tokens: u32,
    /// Hidden size.
    pub hidden: u32,
    /// Encoding of the output.
    pub dtype: OutputDtype,
}

/// What a [`Placement`] frame says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum PlacementOp {
    /// Router → worker: hold exactly the listed experts (load the missing ones first, then
    /// drop the rest once every router has seen the new set).
    Hold = 1,
    /// Worker → every router: the experts it serves now, at `version` (sent when a link comes
    /// up and after every change; `message` says why a requested change failed).
    Holding = 2,
    /// Router → worker: this router routes by the worker's `Holding` of `version` from now on
    /// (sent after every dispatch planned on the older set, on the same link).
    Seen = 3,
    /// Frontend → router: apply this placement to the running fabric (every worker rank; a
    /// rank without entries is emptied), within `timeout_ms`.
    Apply = 4,
    /// Router → frontend: the placement of [`PlacementOp::Apply`] `request_id` is served at
    /// `version` (failures are error frames).
    Applied = 5,
    /// Router → worker: announce what you hold to me now, with this `request_id` (a change
    /// starts from every device's answer).
    Survey = 6,
    /// Worker → every router: every router connected when this worker announced its set of
    /// `version` has confirmed it (`Seen`) or lost its link: no router routes by an older set
    /// of this worker any more (a change's next step waits for it).
    Settled = 7,
    /// Worker → router: send me routed expert (layer, expert) of the single entry (its rank
    /// is the asker's), as `request_id`'s stream of `Chunk`s; router → a worker that owns it:
    /// stream it to me (the entry names the owner). A gain in a live change whose weights
    /// are not on the gainer's host is copied from a current owner this way.
    Fetch = 8,
    /// Owner → router → asker: bytes of the stream `request_id` at byte offset `version` (the
    /// payload, `entries` bytes long); `loaded` is 1 on the last chunk; a non-empty `message`
    /// ends the stream with why it failed.
    Chunk = 9,
    /// Asker → router → owner: stream `request_id` has `version` bytes received (the owner
    /// keeps at most a window of unacknowledged bytes in flight, so a slow asker or link
    /// slows the copy instead of queueing it in the router). `version` [`COPY_CANCELLED`]:
    /// router → owner, the asker is gone: stop the stream (or never start it).
    Ack = 10,
}

/// The bytes of a [`PlacementOp::Ack`] that cancels its stream: the router's word to the
/// owner that the asking device is gone (its copy thread would otherwise wait for
/// acknowledgements that never come, and the copies queued behind it with it).
pub const COPY_CANCELLED: u64 = u64::MAX;

impl PlacementOp {
    fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            1 => Self::Hold,
            2 => Self::Holding,
            3 => Self::Seen,
            4 => Self::Apply,
            5 => Self::Applied,
            6 => Self::Survey,
            7 => Self::Settled,
            8 => Self::Fetch,
            9 => Self::Chunk,
            10 => Self::Ack,
            _ => return None,
        })
    }
}

impl Placement {
    /// A `Chunk` that ends stream `request_id` with why it failed (cut to
    /// [`MAX_PLACEMENT_MESSAGE_BYTES`]).
    pub fn chunk_error(request_id: u64, why: &str) -> Self {
        let mut p = Self::new(PlacementOp::Chunk, 0, 0);
        p.request_id = request_id;
        p.message = placement_message(why);
        p
    }
}

/// `message` cut at a character boundary to what a placement frame carries.
pub fn placement_message(message: &str) -> String {
    let mut end = message.len().min(MAX_PLACEMENT_MESSAGE_BYTES);
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    message[..end].to_owned()
}

/// Longest message in a placement frame, in bytes (it fits a frontend's header read).
pub const MAX_PLACEMENT_MESSAGE_BYTES: usize = 2048;

/// Bytes of one placement entry in a payload: mesh rank, layer, expert (u32 each).
pub const PLACEMENT_ENTRY_BYTES: usize = 12;

/// A live placement change (see [`PlacementOp`]). The payload lists `entries`
/// (mesh rank, layer, expert) triples, u32 little endian ([`encode_placement_entries`],
/// [`placement_entries`]); a worker's own lists carry its own rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// What this frame says.
    pub op: PlacementOp,
    /// The frontend's request id (`Apply`, `Applied`), or the survey answered (`Survey`, and
    /// the `Holding` answering it); 0 otherwise.
    pub request_id: u64,
    /// The placement version: every change increases it; a worker refuses an older one.
    pub version: u64,
    /// (rank, layer, expert) triples in the payload; for a `Chunk`, its payload bytes.
    pub entries: u32,
    /// `Apply`: how long the change may take, in milliseconds; `Applied`: how long it took.
    pub millis: u32,
    /// `Applied`: experts loaded over every device.
    pub loaded: u32,
    /// `Applied`: experts released over every device.
    pub released: u32,
    /// Why a change failed (`Holding`), or which releases were not confirmed (`Applied`;
    /// empty when every one was); UTF-8, at most
    /// [`MAX_PLACEMENT_MESSAGE_BYTES`].
    pub message: String,
}

impl Placement {
    /// A frame of `op` with `entries` listed and every other field zero.
    pub fn new(op: PlacementOp, version: u64, entries: usize) -> Self {
        Self {
            op,
            request_id: 0,
            version,
            entries: entries as u32,
            millis: 0,
            loaded: 0,
            released: 0,
            message: String::new(),
        }
    }
}

/// The payload listing `entries` (mesh rank, layer, expert).
pub fn encode_placement_entries(entries: &[(u32, u32, u32)]) -> Vec<u8> {
    let mut out = Vec::with_capacity(entries.len() * PLACEMENT_ENTRY_BYTES);
    for &(r, l, e) in entries {
        out.extend_from_slice(&r.to_le_bytes());
        out.extend_from_slice(&l.to_le_bytes());
        out.extend_from_slice(&e.to_le_bytes());
    }
    out
}

/// The (mesh rank, layer, expert) entries of a placement frame's payload.
pub fn placement_entries(
    p: &Placement,
    payload: &[u8],
) -> Result<Vec<(u32, u32, u32)>, CodecError> {
    let n = p.entries as usize;
    if payload.len() != n.saturating_mul(PLACEMENT_ENTRY_BYTES) {
        return Err(bad(
            FrameKind::Placement,
            format!(
                "{} payload bytes for {n} entries of 12 bytes",
                payload.len()
            ),
        ));
    }
    let u = |b: &[u8]| u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    Ok(payload
        .chunks_exact(PLACEMENT_ENTRY_BYTES)
        .map(|c| (u(&c[0..4]), u(&c[4..8]), u(&c[8..12])))
        .collect())
}

/// The kind-specific part of a frame (everything but the payload).
#[derive(Debug, Clone, PartialEq)]
pub enum Body {
    /// See [`Hello`].
    Hello(Hello),
    /// See [`Auth`].
    Auth(Auth),
    /// See [`LinkInfo`].
    LinkInfo(LinkInfo),
    /// See [`Dispatch`].
    Dispatch(Dispatch),
    /// See [`ExpertResult`].
    Result(ExpertResult),
    /// See [`ErrorFrame`].
    Error(ErrorFrame),
    /// See [`Heartbeat`].
    Heartbeat(Heartbeat),
    /// See [`Credit`].
    Credit(Credit),
    /// See [`LayerRequest`].
    LayerRequest(LayerRequest),
    /// See [`LayerResponse`].
    LayerResponse(LayerResponse),
    /// See [`Placement`].
    Placement(Placement),
}

fn bad(kind: FrameKind, what: impl Into<String>) -> CodecError {
    CodecError::BadMetadata {
        kind,
        what: what.into(),
    }
}

/// Bounds-checked little-endian reader over metadata bytes.
struct Cursor<'a> {
    kind: FrameKind,
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], CodecError> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.bytes.len());
        let Some(end) = end else {
            return Err(bad(
                self.kind,
                format!(
                    "{what}: needs {n} bytes at offset {}, metadata has {}",
                    self.pos,
                    self.bytes.len()
                ),
            ));
        };
        let s = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn u8(&mut self, what: &str) -> Result<u8, CodecError> {
        Ok(self.take(1, what)?[0])
    }
    fn u16(&mut self, what: &str) -> Result<u16, CodecError> {
        let b = self.take(2, what)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    fn u32(&mut self, what: &str) -> Result<u32, CodecError> {
        let b = self.take(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self, what: &str) -> Result<u64, CodecError> {
        let b = self.take(8, what)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
    fn array32(&mut self, what: &str) -> Result<[u8; 32], CodecError> {
        let mut a = [0u8; 32];
        a.copy_from_slice(self.take(32, what)?);
        Ok(a)
    }
    fn finish(&self) -> Result<(), CodecError> {
        if self.pos != self.bytes.len() {
            return Err(bad(
                self.kind,
                format!("{} trailing metadata bytes", self.bytes.len() - self.pos),
            ));
        }
        Ok(())
    }
}

/// The dispatch's compute-mode byte: 0 exact, 1 accurate.
fn mode_u8(m: ComputeMode) -> u8 {
    match m {
        ComputeMode::Exact => 0,
        ComputeMode::Accurate => 1,
    }
}

fn mode_from(kind: FrameKind, v: u8) -> Result<ComputeMode, CodecError> {
    match v {
        0 => Ok(ComputeMode::Exact),
        1 => Ok(ComputeMode::Accurate),
        _ => Err(bad(kind, format!("unknown compute mode {v}"))),
    }
}

fn layout_from(kind: FrameKind, v: u8) -> Result<OutputLayout, CodecError> {
    match v {
        0 => Ok(OutputLayout::PerSlot),
        1 => Ok(OutputLayout::PreCombined),
        _ => Err(bad(kind, format!("unknown output layout {v}"))),
    }
}

fn act_dtype(kind: FrameKind, v: u8) -> Result<ActivationDtype, CodecError> {
    ActivationDtype::from_u8(v).ok_or_else(|| bad(kind, format!("unknown activation dtype {v}")))
}

fn out_dtype(kind: FrameKind, v: u8) -> Result<OutputDtype, CodecError> {
    OutputDtype::from_u8(v).ok_or_else(|| bad(kind, format!("unknown output dtype {v}")))
}

impl Body {
    /// The frame kind of this body.
    pub fn kind(&self) -> FrameKind {
        match self {
            Self::Hello(_) => FrameKind::Hello,
            Self::Auth(_) => FrameKind::Auth,
            Self::LinkInfo(_) => FrameKind::LinkInfo,
            Self::Dispatch(_) => FrameKind::Dispatch,
            Self::Result(_) => FrameKind::Result,
            Self::Error(_) => FrameKind::Error,
            Self::Heartbeat(_) => FrameKind::Heartbeat,
            Self::Credit(_) => FrameKind::Credit,
            Self::LayerRequest(_) => FrameKind::LayerRequest,
            Self::LayerResponse(_) => FrameKind::LayerResponse,
            Self::Placement(_) => FrameKind::Placement,
        }
    }

    /// Request id of request-carrying bodies.
    pub fn request_id(&self) -> Option<u64> {
        match self {
            Self::Dispatch(d) => Some(d.batch_id),
            Self::Result(r) => Some(r.batch_id),
            Self::Error(e) => Some(e.request_id),
            Self::LayerRequest(r) => Some(r.request_id),
            Self::LayerResponse(r) => Some(r.request_id),
            Self::Placement(p) => Some(p.request_id),
            _ => None,
        }
    }

    /// Checks invariants the encoder relies on (string lengths, parallel arrays, shapes).
    pub fn validate(&self) -> Result<(), CodecError> {
        let kind = self.kind();
        match self {
            Self::Hello(h) => {
                if h.cluster.len() > MAX_CLUSTER_NAME_BYTES {
                    return Err(bad(kind, "cluster name longer than 255 bytes"));
                }
                if h.attachment.len() > MAX_ATTACHMENT_BYTES {
                    return Err(bad(kind, "attachment longer than 1024 bytes"));
                }
                if h.identity.len() > MAX_IDENTITY_BYTES {
                    return Err(bad(kind, "frontend name longer than 255 bytes"));
                }
            }
            Self::LinkInfo(l) if l.attachment.len() > MAX_ATTACHMENT_BYTES => {
                return Err(bad(kind, "attachment longer than 1024 bytes"));
            }
            Self::Dispatch(d) => {
                if d.expert_counts.len() != d.tokens as usize {
                    return Err(bad(
                        kind,
                        format!(
                            "{} expert counts for {} tokens",
                            d.expert_counts.len(),
                            d.tokens
                        ),
                    ));
                }
                let pairs: u64 = d.expert_counts.iter().map(|&c| c as u64).sum();
                if pairs != d.experts.len() as u64 || pairs != d.weights.len() as u64 {
                    return Err(bad(
                        kind,
                        format!(
                            "expert counts sum to {pairs} but {} expert ids and {} weights",
                            d.experts.len(),
                            d.weights.len()
                        ),
                    ));
                }
                if pairs > u32::MAX as u64 {
                    return Err(bad(kind, "too many (expert, weight) pairs"));
                }
            }
            Self::Error(e) if e.message.len() > MAX_ERROR_MESSAGE_BYTES => {
                return Err(bad(kind, "error message longer than 4096 bytes"));
            }
            Self::Error(e) if e.part == Some(NO_PART) => {
                return Err(bad(
                    kind,
                    "part 4294967295 stands for \"no part\" on the wire",
                ));
            }
            Self::Placement(p) if p.message.len() > MAX_PLACEMENT_MESSAGE_BYTES => {
                return Err(bad(kind, "placement message longer than 2048 bytes"));
            }
            _ => {}
        }
        Ok(())
    }

    /// Payload bytes this body describes.
    pub fn expected_payload_len(&self) -> Result<u64, CodecError> {
        let kind = self.kind();
        let shape_err = || bad(kind, "shape overflows or hidden size unsupported by dtype");
        Ok(match self {
            Self::Dispatch(d) => d
                .dtype
                .payload_bytes(d.tokens as usize, d.hidden as usize)
                .ok_or_else(shape_err)?,
            Self::Result(r) => (r.rows as u64)
                .checked_mul(r.hidden as u64)
                .and_then(|n| n.checked_mul(r.dtype.elem_bytes() as u64))
                .ok_or_else(shape_err)?,
            Self::LayerRequest(r) => {
                let states = r
                    .dtype
                    .payload_bytes(r.tokens as usize, r.hidden as usize)
                    .ok_or_else(shape_err)?;
                if r.logit_experts == 0 {
                    states
                } else {
                    let logits = (r.tokens as u64)
                        .checked_mul(r.logit_experts as u64)
                        .and_then(|n| n.checked_mul(4))
                        .ok_or_else(shape_err)?;
                    (align_up(states as usize) as u64)
                        .checked_add(logits)
                        .ok_or_else(shape_err)?
                }
            }
            Self::LayerResponse(r) => (r.tokens as u64)
                .checked_mul(r.hidden as u64)
                .and_then(|n| n.checked_mul(r.dtype.elem_bytes() as u64))
                .ok_or_else(shape_err)?,
            // A chunk's payload is its bytes; every other op's, its entries.
            Self::Placement(p) if p.op == PlacementOp::Chunk => u64::from(p.entries),
            Self::Placement(p) => p.entries as u64 * PLACEMENT_ENTRY_BYTES as u64,
            _ => 0,
        })
    }

    /// Bytes of metadata this body encodes to.
    pub fn meta_len(&self) -> usize {
        match self {
            Self::Hello(h) => {
                1 + 1
                    + 2
                    + 4
                    + 4
                    + 8
                    + NONCE_BYTES
                    + 1
                    + h.cluster.len()
                    + 2
                    + h.attachment.len()
                    + 8
                    + FINGERPRINT_BYTES
                    + 1
                    + h.identity.len()
            }
            Self::LinkInfo(l) => 2 + l.attachment.len(),
            Self::Auth(a) => {
                2 + if a.mac.is_some() { NONCE_BYTES } else { 0 }
                    + if a.identity.is_some() {
                        SEALED_IDENTITY_BYTES
                    } else {
                        0
                    }
            }
            Self::Dispatch(d) => {
                8 + 4 * 4 + 4 + 4 + 2 * d.expert_counts.len() + 8 * d.experts.len()
            }
            Self::Result(_) => 8 + 4 + 4 + 4 + 4 + 4,
            Self::Error(e) => 8 + 4 + 2 + 2 + e.message.len(),
            Self::Heartbeat(_) => 16,
            Self::Credit(_) => 8,
            Self::LayerRequest(_) => 8 + 4 + 4 + 4 + 4 + 4 + 8,
            Self::LayerResponse(_) => 8 + 4 + 4 + 4,
            Self::Placement(p) => 4 + 8 + 8 + 4 * 4 + 2 + p.message.len(),
        }
    }

    fn write_meta(&self, out: &mut Vec<u8>) {
        match self {
            Self::Hello(h) => write_hello(h, out),
            Self::LinkInfo(l) => {
                out.extend_from_slice(&(l.attachment.len() as u16).to_le_bytes());
                out.extend_from_slice(&l.attachment);
            }
            Self::Auth(a) => {
                match &a.mac {
                    Some(m) => {
                        out.push(NONCE_BYTES as u8);
                        out.extend_from_slice(m);
                    }
                    None => out.push(0),
                }
                match &a.identity {
                    Some(id) => {
                        out.push(SEALED_IDENTITY_BYTES as u8);
                        out.extend_from_slice(id);
                    }
                    None => out.push(0),
                }
            }
            Self::Dispatch(d) => {
                out.extend_from_slice(&d.batch_id.to_le_bytes());
                out.extend_from_slice(&d.layer.to_le_bytes());
                out.extend_from_slice(&d.part.to_le_bytes());
                out.extend_from_slice(&d.tokens.to_le_bytes());
                out.extend_from_slice(&d.hidden.to_le_bytes());
                out.push(d.dtype as u8);
                out.push(mode_u8(d.mode));
                out.push(layout_u8(d.layout));
                out.push(result_dtype_u8(d.result_dtype));
                out.extend_from_slice(&(d.experts.len() as u32).to_le_bytes());
                for &e in &d.experts {
                    out.extend_from_slice(&e.to_le_bytes());
                }
                for &w in &d.weights {
                    out.extend_from_slice(&w.to_le_bytes());
                }
                for &c in &d.expert_counts {
                    out.extend_from_slice(&c.to_le_bytes());
                }
            }
            Self::Result(r) => {
                out.extend_from_slice(&r.batch_id.to_le_bytes());
                out.extend_from_slice(&r.layer.to_le_bytes());
                out.extend_from_slice(&r.part.to_le_bytes());
                out.extend_from_slice(&r.rows.to_le_bytes());
                out.extend_from_slice(&r.hidden.to_le_bytes());
                out.push(layout_u8(r.layout));
                out.push(r.dtype as u8);
                out.extend_from_slice(&0u16.to_le_bytes());
            }
            Self::Error(e) => {
                out.extend_from_slice(&e.request_id.to_le_bytes());
                out.extend_from_slice(&e.part.unwrap_or(NO_PART).to_le_bytes());
                out.extend_from_slice(&e.code.to_u16().to_le_bytes());
                out.extend_from_slice(&(e.message.len() as u16).to_le_bytes());
                out.extend_from_slice(e.message.as_bytes());
            }
            Self::Heartbeat(h) => {
                out.extend_from_slice(&h.seq.to_le_bytes());
                out.extend_from_slice(&h.sent_at_us.to_le_bytes());
            }
            Self::Credit(c) => out.extend_from_slice(&c.bytes.to_le_bytes()),
            Self::LayerRequest(r) => {
                out.extend_from_slice(&r.request_id.to_le_bytes());
                out.extend_from_slice(&r.layer.to_le_bytes());
                out.extend_from_slice(&r.tokens.to_le_bytes());
                out.extend_from_slice(&r.hidden.to_le_bytes());
                out.push(r.dtype as u8);
                out.extend_from_slice(&[0, 0, 0]);
                out.extend_from_slice(&r.logit_experts.to_le_bytes());
                out.extend_from_slice(&r.deadline_us.to_le_bytes());
            }
            Self::LayerResponse(r) => {
                out.extend_from_slice(&r.request_id.to_le_bytes());
                out.extend_from_slice(&r.tokens.to_le_bytes());
                out.extend_from_slice(&r.hidden.to_le_bytes());
                out.push(r.dtype as u8);
                out.extend_from_slice(&[0, 0, 0]);
            }
            Self::Placement(p) => write_placement(p, out),
        }
    }

    /// Decodes the metadata of a frame of `kind`. Every count is checked against the bytes
    /// present before a vector of that size is allocated.
    pub fn decode_meta(kind: FrameKind, meta: &[u8]) -> Result<Body, CodecError> {
        let mut c = Cursor {
            kind,
            bytes: meta,
            pos: 0,
        };
        let body = match kind {
            FrameKind::Hello => Body::Hello(decode_hello(&mut c)?),
            FrameKind::Auth => Body::Auth(decode_auth(&mut c)?),
            FrameKind::LinkInfo => {
                let n = c.u16("attachment length")? as usize;
                if n > MAX_ATTACHMENT_BYTES {
                    return Err(bad(kind, format!("attachment of {n} bytes exceeds 1024")));
                }
                Body::LinkInfo(LinkInfo {
                    attachment: c.take(n, "attachment")?.to_vec(),
                })
            }
            FrameKind::Dispatch => Body::Dispatch(decode_dispatch(&mut c)?),
            FrameKind::Result => Body::Result(decode_result(&mut c)?),
            FrameKind::Error => Body::Error(decode_error(&mut c)?),
            FrameKind::Heartbeat => Body::Heartbeat(Heartbeat {
                seq: c.u64("sequence")?,
                sent_at_us: c.u64("timestamp")?,
            }),
            FrameKind::Credit => Body::Credit(Credit {
                bytes: c.u64("credit bytes")?,
            }),
            FrameKind::LayerRequest => Body::LayerRequest(decode_layer_request(&mut c)?),
            FrameKind::LayerResponse => Body::LayerResponse(decode_layer_response(&mut c)?),
            FrameKind::Placement => Body::Placement(decode_placement(&mut c)?),
        };
        c.finish()?;
        Ok(body)
    }
}

/// Decodes the metadata of the hello.
fn decode_hello(c: &mut Cursor<'_>) -> Result<Hello, CodecError> {
    let format_version = c.u8("format version")?;
    let auth = c.u8("auth flag")?;
    if auth > 1 {
        return Err(bad(c.kind, format!("auth flag {auth} is not 0 or 1")));
    }
    let _reserved = c.u16("reserved")?;
    let rank = c.u32("rank")?;
    let world_size = c.u32("world size")?;
    let recv_window_bytes = c.u64("receive window")?;
    let nonce = c.array32("nonce")?;
    let name_len = c.u8("cluster name length")? as usize;
    let name = c.take(name_len, "cluster name")?;
    let cluster = std::str::from_utf8(name)
        .map_err(|_| bad(c.kind, "cluster name is not UTF-8"))?
        .to_owned();
    let att_len = c.u16("attachment length")? as usize;
    if att_len > MAX_ATTACHMENT_BYTES {
        return Err(bad(
            c.kind,
            format!("attachment of {att_len} bytes exceeds 1024"),
        ));
    }
    let attachment = c.take(att_len, "attachment")?.to_vec();
    let incarnation = c.u64("incarnation")?;
    let fingerprint = c.array32("fingerprint")?;
    let id_len = c.u8("frontend name length")? as usize;
    let identity = std::str::from_utf8(c.take(id_len, "frontend name")?)
        .map_err(|_| bad(c.kind, "frontend name is not UTF-8"))?
        .to_owned();
    Ok(Hello {
        format_version,
        cluster,
        rank,
        world_size,
        recv_window_bytes,
        auth_required: auth == 1,
        nonce,
        attachment,
        incarnation,
        fingerprint,
        identity,
    })
}

/// Decodes the metadata of an auth answer.
fn decode_auth(c: &mut Cursor<'_>) -> Result<Auth, CodecError> {
    let n = c.u8("mac length")? as usize;
    let mac = match n {
        0 => None,
        NONCE_BYTES => Some(c.array32("mac")?),
        _ => return Err(bad(c.kind, format!("mac length {n} is not 0 or 32"))),
    };
    let n = c.u8("sealed identity length")? as usize;
    let identity = match n {
        0 => None,
        SEALED_IDENTITY_BYTES => {
            let mut id = [0u8; SEALED_IDENTITY_BYTES];
            id.copy_from_slice(c.take(SEALED_IDENTITY_BYTES, "sealed identity")?);
            Some(id)
        }
        _ => {
            return Err(bad(
                c.kind,
                format!("sealed identity length {n} is not 0 or {SEALED_IDENTITY_BYTES}"),
            ));
        }
    };
    Ok(Auth { mac, identity })
}

/// Decodes the metadata of a dispatch (lengths checked before any vector is allocated).
fn decode_dispatch(c: &mut Cursor<'_>) -> Result<Dispatch, CodecError> {
    let request_id = c.u64("request id")?;
    let layer = c.u32("layer")?;
    let part = c.u32("micro-batch")?;
    let tokens = c.u32("token count")?;
    let hidden = c.u32("hidden size")?;
    let dtype = act_dtype(c.kind, c.u8("dtype")?)?;
    let mode = mode_from(c.kind, c.u8("compute mode")?)?;
    let layout = layout_from(c.kind, c.u8("layout")?)?;
    let result_dtype = result_dtype_from(c.kind, c.u8("result dtype")?)?;
    let pairs = c.u32("pair count")? as usize;
    // Lengths first: the rest of the metadata must hold exactly these arrays.
    let need = (pairs as u64) * 8 + (tokens as u64) * 2;
    let have = (c.bytes.len() - c.pos) as u64;
    if need != have {
        return Err(bad(
            c.kind,
            format!(
                "{tokens} tokens and {pairs} pairs need {need} more metadata bytes, {have} present"
            ),
        ));
    }
    let ids = c.take(pairs * 4, "expert ids")?;
    let ws = c.take(pairs * 4, "weights")?;
    let cs = c.take(tokens as usize * 2, "expert counts")?;
    let experts: Vec<u32> = ids
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let weights: Vec<f32> = ws
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let expert_counts: Vec<u16> = cs
        .chunks_exact(2)
        .map(|b| u16::from_le_bytes([b[0], b[1]]))
        .collect();
    let sum: u64 = expert_counts.iter().map(|&x| x as u64).sum();
    if sum != pairs as u64 {
        return Err(bad(
            c.kind,
            format!("per-token expert counts sum to {sum}, header says {pairs} pairs"),
        ));
    }
    Ok(Dispatch {
        batch_id: request_id,
        layer,
        part,
        tokens,
        hidden,
        dtype,
        mode,
        layout,
        result_dtype,
        expert_counts,
        experts,
        weights,
    })
}

/// Decodes the metadata of an expert result.
fn decode_result(c: &mut Cursor<'_>) -> Result<ExpertResult, CodecError> {
    let request_id = c.u64("request id")?;
    let layer = c.u32("layer")?;
    let part = c.u32("micro-batch")?;
    let rows = c.u32("row count")?;
    let hidden = c.u32("hidden size")?;
    let layout = layout_from(c.kind, c.u8("layout")?)?;
    let dtype = out_dtype(c.kind, c.u8("dtype")?)?;
    let _reserved = c.u16("reserved")?;
    Ok(ExpertResult {
        batch_id: request_id,
        layer,
        part,
        layout,
        rows,
        hidden,
        dtype,
    })
}

/// Encodes the metadata of a hello.
fn write_hello(h: &Hello, out: &mut Vec<u8>) {
    out.push(h.format_version);
    out.push(u8::from(h.auth_required));
    out.extend_from_slice(&0u16.to_le_bytes());
    out.extend_from_slice(&h.rank.to_le_bytes());
    out.extend_from_slice(&h.world_size.to_le_bytes());
    out.extend_from_slice(&h.recv_window_bytes.to_le_bytes());
    out.extend_from_slice(&h.nonce);
    out.push(h.cluster.len() as u8);
    out.extend_from_slice(h.cluster.as_bytes());
    out.extend_from_slice(&(h.attachment.len() as u16).to_le_bytes());
    out.extend_from_slice(&h.attachment);
    out.extend_from_slice(&h.incarnation.to_le_bytes());
    out.extend_from_slice(&h.fingerprint);
    out.push(h.identity.len() as u8);
    out.extend_from_slice(h.identity.as_bytes());
}

/// Encodes the metadata of a placement frame.
fn write_placement(p: &Placement, out: &mut Vec<u8>) {
    out.extend_from_slice(&[p.op as u8, 0, 0, 0]);
    out.extend_from_slice(&p.request_id.to_le_bytes());
    out.extend_from_slice(&p.version.to_le_bytes());
    for v in [p.entries, p.millis, p.loaded, p.released] {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out.extend_from_slice(&(p.message.len() as u16).to_le_bytes());
    out.extend_from_slice(p.message.as_bytes());
}

/// Decodes the metadata of a placement frame.
fn decode_placement(c: &mut Cursor<'_>) -> Result<Placement, CodecError> {
    let op = c.u8("placement op")?;
    let op = PlacementOp::from_u8(op)
        .ok_or_else(|| bad(c.kind, format!("unknown placement op {op}")))?;
    c.take(3, "reserved")?;
    let request_id = c.u64("request id")?;
    let version = c.u64("version")?;
    let entries = c.u32("entries")?;
    let millis = c.u32("milliseconds")?;
    let loaded = c.u32("loaded")?;
    let released = c.u32("released")?;
    let n = c.u16("message length")? as usize;
    if n > MAX_PLACEMENT_MESSAGE_BYTES {
        return Err(bad(c.kind, format!("message of {n} bytes exceeds 2048")));
    }
    let message = std::str::from_utf8(c.take(n, "message")?)
        .map_err(|_| bad(c.kind, "message is not UTF-8"))?
        .to_owned();
    Ok(Placement {
        op,
        request_id,
        version,
        entries,
        millis,
        loaded,
        released,
        message,
    })
}

/// Decodes the metadata of an error frame.
fn decode_error(c: &mut Cursor<'_>) -> Result<ErrorFrame, CodecError> {
    let request_id = c.u64("request id")?;
    let part = Some(c.u32("part")?).filter(|&p| p != NO_PART);
    let code = ErrorCode::from_u16(c.u16("error code")?);
    let n = c.u16("message length")? as usize;
    if n > MAX_ERROR_MESSAGE_BYTES {
        return Err(bad(c.kind, format!("message of {n} bytes exceeds 4096")));
    }
    let msg = c.take(n, "message")?;
    let message = std::str::from_utf8(msg)
        .map_err(|_| bad(c.kind, "message is not UTF-8"))?
        .to_owned();
    Ok(ErrorFrame {
        request_id,
        part,
        code,
        message,
    })
}

/// Decodes the metadata of a frontend layer request.
fn decode_layer_request(c: &mut Cursor<'_>) -> Result<LayerRequest, CodecError> {
    let request_id = c.u64("request id")?;
    let layer = c.u32("layer")?;
    let tokens = c.u32("token count")?;
    let hidden = c.u32("hidden size")?;
    let dtype = act_dtype(c.kind, c.u8("dtype")?)?;
    c.take(3, "reserved")?;
    let logit_experts = c.u32("logit experts")?;
    let deadline_us = c.u64("deadline")?;
    Ok(LayerRequest {
        request_id,
        layer,
        tokens,
        hidden,
        dtype,
        logit_experts,
        deadline_us,
    })
}

/// Decodes the metadata of a frontend layer response.
fn decode_layer_response(c: &mut Cursor<'_>) -> Result<LayerResponse, CodecError> {
    let request_id = c.u64("request id")?;
    let tokens = c.u32("token count")?;
    let hidden = c.u32("hidden size")?;
    let dtype = out_dtype(c.kind, c.u8("dtype")?)?;
    c.take(3, "reserved")?;
    Ok(LayerResponse {
        request_id,
        tokens,
        hidden,
        dtype,
    })
}

/// The dispatch's result-dtype byte: 0 is f32 (the byte was reserved and zero before results
/// could be bf16, so older routers' frames keep their meaning), 1 is bf16.
fn result_dtype_u8(d: OutputDtype) -> u8 {
    match d {
        OutputDtype::F32 => 0,
        OutputDtype::Bf16 => 1,
    }
}

fn result_dtype_from(kind: FrameKind, v: u8) -> Result<OutputDtype, CodecError> {
    match v {
        0 => Ok(OutputDtype::F32),
        1 => Ok(OutputDtype::Bf16),
        _ => Err(bad(kind, format!("unknown result dtype {v}"))),
    }
}

fn layout_u8(l: OutputLayout) -> u8 {
    match l {
        OutputLayout::PerSlot => 0,
        OutputLayout::PreCombined => 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dispatch_result_dtype_round_trips_and_zero_means_f32() {
        for result_dtype in [OutputDtype::F32, OutputDtype::Bf16] {
            let body = Body::Dispatch(Dispatch {
                batch_id: 9,
                layer: 1,
                part: 2,
                tokens: 1,
                hidden: 32,
                dtype: ActivationDtype::Q8Block32,
                mode: ComputeMode::Exact,
                layout: OutputLayout::PreCombined,
                result_dtype,
                expert_counts: vec![1],
                experts: vec![3],
                weights: vec![0.5],
            });
            let payload = vec![0u8; body.expected_payload_len().unwrap() as usize];
            let cfg = CodecConfig::default();
            let mut frame = encode_frame(&body, &payload, &cfg).unwrap();
            // The result-dtype byte sits after dtype, mode and layout (metadata offset 27).
            let at = HEADER_LEN + 27;
            assert_eq!(frame[at], u8::from(result_dtype == OutputDtype::Bf16));
            assert_eq!(decode_frame(&frame, &cfg).unwrap().0, body);
            frame[at] = 7; // metadata is not covered by the header checksum
            assert!(matches!(
                decode_frame(&frame, &cfg),
                Err(CodecError::BadMetadata { .. })
            ));
        }
    }

    /// An error frame's part sits after the request id, a little-endian u32 with `NO_PART`
    /// for "none"; `Some(NO_PART)` cannot be written (it would read back as `None`).
    #[test]
    fn an_error_frames_part_is_a_u32_after_the_request_id() {
        let cfg = CodecConfig::default();
        for (part, wire) in [(Some(0), 0u32), (Some(7), 7), (None, NO_PART)] {
            let body = Body::Error(ErrorFrame {
                request_id: 0x0102_0304_0506_0708,
                part,
                code: ErrorCode::NotFound,
                message: "no expert 3 here".into(),
            });
            let frame = encode_frame(&body, &[], &cfg).unwrap();
            let at = HEADER_LEN + 8;
            assert_eq!(frame[at..at + 4], wire.to_le_bytes());
            assert_eq!(
                frame[at + 4..at + 6],
                9u16.to_le_bytes(),
                "the code follows"
            );
            assert_eq!(decode_frame(&frame, &cfg).unwrap().0, body);
        }
        let reserved = Body::Error(ErrorFrame {
            request_id: 1,
            part: Some(NO_PART),
            code: ErrorCode::Internal,
            message: String::new(),
        });
        assert!(matches!(
            encode_frame(&reserved, &[], &cfg),
            Err(CodecError::BadMetadata { .. })
        ));
    }
}
