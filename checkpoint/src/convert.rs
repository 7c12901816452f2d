//! `expertmesh convert`: a Hugging Face checkpoint folder → a weights folder of one packed-INT4
//! shard per device, a router file and a manifest.
//!
//! Why this exists: serving a real model needs each device's experts in the packed format,
//! split by the placement, checked and ready to map. This is the one pass over the checkpoint
//! that does it: per device, the experts the placement gives it (routed, plus the shared ones
//! placed there) are read one tensor at a time from the mmapped safetensors files and quantized
//! (or imported losslessly) in parallel chunks, then streamed into the device's shard; the
//! router file gets every MoE layer's gate weight, selection bias and shared experts.
//!
//! Memory stays bounded by one chunk of experts (2 × threads) whatever the checkpoint's size.
//! Shards appear atomically ([`ShardWriter`]); a re-run keeps every shard whose job
//! fingerprint and checksum match (resume after a crash or a full disk) and rewrites the rest;
//! the manifest is removed before anything else in the folder changes and written last, so a
//! folder with a manifest is complete.

use crate::experts::{
    ExpertError, ExpertRef, Family, check_expert, expert_tensor_names, fused_expert_tensors,
    read_expert,
};
use crate::safetensors::{Checkpoint, Dtype, SafetensorsError};
use expertmesh_quant::format::ExpertWeights;
use expertmesh_shard::file::{
    FileIdentity, ShardError, ShardFile, ShardIndex, ShardKind, ShardWriter,
};
use expertmesh_shard::manifest::{
    LayerError, MANIFEST_FORMAT, MANIFEST_VERSION, Manifest, ManifestError, ShardRecord,
    SourceFile, SourceInfo,
};
use expertmesh_shard::{
    ROUTER_SHARD_NAME, device_shard_name, gate_bias_name, gate_weight_name, shared_dense_names,
    shared_gate_name,
};
use expertmesh_topology::model::{ModelSpec, Scoring};
use expertmesh_topology::placement::{Placement, SharedLocation};
use expertmesh_topology::topology::{DeviceRank, Topology};
use rayon::prelude::*;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// " (in FILE)" for an error's message, when the file is known.
fn in_file(file: Option<&Path>) -> String {
    file.map(|f| format!(" (in {})", f.display()))
        .unwrap_or_default()
}

/// The model file's name in a weights folder.
pub const MODEL_FILE: &str = "model.toml";
/// The placement file's name in a weights folder.
pub const PLACEMENT_FILE: &str = "placement.toml";

/// Why a conversion failed. Every message names the tensor or file.
#[derive(Debug, thiserror::Error)]
pub enum ConvertError {
    /// Reading or converting one expert failed.
    #[error("layer {layer}, {which}: {source}{}", in_file(file.as_deref().map(PathBuf::as_path)))]
    Expert {
        /// Layer.
        layer: u32,
        /// Which expert.
        which: ExpertRef,
        /// The checkpoint file holding the tensor the error names (of a checkpoint of many
        /// files: the one to re-download).
        /// (A thin box: `Box<Path>` would be two words and the error too large.)
        file: Option<Box<PathBuf>>,
        /// Why.
        #[source]
        source: ExpertError,
    },
    /// Reading a router tensor failed.
    #[error(transparent)]
    Read(#[from] SafetensorsError),
    /// A router tensor has the wrong shape or non-finite values.
    #[error("tensor \"{tensor}\": {reason}")]
    Tensor {
        /// The tensor.
        tensor: String,
        /// What is wrong.
        reason: String,
    },
    /// Writing (or re-reading) a shard failed.
    #[error(transparent)]
    Shard(#[from] ShardError),
    /// Writing the manifest failed.
    #[error(transparent)]
    Manifest(#[from] ManifestError),
    /// Other I/O (the output folder, small files, hashing the source).
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
    /// Another conversion holds the output folder.
    #[error(
        "{}: another `expertmesh convert` is writing into this folder; wait for it to end, or give another --out",
        path.display()
    )]
    OutputBusy {
        /// The output folder.
        path: PathBuf,
    },
    /// A small output file (the manifest, the model or placement copy) could not be written:
    /// the disk is full, or the folder is not writable.
    #[error(
        "{}: writing: {source}; free space on its disk (or let this user write the folder) and run again: shards already finished are kept",
        path.display()
    )]
    Write {
        /// The file.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The placement cannot be served with these weights.
    #[error("{0}")]
    Placement(String),
    /// The thread pool could not be built.
    #[error("starting {threads} conversion threads: {reason}")]
    Threads {
        /// Threads asked for.
        threads: usize,
        /// Why.
        reason: String,
    },
    /// A checkpoint file changed (or went) while it was converted: the shards and the
    /// manifest's hashes would describe different files.
    #[error(
        "{}: {what} during the conversion; run it again once the checkpoint is complete and \
         left alone (what was converted from the old file is redone)",
        path.display()
    )]
    SourceChanged {
        /// The file.
        path: PathBuf,
        /// What changed.
        what: String,
    },
}

/// What identifies a checkpoint file's content on disk (the shard reader's [`FileIdentity`]:
/// size, modification time, device and inode), read when the conversion starts and again
/// before its manifest is written.
fn identity_of(path: &Path) -> std::io::Result<FileIdentity> {
    Ok(FileIdentity::of(&std::fs::metadata(path)?))
}

/// The small files, then (every checkpoint file still the one converted) the manifest, last:
/// a folder with a manifest is complete.
fn write_last(
    job: &ConvertJob<'_>,
    manifest: &Manifest,
    identities: &[(PathBuf, FileIdentity)],
) -> Result<(), ConvertError> {
    write_small(
        job.out,
        MODEL_FILE,
        &expertmesh_topology::model_file::model_to_toml_string(job.spec),
    )?;
    write_small(job.out, PLACEMENT_FILE, job.placement_text)?;
    check_unchanged(identities)?;
    manifest.write(job.out)?;
    Ok(())
}

/// Every file of `before` is still the file it was (not replaced, grown, cut, touched or
/// removed).
fn check_unchanged(before: &[(PathBuf, FileIdentity)]) -> Result<(), ConvertError> {
    for (path, was) in before {
        let what = match identity_of(path) {
            Err(e) => format!("it could not be looked at any more ({e})"),
            Ok(now) if now.device_inode != was.device_inode => {
                "it was replaced by another file".into()
            }
            Ok(now) if now.bytes != was.bytes => {
                format!("its size changed from {} to {} bytes", was.bytes, now.bytes)
            }
            Ok(now) if now.modified != was.modified => "it was modified".into(),
            Ok(_) => continue,
        };
        return Err(ConvertError::SourceChanged {
            path: path.clone(),
            what,
        });
    }
    Ok(())
}

