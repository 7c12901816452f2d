//! Checks of the Hugging Face test support (`tests/hf_support`) before end-to-end converter
//! tests rely on it: every family's tiny `config.json` is accepted by `load_hf_model` with the
//! sizes written; the safetensors files (single and sharded) hold every expected tensor with
//! its dtype and shape; the values recorded as stored are what the files say (and what
//! `read_expert` reads: exactly for pack-quantized, GPTQ and AWQ, closely after INT4
//! quantization otherwise); Qwen2-MoE's gated shared expert is written and referenced as
//! transformers defines it; and the f64 MoE reference gives the hand-computed routing and
//! outputs.

use crate::hf_support::reference::{
    DenseExpert, MoeBlock, Scoring, block_from_tiny, moe_block_f64, route_f64, route_tokens,
    sigmoid, silu,
};
use crate::hf_support::tiny::{
    MODEL_TYPES, QWEN2_SHARED_MULT, TinyCheckpoint, TinySpec, WeightFormat, bias_name,
    dense_mlp_names, random_tokens, router_name, write_tiny_checkpoint,
};
use expertmesh_checkpoint::experts::{
    ExpertRef, Family, expert_tensor_names, read_expert, source_quant,
};
use expertmesh_checkpoint::hf_config::load_hf_model;
use expertmesh_checkpoint::safetensors::{Checkpoint, Dtype, INDEX_FILE, SINGLE_FILE};
use expertmesh_quant::format::{QuantSpec, ScaleDtype};
use expertmesh_topology::model::Scoring as SpecScoring;
use half::{bf16, f16};

/// silu(1) = 1 / (1 + e^-1), to 16 digits.
const SILU_1: f64 = 0.731_058_578_630_004_9;

fn write(spec: &TinySpec) -> (tempfile::TempDir, TinyCheckpoint) {
    let tmp = tempfile::tempdir().unwrap();
    let ck = write_tiny_checkpoint(&tmp.path().join("tiny"), spec);
    (tmp, ck)
}

#[test]
fn every_family_config_loads_with_the_sizes_written() {
    for mt in MODEL_TYPES {
        for format in WeightFormat::ALL {
            let spec = TinySpec::for_model_type(mt).with_dtype(format);
            let (_tmp, ck) = write(&spec);
            let m = load_hf_model(&ck.dir)
                .unwrap_or_else(|e| panic!("{mt} {format:?}: {e}\n{:#}", ck.config));
            let what = format!("{mt} {format:?}");
            assert_eq!(m.num_layers, 3, "{what}");
            assert_eq!(m.hidden, 64, "{what}");
            assert_eq!(m.routed_experts, 8, "{what}");
            assert_eq!(m.top_k, 2, "{what}");
            assert_eq!(m.moe_intermediate, 32, "{what}");
            assert_eq!(m.first_dense_layers as usize, spec.first_dense, "{what}");
            assert_eq!(m.moe_layer_step, 1, "{what}");
            let ids: Vec<usize> = m.moe_layer_ids().iter().map(|&l| l as usize).collect();
            assert_eq!(ids, spec.moe_layers(), "{what}");
            assert_eq!(m.shared_experts, u32::from(spec.shared), "{what}");
            assert_eq!(
                m.shared_intermediate as usize,
                spec.shared_inter(),
                "{what}"
            );
            let scoring = match spec.family {
                Family::DeepseekV3 | Family::Glm4Moe => SpecScoring::SigmoidBias,
                Family::Mixtral => SpecScoring::TopkSoftmax,
                _ => SpecScoring::Softmax,
            };
            assert_eq!(m.scoring, scoring, "{what}");
            let norm = spec.norm_topk_prob || spec.family == Family::Mixtral;
            assert_eq!(m.norm_topk_prob, norm, "{what}");
            if spec.is_sigmoid() {
                assert_eq!(m.routed_scaling_factor, spec.routed_scaling_factor as f32);
                assert_eq!(m.n_group as usize, spec.n_group, "{what}");
                assert_eq!(m.topk_group as usize, spec.topk_group, "{what}");
            }
        }
    }
    // The defaults have the shapes of their real models.
    let ds = TinySpec::for_model_type("deepseek_v3");
    assert_eq!((ds.n_group, ds.topk_group, ds.first_dense), (4, 2, 1));
    assert!(ds.shared && ds.nonzero_bias);
    assert_eq!(TinySpec::new(Family::DeepseekV3), ds);
    assert_eq!(
        TinySpec::for_model_type("kimi_k2").family,
        Family::DeepseekV3
    );
    assert!(!TinySpec::new(Family::Qwen2Moe).shared);
}

