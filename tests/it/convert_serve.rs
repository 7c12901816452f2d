//! Real checkpoints end to end (issue 10): a tiny Hugging Face checkpoint folder of every
//! family and source format is converted by the `expertmesh convert` binary, served by a local
//! fabric of real worker processes from the converted folder (`--weights`), and every MoE
//! layer's output is checked:
//!
//! * accurate mode against an independent f64 reference of the family's published MoE block
//!   (`hf_support::reference`, written from transformers' modeling code, not the router's),
//!   on the gate and biases of the checkpoint and the experts the fabric serves (dequantized
//!   from the shards): within 1e-5 of the output's RMS (f32 summation order; measured below
//!   2e-6), tokens at a routing near-tie skipped;
//! * exact mode bit for bit against the in-process exact reference (one CPU backend holding
//!   every converted expert);
//! * lossless imports: every pack-quantized expert served equals the checkpoint's own
//!   dequantized values exactly, and BF16 shared experts of an INT4 checkpoint are served
//!   unquantized.

use crate::hf_support::reference::{DenseExpert, block_from_tiny, moe_block_f64, route_tokens};
use crate::hf_support::tiny::{
    Fp8Layout, TinyCheckpoint, TinySpec, WeightFormat, random_tokens, write_tiny_checkpoint,
};
use crate::support::{root, rt};
use expertmesh_backend::{ExpertBackend, ExpertKey};
use expertmesh_checkpoint::experts::ExpertRef;
use expertmesh_cpu_backend::CpuBackend;
use expertmesh_fabric::local::{LocalFabric, LocalFabricOptions};
use expertmesh_quant::contract::ComputeMode;
use expertmesh_quant::format::ExpertWeights;
use expertmesh_router::client::RouterClient;
use expertmesh_router::core::RouterConfig;
use expertmesh_shard::file::ShardFile;
use expertmesh_worker::deploy::Deployment;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

fn topology() -> PathBuf {
    root().join("examples/single-host.toml")
}

/// Run `expertmesh convert` on `ckpt` into `out`; returns stdout and stderr.
fn convert(ckpt: &Path, out: &Path) -> (String, String) {
    convert_args(ckpt, out, &[])
}

/// [`convert`] with extra arguments.
fn convert_args(ckpt: &Path, out: &Path, extra: &[&str]) -> (String, String) {
    convert_args_on(ckpt, out, &topology(), extra)
}

/// [`convert_args`] for the cluster of topology file `topo`.
fn convert_args_on(ckpt: &Path, out: &Path, topo: &Path, extra: &[&str]) -> (String, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_expertmesh"))
        .args(["convert", "--threads", "2", "--checkpoint"])
        .arg(ckpt)
        .args(extra)
        .arg("--topology")
        .arg(topo)
        .arg("--out")
        .arg(out)
        .output()
        .unwrap();
    let (so, se) = (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    );
    assert!(o.status.success(), "convert failed:\n{so}\n{se}");
    (so, se)
}

/// Every expert of a converted folder, keyed (layer, expert), and the router file.
fn converted_experts(out: &Path) -> (BTreeMap<(u32, u32), ExpertWeights>, ShardFile) {
    let mut all = BTreeMap::new();
    let mut names: Vec<PathBuf> = std::fs::read_dir(out)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "emshard"))
        .collect();
    names.sort();
    for p in &names {
        let f = ShardFile::open(p).unwrap();
        f.verify(None).unwrap();
        for (i, e) in f.index().experts.iter().enumerate() {
            all.insert((e.layer, e.expert), f.expert(i).unwrap());
        }
    }
    let router = ShardFile::open(&out.join(expertmesh_shard::ROUTER_SHARD_NAME)).unwrap();
    (all, router)
}

fn options(out: &Path, mode: ComputeMode) -> LocalFabricOptions {
    let mut o = LocalFabricOptions::new(topology(), "", "");
    o.weights = Some(out.to_path_buf());
    o.exe = PathBuf::from(env!("CARGO_BIN_EXE_expertmesh"));
    o.ephemeral_ports = true;
    o.router = RouterConfig {
        mode: mode.into(),
        batch_window: Duration::from_micros(100),
        micro_batch_tokens: 16,
        default_deadline: Duration::from_secs(20),
        ..RouterConfig::default()
    };
    o.connect_timeout = Duration::from_secs(60);
    o
}

/// The shared expert the fabric serves for `layer`: dense from the router file, or packed.
fn served_shared(
    ck: &TinyCheckpoint,
    experts: &BTreeMap<(u32, u32), ExpertWeights>,
    router: &ShardFile,
    layer: u32,
) -> Option<DenseExpert> {
    if !ck.spec.shared {
        return None;
    }
    let e = ck.spec.routed_experts as u32;
    if let Some(w) = experts.get(&(layer, e)) {
        return Some(DenseExpert::from_packed(w));
    }
    let [g, u, d] = expertmesh_shard::shared_dense_names(layer, 0)
        .map(|n| router.tensor_f32(&n).expect("dense shared expert").1);
    Some(DenseExpert::from_f32(ck.spec.shared_inter(), &g, &u, &d))
}

