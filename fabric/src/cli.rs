//! The `expertmesh` command line: argument parsing and the subcommands' top level.
//!
//! Why this exists: the binary is a thin `main`; every subcommand lives here so integration
//! tests and the binary share one code path. Exit codes follow the design brief: 0 success,
//! 1 invalid input (validation problems, mismatched results), 2 usage or I/O errors.

use clap::{Parser, Subcommand};
use expertmesh_hip_kernels::contract::ComputeMode;
use expertmesh_router::reference;
use expertmesh_topology::resolve_model;
use std::process::ExitCode;
use std::time::Instant;

/// ExpertMesh: stationary packed-INT4 experts, activation-only transport.
#[derive(Parser, Debug)]
#[command(name = "expertmesh", version, about)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// List the built-in model presets, or show one model (preset or file) in detail.
    Models(crate::models_cmd::ModelsArgs),
    /// Check a topology file, and optionally a model and a placement against it.
    Validate(crate::validate_cmd::ValidateArgs),
    /// Place a model's experts on a cluster; report memory, load, traffic, throughput, cost.
    Plan(Box<crate::plan_cmd::PlanArgs>),
    /// Measure kernels, transport or the whole fabric against same-run limits.
    Bench {
        #[command(subcommand)]
        what: BenchCommand,
    },
    /// Run the main job on the embedded default and print a report.
    Demo {
        /// Write the report as JSON to this file.
        #[arg(long)]
        json: Option<std::path::PathBuf>,
        /// Model preset or model TOML file.
        #[arg(long, default_value = "demo-small")]
        model: String,
    },
}

#[derive(Subcommand, Debug)]
enum BenchCommand {
    /// Expert FFN kernels on the CPU backend vs. memory read bandwidth and int8 peak.
    Kernels {
        /// Write the results as JSON (DESIGN.md §3) to this file.
        #[arg(long)]
        json: Option<std::path::PathBuf>,
        /// Backend threads (default: all cores).
        #[arg(long)]
        threads: Option<usize>,
        /// Seconds of measurement per case.
        #[arg(long, default_value_t = 2.0)]
        seconds: f64,
        /// Comma-separated model presets whose expert shapes are measured.
        #[arg(
            long,
            default_value = "kimi-k2,qwen3-30b-a3b,mixtral-8x7b",
            value_delimiter = ','
        )]
        models: Vec<String>,
        /// Comma-separated decode batch sizes.
        #[arg(long, default_value = "1,2,4,8,16,64,256", value_delimiter = ',')]
        batches: Vec<usize>,
        /// Tokens per expert for the prefill case (0 skips it).
        #[arg(long, default_value_t = 256)]
        prefill_tokens: usize,
        /// Minimum weight pool in MiB (default: max(1 GiB, 8 x last-level cache)).
        #[arg(long, default_value_t = 0)]
        pool_mib: u64,
    },
}

/// Exit code for invalid input (validation failed, results mismatched).
pub const EXIT_INVALID: u8 = 1;
/// Exit code for usage and I/O errors.
pub const EXIT_USAGE: u8 = 2;

/// Parse the process arguments and run; never panics on bad input.
pub fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let code = if e.use_stderr() { EXIT_USAGE } else { 0 };
            let _ = e.print();
            return ExitCode::from(code);
        }
    };
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(EXIT_USAGE)
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Models(args) => Ok(crate::models_cmd::run(&args)),
        Command::Validate(args) => Ok(crate::validate_cmd::run(&args)),
        Command::Plan(args) => Ok(crate::plan_cmd::run(&args)),
        Command::Demo { json, model } => demo_in_process(&model, json.as_deref()),
        Command::Bench { what } => match what {
            BenchCommand::Kernels {
                json,
                threads,
                seconds,
                models,
                batches,
                prefill_tokens,
                pool_mib,
            } => {
                let models = models
                    .iter()
                    .map(|m| resolve_model(m).map_err(anyhow::Error::from))
                    .collect::<anyhow::Result<Vec<_>>>()?;
                let threads = threads.unwrap_or_else(|| {
                    std::thread::available_parallelism()
                        .map(|n| n.get())
                        .unwrap_or(1)
                });
                let report =
                    crate::bench_kernels::run(&crate::bench_kernels::KernelBenchOptions {
                        threads,
                        seconds,
                        models,
                        batches,
                        prefill_tokens,
                        pool_bytes: pool_mib << 20,
                    })?;
                report.print_table();
                if let Some(path) = json {
                    report.write(&path)?;
                    println!("wrote {}", path.display());
                }
                Ok(ExitCode::SUCCESS)
            }
        },
    }
}

fn demo_in_process(model: &str, json: Option<&std::path::Path>) -> anyhow::Result<ExitCode> {
    let spec = resolve_model(model)?;
    let seed = 42;
    println!(
        "ExpertMesh demo (in-process reference): model {} — {} MoE layers x {} experts, top-{}, H {}",
        spec.name,
        spec.moe_layers(),
        spec.routed_experts,
        spec.top_k,
        spec.hidden
    );
    let mut results = Vec::new();
    let mut tokens_total = 0usize;
    let start = Instant::now();
    for layer in spec.moe_layer_ids() {
        let lw = reference::synthetic_layer(&spec, seed, layer)?;
        for batch in [1usize, 4, 16] {
            let x = reference::synthetic_hidden(
                layer as u64 * 1000 + batch as u64,
                batch,
                spec.hidden as usize,
            );
            let t0 = Instant::now();
            let (routing, out) = reference::moe_layer(&spec, &lw, &x, ComputeMode::Exact)?;
            let dt = t0.elapsed();
            let truth = reference::moe_layer_f64(&lw, &x, &routing);
            let err = reference::rel_error_vs_rms(&out, &truth);
            tokens_total += batch;
            results.push(serde_json::json!({
                "layer": layer, "batch": batch, "latency_us": dt.as_secs_f64() * 1e6, "rel_error_vs_f64": err,
            }));
            println!(
                "  layer {layer:>2} batch {batch:>3}: {:>9.1} us  max|err|/rms vs f64 = {err:.2e}",
                dt.as_secs_f64() * 1e6
            );
        }
    }
    let secs = start.elapsed().as_secs_f64();
    println!("{tokens_total} token-layers in {secs:.2} s");
    if let Some(path) = json {
        std::fs::write(
            path,
            serde_json::to_string_pretty(&serde_json::json!({"results": results}))?,
        )?;
    }
    Ok(ExitCode::SUCCESS)
}
