//! One safetensors file, memory-mapped, and zero-copy views of its tensors.
//!
//! Why this exists: real checkpoints are hundreds of GB, so a file is mapped read-only and its
//! tensors are converted to `f32` into the caller's buffer, whole or by rows, never read whole.

use super::dtype::{Dtype, convert, e5m2_to_f32};
use super::error::{Result, SafetensorsError};
use super::header::{TensorInfo, parse};
use expertmesh_quant::fp8::e4m3_to_f32;
use half::{bf16, f16};
use memmap2::Mmap;
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};

/// One safetensors file, mapped read-only, its header validated.
#[derive(Debug)]
pub struct SafetensorsFile {
    pub(super) path: PathBuf,
    pub(super) mmap: Mmap,
    pub(super) tensors: Vec<TensorInfo>,
    pub(super) by_name: HashMap<String, usize>,
    pub(super) metadata: BTreeMap<String, String>,
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
    pub(super) fn view<'a>(&'a self, info: &'a TensorInfo) -> TensorView<'a> {
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
    pub(super) path: &'a Path,
    pub(super) name: &'a str,
    pub(super) dtype: Dtype,
    pub(super) shape: Vec<usize>,
    pub(super) bytes: &'a [u8],
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

    /// Slice `i` along the first dimension, without it: of a `[E, R, C]` tensor, the `[R, C]`
    /// matrix `i` (how fused expert tensors hold one expert each).
    pub fn select(&self, i: usize) -> Result<TensorView<'a>> {
        let mut one = self.rows(i..i + 1)?;
        one.shape.remove(0);
        Ok(one)
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
