//! Payload encodings of activations and results, and conversions between them and `f32`.
//!
//! Why this exists: the router chooses per dispatch how activations travel (bf16 for accuracy,
//! fp8 e4m3 to halve the bytes, the exact-mode int8 block format to make exact mode lossless
//! and 44% smaller than bf16). Sender and receiver must agree byte for byte on each layout, so
//! the layouts and their conversions live next to the codec that carries them.
//!
//! Layouts of a `[tokens][hidden]` activation payload (little endian):
//! - `Bf16`, `F16`: `tokens·hidden` 2-byte values; `F32`: 4-byte values.
//! - `Fp8E4m3`: `tokens·hidden` e4m3 codes, zero padding to a multiple of 64, then `tokens` f32
//!   scales; value = decode(code) · scale\[token\]. The encoder picks scale = amax / 448.
//! - `Q8Block32`: `tokens·hidden` int8 codes (the exact-mode activation quantization of
//!   `expertmesh_quant::contract` §1), zero padding to a multiple of 64, then
//!   `tokens·hidden/32` f32 block scales; `hidden` must be a multiple of 32.
//!
//! Result payloads (`OutputDtype`) are rows of f32 or bf16 values (bf16: round to nearest even
//! of the worker's f32 row, [`round_to_bf16`]); what the fabric sends per token in each serving
//! mode is measured on encoded frames by `codec::wire_bytes_per_token`.

use crate::align::align_up;
use half::{bf16, f16};

/// Encoding of activation payloads (dispatch and layer requests).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum ActivationDtype {
    /// bfloat16.
    Bf16 = 1,
    /// IEEE half precision.
    F16 = 2,
    /// IEEE single precision.
    F32 = 3,
    /// fp8 e4m3 (OCP "e4m3fn": no infinities, max 448) with one f32 scale per token.
    Fp8E4m3 = 4,
    /// int8 codes with one f32 scale per 32-element block (exact-mode activation format).
    Q8Block32 = 5,
}

/// Encoding of result payloads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum OutputDtype {
    /// IEEE single precision (exact mode returns f32 rows).
    F32 = 3,
    /// bfloat16.
    Bf16 = 1,
}

/// Why a conversion cannot be done.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum DtypeError {
    /// Buffer sizes do not match the shape.
    #[error("{what}: expected {expected} elements/bytes, got {got}")]
    Length {
        /// Which buffer.
        what: &'static str,
        /// Expected size.
        expected: usize,
        /// Actual size.
        got: usize,
    },
    /// The shape is not representable in this dtype.
    #[error(
        "shape [{tokens}][{hidden}] is not valid for {dtype:?} (q8-block32 needs hidden % 32 == 0)"
    )]
    Shape {
        /// Token count.
        tokens: usize,
        /// Hidden size.
        hidden: usize,
        /// Dtype.
        dtype: ActivationDtype,
    },
    /// A NaN or infinity where the format needs finite values.
    #[error(
        "non-finite value {value} at token {token}, element {index}; reject NaN/inf inputs before encoding"
    )]
    NonFinite {
        /// Token index.
        token: usize,
        /// Element index within the token.
        index: usize,
        /// The value.
        value: f32,
    },
}

