//! The router core: a sans-IO state machine from frontend requests to combined layer outputs.
//!
//! Why this exists: everything the router decides — batching requests that arrive close
//! together, gating, splitting a batch into micro-batches, planning destinations, choosing
//! replicas, re-dispatching the share of a dead or straggling device, enforcing deadlines and
//! combining results in a fixed order — lives here, with no sockets, threads or clocks. The
//! service ([`crate::service`]) feeds it requests, worker frames, peer notices and the current
//! time, and carries out the [`Action`]s it returns. Tests drive it with simulated workers.
//!
//! Time: every input that needs the time carries it (`now`); the core never reads a clock, and
//! its incarnation is given to it ([`RouterCore::new`]; the service draws a random one), so the
//! same inputs give the same actions. Only the metrics it updates
//! ([`crate::metrics::CoreMetrics`]) read the wall clock, to time the CPU work of the dispatch
//! and combine stages; nothing the core decides depends on them.
//!
//! Numerics: the serving mode ([`LayerMode`]: the kernels'
//! [`ComputeMode`](expertmesh_quant::contract::ComputeMode) and the [`ResultWire`]) decides
//! what workers send back. With per-slot results (exact, exact-bf16) workers return one row per
//! (token, slot) and [`RouterCore`] sums them in slot order (`acc = acc + w·y`, then the shared
//! experts), the contract's §5, so outputs are bit-identical to the in-process reference (for
//! exact-bf16: the reference whose expert outputs are rounded to bf16) whatever the placement
//! or replica choice. With pre-combined results (accurate, serving) each worker sums its own
//! slots per token and the router adds the devices' partial sums in part order: fewer bytes,
//! bits that depend on the placement, within a stated tolerance of the f64 reference.
//!
//! Batching: a layer's pending batch is dispatched when its window closes, when it is full, or
//! as soon as every connected frontend ([`RouterCore::set_frontends`]) has a request in it —
//! nobody else can join, so waiting longer only adds latency.
//!
//! Bounds: a request that finds `max_inflight_batches` batches in flight is refused with
//! `Overloaded` (a layer's pending batch, opened below the limit, may still go out past it, so
//! batches in flight and pending stay within the limit plus one per layer), each batch holds at
//! most `max_batch_tokens` tokens, and every batch has a deadline after which its requests fail
//! with an error naming the devices that did not answer.
//!
//! Layout: this module holds the core's state and its API (every input the driver feeds it,
//! and the actions it takes out); each concern's logic lives in its own module:
//! * `config` — [`RouterConfig`], [`LayerMode`] and the wire format, the per-layer setup.
//! * `validate` — [`RequestValidator`]: frontend requests checked and decoded.
//! * `dispatch` — batching, gating, micro-batches, planning around dead and quarantined
//!   devices, dispatch frames and their payloads.
//! * `recovery` — re-dispatch after lost links, failed sends and error answers, hedged
//!   stragglers, deadlines, device faults, quarantine probes, stale incarnations.
//! * `combine` — worker results decoded into place, the router's own shared experts, and a
//!   finished batch combined into its requests' outputs.
//! * `invariants` — the rules the state keeps between inputs, checked after every input in
//!   debug builds.

mod combine;
mod config;
mod dispatch;
mod invariants;
mod recovery;
mod validate;

pub use config::{
    DEFAULT_MAX_DEADLINE, LayerMode, LayerSetup, ResultWire, RouterConfig, SharedRunner,
    SharedSite, UnknownLayerMode, part_slots,
};
pub use validate::{NON_FINITE_INPUT, Rejection, Request, RequestValidator};

use crate::gating::Routing;
use crate::health::{Health, HedgePolicy};
use crate::plan::{DevicePlan, LayerOwners, Replicas};
use crate::ranks::RankNames;
use expertmesh_topology::model::ModelSpec;
use expertmesh_transport::codec::{ErrorCode, ExpertResult, LayerRequest, WireFormat};
use expertmesh_transport::mesh::OutFrame;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::{Duration, Instant};

/// Identifies a frontend connection to the driver.
pub type ClientId = u64;

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
    /// Worker links the core has taken up: the link came up and the worker announced what it
    /// holds (it counts the device live from then on).
    pub peer_ups: u64,
    /// Result and error frames dropped because their batch id carries another router
    /// incarnation: work dispatched by an earlier router process on this rank.
    pub stale_results: u64,
    /// Parts sent to a replica as well (or re-planned where no one replica holds them)
    /// because their device had not answered within its hedge timeout.
    pub hedges: u64,
    /// Times a device was taken out of replica choice (quarantined).
    pub quarantines: u64,
    /// Times a quarantined device answered its probe in time and came back.
    pub quarantine_releases: u64,
    /// Probes sent (a live part mirrored to a device whose quarantine ran out).
    pub probes: u64,
    /// Workers' announcements of what they hold taken into the owners
    /// ([`RouterCore::set_holdings`]).
    pub holdings: u64,
}

