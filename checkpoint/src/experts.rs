//! One expert of a Hugging Face checkpoint → packed INT4 [`ExpertWeights`]: the step
//! `expertmesh convert` runs per expert.
//!
//! Why this exists: a checkpoint stores each expert as three dense projections (gate, up, down)
//! under family-specific names and in BF16, F16, F32 or scaled FP8. The serving format is
//! the packed INT4 pair `W13` (gate and up rows interleaved, [`w13_row_meaning`]) and `W2`, in
//! the model's [`QuantSpec`]. This module finds the tensors, checks their shapes against the
//! [`ModelSpec`], and streams them row by row through the searched quantizer
//! ([`quantize_rows_measured`]), so memory beyond the output is one row of f32 (plus an FP8
//! tensor's small block-scale grid), whatever the expert's size.
//!
//! Tensor names (the published layouts, PyTorch `Linear` weights `[out, in]`: gate and up
//! `[F, H]`, down `[H, F]`):
//!
//! * DeepSeek-V3, Kimi K2, GLM-4.5: `model.layers.{L}.mlp.experts.{e}.{gate,up,down}_proj.weight`;
//!   shared: `model.layers.{L}.mlp.shared_experts.{gate,up,down}_proj.weight`.
//! * Qwen3-MoE, OLMoE: `model.layers.{L}.mlp.experts.{e}.{gate,up,down}_proj.weight`; no shared
//!   expert. Qwen2-MoE: the same routed names; shared:
//!   `model.layers.{L}.mlp.shared_expert.{gate,up,down}_proj.weight` (its per-token gate
//!   `model.layers.{L}.mlp.shared_expert_gate.weight` `[1, H]` goes to the router file).
//! * Mixtral: `model.layers.{L}.block_sparse_moe.experts.{e}.{w1,w3,w2}.weight` (w1 = gate,
//!   w3 = up, w2 = down); no shared expert.
//! * Fused (transformers v5 and the models published with it, or a checkpoint re-saved with
//!   `save_original_format=False`): a layer's routed experts in two 3-D tensors,
//!   `model.layers.{L}.mlp.experts.gate_up_proj` `[E, 2F, H]` (expert `e`'s gate rows, then its
//!   up rows) and `….down_proj` `[E, H, F]` (Mixtral's under `block_sparse_moe.experts` too),
//!   BF16, F16 or F32 ([`fused_expert_tensors`]). Read when the per-expert names are absent.
//!
//! FP8 (`F8_E4M3`) weights carry a grid of scales, each covering a block of `[b0, b1]` weights:
//! `value = e4m3(code) × scale[r/b0][c/b1]` ([`Fp8Scales`]). DeepSeek-V3 and transformers'
//! fine-grained FP8 store it as `…weight_scale_inv`, shape `[ceil(rows/b0), ceil(cols/b1)]`,
//! the block the quantization config's `weight_block_size` (128 × 128 when it names none);
//! compressed-tensors' `float-quantized` stores `…weight_scale`: per tensor (`[1]`), per output
//! channel (`[rows, 1]`) or per block (its `block_structure`). Any float dtype. A NaN or
//! infinite weight is an error naming the tensor, row and column.
//!
//! A compressed-tensors `pack-quantized` INT4 projection (Kimi K2-Thinking: `X.weight_packed`,
//! `X.weight_scale`, `X.weight_shape` instead of `X.weight`) is detected per tensor and imported
//! without requantization by [`crate::packed_import`]. A GPTQ or AWQ INT4 projection
//! (`X.qweight`, `X.qzeros`, `X.scales` instead of `X.weight`) is imported the same way, codes,
//! zero points and scale bits copied, by [`crate::gptq_import`].
//!
//! Such an import is lossless only when the model's [`QuantSpec`] has the checkpoint's group
//! size, scale dtype and zero points; [`source_quant`] reads that spec off the checkpoint so the
//! converter can set it before reading any expert.

use expertmesh_quant::format::{
    ExpertWeights, FormatError, GateUp, PackedMatrix, QuantSpec, ScaleDtype, w13_row_meaning,
};
use expertmesh_quant::search::{SquaredError, quantize_rows_measured};
use expertmesh_topology::model::ModelSpec;

