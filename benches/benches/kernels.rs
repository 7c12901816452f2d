//! Criterion micro-benchmarks of the CPU expert kernels.
//!
//! `row_block/*`: one 16-row block of a Kimi-sized matrix (K = 7168) with its weights resident
//! in cache, for 1, 4 and 8 tokens: the compute-bound speed of each ISA path. `streams/*`: the
//! decode streams kernel over four Qwen3-sized (K = 2048) matrices resident in L2, each with
//! 1 to 4 tokens, against the same tokens as one stream each (how a two-token expert ran before
//! the kernel took several tokens per stream). `expert/*`: a
//! whole Kimi-sized expert FFN through the backend (weights from DRAM after the first pass,
//! since one expert is 24.8 MB). Throughput is reported in weight bytes per second; compare
//! with `expertmesh bench kernels`, which also measures the machine's read bandwidth.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use expertmesh_backend::{
    Activations, BatchLimits, ExpertBackend, ExpertGroup, ExpertKey, GroupedBatch, OutputLayout,
};
use expertmesh_cpu_backend::CpuBackend;
use expertmesh_cpu_backend::kernels::{self, Isa, RowBlockJob, TokenQ8};
use expertmesh_cpu_backend::layout::R16Matrix;
use expertmesh_quant::contract::ComputeMode;
use expertmesh_quant::format::QuantSpec;
use expertmesh_quant::reference::QuantizedVec;
use expertmesh_quant::synth::{self, SplitMix64};
use std::hint::black_box;

/// `n` random tokens of `k` values quantized as the kernels take them, and their block sums.
fn quantized_tokens(
    rng: &mut SplitMix64,
    n: usize,
    k: usize,
) -> (Vec<QuantizedVec>, Vec<Vec<i32>>) {
    let acts: Vec<QuantizedVec> = (0..n)
        .map(|_| QuantizedVec::new(&synth::normal_vec(rng, k, 1.0)))
        .collect();
    let sums = acts
        .iter()
        .map(|a| {
            let mut s = vec![0; k / 32];
            kernels::block_sums(&a.q, &mut s);
            s
        })
        .collect();
    (acts, sums)
}

fn row_block(c: &mut Criterion) {
    let k = 7168;
    let mut rng = SplitMix64::new(1);
    let m = synth::random_packed("bench", QuantSpec::G32_BF16, 64, k, &mut rng).unwrap();
    let r16 = R16Matrix::from_canonical(&m);
    let (acts, sums) = quantized_tokens(&mut rng, 8, k);
    let toks: Vec<TokenQ8> = acts
        .iter()
        .zip(&sums)
        .map(|(a, s)| TokenQ8 {
            q: &a.q,
            d: &a.d,
            qsum: s,
        })
        .collect();
    let mut g = c.benchmark_group("row_block");
    // four row blocks per iteration
    g.throughput(Throughput::Bytes(
        (4 * (16 * k / 2 + 16 * (k / 32) * 2)) as u64,
    ));
    for isa in Isa::available() {
        for n in [1usize, 4, 8] {
            g.bench_function(format!("{}/exact/{n}tok", isa.name()), |b| {
                let mut out = [[0f32; 16]; 8];
                b.iter(|| {
                    for rb in 0..4 {
                        kernels::rowblock_exact(isa, &r16, rb, black_box(&toks[..n]), &mut out);
                    }
                    black_box(&out);
                })
            });
        }
        let xs: Vec<Vec<f32>> = (0..8)
            .map(|_| synth::normal_vec(&mut rng, k, 1.0))
            .collect();
        let xr: Vec<&[f32]> = xs.iter().map(|v| v.as_slice()).collect();
        g.bench_function(format!("{}/accurate/1tok", isa.name()), |b| {
            let mut out = [[0f32; 16]; 8];
            b.iter(|| {
                for rb in 0..4 {
                    kernels::rowblock_accurate(isa, &r16, rb, black_box(&xr[..1]), &mut out);
                }
                black_box(&out);
            })
        });
    }
    g.finish();
}

