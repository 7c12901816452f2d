//! `expertmesh bench cluster`: its arguments, and the run's table, JSON and exit code.
//!
//! Why this exists: the emulated-cluster bench is a library
//! ([`expertmesh_benches::cluster`]); this module turns the command line into its options
//! (the standard run, `--quick`, or a line rate scaled from a topology's NIC) and its outcome
//! into an exit code (1 when an answer was wrong or a call failed).

use anyhow::anyhow;
use expertmesh_benches::cluster::ClusterBenchOptions;
use expertmesh_router::core::LayerMode;
use std::path::PathBuf;

/// Exit codes of `bench cluster`, shown by its --help.
pub(crate) const EXIT_CODES: &str = "\
Exit codes: 0 measured, every answer bit-identical; 1 a mismatched or failed call (named);
2 bad options, or a cluster that could not start or a report that could not be written.";

/// Arguments of `bench cluster` (defaults: the standard run; `--quick`: the test's).
#[derive(clap::Args, Debug)]
pub(crate) struct ClusterCli {
    /// Write the results as JSON to this file (format: `expertmesh bench --help`; achieved =
    /// measured, limit = the planner's prediction).
    #[arg(long)]
    json: Option<PathBuf>,
    /// Small figures (3 nodes of 2 workers at 40 Mbit/s, 1 and 3 routers, batches 1 and 8)
    /// for tests.
    #[arg(long)]
    quick: bool,
    /// Nodes (network namespaces), one CPU worker each.
    #[arg(long)]
    nodes: Option<usize>,
    /// Comma-separated router counts, each run as its own cluster (routers on nodes 0..R-1;
    /// default 1 and one per node).
    #[arg(long, value_delimiter = ',')]
    routers: Vec<usize>,
    /// NIC line rate in Mbit/s, each direction (tc tbf on both ends of every veth).
    #[arg(long)]
    line_rate_mbit: Option<f64>,
    /// Scale the line rate from this topology's first NIC instead (with --scale).
    #[arg(long, requires = "scale")]
    scale_from: Option<PathBuf>,
    /// Factor applied to --scale-from's line rate (e.g. 0.01: 10 Gbit/s becomes 100 Mbit/s).
    #[arg(long)]
    scale: Option<f64>,
    /// tbf bucket in bytes (larger allows longer bursts above the rate).
    #[arg(long)]
    tbf_burst: Option<u64>,
    /// tbf queue latency in ms (sets the queue length; too short drops packets).
    #[arg(long)]
    tbf_latency_ms: Option<f64>,
    /// Comma-separated batch sizes (tokens per layer call per frontend).
    #[arg(long, value_delimiter = ',')]
    batches: Vec<usize>,
    /// Seconds of measurement per batch size.
    #[arg(long)]
    seconds: Option<f64>,
    /// Frontend connections per router.
    #[arg(long)]
    clients: Option<usize>,
    /// Model hidden size (a multiple of 64).
    #[arg(long)]
    hidden: Option<u32>,
    /// CPU workers per node (two or more: the router sends a remote node one dispatch per
    /// micro-batch and its leader fans it out over shared memory).
    #[arg(long)]
    devices_per_node: Option<usize>,
    /// Serving mode of the routers: exact (every answer bit for bit against the in-process
    /// reference) or serving (bf16 rows pre-combined per device; RMS error within 1% of the
    /// reference's RMS). The prediction counts that mode's wire.
    #[arg(long, default_value = "exact",
          value_parser = crate::args::modes_parser(&[LayerMode::Exact, LayerMode::Serving]))]
    mode: LayerMode,
    /// Keep the generated topology, model, placement and logs in this folder.
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Niceness of the cluster's processes and frontends (e.g. -10 on a busy shared machine:
    /// the emulation is latency-sensitive though it needs little CPU).
    #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
    nice: i32,
}

impl ClusterCli {
    /// The options these arguments describe.
    pub(crate) fn options(&self) -> anyhow::Result<ClusterBenchOptions> {
        let mut o = if self.quick {
            ClusterBenchOptions::quick()
        } else {
            ClusterBenchOptions::standard()
        };
        if let Some(n) = self.nodes {
            o.nodes = n;
            if self.routers.is_empty() && !self.quick {
                o.routers = vec![1, n];
            }
        }
        if !self.routers.is_empty() {
            o.routers = self.routers.clone();
        }
        if let Some(path) = &self.scale_from {
            let t = expertmesh_topology::Topology::load(path).map_err(|e| anyhow!("{e}"))?;
            let nic = t
                .nodes()
                .iter()
                .flat_map(|n| n.nics())
                .next()
                .ok_or_else(|| anyhow!("{} has no NIC", path.display()))?;
            let scale = self.scale.unwrap_or(1.0);
            o.line_rate_mbit = nic.speed_gbit_s() * 1000.0 * scale;
            o.scaled_from = Some(format!(
                "{} Gbit/s of {} x {scale}",
                nic.speed_gbit_s(),
                path.display()
            ));
        }
        if let Some(r) = self.line_rate_mbit {
            o.line_rate_mbit = r;
        }
        o.tbf_burst_bytes = self.tbf_burst.unwrap_or(o.tbf_burst_bytes);
        o.tbf_latency_ms = self.tbf_latency_ms.unwrap_or(o.tbf_latency_ms);
        if !self.batches.is_empty() {
            o.batches = self.batches.clone();
        }
        o.seconds = self.seconds.unwrap_or(o.seconds);
        o.clients = self.clients.unwrap_or(o.clients).max(1);
        o.hidden = self.hidden.unwrap_or(o.hidden);
        o.mode = self.mode;
        o.devices_per_node = self
            .devices_per_node
            .unwrap_or(o.devices_per_node)
            .clamp(1, 8);
        anyhow::ensure!(
            o.hidden >= 64 && o.hidden % 64 == 0,
            "--hidden must be a multiple of 64"
        );
        anyhow::ensure!(
            o.line_rate_mbit.is_finite() && o.line_rate_mbit >= 1.0,
            "the line rate must be at least 1 Mbit/s"
        );
        anyhow::ensure!(
            o.seconds > 0.0 && o.seconds <= 600.0,
            "--seconds must be in (0, 600]"
        );
        o.dir = self.dir.clone();
        o.nice = self.nice;
        Ok(o)
    }
}

/// Run `bench cluster` from the command line: the table, the JSON, exit 1 when an answer was
/// wrong or a call failed.
pub(crate) fn run(c: ClusterCli) -> anyhow::Result<std::process::ExitCode> {
    let o = c.options()?;
    let out = expertmesh_benches::cluster::run(&o)?;
    out.print_table();
    if let Some(path) = &c.json {
        out.report.write(path)?;
        println!("wrote {}", path.display());
    }
    for p in &out.problems {
        eprintln!("error: {p}");
    }
    Ok(if out.problems.is_empty() {
        std::process::ExitCode::SUCCESS
    } else {
        std::process::ExitCode::from(crate::exit::EXIT_INVALID)
    })
}
