//! Argument groups and value parsers that several commands share: a deployment's files, the
//! router's tuning, credentials, observers, and the parsers that turn words into the domain
//! types (`LayerMode`, `LinkKind`, `BackendChoice`, addresses).
//!
//! Why this exists: `worker`, `router`, `up`, `infer`, `demo` and `bench` must spell the same
//! option the same way with the same help, and the command line must not grow mirror enums of
//! the library's types: each parser lists the type's own names (its `FromStr`) with help for
//! each value.

use anyhow::bail;
use clap::Args;
use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser};
use expertmesh_fabric::credentials::Security;
use expertmesh_fabric::observe::ObserveOptions;
use expertmesh_router::core::{LayerMode, RouterConfig};
use expertmesh_transport::dtype::ActivationDtype;
use expertmesh_transport::mesh::LinkKind;
use expertmesh_worker::deploy::Deployment;
use expertmesh_worker::process::BackendChoice;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// Longest wait a duration flag takes: a day. Larger values (and negative or NaN ones) are
/// refused before anything starts: a deadline past what the clock holds would panic later.
pub(crate) const LONGEST_WAIT_S: u64 = 86_400;

/// Parses a duration flag in seconds: a number from 0 to [`LONGEST_WAIT_S`].
pub(crate) fn parse_seconds(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if (0.0..=LONGEST_WAIT_S as f64).contains(&v) => Ok(v),
        _ => Err(format!(
            "{s:?} is not a number of seconds from 0 to {LONGEST_WAIT_S} (a day)"
        )),
    }
}

/// Parses a duration flag in seconds that must be positive: more than 0 (at least a
/// nanosecond, the clock's step) and at most [`LONGEST_WAIT_S`].
pub(crate) fn parse_positive_seconds(s: &str) -> Result<f64, String> {
    match parse_seconds(s) {
        Ok(v) if !Duration::from_secs_f64(v).is_zero() => Ok(v),
        _ => Err(format!(
            "{s:?} is not a number of seconds above 0 and at most {LONGEST_WAIT_S} (a day)"
        )),
    }
}

/// Parses `--link-timeout-s`: seconds, at least
/// [`MIN_LINK_TIMEOUT`](expertmesh_worker::deploy::MIN_LINK_TIMEOUT) and at most
/// [`LONGEST_WAIT_S`].
pub(crate) fn parse_link_timeout(s: &str) -> Result<f64, String> {
    let min = expertmesh_worker::deploy::MIN_LINK_TIMEOUT.as_secs_f64();
    match parse_seconds(s) {
        Ok(v) if v >= min => Ok(v),
        _ => Err(format!(
            "{s:?} is not a link timeout: give seconds from {min} (four heartbeats of a peer) to {LONGEST_WAIT_S}"
        )),
    }
}

/// `--link-timeout-s` of `router`, `worker` and `up`.
#[derive(Args, Debug, Clone)]
pub(crate) struct LinkTimeoutArgs {
    /// How long a mesh peer (a router, a worker, a node peer) may stay silent, in its
    /// handshake or after it, before its link is declared dead: its calls go to a replica or
    /// fail, and it is redialled. Longer rides out a peer stalled for a while (swapping,
    /// stopped); shorter notices a lost host sooner (a closed socket is noticed at once
    /// either way). Every process may have its own; heartbeats go every 500 ms
    /// whatever it is.
    #[arg(long, default_value_t = expertmesh_worker::deploy::DEFAULT_LINK_TIMEOUT.as_secs_f64(), value_name = "SECONDS", value_parser = parse_link_timeout)]
    pub(crate) link_timeout_s: f64,
}

impl LinkTimeoutArgs {
    /// The link timeout.
    pub(crate) fn duration(&self) -> Duration {
        Duration::from_secs_f64(self.link_timeout_s)
    }

    /// Sets the deployment's link timeout.
    pub(crate) fn apply(&self, dep: &mut expertmesh_worker::deploy::Deployment) {
        dep.link_timeout = self.duration();
    }
}

