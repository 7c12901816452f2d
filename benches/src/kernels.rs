//! `expertmesh bench kernels`: expert FFN throughput of the CPU backend against its roofline
//! (the machine's read bandwidth and int8 compute peak), measured in the same run.
//!
//! Why this exists: decode MoE is memory-bound, so the honest figure for a kernel is weight
//! bytes actually read per second over what the machine can read at all; prefill and large
//! batches on few experts are compute-bound, so those are judged against the int8 peak. Each
//! case's limit is its roofline, min(bytes / read bandwidth, ops / int8 peak)
//! ([`crate::method::roofline`]), where the read bandwidth is the best configuration of several
//! read kernels, thread counts, placements and buffer sizes ([`membw::probe_configs`], swept
//! at the start), and the peak is a dot-product loop on the kernel's instruction. Where the
//! kernels use AMX (`--isa amx-int8`, the default on AMX machines), the compute ceiling is the
//! faster of that loop and the AMX contract loop (`amx::contract_loop`: the K = 32 tile
//! operation, its store and the contract's f32 combine per block, nothing else), both in the
//! same run (`machine.amx_contract_tops_*`).
//!
//! With `--cache-resident` every decode case (exact at each batch, accurate) is measured again
//! with its weights in the cache: each call maps its routed experts onto the same first few
//! experts of the pool (as many as half the last-level cache holds, at least one), so no
//! DRAM read bounds it, and its limit is the compute peak alone: the int8 peak, or the AMX
//! contract loop where that is higher and the mode can use it (`kernel-ceiling-*` rows; not
//! `decode-*`, so `plan --calibrate` never takes them for a device's decode speed). That is
//! the kernels' own ceiling: a decode row far below its read limit whose ceiling is near it
//! is held by the kernels' arithmetic, not by memory.
//!
//! Batches route B tokens top-k over the routed experts of one layer of a real model shape, so
//! the number of touched experts follows U(B) = E·(1 − (1 − k/E)^B). Weights rotate over a pool
//! of experts several times larger than the last-level cache, so every expert is read from
//! DRAM (the pool holds a few generated experts and copies of them: the data's values do not
//! matter to the bandwidth).
//!
//! Statistics ([`crate::method::stats`]): every figure is the median of `--repeats` repetitions;
//! one repetition of a case is a limit sample (the better of two passes of the best read probe,
//! and of the best probe that reads as the kernels do when that is another one, and of two of
//! the peak loop) and a slot of kernel calls (at least [`SLOT_S`]), back to back, so drift and a noisy neighbour hit the kernel and its
//! limit alike; cases take turns within a repetition (the order reversed every other one).
//! `--seconds` bounds the whole run: setup (probe sweep, pools, warm-up calls) gets at most
//! [`SETUP_SHARE`] of it, and repetitions stop when the next would not finish in time; what
//! was cut is printed and recorded in `machine.settings` and `machine.skipped_cases` (every
//! requested case is either a result or a skipped case with its reason). One thing runs
//! whatever the clock says, so that every run measures something on a slow or busy machine:
//! the first model's pool, its first case's warm-up call and that case's first repetition
//! (`settings.over_time_s` says by how much the run went past `--seconds`, for this or a repetition slower than its estimate). Memory
//! bounds it too: the probe buffer and every model's pool, held together, stay within
//! [`MEMORY_SHARE`] of the memory available at start (stated in the output and in
//! `machine.settings`). The JSON's `machine.device_kind` is `"cpu"`: `plan --calibrate`
//! applies these figures to CPU devices only.

use crate::BenchError;
use crate::method::json::{BenchReport, BenchResult};
use crate::method::machine;
use crate::method::roofline::{self, Bound, Roofline};
use crate::method::stats::Spread;
use expertmesh_backend::{
    Activations, BatchLimits, ExpertBackend, ExpertKey, GroupedBatch, Grouping, OutputLayout,
};
use expertmesh_cpu_backend::CpuBackend;
use expertmesh_cpu_backend::membw::{self, Placement, ProbeConfig};
use expertmesh_quant::contract::ComputeMode;
use expertmesh_quant::synth::{self, SplitMix64};
use expertmesh_topology::model::ModelSpec;
use std::time::{Duration, Instant};

/// The CPU kernels' instruction sets (`--isa`).
pub use expertmesh_cpu_backend::kernels::Isa;

/// Options of `bench kernels`.
#[derive(Debug, Clone)]
pub struct KernelBenchOptions {
    /// Backend threads.
    pub threads: usize,
    /// Seconds the whole run may take.
    pub seconds: f64,
    /// Repetitions per case (fewer when `seconds` runs out).
    pub repetitions: usize,
    /// Model presets whose expert shapes are measured.
    pub models: Vec<ModelSpec>,
    /// Decode batch sizes (tokens per layer call).
    pub batches: Vec<usize>,
    /// Tokens per expert for the prefill case (0 to skip).
    pub prefill_tokens: usize,
    /// Minimum pool size in bytes (0: the default, max(32 × LLC, 1 GiB), less in a short run).
    pub pool_bytes: u64,
    /// Where the backend's threads run.
    pub pin: KernelPin,
    /// The instruction set the kernels use (`None`: the best this CPU has).
    pub isa: Option<expertmesh_cpu_backend::kernels::Isa>,
    /// Also measure every decode case with its weights in the cache (a few experts of the
    /// pool, the same ones every call): the kernels' own ceiling, against the compute peak alone,
    /// which says whether a decode row below its read limit is held by memory or by the
    /// kernels' arithmetic.
    pub cache_resident: bool,
}

/// Where `bench kernels` runs the backend's threads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelPin {
    /// As the best read probe's threads: the kernel gets the placement its limit was measured
    /// with (pinned, when pinned threads read best), so a machine whose pinned read bandwidth
    /// moves between runs moves the kernel with its limit.
    Limit,
    /// Wherever the OS schedules them (what a worker does).
    Unpinned,
}

impl KernelPin {
    /// Both placements, as `--pin` lists them.
    pub const ALL: [KernelPin; 2] = [KernelPin::Limit, KernelPin::Unpinned];

    /// The name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Self::Limit => "limit",
            Self::Unpinned => "unpinned",
        }
    }

    /// The CPUs to pin `threads` backend threads to, given the limit's best probe.
    fn cpus(self, threads: usize, best: &ProbeConfig) -> Option<Vec<usize>> {
        match self {
            KernelPin::Limit => best.placement.cpus(threads),
            KernelPin::Unpinned => None,
        }
    }
}

impl std::str::FromStr for KernelPin {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| format!("unknown placement {s:?}: give limit or unpinned"))
    }
}

/// Repetitions per case by default: enough to see a 10% change of a ratio between two runs on
/// a noisy 2-core VM (BENCHMARKS.md, "How many repetitions").
pub const DEFAULT_REPETITIONS: usize = 21;

/// The most of `--seconds` that setup (probe sweep, pools, warm-up calls) may take.
pub(crate) const SETUP_SHARE: f64 = 0.4;

/// Bytes per second a pool loads at (measured here: 0.23–0.37 GB/s), for the time plan.
const POOL_LOAD_RATE: f64 = 0.25e9;

/// Target length of one repetition's slot of kernel calls, seconds (at least one call).
const SLOT_S: f64 = 0.03;

/// The share of the memory available at start ([`machine::memory_available_bytes`]) that the
/// probe buffer and the weight pools may hold together: the rest is the machine's (a 24 GiB
/// machine with a 480 MiB last-level cache would otherwise be asked for 32 x LLC per model
/// and per probe, and the kernel's OOM killer ended such a run).
pub(crate) const MEMORY_SHARE: f64 = 0.5;

/// The smallest weight pool and probe buffer a run is measured with whatever the memory
/// (below these the figures would be mostly cache reads, and the run refuses to start).
const MIN_POOL_BYTES: u64 = 16 << 20;
const MIN_PROBE_BYTES: u64 = 32 << 20;

