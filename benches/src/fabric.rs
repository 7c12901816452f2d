//! `expertmesh bench fabric`: tokens/s of one MoE layer through the local fabric against the
//! same layer run in-process by the same backend, measured in the same run.
//!
//! Why this exists: it answers "what does distributing the experts cost?" The in-process
//! figure is the ceiling — gate (its logits on as many threads as the backend has), the CPU
//! backend running every expert of the layer with all the cores the workers have together,
//! combine — and the fabric figure is the same work
//! through the router, the transport and worker processes, with several frontends keeping it
//! busy. The ceiling does the same work with the same concurrency: the `clients` frontends
//! each send their own `b` of the same `clients × b` distinct tokens (clients sending the
//! same tokens would route to fewer experts than the ceiling reads), the router may batch all
//! of them together (its largest batch is `clients ×` the largest call), and the ceiling runs
//! them in-process as that one batch, cut into the router's micro-batches (what an ideal
//! batcher would run; the backend reads each expert once per micro-batch, so this is the
//! fastest way through that work), measured right before and right after each fabric
//! measurement (the better of the two: on a shared machine a limit taken once, long before,
//! is another moment's). `ratio = fabric / in-process` (at most 1); the target is
//! ≥ 0.9 at batch 64 on two workers. The router's micro-batch is its largest batch (at most
//! what one frame carries) unless `--micro-batch` says otherwise (see [`micro_batch`]).
//!
//! Latency rows (`... latency_p50` / `_p99`, batch 1): one frontend calling a 1-token layer
//! again and again, against a floor measured in the same run: the in-process 1-token layer
//! time, which no fabric can beat (`ratio ≥ 1`, lower is better; the ratio is what the
//! frontend's call and the worker's hop cost on top of the compute). A raw blocking loopback
//! TCP round trip of the same bytes is measured too and recorded beside it
//! (`raw_tcp_round_trip_us_p50`), but it is not part of the floor: on a small VM a blocking
//! socket's wake-ups can cost more than the fabric's whole hop (its threads spin briefly before
//! they park), so it is not a lower bound. A second row
//! (`... window`) repeats it with another frontend connected but idle, so the batch window
//! applies: what every lone call paid before the window learned to close when every connected
//! frontend is waiting. The wire table prints the bytes per token per layer each serving mode
//! sends (`codec::wire_bytes_per_token`, from encoded frames) for this model and Kimi K2.

use crate::BenchError;
use crate::method::json::{BenchReport, BenchResult};
use expertmesh_fabric::local::{LocalFabric, LocalFabricOptions};
use expertmesh_router::client::RouterClient;
use expertmesh_router::core::{LayerMode, RouterConfig};
use expertmesh_router::reference;
use expertmesh_transport::codec;
use expertmesh_transport::mesh::LinkKind;
use expertmesh_worker::deploy::Deployment;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Options of `bench fabric`.
#[derive(Clone, Debug)]
pub struct FabricBenchOptions {
    /// Topology (default: the embedded single-host example).
    pub topology: Option<PathBuf>,
    /// Model.
    pub model: String,
    /// Placement (default: the embedded single-host placement of demo-small).
    pub placement: Option<PathBuf>,
    /// Batch sizes (tokens per layer call).
    pub batches: Vec<usize>,
    /// Seconds per measurement.
    pub seconds: f64,
    /// Concurrent frontend clients.
    pub clients: usize,
    /// Links to measure.
    pub links: Vec<LinkKind>,
    /// Serving mode.
    pub mode: LayerMode,
    /// Tokens per micro-batch (the router's split, and the workers' batch limit); `None`: the
    /// largest batch, so a call is never split (see [`micro_batch`]).
    pub micro_batch: Option<usize>,
}

