//! `expertmesh bench convert`: the checkpoint converter's throughput, a worker's shard load and
//! the searched quantizer's error, each against a limit measured in the same run.
//!
//! Why this exists: serving a real checkpoint starts with two one-off passes over the weights
//! (`expertmesh convert`, then every worker loading its shard) and bakes in one choice that
//! lasts (the quantizer). Their honest figures are relative: conversion and loading against
//! simply reading the same bytes from the page cache, the searched quantizer against absmax
//! round-to-nearest on the same weights. Absolute numbers on shared, noisy machines mean little.
//!
//! What runs, all in one folder (a temporary one unless `--dir` is given):
//!
//! 1. A synthetic qwen3_moe BF16 checkpoint (one safetensors file per layer plus the index,
//!    written with [`write_safetensors`]; Gaussian weights of standard deviation
//!    `1/sqrt(fan_in)`) and the single-host topology (two CPU devices; expert memory raised so
//!    any size fits). The placement is the planner's balanced default, as `expertmesh convert`
//!    makes it.
//! 2. **Convert**: per thread count, `repeats` times alternately: a raw read of every
//!    safetensors file (the limit: the faster of two reads of the page cache, each whole file
//!    into one reused buffer with [`std::fs::File::read`] and each file mapped with every byte
//!    loaded ([`mapped_read`]), both recorded; one warm-up read first so both sides read the
//!    page cache), then [`convert`] into a fresh folder. Achieved = source expert bytes /
//!    convert seconds. On an EPYC VM without AVX-512 the kernel's copy read a fifth of the map's
//!    rate, and the converter reads a map; both reads run on one thread. A step on two threads
//!    or more (a two-thread conversion, the loads below) is held to the faster of those and the
//!    same maps read on two threads ([`mapped_read_pair`], also recorded).
//! 3. **Load**: what a worker does from start to loaded, for every device shard: load the
//!    deployment from the converted folder, open and verify the shard (crc32c of the whole file
//!    against the manifest), copy each expert out of the map and pack it into a [`CpuBackend`]
//!    ([`ExpertBackend::load_from`]); against a raw read of the same shard files (the two
//!    reads above). Achieved = shard bytes / seconds, measured [`LOAD_RUNS_PER_REPEAT`] times
//!    per repeat (a load is cheap), with the time split into deployment, open + verify, copy
//!    and pack, and the first run reported apart (the only one whose memory is fresh, as in a
//!    new worker process). Beside it, a reference rather than a limit: a copy of the mapped
//!    shard files into one fresh huge-page buffer ([`fresh_copy`]), the least work of a loader
//!    that places the bytes in memory of its own (fresh memory costs the kernel's zeroing).
//!    The load runs on two threads (the repack, and the shard's checksum beside it), so its
//!    limit includes the two-thread read; the one-thread ratio is recorded too.
//! 4. **Load from the tile cache** (`worker --tile-cache`): one load that repacks and keeps
//!    each device's arena in a cache folder (not timed), then the same number of loads that map
//!    the kept files and check them (crc32c on two threads), against the same limit. Achieved
//!    counts the shards' bytes, as the repacking row does.
//! 5. **Quantizer error**: on some of the checkpoint's experts (read back from it, so the BF16
//!    values exactly), and on experts of the same shape with heavy-tailed weights (Student-t
//!    with ν = 4, and Gaussian with a few outlier input columns), the relative L2 error of the
//!    expert FFN output `down · (silu(gate·x) ⊙ up·x)` in f64 over random Gaussian inputs, with
//!    each quantizer's dequantized weights against the BF16 weights; and the weight error
//!    `‖w − deq(w)‖ / ‖w‖`. Achieved = searched, limit = absmax; lower is better. Absmax is
//!    a reference to beat, not a bound (`limit_role: reference`): a ratio below 1 is the
//!    search's gain, never a bench bug. Each quantizer's speed (BF16 MB per thread-second) is
//!    recorded beside.
//!
//! Throughputs are medians over runs (the best alongside); results carry `kind` (`convert`,
//! `load`, `load_tile_cache`, `quant_error`) and what the limit is. The load averages before and after the run
//! are recorded in `machine`: the conversion is compute-bound and its limit is not, so other
//! work on a shared machine lowers its ratio.

use crate::BenchError;
use crate::method::json::{BenchReport, BenchResult, Better};
use expertmesh_backend::{BackendError, ExpertBackend, ExpertShape, ExpertSource};
use expertmesh_checkpoint::convert::{ConvertJob, convert, gate_tensor_names};
use expertmesh_checkpoint::experts::{ExpertRef, Family, expert_tensor_names, source_quant};
use expertmesh_checkpoint::hf_config::load_hf_model_and_family;
use expertmesh_checkpoint::safetensors::{
    Checkpoint, Dtype, INDEX_FILE, TensorData, write_safetensors,
};
use expertmesh_cpu_backend::tile_cache::{TileCache, TileCacheUse};
use expertmesh_cpu_backend::{CpuBackend, membw};
use expertmesh_planner::{self as plan, PlanOptions};
use expertmesh_quant::format::{ExpertWeights, PackedMatrix, PackedRef, QuantSpec};
use expertmesh_quant::search::quantize_matrix_searched;
use expertmesh_quant::synth::{SplitMix64, mix_seed};
use expertmesh_topology::model::ModelSpec;
use expertmesh_topology::placement::Placement;
use expertmesh_topology::topology::Topology;
use expertmesh_worker::deploy::Deployment;
use half::bf16;
use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

/// Options of `bench convert`.
#[derive(Debug, Clone)]
pub struct ConvertBenchOptions {
    /// Hidden size (a multiple of 32).
    pub hidden: usize,
    /// Routed expert width (`moe_intermediate_size`, a multiple of 32).
    pub moe_inter: usize,
    /// Routed experts per layer.
    pub experts: usize,
    /// Layers (every one MoE).
    pub layers: usize,
    /// Conversion thread counts, each measured (the first is also the one whose output the
    /// load bench reads).
    pub threads: Vec<usize>,
    /// Measurements per conversion case (raw read and conversion alternate); the worker load,
    /// much cheaper, is measured [`LOAD_RUNS_PER_REPEAT`] times as often.
    pub repeats: usize,
    /// Experts per weight distribution whose quantization error is measured (0: skip).
    pub error_experts: usize,
    /// Random inputs per expert for the output error.
    pub error_inputs: usize,
    /// Folder for the checkpoint and the converted shards (kept); `None`: a temporary folder,
    /// removed at the end.
    pub dir: Option<PathBuf>,
    /// Quantize with u4 zero points per group (asymmetric) instead of the symmetric default.
    pub zero_points: bool,
    /// Seed of the synthetic weights and inputs.
    pub seed: u64,
}

impl ConvertBenchOptions {
    /// The default run: hidden 2048, experts of width 768 (Qwen3-30B-A3B's shape), 4 experts
    /// × 2 layers = 75.5 MB of BF16 experts (the searched quantizer converts about 40 MB/s per
    /// thread on a Zen 3 core, so the whole run takes about 15 s on 2 cores); conversion with 2 and 1
    /// threads, 2 repeats; the quantizer error on 2 experts per distribution.
    pub fn standard() -> Self {
        Self {
            hidden: 2048,
            moe_inter: 768,
            experts: 4,
            layers: 2,
            threads: vec![2, 1],
            repeats: 2,
            error_experts: 2,
            error_inputs: 16,
            dir: None,
            zero_points: false,
            seed: 0x00C0_4E47,
        }
    }

