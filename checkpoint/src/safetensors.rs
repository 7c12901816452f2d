//! The safetensors format: one file's header and tensors (memory-mapped, zero copy), a
//! checkpoint folder of one or many such files, and a small writer.
//!
//! Layout of a file: an 8-byte little-endian `u64` header length `N`, then `N` bytes of UTF-8
//! JSON mapping each tensor name to `{"dtype", "shape", "data_offsets": [begin, end]}` (offsets
//! relative to the first byte after the header) plus an optional `"__metadata__"` object of
//! strings, then the tensor data.
//!
//! Real checkpoints are hundreds of GB, so nothing here reads a whole file: [`SafetensorsFile`]
//! maps the file read-only, validates the header against the file's length (every tensor's
//! dtype, size and offsets; no two tensors overlapping), and hands out [`TensorView`]s that
//! borrow the mapped bytes. A view converts to `f32` into the caller's buffer, whole or a range
//! of rows at a time ([`TensorView::rows`], [`TensorView::row_chunks`]), so memory stays bounded
//! by the caller's chunk size; the page cache holds the rest.
//!
//! [`Checkpoint`] is a folder: `model.safetensors.index.json` (a weight map of tensor → file) or
//! a single `model.safetensors`. [`write_safetensors`] writes a valid file atomically, for
//! tests and tools.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::ops::Range;
use std::path::{Component, Path, PathBuf};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

use half::{bf16, f16};
use memmap2::Mmap;
use serde::de::{Deserializer, MapAccess, Visitor};
use serde::{Deserialize, Serialize};

/// The largest header this reader accepts (100 MB); real headers are a few MB at most.
pub const MAX_HEADER_LEN: u64 = 100_000_000;

/// The file name of a multi-file checkpoint's index.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// The file name of a single-file checkpoint.
pub const SINGLE_FILE: &str = "model.safetensors";

/// The name [`parse_header`] gives in its errors, having no file.
const IN_MEMORY: &str = "<in-memory header>";

/// A result of this module.
pub type Result<T, E = SafetensorsError> = std::result::Result<T, E>;

/// An element type of a safetensors tensor (the byte-sized ones of the format).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Dtype {
    /// Boolean, one byte.
    Bool,
    /// Unsigned 8-bit integer.
    U8,
    /// Signed 8-bit integer.
    I8,
    /// OCP FP8 E4M3FN: bias 7, no infinities, NaN = `0x7F`/`0xFF`.
    F8E4M3,
    /// OCP FP8 E5M2: the top byte of an IEEE half.
    F8E5M2,
    /// FP8 E8M0 (power-of-two scales of MX formats); stored, not converted.
    F8E8M0,
    /// Signed 16-bit integer.
    I16,
    /// Unsigned 16-bit integer.
    U16,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    BF16,
    /// Signed 32-bit integer.
    I32,
    /// Unsigned 32-bit integer.
    U32,
    /// IEEE single precision.
    F32,
    /// Complex of two `f32`.
    C64,
    /// Signed 64-bit integer.
    I64,
    /// Unsigned 64-bit integer.
    U64,
    /// IEEE double precision.
    F64,
}

impl Dtype {
    /// Every dtype this reader knows.
    pub const ALL: [Dtype; 17] = [
        Dtype::Bool,
        Dtype::U8,
        Dtype::I8,
        Dtype::F8E4M3,
        Dtype::F8E5M2,
        Dtype::F8E8M0,
        Dtype::I16,
        Dtype::U16,
        Dtype::F16,
        Dtype::BF16,
        Dtype::I32,
        Dtype::U32,
        Dtype::F32,
        Dtype::C64,
        Dtype::I64,
        Dtype::U64,
        Dtype::F64,
    ];

