//! Helpers shared by the import tests (`gptq_import`, `packed_import`): the tensors a test
//! writes, a one-expert DeepSeek-V3 model, the expert's tensor prefixes, writing a
//! checkpoint folder, and reading an expert with the converter's pre-pass held to the read
//! (`read_checked`, used by every test here that reads an expert).

use std::collections::BTreeMap;
use std::path::Path;

use expertmesh_checkpoint::experts::{
    ExpertError, ExpertRef, Family, check_expert, expert_tensor_names, read_expert,
};
use expertmesh_checkpoint::safetensors::Checkpoint;
use expertmesh_checkpoint::safetensors::{Dtype, SINGLE_FILE, TensorData, write_safetensors};
use expertmesh_quant::format::{
    ExpertWeights, GateUp, PackedMatrix, QuantSpec, ScaleDtype, w13_row,
};
use expertmesh_topology::model::{ModelSpec, preset_by_name};

/// `read_expert`, with the converter's pre-pass (`check_expert`) held to it: what the check
/// refuses, the read refuses with the same error; what it passes, the read refuses only for a
/// weight's value.
pub(crate) fn read_checked(
    ckpt: &Checkpoint,
    spec: &ModelSpec,
    family: Family,
    layer: u32,
    which: ExpertRef,
) -> Result<(ExpertWeights, f64), ExpertError> {
    let checked = check_expert(ckpt, spec, family, layer, which);
    let read = read_expert(ckpt, spec, family, layer, which);
    match (&checked, &read) {
        (Err(c), Err(r)) => assert_eq!(c.to_string(), r.to_string(), "check vs read"),
        (Err(c), Ok(_)) => panic!("the pre-pass refused an expert that reads: {c}"),
        (Ok(()), Err(r)) => assert!(
            matches!(
                r,
                ExpertError::NonFinite { .. } | ExpertError::Quantize { .. }
            ),
            "passed the pre-pass, refused for more than a weight's value: {r}"
        ),
        (Ok(()), Ok(_)) => {}
    }
    read
}

/// `(name, dtype, shape, bytes)`.
pub(crate) type Owned = (String, Dtype, Vec<usize>, Vec<u8>);

/// The generated projections `P`, the tensors written, and what `read_expert` made of them.
pub(crate) type Imported<P> = (
    Vec<P>,
    Vec<Owned>,
    Result<(ExpertWeights, f64), ExpertError>,
);

/// DeepSeek-V3 cut down to one MoE layer of two routed experts of hidden `h` and
/// intermediate `f`, no shared experts, in `quant`.
pub(crate) fn model(h: usize, f: usize, quant: QuantSpec) -> ModelSpec {
    let mut m = preset_by_name("deepseek-v3").unwrap();
    m.num_layers = 1;
    m.first_dense_layers = 0;
    m.moe_layer_step = 1;
    m.hidden = h as u32;
    m.routed_experts = 2;
    m.moe_intermediate = f as u32;
    m.shared_experts = 0;
    m.shared_intermediate = 0;
    m.quant = quant;
    m
}

/// A packed format of group `group`.
pub(crate) fn quant(group: usize, scale_dtype: ScaleDtype, zero_points: bool) -> QuantSpec {
    QuantSpec {
        group_size: group as u32,
        scale_dtype,
        zero_points,
    }
}

/// The tensor prefixes (names without `.weight`) of layer 0's routed expert 0: gate, up, down.
pub(crate) fn bases() -> [String; 3] {
    expert_tensor_names(Family::DeepseekV3, 0, ExpertRef::Routed(0))
        .unwrap()
        .map(|n| n.strip_suffix(".weight").unwrap().to_string())
}

/// Writes `tensors` (and `config`, when given) into `dir`.
pub(crate) fn write_checkpoint(dir: &Path, tensors: &[Owned], config: Option<&serde_json::Value>) {
    let borrowed: Vec<TensorData<'_>> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.as_str(), *d, s.as_slice(), b.as_slice()))
        .collect();
    write_safetensors(dir.join(SINGLE_FILE), &borrowed, &BTreeMap::new()).unwrap();
    if let Some(config) = config {
        std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    }
}

/// Row `r` of projection `i` (0 gate, 1 up, 2 down) of an imported expert: the packed matrix
/// holding it, the row's index there, and the row dequantized (`cols` values).
pub(crate) fn proj_row(
    w: &ExpertWeights,
    i: usize,
    r: usize,
    cols: usize,
) -> (&PackedMatrix, usize, Vec<f32>) {
    let (m, n) = match i {
        0 => (w.w13(), w13_row(GateUp::Gate, r)),
        1 => (w.w13(), w13_row(GateUp::Up, r)),
        _ => (w.w2(), r),
    };
    let mut row = vec![0f32; cols];
    m.dequantize_row(n, &mut row);
    (m, n, row)
}
