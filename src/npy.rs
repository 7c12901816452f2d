//! Minimal `.npy` (NumPy format 1.0/2.0/3.0) reading and writing for `expertmesh infer`.
//!
//! Why this exists: frontends and people testing a fabric hand hidden states around as NumPy
//! files. Only what `infer` needs is supported: 2-D little-endian C-order arrays of f32 (`<f4`),
//! f16 (`<f2`) and bf16 stored as raw u16 (`<u2`, NumPy has no bf16), and f64 (`<f8`, NumPy's
//! default, narrowed to f32). Every length in the header is checked before anything is
//! allocated, and bad files get an error naming the problem. [`read_header`] reads only the
//! header, so a caller can refuse a file by its shape before reading its data.

use half::{bf16, f16};
use std::path::Path;

/// Element type of an array file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NpyDtype {
    /// `<f4`.
    F32,
    /// `<f2`.
    F16,
    /// `<u2` holding bfloat16 bit patterns.
    Bf16Bits,
    /// `<f8`, read narrowed to f32.
    F64,
}

impl NpyDtype {
    fn descr(self) -> &'static str {
        match self {
            NpyDtype::F32 => "<f4",
            NpyDtype::F16 => "<f2",
            NpyDtype::Bf16Bits => "<u2",
            NpyDtype::F64 => "<f8",
        }
    }

    /// Bytes per element in the file.
    pub fn size(self) -> usize {
        match self {
            NpyDtype::F64 => 8,
            NpyDtype::F32 => 4,
            NpyDtype::F16 | NpyDtype::Bf16Bits => 2,
        }
    }
}

/// A 2-D array read from a file, widened to f32.
#[derive(Clone, Debug, PartialEq)]
pub struct Array2 {
    /// Rows.
    pub rows: usize,
    /// Columns.
    pub cols: usize,
    /// The file's element type.
    pub dtype: NpyDtype,
    /// Row-major values.
    pub data: Vec<f32>,
}

/// The header of an array file: element type and 2-D shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// The file's element type.
    pub dtype: NpyDtype,
    /// Rows.
    pub rows: usize,
    /// Columns.
    pub cols: usize,
}

/// Why a file could not be read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NpyError {
    /// I/O failure. (The cause is part of the message, not a separate source, so that printing
    /// the error chain says it once.)
    #[error("{path}: {cause}")]
    Io {
        /// File.
        path: String,
        /// Cause.
        cause: std::io::Error,
    },
    /// Not a valid or supported `.npy` file.
    #[error("{path}: {what}")]
    Format {
        /// File.
        path: String,
        /// The problem and what to do.
        what: String,
    },
}

/// Parse `.npy` bytes.
pub fn parse(path: &str, bytes: &[u8]) -> Result<Array2, NpyError> {
    let bad = |what: String| NpyError::Format {
        path: path.to_string(),
        what,
    };
    let (header, end) = header_text(bytes).map_err(bad)?;
    let (dtype, descr, rows, cols) = parse_header(header).map_err(bad)?;
    let body = &bytes[end..];
    check_data_len(body.len() as u64, dtype, descr, rows, cols).map_err(bad)?;
    let data = match dtype {
        NpyDtype::F32 => body
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        NpyDtype::F16 => body
            .chunks_exact(2)
            .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        NpyDtype::Bf16Bits => body
            .chunks_exact(2)
            .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        NpyDtype::F64 => body
            .chunks_exact(8)
            .map(|b| f64::from_le_bytes(b.try_into().expect("8 bytes")) as f32)
            .collect(),
    };
    Ok(Array2 {
        rows,
        cols,
        dtype,
        data,
    })
}

/// The data of a `rows × cols` array of `dtype` is `data_len` bytes, as the shape needs.
fn check_data_len(
    data_len: u64,
    dtype: NpyDtype,
    descr: &str,
    rows: usize,
    cols: usize,
) -> Result<(), String> {
    let need = (rows as u64)
        .checked_mul(cols as u64)
        .and_then(|n| n.checked_mul(dtype.size() as u64))
        .ok_or_else(|| format!("shape ({rows}, {cols}) is more than any file holds"))?;
    if data_len != need {
        return Err(format!(
            "data has {data_len} bytes, shape ({rows}, {cols}) of {descr} needs {need}"
        ));
    }
    Ok(())
}

/// Parsing step 1: check the magic and version; the header text and where the data starts.
fn header_text(bytes: &[u8]) -> Result<(&str, usize), String> {
    if bytes.len() < 10 || &bytes[..6] != b"\x93NUMPY" {
        return Err("not a .npy file (missing \\x93NUMPY magic)".into());
    }
    let major = bytes[6];
    let (hlen, start): (usize, usize) = match major {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        2 | 3 => {
            if bytes.len() < 12 {
                return Err("truncated header".into());
            }
            (
                u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize,
                12,
            )
        }
        v => return Err(format!("unsupported .npy format version {v}")),
    };
    let end = start
        .checked_add(hlen)
        .filter(|&e| e <= bytes.len())
        .ok_or_else(|| "header longer than the file".to_owned())?;
    let header =
        std::str::from_utf8(&bytes[start..end]).map_err(|_| "header is not UTF-8".to_owned())?;
    Ok((header, end))
}

