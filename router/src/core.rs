//! The router core: a sans-IO state machine from frontend requests to combined layer outputs.
//!
//! Why this exists: everything the router decides — batching requests that arrive close
//! together, gating, splitting a batch into micro-batches, planning destinations, choosing
//! replicas, re-dispatching the share of a dead or straggling device, enforcing deadlines and
//! combining results in a fixed order — lives here, with no sockets, threads or clocks. The
//! service ([`crate::service`]) feeds it requests, worker frames, peer notices and the current
//! time, and carries out the [`Action`]s it returns. Tests drive it with simulated workers.
//!
//! Numerics: the serving mode ([`LayerMode`]: the kernels' [`ComputeMode`] and the
//! [`ResultWire`]) decides what workers send back. With per-slot results (exact, exact-bf16)
//! workers return one row per (token, slot) and [`RouterCore`] sums them in slot order
//! (`acc = acc + w·y`, then the shared experts), the contract's §5, so outputs are
//! bit-identical to the in-process reference (for exact-bf16: the reference whose expert
//! outputs are rounded to bf16) whatever the placement or replica choice. With pre-combined
//! results (accurate, serving) each worker sums its own slots per token and the router adds the
//! devices' partial sums in part order: fewer bytes, bits that depend on the placement, within
//! a stated tolerance of the f64 reference.
//!
//! Batching: a layer's pending batch is dispatched when its window closes, when it is full, or
//! as soon as every connected frontend ([`RouterCore::set_frontends`]) has a request in it —
//! nobody else can join, so waiting longer only adds latency.
//!
//! Bounds: at most `max_inflight_batches` batches are in flight (beyond that new requests are
//! refused with `Overloaded`), each batch holds at most `max_batch_tokens` tokens, and every
//! batch has a deadline after which its requests fail with an error naming the devices that did
//! not answer.

use crate::gating::{self, GateWeights, Routing};
use crate::health::{Health, HealthEvent, HedgePolicy};
use crate::plan::{self, DevicePlan, LayerOwners, PlanError, Replicas};
use bytes::Bytes;
use expertmesh_backend::BackendError;
use expertmesh_quant::contract::{self, ComputeMode};
use expertmesh_topology::model::ModelSpec;
use expertmesh_transport::codec::{
    Body, Dispatch, ErrorCode, ExpertResult, LayerRequest, OutputLayout as WireLayout, WireFormat,
};
use expertmesh_transport::dtype::{self, ActivationDtype, OutputDtype};
use expertmesh_transport::mesh::OutFrame;
use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

/// Identifies a frontend connection to the driver.
pub type ClientId = u64;

/// Router settings.
#[derive(Clone, Debug)]
pub struct RouterConfig {
    /// Numerical contract of every layer call.
    pub mode: ComputeMode,
    /// Largest request accepted (tokens).
    pub max_request_tokens: usize,
    /// Largest merged batch (tokens).
    pub max_batch_tokens: usize,
    /// Tokens per micro-batch: a batch is split so the first parts compute while later ones
    /// are still on the wire.
    pub micro_batch_tokens: usize,
    /// How long a batch waits for more requests of the same layer (0: dispatch at once).
    pub batch_window: Duration,
    /// Deadline of requests that do not carry one.
    pub default_deadline: Duration,
    /// A part unanswered this long is re-sent to a replica when one exists.
    pub straggler_timeout: Duration,
    /// Batches in flight at most; beyond this requests are refused (`Overloaded`).
    pub max_inflight_batches: usize,
    /// The longest deadline a request may ask for: a longer one (`deadline_us = u64::MAX`
    /// included) is cut to this.
    pub max_deadline: Duration,
    /// Requests admitted and not yet answered, all frontend connections together. The service
    /// decides from each request's header, before its payload is read: beyond this, or beyond
    /// the connection's fair share, the request is refused with `Overloaded`.
    pub max_inflight_requests: usize,
    /// Tokens of the requests admitted and not yet answered, all connections together (the
    /// router's memory for requests grows with this).
    pub max_inflight_tokens: usize,
    /// Dispatch encoding in accurate mode (exact mode always sends `q8-block32`, which is
    /// lossless for it).
    pub accurate_dtype: ActivationDtype,
    /// What workers send back and who combines it ([`LayerMode`] names the useful pairs of
    /// `mode` and `results`).
    pub results: ResultWire,
}

/// What a worker sends back for its share of a layer call, and who combines it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ResultWire {
    /// The compute mode's full-precision wire: in exact mode one f32 row per (token, slot),
    /// combined on the router in slot order (placement-independent bits); in accurate mode one
    /// f32 row per (device, token), pre-combined on the worker.
    #[default]
    Full,
    /// One row per (token, slot), each expert output (routed and shared) rounded to bf16 as GPU
    /// MoE kernels emit it, combined on the router in slot order in f32: half the result bytes
    /// of exact mode and still placement-independent (bit-identical to
    /// `reference::moe_layer_backend_rounded` with bf16 rounding).
    SlotsBf16,
    /// One row per (device, token): the worker sums its slots in slot order in f32 and rounds
    /// the sum to bf16; the router adds the devices' rows in part order. The fewest bytes (a
    /// token's result crosses the wire once per device, 2 bytes a value); the bits depend on
    /// which experts share a device.
    CombinedBf16,
}

/// The serving modes: a kernel contract and a result wire, by name (`--mode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LayerMode {
    /// W4A8 kernels, per-slot f32 results: bit-identical to the exact reference whatever the
    /// placement (the demo and the bit-exact tests use it).
    Exact,
    /// W4A8 kernels, per-slot results rounded to bf16: half of exact's result bytes, bits still
    /// independent of the placement (the reference with every expert output rounded to bf16).
    ExactBf16,
    /// W4A16 kernels, f32 results pre-combined per (device, token): within 1e-4 of the output
    /// RMS of the f64 reference.
    Accurate,
    /// W4A8 kernels (q8 dispatch), results pre-combined per (device, token) on the worker and
    /// sent in bf16: the leanest wire, within the exact mode's tolerance of the f64 reference
    /// plus bf16 rounding of each device's partial sum; the default of `up` and `router`.
    Serving,
}

impl LayerMode {
    /// Every mode, in the order reports list them.
    pub const ALL: [LayerMode; 4] = [
        LayerMode::Exact,
        LayerMode::ExactBf16,
        LayerMode::Accurate,
        LayerMode::Serving,
    ];

    /// The kernels' numerical contract.
    pub fn compute(self) -> ComputeMode {
        match self {
            Self::Accurate => ComputeMode::Accurate,
            _ => ComputeMode::Exact,
        }
    }

    /// The result wire.
    pub fn results(self) -> ResultWire {
        match self {
            Self::Exact | Self::Accurate => ResultWire::Full,
            Self::ExactBf16 => ResultWire::SlotsBf16,
            Self::Serving => ResultWire::CombinedBf16,
        }
    }

    /// The name on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Self::Exact => "exact",
            Self::ExactBf16 => "exact-bf16",
            Self::Accurate => "accurate",
            Self::Serving => "serving",
        }
    }

    /// Whether the outputs' bits are independent of the placement and replica choice.
    pub fn placement_independent(self) -> bool {
        matches!(self, Self::Exact | Self::ExactBf16)
    }

    /// `cfg` with this mode's kernel contract and result wire.
    pub fn apply(self, cfg: RouterConfig) -> RouterConfig {
        RouterConfig {
            mode: self.compute(),
            results: self.results(),
            ..cfg
        }
    }
}

/// A serving mode name that is not one of [`LayerMode::ALL`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown mode {0:?}: give exact, exact-bf16, accurate or serving")]
pub struct UnknownLayerMode(pub String);

impl std::str::FromStr for LayerMode {
    type Err = UnknownLayerMode;

    /// The mode named `s` ([`LayerMode::name`]; case-insensitive, `_` for `-` accepted).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let want = s.trim().replace('_', "-");
        Self::ALL
            .into_iter()
            .find(|m| m.name().eq_ignore_ascii_case(&want))
            .ok_or_else(|| UnknownLayerMode(s.to_owned()))
    }
}

impl std::fmt::Display for LayerMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl RouterConfig {
    /// The named mode of `mode` and `results`, when they form one.
    pub fn layer_mode(&self) -> Option<LayerMode> {
        LayerMode::ALL
            .into_iter()
            .find(|m| m.compute() == self.mode && m.results() == self.results)
    }

    /// What a dispatch and its result look like on the wire in this configuration (feed it to
    /// `codec::wire_bytes_per_token` for the bytes per token).
    pub fn wire_format(&self) -> WireFormat {
        let per_slot = match self.results {
            ResultWire::Full => self.mode == ComputeMode::Exact,
            ResultWire::SlotsBf16 => true,
            ResultWire::CombinedBf16 => false,
        };
        WireFormat {
            dispatch: match self.mode {
                ComputeMode::Exact => ActivationDtype::Q8Block32,
                ComputeMode::Accurate => self.accurate_dtype,
            },
            layout: if per_slot {
                WireLayout::PerSlot
            } else {
                WireLayout::PreCombined
            },
            result: match self.results {
                ResultWire::Full => OutputDtype::F32,
                ResultWire::SlotsBf16 | ResultWire::CombinedBf16 => OutputDtype::Bf16,
            },
        }
    }
}

