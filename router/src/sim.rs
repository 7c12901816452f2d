//! A simulated cluster for the router core: the one harness its tests drive it with.
//!
//! Why this exists: the core is sans-IO, so its tests run it in process, against simulated
//! devices, on a virtual clock. Every such test needs the same cluster: synthetic weights,
//! each device's experts, the layer setups, a core, devices that answer dispatches, and a pump
//! that carries out the core's actions (sends answered at once, after a latency, held, failed,
//! or never; answers recorded). It is built here once.
//!
//! Why here: the router's own tests (`router/tests/it`) cannot depend on the worker crate (it
//! depends on this one), and the worker's tests (`worker/tests/it`) run the real dispatch
//! executor and CPU backend as devices. So the harness lives in the router crate and takes its
//! devices as [`SimWorker`]s: the router's tests answer with zero rows ([`ZeroRows`]), the
//! worker's wrap a `DispatchExecutor`. It is compiled only with the `sim` cargo feature, which
//! both crates' dev-dependencies enable (and in the router's own unit tests): no build of the
//! binary links it.

use crate::core::{
    Action, ClientId, LayerSetup, Request, RouterConfig, RouterCore, SharedRunner, SharedSite,
};
use crate::plan::{LayerOwners, Replicas};
use crate::ranks::RankNames;
use crate::reference::{self, LayerWeights};
use bytes::Bytes;
use expertmesh_backend::{BackendError, ExpertKey};
use expertmesh_quant::contract::ComputeMode;
use expertmesh_quant::format::ExpertWeights;
use expertmesh_quant::reference as oracle;
use expertmesh_topology::model::ModelSpec;
use expertmesh_transport::codec::{Body, Dispatch, ErrorCode, ExpertResult, OutputLayout};
use expertmesh_transport::mesh::OutFrame;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// A device's answer to a dispatch: the result frame and its payload, or an error code and
/// message (an error frame).
pub type WorkerAnswer = Result<(ExpertResult, Bytes), (ErrorCode, String)>;

/// A request's answer as its client gets it: the output rows, or the error code and message.
pub type Answer = Result<Vec<f32>, (ErrorCode, String)>;

/// A simulated device: what it answers to a dispatch.
pub trait SimWorker {
    /// The answer to dispatch `d` carrying `payload`.
    fn answer(&mut self, d: &Dispatch, payload: &[u8]) -> WorkerAnswer;
}

/// A device that answers every dispatch with rows of zeros in the layout and dtype asked for
/// (for tests of the core's bookkeeping, not of its numbers).
#[derive(Clone, Copy, Debug, Default)]
pub struct ZeroRows;

impl SimWorker for ZeroRows {
    fn answer(&mut self, d: &Dispatch, _payload: &[u8]) -> WorkerAnswer {
        let rows = match d.layout {
            OutputLayout::PerSlot => d.experts.len() as u32,
            OutputLayout::PreCombined => d.tokens,
        };
        let res = ExpertResult {
            batch_id: d.batch_id,
            layer: d.layer,
            part: d.part,
            layout: d.layout,
            rows,
            hidden: d.hidden,
            dtype: d.result_dtype,
        };
        let bytes = rows as usize * d.hidden as usize * d.result_dtype.elem_bytes();
        Ok((res, Bytes::from(vec![0u8; bytes])))
    }
}

/// Shared experts on the router, computed with the scalar oracle in the batch's mode (what the
/// CPU backend computes bit for bit).
struct OracleShared {
    hidden: usize,
    layers: HashMap<u32, LayerWeights>,
}

impl SharedRunner for OracleShared {
    fn run(
        &mut self,
        layer: u32,
        x: &[f32],
        tokens: usize,
        mode: ComputeMode,
        out: &mut [f32],
    ) -> Result<(), BackendError> {
        let h = self.hidden;
        let lw = self.layers.get(&layer).ok_or(BackendError::NotLoaded)?;
        let s = lw.shared.len();
        for t in 0..tokens {
            let xt = &x[t * h..(t + 1) * h];
            let qa = oracle::QuantizedVec::new(xt);
            for (i, w) in lw.shared.iter().enumerate() {
                let y = &mut out[(t * s + i) * h..(t * s + i + 1) * h];
                match mode {
                    ComputeMode::Exact => oracle::expert_ffn_exact_quantized(w, &qa, y),
                    ComputeMode::Accurate => oracle::expert_ffn_accurate(w, xt, y),
                }
            }
        }
        Ok(())
    }
}

