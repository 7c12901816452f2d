//! Reading one checkpoint expert into packed INT4: both naming layouts and the fused layout of
//! transformers v5, single-file and sharded checkpoints, BF16 and block-scaled FP8 sources, the
//! gate/up interleave, and errors that name the tensor.

use std::collections::BTreeMap;
use std::path::Path;

use crate::support::read_checked;
use expertmesh_checkpoint::experts::{ExpertError, ExpertRef, Family, expert_tensor_names};
use expertmesh_checkpoint::safetensors::{
    Checkpoint, Dtype, INDEX_FILE, SINGLE_FILE, TensorData, e4m3_to_f32, write_safetensors,
};
use expertmesh_quant::format::{ExpertWeights, GateUp, QuantSpec, w13_row};
use expertmesh_quant::synth::SplitMix64;
use expertmesh_topology::model::{ModelSpec, preset_by_name};
use half::bf16;
use tempfile::TempDir;

/// `(name, dtype, shape, bytes)`.
type Owned = (String, Dtype, Vec<usize>, Vec<u8>);

/// A source expert: its tensors and the f32 values the reader should see for gate, up, down.
struct Source {
    tensors: Vec<Owned>,
    values: [Vec<f32>; 3],
}

/// How to make a source expert's weights.
#[derive(Clone, Copy)]
enum Kind {
    /// Gaussian, stored BF16.
    Bf16,
    /// Gate all positive, up all negative, down Gaussian; BF16.
    Signed,
    /// Gaussian FP8 E4M3 codes with known block scales (f32 grid for gate/up, bf16 for down).
    Fp8,
    /// BF16 weights on a symmetric INT4 grid, as a quantization-aware-trained model publishes
    /// them: per group of 32 along each row, a power-of-two scale times codes in `-m ..= m-1`,
    /// the group's largest code `m` anywhere from 4 to 8 (used, on either side).
    PowerOfTwoGrid,
    /// BF16 weights on a full-range INT4 grid: per group, a 5-bit scale (not a power of two)
    /// times codes in `-7 ..= 7` with ±7 used.
    FullRangeGrid,
}

/// A small model: two MoE layers, three routed experts of width `f`, and (when `shared`) one
/// shared expert of width `2f`.
fn model(hidden: u32, f: u32, shared: bool) -> ModelSpec {
    let mut m = preset_by_name("deepseek-v3").unwrap();
    m.num_layers = 2;
    m.first_dense_layers = 0;
    m.moe_layer_step = 1;
    m.hidden = hidden;
    m.routed_experts = 3;
    m.moe_intermediate = f;
    m.shared_experts = u32::from(shared);
    m.shared_intermediate = if shared { 2 * f } else { 0 };
    m.quant = QuantSpec::G32_BF16;
    m
}

fn bf16_bytes(v: &[f32]) -> (Vec<u8>, Vec<f32>) {
    let b: Vec<bf16> = v.iter().map(|&x| bf16::from_f32(x)).collect();
    let bytes = b.iter().flat_map(|x| x.to_le_bytes()).collect();
    (bytes, b.iter().map(|x| x.to_f32()).collect())
}

/// The finite E4M3 code nearest to `x`.
fn e4m3_code(x: f32) -> u8 {
    (0..=255u8)
        .filter(|c| c & 0x7F != 0x7F)
        .min_by(|&a, &b| {
            let da = (e4m3_to_f32(a) - x).abs();
            let db = (e4m3_to_f32(b) - x).abs();
            da.total_cmp(&db)
        })
        .unwrap()
}

