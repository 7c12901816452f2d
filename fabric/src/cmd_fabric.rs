//! The fabric subcommands: `worker`, `router`, `up`, `infer`.
//!
//! Why this exists: each is a thin layer between command-line arguments and the library
//! (deployment, worker loop, router service, local launcher, client), so that multi-host
//! deployments (`router` on one host, `worker` on each) and the single-host launcher (`up`)
//! run exactly the same code.

use crate::local::{LocalFabric, LocalFabricOptions, frontend_config};
use anyhow::{Context, anyhow, bail};
use clap::{Args, ValueEnum};
use expertmesh_quant::contract::ComputeMode;
use expertmesh_router::client::{ClientError, ClientOptions, RouterClient};
use expertmesh_router::core::{LayerMode, RouterConfig};
use expertmesh_router::service::{RouterService, ServiceConfig};
use expertmesh_topology::topology::DeviceRank;
use expertmesh_transport::dtype::ActivationDtype;
use expertmesh_transport::frontend::{FrontendConfig, FrontendError};
use expertmesh_transport::mesh::LinkKind;
use expertmesh_worker::deploy::Deployment;
use expertmesh_worker::process::{BackendChoice, WorkerOptions};
use expertmesh_worker::shared::router_core;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

/// An address on the command line: "host:port" with a host name ("localhost:47400") or an IP
/// address; a name is resolved, preferring IPv4 (what the topology's loopback examples use).
pub fn parse_endpoint(s: &str) -> Result<SocketAddr, String> {
    let addrs = resolve_all(s)?;
    Ok(addrs
        .iter()
        .copied()
        .find(SocketAddr::is_ipv4)
        .unwrap_or(addrs[0]))
}

/// Every address "host:port" resolves to (at least one), or a message saying what is wrong.
fn resolve_all(s: &str) -> Result<Vec<SocketAddr>, String> {
    use std::net::ToSocketAddrs;
    if let Ok(a) = s.parse::<SocketAddr>() {
        return Ok(vec![a]);
    }
    if !s.contains(':') {
        return Err(format!(
            "{s:?} has no port; write HOST:PORT, e.g. 127.0.0.1:47400"
        ));
    }
    let addrs: Vec<SocketAddr> = s
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve {s:?}: {e}"))?
        .collect();
    if addrs.is_empty() {
        return Err(format!("{s:?} resolves to no address"));
    }
    Ok(addrs)
}

/// Worker ↔ router link kinds on the command line.
#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum LinkArg {
    /// TCP (any hosts).
    Tcp,
    /// Shared-memory rings (same host; falls back to TCP when /dev/shm is unusable).
    Shm,
    /// RoCE (build with `--features rdma`).
    Rdma,
}

impl From<LinkArg> for LinkKind {
    fn from(l: LinkArg) -> Self {
        match l {
            LinkArg::Tcp => LinkKind::Tcp,
            LinkArg::Shm => LinkKind::Shm,
            LinkArg::Rdma => LinkKind::Rdma,
        }
    }
}

/// Serving mode on the command line (`expertmesh_router::core::LayerMode`).
#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum ModeArg {
    /// W4A8, per-slot f32 results: bit-identical to the reference whatever the placement.
    Exact,
    /// W4A8, per-slot results rounded to bf16: half of exact's result bytes, bits still
    /// placement-independent (the reference with bf16 expert outputs).
    ExactBf16,
    /// W4A16, f32 results pre-combined per device: within 1e-4 of the f64 reference.
    Accurate,
    /// W4A8 (q8 dispatch), results pre-combined per device and sent in bf16: the leanest wire,
    /// within the exact mode's tolerance of f64 (RMS < 2%) plus bf16 rounding.
    Serving,
}

impl From<ModeArg> for LayerMode {
    fn from(m: ModeArg) -> Self {
        match m {
            ModeArg::Exact => LayerMode::Exact,
            ModeArg::ExactBf16 => LayerMode::ExactBf16,
            ModeArg::Accurate => LayerMode::Accurate,
            ModeArg::Serving => LayerMode::Serving,
        }
    }
}