/// Every tensor the spec implies, derived here from the family layouts (not from the writer):
/// `(name, dtype, shape)`.
fn expected_tensors(spec: &TinySpec) -> Vec<(String, Dtype, Vec<usize>)> {
    let (h, e) = (spec.hidden, spec.routed_experts);
    let float = |f: WeightFormat| match f {
        WeightFormat::F16 => Dtype::F16,
        WeightFormat::F32 => Dtype::F32,
        _ => Dtype::BF16,
    };
    let mut out = vec![(
        "model.embed_tokens.weight".into(),
        float(spec.dtype),
        vec![16, h],
    )];
    let mut weight = |name: String, rows: usize, cols: usize, routed: bool| match spec.dtype {
        WeightFormat::Gptq { group, .. } | WeightFormat::Awq { group } if routed => {
            out.extend(gptq_awq_tensors(&name, [rows, cols], group, spec.dtype));
        }
        WeightFormat::PackQuantized if routed => {
            let base = name.strip_suffix(".weight").unwrap();
            out.push((
                format!("{base}.weight_packed"),
                Dtype::I32,
                vec![rows, cols / 8],
            ));
            out.push((
                format!("{base}.weight_scale"),
                Dtype::BF16,
                vec![rows, cols / 32],
            ));
            out.push((format!("{base}.weight_shape"), Dtype::I32, vec![2]));
        }
        WeightFormat::Fp8Block => {
            let grid = vec![rows.div_ceil(128), cols.div_ceil(128)];
            out.push((format!("{name}_scale_inv"), Dtype::F32, grid));
            out.push((name, Dtype::F8E4M3, vec![rows, cols]));
        }
        f => out.push((name, float(f), vec![rows, cols])),
    };
    for l in 0..spec.num_layers {
        if !spec.is_moe(l) {
            let [g, u, d] = dense_mlp_names(l);
            weight(g, spec.dense_inter, h, false);
            weight(u, spec.dense_inter, h, false);
            weight(d, h, spec.dense_inter, false);
            continue;
        }
        let mut whiches: Vec<ExpertRef> = (0..e as u32).map(ExpertRef::Routed).collect();
        whiches.extend(spec.shared.then_some(ExpertRef::Shared));
        for which in whiches {
            let routed = which != ExpertRef::Shared;
            let f = if routed {
                spec.moe_inter
            } else {
                spec.shared_inter()
            };
            let [g, u, d] = expert_names(spec.family, l, which);
            weight(g, f, h, routed);
            weight(u, f, h, routed);
            weight(d, h, f, routed);
        }
    }
    for l in spec.moe_layers() {
        out.push((router_name(spec, l), Dtype::BF16, vec![e, h]));
        if spec.is_sigmoid() {
            out.push((bias_name(l), Dtype::F32, vec![e]));
        }
        if spec.shared && spec.family == Family::Qwen2Moe {
            out.push((qwen2_shared_gate(l), Dtype::BF16, vec![1, h]));
        }
    }
    out
}

/// The GPTQ (AutoGPTQ) or AWQ (AutoAWQ GEMM) tensors of weight `name` `[rows = out, cols = in]`.
fn gptq_awq_tensors(
    name: &str,
    [rows, cols]: [usize; 2],
    group: usize,
    format: WeightFormat,
) -> Vec<(String, Dtype, Vec<usize>)> {
    let base = name.strip_suffix(".weight").unwrap();
    let awq = matches!(format, WeightFormat::Awq { .. });
    let qweight = if awq {
        vec![cols, rows / 8]
    } else {
        vec![cols / 8, rows]
    };
    let mut out = vec![
        (format!("{base}.qweight"), Dtype::I32, qweight),
        (
            format!("{base}.qzeros"),
            Dtype::I32,
            vec![cols / group, rows / 8],
        ),
        (
            format!("{base}.scales"),
            Dtype::F16,
            vec![cols / group, rows],
        ),
    ];
    if !awq {
        out.push((format!("{base}.g_idx"), Dtype::I32, vec![cols]));
    }
    out
}

/// Qwen2-MoE's shared expert gate of layer `l`, from transformers' `Qwen2MoeSparseMoeBlock`.
fn qwen2_shared_gate(l: usize) -> String {
    format!("model.layers.{l}.mlp.shared_expert_gate.weight")
}

/// An expert's `[gate, up, down]` names: the project's layouts, except Qwen2-MoE's shared
/// expert (`mlp.shared_expert`, singular, in transformers), which the project does not read yet.
fn expert_names(family: Family, l: usize, which: ExpertRef) -> [String; 3] {
    if family == Family::Qwen2Moe && which == ExpertRef::Shared {
        return ["gate", "up", "down"]
            .map(|w| format!("model.layers.{l}.mlp.shared_expert.{w}_proj.weight"));
    }
    expert_tensor_names(family, l as u32, which).unwrap()
}

/// Every family in every format, Qwen2-MoE with its shared expert, and GPTQ/AWQ with groups
/// of 64 and 128.
fn every_spec() -> Vec<TinySpec> {
    let mut specs: Vec<TinySpec> = MODEL_TYPES
        .iter()
        .flat_map(|mt| WeightFormat::ALL.map(|f| TinySpec::for_model_type(mt).with_dtype(f)))
        .collect();
    specs.push(TinySpec::qwen2_with_shared());
    specs.push(TinySpec::qwen2_with_shared().with_dtype(WeightFormat::Awq { group: 32 }));
    specs.extend([
        TinySpec::for_model_type("kimi_k2").with_dtype(WeightFormat::Gptq {
            v2: false,
            group: 64,
        }),
        TinySpec::for_model_type("qwen3_moe").with_dtype(WeightFormat::Gptq {
            v2: true,
            group: 128,
        }),
        TinySpec::for_model_type("mixtral").with_dtype(WeightFormat::Awq { group: 128 }),
    ]);
    specs
}

