//! Memory read bandwidth probes: the "limit" that kernel benchmarks report their ratio against.
//!
//! Why this exists: a kernel's honest figure is weight bytes read per second divided by what
//! the machine can read at all, measured in the same run (shared, noisy machines make absolute
//! numbers meaningless). A limit must be a limit: one plain read loop is not what the machine
//! can read (a kernel with software prefetch beat it by 2-40% on two machines), so
//! [`probe_configs`] lists several read kernels ([`ReadKernel`]: plain, software-prefetched
//! into L1 or into L2, several interleaved streams, streaming loads, 512-bit loads and
//! streaming loads where AVX-512 exists), thread counts, thread placements ([`Placement`]) and buffer sizes, and a
//! bench takes the best of them ([`read_pass`] measures one pass of one configuration).

use std::time::Instant;

/// Read `buf` once per pass with `threads` threads, `passes` times; returns every pass's
/// bandwidth in bytes per second (callers take the median or the best).
pub fn read_bandwidth_samples(buf: &[u8], threads: usize, passes: usize) -> Vec<f64> {
    let threads = threads.max(1);
    let chunk = buf.len() / threads / 64 * 64;
    let mut out = Vec::with_capacity(passes);
    for _ in 0..passes.max(1) {
        let t0 = Instant::now();
        std::thread::scope(|s| {
            for i in 0..threads {
                let part = &buf[i * chunk..(i + 1) * chunk];
                s.spawn(move || std::hint::black_box(xor_reduce(part)));
            }
        });
        let dt = t0.elapsed().as_secs_f64();
        out.push((chunk * threads) as f64 / dt);
    }
    out
}

/// The best of `passes` passes (see [`read_bandwidth_samples`]).
pub fn read_bandwidth(buf: &[u8], threads: usize, passes: usize) -> f64 {
    read_bandwidth_samples(buf, threads, passes)
        .into_iter()
        .fold(0.0, f64::max)
}

/// The median of a sample (0 for none).
pub fn median(samples: &[f64]) -> f64 {
    let mut s = samples.to_vec();
    s.sort_by(f64::total_cmp);
    match s.len() {
        0 => 0.0,
        n if n % 2 == 1 => s[n / 2],
        n => 0.5 * (s[n / 2 - 1] + s[n / 2]),
    }
}

fn xor_reduce(part: &[u8]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 is available (checked above).
        return unsafe { xor_reduce_avx2(part) };
    }
    part.chunks_exact(8).fold(0u64, |a, c| {
        a ^ u64::from_le_bytes(c.try_into().unwrap_or_default())
    })
}

/// [`xor_reduce`] on AVX2: XOR of the whole 128-byte chunks of `part` (a tail is ignored).
///
/// # Safety
/// The CPU must support AVX2. `part` may have any length and alignment.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn xor_reduce_avx2(part: &[u8]) -> u64 {
    use std::arch::x86_64::*;
    let mut a = [_mm256_setzero_si256(); 4];
    let n = part.len() / 128;
    let p = part.as_ptr();
    for i in 0..n {
        for (j, aj) in a.iter_mut().enumerate() {
            // SAFETY: i*128 + j*32 + 32 <= n*128 <= part.len().
            *aj = _mm256_xor_si256(*aj, unsafe {
                _mm256_loadu_si256(p.add(i * 128 + j * 32).cast())
            });
        }
    }
    let x = _mm256_xor_si256(_mm256_xor_si256(a[0], a[1]), _mm256_xor_si256(a[2], a[3]));
    (_mm256_extract_epi64(x, 0)
        ^ _mm256_extract_epi64(x, 1)
        ^ _mm256_extract_epi64(x, 2)
        ^ _mm256_extract_epi64(x, 3)) as u64
}