/// A duration flag in whole milliseconds: at most [`LONGEST_WAIT_S`] seconds.
pub(crate) fn millis_parser() -> clap::builder::RangedU64ValueParser<u64> {
    clap::value_parser!(u64).range(..=LONGEST_WAIT_S * 1000)
}

/// A duration flag in whole seconds: at most [`LONGEST_WAIT_S`].
pub(crate) fn whole_seconds_parser() -> clap::builder::RangedU64ValueParser<u64> {
    clap::value_parser!(u64).range(..=LONGEST_WAIT_S)
}

/// A `--threads` flag: from 1 to [`MAX_THREADS`](expertmesh_topology::topology::MAX_THREADS),
/// the bound a topology's `threads` has (0 and a mistyped huge count are refused by name).
pub(crate) fn threads_parser() -> clap::builder::RangedU64ValueParser<usize> {
    clap::builder::RangedU64ValueParser::<usize>::new()
        .range(1..=u64::from(expertmesh_topology::topology::MAX_THREADS))
}

/// `HOST:PORT` (a host name or an IP address), resolved ([`expertmesh_fabric::endpoint`]).
pub(crate) fn parse_endpoint(
    s: &str,
) -> Result<SocketAddr, expertmesh_fabric::endpoint::EndpointError> {
    expertmesh_fabric::endpoint::parse_endpoint(s)
}

/// What each serving mode means, for `--mode`'s help.
fn mode_help(m: LayerMode) -> &'static str {
    match m {
        LayerMode::Exact => {
            "W4A8, per-slot f32 results: bit-identical to the reference whatever the placement"
        }
        LayerMode::ExactBf16 => {
            "W4A8, per-slot results rounded to bf16: half of exact's result bytes, bits still placement-independent (the reference with bf16 expert outputs)"
        }
        LayerMode::Accurate => {
            "W4A16, f32 results pre-combined per device: within 1e-4 of the f64 reference"
        }
        LayerMode::Serving => {
            "W4A8 (q8 dispatch), results pre-combined per device and sent in bf16: the leanest wire, within the exact mode's tolerance of f64 (RMS < 2%) plus bf16 rounding"
        }
    }
}

/// `--mode`: a [`LayerMode`] by its name.
pub(crate) fn mode_parser() -> impl TypedValueParser<Value = LayerMode> {
    modes_parser(&LayerMode::ALL)
}

/// `--mode` where a command runs only some modes: a [`LayerMode`] among `modes`, by its name.
pub(crate) fn modes_parser(
    modes: &[LayerMode],
) -> impl TypedValueParser<Value = LayerMode> + use<> {
    PossibleValuesParser::new(
        modes
            .iter()
            .map(|&m| PossibleValue::new(m.name()).help(mode_help(m)))
            .collect::<Vec<_>>(),
    )
    .map(|s| s.parse::<LayerMode>().expect("a listed mode name"))
}

/// What each link kind is, for `--link`'s help.
fn link_help(l: LinkKind) -> &'static str {
    match l {
        LinkKind::Tcp => "TCP (any hosts)",
        LinkKind::Shm => {
            "shared-memory rings (same host; falls back to TCP when /dev/shm is unusable)"
        }
        LinkKind::Rdma => {
            "RDMA writes with immediate into the peer's ring (--rdma-provider: verbs for RoCE/InfiniBand, \
             build with `--features rdma`; libfabric[:PROVIDER], build with `--features libfabric`)"
        }
    }
}

/// `--link`: a [`LinkKind`] among `kinds`, by its name.
pub(crate) fn link_parser(kinds: &[LinkKind]) -> impl TypedValueParser<Value = LinkKind> + use<> {
    PossibleValuesParser::new(
        kinds
            .iter()
            .map(|&l| PossibleValue::new(l.name()).help(link_help(l)))
            .collect::<Vec<_>>(),
    )
    .map(|s| s.parse::<LinkKind>().expect("a listed link name"))
}