/// Calls every MoE layer through the fabric (accurate mode) and compares with the f64
/// reference of the published block on the served experts.
fn check_accurate(ck: &TinyCheckpoint, out: &Path) {
    let (experts, router) = converted_experts(out);
    let fabric = LocalFabric::start(options(out, ComputeMode::Accurate)).unwrap();
    let h = ck.spec.hidden;
    let rt = rt();
    let mut client = rt
        .block_on(RouterClient::connect(
            fabric.frontend_addr(),
            &fabric.frontend_config(),
        ))
        .unwrap();
    let tokens = 12;
    for l in ck.spec.moe_layers() {
        let layer = l as u32;
        let x64 = random_tokens(tokens, h, 100 + l as u64);
        let x: Vec<f32> = x64.iter().map(|&v| v as f32).collect();
        let got = rt.block_on(client.call(layer, &x, h, None, None)).unwrap();
        let served: Vec<DenseExpert> = (0..ck.spec.routed_experts as u32)
            .map(|e| DenseExpert::from_packed(&experts[&(layer, e)]))
            .collect();
        let block = block_from_tiny(ck, l)
            .with_experts(served, served_shared(ck, &experts, &router, layer));
        let want = moe_block_f64(&block, ck.spec.family, &x64, tokens);
        let routes = route_tokens(&block, ck.spec.family, &x64, tokens);
        let rms = (want.iter().map(|v| v * v).sum::<f64>() / want.len() as f64).sqrt();
        let mut compared = 0;
        for (t, r) in routes.iter().enumerate() {
            if r.margin < 1e-4 {
                continue; // a near-tie: f32 logits may route it differently, correctly
            }
            compared += 1;
            for n in 0..h {
                let (a, b) = (f64::from(got[t * h + n]), want[t * h + n]);
                assert!(
                    (a - b).abs() <= 1e-5 * rms,
                    "{} {:?} layer {layer} token {t} [{n}]: fabric {a} reference {b} (rms {rms})",
                    ck.spec.model_type,
                    ck.spec.dtype
                );
            }
        }
        assert!(
            compared >= tokens - 2,
            "too many near-ties: {compared}/{tokens}"
        );
    }
    assert_eq!(fabric.service().stats().failures, 0);
    fabric.shutdown();
}

/// Calls every MoE layer in exact mode and compares bit for bit with the in-process exact
/// reference on the same converted weights.
fn check_exact(ck: &TinyCheckpoint, out: &Path) {
    let fabric = LocalFabric::start(options(out, ComputeMode::Exact)).unwrap();
    check_served_exactly(ck, out, &fabric);
    fabric.shutdown();
}

/// Every MoE layer of the converted `out` served by `fabric` bit for bit like the exact
/// in-process reference.
fn check_served_exactly(ck: &TinyCheckpoint, out: &Path, fabric: &LocalFabric) {
    check_served_exactly_on(ck, out, fabric, &topology());
}

/// [`check_served_exactly`] for a fabric on topology file `topo`.
fn check_served_exactly_on(ck: &TinyCheckpoint, out: &Path, fabric: &LocalFabric, topo: &Path) {
    let dep = Deployment::load_converted(topo, out).unwrap();
    let mut backend = reference_backend(&dep, out);
    let mut dense = dep
        .shared_dense()
        .then(|| expertmesh_worker::shared::DenseSharedRunner::load(&dep).unwrap());
    let setups = dep.layer_setups().unwrap();
    check_served(ck, &dep, &mut backend, &mut dense, &setups, fabric);
}

/// The exact in-process reference of the converted `out`: one CPU backend holding every
/// expert of its shards.
fn reference_backend(dep: &Deployment, out: &Path) -> CpuBackend {
    let (experts, _) = converted_experts(out);
    let keyed: Vec<(ExpertKey, ExpertWeights)> = experts
        .into_iter()
        .map(|((layer, expert), w)| (ExpertKey { layer, expert }, w))
        .collect();
    let mut backend = CpuBackend::new(1).unwrap();
    let slots = (dep.spec.top_k + dep.spec.shared_experts) as usize;
    let limits = expertmesh_backend::BatchLimits {
        max_tokens: 64,
        max_pairs: 64 * slots,
    };
    backend.load(keyed, limits).unwrap();
    backend
}

/// One call per layer of `setups` through `fabric`, compared bit for bit with `backend`
/// (plus the router's dense shared experts, when it runs them).
fn check_served(
    ck: &TinyCheckpoint,
    dep: &Deployment,
    backend: &mut CpuBackend,
    dense: &mut Option<expertmesh_worker::shared::DenseSharedRunner>,
    setups: &[expertmesh_router::core::LayerSetup],
    fabric: &LocalFabric,
) {
    let spec = dep.spec.clone();
    let h = spec.hidden as usize;
    let rt = rt();
    let mut client = rt
        .block_on(RouterClient::connect(
            fabric.frontend_addr(),
            &fabric.frontend_config(),
        ))
        .unwrap();
    for s in setups {
        let tokens = 9;
        let x: Vec<f32> = random_tokens(tokens, h, 7 + u64::from(s.layer))
            .iter()
            .map(|&v| v as f32)
            .collect();
        let got = rt
            .block_on(client.call(s.layer, &x, h, None, None))
            .unwrap();
        let mut routed_spec = spec.clone();
        if dense.is_some() {
            routed_spec.shared_experts = 0;
        }
        let (_, mut want) = expertmesh_router::reference::moe_layer_backend(
            &routed_spec,
            &s.gate,
            s.layer,
            backend,
            &x,
            ComputeMode::Exact,
        )
        .unwrap();
        if let Some(d) = dense.as_mut() {
            use expertmesh_router::core::SharedRunner;
            let mut rows = vec![0f32; tokens * h];
            d.run(s.layer, &x, tokens, ComputeMode::Exact, &mut rows)
                .unwrap();
            for (o, v) in want.iter_mut().zip(&rows) {
                *o += v;
            }
        }
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&got),
            bits(&want),
            "{} layer {}",
            ck.spec.model_type,
            s.layer
        );
    }
}

fn case(
    model_type: &str,
    dtype: WeightFormat,
    files: usize,
) -> (tempfile::TempDir, TinyCheckpoint, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let spec = TinySpec::for_model_type(model_type)
        .with_dtype(dtype)
        .with_files(files);
    let ck = write_tiny_checkpoint(&dir.path().join("ckpt"), &spec);
    let out = dir.path().join("weights");
    convert(&ck.dir, &out);
    (dir, ck, out)
}

#[test]
fn deepseek_v3_fp8_in_three_files_matches_the_reference() {
    let _machine = crate::support::shared();
    let (_d, ck, out) = case("deepseek_v3", WeightFormat::Fp8Block, 3);
    check_accurate(&ck, &out);
    check_exact(&ck, &out);
}