/// Default [`RouterConfig::max_deadline`]: one minute.
pub const DEFAULT_MAX_DEADLINE: Duration = Duration::from_secs(60);

impl Default for RouterConfig {
    fn default() -> Self {
        Self {
            mode: ComputeMode::Exact,
            max_request_tokens: 256,
            max_batch_tokens: 256,
            micro_batch_tokens: 32,
            batch_window: Duration::from_micros(200),
            default_deadline: Duration::from_secs(10),
            straggler_timeout: Duration::from_secs(3),
            max_inflight_batches: 64,
            max_deadline: DEFAULT_MAX_DEADLINE,
            max_inflight_requests: 64,
            max_inflight_tokens: 2048,
            accurate_dtype: ActivationDtype::F32,
            results: ResultWire::Full,
        }
    }
}

/// Where a layer's shared experts run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SharedSite {
    /// The model has no shared experts.
    None,
    /// On the router host ([`SharedRunner`]).
    Router,
    /// On the worker with this mesh rank (dispatched as extra slots with weight 1).
    Rank(u32),
}

/// Everything the router knows about one MoE layer.
#[derive(Clone, Debug)]
pub struct LayerSetup {
    /// Layer index.
    pub layer: u32,
    /// Gate weights and selection bias.
    pub gate: GateWeights,
    /// Owners of each routed expert, as mesh ranks.
    pub owners: LayerOwners,
    /// Where the shared experts run.
    pub shared: SharedSite,
}

/// Runs shared experts on the router host (the CPU backend in the service; a stub in tests).
pub trait SharedRunner: Send {
    /// Write `[tokens][shared][hidden]` outputs of `layer`'s shared experts for `x`
    /// (`[tokens][hidden]`) into `out`, computed in `mode`.
    fn run(
        &mut self,
        layer: u32,
        x: &[f32],
        tokens: usize,
        mode: ComputeMode,
        out: &mut [f32],
    ) -> Result<(), BackendError>;
}

/// Checks and decodes frontend requests: a cheap clone of what the core knows about shapes.
#[derive(Clone, Debug)]
pub struct RequestValidator {
    spec: ModelSpec,
    layers: Vec<u32>,
    max_request_tokens: usize,
    default_deadline: Duration,
    max_deadline: Duration,
    /// Where refusals are counted ([`RequestValidator::metrics`]).
    metrics: std::sync::Arc<crate::metrics::RouterMetrics>,
}

/// The end of the message refusing a non-finite hidden state: the refusal that comes after every
/// shape check passed (`RouterClient::check_shape` relies on that order).
pub const NON_FINITE_INPUT: &str = "inputs must be finite";

/// Why a frontend request was refused: the code and message of its error frame.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{code:?}: {message}")]
pub struct Rejection {
    /// Stable error code.
    pub code: ErrorCode,
    /// What is wrong and what to do.
    pub message: String,
}

fn reject<T>(code: ErrorCode, message: String) -> Result<T, Rejection> {
    Err(Rejection { code, message })
}

impl RequestValidator {
    /// The router's metrics, where the service counts the requests it refuses.
    pub fn metrics(&self) -> &crate::metrics::RouterMetrics {
        &self.metrics
    }

    /// Validate a frontend `LayerRequest` and decode its payload, or say what is wrong.
    pub fn validate(
        &self,
        client: ClientId,
        req: &LayerRequest,
        payload: &[u8],
        now: Instant,
    ) -> Result<Request, Rejection> {
        self.check_shape(req)?;
        let (t, h) = (req.tokens as usize, self.spec.hidden as usize);
        let range = req.hidden_range();
        let logits_end = req.logits_range().map_or(range.end, |r| r.end);
        if payload.len() < logits_end {
            let msg = format!(
                "payload has {} bytes, the request describes {logits_end}",
                payload.len()
            );
            return reject(ErrorCode::BadFrame, msg);
        }
        // One copy in: the payload is decoded once, into the buffer the batch will use.
        let mut x = vec![0f32; t * h];
        if let Err(e) = dtype::decode_activations(req.dtype, t, h, &payload[range], &mut x) {
            return reject(ErrorCode::InvalidInput, e.to_string());
        }
        if let Some(i) = x.iter().position(|v| !v.is_finite()) {
            let msg = format!(
                "hidden state of token {} element {} is {}; {NON_FINITE_INPUT}",
                i / h,
                i % h,
                x[i]
            );
            return reject(ErrorCode::InvalidInput, msg);
        }
        let logits = match req.logits_range() {
            None => None,
            Some(r) => Some(self.decode_logits(req, &payload[r])?),
        };
        let deadline = now + self.deadline_of(req);
        Ok(Request {
            client,
            request_id: req.request_id,
            layer: req.layer,
            tokens: t,
            x,
            logits,
            deadline,
        })
    }

    /// How long `req` may take: its own deadline (or the default when it gives none), cut to
    /// the router's maximum.
    pub fn deadline_of(&self, req: &LayerRequest) -> Duration {
        let asked = match req.deadline_us {
            0 => self.default_deadline,
            us => Duration::from_micros(us),
        };
        asked.min(self.max_deadline)
    }

    /// The checks a request's metadata alone allows (layer, hidden size, token count, dtype),
    /// made before its payload is read.
    pub fn check(&self, req: &LayerRequest) -> Result<(), Rejection> {
        self.check_shape(req)
    }

    /// Layer, hidden size, token count and dtype against what this router serves.
    fn check_shape(&self, req: &LayerRequest) -> Result<(), Rejection> {
        let spec = &self.spec;
        if self.layers.binary_search(&req.layer).is_err() {
            let l = &self.layers;
            let what = if req.layer < spec.num_layers && !spec.is_moe_layer(req.layer) {
                "a dense layer (its MLP is not a mixture of experts: run it in the frontend)"
            } else if req.layer < spec.num_layers {
                "a MoE layer this router does not serve"
            } else {
                "past the model's last layer"
            };
            let msg = format!(
                "layer {} of model {} is {what}; the router serves MoE layers {}..={} (decoder layer indices)",
                req.layer,
                spec.name,
                l.first().copied().unwrap_or(0),
                l.last().copied().unwrap_or(0)
            );
            return reject(ErrorCode::NotFound, msg);
        }
        if req.hidden != spec.hidden {
            let msg = format!(
                "hidden size {} does not match model {} (hidden {})",
                req.hidden, spec.name, spec.hidden
            );
            return reject(ErrorCode::InvalidInput, msg);
        }
        let t = req.tokens as usize;
        if t == 0 || t > self.max_request_tokens {
            let msg = format!(
                "{t} tokens: a request carries 1 to {} tokens; split larger batches",
                self.max_request_tokens
            );
            return reject(ErrorCode::InvalidInput, msg);
        }
        if req.dtype == ActivationDtype::Q8Block32 {
            let msg = "q8-block32 is a worker dispatch format; send hidden states as f32, bf16, f16 or fp8";
            return reject(ErrorCode::Unsupported, msg.into());
        }
        Ok(())
    }

    /// The frontend's router logits `[tokens][experts]` (f32 little-endian), checked finite.
    fn decode_logits(&self, req: &LayerRequest, bytes: &[u8]) -> Result<Vec<f32>, Rejection> {
        let spec = &self.spec;
        if req.logit_experts != spec.routed_experts {
            let msg = format!(
                "router logits have {} columns but model {} has {} routed experts",
                req.logit_experts, spec.name, spec.routed_experts
            );
            return reject(ErrorCode::InvalidInput, msg);
        }
        let l: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        if let Some(i) = l.iter().position(|v| !v.is_finite()) {
            let e = spec.routed_experts as usize;
            let msg = format!(
                "router logit of token {} expert {} is {}; logits must be finite",
                i / e,
                i % e,
                l[i]
            );
            return reject(ErrorCode::InvalidInput, msg);
        }
        Ok(l)
    }
}

/// A validated frontend request.
#[derive(Clone, Debug)]
pub struct Request {
    /// The connection it came from.
    pub client: ClientId,
    /// The client's request id.
    pub request_id: u64,
    /// MoE layer.
    pub layer: u32,
    /// Number of tokens.
    pub tokens: usize,
    /// Hidden states `[tokens][hidden]`.
    pub x: Vec<f32>,
    /// Router logits `[tokens][experts]`, when the frontend computed them.
    pub logits: Option<Vec<f32>>,
    /// When it must be answered.
    pub deadline: Instant,
}