/// How much work a run does, scaled to `--seconds` and to the memory available.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Effort {
    /// Weight pool per model, bytes.
    pub pool_bytes: u64,
    /// The pool of an unhurried run.
    pub full_pool_bytes: u64,
    /// The smallest pool a model is measured with (twice the last-level cache, or less when
    /// memory is short).
    pub min_pool_bytes: u64,
    /// Largest bandwidth probe buffer, bytes.
    pub probe_bytes: u64,
    /// The largest probe buffer of an unhurried run.
    pub full_probe_bytes: u64,
    /// Passes per probe configuration in the sweep.
    pub probe_passes: usize,
    /// Whether `seconds` shrank the pool or the probe.
    pub short: bool,
    /// Seconds for setup.
    pub setup_s: f64,
    /// Memory available at start, bytes (`None`: unknown, not limited).
    pub memory_available_bytes: Option<u64>,
    /// What the probe and every model's pool may hold together: [`MEMORY_SHARE`] of it.
    pub memory_budget_bytes: Option<u64>,
    /// Whether the memory budget shrank the pool or the probe.
    pub memory_limited: bool,
}

/// A run that cannot be sized within the memory available.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EffortError {
    /// Even the smallest pools and probe exceed the budget.
    #[error(
        "bench kernels needs at least {need_mib} MiB for its smallest weight pools and read probe, but only {budget_mib} MiB ({share:.0}% of the {available_mib} MiB available) may be used: free memory or measure fewer models at once"
    )]
    NoMemory {
        /// MiB the smallest run needs.
        need_mib: u64,
        /// MiB it may use.
        budget_mib: u64,
        /// MiB available.
        available_mib: u64,
        /// The share, percent.
        share: f64,
    },
    /// `--pool-mib` asks for more than the budget holds.
    #[error(
        "--pool-mib {pool_mib}: {models} pool(s) and the read probe would hold {need_mib} MiB, more than the {budget_mib} MiB ({share:.0}% of the {available_mib} MiB available) a run may use; lower --pool-mib"
    )]
    PoolTooLarge {
        /// The pool asked for, MiB.
        pool_mib: u64,
        /// Models measured.
        models: usize,
        /// MiB the run would hold.
        need_mib: u64,
        /// MiB it may use.
        budget_mib: u64,
        /// MiB available.
        available_mib: u64,
        /// The share, percent.
        share: f64,
    },
}

impl Effort {
    /// The effort for `opts` on a machine whose last-level cache holds `llc` bytes and with
    /// `available` bytes of memory free (`None`: unknown): the pool and probe shrink when
    /// preparing them would not fit the setup share, and again when the probe and every
    /// model's pool (all held at once) would exceed [`MEMORY_SHARE`] of the memory.
    pub fn new(
        opts: &KernelBenchOptions,
        llc: u64,
        available: Option<u64>,
    ) -> Result<Effort, EffortError> {
        // Floors of 1 GiB, not only multiples of the reported cache: a VM may report less
        // cache than the host gives it (BENCHMARKS.md: a "32 MiB" L3 read like 96 MiB).
        let full_pool_bytes = (32 * llc).max(1 << 30);
        let full_probe_bytes = (32 * llc).max(1 << 30);
        let setup_s = SETUP_SHARE * opts.seconds;
        let models = opts.models.len().max(1) as u64;
        let fit = |share: f64, rate: f64| (setup_s * share * rate) as u64;
        // Loading a pool runs at about 0.25 GB/s here (generation, copies, repack); filling
        // and sweeping the probe at about 2 GB/s.
        let pool_floor = (2 * llc).max(32 << 20);
        let mut pool = fit(0.5 / models as f64, POOL_LOAD_RATE).clamp(pool_floor, full_pool_bytes);
        let mut probe = fit(0.15, 2e9).clamp((4 * llc).max(64 << 20), full_probe_bytes);
        let short = pool < full_pool_bytes || probe < full_probe_bytes;
        let budget = available.map(|a| (a as f64 * MEMORY_SHARE) as u64);
        let mib = |b: u64| b >> 20;
        let share = MEMORY_SHARE * 100.0;
        let mut memory_limited = false;
        if let (Some(budget), Some(available)) = (budget, available) {
            if opts.pool_bytes > 0 && models * opts.pool_bytes + MIN_PROBE_BYTES > budget {
                return Err(EffortError::PoolTooLarge {
                    pool_mib: mib(opts.pool_bytes),
                    models: models as usize,
                    need_mib: mib(models * opts.pool_bytes + MIN_PROBE_BYTES),
                    budget_mib: mib(budget),
                    available_mib: mib(available),
                    share,
                });
            }
            let need = probe + models * pool.max(opts.pool_bytes);
            if need > budget {
                // Shrink both in proportion, down to the smallest measurable sizes.
                let scale = budget as f64 / need as f64;
                pool = ((pool as f64 * scale) as u64).max(MIN_POOL_BYTES);
                probe = ((probe as f64 * scale) as u64).max(MIN_PROBE_BYTES);
                memory_limited = true;
                if probe + models * pool.max(opts.pool_bytes) > budget {
                    return Err(EffortError::NoMemory {
                        need_mib: mib(MIN_PROBE_BYTES + models * MIN_POOL_BYTES),
                        budget_mib: mib(budget),
                        available_mib: mib(available),
                        share,
                    });
                }
            }
        }
        let pool_bytes = pool.max(opts.pool_bytes);
        Ok(Effort {
            pool_bytes,
            min_pool_bytes: pool_floor.min(pool_bytes),
            full_pool_bytes,
            probe_bytes: probe,
            full_probe_bytes,
            probe_passes: if opts.seconds >= 20.0 { 3 } else { 1 },
            short,
            setup_s,
            memory_available_bytes: available,
            memory_budget_bytes: budget,
            memory_limited,
        })
    }

    /// The line a run limited by memory prints: what it holds, and what that costs.
    fn memory_line(&self, llc: u64) -> Option<String> {
        let mib = |b: u64| b >> 20;
        self.memory_limited.then(|| {
            let cache = if self.pool_bytes < 2 * llc || self.probe_bytes < 4 * llc {
                format!(
                    "; below 2x/4x the {} MiB last-level cache, so part of every figure is cache reads",
                    mib(llc)
                )
            } else {
                String::new()
            };
            format!(
                "memory-limited run: weight pools of {} MiB and a {} MiB read probe, within {:.0}% of the {} MiB available{cache}",
                mib(self.pool_bytes),
                mib(self.probe_bytes),
                MEMORY_SHARE * 100.0,
                mib(self.memory_available_bytes.unwrap_or(0)),
            )
        })
    }

    /// What the run does, for `machine.settings` in the JSON.
    fn settings(&self, opts: &KernelBenchOptions) -> serde_json::Value {
        serde_json::json!({
            "seconds": opts.seconds,
            "threads": opts.threads,
            "repetitions": opts.repetitions,
            "models": opts.models.iter().map(|m| m.name.clone()).collect::<Vec<_>>(),
            "batches": opts.batches,
            "prefill_tokens": opts.prefill_tokens,
            "pin": format!("{:?}", opts.pin).to_lowercase(),
            "pool_bytes": self.pool_bytes,
            "full_pool_bytes": self.full_pool_bytes,
            "probe_bytes": self.probe_bytes,
            "full_probe_bytes": self.full_probe_bytes,
            "probe_passes": self.probe_passes,
            "min_calls_per_case": 1,
            "slot_s": SLOT_S,
            "setup_share": SETUP_SHARE,
            "short_run": self.short,
            "memory_available_bytes": self.memory_available_bytes,
            "memory_budget_bytes": self.memory_budget_bytes,
            "memory_share": MEMORY_SHARE,
            "memory_limited": self.memory_limited,
            "cache_resident": opts.cache_resident,
        })
    }

    /// The line a short run prints about what it shrank.
    fn short_run_line(&self, seconds: f64) -> Option<String> {
        let mib = |b: u64| b >> 20;
        self.short.then(|| {
            format!(
                "short run (--seconds {seconds}): weight pool {} MiB instead of {}, bandwidth probe up to {} MiB instead of {}, {} sweep pass(es) per probe; figures are noisier than a longer run's",
                mib(self.pool_bytes),
                mib(self.full_pool_bytes),
                mib(self.probe_bytes),
                mib(self.full_probe_bytes),
                self.probe_passes,
            )
        })
    }
}

