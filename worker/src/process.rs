//! The expert worker: one process per device, pinning its experts for life and serving
//! dispatch frames from every router.
//!
//! Why this exists: this is the "device" of the design. At start it loads only its own
//! (layer, expert) weights onto its backend, once, with every buffer sized for the largest
//! batch; then it joins the mesh (dialing every router, redialing each with backoff if it
//! restarts) and loops: a dispatch frame in, the backend run once for the whole grouped batch,
//! one result frame out to the router that sent it. Compute runs on its own thread so the mesh
//! keeps answering heartbeats however long a batch takes. Dispatches from several routers are
//! served round robin ([`crate::fair`]): each router's credit window bounds what it can queue
//! here, and one busy router cannot starve another. A router whose link is lost costs only
//! its own queued dispatches (dropped: nobody would read their results).

use crate::deploy::Deployment;
use crate::exec::DispatchExecutor;
use crate::fair::SharedFairQueue;
use crate::weights;
use anyhow::{Context, anyhow, bail};
use expertmesh_backend::{BatchLimits, ExpertBackend};
use expertmesh_cpu_backend::CpuBackend;
use expertmesh_transport::codec::{Body, ErrorFrame};
use expertmesh_transport::mesh::{
    LinkKind, Mesh, MeshEvents, OutFrame, RecvFrame, Transport, TransportEvent,
};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

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
    /// Link to the router.
    pub link: LinkKind,
    /// Backend threads (default: the topology's `threads` for CPU devices, else all cores).
    pub threads: Option<usize>,
    /// Backend choice.
    pub backend: BackendChoice,
    /// Largest batch (tokens) a dispatch may carry.
    pub max_tokens: usize,
}

/// Choose and load the backend for device `d`.
fn make_backend(
    dep: &Deployment,
    opts: &WorkerOptions,
    limits: BatchLimits,
) -> anyhow::Result<Box<dyn ExpertBackend>> {
    let d = dep.device(&opts.device)?;
    let dev = dep
        .topology
        .device(d)
        .ok_or_else(|| anyhow!("no device {}", d.0))?;
    let mut experts = weights::device_expert_source(dep, d)?;
    let threads = opts
        .threads
        .or(dev.threads().map(|t| t as usize))
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let want_hip = match opts.backend {
        BackendChoice::Cpu => false,
        BackendChoice::Hip => true,
        BackendChoice::Auto => dev.kind() == expertmesh_topology::topology::DeviceKind::Gpu,
    };
    if want_hip {
        match expertmesh_hip_kernels::hip::HipBackend::new(dev.gpu_index().unwrap_or(0) as usize) {
            Ok(mut hip) => {
                hip.load_from(&mut *experts, limits)
                    .map_err(|e| anyhow!("{}: {e}", dev.id()))?;
                return Ok(Box::new(hip));
            }
            Err(e) if opts.backend == BackendChoice::Auto => {
                tracing::warn!(
                    device = %dev.id(),
                    "HIP backend unavailable ({e}); falling back to the CPU backend"
                );
            }
            Err(e) => return Err(anyhow!("{}: {e}", dev.id())),
        }
    }
    let mut cpu = CpuBackend::new(threads).map_err(|e| anyhow!("{e}"))?;
    cpu.load_from(&mut *experts, limits)
        .map_err(|e| anyhow!("{}: {e}", dev.id()))?;
    Ok(Box::new(cpu))
}

/// Batch limits of a worker: `max_tokens` tokens, each with all its routed and shared slots.
pub fn worker_limits(dep: &Deployment, max_tokens: usize) -> BatchLimits {
    let slots = (dep.spec.top_k + dep.spec.shared_experts) as usize;
    BatchLimits {
        max_tokens,
        max_pairs: max_tokens * slots,
    }
}

