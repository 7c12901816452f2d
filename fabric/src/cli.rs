//! The `expertmesh` command line: argument parsing and the subcommands' top level.
//!
//! Why this exists: the binary is a thin `main`; every subcommand lives here so integration
//! tests and the binary share one code path. Exit codes follow the design brief: 0 success,
//! 1 invalid input (validation problems, mismatched results), 2 usage or I/O errors.

use clap::{Parser, Subcommand};
use std::process::ExitCode;

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
    /// Run a benchmark (each figure against a limit measured in the same run).
    #[command(subcommand)]
    Bench(crate::bench_cli::BenchTarget),
    /// The main job: start a local fabric, drive traffic, check every response against the
    /// in-process reference, print a report.
    Demo(crate::demo::DemoCli),
    /// Start a whole local fabric (router + one worker process per device) until Ctrl-C.
    Up(crate::cmd_fabric::UpCli),
    /// Run one expert worker (one device) of a multi-host deployment.
    Worker(crate::cmd_fabric::WorkerCli),
    /// Run the router service of a multi-host deployment.
    Router(crate::cmd_fabric::RouterCli),
    /// One MoE-layer call from .npy files through a running router.
    Infer(crate::cmd_fabric::InferCli),
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
    init_logging();
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(EXIT_USAGE)
        }
    }
}

/// Log lines (tracing) go to stderr: warnings from every crate, and the worker's lifecycle
/// (backend choice, links) at info. `EXPERTMESH_LOG` overrides the filter (`RUST_LOG` syntax).
fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("EXPERTMESH_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn,expertmesh_worker=info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .without_time()
        .try_init();
}

fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Models(args) => Ok(crate::models_cmd::run(&args)),
        Command::Validate(args) => Ok(crate::validate_cmd::run(&args)),
        Command::Plan(args) => Ok(crate::plan_cmd::run(&args)),
        Command::Demo(args) => crate::demo::run(args),
        Command::Up(args) => crate::cmd_fabric::up(args),
        Command::Worker(args) => crate::cmd_fabric::worker(args),
        Command::Router(args) => crate::cmd_fabric::router(args),
        Command::Infer(args) => crate::cmd_fabric::infer(args),
        Command::Bench(target) => crate::bench_cli::run(target),
    }
}
