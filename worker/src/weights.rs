//! Weight loading: which experts a device pins, and the in-process reference backend.
//!
//! Why this exists: a worker (and the router, for shared experts it runs itself) must load
//! exactly the (layer, expert) weights the placement gives it, once, at start. With converted
//! weights (`--weights W`) a worker maps only its own shard, checks it against the manifest's
//! checksum and the placement, and copies each expert out of the map (the router reads gates,
//! biases and shared experts from the router file); without, weights are synthetic from the
//! deployment's seed. The in-process reference backend (every expert of some layers on one CPU
//! backend) lives here too: it is the only other place that builds a concrete backend.

use crate::deploy::Deployment;
use expertmesh_backend::{
    BackendError, BatchLimits, ContentId, ExpertBackend, ExpertKey, ExpertShape, ExpertSource,
    VecSource,
};
use expertmesh_cpu_backend::CpuBackend;
use expertmesh_quant::format::{ExpertWeights, FormatError, PackedRef, QuantSpec};
use expertmesh_router::gating::GateWeights;
use expertmesh_shard::ShardError;
use expertmesh_shard::file::{ShardFile, ShardKind};
use expertmesh_shard::{gate_bias_name, gate_weight_name};
use expertmesh_topology::model::ModelSpec;
use expertmesh_topology::placement::SharedLocation;
use expertmesh_topology::topology::DeviceRank;
use std::collections::BTreeSet;
use std::path::PathBuf;

/// Why a device's (or the router's) weights could not be loaded: a shard or the router file
/// missing, damaged, of another conversion or not matching the placement; or a synthetic
/// expert that could not be generated.
///
/// Every message includes its cause, and no variant exposes it as
/// [`std::error::Error::source`] (see [`crate::deploy::DeployError`]).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WeightsError {
    /// A synthetic routed expert could not be generated.
    #[error("generating layer {layer} expert {expert}: {cause}")]
    SyntheticExpert {
        /// Layer.
        layer: u32,
        /// Expert.
        expert: u32,
        /// Why.
        cause: FormatError,
    },
    /// A synthetic shared expert could not be generated.
    #[error("generating layer {layer} shared expert {index}: {cause}")]
    SyntheticShared {
        /// Layer.
        layer: u32,
        /// Which shared expert of the layer.
        index: u32,
        /// Why.
        cause: FormatError,
    },
    /// Shards were asked of a deployment with synthetic weights.
    #[error("the deployment has no converted weights")]
    NotConverted,
    /// A device rank outside the topology.
    #[error("no device rank {0}")]
    NoDeviceRank(u32),
    /// The manifest lists no shard for a device.
    #[error("{}: the manifest has no shard for device {device}", dir.display())]
    NoShard {
        /// The weights folder.
        dir: PathBuf,
        /// The device's id.
        device: String,
    },
    /// A shard or the router file could not be read, is damaged, fails its checksum or lacks
    /// a tensor.
    #[error("{0}")]
    Shard(ShardError),
    /// A shard's own index names another conversion, kind or device than the manifest.
    #[error(
        "{}: this shard belongs to another conversion or device than the manifest says \
         (kind {kind:?}, device {device:?}); convert again",
        path.display()
    )]
    ForeignShard {
        /// The shard.
        path: PathBuf,
        /// The kind its index says.
        kind: ShardKind,
        /// The device its index says.
        device: Option<String>,
    },
    /// A shard's format or hidden size is not the model's.
    #[error(
        "{}: shard format {quant} hidden {hidden} but the model says {model_quant} hidden \
         {model_hidden}",
        path.display()
    )]
    ShardFormat {
        /// The shard.
        path: PathBuf,
        /// The shard's format.
        quant: QuantSpec,
        /// The shard's hidden size.
        hidden: u64,
        /// The model's format.
        model_quant: QuantSpec,
        /// The model's hidden size.
        model_hidden: u32,
    },
    /// Reading the experts out of a shard failed.
    #[error("{0}")]
    Load(BackendError),
    /// A device shard holds an expert the placement does not give the device.
    #[error(
        "{}: holds layer {layer} expert {expert}, which the placement does not give this \
         device; the folder was edited: convert again",
        path.display()
    )]
    NotPlaced {
        /// The shard.
        path: PathBuf,
        /// Layer.
        layer: u32,
        /// Expert.
        expert: u32,
    },
    /// A shard lacks experts the placement needs (the first few, as (layer, expert)).
    #[error(
        "{}: missing experts the placement needs (layer, expert): {missing:?}; convert again",
        path.display()
    )]
    MissingExperts {
        /// The shard.
        path: PathBuf,
        /// Up to five missing (layer, expert) pairs.
        missing: Vec<(u32, u32)>,
    },
    /// The thread checking a shard's checksum could not start.
    #[error("starting the checksum thread: {0}")]
    ChecksumThread(std::io::Error),
    /// A layer's gate in the router file has another shape than the model's.
    #[error(
        "{}: layer {layer} gate has shape {weight:?} / bias {bias:?}, the model needs \
         [{experts}, {hidden}] / [{experts}]",
        path.display()
    )]
    GateShape {
        /// The router file.
        path: PathBuf,
        /// Layer.
        layer: u32,
        /// The gate weight's shape.
        weight: Vec<u64>,
        /// The gate bias's shape.
        bias: Vec<u64>,
        /// The model's routed experts.
        experts: usize,
        /// The model's hidden size.
        hidden: usize,
    },
    /// A layer's shared-expert gate in the router file has another shape than the model's.
    #[error("{}: {name} has shape {shape:?}, the model needs [{hidden}]", path.display())]
    SharedGateShape {
        /// The router file.
        path: PathBuf,
        /// The tensor.
        name: String,
        /// Its shape.
        shape: Vec<u64>,
        /// The model's hidden size.
        hidden: usize,
    },
    /// A dense shared expert's matrix in the router file has another size than the model's.
    #[error("{name}: shape {shape:?}, need {inter}x{hidden}")]
    DenseSharedShape {
        /// The tensor.
        name: String,
        /// Its shape.
        shape: Vec<u64>,
        /// The model's shared intermediate size.
        inter: usize,
        /// The model's hidden size.
        hidden: usize,
    },
}

