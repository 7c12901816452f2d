//! `expertmesh demo`: the main job on the embedded default.
//!
//! Why this exists: it is what a new user runs first and what shows the whole system working:
//! a local fabric (router + one worker process per CPU device of the single-host example), a
//! small MoE preset, decode-like traffic over several layers with batches of 1 to 64 tokens from
//! several concurrent clients, every response checked against the in-process reference (bit for
//! bit in exact mode), and a report: tokens/s, latency percentiles per layer call, bytes on the
//! wire per token, and what a weight-moving (offloading) design would have moved instead. The
//! process exits 0 only if every response matched.

use crate::args::{RouterArgs, link_parser};
use anyhow::{Context, anyhow, bail};
use clap::Args;
use expertmesh_benches::method::json::MachineInfo;
use expertmesh_benches::method::stats::percentile;
use expertmesh_fabric::defaults::local_files;
use expertmesh_fabric::local::{LocalFabric, LocalFabricOptions};
use expertmesh_quant::contract::ComputeMode;
use expertmesh_router::client::RouterClient;
use expertmesh_router::core::LayerMode;
use expertmesh_router::core::RouterStats;
use expertmesh_router::reference;
use expertmesh_transport::mesh::LinkKind;
use expertmesh_worker::deploy::Deployment;
use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// `expertmesh demo`.
#[derive(Args, Debug)]
pub(crate) struct DemoCli {
    /// Write the report as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Topology (default: the embedded single-host example).
    #[arg(long)]
    topology: Option<PathBuf>,
    /// Model preset or file (default: demo-small).
    #[arg(long, default_value = "demo-small")]
    model: String,
    /// Placement (default: the embedded single-host placement of demo-small).
    #[arg(long)]
    placement: Option<PathBuf>,
    /// Worker ↔ router link.
    #[arg(long, default_value = "tcp", value_parser = link_parser(&LinkKind::ALL))]
    link: LinkKind,
    /// The NIC under RDMA links: verbs, libfabric (= libfabric:tcp;ofi_rxm, any host) or
    /// `libfabric:<provider>`.
    #[arg(long, default_value = "verbs", value_parser = crate::args::rdma_provider_parser)]
    rdma_provider: expertmesh_transport::rdma::RdmaProvider,
    /// Rounds over the (layer, batch) schedule.
    #[arg(long, default_value_t = 10)]
    rounds: usize,
    /// Concurrent frontend clients.
    #[arg(long, default_value_t = 4)]
    clients: usize,
    /// Comma-separated batch sizes.
    #[arg(long, default_value = "1,2,4,8,16,32,64", value_delimiter = ',')]
    batches: Vec<usize>,
    #[command(flatten)]
    router: RouterArgs,
    /// Hide the progress bar.
    #[arg(long)]
    quiet: bool,
}

struct Call {
    layer: u32,
    x: Vec<f32>,
    tokens: usize,
    out: Option<Result<Vec<f32>, String>>,
    latency: Duration,
}

/// Run the demo.
pub(crate) fn run(cli: DemoCli) -> anyhow::Result<ExitCode> {
    check_options(&cli)?;
    remove_stale_demo_folders();
    // Named after this process, so that a later demo can tell an interrupted one's folder
    // (Ctrl-C ends the process without dropping it) from a running one's.
    // Held while the demo runs: another demo's sweep leaves a held folder alone.
    let (tmp, _held) = expertmesh_files::make_locked_folder(
        || {
            tempfile::Builder::new()
                .prefix(&format!("{DEMO_FOLDER_PREFIX}{}-", std::process::id()))
                .tempdir()
        },
        tempfile::TempDir::path,
    )?;
    let (topology, placement, _planned) = local_files(
        tmp.path(),
        cli.topology.as_deref(),
        &cli.model,
        cli.placement.as_deref(),
    )?;
    // The demo checks bit for bit (exact) or against a stated tolerance (accurate).
    let mode = match cli.router.mode_or(LayerMode::Exact) {
        m @ (LayerMode::Exact | LayerMode::Accurate) => m.compute(),
        other => bail!(
            "the demo checks exact and accurate modes; {} is served by `up` and `router` and tested in worker/tests/it/wire_modes.rs",
            other.name()
        ),
    };
    let fabric = start_fabric(&cli, &topology, &placement, tmp.path(), mode)?;
    let dep = fabric.deployment().clone();
    let spec = dep.spec.clone();
    let h = spec.hidden as usize;
    let layers = spec.moe_layer_ids();
    let calls = schedule(&cli, &layers, h);
    let total_tokens: usize = calls.iter().map(|c| c.tokens).sum();
    let (calls, traffic_secs) = run_traffic(&cli, &fabric, calls, h)?;
    let stats = fabric.service().stats();
    fabric.shutdown();

    println!(
        "  checking {} responses against the in-process reference ...",
        calls.lock().map(|c| c.len()).unwrap_or(0)
    );
    let calls = Arc::try_unwrap(calls)
        .map_err(|_| anyhow!("clients still hold the calls"))?
        .into_inner()
        .unwrap_or_else(|e| e.into_inner());
    let check = check_responses(&cli, &dep, &layers, &calls, mode)?;
    let traffic = Traffic {
        calls: &calls,
        total_tokens,
        secs: traffic_secs,
        stats: &stats,
    };
    report(&cli, &dep, mode, &traffic, &check)
}