/// What the driver must do.
#[derive(Debug)]
pub enum Action {
    /// Send a frame to a worker.
    Send {
        /// Destination mesh rank.
        rank: u32,
        /// The frame.
        frame: OutFrame,
        /// Batch and part, for reporting a failed send back via [`RouterCore::on_send_failed`].
        batch: u64,
        /// Part id (the frame's micro-batch field).
        part: u32,
    },
    /// Answer a request.
    Respond {
        /// Connection.
        client: ClientId,
        /// Request id.
        request_id: u64,
        /// Tokens.
        tokens: usize,
        /// Output `[tokens][hidden]`.
        output: Vec<f32>,
    },
    /// Fail a request.
    Fail {
        /// Connection.
        client: ClientId,
        /// Request id.
        request_id: u64,
        /// Stable error code.
        code: ErrorCode,
        /// What went wrong and what to do.
        message: String,
    },
}

/// Counters for reports and metrics.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RouterStats {
    /// Requests answered with an output.
    pub responses: u64,
    /// Requests failed.
    pub failures: u64,
    /// Batches dispatched.
    pub batches: u64,
    /// Parts (per-device frames) sent.
    pub parts_sent: u64,
    /// Parts re-sent to a replica after a failure or timeout.
    pub parts_redispatched: u64,
    /// Activation payload bytes sent to workers.
    pub dispatch_payload_bytes: u64,
    /// Result payload bytes received from workers.
    pub result_payload_bytes: u64,
    /// Tokens answered.
    pub tokens: u64,
    /// Worker links the core has seen come up (it counts a device live from then on).
    pub peer_ups: u64,
    /// Result and error frames dropped because their batch id carries another router
    /// incarnation: work dispatched by an earlier router process on this rank.
    pub stale_results: u64,
    /// Parts re-sent to a replica because their device had not answered within its hedge
    /// timeout.
    pub hedges: u64,
    /// Times a device was taken out of replica choice (quarantined).
    pub quarantines: u64,
    /// Times a quarantined device answered its probe in time and came back.
    pub quarantine_releases: u64,
    /// Probes sent (a live part mirrored to a device whose quarantine ran out).
    pub probes: u64,
}

/// Why a part is sent again, and where to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Resend {
    /// Its device was lost or a send to it failed: to other owners.
    Lost,
    /// Its device has not answered in time: to other owners, and only when another live owner
    /// exists for all its experts (the device stays alive).
    Straggler,
    /// Its node's leader could not reach a node peer: to the devices themselves, without
    /// per-node dedup.
    WithoutDedup,
}

struct Member {
    client: ClientId,
    request_id: u64,
    offset: usize,
    tokens: usize,
    /// The request's own deadline: past it, it fails alone and its answer is discarded.
    deadline: Instant,
    /// Failed at its own deadline while the rest of its batch goes on.
    expired: bool,
}

struct Pending {
    members: Vec<Member>,
    /// `[tokens][hidden]`: the first request's buffer, moved in; later requests appended.
    x: Vec<f32>,
    /// `[tokens][experts]`: the frontend's logits where it sent them (zeros elsewhere).
    logits: Vec<f32>,
    /// Per token, whether `logits` holds the frontend's row.
    logits_given: Vec<bool>,
    /// The distinct frontend connections with a request in this batch.
    clients: Vec<ClientId>,
    flush_at: Instant,
    /// The latest of the members' deadlines (each member fails alone at its own).
    deadline: Instant,
}

struct Part {
    rank: u32,
    plan: DevicePlan,
    sent_at: Instant,
    /// When the part is hedged if still unanswered (without another owner: looked at again).
    hedge_at: Instant,
    /// Its device has been charged with a straggle for it (once per part).
    straggled: bool,
    live: bool,
}

struct Inflight {
    layer: u32,
    tokens: usize,
    members: Vec<Member>,
    deadline: Instant,
    /// Routing with the remote shared experts appended as extra slots (weight 1).
    routing: Routing,
    x: Vec<f32>,
    /// Exact mode: the input quantized once per contract §1 (codes, scales).
    q8: Option<(Vec<i8>, Vec<f32>)>,
    /// Per-slot results: `[tokens][slots][hidden]` rows.
    slot_rows: Vec<f32>,
    /// Pre-combined results: per part id, (tokens, rows `[tokens][hidden]`).
    partials: BTreeMap<u32, (Vec<u32>, Vec<f32>)>,
    /// Shared experts computed on the router, `[tokens][shared][hidden]`.
    shared_local: Vec<f32>,
    /// The router-side shared experts are still to run.
    shared_pending: bool,
    /// Per token, the weight of the shared experts' output (empty: weight 1).
    shared_weights: Vec<f32>,
    parts: Vec<Part>,
    outstanding: usize,
}

/// The router state machine. See the module docs.
pub struct RouterCore {
    spec: ModelSpec,
    cfg: RouterConfig,
    /// `cfg.wire_format()`, once.
    wire: WireFormat,
    /// Frontend connections open now, when the driver reports them ([`Self::set_frontends`]).
    frontends: Option<usize>,
    layers: HashMap<u32, LayerSetup>,
    /// Owners extended with the shared experts' pseudo-ids (`E + i`) per layer.
    owners_ext: HashMap<u32, LayerOwners>,
    replicas: Replicas,
    rank_names: Vec<String>,
    shared_runner: Option<Box<dyn SharedRunner>>,
    pending: BTreeMap<u32, Pending>,
    inflight: BTreeMap<u64, Inflight>,
    /// Sequence number of the next batch (the low 32 bits of its id).
    next_batch: u64,
    /// This core's incarnation: the high 32 bits of every batch id it issues.
    incarnation: u32,
    /// Latency estimates (hedge timeouts) and quarantine of every rank.
    health: Health,
    /// Per quarantined rank with a probe out: the probe's layer and expected result rows.
    probes: HashMap<u32, (u32, usize)>,
    /// When a stale result was last logged at warn level (rate limit).
    last_stale_warn: Option<Instant>,
    actions: Vec<Action>,
    stats: RouterStats,
    /// Prometheus figures ([`crate::metrics`]).
    metrics: crate::metrics::CoreMetrics,
}

impl RouterCore {
    /// A router for `spec` over `layers`. `rank_names[r]` names mesh rank `r` in messages;
    /// `replicas` carries node locality and starts with every worker considered alive.
    pub fn new(
        spec: ModelSpec,
        cfg: RouterConfig,
        layers: Vec<LayerSetup>,
        replicas: Replicas,
        rank_names: Vec<String>,
        shared_runner: Option<Box<dyn SharedRunner>>,
    ) -> Self {
        let e = spec.routed_experts;
        let mut owners_ext = HashMap::new();
        for l in &layers {
            let mut o = l.owners.clone();
            if let SharedSite::Rank(r) = l.shared {
                for _ in 0..spec.shared_experts {
                    o.owners.push(vec![r]);
                }
            }
            debug_assert_eq!(l.owners.owners.len(), e as usize);
            owners_ext.insert(l.layer, o);
        }
        let layer_ids: Vec<u32> = layers.iter().map(|l| l.layer).collect();
        let metrics = crate::metrics::CoreMetrics::new(&layer_ids, e as usize, &rank_names);
        let health = Health::new(
            replicas.alive.len(),
            cfg.straggler_timeout,
            HedgePolicy::default(),
        );
        Self {
            spec,
            wire: cfg.wire_format(),
            frontends: None,
            cfg,
            layers: layers.into_iter().map(|l| (l.layer, l)).collect(),
            owners_ext,
            replicas,
            rank_names,
            shared_runner,
            pending: BTreeMap::new(),
            inflight: BTreeMap::new(),
            next_batch: 1,
            incarnation: fresh_incarnation(),
            health,
            probes: HashMap::new(),
            last_stale_warn: None,
            actions: Vec::new(),
            stats: RouterStats::default(),
            metrics,
        }
    }

    /// The model served.
    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    /// Settings.
    pub fn config(&self) -> &RouterConfig {
        &self.cfg
    }

    /// Counters so far.
    pub fn stats(&self) -> &RouterStats {
        &self.stats
    }

    /// The metrics this core keeps (shared with its service and `/metrics` endpoint).
    pub fn metrics(&self) -> &std::sync::Arc<crate::metrics::RouterMetrics> {
        self.metrics.shared()
    }

    /// This router's incarnation: random per core (so per router process), the high 32 bits
    /// of every batch id it issues. A result whose batch id carries another incarnation (work
    /// an earlier router process on this rank dispatched) is dropped and counted
    /// ([`RouterStats::stale_results`]), never absorbed into a live batch.
    pub fn incarnation(&self) -> u32 {
        self.incarnation
    }

    /// Sets the incarnation (nonzero; tests use fixed ones). Batches in flight keep their ids
    /// and their results are then dropped as stale.
    pub fn set_incarnation(&mut self, incarnation: u32) {
        self.incarnation = incarnation.max(1);
    }

    /// Replaces the hedging and quarantine tuning (the hedge ceiling stays the configured
    /// `straggler_timeout`); latency history and standings start afresh.
    pub fn set_hedge_policy(&mut self, policy: HedgePolicy) {
        let ranks = self.replicas.alive.len();
        self.health = Health::new(ranks, self.cfg.straggler_timeout, policy);
        self.probes.clear();
    }

