//! Copying one routed expert from the device that owns it to a device that gains it: the
//! bytes on the wire and their reassembly (sans-IO).
//!
//! Why this exists: in a live placement change a gaining device reads its new experts from
//! its host's converted weights; on a cluster whose hosts each hold only their own devices'
//! shards (`expertmesh deploy`'s per-host folders) the weights of an expert it gains may be on
//! another host only. Then it asks the coordinating router for the expert (`Fetch`), the
//! router asks a current owner, and the owner streams the packed expert back through the
//! router (`Chunk` frames, [`CHUNK_BYTES`] each, paced at [`FETCH_BYTES_PER_S`] and at most
//! [`WINDOW_BYTES`] ahead of the gainer's `Ack`s, so serving goes on and nothing piles up in
//! the router; weights move once per change, never per token). The owner reads the expert from
//! its own host's shard, checked against the manifest's checksum as at start, or, when it was
//! copied the expert itself, sends the stream it kept (`io::CopyCache`); the stream ends with
//! a CRC-32C of everything before it, so a damaged copy fails the load.
//!
//! The stream: `EMXF`, version 1, the key, the shapes and the packed format, the six array
//! lengths (u64), the arrays (W13 nibbles, scales, zero points; W2 the same), then the
//! CRC-32C (all little-endian). Every length is checked against the shapes before anything
//! is allocated, and [`Assembly`] refuses a stream longer than the gainer expects.

use expertmesh_backend::ExpertKey;
use expertmesh_quant::format::{ExpertWeights, PackedMatrix, QuantSpec, ScaleDtype};

/// Bytes per `Chunk` frame.
pub const CHUNK_BYTES: usize = 1 << 20;

/// Bytes an owner sends ahead of the gainer's acknowledgements (a slow gainer or link slows
/// the copy; nothing queues up in the router).
pub const WINDOW_BYTES: usize = 4 * CHUNK_BYTES;

// A chunk must fit the worker mesh's frames.
const _: () = assert!(CHUNK_BYTES + 4096 < crate::deploy::MAX_FRAME_BYTES);

/// The most an owner streams per second for one fetch (serving goes on meanwhile).
pub const FETCH_BYTES_PER_S: f64 = 2e9;

const MAGIC: &[u8; 4] = b"EMXF";
const VERSION: u32 = 1;
/// Magic, version, layer, expert, hidden, inter, group (u32 each), scale type and zero
/// points (u8 each), two bytes of padding, six lengths (u64 each).
const HEADER_BYTES: usize = 4 + 6 * 4 + 4 + 6 * 8;

/// Why a fetched expert cannot be used.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FetchError {
    /// The stream is not an expert of this format.
    #[error("the fetched expert is malformed: {0}")]
    Malformed(String),
    /// The bytes do not match their checksum.
    #[error("the fetched expert's checksum does not match (damaged in transit)")]
    Checksum,
    /// The stream is another expert or another shape than asked.
    #[error("the fetched expert is {got}, not the {want} asked for")]
    Mismatch {
        /// What arrived.
        got: String,
        /// What was asked.
        want: String,
    },
}

