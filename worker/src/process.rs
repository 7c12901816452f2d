//! The expert worker: one process per device, pinning its experts for life and serving
//! dispatch frames from every router.
//!
//! Why this exists: this is the "device" of the design. At start it loads only its own
//! (layer, expert) weights onto its backend, once, with every buffer sized for the largest
//! batch; then it joins the mesh (dialing every router, redialing each with backoff if it
//! restarts) and loops: a dispatch frame in, the backend run once for the whole grouped batch,
//! one result frame out to the router that sent it. The compute loop runs on the main thread
//! and reads the mesh's events itself (the driver that read a frame wakes it: no task in
//! between), while the mesh's own tasks keep answering heartbeats on the I/O thread however
//! long a batch takes. Dispatches from several routers are
//! served round robin ([`crate::fair`]): each router's credit window bounds what it can queue
//! here, and one busy router cannot starve another. A router whose link is lost costs only
//! its own queued dispatches (dropped: nobody would read their results).

use crate::deploy::{DeployError, Deployment};
use crate::exec::DispatchExecutor;
use crate::exec::ExecError;
use crate::fair::FairQueue;
use crate::fanout::{ExpertHomes, Forward, NodeFanout, ToRouter};
use crate::holdings::Confirmed;
use crate::weights::{self, WeightsError};
use expertmesh_backend::ExpertKey;
use expertmesh_backend::{BackendError, BatchLimits, ExpertBackend};
use expertmesh_cpu_backend::CpuBackend;
use expertmesh_router::metrics::http::MetricsServerError;
use expertmesh_transport::codec::{
    self, Body, ErrorCode, ErrorFrame, ExpertResult, Placement, PlacementOp,
    encode_placement_entries, placement_entries, placement_message,
};
use expertmesh_transport::mesh::{
    LinkKind, Mesh, MeshEvents, OutFrame, PeerError, PeerErrorKind, RecvFrame, StartError,
    Transport, TransportEvent,
};
use expertmesh_transport::{MemoryBudget, MemoryReservation};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context as TaskContext, Poll, Waker};
use std::time::{Duration, Instant};

/// Why a worker process (or the router core of a router process) could not start: its
/// deployment or weights, its backend, its runtime, its mesh or its metrics endpoint.
///
/// Every message includes its cause, and no variant exposes it as
/// [`std::error::Error::source`] (see [`DeployError`]).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WorkerError {
    /// The device, a router or an endpoint could not be looked up in the deployment.
    #[error("{0}")]
    Deploy(DeployError),
    /// The experts (or the router's gates and shared experts) could not be loaded.
    #[error("{0}")]
    Weights(WeightsError),
    /// A device rank the topology does not have.
    #[error("no device {0}")]
    NoDevice(u32),
    /// A device's backend could not start or load its experts.
    #[error("{device}: {cause}")]
    DeviceBackend {
        /// The device's id.
        device: String,
        /// Why.
        cause: BackendError,
    },
    /// Preparing a device's tile cache ([`prepare_tile_cache`]) could not be done.
    #[error("{device}: {why}")]
    TileCache {
        /// The device's id.
        device: String,
        /// Why.
        why: String,
    },
    /// A CPU backend (the router's, for shared experts, or a worker's) could not start or
    /// load its experts.
    #[error("{0}")]
    Backend(BackendError),
    /// The worker's async runtime could not start.
    #[error("starting the worker runtime: {0}")]
    Runtime(std::io::Error),
    /// The worker could not join the mesh.
    #[error("worker {worker}: {cause}")]
    Mesh {
        /// The device, as "node/device (rank N)".
        worker: String,
        /// Why.
        cause: StartError,
    },
    /// The worker's `/metrics` endpoint could not start.
    #[error("worker {worker}: {cause}")]
    Metrics {
        /// The device's id.
        worker: String,
        /// Why.
        cause: MetricsServerError,
    },
    /// `--router` was given, but not once per router of the topology.
    #[error(
        "{given} router address{} given but topology {cluster} declares {routers} router{}; \
         pass one --router per router, in the topology's order",
        if *given == 1 { " was" } else { "es were" },
        if *routers == 1 { "" } else { "s" }
    )]
    RouterCount {
        /// How many addresses were given.
        given: usize,
        /// The topology's cluster name.
        cluster: String,
        /// How many routers it declares.
        routers: u32,
    },
}

impl From<DeployError> for WorkerError {
    fn from(e: DeployError) -> Self {
        Self::Deploy(e)
    }
}

impl From<WeightsError> for WorkerError {
    fn from(e: WeightsError) -> Self {
        Self::Weights(e)
    }
}

/// Which backend a worker runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendChoice {
    /// HIP when compiled in and a device is present, else the CPU (with a log line).
    Auto,
    /// The CPU backend.
    Cpu,
    /// The HIP backend; failing to start it is an error.
    Hip,
}

impl BackendChoice {
    /// Every choice, as `--backend` lists them.
    pub const ALL: [BackendChoice; 3] =
        [BackendChoice::Auto, BackendChoice::Cpu, BackendChoice::Hip];

    /// The name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Cpu => "cpu",
            Self::Hip => "hip",
        }
    }
}

impl std::str::FromStr for BackendChoice {
    type Err = String;

    /// The choice named `s` ([`BackendChoice::name`]).
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|b| b.name() == s)
            .ok_or_else(|| format!("unknown backend {s:?}: give auto, cpu or hip"))
    }
}

/// How one worker runs.
#[derive(Clone, Debug)]
pub struct WorkerOptions {
    /// Which device ("node/device" or a rank number).
    pub device: String,
    /// Where each router's mesh listens, by instance (empty: every router from the topology;
    /// otherwise one address per router the topology declares).
    pub routers: Vec<SocketAddr>,
    /// This worker's listen address (default: the device's data endpoint).
    pub listen: Option<SocketAddr>,
    /// Every device's listen address by topology rank (empty: the topology's data endpoints);
    /// node peers dial each other there when their node fans out.
    pub device_addrs: Vec<SocketAddr>,
    /// Link to the router.
    pub link: LinkKind,
    /// Backend threads (default: the topology's `threads` for CPU devices, else all cores).
    pub threads: Option<usize>,
    /// Backend choice.
    pub backend: BackendChoice,
    /// The HIP runtime library to open (default: `EXPERTMESH_HIP_LIBRARY`, else `libamdhip64`
    /// from ROCm's usual places).
    pub hip_library: Option<std::path::PathBuf>,
    /// The GPU to use, overriding the topology's `gpu_index` (a container that sees only the
    /// GPU its device plugin gave it sees it as 0).
    pub gpu_index: Option<usize>,
    /// The NIC under RDMA links (routers and workers must agree).
    pub rdma_provider: expertmesh_transport::rdma::RdmaProvider,
    /// Largest batch (tokens) a dispatch may carry.
    pub max_tokens: usize,
    /// Serve Prometheus metrics at `/metrics` on this address (port 0 picks a free one).
    pub metrics: Option<SocketAddr>,
    /// A folder where the CPU backend keeps its repacked tiles of the shard, and maps them
    /// from on the next start instead of repacking ([`expertmesh_cpu_backend::tile_cache`]).
    pub tile_cache: Option<std::path::PathBuf>,
}

/// A loaded backend, and with a tile cache being written, the thread that waits for it
/// (joined at a clean stop, so a stop does not leave the file half written).
type LoadedBackend = (Box<dyn ExpertBackend>, Option<std::thread::JoinHandle<()>>);