    /// The name in a safetensors header (`"BF16"`, `"F8_E4M3"`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            Dtype::Bool => "BOOL",
            Dtype::U8 => "U8",
            Dtype::I8 => "I8",
            Dtype::F8E4M3 => "F8_E4M3",
            Dtype::F8E5M2 => "F8_E5M2",
            Dtype::F8E8M0 => "F8_E8M0",
            Dtype::I16 => "I16",
            Dtype::U16 => "U16",
            Dtype::F16 => "F16",
            Dtype::BF16 => "BF16",
            Dtype::I32 => "I32",
            Dtype::U32 => "U32",
            Dtype::F32 => "F32",
            Dtype::C64 => "C64",
            Dtype::I64 => "I64",
            Dtype::U64 => "U64",
            Dtype::F64 => "F64",
        }
    }

    /// The dtype of a header name, or `None` for a name this reader does not know.
    pub fn from_name(name: &str) -> Option<Dtype> {
        Dtype::ALL.into_iter().find(|d| d.name() == name)
    }

    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            Dtype::Bool | Dtype::U8 | Dtype::I8 => 1,
            Dtype::F8E4M3 | Dtype::F8E5M2 | Dtype::F8E8M0 => 1,
            Dtype::I16 | Dtype::U16 | Dtype::F16 | Dtype::BF16 => 2,
            Dtype::I32 | Dtype::U32 | Dtype::F32 => 4,
            Dtype::C64 | Dtype::I64 | Dtype::U64 | Dtype::F64 => 8,
        }
    }

    /// Whether [`TensorView::to_f32_into`] converts this dtype.
    pub const fn converts_to_f32(self) -> bool {
        matches!(
            self,
            Dtype::F8E4M3 | Dtype::F8E5M2 | Dtype::F16 | Dtype::BF16 | Dtype::F32 | Dtype::F64
        )
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Everything that can go wrong reading or writing safetensors. Each message names the file
/// (and the tensor, where there is one) and says what to do.
#[derive(Debug, thiserror::Error)]
pub enum SafetensorsError {
    /// A file could not be opened, measured or mapped.
    #[error("cannot read {}: {source}; check that the file exists and is readable", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A file could not be written.
    #[error("cannot write {}: {source}; check free space and permissions", path.display())]
    Write {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The file is shorter than the 8-byte header length.
    #[error(
        "{}: {len} bytes is too short for a safetensors file (it starts with an 8-byte header \
         length); the file is truncated or not safetensors: re-download it",
        path.display()
    )]
    TooShort {
        /// The file.
        path: PathBuf,
        /// Its length in bytes.
        len: u64,
    },
    /// The header length is over [`MAX_HEADER_LEN`].
    #[error(
        "{}: header length {header_len} bytes is over the {max}-byte limit; the file is corrupt \
         or not safetensors: re-download it",
        path.display()
    )]
    HeaderTooLarge {
        /// The file.
        path: PathBuf,
        /// The header length the file claims.
        header_len: u64,
        /// The limit, [`MAX_HEADER_LEN`].
        max: u64,
    },
    /// The header length runs past the end of the file.
    #[error(
        "{}: header length {header_len} bytes runs past the end of the file ({available} bytes \
         after the length); the file is truncated: re-download it",
        path.display()
    )]
    HeaderPastEnd {
        /// The file.
        path: PathBuf,
        /// The header length the file claims.
        header_len: u64,
        /// The bytes there are after the 8-byte length.
        available: u64,
    },
    /// The header is not a JSON object (or not UTF-8).
    #[error(
        "{}: the header is not a valid JSON object ({message}); the file is corrupt: re-download it",
        path.display()
    )]
    BadJson {
        /// The file.
        path: PathBuf,
        /// What the JSON parser said.
        message: String,
    },
    /// `__metadata__` is not an object of strings.
    #[error(
        "{}: \"__metadata__\" must map strings to strings ({message}); the file is corrupt: \
         re-download it or re-export the checkpoint",
        path.display()
    )]
    BadMetadata {
        /// The file.
        path: PathBuf,
        /// What was wrong.
        message: String,
    },
    /// A tensor's entry lacks a field or has one of the wrong type.
    #[error(
        "{}: tensor \"{tensor}\": {message}; the header is malformed: re-download the file or \
         re-export the checkpoint",
        path.display()
    )]
    BadEntry {
        /// The file.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// What was wrong.
        message: String,
    },
    /// The same tensor name appears twice in one header.
    #[error(
        "{}: tensor \"{tensor}\" appears twice in the header; the file is corrupt: re-download it",
        path.display()
    )]
    DuplicateTensor {
        /// The file.
        path: PathBuf,
        /// The tensor.
        tensor: String,
    },
    /// A tensor's dtype is not one this reader knows.
    #[error(
        "{}: tensor \"{tensor}\" has dtype \"{dtype}\", which this reader does not support \
         (supported: {}); re-export the checkpoint in a supported dtype",
        path.display(),
        Dtype::ALL.map(Dtype::name).join(", ")
    )]
    UnknownDtype {
        /// The file.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// The dtype name in the header.
        dtype: String,
    },
    /// A tensor's `data_offsets` end before they begin.
    #[error(
        "{}: tensor \"{tensor}\" has data_offsets [{begin}, {end}], which end before they begin; \
         the header is corrupt: re-download the file",
        path.display()
    )]
    OffsetsReversed {
        /// The file.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// The first offset.
        begin: u64,
        /// The second offset.
        end: u64,
    },
    /// A tensor's shape and dtype need a different number of bytes than its offsets span.
    #[error(
        "{}: tensor \"{tensor}\" ({dtype} {shape:?}) needs {} bytes but its data_offsets span \
         {actual}; the header is inconsistent: re-download the file",
        path.display(),
        expected.map_or_else(|| "more than 2^64".to_string(), |e| e.to_string())
    )]
    SizeMismatch {
        /// The file.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// Its dtype.
        dtype: Dtype,
        /// Its shape as in the header.
        shape: Vec<u64>,
        /// Bytes the shape needs (`None`: more than `u64` can count).
        expected: Option<u64>,
        /// Bytes the offsets span.
        actual: u64,
    },
    /// A tensor's data runs past the end of the file.
    #[error(
        "{}: tensor \"{tensor}\" has data_offsets [{begin}, {end}] past the end of the \
         {data_len}-byte data region; the file is truncated: re-download it",
        path.display()
    )]
    OffsetsPastEnd {
        /// The file.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// The first offset.
        begin: u64,
        /// The second offset.
        end: u64,
        /// Bytes of data after the header.
        data_len: u64,
    },
    /// Two tensors share bytes.
    #[error(
        "{}: tensors \"{first}\" and \"{second}\" overlap in the data region; the file is \
         corrupt: re-download it",
        path.display()
    )]
    Overlap {
        /// The file.
        path: PathBuf,
        /// The tensor that starts first.
        first: String,
        /// The tensor that starts inside it.
        second: String,
    },
    /// A file has no tensor of that name.
    #[error(
        "{} has no tensor \"{tensor}\"; check the name against the file's tensor list",
        path.display()
    )]
    TensorNotFound {
        /// The file.
        path: PathBuf,
        /// The tensor asked for.
        tensor: String,
    },
    /// A checkpoint folder has neither an index nor a single model file.
    #[error(
        "{} has neither {INDEX_FILE} nor {SINGLE_FILE}; point at a Hugging Face checkpoint \
         folder with its safetensors files downloaded",
        dir.display()
    )]
    NoCheckpointFiles {
        /// The folder.
        dir: PathBuf,
    },
    /// The index file is malformed.
    #[error(
        "{}: {message}; the index is corrupt: re-download {INDEX_FILE}",
        path.display()
    )]
    BadIndex {
        /// The index file.
        path: PathBuf,
        /// What was wrong.
        message: String,
    },
    /// The index maps a tensor to a file that is not in the folder.
    #[error(
        "{} maps tensor \"{tensor}\" to {}, which does not exist; the download is incomplete: \
         download that file into the folder",
        index.display(),
        file.display()
    )]
    MissingShard {
        /// The index file.
        index: PathBuf,
        /// The missing file.
        file: PathBuf,
        /// A tensor the index places in it.
        tensor: String,
    },
    /// The checkpoint has no tensor of that name.
    #[error(
        "checkpoint {} has no tensor \"{tensor}\" (it is not in {}); check the name against the \
         checkpoint's tensor list",
        dir.display(),
        listed_in.display()
    )]
    UnknownTensor {
        /// The checkpoint folder.
        dir: PathBuf,
        /// The index or single file that lists the tensors.
        listed_in: PathBuf,
        /// The tensor asked for.
        tensor: String,
    },
    /// The index places a tensor in a file that does not have it.
    #[error(
        "{} maps tensor \"{tensor}\" to {}, but that file has no such tensor; the files are from \
         different downloads: re-download {}",
        index.display(),
        file.display(),
        file.display()
    )]
    TensorNotInShard {
        /// The index file.
        index: PathBuf,
        /// The file the tensor should be in.
        file: PathBuf,
        /// The tensor.
        tensor: String,
    },
    /// Row access on a tensor with no rows (a scalar).
    #[error(
        "{}: tensor \"{tensor}\" has shape {shape:?}, which has no rows; read it whole instead",
        path.display()
    )]
    NoRows {
        /// The file.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// Its shape.
        shape: Vec<usize>,
    },
    /// A row range outside the tensor.
    #[error(
        "{}: tensor \"{tensor}\" has {count} rows; rows {start}..{end} are out of range: ask for \
         rows within 0..{count}",
        path.display()
    )]
    RowsOutOfRange {
        /// The file.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// First row asked for.
        start: usize,
        /// One past the last row asked for.
        end: usize,
        /// Rows the tensor has.
        count: usize,
    },
    /// An output buffer of the wrong length.
    #[error(
        "{}: tensor \"{tensor}\" has {expected} elements but the output buffer holds {actual}; \
         pass a buffer of exactly {expected}",
        path.display()
    )]
    BufferLength {
        /// The file.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// Elements of the tensor (or row range).
        expected: usize,
        /// Elements of the buffer.
        actual: usize,
    },
    /// A dtype that does not convert to `f32`.
    #[error(
        "{}: tensor \"{tensor}\" is {dtype}, which does not convert to f32 (only F8_E4M3, \
         F8_E5M2, F16, BF16, F32, F64 do); read its raw bytes instead",
        path.display()
    )]
    UnsupportedConversion {
        /// The file.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// Its dtype.
        dtype: Dtype,
    },
    /// The writer was given an invalid tensor.
    #[error("cannot write {}: tensor \"{tensor}\": {message}", path.display())]
    WriteInvalid {
        /// The file to be written.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// What was wrong.
        message: String,
    },
}