/// Progress of a conversion, for a progress bar.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Progress {
    /// Before anything is written: `shards` an earlier run left in the folder are read whole
    /// for their checksums (those that match this job are kept).
    Verifying {
        /// Shard files found.
        shards: u64,
    },
    /// Shard files read for their checksums (after [`Progress::Verifying`]; they add up to its
    /// count).
    Verified {
        /// Shard files.
        shards: u64,
    },
    /// Before anything is written: the tensors of `experts` experts are checked
    /// ([`check_expert`]).
    Checking {
        /// Experts to convert (each once).
        experts: u64,
    },
    /// Experts whose tensors were checked (after [`Progress::Checking`]; they add up to its
    /// count unless an expert fails its check).
    Checked {
        /// Experts.
        experts: u64,
    },
    /// The work ahead: experts and their source bytes.
    Start {
        /// Experts to convert (every shard's, and the router's shared experts).
        experts: u64,
        /// Source bytes of those experts.
        bytes: u64,
    },
    /// Experts done (converted or kept from an earlier run) and their source bytes.
    Done {
        /// Experts.
        experts: u64,
        /// Source bytes.
        bytes: u64,
    },
}

/// What to convert and where.
#[derive(Debug)]
pub struct ConvertJob<'a> {
    /// The opened checkpoint.
    pub ckpt: &'a Checkpoint,
    /// Its family (tensor names).
    pub family: Family,
    /// The model, with the packed format the shards get.
    pub spec: &'a ModelSpec,
    /// The cluster.
    pub topology: &'a Topology,
    /// Where every expert goes.
    pub placement: &'a Placement,
    /// The placement file's text (copied into the folder).
    pub placement_text: &'a str,
    /// The output folder (created if missing).
    pub out: &'a Path,
    /// Worker threads (≥ 1).
    pub threads: usize,
    /// Keep the shared experts dense at the checkpoint's precision in the router file (see
    /// [`keeps_shared_dense`]) instead of quantizing them.
    pub shared_dense: bool,
}

/// What the conversion did.
#[derive(Clone, Debug)]
pub struct ConvertReport {
    /// The manifest written.
    pub manifest: Manifest,
    /// Shards kept from an earlier run (checksums matched).
    pub shards_kept: usize,
    /// Shards written by this run.
    pub shards_written: usize,
    /// Source bytes of the experts converted by this run.
    pub source_bytes_converted: u64,
    /// Bytes of the shards (the router's included) this run wrote, not those kept.
    pub shard_bytes_written: u64,
    /// Seconds the hashing ran, beside the conversion.
    pub hashing_seconds: f64,
    /// Threads the hashing ran on (the manifest's `source.files` are what it hashed): a
    /// quarter of the job's beside a conversion, all of them when every shard was kept, at
    /// most one per file.
    pub hashing_threads: usize,
}

/// One expert to put into a shard: its key and where it comes from.
#[derive(Clone, Copy, Debug)]
struct Item {
    layer: u32,
    key: u32,
    which: ExpertRef,
    /// Source bytes of its three projections ([`item_bytes`], set by [`job_items`]), for
    /// progress and throughput.
    source_bytes: u64,
}

/// Every expert device `d` pins, in file order: per MoE layer its routed experts in slot
/// order, then the layer's shared experts when the placement puts them on `d`.
fn device_items(spec: &ModelSpec, placement: &Placement, d: DeviceRank) -> Vec<Item> {
    let mut items = Vec::new();
    for layer in spec.moe_layer_ids() {
        for &e in placement.experts_on(d, layer) {
            items.push(Item {
                layer,
                key: e,
                which: ExpertRef::Routed(e),
                source_bytes: 0,
            });
        }
        if placement.shared_location(layer) == Some(SharedLocation::Device(d)) {
            items.extend(shared_items(spec, layer));
        }
    }
    items
}

/// The shared experts of `layer` (keys `routed_experts + i`).
fn shared_items(spec: &ModelSpec, layer: u32) -> impl Iterator<Item = Item> + use<> {
    let routed = spec.routed_experts;
    (0..spec.shared_experts).map(move |i| Item {
        layer,
        key: routed + i,
        which: ExpertRef::Shared,
        source_bytes: 0,
    })
}

/// Convert `job`, reporting progress to `progress`. On an error, every shard already finished
/// stays (a re-run keeps it), the one in progress is removed, and no manifest is written.
pub fn convert(
    job: &ConvertJob<'_>,
    progress: &(dyn Fn(Progress) + Sync),
) -> Result<ConvertReport, ConvertError> {
    let _out_held = hold_output(job)?;
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(job.threads.max(1))
        .build()
        .map_err(|e| ConvertError::Threads {
            threads: job.threads,
            reason: e.to_string(),
        })?;
    let (fingerprint, identities) = fingerprint(job)?;
    check_router_tensors(job)?;
    check_dense_shared_on_router(job)?;
    check_dense_shared_tensors(job)?;
    let Work {
        plans,
        router_items,
        kept,
        router_kept,
        hash_threads,
    } = plan_work(job, &pool, &fingerprint, progress)?;
    withdraw_manifest(job.out)?;
    let devices = job.topology.devices();
    let all = plans.iter().flatten().chain(&router_items);
    let (experts, bytes) = all.fold((0, 0), |(n, b), it| (n + 1, b + it.source_bytes));
    progress(Progress::Start { experts, bytes });
    // Source hashes run beside the conversion (one more reader of the same page cache); a
    // failed conversion stops them, so its error comes without waiting for the whole
    // checkpoint to be read.
    let stop_hashing = AtomicBool::new(false);
    let hashing = std::thread::scope(|s| {
        let hasher = s.spawn(|| {
            let started = std::time::Instant::now();
            let (files, threads) = source_files(job.ckpt, &identities, &stop_hashing, hash_threads);
            (files, started.elapsed().as_secs_f64(), threads)
        });
        let shards = pool.install(|| convert_shards(job, &fingerprint, &plans, &kept, progress));
        let router = match &shards {
            Ok(_) => pool
                .install(|| write_router(job, &fingerprint, &router_items, router_kept, progress)),
            Err(_) => Ok(Default::default()),
        };
        if shards.is_err() || router.is_err() {
            stop_hashing.store(true, Ordering::Relaxed);
        }
        let files = hasher.join().expect("the hashing thread does not panic");
        (shards, router, files)
    });
    let (shards, router, (files, hashing_seconds, hashing_threads)) = hashing;
    let (records, devices_tally) = shards?;
    let (router, router_tally) = router?;
    let files = files?.expect("hashing is stopped only after a failure, returned above");
    let manifest = Manifest {
        format: MANIFEST_FORMAT.into(),
        format_version: MANIFEST_VERSION,
        created_by: format!("expertmesh {}", env!("CARGO_PKG_VERSION")),
        model: job.spec.name.clone(),
        topology: job.topology.name().into(),
        model_file: MODEL_FILE.into(),
        placement_file: PLACEMENT_FILE.into(),
        fingerprint,
        quant: job.spec.quant,
        source: SourceInfo {
            dir: job.ckpt.dir().display().to_string(),
            family: format!("{:?}", job.family),
            weight_format: weight_format(job),
            files,
        },
        shards: records,
        router,
        shared_dense: job.shared_dense,
        layers: layer_errors(job.out, job.spec, devices.len())?,
    };
    write_last(job, &manifest, &identities)?;
    Ok(ConvertReport {
        manifest,
        shards_kept: devices_tally.kept,
        shards_written: devices_tally.written,
        source_bytes_converted: devices_tally.source_bytes + router_tally.source_bytes,
        shard_bytes_written: devices_tally.shard_bytes + router_tally.shard_bytes,
        hashing_seconds,
        hashing_threads,
    })
}