/// `--rdma-provider`: an [`RdmaProvider`](expertmesh_transport::rdma::RdmaProvider) by its name
/// (`verbs`, `libfabric`, `libfabric:<provider>`).
pub(crate) fn rdma_provider_parser(
    s: &str,
) -> Result<expertmesh_transport::rdma::RdmaProvider, String> {
    s.parse()
}

/// `plan --strategy`: a [`Strategy`](expertmesh_planner::Strategy) by its name.
pub(crate) fn strategy_parser() -> impl TypedValueParser<Value = expertmesh_planner::Strategy> {
    use expertmesh_planner::Strategy;
    let help = |x: Strategy| match x {
        Strategy::Auto => {
            "hierarchical when groups line up with nodes or co-selection statistics are given, else global"
        }
        Strategy::Global => "replicate and pack over all devices at once",
        Strategy::Hierarchical => "nodes first, then devices inside each node",
    };
    PossibleValuesParser::new(Strategy::ALL.map(|x| PossibleValue::new(x.name()).help(help(x))))
        .map(|s| s.parse::<Strategy>().expect("a listed strategy name"))
}

/// `plan --eplb-layers`: [`EplbLayers`](expertmesh_planner::eplb::EplbLayers) by its name.
pub(crate) fn eplb_layers_parser()
-> impl TypedValueParser<Value = expertmesh_planner::eplb::EplbLayers> {
    use expertmesh_planner::eplb::EplbLayers;
    let help = |x: EplbLayers| match x {
        EplbLayers::All => "one row per model layer (SGLang --init-expert-location)",
        EplbLayers::Moe => "one row per MoE layer (vLLM's map)",
    };
    PossibleValuesParser::new(EplbLayers::ALL.map(|x| PossibleValue::new(x.name()).help(help(x))))
        .map(|s| s.parse::<EplbLayers>().expect("a listed row choice"))
}

/// `--backend`: a [`BackendChoice`] by its name.
pub(crate) fn backend_parser() -> impl TypedValueParser<Value = BackendChoice> {
    let help = |b: BackendChoice| match b {
        BackendChoice::Auto => "HIP when available for GPU devices, else CPU",
        BackendChoice::Cpu => "CPU backend",
        BackendChoice::Hip => "HIP backend (error when unavailable)",
    };
    PossibleValuesParser::new(
        BackendChoice::ALL.map(|b| PossibleValue::new(b.name()).help(help(b))),
    )
    .map(|s| s.parse::<BackendChoice>().expect("a listed backend name"))
}

/// The files of a deployment: topology plus either a converted weights folder (`--weights`,
/// whose manifest names the model and placement) or a model and a placement (synthetic weights
/// from `--seed`).
#[derive(Args, Debug, Clone)]
pub(crate) struct DeployArgs {
    /// Topology file.
    #[arg(long)]
    pub(crate) topology: PathBuf,
    /// Converted weights folder (written by `expertmesh convert`); the model and the placement
    /// come from its manifest.
    #[arg(long, conflicts_with_all = ["model", "placement", "seed"])]
    pub(crate) weights: Option<PathBuf>,
    /// Model preset or model TOML file (synthetic weights; not with --weights).
    #[arg(long, required_unless_present = "weights")]
    pub(crate) model: Option<String>,
    /// Placement file (not with --weights).
    #[arg(long, required_unless_present = "weights")]
    pub(crate) placement: Option<PathBuf>,
    /// Seed of the synthetic expert weights (must match on every process; not with --weights).
    #[arg(long, default_value_t = 42)]
    pub(crate) seed: u64,
}

impl DeployArgs {
    /// Load the deployment these arguments describe.
    pub(crate) fn load(&self) -> anyhow::Result<Deployment> {
        match (&self.weights, &self.model, &self.placement) {
            (Some(w), _, _) => Ok(Deployment::load_converted(&self.topology, w)?),
            (None, Some(m), Some(p)) => Ok(Deployment::load(&self.topology, m, p, self.seed)?),
            _ => bail!("give --weights W, or --model and --placement"),
        }
    }
}

