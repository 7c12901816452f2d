//! The CPU kernels' tile layout ("R16"): a deterministic, load-time repack of the canonical
//! format that puts 16 output rows side by side.
//!
//! Why this exists: the CPU kernels vectorize over output rows (one SIMD lane per row), so no
//! horizontal reductions are needed and each lane follows the contract's block order exactly.
//! For that, the nibbles of 16 rows for one 32-element block must sit in 256 contiguous bytes,
//! arranged so that one `& 0x0F` or `>> 4` yields, per 32-bit lane, four consecutive K elements
//! of that lane's row:
//!
//! ```text
//! row block rb (rows 16rb..16rb+16), K block b (elements 32b..32b+32):
//!   nibbles[rb][b]: 4 chunks c = 0..4 of 64 bytes; byte 4r + i of chunk c holds
//!       low nibble  = u[16rb + r][32b + 4c + i]        (elements 0..16 of the block)
//!       high nibble = u[16rb + r][32b + 16 + 4c + i]   (elements 16..32)
//!   scales[rb][g]: 16 u16, row order (g = scale group)
//!   zeros[rb][g]:  16 u8, row order, one zero point per byte (only with zero points)
//! ```
//!
//! Rows past the end of the matrix (when N is not a multiple of 16) are padded with code 8 and
//! scale 0, and their outputs are discarded. [`R16Matrix::to_canonical`] inverts the repack
//! (round-trip tested).

use expertmesh_quant::aligned::AlignedVec;
use expertmesh_quant::format::{BLOCK, BLOCK_BYTES, PackedMatrix, PackedRows, QuantSpec};
use std::ops::Range;
use std::sync::Arc;

/// Rows per row block (SIMD lanes).
pub const ROWS: usize = 16;
/// Bytes of nibbles per (row block, K block).
pub const TILE_BYTES: usize = ROWS * BLOCK_BYTES;

/// A packed matrix in the R16 layout: three regions (nibbles, scales, zero points) of a byte
/// arena that may hold many matrices. The CPU backend packs all the experts of a device into one
/// arena, so a few huge allocations (2 MiB pages) back every weight the kernels stream.
#[derive(Clone, Debug)]
pub struct R16Matrix {
    rows: usize,
    cols: usize,
    spec: QuantSpec,
    arena: Arc<AlignedVec<u8>>,
    nibbles: Range<usize>,
    /// Byte range of the u16 scales (64-byte aligned start).
    scales: Range<usize>,
    zeros: Option<Range<usize>>,
}

fn pad64(n: usize) -> usize {
    n.div_ceil(64) * 64
}

/// Byte sizes of the three regions of a `rows × cols` matrix of `spec` in the R16 layout
/// (nibbles, scales, zero points).
fn region_sizes(rows: usize, cols: usize, spec: QuantSpec) -> (usize, usize, usize) {
    let rbs = rows.div_ceil(ROWS);
    let groups = cols / spec.group();
    let nib = rbs * (cols / BLOCK) * TILE_BYTES;
    let sc = rbs * groups * ROWS * 2;
    let z = if spec.zero_points {
        rbs * groups * ROWS
    } else {
        0
    };
    (nib, sc, z)
}

/// The shape of one matrix to pack: rows, columns, format.
pub type MatrixDims = (usize, usize, QuantSpec);

impl R16Matrix {
    /// Arena bytes one matrix needs (each region 64-byte aligned).
    pub fn footprint(m: &PackedMatrix) -> usize {
        Self::footprint_of((m.rows(), m.cols(), m.spec()))
    }

    fn footprint_of((rows, cols, spec): MatrixDims) -> usize {
        let (n, s, z) = region_sizes(rows, cols, spec);
        pad64(n) + pad64(s) + pad64(z)
    }

    /// Repack a canonical matrix into its own arena.
    pub fn from_canonical(m: &PackedMatrix) -> Self {
        Self::pack_all(&[m]).pop().expect("one matrix")
    }

