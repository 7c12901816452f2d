//! Kernel test vectors: grouped expert batches with the Rust reference's answers, in a small
//! versioned binary file that the C++ harnesses read.
//!
//! Why this exists: the HIP kernels are checked against the Rust reference on machines that have
//! a GPU but maybe no Rust toolchain, and on the CPU side by a g++-compiled host path that shares
//! the kernels' arithmetic (`kernels/em_contract.h`). Both read the same file, written here from
//! the scalar oracle ([`expertmesh_quant::reference`]), so "bit for bit with the CPU reference" means bit for
//! bit with these bytes.
//!
//! # File format (`EMTV`, version 1, all little-endian)
//!
//! ```text
//! magic "EMTV", u32 version = 1, u32 case_count, u32 reserved = 0
//! per case:
//!   u32 hidden H, inter F, group_size, scale_dtype (0 f16, 1 bf16), zero_points (0/1),
//!       experts E, tokens T, groups G, pairs P
//!   per expert: W13 nibbles [2F·H/2] u8, W13 scales [2F·H/g] u16, W13 zeros [2F·ceil(H/g/2)] u8
//!               (only with zero points), then W2 likewise ([H][F])
//!   x [T·H] f32
//!   per group: u32 expert index, u32 pair count   (group g owns the next `count` pairs)
//!   pair_token [P] u32, pair_out [P] u32, pair_weight [P] f32
//!   xq [T·H] i8, xd [T·H/32] f32                  (contract §1 quantization of x)
//!   y_exact [P·H] f32       (row = output row; expert_ffn_exact)
//!   y_combined [T·H] f32    (Σ w·y_exact over each token's pairs in output-row order, from +0)
//!   y_accurate [P·H] f32    (expert_ffn_accurate)
//!   y_f64 [P·H] f64         (expert_ffn_f64: the truth tolerances are measured against)
//! u64 FNV-1a of every preceding byte
//! ```
//!
//! Output rows are numbered token-major in slot order, as [`expertmesh_backend`] requires.

use expertmesh_quant::contract;
use expertmesh_quant::format::{
    BLOCK, ExpertWeights, FormatError, PackedMatrix, QuantSpec, ScaleDtype,
};
use expertmesh_quant::reference;
use expertmesh_quant::synth::{self, SplitMix64};

/// File magic.
pub const MAGIC: [u8; 4] = *b"EMTV";
/// Format version written and accepted.
pub const VERSION: u32 = 1;

/// Errors reading a vector file.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum VectorError {
    /// The file does not start with `EMTV`.
    #[error("not an ExpertMesh test-vector file (magic {0:?}, expected \"EMTV\")")]
    BadMagic([u8; 4]),
    /// A version this reader does not know.
    #[error(
        "test-vector version {0} is not supported (this build reads version {VERSION}); regenerate the file"
    )]
    UnsupportedVersion(u32),
    /// The file ends early.
    #[error(
        "test-vector file truncated while reading {what}: need {need} bytes at offset {offset}, file has {len}"
    )]
    Truncated {
        /// What was being read.
        what: &'static str,
        /// Bytes needed.
        need: usize,
        /// Offset of the read.
        offset: usize,
        /// File length.
        len: usize,
    },
    /// The trailing checksum does not match.
    #[error(
        "test-vector checksum mismatch (stored {stored:#018x}, computed {computed:#018x}): the file is corrupt"
    )]
    Checksum {
        /// Stored value.
        stored: u64,
        /// Computed value.
        computed: u64,
    },
    /// A header field is out of range.
    #[error("test-vector case {case}: {detail}")]
    BadHeader {
        /// Case index.
        case: usize,
        /// What is wrong.
        detail: String,
    },
    /// Packed weights failed validation.
    #[error("test-vector case {case}: {source}")]
    Format {
        /// Case index.
        case: usize,
        /// The format error.
        source: FormatError,
    },
}

/// One expert group: which expert (index into [`VectorCase::experts`]) and how many pairs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VectorGroup {
    /// Expert index.
    pub expert: u32,
    /// Number of (token, expert) pairs; may be zero.
    pub count: u32,
}