/// Choose and load the backend for device `d` ([`LoadedBackend`]).
fn make_backend(
    dep: &Deployment,
    opts: &WorkerOptions,
    limits: BatchLimits,
    metrics: &Arc<crate::metrics::WorkerMetrics>,
) -> Result<LoadedBackend, WorkerError> {
    let d = dep.device(&opts.device)?;
    let dev = dep.topology.device(d).ok_or(WorkerError::NoDevice(d.0))?;
    let on_device = |cause| WorkerError::DeviceBackend {
        device: dev.id().to_string(),
        cause,
    };
    let mut experts = weights::device_expert_source(dep, d)?;
    let threads = device_threads(opts, dev);
    let want_hip = match opts.backend {
        BackendChoice::Cpu => false,
        BackendChoice::Hip => true,
        BackendChoice::Auto => dev.kind() == expertmesh_topology::topology::DeviceKind::Gpu,
    };
    if want_hip {
        let gpu = opts
            .gpu_index
            .unwrap_or(dev.gpu_index().unwrap_or(0) as usize);
        let hip = match &opts.hip_library {
            Some(lib) => expertmesh_hip_kernels::hip::HipBackend::with_library(gpu, lib),
            None => expertmesh_hip_kernels::hip::HipBackend::new(gpu),
        };
        match hip {
            Ok(mut hip) => {
                if opts.tile_cache.is_some() {
                    tracing::info!(
                        device = %dev.id(),
                        "--tile-cache is for the CPU backend; the HIP backend uploads the shard"
                    );
                }
                hip.load_from(&mut *experts, limits).map_err(on_device)?;
                return Ok((Box::new(hip), None));
            }
            Err(e) if opts.backend == BackendChoice::Auto => {
                tracing::warn!(
                    device = %dev.id(),
                    "HIP backend unavailable ({e}); falling back to the CPU backend"
                );
            }
            Err(e) => return Err(on_device(e)),
        }
    }
    let mut cpu = load_cpu(threads, opts.tile_cache.as_deref(), &mut *experts, limits)
        .map_err(|e| e.on(dev.id()))?;
    log_tile_cache_use(dev.id(), cpu.tile_cache_use());
    metrics.on_tile_cache(cpu.tile_cache_use());
    // The tiles are written beside the serving; their outcome is logged when known.
    let writer = cpu.take_tile_cache_writer().and_then(|w| {
        let id = dev.id().to_string();
        let metrics = Arc::clone(metrics);
        std::thread::Builder::new()
            .name("tile-cache-log".into())
            .spawn(move || {
                if let Ok(used) = w.join() {
                    log_tile_cache_use(&id, &used);
                    metrics.on_tile_cache(&used);
                }
            })
            .ok()
    });
    Ok((Box::new(cpu), writer))
}

/// What a load did with the tile cache ([`prepare_tile_cache`]'s answer).
pub use expertmesh_cpu_backend::tile_cache::TileCacheUse;

/// Why [`load_cpu`] failed: the backend could not start, or could not load the experts.
enum CpuLoadError {
    Start(BackendError),
    Load(BackendError),
}

impl CpuLoadError {
    /// The worker's error for device `id`.
    fn on(self, id: &str) -> WorkerError {
        match self {
            CpuLoadError::Start(e) => WorkerError::Backend(e),
            CpuLoadError::Load(cause) => WorkerError::DeviceBackend {
                device: id.to_string(),
                cause,
            },
        }
    }
}

/// A CPU backend of `threads` threads with the experts of `experts` loaded, through the tile
/// cache in `tile_cache` when given.
fn load_cpu(
    threads: usize,
    tile_cache: Option<&std::path::Path>,
    experts: &mut dyn expertmesh_backend::ExpertSource,
    limits: BatchLimits,
) -> Result<CpuBackend, CpuLoadError> {
    let mut cpu = CpuBackend::new(threads).map_err(CpuLoadError::Start)?;
    if let Some(dir) = tile_cache {
        cpu.set_tile_cache(Some(expertmesh_cpu_backend::tile_cache::TileCache::new(
            dir,
        )));
    }
    cpu.load_from(experts, limits).map_err(CpuLoadError::Load)?;
    Ok(cpu)
}

/// Backend threads of a CPU device: `--threads`, else the topology's, else every core.
fn device_threads(opts: &WorkerOptions, dev: &expertmesh_topology::topology::Device) -> usize {
    opts.threads
        .or(dev.threads().map(|t| t as usize))
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// Loads device `opts.device`'s experts on the CPU backend with `opts.tile_cache`, waits for
/// its tile file to be written (or finds it already there) and returns what the cache did,
/// without joining any mesh: run it before a start, or before an upgrade while the old
/// worker still serves, so that start maps its tiles instead of repacking. Refused for a
/// device that would run on HIP (`--backend hip`, or `auto` on a GPU device): the HIP backend
/// uploads its shard and keeps no tiles.
pub fn prepare_tile_cache(
    dep: &Deployment,
    opts: &WorkerOptions,
) -> Result<TileCacheUse, WorkerError> {
    let d = dep.device(&opts.device)?;
    let dev = dep.topology.device(d).ok_or(WorkerError::NoDevice(d.0))?;
    let refuse = |why: &str| WorkerError::TileCache {
        device: dev.id().to_string(),
        why: why.to_string(),
    };
    let Some(dir) = &opts.tile_cache else {
        return Err(refuse("preparing the tile cache needs --tile-cache DIR"));
    };
    let gpu = dev.kind() == expertmesh_topology::topology::DeviceKind::Gpu;
    if opts.backend == BackendChoice::Hip || (opts.backend == BackendChoice::Auto && gpu) {
        return Err(refuse(
            "the tile cache is for the CPU backend; this device runs on HIP, which uploads its \
             shard and keeps no tiles (give --backend cpu if it serves on the CPU)",
        ));
    }
    let mut experts = weights::device_expert_source(dep, d)?;
    let limits = worker_limits(dep, opts.max_tokens);
    let mut cpu = load_cpu(device_threads(opts, dev), Some(dir), &mut *experts, limits)
        .map_err(|e| e.on(dev.id()))?;
    let used = match cpu.take_tile_cache_writer() {
        Some(w) => w
            .join()
            .map_err(|_| refuse("the tile cache's writer thread panicked"))?,
        None => cpu.tile_cache_use().clone(),
    };
    log_tile_cache_use(dev.id(), &used);
    Ok(used)
}

/// Says what the load of device `id` did with the tile cache (nothing without one).
fn log_tile_cache_use(id: &str, used: &TileCacheUse) {
    match used {
        TileCacheUse::Unused => {}
        TileCacheUse::NoContentId => tracing::info!(
            device = %id,
            "tile cache not used: synthetic weights have no stable identity (convert a checkpoint)"
        ),
        TileCacheUse::Reused {
            file,
            lock_error: None,
        } => tracing::info!(
            device = %id, file = %file.display(),
            "experts mapped from the tile cache and locked in memory"
        ),
        TileCacheUse::Reused {
            file,
            lock_error: Some(error),
        } => tracing::warn!(
            device = %id, file = %file.display(), %error,
            "experts copied from the tile cache into this process's memory: its map could not \
             be locked (usually the memory lock limit: raise it, e.g. LimitMEMLOCK=infinity or \
             `ulimit -l unlimited`, for the faster load)"
        ),
        TileCacheUse::Writing { file, miss } => tracing::info!(
            device = %id, file = %file.display(), %miss,
            "experts repacked; keeping the tiles for the next start (written while serving)"
        ),
        TileCacheUse::Written {
            file,
            miss,
            write_s,
        } => tracing::info!(
            device = %id, file = %file.display(), %miss, write_s = format!("{write_s:.2}"),
            "the tiles are kept for the next start"
        ),
        TileCacheUse::NotWritten { miss, error } => tracing::warn!(
            device = %id, %miss, %error, "experts repacked; the tile cache could not keep them"
        ),
    }
}

/// Batch limits of a worker: `max_tokens` tokens, each with all its routed and shared slots.
pub fn worker_limits(dep: &Deployment, max_tokens: usize) -> BatchLimits {
    let slots = (dep.spec.top_k + dep.spec.shared_experts) as usize;
    BatchLimits {
        max_tokens,
        max_pairs: max_tokens * slots,
    }
}

/// The first SIGTERM or SIGINT, named. When the handlers cannot be installed (logged), this
/// never returns and the signals keep their default action (the process ends at once).
pub async fn stop_signal() -> &'static str {
    use tokio::signal::unix::{SignalKind, signal};
    let reset = expertmesh_transport::signals::reset_stop_handlers_set_by_libraries();
    if !reset.is_empty() {
        tracing::debug!(
            ?reset,
            "a linked library had installed stop handlers; reset to the default first"
        );
    }
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        tracing::warn!("cannot install SIGTERM/SIGINT handlers; the default actions apply");
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    }
}

/// The worker's `/ready` check: once it joined every router (the routers missing are named),
/// ready for good ([`ReadyOnce`](expertmesh_router::metrics::http::ReadyOnce): one router
/// restarting does not take every worker out of service) until it stops.
fn readiness(
    dep: &Deployment,
    mesh: &Mesh,
    stop: Arc<AtomicBool>,
) -> expertmesh_router::metrics::http::Readiness {
    let mesh = mesh.clone();
    let names = dep.rank_names();
    let routers = dep.router_count();
    let joined = expertmesh_router::metrics::http::ReadyOnce::default();
    Arc::new(move || {
        let stopping = stop
            .load(Ordering::Acquire)
            .then(|| "stopping: answering what is queued, taking nothing new".to_owned());
        joined.verdict(stopping, || {
            let missing: Vec<&str> = (0..routers)
                .filter(|&r| !mesh.is_connected(r))
                .map(|r| names.get(r as usize).map_or("router", String::as_str))
                .collect();
            (!missing.is_empty()).then(|| format!("not joined to router(s) {}", missing.join(", ")))
        })
    })
}

