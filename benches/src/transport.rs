//! `expertmesh bench transport`: dispatch-frame throughput and round-trip latency over TCP
//! loopback and shared memory, each against a limit measured in the same run.
//!
//! Why this exists: the transport's cost must be known relative to what the machine can do at
//! all, not as an absolute number that changes with every host. Limits:
//! - TCP throughput: a raw loopback stream (same message size) on a connection kept for the
//!   whole run, as the mesh's link is (a fresh one starts with small windows and the mesh beat
//!   it). A sweep at the start picks, per frame size, the best of five ways ([`RawWay`]:
//!   blocking or tokio sockets, kept or fresh connection, one or eight frames per write: the
//!   mesh coalesces frames); each repetition takes the best of two passes of it and one of the
//!   other socket kind;
//! - TCP round trip: raw ping-pong on kept connections (same message out, 64-byte answer back),
//!   per percentile the lower of blocking and tokio sockets;
//! - shared-memory throughput: single-thread `memcpy` bandwidth for the frame size, the better
//!   of a ring as large as the shm ring and a cache-warm ring of two frames;
//! - shared-memory round trip: two threads passing the frame through a shared buffer with an
//!   atomic flag (one memcpy in, the peer reads the first 64 bytes; hand-offs that spin briefly,
//!   then yield the CPU; no protocol, no framing). A pure spin is not a limit on a machine with fewer free cores than spinning
//!   threads: a waiter whose peer is descheduled burns its whole time slice, and the "limit"
//!   read milliseconds where the mesh took microseconds.
//!
//! The cost of encryption: with TCP among the links, a second TCP pair runs with issued
//! credentials (every frame sealed with AES-256-GCM, see `expertmesh_transport::crypto`);
//! `tcp_encrypted_dispatch_throughput` and `tcp_encrypted_dispatch_rtt_p50` take the plain TCP
//! mesh as their limit, measured interleaved with it in the same repetitions (order alternating),
//! so their ratio is encrypted / plain (target: at least 0.7 of plain throughput at 64 tokens).
//!
//! Every result says which way its ratio is good (`better`: throughput `higher`, round trip
//! `lower`), in the JSON and in the table's last column.
//!
//! Statistics ([`crate::method::stats`]): each figure is the median of `--repeats` repetitions.
//! One repetition of a (link, frame size) measures the mesh's throughput (a slot of about
//! [`SLOT_S`]) and a chunk of round trips, and the same for the limit, back to back (the limit
//! first on odd repetitions), so drift hits both; a round-trip figure is the median over
//! repetitions of each chunk's p50 or p99 (`pooled_*` keeps the percentile of all round trips).
//! Repetitions go round every link and frame size in turn; `--seconds` bounds the whole run
//! (the first repetition always runs).
//!
//! Frames are dispatch frames of 1, 8, 64 and 256 tokens of hidden 7168 in bf16, each token with
//! two (expert, weight) pairs, exactly what the router sends a device.

use crate::BenchError;
use crate::method::json::{BenchReport, BenchResult};
use crate::method::stats::percentile;
use bytes::Bytes;
use expertmesh_transport::codec::{self, Body, ComputeMode, Dispatch, ExpertResult, OutputLayout};
use expertmesh_transport::rdma::RdmaProvider;
use expertmesh_transport::{
    ActivationDtype, LinkKind, Mesh, MeshConfig, MeshEvents, OutFrame, OutputDtype, PeerAddress,
    Transport, TransportEvent,
};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Hidden size of the benchmarked frames (DeepSeek-V3 / Kimi K2).
pub const HIDDEN: usize = 7168;
/// Token counts of the benchmarked frames.
pub(crate) const TOKEN_COUNTS: [usize; 4] = [1, 8, 64, 256];
const ACK_BYTES: usize = 64;
/// Shared-memory ring size in the bench (room for several 256-token frames).
const BENCH_RING_BYTES: usize = 24 << 20;

/// Options of the transport bench.
#[derive(Debug, Clone)]
pub struct TransportBenchOptions {
    /// Seconds the whole run may take.
    pub seconds: f64,
    /// Round trips per latency sample.
    pub round_trips: usize,
    /// Links to measure.
    pub links: Vec<LinkKind>,
    /// Repetitions per figure (fewer when `seconds` runs out).
    pub repetitions: usize,
    /// The NIC under the RDMA link, when `links` has it.
    pub rdma_provider: RdmaProvider,
}

/// Repetitions per figure by default: enough to see a 10% change of a ratio between two runs
/// on a noisy 2-core VM as often as this bench's noise allows (BENCHMARKS.md, "How many
/// repetitions"; each costs about 1 s).
pub const DEFAULT_REPETITIONS: usize = 31;

/// Target seconds of one throughput sample (assuming ~2 GB/s to size it).
const SLOT_S: f64 = 0.1;

impl Default for TransportBenchOptions {
    fn default() -> Self {
        Self {
            seconds: 30.0,
            round_trips: 100,
            links: vec![LinkKind::Tcp, LinkKind::Shm],
            repetitions: DEFAULT_REPETITIONS,
            rdma_provider: RdmaProvider::default(),
        }
    }
}

fn dispatch_frame(tokens: usize) -> OutFrame {
    let pairs = 2 * tokens;
    let body = Body::Dispatch(Dispatch {
        batch_id: 1,
        layer: 0,
        part: 0,
        tokens: tokens as u32,
        hidden: HIDDEN as u32,
        dtype: ActivationDtype::Bf16,
        mode: ComputeMode::Exact,
        layout: OutputLayout::PerSlot,
        result_dtype: OutputDtype::F32,
        expert_counts: vec![2; tokens],
        experts: (0..pairs as u32).collect(),
        weights: vec![0.5; pairs],
    });
    let payload: Vec<u8> = (0..tokens * HIDDEN * 2).map(|i| i as u8).collect();
    OutFrame::with_payload(body, payload)
}