/// The start of a demo's temporary folder's name, before its process id.
const DEMO_FOLDER_PREFIX: &str = "expertmesh-demo-";

/// Removes the temporary folders (configuration, worker logs) of earlier demos that were
/// interrupted (Ctrl-C, a kill): those whose process no longer runs (checked in `/proc`;
/// elsewhere nothing is removed) and that no running demo holds locked. Best effort.
fn remove_stale_demo_folders() {
    let tmp = std::env::temp_dir();
    expertmesh_files::remove_left_by_gone_processes(&tmp, |name| {
        expertmesh_files::pid_after(DEMO_FOLDER_PREFIX, name)
    });
}

/// Usage errors (exit 2) before anything starts: a schedule with no call, or batches the
/// router would refuse (they would be counted as failed calls and their throughput as made up).
fn check_options(cli: &DemoCli) -> anyhow::Result<()> {
    if cli.rounds == 0 || cli.clients == 0 {
        bail!(
            "--rounds {} --clients {}: both must be at least 1",
            cli.rounds,
            cli.clients
        );
    }
    let max = cli.router.max_tokens;
    if let Some(&b) = cli.batches.iter().find(|&&b| b == 0 || b > max) {
        bail!(
            "--batches: a batch of {b} tokens; each must be 1 to {max} tokens (the router's \
             --max-tokens)"
        );
    }
    Ok(())
}

/// Setup step: start the local fabric and print what it runs.
fn start_fabric(
    cli: &DemoCli,
    topology: &std::path::Path,
    placement: &std::path::Path,
    tmp: &std::path::Path,
    mode: ComputeMode,
) -> anyhow::Result<LocalFabric> {
    let mut opts = LocalFabricOptions::new(topology, &cli.model, placement);
    opts.link = cli.link;
    opts.rdma_provider = cli.rdma_provider.clone();
    opts.router = cli.router.config_in(LayerMode::Exact);
    opts.frontend_limits = cli.router.frontend_limits();
    opts.ephemeral_ports = true;
    opts.log_dir = Some(tmp.join("logs"));
    println!("ExpertMesh demo: starting a local fabric ...");
    let t_start = Instant::now();
    let fabric = LocalFabric::start(opts).context("starting the local fabric")?;
    let dep = fabric.deployment();
    let spec = &dep.spec;
    println!(
        "  model {}: {} MoE layers x {} experts (top-{}, {} shared), hidden {}, {} per expert",
        spec.name,
        spec.moe_layers(),
        spec.routed_experts,
        spec.top_k,
        spec.shared_experts,
        spec.hidden,
        human_bytes(spec.expert_bytes())
    );
    println!(
        "  topology {}: {} workers ({}), link {}, {} mode; started in {:.1} s; router at {}",
        dep.topology.name(),
        dep.topology.devices().len(),
        dep.topology
            .devices()
            .iter()
            .map(|d| d.id().to_string())
            .collect::<Vec<_>>()
            .join(", "),
        cli.link.name(),
        mode.name(),
        t_start.elapsed().as_secs_f64(),
        fabric.frontend_addr()
    );
    Ok(fabric)
}

