//! `expertmesh bench fabric`: tokens/s of one MoE layer through the local fabric against the
//! same layer run in-process by the same backend, measured in the same run.
//!
//! Why this exists: it answers "what does distributing the experts cost?" The in-process
//! figure is the ceiling — gate, the CPU backend running every expert of the layer with all
//! the cores the workers have together, combine — and the fabric figure is the same work
//! through the router, the transport and worker processes, with several frontends keeping it
//! busy. `ratio = fabric / in-process`; the target is ≥ 0.7 at batch 64 on two workers.

use crate::bench_json::{BenchReport, BenchResult};
use crate::local::{LocalFabric, LocalFabricOptions};
use anyhow::anyhow;
use expertmesh_quant::contract::ComputeMode;
use expertmesh_router::client::RouterClient;
use expertmesh_router::core::RouterConfig;
use expertmesh_router::reference;
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
    /// Numerical mode.
    pub mode: ComputeMode,
}

/// Run the benchmark.
pub fn run(o: &FabricBenchOptions) -> anyhow::Result<BenchReport> {
    let tmp = tempfile::Builder::new()
        .prefix("expertmesh-bench-")
        .tempdir()?;
    let (topology, placement, _planned) = crate::demo::local_files(
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
    let limits = in_process_limits(o, &dep, layer, threads)?;
    for &link in &o.links {
        let run = LinkRun {
            o,
            dep: &dep,
            layer,
            threads,
            limits: &limits,
        };
        run.bench(&topology, &placement, link, &mut report)?;
    }
    Ok(report)
}

/// The largest batch size (the router's limits).
fn max_batch(o: &FabricBenchOptions) -> usize {
    o.batches.iter().copied().max().unwrap_or(64)
}

/// In-process step: tokens/s of the whole layer on one backend, per batch size (the limits).
fn in_process_limits(
    o: &FabricBenchOptions,
    dep: &Deployment,
    layer: u32,
    threads: usize,
) -> anyhow::Result<Vec<f64>> {
    let spec = &dep.spec;
    let h = spec.hidden as usize;
    let mut backend = expertmesh_worker::weights::reference_backend(
        spec,
        dep.seed,
        &[layer],
        threads,
        max_batch(o),
    )
    .map_err(|e| anyhow!(e))?;
    let gate = reference::synthetic_gate(spec, dep.seed, layer);
    let mut limits = Vec::new();
    for &b in &o.batches {
        let x = reference::synthetic_hidden(b as u64, b, h);
        let _ = reference::moe_layer_backend(spec, &gate, layer, &mut backend, &x, o.mode)
            .map_err(|e| anyhow!(e))?;
        let t0 = Instant::now();
        let mut calls = 0u64;
        while t0.elapsed().as_secs_f64() < o.seconds || calls < 3 {
            reference::moe_layer_backend(spec, &gate, layer, &mut backend, &x, o.mode)
                .map_err(|e| anyhow!(e))?;
            calls += 1;
        }
        let tps = (calls as usize * b) as f64 / t0.elapsed().as_secs_f64();
        println!("in-process layer, batch {b:>3}: {tps:>9.0} tokens/s ({threads} threads)");
        limits.push(tps);
    }
    Ok(limits)
}

/// What every link's measurement shares.
struct LinkRun<'a> {
    o: &'a FabricBenchOptions,
    dep: &'a Deployment,
    layer: u32,
    threads: usize,
    /// In-process tokens/s per batch size.
    limits: &'a [f64],
}

impl LinkRun<'_> {
    /// Fabric step: start a local fabric over `link`, measure every batch size, and record
    /// the router's stats.
    fn bench(
        &self,
        topology: &std::path::Path,
        placement: &std::path::Path,
        link: LinkKind,
        report: &mut BenchReport,
    ) -> anyhow::Result<()> {
        let (o, spec, threads) = (self.o, &self.dep.spec, self.threads);
        let maxb = max_batch(o);
        let mut opts = LocalFabricOptions::new(topology, &o.model, placement);
        opts.ephemeral_ports = true;
        opts.link = link;
        opts.router = RouterConfig {
            mode: o.mode,
            max_request_tokens: maxb,
            max_batch_tokens: maxb,
            micro_batch_tokens: 16,
            batch_window: Duration::from_micros(50),
            ..RouterConfig::default()
        };
        let fabric = LocalFabric::start(opts)?;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        for (i, &b) in o.batches.iter().enumerate() {
            let tps = self.measure(&rt, &fabric, b)?;
            let limit = self.limits[i];
            println!(
                "fabric over {}, batch {b:>3}: {tps:>9.0} tokens/s = {:.3} of in-process ({} clients)",
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
                    format!("the same layer in-process on one CPU backend with {threads} threads"),
                )
                .with("clients", o.clients as u64)
                .with("workers", self.dep.topology.devices().len() as u64),
            );
        }
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
    ) -> anyhow::Result<f64> {
        let (o, layer) = (self.o, self.layer);
        let h = self.dep.spec.hidden as usize;
        let addr = fabric.frontend_addr();
        let fcfg = fabric.frontend_config();
        let x = Arc::new(reference::synthetic_hidden(b as u64, b, h));
        let tokens = Arc::new(AtomicU64::new(0));
        let stop_at = Instant::now() + Duration::from_secs_f64(o.seconds);
        let secs = rt.block_on(async {
            let mut tasks = Vec::new();
            // warm-up call per client, then measure
            let mut clients = Vec::new();
            for _ in 0..o.clients.max(1) {
                let mut c = RouterClient::connect(addr, &fcfg)
                    .await
                    .map_err(|e| anyhow!("{e}"))?;
                c.call(layer, &x, h, None, None)
                    .await
                    .map_err(|e| anyhow!("{e}"))?;
                clients.push(c);
            }
            let t0 = Instant::now();
            for mut c in clients {
                let x = x.clone();
                let tokens = tokens.clone();
                tasks.push(tokio::spawn(async move {
                    while Instant::now() < stop_at {
                        c.call(layer, &x, h, None, None)
                            .await
                            .map_err(|e| anyhow!("{e}"))?;
                        tokens.fetch_add(b as u64, Ordering::Relaxed);
                    }
                    Ok::<(), anyhow::Error>(())
                }));
            }
            for t in tasks {
                t.await.map_err(|e| anyhow!("{e}"))??;
            }
            Ok::<f64, anyhow::Error>(t0.elapsed().as_secs_f64())
        })?;
        Ok(tokens.load(Ordering::Relaxed) as f64 / secs)
    }
}