/// One weight tensor `[rows, cols]` of `kind` (sign: +1 all positive, -1 all negative, 0 any),
/// plus its `weight_scale_inv` for FP8; returns the tensors and the values they mean.
fn weight(
    name: &str,
    [rows, cols]: [usize; 2],
    kind: Kind,
    sign: f32,
    rng: &mut SplitMix64,
) -> (Vec<Owned>, Vec<f32>) {
    let gauss: Vec<f32> = (0..rows * cols)
        .map(|_| {
            let x = rng.normal() as f32;
            if sign == 0.0 {
                x
            } else {
                sign * (x.abs() + 0.05)
            }
        })
        .collect();
    let shape = vec![rows, cols];
    if matches!(kind, Kind::PowerOfTwoGrid | Kind::FullRangeGrid) {
        let grid: Vec<f32> = (0..rows * cols / 32)
            .flat_map(|_| grid_group(kind, rng))
            .collect();
        let (bytes, values) = bf16_bytes(&grid);
        assert_eq!(values, grid, "grid weights are exact in bf16");
        return (vec![(name.into(), Dtype::BF16, shape, bytes)], values);
    }
    if !matches!(kind, Kind::Fp8) {
        let (bytes, values) = bf16_bytes(&gauss);
        return (vec![(name.into(), Dtype::BF16, shape, bytes)], values);
    }
    let codes: Vec<u8> = gauss.iter().map(|&x| e4m3_code(x)).collect();
    let grid = [rows.div_ceil(128), cols.div_ceil(128)];
    let scales: Vec<f32> = (0..grid[0] * grid[1])
        .map(|i| 0.0078125 * (i + 1) as f32)
        .collect();
    let values = (0..rows * cols)
        .map(|i| {
            let (r, c) = (i / cols, i % cols);
            e4m3_to_f32(codes[i]) * scales[(r / 128) * grid[1] + c / 128]
        })
        .collect();
    let (sdtype, sbytes) = if name.contains("down") {
        (Dtype::BF16, bf16_bytes(&scales).0)
    } else {
        (
            Dtype::F32,
            scales.iter().flat_map(|s| s.to_le_bytes()).collect(),
        )
    };
    let scale = (format!("{name}_scale_inv"), sdtype, grid.to_vec(), sbytes);
    (
        vec![(name.into(), Dtype::F8E4M3, shape, codes), scale],
        values,
    )
}

/// One group of 32 grid weights of `kind` (see [`Kind`]), around magnitude 2^-4.
fn grid_group(kind: Kind, rng: &mut SplitMix64) -> Vec<f32> {
    let e = -9 + rng.below(4) as i32;
    let (d, m) = match kind {
        Kind::PowerOfTwoGrid => (2f32.powi(e), 4 + rng.below(5) as i64),
        _ => ((16 + rng.below(16)) as f32 / 16.0 * 2f32.powi(e), 7),
    };
    let span = if matches!(kind, Kind::PowerOfTwoGrid) {
        2 * m
    } else {
        15
    };
    let low = if matches!(kind, Kind::PowerOfTwoGrid) {
        -m
    } else {
        -7
    };
    let extreme = match kind {
        Kind::PowerOfTwoGrid => [-m, m - 1][rng.below(2) as usize],
        _ => [-7, 7][rng.below(2) as usize],
    };
    (0..32)
        .map(|i| {
            let c = if i == 7 {
                extreme
            } else {
                low + rng.below(span as u64) as i64
            };
            d * c as f32
        })
        .collect()
}

/// The three tensors of one expert of width `f` in `family`'s naming.
fn expert(family: Family, layer: u32, which: ExpertRef, h: usize, f: usize, kind: Kind) -> Source {
    let mut rng = SplitMix64::new(u64::from(layer) * 1000 + 7);
    let names = expert_tensor_names(family, layer, which).unwrap();
    let signs = match kind {
        Kind::Signed => [1.0, -1.0, 0.0],
        _ => [0.0; 3],
    };
    let shapes = [[f, h], [f, h], [h, f]];
    let mut tensors = Vec::new();
    let values = [0, 1, 2].map(|i| {
        let (t, v) = weight(&names[i], shapes[i], kind, signs[i], &mut rng);
        tensors.extend(t);
        v
    });
    Source { tensors, values }
}

