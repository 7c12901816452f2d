//! `expertmesh._native`: the Python binding of [`RouterClient`], the client a serving frontend
//! uses to call the router once per MoE layer.
//!
//! Why this exists: a Python model server (PyTorch, transformers) runs attention, norms and
//! dense layers itself and sends each MoE layer's hidden states to the fabric. This module puts
//! the Rust client behind a Python class without copying the arrays on the way (see
//! [`array`]), releases the GIL while a call is in flight (the call runs on a current-thread
//! tokio runtime owned by the client object), and turns the client's typed errors into the
//! exception hierarchy of `expertmesh/_errors.py` (one class per router error code).
//!
//! Threads: a client's methods may be called from any thread; calls on one client are
//! serialized by a gate waited for with the GIL released (so a thread waiting for the client
//! never blocks other Python threads), which still answers Ctrl-C and `close`. Signal handlers
//! run outside the client's runtime, so one may call another client, or `close` this one.
//! Pipelining on one connection is `submit` / `wait`; concurrency across threads is one client
//! per thread.

mod array;
mod bench;
mod errors;

use array::{Elem, Raw, View};
use errors::Failure;
use expertmesh_router::client::{CallHandle, HiddenStates, RouterClient as RustClient};
use expertmesh_transport::frontend::FrontendConfig;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyList, PyString, PyTuple};
use std::future::Future;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::runtime::Runtime;

/// How often a blocked call checks for Ctrl-C (KeyboardInterrupt) and other signals.
const SIGNAL_POLL: Duration = Duration::from_millis(50);

/// Ids of client objects (a handle remembers the client that made it).
static NEXT_CLIENT: AtomicU64 = AtomicU64::new(1);

/// The connection and the runtime that drives it.
struct Inner {
    rt: Runtime,
    /// `None` once closed.
    client: Option<RustClient>,
}

/// What a client object owns; its gate serializes calls from several Python threads.
struct Shared {
    /// Taken only by the thread that holds `gate`: uncontended. Dropped only in the process
    /// that made it ([`Shared`]'s `Drop`).
    inner: Mutex<std::mem::ManuallyDrop<Inner>>,
    /// The process that made the connection ([`std::process::id`]): after `fork()` the child
    /// shares its socket, its runtime's epoll instance and its request ids and nonces with
    /// the parent, so the child may neither call through it nor close it.
    pid: u32,
    /// Which thread's call has the client (see [`Gate`]).
    gate: Gate,
    /// Set by `close`: a call blocked on another thread (holding the gate) gives up.
    closing: Closing,
    /// What the getters read without waiting for another thread's call to end.
    published: Published,
}

/// The client's counts and router as of the end of the last call (or of the connect), kept
/// where the getters (`in_flight`, `ready`, `max_in_flight`, `addr`) read them without the
/// gate: a thread watching a client is not held for the length of another thread's call.
struct Published {
    in_flight: AtomicUsize,
    ready: AtomicUsize,
    max_in_flight: AtomicUsize,
    /// The router the connection is to (a failover moves it).
    peer: Mutex<SocketAddr>,
}

impl Published {
    fn of(c: &RustClient) -> Self {
        Self {
            in_flight: AtomicUsize::new(c.in_flight()),
            ready: AtomicUsize::new(c.ready()),
            max_in_flight: AtomicUsize::new(c.max_in_flight()),
            peer: Mutex::new(c.peer_addr()),
        }
    }

    fn update(&self, c: &RustClient) {
        self.in_flight.store(c.in_flight(), Ordering::Relaxed);
        self.ready.store(c.ready(), Ordering::Relaxed);
        self.max_in_flight
            .store(c.max_in_flight(), Ordering::Relaxed);
        *self.peer.lock().unwrap_or_else(|e| e.into_inner()) = c.peer_addr();
    }

    fn peer(&self) -> SocketAddr {
        *self.peer.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Serializes calls on one client across Python threads. Unlike a plain mutex, a thread
/// waiting for it checks for signals (Ctrl-C) every [`SIGNAL_POLL`] and gives up when the
/// client is closed, and a call made from a signal handler while a call of the same thread
/// has the client (it would wait for itself) is refused.
#[derive(Default)]
struct Gate {
    /// The id ([`thread_id`]) of the thread whose call has the client; 0: none.
    holder: Mutex<u64>,
    freed: std::sync::Condvar,
}

/// A number for this thread, never 0.
fn thread_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    thread_local!(static ID: u64 = NEXT.fetch_add(1, Ordering::Relaxed));
    ID.with(|id| *id)
}

impl Gate {
    fn holder(&self) -> MutexGuard<'_, u64> {
        self.holder.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Wait until the client is free and take it for this thread.
    fn enter(&self, closing: &Closing) -> Result<(), Failure> {
        let me = thread_id();
        let mut holder = self.holder();
        while *holder != 0 {
            if *holder == me {
                return Err(Failure::Reentrant);
            }
            if closing.is_set() {
                return Err(Failure::Closed);
            }
            let (h, waited) = self
                .freed
                .wait_timeout(holder, SIGNAL_POLL)
                .unwrap_or_else(|e| e.into_inner());
            holder = h;
            if waited.timed_out() && *holder != 0 {
                drop(holder);
                Python::attach(|py| py.check_signals()).map_err(Failure::Interrupted)?;
                holder = self.holder();
            }
        }
        *holder = me;
        Ok(())
    }

