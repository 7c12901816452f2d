//! `expertmesh bench soak`: its arguments, and the run's summary, JSON and exit code.
//!
//! Why this exists: the soak is a library ([`expertmesh_benches::soak`]); this module turns the
//! command line into its options and its outcome into an exit code (1 when an answer was wrong
//! or a call hung).

use expertmesh_benches::soak::{self, NetMode, SoakOptions};
use std::path::PathBuf;
use std::process::ExitCode;

/// Exit codes of `bench soak`, shown by its --help.
pub(crate) const EXIT_CODES: &str = "\
Exit codes: 0 every answer bit-identical or a clean error and no call hung; 1 a wrong answer or
a hung call; 2 bad options, or a fabric that could not start.";

/// Arguments of `bench soak`.
#[derive(clap::Args, Debug, Clone)]
pub(crate) struct SoakCli {
    /// Length of the run in minutes (fractions allowed, e.g. 0.5).
    #[arg(long, default_value_t = 10.0)]
    minutes: f64,
    /// Seed of the fault schedule (which fault, which target, when).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Seconds between faults (each ±20%).
    #[arg(long, default_value_t = 60.0)]
    fault_every_s: f64,
    /// Checking clients.
    #[arg(long, default_value_t = 3)]
    clients: usize,
    /// Router processes; with more than one every client is a failover client over all of
    /// them (`RouterClient::connect_any`).
    #[arg(long, default_value_t = 1)]
    routers: usize,
    /// Deadline of every call, ms.
    #[arg(long, default_value_t = 2000)]
    deadline_ms: u64,
    /// A call with no answer by deadline + this is a hang, ms.
    #[arg(long, default_value_t = 2000)]
    hang_margin_ms: u64,
    /// Network: auto (namespaces when permitted, else loopback, said in the output),
    /// namespaces (partitions, slow links; needs root and `ip netns`) or loopback.
    #[arg(long, default_value = "auto", value_parser = net_parser())]
    net: NetMode,
    /// Write the report as JSON (format: `expertmesh bench --help`; details under
    /// machine.soak).
    #[arg(long)]
    json: Option<PathBuf>,
    /// Folder for the fabric's files and logs, kept (default: a temporary folder, removed).
    #[arg(long)]
    dir: Option<PathBuf>,
}

/// `--net`: a [`NetMode`] by its name.
fn net_parser() -> impl clap::builder::TypedValueParser<Value = NetMode> {
    use clap::builder::TypedValueParser as _;
    clap::builder::PossibleValuesParser::new(NetMode::ALL.map(NetMode::name))
        .map(|s| s.parse::<NetMode>().expect("a listed network mode"))
}

/// Run `bench soak` from the command line.
pub(crate) fn run(cli: SoakCli) -> anyhow::Result<ExitCode> {
    let opts = SoakOptions {
        minutes: cli.minutes,
        seed: cli.seed,
        fault_every_s: cli.fault_every_s,
        clients: cli.clients,
        routers: cli.routers,
        deadline_ms: cli.deadline_ms,
        hang_margin_ms: cli.hang_margin_ms,
        net: cli.net,
        dir: cli.dir,
    };
    opts.check()?;
    expertmesh_benches::cluster::netns::install_signal_cleanup();
    let report = soak::run(&opts)?;
    print!("{}", report.summary());
    if let Some(path) = &cli.json {
        report.bench_report().write(path)?;
        println!("wrote {}", path.display());
    }
    Ok(if report.passed() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(crate::exit::EXIT_INVALID)
    })
}
