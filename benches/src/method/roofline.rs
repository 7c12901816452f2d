//! The roofline a kernel result is judged against: min(bytes / read bandwidth, ops / compute
//! peak), with the int8 compute peak measured in the same run by a dot-product loop.
//!
//! Why this exists: dividing a compute-bound case (Mixtral at 16 tokens per expert) by memory
//! bandwidth says nothing about how close it is to its real bound (issue 17 read it as 0.28 "of
//! the limit"), and a nominal-clock peak is not what a VM's core delivers. The peak loop runs
//! the same instruction the expert kernels use for their int8 dot products (`vpdpbusd` with
//! AVX-512 VNNI, `vpmaddubsw` + `vpaddw` with AVX2: the kernels' exact-mode inner loop), with
//! enough independent accumulators to reach the instruction's throughput and no memory
//! traffic, on the same number of threads; nothing the kernel does per weight can be cheaper.

use std::time::Instant;

/// Which side of the roofline bounds a case.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bound {
    /// Reading the bytes takes longer than the arithmetic.
    Memory,
    /// The arithmetic takes longer than reading the bytes.
    Compute,
}

impl Bound {
    /// "memory" or "compute", as in the JSON.
    pub fn name(self) -> &'static str {
        match self {
            Bound::Memory => "memory",
            Bound::Compute => "compute",
        }
    }
}

/// The machine's two ceilings, measured in the same run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Roofline {
    /// Read bandwidth, bytes per second.
    pub read_bytes_per_s: f64,
    /// Compute peak, operations per second.
    pub ops_per_s: f64,
}

impl Roofline {
    /// The least time `bytes` read and `ops` operations can take, and which side bounds it.
    pub fn time(&self, bytes: f64, ops: f64) -> (f64, Bound) {
        let mem = if self.read_bytes_per_s > 0.0 {
            bytes / self.read_bytes_per_s
        } else {
            0.0
        };
        let comp = if self.ops_per_s > 0.0 {
            ops / self.ops_per_s
        } else {
            0.0
        };
        if comp > mem {
            (comp, Bound::Compute)
        } else {
            (mem, Bound::Memory)
        }
    }

    /// The roofline as a byte rate for work of `bytes` and `ops`: bytes / [`Roofline::time`] =
    /// min(read bandwidth, compute peak × bytes / ops).
    pub(crate) fn byte_rate(&self, bytes: f64, ops: f64) -> (f64, Bound) {
        let (t, b) = self.time(bytes, ops);
        (if t > 0.0 { bytes / t } else { 0.0 }, b)
    }

    /// The roofline as an operation rate: ops / [`Roofline::time`] = min(compute peak, read
    /// bandwidth × ops / bytes).
    pub(crate) fn op_rate(&self, bytes: f64, ops: f64) -> (f64, Bound) {
        let (t, b) = self.time(bytes, ops);
        (if t > 0.0 { ops / t } else { 0.0 }, b)
    }
}

/// Which instructions the int8 peak loop runs: those of the kernels it is the ceiling of
/// (`bench kernels --isa avx2` on an AVX-512 VNNI CPU is held to the AVX2 peak, not to
/// `vpdpbusd zmm`'s, which its kernels cannot use).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PeakLoop {
    /// `vpdpbusd zmm` (AVX-512 VNNI kernels, and AMX's VNNI paths).
    Vnni512,
    /// `vpmaddubsw` + `vpaddw` ymm (AVX2 kernels).
    Avx2,
    /// Scalar i32 multiply-adds (portable kernels).
    Scalar,
}

impl PeakLoop {
    /// The loop of `isa`'s kernels, or of the best this CPU runs where it lacks them.
    pub(crate) fn of(isa: expertmesh_cpu_backend::kernels::Isa) -> Self {
        use expertmesh_cpu_backend::kernels::Isa;
        let wanted = match isa {
            Isa::Avx512Vnni | Isa::Amx => PeakLoop::Vnni512,
            Isa::Avx2 => PeakLoop::Avx2,
            Isa::Scalar => PeakLoop::Scalar,
        };
        let best = Self::best();
        // A loop this CPU cannot run falls back to the best it can.
        match (wanted, best) {
            (PeakLoop::Vnni512, b) => b,
            (PeakLoop::Avx2, PeakLoop::Scalar) => PeakLoop::Scalar,
            (w, _) => w,
        }
    }

    /// The best loop this CPU runs.
    pub(crate) fn best() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512vnni")
            {
                return PeakLoop::Vnni512;
            }
            if std::arch::is_x86_feature_detected!("avx2") {
                return PeakLoop::Avx2;
            }
        }
        PeakLoop::Scalar
    }

    /// The instruction sequence the loop runs.
    pub(crate) fn basis(self) -> &'static str {
        match self {
            PeakLoop::Vnni512 => {
                "vpdpbusd zmm (64 int8 MACs = 128 ops each), 12 accumulators per thread"
            }
            PeakLoop::Avx2 => {
                "vpmaddubsw + vpaddw ymm (32 int8 MACs = 64 ops per pair), 12 accumulators per thread"
            }
            PeakLoop::Scalar => {
                "scalar i32 multiply-add (1 MAC = 2 ops), 8 accumulators per thread"
            }
        }
    }
}

