//! The `ExpertBackend` trait: what a device that runs experts must do.
//!
//! Why this exists: the worker runs experts through this trait and does not know whether a CPU
//! or a GPU is behind it. This crate depends on no implementation (tikv's engine-traits rule):
//! the CPU backend lives in `expertmesh-cpu-backend`, the HIP backend in `expertmesh-hip-kernels`
//! behind its feature, and a backend
//! that is not compiled in reports [`BackendError::NotCompiled`] instead of panicking.
//!
//! # Design
//!
//! * **Load once.** [`ExpertBackend::load`] receives every (layer, expert) the device pins for its
//!   whole life plus the largest batch it will ever see ([`BatchLimits`]); implementations
//!   allocate all device and scratch buffers there. `execute` allocates nothing proportional to
//!   the batch.
//! * **Grouped batches.** The caller has already grouped rows by expert: a [`GroupedBatch`] is one
//!   input matrix `[T][H]` plus a list of [`ExpertGroup`]s, each naming an expert, the token rows
//!   that chose it and their routing weights. Each touched expert's weights are read once per
//!   batch however many tokens chose it.
//! * **Output rows.** Every (token, expert) pair of the batch has an output row index
//!   (`ExpertGroup::out_rows`), numbered token-major in slot order by the caller. With
//!   [`OutputLayout::PerSlot`] row `r` of the output holds that pair's unweighted expert output;
//!   with [`OutputLayout::PreCombined`] row `t` holds `Σ w·y` over token `t`'s pairs, summed in
//!   increasing output-row order (contract §5, restricted to this device's slots).

pub mod grouping;

pub use expertmesh_quant::contract::OutputLayout;
pub use grouping::Grouping;

use expertmesh_quant::contract::ComputeMode;
use expertmesh_quant::format::{ExpertWeights, PackedRef};
use std::fmt;

/// Which expert: MoE layer index and expert index. Shared experts of a layer use indices
/// `routed_experts + i`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ExpertKey {
    /// Transformer layer index.
    pub layer: u32,
    /// Expert index within the layer.
    pub expert: u32,
}

impl fmt::Display for ExpertKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "layer {} expert {}", self.layer, self.expert)
    }
}

/// The largest batch a backend must accept; buffers are sized from it at load time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchLimits {
    /// Tokens per batch (rows of the input).
    pub max_tokens: usize,
    /// (token, expert) pairs per batch.
    pub max_pairs: usize,
}

/// Input activations of a batch, `[T][H]` row-major.
#[derive(Clone, Copy, Debug)]
pub enum Activations<'a> {
    /// f32 hidden states.
    F32(&'a [f32]),
    /// Already quantized per contract §1: int8 codes `[T][H]` and scales `[T][H/32]`. Valid in
    /// exact mode only (it is exactly what exact mode would compute from the f32 input).
    Q8 {
        /// Codes.
        q: &'a [i8],
        /// Per-block scales.
        d: &'a [f32],
    },
}

/// All tokens of one batch that chose one expert.
#[derive(Clone, Copy, Debug)]
pub struct ExpertGroup<'a> {
    /// The expert.
    pub key: ExpertKey,
    /// Input row of each token, ascending.
    pub tokens: &'a [u32],
    /// Routing weight of each token for this expert (used by [`OutputLayout::PreCombined`]).
    pub weights: &'a [f32],
    /// Output row of each (token, expert) pair (see the module docs).
    pub out_rows: &'a [u32],
}

/// One grouped batch.
#[derive(Clone, Copy, Debug)]
pub struct GroupedBatch<'a> {
    /// Exact (W4A8) or accurate (W4A16).
    pub mode: ComputeMode,
    /// Hidden size H.
    pub hidden: usize,
    /// Number of input rows T.
    pub tokens: usize,
    /// The input.
    pub input: Activations<'a>,
    /// Expert groups.
    pub groups: &'a [ExpertGroup<'a>],
    /// Output layout.
    pub layout: OutputLayout,
}

