//! `expertmesh worker`: one expert worker (one device) of a deployment.
//!
//! Why this exists: a multi-host deployment starts one of these per device, and the local
//! launcher starts the same command for each of its workers, so both run exactly the same code
//! ([`expertmesh_worker::process::run`]); this module turns arguments into its options, and
//! with `--prepare-tile-cache` runs [`expertmesh_worker::process::prepare_tile_cache`] and
//! says what it did.

use crate::args::{
    DeployArgs, LinkTimeoutArgs, MetricsArgs, SecurityArgs, backend_parser, link_parser,
    parse_endpoint, rdma_provider_parser,
};
use clap::Args;
use expertmesh_transport::mesh::LinkKind;
use expertmesh_worker::process::{BackendChoice, WorkerOptions};
use std::net::SocketAddr;
use std::process::ExitCode;

/// `expertmesh worker`.
#[derive(Args, Debug)]
pub(crate) struct WorkerCli {
    #[command(flatten)]
    deploy: DeployArgs,
    /// Device to serve: its id ("node/device") or topology rank.
    #[arg(long)]
    device: String,
    /// Router mesh address; repeat it (or separate with commas) once per router, in the
    /// topology's order (default: every router's mesh port from the topology).
    #[arg(long, value_parser = parse_endpoint, value_delimiter = ',')]
    router: Vec<SocketAddr>,
    /// Listen address of this worker (default: the device's data port).
    #[arg(long, value_parser = parse_endpoint)]
    listen: Option<SocketAddr>,
    /// Every device's listen address in topology order, comma-separated (default: the
    /// topology's data endpoints); node peers dial each other there to share dispatches.
    #[arg(long, value_parser = parse_endpoint, value_delimiter = ',')]
    device_addrs: Vec<SocketAddr>,
    /// Link to the router.
    #[arg(long, default_value = "tcp", value_parser = link_parser(&LinkKind::ALL))]
    link: LinkKind,
    /// The NIC under RDMA links: verbs (RoCE/InfiniBand), libfabric (= libfabric:tcp;ofi_rxm)
    /// or `libfabric:<provider>` (e.g. libfabric:verbs;ofi_rxm, libfabric:efa). Routers and
    /// workers must agree.
    #[arg(long, default_value = "verbs", value_parser = rdma_provider_parser)]
    rdma_provider: expertmesh_transport::rdma::RdmaProvider,
    #[command(flatten)]
    link_timeout: LinkTimeoutArgs,
    /// Backend threads (default: the topology's `threads` for CPU devices).
    #[arg(long, value_parser = crate::args::threads_parser())]
    threads: Option<usize>,
    /// Backend: auto (HIP for GPU devices when available, else CPU), cpu or hip.
    #[arg(long, default_value = "auto", value_parser = backend_parser())]
    backend: BackendChoice,
    /// The HIP runtime library to open (default: $EXPERTMESH_HIP_LIBRARY, else libamdhip64 from
    /// $HIP_PATH, $ROCM_PATH, /opt/rocm or the loader's path).
    #[arg(long, value_name = "PATH")]
    hip_library: Option<std::path::PathBuf>,
    /// The GPU to use, overriding the topology's gpu_index (in a container that sees only the
    /// GPU its device plugin gave it, 0).
    #[arg(long, value_name = "N")]
    gpu_index: Option<usize>,
    /// Largest dispatch (tokens) this worker accepts; match the router's --micro-batch.
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    /// Keep the CPU backend's repacked tiles of this device's shard in this folder (private
    /// to this user; created 0700) and map them from there on the next start instead of
    /// repacking: a restart loads at the speed of a read. Converted weights only.
    #[arg(long, value_name = "DIR")]
    tile_cache: Option<std::path::PathBuf>,
    /// Only prepare --tile-cache: load this device's experts, keep their tiles and exit (0
    /// when the file is kept or was already valid), joining no mesh (the router, listen, link,
    /// metrics and security options do not apply). Run it before a start, or before an
    /// upgrade while the old worker still serves, so the start maps the tiles; it needs memory
    /// for a second copy of the experts meanwhile, and uses --threads (default: every core).
    #[arg(long, requires = "tile_cache")]
    prepare_tile_cache: bool,
    /// Exit when the parent process exits (used by the local launcher).
    #[arg(long)]
    exit_with_parent: bool,
    #[command(flatten)]
    metrics: MetricsArgs,
    #[command(flatten)]
    security: SecurityArgs,
}

/// Run `expertmesh worker`.
pub(crate) fn run(cli: WorkerCli) -> anyhow::Result<ExitCode> {
    if cli.exit_with_parent {
        expertmesh_fabric::process::exit_with_parent();
    }
    let mut dep = cli.deploy.load()?;
    if cli.prepare_tile_cache {
        return prepare(&dep, cli);
    }
    cli.link_timeout.apply(&mut dep);
    let d = dep.device(&cli.device)?;
    let listen = match cli.listen {
        Some(a) => a,
        None => dep.worker_endpoint(d)?,
    };
    let mut exposed = vec![listen];
    exposed.extend(&cli.router);
    let rank = dep.mesh_rank(d);
    cli.security
        .security()
        .apply_rank(&mut dep, rank, &exposed)?;
    expertmesh_worker::process::run(dep, options(cli))?;
    Ok(ExitCode::SUCCESS)
}

/// The worker's options from its arguments.
fn options(cli: WorkerCli) -> WorkerOptions {
    WorkerOptions {
        device: cli.device,
        routers: cli.router,
        listen: cli.listen,
        device_addrs: cli.device_addrs,
        link: cli.link,
        threads: cli.threads,
        backend: cli.backend,
        hip_library: cli.hip_library,
        gpu_index: cli.gpu_index,
        rdma_provider: cli.rdma_provider,
        max_tokens: cli.max_tokens.max(1),
        metrics: cli.metrics.metrics,
        tile_cache: cli.tile_cache,
    }
}

/// `--prepare-tile-cache`: keep the device's tiles, say where, and exit.
fn prepare(
    dep: &expertmesh_worker::deploy::Deployment,
    cli: WorkerCli,
) -> anyhow::Result<ExitCode> {
    use expertmesh_worker::process::TileCacheUse;
    let device = cli.device.clone();
    let t0 = std::time::Instant::now();
    let used = expertmesh_worker::process::prepare_tile_cache(dep, &options(cli))?;
    let secs = t0.elapsed().as_secs_f64();
    match used {
        TileCacheUse::Reused { file, .. } => println!(
            "expertmesh worker {device}: its tiles were already kept in {} (checked in {secs:.2} s)",
            file.display()
        ),
        TileCacheUse::Written { file, .. } => println!(
            "expertmesh worker {device}: tiles kept in {} ({secs:.2} s)",
            file.display()
        ),
        TileCacheUse::NotWritten { error, .. } => {
            anyhow::bail!("{device}: the tiles could not be kept: {error}")
        }
        TileCacheUse::NoContentId => anyhow::bail!(
            "{device}: synthetic weights have no stable identity to keep tiles for; give \
             --weights (a converted checkpoint)"
        ),
        TileCacheUse::Unused => {
            println!("expertmesh worker {device}: holds no experts, no tiles to keep")
        }
        TileCacheUse::Writing { .. } => {
            anyhow::bail!("{device}: the tiles were still being written ({used:?})")
        }
    }
    Ok(ExitCode::SUCCESS)
}