    /// Take the client for this thread if it is free now.
    fn try_enter(&self) -> bool {
        let mut holder = self.holder();
        if *holder != 0 {
            return false;
        }
        *holder = thread_id();
        true
    }

    fn leave(&self) {
        *self.holder() = 0;
        self.freed.notify_one();
    }
}

/// `close`'s signal to calls in progress ([`block`] watches it).
#[derive(Default)]
struct Closing {
    closed: std::sync::atomic::AtomicBool,
    notify: tokio::sync::Notify,
}

impl Closing {
    fn is_set(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }

    fn set(&self) {
        self.closed.store(true, Ordering::SeqCst);
        self.notify.notify_waiters();
    }
}

/// The client's runtime, and the close signal its blocking calls watch.
#[derive(Clone, Copy)]
struct Blocking<'a> {
    rt: &'a Runtime,
    closing: Option<&'a Closing>,
}

impl<'a> Blocking<'a> {
    /// `rt` alone (a call no `close` can reach: the connect, a bench's own client).
    fn plain(rt: &'a Runtime) -> Self {
        Self { rt, closing: None }
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, std::mem::ManuallyDrop<Inner>> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether this is a `fork()` child of the process that made the connection.
    fn forked(&self) -> bool {
        std::process::id() != self.pid
    }

    /// Drop the connection once `close` was called, unless another thread's call has the
    /// client (it drops it when it ends: see [`with_client`]). In a `fork()` child the
    /// connection is forgotten instead: dropping it would take its socket out of the epoll
    /// instance the parent shares, and the parent's calls would stall.
    fn drop_if_closing(&self) {
        if self.closing.is_set() && self.gate.try_enter() {
            let client = self.lock().client.take();
            if self.forked() {
                std::mem::forget(client);
            } else {
                drop(client);
            }
            self.gate.leave();
        }
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        if !self.forked() {
            let inner = self.inner.get_mut().unwrap_or_else(|e| e.into_inner());
            // SAFETY: dropped once, here, and never used again (`self` is being dropped).
            unsafe { std::mem::ManuallyDrop::drop(inner) };
        }
        // In a fork() child the runtime and the connection are left as they are (see
        // `drop_if_closing`): the memory is the child's copy, nothing else is touched.
    }
}

/// The hidden states of a call, borrowed from the caller's array.
#[derive(Clone, Copy)]
enum StatesRaw {
    F32(Raw<f32>),
    F16(Raw<u16>),
    Bf16(Raw<u16>),
}

impl StatesRaw {
    /// The hidden states and the logits as `submit` takes them.
    ///
    /// # Safety
    /// As [`Raw::slice`], for both.
    unsafe fn with_logits<'a>(
        self,
        logits: Option<Raw<f32>>,
    ) -> (HiddenStates<'a>, Option<&'a [f32]>) {
        // SAFETY: forwarded to the caller.
        unsafe {
            let x = match self {
                StatesRaw::F32(r) => HiddenStates::F32(r.slice()),
                StatesRaw::F16(r) => HiddenStates::F16Bits(r.slice()),
                StatesRaw::Bf16(r) => HiddenStates::Bf16Bits(r.slice()),
            };
            (x, logits.map(|r| r.slice()))
        }
    }
}

/// A checked request: everything `submit` needs, borrowed from the caller's arrays (kept alive
/// by the views).
struct Request {
    layer: u32,
    hidden: usize,
    tokens: usize,
    states: StatesRaw,
    logits: Option<Raw<f32>>,
    deadline: Option<Duration>,
    _views: (View, Option<View>),
}

