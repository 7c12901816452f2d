//! `expertmesh bench kernels`: expert FFN throughput of the CPU backend against the machine's
//! memory read bandwidth (decode) and int8 peak (prefill), measured in the same run.
//!
//! Why this exists: decode MoE is memory-bound, so the honest figure for a kernel is weight
//! bytes actually read per second over the bandwidth the machine can read at all. Batches route
//! B tokens top-k over the routed experts of one layer of a real model shape, so the number of
//! touched experts follows U(B) = E·(1 − (1 − k/E)^B). Weights rotate over a pool of experts
//! several times larger than the last-level cache, so every expert is read from DRAM.

use crate::bench_json::{BenchReport, BenchResult};
use expertmesh_hip_kernels::backend::{
    Activations, BatchLimits, ExpertBackend, ExpertGroup, ExpertKey, GroupedBatch, OutputLayout,
};
use expertmesh_hip_kernels::contract::ComputeMode;
use expertmesh_hip_kernels::cpu::{CpuBackend, membw};
use expertmesh_hip_kernels::synth::{self, SplitMix64};
use expertmesh_topology::model::ModelSpec;
use std::time::Instant;

/// Options of `bench kernels`.
#[derive(Debug, Clone)]
pub struct KernelBenchOptions {
    /// Backend threads.
    pub threads: usize,
    /// Seconds of measurement per case.
    pub seconds: f64,
    /// Model presets whose expert shapes are measured.
    pub models: Vec<ModelSpec>,
    /// Decode batch sizes (tokens per layer call).
    pub batches: Vec<usize>,
    /// Tokens per expert for the prefill case (0 to skip).
    pub prefill_tokens: usize,
    /// Minimum pool size in bytes (defaults to max(1 GiB, 8 × LLC)).
    pub pool_bytes: u64,
}

/// One expert's share of a routed batch: physical expert, tokens, weights, output rows.
type RoutedGroup = (u32, Vec<u32>, Vec<f32>, Vec<u32>);

/// One routed batch: per physical expert, its tokens and weights.
struct RoutedBatch {
    groups: Vec<RoutedGroup>,
    pairs: usize,
}

/// Route `tokens` tokens top-k uniformly at random over `experts` logical experts, mapping
/// logical expert `e` to physical `(e + offset) % pool`.
fn route_uniform(
    rng: &mut SplitMix64,
    tokens: usize,
    experts: usize,
    top_k: usize,
    offset: usize,
    pool: usize,
) -> RoutedBatch {
    let mut per: Vec<(Vec<u32>, Vec<f32>)> = vec![(Vec::new(), Vec::new()); experts];
    let mut chosen = Vec::with_capacity(top_k);
    for t in 0..tokens {
        chosen.clear();
        while chosen.len() < top_k.min(experts) {
            let e = rng.below(experts as u64) as usize;
            if !chosen.contains(&e) {
                chosen.push(e);
            }
        }
        for &e in &chosen {
            per[e].0.push(t as u32);
            per[e].1.push(1.0 / top_k as f32);
        }
    }
    let mut groups = Vec::new();
    let mut pairs = 0;
    for (e, (toks, ws)) in per.into_iter().enumerate() {
        if toks.is_empty() {
            continue;
        }
        let rows = (pairs as u32..(pairs + toks.len()) as u32).collect();
        pairs += toks.len();
        groups.push((((e + offset) % pool) as u32, toks, ws, rows));
    }
    RoutedBatch { groups, pairs }
}

