//! Lossless import of GPTQ (AutoGPTQ / GPTQModel) and AWQ (AutoAWQ GEMM) INT4 experts into
//! packed INT4 [`ExpertWeights`](expertmesh_quant::format::ExpertWeights), without
//! requantization.
//!
//! Why this exists: most published INT4 MoE checkpoints are GPTQ or AWQ. Their 4-bit codes,
//! per-group zero points and f16 scales map one to one onto the serving format (groups along
//! the input dimension, `value = scale × (code − zero)`); only the bit packing differs. Running
//! them through the quantizer again (dequantize + requantize) would lose accuracy, so this
//! module copies every code, zero point and scale bit instead and refuses, naming the tensor,
//! whatever the packed format cannot hold exactly.
//!
//! For a `Linear` `X` with weight `[out, in]` the checkpoint holds, instead of `X.weight`:
//!
//! * **GPTQ**: `X.qweight` I32 `[in/8, out]`, packed along the input dimension (word `(w, o)`
//!   holds input rows `8w..8w+8`, row `8w + i` in bits `4i..4i+4`); `X.qzeros` I32
//!   `[in/group, out/8]`, packed along the output dimension (word `(g, w)` holds the zero point
//!   of output `8w + i` in bits `4i`); `X.scales` F16 `[in/group, out]`; optionally `X.g_idx`
//!   I32 `[in]`, the group of each input row. `checkpoint_format` `"gptq"` (v1, the default)
//!   stores `zero − 1`, `"gptq_v2"` stores the zero point itself.
//! * **AWQ** (GEMM): `X.qweight` I32 `[in, out/8]`, packed along the output dimension in
//!   AutoAWQ's interleave (bits `4i..4i+4` of word `(k, w)` hold output `8w + AWQ_ORDER[i]`);
//!   `X.qzeros` I32 `[in/group, out/8]` packed the same way; `X.scales` F16 `[in/group, out]`.
//!
//! The layout comes from `quantization_config` in the folder's `config.json` (or AutoGPTQ's
//! `quantize_config.json`): `quant_method`, `checkpoint_format`, `sym`, `bits`, AutoAWQ's
//! `version`. Without one, the `qweight` shape decides (`[in/8, out]` is GPTQ v1, `[in, out/8]`
//! is AWQ). The group size (input rows / scale rows) must be 32, 64 or 128 and equal the model's
//! [`QuantSpec::group_size`]; the scale dtype must equal the model's (bf16 scales, which some
//! exporters write, are accepted the same way); zero points are stored when the model's spec
//! has them, and otherwise every zero point must be 8. Act-order (`desc_act`) checkpoints, whose
//! `g_idx` is not `k / group`, are refused: the packed format's groups are contiguous.
//! [`gptq_source_quant`] says which spec makes a checkpoint's import lossless.

use std::path::{Path, PathBuf};

use expertmesh_quant::format::{PackedMatrix, QuantSpec, ScaleDtype};
use serde_json::{Map, Value};

use crate::experts::{ExpertError, check_shape};
use crate::hf_config::{CONFIG_FILE, MAX_CONFIG_BYTES};
use crate::packed_import::{CODES_PER_WORD, Int4Rows};
use crate::safetensors::{Checkpoint, Dtype, TensorView};

/// AutoAWQ's nibble order: bits `4i..4i+4` of a word hold output `8w + AWQ_ORDER[i]`.
pub const AWQ_ORDER: [usize; 8] = [0, 2, 4, 6, 1, 3, 5, 7];

/// The inverse of [`AWQ_ORDER`]: output `8w + j` lives in nibble `AWQ_NIBBLE[j]`.
const AWQ_NIBBLE: [usize; 8] = [0, 4, 1, 5, 2, 6, 3, 7];

/// AutoGPTQ's separate quantization config, read when `config.json` has none.
pub const GPTQ_CONFIG_FILE: &str = "quantize_config.json";

/// How one `X.qweight` projection is laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Int4Layout {
    /// GPTQ, `checkpoint_format` `"gptq"`: zero points stored minus one.
    GptqV1,
    /// GPTQ, `checkpoint_format` `"gptq_v2"`: zero points stored as they are.
    GptqV2,
    /// AutoAWQ GEMM: packed along the output dimension in [`AWQ_ORDER`].
    Awq,
}

