//! The packed INT4 expert format: one definition for disk, CPU and GPU.
//!
//! Why this exists: every other part of ExpertMesh (the CPU kernels, the HIP kernels, the byte
//! accounting of the planner, checkpoint import) agrees on these bytes. A GPU tile layout is a
//! deterministic repack of this format done at load time, never a second source of truth.
//!
//! # Logical model
//!
//! One projection of one expert is a matrix `W[n][k]` with `N = rows` outputs and `K = cols`
//! inputs. Each element is stored as an unsigned 4-bit code `u[n][k] ∈ 0..=15` with a per-group
//! zero point `z[n][g] ∈ 0..=15` (always 8 unless [`QuantSpec::zero_points`] is set) and a per-group
//! 16-bit scale `s[n][g]`:
//!
//! ```text
//! value(n, k) = f32(s[n][g]) * f32(u[n][k] - z[n][g])        g = k / group_size
//! ```
//!
//! The product is exact in f32 (at most 11 significant bits times 4 bits), so the dequantized
//! value is bit-identical on every implementation ("Level 0" of the numerical contract).
//!
//! # Byte layout (structure of arrays, row-major, little-endian)
//!
//! * **Nibbles** `[N][K/2]` bytes. `K` is a multiple of [`BLOCK`] (32). Each row is a sequence of
//!   32-element blocks of 16 bytes each; inside block `b` of row `n`, byte `j` (0..16) holds
//!   `u[n][32b + j]` in its low nibble and `u[n][32b + j + 16]` in its high nibble (ggml Q4_0
//!   order). So `byte & 0x0F` yields elements 0..16 of the block and `byte >> 4` elements 16..32,
//!   each a contiguous run that lines up with contiguous int8 activations.
//! * **Scales** `[N][K/group_size]` `u16` bit patterns, either IEEE binary16 or bfloat16 as
//!   [`QuantSpec::scale_dtype`] says. The two are never converted into each other.
//! * **Zero points** (only with [`QuantSpec::zero_points`]) `[N][ceil(G/2)]` bytes with
//!   `G = K/group_size`; group `g` lives in byte `g/2`, low nibble for even `g`, high for odd.
//!   When `G` is odd, the unused high nibble of each row's last byte is 8.
//!
//! Group sizes are 32, 64 or 128; a group of 64 or 128 is two or four consecutive 32-element
//! nibble blocks sharing one scale (and zero point), so GPTQ/AWQ g128 checkpoints import without
//! loss while the nibble packing stays per 32.
//!
//! # Expert tensor set
//!
//! An expert FFN `y = W2 · (silu(W1·x) ⊙ (W3·x))` with hidden size `H` and intermediate size `F`
//! is stored as two packed matrices ([`ExpertWeights`]):
//!
//! * `W13`, shape `[2F][H]`: gate (`W1`) and up (`W3`) rows interleaved in chunks of
//!   [`GATE_UP_CHUNK`] (16) rows: W13 rows `32c..32c+16` are gate rows `16c..16c+16`, W13 rows
//!   `32c+16..32c+32` are up rows `16c..16c+16`. A tile of 32 consecutive W13 rows therefore holds
//!   matching gate and up outputs and can apply `silu(g)·u` in its epilogue. `F` is a multiple of
//!   32 (it is the `K` of `W2`), so every chunk is full.
//! * `W2`, shape `[H][F]`.

use crate::aligned::AlignedVec;
use half::{bf16, f16};
use serde::{Deserialize, Serialize};
use std::fmt;

/// Elements per nibble block and per activation quantization block.
pub const BLOCK: usize = 32;
/// Bytes per packed nibble block.
pub const BLOCK_BYTES: usize = BLOCK / 2;
/// Rows per gate or up chunk in the interleaved `W13` matrix.
pub const GATE_UP_CHUNK: usize = 16;
/// Zero point implied when a matrix stores none (offset-binary, symmetric).
pub const DEFAULT_ZERO: u8 = 8;

/// Errors building or checking packed tensors.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum FormatError {
    /// An expert's two matrices were packed with different specs.
    #[error("W13 is packed as {w13} but W2 as {w2}: one expert's matrices share one spec")]
    MixedSpecs {
        /// W13's spec.
        w13: QuantSpec,
        /// W2's spec.
        w2: QuantSpec,
    },
    /// The group size is not one of 32, 64, 128.
    #[error("group size {0} is not supported: use 32, 64 or 128")]
    BadGroupSize(u32),
    /// `cols` is not a multiple of the group size (and of 32).
    #[error(
        "{what}: {cols} columns is not a multiple of the group size {group_size}; pad the input dimension or choose group_size 32"
    )]
    ColsNotMultiple {
        /// Which tensor.
        what: &'static str,
        /// Columns (K).
        cols: usize,
        /// Group size in elements.
        group_size: usize,
    },
    /// A matrix with no columns (no group at all): a model or file with a zero size.
    #[error("{what}: 0 columns; a matrix needs at least one group of columns")]
    NoCols {
        /// Which tensor.
        what: &'static str,
    },
    /// A buffer has the wrong number of elements.
    #[error("{what}: expected {expected} elements, got {got}")]
    LengthMismatch {
        /// Which buffer.
        what: &'static str,
        /// Required length.
        expected: usize,
        /// Supplied length.
        got: usize,
    },
    /// A weight is NaN or infinite.
    #[error("{what}: weight at row {row}, column {col} is not finite ({value})")]
    NonFiniteWeight {
        /// Which tensor.
        what: &'static str,
        /// Row index.
        row: usize,
        /// Column index.
        col: usize,
        /// The offending value.
        value: f32,
    },
    /// A group's scale does not fit the 16-bit scale type.
    #[error(
        "{what}: row {row} group {group} needs scale {scale:e}, which {dtype} cannot represent; use bf16 scales"
    )]
    ScaleOverflow {
        /// Which tensor.
        what: &'static str,
        /// Row index.
        row: usize,
        /// Group index.
        group: usize,
        /// The scale that overflowed.
        scale: f32,
        /// The scale type.
        dtype: ScaleDtype,
    },
    /// Intermediate size not a multiple of 32.
    #[error("expert intermediate size {0} is not a multiple of 32")]
    BadIntermediate(usize),
    /// A stored scale is NaN or infinite (every output of its row would be).
    #[error(
        "{what}: row {row} group {group} has a non-finite {dtype} scale (bits {bits:#06x}); the \
         packed weights are damaged: convert them again"
    )]
    NonFiniteScale {
        /// Which tensor.
        what: &'static str,
        /// Row index.
        row: usize,
        /// Group index.
        group: usize,
        /// The scale's bits.
        bits: u16,
        /// The scale type.
        dtype: ScaleDtype,
    },
}