/// One tensor of a safetensors header, validated against its file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// The tensor's name.
    pub name: String,
    /// Its element type.
    pub dtype: Dtype,
    /// Its shape (row-major); `[]` is a scalar.
    pub shape: Vec<usize>,
    /// Its bytes in the file: absolute offsets, i.e. the header's `data_offsets` plus
    /// `8 + header length`.
    pub data: Range<usize>,
}

impl TensorInfo {
    /// Number of elements (the product of the shape; 1 for a scalar).
    pub fn num_elements(&self) -> usize {
        self.shape.iter().product()
    }

    /// Number of bytes of data.
    pub fn num_bytes(&self) -> usize {
        self.data.len()
    }
}

/// A parsed, validated header.
struct Header {
    /// Tensors in file order (by data offset).
    tensors: Vec<TensorInfo>,
    /// `__metadata__`, empty when absent.
    metadata: BTreeMap<String, String>,
}

/// A JSON object's entries in document order, duplicates kept (serde_json's map drops them).
struct Entries(Vec<(String, serde_json::Value)>);

impl<'de> Deserialize<'de> for Entries {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct EntriesVisitor;
        impl<'de> Visitor<'de> for EntriesVisitor {
            type Value = Entries;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object of tensor entries")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Entries, A::Error> {
                let mut entries = Vec::with_capacity(map.size_hint().unwrap_or(0).min(1 << 16));
                while let Some(entry) = map.next_entry::<String, serde_json::Value>()? {
                    entries.push(entry);
                }
                Ok(Entries(entries))
            }
        }
        deserializer.deserialize_map(EntriesVisitor)
    }
}