#[test]
fn files_hold_every_expected_tensor_single_and_sharded() {
    for (base, files) in every_spec()
        .into_iter()
        .flat_map(|s| [(s.clone(), 1), (s, 4)])
    {
        let spec = base.with_files(files);
        let what = format!(
            "{} {:?} shared {} in {files} file(s)",
            spec.model_type, spec.dtype, spec.shared
        );
        let (_tmp, ck) = write(&spec);
        let ckpt = Checkpoint::open(&ck.dir).unwrap_or_else(|e| panic!("{what}: {e}"));
        let expected = expected_tensors(&spec);
        assert_eq!(ckpt.len(), expected.len(), "{what}");
        assert_eq!(ck.tensors.len(), expected.len(), "{what}");
        for (name, dtype, shape) in &expected {
            let info = ckpt
                .tensor_info(name)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_eq!((info.dtype, &info.shape), (*dtype, shape), "{what}: {name}");
            let file = ckpt.file_of(name).unwrap().file_name().unwrap();
            assert_eq!(file.to_str(), Some(ck.entry(name).unwrap().file.as_str()));
        }
        assert_eq!(ckpt.files().len(), files, "{what}");
        assert_eq!(ck.files.len(), files, "{what}");
        assert_eq!(ck.dir.join(INDEX_FILE).is_file(), files > 1, "{what}");
        assert_eq!(ck.dir.join(SINGLE_FILE).is_file(), files == 1, "{what}");
    }
}

/// A tensor as f32 values with FP8 block scales applied (what the checkpoint means).
fn file_values(ckpt: &Checkpoint, name: &str) -> Vec<f64> {
    let view = ckpt.tensor(name).unwrap();
    let mut v = view.to_f32_vec().unwrap();
    if view.dtype() == Dtype::F8E4M3 {
        let cols = view.shape()[1];
        let grid = ckpt.tensor(&format!("{name}_scale_inv")).unwrap();
        let (scales, gcols) = (grid.to_f32_vec().unwrap(), grid.shape()[1]);
        for (i, x) in v.iter_mut().enumerate() {
            *x *= scales[(i / cols / 128) * gcols + (i % cols) / 128];
        }
    }
    v.into_iter().map(f64::from).collect()
}

/// A pack-quantized projection decoded from its definition: word `w` of a row holds columns
/// `8w..8w+8` LSB first, `value = (code − 8) × bf16 scale`, group 32.
fn decode_packed(ckpt: &Checkpoint, base: &str) -> Vec<f64> {
    let words = ckpt.tensor(&format!("{base}.weight_packed")).unwrap();
    let scales = ckpt.tensor(&format!("{base}.weight_scale")).unwrap();
    let (rows, cols) = (words.shape()[0], words.shape()[1] * 8);
    let (wb, sb) = (words.bytes(), scales.bytes());
    let mut out = Vec::with_capacity(rows * cols);
    for i in 0..rows * cols {
        let w = u32::from_le_bytes(wb[4 * (i / 8)..][..4].try_into().unwrap());
        let code = (w >> (4 * (i % 8))) & 0xF;
        let s = 2 * (i / 32);
        let scale = bf16::from_le_bytes([sb[s], sb[s + 1]]).to_f64();
        out.push((f64::from(code) - 8.0) * scale);
    }
    out
}