impl std::fmt::Display for Int4Layout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Int4Layout::GptqV1 => "GPTQ (checkpoint_format gptq)",
            Int4Layout::GptqV2 => "GPTQ (checkpoint_format gptq_v2)",
            Int4Layout::Awq => "AWQ (GEMM)",
        })
    }
}

/// The parts of a checkpoint's `quantization_config` this import reads (absent keys are `None`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct QuantConfig {
    /// The file it came from (`None` when the folder has no quantization config).
    pub path: Option<PathBuf>,
    /// `quant_method`, lowercased (`"gptq"`, `"awq"`, ...).
    pub method: Option<String>,
    /// GPTQ's `checkpoint_format`, lowercased (`"gptq"`, `"gptq_v2"`, ...).
    pub checkpoint_format: Option<String>,
    /// `sym`: symmetric quantization (every zero point 8).
    pub sym: Option<bool>,
    /// `bits` (AutoAWQ: `w_bit`).
    pub bits: Option<u64>,
    /// AutoAWQ's kernel layout `version`, lowercased (`"gemm"`, `"gemv"`, ...).
    pub version: Option<String>,
    /// FP8 checkpoints' block (`[rows, cols]` of weights sharing one scale): transformers'
    /// `weight_block_size`, else compressed-tensors' `block_structure` of its config groups;
    /// `None` when neither names one, `Err` (what was written) when it is not two whole
    /// numbers from 1 to 2^20 or the groups name different blocks. See
    /// [`QuantConfig::fp8_block`].
    pub weight_block: Option<Result<[usize; 2], String>>,
}

/// Reads the quantization config of checkpoint folder `dir`: `quantization_config` of
/// `config.json`, else the whole of `quantize_config.json`; the default when neither exists.
pub fn read_quant_config(dir: &Path) -> Result<QuantConfig, ExpertError> {
    let config_path = dir.join(CONFIG_FILE);
    if config_path.is_file() {
        let config = read_json(&config_path)?;
        if let Some(q) = config.get("quantization_config") {
            let Value::Object(q) = q else {
                return Err(config_error(
                    &config_path,
                    "quantization_config is not an object",
                ));
            };
            return Ok(quant_config(config_path, q));
        }
    }
    let gptq_path = dir.join(GPTQ_CONFIG_FILE);
    if gptq_path.is_file() {
        let q = read_json(&gptq_path)?;
        return Ok(quant_config(gptq_path, &q));
    }
    Ok(QuantConfig::default())
}

/// [`read_quant_config`] of `ckpt`'s folder, read once per opened checkpoint (a failed read is
/// not kept: it is tried again, and fails again, naming the file).
pub fn quant_config_of(ckpt: &Checkpoint) -> Result<&QuantConfig, ExpertError> {
    if let Some(q) = ckpt.quant_config.get() {
        return Ok(q);
    }
    let q = read_quant_config(ckpt.dir())?;
    Ok(ckpt.quant_config.get_or_init(|| q))
}

/// The `quant_method`s whose checkpoints the converter reads (FP8 with its scales, GPTQ,
/// AWQ, compressed-tensors' `pack-quantized`; unquantized checkpoints name none).
const READ_METHODS: [&str; 5] = [
    "fp8",
    "gptq",
    "awq",
    "compressed-tensors",
    "compressed_tensors",
];

/// Refuses, naming it, a checkpoint in `dir` quantized by a method the converter does not read
/// (bitsandbytes, NVIDIA modelopt's FP4, MLX, HQQ, ...): its expert tensors have other dtypes
/// and shapes, and without this check the first one fails as "the checkpoint does not match
/// its config.json".
pub fn check_quant_method(dir: &Path) -> Result<(), ExpertError> {
    let q = read_quant_config(dir)?;
    let path = q.path.as_deref().unwrap_or(dir);
    if let Some(m) = q.method.as_deref().filter(|m| !READ_METHODS.contains(m)) {
        return Err(config_error(
            path,
            &format!(
                "quant_method \"{m}\" is not a format expertmesh convert reads (it reads \
                 bf16/fp16/fp32, fp8 with its scales, gptq, awq and compressed-tensors \
                 pack-quantized or float-quantized); convert from the model's BF16 checkpoint"
            ),
        ));
    }
    let config_path = dir.join(CONFIG_FILE);
    if q.path.is_none() && config_path.is_file() {
        let config = read_json(&config_path)?;
        if config.get("quantization").is_some_and(Value::is_object) {
            return Err(config_error(
                &config_path,
                "\"quantization\" says an MLX-quantized checkpoint, which expertmesh convert \
                 does not read; convert from the model's BF16 checkpoint",
            ));
        }
    }
    Ok(())
}