use crate::gptq_import::{Int4Source, gptq_source_quant, open_gptq_expert};
pub use crate::hf_config::Family;
use crate::packed_import::{PackedSource, assemble_int4_expert, open_packed_expert, packed_base};
use crate::safetensors::{Checkpoint, Dtype, SafetensorsError, TensorView};

/// Rows and columns per block of an FP8 weight's `weight_scale_inv` grid when the quantization
/// config names no block size (DeepSeek-V3's).
pub const FP8_BLOCK: usize = 128;

/// Which expert of a layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ExpertRef {
    /// Routed expert `e`.
    Routed(u32),
    /// The layer's shared expert (DeepSeek-V3 family: one, of width `shared_intermediate`).
    Shared,
}

impl std::fmt::Display for ExpertRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ExpertRef::Routed(e) => write!(f, "routed expert {e}"),
            ExpertRef::Shared => f.write_str("shared expert"),
        }
    }
}

/// Everything that can go wrong reading an expert; each message names the tensor.
#[derive(Debug, thiserror::Error)]
pub enum ExpertError {
    /// The layer or expert does not exist in the model (or the family has no shared expert).
    #[error("layer {layer}, {which}: {reason}")]
    NoSuchExpert {
        /// The layer asked for.
        layer: u32,
        /// The expert asked for.
        which: ExpertRef,
        /// Why it does not exist.
        reason: String,
    },
    /// Reading a tensor failed (missing tensor, missing shard, corrupt file); names the tensor.
    #[error(transparent)]
    Read(#[from] SafetensorsError),
    /// A tensor's shape is not what the model says.
    #[error(
        "tensor \"{tensor}\" has shape {actual:?} but the model needs {expected:?}; the \
         checkpoint does not match its config.json"
    )]
    Shape {
        /// The tensor.
        tensor: String,
        /// The shape the model implies.
        expected: Vec<usize>,
        /// The shape in the checkpoint.
        actual: Vec<usize>,
    },
    /// A weight's dtype is not one the converter reads.
    #[error(
        "tensor \"{tensor}\" has dtype {dtype}; expert weights must be BF16, F16, F32 or \
         F8_E4M3 with its scales (weight_scale_inv or weight_scale)"
    )]
    Dtype {
        /// The tensor.
        tensor: String,
        /// Its dtype.
        dtype: Dtype,
    },
    /// A weight (after FP8 scaling) is NaN or infinite.
    #[error(
        "tensor \"{tensor}\": weight at row {row}, column {col} is not finite ({value}); the \
         checkpoint is corrupt: re-download it"
    )]
    NonFinite {
        /// The weight tensor.
        tensor: String,
        /// Row index.
        row: usize,
        /// Column index.
        col: usize,
        /// The value after conversion (and scaling).
        value: f32,
    },
    /// A `pack-quantized` INT4 tensor cannot be imported losslessly (wrong dtype, recorded
    /// shape, group size or scale dtype, or a mix of formats within one expert).
    #[error("tensor \"{tensor}\": {reason}")]
    Packed {
        /// The tensor.
        tensor: String,
        /// What is wrong and what to do.
        reason: String,
    },
    /// The checkpoint's quantization config (`config.json`'s `quantization_config`, or
    /// `quantize_config.json`) is unreadable or names a format that cannot be imported exactly.
    #[error("{}: {reason}", path.display())]
    Config {
        /// The config file.
        path: std::path::PathBuf,
        /// What is wrong and what to do.
        reason: String,
    },
    /// Fused expert tensors ([`fused_expert_tensors`]) in a form the converter does not read.
    #[error("tensor \"{tensor}\": {reason}")]
    Fused {
        /// The fused tensor.
        tensor: String,
        /// What is wrong and what to do.
        reason: String,
    },
    /// The quantizer refused the matrix (e.g. a dimension not a multiple of the group size).
    #[error("quantizing {what} from \"{tensor}\": {source}")]
    Quantize {
        /// Which packed matrix (`W13` or `W2`).
        what: &'static str,
        /// A source tensor of it.
        tensor: String,
        /// The quantizer's error.
        #[source]
        source: FormatError,
    },
}