/// Setup step: the schedule, every layer x every batch size, `rounds` times, in an
/// interleaved order.
fn schedule(cli: &DemoCli, layers: &[u32], h: usize) -> Vec<Call> {
    let mut calls: Vec<Call> = Vec::new();
    let mut seed = 1000u64;
    for _ in 0..cli.rounds.max(1) {
        for &b in &cli.batches {
            for &l in layers {
                seed += 1;
                calls.push(Call {
                    layer: l,
                    x: reference::synthetic_hidden(seed, b, h),
                    tokens: b,
                    out: None,
                    latency: Duration::ZERO,
                });
            }
        }
    }
    calls
}

/// Traffic step: `clients` concurrent frontend clients run the schedule; the calls with their
/// responses and latencies, and the traffic's wall time in seconds.
fn run_traffic(
    cli: &DemoCli,
    fabric: &LocalFabric,
    calls: Vec<Call>,
    h: usize,
) -> anyhow::Result<(Arc<Mutex<Vec<Call>>>, f64)> {
    let bar = if cli.quiet {
        indicatif::ProgressBar::hidden()
    } else {
        indicatif::ProgressBar::new(calls.len() as u64).with_style(
            indicatif::ProgressStyle::with_template(
                "  traffic {bar:40} {pos}/{len} layer calls ({per_sec}, eta {eta})",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        )
    };
    let calls = Arc::new(Mutex::new(calls));
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let addr = fabric.frontend_addr();
    let fcfg = fabric.frontend_config();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let t_traffic = Instant::now();
    rt.block_on(async {
        let mut tasks = Vec::new();
        for _ in 0..cli.clients.max(1) {
            let calls = calls.clone();
            let next = next.clone();
            let fcfg = fcfg.clone();
            let bar = bar.clone();
            tasks.push(tokio::spawn(async move {
                let mut client = RouterClient::connect(addr, &fcfg)
                    .await
                    .map_err(|e| anyhow!("{e}"))?;
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let (layer, x) = {
                        let c = calls.lock().unwrap_or_else(|e| e.into_inner());
                        if i >= c.len() {
                            return Ok::<(), anyhow::Error>(());
                        }
                        (c[i].layer, c[i].x.clone())
                    };
                    let t = Instant::now();
                    let res = client
                        .call(layer, &x, h, None, None)
                        .await
                        .map_err(|e| e.to_string());
                    let lat = t.elapsed();
                    let mut c = calls.lock().unwrap_or_else(|e| e.into_inner());
                    c[i].out = Some(res);
                    c[i].latency = lat;
                    bar.inc(1);
                }
            }));
        }
        for t in tasks {
            t.await.map_err(|e| anyhow!("{e}"))??;
        }
        Ok::<(), anyhow::Error>(())
    })?;
    let traffic_secs = t_traffic.elapsed().as_secs_f64();
    bar.finish_and_clear();
    Ok((calls, traffic_secs))
}

/// What the check step found.
#[derive(Default)]
struct CheckResult {
    mismatches: usize,
    errors: usize,
    /// Worst accurate-mode error relative to the output RMS.
    max_err: f64,
    /// Expert-weight bytes a weight-moving design would have moved.
    offload_bytes: u64,
    first_error: Option<String>,
}