/// Size of the last-level cache in bytes, from sysfs (0 when unknown).
pub fn last_level_cache_bytes() -> u64 {
    let mut best = 0;
    for idx in 0..8 {
        let base = format!("/sys/devices/system/cpu/cpu0/cache/index{idx}");
        let Ok(size) = std::fs::read_to_string(format!("{base}/size")) else {
            continue;
        };
        let size = size.trim();
        let (num, mult) = match size.strip_suffix('K') {
            Some(n) => (n, 1024),
            None => match size.strip_suffix('M') {
                Some(n) => (n, 1024 * 1024),
                None => (size, 1),
            },
        };
        if let Ok(v) = num.parse::<u64>() {
            best = best.max(v * mult);
        }
    }
    best
}

/// One read loop of the bandwidth probe (every one XOR-reduces the bytes it reads so the
/// loads cannot be dropped).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReadKernel {
    /// 256-bit loads (64-bit words without AVX2), one stream per thread.
    Plain,
    /// [`ReadKernel::Plain`] plus `prefetcht0` 4 KiB ahead.
    Prefetch,
    /// Four interleaved streams per thread (each a quarter of its part), prefetched
    /// (`prefetcht0`).
    MultiStream,
    /// `vmovntdqa` 256-bit streaming loads.
    StreamLoad,
    /// 512-bit loads plus `prefetcht0` 4 KiB ahead (AVX-512 F only).
    Avx512,
    /// `vmovntdqa` 512-bit streaming loads (AVX-512 F only).
    Avx512Stream,
    /// [`ReadKernel::MultiStream`] prefetching into L2 only (`prefetcht1`): what the expert
    /// kernels do. An L1 prefetch holds one of the core's few L1 miss buffers for the whole
    /// trip to DRAM; an L2 prefetch is tracked by the L2's larger queue, so more lines are in
    /// flight (on the EPYC Zen 4 VM: 44–48 GB/s against 30 for this kernel with `prefetcht0`).
    MultiStreamL2,
    /// [`ReadKernel::Avx512`] prefetching into L2 only (`prefetcht1`; AVX-512 F only).
    Avx512L2,
}

impl ReadKernel {
    /// Every kernel, in a fixed order.
    pub const ALL: [ReadKernel; 8] = [
        ReadKernel::Plain,
        ReadKernel::Prefetch,
        ReadKernel::MultiStream,
        ReadKernel::StreamLoad,
        ReadKernel::Avx512,
        ReadKernel::Avx512Stream,
        ReadKernel::MultiStreamL2,
        ReadKernel::Avx512L2,
    ];

    /// The kernel's name in reports.
    pub fn name(self) -> &'static str {
        match self {
            ReadKernel::Plain => "plain",
            ReadKernel::Prefetch => "prefetch",
            ReadKernel::MultiStream => "4-stream-prefetch",
            ReadKernel::StreamLoad => "stream-load",
            ReadKernel::Avx512 => "avx512-prefetch",
            ReadKernel::Avx512Stream => "avx512-stream-load",
            ReadKernel::MultiStreamL2 => "4-stream-prefetch-l2",
            ReadKernel::Avx512L2 => "avx512-prefetch-l2",
        }
    }

    /// Whether this CPU can run the kernel as named (others fall back to plain reads, so a
    /// probe list leaves them out).
    pub fn available(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            match self {
                ReadKernel::Plain => true,
                ReadKernel::Avx512 | ReadKernel::Avx512Stream | ReadKernel::Avx512L2 => {
                    std::arch::is_x86_feature_detected!("avx512f")
                }
                _ => std::arch::is_x86_feature_detected!("avx2"),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            self == ReadKernel::Plain
        }
    }
}

/// Where a probe's threads run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Placement {
    /// Wherever the OS schedules them.
    Unpinned,
    /// Thread `i` pinned to the `i`-th CPU the process may use.
    Compact,
    /// Threads pinned evenly across the CPUs the process may use (thread `i` on the
    /// `i * cpus / threads`-th one: other cores or sockets before SMT siblings when the CPU
    /// numbering puts siblings last, as Linux does).
    Spread,
}

