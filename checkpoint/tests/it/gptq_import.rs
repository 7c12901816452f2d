//! Lossless import of GPTQ (v1, v2, symmetric) and AWQ INT4 experts: every code, zero point and
//! scale bit round-trips and every dequantized value equals an independent f64 decoder's of the
//! checkpoint's own tensors; act-order, unsupported groups, unrepresentable zero points, mixed
//! formats and wrong shapes are refused naming the tensor; `source_quant` gives the spec that
//! makes each format's import lossless.

use expertmesh_checkpoint::experts::{
    ExpertError, ExpertRef, Family, expert_tensor_names, source_quant,
};
use expertmesh_checkpoint::safetensors::{Checkpoint, Dtype};
use expertmesh_quant::format::{QuantSpec, ScaleDtype};
use expertmesh_quant::synth::SplitMix64;
use half::{bf16, f16};
use tempfile::TempDir;

use crate::support::{self, Owned, bases, model, proj_row, quant, read_checked, write_checkpoint};

/// The generated projections, the tensors written, and what `read_expert` made of them.
type Imported = support::Imported<Proj>;

/// AutoAWQ's order, written out here independently of the crate.
const ORDER: [usize; 8] = [0, 2, 4, 6, 1, 3, 5, 7];

/// Which checkpoint layout a test writes.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Fmt {
    /// GPTQ, checkpoint_format "gptq" (zeros stored minus one).
    V1,
    /// GPTQ, checkpoint_format "gptq_v2".
    V2,
    /// AutoAWQ GEMM.
    Awq,
}

/// One projection as the test generated it (weight `[rows = out, cols = in]`): codes
/// `[rows][cols]`, zero points `[groups][rows]` (the real zero point, 0..=16), f16 scale bits
/// `[groups][rows]`.
struct Proj {
    rows: usize,
    cols: usize,
    group: usize,
    codes: Vec<u8>,
    zeros: Vec<u8>,
    scales: Vec<u16>,
}

/// What a test writes: sizes, group, layout, zero points, config, and edits.
struct Case {
    h: usize,
    f: usize,
    group: usize,
    fmt: Fmt,
    /// Every zero point 8 (and `sym: true` in the config).
    sym: bool,
    /// Write `config.json` with a `quantization_config`.
    config: bool,
    /// Write a trivial `g_idx` (GPTQ only).
    g_idx: bool,
    seed: u64,
}

impl Case {
    fn new(fmt: Fmt, group: usize) -> Case {
        let (h, f) = if group == 128 { (128, 128) } else { (64, 32) };
        Case {
            h,
            f,
            group,
            fmt,
            sym: false,
            config: true,
            g_idx: false,
            seed: 7,
        }
    }
}

fn random_proj(rng: &mut SplitMix64, [rows, cols]: [usize; 2], group: usize, c: &Case) -> Proj {
    let codes = (0..rows * cols).map(|_| rng.below(16) as u8).collect();
    let groups = cols / group;
    let zeros = (0..groups * rows)
        .map(|_| match (c.sym, c.fmt) {
            (true, _) => 8,
            // v1 cannot store zero point 0 (it would be stored as −1).
            (false, Fmt::V1) => 1 + rng.below(15) as u8,
            (false, _) => rng.below(16) as u8,
        })
        .collect();
    let scales = (0..groups * rows)
        .map(|_| f16::from_f64(rng.normal() * 0.01).to_bits())
        .collect();
    Proj {
        rows,
        cols,
        group,
        codes,
        zeros,
        scales,
    }
}

fn words_bytes(words: &[u32]) -> Vec<u8> {
    words
        .iter()
        .flat_map(|w| (*w as i32).to_le_bytes())
        .collect()
}

/// The zero point as `fmt` stores it (v1: minus one; a zero point of 16 is stored as 15).
fn stored_zero(fmt: Fmt, z: u8) -> u32 {
    u32::from(if fmt == Fmt::V1 { z - 1 } else { z })
}

