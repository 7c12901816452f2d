//! Lossless import of compressed-tensors `pack-quantized` INT4 experts (Kimi K2-Thinking's
//! checkpoint format) into packed INT4 [`ExpertWeights`], without requantization.
//!
//! Why this exists: a checkpoint that already stores INT4 codes with per-group scales must not
//! go through the quantizer again (dequantize + requantize loses accuracy). Its codes and scale
//! bits map one to one onto the serving format; only the nibble order changes.
//!
//! For a `Linear` `X` with weight `[rows, cols]` the checkpoint holds, instead of `X.weight`:
//!
//! * `X.weight_packed`: I32 (or U32) `[rows, cols/8]`, eight 4-bit codes per word, least
//!   significant nibble first (column `8w + i` in bits `4i..4i+4` of word `w`); each code is
//!   offset-binary `q + 8`, so `value = (code − 8) × scale`.
//! * `X.weight_scale`: BF16 (or F16) `[rows, cols/group]`, `group` 32, 64 or 128.
//! * `X.weight_shape`: I32 or I64 `[2]` = `[rows, cols]`.
//! * Asymmetric (`symmetric: false`) groups also have `X.weight_zero_point`: I32
//!   `[ceil(rows/8), cols/group]`, eight zero points per word packed along the *rows* (row
//!   `8w + i` in bits `4i..4i+4` of word `w` of its group's column), offset-binary like the
//!   codes, so `value = (code − zero) × scale` with both as stored.
//! * Act-order (`actorder`) checkpoints also have `X.weight_g_idx`, each column's group: only
//!   the trivial `k / group` is accepted (the format's groups are contiguous).
//!
//! The import copies each code into the format's Q4_0 nibble order, each zero point (8 for
//! symmetric groups) and each scale's 16 bits unchanged; the checkpoint's group size, scale
//! dtype and zero points must equal the model's [`QuantSpec`] (bf16 and f16 are never
//! converted into each other).

use expertmesh_quant::format::{
    ExpertWeights, GateUp, PackedMatrix, QuantSpec, ScaleDtype, w13_row_meaning,
};

use crate::experts::{ExpertError, check_shape};
use crate::gptq_import::check_g_idx;
use crate::safetensors::{Checkpoint, Dtype, TensorView};

/// Codes per packed 32-bit word.
pub const CODES_PER_WORD: usize = 8;

/// The name prefix `X` of weight tensor `X.weight`, when `X.weight_packed` is in `ckpt` and
/// `X.weight` is not: the tensor is stored `pack-quantized`.
pub fn packed_base(ckpt: &Checkpoint, weight_name: &str) -> Option<String> {
    let base = weight_name.strip_suffix(".weight")?;
    let packed = ckpt.contains(&format!("{base}.weight_packed")) && !ckpt.contains(weight_name);
    packed.then(|| base.to_string())
}

/// Opens a `pack-quantized` expert (read by [`crate::experts::read_expert`], which copies its
/// codes and scales with [`assemble_int4_expert`]): `names` are its `[gate, up, down]` weight
/// names (`….weight`), `inter`/`hidden` its sizes. Each projection is checked against `quant`
/// (dtypes, shapes, group size, scale dtype, zero points, act-order indices); no code or scale
/// is read. `Ok(None)` when none of the three is stored `pack-quantized`, an error when only
/// some are.
pub(crate) fn open_packed_expert<'a>(
    ckpt: &'a Checkpoint,
    quant: QuantSpec,
    names: &[String; 3],
    inter: usize,
    hidden: usize,
) -> Result<Option<[PackedSource<'a>; 3]>, ExpertError> {
    let bases = names.clone().map(|n| packed_base(ckpt, &n));
    let [Some(gate), Some(up), Some(down)] = bases else {
        return match names.iter().zip(&bases).find(|(_, b)| b.is_some()) {
            None => Ok(None),
            Some((name, _)) => Err(ExpertError::Packed {
                tensor: name.clone(),
                reason: "only some of this expert's projections are stored pack-quantized; \
                         gate, up and down must share one format"
                    .into(),
            }),
        };
    };
    Ok(Some([
        PackedSource::open(ckpt, &gate, [inter, hidden], quant)?,
        PackedSource::open(ckpt, &up, [inter, hidden], quant)?,
        PackedSource::open(ckpt, &down, [hidden, inter], quant)?,
    ]))
}

