//! `expertmesh bench cluster`: an emulated multi-node cluster on one machine — nodes as network
//! namespaces with rate-limited NICs, real `expertmesh router` and `expertmesh worker`
//! processes inside them, several frontends per router — measured against `expertmesh plan`'s
//! prediction for the same (scaled) topology.
//!
//! Why this exists: the planner's traffic and roofline model is what cluster builders buy
//! hardware by; this checks it end to end. The NICs are scaled down (tens to hundreds of
//! Mbit/s, `tc tbf` on both ends of every veth so each direction of a node's NIC has the line
//! rate) and the experts are small, so on a small machine the network binds, as it does on a
//! real cluster at those batch sizes. For every batch size the table shows tokens/s measured
//! (tokens through every MoE layer per second, from all frontends) and predicted
//! (`expertmesh_planner::evaluate::Evaluator::roofline` on the generated topology and
//! placement, with the bytes the fabric sends: [`expertmesh_fabric::wire_model`]), their ratio, per-layer
//! call latency p50/p99, and the router node's NIC bytes per token measured next to the
//! planner's. In exact mode (the default) every answer is compared bit for bit with the
//! in-process reference, in serving mode (`--mode serving`: bf16 rows pre-combined per device)
//! within [`SERVING_TOLERANCE`] of it; a mismatch or a failed call makes the run exit 1.
//!
//! It needs root (or CAP_NET_ADMIN/CAP_SYS_ADMIN) and iproute2; without them it stops with
//! "network namespaces not permitted". Everything it creates is named `emc-<pid>-...` and removed
//! on exit, on errors, and on Ctrl-C.

mod files;
pub mod netns;