/// A GPTQ (AutoGPTQ) or AWQ (AutoAWQ GEMM) projection decoded from its definition,
/// `scale × (code − zero)` `[out × in]`: GPTQ `qweight` `[in/8, out]` holds input `8w + i` of
/// output `o` in bits `4i` of word `(w, o)`; both formats' `qzeros` `[in/group, out/8]` (and
/// AWQ's `qweight` `[in, out/8]`) hold output `8w + j` in word `w`'s nibble `j` (GPTQ) or the
/// nibble `i` with `[0, 2, 4, 6, 1, 3, 5, 7][i] = j` (AWQ); GPTQ v1 stores `zero − 1`.
fn decode_gptq_awq(ckpt: &Checkpoint, base: &str, format: WeightFormat) -> Vec<f64> {
    let t = |s: &str| ckpt.tensor(&format!("{base}.{s}")).unwrap();
    let (qweight, qzeros, scales) = (t("qweight"), t("qzeros"), t("scales"));
    let (groups, rows) = (scales.shape()[0], scales.shape()[1]);
    let (awq, v1) = match format {
        WeightFormat::Awq { .. } => (true, false),
        WeightFormat::Gptq { v2, .. } => (false, !v2),
        f => panic!("{f:?} is not GPTQ/AWQ"),
    };
    let cols = qweight.shape()[0] * if awq { 1 } else { 8 };
    let group = cols / groups;
    let nibble = |bytes: &[u8], word: usize, i: usize| {
        let w = u32::from_le_bytes(bytes[4 * word..][..4].try_into().unwrap());
        f64::from((w >> (4 * i)) & 0xF)
    };
    let out_slot = |o: usize| {
        let j = o % 8;
        if awq { [0, 4, 1, 5, 2, 6, 3, 7][j] } else { j }
    };
    let (wb, zb, sb) = (qweight.bytes(), qzeros.bytes(), scales.bytes());
    let mut out = Vec::with_capacity(rows * cols);
    for o in 0..rows {
        for k in 0..cols {
            let g = k / group;
            let code = if awq {
                nibble(wb, k * rows / 8 + o / 8, out_slot(o))
            } else {
                nibble(wb, (k / 8) * rows + o, k % 8)
            };
            let zero = nibble(zb, g * rows / 8 + o / 8, out_slot(o)) + f64::from(u8::from(v1));
            let s = 2 * (g * rows + o);
            let scale = f16::from_le_bytes([sb[s], sb[s + 1]]).to_f64();
            out.push(scale * (code - zero));
        }
    }
    if !awq {
        let g_idx = t("g_idx");
        let g_idx: Vec<i32> = g_idx
            .bytes()
            .chunks_exact(4)
            .map(|b| i32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        let trivial = (0..cols).map(|k| (k / group) as i32);
        assert!(g_idx.into_iter().eq(trivial), "{base}.g_idx");
    }
    out
}

/// The three matrices of `m` under `names`.
fn push_mlp<'a>(out: &mut Vec<(String, &'a [f64])>, names: [String; 3], m: &'a DenseExpert) {
    let [g, u, d] = names;
    out.extend([(g, &m.gate[..]), (u, &m.up[..]), (d, &m.down[..])]);
}

/// Every recorded matrix of `ck` with its tensor name.
fn recorded(ck: &TinyCheckpoint) -> Vec<(String, &[f64])> {
    let spec = &ck.spec;
    let mut out: Vec<(String, &[f64])> = vec![("model.embed_tokens.weight".into(), &ck.embed)];
    for l in 0..spec.num_layers {
        if !spec.is_moe(l) {
            push_mlp(&mut out, dense_mlp_names(l), ck.dense(l));
            continue;
        }
        let mut whiches: Vec<ExpertRef> = (0..spec.routed_experts as u32)
            .map(ExpertRef::Routed)
            .collect();
        whiches.extend(spec.shared.then_some(ExpertRef::Shared));
        for which in whiches {
            push_mlp(
                &mut out,
                expert_names(spec.family, l, which),
                ck.expert(l, which),
            );
        }
        out.push((router_name(spec, l), &ck.moe(l).gate));
        if let Some(b) = &ck.moe(l).bias {
            out.push((bias_name(l), b));
        }
        if let Some(g) = &ck.moe(l).shared_gate {
            out.push((qwen2_shared_gate(l), g));
        }
    }
    out
}

/// A spec wide enough for several FP8 blocks (and a partial one) per matrix.
fn wide(mt: &str, format: WeightFormat) -> TinySpec {
    let mut s = TinySpec::for_model_type(mt)
        .with_dtype(format)
        .with_files(3);
    s.hidden = 256;
    s.moe_inter = 160;
    s.dense_inter = 192;
    s.routed_experts = 4;
    if s.n_group > 1 {
        s.n_group = 2;
        s.topk_group = 1;
    }
    s
}

#[test]
fn recorded_values_are_what_the_files_hold() {
    let mut specs = every_spec();
    // Several FP8 blocks (and a partial one) per matrix, several INT4 groups per row.
    let gptq = WeightFormat::Gptq {
        v2: false,
        group: 32,
    };
    for mt in ["deepseek_v3", "mixtral"] {
        specs.extend(
            [WeightFormat::Fp8Block, WeightFormat::PackQuantized, gptq].map(|f| wide(mt, f)),
        );
    }
    specs.push(wide("qwen3_moe", WeightFormat::Awq { group: 32 }));
    for spec in specs {
        let what = format!(
            "{} {:?} hidden {} shared {}",
            spec.model_type, spec.dtype, spec.hidden, spec.shared
        );
        let (_tmp, ck) = write(&spec);
        let ckpt = Checkpoint::open(&ck.dir).unwrap();
        for (name, values) in recorded(&ck) {
            let got = match name.strip_suffix(".weight") {
                Some(base) if ckpt.contains(&format!("{base}.weight_packed")) => {
                    decode_packed(&ckpt, base)
                }
                Some(base) if ckpt.contains(&format!("{base}.qweight")) => {
                    decode_gptq_awq(&ckpt, base, spec.dtype)
                }
                _ => file_values(&ckpt, &name),
            };
            assert!(got == values, "{what}: {name} differs from the file");
        }
    }
}

/// `‖a − b‖ / ‖b‖`.
fn rel(a: &[f64], b: &[f64]) -> f64 {
    let d: f64 = a.iter().zip(b).map(|(x, y)| (x - y).powi(2)).sum();
    let n: f64 = b.iter().map(|y| y * y).sum();
    (d / n).sqrt()
}