/// Run the benchmark.
pub fn run(o: &FabricBenchOptions) -> Result<BenchReport, BenchError> {
    if o.batches.is_empty() || o.batches.contains(&0) {
        return Err(BenchError::Options("--batches needs sizes >= 1".into()));
    }
    let tmp = tempfile::Builder::new()
        .prefix("expertmesh-bench-")
        .tempdir()?;
    let (topology, placement, _planned) = expertmesh_fabric::defaults::local_files(
        tmp.path(),
        o.topology.as_deref(),
        &o.model,
        o.placement.as_deref(),
    )?;
    let mut report = BenchReport::new();
    let dep = Deployment::load(&topology, &o.model, &placement, 42)?;
    let spec = dep.spec.clone();
    let layer = spec.moe_layer_ids()[0];
    // Cores the workers have together: the in-process run gets the same.
    let threads: usize = dep
        .topology
        .devices()
        .iter()
        .map(|d| d.threads().unwrap_or(1) as usize)
        .sum::<usize>()
        .max(1);
    report
        .machine
        .extra
        .insert("model".into(), spec.name.clone().into());
    report
        .machine
        .extra
        .insert("workers".into(), dep.topology.devices().len().into());
    report
        .machine
        .extra
        .insert("in_process_threads".into(), threads.into());
    let micro_batch_tokens = micro_batch(o, &dep);
    report
        .machine
        .extra
        .insert("micro_batch_tokens".into(), micro_batch_tokens.into());
    print_wire_table(&spec);
    if let Some(kimi) = expertmesh_topology::model::preset_by_name("kimi-k2") {
        print_wire_table(&kimi);
    }
    let mut limits = InProcess::new(o, &dep, layer, threads, micro_batch_tokens)?;
    for &link in &o.links {
        let mut run = LinkRun {
            o,
            dep: &dep,
            layer,
            threads,
            micro_batch_tokens,
            limits: &mut limits,
        };
        run.bench(&topology, &placement, link, &mut report)?;
    }
    Ok(report)
}

/// Tokens per micro-batch: as asked, else what `up` uses on one host (the largest batch, at
/// most what one frame carries). Micro-batches exist to overlap the wire with compute across
/// hosts; on one host there is little wire to hide, and each micro-batch streams every expert
/// it touches again (16-token micro-batches of 64-token calls cost this bench 14-19 % of its
/// tokens per second on a 2-vCPU EPYC: 0.66-0.73 against 0.75-0.87 of the in-process layer,
/// both links).
fn micro_batch(o: &FabricBenchOptions, dep: &Deployment) -> usize {
    let router = o.mode.apply(RouterConfig {
        max_batch_tokens: router_batch(o),
        ..RouterConfig::default()
    });
    o.micro_batch
        .unwrap_or_else(|| expertmesh_fabric::local::one_host_micro_batch(dep, &router))
        .max(1)
}

/// The largest batch size (the router's largest request).
fn max_batch(o: &FabricBenchOptions) -> usize {
    o.batches.iter().copied().max().unwrap_or(64)
}

/// The router's largest batch: every client's largest call at once (what the in-process
/// limit runs as one batch).
fn router_batch(o: &FabricBenchOptions) -> usize {
    max_batch(o) * o.clients.max(1)
}

/// Client `i`'s tokens of the `clients × b` the in-process limit runs: its own `b` of them.
fn client_tokens(all: &[f32], i: usize, b: usize, h: usize) -> Vec<f32> {
    all[i * b * h..(i + 1) * b * h].to_vec()
}

/// One in-process layer call on `x` (gate, route, the backend's experts, combine), the gate's
/// logits computed by [`logits_threaded`] on up to `threads` threads. The fabric's router
/// computes the gate while the workers compute other batches, so a limit whose gate ran on
/// one thread while the backend's other threads waited would leave a core idle the fabric can
/// use: at 4 × 64 tokens of demo-small the gate is about a tenth of the call.
fn layer_call(
    spec: &expertmesh_topology::model::ModelSpec,
    gate: &expertmesh_router::gating::GateWeights,
    layer: u32,
    backend: &mut dyn expertmesh_backend::ExpertBackend,
    x: &[f32],
    mode: expertmesh_quant::contract::ComputeMode,
    threads: usize,
) -> Result<(), BenchError> {
    let logits = logits_threaded(gate, x, threads);
    reference::moe_layer_backend_from_logits(
        spec,
        gate,
        layer,
        backend,
        x,
        &logits,
        mode,
        reference::ExpertRounding::None,
    )
    .map_err(BenchError::ReferenceLayer)?;
    Ok(())
}