/// The worker's `/ready` before its mesh exists: `/live` and `/metrics` answer from before
/// the load (a cluster engine's start-up probe must not kill a worker still loading a large
/// shard), `/ready` says it is loading until [`readiness`] of its mesh is set.
#[derive(Default)]
struct MeshReady(Arc<std::sync::OnceLock<expertmesh_router::metrics::http::Readiness>>);

impl MeshReady {
    fn readiness(&self) -> expertmesh_router::metrics::http::Readiness {
        let mesh = Arc::clone(&self.0);
        Arc::new(move || match mesh.get() {
            Some(ready) => ready(),
            None => Err("loading its experts".to_string()),
        })
    }
}

/// A flag set, and the calling (compute) thread woken, on SIGTERM or SIGINT (Slurm's
/// `scancel`, Kubernetes, systemd, Ctrl-C): the compute loop then finishes and answers what
/// is queued and returns; routers send later parts to a replica or fail them with a reason.
fn stop_on_signal(rt: &tokio::runtime::Runtime) -> Arc<AtomicBool> {
    let stop = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&stop);
    let compute = std::thread::current();
    rt.spawn(async move {
        let signal = stop_signal().await;
        tracing::info!(signal, "stopping: finishing queued dispatches");
        eprintln!("expertmesh worker: {signal}: finishing queued dispatches, then exiting");
        flag.store(true, Ordering::SeqCst);
        compute.unpark();
    });
    stop
}

/// Run a worker until SIGTERM or SIGINT (it finishes and answers what is queued, and a node
/// leader what its node peers still compute, then returns) or until its mesh ends.
pub fn run(dep: Deployment, opts: WorkerOptions) -> Result<(), WorkerError> {
    let d = dep.device(&opts.device)?;
    let rank = dep.mesh_rank(d);
    let t0 = Instant::now();
    let limits = worker_limits(&dep, opts.max_tokens);
    let metrics = crate::metrics::new(&dep);
    let mesh_ready = MeshReady::default();
    let _metrics_server =
        crate::metrics::serve(&metrics, &dep, rank, opts.metrics, mesh_ready.readiness())?;
    let load_started = Instant::now();
    let (backend, tile_cache_writer) = make_backend(&dep, &opts, limits, &metrics)?;
    let loaded = backend.loaded_bytes();
    metrics.on_loaded(load_started.elapsed().as_secs_f64(), loaded);
    let backend_name = backend.name();
    let exec = DispatchExecutor::new(backend, dep.spec.hidden as usize, limits);
    let routers = router_addresses(&dep, &opts.routers)?;
    let listen = match opts.listen {
        Some(a) => a,
        None => dep.worker_endpoint(d)?,
    };
    let mut cfg = dep.mesh_config(rank, &routers, &opts.device_addrs, listen, opts.link);
    cfg.rdma_provider = opts.rdma_provider.clone();
    let node_peers = dep.node_peers(d);
    let r_count = dep.router_count();
    if !node_peers.is_empty() {
        // Join the node peers first, the routers after (below): a router must not count this
        // device as a live destination before its node's leader can forward to it.
        cfg.dial_ranks = cfg
            .dial_ranks
            .map(|v| v.into_iter().filter(|&r| r >= r_count).collect());
    }
    let fanout = (!node_peers.is_empty()).then(|| {
        NodeFanout::new(
            ExpertHomes::for_device(&dep, d),
            dep.spec.hidden as usize,
            FANOUT_TIMEOUT,
            expertmesh_router::service::fresh_incarnation(),
        )
    });
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("worker-io")
        .enable_all()
        .build()
        .map_err(WorkerError::Runtime)?;
    // Messages name the device and its topology rank; the mesh rank stays internal.
    let id = dep.device_label(d);
    let (mesh, events) = rt
        .block_on(Mesh::start(cfg))
        .map_err(|cause| WorkerError::Mesh {
            worker: id.clone(),
            cause,
        })?;
    join_routers_after_node_peers(&rt, &mesh, &node_peers, r_count, &id);
    let listening = mesh.local_addr().unwrap_or(listen);
    say_ready(&id, loaded, &backend_name, t0, listening, &routers);

    // The compute loop runs on this thread and reads the mesh's events itself: a frame goes
    // from the driver that read it (the shm consumer or the TCP reader) straight to it, no
    // task in between. Inputs wait in per-sender queues served round robin; each router's
    // credit window bounds what it can have queued here.
    let stop = stop_on_signal(&rt);
    let _ = mesh_ready.0.set(readiness(&dep, &mesh, Arc::clone(&stop)));
    let ctx = ComputeCtx {
        stop,
        exec,
        fanout,
        routers: dep.router_count(),
        mesh: mesh.clone(),
        handle: rt.handle().clone(),
        queue: FairQueue::new(routers.len()),
        names: dep.rank_names(),
        id,
        metrics,
        stale: StaleWork::default(),
        live: Live::new(dep, d, rank),
        peer_backlog: MemoryBudget::new(PEER_BACKLOG_BYTES),
        stopping: false,
    };
    {
        let _guard = rt.enter();
        ctx.run(events);
    }
    mesh.shutdown();
    rt.shutdown_timeout(Duration::from_millis(200));
    if let Some(w) = tile_cache_writer {
        let _ = w.join(); // finish writing the tiles kept for the next start
    }
    Ok(())
}

/// A device with node peers joins them first and dials the routers after (a router must not
/// count it as a live destination before its node's leader can forward to it).
fn join_routers_after_node_peers(
    rt: &tokio::runtime::Runtime,
    mesh: &Mesh,
    node_peers: &[u32],
    routers: u32,
    id: &str,
) {
    if node_peers.is_empty() {
        return;
    }
    if let Err(e) = rt.block_on(mesh.wait_connected(node_peers, NODE_JOIN_TIMEOUT)) {
        tracing::warn!(
            worker = %id, error = %e,
            "node peers not connected; joining the routers anyway (forwarded shares for them fail until they connect)"
        );
    }
    let _guard = rt.enter();
    for r in 0..routers {
        mesh.dial(r);
    }
}

/// The line on stdout that says worker `id` is ready (the launchers and tests wait for it).
fn say_ready(
    id: &str,
    loaded: u64,
    backend_name: &str,
    t0: Instant,
    listening: SocketAddr,
    routers: &[SocketAddr],
) {
    let shown: Vec<String> = routers.iter().map(ToString::to_string).collect();
    println!(
        "expertmesh worker {id} ready: {:.1} MB of experts on {backend_name}, loaded in {:.2} s, listening on {listening}, router{} at {}",
        loaded as f64 / 1e6,
        t0.elapsed().as_secs_f64(),
        if routers.len() == 1 { "" } else { "s" },
        shown.join(", "),
    );
    let _ = std::io::Write::flush(&mut std::io::stdout());
}

/// How long a worker of a fanning-out node waits for its node peers before it joins the
/// routers anyway. A peer that starts later is still joined before any router counts it:
/// it waits for this worker (already up) before it dials the routers; the wait only runs
/// out when a peer is down.
const NODE_JOIN_TIMEOUT: Duration = Duration::from_secs(3);

/// How long a node's leader waits for its peers' shares of a forwarded dispatch.
const FANOUT_TIMEOUT: Duration = Duration::from_secs(5);

/// The most bytes of frames on their way to node peers (`ComputeCtx::peer_backlog`): two
/// receive windows' worth. Past it a leader refuses to forward (the router sends the pairs to
/// their owners) and a device drops an answer to a node peer (the leader fails its entry).
///
/// Why a bound: the compute thread never waits on a send to a node peer (the peer may be
/// waiting to send here itself, each side's window full of work queued behind the other's
/// blocked send), so the runtime carries those sends, each holding a reservation of its bytes
/// until it ends; a slow peer cannot pile them up without bound. A send still waiting for
/// credit after [`FANOUT_TIMEOUT`] is given up: its leader has failed the entry.
const PEER_BACKLOG_BYTES: u64 = 4 * crate::deploy::MAX_FRAME_BYTES as u64;

/// Reservations of every one of `bytes` from `budget`, or none (all given back) when they do
/// not fit together.
fn reserve_all(budget: &MemoryBudget, bytes: &[u64]) -> Option<Vec<MemoryReservation>> {
    bytes.iter().map(|&b| budget.reserve(b).ok()).collect()
}

