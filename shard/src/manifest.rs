//! The manifest of a converted-weights folder: which files make up the conversion and how to
//! check them.
//!
//! Why this exists: `expertmesh up --weights W` must take everything from one place — the
//! model file, the placement, each device's shard and the router file — and refuse anything
//! inconsistent before loading a byte of weights. The manifest (`W/manifest.json`) is written
//! last and atomically by `expertmesh convert`, so a folder with a manifest is complete; it
//! records the format version, the source checkpoint's files and hashes, each shard's size and
//! checksum, and the conversion error of every layer.

use expertmesh_quant::format::QuantSpec;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// The manifest's file name in a weights folder.
pub const MANIFEST_FILE: &str = "manifest.json";
/// The `format` field of every manifest.
pub const MANIFEST_FORMAT: &str = "expertmesh-weights";
/// The manifest version this code writes and reads.
pub const MANIFEST_VERSION: u32 = 1;
/// Largest manifest accepted when reading.
const MAX_MANIFEST_BYTES: u64 = 64 << 20;

/// One source checkpoint file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SourceFile {
    /// Name within the checkpoint folder.
    pub name: String,
    /// Size in bytes.
    pub bytes: u64,
    /// SHA-256 of the file, lowercase hex.
    pub sha256: String,
}

/// Where the weights came from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SourceInfo {
    /// The checkpoint folder as given to `convert`.
    pub dir: String,
    /// `model_type` family.
    pub family: String,
    /// Source weight format (`bf16`, `fp8-block`, `pack-quantized`, `gptq`, ...).
    pub weight_format: String,
    /// `config.json` and every `*.safetensors` file read.
    pub files: Vec<SourceFile>,
}

/// One shard file of the folder.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShardRecord {
    /// Device id (`node/device`), or `router` for the router file.
    pub device: String,
    /// The file's name within the folder.
    pub file: String,
    /// Size in bytes.
    pub bytes: u64,
    /// crc32c of the whole file.
    pub crc32c: u32,
    /// Experts stored.
    pub experts: u64,
}

/// Conversion error of one layer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayerError {
    /// Decoder layer index.
    pub layer: u32,
    /// Experts converted (routed and shared).
    pub experts: u64,
    /// Mean over experts of `‖w − deq(w)‖₂ / ‖w‖₂` (0 for lossless imports).
    pub rel_error_mean: f64,
    /// Largest per-expert relative error.
    pub rel_error_max: f64,
}

/// `W/manifest.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// Always [`MANIFEST_FORMAT`].
    pub format: String,
    /// [`MANIFEST_VERSION`].
    pub format_version: u32,
    /// The program that wrote it.
    pub created_by: String,
    /// The model's name (as in the model file).
    pub model: String,
    /// The topology's cluster name the placement was made for.
    pub topology: String,
    /// Model file within the folder.
    pub model_file: String,
    /// Placement file within the folder.
    pub placement_file: String,
    /// Identity of the conversion job; every shard records it too.
    pub fingerprint: String,
    /// Packed format of every expert.
    pub quant: QuantSpec,
    /// The source checkpoint.
    pub source: SourceInfo,
    /// One per device, in topology rank order.
    pub shards: Vec<ShardRecord>,
    /// The router's file (gates, biases, shared experts).
    pub router: ShardRecord,
    /// Shared experts are kept dense at the checkpoint's precision (bf16 or f32) in the router
    /// file and run by the router, instead of packed INT4 (an INT4 checkpoint that keeps them
    /// unquantized is served losslessly this way).
    #[serde(default)]
    pub shared_dense: bool,
    /// Conversion error per MoE layer.
    pub layers: Vec<LayerError>,
}

/// Why a manifest could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    /// I/O.
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
    /// Not a valid manifest.
    #[error("{path}: {reason}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong and what to do.
        reason: String,
    },
}

impl Manifest {
    /// Read and check `dir/manifest.json`.
    pub fn load(dir: &Path) -> Result<Self, ManifestError> {
        let path = dir.join(MANIFEST_FILE);
        let invalid = |reason: String| ManifestError::Invalid {
            path: path.clone(),
            reason,
        };
        let missing = |source| ManifestError::Io {
            path: path.clone(),
            what: if dir.is_dir() {
                "reading (no manifest: is this a folder written by `expertmesh convert`, and did it finish?)"
            } else {
                "reading (no such weights folder)"
            },
            source,
        };
        // Opened without blocking (a FIFO put in its place would wait for a writer), then
        // looked at through the handle: what is read is what was checked.
        let file = expertmesh_files::open_nonblocking(&path).map_err(missing)?;
        let io = |source| ManifestError::Io {
            path: path.clone(),
            what: "reading",
            source,
        };
        let meta = file.metadata().map_err(io)?;
        if !meta.is_file() {
            return Err(invalid(
                "not a regular file (a device, pipe or folder where the manifest should be)".into(),
            ));
        }
        if meta.len() > MAX_MANIFEST_BYTES {
            return Err(invalid(format!(
                "{} bytes is too large for a manifest",
                meta.len()
            )));
        }
        // At most one byte past the bound: the file may have grown since it was looked at.
        let mut text = Vec::new();
        std::io::Read::read_to_end(
            &mut std::io::Read::take(file, MAX_MANIFEST_BYTES + 1),
            &mut text,
        )
        .map_err(io)?;
        if text.len() as u64 > MAX_MANIFEST_BYTES {
            return Err(invalid(
                "too large for a manifest (it grew while read)".into(),
            ));
        }
        Self::parse(&text, &path)
    }

