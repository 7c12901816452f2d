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
use expertmesh_planner::transition;
use expertmesh_router::client::placement::{ApplyError, apply_placement};
use expertmesh_topology::model::ModelSpec;
use expertmesh_topology::placement::Placement as PlacementFile;
use expertmesh_topology::topology::Topology;
use expertmesh_transport::frontend::{FrameConnection, FrontendConfig};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

/// (mesh rank, layer, expert) of one placement to apply.
type Entries = Vec<(u32, u32, u32)>;

/// What `rebalance` and `drain` both take: the running fabric and how long a step may take.
#[derive(Args, Debug)]
pub(crate) struct FabricArgs {
    /// Router 0's frontend address, HOST:PORT: it coordinates the change for the whole
    /// fabric (every router routes by what the workers announce; the others refuse changes).
    #[arg(long)]
    router: String,
    /// Cluster name, checked in the handshake (default: the topology's `name`).
    #[arg(long)]
    cluster: Option<String>,
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
    /// Write the placement applied here (TOML), for workers restarted later.
    #[arg(long, value_name = "FILE")]
    out: Option<PathBuf>,
    /// How long each step of the change may take (loading the gains, releasing).
    #[arg(long, default_value_t = 600.0, value_name = "SECONDS",
          value_parser = crate::args::parse_positive_seconds)]
    timeout_s: f64,
    #[command(flatten)]
    security: SecurityArgs,
}

/// `expertmesh rebalance`.
#[derive(Args, Debug)]
pub(crate) struct RebalanceCli {
    /// The new placement file (`expertmesh plan` writes one). Every device of the topology
    /// holds exactly what it lists once the change is applied; the shared experts stay where
    /// they run.
    #[arg(long, required_unless_present = "drain", conflicts_with = "drain")]
    placement: Option<PathBuf>,
    /// The placement the fabric serves now. With it the change is planned in steps that each
    /// fit every device's memory (`expertmesh plan --from` shows them), applied one after
    /// the other; without it the change is one step, and a device without room for its old
    /// and new experts together refuses it.
    #[arg(long, value_name = "SERVED")]
    from: Option<PathBuf>,
    /// Drain this device (NODE/DEVICE) instead of applying a placement (the same as
    /// `expertmesh drain --device`; needs --from).
    #[arg(long, value_name = "NODE/DEVICE", requires = "from")]
    drain: Option<String>,
    #[command(flatten)]
    fabric: FabricArgs,
}

/// `expertmesh drain`.
#[derive(Args, Debug)]
pub(crate) struct DrainCli {
    /// The device to drain, NODE/DEVICE as in the topology: every expert only it holds moves
    /// to the other devices with room; then it serves nothing and its worker can stop with
    /// no call failing.
    #[arg(long, value_name = "NODE/DEVICE")]
    device: String,
    /// The placement the fabric serves now (the moves are planned from it, in steps that fit
    /// every device's memory).
    #[arg(long, value_name = "SERVED")]
    from: PathBuf,
    #[command(flatten)]
    fabric: FabricArgs,
}

/// Run `expertmesh drain`: `rebalance --drain` under its own name, with the same exit codes.
pub(crate) fn drain(cli: DrainCli) -> anyhow::Result<ExitCode> {
    let device = cli.device.clone();
    let code = run(RebalanceCli {
        placement: None,
        from: Some(cli.from),
        drain: Some(cli.device),
        fabric: cli.fabric,
    })?;
    if code == ExitCode::SUCCESS {
        println!(
            "{device} serves nothing now: stop its worker (SIGTERM, or remove it from the \
             engine's job) and no call fails; take it out of the topology before the fabric's \
             next restart"
        );
    }
    Ok(code)
}

/// Whether a file can be written at `path`: a scratch file of this process made (held, so a
/// sweep leaves it) and removed in its folder; a missing folder or one without write
/// permission is named.
fn check_writable(path: &std::path::Path) -> anyhow::Result<()> {
    let folder = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => std::path::Path::new("."),
    };
    // A fresh temporary name, as the write itself will use (left-overs of killed runs are
    // swept, and never block this).
    let probe = expertmesh_files::temp_path(&folder.join(".expertmesh-write-check"));
    let held = expertmesh_files::create_locked(&probe, None).map_err(|e| {
        anyhow!(
            "--out {}: cannot write in {} ({e}); nothing was changed",
            path.display(),
            folder.display()
        )
    })?;
    let _ = std::fs::remove_file(&probe);
    drop(held);
    Ok(())
}