/// Creates and holds the output folder, and removes what a killed conversion left there.
fn hold_output(job: &ConvertJob<'_>) -> Result<expertmesh_files::Held, ConvertError> {
    std::fs::create_dir_all(job.out).map_err(|source| ConvertError::Io {
        path: job.out.to_path_buf(),
        what: "creating the output folder",
        source,
    })?;
    // One conversion at a time per folder: two would withdraw and write each other's
    // manifest and shards (held until the conversion returns; unlocked where the file system
    // has no locks).
    let held = expertmesh_files::lock_folder(job.out).map_err(|source| {
        if source.kind() == std::io::ErrorKind::WouldBlock {
            ConvertError::OutputBusy {
                path: job.out.to_path_buf(),
            }
        } else {
            ConvertError::Io {
                path: job.out.to_path_buf(),
                what: "opening the output folder",
                source,
            }
        }
    })?;
    // A killed conversion's temporary files (a shard's is as large as the shard).
    expertmesh_files::remove_stale_temps(job.out);
    Ok(held)
}

/// What a run converts and what it keeps.
struct Work {
    /// Every device's experts, in file order.
    plans: Vec<Vec<Item>>,
    /// The router file's shared experts.
    router_items: Vec<Item>,
    /// Per device, the size and checksum of the shard an earlier run left whole for this job.
    kept: Vec<Option<(u64, u32)>>,
    /// The same for the router file.
    router_kept: Option<(u64, u32)>,
    /// Threads that hash the source files beside the conversion.
    hash_threads: usize,
}

/// Decides once which shards an earlier run left whole for this job (each read whole for its
/// checksum: on the pool, a shard per thread): those are kept, and only the experts of the
/// others are checked ([`check_experts`]) and converted.
fn plan_work(
    job: &ConvertJob<'_>,
    pool: &rayon::ThreadPool,
    fingerprint: &str,
    progress: &(dyn Fn(Progress) + Sync),
) -> Result<Work, ConvertError> {
    let (plans, router_items) = job_items(job);
    // Every shard of the job: (its path, the device it is for, its experts); the router's last.
    let shards: Vec<(PathBuf, Option<&str>, &[Item])> = job
        .topology
        .devices()
        .iter()
        .zip(&plans)
        .map(|(d, items)| {
            let path = job.out.join(device_shard_name(d.rank().0));
            (path, Some(d.id()), items.as_slice())
        })
        .chain(std::iter::once((
            job.out.join(ROUTER_SHARD_NAME),
            None,
            router_items.as_slice(),
        )))
        .collect();
    let found: Vec<bool> = shards.iter().map(|(path, ..)| path.is_file()).collect();
    let n_found = found.iter().filter(|&&f| f).count() as u64;
    if n_found > 0 {
        progress(Progress::Verifying { shards: n_found });
    }
    let mut kept: Vec<Option<(u64, u32)>> = pool.install(|| {
        shards
            .par_iter()
            .zip(&found)
            .map(|((path, device, items), &found)| {
                let kept = reusable(path, fingerprint, *device, items);
                if found {
                    progress(Progress::Verified { shards: 1 });
                }
                kept
            })
            .collect()
    });
    let router_kept = kept.pop().flatten();
    let to_convert: Vec<&Item> = plans
        .iter()
        .zip(&kept)
        .filter(|(_, k)| k.is_none())
        .flat_map(|(items, _)| items)
        .chain(router_items.iter().filter(|_| router_kept.is_none()))
        .collect();
    check_experts(job, pool, &to_convert, progress)?;
    // Hashing runs beside the conversion: a quarter of its threads keep pace with quantizing
    // ones (SHA-256 runs ~1.6 GB/s a core, quantizing ~0.07), every thread when nothing is
    // converted (a resumed run whose shards are all kept is nothing but the hash).
    let hash_threads = if to_convert.is_empty() {
        job.threads
    } else {
        (job.threads / 4).max(1)
    };
    Ok(Work {
        plans,
        router_items,
        kept,
        router_kept,
        hash_threads,
    })
}