fn streams(c: &mut Criterion) {
    let (k, rows, experts) = (2048, 256, kernels::MAX_STREAMS);
    let mut rng = SplitMix64::new(2);
    let ms: Vec<R16Matrix> = (0..experts)
        .map(|_| {
            let m = synth::random_packed("bench", QuantSpec::G32_BF16, rows, k, &mut rng);
            R16Matrix::from_canonical(&m.unwrap())
        })
        .collect();
    let n = experts * kernels::MAX_STREAM_TOKENS;
    let (acts, sums) = quantized_tokens(&mut rng, n, k);
    let tok = |i: usize| TokenQ8 {
        q: &acts[i].q,
        d: &acts[i].d,
        qsum: &sums[i],
    };
    let mut g = c.benchmark_group("streams");
    // every row block of the four matrices per iteration (1 MiB of weights, in L2)
    g.throughput(Throughput::Bytes(
        (experts * (rows * k / 2 + rows * (k / 32) * 2)) as u64,
    ));
    /// Every row block of the matrices, `T` tokens per job (matrix `j` gets tokens `jT..jT+T`).
    fn shared<'a, const T: usize>(
        isa: Isa,
        ms: &'a [R16Matrix],
        tok: impl Fn(usize) -> TokenQ8<'a>,
        out: &mut [[f32; 16]],
    ) {
        let mut jobs: Vec<RowBlockJob<'a, T>> = (0..ms.len())
            .map(|j| RowBlockJob {
                m: &ms[j],
                rb: 0,
                toks: std::array::from_fn(|t| tok(j * T + t)),
            })
            .collect();
        for rb in 0..ms[0].row_blocks() {
            jobs.iter_mut().for_each(|j| j.rb = rb);
            kernels::rowblocks_exact(isa, black_box(&jobs), out);
        }
    }
    for isa in Isa::available() {
        let mut out = [[0f32; 16]; 16];
        for t in 1..=kernels::MAX_STREAM_TOKENS {
            g.bench_function(format!("{}/{t}tok/shared", isa.name()), |b| {
                b.iter(|| match t {
                    1 => shared::<1>(isa, &ms, tok, &mut out),
                    2 => shared::<2>(isa, &ms, tok, &mut out),
                    3 => shared::<3>(isa, &ms, tok, &mut out),
                    _ => shared::<4>(isa, &ms, tok, &mut out),
                })
            });
            if t > 1 {
                g.bench_function(format!("{}/{t}tok/stream-per-token", isa.name()), |b| {
                    let mut jobs: Vec<RowBlockJob<'_, 1>> = (0..experts * t)
                        .map(|s| RowBlockJob {
                            m: &ms[s / t],
                            rb: 0,
                            toks: [tok(s)],
                        })
                        .collect();
                    b.iter(|| {
                        for rb in 0..rows / 16 {
                            jobs.iter_mut().for_each(|j| j.rb = rb);
                            kernels::rowblocks_exact(isa, black_box(&jobs), &mut out);
                        }
                    })
                });
            }
        }
    }
    g.finish();
}

fn expert(c: &mut Criterion) {
    let (h, f) = (7168, 2048);
    let w = synth::synthetic_expert(QuantSpec::G32_BF16, h, f, 3, 0, 0).unwrap();
    let bytes = w.bytes() as u64;
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let mut be = CpuBackend::new(threads).unwrap();
    let key = ExpertKey {
        layer: 0,
        expert: 0,
    };
    be.load(
        vec![(key, w)],
        BatchLimits {
            max_tokens: 8,
            max_pairs: 8,
        },
    )
    .unwrap();
    let mut rng = SplitMix64::new(2);
    let x = synth::normal_vec(&mut rng, 8 * h, 1.0);
    let mut g = c.benchmark_group("expert");
    g.throughput(Throughput::Bytes(bytes));
    g.sample_size(20);
    for n in [1usize, 8] {
        let toks: Vec<u32> = (0..n as u32).collect();
        let weights = vec![1.0f32; n];
        g.bench_function(format!("kimi/exact/{n}tok/{threads}threads"), |b| {
            let mut out = vec![0f32; n * h];
            b.iter(|| {
                let groups = [ExpertGroup {
                    key,
                    tokens: &toks,
                    weights: &weights,
                    out_rows: &toks,
                }];
                let batch = GroupedBatch {
                    mode: ComputeMode::Exact,
                    hidden: h,
                    tokens: n,
                    input: Activations::F32(&x[..n * h]),
                    groups: &groups,
                    layout: OutputLayout::PerSlot,
                };
                be.execute(&batch, &mut out).unwrap();
                black_box(&out);
            })
        });
    }
    g.finish();
}

/// One small expert per call (Qwen3-30B-A3B: H 2048, F 768, 2.4 MB), each call another of 64
/// (150 MB: read from memory, not cache): the call is short enough that dispatching its steps
/// to the pool's threads shows.
fn small_expert_per_call(c: &mut Criterion) {
    let (h, f, pool) = (2048, 768, 64u32);
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let experts: Vec<_> = (0..pool)
        .map(|e| {
            let w = synth::synthetic_expert(QuantSpec::G32_BF16, h, f, 5, 0, e).unwrap();
            (
                ExpertKey {
                    layer: 0,
                    expert: e,
                },
                w,
            )
        })
        .collect();
    let bytes = experts[0].1.bytes() as u64;
    let mut be = CpuBackend::new(threads).unwrap();
    be.load(
        experts,
        BatchLimits {
            max_tokens: 1,
            max_pairs: 1,
        },
    )
    .unwrap();
    let x = synth::normal_vec(&mut SplitMix64::new(4), h, 1.0);
    let mut g = c.benchmark_group("expert");
    g.throughput(Throughput::Bytes(bytes));
    g.sample_size(30);
    g.bench_function(format!("qwen3/exact/1tok/1expert/{threads}threads"), |b| {
        let mut out = vec![0f32; h];
        let mut next = 0u32;
        b.iter(|| {
            next = (next + 1) % pool;
            let groups = [ExpertGroup {
                key: ExpertKey {
                    layer: 0,
                    expert: next,
                },
                tokens: &[0],
                weights: &[1.0],
                out_rows: &[0],
            }];
            let batch = GroupedBatch {
                mode: ComputeMode::Exact,
                hidden: h,
                tokens: 1,
                input: Activations::F32(&x),
                groups: &groups,
                layout: OutputLayout::PerSlot,
            };
            be.execute(&batch, &mut out).unwrap();
            black_box(&out);
        })
    });
    g.finish();
}

criterion_group!(benches, row_block, streams, expert, small_expert_per_call);
criterion_main!(benches);