/// Why the reference backend could not be built.
#[derive(Debug, thiserror::Error)]
pub enum ReferenceError {
    /// Generating a synthetic expert failed.
    #[error("generating synthetic experts: {0}")]
    Weights(#[from] FormatError),
    /// The CPU backend refused the experts or the limits.
    #[error("loading the reference CPU backend: {0}")]
    Backend(#[from] BackendError),
}

/// The experts a device pins: its routed experts of every layer, plus the shared experts of the
/// layers whose shared experts it runs (keys `routed_experts + i`). From its shard when the
/// deployment has converted weights, synthetic from the seed otherwise.
pub fn load_device_experts(
    dep: &Deployment,
    d: DeviceRank,
) -> Result<Vec<(ExpertKey, ExpertWeights)>, WeightsError> {
    if dep.weights.is_some() {
        return load_shard_experts(dep, Some(d));
    }
    let spec = &dep.spec;
    let mut out = Vec::new();
    for layer in spec.moe_layer_ids() {
        for &e in dep.placement.experts_on(d, layer) {
            let w = spec.synthetic(dep.seed).routed(layer, e).map_err(|cause| {
                WeightsError::SyntheticExpert {
                    layer,
                    expert: e,
                    cause,
                }
            })?;
            out.push((ExpertKey { layer, expert: e }, w));
        }
        if matches!(dep.placement.shared_location(layer), Some(SharedLocation::Device(x)) if x == d)
        {
            push_shared(dep, layer, &mut out)?;
        }
    }
    Ok(out)
}

/// The shared experts the router runs itself.
pub fn load_router_shared_experts(
    dep: &Deployment,
) -> Result<Vec<(ExpertKey, ExpertWeights)>, WeightsError> {
    if dep.weights.is_some() {
        return load_shard_experts(dep, None);
    }
    let mut out = Vec::new();
    for layer in dep.spec.moe_layer_ids() {
        if !matches!(
            dep.placement.shared_location(layer),
            Some(SharedLocation::Device(_))
        ) {
            push_shared(dep, layer, &mut out)?;
        }
    }
    Ok(out)
}

/// Append `layer`'s shared experts (keys `routed_experts + i`).
fn push_shared(
    dep: &Deployment,
    layer: u32,
    out: &mut Vec<(ExpertKey, ExpertWeights)>,
) -> Result<(), WeightsError> {
    let spec = &dep.spec;
    for i in 0..spec.shared_experts {
        let w = spec.synthetic(dep.seed).shared(layer, i).map_err(|cause| {
            WeightsError::SyntheticShared {
                layer,
                index: i,
                cause,
            }
        })?;
        out.push((
            ExpertKey {
                layer,
                expert: spec.routed_experts + i,
            },
            w,
        ));
    }
    Ok(())
}

/// The (layer, expert) keys device `d` (or, for `None`, the router) must load.
fn expected_keys(dep: &Deployment, d: Option<DeviceRank>) -> BTreeSet<(u32, u32)> {
    let spec = &dep.spec;
    let mut keys = BTreeSet::new();
    for layer in spec.moe_layer_ids() {
        let shared_here = match (d, dep.placement.shared_location(layer)) {
            (Some(d), Some(SharedLocation::Device(x))) => x == d,
            (Some(_), _) => false,
            (None, _) if dep.shared_dense() => false,
            (None, Some(SharedLocation::Device(_))) => false,
            (None, _) => true,
        };
        if let Some(d) = d {
            keys.extend(
                dep.placement
                    .experts_on(d, layer)
                    .iter()
                    .map(|&e| (layer, e)),
            );
        }
        if shared_here {
            keys.extend((0..spec.shared_experts).map(|i| (layer, spec.routed_experts + i)));
        }
    }
    keys
}

/// Open and verify the shard of device `d` (`None`: the router file) against the manifest.
pub fn open_shard(dep: &Deployment, d: Option<DeviceRank>) -> Result<ShardFile, WeightsError> {
    let (f, crc) = open_shard_unverified(dep, d)?;
    f.verify(Some(crc)).map_err(WeightsError::Shard)?;
    Ok(f)
}

/// [`open_shard`] without the checksum pass: header, index, kind, device, fingerprint and
/// format are checked; returns the file and the manifest's checksum, which the caller must
/// verify before serving anything loaded from it.
fn open_shard_unverified(
    dep: &Deployment,
    d: Option<DeviceRank>,
) -> Result<(ShardFile, u32), WeightsError> {
    let w = dep.weights.as_ref().ok_or(WeightsError::NotConverted)?;
    let m = &w.manifest;
    let (record, kind, id) = match d {
        Some(d) => {
            let id = dep
                .topology
                .device(d)
                .map(|x| x.id().to_string())
                .ok_or(WeightsError::NoDeviceRank(d.0))?;
            let r = m.shard_of(&id).ok_or_else(|| WeightsError::NoShard {
                dir: w.dir.clone(),
                device: id.clone(),
            })?;
            (r, ShardKind::Device, Some(id))
        }
        None => (&m.router, ShardKind::Router, None),
    };
    let path = w.path(&record.file);
    let f = ShardFile::open(&path).map_err(WeightsError::Shard)?;
    let idx = f.index();
    if idx.kind != kind || idx.device != id || idx.fingerprint != m.fingerprint {
        return Err(WeightsError::ForeignShard {
            path,
            kind: idx.kind,
            device: idx.device.clone(),
        });
    }
    if idx.quant != dep.spec.quant || idx.hidden != u64::from(dep.spec.hidden) {
        return Err(WeightsError::ShardFormat {
            path,
            quant: idx.quant,
            hidden: idx.hidden,
            model_quant: dep.spec.quant,
            model_hidden: dep.spec.hidden,
        });
    }
    Ok((f, record.crc32c))
}

/// The experts of device `d`'s shard (`None`: the router file's shared experts that no device
/// runs), checked against the placement, read into memory.
fn load_shard_experts(
    dep: &Deployment,
    d: Option<DeviceRank>,
) -> Result<Vec<(ExpertKey, ExpertWeights)>, WeightsError> {
    let mut src = ShardSource::open(dep, d)?;
    expertmesh_backend::collect_source(&mut src).map_err(WeightsError::Load)
}

/// The experts device `d` pins, as a source a backend loads one expert at a time: from its
/// shard (mapped; each expert copied out once, straight into the backend), or synthetic.
pub fn device_expert_source(
    dep: &Deployment,
    d: DeviceRank,
) -> Result<Box<dyn ExpertSource>, WeightsError> {
    if dep.weights.is_some() {
        return Ok(Box::new(ShardSource::open(dep, Some(d))?));
    }
    Ok(Box::new(VecSource::new(load_device_experts(dep, d)?)))
}

/// A shard's experts that one process must load, handed over one at a time. The checksum of
/// the whole file is computed on another thread while the experts are copied out (the two
/// passes overlap; the thread starts with the first expert taken, so a backend that takes none
/// because it holds the same content already, by [`ExpertSource::content_id`], reads nothing);
/// [`ExpertSource::finish`] waits for it, and the load fails if it does not match the
/// manifest, so nothing from a damaged shard is ever served.
#[derive(Debug)]
pub struct ShardSource {
    file: std::sync::Arc<ShardFile>,
    /// The whole file's crc32c the manifest records.
    crc: u32,
    /// Where the whole-file check is.
    verify: Verify,
    entries: Vec<usize>,
    shapes: Vec<ExpertShape>,
}

/// The whole-file check of a [`ShardSource`]: started with the first expert taken, joined
/// at `finish`.
#[derive(Debug)]
enum Verify {
    NotStarted,
    Running(VerifyThread),
    Done,
}

impl ShardSource {
    /// Open the shard of device `d` (`None`: the router file) and select the experts the
    /// placement gives it (every expert of a device shard must be one); its checksum is
    /// checked as its experts are read.
    pub fn open(dep: &Deployment, d: Option<DeviceRank>) -> Result<Self, WeightsError> {
        let (file, crc) = open_shard_unverified(dep, d)?;
        let want = expected_keys(dep, d);
        let (mut entries, mut shapes) = (Vec::new(), Vec::new());
        for (i, e) in file.index().experts.iter().enumerate() {
            if !want.contains(&(e.layer, e.expert)) {
                if d.is_none() {
                    continue; // the router file holds every shared expert
                }
                return Err(WeightsError::NotPlaced {
                    path: file.path().to_path_buf(),
                    layer: e.layer,
                    expert: e.expert,
                });
            }
            entries.push(i);
            shapes.push(shard_shape(&file, e));
        }
        if shapes.len() != want.len() {
            let have: BTreeSet<(u32, u32)> =
                shapes.iter().map(|s| (s.key.layer, s.key.expert)).collect();
            return Err(WeightsError::MissingExperts {
                path: file.path().to_path_buf(),
                missing: want.difference(&have).take(5).copied().collect(),
            });
        }
        Ok(Self {
            file: std::sync::Arc::new(file),
            crc,
            verify: Verify::NotStarted,
            entries,
            shapes,
        })
    }

    /// Start the checksum thread if it is not running yet (the first expert taken).
    fn start_verify(&mut self) -> Result<(), BackendError> {
        if matches!(self.verify, Verify::NotStarted) {
            self.verify = Verify::Running(
                spawn_verify_shared(std::sync::Arc::clone(&self.file), self.crc)
                    .map_err(|e| BackendError::Source(e.to_string()))?,
            );
        }
        Ok(())
    }
}

impl ExpertSource for ShardSource {
    fn shapes(&self) -> &[ExpertShape] {
        &self.shapes
    }

    fn expert(&mut self, i: usize) -> Result<ExpertWeights, BackendError> {
        let at = *self
            .entries
            .get(i)
            .ok_or_else(|| BackendError::Source(format!("no expert {i} in the shard")))?;
        self.start_verify()?;
        self.file
            .expert(at)
            .map_err(|e| BackendError::Source(e.to_string()))
    }

    fn expert_ref(
        &mut self,
        i: usize,
    ) -> Option<Result<(PackedRef<'_>, PackedRef<'_>), BackendError>> {
        let at = *self.entries.get(i)?;
        if let Err(e) = self.start_verify() {
            return Some(Err(e));
        }
        Some(
            self.file
                .expert_ref(at)
                .map_err(|e| BackendError::Source(e.to_string())),
        )
    }

    fn finish(&mut self) -> Result<(), BackendError> {
        let v = match std::mem::replace(&mut self.verify, Verify::Done) {
            // Nothing was taken (no experts): check the file here, as a load always does.
            Verify::NotStarted => {
                return self
                    .file
                    .verify(Some(self.crc))
                    .map_err(|e| BackendError::Source(e.to_string()));
            }
            Verify::Running(v) => v,
            Verify::Done => return Ok(()),
        };
        match v.join() {
            Ok(r) => r.map_err(|e| BackendError::Source(e.to_string())),
            Err(_) => Err(BackendError::Source(format!(
                "{}: the checksum thread panicked",
                self.file.path().display()
            ))),
        }
    }

    /// The shard's path; the conversion's fingerprint, the shard's size, modification time,
    /// inode and the manifest's checksum of it, and the experts selected (a rewritten or
    /// replaced shard is other content even when its 32-bit checksum collides). Not the
    /// filesystem's device number: overlayfs gives a container's files a new one at every
    /// start (and drives can be renumbered at boot), so every start was a miss there.
    fn content_id(&self) -> Option<ContentId> {
        let idx = self.file.index();
        let path = self.file.path();
        let place = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
        // The mapped file's own identity: the path may name a newer file by now.
        let f = self.file.identity();
        Some(ContentId {
            place: place.display().to_string(),
            id: format!(
                "shard of conversion {} for device {}: {} bytes, modified {}.{:09}, inode {}, \
                 crc32c {:08x}, entries {:?}",
                idx.fingerprint,
                idx.device.as_deref().unwrap_or("router"),
                f.bytes,
                f.modified.0,
                f.modified.1,
                f.device_inode.1,
                self.crc,
                self.entries
            ),
        })
    }
}

/// The routed experts `keys` ((layer, expert), ascending) a device gains in a live placement
/// change, as a source its backend loads one at a time: from the host's converted weights
/// (whichever device shards of the conversion hold them; each shard used is checked against
/// the manifest's checksum before the load commits, as at start), or synthetic from the seed.
pub fn gained_expert_source(
    dep: &Deployment,
    keys: &[(u32, u32)],
) -> Result<Box<dyn ExpertSource>, WeightsError> {
    let (src, missing) = gained_expert_source_on_host(dep, keys)?;
    if !missing.is_empty() {
        let path = dep
            .weights
            .as_ref()
            .map(|w| w.dir.clone())
            .unwrap_or_default();
        return Err(WeightsError::MissingExperts {
            path,
            missing: missing.into_iter().take(5).collect(),
        });
    }
    Ok(src)
}

/// The gains a host has weights for, as a source, and the keys it has none for.
pub type HostGains = (Box<dyn ExpertSource>, Vec<(u32, u32)>);

/// [`gained_expert_source`] for the experts this host has weights for, and the keys it has
/// none for (ascending; empty for synthetic weights): those are copied from a device that
/// serves them ([`crate::fetch`]).
pub fn gained_expert_source_on_host(
    dep: &Deployment,
    keys: &[(u32, u32)],
) -> Result<HostGains, WeightsError> {
    let spec = &dep.spec;
    let Some(w) = dep.weights.as_ref() else {
        let synth = spec.synthetic(dep.seed);
        let experts =
            keys.iter()
                .map(|&(layer, expert)| {
                    let weights = synth.routed(layer, expert).map_err(|cause| {
                        WeightsError::SyntheticExpert {
                            layer,
                            expert,
                            cause,
                        }
                    })?;
                    Ok((ExpertKey { layer, expert }, weights))
                })
                .collect::<Result<Vec<_>, WeightsError>>()?;
        return Ok((Box::new(VecSource::new(experts)), Vec::new()));
    };
    let mut missing: BTreeSet<(u32, u32)> = keys.iter().copied().collect();
    let mut src = GainSource::default();
    for (i, d) in dep.topology.devices().iter().enumerate() {
        if missing.is_empty() {
            break;
        }
        // A shard this host does not have (a multi-host fabric copies each host its own)
        // is skipped: another may hold the expert.
        let id = d.id().to_string();
        match w.manifest.shard_of(&id) {
            Some(r) if w.path(&r.file).exists() => {}
            _ => continue,
        }
        let (file, crc) = open_shard_unverified(dep, Some(DeviceRank(i as u32)))?;
        let hits: Vec<(usize, ExpertShape)> = file
            .index()
            .experts
            .iter()
            .enumerate()
            .filter(|(_, e)| missing.remove(&(e.layer, e.expert)))
            .map(|(at, e)| (at, shard_shape(&file, e)))
            .collect();
        if hits.is_empty() {
            continue;
        }
        let (file, verify) = spawn_verify(file, crc)?;
        src.verify.push((file.path().to_path_buf(), verify));
        for (at, shape) in hits {
            src.entries.push((std::sync::Arc::clone(&file), at));
            src.shapes.push(shape);
        }
    }
    Ok((Box::new(src), missing.into_iter().collect()))
}

/// This host's device shards for reading one expert at a time (an owner's copy server): a
/// shard is checked against the manifest's checksum the first time an expert is read from it,
/// not once per expert (a device shard can be many gigabytes).
#[derive(Debug)]
pub struct HostShards {
    dep: Deployment,
    /// Per device index: its shard on this host, opened, the manifest's checksum, and whether
    /// the whole file was checked against it.
    opened: std::collections::HashMap<usize, (ShardFile, u32, bool)>,
}

impl HostShards {
    /// Nothing opened yet.
    pub fn new(dep: Deployment) -> Self {
        Self {
            dep,
            opened: std::collections::HashMap::new(),
        }
    }

    /// Routed expert `key` from a shard on this host that holds it (checked), or synthetic
    /// from the seed; `None` when no shard on this host holds it.
    ///
    /// # Errors
    /// A shard that cannot be opened, does not match the manifest, or is damaged.
    pub fn expert(&mut self, key: ExpertKey) -> Result<Option<ExpertWeights>, WeightsError> {
        let Some(w) = self.dep.weights.as_ref() else {
            let (layer, expert) = (key.layer, key.expert);
            return self
                .dep
                .spec
                .synthetic(self.dep.seed)
                .routed(layer, expert)
                .map(Some)
                .map_err(|cause| WeightsError::SyntheticExpert {
                    layer,
                    expert,
                    cause,
                });
        };
        for (i, d) in self.dep.topology.devices().iter().enumerate() {
            match w.manifest.shard_of(d.id()) {
                Some(r) if w.path(&r.file).exists() => {}
                _ => continue,
            }
            if !self.opened.contains_key(&i) {
                let (file, crc) = open_shard_unverified(&self.dep, Some(DeviceRank(i as u32)))?;
                self.opened.insert(i, (file, crc, false));
            }
            let (file, crc, checked) = self.opened.get_mut(&i).expect("opened above");
            let Some(at) = file
                .index()
                .experts
                .iter()
                .position(|e| (e.layer, e.expert) == (key.layer, key.expert))
            else {
                continue;
            };
            if !*checked {
                file.verify(Some(*crc)).map_err(WeightsError::Shard)?;
                *checked = true;
            }
            return file.expert(at).map(Some).map_err(WeightsError::Shard);
        }
        Ok(None)
    }
}

/// A thread checking a shard's whole-file checksum.
type VerifyThread = std::thread::JoinHandle<Result<(), expertmesh_shard::ShardError>>;

/// `file` shared with a thread that checks its whole-file checksum against `crc` while its
/// experts are read.
fn spawn_verify(
    file: ShardFile,
    crc: u32,
) -> Result<(std::sync::Arc<ShardFile>, VerifyThread), WeightsError> {
    let file = std::sync::Arc::new(file);
    let verify = spawn_verify_shared(std::sync::Arc::clone(&file), crc)?;
    Ok((file, verify))
}

/// A thread checking `file`'s whole-file checksum against `crc`.
fn spawn_verify_shared(
    file: std::sync::Arc<ShardFile>,
    crc: u32,
) -> Result<VerifyThread, WeightsError> {
    std::thread::Builder::new()
        .name("shard-verify".into())
        .spawn(move || file.verify(Some(crc)))
        .map_err(WeightsError::ChecksumThread)
}

/// The key and shape of expert entry `e` of `file`.
fn shard_shape(file: &ShardFile, e: &expertmesh_shard::file::ExpertEntry) -> ExpertShape {
    ExpertShape {
        key: ExpertKey {
            layer: e.layer,
            expert: e.expert,
        },
        hidden: file.index().hidden as usize,
        inter: e.inter as usize,
        quant: file.index().quant,
    }
}

/// Experts gathered from several device shards ([`gained_expert_source`]): each shard's
/// checksum runs on its own thread while the experts are copied out, and
/// [`ExpertSource::finish`] fails the load unless every one matches the manifest.
#[derive(Debug, Default)]
struct GainSource {
    entries: Vec<(std::sync::Arc<ShardFile>, usize)>,
    shapes: Vec<ExpertShape>,
    verify: Vec<ShardCheck>,
}

/// A shard's path and the thread checking its checksum.
type ShardCheck = (PathBuf, VerifyThread);

impl ExpertSource for GainSource {
    fn shapes(&self) -> &[ExpertShape] {
        &self.shapes
    }

    fn expert(&mut self, i: usize) -> Result<ExpertWeights, BackendError> {
        let (file, at) = self
            .entries
            .get(i)
            .ok_or_else(|| BackendError::Source(format!("no gained expert {i}")))?;
        file.expert(*at)
            .map_err(|e| BackendError::Source(e.to_string()))
    }

    fn expert_ref(
        &mut self,
        i: usize,
    ) -> Option<Result<(PackedRef<'_>, PackedRef<'_>), BackendError>> {
        let (file, at) = self.entries.get(i)?;
        Some(
            file.expert_ref(*at)
                .map_err(|e| BackendError::Source(e.to_string())),
        )
    }

    fn finish(&mut self) -> Result<(), BackendError> {
        for (path, v) in self.verify.drain(..) {
            match v.join() {
                Ok(r) => r.map_err(|e| BackendError::Source(e.to_string()))?,
                Err(_) => {
                    return Err(BackendError::Source(format!(
                        "{}: the checksum thread panicked",
                        path.display()
                    )));
                }
            }
        }
        Ok(())
    }
}

/// The router's gates: from the router file of converted weights, or synthetic.
#[derive(Debug)]
pub enum Gates {
    /// Synthetic from the seed.
    Synthetic,
    /// Read from the router file.
    File(Box<ShardFile>),
}

impl Gates {
    /// Open the router file when the deployment has converted weights.
    pub fn open(dep: &Deployment) -> Result<Self, WeightsError> {
        Ok(match dep.weights {
            Some(_) => Gates::File(Box::new(open_shard(dep, None)?)),
            None => Gates::Synthetic,
        })
    }

    /// The gate of `layer`.
    pub fn layer(&mut self, dep: &Deployment, layer: u32) -> Result<GateWeights, WeightsError> {
        let spec = &dep.spec;
        let f = match self {
            Gates::Synthetic => {
                return Ok(expertmesh_router::reference::synthetic_gate(
                    spec, dep.seed, layer,
                ));
            }
            Gates::File(f) => f,
        };
        let (e, h) = (spec.routed_experts as usize, spec.hidden as usize);
        let (ws, weight) = f
            .tensor_f32(&gate_weight_name(layer))
            .map_err(WeightsError::Shard)?;
        let (bs, bias) = f
            .tensor_f32(&gate_bias_name(layer))
            .map_err(WeightsError::Shard)?;
        if ws != [e as u64, h as u64] || bs != [e as u64] {
            return Err(WeightsError::GateShape {
                path: f.path().to_path_buf(),
                layer,
                weight: ws,
                bias: bs,
                experts: e,
                hidden: h,
            });
        }
        let shared_gate = if spec.shared_expert_gate {
            let name = expertmesh_shard::shared_gate_name(layer);
            let (gs, g) = f.tensor_f32(&name).map_err(WeightsError::Shard)?;
            if gs != [h as u64] {
                return Err(WeightsError::SharedGateShape {
                    path: f.path().to_path_buf(),
                    name,
                    shape: gs,
                    hidden: h,
                });
            }
            Some(g)
        } else {
            None
        };
        Ok(GateWeights {
            experts: e,
            hidden: h,
            weight,
            bias,
            shared_gate,
        })
    }
}

/// Every expert of `layers`, keyed the way backends and workers key them: routed experts
/// `(layer, e)`, shared experts `(layer, routed_experts + i)`.
pub fn synthetic_keyed_experts(
    spec: &ModelSpec,
    seed: u64,
    layers: &[u32],
) -> Result<Vec<(ExpertKey, ExpertWeights)>, FormatError> {
    let synth = spec.synthetic(seed);
    let mut all = Vec::new();
    for &layer in layers {
        for e in 0..spec.routed_experts {
            all.push((ExpertKey { layer, expert: e }, synth.routed(layer, e)?));
        }
        for i in 0..spec.shared_experts {
            let key = ExpertKey {
                layer,
                expert: spec.routed_experts + i,
            };
            all.push((key, synth.shared(layer, i)?));
        }
    }
    Ok(all)
}

/// The fast in-process reference: one CPU backend (bit-identical to the scalar oracle in exact
/// mode) holding every expert of `layers`, for batches up to `max_tokens`; run layers on it
/// with `expertmesh_router::reference::moe_layer_backend`.
pub fn reference_backend(
    spec: &ModelSpec,
    seed: u64,
    layers: &[u32],
    threads: usize,
    max_tokens: usize,
) -> Result<CpuBackend, ReferenceError> {
    let experts = synthetic_keyed_experts(spec, seed, layers)?;
    let mut backend = CpuBackend::new(threads)?;
    let slots = (spec.top_k + spec.shared_experts) as usize;
    backend.load(
        experts,
        BatchLimits {
            max_tokens,
            max_pairs: max_tokens * slots,
        },
    )?;
    Ok(backend)
}
