//! The router service: the I/O driver around [`RouterCore`].
//!
//! Why this exists: the core decides, this module moves bytes and time. It accepts frontend
//! connections (transport's framed TCP), decodes and validates their `LayerRequest`s in the
//! connection tasks, runs the core on its own thread (gating, planning, quantizing activations
//! and combining are CPU work that must not stall the async runtime), sends the core's dispatch
//! frames over the worker mesh, feeds worker results and peer notices back, and writes responses.
//!
//! Hops on the hot path: the core thread polls the mesh's event queue itself, so a worker's
//! result goes from the thread that read it (the shared-memory ring's consumer thread, or the
//! TCP reader) straight to the core thread; and each dispatch frame is first written from the
//! core thread (a task takes over only a send that must wait for credit or a busy link).
//!
//! Batching: the service tells the core how many frontend connections are open
//! ([`RouterCore::set_frontends`]), so a batch window closes as soon as every connected frontend
//! has a request pending for that layer — one frontend alone never waits for the window.
//!
//! Bounds: each connection has at most `max_outstanding_per_client` requests in flight (the
//! reader stops reading until a response frees a slot, so TCP backpressure reaches the
//! frontend); the core bounds batches in flight; sends wait for the mesh's per-peer credit.
//! Admission ([`crate::admission`]) is decided from each request's header and metadata before
//! its payload is read: past the router's capacity (`RouterConfig::max_inflight_requests`,
//! `max_inflight_tokens`) or the connection's fair share of it, the request is answered
//! `Overloaded` and its payload skipped through a small fixed buffer, so shedding costs neither
//! memory nor decoding. After a burst the allocator's free pages are returned to the system
//! ([`MemoryTrim`]), so the router's memory comes back to its baseline.
//! A frame whose header is intact but whose content is bad is answered with an error frame and
//! the connection goes on; a broken stream closes only that connection. A client that closes
//! its side after its requests (`shutdown(SHUT_WR)`: done sending) still gets every answer,
//! then the end of the stream.

use crate::admission::{Admission, AdmissionLimits, Shed};
use crate::client::placement::Applied;
use crate::confirmations::Confirmations;
use crate::core::{Action, ClientId, RouterCore};
use crate::rebalance::{ChangeAction, Coordinator};
use crate::relay::{ChunkRoute, RelayAction, Relays};
use expertmesh_transport::codec::{
    Body, ErrorCode, LayerRequest, LayerResponse, Placement, PlacementOp, encode_placement_entries,
    placement_entries, placement_message,
};
use expertmesh_transport::dtype::{self, OutputDtype};
use expertmesh_transport::frontend::{
    FrameHead, FrameListener, FrameReader, FrameWriter as FrontendWriter, FrontendConfig,
    FrontendError, IncomingClient, MAX_HEAD_META_BYTES,
};
use expertmesh_transport::mesh::{
    Mesh, MeshConfig, MeshEvents, OutFrame, StartError, Transport, TransportEvent,
};
use expertmesh_transport::{MemoryBudget, MemoryReservation};
use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};
use tokio::sync::{Semaphore, mpsc};

/// Service settings.
#[derive(Clone, Debug)]
pub struct ServiceConfig {
    /// Where frontends connect.
    pub frontend_listen: SocketAddr,
    /// Frontend connection settings (cluster name, secret, codec).
    pub frontend: FrontendConfig,
    /// Requests one connection may have in flight.
    pub max_outstanding_per_client: usize,
}

/// Why the service could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServiceError {
    /// The worker mesh could not start.
    #[error("worker mesh: {0}")]
    Mesh(#[from] StartError),
    /// The frontend port could not be bound.
    #[error("cannot listen for frontends on {addr}: {source}")]
    Listen {
        /// Address.
        addr: SocketAddr,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// The async runtime could not start.
    #[error("cannot start the router runtime: {0}")]
    Runtime(std::io::Error),
    /// Micro-batches too large for one frame of this model and mode.
    #[error(
        "micro-batches of {micro_batch} tokens are too large for {model} in this mode: a part \
         to one device (up to {slots} experts per token) would not fit a {max_frame_bytes}-byte \
         frame (or its metadata the 1 MiB head of one); use micro-batches of {fits} tokens or \
         less (`--micro-batch`; workers started apart need a matching `--max-tokens`)"
    )]
    MicroBatchTooLarge {
        /// The configured micro-batch (tokens).
        micro_batch: usize,
        /// The model.
        model: String,
        /// Experts of one token a part may carry (routed top-k, and shared experts on a worker).
        slots: usize,
        /// The mesh's frame limit.
        max_frame_bytes: usize,
        /// The largest micro-batch that fits.
        fits: usize,
    },
    /// Not even one token's part fits a frame in this mode.
    #[error(
        "one token of {model} in this mode does not fit a {max_frame_bytes}-byte frame (up to \
         {slots} experts per token on one device): choose a mode with smaller results (serving \
         or exact-bf16)"
    )]
    TokenTooLarge {
        /// The model.
        model: String,
        /// Experts of one token a part may carry.
        slots: usize,
        /// The mesh's frame limit.
        max_frame_bytes: usize,
    },
    /// Request limits that would refuse every request, or every request above a size, for
    /// ever.
    #[error(
        "requests of up to {max_request_tokens} tokens (`--max-tokens`) with at most \
         {max_inflight_tokens} tokens in flight (`--max-inflight-tokens`): {why}"
    )]
    RequestLimits {
        /// The largest request accepted.
        max_request_tokens: usize,
        /// The tokens the router admits at once.
        max_inflight_tokens: usize,
        /// What is wrong and what to change.
        why: &'static str,
    },
    /// The answer to the largest request accepted would not fit a frontend frame.
    #[error(
        "the answer to a request of {max_request_tokens} tokens (`--max-tokens`) is \
         {answer_bytes} bytes ({max_request_tokens} x {hidden} f32 values and its header), more \
         than a frontend frame's {max_frame_bytes}: lower --max-tokens to {fits} or less"
    )]
    AnswerTooLarge {
        /// The largest request accepted.
        max_request_tokens: usize,
        /// The model's hidden size.
        hidden: usize,
        /// The frame that answer needs.
        answer_bytes: usize,
        /// The frontend's frame limit.
        max_frame_bytes: usize,
        /// The most tokens whose answer fits.
        fits: usize,
    },
}

enum CoreInput {
    Request(crate::core::Request),
    /// The number of open frontend connections changed (the core closes a batch window early
    /// once every one of them has a request pending). The core reads the count itself when
    /// it takes this notice: notices of different connections may arrive in any order, the
    /// count read last is the current one.
    Frontends,
    SendFailed {
        rank: u32,
        batch: u64,
        part: u32,
    },
    /// A dispatch not sent: the rank's [`SendBacklog`] is full.
    SendRefused {
        rank: u32,
        batch: u64,
        part: u32,
    },
    /// A frontend asks to apply a placement to the running fabric (or this process does:
    /// `reply` set, [`PlacementHandle`]).
    Apply {
        client: ClientId,
        request_id: u64,
        entries: Vec<(u32, u32, u32)>,
        timeout: Duration,
        reply: Option<std_mpsc::Sender<Result<Applied, String>>>,
    },
    Stop,
}

enum ClientMsg {
    Response {
        request_id: u64,
        tokens: usize,
        hidden: usize,
        output: Vec<f32>,
        /// The request's admitted share, held until the answer is written.
        share: Option<AnswerShare>,
    },
    Error {
        request_id: u64,
        code: ErrorCode,
        message: String,
        /// The request's admitted share (a request the core failed), held until written.
        share: Option<AnswerShare>,
    },
    /// A placement change answered ([`PlacementOp::Applied`]).
    Placement(Placement),
}

/// A running router service. Dropping it (or [`RouterService::shutdown`]) stops everything.
pub struct RouterService {
    runtime: Option<tokio::runtime::Runtime>,
    core_thread: Option<std::thread::JoinHandle<()>>,
    input: CoreTx,
    frontend_addr: SocketAddr,
    mesh: Mesh,
    stats: Arc<Mutex<crate::core::RouterStats>>,
    metrics: Arc<crate::metrics::RouterMetrics>,
    ranks: crate::ranks::RankNames,
    admission: Arc<AdmissionGate>,
    /// The request ids of in-process placement changes, shared by every handle.
    placement_requests: Arc<std::sync::atomic::AtomicU64>,
    /// Per mesh rank: its worker is live for this router ([`RouterService::is_worker_live`]).
    live: WorkersLive,
    /// Frontend connections whose handshake is done ([`RouterService::frontends_open`]).
    frontends_open: Arc<AtomicUsize>,
}

/// What the core publishes of its workers: per mesh rank whether its worker is live for the
/// core (its link is up and it has announced what it holds, so the core may choose it for
/// parts), and how many routed experts of this router's layers have no live owner (a request
/// touching one fails). Written by the core thread only; read by the launcher and the
/// readiness check.
struct Liveness {
    workers: Vec<std::sync::atomic::AtomicBool>,
    uncovered: AtomicUsize,
}

type WorkersLive = Arc<Liveness>;

/// No worker live yet, for `ranks` mesh ranks, and `uncovered` experts without one.
fn workers_live(ranks: usize, uncovered: usize) -> WorkersLive {
    Arc::new(Liveness {
        workers: (0..ranks)
            .map(|_| std::sync::atomic::AtomicBool::new(false))
            .collect(),
        uncovered: AtomicUsize::new(uncovered),
    })
}

impl std::fmt::Debug for RouterService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RouterService")
            .field("frontend_addr", &self.frontend_addr)
            .finish()
    }
}