/// FP8 whose scales are not DeepSeek-V3's 128 × 128 `weight_scale_inv` blocks: transformers'
/// fine-grained FP8 with another `weight_block_size`, and compressed-tensors'
/// `float-quantized` (llm-compressor's FP8 schemes) per block, per output channel, per group
/// of 16 inputs and per tensor. Each converts to exactly the experts of the same checkpoint written as F32 of the
/// values its FP8 weights store (an independent float read of the same numbers). Blocks of
/// 24 × 40 cover the tiny model's 32 × 64 and 64 × 32 weights unevenly: a reader that took
/// another block size, or the block dimensions swapped, would find a grid of another shape or
/// read other values. The 24 × 40 checkpoint is also served bit for bit like the reference.
#[test]
fn fp8_of_other_scale_layouts_converts_as_its_values_read_as_f32() {
    let _machine = crate::support::shared();
    let layouts = [
        Fp8Layout::ScaleInv([24, 40]),
        Fp8Layout::CompressedBlock([24, 40]),
        Fp8Layout::CompressedChannel,
        Fp8Layout::CompressedGroup(16),
        Fp8Layout::CompressedTensor,
    ];
    for layout in layouts {
        let dir = tempfile::tempdir().unwrap();
        let spec = TinySpec::for_model_type("deepseek_v3").with_fp8(layout);
        let ck = write_tiny_checkpoint(&dir.path().join("fp8"), &spec);
        let out = dir.path().join("weights");
        convert(&ck.dir, &out);
        let mut as_f32 = spec.clone();
        as_f32.fp8_as_f32 = true;
        let ck32 = write_tiny_checkpoint(&dir.path().join("f32"), &as_f32);
        let out32 = dir.path().join("weights-f32");
        convert(&ck32.dir, &out32);
        let (experts, _) = converted_experts(&out);
        let (experts32, _) = converted_experts(&out32);
        assert_eq!(experts.len(), experts32.len());
        for (key, e) in &experts {
            assert!(experts32[key] == *e, "{layout:?}: expert {key:?} differs");
        }
        if layout == Fp8Layout::ScaleInv([24, 40]) {
            check_exact(&ck, &out);
        }
    }
}

#[test]
fn kimi_k2_pack_quantized_is_served_losslessly() {
    let _machine = crate::support::shared();
    let (_d, ck, out) = case("kimi_k2", WeightFormat::PackQuantized, 2);
    let (experts, router) = converted_experts(&out);
    for l in ck.spec.moe_layers() {
        for e in 0..ck.spec.routed_experts {
            let served = DenseExpert::from_packed(&experts[&(l as u32, e as u32)]);
            assert_eq!(
                &served,
                ck.expert(l, ExpertRef::Routed(e as u32)),
                "layer {l} expert {e}"
            );
        }
        // the BF16 shared expert is kept dense, exactly
        let shared = served_shared(&ck, &experts, &router, l as u32).unwrap();
        assert_eq!(&shared, ck.expert(l, ExpertRef::Shared), "layer {l} shared");
    }
    let manifest = expertmesh_shard::Manifest::load(&out).unwrap();
    assert!(manifest.shared_dense);
    assert!(
        manifest.layers.iter().all(|l| l.rel_error_max == 0.0),
        "{:?}",
        manifest.layers
    );
    check_accurate(&ck, &out);
    check_exact(&ck, &out);
}

#[test]
fn glm4_moe_bf16_matches_the_reference() {
    let _machine = crate::support::shared();
    let (_d, ck, out) = case("glm4_moe", WeightFormat::Bf16, 1);
    check_accurate(&ck, &out);
}

#[test]
fn qwen3_moe_bf16_with_a_dense_layer_matches_the_reference() {
    let _machine = crate::support::shared();
    let (_d, ck, out) = case("qwen3_moe", WeightFormat::Bf16, 1);
    check_accurate(&ck, &out);
    check_exact(&ck, &out);
}

#[test]
fn qwen2_moe_f16_matches_the_reference() {
    let _machine = crate::support::shared();
    let (_d, ck, out) = case("qwen2_moe", WeightFormat::F16, 1);
    check_accurate(&ck, &out);
}

#[test]
fn mixtral_f32_in_two_files_matches_the_reference() {
    let _machine = crate::support::shared();
    let (_d, ck, out) = case("mixtral", WeightFormat::F32, 2);
    check_accurate(&ck, &out);
}

/// A checkpoint that stores its routed experts fused (transformers v5's
/// `mlp.experts.gate_up_proj` / `down_proj`, how models published since ship) converts to
/// exactly the packed experts of the same weights stored one tensor per expert, and is served
/// to the reference.
#[test]
fn qwen3_moe_with_fused_experts_converts_as_per_expert_tensors() {
    fused_experts_convert_as_per_expert_tensors("qwen3_moe");
}

/// The same for Mixtral, whose whole `block_sparse_moe` block transformers v5 saves as `mlp`
/// (its router gate too).
#[test]
fn mixtral_with_fused_experts_converts_as_per_expert_tensors() {
    fused_experts_convert_as_per_expert_tensors("mixtral");
}

fn fused_experts_convert_as_per_expert_tensors(model_type: &str) {
    let _machine = crate::support::shared();
    let dir = tempfile::tempdir().unwrap();
    let per_expert = TinySpec::for_model_type(model_type).with_files(2);
    let fused = TinySpec {
        fused_experts: true,
        ..per_expert.clone()
    };
    let a = write_tiny_checkpoint(&dir.path().join("per-expert"), &per_expert);
    let b = write_tiny_checkpoint(&dir.path().join("fused"), &fused);
    assert!(b.entry("model.layers.1.mlp.experts.gate_up_proj").is_some());
    assert!(
        b.entry("model.layers.1.mlp.experts.0.gate_proj.weight")
            .is_none()
    );
    let (out_a, out_b) = (dir.path().join("weights-a"), dir.path().join("weights-b"));
    convert(&a.dir, &out_a);
    convert(&b.dir, &out_b);
    let (experts_a, _) = converted_experts(&out_a);
    let (experts_b, _) = converted_experts(&out_b);
    assert_eq!(
        experts_a.len(),
        per_expert.routed_experts * per_expert.moe_layers().len()
    );
    assert_eq!(
        experts_a.keys().collect::<Vec<_>>(),
        experts_b.keys().collect::<Vec<_>>()
    );
    for (key, w) in &experts_a {
        assert!(
            w == &experts_b[key],
            "{key:?} differs between the two layouts"
        );
    }
    check_exact(&b, &out_b);
}