/// A request's answer and when (virtual time) it came.
#[derive(Debug)]
pub struct Reply {
    /// The frontend connection.
    pub client: ClientId,
    /// The request.
    pub request_id: u64,
    /// When it was answered.
    pub at: Instant,
    /// The answer.
    pub answer: Answer,
}

/// A dispatch a device took and has not answered yet.
#[derive(Debug)]
pub struct InFlight {
    /// When the answer reaches the router (`None`: held until [`Sim::deliver`]).
    pub at: Option<Instant>,
    /// The device's mesh rank.
    pub rank: u32,
    /// The dispatch's batch id.
    pub batch: u64,
    /// The dispatch's part.
    pub part: u32,
    /// The device's answer.
    pub answer: WorkerAnswer,
}

/// Makes the shared-expert runner of a router that keeps them (given the layers' weights).
type RunnerFactory = Box<dyn FnOnce(&HashMap<u32, LayerWeights>) -> Box<dyn SharedRunner>>;

/// How a simulated cluster is built ([`Sim::builder`]).
pub struct SimBuilder {
    spec: ModelSpec,
    assign: Vec<Vec<u32>>,
    shared: SharedSite,
    cfg: RouterConfig,
    seed: u64,
    device_prefix: String,
    tweak: Box<dyn FnOnce(&mut Replicas)>,
    router_shared: Option<RunnerFactory>,
}

impl std::fmt::Debug for SimBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimBuilder")
            .field("spec", &self.spec.name)
            .field("assign", &self.assign)
            .field("shared", &self.shared)
            .finish_non_exhaustive()
    }
}

impl SimBuilder {
    /// The model served.
    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    /// Where the shared experts run (default: nowhere; with `Rank(r)` device `r` holds them,
    /// with `Router` the router runs them with the scalar oracle unless
    /// [`SimBuilder::router_shared`] says otherwise).
    pub fn shared(mut self, site: SharedSite) -> Self {
        self.shared = site;
        self
    }

    /// The router's settings (default: [`RouterConfig::default`]).
    pub fn config(mut self, cfg: RouterConfig) -> Self {
        self.cfg = cfg;
        self
    }

    /// The seed of the synthetic weights (default 1).
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Devices are named `{prefix}{d}` (default `node0/dev`: `node0/dev0`, `node0/dev1`, ...).
    pub fn device_prefix(mut self, prefix: &str) -> Self {
        self.device_prefix = prefix.to_owned();
        self
    }

    /// Adjusts the router's replica state (nodes, locality, per-node dedup) before the core
    /// is built.
    pub fn replicas(mut self, tweak: impl FnOnce(&mut Replicas) + 'static) -> Self {
        self.tweak = Box::new(tweak);
        self
    }

    /// The router's shared-expert runner when they run on the router, made from the layers'
    /// weights (default: the scalar oracle).
    pub fn router_shared(
        mut self,
        runner: impl FnOnce(&HashMap<u32, LayerWeights>) -> Box<dyn SharedRunner> + 'static,
    ) -> Self {
        self.router_shared = Some(Box::new(runner));
        self
    }

    /// The cluster: mesh rank 0 is the router, rank `d + 1` device `d`, whose simulated worker
    /// `worker(rank, experts)` makes from the experts it holds (its routed experts of every
    /// layer, and the shared experts when they live on it).
    pub fn build(
        self,
        mut worker: impl FnMut(u32, Vec<(ExpertKey, ExpertWeights)>) -> Box<dyn SimWorker>,
    ) -> Sim {
        let spec = &self.spec;
        let layers: HashMap<u32, LayerWeights> = spec
            .moe_layer_ids()
            .into_iter()
            .map(|l| {
                let w = reference::synthetic_layer(spec, self.seed, l).expect("a known preset");
                (l, w)
            })
            .collect();
        let mut owners = vec![Vec::new(); spec.routed_experts as usize];
        for (d, experts) in self.assign.iter().enumerate() {
            for &x in experts {
                owners[x as usize].push(d as u32 + 1);
            }
        }
        for o in &mut owners {
            o.dedup();
        }
        let setups = layers
            .iter()
            .map(|(&l, lw)| LayerSetup {
                layer: l,
                gate: lw.gate.clone(),
                owners: LayerOwners {
                    owners: owners.clone(),
                },
                shared: self.shared,
            })
            .collect();
        let workers = (1..=self.assign.len() as u32)
            .map(|rank| (rank, worker(rank, self.experts_of(rank, &layers))))
            .collect();
        let names: Vec<String> = std::iter::once("router".to_owned())
            .chain((0..self.assign.len()).map(|d| format!("{}{d}", self.device_prefix)))
            .collect();
        let mut replicas = Replicas::new(names.len());
        replicas.alive[0] = false; // the router itself owns nothing
        (self.tweak)(&mut replicas);
        let runner = match (self.shared, self.router_shared) {
            (SharedSite::Router, Some(make)) => Some(make(&layers)),
            (SharedSite::Router, None) => Some(Box::new(OracleShared {
                hidden: spec.hidden as usize,
                layers: layers.clone(),
            }) as Box<dyn SharedRunner>),
            _ => None,
        };
        let core = RouterCore::new(
            spec.clone(),
            self.cfg,
            setups,
            replicas,
            RankNames::new(names, 1),
            runner,
            SIM_INCARNATION,
        );
        Sim {
            core,
            layers,
            workers,
            now: Instant::now(),
            deadline: Duration::from_secs(5),
            latency: HashMap::new(),
            hold: false,
            down: Vec::new(),
            silent: Vec::new(),
            backlogged: Vec::new(),
            erroring: HashMap::new(),
            failing_probes: HashMap::new(),
            wrong_shape: Vec::new(),
            cut_off_leaders: Vec::new(),
            queue: Vec::new(),
            sent: HashMap::new(),
            replies: Vec::new(),
        }
    }

