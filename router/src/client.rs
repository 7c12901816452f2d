//! `RouterClient`: what a serving frontend links to call the router once per MoE layer.
//!
//! Why this exists: the attention/dense half of a model server should not know about frames,
//! dtypes or request ids. One call sends a layer's hidden states (and optionally the router
//! logits it already computed) and returns the combined expert output, or an error that says
//! what the router refused and why.
//!
//! # One call, or several in flight
//!
//! [`RouterClient::call`] sends a request and waits for its answer. To overlap micro-batches on
//! one connection, split it: [`RouterClient::submit`] encodes and sends a request and returns a
//! [`CallHandle`] at once; [`RouterClient::wait`] (or [`RouterClient::wait_into`], into the
//! caller's buffer) returns that request's output. The router answers in completion order;
//! answers are matched to handles by request id, so handles may be waited in any order, and
//! `call` may be used while other handles are outstanding.
//!
//! * **Bound.** At most [`RouterClient::max_in_flight`] requests are sent and unanswered at a
//!   time (default [`DEFAULT_MAX_IN_FLIGHT`], the router's default per-connection limit). A
//!   `submit` at the limit first reads answers (keeping them for their handles) until one
//!   arrives; it waits, it never fails for that. Set the limit no higher than the router's
//!   `max_outstanding_per_client`: the client reads and writes on its connection one frame at
//!   a time, so a request the router will not read (its limit reached) could block the client's
//!   write while the router's answers fill the socket.
//! * **Held answers.** An answer read while waiting for another handle (or while `submit` makes
//!   room) is kept until its handle is waited or dropped. The client thus holds at most one
//!   answer per handle the caller still owns, besides the requests in flight.
//! * **Errors.** A refusal from the router (an error frame) fails only its own handle, as
//!   [`ClientError::Server`] with the router's code. Input that cannot be encoded is refused by
//!   `submit` before anything is sent. A broken connection (socket error, closed by the router,
//!   bytes that cannot be framed, a frame a router never sends) fails every request in flight
//!   with the same error, and every later `submit` returns it too; answers that arrived before
//!   stay valid. An error frame that names no request (request id 0: the router could not
//!   read the id of something it was sent, which only [`RouterClient::write_raw`] produces) is
//!   logged and otherwise ignored. The exception is a connection the router closed for
//!   idleness (its frontend idle timeout, `router --frontend-idle-timeout-s`), which it says
//!   with a `ShuttingDown` frame naming no request, and only with nothing in flight; it reads
//!   nothing after deciding, so nothing is lost. With nothing in flight, `submit` first looks
//!   for that frame and, finding it, connects to the same router again before sending; a
//!   request that was sent as the router decided crosses the frame unread, and is sent again
//!   on a new connection to the same router (the client keeps every payload until its answer,
//!   and reuses the buffer after), by a failover client too. Only a failed connect (a
//!   failover client then moves to the next router), or a second idle close before any of
//!   them is answered, fails the requests.
//! * **Dropped handles.** Dropping a [`CallHandle`] without waiting abandons its request: the
//!   router still computes it and it keeps its in-flight slot until its answer arrives, which is
//!   then discarded (an answer that had already arrived is freed at the client's next call).
//!   Nothing is kept for a dropped handle.
//! * **Cancellation.** Every method is cancel-safe: dropping its future (a timeout, a
//!   `select!`) never leaves the connection unusable. A frame read or write that was under way
//!   is finished by the next call on the client, so the stream stays framed and nothing is
//!   lost. Dropping a `wait` or `wait_into` future drops the handle it was given: the request is
//!   abandoned as above. Dropping a `submit` (or `call`) future abandons its request, which may
//!   or may not have been sent.
//! * **Progress.** There is no background task: the connection is read only while a `submit`,
//!   `wait` or `call` of this client is awaited. Answers that arrive in between wait in the
//!   socket (the router's per-connection limit bounds them). Reading and writing are
//!   independent (`client/link.rs`): a write that the router does not take never keeps the
//!   client from reading.
//!
//! # Deadlines
//!
//! Every request has a deadline on the client: the `deadline` argument, or
//! [`ClientOptions::default_deadline`] when it is `None`. The router is told the `deadline`
//! too (`None`: the router's own default applies there) and normally answers
//! [`ErrorCode::DeadlineExceeded`] itself; but whatever the router does (it is stopped, cut off,
//! or never answers), the client's `wait` returns [`ClientError::Deadline`] (whose
//! [`code`](ClientError::code) is `DeadlineExceeded`) at the request's deadline, measured from
//! its `submit`, plus [`ROUTER_ANSWER_GRACE`] when the router was told the deadline (so a live
//! router's own answer, which names what it waited for, arrives first) and the few
//! milliseconds of a timer. `submit` itself gives up with the same
//! error when the request could not be sent before its deadline. A request whose deadline
//! passed is forgotten at once: its in-flight slot is free for the next request, and its late
//! answer, if one comes, is discarded.
//!
//! # Keepalive
//!
//! While calls are outstanding, a router that has sent nothing for
//! [`ClientOptions::keepalive_interval`] is probed (a request every router refuses at once from
//! its connection's reader, without computing: `client/liveness.rs`); if it still sends nothing
//! within [`ClientOptions::keepalive_timeout`] after the probe, it is given up as
//! [`ClientError::Unresponsive`], which names the router and how long it was silent. So a
//! stopped, hung or partitioned router is noticed at most `keepalive_interval +
//! keepalive_timeout` (defaults 1 s + 2 s) after the last frame it sent or after the call
//! started, whichever is later, whatever the calls' deadlines, while the caller is in a call
//! of this client (there is no background task). A connection on which nothing is outstanding
//! is not probed; its next call starts the clock. Silence while the caller was away between
//! calls is not held against the router: what it sent meanwhile is read first (answers that
//! came in time are answers, whatever their deadlines say by then), and it is probed before it
//! is given up, unless a write to it is blocked.
//!
//! # Failover over several routers
//!
//! [`RouterClient::connect_any`] takes a list of router addresses (routers of one fabric, which
//! share its expert pool and compute the same answers) and connects to the first that answers.
//! When that router is lost (the connection closes or fails, the keepalive gives it up, it
//! answers `ShuttingDown`, or it sends something a router never sends), the client moves to the
//! next router in the list (round robin, each tried with [`ClientOptions::connect_timeout`];
//! after a round in which none answered it waits a jittered backoff that doubles up to
//! [`ClientOptions::max_backoff`]) and sends again, in order, every request that had no answer yet and whose handle is still held,
//! with the rest of its deadline. Layer calls are idempotent, so a request answered twice is
//! harmless, and the old connection is closed before anything is re-sent, so no late answer of
//! the lost router can be taken for the new one's. A caller sees the answer, the router's
//! refusal, or [`ClientError::Deadline`] when no router answered in time; never a hang. Answers
//! that arrived before the loss stay valid. The client keeps each unanswered request's encoded
//! payload for this (at most [`RouterClient::max_in_flight`] of them). With a single address,
//! `connect_any` reconnects to that router (a restart) within the calls' deadlines.
//! [`RouterClient::connect`] does not fail over: a lost connection fails every request in
//! flight and every later call, as described under *Errors*.

