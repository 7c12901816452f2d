//! The CPU backend against the scalar reference: bit-identical in exact mode on every ISA this
//! machine supports, within tolerance of f64 in accurate mode.

use crate::say;
use expertmesh_backend::{
    Activations, BatchLimits, ExpertBackend, ExpertGroup, ExpertKey, GroupedBatch, OutputLayout,
};
use expertmesh_cpu_backend::CpuBackend;
use expertmesh_cpu_backend::kernels::{self, Isa, RowBlockJob, TokenQ8};
use expertmesh_cpu_backend::layout::R16Matrix;
use expertmesh_quant::contract::{self, ComputeMode};
use expertmesh_quant::format::{
    ExpertWeights, PackedMatrix, PackedRef, PackedRows, QuantSpec, ScaleDtype,
};
use expertmesh_quant::reference::{self, QuantizedVec};
use expertmesh_quant::synth::{self, SplitMix64};
use proptest::prelude::*;

pub(crate) fn spec_strategy() -> impl Strategy<Value = QuantSpec> {
    (
        prop::sample::select(vec![32u32, 64, 128]),
        prop::sample::select(vec![ScaleDtype::F16, ScaleDtype::Bf16]),
        any::<bool>(),
    )
        .prop_map(|(group_size, scale_dtype, zero_points)| QuantSpec {
            group_size,
            scale_dtype,
            zero_points,
        })
}

/// A matrix that gives its scales value by value only (no little-endian rows).
struct ValuesOnly<'a>(&'a PackedMatrix);

impl PackedRows for ValuesOnly<'_> {
    fn rows(&self) -> usize {
        self.0.rows()
    }
    fn cols(&self) -> usize {
        self.0.cols()
    }
    fn spec(&self) -> QuantSpec {
        self.0.spec()
    }
    fn row_nibbles(&self, n: usize) -> &[u8] {
        PackedRows::row_nibbles(self.0, n)
    }
    fn scale_bits(&self, n: usize, g: usize) -> u16 {
        PackedRows::scale_bits(self.0, n, g)
    }
    fn zero(&self, n: usize, g: usize) -> u8 {
        PackedRows::zero(self.0, n, g)
    }
}

fn random_matrix(spec: QuantSpec, rows: usize, cols: usize, seed: u64) -> PackedMatrix {
    let mut rng = SplitMix64::new(seed);
    synth::random_packed("test", spec, rows, cols, &mut rng).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn r16_repack_round_trips(spec in spec_strategy(), rows in 1usize..40, kb in 1usize..12, seed in any::<u64>()) {
        let cols = (kb * 32).div_ceil(spec.group_size as usize) * spec.group_size as usize;
        let m = random_matrix(spec, rows, cols, seed);
        let r = R16Matrix::from_canonical(&m);
        prop_assert_eq!(r.to_canonical(), m);
    }

    /// The repack reads a matrix the same from every source: an owned matrix and a mapped
    /// shard's view (whole row blocks' scales transposed with vector loads from their
    /// little-endian rows) and a source that gives its scales value by value.
    #[test]
    fn r16_repack_is_the_same_from_every_source(
        spec in spec_strategy(), rows in 1usize..70, kb in 1usize..24, seed in any::<u64>()
    ) {
        let cols = (kb * 32).div_ceil(spec.group_size as usize) * spec.group_size as usize;
        let m = random_matrix(spec, rows, cols, seed);
        let scales_le: Vec<u8> = m.scales().iter().flat_map(|s| s.to_le_bytes()).collect();
        let view = PackedRef::new("test", spec, rows, cols, m.nibbles(), &scales_le, m.zeros())
            .expect("the matrix's own lengths");
        let dims = [(rows, cols, spec)];
        let pack = |src: &dyn PackedRows| {
            let r: Result<_, std::convert::Infallible> = R16Matrix::pack_streamed(&dims, |_, w| {
                w(src);
                Ok(())
            });
            r.expect("infallible").pop().expect("one matrix").to_canonical()
        };
        prop_assert_eq!(&pack(&m), &m);
        prop_assert_eq!(&pack(&view), &m);
        prop_assert_eq!(&pack(&ValuesOnly(&m)), &m);
    }

    /// Every ISA's row-block kernel equals the contract's scalar row dot bit for bit.
    #[test]
    fn rowblock_exact_is_bit_identical(
        spec in spec_strategy(), rows in 1usize..40, kb in 1usize..40, ntok in 1usize..=8, seed in any::<u64>()
    ) {
        let cols = (kb * 32).div_ceil(spec.group_size as usize) * spec.group_size as usize;
        let m = random_matrix(spec, rows, cols, seed);
        let r16 = R16Matrix::from_canonical(&m);
        let mut rng = SplitMix64::new(seed ^ 1);
        let acts: Vec<QuantizedVec> = (0..ntok)
            .map(|_| QuantizedVec::new(&synth::normal_vec(&mut rng, cols, 1.0)))
            .collect();
        let sums: Vec<Vec<i32>> = acts.iter().map(|a| {
            let mut s = vec![0; cols / 32];
            kernels::block_sums(&a.q, &mut s);
            s
        }).collect();
        let toks: Vec<TokenQ8> = acts.iter().zip(&sums).map(|(a, s)| TokenQ8 { q: &a.q, d: &a.d, qsum: s }).collect();
        for isa in Isa::available() {
            for rb in 0..r16.row_blocks() {
                let mut out = [[0f32; 16]; 8];
                kernels::rowblock_exact(isa, &r16, rb, &toks, &mut out);
                for (t, a) in acts.iter().enumerate() {
                    for r in 0..16.min(rows - rb * 16) {
                        let want = reference::row_dot_exact(&m, rb * 16 + r, a);
                        prop_assert_eq!(out[t][r].to_bits(), want.to_bits(),
                            "{:?} row {} token {}: {} vs {}", isa, rb * 16 + r, t, out[t][r], want);
                    }
                }
            }
        }
    }
}