fn ack_frame() -> OutFrame {
    OutFrame::new(Body::Result(ExpertResult {
        batch_id: 1,
        layer: 0,
        part: 0,
        layout: OutputLayout::PerSlot,
        rows: 0,
        hidden: HIDDEN as u32,
        dtype: OutputDtype::Bf16,
    }))
}

/// Interleaved samples of one (link, frame size): throughput and round-trip percentiles of
/// the mesh and of its limit, one entry per repetition.
#[derive(Default)]
struct Unit {
    thr: (Vec<f64>, Vec<f64>),
    p50: (Vec<f64>, Vec<f64>),
    p99: (Vec<f64>, Vec<f64>),
    /// Every round trip, pooled over repetitions (mesh, limit).
    rtt_all: (Vec<f64>, Vec<f64>),
    /// Seconds the last repetition of this unit took.
    last_s: f64,
    frames: usize,
    trips: usize,
    frame_bytes: usize,
    /// The TCP throughput limit's way of moving the bytes, chosen by the sweep.
    tcp_way: Option<RawWay>,
}

/// Runs the bench (progress on stdout) and returns its report.
pub fn run(args: &TransportBenchOptions) -> Result<BenchReport, BenchError> {
    let start = Instant::now();
    let end = start + Duration::from_secs_f64(args.seconds);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let (shm_tmp, shm_dir) = tempfile_dir()?;
    // One raw TCP pair for the whole run, as the mesh's links are: a connection made per
    // measurement starts with small autotuned windows, and the long-lived mesh beat it (1.05-1.18
    // of its throughput, half its round trip at 256 tokens).
    let mut raw = rt.block_on(RawTcp::new())?;
    let mut pairs = Vec::new();
    for &link in &args.links {
        let pair = start_pair(link, &shm_dir, false, &args.rdma_provider);
        pairs.push((link, rt.block_on(pair)?));
    }
    let sealed = start_pair(LinkKind::Tcp, &shm_dir, true, &args.rdma_provider);
    let mut encrypted = match args.links.contains(&LinkKind::Tcp) {
        true => Some(rt.block_on(sealed)?),
        false => None,
    };
    let mut enc_units: Vec<Unit> = TOKEN_COUNTS.iter().map(|_| Unit::default()).collect();
    let mut units: Vec<Vec<Unit>> = pairs
        .iter()
        .map(|_| TOKEN_COUNTS.iter().map(|_| Unit::default()).collect())
        .collect();
    let links: Vec<LinkKind> = pairs.iter().map(|(l, _)| *l).collect();
    sweep_tcp_bound_links(&rt, &mut raw, &links, &mut units, args, start)?;
    let mut done = 0;
    'reps: for rep in 0..args.repetitions.max(1) {
        for (li, (link, (meshes, events))) in pairs.iter_mut().enumerate() {
            for (ti, &tokens) in TOKEN_COUNTS.iter().enumerate() {
                let u = &mut units[li][ti];
                // The last repetition's time with 20% to spare (before the first: two slots).
                // The first repetition always runs: a run that measured nothing is no run.
                let est = 1.2 * u.last_s.max(2.0 * SLOT_S + 0.02);
                if rep > 0 && Instant::now() + Duration::from_secs_f64(est) > end {
                    println!(
                        "--seconds {} reached in repetition {}: stopping (figures from the repetitions done)",
                        args.seconds,
                        rep + 1
                    );
                    break 'reps;
                }
                let t0 = Instant::now();
                sample_unit(&rt, &mut raw, *link, meshes, events, tokens, args, rep, u)?;
                if *link == LinkKind::Tcp
                    && let Some((em, ee)) = encrypted.as_mut()
                {
                    let plain = (meshes.as_slice(), &mut *events);
                    let eu = &mut enc_units[ti];
                    sample_encrypted(&rt, plain, (em, ee), tokens, args, rep, eu)?;
                }
                u.last_s = t0.elapsed().as_secs_f64();
            }
        }
        done = rep + 1;
    }
    let encrypted_meshes = encrypted.iter().flat_map(|(m, _)| m);
    for m in pairs
        .iter()
        .flat_map(|(_, (m, _))| m)
        .chain(encrypted_meshes)
    {
        m.shutdown();
    }
    drop(shm_tmp);
    let mut report = BenchReport::new();
    for ((link, _), us) in pairs.iter().zip(&units) {
        for (u, &tokens) in us.iter().zip(&TOKEN_COUNTS) {
            report
                .results
                .extend(unit_results(*link, &args.rdma_provider, tokens, u));
        }
    }
    if encrypted.is_some() {
        for (u, &tokens) in enc_units.iter().zip(&TOKEN_COUNTS) {
            report.results.extend(encrypted_results(tokens, u));
        }
    }
    let m = &mut report.machine.extra;
    m.insert("tcp_limit_sweep".into(), serde_json::json!(raw.swept));
    m.insert("hidden".into(), serde_json::json!(HIDDEN));
    m.insert("dtype".into(), serde_json::json!("bf16"));
    crate::method::machine::finish(m);
    m.insert(
        "settings".into(),
        serde_json::json!({
            "seconds": args.seconds, "repetitions": args.repetitions,
            "repetitions_done": done, "round_trips": args.round_trips,
            "slot_s": SLOT_S, "elapsed_s": start.elapsed().as_secs_f64(),
            "links": args.links.iter().map(|l| l.name()).collect::<Vec<_>>(),
        }),
    );
    println!(
        "ratio = achieved / limit (medians of {done} interleaved repetitions; spread p10-p90 of the per-repetition ratios); batch = tokens per frame"
    );
    Ok(report)
}

