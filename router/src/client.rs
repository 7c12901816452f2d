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
//!   logged and otherwise ignored.
//! * **Dropped handles.** Dropping a [`CallHandle`] without waiting abandons its request: the
//!   router still computes it and it keeps its in-flight slot until its answer arrives, which is
//!   then discarded (an answer that had already arrived is freed at the client's next call).
//!   Nothing is kept for a dropped handle.
//! * **Cancellation.** Every method is cancel-safe: dropping its future (a timeout, a
//!   `select!`) never leaves the connection unusable. A frame read or write that was under way
//!   is finished by the next call on the client, so the stream stays framed and nothing is
//!   lost. Dropping a `wait` or `wait_into` future drops the handle it was given: the request is
//!   abandoned as above. Dropping a `submit` (or `call`) future abandons its request, which may
//!   or may not have been sent. (Client-side timeouts are thus fine but lose the answer; the
//!   `deadline` argument makes the router itself give up and answer with
//!   [`ErrorCode::DeadlineExceeded`].)
//! * **Progress.** There is no background task: the connection is read only while a `submit`,
//!   `wait` or `call` of this client is awaited. Answers that arrive in between wait in the
//!   socket (the router's per-connection limit bounds them).

mod encode;
mod link;
mod pending;
#[cfg(test)]
mod tests;

pub use encode::HiddenStates;

use encode::Layout;
use expertmesh_transport::codec::{Body, ErrorCode, LayerRequest};
use expertmesh_transport::dtype::{self, ActivationDtype};
use expertmesh_transport::frontend::{ClientFrame, FrameConnection, FrontendConfig, FrontendError};
use link::{Finished, Link};
use pending::{Delivery, Pending, Take};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Largest payload of a [`RouterClient::check_shape`] probe: it asks about at most this many
/// bytes of fp8 activations, so the router decodes a few MiB at most.
pub const SHAPE_PROBE_BYTES: usize = 8 << 20;

/// Default of [`RouterClient::max_in_flight`]: the router's default
/// `max_outstanding_per_client`.
pub const DEFAULT_MAX_IN_FLIGHT: usize = 32;

/// The client keeps one request buffer for reuse, up to this size (a larger one is freed after
/// its request is sent).
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

/// A connection to the router service, with up to [`RouterClient::max_in_flight`] requests in
/// flight (see the [module docs](self) for pipelining, errors and cancellation). Open several
/// clients for concurrency across tasks: the methods take `&mut self`.
pub struct RouterClient {
    link: Link,
    pending: Pending<Answer>,
    abandoned: Abandoned,
    /// The error that broke the connection; every later call returns it.
    broken: Option<ClientError>,
    max_in_flight: usize,
    next_id: u64,
    /// A request buffer kept for reuse.
    spare: Vec<u8>,
}

impl std::fmt::Debug for RouterClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RouterClient")
            .field("link", &self.link)
            .field("in_flight", &self.pending.in_flight())
            .field("ready", &self.pending.held())
            .field("max_in_flight", &self.max_in_flight)
            .field("broken", &self.broken)
            .finish()
    }
}

impl RouterClient {
    /// Connect (and authenticate, when `cfg` carries a secret).
    pub async fn connect(addr: SocketAddr, cfg: &FrontendConfig) -> Result<Self, ClientError> {
        Ok(Self {
            link: Link::new(FrameConnection::connect(addr, cfg).await?),
            pending: Pending::default(),
            abandoned: Abandoned::default(),
            broken: None,
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
            next_id: 1,
            spare: Vec::new(),
        })
    }

