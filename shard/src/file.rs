//! One shard file: a device's (or the router's) packed-INT4 experts and f32 tensors, written
//! atomically and read back through a bounds-checked memory map.
//!
//! Why this exists: a converted checkpoint is served by many processes, each of which must load
//! exactly its own weights, fast, from a file it did not write and cannot trust blindly. The
//! layout is chosen so that a worker maps the file and copies each matrix straight into its
//! backend; every offset and length is validated before use, so a corrupt or truncated file is
//! an error naming the file, never a panic or an out-of-bounds read.
//!
//! Layout (little-endian, [`FORMAT_VERSION`] 1):
//!
//! ```text
//! [0, 4096)         header page: magic "EMSHARD\0", version u32, kind u32, index_offset u64,
//!                   index_len u64, index_crc32c u32, body_crc32c u32, file_len u64, zeros
//! [4096, index)     blobs: each expert's W13 nibbles start on a 4096-byte page; every other
//!                   blob (scales, zero points, W2, f32 tensors) starts on 64 bytes
//! [index, file_len) the index: JSON (`ShardIndex`): every expert's (layer, expert, sizes,
//!                   blob ranges, relative error) and every tensor's (name, shape, range)
//! ```
//!
//! `body_crc32c` covers `[4096, file_len)` (blobs and index) so a shard can be checked on its
//! own (a resumed conversion does this); the manifest's checksum covers the whole file.
//! [`ShardWriter`] writes to a temporary name beside the final one, syncs it and renames it:
//! a file with the final name is always complete.

use expertmesh_quant::format::{ExpertWeights, FormatError, PackedMatrix, PackedRef, QuantSpec};
use memmap2::Mmap;
use serde::{Deserialize, Serialize};
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};

/// The first eight bytes of every shard file.
pub const MAGIC: [u8; 8] = *b"EMSHARD\0";
/// The version this code writes and reads.
pub const FORMAT_VERSION: u32 = 1;
/// Bytes of the header page; blobs start after it.
pub const HEADER_BYTES: u64 = 4096;
/// Alignment of each expert's first blob.
pub const PAGE: u64 = 4096;
/// Alignment of every other blob.
pub const BLOB_ALIGN: u64 = 64;
/// Largest index accepted when reading (a valid index of a trillion-parameter model's device
/// shard is a few megabytes).
pub const MAX_INDEX_BYTES: u64 = 256 << 20;

/// What a shard holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ShardKind {
    /// One device's routed experts (and the shared experts placed on it).
    Device,
    /// The router's file: gates, correction biases, shared experts.
    Router,
}

impl ShardKind {
    fn code(self) -> u32 {
        match self {
            ShardKind::Device => 1,
            ShardKind::Router => 2,
        }
    }
}

/// Byte range of one blob in the file (`[offset, offset + len)`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Blob {
    /// Offset from the start of the file.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
}

/// Where one packed matrix's arrays are.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MatrixEntry {
    /// Output rows.
    pub rows: u64,
    /// Input columns.
    pub cols: u64,
    /// The nibbles, `rows × cols / 2` bytes.
    pub nibbles: Blob,
    /// The scales, `rows × groups` little-endian 16-bit values.
    pub scales: Blob,
    /// The zero points (`rows × ceil(groups / 2)` bytes) when the format has them.
    pub zeros: Option<Blob>,
}

/// One expert in the index.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ExpertEntry {
    /// Decoder layer index.
    pub layer: u32,
    /// Expert id (routed `0..E`, shared `E + i`).
    pub expert: u32,
    /// Intermediate size.
    pub inter: u64,
    /// Gate and up rows, interleaved.
    pub w13: MatrixEntry,
    /// Down projection.
    pub w2: MatrixEntry,
    /// Relative error `‖w − deq(w)‖₂ / ‖w‖₂` of the conversion (0 for a lossless import).
    pub rel_error: f64,
}

/// Element type of a plain tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TensorDtype {
    /// Little-endian IEEE single precision.
    F32,
    /// Little-endian bfloat16 bits (weights kept at a checkpoint's own precision).
    Bf16,
}

impl TensorDtype {
    /// Bytes per element.
    pub fn size(self) -> u64 {
        match self {
            TensorDtype::F32 => 4,
            TensorDtype::Bf16 => 2,
        }
    }
}