impl ActivationDtype {
    /// The dtype for a wire byte.
    pub fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            1 => Self::Bf16,
            2 => Self::F16,
            3 => Self::F32,
            4 => Self::Fp8E4m3,
            5 => Self::Q8Block32,
            _ => return None,
        })
    }

    /// Name used on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Self::Bf16 => "bf16",
            Self::F16 => "f16",
            Self::F32 => "f32",
            Self::Fp8E4m3 => "fp8-e4m3",
            Self::Q8Block32 => "q8-block32",
        }
    }

    /// Payload bytes of a `[tokens][hidden]` activation, or `None` when the shape overflows or
    /// is invalid for this dtype.
    pub fn payload_bytes(self, tokens: usize, hidden: usize) -> Option<u64> {
        let n = (tokens as u64).checked_mul(hidden as u64)?;
        if n > (usize::MAX / 8) as u64 {
            return None;
        }
        match self {
            Self::Bf16 | Self::F16 => n.checked_mul(2),
            Self::F32 => n.checked_mul(4),
            Self::Fp8E4m3 => (align_up(n as usize) as u64).checked_add((tokens as u64) * 4),
            Self::Q8Block32 => {
                if !hidden.is_multiple_of(32) {
                    return None;
                }
                (align_up(n as usize) as u64).checked_add(n / 32 * 4)
            }
        }
    }

    /// Byte offset of the scales inside the payload, for the scaled formats.
    pub fn scales_offset(self, tokens: usize, hidden: usize) -> Option<usize> {
        match self {
            Self::Fp8E4m3 | Self::Q8Block32 => Some(align_up(tokens * hidden)),
            _ => None,
        }
    }
}

impl OutputDtype {
    /// The dtype for a wire byte.
    pub fn from_u8(v: u8) -> Option<Self> {
        match v {
            1 => Some(Self::Bf16),
            3 => Some(Self::F32),
            _ => None,
        }
    }

    /// Bytes per element.
    pub fn elem_bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::Bf16 => 2,
        }
    }
}

fn check_len(what: &'static str, expected: usize, got: usize) -> Result<(), DtypeError> {
    if expected != got {
        return Err(DtypeError::Length {
            what,
            expected,
            got,
        });
    }
    Ok(())
}

pub use expertmesh_quant::fp8::{E4M3_MAX, e4m3_to_f32, f32_to_e4m3};

/// Encodes `src` (`[tokens][hidden]` f32) into `dst` in `dtype`'s payload layout. `dst` must be
/// exactly [`ActivationDtype::payload_bytes`] long.
pub fn encode_activations(
    dtype: ActivationDtype,
    tokens: usize,
    hidden: usize,
    src: &[f32],
    dst: &mut [u8],
) -> Result<(), DtypeError> {
    check_len("source f32 values", tokens * hidden, src.len())?;
    encode_rows(
        dtype,
        tokens,
        hidden,
        |t| &src[t * hidden..(t + 1) * hidden],
        dst,
    )
}

/// Encodes the rows `token_ids` of `src` (`[T][hidden]` f32) into `dst`, in that order, in
/// `dtype`'s payload layout: the gather and the encoding are one pass (no intermediate copy of
/// the rows).
pub fn encode_activations_gather(
    dtype: ActivationDtype,
    hidden: usize,
    src: &[f32],
    token_ids: &[u32],
    dst: &mut [u8],
) -> Result<(), DtypeError> {
    let rows = src.len() / hidden.max(1);
    if let Some(&t) = token_ids.iter().find(|&&t| t as usize >= rows) {
        return Err(DtypeError::Length {
            what: "gathered token index",
            expected: rows,
            got: t as usize,
        });
    }
    encode_rows(
        dtype,
        token_ids.len(),
        hidden,
        |j| {
            let t = token_ids[j] as usize;
            &src[t * hidden..(t + 1) * hidden]
        },
        dst,
    )
}