mod driver;
mod encode;
mod link;
pub(crate) mod liveness;
mod pending;
pub mod placement;
#[cfg(test)]
mod tests;

pub use encode::HiddenStates;

use encode::Layout;
use expertmesh_transport::codec::{Body, ErrorCode, LayerRequest};
use expertmesh_transport::dtype::{self, ActivationDtype};
use expertmesh_transport::frontend::{ClientFrame, FrameConnection, FrontendConfig, FrontendError};
use link::Link;
use liveness::{Keepalive, Reconnect};
use pending::Pending;
use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long past a deadline the router was told the client still waits for the router's own
/// answer (a live router answers `DeadlineExceeded` at the deadline, naming the devices it
/// waited for); a stopped or cut-off router is given up then.
pub const ROUTER_ANSWER_GRACE: Duration = Duration::from_millis(250);

/// `budget` from now, or about a century from now where `budget` is longer (a deadline of
/// `Duration::MAX` means "no deadline", not an overflow).
pub(crate) fn instant_after(budget: Duration) -> Instant {
    const CENTURY: Duration = Duration::from_secs(100 * 365 * 24 * 3600);
    let now = Instant::now();
    now.checked_add(budget.min(CENTURY)).unwrap_or(now)
}

/// A duration in whole microseconds for the wire, at most `u64::MAX` (which the router cuts to
/// its longest deadline).
pub(crate) fn wire_micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// Largest payload of a [`RouterClient::check_shape`] probe: it asks about at most this many
/// bytes of fp8 activations, so the router decodes a few MiB at most.
pub const SHAPE_PROBE_BYTES: usize = 8 << 20;