/// The 16-bit floating-point type of the per-group scales.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ScaleDtype {
    /// IEEE 754 binary16.
    F16,
    /// bfloat16 (the upper half of an f32).
    Bf16,
}

impl ScaleDtype {
    /// Whether `bits` of this type is NaN or infinite (every exponent bit set).
    pub fn is_non_finite(self, bits: u16) -> bool {
        let exponent = self.exponent_bits();
        bits & exponent == exponent
    }

    /// The exponent field's bits.
    fn exponent_bits(self) -> u16 {
        match self {
            ScaleDtype::F16 => 0x7c00,
            ScaleDtype::Bf16 => 0x7f80,
        }
    }

    /// Exact widening of a stored scale to f32.
    #[inline(always)]
    pub fn to_f32(self, bits: u16) -> f32 {
        match self {
            ScaleDtype::F16 => f16::from_bits(bits).to_f32(),
            ScaleDtype::Bf16 => bf16::from_bits(bits).to_f32(),
        }
    }

    /// Round an f32 to this type, to nearest even.
    #[inline]
    pub fn from_f32(self, v: f32) -> u16 {
        match self {
            ScaleDtype::F16 => f16::from_f32(v).to_bits(),
            ScaleDtype::Bf16 => bf16::from_f32(v).to_bits(),
        }
    }

    /// Flag value used in binary headers: 0 = f16, 1 = bf16.
    pub fn flag(self) -> u8 {
        match self {
            ScaleDtype::F16 => 0,
            ScaleDtype::Bf16 => 1,
        }
    }

    /// Inverse of [`ScaleDtype::flag`].
    pub fn from_flag(flag: u8) -> Option<Self> {
        match flag {
            0 => Some(ScaleDtype::F16),
            1 => Some(ScaleDtype::Bf16),
            _ => None,
        }
    }
}

impl fmt::Display for ScaleDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ScaleDtype::F16 => "f16",
            ScaleDtype::Bf16 => "bf16",
        })
    }
}

/// How a model's experts are quantized: group size, scale type, zero points.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QuantSpec {
    /// Elements per scale group along K: 32, 64 or 128.
    pub group_size: u32,
    /// Scale type.
    pub scale_dtype: ScaleDtype,
    /// Per-group u4 zero points (AWQ / asymmetric GPTQ); symmetric (zero point 8) when false.
    #[serde(default)]
    pub zero_points: bool,
}

impl QuantSpec {
    /// Group 32, bf16 scales, symmetric: Kimi K2's native INT4 and the default.
    pub const G32_BF16: QuantSpec = QuantSpec {
        group_size: 32,
        scale_dtype: ScaleDtype::Bf16,
        zero_points: false,
    };

    /// Check the group size.
    pub fn validate(&self) -> Result<(), FormatError> {
        match self.group_size {
            32 | 64 | 128 => Ok(()),
            g => Err(FormatError::BadGroupSize(g)),
        }
    }

    /// Group size as usize.
    pub fn group(&self) -> usize {
        self.group_size as usize
    }

    /// Check that a `[rows][cols]` matrix can be packed with this spec.
    pub fn check_shape(&self, what: &'static str, cols: usize) -> Result<(), FormatError> {
        self.validate()?;
        let group_size = self.group();
        if cols == 0 {
            return Err(FormatError::NoCols { what });
        }
        if cols % group_size != 0 || cols % BLOCK != 0 {
            return Err(FormatError::ColsNotMultiple {
                what,
                cols,
                group_size,
            });
        }
        Ok(())
    }

    /// Bytes of one packed `[rows][cols]` matrix: nibbles + scales (+ zero points).
    pub fn matrix_bytes(&self, rows: u64, cols: u64) -> u64 {
        let groups = cols / self.group_size as u64;
        let nibbles = rows * cols / 2;
        let scales = rows * groups * 2;
        let zeros = if self.zero_points {
            rows * groups.div_ceil(2)
        } else {
            0
        };
        nibbles + scales + zeros
    }

    /// Bytes of one packed expert with hidden size `hidden` and intermediate size `inter`
    /// (`W13 [2F][H]` + `W2 [H][F]`).
    pub fn expert_bytes(&self, hidden: u64, inter: u64) -> u64 {
        self.matrix_bytes(2 * inter, hidden) + self.matrix_bytes(hidden, inter)
    }

    /// Average storage bits per weight (4 + 16/g, + 4/g with zero points).
    pub fn bits_per_weight(&self) -> f64 {
        let g = self.group_size as f64;
        4.0 + 16.0 / g + if self.zero_points { 4.0 / g } else { 0.0 }
    }
}

