//! `expertmesh bench kernels`: expert FFN throughput of the CPU backend against the machine's
//! memory read bandwidth (decode) and int8 peak (prefill), measured in the same run.
//!
//! Why this exists: decode MoE is memory-bound, so the honest figure for a kernel is weight
//! bytes actually read per second over the bandwidth the machine can read at all. Batches route
//! B tokens top-k over the routed experts of one layer of a real model shape, so the number of
//! touched experts follows U(B) = E·(1 − (1 − k/E)^B). Weights rotate over a pool of experts
//! several times larger than the last-level cache, so every expert is read from DRAM.
//!
//! The run's length scales with `--seconds`: at 1 s and above the pool is max(1 GiB, 8 × LLC)
//! and the bandwidth probe reads max(512 MiB, 8 × LLC) 7 times per model; below 1 s the pool
//! and probe shrink in proportion (never below 2 × and 4 × the LLC) with 3 probe passes and 3
//! calls per case at least (prefill 1), and batches whose one call would take over
//! max(1 s, 5 × `--seconds`) are skipped, which the output states and `machine.settings` and
//! `machine.skipped_cases` record. The JSON's
//! `machine.device_kind` is `"cpu"`: `plan --calibrate` applies these figures to CPU devices
//! only.

use crate::bench_json::{BenchReport, BenchResult};
use expertmesh_backend::{
    Activations, BatchLimits, ExpertBackend, ExpertKey, GroupedBatch, Grouping, OutputLayout,
};
use expertmesh_cpu_backend::{CpuBackend, membw};
use expertmesh_quant::contract::ComputeMode;
use expertmesh_quant::synth::{self, SplitMix64};
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
    /// Minimum pool size in bytes (defaults to max(1 GiB, 8 × LLC), scaled down below 1 s).
    pub pool_bytes: u64,
}

/// How much work a run does beyond its measurement time, scaled to `--seconds`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Effort {
    /// Weight pool per model, bytes.
    pub pool_bytes: u64,
    /// The pool a run of 1 s or more uses.
    pub full_pool_bytes: u64,
    /// Bandwidth probe buffer, bytes.
    pub probe_bytes: u64,
    /// The probe buffer of a run of 1 s or more.
    pub full_probe_bytes: u64,
    /// Probe passes per model.
    pub probe_passes: usize,
    /// Calls per decode case at least (prefill: two fewer, at least 2; 1 in a short run).
    pub min_calls: u64,
    /// Whether `seconds` < 1 shrank the run.
    pub short: bool,
    /// A short run skips a batch whose one call would take longer than this, seconds.
    pub call_budget_s: f64,
}

/// Probe passes and calls per case of a full run.
const FULL_PASSES: usize = 7;
const FULL_MIN_CALLS: u64 = 5;

impl Effort {
    /// The effort for `opts` on a machine whose last-level cache holds `llc` bytes.
    pub fn new(opts: &KernelBenchOptions, llc: u64) -> Effort {
        let full_pool_bytes = (8 * llc).max(1 << 30);
        let full_probe_bytes = (8 * llc).max(512 << 20);
        let scale = opts.seconds.clamp(0.0, 1.0);
        let short = scale < 1.0;
        let scaled = |full: u64, floor: u64| ((full as f64 * scale) as u64).clamp(floor, full);
        Effort {
            pool_bytes: scaled(full_pool_bytes, (2 * llc).max(64 << 20)).max(opts.pool_bytes),
            full_pool_bytes,
            probe_bytes: scaled(full_probe_bytes, (4 * llc).max(64 << 20)),
            full_probe_bytes,
            probe_passes: if short { 3 } else { FULL_PASSES },
            min_calls: if short { 3 } else { FULL_MIN_CALLS },
            short,
            call_budget_s: (5.0 * opts.seconds).max(1.0),
        }
    }

    /// In a short run, the estimated seconds of one call of batch `b` when over the budget,
    /// from the last batch measured (`(batch, seconds per call)`; time grows at most linearly
    /// with the batch).
    fn too_long(&self, last: Option<(usize, f64)>, b: usize) -> Option<f64> {
        let (b0, t0) = last.filter(|_| self.short)?;
        let est = t0 * b as f64 / b0.max(1) as f64;
        (est > self.call_budget_s).then_some(est)
    }

