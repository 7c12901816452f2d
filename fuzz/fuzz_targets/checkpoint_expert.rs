//! Fuzz reading one expert of a checkpoint (`expertmesh_checkpoint::experts::read_expert`,
//! what `expertmesh convert` runs per expert) below the safetensors header: the tensors of a
//! tiny model built from the input, one tensor per expert or fused per layer (transformers
//! v5's `gate_up_proj` / `down_proj`, under both of Mixtral's homes), in BF16, F16, F32 or
//! FP8 with its block scales, with a chosen tensor's shape bent, values optionally made
//! finite. Checks: never a panic; an expert that reads has the model's shape and a relative
//! error that is a number; an error names a tensor of the layer; the converter's header-only
//! pre-pass (`check_expert`) refuses exactly what reading refuses before its first weight
//! (the same error), and what it passes fails reading only for a weight's value.
//! Run: `cargo +nightly fuzz run checkpoint_expert -- -max_total_time=60`.
#![no_main]

use expertmesh_checkpoint::experts::{
    ExpertError, ExpertRef, Family, check_expert, read_expert, source_quant,
};
use expertmesh_checkpoint::safetensors::{Checkpoint, Dtype, SINGLE_FILE};
use expertmesh_quant::format::QuantSpec;
use expertmesh_topology::model::{ModelSpec, preset_by_name};
use libfuzzer_sys::fuzz_target;

const HIDDEN: usize = 64;
const INTER: usize = 32;
const EXPERTS: usize = 2;

/// One MoE layer of two experts (hidden 64, width 32), no shared expert.
fn model() -> ModelSpec {
    let mut m = preset_by_name("deepseek-v3").unwrap();
    m.num_layers = 1;
    m.first_dense_layers = 0;
    m.moe_layer_step = 1;
    m.hidden = HIDDEN as u32;
    m.routed_experts = EXPERTS as u32;
    m.moe_intermediate = INTER as u32;
    m.shared_experts = 0;
    m.shared_intermediate = 0;
    m.quant = QuantSpec::G32_BF16;
    m
}

/// `len` bytes cycled from `data` (zeros when it is empty), non-finite values made finite
/// when `finite` (an all-ones exponent loses its top bit).
fn fill(data: &[u8], at: &mut usize, len: usize, dtype: Dtype, finite: bool) -> Vec<u8> {
    let mut out: Vec<u8> = (0..len)
        .map(|i| {
            if data.is_empty() {
                0
            } else {
                data[(*at + i) % data.len()]
            }
        })
        .collect();
    *at += len;
    if finite {
        match dtype {
            Dtype::BF16 => out.chunks_mut(2).for_each(|c| {
                if c[1] & 0x7F == 0x7F && c[0] & 0x80 != 0 {
                    c[1] &= !0x40;
                }
            }),
            Dtype::F16 => out.chunks_mut(2).for_each(|c| {
                if c[1] & 0x7C == 0x7C {
                    c[1] &= !0x40;
                }
            }),
            Dtype::F32 => out.chunks_mut(4).for_each(|c| {
                if c[3] & 0x7F == 0x7F && c[2] & 0x80 != 0 {
                    c[3] &= !0x40;
                }
            }),
            _ => out.iter_mut().for_each(|b| {
                if *b & 0x7F == 0x7F {
                    *b &= !0x01;
                }
            }),
        }
    }
    out
}

/// A safetensors file of `tensors` (`name, dtype, shape, bytes`), laid out in order.
fn file(tensors: &[(String, Dtype, Vec<usize>, Vec<u8>)]) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    let mut offset = 0usize;
    for (name, dtype, shape, bytes) in tensors {
        header.insert(
            name.clone(),
            serde_json::json!({
                "dtype": dtype.to_string(),
                "shape": shape,
                "data_offsets": [offset, offset + bytes.len()],
            }),
        );
        offset += bytes.len();
    }
    let mut text = serde_json::Value::Object(header).to_string().into_bytes();
    while text.len() % 8 != 0 {
        text.push(b' ');
    }
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&text);
    for (.., bytes) in tensors {
        out.extend_from_slice(bytes);
    }
    out
}