/// The run's clock: when it started and when it must end.
#[derive(Debug, Clone, Copy)]
struct Clock {
    start: Instant,
    end: Instant,
    setup_end: Instant,
}

impl Clock {
    fn new(seconds: f64, setup_s: f64) -> Clock {
        let start = Instant::now();
        Clock {
            start,
            end: start + Duration::from_secs_f64(seconds),
            setup_end: start + Duration::from_secs_f64(setup_s),
        }
    }
    /// Whether `secs` more still end by `until`.
    fn fits(until: Instant, secs: f64) -> bool {
        Instant::now() + Duration::from_secs_f64(secs.max(0.0)) <= until
    }
}

/// The same-run limits: the best read probe configuration (from a sweep), the peak loop,
/// and with the AMX kernels the AMX contract loop.
struct Limits {
    buf: Vec<u8>,
    best: ProbeConfig,
    /// The best configuration among those that read as the kernels do (several streams per
    /// thread, prefetched into L2), when `best` is not one: sampled beside `best`, so a sweep
    /// that met the machine in another state cannot leave a limit below the kernels' own way
    /// of reading (on a VM whose bandwidth changes state, a `plain` probe picked in one state
    /// read 3 % below the decode kernel in the other).
    kernel_like: Option<ProbeConfig>,
    sweep: Vec<(ProbeConfig, Vec<f64>)>,
    peak_iters: usize,
    /// The int8 peak loop: the kernels' own instructions ([`roofline::PeakLoop::of`]).
    peak_loop: roofline::PeakLoop,
    /// Iterations of the AMX contract loop per pass (`None`: the kernels do not use AMX).
    amx_iters: Option<usize>,
    threads: usize,
    bw: Vec<f64>,
    peak: Vec<f64>,
    amx: Vec<f64>,
}

impl Limits {
    /// Sweep every probe configuration (passes round-robin until `effort.probe_passes` each
    /// or a tenth of the setup time is spent) and keep the one with the best median.
    fn sweep(
        threads: usize,
        effort: &Effort,
        llc: u64,
        clock: &Clock,
        isa: expertmesh_cpu_backend::kernels::Isa,
    ) -> Limits {
        let amx = isa == expertmesh_cpu_backend::kernels::Isa::Amx;
        let peak_loop = roofline::PeakLoop::of(isa);
        let big = effort.probe_bytes as usize;
        let small = ((16 * llc) as usize).max(512 << 20).min(big);
        let mut sizes = vec![small, big];
        sizes.dedup();
        let buf = vec![1u8; big];
        let until = clock.start + Duration::from_secs_f64(0.25 * effort.setup_s);
        let mut configs = membw::probe_configs(threads, &sizes);
        // Most promising first, for a sweep the clock cuts short: all threads, pinned.
        configs.sort_by_key(|c| {
            (
                std::cmp::Reverse(c.threads),
                c.placement == Placement::Unpinned,
            )
        });
        let mut sweep: Vec<(ProbeConfig, Vec<f64>)> =
            configs.into_iter().map(|c| (c, Vec::new())).collect();
        'passes: for _ in 0..effort.probe_passes {
            for (cfg, samples) in sweep.iter_mut() {
                if !samples.is_empty() && !Clock::fits(until, cfg.bytes as f64 / 10e9) {
                    break 'passes;
                }
                samples.push(membw::read_pass(&buf, cfg));
            }
        }
        sweep.retain(|(_, s)| !s.is_empty());
        let best = sweep
            .iter()
            .max_by(|a, b| Spread::of(&a.1).median.total_cmp(&Spread::of(&b.1).median))
            .map(|(c, _)| c.clone())
            .expect("the first configuration always runs");
        let reads_like_kernels = |c: &ProbeConfig| {
            matches!(
                c.kernel,
                membw::ReadKernel::MultiStreamL2 | membw::ReadKernel::Avx512L2
            ) && c.threads == best.threads
        };
        let kernel_like = sweep
            .iter()
            .filter(|(c, _)| reads_like_kernels(c))
            .max_by(|a, b| Spread::of(&a.1).median.total_cmp(&Spread::of(&b.1).median))
            .map(|(c, _)| c.clone())
            .filter(|c| *c != best);
        Limits {
            buf,
            best,
            kernel_like,
            sweep,
            peak_iters: roofline::iters_for(0.004, peak_loop),
            peak_loop,
            amx_iters: amx.then(|| roofline::amx_iters_for(0.004)).flatten(),
            threads,
            bw: Vec::new(),
            peak: Vec::new(),
            amx: Vec::new(),
        }
    }

    /// One limit sample: the best of two passes of the best probe (and two of the kernel-like
    /// one, [`Limits::kernel_like`]) and the better of two passes of the peak loop (a limit is an upper envelope: interference only lowers a pass, so the
    /// better of two is the less disturbed one). With AMX the compute ceiling is the faster
    /// of the peak loop and the AMX contract loop (the kernels use whichever path is faster
    /// for a token tile, so the ceiling is the better of the two).
    fn sample(&mut self) -> Roofline {
        let best_of_2 = |f: &mut dyn FnMut() -> f64| f().max(f());
        let mut read = best_of_2(&mut || membw::read_pass(&self.buf, &self.best));
        if let Some(k) = &self.kernel_like {
            read = read.max(best_of_2(&mut || membw::read_pass(&self.buf, k)));
        }
        let mut r = Roofline {
            read_bytes_per_s: read,
            ops_per_s: best_of_2(&mut || {
                roofline::int8_peak_pass(self.threads, self.peak_iters, self.peak_loop)
            }),
        };
        self.bw.push(r.read_bytes_per_s);
        self.peak.push(r.ops_per_s);
        if let Some(iters) = self.amx_iters {
            let threads = self.threads;
            let amx = best_of_2(&mut || roofline::amx_contract_pass(threads, iters).unwrap_or(0.0));
            self.amx.push(amx);
            r.ops_per_s = r.ops_per_s.max(amx);
        }
        r
    }

    /// Seconds one [`Limits::sample`] takes (estimated).
    fn sample_s(&self) -> f64 {
        let read_s = |probe: &ProbeConfig| {
            let bw = self
                .sweep
                .iter()
                .find(|(c, _)| c == probe)
                .map_or(0.0, |(_, s)| Spread::of(s).median);
            probe.bytes as f64 / bw.max(1e9)
        };
        let reads = read_s(&self.best) + self.kernel_like.as_ref().map_or(0.0, read_s);
        let loops = if self.amx_iters.is_some() {
            0.008
        } else {
            0.004
        };
        2.0 * (reads + loops)
    }

    /// The sweep and the interleaved samples, for `machine` in the JSON.
    fn describe(&self, report: &mut BenchReport) {
        let probes: Vec<serde_json::Value> = self
            .sweep
            .iter()
            .map(|(c, s)| {
                serde_json::json!({
                    "name": c.name(), "kernel": c.kernel.name(), "threads": c.threads,
                    "placement": c.placement.name(), "bytes": c.bytes,
                    "gbs_median": Spread::of(s).median / 1e9,
                    "samples_gbs": s.iter().map(|x| x / 1e9).collect::<Vec<_>>(),
                })
            })
            .collect();
        let (bw, peak) = (Spread::of(&self.bw), Spread::of(&self.peak));
        let m = &mut report.machine.extra;
        m.insert("read_bandwidth_probes".into(), probes.into());
        m.insert("read_bandwidth_probe_best".into(), self.best.name().into());
        if let Some(k) = &self.kernel_like {
            m.insert("read_bandwidth_probe_kernel_like".into(), k.name().into());
        }
        m.insert("bandwidth_probe_bytes".into(), self.best.bytes.into());
        m.insert("read_bandwidth_gbs_median".into(), (bw.median / 1e9).into());
        m.insert("read_bandwidth_gbs_p10".into(), (bw.p10 / 1e9).into());
        m.insert("read_bandwidth_gbs_p90".into(), (bw.p90 / 1e9).into());
        let best = self.bw.iter().copied().fold(0.0, f64::max);
        m.insert("read_bandwidth_gbs_best".into(), (best / 1e9).into());
        m.insert("int8_peak_tops_median".into(), (peak.median / 1e12).into());
        m.insert("int8_peak_tops_p10".into(), (peak.p10 / 1e12).into());
        m.insert("int8_peak_tops_p90".into(), (peak.p90 / 1e12).into());
        m.insert("int8_peak_basis".into(), self.peak_loop.basis().into());
        if !self.amx.is_empty() {
            let amx = Spread::of(&self.amx);
            m.insert(
                "amx_contract_tops_median".into(),
                (amx.median / 1e12).into(),
            );
            m.insert("amx_contract_tops_p10".into(), (amx.p10 / 1e12).into());
            m.insert("amx_contract_tops_p90".into(), (amx.p90 / 1e12).into());
            m.insert(
                "amx_contract_basis".into(),
                roofline::AMX_CONTRACT_BASIS.into(),
            );
        }
    }
}