impl Default for QuantSpec {
    fn default() -> Self {
        Self::G32_BF16
    }
}

impl fmt::Display for QuantSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "int4 g{} {} scales{}",
            self.group_size,
            self.scale_dtype,
            if self.zero_points {
                " + u4 zero points"
            } else {
                ""
            }
        )
    }
}

/// Read access to a packed matrix's arrays wherever they live (an owned [`PackedMatrix`], or a
/// [`PackedRef`] borrowed from a mapped shard file), for code that repacks them.
pub trait PackedRows {
    /// Output rows.
    fn rows(&self) -> usize;
    /// Input columns.
    fn cols(&self) -> usize;
    /// The format.
    fn spec(&self) -> QuantSpec;
    /// The canonical nibble bytes of row `n`.
    fn row_nibbles(&self, n: usize) -> &[u8];
    /// The scale bits of group `g` of row `n`.
    fn scale_bits(&self, n: usize, g: usize) -> u16;
    /// The zero point of group `g` of row `n` (8 without zero points).
    fn zero(&self, n: usize, g: usize) -> u8;
    /// Row `n`'s scale bits, one per group, into `out` (one call per row for repackers).
    fn row_scale_bits_into(&self, n: usize, out: &mut [u16]) {
        for (g, o) in out.iter_mut().enumerate() {
            *o = self.scale_bits(n, g);
        }
    }
    /// Row `n`'s zero points, one per group, into `out`.
    fn row_zeros_into(&self, n: usize, out: &mut [u8]) {
        for (g, o) in out.iter_mut().enumerate() {
            *o = self.zero(n, g);
        }
    }
    /// Row `n`'s scale bits as little-endian bytes (two per group), where the matrix holds
    /// them so (a mapped shard's; an owned matrix's on little-endian machines): repackers
    /// read whole rows of them with vector loads. `None` where they are not held so.
    fn row_scales_le(&self, n: usize) -> Option<&[u8]> {
        let _ = n;
        None
    }
}

/// Unpack one row's u4 zero points (two per byte, low nibble first) into `out`.
fn unpack_zeros(packed: &[u8], out: &mut [u8]) {
    for (g, o) in out.iter_mut().enumerate() {
        let byte = packed[g / 2];
        *o = if g % 2 == 0 { byte & 0x0F } else { byte >> 4 };
    }
}

impl PackedRows for PackedMatrix {
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    fn spec(&self) -> QuantSpec {
        self.spec
    }
    fn row_nibbles(&self, n: usize) -> &[u8] {
        PackedMatrix::row_nibbles(self, n)
    }
    fn scale_bits(&self, n: usize, g: usize) -> u16 {
        self.row_scales(n)[g]
    }
    fn zero(&self, n: usize, g: usize) -> u8 {
        PackedMatrix::zero(self, n, g)
    }
    fn row_scale_bits_into(&self, n: usize, out: &mut [u16]) {
        out.copy_from_slice(self.row_scales(n));
    }
    fn row_zeros_into(&self, n: usize, out: &mut [u8]) {
        match &self.zeros {
            None => out.fill(DEFAULT_ZERO),
            Some(z) => {
                let per_row = self.groups_per_row().div_ceil(2);
                unpack_zeros(&z[n * per_row..(n + 1) * per_row], out);
            }
        }
    }
    #[cfg(target_endian = "little")]
    fn row_scales_le(&self, n: usize) -> Option<&[u8]> {
        let row = self.row_scales(n);
        // SAFETY: the bytes of the row's u16 values, in bounds and aligned for u8; on a
        // little-endian machine they are the values' little-endian bytes.
        Some(unsafe { std::slice::from_raw_parts(row.as_ptr().cast::<u8>(), 2 * row.len()) })
    }
}

/// Refuses the first NaN or infinite scale of `scales` (`groups` per row, in row order).
///
/// On the load path: a first pass without early exit (it vectorizes: ~0.05 ms for a Kimi
/// expert's 1.4 M scales, where a loop that stops at the first bad one ran ~0.4 ms, a sixth
/// of reading the expert), and only when it finds one a second pass to name it.
fn check_scales_finite(
    what: &'static str,
    dtype: ScaleDtype,
    groups: usize,
    scales: impl Iterator<Item = u16> + Clone,
) -> Result<(), FormatError> {
    let exponent = dtype.exponent_bits();
    let any = scales
        .clone()
        .fold(false, |bad, bits| bad | (bits & exponent == exponent));
    if !any {
        return Ok(());
    }
    for (i, bits) in scales.enumerate() {
        if dtype.is_non_finite(bits) {
            return Err(FormatError::NonFiniteScale {
                what,
                row: i / groups,
                group: i % groups,
                bits,
                dtype,
            });
        }
    }
    Ok(())
}

/// A packed matrix borrowed from bytes on disk (scales as little-endian 16-bit values), lengths
/// checked: a shard's matrix read in place, without a copy.
#[derive(Clone, Copy, Debug)]
pub struct PackedRef<'a> {
    rows: usize,
    cols: usize,
    spec: QuantSpec,
    nibbles: &'a [u8],
    scales_le: &'a [u8],
    zeros: Option<&'a [u8]>,
}