/// The fields of a quantization config object `q` read from `path`.
fn quant_config(path: PathBuf, q: &Map<String, Value>) -> QuantConfig {
    let text = |key: &str| {
        q.get(key)
            .and_then(Value::as_str)
            .map(str::to_ascii_lowercase)
    };
    QuantConfig {
        method: text("quant_method"),
        checkpoint_format: text("checkpoint_format"),
        sym: q.get("sym").and_then(Value::as_bool),
        bits: q
            .get("bits")
            .or_else(|| q.get("w_bit"))
            .and_then(Value::as_u64),
        version: text("version"),
        weight_block: fp8_block_of(q),
        path: Some(path),
    }
}

/// The FP8 block a quantization config names ([`QuantConfig::weight_block`]): `weight_block_size`,
/// else the `block_structure` of its `config_groups` (null counts as absent; the groups must
/// agree: the converter reads one block size per checkpoint).
fn fp8_block_of(q: &Map<String, Value>) -> Option<Result<[usize; 2], String>> {
    if let Some(v) = q.get("weight_block_size").filter(|v| !v.is_null()) {
        return Some(block_value(v).ok_or_else(|| format!("weight_block_size {v}")));
    }
    let mut found: Vec<(&String, &Value)> = Vec::new();
    for (name, group) in q.get("config_groups")?.as_object()? {
        if let Some(b) = group
            .get("weights")
            .and_then(|w| w.get("block_structure"))
            .filter(|b| !b.is_null())
        {
            found.push((name, b));
        }
    }
    found.first()?;
    let blocks: Vec<Option<[usize; 2]>> = found.iter().map(|(_, b)| block_value(b)).collect();
    if blocks.iter().all(|b| b.is_some() && *b == blocks[0]) {
        return blocks[0].map(Ok);
    }
    let named: Vec<String> = found.iter().map(|(g, b)| format!("{g}: {b}")).collect();
    Some(Err(
        if found.len() > 1 && blocks.iter().all(Option::is_some) {
            format!(
                "config_groups name different FP8 blocks ({}), and one block size per checkpoint \
             is read",
                named.join(", ")
            )
        } else {
            format!("block_structure of {}", named.join(", "))
        },
    ))
}

/// `[rows, cols]` from a block as configs write it: a list of two whole numbers (`128` or
/// `128.0`), or a string `"128x128"` (older compressed-tensors); each from 1 to 2^20.
fn block_value(v: &Value) -> Option<[usize; 2]> {
    let whole = |n: &Value| {
        n.as_u64().or_else(|| {
            n.as_f64()
                .filter(|f| f.fract() == 0.0 && *f >= 1.0)
                .map(|f| f as u64)
        })
    };
    let parts: Vec<u64> = match v {
        Value::Array(a) => a.iter().map(whole).collect::<Option<_>>()?,
        Value::String(t) => t
            .split(['x', 'X', ','])
            .map(|n| n.trim().parse().ok())
            .collect::<Option<_>>()?,
        _ => return None,
    };
    let fits = |n: u64| (1..=1 << 20).contains(&n);
    match parts[..] {
        [r, c] if fits(r) && fits(c) => Some([r as usize, c as usize]),
        _ => None,
    }
}

/// `path` as a JSON object, bounded by [`MAX_CONFIG_BYTES`].
fn read_json(path: &Path) -> Result<Map<String, Value>, ExpertError> {
    let bytes = match crate::hf_config::read_bounded(path) {
        Ok(bytes) => bytes,
        Err(e) => return Err(config_error(path, &format!("cannot read it ({e})"))),
    };
    if bytes.len() as u64 > MAX_CONFIG_BYTES {
        return Err(config_error(path, "larger than a config file can be"));
    }
    match serde_json::from_slice::<Value>(&bytes) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(config_error(path, "the top level is not a JSON object")),
        Err(e) => Err(config_error(path, &format!("not JSON ({e})"))),
    }
}

fn config_error(path: &Path, reason: &str) -> ExpertError {
    ExpertError::Config {
        path: path.to_path_buf(),
        reason: reason.to_string(),
    }
}