use crate::BenchError;
use crate::method::json::{BenchReport, BenchResult};
use crate::method::stats::percentile;
use expertmesh_planner::evaluate::{Evaluator, Hardware, NicBytes, Roofline};
use expertmesh_planner::stats::LoadStats;
use expertmesh_quant::contract::ComputeMode;
use expertmesh_router::client::RouterClient;
use expertmesh_router::core::LayerMode;
use expertmesh_router::reference;
use expertmesh_transport::frontend::FrontendConfig;
use expertmesh_worker::deploy::Deployment;
use files::ClusterFiles;
use netns::{Emulation, Shaping};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Exit codes of `bench cluster`, shown by its --help.
pub const EXIT_CODES: &str = "\
Exit codes: 0 measured, every answer correct (and --json written); 1 an answer differed from the
in-process reference or a call failed; 2 bad options, or a cluster that could not start (no
root, no iproute2: \"network namespaces not permitted\").";

/// Largest RMS error of a serving-mode answer against the exact reference, relative to the
/// reference's RMS: the per-device pre-combined sums are rounded to bf16 (8 significant bits,
/// about 0.1-0.2% RMS) and added in another order; a wrong answer is off by ~100%.
pub(crate) const SERVING_TOLERANCE: f64 = 0.01;

/// Seed of the synthetic weights (every process uses the same).
const SEED: u64 = 42;
/// Frontend port of every router (each router has its own node address).
const ROUTER_PORT: u16 = 7000;

/// Options of `bench cluster`.
#[derive(Clone, Debug)]
pub struct ClusterBenchOptions {
    /// Nodes (one CPU worker each).
    pub nodes: usize,
    /// Router counts to run (routers on nodes 0..R-1), each a separate cluster.
    pub routers: Vec<usize>,
    /// NIC line rate, Mbit/s, each direction.
    pub line_rate_mbit: f64,
    /// Where the line rate was scaled from (for the generated files' comments).
    pub scaled_from: Option<String>,
    /// MTU of the emulated NICs.
    pub mtu: u32,
    /// tbf bucket, bytes.
    pub tbf_burst_bytes: u64,
    /// tbf queue latency, ms.
    pub tbf_latency_ms: f64,
    /// Batch sizes (tokens per layer call per frontend).
    pub batches: Vec<usize>,
    /// Seconds of measurement per batch size.
    pub seconds: f64,
    /// Seconds of warm-up per batch size.
    pub warmup: f64,
    /// Frontend connections per router.
    pub clients: usize,
    /// Model: hidden size.
    pub hidden: u32,
    /// Model: routed experts per layer.
    pub experts: u32,
    /// Model: experts per token.
    pub top_k: u32,
    /// Model: expert width.
    pub moe_inter: u32,
    /// Model: MoE layers.
    pub layers: u32,
    /// Router micro-batch (tokens).
    pub micro_batch: usize,
    /// CPU workers per node (with two or more, a remote node's leader fans dispatches out).
    pub devices_per_node: usize,
    /// Serving mode: exact (answers bit for bit) or serving (within [`SERVING_TOLERANCE`]).
    pub mode: LayerMode,
    /// Folder for the generated files and logs (default: a temporary folder, removed).
    pub dir: Option<PathBuf>,
    /// Scheduling niceness of the cluster's processes and frontends (negative: ahead of other
    /// work on a shared machine; 0 leaves it alone).
    pub nice: i32,
    /// The `expertmesh` binary to run in the namespaces (default: this one).
    pub exe: Option<PathBuf>,
}

impl ClusterBenchOptions {
    /// The standard run: 4 nodes at 100 Mbit/s, one router and one per node, batches 1-64.
    pub fn standard() -> Self {
        ClusterBenchOptions {
            nodes: 4,
            routers: vec![1, 4],
            line_rate_mbit: 100.0,
            scaled_from: None,
            mtu: 9000,
            tbf_burst_bytes: 256 * 1024,
            tbf_latency_ms: 100.0,
            batches: vec![1, 4, 16, 64],
            seconds: 6.0,
            warmup: 1.5,
            clients: 8,
            hidden: 2048,
            experts: 16,
            top_k: 4,
            moe_inter: 64,
            layers: 2,
            micro_batch: 32,
            devices_per_node: 1,
            mode: LayerMode::Exact,
            dir: None,
            nice: 0,
            exe: None,
        }
    }

    /// Small figures for the integration test: 3 nodes of 2 CPU workers at 40 Mbit/s, one
    /// router and one per node, batches 1 and 8, 1.5 s each after 0.5 s of warm-up (a row
    /// at batch 8 still counts about 90 calls; the test's band is 0.6-1.4 of the plan).
    pub fn quick() -> Self {
        ClusterBenchOptions {
            nodes: 3,
            routers: vec![1, 3],
            devices_per_node: 2,
            line_rate_mbit: 40.0,
            batches: vec![1, 8],
            seconds: 1.5,
            warmup: 0.5,
            clients: 6,
            hidden: 1024,
            experts: 12,
            top_k: 3,
            ..Self::standard()
        }
    }
}

/// One measured row.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ClusterRow {
    /// Routers in the cluster.
    pub routers: usize,
    /// Tokens per layer call per frontend.
    pub batch: usize,
    /// Tokens through every MoE layer per second, all frontends together.
    pub measured_tokens_per_s: f64,
    /// The planner's roofline for the same cluster.
    pub predicted_tokens_per_s: f64,
    /// The planner's bottleneck.
    pub bottleneck: String,
    /// Layer-call latency percentiles, ms.
    pub p50_ms: f64,
    /// 99th percentile, ms.
    pub p99_ms: f64,
    /// Layer calls measured.
    pub calls: u64,
    /// Bytes node 0's NIC received per token per layer (measured, Ethernet frames).
    pub router_nic_rx_bytes_per_token: f64,
    /// Bytes node 0's NIC sent per token per layer (measured).
    pub router_nic_tx_bytes_per_token: f64,
    /// The planner's bytes for node 0's NIC received per token per layer (headers added).
    pub predicted_router_nic_rx_bytes_per_token: f64,
    /// The planner's bytes for node 0's NIC sent per token per layer (headers added).
    pub predicted_router_nic_tx_bytes_per_token: f64,
    /// Share of the machine's CPU time busy during the measurement (all processes).
    pub cpu_busy: f64,
    /// Cores the cluster's own processes (routers, workers, this process's frontends) used.
    pub cluster_cores: f64,
    /// Packets the tbf shapers dropped during the measurement.
    pub tbf_drops: u64,
    /// TCP segments retransmitted during the measurement (all nodes).
    pub tcp_retransmits: u64,
    /// Answers that differed from the reference.
    pub mismatches: u64,
    /// Calls that failed.
    pub errors: u64,
}

impl ClusterRow {
    /// measured / predicted.
    pub fn ratio(&self) -> f64 {
        self.measured_tokens_per_s / self.predicted_tokens_per_s.max(1e-12)
    }
}

/// The outcome: rows, the bench JSON, and what went wrong.
pub struct ClusterOutcome {
    /// One row per (routers, batch).
    pub rows: Vec<ClusterRow>,
    /// Bench JSON (`expertmesh bench --help`): achieved = measured, limit = predicted.
    pub report: BenchReport,
    /// Mismatches and failed calls, described.
    pub problems: Vec<String>,
}