/// One routed batch: its (token, logical expert) pairs, grouped by logical expert when run;
/// logical expert `e` runs on physical expert `slot[e]`.
struct RoutedBatch {
    grouping: Grouping,
    /// Per logical expert, the physical expert of the pool it runs on: the call's touched
    /// experts, in ascending order (the order they run in), take consecutive slots from the
    /// rotation's offset, so no two of them share one unless the call touches more experts
    /// than the pool holds (then a slot is used again a whole pool later, at least twice the
    /// last-level cache: from memory again). A mapping `(e + offset) % pool` put two logical
    /// experts of one call on one physical expert, the second read from the cache but counted
    /// as read from memory (Kimi rows passed their read limit).
    slot: Vec<u32>,
    /// Distinct experts touched: each read from memory once.
    touched: usize,
    pairs: usize,
}

/// Physical slots for the touched logical experts (`touched[e]`), consecutive from `offset`
/// in ascending logical order, modulo `pool`; untouched experts get slot 0 (never run).
fn assign_slots(touched: &[bool], offset: usize, pool: usize) -> Vec<u32> {
    let mut next = offset;
    touched
        .iter()
        .map(|&t| {
            if !t {
                return 0;
            }
            let s = (next % pool.max(1)) as u32;
            next += 1;
            s
        })
        .collect()
}

/// Route `tokens` tokens top-k uniformly at random over `experts` logical experts, the
/// touched ones on consecutive physical slots of `pool` from `offset` ([`RoutedBatch::slot`]).
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
        slot: assign_slots(&touched, offset, pool),
        touched: touched.iter().filter(|&&x| x).count(),
        pairs,
    }
}

/// What a case runs.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    /// Exact-mode decode of a routed batch of this many tokens.
    Decode(usize),
    /// Accurate-mode decode of one token.
    Accurate,
    /// This many tokens on one expert at a time, exact mode.
    Prefill(usize),
    /// [`Kind::Decode`] with the weights in the cache (`--cache-resident`).
    DecodeCached(usize),
    /// [`Kind::Accurate`] with the weights in the cache (`--cache-resident`).
    AccurateCached,
}

impl Kind {
    /// Whether the case reads a few cache-resident experts instead of the pool.
    fn cached(self) -> bool {
        matches!(self, Kind::DecodeCached(_) | Kind::AccurateCached)
    }

    /// Int8 dot products per (token, weight): accurate mode runs the integer kernels on
    /// [`ACCURATE_LEVELS`](expertmesh_cpu_backend::kernels::ACCURATE_LEVELS) levels of each
    /// token.
    fn int8_passes(self) -> f64 {
        match self {
            Kind::Accurate | Kind::AccurateCached => {
                expertmesh_cpu_backend::kernels::ACCURATE_LEVELS as f64
            }
            _ => 1.0,
        }
    }
}

/// One model's expert pool loaded into a backend, and the shared input and RNG.
struct ModelBench {
    spec: ModelSpec,
    backend: CpuBackend,
    /// Hidden size, intermediate size, routed experts, top-k.
    h: usize,
    f: usize,
    e: usize,
    k: usize,
    expert_bytes: u64,
    /// Experts in the pool.
    pool: usize,
    /// Experts the cache-resident cases use (the first of the pool): as many as half the
    /// last-level cache holds, at least one.
    cached_pool: usize,
    rng: SplitMix64,
    x: Vec<f32>,
    out: Vec<f32>,
    offset: usize,
}

/// What one call did: bytes of weights read, int8 operations, touched experts, seconds.
#[derive(Debug, Clone, Copy, Default)]
struct Call {
    bytes: f64,
    ops: f64,
    touched: f64,
    secs: f64,
}

impl ModelBench {
    /// Setup step: a pool of at least `pool_bytes` of experts (a few generated, the rest
    /// copies), loaded into a backend with `threads` threads.
    fn load(
        spec: &ModelSpec,
        threads: usize,
        pin: Option<Vec<usize>>,
        isa: expertmesh_cpu_backend::kernels::Isa,
        pool_bytes: u64,
        max_tokens: usize,
    ) -> Result<Self, BenchError> {
        let (h, f) = (spec.hidden as usize, spec.moe_intermediate as usize);
        let (e, k) = (spec.routed_experts as usize, spec.top_k as usize);
        let expert_bytes = spec.expert_bytes();
        let pool = (pool_bytes.div_ceil(expert_bytes) as usize).max(2);
        print!(
            "{}: pool of {pool} experts ({:.2} GB) ... ",
            spec.name,
            (pool as u64 * expert_bytes) as f64 / 1e9
        );
        let t0 = Instant::now();
        let distinct = (0..pool.min(4))
            .map(|i| synth::synthetic_expert(spec.quant, h, f, 7, 0, i as u32))
            .collect::<Result<Vec<_>, _>>()?;
        let experts = (0..pool)
            .map(|i| {
                let key = ExpertKey {
                    layer: 0,
                    expert: i as u32,
                };
                (key, distinct[i % distinct.len()].clone())
            })
            .collect();
        drop(distinct);
        let mut backend = CpuBackend::with_isa_pinned(threads, isa, pin)?;
        backend.load(
            experts,
            BatchLimits {
                max_tokens,
                max_pairs: max_tokens * k.max(1),
            },
        )?;
        println!(
            "{:.1} s, backend {}",
            t0.elapsed().as_secs_f64(),
            backend.name()
        );
        let mut rng = SplitMix64::new(99);
        let x = synth::normal_vec(&mut rng, max_tokens * h, 1.0);
        Ok(Self {
            spec: spec.clone(),
            backend,
            h,
            f,
            e,
            k,
            expert_bytes,
            pool,
            cached_pool: 1,
            rng,
            x,
            out: Vec::new(),
            offset: 0,
        })
    }

    /// One call of `kind`; the experts rotate so consecutive calls read other experts.
    fn call(&mut self, kind: Kind) -> Result<Call, BenchError> {
        let (tokens, mode, mut rb) = match kind {
            Kind::Decode(_) | Kind::Accurate | Kind::DecodeCached(_) | Kind::AccurateCached => {
                let (b, mode) = match kind {
                    Kind::Decode(b) | Kind::DecodeCached(b) => (b, ComputeMode::Exact),
                    _ => (1, ComputeMode::Accurate),
                };
                // Cached: every call maps its experts onto the same first few of the pool;
                // otherwise the rotation moves past the slots this call takes.
                let (offset, pool) = if kind.cached() {
                    (0, self.cached_pool)
                } else {
                    (self.offset, self.pool)
                };
                let rb = route_uniform(&mut self.rng, b, self.e, self.k, offset, pool);
                if !kind.cached() {
                    self.offset = (self.offset + rb.touched + 1) % self.pool.max(1);
                }
                (b, mode, rb)
            }
            Kind::Prefill(tpe) => {
                let mut grouping = Grouping::with_capacity(tpe);
                for t in 0..tpe as u32 {
                    grouping.push(0, t, 1.0, t);
                }
                self.offset = (self.offset + 1) % self.pool.max(1);
                let rb = RoutedBatch {
                    grouping,
                    slot: vec![self.offset as u32],
                    touched: 1,
                    pairs: tpe,
                };
                (tpe, ComputeMode::Exact, rb)
            }
        };
        let t = Instant::now();
        self.run_batch(tokens, &mut rb, mode)?;
        let secs = t.elapsed().as_secs_f64();
        Ok(Call {
            bytes: (rb.touched as u64 * self.expert_bytes) as f64,
            ops: kind.int8_passes() * 2.0 * rb.pairs as f64 * self.spec.expert_params() as f64,
            touched: rb.touched as f64,
            secs,
        })
    }