impl QuantConfig {
    /// The FP8 block (`[rows, cols]` of weights per scale) the config names, if any; an error
    /// naming the file for one that is not two whole numbers from 1 to 2^20.
    pub fn fp8_block(&self) -> Result<Option<[usize; 2]>, ExpertError> {
        match &self.weight_block {
            None => Ok(None),
            Some(Ok(b)) => Ok(Some(*b)),
            Some(Err(written)) => Err(self.error(format!(
                "quantization_config: {written}: an FP8 block is two whole numbers of rows and \
                 columns, 1 to 1048576, one for the whole checkpoint"
            ))),
        }
    }

    /// An error about this config (naming its file).
    fn error(&self, reason: String) -> ExpertError {
        ExpertError::Config {
            path: self
                .path
                .clone()
                .unwrap_or_else(|| PathBuf::from(CONFIG_FILE)),
            reason,
        }
    }

    /// The layout every `qweight` of the checkpoint has, or `None` when the config does not say
    /// (the shape decides); an error for a config this import cannot read exactly.
    fn layout(&self) -> Result<Option<Int4Layout>, ExpertError> {
        if let Some(bits) = self.bits.filter(|&b| b != 4) {
            return Err(self.error(format!(
                "quantization_config has bits {bits}; only 4-bit GPTQ/AWQ imports losslessly \
                 into packed INT4: use a 4-bit or a float checkpoint"
            )));
        }
        match self.method.as_deref() {
            None => Ok(None),
            Some("gptq") => self.gptq_version().map(Some),
            Some("awq") => match self.version.as_deref() {
                None | Some("gemm") => Ok(Some(Int4Layout::Awq)),
                Some(v) => Err(self.error(format!(
                    "AutoAWQ version \"{v}\" packs its weights differently; only the GEMM \
                     layout is imported: re-export the checkpoint with version \"gemm\""
                ))),
            },
            Some(m) => Err(self.error(format!(
                "quant_method \"{m}\" but the checkpoint stores GPTQ/AWQ-style qweight tensors; \
                 only quant_method \"gptq\" and \"awq\" are read this way"
            ))),
        }
    }

    /// GPTQ v1 or v2, from `checkpoint_format` (v1 when absent).
    fn gptq_version(&self) -> Result<Int4Layout, ExpertError> {
        match self.checkpoint_format.as_deref() {
            None | Some("gptq") => Ok(Int4Layout::GptqV1),
            Some("gptq_v2") => Ok(Int4Layout::GptqV2),
            Some(f) => Err(self.error(format!(
                "GPTQ checkpoint_format \"{f}\" is a kernel-specific repacking; only \"gptq\" \
                 and \"gptq_v2\" are imported: use the plain GPTQ export of the model"
            ))),
        }
    }
}

/// The name prefix `X` of weight tensor `X.weight`, when `X.qweight` is in `ckpt` and
/// `X.weight` is not: the tensor is stored GPTQ or AWQ.
pub fn qweight_base(ckpt: &Checkpoint, weight_name: &str) -> Option<String> {
    let base = weight_name.strip_suffix(".weight")?;
    let stored = ckpt.contains(&format!("{base}.qweight")) && !ckpt.contains(weight_name);
    stored.then(|| base.to_string())
}

/// Opens a GPTQ or AWQ expert (read by [`crate::experts::read_expert`], which copies its codes,
/// zero points and scales with [`crate::packed_import::assemble_int4_expert`]): `names` are
/// its `[gate, up, down]` weight names (`….weight`), `inter`/`hidden` its sizes, `quant` the
/// model's spec (group size and scale dtype must be the checkpoint's; without zero points
/// every zero point must be 8).
/// Each projection is opened (shapes, dtypes, group size, `g_idx`, zero points) and checked
/// against `quant`; no code or scale is copied. `Ok(None)` when none of the three is stored as
/// `qweight`, an error when only some are (or they mix GPTQ and AWQ).
pub(crate) fn open_gptq_expert<'a>(
    ckpt: &'a Checkpoint,
    quant: QuantSpec,
    names: &[String; 3],
    inter: usize,
    hidden: usize,
) -> Result<Option<[Int4Source<'a>; 3]>, ExpertError> {
    let Some((_, srcs)) = open_expert(ckpt, names, inter, hidden)? else {
        return Ok(None);
    };
    for src in &srcs {
        src.check_against(quant)?;
    }
    Ok(Some(srcs))
}