impl GroupedBatch<'_> {
    /// Total (token, expert) pairs.
    pub fn pairs(&self) -> usize {
        self.groups.iter().map(|g| g.tokens.len()).sum()
    }

    /// Required output length for this batch's layout.
    pub fn output_len(&self) -> usize {
        match self.layout {
            OutputLayout::PerSlot => self.pairs() * self.hidden,
            OutputLayout::PreCombined => self.tokens * self.hidden,
        }
    }

    /// Check shapes and indices against `limits`; every backend calls this first.
    pub fn validate(&self, limits: &BatchLimits, out_len: usize) -> Result<(), BackendError> {
        self.validate_with(limits, out_len, &mut Vec::new())
    }

    /// [`GroupedBatch::validate`] with the caller's scratch for the output-row check, so a
    /// backend that keeps `seen` between batches validates without allocating (`seen` grows to
    /// the batch's pair count once and keeps its capacity).
    pub fn validate_with(
        &self,
        limits: &BatchLimits,
        out_len: usize,
        seen: &mut Vec<bool>,
    ) -> Result<(), BackendError> {
        let t = self.tokens;
        let h = self.hidden;
        if h == 0 || !h.is_multiple_of(expertmesh_quant::format::BLOCK) {
            return Err(BackendError::Shape(format!(
                "hidden size {h} is not a positive multiple of 32"
            )));
        }
        if t > limits.max_tokens {
            return Err(BackendError::Capacity {
                what: "tokens",
                limit: limits.max_tokens,
                got: t,
            });
        }
        let pairs = self.pairs();
        if pairs > limits.max_pairs {
            return Err(BackendError::Capacity {
                what: "(token, expert) pairs",
                limit: limits.max_pairs,
                got: pairs,
            });
        }
        match self.input {
            Activations::F32(x) if x.len() != t * h => {
                return Err(BackendError::Shape(format!(
                    "input has {} values, expected {t} x {h}",
                    x.len()
                )));
            }
            Activations::Q8 { q, d } => {
                if q.len() != t * h || d.len() != t * h / expertmesh_quant::format::BLOCK {
                    return Err(BackendError::Shape(format!(
                        "q8 input has {} codes and {} scales, expected {} and {}",
                        q.len(),
                        d.len(),
                        t * h,
                        t * h / expertmesh_quant::format::BLOCK
                    )));
                }
                if self.mode != ComputeMode::Exact {
                    return Err(BackendError::Shape(
                        "q8 input is only valid in exact mode".into(),
                    ));
                }
            }
            _ => {}
        }
        if out_len != self.output_len() {
            return Err(BackendError::Shape(format!(
                "output has {out_len} values, expected {}",
                self.output_len()
            )));
        }
        seen.clear();
        seen.resize(pairs, false);
        for g in self.groups {
            let n = g.tokens.len();
            if g.weights.len() != n || g.out_rows.len() != n {
                return Err(BackendError::Shape(format!(
                    "{}: {} tokens but {} weights and {} output rows",
                    g.key,
                    n,
                    g.weights.len(),
                    g.out_rows.len()
                )));
            }
            for (&tok, &row) in g.tokens.iter().zip(g.out_rows) {
                if tok as usize >= t {
                    return Err(BackendError::Shape(format!(
                        "{}: token row {tok} out of range (batch has {t})",
                        g.key
                    )));
                }
                let r = row as usize;
                if r >= pairs || seen[r] {
                    return Err(BackendError::Shape(format!(
                        "{}: output row {row} out of range or used twice (batch has {pairs} pairs)",
                        g.key
                    )));
                }
                seen[r] = true;
            }
        }
        Ok(())
    }
}

/// Errors from expert backends.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BackendError {
    /// The backend was not compiled into this binary.
    #[error("the {backend} backend is not compiled in: rebuild with `--features {feature}`")]
    NotCompiled {
        /// Backend name.
        backend: &'static str,
        /// Cargo feature that enables it.
        feature: &'static str,
    },
    /// No usable device.
    #[error("no {backend} device available: {detail}")]
    NoDevice {
        /// Backend name.
        backend: &'static str,
        /// What was found instead.
        detail: String,
    },
    /// The batch names an expert this device did not load.
    #[error("{0} is not loaded on this device")]
    UnknownExpert(ExpertKey),
    /// The batch is larger than the limits given at load time.
    #[error("batch has {got} {what}, more than the {limit} this backend was loaded for")]
    Capacity {
        /// What overflowed.
        what: &'static str,
        /// The limit.
        limit: usize,
        /// The batch's value.
        got: usize,
    },
    /// Shapes or indices are inconsistent.
    #[error("bad batch: {0}")]
    Shape(String),
    /// Experts do not fit the device.
    #[error("experts need {need} bytes but the device has {have} bytes available")]
    OutOfMemory {
        /// Bytes needed.
        need: u64,
        /// Bytes available.
        have: u64,
    },
    /// A device runtime call failed.
    #[error("{backend} runtime: {detail}")]
    Device {
        /// Backend name.
        backend: &'static str,
        /// The failing call and its error.
        detail: String,
    },
    /// An [`ExpertSource`] could not produce an expert (a damaged shard file, say).
    #[error("reading experts to load: {0}")]
    Source(String),
    /// `execute` was called before `load`.
    #[error("no experts loaded: call load() first")]
    NotLoaded,
}