    /// The experts mesh rank `rank` (device `rank - 1`) holds, keyed, in every layer.
    fn experts_of(
        &self,
        rank: u32,
        layers: &HashMap<u32, LayerWeights>,
    ) -> Vec<(ExpertKey, ExpertWeights)> {
        let mut list = Vec::new();
        for (&layer, lw) in layers {
            let key = |expert| ExpertKey { layer, expert };
            let routed = &self.assign[rank as usize - 1];
            list.extend(
                routed
                    .iter()
                    .map(|&x| (key(x), lw.experts[x as usize].clone())),
            );
            if self.shared == SharedSite::Rank(rank) {
                let e = self.spec.routed_experts;
                let shared = lw.shared.iter().enumerate();
                list.extend(shared.map(|(i, w)| (key(e + i as u32), w.clone())));
            }
        }
        list
    }
}

/// The incarnation of a simulated router (tests that need others set them).
pub const SIM_INCARNATION: u32 = 1;

/// A router core and its simulated devices on a virtual clock. Mesh rank 0 is the router,
/// ranks 1.. the devices. The knobs are public: a test sets how each device behaves, then
/// submits requests and moves the clock.
pub struct Sim {
    /// The core under test.
    pub core: RouterCore,
    /// The synthetic weights of every MoE layer (for references).
    pub layers: HashMap<u32, LayerWeights>,
    /// The simulated devices, by mesh rank.
    pub workers: HashMap<u32, Box<dyn SimWorker>>,
    /// The virtual clock.
    pub now: Instant,
    /// Deadline of the requests of [`Sim::request`] and [`Sim::call`], from submission.
    pub deadline: Duration,
    /// Per device, how long its answers take (absent: answered at once, within the pump).
    pub latency: HashMap<u32, Duration>,
    /// Every answer is held until [`Sim::deliver`].
    pub hold: bool,
    /// Devices whose link is down: a send to them fails.
    pub down: Vec<u32>,
    /// Devices that take dispatches and never answer (paused).
    pub silent: Vec<u32>,
    /// Devices whose link is up but whose backlog of unsent frames is full: the driver does
    /// not send to them ([`RouterCore::on_send_refused`]).
    pub backlogged: Vec<u32>,
    /// Devices that answer every dispatch with this error ("expert not loaded here").
    pub erroring: HashMap<u32, ErrorCode>,
    /// Devices that answer their quarantine probe with this error, at once (before the
    /// answers to their other dispatches), and every other dispatch as usual.
    pub failing_probes: HashMap<u32, ErrorCode>,
    /// Devices whose results carry one row fewer than asked (a build that disagrees on the
    /// result's shape).
    pub wrong_shape: Vec<u32>,
    /// Node leaders that cannot reach their node peers: a dispatch holding experts they do not
    /// own is answered `PeerUnavailable` (as `worker::fanout` does) instead of `NotFound`.
    pub cut_off_leaders: Vec<u32>,
    /// Answers on their way back to the router (or held).
    pub queue: Vec<InFlight>,
    /// Dispatches sent, per device.
    pub sent: HashMap<u32, usize>,
    /// Every answer the core gave, in order.
    pub replies: Vec<Reply>,
}