/// Remove an earlier run's manifest before any file of the folder changes: a folder with a
/// manifest is complete, and this run's shards, model and placement files would otherwise sit
/// beside the old manifest if it failed (workers would refuse the shards as foreign, naming
/// the wrong cause). A run that keeps every shard writes the manifest again at its end.
fn withdraw_manifest(out: &Path) -> Result<(), ConvertError> {
    let path = out.join(expertmesh_shard::manifest::MANIFEST_FILE);
    match std::fs::remove_file(&path) {
        Ok(()) => {
            // The removal reaches the disk before any shard is replaced.
            expertmesh_files::sync_parent(&path);
            Ok(())
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(ConvertError::Io {
            path,
            what: "removing the earlier run's manifest before converting again",
            source,
        }),
    }
}

/// Dense (unquantized) shared experts run on the router: a placement that puts a layer's
/// shared experts on a device cannot keep them dense.
fn check_dense_shared_on_router(job: &ConvertJob<'_>) -> Result<(), ConvertError> {
    if job.shared_dense
        && let Some(l) = job.spec.moe_layer_ids().into_iter().find(|&l| {
            matches!(
                job.placement.shared_location(l),
                Some(SharedLocation::Device(_))
            )
        })
    {
        return Err(ConvertError::Placement(format!(
            "the placement runs layer {l}'s shared experts on a device, but this checkpoint \
             keeps them unquantized and dense shared experts run on the router: place shared \
             experts on the router, or pass --quantize-shared to quantize them to INT4"
        )));
    }
    Ok(())
}

/// Before anything is written: every MoE layer's unquantized shared-expert tensors (kept
/// dense on the router) are in the checkpoint with the model's shapes and a plain float type
/// (headers only), so one missing or of another shape in a late layer fails the run before
/// the device shards are converted, not after.
fn check_dense_shared_tensors(job: &ConvertJob<'_>) -> Result<(), ConvertError> {
    if !job.shared_dense {
        return Ok(());
    }
    for layer in job.spec.moe_layer_ids() {
        let names =
            expert_tensor_names(job.family, layer, ExpertRef::Shared).map_err(|source| {
                ConvertError::Expert {
                    layer,
                    which: ExpertRef::Shared,
                    file: None,
                    source,
                }
            })?;
        for (name, shape) in names.iter().zip(shared_dense_shapes(job.spec)) {
            plain_tensor(job.ckpt, name, &shape)?;
        }
    }
    Ok(())
}

/// The shapes of a shared expert's gate, up and down projections (`[F, H]`, `[F, H]`,
/// `[H, F]`), as the checkpoint keeps them.
fn shared_dense_shapes(spec: &ModelSpec) -> [[usize; 2]; 3] {
    let (h, f) = (spec.hidden as usize, spec.shared_intermediate as usize);
    [[f, h], [f, h], [h, f]]
}

/// The experts of each device's shard (topology order) and those of the router file (the
/// shared experts, quantized, unless kept dense there).
fn job_items(job: &ConvertJob<'_>) -> (Vec<Vec<Item>>, Vec<Item>) {
    let mut plans: Vec<Vec<Item>> = job
        .topology
        .devices()
        .iter()
        .map(|d| device_items(job.spec, job.placement, d.rank()))
        .collect();
    let mut router_items = if job.shared_dense {
        Vec::new()
    } else {
        job.spec
            .moe_layer_ids()
            .into_iter()
            .flat_map(|l| shared_items(job.spec, l))
            .collect()
    };
    // Sized once per expert (replicas share their source).
    let mut sizes = std::collections::HashMap::new();
    for it in plans.iter_mut().flatten().chain(&mut router_items) {
        it.source_bytes = *sizes
            .entry((it.layer, it.which))
            .or_insert_with(|| item_bytes(job, it.layer, it.which));
    }
    (plans, router_items)
}

type ShardsResult = Result<(Vec<ShardRecord>, Tally), ConvertError>;

/// What a run did with its shards.
#[derive(Clone, Copy, Debug, Default)]
struct Tally {
    /// Shards kept from an earlier run.
    kept: usize,
    /// Shards written.
    written: usize,
    /// Source bytes of the experts converted into the written shards.
    source_bytes: u64,
    /// Bytes of the written shards.
    shard_bytes: u64,
}

/// Every device's shard: kept where `kept` holds an earlier run's (its size and checksum,
/// [`reusable`]), written otherwise.
fn convert_shards(
    job: &ConvertJob<'_>,
    fingerprint: &str,
    plans: &[Vec<Item>],
    kept: &[Option<(u64, u32)>],
    progress: &(dyn Fn(Progress) + Sync),
) -> ShardsResult {
    let (mut records, mut tally) = (Vec::new(), Tally::default());
    for ((d, items), kept) in job.topology.devices().iter().zip(plans).zip(kept) {
        let name = device_shard_name(d.rank().0);
        let path = job.out.join(&name);
        let bytes: u64 = items.iter().map(|it| it.source_bytes).sum();
        let summary = match *kept {
            Some(s) => {
                tally.kept += 1;
                progress(Progress::Done {
                    experts: items.len() as u64,
                    bytes,
                });
                s
            }
            None => {
                let index = empty_index(job, fingerprint, ShardKind::Device, Some(d.id()));
                let mut w = ShardWriter::create(&path, index)?;
                write_experts(job, items, &mut w, progress)?;
                let s = w.finish()?;
                tally.written += 1;
                tally.source_bytes += bytes;
                tally.shard_bytes += s.bytes;
                (s.bytes, s.crc32c)
            }
        };
        records.push(ShardRecord {
            device: d.id().to_string(),
            file: name,
            bytes: summary.0,
            crc32c: summary.1,
            experts: items.len() as u64,
        });
    }
    Ok((records, tally))
}

fn empty_index(
    job: &ConvertJob<'_>,
    fingerprint: &str,
    kind: ShardKind,
    device: Option<&str>,
) -> ShardIndex {
    ShardIndex {
        kind,
        fingerprint: fingerprint.to_string(),
        device: device.map(str::to_string),
        quant: job.spec.quant,
        hidden: u64::from(job.spec.hidden),
        experts: Vec::new(),
        tensors: Vec::new(),
    }
}

/// An earlier run's shard at `path` that can be kept: same job, same experts, body intact.
/// Returns its size and whole-file checksum.
fn reusable(
    path: &Path,
    fingerprint: &str,
    device: Option<&str>,
    items: &[Item],
) -> Option<(u64, u32)> {
    let f = ShardFile::open(path).ok()?;
    let idx = f.index();
    let same = idx.fingerprint == fingerprint
        && idx.device.as_deref() == device
        && idx.experts.len() == items.len()
        && idx
            .experts
            .iter()
            .zip(items)
            .all(|(e, it)| e.layer == it.layer && e.expert == it.key);
    if !same {
        return None;
    }
    Some((f.len(), f.verified_crc32c().ok()?))
}

/// The experts to convert checked before anything is written ([`check_expert`]: their
/// tensors' headers and the small tensors beside them, no weight read): a checkpoint missing
/// an expert of its last layer, or holding one in another shape or dtype, fails in seconds
/// naming it, not after every layer before it was converted, and an earlier run's complete
/// output stays as it was. Each expert is checked once (replicas share it); the first failing
/// one in `items` order (device shards in rank order, then the router's) is named.
fn check_experts(
    job: &ConvertJob<'_>,
    pool: &rayon::ThreadPool,
    items: &[&Item],
    progress: &(dyn Fn(Progress) + Sync),
) -> Result<(), ConvertError> {
    let mut seen = std::collections::HashSet::new();
    let items: Vec<&Item> = items
        .iter()
        .copied()
        .filter(|it| seen.insert((it.layer, it.which)))
        .collect();
    if !items.is_empty() {
        progress(Progress::Checking {
            experts: items.len() as u64,
        });
    }
    let failed = pool.install(|| {
        items.par_iter().find_map_first(|it| {
            let checked = check_expert(job.ckpt, job.spec, job.family, it.layer, it.which);
            progress(Progress::Checked { experts: 1 });
            checked.err().map(|source| expert_error(job, it, source))
        })
    });
    failed.map_or(Ok(()), Err)
}

/// `source`, an error of expert `it`, with the checkpoint file holding the tensor it names.
fn expert_error(job: &ConvertJob<'_>, it: &Item, source: ExpertError) -> ConvertError {
    ConvertError::Expert {
        layer: it.layer,
        which: it.which,
        file: source
            .tensor()
            .and_then(|t| job.ckpt.file_of(t))
            .map(|f| Box::new(f.to_path_buf())),
        source,
    }
}

/// Convert `items` in parallel chunks and append them to `w` in order. After the first
/// failure the remaining items of the chunk are skipped; the first failure in item order is
/// returned.
fn write_experts(
    job: &ConvertJob<'_>,
    items: &[Item],
    w: &mut ShardWriter,
    progress: &(dyn Fn(Progress) + Sync),
) -> Result<(), ConvertError> {
    let chunk = 2 * rayon::current_num_threads().max(1);
    let failed = AtomicBool::new(false);
    for part in items.chunks(chunk) {
        let done: Vec<Option<Result<(ExpertWeights, f64), ConvertError>>> = part
            .par_iter()
            .map(|it| {
                if failed.load(Ordering::Relaxed) {
                    return None;
                }
                let r = read_expert(job.ckpt, job.spec, job.family, it.layer, it.which)
                    .map_err(|source| expert_error(job, it, source));
                failed.fetch_or(r.is_err(), Ordering::Relaxed);
                Some(r)
            })
            .collect();
        let mut converted = Vec::with_capacity(part.len());
        for r in done.into_iter().flatten() {
            converted.push(r?);
        }
        for ((weights, err), it) in converted.into_iter().zip(part) {
            w.add_expert(it.layer, it.key, &weights, err)?;
            progress(Progress::Done {
                experts: 1,
                bytes: it.source_bytes,
            });
        }
    }
    Ok(())
}

/// The router file: every MoE layer's gate weight and selection bias (f32), and every shared
/// expert.
fn write_router(
    job: &ConvertJob<'_>,
    fingerprint: &str,
    shared: &[Item],
    kept: Option<(u64, u32)>,
    progress: &(dyn Fn(Progress) + Sync),
) -> Result<(ShardRecord, Tally), ConvertError> {
    let path = job.out.join(ROUTER_SHARD_NAME);
    let bytes: u64 = shared.iter().map(|it| it.source_bytes).sum();
    let summary = match kept {
        Some(s) => {
            progress(Progress::Done {
                experts: shared.len() as u64,
                bytes,
            });
            (s, Tally::default())
        }
        None => {
            let index = empty_index(job, fingerprint, ShardKind::Router, None);
            let mut w = ShardWriter::create(&path, index)?;
            for (layer, t) in router_tensors(job) {
                let (weight, bias) = read_gate(job, &t)?;
                let (e, h) = (
                    u64::from(job.spec.routed_experts),
                    u64::from(job.spec.hidden),
                );
                w.add_tensor_f32(&gate_weight_name(layer), &[e, h], &weight)?;
                w.add_tensor_f32(&gate_bias_name(layer), &[e], &bias)?;
                if let Some((name, shape)) = &t.shared_gate {
                    let g = read_f32(job.ckpt, name, shape)?;
                    w.add_tensor_f32(&shared_gate_name(layer), &[h], &g)?;
                }
                if job.shared_dense {
                    write_dense_shared(job, layer, &mut w)?;
                }
            }
            write_experts(job, shared, &mut w, progress)?;
            let s = w.finish()?;
            let tally = Tally {
                source_bytes: bytes,
                shard_bytes: s.bytes,
                ..Tally::default()
            };
            ((s.bytes, s.crc32c), tally)
        }
    };
    Ok((
        ShardRecord {
            device: "router".into(),
            file: ROUTER_SHARD_NAME.into(),
            bytes: summary.0.0,
            crc32c: summary.0.1,
            experts: shared.len() as u64,
        },
        summary.1,
    ))
}

/// Whether the checkpoint keeps its shared experts unquantized on purpose: the routed experts
/// are stored INT4 (pack-quantized, GPTQ or AWQ) while the shared experts are plain floats
/// (Kimi K2-Thinking lists them in its quantization config's `ignore`). Such shared experts are
/// served at that precision by default, so the whole layer is served losslessly.
pub fn keeps_shared_dense(ckpt: &Checkpoint, spec: &ModelSpec, family: Family) -> bool {
    let Some(&layer) = spec.moe_layer_ids().first() else {
        return false;
    };
    if spec.shared_experts == 0 || !family.has_shared_expert() {
        return false;
    }
    let Ok(shared) = expert_tensor_names(family, layer, ExpertRef::Shared) else {
        return false;
    };
    let routed_int4 = routed_is_int4(ckpt, spec, family);
    // All three projections: one stored otherwise (FP8 with its scales) is quantized
    // through the expert reader, which applies them.
    let shared_float = shared.iter().all(|name| {
        ckpt.tensor_info(name)
            .is_ok_and(|i| is_plain_float(i.dtype))
    });
    routed_int4 && shared_float
}

/// Whether the checkpoint stores its routed experts as INT4 (compressed-tensors
/// `pack-quantized`, GPTQ or AWQ), judged by routed expert 0 of the first MoE layer.
pub fn routed_is_int4(ckpt: &Checkpoint, spec: &ModelSpec, family: Family) -> bool {
    let Some(&layer) = spec.moe_layer_ids().first() else {
        return false;
    };
    let Ok([routed, ..]) = expert_tensor_names(family, layer, ExpertRef::Routed(0)) else {
        return false;
    };
    let base = routed.strip_suffix(".weight").unwrap_or(&routed);
    !ckpt.contains(&routed)
        && ["weight_packed", "qweight"]
            .iter()
            .any(|s| ckpt.contains(&format!("{base}.{s}")))
}

/// `layer`'s shared experts as dense tensors at the checkpoint's precision (BF16 bits copied;
/// F16 and F32 widened to f32 exactly), shapes and values checked.
fn write_dense_shared(
    job: &ConvertJob<'_>,
    layer: u32,
    w: &mut ShardWriter,
) -> Result<(), ConvertError> {
    let names = expert_tensor_names(job.family, layer, ExpertRef::Shared).map_err(|source| {
        ConvertError::Expert {
            layer,
            which: ExpertRef::Shared,
            file: None,
            source,
        }
    })?;
    let shapes = shared_dense_shapes(job.spec);
    for i in 0..job.spec.shared_experts {
        let out = shared_dense_names(layer, i);
        for ((src, dst), shape) in names.iter().zip(&out).zip(shapes) {
            let values = read_f32(job.ckpt, src, &shape)?;
            let dims = [shape[0] as u64, shape[1] as u64];
            if job.ckpt.tensor_info(src)?.dtype == Dtype::BF16 {
                let bits: Vec<u16> = values.iter().map(|v| (v.to_bits() >> 16) as u16).collect();
                w.add_tensor_bf16(dst, &dims, &bits)?;
            } else {
                w.add_tensor_f32(dst, &dims, &values)?;
            }
        }
    }
    Ok(())
}

/// The checkpoint names of `layer`'s gate weight and (sigmoid-bias families) selection bias.
pub fn gate_tensor_names(family: Family, layer: u32) -> (String, Option<String>) {
    let p = format!("model.layers.{layer}");
    match family {
        Family::Mixtral => (format!("{p}.block_sparse_moe.gate.weight"), None),
        Family::DeepseekV3 | Family::Glm4Moe => (
            format!("{p}.mlp.gate.weight"),
            Some(format!("{p}.mlp.gate.e_score_correction_bias")),
        ),
        Family::Qwen3Moe | Family::Qwen2Moe | Family::Olmoe => {
            (format!("{p}.mlp.gate.weight"), None)
        }
    }
}

/// The router file's tensors of each MoE layer read from the checkpoint, with their shapes:
/// the gate weight `[E, H]`, the selection bias `[E]` where the scoring has one (not for
/// `topk_method = "greedy"`, whose bias is zero), and Qwen2's shared-expert gate `[1, H]`.
fn router_tensors(job: &ConvertJob<'_>) -> Vec<(u32, RouterTensors)> {
    let (e, h) = (job.spec.routed_experts as usize, job.spec.hidden as usize);
    let bias_stored =
        job.spec.scoring == Scoring::SigmoidBias && !crate::hf_config::greedy_topk(job.ckpt.dir());
    let tensors = |layer: u32| {
        let (mut wname, bname) = gate_tensor_names(job.family, layer);
        // transformers v5 saves Mixtral's `block_sparse_moe` as `mlp` (its fused experts are
        // found there too: `experts::fused_expert_tensors`).
        let v5 = format!("model.layers.{layer}.mlp.gate.weight");
        if !job.ckpt.contains(&wname) && job.ckpt.contains(&v5) {
            wname = v5;
        }
        let shared_gate = job.spec.shared_expert_gate.then(|| {
            let name = format!("model.layers.{layer}.mlp.shared_expert_gate.weight");
            (name, vec![1, h])
        });
        RouterTensors {
            gate: (wname, vec![e, h]),
            bias: bname.filter(|_| bias_stored).map(|b| (b, vec![e])),
            shared_gate,
        }
    };
    let layers = job.spec.moe_layer_ids().into_iter();
    layers.map(|l| (l, tensors(l))).collect()
}

/// One layer's router tensors in the checkpoint: (name, shape) of each ([`router_tensors`]).
struct RouterTensors {
    gate: (String, Vec<usize>),
    bias: Option<(String, Vec<usize>)>,
    shared_gate: Option<(String, Vec<usize>)>,
}

/// Checks, from the headers alone, that every router tensor is there with its shape, before
/// any shard is written: a missing gate is named at once, not after hours of expert
/// conversion.
fn check_router_tensors(job: &ConvertJob<'_>) -> Result<(), ConvertError> {
    for (_, t) in router_tensors(job) {
        let all = std::iter::once(&t.gate)
            .chain(&t.bias)
            .chain(&t.shared_gate);
        for (name, shape) in all {
            plain_tensor(job.ckpt, name, shape)?;
        }
    }
    Ok(())
}

/// A layer's gate weight `[E, H]` and selection bias `[E]` (zero where the checkpoint stores
/// none, see [`router_tensors`]) as f32, shapes and values checked.
fn read_gate(
    job: &ConvertJob<'_>,
    t: &RouterTensors,
) -> Result<(Vec<f32>, Vec<f32>), ConvertError> {
    let e = job.spec.routed_experts as usize;
    let weight = read_f32(job.ckpt, &t.gate.0, &t.gate.1)?;
    let bias = match &t.bias {
        Some((b, shape)) => read_f32(job.ckpt, b, shape)?,
        None => vec![0.0; e],
    };
    Ok((weight, bias))
}

/// Tensor `name`, which must be stored as plain floats ([`plain_float`]) and have `shape`.
fn plain_tensor<'c>(
    ckpt: &'c Checkpoint,
    name: &str,
    shape: &[usize],
) -> Result<crate::safetensors::TensorView<'c>, ConvertError> {
    let view = ckpt.tensor(name)?;
    // The dtype first: a tensor another quantizer packed has another shape too, and is named
    // for its dtype, not as a mismatch with config.json.
    plain_float(name, &view)?;
    if view.shape() != shape {
        return Err(ConvertError::Tensor {
            tensor: name.into(),
            reason: format!(
                "shape {:?} but the model needs {shape:?}; the checkpoint does not match its \
                 config.json",
                view.shape()
            ),
        });
    }
    Ok(view)
}

