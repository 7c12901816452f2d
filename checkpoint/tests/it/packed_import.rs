//! Lossless import of compressed-tensors `pack-quantized` INT4 experts: every code and scale
//! bit round-trips, the dequantized values equal an independent decoder's, and malformed or
//! incompatible checkpoints are refused with errors naming the tensor.

use expertmesh_checkpoint::experts::{ExpertRef, Family, read_expert};
use expertmesh_checkpoint::safetensors::{Checkpoint, Dtype};
use expertmesh_quant::format::ScaleDtype;
use expertmesh_quant::synth::SplitMix64;
use expertmesh_topology::model::ModelSpec;
use half::bf16;
use tempfile::TempDir;

use crate::support::{self, Owned, bases, proj_row, write_checkpoint};

/// The generated projections, the tensors written, and what `read_expert` made of them.
type Imported = support::Imported<Proj>;

const H: usize = 64;
const F: usize = 32;

/// One projection as the test generated it: codes `[rows][cols]` (0..16) and bf16 scale bits.
struct Proj {
    rows: usize,
    cols: usize,
    group: usize,
    codes: Vec<u8>,
    scales: Vec<u16>,
}

fn model(h: usize, f: usize, group: u32, scale_dtype: ScaleDtype) -> ModelSpec {
    support::model(h, f, support::quant(group as usize, scale_dtype, false))
}

fn random_proj(rng: &mut SplitMix64, rows: usize, cols: usize, group: usize) -> Proj {
    let codes = (0..rows * cols).map(|_| rng.below(16) as u8).collect();
    let scales = (0..rows * cols / group)
        .map(|_| bf16::from_f64(rng.normal() * 0.01).to_bits())
        .collect();
    Proj {
        rows,
        cols,
        group,
        codes,
        scales,
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
    vec![
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
    ]
}

/// Independent decoder from the format's definition: word `w` of a row holds columns
/// `8w..8w+8`, LSB first; `value = (code − 8) × bf16 scale`.
fn decode(packed: &[u8], scales: &[u8], rows: usize, cols: usize, group: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(rows * cols);
    for r in 0..rows {
        for c in 0..cols {
            let i = (r * cols + c) / 8;
            let word = i32::from_le_bytes(packed[4 * i..4 * i + 4].try_into().unwrap()) as u32;
            let code = (word >> (4 * (c % 8))) & 0xF;
            let s = (r * (cols / group) + c / group) * 2;
            let scale = bf16::from_le_bytes([scales[s], scales[s + 1]]).to_f32();
            out.push((code as f32 - 8.0) * scale);
        }
    }
    out
}

/// A checkpoint of one pack-quantized expert (group `group`), after `edit`; reads it with
/// `spec`. Returns the generated projections and the result.
fn import(
    [h, f]: [usize; 2],
    group: usize,
    spec: &ModelSpec,
    edit: impl FnOnce(&mut Vec<Owned>),
) -> Imported {
    let mut rng = SplitMix64::new(0x5eed + group as u64);
    let projs = vec![
        random_proj(&mut rng, f, h, group),
        random_proj(&mut rng, f, h, group),
        random_proj(&mut rng, h, f, group),
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
    let result = read_expert(&ckpt, spec, Family::DeepseekV3, 0, ExpertRef::Routed(0));
    (projs, all, result)
}

fn round_trip(h: usize, f: usize, group: usize) {
    let spec = model(h, f, group as u32, ScaleDtype::Bf16);
    let (projs, all, result) = import([h, f], group, &spec, |_| {});
    let (w, error) = result.unwrap();
    assert_eq!(error, 0.0);
    assert_eq!(w.spec(), spec.quant);
    let bytes = |suffix: &str, i: usize| {
        let name = format!("{}.{suffix}", bases()[i]);
        all.iter().find(|t| t.0 == name).unwrap().3.clone()
    };
    for (i, p) in projs.iter().enumerate() {
        let expected = decode(
            &bytes("weight_packed", i),
            &bytes("weight_scale", i),
            p.rows,
            p.cols,
            group,
        );
        for r in 0..p.rows {
            let (m, n, row) = proj_row(&w, i, r, p.cols);
            for c in 0..p.cols {
                assert_eq!(m.code(n, c), p.codes[r * p.cols + c], "proj {i} ({r}, {c})");
                assert_eq!(m.zero(n, c / group), 8);
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
    round_trip(H, F, 32);
}

#[test]
fn pack_quantized_g64_and_g128_round_trip_exactly() {
    round_trip(128, 64, 64);
    round_trip(128, 128, 128);
}

fn message(spec: &ModelSpec, edit: impl FnOnce(&mut Vec<Owned>)) -> String {
    import([H, F], 32, spec, edit).2.unwrap_err().to_string()
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
