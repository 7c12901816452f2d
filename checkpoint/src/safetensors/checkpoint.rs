//! A checkpoint folder: one `model.safetensors`, or many files through the index.
//!
//! Why this exists: Hugging Face checkpoints shard their tensors over files named by a weight map;
//! this resolves a tensor name to its file (opened once, when first needed) and checks that the
//! index names only files inside the folder.

use super::error::{Result, SafetensorsError};
use super::header::TensorInfo;
use super::reader::{SafetensorsFile, TensorView};
use super::{INDEX_FILE, MAX_HEADER_LEN, SINGLE_FILE};
use serde::Deserialize;
use std::collections::{BTreeMap, HashMap};
use std::path::{Component, Path, PathBuf};
use std::sync::OnceLock;

/// A Hugging Face checkpoint folder's tensors: through `model.safetensors.index.json` or a
/// single `model.safetensors`. Each file is opened once, when first needed.
#[derive(Debug)]
pub struct Checkpoint {
    pub(super) dir: PathBuf,
    /// The index file, or the single model file.
    pub(super) source: PathBuf,
    /// Tensor name → index into `shards`.
    pub(super) weight_map: BTreeMap<String, usize>,
    pub(super) shards: Vec<Shard>,
    /// The folder's quantization config, read once when first asked for
    /// ([`crate::gptq_import::quant_config_of`]: every expert's check and read consults it).
    pub(crate) quant_config: OnceLock<crate::gptq_import::QuantConfig>,
}

/// One file of a checkpoint, opened on first use.
#[derive(Debug)]
pub(super) struct Shard {
    pub(super) path: PathBuf,
    pub(super) file: OnceLock<SafetensorsFile>,
}

/// The part of `model.safetensors.index.json` this reader uses.
#[derive(Deserialize)]
pub(super) struct IndexFile {
    pub(super) weight_map: BTreeMap<String, String>,
}

/// `Err` [`SafetensorsError::DanglingLink`] when `path` is a symbolic link to nothing (what a
/// Hugging Face cache snapshot copied without `-L` holds): "no such file" would be wrong
/// where `ls` lists it.
fn dangling(path: &Path) -> Result<()> {
    let is_link = std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink());
    if is_link && std::fs::metadata(path).is_err() {
        let target = std::fs::read_link(path).unwrap_or_default();
        return Err(SafetensorsError::DanglingLink {
            link: path.to_path_buf(),
            target,
        });
    }
    Ok(())
}

impl Checkpoint {
    /// Opens the checkpoint in `dir`: reads its index (checking every file it names exists), or
    /// opens its single `model.safetensors`.
    pub fn open(dir: impl AsRef<Path>) -> Result<Checkpoint> {
        let dir = dir.as_ref().to_path_buf();
        // A folder that is not there is said so, not "has no model files".
        if let Err(source) = std::fs::metadata(&dir) {
            return Err(SafetensorsError::Io { path: dir, source });
        }
        let index = dir.join(INDEX_FILE);
        if index.is_file() {
            return Checkpoint::from_index(dir, index);
        }
        dangling(&index)?;
        let single = dir.join(SINGLE_FILE);
        if !single.is_file() {
            dangling(&single)?;
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
            quant_config: OnceLock::new(),
        })
    }

    pub(super) fn from_index(dir: PathBuf, index: PathBuf) -> Result<Checkpoint> {
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
                    dangling(&path)?;
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
            quant_config: OnceLock::new(),
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

    /// Opens (once) and validates every file of the checkpoint: a truncated or corrupt file
    /// is named before anything is read from the others.
    pub fn open_all(&self) -> Result<()> {
        for shard in &self.shards {
            if shard.file.get().is_none() {
                let file = SafetensorsFile::open(&shard.path)?;
                let _ = shard.file.set(file);
            }
        }
        Ok(())
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

    pub(super) fn not_in_shard(&self, file: &SafetensorsFile, name: &str) -> SafetensorsError {
        SafetensorsError::TensorNotInShard {
            index: self.source.clone(),
            file: file.path.clone(),
            tensor: name.to_string(),
        }
    }
}
