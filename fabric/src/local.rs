//! The local fabric launcher: the router service(s) in this process and one worker process per
//! device of a topology, on one host. A topology with several `[[router]]` tables gets that
//! many router services, all sharing the same workers.
//!
//! Why this exists: `expertmesh up`, the demo, `bench fabric` and the integration tests all
//! need a whole fabric — real processes, real sockets or shared memory — started, supervised
//! (kill, restart) and shut down cleanly. Workers are this same binary run as
//! `expertmesh worker ...`; they die with the launcher (parent-death signal) so nothing is left
//! running.

use crate::FabricError;
use expertmesh_router::core::{RouterConfig, part_slots};
use expertmesh_router::service::{RouterService, ServiceConfig};
use expertmesh_topology::topology::DeviceRank;
use expertmesh_transport::frontend::{FrontendConfig, FrontendGate};
use expertmesh_transport::mesh::LinkKind;
use expertmesh_worker::deploy::Deployment;
use expertmesh_worker::shared::router_core;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// How to start a local fabric.
#[derive(Clone, Debug)]
pub struct LocalFabricOptions {
    /// Topology file.
    pub topology: PathBuf,
    /// Model preset or file.
    pub model: String,
    /// Placement file.
    pub placement: PathBuf,
    /// Seed of the synthetic weights.
    pub seed: u64,
    /// A converted weights folder to serve (its manifest's model and placement are used;
    /// `model`, `placement` and `seed` are then ignored).
    pub weights: Option<PathBuf>,
    /// Per device (rank order), a weights folder its worker reads instead of `weights`: the
    /// per-host copies of a multi-host deployment (each holding only its host's shards), on
    /// one machine. Empty: every worker reads `weights`.
    pub worker_weights: Vec<PathBuf>,
    /// Worker ↔ router link.
    pub link: LinkKind,
    /// How long a silent mesh peer is given, for the routers and every worker
    /// (`--link-timeout-s`; [`Deployment::link_timeout`]).
    pub link_timeout: Duration,
    /// Router settings (mode, batching, deadlines).
    pub router: RouterConfig,
    /// The `expertmesh` binary to run workers with.
    pub exe: PathBuf,
    /// Frontend listen address of router 0 (`None`: the topology's, or an ephemeral port with
    /// `ephemeral_ports`).
    pub frontend_listen: Option<SocketAddr>,
    /// Use ephemeral ports on 127.0.0.1 for everything (tests run in parallel).
    pub ephemeral_ports: bool,
    /// Worker backend threads (default: the topology's).
    pub worker_threads: Option<usize>,
    /// The HIP runtime library GPU workers open (`--hip-library`; default: theirs).
    pub hip_library: Option<PathBuf>,
    /// The folder CPU workers keep their repacked tiles in (`--tile-cache`; `None`: none).
    pub tile_cache: Option<PathBuf>,
    /// The NIC under RDMA links, for the router and every worker (`--rdma-provider`).
    pub rdma_provider: expertmesh_transport::rdma::RdmaProvider,
    /// How long to wait for every worker to load its experts and connect.
    pub connect_timeout: Duration,
    /// Directory for worker logs (default: a fresh temporary directory).
    pub log_dir: Option<PathBuf>,
    /// Each worker's `--metrics` address, by device rank (empty: workers serve no metrics).
    pub worker_metrics: Vec<SocketAddr>,
    /// A cluster master key (`expertmesh keys init`): every router, worker and
    /// [`LocalFabric::frontend_config`] then gets its own issued credentials (authenticated,
    /// encrypted links). `None`: no credentials.
    pub key: Option<PathBuf>,
    /// Let workers run without credentials on non-loopback addresses (`--insecure`).
    pub insecure: bool,
    /// Limits on each router's frontend connections.
    pub frontend_limits: FrontendLimits,
    /// Replace `router.micro_batch_tokens` by the largest batch one frame carries for the
    /// model and mode (at most `router.max_batch_tokens`; see [`one_host_micro_batch`]): every
    /// process of a local fabric shares this host, so there is no wire to overlap, and every
    /// micro-batch would stream the experts it touches again.
    pub micro_batch_fit: bool,
}

