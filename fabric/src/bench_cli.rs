//! `expertmesh bench <target>`: the bench subcommands and their arguments.
//!
//! Why this exists: each bench lives in its own module; this one only parses arguments and
//! dispatches, so adding `bench kernels` or `bench fabric` is one enum variant here.

use crate::bench_transport::{self, TransportBenchArgs};
use clap::{Args, Subcommand};
use expertmesh_transport::LinkKind;
use std::path::PathBuf;
use std::process::ExitCode;

/// What to benchmark.
#[derive(Subcommand, Debug)]
pub enum BenchTarget {
    /// Dispatch-frame throughput and round-trip latency over TCP loopback and shared memory,
    /// against a raw socket and memcpy measured in the same run.
    Transport(TransportCli),
}

/// Arguments of `bench transport`.
#[derive(Args, Debug)]
pub struct TransportCli {
    /// Write the report as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Approximate seconds per throughput measurement.
    #[arg(long, default_value_t = 0.3)]
    seconds: f64,
    /// Round trips per latency measurement (a quarter for 64 and 256 tokens).
    #[arg(long, default_value_t = 400)]
    round_trips: usize,
    /// Links to measure: tcp, shm (repeatable; default both).
    #[arg(long = "link", value_parser = parse_link)]
    links: Vec<LinkKind>,
}

fn parse_link(s: &str) -> Result<LinkKind, String> {
    match s {
        "tcp" => Ok(LinkKind::Tcp),
        "shm" => Ok(LinkKind::Shm),
        other => Err(format!("unknown link {other:?}; use tcp or shm")),
    }
}

/// Runs a bench target.
pub fn run(target: BenchTarget) -> anyhow::Result<ExitCode> {
    match target {
        BenchTarget::Transport(t) => {
            let mut args = TransportBenchArgs {
                json: t.json,
                seconds: t.seconds,
                round_trips: t.round_trips,
                ..TransportBenchArgs::default()
            };
            anyhow::ensure!(
                t.seconds > 0.0 && t.seconds <= 60.0,
                "--seconds must be in (0, 60]"
            );
            if !t.links.is_empty() {
                args.links = t.links;
            }
            bench_transport::run(&args)
        }
    }
}