    /// Repack several matrices into one shared arena (in order).
    pub fn pack_all(ms: &[&PackedMatrix]) -> Vec<Self> {
        let dims: Vec<MatrixDims> = ms.iter().map(|m| (m.rows(), m.cols(), m.spec())).collect();
        let r: Result<_, std::convert::Infallible> = Self::pack_streamed(&dims, |i, write| {
            write(ms[i]);
            Ok(())
        });
        match r {
            Ok(v) => v,
            Err(e) => match e {},
        }
    }

    /// Pack matrices of the shapes `dims` into one arena sized up front, asking `fill(i, w)` to
    /// hand matrix `i` to `w` (in order): the caller can read each from a file and drop it, so
    /// the canonical set is never in memory whole. A matrix whose shape differs from `dims[i]`
    /// is a caller bug and panics.
    pub fn pack_streamed<E>(
        dims: &[MatrixDims],
        mut fill: impl FnMut(usize, &mut dyn FnMut(&dyn PackedRows)) -> Result<(), E>,
    ) -> Result<Vec<Self>, E> {
        let total: usize = dims.iter().map(|&d| Self::footprint_of(d)).sum();
        let mut arena = AlignedVec::<u8>::zeroed(total.max(64));
        let mut layout = Vec::with_capacity(dims.len());
        let mut off = 0;
        for (i, &d) in dims.iter().enumerate() {
            let (n, s, z) = region_sizes(d.0, d.1, d.2);
            let nib = off..off + n;
            let sc = off + pad64(n)..off + pad64(n) + s;
            let zr = (z > 0).then(|| off + pad64(n) + pad64(s)..off + pad64(n) + pad64(s) + z);
            let mut written = false;
            fill(i, &mut |m: &dyn PackedRows| {
                assert_eq!(
                    (m.rows(), m.cols(), m.spec()),
                    d,
                    "pack_streamed: matrix {i} shape"
                );
                Self::write(m, &mut arena, nib.clone(), sc.clone(), zr.clone());
                written = true;
            })?;
            assert!(written, "pack_streamed: matrix {i} was not handed over");
            layout.push((nib, sc, zr));
            off += Self::footprint_of(d);
        }
        let arena = Arc::new(arena);
        Ok(dims
            .iter()
            .zip(layout)
            .map(|(&(rows, cols, spec), (nibbles, scales, zeros))| Self {
                rows,
                cols,
                spec,
                arena: Arc::clone(&arena),
                nibbles,
                scales,
                zeros,
            })
            .collect())
    }

    fn write(
        m: &dyn PackedRows,
        arena: &mut [u8],
        nib: Range<usize>,
        sc: Range<usize>,
        zr: Option<Range<usize>>,
    ) {
        let rows = m.rows();
        let blocks = m.cols() / BLOCK;
        let groups = m.cols() / m.spec().group();
        // One row's scales and zero points, fetched with one call each per row.
        let (mut row_scales, mut row_zeros) = (vec![0u16; groups], vec![0u8; groups]);
        // Padding rows of a partial last row block read as zero codes (0x88 nibbles, zero
        // point 8); full row blocks are overwritten below, so only the partial one is filled.
        if rows % ROWS != 0 {
            let last = rows / ROWS;
            let per_block = blocks * TILE_BYTES;
            arena[nib.start + last * per_block..nib.end].fill(0x88);
            if let Some(z) = &zr {
                let per_z = groups * ROWS;
                arena[z.start + last * per_z..z.end].fill(8);
            }
        }
        for n in 0..rows {
            let (rb, r) = (n / ROWS, n % ROWS);
            let src = m.row_nibbles(n);
            for b in 0..blocks {
                let tile = &mut arena[nib.start + (rb * blocks + b) * TILE_BYTES..][..TILE_BYTES];
                let blk = &src[b * BLOCK_BYTES..(b + 1) * BLOCK_BYTES];
                for c in 0..4 {
                    // canonical byte j holds elements j (low) and j + 16 (high); R16 byte
                    // (c, r, i) holds elements 4c + i (low) and 16 + 4c + i (high): the same
                    // pair, so the four bytes i = 0..4 copy unchanged.
                    tile[c * 64 + 4 * r..][..4].copy_from_slice(&blk[4 * c..][..4]);
                }
            }
            m.row_scale_bits_into(n, &mut row_scales);
            for (g, s) in row_scales.iter().enumerate() {
                let at = sc.start + ((rb * groups + g) * ROWS + r) * 2;
                arena[at..at + 2].copy_from_slice(&s.to_ne_bytes());
            }
            if let Some(z) = &zr {
                m.row_zeros_into(n, &mut row_zeros);
                for (g, &zero) in row_zeros.iter().enumerate() {
                    arena[z.start + (rb * groups + g) * ROWS + r] = zero;
                }
            }
        }
    }