/// One plain tensor (a gate's weight, a correction bias) in the index.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorEntry {
    /// Name, e.g. `layers.3.gate.weight`.
    pub name: String,
    /// Element type.
    pub dtype: TensorDtype,
    /// Shape.
    pub shape: Vec<u64>,
    /// The bytes.
    pub data: Blob,
}

/// The index at the end of a shard.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShardIndex {
    /// What the shard holds.
    pub kind: ShardKind,
    /// The conversion job this shard belongs to (model, placement, source, options): a resumed
    /// conversion keeps a shard only when this matches.
    pub fingerprint: String,
    /// Device id (`node/device`) for device shards.
    pub device: Option<String>,
    /// Packed format of every expert.
    pub quant: QuantSpec,
    /// Hidden size.
    pub hidden: u64,
    /// The experts, in file order.
    pub experts: Vec<ExpertEntry>,
    /// The plain tensors, in file order.
    pub tensors: Vec<TensorEntry>,
}

/// Why a shard could not be written or read. Every message names the file.
#[derive(Debug, thiserror::Error)]
pub enum ShardError {
    /// An I/O error (disk full, permission, missing file).
    #[error("{path}: {what}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What was being done.
        what: &'static str,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// Writing shard `path` failed (its temporary file, removed since): the disk is full, or
    /// the folder is not writable.
    #[error(
        "{}: {what}: {source}; free space on its disk (or let this user write the folder) and run again: shards already finished are kept",
        path.display()
    )]
    Write {
        /// The shard being written (its final name).
        path: PathBuf,
        /// What was being done.
        what: &'static str,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The file is not a valid shard (wrong magic, truncated, bad index, bad ranges).
    #[error("{path}: {reason}; the shard is damaged or not a shard: re-run `expertmesh convert`")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The file's checksum is not the expected one.
    #[error(
        "{path}: checksum mismatch (crc32c {actual:08x}, expected {expected:08x}); the shard is \
         corrupt: re-run `expertmesh convert` to rewrite it"
    )]
    Checksum {
        /// The file.
        path: PathBuf,
        /// The expected checksum.
        expected: u32,
        /// What the file has.
        actual: u32,
    },
    /// A stored matrix does not form a valid packed matrix.
    #[error("{path}: layer {layer} expert {expert}: {source}")]
    Format {
        /// The file.
        path: PathBuf,
        /// Layer.
        layer: u32,
        /// Expert.
        expert: u32,
        /// Why.
        #[source]
        source: FormatError,
    },
    /// A tensor asked for is not in the shard.
    #[error("{path}: no tensor {name:?}; the weights were converted for another model")]
    MissingTensor {
        /// The file.
        path: PathBuf,
        /// The tensor.
        name: String,
    },
}

type Result<T> = std::result::Result<T, ShardError>;

/// Checksums and size of a finished shard.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShardSummary {
    /// File size in bytes.
    pub bytes: u64,
    /// crc32c of the whole file (what the manifest records).
    pub crc32c: u32,
}

/// Writes one shard, streaming blobs to a temporary file; [`ShardWriter::finish`] makes it
/// appear under its final name. Dropping an unfinished writer removes the temporary file.
#[derive(Debug)]
pub struct ShardWriter {
    out: Option<BufWriter<expertmesh_files::Held>>,
    temp: PathBuf,
    path: PathBuf,
    pos: u64,
    body_crc: u32,
    index: ShardIndex,
}

impl ShardWriter {
    /// Start writing the shard that will be `path`.
    pub fn create(path: &Path, index: ShardIndex) -> Result<Self> {
        let temp = expertmesh_files::temp_path(path);
        // Locked while it is written: a sweep of the folder leaves it alone.
        let file =
            expertmesh_files::create_locked(&temp, None).map_err(|source| ShardError::Write {
                path: path.to_path_buf(),
                what: "creating its temporary file",
                source,
            })?;
        let mut w = Self {
            out: Some(BufWriter::with_capacity(1 << 20, file)),
            temp,
            path: path.to_path_buf(),
            pos: 0,
            body_crc: 0,
            index: ShardIndex {
                experts: Vec::new(),
                tensors: Vec::new(),
                ..index
            },
        };
        w.write_raw(&[0u8; HEADER_BYTES as usize])?;
        w.body_crc = 0;
        Ok(w)
    }