impl ExpertError {
    /// The checkpoint tensor the error is about, when it names one.
    pub fn tensor(&self) -> Option<&str> {
        match self {
            ExpertError::Shape { tensor, .. }
            | ExpertError::Dtype { tensor, .. }
            | ExpertError::NonFinite { tensor, .. }
            | ExpertError::Packed { tensor, .. }
            | ExpertError::Fused { tensor, .. }
            | ExpertError::Quantize { tensor, .. } => Some(tensor),
            _ => None,
        }
    }
}

/// The checkpoint tensor names `[gate, up, down]` of one expert of `layer` in `family`'s layout.
pub fn expert_tensor_names(
    family: Family,
    layer: u32,
    which: ExpertRef,
) -> Result<[String; 3], ExpertError> {
    let p = format!("model.layers.{layer}");
    let names = match (family, which) {
        (Family::Mixtral, ExpertRef::Routed(e)) => {
            let b = format!("{p}.block_sparse_moe.experts.{e}");
            ["w1", "w3", "w2"].map(|w| format!("{b}.{w}.weight"))
        }
        (_, ExpertRef::Routed(e)) => {
            ["gate", "up", "down"].map(|w| format!("{p}.mlp.experts.{e}.{w}_proj.weight"))
        }
        (Family::Qwen2Moe, ExpertRef::Shared) => {
            ["gate", "up", "down"].map(|w| format!("{p}.mlp.shared_expert.{w}_proj.weight"))
        }
        (f, ExpertRef::Shared) if f.has_shared_expert() => {
            ["gate", "up", "down"].map(|w| format!("{p}.mlp.shared_experts.{w}_proj.weight"))
        }
        (f, ExpertRef::Shared) => {
            return Err(ExpertError::NoSuchExpert {
                layer,
                which,
                reason: format!("{f:?} checkpoints have no shared expert"),
            });
        }
    };
    Ok(names)
}

/// The fused tensors `[gate_up, down]` holding every routed expert of `layer` (module docs),
/// when `ckpt` stores them so (and not per expert).
pub fn fused_expert_tensors(ckpt: &Checkpoint, family: Family, layer: u32) -> Option<[String; 2]> {
    let p = format!("model.layers.{layer}");
    let mut homes = vec![format!("{p}.mlp.experts")];
    if family == Family::Mixtral {
        homes.push(format!("{p}.block_sparse_moe.experts"));
    }
    homes.into_iter().find_map(|home| {
        let names = [format!("{home}.gate_up_proj"), format!("{home}.down_proj")];
        names.iter().all(|n| ckpt.contains(n)).then_some(names)
    })
}

/// Routed expert `e`'s gate, up and down from the fused tensors `[gate_up, down]` (shapes
/// `[E, 2F, H]` and `[E, H, F]`, checked).
fn open_fused<'a>(
    ckpt: &'a Checkpoint,
    [gate_up, down]: &[String; 2],
    e: usize,
    [experts, inter, hidden]: [usize; 3],
) -> Result<[RowSource<'a>; 3], ExpertError> {
    let open = |name: &str, shape: [usize; 3]| -> Result<TensorView<'a>, ExpertError> {
        let view = ckpt.tensor(name)?;
        if !matches!(view.dtype(), Dtype::BF16 | Dtype::F16 | Dtype::F32) {
            return Err(ExpertError::Fused {
                tensor: name.to_string(),
                reason: format!(
                    "dtype {} in fused expert tensors is not read (BF16, F16 or F32 are); \
                     save the checkpoint with one tensor per expert (transformers: \
                     save_pretrained(..., save_original_format=True))",
                    view.dtype()
                ),
            });
        }
        check_shape(name, view.shape(), &shape)?;
        Ok(view.select(e)?)
    };
    let gu = open(gate_up, [experts, 2 * inter, hidden])?;
    let d = open(down, [experts, hidden, inter])?;
    let source = |name: &str, view, row0| RowSource {
        name: format!("{name}[{e}]"),
        view,
        row0,
        scales: None,
    };
    Ok([
        source(gate_up, gu.clone(), 0),
        source(gate_up, gu, inter),
        source(down, d, 0),
    ])
}