    fn nibble_bytes(&self) -> &[u8] {
        &self.arena[self.nibbles.clone()]
    }

    fn scale_values(&self) -> &[u16] {
        let bytes = &self.arena[self.scales.clone()];
        // SAFETY: the region starts 64-byte aligned and holds whole u16 values written with
        // to_ne_bytes; u16 has no invalid bit patterns.
        unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<u16>(), bytes.len() / 2) }
    }

    fn zero_bytes(&self) -> Option<&[u8]> {
        self.zeros.clone().map(|z| &self.arena[z])
    }

    /// Invert the repack.
    pub fn to_canonical(&self) -> PackedMatrix {
        let mut m = PackedMatrix::zeroed("R16", self.spec, self.rows, self.cols)
            .expect("shape was valid when packed");
        let blocks = self.blocks();
        let groups = self.groups();
        for n in 0..self.rows {
            let (rb, r) = (n / ROWS, n % ROWS);
            for b in 0..blocks {
                let tile = self.tile(rb, b);
                for c in 0..4 {
                    for i in 0..4 {
                        let byte = tile[c * 64 + 4 * r + i];
                        m.set_code(n, b * BLOCK + 4 * c + i, byte & 0x0F);
                        m.set_code(n, b * BLOCK + 16 + 4 * c + i, byte >> 4);
                    }
                }
            }
            for g in 0..groups {
                m.scales_mut()[n * groups + g] = self.scale_values()[(rb * groups + g) * ROWS + r];
                if let Some(z) = self.zero_bytes() {
                    m.set_zero(n, g, z[(rb * groups + g) * ROWS + r]);
                }
            }
        }
        m
    }

    /// Output rows N.
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// Input columns K.
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// Row blocks (N / 16 rounded up).
    pub fn row_blocks(&self) -> usize {
        self.rows.div_ceil(ROWS)
    }
    /// 32-element K blocks.
    pub fn blocks(&self) -> usize {
        self.cols / BLOCK
    }
    /// Scale groups per row.
    pub fn groups(&self) -> usize {
        self.cols / self.spec.group()
    }
    /// 32-element blocks per scale group (1, 2 or 4).
    pub fn blocks_per_group(&self) -> usize {
        self.spec.group() / BLOCK
    }
    /// The quantization spec.
    pub fn spec(&self) -> QuantSpec {
        self.spec
    }
    /// Nibble tile `(rb, b)`, 256 bytes.
    #[inline(always)]
    pub fn tile(&self, rb: usize, b: usize) -> &[u8] {
        &self.nibble_bytes()[(rb * self.blocks() + b) * TILE_BYTES..][..TILE_BYTES]
    }
    /// All nibble tiles of row block `rb`, `[blocks][256]`.
    #[inline(always)]
    pub fn row_block_nibbles(&self, rb: usize) -> &[u8] {
        let n = self.blocks() * TILE_BYTES;
        &self.nibble_bytes()[rb * n..(rb + 1) * n]
    }
    /// All scales of row block `rb`, `[groups][16]`.
    #[inline(always)]
    pub fn row_block_scales(&self, rb: usize) -> &[u16] {
        let n = self.groups() * ROWS;
        &self.scale_values()[rb * n..(rb + 1) * n]
    }
    /// All zero points of row block `rb`, `[groups][16]`, when present.
    #[inline(always)]
    pub fn row_block_zeros(&self, rb: usize) -> Option<&[u8]> {
        let n = self.groups() * ROWS;
        self.zero_bytes().map(|z| &z[rb * n..(rb + 1) * n])
    }
    /// Bytes held (nibbles, scales, zeros).
    pub fn bytes(&self) -> usize {
        self.nibbles.len() + self.scales.len() + self.zeros.as_ref().map_or(0, |z| z.len())
    }
}