impl<'a> PackedRef<'a> {
    /// Check every length (as [`PackedMatrix::from_le_parts`]) and borrow the arrays.
    pub fn new(
        what: &'static str,
        spec: QuantSpec,
        rows: usize,
        cols: usize,
        nibbles: &'a [u8],
        scales_le: &'a [u8],
        zeros: Option<&'a [u8]>,
    ) -> Result<Self, FormatError> {
        spec.check_shape(what, cols)?;
        let groups = cols / spec.group();
        check_len("nibbles", rows * cols / 2, nibbles.len())?;
        check_len("scales", rows * groups * 2, scales_le.len())?;
        let want_zeros = if spec.zero_points {
            rows * groups.div_ceil(2)
        } else {
            0
        };
        check_len("zero points", want_zeros, zeros.map_or(0, <[u8]>::len))?;
        let scales = scales_le
            .chunks_exact(2)
            .map(|p| u16::from_le_bytes([p[0], p[1]]));
        check_scales_finite(what, spec.scale_dtype, groups, scales)?;
        Ok(Self {
            rows,
            cols,
            spec,
            nibbles,
            scales_le,
            zeros: zeros.filter(|_| spec.zero_points),
        })
    }
}

impl PackedRows for PackedRef<'_> {
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    fn spec(&self) -> QuantSpec {
        self.spec
    }
    fn row_nibbles(&self, n: usize) -> &[u8] {
        let rb = self.cols / 2;
        &self.nibbles[n * rb..(n + 1) * rb]
    }
    fn scale_bits(&self, n: usize, g: usize) -> u16 {
        let at = 2 * (n * (self.cols / self.spec.group()) + g);
        u16::from_le_bytes([self.scales_le[at], self.scales_le[at + 1]])
    }
    fn zero(&self, n: usize, g: usize) -> u8 {
        match self.zeros {
            None => DEFAULT_ZERO,
            Some(z) => {
                let per_row = (self.cols / self.spec.group()).div_ceil(2);
                let byte = z[n * per_row + g / 2];
                if g % 2 == 0 { byte & 0x0F } else { byte >> 4 }
            }
        }
    }
    fn row_scale_bits_into(&self, n: usize, out: &mut [u16]) {
        let per_row = 2 * out.len();
        let row = &self.scales_le[n * per_row..(n + 1) * per_row];
        for (o, p) in out.iter_mut().zip(row.chunks_exact(2)) {
            *o = u16::from_le_bytes([p[0], p[1]]);
        }
    }
    fn row_zeros_into(&self, n: usize, out: &mut [u8]) {
        match self.zeros {
            None => out.fill(DEFAULT_ZERO),
            Some(z) => {
                let per_row = out.len().div_ceil(2);
                unpack_zeros(&z[n * per_row..(n + 1) * per_row], out);
            }
        }
    }
    fn row_scales_le(&self, n: usize) -> Option<&[u8]> {
        let per_row = 2 * (self.cols / self.spec.group());
        Some(&self.scales_le[n * per_row..(n + 1) * per_row])
    }
}

/// One packed `[rows][cols]` matrix in the canonical layout (see the module docs).
#[derive(Clone, Debug, PartialEq)]
pub struct PackedMatrix {
    rows: usize,
    cols: usize,
    spec: QuantSpec,
    nibbles: AlignedVec<u8>,
    scales: AlignedVec<u16>,
    zeros: Option<AlignedVec<u8>>,
}

impl PackedMatrix {
    /// An all-zero matrix (all codes equal to the zero point, all scales zero).
    pub fn zeroed(
        what: &'static str,
        spec: QuantSpec,
        rows: usize,
        cols: usize,
    ) -> Result<Self, FormatError> {
        spec.check_shape(what, cols)?;
        let groups = cols / spec.group();
        let mut nibbles = AlignedVec::zeroed(rows * cols / 2);
        nibbles.fill(DEFAULT_ZERO | (DEFAULT_ZERO << 4));
        let zeros = spec.zero_points.then(|| {
            let mut z = AlignedVec::zeroed(rows * groups.div_ceil(2));
            z.fill(DEFAULT_ZERO | (DEFAULT_ZERO << 4));
            z
        });
        Ok(Self {
            rows,
            cols,
            spec,
            nibbles,
            scales: AlignedVec::zeroed(rows * groups),
            zeros,
        })
    }

    /// Assemble a matrix from its three arrays, checking every length.
    pub fn from_parts(
        what: &'static str,
        spec: QuantSpec,
        rows: usize,
        cols: usize,
        nibbles: &[u8],
        scales: &[u16],
        zeros: Option<&[u8]>,
    ) -> Result<Self, FormatError> {
        let mut m = Self::zeroed(what, spec, rows, cols)?;
        check_len("nibbles", m.nibbles.len(), nibbles.len())?;
        check_len("scales", m.scales.len(), scales.len())?;
        check_scales_finite(
            what,
            spec.scale_dtype,
            cols / spec.group(),
            scales.iter().copied(),
        )?;
        m.nibbles.copy_from_slice(nibbles);
        m.scales.copy_from_slice(scales);
        match (&mut m.zeros, zeros) {
            (Some(dst), Some(src)) => {
                check_len("zero points", dst.len(), src.len())?;
                dst.copy_from_slice(src);
            }
            (None, None) => {}
            (Some(dst), None) => check_len("zero points", dst.len(), 0)?,
            (None, Some(src)) => check_len("zero points", 0, src.len())?,
        }
        Ok(m)
    }

    /// Assemble a matrix from arrays read from disk: `scales_le` holds the scales as
    /// little-endian 16-bit values. Every length is checked; each array is written once (no
    /// zeroing first), which is what makes a shard load run near the memory-copy limit.
    pub fn from_le_parts(
        what: &'static str,
        spec: QuantSpec,
        rows: usize,
        cols: usize,
        nibbles: &[u8],
        scales_le: &[u8],
        zeros: Option<&[u8]>,
    ) -> Result<Self, FormatError> {
        PackedRef::new(what, spec, rows, cols, nibbles, scales_le, zeros)?;
        let groups = cols / spec.group();
        let mut pairs = scales_le.chunks_exact(2);
        let scales = AlignedVec::from_fn(rows * groups, || {
            let p = pairs.next().expect("checked length");
            u16::from_le_bytes([p[0], p[1]])
        });
        Ok(Self {
            rows,
            cols,
            spec,
            nibbles: AlignedVec::from_slice(nibbles),
            scales,
            zeros: spec
                .zero_points
                .then(|| AlignedVec::from_slice(zeros.unwrap_or_default())),
        })
    }

