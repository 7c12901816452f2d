//! An atomic safetensors writer, for tests and tools.
//!
//! Why this exists: tests and tools build checkpoints; the file is written to a temporary name,
//! synced and renamed, so a reader never sees a partial file.

use super::dtype::Dtype;
use super::error::{Result, SafetensorsError};
use serde::Serialize;
use std::collections::BTreeMap;
use std::io::{BufWriter, Write};
use std::path::Path;

/// A tensor's header entry as the writer emits it.
#[derive(Serialize)]
pub(super) struct WriteEntry<'a> {
    pub(super) dtype: &'static str,
    pub(super) shape: &'a [usize],
    pub(super) data_offsets: [u64; 2],
}

/// A tensor to write: `(name, dtype, shape, little-endian bytes)`.
pub type TensorData<'a> = (&'a str, Dtype, &'a [usize], &'a [u8]);

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
    let temp = expertmesh_files::temp_path(path);
    // Locked until it is renamed (the lock goes with the file): a sweep leaves it alone.
    let file =
        expertmesh_files::create_locked(&temp, None).map_err(|source| SafetensorsError::Write {
            path: path.to_path_buf(),
            source,
        })?;
    let result = write_file(file, &header, tensors).and_then(|f| {
        std::fs::rename(&temp, path)?;
        drop(f);
        Ok(())
    });
    result.map_err(|source| {
        let _ = std::fs::remove_file(&temp);
        SafetensorsError::Write {
            path: path.to_path_buf(),
            source,
        }
    })
}

/// The header of [`write_safetensors`], length prefix included and padded.
pub(super) fn write_header(
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

/// Writes `header` then every tensor's bytes to `file` (new, locked), synced; gives it back.
pub(super) fn write_file(
    file: expertmesh_files::Held,
    header: &[u8],
    tensors: &[TensorData<'_>],
) -> std::io::Result<expertmesh_files::Held> {
    let mut out = BufWriter::new(file);
    out.write_all(header)?;
    for (_, _, _, bytes) in tensors {
        out.write_all(bytes)?;
    }
    let file = out.into_inner().map_err(|e| e.into_error())?;
    file.sync_all()?;
    Ok(file)
}
