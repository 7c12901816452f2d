//! `expertmesh bench <target>`: the bench subcommands and their arguments.
//!
//! Why this exists: each bench is a library function of `expertmesh-benches` that takes plain
//! options; this module only parses arguments, calls it, prints its table and writes its JSON
//! and report, so adding a bench is one enum variant here. `cluster` and `soak` have more
//! options and their own exit codes: they have their own modules.

mod cluster;
mod soak;

use crate::args::{link_parser, mode_parser};
use anyhow::anyhow;
use clap::{Args, Subcommand};
use expertmesh_benches::kernels::{self, KernelPin};
use expertmesh_benches::method::{compare, report};
use expertmesh_benches::{convert, fabric, rebalance, transport};
use expertmesh_router::core::LayerMode;
use expertmesh_transport::LinkKind;
use std::path::PathBuf;
use std::process::ExitCode;

/// The links the transport and fabric benches measure.
const BENCH_LINKS: [LinkKind; 2] = [LinkKind::Tcp, LinkKind::Shm];

/// Exit codes of every `bench` command, shown by its --help.
pub(crate) const BENCH_EXIT_CODES: &str = "\
Exit codes: 0 measured (and --json written); 2 bad options, or a run that could not start or
write its report (1 is not used).";

/// The bench JSON format, shown by `expertmesh bench --help`.
pub(crate) const BENCH_HELP: &str = "\
Every figure is a ratio against a limit measured in the same run on the same machine (shared,
noisy machines make absolute numbers mean little). Tables: achieved, limit, unit, ratio =
achieved / limit, and which way the ratio is good (\"higher is better\" for throughputs,
\"lower is better\" for latencies).

--json FILE writes:
  {\"machine\": {\"hostname\", \"os\", \"arch\", \"cpus\", \"cpu_model\", \"memory_bytes\", ...},
   \"results\": [{\"name\", \"batch\", \"achieved\", \"limit\", \"unit\", \"ratio\",
                \"better\": \"higher\" | \"lower\", \"limit_is\" or \"limit_kind\", ...}, ...]}
  machine also records each bench's settings; `bench kernels` adds \"device_kind\": \"cpu\",
  \"backend\", \"settings\" (seconds, pool and probe sizes) and the measured read bandwidth.
  machine describes the CPU (model, family, flags), kernel, build profile, git revision and
  load. kernels and transport figures are medians of interleaved repetitions (the thing and
  its limit back to back): each result adds \"ratio_p10\"/\"ratio_p90\", \"repetitions\",
  \"samples\": {\"achieved\": [...], \"limit\": [...]} and \"bench_bug\": true when a ratio is
  past its limit by more than 2%. --report DIR writes an HTML page with plots;
  `expertmesh bench compare A.json B.json` flags the figures that moved beyond noise.
`expertmesh plan --calibrate FILE` reads these files (kernel results calibrate only devices of
the machine's device_kind). Recorded runs and how to read them: BENCHMARKS.md in the repository.

Exit codes: 0 measured (and --json written); 1 (`cluster`, `soak`) a wrong answer, a failed or
hung call; 2 bad options, or a run that could not start or write its report.";

/// What to benchmark.
#[derive(Subcommand, Debug)]
pub(crate) enum BenchTarget {
    /// Compare two bench JSON files figure by figure: each ratio with its spread, the change,
    /// and whether it is outside noise (rank test on the raw samples, else disjoint p10-p90
    /// ranges); machine differences first. `--report DIR` also plots the changes.
    #[command(after_help = BENCH_EXIT_CODES)]
    Compare(CompareCli),
    /// An emulated cluster: nodes as network namespaces with tc-shaped NICs, router and worker
    /// processes inside them, several frontends; tokens/s and latency per batch size against
    /// `expertmesh plan`'s prediction for the same topology (needs root).
    #[command(after_help = cluster::EXIT_CODES)]
    Cluster(cluster::ClusterCli),
    /// Checkpoint conversion and a worker's shard load against a raw read of the same files,
    /// and the searched quantizer's error against absmax round-to-nearest, measured in the
    /// same run on a synthetic BF16 checkpoint.
    #[command(after_help = BENCH_EXIT_CODES)]
    Convert(ConvertCli),
    /// One MoE layer through the local fabric (router + worker processes) against the same
    /// layer in-process on the same backend, measured in the same run.
    #[command(after_help = BENCH_EXIT_CODES)]
    Fabric(FabricCli),
    /// Expert FFN kernels on the CPU backend against the memory read bandwidth (decode) and
    /// the int8 peak (prefill; on an AMX CPU the higher of it and the AMX contract loop)
    /// measured in the same run.
    #[command(after_help = BENCH_EXIT_CODES)]
    Kernels(KernelsCli),
    /// Skewed (Zipf) traffic on the local fabric before and after a live placement change
    /// planned for it, against the gain the planner's device-load model predicts; the p99 of
    /// calls while the change is applied against the p99 before.
    #[command(after_help = BENCH_EXIT_CODES)]
    Rebalance(RebalanceCli),
    /// A small multi-process fabric (exact mode, replicas) under checked load for N minutes
    /// with a random fault about once a minute (worker kill/pause, router restart/pause, and
    /// with root partitions and slow links): calls, clean errors, wrong answers and hangs
    /// (both must be 0), recovery after each fault, RSS at start and end.
    #[command(after_help = soak::EXIT_CODES)]
    Soak(soak::SoakCli),
    /// Dispatch-frame throughput and round-trip latency over TCP loopback and shared memory,
    /// against a raw socket and memcpy measured in the same run.
    #[command(after_help = BENCH_EXIT_CODES)]
    Transport(TransportCli),
}

/// Arguments of `bench convert` (sizes default to `--quick`'s or the standard run's).
#[derive(Args, Debug)]
pub(crate) struct ConvertCli {
    /// Write the results as JSON to this file (format: `expertmesh bench --help`).
    #[arg(long)]
    json: Option<PathBuf>,
    /// A tiny run for tests (hidden 256, width 128, 4 experts, 1 layer, 2 repeats) instead of
    /// the standard one (hidden 2048, width 768, 4 experts, 2 layers: 75.5 MB of BF16, 2
    /// repeats).
    #[arg(long)]
    quick: bool,
    /// Hidden size (a multiple of 32).
    #[arg(long)]
    hidden: Option<usize>,
    /// Routed expert width (a multiple of 32).
    #[arg(long)]
    moe_inter: Option<usize>,
    /// Routed experts per layer.
    #[arg(long)]
    experts: Option<usize>,
    /// Layers (every one MoE).
    #[arg(long)]
    layers: Option<usize>,
    /// Comma-separated conversion thread counts, each measured (default 2,1).
    #[arg(long, value_delimiter = ',', value_parser = crate::args::threads_parser())]
    threads: Vec<usize>,
    /// Measurements per case.
    #[arg(long)]
    repeats: Option<usize>,
    /// Experts per weight distribution whose quantization error is measured.
    #[arg(long)]
    error_experts: Option<usize>,
    /// Random inputs per expert for the output error.
    #[arg(long)]
    error_inputs: Option<usize>,
    /// Folder for the synthetic checkpoint and the converted shards, kept afterwards (default:
    /// a temporary folder, removed).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Quantize with u4 zero points per group (asymmetric) instead of symmetrically.
    #[arg(long)]
    zero_points: bool,
}

impl ConvertCli {
    fn options(&self) -> convert::ConvertBenchOptions {
        let base = if self.quick {
            convert::ConvertBenchOptions::quick()
        } else {
            convert::ConvertBenchOptions::standard()
        };
        convert::ConvertBenchOptions {
            hidden: self.hidden.unwrap_or(base.hidden),
            moe_inter: self.moe_inter.unwrap_or(base.moe_inter),
            experts: self.experts.unwrap_or(base.experts),
            layers: self.layers.unwrap_or(base.layers),
            threads: if self.threads.is_empty() {
                base.threads
            } else {
                self.threads.clone()
            },
            repeats: self.repeats.unwrap_or(base.repeats),
            error_experts: self.error_experts.unwrap_or(base.error_experts),
            error_inputs: self.error_inputs.unwrap_or(base.error_inputs),
            dir: self.dir.clone(),
            zero_points: self.zero_points,
            seed: base.seed,
        }
    }
}

/// Arguments of `bench fabric`.
#[derive(Args, Debug)]
pub(crate) struct FabricCli {
    /// Write the results as JSON to this file (format: `expertmesh bench --help`).
    #[arg(long)]
    json: Option<PathBuf>,
    /// Model preset or file.
    #[arg(long, default_value = "demo-small")]
    model: String,
    /// Topology (default: the embedded single-host example, two workers).
    #[arg(long)]
    topology: Option<PathBuf>,
    /// Placement (default: the embedded single-host placement of demo-small).
    #[arg(long)]
    placement: Option<PathBuf>,
    /// Comma-separated batch sizes.
    #[arg(long, default_value = "1,8,64", value_delimiter = ',')]
    batches: Vec<usize>,
    /// Seconds per measurement.
    #[arg(long, default_value_t = 3.0)]
    seconds: f64,
    /// Concurrent frontend clients.
    #[arg(long, default_value_t = 4)]
    clients: usize,
    /// Links to measure: tcp, shm (repeatable; default both).
    #[arg(long = "link", value_parser = link_parser(&BENCH_LINKS))]
    links: Vec<LinkKind>,
    /// Numerical mode.
    #[arg(long, default_value = "exact", value_parser = mode_parser())]
    mode: LayerMode,
    /// Tokens per micro-batch (router split and worker limit; default: the largest batch, so
    /// calls are not split: on one host each micro-batch would only stream the touched experts
    /// again).
    #[arg(long)]
    micro_batch: Option<usize>,
}

impl FabricCli {
    /// The bench's options (`--seconds` checked; no `--link`: TCP and shared memory).
    fn options(self) -> anyhow::Result<fabric::FabricBenchOptions> {
        anyhow::ensure!(
            self.seconds > 0.0 && self.seconds <= 600.0,
            "--seconds must be in (0, 600]"
        );
        let links = if self.links.is_empty() {
            BENCH_LINKS.to_vec()
        } else {
            self.links
        };
        Ok(fabric::FabricBenchOptions {
            topology: self.topology,
            model: self.model,
            placement: self.placement,
            batches: self.batches,
            seconds: self.seconds,
            clients: self.clients,
            links,
            mode: self.mode,
            micro_batch: self.micro_batch,
        })
    }
}

/// Arguments of `bench rebalance`.
#[derive(Args, Debug)]
pub(crate) struct RebalanceCli {
    /// Write the results as JSON to this file (format: `expertmesh bench --help`).
    #[arg(long)]
    json: Option<PathBuf>,
    /// Comma-separated batch sizes.
    #[arg(long, default_value = "16,64", value_delimiter = ',')]
    batches: Vec<usize>,
    /// Seconds per measurement.
    #[arg(long, default_value_t = 3.0)]
    seconds: f64,
    /// Concurrent frontend clients.
    #[arg(long, default_value_t = 4)]
    clients: usize,
    /// Zipf exponent of the expert popularity (hot experts are the low ids, all on the first
    /// device of the load-blind placement).
    #[arg(long, default_value_t = 1.2)]
    zipf: f64,
    /// The model served (a preset name or a model TOML file; one MoE layer of it is
    /// called). `wide` (the default): one MoE layer of 32 experts top-4 the width of
    /// GLM-4.5-Air's (hidden 4096, intermediate 1408), so the devices' compute, not the
    /// router's per-call work, bounds the throughput, as the planner's model assumes.
    #[arg(long, default_value = "wide")]
    model: String,
}

/// Arguments of `bench kernels`.
#[derive(Args, Debug)]
pub(crate) struct KernelsCli {
    /// Write the results as JSON to this file (format: `expertmesh bench --help`).
    #[arg(long)]
    json: Option<PathBuf>,
    /// Backend threads (default: all cores).
    #[arg(long, value_parser = crate::args::threads_parser())]
    threads: Option<usize>,
    /// Seconds the whole run may take (setup included): repetitions stop when the next would
    /// not fit; a short run also shrinks the weight pool and the probes (stated in the output).
    #[arg(long, default_value_t = 300.0)]
    seconds: f64,
    /// Repetitions per case (each: read probe, peak loop, kernel calls, back to back).
    #[arg(long, default_value_t = kernels::DEFAULT_REPETITIONS)]
    repeats: usize,
    /// Write an HTML page with SVG plots into this folder (index.html).
    #[arg(long)]
    report: Option<PathBuf>,
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
    /// Minimum weight pool in MiB (default: max(1 GiB, 32 x last-level cache); less when
    /// --seconds is too short to fill it, but at least 2 x the last-level cache).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=1 << 24))]
    pool_mib: u64,
    /// Where the backend's threads run: `limit` pins them as the best read probe's threads
    /// (the placement the memory limit was measured with), `unpinned` leaves them to the OS.
    #[arg(long, default_value = "limit", value_parser = pin_parser())]
    pin: KernelPin,
    /// Instruction set of the kernels: scalar, avx2, avx512-vnni or amx-int8 (default: the best this CPU
    /// has), to compare the paths on one machine.
    #[arg(long, value_parser = isa_parser)]
    isa: Option<kernels::Isa>,
    /// Also measure every decode case with its weights in the cache (the same few experts
    /// every call), against the kernels' own ceiling (the int8 peak; for exact mode on an AMX
    /// CPU the higher of it and the AMX contract loop), which tells a decode row held by
    /// memory from one held by the kernels' arithmetic.
    #[arg(long)]
    cache_resident: bool,
}

/// Arguments of `bench transport`.
#[derive(Args, Debug)]
pub(crate) struct TransportCli {
    /// Write the results as JSON to this file (format: `expertmesh bench --help`).
    #[arg(long)]
    json: Option<PathBuf>,
    /// Seconds the whole run may take: repetitions stop when the next would not fit.
    #[arg(long, default_value_t = 60.0)]
    seconds: f64,
    /// Round trips per latency sample (mesh and limit each, per repetition).
    #[arg(long, default_value_t = 100)]
    round_trips: usize,
    /// Repetitions per figure (mesh and limit alternate within each).
    #[arg(long, default_value_t = transport::DEFAULT_REPETITIONS)]
    repeats: usize,
    /// Write an HTML page with SVG plots into this folder (index.html).
    #[arg(long)]
    report: Option<PathBuf>,
    /// Links to measure: tcp, shm, rdma (repeatable; default tcp and shm).
    #[arg(long = "link", value_parser = link_parser(&LinkKind::ALL))]
    links: Vec<LinkKind>,
    /// The NIC under the rdma link: verbs (an RDMA device; `--features rdma`), libfabric
    /// (tcp;ofi_rxm, any host; `--features libfabric`) or `libfabric:<provider>`.
    #[arg(long, default_value = "verbs", value_parser = crate::args::rdma_provider_parser)]
    rdma_provider: expertmesh_transport::rdma::RdmaProvider,
}

/// `--pin`: a [`KernelPin`] by its name.
fn pin_parser() -> impl clap::builder::TypedValueParser<Value = KernelPin> {
    use clap::builder::TypedValueParser as _;
    clap::builder::PossibleValuesParser::new(KernelPin::ALL.map(KernelPin::name))
        .map(|s| s.parse::<KernelPin>().expect("a listed placement"))
}

/// `--isa`: an instruction set this CPU supports.
fn isa_parser(s: &str) -> Result<kernels::Isa, String> {
    use kernels::Isa;
    let all = [Isa::Scalar, Isa::Avx2, Isa::Avx512Vnni, Isa::Amx];
    let isa = all
        .into_iter()
        .find(|i| i.name() == s)
        .ok_or_else(|| format!("{s:?}: one of scalar, avx2, avx512-vnni, amx-int8"))?;
    if !isa.supported() {
        return Err(format!(
            "this CPU cannot run {s} (it has: {})",
            Isa::available()
                .iter()
                .map(|i| i.name())
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    Ok(isa)
}

/// Arguments of `bench compare`.
#[derive(Args, Debug)]
pub(crate) struct CompareCli {
    /// The first (reference) bench JSON file.
    a: PathBuf,
    /// The second bench JSON file, compared against the first.
    b: PathBuf,
    /// Write an HTML page with the changes plotted into this folder (index.html).
    #[arg(long)]
    report: Option<PathBuf>,
}

/// Prints a report's table and writes its JSON when asked.
fn print_and_write(
    report: &expertmesh_benches::method::json::BenchReport,
    json: Option<&std::path::Path>,
) -> anyhow::Result<ExitCode> {
    report.print_table();
    if let Some(path) = json {
        report.write(path)?;
        println!("wrote {}", path.display());
    }
    Ok(ExitCode::SUCCESS)
}

/// Runs a bench target.
pub(crate) fn run(target: BenchTarget) -> anyhow::Result<ExitCode> {
    match target {
        BenchTarget::Cluster(c) => cluster::run(c),
        BenchTarget::Compare(c) => {
            compare::run(&c.a, &c.b, c.report.as_deref())?;
            Ok(ExitCode::SUCCESS)
        }
        BenchTarget::Soak(c) => soak::run(c),
        BenchTarget::Rebalance(r) => {
            anyhow::ensure!(
                r.seconds > 0.0 && r.seconds <= 600.0,
                "--seconds must be in (0, 600]"
            );
            let report = rebalance::run(&rebalance::RebalanceBenchOptions {
                batches: r.batches,
                seconds: r.seconds,
                clients: r.clients,
                zipf: r.zipf,
                model: r.model,
            })?;
            print_and_write(&report, r.json.as_deref())
        }
        BenchTarget::Convert(c) => {
            let report = convert::run(&c.options())?;
            print_and_write(&report, c.json.as_deref())
        }
        BenchTarget::Fabric(f) => {
            let json = f.json.clone();
            let report = fabric::run(&f.options()?)?;
            print_and_write(&report, json.as_deref())
        }
        BenchTarget::Kernels(k) => {
            anyhow::ensure!(
                k.seconds > 0.0 && k.seconds <= 600.0,
                "--seconds must be in (0, 600]"
            );
            anyhow::ensure!(
                !k.batches.contains(&0),
                "--batches: a batch has at least one token"
            );
            anyhow::ensure!(k.repeats >= 1, "--repeats must be at least 1");
            let models = k
                .models
                .iter()
                .map(|m| {
                    expertmesh_topology::resolve_model(m).map_err(|e| anyhow!("--models: {e}"))
                })
                .collect::<anyhow::Result<Vec<_>>>()?;
            let threads = k
                .threads
                .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
            let report = kernels::run(&kernels::KernelBenchOptions {
                threads,
                seconds: k.seconds,
                repetitions: k.repeats,
                models,
                batches: k.batches,
                prefill_tokens: k.prefill_tokens,
                pool_bytes: k.pool_mib << 20,
                pin: k.pin,
                isa: k.isa,
                cache_resident: k.cache_resident,
            })?;
            report.print_table();
            report::finish(&report, k.json.as_deref(), k.report.as_deref())?;
            Ok(ExitCode::SUCCESS)
        }
        BenchTarget::Transport(t) => {
            let mut args = transport::TransportBenchOptions {
                seconds: t.seconds,
                round_trips: t.round_trips,
                repetitions: t.repeats.max(1),
                ..transport::TransportBenchOptions::default()
            };
            anyhow::ensure!(
                t.seconds > 0.0 && t.seconds <= 600.0,
                "--seconds must be in (0, 600]"
            );
            if !t.links.is_empty() {
                args.links = t.links;
            }
            args.rdma_provider = t.rdma_provider;
            let report = transport::run(&args)?;
            report.print_table();
            report::finish(&report, t.json.as_deref(), t.report.as_deref())?;
            Ok(ExitCode::SUCCESS)
        }
    }
}