/// The [`QuantSpec`] that imports this GPTQ/AWQ expert losslessly (`names`, `inter`, `hidden`
/// as for [`open_gptq_expert`]): the checkpoint's group size and scale dtype, and zero points
/// unless the checkpoint is symmetric (AWQ always has them; GPTQ does unless `sym` is true, or
/// is absent and every zero point of this expert is 8). `Ok(None)` when the expert is not
/// stored as `qweight`.
pub fn gptq_source_quant(
    ckpt: &Checkpoint,
    names: &[String; 3],
    inter: usize,
    hidden: usize,
) -> Result<Option<QuantSpec>, ExpertError> {
    let Some((config, srcs)) = open_expert(ckpt, names, inter, hidden)? else {
        return Ok(None);
    };
    let [first, ..] = &srcs;
    for src in &srcs[1..] {
        if src.group != first.group || src.scale_dtype != first.scale_dtype {
            return Err(ExpertError::Packed {
                tensor: format!("{}.scales", src.base),
                reason: format!(
                    "groups of {} with {} scales, but \"{}.scales\" has groups of {} with {} \
                     scales; one expert's projections must share one quantization",
                    src.group, src.scale_dtype, first.base, first.group, first.scale_dtype
                ),
            });
        }
    }
    let all_eight = srcs.iter().all(|s| s.all_eight);
    let zero_points = match (first.layout, config.sym) {
        (Int4Layout::Awq, _) | (_, Some(false)) => true,
        _ => !all_eight,
    };
    Ok(Some(QuantSpec {
        group_size: first.group as u32,
        scale_dtype: first.scale_dtype,
        zero_points,
    }))
}

/// The config and the three opened projections of a `qweight` expert; `None` when none of
/// `names` is stored as `qweight`, an error when only some are or their layouts differ.
fn open_expert<'a>(
    ckpt: &'a Checkpoint,
    names: &[String; 3],
    inter: usize,
    hidden: usize,
) -> Result<Option<(&'a QuantConfig, [Int4Source<'a>; 3])>, ExpertError> {
    let bases = names.clone().map(|n| qweight_base(ckpt, &n));
    let [Some(gate), Some(up), Some(down)] = bases else {
        return match names.iter().zip(&bases).find(|(_, b)| b.is_some()) {
            None => Ok(None),
            Some((name, _)) => Err(ExpertError::Packed {
                tensor: name.clone(),
                reason: "only some of this expert's projections are stored GPTQ/AWQ (qweight); \
                         gate, up and down must share one format"
                    .into(),
            }),
        };
    };
    let config = quant_config_of(ckpt)?;
    let srcs = [
        Int4Source::open(ckpt, &gate, [inter, hidden], config)?,
        Int4Source::open(ckpt, &up, [inter, hidden], config)?,
        Int4Source::open(ckpt, &down, [hidden, inter], config)?,
    ];
    if let Some(other) = srcs.iter().find(|s| s.layout != srcs[0].layout) {
        return Err(ExpertError::Packed {
            tensor: format!("{}.qweight", other.base),
            reason: format!(
                "stored {} but \"{}.qweight\" is {}; gate, up and down must share one format",
                other.layout, srcs[0].base, srcs[0].layout
            ),
        });
    }
    Ok(Some((config, srcs)))
}

/// Word `i` of a little-endian 32-bit tensor.
fn word(bytes: &[u8], i: usize) -> u32 {
    u32::from_le_bytes([
        bytes[4 * i],
        bytes[4 * i + 1],
        bytes[4 * i + 2],
        bytes[4 * i + 3],
    ])
}

/// An error about tensor `tensor`.
fn packed_error(tensor: &str, reason: String) -> ExpertError {
    ExpertError::Packed {
        tensor: tensor.to_string(),
        reason,
    }
}

/// Checks that `view` holds 32-bit packed words.
fn check_words(name: &str, view: &TensorView<'_>) -> Result<(), ExpertError> {
    match view.dtype() {
        Dtype::I32 | Dtype::U32 => Ok(()),
        d => Err(packed_error(
            name,
            format!("dtype {d} (packed INT4 tensors must be I32)"),
        )),
    }
}