/// A tensor's header entry before validation.
#[derive(Deserialize)]
struct RawEntry {
    dtype: String,
    shape: Vec<u64>,
    data_offsets: (u64, u64),
}

/// Parses and validates a safetensors header: `bytes` is the start of a file of `file_len`
/// bytes (at least its 8-byte length and header; the whole file is fine), and the result is
/// every tensor in file order (by data offset), each checked against `file_len`.
///
/// Errors name `<in-memory header>` as the file; [`SafetensorsFile::open`] names the real one.
/// Any bytes give tensors or an error, never a panic (this is the fuzz target's entry point).
pub fn parse_header(bytes: &[u8], file_len: u64) -> Result<Vec<TensorInfo>> {
    parse(Path::new(IN_MEMORY), bytes, file_len).map(|h| h.tensors)
}

/// [`parse_header`], naming `path` in errors and keeping the metadata.
fn parse(path: &Path, bytes: &[u8], file_len: u64) -> Result<Header> {
    let too_short = || SafetensorsError::TooShort {
        path: path.to_path_buf(),
        len: file_len.min(bytes.len() as u64),
    };
    let Some(&prefix) = bytes.first_chunk::<8>() else {
        return Err(too_short());
    };
    if file_len < 8 {
        return Err(too_short());
    }
    let header_len = u64::from_le_bytes(prefix);
    if header_len > MAX_HEADER_LEN {
        return Err(SafetensorsError::HeaderTooLarge {
            path: path.to_path_buf(),
            header_len,
            max: MAX_HEADER_LEN,
        });
    }
    // header_len <= 100 MB, so these fit in usize and do not overflow.
    let available = (file_len - 8).min(bytes.len() as u64 - 8);
    if header_len > available {
        return Err(SafetensorsError::HeaderPastEnd {
            path: path.to_path_buf(),
            header_len,
            available,
        });
    }
    let data_start = 8 + header_len as usize;
    let json = &bytes[8..data_start];
    let Entries(entries) = serde_json::from_slice(json).map_err(|e| SafetensorsError::BadJson {
        path: path.to_path_buf(),
        message: e.to_string(),
    })?;
    let data_len = file_len - data_start as u64;
    let mut header = Header {
        tensors: Vec::with_capacity(entries.len()),
        metadata: BTreeMap::new(),
    };
    let mut seen = HashSet::with_capacity(entries.len());
    for (name, value) in entries {
        if !seen.insert(name.clone()) {
            return Err(SafetensorsError::DuplicateTensor {
                path: path.to_path_buf(),
                tensor: name,
            });
        }
        if name == "__metadata__" {
            header.metadata =
                BTreeMap::deserialize(&value).map_err(|e| SafetensorsError::BadMetadata {
                    path: path.to_path_buf(),
                    message: e.to_string(),
                })?;
            continue;
        }
        let raw = RawEntry::deserialize(&value).map_err(|e| SafetensorsError::BadEntry {
            path: path.to_path_buf(),
            tensor: name.clone(),
            message: e.to_string(),
        })?;
        header
            .tensors
            .push(validate_entry(path, name, raw, data_start, data_len)?);
    }
    check_no_overlap(path, &mut header.tensors)?;
    Ok(header)
}