/// The one activation encoder: row `t` of the payload comes from `row(t)`.
fn encode_rows<'a>(
    dtype: ActivationDtype,
    tokens: usize,
    hidden: usize,
    row: impl Fn(usize) -> &'a [f32],
    dst: &mut [u8],
) -> Result<(), DtypeError> {
    let n = tokens * hidden;
    let bytes = payload_len(dtype, tokens, hidden)?;
    check_len("destination payload bytes", bytes, dst.len())?;
    match dtype {
        ActivationDtype::Bf16 => {
            let w = 2 * hidden;
            for t in 0..tokens {
                for (o, &x) in dst[t * w..(t + 1) * w].chunks_exact_mut(2).zip(row(t)) {
                    o.copy_from_slice(&bf16::from_f32(x).to_le_bytes());
                }
            }
        }
        ActivationDtype::F16 => {
            let w = 2 * hidden;
            for t in 0..tokens {
                for (o, &x) in dst[t * w..(t + 1) * w].chunks_exact_mut(2).zip(row(t)) {
                    o.copy_from_slice(&f16::from_f32(x).to_le_bytes());
                }
            }
        }
        ActivationDtype::F32 => {
            let w = 4 * hidden;
            for t in 0..tokens {
                for (o, &x) in dst[t * w..(t + 1) * w].chunks_exact_mut(4).zip(row(t)) {
                    o.copy_from_slice(&x.to_le_bytes());
                }
            }
        }
        ActivationDtype::Fp8E4m3 => {
            let (codes, rest) = dst.split_at_mut(align_up(n));
            rest_zero(&mut codes[n..]);
            for t in 0..tokens {
                let row = row(t);
                let mut amax = 0f32;
                for (i, &x) in row.iter().enumerate() {
                    if !x.is_finite() {
                        return Err(DtypeError::NonFinite {
                            token: t,
                            index: i,
                            value: x,
                        });
                    }
                    amax = amax.max(x.abs());
                }
                let scale = if amax > 0.0 { amax / E4M3_MAX } else { 1.0 };
                let inv = 1.0 / scale;
                for (o, &x) in codes[t * hidden..(t + 1) * hidden].iter_mut().zip(row) {
                    *o = f32_to_e4m3(x * inv);
                }
                rest[t * 4..t * 4 + 4].copy_from_slice(&scale.to_le_bytes());
            }
        }
        ActivationDtype::Q8Block32 => {
            for t in 0..tokens {
                if let Some((i, &x)) = row(t).iter().enumerate().find(|(_, x)| !x.is_finite()) {
                    return Err(DtypeError::NonFinite {
                        token: t,
                        index: i,
                        value: x,
                    });
                }
            }
            rest_zero(&mut dst[n..align_up(n)]);
            let mut q = vec![0i8; hidden];
            let mut d = vec![0f32; hidden / 32];
            for t in 0..tokens {
                expertmesh_quant::contract::quantize_activations(row(t), &mut q, &mut d);
                write_q8_row(dst, tokens, hidden, t, &q, &d);
            }
        }
    }
    Ok(())
}

/// [`ActivationDtype::payload_bytes`], or the shape error naming the dtype.
fn payload_len(dtype: ActivationDtype, tokens: usize, hidden: usize) -> Result<usize, DtypeError> {
    dtype
        .payload_bytes(tokens, hidden)
        .map(|b| b as usize)
        .ok_or(DtypeError::Shape {
            tokens,
            hidden,
            dtype,
        })
}

fn rest_zero(b: &mut [u8]) {
    b.iter_mut().for_each(|x| *x = 0);
}