    /// How long a part sent to `rank` for `layer` now goes unanswered before it is hedged.
    pub fn hedge_after(&self, rank: u32, layer: u32) -> Duration {
        self.health.hedge_after(rank, layer)
    }

    /// Mesh ranks out of rotation now (quarantined, or being probed).
    pub fn quarantined(&self) -> Vec<u32> {
        self.health.quarantined()
    }

    /// Layers served, ascending.
    pub fn layers(&self) -> Vec<u32> {
        let mut l: Vec<u32> = self.layers.keys().copied().collect();
        l.sort_unstable();
        l
    }

    /// Batches in flight.
    pub fn inflight(&self) -> usize {
        self.inflight.len()
    }

    /// Take the actions produced so far.
    pub fn drain_actions(&mut self) -> Vec<Action> {
        std::mem::take(&mut self.actions)
    }

    /// The earliest time [`RouterCore::on_tick`] has work to do.
    pub fn next_timeout(&self) -> Option<Instant> {
        let p = self.pending.values().map(|p| p.flush_at);
        let d = self.inflight.values().flat_map(|b| {
            let straggle = b.parts.iter().filter(|p| p.live).map(|p| p.hedge_at);
            let own = b.members.iter().filter(|m| !m.expired).map(|m| m.deadline);
            std::iter::once(b.deadline).chain(own).chain(straggle)
        });
        p.chain(d).chain(self.health.next_timeout()).min()
    }

    /// How messages name mesh rank `rank`: the device's name and its topology rank
    /// (`rank` minus the number of routers), or the router's name.
    pub fn name(&self, rank: u32) -> String {
        // Routers come first (their names have no '/'; device ids are "node/device").
        let routers = self
            .rank_names
            .iter()
            .take_while(|n| !n.contains('/'))
            .count()
            .max(1) as u32;
        match self.rank_names.get(rank as usize) {
            Some(n) if rank < routers => n.clone(),
            Some(n) => format!("{n} (rank {})", rank - routers),
            None if rank == 0 => "router".into(),
            None => format!("device rank {}", rank.saturating_sub(routers)),
        }
    }

    /// [`RouterCore::name`] of every mesh rank, for the service's logs.
    pub fn rank_labels(&self) -> Vec<String> {
        (0..self.rank_names.len() as u32)
            .map(|r| self.name(r))
            .collect()
    }

    /// A validator for frontend requests that can run outside the core (in connection tasks).
    pub fn validator(&self) -> RequestValidator {
        RequestValidator {
            spec: self.spec.clone(),
            layers: self.layers(),
            max_request_tokens: self.cfg.max_request_tokens,
            default_deadline: self.cfg.default_deadline,
            max_deadline: self.cfg.max_deadline,
            metrics: std::sync::Arc::clone(self.metrics.shared()),
        }
    }

    /// Validate a frontend `LayerRequest` and decode its payload, or say what is wrong.
    pub fn validate(
        &self,
        client: ClientId,
        req: &LayerRequest,
        payload: &[u8],
        now: Instant,
    ) -> Result<Request, Rejection> {
        self.validator().validate(client, req, payload, now)
    }

    /// Accept a validated request. It joins the pending batch of its layer (dispatched when the
    /// batch window closes or the batch is full).
    pub fn submit(&mut self, req: Request, now: Instant) {
        if req.deadline <= now {
            let msg =
                "deadline exceeded before the request could be batched; give it a longer deadline";
            self.fail_one(
                req.client,
                req.request_id,
                ErrorCode::DeadlineExceeded,
                msg.into(),
            );
            return;
        }
        if self.inflight.len() >= self.cfg.max_inflight_batches {
            self.fail_one(
                req.client,
                req.request_id,
                ErrorCode::Overloaded,
                format!(
                    "router has {} batches in flight (the limit); retry shortly",
                    self.inflight.len()
                ),
            );
            return;
        }
        let layer = req.layer;
        let full = self.pending.get(&layer).is_some_and(|p| {
            p.x.len() / self.spec.hidden as usize + req.tokens > self.cfg.max_batch_tokens
        });
        if full {
            self.flush(layer, now);
        }
        let p = self.pending.entry(layer).or_insert_with(|| Pending {
            members: Vec::new(),
            x: Vec::new(),
            logits: Vec::new(),
            logits_given: Vec::new(),
            clients: Vec::new(),
            flush_at: now + self.cfg.batch_window,
            deadline: req.deadline,
        });
        if !p.clients.contains(&req.client) {
            p.clients.push(req.client);
        }
        let offset = p.x.len() / self.spec.hidden as usize;
        p.members.push(Member {
            client: req.client,
            request_id: req.request_id,
            offset,
            tokens: req.tokens,
            deadline: req.deadline,
            expired: false,
        });
        if p.x.is_empty() {
            p.x = req.x; // a lone request's input is moved, not copied
        } else {
            p.x.extend_from_slice(&req.x);
        }
        let e = self.spec.routed_experts as usize;
        match &req.logits {
            Some(l) => p.logits.extend_from_slice(l),
            None => p.logits.resize(p.logits.len() + req.tokens * e, 0.0),
        }
        p.logits_given
            .extend(std::iter::repeat_n(req.logits.is_some(), req.tokens));
        p.deadline = p.deadline.max(req.deadline);
        let everyone = self.frontends.is_some_and(|n| p.clients.len() >= n);
        if self.cfg.batch_window.is_zero()
            || everyone
            || p.x.len() / self.spec.hidden as usize >= self.cfg.max_batch_tokens
        {
            self.flush(layer, now);
        }
    }

    /// The driver's count of open frontend connections. A pending batch that holds a request of
    /// every one of them is dispatched at once (in [`Self::submit`], or here when a connection
    /// closed): nobody else can join it. Until the driver calls this, only the window, a full
    /// batch or a zero window dispatch.
    pub fn set_frontends(&mut self, open: usize, now: Instant) {
        self.frontends = Some(open);
        let ready: Vec<u32> = self
            .pending
            .iter()
            .filter(|(_, p)| p.clients.len() >= open)
            .map(|(&l, _)| l)
            .collect();
        for l in ready {
            self.flush(l, now);
        }
    }

    /// Handle timers: close batch windows, re-send stragglers, fail requests past deadline.
    pub fn on_tick(&mut self, now: Instant) {
        let due: Vec<u32> = self
            .pending
            .iter()
            .filter(|(_, p)| p.flush_at <= now)
            .map(|(&l, _)| l)
            .collect();
        for l in due {
            self.flush(l, now);
        }
        for ev in self.health.expire_probes(now) {
            self.health_event(ev, "its probe went unanswered");
        }
        self.probes
            .retain(|&r, _| self.health.probe_of(r).is_some());
        let ids: Vec<u64> = self.inflight.keys().copied().collect();
        for id in ids {
            self.expire_members(id, now);
            let Some(b) = self.inflight.get(&id) else {
                continue;
            };
            if b.deadline <= now {
                let waiting: Vec<String> = b
                    .parts
                    .iter()
                    .filter(|p| p.live)
                    .map(|p| self.name(p.rank))
                    .collect();
                let msg = format!(
                    "deadline exceeded: layer {} still waiting for {}; the device may be overloaded or down",
                    b.layer,
                    waiting.join(", ")
                );
                self.fail_batch(id, ErrorCode::DeadlineExceeded, msg);
                continue;
            }
            let slow: Vec<usize> = b
                .parts
                .iter()
                .enumerate()
                .filter(|(_, p)| p.live && p.hedge_at <= now)
                .map(|(i, _)| i)
                .collect();
            for i in slow {
                self.straggled(id, i, now);
                // Re-send only when another owner exists; otherwise keep waiting until the
                // deadline (the part's clock restarts so this is not retried every tick).
                self.redispatch(id, i, now, Resend::Straggler);
            }
        }
    }