/// The stream of `weights` as routed expert `key`.
pub fn encode_expert(key: ExpertKey, weights: &ExpertWeights) -> Vec<u8> {
    let spec = weights.spec();
    let (w13, w2) = (weights.w13(), weights.w2());
    let scales =
        |m: &PackedMatrix| -> Vec<u8> { m.scales().iter().flat_map(|s| s.to_le_bytes()).collect() };
    let arrays: [Vec<u8>; 6] = [
        w13.nibbles().to_vec(),
        scales(w13),
        w13.zeros().unwrap_or_default().to_vec(),
        w2.nibbles().to_vec(),
        scales(w2),
        w2.zeros().unwrap_or_default().to_vec(),
    ];
    let mut out = Vec::with_capacity(HEADER_BYTES + arrays.iter().map(Vec::len).sum::<usize>() + 4);
    out.extend_from_slice(MAGIC);
    for v in [
        VERSION,
        key.layer,
        key.expert,
        weights.hidden() as u32,
        weights.inter() as u32,
        spec.group_size,
    ] {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out.push(match spec.scale_dtype {
        ScaleDtype::F16 => 0,
        ScaleDtype::Bf16 => 1,
    });
    out.push(u8::from(spec.zero_points));
    out.extend_from_slice(&[0, 0]);
    for a in &arrays {
        out.extend_from_slice(&(a.len() as u64).to_le_bytes());
    }
    for a in &arrays {
        out.extend_from_slice(a);
    }
    let crc = crc32c::crc32c(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

/// The expert in `bytes`, which must be `want` (its key, hidden and intermediate sizes).
///
/// # Errors
/// A malformed or damaged stream, or another expert or shape than `want`.
pub fn decode_expert(
    bytes: &[u8],
    want: ExpertKey,
    hidden: usize,
    inter: usize,
) -> Result<ExpertWeights, FetchError> {
    let bad = |m: &str| FetchError::Malformed(m.to_owned());
    if bytes.len() < HEADER_BYTES + 4 {
        return Err(bad("shorter than its header"));
    }
    let (body, crc) = bytes.split_at(bytes.len() - 4);
    if crc32c::crc32c(body) != u32::from_le_bytes(crc.try_into().expect("4 bytes")) {
        return Err(FetchError::Checksum);
    }
    let Header {
        key,
        hidden: h,
        inter: n,
        spec,
        lens,
    } = parse_header(body)?;
    if key != want || (h, n) != (hidden, inter) {
        return Err(FetchError::Mismatch {
            got: format!(
                "layer {} expert {} (hidden {h}, intermediate {n})",
                key.layer, key.expert
            ),
            want: format!(
                "layer {} expert {} (hidden {hidden}, intermediate {inter})",
                want.layer, want.expert
            ),
        });
    }
    let zero_points = spec.zero_points;
    let total = lens
        .iter()
        .try_fold(HEADER_BYTES, |a, &l| a.checked_add(l))
        .ok_or_else(|| bad("array lengths overflow"))?;
    if total != body.len() {
        return Err(bad(&format!(
            "{} bytes of arrays announced, {} present",
            total - HEADER_BYTES,
            body.len() - HEADER_BYTES
        )));
    }
    let mut at = HEADER_BYTES;
    let mut next = |len: usize| {
        let s = &body[at..at + len];
        at += len;
        s
    };
    let (n13, s13, z13) = (next(lens[0]), next(lens[1]), next(lens[2]));
    let (n2, s2, z2) = (next(lens[3]), next(lens[4]), next(lens[5]));
    // (`from_le_parts` checks every length against the shapes.)
    let w13 = PackedMatrix::from_le_parts(
        "fetched W13",
        spec,
        2 * inter,
        hidden,
        n13,
        s13,
        zero_points.then_some(z13),
    )
    .map_err(|e| bad(&e.to_string()))?;
    let w2 = PackedMatrix::from_le_parts(
        "fetched W2",
        spec,
        hidden,
        inter,
        n2,
        s2,
        zero_points.then_some(z2),
    )
    .map_err(|e| bad(&e.to_string()))?;
    ExpertWeights::new(w13, w2).map_err(|e| bad(&e.to_string()))
}

/// What a stream's header says.
struct Header {
    key: ExpertKey,
    hidden: usize,
    inter: usize,
    spec: QuantSpec,
    /// The six arrays' lengths, in stream order.
    lens: [usize; 6],
}

/// The header of `body` (a stream without its checksum, at least [`HEADER_BYTES`] long).
fn parse_header(body: &[u8]) -> Result<Header, FetchError> {
    let bad = |m: &str| FetchError::Malformed(m.to_owned());
    if &body[..4] != MAGIC {
        return Err(bad("no EMXF magic"));
    }
    let u32_at = |i: usize| u32::from_le_bytes(body[4 + 4 * i..8 + 4 * i].try_into().expect("4"));
    if u32_at(0) != VERSION {
        return Err(bad(&format!(
            "stream version {} (this build reads 1)",
            u32_at(0)
        )));
    }
    let key = ExpertKey {
        layer: u32_at(1),
        expert: u32_at(2),
    };
    let (h, n) = (u32_at(3) as usize, u32_at(4) as usize);
    let scale_dtype = match body[28] {
        0 => ScaleDtype::F16,
        1 => ScaleDtype::Bf16,
        x => return Err(bad(&format!("scale type {x}"))),
    };
    let zero_points = match body[29] {
        0 => false,
        1 => true,
        x => return Err(bad(&format!("zero-point flag {x}"))),
    };
    let spec = QuantSpec {
        group_size: u32_at(5),
        scale_dtype,
        zero_points,
    };
    spec.validate()
        .map_err(|e| bad(&format!("packed format: {e}")))?;
    let mut lens = [0usize; 6];
    for (i, l) in lens.iter_mut().enumerate() {
        let at = 32 + 8 * i;
        let v = u64::from_le_bytes(body[at..at + 8].try_into().expect("8"));
        *l = usize::try_from(v).map_err(|_| bad("an array length over the address space"))?;
    }
    Ok(Header {
        key,
        hidden: h,
        inter: n,
        spec,
        lens,
    })
}

/// Reassembles one stream from chunks that may arrive in any order (a relay may reorder
/// them), holding at most `max_bytes`.
#[derive(Debug)]
pub struct Assembly {
    max_bytes: usize,
    bytes: Vec<u8>,
    /// Byte ranges received, merged, ascending.
    have: Vec<(usize, usize)>,
    /// The stream's length, once its last chunk arrived.
    total: Option<usize>,
}

impl Assembly {
    /// An empty stream of at most `max_bytes`.
    pub fn new(max_bytes: usize) -> Self {
        Self {
            max_bytes,
            bytes: Vec::new(),
            have: Vec::new(),
            total: None,
        }
    }

    /// Takes the chunk at byte `offset` (`last`: it ends the stream). Returns the whole
    /// stream once every byte up to the end arrived.
    ///
    /// # Errors
    /// A chunk past `max_bytes`, past the stream's end, overlapping another with other bytes,
    /// or a second end.
    pub fn add(
        &mut self,
        offset: u64,
        data: &[u8],
        last: bool,
    ) -> Result<Option<Vec<u8>>, FetchError> {
        let bad = |m: String| Err(FetchError::Malformed(m));
        let start = usize::try_from(offset).unwrap_or(usize::MAX);
        let end = start.saturating_add(data.len());
        if end > self.max_bytes {
            return bad(format!(
                "a chunk ends at byte {end}, past the {} bytes expected for this expert",
                self.max_bytes
            ));
        }
        if let Some(t) = self.total
            && (end > t || last)
        {
            return bad(format!(
                "a chunk at {start}..{end} after the stream's end at {t}"
            ));
        }
        if last {
            if self.have.iter().any(|&(_, e)| e > end) {
                return bad(format!(
                    "the stream ends at {end}, before bytes already received"
                ));
            }
            self.total = Some(end);
        }
        if self.bytes.len() < end {
            self.bytes.resize(end, 0);
        }
        for &(s, e) in &self.have {
            let (lo, hi) = (s.max(start), e.min(end));
            if lo < hi && self.bytes[lo..hi] != data[lo - start..hi - start] {
                return bad(format!("chunks overlap at {lo}..{hi} with other bytes"));
            }
        }
        self.bytes[start..end].copy_from_slice(data);
        self.have.push((start, end));
        self.have.sort_unstable();
        let mut merged: Vec<(usize, usize)> = Vec::with_capacity(self.have.len());
        for &(s, e) in &self.have {
            match merged.last_mut() {
                Some(m) if s <= m.1 => m.1 = m.1.max(e),
                _ => merged.push((s, e)),
            }
        }
        self.have = merged;
        match self.total {
            Some(t) if self.have.first() == Some(&(0, t)) || t == 0 => {
                Ok(Some(std::mem::take(&mut self.bytes)))
            }
            _ => Ok(None),
        }
    }
}

/// The most bytes the stream of an expert of these sizes can have (an [`Assembly`]'s bound):
/// the packed arrays with zero points (at most a byte per group, plus a row's padding), the
/// header and the checksum.
pub fn max_stream_bytes(hidden: usize, inter: usize, group: usize) -> usize {
    let weights = 3 * hidden * inter;
    let groups = weights / group.max(1);
    let rows = 2 * inter + hidden;
    HEADER_BYTES + weights / 2 + 3 * groups + rows + 4
}

pub(crate) mod io;

#[cfg(test)]
mod tests;