/// Whether `link` moves its bytes over TCP sockets, so that raw loopback TCP is its limit: TCP,
/// and RDMA over libfabric's `tcp` providers.
fn tcp_limited(link: LinkKind, provider: &RdmaProvider) -> bool {
    match link {
        LinkKind::Tcp => true,
        LinkKind::Rdma => matches!(provider, RdmaProvider::Libfabric(p) if p.starts_with("tcp")),
        LinkKind::Shm => false,
    }
}

/// Sweeps the raw TCP ways once for the first link that runs over TCP sockets (TCP, or RDMA on
/// libfabric's tcp provider); every other such link shares the sweep's best way.
fn sweep_tcp_bound_links(
    rt: &tokio::runtime::Runtime,
    raw: &mut RawTcp,
    links: &[LinkKind],
    units: &mut [Vec<Unit>],
    args: &TransportBenchOptions,
    start: Instant,
) -> Result<(), BenchError> {
    let tcp_bound = |l: LinkKind| tcp_limited(l, &args.rdma_provider);
    let Some(li) = links.iter().position(|&l| tcp_bound(l)) else {
        return Ok(());
    };
    sweep_tcp_limits(rt, raw, &mut units[li], start, args.seconds)?;
    let ways: Vec<Option<RawWay>> = units[li].iter().map(|u| u.tcp_way).collect();
    for (lj, &l) in links.iter().enumerate() {
        if lj != li && tcp_bound(l) {
            for (u, &w) in units[lj].iter_mut().zip(&ways) {
                u.tcp_way = w;
            }
        }
    }
    Ok(())
}

/// Chooses each frame size's TCP limit way ([`RawTcp::sweep`]) in at most a tenth of the
/// run; a short run measures fewer ways (the first is the per-frame writer on the kept
/// connection).
fn sweep_tcp_limits(
    rt: &tokio::runtime::Runtime,
    raw: &mut RawTcp,
    units: &mut [Unit],
    start: Instant,
    seconds: f64,
) -> Result<(), BenchError> {
    let until = start + Duration::from_secs_f64(0.1 * seconds);
    let passes = if seconds >= 20.0 { 3 } else { 1 };
    for (u, &tokens) in units.iter_mut().zip(&TOKEN_COUNTS) {
        let frame = dispatch_frame(tokens);
        let msg = codec::frame_len(&frame.body, frame.payload.len());
        let count = frames_for(SLOT_S, msg);
        u.tcp_way = Some(raw.sweep(rt, tokens, msg, count, passes, until)?);
    }
    Ok(())
}

/// One repetition of one (link, frame size): throughput then round trips, each with its
/// limit measured right after (before, on odd repetitions).
#[allow(clippy::too_many_arguments)]
fn sample_unit(
    rt: &tokio::runtime::Runtime,
    raw: &mut RawTcp,
    link: LinkKind,
    meshes: &[Mesh],
    events: &mut MeshEvents,
    tokens: usize,
    args: &TransportBenchOptions,
    rep: usize,
    u: &mut Unit,
) -> Result<(), BenchError> {
    let frame = dispatch_frame(tokens);
    let msg = codec::frame_len(&frame.body, frame.payload.len());
    let count = frames_for(SLOT_S, msg);
    let trips = args.round_trips.max(10);
    let limit_first = rep % 2 == 1;
    let mut thr = (0.0, 0.0);
    let mut rtt = (Vec::new(), Vec::new());
    // The floor's second way (TCP: tokio's sockets; its percentiles count when lower).
    let mut rtt_alt: Vec<f64> = Vec::new();
    for step in 0..2 {
        if (step == 0) != limit_first {
            thr.0 = rt.block_on(mesh_throughput(meshes, events, &frame, count))?;
            rtt.0 = rt.block_on(mesh_round_trips(meshes, events, &frame, trips))?;
        } else {
            let tcp = tcp_limited(link, &args.rdma_provider);
            thr.1 = match tcp {
                // An upper envelope (interference only lowers a pass): two passes of the
                // sweep's way and one of the runner-up kind (tokio's sockets, or blocking
                // ones when tokio's won), the best of the three.
                true => {
                    let way = u.tcp_way.unwrap_or(RawWay::BlockingKept(1));
                    let other = match way {
                        RawWay::TokioKept => RawWay::BlockingKept(1),
                        _ => RawWay::TokioKept,
                    };
                    let a = raw.measure(rt, way, msg, count)?;
                    let b = raw.measure(rt, other, msg, count)?;
                    a.max(b).max(raw.measure(rt, way, msg, count)?)
                }
                // The better of a ring as large as the shm ring's and one of two frames
                // (cache-warm): the mesh's copy may find its ring in cache.
                false => {
                    memcpy_gbps(msg, count, BENCH_RING_BYTES).max(memcpy_gbps(msg, count, 2 * msg))
                }
            };
            rtt.1 = match tcp {
                true => {
                    rtt_alt = rt.block_on(raw.tokio_ping_pong_us(msg, trips))?;
                    raw.ping_pong_us(msg, trips)?
                }
                false => memory_ping_pong_us(msg, trips),
            };
        }
    }
    rtt.0.sort_by(f64::total_cmp);
    rtt.1.sort_by(f64::total_cmp);
    rtt_alt.sort_by(f64::total_cmp);
    // A floor is the best a raw way reaches: per percentile, the lower of the two ways.
    let floor = |q: f64| {
        let p = percentile(&rtt.1, q);
        if rtt_alt.is_empty() {
            p
        } else {
            p.min(percentile(&rtt_alt, q))
        }
    };
    u.thr.0.push(thr.0);
    u.thr.1.push(thr.1);
    u.p50.0.push(percentile(&rtt.0, 50.0));
    u.p50.1.push(floor(50.0));
    u.p99.0.push(percentile(&rtt.0, 99.0));
    u.p99.1.push(floor(99.0));
    if !rtt_alt.is_empty() && percentile(&rtt_alt, 50.0) < percentile(&rtt.1, 50.0) {
        rtt.1 = rtt_alt;
    }
    u.rtt_all.0.extend(&rtt.0);
    u.rtt_all.1.extend(&rtt.1);
    (u.frames, u.trips, u.frame_bytes) = (count, trips, msg);
    Ok(())
}