/// The shape of one expert an [`ExpertSource`] will hand over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertShape {
    /// Which expert.
    pub key: ExpertKey,
    /// Hidden size.
    pub hidden: usize,
    /// Intermediate size.
    pub inter: usize,
    /// Packed format.
    pub quant: expertmesh_quant::format::QuantSpec,
}

/// Experts handed to [`ExpertBackend::load_from`] one at a time (a shard file being read), so
/// a backend can put each into its own memory and drop it: the set is never held twice.
pub trait ExpertSource {
    /// Every expert's key and shape, in the order [`ExpertSource::expert`] hands them over.
    fn shapes(&self) -> &[ExpertShape];
    /// Expert `i` (called once per `i`, in increasing order).
    fn expert(&mut self, i: usize) -> Result<ExpertWeights, BackendError>;

    /// Expert `i` as `(W13, W2)` borrowed in place (a mapped shard), when the source can: a
    /// backend that repacks anyway reads it without the copy [`ExpertSource::expert`] makes.
    /// May be called more than once per `i`. `None`: use [`ExpertSource::expert`].
    fn expert_ref(
        &mut self,
        i: usize,
    ) -> Option<Result<(PackedRef<'_>, PackedRef<'_>), BackendError>> {
        let _ = i;
        None
    }

    /// Called once after the last expert, before the backend commits the load: a source that
    /// checks its data alongside (a shard's checksum) reports a failure here, and the load
    /// fails. A backend that takes no expert from the source (it found the same content, by
    /// [`ExpertSource::content_id`], already prepared) does not call it.
    fn finish(&mut self) -> Result<(), BackendError> {
        Ok(())
    }

    /// What exactly this source hands over, named stably across processes: a backend may keep
    /// what it derives from the experts under this name and reuse it when the same name comes
    /// again. `None` (in-memory experts): nothing may be reused.
    fn content_id(&self) -> Option<ContentId> {
        None
    }
}

/// The name of a source's content ([`ExpertSource::content_id`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ContentId {
    /// Where the content lives (a converted shard: its path): a backend keeps at most one
    /// derived copy per place, so new content at the same place replaces the old copy.
    pub place: String,
    /// Everything that tells this content from any other at that place (a converted shard: the
    /// conversion's fingerprint, the file's size, modification time, inode and checksum, the
    /// experts selected). A derived copy is reused only when this is equal.
    pub id: String,
}

/// An in-memory set of experts as an [`ExpertSource`] (each handed over once).
#[derive(Debug)]
pub struct VecSource {
    shapes: Vec<ExpertShape>,
    experts: Vec<Option<ExpertWeights>>,
}

impl VecSource {
    /// The source of `experts`.
    pub fn new(experts: Vec<(ExpertKey, ExpertWeights)>) -> Self {
        let shapes = experts
            .iter()
            .map(|(key, w)| ExpertShape {
                key: *key,
                hidden: w.hidden(),
                inter: w.inter(),
                quant: w.spec(),
            })
            .collect();
        Self {
            shapes,
            experts: experts.into_iter().map(|(_, w)| Some(w)).collect(),
        }
    }
}

impl ExpertSource for VecSource {
    fn shapes(&self) -> &[ExpertShape] {
        &self.shapes
    }

    fn expert(&mut self, i: usize) -> Result<ExpertWeights, BackendError> {
        self.experts
            .get_mut(i)
            .and_then(Option::take)
            .ok_or_else(|| BackendError::Source(format!("expert {i} was already handed over")))
    }
}