impl RouterService {
    /// Start the mesh (this process is `mesh.protocol.local_rank`, normally 0), the frontend
    /// listener and the core thread.
    pub fn start(
        core: RouterCore,
        mesh_cfg: MeshConfig,
        cfg: ServiceConfig,
    ) -> Result<Self, ServiceError> {
        let mesh_max_frame_bytes = mesh_cfg.protocol.codec.max_frame_bytes;
        check_start(&core, mesh_max_frame_bytes, &cfg)?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("router-io")
            .enable_all()
            .build()
            .map_err(ServiceError::Runtime)?;
        let own_rank = mesh_cfg.protocol.local_rank;
        let (mesh, events) = runtime.block_on(Mesh::start(mesh_cfg))?;
        let addr = cfg.frontend_listen;
        let listen_err = |source: std::io::Error| ServiceError::Listen { addr, source };
        let listener = runtime
            .block_on(FrameListener::bind(addr, cfg.frontend.clone()))
            .map_err(listen_err)?;
        let frontend_addr = listener.local_addr().map_err(listen_err)?;
        let (tx, input_rx) = std_mpsc::sync_channel::<CoreInput>(CORE_INPUT_CAPACITY);
        let input_tx = CoreTx {
            tx,
            thread: Arc::default(),
        };
        let clients: ClientQueues = Arc::default();
        let metrics = Arc::clone(core.metrics());
        let stats = Arc::clone(metrics.stats_cell());
        let validator = core.validator();
        let hidden = core.spec().hidden as usize;

        // Frontend acceptor.
        let open = Arc::new(AtomicUsize::new(0));
        let admission = Arc::new(AdmissionGate {
            state: Mutex::new(Admission::new(AdmissionLimits {
                max_requests: core.config().max_inflight_requests,
                max_tokens: core.config().max_inflight_tokens,
                max_per_client: cfg.max_outstanding_per_client.max(1),
            })),
            released: tokio::sync::Notify::new(),
            core: std::sync::OnceLock::new(),
        });
        runtime.spawn(accept_loop(
            listener,
            FrontendConn {
                client: 0,
                validator,
                tx: input_tx.clone(),
                clients: clients.clone(),
                open: Arc::clone(&open),
                max_outstanding: cfg.max_outstanding_per_client.max(1),
                admission: Arc::clone(&admission),
                frontend: Arc::new(cfg.frontend.clone()),
            },
        ));
        // Core thread: it reads the mesh's events itself (no task in between).
        let ranks = core.rank_names().clone();
        let live = workers_live(ranks.len(), core.uncovered_experts(|_| false));
        let send_backlog = Arc::new(SendBacklog::new(
            ranks.len(),
            send_backlog_bytes(core.config(), hidden, mesh_max_frame_bytes),
        ));
        let core_loop = CoreLoop {
            send_backlog,
            changes: Changes::new(&core, own_rank),
            names: core.rank_labels(),
            core,
            rx: input_rx,
            events: Some(events),
            tx: input_tx.clone(),
            rt: runtime.handle().clone(),
            mesh: mesh.clone(),
            clients,
            stats: stats.clone(),
            hidden,
            open: Arc::clone(&open),
            admission: Arc::clone(&admission),
            trim: MemoryTrim::default(),
            live: Arc::clone(&live),
        };
        let core_thread = std::thread::Builder::new()
            .name("router-core".into())
            .spawn(move || core_loop.run())
            .map_err(ServiceError::Runtime)?;
        Ok(Self {
            runtime: Some(runtime),
            core_thread: Some(core_thread),
            input: input_tx,
            frontend_addr,
            mesh,
            stats,
            metrics,
            ranks,
            admission,
            placement_requests: Arc::default(),
            live,
            frontends_open: open,
        })
    }

    /// Frontend connections open now (handshake done, not yet closed). A connection is counted
    /// before any of its requests reaches the core, so the batch window (which waits for every
    /// open connection's request, [`crate::core::RouterConfig::batch_window`]) sees it from its
    /// first request on.
    pub fn frontends_open(&self) -> usize {
        self.frontends_open.load(Ordering::Acquire)
    }

    /// This router's `/ready` check: ready once every device's worker has joined it (its link
    /// is up and it announced what it holds: [`RouterService::is_worker_live`]), or once every
    /// routed expert of its layers has a live owner and [`READY_WITHOUT_ALL_AFTER`] has passed
    /// since it started (a router restarted while a worker is gone for good serves what its
    /// peers serve), and from then on until it drains. A worker lost later (drained and
    /// stopped, crashed, restarting after a re-deploy) does not make it unready: every router
    /// of the fabric shares the workers, so taking the routers out of service would only
    /// refuse what they still serve (the core routes around devices that are down). Not
    /// ready: the reason names the workers not joined yet (the first few) and the experts
    /// without an owner, or that it is draining.
    pub fn readiness(&self) -> crate::metrics::http::Readiness {
        let live = Arc::clone(&self.live);
        let ranks = self.ranks.clone();
        let admission = Arc::clone(&self.admission);
        let joined = crate::metrics::http::ReadyOnce::default();
        let started = Instant::now();
        Arc::new(move || {
            let draining = admission
                .lock()
                .is_draining()
                .then(|| "draining before it stops: it takes no new requests".to_owned());
            joined.verdict(draining, || {
                let devices = ranks.routers()..ranks.len() as u32;
                let total = devices.len();
                let missing: Vec<u32> = devices
                    .filter(|&r| !live.workers[r as usize].load(Ordering::Acquire))
                    .collect();
                let shown: Vec<String> = missing.iter().take(8).map(|&r| ranks.label(r)).collect();
                not_ready_yet(
                    [missing.len(), total],
                    &shown,
                    live.uncovered.load(Ordering::Acquire),
                    started.elapsed(),
                )
            })
        })
    }

