//! `expertmesh convert` and `--weights` on bad input (issue 10): a missing tensor, a shape that
//! contradicts config.json, NaN weights, a truncated checkpoint file, a full disk, a corrupt or
//! truncated shard. Each is exit 1 (convert) or a refusal to start (worker) naming the tensor
//! or file; nothing already written is corrupted, and a re-run resumes.

use crate::hf_support::tiny::{TinySpec, write_tiny_checkpoint};
use crate::support::{Run, root, run};
use expertmesh_checkpoint::safetensors::{Checkpoint, Dtype, write_safetensors};
use expertmesh_shard::file::ShardFile;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn tiny(dir: &Path, model_type: &str) -> PathBuf {
    let ck = dir.join("ckpt");
    write_tiny_checkpoint(&ck, &TinySpec::for_model_type(model_type));
    ck
}

fn convert(ckpt: &Path, out: &Path) -> Run {
    run(&[
        "convert",
        "--threads",
        "2",
        "--checkpoint",
        ckpt.to_str().unwrap(),
        "--topology",
        "examples/single-host.toml",
        "--out",
        out.to_str().unwrap(),
    ])
}

fn convert_with(ckpt: &Path, out: &Path, placement: &Path) -> Run {
    run(&[
        "convert",
        "--checkpoint",
        ckpt.to_str().unwrap(),
        "--topology",
        "examples/single-host.toml",
        "--placement",
        placement.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ])
}

/// Rewrite `model.safetensors` through `edit(name, bytes)`: `false` drops the tensor.
fn rewrite(ckpt: &Path, edit: impl Fn(&str, &mut Vec<u8>) -> bool) {
    rewrite_typed(ckpt, |n, _, b| edit(n, b));
}

/// [`rewrite`], where `edit` may change the dtype too.
fn rewrite_typed(ckpt: &Path, edit: impl Fn(&str, &mut Dtype, &mut Vec<u8>) -> bool) {
    rewrite_shaped(ckpt, |n, d, _, b| edit(n, d, b));
}

/// [`rewrite`], where `edit` may change the dtype and the shape too.
fn rewrite_shaped(
    ckpt: &Path,
    edit: impl Fn(&str, &mut Dtype, &mut Vec<usize>, &mut Vec<u8>) -> bool,
) {
    rewrite_adding(ckpt, edit, Vec::new());
}

/// [`rewrite_shaped`], then `added` (name, dtype, shape, bytes) written beside the rest.
fn rewrite_adding(
    ckpt: &Path,
    edit: impl Fn(&str, &mut Dtype, &mut Vec<usize>, &mut Vec<u8>) -> bool,
    added: Vec<(String, Dtype, Vec<usize>, Vec<u8>)>,
) {
    let c = Checkpoint::open(ckpt).unwrap();
    let mut owned = Vec::new();
    for name in c.tensor_names() {
        let v = c.tensor(name).unwrap();
        let mut bytes = v.bytes().to_vec();
        let mut dtype = v.dtype();
        let mut shape = v.shape().to_vec();
        if edit(name, &mut dtype, &mut shape, &mut bytes) {
            owned.push((name.to_string(), dtype, shape, bytes));
        }
    }
    drop(c);
    owned.extend(added);
    let refs: Vec<_> = owned
        .iter()
        .map(|(n, d, s, b)| (n.as_str(), *d, s.as_slice(), b.as_slice()))
        .collect();
    write_safetensors(ckpt.join("model.safetensors"), &refs, &BTreeMap::new()).unwrap();
}

fn fails_naming(r: &Run, what: &str) {
    assert_eq!(r.code, 1, "stdout:\n{}\nstderr:\n{}", r.stdout, r.stderr);
    assert!(
        r.stderr.contains(what),
        "does not name {what:?}:\n{}",
        r.stderr
    );
    assert!(!r.stdout.contains("converted"), "{}", r.stdout);
}

const UP: &str = "model.layers.1.mlp.experts.3.up_proj.weight";

#[test]
fn a_missing_tensor_is_named() {
    let d = tempfile::tempdir().unwrap();
    let ck = tiny(d.path(), "qwen3_moe");
    rewrite(&ck, |n, _| n != UP);
    let out = d.path().join("w");
    fails_naming(&convert(&ck, &out), UP);
    assert!(
        !out.join("manifest.json").exists(),
        "no manifest after a failure"
    );
}

