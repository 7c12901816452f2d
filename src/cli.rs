//! The `expertmesh` command line: the commands, logging, and turning results into exit codes.
//!
//! Why this exists: the binary is a thin `main`; this module parses the arguments, starts
//! logging and runs one command of [`crate::cmd`]. Errors become a message on stderr and exit
//! code 2 here ([`crate::exit`] lists the codes); nothing panics on bad input.

use crate::cmd;
use crate::exit::{COMMAND_EXIT_CODES, EXIT_CODES_HELP, EXIT_USAGE};
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use std::process::ExitCode;

/// ExpertMesh: stationary packed-INT4 experts, activation-only transport.
#[derive(Parser, Debug)]
#[command(name = "expertmesh", version, about, after_help = EXIT_CODES_HELP)]
pub(crate) struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// List the built-in model presets, or show one model (preset or file) in detail.
    Models(cmd::models::ModelsArgs),
    /// Check a topology file, and optionally a model and a placement against it.
    Validate(cmd::validate::ValidateArgs),
    /// Place a model's experts on a cluster; report memory, load, traffic, throughput, cost.
    Plan(Box<cmd::plan::PlanArgs>),
    /// Convert a Hugging Face checkpoint folder into packed-INT4 shards, one per device.
    Convert(cmd::convert::ConvertArgs),
    /// Run a benchmark (each figure against a limit measured in the same run).
    #[command(subcommand, after_help = cmd::bench::BENCH_HELP)]
    Bench(cmd::bench::BenchTarget),
    /// The main job: start a local fabric, drive traffic, check every response against the
    /// in-process reference, print a report.
    Demo(cmd::demo::DemoCli),
    /// Start a whole local fabric (router + one worker process per device) until Ctrl-C.
    Up(cmd::up::UpCli),
    /// Run one expert worker (one device) of a multi-host deployment.
    Worker(cmd::worker::WorkerCli),
    /// Run the router service of a multi-host deployment.
    Router(cmd::router::RouterCli),
    /// One MoE-layer call from .npy files through a running router.
    Infer(cmd::infer::InferCli),
    /// Apply a new placement to a running fabric: gaining devices load first, losing devices
    /// release once every router stopped sending them; no call fails.
    Rebalance(cmd::rebalance::RebalanceCli),
    /// Drain a device of a running fabric: its experts move to the others (each loaded before
    /// it is released), then it serves nothing and can stop; no call fails.
    Drain(cmd::rebalance::DrainCli),
    /// Make the cluster's credentials: a master key (`init`), and each process's own
    /// credential file (`issue`).
    #[command(subcommand)]
    Keys(cmd::keys::KeysCli),
    /// Write what runs the fabric on a cluster engine: Slurm, Kubernetes or systemd (every
    /// process with exactly its own files), and print how to start it.
    #[command(subcommand)]
    Deploy(cmd::deploy::DeployCli),
}

/// The command line definition, with each command's exit codes at the end of its --help
/// (`bench` commands carry theirs in `bench_cli`).
pub(crate) fn command() -> clap::Command {
    let mut cmd = Cli::command();
    for (name, exit) in COMMAND_EXIT_CODES {
        cmd = cmd.mut_subcommand(name, |c| with_exit_codes(c, exit));
    }
    cmd
}

/// `c` with `exit` appended to its after-help texts (short and long) that do not list exit
/// codes yet.
fn with_exit_codes(c: clap::Command, exit: &str) -> clap::Command {
    let add = |h: Option<&clap::builder::StyledStr>| match h {
        Some(h) if h.to_string().contains("Exit codes") => h.to_string(),
        Some(h) => format!("{h}\n\n{exit}"),
        None => exit.to_owned(),
    };
    let long = c.get_after_long_help().map(|h| add(Some(h)));
    let short = add(c.get_after_help());
    let c = c.after_help(short);
    match long {
        Some(l) => c.after_long_help(l),
        None => c,
    }
}

/// Parse the process arguments and run; never panics on bad input.
pub fn main() -> ExitCode {
    // A mapped checkpoint, shard or tile-cache file cut short under us is named, not just
    // "Bus error".
    expertmesh_files::sigbus::install();
    let parsed = command()
        .try_get_matches()
        .and_then(|m| Cli::from_arg_matches(&m));
    let cli = match parsed {
        Ok(c) => c,
        Err(e) => {
            let code = if e.use_stderr() { EXIT_USAGE } else { 0 };
            let _ = e.print();
            return ExitCode::from(code);
        }
    };
    init_logging(cli.command.default_log_filter());
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(EXIT_USAGE)
        }
    }
}

/// The default log filter: warnings from every crate, and the fabric's own lifecycle at info
/// (links up and lost with rank, address and link kind; workers refused in the handshake;
/// devices quarantined and released; results of another incarnation dropped; metrics and load
/// files served). `EXPERTMESH_LOG` overrides it (`RUST_LOG` syntax, e.g.
/// `EXPERTMESH_LOG=debug` or `EXPERTMESH_LOG=warn,expertmesh_router=debug`).
pub(crate) const DEFAULT_LOG_FILTER: &str = "warn,expertmesh=info,expertmesh_fabric=info,\
expertmesh_router=info,expertmesh_worker=info,expertmesh_transport=info";

/// The default log filter of the commands whose output is a report (`demo`, `bench`):
/// warnings only, so the fabric's lifecycle lines do not land in the middle of the report
/// (`EXPERTMESH_LOG=info` shows them; the workers' own logs are files in the fabric's log
/// folder either way).
pub(crate) const REPORT_LOG_FILTER: &str = "warn";

impl Command {
    /// The log filter this command starts with when `EXPERTMESH_LOG` is not set.
    fn default_log_filter(&self) -> &'static str {
        match self {
            Command::Demo(_) | Command::Bench(_) => REPORT_LOG_FILTER,
            _ => DEFAULT_LOG_FILTER,
        }
    }
}

/// Log lines (tracing) go to stderr, one event per line with its time, level, target (the
/// crate and module) and key=value fields, colored only on a terminal; `EXPERTMESH_LOG_FORMAT=json` writes one JSON
/// object per line instead (for log shippers). Every process logs the same way: `up` and
/// `router` here, each worker process to its log file (its stderr). `default` is the filter
/// unless `EXPERTMESH_LOG` gives one.
fn init_logging(default: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("EXPERTMESH_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(true)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    let json = std::env::var("EXPERTMESH_LOG_FORMAT").is_ok_and(|f| f.eq_ignore_ascii_case("json"));
    let _ = if json {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
}

fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Models(args) => Ok(cmd::models::run(&args)),
        Command::Validate(args) => Ok(cmd::validate::run(&args)),
        Command::Plan(args) => Ok(cmd::plan::run(&args)),
        Command::Convert(args) => Ok(cmd::convert::run(&args)),
        Command::Demo(args) => cmd::demo::run(args),
        Command::Up(args) => cmd::up::run(args),
        Command::Worker(args) => cmd::worker::run(args),
        Command::Router(args) => cmd::router::run(args),
        Command::Infer(args) => cmd::infer::run(args),
        Command::Rebalance(args) => cmd::rebalance::run(args),
        Command::Drain(args) => cmd::rebalance::drain(args),
        Command::Keys(args) => cmd::keys::run(args),
        Command::Deploy(args) => cmd::deploy::run(args),
        Command::Bench(target) => cmd::bench::run(target),
    }
}
