//! The `/metrics` HTTP endpoint: a minimal, bounded responder for Prometheus scrapes.
//!
//! Why this exists: every process of the fabric (each router, each worker) exposes its
//! Prometheus series over HTTP. The only request it must answer is `GET /metrics`, so instead
//! of a web framework this is a small tokio responder on its own thread (its own
//! current-thread runtime), so a scrape never takes time from the router's or worker's I/O
//! runtime and a stuck scraper cannot hold anything the data path needs.
//!
//! Bounds: at most [`MAX_CONNECTIONS`] scrapes are served at once, a request head may be at
//! most [`MAX_HEAD_BYTES`] and must arrive within [`READ_TIMEOUT`], a response must be
//! written within [`WRITE_TIMEOUT`], and every connection is closed after one answer. With
//! every slot taken the accept loop never waits (a wait would leave a health probe queued in
//! the kernel behind whatever a client keeps opening): a newcomer takes the place of the
//! oldest connection still waiting for its request head after [`HEAD_GRACE`], else of the
//! oldest connection of the address holding the most slots when the newcomer's own address
//! holds at least two fewer, else of the oldest of all once it has been served for
//! [`EVICT_AFTER`]; otherwise the newcomer is closed at once. So neither idle connections nor scrapers that stop reading their answers
//! keep a cluster engine's probe (from another address) out, and no scrape is cut short in
//! its first second by its own address's newcomers. Anything but `GET` (or `HEAD`) of
//! `/metrics`, `/live`, `/ready` or `/` is answered 404 or 405 with a line saying what is
//! served.
//!
//! Health for cluster engines (Kubernetes probes, a Slurm script waiting for its fabric):
//! `/live` answers 200 while the process's responder runs; `/ready` answers 200 when the
//! process's [`Readiness`] check passes (a router: every worker joined, or every routed expert
//! has a live owner a while after its start; a worker: it joined every router; each then for
//! good, [`ReadyOnce`], until it drains or stops), else 503 with the reason on one line.

use prometheus_client::registry::Registry;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{Notify, Semaphore};

/// Scrapes served at once.
pub const MAX_CONNECTIONS: usize = 8;
/// Largest request head (request line and headers) read.
pub const MAX_HEAD_BYTES: usize = 8 << 10;
/// How long a client may take to send its request head.
pub const READ_TIMEOUT: Duration = Duration::from_secs(5);
/// How long writing one response may take.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a connection whose request head has arrived keeps its slot against a newcomer
/// from its own address (or one holding as many slots) when every slot is taken: an honest
/// scrape's answer is written in milliseconds.
pub const EVICT_AFTER: Duration = Duration::from_secs(1);
/// How long a new connection keeps its slot while its request head is on the way (a flood
/// of bare connections cannot end a probe before its head is read).
pub const HEAD_GRACE: Duration = Duration::from_millis(100);

/// The time limits of the responder (tests: limits no test outlasts, so what they see does
/// not depend on the machine's speed).
#[derive(Debug, Clone, Copy)]
struct Limits {
    /// How long a client may take to send its request head ([`READ_TIMEOUT`]).
    read: Duration,
    /// How long writing one response may take ([`WRITE_TIMEOUT`]).
    write: Duration,
    /// [`EVICT_AFTER`].
    evict_after: Duration,
    /// [`HEAD_GRACE`].
    head_grace: Duration,
}

impl Limits {
    const DEFAULT: Limits = Limits {
        read: READ_TIMEOUT,
        write: WRITE_TIMEOUT,
        evict_after: EVICT_AFTER,
        head_grace: HEAD_GRACE,
    };
}

/// Content type of the Prometheus text exposition format, version 0.0.4.
pub const CONTENT_TYPE: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

/// The `/ready` check: `Ok` when the process can serve, else why not (one line). Called on
/// the responder's thread for each `/ready` request, so it must be quick and never block.
pub type Readiness = Arc<dyn Fn() -> Result<(), String> + Send + Sync>;

/// A `/ready` check that passes for good once its condition held: a router once every worker
/// joined it, a worker once it joined every router. A peer lost later does not make the
/// process unready (every router shares the workers and every worker serves every router:
/// taking one out of service would only refuse what it still serves, while its peers redial
/// it); only a reason that holds now (draining, stopping) does.
#[derive(Debug, Default)]
pub struct ReadyOnce(std::sync::atomic::AtomicBool);