/// Every file of `out` and its bytes.
fn folder_bytes(out: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(out)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read(&p).unwrap())
        })
        .collect()
}

/// The expert read last (the highest layer's highest routed expert) of a tiny checkpoint holds
/// a down projection one row short: the conversion names it before anything is written. With
/// no earlier output, no shard is on disk; over an earlier run's complete output, its manifest
/// and every shard stay byte for byte (without the header pre-pass, the manifest was withdrawn
/// and the shards before that expert written again).
#[test]
fn a_bad_expert_of_the_last_layer_is_named_before_anything_is_written() {
    let d = tempfile::tempdir().unwrap();
    let ck = tiny(d.path(), "qwen3_moe");
    let out = d.path().join("w");
    let first = convert(&ck, &out);
    assert_eq!(first.code, 0, "{}", first.stderr);
    let before = folder_bytes(&out);
    assert!(before.contains_key("manifest.json"), "{:?}", before.keys());
    let c = Checkpoint::open(&ck).unwrap();
    let last = c
        .tensor_names()
        .filter_map(|n| {
            let rest = n.strip_prefix("model.layers.")?;
            let (layer, rest) = rest.split_once(".mlp.experts.")?;
            let expert = rest.strip_suffix(".down_proj.weight")?;
            Some((layer.parse::<u32>().ok()?, expert.parse::<u32>().ok()?))
        })
        .max()
        .expect("routed experts in the tiny checkpoint");
    drop(c);
    let bad = format!(
        "model.layers.{}.mlp.experts.{}.down_proj.weight",
        last.0, last.1
    );
    rewrite_shaped(&ck, |n, dtype, shape, bytes| {
        if n == bad {
            shape[0] -= 1;
            bytes.truncate(shape.iter().product::<usize>() * dtype.size());
        }
        true
    });
    let again = convert(&ck, &out);
    fails_naming(&again, &bad);
    assert!(again.stderr.contains("shape"), "{}", again.stderr);
    // What it did before failing is said: the earlier shards read, the tensors checked.
    for stage in ["verifying the", "checking the tensors of the"] {
        assert!(again.stderr.contains(stage), "{}", again.stderr);
    }
    let after = folder_bytes(&out);
    assert_eq!(
        before.keys().collect::<Vec<_>>(),
        after.keys().collect::<Vec<_>>(),
        "the folder's files changed"
    );
    for (name, bytes) in &before {
        assert!(after[name] == *bytes, "{name} was rewritten");
    }
    let fresh = d.path().join("fresh");
    fails_naming(&convert(&ck, &fresh), &bad);
    let written: Vec<_> = folder_bytes(&fresh).into_keys().collect();
    assert!(
        written.iter().all(|n| !n.contains(".emshard")),
        "written before the check: {written:?}"
    );
}