    /// A worker's result frame arrived.
    pub fn on_result(&mut self, from: u32, res: &ExpertResult, payload: &[u8], now: Instant) {
        if !self.own_batch(res.batch_id, from, now) {
            return;
        }
        if self.health.is_probe(from, res.batch_id, res.part) {
            self.probe_answered(from, res, payload, now);
            return;
        }
        let h = self.spec.hidden as usize;
        let wire = self.wire;
        let Some(b) = self.inflight.get_mut(&res.batch_id) else {
            return; // late result of a finished or failed batch
        };
        let Some(part) = b.parts.get_mut(res.part as usize) else {
            return;
        };
        if !part.live || part.rank != from {
            return; // superseded by a re-dispatch
        }
        let expect_rows = match wire.layout {
            WireLayout::PerSlot => part.plan.pairs(),
            WireLayout::PreCombined => part.plan.tokens.len(),
        };
        let wrong = res.rows as usize != expect_rows
            || res.layout != wire.layout
            || res.hidden as usize != h
            || payload.len() != expect_rows * h * res.dtype.elem_bytes();
        if wrong {
            let msg = format!(
                "{} returned {} rows of {} values ({} bytes) where {} rows of {h} were expected",
                self.name(from),
                res.rows,
                res.hidden,
                payload.len(),
                expect_rows
            );
            self.fail_batch(res.batch_id, ErrorCode::Internal, msg);
            return;
        }
        // One copy in: each row is decoded straight into its place (per-slot: the batch's
        // per-slot rows; pre-combined: the part's rows). A worker that answers a bf16 request
        // in f32 (an older build ignores the byte) is rounded here: the same bits.
        let row_bytes = h * res.dtype.elem_bytes();
        let round = wire.result == OutputDtype::Bf16 && res.dtype != OutputDtype::Bf16;
        let decoded = match wire.layout {
            WireLayout::PerSlot => {
                let slots = b.routing.top_k;
                part.plan
                    .pair_targets()
                    .enumerate()
                    .try_for_each(|(i, (t, s))| {
                        let dst = &mut b.slot_rows[(t as usize * slots + s as usize) * h..][..h];
                        let src = &payload[i * row_bytes..(i + 1) * row_bytes];
                        dtype::decode_output(res.dtype, src, dst)?;
                        if round {
                            dtype::round_to_bf16(dst);
                        }
                        Ok(())
                    })
            }
            WireLayout::PreCombined => {
                let mut rows = vec![0f32; expect_rows * h];
                dtype::decode_output(res.dtype, payload, &mut rows).map(|()| {
                    if round {
                        dtype::round_to_bf16(&mut rows);
                    }
                    b.partials
                        .insert(res.part, (part.plan.tokens.clone(), rows));
                })
            }
        };
        if decoded.is_err() {
            let msg = format!("{} sent an undecodable result", self.name(from));
            self.fail_batch(res.batch_id, ErrorCode::Internal, msg);
            return;
        }
        part.live = false;
        let latency = now.saturating_duration_since(part.sent_at);
        self.metrics.on_part_answered(part.sent_at, now);
        let in_time = !part.straggled;
        let pairs = part.plan.pairs() as u64;
        self.replicas.load[from as usize] = self.replicas.load[from as usize].saturating_sub(pairs);
        self.stats.result_payload_bytes += payload.len() as u64;
        b.outstanding -= 1;
        let (layer, done) = (b.layer, b.outstanding == 0 && !b.shared_pending);
        // Only answers in time feed the latency estimate: a straggle (a paused device) would
        // hold the hedge timeout at its ceiling long after the device recovered.
        if in_time && let Some(ev) = self.health.on_answer(from, layer, latency, now) {
            self.health_event(ev, "it answered a part only it could serve in time");
        }
        if done {
            self.complete(res.batch_id);
        }
    }

    /// A worker answered a dispatch with an error frame. Frames of another router incarnation
    /// are dropped, and so is the error of a part already answered or re-sent elsewhere (the
    /// batch goes on). When a node's leader could not reach a node peer (`PeerUnavailable`
    /// with per-node dedup on), its parts of the batch are sent again straight to the devices,
    /// so the router's own view of them decides (a replica elsewhere, the device itself over
    /// its own link, or a clean error naming it). An error that is the device's own (internal,
    /// overloaded, an expert not loaded there, shutting down) counts against the device and
    /// its parts go to replicas when every one of their experts has another live owner;
    /// otherwise the batch fails with the device's message.
    pub fn on_worker_error(
        &mut self,
        from: u32,
        request_id: u64,
        code: ErrorCode,
        message: &str,
        now: Instant,
    ) {
        if !self.own_batch(request_id, from, now) {
            return;
        }
        if self
            .health
            .probe_of(from)
            .is_some_and(|(b, _)| b == request_id)
        {
            self.fault(from, now, "its probe was answered with an error");
            self.probes.remove(&from);
        }
        let parts: Vec<usize> = self.inflight.get(&request_id).map_or_else(Vec::new, |b| {
            b.parts
                .iter()
                .enumerate()
                .filter(|(_, p)| p.live && p.rank == from)
                .map(|(i, _)| i)
                .collect()
        });
        if parts.is_empty() {
            return; // a finished batch, a superseded part, or the probe's answer
        }
        if code == ErrorCode::PeerUnavailable && self.replicas.node_dedup {
            tracing::warn!(
                leader = %self.name(from), message,
                "a node leader could not reach a node peer; sending its share directly"
            );
            for i in parts {
                self.redispatch(request_id, i, now, Resend::WithoutDedup);
            }
            return;
        }
        let device_fault = matches!(
            code,
            ErrorCode::Internal
                | ErrorCode::Overloaded
                | ErrorCode::PeerUnavailable
                | ErrorCode::NotFound
                | ErrorCode::ShuttingDown
                | ErrorCode::Other(_)
        );
        if device_fault {
            self.fault(from, now, "it answered with an error");
            if parts.iter().all(|&i| self.has_other_owner(request_id, i)) {
                tracing::warn!(
                    device = %self.name(from), ?code, message,
                    "a device answered with an error; its share goes to a replica"
                );
                for i in parts {
                    self.redispatch(request_id, i, now, Resend::Lost);
                }
                return;
            }
        }
        let msg = format!("{}: {message}", self.name(from));
        self.fail_batch(request_id, code, msg);
    }

    /// A link to a worker failed: its outstanding parts go to replicas, or their batches fail.
    pub fn on_peer_lost(&mut self, rank: u32, now: Instant) {
        if let Some(a) = self.replicas.alive.get_mut(rank as usize) {
            *a = false;
        }
        self.fault(rank, now, "its link was lost");
        self.replicas.load[rank as usize] = 0;
        let affected: Vec<(u64, usize)> = self
            .inflight
            .iter()
            .flat_map(|(&id, b)| {
                b.parts
                    .iter()
                    .enumerate()
                    .filter(|(_, p)| p.live && p.rank == rank)
                    .map(move |(i, _)| (id, i))
            })
            .collect();
        for (id, i) in affected {
            self.redispatch(id, i, now, Resend::Lost);
        }
    }

    /// A link to a worker is (again) established.
    pub fn on_peer_up(&mut self, rank: u32) {
        self.stats.peer_ups += 1;
        if let Some(a) = self.replicas.alive.get_mut(rank as usize) {
            *a = true;
        }
    }

    /// Sending a part failed (the link went down while the send waited).
    pub fn on_send_failed(&mut self, rank: u32, batch: u64, part: u32, now: Instant) {
        if self.health.is_probe(rank, batch, part) {
            self.fault(rank, now, "sending its probe failed");
            self.probes.remove(&rank);
            return;
        }
        let live = self
            .inflight
            .get(&batch)
            .and_then(|b| b.parts.get(part as usize))
            .is_some_and(|p| p.live && p.rank == rank);
        if live {
            if let Some(a) = self.replicas.alive.get_mut(rank as usize) {
                *a = false;
            }
            self.fault(rank, now, "a send to it failed");
            self.redispatch(batch, part as usize, now, Resend::Lost);
        }
    }

    fn fail_one(&mut self, client: ClientId, request_id: u64, code: ErrorCode, message: String) {
        self.stats.failures += 1;
        self.metrics.on_error(code);
        self.actions.push(Action::Fail {
            client,
            request_id,
            code,
            message,
        });
    }

    fn fail_batch(&mut self, id: u64, code: ErrorCode, message: String) {
        let Some(b) = self.inflight.remove(&id) else {
            return;
        };
        for p in b.parts.iter().filter(|p| p.live) {
            let l = &mut self.replicas.load[p.rank as usize];
            *l = l.saturating_sub(p.plan.pairs() as u64);
        }
        for m in b.members.into_iter().filter(|m| !m.expired) {
            self.fail_one(m.client, m.request_id, code, message.clone());
        }
    }

    /// Fail, each alone, the members of batch `id` whose own deadline has passed while the
    /// batch goes on for the others (a short deadline fails only its own request). The batch
    /// as a whole fails at the latest of its members' deadlines ([`Self::on_tick`]).
    fn expire_members(&mut self, id: u64, now: Instant) {
        let Some(b) = self.inflight.get_mut(&id) else {
            return;
        };
        if b.deadline <= now {
            return; // every member is due: the whole batch fails, naming the devices
        }
        let mut due = Vec::new();
        for m in b
            .members
            .iter_mut()
            .filter(|m| !m.expired && m.deadline <= now)
        {
            m.expired = true;
            due.push((m.client, m.request_id));
        }
        if due.is_empty() {
            return;
        }
        let layer = b.layer;
        let live: Vec<u32> = b.parts.iter().filter(|p| p.live).map(|p| p.rank).collect();
        let waiting: Vec<String> = live.into_iter().map(|r| self.name(r)).collect();
        let msg = format!(
            "deadline exceeded: the request's own deadline passed while layer {layer} waited for {}; give it a longer deadline, or the device may be overloaded",
            if waiting.is_empty() {
                "the router".to_owned()
            } else {
                waiting.join(", ")
            }
        );
        for (client, request_id) in due {
            self.fail_one(client, request_id, ErrorCode::DeadlineExceeded, msg.clone());
        }
    }

