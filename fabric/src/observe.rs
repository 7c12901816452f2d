//! The operator's view of a running fabric: `--metrics` endpoints and the live load file.
//!
//! Why this exists: `router`, `worker` and `up` share one way to expose what they do. Each
//! router and each worker serves Prometheus metrics on its own port (`--metrics ADDR`; port 0
//! picks free ports, and every chosen address is printed), and a router can keep a live
//! per-expert load file in the planner's statistics format (`--load-stats FILE`), refreshed
//! atomically every few seconds, so `expertmesh plan --load FILE` replans replication from
//! the traffic actually served (the loop from traffic back to placement).
//!
//! Ports for `up --metrics HOST:PORT`: router `i` gets `PORT + i`, worker `d` gets
//! `PORT + routers + d`; with port 0 every process gets a free port (the workers' are picked
//! here, before they start, so they can be printed and kept across worker restarts).

use crate::FabricError;
use crate::local::LocalFabric;
use expertmesh_planner::stats::LoadStats;
use expertmesh_router::metrics::http::MetricsServer;
use expertmesh_router::metrics::{RouterMetrics, registry_of};
use expertmesh_router::service::RouterService;
use expertmesh_topology::model::ModelSpec;
use expertmesh_topology::topology::{DeviceRank, Topology};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

/// What to observe: a `/metrics` endpoint per process and the live load file (the router's
/// and `up`'s `--metrics`, `--load-stats` and `--load-stats-every`).
#[derive(Debug, Clone)]
pub struct ObserveOptions {
    /// Serve Prometheus metrics at http://ADDR/metrics; with `up`, router i at PORT+i and
    /// worker d at PORT+routers+d (all free ports when PORT is 0).
    pub metrics: Option<SocketAddr>,
    /// Keep a live per-expert load file here, in the planner's statistics format (.json for
    /// JSON, else CSV).
    pub load_stats: Option<PathBuf>,
    /// Seconds between rewrites of the load file.
    pub load_stats_every: f64,
}

impl Default for ObserveOptions {
    fn default() -> Self {
        Self {
            metrics: None,
            load_stats: None,
            load_stats_every: 10.0,
        }
    }
}

/// What observes a running router or fabric; dropping it stops the endpoints and writes the
/// load file one last time.
#[derive(Debug, Default)]
pub struct Observers {
    servers: Vec<MetricsServer>,
    writer: Option<LoadStatsWriter>,
}

/// The address of process `i` (routers first, then workers) for `--metrics base`.
fn nth_addr(base: SocketAddr, i: usize) -> Result<SocketAddr, FabricError> {
    if base.port() == 0 {
        return Ok(base);
    }
    let port = u16::try_from(usize::from(base.port()) + i)
        .map_err(|_| FabricError::MetricsPort { base, process: i })?;
    Ok(SocketAddr::new(base.ip(), port))
}

/// `up`: the address of each worker's endpoint, by topology device rank (empty without
/// `--metrics`). With port 0 free ports are picked now, so they can be printed before the
/// workers start and kept when one restarts.
pub(crate) fn worker_metrics_addrs(
    args: &ObserveOptions,
    routers: usize,
    devices: usize,
) -> Result<Vec<SocketAddr>, FabricError> {
    let Some(base) = args.metrics else {
        return Ok(Vec::new());
    };
    if base.port() != 0 {
        return (0..devices).map(|d| nth_addr(base, routers + d)).collect();
    }
    // Below the ephemeral range: a worker binds its port only once started (and again after
    // a restart), and a port the kernel picked (binding port 0) could meanwhile be taken by
    // an outgoing connection (the workers' own links, a frontend's).
    (0..devices)
        .map(|_| {
            expertmesh_transport::ports::free_ports(base.ip(), 1)
                .map(|port| SocketAddr::new(base.ip(), port))
                .map_err(FabricError::io(format!(
                    "picking free ports for the workers' --metrics on {base}"
                )))
        })
        .collect()
}

/// `up`: each worker's `--metrics` address ([`worker_metrics_addrs`]) for the routers and
/// devices of `topology` (empty without `--metrics`).
pub fn up_worker_addrs(
    args: &ObserveOptions,
    topology: &Path,
) -> Result<Vec<SocketAddr>, FabricError> {
    if args.metrics.is_none() {
        return Ok(Vec::new());
    }
    let t = Topology::load(topology).map_err(FabricError::Topology)?;
    worker_metrics_addrs(args, t.routers().len().max(1), t.devices().len())
}