/// Read every expert of `source` into memory (what a backend without a streaming load does).
pub fn collect_source(
    source: &mut dyn ExpertSource,
) -> Result<Vec<(ExpertKey, ExpertWeights)>, BackendError> {
    let keys: Vec<ExpertKey> = source.shapes().iter().map(|s| s.key).collect();
    let experts = keys
        .into_iter()
        .enumerate()
        .map(|(i, key)| Ok((key, source.expert(i)?)))
        .collect::<Result<Vec<_>, BackendError>>()?;
    source.finish()?;
    Ok(experts)
}

/// Packs experts for one backend off the thread that serves ([`ExpertBackend::stager`]).
pub trait ExpertStager: Send {
    /// Every expert of `source`, packed the way the backend keeps them.
    fn stage(&self, source: &mut dyn ExpertSource) -> Result<StagedExperts, BackendError>;
}

/// Experts packed by an [`ExpertStager`], waiting for [`ExpertBackend::install`].
pub struct StagedExperts {
    /// Their keys, in the order staged.
    pub keys: Vec<ExpertKey>,
    /// Bytes of their packed weights (the format's accounting).
    pub bytes: u64,
    /// The backend's own packed form (only the backend whose stager made it reads it).
    pub packed: Box<dyn std::any::Any + Send>,
}

impl fmt::Debug for StagedExperts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StagedExperts")
            .field("experts", &self.keys.len())
            .field("bytes", &self.bytes)
            .finish_non_exhaustive()
    }
}

/// A device that runs packed-INT4 experts. See the module docs for the design.
pub trait ExpertBackend: Send {
    /// Short name for logs and reports ("cpu-avx512-vnni", "hip-gfx90a", ...).
    fn name(&self) -> String;

    /// Pin `experts` for the life of the backend and allocate every buffer for batches up to
    /// `limits`. Called once; a second call replaces everything.
    fn load(
        &mut self,
        experts: Vec<(ExpertKey, ExpertWeights)>,
        limits: BatchLimits,
    ) -> Result<(), BackendError>;

    /// [`ExpertBackend::load`] from a source handing experts over one at a time. Backends
    /// that can place each expert as it arrives override this so the set is never in memory
    /// twice; the default collects the source and calls `load`.
    fn load_from(
        &mut self,
        source: &mut dyn ExpertSource,
        limits: BatchLimits,
    ) -> Result<(), BackendError> {
        let experts = collect_source(source)?;
        self.load(experts, limits)
    }

    /// Run one grouped batch, writing `batch.output_len()` values to `out`.
    fn execute(&mut self, batch: &GroupedBatch<'_>, out: &mut [f32]) -> Result<(), BackendError>;

    /// Bytes of expert weights pinned.
    fn loaded_bytes(&self) -> u64;

    /// Pin the experts of `source` next to those loaded (a live placement change: the device
    /// gains experts while it serves its others). Keys already loaded are an error, and so is a
    /// hidden size unlike the loaded experts'. A backend that cannot change its set while
    /// serving says so (the default), and the change is refused for its device.
    fn add_experts(&mut self, source: &mut dyn ExpertSource) -> Result<(), BackendError> {
        let _ = source;
        Err(BackendError::Source(format!(
            "the {} backend cannot gain experts while serving; restart its worker with the new placement",
            self.name()
        )))
    }

    /// A stager that packs experts for this backend on another thread, so that a device
    /// gaining experts keeps serving while they are packed and only installs them
    /// ([`ExpertBackend::install`]). `None` (the default): gains go through
    /// [`ExpertBackend::add_experts`] on the serving thread.
    fn stager(&self) -> Option<Box<dyn ExpertStager>> {
        None
    }

    /// Pin experts this backend's stager packed next to those loaded. The checks of
    /// [`ExpertBackend::add_experts`] apply; experts staged by another backend are an error.
    fn install(&mut self, staged: StagedExperts) -> Result<(), BackendError> {
        let _ = staged;
        Err(BackendError::Source(format!(
            "the {} backend has no stager; its gains load through add_experts",
            self.name()
        )))
    }

    /// Release `keys` (a live placement change: the device lost them) and their memory. A key
    /// not loaded is an error and nothing is released.
    fn release_experts(&mut self, keys: &[ExpertKey]) -> Result<(), BackendError> {
        let _ = keys;
        Err(BackendError::Source(format!(
            "the {} backend cannot release experts while serving; restart its worker with the new placement",
            self.name()
        )))
    }
}