fn write(path: &Path, tensors: &[Owned]) {
    let borrowed: Vec<TensorData<'_>> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.as_str(), *d, s.as_slice(), b.as_slice()))
        .collect();
    write_safetensors(path, &borrowed, &BTreeMap::new()).unwrap();
}

/// Writes `layers` (each a list of tensors) as one file, or as one shard per layer plus index.
fn write_checkpoint(dir: &Path, layers: &[Vec<Owned>], sharded: bool) {
    if !sharded {
        write(&dir.join(SINGLE_FILE), &layers.concat());
        return;
    }
    let mut map = serde_json::Map::new();
    for (i, tensors) in layers.iter().enumerate() {
        let file = format!("model-{:05}-of-{:05}.safetensors", i + 1, layers.len());
        write(&dir.join(&file), tensors);
        for (name, ..) in tensors {
            map.insert(name.clone(), file.clone().into());
        }
    }
    let index = serde_json::json!({ "metadata": {}, "weight_map": map });
    std::fs::write(dir.join(INDEX_FILE), index.to_string()).unwrap();
}

/// `‖a − b‖ / ‖a‖`.
fn rel(a: &[f32], b: &[f32]) -> f64 {
    let d: f64 = a.iter().zip(b).map(|(x, y)| f64::from(x - y).powi(2)).sum();
    let n: f64 = a.iter().map(|x| f64::from(*x).powi(2)).sum();
    (d / n).sqrt()
}

/// The dequantized gate, up and down of `w`, gate/up taken from where `w13_row` says.
fn dequantized(w: &ExpertWeights) -> [Vec<f32>; 3] {
    let (h, f) = (w.hidden(), w.inter());
    let w13 = w.w13().dequantize();
    let pick = |which| {
        (0..f)
            .flat_map(|i| w13[w13_row(which, i) * h..][..h].to_vec())
            .collect::<Vec<f32>>()
    };
    [pick(GateUp::Gate), pick(GateUp::Up), w.w2().dequantize()]
}

/// Reads every expert of a two-layer checkpoint and checks it against its source.
fn round_trip(family: Family, kind: Kind, h: usize, f: usize, sharded: bool) {
    let shared = family.has_shared_expert();
    let spec = model(h as u32, f as u32, shared);
    let mut whiches: Vec<ExpertRef> = (0..3).map(ExpertRef::Routed).collect();
    if shared {
        whiches.push(ExpertRef::Shared);
    }
    let mut sources = Vec::new();
    let mut layers = Vec::new();
    for layer in 0..2 {
        let mut tensors = Vec::new();
        for &which in &whiches {
            let width = if which == ExpertRef::Shared { 2 * f } else { f };
            let s = expert(family, layer, which, h, width, kind);
            tensors.extend(s.tensors.iter().cloned());
            sources.push((layer, which, s));
        }
        layers.push(tensors);
    }
    let dir = TempDir::new().unwrap();
    write_checkpoint(dir.path(), &layers, sharded);
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    for (layer, which, source) in &sources {
        let (w, err) = read_checked(&ckpt, &spec, family, *layer, *which).unwrap();
        assert_eq!(w.hidden(), h);
        assert_eq!(w.spec(), spec.quant);
        let deq = dequantized(&w);
        let all_src = source.values.concat();
        let all_deq = deq.concat();
        let expect = rel(&all_src, &all_deq);
        assert!(err <= 0.12, "{layer} {which}: relative error {err}");
        if matches!(kind, Kind::PowerOfTwoGrid | Kind::FullRangeGrid) {
            assert_eq!(err, 0.0, "{layer} {which}: weights on an INT4 grid");
            for i in 0..3 {
                assert!(
                    source.values[i] == deq[i],
                    "{layer} {which} tensor {i} not exact"
                );
            }
        }
        assert!(
            (err - expect).abs() < 1e-6,
            "reported {err}, measured {expect}"
        );
        for i in 0..3 {
            let e = rel(&source.values[i], &deq[i]);
            assert!(e <= 0.12, "{layer} {which} tensor {i}: relative error {e}");
        }
        if matches!(kind, Kind::Signed) {
            assert!(deq[0].iter().all(|&v| v >= 0.0) && deq[0].iter().sum::<f32>() > 0.0);
            assert!(deq[1].iter().all(|&v| v <= 0.0) && deq[1].iter().sum::<f32>() < 0.0);
        }
    }
}