/// One pass of the int8 peak loop: `iters` iterations on each of `threads` threads (started
/// together, thread `i` pinned to the `i`-th allowed CPU so two threads never share a core
/// while another is idle); returns int8 operations (2 per multiply-accumulate) per second.
pub(crate) fn int8_peak_pass(threads: usize, iters: usize, peak: PeakLoop) -> f64 {
    parallel_pass(threads, &|| {
        let (ops, sink) = dot_loop(std::hint::black_box(iters), peak);
        std::hint::black_box(sink);
        ops
    })
}

/// What the AMX contract loop is (`bench kernels` JSON: `amx_contract_basis`).
pub(crate) const AMX_CONTRACT_BASIS: &str = "per 32-element block of 16 tokens x 16 rows: \
    TILEZERO, TILELOADD A and B from L1, one K=32 TDPBSSD, TILESTORED, then per token the \
    contract's f32 combine (s*d)*f32(isum) added to a partial; two tile sets alternating \
    (expertmesh_cpu_backend::amx::contract_loop)";

/// One pass of the AMX contract loop ([`expertmesh_cpu_backend::amx::contract_loop`]: the
/// most an exact AMX kernel can do under the contract) on `threads` threads as
/// [`int8_peak_pass`] runs its loop; int8 operations per second, or `None` where this process
/// cannot run AMX.
pub(crate) fn amx_contract_pass(threads: usize, iters: usize) -> Option<f64> {
    use expertmesh_cpu_backend::amx;
    amx::tiles::amx_available().ok()?;
    Some(parallel_pass(threads, &|| {
        let (blocks, sink) = amx::contract_loop(std::hint::black_box(iters)).unwrap_or((0, 0.0));
        std::hint::black_box(sink);
        blocks as f64 * amx::CONTRACT_LOOP_OPS as f64
    }))
}