/// Default of [`RouterClient::max_in_flight`]: the router's default
/// `max_outstanding_per_client`.
pub const DEFAULT_MAX_IN_FLIGHT: usize = 32;

/// The client keeps request buffers for reuse, up to this many bytes in all (one that does
/// not fit is freed once its request is answered).
const RETAIN_BUFFER_BYTES: usize = 16 << 20;

/// Why a call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// The connection failed. (Its cause is part of the message, not a separate source, so
    /// that printing the error chain says it once.)
    #[error("router connection: {0}")]
    Transport(FrontendError),
    /// The router answered with an error.
    #[error("router refused request {request_id} ({code:?}): {message}")]
    Server {
        /// The request.
        request_id: u64,
        /// Stable error code.
        code: ErrorCode,
        /// The router's explanation.
        message: String,
    },
    /// The input cannot be encoded (shape, NaN for fp8, ...).
    #[error("cannot encode the request: {0}")]
    Input(String),
    /// A call was given something it cannot use: an output buffer of the wrong size, a handle
    /// of another client.
    #[error("invalid call: {0}")]
    Usage(String),
    /// The router answered something that is not a response to this call.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// The request's deadline passed on the client without an answer (whatever the router
    /// did); [`ClientError::code`] is [`ErrorCode::DeadlineExceeded`].
    #[error("request {request_id}: no answer within its deadline of {deadline:?}: {detail}")]
    Deadline {
        /// The request (0: it was never sent; the client waited for a free slot).
        request_id: u64,
        /// The deadline it was given.
        deadline: Duration,
        /// What the client was waiting on (the router's address, or why no router was
        /// connected).
        detail: String,
    },
    /// The router sent nothing while calls were outstanding and did not answer a keepalive
    /// probe: the process is stopped or hung, or the network is cut.
    #[error(
        "router {router} sent nothing for {silent:?} while calls were outstanding and did not answer a keepalive probe (stopped, hung or unreachable)"
    )]
    Unresponsive {
        /// The router's address.
        router: SocketAddr,
        /// How long it was silent.
        silent: Duration,
    },
}

impl From<FrontendError> for ClientError {
    fn from(e: FrontendError) -> Self {
        ClientError::Transport(e)
    }
}

impl ClientError {
    /// The router's error code, when the router refused the call.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            ClientError::Server { code, .. } => Some(*code),
            ClientError::Deadline { .. } => Some(ErrorCode::DeadlineExceeded),
            _ => None,
        }
    }

    /// An equal error, for each request a broken connection fails (an I/O cause is carried as
    /// its kind and message).
    fn duplicate(&self, peer: SocketAddr) -> ClientError {
        match self {
            ClientError::Transport(e) => ClientError::Transport(duplicate_transport(e, peer)),
            ClientError::Server {
                request_id,
                code,
                message,
            } => ClientError::Server {
                request_id: *request_id,
                code: *code,
                message: message.clone(),
            },
            ClientError::Input(m) => ClientError::Input(m.clone()),
            ClientError::Usage(m) => ClientError::Usage(m.clone()),
            ClientError::Protocol(m) => ClientError::Protocol(m.clone()),
            ClientError::Deadline {
                request_id,
                deadline,
                detail,
            } => ClientError::Deadline {
                request_id: *request_id,
                deadline: *deadline,
                detail: detail.clone(),
            },
            ClientError::Unresponsive { router, silent } => ClientError::Unresponsive {
                router: *router,
                silent: *silent,
            },
        }
    }
}

/// See [`ClientError::duplicate`].
fn duplicate_transport(e: &FrontendError, peer: SocketAddr) -> FrontendError {
    match e {
        FrontendError::Io { peer, source } => FrontendError::Io {
            peer: *peer,
            source: std::io::Error::new(source.kind(), source.to_string()),
        },
        FrontendError::Handshake { peer, source } => FrontendError::Handshake {
            peer: *peer,
            source: source.clone(),
        },
        FrontendError::BadFrame {
            peer,
            recoverable,
            request_id,
            error,
        } => FrontendError::BadFrame {
            peer: *peer,
            recoverable: *recoverable,
            request_id: *request_id,
            error: error.clone(),
        },
        FrontendError::Closed { peer } => FrontendError::Closed { peer: *peer },
        FrontendError::NotFrontend { peer, what } => FrontendError::NotFrontend {
            peer: *peer,
            what: what.clone(),
        },
        other => FrontendError::Io {
            peer,
            source: std::io::Error::other(other.to_string()),
        },
    }
}