/// A connection to the ExpertMesh router: one call per MoE layer.
///
/// Connects and authenticates at once. ``addr`` is ``"HOST:PORT"`` (or
/// a ``(host, port)`` tuple): the frontend address ``expertmesh up`` / ``expertmesh router``
/// prints; several routers (``"A:P,B:P"`` or a list of addresses) are tried in order and the
/// first that answers is used, and a call whose router is lost goes to the next, as
/// ``expertmesh infer --router A,B`` does (``addr`` is the router connected now). ``cluster`` is the
/// topology's ``name``, checked in the handshake. ``credentials`` is the path of this frontend's
/// credentials file (``expertmesh keys issue --frontend NAME``): the frontend authenticates
/// under its own name and every frame is encrypted. ``secret`` (``str`` or ``bytes``) is the
/// legacy shared secret (any holder can act as any frontend); ``None`` reads
/// ``EXPERTMESH_SECRET`` or the file named by ``EXPERTMESH_SECRET_FILE`` as the command-line
/// tools do (neither set: no authentication); ``""`` forces none. Give at most one of the two.
/// ``max_in_flight`` bounds the requests submitted and not yet answered (keep it at most the
/// router's per-connection limit, 32).
///
/// Inputs are borrowed, never copied: ``x`` is ``[tokens, hidden]`` C-contiguous float32,
/// float16, or bfloat16 bits as uint16 (NumPy) — or a CPU torch tensor of float32, float16 or
/// bfloat16 (through DLPack). ``logits`` (the router logits, when the frontend computed them)
/// is ``[tokens, experts]`` float32. The output is ``[tokens, hidden]`` float32, written into
/// ``out`` when given (a writable C-contiguous float32 array or tensor of that shape), else into a
/// new NumPy array. Nothing is sent when an argument is wrong: ``TypeError`` (wrong type or
/// dtype) or ``ValueError`` (shape, layout), naming the argument.
///
/// The GIL is released while a call is in flight. Router refusals raise subclasses of
/// ``expertmesh.RouterError`` (``DeviceDown``, ``DeadlineExceeded``, ``Overloaded``,
/// ``BadRequest``, ...); a failed or broken connection raises ``expertmesh.ConnectionFailed``.
/// Ctrl-C interrupts a blocked call (its request is abandoned; the connection stays usable).
#[pyclass(module = "expertmesh", name = "RouterClient", frozen)]
struct PyRouterClient {
    shared: Arc<Shared>,
    id: u64,
    cluster: String,
}

/// A request sent by :meth:`RouterClient.submit`; pass it to :meth:`RouterClient.wait` on the
/// same client (once). Dropping it without waiting abandons the request (its answer is
/// discarded when it arrives).
#[pyclass(module = "expertmesh", name = "Handle", frozen)]
struct PyHandle {
    handle: Mutex<Option<CallHandle>>,
    client: u64,
    /// The request's id on the wire (in the router's logs and errors).
    #[pyo3(get)]
    request_id: u64,
    /// The MoE layer.
    #[pyo3(get)]
    layer: u32,
    /// Tokens of the request (rows of the output).
    #[pyo3(get)]
    tokens: usize,
    /// Hidden size (columns of the output).
    #[pyo3(get)]
    hidden: usize,
}

#[pymethods]
impl PyHandle {
    /// Whether the handle was already waited.
    #[getter]
    fn waited(&self) -> bool {
        self.handle
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_none()
    }

    fn __repr__(&self) -> String {
        format!(
            "<expertmesh.Handle request {} layer {} [{}, {}]{}>",
            self.request_id,
            self.layer,
            self.tokens,
            self.hidden,
            if self.waited() { " waited" } else { "" }
        )
    }
}

#[pymethods]
impl PyRouterClient {
    #[new]
    #[pyo3(signature = (addr, cluster = "single-host", secret = None, *, credentials = None, max_in_flight = 32, connect_timeout_s = 10.0))]
    fn new(
        py: Python<'_>,
        addr: &Bound<'_, PyAny>,
        cluster: &str,
        secret: Option<&Bound<'_, PyAny>>,
        credentials: Option<std::path::PathBuf>,
        max_in_flight: usize,
        connect_timeout_s: f64,
    ) -> PyResult<Self> {
        let routers = addr_texts(addr)?.len();
        let addrs = resolve(py, addr)?;
        let cfg = match credentials {
            Some(path) if secret.is_none() => credentials_config(cluster, &path)?,
            Some(_) => {
                return Err(PyValueError::new_err(
                    "credentials and secret: give one (credentials are per frontend; the secret is the legacy shared one)",
                ));
            }
            None => frontend_config(cluster, secret)?,
        };
        if max_in_flight == 0 {
            return Err(PyValueError::new_err("max_in_flight: must be at least 1"));
        }
        let timeout = positive_seconds(connect_timeout_s, "connect_timeout_s")?;
        let rt = runtime()?;
        let client = py
            .detach(|| {
                let connect = async {
                    if routers > 1 {
                        // Several routers: the first that answers, then failover between them
                        // for the client's life (as `expertmesh infer --router A,B`).
                        let opts = expertmesh_router::client::ClientOptions {
                            connect_timeout: timeout,
                            ..Default::default()
                        };
                        RustClient::connect_any(&addrs, &cfg, opts).await
                    } else {
                        connect_any(&addrs, &cfg, timeout).await
                    }
                };
                block(Blocking::plain(&rt), connect)
            })
            .map_err(|e| e.into_pyerr(py))?;
        let mut client = client;
        client.set_max_in_flight(max_in_flight);
        Ok(Self {
            shared: Arc::new(Shared {
                published: Published::of(&client),
                inner: Mutex::new(std::mem::ManuallyDrop::new(Inner {
                    rt,
                    client: Some(client),
                })),
                pid: std::process::id(),
                gate: Gate::default(),
                closing: Closing::default(),
            }),
            id: NEXT_CLIENT.fetch_add(1, Ordering::Relaxed),
            cluster: cluster.to_owned(),
        })
    }