    /// Stop admitting requests (each new one is refused with `ShuttingDown`, saying the router
    /// is draining, so a failover client sends it to another router) and wait up to `timeout` for
    /// the admitted ones to be answered and their answers written (a frontend that does not
    /// read keeps it waiting until `timeout`). Returns how many were still unanswered or
    /// unwritten at the end (0: drained). The service keeps running;
    /// [`RouterService::shutdown`] stops it.
    pub fn drain(&self, timeout: Duration) -> usize {
        self.admission.lock().drain();
        let until = Instant::now() + timeout;
        loop {
            let (requests, _) = self.admission.lock().in_flight();
            if requests == 0 || Instant::now() >= until {
                return requests;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Where frontends connect.
    pub fn frontend_addr(&self) -> SocketAddr {
        self.frontend_addr
    }

    /// The mesh's listen address.
    pub fn mesh_addr(&self) -> Option<SocketAddr> {
        self.mesh.local_addr()
    }

    /// Wait until every rank in `ranks` is connected.
    pub fn wait_for_workers(&self, ranks: &[u32], timeout: Duration) -> Result<(), StartError> {
        let rt = self.runtime.as_ref().expect("running");
        rt.block_on(self.mesh.wait_connected(ranks, timeout))
    }

    /// The link kind to rank `r`, when connected.
    pub fn link_kind(&self, r: u32) -> Option<expertmesh_transport::mesh::LinkKind> {
        self.mesh.link_kind(r)
    }

    /// Whether rank `r` is connected now.
    pub fn is_connected(&self, r: u32) -> bool {
        self.mesh.is_connected(r)
    }

    /// Whether the worker of mesh rank `r` is live for this router now: its link is up and it
    /// has announced what it holds, so requests may use it. A link can be connected a moment
    /// before that ([`RouterService::is_connected`]): a request routed to the worker then
    /// would find it down.
    pub fn is_worker_live(&self, r: u32) -> bool {
        self.live
            .workers
            .get(r as usize)
            .is_some_and(|l| l.load(Ordering::Acquire))
    }

    /// The core's counters (updated after every batch of work).
    pub fn stats(&self) -> crate::core::RouterStats {
        self.stats.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Applies placements to the running fabric from this process, as a frontend would
    /// (`expertmesh router --auto-rebalance-every`); only router 0 coordinates changes.
    pub fn placement_handle(&self) -> PlacementHandle {
        PlacementHandle {
            tx: self.input.clone(),
            next_request: Arc::clone(&self.placement_requests),
        }
    }

    /// This router's metrics (what its `/metrics` endpoint and load-statistics writer read).
    pub fn metrics(&self) -> &Arc<crate::metrics::RouterMetrics> {
        &self.metrics
    }

    /// Stop the core, close every connection and the mesh.
    pub fn shutdown(&mut self) {
        self.input.wake();
        let _ = self.input.tx.send(CoreInput::Stop);
        self.input.wake();
        if let Some(t) = self.core_thread.take() {
            let _ = t.join();
        }
        self.mesh.shutdown();
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_timeout(Duration::from_secs(1));
        }
    }
}

impl Drop for RouterService {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// A random nonzero router incarnation (for [`RouterCore::new`]; the worker's node fan-out
/// uses one for its sub-dispatch ids too): the standard library's per-process random hash
/// keys mixed with the time and the process id, so router processes (and restarts) differ.
/// It lives with the service because it reads the clock; the core takes it as given.
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

/// Capacity of the core's input queue (requests, worker frames, link notices). Producers
/// wait when it is full ([`send_to_core`]), so a burst backs up into TCP and the mesh's credit
/// windows instead of into memory.
const CORE_INPUT_CAPACITY: usize = 1024;

/// Per-connection answer paths, by client id.
type ClientQueues = Arc<Mutex<HashMap<ClientId, ClientOut>>>;

/// How answers reach one frontend connection: its writer, which the core thread uses directly
/// when it is free (no hand-off to the connection's writer task), and the queue its writer task
/// drains otherwise (and for the reader's own error replies).
#[derive(Clone)]
struct ClientOut {
    tx: mpsc::Sender<ClientMsg>,
    writer: Arc<tokio::sync::Mutex<FrontendWriter>>,
    slots: Arc<Semaphore>,
    peer: SocketAddr,
}

/// The client id of changes asked from this process ([`PlacementHandle`]); frontend
/// connections count up from 1.
const IN_PROCESS: ClientId = ClientId::MAX;

/// Applies placements to the running fabric from the router's own process (its automatic
/// rebalancing), through the same coordinator and answers as a frontend's `Apply`.
#[derive(Clone)]
pub struct PlacementHandle {
    tx: CoreTx,
    next_request: Arc<std::sync::atomic::AtomicU64>,
}

impl std::fmt::Debug for PlacementHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PlacementHandle").finish_non_exhaustive()
    }
}

impl PlacementHandle {
    /// Applies `entries` ((mesh rank, layer, expert); every worker targeted, one without
    /// entries is emptied), each step within `timeout`, and waits for the answer (blocking:
    /// call it from a thread of its own), or until `stop` is set.
    ///
    /// # Errors
    /// Why the change was refused or failed (the coordinator's message), or that the router
    /// stopped or did not answer.
    pub fn apply(
        &self,
        entries: Vec<(u32, u32, u32)>,
        timeout: Duration,
        stop: Option<&std::sync::atomic::AtomicBool>,
    ) -> Result<Applied, String> {
        let request_id = self.next_request.fetch_add(1, Ordering::AcqRel) + 1;
        let (reply, answer) = std_mpsc::channel();
        let msg = CoreInput::Apply {
            client: IN_PROCESS,
            request_id,
            entries,
            timeout,
            reply: Some(reply),
        };
        // (Blocking while the core's queue is full: this caller has a thread of its own.)
        self.tx
            .tx
            .send(msg)
            .map_err(|_| "the router stopped".to_owned())?;
        self.tx.wake();
        let wait = 4 * timeout + Duration::from_secs(10);
        let until = std::time::Instant::now() + wait;
        loop {
            match answer.recv_timeout(Duration::from_millis(100)) {
                Ok(a) => return a,
                Err(std_mpsc::RecvTimeoutError::Disconnected) => {
                    return Err("the router stopped".into());
                }
                Err(std_mpsc::RecvTimeoutError::Timeout) => {}
            }
            if stop.is_some_and(|s| s.load(Ordering::Acquire)) {
                return Err("stopped while waiting (the router's coordinator carries on)".into());
            }
            if std::time::Instant::now() >= until {
                return Err(format!(
                    "no answer from the router's coordinator within {wait:?}"
                ));
            }
        }
    }
}

/// How long after its start a router that can serve every routed expert (each has a live
/// owner) is ready without every worker having joined ([`RouterService::readiness`]): long
/// enough for the workers that are up to join it (they redial at least once a second), so a
/// fabric's first start still waits for all of them, short enough that a router restarted
/// while a worker is gone for good is back in service within a probe's patience.
pub const READY_WITHOUT_ALL_AFTER: Duration = Duration::from_secs(30);

/// Why a router that has not been ready yet is not ready now, or `None` when it is
/// ([`RouterService::readiness`]): `missing` of `total` workers have not joined (`shown`: the
/// first few's names), `uncovered` routed experts have no live owner, `since_start` has passed
/// since the router started.
fn not_ready_yet(
    [missing, total]: [usize; 2],
    shown: &[String],
    uncovered: usize,
    since_start: Duration,
) -> Option<String> {
    if missing == 0 || (uncovered == 0 && since_start >= READY_WITHOUT_ALL_AFTER) {
        return None;
    }
    let more = if missing > shown.len() { ", ..." } else { "" };
    let owners = if uncovered == 0 {
        format!(
            "every routed expert has a live owner (ready without the rest {}s after the start)",
            READY_WITHOUT_ALL_AFTER.as_secs()
        )
    } else {
        format!("{uncovered} routed experts without a live owner")
    };
    Some(format!(
        "{missing} of {total} workers not joined: {}{more}; {owners}",
        shown.join(", ")
    ))
}

/// The core's input queue (frontend requests, connection counts, failed sends) and the core
/// thread to wake after each message: the core sleeps on its thread's park token, which both
/// this queue and the mesh's event queue (through the core's waker) unpark.
#[derive(Clone)]
struct CoreTx {
    tx: std_mpsc::SyncSender<CoreInput>,
    /// Set by the core thread itself before it first looks at the queue.
    thread: Arc<OnceLock<std::thread::Thread>>,
}

impl CoreTx {
    fn wake(&self) {
        if let Some(t) = self.thread.get() {
            t.unpark();
        }
    }
}

/// Refuses request limits under which requests could never be served: no token allowed, or
/// requests larger than what admission ever lets in at once (such a request would be answered
/// "router at capacity, retry" on every try, even on an idle router).
fn check_request_limits(cfg: &crate::core::RouterConfig) -> Result<(), ServiceError> {
    let why = if cfg.max_request_tokens == 0 {
        "a request carries at least one token: set --max-tokens to 1 or more"
    } else if cfg.max_inflight_tokens == 0 {
        "no request could ever be admitted: set --max-inflight-tokens to at least --max-tokens"
    } else if cfg.max_request_tokens > cfg.max_inflight_tokens {
        "the largest requests could never be admitted: raise --max-inflight-tokens to at least \
         --max-tokens, or lower --max-tokens"
    } else {
        return Ok(());
    };
    Err(ServiceError::RequestLimits {
        max_request_tokens: cfg.max_request_tokens,
        max_inflight_tokens: cfg.max_inflight_tokens,
        why,
    })
}

/// The frontend frame of an answer of `tokens` tokens of `hidden` f32 values.
fn answer_frame_bytes(tokens: usize, hidden: usize) -> usize {
    let body = Body::LayerResponse(LayerResponse {
        request_id: 0,
        tokens: u32::try_from(tokens).unwrap_or(u32::MAX),
        hidden: u32::try_from(hidden).unwrap_or(u32::MAX),
        dtype: OutputDtype::F32,
    });
    expertmesh_transport::codec::frame_len(&body, tokens.saturating_mul(hidden).saturating_mul(4))
}

/// [`RouterService::start`]'s checks of a configuration: micro-batches that fit a mesh frame,
/// and [`check_limits`].
fn check_start(
    core: &RouterCore,
    mesh_max_frame_bytes: usize,
    cfg: &ServiceConfig,
) -> Result<(), ServiceError> {
    check_micro_batch(core, mesh_max_frame_bytes)?;
    let hidden = core.spec().hidden as usize;
    check_limits(core.config(), hidden, cfg.frontend.codec.max_frame_bytes)
}

/// The checks of request limits [`RouterService::start`] makes, for a driver to run before it
/// builds the core (which already sizes buffers from these limits): requests no admission
/// could pass, and answers no frontend frame could carry (`hidden`: the model's hidden size;
/// `frontend_max_frame`: the frontend's frame limit).
pub fn check_limits(
    cfg: &crate::core::RouterConfig,
    hidden: usize,
    frontend_max_frame: usize,
) -> Result<(), ServiceError> {
    check_request_limits(cfg)?;
    check_answer_fits(cfg.max_request_tokens, hidden, frontend_max_frame)
}

/// Refuses a request size whose answer (f32 rows) could not be sent in one frontend frame:
/// such a request would be computed and its answer never delivered.
fn check_answer_fits(
    tokens: usize,
    hidden: usize,
    max_frame_bytes: usize,
) -> Result<(), ServiceError> {
    let answer_bytes = answer_frame_bytes(tokens, hidden);
    if answer_bytes <= max_frame_bytes {
        return Ok(());
    }
    // The most tokens whose answer fits (the frame grows with them).
    let mut fits = max_frame_bytes / (hidden * 4).max(1);
    while fits > 0 && answer_frame_bytes(fits, hidden) > max_frame_bytes {
        fits -= 1;
    }
    Err(ServiceError::AnswerTooLarge {
        max_request_tokens: tokens,
        hidden,
        answer_bytes,
        max_frame_bytes,
        fits,
    })
}

/// Refuses a micro-batch whose worst-case part (every token with all its routed experts, and
/// the shared experts where a worker runs them, on one device) would not fit a frame: without this check such a
/// fabric starts and then fails the calls that happen to land that way.
fn check_micro_batch(core: &RouterCore, max_frame_bytes: usize) -> Result<(), ServiceError> {
    let spec = core.spec();
    let slots = core.max_slots_per_token();
    let cfg = core.config();
    // No part is larger than the largest batch: `max_batch_tokens`, or one request of up to
    // `max_request_tokens` that is a batch on its own.
    let largest = cfg.max_batch_tokens.max(cfg.max_request_tokens);
    let micro_batch = cfg.micro_batch_tokens.min(largest).max(1);
    let fits = cfg.largest_micro_batch(spec, slots, max_frame_bytes);
    if fits == 0 {
        return Err(ServiceError::TokenTooLarge {
            model: spec.name.clone(),
            slots,
            max_frame_bytes,
        });
    }
    if micro_batch > fits {
        return Err(ServiceError::MicroBatchTooLarge {
            micro_batch,
            model: spec.name.clone(),
            slots,
            max_frame_bytes,
            fits,
        });
    }
    Ok(())
}

/// Hand `msg` to the core, waiting (asynchronously) while its queue is full. `Err` when the
/// core has stopped.
async fn send_to_core(tx: &CoreTx, mut msg: CoreInput) -> Result<(), ()> {
    loop {
        match tx.tx.try_send(msg) {
            Ok(()) => {
                tx.wake();
                return Ok(());
            }
            Err(std_mpsc::TrySendError::Full(m)) => {
                msg = m;
                tokio::time::sleep(Duration::from_micros(200)).await;
            }
            Err(std_mpsc::TrySendError::Disconnected(_)) => return Err(()),
        }
    }
}

/// Wakes the core thread: the waker the core polls the mesh's events and its first send
/// attempts with.
struct Unpark(std::thread::Thread);

impl std::task::Wake for Unpark {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.0.unpark();
    }
}

/// Accept frontend connections forever; each is served by its own task (a copy of `template`
/// with its own client id).
async fn accept_loop(listener: FrameListener, template: FrontendConn) {
    let mut next_client: ClientId = 1;
    loop {
        let incoming = match listener.accept().await {
            Ok(i) => i,
            Err(e) => {
                tracing::warn!(error = %e, "accepting a frontend connection failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let conn = FrontendConn {
            client: next_client,
            ..template.clone()
        };
        next_client += 1;
        tokio::spawn(conn.serve(incoming));
    }
}

/// One frontend connection's shared state.
#[derive(Clone)]
struct FrontendConn {
    client: ClientId,
    validator: crate::core::RequestValidator,
    tx: CoreTx,
    clients: ClientQueues,
    /// Open (handshaken) frontend connections, shared by all of them.
    open: Arc<AtomicUsize>,
    max_outstanding: usize,
    /// The router's admitted requests, shared by every connection, the core thread and the
    /// answers waiting to be written ([`AnswerShare`]).
    admission: Arc<AdmissionGate>,
    /// The listener's settings: how long the connection may idle
    /// ([`FrontendConfig::idle_timeout`]), who may change the placement
    /// ([`FrontendConfig::may_change_placement`]).
    frontend: Arc<FrontendConfig>,
}

impl FrontendConn {
    /// Handshake, then read requests and write responses until either side closes.
    ///
    /// Bounds: at most `max_outstanding` requests of this connection are in flight (a permit
    /// per request read, returned when its response or error is written), so the response
    /// queue, whose every message holds one permit, never holds more than `max_outstanding`.
    async fn serve(self, incoming: IncomingClient) {
        let peer = incoming.peer_addr();
        let conn = match incoming.handshake().await {
            Ok(c) => c,
            Err(e) => {
                // Already logged where it was refused, at most a few lines a second (a loop
                // of garbage connections must not flood the log).
                tracing::debug!(%peer, error = %e, "frontend handshake failed; connection refused");
                return;
            }
        };
        let (mut reader, writer) = conn.split();
        let progress = writer.progress();
        let (out_tx, out_rx) = mpsc::channel::<ClientMsg>(self.max_outstanding);
        let slots = Arc::new(Semaphore::new(self.max_outstanding));
        let writer = Arc::new(tokio::sync::Mutex::new(writer));
        let out = ClientOut {
            tx: out_tx.clone(),
            writer: Arc::clone(&writer),
            slots: Arc::clone(&slots),
            peer,
        };
        self.clients
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(self.client, out);
        // The task holds no sender of its own queue: it ends once this connection is gone.
        let write_task = tokio::spawn(write_responses(
            Arc::clone(&writer),
            slots.clone(),
            peer,
            out_rx,
        ));
        // Counted before this connection's first request reaches the core (same queue).
        self.admission.lock().open();
        self.open.fetch_add(1, Ordering::AcqRel);
        let _ = send_to_core(&self.tx, CoreInput::Frontends).await;
        let shut = reader.shut_down_handle();
        let untaken = async {
            let Some(idle) = self.frontend.idle_timeout else {
                return std::future::pending().await;
            };
            overdue(&progress, idle, None).await;
            tracing::info!(
                %peer,
                "frontend connection closed: its answers were not taken for the idle timeout \
                 (router --frontend-idle-timeout-s)"
            );
            // Reads and writes fail from now on: the reader ends through its own error paths
            // (each admitted request's share released), the writes at once; a reader
            // waiting for an answer's place stops waiting. (The handle is used while `reader`,
            // which owns the socket, lives: this future ends before it is dropped.)
            shut.shut_down();
            slots.close();
            std::future::pending::<()>().await
        };
        let reading = async {
            let end = self
                .read_requests(&mut reader, &out_tx, &slots, &writer, &progress, peer)
                .await;
            // No request comes from it any more: batches stop waiting for it and the others'
            // shares grow now (its requests in flight keep theirs until answered).
            self.admission.lock().close(self.client);
            self.open.fetch_sub(1, Ordering::AcqRel);
            let _ = send_to_core(&self.tx, CoreInput::Frontends).await;
            if let ReadEnd::ClientDone { answer_by } = end {
                let until = answer_by + ANSWER_GRACE;
                answered(&slots, self.max_outstanding, &out_tx, until).await;
            }
            end
        };
        let end = tokio::select! {
            end = reading => end,
            () = untaken => unreachable!("pending"),
        };
        self.clients
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.client);
        drop(out_tx);
        self.finish_writes(write_task, &writer, &progress, &reader, peer)
            .await;
        drop(reader);
        if let ReadEnd::Idle(frontend, message) = end {
            // Logged once the closing frame is written (tests wait for this line).
            tracing::info!(%peer, frontend, "frontend connection {message}");
        }
    }

    /// Reader: each request is admitted or shed from its header and metadata, before its
    /// payload is read ([`crate::admission`]); an admitted one is read, validated here and
    /// handed to the core. A shed or refused request's payload is skipped, never held.
    /// Returns how reading ended ([`ReadEnd`]). A head is read before its request takes a
    /// slot: keepalive probes need none ([`answer_probe`]).
    async fn read_requests(
        &self,
        reader: &mut FrameReader,
        out_tx: &mpsc::Sender<ClientMsg>,
        slots: &Semaphore,
        writer: &tokio::sync::Mutex<FrontendWriter>,
        progress: &expertmesh_transport::frontend::WriteProgress,
        peer: SocketAddr,
    ) -> ReadEnd {
        let reply = |request_id, code, message| self.reply(out_tx, request_id, code, message);
        let mut last_request = tokio::time::Instant::now();
        // When every request read so far must have been answered (its deadline).
        let mut answer_by = last_request;
        loop {
            let read = tokio::select! {
                r = reader.read_head() => r,
                idle = self.idle(last_request, slots, progress) => {
                    let (frontend, message) = idle_closed(idle, reader, out_tx);
                    return ReadEnd::Idle(frontend, message);
                }
            };
            let head = match read {
                Ok(h) => h,
                Err(FrontendError::Closed { .. }) => return ReadEnd::ClientDone { answer_by },
                Err(e) => {
                    tracing::info!(%peer, error = %e, "frontend connection closed");
                    break;
                }
            };
            match answer_probe(&head, writer).await {
                Ok(true) => continue,
                Ok(false) => {}
                Err(e) => {
                    tracing::info!(%peer, error = %e, "frontend connection closed while writing");
                    break;
                }
            }
            if !matches!(head.body(), Some(Ok(Body::Heartbeat(_)))) {
                last_request = tokio::time::Instant::now();
            }
            if slots.acquire().await.map(|p| p.forget()).is_err() {
                break; // the connection is closing
            }
            let taken = match self.take(head).await {
                Take::Request(req, head) => self.read_request(reader, req, head).await,
                Take::Placement(p, head)
                    if !self.frontend.may_change_placement(reader.frontend()) =>
                {
                    let (code, message) = self.placement_refused(reader.frontend(), peer);
                    reply(p.request_id, code, message);
                    reader.skip_payload(head).await.map(|()| None)
                }
                Take::Placement(p, head) => match self.read_placement(reader, &p, head).await {
                    Ok(Ok(apply)) => {
                        let by = tokio::time::Instant::now() + placement_answer_within(&p);
                        answer_by = answer_by.max(by);
                        if send_to_core(&self.tx, apply).await.is_err() {
                            break;
                        }
                        continue;
                    }
                    Ok(Err(message)) => {
                        reply(p.request_id, ErrorCode::InvalidInput, message);
                        continue;
                    }
                    Err(e) => {
                        tracing::info!(%peer, error = %e, "frontend connection closed");
                        break;
                    }
                },
                Take::Skip(head, answer) => {
                    let skipped = reader.skip_payload(head).await;
                    match answer {
                        Some((id, code, message)) => reply(id, code, message),
                        None => slots.add_permits(1), // a heartbeat: no answer
                    }
                    skipped.map(|()| None)
                }
            };
            match taken {
                Ok(None) => {}
                Ok(Some(Ok(r))) => {
                    // The core answers by the deadline fixed when the request was validated.
                    answer_by = answer_by.max(tokio::time::Instant::from_std(r.deadline));
                    if send_to_core(&self.tx, CoreInput::Request(r)).await.is_err() {
                        break;
                    }
                }
                Ok(Some(Err((id, code, message)))) => reply(id, code, message),
                Err(e) => {
                    tracing::info!(%peer, error = %e, "frontend connection closed");
                    break;
                }
            }
        }
        ReadEnd::Broken
    }

    /// Answers a frame of this connection with an error (counted in the metrics). Never
    /// full: the message holds the permit of the frame that caused it.
    fn reply(
        &self,
        out_tx: &mpsc::Sender<ClientMsg>,
        request_id: u64,
        code: ErrorCode,
        message: String,
    ) {
        self.validator.metrics().on_error(code);
        let _ = out_tx.try_send(ClientMsg::Error {
            request_id,
            code,
            message,
            share: None,
        });
    }

    /// Waits for the answers still being written to a connection that is done reading (idle,
    /// closed by its client, broken): its write task's, and one the core thread started
    /// itself ([`CoreLoop::answer`]; done once the writer is free). A client that never
    /// takes them would hold its socket and its answers for ever: once one write has waited
    /// [`FrontendConfig::frame_timeout`] (plus a second per 16 MiB of it) since reading
    /// stopped (for a client done sending: since the wait for its answers, [`answered`],
    /// ended), the socket is shut down, and the writes fail at once. Without a frame timeout
    /// the idle timeout is the limit; without either, they wait.
    async fn finish_writes(
        &self,
        write_task: tokio::task::JoinHandle<()>,
        writer: &tokio::sync::Mutex<FrontendWriter>,
        progress: &expertmesh_transport::frontend::WriteProgress,
        reader: &FrameReader,
        peer: SocketAddr,
    ) {
        // The connection is out of `clients`: the core starts no new write to it.
        let written = async {
            let _ = write_task.await;
            drop(writer.lock().await);
        };
        tokio::pin!(written);
        // Without a frame timeout the idle timeout bounds what is left, as it did while the
        // connection was read.
        let Some(base) = self.frontend.frame_timeout.or(self.frontend.idle_timeout) else {
            return written.await;
        };
        let since = Some(std::time::Instant::now());
        tokio::select! {
            () = &mut written => {}
            () = overdue(progress, base, since) => {
                tracing::info!(
                    %peer,
                    "frontend connection closed: an answer was not taken within \
                     {base:?} (plus a second per 16 MiB) after the connection stopped being \
                     read (router --frontend-frame-timeout-s)"
                );
                reader.shut_down();
                written.await;
            }
        }
    }

    /// Completes (with the timeout) once this connection has been idle for
    /// [`FrontendConfig::idle_timeout`]: none in flight, and a whole period since both its last
    /// request (`last_request`) and its last answer (`progress`'s last write) ([`idle_wait`];
    /// `slots` lacks one permit per request in flight, none is taken while a head is read).
    /// Never completes without an idle timeout.
    async fn idle(
        &self,
        last_request: tokio::time::Instant,
        slots: &Semaphore,
        progress: &expertmesh_transport::frontend::WriteProgress,
    ) -> Duration {
        let Some(idle) = self.frontend.idle_timeout else {
            return std::future::pending().await;
        };
        let mut at = last_request + idle;
        loop {
            tokio::time::sleep_until(at).await;
            let now = tokio::time::Instant::now();
            let busy = slots.available_permits() < self.max_outstanding;
            let since_request = now.saturating_duration_since(last_request);
            match idle_wait(idle, since_request, progress.since_last_write(), busy) {
                None => return idle,
                Some(wait) => at = now + wait,
            }
        }
    }

    /// What to do with a frame from its head alone: read an admitted request, or skip the
    /// payload (answering a shed or refused request, or nothing for a heartbeat). A request
    /// over its share waits up to [`ADMISSION_WAIT`] for room before it is shed.
    async fn take(&self, head: FrameHead) -> Take {
        let (id, body) = (head.request_id().unwrap_or(0), head.body());
        let req = match body {
            Some(Ok(Body::LayerRequest(req))) => *req,
            Some(Ok(Body::Heartbeat(_))) => return Take::Skip(head, None),
            Some(Ok(Body::Placement(p))) if p.op == PlacementOp::Apply => {
                return Take::Placement(p.clone(), head);
            }
            Some(Ok(other)) => {
                let message = format!(
                    "frontends send LayerRequest frames (and Placement frames to apply one), not \
                     {:?}",
                    kind_name(other)
                );
                // A placement frame carries its own request id (its caller waits on it); other
                // kinds have none to answer.
                let rid = match other {
                    Body::Placement(p) => p.request_id,
                    _ => 0,
                };
                return Take::Skip(head, Some((rid, ErrorCode::BadFrame, message)));
            }
            Some(Err(error)) => {
                let message = format!("bad frame: {error}");
                return Take::Skip(head, Some((id, ErrorCode::BadFrame, message)));
            }
            None => {
                let message = format!(
                    "bad frame: {:?} metadata over {MAX_HEAD_META_BYTES} bytes; frontends send LayerRequest frames",
                    head.kind()
                );
                return Take::Skip(head, Some((id, ErrorCode::BadFrame, message)));
            }
        };
        if let Err(e) = self.validator.check(&req) {
            return Take::Skip(head, Some((req.request_id, e.code, e.message)));
        }
        match self.admission.admit(self.client, &req).await {
            Ok(()) => Take::Request(req, head),
            Err(shed) => Take::Skip(head, Some((req.request_id, shed.code(), shed.to_string()))),
        }
    }

    /// Read and validate the payload of admitted request `req`. Returns the request for the
    /// core or the refusal to answer (the request's share is released then); `Err` when the
    /// connection broke.
    async fn read_request(
        &self,
        reader: &mut FrameReader,
        req: LayerRequest,
        head: FrameHead,
    ) -> Result<Option<Result<crate::core::Request, Answer>>, FrontendError> {
        let release = || {
            let (client, id) = (self.client, req.request_id);
            self.admission.free(|a| a.release(client, id));
        };
        let frame = match reader.read_payload(head).await {
            Ok(f) => f,
            Err(FrontendError::BadFrame {
                recoverable: true,
                error,
                ..
            }) => {
                release();
                let message = format!("bad frame: {error}");
                return Ok(Some(Err((req.request_id, ErrorCode::BadFrame, message))));
            }
            Err(e) => {
                release();
                return Err(e);
            }
        };
        let now = Instant::now();
        let validated = self
            .validator
            .validate(self.client, &req, frame.payload(), now);
        drop(frame);
        Ok(Some(validated.map_err(|e| {
            release();
            (req.request_id, e.code, e.message)
        })))
    }
}

impl FrontendConn {
    /// The answer to a placement change from frontend `name`, which may not make one: logged,
    /// and the connection goes on serving its layer calls.
    fn placement_refused(&self, name: &str, peer: SocketAddr) -> (ErrorCode, String) {
        tracing::warn!(
            %peer,
            frontend = name,
            "placement change refused: the frontend is not a placement admin"
        );
        let who = if name.is_empty() {
            "a frontend without a name".to_owned()
        } else {
            format!("frontend {name:?}")
        };
        let message = format!(
            "{who} may not change the placement: this router takes placement changes only from \
             the frontends named by its --placement-admins ({}); issue one's credential with \
             `expertmesh keys issue --frontend NAME` and pass it to rebalance/drain \
             --credentials",
            match self.frontend.placement_admins.join(", ") {
                admins if admins.is_empty() => "none".to_owned(),
                admins => admins,
            }
        );
        (ErrorCode::NotPermitted, message)
    }

    /// Reads the entries of a frontend's placement to apply. `Ok(Err)`: a bad placement frame
    /// (answered, the connection goes on); `Err`: the connection broke.
    async fn read_placement(
        &self,
        reader: &mut FrameReader,
        p: &Placement,
        head: FrameHead,
    ) -> Result<Result<CoreInput, String>, FrontendError> {
        let frame = match reader.read_payload(head).await {
            Ok(f) => f,
            Err(FrontendError::BadFrame {
                recoverable: true,
                error,
                ..
            }) => return Ok(Err(format!("bad placement frame: {error}"))),
            Err(e) => return Err(e),
        };
        let entries = match placement_entries(p, frame.payload()) {
            Ok(e) => e,
            Err(e) => return Ok(Err(format!("bad placement frame: {e}"))),
        };
        tracing::info!(
            frontend = reader.frontend(),
            entries = entries.len(),
            request_id = p.request_id,
            "placement change asked"
        );
        Ok(Ok(CoreInput::Apply {
            client: self.client,
            request_id: p.request_id,
            entries,
            timeout: Duration::from_millis(u64::from(p.millis.max(1))),
            reply: None,
        }))
    }
}

/// An error answer: request id, code, message.
type Answer = (u64, ErrorCode, String);

/// What the reader does with a frame after its head ([`FrontendConn::take`]).
enum Take {
    /// An admitted request: read its payload.
    Request(LayerRequest, FrameHead),
    /// A placement to apply: read its entries.
    Placement(Placement, FrameHead),
    /// Skip the payload, then answer (`None`: a heartbeat, no answer).
    Skip(FrameHead, Option<Answer>),
}

/// How long a request over its connection's share waits (its payload unread) for the share to
/// free before it is shed: a greedy connection is slowed to its share rather than spinning
/// through refusals, and a refusal still comes quickly.
const ADMISSION_WAIT: Duration = Duration::from_millis(100);

/// The router's admission state, shared by the connection tasks (which admit) and the
/// answers ([`AnswerShare`], released once written, waking the waiting readers).
struct AdmissionGate {
    state: Mutex<Admission>,
    /// Notified after answers freed shares.
    released: tokio::sync::Notify,
    /// The core thread, woken when the last share is released ([`AnswerShare`]).
    core: std::sync::OnceLock<std::thread::Thread>,
}

impl AdmissionGate {
    /// Locks the state (a poisoned lock is still consistent: every update is one step).
    fn lock(&self) -> std::sync::MutexGuard<'_, Admission> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Frees a share (`free` on the state), then wakes the readers waiting for room, and the
    /// core thread when nothing is in flight any more: it may be parked waiting for the router
    /// to fall idle to give a burst's memory back.
    fn free(&self, free: impl FnOnce(&mut Admission)) {
        let idle = {
            let mut admission = self.lock();
            free(&mut admission);
            admission.in_flight().0 == 0
        };
        self.released.notify_waiters();
        if idle && let Some(core) = self.core.get() {
            core.unpark();
        }
    }

    /// Admit `req` of `client`, waiting up to [`ADMISSION_WAIT`] for shares to free before
    /// shedding it.
    async fn admit(&self, client: ClientId, req: &LayerRequest) -> Result<(), Shed> {
        let until = tokio::time::Instant::now() + ADMISSION_WAIT;
        loop {
            let freed = self.released.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            let shed = match self
                .lock()
                .admit(client, req.request_id, req.tokens as usize)
            {
                Ok(()) => return Ok(()),
                Err(shed) => shed,
            };
            if tokio::time::timeout_at(until, freed).await.is_err() {
                return Err(shed);
            }
        }
    }
}

/// An answered request's share of the router's capacity ([`crate::admission`]) while its
/// answer waits to be written: released when dropped, once the answer is written or dropped
/// with its connection. So the answers a frontend does not take count against its share (it
/// is refused more work until it reads), and all the answers waiting in the router hold at
/// most what admission lets in, instead of up to `max_outstanding` per connection. (The
/// request's id is free from the answer on: [`Admission::answered`].)
struct AnswerShare {
    gate: Arc<AdmissionGate>,
    client: ClientId,
    /// From [`Admission::answered`].
    ticket: u64,
}

impl AnswerShare {
    /// The share of `client`'s request `request_id`, answered now (`None`: not admitted).
    fn answered(gate: &Arc<AdmissionGate>, client: ClientId, request_id: u64) -> Option<Self> {
        let ticket = gate.lock().answered(client, request_id)?;
        Some(Self {
            gate: Arc::clone(gate),
            client,
            ticket,
        })
    }
}

impl Drop for AnswerShare {
    fn drop(&mut self) {
        let (client, ticket) = (self.client, self.ticket);
        self.gate.free(|a| a.release_answered(client, ticket));
    }
}

/// Writer task: the answers of one connection that the core thread did not write itself (the
/// writer was busy) and the reader's error replies, in completion order.
async fn write_responses(
    writer: Arc<tokio::sync::Mutex<FrontendWriter>>,
    slots: Arc<Semaphore>,
    peer: SocketAddr,
    mut out_rx: mpsc::Receiver<ClientMsg>,
) {
    let mut bytes = Vec::new();
    while let Some(msg) = out_rx.recv().await {
        let mut w = writer.lock().await;
        if let Err(e) = write_answer(&mut w, msg, &slots, &mut bytes).await {
            tracing::info!(%peer, error = %e, "frontend connection closed while writing");
            return;
        }
    }
}

/// Completes once the write under way on `progress`'s writer has waited past
/// [`expertmesh_transport::frontend::frame_deadline`] of `base` for its size, counted from
/// `since` at the earliest (looked at every second at most).
async fn overdue(
    progress: &expertmesh_transport::frontend::WriteProgress,
    base: Duration,
    since: Option<std::time::Instant>,
) {
    loop {
        tokio::time::sleep(base.min(Duration::from_secs(1))).await;
        if progress.overdue_since(base, since) {
            return;
        }
    }
}

/// How a frontend connection's reading ended ([`FrontendConn::read_requests`]).
enum ReadEnd {
    /// Closed for idleness: the frontend's name and why, for the log.
    Idle(String, String),
    /// The client closed its side (the stream ended before or within a frame's head): it is
    /// done sending, or gone. The requests it sent are still answered ([`answered`]), each by
    /// `answer_by` (the latest of their deadlines and placement waits).
    ClientDone {
        /// When the last request read must have been answered.
        answer_by: tokio::time::Instant,
    },
    /// A broken stream or frame, or the router stopping.
    Broken,
}

/// How long the answer to placement change `p` may take ([`answer_within`] of its
/// timeout).
///
/// [`answer_within`]: crate::client::placement::answer_within
fn placement_answer_within(p: &Placement) -> Duration {
    crate::client::placement::answer_within(Duration::from_millis(u64::from(p.millis.max(1))))
}

/// How long past the last deadline of its requests a connection that is done sending waits
/// for their answers (the core answers `DeadlineExceeded` once a deadline has passed).
const ANSWER_GRACE: Duration = Duration::from_secs(5);

/// Completes once every request of a connection that is done sending has been answered: all
/// `max_outstanding` permits back in `slots` (an answer returns its permit as its write
/// begins), the connection's write task gone (a write failed: nobody reads the answers),
/// `slots` closed (its answers were not taken), or at `until` (past every request's deadline:
/// an answer still missing then is not waited for).
async fn answered(
    slots: &Semaphore,
    max_outstanding: usize,
    out_tx: &mpsc::Sender<ClientMsg>,
    until: tokio::time::Instant,
) {
    let all = u32::try_from(max_outstanding).unwrap_or(u32::MAX);
    tokio::select! {
        _ = slots.acquire_many(all) => {}
        () = out_tx.closed() => {}
        () = tokio::time::sleep_until(until) => {}
    }
}

/// How much longer a connection with idle timeout `idle` must stay quiet before it is idle,
/// looked at now; `None`: it is idle now. `since_request`: time since its last request
/// arrived; `since_answer`: since its last write (an answer) ended, `None` before the first;
/// `busy`: a request in flight (looked at again within a second). Idleness counts from the
/// later of the two, so a connection is never closed right after a slow answer.
fn idle_wait(
    idle: Duration,
    since_request: Duration,
    since_answer: Option<Duration>,
    busy: bool,
) -> Option<Duration> {
    if busy {
        return Some(idle.min(Duration::from_secs(1)));
    }
    let quiet = since_answer.map_or(since_request, |a| a.min(since_request));
    (quiet < idle).then(|| idle - quiet)
}

/// Tells the client its connection closes for idleness (`idle` without a request); returns
/// (frontend name, why) for the log.
fn idle_closed(
    idle: Duration,
    reader: &FrameReader,
    out_tx: &mpsc::Sender<ClientMsg>,
) -> (String, String) {
    let message = format!(
        "closed: no request or answer for {idle:?} and none in flight (the router's frontend idle \
         timeout, router --frontend-idle-timeout-s); connect again"
    );
    let _ = out_tx.try_send(ClientMsg::Error {
        request_id: 0,
        code: ErrorCode::ShuttingDown,
        message: message.clone(),
        share: None,
    });
    (reader.frontend().to_owned(), message)
}

/// Answers `head` at once when it is a client's keepalive probe (a request for no layer, no
/// tokens, no payload), without taking a slot: `Ok(true)`. So a client whose every slot waits
/// on requests slow to answer (a device waited for up to their deadline) still hears that the
/// router is alive, instead of giving it up. Never waits for the writer: while
/// it is busy the client is being sent answers (or is not reading), which say as much as this
/// one would. `Ok(false)`: not a probe.
async fn answer_probe(
    head: &FrameHead,
    writer: &tokio::sync::Mutex<FrontendWriter>,
) -> Result<bool, FrontendError> {
    let Some(Ok(Body::LayerRequest(req))) = head.body() else {
        return Ok(false);
    };
    if req.layer != crate::client::liveness::PROBE_LAYER
        || req.tokens != 0
        || head.payload_len() != 0
    {
        return Ok(false);
    }
    if let Ok(mut w) = writer.try_lock() {
        let message = "keepalive probe: no layer this far; the router is alive";
        w.write_error(req.request_id, ErrorCode::NotFound, message)
            .await?;
    }
    Ok(true)
}

/// Writes one answer, returning its request's permit first. The combined f32 rows are written
/// as the frame's payload as they are (little-endian machines) or encoded once into `bytes`.
async fn write_answer(
    writer: &mut FrontendWriter,
    msg: ClientMsg,
    slots: &Semaphore,
    bytes: &mut Vec<u8>,
) -> Result<(), FrontendError> {
    match msg {
        ClientMsg::Response {
            request_id,
            tokens,
            hidden,
            output,
            share,
        } => {
            let body = Body::LayerResponse(LayerResponse {
                request_id,
                tokens: tokens as u32,
                hidden: hidden as u32,
                dtype: OutputDtype::F32,
            });
            let payload = match dtype::f32_as_le_bytes(&output) {
                Some(b) => b, // little-endian machine: the rows are the payload
                None => {
                    bytes.resize(output.len() * 4, 0);
                    let _ = dtype::encode_output(OutputDtype::F32, &output, bytes);
                    bytes
                }
            };
            slots.add_permits(1);
            let written = writer.write_frame(&body, payload).await;
            drop(share);
            written
        }
        ClientMsg::Error {
            request_id,
            code,
            message,
            share,
        } => {
            slots.add_permits(1);
            let written = writer.write_error(request_id, code, &message).await;
            drop(share);
            written
        }
        ClientMsg::Placement(p) => {
            slots.add_permits(1);
            writer.write_frame(&Body::Placement(p), &[]).await
        }
    }
}

fn kind_name(b: &Body) -> &'static str {
    match b {
        Body::Hello(_) => "Hello",
        Body::Auth(_) => "Auth",
        Body::LinkInfo(_) => "LinkInfo",
        Body::Dispatch(_) => "Dispatch",
        Body::Result(_) => "Result",
        Body::Error(_) => "Error",
        Body::Heartbeat(_) => "Heartbeat",
        Body::Credit(_) => "Credit",
        Body::LayerRequest(_) => "LayerRequest",
        Body::LayerResponse(_) => "LayerResponse",
        Body::Placement(_) => "Placement",
    }
}

/// Inputs (and, separately, mesh events) the core thread takes per pass before it acts.
const PASS: usize = 64;

/// Gives the heap memory freed after a burst of work back to the operating system: once the
/// router has been idle (nothing admitted, no batch in flight) for [`MemoryTrim::IDLE`] after
/// being busy, the core thread calls glibc's `malloc_trim`, which releases the free pages of
/// every allocator arena. Without it the allocator keeps its high-water mark (issue 15: 84 MiB
/// before a load, 600–800 MiB after it).
#[derive(Debug, Default)]
struct MemoryTrim {
    /// When the router was last busy, if it has not been trimmed since.
    busy_at: Option<Instant>,
}

impl MemoryTrim {
    /// How long the router must be idle before its memory is trimmed.
    const IDLE: Duration = Duration::from_millis(250);

