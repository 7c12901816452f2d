//! The shard format: what is written reads back bit for bit, and every kind of damage is an
//! error naming the file (never a panic).

use expertmesh_quant::format::{PackedRows, QuantSpec, ScaleDtype};
use expertmesh_quant::synth::synthetic_expert;
use expertmesh_shard::file::{self, ShardError, ShardFile, ShardIndex, ShardKind, ShardWriter};
use proptest::prelude::*;
use std::path::Path;

fn index(quant: QuantSpec) -> ShardIndex {
    ShardIndex {
        kind: ShardKind::Device,
        fingerprint: "abc".into(),
        device: Some("local/cpu0".into()),
        quant,
        hidden: 128,
        experts: Vec::new(),
        tensors: Vec::new(),
    }
}

/// Writes a shard of three experts and one tensor; returns the experts and the summary.
fn write(path: &Path, quant: QuantSpec) -> (Vec<expertmesh_quant::format::ExpertWeights>, u32) {
    let mut w = ShardWriter::create(path, index(quant)).unwrap();
    let experts: Vec<_> = (0..3)
        .map(|e| synthetic_expert(quant, 128, 128 * (e + 1), 7, 1, e as u32).unwrap())
        .collect();
    for (e, x) in experts.iter().enumerate() {
        w.add_expert(1, e as u32, x, 0.01 * e as f64).unwrap();
    }
    w.add_tensor_f32(
        "layers.1.gate.weight",
        &[2, 3],
        &[1.0, -2.0, 3.5, 0.0, f32::MIN_POSITIVE, 7.0],
    )
    .unwrap();
    let s = w.finish().unwrap();
    assert_eq!(s.bytes, std::fs::metadata(path).unwrap().len());
    (experts, s.crc32c)
}

#[test]
fn round_trip_is_bit_exact_for_every_format() {
    let dir = tempfile::tempdir().unwrap();
    for (i, quant) in [
        QuantSpec::G32_BF16,
        QuantSpec {
            group_size: 128,
            scale_dtype: ScaleDtype::F16,
            zero_points: true,
        },
        QuantSpec {
            group_size: 64,
            scale_dtype: ScaleDtype::Bf16,
            zero_points: true,
        },
    ]
    .into_iter()
    .enumerate()
    {
        let path = dir.path().join(format!("s{i}.emshard"));
        let (experts, crc) = write(&path, quant);
        let f = ShardFile::open(&path).unwrap();
        f.verify(Some(crc)).unwrap();
        assert_eq!(
            f.crc32c(),
            crc,
            "the summary's checksum is the whole file's"
        );
        assert_eq!(f.index().experts.len(), 3);
        for (i, want) in experts.iter().enumerate() {
            assert_eq!(&f.expert(i).unwrap(), want);
            // the in-place view reads the same codes, scales and zero points
            let (r13, r2) = f.expert_ref(i).unwrap();
            for (r, m) in [(&r13, want.w13()), (&r2, want.w2())] {
                assert_eq!(
                    (r.rows(), r.cols(), r.spec()),
                    (m.rows(), m.cols(), m.spec())
                );
                let g = m.groups_per_row();
                let (mut rs, mut ms) = (vec![0u16; g], vec![0u16; g]);
                let (mut rz, mut mz) = (vec![0u8; g], vec![0u8; g]);
                for n in 0..m.rows() {
                    r.row_scale_bits_into(n, &mut rs);
                    PackedRows::row_scale_bits_into(m, n, &mut ms);
                    assert_eq!((&rs, &ms), (&ms, &m.row_scales(n).to_vec()));
                    r.row_zeros_into(n, &mut rz);
                    PackedRows::row_zeros_into(m, n, &mut mz);
                    let want: Vec<u8> = (0..g).map(|k| m.zero(n, k)).collect();
                    assert_eq!((&rz, &mz), (&want, &want));
                    assert_eq!(r.row_nibbles(n), m.row_nibbles(n));
                    for g in 0..m.groups_per_row() {
                        assert_eq!(r.scale_bits(n, g), m.row_scales(n)[g]);
                        assert_eq!(PackedRows::zero(r, n, g), m.zero(n, g));
                    }
                }
            }
            assert_eq!(f.index().experts[i].w13.nibbles.offset % file::PAGE, 0);
        }
        let (shape, v) = f.tensor_f32("layers.1.gate.weight").unwrap();
        assert_eq!(shape, vec![2, 3]);
        assert_eq!(v[4].to_bits(), f32::MIN_POSITIVE.to_bits());
        assert!(matches!(
            f.tensor_f32("nope"),
            Err(ShardError::MissingTensor { .. })
        ));
    }
    // Only final files remain: no temporaries.
    for e in std::fs::read_dir(dir.path()).unwrap() {
        let name = e.unwrap().file_name().into_string().unwrap();
        assert!(!name.starts_with('.'), "left behind: {name}");
    }
}

#[test]
fn a_flipped_bit_fails_the_checksum_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("a.emshard");
    let (_, crc) = write(&path, QuantSpec::G32_BF16);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[file::HEADER_BYTES as usize + 100] ^= 0x10;
    std::fs::write(&path, &bytes).unwrap();
    let f = ShardFile::open(&path).unwrap();
    let e = f.verify(Some(crc)).unwrap_err();
    assert!(matches!(e, ShardError::Checksum { .. }), "{e}");
    assert!(e.to_string().contains("a.emshard"), "{e}");
}