/// Run the benchmark: one emulated cluster per router count.
pub fn run(o: &ClusterBenchOptions) -> Result<ClusterOutcome, BenchError> {
    check(o)?;
    netns::install_signal_cleanup();
    if o.nice != 0 {
        // SAFETY: setpriority only changes this thread's niceness; threads started from it
        // (the frontends) inherit it.
        let rc = unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, o.nice) };
        if rc != 0 {
            return Err(BenchError::Nice {
                nice: o.nice,
                cause: std::io::Error::last_os_error(),
            });
        }
    }
    let tmp;
    let dir: &Path = match &o.dir {
        Some(d) => {
            std::fs::create_dir_all(d)
                .map_err(BenchError::io(format!("cannot create {}", d.display())))?;
            d
        }
        None => {
            tmp = tempfile::Builder::new()
                .prefix("expertmesh-cluster-")
                .tempdir()?;
            tmp.path()
        }
    };
    let mut out = ClusterOutcome {
        rows: Vec::new(),
        report: BenchReport::new(),
        problems: Vec::new(),
    };
    describe_machine(o, &mut out.report);
    // Every process runs a copy of this binary, so a rebuild during the run cannot swap it.
    let mut o = o.clone();
    if o.exe.is_none() {
        let src =
            std::env::current_exe().map_err(BenchError::io("cannot find the expertmesh binary"))?;
        let dst = dir.join("expertmesh");
        std::fs::copy(&src, &dst).map_err(BenchError::io(format!(
            "cannot copy {} to {}",
            src.display(),
            dst.display()
        )))?;
        o.exe = Some(dst);
    }
    for &routers in &o.routers {
        run_config(&o, dir, routers, &mut out)?;
    }
    Ok(out)
}

/// Refuses options the emulated cluster cannot run with, naming the option.
fn check(o: &ClusterBenchOptions) -> Result<(), BenchError> {
    let bad = |what: &str| Err(BenchError::Options(what.to_string()));
    if o.nodes < 2 {
        return bad("--nodes must be at least 2");
    }
    if !o.routers.iter().all(|&r| (1..=o.nodes).contains(&r)) {
        return bad("--routers must be between 1 and --nodes");
    }
    if o.batches.is_empty() || !o.batches.iter().all(|&b| (1..=256).contains(&b)) {
        return bad("--batches must list batch sizes in 1..=256");
    }
    Ok(())
}

/// Record the settings in the report's machine section.
fn describe_machine(o: &ClusterBenchOptions, report: &mut BenchReport) {
    let extra = &mut report.machine.extra;
    extra.insert("nodes".into(), o.nodes.into());
    extra.insert("devices_per_node".into(), o.devices_per_node.into());
    extra.insert("line_rate_mbit".into(), o.line_rate_mbit.into());
    extra.insert("mtu".into(), o.mtu.into());
    extra.insert("tbf_burst_bytes".into(), o.tbf_burst_bytes.into());
    extra.insert("tbf_latency_ms".into(), o.tbf_latency_ms.into());
    extra.insert("clients_per_router".into(), o.clients.into());
    extra.insert("nice".into(), o.nice.into());
    extra.insert(
        "model".into(),
        format!(
            "{} MoE layers, {} experts, top-{}, hidden {}, expert width {}",
            o.layers, o.experts, o.top_k, o.hidden, o.moe_inter
        )
        .into(),
    );
    extra.insert("mode".into(), o.mode.name().into());
    if let Ok(l) = std::fs::read_to_string("/proc/loadavg") {
        extra.insert("loadavg_at_start".into(), l.trim().into());
    }
}

/// One cluster: files, namespaces, processes, references, then every batch size.
fn run_config(
    o: &ClusterBenchOptions,
    dir: &Path,
    routers: usize,
    out: &mut ClusterOutcome,
) -> Result<(), BenchError> {
    let files = files::write(dir, o, routers)?;
    let dep = Deployment::load(
        &files.topology_path,
        &files.model_path.to_string_lossy(),
        &files.placement_path,
        SEED,
    )?;
    let mut emu = Emulation::create(
        o.nodes,
        Shaping {
            rate_mbit: o.line_rate_mbit,
            burst_bytes: o.tbf_burst_bytes,
            latency_ms: o.tbf_latency_ms,
            mtu: o.mtu,
        },
    )?;
    start_processes(&mut emu, o, &files, routers, dir)?;
    let fcfg = FrontendConfig::new(dep.topology.name());
    wait_ready(&mut emu, &dep, routers, &fcfg)?;
    println!(
        "emulated cluster: {} nodes x {} CPU workers, {routers} router(s), {} Mbit/s NICs; files and logs in {}",
        o.nodes,
        o.devices_per_node,
        o.line_rate_mbit,
        dir.display()
    );
    for &b in &o.batches {
        let pools = Pools::build(o, &dep, routers, b)?;
        let m = measure(&mut emu, o, &dep, routers, &pools, &fcfg)?;
        let predicted = predict(o, &files, Some(&pools.load), b, routers)?;
        let row = row_of(o, routers, b, &m, &predicted);
        print_row(&row);
        if let Some(p) = &m.first_problem {
            out.problems
                .push(format!("{routers} router(s), batch {b}: {p}"));
        }
        push_result(&mut out.report, &row);
        out.rows.push(row);
    }
    drop(emu);
    Ok(())
}