/// Whether tensors of `dtype` hold their values as they are (no block scale beside them).
fn is_plain_float(dtype: Dtype) -> bool {
    matches!(dtype, Dtype::BF16 | Dtype::F16 | Dtype::F32 | Dtype::F64)
}

/// `view` (tensor `name`) unless it is not a plain float: an FP8 router or dense shared
/// tensor read as it is would skip its scales (`…_scale_inv`, `…_scale`) and give wrong values.
fn plain_float<'v, 'c>(
    name: &str,
    view: &'v crate::safetensors::TensorView<'c>,
) -> Result<&'v crate::safetensors::TensorView<'c>, ConvertError> {
    if is_plain_float(view.dtype()) {
        return Ok(view);
    }
    Err(ConvertError::Tensor {
        tensor: name.into(),
        reason: format!(
            "stored as {}, but the router's tensors (gate weight, selection bias, shared-expert \
             gate) and unquantized shared experts are read as they are, so they must be BF16, \
             F16, F32 or F64; an FP8 checkpoint keeps them in one of those",
            view.dtype().name()
        ),
    })
}

fn read_f32(ckpt: &Checkpoint, name: &str, shape: &[usize]) -> Result<Vec<f32>, ConvertError> {
    let v = plain_tensor(ckpt, name, shape)?.to_f32_vec()?;
    if let Some(i) = v.iter().position(|x| !x.is_finite()) {
        return Err(ConvertError::Tensor {
            tensor: name.into(),
            reason: format!(
                "element {i} is not finite ({}); the checkpoint is corrupt: re-download it",
                v[i]
            ),
        });
    }
    Ok(v)
}