/// A checkpoint file cut short in place while the converter reads it (another program
/// truncating or rewriting it) ends the conversion with SIGBUS, as before, but no longer with
/// only "Bus error": stderr names the file and says what happened and what to do, and no
/// manifest is written. The cut comes right after the converter announces its job, before it
/// reads a weight (~100 MB of experts: seconds of quantizing), so it normally faults (both
/// threads; one reports). Whatever the timing, the cut file is named and nothing is
/// published: a converter that had read every weight before the cut names it as changed at
/// its end-of-run check; one that finished before the cut (a test thread held up for
/// seconds) leaves nothing to judge, and the test says so.
#[cfg(target_os = "linux")]
#[test]
fn a_checkpoint_file_cut_short_under_the_converter_is_named() {
    use std::io::{BufRead, BufReader};
    use std::os::unix::process::ExitStatusExt;
    let d = tempfile::tempdir().unwrap();
    let ck = d.path().join("ckpt");
    let mut spec = TinySpec::for_model_type("qwen3_moe");
    (spec.hidden, spec.moe_inter, spec.routed_experts, spec.files) = (1024, 512, 16, 2);
    write_tiny_checkpoint(&ck, &spec);
    let out = d.path().join("w");
    let mut child = std::process::Command::new(crate::support::bin())
        .current_dir(root())
        .args(["convert", "--threads", "2", "--checkpoint"])
        .arg(&ck)
        .args(["--topology", "examples/single-host.toml", "--out"])
        .arg(&out)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let mut said = String::new();
    while !said.contains("expertmesh convert:") {
        assert!(
            stderr.read_line(&mut said).unwrap() > 0,
            "the converter ended before it began: {said}"
        );
    }
    // Every safetensors file cut to its header: every weight is past the end.
    let files: Vec<PathBuf> = Checkpoint::open(&ck)
        .unwrap()
        .files()
        .map(Path::to_path_buf)
        .collect();
    for f in &files {
        let head = std::fs::read(f).unwrap();
        let header = u64::from_le_bytes(head[..8].try_into().unwrap());
        let file = std::fs::OpenOptions::new().write(true).open(f).unwrap();
        file.set_len(8 + header).unwrap();
    }
    let guard = std::time::Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(
            guard.elapsed() < std::time::Duration::from_secs(300),
            "hang guard: the converter did not end"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut stderr, &mut rest).unwrap();
    said.push_str(&rest);
    if status.success() {
        crate::support::say(
            "skipped: the conversion finished before the test cut its file (the test thread was \
             held up); nothing to judge",
        );
        return;
    }
    match status.signal() {
        Some(sig) => {
            assert_eq!(sig, libc::SIGBUS, "{status:?}\n{said}");
            assert!(said.contains("stopped by SIGBUS"), "{said}");
        }
        // Every weight read before the cut: the end-of-run check names the file.
        None => {
            assert_eq!(status.code(), Some(1), "{said}");
            crate::support::say("the converter read every weight before the cut: no SIGBUS");
        }
    }
    let named = files.iter().any(|f| {
        said.contains(&*f.to_string_lossy())
            || said.contains(&*std::fs::canonicalize(f).unwrap().to_string_lossy())
    });
    assert!(named, "no checkpoint file named:\n{said}");
    assert!(!out.join("manifest.json").exists());
}

/// The router file's tensors are checked from the headers before any shard is written: a
/// missing selection bias is named at once, with no device shard on disk. With
/// `topk_method = "greedy"` (a zero bias, which such checkpoints do not store) the same
/// checkpoint converts.
#[test]
fn router_tensors_are_checked_before_any_shard_and_greedy_needs_no_bias() {
    const BIAS: &str = "mlp.gate.e_score_correction_bias";
    let d = tempfile::tempdir().unwrap();
    let ck = tiny(d.path(), "deepseek_v3");
    rewrite(&ck, |n, _| !n.ends_with(BIAS));
    let out = d.path().join("w");
    fails_naming(&convert(&ck, &out), BIAS);
    let shards: Vec<_> = std::fs::read_dir(&out)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".emshard"))
        .collect();
    assert!(shards.is_empty(), "written before the check: {shards:?}");
    let config = ck.join("config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config).unwrap()).unwrap();
    v["topk_method"] = "greedy".into();
    std::fs::write(&config, v.to_string()).unwrap();
    let r = convert(&ck, &out);
    assert_eq!(r.code, 0, "{}", r.stderr);
}

#[test]
fn a_shape_that_contradicts_config_json_is_named() {
    let d = tempfile::tempdir().unwrap();
    let ck = tiny(d.path(), "qwen3_moe");
    let cfg = std::fs::read_to_string(ck.join("config.json")).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&cfg).unwrap();
    v["moe_intermediate_size"] = 64.into();
    std::fs::write(ck.join("config.json"), v.to_string()).unwrap();
    let r = convert(&ck, &d.path().join("w"));
    fails_naming(&r, "gate_proj.weight");
    assert!(r.stderr.contains("config.json"), "{}", r.stderr);
}

#[test]
fn nan_weights_and_a_nan_gate_are_named() {
    for target in [UP, "model.layers.2.mlp.gate.weight"] {
        let d = tempfile::tempdir().unwrap();
        let ck = tiny(d.path(), "qwen3_moe");
        rewrite(&ck, |n, b| {
            if n == target {
                b[10..12].copy_from_slice(&0x7FC0u16.to_le_bytes()); // bf16 NaN
            }
            true
        });
        let r = convert(&ck, &d.path().join("w"));
        fails_naming(&r, target);
        assert!(r.stderr.contains("not finite"), "{}", r.stderr);
        if target == UP {
            // The file that holds it (of a checkpoint of many: the one to re-download).
            let file = ck.join("model.safetensors");
            assert!(
                r.stderr.contains(&format!("(in {})", file.display())),
                "{}",
                r.stderr
            );
        }
    }
}