    /// A tiny run for tests (a second or two): hidden 256, width 128, 4 experts, 1 layer.
    pub fn quick() -> Self {
        Self {
            hidden: 256,
            moe_inter: 128,
            experts: 4,
            layers: 1,
            threads: vec![2, 1],
            repeats: 2,
            error_experts: 2,
            error_inputs: 4,
            ..Self::standard()
        }
    }

    /// BF16 bytes of one expert (gate, up, down).
    pub fn expert_bytes(&self) -> u64 {
        3 * (self.hidden * self.moe_inter * 2) as u64
    }

    /// Refuse sizes the converter or the planner cannot take.
    pub fn check(&self) -> Result<(), BenchError> {
        let checks = [
            (
                self.hidden >= 32 && self.hidden % 32 == 0,
                "--hidden must be a positive multiple of 32",
            ),
            (
                self.moe_inter >= 32 && self.moe_inter % 32 == 0,
                "--moe-inter must be a positive multiple of 32",
            ),
            (
                (2..=1024).contains(&self.experts),
                "--experts must be in 2..=1024",
            ),
            (
                (1..=256).contains(&self.layers),
                "--layers must be in 1..=256",
            ),
            (
                !self.threads.is_empty() && self.threads.iter().all(|&t| (1..=1024).contains(&t)),
                "--threads must list thread counts in 1..=1024",
            ),
            (
                (1..=100).contains(&self.repeats),
                "--repeats must be in 1..=100",
            ),
            (
                self.error_experts == 0 || self.error_inputs >= 1,
                "--error-inputs must be at least 1",
            ),
        ];
        match checks.into_iter().find(|(ok, _)| !ok) {
            Some((_, what)) => Err(BenchError::Options(what.to_string())),
            None => Ok(()),
        }
    }

    fn settings(&self, dir: &Path) -> serde_json::Value {
        serde_json::json!({
            "hidden": self.hidden,
            "moe_inter": self.moe_inter,
            "experts": self.experts,
            "layers": self.layers,
            "expert_bytes_bf16": self.expert_bytes(),
            "checkpoint_expert_bytes": self.expert_bytes() * (self.experts * self.layers) as u64,
            "threads": self.threads,
            "repeats": self.repeats,
            "load_runs": self.repeats * LOAD_RUNS_PER_REPEAT,
            "error_experts": self.error_experts,
            "error_inputs": self.error_inputs,
            "zero_points": self.zero_points,
            "seed": self.seed,
            "dir": dir.display().to_string(),
        })
    }
}

/// Worker loads per conversion repeat.
pub(crate) const LOAD_RUNS_PER_REPEAT: usize = 3;

/// How synthetic expert weights are drawn (each scaled to standard deviation `1/sqrt(fan_in)`
/// before rounding to BF16).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightDist {
    /// Normal.
    Gaussian,
    /// Student-t with ν = 4 (`z / sqrt(χ²₄ / 4)`, scaled to unit variance): scattered outliers.
    StudentT4,
    /// Normal, with one input column in [`OUTLIER_EVERY`] (chosen per matrix) scaled by
    /// [`OUTLIER_SCALE`]: outlier channels, as in real LLM weights.
    OutlierColumns,
}

/// One input column in this many is an outlier column of [`WeightDist::OutlierColumns`].
pub(crate) const OUTLIER_EVERY: u64 = 128;
/// How much larger an outlier column's weights are.
pub(crate) const OUTLIER_SCALE: f64 = 10.0;

impl WeightDist {
    /// Every distribution, the checkpoint's first.
    pub const ALL: [WeightDist; 3] = [
        WeightDist::Gaussian,
        WeightDist::StudentT4,
        WeightDist::OutlierColumns,
    ];

    /// The name in result names.
    pub fn name(self) -> &'static str {
        match self {
            WeightDist::Gaussian => "gaussian",
            WeightDist::StudentT4 => "student_t4",
            WeightDist::OutlierColumns => "outlier_columns",
        }
    }

    fn sample(self, n: &mut Normals) -> f64 {
        match self {
            WeightDist::Gaussian | WeightDist::OutlierColumns => n.next(),
            WeightDist::StudentT4 => {
                let z = n.next();
                let chi2: f64 = (0..4).map(|_| n.next().powi(2)).sum();
                // Var(t_4) = 4 / (4 - 2) = 2.
                z / (chi2 / 4.0).max(1e-300).sqrt() / std::f64::consts::SQRT_2
            }
        }
    }
}

/// Standard normals by Box–Muller, both values of each pair used.
struct Normals {
    rng: SplitMix64,
    spare: Option<f64>,
}

impl Normals {
    fn new(seed: u64) -> Self {
        Self {
            rng: SplitMix64::new(seed),
            spare: None,
        }
    }

    fn next(&mut self) -> f64 {
        if let Some(v) = self.spare.take() {
            return v;
        }
        let u1 = self.rng.next_f64().max(1e-300);
        let (s, c) = (std::f64::consts::TAU * self.rng.next_f64()).sin_cos();
        let r = (-2.0 * u1.ln()).sqrt();
        self.spare = Some(r * s);
        r * c
    }
}

/// A `[rows][cols]` matrix of `dist` with standard deviation `1/sqrt(cols)`, rounded to BF16.
fn synthetic_matrix(dist: WeightDist, seed: u64, rows: usize, cols: usize) -> Vec<bf16> {
    let mut n = Normals::new(seed);
    let std = 1.0 / (cols as f64).sqrt();
    let scale: Vec<f64> = (0..cols as u64)
        .map(|c| {
            let outlier =
                dist == WeightDist::OutlierColumns && mix_seed(&[seed, c]) % OUTLIER_EVERY == 0;
            if outlier { std * OUTLIER_SCALE } else { std }
        })
        .collect();
    let mut out = Vec::with_capacity(rows * cols);
    for _ in 0..rows {
        out.extend(
            scale
                .iter()
                .map(|&s| bf16::from_f64(dist.sample(&mut n) * s)),
        );
    }
    out
}

/// Expert `(layer, expert)` of `dist`: gate `[F][H]`, up `[F][H]`, down `[H][F]` in BF16.
pub fn synthetic_expert(
    opts: &ConvertBenchOptions,
    dist: WeightDist,
    layer: usize,
    expert: usize,
) -> [Vec<bf16>; 3] {
    let (h, f) = (opts.hidden, opts.moe_inter);
    let seed = |m: u64| mix_seed(&[opts.seed, dist as u64, layer as u64, expert as u64, m]);
    [
        synthetic_matrix(dist, seed(0), f, h),
        synthetic_matrix(dist, seed(1), f, h),
        synthetic_matrix(dist, seed(2), h, f),
    ]
}

/// `f(0..n)` on `threads` scoped threads; results in index order.
fn par_map<T: Send>(n: usize, threads: usize, f: impl Fn(usize) -> T + Sync) -> Vec<T> {
    let next = AtomicUsize::new(0);
    let (f, next) = (&f, &next);
    let mut parts: Vec<(usize, T)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads.clamp(1, n.max(1)))
            .map(|_| {
                s.spawn(move || {
                    let mut mine = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= n {
                            return mine;
                        }
                        mine.push((i, f(i)));
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("a bench thread panicked"))
            .collect()
    });
    parts.sort_by_key(|p| p.0);
    parts.into_iter().map(|p| p.1).collect()
}

fn bf16_bytes(v: &[bf16]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect()
}

