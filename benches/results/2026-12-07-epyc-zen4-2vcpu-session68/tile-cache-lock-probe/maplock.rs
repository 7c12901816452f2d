use std::time::Instant;
fn main() {
    let path = std::env::args().nth(1).unwrap();
    for round in 0..4 {
        let f = std::fs::File::open(&path).unwrap();
        let t0 = Instant::now();
        let map = unsafe { memmap2::Mmap::map(&f) }.unwrap();
        let t1 = Instant::now();
        if round % 2 == 0 { map.lock().unwrap(); }
        let t2 = Instant::now();
        let mut x = 0u32;
        for c in map.chunks(1 << 20) { x ^= crc32c::crc32c(c); }
        let t3 = Instant::now();
        println!("{} lock={} map {:.3} ms, lock {:.3} ms, crc {:.3} ms ({:.1} GB/s) {x}", map.len(), round % 2 == 0,
            (t1 - t0).as_secs_f64() * 1e3, (t2 - t1).as_secs_f64() * 1e3, (t3 - t2).as_secs_f64() * 1e3, map.len() as f64 / (t3 - t2).as_secs_f64() / 1e9);
    }
}