/// What the I/O loop hands the compute thread.
enum Input {
    /// A dispatch (from a router, or from this node's leader).
    Dispatch(RecvFrame),
    /// A node peer's result for a forwarded share, copied out of its frame so the link's
    /// credit is released at once (the compute thread may be waiting to send to that peer).
    PeerResult {
        from: u32,
        res: ExpertResult,
        payload: Vec<u8>,
    },
    /// A node peer's error for a forwarded share.
    PeerError { from: u32, frame: ErrorFrame },
    /// A router's `Hold` or `Seen` (queued behind its dispatches: a `Seen` frees only after
    /// every dispatch that router sent before it has run).
    Placement {
        from: u32,
        frame: Placement,
        payload: Vec<u8>,
    },
    /// A node peer's `Holding`: the routed experts it serves as of `version` (its fan-out
    /// homes follow).
    PeerHolding {
        from: u32,
        version: u64,
        experts: Vec<(u32, u32)>,
    },
}

/// The compute loop's state: the executor, the node fan-out (when this node fans out), the
/// mesh to answer on, and the inputs waiting per sender.
struct ComputeCtx {
    /// Set by SIGTERM/SIGINT: take no new input, return once the queue is empty (and, on a
    /// leader, once no forwarded dispatch waits for its node peers, for at most
    /// [`FANOUT_TIMEOUT`]).
    stop: Arc<AtomicBool>,
    exec: DispatchExecutor,
    fanout: Option<NodeFanout>,
    routers: u32,
    mesh: Mesh,
    handle: tokio::runtime::Handle,
    queue: FairQueue<Input>,
    names: Vec<String>,
    id: String,
    metrics: Arc<crate::metrics::WorkerMetrics>,
    /// Work of replaced links: dispatches dropped unrun, answers not sent, and when that was
    /// last logged at warn level.
    stale: StaleWork,
    /// Live placement changes: what this device holds, its memory, a deferred hold.
    live: Live,
    /// Frames to node peers on their way.
    peer_backlog: MemoryBudget,
    /// A stop signal came: dispatches that arrive now are refused (ShuttingDown).
    stopping: bool,
}

/// What a worker needs for live placement changes.
struct Live {
    /// What this device holds and announces.
    holdings: crate::holdings::Holdings,
    /// This worker's mesh rank.
    rank: u32,
    /// The device's budget for pinned experts (a change must fit next to what it serves).
    expert_memory: u64,
    /// The deployment (where gained experts are read from).
    dep: Deployment,
    /// A hold taken again later: its gains fit only once the experts being released are
    /// freed, or another hold's gains are being staged: (router, frame, entries).
    deferred: Option<(u32, Placement, Vec<u8>)>,
    /// Gains being read and packed on a loader thread while this device serves.
    staging: Option<Staging>,
    /// Experts every router stopped sending while gains were staged: freed after the install
    /// (unless the staged hold serves them again).
    free_later: Vec<(u32, u32)>,
    /// Where chunks of experts copied to this device go (the loader thread), while staging.
    chunk_tx: Option<std::sync::mpsc::SyncSender<crate::fetch::io::ChunkMsg>>,
    /// Serves copies of this device's experts to gaining devices (started on first use).
    copies: Option<crate::fetch::io::CopyServer>,
    /// The experts this device was copied, kept to copy them on.
    copied: Arc<crate::fetch::io::CopyCache>,
}

/// The gains `load` as one source: from this host's shards, then copied from their owners.
fn gain_source(
    dep: &Deployment,
    load: &[(u32, u32)],
    fetcher: crate::fetch::io::Fetcher,
) -> Result<Box<dyn expertmesh_backend::ExpertSource>, String> {
    let (local, missing) =
        weights::gained_expert_source_on_host(dep, load).map_err(|e| e.to_string())?;
    if missing.is_empty() {
        return Ok(local);
    }
    let copied = crate::fetch::io::FetchSource::new(fetcher, dep.clone(), &missing)?;
    Ok(Box::new(crate::fetch::io::Chain::new(local, copied)))
}

/// A hold whose gains a loader thread reads and packs ([`ExpertBackend::stager`]).
struct Staging {
    plan: crate::holdings::HoldPlan,
    started: Instant,
    loader: std::thread::JoinHandle<Result<expertmesh_backend::StagedExperts, String>>,
    /// Set when a newer hold does not want every expert staged: the loader's copies stop.
    superseded: Arc<std::sync::atomic::AtomicBool>,
}

impl Staging {
    /// Whether `hold` (for this worker, mesh rank `rank`) supersedes the staged one: a newer
    /// version, well formed and all this worker's, that drops any of the gains being staged
    /// (an undo, a later step). A hold this worker would refuse, or one that keeps every
    /// staged gain, leaves the staging alone.
    fn superseded_by(&self, hold: &Placement, payload: &[u8], rank: u32) -> bool {
        let Ok(entries) = placement_entries(hold, payload) else {
            return false;
        };
        if hold.version <= self.plan.version || entries.iter().any(|&(r, _, _)| r != rank) {
            return false;
        }
        let wanted: std::collections::BTreeSet<(u32, u32)> =
            entries.into_iter().map(|(_, l, e)| (l, e)).collect();
        self.plan.load.iter().any(|k| !wanted.contains(k))
    }
}

/// What became of a `Hold`.
enum HoldOutcome {
    /// Served now: its version, the experts loaded, and what the commit confirmed at once.
    Done(u64, usize, Confirmed),
    /// Taken again once the experts being released are freed.
    Deferred,
    /// Its gains are being staged on a loader thread.
    Staging,
}

impl Live {
    /// Device `d` (mesh rank `rank`) serving its placement file's experts.
    fn new(dep: Deployment, d: expertmesh_topology::topology::DeviceRank, rank: u32) -> Self {
        let expert_memory = dep
            .topology
            .device(d)
            .map_or(u64::MAX, |x| x.expert_memory_bytes());
        Self {
            holdings: crate::holdings::Holdings::new(placed_experts(&dep, d)),
            rank,
            expert_memory,
            dep,
            deferred: None,
            staging: None,
            free_later: Vec::new(),
            chunk_tx: None,
            copies: None,
            copied: Arc::new(crate::fetch::io::CopyCache::new(rank)),
        }
    }
}

/// Work that belonged to a link since replaced (its router restarted): counted, logged at
/// debug, and at warn level at most every [`STALE_LOG_EVERY`].
#[derive(Debug, Default)]
struct StaleWork {
    dispatches: u64,
    answers: u64,
    refusals: u64,
    last_warn: Option<Instant>,
}

/// How long a send to a router may wait for its credit before the router is taken for
/// wedged: the longest deadline a router grants by default (60 s: past it nothing the router
/// waits for is still useful), or the link timeout where that is longer (a stall is treated
/// no faster than silence). A router busy for seconds on one batch (its own shared experts,
/// a large combine) takes no frame meanwhile and keeps its links.
pub fn stall_bound(link_timeout: Duration) -> Duration {
    link_timeout.max(expertmesh_router::core::DEFAULT_MAX_DEADLINE)
}

/// Least time between two warnings about stale work or refusals by a router.
const STALE_LOG_EVERY: Duration = Duration::from_secs(5);

impl StaleWork {
    /// Whether a warning is due now (and records that it was given).
    fn warn_due(&mut self) -> bool {
        let due = self
            .last_warn
            .is_none_or(|t| t.elapsed() >= STALE_LOG_EVERY);
        if due {
            self.last_warn = Some(Instant::now());
        }
        due
    }
}

/// Wakes the compute loop (the waker it polls the mesh's events with).
struct Unpark(std::thread::Thread);

impl std::task::Wake for Unpark {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.0.unpark();
    }
}

/// Mesh events taken per pass before the next input runs (a flood of frames cannot delay the
/// queued work, and taking events first keeps the round robin fair).
const EVENTS_PER_PASS: usize = 64;