    /// One MoE layer call: send ``x`` ``[tokens, hidden]`` through MoE layer ``layer`` (the
    /// checkpoint's decoder layer index) and return the combined expert output ``[tokens,
    /// hidden]`` float32 — ``out`` itself when given. ``logits`` ``[tokens, experts]`` float32:
    /// the router logits, when the frontend computed them (else the router's gate computes
    /// them). ``deadline_ms``: the router gives up after this long and raises
    /// ``DeadlineExceeded`` (default: the router's, 10 s). ``out`` may be ``x`` itself (a
    /// float32 ``x`` is sent before the output is written).
    #[pyo3(signature = (layer, x, logits = None, out = None, deadline_ms = None))]
    fn moe<'py>(
        &self,
        py: Python<'py>,
        layer: &Bound<'py, PyAny>,
        x: &Bound<'py, PyAny>,
        logits: Option<&Bound<'py, PyAny>>,
        out: Option<&Bound<'py, PyAny>>,
        deadline_ms: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let req = request(layer, x, logits, deadline_ms)?;
        let (out_obj, out_view) = output(py, out, req.tokens, req.hidden)?;
        let out_raw = out_view.raw::<f32>();
        let (states, logits, deadline) = (req.states, req.logits, req.deadline);
        let (layer, hidden) = (req.layer, req.hidden);
        let shared = &*self.shared;
        py.detach(|| {
            with_client(shared, |run, client| {
                block(run, async move {
                    // `x` and `logits` are borrowed only while `submit` encodes them, before
                    // `out` is borrowed: an `out` that aliases `x` is fine.
                    let handle = {
                        // SAFETY: the views in `req` and `out_view` keep the arrays alive
                        // until the end of this call; nothing else borrows them meanwhile.
                        let (x, l) = unsafe { states.with_logits(logits) };
                        client.submit(layer, x, hidden, l, deadline).await?
                    };
                    // SAFETY: as above; the borrows of `x` and `logits` have ended.
                    let out = unsafe { out_raw.slice_mut() };
                    client.wait_into(handle, out).await
                })
            })
        })
        .map_err(|e| e.into_pyerr(py))?;
        drop(req);
        drop(out_view);
        Ok(out_obj)
    }

    /// Send one MoE layer call and return a :class:`Handle` at once, without waiting for the
    /// answer (arguments as :meth:`moe`); redeem it with :meth:`wait`. Up to ``max_in_flight``
    /// requests may be outstanding; at the limit ``submit`` first reads answers (keeping them
    /// for their handles) until one arrives. ``x`` and ``logits`` are encoded into the request
    /// before ``submit`` returns: the arrays may be reused at once.
    #[pyo3(signature = (layer, x, logits = None, deadline_ms = None))]
    fn submit(
        &self,
        py: Python<'_>,
        layer: &Bound<'_, PyAny>,
        x: &Bound<'_, PyAny>,
        logits: Option<&Bound<'_, PyAny>>,
        deadline_ms: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyHandle> {
        let req = request(layer, x, logits, deadline_ms)?;
        let (states, l, deadline) = (req.states, req.logits, req.deadline);
        let (layer, hidden) = (req.layer, req.hidden);
        let shared = &*self.shared;
        let handle = py
            .detach(|| {
                with_client(shared, |run, client| {
                    block(run, async move {
                        // SAFETY: the views in `req` keep the arrays alive during this call.
                        let (x, l) = unsafe { states.with_logits(l) };
                        client.submit(layer, x, hidden, l, deadline).await
                    })
                })
            })
            .map_err(|e| e.into_pyerr(py))?;
        drop(req);
        Ok(PyHandle {
            client: self.id,
            request_id: handle.request_id(),
            layer,
            tokens: handle.tokens(),
            hidden: handle.hidden(),
            handle: Mutex::new(Some(handle)),
        })
    }

    /// The output of the request behind ``handle`` (``[tokens, hidden]`` float32; ``out``
    /// itself when given), waiting for it if needed. Handles may be waited in any order; each
    /// once. Raises the router's refusal of that request (a :class:`RouterError`), or
    /// ``ConnectionFailed`` when the connection broke before its answer came. A wrong ``out``
    /// raises before the handle is used (it can be waited again).
    #[pyo3(signature = (handle, out = None))]
    fn wait<'py>(
        &self,
        py: Python<'py>,
        handle: &Bound<'py, PyAny>,
        out: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let h = handle.cast::<PyHandle>().map_err(|_| {
            PyTypeError::new_err(format!(
                "handle: expected a Handle returned by RouterClient.submit, got {}",
                array::type_name(handle)
            ))
        })?;
        let h = h.get();
        if h.client != self.id {
            return Err(PyValueError::new_err(format!(
                "handle: request {} was submitted on another RouterClient; wait on that one",
                h.request_id
            )));
        }
        let (out_obj, out_view) = output(py, out, h.tokens, h.hidden)?;
        let waited = || format!("handle: request {} was already waited", h.request_id);
        let slot = &h.handle;
        let take = || slot.lock().unwrap_or_else(|e| e.into_inner()).take();
        if slot.lock().unwrap_or_else(|e| e.into_inner()).is_none() {
            return Err(PyValueError::new_err(waited()));
        }
        let out_raw = out_view.raw::<f32>();
        let shared = &*self.shared;
        py.detach(|| {
            with_client(shared, |run, client| {
                // Taken once the client is this thread's: an interrupt or a refusal while
                // waiting for it leaves the handle to be waited again.
                let call = take().ok_or_else(|| {
                    Failure::Client(expertmesh_router::client::ClientError::Usage(waited()))
                })?;
                // SAFETY: `out_view` keeps `out` alive during this call; no other slice of it
                // is alive.
                block(run, client.wait_into(call, unsafe { out_raw.slice_mut() }))
            })
        })
        .map_err(|e| e.into_pyerr(py))?;
        drop(out_view);
        Ok(out_obj)
    }

    /// Ask the router whether it accepts a request of ``tokens`` x ``hidden`` for ``layer``
    /// without sending data. Returns the number of tokens it was asked about (``tokens``, or
    /// fewer for huge requests); raises the router's reason (``NotFound`` for a layer it does
    /// not serve, ``BadRequest`` for another hidden size or too many tokens).
    fn check_shape(
        &self,
        py: Python<'_>,
        layer: &Bound<'_, PyAny>,
        tokens: usize,
        hidden: usize,
    ) -> PyResult<usize> {
        let layer = layer_arg(layer)?;
        let shared = &*self.shared;
        py.detach(|| {
            with_client(shared, |run, client| {
                block(run, client.check_shape(layer, tokens, hidden))
            })
        })
        .map_err(|e| e.into_pyerr(py))
    }

    /// Close the connection (requests in flight are abandoned: a call blocked on another
    /// thread raises ``ValueError`` at once). Later calls raise ``ValueError``. Also done by
    /// ``with RouterClient(...) as c:`` and when the object is collected.
    fn close(&self, py: Python<'_>) {
        let shared = &*self.shared;
        shared.closing.set();
        // Never waits: a call that has the client (on another thread, or the one a signal
        // handler calling this interrupted) drops the connection as it ends.
        shared.gate.freed.notify_all();
        py.detach(|| shared.drop_if_closing());
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, PyTuple>) {
        self.close(py);
    }

    /// The address of the router the connection is to, ``"HOST:PORT"`` (given several, the
    /// one a failover moved it to), as of the end of the last call.
    #[getter]
    fn addr(&self) -> String {
        self.shared.published.peer().to_string()
    }

    /// The cluster name given to the handshake.
    #[getter]
    fn cluster(&self) -> &str {
        &self.cluster
    }

    /// Whether :meth:`close` was called.
    #[getter]
    fn closed(&self) -> bool {
        self.shared.closing.is_set()
    }

    /// How many requests may be submitted and unanswered at a time (settable, at least 1).
    #[getter]
    fn get_max_in_flight(&self, py: Python<'_>) -> PyResult<usize> {
        self.published(py, &self.shared.published.max_in_flight)
    }

    #[setter]
    fn set_max_in_flight(&self, py: Python<'_>, n: usize) -> PyResult<()> {
        if n == 0 {
            return Err(PyValueError::new_err("max_in_flight: must be at least 1"));
        }
        let shared = &*self.shared;
        py.detach(|| {
            with_client(shared, |_, c| {
                c.set_max_in_flight(n);
                Ok(())
            })
        })
        .map_err(|e| e.into_pyerr(py))
    }

    /// Requests submitted and not answered yet (abandoned ones included), as of the end of
    /// the last call (read without waiting for another thread's call).
    #[getter]
    fn in_flight(&self, py: Python<'_>) -> PyResult<usize> {
        self.published(py, &self.shared.published.in_flight)
    }

    /// Answers received and held for handles not waited yet, as of the end of the last call.
    #[getter]
    fn ready(&self, py: Python<'_>) -> PyResult<usize> {
        self.published(py, &self.shared.published.ready)
    }

    fn __repr__(&self) -> String {
        format!(
            "<expertmesh.RouterClient {} cluster {:?}>",
            self.shared.published.peer(),
            self.cluster
        )
    }
}

