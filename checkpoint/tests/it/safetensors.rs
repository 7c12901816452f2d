//! The safetensors reader, writer and checkpoint folder: round trips, exact conversions, and
//! every kind of bad input giving its own error that names the file and the tensor.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use expertmesh_checkpoint::safetensors::{
    Checkpoint, Dtype, MAX_HEADER_LEN, SafetensorsError, SafetensorsFile, TensorData, e4m3_to_f32,
    parse_header, write_safetensors,
};
use half::{bf16, f16};
use proptest::prelude::*;
use tempfile::TempDir;

type Owned = (String, Dtype, Vec<usize>, Vec<u8>);

fn write(path: &Path, tensors: &[Owned], metadata: &BTreeMap<String, String>) {
    let borrowed: Vec<TensorData<'_>> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.as_str(), *d, s.as_slice(), b.as_slice()))
        .collect();
    write_safetensors(path, &borrowed, metadata).unwrap();
}

fn tensor(name: &str, dtype: Dtype, shape: &[usize], seed: u8) -> Owned {
    let len = shape.iter().product::<usize>() * dtype.size();
    let bytes = (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect();
    (name.to_string(), dtype, shape.to_vec(), bytes)
}

/// A file of a hand-written header and `data_len` zero bytes.
fn raw_file(dir: &TempDir, name: &str, header: &str, data_len: usize) -> PathBuf {
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.resize(bytes.len() + data_len, 0);
    let path = dir.path().join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

fn open_err(path: &Path) -> SafetensorsError {
    SafetensorsFile::open(path).expect_err("the file should be refused")
}

/// The error's message names `path`'s file and each of `names`.
fn assert_names(err: &SafetensorsError, path: &Path, names: &[&str]) {
    let msg = err.to_string();
    assert!(
        msg.contains(&path.display().to_string()),
        "{msg} should name {}",
        path.display()
    );
    for name in names {
        assert!(msg.contains(name), "{msg} should name {name}");
    }
}

#[test]
fn round_trip_several_dtypes_and_shapes() {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("m.safetensors");
    let tensors = vec![
        tensor("layers.0.w", Dtype::BF16, &[2, 3], 1),
        tensor("layers.0.b", Dtype::F16, &[4], 2),
        tensor("cube", Dtype::F32, &[2, 2, 2], 3),
        tensor("scalar", Dtype::I64, &[], 4),
        tensor("empty", Dtype::U8, &[0, 5], 5),
        tensor("fp8", Dtype::F8E4M3, &[3, 2], 6),
        tensor("mask", Dtype::Bool, &[1], 7),
        tensor("wide", Dtype::F64, &[3], 8),
    ];
    let metadata = BTreeMap::from([("format".to_string(), "pt".to_string())]);
    write(&path, &tensors, &metadata);

    let raw = std::fs::read(&path).unwrap();
    let header_len = u64::from_le_bytes(raw[..8].try_into().unwrap()) as usize;
    assert_eq!(header_len % 8, 0, "header padded to 8 bytes");
    assert_eq!(
        raw.len(),
        8 + header_len + tensors.iter().map(|t| t.3.len()).sum::<usize>()
    );

    let file = SafetensorsFile::open(&path).unwrap();
    assert_eq!(file.len(), tensors.len());
    assert_eq!(file.metadata(), &metadata);
    let infos: Vec<_> = file.tensors().collect();
    assert!(
        infos.windows(2).all(|w| w[0].data.end <= w[1].data.start),
        "file order"
    );
    for (name, dtype, shape, bytes) in &tensors {
        let view = file.tensor(name).unwrap();
        assert_eq!(
            (view.name(), view.dtype(), view.shape()),
            (name.as_str(), *dtype, &shape[..])
        );
        assert_eq!(view.bytes(), &bytes[..]);
        let info = file.info(name).unwrap();
        assert_eq!(&raw[info.data.clone()], &bytes[..]);
        assert_eq!(info.num_bytes(), bytes.len());
    }
    assert_eq!(
        parse_header(&raw, raw.len() as u64).unwrap(),
        infos.into_iter().cloned().collect::<Vec<_>>()
    );
    // The header alone is enough for parse_header.
    assert_eq!(
        parse_header(&raw[..8 + header_len], raw.len() as u64)
            .unwrap()
            .len(),
        tensors.len()
    );
}

fn convert_all(dir: &TempDir, dtype: Dtype, bytes: Vec<u8>) -> Vec<f32> {
    let path = dir.path().join(format!("{dtype}.safetensors"));
    let n = bytes.len() / dtype.size();
    write(
        &path,
        &[("t".into(), dtype, vec![n], bytes)],
        &BTreeMap::new(),
    );
    let file = SafetensorsFile::open(&path).unwrap();
    let mut out = vec![0.0; n];
    file.tensor("t").unwrap().to_f32_into(&mut out).unwrap();
    out
}

fn same(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

#[test]
fn bf16_and_f16_convert_exactly_like_half() {
    let dir = TempDir::new().unwrap();
    let codes: Vec<u8> = (0..=u16::MAX).flat_map(u16::to_le_bytes).collect();
    let from_bf16 = convert_all(&dir, Dtype::BF16, codes.clone());
    let from_f16 = convert_all(&dir, Dtype::F16, codes);
    for code in 0..=u16::MAX {
        let i = code as usize;
        assert!(
            same(from_bf16[i], bf16::from_bits(code).to_f32()),
            "bf16 {code:#06x}"
        );
        assert!(
            same(from_f16[i], f16::from_bits(code).to_f32()),
            "f16 {code:#06x}"
        );
    }
}

/// E4M3FN from its definition: sign, 4-bit exponent (bias 7), 3-bit mantissa, subnormals at
/// exponent 0, no infinities, S.1111.111 is NaN.
fn e4m3_reference(code: u8) -> f32 {
    let sign = if code & 0x80 != 0 { -1.0f64 } else { 1.0 };
    let exp = i32::from((code >> 3) & 0xF);
    let man = f64::from(code & 0x7);
    if exp == 15 && man == 7.0 {
        return f32::NAN;
    }
    let magnitude = if exp == 0 {
        man / 8.0 * 2f64.powi(1 - 7)
    } else {
        (1.0 + man / 8.0) * 2f64.powi(exp - 7)
    };
    (sign * magnitude) as f32
}

#[test]
fn e4m3_all_256_codes_match_the_definition() {
    let dir = TempDir::new().unwrap();
    let converted = convert_all(&dir, Dtype::F8E4M3, (0..=255).collect());
    for code in 0..=255u8 {
        let want = e4m3_reference(code);
        assert!(
            same(converted[code as usize], want),
            "code {code:#04x}: {} vs {want}",
            converted[code as usize]
        );
        assert!(same(e4m3_to_f32(code), want));
    }
    assert_eq!(e4m3_to_f32(0x7E), 448.0);
    assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
    assert!(e4m3_to_f32(0x7F).is_nan() && e4m3_to_f32(0xFF).is_nan());
    assert_eq!(e4m3_to_f32(0x80).to_bits(), (-0.0f32).to_bits());
    assert_eq!(
        converted.iter().filter(|x| x.is_nan()).count(),
        2,
        "no other NaN, no infinity"
    );
    assert!(converted.iter().all(|x| !x.is_infinite()));
}

#[test]
fn f32_f64_and_e5m2_convert() {
    let dir = TempDir::new().unwrap();
    let values = [0.0f32, -1.5, 3.25e-3, f32::MAX, f32::INFINITY];
    let f32s = convert_all(
        &dir,
        Dtype::F32,
        values.iter().flat_map(|v| v.to_le_bytes()).collect(),
    );
    assert_eq!(f32s, values);
    let f64s = convert_all(
        &dir,
        Dtype::F64,
        [1.0f64, -2.5]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
    );
    assert_eq!(f64s, [1.0, -2.5]);
    let e5m2 = convert_all(&dir, Dtype::F8E5M2, vec![0x3C, 0xC0, 0x7C, 0x01]);
    assert_eq!(e5m2[..3], [1.0, -2.0, f32::INFINITY]);
    assert_eq!(e5m2[3], 2f32.powi(-16));
}

#[test]
fn rows_give_bounded_chunks_of_a_matrix() {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("m.safetensors");
    let values: Vec<f32> = (0..15).map(|i| i as f32).collect();
    let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    write(
        &path,
        &[
            ("w".into(), Dtype::F32, vec![5, 3], bytes),
            tensor("s", Dtype::F32, &[], 1),
            tensor("i", Dtype::I32, &[2], 2),
        ],
        &BTreeMap::new(),
    );
    let file = SafetensorsFile::open(&path).unwrap();
    let w = file.tensor("w").unwrap();
    let mid = w.rows(1..4).unwrap();
    assert_eq!(mid.shape(), [3, 3]);
    assert_eq!(mid.to_f32_vec().unwrap(), values[3..12]);
    assert_eq!(w.rows(2..2).unwrap().num_elements(), 0);
    let chunks: Vec<_> = w.row_chunks(2).collect();
    assert_eq!(
        chunks.iter().map(|c| c.shape()[0]).collect::<Vec<_>>(),
        [2, 2, 1]
    );
    let joined: Vec<f32> = chunks
        .iter()
        .flat_map(|c| c.to_f32_vec().unwrap())
        .collect();
    assert_eq!(joined, values);

    let err = w.rows(4..6).unwrap_err();
    assert!(
        matches!(
            err,
            SafetensorsError::RowsOutOfRange {
                start: 4,
                end: 6,
                count: 5,
                ..
            }
        ),
        "{err}"
    );
    assert_names(&err, &path, &["\"w\""]);
    let err = file.tensor("s").unwrap().rows(0..1).unwrap_err();
    assert!(matches!(err, SafetensorsError::NoRows { .. }), "{err}");
    let err = w.to_f32_into(&mut [0.0; 14]).unwrap_err();
    assert!(
        matches!(
            err,
            SafetensorsError::BufferLength {
                expected: 15,
                actual: 14,
                ..
            }
        ),
        "{err}"
    );
    let err = file.tensor("i").unwrap().to_f32_vec().unwrap_err();
    assert!(
        matches!(
            err,
            SafetensorsError::UnsupportedConversion {
                dtype: Dtype::I32,
                ..
            }
        ),
        "{err}"
    );
    assert_names(&err, &path, &["\"i\""]);
}

fn index_json(map: &[(&str, &str)]) -> String {
    let weight_map: BTreeMap<_, _> = map.iter().copied().collect();
    serde_json::json!({"metadata": {"total_size": 0}, "weight_map": weight_map}).to_string()
}

#[test]
fn index_with_two_shards() {
    let dir = TempDir::new().unwrap();
    let (s1, s2) = (
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    );
    let a = tensor("a", Dtype::BF16, &[4, 2], 1);
    let b = tensor("b", Dtype::F32, &[3], 2);
    let c = tensor("c", Dtype::F8E4M3, &[2, 2], 3);
    write(
        &dir.path().join(s1),
        &[a.clone(), b.clone()],
        &BTreeMap::new(),
    );
    write(
        &dir.path().join(s2),
        std::slice::from_ref(&c),
        &BTreeMap::new(),
    );
    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        index_json(&[("a", s1), ("b", s1), ("c", s2)]),
    )
    .unwrap();

    let ckpt = Checkpoint::open(dir.path()).unwrap();
    assert_eq!(ckpt.tensor_names().collect::<Vec<_>>(), ["a", "b", "c"]);
    assert_eq!(ckpt.len(), 3);
    assert_eq!(ckpt.files().count(), 2);
    assert_eq!(ckpt.file_of("c").unwrap(), dir.path().join(s2));
    for t in [&a, &b, &c] {
        let view = ckpt.tensor(&t.0).unwrap();
        assert_eq!(
            (view.dtype(), view.shape(), view.bytes()),
            (t.1, &t.2[..], &t.3[..])
        );
    }
    assert_eq!(ckpt.tensor_info("c").unwrap().shape, [2, 2]);
    // Each file is opened once: the same file serves every tensor in it.
    assert!(std::ptr::eq(
        ckpt.file_for("a").unwrap(),
        ckpt.file_for("b").unwrap()
    ));
}

#[test]
fn single_file_checkpoint() {
    let dir = TempDir::new().unwrap();
    write(
        &dir.path().join("model.safetensors"),
        &[tensor("x", Dtype::F16, &[2], 1)],
        &BTreeMap::new(),
    );
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    assert_eq!(ckpt.tensor_names().collect::<Vec<_>>(), ["x"]);
    assert_eq!(ckpt.tensor("x").unwrap().num_elements(), 2);
    let err = ckpt.tensor("y").unwrap_err();
    assert!(
        matches!(&err, SafetensorsError::UnknownTensor { tensor, .. } if tensor == "y"),
        "{err}"
    );
}

#[test]
fn truncated_and_oversized_headers_are_refused() {
    let dir = TempDir::new().unwrap();
    let short = dir.path().join("short.safetensors");
    std::fs::write(&short, [1, 2, 3]).unwrap();
    let err = open_err(&short);
    assert!(
        matches!(err, SafetensorsError::TooShort { len: 3, .. }),
        "{err}"
    );
    assert_names(&err, &short, &["re-download"]);
    let empty = dir.path().join("empty.safetensors");
    std::fs::write(&empty, []).unwrap();
    assert!(matches!(
        open_err(&empty),
        SafetensorsError::TooShort { len: 0, .. }
    ));

    let past = dir.path().join("past.safetensors");
    let mut bytes = 1000u64.to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{}");
    std::fs::write(&past, bytes).unwrap();
    let err = open_err(&past);
    assert!(
        matches!(
            err,
            SafetensorsError::HeaderPastEnd {
                header_len: 1000,
                available: 2,
                ..
            }
        ),
        "{err}"
    );
    assert_names(&err, &past, &["truncated"]);

    let huge = dir.path().join("huge.safetensors");
    let mut bytes = (MAX_HEADER_LEN + 1).to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{}");
    std::fs::write(&huge, bytes).unwrap();
    let err = open_err(&huge);
    assert!(
        matches!(err, SafetensorsError::HeaderTooLarge { .. }),
        "{err}"
    );
    assert_names(&err, &huge, &[]);

    let missing = dir.path().join("nope.safetensors");
    let err = open_err(&missing);
    assert!(matches!(err, SafetensorsError::Io { .. }), "{err}");
    assert_names(&err, &missing, &[]);
}

#[test]
fn malformed_headers_are_refused() {
    let dir = TempDir::new().unwrap();
    let cases: [(&str, &str, usize); 6] = [
        ("json", r#"{"a": {"dtype": "F32""#, 0),
        ("array", "[1, 2]", 0),
        ("utf8", "{\"\u{0}\u{7f}", 0),
        ("field", r#"{"w": {"dtype": "F32", "shape": [1]}}"#, 4),
        ("metadata", r#"{"__metadata__": {"k": 1}}"#, 0),
        (
            "dup",
            r#"{"w": {"dtype":"U8","shape":[1],"data_offsets":[0,1]}, "w": {"dtype":"U8","shape":[1],"data_offsets":[1,2]}}"#,
            2,
        ),
    ];
    for (name, header, data) in cases {
        let path = raw_file(&dir, name, header, data);
        let err = open_err(&path);
        let ok = match name {
            "json" | "array" | "utf8" => matches!(err, SafetensorsError::BadJson { .. }),
            "field" => matches!(&err, SafetensorsError::BadEntry { tensor, .. } if tensor == "w"),
            "metadata" => matches!(err, SafetensorsError::BadMetadata { .. }),
            _ => matches!(&err, SafetensorsError::DuplicateTensor { tensor, .. } if tensor == "w"),
        };
        assert!(ok, "{name}: {err:?}");
        assert_names(&err, &path, &[]);
    }
    let bad_utf8 = dir.path().join("bytes");
    let mut bytes = 4u64.to_le_bytes().to_vec();
    bytes.extend_from_slice(&[b'{', 0xFF, 0xFE, b'}']);
    std::fs::write(&bad_utf8, bytes).unwrap();
    assert!(matches!(
        open_err(&bad_utf8),
        SafetensorsError::BadJson { .. }
    ));
}

#[test]
fn inconsistent_tensors_are_refused() {
    let dir = TempDir::new().unwrap();
    let path = raw_file(
        &dir,
        "dtype",
        r#"{"w": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}"#,
        1,
    );
    let err = open_err(&path);
    assert!(
        matches!(&err, SafetensorsError::UnknownDtype { tensor, dtype, .. } if tensor == "w" && dtype == "F4")
    );
    assert_names(&err, &path, &["\"w\"", "F4"]);

    let path = raw_file(
        &dir,
        "size",
        r#"{"w": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 10]}}"#,
        10,
    );
    let err = open_err(&path);
    assert!(
        matches!(
            err,
            SafetensorsError::SizeMismatch {
                expected: Some(12),
                actual: 10,
                ..
            }
        ),
        "{err}"
    );
    assert_names(&err, &path, &["\"w\"", "12", "10"]);

    let huge = format!(
        r#"{{"w": {{"dtype": "F32", "shape": [{}, 4], "data_offsets": [0, 0]}}}}"#,
        u64::MAX / 2
    );
    let err = open_err(&raw_file(&dir, "overflow", &huge, 0));
    assert!(
        matches!(err, SafetensorsError::SizeMismatch { expected: None, .. }),
        "{err}"
    );
    // Empty, but a row of it could not be counted: slicing rows would overflow.
    let empty_huge = format!(
        r#"{{"w": {{"dtype": "BF16", "shape": [0, {}, 4], "data_offsets": [0, 0]}}}}"#,
        u64::MAX / 4
    );
    let path = raw_file(&dir, "empty-overflow", &empty_huge, 0);
    let err = open_err(&path);
    assert!(
        matches!(&err, SafetensorsError::BadEntry { tensor, .. } if tensor == "w"),
        "{err}"
    );
    assert_names(&err, &path, &["\"w\"", "2^64"]);

    let path = raw_file(
        &dir,
        "reversed",
        r#"{"w": {"dtype": "U8", "shape": [0], "data_offsets": [4, 2]}}"#,
        8,
    );
    let err = open_err(&path);
    assert!(
        matches!(
            err,
            SafetensorsError::OffsetsReversed {
                begin: 4,
                end: 2,
                ..
            }
        ),
        "{err}"
    );
    assert_names(&err, &path, &["\"w\""]);

    let path = raw_file(
        &dir,
        "past",
        r#"{"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}"#,
        12,
    );
    let err = open_err(&path);
    assert!(
        matches!(
            err,
            SafetensorsError::OffsetsPastEnd {
                end: 16,
                data_len: 12,
                ..
            }
        ),
        "{err}"
    );
    assert_names(&err, &path, &["\"w\"", "re-download"]);

    let overlap = r#"{"a": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]},
                      "b": {"dtype": "U8", "shape": [4], "data_offsets": [6, 10]}}"#;
    let path = raw_file(&dir, "overlap", overlap, 10);
    let err = open_err(&path);
    assert!(
        matches!(&err, SafetensorsError::Overlap { first, second, .. } if first == "a" && second == "b"),
        "{err}"
    );
    assert_names(&err, &path, &["\"a\"", "\"b\""]);
}

#[test]
fn truncated_data_is_refused() {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("cut.safetensors");
    write(
        &path,
        &[
            tensor("a", Dtype::F32, &[8], 1),
            tensor("b", Dtype::F32, &[8], 2),
        ],
        &BTreeMap::new(),
    );
    let len = std::fs::metadata(&path).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(len - 1)
        .unwrap();
    let err = open_err(&path);
    assert!(
        matches!(&err, SafetensorsError::OffsetsPastEnd { tensor, .. } if tensor == "b"),
        "{err}"
    );
}

/// A Hugging Face cache snapshot copied without `-L`: every file a link to a blob that is not
/// there. Said as such (a link to what), not "has no model files" or "does not exist".
#[test]
fn links_to_nothing_are_named_as_links() {
    use std::os::unix::fs::symlink;
    let dir = TempDir::new().unwrap();
    let blob = "../../blobs/0f3c";
    symlink(blob, dir.path().join("model.safetensors.index.json")).unwrap();
    let err = Checkpoint::open(dir.path()).unwrap_err();
    assert!(
        matches!(&err, SafetensorsError::DanglingLink { target, .. } if target.to_str() == Some(blob)),
        "{err}"
    );
    assert_names(
        &err,
        dir.path(),
        &["model.safetensors.index.json", blob, "cp -rL"],
    );
    // The single file, and a shard an index names.
    std::fs::remove_file(dir.path().join("model.safetensors.index.json")).unwrap();
    symlink(blob, dir.path().join("model.safetensors")).unwrap();
    let err = Checkpoint::open(dir.path()).unwrap_err();
    assert!(
        matches!(err, SafetensorsError::DanglingLink { .. }),
        "{err}"
    );
    std::fs::remove_file(dir.path().join("model.safetensors")).unwrap();
    let shard = "model-00001-of-00001.safetensors";
    symlink(blob, dir.path().join(shard)).unwrap();
    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        index_json(&[("a", shard)]),
    )
    .unwrap();
    let err = Checkpoint::open(dir.path()).unwrap_err();
    assert!(
        matches!(&err, SafetensorsError::DanglingLink { link, .. } if link.ends_with(shard)),
        "{err}"
    );
}

#[test]
fn missing_tensors_and_files_are_named() {
    let dir = TempDir::new().unwrap();
    let err = Checkpoint::open(dir.path()).unwrap_err();
    assert!(
        matches!(err, SafetensorsError::NoCheckpointFiles { .. }),
        "{err}"
    );
    assert_names(
        &err,
        dir.path(),
        &["model.safetensors.index.json", "model.safetensors"],
    );

    let shard = "model-00001-of-00002.safetensors";
    write(
        &dir.path().join(shard),
        &[tensor("a", Dtype::U8, &[1], 1)],
        &BTreeMap::new(),
    );
    let index = dir.path().join("model.safetensors.index.json");
    std::fs::write(
        &index,
        index_json(&[
            ("a", shard),
            ("ghost", shard),
            ("z", "model-00002-of-00002.safetensors"),
        ]),
    )
    .unwrap();
    let err = Checkpoint::open(dir.path()).unwrap_err();
    assert!(
        matches!(&err, SafetensorsError::MissingShard { tensor, .. } if tensor == "z"),
        "{err}"
    );
    assert_names(&err, &index, &["model-00002-of-00002.safetensors", "\"z\""]);

    std::fs::write(&index, index_json(&[("a", shard), ("ghost", shard)])).unwrap();
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let err = ckpt.tensor("ghost").unwrap_err();
    assert!(
        matches!(&err, SafetensorsError::TensorNotInShard { tensor, .. } if tensor == "ghost"),
        "{err}"
    );
    assert_names(&err, &index, &["\"ghost\"", shard]);
    let err = ckpt.tensor("nope").unwrap_err();
    assert!(
        matches!(&err, SafetensorsError::UnknownTensor { tensor, .. } if tensor == "nope"),
        "{err}"
    );
    assert_names(&err, &index, &["\"nope\""]);

    let file = SafetensorsFile::open(dir.path().join(shard)).unwrap();
    let err = file.tensor("nope").unwrap_err();
    assert!(
        matches!(&err, SafetensorsError::TensorNotFound { tensor, .. } if tensor == "nope"),
        "{err}"
    );
    assert_names(&err, &dir.path().join(shard), &["\"nope\""]);

    for bad in [
        r#"{"weight_map": 3}"#.to_string(),
        index_json(&[("a", "../escape.safetensors")]),
    ] {
        std::fs::write(&index, bad).unwrap();
        let err = Checkpoint::open(dir.path()).unwrap_err();
        assert!(matches!(err, SafetensorsError::BadIndex { .. }), "{err}");
        assert_names(&err, &index, &[]);
    }
}

#[test]
fn writer_refuses_bad_tensors_and_leaves_no_temp_file() {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("w.safetensors");
    let bytes = [0u8; 6];
    let cases: [&[TensorData<'_>]; 3] = [
        &[("a", Dtype::F32, &[2], &bytes)],
        &[
            ("a", Dtype::U8, &[6], &bytes),
            ("a", Dtype::U8, &[6], &bytes),
        ],
        &[("__metadata__", Dtype::U8, &[6], &bytes)],
    ];
    for tensors in cases {
        let err = write_safetensors(&path, tensors, &BTreeMap::new()).unwrap_err();
        assert!(
            matches!(err, SafetensorsError::WriteInvalid { .. }),
            "{err}"
        );
        assert_names(&err, &path, &[tensors[0].0]);
    }
    write_safetensors(
        &path,
        &[("a", Dtype::U8, &[2, 3], &bytes)],
        &BTreeMap::new(),
    )
    .unwrap();
    write_safetensors(&path, &[("b", Dtype::U8, &[6], &bytes)], &BTreeMap::new()).unwrap();
    assert_eq!(
        SafetensorsFile::open(&path)
            .unwrap()
            .tensors()
            .map(|t| t.name.as_str())
            .collect::<Vec<_>>(),
        ["b"]
    );
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, ["w.safetensors"], "no temporary files left");
}

fn tensor_set() -> impl Strategy<Value = Vec<Owned>> {
    let one = (
        prop::sample::select(Dtype::ALL.to_vec()),
        prop::collection::vec(0usize..5, 0..4),
        any::<u8>(),
    );
    prop::collection::vec(one, 0..8).prop_map(|specs| {
        specs
            .into_iter()
            .enumerate()
            .map(|(i, (dtype, shape, seed))| tensor(&format!("t{i}.weight"), dtype, &shape, seed))
            .collect()
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn random_tensor_sets_round_trip(tensors in tensor_set(), meta in prop::collection::btree_map("[a-z]{1,4}", ".{0,6}", 0..3)) {
        let dir = TempDir::new().unwrap();
        let path = dir.path().join("p.safetensors");
        write(&path, &tensors, &meta);
        let file = SafetensorsFile::open(&path).unwrap();
        prop_assert_eq!(file.len(), tensors.len());
        prop_assert_eq!(file.metadata(), &meta);
        for (name, dtype, shape, bytes) in &tensors {
            let view = file.tensor(name).unwrap();
            prop_assert_eq!(view.dtype(), *dtype);
            prop_assert_eq!(view.shape(), &shape[..]);
            prop_assert_eq!(view.bytes(), &bytes[..]);
        }
    }

    #[test]
    fn corrupted_headers_never_panic(tensors in tensor_set(), flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6), cut in any::<prop::sample::Index>()) {
        let dir = TempDir::new().unwrap();
        let path = dir.path().join("c.safetensors");
        write(&path, &tensors, &BTreeMap::new());
        let mut bytes = std::fs::read(&path).unwrap();
        for (at, value) in flips {
            let i = at.index(bytes.len());
            bytes[i] = value;
        }
        let len = cut.index(bytes.len() + 1);
        for file_len in [len as u64, bytes.len() as u64, u64::MAX] {
            if let Ok(infos) = parse_header(&bytes[..len], file_len) {
                for info in infos {
                    prop_assert!(info.data.start <= info.data.end && info.data.end as u64 <= file_len);
                }
            }
        }
    }
}

/// A checkpoint folder that is not there is said so, not reported as a folder without model
/// files; an empty folder is the latter.
#[test]
fn a_missing_folder_and_an_empty_one_are_told_apart() {
    let dir = TempDir::new().unwrap();
    let missing = dir.path().join("not-downloaded");
    let e = Checkpoint::open(&missing).unwrap_err();
    assert!(matches!(e, SafetensorsError::Io { .. }), "{e}");
    assert!(e.to_string().contains("not-downloaded"), "{e}");
    let e = Checkpoint::open(dir.path()).unwrap_err();
    assert!(
        matches!(e, SafetensorsError::NoCheckpointFiles { .. }),
        "{e}"
    );
}
