//! The exact-mode (W4A8) numerical contract, written down so that a second implementation can
//! match it bit for bit.
//!
//! Why this exists: ExpertMesh promises that the scalar reference, the AVX2 and AVX-512 VNNI CPU
//! kernels and the HIP kernels produce **identical bits** in exact mode, and that the fabric's
//! output equals the in-process reference whatever the placement or replica choice. That only
//! holds if every floating-point operation, its operands' order and its rounding are specified.
//! This module is that specification, and its functions are the executable form of it that every
//! kernel is tested against. All arithmetic is IEEE 754 binary32 with round-to-nearest-even, no
//! fused multiply-add (HIP sources are compiled with `-ffp-contract=off`; Rust never contracts),
//! and no flushing of subnormals.
//!
//! # 1. Activation quantization (per token, per 32-element block)
//!
//! For each block `x[0..32]` of an activation vector (the input of `W13`, and the intermediate
//! `h` before `W2`):
//!
//! ```text
//! amax = max_i |x[i]|                                   (exact)
//! if !(amax >= 2^-96):  d = 0, q[i] = 0                 (all-zero or negligible block)
//! else:
//!     d    = amax / 127                                 (f32 division)
//!     inv  = 127 / amax                                 (f32 division, computed separately)
//!     q[i] = clamp(round_half_even(x[i] * inv), -127, 127)   as i8
//! ```
//!
//! Inputs must be finite; the fabric rejects NaN and infinities before they reach a kernel.
//!
//! # 2. Per-block integer dot product
//!
//! For weight row `n` and block `b` (elements `32b..32b+32`), with `z` the zero point of the
//! block's scale group:
//!
//! ```text
//! isum[b] = Σ_{j<32} (u[n][32b+j] - z) · q[32b+j]              (exact in i32, any order)
//! ```
//!
//! `|isum| ≤ 32·15·127`, so it is exact in i32 and also exactly representable in f32.
//!
//! # 3. Block term and fixed reduction order over K
//!
//! ```text
//! t[b] = (s[n][group(b)] * d[b]) * f32(isum[b])       (two roundings, in this order)
//! ```
//!
//! The terms are summed with [`LANES`] = 16 partial sums: `P[l] = +0.0`, then for each block `b`
//! in increasing order `P[b % 16] = P[b % 16] + t[b]`; then a halving tree
//! `P[l] = P[l] + P[l + w]` for `w = 8, 4, 2, 1` and `l < w`. The row result is `P[0]`.
//! On a GPU this is 16 lanes striding over K followed by `xor` shuffles 8, 4, 2, 1 (IEEE addition
//! is commutative, so every lane of an xor butterfly ends with the same bits); a 64-wide wave
//! computes four rows at once, a 32-wide wave two.
//!
//! # 4. Gate/up epilogue
//!
//! For intermediate index `f`, with `g` and `u` the row results of the gate and up rows:
//!
//! ```text
//! h[f] = silu(g) * u          silu(g) = g / (1 + exp_c(-g))
//! ```
//!
//! where `exp_c` is [`exp_contract`]: a range reduction to `2^n · e^r` and a fixed degree-7
//! polynomial, each step a single IEEE operation (see the function for the exact sequence).
//! `h` is then quantized with step 1 and multiplied by `W2` with steps 2–3, giving the expert
//! output `y[0..H]`.
//!
//! # 5. Combining experts
//!
//! A token's routed output is `acc = +0.0; for slot in 0..k: acc = acc + (w[slot] * y_slot)`,
//! slots in the router's order (descending score, ties to the lower expert id). Shared experts
//! are added after the routed sum in their index order: `out = acc + y_shared0 (+ y_shared1 ...)`.
//! Workers in exact mode return one vector per (token, slot) and the router performs this sum,
//! so the result does not depend on placement, replica choice or device count.
//!
//! # Accurate mode (W4A16)
//!
//! Activations stay f32 (converted exactly from bf16/f16), weights are dequantized exactly, and
//! dot products accumulate in f32 in whatever order a kernel prefers; results are compared with
//! an f64 reference within a stated tolerance, never bit for bit.