fuzz_target!(|data: &[u8]| {
    let Some((ctl, data)) = data.split_first_chunk::<4>() else {
        return;
    };
    let family = if ctl[0] & 1 == 0 {
        Family::DeepseekV3
    } else {
        Family::Mixtral
    };
    // 0: per expert; 1: fused under mlp.experts; 2: fused under block_sparse_moe.experts.
    let layout = (ctl[0] >> 1) % 3;
    let dtype = [Dtype::BF16, Dtype::F16, Dtype::F32, Dtype::F8E4M3][usize::from(ctl[1] % 4)];
    let finite = ctl[1] & 0x80 != 0;
    // Which tensor's shape to bend (none above the count), and by how much.
    let (bent, by) = (usize::from(ctl[2]), i64::from(ctl[3] as i8));
    let mut tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    let names: Vec<(String, Vec<usize>)> = match layout {
        0 => (0..EXPERTS as u32)
            .flat_map(|e| {
                let names = expertmesh_checkpoint::experts::expert_tensor_names(
                    family,
                    0,
                    ExpertRef::Routed(e),
                )
                .unwrap();
                let shapes = [
                    vec![INTER, HIDDEN],
                    vec![INTER, HIDDEN],
                    vec![HIDDEN, INTER],
                ];
                names.into_iter().zip(shapes)
            })
            .collect(),
        _ => {
            let home = if layout == 1 {
                "model.layers.0.mlp.experts"
            } else {
                "model.layers.0.block_sparse_moe.experts"
            };
            vec![
                (
                    format!("{home}.gate_up_proj"),
                    vec![EXPERTS, 2 * INTER, HIDDEN],
                ),
                (format!("{home}.down_proj"), vec![EXPERTS, HIDDEN, INTER]),
            ]
        }
    };
    let mut at = 0;
    for (i, (name, mut shape)) in names.into_iter().enumerate() {
        if i == bent {
            let d = bent % shape.len();
            shape[d] = (shape[d] as i64 + by).clamp(0, 512) as usize;
        }
        let elements: usize = shape.iter().product();
        let bytes = fill(data, &mut at, elements * dtype.size(), dtype, finite);
        if dtype == Dtype::F8E4M3 && shape.len() == 2 {
            let grid = vec![shape[0].div_ceil(128), shape[1].div_ceil(128)];
            let scales = fill(data, &mut at, grid[0] * grid[1] * 4, Dtype::F32, finite);
            tensors.push((format!("{name}_scale_inv"), Dtype::F32, grid, scales));
        }
        tensors.push((name, dtype, shape, bytes));
    }
    thread_local! {
        static DIR: std::path::PathBuf = {
            let d = std::env::temp_dir().join(format!("em-fuzz-ckpt-{}", std::process::id()));
            std::fs::create_dir_all(&d).unwrap();
            d
        };
    }
    let dir = DIR.with(|d| d.clone());
    std::fs::write(dir.join(SINGLE_FILE), file(&tensors)).unwrap();
    let Ok(ckpt) = Checkpoint::open(&dir) else {
        return;
    };
    let spec = model();
    let _ = source_quant(&ckpt, &spec, family);
    for e in 0..EXPERTS as u32 {
        let checked = check_expert(&ckpt, &spec, family, 0, ExpertRef::Routed(e));
        let read = read_expert(&ckpt, &spec, family, 0, ExpertRef::Routed(e));
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
        match read {
            Ok((w, err)) => {
                assert_eq!((w.hidden(), w.inter()), (HIDDEN, INTER));
                assert!(!err.is_nan() && err >= 0.0, "relative error {err}");
            }
            Err(e) => {
                // Every tensor of the layer, in the file or looked for, is under this prefix.
                let msg = e.to_string();
                assert!(
                    msg.contains("model.layers.0."),
                    "an error that names no tensor: {msg}"
                );
            }
        }
    }
});