    /// Gate, plan and send a pending batch.
    fn flush(&mut self, layer: u32, now: Instant) {
        let Some(p) = self.pending.remove(&layer) else {
            return;
        };
        let h = self.spec.hidden as usize;
        let e = self.spec.routed_experts as usize;
        let tokens = p.x.len() / h;
        let setup = &self.layers[&layer];
        // Gating: the frontend's logits where given, the gate matrix otherwise.
        let mut logits = p.logits;
        for (t, _) in p.logits_given.iter().enumerate().filter(|(_, g)| !**g) {
            setup
                .gate
                .logits_into(&p.x[t * h..(t + 1) * h], &mut logits[t * e..(t + 1) * e]);
        }
        let routing = match gating::route(&self.spec, &logits, &setup.gate.bias) {
            Ok(r) => r,
            Err(err) => {
                for m in p.members {
                    self.fail_one(
                        m.client,
                        m.request_id,
                        ErrorCode::InvalidInput,
                        err.to_string(),
                    );
                }
                return;
            }
        };
        let (routing, shared_weights, shared_pending, shared_local) =
            shared_parts(&self.spec, setup, routing, &p.x);
        let q8 = (self.cfg.mode == ComputeMode::Exact).then(|| {
            let mut q = vec![0i8; tokens * h];
            let mut d = vec![0f32; tokens * h / 32];
            contract::quantize_activations(&p.x, &mut q, &mut d);
            (q, d)
        });
        let slots = routing.top_k;
        let id = self.issue_batch_id();
        self.stats.batches += 1;
        let batch = Inflight {
            layer,
            tokens,
            members: p.members,
            deadline: p.deadline,
            slot_rows: if self.wire.layout == WireLayout::PerSlot {
                vec![0f32; tokens * slots * h]
            } else {
                Vec::new()
            },
            partials: BTreeMap::new(),
            routing,
            x: p.x,
            q8,
            shared_local,
            shared_pending,
            shared_weights,
            parts: Vec::new(),
            outstanding: 0,
        };
        self.inflight.insert(id, batch);
        let opened = p.flush_at.checked_sub(self.cfg.batch_window).unwrap_or(now);
        let b = &self.inflight[&id];
        let (n, r) = (b.members.len(), &b.routing);
        self.metrics.on_batch(id, layer, n, r, opened, now);
        // Micro-batches: plan and send each chunk of tokens separately.
        let mb = self.cfg.micro_batch_tokens.max(1);
        let mut start = 0;
        while start < tokens {
            let end = (start + mb).min(tokens);
            let mut pairs = Vec::with_capacity((end - start) * slots);
            pairs.extend(
                (start as u32..end as u32).flat_map(|t| (0..slots as u32).map(move |s| (t, s))),
            );
            if !self.send_pairs(id, &pairs, None, true, now) {
                return;
            }
            start = end;
        }
        self.metrics.on_dispatched(now);
        self.send_probes(id, now);
        if self
            .inflight
            .get(&id)
            .is_some_and(|b| b.outstanding == 0 && !b.shared_pending)
        {
            self.complete(id);
        }
    }

    /// Run work deferred until the driver has sent the latest dispatch frames: the shared
    /// experts of batches whose shared experts live on the router. Call after draining actions.
    pub fn run_deferred(&mut self) {
        let ids: Vec<u64> = self
            .inflight
            .iter()
            .filter(|(_, b)| b.shared_pending)
            .map(|(&id, _)| id)
            .collect();
        for id in ids {
            let mode = self.cfg.mode;
            let Some(b) = self.inflight.get_mut(&id) else {
                continue;
            };
            let res = match self.shared_runner.as_mut() {
                Some(r) => r.run(b.layer, &b.x, b.tokens, mode, &mut b.shared_local),
                None => Err(BackendError::NotLoaded),
            };
            b.shared_pending = false;
            if self.cfg.results == ResultWire::SlotsBf16 {
                // Every expert output is rounded to bf16, wherever it ran (the contract of
                // exact-bf16: the same bits with the shared experts on a worker).
                dtype::round_to_bf16(&mut b.shared_local);
            }
            let layer = b.layer;
            let done = b.outstanding == 0;
            match res {
                Err(msg) => self.fail_batch(
                    id,
                    ErrorCode::Internal,
                    format!("shared expert of layer {layer} on the router: {msg}"),
                ),
                Ok(()) if done => self.complete(id),
                Ok(()) => {}
            }
        }
    }

    /// Whether [`RouterCore::run_deferred`] has work.
    pub fn has_deferred(&self) -> bool {
        self.inflight.values().any(|b| b.shared_pending)
    }

    /// Plan `pairs` of batch `id` (avoiding `avoid` in addition to dead ranks, and quarantined
    /// ranks unless an expert has no other live owner) and send them. With `dedup` off (a
    /// node's leader could not reach a peer), every pair goes to the device chosen for it, not
    /// through its node's leader. Returns false when the batch failed.
    fn send_pairs(
        &mut self,
        id: u64,
        pairs: &[(u32, u32)],
        avoid: Option<u32>,
        dedup: bool,
        now: Instant,
    ) -> bool {
        let Some(b) = self.inflight.get(&id) else {
            return false;
        };
        let owners = &self.owners_ext[&b.layer];
        let mut replicas = self.replicas.clone();
        if let Some(r) = avoid {
            replicas.alive[r as usize] = false;
        }
        replicas.node_dedup &= dedup;
        let benched = self.health.quarantined();
        let plans = match plan_around(&b.routing, owners, replicas, pairs, &benched) {
            Ok(p) => p,
            Err(PlanError::NoLiveOwner { expert, owners }) => {
                let who: Vec<String> = owners.iter().map(|&r| self.name(r)).collect();
                let what = if expert >= self.spec.routed_experts {
                    format!("shared expert {}", expert - self.spec.routed_experts)
                } else {
                    format!("expert {expert}")
                };
                let msg = format!(
                    "layer {}: {what} is unavailable: {} down and the placement has no other replica",
                    b.layer,
                    who.join(", ")
                );
                self.fail_batch(id, ErrorCode::PeerUnavailable, msg);
                return false;
            }
            Err(err) => {
                self.fail_batch(id, ErrorCode::Internal, err.to_string());
                return false;
            }
        };
        for plan in plans {
            let b = self.inflight.get(&id).expect("checked above");
            let part_id = b.parts.len() as u32;
            let (frame, payload_len) = self.part_frame(b, id, part_id, &plan);
            self.stats.parts_sent += 1;
            self.stats.dispatch_payload_bytes += payload_len as u64;
            self.replicas.load[plan.rank as usize] += plan.pairs() as u64;
            let rank = plan.rank;
            let b = self.inflight.get_mut(&id).expect("checked above");
            b.parts.push(Part {
                rank,
                plan,
                sent_at: now,
                hedge_at: now + self.health.hedge_after(rank, b.layer),
                straggled: false,
                live: true,
            });
            b.outstanding += 1;
            self.actions.push(Action::Send {
                rank,
                frame,
                batch: id,
                part: part_id,
            });
        }
        true
    }

    /// The dispatch frame of part `part_id` of batch `id` (in flight as `b`) for `plan`, and
    /// its payload's length.
    fn part_frame(
        &self,
        b: &Inflight,
        id: u64,
        part_id: u32,
        plan: &DevicePlan,
    ) -> (OutFrame, usize) {
        let h = self.spec.hidden as usize;
        let mode = self.cfg.mode;
        let n = plan.tokens.len();
        let (dtype, payload) = dispatch_payload(b, &plan.tokens, h, mode, self.cfg.accurate_dtype);
        let dispatch = Dispatch {
            batch_id: id,
            layer: b.layer,
            part: part_id,
            tokens: n as u32,
            hidden: h as u32,
            dtype,
            mode,
            layout: self.wire.layout,
            result_dtype: self.wire.result,
            expert_counts: plan.counts.iter().map(|&c| c as u16).collect(),
            experts: plan.experts.clone(),
            weights: plan.weights.clone(),
        };
        let len = payload.len();
        (
            OutFrame::with_payload(Body::Dispatch(dispatch), Bytes::from(payload)),
            len,
        )
    }

    /// Whether every expert of part `i` of batch `id` has a live owner other than the part's
    /// device.
    fn has_other_owner(&self, id: u64, i: usize) -> bool {
        let Some(b) = self.inflight.get(&id) else {
            return false;
        };
        let Some(part) = b.parts.get(i) else {
            return false;
        };
        let owners = &self.owners_ext[&b.layer];
        part.plan.pair_targets().all(|(t, s)| {
            let e = b.routing.experts_of(t as usize)[s as usize];
            owners.owners[e as usize]
                .iter()
                .any(|&r| r != part.rank && self.replicas.alive[r as usize])
        })
    }