#[derive(Clone, Copy)]
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

impl Pending {
    /// The batch of the members `keep` accepts, in order: their tokens' rows of `x` (`hidden`
    /// wide), of `logits` (`experts` wide, the batch's gated logits, returned beside it) and
    /// of `logits_given`, their connections, and the latest of their deadlines. `None` when
    /// none is kept.
    fn retain_members(
        &self,
        hidden: usize,
        experts: usize,
        logits: &[f32],
        keep: impl Fn(&Member) -> bool,
    ) -> Option<(Pending, Vec<f32>)> {
        let (h, e) = (hidden, experts);
        let mut kept = Pending {
            members: Vec::with_capacity(self.members.len()),
            x: Vec::with_capacity(self.x.len()),
            logits: Vec::new(),
            logits_given: Vec::with_capacity(self.logits_given.len()),
            clients: Vec::new(),
            flush_at: self.flush_at,
            deadline: self.deadline,
        };
        let mut kept_logits = Vec::with_capacity(logits.len());
        let mut deadline = None;
        for m in self.members.iter().filter(|m| keep(m)) {
            let (from, to) = (m.offset, m.offset + m.tokens);
            kept.members.push(Member {
                offset: kept.logits_given.len(),
                ..*m
            });
            kept.x.extend_from_slice(&self.x[from * h..to * h]);
            kept_logits.extend_from_slice(&logits[from * e..to * e]);
            kept.logits_given
                .extend_from_slice(&self.logits_given[from..to]);
            if !kept.clients.contains(&m.client) {
                kept.clients.push(m.client);
            }
            deadline = deadline.max(Some(m.deadline));
        }
        kept.deadline = deadline?;
        Some((kept, kept_logits))
    }
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
    /// The part covering the same pairs on another device, when this one was hedged (or is
    /// the hedge): both stay live and the first answer of the two is taken, the other part
    /// retired ([`Inflight::retire`]). A hedge that superseded its part instead could bounce
    /// between two owners that are both slower than their hedge timeout (a load spike) until
    /// the batch gave up, every late answer dropped.
    twin: Option<u32>,
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
    /// When its batch window opened (the end-to-end latency of its requests starts there).
    opened: Instant,
    /// Parts re-sent so far (bounded: [`RouterCore::max_resends`]).
    resends: usize,
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
    /// Names of the mesh ranks (messages, logs, metrics).
    ranks: RankNames,
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
    /// Actions not yet taken by the driver, oldest first.
    actions: VecDeque<Action>,
    stats: RouterStats,
    /// Prometheus figures ([`crate::metrics`]).
    metrics: crate::metrics::CoreMetrics,
}