#[test]
fn olmoe_bf16_matches_the_reference() {
    let _machine = crate::support::shared();
    let (_d, ck, out) = case("olmoe", WeightFormat::Bf16, 1);
    check_accurate(&ck, &out);
}

/// GPTQ/AWQ imports are lossless: every routed expert served from `out` equals the checkpoint's
/// own dequantized values `scale × (code − zero)`, the manifest's quant is the checkpoint's
/// (group, F16 scales, zero points) and every MoE layer reports zero error.
fn assert_gptq_awq_served_losslessly(ck: &TinyCheckpoint, out: &Path) {
    let (experts, _) = converted_experts(out);
    for l in ck.spec.moe_layers() {
        for e in 0..ck.spec.routed_experts {
            let served = DenseExpert::from_packed(&experts[&(l as u32, e as u32)]);
            assert_eq!(
                &served,
                ck.expert(l, ExpertRef::Routed(e as u32)),
                "{} {:?} layer {l} expert {e}",
                ck.spec.model_type,
                ck.spec.dtype
            );
        }
    }
    let manifest = expertmesh_shard::Manifest::load(out).unwrap();
    let method = match ck.spec.dtype {
        WeightFormat::Awq { .. } => "awq",
        _ => "gptq",
    };
    assert!(
        manifest.source.weight_format.starts_with(method),
        "{}",
        manifest.source.weight_format
    );
    let group = ck.spec.dtype.int4_group().expect("an INT4 format");
    let quant = expertmesh_quant::format::QuantSpec {
        group_size: group as u32,
        scale_dtype: expertmesh_quant::format::ScaleDtype::F16,
        zero_points: true,
    };
    assert_eq!(manifest.quant, quant);
    let layers: Vec<usize> = manifest.layers.iter().map(|l| l.layer as usize).collect();
    assert_eq!(layers, ck.spec.moe_layers());
    assert!(
        manifest.layers.iter().all(|l| l.rel_error_max == 0.0),
        "{:?}",
        manifest.layers
    );
}

#[test]
fn qwen3_moe_gptq_v1_group_128_is_served_losslessly() {
    let _machine = crate::support::shared();
    let gptq = WeightFormat::Gptq {
        v2: false,
        group: 128,
    };
    let (_d, ck, out) = case("qwen3_moe", gptq, 2);
    assert_eq!((ck.spec.hidden, ck.spec.moe_inter), (128, 128));
    assert_gptq_awq_served_losslessly(&ck, &out);
    check_accurate(&ck, &out);
    check_exact(&ck, &out);
}

#[test]
fn mixtral_awq_group_32_in_three_files_is_served_losslessly() {
    let _machine = crate::support::shared();
    let (_d, ck, out) = case("mixtral", WeightFormat::Awq { group: 32 }, 3);
    assert_gptq_awq_served_losslessly(&ck, &out);
    check_accurate(&ck, &out);
    check_exact(&ck, &out);
}

#[test]
fn qwen2_moe_gated_shared_expert_on_the_router_matches_the_reference() {
    let _machine = crate::support::shared();
    let dir = tempfile::tempdir().unwrap();
    let ck = write_tiny_checkpoint(&dir.path().join("ckpt"), &TinySpec::qwen2_with_shared());
    let out = dir.path().join("weights");
    convert(&ck.dir, &out);
    let dep = Deployment::load_converted(&topology(), &out).unwrap();
    assert!(dep.spec.shared_expert_gate && dep.spec.shared_experts == 1);
    check_accurate(&ck, &out);
    check_exact(&ck, &out);
}

#[test]
fn qwen2_moe_gated_shared_expert_on_a_worker_matches_the_reference() {
    let _machine = crate::support::shared();
    let dir = tempfile::tempdir().unwrap();
    let ck = write_tiny_checkpoint(&dir.path().join("ckpt"), &TinySpec::qwen2_with_shared());
    // Routed experts split over both devices, the shared expert on cpu1: the router sends it
    // every token with the token's gate weight as the slot weight.
    let placement = dir.path().join("p.toml");
    std::fs::write(
        &placement,
        "format = 1\nmodel = \"ckpt\"\ncluster = \"single-host\"\n\n[[assign]]\n\
         layers = \"all\"\ndevice = \"local/cpu0\"\nexperts = \"0-3\"\n\n[[assign]]\n\
         layers = \"all\"\ndevice = \"local/cpu1\"\nexperts = \"4-7\"\n\n[[shared]]\n\
         layers = \"all\"\ndevice = \"local/cpu1\"\n",
    )
    .unwrap();
    let out = dir.path().join("weights");
    convert_args(&ck.dir, &out, &["--placement", placement.to_str().unwrap()]);
    let dep = Deployment::load_converted(&topology(), &out).unwrap();
    let l = dep.spec.moe_layer_ids()[0];
    assert!(matches!(
        dep.placement.shared_location(l),
        Some(expertmesh_topology::placement::SharedLocation::Device(_))
    ));
    check_accurate(&ck, &out);
    check_exact(&ck, &out);
}