/// A router gate another quantizer packed (here U8, half the columns) is named for its dtype,
/// not as a shape that contradicts config.json.
#[test]
fn a_packed_router_gate_is_named_for_its_dtype() {
    let d = tempfile::tempdir().unwrap();
    let ck = tiny(d.path(), "qwen3_moe");
    let gate = "model.layers.2.mlp.gate.weight";
    rewrite_shaped(&ck, |n, dtype, shape, b| {
        if n == gate {
            *dtype = Dtype::U8;
            shape[1] /= 4;
            b.truncate(shape[0] * shape[1]);
        }
        true
    });
    let r = convert(&ck, &d.path().join("w"));
    fails_naming(&r, gate);
    assert!(
        r.stderr.contains("stored as U8") && !r.stderr.contains("does not match its"),
        "{}",
        r.stderr
    );
}

#[test]
fn a_truncated_checkpoint_file_is_named() {
    let d = tempfile::tempdir().unwrap();
    let ck = tiny(d.path(), "mixtral");
    let f = ck.join("model.safetensors");
    let len = std::fs::metadata(&f).unwrap().len();
    let file = std::fs::OpenOptions::new().write(true).open(&f).unwrap();
    file.set_len(len - 100).unwrap();
    fails_naming(&convert(&ck, &d.path().join("w")), "model.safetensors");
}

/// A checkpoint of several files, one of them cut to 3 bytes: named, with the reader's own
/// words, before any output changes (an earlier converted folder keeps its manifest).
#[test]
fn a_truncated_file_of_an_indexed_checkpoint_is_named_before_anything_is_written() {
    let d = tempfile::tempdir().unwrap();
    let ck = tiny(d.path(), "mixtral");
    let out = d.path().join("w");
    assert_eq!(convert(&ck, &out).code, 0, "the whole checkpoint converts");
    // An index over model.safetensors's tensors, plus one more in a 3-byte file.
    let bytes = std::fs::read(ck.join("model.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let mut map = serde_json::Map::new();
    for name in header
        .as_object()
        .unwrap()
        .keys()
        .filter(|k| *k != "__metadata__")
    {
        map.insert(name.clone(), "model.safetensors".into());
    }
    map.insert("lm_head.weight".into(), "b.safetensors".into());
    let index = serde_json::json!({ "weight_map": map });
    std::fs::write(ck.join("model.safetensors.index.json"), index.to_string()).unwrap();
    std::fs::write(ck.join("b.safetensors"), [1u8, 2, 3]).unwrap();
    let r = convert(&ck, &out);
    fails_naming(&r, "b.safetensors");
    assert!(
        r.stderr.contains("truncated") && !r.stderr.contains("failed to fill whole buffer"),
        "says the file is truncated: {}",
        r.stderr
    );
    assert!(
        out.join("manifest.json").exists(),
        "the earlier conversion's manifest is withdrawn only once the checkpoint is read"
    );
}

/// Every shard present in `out` is complete (opens and its body checksum holds).
fn all_shards_complete(out: &Path) -> usize {
    let mut n = 0;
    for e in std::fs::read_dir(out).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        assert!(
            !name.starts_with('.'),
            "a temporary file was left behind: {name}"
        );
        if name.ends_with(".emshard") {
            let f = ShardFile::open(&p).unwrap();
            f.verify(None).unwrap();
            n += 1;
        }
    }
    n
}

#[test]
fn a_full_disk_fails_naming_the_file_and_a_rerun_resumes() {
    let d = tempfile::tempdir().unwrap();
    let ck = tiny(d.path(), "deepseek_v3");
    let out = d.path().join("w");
    // An uneven placement: device 0's shard (2 experts) fits, device 1's (14) does not.
    // RLIMIT_FSIZE makes writes past 32 KiB fail with EFBIG ("File too large") once SIGXFSZ is
    // ignored, as a full disk would.
    let placement = d.path().join("uneven.toml");
    std::fs::write(
        &placement,
        "format = 1\nmodel = \"ckpt\"\ncluster = \"single-host\"\n\n[[assign]]\n\
         layers = \"all\"\ndevice = \"local/cpu0\"\nexperts = \"0\"\n\n[[assign]]\n\
         layers = \"all\"\ndevice = \"local/cpu1\"\nexperts = \"1-7\"\n\n\
         [[shared]]\nlayers = \"all\"\ndevice = \"router\"\n",
    )
    .unwrap();
    let script = format!(
        "trap '' XFSZ; ulimit -f 32; exec {} convert --threads 1 --checkpoint {} --topology \
         examples/single-host.toml --placement {} --out {}",
        env!("CARGO_BIN_EXE_expertmesh"),
        ck.display(),
        placement.display(),
        out.display()
    );
    let o = std::process::Command::new("bash")
        .args(["-c", &script])
        .current_dir(root())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains(".emshard"), "names the shard: {stderr}");
    // The shard by its own name (its temporary file is gone), and what to do.
    assert!(
        !stderr.contains(".tmp-") && stderr.contains("free space"),
        "names the shard, not its removed temporary file, and says what to do: {stderr}"
    );
    assert!(!out.join("manifest.json").exists());
    assert_eq!(
        all_shards_complete(&out),
        1,
        "the shard that fitted is kept, nothing else"
    );
    let r = convert_with(&ck, &out, &placement);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(
        r.stdout.contains("1 kept from an earlier run"),
        "{}{}",
        r.stdout,
        r.stderr
    );
    assert_eq!(all_shards_complete(&out), 3, "two devices and the router");
    let again = convert_with(&ck, &out, &placement);
    assert!(
        again.stdout.contains("0 shards written"),
        "{}",
        again.stdout
    );
    // Another placement is another job: every shard is rewritten.
    let other = convert(&ck, &out);
    assert!(
        other.stdout.contains("2 shards written"),
        "{}",
        other.stdout
    );
}