/// One repetition of the encrypted TCP pair against the plain one, same frame: throughput and
/// round trips of each, back to back (plain first on odd repetitions).
fn sample_encrypted(
    rt: &tokio::runtime::Runtime,
    plain: (&[Mesh], &mut MeshEvents),
    enc: (&[Mesh], &mut MeshEvents),
    tokens: usize,
    args: &TransportBenchOptions,
    rep: usize,
    u: &mut Unit,
) -> Result<(), BenchError> {
    let frame = dispatch_frame(tokens);
    let msg = codec::frame_len(&frame.body, frame.payload.len());
    let count = frames_for(SLOT_S, msg);
    let trips = args.round_trips.max(10);
    let (mut thr, mut rtt) = ((0.0, 0.0), (Vec::new(), Vec::new()));
    let (pm, pe) = plain;
    let (em, ee) = enc;
    for step in 0..2 {
        if (step == 0) != (rep % 2 == 1) {
            thr.0 = rt.block_on(mesh_throughput(em, ee, &frame, count))?;
            rtt.0 = rt.block_on(mesh_round_trips(em, ee, &frame, trips))?;
        } else {
            thr.1 = rt.block_on(mesh_throughput(pm, pe, &frame, count))?;
            rtt.1 = rt.block_on(mesh_round_trips(pm, pe, &frame, trips))?;
        }
    }
    rtt.0.sort_by(f64::total_cmp);
    rtt.1.sort_by(f64::total_cmp);
    u.thr.0.push(thr.0);
    u.thr.1.push(thr.1);
    u.p50.0.push(percentile(&rtt.0, 50.0));
    u.p50.1.push(percentile(&rtt.1, 50.0));
    (u.frames, u.trips, u.frame_bytes) = (count, trips, msg);
    Ok(())
}

/// The encrypted TCP rows of one frame size: achieved = the sealed mesh, limit = the plain
/// mesh in the same repetitions.
fn encrypted_results(tokens: usize, u: &Unit) -> Vec<BenchResult> {
    if u.thr.0.is_empty() {
        return Vec::new();
    }
    let limit =
        "the plain (unencrypted) TCP mesh, same frames, interleaved in the same repetitions";
    vec![
        BenchResult::from_samples(
            "tcp_encrypted_dispatch_throughput".to_string(),
            tokens as u64,
            &u.thr.0,
            &u.thr.1,
            "GB/s",
        )
        .with("limit_is", limit)
        .with("cipher", "AES-256-GCM (ring), per-direction counter nonces")
        .with("frame_bytes", u.frame_bytes as u64)
        .with("frames", u.frames as u64),
        BenchResult::from_samples(
            "tcp_encrypted_dispatch_rtt_p50".to_string(),
            tokens as u64,
            &u.p50.0,
            &u.p50.1,
            "us",
        )
        .with("limit_is", limit)
        .with("round_trips", u.trips as u64),
    ]
}

/// The three result rows of one (link, frame size).
fn unit_results(
    link: LinkKind,
    provider: &RdmaProvider,
    tokens: usize,
    u: &Unit,
) -> Vec<BenchResult> {
    if u.thr.0.is_empty() {
        return Vec::new();
    }
    let (thr_limit, rtt_limit) = match tcp_limited(link, provider) {
        true => (
            "raw loopback TCP stream: the best way of a sweep at the start (blocking or tokio sockets, a connection kept for the run or a fresh one, 1 or 8 frames per write; tcp_limit_sweep in machine); per repetition the best of 2 passes of it and 1 of the other socket kind",
            "raw TCP ping-pong on connections kept for the run: per repetition and percentile, the lower of blocking and tokio sockets",
        ),
        false => (
            "single-thread memcpy from one buffer into a ring: the better of the shm ring's size and two frames",
            "two threads, one memcpy in + atomic flag each way (spin, then yield); the peer reads 64 bytes",
        ),
    };
    let mut out = vec![
        BenchResult::from_samples(
            format!("{}_dispatch_throughput", link.name()),
            tokens as u64,
            &u.thr.0,
            &u.thr.1,
            "GB/s",
        )
        .with("limit_is", thr_limit)
        .with("link_provider", link_provider(link, provider))
        .with("frame_bytes", u.frame_bytes as u64)
        .with("frames", u.frames as u64),
    ];
    let mut pooled = u.rtt_all.clone();
    pooled.0.sort_by(f64::total_cmp);
    pooled.1.sort_by(f64::total_cmp);
    for (tag, p, s) in [("p50", 50.0, &u.p50), ("p99", 99.0, &u.p99)] {
        out.push(
            BenchResult::from_samples(
                format!("{}_dispatch_rtt_{tag}", link.name()),
                tokens as u64,
                &s.0,
                &s.1,
                "us",
            )
            .with("limit_is", rtt_limit)
            .with("round_trips", u.trips as u64)
            .with("pooled_achieved", percentile(&pooled.0, p))
            .with("pooled_limit", percentile(&pooled.1, p))
            .with("percentile_of", "each repetition's round trips; achieved and limit are medians over repetitions, pooled_* the percentile of all round trips"),
        );
    }
    out
}

/// What carries `link`'s bytes, for the JSON rows: the NIC provider for RDMA.
fn link_provider(link: LinkKind, provider: &RdmaProvider) -> String {
    match link {
        LinkKind::Rdma => provider.name(),
        _ => link.name().to_string(),
    }
}