    /// Run one routed batch (per-slot output) on the backend.
    fn run_batch(
        &mut self,
        tokens: usize,
        rb: &mut RoutedBatch,
        mode: ComputeMode,
    ) -> Result<(), BenchError> {
        let hidden = self.h;
        self.out.resize(rb.pairs * hidden, 0.0);
        let slot = &rb.slot;
        let physical = |e: u32| slot[e as usize];
        let (backend, x, out) = (&mut self.backend, &self.x, &mut self.out);
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
}

/// What one expert costs a CPU device of `threads` threads on this machine, measured: seconds
/// to stream its weights once, and seconds per (token, expert) pair beyond that. From calls of
/// one expert with 1 and with 8 tokens (a decode call's experts get a few tokens each), each on
/// another expert of a pool at least twice the last-level cache, so the weights come from
/// memory; medians of `reps` calls each. The pool takes at most a quarter of the memory the
/// machine has available (then fewer experts, some maybe cached: the stream cost reads low).
/// The cost model `bench rebalance` gives the planner for CPU devices, whose topology entries
/// carry no int8 rate.
pub(crate) fn cpu_expert_costs(
    spec: &ModelSpec,
    threads: usize,
    reps: usize,
) -> Result<(f64, f64), BenchError> {
    let llc = membw::last_level_cache_bytes();
    let mut pool_bytes = (2 * llc).max(64 << 20);
    if let Some(available) = machine::memory_available_bytes() {
        pool_bytes = pool_bytes.min(available / 4);
    }
    let isa = expertmesh_cpu_backend::kernels::Isa::detect();
    let mut m = ModelBench::load(spec, threads, None, isa, pool_bytes, 8)?;
    let mut median_s = |tokens: usize| -> Result<f64, BenchError> {
        m.call(Kind::Prefill(tokens))?; // warm-up
        let mut s = (0..reps.max(1))
            .map(|_| m.call(Kind::Prefill(tokens)).map(|c| c.secs))
            .collect::<Result<Vec<f64>, _>>()?;
        s.sort_by(f64::total_cmp);
        Ok(s[s.len() / 2])
    };
    let one = median_s(1)?;
    let eight = median_s(8)?;
    let per_pair = ((eight - one) / 7.0).max(1e-9);
    Ok(((one - per_pair).max(1e-9), per_pair))
}

/// One measured case: a model, what it runs, and its interleaved samples.
struct Case {
    model: usize,
    kind: Kind,
    /// Seconds of one call (from the warm-up, then the latest slot).
    call_s: f64,
    /// Per repetition: achieved and limit in the row's unit, and the slot's calls.
    achieved: Vec<f64>,
    limit: Vec<f64>,
    slots: Vec<(Call, u32, Bound)>,
    /// Seconds the last repetition took.
    last_sample_s: f64,
}

impl Case {
    fn unit(&self) -> &'static str {
        match self.kind {
            Kind::Prefill(_) => "TOPS",
            _ => "GB/s",
        }
    }

    /// One repetition: a limit sample, then a slot of calls (at least one, about [`SLOT_S`]).
    fn sample(&mut self, m: &mut ModelBench, limits: &mut Limits) -> Result<(), BenchError> {
        let mut roof = limits.sample();
        if self.kind == Kind::Accurate {
            // The read limit alone: accurate mode is judged as a memory-bound decode.
            roof.ops_per_s = 0.0;
        }
        if self.kind.cached() {
            // Weights in the cache: no DRAM read to bound it, the compute peak alone: the
            // vector int8 peak, or the AMX contract loop where it is higher (the backend
            // runs AMX tiles for groups of 16 tokens and more, which batches of 64 and 256
            // reach on models with few experts), so the ceiling is never one the call passes.
            // Accurate mode runs the vector kernels only.
            roof.read_bytes_per_s = 0.0;
            let peak = limits.peak.last().copied().unwrap_or(0.0);
            let amx = match self.kind {
                Kind::Accurate | Kind::AccurateCached => 0.0,
                _ => limits.amx.last().copied().unwrap_or(0.0),
            };
            roof.ops_per_s = peak.max(amx);
            // The read probe just evicted the experts: one untimed call brings them back.
            m.call(self.kind)?;
        }
        let mut sum = Call::default();
        let mut calls = 0u32;
        while calls == 0 || sum.secs < SLOT_S {
            let c = m.call(self.kind)?;
            sum.bytes += c.bytes;
            sum.ops += c.ops;
            sum.touched += c.touched;
            sum.secs += c.secs;
            calls += 1;
        }
        self.call_s = sum.secs / calls as f64;
        let (lim, bound) = match self.kind {
            Kind::Prefill(_) => {
                let (r, b) = roof.op_rate(sum.bytes, sum.ops);
                (r / 1e12, b)
            }
            _ => {
                let (r, b) = roof.byte_rate(sum.bytes, sum.ops);
                (r / 1e9, b)
            }
        };
        let achieved = match self.kind {
            Kind::Prefill(_) => sum.ops / sum.secs / 1e12,
            _ => sum.bytes / sum.secs / 1e9,
        };
        self.achieved.push(achieved);
        self.limit.push(lim);
        self.slots.push((sum, calls, bound));
        Ok(())
    }

    /// Seconds one repetition takes: the longer of the estimate and the last one's time,
    /// with 20% to spare.
    fn sample_s(&self, limits: &Limits) -> f64 {
        1.2 * (limits.sample_s() + self.call_s.max(SLOT_S)).max(self.last_sample_s)
    }
}

/// Run the kernel benchmark and return the report.
pub fn run(opts: &KernelBenchOptions) -> Result<BenchReport, BenchError> {
    let mut report = BenchReport::new();
    let llc = membw::last_level_cache_bytes();
    let effort = Effort::new(opts, llc, machine::memory_available_bytes())?;
    let clock = Clock::new(opts.seconds, effort.setup_s);
    if let Some(line) = effort.short_run_line(opts.seconds) {
        println!("{line}");
    }
    if let Some(line) = effort.memory_line(llc) {
        println!("{line}");
    }
    let isa = opts
        .isa
        .unwrap_or_else(expertmesh_cpu_backend::kernels::Isa::detect);
    let amx = isa == expertmesh_cpu_backend::kernels::Isa::Amx;
    let mut limits = Limits::sweep(opts.threads, &effort, llc, &clock, isa);
    if let Some(iters) = limits.amx_iters {
        println!(
            "  AMX kernels: compute limit = max(int8 peak loop, AMX contract loop of {iters} blocks)"
        );
    }
    println!(
        "  read probes: {} configurations swept; best {} at {:.2} GB/s (median of its passes)",
        limits.sweep.len(),
        limits.best.name(),
        limits
            .sweep
            .iter()
            .find(|(c, _)| *c == limits.best)
            .map_or(0.0, |(_, s)| Spread::of(s).median / 1e9)
    );
    let mut skipped = Vec::new();
    let pin = opts.pin.cpus(opts.threads, &limits.best);
    let (mut models, mut cases) =
        setup_cases(opts, &effort, &clock, pin.clone(), &mut skipped, llc)?;
    let done = measure(&mut models, &mut cases, &mut limits, opts, &clock)?;
    limits.describe(&mut report);
    let moved = limit_moved(&limits.bw);
    let extra = &mut report.machine.extra;
    extra.insert("read_limit_moved".into(), moved.is_some().into());
    extra.insert("device_kind".into(), "cpu".into());
    let mut settings = effort.settings(opts);
    let elapsed_s = clock.start.elapsed().as_secs_f64();
    settings["repetitions_done"] = done.into();
    settings["elapsed_s"] = elapsed_s.into();
    let over_time_s = (elapsed_s - opts.seconds).max(0.0);
    settings["over_time_s"] = over_time_s.into();
    if over_time_s > 0.0 {
        println!(
            "  --seconds {} exceeded by {over_time_s:.1} s: the first case's pool, warm-up call and first repetition always run, and on a busy machine a repetition can take longer than its estimate",
            opts.seconds
        );
    }
    extra.insert("settings".into(), settings);
    extra.insert("threads".into(), opts.threads.into());
    // The CPUs the backend's threads were pinned to (null: unpinned).
    extra.insert("kernel_pinned_cpus".into(), serde_json::json!(pin));
    if let Some(m) = models.first() {
        extra.insert("backend".into(), m.backend.name().into());
    }
    machine::finish(extra);
    for c in &cases {
        match result_of(c, &models[c.model], opts.threads, amx) {
            Some(r) => report.results.push(r),
            None => skipped.push(serde_json::json!({
                "model": models[c.model].spec.name, "case": format!("{:?}", c.kind),
                "why": "set up, but no repetition of it fitted in --seconds",
            })),
        }
    }
    report
        .machine
        .extra
        .insert("skipped_cases".into(), skipped.into());
    report
        .results
        .sort_by(|a, b| a.name.cmp(&b.name).then(a.batch.cmp(&b.batch)));
    if let Some(line) = moved {
        println!("{line}");
    }
    for bug in report.bench_bugs() {
        println!(
            "BENCH BUG: {} B={} ratio {:.3} is past its limit by more than 2%: the limit was not measured as a limit",
            bug.name, bug.batch, bug.ratio
        );
    }
    Ok(report)
}