    /// What the run does, for `machine.settings` in the JSON.
    fn settings(&self, opts: &KernelBenchOptions) -> serde_json::Value {
        serde_json::json!({
            "seconds": opts.seconds,
            "threads": opts.threads,
            "models": opts.models.iter().map(|m| m.name.clone()).collect::<Vec<_>>(),
            "batches": opts.batches,
            "prefill_tokens": opts.prefill_tokens,
            "pool_bytes": self.pool_bytes,
            "full_pool_bytes": self.full_pool_bytes,
            "probe_bytes": self.probe_bytes,
            "full_probe_bytes": self.full_probe_bytes,
            "probe_passes": self.probe_passes,
            "min_calls_per_case": self.min_calls,
            "short_run": self.short,
            "call_budget_s": self.call_budget_s,
        })
    }

    /// The line a short run prints about what it shrank.
    fn short_run_line(&self, seconds: f64) -> Option<String> {
        let mib = |b: u64| b >> 20;
        self.short.then(|| {
            format!(
                "short run (--seconds {seconds} < 1): weight pool {} MiB instead of {}, bandwidth probe {} MiB x {} passes instead of {} MiB x {FULL_PASSES}, at least {} calls per case instead of {FULL_MIN_CALLS} (prefill: 1), batches whose one call would exceed {:.1} s skipped; figures are noisier than a full run's",
                mib(self.pool_bytes),
                mib(self.full_pool_bytes),
                mib(self.probe_bytes),
                self.probe_passes,
                mib(self.full_probe_bytes),
                self.min_calls,
                self.call_budget_s
            )
        })
    }
}

/// One expert's share of a routed batch: physical expert, tokens, weights, output rows.
/// One routed batch: its (token, logical expert) pairs, grouped by logical expert when run;
/// logical expert `e` runs on physical expert `(e + offset) % pool`.
struct RoutedBatch {
    grouping: Grouping,
    offset: usize,
    pool: usize,
    /// Distinct experts touched.
    touched: usize,
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
    let k = top_k.min(experts);
    let mut grouping = Grouping::with_capacity(tokens * k);
    let mut touched = vec![false; experts];
    let mut chosen = Vec::with_capacity(k);
    for t in 0..tokens {
        chosen.clear();
        while chosen.len() < k {
            let e = rng.below(experts as u64) as usize;
            if !chosen.contains(&e) {
                chosen.push(e);
            }
        }
        for &e in &chosen {
            touched[e] = true;
            let row = grouping.len() as u32;
            grouping.push(e as u32, t as u32, 1.0 / top_k as f32, row);
        }
    }
    let pairs = grouping.len();
    RoutedBatch {
        grouping,
        offset,
        pool,
        touched: touched.iter().filter(|&&x| x).count(),
        pairs,
    }
}

/// Run one routed batch (per-slot output) on the backend.
fn run_batch(
    backend: &mut CpuBackend,
    hidden: usize,
    tokens: usize,
    x: &[f32],
    rb: &mut RoutedBatch,
    out: &mut Vec<f32>,
    mode: ComputeMode,
) -> anyhow::Result<()> {
    out.resize(rb.pairs * hidden, 0.0);
    let (offset, pool) = (rb.offset, rb.pool);
    let physical = |e: u32| ((e as usize + offset) % pool) as u32;
    rb.grouping.with_groups_keyed(0, physical, |groups| {
        let batch = GroupedBatch {
            mode,
            hidden,
            tokens,
            input: Activations::F32(&x[..tokens * hidden]),
            groups,
            layout: OutputLayout::PerSlot,
        };
        backend.execute(&batch, out)
    })?;
    Ok(())
}

/// Per-call samples of one case: bytes read (or ops) per second for every call.
#[derive(Default)]
struct Samples {
    rates: Vec<f64>,
    secs: f64,
    calls: u64,
    touched: usize,
}

