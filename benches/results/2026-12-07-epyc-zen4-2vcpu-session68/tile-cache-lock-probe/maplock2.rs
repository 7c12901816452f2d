use std::time::Instant;
fn lock(p: *const u8, len: usize) { unsafe { assert_eq!(libc_mlock(p, len), 0); } }
extern "C" { #[link_name = "mlock"] fn libc_mlock(addr: *const u8, len: usize) -> i32; }
fn main() {
    let path = std::env::args().nth(1).unwrap();
    for round in 0..8 {
        let f = std::fs::File::open(&path).unwrap();
        let map = unsafe { memmap2::Mmap::map(&f) }.unwrap();
        let t0 = Instant::now();
        let half = (map.len() / 2) & !4095;
        let (a, b) = map.split_at(half);
        let par = round % 2 == 1;
        let (x, y);
        if par {
            let r = std::thread::scope(|s| {
                let h = s.spawn(|| { lock(b.as_ptr(), b.len()); b.chunks(1<<20).fold(0u32, |x, c| x ^ crc32c::crc32c(c)) });
                lock(a.as_ptr(), a.len());
                let x = a.chunks(1<<20).fold(0u32, |x, c| x ^ crc32c::crc32c(c));
                (x, h.join().unwrap())
            });
            x = r.0; y = r.1;
        } else {
            map.lock().unwrap();
            let r = std::thread::scope(|s| {
                let h = s.spawn(|| b.chunks(1<<20).fold(0u32, |x, c| x ^ crc32c::crc32c(c)));
                let x = a.chunks(1<<20).fold(0u32, |x, c| x ^ crc32c::crc32c(c));
                (x, h.join().unwrap())
            });
            x = r.0; y = r.1;
        }
        let t = t0.elapsed().as_secs_f64();
        println!("per-thread lock={par}: {:.3} ms ({:.1} GB/s) {}", t * 1e3, map.len() as f64 / t / 1e9, x ^ y);
    }
}