impl Placement {
    /// The placement's name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Placement::Unpinned => "unpinned",
            Placement::Compact => "compact",
            Placement::Spread => "spread",
        }
    }

    /// The CPU each of `threads` threads is pinned to (`None`: unpinned, or pinning is not
    /// supported here).
    pub fn cpus(self, threads: usize) -> Option<Vec<usize>> {
        let allowed = allowed_cpus();
        if self == Placement::Unpinned || allowed.is_empty() {
            return None;
        }
        let n = allowed.len();
        Some(
            (0..threads)
                .map(|i| match self {
                    Placement::Spread => allowed[(i * n / threads.max(1)) % n],
                    _ => allowed[i % n],
                })
                .collect(),
        )
    }
}

/// One probe configuration: a read kernel, a thread count, a placement and a buffer size.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ProbeConfig {
    /// The read loop.
    pub kernel: ReadKernel,
    /// Reading threads (each reads its own contiguous part).
    pub threads: usize,
    /// Where they run.
    pub placement: Placement,
    /// Bytes read per pass.
    pub bytes: usize,
}

impl ProbeConfig {
    /// A short name: `prefetch 2t compact 512MiB`.
    pub fn name(&self) -> String {
        format!(
            "{} {}t {} {}MiB",
            self.kernel.name(),
            self.threads,
            self.placement.name(),
            self.bytes >> 20
        )
    }
}

/// Every probe configuration worth trying with up to `max_threads` threads over buffers of
/// `sizes` bytes: each available kernel, 1 and `max_threads` threads, unpinned and pinned
/// (placements that pin the same CPUs are listed once).
pub fn probe_configs(max_threads: usize, sizes: &[usize]) -> Vec<ProbeConfig> {
    let mut thread_counts = vec![1, max_threads.max(1)];
    thread_counts.dedup();
    let mut out = Vec::new();
    for &bytes in sizes {
        for kernel in ReadKernel::ALL.into_iter().filter(|k| k.available()) {
            for &threads in &thread_counts {
                let mut pinned_sets = Vec::new();
                for placement in [Placement::Unpinned, Placement::Compact, Placement::Spread] {
                    let cpus = placement.cpus(threads);
                    if placement != Placement::Unpinned {
                        if cpus.is_none() || pinned_sets.contains(&cpus) {
                            continue;
                        }
                        pinned_sets.push(cpus);
                    }
                    out.push(ProbeConfig {
                        kernel,
                        threads,
                        placement,
                        bytes,
                    });
                }
            }
        }
    }
    out
}

/// One pass of `cfg` over the first `cfg.bytes` of `buf` (all of it when shorter): bytes read
/// per second, from the first thread's start to the last one's end, each timed by the thread
/// itself (the spawning thread may not be scheduled while the readers run).
pub fn read_pass(buf: &[u8], cfg: &ProbeConfig) -> f64 {
    let threads = cfg.threads.max(1);
    let len = cfg.bytes.min(buf.len());
    let chunk = len / threads / 512 * 512;
    if chunk == 0 {
        return 0.0;
    }
    let cpus = cfg.placement.cpus(threads);
    let ready = std::sync::Barrier::new(threads);
    let spans: Vec<Option<(Instant, Instant)>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..threads)
            .map(|i| {
                let part = &buf[i * chunk..(i + 1) * chunk];
                let cpu = cpus.as_ref().map(|c| c[i]);
                let ready = &ready;
                s.spawn(move || {
                    if let Some(cpu) = cpu {
                        pin_to(cpu);
                    }
                    ready.wait();
                    let t0 = Instant::now();
                    std::hint::black_box(read_with(cfg.kernel, part));
                    (t0, Instant::now())
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().ok()).collect()
    });
    match span_secs(&spans) {
        Some(secs) => (chunk * threads) as f64 / secs,
        None => 0.0,
    }
}