    fn busy(&mut self, now: Instant) {
        self.busy_at = Some(now);
    }

    /// When a trim is due (`None`: nothing to trim).
    fn due(&self) -> Option<Instant> {
        self.busy_at.map(|t| t + Self::IDLE)
    }

    /// Trim when due and `idle`.
    fn poll(&mut self, now: Instant, idle: bool) {
        if idle && self.due().is_some_and(|t| t <= now) {
            self.busy_at = None;
            release_free_memory();
        }
    }
}

/// Returns the allocator's free pages to the operating system (glibc; elsewhere a no-op).
fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only walks the allocator's own free lists; it has no preconditions.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// The core thread's state: the core, its input queue, the mesh's events, and what carrying
/// out actions needs.
struct CoreLoop {
    core: RouterCore,
    rx: std_mpsc::Receiver<CoreInput>,
    /// The mesh's events, polled on this thread (`None` once the mesh has shut down).
    events: Option<MeshEvents>,
    tx: CoreTx,
    rt: tokio::runtime::Handle,
    mesh: Mesh,
    clients: ClientQueues,
    stats: Arc<Mutex<crate::core::RouterStats>>,
    hidden: usize,
    /// `names[r]` labels mesh rank `r` in logs (device name and rank).
    names: Vec<String>,
    /// Open frontend connections (kept by the connection tasks).
    open: Arc<AtomicUsize>,
    /// The admitted requests: each answer the core gives frees its request's id, and its
    /// share once written ([`AnswerShare`]).
    admission: Arc<AdmissionGate>,
    /// Gives the memory of a finished burst back to the system.
    trim: MemoryTrim,
    /// Live placement changes: coordination and confirmations.
    changes: Changes,
    /// Which workers the core may choose, for [`RouterService::is_worker_live`].
    live: WorkersLive,
    /// Dispatch bytes per rank not written yet ([`CoreLoop::send`]).
    send_backlog: Arc<SendBacklog>,
}

/// How many of the mesh's largest frames may wait, per worker, for the link to take them,
/// beyond what the admitted work can need.
const SEND_BACKLOG_FRAMES: usize = 4;

/// The bound of a worker's [`SendBacklog`]: twice the dispatch rows of every token the
/// router admits at once (f32, the widest; twice for hedges and probes), which live work to a
/// merely slow worker does not fill alone, plus [`SEND_BACKLOG_FRAMES`] largest frames. What
/// it bounds is work left behind by failed batches (whose frames count until written, so
/// under sustained failures a live part can still be refused).
fn send_backlog_bytes(cfg: &crate::core::RouterConfig, hidden: usize, max_frame: usize) -> usize {
    cfg.max_inflight_tokens
        .saturating_mul(hidden)
        .saturating_mul(4 * 2)
        .saturating_add(SEND_BACKLOG_FRAMES.saturating_mul(max_frame))
}

/// The dispatch bytes waiting to be written to each rank: a worker that stops taking its
/// frames (its compute hung, its link still alive) holds its credit, and every batch planned
/// on it would otherwise leave one more frame waiting in memory for it, to be computed (for
/// requests long failed) before anything new once it recovers. One [`MemoryBudget`] per rank;
/// each send holds a reservation of its frame's bytes until written.
struct SendBacklog(Vec<MemoryBudget>);

impl SendBacklog {
    fn new(ranks: usize, limit: usize) -> Self {
        Self(
            (0..ranks)
                .map(|_| MemoryBudget::new(limit as u64))
                .collect(),
        )
    }