/// One GPTQ/AWQ projection (weight `[rows = out, cols = in]`), checked on opening: shapes,
/// dtypes, group size, `g_idx`, and that every zero point fits a u4.
pub(crate) struct Int4Source<'a> {
    /// The name prefix `X`.
    base: String,
    layout: Int4Layout,
    rows: usize,
    group: usize,
    qweight: &'a [u8],
    qzeros: &'a [u8],
    scales: &'a [u8],
    scale_dtype: ScaleDtype,
    /// Every zero point is 8.
    all_eight: bool,
}

impl<'a> Int4Source<'a> {
    /// Opens `X.qweight`, `X.scales`, `X.qzeros` (and `X.g_idx` when present) for `X = base`.
    fn open(
        ckpt: &'a Checkpoint,
        base: &str,
        [rows, cols]: [usize; 2],
        config: &QuantConfig,
    ) -> Result<Self, ExpertError> {
        let qweight_name = format!("{base}.qweight");
        let qweight = ckpt.tensor(&qweight_name)?;
        check_words(&qweight_name, &qweight)?;
        if rows % CODES_PER_WORD != 0 || cols % CODES_PER_WORD != 0 {
            let reason = format!(
                "the weight is [{rows}, {cols}]; GPTQ/AWQ packing needs both dimensions to be \
                 multiples of {CODES_PER_WORD}"
            );
            return Err(packed_error(&qweight_name, reason));
        }
        let layout = resolve_layout(config, &qweight_name, qweight.shape(), [rows, cols])?;
        let (scales, scale_dtype, group) = open_scales(ckpt, base, [rows, cols])?;
        let qzeros_name = format!("{base}.qzeros");
        let qzeros = ckpt.tensor(&qzeros_name)?;
        check_words(&qzeros_name, &qzeros)?;
        check_shape(
            &qzeros_name,
            qzeros.shape(),
            &[cols / group, rows / CODES_PER_WORD],
        )?;
        check_g_idx(ckpt, &format!("{base}.g_idx"), cols, group)?;
        let mut src = Int4Source {
            base: base.to_string(),
            layout,
            rows,
            group,
            qweight: qweight.bytes(),
            qzeros: qzeros.bytes(),
            scales: scales.bytes(),
            scale_dtype,
            all_eight: false,
        };
        src.all_eight = src.scan_zeros(cols / group)?;
        Ok(src)
    }

    /// Checks every stored zero point fits a u4 (GPTQ v1 stores `zero − 1`, so a stored 15 is
    /// zero point 16); returns whether every zero point is 8.
    fn scan_zeros(&self, groups: usize) -> Result<bool, ExpertError> {
        let mut all_eight = true;
        for g in 0..groups {
            for r in 0..self.rows {
                let stored = self.stored_zero(r, g);
                if self.layout == Int4Layout::GptqV1 && stored == 15 {
                    let reason = format!(
                        "the zero point of output {r} in group {g} is stored as 15, which under \
                         checkpoint_format \"gptq\" (zero − 1) means 16: a u4 zero point cannot \
                         hold it; re-quantize with checkpoint_format gptq_v2 (which stores zero \
                         points as they are) or use a float checkpoint"
                    );
                    return Err(packed_error(&format!("{}.qzeros", self.base), reason));
                }
                all_eight &= self.zero(r, g) == 8;
            }
        }
        Ok(all_eight)
    }

    /// Checks the checkpoint can be imported into the model's `quant` without loss.
    fn check_against(&self, quant: QuantSpec) -> Result<(), ExpertError> {
        let scales_name = format!("{}.scales", self.base);
        if self.group != quant.group() {
            let reason = format!(
                "the checkpoint's groups are {} input features but the model's quant spec \
                 ({quant}) uses {}; the import keeps the checkpoint's groups: set the model's \
                 group size to {} (source_quant gives the lossless spec)",
                self.group,
                quant.group(),
                self.group
            );
            return Err(packed_error(&scales_name, reason));
        }
        if self.scale_dtype != quant.scale_dtype {
            let reason = format!(
                "the checkpoint's scales are {} but the model's quant spec ({quant}) wants {} \
                 scales; the two are never converted into each other: set the model's scale \
                 dtype to {}",
                self.scale_dtype, quant.scale_dtype, self.scale_dtype
            );
            return Err(packed_error(&scales_name, reason));
        }
        if !quant.zero_points && !self.all_eight {
            // Where the spec came from the checkpoint itself (`gptq_source_quant`), this is a
            // GPTQ checkpoint whose config does not say `sym` and whose first routed expert is
            // symmetric: the config is what can say otherwise.
            let reason = format!(
                "the checkpoint has zero points other than 8 (asymmetric quantization) but the \
                 model's quant spec ({quant}) stores none: set its zero_points to true; where \
                 `expertmesh convert` chose that spec (a quantization config without `sym`, \
                 judged from routed expert 0 of the first MoE layer), add \"sym\": false to \
                 the quantization config (config.json's quantization_config, or \
                 quantize_config.json) and convert again"
            );
            return Err(packed_error(&format!("{}.qzeros", self.base), reason));
        }
        Ok(())
    }