/// Tokens each extra gate thread takes at least: a thread started per call costs tens of µs
/// on a small VM, about what the gate of 64 tokens of demo-small takes.
const GATE_TOKENS_PER_THREAD: usize = 64;

/// The gate's logits of `x` (`[tokens][experts]`, bit-identical to
/// [`GateWeights::logits`](expertmesh_router::gating::GateWeights::logits): each token's logits
/// are computed alone), over contiguous token ranges on up to `threads` threads, one of them
/// the caller's, each with at least [`GATE_TOKENS_PER_THREAD`] tokens.
fn logits_threaded(
    gate: &expertmesh_router::gating::GateWeights,
    x: &[f32],
    threads: usize,
) -> Vec<f32> {
    let (h, e) = (gate.hidden, gate.experts);
    let tokens = x.len() / h;
    let mut logits = vec![0f32; tokens * e];
    let used = threads.min(tokens / GATE_TOKENS_PER_THREAD).max(1);
    let per = tokens.div_ceil(used).max(1);
    std::thread::scope(|scope| {
        let mut parts = x.chunks(per * h).zip(logits.chunks_mut(per * e));
        let first = parts.next();
        for (xs, ls) in parts {
            scope.spawn(move || gate.logits_into(xs, ls));
        }
        if let Some((xs, ls)) = first {
            gate.logits_into(xs, ls);
        }
    });
    logits
}

/// The in-process layer: one backend with the workers' threads, the gate, and the 1-token
/// call's p50 time (the latency rows' floor). Its tokens/s for a batch size is measured right
/// before and right after each fabric measurement of that size ([`InProcess::tokens_per_s`]):
/// on a shared machine a limit taken once, long before, is another moment's.
struct InProcess {
    backend: expertmesh_cpu_backend::CpuBackend,
    gate: expertmesh_router::gating::GateWeights,
    spec: expertmesh_topology::model::ModelSpec,
    layer: u32,
    threads: usize,
    clients: usize,
    micro_batch_tokens: usize,
    mode: expertmesh_quant::contract::ComputeMode,
    seconds: f64,
    one_token_us: f64,
}

impl InProcess {
    /// Loads the layer's experts and measures the 1-token floor.
    fn new(
        o: &FabricBenchOptions,
        dep: &Deployment,
        layer: u32,
        threads: usize,
        micro_batch_tokens: usize,
    ) -> Result<Self, BenchError> {
        let spec = dep.spec.clone();
        let backend = expertmesh_worker::weights::reference_backend(
            &spec,
            dep.seed,
            &[layer],
            threads,
            router_batch(o),
        )
        .map_err(BenchError::ReferenceBackend)?;
        let gate = reference::synthetic_gate(&spec, dep.seed, layer);
        let mut me = Self {
            backend,
            gate,
            spec,
            layer,
            threads,
            clients: o.clients.max(1),
            micro_batch_tokens: micro_batch_tokens.max(1),
            mode: o.mode.compute(),
            seconds: o.seconds,
            one_token_us: 0.0,
        };
        let x = reference::synthetic_hidden(1, 1, me.spec.hidden as usize);
        let mut lat = Vec::new();
        let t0 = Instant::now();
        while t0.elapsed().as_secs_f64() < o.seconds.min(1.0) || lat.len() < 20 {
            let t = Instant::now();
            me.call(&x, 1)?;
            lat.push(t.elapsed().as_secs_f64() * 1e6);
        }
        lat.sort_by(f64::total_cmp);
        me.one_token_us = crate::method::stats::percentile(&lat, 50.0);
        println!(
            "in-process layer, 1 token: p50 {:.0} us ({threads} threads)",
            me.one_token_us
        );
        Ok(me)
    }

    /// One layer call on `x` in the router's micro-batches.
    fn call(&mut self, x: &[f32], threads: usize) -> Result<(), BenchError> {
        let h = self.spec.hidden as usize;
        for part in x.chunks(self.micro_batch_tokens * h) {
            layer_call(
                &self.spec,
                &self.gate,
                self.layer,
                &mut self.backend,
                part,
                self.mode,
                threads,
            )?;
        }
        Ok(())
    }