/// One grouped batch with its reference outputs.
#[derive(Clone, Debug, PartialEq)]
pub struct VectorCase {
    /// Quantization spec of every expert.
    pub spec: QuantSpec,
    /// Hidden size H.
    pub hidden: usize,
    /// Intermediate size F.
    pub inter: usize,
    /// The experts.
    pub experts: Vec<ExpertWeights>,
    /// Tokens T.
    pub tokens: usize,
    /// Input `[T][H]`.
    pub x: Vec<f32>,
    /// Groups; group g owns the next `count` pairs.
    pub groups: Vec<VectorGroup>,
    /// Input row of each pair.
    pub pair_token: Vec<u32>,
    /// Output row of each pair.
    pub pair_out: Vec<u32>,
    /// Routing weight of each pair.
    pub pair_weight: Vec<f32>,
    /// Contract §1 codes of `x`.
    pub xq: Vec<i8>,
    /// Contract §1 block scales of `x`.
    pub xd: Vec<f32>,
    /// Exact per-slot outputs `[P][H]` by output row.
    pub y_exact: Vec<f32>,
    /// Exact pre-combined outputs `[T][H]`.
    pub y_combined: Vec<f32>,
    /// Accurate-mode reference outputs `[P][H]`.
    pub y_accurate: Vec<f32>,
    /// f64 outputs `[P][H]`.
    pub y_f64: Vec<f64>,
}

impl VectorCase {
    /// Number of (token, expert) pairs.
    pub fn pairs(&self) -> usize {
        self.pair_token.len()
    }
}

/// Parameters of one generated case.
#[derive(Clone, Copy, Debug)]
pub struct CaseParams {
    /// Quantization spec.
    pub spec: QuantSpec,
    /// Hidden size (multiple of the group size).
    pub hidden: usize,
    /// Intermediate size (multiple of the group size and of 32).
    pub inter: usize,
    /// Experts in the batch (some may receive no token).
    pub experts: usize,
    /// Tokens.
    pub tokens: usize,
    /// Experts per token (≤ experts).
    pub top_k: usize,
    /// Build experts by quantizing Gaussian weights (slow, realistic) instead of random codes.
    pub gaussian: bool,
}

impl CaseParams {
    /// A case of random codes (not quantized Gaussian weights): `hidden` and `inter` sizes,
    /// `experts` in the batch, `tokens`, `top_k` experts per token.
    pub fn random_codes(
        spec: QuantSpec,
        (hidden, inter): (usize, usize),
        experts: usize,
        tokens: usize,
        top_k: usize,
    ) -> Self {
        Self {
            spec,
            hidden,
            inter,
            experts,
            tokens,
            top_k,
            gaussian: false,
        }
    }
}

/// Generate one case and compute every reference output.
pub fn generate_case(p: &CaseParams, seed: u64) -> Result<VectorCase, FormatError> {
    assert!(
        p.top_k <= p.experts && p.top_k > 0,
        "top_k must be in 1..=experts"
    );
    let mut rng = SplitMix64::new(seed);
    let experts = generate_experts(p, seed, &mut rng)?;
    let h = p.hidden;
    let x = generate_input(p, &mut rng);
    let routing = generate_routing(p, &mut rng);
    let mut xq = vec![0i8; p.tokens * h];
    let mut xd = vec![0f32; p.tokens * h / BLOCK];
    contract::quantize_activations(&x, &mut xq, &mut xd);
    let (y_exact, y_accurate, y_f64) = reference_outputs(&experts, &x, h, &routing);
    let y_combined = combine_reference(p.tokens, h, &routing, &y_exact);
    let Routing {
        groups,
        pair_token,
        pair_out,
        pair_weight,
    } = routing;
    Ok(VectorCase {
        spec: p.spec,
        hidden: h,
        inter: p.inter,
        experts,
        tokens: p.tokens,
        x,
        groups,
        pair_token,
        pair_out,
        pair_weight,
        xq,
        xd,
        y_exact,
        y_combined,
        y_accurate,
        y_f64,
    })
}

