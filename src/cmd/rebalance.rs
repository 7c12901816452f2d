//! `expertmesh rebalance`: apply a new placement to a running fabric, with no call failing.
//!
//! Why this exists: a better placement (from `plan --load` on live load, or for a device added
//! or drained) is only worth something if it reaches the fabric without a restart. This
//! command checks the new placement against the topology and the model, sends it to one
//! router, and waits for that router to report the placement served (each gaining device
//! loaded its experts first, each losing device released them once every router had stopped
//! sending them) or the change undone with its reason (`expertmesh_router::rebalance`).

use crate::args::SecurityArgs;
use anyhow::{anyhow, bail};
use clap::Args;
use expertmesh_fabric::endpoint;
use expertmesh_topology::model::ModelSpec;
use expertmesh_topology::placement::Placement as PlacementFile;
use expertmesh_topology::topology::Topology;
use expertmesh_transport::codec::{Body, Placement, PlacementOp, encode_placement_entries};
use expertmesh_transport::frontend::{FrameConnection, FrontendConfig};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

/// `expertmesh rebalance`.
#[derive(Args, Debug)]
pub(crate) struct RebalanceCli {
    /// A router's frontend address, HOST:PORT: it coordinates the change for the whole fabric
    /// (every router routes by what the workers announce).
    #[arg(long)]
    router: String,
    /// Cluster name (the topology's `name`), checked in the handshake.
    #[arg(long, default_value = "single-host")]
    cluster: String,
    /// The fabric's topology file.
    #[arg(long)]
    topology: PathBuf,
    /// The model: a preset name or a model TOML file (default with --weights: the
    /// converted folder's model).
    #[arg(long)]
    model: Option<String>,
    /// The converted weights folder the fabric serves (its model is used; gaining devices
    /// read their new experts from it).
    #[arg(long)]
    weights: Option<PathBuf>,
    /// The new placement file (`expertmesh plan` writes one). Every device of the topology
    /// holds exactly what it lists once the change is applied; the shared experts stay where
    /// they run.
    #[arg(long)]
    placement: PathBuf,
    /// How long each step of the change may take (loading the gains, releasing).
    #[arg(long, default_value_t = 600.0, value_name = "SECONDS")]
    timeout_s: f64,
    #[command(flatten)]
    security: SecurityArgs,
}

/// Run `expertmesh rebalance`: exit 0 once the placement is served, 1 when the router refused
/// it or the change failed (its reason printed; the fabric serves the old placement, or says
/// which device did not confirm), 2 on usage, file or connection errors.
pub(crate) fn run(cli: RebalanceCli) -> anyhow::Result<ExitCode> {
    if !(cli.timeout_s > 0.0 && cli.timeout_s <= 86_400.0) {
        bail!("--timeout-s must be in (0, 86400], not {}", cli.timeout_s);
    }
    let topo = Topology::load(&cli.topology).map_err(|e| anyhow!("{e}"))?;
    let spec = model_of(&cli)?;
    let placement =
        PlacementFile::load(&cli.placement, &topo, &spec).map_err(|e| anyhow!("{e}"))?;
    let entries = entries_of(&topo, &spec, &placement);
    let addrs = endpoint::resolve_all(cli.router.trim()).map_err(|e| anyhow!("--router: {e}"))?;
    let mut cfg = FrontendConfig::new(cli.cluster.clone());
    cfg.credentials = cli.security.security().frontend(&cli.cluster, &addrs)?;
    let timeout = Duration::from_secs_f64(cli.timeout_s);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let addr = *addrs
        .first()
        .ok_or_else(|| anyhow!("--router {}: no address", cli.router))?;
    let answer = rt.block_on(async {
        let mut conn = FrameConnection::connect(addr, &cfg)
            .await
            .map_err(|e| anyhow!("{e}; is the router running, and is this its frontend port?"))?;
        let mut p = Placement::new(PlacementOp::Apply, 0, entries.len());
        p.request_id = 1;
        p.millis = u32::try_from(timeout.as_millis()).unwrap_or(u32::MAX);
        conn.write_frame(&Body::Placement(p), &encode_placement_entries(&entries))
            .await
            .map_err(|e| anyhow!("{e}"))?;
        // Load, release, and (on failure) the undo each get the timeout.
        let wait = 3 * timeout + Duration::from_secs(10);
        let frame = tokio::time::timeout(wait, conn.read_frame())
            .await
            .map_err(|_| anyhow!("no answer from the router within {wait:?}"))?
            .map_err(|e| anyhow!("{e}"))?;
        anyhow::Ok(frame.body().clone())
    })?;
    match answer {
        Body::Placement(p) if p.op == PlacementOp::Applied => {
            println!(
                "placement {} is served at version {}: {} experts loaded, {} released, in {:.2} s",
                cli.placement.display(),
                p.version,
                p.loaded,
                p.released,
                f64::from(p.millis) / 1e3
            );
            println!(
                "note: a worker restarted later loads its placement file; make {} the fabric's \
                 placement (or convert with it) before restarting workers",
                cli.placement.display()
            );
            Ok(ExitCode::SUCCESS)
        }
        Body::Error(e) => {
            eprintln!("error: the placement change failed: {}", e.message);
            Ok(ExitCode::from(crate::exit::EXIT_INVALID))
        }
        other => bail!(
            "the router answered with an unexpected {:?} frame",
            other.kind()
        ),
    }
}

/// The model: `--model`, or the converted folder's.
fn model_of(cli: &RebalanceCli) -> anyhow::Result<ModelSpec> {
    match (&cli.model, &cli.weights) {
        (Some(m), _) => expertmesh_topology::resolve_model(m).map_err(|e| anyhow!("{e}")),
        (None, Some(w)) => expertmesh_worker::deploy::Deployment::load_converted(&cli.topology, w)
            .map(|d| d.spec)
            .map_err(|e| anyhow!("{e}")),
        (None, None) => bail!("give the model: --model PRESET|FILE, or --weights DIR"),
    }
}

/// Every (mesh rank, layer, expert) of the placement: the routers are mesh ranks
/// `0..routers`, device `d` is `routers + d`.
fn entries_of(topo: &Topology, spec: &ModelSpec, p: &PlacementFile) -> Vec<(u32, u32, u32)> {
    let routers = (topo.routers().len() as u32).max(1);
    let mut out = Vec::new();
    for d in topo.devices() {
        let rank = routers + d.rank().0;
        for layer in spec.moe_layer_ids() {
            out.extend(
                p.experts_on(d.rank(), layer)
                    .iter()
                    .map(|&e| (rank, layer, e)),
            );
        }
    }
    out
}