use crate::format::BLOCK;
use serde::{Deserialize, Serialize};

/// Which numerical contract a computation follows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ComputeMode {
    /// W4A8 with the fixed operation order of this module: bit-identical everywhere.
    #[default]
    Exact,
    /// W4A16 (f32 activations): within a stated tolerance of the f64 reference.
    Accurate,
}

impl ComputeMode {
    /// The name used on the command line and in files.
    pub fn name(self) -> &'static str {
        match self {
            ComputeMode::Exact => "exact",
            ComputeMode::Accurate => "accurate",
        }
    }
}

/// How an expert computation's results are laid out: what a backend writes and what a worker
/// sends back (one definition for the backend trait and the wire).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OutputLayout {
    /// One unweighted row per (token, expert) pair, `[pairs][H]`, in the dispatch's order; the
    /// router combines them in slot order.
    PerSlot,
    /// One row per input token, `[T][H]`: the weighted sum of its pairs on this device (the
    /// worker's experts already summed with their routing weights).
    PreCombined,
}

/// Partial sums per row in the exact reduction (see the module docs, §3).
pub const LANES: usize = 16;

/// Blocks whose largest magnitude is below this quantize to zero: 2^-96 (bits 0x0F800000).
pub const MIN_BLOCK_AMAX: f32 = f32::from_bits(0x0F80_0000);

/// Quantize one 32-element block per §1, writing 32 codes; returns the block scale `d`.
#[inline]
pub fn quantize_block(x: &[f32], q: &mut [i8]) -> f32 {
    debug_assert_eq!(x.len(), BLOCK);
    debug_assert_eq!(q.len(), BLOCK);
    let mut amax = 0f32;
    for &v in x {
        amax = amax.max(v.abs());
    }
    // `!(amax >= MIN)` also catches NaN.
    // A NaN amax also takes this branch (inputs are validated finite before they get here).
    if amax.partial_cmp(&MIN_BLOCK_AMAX) != Some(std::cmp::Ordering::Greater)
        && amax != MIN_BLOCK_AMAX
    {
        q.fill(0);
        return 0.0;
    }
    let d = amax / 127.0;
    let inv = 127.0 / amax;
    for (qi, &v) in q.iter_mut().zip(x) {
        *qi = round_half_even_small(v * inv).clamp(-127.0, 127.0) as i8;
    }
    d
}

/// `1.5 · 2^23`: adding and subtracting it rounds an f32 of magnitude below `2^22` to the
/// nearest integer, ties to even (the sum lies where the spacing of f32 values is 1, and IEEE
/// addition rounds to nearest even; the subtraction is exact).
const ROUNDING_MAGIC: f32 = 12_582_912.0;

/// `t.round_ties_even()` for `|t| < 2^22` (and NaN for NaN), in two additions; except that a
/// negative `t` that rounds to zero gives +0 (the `as i8` that follows makes both 0).
///
/// Why not `round_ties_even`: on the x86-64 baseline (no SSE4.1) it is a call to the C
/// library's `rintf` per element, which kept the router's activation quantization from
/// vectorizing (about 4 % of a 2-vCPU fabric's CPU time at batch 64). Here `|t| ≤ 127`; the
/// searched quantizer's code rule and its plain passes use it too.
#[inline(always)]
pub(crate) fn round_half_even_small(t: f32) -> f32 {
    (t + ROUNDING_MAGIC) - ROUNDING_MAGIC
}

/// Quantize a whole activation vector (`x.len()` a multiple of 32) into codes `q` and per-block
/// scales `d`.
pub fn quantize_activations(x: &[f32], q: &mut [i8], d: &mut [f32]) {
    assert_eq!(
        x.len() % BLOCK,
        0,
        "activation length must be a multiple of 32"
    );
    assert_eq!(q.len(), x.len());
    assert_eq!(d.len(), x.len() / BLOCK);
    for (b, db) in d.iter_mut().enumerate() {
        *db = quantize_block(
            &x[b * BLOCK..(b + 1) * BLOCK],
            &mut q[b * BLOCK..(b + 1) * BLOCK],
        );
    }
}