    /// Tokens/s of the clients' concurrent `b`-token calls as the one batch an ideal batcher
    /// would make (their distinct tokens, [`client_tokens`]), for about `seconds`.
    fn tokens_per_s(&mut self, b: usize) -> Result<f64, BenchError> {
        let tokens = b * self.clients;
        let x = reference::synthetic_hidden(b as u64, tokens, self.spec.hidden as usize);
        self.call(&x, self.threads)?;
        let t0 = Instant::now();
        let mut calls = 0u64;
        while t0.elapsed().as_secs_f64() < self.seconds || calls < 3 {
            self.call(&x, self.threads)?;
            calls += 1;
        }
        Ok((calls as usize * tokens) as f64 / t0.elapsed().as_secs_f64())
    }
}

/// What every link's measurement shares.
struct LinkRun<'a> {
    o: &'a FabricBenchOptions,
    dep: &'a Deployment,
    layer: u32,
    threads: usize,
    /// The routers' micro-batch ([`micro_batch`]).
    micro_batch_tokens: usize,
    /// The in-process layer (limits measured beside each fabric measurement).
    limits: &'a mut InProcess,
}

impl LinkRun<'_> {
    /// Fabric step: start a local fabric over `link`, measure every batch size, and record
    /// the router's stats.
    fn bench(
        &mut self,
        topology: &std::path::Path,
        placement: &std::path::Path,
        link: LinkKind,
        report: &mut BenchReport,
    ) -> Result<(), BenchError> {
        let (o, spec, threads) = (self.o, &self.dep.spec, self.threads);
        let maxb = max_batch(o);
        let mut opts = LocalFabricOptions::new(topology, &o.model, placement);
        opts.ephemeral_ports = true;
        opts.link = link;
        // Every client of this bench is one unnamed frontend: let it open them all.
        let cap = &mut opts.frontend_limits.max_connections_per_frontend;
        *cap = (*cap).max(u32::try_from(o.clients).unwrap_or(u32::MAX));
        opts.router = o.mode.apply(RouterConfig {
            max_request_tokens: maxb,
            max_batch_tokens: router_batch(o),
            // Every client's largest request in flight at once.
            max_inflight_tokens: RouterConfig::default()
                .max_inflight_tokens
                .max(maxb * o.clients.max(1)),
            micro_batch_tokens: self.micro_batch_tokens,
            batch_window: Duration::from_micros(50),
            ..RouterConfig::default()
        });
        let fabric = LocalFabric::start(opts)?;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        for &b in &o.batches {
            // The limit right before and right after: the better of the two (a limit is the
            // most the same work reaches), both recorded.
            let before = self.limits.tokens_per_s(b)?;
            let tps = self.measure(&rt, &fabric, b)?;
            let after = self.limits.tokens_per_s(b)?;
            let limit = before.max(after);
            println!(
                "fabric over {}, batch {b:>3}: {tps:>9.0} tokens/s = {:.3} of in-process \
                 ({before:.0} before, {after:.0} after; {} clients)",
                link.name(),
                tps / limit,
                o.clients
            );
            report.results.push(
                BenchResult::new(
                    format!("fabric-{}-{} {}", link.name(), o.mode.name(), spec.name),
                    b as u64,
                    tps,
                    limit,
                    "tokens/s",
                )
                .with(
                    "limit_is",
                    format!(
                        "the same layer in-process on one CPU backend with {threads} threads, the {} clients' {b}-token batches (distinct tokens) as one batch of {} tokens in micro-batches of {}, measured right before and after (the better)",
                        o.clients.max(1),
                        b * o.clients.max(1),
                        self.micro_batch_tokens
                    ),
                )
                .with("clients", o.clients as u64)
                .with("workers", self.dep.topology.devices().len() as u64)
                .with("limit_before", before)
                .with("limit_after", after),
            );
        }
        self.latency(&rt, &fabric, link, report)?;
        let stats = fabric.service().stats();
        report.machine.extra.insert(
            format!("router_stats_{}", link.name()),
            format!("{stats:?}").into(),
        );
        fabric.shutdown();
        Ok(())
    }

    /// Fabric step: tokens/s of batches of `b` tokens from every client (one warm-up call
    /// each) for the measurement time.
    fn measure(
        &self,
        rt: &tokio::runtime::Runtime,
        fabric: &LocalFabric,
        b: usize,
    ) -> Result<f64, BenchError> {
        let (o, layer) = (self.o, self.layer);
        let h = self.dep.spec.hidden as usize;
        let addr = fabric.frontend_addr();
        let fcfg = fabric.frontend_config();
        // The in-process limit's tokens, each client its own `b` of them.
        let all = reference::synthetic_hidden(b as u64, b * o.clients.max(1), h);
        let tokens = Arc::new(AtomicU64::new(0));
        let stop_at = Instant::now() + Duration::from_secs_f64(o.seconds);
        let secs = rt.block_on(async {
            let mut tasks = Vec::new();
            // warm-up call per client, then measure
            let mut clients = Vec::new();
            for i in 0..o.clients.max(1) {
                let mut c = RouterClient::connect(addr, &fcfg)
                    .await
                    .map_err(BenchError::from)?;
                let x = client_tokens(&all, i, b, h);
                c.call(layer, &x, h, None, None)
                    .await
                    .map_err(BenchError::from)?;
                clients.push((c, x));
            }
            let t0 = Instant::now();
            for (mut c, x) in clients {
                let tokens = tokens.clone();
                tasks.push(tokio::spawn(async move {
                    // At least one call per client, however long the warm-up took on a
                    // busy machine (a measurement never comes back empty).
                    loop {
                        c.call(layer, &x, h, None, None)
                            .await
                            .map_err(BenchError::from)?;
                        tokens.fetch_add(b as u64, Ordering::Relaxed);
                        if Instant::now() >= stop_at {
                            break;
                        }
                    }
                    Ok::<(), BenchError>(())
                }));
            }
            for t in tasks {
                t.await??;
            }
            Ok::<f64, BenchError>(t0.elapsed().as_secs_f64())
        })?;
        Ok(tokens.load(Ordering::Relaxed) as f64 / secs)
    }
}