    /// The nibble of a word packed along the output dimension that holds output `r`.
    fn out_nibble(&self, r: usize) -> usize {
        match self.layout {
            Int4Layout::Awq => AWQ_NIBBLE[r % CODES_PER_WORD],
            Int4Layout::GptqV1 | Int4Layout::GptqV2 => r % CODES_PER_WORD,
        }
    }

    /// The u4 code of output `r`, input `k`.
    fn code(&self, r: usize, k: usize) -> u8 {
        let (w, nibble) = match self.layout {
            Int4Layout::Awq => (
                k * (self.rows / CODES_PER_WORD) + r / CODES_PER_WORD,
                self.out_nibble(r),
            ),
            Int4Layout::GptqV1 | Int4Layout::GptqV2 => {
                ((k / CODES_PER_WORD) * self.rows + r, k % CODES_PER_WORD)
            }
        };
        ((word(self.qweight, w) >> (4 * nibble)) & 0xF) as u8
    }

    /// The nibble `X.qzeros` stores for output `r`, group `g`.
    fn stored_zero(&self, r: usize, g: usize) -> u8 {
        let w = g * (self.rows / CODES_PER_WORD) + r / CODES_PER_WORD;
        ((word(self.qzeros, w) >> (4 * self.out_nibble(r))) & 0xF) as u8
    }

    /// The zero point of output `r`, group `g` (checked to fit a u4 on opening).
    fn zero(&self, r: usize, g: usize) -> u8 {
        let stored = self.stored_zero(r, g);
        match self.layout {
            Int4Layout::GptqV1 => stored + 1,
            Int4Layout::GptqV2 | Int4Layout::Awq => stored,
        }
    }

    /// The scale bits of output `r`, group `g`.
    fn scale_bits(&self, r: usize, g: usize) -> u16 {
        let i = 2 * (g * self.rows + r);
        u16::from_le_bytes([self.scales[i], self.scales[i + 1]])
    }
}

impl Int4Rows for Int4Source<'_> {
    fn base(&self) -> &str {
        &self.base
    }

    /// Copies output `r` (codes, zero points, scale bits as they are) into row `n` of `dst`.
    fn copy_row(&self, r: usize, dst: &mut PackedMatrix, n: usize) {
        // The format places each code and zero (its nibble orders live in `set_code`/`set_zero`).
        for k in 0..dst.cols() {
            dst.set_code(n, k, self.code(r, k));
        }
        let groups = dst.groups_per_row();
        for g in 0..groups {
            dst.set_zero(n, g, self.zero(r, g));
        }
        let scales = &mut dst.scales_mut()[n * groups..][..groups];
        for (g, s) in scales.iter_mut().enumerate() {
            *s = self.scale_bits(r, g);
        }
    }

    /// Output `r` as the checkpoint defines it, `scale × (code − zero)` in f32 (exact),
    /// rejecting non-finite values (a NaN or infinite scale).
    fn fill(&self, r: usize, out: &mut [f32]) -> Result<(), ExpertError> {
        for (k, v) in out.iter_mut().enumerate() {
            let g = k / self.group;
            let scale = self.scale_dtype.to_f32(self.scale_bits(r, g));
            *v = scale * (i32::from(self.code(r, k)) - i32::from(self.zero(r, g))) as f32;
        }
        match out.iter().position(|v| !v.is_finite()) {
            None => Ok(()),
            Some(col) => Err(ExpertError::NonFinite {
                tensor: format!("{}.scales", self.base),
                row: r,
                col,
                value: out[col],
            }),
        }
    }
}