#[test]
fn read_expert_reads_the_recorded_experts() {
    for mt in MODEL_TYPES {
        for format in WeightFormat::ALL {
            let spec = TinySpec::for_model_type(mt)
                .with_dtype(format)
                .with_files(2);
            let (_tmp, ck) = write(&spec);
            let mut model = load_hf_model(&ck.dir).unwrap();
            let ckpt = Checkpoint::open(&ck.dir).unwrap();
            // What the converter does: the packed format INT4 sources import into losslessly.
            model.quant = source_quant(&ckpt, &model, spec.family).unwrap();
            for l in spec.moe_layers() {
                let mut whiches: Vec<ExpertRef> = (0..spec.routed_experts as u32)
                    .map(ExpertRef::Routed)
                    .collect();
                whiches.extend(spec.shared.then_some(ExpertRef::Shared));
                for which in whiches {
                    let what = format!("{mt} {format:?} layer {l} {which}");
                    let (w, err) = read_expert(&ckpt, &model, spec.family, l as u32, which)
                        .unwrap_or_else(|e| panic!("{what}: {e}"));
                    let got = DenseExpert::from_packed(&w);
                    let want = ck.expert(l, which);
                    let lossless = format.is_int4() && which != ExpertRef::Shared;
                    if lossless {
                        assert_eq!(&got, want, "{what}");
                        assert_eq!(err, 0.0, "{what}");
                        continue;
                    }
                    let r = rel(
                        &[got.gate, got.up, got.down].concat(),
                        &[&want.gate[..], &want.up, &want.down].concat(),
                    );
                    assert!(r < 0.15, "{what}: INT4 relative error {r}");
                    assert!((r - err).abs() < 1e-4, "{what}: {r} vs reported {err}");
                }
            }
        }
    }
}

/// A block of `E` one-wide experts over hidden size 2 with router logits `logits` for the
/// token `[1, 0]`: expert `e` outputs `(e + 1) · silu(1) · 2 · [1, −1]`; the shared expert
/// (when given) `10 · silu(1) · [1, 0]`.
fn hand_block(scoring: Scoring, logits: &[f64], bias: &[f64], shared: bool) -> MoeBlock {
    let expert = |g: f64, u: f64, d: [f64; 2]| DenseExpert {
        inter: 1,
        gate: vec![g, 0.0],
        up: vec![u, 0.0],
        down: d.to_vec(),
    };
    MoeBlock {
        scoring,
        top_k: 2,
        norm_topk_prob: true,
        routed_scaling_factor: 1.0,
        n_group: 1,
        topk_group: 1,
        gate: logits.iter().flat_map(|&l| [l, 0.0]).collect(),
        bias: bias.to_vec(),
        experts: (0..logits.len())
            .map(|e| expert(1.0, 2.0, [(e + 1) as f64, -((e + 1) as f64)]))
            .collect(),
        shared: shared.then(|| expert(1.0, 1.0, [10.0, 0.0])),
        shared_gate: None,
    }
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-12 * b.abs().max(1.0)
}

fn assert_routing(got: &crate::hf_support::reference::Routing, experts: &[usize], weights: &[f64]) {
    assert_eq!(got.experts, experts, "{got:?}");
    for (g, w) in got.weights.iter().zip(weights) {
        assert!(close(*g, *w), "weights {:?}, want {weights:?}", got.weights);
    }
}

#[test]
fn softmax_references_by_hand() {
    assert!(close(silu(1.0), SILU_1));
    // softmax(ln 1, ln 2, ln 3, ln 4) = (0.1, 0.2, 0.3, 0.4); top-2 = experts 3 and 2.
    let logits: Vec<f64> = (1..=4).map(|v| f64::from(v).ln()).collect();
    let mut b = hand_block(Scoring::Softmax, &logits, &[0.0; 4], false);
    for family in [Family::Qwen3Moe, Family::Qwen2Moe, Family::Olmoe] {
        b.norm_topk_prob = true;
        let r = route_f64(&b, family, &logits);
        assert_routing(&r, &[3, 2], &[4.0 / 7.0, 3.0 / 7.0]);
        assert!(close(r.margin, 1.5f64.ln()) && r.zero_mask_agrees);
        let out = moe_block_f64(&b, family, &[1.0, 0.0], 1);
        let want = (4.0 / 7.0 * 4.0 + 3.0 / 7.0 * 3.0) * 2.0 * SILU_1;
        assert!(
            close(out[0], want) && close(out[1], -want),
            "{family:?} {out:?}"
        );
        b.norm_topk_prob = false;
        assert_routing(&route_f64(&b, family, &logits), &[3, 2], &[0.4, 0.3]);
        let out = moe_block_f64(&b, family, &[1.0, 0.0], 1);
        assert!(close(out[0], 2.5 * 2.0 * SILU_1), "{family:?} {out:?}");
    }
    // Mixtral renormalizes whatever norm_topk_prob says.
    let r = route_f64(&b, Family::Mixtral, &logits);
    assert_routing(&r, &[3, 2], &[4.0 / 7.0, 3.0 / 7.0]);
    // Softmax is shift-invariant: the same decision for logits + 5.
    let shifted: Vec<f64> = logits.iter().map(|l| l + 5.0).collect();
    assert_routing(
        &route_f64(&b, Family::Mixtral, &shifted),
        &[3, 2],
        &[4.0 / 7.0, 3.0 / 7.0],
    );
}