impl Samples {
    fn add(&mut self, amount: f64, secs: f64, touched: usize) {
        self.rates.push(amount / secs);
        self.secs += secs;
        self.calls += 1;
        self.touched += touched;
    }
    fn median(&self) -> f64 {
        membw::median(&self.rates)
    }
    fn best(&self) -> f64 {
        self.rates.iter().copied().fold(0.0, f64::max)
    }
}

/// Same-run bandwidth samples, re-probed before every model so a noisy neighbour affects the
/// limit and the kernel alike.
struct Bandwidth {
    probe: Vec<u8>,
    threads: usize,
    passes: usize,
    samples: Vec<f64>,
}

impl Bandwidth {
    fn probe(&mut self) {
        let s = membw::read_bandwidth_samples(&self.probe, self.threads, self.passes);
        self.samples.extend(s);
    }
    fn median(&self) -> f64 {
        membw::median(&self.samples)
    }
    fn best(&self) -> f64 {
        self.samples.iter().copied().fold(0.0, f64::max)
    }
}

/// Run the kernel benchmark and return the report. Figures are medians over calls (achieved)
/// and over probe passes (limit); the best of each is reported alongside.
pub fn run(opts: &KernelBenchOptions) -> anyhow::Result<BenchReport> {
    let mut report = BenchReport::new();
    let effort = Effort::new(opts, membw::last_level_cache_bytes());
    if let Some(line) = effort.short_run_line(opts.seconds) {
        println!("{line}");
    }
    // Same-run limit: read bandwidth over a buffer 8x the LLC (at least 512 MiB; less in a
    // short run).
    let probe_len = effort.probe_bytes as usize;
    let mut bw = Bandwidth {
        probe: vec![1u8; probe_len],
        threads: opts.threads,
        passes: effort.probe_passes,
        samples: Vec::new(),
    };
    let extra = &mut report.machine.extra;
    extra.insert("device_kind".into(), "cpu".into());
    extra.insert("settings".into(), effort.settings(opts));
    extra.insert("threads".into(), opts.threads.into());
    report
        .machine
        .extra
        .insert("bandwidth_probe_bytes".into(), probe_len.into());
    let mhz = report
        .machine
        .extra
        .get("cpu_mhz")
        .and_then(|v| v.as_f64())
        .unwrap_or(0.0);
    let mut pending: Vec<(BenchResult, f64)> = Vec::new(); // (result with achieved set, best)

    let mut skipped = Vec::new();
    for spec in &opts.models {
        let mut m = ModelBench::load(opts, spec, &effort)?;
        report
            .machine
            .extra
            .insert("backend".into(), m.backend.name().into());
        bw.probe();
        println!(
            "  memory read bandwidth ({} threads, {} MiB): median {:.2} GB/s, best {:.2} GB/s so far",
            opts.threads,
            probe_len >> 20,
            gbs(bw.median()),
            gbs(bw.best())
        );
        m.decode(&mut pending, &mut skipped)?;
        m.accurate(&mut pending)?;
        if opts.prefill_tokens > 0 && mhz > 0.0 {
            report.results.push(m.prefill(mhz)?);
        }
    }
    add_memory_bound(&mut report, &bw, pending);
    report
        .machine
        .extra
        .insert("skipped_cases".into(), skipped.into());
    report
        .results
        .sort_by(|a, b| a.name.cmp(&b.name).then(a.batch.cmp(&b.batch)));
    Ok(report)
}

/// Bytes per second in GB/s.
fn gbs(b: f64) -> f64 {
    b / 1e9
}

/// Final step: the memory-bound results against the run's bandwidth (medians, and bests
/// alongside), first in the report.
fn add_memory_bound(report: &mut BenchReport, bw: &Bandwidth, pending: Vec<(BenchResult, f64)>) {
    let (limit, limit_best) = (gbs(bw.median()), gbs(bw.best()));
    report
        .machine
        .extra
        .insert("read_bandwidth_gbs_median".into(), limit.into());
    report
        .machine
        .extra
        .insert("read_bandwidth_gbs_best".into(), limit_best.into());
    for (mut r, best) in pending {
        r.limit = limit;
        r.ratio = if limit > 0.0 { r.achieved / limit } else { 0.0 };
        r = r
            .with("best", best)
            .with("limit_best", limit_best)
            .with(
                "ratio_best",
                if limit_best > 0.0 {
                    best / limit_best
                } else {
                    0.0
                },
            )
            .with(
                "limit_kind",
                "memory read bandwidth, same run, same threads",
            );
        report.results.insert(0, r);
    }
}