/// The qwen3_moe `config.json` of the synthetic model (every layer MoE, top-k ≤ 4).
fn config_json(opts: &ConvertBenchOptions) -> serde_json::Value {
    serde_json::json!({
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "hidden_size": opts.hidden,
        "num_hidden_layers": opts.layers,
        "num_experts_per_tok": opts.experts.min(4),
        "hidden_act": "silu",
        "vocab_size": 16,
        "tie_word_embeddings": false,
        "torch_dtype": "bfloat16",
        "num_experts": opts.experts,
        "moe_intermediate_size": opts.moe_inter,
        "intermediate_size": 2 * opts.moe_inter,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": true,
    })
}

/// Write the synthetic checkpoint into `dir` (one safetensors file per layer, the index,
/// `config.json`); returns the safetensors files.
fn write_checkpoint(
    dir: &Path,
    opts: &ConvertBenchOptions,
    threads: usize,
) -> Result<Vec<PathBuf>, BenchError> {
    std::fs::create_dir_all(dir).map_err(BenchError::io(format!("creating {}", dir.display())))?;
    let config = serde_json::to_string_pretty(&config_json(opts))?;
    std::fs::write(dir.join("config.json"), config)?;
    let (h, f, e) = (opts.hidden, opts.moe_inter, opts.experts);
    let (mut files, mut weight_map, mut total) = (Vec::new(), serde_json::Map::new(), 0usize);
    for layer in 0..opts.layers {
        let name = format!("model-{:05}-of-{:05}.safetensors", layer + 1, opts.layers);
        let experts = par_map(e, threads, |x| {
            synthetic_expert(opts, WeightDist::Gaussian, layer, x).map(|m| bf16_bytes(&m))
        });
        let gate_seed = mix_seed(&[opts.seed, 0x6A7E, layer as u64]);
        let gate = bf16_bytes(&synthetic_matrix(WeightDist::Gaussian, gate_seed, e, h));
        let (gate_name, _) = gate_tensor_names(Family::Qwen3Moe, layer as u32);
        let mut names = Vec::with_capacity(e);
        for x in 0..e {
            names.push(expert_tensor_names(
                Family::Qwen3Moe,
                layer as u32,
                ExpertRef::Routed(x as u32),
            )?);
        }
        let (fh, hf, eh) = ([f, h], [h, f], [e, h]);
        let mut tensors: Vec<TensorData<'_>> = vec![(gate_name.as_str(), Dtype::BF16, &eh, &gate)];
        for (n, m) in names.iter().zip(&experts) {
            tensors.push((n[0].as_str(), Dtype::BF16, &fh, &m[0]));
            tensors.push((n[1].as_str(), Dtype::BF16, &fh, &m[1]));
            tensors.push((n[2].as_str(), Dtype::BF16, &hf, &m[2]));
        }
        let path = dir.join(&name);
        write_safetensors(&path, &tensors, &BTreeMap::new())?;
        for (t, _, _, bytes) in &tensors {
            weight_map.insert((*t).to_string(), name.clone().into());
            total += bytes.len();
        }
        files.push(path);
    }
    let index = serde_json::json!({"metadata": {"total_size": total}, "weight_map": weight_map});
    std::fs::write(dir.join(INDEX_FILE), serde_json::to_string_pretty(&index)?)?;
    Ok(files)
}

/// The embedded single-host topology (two CPU devices), with room for any size of run.
fn write_topology(dir: &Path) -> Result<PathBuf, BenchError> {
    let text = expertmesh_fabric::defaults::SINGLE_HOST_TOPOLOGY
        .replace("expert_memory = \"256 MiB\"", "expert_memory = \"64 GiB\"");
    let path = dir.join("single-host.toml");
    std::fs::write(&path, text)?;
    Ok(path)
}

/// One raw read of a set of files, both ways a reader can take them from the page cache.
#[derive(Clone, Copy, Debug)]
struct RawRead {
    bytes: u64,
    /// [`std::fs::File::read`] of each whole file into one reused buffer (a copy by the
    /// kernel).
    file_read_secs: f64,
    /// Each file mapped and every byte loaded on one thread ([`mapped_read`]): what one
    /// thread reading the map (the converter's safetensors reader, the worker's shard reader)
    /// cannot do faster.
    mapped_read_secs: f64,
    /// The same maps read by two threads, each taking half of every file
    /// ([`mapped_read_pair`]): what a step reading on two threads cannot do faster.
    mapped_pair_secs: f64,
}

impl RawRead {
    /// The faster of the two reads, bytes per second: the limit. On the EPYC VM without
    /// AVX-512 of BENCHMARKS the kernel's copy read 1.6-2.7 GB/s and the map 10-16; the Intel
    /// Xeon VM's copy read 6.5-13.6 GB/s (its map unmeasured): `File::read` stays in the race
    /// where a kernel copies faster than a mapped read, and for comparison with earlier runs.
    fn rate(&self) -> f64 {
        self.file_read_rate().max(self.mapped_read_rate())
    }

    /// The limit of a step that reads on `threads` threads, bytes per second: [`Self::rate`],
    /// or with two threads or more, the faster of it and the two-thread mapped read (the
    /// worker loads check on two threads; the two-thread conversions read on two).
    fn rate_on(&self, threads: usize) -> f64 {
        if threads >= 2 {
            self.rate().max(self.mapped_pair_rate())
        } else {
            self.rate()
        }
    }

    /// The two-thread mapped read's rate, bytes per second.
    fn mapped_pair_rate(&self) -> f64 {
        self.bytes as f64 / self.mapped_pair_secs
    }

    /// [`std::fs::File::read`]'s rate, bytes per second.
    fn file_read_rate(&self) -> f64 {
        self.bytes as f64 / self.file_read_secs
    }

    /// The mapped read's rate, bytes per second.
    fn mapped_read_rate(&self) -> f64 {
        self.bytes as f64 / self.mapped_read_secs
    }
}

/// What the convert and load rows' read limit is (`limit_kind`), after what is read.
const READ_LIMIT_KIND: &str = "from the page cache, the fastest of File::read of each whole \
    file into one reused buffer, a map of each with every byte loaded, and (for a step on two \
    threads or more) the same maps read on two threads, same run";

/// Threads a worker load reads on: the repack and its shard's checksum thread, or the tile
/// cache's check on (at least) two.
const LOAD_THREADS: usize = 2;

/// Read every file of `files` fully both ways ([`RawRead`]): into `buf` (one reused buffer,
/// as large as the largest file) with [`std::fs::File::read`], then mapped.
fn raw_read(files: &[PathBuf], buf: &mut Vec<u8>) -> Result<RawRead, BenchError> {
    let mut largest = 0;
    for p in files {
        largest = largest.max(std::fs::metadata(p)?.len() as usize);
    }
    if buf.len() < largest {
        buf.resize(largest, 0);
    }
    let t0 = Instant::now();
    let mut total = 0u64;
    for p in files {
        let mut f =
            std::fs::File::open(p).map_err(BenchError::io(format!("reading {}", p.display())))?;
        let mut at = 0;
        loop {
            let n = f.read(&mut buf[at..])?;
            if n == 0 {
                break;
            }
            at += n;
        }
        total += at as u64;
    }
    let file_read_secs = t0.elapsed().as_secs_f64();
    let t0 = Instant::now();
    let mapped = mapped_read(files)?;
    let mapped_read_secs = t0.elapsed().as_secs_f64();
    let t0 = Instant::now();
    let pair = mapped_read_pair(files)?;
    let mapped_pair_secs = t0.elapsed().as_secs_f64();
    if mapped != total || pair != total {
        return Err(BenchError::io("reading the files twice for the raw read")(
            std::io::Error::other("a file changed size between the two reads"),
        ));
    }
    Ok(RawRead {
        bytes: total,
        file_read_secs,
        mapped_read_secs,
        mapped_pair_secs,
    })
}