    /// A reservation of `n` bytes for `rank` (`Ok(None)`: a rank past the table, not bounded
    /// here), or `Err` when they do not fit its bound. The bound holds several of the largest
    /// frames, so a rank with nothing waiting always takes one.
    fn reserve(&self, rank: u32, n: usize) -> Result<Option<MemoryReservation>, String> {
        match self.0.get(rank as usize) {
            Some(b) => b.reserve(n as u64).map(Some),
            None => Ok(None),
        }
    }
}

/// The core thread's part in live placement changes.
struct Changes {
    /// The changes this router coordinates ([`crate::rebalance`]).
    coordinator: Coordinator,
    /// Changes refused before they started, to answer (client, request, why).
    failed: Vec<(ClientId, u64, String)>,
    /// Confirmations (`Seen`) waiting for the dispatches sent their worker before them
    /// ([`CoreLoop::send`] counts each send under way).
    unconfirmed: Confirmations<OutFrame>,
    /// Changes asked from this process ([`PlacementHandle`], client [`IN_PROCESS`]): where
    /// each request's answer goes.
    in_process: HashMap<u64, std_mpsc::Sender<Result<Applied, String>>>,
    /// Copies of gained experts relayed through this router ([`CoreLoop::fetch`]).
    relays: Relays,
}

impl Changes {
    /// The part of the router with mesh rank `own_rank` (router 0 coordinates changes).
    fn new(core: &RouterCore, own_rank: u32) -> Self {
        let names = core.rank_labels();
        let ranks = names.len();
        Self {
            coordinator: Coordinator::new(
                core.rank_names().routers(),
                names,
                core.layers(),
                core.spec().routed_experts,
                own_rank == 0,
            ),
            failed: Vec::new(),
            unconfirmed: Confirmations::new(ranks),
            in_process: HashMap::new(),
            relays: Relays::default(),
        }
    }
}

impl CoreLoop {
    /// Until [`CoreInput::Stop`]: take every ready input and mesh event, let the core act, and
    /// sleep on the thread's park token until the next input, event or timer. Worker frames
    /// reach the core straight from the driver that read them (the shared-memory consumer
    /// thread or the TCP reader) through the mesh's event queue, whose waker unparks this
    /// thread: no task in between.
    fn run(mut self) {
        let _ = self.tx.thread.set(std::thread::current());
        let _ = self.admission.core.set(std::thread::current());
        let _rt = self.rt.enter();
        let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
        let mut cx = Context::from_waker(&waker);
        loop {
            let mut busy = false;
            // At most PASS inputs and PASS events per pass, so that neither queue starves the
            // other, the timers or the answers.
            for _ in 0..PASS {
                match self.rx.try_recv() {
                    Ok(CoreInput::Stop) | Err(std_mpsc::TryRecvError::Disconnected) => return,
                    Ok(msg) => {
                        busy = true;
                        self.input(msg);
                    }
                    Err(std_mpsc::TryRecvError::Empty) => break,
                }
            }
            for _ in 0..PASS {
                let Some(events) = self.events.as_mut() else {
                    break;
                };
                let next = std::pin::pin!(events.recv()).poll(&mut cx);
                match next {
                    Poll::Ready(Some(ev)) => {
                        busy = true;
                        self.event(ev);
                    }
                    Poll::Ready(None) => self.events = None,
                    Poll::Pending => break,
                }
            }
            self.core.on_tick(Instant::now());
            self.changes.coordinator.on_tick(Instant::now());
            busy |= self.coordinate();
            busy |= self.act(&mut cx);
            let confirming = self.changes.unconfirmed.pending() && self.confirm();
            let now = Instant::now();
            if busy {
                self.trim.busy(now);
            } else {
                let idle = self.core.inflight() == 0 && self.admission.lock().in_flight().0 == 0;
                self.trim.poll(now, idle);
                let trim_at = self.trim.due().filter(|_| idle);
                // A confirmation waiting for sends to finish looks again in a millisecond.
                let confirm_at = confirming.then(|| now + Duration::from_millis(1));
                match [
                    self.core.next_timeout(),
                    trim_at,
                    self.changes.coordinator.next_timeout(),
                    confirm_at,
                ]
                .into_iter()
                .flatten()
                .min()
                {
                    Some(t) => {
                        let now = Instant::now();
                        if t > now {
                            std::thread::park_timeout(t - now);
                        }
                    }
                    None => std::thread::park(),
                }
            }
        }
    }