/// Start every worker and router in its node's namespace.
fn start_processes(
    emu: &mut Emulation,
    o: &ClusterBenchOptions,
    f: &ClusterFiles,
    routers: usize,
    dir: &Path,
) -> Result<(), BenchError> {
    let exe = match &o.exe {
        Some(e) => e.clone(),
        None => {
            std::env::current_exe().map_err(BenchError::io("cannot find the expertmesh binary"))?
        }
    };
    let s = |p: &Path| p.to_string_lossy().into_owned();
    let deploy = [
        "--topology".to_owned(),
        s(&f.topology_path),
        "--model".to_owned(),
        s(&f.model_path),
        "--placement".to_owned(),
        s(&f.placement_path),
        // The emulated nodes talk over a private bridge of this host's own namespaces; the
        // bench measures the plain wire the planner models (sealed links cost CPU the model
        // does not count), so it runs without credentials on purpose.
        "--insecure".to_owned(),
    ];
    let nice: Vec<String> = if o.nice != 0 {
        vec!["nice".into(), "-n".into(), o.nice.to_string()]
    } else {
        Vec::new()
    };
    for (i, k) in (0..emu.nodes()).flat_map(|i| (0..o.devices_per_node).map(move |k| (i, k))) {
        let mut args = nice.clone();
        args.extend([s(&exe), "worker".to_owned()]);
        args.extend(deploy.iter().cloned());
        args.extend(
            [
                "--device",
                &format!("n{i}/cpu{k}"),
                "--threads",
                "1",
                "--max-tokens",
                &o.micro_batch.to_string(),
            ]
            .map(String::from),
        );
        let log = dir.join(format!("worker-n{i}-cpu{k}-{routers}r.log"));
        emu.spawn(i, &args, &log)?;
    }
    for r in 0..routers {
        let mut args = nice.clone();
        args.extend([s(&exe), "router".to_owned()]);
        args.extend(deploy.iter().cloned());
        args.extend(
            [
                "--mode",
                o.mode.name(),
                "--micro-batch",
                &o.micro_batch.to_string(),
                "--max-tokens",
                "256",
            ]
            .map(String::from),
        );
        if routers > 1 {
            args.extend(["--instance".to_owned(), r.to_string()]);
        }
        emu.spawn(r, &args, &dir.join(format!("router{r}-{routers}r.log")))?;
    }
    Ok(())
}

/// A router's frontend address.
fn router_addr(r: usize) -> std::net::SocketAddr {
    let ip: std::net::Ipv4Addr = Emulation::node_address(r).parse().expect("literal address");
    (ip, ROUTER_PORT).into()
}

/// Wait until every router answers a one-token call (every worker connected), up to 60 s.
fn wait_ready(
    emu: &mut Emulation,
    dep: &Deployment,
    routers: usize,
    fcfg: &FrontendConfig,
) -> Result<(), BenchError> {
    let h = dep.spec.hidden as usize;
    let layer = dep.spec.moe_layer_ids()[0];
    // 32 tokens: every device is touched, so every worker has connected once this answers.
    let x = reference::synthetic_hidden(1, 32, h);
    let until = Instant::now() + Duration::from_secs(60);
    for r in 0..routers {
        let ns = emu.node_ns(r);
        let mut last = String::new();
        loop {
            if let Some(e) = emu.exited() {
                return Err(BenchError::ProcessExited(e));
            }
            let (cfg, x) = (fcfg.clone(), x.clone());
            let attempt = in_namespace(&ns, move |rt| {
                rt.block_on(async {
                    let mut c = RouterClient::connect(router_addr(r), &cfg).await?;
                    c.call(layer, &x, h, None, None).await
                })
                .map_err(BenchError::from)
            });
            match attempt {
                Ok(_) => break,
                Err(e) if Instant::now() < until => {
                    last = e.to_string();
                    std::thread::sleep(Duration::from_millis(200));
                }
                Err(e) => {
                    return Err(BenchError::NotReady {
                        router: r,
                        cause: Box::new(e),
                        last,
                    });
                }
            }
        }
    }
    Ok(())
}