/// The tensors of `p` under prefix `base` in layout `fmt`.
fn tensors(base: &str, p: &Proj, fmt: Fmt, g_idx: bool) -> Vec<Owned> {
    let (rows, cols, groups) = (p.rows, p.cols, p.cols / p.group);
    // The output-packed nibble of output 8w + j: GPTQ j, AWQ the i with ORDER[i] == j.
    let slot = |j: usize| match fmt {
        Fmt::Awq => ORDER.iter().position(|&o| o == j).unwrap(),
        _ => j,
    };
    let mut qzeros = vec![0u32; groups * rows / 8];
    for g in 0..groups {
        for o in 0..rows {
            let z = stored_zero(fmt, p.zeros[g * rows + o]);
            qzeros[g * rows / 8 + o / 8] |= z << (4 * slot(o % 8));
        }
    }
    let (qweight, qshape) = if fmt == Fmt::Awq {
        let mut q = vec![0u32; cols * rows / 8];
        for k in 0..cols {
            for o in 0..rows {
                q[k * rows / 8 + o / 8] |= u32::from(p.codes[o * cols + k]) << (4 * slot(o % 8));
            }
        }
        (q, vec![cols, rows / 8])
    } else {
        let mut q = vec![0u32; cols / 8 * rows];
        for k in 0..cols {
            for o in 0..rows {
                q[(k / 8) * rows + o] |= u32::from(p.codes[o * cols + k]) << (4 * (k % 8));
            }
        }
        (q, vec![cols / 8, rows])
    };
    let scales = p.scales.iter().flat_map(|s| s.to_le_bytes()).collect();
    let mut out = vec![
        (
            format!("{base}.qweight"),
            Dtype::I32,
            qshape,
            words_bytes(&qweight),
        ),
        (
            format!("{base}.qzeros"),
            Dtype::I32,
            vec![groups, rows / 8],
            words_bytes(&qzeros),
        ),
        (
            format!("{base}.scales"),
            Dtype::F16,
            vec![groups, rows],
            scales,
        ),
    ];
    if g_idx {
        let idx: Vec<u8> = (0..cols)
            .flat_map(|k| ((k / p.group) as i32).to_le_bytes())
            .collect();
        out.push((format!("{base}.g_idx"), Dtype::I32, vec![cols], idx));
    }
    out
}

fn config_json(c: &Case) -> serde_json::Value {
    let (method, format) = match c.fmt {
        Fmt::V1 => ("gptq", Some("gptq")),
        Fmt::V2 => ("gptq", Some("gptq_v2")),
        Fmt::Awq => ("awq", None),
    };
    let mut q = serde_json::json!({
        "quant_method": method, "bits": 4, "group_size": c.group, "desc_act": false, "sym": c.sym,
    });
    if let Some(f) = format {
        q["checkpoint_format"] = f.into();
    }
    if c.fmt == Fmt::Awq {
        q = serde_json::json!({
            "quant_method": "awq", "bits": 4, "group_size": c.group, "zero_point": true,
            "version": "gemm",
        });
    }
    serde_json::json!({ "model_type": "deepseek_v3", "quantization_config": q })
}

/// The projections and tensors of one expert of case `c`.
fn generate(c: &Case) -> (Vec<Proj>, Vec<Owned>) {
    let mut rng = SplitMix64::new(c.seed * 1000 + c.group as u64);
    let shapes = [[c.f, c.h], [c.f, c.h], [c.h, c.f]];
    let projs: Vec<Proj> = shapes
        .iter()
        .map(|&s| random_proj(&mut rng, s, c.group, c))
        .collect();
    let all = bases()
        .iter()
        .zip(&projs)
        .flat_map(|(b, p)| tensors(b, p, c.fmt, c.g_idx))
        .collect();
    (projs, all)
}

/// Writes case `c` (after `edit`) and reads its expert with the model quant `q`.
fn import(c: &Case, q: QuantSpec, edit: impl FnOnce(&mut Vec<Owned>)) -> Imported {
    let (projs, mut all) = generate(c);
    edit(&mut all);
    let dir = TempDir::new().unwrap();
    write_checkpoint(dir.path(), &all, c.config.then(|| config_json(c)).as_ref());
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let spec = model(c.h, c.f, q);
    let result = read_checked(&ckpt, &spec, Family::DeepseekV3, 0, ExpertRef::Routed(0));
    (projs, all, result)
}