/// Lower clamp of [`exp_contract`]'s argument.
pub const EXP_MIN: f32 = -87.0;
/// Upper clamp of [`exp_contract`]'s argument.
pub const EXP_MAX: f32 = 88.0;
/// log2(e) rounded to f32 (bits 0x3FB8AA3B).
pub const LOG2E: f32 = f32::from_bits(0x3FB8_AA3B);
/// High part of ln 2: 0.693359375 (bits 0x3F318000).
pub const LN2_HI: f32 = f32::from_bits(0x3F31_8000);
/// Low part of ln 2: -2.12194440e-4 (bits 0xB95E8083).
pub const LN2_LO: f32 = f32::from_bits(0xB95E_8083);
/// Polynomial coefficients of [`exp_contract`], highest degree first (Cephes `expf`), given by
/// their bit patterns so every implementation uses the same values:
/// 1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 0.5.
pub const EXP_POLY: [f32; 6] = [
    f32::from_bits(0x3950_6967),
    f32::from_bits(0x3AB7_43CE),
    f32::from_bits(0x3C08_8908),
    f32::from_bits(0x3D2A_A9C1),
    f32::from_bits(0x3E2A_AAAA),
    f32::from_bits(0x3F00_0000),
];

/// `e^v` as the contract computes it. Every line is one IEEE binary32 operation:
///
/// ```text
/// v  = min(max(v, -87), 88)
/// n  = round_half_even(v * LOG2E)
/// r  = v - n * LN2_HI                 (multiply, then subtract)
/// r  = r - n * LN2_LO
/// z  = r * r
/// p  = c0; p = p * r + c1; ... ; p = p * r + c5        (c = EXP_POLY, multiply then add)
/// p  = p * z;  p = p + r;  p = p + 1
/// e  = p * 2^n                        (2^n built from its exponent bits; n ∈ [-126, 127])
/// ```
///
/// Accuracy: within 2 ulp of `e^v` on the clamped range (tested against f64).
#[inline(always)]
// One line per IEEE operation, as specified above; max-then-min (not clamp) because that is
// what fmaxf/fminf compute on the GPU.
#[allow(clippy::assign_op_pattern, clippy::manual_clamp)]
pub fn exp_contract(v: f32) -> f32 {
    let v = v.max(EXP_MIN).min(EXP_MAX);
    let n = (v * LOG2E).round_ties_even();
    let mut r = v - n * LN2_HI;
    r = r - n * LN2_LO;
    let z = r * r;
    let mut p = EXP_POLY[0];
    for &c in &EXP_POLY[1..] {
        p = p * r + c;
    }
    p = p * z;
    p = p + r;
    p = p + 1.0;
    let pow2 = f32::from_bits(((n as i32 + 127) as u32) << 23);
    p * pow2
}

/// `silu(g) = g / (1 + exp_c(-g))` per the contract.
#[inline(always)]
pub fn silu_contract(g: f32) -> f32 {
    g / (1.0 + exp_contract(-g))
}

/// The gate/up epilogue `silu(g) * u`.
#[inline(always)]
pub fn swiglu_contract(g: f32, u: f32) -> f32 {
    silu_contract(g) * u
}

/// Reduce per-block terms in the contract's fixed order (§3). `terms[b]` is block `b`'s term.
pub fn reduce_terms(terms: impl IntoIterator<Item = f32>) -> f32 {
    let mut p = [0f32; LANES];
    for (b, t) in terms.into_iter().enumerate() {
        p[b % LANES] += t;
    }
    reduce_lanes(&mut p)
}