    fn input(&mut self, msg: CoreInput) {
        let now = Instant::now();
        match msg {
            CoreInput::Stop => {}
            CoreInput::Request(r) => self.core.submit(r, now),
            CoreInput::Frontends => {
                let open = self.open.load(Ordering::Acquire);
                self.core.set_frontends(open, now);
            }
            CoreInput::SendFailed { rank, batch, part } => {
                self.core.on_send_failed(rank, batch, part, now)
            }
            CoreInput::SendRefused { rank, batch, part } => {
                self.core.on_send_refused(rank, batch, part, now)
            }
            CoreInput::Apply {
                client,
                request_id,
                entries,
                timeout,
                reply,
            } => {
                if let Some(reply) = reply {
                    self.changes.in_process.insert(request_id, reply);
                }
                if let Err(message) = self
                    .changes
                    .coordinator
                    .apply(client, request_id, &entries, timeout, now)
                {
                    tracing::warn!(request_id, "placement change refused: {message}");
                    self.changes.failed.push((client, request_id, message));
                }
            }
        }
    }

    /// A worker announced what it holds: the core routes by it from now on, the coordinator
    /// counts it, and the worker gets this router's confirmation (behind every dispatch
    /// planned on its older set: they were sent before, on the same link).
    fn holding(&mut self, from: u32, p: &Placement, payload: &[u8], now: Instant) {
        let entries = match placement_entries(p, payload) {
            Ok(e) => e,
            Err(e) => {
                tracing::warn!(from, error = %e, "a worker's holding announcement is malformed; ignored");
                return;
            }
        };
        let held: Vec<(u32, u32)> = entries
            .iter()
            .filter(|&&(r, _, _)| r == from)
            .map(|&(_, l, e)| (l, e))
            .collect();
        if held.len() != entries.len() {
            tracing::warn!(from, "a worker announced experts of another rank; ignored");
            return;
        }
        match self.core.set_holdings(from, &held) {
            Ok(orphans) if !orphans.is_empty() => tracing::warn!(
                worker = %self.names.get(from as usize).map_or("?", String::as_str),
                version = p.version,
                "experts without an owner now (calls needing them fail until one holds them): {:?}",
                &orphans[..orphans.len().min(8)]
            ),
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(from, "a worker's holding announcement was refused: {e}");
                return;
            }
        }
        self.publish_coverage();
        if !p.message.is_empty() {
            tracing::warn!(
                from,
                version = p.version,
                "a worker refused a placement change: {}",
                p.message
            );
        }
        self.changes
            .coordinator
            .on_holding(from, p.version, &held, &p.message, p.request_id, now);
        // The first announcement on this link takes the worker up.
        if self
            .live
            .workers
            .get(from as usize)
            .is_some_and(|l| !l.load(Ordering::Acquire))
        {
            self.core.on_peer_up(from);
            self.set_live(from, true);
            tracing::debug!(from, version = p.version, "worker announced what it holds");
        }
        let seen = Placement::new(PlacementOp::Seen, p.version, 0);
        // Sent by `confirm` once the core's actions of this pass are carried out: dispatches
        // planned on the older set may still be queued in the core.
        self.changes
            .unconfirmed
            .push(from, OutFrame::new(Body::Placement(seen)));
        *self.stats.lock().unwrap_or_else(|e| e.into_inner()) = self.core.stats().clone();
    }