/// Independent f64 decoder of one projection's tensors, from the layouts' definitions:
/// `[rows][cols]` values `scale × (q − zero)`.
fn decode(all: &[Owned], base: &str, fmt: Fmt, [rows, cols]: [usize; 2]) -> Vec<f64> {
    let get = |suffix: &str| {
        &all.iter()
            .find(|t| t.0 == format!("{base}.{suffix}"))
            .unwrap()
            .3
    };
    let (qweight, qzeros, scales) = (get("qweight"), get("qzeros"), get("scales"));
    let groups = scales.len() / 2 / rows;
    let group = cols / groups;
    let word =
        |b: &[u8], i: usize| i32::from_le_bytes(b[4 * i..4 * i + 4].try_into().unwrap()) as u32;
    let nib = |w: u32, i: usize| f64::from((w >> (4 * i)) & 0xF);
    let mut out = Vec::with_capacity(rows * cols);
    for o in 0..rows {
        for k in 0..cols {
            let g = k / group;
            let (q, z) = match fmt {
                Fmt::Awq => {
                    let i = ORDER.iter().position(|&j| j == o % 8).unwrap();
                    let q = nib(word(qweight, k * rows / 8 + o / 8), i);
                    (q, nib(word(qzeros, g * rows / 8 + o / 8), i))
                }
                _ => {
                    let q = nib(word(qweight, (k / 8) * rows + o), k % 8);
                    let z = nib(word(qzeros, g * rows / 8 + o / 8), o % 8);
                    (q, if fmt == Fmt::V1 { z + 1.0 } else { z })
                }
            };
            let s = 2 * (g * rows + o);
            let scale = f16::from_le_bytes([scales[s], scales[s + 1]]).to_f64();
            out.push(scale * (q - z));
        }
    }
    out
}

/// Imports case `c` with model quant `q` and checks every code, zero point, scale and value.
fn round_trip(c: &Case, q: QuantSpec) {
    let (projs, all, result) = import(c, q, |_| {});
    let (w, error) = result.unwrap();
    assert_eq!(error, 0.0);
    assert_eq!(w.spec(), q);
    for (i, p) in projs.iter().enumerate() {
        let expected = decode(&all, &bases()[i], c.fmt, [p.rows, p.cols]);
        for r in 0..p.rows {
            let (m, n, row) = proj_row(&w, i, r, p.cols);
            for k in 0..p.cols {
                let g = k / p.group;
                assert_eq!(m.code(n, k), p.codes[r * p.cols + k], "proj {i} ({r}, {k})");
                assert_eq!(m.zero(n, g), p.zeros[g * p.rows + r], "proj {i} ({r}, {g})");
                assert_eq!(m.row_scales(n)[g], p.scales[g * p.rows + r]);
                let want = expected[r * p.cols + k];
                assert_eq!(
                    f64::from(m.value(n, k)).to_bits(),
                    want.to_bits(),
                    "({r}, {k})"
                );
                assert_eq!(f64::from(row[k]).to_bits(), want.to_bits());
            }
        }
    }
}

#[test]
fn gptq_v1_round_trips_exactly() {
    for group in [32, 128] {
        round_trip(
            &Case::new(Fmt::V1, group),
            quant(group, ScaleDtype::F16, true),
        );
    }
}

#[test]
fn gptq_v2_round_trips_exactly() {
    for group in [32, 128] {
        round_trip(
            &Case::new(Fmt::V2, group),
            quant(group, ScaleDtype::F16, true),
        );
    }
}

#[test]
fn awq_round_trips_exactly() {
    for group in [32, 128] {
        round_trip(
            &Case::new(Fmt::Awq, group),
            quant(group, ScaleDtype::F16, true),
        );
    }
}