    /// Output rows (N).
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// Input columns (K).
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// Quantization spec.
    pub fn spec(&self) -> QuantSpec {
        self.spec
    }
    /// Scale groups per row.
    pub fn groups_per_row(&self) -> usize {
        self.cols / self.spec.group()
    }
    /// 32-element nibble blocks per row.
    pub fn blocks_per_row(&self) -> usize {
        self.cols / BLOCK
    }
    /// Packed bytes per row of nibbles.
    pub fn row_bytes(&self) -> usize {
        self.cols / 2
    }
    /// All nibble bytes, `[N][K/2]`.
    pub fn nibbles(&self) -> &[u8] {
        &self.nibbles
    }
    /// Mutable nibble bytes.
    pub fn nibbles_mut(&mut self) -> &mut [u8] {
        &mut self.nibbles
    }
    /// All scale bit patterns, `[N][K/g]`.
    pub fn scales(&self) -> &[u16] {
        &self.scales
    }
    /// Mutable scale bit patterns.
    pub fn scales_mut(&mut self) -> &mut [u16] {
        &mut self.scales
    }
    /// Packed zero points, `[N][ceil(G/2)]`, when the spec has them.
    pub fn zeros(&self) -> Option<&[u8]> {
        self.zeros.as_deref()
    }
    /// Mutable packed zero points.
    pub fn zeros_mut(&mut self) -> Option<&mut [u8]> {
        self.zeros.as_deref_mut()
    }
    /// Total stored bytes (equals [`QuantSpec::matrix_bytes`]).
    pub fn bytes(&self) -> usize {
        self.nibbles.len() + self.scales.len() * 2 + self.zeros.as_ref().map_or(0, |z| z.len())
    }

    /// Nibble bytes of row `n`.
    #[inline(always)]
    pub fn row_nibbles(&self, n: usize) -> &[u8] {
        let rb = self.row_bytes();
        &self.nibbles[n * rb..(n + 1) * rb]
    }

    /// Scale bit patterns of row `n`, one per group.
    #[inline(always)]
    pub fn row_scales(&self, n: usize) -> &[u16] {
        let g = self.groups_per_row();
        &self.scales[n * g..(n + 1) * g]
    }

    /// The u4 code of element `(n, k)`.
    #[inline(always)]
    pub fn code(&self, n: usize, k: usize) -> u8 {
        let b = k / BLOCK;
        let j = k % BLOCK;
        let byte = self.row_nibbles(n)[b * BLOCK_BYTES + (j % BLOCK_BYTES)];
        if j < BLOCK_BYTES {
            byte & 0x0F
        } else {
            byte >> 4
        }
    }

    /// Set the u4 code of element `(n, k)` (`code` must be < 16).
    pub fn set_code(&mut self, n: usize, k: usize, code: u8) {
        debug_assert!(code < 16);
        let rb = self.row_bytes();
        let b = k / BLOCK;
        let j = k % BLOCK;
        let byte = &mut self.nibbles[n * rb + b * BLOCK_BYTES + (j % BLOCK_BYTES)];
        if j < BLOCK_BYTES {
            *byte = (*byte & 0xF0) | code;
        } else {
            *byte = (*byte & 0x0F) | (code << 4);
        }
    }

    /// The zero point of group `g` of row `n` (8 without zero points).
    #[inline(always)]
    pub fn zero(&self, n: usize, g: usize) -> u8 {
        match &self.zeros {
            None => DEFAULT_ZERO,
            Some(z) => {
                let per_row = self.groups_per_row().div_ceil(2);
                let byte = z[n * per_row + g / 2];
                if g % 2 == 0 { byte & 0x0F } else { byte >> 4 }
            }
        }
    }

    /// Set the zero point of group `g` of row `n` (no-op for symmetric matrices).
    pub fn set_zero(&mut self, n: usize, g: usize, zero: u8) {
        debug_assert!(zero < 16);
        let per_row = self.groups_per_row().div_ceil(2);
        if let Some(z) = &mut self.zeros {
            let byte = &mut z[n * per_row + g / 2];
            if g % 2 == 0 {
                *byte = (*byte & 0xF0) | zero;
            } else {
                *byte = (*byte & 0x0F) | (zero << 4);
            }
        }
    }

    /// The f32 scale of group `g` of row `n` (exact widening).
    #[inline(always)]
    pub fn scale(&self, n: usize, g: usize) -> f32 {
        self.spec
            .scale_dtype
            .to_f32(self.scales[n * self.groups_per_row() + g])
    }

    /// The scale group index of 32-element block `b`.
    #[inline(always)]
    pub fn group_of_block(&self, b: usize) -> usize {
        b * BLOCK / self.spec.group()
    }

    /// The exact dequantized value of element `(n, k)`.
    #[inline]
    pub fn value(&self, n: usize, k: usize) -> f32 {
        let g = k / self.spec.group();
        self.scale(n, g) * (self.code(n, k) as i32 - self.zero(n, g) as i32) as f32
    }