    /// Re-send part `i` of batch `id` ([`Resend`] says why and where to).
    fn redispatch(&mut self, id: u64, i: usize, now: Instant, why: Resend) {
        let Some(b) = self.inflight.get(&id) else {
            return;
        };
        if !b.parts[i].live {
            return;
        }
        if why == Resend::Straggler && !self.has_other_owner(id, i) {
            // Keep waiting (until the deadline), and look again later: a replica may come
            // back.
            let b = self.inflight.get_mut(&id).expect("checked above");
            let part = &mut b.parts[i];
            let wait = self.health.hedge_after(part.rank, b.layer);
            part.hedge_at = now + wait.max(STRAGGLER_RECHECK);
            return;
        }
        let b = self.inflight.get_mut(&id).expect("checked above");
        let part = &mut b.parts[i];
        let rank = part.rank;
        let mut pairs = Vec::with_capacity(part.plan.pairs());
        pairs.extend(part.plan.pair_targets());
        part.live = false;
        b.outstanding -= 1;
        let l = &mut self.replicas.load[rank as usize];
        *l = l.saturating_sub(pairs.len() as u64);
        self.stats.parts_redispatched += 1;
        if why == Resend::Straggler {
            self.stats.hedges += 1;
        }
        let (avoid, dedup) = match why {
            Resend::WithoutDedup => (None, false),
            Resend::Lost | Resend::Straggler => (Some(rank), true),
        };
        if self.send_pairs(id, &pairs, avoid, dedup, now)
            && self
                .inflight
                .get(&id)
                .is_some_and(|b| b.outstanding == 0 && !b.shared_pending)
        {
            self.complete(id);
        }
    }

    /// Part `i` of batch `id` is past its hedge time: charge its device once.
    fn straggled(&mut self, id: u64, i: usize, now: Instant) {
        let Some(part) = self.inflight.get_mut(&id).and_then(|b| b.parts.get_mut(i)) else {
            return;
        };
        if std::mem::replace(&mut part.straggled, true) {
            return;
        }
        let rank = part.rank;
        self.fault(rank, now, "it straggled past its hedge timeout");
    }

    /// A fault of `rank` (a straggle, a failed send, a lost link, an error answer): its probe
    /// fails when one is out, else it counts towards quarantine.
    fn fault(&mut self, rank: u32, now: Instant, why: &str) {
        let ev = if self.health.probe_of(rank).is_some() {
            self.probes.remove(&rank);
            Some(self.health.on_probe_failed(rank, now))
        } else {
            self.health.on_fault(rank, now)
        };
        if let Some(ev) = ev {
            self.health_event(ev, why);
        }
    }

    /// Counts and logs a change of a device's standing.
    fn health_event(&mut self, ev: HealthEvent, why: &str) {
        match ev {
            HealthEvent::Quarantined { rank, period } => {
                self.stats.quarantines += 1;
                tracing::info!(
                    device = %self.name(rank), ?period,
                    "device quarantined ({why}): left out of replica choice, probed after the period"
                );
            }
            HealthEvent::Released { rank } => {
                self.stats.quarantine_releases += 1;
                tracing::info!(device = %self.name(rank), "device back in rotation ({why})");
            }
        }
    }

    /// Mirrors one live part of batch `id` to each live device whose quarantine ran out and
    /// that holds every expert of that part: its probe. The probe's answer is checked and
    /// dropped ([`RouterCore::on_result`]); the batch never waits on it.
    fn send_probes(&mut self, id: u64, now: Instant) {
        for rank in self.health.probes_due(now) {
            if !self.replicas.alive.get(rank as usize).is_some_and(|&a| a) {
                continue; // not connected: probed once it is back
            }
            let Some(b) = self.inflight.get(&id) else {
                return;
            };
            let owners = &self.owners_ext[&b.layer];
            let holds = |p: &Part| {
                p.plan.pair_targets().all(|(t, s)| {
                    let e = b.routing.experts_of(t as usize)[s as usize];
                    owners.owners[e as usize].contains(&rank)
                })
            };
            let live_part = |p: &&Part| p.live && p.rank != rank && holds(p);
            let Some(src) = b.parts.iter().find(live_part) else {
                continue;
            };
            let mut plan = src.plan.clone();
            plan.rank = rank;
            let part_id = b.parts.len() as u32;
            let (frame, _) = self.part_frame(b, id, part_id, &plan);
            let rows = match self.wire.layout {
                WireLayout::PerSlot => plan.pairs(),
                WireLayout::PreCombined => plan.tokens.len(),
            };
            let layer = b.layer;
            let b = self.inflight.get_mut(&id).expect("checked above");
            b.parts.push(Part {
                rank,
                plan,
                sent_at: now,
                hedge_at: now,
                straggled: false,
                live: false,
            });
            self.health.probe_sent(rank, id, part_id, now);
            self.probes.insert(rank, (layer, rows));
            self.stats.probes += 1;
            tracing::debug!(device = %self.name(rank), batch = id, part = part_id, "probe sent");
            self.actions.push(Action::Send {
                rank,
                frame,
                batch: id,
                part: part_id,
            });
        }
    }

    /// The probe out to `from` was answered: back in rotation when the answer has the shape
    /// asked for and came in time, quarantined again otherwise.
    fn probe_answered(&mut self, from: u32, res: &ExpertResult, payload: &[u8], now: Instant) {
        let Some((layer, rows)) = self.probes.remove(&from) else {
            return;
        };
        let h = self.spec.hidden as usize;
        let fits = res.rows as usize == rows
            && res.layout == self.wire.layout
            && res.hidden as usize == h
            && payload.len() == rows * h * res.dtype.elem_bytes();
        let ev = if fits {
            self.health.on_probe_answered(from, layer, now)
        } else {
            self.health.on_probe_failed(from, now)
        };
        let why = if fits {
            "it answered its probe"
        } else {
            "it answered its probe with a result of the wrong shape"
        };
        self.health_event(ev, why);
    }

    /// Whether batch id `id` (of a result or error frame from `from`) was issued by this
    /// incarnation. A frame of another one (an earlier router process on this rank) is dropped
    /// and counted, with a warning at most every [`STALE_WARN_EVERY`].
    fn own_batch(&mut self, id: u64, from: u32, now: Instant) -> bool {
        if id >> 32 == u64::from(self.incarnation) {
            return true;
        }
        if id == 0 {
            return false; // an error about a frame the worker could not read
        }
        self.stats.stale_results += 1;
        let (batch, mine) = (format!("{id:016x}"), format!("{:08x}", self.incarnation));
        tracing::debug!(from = %self.name(from), batch, incarnation = mine, "dropped a frame of another router incarnation");
        if self
            .last_stale_warn
            .is_none_or(|t| now.saturating_duration_since(t) >= STALE_WARN_EVERY)
        {
            self.last_stale_warn = Some(now);
            tracing::warn!(
                from = %self.name(from), batch, incarnation = mine,
                dropped = self.stats.stale_results,
                "dropping answers to another router incarnation (work an earlier router process on this rank dispatched)"
            );
        }
        false
    }

    /// The id of a new batch: this incarnation in the high 32 bits, a sequence number
    /// (1.., wrapping) in the low.
    fn issue_batch_id(&mut self) -> u64 {
        let seq = self.next_batch;
        self.next_batch = if seq >= u64::from(u32::MAX) {
            1
        } else {
            seq + 1
        };
        (u64::from(self.incarnation) << 32) | seq
    }

    /// Combine a finished batch and answer its requests.
    fn complete(&mut self, id: u64) {
        let Some(b) = self.inflight.remove(&id) else {
            return;
        };
        let combining = Instant::now();
        let h = self.spec.hidden as usize;
        let shared = if b.shared_local.is_empty() {
            0
        } else {
            self.spec.shared_experts as usize
        };
        let slots = b.routing.top_k;
        // Each request's output is combined in place in the buffer its response carries: no
        // batch-wide output and no per-request copy. Per token the order of additions is the
        // contract's (slots in order, then shared), whatever request it belongs to.
        let mut outs: Vec<Vec<f32>> = b.members.iter().map(|m| vec![0f32; m.tokens * h]).collect();
        match self.wire.layout {
            WireLayout::PerSlot => {
                for t in 0..b.tokens {
                    let o = member_row(&b.members, &mut outs, t, h);
                    let w = b.routing.weights_of(t);
                    for s in 0..slots {
                        let y = &b.slot_rows[(t * slots + s) * h..(t * slots + s + 1) * h];
                        // Routed slots carry their weight; remote shared slots carry 1.0, and
                        // acc + 1.0·y == acc + y exactly, as the contract adds shared outputs.
                        let ws = w[s];
                        for (a, &v) in o.iter_mut().zip(y) {
                            *a += ws * v;
                        }
                    }
                }
            }
            WireLayout::PreCombined => {
                for (tokens, rows) in b.partials.values() {
                    for (j, &t) in tokens.iter().enumerate() {
                        let o = member_row(&b.members, &mut outs, t as usize, h);
                        for (a, &v) in o.iter_mut().zip(&rows[j * h..(j + 1) * h]) {
                            *a += v;
                        }
                    }
                }
            }
        }
        for t in 0..b.tokens {
            let o = member_row(&b.members, &mut outs, t, h);
            let gate = b.shared_weights.get(t).copied();
            for i in 0..shared {
                let y = &b.shared_local[(t * shared + i) * h..(t * shared + i + 1) * h];
                match gate {
                    Some(g) => o.iter_mut().zip(y).for_each(|(a, &v)| *a += g * v),
                    None => o.iter_mut().zip(y).for_each(|(a, &v)| *a += v),
                }
            }
        }
        self.metrics.on_completed(id, b.members.len(), combining);
        for (m, output) in b.members.into_iter().zip(outs).filter(|(m, _)| !m.expired) {
            self.stats.responses += 1;
            self.stats.tokens += m.tokens as u64;
            self.actions.push(Action::Respond {
                client: m.client,
                request_id: m.request_id,
                tokens: m.tokens,
                output,
            });
        }
    }
}