#[test]
fn symmetric_gptq_imports_without_zero_points() {
    for fmt in [Fmt::V1, Fmt::V2] {
        let c = Case {
            sym: true,
            ..Case::new(fmt, 32)
        };
        round_trip(&c, quant(32, ScaleDtype::F16, false));
        round_trip(&c, quant(32, ScaleDtype::F16, true));
    }
}

#[test]
fn layout_is_detected_by_shape_without_a_config() {
    for fmt in [Fmt::V1, Fmt::Awq] {
        let c = Case {
            config: false,
            seed: 11,
            ..Case::new(fmt, 32)
        };
        round_trip(&c, quant(32, ScaleDtype::F16, true));
    }
}

#[test]
fn trivial_g_idx_is_accepted() {
    for group in [32, 128] {
        let c = Case {
            g_idx: true,
            ..Case::new(Fmt::V1, group)
        };
        round_trip(&c, quant(group, ScaleDtype::F16, true));
    }
}

/// The error message of importing case `c` with model quant `q` after `edit`.
fn message(c: &Case, q: QuantSpec, edit: impl FnOnce(&mut Vec<Owned>)) -> String {
    import(c, q, edit).2.unwrap_err().to_string()
}

fn g32() -> QuantSpec {
    quant(32, ScaleDtype::F16, true)
}

fn tensor_mut<'a>(all: &'a mut [Owned], name: &str) -> &'a mut Owned {
    all.iter_mut().find(|t| t.0 == name).unwrap()
}

#[test]
fn act_order_g_idx_is_refused() {
    let c = Case {
        g_idx: true,
        ..Case::new(Fmt::V1, 32)
    };
    let name = format!("{}.g_idx", bases()[1]);
    let msg = message(&c, g32(), |all| {
        let t = tensor_mut(all, &name);
        // desc_act: input rows in decreasing-activation order, groups no longer contiguous.
        let idx: Vec<i32> = (0..H_G32)
            .map(|k| ((k * 7 + 3) % H_G32 / 32) as i32)
            .collect();
        t.3 = idx.iter().flat_map(|g| g.to_le_bytes()).collect();
    });
    assert!(msg.contains(&name), "{msg}");
    assert!(msg.contains("act-order"), "{msg}");
    assert!(msg.contains("desc_act"), "{msg}");
}

/// Hidden size of the g32 cases.
const H_G32: usize = 64;

#[test]
fn unsupported_group_sizes_are_refused() {
    for (group, h, f) in [(16, 64, 32), (48, 96, 96)] {
        let c = Case {
            h,
            f,
            ..Case::new(Fmt::V2, group)
        };
        let msg = message(&c, g32(), |_| {});
        assert!(msg.contains(&format!("{}.scales", bases()[0])), "{msg}");
        assert!(msg.contains(&format!("groups of {group}")), "{msg}");
        assert!(msg.contains("32, 64 or 128"), "{msg}");
    }
}

#[test]
fn group_other_than_the_models_is_refused() {
    let msg = message(&Case::new(Fmt::Awq, 128), g32(), |_| {});
    assert!(msg.contains(&format!("{}.scales", bases()[0])), "{msg}");
    assert!(msg.contains("group size to 128"), "{msg}");
}

#[test]
fn scale_dtype_other_than_the_models_is_refused() {
    let msg = message(
        &Case::new(Fmt::V2, 32),
        quant(32, ScaleDtype::Bf16, true),
        |_| {},
    );
    assert!(msg.contains(".scales"), "{msg}");
    assert!(msg.contains("scales are f16"), "{msg}");
}

#[test]
fn asymmetric_zeros_need_zero_points() {
    let msg = message(
        &Case::new(Fmt::V1, 32),
        quant(32, ScaleDtype::F16, false),
        |_| {},
    );
    assert!(msg.contains(".qzeros"), "{msg}");
    assert!(msg.contains("zero_points"), "{msg}");
    // What a converter's user can do when the spec was inferred: say `sym` in the config.
    assert!(msg.contains("\"sym\": false"), "{msg}");
}

