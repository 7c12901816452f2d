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
    arena: Arc<Arena>,
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

/// Byte ranges of one matrix's nibbles, scales and zero points within its arena.
type Regions = (Range<usize>, Range<usize>, Option<Range<usize>>);

/// Where each matrix of `dims` lies in one arena: in order, each region 64-byte aligned.
fn arena_regions(dims: &[MatrixDims]) -> Vec<Regions> {
    let mut off = 0;
    dims.iter()
        .map(|&d| {
            let (n, s, z) = region_sizes(d.0, d.1, d.2);
            let nib = off..off + n;
            let sc = off + pad64(n)..off + pad64(n) + s;
            let zr = (z > 0).then(|| off + pad64(n) + pad64(s)..off + pad64(n) + pad64(s) + z);
            off += R16Matrix::footprint_of(d);
            (nib, sc, zr)
        })
        .collect()
}

/// Bytes of the arena that holds the matrices `dims` (at least 64).
pub fn arena_bytes(dims: &[MatrixDims]) -> usize {
    dims.iter()
        .map(|&d| R16Matrix::footprint_of(d))
        .sum::<usize>()
        .max(64)
}

/// The memory an arena of tiles lives in: filled by a repack in memory of the process's own,
/// or a mapped tile cache file that already holds the repacked bytes ([`crate::tile_cache`]).
/// Either way it starts 64-byte aligned and is read-only once the matrices exist.
pub enum Arena {
    /// Repacked into fresh memory (huge pages where the kernel gives them).
    Owned(AlignedVec<u8>),
    /// The tiles of a verified tile cache file, mapped read-only.
    Mapped(crate::tile_cache::MappedTiles),
}

impl std::ops::Deref for Arena {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            Arena::Owned(v) => v,
            Arena::Mapped(m) => m.bytes(),
        }
    }
}