/// Tokens per micro-batch of a router whose `--micro-batch` is not given (`router`, `demo`).
pub(crate) const DEFAULT_MICRO_BATCH: usize = 32;

/// Router tuning shared by `router`, `up`, `demo` and `bench fabric`.
#[derive(Args, Debug, Clone)]
pub(crate) struct RouterArgs {
    /// Serving mode (numerics and result wire). Default: serving for `up` and `router`, exact
    /// for `demo` and `bench fabric`.
    #[arg(long, value_parser = mode_parser())]
    pub(crate) mode: Option<LayerMode>,
    /// How long a batch waits for more requests of the same layer, in microseconds (it goes
    /// at once when every connected frontend has a request in it).
    #[arg(long, default_value_t = 200)]
    pub(crate) batch_window_us: u64,
    /// Tokens per micro-batch: a batch is cut into parts of this many tokens, so one part's
    /// wire overlaps another's compute. Default: 32 for `router`; for `up`, whose processes
    /// share one host, the largest request that one frame carries (every micro-batch streams
    /// the experts it touches again). Workers started apart take `--max-tokens` of this size.
    #[arg(long)]
    pub(crate) micro_batch: Option<usize>,
    /// Largest request (tokens).
    #[arg(long, default_value_t = 256)]
    pub(crate) max_tokens: usize,
    /// Deadline of requests that carry none, in milliseconds.
    #[arg(long, default_value_t = 10_000, value_parser = millis_parser())]
    pub(crate) deadline_ms: u64,
    /// Longest deadline a request may ask for, in milliseconds (longer ones are cut to it).
    #[arg(long, default_value_t = 60_000, value_parser = millis_parser())]
    pub(crate) max_deadline_ms: u64,
    /// Tokens of admitted, unanswered requests, all frontends together: beyond this (or a
    /// frontend's fair share of it) requests are refused with Overloaded before their data is
    /// read.
    #[arg(long, default_value_t = 2048)]
    pub(crate) max_inflight_tokens: usize,
    /// Re-send a part to a replica after this many milliseconds without an answer.
    #[arg(long, default_value_t = 3_000, value_parser = millis_parser())]
    pub(crate) straggler_ms: u64,
    /// Most connections one frontend name may hold open to a router (0: no limit); one more
    /// is refused, saying so, so that one frontend cannot take every connection's memory.
    #[arg(long, default_value_t = expertmesh_transport::frontend::DEFAULT_MAX_CONNECTIONS_PER_FRONTEND)]
    pub(crate) max_connections_per_frontend: u32,
    /// Close a frontend connection that has neither sent a request nor been answered for this
    /// many seconds and has none in flight, or that has left an answer untaken this long (plus
    /// one per 16 MiB of it) (0: never).
    #[arg(long, default_value_t = expertmesh_transport::frontend::DEFAULT_FRONTEND_IDLE_TIMEOUT.as_secs(), value_parser = whole_seconds_parser())]
    pub(crate) frontend_idle_timeout_s: u64,
    /// Close a frontend connection that leaves a frame half sent for this many seconds (plus
    /// one per 16 MiB of the frame; 0: never): it would otherwise hold its request's share of
    /// the router's capacity while its socket is open. Each answer that a connection no longer
    /// read has not taken gets as long.
    #[arg(long, default_value_t = expertmesh_transport::frontend::DEFAULT_FRONTEND_FRAME_TIMEOUT.as_secs(), value_parser = whole_seconds_parser())]
    pub(crate) frontend_frame_timeout_s: u64,
    /// Frontend names whose connections may change the placement (`expertmesh rebalance`,
    /// `drain`); others are refused with NotPermitted. Checked where frontends are
    /// authenticated (credentials); issue the credential with `expertmesh keys issue --frontend
    /// admin`. Without credentials every connection may.
    #[arg(long, value_delimiter = ',', default_value = expertmesh_transport::frontend::DEFAULT_PLACEMENT_ADMIN)]
    pub(crate) placement_admins: Vec<String>,
}