/// Logits whose sigmoids are `p`.
fn inverse_sigmoid(p: &[f64]) -> Vec<f64> {
    p.iter().map(|&p| (p / (1.0 - p)).ln()).collect()
}

#[test]
fn sigmoid_bias_reference_by_hand() {
    // scores  = [0.9, 0.1, 0.2, 0.3 | 0.6, 0.5, 0.55, 0.2]
    // bias    = [0, 0.55, 0, 0 | 0.35, 0, 0, 0]
    // choice  = [0.9, 0.65, 0.2, 0.3 | 0.95, 0.5, 0.55, 0.2]
    let p = [0.9, 0.1, 0.2, 0.3, 0.6, 0.5, 0.55, 0.2];
    let bias = [0.0, 0.55, 0.0, 0.0, 0.35, 0.0, 0.0, 0.0];
    let logits = inverse_sigmoid(&p);
    let mut b = hand_block(Scoring::SigmoidBias, &logits, &bias, true);
    b.routed_scaling_factor = 2.5;
    for family in [Family::DeepseekV3, Family::Glm4Moe] {
        // Two groups, keep one: group scores (top-2 sums) 1.55 vs 1.50 keep group 0 (its max,
        // 0.9, is below group 1's 0.95); the bias picks expert 1 (score 0.1) over expert 3
        // (0.3); weights are the unbiased scores 0.9, 0.1, normalized (sum 1), × 2.5.
        b.n_group = 2;
        b.topk_group = 1;
        b.norm_topk_prob = true;
        let r = route_f64(&b, family, &logits);
        assert_routing(&r, &[0, 1], &[2.25, 0.25]);
        assert!(
            (r.margin - 0.05).abs() < 1e-12 && r.zero_mask_agrees,
            "{r:?}"
        );
        // Output: routed (2.25·1 + 0.25·2) · 2·silu(1) · [1, −1], plus shared 10·silu(1)·[1, 0].
        let out = moe_block_f64(&b, family, &[1.0, 0.0], 1);
        assert!(close(out[0], 5.5 * SILU_1 + 10.0 * SILU_1), "{out:?}");
        assert!(close(out[1], -5.5 * SILU_1), "{out:?}");
        // One group: the best choices overall, experts 4 (0.95) and 0 (0.9); weights
        // 0.6 / 1.5 and 0.9 / 1.5, × 2.5.
        b.n_group = 1;
        b.topk_group = 1;
        assert_routing(&route_f64(&b, family, &logits), &[4, 0], &[1.0, 1.5]);
        // Without renormalization: the scores × 2.5.
        b.norm_topk_prob = false;
        assert_routing(&route_f64(&b, family, &logits), &[4, 0], &[1.5, 2.25]);
        // Zero bias, two groups: 0.9 + 0.3 = 1.2 beats 0.6 + 0.55 = 1.15; experts 0 and 3,
        // 0.9 / 1.2 and 0.3 / 1.2, × 2.5.
        b.norm_topk_prob = true;
        b.n_group = 2;
        let unbiased = MoeBlock {
            bias: vec![0.0; 8],
            ..b.clone()
        };
        assert_routing(
            &route_f64(&unbiased, family, &logits),
            &[0, 3],
            &[1.875, 0.625],
        );
    }
}

#[test]
fn negative_selection_scores_are_flagged() {
    // All scores 0.5; biases make every choice negative: group 0 (−0.4 − 0.3) is kept, its two
    // experts are chosen by -inf masking, while 0.0 masking would choose group 1's experts.
    let logits = [0.0; 4];
    let mut b = hand_block(
        Scoring::SigmoidBias,
        &logits,
        &[-0.9, -0.8, -0.95, -0.99],
        false,
    );
    b.n_group = 2;
    b.topk_group = 1;
    let r = route_f64(&b, Family::DeepseekV3, &logits);
    assert_routing(&r, &[1, 0], &[0.5, 0.5]);
    assert!(!r.zero_mask_agrees);
    b.n_group = 1; // nothing dropped: both maskings agree
    assert!(route_f64(&b, Family::DeepseekV3, &logits).zero_mask_agrees);
}