/// A case's routing: the groups and, group-major, each pair's token, output row and weight.
struct Routing {
    groups: Vec<VectorGroup>,
    pair_token: Vec<u32>,
    pair_out: Vec<u32>,
    pair_weight: Vec<f32>,
}

/// Generation step 1: the experts (quantized Gaussian weights or random codes).
fn generate_experts(
    p: &CaseParams,
    seed: u64,
    rng: &mut SplitMix64,
) -> Result<Vec<ExpertWeights>, FormatError> {
    let mut experts = Vec::with_capacity(p.experts);
    for e in 0..p.experts {
        let w = if p.gaussian {
            synth::quantized_gaussian_expert(p.spec, p.hidden, p.inter, rng)?
        } else {
            synth::synthetic_expert(p.spec, p.hidden, p.inter, seed, 0, e as u32)?
        };
        experts.push(w);
    }
    Ok(experts)
}

/// Generation step 2: the input `[T][H]`, with its edge blocks.
fn generate_input(p: &CaseParams, rng: &mut SplitMix64) -> Vec<f32> {
    let h = p.hidden;
    let mut x = synth::normal_vec(rng, p.tokens * h, 1.0);
    // Edge blocks: an all-zero block and a block below the contract's amax threshold.
    x[..BLOCK].fill(0.0);
    if h >= 2 * BLOCK {
        x[BLOCK..2 * BLOCK].fill(1e-35);
    }
    x
}

/// Generation step 3: routing, each token picking top_k distinct experts; output rows
/// token-major in slot order; pairs laid out group-major.
fn generate_routing(p: &CaseParams, rng: &mut SplitMix64) -> Routing {
    let mut choice: Vec<Vec<(u32, f32, u32)>> = vec![Vec::new(); p.experts];
    let mut out_row = 0u32;
    for t in 0..p.tokens {
        let mut picked: Vec<u32> = Vec::with_capacity(p.top_k);
        while picked.len() < p.top_k {
            let e = rng.below(p.experts as u64) as u32;
            if !picked.contains(&e) {
                picked.push(e);
            }
        }
        for e in picked {
            let w = rng.uniform(0.05, 1.0) as f32;
            choice[e as usize].push((t as u32, w, out_row));
            out_row += 1;
        }
    }
    let mut groups = Vec::new();
    let (mut pair_token, mut pair_out, mut pair_weight) = (Vec::new(), Vec::new(), Vec::new());
    for (e, list) in choice.iter().enumerate() {
        groups.push(VectorGroup {
            expert: e as u32,
            count: list.len() as u32,
        });
        for &(t, w, r) in list {
            pair_token.push(t);
            pair_weight.push(w);
            pair_out.push(r);
        }
    }
    Routing {
        groups,
        pair_token,
        pair_out,
        pair_weight,
    }
}

/// Generation step 4: the per-slot reference outputs (exact, accurate, f64) by output row.
fn reference_outputs(
    experts: &[ExpertWeights],
    x: &[f32],
    h: usize,
    routing: &Routing,
) -> (Vec<f32>, Vec<f32>, Vec<f64>) {
    let pairs = routing.pair_token.len();
    let mut y_exact = vec![0f32; pairs * h];
    let mut y_accurate = vec![0f32; pairs * h];
    let mut y_f64 = vec![0f64; pairs * h];
    let mut pair = 0usize;
    for g in &routing.groups {
        let w = &experts[g.expert as usize];
        for _ in 0..g.count {
            let t = routing.pair_token[pair] as usize;
            let r = routing.pair_out[pair] as usize;
            let xt = &x[t * h..(t + 1) * h];
            reference::expert_ffn_exact(w, xt, &mut y_exact[r * h..(r + 1) * h]);
            reference::expert_ffn_accurate(w, xt, &mut y_accurate[r * h..(r + 1) * h]);
            let x64: Vec<f64> = xt.iter().map(|&v| v as f64).collect();
            reference::expert_ffn_f64(w, &x64, &mut y_f64[r * h..(r + 1) * h]);
            pair += 1;
        }
    }
    (y_exact, y_accurate, y_f64)
}