#[test]
fn olmoe_bf16_with_zero_points_matches_the_reference() {
    let _machine = crate::support::shared();
    let dir = tempfile::tempdir().unwrap();
    let ck = write_tiny_checkpoint(&dir.path().join("ckpt"), &TinySpec::for_model_type("olmoe"));
    let out = dir.path().join("weights");
    convert_args(&ck.dir, &out, &["--zero-points"]);
    let manifest = expertmesh_shard::Manifest::load(&out).unwrap();
    assert!(manifest.quant.zero_points, "{}", manifest.quant);
    check_accurate(&ck, &out);
    check_exact(&ck, &out);
    // An INT4 checkpoint keeps its own format: --zero-points is refused, naming the format.
    let kimi = write_tiny_checkpoint(
        &dir.path().join("kimi"),
        &TinySpec::for_model_type("kimi_k2").with_dtype(WeightFormat::PackQuantized),
    );
    let o = Command::new(env!("CARGO_BIN_EXE_expertmesh"))
        .args(["convert", "--zero-points", "--checkpoint"])
        .arg(&kimi.dir)
        .arg("--topology")
        .arg(topology())
        .arg("--out")
        .arg(dir.path().join("w2"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("--zero-points applies to float checkpoints"),
        "{stderr}"
    );
}

/// `dep`'s placement with the two devices' lists swapped on every layer (shared experts stay).
pub(crate) fn swapped(dep: &Deployment) -> expertmesh_topology::placement::Placement {
    use expertmesh_topology::placement::Placement;
    let p = &dep.placement;
    let layers = dep.spec.moe_layer_ids();
    let ranks: Vec<_> = dep.topology.devices().iter().map(|d| d.rank()).collect();
    let slots = layers
        .iter()
        .map(|&l| {
            ranks
                .iter()
                .rev()
                .map(|&r| p.experts_on(r, l).to_vec())
                .collect()
        })
        .collect();
    let shared = layers
        .iter()
        .filter_map(|&l| p.shared_location(l))
        .collect();
    Placement::new(&dep.topology, &dep.spec, slots, shared, "swapped").unwrap()
}

/// `expertmesh rebalance` of `placement` against `fabric` serving `out`: exit code and output.
fn rebalance(fabric: &LocalFabric, out: &Path, placement: &Path) -> (Option<i32>, String) {
    rebalance_on(fabric, &topology(), out, placement)
}

/// [`rebalance`] for a fabric on topology file `topo`.
fn rebalance_on(
    fabric: &LocalFabric,
    topo: &Path,
    out: &Path,
    placement: &Path,
) -> (Option<i32>, String) {
    rebalance_args(
        fabric,
        topo,
        &["--weights".as_ref(), out.as_os_str()],
        placement,
    )
}

/// `expertmesh rebalance` of `placement` against `fabric` on topology file `topo`, with `args`
/// naming the model or weights: exit code and output.
pub(crate) fn rebalance_args(
    fabric: &LocalFabric,
    topo: &Path,
    args: &[&std::ffi::OsStr],
    placement: &Path,
) -> (Option<i32>, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_expertmesh"))
        .args(["rebalance", "--router", &fabric.frontend_addr().to_string()])
        .arg("--topology")
        .arg(topo)
        .args(args)
        .arg("--placement")
        .arg(placement)
        .args(["--timeout-s", "60"])
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    (o.status.code(), text)
}

/// Converted weights move live (issue 29): each device gains the other's experts from the
/// other's shard (checked against the manifest's checksum) while the fabric serves; served
/// afterwards bit for bit like before. A change whose gains come from a damaged shard is
/// refused by the gainer and undone, and the fabric still serves every layer exactly.
#[test]
fn converted_experts_move_live_between_devices_and_a_damaged_shard_undoes_the_change() {
    let _machine = crate::support::shared();
    let (dir, ck, out) = case("qwen3_moe", WeightFormat::Bf16, 1);
    let dep = Deployment::load_converted(&topology(), &out).unwrap();
    let swapped_path = dir.path().join("swapped.toml");
    std::fs::write(&swapped_path, swapped(&dep).to_toml_string()).unwrap();
    let original = dir.path().join("original.toml");
    std::fs::write(&original, dep.placement.to_toml_string()).unwrap();
    let fabric = LocalFabric::start(options(&out, ComputeMode::Exact)).unwrap();
    let (code, text) = rebalance(&fabric, &out, &swapped_path);
    crate::support::say(&text);
    assert_eq!(code, Some(0), "{text}");
    check_served_exactly(&ck, &out, &fabric);
    // Damage device 0's shard: moving its experts back to device 0 must read from it.
    let record = &dep.weights.as_ref().unwrap().manifest.shards[0];
    refused_for_damage(&fabric, &out, &out.join(&record.file), &original);
    check_served_exactly(&ck, &out, &fabric);
    fabric.shutdown();
}

/// With one byte of `shard`'s first expert flipped, `rebalance` to `placement` fails (exit 1),
/// the change is undone and the answer names the checksum; the shard is intact again after.
fn refused_for_damage(fabric: &LocalFabric, out: &Path, shard: &Path, placement: &Path) {
    let intact = std::fs::read(shard).unwrap();
    let at = ShardFile::open(shard).unwrap().index().experts[0]
        .w13
        .nibbles
        .offset as usize;
    let mut bytes = intact.clone();
    bytes[at] ^= 0x5a;
    std::fs::write(shard, bytes).unwrap();
    let (code, text) = rebalance(fabric, out, placement);
    // (The reference reads every shard: the intact bytes back before any assertion.)
    std::fs::write(shard, intact).unwrap();
    assert_eq!(code, Some(1), "{text}");
    assert!(
        text.contains("undone") && text.contains("checksum mismatch"),
        "{text}"
    );
}

/// Worker `d`'s log says it copied an expert to a gaining device (its copy thread logs it
/// just after the last chunk; looked for until it shows).
fn copied_one(fabric: &LocalFabric, d: usize) {
    let path = fabric.log_dir().join(format!("worker-{d}.log"));
    let copied = || {
        std::fs::read_to_string(&path)
            .unwrap_or_default()
            .contains("expert copied to a gaining device")
    };
    crate::support::wait_for(
        &format!("worker {d} never logged a copy: {}", path.display()),
        Duration::from_millis(50),
        copied,
    );
}

/// The device ids of `dep`'s topology, in rank order.
fn device_ids(dep: &Deployment) -> Vec<String> {
    dep.topology
        .devices()
        .iter()
        .map(|d| d.id().to_string())
        .collect()
}

/// Per device, a folder `dir/hostD` with every file of the converted folder `out` but the
/// other devices' shards (hard links): each device on a host of its own, on one machine.
fn per_host_folders(dir: &Path, out: &Path, dep: &Deployment) -> Vec<PathBuf> {
    let manifest = &dep.weights.as_ref().unwrap().manifest;
    let ids = device_ids(dep);
    let mut folders = Vec::new();
    for (i, _) in ids.iter().enumerate() {
        let others: Vec<String> = ids
            .iter()
            .enumerate()
            .filter(|&(j, _)| j != i)
            .filter_map(|(_, o)| manifest.shard_of(o).map(|r| r.file.clone()))
            .collect();
        let host = dir.join(format!("host{i}"));
        std::fs::create_dir(&host).unwrap();
        for entry in std::fs::read_dir(out).unwrap() {
            let entry = entry.unwrap();
            let name = entry.file_name().to_string_lossy().into_owned();
            if !others.contains(&name) {
                std::fs::hard_link(entry.path(), host.join(&name)).unwrap();
            }
        }
        folders.push(host);
    }
    folders
}

/// On a cluster whose hosts hold only their own devices' shards (each worker here reads a
/// folder without the other device's shard), a device gains experts whose weights only the
/// other host has: each is copied from its current owner through the router (checked end to
/// end), and the fabric serves every layer bit for bit afterwards. An owner whose shard is
/// damaged fails the copy and the change is undone.
#[test]
fn a_gained_expert_only_another_host_has_is_copied_from_its_owner() {
    let _machine = crate::support::shared();
    let (dir, ck, out) = case("qwen3_moe", WeightFormat::Bf16, 1);
    let dep = Deployment::load_converted(&topology(), &out).unwrap();
    let manifest = &dep.weights.as_ref().unwrap().manifest;
    let ids = device_ids(&dep);
    let folders = per_host_folders(dir.path(), &out, &dep);
    let swapped_path = dir.path().join("swapped.toml");
    std::fs::write(&swapped_path, swapped(&dep).to_toml_string()).unwrap();
    let mut o = options(&out, ComputeMode::Exact);
    o.worker_weights = folders;
    let fabric = LocalFabric::start(o).unwrap();
    // The owner reads what it copies from its host's shard, checked against the manifest: a
    // damaged one fails the copy, and the change is undone.
    // (The folders hold hard links: damaging the shard damages host 1's copy too.)
    let shard1 = out.join(&manifest.shard_of(&ids[1]).unwrap().file);
    refused_for_damage(&fabric, &out, &shard1, &swapped_path);
    check_served_exactly(&ck, &out, &fabric);
    let (code, text) = rebalance(&fabric, &out, &swapped_path);
    crate::support::say(&text);
    assert_eq!(code, Some(0), "{text}");
    check_served_exactly(&ck, &out, &fabric);
    // Every gain was a copy: each worker's log names the copies it served.
    for d in 0..ids.len() {
        copied_one(&fabric, d);
    }
    fabric.shutdown();
}

/// An expert copied to a device is copied on from it: on three devices each with a host of
/// its own, device 0 takes device 1's experts (copied from device 1), then device 2 takes them
/// from device 0, whose host has no shard with them (it copies on the stream it kept). Served
/// bit for bit after each change.
#[test]
fn an_expert_copied_to_a_device_is_copied_on_from_it() {
    use expertmesh_topology::placement::Placement;
    let _machine = crate::support::shared();
    let dir = tempfile::tempdir().unwrap();
    let topo = crate::support::with_third_cpu(&topology(), &dir.path().join("three.toml"));
    let spec = TinySpec::for_model_type("qwen3_moe")
        .with_dtype(WeightFormat::Bf16)
        .with_files(1);
    let ck = write_tiny_checkpoint(&dir.path().join("ckpt"), &spec);
    let out = dir.path().join("weights");
    convert_args_on(&ck.dir, &out, &topo, &[]);
    let dep = Deployment::load_converted(&topo, &out).unwrap();
    let folders = per_host_folders(dir.path(), &out, &dep);
    let layers = dep.spec.moe_layer_ids();
    let ranks: Vec<_> = dep.topology.devices().iter().map(|d| d.rank()).collect();
    let held = |l: u32, d: usize| dep.placement.experts_on(ranks[d], l).to_vec();
    // `lists(l)` gives devices 0, 1, 2 their experts of layer l.
    let write = |name: &str, lists: &dyn Fn(u32) -> [Vec<u32>; 3]| -> PathBuf {
        let slots = layers.iter().map(|&l| lists(l).to_vec()).collect();
        let shared = layers
            .iter()
            .filter_map(|&l| dep.placement.shared_location(l))
            .collect();
        let p = Placement::new(&dep.topology, &dep.spec, slots, shared, name).unwrap();
        let path = dir.path().join(format!("{name}.toml"));
        std::fs::write(&path, p.to_toml_string()).unwrap();
        path
    };
    let union = |a: Vec<u32>, b: Vec<u32>| -> Vec<u32> {
        let mut u: Vec<u32> = a.into_iter().chain(b).collect();
        u.sort_unstable();
        u.dedup();
        u
    };
    let first = write("first", &|l| {
        [union(held(l, 0), held(l, 1)), Vec::new(), held(l, 2)]
    });
    let second = write("second", &|l| {
        [held(l, 0), Vec::new(), union(held(l, 2), held(l, 1))]
    });
    let mut o = options(&out, ComputeMode::Exact);
    o.topology = topo.clone();
    o.worker_weights = folders;
    let fabric = LocalFabric::start(o).unwrap();
    for step in [&first, &second] {
        let (code, text) = rebalance_on(&fabric, &topo, &out, step);
        crate::support::say(&text);
        assert_eq!(code, Some(0), "{text}");
        check_served_exactly_on(&ck, &out, &fabric, &topo);
    }
    // Device 0 copied on what it had been copied (its host has no shard with it).
    copied_one(&fabric, 0);
    fabric.shutdown();
}

/// `worker --prepare-tile-cache` keeps each device's tiles and exits without joining any
/// mesh; the fabric's first start then maps them (each worker's metrics say `reused`) and
/// serves every layer bit for bit. A second prepare finds the tiles valid; synthetic weights
/// (no stable identity) and a device on HIP (which keeps no tiles) are refused with the reason.
#[test]
fn prepared_tiles_make_the_first_start_a_reuse() {
    let _machine = crate::support::shared();
    let (d, ck, out) = case("olmoe", WeightFormat::Bf16, 1);
    let tiles = d.path().join("tiles");
    let dep = Deployment::load_converted(&topology(), &out).unwrap();
    let (topo, tiles_dir) = (topology(), tiles.to_str().unwrap().to_string());
    let prepare = |weights: &[&str], device: &str| {
        let mut args = vec!["worker", "--topology", topo.to_str().unwrap()];
        args.extend(weights);
        args.extend(["--device", device, "--prepare-tile-cache"]);
        args.extend(["--tile-cache", &tiles_dir]);
        let r = crate::support::run(&args);
        (r.code == 0, format!("{}{}", r.stdout, r.stderr))
    };
    let converted = ["--weights", out.to_str().unwrap()];
    for dev in dep.topology.devices() {
        let (ok, text) = prepare(&converted, dev.id());
        assert!(ok && text.contains("tiles kept in"), "{text}");
        let (ok, text) = prepare(&converted, dev.id());
        assert!(ok && text.contains("already kept"), "{text}");
    }
    let synthetic = [
        "--model",
        "demo-small",
        "--placement",
        "examples/single-host-demo-small.placement.toml",
    ];
    let (ok, text) = prepare(&synthetic, dep.topology.devices()[0].id());
    assert!(!ok && text.contains("no stable identity"), "{text}");
    let on_hip = ["--weights", out.to_str().unwrap(), "--backend", "hip"];
    let (ok, text) = prepare(&on_hip, dep.topology.devices()[0].id());
    assert!(!ok && text.contains("for the CPU backend"), "{text}");

    let mut o = options(&out, ComputeMode::Exact);
    o.tile_cache = Some(tiles.clone());
    let urls = serve_worker_metrics(&mut o, dep.topology.devices().len());
    let fabric = LocalFabric::start(o).unwrap();
    for url in &urls {
        tile_cache_outcome(url, &["reused", "reused_copied"]);
    }
    check_served_exactly(&ck, &out, &fabric);
    fabric.shutdown();
}

/// Gives each of `devices` workers of `o` a `--metrics` address on a free loopback port;
/// returns their URLs by device rank.
fn serve_worker_metrics(o: &mut LocalFabricOptions, devices: usize) -> Vec<String> {
    o.worker_metrics = (0..devices)
        .map(|_| std::net::SocketAddr::from(([127, 0, 0, 1], crate::support::free_port())))
        .collect();
    o.worker_metrics
        .iter()
        .map(|a| format!("http://{a}/metrics"))
        .collect()
}

/// Scrapes a worker's `url`: its start's load took time and brought in bytes, and its tile
/// cache outcome is one of `want` (exactly one outcome reads 1).
fn tile_cache_outcome(url: &str, want: &[&str]) -> crate::metrics::Scrape {
    let (status, text) = crate::metrics::http_get(url);
    assert!(status.contains(" 200 "), "{url}: {status}");
    let w = crate::metrics::Scrape::parse(&text);
    assert!(
        w.sum("expertmesh_worker_load_duration_seconds", &[]) > 0.0,
        "{text}"
    );
    assert!(w.sum("expertmesh_worker_load_bytes", &[]) > 0.0, "{text}");
    assert_eq!(w.sum("expertmesh_worker_tile_cache", &[]), 1.0, "{text}");
    let now: f64 = want
        .iter()
        .map(|o| w.sum("expertmesh_worker_tile_cache", &[("outcome", o)]))
        .sum();
    assert_eq!(now, 1.0, "outcome not one of {want:?}:\n{text}");
    w
}

/// Workers started with `--tile-cache` keep their repacked tiles (one private file per
/// device), and restarted they map those instead of reading their shards: with a nibble of
/// every device shard then changed in place, size and time kept (which a repacking load
/// refuses by the manifest's checksum), the restarted fabric still serves every layer bit for
/// bit as before.
#[test]
fn a_restarted_fabric_serves_the_tiles_its_first_start_kept() {
    use std::os::unix::fs::{FileExt, PermissionsExt};
    let _machine = crate::support::shared();
    let (d, ck, out) = case("olmoe", WeightFormat::Bf16, 1);
    let tiles = d.path().join("tiles");
    let dep = Deployment::load_converted(&topology(), &out).unwrap();
    let mut o = options(&out, ComputeMode::Exact);
    o.tile_cache = Some(tiles.clone());
    let urls = serve_worker_metrics(&mut o, dep.topology.devices().len());
    let fabric = LocalFabric::start(o.clone()).unwrap();
    check_served_exactly(&ck, &out, &fabric);
    // Each worker's metrics say its load repacked and is keeping the tiles.
    for url in &urls {
        tile_cache_outcome(url, &["writing", "written"]);
    }
    // The workers write their tiles while they serve; a stop (SIGTERM) waits for the write.
    fabric.shutdown();
    let kept: Vec<PathBuf> = std::fs::read_dir(&tiles)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "r16"))
        .collect();
    assert_eq!(kept.len(), dep.topology.devices().len(), "{kept:?}");
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&tiles), 0o700);
    assert!(kept.iter().all(|p| mode(p) == 0o400));

    // The reference, from the intact shards; then damage every device shard's first expert.
    let mut backend = reference_backend(&dep, &out);
    let w = dep.weights.as_ref().unwrap();
    for s in &w.manifest.shards {
        let path = w.path(&s.file);
        let at = ShardFile::open(&path).unwrap().index().experts[0]
            .w13
            .nibbles
            .offset;
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        let modified = f.metadata().unwrap().modified().unwrap();
        let mut b = [0u8];
        f.read_exact_at(&mut b, at).unwrap();
        f.write_all_at(&[b[0] ^ 0x11], at).unwrap();
        // Bit rot keeps the file's size and time (a rewrite would not: other content).
        f.set_modified(modified).unwrap();
        let e = ShardFile::open(&path)
            .unwrap()
            .verify(Some(s.crc32c))
            .unwrap_err();
        assert!(e.to_string().contains("checksum"), "{e}");
    }
    let setups = dep.layer_setups().unwrap();
    let urls = serve_worker_metrics(&mut o, dep.topology.devices().len());
    let fabric = LocalFabric::start(o.clone()).unwrap();
    check_served(&ck, &dep, &mut backend, &mut None, &setups, &fabric);
    // Restarted, each worker's metrics say it took its tiles from the cache (mapped, or
    // copied where the memory lock limit refused the map) and wrote none.
    for url in &urls {
        let w = tile_cache_outcome(url, &["reused", "reused_copied"]);
        assert_eq!(
            w.sum("expertmesh_worker_tile_cache_write_duration_seconds", &[]),
            0.0
        );
    }
    fabric.shutdown();

    // A shard whose time changed is other content: the kept tiles are not used, the repack
    // reads the damaged shard, and the worker refuses it.
    let first = w.path(&w.manifest.shards[0].file);
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&first)
        .unwrap();
    f.set_modified(std::time::SystemTime::now() + Duration::from_secs(5))
        .unwrap();
    let e = LocalFabric::start(o).map(|f| f.shutdown()).unwrap_err();
    assert!(e.to_string().contains("checksum mismatch"), "{e}");
}

