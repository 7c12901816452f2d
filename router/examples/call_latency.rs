//! Latency of 1-token layer calls against a running router (`expertmesh up` or `router`), from
//! one frontend, optionally with a second frontend connected and idle; and the raw loopback
//! TCP round trip of the same machine, for the ratio. Used to compare fabric builds on the same
//! machine in the same session (BENCHMARKS.md, "Scale-out: wire and latency"):
//!
//! ```sh
//! cargo run --release -p expertmesh-router --example call_latency -- ADDR CLUSTER HIDDEN LAYER SECONDS [idle]
//! ```

use expertmesh_router::client::RouterClient;
use expertmesh_transport::frontend::FrontendConfig;
use std::io::{Read, Write};
use std::time::{Duration, Instant};

fn percentile(sorted: &[f64], p: f64) -> f64 {
    // Nearest rank, the benches' definition (benches::method::stats::percentile; this example
    // cannot depend on the benches crate, which depends on the router).
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Raw blocking loopback TCP round trips of `msg` bytes out, 64 back, in µs (sorted).
fn raw_tcp_us(msg: usize, trips: usize) -> Vec<f64> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let server = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        s.set_nodelay(true).unwrap();
        let mut buf = vec![0u8; msg];
        for _ in 0..trips + 10 {
            s.read_exact(&mut buf).unwrap();
            s.write_all(&buf[..64]).unwrap();
        }
    });
    let mut c = std::net::TcpStream::connect(addr).unwrap();
    c.set_nodelay(true).unwrap();
    let (out, mut back) = (vec![7u8; msg], [0u8; 64]);
    let mut lat = Vec::new();
    for i in 0..trips + 10 {
        let t = Instant::now();
        c.write_all(&out).unwrap();
        c.read_exact(&mut back).unwrap();
        if i >= 10 {
            lat.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    server.join().unwrap();
    lat.sort_by(f64::total_cmp);
    lat
}

fn main() {
    let a: Vec<String> = std::env::args().collect();
    if a.len() < 6 {
        eprintln!("usage: call_latency ADDR CLUSTER HIDDEN LAYER SECONDS [idle]");
        std::process::exit(2);
    }
    let addr = a[1].parse().expect("ADDR");
    let cfg = FrontendConfig::new(a[2].clone());
    let h: usize = a[3].parse().expect("HIDDEN");
    let layer: u32 = a[4].parse().expect("LAYER");
    let secs: f64 = a[5].parse().expect("SECONDS");
    let idle = a.get(6).is_some_and(|s| s == "idle");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let x: Vec<f32> = (0..h)
        .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
        .collect();
    let mut lat = rt.block_on(async {
        let mut c = RouterClient::connect(addr, &cfg).await.unwrap();
        let _other = if idle {
            let o = RouterClient::connect(addr, &cfg).await.unwrap();
            tokio::time::sleep(Duration::from_millis(200)).await;
            Some(o)
        } else {
            None
        };
        for _ in 0..20 {
            c.call(layer, &x, h, None, None).await.unwrap();
        }
        let mut lat = Vec::new();
        let t0 = Instant::now();
        while t0.elapsed().as_secs_f64() < secs {
            let t = Instant::now();
            c.call(layer, &x, h, None, None).await.unwrap();
            lat.push(t.elapsed().as_secs_f64() * 1e6);
        }
        lat
    });
    lat.sort_by(f64::total_cmp);
    let raw = raw_tcp_us(h + h / 8 + 192, 2000);
    println!(
        "calls {} p50 {:.0} us p99 {:.0} us; raw tcp rtt p50 {:.1} us p99 {:.1} us{}",
        lat.len(),
        percentile(&lat, 50.0),
        percentile(&lat, 99.0),
        percentile(&raw, 50.0),
        percentile(&raw, 99.0),
        if idle { " (second frontend idle)" } else { "" }
    );
}
