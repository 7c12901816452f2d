//! Lossless import of compressed-tensors `pack-quantized` INT4 experts, symmetric and
//! asymmetric: every code, zero point and scale bit round-trips, the dequantized values equal
//! an independent decoder's, and malformed or incompatible checkpoints (act-order groups
//! included) are refused with errors naming the tensor.

use expertmesh_checkpoint::experts::{ExpertRef, Family};
use expertmesh_checkpoint::safetensors::{Checkpoint, Dtype};
use expertmesh_quant::format::ScaleDtype;
use expertmesh_quant::synth::SplitMix64;
use expertmesh_topology::model::ModelSpec;
use half::bf16;
use tempfile::TempDir;

use crate::support::{self, Owned, bases, proj_row, read_checked, write_checkpoint};

/// The generated projections, the tensors written, and what `read_expert` made of them.
type Imported = support::Imported<Proj>;

const H: usize = 64;
const F: usize = 32;

/// One projection as the test generated it: codes `[rows][cols]` (0..16), bf16 scale bits and,
/// for asymmetric groups, zero points `[rows][groups]` (0..16, offset-binary as stored).
struct Proj {
    rows: usize,
    cols: usize,
    group: usize,
    codes: Vec<u8>,
    scales: Vec<u16>,
    zeros: Option<Vec<u8>>,
}

fn model(h: usize, f: usize, group: u32, scale_dtype: ScaleDtype) -> ModelSpec {
    support::model(h, f, support::quant(group as usize, scale_dtype, false))
}

fn asymmetric_model(h: usize, f: usize, group: u32) -> ModelSpec {
    support::model(h, f, support::quant(group as usize, ScaleDtype::Bf16, true))
}

fn random_proj(rng: &mut SplitMix64, rows: usize, cols: usize, group: usize, zeros: bool) -> Proj {
    let codes = (0..rows * cols).map(|_| rng.below(16) as u8).collect();
    let scales = (0..rows * cols / group)
        .map(|_| bf16::from_f64(rng.normal() * 0.01).to_bits())
        .collect();
    let zeros = zeros.then(|| {
        (0..rows * cols / group)
            .map(|_| rng.below(16) as u8)
            .collect()
    });
    Proj {
        rows,
        cols,
        group,
        codes,
        scales,
        zeros,
    }
}

/// The three tensors of `p` under prefix `base`, in compressed-tensors `pack-quantized` layout.
fn tensors(base: &str, p: &Proj) -> Vec<Owned> {
    let mut words = Vec::new();
    for chunk in p.codes.chunks_exact(8) {
        let w = chunk
            .iter()
            .enumerate()
            .fold(0u32, |w, (i, &c)| w | u32::from(c) << (4 * i));
        words.extend_from_slice(&(w as i32).to_le_bytes());
    }
    let scales = p.scales.iter().flat_map(|s| s.to_le_bytes()).collect();
    let shape = [p.rows as i64, p.cols as i64];
    let shape_bytes = shape.iter().flat_map(|d| d.to_le_bytes()).collect();
    let mut out = Vec::new();
    if let Some(zeros) = &p.zeros {
        // Packed along the rows: row `8w + i` of group `g` in bits `4i` of word `[w][g]`.
        let groups = p.cols / p.group;
        let mut words = vec![0u32; p.rows.div_ceil(8) * groups];
        for r in 0..p.rows {
            for g in 0..groups {
                words[(r / 8) * groups + g] |= u32::from(zeros[r * groups + g]) << (4 * (r % 8));
            }
        }
        out.push((
            format!("{base}.weight_zero_point"),
            Dtype::I32,
            vec![p.rows.div_ceil(8), groups],
            words
                .iter()
                .flat_map(|w| (*w as i32).to_le_bytes())
                .collect(),
        ));
    }
    out.extend([
        (
            format!("{base}.weight_packed"),
            Dtype::I32,
            vec![p.rows, p.cols / 8],
            words,
        ),
        (
            format!("{base}.weight_scale"),
            Dtype::BF16,
            vec![p.rows, p.cols / p.group],
            scales,
        ),
        (
            format!("{base}.weight_shape"),
            Dtype::I64,
            vec![2],
            shape_bytes,
        ),
    ]);
    out
}