    /// Worker `from` gains an expert its host has no weights for and asks for a copy: a live
    /// owner other than it is asked to stream it here ([`crate::relay`]).
    fn fetch(&mut self, from: u32, p: &Placement, payload: &[u8]) {
        let entries = placement_entries(p, payload).unwrap_or_default();
        let owners: Vec<u32> = match entries[..] {
            [(_, layer, expert)] => self
                .core
                .live_owners(layer, expert)
                .into_iter()
                .filter(|&r| self.mesh.is_connected(r))
                .collect(),
            _ => Vec::new(),
        };
        let action = self
            .changes
            .relays
            .fetch(from, p.request_id, &entries, owners);
        self.relay(action);
    }

    /// A chunk of a relayed copy from its owner: on to the gainer, or to the next owner.
    fn relay_chunk(&mut self, from: u32, p: &Placement, payload: &[u8]) {
        let failed = !p.message.is_empty();
        if let Some(action) = self
            .changes
            .relays
            .chunk(from, p.request_id, failed, p.loaded == 1)
        {
            match action {
                ChunkRoute::Forward { gainer, gainer_id } => {
                    let mut fwd = p.clone();
                    fwd.request_id = gainer_id;
                    let frame = OutFrame::with_payload(
                        Body::Placement(fwd),
                        bytes::Bytes::copy_from_slice(payload),
                    );
                    self.send_control(gainer, frame);
                }
                ChunkRoute::Next(ask) => {
                    tracing::info!(
                        from,
                        "an owner could not copy the expert ({}); asking another",
                        p.message
                    );
                    self.relay(ask);
                }
            }
        }
    }

    /// The gainer's acknowledgement of a relayed copy: on to the owner (its window).
    fn relay_ack(&mut self, from: u32, p: &Placement) {
        if let Some(action) = self.changes.relays.ack(from, p.request_id, p.version) {
            self.relay(action);
        }
    }

    /// Worker `rank`'s link is gone: the copies it streamed fail at their gainers.
    fn relays_lost(&mut self, rank: u32) {
        let name = self
            .names
            .get(rank as usize)
            .cloned()
            .unwrap_or_else(|| format!("mesh rank {rank}"));
        for action in self.changes.relays.lost(rank, &name) {
            self.relay(action);
        }
    }

    /// Carries out a relay action other than a chunk's forward.
    fn relay(&self, action: RelayAction) {
        match action {
            RelayAction::Ask { owner, id, key } => {
                tracing::info!(
                    owner,
                    layer = key.0,
                    expert = key.1,
                    "relaying an expert copy"
                );
                let mut ask = Placement::new(PlacementOp::Fetch, 0, 1);
                ask.request_id = id;
                let entries = encode_placement_entries(&[(owner, key.0, key.1)]);
                let frame =
                    OutFrame::with_payload(Body::Placement(ask), bytes::Bytes::from(entries));
                self.send_control(owner, frame);
            }
            RelayAction::Refuse {
                gainer,
                gainer_id,
                why,
            } => {
                tracing::warn!(gainer, "expert copy refused: {why}");
                let frame = OutFrame::new(Body::Placement(Placement::chunk_error(gainer_id, &why)));
                self.send_control(gainer, frame);
            }
            RelayAction::Ack { owner, id, bytes } => {
                let mut ack = Placement::new(PlacementOp::Ack, bytes, 0);
                ack.request_id = id;
                self.send_control(owner, OutFrame::new(Body::Placement(ack)));
            }
        }
    }

    /// Sends the confirmations (`Seen`) whose worker has no dispatch begun before them still
    /// being sent ([`Confirmations`]): each goes on the link behind every dispatch planned on
    /// the worker's older set. Returns whether any is still waiting.
    fn confirm(&mut self) -> bool {
        for (rank, frame) in self.changes.unconfirmed.ready() {
            self.send_control(rank, frame);
        }
        self.changes.unconfirmed.pending()
    }

    /// Sends a control frame (a hold, a confirmation) to worker `rank`, in order behind what
    /// this thread sent it before; a failure is logged (a lost link is reported to the
    /// coordinator as a lost peer).
    fn send_control(&self, rank: u32, frame: OutFrame) {
        self.core.metrics().on_sent(rank, &frame);
        let mesh = self.mesh.clone();
        let mut send = Box::pin(async move {
            if let Err(e) = mesh.send(rank, &frame).await {
                tracing::warn!(rank, error = %e, "placement frame not delivered");
            }
        });
        let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
        if send
            .as_mut()
            .poll(&mut Context::from_waker(&waker))
            .is_pending()
        {
            self.rt.spawn(send);
        }
    }

    /// Takes the answers to this process's own changes ([`PlacementHandle`]) out of `answers`
    /// and hands each to its handle.
    fn answer_in_process(&mut self, answers: &mut Vec<(ClientId, ClientMsg)>) {
        answers.retain(|(client, msg)| {
            if *client != IN_PROCESS {
                return true;
            }
            let (id, answer) = match msg {
                ClientMsg::Placement(p) => (p.request_id, Ok(Applied::of(p))),
                ClientMsg::Error {
                    request_id,
                    message,
                    ..
                } => (*request_id, Err(message.clone())),
                ClientMsg::Response { request_id, .. } => (*request_id, Err(String::new())),
            };
            if let Some(reply) = self.changes.in_process.remove(&id) {
                let _ = reply.send(answer);
            }
            false
        });
    }

    /// Carries out the coordinator's actions: holds to workers, answers to frontends.
    fn coordinate(&mut self) -> bool {
        let mut any = false;
        let failed = std::mem::take(&mut self.changes.failed);
        let mut answers: Vec<(ClientId, ClientMsg)> = failed
            .into_iter()
            .map(|(client, request_id, message)| {
                let msg = ClientMsg::Error {
                    request_id,
                    code: ErrorCode::InvalidInput,
                    message,
                    share: None,
                };
                (client, msg)
            })
            .collect();
        while let Some(a) = self.changes.coordinator.poll_action() {
            any = true;
            match a {
                ChangeAction::Survey { rank, nonce } => {
                    let mut survey = Placement::new(PlacementOp::Survey, 0, 0);
                    survey.request_id = nonce;
                    self.send_control(rank, OutFrame::new(Body::Placement(survey)));
                }
                ChangeAction::Hold {
                    rank,
                    version,
                    experts,
                } => {
                    let entries: Vec<(u32, u32, u32)> =
                        experts.iter().map(|&(l, e)| (rank, l, e)).collect();
                    let hold = Placement::new(PlacementOp::Hold, version, entries.len());
                    let frame = OutFrame::with_payload(
                        Body::Placement(hold),
                        bytes::Bytes::from(encode_placement_entries(&entries)),
                    );
                    self.send_control(rank, frame);
                }
                ChangeAction::Applied {
                    client,
                    request_id,
                    version,
                    loaded,
                    released,
                    took,
                    unconfirmed,
                } => {
                    tracing::info!(
                        version,
                        loaded,
                        released,
                        "placement change applied in {took:?}"
                    );
                    let mut p = Placement::new(PlacementOp::Applied, version, 0);
                    if let Some(why) = unconfirmed {
                        tracing::warn!(version, "{why}");
                        p.message = placement_message(&why);
                    }
                    p.request_id = request_id;
                    p.loaded = loaded;
                    p.released = released;
                    p.millis = u32::try_from(took.as_millis()).unwrap_or(u32::MAX);
                    answers.push((client, ClientMsg::Placement(p)));
                }
                ChangeAction::Failed {
                    client,
                    request_id,
                    message,
                } => {
                    tracing::warn!(request_id, "placement change failed: {message}");
                    let msg = ClientMsg::Error {
                        request_id,
                        code: ErrorCode::PeerUnavailable,
                        message,
                        share: None,
                    };
                    answers.push((client, msg));
                }
            }
        }
        self.answer_in_process(&mut answers);
        if !answers.is_empty() {
            any = true;
            let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
            let mut cx = Context::from_waker(&waker);
            let clients = Arc::clone(&self.clients);
            let clients = clients.lock().unwrap_or_else(|e| e.into_inner());
            for (client, msg) in answers {
                if let Some(c) = clients.get(&client) {
                    self.answer(c, msg, &mut cx);
                }
            }
        }
        any
    }