impl ComputeCtx {
    /// Until the mesh's events end, or a stop signal came and the queue is empty (and no
    /// forwarded dispatch waits for node peers, at most [`FANOUT_TIMEOUT`]): take the
    /// ready events into the queues, run the next input round robin over senders, and sleep
    /// on this thread's park token when there is nothing to do (the mesh's event queue, or
    /// the stop signal, unparks it).
    fn run(mut self, mut events: MeshEvents) {
        let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
        let mut cx = TaskContext::from_waker(&waker);
        let mut open = true;
        // When the stop signal was first seen.
        let mut stopped_at: Option<Instant> = None;
        loop {
            // Once stopping, nothing new is taken from the links (so a busy router cannot keep
            // the worker alive): what is queued is answered, then the loop returns. A leader
            // with forwarded dispatches still waiting for its node peers keeps reading their
            // answers until none waits, for at most FANOUT_TIMEOUT; a dispatch that arrives
            // meanwhile is refused at once (ShuttingDown: the router turns to a replica).
            let stopping = self.stop.load(Ordering::SeqCst);
            self.stopping = stopping;
            if stopping && stopped_at.is_none() {
                stopped_at = Some(Instant::now());
            }
            let finishing = stopped_at.is_some_and(|t| t.elapsed() < FANOUT_TIMEOUT)
                && self.fanout.as_ref().is_some_and(|f| f.pending() > 0);
            let taking = open && (!stopping || finishing);
            // Whether the event queue may still hold events (then this pass must not park:
            // the waker is registered only by a poll that finds the queue empty).
            let mut more = taking;
            for _ in 0..EVENTS_PER_PASS {
                if !taking {
                    break;
                }
                match std::pin::pin!(events.recv()).poll(&mut cx) {
                    Poll::Ready(Some(ev)) => self.event(ev),
                    Poll::Ready(None) => open = false,
                    Poll::Pending => {
                        more = false;
                        break;
                    }
                }
            }
            let now = Instant::now();
            if let Some(f) = self.fanout.as_mut() {
                let expired = f.expire(now);
                self.answer_routers(expired);
            }
            self.poll_staging();
            if let Some((_, input)) = self.queue.pop() {
                self.handle_input(input);
                continue;
            }
            if !open || (stopping && !finishing) {
                return;
            }
            if more {
                continue;
            }
            let pending = self.fanout.as_ref().is_some_and(|f| f.pending() > 0);
            std::thread::park_timeout(if pending {
                Duration::from_millis(50)
            } else {
                Duration::from_secs(1)
            });
        }
    }

    /// A mesh event: dispatches and node peers' answers into the queues (answers copied out
    /// of their frames, so the link's credit is released at once), peer notices into the log;
    /// a lost router's queued dispatches are dropped.
    fn event(&mut self, ev: TransportEvent) {
        let name = |r: u32| self.names.get(r as usize).map_or("?", String::as_str);
        match ev {
            TransportEvent::Frame(f) => {
                let from = f.peer();
                self.metrics.on_received(from, f.frame_len());
                let input = match f.body() {
                    Body::Dispatch(_) if self.stopping => return self.refuse_stopping(f),
                    Body::Dispatch(_) => Input::Dispatch(f),
                    // A router refusing this connection (another process serves this device):
                    // say so, rate-limited (the dialer keeps retrying with backoff).
                    Body::Error(e) if from < self.routers && e.request_id == 0 => {
                        self.stale.refusals += 1;
                        if self.stale.warn_due() {
                            tracing::warn!(
                                worker = %self.id, peer = name(from), refusals = self.stale.refusals,
                                "refused by the router: {}", e.message
                            );
                        }
                        return;
                    }
                    // A node peer's answer is copied into the queue only when it is the first
                    // to a share still pending, from the peer it went to; the rest are
                    // dropped here (late answers were dropped when taken out, but the copies
                    // of a peer sending them without end grew the queue).
                    Body::Result(ExpertResult { batch_id: id, .. })
                    | Body::Error(ErrorFrame { request_id: id, .. })
                        if !self.fanout.as_mut().is_some_and(|fo| fo.claim(from, *id)) =>
                    {
                        self.stale.answers += 1;
                        return;
                    }
                    Body::Result(res) => Input::PeerResult {
                        from,
                        res: *res,
                        payload: f.payload().to_vec(),
                    },
                    Body::Error(e) => Input::PeerError {
                        from,
                        frame: e.clone(),
                    },
                    Body::Placement(p) if from < self.routers => Input::Placement {
                        from,
                        frame: p.clone(),
                        payload: f.payload().to_vec(),
                    },
                    Body::Placement(p) if p.op == PlacementOp::Holding && self.fanout.is_some() => {
                        match placement_entries(p, f.payload()) {
                            Ok(entries) => Input::PeerHolding {
                                from,
                                version: p.version,
                                experts: entries
                                    .into_iter()
                                    .filter(|&(r, _, _)| r == from)
                                    .map(|(_, l, e)| (l, e))
                                    .collect(),
                            },
                            Err(e) => {
                                tracing::warn!(worker = %self.id, peer = name(from), error = %e, "a node peer's announcement was malformed; ignored");
                                return;
                            }
                        }
                    }
                    _ => return,
                };
                self.queue.push(from as usize, input);
            }
            TransportEvent::PeerUp { peer, link, .. } => {
                tracing::info!(worker = %self.id, peer = name(peer), link = link.name(), "connected");
                self.peer_up(peer);
            }
            TransportEvent::PeerLost(e) => {
                let dropped = self.queue.drop_sender(e.peer as usize);
                self.stale.dispatches += dropped as u64;
                self.metrics.on_link(e.peer, false, dropped);
                tracing::warn!(
                    worker = %self.id, peer = name(e.peer), error = %e.kind, dropped,
                    "link lost; redialing (its queued dispatches dropped)"
                );
                // At once, not through the queue: a stale loss handled after the peer is back
                // would fail work forwarded over its new link.
                let failed = self
                    .fanout
                    .as_mut()
                    .map(|f| f.on_peer_lost(e.peer))
                    .unwrap_or_default();
                self.answer_routers(failed);
                if e.peer < self.routers {
                    let confirmed = self.live.holdings.on_router_lost(e.peer);
                    self.confirmed(confirmed);
                }
            }
        }
    }

    /// A link came up: a router hears what this device holds now; a node peer (maybe
    /// restarted) too, and its own announcements count from its new link on.
    fn peer_up(&mut self, peer: u32) {
        self.metrics.on_link(peer, true, 0);
        if peer < self.routers {
            self.announce_to(peer);
        } else if self
            .fanout
            .as_ref()
            .is_some_and(|f| f.node_peers().contains(&peer))
        {
            if let Some(f) = self.fanout.as_mut() {
                f.new_link(peer);
            }
            let version = self.live.holdings.newest();
            let frame = self.holding_frame(version, "", 0);
            self.send_to_node_peer(peer, frame);
        }
    }

    /// A dispatch that came while this worker stops: refused at once (ShuttingDown: the
    /// router turns to a replica, a leader fails its entry) instead of started and dropped.
    fn refuse_stopping(&mut self, f: RecvFrame) {
        let (from, generation) = (f.peer(), f.link_generation());
        let Body::Dispatch(d) = f.body() else {
            return;
        };
        let e = ExecError {
            code: ErrorCode::ShuttingDown,
            message: format!("{} is stopping (a stop signal came)", self.id),
        };
        let refusal = error_frame(d.batch_id, d.part, e);
        drop(f);
        if from < self.routers {
            self.send_on(from, generation, &refusal);
        } else {
            let doing = "refusing a node peer's share while stopping";
            self.spawn_peer_send(from, Some(generation), refusal, doing);
        }
    }

    fn handle_input(&mut self, input: Input) {
        let out = match input {
            Input::Dispatch(frame) => return self.dispatch(frame),
            Input::PeerResult { from, res, payload } => self
                .fanout
                .as_mut()
                .and_then(|f| f.on_result(from, &res, &payload)),
            Input::PeerError { from, frame } => self
                .fanout
                .as_mut()
                .and_then(|f| f.on_error(from, frame.request_id, frame.code, &frame.message)),
            Input::Placement {
                from,
                frame,
                payload,
            } => return self.placement(from, &frame, &payload),
            Input::PeerHolding {
                from,
                version,
                experts,
            } => {
                if let Some(f) = self.fanout.as_mut() {
                    f.set_held(from, version, experts);
                }
                return;
            }
        };
        self.answer_routers(out);
    }