/// p90 / p10 of the read limit's samples past which the limit moved during the run: steady
/// runs here spread 5-10%; a run whose two-thread reads switched between ~32 and ~40 GB/s
/// (the host's placement of the vCPUs, as far as the VM can tell) spread 27%.
const LIMIT_MOVED: f64 = 1.15;

/// The warning for a read limit that moved during the run (`None`: it held still). Decode
/// kernels below the limit do not move with it, so their ratios move instead.
fn limit_moved(bw: &[f64]) -> Option<String> {
    let s = Spread::of(bw);
    (s.p10 > 0.0 && s.p90 / s.p10 > LIMIT_MOVED).then(|| {
        format!(
            "NOTE: the read limit moved during this run (p10 {:.1}, p90 {:.1} GB/s, {:.0}% apart): \
             memory-bound ratios of this run are not comparable with a run at another limit \
             (`bench compare` prints both limits first); rerun when it holds still",
            s.p10 / 1e9,
            s.p90 / 1e9,
            (s.p90 / s.p10 - 1.0) * 100.0
        )
    })
}

/// Setup: each model's pool and its cases, each warmed up by one call (which also times it);
/// a case whose call would not fit its share of the remaining time is skipped, and so is a
/// model whose pool would not be ready before the setup share runs out.
fn setup_cases(
    opts: &KernelBenchOptions,
    effort: &Effort,
    clock: &Clock,
    pin: Option<Vec<usize>>,
    skipped: &mut Vec<serde_json::Value>,
    llc: u64,
) -> Result<(Vec<ModelBench>, Vec<Case>), BenchError> {
    let max_b = opts.batches.iter().copied().max().unwrap_or(1);
    let max_tokens = max_b.max(opts.prefill_tokens);
    let (mut models, mut cases) = (Vec::new(), Vec::new());
    let mut skip = |name: &str, kind: Kind, why: String| {
        println!("  {name} {kind:?}: skipped ({why})");
        skipped.push(serde_json::json!({"model": name, "case": format!("{kind:?}"), "why": why}));
    };
    for spec in &opts.models {
        // The planned pool, or what the setup time left can load, but never less than the
        // smallest pool that still misses the cache.
        let left = clock.setup_end.saturating_duration_since(Instant::now());
        let pool_bytes = effort
            .pool_bytes
            .min((left.as_secs_f64() * POOL_LOAD_RATE) as u64);
        // The first model is always measured (its pool at least the smallest that misses
        // the cache), whatever the clock says: a run always measures something.
        let first = models.is_empty();
        let pool_bytes = if first {
            pool_bytes.max(effort.min_pool_bytes)
        } else if pool_bytes < effort.min_pool_bytes {
            skip(
                &spec.name,
                Kind::Decode(0),
                "no time left for its pool".into(),
            );
            continue;
        } else {
            pool_bytes
        };
        let isa = opts
            .isa
            .unwrap_or_else(expertmesh_cpu_backend::kernels::Isa::detect);
        let mut m = ModelBench::load(spec, opts.threads, pin.clone(), isa, pool_bytes, max_tokens)?;
        let mut kinds: Vec<Kind> = opts.batches.iter().map(|&b| Kind::Decode(b)).collect();
        kinds.push(Kind::Accurate);
        if opts.prefill_tokens > 0 {
            kinds.push(Kind::Prefill(opts.prefill_tokens));
        }
        if opts.cache_resident {
            kinds.extend(cached_kinds(opts, &mut m, llc, &mut skip));
        }
        let mut last: Option<(usize, f64)> = None;
        for kind in kinds {
            let tokens = match kind {
                Kind::Decode(b) | Kind::Prefill(b) | Kind::DecodeCached(b) => b,
                Kind::Accurate | Kind::AccurateCached => 1,
            };
            // One call of this case may take at most a third of the time left (estimated
            // from the last decode batch, linear in the batch).
            let budget = (clock.end - Instant::now().min(clock.end)).as_secs_f64() / 3.0;
            let est = last.map_or(0.0, |(b0, t0)| t0 * tokens as f64 / b0.max(1) as f64);
            let first_case = first && cases.is_empty();
            if !first_case && (est > budget || !Clock::fits(clock.end, est)) {
                skip(
                    &spec.name,
                    kind,
                    format!("one call ~{est:.2} s > {budget:.2} s"),
                );
                continue;
            }
            let c = m.call(kind)?;
            if matches!(kind, Kind::Decode(_)) {
                last = Some((tokens, c.secs));
            }
            cases.push(Case {
                model: models.len(),
                kind,
                call_s: c.secs,
                achieved: Vec::new(),
                limit: Vec::new(),
                slots: Vec::new(),
                last_sample_s: 0.0,
            });
        }
        models.push(m);
    }
    Ok((models, cases))
}

/// `--cache-resident`: the cached twins of `m`'s decode cases, its `cached_pool` set to as
/// many experts as half the last-level cache (`llc` bytes) holds, at least one; none (each
/// handed to `skip` with the reason) where one expert does not fit the cache, since their
/// rows would read DRAM.
fn cached_kinds(
    opts: &KernelBenchOptions,
    m: &mut ModelBench,
    llc: u64,
    skip: &mut dyn FnMut(&str, Kind, String),
) -> Vec<Kind> {
    m.cached_pool = ((llc / 2) / m.expert_bytes.max(1)).clamp(1, m.pool as u64) as usize;
    let mut cached: Vec<Kind> = opts
        .batches
        .iter()
        .map(|&b| Kind::DecodeCached(b))
        .collect();
    cached.push(Kind::AccurateCached);
    if llc > 0 && m.expert_bytes <= llc {
        return cached;
    }
    for kind in cached {
        skip(
            &m.spec.name,
            kind,
            format!(
                "--cache-resident: one expert ({} MiB) does not fit the last-level cache ({} MiB)",
                m.expert_bytes >> 20,
                llc >> 20
            ),
        );
    }
    Vec::new()
}