/// The request a recoverable bad frame belongs to: the frame could not be encoded or decoded,
/// but the stream is still framed, so only that request fails.
fn recoverable_request(e: &FrontendError) -> Option<u64> {
    match e {
        FrontendError::BadFrame {
            recoverable: true,
            request_id,
            ..
        } => *request_id,
        _ => None,
    }
}

/// What the client keeps for a request until its handle takes it.
type Answer = Result<ClientFrame, ClientError>;

/// Request ids of handles dropped without being waited, shared by a client and its handles.
type Abandoned = Arc<Mutex<Vec<u64>>>;

/// A request sent by [`RouterClient::submit`]; redeem it with [`RouterClient::wait`] or
/// [`RouterClient::wait_into`] on the same client.
///
/// Dropping it without waiting abandons the request: its answer is discarded when it arrives
/// (see the [module docs](self)).
#[must_use = "a request's output is returned by RouterClient::wait; dropping the handle discards it"]
pub struct CallHandle {
    request_id: u64,
    tokens: usize,
    hidden: usize,
    /// The request's deadline on the client.
    deadline: Instant,
    /// The client's list of abandoned requests; `None` once the handle was redeemed.
    owner: Option<Abandoned>,
}

impl std::fmt::Debug for CallHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CallHandle")
            .field("request_id", &self.request_id)
            .field("tokens", &self.tokens)
            .field("hidden", &self.hidden)
            .finish()
    }
}

impl CallHandle {
    /// The request id on the wire (it appears in the router's logs and errors).
    pub fn request_id(&self) -> u64 {
        self.request_id
    }

    /// Tokens of the request.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// Hidden size of the request.
    pub fn hidden(&self) -> usize {
        self.hidden
    }

    /// Values of the output (`tokens × hidden`): the length [`RouterClient::wait_into`] needs.
    pub fn output_len(&self) -> usize {
        self.tokens * self.hidden
    }

    fn belongs_to(&self, abandoned: &Abandoned) -> bool {
        self.owner
            .as_ref()
            .is_some_and(|o| Arc::ptr_eq(o, abandoned))
    }

    /// The request was redeemed: dropping the handle no longer abandons it.
    fn redeem(&mut self) {
        self.owner = None;
    }
}

impl Drop for CallHandle {
    fn drop(&mut self) {
        if let Some(owner) = self.owner.take() {
            lock(&owner).push(self.request_id);
        }
    }
}

fn lock(a: &Abandoned) -> std::sync::MutexGuard<'_, Vec<u64>> {
    a.lock().unwrap_or_else(|e| e.into_inner())
}

/// Default of [`ClientOptions::default_deadline`]: above the router's default deadline (10 s)
/// and the longer ones fabrics are often configured with, so that a router that is alive
/// answers first (a router that is not is noticed sooner by the keepalive).
pub const DEFAULT_CALL_DEADLINE: Duration = Duration::from_secs(30);

/// How a [`RouterClient`] bounds its waits: deadlines, keepalive, reconnects (see the
/// [module docs](self)).
///
/// Build one from the defaults: `ClientOptions { keepalive_timeout: d, ..ClientOptions::default() }`.
#[derive(Clone, Debug)]
pub struct ClientOptions {
    /// The client-side deadline of a call given no `deadline`.
    pub default_deadline: Duration,
    /// Probe a router that has sent nothing for this long while calls are outstanding
    /// (`Duration::MAX`: never; the calls' deadlines still hold).
    pub keepalive_interval: Duration,
    /// Give up a router that sends nothing for this long after a probe. Raise it for routers
    /// that may be too loaded to read a probe for seconds.
    pub keepalive_timeout: Duration,
    /// Limit of one connect attempt (TCP connect and handshake) when failing over.
    pub connect_timeout: Duration,
    /// First backoff after a round of failed connect attempts (it doubles each round).
    pub min_backoff: Duration,
    /// Largest backoff between rounds of connect attempts.
    pub max_backoff: Duration,
}