/// A folder of this run's own for the rings (two runs in one process, as the unit tests do,
/// never share one), removed when the first is dropped, and its path.
fn tempfile_dir() -> Result<(tempfile::TempDir, PathBuf), BenchError> {
    let base = if std::path::Path::new("/dev/shm").is_dir() {
        PathBuf::from("/dev/shm")
    } else {
        std::env::temp_dir()
    };
    let dir = tempfile::Builder::new()
        .prefix("expertmesh-bench-")
        .tempdir_in(base)?;
    let path = dir.path().to_path_buf();
    Ok((dir, path))
}

fn frames_for(seconds: f64, msg: usize) -> usize {
    // Assume ~2 GB/s to size the run; at least 20 frames, at most 20 000.
    ((seconds * 2e9 / msg as f64) as usize).clamp(20, 20_000)
}

/// Two ranks linked by `link`; with `encrypted`, each holds its own issued credentials (a
/// fresh random cluster key), so every TCP frame is sealed.
async fn start_pair(
    link: LinkKind,
    shm_dir: &std::path::Path,
    encrypted: bool,
    rdma_provider: &RdmaProvider,
) -> Result<(Vec<Mesh>, MeshEvents), BenchError> {
    let master = expertmesh_transport::crypto::Key::random()?;
    // Below the ephemeral range (the meshes bind them later; an outgoing connection could
    // take a port the kernel picked meanwhile).
    let addrs: Vec<SocketAddr> = (0..2)
        .map(|_| {
            expertmesh_transport::ports::free_loopback_ports(1)
                .map(|port| SocketAddr::from(([127, 0, 0, 1], port)))
        })
        .collect::<Result<_, _>>()?;
    let mut meshes = Vec::new();
    let mut rx0 = None;
    for rank in 0..2u32 {
        let peers = addrs
            .iter()
            .map(|&addr| PeerAddress { addr, link })
            .collect();
        let mut cfg = MeshConfig::new("bench", rank, peers);
        cfg.protocol.codec.max_frame_bytes = 8 << 20;
        cfg.protocol.recv_window_bytes = 64 << 20;
        cfg.shm.dir = shm_dir.to_path_buf();
        cfg.shm.ring_bytes = BENCH_RING_BYTES;
        cfg.rdma_provider = rdma_provider.clone();
        if encrypted {
            let c =
                expertmesh_transport::crypto::Credentials::issue_rank(&master, "bench", rank, 2, 1);
            cfg.protocol.credentials = Some(Arc::new(c));
        }
        let (m, ev) = Mesh::start(cfg).await?;
        if rank == 0 {
            rx0 = Some(ev);
        } else {
            tokio::spawn(echo_server(m.clone(), ev));
        }
        meshes.push(m);
    }
    meshes[0]
        .wait_connected(&[1], Duration::from_secs(10))
        .await?;
    if meshes[0].link_kind(1) != Some(link) {
        return Err(BenchError::LinkFallback {
            link,
            got: meshes[0].link_kind(1),
        });
    }
    Ok((meshes, rx0.expect("rank 0 events")))
}

/// Rank 1: answers a dispatch with request id 1 by an ack; counts stream frames (request id 2)
/// and acks when told how many to expect (request id 3 carries the count in `layer`).
async fn echo_server(mesh: Mesh, mut events: MeshEvents) {
    let ack = ack_frame();
    let mut counted = 0u64;
    let mut expect = u64::MAX;
    while let Some(ev) = events.recv().await {
        let TransportEvent::Frame(f) = ev else {
            continue;
        };
        let id = f.body().request_id().unwrap_or(0);
        let layer = match f.body() {
            Body::Dispatch(d) => d.layer as u64,
            _ => 0,
        };
        drop(f);
        match id {
            1 if mesh.send(0, &ack).await.is_err() => return,
            1 => {}
            2 => {
                counted += 1;
                if counted == expect {
                    counted = 0;
                    expect = u64::MAX;
                    let _ = mesh.send(0, &ack).await;
                }
            }
            3 => {
                expect = layer;
                if counted == expect {
                    counted = 0;
                    expect = u64::MAX;
                    let _ = mesh.send(0, &ack).await;
                }
            }
            _ => {}
        }
    }
}

fn with_id(frame: &OutFrame, id: u64, layer: u32) -> OutFrame {
    let mut f = frame.clone();
    if let Body::Dispatch(d) = &mut f.body {
        d.batch_id = id;
        d.layer = layer;
    }
    f.payload = Bytes::clone(&frame.payload);
    f
}

async fn mesh_throughput(
    meshes: &[Mesh],
    events: &mut MeshEvents,
    frame: &OutFrame,
    count: usize,
) -> Result<f64, BenchError> {
    let stream = with_id(frame, 2, 0);
    let bytes = codec::frame_len(&frame.body, frame.payload.len()) as f64;
    // Warm-up (untimed): fills the receive buffer pool and the socket or ring once.
    // `n` frames, then a marker frame that rank 1 acknowledges once it has them all.
    let mut burst = async |n: usize, what: &str| -> Result<(), BenchError> {
        for _ in 0..n {
            meshes[0].send(1, &stream).await?;
        }
        meshes[0]
            .send(1, &with_id(&dispatch_frame(1), 3, n as u32))
            .await?;
        events
            .recv_frame(Duration::from_secs(60))
            .await
            .ok_or_else(|| BenchError::NoAck(what.to_string()))?;
        Ok(())
    };
    burst((count / 4).clamp(2, 32), "warm-up").await?;
    let start = Instant::now();
    burst(count, "completion").await?;
    let secs = start.elapsed().as_secs_f64();
    Ok(bytes * count as f64 / secs / 1e9)
}