/// The repetitions: every case in turn (reversed every other repetition), until
/// `opts.repetitions` or the clock stops them; returns the repetitions every case completed.
fn measure(
    models: &mut [ModelBench],
    cases: &mut [Case],
    limits: &mut Limits,
    opts: &KernelBenchOptions,
    clock: &Clock,
) -> Result<usize, BenchError> {
    if cases.is_empty() {
        // Every case was skipped (no time left for a pool): nothing was repeated.
        return Ok(0);
    }
    let mut order: Vec<usize> = (0..cases.len()).collect();
    for rep in 0..opts.repetitions.max(1) {
        for &i in &order {
            let c = &mut cases[i];
            // 2% of the run (at least 20 ms) is kept for what follows the last repetition.
            let reserve = (0.02 * opts.seconds).max(0.02);
            // The first case's first repetition always runs (see the module doc).
            let guaranteed = rep == 0 && i == 0;
            if !guaranteed && !Clock::fits(clock.end, c.sample_s(limits) + reserve) {
                println!(
                    "  --seconds {} reached in repetition {}: stopping (figures from the repetitions done)",
                    opts.seconds,
                    rep + 1
                );
                return Ok(rep);
            }
            let t0 = Instant::now();
            c.sample(&mut models[c.model], limits)?;
            c.last_sample_s = t0.elapsed().as_secs_f64();
        }
        order.reverse();
    }
    Ok(opts.repetitions.max(1))
}

/// What the limit of a case of `kind` is, for its row's `limit_kind` (`amx`: the kernels are
/// AMX's).
fn limit_kind(kind: Kind, amx: bool) -> &'static str {
    if kind == Kind::Accurate {
        "memory read bandwidth (best read probe), same run, interleaved; f32 peak not measured"
    } else if kind.cached() && amx && kind != Kind::AccurateCached {
        "int8 ops / max(int8 peak, AMX contract loop) (weights cache-resident: the same few \
         experts every call, no DRAM read), same run, interleaved: the kernels' own ceiling"
    } else if kind.cached() {
        "int8 ops / int8 peak alone (weights cache-resident: the same few experts every call, \
         no DRAM read; accurate mode counts its three int8 levels), same run, interleaved: \
         the kernels' own ceiling"
    } else if amx {
        "roofline min(bytes / read bandwidth, int8 ops / max(int8 peak, AMX contract loop)), \
         same run, interleaved"
    } else {
        "roofline min(bytes / read bandwidth, int8 ops / int8 peak), same run, interleaved"
    }
}