impl PyRouterClient {
    /// A count the getters read ([`Published`]): refused, as a call is, in a `fork()` child
    /// or once closed.
    fn published(&self, py: Python<'_>, count: &AtomicUsize) -> PyResult<usize> {
        let shared = &*self.shared;
        if shared.forked() {
            return Err(Failure::Forked(shared.pid).into_pyerr(py));
        }
        if shared.closing.is_set() {
            return Err(Failure::Closed.into_pyerr(py));
        }
        Ok(count.load(Ordering::Relaxed))
    }
}

/// Run `f` on the client (locked), or fail when it was closed (or is being closed).
fn with_client<T>(
    shared: &Shared,
    f: impl FnOnce(Blocking<'_>, &mut RustClient) -> Result<T, Failure>,
) -> Result<T, Failure> {
    if shared.forked() {
        return Err(Failure::Forked(shared.pid));
    }
    shared.gate.enter(&shared.closing)?;
    // Released however `f` ends (a panic included).
    let _entered = Entered(shared);
    let mut guard = shared.lock();
    let Inner { rt, client } = &mut **guard;
    let run = Blocking {
        rt,
        closing: Some(&shared.closing),
    };
    match client.as_mut() {
        Some(c) if !shared.closing.is_set() => {
            let out = f(run, c);
            shared.published.update(c);
            out
        }
        _ => Err(Failure::Closed),
    }
}

/// The gate held by this thread's call: dropping it frees the client, then drops the
/// connection if a `close` came meanwhile (it could not take the client itself).
struct Entered<'a>(&'a Shared);