/// Map `path` read-only (`None` for an empty file, which cannot be mapped).
fn map_file(path: &Path) -> Result<Option<memmap2::Mmap>, BenchError> {
    let f =
        std::fs::File::open(path).map_err(BenchError::io(format!("reading {}", path.display())))?;
    if f.metadata()?.len() == 0 {
        return Ok(None);
    }
    // SAFETY: a read-only map of a file this bench wrote and nobody modifies while it is
    // mapped (the bytes behind the slice cannot change); callers drop it before the next.
    let map = unsafe { memmap2::Mmap::map(&f) }
        .map_err(BenchError::io(format!("mapping {}", path.display())))?;
    Ok(Some(map))
}

/// Map each of `files` and load every byte of it once (the memory probe's XOR reduction,
/// [`membw::read_with`], and the last bytes it leaves), unmapping before the next: the
/// page-cache read a reader of the map pays, page faults included. Returns the bytes read.
fn mapped_read(files: &[PathBuf]) -> Result<u64, BenchError> {
    let (mut total, mut folded) = (0u64, 0u64);
    for p in files {
        let Some(map) = map_file(p)? else { continue };
        folded ^= membw::read_with(membw::ReadKernel::Plain, &map);
        // The reduction takes whole 128-byte chunks; the rest byte by byte.
        for &b in &map[map.len() / 128 * 128..] {
            folded ^= u64::from(b);
        }
        total += map.len() as u64;
    }
    std::hint::black_box(folded);
    Ok(total)
}

/// [`mapped_read`] on two threads: every file mapped, the first half of each read by this
/// thread and the second by a helper (started inside the timing, as a loader's would be).
/// Returns the bytes read.
fn mapped_read_pair(files: &[PathBuf]) -> Result<u64, BenchError> {
    let mut maps = Vec::with_capacity(files.len());
    for p in files {
        maps.extend(map_file(p)?);
    }
    let fold = |half: usize| {
        let mut folded = 0u64;
        for map in &maps {
            let mid = map.len() / 2 / 128 * 128;
            let part = if half == 0 { &map[..mid] } else { &map[mid..] };
            folded ^= membw::read_with(membw::ReadKernel::Plain, part);
            for &b in &part[part.len() / 128 * 128..] {
                folded ^= u64::from(b);
            }
        }
        folded
    };
    let folded = std::thread::scope(|s| {
        let helper = s.spawn(|| fold(1));
        let mine = fold(0);
        mine ^ helper.join().unwrap_or(0)
    });
    std::hint::black_box(folded);
    Ok(maps.iter().map(|m| m.len() as u64).sum())
}

/// A copy of every byte of `files` from their maps into one fresh buffer (from 4 MiB on its
/// own huge-page mapping, as the worker's arena is; smaller ones, as in `--quick` runs, may
/// reuse the allocator's memory): the least work of a loader that places the bytes in memory
/// it owns. Returns bytes copied and seconds (the buffer's release not included).
fn fresh_copy(files: &[PathBuf]) -> Result<(u64, f64), BenchError> {
    let mut len = 0;
    for p in files {
        len += std::fs::metadata(p)?.len() as usize;
    }
    let t0 = Instant::now();
    let mut arena = expertmesh_quant::aligned::AlignedVec::<u8>::zeroed(len.max(1));
    let mut at = 0;
    for p in files {
        let Some(map) = map_file(p)? else { continue };
        let n = map.len().min(len - at);
        arena[at..at + n].copy_from_slice(&map[..n]);
        at += n;
    }
    std::hint::black_box(&arena);
    let secs = t0.elapsed().as_secs_f64();
    drop(arena);
    Ok((at as u64, secs))
}

/// The checkpoint, cluster and placement every step uses.
struct Prepared {
    dir: PathBuf,
    ckpt_dir: PathBuf,
    files: Vec<PathBuf>,
    topology_path: PathBuf,
    topology: Topology,
    spec: ModelSpec,
    placement: Placement,
    placement_text: String,
}

/// Write the checkpoint and topology into `dir`, read the model back as `expertmesh convert`
/// does, and plan the balanced default placement.
fn prepare(dir: &Path, opts: &ConvertBenchOptions) -> Result<Prepared, BenchError> {
    let ckpt_dir = dir.join("bench-qwen3-moe");
    let t0 = Instant::now();
    let threads = opts.threads.iter().copied().max().unwrap_or(1);
    let files = write_checkpoint(&ckpt_dir, opts, threads)?;
    println!(
        "wrote a {:.0} MB BF16 checkpoint ({} layers x {} experts of {}x{}) in {:.1} s",
        (opts.expert_bytes() * (opts.experts * opts.layers) as u64) as f64 / 1e6,
        opts.layers,
        opts.experts,
        opts.hidden,
        opts.moe_inter,
        t0.elapsed().as_secs_f64()
    );
    let topology_path = write_topology(dir)?;
    let topology = Topology::load(&topology_path).map_err(BenchError::File)?;
    let ckpt = Checkpoint::open(&ckpt_dir)?;
    let (mut spec, family) = load_hf_model_and_family(&ckpt_dir).map_err(BenchError::HfConfig)?;
    if family != Family::Qwen3Moe {
        return Err(BenchError::Family(family));
    }
    spec.quant = source_quant(&ckpt, &spec, family)?;
    spec.quant.zero_points |= opts.zero_points;
    let plan_opts = PlanOptions {
        description: format!("balanced default of expertmesh convert for {}", spec.name),
        ..PlanOptions::default()
    };
    let planned =
        plan::plan(&topology, &spec, None, None, &plan_opts).map_err(|cause| BenchError::Plan {
            what: "planning the bench placement",
            cause,
        })?;
    Ok(Prepared {
        dir: dir.to_path_buf(),
        ckpt_dir,
        files,
        topology_path,
        topology,
        spec,
        placement_text: planned.placement.to_toml_string(),
        placement: planned.placement,
    })
}

/// A raw read's two rates, for the progress lines.
fn read_text(r: &RawRead) -> String {
    format!(
        "{:.2} GB/s (File::read {:.2}, mapped {:.2}, mapped on two threads {:.2})",
        r.rate() / 1e9,
        r.file_read_rate() / 1e9,
        r.mapped_read_rate() / 1e9,
        r.mapped_pair_rate() / 1e9
    )
}

/// `result` with the medians of both raw reads of `reads` (GB/s) beside its limit.
fn with_reads(result: BenchResult, reads: &[RawRead]) -> BenchResult {
    let rate = |rate: fn(&RawRead) -> f64| {
        membw::median(&reads.iter().map(rate).collect::<Vec<_>>()) / 1e9
    };
    result
        .with("limit_file_read", rate(RawRead::file_read_rate))
        .with("limit_mapped_read", rate(RawRead::mapped_read_rate))
        .with(
            "limit_mapped_read_two_threads",
            rate(RawRead::mapped_pair_rate),
        )
}

/// Median and best of rate samples.
fn median_best(samples: &[f64]) -> (f64, f64) {
    (
        membw::median(samples),
        samples.iter().copied().fold(0.0, f64::max),
    )
}