impl From<ModeArg> for ComputeMode {
    fn from(m: ModeArg) -> Self {
        LayerMode::from(m).compute()
    }
}

/// The files of a deployment: topology plus either a converted weights folder (`--weights`,
/// whose manifest names the model and placement) or a model and a placement (synthetic weights
/// from `--seed`).
#[derive(Args, Debug, Clone)]
pub struct DeployArgs {
    /// Topology file.
    #[arg(long)]
    pub topology: PathBuf,
    /// Converted weights folder (written by `expertmesh convert`); the model and the placement
    /// come from its manifest.
    #[arg(long, conflicts_with_all = ["model", "placement", "seed"])]
    pub weights: Option<PathBuf>,
    /// Model preset or model TOML file (synthetic weights; not with --weights).
    #[arg(long, required_unless_present = "weights")]
    pub model: Option<String>,
    /// Placement file (not with --weights).
    #[arg(long, required_unless_present = "weights")]
    pub placement: Option<PathBuf>,
    /// Seed of the synthetic expert weights (must match on every process; not with --weights).
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
}

impl DeployArgs {
    /// Load the deployment these arguments describe.
    pub fn load(&self) -> anyhow::Result<Deployment> {
        match (&self.weights, &self.model, &self.placement) {
            (Some(w), _, _) => Deployment::load_converted(&self.topology, w),
            (None, Some(m), Some(p)) => Deployment::load(&self.topology, m, p, self.seed),
            _ => bail!("give --weights W, or --model and --placement"),
        }
    }
}

/// Router tuning shared by `router`, `up`, `demo` and `bench fabric`.
#[derive(Args, Debug, Clone)]
pub struct RouterArgs {
    /// Serving mode (numerics and result wire). Default: serving for `up` and `router`, exact
    /// for `demo` and `bench fabric`.
    #[arg(long, value_enum)]
    pub mode: Option<ModeArg>,
    /// How long a batch waits for more requests of the same layer, in microseconds (it goes
    /// at once when every connected frontend has a request in it).
    #[arg(long, default_value_t = 200)]
    pub batch_window_us: u64,
    /// Tokens per micro-batch.
    #[arg(long, default_value_t = 32)]
    pub micro_batch: usize,
    /// Largest request (tokens).
    #[arg(long, default_value_t = 256)]
    pub max_tokens: usize,
    /// Deadline of requests that carry none, in milliseconds.
    #[arg(long, default_value_t = 10_000)]
    pub deadline_ms: u64,
    /// Longest deadline a request may ask for, in milliseconds (longer ones are cut to it).
    #[arg(long, default_value_t = 60_000)]
    pub max_deadline_ms: u64,
    /// Tokens of admitted, unanswered requests, all frontends together: beyond this (or a
    /// frontend's fair share of it) requests are refused with Overloaded before their data is
    /// read.
    #[arg(long, default_value_t = 2048)]
    pub max_inflight_tokens: usize,
    /// Re-send a part to a replica after this many milliseconds without an answer.
    #[arg(long, default_value_t = 3_000)]
    pub straggler_ms: u64,
}

impl RouterArgs {
    /// `--mode`, or `default` when it is not given (each command has its own default).
    pub fn mode_or(&self, default: ModeArg) -> ModeArg {
        self.mode.unwrap_or(default)
    }

    /// The router configuration of `up` and `router` (serving mode unless `--mode` says).
    pub fn config(&self) -> RouterConfig {
        self.config_in(ModeArg::Serving)
    }

    /// The router configuration, in `default` mode unless `--mode` says otherwise.
    pub fn config_in(&self, default: ModeArg) -> RouterConfig {
        let mode = LayerMode::from(self.mode_or(default));
        RouterConfig {
            mode,
            max_request_tokens: self.max_tokens,
            max_batch_tokens: self.max_tokens,
            micro_batch_tokens: self.micro_batch.max(1),
            batch_window: Duration::from_micros(self.batch_window_us),
            default_deadline: Duration::from_millis(self.deadline_ms),
            straggler_timeout: Duration::from_millis(self.straggler_ms),
            max_inflight_batches: 64,
            max_deadline: Duration::from_millis(self.max_deadline_ms),
            max_inflight_requests: 64,
            max_inflight_tokens: self.max_inflight_tokens.max(1),
            accurate_dtype: ActivationDtype::F32,
        }
    }
}