impl Drop for Entered<'_> {
    fn drop(&mut self) {
        self.0.gate.leave();
        self.0.drop_if_closing();
    }
}

/// A current-thread runtime with I/O and timers (one per client: no threads of its own).
fn runtime() -> PyResult<Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| PyErr::new::<pyo3::exceptions::PyOSError, _>(e.to_string()))
}

/// Run `fut` to completion on `run`'s runtime, checking for signals (Ctrl-C) every
/// [`SIGNAL_POLL`]; a signal handler's exception drops `fut` (its request is abandoned: the
/// client is cancel-safe) and is returned. So does `close` on another thread
/// ([`Failure::Closed`]), which then takes the client.
fn block<T>(
    run: Blocking<'_>,
    fut: impl Future<Output = Result<T, expertmesh_router::client::ClientError>>,
) -> Result<T, Failure> {
    let mut fut = std::pin::pin!(fut);
    let never = tokio::sync::Notify::new();
    let mut closed = std::pin::pin!(run.closing.map_or(&never, |c| &c.notify).notified());
    // Registered before the flag is read: a `close` after this read wakes it.
    closed.as_mut().enable();
    if run.closing.is_some_and(Closing::is_set) {
        return Err(Failure::Closed);
    }
    loop {
        let step = run.rt.block_on(async {
            tokio::select! {
                biased;
                r = &mut fut => Some(r.map_err(Failure::Client)),
                () = &mut closed => Some(Err(Failure::Closed)),
                _ = tokio::time::sleep(SIGNAL_POLL) => None,
            }
        });
        if let Some(done) = step {
            return done;
        }
        // Outside the runtime: a signal handler may call another client (whose runtime
        // cannot start inside this one's).
        Python::attach(|py| py.check_signals()).map_err(Failure::Interrupted)?;
    }
}

/// Connect to the first of `addrs` (one router's addresses) that answers, within `timeout`
/// each.
async fn connect_any(
    addrs: &[SocketAddr],
    cfg: &FrontendConfig,
    timeout: Duration,
) -> Result<RustClient, expertmesh_router::client::ClientError> {
    use expertmesh_router::client::ClientError;
    use expertmesh_transport::frontend::FrontendError;
    let mut last = None;
    for &a in addrs {
        match tokio::time::timeout(timeout, RustClient::connect(a, cfg)).await {
            Ok(Ok(c)) => return Ok(c),
            Ok(Err(e)) => last = Some(e),
            Err(_) => {
                last = Some(ClientError::Transport(FrontendError::Io {
                    peer: a,
                    source: std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!("no answer within {timeout:?}"),
                    ),
                }))
            }
        }
    }
    Err(last.unwrap_or_else(|| ClientError::Input("no address to connect to".into())))
}

/// `"HOST:PORT"`, `(host, port)`, `"A:P,B:P"` or a list of addresses: every address each
/// resolves to (IPv4 first), in the order given. The names are read from Python with the GIL
/// held; the lookups (DNS, which can take seconds) run without it, so other Python threads
/// and an asyncio loop go on meanwhile.
fn resolve(py: Python<'_>, addr: &Bound<'_, PyAny>) -> PyResult<Vec<SocketAddr>> {
    let texts = addr_texts(addr)?;
    py.detach(|| resolve_texts(&texts))
        .map_err(PyValueError::new_err)
}

/// The `HOST:PORT` texts of `addr` (see [`resolve`]), at least one.
fn addr_texts(addr: &Bound<'_, PyAny>) -> PyResult<Vec<String>> {
    let texts = if let Ok(s) = addr.cast::<PyString>() {
        let text = s.extract::<String>()?;
        text.split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .map(str::to_owned)
            .collect()
    } else if let Ok(list) = addr.cast::<PyList>() {
        let mut all = Vec::new();
        for item in list.iter() {
            all.push(addr_text(&item)?);
        }
        all
    } else {
        vec![addr_text(addr)?]
    };
    if texts.is_empty() {
        return Err(PyValueError::new_err(
            "addr: the list of routers is empty; write HOST:PORT, several separated by commas",
        ));
    }
    Ok(texts)
}

/// One `"HOST:PORT"` or `(host, port)` as text.
fn addr_text(addr: &Bound<'_, PyAny>) -> PyResult<String> {
    if let Ok(s) = addr.cast::<PyString>() {
        Ok(s.extract::<String>()?.trim().to_owned())
    } else if let Ok((host, port)) = addr.extract::<(String, u16)>() {
        Ok(if host.contains(':') {
            format!("[{host}]:{port}")
        } else {
            format!("{host}:{port}")
        })
    } else {
        Err(PyTypeError::new_err(format!(
            "addr: expected \"HOST:PORT\" or a (host, port) tuple, got {}",
            array::type_name(addr)
        )))
    }
}