    /// Runs a dispatch here, or (a router's dispatch holding experts of node peers) forwards
    /// its shares. A dispatch whose link has since been replaced (its sender restarted) is
    /// dropped unrun: nobody would read the answer, and it must not reach the new process.
    fn dispatch(&mut self, frame: RecvFrame) {
        let from = frame.peer();
        let generation = frame.link_generation();
        let Body::Dispatch(d) = frame.body() else {
            return;
        };
        if self.mesh.link_generation(from) != Some(generation) {
            self.stale.dispatches += 1;
            tracing::debug!(worker = %self.id, from, batch = d.batch_id, "dropped a dispatch of a replaced link");
            if self.stale.warn_due() {
                tracing::warn!(
                    worker = %self.id, from, dropped = self.stale.dispatches,
                    "dropping queued dispatches of a link that was replaced (its router restarted)"
                );
            }
            return;
        }
        if from < self.routers
            && let Some(f) = self.fanout.as_mut()
            && f.needs_forwarding(d)
        {
            let mesh = &self.mesh;
            let started = f.start(
                from,
                generation,
                d,
                frame.payload(),
                |r| mesh.is_connected(r),
                Instant::now(),
            );
            let (batch_id, part) = (d.batch_id, d.part);
            drop(frame);
            match started {
                Ok(fwd) => self.forward(fwd),
                Err(e) => self.send_on(from, generation, &error_frame(batch_id, part, e)),
            }
            return;
        }
        let started = Instant::now();
        // Only a dispatch computed counts (tokens, pairs, each expert's pairs, compute time):
        // a refused one (an expert not held, overload) computed nothing.
        let out = match self.exec.execute(d, frame.payload()) {
            Ok((res, bytes)) => {
                self.metrics.on_executed(d, started);
                OutFrame::with_payload(Body::Result(res), bytes)
            }
            Err(e) => error_frame(d.batch_id, d.part, e),
        };
        // Release the dispatch's credit before waiting to send the result.
        drop(frame);
        if from < self.routers {
            self.send_on(from, generation, &out);
        } else {
            // A node peer's share: never waited for here (see PEER_BACKLOG_BYTES).
            self.spawn_peer_send(from, Some(generation), out, "answering a node peer's share");
        }
    }

    /// A router's `Hold` (load the gains, serve the new set, announce it; free the dropped
    /// experts once every router confirmed) or `Seen` (a router's confirmation).
    fn placement(&mut self, from: u32, p: &Placement, payload: &[u8]) {
        match p.op {
            PlacementOp::Survey => {
                let version = self.live.holdings.newest();
                self.announce_frame(from, version, "", p.request_id);
            }
            PlacementOp::Seen => {
                let confirmed = self.live.holdings.on_seen(from, p.version);
                self.confirmed(confirmed);
            }
            PlacementOp::Fetch => self.copy_asked(from, p, payload),
            PlacementOp::Ack => {
                if let Some(c) = &self.live.copies {
                    c.ack(p.request_id, p.version);
                }
            }
            PlacementOp::Chunk => {
                // Bounded: a stream whose chunks overflow the loader's queue fails (its copy
                // times out at the loader, and the change is undone).
                if let Some(tx) = &self.live.chunk_tx
                    && tx
                        .try_send((p.request_id, p.clone(), payload.to_vec()))
                        .is_err()
                {
                    tracing::warn!(worker = %self.id, "a chunk of an expert copy was dropped: the loader's queue is full");
                }
            }
            PlacementOp::Hold => {
                // A newer hold replaces one waiting; one arriving while gains are staged waits
                // for them (it is taken again once they are installed or failed).
                self.live.deferred = None;
                if let Some(staging) = &self.live.staging {
                    if staging.superseded_by(p, payload, self.live.rank) {
                        // Its copies stop: the staged hold then fails (a stale version's
                        // refusal, which its router ignores) and this one is taken at once.
                        staging
                            .superseded
                            .store(true, std::sync::atomic::Ordering::Relaxed);
                        self.live.chunk_tx = None;
                    }
                    self.live.deferred = Some((from, p.clone(), payload.to_vec()));
                    return;
                }
                let started = Instant::now();
                match self.hold(from, p, payload) {
                    Ok(HoldOutcome::Done(version, gained, confirmed)) => {
                        self.changed(version, gained, started);
                        self.confirmed(confirmed);
                    }
                    Ok(HoldOutcome::Deferred) => {
                        tracing::info!(
                            worker = %self.id, version = p.version, releasing = self.live.holdings.releasing(),
                            "placement change waits for experts being released to make room"
                        );
                        self.live.deferred = Some((from, p.clone(), payload.to_vec()));
                    }
                    Ok(HoldOutcome::Staging) => {}
                    Err(why) => self.refuse(p.version, &why),
                }
            }
            other => {
                tracing::warn!(worker = %self.id, from, op = ?other, "unexpected placement frame from a router")
            }
        }
    }

    /// Router `from` asks this device to copy one of its experts to a gaining device
    /// (`crate::fetch`): queued on the copy server, or refused at once.
    fn copy_asked(&mut self, from: u32, p: &Placement, payload: &[u8]) {
        let entries = placement_entries(p, payload).unwrap_or_default();
        let asked = match entries[..] {
            [(rank, layer, expert)] if rank == self.live.rank => Ok(ExpertKey { layer, expert }),
            _ => Err("a copy request names exactly one expert of this device".to_owned()),
        };
        let queued = asked.and_then(|key| {
            if self.live.copies.is_none() {
                let server = crate::fetch::io::CopyServer::start(
                    self.live.dep.clone(),
                    Arc::clone(&self.live.copied),
                    self.mesh.clone(),
                    self.handle.clone(),
                    self.id.clone(),
                )
                .map_err(|e| format!("starting the copy thread: {e}"))?;
                self.live.copies = Some(server);
            }
            self.live
                .copies
                .as_ref()
                .expect("started above")
                .ask(from, p.request_id, key)
        });
        if let Err(why) = queued {
            tracing::warn!(worker = %self.id, "expert copy refused: {why}");
            let frame = OutFrame::new(Body::Placement(Placement::chunk_error(p.request_id, &why)));
            self.send_control(from, &frame, "refusing an expert copy");
        }
    }

    /// A hold is served: say so and announce the set.
    fn changed(&mut self, version: u64, gained: usize, started: Instant) {
        tracing::info!(
            worker = %self.id, version, gained, experts = self.live.holdings.serving().len(),
            releasing = self.live.holdings.releasing(),
            "placement changed in {:.1} ms", started.elapsed().as_secs_f64() * 1e3
        );
        self.announce_as(version, "");
    }

    /// A hold of `version` is refused or failed: announce the set served, with why.
    fn refuse(&mut self, version: u64, why: &str) {
        self.live.holdings.refused(version);
        tracing::warn!(worker = %self.id, version, "placement change refused: {why}");
        let why = placement_message(why);
        self.announce_as(version, &why);
    }

    /// Installs gains a loader thread finished staging, serves their hold's set and announces
    /// it (or announces why they failed); then frees what waited and takes a waiting hold.
    fn poll_staging(&mut self) {
        if !self
            .live
            .staging
            .as_ref()
            .is_some_and(|s| s.loader.is_finished())
        {
            return;
        }
        let Staging {
            plan,
            started,
            loader,
            ..
        } = self.live.staging.take().expect("checked above");
        self.live.chunk_tx = None;
        let version = plan.version;
        let staged = loader
            .join()
            .unwrap_or_else(|_| Err("the loader thread panicked".into()))
            .and_then(|staged| {
                self.exec
                    .backend_mut()
                    .install(staged)
                    .map_err(|e| format!("installing the gained experts: {e}"))
            });
        match staged {
            Ok(()) => {
                let gained = plan.load.len();
                let connected = self.connected_routers();
                let confirmed = self.live.holdings.commit(plan, connected);
                self.changed(version, gained, started);
                self.confirmed(confirmed);
            }
            Err(why) => self.refuse(version, &why),
        }
        let serving: std::collections::BTreeSet<(u32, u32)> =
            self.live.holdings.serving().into_iter().collect();
        let later: Vec<(u32, u32)> = std::mem::take(&mut self.live.free_later)
            .into_iter()
            .filter(|e| !serving.contains(e))
            .collect();
        self.release(&later);
        if let Some((from, p, payload)) = self.live.deferred.take() {
            self.placement(from, &p, &payload);
        }
    }