/// The result row of a case (none without samples).
fn result_of(c: &Case, m: &ModelBench, threads: usize, amx: bool) -> Option<BenchResult> {
    if c.achieved.is_empty() {
        return None;
    }
    let (spec, h, f) = (&m.spec, m.h, m.f);
    let (name, batch, mode) = match c.kind {
        Kind::Decode(b) => (format!("decode-exact {} H{h} F{f}", spec.name), b, "exact"),
        Kind::Accurate => (
            format!("decode-accurate {} H{h} F{f}", spec.name),
            1,
            "accurate",
        ),
        Kind::Prefill(t) => (format!("prefill-exact {} H{h} F{f}", spec.name), t, "exact"),
        Kind::DecodeCached(b) => (
            format!("kernel-ceiling-exact {} H{h} F{f}", spec.name),
            b,
            "exact",
        ),
        Kind::AccurateCached => (
            format!("kernel-ceiling-accurate {} H{h} F{f}", spec.name),
            1,
            "accurate",
        ),
    };
    let mut r = BenchResult::from_samples(name, batch as u64, &c.achieved, &c.limit, c.unit());
    let calls: u32 = c.slots.iter().map(|s| s.1).sum();
    let tot = c.slots.iter().fold(Call::default(), |a, (s, _, _)| Call {
        bytes: a.bytes + s.bytes,
        ops: a.ops + s.ops,
        touched: a.touched + s.touched,
        secs: a.secs + s.secs,
    });
    let lat: Vec<f64> = c
        .slots
        .iter()
        .map(|(s, n, _)| s.secs / *n as f64 * 1e6)
        .collect();
    let lat = Spread::of(&lat);
    let compute = c.slots.iter().filter(|s| s.2 == Bound::Compute).count();
    let bound = if 2 * compute > c.slots.len() {
        Bound::Compute
    } else {
        Bound::Memory
    };
    let best = c.achieved.iter().copied().fold(0.0, f64::max);
    let ratio_best = if r.limit > 0.0 { best / r.limit } else { 0.0 };
    let limit_kind = limit_kind(c.kind, amx);
    r = r
        .with("mode", mode)
        .with("limit_kind", limit_kind)
        .with("bound", bound.name())
        .with("best", best)
        .with("ratio_best", ratio_best)
        .with("experts_touched", tot.touched / calls as f64)
        .with(
            "tokens_per_expert",
            tot.ops / c.kind.int8_passes() / 2.0 / spec.expert_params() as f64 / tot.touched,
        )
        .with(
            "cache_resident_experts",
            if c.kind.cached() { m.cached_pool } else { 0 },
        )
        .with(
            "cache_resident_bytes",
            if c.kind.cached() {
                m.cached_pool as u64 * m.expert_bytes
            } else {
                0
            },
        )
        .with("ops_per_byte", tot.ops / tot.bytes)
        .with("int8_tops", tot.ops / tot.secs / 1e12)
        .with("latency_us", lat.median)
        .with("latency_us_p10", lat.p10)
        .with("latency_us_p90", lat.p90)
        .with("calls", calls)
        .with("threads", threads);
    println!(
        "  {} B={}: {:.3} [{:.3}-{:.3}] of its {} limit over {} repetitions",
        r.name,
        r.batch,
        r.ratio,
        r.extra_f64("ratio_p10").unwrap_or(0.0),
        r.extra_f64("ratio_p90").unwrap_or(0.0),
        bound.name(),
        c.achieved.len()
    );
    Some(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(seconds: f64) -> KernelBenchOptions {
        KernelBenchOptions {
            threads: 1,
            seconds,
            repetitions: 3,
            models: vec![expertmesh_topology::resolve_model("demo-small").unwrap()],
            batches: vec![1, 4],
            prefill_tokens: 8,
            pool_bytes: 0,
            pin: KernelPin::Limit,
            isa: None,
            cache_resident: false,
        }
    }

    /// A call's touched experts run on distinct physical experts whenever the pool holds as
    /// many (so each is read from memory, as counted); with more, a slot is reused only a
    /// whole pool later.
    #[test]
    fn a_calls_experts_run_on_distinct_physical_experts() {
        for seed in 0..50 {
            for (pool, offset) in [(5usize, 3usize), (44, 40), (200, 7)] {
                let mut rng = SplitMix64::new(seed);
                let mut rb = route_uniform(&mut rng, 16, 384, 8, offset, pool);
                let logical: Vec<u32> = rb
                    .grouping
                    .with_groups(0, |g| g.iter().map(|g| g.key.expert).collect());
                assert_eq!(rb.touched, logical.len());
                let slots: Vec<u32> = logical.iter().map(|&e| rb.slot[e as usize]).collect();
                // Consecutive from the offset, in ascending logical order, modulo the pool.
                for (i, &s) in slots.iter().enumerate() {
                    assert_eq!(s as usize, (offset + i) % pool, "pool {pool}");
                }
                let mut distinct = slots.clone();
                distinct.sort_unstable();
                distinct.dedup();
                assert_eq!(distinct.len(), logical.len().min(pool), "pool {pool}");
            }
        }
    }

    #[test]
    fn a_limit_that_moved_during_the_run_is_named() {
        let steady: Vec<f64> = (0..21).map(|i| 31e9 + (i % 5) as f64 * 0.4e9).collect();
        assert_eq!(limit_moved(&steady), None);
        let mut moved = steady.clone();
        moved.extend((0..10).map(|i| 40e9 + i as f64 * 0.1e9));
        let line = limit_moved(&moved).expect("a 31 -> 40 GB/s switch is a move");
        assert!(line.contains("moved"), "{line}");
        assert_eq!(limit_moved(&[]), None);
    }

    #[test]
    fn effort_shrinks_with_the_time_and_never_below_the_cache() {
        let llc = 32 << 20;
        let long = Effort::new(&opts(600.0), llc, None).unwrap();
        assert!(!long.short && !long.memory_limited);
        assert_eq!(long.pool_bytes, long.full_pool_bytes);
        let short = Effort::new(&opts(0.5), llc, None).unwrap();
        assert!(short.short);
        assert!(short.pool_bytes < long.pool_bytes && short.pool_bytes >= 2 * llc);
        assert!(short.probe_bytes >= 4 * llc);
        assert!(short.short_run_line(0.5).is_some());
    }

    /// A Xeon's 480 MiB last-level cache asks for 15 GiB per pool and per probe: on a 24 GiB
    /// machine with three models that was 24 GB resident and the OOM killer. Sized within
    /// the memory available instead, and said so.
    #[test]
    fn effort_fits_the_memory_available_with_a_large_cache() {
        let llc: u64 = 480 << 20;
        let mut o = opts(600.0);
        o.models = ["kimi-k2", "qwen3-30b-a3b", "mixtral-8x7b"]
            .map(|m| expertmesh_topology::resolve_model(m).unwrap())
            .to_vec();
        let gib: u64 = 1 << 30;
        for available in [20 * gib, 8 * gib, 2 * gib] {
            let e = Effort::new(&o, llc, Some(available)).unwrap();
            let held = e.probe_bytes + 3 * e.pool_bytes;
            assert!(
                held as f64 <= MEMORY_SHARE * available as f64,
                "{available}: {e:?}"
            );
            assert!(e.memory_limited, "{e:?}");
            assert!(e.min_pool_bytes <= e.pool_bytes, "{e:?}");
            let line = e.memory_line(llc).expect("a memory-limited run says so");
            assert!(line.contains("memory-limited"), "{line}");
            let s = e.settings(&o);
            assert_eq!(s["memory_limited"], true);
            assert_eq!(s["memory_available_bytes"], available);
        }
        // Ample memory: the sizes the time alone gives.
        let free = Effort::new(&o, llc, Some(1 << 50)).unwrap();
        let timed = Effort::new(&o, llc, None).unwrap();
        assert!(!free.memory_limited, "{free:?}");
        assert_eq!(
            (free.pool_bytes, free.probe_bytes),
            (timed.pool_bytes, timed.probe_bytes)
        );
        // Too little for even the smallest run, or a --pool-mib past the budget: refused
        // before anything is allocated, naming what to change.
        let e = Effort::new(&o, llc, Some(64 << 20)).unwrap_err();
        assert!(e.to_string().contains("free memory"), "{e}");
        o.pool_bytes = 4 * gib;
        let e = Effort::new(&o, llc, Some(8 * gib)).unwrap_err();
        assert!(e.to_string().contains("lower --pool-mib"), "{e}");
    }

    /// What a run guarantees whatever the machine's speed or load (the time budget may or
    /// may not suffice for a case): the first case is measured, every other case is measured
    /// or reported skipped with a reason, and every figure has its interleaved limit.
    #[test]
    fn a_run_measures_the_first_case_and_accounts_for_every_other() {
        let o = opts(4.0);
        let report = run(&o).unwrap();
        let names: Vec<_> = report
            .results
            .iter()
            .map(|r| (r.name.as_str(), r.batch))
            .collect();
        assert!(
            names.contains(&("decode-exact demo-small H1024 F512", 1)),
            "the first case always runs: {names:?}"
        );
        let skipped = report.machine.extra["skipped_cases"].as_array().unwrap();
        for s in skipped {
            assert!(s["why"].as_str().is_some_and(|w| !w.is_empty()), "{s}");
        }
        // Decode 1 and 4, accurate, prefill: each a result or a skip (a skipped pool counts
        // for every case of its model, here the only one, which is never skipped).
        let cases = o.batches.len() + 2;
        assert_eq!(names.len() + skipped.len(), cases, "{names:?} {skipped:?}");
        for r in &report.results {
            let a = r.samples("achieved");
            assert_eq!(a.len(), r.samples("limit").len());
            assert!(!a.is_empty());
            assert!(r.limit > 0.0 && r.achieved > 0.0, "{r:?}");
            let bound = r.extra["bound"].as_str().unwrap();
            assert!(bound == "memory" || bound == "compute");
        }
        let m = &report.machine.extra;
        assert!(m["read_bandwidth_probes"].as_array().unwrap().len() >= 2);
        assert!(m["int8_peak_tops_median"].as_f64().unwrap() > 0.0);
        assert!(m["settings"]["over_time_s"].as_f64().is_some());
    }

    /// A cache-resident call reads the same first `cached_pool` experts every time (the pool's
    /// rotation does not move) and counts the int8 work it does: accurate mode's three levels.
    #[test]
    fn cached_calls_stay_on_the_first_experts_and_count_their_int8_work() {
        let spec = expertmesh_topology::resolve_model("demo-small").unwrap();
        let isa = expertmesh_cpu_backend::kernels::Isa::detect();
        let mut m = ModelBench::load(&spec, 1, None, isa, 64 << 20, 4).unwrap();
        m.cached_pool = 2;
        let offset = m.offset;
        let params = spec.expert_params() as f64;
        for kind in [Kind::DecodeCached(4), Kind::AccurateCached] {
            let c = m.call(kind).unwrap();
            assert_eq!(m.offset, offset, "{kind:?} moved the rotation");
            let pairs = c.ops / (kind.int8_passes() * 2.0 * params);
            let tokens = if kind == Kind::AccurateCached {
                1.0
            } else {
                4.0
            };
            assert_eq!(pairs, tokens * spec.top_k as f64, "{kind:?}");
            assert_eq!(c.bytes, c.touched * m.expert_bytes as f64, "{kind:?}");
        }
        assert_eq!(Kind::AccurateCached.int8_passes(), 3.0);
        // The pool's own decode calls rotate.
        m.call(Kind::Decode(1)).unwrap();
        assert_ne!(m.offset, offset);
    }

    /// `--cache-resident` adds a cached twin of every decode case (each batch, and accurate
    /// mode), each a result or a skip with its reason; a cached row is judged against the int8
    /// peak alone (compute-bound, its limit the peak's bytes) and names how many experts it
    /// reads.
    #[test]
    fn a_cache_resident_run_adds_a_cached_twin_of_every_decode_case() {
        let mut o = opts(6.0);
        o.cache_resident = true;
        o.prefill_tokens = 0;
        let report = run(&o).unwrap();
        let skipped = report.machine.extra["skipped_cases"].as_array().unwrap();
        // Decode 1 and 4 and accurate, then the same three cached.
        assert_eq!(
            report.results.len() + skipped.len(),
            2 * (o.batches.len() + 1),
            "{:?} {skipped:?}",
            report.results.iter().map(|r| &r.name).collect::<Vec<_>>()
        );
        assert_eq!(report.machine.extra["settings"]["cache_resident"], true);
        let ceilings: Vec<_> = report
            .results
            .iter()
            .filter(|r| r.name.starts_with("kernel-ceiling-"))
            .collect();
        for r in &ceilings {
            let kind = r.extra["limit_kind"].as_str().unwrap();
            // The int8 peak, or with AMX kernels (an AMX machine) the higher of it and the
            // AMX contract loop for exact mode.
            assert!(
                kind.contains("int8 peak alone") || kind.contains("AMX contract loop"),
                "{r:?}"
            );
            assert_eq!(r.extra["bound"], "compute", "{r:?}");
            assert!(
                r.extra["cache_resident_experts"].as_u64().unwrap() >= 1,
                "{r:?}"
            );
            assert!(
                r.extra["cache_resident_bytes"].as_u64().unwrap() > 0,
                "{r:?}"
            );
            assert!(r.limit > 0.0 && r.achieved > 0.0, "{r:?}");
        }
        // `decode-*` rows (what `plan --calibrate` reads) never read cache-resident experts.
        for r in report
            .results
            .iter()
            .filter(|r| r.name.starts_with("decode-"))
        {
            assert_eq!(r.extra["cache_resident_experts"], 0, "{r:?}");
        }
        for s in skipped {
            assert!(s["why"].as_str().is_some_and(|w| !w.is_empty()), "{s}");
        }
        // A short run may skip cases, but says so: some ceiling is measured unless every
        // cached case was skipped.
        let cached_skips = skipped
            .iter()
            .filter(|s| s["case"].as_str().is_some_and(|c| c.contains("Cached")))
            .count();
        assert!(
            !ceilings.is_empty() || cached_skips == o.batches.len() + 1,
            "{skipped:?}"
        );
    }
}