/// One stored INT4 projection that an importer copies row by row into the packed layout.
pub(crate) trait Int4Rows {
    /// The tensor name prefix (for errors).
    fn base(&self) -> &str;
    /// Copy source row `r` into row `n` of `dst` (codes, scales, zero points), exactly.
    fn copy_row(&self, r: usize, dst: &mut PackedMatrix, n: usize);
    /// Source row `r` dequantized by the checkpoint's own rule, into `out`.
    fn fill(&self, r: usize, out: &mut [f32]) -> Result<(), ExpertError>;
}

/// The expert whose gate, up and down projections are `[gate, up, down]`: codes and scales
/// copied into W13 (gate/up rows interleaved) and W2, with the relative error against the
/// checkpoint's own dequantized values (0 unless the import is wrong). Shared by every
/// lossless INT4 importer (compressed-tensors here, GPTQ/AWQ in `gptq_import`).
pub(crate) fn assemble_int4_expert<S: Int4Rows>(
    quant: QuantSpec,
    inter: usize,
    hidden: usize,
    [gate, up, down]: [&S; 3],
) -> Result<(ExpertWeights, f64), ExpertError> {
    let w13_src = |r: usize| match w13_row_meaning(r) {
        (GateUp::Gate, f) => (gate, f),
        (GateUp::Up, f) => (up, f),
    };
    let mut w13 = zeroed("W13", gate.base(), quant, 2 * inter, hidden)?;
    let mut w2 = zeroed("W2", down.base(), quant, hidden, inter)?;
    for r in 0..2 * inter {
        let (src, f) = w13_src(r);
        src.copy_row(f, &mut w13, r);
    }
    for n in 0..hidden {
        down.copy_row(n, &mut w2, n);
    }
    let (d13, n13) = squared_error(&w13, |r, out| {
        let (src, f) = w13_src(r);
        src.fill(f, out)
    })?;
    let (d2, n2) = squared_error(&w2, |n, out| down.fill(n, out))?;
    let error = expertmesh_quant::search::relative_of(d13 + d2, n13 + n2);
    let weights = ExpertWeights::new(w13, w2).map_err(|source| ExpertError::Quantize {
        what: "W13/W2",
        tensor: down.base().to_string(),
        source,
    })?;
    Ok((weights, error))
}

/// An all-zero packed matrix, its format error naming `tensor`.
fn zeroed(
    what: &'static str,
    tensor: &str,
    quant: QuantSpec,
    rows: usize,
    cols: usize,
) -> Result<PackedMatrix, ExpertError> {
    PackedMatrix::zeroed(what, quant, rows, cols).map_err(|source| ExpertError::Quantize {
        what,
        tensor: tensor.to_string(),
        source,
    })
}

/// One `pack-quantized` projection: its packed codes and scales, checked against the model.
pub(crate) struct PackedSource<'a> {
    /// The name prefix `X`.
    base: String,
    /// `X.weight_packed`, `[rows, cols/8]` 32-bit words.
    packed: TensorView<'a>,
    /// `X.weight_scale`, `[rows, cols/group]` 16-bit scales.
    scales: TensorView<'a>,
    /// `X.weight_zero_point`, `[ceil(rows/8), cols/group]` 32-bit words (asymmetric groups).
    zeros: Option<TensorView<'a>>,
    cols: usize,
    groups: usize,
    group: usize,
    scale_dtype: ScaleDtype,
}