    fn io(&self, what: &'static str) -> impl FnOnce(std::io::Error) -> ShardError + '_ {
        move |source| ShardError::Write {
            path: self.path.clone(),
            what,
            source,
        }
    }

    fn write_raw(&mut self, bytes: &[u8]) -> Result<()> {
        let out = self.out.as_mut().expect("writer used after finish");
        if let Err(source) = out.write_all(bytes) {
            return Err(ShardError::Write {
                path: self.path.clone(),
                what: "writing",
                source,
            });
        }
        self.body_crc = crc32c::crc32c_append(self.body_crc, bytes);
        self.pos += bytes.len() as u64;
        Ok(())
    }

    fn pad_to(&mut self, align: u64) -> Result<()> {
        let pad = self.pos.next_multiple_of(align) - self.pos;
        const ZEROS: [u8; PAGE as usize] = [0; PAGE as usize];
        self.write_raw(&ZEROS[..pad as usize])
    }

    fn blob(&mut self, bytes: &[u8], align: u64) -> Result<Blob> {
        self.pad_to(align)?;
        let offset = self.pos;
        self.write_raw(bytes)?;
        Ok(Blob {
            offset,
            len: bytes.len() as u64,
        })
    }

    fn matrix(&mut self, m: &PackedMatrix, first_align: u64) -> Result<MatrixEntry> {
        let nibbles = self.blob(m.nibbles(), first_align)?;
        let scales: Vec<u8> = m.scales().iter().flat_map(|s| s.to_le_bytes()).collect();
        let scales = self.blob(&scales, BLOB_ALIGN)?;
        let zeros = match m.zeros() {
            Some(z) => Some(self.blob(z, BLOB_ALIGN)?),
            None => None,
        };
        Ok(MatrixEntry {
            rows: m.rows() as u64,
            cols: m.cols() as u64,
            nibbles,
            scales,
            zeros,
        })
    }

    /// Append expert `(layer, expert)`.
    pub fn add_expert(
        &mut self,
        layer: u32,
        expert: u32,
        w: &ExpertWeights,
        rel_error: f64,
    ) -> Result<()> {
        let w13 = self.matrix(w.w13(), PAGE)?;
        let w2 = self.matrix(w.w2(), BLOB_ALIGN)?;
        self.index.experts.push(ExpertEntry {
            layer,
            expert,
            inter: w.inter() as u64,
            w13,
            w2,
            rel_error,
        });
        Ok(())
    }

    /// Append an f32 tensor.
    pub fn add_tensor_f32(&mut self, name: &str, shape: &[u64], data: &[f32]) -> Result<()> {
        let bytes: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.add_tensor(name, TensorDtype::F32, shape, &bytes)
    }

    /// Append a bf16 tensor (its bits).
    pub fn add_tensor_bf16(&mut self, name: &str, shape: &[u64], bits: &[u16]) -> Result<()> {
        let bytes: Vec<u8> = bits.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.add_tensor(name, TensorDtype::Bf16, shape, &bytes)
    }

    fn add_tensor(
        &mut self,
        name: &str,
        dtype: TensorDtype,
        shape: &[u64],
        bytes: &[u8],
    ) -> Result<()> {
        let data = self.blob(bytes, BLOB_ALIGN)?;
        self.index.tensors.push(TensorEntry {
            name: name.to_string(),
            dtype,
            shape: shape.to_vec(),
            data,
        });
        Ok(())
    }

    /// Write the index and header, sync, and rename the file to its final name. On error the
    /// temporary file is removed and nothing appears under the final name.
    pub fn finish(mut self) -> Result<ShardSummary> {
        let result = self.finish_inner();
        if result.is_err() {
            let _ = std::fs::remove_file(&self.temp);
        }
        result
    }

    fn finish_inner(&mut self) -> Result<ShardSummary> {
        let json = serde_json::to_vec(&self.index).expect("the index serializes");
        self.pad_to(BLOB_ALIGN)?;
        let index_offset = self.pos;
        self.write_raw(&json)?;
        let file_len = self.pos;
        let mut header = [0u8; HEADER_BYTES as usize];
        header[0..8].copy_from_slice(&MAGIC);
        header[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        header[12..16].copy_from_slice(&self.index.kind.code().to_le_bytes());
        header[16..24].copy_from_slice(&index_offset.to_le_bytes());
        header[24..32].copy_from_slice(&(json.len() as u64).to_le_bytes());
        header[32..36].copy_from_slice(&crc32c::crc32c(&json).to_le_bytes());
        header[36..40].copy_from_slice(&self.body_crc.to_le_bytes());
        header[40..48].copy_from_slice(&file_len.to_le_bytes());
        let out = self.out.take().expect("finish once");
        let mut file = out
            .into_inner()
            .map_err(|e| e.into_error())
            .map_err(self.io("writing"))?;
        file.seek(SeekFrom::Start(0)).map_err(self.io("seeking"))?;
        file.write_all(&header).map_err(self.io("writing"))?;
        file.sync_all().map_err(self.io("syncing"))?;
        // Renamed while still locked (the lock goes with `file`).
        std::fs::rename(&self.temp, &self.path).map_err(|source| ShardError::Write {
            path: self.path.clone(),
            what: "renaming the finished shard into place",
            source,
        })?;
        drop(file);
        expertmesh_files::sync_parent(&self.path);
        let body_len = (file_len - HEADER_BYTES) as usize;
        Ok(ShardSummary {
            bytes: file_len,
            crc32c: crc32c::crc32c_combine(crc32c::crc32c(&header), self.body_crc, body_len),
        })
    }
}

impl Drop for ShardWriter {
    fn drop(&mut self) {
        if self.out.take().is_some() {
            let _ = std::fs::remove_file(&self.temp);
        }
    }
}

/// A shard opened for reading: mapped, header and index validated.
#[derive(Debug)]
pub struct ShardFile {
    path: PathBuf,
    map: Mmap,
    index: ShardIndex,
    body_crc: u32,
    /// The mapped file's identity (`fstat` of the descriptor mapped, not of the path, which
    /// may name another file by now).
    identity: FileIdentity,
}

/// Which file a [`ShardFile`] mapped, as `fstat` saw it when it was opened: a file rewritten
/// or replaced since has another identity (size, time or inode), even if its checksum
/// collides with the old one's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileIdentity {
    /// Size in bytes.
    pub bytes: u64,
    /// Last modification, seconds since the epoch and nanoseconds.
    pub modified: (i64, i64),
    /// The file system's device and the file's inode (0 where the platform has none).
    pub device_inode: (u64, u64),
}

impl FileIdentity {
    /// The identity `meta` (of an open file, or of a path) says.
    pub fn of(meta: &std::fs::Metadata) -> Self {
        #[cfg(unix)]
        {
            use std::os::unix::fs::MetadataExt;
            Self {
                bytes: meta.len(),
                modified: (meta.mtime(), meta.mtime_nsec()),
                device_inode: (meta.dev(), meta.ino()),
            }
        }
        #[cfg(not(unix))]
        {
            let modified = meta
                .modified()
                .ok()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map_or((0, 0), |d| {
                    (d.as_secs() as i64, i64::from(d.subsec_nanos()))
                });
            Self {
                bytes: meta.len(),
                modified,
                device_inode: (0, 0),
            }
        }
    }
}

impl ShardFile {
    /// Map `path` and validate its header, index and every blob range (not the checksum: see
    /// [`ShardFile::verify`]).
    pub fn open(path: &Path) -> Result<Self> {
        // Not blocking on a FIFO put where a shard should be; a regular file, checked below.
        let file = expertmesh_files::open_nonblocking(path).map_err(|source| ShardError::Io {
            path: path.to_path_buf(),
            what: "opening",
            source,
        })?;
        if !file.metadata().is_ok_and(|m| m.is_file()) {
            return Err(ShardError::Io {
                path: path.to_path_buf(),
                what: "opening",
                source: std::io::Error::other("not a regular file (a device, pipe or folder)"),
            });
        }
        // SAFETY: the map is read-only; a concurrent truncation by another process is the one
        // hazard of every mmap reader; shards are never modified in place (writers rename).
        let map = unsafe { Mmap::map(&file) }.map_err(|source| ShardError::Io {
            path: path.to_path_buf(),
            what: "mapping",
            source,
        })?;
        let identity = file
            .metadata()
            .map(|m| FileIdentity::of(&m))
            .map_err(|source| ShardError::Io {
                path: path.to_path_buf(),
                what: "reading the metadata of",
                source,
            })?;
        let (index, body_crc) = parse(&map).map_err(|reason| ShardError::Corrupt {
            path: path.to_path_buf(),
            reason,
        })?;
        Ok(Self {
            path: path.to_path_buf(),
            map,
            index,
            body_crc,
            identity,
        })
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Which file was mapped, taken from its descriptor when it was opened.
    pub fn identity(&self) -> FileIdentity {
        self.identity
    }

    /// The index.
    pub fn index(&self) -> &ShardIndex {
        &self.index
    }

    /// Size in bytes.
    pub fn len(&self) -> u64 {
        self.map.len() as u64
    }

    /// Whether the file is empty (never true for an opened shard).
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// crc32c of the whole file (one pass over it).
    pub fn crc32c(&self) -> u32 {
        crc32c::crc32c(&self.map)
    }

    /// Check the body against the header's checksum, and the whole file against `expected`
    /// (the manifest's) when given.
    pub fn verify(&self, expected: Option<u32>) -> Result<()> {
        let actual = self.verified_crc32c()?;
        match expected {
            Some(expected) if actual != expected => Err(ShardError::Checksum {
                path: self.path.clone(),
                expected,
                actual,
            }),
            _ => Ok(()),
        }
    }

    /// Check the body against the header's checksum and return the whole file's crc32c (what
    /// [`ShardFile::crc32c`] gives), in one pass over the file.
    pub fn verified_crc32c(&self) -> Result<u32> {
        let head = &self.map[..HEADER_BYTES as usize];
        let body = &self.map[HEADER_BYTES as usize..];
        let body_crc = crc32c::crc32c(body);
        if body_crc != self.body_crc {
            return Err(ShardError::Checksum {
                path: self.path.clone(),
                expected: self.body_crc,
                actual: body_crc,
            });
        }
        Ok(crc32c::crc32c_combine(
            crc32c::crc32c(head),
            body_crc,
            body.len(),
        ))
    }

    fn bytes(&self, b: Blob) -> &[u8] {
        // Ranges were validated by `parse`.
        &self.map[b.offset as usize..(b.offset + b.len) as usize]
    }

    fn packed(&self, what: &'static str, e: &ExpertEntry, m: &MatrixEntry) -> Result<PackedMatrix> {
        let (rows, cols) = (m.rows as usize, m.cols as usize);
        let zeros = m.zeros.map(|b| self.bytes(b));
        PackedMatrix::from_le_parts(
            what,
            self.index.quant,
            rows,
            cols,
            self.bytes(m.nibbles),
            self.bytes(m.scales),
            zeros,
        )
        .map_err(|source| ShardError::Format {
            path: self.path.clone(),
            layer: e.layer,
            expert: e.expert,
            source,
        })
    }

    /// Expert `i` of the index as `(W13, W2)` borrowed from the map (no copy).
    pub fn expert_ref(&self, i: usize) -> Result<(PackedRef<'_>, PackedRef<'_>)> {
        let e = &self.index.experts[i];
        let view = |what, m: &MatrixEntry| {
            PackedRef::new(
                what,
                self.index.quant,
                m.rows as usize,
                m.cols as usize,
                self.bytes(m.nibbles),
                self.bytes(m.scales),
                m.zeros.map(|b| self.bytes(b)),
            )
            .map_err(|source| ShardError::Format {
                path: self.path.clone(),
                layer: e.layer,
                expert: e.expert,
                source,
            })
        };
        Ok((view("W13", &e.w13)?, view("W2", &e.w2)?))
    }

    /// Expert `i` of the index, copied out of the map into packed matrices.
    pub fn expert(&self, i: usize) -> Result<ExpertWeights> {
        let e = &self.index.experts[i];
        let w13 = self.packed("W13", e, &e.w13)?;
        let w2 = self.packed("W2", e, &e.w2)?;
        ExpertWeights::new(w13, w2).map_err(|source| ShardError::Format {
            path: self.path.clone(),
            layer: e.layer,
            expert: e.expert,
            source,
        })
    }

    /// Whether the shard holds a tensor `name`.
    pub fn has_tensor(&self, name: &str) -> bool {
        self.index.tensors.iter().any(|t| t.name == name)
    }

    /// The tensor `name` (f32, or bf16 widened exactly) and its shape.
    pub fn tensor_f32(&self, name: &str) -> Result<(Vec<u64>, Vec<f32>)> {
        let t = self
            .index
            .tensors
            .iter()
            .find(|t| t.name == name)
            .ok_or_else(|| ShardError::MissingTensor {
                path: self.path.clone(),
                name: name.to_string(),
            })?;
        let bytes = self.bytes(t.data);
        let values = match t.dtype {
            TensorDtype::F32 => bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            TensorDtype::Bf16 => bytes
                .chunks_exact(2)
                .map(|c| f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16))
                .collect(),
        };
        Ok((t.shape.clone(), values))
    }
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// Validate the header and index of a whole shard's bytes; returns the index and the body
/// checksum the header records. Never panics, whatever the bytes.
pub fn parse(bytes: &[u8]) -> std::result::Result<(ShardIndex, u32), String> {
    let len = bytes.len() as u64;
    if len < HEADER_BYTES {
        return Err(format!(
            "{len} bytes, shorter than the {HEADER_BYTES}-byte header (truncated?)"
        ));
    }
    if bytes[..8] != MAGIC {
        return Err("no EMSHARD magic: not a shard file".into());
    }
    let version = u32_at(bytes, 8);
    if version != FORMAT_VERSION {
        return Err(format!(
            "format version {version}; this build reads version {FORMAT_VERSION}"
        ));
    }
    let (index_offset, index_len) = (u64_at(bytes, 16), u64_at(bytes, 24));
    let (index_crc, body_crc, file_len) = (u32_at(bytes, 32), u32_at(bytes, 36), u64_at(bytes, 40));
    if file_len != len {
        return Err(format!(
            "the header says {file_len} bytes but the file has {len} (truncated or appended to)"
        ));
    }
    if index_len > MAX_INDEX_BYTES
        || index_offset < HEADER_BYTES
        || index_offset.checked_add(index_len) != Some(len)
    {
        return Err(format!(
            "index at {index_offset}+{index_len} does not end the {len}-byte file"
        ));
    }
    let json = &bytes[index_offset as usize..];
    if crc32c::crc32c(json) != index_crc {
        return Err("index checksum mismatch".into());
    }
    let index: ShardIndex =
        serde_json::from_slice(json).map_err(|e| format!("index is not valid: {e}"))?;
    if index.kind.code() != u32_at(bytes, 12) {
        return Err("the header's kind and the index's kind differ".into());
    }
    check_ranges(&index, index_offset)?;
    Ok((index, body_crc))
}

/// Every blob within `[HEADER_BYTES, end)`, 2-byte scales and 4-byte tensors aligned, lengths
/// matching the shapes.
fn check_ranges(index: &ShardIndex, end: u64) -> std::result::Result<(), String> {
    let within = |b: Blob, what: &str, align: u64| -> std::result::Result<Range<u64>, String> {
        let stop = b.offset.checked_add(b.len).filter(|&s| s <= end);
        match stop {
            Some(s) if b.offset >= HEADER_BYTES && b.offset % align == 0 => Ok(b.offset..s),
            _ => Err(format!(
                "{what} at {}+{} is outside the data region or misaligned",
                b.offset, b.len
            )),
        }
    };
    let q = index.quant;
    q.validate().map_err(|e| format!("index quant: {e}"))?;
    for e in &index.experts {
        // The matrices are what the entry's sizes say (readers size buffers from `inter`).
        let w13 = e.inter.checked_mul(2).map(|r| (r, index.hidden));
        if w13 != Some((e.w13.rows, e.w13.cols))
            || (e.w2.rows, e.w2.cols) != (index.hidden, e.inter)
        {
            return Err(format!(
                "layer {} expert {}: W13 {}x{} and W2 {}x{} are not the [2*{}, {}] and [{}, {}] \
                 its intermediate size {} and the hidden size {} make",
                e.layer,
                e.expert,
                e.w13.rows,
                e.w13.cols,
                e.w2.rows,
                e.w2.cols,
                e.inter,
                index.hidden,
                index.hidden,
                e.inter,
                e.inter,
                index.hidden
            ));
        }
        for (name, m) in [("W13", &e.w13), ("W2", &e.w2)] {
            let what = format!("layer {} expert {} {name}", e.layer, e.expert);
            let groups = m.cols.checked_div(u64::from(q.group_size)).unwrap_or(0);
            let nib = m.rows.checked_mul(m.cols).map(|x| x / 2);
            let sc = m.rows.checked_mul(groups).and_then(|x| x.checked_mul(2));
            if nib != Some(m.nibbles.len) || sc != Some(m.scales.len) {
                return Err(format!(
                    "{what}: blob sizes do not match {}x{}",
                    m.rows, m.cols
                ));
            }
            within(m.nibbles, &what, 1)?;
            within(m.scales, &what, 2)?;
            if let Some(z) = m.zeros {
                within(z, &what, 1)?;
            }
        }
    }
    for t in &index.tensors {
        let n = t
            .shape
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .and_then(|n| n.checked_mul(t.dtype.size()));
        if n != Some(t.data.len) {
            return Err(format!("tensor {}: size does not match its shape", t.name));
        }
        within(t.data, &t.name, t.dtype.size())?;
    }
    Ok(())
}
