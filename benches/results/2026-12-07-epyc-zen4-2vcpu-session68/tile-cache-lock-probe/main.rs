use std::time::Instant;
fn main() {
    for &size in &[1usize << 20, 8 << 20, 21 << 20] {
        let buf: Vec<u8> = (0..size).map(|i| (i * 7 + 3) as u8).collect();
        let mut best = f64::MAX;
        let mut x = 0u32;
        for _ in 0..30 {
            let t = Instant::now();
            for c in buf.chunks(1 << 20) { x ^= crc32c::crc32c(c); }
            best = best.min(t.elapsed().as_secs_f64());
        }
        let mut bs = f64::MAX; let mut s = 0u64;
        for _ in 0..30 {
            let t = Instant::now();
            for c in buf.chunks_exact(8) { s = s.wrapping_add(u64::from_le_bytes(c.try_into().unwrap())); }
            bs = bs.min(t.elapsed().as_secs_f64());
        }
        println!("{} MiB: crc {:.1} GB/s, sum {:.1} GB/s ({x} {s})", size >> 20, size as f64 / best / 1e9, size as f64 / bs / 1e9);
    }
}