/// `expertmesh worker`.
#[derive(Args, Debug)]
pub struct WorkerCli {
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
    #[arg(long, value_enum, default_value_t = LinkArg::Tcp)]
    link: LinkArg,
    /// Backend threads (default: the topology's `threads` for CPU devices).
    #[arg(long)]
    threads: Option<usize>,
    /// Backend: auto (HIP for GPU devices when available, else CPU), cpu or hip.
    #[arg(long, value_enum, default_value_t = BackendArg::Auto)]
    backend: BackendArg,
    /// Largest dispatch (tokens) this worker accepts; match the router's --micro-batch.
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    /// Exit when the parent process exits (used by the local launcher).
    #[arg(long)]
    exit_with_parent: bool,
    #[command(flatten)]
    metrics: crate::observe::MetricsArgs,
    #[command(flatten)]
    security: crate::keys_cmd::SecurityArgs,
}

/// Backend choice on the command line.
#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum BackendArg {
    /// HIP when available for GPU devices, else CPU.
    Auto,
    /// CPU backend.
    Cpu,
    /// HIP backend (error when unavailable).
    Hip,
}

/// Run `expertmesh worker`.
pub fn worker(cli: WorkerCli) -> anyhow::Result<ExitCode> {
    if cli.exit_with_parent {
        exit_with_parent();
    }
    let mut dep = cli.deploy.load()?;
    let d = dep.device(&cli.device)?;
    let listen = match cli.listen {
        Some(a) => a,
        None => dep.worker_endpoint(d)?,
    };
    let mut exposed = vec![listen];
    exposed.extend(&cli.router);
    let rank = dep.mesh_rank(d);
    cli.security.apply_rank(&mut dep, rank, &exposed)?;
    expertmesh_worker::process::run(
        dep,
        WorkerOptions {
            device: cli.device,
            routers: cli.router,
            listen: cli.listen,
            device_addrs: cli.device_addrs,
            link: cli.link.into(),
            threads: cli.threads,
            backend: match cli.backend {
                BackendArg::Auto => BackendChoice::Auto,
                BackendArg::Cpu => BackendChoice::Cpu,
                BackendArg::Hip => BackendChoice::Hip,
            },
            max_tokens: cli.max_tokens.max(1),
            metrics: cli.metrics.metrics,
        },
    )?;
    Ok(ExitCode::SUCCESS)
}

#[cfg(target_os = "linux")]
fn exit_with_parent() {
    // SAFETY: prctl with PR_SET_PDEATHSIG only sets a signal for this process.
    unsafe {
        libc::prctl(
            libc::PR_SET_PDEATHSIG,
            libc::SIGKILL as libc::c_ulong,
            0,
            0,
            0,
        );
    }
    // SAFETY: getppid has no preconditions.
    if unsafe { libc::getppid() } == 1 {
        std::process::exit(0);
    }
}

#[cfg(not(target_os = "linux"))]
fn exit_with_parent() {}

/// `expertmesh router`.
#[derive(Args, Debug)]
pub struct RouterCli {
    #[command(flatten)]
    deploy: DeployArgs,
    #[command(flatten)]
    router: RouterArgs,
    /// Which router of the topology this is (0-based, in the order of its `[[router]]`
    /// tables; several routers share the same workers).
    #[arg(long, default_value_t = 0)]
    instance: u32,
    /// Frontend listen address (default: this router's section of the topology).
    #[arg(long, value_parser = parse_endpoint)]
    listen: Option<SocketAddr>,
    /// Mesh listen address for workers (default: this router's mesh_port, or its node's
    /// control port).
    #[arg(long, value_parser = parse_endpoint)]
    mesh_listen: Option<SocketAddr>,
    /// Link kind workers use (must match the workers' --link).
    #[arg(long, value_enum, default_value_t = LinkArg::Tcp)]
    link: LinkArg,
    /// Threads for shared experts run on the router.
    #[arg(long, default_value_t = 1)]
    threads: usize,
    #[command(flatten)]
    observe: crate::observe::ObserveArgs,
    #[command(flatten)]
    security: crate::keys_cmd::SecurityArgs,
}