/// The checkpoint's configuration is part of the job (its quantization settings, such as
/// GPTQ's `checkpoint_format`, decide how INT4 codes are read): after `config.json` changed, a
/// re-run rewrites every shard instead of keeping the earlier ones.
#[test]
fn an_edited_config_json_is_another_job() {
    let d = tempfile::tempdir().unwrap();
    let ck = tiny(d.path(), "deepseek_v3");
    let out = d.path().join("w");
    let first = convert(&ck, &out);
    assert_eq!(first.code, 0, "{}", first.stderr);
    let again = convert(&ck, &out);
    assert!(
        again.stdout.contains("0 shards written, 2 kept"),
        "{}",
        again.stdout
    );
    let config = ck.join("config.json");
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config).unwrap()).unwrap();
    json["quantization_note"] = serde_json::json!("an edit the model description does not see");
    std::fs::write(&config, json.to_string()).unwrap();
    let edited = convert(&ck, &out);
    assert_eq!(edited.code, 0, "{}", edited.stderr);
    assert!(
        edited.stdout.contains("2 shards written, 0 kept"),
        "{}",
        edited.stdout
    );
}

/// Weights rewritten in place (a new download or snapshot of the same revision: same names,
/// sizes and headers, other bytes) are another job: a re-run converts them again instead of
/// keeping shards made from the old bytes. A re-run that then fails leaves no manifest
/// beside its shards: a folder with a manifest is complete.
#[test]
fn weights_rewritten_in_place_are_converted_again_and_a_failed_rerun_withdraws_the_manifest() {
    let d = tempfile::tempdir().unwrap();
    let ck = tiny(d.path(), "deepseek_v3");
    let out = d.path().join("w");
    let first = convert(&ck, &out);
    assert_eq!(first.code, 0, "{}", first.stderr);
    let sha = |out: &Path| {
        let m = expertmesh_shard::Manifest::load(out).unwrap();
        m.source
            .files
            .iter()
            .map(|f| f.sha256.clone())
            .collect::<Vec<_>>()
    };
    let before = sha(&out);
    let file = ck.join("model.safetensors");
    let modified = std::fs::metadata(&file).unwrap().modified().unwrap();
    // Negate every routed expert's up projection in place (flip each bf16 sign bit): same
    // size and header, other bytes.
    let mut bytes = std::fs::read(&file).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let mut flipped = 0;
    for (name, t) in header.as_object().unwrap() {
        if name.contains(".mlp.experts.") && name.ends_with("up_proj.weight") {
            let at = |i: usize| 8 + n + t["data_offsets"][i].as_u64().unwrap() as usize;
            bytes[at(0)..at(1)]
                .chunks_exact_mut(2)
                .for_each(|v| v[1] ^= 0x80);
            flipped += 1;
        }
    }
    assert!(
        flipped > 0,
        "no routed up projection in the tiny checkpoint"
    );
    std::fs::write(&file, &bytes).unwrap();
    // A later time whatever the file system's clock granularity.
    let f = std::fs::File::options().write(true).open(&file).unwrap();
    f.set_modified(modified + std::time::Duration::from_secs(2))
        .unwrap();
    drop(f);
    let again = convert(&ck, &out);
    assert_eq!(again.code, 0, "{}", again.stderr);
    assert!(
        again.stdout.contains("2 shards written, 0 kept"),
        "shards of the old bytes kept: {}",
        again.stdout
    );
    assert_ne!(sha(&out), before, "the manifest names the new bytes");
    // A re-run that fails: the earlier manifest does not survive it.
    rewrite(&ck, |n, b| {
        if n.contains(".mlp.experts.") && n.ends_with("down_proj.weight") {
            b[0..2].copy_from_slice(&0x7FC0u16.to_le_bytes()); // bf16 NaN
        }
        true
    });
    let failed = convert(&ck, &out);
    assert_eq!(failed.code, 1, "{}", failed.stderr);
    assert!(failed.stderr.contains("not finite"), "{}", failed.stderr);
    assert!(
        !out.join("manifest.json").exists(),
        "a manifest beside shards of a failed run"
    );
}