/// Limits on a router's frontend connections (`--max-connections-per-frontend`,
/// `--frontend-idle-timeout-s`, `--frontend-frame-timeout-s`, `--placement-admins`): how many
/// one frontend name may hold open, how long one may sit idle (no request, none in flight) or
/// leave a frame half sent before the router closes it, and which frontends may change the
/// placement.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FrontendLimits {
    /// Most connections per frontend name (0: no limit).
    pub max_connections_per_frontend: u32,
    /// Idle time after which a connection is closed (`None`: never).
    pub idle_timeout: Option<Duration>,
    /// Frontend names that may change the placement (`--placement-admins`).
    pub placement_admins: Vec<String>,
    /// How long a frame begun may take to arrive (`--frontend-frame-timeout-s`; `None`: no
    /// limit), see [`FrontendConfig::frame_timeout`].
    pub frame_timeout: Option<Duration>,
}

impl Default for FrontendLimits {
    fn default() -> Self {
        Self {
            max_connections_per_frontend:
                expertmesh_transport::frontend::DEFAULT_MAX_CONNECTIONS_PER_FRONTEND,
            idle_timeout: Some(expertmesh_transport::frontend::DEFAULT_FRONTEND_IDLE_TIMEOUT),
            placement_admins: vec![
                expertmesh_transport::frontend::DEFAULT_PLACEMENT_ADMIN.to_owned(),
            ],
            frame_timeout: Some(expertmesh_transport::frontend::DEFAULT_FRONTEND_FRAME_TIMEOUT),
        }
    }
}

impl FrontendLimits {
    /// Sets these limits on a router's frontend settings.
    pub fn apply(&self, f: &mut FrontendConfig) {
        f.max_connections_per_frontend = self.max_connections_per_frontend;
        f.idle_timeout = self.idle_timeout;
        f.frame_timeout = self.frame_timeout;
        f.placement_admins.clone_from(&self.placement_admins);
    }
}

impl LocalFabricOptions {
    /// The weights folder device `d`'s worker reads (`worker_weights`, else `weights`).
    fn weights_of(&self, d: usize) -> Option<&PathBuf> {
        self.worker_weights.get(d).or(self.weights.as_ref())
    }

    /// Defaults for a topology/model/placement triple.
    pub fn new(topology: impl Into<PathBuf>, model: &str, placement: impl Into<PathBuf>) -> Self {
        Self {
            topology: topology.into(),
            model: model.into(),
            placement: placement.into(),
            seed: 42,
            weights: None,
            worker_weights: Vec::new(),
            link: LinkKind::Tcp,
            link_timeout: expertmesh_worker::deploy::DEFAULT_LINK_TIMEOUT,
            router: RouterConfig::default(),
            exe: std::env::current_exe().unwrap_or_else(|_| PathBuf::from("expertmesh")),
            frontend_listen: None,
            ephemeral_ports: false,
            worker_threads: None,
            hip_library: None,
            tile_cache: None,
            rdma_provider: Default::default(),
            connect_timeout: Duration::from_secs(120),
            log_dir: None,
            worker_metrics: Vec::new(),
            key: None,
            insecure: false,
            frontend_limits: FrontendLimits::default(),
            micro_batch_fit: false,
        }
    }
}

/// The micro-batch of a fabric whose processes share one host: the router's largest batch,
/// or fewer tokens where a part of that many (each token with all the experts a part can
/// carry on one device) would not fit one frame.
pub fn one_host_micro_batch(dep: &Deployment, router: &RouterConfig) -> usize {
    let slots = part_slots(&dep.spec, dep.shared_on_a_device());
    let fits =
        router.largest_micro_batch(&dep.spec, slots, expertmesh_worker::deploy::MAX_FRAME_BYTES);
    router.max_batch_tokens.min(fits).max(1)
}

/// Frontend settings matching a deployment (cluster name, secret).
pub fn frontend_config(dep: &Deployment) -> FrontendConfig {
    let mut f = FrontendConfig::new(dep.topology.name());
    f.credentials = dep.credentials.clone();
    f
}