impl ReadyOnce {
    /// The verdict: `not_now`'s reason when given; else ready when the condition held once;
    /// else `missing` says why not (`None`: it holds now; asked only until it first does).
    pub fn verdict(
        &self,
        not_now: Option<String>,
        missing: impl FnOnce() -> Option<String>,
    ) -> Result<(), String> {
        use std::sync::atomic::Ordering;
        if let Some(why) = not_now {
            return Err(why);
        }
        if self.0.load(Ordering::Acquire) {
            return Ok(());
        }
        match missing() {
            Some(why) => Err(why),
            None => {
                self.0.store(true, Ordering::Release);
                Ok(())
            }
        }
    }
}

/// Why the endpoint could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MetricsServerError {
    /// The listen address could not be bound.
    #[error(
        "cannot serve /metrics on {addr}: {source}; pick another --metrics address (port 0 picks a free one)"
    )]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// The responder's thread or runtime could not start.
    #[error("cannot start the /metrics responder: {0}")]
    Start(std::io::Error),
}

/// A running `/metrics` endpoint. Dropping it stops the responder and closes the port.
pub struct MetricsServer {
    addr: SocketAddr,
    stop: Arc<Notify>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for MetricsServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetricsServer")
            .field("addr", &self.addr)
            .finish()
    }
}

impl MetricsServer {
    /// Bind `listen` (port 0 picks a free port) and serve `registry` on `GET /metrics` from a
    /// thread of its own until dropped.
    pub fn start(listen: SocketAddr, registry: Registry) -> Result<Self, MetricsServerError> {
        Self::start_with_readiness(listen, registry, Arc::new(|| Ok(())))
    }

    /// [`MetricsServer::start`] with a `/ready` check (without one, `/ready` is always 200).
    pub fn start_with_readiness(
        listen: SocketAddr,
        registry: Registry,
        ready: Readiness,
    ) -> Result<Self, MetricsServerError> {
        Self::start_with(listen, registry, ready, Limits::DEFAULT)
    }

    /// [`MetricsServer::start_with_readiness`] with its time limits.
    fn start_with(
        listen: SocketAddr,
        registry: Registry,
        ready: Readiness,
        limits: Limits,
    ) -> Result<Self, MetricsServerError> {
        let bind = |source| MetricsServerError::Bind {
            addr: listen,
            source,
        };
        let std_listener = std::net::TcpListener::bind(listen).map_err(bind)?;
        std_listener.set_nonblocking(true).map_err(bind)?;
        let addr = std_listener.local_addr().map_err(bind)?;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(MetricsServerError::Start)?;
        let stop = Arc::new(Notify::new());
        let stop_rx = Arc::clone(&stop);
        let registry = Arc::new(Endpoints {
            registry,
            ready,
            limits,
        });
        let thread = std::thread::Builder::new()
            .name("metrics-http".into())
            .spawn(move || {
                rt.block_on(async move {
                    let listener = match tokio::net::TcpListener::from_std(std_listener) {
                        Ok(l) => l,
                        Err(e) => {
                            tracing::warn!(error = %e, "the /metrics responder could not start");
                            return;
                        }
                    };
                    tokio::select! {
                        () = stop_rx.notified() => {}
                        () = accept_loop(listener, registry) => {}
                    }
                });
            })
            .map_err(MetricsServerError::Start)?;
        Ok(Self {
            addr,
            stop,
            thread: Some(thread),
        })
    }