/// Run a worker until the process is killed.
pub fn run(dep: Deployment, opts: WorkerOptions) -> anyhow::Result<()> {
    let d = dep.device(&opts.device)?;
    let rank = dep.mesh_rank(d);
    let t0 = Instant::now();
    let limits = worker_limits(&dep, opts.max_tokens);
    let backend = make_backend(&dep, &opts, limits)?;
    let loaded = backend.loaded_bytes();
    let backend_name = backend.name();
    let exec = DispatchExecutor::new(backend, dep.spec.hidden as usize, limits);
    let routers = router_addresses(&dep, &opts.routers)?;
    let listen = match opts.listen {
        Some(a) => a,
        None => dep.worker_endpoint(d)?,
    };
    let cfg = dep.mesh_config(rank, &routers, listen, opts.link);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("worker-io")
        .enable_all()
        .build()
        .context("starting the worker runtime")?;
    // Messages name the device and its topology rank; the mesh rank stays internal.
    let id = dep.device_label(d);
    let (mesh, events) = rt
        .block_on(Mesh::start(cfg))
        .map_err(|e| anyhow!("worker {id}: {e}"))?;
    let shown: Vec<String> = routers.iter().map(ToString::to_string).collect();
    println!(
        "expertmesh worker {id} ready: {:.1} MB of experts on {backend_name}, loaded in {:.2} s, listening on {}, router{} at {}",
        loaded as f64 / 1e6,
        t0.elapsed().as_secs_f64(),
        mesh.local_addr()
            .map_or_else(|| listen.to_string(), |a| a.to_string()),
        if routers.len() == 1 { "" } else { "s" },
        shown.join(", "),
    );
    use std::io::Write;
    let _ = std::io::stdout().flush();

    // Frames go to the compute thread through per-router queues served round robin; each
    // router's credit window bounds what it can have queued here.
    let queue = Arc::new(SharedFairQueue::<RecvFrame>::new(routers.len()));
    let compute = spawn_compute(exec, Arc::clone(&queue), mesh.clone(), rt.handle().clone())?;
    rt.block_on(serve_events(events, &queue, dep.rank_names(), &id));
    queue.close();
    let _ = compute.join();
    mesh.shutdown();
    rt.shutdown_timeout(Duration::from_millis(200));
    Ok(())
}

/// The routers' mesh endpoints: given on the command line (one per router), or from the
/// topology.
fn router_addresses(dep: &Deployment, given: &[SocketAddr]) -> anyhow::Result<Vec<SocketAddr>> {
    if given.is_empty() {
        return dep.router_mesh_endpoints();
    }
    if given.len() as u32 != dep.router_count() {
        bail!(
            "{} router address{} given but topology {} declares {} router{}; pass one --router \
             per router, in the topology's order",
            given.len(),
            if given.len() == 1 { " was" } else { "es were" },
            dep.topology.name(),
            dep.router_count(),
            if dep.router_count() == 1 { "" } else { "s" },
        );
    }
    Ok(given.to_vec())
}

/// The compute thread: takes dispatches round robin over routers, runs them, and sends each
/// result to the router it came from.
fn spawn_compute(
    mut exec: DispatchExecutor,
    queue: Arc<SharedFairQueue<RecvFrame>>,
    mesh: Mesh,
    handle: tokio::runtime::Handle,
) -> anyhow::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name("worker-compute".into())
        .spawn(move || {
            while let Some((_, frame)) = queue.pop_blocking() {
                let from = frame.peer();
                let out = match frame.body() {
                    Body::Dispatch(d) => match exec.execute(d, frame.payload()) {
                        Ok((res, bytes)) => OutFrame::with_payload(Body::Result(res), bytes),
                        Err(crate::exec::ExecError { code, message }) => {
                            OutFrame::new(Body::Error(ErrorFrame {
                                request_id: d.batch_id,
                                code,
                                message,
                            }))
                        }
                    },
                    _ => continue,
                };
                // Release the dispatch's credit before waiting to send the result.
                drop(frame);
                if let Err(e) = handle.block_on(mesh.send(from, &out)) {
                    tracing::warn!(error = %e, "result not delivered");
                }
            }
        })
        .context("starting the compute thread")
}

/// The I/O loop: dispatches into the fair queue, peer notices into the log; a lost router's
/// queued dispatches are dropped.
async fn serve_events(
    mut events: MeshEvents,
    queue: &SharedFairQueue<RecvFrame>,
    names: Vec<String>,
    id: &str,
) {
    while let Some(ev) = events.recv().await {
        match ev {
            TransportEvent::Frame(f) => {
                if matches!(f.body(), Body::Dispatch(_)) {
                    queue.push(f.peer() as usize, f);
                }
            }
            TransportEvent::PeerUp { peer, link } => {
                let peer = names.get(peer as usize).map_or("?", String::as_str);
                tracing::info!(worker = %id, peer, link = link.name(), "connected");
            }
            TransportEvent::PeerLost(e) => {
                let dropped = queue.drop_sender(e.peer as usize);
                let peer = names.get(e.peer as usize).map_or("?", String::as_str);
                tracing::warn!(
                    worker = %id, peer, error = %e.kind, dropped,
                    "link lost; redialing (its queued dispatches dropped)"
                );
            }
        }
    }
}