#[test]
fn tiny_blocks_route_sensibly_and_batch_like_single_tokens() {
    for mt in MODEL_TYPES {
        let spec = TinySpec::for_model_type(mt);
        let (_tmp, ck) = write(&spec);
        let tokens = 64;
        let x = random_tokens(tokens, spec.hidden, 99);
        for l in spec.moe_layers() {
            let block = block_from_tiny(&ck, l);
            let routings = route_tokens(&block, spec.family, &x, tokens);
            for r in &routings {
                assert!(r.zero_mask_agrees && r.margin > 0.0, "{mt}: {r:?}");
                let sum: f64 = r.weights.iter().sum();
                let norm = spec.norm_topk_prob || spec.family == Family::Mixtral;
                let scale = if spec.is_sigmoid() {
                    spec.routed_scaling_factor
                } else {
                    1.0
                };
                if norm {
                    assert!((sum - scale).abs() < 1e-12, "{mt}: {r:?}");
                }
            }
            let all = moe_block_f64(&block, spec.family, &x, tokens);
            let one = moe_block_f64(&block, spec.family, &x[5 * spec.hidden..][..spec.hidden], 1);
            assert_eq!(&all[5 * spec.hidden..][..spec.hidden], &one[..], "{mt}");
            // The bias and the groups of the defaults change some decisions.
            if spec.nonzero_bias {
                let unbiased = MoeBlock {
                    bias: vec![0.0; spec.routed_experts],
                    ..block.clone()
                };
                let other = route_tokens(&unbiased, spec.family, &x, tokens);
                assert!(other != routings, "{mt}: the bias never matters");
            }
            if spec.n_group > 1 {
                let ungrouped = MoeBlock {
                    n_group: 1,
                    topk_group: 1,
                    ..block.clone()
                };
                let other = route_tokens(&ungrouped, spec.family, &x, tokens);
                assert!(other != routings, "{mt}: the groups never matter");
            }
        }
    }
}

#[test]
fn converted_pack_quantized_experts_give_the_recorded_block() {
    let spec = TinySpec::for_model_type("kimi_k2").with_dtype(WeightFormat::PackQuantized);
    let (_tmp, ck) = write(&spec);
    let model = load_hf_model(&ck.dir).unwrap();
    let ckpt = Checkpoint::open(&ck.dir).unwrap();
    let x = random_tokens(8, spec.hidden, 5);
    for l in spec.moe_layers() {
        let block = block_from_tiny(&ck, l);
        let routed = (0..spec.routed_experts as u32)
            .map(|e| {
                let (w, _) =
                    read_expert(&ckpt, &model, spec.family, l as u32, ExpertRef::Routed(e))
                        .unwrap();
                DenseExpert::from_packed(&w)
            })
            .collect();
        let converted = block.with_experts(routed, block.shared.clone());
        assert_eq!(
            moe_block_f64(&converted, spec.family, &x, 8),
            moe_block_f64(&block, spec.family, &x, 8),
            "layer {l}"
        );
    }
}

#[test]
fn gptq_and_awq_experts_import_losslessly() {
    let cases = [
        (
            "qwen3_moe",
            WeightFormat::Gptq {
                v2: false,
                group: 32,
            },
        ),
        (
            "deepseek_v3",
            WeightFormat::Gptq {
                v2: true,
                group: 128,
            },
        ),
        ("mixtral", WeightFormat::Awq { group: 64 }),
        ("olmoe", WeightFormat::Awq { group: 128 }),
        ("kimi_k2", WeightFormat::Awq { group: 32 }),
    ];
    for (mt, format) in cases {
        let spec = TinySpec::for_model_type(mt)
            .with_dtype(format)
            .with_files(2);
        let group = format.int4_group().unwrap();
        let what = format!("{mt} {format:?}");
        // Group 128 bumps the tiny sizes to hidden 128, experts of width 128.
        assert_eq!(spec.hidden, 64usize.next_multiple_of(group), "{what}");
        assert_eq!(spec.moe_inter, 32usize.next_multiple_of(group), "{what}");
        let (_tmp, ck) = write(&spec);
        let q = &ck.config["quantization_config"];
        assert_eq!(q["bits"], 4, "{what}");
        assert_eq!(q["group_size"], group, "{what}");
        match format {
            WeightFormat::Gptq { v2, .. } => {
                assert_eq!(q["quant_method"], "gptq", "{what}");
                assert_eq!(q["sym"], false, "{what}");
                assert_eq!(q["desc_act"], false, "{what}");
                let cf = if v2 { "gptq_v2" } else { "gptq" };
                assert_eq!(q["checkpoint_format"], cf, "{what}");
            }
            _ => {
                assert_eq!(q["quant_method"], "awq", "{what}");
                assert_eq!(
                    (&q["zero_point"], &q["version"]),
                    (&true.into(), &"gemm".into())
                );
            }
        }
        let mut model = load_hf_model(&ck.dir).unwrap_or_else(|e| panic!("{what}: {e}"));
        let ckpt = Checkpoint::open(&ck.dir).unwrap();
        model.quant = source_quant(&ckpt, &model, spec.family).unwrap();
        let want_quant = QuantSpec {
            group_size: group as u32,
            scale_dtype: ScaleDtype::F16,
            zero_points: true,
        };
        assert_eq!(model.quant, want_quant, "{what}");
        for l in spec.moe_layers() {
            for e in 0..spec.routed_experts as u32 {
                let which = ExpertRef::Routed(e);
                let (w, err) = read_expert(&ckpt, &model, spec.family, l as u32, which)
                    .unwrap_or_else(|e| panic!("{what} layer {l}: {e}"));
                assert_eq!(err, 0.0, "{what} layer {l} expert {e}");
                let got = DenseExpert::from_packed(&w);
                assert_eq!(&got, ck.expert(l, which), "{what} layer {l} expert {e}");
            }
        }
    }
}