impl RouterCore {
    /// A router for `spec` over `layers`. `ranks` names the mesh ranks in messages (the routers
    /// first: their number comes from the deployment);
    /// `replicas` carries node locality and starts with every worker considered alive.
    /// `incarnation` (nonzero; the service's `fresh_incarnation` for a router process) goes
    /// into the high 32 bits of every batch id ([`RouterCore::incarnation`]).
    pub fn new(
        spec: ModelSpec,
        cfg: RouterConfig,
        layers: Vec<LayerSetup>,
        replicas: Replicas,
        ranks: RankNames,
        shared_runner: Option<Box<dyn SharedRunner>>,
        incarnation: u32,
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
        let metrics = crate::metrics::CoreMetrics::new(&layer_ids, e as usize, &ranks);
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
            ranks,
            shared_runner,
            pending: BTreeMap::new(),
            inflight: BTreeMap::new(),
            next_batch: 1,
            incarnation: incarnation.max(1),
            health,
            probes: HashMap::new(),
            last_stale_warn: None,
            actions: VecDeque::new(),
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

    /// The most experts of one token a part to one device can carry: the routed top-k, plus
    /// the shared experts where some layer runs them on a worker (dispatched as extra slots).
    pub fn max_slots_per_token(&self) -> usize {
        let shared_on_a_worker = self
            .layers
            .values()
            .any(|l| matches!(l.shared, SharedSite::Rank(_)));
        part_slots(&self.spec, shared_on_a_worker)
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

    /// The quarantine probe out to `rank` now, as (batch, part), if any.
    pub fn probe_out_to(&self, rank: u32) -> Option<(u64, u32)> {
        self.health.probe_of(rank)
    }

    /// Layers served, ascending.
    pub fn layers(&self) -> Vec<u32> {
        let mut l: Vec<u32> = self.layers.keys().copied().collect();
        l.sort_unstable();
        l
    }

    /// The worker ranks that own routed expert `expert` of `layer` and may be chosen now
    /// (their link is up and they announced it), ascending; empty for an unknown layer.
    pub fn live_owners(&self, layer: u32, expert: u32) -> Vec<u32> {
        self.layers
            .get(&layer)
            .and_then(|s| s.owners.owners.get(expert as usize))
            .map(|list| {
                list.iter()
                    .copied()
                    .filter(|&r| self.replicas.alive.get(r as usize) == Some(&true))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Routed experts of this router's layers that no worker `live` says yes to owns: with
    /// the workers that joined this router (link up, holdings announced), the experts a
    /// request may touch and fail on. (The core's own liveness starts with every worker up,
    /// so that a worker is tried before its link ever came up: not a measure of coverage.)
    pub fn uncovered_experts(&self, live: impl Fn(u32) -> bool) -> usize {
        let alive = |r: &u32| live(*r);
        self.layers
            .values()
            .map(|s| {
                s.owners
                    .owners
                    .iter()
                    .filter(|list| !list.iter().any(alive))
                    .count()
            })
            .sum()
    }

    /// Batches in flight.
    pub fn inflight(&self) -> usize {
        self.inflight.len()
    }

    /// The next action for the driver, oldest first; `None` when there is none. The driver
    /// takes actions until `None` after every input it feeds (actions taken, the queue keeps
    /// its capacity: no allocation per pass).
    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
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
    /// (`rank` minus the number of routers), or the router's name ([`RankNames::label`]).
    pub fn name(&self, rank: u32) -> String {
        self.ranks.label(rank)
    }

    /// [`RouterCore::name`] of every mesh rank, for the service's logs.
    pub fn rank_labels(&self) -> Vec<String> {
        self.ranks.labels()
    }

    /// The names of the mesh ranks and how many routers lead them.
    pub fn rank_names(&self) -> &RankNames {
        &self.ranks
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
        self.admit(req, now);
        self.debug_check();
    }

    /// The driver's count of open frontend connections. A pending batch that holds a request of
    /// every one of them is dispatched at once (in [`Self::submit`], or here when a connection
    /// closed): nobody else can join it. Until the driver calls this, only the window, a full
    /// batch or a zero window dispatch.
    pub fn set_frontends(&mut self, open: usize, now: Instant) {
        self.frontends = Some(open);
        self.flush_joined_by(open, now);
        self.debug_check();
    }

    /// Handle timers: close batch windows, re-send stragglers, fail requests past deadline.
    pub fn on_tick(&mut self, now: Instant) {
        self.flush_due(now);
        self.expire_probes(now);
        self.watch_inflight(now);
        self.debug_check();
    }

    /// A worker's result frame arrived.
    pub fn on_result(&mut self, from: u32, res: &ExpertResult, payload: &[u8], now: Instant) {
        self.take_result(from, res, payload, now);
        self.debug_check();
    }

    /// A worker answered a dispatch with an error frame. Frames of another router incarnation
    /// are dropped, and so is the error of a part already answered or re-sent elsewhere (the
    /// batch goes on). When a node's leader could not serve a part through its node
    /// (`PeerUnavailable` with per-node dedup on: a peer unreachable, or a live placement
    /// change the leader had not heard of yet), its parts are sent again straight to the devices,
    /// so the router's own view of them decides (a replica elsewhere, the device itself over
    /// its own link, or a clean error naming it). An error that is the device's own (internal,
    /// overloaded, an expert not loaded there, shutting down) counts against the device and
    /// its parts go to replicas when every one of their experts has another live owner;
    /// otherwise the batch fails with the device's message.
    ///
    /// `part` is the part the error names (workers name the part of the dispatch they
    /// answer): an error for the quarantine probe out to the device counts against the probe
    /// alone, and one for a live part touches only that part. An error that names no part is
    /// taken for the probe (when one of this batch is out to the device) and for every live
    /// part of the batch on the device.
    pub fn on_worker_error(
        &mut self,
        from: u32,
        request_id: u64,
        part: Option<u32>,
        code: ErrorCode,
        message: &str,
        now: Instant,
    ) {
        self.take_worker_error(from, request_id, part, code, message, now);
        self.debug_check();
    }

    /// A link to a worker failed: its outstanding parts go to replicas, or their batches fail.
    pub fn on_peer_lost(&mut self, rank: u32, now: Instant) {
        self.peer_lost(rank, now);
        self.debug_check();
    }

    /// A link to a worker came up but the worker has not said what it holds yet: it is not
    /// chosen for parts until it has ([`RouterCore::on_peer_up`], after its announcement
    /// went through [`RouterCore::set_holdings`]), so a router that restarted with an older
    /// placement file never sends it an expert it no longer holds. (The old link's parts were
    /// handled when it was lost: the mesh reports a replaced link lost before the new one is
    /// up. Parts sent in the moment between the new link's install and that report went on
    /// the new link and are sent again, to a replica, when the report is taken.)
    pub fn on_peer_joining(&mut self, rank: u32) {
        if let Some(a) = self.replicas.alive.get_mut(rank as usize) {
            *a = false;
        }
        self.debug_check();
    }

    /// A link to a worker is (again) established and the worker may be chosen.
    pub fn on_peer_up(&mut self, rank: u32) {
        self.stats.peer_ups += 1;
        if let Some(a) = self.replicas.alive.get_mut(rank as usize) {
            *a = true;
        }
        self.debug_check();
    }

    /// Worker `rank` serves exactly `held` ((layer, expert) pairs) from now on (its
    /// announcement during a live placement change, or when its link comes up): it becomes an
    /// owner of those experts of this router's layers and stops being one of every other
    /// (pairs of layers this router does not serve are ignored). Parts already sent are not
    /// touched: a worker keeps what it releases until every router has seen its new set.
    /// Returns the experts of this router's layers that no rank owns any more, ascending.
    ///
    /// # Errors
    /// A rank that is not a worker's, or an expert outside the model; nothing changes then.
    pub fn set_holdings(
        &mut self,
        rank: u32,
        held: &[(u32, u32)],
    ) -> Result<Vec<(u32, u32)>, String> {
        let experts = self.spec.routed_experts;
        if rank < self.ranks.routers() || rank as usize >= self.replicas.alive.len() {
            return Err(format!("mesh rank {rank} is not a worker of this fabric"));
        }
        if let Some(&(l, e)) = held.iter().find(|&&(_, e)| e >= experts) {
            return Err(format!(
                "layer {l} expert {e} is outside the model's {experts} routed experts"
            ));
        }
        let mut orphans = Vec::new();
        let mut layers: Vec<u32> = self.layers.keys().copied().collect();
        layers.sort_unstable();
        for l in layers {
            let mine: std::collections::BTreeSet<u32> = held
                .iter()
                .filter(|&&(hl, _)| hl == l)
                .map(|&(_, e)| e)
                .collect();
            let setup = self.layers.get_mut(&l).expect("listed above");
            let ext = self.owners_ext.get_mut(&l).expect("one per layer");
            for e in 0..experts {
                let list = &mut setup.owners.owners[e as usize];
                list.retain(|&r| r != rank);
                if mine.contains(&e) {
                    let at = list.partition_point(|&r| r < rank);
                    list.insert(at, rank);
                }
                if list.is_empty() {
                    orphans.push((l, e));
                }
                ext.owners[e as usize].clone_from(list);
            }
        }
        self.stats.holdings += 1;
        self.debug_check();
        Ok(orphans)
    }

    /// Sending a part failed (the link went down while the send waited).
    pub fn on_send_failed(&mut self, rank: u32, batch: u64, part: u32, now: Instant) {
        self.send_failed(rank, batch, part, now);
        self.debug_check();
    }

    /// The driver did not send part `part` of batch `batch` to `rank`: frames already wait
    /// for that worker up to its bound (it is not taking them). Unlike a failed send the link
    /// is up: the device is charged a fault, not marked lost.
    pub fn on_send_refused(&mut self, rank: u32, batch: u64, part: u32, now: Instant) {
        self.send_refused(rank, batch, part, now);
        self.debug_check();
    }

    /// Run work deferred until the driver has sent the latest dispatch frames: the shared
    /// experts of batches whose shared experts live on the router. Call once the actions are
    /// taken ([`RouterCore::poll_action`] gave `None`), then take the new ones.
    pub fn run_deferred(&mut self, now: Instant) {
        self.run_router_shared(now);
        self.debug_check();
    }

    /// Whether [`RouterCore::run_deferred`] has work.
    pub fn has_deferred(&self) -> bool {
        self.inflight.values().any(|b| b.shared_pending)
    }

    fn fail_one(&mut self, client: ClientId, request_id: u64, code: ErrorCode, message: String) {
        self.stats.failures += 1;
        self.metrics.on_error(code);
        self.actions.push_back(Action::Fail {
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
}