fn run_batch(
    backend: &mut CpuBackend,
    hidden: usize,
    tokens: usize,
    x: &[f32],
    rb: &RoutedBatch,
    out: &mut Vec<f32>,
    mode: ComputeMode,
) -> anyhow::Result<()> {
    let groups: Vec<ExpertGroup> = rb
        .groups
        .iter()
        .map(|(p, t, w, r)| ExpertGroup {
            key: ExpertKey {
                layer: 0,
                expert: *p,
            },
            tokens: t,
            weights: w,
            out_rows: r,
        })
        .collect();
    let batch = GroupedBatch {
        mode,
        hidden,
        tokens,
        input: Activations::F32(&x[..tokens * hidden]),
        groups: &groups,
        layout: OutputLayout::PerSlot,
    };
    out.resize(batch.output_len(), 0.0);
    backend.execute(&batch, out)?;
    Ok(())
}

/// Run the kernel benchmark and return the report.
pub fn run(opts: &KernelBenchOptions) -> anyhow::Result<BenchReport> {
    let mut report = BenchReport::new();
    let llc = membw::last_level_cache_bytes();
    let pool_target = opts.pool_bytes.max(8 * llc).max(1 << 30);
    // Same-run limit: read bandwidth over a buffer 8x the LLC (at least 512 MiB).
    let probe_len = (8 * llc).max(512 << 20) as usize;
    let probe = vec![1u8; probe_len];
    let bw = membw::read_bandwidth(&probe, opts.threads, 5);
    drop(probe);
    let gbs = |b: f64| b / 1e9;
    println!(
        "memory read bandwidth ({} threads, {} MiB buffer): {:.2} GB/s; LLC {} MiB",
        opts.threads,
        probe_len >> 20,
        gbs(bw),
        llc >> 20
    );
    report
        .machine
        .extra
        .insert("read_bandwidth_gbs".into(), gbs(bw).into());
    report
        .machine
        .extra
        .insert("threads".into(), opts.threads.into());
    let mhz = report
        .machine
        .extra
        .get("cpu_mhz")
        .and_then(|v| v.as_f64())
        .unwrap_or(0.0);

    for spec in &opts.models {
        let (h, f) = (spec.hidden as usize, spec.moe_intermediate as usize);
        let (e, k) = (spec.routed_experts as usize, spec.top_k as usize);
        let expert_bytes = spec.expert_bytes();
        let pool = (pool_target.div_ceil(expert_bytes) as usize).max(2);
        print!(
            "{}: generating {pool} experts ({:.2} GB) ... ",
            spec.name,
            (pool as u64 * expert_bytes) as f64 / 1e9
        );
        let t0 = Instant::now();
        let experts = (0..pool)
            .map(|i| {
                synth::synthetic_expert(spec.quant, h, f, 7, 0, i as u32).map(|w| {
                    (
                        ExpertKey {
                            layer: 0,
                            expert: i as u32,
                        },
                        w,
                    )
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let max_b = opts
            .batches
            .iter()
            .copied()
            .max()
            .unwrap_or(1)
            .max(opts.prefill_tokens);
        let mut backend = CpuBackend::new(opts.threads)?;
        backend.load(
            experts,
            BatchLimits {
                max_tokens: max_b,
                max_pairs: max_b * k.max(1),
            },
        )?;
        println!(
            "{:.1} s, backend {}",
            t0.elapsed().as_secs_f64(),
            backend.name()
        );
        let mut rng = SplitMix64::new(99);
        let x = synth::normal_vec(&mut rng, max_b * h, 1.0);
        let mut out = Vec::new();
        for &b in &opts.batches {
            let mut offset = 0usize;
            // warm-up (first touch of the output buffer, thread start)
            let rb = route_uniform(&mut rng, b, e, k, offset, pool);
            run_batch(&mut backend, h, b, &x, &rb, &mut out, ComputeMode::Exact)?;
            let (mut bytes, mut secs, mut calls, mut touched) = (0u64, 0f64, 0u64, 0usize);
            while secs < opts.seconds || calls < 3 {
                offset += e + 1;
                let rb = route_uniform(&mut rng, b, e, k, offset, pool);
                let t = Instant::now();
                run_batch(&mut backend, h, b, &x, &rb, &mut out, ComputeMode::Exact)?;
                secs += t.elapsed().as_secs_f64();
                bytes += rb.groups.len() as u64 * expert_bytes;
                touched += rb.groups.len();
                calls += 1;
            }
            let achieved = bytes as f64 / secs;
            let avg_touched = touched as f64 / calls as f64;
            let ops = 2.0 * (b * k) as f64 * spec.expert_params() as f64 * calls as f64 / secs;
            report.results.push(
                BenchResult::new(
                    format!("decode-exact {} H{h} F{f}", spec.name),
                    b as u64,
                    gbs(achieved),
                    gbs(bw),
                    "GB/s",
                )
                .with("experts_touched", avg_touched)
                .with("tokens_per_expert", (b * k) as f64 / avg_touched)
                .with("latency_us", secs / calls as f64 * 1e6)
                .with("int8_tops", ops / 1e12)
                .with("mode", "exact"),
            );
            println!(
                "  B={b:>4}: {:>7.2} GB/s of weights ({:.3} of read bandwidth), {:>6.1} experts, {:>9.1} us/call",
                gbs(achieved),
                achieved / bw,
                avg_touched,
                secs / calls as f64 * 1e6
            );
        }
        // Accurate mode at batch 1, for reference.
        {
            let mut offset = 0;
            let (mut bytes, mut secs, mut calls) = (0u64, 0f64, 0u64);
            while secs < opts.seconds.min(1.0) || calls < 3 {
                offset += k;
                let rb = route_uniform(&mut rng, 1, e, k, offset, pool);
                let t = Instant::now();
                run_batch(&mut backend, h, 1, &x, &rb, &mut out, ComputeMode::Accurate)?;
                secs += t.elapsed().as_secs_f64();
                bytes += rb.groups.len() as u64 * expert_bytes;
                calls += 1;
            }
            let achieved = bytes as f64 / secs;
            report.results.push(
                BenchResult::new(
                    format!("decode-accurate {} H{h} F{f}", spec.name),
                    1,
                    gbs(achieved),
                    gbs(bw),
                    "GB/s",
                )
                .with("mode", "accurate"),
            );
            println!(
                "  B=   1 accurate: {:>7.2} GB/s ({:.3})",
                gbs(achieved),
                achieved / bw
            );
        }
        // Prefill: many tokens on one expert at a time (compute-bound).
        if opts.prefill_tokens > 0 && mhz > 0.0 {
            let tpe = opts.prefill_tokens;
            let peak = opts.threads as f64 * mhz * 1e6 * 2.0 * 64.0;
            let (mut secs, mut calls, mut idx) = (0f64, 0u64, 0usize);
            while secs < opts.seconds || calls < 2 {
                let toks: Vec<u32> = (0..tpe as u32).collect();
                let rb = RoutedBatch {
                    groups: vec![((idx % pool) as u32, toks.clone(), vec![1.0; tpe], toks)],
                    pairs: tpe,
                };
                idx += 1;
                let t = Instant::now();
                run_batch(&mut backend, h, tpe, &x, &rb, &mut out, ComputeMode::Exact)?;
                secs += t.elapsed().as_secs_f64();
                calls += 1;
                let _ = rb.pairs;
            }
            let ops = 2.0 * tpe as f64 * spec.expert_params() as f64 * calls as f64 / secs;
            report.results.push(
                BenchResult::new(format!("prefill-exact {} H{h} F{f}", spec.name), tpe as u64, ops / 1e12, peak / 1e12, "TOPS")
                    .with("peak_basis", format!("{} threads x {mhz:.0} MHz x 128 int8 ops/cycle (one 512-bit vpdpbusd per cycle)", opts.threads))
                    .with("mode", "exact"),
            );
            println!(
                "  prefill {tpe} tokens/expert: {:.3} int8 TOPS ({:.3} of VNNI peak)",
                ops / 1e12,
                ops / peak
            );
        }
    }
    Ok(report)
}