#[test]
fn qwen2_gated_shared_expert_by_hand() {
    // softmax(ln 1, ln 2, ln 3, ln 4) = (0.1, 0.2, 0.3, 0.4); top-2 without renormalization:
    // routed (0.4·4 + 0.3·3) · 2·silu(1) · [1, −1] = 5·silu(1) · [1, −1]; the shared expert
    // gives 10·silu(1) · [1, 0] for the token [1, 0] (and [1, 1]: experts ignore x[1]).
    let logits: Vec<f64> = (1..=4).map(|v| f64::from(v).ln()).collect();
    let mut b = hand_block(Scoring::Softmax, &logits, &[0.0; 4], true);
    b.norm_topk_prob = false;
    let check = |b: &MoeBlock, x: [f64; 2], shared_weight: f64| {
        let out = moe_block_f64(b, Family::Qwen2Moe, &x, 1);
        let want = 5.0 * SILU_1 + shared_weight * 10.0 * SILU_1;
        assert!(close(out[0], want), "{x:?} {out:?}, want {want}");
        assert!(close(out[1], -5.0 * SILU_1), "{x:?} {out:?}");
    };
    // Without a gate the shared expert has weight 1 (the DeepSeek-V3 behaviour).
    check(&b, [1.0, 0.0], 1.0);
    // sigmoid(ln 3) = 3/4, sigmoid(−ln 3) = 1/4, sigmoid(0) = 1/2: the gate is per token.
    b.shared_gate = Some(vec![3f64.ln(), -(3f64.ln())]);
    assert!(close(b.shared_weight(&[1.0, 0.0]), 0.75));
    check(&b, [1.0, 0.0], 0.75);
    check(&b, [1.0, 1.0], 0.5);
    b.shared_gate = Some(vec![-(3f64.ln()), 0.0]);
    check(&b, [1.0, 0.0], 0.25);
    // The gate scales only the shared expert: routing is unchanged, and with_experts keeps it.
    assert_routing(
        &route_f64(&b, Family::Qwen2Moe, &logits),
        &[3, 2],
        &[0.4, 0.3],
    );
    let again = b.with_experts(b.experts.clone(), b.shared.clone());
    assert_eq!(again.shared_gate, b.shared_gate);
    check(&again, [1.0, 0.0], 0.25);
}

#[test]
fn qwen2_shared_expert_is_written_and_gated() {
    let spec = TinySpec::qwen2_with_shared();
    assert!(spec.shared && spec.gated_shared() && !spec.norm_topk_prob);
    let (h, f) = (spec.hidden, QWEN2_SHARED_MULT * spec.moe_inter);
    assert_eq!(spec.shared_inter(), f);
    let (_tmp, ck) = write(&spec);
    assert_eq!(ck.config["shared_expert_intermediate_size"], f);
    assert_eq!(ck.config["moe_intermediate_size"], spec.moe_inter);
    let ckpt = Checkpoint::open(&ck.dir).unwrap();
    let tokens = 32;
    let x = random_tokens(tokens, h, 17);
    for l in spec.moe_layers() {
        let p = format!("model.layers.{l}.mlp");
        let gate_name = format!("{p}.shared_expert_gate.weight");
        let info = ckpt.tensor_info(&gate_name).unwrap();
        assert_eq!((info.dtype, &info.shape[..]), (Dtype::BF16, &[1, h][..]));
        let gate = file_values(&ckpt, &gate_name);
        assert_eq!(ck.moe(l).shared_gate.as_ref(), Some(&gate), "layer {l}");
        let shared = ck.expert(l, ExpertRef::Shared);
        assert_eq!(shared.inter, f);
        for (w, m) in ["gate", "up", "down"]
            .iter()
            .zip([&shared.gate, &shared.up, &shared.down])
        {
            assert_eq!(
                &file_values(&ckpt, &format!("{p}.shared_expert.{w}_proj.weight")),
                m
            );
        }
        // The block: the routed experts plus sigmoid(gate · x) × shared(x), per token.
        let block = block_from_tiny(&ck, l);
        assert_eq!(block.shared_gate.as_ref(), Some(&gate));
        let routed_only = MoeBlock {
            shared: None,
            shared_gate: None,
            ..block.clone()
        };
        let got = moe_block_f64(&block, spec.family, &x, tokens);
        let routed = moe_block_f64(&routed_only, spec.family, &x, tokens);
        let mut weights = Vec::new();
        for (t, row) in x.chunks_exact(h).enumerate() {
            let s = sigmoid(gate.iter().zip(row).map(|(g, v)| g * v).sum());
            weights.push(s);
            for (n, y) in shared.forward(row).into_iter().enumerate() {
                let want = routed[t * h + n] + s * y;
                assert!(close(got[t * h + n], want), "layer {l} token {t} [{n}]");
            }
        }
        // The gate varies per token (not a constant factor).
        let (lo, hi) = weights
            .iter()
            .fold((1f64, 0f64), |(a, b), &w| (a.min(w), b.max(w)));
        assert!(
            lo < 0.4 && hi > 0.6,
            "layer {l}: gate weights in [{lo}, {hi}]"
        );
    }
}