    /// The address it listens on (with the port chosen when 0 was asked for).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The scrape URL, `http://ADDR/metrics`.
    pub fn url(&self) -> String {
        format!("http://{}/metrics", self.addr)
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.stop.notify_one();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A connection being served: its task, its client's address, whether its request head has
/// arrived, and since when it has been served.
struct Served {
    task: tokio::task::AbortHandle,
    peer: std::net::IpAddr,
    head_read: Arc<std::sync::atomic::AtomicBool>,
    since: tokio::time::Instant,
}

/// What the eviction policy sees of a served connection.
#[derive(Debug, Clone, Copy)]
struct SlotView {
    peer: std::net::IpAddr,
    head_read: bool,
    age: Duration,
}

/// Which served connection (index, oldest first) gives its slot to a newcomer from `peer`
/// when every slot is taken, or `None` when the newcomer is to be closed (the policy of the
/// module's docs: never wait, and never let one address keep another out).
fn give_way(served: &[SlotView], peer: std::net::IpAddr, limits: &Limits) -> Option<usize> {
    if let Some(i) = served
        .iter()
        .position(|c| !c.head_read && c.age >= limits.head_grace)
    {
        return Some(i);
    }
    let held = |ip| served.iter().filter(|c| c.peer == ip).count();
    // The address holding the most slots (ties: the one whose oldest connection is oldest).
    let mut most: Option<(std::net::IpAddr, usize)> = None;
    for c in served {
        let n = held(c.peer);
        if most.is_none_or(|(_, m)| n > m) {
            most = Some((c.peer, n));
        }
    }
    // Only a move that makes the shares more even: an address one slot short of the most
    // would only swap places with it (and newcomers of many addresses would churn).
    if let Some((ip, n)) = most
        && held(peer) + 1 < n
    {
        return served.iter().position(|c| c.peer == ip);
    }
    served
        .first()
        .and_then(|c| (c.age >= limits.evict_after).then_some(0))
}

/// Accept scrapes forever, at most [`MAX_CONNECTIONS`] at once; with every slot taken, a
/// newcomer takes a slot [`give_way`] frees, or is closed at once.
async fn accept_loop(listener: tokio::net::TcpListener, registry: Arc<Endpoints>) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let mut served: std::collections::VecDeque<Served> = std::collections::VecDeque::new();
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok((s, a)) => (s, a.ip()),
            Err(e) => {
                tracing::debug!(error = %e, "accepting a /metrics connection failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Some(permit) = make_room(&slots, &mut served, peer, &registry.limits).await else {
            drop(stream); // every slot is its own address's or too young to give way
            continue;
        };
        let registry = Arc::clone(&registry);
        let head_read = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = Arc::clone(&head_read);
        let task = tokio::spawn(async move {
            serve_one(stream, &registry, &flag).await;
            drop(permit);
        });
        served.push_back(Served {
            task: task.abort_handle(),
            peer,
            head_read,
            since: tokio::time::Instant::now(),
        });
    }
}

/// A slot for a newcomer from `peer`: a free one, else the one [`give_way`] picks (that
/// connection is ended). `None` when none is to be had now.
async fn make_room(
    slots: &Arc<Semaphore>,
    served: &mut std::collections::VecDeque<Served>,
    peer: std::net::IpAddr,
    limits: &Limits,
) -> Option<tokio::sync::OwnedSemaphorePermit> {
    served.retain(|c| !c.task.is_finished());
    if let Ok(permit) = Arc::clone(slots).try_acquire_owned() {
        return Some(permit);
    }
    let views: Vec<SlotView> = served
        .iter()
        .map(|c| SlotView {
            peer: c.peer,
            head_read: c.head_read.load(std::sync::atomic::Ordering::Acquire),
            age: c.since.elapsed(),
        })
        .collect();
    let c = give_way(&views, peer, limits).and_then(|i| served.remove(i))?;
    c.task.abort();
    // Its permit comes back as its task is dropped, which the next poll of this runtime does.
    Arc::clone(slots).acquire_owned().await.ok()
}

/// Read one request head (`head_read` set once it has arrived) and answer it; the connection
/// closes afterwards.
async fn serve_one(
    mut stream: tokio::net::TcpStream,
    registry: &Endpoints,
    head_read: &std::sync::atomic::AtomicBool,
) {
    let head = match tokio::time::timeout(registry.limits.read, read_head(&mut stream)).await {
        Ok(Some(h)) => h,
        _ => return,
    };
    head_read.store(true, std::sync::atomic::Ordering::Release);
    let (status, body) = answer(&head, registry);
    let head_only = head.starts_with(b"HEAD ");
    let content_type = if status == 200 && body_is_metrics(&head) {
        CONTENT_TYPE
    } else {
        "text/plain; charset=utf-8"
    };
    let mut out = format!(
        "HTTP/1.1 {status} {}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        reason(status),
        body.len()
    )
    .into_bytes();
    if !head_only {
        out.extend_from_slice(body.as_bytes());
    }
    let write = async {
        stream.write_all(&out).await?;
        stream.shutdown().await
    };
    let written = tokio::time::timeout(registry.limits.write, write).await;
    if matches!(written, Ok(Ok(()))) && announces_body(&head) {
        linger(&mut stream, registry.limits.read).await;
    }
}

/// Reads and drops what the client sent after its head (a body) until it closes, for at most
/// `limit` and [`MAX_DRAINED_BYTES`]: a socket closed with unread bytes is reset, and a reset
/// that overtakes the answer on the way can discard it before the client reads it (a
/// lingering close). Only after a request that announced a body: every probe and scrape
/// closes at once.
async fn linger(stream: &mut tokio::net::TcpStream, limit: Duration) {
    let drain = async {
        let mut chunk = [0u8; 4096];
        let mut left = MAX_DRAINED_BYTES;
        while left > 0 {
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => break,
                Ok(n) => left = left.saturating_sub(n),
            }
        }
    };
    let _ = tokio::time::timeout(limit, drain).await;
}