/// Sequential 1-token calls from one client for about `secs`; their latencies in µs, sorted.
async fn one_token_latencies(
    c: &mut RouterClient,
    layer: u32,
    x: &[f32],
    h: usize,
    secs: f64,
) -> Result<Vec<f64>, BenchError> {
    for _ in 0..10 {
        c.call(layer, x, h, None, None)
            .await
            .map_err(BenchError::from)?;
    }
    let mut lat = Vec::new();
    let t0 = Instant::now();
    while t0.elapsed().as_secs_f64() < secs || lat.len() < 50 {
        let t = Instant::now();
        c.call(layer, x, h, None, None)
            .await
            .map_err(BenchError::from)?;
        lat.push(t.elapsed().as_secs_f64() * 1e6);
    }
    lat.sort_by(f64::total_cmp);
    Ok(lat)
}

impl LinkRun<'_> {
    /// Latency step: 1-token calls from one frontend (the window closes at once: it is the
    /// only one connected), then again with a second, idle frontend connected (the window
    /// applies), against the floor: the in-process 1-token time (a raw TCP round trip is
    /// recorded beside it).
    fn latency(
        &self,
        rt: &tokio::runtime::Runtime,
        fabric: &LocalFabric,
        link: LinkKind,
        report: &mut BenchReport,
    ) -> Result<(), BenchError> {
        let (o, layer) = (self.o, self.layer);
        let spec = &self.dep.spec;
        let h = spec.hidden as usize;
        let x = reference::synthetic_hidden(1, 1, h);
        let secs = o.seconds.min(2.0);
        let addr = fabric.frontend_addr();
        let fcfg = fabric.frontend_config();
        let (alone, window) = rt.block_on(async {
            let mut c = RouterClient::connect(addr, &fcfg)
                .await
                .map_err(BenchError::from)?;
            let alone = one_token_latencies(&mut c, layer, &x, h, secs).await?;
            let idle = RouterClient::connect(addr, &fcfg)
                .await
                .map_err(BenchError::from)?;
            // The router counts a connection once its side of the handshake is done.
            tokio::time::sleep(Duration::from_millis(200)).await;
            let window = one_token_latencies(&mut c, layer, &x, h, secs).await?;
            drop(idle);
            Ok::<_, BenchError>((alone, window))
        })?;
        let msg = one_token_dispatch_bytes(spec, o.mode);
        let mut raw = raw_tcp_round_trips_us(msg, alone.len().clamp(200, 5000))?;
        raw.sort_by(f64::total_cmp);
        let raw50 = crate::method::stats::percentile(&raw, 50.0);
        let limit = self.limits.one_token_us;
        let name = format!("fabric-{}-{} {}", link.name(), o.mode.name(), spec.name);
        let limit_is = format!(
            "a floor: the in-process 1-token layer ({limit:.0} us); the fabric adds the frontend's call and the worker's hop (a raw blocking loopback TCP round trip of {msg} bytes out, 64 back: {raw50:.1} us p50, not a floor)"
        );
        for (lat, what) in [(&alone, "latency"), (&window, "latency window")] {
            for (p, tag) in [(50.0, "p50"), (99.0, "p99")] {
                let v = crate::method::stats::percentile(lat, p);
                println!(
                    "fabric over {}, 1 token, {what} {tag}: {v:>7.0} us = {:.2} x the floor {limit:.0} us",
                    link.name(),
                    v / limit
                );
                report.results.push(
                    BenchResult::new(format!("{name} {what} {tag}"), 1, v, limit, "us")
                        .with("limit_is", limit_is.clone())
                        .with("raw_tcp_round_trip_us_p50", raw50)
                        .with("calls", lat.len() as u64)
                        .with("frontends", if what == "latency" { 1u64 } else { 2u64 }),
                );
            }
        }
        Ok(())
    }
}