impl<'a> PackedSource<'a> {
    /// Opens `X.weight_packed`, `X.weight_scale` and `X.weight_shape` for `X = base`, checking
    /// dtypes, shapes (`[rows, cols]` from the model), group size and scale dtype against `quant`.
    fn open(
        ckpt: &'a Checkpoint,
        base: &str,
        [rows, cols]: [usize; 2],
        quant: QuantSpec,
    ) -> Result<Self, ExpertError> {
        let fail = |tensor: &str, reason: String| ExpertError::Packed {
            tensor: tensor.to_string(),
            reason,
        };
        check_recorded_shape(ckpt, base, [rows, cols])?;
        let packed_name = format!("{base}.weight_packed");
        let packed = ckpt.tensor(&packed_name)?;
        if !matches!(packed.dtype(), Dtype::I32 | Dtype::U32) {
            let reason = format!("dtype {} (packed INT4 codes must be I32)", packed.dtype());
            return Err(fail(&packed_name, reason));
        }
        if cols % CODES_PER_WORD != 0 {
            let reason = format!("{cols} columns is not a multiple of {CODES_PER_WORD}");
            return Err(fail(&packed_name, reason));
        }
        check_shape(&packed_name, packed.shape(), &[rows, cols / CODES_PER_WORD])?;
        let scale_name = format!("{base}.weight_scale");
        let scales = ckpt.tensor(&scale_name)?;
        let scale_dtype = match scales.dtype() {
            Dtype::BF16 => ScaleDtype::Bf16,
            Dtype::F16 => ScaleDtype::F16,
            d => {
                return Err(fail(
                    &scale_name,
                    format!("dtype {d} (scales must be BF16 or F16)"),
                ));
            }
        };
        if scale_dtype != quant.scale_dtype {
            let reason = format!(
                "the checkpoint's scales are {scale_dtype} but the model's quant spec ({quant}) \
                 wants {} scales; {scale_dtype} and {} are never converted into each other: set \
                 the model's scale dtype to {scale_dtype}",
                quant.scale_dtype, quant.scale_dtype
            );
            return Err(fail(&scale_name, reason));
        }
        let group = quant.group();
        if cols % group != 0 || scales.shape().len() != 2 || scales.shape()[1] != cols / group {
            let reason = format!(
                "shape {:?} does not give the model's group size {group} over {cols} columns \
                 (expected [{rows}, {}]); the import keeps the checkpoint's groups, so the \
                 model's quant spec must use its group size",
                scales.shape(),
                cols / group.max(1)
            );
            return Err(fail(&scale_name, reason));
        }
        check_shape(&scale_name, scales.shape(), &[rows, cols / group])?;
        let zero_name = format!("{base}.weight_zero_point");
        let zeros = if ckpt.contains(&zero_name) {
            let view = ckpt.tensor(&zero_name)?;
            if !matches!(view.dtype(), Dtype::I32 | Dtype::U32) {
                let reason = format!(
                    "dtype {} (packed zero points must be I32 or U32)",
                    view.dtype()
                );
                return Err(fail(&zero_name, reason));
            }
            check_shape(
                &zero_name,
                view.shape(),
                &[rows.div_ceil(CODES_PER_WORD), cols / group],
            )?;
            Some(view)
        } else {
            None
        };
        if zeros.is_some() != quant.zero_points {
            let (has, set) = match zeros {
                Some(_) => ("has zero points (asymmetric groups)", "true"),
                None => ("has no zero points (symmetric groups)", "false"),
            };
            let reason = format!(
                "the checkpoint {has} but the model's quant spec ({quant}) does not agree: set \
                 the model's zero_points to {set}"
            );
            return Err(fail(&zero_name, reason));
        }
        check_g_idx(ckpt, &format!("{base}.weight_g_idx"), cols, group)?;
        Ok(PackedSource {
            base: base.to_string(),
            packed,
            scales,
            zeros,
            cols,
            groups: cols / group,
            group,
            scale_dtype,
        })
    }

    /// The u4 code (offset-binary, zero point 8) of column `k` of row `r`.
    fn code(&self, r: usize, k: usize) -> u8 {
        let word = (r * self.cols + k) / CODES_PER_WORD;
        let b = &self.packed.bytes()[word * 4..word * 4 + 4];
        let w = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        ((w >> (4 * (k % CODES_PER_WORD))) & 0xF) as u8
    }

    /// The u4 zero point (offset-binary, as stored) of group `g` of row `r`: 8 for symmetric
    /// groups.
    fn zero(&self, r: usize, g: usize) -> u8 {
        let Some(zeros) = &self.zeros else {
            return 8;
        };
        let word = (r / CODES_PER_WORD) * self.groups + g;
        let b = &zeros.bytes()[word * 4..word * 4 + 4];
        let w = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        ((w >> (4 * (r % CODES_PER_WORD))) & 0xF) as u8
    }