    /// Dequantize row `n` into `out` (`out.len() == cols`), exactly.
    pub fn dequantize_row(&self, n: usize, out: &mut [f32]) {
        assert_eq!(out.len(), self.cols, "dequantize_row: output length");
        let row = self.row_nibbles(n);
        for b in 0..self.blocks_per_row() {
            let g = self.group_of_block(b);
            let s = self.scale(n, g);
            let z = self.zero(n, g) as i32;
            let bytes = &row[b * BLOCK_BYTES..(b + 1) * BLOCK_BYTES];
            for (j, &byte) in bytes.iter().enumerate() {
                out[b * BLOCK + j] = s * ((byte & 0x0F) as i32 - z) as f32;
                out[b * BLOCK + j + BLOCK_BYTES] = s * ((byte >> 4) as i32 - z) as f32;
            }
        }
    }

    /// Dequantize the whole matrix, `[N][K]` row-major.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.rows * self.cols];
        for n in 0..self.rows {
            self.dequantize_row(n, &mut out[n * self.cols..(n + 1) * self.cols]);
        }
        out
    }

    /// Quantize a dense row-major `[rows][cols]` f32 matrix with round-to-nearest.
    ///
    /// Symmetric (no zero points): per group, `m` is the element of largest magnitude, the scale
    /// is `d = round16(m / -8)` and codes are `clamp(round_half_even(w / d), -8, 7) + 8` (ggml
    /// Q4_0's rule, so the largest element maps to -8 exactly and all 16 levels are used).
    /// With zero points: the range `[min, max]` widened to hold 0 (as GPTQ and AWQ do: a group
    /// of all-positive or all-negative weights is otherwise out of the codes' reach),
    /// `d = round16((max - min) / 15)`, `z = clamp(round(-min / d), 0, 15)`, codes
    /// `clamp(round(w / d) + z, 0, 15)`. A constant group takes the symmetric rule; an
    /// all-zero group gets scale 0 and code = zero point.
    ///
    /// [`crate::search::quantize_matrix_searched`] writes the same layout with a least-squares
    /// scale (and zero point) search instead, for a lower reconstruction error.
    pub fn quantize(
        what: &'static str,
        spec: QuantSpec,
        rows: usize,
        cols: usize,
        dense: &[f32],
    ) -> Result<Self, FormatError> {
        check_len(what, rows * cols, dense.len())?;
        let mut m = Self::zeroed(what, spec, rows, cols)?;
        let gs = spec.group();
        for n in 0..rows {
            for g in 0..cols / gs {
                let w = &dense[n * cols + g * gs..n * cols + (g + 1) * gs];
                if let Some(i) = w.iter().position(|v| !v.is_finite()) {
                    return Err(FormatError::NonFiniteWeight {
                        what,
                        row: n,
                        col: g * gs + i,
                        value: w[i],
                    });
                }
                let (scale_bits, zero) = if spec.zero_points {
                    quantize_group_asym(spec.scale_dtype, w)
                } else {
                    (quantize_group_sym_scale(spec.scale_dtype, w), DEFAULT_ZERO)
                };
                let d = spec.scale_dtype.to_f32(scale_bits);
                if !d.is_finite() {
                    return Err(FormatError::ScaleOverflow {
                        what,
                        row: n,
                        group: g,
                        scale: d,
                        dtype: spec.scale_dtype,
                    });
                }
                m.scales[n * (cols / gs) + g] = scale_bits;
                m.set_zero(n, g, zero);
                for (i, &v) in w.iter().enumerate() {
                    let code = if d == 0.0 {
                        zero
                    } else {
                        ((v / d).round_ties_even() + zero as f32).clamp(0.0, 15.0) as u8
                    };
                    m.set_code(n, g * gs + i, code);
                }
            }
        }
        Ok(m)
    }
}

impl PackedMatrix {
    /// [`PackedMatrix::quantize`] from bfloat16 weights (widened to f32 exactly first).
    pub fn quantize_bf16(
        what: &'static str,
        spec: QuantSpec,
        rows: usize,
        cols: usize,
        dense: &[bf16],
    ) -> Result<Self, FormatError> {
        let wide: Vec<f32> = dense.iter().map(|v| v.to_f32()).collect();
        Self::quantize(what, spec, rows, cols, &wide)
    }

    /// [`PackedMatrix::quantize`] from IEEE half weights (widened to f32 exactly first).
    pub fn quantize_f16(
        what: &'static str,
        spec: QuantSpec,
        rows: usize,
        cols: usize,
        dense: &[f16],
    ) -> Result<Self, FormatError> {
        let wide: Vec<f32> = dense.iter().map(|v| v.to_f32()).collect();
        Self::quantize(what, spec, rows, cols, &wide)
    }
}

pub(crate) fn check_len(
    what: &'static str,
    expected: usize,
    got: usize,
) -> Result<(), FormatError> {
    if expected == got {
        Ok(())
    } else {
        Err(FormatError::LengthMismatch {
            what,
            expected,
            got,
        })
    }
}

/// Scale of a symmetric group: the signed element of largest magnitude divided by -8.
pub(crate) fn quantize_group_sym_scale(dtype: ScaleDtype, w: &[f32]) -> u16 {
    let mut m = 0f32;
    for &v in w {
        if v.abs() > m.abs() {
            m = v;
        }
    }
    let bits = dtype.from_f32(m / -8.0);
    // A scale that rounds to a signed zero is stored as +0 so all-zero groups look alike.
    if dtype.to_f32(bits) == 0.0 { 0 } else { bits }
}