/// Why frontends are refused while workers `names` have not connected.
fn starting_reason(names: &[String]) -> String {
    format!(
        "the fabric is starting: workers {} have not connected yet; retry once `expertmesh up` \
         prints where frontends connect",
        names.join(", ")
    )
}

/// A running local fabric.
pub struct LocalFabric {
    dep: Deployment,
    opts: LocalFabricOptions,
    /// Router services by instance (`None` once stopped with [`LocalFabric::stop_router`]).
    services: Vec<Option<RouterService>>,
    gates: Vec<FrontendGate>,
    router_mesh: Vec<SocketAddr>,
    /// Where each router's frontends connect, by instance (kept for restarts).
    router_frontends: Vec<SocketAddr>,
    /// Each device's listen address when the launcher picks them (ephemeral ports on a
    /// topology whose nodes fan out: node peers must know where to dial each other).
    device_addrs: Vec<SocketAddr>,
    workers: Vec<Option<Child>>,
    log_dir: PathBuf,
    /// The temporary log folder when none was asked for, held locked while the fabric lives.
    _tmp: Option<(tempfile::TempDir, expertmesh_files::Held)>,
}

impl std::fmt::Debug for LocalFabric {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalFabric")
            .field("frontends", &self.frontend_addrs())
            .finish()
    }
}

impl LocalFabric {
    /// Start the routers and every worker, and wait until all workers are connected to every
    /// router.
    pub fn start(mut opts: LocalFabricOptions) -> Result<Self, FabricError> {
        let mut dep = match &opts.weights {
            Some(w) => Deployment::load_converted(&opts.topology, w)?,
            None => Deployment::load(&opts.topology, &opts.model, &opts.placement, opts.seed)?,
        };
        dep.link_timeout = opts.link_timeout;
        if opts.micro_batch_fit {
            opts.router.micro_batch_tokens = one_host_micro_batch(&dep, &opts.router);
        }
        let (tmp, log_dir) = log_dir(&opts)?;
        let n = dep.topology.devices().len();
        let all_names: Vec<String> = (0..n)
            .map(|d| dep.device_label(DeviceRank(d as u32)))
            .collect();
        let mut services = Vec::new();
        let mut gates = Vec::new();
        let mut router_mesh = Vec::new();
        let mut router_frontends = Vec::new();
        for instance in 0..dep.router_count() {
            // Frontends are refused, with the reason, until every worker has connected; the
            // reason names the missing workers from the first moment the port listens.
            let gate = FrontendGate::closed(starting_reason(&all_names));
            let service = start_router(&dep, &opts, instance, gate.clone(), None)?;
            router_frontends.push(service.frontend_addr());
            router_mesh.push(
                service
                    .mesh_addr()
                    .ok_or(FabricError::RouterMeshAddress(instance))?,
            );
            services.push(Some(service));
            gates.push(gate);
        }
        let device_addrs = pick_device_addrs(&dep, &opts)?;
        let mut fabric = Self {
            dep,
            opts,
            services,
            gates,
            router_mesh,
            router_frontends,
            device_addrs,
            workers: (0..n).map(|_| None).collect(),
            log_dir,
            _tmp: tmp,
        };
        for d in 0..n {
            fabric.spawn_worker(d)?;
        }
        let all: Vec<usize> = (0..n).collect();
        if let Err(e) = fabric.wait_for_workers(&all) {
            // The error points at the logs: keep them after the launcher exits, but not the
            // workers' credential files beside them (secrets have no place in a folder kept
            // for reading).
            if let Some((t, _held)) = fabric._tmp.take() {
                remove_credential_files(t.path());
                // A later fabric's sweep of killed fabrics' folders leaves this one alone.
                let _ = std::fs::write(t.path().join(KEPT_MARKER), KEPT_NOTE);
                let _ = t.keep();
            }
            return Err(e);
        }
        for g in &fabric.gates {
            g.open();
        }
        Ok(fabric)
    }