/// Checks one entry against the data region (`data_len` bytes from `data_start`).
fn validate_entry(
    path: &Path,
    name: String,
    raw: RawEntry,
    data_start: usize,
    data_len: u64,
) -> Result<TensorInfo> {
    let Some(dtype) = Dtype::from_name(&raw.dtype) else {
        return Err(SafetensorsError::UnknownDtype {
            path: path.to_path_buf(),
            tensor: name,
            dtype: raw.dtype,
        });
    };
    let (begin, end) = raw.data_offsets;
    if begin > end {
        return Err(SafetensorsError::OffsetsReversed {
            path: path.to_path_buf(),
            tensor: name,
            begin,
            end,
        });
    }
    let expected = raw
        .shape
        .iter()
        .try_fold(dtype.size() as u64, |acc, &d| acc.checked_mul(d));
    if expected != Some(end - begin) {
        return Err(SafetensorsError::SizeMismatch {
            path: path.to_path_buf(),
            tensor: name,
            dtype,
            shape: raw.shape,
            expected,
            actual: end - begin,
        });
    }
    // Absolute offsets; they fit in usize whenever the file fits in memory.
    let absolute = |off: u64| usize::try_from(off).ok()?.checked_add(data_start);
    let (Some(lo), Some(hi), true) = (absolute(begin), absolute(end), end <= data_len) else {
        return Err(SafetensorsError::OffsetsPastEnd {
            path: path.to_path_buf(),
            tensor: name,
            begin,
            end,
            data_len,
        });
    };
    let shape: Option<Vec<usize>> = raw.shape.iter().map(|&d| usize::try_from(d).ok()).collect();
    let Some(shape) = shape else {
        return Err(SafetensorsError::BadEntry {
            path: path.to_path_buf(),
            tensor: name,
            message: format!(
                "shape {:?} does not fit this machine's address space",
                raw.shape
            ),
        });
    };
    Ok(TensorInfo {
        name,
        dtype,
        shape,
        data: lo..hi,
    })
}

/// Sorts `tensors` by data offset and refuses any two that share bytes.
fn check_no_overlap(path: &Path, tensors: &mut [TensorInfo]) -> Result<()> {
    tensors.sort_by(|a, b| {
        (a.data.start, a.data.end, &a.name).cmp(&(b.data.start, b.data.end, &b.name))
    });
    for pair in tensors.windows(2) {
        if pair[1].data.start < pair[0].data.end {
            return Err(SafetensorsError::Overlap {
                path: path.to_path_buf(),
                first: pair[0].name.clone(),
                second: pair[1].name.clone(),
            });
        }
    }
    Ok(())
}

/// One safetensors file, mapped read-only, its header validated.
#[derive(Debug)]
pub struct SafetensorsFile {
    path: PathBuf,
    mmap: Mmap,
    tensors: Vec<TensorInfo>,
    by_name: HashMap<String, usize>,
    metadata: BTreeMap<String, String>,
}

impl SafetensorsFile {
    /// Maps `path` read-only and validates its header (reads the header only, not the data).
    ///
    /// The file must not be modified while this value lives (checkpoints are read-only inputs).
    pub fn open(path: impl AsRef<Path>) -> Result<SafetensorsFile> {
        let path = path.as_ref();
        let io = |source| SafetensorsError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        // Too short to be safetensors; also spares mapping an empty file.
        if len < 8 {
            return Err(SafetensorsError::TooShort {
                path: path.to_path_buf(),
                len,
            });
        }
        // SAFETY: the map is read-only and private to this value; the documented contract is
        // that checkpoint files are not modified or truncated while they are open (as for every
        // mmap-based safetensors reader). All access goes through bounds-checked slices.
        let mmap = unsafe { Mmap::map(&file) }.map_err(io)?;
        let header = parse(path, &mmap, mmap.len() as u64)?;
        let by_name = header
            .tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        Ok(SafetensorsFile {
            path: path.to_path_buf(),
            mmap,
            tensors: header.tensors,
            by_name,
            metadata: header.metadata,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Every tensor, in file order (by data offset).
    pub fn tensors(&self) -> std::slice::Iter<'_, TensorInfo> {
        self.tensors.iter()
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// Whether the file has no tensors.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// The header's `__metadata__` (empty when absent).
    pub fn metadata(&self) -> &BTreeMap<String, String> {
        &self.metadata
    }

    /// The tensor called `name`, if the file has it.
    pub fn info(&self, name: &str) -> Option<&TensorInfo> {
        self.by_name.get(name).map(|&i| &self.tensors[i])
    }

    /// A zero-copy view of the tensor called `name`.
    pub fn tensor(&self, name: &str) -> Result<TensorView<'_>> {
        let info = self
            .info(name)
            .ok_or_else(|| SafetensorsError::TensorNotFound {
                path: self.path.clone(),
                tensor: name.to_string(),
            })?;
        Ok(self.view(info))
    }

    /// The view of one of this file's tensors.
    fn view<'a>(&'a self, info: &'a TensorInfo) -> TensorView<'a> {
        TensorView {
            path: &self.path,
            name: &info.name,
            dtype: info.dtype,
            shape: info.shape.clone(),
            // Validated against the map's length in `open`.
            bytes: &self.mmap[info.data.clone()],
        }
    }
}

/// A tensor's bytes (borrowed from the file's map, no copy) with its dtype and shape; or a
/// range of its rows.
#[derive(Debug, Clone)]
pub struct TensorView<'a> {
    path: &'a Path,
    name: &'a str,
    dtype: Dtype,
    shape: Vec<usize>,
    bytes: &'a [u8],
}

impl<'a> TensorView<'a> {
    /// The tensor's name.
    pub fn name(&self) -> &'a str {
        self.name
    }