/// One model's cases: its expert pool loaded into a backend, and the shared input and RNG.
struct ModelBench<'a> {
    opts: &'a KernelBenchOptions,
    spec: &'a ModelSpec,
    effort: Effort,
    backend: CpuBackend,
    /// Hidden size, intermediate size, routed experts, top-k.
    h: usize,
    f: usize,
    e: usize,
    k: usize,
    expert_bytes: u64,
    /// Experts in the pool.
    pool: usize,
    rng: SplitMix64,
    x: Vec<f32>,
    out: Vec<f32>,
}

impl<'a> ModelBench<'a> {
    /// Setup step: generate a pool of experts larger than the cache and load it.
    fn load(
        opts: &'a KernelBenchOptions,
        spec: &'a ModelSpec,
        effort: &Effort,
    ) -> anyhow::Result<Self> {
        let pool_target = effort.pool_bytes;
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
        Ok(Self {
            opts,
            spec,
            effort: *effort,
            backend,
            h,
            f,
            e,
            k,
            expert_bytes,
            pool,
            rng,
            x,
            out: Vec::new(),
        })
    }

    /// Time calls of `b` uniformly routed tokens in `mode` until `secs` seconds and the
    /// effort's minimum calls,
    /// the experts rotating by `stride` per call (amount: weight bytes read).
    fn sample_routed(
        &mut self,
        b: usize,
        mode: ComputeMode,
        stride: usize,
        secs: f64,
    ) -> anyhow::Result<Samples> {
        let mut offset = 0usize;
        let mut s = Samples::default();
        while s.secs < secs || s.calls < self.effort.min_calls {
            offset += stride;
            let mut rb = route_uniform(&mut self.rng, b, self.e, self.k, offset, self.pool);
            let t = Instant::now();
            run_batch(
                &mut self.backend,
                self.h,
                b,
                &self.x,
                &mut rb,
                &mut self.out,
                mode,
            )?;
            s.add(
                (rb.touched as u64 * self.expert_bytes) as f64,
                t.elapsed().as_secs_f64(),
                rb.touched,
            );
        }
        Ok(s)
    }

    /// Decode step: exact mode at every batch size (memory-bound; limits set later).
    /// A short run skips batches whose one call would take far longer than `--seconds`
    /// (estimated from the last batch measured) and warms up only before its first batch.
    fn decode(
        &mut self,
        pending: &mut Vec<(BenchResult, f64)>,
        skipped: &mut Vec<serde_json::Value>,
    ) -> anyhow::Result<()> {
        let (spec, h, f, e, k) = (self.spec, self.h, self.f, self.e, self.k);
        let mut last: Option<(usize, f64)> = None;
        for &b in &self.opts.batches {
            if let Some(est) = self.effort.too_long(last, b) {
                println!(
                    "  B={b:>4}: skipped in this short run (one call ~ {est:.1} s > {:.1} s); use --seconds 1 or more to measure it",
                    self.effort.call_budget_s
                );
                skipped.push(serde_json::json!({
                    "model": spec.name, "batch": b, "estimated_call_s": est,
                }));
                continue;
            }
            if !self.effort.short || last.is_none() {
                // warm-up (first touch of the output buffer, thread start)
                let mut rb = route_uniform(&mut self.rng, b, e, k, 0, self.pool);
                run_batch(
                    &mut self.backend,
                    h,
                    b,
                    &self.x,
                    &mut rb,
                    &mut self.out,
                    ComputeMode::Exact,
                )?;
            }
            let s = self.sample_routed(b, ComputeMode::Exact, e + 1, self.opts.seconds)?;
            last = Some((b, s.secs / s.calls as f64));
            let avg_touched = s.touched as f64 / s.calls as f64;
            let ops = 2.0 * (b * k) as f64 * spec.expert_params() as f64 * s.calls as f64 / s.secs;
            pending.push((
                BenchResult::new(
                    format!("decode-exact {} H{h} F{f}", spec.name),
                    b as u64,
                    gbs(s.median()),
                    0.0,
                    "GB/s",
                )
                .with("experts_touched", avg_touched)
                .with("tokens_per_expert", (b * k) as f64 / avg_touched)
                .with("latency_us", s.secs / s.calls as f64 * 1e6)
                .with("int8_tops", ops / 1e12)
                .with("calls", s.calls)
                .with("mode", "exact"),
                gbs(s.best()),
            ));
            println!(
                "  B={b:>4}: {:>7.2} GB/s of weights (median call; best {:.2}), {:>6.1} experts, {:>9.1} us/call",
                gbs(s.median()),
                gbs(s.best()),
                avg_touched,
                s.secs / s.calls as f64 * 1e6
            );
        }
        Ok(())
    }

