//! Element types of safetensors tensors and their conversion to `f32`.
//!
//! Why this exists: checkpoints come in bf16, f16, f32 and FP8 (E4M3, E5M2); every reader path
//! converts through these, so the byte widths and decodings live in one place.

use half::f16;
use std::fmt;

/// An element type of a safetensors tensor (the byte-sized ones of the format).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Dtype {
    /// Boolean, one byte.
    Bool,
    /// Unsigned 8-bit integer.
    U8,
    /// Signed 8-bit integer.
    I8,
    /// OCP FP8 E4M3FN: bias 7, no infinities, NaN = `0x7F`/`0xFF`.
    F8E4M3,
    /// OCP FP8 E5M2: the top byte of an IEEE half.
    F8E5M2,
    /// FP8 E8M0 (power-of-two scales of MX formats); stored, not converted.
    F8E8M0,
    /// Signed 16-bit integer.
    I16,
    /// Unsigned 16-bit integer.
    U16,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    BF16,
    /// Signed 32-bit integer.
    I32,
    /// Unsigned 32-bit integer.
    U32,
    /// IEEE single precision.
    F32,
    /// Complex of two `f32`.
    C64,
    /// Signed 64-bit integer.
    I64,
    /// Unsigned 64-bit integer.
    U64,
    /// IEEE double precision.
    F64,
}

impl Dtype {
    /// Every dtype this reader knows.
    pub const ALL: [Dtype; 17] = [
        Dtype::Bool,
        Dtype::U8,
        Dtype::I8,
        Dtype::F8E4M3,
        Dtype::F8E5M2,
        Dtype::F8E8M0,
        Dtype::I16,
        Dtype::U16,
        Dtype::F16,
        Dtype::BF16,
        Dtype::I32,
        Dtype::U32,
        Dtype::F32,
        Dtype::C64,
        Dtype::I64,
        Dtype::U64,
        Dtype::F64,
    ];

    /// The name in a safetensors header (`"BF16"`, `"F8_E4M3"`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            Dtype::Bool => "BOOL",
            Dtype::U8 => "U8",
            Dtype::I8 => "I8",
            Dtype::F8E4M3 => "F8_E4M3",
            Dtype::F8E5M2 => "F8_E5M2",
            Dtype::F8E8M0 => "F8_E8M0",
            Dtype::I16 => "I16",
            Dtype::U16 => "U16",
            Dtype::F16 => "F16",
            Dtype::BF16 => "BF16",
            Dtype::I32 => "I32",
            Dtype::U32 => "U32",
            Dtype::F32 => "F32",
            Dtype::C64 => "C64",
            Dtype::I64 => "I64",
            Dtype::U64 => "U64",
            Dtype::F64 => "F64",
        }
    }

    /// The dtype of a header name, or `None` for a name this reader does not know.
    pub fn from_name(name: &str) -> Option<Dtype> {
        Dtype::ALL.into_iter().find(|d| d.name() == name)
    }

    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            Dtype::Bool | Dtype::U8 | Dtype::I8 => 1,
            Dtype::F8E4M3 | Dtype::F8E5M2 | Dtype::F8E8M0 => 1,
            Dtype::I16 | Dtype::U16 | Dtype::F16 | Dtype::BF16 => 2,
            Dtype::I32 | Dtype::U32 | Dtype::F32 => 4,
            Dtype::C64 | Dtype::I64 | Dtype::U64 | Dtype::F64 => 8,
        }
    }

    /// Whether [`TensorView::to_f32_into`](super::TensorView::to_f32_into) converts this dtype.
    pub const fn converts_to_f32(self) -> bool {
        matches!(
            self,
            Dtype::F8E4M3 | Dtype::F8E5M2 | Dtype::F16 | Dtype::BF16 | Dtype::F32 | Dtype::F64
        )
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Converts `N`-byte little-endian elements of `bytes` into `out` (lengths already checked).
pub(super) fn convert<const N: usize>(out: &mut [f32], bytes: &[u8], f: impl Fn([u8; N]) -> f32) {
    for (o, chunk) in out.iter_mut().zip(bytes.chunks_exact(N)) {
        let mut a = [0u8; N];
        a.copy_from_slice(chunk);
        *o = f(a);
    }
}

/// Decodes one OCP FP8 E5M2 byte (the top half of an IEEE half).
pub fn e5m2_to_f32(code: u8) -> f32 {
    f16::from_bits(u16::from(code) << 8).to_f32()
}