    /// The file the tensor is in.
    pub fn path(&self) -> &'a Path {
        self.path
    }

    /// Its element type.
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    /// Its shape (for a row range, the first dimension is the number of rows in the range).
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Its raw little-endian bytes, straight from the file.
    pub fn bytes(&self) -> &'a [u8] {
        self.bytes
    }

    /// Number of elements.
    pub fn num_elements(&self) -> usize {
        self.bytes.len() / self.dtype.size()
    }

    /// Number of rows: the first dimension (`None` for a scalar).
    pub fn num_rows(&self) -> Option<usize> {
        self.shape.first().copied()
    }

    /// Rows `range` (along the first dimension; a 2-D `[rows, cols]` weight gives `[n, cols]`),
    /// as a view of the same bytes.
    pub fn rows(&self, range: Range<usize>) -> Result<TensorView<'a>> {
        let Some(&count) = self.shape.first() else {
            return Err(SafetensorsError::NoRows {
                path: self.path.to_path_buf(),
                tensor: self.name.to_string(),
                shape: self.shape.clone(),
            });
        };
        if range.start > range.end || range.end > count {
            return Err(SafetensorsError::RowsOutOfRange {
                path: self.path.to_path_buf(),
                tensor: self.name.to_string(),
                start: range.start,
                end: range.end,
                count,
            });
        }
        // The tensor's size was validated, so these products do not overflow.
        let row_bytes = self.shape[1..].iter().product::<usize>() * self.dtype.size();
        let mut shape = self.shape.clone();
        shape[0] = range.len();
        Ok(TensorView {
            bytes: &self.bytes[range.start * row_bytes..range.end * row_bytes],
            shape,
            ..*self
        })
    }

    /// Views of at most `rows_per_chunk` rows each (at least 1), covering every row in order:
    /// the way to convert a large tensor in bounded memory. A scalar gives one chunk, itself.
    pub fn row_chunks(&self, rows_per_chunk: usize) -> impl Iterator<Item = TensorView<'a>> + '_ {
        let step = rows_per_chunk.max(1);
        let (count, whole) = match self.shape.first() {
            Some(&count) => (count, None),
            None => (0, Some(self.clone())),
        };
        let chunks = (0..count)
            .step_by(step)
            .filter_map(move |r0| self.rows(r0..(r0 + step).min(count)).ok());
        whole.into_iter().chain(chunks)
    }

    /// Converts every element to `f32` into `out`, which must hold exactly
    /// [`num_elements`](Self::num_elements). BF16 and F16 via `half` (exact); F8_E4M3 as OCP
    /// E4M3FN (exact; `0x7F`/`0xFF` are NaN); F8_E5M2 exact; F32 as is; F64 rounded.
    pub fn to_f32_into(&self, out: &mut [f32]) -> Result<()> {
        if !self.dtype.converts_to_f32() {
            return Err(SafetensorsError::UnsupportedConversion {
                path: self.path.to_path_buf(),
                tensor: self.name.to_string(),
                dtype: self.dtype,
            });
        }
        if out.len() != self.num_elements() {
            return Err(SafetensorsError::BufferLength {
                path: self.path.to_path_buf(),
                tensor: self.name.to_string(),
                expected: self.num_elements(),
                actual: out.len(),
            });
        }
        let b = self.bytes;
        match self.dtype {
            Dtype::F8E4M3 => out
                .iter_mut()
                .zip(b)
                .for_each(|(o, &x)| *o = e4m3_to_f32(x)),
            Dtype::F8E5M2 => out
                .iter_mut()
                .zip(b)
                .for_each(|(o, &x)| *o = e5m2_to_f32(x)),
            Dtype::F16 => convert(out, b, |c: [u8; 2]| f16::from_le_bytes(c).to_f32()),
            Dtype::BF16 => convert(out, b, |c: [u8; 2]| bf16::from_le_bytes(c).to_f32()),
            Dtype::F32 => convert(out, b, f32::from_le_bytes),
            Dtype::F64 => convert(out, b, |c: [u8; 8]| f64::from_le_bytes(c) as f32),
            _ => unreachable!("converts_to_f32 was checked above"),
        }
        Ok(())
    }

    /// [`to_f32_into`](Self::to_f32_into) into a new vector (for small tensors or row chunks).
    pub fn to_f32_vec(&self) -> Result<Vec<f32>> {
        let mut out = vec![0.0; self.num_elements()];
        self.to_f32_into(&mut out)?;
        Ok(out)
    }
}

/// Converts `N`-byte little-endian elements of `bytes` into `out` (lengths already checked).
fn convert<const N: usize>(out: &mut [f32], bytes: &[u8], f: impl Fn([u8; N]) -> f32) {
    for (o, chunk) in out.iter_mut().zip(bytes.chunks_exact(N)) {
        let mut a = [0u8; N];
        a.copy_from_slice(chunk);
        *o = f(a);
    }
}