impl std::fmt::Debug for Arena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Arena::Owned(v) => write!(f, "Arena::Owned({} bytes)", v.len()),
            Arena::Mapped(m) => write!(f, "Arena::Mapped({} bytes)", m.bytes().len()),
        }
    }
}

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
        let regions = arena_regions(dims);
        let mut arena = AlignedVec::<u8>::zeroed(arena_bytes(dims));
        for (i, (&d, (nib, sc, zr))) in dims.iter().zip(&regions).enumerate() {
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
        }
        Ok(Self::views(dims, regions, Arc::new(Arena::Owned(arena))))
    }

    /// The matrices of the shapes `dims` over an arena that already holds their tiles, laid
    /// out as [`R16Matrix::pack_streamed`] lays them out (a mapped tile cache file). `None`
    /// when the arena's size is not [`arena_bytes`] of `dims`.
    pub(crate) fn over_arena(dims: &[MatrixDims], arena: Arc<Arena>) -> Option<Vec<Self>> {
        (arena.len() == arena_bytes(dims)).then(|| Self::views(dims, arena_regions(dims), arena))
    }

    fn views(dims: &[MatrixDims], regions: Vec<Regions>, arena: Arc<Arena>) -> Vec<Self> {
        dims.iter()
            .zip(regions)
            .map(|(&(rows, cols, spec), (nibbles, scales, zeros))| Self {
                rows,
                cols,
                spec,
                arena: Arc::clone(&arena),
                nibbles,
                scales,
                zeros,
            })
            .collect()
    }

    /// The whole arena this matrix lies in (shared by every matrix packed with it).
    pub(crate) fn arena(&self) -> &Arc<Arena> {
        &self.arena
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
        let per_block = blocks * TILE_BYTES;
        // Padding rows of a partial last row block read as zero codes (0x88 nibbles, zero
        // point 8) and scale 0 (the arena starts zeroed); full row blocks are overwritten
        // below, so only the partial one is filled.
        if rows % ROWS != 0 {
            let last = rows / ROWS;
            arena[nib.start + last * per_block..nib.end].fill(0x88);
            if let Some(z) = &zr {
                let per_z = groups * ROWS;
                arena[z.start + last * per_z..z.end].fill(8);
            }
        }
        // One row block's scales and zero points, `[row][group]`, fetched with one call per
        // row, then written group by group in row order (the scales of a whole row block of a
        // source holding little-endian rows, a mapped shard or an owned matrix, are
        // transposed with vector loads instead, [`transpose_scales`]: loads 5 % faster on an
        // EPYC VM; the value-by-value buffer is then never allocated).
        let mut rb_scales = Vec::new();
        let mut rb_zeros = vec![0u8; if zr.is_some() { ROWS * groups } else { 0 }];
        let row_block = |rb: usize| -> [&[u8]; ROWS] {
            let n0 = rb * ROWS;
            std::array::from_fn(|r| {
                if n0 + r < rows {
                    m.row_nibbles(n0 + r)
                } else {
                    &[]
                }
            })
        };
        let mut src = row_block(0);
        for rb in 0..rows.div_ceil(ROWS) {
            let n0 = rb * ROWS;
            let nr = ROWS.min(rows - n0);
            let next = row_block(rb + 1);
            let tiles = &mut arena[nib.start + rb * per_block..][..per_block];
            transpose_row_block(&src[..nr], &next, tiles, blocks);
            src = next;
            let at = sc.start + rb * groups * ROWS * 2;
            let out = &mut arena[at..at + groups * ROWS * 2];
            if !transpose_scales(m, n0, nr, out) {
                rb_scales.resize(ROWS * groups, 0u16);
                for r in 0..nr {
                    m.row_scale_bits_into(n0 + r, &mut rb_scales[r * groups..(r + 1) * groups]);
                }
                for (g, out) in out.chunks_exact_mut(2 * ROWS).enumerate() {
                    for (r, o) in out.chunks_exact_mut(2).take(nr).enumerate() {
                        o.copy_from_slice(&rb_scales[r * groups + g].to_ne_bytes());
                    }
                }
            }
            if let Some(z) = &zr {
                for r in 0..nr {
                    m.row_zeros_into(n0 + r, &mut rb_zeros[r * groups..(r + 1) * groups]);
                }
                let at = z.start + rb * groups * ROWS;
                for (g, out) in arena[at..at + groups * ROWS]
                    .chunks_exact_mut(ROWS)
                    .enumerate()
                {
                    for (r, o) in out.iter_mut().take(nr).enumerate() {
                        *o = rb_zeros[r * groups + g];
                    }
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

/// Repacks one row block's nibbles: `src` holds its rows' canonical nibble bytes (16, or fewer
/// for a partial last block), `tiles` its `blocks` tiles of [`TILE_BYTES`]. Canonical byte `j`
/// of a block holds elements `j` (low) and `j + 16` (high); R16 byte `(c, r, i)` holds elements
/// `4c + i` and `16 + 4c + i` of row `r`: the same pair, so each tile is a transpose of
/// 4-byte words, `[row][c]` into `[c][row]`.
///
/// `next` holds the next row block's rows (empty slices past the matrix), which the SIMD path
/// prefetches one cache line per row every four blocks: sixteen row streams are more than the
/// hardware prefetchers follow, and without it the repack waited on memory for its source
/// (`bench convert`'s worker load: pack 9.7-10.0 ms against 10.7-11.0 on the EPYC VM).
fn transpose_row_block(src: &[&[u8]], next: &[&[u8]; ROWS], tiles: &mut [u8], blocks: usize) {
    assert!(src.len() <= ROWS && tiles.len() == blocks * TILE_BYTES);
    assert!(src.iter().all(|row| row.len() == blocks * BLOCK_BYTES));
    #[cfg(target_arch = "x86_64")]
    if let Ok(rows) = <&[&[u8]; ROWS]>::try_from(src) {
        // SAFETY: every row holds `blocks` blocks and `tiles` as many tiles (asserted above).
        unsafe { transpose_sse2(rows, next, tiles, blocks) };
        return;
    }
    let _ = next;
    for (r, row) in src.iter().enumerate() {
        for (tile, blk) in tiles
            .chunks_exact_mut(TILE_BYTES)
            .zip(row.chunks_exact(BLOCK_BYTES))
        {
            for c in 0..4 {
                tile[c * 64 + 4 * r..][..4].copy_from_slice(&blk[4 * c..][..4]);
            }
        }
    }
}

/// Write row block `n0`'s scales (`nr` rows) into `out` as `[group][16 rows]` values in the
/// machine's byte order, with vector transposes where the block is full and `m` holds its
/// rows as little-endian bytes ([`PackedRows::row_scales_le`]; x86-64, little-endian);
/// returns whether it wrote them (the caller writes them value by value otherwise).
fn transpose_scales(m: &dyn PackedRows, n0: usize, nr: usize, out: &mut [u8]) -> bool {
    #[cfg(target_arch = "x86_64")]
    if nr == ROWS {
        let mut rows = [&[][..]; ROWS];
        for (r, row) in rows.iter_mut().enumerate() {
            match m.row_scales_le(n0 + r) {
                Some(bytes) => *row = bytes,
                None => return false,
            }
        }
        let groups = out.len() / (2 * ROWS);
        assert!(out.len() == groups * 2 * ROWS && rows.iter().all(|r| r.len() == 2 * groups));
        // SAFETY: every row holds `groups × 2` bytes and `out` `groups × 32` (asserted).
        unsafe { transpose_scales_sse2(&rows, groups, out) };
        return true;
    }
    let _ = (m, n0, nr, out);
    false
}

/// [`transpose_scales`] for 16 rows: 8×8 transposes of 16-bit values (SSE2), each group's 16
/// values stored as two 16-byte halves; the groups past the last multiple of 8 one by one.
///
/// # Safety
/// Each of the 16 rows holds `groups × 2` bytes and `out` holds `groups × 32`.
#[cfg(target_arch = "x86_64")]
unsafe fn transpose_scales_sse2(rows: &[&[u8]; ROWS], groups: usize, out: &mut [u8]) {
    use std::arch::x86_64::*;
    let o = out.as_mut_ptr();
    let full = groups / 8 * 8;
    for g0 in (0..full).step_by(8) {
        for half in 0..2 {
            // SAFETY: g0 + 8 <= groups, so bytes 2·g0..2·g0 + 16 of each row are in bounds;
            // unaligned loads (SSE2, part of x86-64).
            let a: [__m128i; 8] = std::array::from_fn(|j| unsafe {
                _mm_loadu_si128(rows[8 * half + j].as_ptr().add(2 * g0).cast())
            });
            // Pairs, then quads, then octets of rows per group.
            // SAFETY: register-only SSE2, part of x86-64.
            let p: [__m128i; 8] = std::array::from_fn(|i| unsafe {
                let (x, y) = (a[2 * (i / 2)], a[2 * (i / 2) + 1]);
                if i % 2 == 0 {
                    _mm_unpacklo_epi16(x, y)
                } else {
                    _mm_unpackhi_epi16(x, y)
                }
            });
            // p[0]: rows 0,1 groups 0-3; p[1]: rows 0,1 groups 4-7; p[2], p[3]: rows 2,3 ...
            // SAFETY: register-only SSE2, part of x86-64.
            let q: [__m128i; 8] = std::array::from_fn(|i| unsafe {
                let base = 4 * (i / 4) + (i % 4) / 2;
                let (x, y) = (p[base], p[base + 2]);
                if i % 2 == 0 {
                    _mm_unpacklo_epi32(x, y)
                } else {
                    _mm_unpackhi_epi32(x, y)
                }
            });
            // q[0]: rows 0-3 groups 0,1; q[1]: groups 2,3; q[2]: 4,5; q[3]: 6,7; q[4..8]:
            // rows 4-7 likewise.
            for g in 0..8 {
                let (x, y) = (q[g / 2], q[4 + g / 2]);
                // SAFETY: register-only SSE2, and (g0 + g)·32 + 16·half + 16 <= groups · 32.
                unsafe {
                    let v = if g % 2 == 0 {
                        _mm_unpacklo_epi64(x, y)
                    } else {
                        _mm_unpackhi_epi64(x, y)
                    };
                    _mm_storeu_si128(o.add((g0 + g) * 2 * ROWS + 16 * half).cast(), v);
                }
            }
        }
    }
    for g in full..groups {
        for (r, row) in rows.iter().enumerate() {
            out[g * 2 * ROWS + 2 * r..][..2].copy_from_slice(&row[2 * g..2 * g + 2]);
        }
    }
}

/// [`transpose_row_block`] for a full row block: per block, four 4×4 word transposes
/// (SSE2, part of every x86-64 CPU), each tile written once, in order, with `next` (the next
/// row block's rows, any lengths) prefetched along.
///
/// # Safety
/// Each of the 16 rows holds `blocks × 16` bytes and `tiles` holds `blocks` × [`TILE_BYTES`].
#[cfg(target_arch = "x86_64")]
unsafe fn transpose_sse2(
    rows: &[&[u8]; ROWS],
    next: &[&[u8]; ROWS],
    tiles: &mut [u8],
    blocks: usize,
) {
    use std::arch::x86_64::*;
    let out = tiles.as_mut_ptr();
    for b in 0..blocks {
        // The next row block, one line per row every four blocks (a line holds four blocks'
        // bytes of a row): read one row block ahead, into L2 only (`prefetcht1`: sixteen
        // source rows in flight would hold most of the core's L1 miss buffers until DRAM
        // answers; on the EPYC Zen 4 VM the load read 5-19 % more with it). Only addresses
        // inside a row are formed.
        if b % 4 == 0 {
            for row in next {
                if let Some(line) = row.get(b * BLOCK_BYTES..).filter(|l| !l.is_empty()) {
                    // SAFETY: a prefetch only hints the cache (SSE, part of x86-64).
                    unsafe { _mm_prefetch::<_MM_HINT_T1>(line.as_ptr().cast()) };
                }
            }
        }
        // SAFETY: b < blocks, so each row's bytes 16b..16b+16 and the tile's 256 bytes are in
        // bounds (caller's contract); unaligned loads and stores.
        unsafe {
            let t = out.add(b * TILE_BYTES);
            for q in 0..4 {
                let ld = |j: usize| {
                    _mm_loadu_si128(rows[4 * q + j].as_ptr().add(b * BLOCK_BYTES).cast())
                };
                let (a0, a1, a2, a3) = (ld(0), ld(1), ld(2), ld(3));
                let (t0, t1) = (_mm_unpacklo_epi32(a0, a1), _mm_unpacklo_epi32(a2, a3));
                let (t2, t3) = (_mm_unpackhi_epi32(a0, a1), _mm_unpackhi_epi32(a2, a3));
                _mm_storeu_si128(t.add(16 * q).cast(), _mm_unpacklo_epi64(t0, t1));
                _mm_storeu_si128(t.add(64 + 16 * q).cast(), _mm_unpackhi_epi64(t0, t1));
                _mm_storeu_si128(t.add(128 + 16 * q).cast(), _mm_unpacklo_epi64(t2, t3));
                _mm_storeu_si128(t.add(192 + 16 * q).cast(), _mm_unpackhi_epi64(t2, t3));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use expertmesh_quant::synth::{self, SplitMix64};

    /// The vector scale transpose runs for a whole row block of a source holding little-endian
    /// rows (on x86-64) and writes what the value-by-value path writes, for every group count
    /// from 1 to 40 (whole sets of eight and the groups past them).
    #[test]
    fn scale_transpose_runs_and_matches_the_values() {
        for groups in 1..=40 {
            let mut rng = SplitMix64::new(groups as u64);
            let m = synth::random_packed("test", QuantSpec::G32_BF16, 20, groups * 32, &mut rng)
                .expect("a valid shape");
            let mut fast = vec![0u8; groups * 2 * ROWS];
            let ran = transpose_scales(&m, 0, ROWS, &mut fast);
            assert_eq!(ran, cfg!(target_arch = "x86_64"), "{groups} groups");
            let mut want = vec![0u8; groups * 2 * ROWS];
            for g in 0..groups {
                for r in 0..ROWS {
                    let at = g * 2 * ROWS + 2 * r;
                    want[at..at + 2].copy_from_slice(&m.scale_bits(r, g).to_ne_bytes());
                }
            }
            if ran {
                assert_eq!(fast, want, "{groups} groups");
            }
            // A partial row block (rows 16..20) is left to the caller.
            assert!(!transpose_scales(&m, ROWS, 4, &mut fast));
        }
    }
}
