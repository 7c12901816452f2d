//! Memory read bandwidth probe: the "limit" that kernel benchmarks report their ratio against.
//!
//! Why this exists: a kernel's honest figure is weight bytes read per second divided by what
//! the machine can read at all, measured in the same run with the same thread count (shared,
//! noisy machines make absolute numbers meaningless).

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