/// Run `expertmesh router` until interrupted.
pub fn router(cli: RouterCli) -> anyhow::Result<ExitCode> {
    let mut dep = cli.deploy.load()?;
    let instance = cli.instance;
    let core = router_core(&dep, cli.router.config(), cli.threads, instance)?;
    let mesh_listen = match cli.mesh_listen {
        Some(a) => a,
        None => dep.router_mesh_endpoint(instance)?,
    };
    let listen = match cli.listen {
        Some(a) => a,
        None => dep.router_frontend_endpoint(instance)?,
    };
    cli.security
        .apply_rank(&mut dep, instance, &[mesh_listen, listen])?;
    let service = RouterService::start(
        core,
        dep.mesh_config(instance, &[], &[], mesh_listen, cli.link.into()),
        ServiceConfig {
            frontend_listen: listen,
            frontend: FrontendConfig {
                server_rank: instance,
                ..frontend_config(&dep)
            },
            max_outstanding_per_client: 32,
        },
    )
    .map_err(|e| anyhow!("{e}"))?;
    println!(
        "expertmesh router {instance} of {}: model {} on {} devices; frontends connect to {}, workers to {}",
        dep.router_count(),
        dep.spec.name,
        dep.topology.devices().len(),
        service.frontend_addr(),
        service
            .mesh_addr()
            .map_or_else(|| "?".into(), |a| a.to_string())
    );
    let observers = crate::observe::start(&cli.observe, &[&service], &dep.spec)?;
    wait_for_ctrl_c()?;
    drop(observers);
    drop(service);
    Ok(ExitCode::SUCCESS)
}

fn wait_for_ctrl_c() -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(tokio::signal::ctrl_c())
        .context("waiting for Ctrl-C")?;
    Ok(())
}

/// `expertmesh up`.
#[derive(Args, Debug)]
pub struct UpCli {
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
    #[arg(long, value_enum, default_value_t = LinkArg::Tcp)]
    link: LinkArg,
    #[command(flatten)]
    router: RouterArgs,
    #[command(flatten)]
    observe: crate::observe::ObserveArgs,
    /// Cluster master key (`expertmesh keys init`): `up` issues each router, worker and the
    /// printed frontend its own credentials (authenticated, encrypted links). Without it the
    /// fabric runs unauthenticated and unencrypted (loopback only, unless --insecure).
    #[arg(long)]
    key: Option<PathBuf>,
    /// Run without a key on non-loopback addresses (unauthenticated, unencrypted).
    #[arg(long)]
    insecure: bool,
}