pub use expertmesh_quant::fp8::e4m3_to_f32;

/// Decodes one OCP FP8 E5M2 byte (the top half of an IEEE half).
pub fn e5m2_to_f32(code: u8) -> f32 {
    f16::from_bits(u16::from(code) << 8).to_f32()
}

/// A Hugging Face checkpoint folder's tensors: through `model.safetensors.index.json` or a
/// single `model.safetensors`. Each file is opened once, when first needed.
#[derive(Debug)]
pub struct Checkpoint {
    dir: PathBuf,
    /// The index file, or the single model file.
    source: PathBuf,
    /// Tensor name → index into `shards`.
    weight_map: BTreeMap<String, usize>,
    shards: Vec<Shard>,
}

/// One file of a checkpoint, opened on first use.
#[derive(Debug)]
struct Shard {
    path: PathBuf,
    file: OnceLock<SafetensorsFile>,
}

/// The part of `model.safetensors.index.json` this reader uses.
#[derive(Deserialize)]
struct IndexFile {
    weight_map: BTreeMap<String, String>,
}

impl Checkpoint {
    /// Opens the checkpoint in `dir`: reads its index (checking every file it names exists), or
    /// opens its single `model.safetensors`.
    pub fn open(dir: impl AsRef<Path>) -> Result<Checkpoint> {
        let dir = dir.as_ref().to_path_buf();
        let index = dir.join(INDEX_FILE);
        if index.is_file() {
            return Checkpoint::from_index(dir, index);
        }
        let single = dir.join(SINGLE_FILE);
        if !single.is_file() {
            return Err(SafetensorsError::NoCheckpointFiles { dir });
        }
        let file = SafetensorsFile::open(&single)?;
        let weight_map = file.tensors().map(|t| (t.name.clone(), 0)).collect();
        let shard = Shard {
            path: single.clone(),
            file: OnceLock::from(file),
        };
        Ok(Checkpoint {
            dir,
            source: single,
            weight_map,
            shards: vec![shard],
        })
    }

    fn from_index(dir: PathBuf, index: PathBuf) -> Result<Checkpoint> {
        let bad = |message: String| SafetensorsError::BadIndex {
            path: index.clone(),
            message,
        };
        let io = |source| SafetensorsError::Io {
            path: index.clone(),
            source,
        };
        let len = std::fs::metadata(&index).map_err(io)?.len();
        if len > MAX_HEADER_LEN {
            return Err(bad(format!(
                "{len} bytes is over the {MAX_HEADER_LEN}-byte limit"
            )));
        }
        let text = std::fs::read(&index).map_err(io)?;
        let parsed: IndexFile = serde_json::from_slice(&text).map_err(|e| bad(e.to_string()))?;
        let mut shard_of_file: HashMap<String, usize> = HashMap::new();
        let mut shards = Vec::new();
        let mut weight_map = BTreeMap::new();
        for (tensor, file) in parsed.weight_map {
            let mut parts = Path::new(&file).components();
            if !matches!(
                (parts.next(), parts.next()),
                (Some(Component::Normal(_)), None)
            ) {
                return Err(bad(format!(
                    "tensor \"{tensor}\" maps to \"{file}\", which is not a plain file name in the folder"
                )));
            }
            let next = shards.len();
            let i = *shard_of_file.entry(file.clone()).or_insert(next);
            if i == next {
                let path = dir.join(&file);
                if !path.is_file() {
                    return Err(SafetensorsError::MissingShard {
                        index,
                        file: path,
                        tensor,
                    });
                }
                shards.push(Shard {
                    path,
                    file: OnceLock::new(),
                });
            }
            weight_map.insert(tensor, i);
        }
        Ok(Checkpoint {
            dir,
            source: index,
            weight_map,
            shards,
        })
    }

    /// The checkpoint folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// What lists the tensors: the index file, or the single model file.
    pub fn source(&self) -> &Path {
        &self.source
    }

    /// Every tensor name, sorted.
    pub fn tensor_names(&self) -> impl ExactSizeIterator<Item = &str> {
        self.weight_map.keys().map(String::as_str)
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.weight_map.len()
    }

    /// Whether the checkpoint has no tensors.
    pub fn is_empty(&self) -> bool {
        self.weight_map.is_empty()
    }