    /// Carries out a `Hold`: checks it, then either stages the gains on a loader thread (a
    /// backend with a stager: this device serves meanwhile; [`ComputeCtx::poll_staging`]
    /// installs them), or loads them here between dispatches, and serves the new set.
    fn hold(&mut self, from: u32, p: &Placement, payload: &[u8]) -> Result<HoldOutcome, String> {
        let entries = placement_entries(p, payload).map_err(|e| e.to_string())?;
        if let Some(&(r, l, e)) = entries.iter().find(|&&(r, _, _)| r != self.live.rank) {
            return Err(format!(
                "the hold lists layer {l} expert {e} for mesh rank {r}, not this worker's {}",
                self.live.rank
            ));
        }
        let plan = self
            .live
            .holdings
            .plan(p.version, entries.iter().map(|&(_, l, e)| (l, e)))?;
        if !plan.load.is_empty() {
            let backend = self.exec.backend_mut();
            let need = backend
                .loaded_bytes()
                .saturating_add(plan.load.len() as u64 * self.live.dep.spec.expert_bytes());
            let releasing =
                self.live.holdings.releasing() as u64 * self.live.dep.spec.expert_bytes();
            if need > self.live.expert_memory
                && need - releasing.min(need) <= self.live.expert_memory
            {
                return Ok(HoldOutcome::Deferred);
            }
            if need > self.live.expert_memory {
                return Err(format!(
                    "{} more experts would pin {need} bytes next to what this device serves, over \
                     its expert_memory of {} bytes; apply the change in steps (expertmesh \
                     rebalance --from SERVED plans them) or give the device more memory",
                    plan.load.len(),
                    self.live.expert_memory
                ));
            }
            if let Some(stager) = backend.stager() {
                let (dep, load) = (self.live.dep.clone(), plan.load.clone());
                let compute = std::thread::current();
                // Gains whose weights are not on this host are copied from a device that
                // serves them, through the router that asked (chunks reach the loader from
                // the compute loop).
                let (chunk_tx, chunks) =
                    std::sync::mpsc::sync_channel(crate::fetch::io::CHUNK_QUEUE);
                self.live.chunk_tx = Some(chunk_tx);
                let superseded = Arc::new(std::sync::atomic::AtomicBool::new(false));
                let fetcher = crate::fetch::io::Fetcher {
                    router: from,
                    rank: self.live.rank,
                    mesh: self.mesh.clone(),
                    handle: self.handle.clone(),
                    chunks,
                    cache: Arc::clone(&self.live.copied),
                    superseded: Arc::clone(&superseded),
                };
                let loader = std::thread::Builder::new()
                    .name("expert-loader".into())
                    .spawn(move || {
                        let staged = gain_source(&dep, &load, fetcher).and_then(|mut source| {
                            stager
                                .stage(&mut *source)
                                .map_err(|e| format!("loading the gained experts: {e}"))
                        });
                        compute.unpark();
                        staged
                    })
                    .map_err(|e| {
                        self.live.chunk_tx = None;
                        format!("starting the loader thread: {e}")
                    })?;
                self.live.staging = Some(Staging {
                    plan,
                    started: Instant::now(),
                    loader,
                    superseded,
                });
                return Ok(HoldOutcome::Staging);
            }
            let mut source = weights::gained_expert_source(&self.live.dep, &plan.load)
                .map_err(|e| e.to_string())?;
            backend
                .add_experts(&mut *source)
                .map_err(|e| format!("loading the gained experts: {e}"))?;
        }
        let (version, gained) = (plan.version, plan.load.len());
        let connected = self.connected_routers();
        let confirmed = self.live.holdings.commit(plan, connected);
        Ok(HoldOutcome::Done(version, gained, confirmed))
    }

    /// Carries out what routers' confirmations completed: frees the experts no router can
    /// send here any more, and tells every router a version settled (after its `Holding`).
    fn confirmed(&mut self, confirmed: Confirmed) {
        self.release(&confirmed.free);
        if let Some(version) = confirmed.settled {
            tracing::debug!(worker = %self.id, version, "every router confirmed the set announced");
            let frame = OutFrame::new(Body::Placement(Placement::new(
                PlacementOp::Settled,
                version,
                0,
            )));
            for r in self.connected_routers() {
                self.send_control(r, &frame, "saying the set announced is settled");
            }
        }
    }

    /// The routers whose link is up now.
    fn connected_routers(&self) -> Vec<u32> {
        (0..self.routers)
            .filter(|&r| self.mesh.is_connected(r))
            .collect()
    }

    /// Frees experts no router can send here any more.
    fn release(&mut self, experts: &[(u32, u32)]) {
        if experts.is_empty() {
            return;
        }
        if self.live.staging.is_some() {
            // The staged hold was planned with these loaded; they wait for its install.
            self.live.free_later.extend_from_slice(experts);
            return;
        }
        let keys: Vec<ExpertKey> = experts
            .iter()
            .map(|&(layer, expert)| ExpertKey { layer, expert })
            .collect();
        match self.exec.backend_mut().release_experts(&keys) {
            Ok(()) => {
                for &k in &keys {
                    self.live.copied.remove(k);
                }
                tracing::info!(worker = %self.id, released = keys.len(), "released the experts every router stopped sending here")
            }
            Err(e) => {
                tracing::error!(worker = %self.id, error = %e, "releasing experts failed; they stay loaded")
            }
        }
        // A hold that waited for this room is taken again.
        if let Some((from, p, payload)) = self.live.deferred.take() {
            self.placement(from, &p, &payload);
        }
    }

    /// Announces what this device serves to every connected router, at `version`; a
    /// non-empty `message` says why the hold of `version` was refused (the set announced is
    /// then the one served, at that hold's version, so the coordinator matches it).
    fn announce_as(&mut self, version: u64, message: &str) {
        for r in self.connected_routers() {
            self.announce_frame(r, version, message, 0);
        }
        // The node's devices forward by what each other serves (`fanout::ExpertHomes`).
        let me = self.live.rank;
        let serving = self.live.holdings.serving();
        let Some(f) = self.fanout.as_mut() else {
            return;
        };
        f.set_held(me, version, serving);
        let peers = f.node_peers();
        let frame = self.holding_frame(version, "", 0);
        for peer in peers {
            self.send_to_node_peer(peer, frame.clone());
        }
    }

    /// Sends `frame` to node peer `peer` without waiting on it (the peer may itself be
    /// waiting to send here, as for forwarded shares).
    fn send_to_node_peer(&mut self, peer: u32, frame: OutFrame) {
        self.spawn_peer_send(
            peer,
            None,
            frame,
            "announcing this device's experts to a node peer",
        );
    }

    /// Sends `frame` to node peer `peer` on the runtime, never waiting here (on the link of
    /// `generation` only, when given): within [`PEER_BACKLOG_BYTES`], else dropped with a
    /// warning (the leader waiting for it fails its entry at its timeout).
    fn spawn_peer_send(
        &mut self,
        peer: u32,
        generation: Option<u64>,
        frame: OutFrame,
        doing: &'static str,
    ) {
        let bytes = codec::frame_len(&frame.body, frame.payload.len()) as u64;
        match self.peer_backlog.reserve(bytes) {
            Ok(held) => self.spawn_reserved_peer_send(peer, generation, frame, held, doing),
            Err(why) => tracing::warn!(
                worker = %self.id, peer,
                "{doing}: dropped, the frames on their way to node peers are at their bound ({why})"
            ),
        }
    }