/// How soon a straggling part without another live owner is looked at again (a replica may
/// have come back).
const STRAGGLER_RECHECK: Duration = Duration::from_millis(25);

/// Least time between two warnings about stale frames (each is counted and logged at debug).
const STALE_WARN_EVERY: Duration = Duration::from_secs(5);

/// A random nonzero router incarnation: the standard library's per-process random hash keys
/// mixed with the time and the process id, so router processes (and restarts) differ.
pub fn fresh_incarnation() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    h.write_u128(t);
    h.write_u32(std::process::id());
    let v = h.finish();
    ((v >> 32) as u32 ^ v as u32).max(1)
}

/// Plans `pairs` with the `benched` (quarantined) ranks left out of replica choice, except
/// for experts that no other live rank holds: their benched owners are let back in, one
/// expert at a time, so quarantine never makes an expert unavailable.
fn plan_around(
    routing: &Routing,
    owners: &LayerOwners,
    mut replicas: Replicas,
    pairs: &[(u32, u32)],
    benched: &[u32],
) -> Result<Vec<DevicePlan>, PlanError> {
    let mut out: Vec<u32> = benched
        .iter()
        .copied()
        .filter(|&r| replicas.alive.get(r as usize) == Some(&true))
        .collect();
    for &r in &out {
        replicas.alive[r as usize] = false;
    }
    loop {
        match plan::plan_dispatch(routing, owners, &replicas, Some(pairs)) {
            Err(PlanError::NoLiveOwner { owners: o, .. }) if o.iter().any(|r| out.contains(r)) => {
                for r in o {
                    if let Some(i) = out.iter().position(|&x| x == r) {
                        out.swap_remove(i);
                        replicas.alive[r as usize] = true;
                    }
                }
            }
            other => return other,
        }
    }
}

/// The activation payload of one part: exact mode sends the batch's q8 rows of `tokens`
/// (quantized once per batch), accurate mode encodes their f32 rows in `accurate_dtype`; either
/// way the rows are gathered straight into the frame's bytes.
fn dispatch_payload(
    b: &Inflight,
    tokens: &[u32],
    h: usize,
    mode: ComputeMode,
    accurate_dtype: ActivationDtype,
) -> (ActivationDtype, Vec<u8>) {
    let n = tokens.len();
    match (&b.q8, mode) {
        (Some((q, d)), ComputeMode::Exact) => {
            let dt = ActivationDtype::Q8Block32;
            let mut buf = vec![0u8; dt.payload_bytes(n, h).expect("shape validated") as usize];
            let nb = h / 32;
            for (j, &t) in tokens.iter().enumerate() {
                let t = t as usize;
                let (q, d) = (&q[t * h..(t + 1) * h], &d[t * nb..(t + 1) * nb]);
                dtype::write_q8_row(&mut buf, n, h, j, q, d);
            }
            (dt, buf)
        }
        _ => {
            let bytes = accurate_dtype.payload_bytes(n, h).expect("shape validated") as usize;
            let mut buf = vec![0u8; bytes];
            dtype::encode_activations_gather(accurate_dtype, h, &b.x, tokens, &mut buf)
                .expect("inputs validated finite");
            (accurate_dtype, buf)
        }
    }
}

/// A batch's shared-expert parts: the routing (with the shared experts appended as slots when
/// they live on a worker), each token's shared weight (Qwen2-MoE's `sigmoid(shared_gate · x)`;
/// empty for weight 1), whether they run on the router (in `run_deferred`, after this batch's
/// dispatch frames have been handed to the driver, so they overlap with the workers), and the
/// buffer they write there.
fn shared_parts(
    spec: &ModelSpec,
    setup: &LayerSetup,
    routing: Routing,
    x: &[f32],
) -> (Routing, Vec<f32>, bool, Vec<f32>) {
    let shared = spec.shared_experts as usize;
    let (e, h) = (spec.routed_experts, spec.hidden as usize);
    let shared_weights = if spec.shared_expert_gate && shared > 0 {
        setup.gate.shared_weights(x)
    } else {
        Vec::new()
    };
    let routing = match setup.shared {
        SharedSite::Rank(_) if shared > 0 => {
            with_remote_shared(&routing, e, shared, &shared_weights)
        }
        _ => routing,
    };
    let pending = setup.shared == SharedSite::Router && shared > 0;
    let local = if pending {
        vec![0f32; x.len() / h * shared * h]
    } else {
        Vec::new()
    };
    (routing, shared_weights, pending, local)
}

/// `routing` with a layer's shared experts (pseudo-ids `routed_experts + i`, weight 1, or the
/// token's `shared_weights` entry when the model gates them) appended to every token as extra
/// slots, for shared experts that live on a worker.
fn with_remote_shared(
    routing: &Routing,
    routed_experts: u32,
    shared: usize,
    shared_weights: &[f32],
) -> Routing {
    let tokens = routing.tokens();
    let slots = routing.top_k + shared;
    let mut experts = Vec::with_capacity(tokens * slots);
    let mut weights = Vec::with_capacity(tokens * slots);
    for t in 0..tokens {
        experts.extend_from_slice(routing.experts_of(t));
        weights.extend_from_slice(routing.weights_of(t));
        experts.extend((0..shared as u32).map(|i| routed_experts + i));
        let w = shared_weights.get(t).copied().unwrap_or(1.0);
        weights.extend(std::iter::repeat_n(w, shared));
    }
    Routing {
        top_k: slots,
        experts,
        weights,
    }
}

/// Batch token `t`'s row in its request's output buffer (`members` in offset order).
fn member_row<'a>(
    members: &[Member],
    outs: &'a mut [Vec<f32>],
    t: usize,
    h: usize,
) -> &'a mut [f32] {
    let i = members.partition_point(|m| m.offset <= t) - 1;
    let r = t - members[i].offset;
    &mut outs[i][r * h..(r + 1) * h]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_mode_has_its_wire() {
        let wire = |m: LayerMode| m.apply(RouterConfig::default()).wire_format();
        let f = |dispatch, layout, result| WireFormat {
            dispatch,
            layout,
            result,
        };
        let (q8, f32in) = (ActivationDtype::Q8Block32, ActivationDtype::F32);
        let (slots, combined) = (WireLayout::PerSlot, WireLayout::PreCombined);
        let (f32out, bf16) = (OutputDtype::F32, OutputDtype::Bf16);
        assert_eq!(wire(LayerMode::Exact), f(q8, slots, f32out));
        assert_eq!(wire(LayerMode::ExactBf16), f(q8, slots, bf16));
        assert_eq!(wire(LayerMode::Accurate), f(f32in, combined, f32out));
        assert_eq!(wire(LayerMode::Serving), f(q8, combined, bf16));
        for m in LayerMode::ALL {
            assert_eq!(m.apply(RouterConfig::default()).layer_mode(), Some(m));
        }
        assert_eq!(RouterConfig::default().layer_mode(), Some(LayerMode::Exact));
        let odd = RouterConfig {
            mode: ComputeMode::Accurate,
            results: ResultWire::SlotsBf16,
            ..RouterConfig::default()
        };
        assert_eq!(odd.layer_mode(), None);
        assert_eq!(odd.wire_format(), f(f32in, slots, bf16));
    }

    #[test]
    fn every_mode_parses_from_its_name() {
        for m in LayerMode::ALL {
            assert_eq!(m.name().parse::<LayerMode>(), Ok(m));
            assert_eq!(m.to_string().to_uppercase().parse::<LayerMode>(), Ok(m));
        }
        assert_eq!("exact_bf16".parse::<LayerMode>(), Ok(LayerMode::ExactBf16));
        let err = "fast".parse::<LayerMode>().unwrap_err();
        assert!(err.to_string().contains("exact-bf16"), "{err}");
    }
}