/// Seconds from the earliest start to the latest end of per-thread `(start, end)` spans
/// (none when a thread failed or no time passed).
pub fn span_secs(spans: &[Option<(Instant, Instant)>]) -> Option<f64> {
    let mut first: Option<Instant> = None;
    let mut last: Option<Instant> = None;
    for s in spans {
        let (a, b) = (*s)?;
        first = Some(first.map_or(a, |f| f.min(a)));
        last = Some(last.map_or(b, |l| l.max(b)));
    }
    let secs = (last? - first?).as_secs_f64();
    (secs > 0.0).then_some(secs)
}

/// XOR-reduce `part` with `kernel` (plain reads where the kernel is not available).
pub fn read_with(kernel: ReadKernel, part: &[u8]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if kernel.available() {
        // SAFETY: each kernel's CPU feature was checked by `available`.
        unsafe {
            match kernel {
                ReadKernel::Plain => return xor_reduce(part),
                ReadKernel::Prefetch => return x86::prefetched(part),
                ReadKernel::MultiStream => return x86::multi_stream::<{ x86::L1 }>(part),
                ReadKernel::StreamLoad => return x86::stream_load(part),
                ReadKernel::Avx512 => return x86::avx512::<{ x86::L1 }>(part),
                ReadKernel::Avx512Stream => return x86::avx512_stream(part),
                ReadKernel::MultiStreamL2 => return x86::multi_stream::<{ x86::L2 }>(part),
                ReadKernel::Avx512L2 => return x86::avx512::<{ x86::L2 }>(part),
            }
        }
    }
    xor_reduce(part)
}

/// The CPUs this process may run on (empty when unknown).
pub fn allowed_cpus() -> Vec<usize> {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: a zeroed cpu_set_t is valid; sched_getaffinity writes at most its size.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
                return Vec::new();
            }
            (0..libc::CPU_SETSIZE as usize)
                .filter(|&c| libc::CPU_ISSET(c, &set))
                .collect()
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        Vec::new()
    }
}