/// A term of `-0.0` (negative scales against an all-zero activation) adds to partials that
/// start at `+0.0`, as the contract's do: every kernel gives `+0.0`, bit for bit, for every
/// token count and for K below and above sixteen blocks (where the multi-token kernels and
/// the streams kernels, 1 to 4 streams of 1, 2 or 4 tokens, write their first sixteen
/// blocks' partials without zeroing them first).
#[test]
fn negative_zero_terms_sum_to_positive_zero() {
    for kb in [3usize, 16, 21] {
        let cols = kb * 32;
        let mut m = random_matrix(QuantSpec::G32_BF16, 32, cols, kb as u64);
        for s in m.scales_mut() {
            *s |= 0x8000; // negative scales
        }
        let r16 = R16Matrix::from_canonical(&m);
        let zero = QuantizedVec::new(&vec![0f32; cols]);
        let mut rng = SplitMix64::new(kb as u64);
        let other = QuantizedVec::new(&synth::normal_vec(&mut rng, cols, 1.0));
        let sum = |a: &QuantizedVec| {
            let mut s = vec![0; kb];
            kernels::block_sums(&a.q, &mut s);
            s
        };
        let (zs, os) = (sum(&zero), sum(&other));
        for ntok in 1..=8 {
            // Token 1 is an ordinary one (so a kernel cannot special-case a zero batch).
            let acts: Vec<&QuantizedVec> = (0..ntok)
                .map(|t| if t == 1 { &other } else { &zero })
                .collect();
            let toks: Vec<TokenQ8> = acts
                .iter()
                .enumerate()
                .map(|(t, a)| TokenQ8 {
                    q: &a.q,
                    d: &a.d,
                    qsum: if t == 1 { &os } else { &zs },
                })
                .collect();
            for isa in Isa::available() {
                for rb in 0..r16.row_blocks() {
                    let mut out = [[f32::NAN; 16]; 8];
                    kernels::rowblock_exact(isa, &r16, rb, &toks, &mut out);
                    for (t, a) in acts.iter().enumerate() {
                        for r in 0..16 {
                            let want = reference::row_dot_exact(&m, rb * 16 + r, a);
                            if t != 1 {
                                assert_eq!(want.to_bits(), 0, "the contract gives +0.0");
                            }
                            assert_eq!(
                                out[t][r].to_bits(),
                                want.to_bits(),
                                "{isa:?} K {cols}, {ntok} tokens, row {}, token {t}: {} vs {want}",
                                rb * 16 + r,
                                out[t][r]
                            );
                        }
                    }
                    // The streams kernels (their partials are not zeroed either), with one,
                    // two and four tokens per job.
                    let one = std::slice::from_ref(&r16);
                    let tok = |i: usize| toks[i];
                    let outs = [
                        run_jobs::<1>(isa, one, &vec![(0, rb); ntok], tok),
                        run_jobs::<2>(isa, one, &vec![(0, rb); ntok / 2], tok),
                        run_jobs::<4>(isa, one, &vec![(0, rb); ntok / 4], tok),
                    ];
                    for (t, a) in acts.iter().enumerate() {
                        for r in 0..16 {
                            let want = reference::row_dot_exact(&m, rb * 16 + r, a);
                            for (out, per_job) in outs.iter().zip([1, 2, 4]) {
                                if let Some(got) = out.get(t) {
                                    assert_eq!(
                                        got[r].to_bits(),
                                        want.to_bits(),
                                        "{isa:?} streams of {per_job} tokens, K {cols}, row {}, token {t}",
                                        rb * 16 + r
                                    );
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// The streams kernels over a list of jobs (row blocks of several matrices, each with its
    /// own 1 to 4 tokens; read as interleaved streams on AVX-512 VNNI and AVX2, 4, 2 and 1 at
    /// a time, and split where K differs) equal the contract's scalar row dot bit for bit, on
    /// every ISA: K with and without a tail of blocks past 16, partial last row blocks.
    #[test]
    fn rowblocks_exact_is_bit_identical(
        spec in spec_strategy(), kb in 1usize..40, other_kb in 1usize..40,
        picks in prop::collection::vec((0usize..3, 0usize..4), 1..10), seed in any::<u64>(),
        tokens in 1usize..=kernels::MAX_STREAM_TOKENS
    ) {
        let g = spec.group_size as usize;
        let cols = (kb * 32).div_ceil(g) * g;
        let other_cols = (other_kb * 32).div_ceil(g) * g;
        // Three matrices: two of K `cols`, one of K `other_cols`; 1 to 4 row blocks each, the
        // last one partial when the seed says so.
        let shapes = [(4 * 16 - (seed % 3) as usize, cols), (3 * 16, cols), (2 * 16 - 5, other_cols)];
        let ms: Vec<PackedMatrix> = shapes.iter().enumerate()
            .map(|(i, &(rows, k))| random_matrix(spec, rows, k, seed ^ i as u64))
            .collect();
        let r16: Vec<R16Matrix> = ms.iter().map(R16Matrix::from_canonical).collect();
        let mut rng = SplitMix64::new(seed ^ 7);
        let acts: Vec<QuantizedVec> = picks.iter()
            .flat_map(|&(mi, _)| std::iter::repeat_n(mi, tokens))
            .map(|mi| QuantizedVec::new(&synth::normal_vec(&mut rng, ms[mi].cols(), 1.0)))
            .collect();
        let sums: Vec<Vec<i32>> = acts.iter().map(|a| {
            let mut s = vec![0; a.q.len() / 32];
            kernels::block_sums(&a.q, &mut s);
            s
        }).collect();
        let tok = |i: usize| TokenQ8 { q: &acts[i].q, d: &acts[i].d, qsum: &sums[i] };
        let rbs: Vec<(usize, usize)> =
            picks.iter().map(|&(mi, rb)| (mi, rb % r16[mi].row_blocks())).collect();
        for isa in Isa::available() {
            let out = match tokens {
                1 => run_jobs::<1>(isa, &r16, &rbs, tok),
                2 => run_jobs::<2>(isa, &r16, &rbs, tok),
                3 => run_jobs::<3>(isa, &r16, &rbs, tok),
                _ => run_jobs::<4>(isa, &r16, &rbs, tok),
            };
            for (i, &(mi, rb)) in rbs.iter().enumerate() {
                let m = &ms[mi];
                for t in 0..tokens {
                    let k = i * tokens + t;
                    for r in 0..16.min(m.rows() - rb * 16) {
                        let want = reference::row_dot_exact(m, rb * 16 + r, &acts[k]);
                        prop_assert_eq!(out[k][r].to_bits(), want.to_bits(),
                            "{:?} job {} of {} tokens, token {} (matrix {}, row {}): {} vs {}",
                            isa, i, tokens, t, mi, rb * 16 + r, out[k][r], want);
                    }
                }
            }
        }
    }
}

/// [`kernels::rowblocks_exact`] over jobs `(matrix, row block)` of `T` tokens each, job `i`'s
/// token `t` being `tok(i·T + t)`: the outputs, one per token.
fn run_jobs<'a, const T: usize>(
    isa: Isa,
    r16: &'a [R16Matrix],
    rbs: &[(usize, usize)],
    tok: impl Fn(usize) -> TokenQ8<'a>,
) -> Vec<[f32; 16]> {
    let jobs: Vec<RowBlockJob<'a, T>> = rbs
        .iter()
        .enumerate()
        .map(|(i, &(mi, rb))| RowBlockJob {
            m: &r16[mi],
            rb,
            toks: std::array::from_fn(|t| tok(i * T + t)),
        })
        .collect();
    let mut out = vec![[f32::NAN; 16]; jobs.len() * T];
    kernels::rowblocks_exact(isa, &jobs, &mut out);
    out
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Accurate mode's three int8 levels add back up to the activation within f32's own
    /// rounding (2^-21 of the block's largest magnitude, checked in f64), with block sums that
    /// match their codes; blocks of very different magnitudes, outliers and exact zeros; more
    /// blocks than one step of the level quantizer takes; every ISA's levels bit for bit the
    /// scalar ones.
    #[test]
    fn accurate_levels_reconstruct_the_activation(
        blocks in 1usize..40, seed in any::<u64>(), scale_exp in -30i32..30, outlier in any::<bool>()
    ) {
        let k = blocks * 32;
        let mut rng = SplitMix64::new(seed);
        let mut x = synth::normal_vec(&mut rng, k, 2f64.powi(scale_exp));
        if outlier {
            x[seed as usize % k] *= 1000.0;
        }
        x[..8].fill(0.0);
        let (stride, bstride) = (k + 64, blocks + 2);
        let lv = kernels::ACCURATE_LEVELS;
        let mut q = vec![0i8; lv * stride];
        let mut d = vec![0f32; lv * bstride];
        let mut qsum = vec![0i32; lv * bstride];
        kernels::quantize_levels(Isa::Scalar, &x, &mut q, &mut d, &mut qsum, stride, bstride);
        // Every ISA's levels are the scalar ones, bit for bit.
        for isa in Isa::available() {
            let (mut q2, mut d2, mut s2) = (vec![0i8; lv * stride], vec![0f32; lv * bstride], vec![0i32; lv * bstride]);
            kernels::quantize_levels(isa, &x, &mut q2, &mut d2, &mut s2, stride, bstride);
            prop_assert_eq!(&q2, &q, "{:?} codes", isa);
            prop_assert_eq!(d2.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), d.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), "{:?} scales", isa);
            prop_assert_eq!(&s2, &qsum, "{:?} sums", isa);
        }
        for b in 0..blocks {
            let amax = x[b * 32..(b + 1) * 32].iter().fold(0f64, |m, v| m.max(v.abs() as f64));
            for i in b * 32..(b + 1) * 32 {
                let back: f64 = (0..lv).map(|l| d[l * bstride + b] as f64 * q[l * stride + i] as f64).sum();
                prop_assert!((back - x[i] as f64).abs() <= amax * 2f64.powi(-21),
                    "element {}: {} back as {}", i, x[i], back);
            }
            for l in 0..lv {
                let sum: i32 = q[l * stride + b * 32..l * stride + (b + 1) * 32].iter().map(|&v| v as i32).sum();
                prop_assert_eq!(qsum[l * bstride + b], sum);
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    /// The accurate one-token kernel over jobs of two matrices (read as interleaved streams on
    /// AVX-512 VNNI, on the exact kernels elsewhere) against the f64 product of the dequantized
    /// weights and the unquantized activation: every row within 1e-5 of the rows' RMS (ten
    /// times tighter than accurate mode's stated 1e-4, so a lost level shows).
    #[test]
    fn rowblocks_accurate_1_within_tolerance(
        spec in spec_strategy(), kb in 2usize..40, seed in any::<u64>()
    ) {
        let g = spec.group_size as usize;
        let cols = (kb * 32).div_ceil(g) * g;
        let ms: Vec<PackedMatrix> = (0..2).map(|i| random_matrix(spec, 48, cols, seed ^ i)).collect();
        let r16: Vec<R16Matrix> = ms.iter().map(R16Matrix::from_canonical).collect();
        let mut rng = SplitMix64::new(seed ^ 9);
        let xs: Vec<Vec<f32>> = (0..6).map(|_| synth::normal_vec(&mut rng, cols, 1.0)).collect();
        let lv = kernels::ACCURATE_LEVELS;
        let nb = cols / 32;
        let levels: Vec<(Vec<i8>, Vec<f32>, Vec<i32>)> = xs.iter().map(|x| {
            let (mut q, mut d, mut qs) = (vec![0i8; lv * cols], vec![0f32; lv * nb], vec![0i32; lv * nb]);
            kernels::quantize_levels(Isa::detect(), x, &mut q, &mut d, &mut qs, cols, nb);
            (q, d, qs)
        }).collect();
        // Job i: token i against row block i % 3 of matrix i % 2.
        let jobs: Vec<kernels::LevelsJob> = levels.iter().enumerate().map(|(i, (q, d, qs))| kernels::LevelsJob {
            m: &r16[i % 2],
            rb: i % 3,
            levels: std::array::from_fn(|l| TokenQ8 {
                q: &q[l * cols..(l + 1) * cols],
                d: &d[l * nb..(l + 1) * nb],
                qsum: &qs[l * nb..(l + 1) * nb],
            }),
        }).collect();
        let mut want = vec![[0f64; 16]; jobs.len()];
        let mut w = vec![0f32; cols];
        for (i, wi) in want.iter_mut().enumerate() {
            for (r, wr) in wi.iter_mut().enumerate() {
                ms[i % 2].dequantize_row((i % 3) * 16 + r, &mut w);
                *wr = w.iter().zip(&xs[i]).map(|(&a, &b)| a as f64 * b as f64).sum();
            }
        }
        let rms = (want.iter().flatten().map(|v| v * v).sum::<f64>() / (16 * jobs.len()) as f64).sqrt();
        for isa in Isa::available() {
            let mut out = vec![[f32::NAN; 16]; jobs.len()];
            kernels::rowblocks_accurate_1(isa, &jobs, &mut out);
            for (i, (o, wi)) in out.iter().zip(&want).enumerate() {
                for r in 0..16 {
                    let err = (o[r] as f64 - wi[r]).abs() / rms;
                    prop_assert!(err <= 1e-5, "{:?} job {} row {}: {} vs {} ({:.1e} of the RMS)", isa, i, r, o[r], wi[r], err);
                }
            }
        }
    }
}

/// A batch description for tests: per expert, the tokens that chose it.
struct TestBatch {
    hidden: usize,
    experts: Vec<ExpertWeights>,
    x: Vec<f32>,
    tokens: usize,
    /// (expert index, tokens ascending, weights)
    groups: Vec<(usize, Vec<u32>, Vec<f32>)>,
}

impl TestBatch {
    fn random(
        spec: QuantSpec,
        hidden: usize,
        inters: &[usize],
        tokens: usize,
        top_k: usize,
        seed: u64,
    ) -> Self {
        let mut rng = SplitMix64::new(seed);
        let experts: Vec<ExpertWeights> = inters
            .iter()
            .enumerate()
            .map(|(i, &f)| synth::synthetic_expert(spec, hidden, f, seed, 0, i as u32).unwrap())
            .collect();
        let x = synth::normal_vec(&mut rng, tokens * hidden, 1.0);
        let e = experts.len();
        let mut per_expert: Vec<(Vec<u32>, Vec<f32>)> = vec![(vec![], vec![]); e];
        for t in 0..tokens {
            // choose top_k distinct experts; expert 0 is never chosen when e > top_k, so one
            // loaded expert always receives zero tokens
            let lo = if e > top_k { 1 } else { 0 };
            let mut chosen = Vec::new();
            while chosen.len() < top_k.min(e - lo) {
                let c = lo + rng.below((e - lo) as u64) as usize;
                if !chosen.contains(&c) {
                    chosen.push(c);
                }
            }
            for c in chosen {
                per_expert[c].0.push(t as u32);
                per_expert[c].1.push(rng.uniform(0.1, 1.0) as f32);
            }
        }
        let groups = per_expert
            .into_iter()
            .enumerate()
            .filter(|(_, (t, _))| !t.is_empty())
            .map(|(i, (t, w))| (i, t, w))
            .collect();
        Self {
            hidden,
            experts,
            x,
            tokens,
            groups,
        }
    }

    /// Output rows numbered token-major in expert order (the "slot order" of this test).
    fn out_rows(&self) -> Vec<Vec<u32>> {
        let mut slots: Vec<(u32, usize, usize)> = Vec::new(); // (token, group, i)
        for (gi, (_, toks, _)) in self.groups.iter().enumerate() {
            for (i, &t) in toks.iter().enumerate() {
                slots.push((t, gi, i));
            }
        }
        slots.sort();
        let mut rows: Vec<Vec<u32>> = self
            .groups
            .iter()
            .map(|(_, t, _)| vec![0; t.len()])
            .collect();
        for (r, &(_, gi, i)) in slots.iter().enumerate() {
            rows[gi][i] = r as u32;
        }
        rows
    }

    fn run(&self, backend: &mut CpuBackend, mode: ComputeMode, layout: OutputLayout) -> Vec<f32> {
        let keys: Vec<ExpertKey> = (0..self.experts.len())
            .map(|i| ExpertKey {
                layer: 3,
                expert: i as u32,
            })
            .collect();
        let pairs: usize = self.groups.iter().map(|g| g.1.len()).sum();
        backend
            .load(
                keys.iter()
                    .cloned()
                    .zip(self.experts.iter().cloned())
                    .collect(),
                BatchLimits {
                    max_tokens: self.tokens,
                    max_pairs: pairs.max(1),
                },
            )
            .unwrap();
        let rows = self.out_rows();
        let groups: Vec<ExpertGroup> = self
            .groups
            .iter()
            .zip(&rows)
            .map(|((e, t, w), r)| ExpertGroup {
                key: keys[*e],
                tokens: t,
                weights: w,
                out_rows: r,
            })
            .collect();
        let batch = GroupedBatch {
            mode,
            hidden: self.hidden,
            tokens: self.tokens,
            input: Activations::F32(&self.x),
            groups: &groups,
            layout,
        };
        let mut out = vec![f32::NAN; batch.output_len()];
        backend.execute(&batch, &mut out).unwrap();
        out
    }
}

fn check_exact(tb: &TestBatch, isa: Isa, threads: usize) -> Result<(), TestCaseError> {
    // Small test shapes reach the AMX kernel too (with Isa::Amx).
    check_exact_on(
        tb,
        CpuBackend::with_isa(threads, isa)
            .unwrap()
            .with_amx_min_cols(0),
    )
}

/// The AMX scheduling on any machine: the tile emulator runs the AMX kernel.
fn check_exact_amx_emulated(tb: &TestBatch, threads: usize) -> Result<(), TestCaseError> {
    check_exact_on(tb, CpuBackend::with_amx_emulated(threads).unwrap())
}

fn check_exact_on(tb: &TestBatch, mut be: CpuBackend) -> Result<(), TestCaseError> {
    let isa = be.name();
    let h = tb.hidden;
    let per_slot = tb.run(&mut be, ComputeMode::Exact, OutputLayout::PerSlot);
    let combined = tb.run(&mut be, ComputeMode::Exact, OutputLayout::PreCombined);
    let rows = tb.out_rows();
    let mut want_slot = vec![0f32; per_slot.len()];
    let mut y = vec![0f32; h];
    for (gi, (e, toks, _)) in tb.groups.iter().enumerate() {
        for (i, &t) in toks.iter().enumerate() {
            reference::expert_ffn_exact(
                &tb.experts[*e],
                &tb.x[t as usize * h..(t as usize + 1) * h],
                &mut y,
            );
            let r = rows[gi][i] as usize;
            want_slot[r * h..(r + 1) * h].copy_from_slice(&y);
        }
    }
    for (i, (a, b)) in per_slot.iter().zip(&want_slot).enumerate() {
        prop_assert_eq!(
            a.to_bits(),
            b.to_bits(),
            "{:?} per-slot element {}: {} vs {}",
            isa,
            i,
            a,
            b
        );
    }
    // pre-combined: acc = 0; acc += w*y in output-row order
    let mut want = vec![0f32; tb.tokens * h];
    let mut slots: Vec<(u32, u32, usize, usize)> = Vec::new();
    for (gi, (_, toks, _)) in tb.groups.iter().enumerate() {
        for (i, &t) in toks.iter().enumerate() {
            slots.push((t, rows[gi][i], gi, i));
        }
    }
    slots.sort();
    for (t, r, gi, i) in slots {
        let w = tb.groups[gi].2[i];
        for k in 0..h {
            want[t as usize * h + k] += w * want_slot[r as usize * h + k];
        }
    }
    for (i, (a, b)) in combined.iter().zip(&want).enumerate() {
        prop_assert_eq!(a.to_bits(), b.to_bits(), "{:?} combined element {}", isa, i);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

    /// Scalar, AVX2 and AVX-512 VNNI backends, 1 and 2 threads, bit-identical to the reference:
    /// random shapes (K not a multiple of 256), an expert with zero tokens, mixed intermediate
    /// sizes (a shared expert is just a different F).
    #[test]
    fn backend_exact_matches_reference(
        spec in spec_strategy(),
        hb in 1usize..10,
        inters in prop::collection::vec(1usize..5, 2..5),
        tokens in 1usize..24,
        top_k in 1usize..3,
        seed in any::<u64>(),
    ) {
        let hidden = hb * 128;
        let inters: Vec<usize> = inters.iter().map(|&f| f * 32 * (spec.group_size as usize / 32).max(1)).collect();
        let tb = TestBatch::random(spec, hidden, &inters, tokens, top_k, seed);
        for isa in Isa::available() {
            for threads in [1, 2] {
                check_exact(&tb, isa, threads)?;
            }
        }
        check_exact_amx_emulated(&tb, 2)?;
    }
}

#[test]
fn backend_exact_large_batch() {
    // B from 1 to 300: a 300-token batch on few experts exercises token tiles and prefill.
    for tokens in [1usize, 17, 300] {
        let tb = TestBatch::random(
            QuantSpec::G32_BF16,
            96,
            &[64, 64, 96, 32],
            tokens,
            2,
            tokens as u64,
        );
        for isa in Isa::available() {
            check_exact(&tb, isa, 2).unwrap();
        }
        check_exact_amx_emulated(&tb, 2).unwrap();
    }
}

/// The production AMX choice is per matrix: a matrix of fewer columns than the threshold runs
/// on the VNNI path within the same batch (demo-small: W13 on AMX, W2 not). Both mixes, with
/// the threshold between hidden and intermediate size, are bit-identical to the reference,
/// through the tile emulator everywhere and on the instructions where this CPU has AMX.
#[test]
fn amx_on_one_stage_only_is_bit_identical() {
    // (hidden, intermediate): W13's columns are hidden, W2's the intermediate size.
    for (hidden, inter) in [(96usize, 64usize), (64, 96)] {
        let tb = TestBatch::random(
            QuantSpec::G32_BF16,
            hidden,
            &[inter, inter, inter],
            120,
            2,
            0xA3,
        );
        check_exact_on(
            &tb,
            CpuBackend::with_amx_emulated(2)
                .unwrap()
                .with_amx_min_cols(96),
        )
        .unwrap();
        if Isa::available().contains(&Isa::Amx) {
            check_exact_on(
                &tb,
                CpuBackend::with_isa(2, Isa::Amx)
                    .unwrap()
                    .with_amx_min_cols(96),
            )
            .unwrap();
            say(&format!(
                "ran: AMX on one stage (hidden {hidden}, inter {inter}) on the instructions"
            ));
        } else {
            say("skipped: AMX on one stage on the instructions (no AMX here); the emulator ran");
        }
    }
}

/// The worst element of `tb`'s accurate-mode output on `isa` (2 threads) against the f64
/// reference, as a fraction of each output row's RMS.
fn accurate_worst_error(tb: &TestBatch, isa: Isa) -> f64 {
    let mut be = CpuBackend::with_isa(2, isa).unwrap();
    let got = tb.run(&mut be, ComputeMode::Accurate, OutputLayout::PerSlot);
    let rows = tb.out_rows();
    let h = tb.hidden;
    let mut y = vec![0f64; h];
    let mut worst = 0f64;
    for (gi, (e, toks, _)) in tb.groups.iter().enumerate() {
        for (i, &t) in toks.iter().enumerate() {
            let x: Vec<f64> = tb.x[t as usize * h..(t as usize + 1) * h]
                .iter()
                .map(|&v| v as f64)
                .collect();
            reference::expert_ffn_f64(&tb.experts[*e], &x, &mut y);
            let rms = (y.iter().map(|v| v * v).sum::<f64>() / h as f64).sqrt();
            let r = rows[gi][i] as usize;
            for k in 0..h {
                worst = worst.max((got[r * h + k] as f64 - y[k]).abs() / rms);
            }
        }
    }
    worst
}

/// A batch of at least 2^16 input values (here 300 tokens of 256) quantizes its inputs on the
/// backend's threads, one token per work item: exact mode stays bit-identical to the reference
/// and accurate mode within its tolerance, on every ISA and with the AMX scheduling emulated.
#[test]
fn large_batches_quantize_their_inputs_on_every_thread() {
    let tb = TestBatch::random(QuantSpec::G32_BF16, 256, &[64, 96], 300, 2, 0x9A7);
    assert!(
        tb.hidden * 300 >= 1 << 16,
        "the pooled path needs 2^16 values"
    );
    for isa in Isa::available() {
        check_exact(&tb, isa, 2).unwrap();
        let worst = accurate_worst_error(&tb, isa);
        assert!(worst < 1e-4, "{isa:?} accurate: worst error {worst}");
    }
    check_exact_amx_emulated(&tb, 2).unwrap();
}

/// Decode batches where experts get one to a few tokens: the backend runs small groups as
/// interleaved streams (up to four experts per pass; on AVX2 groups of equal token count, one
/// to four, each tile unpacked once for a group's tokens; elsewhere one stream per token of
/// groups of one or two; split where the intermediate size changes, an empty group and groups
/// of more tokens among them), bit-identical to the reference for every format, ISA and
/// thread count.
#[test]
fn backend_exact_decode_streams() {
    let asym = QuantSpec {
        group_size: 64,
        scale_dtype: ScaleDtype::F16,
        zero_points: true,
    };
    for (i, spec) in [QuantSpec::G32_BF16, asym].into_iter().enumerate() {
        for tokens in [1usize, 2, 3, 5, 8] {
            // Nine experts, one of a different intermediate size in the middle.
            let inters = [128, 128, 128, 128, 128, 64, 128, 128, 128];
            let mut tb = TestBatch::random(spec, 320, &inters, tokens, 6, (10 * i + tokens) as u64);
            // A group without tokens among them (a caller may send one; it computes nothing).
            if let Some(e) = (0..inters.len()).find(|e| tb.groups.iter().all(|g| g.0 != *e)) {
                tb.groups
                    .insert(1.min(tb.groups.len()), (e, vec![], vec![]));
            }
            for isa in Isa::available() {
                for threads in [1, 2] {
                    check_exact(&tb, isa, threads).unwrap();
                }
            }
        }
    }
}

#[test]
fn backend_accurate_within_tolerance() {
    let asym = QuantSpec {
        group_size: 64,
        scale_dtype: ScaleDtype::F16,
        zero_points: true,
    };
    // Token counts that give every expert's tile 1 to 8 tokens (the kernels' per-count paths).
    let cases = Isa::available().into_iter().flat_map(|i| {
        [1usize, 2, 3, 5, 8, 9, 17]
            .into_iter()
            .flat_map(move |n| [(i, QuantSpec::G32_BF16, n), (i, asym, n)])
    });
    for (isa, spec, tokens) in cases {
        let tb = TestBatch::random(spec, 256, &[128, 64, 128], tokens, 2, 5 + tokens as u64);
        let worst = accurate_worst_error(&tb, isa);
        println!("{isa:?} {spec} {tokens} tokens: worst error {worst:.2e} of the output RMS");
        // Stated tolerance for accurate mode: worst element within 1e-4 of the output RMS.
        assert!(
            worst < 1e-4,
            "{isa:?} {spec} {tokens} tokens: accurate mode error {worst}"
        );
    }
}

#[test]
fn bad_batches_are_errors() {
    let tb = TestBatch::random(QuantSpec::G32_BF16, 64, &[32, 32], 3, 1, 9);
    let mut be = CpuBackend::new(1).unwrap();
    let _ = tb.run(&mut be, ComputeMode::Exact, OutputLayout::PerSlot);
    let x = vec![0f32; 64 * 3];
    let unknown = ExpertGroup {
        key: ExpertKey {
            layer: 3,
            expert: 99,
        },
        tokens: &[0],
        weights: &[1.0],
        out_rows: &[0],
    };
    let batch = GroupedBatch {
        mode: ComputeMode::Exact,
        hidden: 64,
        tokens: 3,
        input: Activations::F32(&x),
        groups: std::slice::from_ref(&unknown),
        layout: OutputLayout::PerSlot,
    };
    let mut out = vec![0f32; 64];
    let e = be.execute(&batch, &mut out).unwrap_err();
    assert!(e.to_string().contains("layer 3 expert 99"), "{e}");
    let bad_row = ExpertGroup {
        key: ExpertKey {
            layer: 3,
            expert: 0,
        },
        tokens: &[5],
        weights: &[1.0],
        out_rows: &[0],
    };
    let batch = GroupedBatch {
        groups: std::slice::from_ref(&bad_row),
        ..batch
    };
    let e = be.execute(&batch, &mut out).unwrap_err();
    assert!(e.to_string().contains("token row 5"), "{e}");
    let mut small = vec![0f32; 10];
    let ok_group = ExpertGroup {
        key: ExpertKey {
            layer: 3,
            expert: 0,
        },
        tokens: &[0],
        weights: &[1.0],
        out_rows: &[0],
    };
    let batch = GroupedBatch {
        groups: std::slice::from_ref(&ok_group),
        ..batch
    };
    assert!(be.execute(&batch, &mut small).is_err());
    assert!(be.execute(&batch, &mut out).is_ok());
}

#[test]
fn vector_swiglu_is_bit_identical_to_the_contract() {
    use expertmesh_quant::contract::swiglu_contract;
    let mut rng = SplitMix64::new(12);
    let specials = [
        0.0f32, -0.0, 1.0, -1.0, 87.0, -87.0, 88.5, -88.5, 1e-30, -1e-30, 1e30, -1e30, 3.4e38,
        -3.4e38, 0.5, 20.0,
    ];
    for round in 0..1000 {
        // 1 to 8 rows per call (a token tile), every row checked.
        let rows = 1 + round % 8;
        let mut g = vec![[0f32; 16]; rows];
        let mut u = vec![[0f32; 16]; rows];
        for (r, (gr, ur)) in g.iter_mut().zip(u.iter_mut()).enumerate() {
            for i in 0..16 {
                gr[i] = if round == 0 && r == 0 {
                    specials[i]
                } else {
                    (rng.normal() * [0.1, 3.0, 30.0, 200.0][(round + r) % 4]) as f32
                };
                ur[i] = (rng.normal() * 2.0) as f32;
            }
        }
        for isa in Isa::available() {
            let mut out = g.clone();
            kernels::swiglu_rows(isa, &mut out, &u);
            for r in 0..rows {
                for i in 0..16 {
                    let want = swiglu_contract(g[r][i], u[r][i]);
                    assert_eq!(
                        out[r][i].to_bits(),
                        want.to_bits(),
                        "{isa:?} row {r} of {rows}: g={} u={}: {} vs {}",
                        g[r][i],
                        u[r][i],
                        out[r][i],
                        want
                    );
                }
            }
        }
    }
}

/// The vectorized activation quantization (and its block sums) equals contract §1 bit for bit
/// on every ISA: random vectors at many magnitudes, exact half-way products (ties to even),
/// all-zero, below-minimum and exactly-minimum blocks, and blocks with NaN or an infinity
/// (which take the scalar code), in every window of 1 to 40 blocks, so each odd block sits
/// at every position of a sixteen-block chunk, alone and beside others.
#[test]
fn vector_quantization_is_bit_identical_to_the_contract() {
    let mut rng = SplitMix64::new(9);
    let mut x: Vec<f32> = Vec::new();
    for scale in [1e-30f32, 1e-8, 1.0, 3.5e3, 1e30] {
        x.extend(
            synth::normal_vec(&mut rng, 32 * 40, 1.0)
                .iter()
                .map(|v| v * scale),
        );
    }
    // The odd blocks, each followed by 17 ordinary ones, so windows meet each one alone in a
    // chunk of sixteen as well as together with others.
    let min = contract::MIN_BLOCK_AMAX;
    let odd_blocks: Vec<Vec<f32>> = vec![
        // 127 · k / 254 products land exactly on .5 for amax 127: ties to even.
        (0..32)
            .map(|k| if k == 0 { 127.0 } else { (k as f32) - 0.5 })
            .collect(),
        vec![0.0; 32],
        vec![f32::from_bits(0x0F00_0000); 32],
        (0..32)
            .map(|i| if i == 3 { f32::NAN } else { 1.0 })
            .collect(),
        (0..32)
            .map(|i| if i == 8 { f32::INFINITY } else { 1.0 })
            .collect(),
        (0..32)
            .map(|i| if i == 26 { f32::NEG_INFINITY } else { -1.0 })
            .collect(),
        // amax exactly the contract's minimum (quantized), and the float below it (not).
        (0..32)
            .map(|i| if i == 7 { -min } else { min / 3.0 })
            .collect(),
        (0..32)
            .map(|i| {
                if i == 9 {
                    f32::from_bits(min.to_bits() - 1)
                } else {
                    0.0
                }
            })
            .collect(),
    ];
    for block in odd_blocks {
        x.extend(block);
        x.extend(
            synth::normal_vec(&mut rng, 32 * 17, 1.0)
                .iter()
                .map(|v| v * 7.0),
        );
    }
    let blocks = x.len() / 32;
    // Every window of 1 to 40 blocks at every start: the vector paths take sixteen blocks
    // at a time, so each odd block is met at every position of a chunk and in short tails.
    for len in 1..=40usize.min(blocks) {
        for start in 0..=blocks - len {
            let xs = &x[start * 32..(start + len) * 32];
            let n = xs.len();
            let (mut q0, mut d0) = (vec![0i8; n], vec![0f32; len]);
            contract::quantize_activations(xs, &mut q0, &mut d0);
            let s0: Vec<i32> = q0
                .chunks(32)
                .map(|b| b.iter().map(|&v| i32::from(v)).sum())
                .collect();
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            for isa in Isa::available() {
                let (mut q, mut d) = (vec![1i8; n], vec![1f32; len]);
                kernels::quantize_activations(isa, xs, &mut q, &mut d);
                assert_eq!(q, q0, "{isa:?} codes, blocks {start}..+{len}");
                assert_eq!(
                    bits(&d),
                    bits(&d0),
                    "{isa:?} scales, blocks {start}..+{len}"
                );
                let (mut q, mut d, mut s) = (vec![1i8; n], vec![1f32; len], vec![7i32; len]);
                kernels::quantize_activations_sums(isa, xs, &mut q, &mut d, &mut s);
                assert_eq!(q, q0, "{isa:?} codes with sums, blocks {start}..+{len}");
                assert_eq!(
                    bits(&d),
                    bits(&d0),
                    "{isa:?} scales with sums, {start}..+{len}"
                );
                assert_eq!(s, s0, "{isa:?} block sums, blocks {start}..+{len}");
            }
        }
    }
}