/// The layout of `X.qweight` (shape `shape`) for a weight `[rows, cols]`: the config's when it
/// names one (the shape must then match it), else the one the shape matches.
fn resolve_layout(
    config: &QuantConfig,
    name: &str,
    shape: &[usize],
    [rows, cols]: [usize; 2],
) -> Result<Int4Layout, ExpertError> {
    let gptq = [cols / CODES_PER_WORD, rows];
    let awq = [cols, rows / CODES_PER_WORD];
    if let Some(layout) = config.layout()? {
        let expected = if layout == Int4Layout::Awq { awq } else { gptq };
        check_shape(name, shape, &expected)?;
        return Ok(layout);
    }
    match (shape == gptq, shape == awq) {
        (true, false) => config.gptq_version(),
        (false, true) => Ok(Int4Layout::Awq),
        (true, true) => Err(packed_error(
            name,
            format!(
                "shape {shape:?} fits both GPTQ [in/8, out] and AWQ [in, out/8] and no \
                 quantization_config says which: add quant_method to config.json"
            ),
        )),
        (false, false) => Err(packed_error(
            name,
            format!(
                "shape {shape:?} is neither GPTQ's [in/8, out] = {gptq:?} nor AWQ's [in, out/8] \
                 = {awq:?} for a weight of [out, in] = [{rows}, {cols}]; the checkpoint does not \
                 match its config.json"
            ),
        )),
    }
}

/// Opens `X.scales` (F16 or BF16, `[cols/group, rows]`) and derives the group size, which must
/// be one the packed format has (32, 64, 128).
fn open_scales<'a>(
    ckpt: &'a Checkpoint,
    base: &str,
    [rows, cols]: [usize; 2],
) -> Result<(TensorView<'a>, ScaleDtype, usize), ExpertError> {
    let name = format!("{base}.scales");
    let scales = ckpt.tensor(&name)?;
    let scale_dtype = match scales.dtype() {
        Dtype::F16 => ScaleDtype::F16,
        Dtype::BF16 => ScaleDtype::Bf16,
        d => {
            return Err(packed_error(
                &name,
                format!("dtype {d} (scales must be F16 or BF16)"),
            ));
        }
    };
    let shape = scales.shape();
    if shape.len() != 2 || shape[1] != rows || shape[0] == 0 || cols % shape[0] != 0 {
        let reason = format!(
            "shape {shape:?} does not split the {cols} input features into equal groups \
             (expected [{cols}/group, {rows}]); the checkpoint does not match its config.json"
        );
        return Err(packed_error(&name, reason));
    }
    let group = cols / shape[0];
    if !matches!(group, 32 | 64 | 128) {
        let reason = format!(
            "groups of {group} input features cannot be stored losslessly: the packed format's \
             groups are 32, 64 or 128; re-quantize with group_size 32, 64 or 128, or use a float \
             checkpoint"
        );
        return Err(packed_error(&name, reason));
    }
    Ok((scales, scale_dtype, group))
}

/// Checks the group index tensor `name` (GPTQ's `X.g_idx`, compressed-tensors'
/// `X.weight_g_idx`), when present, is the trivial `k / group` of every input row `k`; any other
/// (act-order) grouping is refused.
pub(crate) fn check_g_idx(
    ckpt: &Checkpoint,
    name: &str,
    cols: usize,
    group: usize,
) -> Result<(), ExpertError> {
    let name = name.to_string();
    if !ckpt.contains(&name) {
        return Ok(());
    }
    let view = ckpt.tensor(&name)?;
    check_shape(&name, view.shape(), &[cols])?;
    let bytes = view.bytes();
    let at = |k: usize| -> Option<i64> {
        match view.dtype() {
            Dtype::I32 => Some(i64::from(word(bytes, k) as i32)),
            Dtype::I64 => Some(i64::from_le_bytes(bytes[8 * k..8 * k + 8].try_into().ok()?)),
            _ => None,
        }
    };
    for k in 0..cols {
        match at(k) {
            None => {
                let reason = format!("dtype {} (g_idx must be I32 or I64)", view.dtype());
                return Err(packed_error(&name, reason));
            }
            Some(g) if g == (k / group) as i64 => {}
            Some(g) => {
                let reason = format!(
                    "input row {k} is in group {g}, not {}: the checkpoint was quantized with \
                     act-order (GPTQ desc_act, compressed-tensors actorder), whose permuted \
                     groups the packed format cannot express; re-quantize without act-order or \
                     use a float checkpoint",
                    k / group
                );
                return Err(packed_error(&name, reason));
            }
        }
    }
    Ok(())
}