/// Run `f` on a new thread inside namespace `ns` with a current-thread runtime.
fn in_namespace<T: Send + 'static>(
    ns: &str,
    f: impl FnOnce(&tokio::runtime::Runtime) -> Result<T, BenchError> + Send + 'static,
) -> Result<T, BenchError> {
    let ns = ns.to_owned();
    std::thread::spawn(move || {
        netns::enter(&ns)?;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        f(&rt)
    })
    .join()
    .map_err(|_| BenchError::Panicked("frontend thread"))?
}

/// Inputs and expected outputs per (router, client): a pool each client cycles through, and
/// the expert load they add up to.
struct Pools {
    /// `[router][client]` → entries of (input, expected output per layer).
    per_client: Vec<Vec<Arc<Vec<Entry>>>>,
    /// Expert selections of all pooled tokens (the planner's `--load`).
    load: LoadStats,
}

/// One pooled input.
struct Entry {
    x: Vec<f32>,
    want: Vec<Vec<f32>>,
}

impl Pools {
    /// Enough distinct tokens per client (at least 64, 2-16 inputs) that the routing seen on
    /// the wire averages out; expected outputs from the in-process reference.
    fn build(
        o: &ClusterBenchOptions,
        dep: &Deployment,
        routers: usize,
        b: usize,
    ) -> Result<Pools, BenchError> {
        let spec = &dep.spec;
        let (h, layers) = (spec.hidden as usize, spec.moe_layer_ids());
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let mut backend =
            expertmesh_worker::weights::reference_backend(spec, dep.seed, &layers, threads, b)
                .map_err(BenchError::ReferenceBackend)?;
        let gates: Vec<_> = layers
            .iter()
            .map(|&l| reference::synthetic_gate(spec, dep.seed, l))
            .collect();
        let per = (64 / b).clamp(2, 16);
        let e = spec.routed_experts as usize;
        let mut counts = vec![vec![0.0f64; e]; layers.len()];
        let mut per_client = Vec::new();
        for r in 0..routers {
            let mut clients = Vec::new();
            for c in 0..o.clients {
                let mut entries = Vec::new();
                for i in 0..per {
                    let seed = (((r * 1000 + c) * 1000 + i) * 1000 + b) as u64;
                    let x = reference::synthetic_hidden(seed, b, h);
                    let mut want = Vec::new();
                    for (li, &l) in layers.iter().enumerate() {
                        let (routing, y) = reference::moe_layer_backend(
                            spec,
                            &gates[li],
                            l,
                            &mut backend,
                            &x,
                            ComputeMode::Exact,
                        )
                        .map_err(BenchError::ReferenceLayer)?;
                        for &x in &routing.experts {
                            counts[li][x as usize] += 1.0;
                        }
                        want.push(y);
                    }
                    entries.push(Entry { x, want });
                }
                clients.push(Arc::new(entries));
            }
            per_client.push(clients);
        }
        let load = LoadStats::new(spec, counts.into_iter().map(Some).collect())
            .map_err(BenchError::LoadStats)?;
        Ok(Pools { per_client, load })
    }
}

/// What the frontends saw in one measurement.
#[derive(Default)]
struct Measured {
    calls: u64,
    /// Layer calls per second, all frontends ([`call_rate`]).
    calls_per_s: f64,
    latencies_ms: Vec<f64>,
    mismatches: u64,
    errors: u64,
    first_problem: Option<String>,
    /// Node 0's NIC bytes per second (sent, received) during the measurement.
    nic_tx_per_s: f64,
    nic_rx_per_s: f64,
    /// Share of CPU time busy during the measurement.
    cpu_busy: f64,
    /// Cores the cluster's processes (routers, workers, frontends) kept busy.
    own_cpu: f64,
    /// Packets the shapers dropped during the measurement.
    tbf_drops: u64,
    /// TCP segments retransmitted during the measurement (all nodes).
    tcp_retransmits: u64,
}

/// (busy, total) CPU jiffies of the whole machine (`/proc/stat`), when readable.
fn cpu_jiffies() -> Option<(u64, u64)> {
    let text = std::fs::read_to_string("/proc/stat").ok()?;
    let line = text.lines().next()?.strip_prefix("cpu ")?;
    let v: Vec<u64> = line
        .split_whitespace()
        .filter_map(|x| x.parse().ok())
        .collect();
    let total: u64 = v.iter().take(8).sum();
    let idle = v.get(3)? + v.get(4).unwrap_or(&0);
    Some((total - idle, total))
}

/// Counters the frontend tasks share.
#[derive(Default)]
struct Shared {
    /// None: answers must be bit-identical; else the largest error relative to the RMS.
    tolerance: Option<f64>,
    stop: AtomicBool,
    measuring: AtomicBool,
    calls: AtomicU64,
    mismatches: AtomicU64,
    errors: AtomicU64,
    latencies_ms: Mutex<Vec<f64>>,
    first_problem: Mutex<Option<String>>,
}