/// Bytes of a 1-token dispatch frame of `spec` in `mode` (the raw round trip's message).
fn one_token_dispatch_bytes(
    spec: &expertmesh_topology::model::ModelSpec,
    mode: LayerMode,
) -> usize {
    let wire = mode.apply(RouterConfig::default()).wire_format();
    codec::wire_bytes_per_token(wire, spec.hidden as usize, 1, 1)
        .map_or(64, |w| w.dispatch as usize)
}

/// Round trips (µs) of `msg` bytes over a raw blocking loopback TCP socket (no delay), each
/// answered by 64 bytes: the transport's floor for one dispatch and its answer.
fn raw_tcp_round_trips_us(msg: usize, trips: usize) -> Result<Vec<f64>, BenchError> {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let server = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut s, _) = listener.accept()?;
        s.set_nodelay(true)?;
        let mut buf = vec![0u8; msg];
        for _ in 0..trips + 10 {
            s.read_exact(&mut buf)?;
            s.write_all(&buf[..64.min(msg)])?;
        }
        Ok(())
    });
    let mut c = std::net::TcpStream::connect(addr)?;
    c.set_nodelay(true)?;
    let out = vec![7u8; msg];
    let mut back = vec![0u8; 64.min(msg)];
    let mut lat = Vec::with_capacity(trips);
    for i in 0..trips + 10 {
        let t = Instant::now();
        c.write_all(&out)?;
        c.read_exact(&mut back)?;
        if i >= 10 {
            lat.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    server
        .join()
        .map_err(|_| BenchError::Panicked("raw TCP server"))??;
    Ok(lat)
}

/// Bytes per token per MoE layer that each serving mode puts on the wire, from the codec's
/// encoded frames: a token goes to `k` devices with one of its experts each (the spread case
/// of a large expert-parallel placement) or to one device holding all `k`; frames of 1 and of
/// 32 tokens. Shared experts run on the router (no wire).
pub(crate) fn wire_table(
    spec: &expertmesh_topology::model::ModelSpec,
) -> Vec<(LayerMode, [f64; 4])> {
    let (h, k) = (spec.hidden as usize, spec.top_k as usize);
    LayerMode::ALL
        .into_iter()
        .map(|m| {
            let wire = m.apply(RouterConfig::default()).wire_format();
            let per = |tokens: usize, slots: usize, devices: usize| {
                codec::wire_bytes_per_token(wire, h, tokens, slots)
                    .map_or(f64::NAN, |w| w.total() * devices as f64)
            };
            (
                m,
                [per(1, 1, k), per(32, 1, k), per(1, k, 1), per(32, k, 1)],
            )
        })
        .collect()
}

/// Prints [`wire_table`] for `spec`.
fn print_wire_table(spec: &expertmesh_topology::model::ModelSpec) {
    println!(
        "wire bytes per token per layer, {} (hidden {}, top-{}), dispatch + results, all destinations:",
        spec.name, spec.hidden, spec.top_k
    );
    println!(
        "  {:<11} {:>14} {:>14} {:>14} {:>14}",
        "mode", "k devs, 1 tok", "k devs, 32 tok", "1 dev, 1 tok", "1 dev, 32 tok"
    );
    for (m, b) in wire_table(spec) {
        println!(
            "  {:<11} {:>14.0} {:>14.0} {:>14.0} {:>14.0}",
            m.name(),
            b[0],
            b[1],
            b[2],
            b[3]
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use expertmesh_topology::model::preset_by_name;

    /// The clients' calls together are exactly the limit's batch: every token once, in order.
    #[test]
    fn the_clients_tokens_together_are_the_limits_batch() {
        let (clients, b, h) = (3, 5, 4);
        let all = reference::synthetic_hidden(5, clients * b, h);
        let joined: Vec<f32> = (0..clients)
            .flat_map(|i| super::client_tokens(&all, i, b, h))
            .collect();
        assert_eq!(joined, all);
        let first_tokens: Vec<&[f32]> = (0..clients)
            .map(|i| &all[i * b * h..i * b * h + h])
            .collect();
        assert!(
            first_tokens.windows(2).all(|w| w[0] != w[1]),
            "distinct tokens"
        );
    }

    #[test]
    fn threaded_logits_are_the_gates_logits_bit_for_bit() {
        let spec = preset_by_name("demo-small").expect("preset");
        let gate = reference::synthetic_gate(&spec, 7, spec.moe_layer_ids()[0]);
        for tokens in [0, 1, 3, 63, 64, 65, 130, 257] {
            let x = reference::synthetic_hidden(tokens as u64, tokens, gate.hidden);
            let want = gate.logits(&x);
            for threads in [1, 2, 3, 4] {
                let got = logits_threaded(&gate, &x, threads);
                let same = got.len() == want.len()
                    && got
                        .iter()
                        .zip(&want)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{tokens} tokens on {threads} threads");
            }
        }
    }

    #[test]
    fn the_layer_from_threaded_logits_is_the_reference_layer_and_bad_shapes_are_refused() {
        use expertmesh_quant::contract::ComputeMode;
        let spec = preset_by_name("demo-small").expect("preset");
        let layer = spec.moe_layer_ids()[0];
        let gate = reference::synthetic_gate(&spec, 7, layer);
        let mut backend = expertmesh_worker::weights::reference_backend(&spec, 7, &[layer], 2, 130)
            .expect("backend");
        let x = reference::synthetic_hidden(3, 130, gate.hidden);
        let mode = ComputeMode::Exact;
        let (_, want) = reference::moe_layer_backend(&spec, &gate, layer, &mut backend, &x, mode)
            .expect("reference layer");
        let logits = logits_threaded(&gate, &x, 2);
        let none = reference::ExpertRounding::None;
        let (_, got) = reference::moe_layer_backend_from_logits(
            &spec,
            &gate,
            layer,
            &mut backend,
            &x,
            &logits,
            mode,
            none,
        )
        .expect("layer from logits");
        assert!(
            got.iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits())
        );
        assert_eq!(got.len(), want.len());
        // Logits of one token too few, and hidden states that are not whole tokens.
        let short = &logits[..logits.len() - gate.experts];
        let r = reference::moe_layer_backend_from_logits(
            &spec,
            &gate,
            layer,
            &mut backend,
            &x,
            short,
            mode,
            none,
        );
        assert!(
            matches!(r, Err(reference::ReferenceError::Gating(_))),
            "{r:?}"
        );
        let torn = &x[..x.len() - 1];
        let r = reference::moe_layer_backend_from_logits(
            &spec,
            &gate,
            layer,
            &mut backend,
            torn,
            &logits,
            mode,
            none,
        );
        assert!(
            matches!(r, Err(reference::ReferenceError::Gating(_))),
            "{r:?}"
        );
    }
}