/// Independent decoder from the format's definition: word `w` of a row holds columns
/// `8w..8w+8`, LSB first; a zero point word `[w][g]` holds rows `8w..8w+8` of group `g`;
/// `value = (code − zero) × bf16 scale`, zero 8 without zero points.
fn decode(
    packed: &[u8],
    scales: &[u8],
    zeros: Option<&[u8]>,
    [rows, cols, group]: [usize; 3],
) -> Vec<f32> {
    let word = |bytes: &[u8], i: usize| {
        i32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().unwrap()) as u32
    };
    let groups = cols / group;
    let mut out = Vec::with_capacity(rows * cols);
    for r in 0..rows {
        for c in 0..cols {
            let code = (word(packed, (r * cols + c) / 8) >> (4 * (c % 8))) & 0xF;
            let zero = zeros.map_or(8, |z| {
                (word(z, (r / 8) * groups + c / group) >> (4 * (r % 8))) & 0xF
            });
            let s = (r * groups + c / group) * 2;
            let scale = bf16::from_le_bytes([scales[s], scales[s + 1]]).to_f32();
            out.push((code as f32 - zero as f32) * scale);
        }
    }
    out
}

/// A checkpoint of one pack-quantized expert (group `group`, with zero points if `zeros`),
/// after `edit`; reads it with `spec`. Returns the generated projections and the result.
fn import(
    [h, f]: [usize; 2],
    group: usize,
    zeros: bool,
    spec: &ModelSpec,
    edit: impl FnOnce(&mut Vec<Owned>),
) -> Imported {
    let mut rng = SplitMix64::new(0x5eed + group as u64);
    let projs = vec![
        random_proj(&mut rng, f, h, group, zeros),
        random_proj(&mut rng, f, h, group, zeros),
        random_proj(&mut rng, h, f, group, zeros),
    ];
    let mut all: Vec<Owned> = bases()
        .iter()
        .zip(&projs)
        .flat_map(|(b, p)| tensors(b, p))
        .collect();
    edit(&mut all);
    let dir = TempDir::new().unwrap();
    write_checkpoint(dir.path(), &all, None);
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let result = read_checked(&ckpt, spec, Family::DeepseekV3, 0, ExpertRef::Routed(0));
    (projs, all, result)
}

fn round_trip(h: usize, f: usize, group: usize, zeros: bool) {
    let spec = if zeros {
        asymmetric_model(h, f, group as u32)
    } else {
        model(h, f, group as u32, ScaleDtype::Bf16)
    };
    let (projs, all, result) = import([h, f], group, zeros, &spec, |_| {});
    let (w, error) = result.unwrap();
    assert_eq!(error, 0.0);
    assert_eq!(w.spec(), spec.quant);
    let bytes = |suffix: &str, i: usize| {
        let name = format!("{}.{suffix}", bases()[i]);
        all.iter().find(|t| t.0 == name).map(|t| t.3.clone())
    };
    for (i, p) in projs.iter().enumerate() {
        let zero_bytes = bytes("weight_zero_point", i);
        assert_eq!(zero_bytes.is_some(), zeros);
        let expected = decode(
            &bytes("weight_packed", i).unwrap(),
            &bytes("weight_scale", i).unwrap(),
            zero_bytes.as_deref(),
            [p.rows, p.cols, group],
        );
        for r in 0..p.rows {
            let (m, n, row) = proj_row(&w, i, r, p.cols);
            for c in 0..p.cols {
                assert_eq!(m.code(n, c), p.codes[r * p.cols + c], "proj {i} ({r}, {c})");
                let zero = p
                    .zeros
                    .as_ref()
                    .map_or(8, |z| z[r * p.cols / group + c / group]);
                assert_eq!(m.zero(n, c / group), zero, "proj {i} ({r}, {c})");
                let want = expected[r * p.cols + c];
                assert_eq!(row[c].to_bits(), want.to_bits(), "proj {i} ({r}, {c})");
                assert_eq!(m.value(n, c).to_bits(), want.to_bits());
            }
            assert_eq!(
                m.row_scales(n),
                &p.scales[r * p.cols / group..][..p.cols / group]
            );
        }
    }
}

#[test]
fn pack_quantized_g32_round_trips_exactly() {
    round_trip(H, F, 32, false);
}

#[test]
fn pack_quantized_g64_and_g128_round_trip_exactly() {
    round_trip(128, 64, 64, false);
    round_trip(128, 128, 128, false);
}