#[test]
fn zero_point_16_under_v1_is_refused() {
    let c = Case::new(Fmt::V1, 32);
    let name = format!("{}.qzeros", bases()[2]);
    let msg = message(&c, g32(), |all| {
        // Stored 15 in the first nibble: zero point 16 under checkpoint_format "gptq".
        tensor_mut(all, &name).3[0] |= 0x0F;
    });
    assert!(msg.contains(&name), "{msg}");
    assert!(msg.contains("16"), "{msg}");
    // The same stored value is zero point 15 under gptq_v2, and imports.
    let (_, _, result) = import(&Case::new(Fmt::V2, 32), g32(), |all| {
        tensor_mut(all, &name).3[0] |= 0x0F;
    });
    assert_eq!(result.unwrap().1, 0.0);
}

#[test]
fn mixed_formats_within_an_expert_are_refused() {
    // Gate GPTQ, up AWQ, no config to force one layout: the shapes disagree.
    let c = Case {
        config: false,
        ..Case::new(Fmt::V1, 32)
    };
    let msg = message(&c, g32(), |all| {
        let awq = Case {
            config: false,
            ..Case::new(Fmt::Awq, 32)
        };
        let up = &bases()[1];
        all.retain(|t| !t.0.starts_with(up.as_str()));
        all.extend(
            generate(&awq)
                .1
                .into_iter()
                .filter(|t| t.0.starts_with(up.as_str())),
        );
    });
    assert!(msg.contains(&format!("{}.qweight", bases()[1])), "{msg}");
    assert!(msg.contains("share one format"), "{msg}");
    // Down stored as a float weight.
    let msg = message(&Case::new(Fmt::V1, 32), g32(), |all| {
        let down = &bases()[2];
        all.retain(|t| !t.0.starts_with(down.as_str()));
        all.push((
            format!("{down}.weight"),
            Dtype::BF16,
            vec![64, 32],
            vec![0; 64 * 32 * 2],
        ));
    });
    assert!(msg.contains("only some"), "{msg}");
}

#[test]
fn wrong_shapes_are_refused_naming_the_tensor() {
    let c = Case::new(Fmt::V1, 32);
    // qweight laid out as AWQ while the config says GPTQ.
    let name = format!("{}.qweight", bases()[0]);
    let msg = message(&c, g32(), |all| tensor_mut(all, &name).2 = vec![64, 4]);
    assert!(msg.contains(&name) && msg.contains("[8, 32]"), "{msg}");
    // qzeros one group short.
    let name = format!("{}.qzeros", bases()[2]);
    let msg = message(&c, g32(), |all| {
        let t = tensor_mut(all, &name);
        t.2 = vec![0, 8];
        t.3.clear();
    });
    assert!(msg.contains(&name) && msg.contains("[1, 8]"), "{msg}");
    // scales for the wrong number of outputs.
    let name = format!("{}.scales", bases()[1]);
    let msg = message(&c, g32(), |all| {
        let t = tensor_mut(all, &name);
        t.2 = vec![2, 16];
        t.3.truncate(2 * 16 * 2);
    });
    assert!(msg.contains(&name), "{msg}");
    // Neither layout, without a config.
    let c = Case { config: false, ..c };
    let name = format!("{}.qweight", bases()[2]);
    let msg = message(&c, g32(), |all| {
        let t = tensor_mut(all, &name);
        t.2 = vec![2, 64];
        t.3.truncate(2 * 64 * 4);
    });
    assert!(msg.contains(&name) && msg.contains("neither"), "{msg}");
}

#[test]
fn unreadable_configs_are_refused() {
    let c = Case::new(Fmt::V1, 32);
    let (_, all) = generate(&c);
    let spec = model(c.h, c.f, g32());
    let cases = [
        (
            serde_json::json!({"quant_method": "gptq", "bits": 8}),
            "bits 8",
        ),
        (
            serde_json::json!({"quant_method": "gptq", "checkpoint_format": "marlin"}),
            "marlin",
        ),
        (
            serde_json::json!({"quant_method": "awq", "version": "gemv"}),
            "gemv",
        ),
    ];
    for (q, needle) in cases {
        let dir = TempDir::new().unwrap();
        let config = serde_json::json!({ "quantization_config": q });
        write_checkpoint(dir.path(), &all, Some(&config));
        let ckpt = Checkpoint::open(dir.path()).unwrap();
        let e = read_checked(&ckpt, &spec, Family::DeepseekV3, 0, ExpertRef::Routed(0));
        let msg = e.unwrap_err().to_string();
        assert!(msg.contains("config.json") && msg.contains(needle), "{msg}");
    }
}