/// Source bytes of one expert (its three projections in whatever stored form), for progress
/// and throughput.
fn item_bytes(job: &ConvertJob<'_>, layer: u32, which: ExpertRef) -> u64 {
    let Ok(names) = expert_tensor_names(job.family, layer, which) else {
        return 0;
    };
    if let (ExpertRef::Routed(_), false) = (which, job.ckpt.contains(&names[0]))
        && let Some(fused) = fused_expert_tensors(job.ckpt, job.family, layer)
    {
        // One expert's share of the layer's fused tensors.
        let experts = u64::from(job.spec.routed_experts.max(1));
        let bytes = |n: &String| job.ckpt.tensor_info(n).map_or(0, |i| i.num_bytes() as u64);
        return fused.iter().map(bytes).sum::<u64>() / experts;
    }
    const SUFFIXES: [&str; 9] = [
        "weight",
        "weight_scale_inv",
        "weight_packed",
        "weight_scale",
        "qweight",
        "qzeros",
        "scales",
        "g_idx",
        "weight_shape",
    ];
    let mut total = 0;
    for n in &names {
        let base = n.strip_suffix(".weight").unwrap_or(n);
        for s in SUFFIXES {
            if let Ok(info) = job.ckpt.tensor_info(&format!("{base}.{s}")) {
                total += info.num_bytes() as u64;
            }
        }
    }
    total
}

/// How the experts are stored in the source, for the manifest.
fn weight_format(job: &ConvertJob<'_>) -> String {
    let Some(&layer) = job.spec.moe_layer_ids().first() else {
        return "none".into();
    };
    let Ok([gate, ..]) = expert_tensor_names(job.family, layer, ExpertRef::Routed(0)) else {
        return "unknown".into();
    };
    let base = gate.strip_suffix(".weight").unwrap_or(&gate);
    if let Ok(info) = job.ckpt.tensor_info(&gate) {
        return info.dtype.to_string().to_lowercase();
    }
    if let Some([gate_up, _]) = fused_expert_tensors(job.ckpt, job.family, layer)
        && let Ok(info) = job.ckpt.tensor_info(&gate_up)
    {
        return format!("{} (fused experts)", info.dtype.to_string().to_lowercase());
    }
    if job.ckpt.contains(&format!("{base}.weight_packed")) {
        return "pack-quantized".into();
    }
    if job.ckpt.contains(&format!("{base}.qweight")) {
        let q = crate::gptq_import::quant_config_of(job.ckpt).ok();
        let method = q.and_then(|q| q.method.as_deref());
        let format = q.and_then(|q| q.checkpoint_format.as_deref());
        return match (method, format) {
            (Some("gptq"), Some(f)) => format!("gptq ({f})"),
            (Some(m), _) => m.to_string(),
            (None, _) => "gptq-or-awq".into(),
        };
    }
    "unknown".into()
}