async fn mesh_round_trips(
    meshes: &[Mesh],
    events: &mut MeshEvents,
    frame: &OutFrame,
    trips: usize,
) -> Result<Vec<f64>, BenchError> {
    let ping = with_id(frame, 1, 0);
    let mut out = Vec::with_capacity(trips);
    for i in 0..trips + 10 {
        let t0 = Instant::now();
        meshes[0].send(1, &ping).await?;
        events
            .recv_frame(Duration::from_secs(10))
            .await
            .ok_or(BenchError::NoAnswer)?;
        if i >= 10 {
            out.push(t0.elapsed().as_secs_f64() * 1e6);
        }
    }
    Ok(out)
}

fn loopback_pair() -> Result<(TcpStream, TcpStream), BenchError> {
    let l = TcpListener::bind("127.0.0.1:0")?;
    let a = TcpStream::connect(l.local_addr()?)?;
    let (b, _) = l.accept()?;
    a.set_nodelay(true)?;
    b.set_nodelay(true)?;
    Ok((a, b))
}

/// Raw loopback TCP connections kept for the whole run (two blocking streams, and two tokio
/// streams driven as the mesh drives its sockets): the limits of the TCP link. Each
/// measurement reads everything it wrote, so the next one starts in step.
struct RawTcp {
    a: TcpStream,
    b: TcpStream,
    /// Tokio's pair: the sender, and the receiver (lent to a reader task per measurement).
    ta: tokio::net::TcpStream,
    tb: Option<tokio::net::TcpStream>,
    /// Every way the sweep measured, per frame size (for `machine.tcp_limit_sweep`).
    swept: Vec<serde_json::Value>,
}

/// A way to move frames over raw loopback TCP, for the TCP throughput limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RawWay {
    /// Blocking sockets on the connection kept for the run, this many frames per write.
    BlockingKept(usize),
    /// Blocking sockets on a new connection per pass, this many frames per write.
    BlockingFresh(usize),
    /// Tokio's sockets on a connection kept for the run, one frame per `write_all`.
    TokioKept,
}

impl RawWay {
    const ALL: [RawWay; 5] = [
        RawWay::BlockingKept(1),
        RawWay::BlockingKept(RAW_BATCH),
        RawWay::BlockingFresh(1),
        RawWay::BlockingFresh(RAW_BATCH),
        RawWay::TokioKept,
    ];

    fn name(self) -> String {
        match self {
            RawWay::BlockingKept(b) => format!("blocking, kept connection, {b} frame(s) per write"),
            RawWay::BlockingFresh(b) => {
                format!("blocking, fresh connection, {b} frame(s) per write")
            }
            RawWay::TokioKept => "tokio, kept connection, 1 frame per write".into(),
        }
    }
}

impl RawTcp {
    async fn new() -> Result<Self, BenchError> {
        let (a, b) = loopback_pair()?;
        let (ta, tb) = loopback_pair()?;
        for s in [&ta, &tb] {
            s.set_nonblocking(true)?;
        }
        Ok(Self {
            a,
            b,
            ta: tokio::net::TcpStream::from_std(ta)?,
            tb: Some(tokio::net::TcpStream::from_std(tb)?),
            swept: Vec::new(),
        })
    }