/// A checkpoint quantized by a method the converter does not read is refused by `source_quant`
/// (before anything is written), naming the method and what to convert from, not blamed on a
/// tensor's shape; so is an MLX-quantized one (its `quantization` key).
#[test]
fn checkpoints_of_methods_not_read_are_refused_by_name() {
    let c = Case::new(Fmt::V1, 32);
    let (_, all) = generate(&c);
    for (config, needle) in [
        (
            serde_json::json!({"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": true}}),
            "\"bitsandbytes\" is not a format",
        ),
        (
            serde_json::json!({"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4"}}),
            "\"modelopt\" is not a format",
        ),
        (
            serde_json::json!({"quantization": {"group_size": 64, "bits": 4}}),
            "MLX-quantized",
        ),
    ] {
        let e = source_quant_of(&c, &all, Some(config), g32()).unwrap_err();
        let msg = e.to_string();
        assert!(
            matches!(e, ExpertError::Config { .. })
                && msg.contains("config.json")
                && msg.contains(needle)
                && msg.contains("BF16 checkpoint"),
            "{msg}"
        );
    }
}

/// Every MoE layer's experts are looked at before anything is written: quantized layers of
/// different settings are refused naming both layers; a layer stored in BF16 beside quantized
/// ones is quantized to their spec (whichever layer comes first).
#[test]
fn every_layer_is_read_for_the_source_spec() {
    let c128 = Case::new(Fmt::Awq, 128);
    let c32 = Case { group: 32, ..c128 };
    let (h, f) = (c128.h, c128.f);
    let two_layers = |q: QuantSpec| {
        let mut m = model(h, f, q);
        m.num_layers = 2;
        m
    };
    let in_layer_1 = |tensors: Vec<Owned>| -> Vec<Owned> {
        tensors
            .into_iter()
            .map(|(n, d, sh, b)| (n.replace("model.layers.0.", "model.layers.1."), d, sh, b))
            .collect()
    };
    let open = |tensors: &[Owned], config: &serde_json::Value| {
        let dir = TempDir::new().unwrap();
        write_checkpoint(dir.path(), tensors, Some(config));
        let ckpt = Checkpoint::open(dir.path()).unwrap();
        let got = source_quant(&ckpt, &two_layers(g32()), Family::DeepseekV3);
        drop(dir);
        got
    };
    // Layer 0 in groups of 32, layer 1 in groups of 128.
    let (_, mut all) = generate(&c32);
    all.extend(in_layer_1(generate(&c128).1));
    let e = open(&all, &config_json(&c32)).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("mixes quantization settings")
            && msg.contains("layer 1")
            && msg.contains("layer 0"),
        "{msg}"
    );
    // Layer 0 in BF16, layer 1 quantized: layer 1's spec.
    let (_, quantized) = generate(&c128);
    let mut all = in_layer_1(quantized);
    for (name, shape) in bases().iter().zip([[f, h], [f, h], [h, f]]) {
        let bytes = vec![0u8; shape[0] * shape[1] * 2];
        all.push((format!("{name}.weight"), Dtype::BF16, shape.to_vec(), bytes));
    }
    let got = open(&all, &config_json(&c128)).unwrap();
    assert_eq!(got.group_size, 128);
}

/// `source_quant` of a checkpoint of `tensors` (+ `config`) for a model with quant `q`.
fn source_quant_of(
    c: &Case,
    tensors: &[Owned],
    config: Option<serde_json::Value>,
    q: QuantSpec,
) -> Result<QuantSpec, ExpertError> {
    let dir = TempDir::new().unwrap();
    write_checkpoint(dir.path(), tensors, config.as_ref());
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    source_quant(&ckpt, &model(c.h, c.f, q), Family::DeepseekV3)
}