#[test]
fn truncation_and_wrong_files_are_refused_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.emshard");
    write(&path, QuantSpec::G32_BF16);
    let bytes = std::fs::read(&path).unwrap();
    for cut in [0, 10, 4096, bytes.len() / 2, bytes.len() - 1] {
        std::fs::write(&path, &bytes[..cut]).unwrap();
        let e = ShardFile::open(&path).unwrap_err();
        assert!(matches!(e, ShardError::Corrupt { .. }), "cut {cut}: {e}");
        assert!(e.to_string().contains("t.emshard"), "{e}");
    }
    std::fs::write(&path, b"{\"not\": \"a shard\"}").unwrap();
    assert!(
        ShardFile::open(&path)
            .unwrap_err()
            .to_string()
            .contains("shorter")
    );
    let e = ShardFile::open(&dir.path().join("missing.emshard")).unwrap_err();
    assert!(matches!(e, ShardError::Io { .. }), "{e}");
}

/// `bytes` with its index replaced by `edit(index)` (re-encoded, header and checksum made to
/// match): damage a reader must find in the index's own values, past its checksum.
fn with_index(bytes: &[u8], edit: impl Fn(&mut serde_json::Value)) -> Vec<u8> {
    let u64_at = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap());
    let offset = u64_at(16) as usize;
    let mut index: serde_json::Value = serde_json::from_slice(&bytes[offset..]).unwrap();
    edit(&mut index);
    let json = serde_json::to_vec(&index).unwrap();
    let mut out = bytes[..offset].to_vec();
    out.extend_from_slice(&json);
    let len = out.len() as u64;
    out[24..32].copy_from_slice(&(json.len() as u64).to_le_bytes());
    out[32..36].copy_from_slice(&crc32c::crc32c(&json).to_le_bytes());
    out[40..48].copy_from_slice(&len.to_le_bytes());
    out
}

/// An expert whose recorded intermediate size is not its matrices' (readers size buffers from
/// it: 2^36 made a worker allocate hundreds of TiB) is refused naming the expert; the
/// untouched re-encoded index still opens.
#[test]
fn an_intermediate_size_its_matrices_do_not_have_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("i.emshard");
    write(&path, QuantSpec::G32_BF16);
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, with_index(&bytes, |_| {})).unwrap();
    ShardFile::open(&path).expect("the same index re-encoded opens");
    for inter in [1u64 << 36, 64, u64::MAX / 2 + 1] {
        let damaged = with_index(&bytes, |i| i["experts"][1]["inter"] = inter.into());
        std::fs::write(&path, damaged).unwrap();
        let e = ShardFile::open(&path).unwrap_err();
        assert!(matches!(e, ShardError::Corrupt { .. }), "{inter}: {e}");
        assert!(
            e.to_string().contains("layer 1 expert 1") && e.to_string().contains("i.emshard"),
            "{e}"
        );
    }
}

#[test]
fn an_abandoned_writer_leaves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("x.emshard");
    {
        let mut w = ShardWriter::create(&path, index(QuantSpec::G32_BF16)).unwrap();
        let x = synthetic_expert(QuantSpec::G32_BF16, 64, 32, 1, 1, 1).unwrap();
        w.add_expert(1, 0, &x, 0.0).unwrap();
        // dropped without finish: a crash mid-shard
    }
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    /// Any damage to a valid shard's header or index is an error or a valid parse, never a
    /// panic; ranges of a parse that succeeds stay inside the file.
    #[test]
    fn damaged_shards_never_panic(flips in prop::collection::vec((0usize..8192, any::<u8>()), 1..8),
                                  tail_cut in 0usize..64) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.emshard");
        write(&path, QuantSpec::G32_BF16);
        let mut bytes = std::fs::read(&path).unwrap();
        let n = bytes.len();
        for (at, v) in flips {
            // half in the header page, half in the index at the end
            let i = if at < 4096 { at } else { n - 1 - (at - 4096) % 512 };
            bytes[i] ^= v;
        }
        bytes.truncate(n - tail_cut.min(n));
        if let Ok((idx, _)) = file::parse(&bytes) {
            for e in &idx.experts {
                prop_assert!(e.w13.nibbles.offset + e.w13.nibbles.len <= bytes.len() as u64);
            }
        }
    }
}

/// A FIFO or a device where a shard or the manifest should be is refused naming the file,
/// instead of an open that waits for a writer for ever or a read that never ends.
#[test]
fn a_pipe_or_a_device_in_place_of_a_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("p.emshard");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: mkfifo on a path in our own temporary folder.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let e = ShardFile::open(&fifo).unwrap_err();
    assert!(e.to_string().contains("not a regular file"), "{e}");
    std::os::unix::fs::symlink("/dev/zero", dir.path().join("manifest.json")).unwrap();
    let e = expertmesh_shard::Manifest::load(dir.path()).unwrap_err();
    assert!(e.to_string().contains("not a regular file"), "{e}");
}