/// What `convert` reports adds up to what it announced: the shard files it verifies, the
/// experts it checks before writing anything, then the experts and source bytes it converts;
/// a second run verifies and keeps every shard, checks nothing and reports every expert done
/// from the kept shards.
#[test]
fn convert_progress_adds_up_to_what_it_announced() {
    use expertmesh_checkpoint::convert::{ConvertJob, Progress, convert, keeps_shared_dense};
    use expertmesh_checkpoint::experts::source_quant;
    use expertmesh_checkpoint::hf_config::load_hf_model_and_family;
    use expertmesh_checkpoint::safetensors::Checkpoint;
    use expertmesh_topology::topology::Topology;
    use std::sync::Mutex;

    let dir = tempfile::tempdir().unwrap();
    let ck = write_tiny_checkpoint(
        &dir.path().join("ckpt"),
        &TinySpec::for_model_type("qwen3_moe"),
    );
    let ckpt = Checkpoint::open(&ck.dir).unwrap();
    let (mut spec, family) = load_hf_model_and_family(&ck.dir).unwrap();
    spec.quant = source_quant(&ckpt, &spec, family).unwrap();
    let topo = Topology::load(&topology()).unwrap();
    let opts = expertmesh_planner::PlanOptions::default();
    let placement = expertmesh_planner::plan(&topo, &spec, None, None, &opts)
        .unwrap()
        .placement;
    let placement_text = placement.to_toml_string();
    let out = dir.path().join("weights");
    let job = ConvertJob {
        ckpt: &ckpt,
        family,
        spec: &spec,
        topology: &topo,
        placement: &placement,
        placement_text: &placement_text,
        out: &out,
        threads: 2,
        shared_dense: keeps_shared_dense(&ckpt, &spec, family),
    };
    // Device shards (the report counts those; the router's file shows in the bytes written).
    let shards = topo.devices().len();
    let run = |written: usize| {
        let events = Mutex::new(Vec::new());
        let report = convert(&job, &|p| events.lock().unwrap().push(p)).unwrap();
        assert_eq!(
            (report.shards_written, report.shards_kept),
            (written, shards - written)
        );
        assert_eq!(report.shard_bytes_written == 0, written == 0);
        assert_eq!(report.source_bytes_converted == 0, written == 0);
        events.into_inner().unwrap()
    };
    // Per kind of event, in the enum's order: the counts it carries added up, and the number
    // of events (for Start and Done: experts and bytes added up).
    let tally = |events: &[Progress]| {
        let mut t = [(0u64, 0u64); 6];
        for p in events {
            let (i, a, b) = match *p {
                Progress::Verifying { shards } => (0, shards, 1),
                Progress::Verified { shards } => (1, shards, 0),
                Progress::Checking { experts } => (2, experts, 1),
                Progress::Checked { experts } => (3, experts, 0),
                Progress::Start { experts, bytes } => (4, experts, bytes),
                Progress::Done { experts, bytes } => (5, experts, bytes),
            };
            t[i] = (t[i].0 + a, t[i].1 + b);
        }
        t
    };
    for (round, events) in [run(shards), run(0)].into_iter().enumerate() {
        let [verifying, verified, checking, checked, start, done] = tally(&events);
        // The first run finds no shard; the second reads every one (the router's too).
        let want = if round == 0 {
            (0, 0)
        } else {
            (shards as u64 + 1, 1)
        };
        assert_eq!(verifying, want, "round {round}: {events:?}");
        assert_eq!(verified.0, verifying.0, "round {round}: {events:?}");
        if round == 0 {
            assert!(checking.0 > 0 && checking.1 == 1, "{events:?}");
        } else {
            // Every shard kept: nothing to check.
            assert_eq!(checking, (0, 0), "{events:?}");
        }
        assert_eq!(checked.0, checking.0, "round {round}: {events:?}");
        assert!(start.0 > 0 && start.1 > 0, "{events:?}");
        assert_eq!(done, start, "round {round}: {events:?}");
        let first_start = events
            .iter()
            .position(|p| matches!(p, Progress::Start { .. }))
            .unwrap();
        assert!(
            events[..first_start]
                .iter()
                .all(|p| !matches!(p, Progress::Done { .. })),
            "{events:?}"
        );
        assert!(
            events[first_start..]
                .iter()
                .all(|p| !matches!(p, Progress::Checked { .. })),
            "{events:?}"
        );
    }
}