#[test]
fn source_quant_of_gptq_and_awq() {
    let cases = [
        (Case::new(Fmt::V1, 128), true),
        (Case::new(Fmt::V2, 32), true),
        (Case::new(Fmt::Awq, 128), true),
        (
            Case {
                sym: true,
                ..Case::new(Fmt::V1, 32)
            },
            false,
        ),
        (
            Case {
                sym: true,
                config: false,
                ..Case::new(Fmt::V1, 32)
            },
            false,
        ),
    ];
    for (c, zero_points) in cases {
        let (_, all) = generate(&c);
        let config = c.config.then(|| config_json(&c));
        let got = source_quant_of(&c, &all, config, QuantSpec::G32_BF16).unwrap();
        let want = quant(c.group, ScaleDtype::F16, zero_points);
        assert_eq!(got, want, "{:?} g{}", c.fmt, c.group);
        // Under that spec the import is lossless.
        round_trip(&c, got);
    }
}

#[test]
fn source_quant_of_sym_awq_keeps_zero_points() {
    let c = Case {
        sym: true,
        ..Case::new(Fmt::Awq, 32)
    };
    let (_, all) = generate(&c);
    let got = source_quant_of(&c, &all, Some(config_json(&c)), QuantSpec::G32_BF16).unwrap();
    assert_eq!(got, quant(32, ScaleDtype::F16, true));
}

#[test]
fn source_quant_refuses_unsupported_groups() {
    let c = Case {
        h: 96,
        f: 96,
        ..Case::new(Fmt::V2, 48)
    };
    let (_, all) = generate(&c);
    let msg = source_quant_of(&c, &all, Some(config_json(&c)), g32())
        .unwrap_err()
        .to_string();
    assert!(msg.contains(&format!("{}.scales", bases()[0])), "{msg}");
}

/// A compressed-tensors `pack-quantized` projection `[rows, cols]` (codes all 8, scales one)
/// with `dtype` scales of group `group`.
fn pack_quantized(base: &str, [rows, cols]: [usize; 2], group: usize, dtype: Dtype) -> Vec<Owned> {
    let one = match dtype {
        Dtype::BF16 => bf16::ONE.to_bits(),
        _ => f16::ONE.to_bits(),
    };
    let shape: Vec<u8> = [rows as i64, cols as i64]
        .iter()
        .flat_map(|d| d.to_le_bytes())
        .collect();
    vec![
        (
            format!("{base}.weight_packed"),
            Dtype::I32,
            vec![rows, cols / 8],
            (0..rows * cols / 8)
                .flat_map(|_| 0x8888_8888u32.to_le_bytes())
                .collect(),
        ),
        (
            format!("{base}.weight_scale"),
            dtype,
            vec![rows, cols / group],
            (0..rows * cols / group)
                .flat_map(|_| one.to_le_bytes())
                .collect(),
        ),
        (format!("{base}.weight_shape"), Dtype::I64, vec![2], shape),
    ]
}

#[test]
fn source_quant_of_pack_quantized() {
    for (group, dtype, scale_dtype) in [
        (32, Dtype::BF16, ScaleDtype::Bf16),
        (128, Dtype::F16, ScaleDtype::F16),
    ] {
        let c = Case::new(Fmt::V1, group);
        let shapes = [[c.f, c.h], [c.f, c.h], [c.h, c.f]];
        let all: Vec<Owned> = bases()
            .iter()
            .zip(shapes)
            .flat_map(|(b, s)| pack_quantized(b, s, group, dtype))
            .collect();
        let got = source_quant_of(&c, &all, None, quant(64, ScaleDtype::F16, true)).unwrap();
        assert_eq!(got, quant(group, scale_dtype, false));
        // Under that spec the expert imports with no error.
        let dir = TempDir::new().unwrap();
        write_checkpoint(dir.path(), &all, None);
        let ckpt = Checkpoint::open(dir.path()).unwrap();
        let spec = model(c.h, c.f, got);
        let (_, error) =
            read_checked(&ckpt, &spec, Family::DeepseekV3, 0, ExpertRef::Routed(0)).unwrap();
        assert_eq!(error, 0.0);
    }
}