impl Shared {
    fn problem(&self, what: String) {
        if let Ok(mut p) = self.first_problem.lock() {
            p.get_or_insert(what);
        }
    }
}

/// Warm up, then measure for `o.seconds`: every router's frontends call every layer in turn
/// with their pooled batches, checking each answer.
fn measure(
    emu: &mut Emulation,
    o: &ClusterBenchOptions,
    dep: &Deployment,
    routers: usize,
    pools: &Pools,
    fcfg: &FrontendConfig,
) -> Result<Measured, BenchError> {
    let shared = Arc::new(Shared {
        tolerance: (o.mode != LayerMode::Exact).then_some(SERVING_TOLERANCE),
        ..Shared::default()
    });
    let mut threads = Vec::new();
    for r in 0..routers {
        let ns = emu.node_ns(r);
        let job = FrontendJob {
            router: r,
            layers: dep.spec.moe_layer_ids(),
            hidden: dep.spec.hidden as usize,
            pools: pools.per_client[r].clone(),
            cfg: fcfg.clone(),
            shared: shared.clone(),
        };
        threads.push(std::thread::spawn(move || {
            in_namespace(&ns, move |rt| rt.block_on(job.run()))
        }));
    }
    std::thread::sleep(Duration::from_secs_f64(o.warmup));
    // The slow samples (a few `ip netns exec` each) first; the NIC counters right at the
    // window's edges, each timed.
    let cpu0 = cpu_jiffies();
    let own0 = emu.cpu_seconds();
    let (drops0, retrans0) = emu.drops_and_retransmits();
    let tn0 = Instant::now();
    let (tx0, rx0) = emu.nic_bytes(0)?;
    let calls0 = shared.calls.load(Ordering::SeqCst);
    shared.measuring.store(true, Ordering::SeqCst);
    let t0 = Instant::now();
    std::thread::sleep(Duration::from_secs_f64(o.seconds));
    let calls1 = shared.calls.load(Ordering::SeqCst);
    let t1 = Instant::now();
    let secs = (t1 - t0).as_secs_f64();
    shared.measuring.store(false, Ordering::SeqCst);
    let (tx1, rx1) = emu.nic_bytes(0)?;
    let nic_secs = tn0.elapsed().as_secs_f64().max(1e-9);
    let own_cpu = (emu.cpu_seconds() - own0) / secs.max(1e-9);
    let (drops1, retrans1) = emu.drops_and_retransmits();
    let cpu_busy = match (cpu0, cpu_jiffies()) {
        (Some((b0, t0)), Some((b1, t1))) if t1 > t0 => (b1 - b0) as f64 / (t1 - t0) as f64,
        _ => 0.0,
    };
    shared.stop.store(true, Ordering::SeqCst);
    let mut completions = Vec::new();
    for t in threads {
        completions.extend(
            t.join()
                .map_err(|_| BenchError::Panicked("frontend thread"))??,
        );
    }
    if let Some(e) = emu.exited() {
        return Err(BenchError::ProcessExited(e));
    }
    let latencies_ms = std::mem::take(&mut *shared.latencies_ms.lock().expect("not poisoned"));
    let first_problem = shared.first_problem.lock().expect("not poisoned").clone();
    Ok(Measured {
        calls: calls1 - calls0,
        calls_per_s: call_rate(&completions, t0, t1),
        latencies_ms,
        mismatches: shared.mismatches.load(Ordering::SeqCst),
        errors: shared.errors.load(Ordering::SeqCst),
        first_problem,
        nic_tx_per_s: (tx1 - tx0) as f64 / nic_secs,
        nic_rx_per_s: (rx1 - rx0) as f64 / nic_secs,
        cpu_busy,
        own_cpu,
        tbf_drops: drops1 - drops0,
        tcp_retransmits: retrans1 - retrans0,
    })
}

/// One router's frontends.
struct FrontendJob {
    router: usize,
    layers: Vec<u32>,
    hidden: usize,
    pools: Vec<Arc<Vec<Entry>>>,
    cfg: FrontendConfig,
    shared: Arc<Shared>,
}

impl FrontendJob {
    /// Connect every client, then call layer after layer until told to stop; each client's
    /// call completion times.
    async fn run(self) -> Result<Vec<Vec<Instant>>, BenchError> {
        let mut tasks = Vec::new();
        for pool in &self.pools {
            let c = RouterClient::connect(router_addr(self.router), &self.cfg)
                .await
                .map_err(|cause| BenchError::RouterClient {
                    router: self.router,
                    cause: Box::new(cause),
                })?;
            let (layers, h) = (self.layers.clone(), self.hidden);
            let (pool, shared) = (pool.clone(), self.shared.clone());
            tasks.push(tokio::spawn(client_loop(c, layers, h, pool, shared)));
        }
        let mut done = Vec::new();
        for t in tasks {
            done.push(t.await?);
        }
        Ok(done)
    }
}