/// Scale and zero point of an asymmetric group.
pub(crate) fn quantize_group_asym(dtype: ScaleDtype, w: &[f32]) -> (u16, u8) {
    let min = w.iter().copied().fold(f32::INFINITY, f32::min);
    let max = w.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if max == min {
        // Constant group: symmetric rule represents it exactly when representable.
        return (quantize_group_sym_scale(dtype, w), DEFAULT_ZERO);
    }
    // The range holds 0, so the zero point lies within the codes: for weights all in [10, 11]
    // the range [10, 11] gave z = round(-10 · 15) clamped to 0 and every code 15, about 1.0.
    let (min, max) = (min.min(0.0), max.max(0.0));
    let bits = dtype.from_f32((max - min) / 15.0);
    let d = dtype.to_f32(bits);
    if d == 0.0 {
        return (0, DEFAULT_ZERO);
    }
    let z = (-min / d).round_ties_even().clamp(0.0, 15.0) as u8;
    (bits, z)
}

/// Which half of the gate/up pair a `W13` row belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GateUp {
    /// A row of W1 (gate projection).
    Gate,
    /// A row of W3 (up projection).
    Up,
}

/// The `W13` row holding gate or up row `f`.
#[inline(always)]
pub fn w13_row(which: GateUp, f: usize) -> usize {
    let chunk = f / GATE_UP_CHUNK;
    let within = f % GATE_UP_CHUNK;
    let base = chunk * 2 * GATE_UP_CHUNK + within;
    match which {
        GateUp::Gate => base,
        GateUp::Up => base + GATE_UP_CHUNK,
    }
}

/// Inverse of [`w13_row`]: which projection and which intermediate index a `W13` row holds.
#[inline(always)]
pub fn w13_row_meaning(r: usize) -> (GateUp, usize) {
    let chunk = r / (2 * GATE_UP_CHUNK);
    let within = r % (2 * GATE_UP_CHUNK);
    if within < GATE_UP_CHUNK {
        (GateUp::Gate, chunk * GATE_UP_CHUNK + within)
    } else {
        (GateUp::Up, chunk * GATE_UP_CHUNK + within - GATE_UP_CHUNK)
    }
}

/// One expert's packed weights: `W13 [2F][H]` (gate/up interleaved) and `W2 [H][F]`.
#[derive(Clone, Debug, PartialEq)]
pub struct ExpertWeights {
    hidden: usize,
    inter: usize,
    w13: PackedMatrix,
    w2: PackedMatrix,
}

impl ExpertWeights {
    /// Assemble from packed matrices, checking shapes and that both share one spec.
    pub fn new(w13: PackedMatrix, w2: PackedMatrix) -> Result<Self, FormatError> {
        let hidden = w13.cols();
        let inter = w2.cols();
        if inter % BLOCK != 0 {
            return Err(FormatError::BadIntermediate(inter));
        }
        check_len("W13 rows (2 x intermediate)", 2 * inter, w13.rows())?;
        check_len("W2 rows (hidden)", hidden, w2.rows())?;
        if w13.spec() != w2.spec() {
            return Err(FormatError::MixedSpecs {
                w13: w13.spec(),
                w2: w2.spec(),
            });
        }
        Ok(Self {
            hidden,
            inter,
            w13,
            w2,
        })
    }

    /// The two matrices `(W13, W2)`, consuming the expert.
    pub fn into_parts(self) -> (PackedMatrix, PackedMatrix) {
        (self.w13, self.w2)
    }

    /// Quantize dense `gate [F][H]`, `up [F][H]`, `down [H][F]` (row-major f32).
    pub fn quantize(
        spec: QuantSpec,
        hidden: usize,
        inter: usize,
        gate: &[f32],
        up: &[f32],
        down: &[f32],
    ) -> Result<Self, FormatError> {
        if inter % BLOCK != 0 {
            return Err(FormatError::BadIntermediate(inter));
        }
        check_len("gate", inter * hidden, gate.len())?;
        check_len("up", inter * hidden, up.len())?;
        let mut w13_dense = vec![0f32; 2 * inter * hidden];
        for r in 0..2 * inter {
            let (which, f) = w13_row_meaning(r);
            let src = match which {
                GateUp::Gate => &gate[f * hidden..(f + 1) * hidden],
                GateUp::Up => &up[f * hidden..(f + 1) * hidden],
            };
            w13_dense[r * hidden..(r + 1) * hidden].copy_from_slice(src);
        }
        let w13 = PackedMatrix::quantize("W13", spec, 2 * inter, hidden, &w13_dense)?;
        let w2 = PackedMatrix::quantize("W2", spec, hidden, inter, down)?;
        Self::new(w13, w2)
    }