/// The job's identity: converter version, model, placement, topology name, the checkpoint's
/// `config.json` and `quantize_config.json` (whole: their quantization settings, such as
/// GPTQ's `checkpoint_format` or `sym`, change how INT4 codes are read), and each source file's
/// name, size, modification time and safetensors header. A kept shard must match it.
///
/// The modification time stands in for the tensor data, which is hashed only while the
/// conversion runs (the manifest's `source.files`): weights downloaded again in place, or a
/// new snapshot of a revision, have the same names, sizes and headers, and without it their
/// re-run would keep shards converted from the old bytes. A copied checkpoint (new times,
/// same bytes) is converted again: the safe side. Returned with each file's identity as read
/// here (what [`check_unchanged`] compares before the manifest).
fn fingerprint(
    job: &ConvertJob<'_>,
) -> Result<(String, Vec<(PathBuf, FileIdentity)>), ConvertError> {
    // Every file opened and checked first (truncated, a header that does not fit it), so a
    // damaged one is named with what to do before any output changes.
    job.ckpt.open_all()?;
    let mut h = Sha256::new();
    h.update(env!("CARGO_PKG_VERSION").as_bytes());
    h.update(expertmesh_topology::model_file::model_to_toml_string(job.spec).as_bytes());
    h.update(job.placement_text.as_bytes());
    h.update(job.topology.name().as_bytes());
    for name in ["config.json", crate::gptq_import::GPTQ_CONFIG_FILE] {
        let path = job.ckpt.dir().join(name);
        // Absent and empty differ: the length goes in first. Read within the bound every
        // configuration read keeps (a larger file is refused where it is parsed).
        let text = match crate::hf_config::read_bounded(&path) {
            Ok(bytes) => Some(bytes),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(source) => {
                return Err(ConvertError::Io {
                    path,
                    what: "reading the checkpoint's configuration",
                    source,
                });
            }
        };
        h.update(name.as_bytes());
        h.update(
            text.as_ref()
                .map_or(u64::MAX, |t| t.len() as u64)
                .to_le_bytes(),
        );
        h.update(text.unwrap_or_default());
    }
    let mut identities = Vec::new();
    for path in job.ckpt.files() {
        let io = |source| ConvertError::Io {
            path: path.to_path_buf(),
            what: "reading the header",
            source,
        };
        let mut f = std::fs::File::open(path).map_err(io)?;
        let meta = f.metadata().map_err(io)?;
        identities.push((path.to_path_buf(), FileIdentity::of(&meta)));
        let len = meta.len();
        // Nanoseconds since the epoch; a file system without times hashes a marker.
        let modified = meta
            .modified()
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(u128::MAX, |d| d.as_nanos());
        let mut head = vec![0u8; 8];
        f.read_exact(&mut head).map_err(io)?;
        // A corrupt length reads no more than a valid header can hold (the reader refuses
        // the file later, naming the problem).
        let n = u64::from_le_bytes(head[..8].try_into().expect("8 bytes"))
            .min(len)
            .min(crate::safetensors::MAX_HEADER_LEN);
        let mut header = Vec::new();
        f.take(n).read_to_end(&mut header).map_err(io)?;
        h.update(path.file_name().unwrap_or_default().as_encoded_bytes());
        h.update(len.to_le_bytes());
        h.update(modified.to_le_bytes());
        h.update(&header);
    }
    Ok((hex(&h.finalize()), identities))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// `config.json` and every safetensors file, in that order: name, size, SHA-256; `None` once
/// `stop` is set. Files are hashed on up to `threads` threads, largest first: SHA-256 runs at
/// about 1.5-2 GB/s per core, so one thread would hash a trillion-parameter checkpoint
/// (0.6-1 TB) slower than many cores convert or import it. A failure stops the other
/// threads; the error returned is the first, in file order, of those that failed. Sizes come
/// from `identities` (the fingerprint's); also returns the threads used.
fn source_files(
    ckpt: &Checkpoint,
    identities: &[(PathBuf, FileIdentity)],
    stop: &AtomicBool,
    threads: usize,
) -> (HashedFiles, usize) {
    let config = ckpt.dir().join("config.json");
    // config.json may be absent (it is hashed where it exists); a checkpoint file is not:
    // one gone is an error here.
    let paths: Vec<&Path> = std::iter::once(config.as_path())
        .filter(|p| p.exists())
        .chain(ckpt.files())
        .collect();
    let size = |p: &Path| {
        let known = identities.iter().find(|(q, _)| q == p);
        known.map_or(0, |(_, id)| id.bytes)
    };
    let mut order: Vec<usize> = (0..paths.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(size(paths[i])));
    let threads = threads.clamp(1, paths.len().max(1));
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let stopped = || stop.load(Ordering::Relaxed) || failed.load(Ordering::Relaxed);
    let hashed: Vec<std::sync::OnceLock<HashOutcome>> =
        paths.iter().map(|_| std::sync::OnceLock::new()).collect();
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                while let Some(&i) = order.get(next.fetch_add(1, Ordering::Relaxed)) {
                    let r = hash_file(paths[i], &stopped);
                    failed.fetch_or(r.is_err(), Ordering::Relaxed);
                    let _ = hashed[i].set(r);
                }
            });
        }
    });
    // In file order: the first error, else `None` if any hash stopped (or never started).
    let mut files = Vec::with_capacity(paths.len());
    let mut complete = true;
    for h in hashed {
        match h.into_inner() {
            Some(Err(e)) => return (Err(e), threads),
            Some(Ok(Some(f))) => files.push(f),
            Some(Ok(None)) | None => complete = false,
        }
    }
    (Ok(complete.then_some(files)), threads)
}

/// The source files' records, `None` when the hashing was stopped.
type HashedFiles = Result<Option<Vec<SourceFile>>, ConvertError>;

/// What hashing one file gave: its record, `None` when stopped, or the error.
type HashOutcome = Result<Option<SourceFile>, ConvertError>;

/// One file's name, size and SHA-256, read a MiB at a time; `None` once `stopped()`.
fn hash_file(path: &Path, stopped: &dyn Fn() -> bool) -> HashOutcome {
    let io = |source| ConvertError::Io {
        path: path.to_path_buf(),
        what: "hashing",
        source,
    };
    let mut f = std::fs::File::open(path).map_err(io)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut bytes = 0u64;
    loop {
        if stopped() {
            return Ok(None);
        }
        let n = f.read(&mut buf).map_err(io)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        bytes += n as u64;
    }
    Ok(Some(SourceFile {
        name: path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        bytes,
        sha256: hex(&h.finalize()),
    }))
}