/// One frontend: for each pooled input, every layer in turn; answers compared bit for bit.
/// Returns when each successful call completed.
async fn client_loop(
    mut c: RouterClient,
    layers: Vec<u32>,
    h: usize,
    pool: Arc<Vec<Entry>>,
    shared: Arc<Shared>,
) -> Vec<Instant> {
    let mut done = Vec::new();
    let mut i = 0usize;
    while !shared.stop.load(Ordering::Relaxed) {
        let entry = &pool[i % pool.len()];
        i += 1;
        for (li, &layer) in layers.iter().enumerate() {
            let measuring = shared.measuring.load(Ordering::Relaxed);
            let t0 = Instant::now();
            match c.call(layer, &entry.x, h, None, None).await {
                Ok(y) => {
                    done.push(Instant::now());
                    let ms = t0.elapsed().as_secs_f64() * 1e3;
                    if measuring && shared.measuring.load(Ordering::Relaxed) {
                        shared.latencies_ms.lock().expect("not poisoned").push(ms);
                    }
                    let want = &entry.want[li];
                    let same = y.len() == want.len()
                        && match shared.tolerance {
                            None => y.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits()),
                            Some(tol) => {
                                let want: Vec<f64> = want.iter().map(|&v| f64::from(v)).collect();
                                reference::rms_error(&y, &want) <= tol
                            }
                        };
                    if !same {
                        shared.mismatches.fetch_add(1, Ordering::Relaxed);
                        shared.problem(format!("layer {layer}: answer differs from the reference"));
                    }
                }
                Err(e) => {
                    shared.errors.fetch_add(1, Ordering::Relaxed);
                    shared.problem(format!("layer {layer}: {e}"));
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
            shared.calls.fetch_add(1, Ordering::Relaxed);
        }
    }
    done
}

/// Calls per second over the window `[t0, t1]`, free of edge effects: per client, its
/// completions inside the window less one over the time between the first and the last of
/// them (a client with fewer than two: its count over the window), summed over clients.
fn call_rate(clients: &[Vec<Instant>], t0: Instant, t1: Instant) -> f64 {
    let window = (t1 - t0).as_secs_f64().max(1e-9);
    clients
        .iter()
        .map(|times| {
            let inside: Vec<Instant> = times
                .iter()
                .copied()
                .filter(|&t| t >= t0 && t <= t1)
                .collect();
            match (inside.first(), inside.last()) {
                (Some(&a), Some(&b)) if inside.len() >= 2 && b > a => {
                    (inside.len() - 1) as f64 / (b - a).as_secs_f64()
                }
                _ => inside.len() as f64 / window,
            }
        })
        .sum()
}

/// What the planner predicts for one batch size.
struct Prediction {
    roofline: Roofline,
    /// Node 0's NIC bytes per token per layer, with TCP/IP and Ethernet headers as the NIC
    /// counters see them (`mtu + 14` bytes on the wire per `mtu - 52` of stream).
    nic0: NicBytes,
}

/// The planner's roofline for the generated cluster at batch `b`, with every router's
/// frontends' calls in flight, on the wire of the mode measured.
fn predict(
    o: &ClusterBenchOptions,
    f: &ClusterFiles,
    load: Option<&LoadStats>,
    b: usize,
    routers: usize,
) -> Result<Prediction, BenchError> {
    let hw = Hardware::from_topology(&f.topology);
    let wire = expertmesh_fabric::wire_model::wire_model(o.mode, f.model.hidden, o.micro_batch)?;
    let ev = Evaluator::new(
        &f.topology,
        &f.model,
        &f.placement,
        load,
        None,
        hw.router_node,
    )
    .with_wire(wire);
    let framing = f64::from(o.mtu + 14) / f64::from(o.mtu - 52);
    let nic = ev.nic_bytes_per_token(&hw, b)[0];
    Ok(Prediction {
        roofline: ev.roofline(&hw, b, routers * o.clients),
        nic0: NicBytes {
            sent: nic.sent * framing,
            received: nic.received * framing,
        },
    })
}

/// A table row from a measurement and its prediction.
fn row_of(
    o: &ClusterBenchOptions,
    routers: usize,
    b: usize,
    m: &Measured,
    pred: &Prediction,
) -> ClusterRow {
    let p = &pred.roofline;
    let mut lat = m.latencies_ms.clone();
    lat.sort_by(f64::total_cmp);
    let layers = f64::from(o.layers.max(1));
    // Tokens through one layer per second, at the measured rate.
    let layer_tokens = (m.calls_per_s * b as f64).max(1e-9);
    ClusterRow {
        routers,
        batch: b,
        measured_tokens_per_s: m.calls_per_s * b as f64 / layers,
        predicted_tokens_per_s: p.tokens_per_s,
        bottleneck: p.bottleneck.clone(),
        p50_ms: percentile(&lat, 50.0),
        p99_ms: percentile(&lat, 99.0),
        calls: m.calls,
        router_nic_rx_bytes_per_token: m.nic_rx_per_s / layer_tokens,
        router_nic_tx_bytes_per_token: m.nic_tx_per_s / layer_tokens,
        predicted_router_nic_rx_bytes_per_token: pred.nic0.received,
        predicted_router_nic_tx_bytes_per_token: pred.nic0.sent,
        cpu_busy: m.cpu_busy,
        cluster_cores: m.own_cpu,
        tbf_drops: m.tbf_drops,
        tcp_retransmits: m.tcp_retransmits,
        mismatches: m.mismatches,
        errors: m.errors,
    }
}

fn print_row(r: &ClusterRow) {
    println!(
        "routers {:>2}  batch {:>3}: {:>8.0} tokens/s measured, {:>8.0} predicted ({}), ratio {:.3}; layer call p50 {:.2} ms, p99 {:.2} ms; node 0 NIC B/token in {:.0} (plan {:.0}), out {:.0} (plan {:.0}); CPU {:.0}% busy (cluster {:.2} cores); {} tbf drops, {} TCP retransmits; {} calls, {} mismatches, {} errors",
        r.routers,
        r.batch,
        r.measured_tokens_per_s,
        r.predicted_tokens_per_s,
        r.bottleneck,
        r.ratio(),
        r.p50_ms,
        r.p99_ms,
        r.router_nic_rx_bytes_per_token,
        r.predicted_router_nic_rx_bytes_per_token,
        r.router_nic_tx_bytes_per_token,
        r.predicted_router_nic_tx_bytes_per_token,
        100.0 * r.cpu_busy,
        r.cluster_cores,
        r.tbf_drops,
        r.tcp_retransmits,
        r.calls,
        r.mismatches,
        r.errors
    );
}

fn push_result(report: &mut BenchReport, r: &ClusterRow) {
    report.results.push(
        BenchResult::new(
            format!("cluster-{}router", r.routers),
            r.batch as u64,
            r.measured_tokens_per_s,
            r.predicted_tokens_per_s,
            "tokens/s",
        )
        .with(
            "limit_is",
            "expertmesh plan's roofline for the same topology",
        )
        // A prediction to compare with, not a bound the measurement cannot pass.
        .against_reference()
        .with("bottleneck", r.bottleneck.clone())
        .with("routers", r.routers as u64)
        .with("p50_ms", r.p50_ms)
        .with("p99_ms", r.p99_ms)
        .with("calls", r.calls)
        .with("mismatches", r.mismatches)
        .with("errors", r.errors)
        .with(
            "router_nic_rx_bytes_per_token",
            r.router_nic_rx_bytes_per_token,
        )
        .with(
            "router_nic_tx_bytes_per_token",
            r.router_nic_tx_bytes_per_token,
        )
        .with(
            "predicted_router_nic_rx_bytes_per_token",
            r.predicted_router_nic_rx_bytes_per_token,
        )
        .with(
            "predicted_router_nic_tx_bytes_per_token",
            r.predicted_router_nic_tx_bytes_per_token,
        )
        .with("cpu_busy", r.cpu_busy)
        .with("cluster_cores", r.cluster_cores)
        .with("tbf_drops", r.tbf_drops)
        .with("tcp_retransmits", r.tcp_retransmits),
    );
}

impl ClusterOutcome {
    /// Prints the rows as a Markdown table: measured and predicted tokens/s, their ratio,
    /// latency percentiles and the predicted bottleneck.
    pub fn print_table(&self) {
        println!();
        println!(
            "| routers | batch | tokens/s measured | predicted | ratio | p50 ms | p99 ms | bottleneck |"
        );
        println!("|---|---|---|---|---|---|---|---|");
        for r in &self.rows {
            println!(
                "| {} | {} | {:.0} | {:.0} | {:.2} | {:.2} | {:.2} | {} |",
                r.routers,
                r.batch,
                r.measured_tokens_per_s,
                r.predicted_tokens_per_s,
                r.ratio(),
                r.p50_ms,
                r.p99_ms,
                r.bottleneck
            );
        }
    }
}