/// Decodes a payload in `dtype`'s layout into `[tokens][hidden]` f32 values (q8 and fp8 values
/// are dequantized: code × scale).
pub fn decode_activations(
    dtype: ActivationDtype,
    tokens: usize,
    hidden: usize,
    src: &[u8],
    dst: &mut [f32],
) -> Result<(), DtypeError> {
    let n = tokens * hidden;
    check_len("destination f32 values", n, dst.len())?;
    let bytes = payload_len(dtype, tokens, hidden)?;
    check_len("source payload bytes", bytes, src.len())?;
    let scale_at =
        |off: usize| f32::from_le_bytes([src[off], src[off + 1], src[off + 2], src[off + 3]]);
    match dtype {
        ActivationDtype::Bf16 => {
            for (o, b) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *o = bf16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        ActivationDtype::F16 => {
            for (o, b) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *o = f16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        ActivationDtype::F32 => {
            for (o, b) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        ActivationDtype::Fp8E4m3 => {
            let base = align_up(n);
            for t in 0..tokens {
                let s = scale_at(base + t * 4);
                for i in 0..hidden {
                    dst[t * hidden + i] = e4m3_to_f32(src[t * hidden + i]) * s;
                }
            }
        }
        ActivationDtype::Q8Block32 => {
            let base = align_up(n);
            for (i, o) in dst.iter_mut().enumerate() {
                let s = scale_at(base + (i / 32) * 4);
                *o = (src[i] as i8) as f32 * s;
            }
        }
    }
    Ok(())
}

/// Splits a q8-block32 payload into its int8 codes `[tokens][hidden]` and f32 block scales
/// `[tokens][hidden/32]` (copied into `codes` / `scales`), the exact-mode kernel inputs.
pub fn q8_split(
    tokens: usize,
    hidden: usize,
    src: &[u8],
    codes: &mut [i8],
    scales: &mut [f32],
) -> Result<(), DtypeError> {
    let n = tokens * hidden;
    let bytes = payload_len(ActivationDtype::Q8Block32, tokens, hidden)?;
    check_len("source payload bytes", bytes, src.len())?;
    check_len("codes", n, codes.len())?;
    check_len("scales", n / 32, scales.len())?;
    for (o, &b) in codes.iter_mut().zip(&src[..n]) {
        *o = b as i8;
    }
    let base = align_up(n);
    for (o, b) in scales.iter_mut().zip(src[base..].chunks_exact(4)) {
        *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
    Ok(())
}

/// Writes row `j` of a q8-block32 payload of `tokens` rows: its int8 codes `q` (`hidden`) at
/// `j·hidden` and its f32 block scales `d` (`hidden/32`, little-endian) at
/// `align_up(tokens·hidden) + j·hidden/32·4`. This function and [`q8_view`] are the only places
/// that know the q8 wire layout.
pub fn write_q8_row(
    payload: &mut [u8],
    tokens: usize,
    hidden: usize,
    j: usize,
    q: &[i8],
    d: &[f32],
) {
    let base = align_up(tokens * hidden);
    for (o, &v) in payload[j * hidden..(j + 1) * hidden].iter_mut().zip(q) {
        *o = v as u8;
    }
    let blocks = hidden / 32;
    for (b, &s) in d.iter().enumerate() {
        let off = base + (j * blocks + b) * 4;
        payload[off..off + 4].copy_from_slice(&s.to_le_bytes());
    }
}

/// Gathers rows `rows` (token indices into a `tokens`-row payload of `dtype`) into `out` as a
/// payload of `rows.len()` rows in the same layout (codes or values, and for the scaled formats
/// each row's scales). A node's leader worker uses it to forward a token subset to a peer
/// device; this and [`write_q8_row`] / [`q8_view`] are the only places that know the layouts.
pub fn gather_rows(
    dtype: ActivationDtype,
    tokens: usize,
    hidden: usize,
    payload: &[u8],
    rows: &[u32],
    out: &mut Vec<u8>,
) -> Result<(), DtypeError> {
    let shape = DtypeError::Shape {
        tokens,
        hidden,
        dtype,
    };
    let want = dtype.payload_bytes(tokens, hidden).ok_or(shape.clone())? as usize;
    check_len("payload", want, payload.len())?;
    if rows.iter().any(|&r| r as usize >= tokens) {
        return Err(shape);
    }
    let n = rows.len();
    let size = dtype.payload_bytes(n, hidden).ok_or(shape)? as usize;
    out.clear();
    out.resize(size, 0);
    let (code_bytes, scale_bytes) = match dtype {
        ActivationDtype::Bf16 | ActivationDtype::F16 => (2 * hidden, 0),
        ActivationDtype::F32 => (4 * hidden, 0),
        ActivationDtype::Fp8E4m3 => (hidden, 4),
        ActivationDtype::Q8Block32 => (hidden, hidden / 32 * 4),
    };
    let (src_scales, dst_scales) = (align_up(tokens * hidden), align_up(n * hidden));
    for (j, &r) in rows.iter().enumerate() {
        let r = r as usize;
        out[j * code_bytes..(j + 1) * code_bytes]
            .copy_from_slice(&payload[r * code_bytes..(r + 1) * code_bytes]);
        if scale_bytes > 0 {
            let (d, s) = (dst_scales + j * scale_bytes, src_scales + r * scale_bytes);
            out[d..d + scale_bytes].copy_from_slice(&payload[s..s + scale_bytes]);
        }
    }
    Ok(())
}

/// Zero-copy view of a q8-block32 payload of `tokens` rows as the exact-mode kernel inputs:
/// int8 codes `[tokens][hidden]` and f32 block scales `[tokens][hidden/32]`. `None` when the
/// payload has the wrong length, the scales are not 4-byte aligned in memory or the machine is
/// big-endian; the caller then decodes with [`q8_split`].
pub fn q8_view(tokens: usize, hidden: usize, payload: &[u8]) -> Option<(&[i8], &[f32])> {
    let n = tokens * hidden;
    let bytes = ActivationDtype::Q8Block32.payload_bytes(tokens, hidden)? as usize;
    if payload.len() != bytes || hidden % 32 != 0 || cfg!(target_endian = "big") {
        return None;
    }
    let (codes, rest) = payload.split_at(align_up(n));
    // SAFETY: i8 and u8 have the same size and alignment, and every bit pattern is valid.
    let q: &[i8] = unsafe { std::slice::from_raw_parts(codes.as_ptr().cast(), n) };
    // SAFETY: every bit pattern is a valid f32; `align_to` yields only the aligned middle part.
    let (pre, d, _) = unsafe { rest[..n / 32 * 4].align_to::<f32>() };
    (pre.is_empty() && d.len() == n / 32).then_some((q, d))
}

/// The f32 payload layout of `src` (little-endian f32) without a copy, where the machine's own
/// layout is that one (little-endian); `None` elsewhere, and the caller encodes with
/// [`encode_output`].
pub fn f32_as_le_bytes(src: &[f32]) -> Option<&[u8]> {
    if cfg!(target_endian = "little") {
        // SAFETY: u8 has alignment 1 and every byte of an f32 is initialized; the length is
        // the f32 slice's size in bytes, within the same allocation.
        Some(unsafe {
            std::slice::from_raw_parts(src.as_ptr().cast::<u8>(), std::mem::size_of_val(src))
        })
    } else {
        None
    }
}

/// Encodes f32 rows into a result payload of `dtype`.
pub fn encode_output(dtype: OutputDtype, src: &[f32], dst: &mut [u8]) -> Result<(), DtypeError> {
    check_len(
        "destination payload bytes",
        src.len() * dtype.elem_bytes(),
        dst.len(),
    )?;
    match dtype {
        OutputDtype::F32 => {
            for (o, &x) in dst.chunks_exact_mut(4).zip(src) {
                o.copy_from_slice(&x.to_le_bytes());
            }
        }
        OutputDtype::Bf16 => {
            for (o, &x) in dst.chunks_exact_mut(2).zip(src) {
                o.copy_from_slice(&bf16::from_f32(x).to_le_bytes());
            }
        }
    }
    Ok(())
}

/// Rounds every value to the nearest bf16 (ties to even), in place: what a bf16 result row
/// carries of an f32 row. Exact on the way back (bf16 → f32 is exact), so rounding a row here
/// or on the worker gives the same bits.
pub fn round_to_bf16(rows: &mut [f32]) {
    for v in rows {
        *v = bf16::from_f32(*v).to_f32();
    }
}

/// Decodes a result payload of `dtype` into f32 rows.
pub fn decode_output(dtype: OutputDtype, src: &[u8], dst: &mut [f32]) -> Result<(), DtypeError> {
    check_len(
        "source payload bytes",
        dst.len() * dtype.elem_bytes(),
        src.len(),
    )?;
    match dtype {
        OutputDtype::F32 => {
            for (o, b) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        OutputDtype::Bf16 => {
            for (o, b) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *o = bf16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Brute-force oracle: the e4m3 code whose value is nearest to `x` (ties to even code).
    fn e4m3_oracle(x: f32) -> u8 {
        let sign = if x.is_sign_negative() { 0x80 } else { 0 };
        let a = (x.abs() as f64).min(448.0);
        let mut best = 0u8;
        let mut best_d = f64::INFINITY;
        for c in 0u8..=0x7E {
            let v = e4m3_to_f32(c) as f64;
            let d = (v - a).abs();
            if d < best_d || (d == best_d && c % 2 == 0) {
                best = c;
                best_d = d;
            }
        }
        sign | best
    }

    #[test]
    fn e4m3_matches_nearest_code_oracle() {
        let mut x = -500.0f32;
        while x < 500.0 {
            assert_eq!(f32_to_e4m3(x), e4m3_oracle(x), "x = {x}");
            x += 0.0371;
        }
        for c in 0u8..=0x7E {
            let v = e4m3_to_f32(c);
            assert_eq!(f32_to_e4m3(v), c, "code {c:#x} round trip");
            assert_eq!(f32_to_e4m3(-v) & 0x7F, c);
        }
        for tiny in [1e-4f32, 1.5e-3, 2f32.powi(-10), 2f32.powi(-9) * 1.5] {
            assert_eq!(f32_to_e4m3(tiny), e4m3_oracle(tiny), "tiny {tiny}");
        }
        assert_eq!(e4m3_to_f32(0x7E), 448.0);
        assert!(e4m3_to_f32(0x7F).is_nan());
    }

    #[test]
    fn scaled_formats_reject_nan() {
        let src = [1.0, f32::NAN, 0.0, 0.0];
        let mut dst = vec![0u8; ActivationDtype::Fp8E4m3.payload_bytes(1, 4).unwrap() as usize];
        let err = encode_activations(ActivationDtype::Fp8E4m3, 1, 4, &src, &mut dst).unwrap_err();
        assert!(matches!(err, DtypeError::NonFinite { index: 1, .. }));
    }

    #[test]
    fn q8_payload_is_smaller_than_bf16_by_44_percent() {
        let q8 = ActivationDtype::Q8Block32.payload_bytes(64, 7168).unwrap() as f64;
        let b = ActivationDtype::Bf16.payload_bytes(64, 7168).unwrap() as f64;
        let saving = 1.0 - q8 / b;
        assert!((saving - 0.4375).abs() < 0.001, "saving {saving}");
    }

    #[test]
    fn gather_rows_equals_encoding_the_chosen_rows() {
        let (tokens, hidden) = (5usize, 64usize);
        let x: Vec<f32> = (0..tokens * hidden)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        let rows = [4u32, 1, 1, 3];
        let picked: Vec<f32> = rows
            .iter()
            .flat_map(|&r| {
                x[r as usize * hidden..(r as usize + 1) * hidden]
                    .iter()
                    .copied()
            })
            .collect();
        for dtype in [
            ActivationDtype::F32,
            ActivationDtype::Bf16,
            ActivationDtype::F16,
            ActivationDtype::Fp8E4m3,
            ActivationDtype::Q8Block32,
        ] {
            let mut full = vec![0u8; dtype.payload_bytes(tokens, hidden).unwrap() as usize];
            encode_activations(dtype, tokens, hidden, &x, &mut full).unwrap();
            let mut want = vec![0u8; dtype.payload_bytes(rows.len(), hidden).unwrap() as usize];
            encode_activations(dtype, rows.len(), hidden, &picked, &mut want).unwrap();
            let mut got = Vec::new();
            gather_rows(dtype, tokens, hidden, &full, &rows, &mut got).unwrap();
            assert_eq!(got, want, "{dtype:?}");
        }
        let mut got = Vec::new();
        let full = vec![0u8; tokens * hidden * 4];
        assert!(gather_rows(ActivationDtype::F32, tokens, hidden, &full, &[5], &mut got).is_err());
        assert!(
            gather_rows(
                ActivationDtype::F32,
                tokens,
                hidden,
                &full[1..],
                &[0],
                &mut got
            )
            .is_err()
        );
    }
}