/// `up`: the observers of every router of `fabric`, and the URLs of its workers' endpoints
/// (`workers`, by device rank) printed.
pub fn start_up(
    args: &ObserveOptions,
    fabric: &LocalFabric,
    workers: &[SocketAddr],
) -> Result<Observers, FabricError> {
    let dep = fabric.deployment();
    let routers: Vec<&RouterService> = (0..dep.router_count() as usize)
        .filter_map(|i| fabric.router(i))
        .collect();
    let obs = start(args, &routers, &dep.spec)?;
    for (d, a) in workers.iter().enumerate() {
        let name = dep.device_label(DeviceRank(d as u32));
        println!("  metrics: worker {name} at http://{a}/metrics");
    }
    Ok(obs)
}

/// Start the observers of `routers` (one endpoint each, and one load file summed over them)
/// serving `spec`, printing each endpoint's URL.
pub fn start(
    args: &ObserveOptions,
    routers: &[&RouterService],
    spec: &ModelSpec,
) -> Result<Observers, FabricError> {
    let mut obs = Observers::default();
    if let Some(base) = args.metrics {
        for (i, r) in routers.iter().enumerate() {
            let addr = nth_addr(base, i)?;
            let registry = registry_of(Arc::clone(r.metrics()));
            let server = MetricsServer::start_with_readiness(addr, registry, r.readiness())
                .map_err(|cause| FabricError::RouterMetrics { instance: i, cause })?;
            tracing::info!(router = i, url = %server.url(), "serving metrics");
            println!("  metrics: router {i} at {}", server.url());
            obs.servers.push(server);
        }
    }
    if let Some(path) = &args.load_stats {
        let every = Duration::try_from_secs_f64(args.load_stats_every)
            .ok()
            .filter(|d| !d.is_zero())
            .ok_or(FabricError::LoadStatsEvery(args.load_stats_every))?;
        let sources: Vec<Arc<RouterMetrics>> =
            routers.iter().map(|r| Arc::clone(r.metrics())).collect();
        let writer = LoadStatsWriter::start(path.clone(), every, spec.clone(), sources)?;
        println!(
            "  load statistics: {} (every {:.1} s; `expertmesh plan --load` reads it)",
            path.display(),
            every.as_secs_f64()
        );
        obs.writer = Some(writer);
    }
    Ok(obs)
}