/// The halving tree of §3 over 16 lane partials.
#[inline(always)]
pub fn reduce_lanes(p: &mut [f32; LANES]) -> f32 {
    let mut w = LANES / 2;
    while w > 0 {
        for l in 0..w {
            p[l] += p[l + w];
        }
        w /= 2;
    }
    p[0]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The two-addition rounding is `round_ties_even` wherever the quantizer uses it (and a
    /// margin beyond): every multiple of 2^-10 up to 130 in magnitude, every half-integer and
    /// its neighbours one ulp away, tiny and subnormal values, a spread of random patterns.
    #[test]
    fn two_addition_rounding_is_round_half_even() {
        let check = |t: f32| {
            let (got, want) = (round_half_even_small(t), t.round_ties_even());
            assert!(
                got == want || (got.is_nan() && want.is_nan()),
                "{t:e}: {got} against {want}"
            );
        };
        for i in -(130 << 10)..=(130 << 10) {
            check(i as f32 / 1024.0);
        }
        for k in -131..=131 {
            let h = k as f32 + 0.5;
            for t in [h, h.next_up(), h.next_down()] {
                check(t);
            }
        }
        for t in [
            0.0,
            -0.0,
            f32::MIN_POSITIVE,
            -f32::MIN_POSITIVE,
            1e-45,
            -1e-45,
            0.49999997,
        ] {
            check(t);
        }
        check(f32::NAN);
        let mut s = 0x9E37_79B9_7F4A_7C15u64;
        for _ in 0..1_000_000 {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let t = f32::from_bits(s as u32);
            if t.abs() < 4_194_304.0 {
                check(t);
            }
        }
    }

    #[test]
    fn exp_is_accurate() {
        let mut worst = 0f64;
        let mut v = -87.0f32;
        while v < 88.0 {
            let got = exp_contract(v) as f64;
            let want = (v as f64).exp();
            let ulp = (want as f32).abs() * f32::EPSILON;
            let err = (got - want).abs() / ulp as f64;
            worst = worst.max(err);
            v += 0.0137;
        }
        assert!(worst <= 2.0, "exp_contract worst error {worst} ulp");
        assert_eq!(exp_contract(0.0), 1.0);
        assert_eq!(exp_contract(-1000.0), exp_contract(EXP_MIN));
        assert!(exp_contract(1000.0).is_finite());
    }

    #[test]
    fn silu_limits() {
        assert_eq!(silu_contract(0.0), 0.0);
        assert!((silu_contract(30.0) - 30.0).abs() < 1e-5);
        assert!(silu_contract(-30.0).abs() < 1e-10);
        let x = 1.3f64;
        assert!((silu_contract(x as f32) as f64 - x / (1.0 + (-x).exp())).abs() < 1e-6);
    }

    #[test]
    fn block_quantization_spec() {
        let mut x = [0f32; 32];
        for (i, v) in x.iter_mut().enumerate() {
            *v = (i as f32 - 15.5) * 0.25;
        }
        let mut q = [0i8; 32];
        let d = quantize_block(&x, &mut q);
        assert_eq!(d, 3.875f32 / 127.0);
        assert_eq!(q[0], -127);
        assert_eq!(q[31], 127);
        // round half even: x*inv = 0.5 exactly would round to 0
        for (i, &qi) in q.iter().enumerate() {
            let want = (x[i] * (127.0 / 3.875)).round_ties_even();
            assert_eq!(qi as f32, want);
        }
        let d = quantize_block(&[0.0; 32], &mut q);
        assert_eq!(d, 0.0);
        assert!(q.iter().all(|&v| v == 0));
        let d = quantize_block(&[1e-35; 32], &mut q);
        assert_eq!(d, 0.0);
    }

    #[test]
    fn reduction_tree_order() {
        // Terms chosen so that sequential and tree order differ in f32.
        let terms: Vec<f32> = (0..40)
            .map(|i| {
                if i % 3 == 0 {
                    1e8
                } else {
                    1.0 + i as f32 * 1e-3
                }
            })
            .collect();
        let mut p = [0f32; LANES];
        for (b, &t) in terms.iter().enumerate() {
            p[b % 16] += t;
        }
        let mut q = p;
        for l in 0..8 {
            q[l] += q[l + 8];
        }
        for l in 0..4 {
            q[l] += q[l + 4];
        }
        for l in 0..2 {
            q[l] += q[l + 2];
        }
        let want = q[0] + q[1];
        assert_eq!(
            reduce_terms(terms.iter().copied()).to_bits(),
            want.to_bits()
        );
    }
}