/// Most bytes read and dropped after an answer (a request body) before the connection closes.
const MAX_DRAINED_BYTES: usize = 64 << 10;

/// Whether a request head says a body follows (`Content-Length` other than 0, or
/// `Transfer-Encoding`).
fn announces_body(head: &[u8]) -> bool {
    let text = String::from_utf8_lossy(head).to_ascii_lowercase();
    text.lines().skip(1).any(|l| {
        let (name, value) = l.split_once(':').unwrap_or((l, ""));
        match name.trim() {
            "content-length" => value.trim() != "0",
            "transfer-encoding" => true,
            _ => false,
        }
    })
}

/// The request head (up to the blank line), or `None` when the client closed first or sent
/// more than [`MAX_HEAD_BYTES`] without ending it.
async fn read_head(stream: &mut tokio::net::TcpStream) -> Option<Vec<u8>> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    loop {
        let n = stream.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
        if buf.windows(4).any(|w| w == b"\r\n\r\n") || buf.windows(2).any(|w| w == b"\n\n") {
            return Some(buf);
        }
        if buf.len() > MAX_HEAD_BYTES {
            return None;
        }
    }
}

/// The request's method and path.
fn request_line(head: &[u8]) -> (&str, &str) {
    let line = head.split(|&b| b == b'\n').next().unwrap_or_default();
    let line = std::str::from_utf8(line).unwrap_or_default();
    let mut parts = line.split_whitespace();
    let method = parts.next().unwrap_or_default();
    let target = parts.next().unwrap_or_default();
    (method, target.split('?').next().unwrap_or_default())
}

fn body_is_metrics(head: &[u8]) -> bool {
    request_line(head).1 == "/metrics"
}

/// What the responder serves: the metrics and the readiness check.
struct Endpoints {
    registry: Registry,
    ready: Readiness,
    /// The time limits.
    limits: Limits,
}