impl Default for ClientOptions {
    /// Deadline [`DEFAULT_CALL_DEADLINE`], keepalive 1 s + 2 s, connect attempts of 1 s,
    /// backoff from 50 ms up to 1 s.
    fn default() -> Self {
        Self {
            default_deadline: DEFAULT_CALL_DEADLINE,
            keepalive_interval: Duration::from_secs(1),
            keepalive_timeout: Duration::from_secs(2),
            connect_timeout: Duration::from_secs(1),
            min_backoff: Duration::from_millis(50),
            max_backoff: Duration::from_secs(1),
        }
    }
}

/// A request in flight, as the client tracks it until it is answered or its deadline passes.
struct Call {
    /// The request header (its `deadline_us` is the one given by the caller).
    req: LayerRequest,
    /// The payload: kept until answered (sent again after an idle close, or on another router
    /// by a failover client); each write holds another reference.
    payload: Arc<Vec<u8>>,
    /// The client-side deadline.
    deadline: Instant,
    /// The deadline the call was given.
    budget: Duration,
    /// Written on the current connection.
    sent: bool,
}

/// A connection to the router service, with up to [`RouterClient::max_in_flight`] requests in
/// flight (see the [module docs](self) for pipelining, errors, deadlines, keepalive and
/// failover). Open several clients for concurrency across tasks: the methods take `&mut self`.
pub struct RouterClient {
    /// The routers this client may use (one for [`RouterClient::connect`]).
    routers: Vec<SocketAddr>,
    /// Whether a lost router is replaced ([`RouterClient::connect_any`]).
    failover: bool,
    /// Index in `routers` of the connected (or last connected) router.
    current: usize,
    cfg: FrontendConfig,
    opts: ClientOptions,
    link: Link,
    keepalive: Keepalive,
    reconnect: Reconnect,
    /// Why the last router was given up, while a failover client has none.
    lost: Option<String>,
    /// Times a failover client connected to a router after losing one.
    failovers: u64,
    pending: Pending<Answer>,
    /// Every request in flight (abandoned ones included), by id.
    calls: HashMap<u64, Call>,
    /// Requests to write on the current connection, in order.
    to_send: VecDeque<u64>,
    /// The request (or probe) whose frame is being written (0: raw bytes).
    writing: Option<u64>,
    abandoned: Abandoned,
    /// The error that broke the connection; every later call returns it.
    broken: Option<ClientError>,
    max_in_flight: usize,
    next_id: u64,
    /// Sequence of keepalive probes.
    next_probe: u64,
    /// Request buffers kept for reuse, at most [`RETAIN_BUFFER_BYTES`] in all.
    spares: Vec<Vec<u8>>,
    /// The capacities of `spares`, summed (kept as it changes, not summed per recycle).
    spare_bytes: usize,
    /// The router closed the connection for idleness with requests on their way: connect to
    /// it again at the next step.
    reopen: bool,
    /// Requests were sent again after an idle close and none has been answered since: a
    /// second idle close then breaks the connection instead of reconnecting again.
    reopened_unanswered: bool,
}

impl std::fmt::Debug for RouterClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RouterClient")
            .field("routers", &self.routers)
            .field("link", &self.link)
            .field("in_flight", &self.pending.in_flight())
            .field("ready", &self.pending.held())
            .field("max_in_flight", &self.max_in_flight)
            .field("lost", &self.lost)
            .field("broken", &self.broken)
            .finish()
    }
}

impl RouterClient {
    /// Connect (and authenticate, when `cfg` carries a secret) to one router, with default
    /// [`ClientOptions`]; no failover (see [`RouterClient::connect_any`]).
    pub async fn connect(addr: SocketAddr, cfg: &FrontendConfig) -> Result<Self, ClientError> {
        Self::connect_with(addr, cfg, ClientOptions::default()).await
    }

    /// [`RouterClient::connect`] with options `opts`.
    pub async fn connect_with(
        addr: SocketAddr,
        cfg: &FrontendConfig,
        opts: ClientOptions,
    ) -> Result<Self, ClientError> {
        let conn = FrameConnection::connect(addr, cfg).await?;
        Ok(Self::new(vec![addr], 0, false, cfg, opts, conn))
    }