    /// The scale bits of group `g` of row `r`.
    fn scale_bits(&self, r: usize, g: usize) -> u16 {
        let i = 2 * (r * self.groups + g);
        let b = self.scales.bytes();
        u16::from_le_bytes([b[i], b[i + 1]])
    }
}

impl Int4Rows for PackedSource<'_> {
    fn base(&self) -> &str {
        &self.base
    }

    /// Copies row `r` (codes in Q4_0 nibble order, zero points and scale bits as they are) into
    /// row `n` of `dst`.
    fn copy_row(&self, r: usize, dst: &mut PackedMatrix, n: usize) {
        // The format places each code (its Q4_0 nibble order lives in `set_code` only).
        for k in 0..dst.cols() {
            dst.set_code(n, k, self.code(r, k));
        }
        let groups = self.groups;
        if self.zeros.is_some() {
            for g in 0..groups {
                dst.set_zero(n, g, self.zero(r, g));
            }
        }
        let scales = &mut dst.scales_mut()[n * groups..][..groups];
        for (g, s) in scales.iter_mut().enumerate() {
            *s = self.scale_bits(r, g);
        }
    }

    /// Row `r` as the checkpoint defines it, `(code − zero) × scale` in f32, rejecting
    /// non-finite values (a NaN or infinite scale).
    fn fill(&self, r: usize, out: &mut [f32]) -> Result<(), ExpertError> {
        for (k, v) in out.iter_mut().enumerate() {
            let g = k / self.group;
            let scale = self.scale_dtype.to_f32(self.scale_bits(r, g));
            *v = (i32::from(self.code(r, k)) - i32::from(self.zero(r, g))) as f32 * scale;
        }
        match out.iter().position(|v| !v.is_finite()) {
            None => Ok(()),
            Some(col) => Err(ExpertError::NonFinite {
                tensor: format!("{}.weight_scale", self.base),
                row: r,
                col,
                value: out[col],
            }),
        }
    }
}

/// Checks `{base}.weight_shape` (I32 or I64 `[2]`) records `[rows, cols]`.
fn check_recorded_shape(
    ckpt: &Checkpoint,
    base: &str,
    expected: [usize; 2],
) -> Result<(), ExpertError> {
    let name = format!("{base}.weight_shape");
    let view = ckpt.tensor(&name)?;
    // The shape first: a large tensor under this name is refused before it is read.
    if view.shape() != [2] {
        return Err(ExpertError::Packed {
            tensor: name,
            reason: format!(
                "tensor shape {:?}, but a recorded weight shape is two numbers ([2]); the \
                 checkpoint is corrupt or not compressed-tensors",
                view.shape()
            ),
        });
    }
    let bytes = view.bytes();
    let recorded: Vec<i64> = match view.dtype() {
        Dtype::I32 => bytes
            .chunks_exact(4)
            .map(|b| i64::from(i32::from_le_bytes([b[0], b[1], b[2], b[3]])))
            .collect(),
        Dtype::I64 => bytes
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().unwrap_or([0; 8])))
            .collect(),
        d => {
            return Err(ExpertError::Packed {
                tensor: name,
                reason: format!("dtype {d} (weight_shape must be I32 or I64)"),
            });
        }
    };
    let want = expected.map(|d| d as i64);
    if recorded != want {
        return Err(ExpertError::Packed {
            tensor: name,
            reason: format!(
                "records the weight shape {recorded:?} but the model needs {want:?}; the \
                 checkpoint does not match its config.json"
            ),
        });
    }
    Ok(())
}

/// `(Σ (x − deq)², Σ x²)` in f64 over every row of `packed`, re-reading the source row by row.
pub(crate) fn squared_error(
    packed: &PackedMatrix,
    fill: impl Fn(usize, &mut [f32]) -> Result<(), ExpertError>,
) -> Result<(f64, f64), ExpertError> {
    let cols = packed.cols();
    let (mut src, mut deq) = (vec![0f32; cols], vec![0f32; cols]);
    let (mut diff, mut norm) = (0f64, 0f64);
    for n in 0..packed.rows() {
        fill(n, &mut src)?;
        packed.dequantize_row(n, &mut deq);
        for (&x, &y) in src.iter().zip(&deq) {
            let r = f64::from(x) - f64::from(y);
            diff += r * r;
            norm += f64::from(x) * f64::from(x);
        }
    }
    Ok((diff, norm))
}