/// Every address the texts resolve to, IPv4 first within each, in the order given.
fn resolve_texts(texts: &[String]) -> Result<Vec<SocketAddr>, String> {
    let mut all = Vec::new();
    for text in texts {
        if let Ok(a) = text.parse::<SocketAddr>() {
            all.push(a);
            continue;
        }
        if !text.contains(':') {
            return Err(format!(
                "addr: {text:?} has no port; write HOST:PORT, e.g. 127.0.0.1:47400"
            ));
        }
        let mut addrs: Vec<SocketAddr> = text
            .to_socket_addrs()
            .map_err(|e| format!("addr: cannot resolve {text:?}: {e}"))?
            .collect();
        if addrs.is_empty() {
            return Err(format!("addr: {text:?} resolves to no address"));
        }
        addrs.sort_by_key(|a| !a.is_ipv4());
        all.extend(addrs);
    }
    Ok(all)
}

/// The handshake settings: `cluster` and the secret (given, or from the environment as the
/// command-line tools read it).
fn frontend_config(cluster: &str, secret: Option<&Bound<'_, PyAny>>) -> PyResult<FrontendConfig> {
    let mut cfg = FrontendConfig::new(cluster);
    let secret: Option<Arc<[u8]>> = match secret {
        Some(s) => {
            let bytes: Vec<u8> = if let Ok(s) = s.cast::<PyString>() {
                s.extract::<String>()?.into_bytes()
            } else if let Ok(b) = s.extract::<Vec<u8>>() {
                b
            } else {
                return Err(PyTypeError::new_err(format!(
                    "secret: expected str or bytes, got {}",
                    array::type_name(s)
                )));
            };
            (!bytes.is_empty()).then(|| Arc::from(bytes))
        }
        None => secret_from_env()?,
    };
    // The legacy shared secret: links are encrypted, but any holder can act as any frontend.
    cfg.credentials =
        secret.map(|s| Arc::new(expertmesh_transport::crypto::Credentials::shared_secret(&s)));
    Ok(cfg)
}

/// The handshake settings for a frontend with its own credentials file (issued by
/// `expertmesh keys issue --frontend NAME`): checked to be a frontend's, for `cluster`.
fn credentials_config(cluster: &str, path: &std::path::Path) -> PyResult<FrontendConfig> {
    use expertmesh_transport::crypto::Credentials;
    let creds =
        Credentials::load(path).map_err(|e| PyValueError::new_err(format!("credentials: {e}")))?;
    creds
        .check_frontend(cluster)
        .map_err(|e| PyValueError::new_err(format!("credentials {}: {e}", path.display())))?;
    let mut cfg = FrontendConfig::new(cluster);
    cfg.credentials = Some(Arc::new(creds));
    Ok(cfg)
}

/// `EXPERTMESH_SECRET`, else the trimmed contents of `EXPERTMESH_SECRET_FILE` (as
/// `expertmesh_worker::deploy::secret_from_env`).
fn secret_from_env() -> PyResult<Option<Arc<[u8]>>> {
    let secret = expertmesh_transport::crypto::legacy_secret_from_env()
        .map_err(|e| PyValueError::new_err(format!("secret: {e}")))?;
    Ok(secret.map(Arc::from))
}

/// The most seconds a timeout may say (about 31 years): past it a `Duration` or an instant
/// that far ahead cannot be formed.
const MAX_SECONDS: f64 = 1e9;

fn positive_seconds(s: f64, arg: &str) -> PyResult<Duration> {
    if !(s.is_finite() && s > 0.0 && s <= MAX_SECONDS) {
        return Err(PyValueError::new_err(format!(
            "{arg}: must be a positive number of seconds up to {MAX_SECONDS:e}, got {s}"
        )));
    }
    Ok(Duration::from_secs_f64(s))
}

/// `layer`: an `int` in `0..2**32`.
fn layer_arg(layer: &Bound<'_, PyAny>) -> PyResult<u32> {
    if layer.is_instance_of::<pyo3::types::PyBool>() {
        return Err(PyTypeError::new_err("layer: expected an int, got bool"));
    }
    let v: i64 = layer.extract().map_err(|_| {
        PyTypeError::new_err(format!(
            "layer: expected an int (the decoder layer index), got {}",
            array::type_name(layer)
        ))
    })?;
    u32::try_from(v)
        .map_err(|_| PyValueError::new_err(format!("layer: must be in 0..2**32, got {v}")))
}