    /// A client that fails over between `routers` (routers of one fabric; see the
    /// [module docs](self)): it connects to the first that answers, trying them in order with
    /// `opts.connect_timeout` each, and moves on to the next when the one it uses is lost.
    /// Fails when the list is empty or none answered (the error names each address and why).
    pub async fn connect_any(
        routers: &[SocketAddr],
        cfg: &FrontendConfig,
        opts: ClientOptions,
    ) -> Result<Self, ClientError> {
        if routers.is_empty() {
            return Err(ClientError::Usage("no router address to connect to".into()));
        }
        let mut failures = Vec::new();
        for (i, &addr) in routers.iter().enumerate() {
            match driver::connect_within(addr, cfg, opts.connect_timeout).await {
                Ok(conn) => return Ok(Self::new(routers.to_vec(), i, true, cfg, opts, conn)),
                Err(e) => failures.push(e),
            }
        }
        if failures.len() == 1 {
            return Err(failures.remove(0));
        }
        let all: Vec<String> = failures.iter().map(|e| e.to_string()).collect();
        Err(ClientError::Transport(FrontendError::Io {
            peer: routers[0],
            source: std::io::Error::new(
                std::io::ErrorKind::NotConnected,
                format!("no router answered: {}", all.join("; ")),
            ),
        }))
    }

    fn new(
        routers: Vec<SocketAddr>,
        current: usize,
        failover: bool,
        cfg: &FrontendConfig,
        opts: ClientOptions,
        conn: FrameConnection,
    ) -> Self {
        let now = Instant::now();
        let reconnect = Reconnect::new(routers.len(), current, opts.min_backoff, opts.max_backoff);
        Self {
            keepalive: Keepalive::new(opts.keepalive_interval, opts.keepalive_timeout, now),
            reconnect,
            routers,
            failover,
            current,
            cfg: cfg.clone(),
            opts,
            link: Link::new(conn),
            lost: None,
            failovers: 0,
            pending: Pending::default(),
            calls: HashMap::new(),
            to_send: VecDeque::new(),
            writing: None,
            abandoned: Abandoned::default(),
            broken: None,
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
            next_id: 1,
            next_probe: 1,
            spares: Vec::new(),
            spare_bytes: 0,
            reopen: false,
            reopened_unanswered: false,
        }
    }

    /// The address of the router in use (or last used, while a failover client has none).
    pub fn peer_addr(&self) -> SocketAddr {
        self.routers[self.current]
    }

    /// The routers this client may use.
    pub fn routers(&self) -> &[SocketAddr] {
        &self.routers
    }

    /// How many times this client moved to a router after losing one.
    pub fn failovers(&self) -> u64 {
        self.failovers
    }

    /// The client's options.
    pub fn options(&self) -> &ClientOptions {
        &self.opts
    }

    /// Replace the client's options (deadlines of requests already submitted do not change).
    pub fn set_options(&mut self, opts: ClientOptions) {
        let now = Instant::now();
        self.keepalive = Keepalive::new(opts.keepalive_interval, opts.keepalive_timeout, now);
        self.reconnect = Reconnect::new(
            self.routers.len(),
            self.current,
            opts.min_backoff,
            opts.max_backoff,
        );
        self.opts = opts;
    }

    /// How many requests may be sent and unanswered at a time.
    pub fn max_in_flight(&self) -> usize {
        self.max_in_flight
    }

    /// Set [`RouterClient::max_in_flight`] (at least 1). Keep it at most the router's
    /// `max_outstanding_per_client` (see the [module docs](self)). Lowering it below the
    /// requests in flight now makes the next `submit` wait until enough have been answered.
    pub fn set_max_in_flight(&mut self, n: usize) {
        self.max_in_flight = n.max(1);
    }

    /// Requests sent and not answered yet (abandoned ones included).
    pub fn in_flight(&self) -> usize {
        self.pending.in_flight()
    }

    /// Answers received and held for handles that have not been waited yet.
    pub fn ready(&self) -> usize {
        self.pending.held()
    }

    /// One MoE layer call with f32 hidden states `x` (`[tokens][hidden]`), sent as f32.
    pub async fn call(
        &mut self,
        layer: u32,
        x: &[f32],
        hidden: usize,
        logits: Option<&[f32]>,
        deadline: Option<Duration>,
    ) -> Result<Vec<f32>, ClientError> {
        self.call_as(layer, x, hidden, ActivationDtype::F32, logits, deadline)
            .await
    }

    /// One MoE layer call, sending the hidden states encoded as `dtype`.
    pub async fn call_as(
        &mut self,
        layer: u32,
        x: &[f32],
        hidden: usize,
        dtype: ActivationDtype,
        logits: Option<&[f32]>,
        deadline: Option<Duration>,
    ) -> Result<Vec<f32>, ClientError> {
        let x = HiddenStates::F32As(x, dtype);
        let handle = self.submit(layer, x, hidden, logits, deadline).await?;
        self.wait(handle).await
    }