    /// Hidden size H.
    pub fn hidden(&self) -> usize {
        self.hidden
    }
    /// Intermediate size F.
    pub fn inter(&self) -> usize {
        self.inter
    }
    /// Quantization spec (shared by both matrices).
    pub fn spec(&self) -> QuantSpec {
        self.w13.spec()
    }
    /// The gate/up matrix.
    pub fn w13(&self) -> &PackedMatrix {
        &self.w13
    }
    /// The down matrix.
    pub fn w2(&self) -> &PackedMatrix {
        &self.w2
    }
    /// Mutable gate/up matrix.
    pub fn w13_mut(&mut self) -> &mut PackedMatrix {
        &mut self.w13
    }
    /// Mutable down matrix.
    pub fn w2_mut(&mut self) -> &mut PackedMatrix {
        &mut self.w2
    }
    /// Total stored bytes.
    pub fn bytes(&self) -> usize {
        self.w13.bytes() + self.w2.bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_accounting_matches_storage() {
        for spec in [
            QuantSpec::G32_BF16,
            QuantSpec {
                group_size: 128,
                scale_dtype: ScaleDtype::F16,
                zero_points: true,
            },
            QuantSpec {
                group_size: 64,
                scale_dtype: ScaleDtype::F16,
                zero_points: true,
            },
        ] {
            let m = PackedMatrix::zeroed("t", spec, 5, 384).unwrap();
            assert_eq!(m.bytes() as u64, spec.matrix_bytes(5, 384));
        }
    }

    /// A NaN or infinite stored scale is refused where packed weights are read in (a shard's
    /// bytes, or arrays handed over), naming the row and group; the largest finite scale and
    /// a negative zero are not.
    #[test]
    fn non_finite_scales_are_refused_naming_row_and_group() {
        for (dtype, bad) in [
            (ScaleDtype::F16, [0x7c00u16, 0xfc00, 0x7e00, 0x7c01]),
            (ScaleDtype::Bf16, [0x7f80, 0xff80, 0x7fc0, 0x7f81]),
        ] {
            let spec = QuantSpec {
                group_size: 32,
                scale_dtype: dtype,
                zero_points: false,
            };
            let (rows, cols) = (3, 96);
            let nibbles = vec![0x88u8; rows * cols / 2];
            let max_finite = dtype.from_f32(if dtype == ScaleDtype::F16 {
                65504.0
            } else {
                3.3e38
            });
            let fine = [max_finite, 0x8000, 0x3c00];
            let mut scales = vec![0x3c00u16; rows * 3];
            scales[..3].copy_from_slice(&fine);
            let le = |s: &[u16]| s.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>();
            PackedRef::new("w", spec, rows, cols, &nibbles, &le(&scales), None).unwrap();
            PackedMatrix::from_parts("w", spec, rows, cols, &nibbles, &scales, None).unwrap();
            for bits in bad {
                let mut s = scales.clone();
                s[2 * 3 + 1] = bits; // row 2, group 1
                let want = |e: FormatError| {
                    assert!(
                        matches!(e, FormatError::NonFiniteScale { row: 2, group: 1, bits: b, .. } if b == bits),
                        "{dtype} {bits:#x}: {e}"
                    );
                };
                want(PackedRef::new("w", spec, rows, cols, &nibbles, &le(&s), None).unwrap_err());
                want(
                    PackedMatrix::from_le_parts("w", spec, rows, cols, &nibbles, &le(&s), None)
                        .unwrap_err(),
                );
                want(
                    PackedMatrix::from_parts("w", spec, rows, cols, &nibbles, &s, None)
                        .unwrap_err(),
                );
            }
        }
    }

    #[test]
    fn kimi_expert_bytes() {
        // 3 * 7168 * 2048 weights at 4.5 bits = 24,772,608 bytes (research note B.4).
        assert_eq!(QuantSpec::G32_BF16.expert_bytes(7168, 2048), 24_772_608);
    }

    #[test]
    fn interleave_is_a_bijection() {
        let f = 64;
        let mut seen = vec![false; 2 * f];
        for i in 0..f {
            for which in [GateUp::Gate, GateUp::Up] {
                let r = w13_row(which, i);
                assert!(!seen[r]);
                seen[r] = true;
                assert_eq!(w13_row_meaning(r), (which, i));
            }
        }
        assert!(seen.iter().all(|&s| s));
        assert_eq!(w13_row(GateUp::Gate, 17), 33);
        assert_eq!(w13_row(GateUp::Up, 0), 16);
    }

    #[test]
    fn nibble_order_is_q4_0() {
        let mut m = PackedMatrix::zeroed("t", QuantSpec::G32_BF16, 1, 64).unwrap();
        for k in 0..64 {
            m.set_code(0, k, (k % 16) as u8);
        }
        let row = m.row_nibbles(0);
        // byte j of block b = u[32b+j] | u[32b+j+16] << 4
        for b in 0..2 {
            for j in 0..16 {
                let lo = ((32 * b + j) % 16) as u8;
                let hi = ((32 * b + j + 16) % 16) as u8;
                assert_eq!(row[b * 16 + j], lo | (hi << 4));
            }
        }
    }

    #[test]
    fn half_precision_inputs_quantize_like_their_f32_values() {
        let w: Vec<f32> = (0..64).map(|i| (i as f32 - 31.5) * 0.37).collect();
        let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
        let wh: Vec<f16> = w.iter().map(|&v| f16::from_f32(v)).collect();
        let from_b = PackedMatrix::quantize_bf16("t", QuantSpec::G32_BF16, 2, 32, &wb).unwrap();
        let wide_b: Vec<f32> = wb.iter().map(|v| v.to_f32()).collect();
        assert_eq!(
            from_b,
            PackedMatrix::quantize("t", QuantSpec::G32_BF16, 2, 32, &wide_b).unwrap()
        );
        let from_h = PackedMatrix::quantize_f16("t", QuantSpec::G32_BF16, 2, 32, &wh).unwrap();
        let wide_h: Vec<f32> = wh.iter().map(|v| v.to_f32()).collect();
        assert_eq!(
            from_h,
            PackedMatrix::quantize("t", QuantSpec::G32_BF16, 2, 32, &wide_h).unwrap()
        );
    }

    #[test]
    fn shape_errors_are_named() {
        let e = PackedMatrix::zeroed("W2", QuantSpec::G32_BF16, 4, 48).unwrap_err();
        assert!(e.to_string().contains("48 columns"), "{e}");
        let spec = QuantSpec {
            group_size: 48,
            ..QuantSpec::G32_BF16
        };
        assert_eq!(spec.validate(), Err(FormatError::BadGroupSize(48)));
        let e =
            PackedMatrix::quantize("W", QuantSpec::G32_BF16, 1, 32, &[f32::NAN; 32]).unwrap_err();
        assert!(matches!(e, FormatError::NonFiniteWeight { col: 0, .. }));
    }
}