/// Write a small text file whole or not at all ([`expertmesh_files::write_whole`]).
fn write_small(dir: &Path, name: &str, text: &str) -> Result<(), ConvertError> {
    let path = dir.join(name);
    expertmesh_files::write_whole(&path, text.as_bytes(), None)
        .map_err(|source| ConvertError::Write { path, source })
}

/// Per-layer conversion error over every shard of the folder (device shards only: the
/// router's shared experts are also counted when no device holds them).
fn layer_errors(
    out: &Path,
    spec: &ModelSpec,
    devices: usize,
) -> Result<Vec<LayerError>, ConvertError> {
    let mut by_layer: BTreeMap<u32, (u64, f64, f64, Vec<u32>)> = BTreeMap::new();
    let mut add = |f: &ShardFile, only_new: bool| {
        for e in &f.index().experts {
            let entry = by_layer.entry(e.layer).or_insert((0, 0.0, 0.0, Vec::new()));
            if only_new && entry.3.contains(&e.expert) {
                continue;
            }
            entry.3.push(e.expert);
            entry.0 += 1;
            entry.1 += e.rel_error;
            entry.2 = entry.2.max(e.rel_error);
        }
    };
    for d in 0..devices {
        add(
            &ShardFile::open(&out.join(device_shard_name(d as u32)))?,
            true,
        );
    }
    add(&ShardFile::open(&out.join(ROUTER_SHARD_NAME))?, true);
    Ok(spec
        .moe_layer_ids()
        .into_iter()
        .map(|layer| {
            let (n, sum, max, _) = by_layer.remove(&layer).unwrap_or_default();
            LayerError {
                layer,
                experts: n,
                rel_error_mean: if n == 0 { 0.0 } else { sum / n as f64 },
                rel_error_max: max,
            }
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A checkpoint file replaced (a re-download renamed over it), cut, touched or removed
    /// between the start and the manifest is named; one left alone is not.
    #[test]
    fn a_checkpoint_file_that_changed_during_the_conversion_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors");
        let ids = |p: &Path| vec![(p.to_path_buf(), identity_of(p).unwrap())];
        std::fs::write(&path, b"0123456789").unwrap();
        let before = ids(&path);
        check_unchanged(&before).unwrap();
        let changed = |what: &str| {
            let e = check_unchanged(&before).unwrap_err();
            assert!(
                matches!(&e, ConvertError::SourceChanged { path: p, .. } if p == &path)
                    && e.to_string().contains(what),
                "{e}"
            );
        };
        // Replaced by another file of the same size (a rename over it).
        let other = dir.path().join("new");
        std::fs::write(&other, b"abcdefghij").unwrap();
        std::fs::rename(&other, &path).unwrap();
        changed("replaced");
        let before = ids(&path);
        // Cut in place.
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(4)
            .unwrap();
        let e = check_unchanged(&before).unwrap_err().to_string();
        assert!(e.contains("from 10 to 4 bytes"), "{e}");
        // Modified in place, same size.
        let before = ids(&path);
        let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        f.set_modified(std::time::SystemTime::UNIX_EPOCH).unwrap();
        drop(f);
        let e = check_unchanged(&before).unwrap_err().to_string();
        assert!(e.contains("modified"), "{e}");
        // Removed.
        let before = ids(&path);
        std::fs::remove_file(&path).unwrap();
        let e = check_unchanged(&before).unwrap_err().to_string();
        assert!(e.contains("could not be looked at"), "{e}");
    }

    /// Files hashed on several threads come back in file order, each the SHA-256 of its own
    /// bytes, whatever the thread count; a file gone before it is hashed fails the whole,
    /// naming it.
    #[test]
    fn files_hashed_on_several_threads_keep_their_order_and_a_gone_one_is_named() {
        use crate::safetensors::{INDEX_FILE, write_safetensors};
        let dir = tempfile::tempdir().unwrap();
        let mut weight_map = serde_json::Map::new();
        // Sizes out of file order, so largest-first hashing starts in the middle.
        for (i, rows) in [3usize, 70_000, 1, 40_000].into_iter().enumerate() {
            let file = format!("model-{:05}-of-00004.safetensors", i + 1);
            let name = format!("t{i}");
            let bytes: Vec<u8> = (0..rows * 4).map(|b| (b * (i + 7) % 251) as u8).collect();
            let shape = [rows];
            let t = (name.as_str(), Dtype::F32, &shape[..], &bytes[..]);
            write_safetensors(dir.path().join(&file), &[t], &BTreeMap::new()).unwrap();
            weight_map.insert(name, file.into());
        }
        let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
        std::fs::write(dir.path().join(INDEX_FILE), index.to_string()).unwrap();
        std::fs::write(dir.path().join("config.json"), "{}").unwrap();
        let ckpt = Checkpoint::open(dir.path()).unwrap();
        let want: Vec<(String, u64, String)> = std::iter::once(dir.path().join("config.json"))
            .chain(ckpt.files().map(|p| p.to_path_buf()))
            .map(|p| {
                let bytes = std::fs::read(&p).unwrap();
                let name = p.file_name().unwrap().to_string_lossy().into_owned();
                (name, bytes.len() as u64, hex(&Sha256::digest(&bytes)))
            })
            .collect();
        assert_eq!(want.len(), 5);
        let ids: Vec<(PathBuf, FileIdentity)> = ckpt
            .files()
            .map(|p| (p.to_path_buf(), identity_of(p).unwrap()))
            .collect();
        let go = AtomicBool::new(false);
        for threads in [1, 3, 8] {
            assert_eq!(source_files(&ckpt, &ids, &go, threads).1, threads.min(5));
        }
        for threads in [1, 2, 3, 8] {
            let got: Vec<(String, u64, String)> = source_files(&ckpt, &ids, &go, threads)
                .0
                .unwrap()
                .unwrap()
                .into_iter()
                .map(|f| (f.name, f.bytes, f.sha256))
                .collect();
            assert_eq!(got, want, "{threads} threads");
        }
        assert!(
            source_files(&ckpt, &ids, &AtomicBool::new(true), 2)
                .0
                .unwrap()
                .is_none()
        );
        let gone = ckpt.files().nth(2).unwrap().to_path_buf();
        std::fs::remove_file(&gone).unwrap();
        let e = source_files(&ckpt, &ids, &go, 3).0.unwrap_err();
        assert!(
            matches!(&e, ConvertError::Io { path, .. } if path == &gone),
            "{e}"
        );
    }

    /// A stopped hash reads nothing more: `None`, where the same file otherwise hashes to the
    /// SHA-256 of its bytes.
    #[test]
    fn hashing_stops_when_asked() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.safetensors");
        let bytes: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
        std::fs::write(&path, &bytes).unwrap();
        let whole = hash_file(&path, &|| false).unwrap().unwrap();
        assert_eq!(whole.bytes, bytes.len() as u64);
        assert_eq!(whole.sha256, hex(&Sha256::digest(&bytes)));
        assert!(hash_file(&path, &|| true).unwrap().is_none());
    }
}