/// Parsing step 2: the header's dtype (and its `descr`), and the 2-D shape.
fn parse_header(header: &str) -> Result<(NpyDtype, &str, usize, usize), String> {
    let field = |key: &str| -> Option<&str> {
        let i = header.find(&format!("'{key}'"))?;
        let rest = &header[i + key.len() + 2..];
        let rest = rest.trim_start().strip_prefix(':')?.trim_start();
        Some(rest)
    };
    let descr = field("descr")
        .and_then(|r| r.strip_prefix('\''))
        .and_then(|r| r.split('\'').next())
        .ok_or_else(|| "header has no 'descr'".to_owned())?;
    let dtype = match descr {
        "<f4" => NpyDtype::F32,
        "<f2" => NpyDtype::F16,
        "<u2" => NpyDtype::Bf16Bits,
        "<f8" => NpyDtype::F64,
        other => {
            return Err(format!(
                "dtype {other:?} is not supported; use float32 (<f4), float16 (<f2), bf16 bits as uint16 (<u2) or float64 (<f8, converted to float32)"
            ));
        }
    };
    let fortran =
        field("fortran_order").ok_or_else(|| "header has no 'fortran_order'".to_owned())?;
    if fortran.starts_with("True") {
        return Err(
            "Fortran-order arrays are not supported; save with np.ascontiguousarray".into(),
        );
    }
    let shape = field("shape")
        .and_then(|r| r.strip_prefix('('))
        .and_then(|r| r.split(')').next())
        .ok_or_else(|| "header has no 'shape'".to_owned())?;
    let dims: Vec<usize> = shape
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.parse::<usize>()
                .map_err(|_| format!("bad shape entry {s:?}"))
        })
        .collect::<Result<_, _>>()?;
    if dims.len() != 2 {
        return Err(format!(
            "array has {} dimensions; expected 2-D [tokens, hidden]",
            dims.len()
        ));
    }
    Ok((dtype, descr, dims[0], dims[1]))
}

/// Read a `.npy` file.
pub fn read(path: &Path) -> Result<Array2, NpyError> {
    let p = path.display().to_string();
    let bytes = std::fs::read(path).map_err(|cause| NpyError::Io {
        path: p.clone(),
        cause,
    })?;
    parse(&p, &bytes)
}

/// Read only the header of a `.npy` file (its dtype and shape), not its data; the file's size
/// must be what the shape needs (a truncated file, or a header whose shape no data backs, is
/// refused here, before anything is sized by it).
pub fn read_header(path: &Path) -> Result<Header, NpyError> {
    use std::io::Read;
    let p = path.display().to_string();
    let io = |cause| NpyError::Io {
        path: p.clone(),
        cause,
    };
    let bad = |what: String| NpyError::Format {
        path: p.clone(),
        what,
    };
    let mut f = std::fs::File::open(path).map_err(io)?;
    let mut start = Vec::with_capacity(12);
    f.by_ref().take(12).read_to_end(&mut start).map_err(io)?;
    if start.len() < 10 {
        return Err(bad("not a .npy file (shorter than a header)".into()));
    }
    let hlen = match start[6] {
        1 => (u16::from_le_bytes([start[8], start[9]]) as u64).saturating_sub(2),
        _ if start.len() == 12 => {
            u32::from_le_bytes([start[8], start[9], start[10], start[11]]) as u64
        }
        _ => return Err(bad("truncated header".into())),
    };
    // A header is a short dict; refuse absurd lengths instead of reading them.
    if hlen > 1 << 20 {
        return Err(bad(format!("header of {hlen} bytes is not a .npy header")));
    }
    let file_len = f.metadata().map_err(io)?.len();
    f.take(hlen).read_to_end(&mut start).map_err(io)?;
    let (header, end) = header_text(&start).map_err(bad)?;
    let (dtype, descr, rows, cols) = parse_header(header).map_err(bad)?;
    check_data_len(
        file_len.saturating_sub(end as u64),
        dtype,
        descr,
        rows,
        cols,
    )
    .map_err(bad)?;
    Ok(Header { dtype, rows, cols })
}