#[test]
fn source_quant_of_pack_quantized_refuses_mixed_groups() {
    let c = Case::new(Fmt::V1, 32);
    let shapes = [[c.f, c.h], [c.f, c.h], [c.h, c.f]];
    let groups = [32, 64, 32];
    let all: Vec<Owned> = (0..3)
        .flat_map(|i| pack_quantized(&bases()[i], shapes[i], groups[i], Dtype::BF16))
        .collect();
    let msg = source_quant_of(&c, &all, None, g32())
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains(&format!("{}.weight_scale", bases()[1])),
        "{msg}"
    );
}

#[test]
fn source_quant_of_a_float_checkpoint_is_the_models() {
    let c = Case::new(Fmt::V1, 32);
    let names = expert_tensor_names(Family::DeepseekV3, 0, ExpertRef::Routed(0)).unwrap();
    let shapes = [[c.f, c.h], [c.f, c.h], [c.h, c.f]];
    let all: Vec<Owned> = names
        .iter()
        .zip(shapes)
        .map(|(n, [r, k])| (n.clone(), Dtype::BF16, vec![r, k], vec![0; r * k * 2]))
        .collect();
    for q in [QuantSpec::G32_BF16, quant(128, ScaleDtype::F16, true)] {
        assert_eq!(source_quant_of(&c, &all, None, q).unwrap(), q);
    }
}

/// The FP8 block a quantization config names, as transformers and compressed-tensors write
/// it: `weight_block_size` (null counts as absent, whole floats are whole numbers), else the
/// config groups' `block_structure` (a list or `"AxB"`; groups that name none are skipped);
/// malformed values and groups naming different blocks are refused naming what was written.
#[test]
fn fp8_blocks_are_read_as_configs_write_them() {
    use expertmesh_checkpoint::gptq_import::read_quant_config;
    use serde_json::json;
    let groups = |blocks: &[serde_json::Value]| {
        let g: serde_json::Map<String, serde_json::Value> = blocks
            .iter()
            .enumerate()
            .map(|(i, b)| {
                let weights = json!({"num_bits": 8, "type": "float", "block_structure": b});
                (
                    format!("group_{i}"),
                    json!({"targets": ["Linear"], "weights": weights}),
                )
            })
            .collect();
        json!({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": g})
    };
    let fp8 = |b: serde_json::Value| json!({"quant_method": "fp8", "weight_block_size": b});
    let read = |q: serde_json::Value| {
        let dir = TempDir::new().unwrap();
        let config = json!({"model_type": "deepseek_v3", "quantization_config": q});
        std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
        read_quant_config(dir.path()).unwrap().fp8_block()
    };
    assert_eq!(read(fp8(json!([64, 32]))).unwrap(), Some([64, 32]));
    assert_eq!(read(fp8(json!([128.0, 128.0]))).unwrap(), Some([128, 128]));
    assert_eq!(read(fp8(json!(null))).unwrap(), None);
    assert_eq!(read(json!({"quant_method": "fp8"})).unwrap(), None);
    assert_eq!(read(groups(&[json!("128x128")])).unwrap(), Some([128, 128]));
    assert_eq!(
        read(groups(&[json!(null), json!([32, 16])])).unwrap(),
        Some([32, 16])
    );
    assert_eq!(read(groups(&[json!(null)])).unwrap(), None);
    for (q, named) in [
        (fp8(json!([0, 128])), "weight_block_size [0,128]"),
        (fp8(json!([128])), "weight_block_size [128]"),
        (fp8(json!("big")), "weight_block_size \"big\""),
        (
            groups(&[json!([128, 128]), json!([64, 64])]),
            "group_0: [128,128], group_1: [64,64]",
        ),
    ] {
        let e = read(q).unwrap_err().to_string();
        assert!(e.contains(named) && e.contains("config.json"), "{e}");
    }
}