/// Status and body for a request head.
fn answer(head: &[u8], endpoints: &Endpoints) -> (u16, String) {
    let (method, path) = request_line(head);
    if method != "GET" && method != "HEAD" {
        return (
            405,
            "only GET of /metrics, /live and /ready is served here\n".into(),
        );
    }
    match path {
        "/live" => (200, "alive\n".into()),
        "/ready" => match (endpoints.ready)() {
            Ok(()) => (200, "ready\n".into()),
            Err(why) => (503, format!("not ready: {why}\n")),
        },
        "/metrics" => {
            let mut text = String::with_capacity(64 << 10);
            match prometheus_client::encoding::prometheus_text::encode(
                &mut text,
                &endpoints.registry,
            ) {
                Ok(()) => (200, text),
                Err(_) => (500, "encoding the metrics failed\n".into()),
            }
        }
        "/" => (
            200,
            "expertmesh: Prometheus metrics at /metrics, liveness at /live, readiness at /ready\n"
                .to_owned(),
        ),
        _ => (
            404,
            format!("no {path} here; metrics are at /metrics, health at /live and /ready\n"),
        ),
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        404 => "Not Found",
        405 => "Method Not Allowed",
        503 => "Service Unavailable",
        _ => "Internal Server Error",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::metrics::counter::Counter;
    use std::io::{Read, Write};

    /// A server of `registry` whose head and write time limits, and whose age for eviction,
    /// no test outlasts (an hour), and whose connections waiting for their head give way at
    /// once: what a test sees of its slots comes from the eviction policy alone, whatever the
    /// machine's speed.
    fn patient_server(registry: Registry) -> MetricsServer {
        let hour = Duration::from_secs(3600);
        let limits = Limits {
            read: hour,
            write: hour,
            evict_after: hour,
            head_grace: Duration::ZERO,
        };
        MetricsServer::start_with(
            "127.0.0.1:0".parse().unwrap(),
            registry,
            Arc::new(|| Ok(())),
            limits,
        )
        .unwrap()
    }

    /// A connection to `addr` from the loopback address `from` (127.0.0.0/8: every one of
    /// them is this machine's on Linux).
    fn connect_from(from: [u8; 4], addr: SocketAddr) -> std::net::TcpStream {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let s = rt.block_on(async {
            let socket = tokio::net::TcpSocket::new_v4().unwrap();
            socket.bind(SocketAddr::from((from, 0))).unwrap();
            socket.connect(addr).await.unwrap()
        });
        let s = s.into_std().unwrap();
        s.set_nonblocking(false).unwrap();
        s
    }

    #[test]
    fn a_newcomer_takes_the_slot_of_an_idle_connection_or_of_the_address_holding_most() {
        let ip = |d: u8| std::net::IpAddr::from([10, 0, 0, d]);
        let ms = Duration::from_millis;
        let slot = |d, head_read, age| SlotView {
            peer: ip(d),
            head_read,
            age: ms(age),
        };
        let limits = Limits::DEFAULT;
        // Waiting for its head past the grace: it goes first, whoever comes.
        let served = [slot(1, true, 900), slot(1, false, 150), slot(2, false, 300)];
        assert_eq!(give_way(&served, ip(1), &limits), Some(1));
        // Within the grace a head on its way is left alone: address 1 holds the most slots
        // (three), so a newcomer from address 3 (none) or 2 (one) takes address 1's oldest...
        let served = [
            slot(2, true, 20),
            slot(1, true, 10),
            slot(1, true, 5),
            slot(1, false, 1),
        ];
        assert_eq!(give_way(&served, ip(3), &limits), Some(1));
        assert_eq!(give_way(&served, ip(2), &limits), Some(1));
        // ... and one from address 1 itself waits for no one: closed, until the oldest has
        // been served for EVICT_AFTER.
        assert_eq!(give_way(&served, ip(1), &limits), None);
        let served = [slot(2, true, 1_000), slot(1, true, 10), slot(1, true, 5)];
        assert_eq!(give_way(&served, ip(1), &limits), Some(0));
        // Even shares, or one short of the most: no address takes another's place before
        // EVICT_AFTER (it would only swap places).
        let served = [slot(1, true, 500), slot(2, true, 400)];
        assert_eq!(give_way(&served, ip(1), &limits), None);
        assert_eq!(
            give_way(&served, ip(3), &limits),
            None,
            "3 would hold what 1 held"
        );
        let served = [slot(1, true, 500), slot(1, true, 400), slot(2, true, 300)];
        assert_eq!(
            give_way(&served, ip(3), &limits),
            Some(0),
            "two short of 1's two"
        );
        assert_eq!(give_way(&served, ip(2), &limits), None, "one short");
    }

    /// One request's answer. The read waits up to a minute: a cap for a test that would
    /// otherwise hang, far above what an answer takes on a loaded machine.
    fn get(addr: SocketAddr, request: &str) -> String {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        s.write_all(request.as_bytes()).unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    }

    #[test]
    fn serves_the_registry_and_refuses_the_rest() {
        let mut registry = Registry::default();
        let c: Counter = Counter::default();
        registry.register("expertmesh_test_things", "Things seen", c.clone());
        c.inc_by(7);
        let server = MetricsServer::start("127.0.0.1:0".parse().unwrap(), registry).unwrap();
        let addr = server.local_addr();
        assert_ne!(addr.port(), 0);
        let ok = get(addr, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
        assert!(ok.starts_with("HTTP/1.1 200 OK\r\n"), "{ok}");
        assert!(ok.contains("version=0.0.4"), "{ok}");
        assert!(ok.contains("\nexpertmesh_test_things_total 7\n"), "{ok}");
        let missing = get(addr, "GET /nope HTTP/1.1\r\n\r\n");
        assert!(missing.starts_with("HTTP/1.1 404"), "{missing}");
        let post = get(addr, "POST /metrics HTTP/1.1\r\n\r\n");
        assert!(post.starts_with("HTTP/1.1 405"), "{post}");
        assert!(!announces_body(b"GET /ready HTTP/1.1\r\nHost: x\r\n\r\n"));
        assert!(!announces_body(
            b"POST / HTTP/1.1\r\nContent-Length: 0\r\n\r\n"
        ));
        assert!(announces_body(
            b"POST / HTTP/1.1\r\ncontent-length: 5\r\n\r\n"
        ));
        assert!(announces_body(
            b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
        ));
        // With a body (never read as a request): answered, not reset before it is read.
        let body = "x".repeat(32 << 10);
        let post = get(
            addr,
            &format!(
                "POST /metrics HTTP/1.1\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            ),
        );
        assert!(post.starts_with("HTTP/1.1 405"), "{post}");
        // A client that never finishes its head does not block the next scrape, nor do as
        // many as there are slots: the oldest idle one makes room (its connection is closed).
        // On a server whose head time limit no test outlasts: slots free by eviction alone.
        drop(server);
        let mut registry = Registry::default();
        registry.register("expertmesh_test_things", "Things seen", c.clone());
        let server = patient_server(registry);
        let addr = server.local_addr();
        let idle: Vec<_> = (0..MAX_CONNECTIONS + 2)
            .map(|_| std::net::TcpStream::connect(addr).unwrap())
            .collect();
        let again = get(addr, "GET /metrics HTTP/1.0\r\n\r\n");
        assert!(again.contains("expertmesh_test_things_total 7"), "{again}");
        // The three oldest made room (for the two idle ones after them and the scrape); the
        // rest are still open (before, the scrape would have waited for the head time limit).
        let open = |mut c: &std::net::TcpStream| {
            c.set_nonblocking(true).unwrap();
            let mut byte = [0u8; 1];
            matches!(c.read(&mut byte), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
        };
        let states: Vec<bool> = idle.iter().map(open).collect();
        assert_eq!(states[..3], [false; 3], "{states:?}");
        assert!(states[3..].iter().all(|&o| o), "{states:?}");
        drop(server);
        assert!(std::net::TcpStream::connect(addr).is_err());
    }

    /// Scrapers from one address that stop reading a large answer take every slot; a health
    /// probe from another address is still answered (the oldest of them gives way), not held
    /// until their writes time out or they age, and the address's own newcomers are closed at
    /// once rather than left queued in front of the probe. Here the time limits and the age
    /// for eviction are an hour, so only that policy can answer the probe.
    #[test]
    fn scrapers_that_stop_reading_do_not_keep_a_health_probe_out() {
        use prometheus_client::encoding::EncodeLabelSet;
        use prometheus_client::metrics::family::Family;
        use std::os::fd::AsRawFd;
        #[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
        struct Labels {
            series: u32,
        }
        // About 12 MB of text: far more than a socket's buffers hold.
        let family: Family<Labels, Counter> = Family::default();
        for series in 0..200_000 {
            family.get_or_create(&Labels { series }).inc();
        }
        let mut registry = Registry::default();
        registry.register("expertmesh_test_many_series", "Many series", family);
        let server = patient_server(registry);
        let addr = server.local_addr();
        let stalled: Vec<std::net::TcpStream> = (0..MAX_CONNECTIONS)
            .map(|_| {
                let mut s = std::net::TcpStream::connect(addr).unwrap();
                let small: libc::c_int = 4096;
                // SAFETY: setsockopt on an open socket with a valid c_int option value.
                unsafe {
                    libc::setsockopt(
                        s.as_raw_fd(),
                        libc::SOL_SOCKET,
                        libc::SO_RCVBUF,
                        (&small as *const libc::c_int).cast(),
                        std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                    )
                };
                s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
                s.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
                // The answer has begun (its head was read): then this scraper stops reading.
                let mut start = [0u8; 12];
                s.read_exact(&mut start).unwrap();
                assert_eq!(&start, b"HTTP/1.1 200");
                s
            })
            .collect();
        // One more from the scrapers' address: closed at once (a guard of a minute).
        let mut more = std::net::TcpStream::connect(addr).unwrap();
        more.set_read_timeout(Some(Duration::from_secs(60)))
            .unwrap();
        more.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
        let mut got = Vec::new();
        match more.read_to_end(&mut got) {
            Ok(_) => assert!(got.is_empty(), "{}", String::from_utf8_lossy(&got)),
            Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "{e}"),
        }
        // A probe from another address: answered.
        let mut probe = connect_from([127, 0, 0, 2], addr);
        probe
            .set_read_timeout(Some(Duration::from_secs(60)))
            .unwrap();
        probe.write_all(b"GET /live HTTP/1.0\r\n\r\n").unwrap();
        let mut live = String::new();
        probe.read_to_string(&mut live).unwrap();
        assert!(live.starts_with("HTTP/1.1 200 OK\r\n"), "{live}");
        drop(stalled);
    }

    /// Not ready until the condition held; from then on ready whoever is lost later; never
    /// while draining or stopping.
    #[test]
    fn ready_once_the_condition_held_until_a_reason_now() {
        let r = ReadyOnce::default();
        let missing = || Some("1 of 2 workers not joined: node0/cpu1".to_string());
        assert_eq!(
            r.verdict(None, missing),
            Err("1 of 2 workers not joined: node0/cpu1".into())
        );
        assert_eq!(r.verdict(None, || None), Ok(()));
        // A peer lost later (drained and stopped, crashed, restarting).
        assert_eq!(r.verdict(None, missing), Ok(()));
        let draining = r.verdict(Some("draining".into()), || None).unwrap_err();
        assert_eq!(draining, "draining");
        let before = ReadyOnce::default().verdict(Some("stopping".into()), || None);
        assert_eq!(before, Err("stopping".into()));
    }

    #[test]
    fn live_and_ready_follow_the_check() {
        let ready = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = Arc::clone(&ready);
        let server = MetricsServer::start_with_readiness(
            "127.0.0.1:0".parse().unwrap(),
            Registry::default(),
            Arc::new(move || {
                if flag.load(std::sync::atomic::Ordering::SeqCst) {
                    Ok(())
                } else {
                    Err("waiting for workers a/0, a/1".into())
                }
            }),
        )
        .unwrap();
        let addr = server.local_addr();
        let live = get(addr, "GET /live HTTP/1.0\r\n\r\n");
        assert!(live.starts_with("HTTP/1.1 200 OK\r\n"), "{live}");
        let not = get(addr, "GET /ready HTTP/1.0\r\n\r\n");
        assert!(not.starts_with("HTTP/1.1 503 "), "{not}");
        assert!(
            not.ends_with("not ready: waiting for workers a/0, a/1\n"),
            "{not}"
        );
        ready.store(true, std::sync::atomic::Ordering::SeqCst);
        let yes = get(addr, "GET /ready?verbose HTTP/1.0\r\n\r\n");
        assert!(yes.starts_with("HTTP/1.1 200 OK\r\n"), "{yes}");
        // Without a check, /ready is always 200.
        let plain =
            MetricsServer::start("127.0.0.1:0".parse().unwrap(), Registry::default()).unwrap();
        let r = get(plain.local_addr(), "GET /ready HTTP/1.0\r\n\r\n");
        assert!(r.starts_with("HTTP/1.1 200 OK\r\n"), "{r}");
    }

    #[test]
    fn a_busy_port_is_a_clear_error() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = taken.local_addr().unwrap();
        let e = MetricsServer::start(addr, Registry::default()).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains(&addr.to_string()) && msg.contains("--metrics"),
            "{msg}"
        );
    }
}