/// Pin the calling thread to `cpu` (best effort: a refusal leaves it unpinned).
pub fn pin_to(cpu: usize) {
    #[cfg(target_os = "linux")]
    // SAFETY: a zeroed cpu_set_t is valid; CPU_SET stays inside it for cpu < CPU_SETSIZE.
    unsafe {
        if cpu < libc::CPU_SETSIZE as usize {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(cpu, &mut set);
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = cpu;
}

/// The x86 read loops of [`ReadKernel`]; each reads the whole 512-byte chunks of its part.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// Prefetch distance in bytes (the expert kernels prefetch 4 KiB ahead).
    const AHEAD: usize = 4096;
    /// Prefetch hint: into L1 (`prefetcht0`).
    pub(super) const L1: i32 = _MM_HINT_T0;
    /// Prefetch hint: into L2 only (`prefetcht1`).
    pub(super) const L2: i32 = _MM_HINT_T1;

    #[inline(always)]
    fn fold(x: __m256i) -> u64 {
        // SAFETY: only reached from functions compiled with AVX2 enabled.
        unsafe {
            (_mm256_extract_epi64(x, 0)
                ^ _mm256_extract_epi64(x, 1)
                ^ _mm256_extract_epi64(x, 2)
                ^ _mm256_extract_epi64(x, 3)) as u64
        }
    }

    /// Plain 256-bit loads with `prefetcht0` [`AHEAD`] bytes ahead.
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn prefetched(part: &[u8]) -> u64 {
        let p = part.as_ptr();
        let mut a = [_mm256_setzero_si256(); 4];
        for i in 0..part.len() / 128 {
            let at = p.wrapping_add(i * 128 + AHEAD);
            // SAFETY: prefetches are hints and never fault; loads stay inside `part`.
            unsafe {
                _mm_prefetch::<_MM_HINT_T0>(at.cast());
                _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(64).cast());
                for (j, aj) in a.iter_mut().enumerate() {
                    *aj = _mm256_xor_si256(*aj, _mm256_loadu_si256(p.add(i * 128 + j * 32).cast()));
                }
            }
        }
        fold(_mm256_xor_si256(
            _mm256_xor_si256(a[0], a[1]),
            _mm256_xor_si256(a[2], a[3]),
        ))
    }

    /// Four streams (the quarters of `part`) read in turn, 128 bytes each, prefetched with
    /// hint `HINT` (`_MM_HINT_T0`: into L1; `_MM_HINT_T1`: into L2).
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn multi_stream<const HINT: i32>(part: &[u8]) -> u64 {
        let q = part.len() / 4 / 128 * 128;
        let p = part.as_ptr();
        let mut a = [_mm256_setzero_si256(); 4];
        for i in 0..q / 128 {
            for s in 0..4 {
                let base = s * q + i * 128;
                // SAFETY: prefetches never fault; base + 128 <= 4q <= part.len().
                unsafe {
                    let at = p.wrapping_add(base + AHEAD);
                    _mm_prefetch::<HINT>(at.cast());
                    _mm_prefetch::<HINT>(at.wrapping_add(64).cast());
                    for (j, aj) in a.iter_mut().enumerate() {
                        *aj =
                            _mm256_xor_si256(*aj, _mm256_loadu_si256(p.add(base + j * 32).cast()));
                    }
                }
            }
        }
        fold(_mm256_xor_si256(
            _mm256_xor_si256(a[0], a[1]),
            _mm256_xor_si256(a[2], a[3]),
        ))
    }

    /// `vmovntdqa` loads (need 32-byte alignment: the unaligned head is skipped).
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn stream_load(part: &[u8]) -> u64 {
        let skip = part.as_ptr().align_offset(32).min(part.len());
        let body = &part[skip..];
        let p = body.as_ptr();
        let mut a = [_mm256_setzero_si256(); 4];
        for i in 0..body.len() / 128 {
            for (j, aj) in a.iter_mut().enumerate() {
                // SAFETY: p is 32-byte aligned and the load stays inside `body`.
                *aj = _mm256_xor_si256(*aj, unsafe {
                    _mm256_stream_load_si256(p.add(i * 128 + j * 32).cast())
                });
            }
        }
        fold(_mm256_xor_si256(
            _mm256_xor_si256(a[0], a[1]),
            _mm256_xor_si256(a[2], a[3]),
        ))
    }

    /// 512-bit loads with a prefetch of hint `HINT` [`AHEAD`] bytes ahead.
    ///
    /// # Safety
    /// The CPU must support AVX-512 F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn avx512<const HINT: i32>(part: &[u8]) -> u64 {
        let p = part.as_ptr();
        let mut a = [_mm512_setzero_si512(); 4];
        for i in 0..part.len() / 256 {
            // SAFETY: prefetches never fault; loads stay inside `part`.
            unsafe {
                let at = p.wrapping_add(i * 256 + AHEAD);
                for l in 0..4 {
                    _mm_prefetch::<HINT>(at.wrapping_add(64 * l).cast());
                }
                for (j, aj) in a.iter_mut().enumerate() {
                    *aj = _mm512_xor_si512(*aj, _mm512_loadu_si512(p.add(i * 256 + j * 64).cast()));
                }
            }
        }
        fold512(_mm512_xor_si512(
            _mm512_xor_si512(a[0], a[1]),
            _mm512_xor_si512(a[2], a[3]),
        ))
    }

    /// `vmovntdqa` 512-bit loads (need 64-byte alignment: the unaligned head is skipped).
    ///
    /// # Safety
    /// The CPU must support AVX-512 F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn avx512_stream(part: &[u8]) -> u64 {
        let skip = part.as_ptr().align_offset(64).min(part.len());
        let body = &part[skip..];
        let p = body.as_ptr();
        let mut a = [_mm512_setzero_si512(); 4];
        for i in 0..body.len() / 256 {
            for (j, aj) in a.iter_mut().enumerate() {
                // SAFETY: p is 64-byte aligned and the load stays inside `body`.
                *aj = _mm512_xor_si512(*aj, unsafe {
                    _mm512_stream_load_si512(p.add(i * 256 + j * 64).cast())
                });
            }
        }
        fold512(_mm512_xor_si512(
            _mm512_xor_si512(a[0], a[1]),
            _mm512_xor_si512(a[2], a[3]),
        ))
    }

    /// XOR of the eight 64-bit lanes.
    #[target_feature(enable = "avx512f")]
    fn fold512(x: __m512i) -> u64 {
        fold(_mm256_xor_si256(
            _mm512_extracti64x4_epi64::<0>(x),
            _mm512_extracti64x4_epi64::<1>(x),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_read_kernel_reduces_the_same_bytes_alike() {
        // XOR of 64-bit words is order-independent; a kernel that skipped or repeated data
        // would differ from the plain one on this pattern. (Streaming loads skip an unaligned
        // head: the buffer is read from an aligned offset.)
        let mut buf = vec![0u8; 1 << 16];
        for (i, b) in buf.iter_mut().enumerate() {
            *b = (i * 31 % 251) as u8;
        }
        let at = buf.as_ptr().align_offset(64);
        let part = &buf[at..at + (32 << 10)];
        let plain = read_with(ReadKernel::Plain, part);
        let mut skipped = Vec::new();
        for k in ReadKernel::ALL {
            if k.available() {
                assert_eq!(read_with(k, part), plain, "{k:?}");
            } else {
                skipped.push(k);
            }
        }
        if !skipped.is_empty() {
            // On the real stderr (the harness captures `print!` of passing tests).
            use std::io::Write as _;
            let _ = writeln!(
                std::io::stderr(),
                "skipped: read kernels {skipped:?} (this CPU lacks their instructions)"
            );
        }
    }

    #[test]
    fn probe_configs_cover_kernels_threads_and_sizes() {
        let c = probe_configs(2, &[1 << 20, 2 << 20]);
        assert!(c.iter().any(|p| p.threads == 1) && c.iter().any(|p| p.threads == 2));
        assert!(c.iter().any(|p| p.bytes == 2 << 20));
        assert!(c.iter().any(|p| p.placement == Placement::Unpinned));
        let mut names: Vec<_> = c.iter().map(ProbeConfig::name).collect();
        let n = names.len();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), n, "no configuration twice");
        let buf = vec![1u8; 2 << 20];
        for p in &c {
            let bw = read_pass(&buf, p);
            assert!(bw > 0.0 && bw.is_finite(), "{}: {bw}", p.name());
        }
    }
}

#[cfg(test)]
mod size_scan {
    use super::*;

    /// Prints the best kernel's bandwidth by buffer size (run by hand: finds the real cache
    /// size of a VM that reports a smaller one).
    #[test]
    #[ignore]
    fn scan_sizes() {
        let buf = vec![1u8; 2048 << 20];
        for mib in [16usize, 32, 64, 96, 128, 192, 256, 512, 1024, 2048] {
            for k in [ReadKernel::Plain, ReadKernel::Prefetch] {
                let cfg = ProbeConfig {
                    kernel: k,
                    threads: 2,
                    placement: Placement::Unpinned,
                    bytes: mib << 20,
                };
                let mut s: Vec<f64> = (0..5).map(|_| read_pass(&buf, &cfg) / 1e9).collect();
                s.sort_by(f64::total_cmp);
                println!(
                    "{mib:>5} MiB {:>10}: median {:.1} GB/s  all {s:.1?}",
                    k.name(),
                    s[2]
                );
            }
        }
    }
}