/// Asymmetric groups (`symmetric: false`): each zero point lands in its group, and the values
/// are the checkpoint's `(code − zero) × scale`.
#[test]
fn asymmetric_pack_quantized_round_trips_exactly() {
    round_trip(H, F, 32, true);
    round_trip(128, 64, 64, true);
}

fn message(spec: &ModelSpec, edit: impl FnOnce(&mut Vec<Owned>)) -> String {
    import([H, F], 32, false, spec, edit)
        .2
        .unwrap_err()
        .to_string()
}

/// An act-order checkpoint's `weight_g_idx`: the trivial grouping is imported, a permuted one
/// refused naming the tensor (the format's groups are contiguous).
#[test]
fn act_order_groups_are_refused_and_trivial_ones_imported() {
    let spec = model(H, F, 32, ScaleDtype::Bf16);
    let g_idx = |groups: Vec<i32>| -> Owned {
        let name = format!("{}.weight_g_idx", bases()[0]);
        let bytes = groups.iter().flat_map(|g| g.to_le_bytes()).collect();
        (name, Dtype::I32, vec![H], bytes)
    };
    let trivial = (0..H as i32).map(|k| k / 32).collect();
    let (_, _, result) = import([H, F], 32, false, &spec, |all| all.push(g_idx(trivial)));
    assert_eq!(result.unwrap().1, 0.0);
    let permuted = (0..H as i32).rev().map(|k| k / 32).collect();
    let msg = message(&spec, |all| all.push(g_idx(permuted)));
    assert!(msg.contains("weight_g_idx"), "{msg}");
    assert!(msg.contains("act-order"), "{msg}");
}

/// Zero points in the checkpoint and the model's quant spec must agree, both ways.
#[test]
fn zero_points_and_the_quant_spec_must_agree() {
    let asym = import([H, F], 32, true, &model(H, F, 32, ScaleDtype::Bf16), |_| {});
    let msg = asym.2.unwrap_err().to_string();
    assert!(msg.contains("weight_zero_point"), "{msg}");
    assert!(msg.contains("zero_points to true"), "{msg}");
    let msg = message(&asymmetric_model(H, F, 32), |_| {});
    assert!(msg.contains("zero_points to false"), "{msg}");
}

#[test]
fn wrong_weight_shape_is_refused() {
    let name = format!("{}.weight_shape", bases()[1]);
    let msg = message(&model(H, F, 32, ScaleDtype::Bf16), |all| {
        let t = all.iter_mut().find(|t| t.0 == name).unwrap();
        t.3 = [F as i64, H as i64 + 8]
            .iter()
            .flat_map(|d| d.to_le_bytes())
            .collect();
    });
    assert!(msg.contains(&name), "{msg}");
    assert!(msg.contains("[32, 72]"), "{msg}");
}

#[test]
fn scale_shape_mismatch_is_refused() {
    let name = format!("{}.weight_scale", bases()[2]);
    let msg = message(&model(H, F, 32, ScaleDtype::Bf16), |all| {
        let t = all.iter_mut().find(|t| t.0 == name).unwrap();
        // One row too few: [H − 1, F / 32].
        t.2 = vec![H - 1, F / 32];
        t.3.truncate((H - 1) * 2);
    });
    assert!(msg.contains(&name), "{msg}");
    assert!(msg.contains("[63, 1]"), "{msg}");
}

#[test]
fn scale_group_mismatch_is_refused() {
    let name = format!("{}.weight_scale", bases()[0]);
    let msg = message(&model(H, F, 32, ScaleDtype::Bf16), |all| {
        let t = all.iter_mut().find(|t| t.0 == name).unwrap();
        t.2 = vec![F, H / 64];
        t.3.truncate(F * 2);
    });
    assert!(msg.contains(&name), "{msg}");
    assert!(msg.contains("group size 32"), "{msg}");
}

#[test]
fn f16_quant_spec_is_refused() {
    let msg = message(&model(H, F, 32, ScaleDtype::F16), |_| {});
    assert!(msg.contains("weight_scale"), "{msg}");
    assert!(msg.contains("scales are bf16"), "{msg}");
}

#[test]
fn mixed_formats_are_refused() {
    let msg = message(&model(H, F, 32, ScaleDtype::Bf16), |all| {
        all.retain(|t| !t.0.starts_with(&bases()[2]));
        all.push((
            format!("{}.weight", bases()[2]),
            Dtype::BF16,
            vec![H, F],
            vec![0; H * F * 2],
        ));
    });
    assert!(msg.contains("only some"), "{msg}");
}