/// Run `expertmesh up` until interrupted; restarts workers that exit.
pub fn up(cli: UpCli) -> anyhow::Result<ExitCode> {
    let model = cli.model.clone().unwrap_or_default();
    let (placement, _tmp) = match (&cli.weights, cli.placement) {
        (Some(w), _) => (w.join("placement.toml"), None),
        (None, Some(p)) => (p, None),
        (None, None) => crate::plan_default::balanced_placement_file(&cli.topology, &model)?,
    };
    let mut opts = LocalFabricOptions::new(&cli.topology, &model, &placement);
    opts.seed = cli.seed;
    opts.weights = cli.weights.clone();
    opts.link = cli.link.into();
    opts.router = cli.router.config();
    let worker_metrics = crate::observe::up_worker_addrs(&cli.observe, &cli.topology)?;
    opts.worker_metrics = worker_metrics.clone();
    opts.key = cli.key.clone();
    opts.insecure = cli.insecure;
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
            crate::keys_cmd::check_security(dep.credentials.as_deref(), cli.insecure, &exposed)?;
        }
    }
    eprintln!(
        "expertmesh up: starting the router(s) and the workers; waiting for them to connect..."
    );
    let mut fabric = LocalFabric::start(opts)?;
    let dep = fabric.deployment();
    println!(
        "expertmesh up: model {} on {} ({} workers over {}), {} mode",
        dep.spec.name,
        dep.topology.name(),
        dep.topology.devices().len(),
        LinkKind::from(cli.link).name(),
        LayerMode::from(cli.router.mode_or(ModeArg::Serving)).name()
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
    let _observers = crate::observe::start_up(&cli.observe, &fabric, &worker_metrics)?;
    println!("Ctrl-C to stop.");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    loop {
        let stop = rt.block_on(async {
            tokio::select! {
                r = tokio::signal::ctrl_c() => { r.ok(); true }
                _ = tokio::time::sleep(Duration::from_millis(500)) => false,
            }
        });
        if stop {
            break;
        }
        for (d, status) in fabric.exited_workers() {
            let name = fabric.deployment().device_label(DeviceRank(d as u32));
            eprintln!("worker {name} exited ({status}); restarting");
            if let Err(e) = fabric.restart_worker(d) {
                eprintln!("restart failed: {e:#}");
            }
        }
    }
    println!("stopping");
    fabric.shutdown();
    Ok(ExitCode::SUCCESS)
}

/// The input format and a NumPy recipe, shown by `expertmesh infer --help` (and the README).
const INFER_HELP: &str = "\
Input: a 2-D .npy of hidden states [tokens, hidden]: float32, float16, or bf16 bits stored as
uint16 (float64 is accepted and converted to float32). hidden is the model's hidden size
(`expertmesh models` lists it; 1024 for demo-small, and `expertmesh up` prints it). A request
carries at most the router's --max-tokens tokens (256 by default): split larger inputs.