impl std::fmt::Debug for Sim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sim")
            .field("now", &self.now)
            .field("queue", &self.queue.len())
            .field("replies", &self.replies)
            .finish_non_exhaustive()
    }
}

impl Sim {
    /// A cluster of `spec` whose device `d` (mesh rank `d + 1`) holds the routed experts
    /// `assign[d]` of every MoE layer.
    pub fn builder(spec: &ModelSpec, assign: &[Vec<u32>]) -> SimBuilder {
        SimBuilder {
            spec: spec.clone(),
            assign: assign.to_vec(),
            shared: SharedSite::None,
            cfg: RouterConfig::default(),
            seed: 1,
            device_prefix: "node0/dev".to_owned(),
            tweak: Box::new(|_| {}),
            router_shared: None,
        }
    }

    /// Hands the core request `request_id` of `client` for `layer` (the tokens of `x`, moved
    /// in), due `deadline` from now. Nothing is pumped.
    pub fn submit(
        &mut self,
        client: ClientId,
        request_id: u64,
        layer: u32,
        x: Vec<f32>,
        deadline: Duration,
    ) {
        let tokens = x.len() / self.core.spec().hidden as usize;
        let req = Request {
            client,
            request_id,
            layer,
            tokens,
            x,
            logits: None,
            deadline: self.now + deadline,
        };
        self.core.submit(req, self.now);
    }

    /// Submits request `request_id` of client 1 for `layer`, due [`Sim::deadline`] from now,
    /// and pumps.
    pub fn request(&mut self, request_id: u64, layer: u32, x: &[f32]) {
        self.submit(1, request_id, layer, x.to_vec(), self.deadline);
        self.pump();
    }

    /// Submits request `request_id` of client 1 for `layer` and runs the virtual clock in 1 ms
    /// steps until it is answered (11 s at most): how long it took, and its answer.
    pub fn call(&mut self, request_id: u64, layer: u32, x: Vec<f32>) -> (Duration, Answer) {
        let start = self.now;
        self.submit(1, request_id, layer, x, self.deadline);
        self.pump();
        let mut step = start;
        loop {
            if let Some((at, answer)) = self.take_timed(request_id) {
                return (at - start, answer);
            }
            assert!(
                step < start + Duration::from_secs(11),
                "request {request_id} never answered"
            );
            step += Duration::from_millis(1);
            self.run_until(step);
        }
    }

    /// Carries out the core's actions until it has none left (and no deferred work): sends
    /// reach their devices, whose answers come back at once unless delayed, held or lost;
    /// answers are recorded in [`Sim::replies`].
    pub fn pump(&mut self) {
        let mut taken = 0u32;
        loop {
            while let Some(action) = self.core.poll_action() {
                taken += 1;
                assert!(taken < 1_000_000, "the router did not settle");
                self.act(action);
            }
            if !self.core.has_deferred() {
                return;
            }
            self.core.run_deferred(self.now);
        }
    }

    /// Lets `d` pass at once, runs the core's timers once, and pumps.
    pub fn advance(&mut self, d: Duration) {
        self.now += d;
        self.core.on_tick(self.now);
        self.pump();
    }

    /// Runs the virtual clock to `until`: delayed answers are delivered and the core's timers
    /// fire in time order, each followed by a pump.
    pub fn run_until(&mut self, until: Instant) {
        loop {
            let answer = self.queue.iter().filter_map(|f| f.at).min();
            let timer = self.core.next_timeout();
            let next = [answer, timer]
                .into_iter()
                .flatten()
                .filter(|&t| t <= until)
                .min();
            let Some(t) = next else {
                self.now = until;
                self.core.on_tick(until);
                self.pump();
                return;
            };
            self.now = self.now.max(t);
            if answer == Some(t) {
                let i = self.queue.iter().position(|f| f.at == Some(t));
                let f = self.queue.swap_remove(i.expect("an answer is due"));
                self.reach_router(f.rank, f.batch, f.part, f.answer);
            } else {
                self.core.on_tick(self.now);
            }
            self.pump();
        }
    }

    /// Delivers every held answer, in the order the dispatches were sent, pumping after each.
    pub fn deliver(&mut self) {
        let (held, rest) = std::mem::take(&mut self.queue)
            .into_iter()
            .partition(|f| f.at.is_none());
        self.queue = rest;
        for f in held {
            self.reach_router(f.rank, f.batch, f.part, f.answer);
            self.pump();
        }
    }

    /// The first answer to request `request_id` (of any client), taken out of the replies.
    pub fn take(&mut self, request_id: u64) -> Option<Answer> {
        self.take_timed(request_id).map(|(_, a)| a)
    }