    /// Picks the best way to move `count` frames of `msg` bytes (`tokens` per frame): every
    /// [`RawWay`] `passes` times, round-robin, until `until` (the first way always runs), the
    /// best median wins. A limit must be one: with
    /// per-frame blocking writes on fresh connections only the mesh (which coalesces frames and
    /// keeps its connection) read 1.04-1.18 of it; which way is fastest depends on the frame
    /// size and the machine (a kept connection's grown windows were slower at 64 tokens here).
    fn sweep(
        &mut self,
        rt: &tokio::runtime::Runtime,
        tokens: usize,
        msg: usize,
        count: usize,
        passes: usize,
        until: Instant,
    ) -> Result<RawWay, BenchError> {
        let mut samples: Vec<(RawWay, Vec<f64>)> =
            RawWay::ALL.iter().map(|&w| (w, Vec::new())).collect();
        'passes: for _ in 0..passes {
            for (way, s) in samples.iter_mut() {
                if *way != RawWay::ALL[0] && Instant::now() >= until {
                    break 'passes;
                }
                s.push(self.measure(rt, *way, msg, count)?);
            }
        }
        samples.retain(|(_, s)| !s.is_empty());
        let median = |s: &[f64]| crate::method::stats::Spread::of(s).median;
        let best = samples
            .iter()
            .max_by(|a, b| median(&a.1).total_cmp(&median(&b.1)))
            .map_or(RawWay::BlockingKept(1), |(w, _)| *w);
        for (way, s) in &samples {
            self.swept.push(serde_json::json!({
                "tokens": tokens, "way": way.name(), "gbs_median": median(s),
                "samples_gbs": s, "chosen": *way == best,
            }));
        }
        Ok(best)
    }

    /// One pass of `way`: GB/s of `count` frames of `msg` bytes.
    fn measure(
        &mut self,
        rt: &tokio::runtime::Runtime,
        way: RawWay,
        msg: usize,
        count: usize,
    ) -> Result<f64, BenchError> {
        match way {
            RawWay::BlockingKept(batch) => stream_gbps(&self.a, &self.b, msg, count, batch),
            RawWay::BlockingFresh(batch) => {
                let (a, b) = loopback_pair()?;
                stream_gbps(&a, &b, msg, count, batch)
            }
            RawWay::TokioKept => rt.block_on(self.tokio_stream_gbps(msg, count)),
        }
    }

    /// Round trips (µs) of a `msg`-byte frame answered by a small ack over tokio's pair (an
    /// echo task answers): the floor as the mesh's I/O reaches it.
    async fn tokio_ping_pong_us(
        &mut self,
        msg: usize,
        trips: usize,
    ) -> Result<Vec<f64>, BenchError> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut tb = self
            .tb
            .take()
            .expect("the tokio receiver is back after each use");
        let server = tokio::spawn(async move {
            let mut buf = vec![0u8; msg];
            let ack = [0u8; ACK_BYTES];
            for _ in 0..trips + 10 {
                tb.read_exact(&mut buf).await?;
                tb.write_all(&ack).await?;
            }
            std::io::Result::Ok(tb)
        });
        let data = vec![7u8; msg];
        let mut ack = [0u8; ACK_BYTES];
        let mut out = Vec::with_capacity(trips);
        for i in 0..trips + 10 {
            let t0 = Instant::now();
            self.ta.write_all(&data).await?;
            self.ta.read_exact(&mut ack).await?;
            if i >= 10 {
                out.push(t0.elapsed().as_secs_f64() * 1e6);
            }
        }
        self.tb = Some(server.await??);
        Ok(out)
    }

    /// Bytes per second (GB/s) of `count` frames of `msg` bytes over tokio's pair: one task
    /// writes them (`write_all` per frame), a reader task reads them whole and acks.
    async fn tokio_stream_gbps(&mut self, msg: usize, count: usize) -> Result<f64, BenchError> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut tb = self
            .tb
            .take()
            .expect("the tokio receiver is back after each use");
        let warm = (count / 4).clamp(2, 32);
        let reader = tokio::spawn(async move {
            let mut buf = vec![0u8; msg];
            for frames in [warm, count] {
                for _ in 0..frames {
                    tb.read_exact(&mut buf).await?;
                }
                tb.write_all(&[1]).await?;
            }
            std::io::Result::Ok(tb)
        });
        let data: Vec<u8> = (0..msg).map(|i| i as u8).collect();
        let mut done = [0u8; 1];
        let mut secs = 0.0;
        for (i, frames) in [warm, count].into_iter().enumerate() {
            let start = Instant::now();
            for _ in 0..frames {
                self.ta.write_all(&data).await?;
            }
            self.ta.read_exact(&mut done).await?;
            if i == 1 {
                secs = start.elapsed().as_secs_f64();
            }
        }
        self.tb = Some(reader.await??);
        Ok((msg * count) as f64 / secs / 1e9)
    }

    /// Round trips (µs) of a `msg`-byte frame answered by a small ack: the TCP link's floor.
    fn ping_pong_us(&self, msg: usize, trips: usize) -> Result<Vec<f64>, BenchError> {
        let (mut a, mut b) = (&self.a, self.b.try_clone()?);
        let server = std::thread::spawn(move || -> std::io::Result<()> {
            let mut buf = vec![0u8; msg];
            let ack = [0u8; ACK_BYTES];
            for _ in 0..trips + 10 {
                b.read_exact(&mut buf)?;
                b.write_all(&ack)?;
            }
            Ok(())
        });
        let data = vec![7u8; msg];
        let mut ack = [0u8; ACK_BYTES];
        let mut out = Vec::with_capacity(trips);
        for i in 0..trips + 10 {
            let t0 = Instant::now();
            a.write_all(&data)?;
            a.read_exact(&mut ack)?;
            if i >= 10 {
                out.push(t0.elapsed().as_secs_f64() * 1e6);
            }
        }
        server
            .join()
            .map_err(|_| BenchError::Panicked("raw ping-pong server"))??;
        Ok(out)
    }
}

/// Bytes per second (GB/s) of `count` frames of `msg` bytes from `a` to `b` (a blocking
/// loopback pair), written `batch` frames per `write_all`; the reader reads large chunks.
fn stream_gbps(
    mut a: &TcpStream,
    b: &TcpStream,
    msg: usize,
    count: usize,
    batch: usize,
) -> Result<f64, BenchError> {
    let mut b = b.try_clone()?;
    let batch = batch.clamp(1, count.max(1));
    let writes = count.div_ceil(batch);
    let warm = (writes / 4).clamp(2, 32);
    let reader = std::thread::spawn(move || -> std::io::Result<()> {
        let mut buf = vec![0u8; (256 << 10).max(msg)];
        for bytes in [warm * batch * msg, writes * batch * msg] {
            let mut left = bytes;
            while left > 0 {
                let n = buf.len().min(left);
                b.read_exact(&mut buf[..n])?;
                left -= n;
            }
            b.write_all(&[1])?;
        }
        Ok(())
    });
    let data: Vec<u8> = (0..msg * batch).map(|i| i as u8).collect();
    let mut done = [0u8; 1];
    for _ in 0..warm {
        a.write_all(&data)?;
    }
    a.read_exact(&mut done)?;
    let start = Instant::now();
    for _ in 0..writes {
        a.write_all(&data)?;
    }
    a.read_exact(&mut done)?;
    let secs = start.elapsed().as_secs_f64();
    reader
        .join()
        .map_err(|_| BenchError::Panicked("raw stream reader"))??;
    Ok((msg * batch * writes) as f64 / secs / 1e9)
}

/// Frames per write in the coalescing raw stream.
const RAW_BATCH: usize = 8;

fn memcpy_gbps(msg: usize, count: usize, ring: usize) -> f64 {
    // What the shm producer does per frame, minus the protocol: copy one source buffer into
    // successive slots of a ring as large as the shm ring (so the same caches are missed).
    let src: Vec<u8> = (0..msg).map(|i| i as u8).collect();
    let mut dst = vec![1u8; ring.max(2 * msg)];
    let ring = dst.len();
    let start = Instant::now();
    let mut off = 0;
    for _ in 0..count {
        if off + msg > ring {
            off = 0;
        }
        dst[off..off + msg].copy_from_slice(&src);
        off += msg;
    }
    std::hint::black_box(&dst);
    msg as f64 * count as f64 / start.elapsed().as_secs_f64() / 1e9
}