/// Run `expertmesh rebalance`: exit 0 once the placement is served (a device that did not
/// confirm its release named in a warning), 1 when the router refused it or the change failed
/// (its reason printed; the fabric serves the old placement), 2 on usage, file or connection
/// errors.
pub(crate) fn run(cli: RebalanceCli) -> anyhow::Result<ExitCode> {
    let topo = Topology::load(&cli.fabric.topology).map_err(|e| anyhow!("{e}"))?;
    let spec = model_of(&cli)?;
    let (steps, what, applied_toml) = plan(&cli, &topo, &spec)?;
    if let Some(out) = &cli.fabric.out {
        // Found out now, not once the fabric has changed (the change cannot be taken back).
        check_writable(out)?;
    }
    if steps.is_empty() {
        println!("{what}: equal to --from, nothing to change");
        return Ok(ExitCode::SUCCESS);
    }
    let addrs =
        endpoint::resolve_all(cli.fabric.router.trim()).map_err(|e| anyhow!("--router: {e}"))?;
    let cluster = cli
        .fabric
        .cluster
        .clone()
        .unwrap_or_else(|| topo.name().to_owned());
    let mut cfg = FrontendConfig::new(cluster.clone());
    cfg.credentials = cli.fabric.security.security().frontend(&cluster, &addrs)?;
    let timeout = Duration::from_secs_f64(cli.fabric.timeout_s);
    let addr = *addrs
        .first()
        .ok_or_else(|| anyhow!("--router {}: no address", cli.fabric.router))?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let mut conn = rt
        .block_on(FrameConnection::connect(addr, &cfg))
        .map_err(|e| anyhow!("{e}; is the router running, and is this its frontend port?"))?;
    let (mut loaded, mut released, mut millis) = (0u64, 0u64, 0u64);
    let mut version = 0;
    for (i, entries) in steps.iter().enumerate() {
        match rt.block_on(apply_placement(&mut conn, i as u64 + 1, entries, timeout)) {
            Ok(p) => {
                if steps.len() > 1 {
                    println!(
                        "step {} of {}: version {}, {} experts loaded, {} released, in {:.2} s",
                        i + 1,
                        steps.len(),
                        p.version,
                        p.loaded,
                        p.released,
                        p.took.as_secs_f64()
                    );
                }
                if let Some(why) = &p.unconfirmed {
                    eprintln!("warning: {why}");
                }
                loaded += u64::from(p.loaded);
                released += u64::from(p.released);
                millis += p.took.as_millis() as u64;
                version = p.version;
            }
            Err(e) => return step_failed(e, i, steps.len()),
        }
    }
    // Written once the placement is served, never for one that was not.
    if let Some(out) = &cli.fabric.out {
        expertmesh_files::write_output(out, applied_toml.as_bytes())
            .map_err(|e| anyhow!("writing {}: {e}", out.display()))?;
    }
    let in_steps = if steps.len() > 1 {
        format!(" ({} steps)", steps.len())
    } else {
        String::new()
    };
    println!(
        "{what} is served at version {version}: {loaded} experts loaded, {released} released, \
         in {:.2} s{in_steps}",
        millis as f64 / 1e3
    );
    let permanent = match &cli.fabric.out {
        Some(o) => format!("start the whole fabric with {} to keep it", o.display()),
        None => "write it with --out and start the whole fabric with it to keep it".into(),
    };
    println!(
        "note: a worker restarted later starts from the fabric's placement file, and the router \
         that applied this change gives it its new set again; {permanent}"
    );
    Ok(ExitCode::SUCCESS)
}

/// Step `i` (0-based) of `steps` was not applied: a lost connection or a garbled answer is an
/// error (the step may still be under way on the router), a failed change exits 1; either
/// way what the earlier steps applied is said.
fn step_failed(e: ApplyError, i: usize, steps: usize) -> anyhow::Result<ExitCode> {
    let done = if i > 0 {
        format!("steps 1 to {i} of {steps} were applied; ")
    } else {
        String::new()
    };
    if matches!(
        e,
        ApplyError::Transport(_) | ApplyError::NoAnswer(_) | ApplyError::Unexpected(_)
    ) {
        bail!(
            "{e}\nnote: {done}step {} may still be under way on the router (it ends applied or \
             undone within its timeout); once the router answers again, run the change again \
             (a router refuses a second change while one is under way)",
            i + 1
        )
    }
    eprintln!("error: the placement change failed: {e}");
    if i > 0 {
        eprintln!("note: {done}the fabric serves step {i}'s placement");
    }
    Ok(ExitCode::from(crate::exit::EXIT_INVALID))
}

/// The change to apply, as the entries of each step (one step without `--from`), what it is
/// (for the summary), and the placement's TOML (for `--out`).
fn plan(
    cli: &RebalanceCli,
    topo: &Topology,
    spec: &ModelSpec,
) -> anyhow::Result<(Vec<Entries>, String, String)> {
    let load = |p: &PathBuf| PlacementFile::load(p, topo, spec).map_err(|e| anyhow!("{e}"));
    let served = cli.from.as_ref().map(load).transpose()?;
    let (new, what) = match (&cli.placement, &cli.drain, &served) {
        (Some(p), _, _) => (load(p)?, format!("placement {}", p.display())),
        (None, Some(dev), Some(old)) => {
            let d = topo.device_by_id(dev).ok_or_else(|| {
                anyhow!("{dev}: no such device in {}", cli.fabric.topology.display())
            })?;
            let p = transition::drained(topo, spec, old, d.rank())
                .map_err(|e| anyhow!("draining {dev}: {e}"))?;
            (p, format!("{dev} drained"))
        }
        _ => bail!("give --placement NEW, or --drain NODE/DEVICE with --from SERVED"),
    };
    let steps: Vec<Entries> = match &served {
        Some(old) => {
            let plan = transition::transition(topo, spec, old, &new)
                .map_err(|e| anyhow!("planning the change from --from: {e}"))?;
            plan.steps
                .iter()
                .map(|s| transition::mesh_entries(topo, spec, &s.owners))
                .collect()
        }
        None => vec![transition::placement_mesh_entries(topo, spec, &new)],
    };
    Ok((steps, what, new.to_toml_string()))
}

/// The model: `--model`, or the converted folder's.
fn model_of(cli: &RebalanceCli) -> anyhow::Result<ModelSpec> {
    match (&cli.fabric.model, &cli.fabric.weights) {
        (Some(m), _) => expertmesh_topology::resolve_model(m).map_err(|e| anyhow!("{e}")),
        (None, Some(w)) => {
            expertmesh_worker::deploy::Deployment::load_converted(&cli.fabric.topology, w)
                .map(|d| d.spec)
                .map_err(|e| anyhow!("{e}"))
        }
        (None, None) => bail!("give the model: --model PRESET|FILE, or --weights DIR"),
    }
}