Make one with NumPy:
  import numpy as np
  x = np.random.randn(4, 1024).astype(np.float32)   # [tokens, hidden]
  np.save(\"x.npy\", x)

Then: expertmesh infer --router 127.0.0.1:47400 --cluster single-host --layer 1 \\
        --input x.npy --output y.npy";

/// `expertmesh infer`.
#[derive(Args, Debug)]
#[command(after_help = INFER_HELP)]
pub struct InferCli {
    /// Router frontend address, HOST:PORT (a host name or an IP address). Give the routers of
    /// one fabric (repeat --router, or separate with commas) to fail over between them: when
    /// the router in use is lost or stops answering, the request goes to the next.
    #[arg(long, required = true, value_delimiter = ',')]
    router: Vec<String>,
    /// Cluster name (the topology's `name`), checked in the handshake.
    #[arg(long, default_value = "single-host")]
    cluster: String,
    /// MoE layer index.
    #[arg(long)]
    layer: u32,
    /// Hidden states, 2-D [tokens, hidden]: f32, f16 or bf16 bits as uint16 (f64 is converted
    /// to f32). See below for how to make one.
    #[arg(long)]
    input: PathBuf,
    /// Where to write the output [tokens, hidden] (f32).
    #[arg(long)]
    output: PathBuf,
    /// Optional router logits [tokens, experts] (f32).
    #[arg(long)]
    logits: Option<PathBuf>,
    /// Deadline in milliseconds: the router gives up then, and so does this client whatever
    /// the router does (exit 1, DeadlineExceeded). Default: the router's own, and 30 s here.
    #[arg(long)]
    deadline_ms: Option<u64>,
    #[command(flatten)]
    security: crate::keys_cmd::SecurityArgs,
}

/// Run `expertmesh infer`: exit 0 with the output written, 1 when the router refused the
/// request (its reason printed), 2 on usage and I/O errors.
///
/// Order: the input's header (dtype, shape), then the router is asked whether it accepts that
/// shape (layer, hidden size, its per-request token limit), and only then is the data read, so
/// an input that can never be sent is refused at once, however large.
pub fn infer(cli: InferCli) -> anyhow::Result<ExitCode> {
    use crate::npy::{self, NpyDtype};
    let head = npy::read_header(&cli.input).map_err(|e| anyhow!("{e}"))?;
    if let Some(p) = &cli.logits {
        let l = npy::read_header(p).map_err(|e| anyhow!("{e}"))?;
        if l.rows != head.rows {
            bail!(
                "{}: {} rows of logits for {} tokens",
                p.display(),
                l.rows,
                head.rows
            );
        }
    }
    let dtype = match head.dtype {
        NpyDtype::F32 | NpyDtype::F64 => ActivationDtype::F32,
        NpyDtype::F16 => ActivationDtype::F16,
        NpyDtype::Bf16Bits => ActivationDtype::Bf16,
    };
    let mut addrs: Vec<SocketAddr> = Vec::new();
    for r in &cli.router {
        for a in resolve_all(r.trim()).map_err(|e| anyhow!("--router: {e}"))? {
            if !addrs.contains(&a) {
                addrs.push(a);
            }
        }
    }
    let mut cfg = FrontendConfig::new(cli.cluster.clone());
    cfg.credentials = cli.security.frontend(&cli.cluster, &addrs)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let checked = rt.block_on(async {
        let opts = ClientOptions::default();
        let mut client = RouterClient::connect_any(&addrs, &cfg, opts).await?;
        client.check_shape(cli.layer, head.rows, head.cols).await?;
        Ok(client)
    });
    let mut client = match checked {
        Ok(c) => c,
        Err(e) => return client_failure(e),
    };
    let frame_limit = cfg.codec.max_frame_bytes as u64;
    let bytes = dtype
        .payload_bytes(head.rows, head.cols)
        .unwrap_or(u64::MAX);
    if bytes > frame_limit {
        let per_token = (bytes / head.rows.max(1) as u64).max(1);
        eprintln!(
            "error: {}: {} tokens are {bytes} bytes as {}, more than one request frame carries ({frame_limit} bytes); split the input into requests of at most {} tokens",
            cli.input.display(),
            head.rows,
            dtype.name(),
            frame_limit / per_token
        );
        return Ok(ExitCode::from(crate::cli::EXIT_INVALID));
    }
    let x = npy::read(&cli.input).map_err(|e| anyhow!("{e}"))?;
    if x.dtype == NpyDtype::F64 {
        eprintln!(
            "note: {} is float64; converted to float32 (save float32, float16 or bf16 bits as uint16 to skip the conversion)",
            cli.input.display()
        );
    }
    let logits = match &cli.logits {
        Some(p) => Some(npy::read(p).map_err(|e| anyhow!("{e}"))?.data),
        None => None,
    };
    let result = rt.block_on(client.call_as(
        cli.layer,
        &x.data,
        x.cols,
        dtype,
        logits.as_deref(),
        cli.deadline_ms.map(Duration::from_millis),
    ));
    match result {
        Ok(out) => {
            npy::write(&cli.output, x.rows, x.cols, &out, NpyDtype::F32)
                .map_err(|e| anyhow!("{e}"))?;
            println!(
                "wrote {} ({} x {} f32)",
                cli.output.display(),
                x.rows,
                x.cols
            );
            Ok(ExitCode::SUCCESS)
        }
        Err(e) => client_failure(e),
    }
}

/// A failed call: exit 1 with the router's reason when it refused the request, else an error
/// (exit 2) said once, with a hint when nothing listens there.
fn client_failure(e: ClientError) -> anyhow::Result<ExitCode> {
    match e {
        ClientError::Server { .. } | ClientError::Deadline { .. } => {
            eprintln!("error: {e}");
            Ok(ExitCode::from(crate::cli::EXIT_INVALID))
        }
        ClientError::Transport(FrontendError::Io { ref source, .. })
            if matches!(
                source.kind(),
                std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::NotConnected
            ) =>
        {
            Err(anyhow!(
                "{e}; is the router running (`expertmesh up` or `expertmesh router`), and is this its frontend port?"
            ))
        }
        e => Err(anyhow!("{e}")),
    }
}