/// An FP8 checkpoint whose scale blocks are not 128 × 128 is refused naming
/// `weight_block_size`; a router gate stored as FP8 is refused naming the tensor (read as it is,
/// its block scales would be skipped).
/// Two conversions into one folder would withdraw and write each other's manifest and
/// shards: while one holds the folder, another is refused naming it, and nothing of the
/// folder changes; once it is let go, a conversion runs.
#[test]
fn a_conversion_into_a_folder_another_is_writing_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let ck = tiny(d.path(), "mixtral");
    let out = d.path().join("w");
    assert_eq!(convert(&ck, &out).code, 0);
    let manifest = std::fs::read(out.join("manifest.json")).unwrap();
    // This test holds the folder as a running conversion does.
    let held = expertmesh_files::lock_folder(&out).unwrap();
    let r = convert(&ck, &out);
    fails_naming(
        &r,
        "another `expertmesh convert` is writing into this folder",
    );
    assert_eq!(std::fs::read(out.join("manifest.json")).unwrap(), manifest);
    drop(held);
    assert_eq!(convert(&ck, &out).code, 0);
}

/// A tiny DeepSeek-V3 checkpoint with FP8 block-scaled experts, in `dir/ckpt`.
fn fp8_block_checkpoint(dir: &Path) -> PathBuf {
    use crate::hf_support::tiny::WeightFormat;
    let ck = dir.join("ckpt");
    let spec = TinySpec::for_model_type("deepseek_v3").with_dtype(WeightFormat::Fp8Block);
    write_tiny_checkpoint(&ck, &spec);
    ck
}

/// An FP8 block scale of zero (a damaged file: it would make its block zeros, converted
/// "exactly") is refused naming the scale tensor and the block.
#[test]
fn a_zero_fp8_block_scale_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let ck = fp8_block_checkpoint(d.path());
    rewrite_typed(&ck, |n, _, b| {
        if n.contains(".experts.") && n.ends_with("_scale_inv") {
            b.fill(0);
        }
        true
    });
    let r = convert(&ck, &d.path().join("w"));
    fails_naming(&r, "_scale_inv");
    assert!(
        r.stderr.contains("block (0, 0) has scale 0"),
        "{}",
        r.stderr
    );
}

