//! Scalar reference implementations of one expert FFN: the oracle for every fast kernel.
//!
//! Why this exists: the SIMD and HIP kernels are fast and therefore hard to read; this module is
//! slow and obvious. [`expert_ffn_exact`] *is* the exact-mode contract of [`crate::contract`]
//! executed line by line, [`expert_ffn_accurate`] is the W4A16 mode with a plain sequential f32
//! accumulation, and [`expert_ffn_f64`] is the truth for the quantized model (exactly dequantized
//! weights, f64 arithmetic, libm `exp`) that tolerances are measured against.

use crate::contract::{self, LANES, quantize_activations};
use crate::format::{BLOCK, BLOCK_BYTES, ExpertWeights, GateUp, PackedMatrix, w13_row};

/// A vector quantized per the contract's §1: codes and per-block scales.
#[derive(Clone, Debug, PartialEq)]
pub struct QuantizedVec {
    /// int8 codes, one per element.
    pub q: Vec<i8>,
    /// f32 scale per 32-element block.
    pub d: Vec<f32>,
}

impl QuantizedVec {
    /// Quantize `x` (length a multiple of 32).
    pub fn new(x: &[f32]) -> Self {
        let mut q = vec![0i8; x.len()];
        let mut d = vec![0f32; x.len() / BLOCK];
        quantize_activations(x, &mut q, &mut d);
        Self { q, d }
    }
}

/// Exact integer dot of block `b` of row `n` with activation codes `q` (contract §2).
#[inline]
pub fn block_isum(m: &PackedMatrix, n: usize, b: usize, q: &[i8]) -> i32 {
    let bytes = &m.row_nibbles(n)[b * BLOCK_BYTES..(b + 1) * BLOCK_BYTES];
    let z = m.zero(n, m.group_of_block(b)) as i32;
    let qb = &q[b * BLOCK..(b + 1) * BLOCK];
    let mut s = 0i32;
    for (j, &byte) in bytes.iter().enumerate() {
        s += ((byte & 0x0F) as i32 - z) * qb[j] as i32;
        s += ((byte >> 4) as i32 - z) * qb[j + BLOCK_BYTES] as i32;
    }
    s
}

/// Row result of the exact mode (contract §2–§3): `Σ_b (s·d_b)·isum_b` in the fixed order.
pub fn row_dot_exact(m: &PackedMatrix, n: usize, a: &QuantizedVec) -> f32 {
    assert_eq!(a.q.len(), m.cols(), "activation length != matrix columns");
    let mut p = [0f32; LANES];
    for b in 0..m.blocks_per_row() {
        let s = m.scale(n, m.group_of_block(b));
        let t = (s * a.d[b]) * block_isum(m, n, b, &a.q) as f32;
        p[b % LANES] += t;
    }
    contract::reduce_lanes(&mut p)
}

/// One expert on one token in exact (W4A8) mode, per the contract. `x.len() == H`,
/// `y.len() == H`.
pub fn expert_ffn_exact(w: &ExpertWeights, x: &[f32], y: &mut [f32]) {
    let a = QuantizedVec::new(x);
    expert_ffn_exact_quantized(w, &a, y)
}

/// [`expert_ffn_exact`] with the input already quantized (the input quantization depends only
/// on the token, so callers running several experts on one token quantize once).
pub fn expert_ffn_exact_quantized(w: &ExpertWeights, a: &QuantizedVec, y: &mut [f32]) {
    assert_eq!(y.len(), w.hidden(), "output length != hidden size");
    let mut h = vec![0f32; w.inter()];
    for (f, hf) in h.iter_mut().enumerate() {
        let g = row_dot_exact(w.w13(), w13_row(GateUp::Gate, f), a);
        let u = row_dot_exact(w.w13(), w13_row(GateUp::Up, f), a);
        *hf = contract::swiglu_contract(g, u);
    }
    let hq = QuantizedVec::new(&h);
    for (n, yn) in y.iter_mut().enumerate() {
        *yn = row_dot_exact(w.w2(), n, &hq);
    }
}

/// One expert on one token in accurate (W4A16) mode: exact dequantization, sequential f32
/// accumulation along K, f32 intermediate.
pub fn expert_ffn_accurate(w: &ExpertWeights, x: &[f32], y: &mut [f32]) {
    assert_eq!(x.len(), w.hidden(), "input length != hidden size");
    assert_eq!(y.len(), w.hidden(), "output length != hidden size");
    let mut row = vec![0f32; w.hidden()];
    let dot = |m: &PackedMatrix, n: usize, v: &[f32], row: &mut Vec<f32>| -> f32 {
        row.resize(m.cols(), 0.0);
        m.dequantize_row(n, row);
        row.iter().zip(v).map(|(a, b)| a * b).sum::<f32>()
    };
    let mut h = vec![0f32; w.inter()];
    for (f, hf) in h.iter_mut().enumerate() {
        let g = dot(w.w13(), w13_row(GateUp::Gate, f), x, &mut row);
        let u = dot(w.w13(), w13_row(GateUp::Up, f), x, &mut row);
        *hf = contract::swiglu_contract(g, u);
    }
    for (n, yn) in y.iter_mut().enumerate() {
        *yn = dot(w.w2(), n, &h, &mut row);
    }
}

/// One expert on one token in f64: exactly dequantized weights, unquantized activations, libm
/// `exp`. The truth that tolerances are measured against.
pub fn expert_ffn_f64(w: &ExpertWeights, x: &[f64], y: &mut [f64]) {
    assert_eq!(x.len(), w.hidden(), "input length != hidden size");
    assert_eq!(y.len(), w.hidden(), "output length != hidden size");
    let mut row = vec![0f32; w.hidden()];
    let mut h = vec![0f64; w.inter()];
    let dot = |m: &PackedMatrix, n: usize, v: &[f64], row: &mut Vec<f32>| -> f64 {
        row.resize(m.cols(), 0.0);
        m.dequantize_row(n, row);
        row.iter().zip(v).map(|(&a, &b)| a as f64 * b).sum::<f64>()
    };
    for (f, hf) in h.iter_mut().enumerate() {
        let g = dot(w.w13(), w13_row(GateUp::Gate, f), x, &mut row);
        let u = dot(w.w13(), w13_row(GateUp::Up, f), x, &mut row);
        *hf = g / (1.0 + (-g).exp()) * u;
    }
    for (n, yn) in y.iter_mut().enumerate() {
        *yn = dot(w.w2(), n, &h, &mut row);
    }
}