/// A throughput result from per-repeat samples (bytes/s) of the step and its limit.
fn throughput_result(name: &str, batch: u64, achieved: &[f64], limit: &[f64]) -> BenchResult {
    let (a, a_best) = median_best(achieved);
    let (l, l_best) = median_best(limit);
    BenchResult::new(name, batch, a / 1e9, l / 1e9, "GB/s")
        .with("best", a_best / 1e9)
        .with("limit_best", l_best / 1e9)
        .with("runs", achieved.len())
}

/// Convert with `threads` threads `repeats` times, each after a raw read of the checkpoint;
/// returns the result and the last run's output folder.
fn convert_case(
    p: &Prepared,
    threads: usize,
    repeats: usize,
    buf: &mut Vec<u8>,
) -> Result<(BenchResult, PathBuf), BenchError> {
    let (mut achieved, mut limit, mut bytes) = (Vec::new(), Vec::new(), 0);
    let mut reads = Vec::new();
    let mut out = PathBuf::new();
    for rep in 0..repeats {
        let read = raw_read(&p.files, buf)?;
        limit.push(read.rate_on(threads));
        reads.push(read);
        if rep > 0 {
            let _ = std::fs::remove_dir_all(&out);
        }
        out = p.dir.join(format!("converted-{threads}t-{rep}"));
        let _ = std::fs::remove_dir_all(&out);
        let ckpt = Checkpoint::open(&p.ckpt_dir)?;
        let job = ConvertJob {
            ckpt: &ckpt,
            family: Family::Qwen3Moe,
            spec: &p.spec,
            topology: &p.topology,
            placement: &p.placement,
            placement_text: &p.placement_text,
            out: &out,
            threads,
            shared_dense: false, // qwen3_moe has no shared expert
        };
        let t0 = Instant::now();
        let report = convert(&job, &|_| {}).map_err(BenchError::from)?;
        let secs = t0.elapsed().as_secs_f64();
        if report.shards_kept != 0 {
            return Err(BenchError::ShardKept);
        }
        bytes = report.source_bytes_converted;
        achieved.push(bytes as f64 / secs);
        println!(
            "  convert, {threads} threads: {:.3} GB/s ({:.2} s); raw read {}",
            bytes as f64 / secs / 1e9,
            secs,
            read_text(&read)
        );
    }
    let r = with_reads(
        throughput_result("convert_throughput", threads as u64, &achieved, &limit),
        &reads,
    )
    .with("kind", "convert")
    .with("source_expert_bytes", bytes)
    .with(
        "limit_kind",
        format!("raw read of the same safetensors files {READ_LIMIT_KIND}"),
    );
    Ok((r, out))
}

/// Seconds of one worker start, summed over the devices (each device is one worker).
#[derive(Clone, Copy, Default)]
struct LoadTimes {
    /// `Deployment::load_converted`: topology, manifest, model and placement files.
    deploy: f64,
    /// Mapping the shard and checking its index against the placement, plus the wait for its
    /// crc32c (whole file, computed on another thread during the load) at the end.
    open_verify: f64,
    /// Reading each expert out of the map (`ExpertSource::expert_ref`: in-place views; a copy
    /// with `expert` for sources that have no view).
    copy: f64,
    /// Creating the backend and the rest of `load_from`: repacking into the backend's arena,
    /// scratch buffers.
    pack: f64,
}

impl LoadTimes {
    fn total(&self) -> f64 {
        self.deploy + self.open_verify + self.copy + self.pack
    }
}

/// Forwards an [`ExpertSource`], timing the reads out of the shard (copies, or in-place views)
/// and the wait for its checksum at the end.
struct TimedSource<'a> {
    inner: &'a mut dyn ExpertSource,
    secs: f64,
    finish_secs: f64,
}

impl ExpertSource for TimedSource<'_> {
    fn shapes(&self) -> &[ExpertShape] {
        self.inner.shapes()
    }

    fn expert(&mut self, i: usize) -> Result<ExpertWeights, BackendError> {
        let t0 = Instant::now();
        let r = self.inner.expert(i);
        self.secs += t0.elapsed().as_secs_f64();
        r
    }

    fn expert_ref(
        &mut self,
        i: usize,
    ) -> Option<Result<(PackedRef<'_>, PackedRef<'_>), BackendError>> {
        let t0 = Instant::now();
        let r = self.inner.expert_ref(i);
        self.secs += t0.elapsed().as_secs_f64();
        r
    }

    fn finish(&mut self) -> Result<(), BackendError> {
        let t0 = Instant::now();
        let r = self.inner.finish();
        self.finish_secs += t0.elapsed().as_secs_f64();
        r
    }

    fn content_id(&self) -> Option<expertmesh_backend::ContentId> {
        self.inner.content_id()
    }
}

/// Load every device's shard of `out` the way its worker does (with `tile_cache`, as a worker
/// started with `--tile-cache`); returns the times and what each load did with the cache.
fn load_all(
    p: &Prepared,
    out: &Path,
    tile_cache: Option<&Path>,
) -> Result<(LoadTimes, Vec<TileCacheUse>), BenchError> {
    let mut t = LoadTimes::default();
    let mut backends = Vec::new();
    let mut uses = Vec::new();
    for d in p.topology.devices() {
        let t0 = Instant::now();
        let dep = Deployment::load_converted(&p.topology_path, out)?;
        let t1 = Instant::now();
        let mut src = expertmesh_worker::weights::device_expert_source(&dep, d.rank())?;
        let t2 = Instant::now();
        let threads = d.threads().map_or(1, |x| x as usize);
        let mut backend = CpuBackend::new(threads)?;
        backend.set_tile_cache(tile_cache.map(TileCache::new));
        let limits = expertmesh_worker::process::worker_limits(&dep, 64);
        let mut timed = TimedSource {
            inner: &mut *src,
            secs: 0.0,
            finish_secs: 0.0,
        };
        backend
            .load_from(&mut timed, limits)
            .map_err(|cause| BenchError::DeviceBackend {
                device: d.id().to_string(),
                cause,
            })?;
        let t3 = Instant::now();
        t.deploy += (t1 - t0).as_secs_f64();
        t.open_verify += (t2 - t1).as_secs_f64() + timed.finish_secs;
        t.copy += timed.secs;
        t.pack += (t3 - t2).as_secs_f64() - timed.secs - timed.finish_secs;
        // A repacking load writes the tiles on a thread of its own: its outcome, not timed.
        uses.push(match backend.take_tile_cache_writer() {
            Some(w) => w
                .join()
                .map_err(|_| BenchError::TileCache("the writer thread panicked".into()))?,
            None => backend.tile_cache_use().clone(),
        });
        backends.push(backend); // dropped after the last device, outside the timings
    }
    Ok((t, uses))
}

/// The device shard files of the converted folder `out`, and their bytes in all.
fn shard_files(p: &Prepared, out: &Path) -> Result<(Vec<PathBuf>, u64), BenchError> {
    let dep = Deployment::load_converted(&p.topology_path, out)?;
    let w = dep.weights.as_ref().ok_or(BenchError::NoWeights)?;
    let shards = w.manifest.shards.iter().map(|s| w.path(&s.file)).collect();
    Ok((shards, w.manifest.shards.iter().map(|s| s.bytes).sum()))
}