/// Weights that already lie on an INT4 grid come back exactly (error 0), whatever the grid's
/// largest code: the converter's quantizer finds the scale that fits, absmax/4 included.
#[test]
fn weights_on_int4_grids_convert_with_error_zero() {
    round_trip(Family::DeepseekV3, Kind::PowerOfTwoGrid, 128, 64, false);
    round_trip(Family::Mixtral, Kind::FullRangeGrid, 128, 64, true);
}

#[test]
fn deepseek_bf16_single_file() {
    round_trip(Family::DeepseekV3, Kind::Bf16, 64, 32, false);
}

#[test]
fn deepseek_bf16_sharded_gate_up_placement() {
    round_trip(Family::DeepseekV3, Kind::Signed, 64, 32, true);
}

#[test]
fn mixtral_bf16_single_and_sharded() {
    round_trip(Family::Mixtral, Kind::Bf16, 64, 32, false);
    round_trip(Family::Mixtral, Kind::Signed, 64, 32, true);
}

#[test]
fn deepseek_fp8_block_scaled() {
    // 256 × 160 spans two 128-blocks each way, so the scale grid's indexing is exercised.
    round_trip(Family::DeepseekV3, Kind::Fp8, 256, 160, true);
}

#[test]
fn mixtral_fp8_block_scaled() {
    round_trip(Family::Mixtral, Kind::Fp8, 256, 160, false);
}

#[test]
fn names_per_family() {
    let [g, u, d] = expert_tensor_names(Family::Mixtral, 3, ExpertRef::Routed(5)).unwrap();
    assert_eq!(g, "model.layers.3.block_sparse_moe.experts.5.w1.weight");
    assert_eq!(u, "model.layers.3.block_sparse_moe.experts.5.w3.weight");
    assert_eq!(d, "model.layers.3.block_sparse_moe.experts.5.w2.weight");
    let [g, ..] = expert_tensor_names(Family::Qwen3Moe, 1, ExpertRef::Routed(2)).unwrap();
    assert_eq!(g, "model.layers.1.mlp.experts.2.gate_proj.weight");
    let [_, _, d] = expert_tensor_names(Family::Glm4Moe, 4, ExpertRef::Shared).unwrap();
    assert_eq!(d, "model.layers.4.mlp.shared_experts.down_proj.weight");
    assert!(expert_tensor_names(Family::Olmoe, 0, ExpertRef::Shared).is_err());
    assert_eq!(Family::from_model_type("kimi_k2"), Some(Family::DeepseekV3));
    assert_eq!(Family::from_model_type("gpt_oss"), None);
}

/// A one-layer DeepSeek checkpoint (H 64, F 32) with expert 0 of layer 0 edited by `edit`;
/// returns the error reading it.
fn read_broken(edit: impl FnOnce(&mut Vec<Owned>)) -> ExpertError {
    let mut tensors = expert(
        Family::DeepseekV3,
        0,
        ExpertRef::Routed(0),
        64,
        32,
        Kind::Bf16,
    )
    .tensors;
    edit(&mut tensors);
    let dir = TempDir::new().unwrap();
    write(&dir.path().join(SINGLE_FILE), &tensors);
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let spec = model(64, 32, true);
    read_checked(&ckpt, &spec, Family::DeepseekV3, 0, ExpertRef::Routed(0)).unwrap_err()
}

const UP: &str = "model.layers.0.mlp.experts.0.up_proj.weight";
const DOWN: &str = "model.layers.0.mlp.experts.0.down_proj.weight";

