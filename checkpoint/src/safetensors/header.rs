//! The safetensors header: parsing and validating it against the file's length.
//!
//! Why this exists: the header is untrusted JSON with offsets into the file; every tensor's dtype,
//! shape, size and offsets are checked (and no two tensors may overlap) before any byte is read
//! through it. [`parse_header`] is the fuzz target's entry point.

use super::dtype::Dtype;
use super::error::{Result, SafetensorsError};
use super::{IN_MEMORY, MAX_HEADER_LEN};
use serde::Deserialize;
use serde::de::{Deserializer, MapAccess, Visitor};
use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::ops::Range;
use std::path::Path;

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
pub(super) struct Header {
    /// Tensors in file order (by data offset).
    pub(super) tensors: Vec<TensorInfo>,
    /// `__metadata__`, empty when absent.
    pub(super) metadata: BTreeMap<String, String>,
}

/// A JSON object's entries in document order, duplicates kept (serde_json's map drops them).
pub(super) struct Entries(Vec<(String, serde_json::Value)>);

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
pub(super) struct RawEntry {
    pub(super) dtype: String,
    pub(super) shape: Vec<u64>,
    pub(super) data_offsets: (u64, u64),
}

/// Parses and validates a safetensors header: `bytes` is the start of a file of `file_len`
/// bytes (at least its 8-byte length and header; the whole file is fine), and the result is
/// every tensor in file order (by data offset), each checked against `file_len`.
///
/// Errors name `<in-memory header>` as the file; [`SafetensorsFile::open`](super::SafetensorsFile::open) names the real one.
/// Any bytes give tensors or an error, never a panic (this is the fuzz target's entry point).
pub fn parse_header(bytes: &[u8], file_len: u64) -> Result<Vec<TensorInfo>> {
    parse(Path::new(IN_MEMORY), bytes, file_len).map(|h| h.tensors)
}

/// [`parse_header`], naming `path` in errors and keeping the metadata.
pub(super) fn parse(path: &Path, bytes: &[u8], file_len: u64) -> Result<Header> {
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
pub(super) fn validate_entry(
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
    // A zero dimension makes the size 0 whatever the others are; their product must still
    // be countable, since a row's size (and a slice of rows) multiplies them.
    if raw.shape.contains(&0)
        && raw
            .shape
            .iter()
            .try_fold(dtype.size() as u64, |acc, &d| acc.checked_mul(d.max(1)))
            .is_none()
    {
        return Err(SafetensorsError::BadEntry {
            path: path.to_path_buf(),
            tensor: name,
            message: format!(
                "shape {:?}: its dimensions multiply past 2^64 bytes (the file is corrupt)",
                raw.shape
            ),
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
pub(super) fn check_no_overlap(path: &Path, tensors: &mut [TensorInfo]) -> Result<()> {
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