/// An FP8 weight whose scales are missing (neither DeepSeek-V3's `…weight_scale_inv` nor
/// compressed-tensors' `…weight_scale`) is refused before anything is written, naming both;
/// one with a zero point beside its scales (asymmetric FP8) is refused naming the zero point.
#[test]
fn fp8_without_scales_or_with_a_zero_point_is_refused_naming_them() {
    let d = tempfile::tempdir().unwrap();
    let ck = fp8_block_checkpoint(d.path());
    rewrite(&ck, |n, _| !n.ends_with("_scale_inv"));
    let out = d.path().join("w");
    let r = convert(&ck, &out);
    fails_naming(&r, "weight_scale_inv");
    assert!(
        r.stderr.contains("weight_scale\"") && r.stderr.contains("without its scales"),
        "{}",
        r.stderr
    );
    assert!(
        !out.join("device-0000.emshard").exists(),
        "refused before any shard"
    );
    // With its scales, but an FP8 zero point beside one (asymmetric FP8): refused naming it.
    let d = tempfile::tempdir().unwrap();
    let ck = fp8_block_checkpoint(d.path());
    let zero = format!("{UP}_zero_point");
    let added = (
        zero.clone(),
        Dtype::F32,
        vec![1],
        0f32.to_le_bytes().to_vec(),
    );
    rewrite_adding(&ck, |_, _, _, _| true, vec![added]);
    let out = d.path().join("w");
    let r = convert(&ck, &out);
    fails_naming(&r, &zero);
    assert!(r.stderr.contains("asymmetric FP8"), "{}", r.stderr);
    assert!(
        !out.join("device-0000.emshard").exists(),
        "refused before any shard"
    );
}

/// A block size that is not two whole numbers is refused naming `weight_block_size`; one that
/// does not match the stored grids (16 × 16 blocks named, 128 × 128 stored) names the scale
/// grid of the wrong shape; an FP8 gate is refused naming its dtype.
#[test]
fn fp8_blocks_that_do_not_fit_and_an_fp8_gate_are_refused() {
    let d = tempfile::tempdir().unwrap();
    let ck = fp8_block_checkpoint(d.path());
    let config = ck.join("config.json");
    let text = std::fs::read_to_string(&config).unwrap();
    let mut json: serde_json::Value = serde_json::from_str(&text).unwrap();
    json["quantization_config"]["weight_block_size"] = serde_json::json!([0, 128]);
    std::fs::write(&config, json.to_string()).unwrap();
    let r = convert(&ck, &d.path().join("w"));
    fails_naming(&r, "weight_block_size");
    assert!(
        r.stderr.contains("weight_block_size [0,128]"),
        "{}",
        r.stderr
    );
    json["quantization_config"]["weight_block_size"] = serde_json::json!([16, 16]);
    std::fs::write(&config, json.to_string()).unwrap();
    let r = convert(&ck, &d.path().join("w1"));
    fails_naming(&r, "_scale_inv");
    std::fs::write(&config, &text).unwrap();
    let gate = std::sync::Mutex::new(None);
    rewrite_typed(&ck, |n, dtype, b| {
        if n.ends_with(".mlp.gate.weight") && *dtype == Dtype::BF16 {
            *b = b
                .chunks_exact(2)
                .map(|v| {
                    let x = f32::from_bits(u32::from(u16::from_le_bytes([v[0], v[1]])) << 16);
                    expertmesh_quant::fp8::f32_to_e4m3(x)
                })
                .collect();
            *dtype = Dtype::F8E4M3;
            gate.lock().unwrap().get_or_insert(n.to_string());
        }
        true
    });
    let r = convert(&ck, &d.path().join("w2"));
    let gate = gate
        .into_inner()
        .unwrap()
        .expect("the checkpoint has a gate");
    fails_naming(&r, "F8_E4M3");
    assert!(r.stderr.contains(".mlp.gate.weight"), "{}", r.stderr);
    assert!(
        !d.path().join("w2").join("device-0000.emshard").exists(),
        "{gate}: refused before any shard"
    );
}

/// Header values a pack-quantized expert's tensors must not be trusted with: a zero-row
/// scale tensor whose other dimension overflows a multiplication, and a `weight_shape` that is
/// not two numbers. Each is refused naming the tensor (exit 1), not a panic.
#[test]
fn packed_tensors_with_impossible_shapes_are_named_not_a_panic() {
    use crate::hf_support::tiny::WeightFormat;
    type Edit = Box<dyn Fn(&mut Vec<usize>, &mut Vec<u8>)>;
    let cases: [(&str, Edit); 2] = [
        (
            ".experts.3.up_proj.weight_scale",
            Box::new(|shape, bytes| {
                *shape = vec![0, 1 << 62];
                bytes.clear();
            }),
        ),
        (
            ".experts.3.up_proj.weight_shape",
            Box::new(|shape, bytes| {
                *shape = vec![4];
                bytes.resize(16, 0);
            }),
        ),
    ];
    for (suffix, edit) in cases {
        let d = tempfile::tempdir().unwrap();
        let ck = d.path().join("ckpt");
        let spec = TinySpec::for_model_type("kimi_k2").with_dtype(WeightFormat::PackQuantized);
        write_tiny_checkpoint(&ck, &spec);
        let target = std::sync::Mutex::new(None);
        rewrite_shaped(&ck, |n, _, shape, bytes| {
            if n.ends_with(suffix) && target.lock().unwrap().is_none() {
                edit(shape, bytes);
                *target.lock().unwrap() = Some(n.to_string());
            }
            true
        });
        let target = target.into_inner().unwrap().expect("the tensor is there");
        fails_naming(&convert(&ck, &d.path().join("w")), &target);
    }
}