/// Runs `work` (returning the operations it did) on `threads` threads, started together and
/// pinned as [`int8_peak_pass`] says; operations per second over the span of all of them.
fn parallel_pass(threads: usize, work: &(dyn Fn() -> f64 + Sync)) -> f64 {
    use expertmesh_cpu_backend::membw::{Placement, pin_to};
    let threads = threads.max(1);
    let cpus = Placement::Compact.cpus(threads);
    let ready = std::sync::Barrier::new(threads);
    let runs: Vec<Option<(std::time::Instant, std::time::Instant, f64)>> =
        std::thread::scope(|s| {
            let hs: Vec<_> = (0..threads)
                .map(|i| {
                    let ready = &ready;
                    let cpu = cpus.as_ref().map(|c| c[i]);
                    s.spawn(move || {
                        if let Some(cpu) = cpu {
                            pin_to(cpu);
                        }
                        ready.wait();
                        let t0 = Instant::now();
                        let ops = work();
                        (t0, Instant::now(), ops)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().ok()).collect()
        });
    let spans: Vec<_> = runs.iter().map(|r| r.map(|(a, b, _)| (a, b))).collect();
    let ops: f64 = runs.iter().flatten().map(|r| r.2).sum();
    expertmesh_cpu_backend::membw::span_secs(&spans).map_or(0.0, |secs| ops / secs)
}

/// Iterations of [`amx_contract_pass`] that take about `secs` on one thread here (from a
/// short calibration pass); `None` without AMX.
pub(crate) fn amx_iters_for(secs: f64) -> Option<usize> {
    use expertmesh_cpu_backend::amx;
    let probe = 20_000;
    let t = Instant::now();
    std::hint::black_box(amx::contract_loop(probe).ok()?);
    let per = t.elapsed().as_secs_f64() / probe as f64;
    Some(((secs / per.max(1e-12)) as usize).clamp(1_000, 100_000_000))
}

/// Iterations of [`int8_peak_pass`] that take about `secs` on one thread here (from a short
/// calibration pass).
pub(crate) fn iters_for(secs: f64, peak: PeakLoop) -> usize {
    let probe = 20_000;
    let t = Instant::now();
    std::hint::black_box(dot_loop(probe, peak));
    let per = t.elapsed().as_secs_f64() / probe as f64;
    ((secs / per.max(1e-12)) as usize).clamp(1_000, 100_000_000)
}

/// Runs the peak loop `peak` (one this CPU runs: [`PeakLoop::of`]); returns (int8 ops done,
/// a value the optimizer must keep).
fn dot_loop(iters: usize, peak: PeakLoop) -> (f64, u64) {
    #[cfg(target_arch = "x86_64")]
    {
        if peak == PeakLoop::Vnni512
            && std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512vnni")
        {
            // SAFETY: the features were checked above.
            let sink = unsafe { x86::vnni(iters) };
            return (iters as f64 * 12.0 * 128.0, sink);
        }
        if peak != PeakLoop::Scalar && std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the feature was checked above.
            let sink = unsafe { x86::avx2(iters) };
            return (iters as f64 * 12.0 * 64.0, sink);
        }
    }
    let mut acc = [1i32; 8];
    let w = std::hint::black_box(3i32);
    for _ in 0..iters {
        for a in acc.iter_mut() {
            *a = a.wrapping_mul(w).wrapping_add(7);
        }
    }
    (
        iters as f64 * 8.0 * 2.0,
        acc.iter().fold(0u64, |s, &a| s ^ a as u64),
    )
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// 12 independent `vpmaddubsw` + `vpaddw` chains.
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn avx2(iters: usize) -> u64 {
        let q = _mm256_set1_epi8(std::hint::black_box(3));
        let mut acc = [_mm256_set1_epi8(std::hint::black_box(0x35)); 12];
        for _ in 0..iters {
            for a in acc.iter_mut() {
                // The product depends on the accumulator, so it cannot be hoisted.
                *a = _mm256_add_epi16(*a, _mm256_maddubs_epi16(*a, q));
            }
        }
        let mut x = acc[0];
        for a in &acc[1..] {
            x = _mm256_xor_si256(x, *a);
        }
        _mm256_extract_epi64(x, 0) as u64
    }

    /// 12 independent `vpdpbusd` chains.
    ///
    /// # Safety
    /// The CPU must support AVX-512 F and VNNI.
    #[target_feature(enable = "avx512f,avx512vnni")]
    pub(super) unsafe fn vnni(iters: usize) -> u64 {
        let q = _mm512_set1_epi8(std::hint::black_box(3));
        let mut acc = [_mm512_set1_epi8(std::hint::black_box(0x35)); 12];
        for _ in 0..iters {
            for a in acc.iter_mut() {
                *a = _mm512_dpbusd_epi32(*a, *a, q);
            }
        }
        let mut x = acc[0];
        for a in &acc[1..] {
            x = _mm512_xor_si512(x, *a);
        }
        _mm512_reduce_add_epi64(x) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roofline_takes_the_slower_side() {
        let r = Roofline {
            read_bytes_per_s: 10.0,
            ops_per_s: 100.0,
        };
        // 50 bytes (5 s) and 200 ops (2 s): memory-bound at the read bandwidth.
        assert_eq!(r.time(50.0, 200.0), (5.0, Bound::Memory));
        assert_eq!(r.byte_rate(50.0, 200.0), (10.0, Bound::Memory));
        // 50 bytes (5 s) and 1000 ops (10 s): compute-bound; as a byte rate 5/s, as an
        // operation rate the peak.
        assert_eq!(r.time(50.0, 1000.0), (10.0, Bound::Compute));
        assert_eq!(r.byte_rate(50.0, 1000.0), (5.0, Bound::Compute));
        assert_eq!(r.op_rate(50.0, 1000.0), (100.0, Bound::Compute));
        // Brute force: the rate never exceeds either ceiling and meets one of them.
        for bytes in [1.0, 7.0, 50.0, 300.0] {
            for ops in [1.0, 70.0, 500.0, 3000.0] {
                let (rate, _) = r.op_rate(bytes, ops);
                let ceilings = [r.ops_per_s, r.read_bytes_per_s * ops / bytes];
                assert!(ceilings.iter().all(|&c| rate <= c + 1e-9));
                assert!(ceilings.iter().any(|&c| (rate - c).abs() < 1e-9));
            }
        }
    }

    #[test]
    fn peak_pass_counts_operations() {
        let best = PeakLoop::best();
        let ops = int8_peak_pass(2, iters_for(0.001, best), best);
        assert!(ops.is_finite() && ops > 1e6, "{ops}");
    }

    /// The peak loop is the kernels' ISA's where this CPU runs it: AVX2 kernels on an AVX-512
    /// VNNI CPU are held to the AVX2 loop; the scalar kernels to the scalar one; a loop the CPU
    /// lacks falls back to its best.
    #[test]
    fn the_peak_loop_follows_the_kernels_isa() {
        use expertmesh_cpu_backend::kernels::Isa;
        assert_eq!(PeakLoop::of(Isa::Scalar), PeakLoop::Scalar);
        let best = PeakLoop::best();
        assert_eq!(PeakLoop::of(Isa::Avx512Vnni), best);
        let avx2 = PeakLoop::of(Isa::Avx2);
        assert_eq!(
            avx2,
            if best == PeakLoop::Scalar {
                PeakLoop::Scalar
            } else {
                PeakLoop::Avx2
            }
        );
        assert!(avx2.basis() != PeakLoop::Vnni512.basis() || best == PeakLoop::Scalar);
    }
}