    /// [`Sim::take`], with when the answer came.
    pub fn take_timed(&mut self, request_id: u64) -> Option<(Instant, Answer)> {
        let i = self
            .replies
            .iter()
            .position(|r| r.request_id == request_id)?;
        let r = self.replies.remove(i);
        Some((r.at, r.answer))
    }

    /// Whether request `request_id` (of any client) has an answer not yet taken.
    pub fn answered(&self, request_id: u64) -> bool {
        self.replies.iter().any(|r| r.request_id == request_id)
    }

    /// Every answer to request `request_id` of `client` not yet taken, in order (a request
    /// answered twice shows up twice).
    pub fn replies_to(&self, client: ClientId, request_id: u64) -> Vec<&Answer> {
        self.replies
            .iter()
            .filter(|r| (r.client, r.request_id) == (client, request_id))
            .map(|r| &r.answer)
            .collect()
    }

    fn act(&mut self, action: Action) {
        let (client, request_id, answer) = match action {
            Action::Send {
                rank,
                frame,
                batch,
                part,
            } => return self.send(rank, frame, batch, part),
            Action::Respond {
                client,
                request_id,
                output,
                ..
            } => (client, request_id, Ok(output)),
            Action::Fail {
                client,
                request_id,
                code,
                message,
            } => (client, request_id, Err((code, message))),
        };
        let at = self.now;
        self.replies.push(Reply {
            client,
            request_id,
            at,
            answer,
        });
    }

    /// One dispatch reaches device `rank` (or fails to).
    fn send(&mut self, rank: u32, frame: OutFrame, batch: u64, part: u32) {
        *self.sent.entry(rank).or_default() += 1;
        if self.down.contains(&rank) {
            self.core.on_send_failed(rank, batch, part, self.now);
            return;
        }
        if self.backlogged.contains(&rank) {
            self.core.on_send_refused(rank, batch, part, self.now);
            return;
        }
        if self.silent.contains(&rank) {
            return;
        }
        let Body::Dispatch(d) = &frame.body else {
            panic!("router sent {:?}", frame.body)
        };
        if let Some(&code) = self.failing_probes.get(&rank)
            && self.core.probe_out_to(rank) == Some((batch, part))
        {
            let answer = Err((code, "the probe's dispatch failed".to_owned()));
            return self.reach_router(rank, batch, part, answer);
        }
        let mut answer = self.answer_of(rank, d, &frame.payload);
        if let Ok((res, bytes)) = &mut answer
            && self.wrong_shape.contains(&rank)
        {
            let row = bytes.len() / res.rows as usize;
            res.rows -= 1;
            *bytes = bytes.slice(..bytes.len() - row);
        }
        let at = match (self.hold, self.latency.get(&rank)) {
            (true, _) => None,
            (false, Some(&l)) => Some(self.now + l),
            (false, None) => return self.reach_router(rank, d.batch_id, d.part, answer),
        };
        self.queue.push(InFlight {
            at,
            rank,
            batch: d.batch_id,
            part: d.part,
            answer,
        });
    }

    /// What device `rank` answers to `d`.
    fn answer_of(&mut self, rank: u32, d: &Dispatch, payload: &[u8]) -> WorkerAnswer {
        if let Some(&code) = self.erroring.get(&rank) {
            return Err((code, "expert not loaded here".to_owned()));
        }
        let worker = self.workers.get_mut(&rank);
        let answer = worker
            .unwrap_or_else(|| panic!("no device at mesh rank {rank}"))
            .answer(d, payload);
        match answer {
            Ok((res, bytes)) => {
                assert_eq!(
                    res.dtype, d.result_dtype,
                    "the worker answers in the dtype asked"
                );
                Ok((res, bytes))
            }
            Err((ErrorCode::NotFound, _)) if self.cut_off_leaders.contains(&rank) => Err((
                ErrorCode::PeerUnavailable,
                "a node peer is not connected to this leader".to_owned(),
            )),
            Err(e) => Err(e),
        }
    }

    /// Device `rank`'s answer to part `part` of batch `batch` reaches the core now (an error
    /// names the part, as workers' do).
    fn reach_router(&mut self, rank: u32, batch: u64, part: u32, answer: WorkerAnswer) {
        match answer {
            Ok((res, bytes)) => self.core.on_result(rank, &res, &bytes, self.now),
            Err((code, message)) => {
                self.core
                    .on_worker_error(rank, batch, Some(part), code, &message, self.now)
            }
        }
    }
}