    /// [`ComputeCtx::spawn_peer_send`] of a frame whose bytes `held` reserves (given back
    /// when the send ends).
    fn spawn_reserved_peer_send(
        &mut self,
        peer: u32,
        generation: Option<u64>,
        frame: OutFrame,
        held: MemoryReservation,
        doing: &'static str,
    ) {
        self.metrics.on_sent(peer, &frame);
        let mesh = self.mesh.clone();
        self.handle.spawn(async move {
            let send = async {
                match generation {
                    Some(g) => mesh.send_on(peer, g, &frame).await,
                    None => mesh.send(peer, &frame).await,
                }
            };
            match tokio::time::timeout(FANOUT_TIMEOUT, send).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) if matches!(e.kind, PeerErrorKind::LinkReplaced(_)) => {
                    tracing::debug!(error = %e, "{doing}: the link was replaced");
                }
                Ok(Err(e)) => tracing::warn!(error = %e, "{doing} failed"),
                Err(_) => tracing::warn!(
                    peer,
                    "{doing}: no credit within {FANOUT_TIMEOUT:?}; given up"
                ),
            }
            drop(held);
        });
    }

    /// Announces what this device serves to router `r` (its link came up), at the newest
    /// version used here (so a change starts above it).
    fn announce_to(&mut self, r: u32) {
        let version = self.live.holdings.newest();
        self.announce_frame(r, version, "", 0);
    }

    /// Announces what this device serves to router `r` at `version`, with `message` (why a
    /// hold was refused) and `survey` (the survey it answers, 0: none).
    fn announce_frame(&mut self, r: u32, version: u64, message: &str, survey: u64) {
        let frame = self.holding_frame(version, message, survey);
        self.send_control(r, &frame, "announcing what this device holds");
    }

    /// The `Holding` frame announcing what this device serves at `version`, with `message`
    /// and `survey` ([`Self::announce_frame`]).
    fn holding_frame(&self, version: u64, message: &str, survey: u64) -> OutFrame {
        let serving = self.live.holdings.serving();
        let entries: Vec<(u32, u32, u32)> = serving
            .iter()
            .map(|&(l, e)| (self.live.rank, l, e))
            .collect();
        let mut body = Placement::new(PlacementOp::Holding, version, entries.len());
        body.message = message.to_owned();
        body.request_id = survey;
        OutFrame::with_payload(
            Body::Placement(body),
            bytes::Bytes::from(encode_placement_entries(&entries)),
        )
    }

    /// Sends a placement frame to router `r`, in order behind what this thread sent it.
    fn send_control(&mut self, r: u32, frame: &OutFrame, doing: &str) {
        self.metrics.on_sent(r, frame);
        let generation = self.mesh.link_generation(r);
        let sent = self.within_stall_bound(r, generation, self.mesh.send(r, frame));
        if let Some(Err(e)) = sent {
            tracing::warn!(worker = %self.id, router = r, error = %e, "{doing} failed");
        }
    }

    /// Runs `send`, a send to router `to` on its link `generation`, for at most
    /// [`stall_bound`]. A router that takes no frame for that long (its
    /// core wedged while its I/O still answers heartbeats, so the link's credit never comes
    /// back) would otherwise hold this thread, and every other router's work with it. Past
    /// the bound the frame is dropped and that link closed, as a silent peer's would be: the
    /// router fails over or fails what it waited for, and this worker redials it. `None`: the
    /// time ran out.
    fn within_stall_bound(
        &self,
        to: u32,
        generation: Option<u64>,
        send: impl Future<Output = Result<(), PeerError>>,
    ) -> Option<Result<(), PeerError>> {
        let timeout = stall_bound(self.live.dep.link_timeout);
        match self
            .handle
            .block_on(async move { tokio::time::timeout(timeout, send).await })
        {
            Ok(sent) => Some(sent),
            Err(_) => {
                let why = format!(
                    "router {to} took no frame for {timeout:?} (the longest default deadline, \
                     or --link-timeout-s if longer): its link is closed and redialled"
                );
                tracing::warn!(worker = %self.id, "{why}");
                if generation.is_some() && self.mesh.link_generation(to) == generation {
                    self.mesh.disconnect(to, &why);
                }
                None
            }
        }
    }

    /// Sends the peers' shares of a forwarded dispatch and runs this device's own.
    fn forward(&mut self, fwd: Forward) {
        let Forward { key, local, remote } = fwd;
        // Never wait here on a send to a node peer (see PEER_BACKLOG_BYTES): the shares'
        // bytes are reserved together, or the dispatch fails at once (PeerUnavailable: the
        // router sends its pairs to the devices directly). A link that fails under a send is
        // reported as PeerLost, and a share that does not go out in time leaves the entry to
        // expire; both fail it.
        let sizes: Vec<u64> = remote
            .iter()
            .map(|(_, f)| codec::frame_len(&f.body, f.payload.len()) as u64)
            .collect();
        let Some(held) = reserve_all(&self.peer_backlog, &sizes) else {
            let message = format!(
                "this node's peers are behind: {} bytes of forwarded work wait for their links",
                self.peer_backlog.used()
            );
            let refused = self.fanout.as_mut().and_then(|f| f.abandon(key, message));
            self.answer_routers(refused);
            return;
        };
        for ((rank, frame), held) in remote.into_iter().zip(held) {
            let doing = "forwarding a share to a node peer";
            self.spawn_reserved_peer_send(rank, None, frame, held, doing);
        }
        let Some((sub, payload)) = local else {
            return;
        };
        // This device's own share of a forwarded dispatch is computed here: counted as one.
        let started = Instant::now();
        let metrics = &self.metrics;
        let out = self
            .fanout
            .as_mut()
            .and_then(|f| match self.exec.execute(&sub, &payload) {
                Ok((res, bytes)) => {
                    metrics.on_executed(&sub, started);
                    f.on_local(key, &res, &bytes)
                }
                Err(e) => f.on_local_error(key, e),
            });
        self.answer_routers(out);
    }

    fn answer_routers(&mut self, frames: impl IntoIterator<Item = ToRouter>) {
        for t in frames {
            self.send_on(t.router, t.generation, &t.frame);
        }
    }

    /// Sends an answer on the link (generation) its dispatch came on; an answer whose link
    /// was replaced meanwhile is dropped and counted.
    fn send_on(&mut self, to: u32, generation: u64, frame: &OutFrame) {
        self.metrics.on_sent(to, frame);
        let send = self.mesh.send_on(to, generation, frame);
        match self.within_stall_bound(to, Some(generation), send) {
            Some(Ok(())) | None => {}
            Some(Err(e)) if matches!(e.kind, PeerErrorKind::LinkReplaced(_)) => {
                self.stale.answers += 1;
                tracing::debug!(worker = %self.id, error = %e, "answer of a replaced link dropped");
            }
            Some(Err(e)) => tracing::warn!(error = %e, "result not delivered"),
        }
    }
}

/// The routed experts device `d` loads at start (its placement file's), as (layer, expert).
fn placed_experts(
    dep: &Deployment,
    d: expertmesh_topology::topology::DeviceRank,
) -> Vec<(u32, u32)> {
    dep.spec
        .moe_layer_ids()
        .into_iter()
        .flat_map(|l| dep.placement.experts_on(d, l).iter().map(move |&e| (l, e)))
        .collect()
}

/// The error frame answering part `part` of dispatch `batch_id`.
fn error_frame(batch_id: u64, part: u32, e: ExecError) -> OutFrame {
    OutFrame::new(Body::Error(ErrorFrame {
        request_id: batch_id,
        part: Some(part),
        code: e.code,
        message: e.message,
    }))
}

/// The routers' mesh endpoints: given on the command line (one per router), or from the
/// topology.
fn router_addresses(
    dep: &Deployment,
    given: &[SocketAddr],
) -> Result<Vec<SocketAddr>, WorkerError> {
    if given.is_empty() {
        return Ok(dep.router_mesh_endpoints()?);
    }
    if given.len() as u32 != dep.router_count() {
        return Err(WorkerError::RouterCount {
            given: given.len(),
            cluster: dep.topology.name().to_string(),
            routers: dep.router_count(),
        });
    }
    Ok(given.to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A staged hold of version 5 (this worker, rank 3, gains (1, 7) and (1, 8)) is superseded
    /// by a newer hold of its own that drops a gain, and by nothing else: not one that keeps
    /// every gain, an older or equal version, a malformed one or one listing another rank.
    #[test]
    fn a_staged_hold_is_superseded_only_by_a_newer_hold_of_its_own_that_drops_a_gain() {
        let plan = crate::holdings::Holdings::new([(1, 1)])
            .plan(5, [(1, 1), (1, 7), (1, 8)])
            .unwrap();
        assert_eq!(plan.load, vec![(1, 7), (1, 8)]);
        let staging = Staging {
            plan,
            started: Instant::now(),
            loader: std::thread::spawn(|| Err("not run".to_string())),
            superseded: Arc::default(),
        };
        let hold = |version: u64, entries: &[(u32, u32, u32)]| {
            (
                Placement::new(PlacementOp::Hold, version, entries.len()),
                encode_placement_entries(entries),
            )
        };
        let by = |(p, payload): (Placement, Vec<u8>)| staging.superseded_by(&p, &payload, 3);
        assert!(by(hold(6, &[(3, 1, 1)])), "an undo drops both gains");
        assert!(by(hold(6, &[(3, 1, 1), (3, 1, 7)])), "drops one gain");
        assert!(!by(hold(6, &[(3, 1, 1), (3, 1, 7), (3, 1, 8), (3, 1, 9)])));
        assert!(!by(hold(5, &[(3, 1, 1)])), "not newer");
        assert!(!by(hold(4, &[(3, 1, 1)])), "older");
        assert!(!by(hold(6, &[(2, 1, 1)])), "another rank's: refused anyway");
        let (p, mut payload) = hold(6, &[(3, 1, 1)]);
        payload.pop();
        assert!(!staging.superseded_by(&p, &payload, 3), "malformed");
    }

    /// The shares of a forwarded dispatch are reserved all together or not at all (nothing
    /// held after a refusal), within the backlog's bound; what a send gives back can be
    /// reserved again.
    #[test]
    fn the_peer_backlog_reserves_all_shares_or_none() {
        let b = MemoryBudget::new(PEER_BACKLOG_BYTES);
        let first = reserve_all(&b, &[PEER_BACKLOG_BYTES - 10]).unwrap();
        assert!(
            reserve_all(&b, &[5, 6]).is_none(),
            "past the bound: nothing taken"
        );
        assert_eq!(b.used(), PEER_BACKLOG_BYTES - 10);
        let two = reserve_all(&b, &[5, 5]).unwrap();
        assert_eq!(b.used(), PEER_BACKLOG_BYTES);
        drop(first);
        drop(two);
        assert_eq!(b.used(), 0);
        assert!(reserve_all(&b, &[PEER_BACKLOG_BYTES]).is_some());
    }
}
