//! `expertmesh up`: a whole local fabric (the router(s) in this process, one worker process
//! per device) until Ctrl-C, restarting workers that exit.
//!
//! Why this exists: the quickest way from a topology and a model (or a converted weights
//! folder) to a fabric frontends can call; it prints where they connect and what input they
//! send. The launcher itself is [`expertmesh_fabric::local`].

use crate::args::{AutoRebalanceArgs, LinkTimeoutArgs, ObserveArgs, RouterArgs, link_parser};
use clap::Args;
use expertmesh_fabric::local::{LocalFabric, LocalFabricOptions};
use expertmesh_fabric::{credentials, defaults, observe};
use expertmesh_router::core::LayerMode;
use expertmesh_transport::mesh::LinkKind;
use expertmesh_worker::deploy::Deployment;
use std::path::PathBuf;
use std::process::ExitCode;

/// `expertmesh up`.
#[derive(Args, Debug)]
pub(crate) struct UpCli {
    /// Topology file.
    #[arg(long)]
    topology: PathBuf,
    /// Converted weights folder (written by `expertmesh convert`); the model and the placement
    /// come from its manifest.
    #[arg(long, conflicts_with_all = ["model", "placement", "seed"])]
    weights: Option<PathBuf>,
    /// Model preset or file (synthetic weights; not with --weights).
    #[arg(long, required_unless_present = "weights")]
    model: Option<String>,
    /// Placement file (default: a balanced plan computed from topology and model).
    #[arg(long)]
    placement: Option<PathBuf>,
    /// Seed of the synthetic weights.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Worker ↔ router link.
    #[arg(long, default_value = "tcp", value_parser = link_parser(&LinkKind::ALL))]
    link: LinkKind,
    #[command(flatten)]
    link_timeout: LinkTimeoutArgs,
    /// The NIC under RDMA links: verbs, libfabric (= libfabric:tcp;ofi_rxm, any host) or
    /// `libfabric:<provider>`.
    #[arg(long, default_value = "verbs", value_parser = crate::args::rdma_provider_parser)]
    rdma_provider: expertmesh_transport::rdma::RdmaProvider,
    #[command(flatten)]
    router: RouterArgs,
    #[command(flatten)]
    observe: ObserveArgs,
    #[command(flatten)]
    auto: AutoRebalanceArgs,
    /// Cluster master key (`expertmesh keys init`): `up` issues each router, worker and the
    /// printed frontend its own credentials (authenticated, encrypted links). Without it the
    /// fabric runs unauthenticated and unencrypted (loopback only, unless --insecure).
    #[arg(long)]
    key: Option<PathBuf>,
    /// Run without a key on non-loopback addresses (unauthenticated, unencrypted).
    #[arg(long)]
    insecure: bool,
    /// CPU workers keep their repacked tiles of the shards in this folder (private to this
    /// user) and map them from there on the next start instead of repacking (with --weights).
    #[arg(long, value_name = "DIR", requires = "weights")]
    tile_cache: Option<PathBuf>,
}

/// Run `expertmesh up` until interrupted; restarts workers that exit.
pub(crate) fn run(cli: UpCli) -> anyhow::Result<ExitCode> {
    let model = cli.model.clone().unwrap_or_default();
    let (placement, _tmp) = match (&cli.weights, cli.placement) {
        (Some(w), _) => (w.join("placement.toml"), None),
        (None, Some(p)) => (p, None),
        (None, None) => defaults::balanced_placement_file(&cli.topology, &model)?,
    };
    let mut opts = LocalFabricOptions::new(&cli.topology, &model, &placement);
    opts.seed = cli.seed;
    opts.weights = cli.weights.clone();
    opts.link = cli.link;
    opts.link_timeout = cli.link_timeout.duration();
    opts.rdma_provider = cli.rdma_provider.clone();
    opts.router = cli.router.config();
    // Every process of `up` is on this host: no micro-batch split unless asked for.
    opts.micro_batch_fit = cli.router.micro_batch.is_none();
    opts.frontend_limits = cli.router.frontend_limits();
    let observe_opts = cli.observe.options();
    let worker_metrics = observe::up_worker_addrs(&observe_opts, &cli.topology)?;
    opts.worker_metrics = worker_metrics.clone();
    opts.key = cli.key.clone();
    opts.insecure = cli.insecure;
    opts.tile_cache = cli.tile_cache.clone();
    if cli.key.is_none() {
        let probe = match &cli.weights {
            Some(w) => Deployment::load_converted(&cli.topology, w),
            None => Deployment::load(&cli.topology, &model, &placement, cli.seed),
        };
        if let Ok(dep) = probe {
            let mut exposed = dep.router_mesh_endpoints()?;
            exposed.extend(
                (0..dep.router_count()).filter_map(|i| dep.router_frontend_endpoint(i).ok()),
            );
            credentials::check_security(dep.credentials.as_deref(), cli.insecure, &exposed)?;
        }
    }
    eprintln!(
        "expertmesh up: starting the router(s) and the workers; waiting for them to connect..."
    );
    let mut fabric = LocalFabric::start(opts)?;
    let dep = fabric.deployment();
    println!(
        "expertmesh up: model {} on {} ({} workers over {}), {} mode, micro-batches of {} tokens",
        dep.spec.name,
        dep.topology.name(),
        dep.topology.devices().len(),
        cli.link.name(),
        cli.router.mode_or(LayerMode::Serving).name(),
        fabric.router_config().micro_batch_tokens
    );
    let fronts: Vec<String> = fabric
        .frontend_addrs()
        .iter()
        .flatten()
        .map(ToString::to_string)
        .collect();
    println!(
        "  frontends: {} (cluster \"{}\"{})",
        fronts.join(", "),
        dep.topology.name(),
        if fronts.len() > 1 {
            format!(", {} routers sharing the workers", fronts.len())
        } else {
            String::new()
        }
    );
    println!("  worker logs: {}", fabric.log_dir().display());
    println!(
        "  input: .npy [tokens, {}] float32, float16 or bf16 bits as uint16, at most {} tokens per request (`expertmesh infer --help` shows how to make one)",
        dep.spec.hidden, cli.router.max_tokens
    );
    println!(
        "  try: expertmesh infer --router {} --cluster {} --layer {} --input X.npy --output Y.npy",
        fronts.join(","),
        dep.topology.name(),
        dep.spec.moe_layer_ids()[0]
    );
    let _observers = observe::start_up(&observe_opts, &fabric, &worker_metrics)?;
    let auto = match fabric.router(0) {
        Some(r) => cli.auto.start(0, r, fabric.deployment())?,
        None => None,
    };
    println!("Ctrl-C to stop.");
    expertmesh_fabric::process::supervise_until_stopped(&mut fabric)?;
    println!("stopping");
    drop(auto);
    fabric.shutdown();
    Ok(ExitCode::SUCCESS)
}