    /// Whether the checkpoint has a tensor called `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.weight_map.contains_key(name)
    }

    /// The file holding `name`, per the weight map.
    pub fn file_of(&self, name: &str) -> Option<&Path> {
        self.weight_map
            .get(name)
            .map(|&i| self.shards[i].path.as_path())
    }

    /// Every safetensors file of the checkpoint, in the order the weight map first names them.
    pub fn files(&self) -> impl ExactSizeIterator<Item = &Path> {
        self.shards.iter().map(|s| s.path.as_path())
    }

    /// The file holding `name`, opened (once) and validated.
    pub fn file_for(&self, name: &str) -> Result<&SafetensorsFile> {
        let &i = self
            .weight_map
            .get(name)
            .ok_or_else(|| SafetensorsError::UnknownTensor {
                dir: self.dir.clone(),
                listed_in: self.source.clone(),
                tensor: name.to_string(),
            })?;
        let shard = &self.shards[i];
        if let Some(file) = shard.file.get() {
            return Ok(file);
        }
        let file = SafetensorsFile::open(&shard.path)?;
        Ok(shard.file.get_or_init(|| file))
    }

    /// The tensor called `name`'s header entry.
    pub fn tensor_info(&self, name: &str) -> Result<&TensorInfo> {
        let file = self.file_for(name)?;
        file.info(name).ok_or_else(|| self.not_in_shard(file, name))
    }

    /// A zero-copy view of the tensor called `name`.
    pub fn tensor(&self, name: &str) -> Result<TensorView<'_>> {
        let file = self.file_for(name)?;
        let info = file
            .info(name)
            .ok_or_else(|| self.not_in_shard(file, name))?;
        Ok(file.view(info))
    }

    fn not_in_shard(&self, file: &SafetensorsFile, name: &str) -> SafetensorsError {
        SafetensorsError::TensorNotInShard {
            index: self.source.clone(),
            file: file.path.clone(),
            tensor: name.to_string(),
        }
    }
}

/// A tensor's header entry as the writer emits it.
#[derive(Serialize)]
struct WriteEntry<'a> {
    dtype: &'static str,
    shape: &'a [usize],
    data_offsets: [u64; 2],
}

/// A tensor to write: `(name, dtype, shape, little-endian bytes)`.
pub type TensorData<'a> = (&'a str, Dtype, &'a [usize], &'a [u8]);

/// Temp-file names unique within this process.
static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// Writes a valid safetensors file of `tensors` (`(name, dtype, shape, little-endian bytes)`,
/// laid out in the given order) and `metadata` (omitted when empty). The header is padded with
/// spaces to a multiple of 8 bytes, as the reference implementation does. The file appears
/// atomically: written to a temporary file beside it, synced, then renamed over `path`.
pub fn write_safetensors(
    path: impl AsRef<Path>,
    tensors: &[TensorData<'_>],
    metadata: &BTreeMap<String, String>,
) -> Result<()> {
    let path = path.as_ref();
    let header = write_header(path, tensors, metadata)?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let unique = TEMP_COUNTER.fetch_add(1, Ordering::Relaxed);
    let temp = path.with_file_name(format!(".{name}.tmp-{}-{unique}", std::process::id()));
    let result = write_file(&temp, &header, tensors).and_then(|()| std::fs::rename(&temp, path));
    result.map_err(|source| {
        let _ = std::fs::remove_file(&temp);
        SafetensorsError::Write {
            path: path.to_path_buf(),
            source,
        }
    })
}

/// The header of [`write_safetensors`], length prefix included and padded.
fn write_header(
    path: &Path,
    tensors: &[TensorData<'_>],
    metadata: &BTreeMap<String, String>,
) -> Result<Vec<u8>> {
    let invalid = |tensor: &str, message: String| SafetensorsError::WriteInvalid {
        path: path.to_path_buf(),
        tensor: tensor.to_string(),
        message,
    };
    let mut map = serde_json::Map::new();
    if !metadata.is_empty() {
        map.insert("__metadata__".into(), serde_json::json!(metadata));
    }
    let mut offset = 0u64;
    for &(name, dtype, shape, bytes) in tensors {
        if name == "__metadata__" {
            return Err(invalid(name, "the name is reserved for metadata".into()));
        }
        let expected = shape
            .iter()
            .try_fold(dtype.size(), |acc, &d| acc.checked_mul(d));
        if expected != Some(bytes.len()) {
            return Err(invalid(
                name,
                format!(
                    "{dtype} {shape:?} needs {expected:?} bytes but {} were given",
                    bytes.len()
                ),
            ));
        }
        let end = offset + bytes.len() as u64;
        let entry = WriteEntry {
            dtype: dtype.name(),
            shape,
            data_offsets: [offset, end],
        };
        let value = serde_json::to_value(entry).map_err(|e| invalid(name, e.to_string()))?;
        if map.insert(name.to_string(), value).is_some() {
            return Err(invalid(name, "the name is given twice".into()));
        }
        offset = end;
    }
    let mut json = serde_json::to_vec(&map).map_err(|e| invalid("", e.to_string()))?;
    while json.len() % 8 != 0 {
        json.push(b' ');
    }
    let mut out = Vec::with_capacity(8 + json.len());
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(&json);
    Ok(out)
}

/// Writes `header` then every tensor's bytes to a new file at `temp`, synced.
fn write_file(temp: &Path, header: &[u8], tensors: &[TensorData<'_>]) -> std::io::Result<()> {
    let mut out = BufWriter::new(File::create_new(temp)?);
    out.write_all(header)?;
    for (_, _, _, bytes) in tensors {
        out.write_all(bytes)?;
    }
    out.into_inner().map_err(|e| e.into_error())?.sync_all()
}