/// One expert's source tensors, opened and checked against the model: how it is stored
/// decides how it is read.
enum OpenedExpert<'a> {
    /// compressed-tensors `pack-quantized` INT4, imported exactly (boxed: the largest
    /// variant, once per expert).
    Packed(Box<[PackedSource<'a>; 3]>),
    /// GPTQ or AWQ INT4, imported exactly.
    Gptq([Int4Source<'a>; 3]),
    /// Floats or FP8 (per expert or a slice of the layer's fused tensors), quantized:
    /// `[gate, up, down]`.
    Float([RowSource<'a>; 3]),
}

/// Opens one expert of `layer` and checks everything its tensors' headers and the small
/// tensors beside them say (presence, dtypes, shapes against config.json, an FP8 block-scale
/// grid, a recorded shape, act-order indices, GPTQ zero points), reading no weight.
fn open_expert<'a>(
    ckpt: &'a Checkpoint,
    spec: &ModelSpec,
    family: Family,
    layer: u32,
    which: ExpertRef,
) -> Result<(OpenedExpert<'a>, usize), ExpertError> {
    let inter = expert_inter(spec, family, layer, which)?;
    let hidden = spec.hidden as usize;
    let names = expert_tensor_names(family, layer, which)?;
    if let Some(srcs) = open_packed_expert(ckpt, spec.quant, &names, inter, hidden)? {
        return Ok((OpenedExpert::Packed(Box::new(srcs)), inter));
    }
    if let Some(srcs) = open_gptq_expert(ckpt, spec.quant, &names, inter, hidden)? {
        return Ok((OpenedExpert::Gptq(srcs), inter));
    }
    let fused = match which {
        ExpertRef::Routed(e) if !ckpt.contains(&names[0]) => {
            fused_expert_tensors(ckpt, family, layer).map(|f| (f, e as usize))
        }
        _ => None,
    };
    let srcs = match fused {
        Some((f, e)) => {
            let experts = spec.routed_experts as usize;
            open_fused(ckpt, &f, e, [experts, inter, hidden])?
        }
        None => {
            let [gate, up, down] = names;
            [
                RowSource::open(ckpt, &gate, [inter, hidden])?,
                RowSource::open(ckpt, &up, [inter, hidden])?,
                RowSource::open(ckpt, &down, [hidden, inter])?,
            ]
        }
    };
    Ok((OpenedExpert::Float(srcs), inter))
}

/// What [`read_expert`] refuses before it reads a weight, checked without reading one: the
/// converter runs this over every expert before it writes anything, so a checkpoint missing an
/// expert of its last layer, or holding one in another shape or dtype, fails in seconds naming
/// it rather than after every layer before it was converted. Weight values (NaN, infinity) are
/// checked only when read.
pub fn check_expert(
    ckpt: &Checkpoint,
    spec: &ModelSpec,
    family: Family,
    layer: u32,
    which: ExpertRef,
) -> Result<(), ExpertError> {
    open_expert(ckpt, spec, family, layer, which).map(drop)
}

/// Reads one expert of `layer` from `ckpt`, checks it against `spec` ([`check_expert`]), and
/// quantizes it with the searched quantizer into `spec.quant`, row by row. Returns the packed
/// expert and its relative error `‖x − deq(x)‖₂ / ‖x‖₂` over both matrices (measured as the
/// codes are written, [`SquaredError`]).
///
/// When the expert is stored `pack-quantized` INT4, or GPTQ / AWQ INT4, its codes (zero points)
/// and scales are imported exactly instead ([`crate::packed_import`], [`crate::gptq_import`]; the
/// model's spec must then be the one [`source_quant`] returns) and the error, measured against
/// the source read a second time, is 0.
pub fn read_expert(
    ckpt: &Checkpoint,
    spec: &ModelSpec,
    family: Family,
    layer: u32,
    which: ExpertRef,
) -> Result<(ExpertWeights, f64), ExpertError> {
    let hidden = spec.hidden as usize;
    let quant = spec.quant;
    let (opened, inter) = open_expert(ckpt, spec, family, layer, which)?;
    let [gate, up, down] = match opened {
        OpenedExpert::Packed(srcs) => {
            let [g, u, d] = &*srcs;
            return assemble_int4_expert(quant, inter, hidden, [g, u, d]);
        }
        OpenedExpert::Gptq([g, u, d]) => {
            return assemble_int4_expert(quant, inter, hidden, [&g, &u, &d]);
        }
        OpenedExpert::Float(srcs) => srcs,
    };
    let w13_row = |r: usize, out: &mut [f32]| match w13_row_meaning(r) {
        (GateUp::Gate, f) => gate.fill(f, out),
        (GateUp::Up, f) => up.fill(f, out),
    };
    let w2_row = |n: usize, out: &mut [f32]| down.fill(n, out);
    let (w13, mut lost) = quantize_streamed("W13", &gate.name, 2 * inter, hidden, quant, w13_row)?;
    let (w2, lost2) = quantize_streamed("W2", &down.name, hidden, inter, quant, w2_row)?;
    lost.add(&lost2);
    let error = lost.relative();
    let weights = ExpertWeights::new(w13, w2).map_err(|source| ExpertError::Quantize {
        what: "W13/W2",
        tensor: down.name.clone(),
        source,
    })?;
    Ok((weights, error))
}

/// The [`QuantSpec`] under which `ckpt`'s experts import losslessly, read off routed expert 0 of
/// every MoE layer: `spec.quant` unchanged for float and FP8 sources (they are quantized
/// anyway); for compressed-tensors `pack-quantized` its group size (columns / `weight_scale`
/// columns) and scale dtype, without zero points; for GPTQ / AWQ what [`gptq_source_quant`]
/// says. Layers stored in float or FP8 beside quantized ones are quantized to the quantized
/// ones' spec; quantized layers of different settings are refused here, before anything is
/// written, naming both. The converter sets the model's quant to this before reading experts.
pub fn source_quant(
    ckpt: &Checkpoint,
    spec: &ModelSpec,
    family: Family,
) -> Result<QuantSpec, ExpertError> {
    crate::gptq_import::check_quant_method(ckpt.dir())?;
    let layers = spec.moe_layer_ids();
    if layers.is_empty() {
        return Err(ExpertError::NoSuchExpert {
            layer: 0,
            which: ExpertRef::Routed(0),
            reason: format!("{} has no MoE layer", spec.name),
        });
    }
    let mut found: Option<(u32, QuantSpec)> = None;
    for layer in layers {
        let quant = match layer_source(ckpt, spec, family, layer)? {
            LayerSource::Quantized(quant) => quant,
            LayerSource::Fp8 | LayerSource::Float => continue,
        };
        match found {
            None => found = Some((layer, quant)),
            Some((first, q)) if q != quant => {
                let names = expert_tensor_names(family, layer, ExpertRef::Routed(0))?;
                return Err(ExpertError::Packed {
                    tensor: names[0].clone(),
                    reason: format!(
                        "layer {layer}'s experts are stored as {quant:?}, layer {first}'s as \
                         {q:?}: this checkpoint mixes quantization settings, which cannot be \
                         imported losslessly into one format; convert from the model's BF16 \
                         checkpoint"
                    ),
                });
            }
            Some(_) => {}
        }
    }
    Ok(found.map_or(spec.quant, |(_, q)| q))
}

/// How routed expert 0 of a layer is stored ([`layer_source`]).
enum LayerSource {
    /// Quantized: the spec it imports losslessly under.
    Quantized(QuantSpec),
    /// FP8 with its scales (quantized like float; the scales' layout checked).
    Fp8,
    /// Plain floats.
    Float,
}

/// How routed expert 0 of `layer` is stored (see [`source_quant`]; FP8's scales found and the
/// configured block read, so a malformed one is refused before anything is written).
fn layer_source(
    ckpt: &Checkpoint,
    spec: &ModelSpec,
    family: Family,
    layer: u32,
) -> Result<LayerSource, ExpertError> {
    let which = ExpertRef::Routed(0);
    let inter = expert_inter(spec, family, layer, which)?;
    let hidden = spec.hidden as usize;
    let names = expert_tensor_names(family, layer, which)?;
    if let Some(quant) = packed_source_quant(ckpt, &names, inter, hidden)? {
        return Ok(LayerSource::Quantized(quant));
    }
    if let Some(quant) = gptq_source_quant(ckpt, &names, inter, hidden)? {
        return Ok(LayerSource::Quantized(quant));
    }
    if ckpt
        .tensor_info(&names[0])
        .is_ok_and(|i| i.dtype == Dtype::F8E4M3)
    {
        for name in &names {
            let shape = ckpt.tensor_info(name)?.shape.clone();
            if let [rows, cols] = shape[..] {
                Fp8Scales::of(ckpt, name, [rows, cols])?;
            }
        }
        return Ok(LayerSource::Fp8);
    }
    Ok(LayerSource::Float)
}

/// Where an FP8 weight keeps its scales, and the block of weights each scale covers.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Fp8Scales {
    /// The scale tensor: `{weight}_scale_inv` or `{weight}_scale`.
    name: String,
    /// Rows and columns of weights per scale.
    block: [usize; 2],
}

impl Fp8Scales {
    /// The scales of FP8 weight `name` (`[rows, cols]`): `…_scale_inv` blocks of the
    /// configured `weight_block_size` (128 × 128 by default), else compressed-tensors'
    /// `…_scale`, per tensor (`[1]`), per output channel (`[rows, 1]`), per group of inputs
    /// (`[rows, cols / group]`) or per configured block.
    fn of(ckpt: &Checkpoint, name: &str, [rows, cols]: [usize; 2]) -> Result<Self, ExpertError> {
        let zero_points = format!("{name}_zero_point");
        if ckpt.contains(&zero_points) {
            return Err(ExpertError::Packed {
                tensor: zero_points,
                reason: "asymmetric FP8 (a zero point beside the scale) is not read: convert \
                         from the model's BF16 checkpoint"
                    .into(),
            });
        }
        let configured = crate::gptq_import::quant_config_of(ckpt)?.fp8_block()?;
        let inv = format!("{name}_scale_inv");
        if ckpt.contains(&inv) {
            let block = configured.unwrap_or([FP8_BLOCK; 2]);
            return Ok(Self { name: inv, block });
        }
        let plain = format!("{name}_scale");
        if !ckpt.contains(&plain) {
            return Err(ExpertError::Packed {
                tensor: name.to_string(),
                reason: format!(
                    "an F8_E4M3 weight without its scales: neither \"{inv}\" nor \"{plain}\" \
                     is in the checkpoint (it is incomplete: download it again)"
                ),
            });
        }
        let block = match ckpt.tensor_info(&plain)?.shape[..] {
            [] | [1] | [1, 1] => [rows, cols],
            [r, 1] if r == rows => [1, cols],
            // compressed-tensors' strategy `group`: a scale per `cols / g` inputs of each row.
            [r, g] if r == rows && configured.is_none() && g > 0 && cols % g == 0 => [1, cols / g],
            _ => configured.unwrap_or([FP8_BLOCK; 2]),
        };
        Ok(Self { name: plain, block })
    }

    /// The grid's shape for a `[rows, cols]` weight.
    fn grid(&self, [rows, cols]: [usize; 2]) -> [usize; 2] {
        [rows.div_ceil(self.block[0]), cols.div_ceil(self.block[1])]
    }
}

/// The spec of a `pack-quantized` expert (`None` when its gate is not stored so): group size and
/// scale dtype from each projection's `weight_scale`, zero points where it has
/// `weight_zero_point`; the three must agree and be representable.
fn packed_source_quant(
    ckpt: &Checkpoint,
    names: &[String; 3],
    inter: usize,
    hidden: usize,
) -> Result<Option<QuantSpec>, ExpertError> {
    if packed_base(ckpt, &names[0]).is_none() {
        return Ok(None);
    }
    let shapes = [[inter, hidden], [inter, hidden], [hidden, inter]];
    let mut found: Option<(QuantSpec, String)> = None;
    for (name, [rows, cols]) in names.iter().zip(shapes) {
        let Some(base) = packed_base(ckpt, name) else {
            return Err(ExpertError::Packed {
                tensor: name.clone(),
                reason: "only some of this expert's projections are stored pack-quantized; \
                         gate, up and down must share one format"
                    .into(),
            });
        };
        let scale_name = format!("{base}.weight_scale");
        let quant = QuantSpec {
            // Asymmetric groups store zero points (`packed_import`'s module docs).
            zero_points: ckpt.contains(&format!("{base}.weight_zero_point")),
            ..packed_scale_quant(ckpt, &scale_name, [rows, cols])?
        };
        match &found {
            Some((first, first_name)) if *first != quant => {
                return Err(ExpertError::Packed {
                    tensor: scale_name,
                    reason: format!(
                        "gives {quant} but \"{first_name}\" gives {first}; one expert's \
                         projections must share one quantization"
                    ),
                });
            }
            Some(_) => {}
            None => found = Some((quant, scale_name)),
        }
    }
    Ok(found.map(|(quant, _)| quant))
}

/// The spec a `pack-quantized` `weight_scale` tensor (`name`, of a weight `[rows, cols]`) implies.
fn packed_scale_quant(
    ckpt: &Checkpoint,
    name: &str,
    [rows, cols]: [usize; 2],
) -> Result<QuantSpec, ExpertError> {
    let fail = |reason: String| ExpertError::Packed {
        tensor: name.to_string(),
        reason,
    };
    let view = ckpt.tensor(name)?;
    let scale_dtype = match view.dtype() {
        Dtype::BF16 => ScaleDtype::Bf16,
        Dtype::F16 => ScaleDtype::F16,
        d => return Err(fail(format!("dtype {d} (scales must be BF16 or F16)"))),
    };
    let shape = view.shape();
    if shape.len() != 2 || shape[0] != rows || shape[1] == 0 || cols % shape[1] != 0 {
        return Err(fail(format!(
            "shape {shape:?} does not split the {cols} columns into equal groups (expected \
             [{rows}, {cols}/group]); the checkpoint does not match its config.json"
        )));
    }
    let group = cols / shape[1];
    let quant = QuantSpec {
        group_size: group as u32,
        scale_dtype,
        zero_points: false,
    };
    if quant.validate().is_err() {
        return Err(fail(format!(
            "groups of {group} columns cannot be stored losslessly: the packed format's groups \
             are 32, 64 or 128; use a checkpoint quantized with one of those or a float one"
        )));
    }
    Ok(quant)
}

/// The intermediate size of the expert, after checking that `layer` is an MoE layer of `spec`
/// and that the expert exists.
fn expert_inter(
    spec: &ModelSpec,
    family: Family,
    layer: u32,
    which: ExpertRef,
) -> Result<usize, ExpertError> {
    let fail = |reason: String| ExpertError::NoSuchExpert {
        layer,
        which,
        reason,
    };
    if !spec.moe_layer_ids().contains(&layer) {
        return Err(fail(format!(
            "layer {layer} is not an MoE layer of {} ({} layers, dense prefix {}, step {})",
            spec.name, spec.num_layers, spec.first_dense_layers, spec.moe_layer_step
        )));
    }
    match which {
        ExpertRef::Routed(e) if e >= spec.routed_experts => Err(fail(format!(
            "{} has {} routed experts per layer",
            spec.name, spec.routed_experts
        ))),
        ExpertRef::Routed(_) => Ok(spec.moe_intermediate as usize),
        ExpertRef::Shared if spec.shared_experts == 0 || !family.has_shared_expert() => {
            Err(fail(format!("{} has no shared expert", spec.name)))
        }
        ExpertRef::Shared => Ok(spec.shared_intermediate as usize),
    }
}

/// [`quantize_rows_measured`] over a fallible row source: the first error stops reading (later
/// rows are zeros) and is returned instead of the matrix and its error.
fn quantize_streamed(
    what: &'static str,
    tensor: &str,
    rows: usize,
    cols: usize,
    quant: QuantSpec,
    fill: impl Fn(usize, &mut [f32]) -> Result<(), ExpertError>,
) -> Result<(PackedMatrix, SquaredError), ExpertError> {
    let mut failed = None;
    let packed = quantize_rows_measured(rows, cols, quant, |n, out| {
        if failed.is_none()
            && let Err(e) = fill(n, out)
        {
            failed = Some(e);
        }
        if failed.is_some() {
            out.fill(0.0);
        }
    });
    if let Some(e) = failed {
        return Err(e);
    }
    packed.map_err(|source| ExpertError::Quantize {
        what,
        tensor: tensor.to_string(),
        source,
    })
}

/// One source weight tensor, read a row at a time as f32 (FP8 scaled by its block grid).
struct RowSource<'a> {
    name: String,
    view: TensorView<'a>,
    /// The view's row that is this matrix's row 0 (a fused tensor's up rows follow its gate
    /// rows).
    row0: usize,
    /// FP8 only: the scale grid, row-major, its column count and the block each scale covers.
    scales: Option<(Vec<f32>, usize, [usize; 2])>,
}

impl<'a> RowSource<'a> {
    /// Opens `name`, checking its shape is `[rows, cols]` and its dtype readable; for FP8 also
    /// loads and checks its scale grid ([`Fp8Scales`]).
    fn open(ckpt: &'a Checkpoint, name: &str, shape: [usize; 2]) -> Result<Self, ExpertError> {
        let view = ckpt.tensor(name)?;
        // The dtype first: a weight of a layout not read (packed bytes, another quantizer's
        // integers) has another shape too, and is named for its dtype, not as a mismatch with
        // config.json.
        let fp8 = match view.dtype() {
            Dtype::BF16 | Dtype::F16 | Dtype::F32 => false,
            Dtype::F8E4M3 => true,
            dtype => {
                return Err(ExpertError::Dtype {
                    tensor: name.to_string(),
                    dtype,
                });
            }
        };
        check_shape(name, view.shape(), &shape)?;
        let scales = if fp8 {
            Some(load_scales(ckpt, name, shape)?)
        } else {
            None
        };
        Ok(RowSource {
            name: name.to_string(),
            view,
            row0: 0,
            scales,
        })
    }

    /// Writes row `r` as f32 into `out` (which holds one row), rejecting NaN and infinity.
    fn fill(&self, r: usize, out: &mut [f32]) -> Result<(), ExpertError> {
        let at = self.row0 + r;
        self.view.rows(at..at + 1)?.to_f32_into(out)?;
        if let Some((grid, grid_cols, [block_rows, block_cols])) = &self.scales {
            let row = &grid[(r / block_rows) * grid_cols..][..*grid_cols];
            for (chunk, &scale) in out.chunks_mut(*block_cols).zip(row) {
                chunk.iter_mut().for_each(|v| *v *= scale);
            }
        }
        match out.iter().position(|v| !v.is_finite()) {
            None => Ok(()),
            Some(col) => Err(ExpertError::NonFinite {
                tensor: self.name.clone(),
                row: at,
                col,
                value: out[col],
            }),
        }
    }
}

/// The scale grid of FP8 weight `name` (shape `[rows, cols]`, [`Fp8Scales`]) as f32, with its
/// column count and the block each scale covers.
fn load_scales(
    ckpt: &Checkpoint,
    name: &str,
    shape: [usize; 2],
) -> Result<(Vec<f32>, usize, [usize; 2]), ExpertError> {
    let at = Fp8Scales::of(ckpt, name, shape)?;
    let view = ckpt.tensor(&at.name)?;
    let expected = at.grid(shape);
    // A per-tensor scale is written `[1]` (compressed-tensors) as often as `[1, 1]`.
    let one_scale = expected == [1, 1] && matches!(view.shape(), [] | [1]);
    if !one_scale {
        check_shape(&at.name, view.shape(), &expected)?;
    }
    let scale_name = at.name;
    if !view.dtype().converts_to_f32() {
        return Err(ExpertError::Packed {
            tensor: scale_name,
            reason: format!(
                "dtype {}: an FP8 scale grid must be F32, BF16 or F16",
                view.dtype()
            ),
        });
    }
    let scales = view.to_f32_vec()?;
    // A scale of zero or below turns its block into zeros or flips it: no real checkpoint
    // stores one, so the file is damaged.
    if let Some(i) = scales.iter().position(|s| !(*s > 0.0 && s.is_finite())) {
        return Err(ExpertError::Packed {
            tensor: scale_name,
            reason: format!(
                "block ({}, {}) has scale {}; FP8 scales are positive and finite: the \
                 checkpoint is damaged, download it again",
                i / expected[1],
                i % expected[1],
                scales[i]
            ),
        });
    }
    Ok((scales, expected[1], at.block))
}

/// An error naming `tensor` unless `actual == expected`.
pub(crate) fn check_shape(
    tensor: &str,
    actual: &[usize],
    expected: &[usize],
) -> Result<(), ExpertError> {
    if actual == expected {
        Ok(())
    } else {
        Err(ExpertError::Shape {
            tensor: tensor.to_string(),
            expected: expected.to_vec(),
            actual: actual.to_vec(),
        })
    }
}