/// Temporary files of a conversion that was killed (no process has their id any more) are
/// removed by the next run into the folder; one of a process that still runs is left alone,
/// and so is one a live writer holds locked whatever its name says (a writer in another PID
/// namespace, where its id runs nothing here).
#[test]
fn a_killed_conversions_temporary_files_are_removed_by_the_next() {
    let d = tempfile::tempdir().unwrap();
    let ck = tiny(d.path(), "deepseek_v3");
    let out = d.path().join("w");
    std::fs::create_dir_all(&out).unwrap();
    // No process has this id (Linux ids stay below 2^22); this test's own process runs.
    let dead = 999_999_999u32;
    let live = std::process::id();
    let stale = [
        format!(".device-0001.emshard.tmp-{dead}-3"),
        format!(".manifest.json.tmp-{dead}"),
    ];
    let running = format!(".device-0000.emshard.tmp-{live}-0");
    for name in stale.iter().chain([&running]) {
        std::fs::write(out.join(name), vec![7u8; 4096]).unwrap();
    }
    let held = format!(".device-0002.emshard.tmp-{dead}-9");
    let lock = expertmesh_files::create_locked(&out.join(&held), None).unwrap();
    let r = convert(&ck, &out);
    assert_eq!(r.code, 0, "{}", r.stderr);
    for name in &stale {
        assert!(!out.join(name).exists(), "{name} was left behind");
    }
    assert!(
        out.join(&running).exists(),
        "a running process's file was removed"
    );
    assert!(out.join(&held).exists(), "a locked file was removed");
    drop(lock);
}

fn worker(out: &Path) -> Run {
    run(&[
        "worker",
        "--topology",
        "examples/single-host.toml",
        "--weights",
        out.to_str().unwrap(),
        "--device",
        "local/cpu1",
        "--router",
        "127.0.0.1:1",
    ])
}

#[test]
fn a_corrupt_or_truncated_shard_stops_the_worker_naming_the_file() {
    let d = tempfile::tempdir().unwrap();
    let ck = tiny(d.path(), "olmoe");
    let out = d.path().join("w");
    assert_eq!(convert(&ck, &out).code, 0);
    let shard = out.join("device-0001.emshard");
    let good = std::fs::read(&shard).unwrap();
    let mut flipped = good.clone();
    flipped[5000] ^= 1;
    std::fs::write(&shard, &flipped).unwrap();
    let r = worker(&out);
    assert_ne!(r.code, 0);
    assert!(
        r.stderr.contains("device-0001.emshard") && r.stderr.contains("checksum"),
        "{}",
        r.stderr
    );
    std::fs::write(&shard, &good[..good.len() - 7]).unwrap();
    let r = worker(&out);
    assert_ne!(r.code, 0);
    assert!(r.stderr.contains("device-0001.emshard"), "{}", r.stderr);
    // --weights with --model is a usage error
    let r = run(&[
        "worker",
        "--topology",
        "examples/single-host.toml",
        "--weights",
        out.to_str().unwrap(),
        "--model",
        "demo-small",
        "--device",
        "0",
    ]);
    assert_eq!(r.code, 2, "{}", r.stderr);
}

#[test]
fn weights_for_another_cluster_are_refused() {
    let d = tempfile::tempdir().unwrap();
    let ck = tiny(d.path(), "olmoe");
    let out = d.path().join("w");
    assert_eq!(convert(&ck, &out).code, 0);
    let r = run(&[
        "worker",
        "--topology",
        "examples/rx7900xtx-1x2.toml",
        "--weights",
        out.to_str().unwrap(),
        "--device",
        "0",
        "--router",
        "127.0.0.1:1",
    ]);
    assert_ne!(r.code, 0);
    assert!(r.stderr.contains("converted for cluster"), "{}", r.stderr);
}