    /// Parse and check a manifest's bytes (`path` names it in errors): the JSON, the format
    /// and version, and that every file it names lies inside the folder. Any bytes give a
    /// manifest or an error, never a panic (the `manifest` fuzz target's entry point).
    pub fn parse(text: &[u8], path: &Path) -> Result<Self, ManifestError> {
        let invalid = |reason: String| ManifestError::Invalid {
            path: path.to_path_buf(),
            reason,
        };
        let m: Manifest = serde_json::from_slice(text)
            .map_err(|e| invalid(format!("not a valid manifest: {e}")))?;
        if m.format != MANIFEST_FORMAT || m.format_version != MANIFEST_VERSION {
            return Err(invalid(format!(
                "format {:?} version {}; this build reads {MANIFEST_FORMAT:?} version \
                 {MANIFEST_VERSION}: convert again with this build",
                m.format, m.format_version
            )));
        }
        let names = [&m.model_file, &m.placement_file, &m.router.file]
            .into_iter()
            .chain(m.shards.iter().map(|s| &s.file));
        for name in names {
            check_file_name(name).map_err(&invalid)?;
        }
        Ok(m)
    }

    /// Write `dir/manifest.json` whole or not at all ([`expertmesh_files::write_whole`]:
    /// temporary file, sync, rename, folder sync).
    pub fn write(&self, dir: &Path) -> Result<(), ManifestError> {
        let path = dir.join(MANIFEST_FILE);
        let text = serde_json::to_vec_pretty(self).expect("the manifest serializes");
        expertmesh_files::write_whole(&path, &text, None).map_err(|source| ManifestError::Io {
            path,
            what: "writing",
            source,
        })
    }

    /// The shard record of device `id`.
    pub fn shard_of(&self, id: &str) -> Option<&ShardRecord> {
        self.shards.iter().find(|s| s.device == id)
    }
}

/// A file name in the manifest must name a file inside the folder: no separators, not `.` or
/// `..`, not empty.
pub fn check_file_name(name: &str) -> Result<(), String> {
    let bad = name.is_empty()
        || name == "."
        || name == ".."
        || name.contains(['/', '\\', '\0'])
        || name.len() > 255;
    if bad {
        Err(format!(
            "file name {name:?} is not a plain file name inside the weights folder"
        ))
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The manifest seed of the fuzz target (what `convert` writes, with made-up figures).
    fn seed() -> String {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/seeds/manifest/demo.json");
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    }

    /// The first layer's `rel_error_mean` replaced by the JSON number `number`.
    fn with_error_mean(number: &str) -> String {
        let text = seed();
        let key = "\"rel_error_mean\": ";
        let start = text.find(key).expect("the seed has a layer error") + key.len();
        let end = start + text[start..].find([',', '}', '\n']).unwrap();
        format!("{}{number}{}", &text[..start], &text[end..])
    }

    /// The fuzz target found it (a 72-digit mean error): a number is read correctly rounded, so
    /// a manifest written back reads to the same manifest, bit for bit.
    #[test]
    fn figures_read_correctly_rounded_and_write_back_to_the_same_bits() {
        let path = Path::new("manifest.json");
        for number in [
            "555505555555555555555555555555555555555555555555555555555555555555555550.0123",
            "0.1",
            "0.30000000000000004",
            "2.2250738585072011e-308",
            "4.9406564584124654e-324",
            "1.7976931348623157e308",
            "0.012345678901234567890123456789",
            "9007199254740993",
        ] {
            let m = Manifest::parse(with_error_mean(number).as_bytes(), path).unwrap();
            let want: f64 = number.parse().unwrap();
            assert_eq!(
                m.layers[0].rel_error_mean.to_bits(),
                want.to_bits(),
                "{number} read as {}",
                m.layers[0].rel_error_mean
            );
            let again = Manifest::parse(&serde_json::to_vec(&m).unwrap(), path).unwrap();
            assert_eq!(again, m, "{number}");
        }
    }
}