    /// Wait until the workers `devices` (topology ranks) are connected, polling their processes:
    /// a worker that exits first is reported at once with its status and the end of its log.
    /// While waiting, frontends are refused with the names of the workers still missing.
    fn wait_for_workers(&mut self, devices: &[usize]) -> Result<(), FabricError> {
        let deadline = std::time::Instant::now() + self.opts.connect_timeout;
        loop {
            let missing: Vec<usize> = devices
                .iter()
                .copied()
                .filter(|&d| {
                    let rank = self.dep.mesh_rank(DeviceRank(d as u32));
                    self.services
                        .iter()
                        .flatten()
                        .any(|s| !s.is_worker_live(rank))
                })
                .collect();
            if missing.is_empty() {
                return Ok(());
            }
            if let Some((d, status)) = self
                .exited_workers()
                .into_iter()
                .find(|(d, _)| missing.contains(d))
            {
                self.workers[d] = None;
                return Err(FabricError::WorkerExited {
                    worker: self.label(d),
                    status,
                    log_tail: self.worker_log_tail(&[d]),
                });
            }
            let names: Vec<String> = missing.iter().map(|&d| self.label(d)).collect();
            if std::time::Instant::now() >= deadline {
                return Err(FabricError::WorkersTimeout {
                    workers: names,
                    timeout: self.opts.connect_timeout,
                    log_tail: self.worker_log_tail(&missing),
                });
            }
            for g in &self.gates {
                if g.reason().is_some() {
                    g.close(starting_reason(&names));
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// A device for messages: "local/cpu0 (rank 0)".
    fn label(&self, d: usize) -> String {
        self.dep.device_label(DeviceRank(d as u32))
    }

    fn worker_log(&self, d: usize) -> PathBuf {
        self.log_dir.join(format!("worker-{d}.log"))
    }

    fn spawn_worker(&mut self, d: usize) -> Result<(), FabricError> {
        let o = &self.opts;
        let dev = &self.dep.topology.devices()[d];
        let log = std::fs::File::create(self.worker_log(d))
            .map_err(FabricError::io("creating a worker log"))?;
        let mut cmd = Command::new(&o.exe);
        cmd.arg("worker").arg("--topology").arg(&o.topology);
        match o.weights_of(d) {
            Some(w) => cmd.arg("--weights").arg(w),
            None => cmd
                .arg("--model")
                .arg(&o.model)
                .arg("--placement")
                .arg(&o.placement)
                .arg("--seed")
                .arg(o.seed.to_string()),
        };
        cmd.arg("--device").arg(dev.id());
        for r in &self.router_mesh {
            cmd.arg("--router").arg(r.to_string());
        }
        cmd.arg("--link")
            .arg(o.link.name())
            .arg("--link-timeout-s")
            .arg(o.link_timeout.as_secs_f64().to_string())
            .arg("--max-tokens")
            .arg(o.router.micro_batch_tokens.max(1).to_string())
            .arg("--exit-with-parent")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        if let Some(a) = self.device_addrs.get(d) {
            cmd.arg("--listen").arg(a.to_string());
            let all: Vec<String> = self.device_addrs.iter().map(ToString::to_string).collect();
            cmd.arg("--device-addrs").arg(all.join(","));
        } else if o.ephemeral_ports {
            cmd.arg("--listen").arg("127.0.0.1:0");
        }
        if let Some(k) = &o.key {
            let lc = crate::credentials::LocalCredentials::new(k, &self.dep, &self.log_dir)?;
            cmd.arg("--credentials")
                .arg(lc.worker_file(&self.dep, d as u32)?);
        }
        if o.insecure {
            cmd.arg("--insecure");
        }
        if let Some(a) = o.worker_metrics.get(d) {
            cmd.arg("--metrics").arg(a.to_string());
        }
        if let Some(t) = o.worker_threads {
            cmd.arg("--threads").arg(t.to_string());
        }
        if let Some(lib) = &o.hip_library {
            cmd.arg("--hip-library").arg(lib);
        }
        if let Some(dir) = &o.tile_cache {
            cmd.arg("--tile-cache").arg(dir);
        }
        cmd.arg("--rdma-provider").arg(o.rdma_provider.name());
        let child = cmd.spawn().map_err(FabricError::io(format!(
            "starting worker {} with {}",
            dev.id(),
            o.exe.display()
        )))?;
        self.workers[d] = Some(child);
        Ok(())
    }

    /// The last lines of the logs of workers `devices`.
    fn worker_log_tail(&self, devices: &[usize]) -> String {
        let mut s = String::new();
        for &d in devices {
            let text = std::fs::read_to_string(self.worker_log(d)).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(8).collect();
            s.push_str(&format!(
                "--- last lines of worker {} log ({}):\n",
                self.label(d),
                self.worker_log(d).display()
            ));
            for l in tail.into_iter().rev() {
                s.push_str(l);
                s.push('\n');
            }
        }
        s
    }

    /// Where router 0's frontends connect.
    pub fn frontend_addr(&self) -> SocketAddr {
        self.service().frontend_addr()
    }

    /// Where each router's frontends connect, by instance (`None`: stopped).
    pub fn frontend_addrs(&self) -> Vec<Option<SocketAddr>> {
        self.services
            .iter()
            .map(|s| s.as_ref().map(RouterService::frontend_addr))
            .collect()
    }

    /// Frontend settings to connect with (with [`LocalFabricOptions::key`]: the credentials
    /// of frontend "local").
    pub fn frontend_config(&self) -> FrontendConfig {
        let mut f = frontend_config(&self.dep);
        if let Some(k) = &self.opts.key
            && let Ok(lc) = crate::credentials::LocalCredentials::new(k, &self.dep, &self.log_dir)
        {
            f.credentials = Some(lc.frontend(&self.dep, "local"));
        }
        f
    }

    /// The deployment (model, topology, placement).
    pub fn deployment(&self) -> &Deployment {
        &self.dep
    }

    /// The routers' settings as started (the micro-batch resolved when
    /// [`LocalFabricOptions::micro_batch_fit`] asked for it).
    pub fn router_config(&self) -> &RouterConfig {
        &self.opts.router
    }

    /// Router 0's service (stats). Panics if it was stopped with
    /// [`LocalFabric::stop_router`]; use [`LocalFabric::router`] then.
    pub fn service(&self) -> &RouterService {
        self.router(0).expect("router 0 is running")
    }

    /// Router `instance`'s service, while it runs.
    pub fn router(&self, instance: usize) -> Option<&RouterService> {
        self.services.get(instance)?.as_ref()
    }

    /// Stop router `instance` at once (its connections close; the workers and the other
    /// routers go on). Tests use it for a router that dies under load.
    pub fn stop_router(&mut self, instance: usize) {
        if let Some(mut s) = self.services.get_mut(instance).and_then(Option::take) {
            s.shutdown();
        }
    }

    /// Start router `instance` again at the mesh and frontend addresses it had (stopping it
    /// first when it runs): to the workers, a restarted router process (a new core, so a new
    /// incarnation in every batch id, and new mesh links; the workers redial it with their
    /// backoff). Returns once every worker has rejoined it and its core has taken them up;
    /// until then its frontends are refused with the names of the workers still missing.
    pub fn restart_router(&mut self, instance: usize) -> Result<(), FabricError> {
        let frontend = match self.router(instance) {
            Some(s) => s.frontend_addr(),
            None => *self
                .router_frontends
                .get(instance)
                .ok_or(FabricError::UnknownRouter(instance))?,
        };
        self.stop_router(instance);
        let n = self.dep.topology.devices().len();
        let all_names: Vec<String> = (0..n).map(|d| self.label(d)).collect();
        let gate = FrontendGate::closed(starting_reason(&all_names));
        let at = Some((self.router_mesh[instance], frontend));
        let service = start_router(&self.dep, &self.opts, instance as u32, gate.clone(), at)?;
        self.services[instance] = Some(service);
        self.gates[instance] = gate.clone();
        let all: Vec<usize> = (0..n).collect();
        self.wait_for_workers(&all)?;
        let ranks = n as u64;
        let deadline = std::time::Instant::now() + self.opts.connect_timeout;
        while self.router(instance).map_or(0, |s| s.stats().peer_ups) < ranks {
            if std::time::Instant::now() >= deadline {
                return Err(FabricError::RouterNotTakingUp(instance));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        gate.open();
        Ok(())
    }

    /// Start an extra worker process for device `d`, besides the one the fabric runs: the
    /// fabric's worker arguments with `overrides` (`("--seed", "7")`, `("--placement",
    /// path)`, ...) replacing or adding to them, listening on an ephemeral port. Tests use it
    /// for workers the routers must refuse (a second process for a live device, other weights,
    /// another placement). Returns the process (it dies with the launcher) and its log file.
    pub fn spawn_extra_worker(
        &self,
        d: usize,
        overrides: &[(&str, &str)],
    ) -> Result<(Child, PathBuf), FabricError> {
        let o = &self.opts;
        let dev = self
            .dep
            .topology
            .devices()
            .get(d)
            .ok_or(FabricError::UnknownDevice(d))?;
        let path = |p: &Path| p.display().to_string();
        let mut args: Vec<(String, String)> = vec![("--topology".into(), path(&o.topology))];
        match o.weights_of(d) {
            Some(w) => args.push(("--weights".into(), path(w))),
            None => {
                args.push(("--model".into(), o.model.clone()));
                args.push(("--placement".into(), path(&o.placement)));
                args.push(("--seed".into(), o.seed.to_string()));
            }
        }
        args.push(("--device".into(), dev.id().to_string()));
        for r in &self.router_mesh {
            args.push(("--router".into(), r.to_string()));
        }
        args.push(("--link".into(), o.link.name().to_string()));
        let link_timeout = o.link_timeout.as_secs_f64().to_string();
        args.push(("--link-timeout-s".into(), link_timeout));
        args.push(("--rdma-provider".into(), o.rdma_provider.name()));
        let max_tokens = o.router.micro_batch_tokens.max(1).to_string();
        args.push(("--max-tokens".into(), max_tokens));
        args.push(("--listen".into(), "127.0.0.1:0".into()));
        if !self.device_addrs.is_empty() {
            let all: Vec<String> = self.device_addrs.iter().map(ToString::to_string).collect();
            args.push(("--device-addrs".into(), all.join(",")));
        }
        for &(k, v) in overrides {
            match args.iter_mut().find(|(a, _)| a == k) {
                Some(a) => a.1 = v.to_string(),
                None => args.push((k.to_string(), v.to_string())),
            }
        }
        let stamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |t| t.as_nanos());
        let log_path = self.log_dir.join(format!("extra-worker-{d}-{stamp}.log"));
        let log =
            std::fs::File::create(&log_path).map_err(FabricError::io("creating a worker log"))?;
        let mut cmd = Command::new(&o.exe);
        cmd.arg("worker");
        for (k, v) in &args {
            cmd.arg(k).arg(v);
        }
        cmd.arg("--exit-with-parent")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        let child = cmd.spawn().map_err(FabricError::io(format!(
            "starting an extra worker for {}",
            dev.id()
        )))?;
        Ok((child, log_path))
    }

    /// Directory of the worker logs.
    pub fn log_dir(&self) -> &Path {
        &self.log_dir
    }

    /// Send `signal` to worker `d`'s process (tests: SIGSTOP to make a worker stop answering,
    /// SIGCONT to resume it).
    pub fn signal_worker(&self, d: usize, signal: i32) -> Result<(), FabricError> {
        let Some(c) = &self.workers[d] else {
            return Err(FabricError::WorkerNotRunning(d));
        };
        // SAFETY: kill(2) on our own child's pid.
        if unsafe { libc::kill(c.id() as i32, signal) } != 0 {
            return Err(FabricError::Signal {
                signal,
                worker: d,
                cause: std::io::Error::last_os_error(),
            });
        }
        Ok(())
    }

    /// Kill worker `d` (topology device rank) with SIGKILL.
    pub fn kill_worker(&mut self, d: usize) -> Result<(), FabricError> {
        if let Some(mut c) = self.workers[d].take() {
            c.kill().map_err(FabricError::io("killing a worker"))?;
            let _ = c.wait();
        }
        Ok(())
    }

    /// Start worker `d` again and wait until it has rejoined: connected to every router, and
    /// each router's core has taken the link up (so the next call may use it).
    pub fn restart_worker(&mut self, d: usize) -> Result<(), FabricError> {
        self.kill_worker(d)?;
        let ups = |f: &Self| -> Vec<u64> {
            f.services
                .iter()
                .map(|s| s.as_ref().map_or(u64::MAX, |s| s.stats().peer_ups))
                .collect()
        };
        let before = ups(self);
        self.spawn_worker(d)?;
        self.wait_for_workers(&[d])?;
        let deadline = std::time::Instant::now() + self.opts.connect_timeout;
        while ups(self)
            .iter()
            .zip(&before)
            .any(|(now, was)| now <= was && *was != u64::MAX)
        {
            if std::time::Instant::now() >= deadline {
                return Err(FabricError::WorkerNotTakenUp(self.label(d)));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(())
    }

    /// Whether worker `d`'s process runs (started and not exited).
    pub fn worker_running(&mut self, d: usize) -> bool {
        self.workers[d]
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// Check every worker process is alive; returns the devices that exited, with status.
    pub(crate) fn exited_workers(&mut self) -> Vec<(usize, String)> {
        let mut out = Vec::new();
        for (d, w) in self.workers.iter_mut().enumerate() {
            if let Some(c) = w
                && let Ok(Some(status)) = c.try_wait()
            {
                out.push((d, status.to_string()));
            }
        }
        out
    }

    /// Stop workers and the router.
    pub fn shutdown(mut self) {
        self.stop();
    }

    /// The routers first (so a deliberate shutdown is not reported as workers lost), then the
    /// workers: SIGTERM (and SIGCONT, for one a test stopped), so each finishes what it must
    /// (a tile cache file being written), then SIGKILL for any still running after
    /// [`WORKER_STOP_GRACE`].
    fn stop(&mut self) {
        for s in self.services.iter_mut().flatten() {
            s.shutdown();
        }
        let running: Vec<Child> = self.workers.iter_mut().filter_map(Option::take).collect();
        for c in &running {
            // SAFETY: kill(2) on our own children's pids (not yet reaped).
            unsafe {
                libc::kill(c.id() as i32, libc::SIGTERM);
                libc::kill(c.id() as i32, libc::SIGCONT);
            }
        }
        let deadline = std::time::Instant::now() + WORKER_STOP_GRACE;
        for mut c in running {
            while matches!(c.try_wait(), Ok(None)) && std::time::Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
            let _ = c.kill(); // an error: it has exited
            let _ = c.wait();
        }
    }
}

impl Drop for LocalFabric {
    fn drop(&mut self) {
        self.stop();
    }
}

/// How long a stop waits for its workers to exit after SIGTERM before it kills them.
const WORKER_STOP_GRACE: Duration = Duration::from_secs(10);

/// Removes the credential files (`*.cred`) from `dir`, best effort.
fn remove_credential_files(dir: &std::path::Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        if e.path().extension().is_some_and(|x| x == "cred") {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// The start of a fabric's temporary log folder's name, before its process id.
const LOG_FOLDER_PREFIX: &str = "expertmesh-fabric-";
/// A file in a temporary log folder kept after a failed start (the error names its logs):
/// the sweep leaves such a folder for its reader to remove.
const KEPT_MARKER: &str = "KEPT-AFTER-A-FAILED-START";
const KEPT_NOTE: &str = "The workers' logs of a fabric that failed to start, kept for reading \
(credential files removed). Remove this folder when done.\n";

/// The worker log directory: the one asked for, or a fresh temporary one named after this
/// process and held while the fabric lives. The temporary folders of earlier fabrics whose
/// process is gone (killed: SIGKILL or the OOM killer run no drop) are removed first: they
/// hold worker logs and the workers' credential files.
#[allow(clippy::type_complexity)]
fn log_dir(
    opts: &LocalFabricOptions,
) -> Result<(Option<(tempfile::TempDir, expertmesh_files::Held)>, PathBuf), FabricError> {
    match &opts.log_dir {
        Some(d) => {
            std::fs::create_dir_all(d)
                .map_err(FabricError::io(format!("creating {}", d.display())))?;
            Ok((None, d.clone()))
        }
        None => {
            let tmp = std::env::temp_dir();
            expertmesh_files::remove_left_by_gone_processes(&tmp, |name| {
                let pid = expertmesh_files::pid_after(LOG_FOLDER_PREFIX, name)?;
                (!tmp.join(name).join(KEPT_MARKER).exists()).then_some(pid)
            });
            let (t, held) = expertmesh_files::make_locked_folder(
                || {
                    tempfile::Builder::new()
                        .prefix(&format!("{LOG_FOLDER_PREFIX}{}-", std::process::id()))
                        .tempdir()
                },
                tempfile::TempDir::path,
            )
            .map_err(FabricError::io("creating a log directory"))?;
            let p = t.path().to_path_buf();
            Ok((Some((t, held)), p))
        }
    }
}

/// Start router `instance` of the deployment, its frontends held at `gate`; `at` gives its
/// (mesh, frontend) addresses for a restart (otherwise they come from the options and the
/// topology).
fn start_router(
    dep: &Deployment,
    opts: &LocalFabricOptions,
    instance: u32,
    gate: FrontendGate,
    at: Option<(SocketAddr, SocketAddr)>,
) -> Result<RouterService, FabricError> {
    let loopback: SocketAddr = "127.0.0.1:0".parse().expect("literal");
    let mesh_listen = match at {
        Some((mesh, _)) => mesh,
        None if opts.ephemeral_ports => loopback,
        None => dep.router_mesh_endpoint(instance)?,
    };
    let frontend_listen = match (at, opts.frontend_listen) {
        (Some((_, f)), _) => f,
        (None, Some(a)) if instance == 0 => a,
        _ if opts.ephemeral_ports => loopback,
        _ => dep.router_frontend_endpoint(instance)?,
    };
    let with_creds;
    let dep = match &opts.key {
        Some(k) => {
            let lc = crate::credentials::LocalCredentials::new(k, dep, Path::new("."))?;
            let mut d = dep.clone();
            d.credentials = Some(lc.router(dep, instance));
            with_creds = d;
            &with_creds
        }
        None => dep,
    };
    let router_threads = 1;
    let mut frontend = frontend_config(dep);
    opts.frontend_limits.apply(&mut frontend);
    // Before the core, which sizes buffers from these limits.
    expertmesh_router::service::check_limits(
        &opts.router,
        dep.spec.hidden as usize,
        frontend.codec.max_frame_bytes,
    )
    .map_err(|cause| FabricError::RouterStart { instance, cause })?;
    let core = router_core(dep, opts.router.clone(), router_threads, instance)?;
    let mut mesh_cfg = dep.mesh_config(instance, &[], &[], mesh_listen, opts.link);
    mesh_cfg.rdma_provider = opts.rdma_provider.clone();
    frontend.gate = gate;
    frontend.server_rank = instance;
    RouterService::start(
        core,
        mesh_cfg,
        ServiceConfig {
            frontend_listen,
            frontend,
            max_outstanding_per_client: 32,
        },
    )
    .map_err(|cause| FabricError::RouterStart { instance, cause })
}

/// With ephemeral ports on a topology where some node fans out, a free loopback port for every
/// device, so node peers can dial each other (and a restarted worker comes back at the same
/// address); otherwise none (workers take any port, or the topology's).
fn pick_device_addrs(
    dep: &Deployment,
    opts: &LocalFabricOptions,
) -> Result<Vec<SocketAddr>, FabricError> {
    let fans_out = (0..dep.topology.nodes().len()).any(|n| dep.node_fans_out(n));
    if !opts.ephemeral_ports || !fans_out {
        return Ok(Vec::new());
    }
    (0..dep.topology.devices().len())
        .map(|_| {
            let port = expertmesh_transport::ports::free_loopback_ports(1)
                .map_err(FabricError::io("picking free ports for the workers"))?;
            Ok(SocketAddr::from(([127, 0, 0, 1], port)))
        })
        .collect()
}