/// `deadline_ms`: a positive number of milliseconds, or `None` (the router's default).
fn deadline_arg(d: Option<&Bound<'_, PyAny>>) -> PyResult<Option<Duration>> {
    let Some(d) = d.filter(|d| !d.is_none()) else {
        return Ok(None);
    };
    if d.is_instance_of::<pyo3::types::PyBool>() {
        return Err(PyTypeError::new_err(
            "deadline_ms: expected a number, got bool",
        ));
    }
    let ms: f64 = d.extract().map_err(|_| {
        PyTypeError::new_err(format!(
            "deadline_ms: expected a number of milliseconds, got {}",
            array::type_name(d)
        ))
    })?;
    if !(ms.is_finite() && ms > 0.0 && ms < 1e12) {
        return Err(PyValueError::new_err(format!(
            "deadline_ms: must be a positive number of milliseconds, got {ms}"
        )));
    }
    Ok(Some(Duration::from_secs_f64(ms / 1000.0)))
}

/// Check every argument of a call before anything is sent.
fn request(
    layer: &Bound<'_, PyAny>,
    x: &Bound<'_, PyAny>,
    logits: Option<&Bound<'_, PyAny>>,
    deadline_ms: Option<&Bound<'_, PyAny>>,
) -> PyResult<Request> {
    let layer = layer_arg(layer)?;
    let xv = array::view(x, "x")?;
    let states = match xv.elem {
        Elem::F32 => StatesRaw::F32(xv.raw()),
        Elem::F16 => StatesRaw::F16(xv.raw()),
        Elem::Bf16 | Elem::U16 => StatesRaw::Bf16(xv.raw()),
        Elem::Other => {
            return Err(PyTypeError::new_err(format!(
                "x: dtype {} is not accepted; send float32, float16, or bfloat16 bits as uint16 (x.astype(np.float32))",
                array::dtype_name(x)
            )));
        }
    };
    if xv.rows == 0 || xv.cols == 0 {
        return Err(PyValueError::new_err(format!(
            "x: has shape ({}, {}); a request carries at least one token of a non-empty hidden state",
            xv.rows, xv.cols
        )));
    }
    let lv = match logits.filter(|l| !l.is_none()) {
        None => None,
        Some(l) => {
            let lv = array::view(l, "logits")?;
            if lv.elem != Elem::F32 {
                return Err(PyTypeError::new_err(format!(
                    "logits: dtype {} is not accepted; router logits are float32",
                    array::dtype_name(l)
                )));
            }
            if lv.rows != xv.rows || lv.cols == 0 {
                return Err(PyValueError::new_err(format!(
                    "logits: shape ({}, {}) does not match x's {} tokens; expected [tokens, experts] = ({}, E)",
                    lv.rows, lv.cols, xv.rows, xv.rows
                )));
            }
            Some(lv)
        }
    };
    let deadline = deadline_arg(deadline_ms)?;
    Ok(Request {
        layer,
        hidden: xv.cols,
        tokens: xv.rows,
        states,
        logits: lv.as_ref().map(View::raw),
        deadline,
        _views: (xv, lv),
    })
}

static NUMPY_EMPTY: PyOnceLock<(Py<PyAny>, Py<PyAny>)> = PyOnceLock::new();

/// The output array: `out` checked (writable float32 `[tokens, hidden]`), or a new NumPy array.
fn output<'py>(
    py: Python<'py>,
    out: Option<&Bound<'py, PyAny>>,
    tokens: usize,
    hidden: usize,
) -> PyResult<(Bound<'py, PyAny>, View)> {
    let obj = match out.filter(|o| !o.is_none()) {
        Some(o) => o.clone(),
        None => {
            let (empty, f32) = NUMPY_EMPTY.get_or_try_init(py, || -> PyResult<_> {
                let np = py.import("numpy")?;
                Ok((
                    np.getattr("empty")?.unbind(),
                    np.getattr("float32")?.unbind(),
                ))
            })?;
            empty.bind(py).call1(((tokens, hidden), f32.bind(py)))?
        }
    };
    let v = array::view(&obj, "out")?;
    if v.elem != Elem::F32 {
        return Err(PyTypeError::new_err(format!(
            "out: dtype {} is not accepted; the output is float32",
            array::dtype_name(&obj)
        )));
    }
    if (v.rows, v.cols) != (tokens, hidden) {
        return Err(PyValueError::new_err(format!(
            "out: shape ({}, {}) does not match the output [tokens, hidden] = ({tokens}, {hidden})",
            v.rows, v.cols
        )));
    }
    if v.readonly {
        return Err(PyValueError::new_err("out: the array is read-only"));
    }
    Ok((obj, v))
}

/// The native part of the `expertmesh` package (import `expertmesh`, not this).
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // A fork() child (gunicorn --preload, multiprocessing) closes its copies of this
    // process's router connections at once: the parent's close() then ends them.
    #[cfg(unix)]
    expertmesh_transport::fork_close::close_client_sockets_in_fork_children();
    m.add_class::<PyRouterClient>()?;
    m.add_class::<PyHandle>()?;
    m.add_function(wrap_pyfunction!(bench::rust_loop, m)?)?;
    m.add(
        "DEFAULT_MAX_IN_FLIGHT",
        expertmesh_router::client::DEFAULT_MAX_IN_FLIGHT,
    )?;
    Ok(())
}