/// Encode a 2-D array as `.npy` (version 1.0) bytes in `dtype`.
pub fn encode(rows: usize, cols: usize, data: &[f32], dtype: NpyDtype) -> Vec<u8> {
    assert_eq!(data.len(), rows * cols);
    let mut header = format!(
        "{{'descr': '{}', 'fortran_order': False, 'shape': ({rows}, {cols}), }}",
        dtype.descr()
    );
    // pad so that magic(6)+version(2)+len(2)+header is a multiple of 64, ending in '\n'
    let total = 10 + header.len() + 1;
    header.push_str(&" ".repeat((64 - total % 64) % 64));
    header.push('\n');
    let mut out = Vec::with_capacity(10 + header.len() + data.len() * dtype.size());
    out.extend_from_slice(b"\x93NUMPY\x01\x00");
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    for &v in data {
        match dtype {
            NpyDtype::F32 => out.extend_from_slice(&v.to_le_bytes()),
            NpyDtype::F16 => out.extend_from_slice(&f16::from_f32(v).to_le_bytes()),
            NpyDtype::Bf16Bits => out.extend_from_slice(&bf16::from_f32(v).to_le_bytes()),
            NpyDtype::F64 => out.extend_from_slice(&f64::from(v).to_le_bytes()),
        }
    }
    out
}

/// Write a 2-D f32 array.
pub fn write(
    path: &Path,
    rows: usize,
    cols: usize,
    data: &[f32],
    dtype: NpyDtype,
) -> Result<(), NpyError> {
    expertmesh_files::write_output(path, &encode(rows, cols, data, dtype)).map_err(|cause| {
        NpyError::Io {
            path: path.display().to_string(),
            cause,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn round_trip(rows in 0usize..5, cols in 0usize..70, seed in any::<u32>()) {
            let data: Vec<f32> = (0..rows * cols).map(|i| ((i as u32 ^ seed) % 256) as f32 - 128.0).collect();
            for dt in [NpyDtype::F32, NpyDtype::F16, NpyDtype::Bf16Bits, NpyDtype::F64] {
                let bytes = encode(rows, cols, &data, dt);
                prop_assert_eq!(bytes[8] as usize + 10 + data.len() * dt.size(), bytes.len());
                let a = parse("x", &bytes).unwrap();
                prop_assert_eq!(a.rows, rows);
                prop_assert_eq!(a.cols, cols);
                prop_assert_eq!(a.data, data.clone()); // small integers are exact in f16 and bf16
            }
        }

        #[test]
        fn garbage_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..200)) {
            let _ = parse("g", &bytes);
            let mut v = b"\x93NUMPY\x01\x00".to_vec();
            v.extend_from_slice(&bytes);
            let _ = parse("g", &v);
        }
    }

    #[test]
    fn the_header_is_read_without_the_data() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.npy");
        std::fs::write(&p, encode(3, 5, &[1.5; 15], NpyDtype::F64)).unwrap();
        let h = read_header(&p).unwrap();
        assert_eq!((h.dtype, h.rows, h.cols), (NpyDtype::F64, 3, 5));
        assert_eq!(read(&p).unwrap().data, vec![1.5f32; 15]);
        // A file shorter than its shape needs is refused from its size alone.
        let mut b = encode(3, 5, &[1.5; 15], NpyDtype::F64);
        b.truncate(b.len() - 40);
        std::fs::write(&p, &b).unwrap();
        assert!(
            read_header(&p)
                .unwrap_err()
                .to_string()
                .contains("needs 120")
        );
        assert!(read(&p).unwrap_err().to_string().contains("needs 120"));
        // A tiny file whose header claims 10^10 values: refused, nothing sized by it.
        let small = encode(1, 1, &[0.0], NpyDtype::F32);
        let at = small.windows(6).position(|w| w == b"(1, 1)").unwrap();
        let shape = b"(100000, 100000)";
        let mut huge = small[..at].to_vec();
        huge.extend_from_slice(shape);
        // The same header length: as many padding spaces fewer.
        let rest = &small[at + 6..];
        let pad = rest.iter().rposition(|&c| c == b' ').unwrap();
        huge.extend_from_slice(&rest[..pad + 1 - (shape.len() - 6)]);
        huge.extend_from_slice(&rest[pad + 1..]);
        assert_eq!(huge.len(), small.len());
        std::fs::write(&p, huge).unwrap();
        let e = read_header(&p).unwrap_err().to_string();
        assert!(e.contains("needs 40000000000"), "{e}");
        std::fs::write(&p, b"\x93NUMPY").unwrap();
        assert!(read_header(&p).is_err());
    }

    #[test]
    fn problems_are_named() {
        let mut b = encode(2, 3, &[0.0; 6], NpyDtype::F32);
        b.pop();
        assert!(parse("f", &b).unwrap_err().to_string().contains("needs 24"));
        let b = String::from("\u{93}NUMPY").into_bytes();
        assert!(parse("f", &b).is_err());
        let mut text = encode(2, 3, &[0.0; 6], NpyDtype::F32);
        let at = text.windows(3).position(|w| w == b"<f4").unwrap();
        text[at..at + 3].copy_from_slice(b"<i8");
        let e = parse("f", &text).unwrap_err().to_string();
        assert!(e.contains("not supported"), "{e}");
    }
}