/// Check step: every response against the in-process reference (bit for bit in exact mode),
/// and the first call of each layer against the scalar oracle itself.
fn check_responses(
    cli: &DemoCli,
    dep: &Deployment,
    layers: &[u32],
    calls: &[Call],
    mode: ComputeMode,
) -> anyhow::Result<CheckResult> {
    let spec = &dep.spec;
    let maxb = cli.batches.iter().copied().max().unwrap_or(1);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut backend =
        expertmesh_worker::weights::reference_backend(spec, dep.seed, layers, threads, maxb)
            .map_err(|e| anyhow!(e))?;
    let gates: std::collections::HashMap<u32, _> = layers
        .iter()
        .map(|&l| (l, reference::synthetic_gate(spec, dep.seed, l)))
        .collect();
    let mut r = CheckResult::default();
    let mut scalar_checked = 0;
    for c in calls {
        let (routing, want) =
            reference::moe_layer_backend(spec, &gates[&c.layer], c.layer, &mut backend, &c.x, mode)
                .map_err(|e| anyhow!(e))?;
        let touched: BTreeSet<u32> = routing.experts.iter().copied().collect();
        r.offload_bytes += touched.len() as u64 * spec.expert_bytes();
        match &c.out {
            Some(Ok(got)) => {
                let ok = match mode {
                    ComputeMode::Exact => got
                        .iter()
                        .zip(&want)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    ComputeMode::Accurate => {
                        let want64: Vec<f64> = want.iter().map(|&v| v as f64).collect();
                        let e = reference::rel_error_vs_rms(got, &want64);
                        r.max_err = r.max_err.max(e);
                        e < 1e-4
                    }
                };
                // Also check the first call of each layer against the scalar oracle itself; a
                // call that fails either check is one mismatch.
                let mut oracle_ok = true;
                if c.tokens == cli.batches[0] && scalar_checked < layers.len() {
                    scalar_checked += 1;
                    let lw = reference::synthetic_layer(spec, dep.seed, c.layer)?;
                    let (_, oracle) =
                        reference::moe_layer(spec, &lw, &c.x, mode).map_err(|e| anyhow!("{e}"))?;
                    oracle_ok = mode != ComputeMode::Exact
                        || oracle
                            .iter()
                            .zip(got)
                            .all(|(a, b)| a.to_bits() == b.to_bits());
                }
                if !(ok && oracle_ok) {
                    r.mismatches += 1;
                }
            }
            Some(Err(e)) => {
                r.errors += 1;
                r.first_error.get_or_insert_with(|| e.clone());
            }
            None => r.errors += 1,
        }
    }
    Ok(r)
}

/// The traffic step's outcome, for the report.
struct Traffic<'a> {
    calls: &'a [Call],
    total_tokens: usize,
    secs: f64,
    stats: &'a RouterStats,
}

/// Report step: throughput, latency, bytes on the wire, the check's verdict, the optional
/// JSON report, and the exit code.
fn report(
    cli: &DemoCli,
    dep: &Deployment,
    mode: ComputeMode,
    traffic: &Traffic<'_>,
    check: &CheckResult,
) -> anyhow::Result<ExitCode> {
    let &Traffic {
        calls,
        total_tokens,
        secs: traffic_secs,
        stats,
    } = traffic;
    let CheckResult {
        mismatches,
        errors,
        offload_bytes,
        ..
    } = *check;
    let mut lat: Vec<f64> = calls
        .iter()
        .map(|c| c.latency.as_secs_f64() * 1e6)
        .collect();
    lat.sort_by(f64::total_cmp);
    let tokens_per_s = total_tokens as f64 / traffic_secs;
    let wire = stats.dispatch_payload_bytes + stats.result_payload_bytes;
    let wire_per_token = wire as f64 / total_tokens as f64;
    let offload_per_token = offload_bytes as f64 / total_tokens as f64;
    println!();
    println!(
        "  {} layer calls, {} tokens in {:.2} s: {:.0} tokens/s (token-layers/s)",
        calls.len(),
        total_tokens,
        traffic_secs,
        tokens_per_s
    );
    println!(
        "  latency per layer call: p50 {:.0} us, p99 {:.0} us",
        percentile(&lat, 50.0),
        percentile(&lat, 99.0)
    );
    let per_batch = report_per_batch(cli, calls);
    println!(
        "  on the wire: {} per token (activations out {}, results back {}; {} batches, {} per-device parts)",
        human_bytes(wire_per_token as u64),
        human_bytes(stats.dispatch_payload_bytes / total_tokens.max(1) as u64),
        human_bytes(stats.result_payload_bytes / total_tokens.max(1) as u64),
        stats.batches,
        stats.parts_sent
    );
    println!(
        "  a weight-moving (offloading) design would have moved {} of expert weights per token ({:.0}x more)",
        human_bytes(offload_per_token as u64),
        offload_per_token / wire_per_token.max(1.0)
    );
    let ok = mismatches == 0 && errors == 0;
    print_verdict(mode, calls.len(), check);
    if let Some(path) = &cli.json {
        let report = serde_json::json!({
            "model": dep.spec.name, "topology": dep.topology.name(), "mode": mode.name(),
            "link": cli.link.name(),
            "calls": calls.len(), "tokens": total_tokens, "seconds": traffic_secs,
            "tokens_per_s": tokens_per_s,
            "latency_us_p50": percentile(&lat, 50.0), "latency_us_p99": percentile(&lat, 99.0),
            "per_batch": per_batch,
            "wire_bytes_per_token": wire_per_token, "offload_bytes_per_token": offload_per_token,
            "mismatches": mismatches, "errors": errors, "ok": ok,
            "machine": MachineInfo::detect(),
        });
        expertmesh_files::write_output(path, serde_json::to_string_pretty(&report)?.as_bytes())
            .with_context(|| format!("writing {}", path.display()))?;
        println!("  wrote {}", path.display());
    }
    if ok {
        println!("demo OK");
        Ok(ExitCode::SUCCESS)
    } else {
        println!("demo FAILED: {mismatches} mismatched, {errors} failed responses");
        Ok(ExitCode::from(crate::exit::EXIT_INVALID))
    }
}