    /// The router's address.
    pub fn peer_addr(&self) -> SocketAddr {
        self.link.peer()
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
    /// `[tokens][experts]` when the frontend computed them, and the router-side `deadline`
    /// (`None`: the router's default). Redeem the handle with [`RouterClient::wait`] or
    /// [`RouterClient::wait_into`].
    ///
    /// Returns once the request is written to the connection. With
    /// [`RouterClient::max_in_flight`] requests unanswered, it first reads answers (keeping
    /// them for their handles) until one arrives. Errors: [`ClientError::Input`] for input that
    /// cannot be encoded (nothing is sent), or the connection's error when it is broken.
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
        let mut buf = self.take_buffer(layout.total);
        if let Err(e) = encode::write_payload(&x, logits, &layout, &mut buf) {
            self.recycle(buf);
            return Err(e);
        }
        let (t, d, e) = (layout.tokens, layout.dtype, layout.logit_experts);
        let req = raw_request(layer, t, hidden, d, e, deadline);
        self.submit_payload(req, buf).await
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
        let t = tokens.min((SHAPE_PROBE_BYTES / hidden.max(1)).max(1));
        let dtype = ActivationDtype::Fp8E4m3;
        let bytes = dtype.payload_bytes(t, hidden).ok_or_else(|| {
            ClientError::Input(format!("{t} x {hidden} cannot be sent as {}", dtype.name()))
        })?;
        let mut payload = self.take_buffer(bytes as usize);
        payload.fill(0xff); // fp8 NaN codes, NaN scales
        let req = raw_request(layer, t, hidden, dtype, 0, None);
        let answer = match self.submit_payload(req, payload).await {
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
        let handle = self.submit_payload(req, buf).await?;
        self.wait(handle).await
    }

    /// Write raw bytes on the connection (tests of the router's handling of malformed frames).
    #[doc(hidden)]
    pub async fn write_raw(&mut self, bytes: &[u8]) -> Result<(), ClientError> {
        self.make_idle().await?;
        if self.link.start_write_raw(bytes.to_vec()).is_ok()
            && let Some(f) = self.link.finish().await
        {
            self.absorb(f);
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
        deadline_us: deadline.map_or(0, |d| d.as_micros().max(1) as u64),
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

// The connection driver: one frame read or written at a time, answers routed to `Pending`.
impl RouterClient {
    /// Send `req` (its id assigned here) with `payload`, once a slot is free; see
    /// [`RouterClient::submit`].
    async fn submit_payload(
        &mut self,
        mut req: LayerRequest,
        payload: Vec<u8>,
    ) -> Result<CallHandle, ClientError> {
        if let Err(e) = self.make_room().await {
            self.recycle(payload);
            return Err(e);
        }
        let id = self.next_id;
        self.next_id += 1;
        req.request_id = id;
        let inserted = self.pending.insert(id);
        debug_assert!(inserted, "request ids are never reused");
        // From here the handle owns the request: if this future is dropped, dropping the
        // handle abandons it, and the write under way is finished by the next call.
        let mut handle = CallHandle {
            request_id: id,
            tokens: req.tokens as usize,
            hidden: req.hidden as usize,
            owner: Some(self.abandoned.clone()),
        };
        if let Err(buf) = self.link.start_write(Body::LayerRequest(req), payload) {
            // Unreachable: the link is idle after make_room.
            self.recycle(buf);
            self.break_with(ClientError::Protocol("the connection was busy".into()));
        }
        if let Some(f) = self.link.finish().await {
            self.absorb(f);
        }
        match self.pending.take(id) {
            Take::InFlight => Ok(handle),
            // Only a failed write answers it this early (a frame too large to encode, or the
            // connection broke).
            Take::Ready(answer) => {
                handle.redeem();
                Err(answer.err().unwrap_or_else(|| {
                    ClientError::Protocol(format!("request {id} was answered before it was sent"))
                }))
            }
            Take::Unknown => Err(ClientError::Protocol(format!("request {id} was lost"))),
        }
    }

    /// Wait until the link is idle and fewer than `max_in_flight` requests are in flight.
    async fn make_room(&mut self) -> Result<(), ClientError> {
        self.make_idle().await?;
        while self.pending.in_flight() >= self.max_in_flight {
            self.progress().await;
            self.check_broken()?;
        }
        Ok(())
    }

    /// Finish an operation a cancelled call left under way.
    async fn make_idle(&mut self) -> Result<(), ClientError> {
        self.collect_abandoned();
        if let Some(f) = self.link.finish().await {
            self.absorb(f);
        }
        self.check_broken()
    }

    /// The answer for `handle`, reading frames until it arrives.
    async fn wait_answer(&mut self, mut handle: CallHandle) -> Answer {
        if !handle.belongs_to(&self.abandoned) {
            return Err(ClientError::Usage(format!(
                "request {} was submitted on another RouterClient; wait on that one",
                handle.request_id
            )));
        }
        let id = handle.request_id;
        loop {
            self.collect_abandoned();
            match self.pending.take(id) {
                Take::Ready(answer) => {
                    handle.redeem();
                    return answer;
                }
                Take::InFlight => {}
                Take::Unknown => {
                    handle.redeem();
                    let m = format!("request {id} is not known on this connection");
                    return Err(ClientError::Protocol(m));
                }
            }
            // A broken connection has answered every request in flight.
            self.check_broken()?;
            self.progress().await;
        }
    }

    /// One step: finish the operation under way, or read one frame.
    async fn progress(&mut self) {
        if !self.link.is_busy() && !self.link.start_read() {
            return; // closed: `broken` says why
        }
        if let Some(f) = self.link.finish().await {
            self.absorb(f);
        }
    }

    /// Account for a finished operation.
    fn absorb(&mut self, finished: Finished) {
        match finished {
            Finished::Wrote { buf, result } => {
                self.recycle(buf);
                if let Err(e) = result {
                    self.fail_one_or_all(e);
                }
            }
            Finished::Read(Ok(frame)) => self.route(frame),
            Finished::Read(Err(e)) => self.fail_one_or_all(e),
        }
    }

    /// A frame from the router: the answer to one request, or a sign the connection is broken.
    fn route(&mut self, frame: ClientFrame) {
        let (id, refusal) = match frame.body() {
            Body::LayerResponse(r) => (r.request_id, None),
            Body::Error(e) if e.request_id != 0 => (
                e.request_id,
                Some(ClientError::Server {
                    request_id: e.request_id,
                    code: e.code,
                    message: e.message.clone(),
                }),
            ),
            Body::Error(e) => {
                tracing::warn!(peer = %self.link.peer(), code = ?e.code, message = %e.message,
                    "the router reported an error that names no request");
                return;
            }
            other => {
                let m = format!("unexpected frame from the router: {other:?}");
                self.break_with(ClientError::Protocol(m));
                return;
            }
        };
        self.deliver(id, refusal.map_or(Ok(frame), Err));
    }

    fn deliver(&mut self, id: u64, answer: Answer) {
        if self.pending.answer(id, answer) == Delivery::Unknown {
            tracing::debug!(request_id = id, "ignored an answer to no request in flight");
        }
    }

    /// A failed read or write: when the stream is still framed and the error names a request
    /// (a frame that could not be encoded or decoded), only that request fails; otherwise the
    /// connection is broken.
    fn fail_one_or_all(&mut self, e: FrontendError) {
        match recoverable_request(&e) {
            Some(id) => self.deliver(id, Err(ClientError::Transport(e))),
            None => self.break_with(ClientError::Transport(e)),
        }
    }

    /// The connection is unusable: close it and fail every request in flight with `e`.
    fn break_with(&mut self, e: ClientError) {
        if self.broken.is_some() {
            return;
        }
        let peer = self.link.peer();
        let failed = self.pending.fail_all(|_| Err(e.duplicate(peer)));
        tracing::debug!(%peer, failed, error = %e, "router connection broken");
        self.link.close();
        self.broken = Some(e);
    }

    fn check_broken(&self) -> Result<(), ClientError> {
        match &self.broken {
            Some(e) => Err(e.duplicate(self.link.peer())),
            None => Ok(()),
        }
    }

    /// Forget the requests of dropped handles.
    fn collect_abandoned(&mut self) {
        let mut ids = lock(&self.abandoned);
        for id in ids.drain(..) {
            self.pending.abandon(id);
        }
    }

    /// A zeroed buffer of `len` bytes (the kept one when there is one).
    fn take_buffer(&mut self, len: usize) -> Vec<u8> {
        let mut b = std::mem::take(&mut self.spare);
        b.clear();
        b.resize(len, 0);
        b
    }

    fn recycle(&mut self, buf: Vec<u8>) {
        if buf.capacity() <= RETAIN_BUFFER_BYTES && buf.capacity() > self.spare.capacity() {
            self.spare = buf;
        }
    }
}