/// Worker load of every device shard of `out`, `runs` times, each after a raw read of the
/// same shard files. The first run is reported apart too: it is the only one whose backend
/// arena and copies land on memory this process has never touched, as in a fresh worker.
fn load_case(
    p: &Prepared,
    out: &Path,
    runs: usize,
    buf: &mut Vec<u8>,
) -> Result<BenchResult, BenchError> {
    let (shards, bytes) = shard_files(p, out)?;
    raw_read(&shards, buf)?; // warm-up
    let (mut achieved, mut limit, mut times) = (Vec::new(), Vec::new(), Vec::new());
    let mut one_thread = Vec::new();
    let (mut reads, mut copies) = (Vec::new(), Vec::new());
    for _ in 0..runs {
        let read = raw_read(&shards, buf)?;
        limit.push(read.rate_on(LOAD_THREADS));
        one_thread.push(read.rate());
        reads.push(read);
        let (t, _) = load_all(p, out, None)?;
        // After the load: the first load is the first use of fresh memory in this process.
        let (copied, copy_secs) = fresh_copy(&shards)?;
        copies.push(copied as f64 / copy_secs);
        achieved.push(bytes as f64 / t.total());
        println!(
            "  worker load: {:.3} GB/s ({:.1} ms: deployment {:.1}, open + verify {:.1}, copy \
             {:.1}, pack {:.1}); raw read {}; copy into fresh memory {:.2} GB/s",
            bytes as f64 / t.total() / 1e9,
            t.total() * 1e3,
            t.deploy * 1e3,
            t.open_verify * 1e3,
            t.copy * 1e3,
            t.pack * 1e3,
            read_text(&read),
            copied as f64 / copy_secs / 1e9
        );
        times.push(t);
    }
    let med = |f: fn(&LoadTimes) -> f64| membw::median(&times.iter().map(f).collect::<Vec<_>>());
    let fresh = membw::median(&copies);
    Ok(with_reads(
        throughput_result("worker_load_throughput", 1, &achieved, &limit),
        &reads,
    )
    .with(
        "ratio_of_one_thread_read",
        membw::median(&achieved) / membw::median(&one_thread),
    )
    .with("fresh_copy", fresh / 1e9)
    .with("ratio_of_fresh_copy", membw::median(&achieved) / fresh)
    .with("kind", "load")
    .with("shard_bytes", bytes)
    .with("shards", shards.len())
    .with("first_run", achieved[0] / 1e9)
    .with("first_run_ratio", achieved[0] / limit[0])
    .with("median_deployment_s", med(|t| t.deploy))
    .with("median_open_verify_s", med(|t| t.open_verify))
    .with("median_copy_s", med(|t| t.copy))
    .with("median_pack_s", med(|t| t.pack))
    .with(
        "limit_kind",
        format!(
            "raw read of the same shard files {READ_LIMIT_KIND} (fresh_copy: a copy of the \
             mapped files into one fresh huge-page buffer, the least work of a loader, a \
             reference)"
        ),
    ))
}

/// Worker load of every device shard of `out` from a tile cache (`worker --tile-cache`):
/// one load that repacks and keeps the tiles (not timed), then `runs` loads that map them, each
/// after a raw read of the shard files. Achieved counts the shards' bytes, as the repacking
/// load's row does (the tile files hold the same weights, padded to whole row blocks).
fn mapped_load_case(
    p: &Prepared,
    out: &Path,
    runs: usize,
    buf: &mut Vec<u8>,
) -> Result<BenchResult, BenchError> {
    let (shards, bytes) = shard_files(p, out)?;
    let tiles = out.join("tile-cache");
    let (first, uses) = load_all(p, out, Some(&tiles))?;
    let mut write_s = 0.0;
    for u in &uses {
        match u {
            TileCacheUse::Written { write_s: s, .. } => write_s += s,
            other => {
                return Err(BenchError::TileCache(format!(
                    "the first load did not keep its tiles: {other:?}"
                )));
            }
        }
    }
    println!(
        "  worker load keeping its tiles: {:.3} GB/s ({:.1} ms, {:.1} of them writing the tiles)",
        bytes as f64 / first.total() / 1e9,
        first.total() * 1e3,
        write_s * 1e3
    );
    let tile_bytes: u64 = std::fs::read_dir(&tiles)?
        .filter_map(Result::ok)
        .filter_map(|e| e.metadata().ok())
        .map(|m| m.len())
        .sum();
    let (mut achieved, mut limit, mut reads, mut mapped) =
        (Vec::new(), Vec::new(), Vec::new(), true);
    let mut one_thread = Vec::new();
    for _ in 0..runs {
        let read = raw_read(&shards, buf)?;
        limit.push(read.rate_on(LOAD_THREADS));
        one_thread.push(read.rate());
        reads.push(read);
        let (t, uses) = load_all(p, out, Some(&tiles))?;
        for u in &uses {
            match u {
                TileCacheUse::Reused { lock_error, .. } => mapped &= lock_error.is_none(),
                other => {
                    return Err(BenchError::TileCache(format!(
                        "a load did not reuse the kept tiles: {other:?}"
                    )));
                }
            }
        }
        achieved.push(bytes as f64 / t.total());
        println!(
            "  worker load from the tile cache: {:.3} GB/s ({:.1} ms: deployment {:.1}, open + \
             map + verify {:.1} [{:.2} + {:.2}]); raw read {}",
            bytes as f64 / t.total() / 1e9,
            t.total() * 1e3,
            t.deploy * 1e3,
            (t.open_verify + t.pack) * 1e3,
            t.open_verify * 1e3,
            t.pack * 1e3,
            read_text(&read)
        );
    }
    std::fs::remove_dir_all(&tiles)?;
    Ok(with_reads(
        throughput_result("worker_load_tile_cache_throughput", 1, &achieved, &limit),
        &reads,
    )
    .with("kind", "load_tile_cache")
    .with("shard_bytes", bytes)
    .with(
        "ratio_of_one_thread_read",
        membw::median(&achieved) / membw::median(&one_thread),
    )
    .with("tile_cache_bytes", tile_bytes)
    .with("shards", shards.len())
    .with("mapped", mapped)
    .with(
        "first_load_keeping_tiles",
        bytes as f64 / first.total() / 1e9,
    )
    .with("first_load_write_s", write_s)
    .with(
        "limit_kind",
        format!(
            "raw read of the same shard files {READ_LIMIT_KIND}; the load maps the tile cache \
             files a first load wrote, locks them in memory (or copies them where it may not \
             lock: mapped false) and checks their crc32c on two threads (the device's, when \
             more)"
        ),
    ))
}

/// Squared-error sums of one expert (or many): weights and FFN outputs, searched and absmax.
#[derive(Clone, Copy, Debug, Default)]
struct ErrorSums {
    w_searched: f64,
    w_absmax: f64,
    w_norm: f64,
    y_searched: f64,
    y_absmax: f64,
    y_norm: f64,
    /// Thread-seconds spent in each quantizer.
    searched_s: f64,
    absmax_s: f64,
}

impl ErrorSums {
    fn add(&mut self, o: &ErrorSums) {
        self.w_searched += o.w_searched;
        self.w_absmax += o.w_absmax;
        self.w_norm += o.w_norm;
        self.y_searched += o.y_searched;
        self.y_absmax += o.y_absmax;
        self.y_norm += o.y_norm;
        self.searched_s += o.searched_s;
        self.absmax_s += o.absmax_s;
    }
}

fn sq_diff(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(&x, &y)| (x as f64 - y as f64).powi(2))
        .sum()
}

