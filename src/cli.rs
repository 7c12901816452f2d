//! The `expertmesh` command line: argument parsing and the subcommands' top level.
//!
//! Why this exists: the binary is a thin `main`; every subcommand lives here so integration
//! tests and the binary share one code path. Exit codes: 0 success, 1 invalid input
//! (validation problems, mismatched results), 2 usage or I/O errors; every command's --help
//! says what each means for it, and `expertmesh --help` lists them all.

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use std::process::ExitCode;

/// Exit codes of every command, shown by `expertmesh --help`.
const EXIT_CODES_HELP: &str = "\
Exit codes: 0 success, 1 invalid input or mismatched results, 2 usage or I/O error. Per command:
  models              0 listed or shown; 1 the model file has problems; 2 unknown preset,
                      unreadable file, bad options
  validate            0 valid; 1 problems found (listed with line:column); 2 unreadable file,
                      unknown preset, bad options
  plan                0 planned; 1 the model does not fit (shortfall named); 2 usage or input error
  convert             0 converted; 1 a problem in the checkpoint, config.json or placement (the
                      tensor or file is named) or a failed write (finished shards are kept:
                      re-run to resume); 2 usage
  bench ...           0 measured; 2 bad options, or a run that could not start (1 is not used)
  demo                0 every response matched the reference; 1 mismatched or failed responses;
                      2 usage or start-up error
  up, worker, router  0 stopped cleanly; 2 usage, start-up or I/O error (1 is not used)
  infer               0 output written; 1 the router answered with an error; 2 usage, I/O or
                      connection error
  keys init|issue     0 written; 2 the file exists (never overwritten), bad key, topology or
                      options
Benchmarks and their JSON format: `expertmesh bench --help` and BENCHMARKS.md.";

/// Each command's exit codes, appended to its own --help (after any text it has).
const COMMAND_EXIT_CODES: [(&str, &str); 9] = [
    ("models", MODELS_EXIT),
    ("validate", VALIDATE_EXIT),
    ("plan", PLAN_EXIT),
    ("convert", crate::convert_cmd::CONVERT_EXIT),
    ("demo", DEMO_EXIT),
    ("up", SERVE_EXIT),
    ("worker", SERVE_EXIT),
    ("router", SERVE_EXIT),
    ("infer", INFER_EXIT),
];
const MODELS_EXIT: &str = "Exit codes: 0 listed or shown; 1 the model file has problems; 2 unknown preset, unreadable file, bad options.";
const VALIDATE_EXIT: &str = "Exit codes: 0 valid; 1 problems found (listed with line:column); 2 unreadable file, unknown preset, bad options.";
const PLAN_EXIT: &str =
    "Exit codes: 0 planned; 1 the model does not fit (shortfall named); 2 usage or input error.";
const DEMO_EXIT: &str = "Exit codes: 0 every response matched the reference; 1 mismatched or failed responses; 2 usage or start-up error.";
const SERVE_EXIT: &str =
    "Exit codes: 0 stopped cleanly; 2 usage, start-up or I/O error (1 is not used).";
const INFER_EXIT: &str = "Exit codes: 0 output written; 1 the router answered with an error; 2 usage, I/O or connection error.";

/// ExpertMesh: stationary packed-INT4 experts, activation-only transport.
#[derive(Parser, Debug)]
#[command(name = "expertmesh", version, about, after_help = EXIT_CODES_HELP)]
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
    /// Convert a Hugging Face checkpoint folder into packed-INT4 shards, one per device.
    Convert(crate::convert_cmd::ConvertArgs),
    /// Run a benchmark (each figure against a limit measured in the same run).
    #[command(subcommand, after_help = crate::bench_cli::BENCH_HELP)]
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
    /// Make the cluster's credentials: a master key (`init`), and each process's own
    /// credential file (`issue`).
    #[command(subcommand)]
    Keys(crate::keys_cmd::KeysCli),
}

/// Exit code for invalid input (validation failed, results mismatched).
pub const EXIT_INVALID: u8 = 1;
/// Exit code for usage and I/O errors.
pub const EXIT_USAGE: u8 = 2;

/// The command line definition, with each command's exit codes at the end of its --help
/// (`bench` commands carry theirs in `bench_cli`).
pub fn command() -> clap::Command {
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
    init_logging();
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
pub const DEFAULT_LOG_FILTER: &str = "warn,expertmesh=info,expertmesh_fabric=info,\
expertmesh_router=info,expertmesh_worker=info,expertmesh_transport=info";

/// Log lines (tracing) go to stderr, one event per line with its time, level, target (the
/// crate and module) and key=value fields, colored only on a terminal; `EXPERTMESH_LOG_FORMAT=json` writes one JSON
/// object per line instead (for log shippers). Every process logs the same way: `up` and
/// `router` here, each worker process to its log file (its stderr).
fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("EXPERTMESH_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(DEFAULT_LOG_FILTER));
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
        Command::Models(args) => Ok(crate::models_cmd::run(&args)),
        Command::Validate(args) => Ok(crate::validate_cmd::run(&args)),
        Command::Plan(args) => Ok(crate::plan_cmd::run(&args)),
        Command::Convert(args) => Ok(crate::convert_cmd::run(&args)),
        Command::Demo(args) => crate::demo::run(args),
        Command::Up(args) => crate::cmd_fabric::up(args),
        Command::Worker(args) => crate::cmd_fabric::worker(args),
        Command::Router(args) => crate::cmd_fabric::router(args),
        Command::Infer(args) => crate::cmd_fabric::infer(args),
        Command::Keys(args) => crate::keys_cmd::run(args),
        Command::Bench(target) => crate::bench_cli::run(target),
    }
}