    /// Send one MoE layer call and return without waiting for its answer: the hidden states `x`
    /// (`[tokens][hidden]`; `&[f32]`, `&Vec<f32>` or any [`HiddenStates`]), the router logits
    /// `[tokens][experts]` when the frontend computed them, and the `deadline` (`None`: the
    /// router's default on the router, [`ClientOptions::default_deadline`] on the client; see
    /// the [module docs](self)). Redeem the handle with [`RouterClient::wait`] or
    /// [`RouterClient::wait_into`].
    ///
    /// Returns once the request is written to the connection. With
    /// [`RouterClient::max_in_flight`] requests unanswered, it first reads answers (keeping
    /// them for their handles) until one arrives. Errors: [`ClientError::Input`] for input that
    /// cannot be encoded (nothing is sent), [`ClientError::Deadline`] when it could not be sent
    /// in time, or the connection's error when it is broken.
    pub async fn submit<'a>(
        &mut self,
        layer: u32,
        x: impl Into<HiddenStates<'a>>,
        hidden: usize,
        logits: Option<&[f32]>,
        deadline: Option<Duration>,
    ) -> Result<CallHandle, ClientError> {
        let x = x.into();
        let layout = Layout::of(&x, hidden, logits)?;
        layout.check_frame(self.cfg.codec.max_frame_bytes)?;
        let mut buf = self.take_buffer(layout.total);
        if let Err(e) = encode::write_payload(&x, logits, &layout, &mut buf) {
            self.recycle(buf);
            return Err(e);
        }
        let (t, d, e) = (layout.tokens, layout.dtype, layout.logit_experts);
        let req = raw_request(layer, t, hidden, d, e, deadline);
        self.submit_payload(req, buf, deadline).await
    }

    /// The output of the request behind `handle` (`[tokens][hidden]` f32), reading answers
    /// until it arrives; answers for other handles are kept for them. Errors: the router's
    /// refusal of this request ([`ClientError::Server`]), the connection's error when it broke
    /// before the answer came, or [`ClientError::Usage`] for a handle of another client.
    ///
    /// Cancel-safe; dropping this future drops `handle` (its request is abandoned).
    pub async fn wait(&mut self, handle: CallHandle) -> Result<Vec<f32>, ClientError> {
        let mut out = vec![0f32; handle.output_len()];
        self.wait_into(handle, &mut out).await?;
        Ok(out)
    }

    /// [`RouterClient::wait`], writing the output into `out`, which must hold exactly
    /// [`CallHandle::output_len`] values (`tokens × hidden`). A buffer of another length is
    /// refused with [`ClientError::Usage`] before anything is read; the handle is consumed
    /// either way (a refused one is abandoned) and the connection is not affected.
    pub async fn wait_into(
        &mut self,
        handle: CallHandle,
        out: &mut [f32],
    ) -> Result<(), ClientError> {
        let (id, tokens, hidden) = (handle.request_id, handle.tokens, handle.hidden);
        if out.len() != tokens * hidden {
            return Err(ClientError::Usage(format!(
                "the output buffer holds {} values; request {id} returns {tokens} tokens x {hidden} = {}",
                out.len(),
                tokens * hidden
            )));
        }
        let frame = self.wait_answer(handle).await?;
        decode_response(&frame, id, tokens, hidden, out)
    }

    /// Ask the router whether it accepts a request of this shape (`tokens` × `hidden` for
    /// `layer`) without sending the data, so that a caller can refuse a huge input before
    /// reading it. Returns how many tokens the router was asked about and accepts
    /// (`tokens`, or [`SHAPE_PROBE_BYTES`]` / hidden` when that is fewer), or
    /// [`ClientError::Server`] with the router's reason: an unknown layer, a wrong hidden size,
    /// or more tokens than its per-request limit (said for `tokens`).
    ///
    /// How: the router checks a request's layer, hidden size and token count, then decodes the
    /// payload and refuses non-finite values before anything is computed. The probe is an fp8
    /// request of NaNs: refused as non-finite exactly when its shape is acceptable.
    pub async fn check_shape(
        &mut self,
        layer: u32,
        tokens: usize,
        hidden: usize,
    ) -> Result<usize, ClientError> {
        if tokens > u32::MAX as usize || hidden > u32::MAX as usize {
            return Err(ClientError::Input(format!(
                "{tokens} tokens x {hidden} values: a request describes at most {} of either",
                u32::MAX
            )));
        }
        let t = tokens.min((SHAPE_PROBE_BYTES / hidden.max(1)).max(1));
        let dtype = ActivationDtype::Fp8E4m3;
        let bytes = dtype.payload_bytes(t, hidden).ok_or_else(|| {
            ClientError::Input(format!("{t} x {hidden} cannot be sent as {}", dtype.name()))
        })?;
        let mut payload = self.take_buffer(bytes as usize);
        payload.fill(0xff); // fp8 NaN codes, NaN scales
        let req = raw_request(layer, t, hidden, dtype, 0, None);
        let answer = match self.submit_payload(req, payload, None).await {
            Ok(handle) => self.wait(handle).await,
            Err(e) => Err(e),
        };
        match answer {
            Err(ClientError::Server { code, message, .. })
                if code == ErrorCode::InvalidInput
                    && message.ends_with(crate::core::NON_FINITE_INPUT) =>
            {
                Ok(t)
            }
            Err(ClientError::Server {
                request_id,
                code,
                message,
            }) => {
                // The router names the probe's token count; say the caller's.
                let message = match message.strip_prefix(&format!("{t} tokens:")) {
                    Some(rest) => format!("{tokens} tokens:{rest}"),
                    None => message,
                };
                Err(ClientError::Server {
                    request_id,
                    code,
                    message,
                })
            }
            Err(e) => Err(e),
            Ok(_) => Err(ClientError::Protocol(
                "the router computed a request of NaNs".into(),
            )),
        }
    }

    /// Send an already encoded payload (hidden states in `dtype`, then optional f32 logits at
    /// the next 64-byte boundary) and wait for the answer.
    #[allow(clippy::too_many_arguments)]
    pub async fn send_raw(
        &mut self,
        layer: u32,
        tokens: usize,
        hidden: usize,
        dtype: ActivationDtype,
        logit_experts: usize,
        payload: &[u8],
        deadline: Option<Duration>,
    ) -> Result<Vec<f32>, ClientError> {
        let mut buf = self.take_buffer(payload.len());
        buf.copy_from_slice(payload);
        let req = raw_request(layer, tokens, hidden, dtype, logit_experts, deadline);
        let handle = self.submit_payload(req, buf, deadline).await?;
        self.wait(handle).await
    }

    /// Write raw bytes on the connection (tests of the router's handling of malformed frames).
    #[doc(hidden)]
    pub async fn write_raw(&mut self, bytes: &[u8]) -> Result<(), ClientError> {
        let until = instant_after(self.opts.default_deadline);
        self.flush_writes(until).await?;
        if self.link.write.start_write_raw(bytes.to_vec()).is_ok() {
            self.writing = Some(0);
            self.flush_writes(until).await?;
        }
        self.check_broken()
    }
}