/// Dot product in f64 (four partial sums).
fn dot(w: &[f32], x: &[f64]) -> f64 {
    let mut acc = [0f64; 4];
    let (wc, xc) = (w.chunks_exact(4), x.chunks_exact(4));
    let (wr, xr) = (wc.remainder(), xc.remainder());
    for (a, b) in wc.zip(xc) {
        for i in 0..4 {
            acc[i] += a[i] as f64 * b[i];
        }
    }
    let tail: f64 = wr.iter().zip(xr).map(|(&a, &b)| a as f64 * b).sum();
    (acc[0] + acc[1]) + (acc[2] + acc[3]) + tail
}

/// The expert FFN `down · (silu(gate·x) ⊙ up·x)` in f64 for every input of `xs` (`[n][H]`).
fn ffn(w: &[Vec<f32>; 3], h: usize, f: usize, xs: &[f64]) -> Vec<f64> {
    let n = xs.len() / h;
    let mut act = vec![0f64; f];
    let mut y = vec![0f64; n * h];
    for j in 0..n {
        let x = &xs[j * h..(j + 1) * h];
        for r in 0..f {
            let g = dot(&w[0][r * h..(r + 1) * h], x);
            let u = dot(&w[1][r * h..(r + 1) * h], x);
            act[r] = g / (1.0 + (-g).exp()) * u;
        }
        for r in 0..h {
            y[j * h + r] = dot(&w[2][r * f..(r + 1) * f], &act);
        }
    }
    y
}

/// Quantize `w` (`[rows][cols]`) both ways and dequantize: (searched, absmax), and the
/// seconds each quantizer took.
fn both_quantizers(
    w: &[f32],
    rows: usize,
    cols: usize,
    spec: QuantSpec,
) -> Result<([Vec<f32>; 2], [f64; 2]), BenchError> {
    let t0 = Instant::now();
    let searched = quantize_matrix_searched(w, rows, cols, spec)?;
    let t1 = Instant::now();
    let absmax = PackedMatrix::quantize("bench weights", spec, rows, cols, w)?;
    let t2 = Instant::now();
    let secs = [(t1 - t0).as_secs_f64(), (t2 - t1).as_secs_f64()];
    Ok(([searched.dequantize(), absmax.dequantize()], secs))
}

/// Weight and output error sums of one expert (`w`: gate, up, down as f32).
fn expert_error(
    w: [Vec<f32>; 3],
    opts: &ConvertBenchOptions,
    spec: QuantSpec,
    seed: u64,
) -> Result<ErrorSums, BenchError> {
    let (h, f) = (opts.hidden, opts.moe_inter);
    let shapes = [(f, h), (f, h), (h, f)];
    let mut s = ErrorSums::default();
    let (mut ws, mut wa) = (Vec::new(), Vec::new());
    for (m, &(rows, cols)) in w.iter().zip(&shapes) {
        let ([qs, qa], [ts, ta]) = both_quantizers(m, rows, cols, spec)?;
        s.searched_s += ts;
        s.absmax_s += ta;
        s.w_searched += sq_diff(m, &qs);
        s.w_absmax += sq_diff(m, &qa);
        s.w_norm += m.iter().map(|&x| (x as f64).powi(2)).sum::<f64>();
        ws.push(qs);
        wa.push(qa);
    }
    let mut normals = Normals::new(seed);
    let xs: Vec<f64> = (0..opts.error_inputs * h).map(|_| normals.next()).collect();
    let into3 = |v: Vec<Vec<f32>>| -> [Vec<f32>; 3] { v.try_into().expect("three matrices") };
    let y = ffn(&w, h, f, &xs);
    let y_s = ffn(&into3(ws), h, f, &xs);
    let y_a = ffn(&into3(wa), h, f, &xs);
    let sq = |a: &[f64], b: &[f64]| -> f64 { a.iter().zip(b).map(|(x, y)| (x - y).powi(2)).sum() };
    s.y_searched = sq(&y_s, &y);
    s.y_absmax = sq(&y_a, &y);
    s.y_norm = y.iter().map(|v| v * v).sum();
    Ok(s)
}

/// Expert `i` of the error sample: `(layer, expert)`, spread over the layers.
fn error_expert(opts: &ConvertBenchOptions, i: usize) -> (usize, usize) {
    (i % opts.layers, (i / opts.layers) % opts.experts)
}

/// The weights of error-sample expert `i` of `dist` as f32: the checkpoint's own tensors for
/// the Gaussian distribution (the BF16 values as stored), generated otherwise.
fn error_weights(
    p: &Prepared,
    ckpt: &Checkpoint,
    opts: &ConvertBenchOptions,
    dist: WeightDist,
    i: usize,
) -> Result<[Vec<f32>; 3], BenchError> {
    let (layer, e) = error_expert(opts, i);
    if dist != WeightDist::Gaussian {
        let m = synthetic_expert(opts, dist, layer, e);
        return Ok(m.map(|v| v.iter().map(|x| x.to_f32()).collect()));
    }
    let names = expert_tensor_names(Family::Qwen3Moe, layer as u32, ExpertRef::Routed(e as u32))?;
    let read = |n: &String| -> Result<Vec<f32>, BenchError> {
        let v = ckpt.tensor(n)?;
        v.to_f32_vec().map_err(|cause| BenchError::Tensor {
            dir: p.ckpt_dir.clone(),
            cause: Box::new(cause),
        })
    };
    Ok([read(&names[0])?, read(&names[1])?, read(&names[2])?])
}

/// The quantizer error results of one distribution.
fn error_case(
    p: &Prepared,
    opts: &ConvertBenchOptions,
    dist: WeightDist,
    threads: usize,
) -> Result<[BenchResult; 2], BenchError> {
    let ckpt = Checkpoint::open(&p.ckpt_dir)?;
    let n = opts.error_experts;
    let parts = par_map(n, threads, |i| {
        let w = error_weights(p, &ckpt, opts, dist, i)?;
        let seed = mix_seed(&[opts.seed, 0x1A9E, dist as u64, i as u64]);
        expert_error(w, opts, p.spec.quant, seed)
    });
    let mut s = ErrorSums::default();
    for part in parts {
        s.add(&part?);
    }
    let rel = |e: f64, norm: f64| (e / norm).sqrt();
    // Quantizer speed, BF16 source MB per thread-second (one thread per expert).
    let mb = (n as u64 * opts.expert_bytes()) as f64 / 1e6;
    let result = |what: &str, searched: f64, absmax: f64| {
        let mut r = BenchResult::new(
            format!("quant_{what}_rel_error_{}", dist.name()),
            n as u64,
            searched,
            absmax,
            "rel-L2",
        )
        .with("kind", "quant_error")
        .with("distribution", dist.name())
        .with("experts", n)
        .with("searched_mb_per_thread_s", mb / s.searched_s)
        .with("absmax_mb_per_thread_s", mb / s.absmax_s)
        .with(
            "limit_kind",
            "reference to beat, not a bound: absmax round-to-nearest (PackedMatrix::quantize) \
             on the same BF16 weights; the searched result is the per-group optimum of the \
             weight error in this format, so no quantizer of it has a lower weight error",
        )
        .against_reference();
        r.better = Better::Lower;
        r
    };
    let out = result(
        "output",
        rel(s.y_searched, s.y_norm),
        rel(s.y_absmax, s.y_norm),
    )
    .with("inputs_per_expert", opts.error_inputs);
    let weight = result(
        "weight",
        rel(s.w_searched, s.w_norm),
        rel(s.w_absmax, s.w_norm),
    );
    println!(
        "  quantizer error, {}: output {:.5} searched vs {:.5} absmax (ratio {:.3}); weights \
         {:.5} vs {:.5} (ratio {:.3}); quantizers {:.1} vs {:.0} MB/s per thread",
        dist.name(),
        out.achieved,
        out.limit,
        out.ratio,
        weight.achieved,
        weight.limit,
        weight.ratio,
        mb / s.searched_s,
        mb / s.absmax_s
    );
    Ok([out, weight])
}