#[test]
fn missing_tensor_is_named() {
    let err = read_broken(|t| t.retain(|(n, ..)| n != UP));
    assert!(matches!(err, ExpertError::Read(_)), "{err:?}");
    assert!(err.to_string().contains(UP), "{err}");
}

#[test]
fn wrong_shape_is_named() {
    let err = read_broken(|t| {
        let down = t.iter_mut().find(|(n, ..)| n == DOWN).unwrap();
        down.2 = vec![32, 64];
    });
    assert!(matches!(err, ExpertError::Shape { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains(DOWN) && msg.contains("[64, 32]"), "{msg}");
}

/// A weight of a layout the converter does not read (here bitsandbytes-style packed bytes,
/// U8 with half the rows) is named for its dtype, not as a shape that contradicts config.json.
#[test]
fn a_weight_of_an_unread_dtype_is_named_for_its_dtype_not_its_shape() {
    let err = read_broken(|t| {
        let down = t.iter_mut().find(|(n, ..)| n == DOWN).unwrap();
        down.1 = Dtype::U8;
        down.2 = vec![32, 1];
        down.3.truncate(32);
    });
    assert!(
        matches!(&err, ExpertError::Dtype { tensor, dtype: Dtype::U8 } if tensor == DOWN),
        "{err:?}"
    );
}

#[test]
fn nan_is_named_with_row_and_column() {
    let err = read_broken(|t| {
        let up = t.iter_mut().find(|(n, ..)| n == UP).unwrap();
        let at = (3 * 64 + 5) * 2;
        up.3[at..at + 2].copy_from_slice(&bf16::NAN.to_le_bytes());
    });
    let msg = err.to_string();
    assert!(
        matches!(err, ExpertError::NonFinite { row: 3, col: 5, .. }),
        "{err:?}"
    );
    assert!(msg.contains(UP), "{msg}");
}

#[test]
fn fp8_without_scale_names_the_scale_tensor() {
    let dir = TempDir::new().unwrap();
    let mut s = expert(
        Family::DeepseekV3,
        0,
        ExpertRef::Routed(0),
        256,
        160,
        Kind::Fp8,
    );
    s.tensors
        .retain(|(n, ..)| !n.ends_with("gate_proj.weight_scale_inv"));
    write(&dir.path().join(SINGLE_FILE), &s.tensors);
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let spec = model(256, 160, true);
    let err = read_checked(&ckpt, &spec, Family::DeepseekV3, 0, ExpertRef::Routed(0)).unwrap_err();
    assert!(
        err.to_string().contains("gate_proj.weight_scale_inv"),
        "{err}"
    );
}

#[test]
fn nonexistent_experts_are_refused() {
    let dir = TempDir::new().unwrap();
    let s = expert(Family::Mixtral, 0, ExpertRef::Routed(0), 64, 32, Kind::Bf16);
    write(&dir.path().join(SINGLE_FILE), &s.tensors);
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let spec = model(64, 32, false);
    for (layer, which) in [
        (0, ExpertRef::Routed(3)),
        (2, ExpertRef::Routed(0)),
        (0, ExpertRef::Shared),
    ] {
        let err = read_checked(&ckpt, &spec, Family::Mixtral, layer, which).unwrap_err();
        assert!(matches!(err, ExpertError::NoSuchExpert { .. }), "{err:?}");
    }
}

/// The layer's routed experts as transformers v5 stores them: `experts.gate_up_proj`
/// `[E, 2F, H]` (each expert's gate rows, then its up rows) and `experts.down_proj`
/// `[E, H, F]` under `home`, built from the per-expert sources' bytes.
fn fused(home: &str, sources: &[Source], h: usize, f: usize) -> Vec<Owned> {
    let bytes = |i: usize| -> Vec<u8> {
        sources
            .iter()
            .flat_map(|s| s.tensors[i].3.clone())
            .collect()
    };
    let gate_up: Vec<u8> = sources
        .iter()
        .flat_map(|s| [s.tensors[0].3.clone(), s.tensors[1].3.clone()].concat())
        .collect();
    let e = sources.len();
    vec![
        (
            format!("{home}.gate_up_proj"),
            Dtype::BF16,
            vec![e, 2 * f, h],
            gate_up,
        ),
        (
            format!("{home}.down_proj"),
            Dtype::BF16,
            vec![e, h, f],
            bytes(2),
        ),
    ]
}

/// A checkpoint that stores a layer's routed experts fused (transformers v5's layout, under
/// `mlp.experts`, and for Mixtral also `block_sparse_moe.experts`) converts to exactly the
/// packed experts, and the same error, as the same weights stored one tensor per expert; a
/// fused tensor of the wrong shape or of FP8 is refused naming it.
#[test]
fn fused_experts_convert_as_the_same_weights_stored_per_expert() {
    let (h, f) = (128, 64);
    let spec = model(h as u32, f as u32, false);
    for (family, home) in [
        (Family::DeepseekV3, "model.layers.0.mlp.experts"),
        (Family::Mixtral, "model.layers.0.block_sparse_moe.experts"),
        (Family::Mixtral, "model.layers.0.mlp.experts"),
    ] {
        let sources: Vec<Source> = (0..3)
            .map(|e| expert(family, 0, ExpertRef::Routed(e), h, f, Kind::Bf16))
            .collect();
        let per_expert = TempDir::new().unwrap();
        write(
            &per_expert.path().join(SINGLE_FILE),
            &sources
                .iter()
                .flat_map(|s| s.tensors.clone())
                .collect::<Vec<_>>(),
        );
        let fused_dir = TempDir::new().unwrap();
        write(
            &fused_dir.path().join(SINGLE_FILE),
            &fused(home, &sources, h, f),
        );
        let a = Checkpoint::open(per_expert.path()).unwrap();
        let b = Checkpoint::open(fused_dir.path()).unwrap();
        for e in 0..3 {
            let which = ExpertRef::Routed(e);
            let (wa, ea) = read_checked(&a, &spec, family, 0, which).unwrap();
            let (wb, eb) = read_checked(&b, &spec, family, 0, which)
                .unwrap_or_else(|err| panic!("{family:?} {home} expert {e}: {err}"));
            assert!(
                wa == wb,
                "{family:?} {home} expert {e}: packed weights differ"
            );
            assert_eq!(ea.to_bits(), eb.to_bits(), "{family:?} expert {e}");
        }
    }
    // A fused tensor of the wrong shape, or in FP8, is named.
    let sources: Vec<Source> = (0..3)
        .map(|e| {
            expert(
                Family::DeepseekV3,
                0,
                ExpertRef::Routed(e),
                h,
                f,
                Kind::Bf16,
            )
        })
        .collect();
    let home = "model.layers.0.mlp.experts";
    for (edit, says) in [
        (
            Box::new(|t: &mut Vec<Owned>| t[0].2 = vec![6, f, h]) as Box<dyn Fn(&mut Vec<Owned>)>,
            "has shape [6, 64, 128] but the model needs [3, 128, 128]",
        ),
        (
            Box::new(|t: &mut Vec<Owned>| {
                t[1].1 = Dtype::F8E4M3;
                let half = t[1].3.len() / 2;
                t[1].3.truncate(half);
            }),
            "dtype F8_E4M3 in fused expert tensors is not read",
        ),
    ] {
        let mut tensors = fused(home, &sources, h, f);
        edit(&mut tensors);
        let dir = TempDir::new().unwrap();
        write(&dir.path().join(SINGLE_FILE), &tensors);
        let ckpt = Checkpoint::open(dir.path()).unwrap();
        let err = read_checked(&ckpt, &spec, Family::DeepseekV3, 0, ExpertRef::Routed(1))
            .unwrap_err()
            .to_string();
        assert!(err.contains(home) && err.contains(says), "{err}");
    }
}