/// A request header for [`RouterClient::submit_payload`] (which assigns the id).
fn raw_request(
    layer: u32,
    tokens: usize,
    hidden: usize,
    dtype: ActivationDtype,
    logit_experts: usize,
    deadline: Option<Duration>,
) -> LayerRequest {
    LayerRequest {
        request_id: 0,
        layer,
        tokens: tokens as u32,
        hidden: hidden as u32,
        dtype,
        logit_experts: logit_experts as u32,
        deadline_us: deadline.map_or(0, |d| wire_micros(d).max(1)),
    }
}

/// Decode the answer to request `id` (`tokens × hidden`) into `out`.
fn decode_response(
    frame: &ClientFrame,
    id: u64,
    tokens: usize,
    hidden: usize,
    out: &mut [f32],
) -> Result<(), ClientError> {
    let Body::LayerResponse(r) = frame.body() else {
        return Err(ClientError::Protocol(format!(
            "request {id} was answered with {:?}",
            frame.body()
        )));
    };
    if (r.tokens as usize, r.hidden as usize) != (tokens, hidden) {
        return Err(ClientError::Protocol(format!(
            "request {id} of {tokens} tokens x {hidden} was answered with {} x {}",
            r.tokens, r.hidden
        )));
    }
    dtype::decode_output(r.dtype, frame.payload(), out)
        .map_err(|e| ClientError::Protocol(e.to_string()))
}