/// Refuse a run whose memory the machine does not have now (`available`: MemAvailable, when
/// known): it holds the checkpoint's largest file in one buffer (at most the whole
/// checkpoint), every device's loaded experts, and a fresh copy of the shards at once (INT4,
/// under a third of the BF16 bytes each), so the checkpoint's bytes and three quarters again
/// are asked for, against 80 % of what is available.
fn check_memory(opts: &ConvertBenchOptions, available: Option<u64>) -> Result<(), BenchError> {
    let checkpoint = opts.expert_bytes() * (opts.experts * opts.layers) as u64;
    let need = checkpoint.saturating_add(checkpoint / 4 * 3);
    match available {
        Some(free) if need > free / 5 * 4 => Err(BenchError::Options(format!(
            "this run needs about {:.1} GB of memory (a {:.1} GB BF16 checkpoint's largest file in \
             one buffer, the shards loaded and copied), more than 80 % of the {:.1} GB available \
             now: lower --experts or --layers",
            need as f64 / 1e9,
            checkpoint as f64 / 1e9,
            free as f64 / 1e9
        ))),
        _ => Ok(()),
    }
}

/// Run the bench and return the report.
pub fn run(opts: &ConvertBenchOptions) -> Result<BenchReport, BenchError> {
    opts.check()?;
    check_memory(opts, crate::method::machine::memory_available_bytes())?;
    let temp;
    let dir = match &opts.dir {
        Some(d) => d.clone(),
        None => {
            temp = tempfile::Builder::new()
                .prefix("expertmesh-bench-convert")
                .tempdir()?;
            temp.path().to_path_buf()
        }
    };
    let mut report = BenchReport::new();
    let extra = &mut report.machine.extra;
    extra.insert("settings".into(), opts.settings(&dir));
    extra.insert("loadavg_start".into(), loadavg().into());
    let p = prepare(&dir, opts)?;
    let mut buf = Vec::new();
    raw_read(&p.files, &mut buf)?; // warm-up: both sides read the page cache
    let mut load_from = None;
    for &threads in &opts.threads {
        let (r, out) = convert_case(&p, threads, opts.repeats, &mut buf)?;
        report.results.push(r);
        match &load_from {
            None => load_from = Some(out),
            Some(_) => std::fs::remove_dir_all(&out)?,
        }
    }
    let out = load_from.expect("at least one thread count");
    let runs = opts.repeats * LOAD_RUNS_PER_REPEAT;
    report.results.push(load_case(&p, &out, runs, &mut buf)?);
    report
        .results
        .push(mapped_load_case(&p, &out, runs, &mut buf)?);
    drop(buf);
    let threads = opts.threads.iter().copied().max().unwrap_or(1);
    for dist in WeightDist::ALL
        .into_iter()
        .filter(|_| opts.error_experts > 0)
    {
        report.results.extend(error_case(&p, opts, dist, threads)?);
    }
    report
        .machine
        .extra
        .insert("loadavg_end".into(), loadavg().into());
    Ok(report)
}

/// `/proc/loadavg`'s three load averages (empty where unknown): other work on a shared
/// machine slows a compute-bound step such as the conversion, but not its read limit.
fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A run is refused when what it asks for passes 80 % of the memory available, naming
    /// the sizes and what to lower; without a figure for the available memory it runs.
    #[test]
    fn a_run_larger_than_the_memory_available_is_refused() {
        let o = ConvertBenchOptions::standard();
        let checkpoint = o.expert_bytes() * (o.experts * o.layers) as u64;
        let need = checkpoint + checkpoint / 4 * 3;
        assert!(check_memory(&o, None).is_ok());
        assert!(check_memory(&o, Some(need * 2)).is_ok());
        let e = check_memory(&o, Some(need)).unwrap_err().to_string();
        assert!(e.contains("lower --experts or --layers"), "{e}");
    }

    fn std_of(v: &[bf16]) -> f64 {
        let n = v.len() as f64;
        (v.iter().map(|x| (x.to_f64()).powi(2)).sum::<f64>() / n).sqrt()
    }

    #[test]
    fn weights_have_the_stated_scale() {
        let (rows, cols) = (64, 1024);
        let want = 1.0 / (cols as f64).sqrt();
        for dist in [WeightDist::Gaussian, WeightDist::StudentT4] {
            let m = synthetic_matrix(dist, 7, rows, cols);
            let got = std_of(&m);
            assert!(
                (got / want - 1.0).abs() < 0.05,
                "{dist:?}: std {got}, want {want}"
            );
        }
        // Outlier columns: a few columns, every row, OUTLIER_SCALE times larger.
        let m = synthetic_matrix(WeightDist::OutlierColumns, 7, rows, cols);
        let col_std = |c: usize| {
            let col: Vec<bf16> = (0..rows).map(|r| m[r * cols + c]).collect();
            std_of(&col) / want
        };
        let big = (0..cols).filter(|&c| col_std(c) > 4.0).count();
        assert!((1..=cols / 32).contains(&big), "{big} outlier columns");
        // Deterministic from the seed.
        let again = |seed| synthetic_matrix(WeightDist::StudentT4, seed, 2, 64);
        assert_eq!(again(7), again(7));
        assert_ne!(again(7), again(8));
    }

    #[test]
    fn par_map_keeps_index_order() {
        let v = par_map(100, 3, |i| i * i);
        assert_eq!(v, (0..100).map(|i| i * i).collect::<Vec<_>>());
        assert!(par_map(0, 2, |i| i).is_empty());
    }

    #[test]
    fn ffn_matches_a_direct_evaluation() {
        let (h, f) = (8, 4);
        let mut n = Normals::new(3);
        let mut mat = |len: usize| (0..len).map(|_| n.next() as f32).collect::<Vec<f32>>();
        let w = [mat(f * h), mat(f * h), mat(h * f)];
        let x: Vec<f64> = (0..2 * h).map(|i| (i as f64 - 7.0) / 5.0).collect();
        let y = ffn(&w, h, f, &x);
        for j in 0..2 {
            let xj = &x[j * h..(j + 1) * h];
            let act: Vec<f64> = (0..f)
                .map(|r| {
                    let row =
                        |m: &[f32]| -> f64 { (0..h).map(|k| m[r * h + k] as f64 * xj[k]).sum() };
                    let (g, u) = (row(&w[0]), row(&w[1]));
                    g / (1.0 + (-g).exp()) * u
                })
                .collect();
            for r in 0..h {
                let want: f64 = (0..f).map(|c| w[2][r * f + c] as f64 * act[c]).sum();
                assert!((y[j * h + r] - want).abs() < 1e-9 * (1.0 + want.abs()));
            }
        }
    }

    #[test]
    fn quick_and_standard_options_are_valid() {
        ConvertBenchOptions::quick().check().unwrap();
        ConvertBenchOptions::standard().check().unwrap();
        let bad = ConvertBenchOptions {
            hidden: 100,
            ..ConvertBenchOptions::quick()
        };
        assert!(bad.check().is_err());
    }
}