/// Generation step 5: the pre-combined outputs, per token its pairs in increasing output row.
fn combine_reference(tokens: usize, h: usize, routing: &Routing, y_exact: &[f32]) -> Vec<f32> {
    let mut by_token: Vec<Vec<(u32, f32)>> = vec![Vec::new(); tokens];
    for i in 0..routing.pair_token.len() {
        by_token[routing.pair_token[i] as usize]
            .push((routing.pair_out[i], routing.pair_weight[i]));
    }
    let mut y_combined = vec![0f32; tokens * h];
    for (t, list) in by_token.iter_mut().enumerate() {
        list.sort_by_key(|&(r, _)| r);
        for n in 0..h {
            let mut acc = 0f32;
            for &(r, w) in list.iter() {
                acc += w * y_exact[r as usize * h + n];
            }
            y_combined[t * h + n] = acc;
        }
    }
    y_combined
}

/// The standard set: random shapes covering K not a multiple of 256, every scale type, group
/// size and zero-point option, zero-token experts, a single-block intermediate, and groups larger
/// than a prefill token tile (16).
pub fn standard_params() -> Vec<CaseParams> {
    let spec = |g: u32, dt: ScaleDtype, zp: bool| QuantSpec {
        group_size: g,
        scale_dtype: dt,
        zero_points: zp,
    };
    use ScaleDtype::{Bf16, F16};
    let c = |spec, hidden, inter, experts, tokens, top_k, gaussian| CaseParams {
        gaussian,
        ..CaseParams::random_codes(spec, (hidden, inter), experts, tokens, top_k)
    };
    vec![
        c(spec(32, Bf16, false), 96, 64, 5, 3, 2, false),
        c(spec(32, F16, true), 160, 96, 6, 5, 3, false),
        c(spec(64, Bf16, true), 256, 128, 4, 7, 2, true),
        c(spec(128, F16, false), 384, 256, 3, 2, 1, false),
        c(spec(32, Bf16, false), 224, 160, 2, 20, 2, false),
        c(spec(32, Bf16, false), 800, 32, 3, 1, 2, true),
        c(spec(32, Bf16, false), 2080, 352, 3, 4, 2, false),
        c(spec(32, F16, false), 64, 32, 9, 6, 4, false),
    ]
}

/// Generate [`standard_params`] from `seed`.
pub fn standard_cases(seed: u64) -> Result<Vec<VectorCase>, FormatError> {
    standard_params()
        .iter()
        .enumerate()
        .map(|(i, p)| generate_case(p, synth::mix_seed(&[seed, i as u64])))
        .collect()
}

fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_matrix(out: &mut Vec<u8>, m: &PackedMatrix) {
    out.extend_from_slice(m.nibbles());
    for &s in m.scales() {
        out.extend_from_slice(&s.to_le_bytes());
    }
    if let Some(z) = m.zeros() {
        out.extend_from_slice(z);
    }
}

/// Serialize cases to the `EMTV` format.
pub fn to_bytes(cases: &[VectorCase]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&MAGIC);
    put_u32(&mut out, VERSION);
    put_u32(&mut out, cases.len() as u32);
    put_u32(&mut out, 0);
    for c in cases {
        for v in [
            c.hidden as u32,
            c.inter as u32,
            c.spec.group_size,
            c.spec.scale_dtype.flag() as u32,
            c.spec.zero_points as u32,
            c.experts.len() as u32,
            c.tokens as u32,
            c.groups.len() as u32,
            c.pairs() as u32,
        ] {
            put_u32(&mut out, v);
        }
        for e in &c.experts {
            put_matrix(&mut out, e.w13());
            put_matrix(&mut out, e.w2());
        }
        c.x.iter()
            .for_each(|v| out.extend_from_slice(&v.to_le_bytes()));
        for g in &c.groups {
            put_u32(&mut out, g.expert);
            put_u32(&mut out, g.count);
        }
        c.pair_token.iter().for_each(|&v| put_u32(&mut out, v));
        c.pair_out.iter().for_each(|&v| put_u32(&mut out, v));
        c.pair_weight
            .iter()
            .for_each(|v| out.extend_from_slice(&v.to_le_bytes()));
        out.extend(c.xq.iter().map(|&v| v as u8));
        c.xd.iter()
            .for_each(|v| out.extend_from_slice(&v.to_le_bytes()));
        for ys in [&c.y_exact, &c.y_combined, &c.y_accurate] {
            ys.iter()
                .for_each(|v| out.extend_from_slice(&v.to_le_bytes()));
        }
        c.y_f64
            .iter()
            .for_each(|v| out.extend_from_slice(&v.to_le_bytes()));
    }
    let sum = fnv1a(&out);
    out.extend_from_slice(&sum.to_le_bytes());
    out
}

struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], VectorError> {
        match self.pos.checked_add(n) {
            Some(end) if end <= self.bytes.len() => {
                let s = &self.bytes[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            _ => Err(VectorError::Truncated {
                what,
                need: n,
                offset: self.pos,
                len: self.bytes.len(),
            }),
        }
    }
    fn u32(&mut self, what: &'static str) -> Result<u32, VectorError> {
        let b = self.take(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u32s(&mut self, n: usize, what: &'static str) -> Result<Vec<u32>, VectorError> {
        let b = self.take(n.saturating_mul(4), what)?;
        Ok(b.chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }
    fn f32s(&mut self, n: usize, what: &'static str) -> Result<Vec<f32>, VectorError> {
        Ok(self
            .u32s(n, what)?
            .into_iter()
            .map(f32::from_bits)
            .collect())
    }
    fn f64s(&mut self, n: usize, what: &'static str) -> Result<Vec<f64>, VectorError> {
        let b = self.take(n.saturating_mul(8), what)?;
        Ok(b.chunks_exact(8)
            .map(|c| f64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
            .collect())
    }
    fn matrix(
        &mut self,
        case: usize,
        what: &'static str,
        spec: QuantSpec,
        rows: usize,
        cols: usize,
    ) -> Result<PackedMatrix, VectorError> {
        let groups = cols / spec.group();
        let nib = self.take(rows * cols / 2, "nibbles")?;
        let scales: Vec<u16> = self
            .take(rows * groups * 2, "scales")?
            .chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
            .collect();
        let zeros = if spec.zero_points {
            Some(self.take(rows * groups.div_ceil(2), "zero points")?)
        } else {
            None
        };
        PackedMatrix::from_parts(what, spec, rows, cols, nib, &scales, zeros)
            .map_err(|source| VectorError::Format { case, source })
    }
}

/// Upper bound on any one dimension accepted from a file (keeps a corrupt header from asking for
/// absurd allocations before the length checks catch it).
const MAX_DIM: u32 = 1 << 24;

/// Parse an `EMTV` file, checking magic, version, every length and the checksum.
pub fn from_bytes(bytes: &[u8]) -> Result<Vec<VectorCase>, VectorError> {
    let (mut r, n) = open_file(bytes)?;
    let mut cases = Vec::new();
    for case in 0..n as usize {
        cases.push(read_case(&mut r, case)?);
    }
    if r.pos != r.bytes.len() {
        return Err(VectorError::BadHeader {
            case: n as usize,
            detail: format!(
                "{} trailing bytes after the last case",
                r.bytes.len() - r.pos
            ),
        });
    }
    Ok(cases)
}

/// Parsing step 1: check the magic, version and checksum; a reader over the checksummed body
/// positioned at the first case, and the case count.
fn open_file(bytes: &[u8]) -> Result<(Reader<'_>, u32), VectorError> {
    if bytes.len() < 24 {
        return Err(VectorError::Truncated {
            what: "header",
            need: 24,
            offset: 0,
            len: bytes.len(),
        });
    }
    let magic = [bytes[0], bytes[1], bytes[2], bytes[3]];
    if magic != MAGIC {
        return Err(VectorError::BadMagic(magic));
    }
    let body = &bytes[..bytes.len() - 8];
    let stored = u64::from_le_bytes(bytes[bytes.len() - 8..].try_into().unwrap_or([0; 8]));
    let computed = fnv1a(body);
    let mut r = Reader {
        bytes: body,
        pos: 4,
    };
    let version = r.u32("version")?;
    if version != VERSION {
        return Err(VectorError::UnsupportedVersion(version));
    }
    if stored != computed {
        return Err(VectorError::Checksum { stored, computed });
    }
    let n = r.u32("case count")?;
    r.u32("reserved")?;
    Ok((r, n))
}

/// A case header's checked fields.
struct CaseHeader {
    spec: QuantSpec,
    hidden: usize,
    inter: usize,
    experts: u32,
    tokens: usize,
    groups: u32,
    pairs: usize,
}

/// Parsing step 2: read and check one case's header.
fn read_case_header(r: &mut Reader<'_>, case: usize) -> Result<CaseHeader, VectorError> {
    let mut hdr = [0u32; 9];
    for v in hdr.iter_mut() {
        *v = r.u32("case header")?;
    }
    let [h, f, gs, dt, zp, e, t, g, p] = hdr;
    let bad = |detail: String| VectorError::BadHeader { case, detail };
    if hdr.iter().any(|&v| v > MAX_DIM) {
        return Err(bad(format!("a dimension exceeds {MAX_DIM}: {hdr:?}")));
    }
    let scale_dtype = ScaleDtype::from_flag(dt as u8)
        .filter(|_| dt <= 1)
        .ok_or_else(|| bad(format!("scale dtype flag {dt} is not 0 (f16) or 1 (bf16)")))?;
    if zp > 1 {
        return Err(bad(format!("zero-point flag {zp} is not 0 or 1")));
    }
    let spec = QuantSpec {
        group_size: gs,
        scale_dtype,
        zero_points: zp == 1,
    };
    spec.validate()
        .map_err(|source| VectorError::Format { case, source })?;
    let (h, f, t, p) = (h as usize, f as usize, t as usize, p as usize);
    if h == 0 || f == 0 || h % BLOCK != 0 || f % BLOCK != 0 {
        return Err(bad(format!(
            "hidden {h} and inter {f} must be positive multiples of 32"
        )));
    }
    Ok(CaseHeader {
        spec,
        hidden: h,
        inter: f,
        experts: e,
        tokens: t,
        groups: g,
        pairs: p,
    })
}

/// Parsing step 3: read one case (header, experts, routing, inputs and reference outputs).
fn read_case(r: &mut Reader<'_>, case: usize) -> Result<VectorCase, VectorError> {
    let CaseHeader {
        spec,
        hidden: h,
        inter: f,
        experts: e,
        tokens: t,
        groups: g,
        pairs: p,
    } = read_case_header(r, case)?;
    let bad = |detail: String| VectorError::BadHeader { case, detail };
    let mut experts = Vec::with_capacity(e as usize);
    for _ in 0..e {
        let w13 = r.matrix(case, "W13", spec, 2 * f, h)?;
        let w2 = r.matrix(case, "W2", spec, h, f)?;
        experts.push(
            ExpertWeights::new(w13, w2).map_err(|source| VectorError::Format { case, source })?,
        );
    }
    let x = r.f32s(t * h, "x")?;
    let raw = r.u32s(2 * g as usize, "groups")?;
    let groups: Vec<VectorGroup> = raw
        .chunks_exact(2)
        .map(|c| VectorGroup {
            expert: c[0],
            count: c[1],
        })
        .collect();
    if groups.iter().map(|g| g.count as usize).sum::<usize>() != p {
        return Err(bad(format!("group counts do not add up to {p} pairs")));
    }
    if let Some(g) = groups.iter().find(|g| g.expert >= e) {
        return Err(bad(format!("group names expert {} of {e}", g.expert)));
    }
    let pair_token = r.u32s(p, "pair tokens")?;
    let pair_out = r.u32s(p, "pair output rows")?;
    let pair_weight = r.f32s(p, "pair weights")?;
    if pair_token.iter().any(|&v| v as usize >= t) || pair_out.iter().any(|&v| v as usize >= p) {
        return Err(bad("a pair's token or output row is out of range".into()));
    }
    let xq = r.take(t * h, "xq")?.iter().map(|&b| b as i8).collect();
    let xd = r.f32s(t * h / BLOCK, "xd")?;
    let y_exact = r.f32s(p * h, "y_exact")?;
    let y_combined = r.f32s(t * h, "y_combined")?;
    let y_accurate = r.f32s(p * h, "y_accurate")?;
    let y_f64 = r.f64s(p * h, "y_f64")?;
    Ok(VectorCase {
        spec,
        hidden: h,
        inter: f,
        experts,
        tokens: t,
        x,
        groups,
        pair_token,
        pair_out,
        pair_weight,
        xq,
        xd,
        y_exact,
        y_combined,
        y_accurate,
        y_f64,
    })
}

/// The accurate-mode tolerance every implementation is held to, per output row of one pair:
/// `max_n |y[n] - y64[n]| <= ACCURATE_REL_TOL * max(rms(y64), 1e-30)`.
///
/// Why this size: f32 accumulation over K terms has a typical relative error near
/// `sqrt(K)·2^-24` of the sum of magnitudes; K ≤ 8192 and the row-sum-to-rms ratio of these
/// synthetic experts stay far below the factor this leaves (measured worst case for the scalar
/// accurate reference on the standard vectors is checked by a test).
pub const ACCURATE_REL_TOL: f64 = 5e-5;

/// Largest normalized accurate-mode error of `y` against `y64` over the rows of `hidden`
/// elements (see [`ACCURATE_REL_TOL`]).
pub fn accurate_error(y: &[f32], y64: &[f64], hidden: usize) -> f64 {
    let mut worst = 0f64;
    for (row, row64) in y.chunks(hidden).zip(y64.chunks(hidden)) {
        let rms = (row64.iter().map(|v| v * v).sum::<f64>() / hidden as f64).sqrt();
        let err = row
            .iter()
            .zip(row64)
            .map(|(&a, &b)| (a as f64 - b).abs())
            .fold(0f64, f64::max);
        worst = worst.max(err / rms.max(1e-30));
    }
    worst
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small() -> Vec<VectorCase> {
        let p = standard_params();
        vec![
            generate_case(&p[0], 1).unwrap(),
            generate_case(&p[1], 2).unwrap(),
        ]
    }

    #[test]
    fn roundtrip_and_corruption() {
        let cases = small();
        let bytes = to_bytes(&cases);
        assert_eq!(from_bytes(&bytes).unwrap(), cases);
        // Any flipped byte is caught (checksum or header check), never a panic.
        for pos in [0, 5, 30, bytes.len() / 2, bytes.len() - 1] {
            let mut bad = bytes.clone();
            bad[pos] ^= 0x40;
            assert!(from_bytes(&bad).is_err(), "flip at {pos} accepted");
        }
        for cut in [0, 10, 24, bytes.len() - 9] {
            assert!(from_bytes(&bytes[..cut]).is_err());
        }
        let mut v2 = bytes.clone();
        v2[4] = 2;
        assert!(matches!(
            from_bytes(&v2),
            Err(VectorError::UnsupportedVersion(2))
        ));
    }

    #[test]
    fn cases_cover_what_they_claim() {
        let cases = small();
        assert!(
            cases.iter().any(|c| c.groups.iter().any(|g| g.count == 0))
                || cases[1].groups.len() > 1
        );
        for c in &cases {
            // Output rows are a permutation of 0..pairs.
            let mut rows = c.pair_out.clone();
            rows.sort();
            assert!(rows.iter().enumerate().all(|(i, &r)| i == r as usize));
            assert!(accurate_error(&c.y_accurate, &c.y_f64, c.hidden) <= ACCURATE_REL_TOL);
            assert!(accurate_error(&c.y_exact, &c.y_f64, c.hidden) > 0.0);
        }
    }
}
