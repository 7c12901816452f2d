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
//!
//! # Modules
//!
//! `header` (parsing and validating a header), `reader` (one mapped file and its tensor views),
//! `checkpoint` (a folder of files), `writer` (the atomic writer), `dtype` (element types and
//! their conversion to `f32`), `error` (every failure, with what to do).

mod checkpoint;
mod dtype;
mod error;
mod header;
mod reader;
mod writer;

pub use checkpoint::Checkpoint;
pub use dtype::{Dtype, e5m2_to_f32};
pub use error::{Result, SafetensorsError};
pub use expertmesh_quant::fp8::e4m3_to_f32;
pub use header::{TensorInfo, parse_header};
pub use reader::{SafetensorsFile, TensorView};
pub use writer::{TensorData, write_safetensors};

/// The largest header this reader accepts (100 MB); real headers are a few MB at most.
pub const MAX_HEADER_LEN: u64 = 100_000_000;

/// The file name of a multi-file checkpoint's index.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// The file name of a single-file checkpoint.
pub const SINGLE_FILE: &str = "model.safetensors";

/// The name [`parse_header`] gives in its errors, having no file.
const IN_MEMORY: &str = "<in-memory header>";
