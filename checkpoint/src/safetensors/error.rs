//! Everything that can go wrong reading or writing safetensors.
//!
//! Why this exists: one error enum for the reader, the checkpoint folder and the writer, each
//! variant naming the file (and tensor) and saying what to do; it is long enough to be read on its
//! own.

use super::dtype::Dtype;
use super::{INDEX_FILE, SINGLE_FILE};
use std::path::PathBuf;

/// A result of this module.
pub type Result<T, E = SafetensorsError> = std::result::Result<T, E>;

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
    /// The header length is over [`MAX_HEADER_LEN`](super::MAX_HEADER_LEN).
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
        /// The limit, [`MAX_HEADER_LEN`](super::MAX_HEADER_LEN).
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
    /// A checkpoint file is a symbolic link to nothing (a Hugging Face cache snapshot copied
    /// without the blobs its links point at).
    #[error(
        "{} is a link to {}, which does not exist (a Hugging Face snapshot copied without its \
         blobs?); copy the checkpoint with its files (`cp -rL`), or point at the snapshot in \
         the cache itself",
        link.display(),
        target.display()
    )]
    DanglingLink {
        /// The link.
        link: PathBuf,
        /// Where it points.
        target: PathBuf,
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