impl RouterArgs {
    /// `--max-connections-per-frontend`, `--frontend-idle-timeout-s`,
    /// `--frontend-frame-timeout-s` and `--placement-admins`.
    pub(crate) fn frontend_limits(&self) -> expertmesh_fabric::local::FrontendLimits {
        expertmesh_fabric::local::FrontendLimits {
            max_connections_per_frontend: self.max_connections_per_frontend,
            idle_timeout: (self.frontend_idle_timeout_s > 0)
                .then(|| Duration::from_secs(self.frontend_idle_timeout_s)),
            frame_timeout: (self.frontend_frame_timeout_s > 0)
                .then(|| Duration::from_secs(self.frontend_frame_timeout_s)),
            placement_admins: self.placement_admins.clone(),
        }
    }

    /// `--mode`, or `default` when it is not given (each command has its own default).
    pub(crate) fn mode_or(&self, default: LayerMode) -> LayerMode {
        self.mode.unwrap_or(default)
    }

    /// The router configuration of `up` and `router` (serving mode unless `--mode` says).
    pub(crate) fn config(&self) -> RouterConfig {
        self.config_in(LayerMode::Serving)
    }

    /// The router configuration, in `default` mode unless `--mode` says otherwise.
    pub(crate) fn config_in(&self, default: LayerMode) -> RouterConfig {
        RouterConfig {
            mode: self.mode_or(default),
            max_request_tokens: self.max_tokens,
            max_batch_tokens: self.max_tokens,
            micro_batch_tokens: self.micro_batch.unwrap_or(DEFAULT_MICRO_BATCH).max(1),
            batch_window: Duration::from_micros(self.batch_window_us),
            default_deadline: Duration::from_millis(self.deadline_ms),
            straggler_timeout: Duration::from_millis(self.straggler_ms),
            max_inflight_batches: 64,
            max_deadline: Duration::from_millis(self.max_deadline_ms),
            max_inflight_requests: 64,
            max_inflight_tokens: self.max_inflight_tokens,
            accurate_dtype: ActivationDtype::F32,
        }
    }
}

/// `--credentials FILE` and `--insecure`, shared by `worker`, `router`, `infer`.
#[derive(Args, Debug, Clone, Default)]
pub(crate) struct SecurityArgs {
    /// This process's credential file (`expertmesh keys issue`): authenticates it as its own
    /// rank or frontend name, and encrypts every TCP link.
    #[arg(long)]
    pub(crate) credentials: Option<PathBuf>,
    /// Run without credentials on a non-loopback address: all traffic is then
    /// unauthenticated and unencrypted (without credentials only loopback is allowed).
    #[arg(long)]
    pub(crate) insecure: bool,
}

impl SecurityArgs {
    /// The launcher's view of these flags.
    pub(crate) fn security(&self) -> Security {
        Security {
            credentials: self.credentials.clone(),
            insecure: self.insecure,
        }
    }
}

/// `--metrics` alone (the worker's flag).
#[derive(Args, Debug, Clone, Default)]
pub(crate) struct MetricsArgs {
    /// Serve Prometheus metrics at http://ADDR/metrics (HOST:PORT; port 0 picks a free port,
    /// printed at start).
    #[arg(long, value_parser = parse_endpoint, value_name = "ADDR")]
    pub(crate) metrics: Option<SocketAddr>,
}