/// Rewrites the live load file from the routers' per-expert counts, on its own thread. A file
/// already there (an earlier run's, a restarted router's) is resumed from: its counts and
/// tokens are added to the routers', so a restart does not throw the routed history away.
#[derive(Debug)]
pub struct LoadStatsWriter {
    stop: Option<mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl LoadStatsWriter {
    /// Read `path` when it exists (the counts to resume from: a file that is not this
    /// model's load statistics fails the start, naming why), write it now (so a bad path
    /// fails at start, with its reason), then every `every` and once more when dropped.
    pub fn start(
        path: PathBuf,
        every: Duration,
        spec: ModelSpec,
        sources: Vec<Arc<RouterMetrics>>,
    ) -> Result<Self, FabricError> {
        let base = match path.try_exists() {
            Ok(true) => Some(LoadStats::load(&path, &spec).map_err(|cause| {
                FabricError::ResumeLoadStats {
                    path: path.clone(),
                    cause,
                }
            })?),
            _ => None,
        };
        if base.is_some() {
            tracing::info!(path = %path.display(), "resuming the load statistics from the file");
        }
        let write = move |path: &Path| write_load(path, &spec, &sources, base.as_ref());
        write(&path)?;
        let (stop, stopped) = mpsc::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("load-stats".into())
            .spawn(move || {
                loop {
                    let last = !matches!(
                        stopped.recv_timeout(every),
                        Err(mpsc::RecvTimeoutError::Timeout)
                    );
                    if let Err(e) = write(&path) {
                        tracing::warn!(error = %format!("{e:#}"), "writing the load statistics failed");
                    }
                    if last {
                        return;
                    }
                }
            })
            .map_err(FabricError::io("starting the load statistics writer"))?;
        Ok(Self {
            stop: Some(stop),
            thread: Some(thread),
        })
    }
}

impl Drop for LoadStatsWriter {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The routers' per-expert counts so far, summed, and added to `base` (counts resumed from),
/// as the planner's load statistics: one row of counts per MoE layer of `spec` (a layer
/// neither has data for has none), and the window's tokens (the most any layer saw, plus
/// `base`'s).
pub fn load_stats(
    spec: &ModelSpec,
    sources: &[Arc<RouterMetrics>],
    base: Option<&LoadStats>,
) -> Result<LoadStats, FabricError> {
    let ids = spec.moe_layer_ids();
    let e = spec.routed_experts as usize;
    let mut counts: Vec<Option<Vec<f64>>> = (0..ids.len())
        .map(|li| base.and_then(|b| b.layer(li)).map(<[f64]>::to_vec))
        .collect();
    let mut tokens = vec![0u64; ids.len()];
    for m in sources {
        for (layer, c) in m.expert_load() {
            let Some(li) = ids.iter().position(|&l| l == layer) else {
                continue;
            };
            let row = counts[li].get_or_insert_with(|| vec![0.0; e]);
            for (r, &v) in row.iter_mut().zip(&c) {
                *r += v as f64;
            }
            tokens[li] += m.layer_tokens(layer);
        }
    }
    let window = tokens.iter().copied().max().unwrap_or(0) as f64;
    let resumed = base.and_then(LoadStats::tokens).unwrap_or(0.0);
    Ok(LoadStats::new(spec, counts)
        .map_err(FabricError::LoadStats)?
        .with_tokens(window + resumed))
}

fn write_load(
    path: &Path,
    spec: &ModelSpec,
    sources: &[Arc<RouterMetrics>],
    base: Option<&LoadStats>,
) -> Result<(), FabricError> {
    load_stats(spec, sources, base)?
        .write_atomic(path, spec)
        .map_err(|cause| FabricError::WriteLoadStats {
            path: path.to_path_buf(),
            cause,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A load file already there is resumed from (its counts and tokens kept and added to),
    /// not rewritten from zero; one that is not the model's load statistics fails the start
    /// naming the file, and is left as it was.
    #[test]
    fn a_load_file_already_there_is_resumed_from() {
        let spec = expertmesh_topology::model::preset_by_name("demo-small").unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("load.json");
        let layers = spec.moe_layer_ids().len();
        let e = spec.routed_experts as usize;
        let mut counts: Vec<Option<Vec<f64>>> = vec![None; layers];
        counts[1] = Some((0..e).map(|i| (i * 3) as f64).collect());
        let earlier = LoadStats::new(&spec, counts).unwrap().with_tokens(500.0);
        earlier.write_atomic(&path, &spec).unwrap();
        let every = Duration::from_secs(3600);
        drop(LoadStatsWriter::start(path.clone(), every, spec.clone(), Vec::new()).unwrap());
        let now = LoadStats::load(&path, &spec).unwrap();
        assert_eq!(now.layer(1), earlier.layer(1));
        assert_eq!(now.layer(0), None);
        assert_eq!(now.tokens(), Some(500.0));

        std::fs::write(&path, "not a load file").unwrap();
        let err = LoadStatsWriter::start(path.clone(), every, spec, Vec::new()).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("load.json") && text.contains("cannot be resumed"),
            "{text}"
        );
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "not a load file");
    }

    #[test]
    fn ports_per_process() {
        let base: SocketAddr = "127.0.0.1:9100".parse().unwrap();
        assert_eq!(nth_addr(base, 3).unwrap().port(), 9103);
        let zero: SocketAddr = "127.0.0.1:0".parse().unwrap();
        assert_eq!(nth_addr(zero, 3).unwrap(), zero);
        let top: SocketAddr = "127.0.0.1:65535".parse().unwrap();
        assert!(nth_addr(top, 1).is_err());
        let args = ObserveOptions {
            metrics: Some(zero),
            load_stats: None,
            load_stats_every: 1.0,
        };
        let picked = worker_metrics_addrs(&args, 1, 3).unwrap();
        assert_eq!(picked.len(), 3);
        assert!(picked.iter().all(|a| a.port() != 0));
        let distinct: std::collections::BTreeSet<u16> = picked.iter().map(|a| a.port()).collect();
        assert_eq!(distinct.len(), 3, "{picked:?}");
    }
}
