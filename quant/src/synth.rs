//! Deterministic synthetic weights and inputs from a seed.
//!
//! Why this exists: until checkpoint loading lands, workers, tests, benches and the demo need
//! expert weights that every process can regenerate independently and identically from
//! `(seed, layer, expert)`: a worker loads only its own experts, and the in-process reference
//! regenerates the same bytes to check the fabric's answers. The generator is a self-contained
//! SplitMix64, so the bytes never change with a dependency upgrade.

use crate::format::{ExpertWeights, FormatError, PackedMatrix, QuantSpec};

/// Identifier mixed into the seed for shared experts (routed experts use the seed as is).
const SHARED_STREAM: u64 = 0x7368_6172; // "shar"

/// Everything that determines a model's synthetic experts: the packed format, the dimensions
/// and the seed. Every process that builds the same `SyntheticExperts` regenerates the same
/// bytes for `(layer, expert)`, which is how a worker loads only its own experts while the
/// in-process reference checks it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SyntheticExperts {
    /// Packed format of every expert.
    pub quant: QuantSpec,
    /// Hidden size `H`.
    pub hidden: usize,
    /// Routed experts' intermediate size.
    pub moe_intermediate: usize,
    /// Shared experts' intermediate size.
    pub shared_intermediate: usize,
    /// The seed.
    pub seed: u64,
}

impl SyntheticExperts {
    /// The routed expert `(layer, expert)`.
    pub fn routed(&self, layer: u32, expert: u32) -> Result<ExpertWeights, FormatError> {
        synthetic_expert(
            self.quant,
            self.hidden,
            self.moe_intermediate,
            self.seed,
            layer,
            expert,
        )
    }

    /// The shared expert `(layer, index)`.
    pub fn shared(&self, layer: u32, index: u32) -> Result<ExpertWeights, FormatError> {
        synthetic_expert(
            self.quant,
            self.hidden,
            self.shared_intermediate,
            mix_seed(&[self.seed, SHARED_STREAM]),
            layer,
            index,
        )
    }
}

/// SplitMix64: tiny, fast, and fully specified (Steele, Lea, Flood 2014).
#[derive(Clone, Debug)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// A generator from a seed.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// Next 64 random bits.
    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    #[inline]
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in [lo, hi).
    pub fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.next_f64()
    }

    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = self.next_f64().max(1e-300);
        let u2 = self.next_f64();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }

    /// Uniform integer in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }
}

/// Mix several identifiers into one seed (so `(seed, layer, expert)` streams are independent).
pub fn mix_seed(parts: &[u64]) -> u64 {
    let mut s = SplitMix64::new(0x4578_7065_7274_4D65); // "ExpertMe"
    let mut acc = 0u64;
    for &p in parts {
        s.0 ^= p;
        acc = acc.rotate_left(17) ^ s.next_u64();
    }
    acc
}

/// `n` standard-normal f32 values times `scale`.
pub fn normal_vec(rng: &mut SplitMix64, n: usize, scale: f64) -> Vec<f32> {
    (0..n).map(|_| (rng.normal() * scale) as f32).collect()
}

/// `n` weights on the breakpoints of a random bfloat16 scale `d` near 0.01 (`(c + ½)·d` for
/// codes `c` in `-8 ..= 7`, where round-half-even decides the code), each moved up to two
/// ulps off it when `jitter`: the groups where a quantizer's f32 division decides, for the
/// searched quantizer's tests.
pub fn half_step_group(rng: &mut SplitMix64, n: usize, jitter: bool) -> Vec<f32> {
    let d = half::bf16::from_f64(0.01 * (1.0 + rng.next_f64())).to_f64();
    (0..n)
        .map(|_| {
            let c = (rng.next_u64() % 16) as f64 - 8.0;
            let v = ((c + 0.5) * d) as f32;
            let ulps = (rng.next_u64() % 5) as i32 - 2;
            f32::from_bits((v.to_bits() as i32 + ulps * i32::from(jitter)) as u32)
        })
        .collect()
}

/// A packed matrix filled directly with random codes and scales (no dense matrix, so large
/// experts are generated at memory speed). Codes are uniform over 0..16 and scales are
/// `(0.5 + U[0,1)) · base` with `base` chosen so a unit-variance input gives unit-variance
/// outputs (`E[(u-8)^2] = 21.5` for uniform codes).
pub fn random_packed(
    what: &'static str,
    spec: QuantSpec,
    rows: usize,
    cols: usize,
    rng: &mut SplitMix64,
) -> Result<PackedMatrix, FormatError> {
    let mut m = PackedMatrix::zeroed(what, spec, rows, cols)?;
    for chunk in m.nibbles_mut().chunks_mut(8) {
        let r = rng.next_u64().to_le_bytes();
        chunk.copy_from_slice(&r[..chunk.len()]);
    }
    let base = 1.0 / (21.5f64.sqrt() * (cols as f64).sqrt());
    let dtype = spec.scale_dtype;
    for s in m.scales_mut() {
        *s = dtype.from_f32((base * rng.uniform(0.5, 1.5)) as f32);
    }
    let groups = m.groups_per_row();
    for n in 0..rows {
        for g in 0..groups {
            if m.zeros().is_some() {
                // zero points near the middle keep the expected value near zero
                let z = 7 + rng.below(3) as u8;
                m.set_zero(n, g, z);
            }
        }
    }
    Ok(m)
}

/// A synthetic expert for `(seed, layer, expert)`, generated directly in packed form.
pub fn synthetic_expert(
    spec: QuantSpec,
    hidden: usize,
    inter: usize,
    seed: u64,
    layer: u32,
    expert: u32,
) -> Result<ExpertWeights, FormatError> {
    let mut rng = SplitMix64::new(mix_seed(&[seed, layer as u64, expert as u64]));
    let w13 = random_packed("W13", spec, 2 * inter, hidden, &mut rng)?;
    let w2 = random_packed("W2", spec, hidden, inter, &mut rng)?;
    ExpertWeights::new(w13, w2)
}

/// A synthetic expert built the slow, realistic way: Gaussian dense weights, then the quantizer.
pub fn quantized_gaussian_expert(
    spec: QuantSpec,
    hidden: usize,
    inter: usize,
    rng: &mut SplitMix64,
) -> Result<ExpertWeights, FormatError> {
    let gate = normal_vec(rng, inter * hidden, 1.0 / (hidden as f64).sqrt());
    let up = normal_vec(rng, inter * hidden, 1.0 / (hidden as f64).sqrt());
    let down = normal_vec(rng, hidden * inter, 1.0 / (inter as f64).sqrt());
    ExpertWeights::quantize(spec, hidden, inter, &gate, &up, &down)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_and_independent() {
        let a = synthetic_expert(QuantSpec::G32_BF16, 64, 32, 7, 1, 2).unwrap();
        let b = synthetic_expert(QuantSpec::G32_BF16, 64, 32, 7, 1, 2).unwrap();
        let c = synthetic_expert(QuantSpec::G32_BF16, 64, 32, 7, 1, 3).unwrap();
        assert_eq!(a, b);
        assert_ne!(a, c);
        // SplitMix64 reference value for seed 0 (from the published algorithm).
        assert_eq!(SplitMix64::new(0).next_u64(), 0xE220_A839_7B1D_CDAF);
    }
}