    fn event(&mut self, ev: TransportEvent) {
        let now = Instant::now();
        let name = |r: u32| {
            self.names
                .get(r as usize)
                .cloned()
                .unwrap_or_else(|| format!("mesh rank {r}"))
        };
        match ev {
            TransportEvent::Frame(f) => {
                let from = f.peer();
                self.core.metrics().on_received(from, f.frame_len());
                match f.body() {
                    Body::Result(res) => self.core.on_result(from, res, f.payload(), now),
                    Body::Placement(p) if p.op == PlacementOp::Holding => {
                        self.holding(from, p, f.payload(), now)
                    }
                    Body::Placement(p) if p.op == PlacementOp::Settled => {
                        self.changes.coordinator.on_settled(from, p.version, now)
                    }
                    Body::Placement(p) if p.op == PlacementOp::Fetch => {
                        self.fetch(from, p, f.payload())
                    }
                    Body::Placement(p) if p.op == PlacementOp::Chunk => {
                        self.relay_chunk(from, p, f.payload())
                    }
                    Body::Placement(p) if p.op == PlacementOp::Ack => self.relay_ack(from, p),
                    Body::Error(e) => self.core.on_worker_error(
                        from,
                        e.request_id,
                        e.part,
                        e.code,
                        &e.message,
                        now,
                    ),
                    other => tracing::warn!(
                        from,
                        kind = kind_name(other),
                        "unexpected frame from a worker"
                    ),
                }
            }
            TransportEvent::PeerUp { peer, link, .. } => {
                tracing::info!(worker = %name(peer), link = link.name(), "worker connected");
                // Chosen for parts once it says what it holds (its first frame on the link).
                self.core.on_peer_joining(peer);
                self.set_live(peer, false);
                self.core.metrics().on_link(peer, true);
            }
            TransportEvent::PeerLost(e) => {
                tracing::warn!(worker = %name(e.peer), error = %e, "worker link lost");
                self.core.on_peer_lost(e.peer, now);
                self.set_live(e.peer, false);
                self.changes.coordinator.on_peer_lost(e.peer, now);
                self.relays_lost(e.peer);
                self.core.metrics().on_link(e.peer, false);
            }
        }
    }

    /// Record whether the core may choose worker `rank` ([`RouterService::is_worker_live`]).
    fn set_live(&self, rank: u32, live: bool) {
        if let Some(l) = self.live.workers.get(rank as usize) {
            l.store(live, Ordering::Release);
        }
        self.publish_coverage();
        self.core.metrics().on_joined(rank, live);
    }

    /// Publish how many routed experts have no live owner ([`Liveness`]), after a worker's
    /// liveness or holdings changed.
    fn publish_coverage(&self) {
        let joined = |r: u32| {
            self.live
                .workers
                .get(r as usize)
                .is_some_and(|l| l.load(Ordering::Acquire))
        };
        let n = self.core.uncovered_experts(joined);
        self.live.uncovered.store(n, Ordering::Release);
    }

    /// Carry out the core's actions (and the deferred router-side work after the sends it
    /// overlaps with). Returns whether there were any.
    fn act(&mut self, cx: &mut Context<'_>) -> bool {
        let mut any = self.perform(cx);
        if self.core.has_deferred() {
            // What was ready is sent; now run the router's own share of the work.
            self.core.run_deferred(Instant::now());
            any |= self.perform(cx);
        }
        any
    }

    /// Carry out every action the core has; returns whether it had any. The core's counters
    /// are published before the first (every action of this pass is already counted).
    fn perform(&mut self, cx: &mut Context<'_>) -> bool {
        let Some(first) = self.core.poll_action() else {
            return false;
        };
        *self.stats.lock().unwrap_or_else(|e| e.into_inner()) = self.core.stats().clone();
        // One short lock per pass; nothing below blocks (writes are polled once, then spawned).
        let clients = Arc::clone(&self.clients);
        let clients_now = clients.lock().unwrap_or_else(|e| e.into_inner());
        // An answer's admitted share goes with it and is released once it is written (or
        // dropped, its connection gone): [`AnswerShare`].
        let share = |client, request_id| AnswerShare::answered(&self.admission, client, request_id);
        let mut next = Some(first);
        while let Some(a) = next {
            match a {
                Action::Send {
                    rank,
                    frame,
                    batch,
                    part,
                } => self.send(rank, frame, batch, part, cx),
                Action::Respond {
                    client,
                    request_id,
                    tokens,
                    output,
                } => {
                    let msg = ClientMsg::Response {
                        request_id,
                        tokens,
                        hidden: self.hidden,
                        output,
                        share: share(client, request_id),
                    };
                    if let Some(c) = clients_now.get(&client) {
                        self.answer(c, msg, cx);
                    }
                }
                Action::Fail {
                    client,
                    request_id,
                    code,
                    message,
                } => {
                    let msg = ClientMsg::Error {
                        request_id,
                        code,
                        message,
                        share: share(client, request_id),
                    };
                    if let Some(c) = clients_now.get(&client) {
                        self.answer(c, msg, cx);
                    }
                }
            }
            next = self.core.poll_action();
        }
        true
    }

    /// Answer a request: written from this thread when the connection's writer is free (polled
    /// once; a write that has to wait goes on as a task), else queued for its writer task.
    /// Never lost to a full queue: every answer holds the permit of its request.
    fn answer(&self, c: &ClientOut, msg: ClientMsg, cx: &mut Context<'_>) {
        let Ok(mut w) = Arc::clone(&c.writer).try_lock_owned() else {
            let _ = c.tx.try_send(msg);
            return;
        };
        let (slots, peer) = (Arc::clone(&c.slots), c.peer);
        let mut write = Box::pin(async move {
            if let Err(e) = write_answer(&mut w, msg, &slots, &mut Vec::new()).await {
                tracing::info!(%peer, error = %e, "frontend connection closed while writing");
            }
        });
        if write.as_mut().poll(cx).is_pending() {
            self.rt.spawn(write);
        }
    }

    /// Send one dispatch frame. The send is polled once here: a link with credit writes the
    /// frame now, from this thread, without waking a runtime thread; a send that has to wait
    /// (credit, a busy writer, a full socket or ring) goes on as a task, never cancelled,
    /// within the rank's [`SendBacklog`] (past it the part fails at once, as a failed send). The
    /// rank's count of unfinished sends covers it until it is written (a worker's `Seen`
    /// waits for those begun before it: a smaller frame could otherwise take the link's
    /// credit first).
    fn send(&self, rank: u32, frame: OutFrame, batch: u64, part: u32, cx: &mut Context<'_>) {
        let (mesh, tx) = (self.mesh.clone(), self.tx.clone());
        let bytes = expertmesh_transport::codec::frame_len(&frame.body, frame.payload.len());
        let Ok(held) = self.send_backlog.reserve(rank, bytes) else {
            // The worker is not taking its frames: this part fails now (a replica takes it,
            // or its batch fails) instead of waiting in memory behind the others.
            tracing::debug!(
                rank,
                batch,
                part,
                "dispatch not sent: the worker's backlog is full"
            );
            let refused = CoreInput::SendRefused { rank, batch, part };
            self.rt.spawn(async move {
                let _ = send_to_core(&tx, refused).await;
            });
            return;
        };
        self.core.metrics().on_sent(rank, &frame);
        let under_way = self.changes.unconfirmed.begin_send(rank);
        let mut send = Box::pin(async move {
            let sent = mesh.send(rank, &frame).await;
            drop(under_way);
            drop(held);
            if let Err(e) = sent {
                tracing::warn!(rank, error = %e, "dispatch send failed");
                let failed = CoreInput::SendFailed { rank, batch, part };
                let _ = send_to_core(&tx, failed).await;
            }
        });
        if send.as_mut().poll(cx).is_pending() {
            self.rt.spawn(send);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{READY_WITHOUT_ALL_AFTER, SendBacklog, idle_wait, not_ready_yet};

    /// Ready when every worker joined; without all of them only once every routed expert has
    /// a live owner and the start is [`READY_WITHOUT_ALL_AFTER`] behind.
    #[test]
    fn a_router_is_ready_when_all_joined_or_later_when_every_expert_is_served() {
        let shown = ["node1/gpu3".to_string()];
        let after = READY_WITHOUT_ALL_AFTER;
        let early = after / 2;
        assert_eq!(not_ready_yet([0, 4], &[], 12, Duration::ZERO), None);
        let why = not_ready_yet([1, 4], &shown, 12, after * 10).unwrap();
        assert!(
            why.contains("1 of 4 workers not joined: node1/gpu3;")
                && why.contains("12 routed experts without a live owner"),
            "{why}"
        );
        let why = not_ready_yet([1, 4], &shown, 0, early).unwrap();
        assert!(
            why.contains("every routed expert has a live owner"),
            "{why}"
        );
        assert_eq!(not_ready_yet([1, 4], &shown, 0, after), None);
        let why = not_ready_yet([9, 12], &shown, 3, early).unwrap();
        assert!(why.contains("node1/gpu3, ...;"), "{why}");
    }

    use std::time::Duration;

    /// Each rank's unsent dispatch bytes stay within the bound; what a written frame gives
    /// back can be reserved again; ranks are apart.
    #[test]
    fn the_send_backlog_bounds_each_rank_apart() {
        let b = SendBacklog::new(3, 100);
        let first = b.reserve(1, 60).unwrap();
        let second = b.reserve(1, 40).unwrap();
        assert!(b.reserve(1, 1).is_err(), "rank 1 is at its bound");
        assert!(b.reserve(2, 100).is_ok(), "rank 2 is not");
        drop(first);
        assert!(b.reserve(1, 50).is_ok());
        drop(second);
        assert!(
            b.reserve(7, 1 << 40).unwrap().is_none(),
            "a rank past the table is not bounded here"
        );
    }

    const S: Duration = Duration::from_secs(1);

    /// Idleness counts from the later of the last request and the last answer, never while a
    /// request is in flight; the wait is what is left of the period.
    #[test]
    fn idleness_counts_from_the_last_request_or_answer_whichever_is_later() {
        let idle = 10 * S;
        // Nothing in flight, no answer yet: from the request.
        assert_eq!(idle_wait(idle, 10 * S, None, false), None);
        assert_eq!(idle_wait(idle, 4 * S, None, false), Some(6 * S));
        // A slow answer 2 s ago to a request 10 s ago: a whole period from the answer.
        assert_eq!(idle_wait(idle, 10 * S, Some(2 * S), false), Some(8 * S));
        assert_eq!(idle_wait(idle, 25 * S, Some(10 * S), false), None);
        // A request after the last answer: from the request.
        assert_eq!(idle_wait(idle, 3 * S, Some(9 * S), false), Some(7 * S));
        // In flight: looked at again within a second, whatever the times.
        assert_eq!(idle_wait(idle, 60 * S, Some(60 * S), true), Some(S));
        assert_eq!(
            idle_wait(S / 2, 60 * S, None, true),
            Some(S / 2),
            "a period under a second"
        );
    }
}