    /// Accurate step: accurate mode at batch 1, for reference.
    fn accurate(&mut self, pending: &mut Vec<(BenchResult, f64)>) -> anyhow::Result<()> {
        let secs = self.opts.seconds.min(1.0);
        let s = self.sample_routed(1, ComputeMode::Accurate, self.k, secs)?;
        pending.push((
            BenchResult::new(
                format!("decode-accurate {} H{} F{}", self.spec.name, self.h, self.f),
                1,
                gbs(s.median()),
                0.0,
                "GB/s",
            )
            .with("mode", "accurate"),
            gbs(s.best()),
        ));
        println!(
            "  B=   1 accurate: {:>7.2} GB/s (median call; best {:.2})",
            gbs(s.median()),
            gbs(s.best())
        );
        Ok(())
    }

    /// Prefill step: many tokens on one expert at a time (compute-bound), against the VNNI
    /// peak at `mhz`.
    fn prefill(&mut self, mhz: f64) -> anyhow::Result<BenchResult> {
        let (opts, spec, h, f) = (self.opts, self.spec, self.h, self.f);
        let tpe = opts.prefill_tokens;
        let peak = opts.threads as f64 * mhz * 1e6 * 2.0 * 64.0;
        let mut s = Samples::default();
        let mut idx = 0usize;
        while s.secs < opts.seconds
            || s.calls < (self.effort.min_calls - 2).max(if self.effort.short { 1 } else { 2 })
        {
            let mut grouping = Grouping::with_capacity(tpe);
            for t in 0..tpe as u32 {
                grouping.push(0, t, 1.0, t);
            }
            let mut rb = RoutedBatch {
                grouping,
                offset: idx % self.pool,
                pool: self.pool,
                touched: 1,
                pairs: tpe,
            };
            idx += 1;
            let t = Instant::now();
            run_batch(
                &mut self.backend,
                h,
                tpe,
                &self.x,
                &mut rb,
                &mut self.out,
                ComputeMode::Exact,
            )?;
            s.add(
                2.0 * tpe as f64 * spec.expert_params() as f64,
                t.elapsed().as_secs_f64(),
                rb.pairs,
            );
        }
        let mut r = BenchResult::new(
            format!("prefill-exact {} H{h} F{f}", spec.name),
            tpe as u64,
            s.median() / 1e12,
            peak / 1e12,
            "TOPS",
        )
        .with(
            "peak_basis",
            format!(
                "{} threads x {mhz:.0} MHz x 128 int8 ops/cycle (one 512-bit vpdpbusd per cycle)",
                opts.threads
            ),
        )
        .with("best", s.best() / 1e12)
        .with("ratio_best", s.best() / peak)
        .with("mode", "exact");
        r.extra
            .insert("limit_kind".into(), "compute peak (nominal clock)".into());
        println!(
            "  prefill {tpe} tokens/expert: {:.3} int8 TOPS ({:.3} of VNNI peak; best {:.3})",
            s.median() / 1e12,
            s.median() / peak,
            s.best() / peak
        );
        Ok(r)
    }
}
