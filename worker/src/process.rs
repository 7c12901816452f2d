//! The expert worker: one process per device, pinning its experts for life and serving
//! dispatch frames from the router.
//!
//! Why this exists: this is the "device" of the design. At start it loads only its own
//! (layer, expert) weights onto its backend, once, with every buffer sized for the largest
//! batch; then it joins the mesh (dialing the router, redialing with backoff if the router
//! restarts) and loops: a dispatch frame in, the backend run once for the whole grouped batch,
//! one result frame out. Compute runs on its own thread so the mesh keeps answering heartbeats
//! however long a batch takes.

use crate::deploy::Deployment;
use crate::exec::DispatchExecutor;
use crate::weights;
use anyhow::{Context, anyhow};
use expertmesh_backend::{BatchLimits, ExpertBackend};
use expertmesh_cpu_backend::CpuBackend;
use expertmesh_transport::codec::{Body, ErrorFrame};
use expertmesh_transport::mesh::{LinkKind, Mesh, OutFrame, RecvFrame, Transport, TransportEvent};
use std::net::SocketAddr;
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
    /// Where the router's mesh listens (default: from the topology).
    pub router: Option<SocketAddr>,
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
    let rank = Deployment::mesh_rank(d);
    let t0 = Instant::now();
    let limits = worker_limits(&dep, opts.max_tokens);
    let backend = make_backend(&dep, &opts, limits)?;
    let loaded = backend.loaded_bytes();
    let backend_name = backend.name();
    let mut exec = DispatchExecutor::new(backend, dep.spec.hidden as usize, limits);
    let router = match opts.router {
        Some(a) => a,
        None => dep.router_mesh_endpoint()?,
    };
    let listen = match opts.listen {
        Some(a) => a,
        None => dep.worker_endpoint(d)?,
    };
    let cfg = dep.mesh_config(rank, router, listen, opts.link);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("worker-io")
        .enable_all()
        .build()
        .context("starting the worker runtime")?;
    // Messages name the device and its topology rank; the mesh rank stays internal.
    let id = dep.device_label(d);
    let (mesh, mut events) = rt
        .block_on(Mesh::start(cfg))
        .map_err(|e| anyhow!("worker {id}: {e}"))?;
    let names = dep.rank_names();
    println!(
        "expertmesh worker {id} ready: {:.1} MB of experts on {backend_name}, loaded in {:.2} s, listening on {}, router at {router}",
        loaded as f64 / 1e6,
        t0.elapsed().as_secs_f64(),
        mesh.local_addr()
            .map_or_else(|| listen.to_string(), |a| a.to_string()),
    );
    use std::io::Write;
    let _ = std::io::stdout().flush();

    // Frames go to the compute thread through a small bounded queue; the mesh's credit window
    // bounds what the router can have outstanding here anyway.
    let (tx, mut rx) = tokio::sync::mpsc::channel::<RecvFrame>(4);
    let handle = rt.handle().clone();
    let compute_mesh = mesh.clone();
    let compute = std::thread::Builder::new()
        .name("worker-compute".into())
        .spawn(move || {
            while let Some(frame) = rx.blocking_recv() {
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
                if let Err(e) = handle.block_on(compute_mesh.send(from, &out)) {
                    tracing::warn!(error = %e, "result not delivered");
                }
            }
        })
        .context("starting the compute thread")?;
    rt.block_on(async {
        while let Some(ev) = events.recv().await {
            match ev {
                TransportEvent::Frame(f) => {
                    if matches!(f.body(), Body::Dispatch(_)) && tx.send(f).await.is_err() {
                        break;
                    }
                }
                TransportEvent::PeerUp { peer, link } => {
                    let peer = names.get(peer as usize).map_or("?", String::as_str);
                    tracing::info!(worker = %id, peer, link = link.name(), "connected");
                }
                TransportEvent::PeerLost(e) => {
                    let peer = names.get(e.peer as usize).map_or("?", String::as_str);
                    tracing::warn!(worker = %id, peer, error = %e.kind, "link lost; redialing");
                }
            }
        }
    });
    drop(tx);
    let _ = compute.join();
    mesh.shutdown();
    rt.shutdown_timeout(Duration::from_millis(200));
    Ok(())
}