/// `--metrics` and the live load file (the router's and `up`'s flags).
#[derive(Args, Debug, Clone)]
pub(crate) struct ObserveArgs {
    /// Serve Prometheus metrics at http://ADDR/metrics (HOST:PORT; port 0 picks free ports).
    /// With `up`, router i listens on PORT+i and worker d on PORT+routers+d (all free ports
    /// when PORT is 0); every address is printed at start.
    #[arg(long, value_parser = parse_endpoint, value_name = "ADDR")]
    pub(crate) metrics: Option<SocketAddr>,
    /// Keep a live per-expert load file here, in the planner's statistics format
    /// (`expertmesh plan --load FILE` reads it; .json for JSON, else CSV): tokens routed to
    /// each expert since start (added to the counts of a file already there: a restarted
    /// router resumes it), rewritten atomically every --load-stats-every seconds and at exit.
    #[arg(long, value_name = "FILE")]
    pub(crate) load_stats: Option<PathBuf>,
    /// Seconds between rewrites of the --load-stats file.
    #[arg(long, default_value_t = 10.0, value_name = "SECONDS",
          value_parser = parse_positive_seconds)]
    pub(crate) load_stats_every: f64,
}

impl ObserveArgs {
    /// The observers these flags ask for.
    pub(crate) fn options(&self) -> ObserveOptions {
        ObserveOptions {
            metrics: self.metrics,
            load_stats: self.load_stats.clone(),
            load_stats_every: self.load_stats_every,
        }
    }
}

/// Automatic rebalancing on router 0 (`router` and `up`): off unless `--auto-rebalance-every`
/// is given.
#[derive(Args, Debug)]
pub(crate) struct AutoRebalanceArgs {
    /// Replan the placement every SECONDS from the load this router routed since the last
    /// round, and apply the new one live (no call fails) when the planner predicts at least
    /// --auto-rebalance-min-gain (the busiest device's load before / after). Router 0 only.
    #[arg(long, value_name = "SECONDS", value_parser = parse_positive_seconds)]
    pub(crate) auto_rebalance_every: Option<f64>,
    /// The predicted gain a change needs (at least 1).
    #[arg(long, default_value_t = 1.2, value_name = "RATIO")]
    pub(crate) auto_rebalance_min_gain: f64,
    /// Tokens a round needs routed before it plans anything.
    #[arg(long, default_value_t = 4096, value_name = "TOKENS")]
    pub(crate) auto_rebalance_min_tokens: u64,
    /// How long each step of an automatic change may take.
    #[arg(long, default_value_t = 600.0, value_name = "SECONDS", value_parser = parse_positive_seconds)]
    pub(crate) auto_rebalance_timeout_s: f64,
}

impl AutoRebalanceArgs {
    /// Starts the automatic rebalancing of router `instance` (`service`) of `dep`, when
    /// asked (printing that it runs).
    pub(crate) fn start(
        &self,
        instance: u32,
        service: &expertmesh_router::service::RouterService,
        dep: &Deployment,
    ) -> anyhow::Result<Option<expertmesh_fabric::auto_rebalance::AutoRebalancer>> {
        use expertmesh_fabric::auto_rebalance::{AutoOptions, AutoRebalancer};
        let Some(every) = self.auto_rebalance_every else {
            return Ok(None);
        };
        if instance != 0 {
            bail!(
                "--auto-rebalance-every: router {instance} does not coordinate placement changes; \
                 give it to router 0"
            );
        }
        // Both flags were parsed positive and at most a day (`parse_positive_seconds`).
        let opts = AutoOptions {
            every: Duration::from_secs_f64(every),
            min_gain: self.auto_rebalance_min_gain,
            min_tokens: self.auto_rebalance_min_tokens,
            timeout: Duration::from_secs_f64(self.auto_rebalance_timeout_s),
        };
        let auto = AutoRebalancer::start(
            opts,
            service.placement_handle(),
            std::sync::Arc::clone(service.metrics()),
            dep.topology.clone(),
            dep.spec.clone(),
            dep.placement.clone(),
        )?;
        println!(
            "  automatic rebalancing: every {every} s, when the predicted gain reaches {} ({} tokens routed at least)",
            self.auto_rebalance_min_gain, self.auto_rebalance_min_tokens
        );
        Ok(Some(auto))
    }
}