/// Report step: the check's verdict.
fn print_verdict(mode: ComputeMode, calls: usize, check: &CheckResult) {
    let CheckResult {
        mismatches,
        errors,
        max_err,
        ..
    } = *check;
    match mode {
        ComputeMode::Exact => println!(
            "  checked: {} of {} responses bit-identical to the in-process reference{}",
            calls.saturating_sub(mismatches + errors),
            calls,
            if errors > 0 {
                format!(
                    ", {errors} failed: {}",
                    check.first_error.clone().unwrap_or_default()
                )
            } else {
                String::new()
            }
        ),
        ComputeMode::Accurate => println!(
            "  checked: worst error {max_err:.2e} of the output RMS (tolerance 1e-4); {mismatches} outside, {errors} failed"
        ),
    }
}

/// Report step: the latency table per batch size (printed), and its JSON rows.
fn report_per_batch(cli: &DemoCli, calls: &[Call]) -> Vec<serde_json::Value> {
    println!(
        "  {:>6} {:>8} {:>10} {:>10}",
        "batch", "calls", "p50 us", "p99 us"
    );
    let mut per_batch = Vec::new();
    for &b in &cli.batches {
        let mut l: Vec<f64> = calls
            .iter()
            .filter(|c| c.tokens == b)
            .map(|c| c.latency.as_secs_f64() * 1e6)
            .collect();
        l.sort_by(f64::total_cmp);
        println!(
            "  {:>6} {:>8} {:>10.0} {:>10.0}",
            b,
            l.len(),
            percentile(&l, 50.0),
            percentile(&l, 99.0)
        );
        per_batch.push(serde_json::json!({"batch": b, "calls": l.len(), "latency_us_p50": percentile(&l, 50.0), "latency_us_p99": percentile(&l, 99.0)}));
    }
    per_batch
}

fn human_bytes(b: u64) -> String {
    let b = b as f64;
    if b >= 1e9 {
        format!("{:.2} GB", b / 1e9)
    } else if b >= 1e6 {
        format!("{:.2} MB", b / 1e6)
    } else if b >= 1e3 {
        format!("{:.1} kB", b / 1e3)
    } else {
        format!("{b:.0} B")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Demo {
        #[command(flatten)]
        demo: DemoCli,
    }

    /// A wrong answer fails the reference check and, for a layer's first call, the oracle
    /// check too: it is still one mismatch, so "checked N of M" never counts below zero.
    #[test]
    fn a_call_that_fails_both_checks_is_one_mismatch_and_a_right_one_none() {
        let cli = Demo::parse_from(["demo", "--rounds", "1", "--batches", "1,2"]).demo;
        let dir = tempfile::tempdir().unwrap();
        let (topology, placement, _planned) =
            local_files(dir.path(), None, &cli.model, None).unwrap();
        let dep = Deployment::load(&topology, &cli.model, &placement, 42).unwrap();
        let spec = &dep.spec;
        let layers = spec.moe_layer_ids();
        let mut calls = schedule(&cli, &layers, spec.hidden as usize);
        // Even calls answered right (the scalar oracle), odd ones wrong everywhere.
        let mut wrong = 0;
        for (i, c) in calls.iter_mut().enumerate() {
            let lw = reference::synthetic_layer(spec, dep.seed, c.layer).unwrap();
            let (_, right) = reference::moe_layer(spec, &lw, &c.x, ComputeMode::Exact).unwrap();
            c.out = Some(Ok(if i % 2 == 0 {
                right
            } else {
                wrong += 1;
                vec![f32::NAN; right.len()]
            }));
        }
        let r = check_responses(&cli, &dep, &layers, &calls, ComputeMode::Exact).unwrap();
        assert_eq!((r.mismatches, r.errors), (wrong, 0));
    }
}