/// Wait until `flag` reads `value`: spin for up to [`SPIN_BEFORE_YIELD`] (a hand-off between
/// running threads takes well under a microsecond), then yield the CPU on every poll so a
/// descheduled peer gets to run.
fn wait_for(flag: &AtomicU64, value: u64) {
    let start = Instant::now();
    let mut polls = 0u32;
    while flag.load(Ordering::Acquire) != value {
        polls = polls.wrapping_add(1);
        if polls % 64 != 0 || start.elapsed() < SPIN_BEFORE_YIELD {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
}

/// How long the in-memory ping-pong spins before it yields: long enough for a hand-off between
/// threads on two cores, short because threads sharing a core pay it on every hand-off.
const SPIN_BEFORE_YIELD: Duration = Duration::from_micros(5);

/// Round-trip times (µs) of `msg` bytes through shared memory between two threads: copy in,
/// hand off, the peer reads the first bytes (as a receiver decoding a header in place would)
/// and hands back. No protocol, no framing, one copy: the floor for the shm link's round trip.
/// (A peer that also copied the payload out made this "floor" slower than the mesh, whose
/// receiver does not copy.)
fn memory_ping_pong_us(msg: usize, trips: usize) -> Vec<f64> {
    struct Shared {
        flag: AtomicU64,
        buf: std::sync::Mutex<Vec<u8>>,
    }
    let shared = Arc::new(Shared {
        flag: AtomicU64::new(0),
        buf: std::sync::Mutex::new(vec![0u8; msg]),
    });
    let s2 = Arc::clone(&shared);
    let total = trips + 10;
    let peer = std::thread::spawn(move || {
        let mut seen = 0u64;
        for i in 0..total as u64 {
            wait_for(&s2.flag, 2 * i + 1);
            let buf = s2.buf.lock().unwrap_or_else(|e| e.into_inner());
            seen ^= buf.iter().take(64).fold(0u64, |a, &b| a ^ b as u64);
            drop(buf);
            s2.flag.store(2 * i + 2, Ordering::Release);
        }
        std::hint::black_box(seen);
    });
    let data = vec![3u8; msg];
    let mut out = Vec::with_capacity(trips);
    for i in 0..total as u64 {
        let t0 = Instant::now();
        shared
            .buf
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .copy_from_slice(&data);
        shared.flag.store(2 * i + 1, Ordering::Release);
        wait_for(&shared.flag, 2 * i + 2);
        if i >= 10 {
            out.push(t0.elapsed().as_secs_f64() * 1e6);
        }
    }
    let _ = peer.join();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_ping_pong_returns_one_positive_sample_per_trip() {
        for msg in [64, 1 << 20] {
            let s = memory_ping_pong_us(msg, 25);
            assert_eq!(s.len(), 25);
            assert!(s.iter().all(|&us| us > 0.0 && us.is_finite()), "{s:?}");
        }
    }

    /// A budget too small for even one repetition still measures one: every figure with one
    /// sample, never an empty report that exits 0.
    #[test]
    fn the_first_repetition_runs_whatever_the_budget() {
        let args = TransportBenchOptions {
            seconds: 0.0,
            round_trips: 10,
            links: vec![LinkKind::Tcp],
            repetitions: 3,
            rdma_provider: RdmaProvider::InProcess(Default::default()),
        };
        let report = serde_json::to_value(run(&args).unwrap()).unwrap();
        let results = report["results"].as_array().unwrap();
        // Three TCP rows and two encrypted-TCP rows per size.
        assert_eq!(results.len(), 5 * TOKEN_COUNTS.len(), "{report:#}");
        for r in results {
            assert_eq!(r["repetitions"].as_u64(), Some(1), "{r}");
            assert!(r["achieved"].as_f64().is_some_and(|a| a > 0.0), "{r}");
        }
    }

    #[test]
    fn bench_runs_with_tiny_settings_and_reports_every_figure() {
        let dir = std::env::temp_dir().join(format!("em-bench-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let json = dir.join("t.json");
        let args = TransportBenchOptions {
            seconds: 20.0,
            round_trips: 20,
            links: vec![LinkKind::Tcp, LinkKind::Shm, LinkKind::Rdma],
            repetitions: 2,
            // The RDMA link on the in-process NIC: both meshes of the bench live here.
            rdma_provider: RdmaProvider::InProcess(Default::default()),
        };
        run(&args).unwrap().write(&json).unwrap();
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        let results = v["results"].as_array().unwrap();
        // Three rows per (link, size), and two encrypted-TCP rows per size.
        assert_eq!(
            results.len(),
            3 * TOKEN_COUNTS.len() * 3 + 2 * TOKEN_COUNTS.len()
        );
        assert!(
            results
                .iter()
                .any(|r| r["name"] == "rdma_dispatch_throughput"
                    && r["link_provider"] == "in-process"
                    && r["ratio"].as_f64().is_some_and(|x| x > 0.0)),
            "an RDMA row names its NIC"
        );
        assert!(
            results
                .iter()
                .any(|r| r["name"] == "tcp_encrypted_dispatch_throughput" && r["batch"] == 64),
            "the encryption cost is reported"
        );
        for r in results {
            let (a, l) = (
                r["achieved"].as_f64().unwrap(),
                r["limit"].as_f64().unwrap(),
            );
            assert!(a > 0.0 && l > 0.0, "{r}");
            assert!((r["ratio"].as_f64().unwrap() - a / l).abs() < 1e-9);
            // Two repetitions asked for; the --seconds budget may stop the run after the first
            // on a slow or busy machine (the bench says so): every row records what it ran.
            let n = r["samples"]["achieved"].as_array().unwrap().len();
            assert!((1..=2).contains(&n), "{r}");
            assert_eq!(r["repetitions"].as_u64(), Some(n as u64), "{r}");
            let want = if r["unit"] == "us" { "lower" } else { "higher" };
            assert_eq!(r["better"], want, "{r}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
