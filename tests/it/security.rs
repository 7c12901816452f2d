//! Attack tests (issue 15 item 5): what an adversary on the same network can do to a running
//! fabric, replayed against real `expertmesh up` processes over real sockets.
//!
//! Why this exists: the fabric was attacked by hand (rank takeover, frame tampering, pre-auth
//! memory and shared-memory exhaustion) and each attack worked. These tests keep every one of
//! those attacks in the suite, so a fix is proven and a regression is caught:
//! - a rogue peer holding another peer's credentials (another worker's, or a frontend's)
//!   claims the rank of a live worker: it must be refused, get no activations, and honest
//!   answers must stay bit-identical;
//! - a proxy flips one byte of a request's metadata, of a request's activations, or of a
//!   response: the call must fail, never return a wrong answer;
//! - connections announce a maximum-size frame before authenticating: the router's and a
//!   worker's resident memory (`VmRSS` from `/proc/<pid>/status`) must stay flat;
//! - a hello asking for a shared-memory link before authenticating: no ring file may appear in
//!   `/dev/shm`.
//!
//! Each test starts its own fabric (`expertmesh up` as a child process, on a topology written
//! with a unique cluster name and free ports), with credentials, in exact mode.

use expertmesh_router::client::placement::{ApplyError, apply_placement};
use expertmesh_transport::codec::{self, Body, CodecConfig, FORMAT_VERSION, HEADER_LEN, Hello};
use expertmesh_transport::crypto::Credentials;
use expertmesh_transport::dtype;
use expertmesh_transport::frontend::{FrameConnection, FrontendConfig};
use expertmesh_transport::{LinkKind, Mesh, MeshConfig, PeerAddress, TransportEvent};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Hidden size of the `demo-small` model.
const HIDDEN: usize = 1024;
/// Largest frame on mesh ports (`expertmesh_worker::deploy::MAX_FRAME_BYTES`).
const MESH_MAX_FRAME: usize = 16 << 20;
/// Largest frame on the router's frontend port (`FrontendConfig::new`).
const FRONTEND_MAX_FRAME: usize = 64 << 20;
/// Resident-memory growth tolerated during the pre-auth attacks, per process (allocator noise,
/// a few kilobytes per connection; the attack costs 64 MiB or 16 MiB per connection when
/// unbounded).
const FLAT_RSS_BYTES: u64 = 24 << 20;

// ---------------------------------------------------------------------------------------------
// The fabric under attack.

/// A topology and placement written for one test: the single-host layout (router, two CPU
/// workers) under a unique cluster name, on free loopback ports.
struct Topo {
    dir: tempfile::TempDir,
    name: String,
    topology: PathBuf,
    placement: PathBuf,
    frontend: SocketAddr,
    router_mesh: SocketAddr,
    workers: [SocketAddr; 2],
}

fn topo(tag: &str) -> Topo {
    let dir = tempfile::tempdir().expect("temp dir");
    let name = format!("sec-{tag}-{}", std::process::id());
    let base = expertmesh_transport::ports::free_loopback_ports(12).expect("12 free ports");
    let (front, ctl, data) = (base, base + 1, base + 10);
    let topology = dir.path().join("topology.toml");
    let text = std::fs::read_to_string(crate::support::root().join("examples/single-host.toml"))
        .expect("examples/single-host.toml")
        .replace("name = \"single-host\"", &format!("name = \"{name}\""))
        .replace("port = 47400", &format!("port = {front}"))
        .replace("control_port = 47401", &format!("control_port = {ctl}"))
        .replace("data_port = 47410", &format!("data_port = {data}"));
    std::fs::write(&topology, text).expect("write topology");
    let placement = dir.path().join("placement.toml");
    let text = std::fs::read_to_string(
        crate::support::root().join("examples/single-host-demo-small.placement.toml"),
    )
    .expect("placement")
    .replace(
        "cluster = \"single-host\"",
        &format!("cluster = \"{name}\""),
    );
    std::fs::write(&placement, text).expect("write placement");
    let addr = |p: u16| SocketAddr::from(([127, 0, 0, 1], p));
    Topo {
        dir,
        name,
        topology,
        placement,
        frontend: addr(front),
        router_mesh: addr(ctl),
        workers: [addr(data), addr(data + 1)],
    }
}

/// What each party holds: per-process credentials from `expertmesh keys` (a cluster master
/// key from `keys init`; `up --key` issues the router's and each worker's from it). The test
/// issues an honest frontend's file and, for the rogue, worker rank 2's (`--device
/// local/cpu1`): the rogue claims rank 1 holding rank 2's or the frontend's credential.
struct Creds {
    master: PathBuf,
    frontend: Arc<Credentials>,
    /// A second frontend's ("fe-other").
    other: Arc<Credentials>,
    worker2: Arc<Credentials>,
}

impl Creds {
    fn new(topo: &Topo) -> Self {
        let master = topo.dir.path().join("master.key");
        let r = crate::support::run(&["keys", "init", "--out", utf8(&master)]);
        assert_eq!(r.code, 0, "expertmesh keys init:\n{}{}", r.stdout, r.stderr);
        let load =
            |out: PathBuf| Arc::new(Credentials::load(&out).expect("load an issued credential"));
        let frontend = load(issue(
            topo,
            &master,
            &["--frontend", "fe-honest"],
            "frontend.cred",
        ));
        let other = load(issue(
            topo,
            &master,
            &["--frontend", "fe-other"],
            "other.cred",
        ));
        let worker2 = load(issue(
            topo,
            &master,
            &["--device", "local/cpu1"],
            "rank2.cred",
        ));
        Self {
            master,
            frontend,
            other,
            worker2,
        }
    }

    /// Arguments for the `up` process.
    fn apply(&self, cmd: &mut Command) {
        cmd.arg("--key").arg(&self.master);
    }

    /// An honest frontend's settings.
    fn frontend(&self, cluster: &str) -> FrontendConfig {
        let mut f = FrontendConfig::new(cluster);
        f.credentials = Some(Arc::clone(&self.frontend));
        f
    }

    /// What a rogue holding the credentials of `held` (worker rank 2, or `None` for a
    /// frontend's) puts into its mesh configuration.
    fn rogue_mesh(&self, held: Option<u32>, cfg: &mut MeshConfig) {
        cfg.protocol.credentials = Some(match held {
            Some(r) => {
                assert_eq!(r, 2, "the test issues rank 2's credential only");
                Arc::clone(&self.worker2)
            }
            None => Arc::clone(&self.frontend),
        });
    }
}

/// A temporary path as the UTF-8 argument it is.
fn utf8(p: &Path) -> &str {
    p.to_str().expect("UTF-8 temp path")
}

/// `expertmesh keys issue` for `who` (`--frontend NAME`, `--device D`) from the master key at
/// `master`, into `file` in the test's folder; the file's path.
fn issue(topo: &Topo, master: &Path, who: &[&str], file: &str) -> PathBuf {
    let out = topo.dir.path().join(file);
    let mut args = vec![
        "keys",
        "issue",
        "--key",
        utf8(master),
        "--topology",
        utf8(&topo.topology),
    ];
    args.extend(who);
    args.extend(["--out", utf8(&out)]);
    let r = crate::support::run(&args);
    assert_eq!(r.code, 0, "expertmesh {args:?}:\n{}{}", r.stdout, r.stderr);
    out
}

/// A running `expertmesh up` (router in the process, two worker children).
struct Fabric {
    child: Child,
    topo: Topo,
    creds: Creds,
    stderr_log: PathBuf,
}

impl Fabric {
    fn start(tag: &str) -> Fabric {
        Self::start_with(tag, &[])
    }

    /// `up` with `extra` arguments.
    fn start_with(tag: &str, extra: &[&str]) -> Fabric {
        let topo = topo(tag);
        let creds = Creds::new(&topo);
        let stderr_log = topo.dir.path().join("up.stderr");
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_expertmesh"));
        cmd.args([
            "up",
            "--model",
            "demo-small",
            "--mode",
            "exact",
            "--link",
            "tcp",
        ])
        .arg("--topology")
        .arg(&topo.topology)
        .arg("--placement")
        .arg(&topo.placement)
        .args(extra)
        .current_dir(crate::support::root())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&stderr_log).expect("stderr log"));
        creds.apply(&mut cmd);
        let mut child = cmd.spawn().expect("start expertmesh up");
        let out = child.stdout.take().expect("piped stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut fabric = Fabric {
            child,
            topo,
            creds,
            stderr_log,
        };
        let deadline = Instant::now() + Duration::from_secs(180);
        loop {
            match rx.recv_timeout(Duration::from_millis(200)) {
                Ok(line) if line.trim_start().starts_with("frontends:") => break,
                Ok(_) => {}
                Err(_) => {
                    if let Ok(Some(status)) = fabric.child.try_wait() {
                        panic!("expertmesh up exited ({status}):\n{}", fabric.stderr());
                    }
                    assert!(
                        Instant::now() < deadline,
                        "expertmesh up not ready in 180 s:\n{}",
                        fabric.stderr()
                    );
                }
            }
        }
        // Keep draining stdout so the child never blocks on a full pipe.
        std::thread::spawn(move || while rx.recv().is_ok() {});
        fabric
    }

    fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr_log).unwrap_or_default()
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn frontend(&self) -> FrontendConfig {
        self.creds.frontend(&self.topo.name)
    }

    /// The pid of the worker child serving `device` ("local/cpu0").
    fn worker_pid(&self, device: &str) -> u32 {
        for e in std::fs::read_dir("/proc").expect("/proc").flatten() {
            let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
                continue;
            };
            let stat = std::fs::read_to_string(e.path().join("stat")).unwrap_or_default();
            // "pid (comm) state ppid ...": the ppid is the second field after the ')'.
            let ppid = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().nth(1))
                .and_then(|p| p.parse::<u32>().ok());
            if ppid != Some(self.pid()) {
                continue;
            }
            let cmdline = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
            let args: Vec<&[u8]> = cmdline.split(|&b| b == 0).collect();
            if args
                .windows(2)
                .any(|w| w[0] == b"--device" && w[1] == device.as_bytes())
            {
                return pid;
            }
        }
        panic!("no worker process for {device} under pid {}", self.pid());
    }

    /// Panics (with the log) if `up` or a worker died.
    fn assert_alive(&mut self) {
        if let Ok(Some(status)) = self.child.try_wait() {
            panic!("expertmesh up died ({status}):\n{}", self.stderr());
        }
        for d in ["local/cpu0", "local/cpu1"] {
            let _ = self.worker_pid(d);
        }
    }
}

impl Drop for Fabric {
    fn drop(&mut self) {
        // The workers run with --exit-with-parent: they die with `up`.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime")
}

// ---------------------------------------------------------------------------------------------
// Honest traffic.

/// Deterministic hidden states for `tokens` tokens.
fn hidden_states(tokens: usize, salt: u32) -> Vec<f32> {
    (0..tokens * HIDDEN)
        .map(|i| {
            let x = (i as u32).wrapping_mul(2_654_435_761).wrapping_add(salt) >> 8;
            (x % 2001) as f32 / 1000.0 - 1.0
        })
        .collect()
}

/// A layer call as f32 activations: the request body and its payload.
fn layer_request(id: u64, layer: u32, x: &[f32]) -> (Body, Vec<u8>) {
    crate::support::f32_layer_request(id, layer, HIDDEN, x)
}

/// One call over `conn`: the output bits, or why there was none (an error frame, a closed or
/// broken connection, no answer within 20 s).
async fn call(
    conn: &mut FrameConnection,
    id: u64,
    layer: u32,
    x: &[f32],
) -> Result<Vec<u32>, String> {
    let (body, payload) = layer_request(id, layer, x);
    conn.write_frame(&body, &payload)
        .await
        .map_err(|e| format!("write: {e}"))?;
    let f = tokio::time::timeout(Duration::from_secs(20), conn.read_frame())
        .await
        .map_err(|_| "no answer within 20 s".to_string())?
        .map_err(|e| format!("read: {e}"))?;
    match f.body() {
        Body::LayerResponse(r) => {
            let mut out = vec![0f32; r.tokens as usize * r.hidden as usize];
            dtype::decode_output(r.dtype, f.payload(), &mut out).map_err(|e| e.to_string())?;
            Ok(crate::support::bits(&out))
        }
        Body::Error(e) => Err(format!("error frame {:?}: {}", e.code, e.message)),
        other => Err(format!("unexpected frame {other:?}")),
    }
}

/// One call on a fresh, direct connection to the router.
async fn honest_call(f: &Fabric, layer: u32, x: &[f32]) -> Result<Vec<u32>, String> {
    let mut conn = FrameConnection::connect(f.topo.frontend, &f.frontend())
        .await
        .map_err(|e| format!("connect: {e}"))?;
    call(&mut conn, 1, layer, x).await
}

// ---------------------------------------------------------------------------------------------
// Rank takeover.

/// A rogue mesh endpoint claiming `claimed` (a live worker's rank), holding the credentials of
/// `held` (another worker's rank, or `None`: a frontend's). Its event loop records every frame
/// it is sent (activations leaking to the impostor).
async fn rogue_claims_live_rank(f: &Fabric, claimed: u32, held: Option<u32>) {
    let (rogue, leaked, sink) = rogue_mesh(f, claimed, |cfg| f.creds.rogue_mesh(held, cfg)).await;
    let accepted = rogue
        .wait_connected(&[0], Duration::from_secs(3))
        .await
        .is_ok();
    // Honest traffic while the rogue keeps trying: every answer must be the honest one.
    let x = hidden_states(6, 11);
    let before = honest_call(f, 0, &x).await;
    let mut answers = Vec::new();
    for layer in 0..4u32 {
        answers.push((layer, honest_call(f, layer, &x).await));
    }
    let leaked_frames = leaked.load(Ordering::Relaxed);
    rogue.shutdown();
    sink.abort();
    let who = match held {
        Some(r) => format!("rank {r}'s credentials"),
        None => "a frontend's credentials".to_string(),
    };
    assert!(
        !accepted,
        "a rogue holding {who} was accepted by the router as live worker rank {claimed}"
    );
    assert_eq!(
        leaked_frames, 0,
        "the rogue claiming rank {claimed} with {who} received {leaked_frames} frames (activations)"
    );
    let before = before.expect("honest call after the rogue tried");
    for (layer, a) in answers {
        let a = a.unwrap_or_else(|e| {
            panic!("honest call to layer {layer} failed while a rogue claimed rank {claimed}: {e}")
        });
        if layer == 0 {
            assert_eq!(
                a, before,
                "honest answers changed while a rogue claimed rank {claimed}"
            );
        }
    }
}

/// A rogue mesh endpoint of rank `claimed` that dials the router only (its settings finished
/// by `creds`: whose credential it holds, what it claims), and a count of the frames other
/// than error frames (a refusal says why in one) that reach it: activations leaking to it.
async fn rogue_mesh(
    f: &Fabric,
    claimed: u32,
    creds: impl FnOnce(&mut MeshConfig),
) -> (Mesh, Arc<AtomicU64>, tokio::task::JoinHandle<()>) {
    let port = expertmesh_transport::ports::free_loopback_ports(1).unwrap();
    let listen = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let peers = (0..3u32)
        .map(|r| PeerAddress {
            addr: match r {
                0 => f.topo.router_mesh,
                r if r == claimed => listen,
                r => f.topo.workers[r as usize - 1],
            },
            link: LinkKind::Tcp,
        })
        .collect();
    let mut cfg = MeshConfig::new(f.topo.name.clone(), claimed, peers);
    cfg.dial_ranks = Some(vec![0]);
    cfg.protocol.codec = CodecConfig {
        max_frame_bytes: MESH_MAX_FRAME,
        payload_checksum: false,
    };
    cfg.protocol.recv_window_bytes = 2 * MESH_MAX_FRAME as u64;
    cfg.reconnect_initial = Duration::from_millis(50);
    cfg.reconnect_max = Duration::from_millis(200);
    creds(&mut cfg);
    let (rogue, mut events) = Mesh::start(cfg).await.expect("rogue mesh starts");
    let leaked = Arc::new(AtomicU64::new(0));
    let leaked2 = Arc::clone(&leaked);
    let sink = tokio::spawn(async move {
        while let Some(ev) = events.recv().await {
            if let TransportEvent::Frame(fr) = ev
                && !matches!(fr.body(), Body::Error(_))
            {
                leaked2.fetch_add(1, Ordering::Relaxed);
            }
        }
    });
    (rogue, leaked, sink)
}

/// Baseline answers (before any rogue) must equal the answers during and after the attack.
fn rank_takeover(tag: &str, held: Option<u32>) {
    let mut f = Fabric::start(tag);
    let rt = rt();
    let x = hidden_states(6, 11);
    let baseline = rt.block_on(honest_call(&f, 0, &x)).expect("honest call");
    rt.block_on(rogue_claims_live_rank(&f, 1, held));
    f.assert_alive();
    let after = rt
        .block_on(honest_call(&f, 0, &x))
        .expect("honest call after the attack");
    assert_eq!(
        after, baseline,
        "answers after the attack differ from before it"
    );
    // The router logged the refusal with the rank the rogue claimed (issue 15 item 1).
    let log = f.stderr();
    assert!(
        log.lines()
            .any(|l| l.contains("refused mesh connection") && l.contains("rank 1")),
        "no refusal naming the claimed rank in the router's log:\n{log}"
    );
}

#[test]
fn rogue_with_another_workers_credentials_cannot_claim_a_live_rank() {
    let _machine = crate::support::shared();
    rank_takeover("rogue-w", Some(2));
}

#[test]
fn rogue_with_a_frontends_credentials_cannot_join_the_mesh() {
    let _machine = crate::support::shared();
    rank_takeover("rogue-f", None);
}

// ---------------------------------------------------------------------------------------------
// Tampering.

/// Which way a byte is flipped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Dir {
    ToRouter,
    ToClient,
}

/// A flip to make: xor `mask` into the byte `offset` bytes after the arming point.
struct Flip {
    dir: Dir,
    at: u64,
    mask: u8,
}

/// A TCP proxy in front of the router's frontend port that passes bytes through unchanged
/// until armed, then flips exactly one byte in one direction.
struct TamperProxy {
    addr: SocketAddr,
    counts: Arc<[AtomicU64; 2]>,
    flip: Arc<Mutex<Option<Flip>>>,
    flipped: Arc<AtomicBool>,
}

impl TamperProxy {
    fn start(target: SocketAddr) -> TamperProxy {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let counts: Arc<[AtomicU64; 2]> = Arc::new([AtomicU64::new(0), AtomicU64::new(0)]);
        let flip: Arc<Mutex<Option<Flip>>> = Arc::new(Mutex::new(None));
        let flipped = Arc::new(AtomicBool::new(false));
        let (c, fl, fd) = (Arc::clone(&counts), Arc::clone(&flip), Arc::clone(&flipped));
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { return };
                let Ok(server) = TcpStream::connect(target) else {
                    continue;
                };
                c[0].store(0, Ordering::SeqCst);
                c[1].store(0, Ordering::SeqCst);
                for (dir, from, to) in [
                    (
                        Dir::ToRouter,
                        client.try_clone().unwrap(),
                        server.try_clone().unwrap(),
                    ),
                    (Dir::ToClient, server, client),
                ] {
                    let (c, fl, fd) = (Arc::clone(&c), Arc::clone(&fl), Arc::clone(&fd));
                    std::thread::spawn(move || pump(dir, from, to, &c, &fl, &fd));
                }
            }
        });
        TamperProxy {
            addr,
            counts,
            flip,
            flipped,
        }
    }

    /// Flip `mask` into the byte `offset` bytes further along `dir` than what has passed now.
    fn arm(&self, dir: Dir, offset: u64, mask: u8) {
        let passed = self.counts[dir as usize].load(Ordering::SeqCst);
        *self.flip.lock().unwrap() = Some(Flip {
            dir,
            at: passed + offset,
            mask,
        });
    }
}

/// Copies `from` to `to`, applying an armed flip for `dir`.
fn pump(
    dir: Dir,
    mut from: TcpStream,
    mut to: TcpStream,
    counts: &[AtomicU64; 2],
    flip: &Mutex<Option<Flip>>,
    flipped: &AtomicBool,
) {
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let start = counts[dir as usize].load(Ordering::SeqCst);
        {
            let mut armed = flip.lock().unwrap();
            if let Some(fl) = armed.as_ref()
                && fl.dir == dir
                && (start..start + n as u64).contains(&fl.at)
            {
                buf[(fl.at - start) as usize] ^= fl.mask;
                flipped.store(true, Ordering::SeqCst);
                *armed = None;
            }
        }
        counts[dir as usize].fetch_add(n as u64, Ordering::SeqCst);
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(std::net::Shutdown::Write);
}

#[test]
fn tampered_frames_are_detected_not_answered() {
    let _machine = crate::support::shared();
    let mut f = Fabric::start("tamper");
    let rt = rt();
    let proxy = TamperProxy::start(f.topo.frontend);
    let x = hidden_states(4, 7);
    let honest0 = rt.block_on(honest_call(&f, 0, &x)).expect("honest layer 0");
    let honest1 = rt.block_on(honest_call(&f, 1, &x)).expect("honest layer 1");
    // Plaintext offsets (frames before sealing): the layer field follows the 8-byte request id
    // after the 32-byte header; activation 0 is the first payload element (f32 little endian:
    // byte 3 holds the sign and the high exponent bits; flipping its lowest bit doubles or
    // halves a value in [-1, 1], which stays finite and passes the router's input checks). The
    // response's first output value likewise. A sealed frame is longer than its plaintext, so
    // each offset still falls inside the same sealed frame, where any flip must fail its tag.
    let (req_body, _) = layer_request(1, 0, &x);
    let req_payload_at = codec::head_len(&req_body) as u64;
    let resp_head = codec::head_len(&Body::LayerResponse(codec::LayerResponse {
        request_id: 1,
        tokens: 4,
        hidden: HIDDEN as u32,
        dtype: expertmesh_transport::OutputDtype::F32,
    })) as u64;
    let cases = [
        (
            "request metadata (layer 0 -> 1)",
            Dir::ToRouter,
            HEADER_LEN as u64 + 8,
            0x01,
        ),
        (
            "request activations (one value doubled or halved)",
            Dir::ToRouter,
            req_payload_at + 3,
            0x01,
        ),
        ("response output", Dir::ToClient, resp_head + 3, 0x01),
    ];
    let mut failures = Vec::new();
    for (what, dir, offset, mask) in cases {
        let outcome: Result<Result<Vec<u32>, String>, String> = rt.block_on(async {
            let mut conn = FrameConnection::connect(proxy.addr, &f.frontend())
                .await
                .map_err(|e| format!("connect through the proxy: {e}"))?;
            if !conn.is_encrypted() {
                return Err("the frontend connection is not encrypted".to_string());
            }
            // The first call passes untouched (the proxy is transparent until armed).
            let clean = call(&mut conn, 1, 0, &x).await?;
            if clean != honest0 {
                return Err("an untampered call through the proxy gave another answer".to_string());
            }
            proxy.flipped.store(false, Ordering::SeqCst);
            proxy.arm(dir, offset, mask);
            Ok(call(&mut conn, 2, 0, &x).await)
        });
        let tampered = match outcome {
            Err(e) => panic!("{what}: setting up the tampering failed: {e}"),
            Ok(t) => t,
        };
        assert!(
            proxy.flipped.load(Ordering::SeqCst),
            "{what}: the proxy never flipped its byte"
        );
        match tampered {
            Err(why) => eprintln!("{what}: tampered call refused ({why})"),
            Ok(out) => failures.push(format!(
                "{what}: the call succeeded with a {} answer",
                if out == honest1 {
                    "wrong (layer 1's)".to_string()
                } else if out == honest0 {
                    "correct (the flip changed nothing?)".to_string()
                } else {
                    "wrong".to_string()
                }
            )),
        }
        // The router goes on serving honest clients.
        f.assert_alive();
        let again = rt
            .block_on(honest_call(&f, 0, &x))
            .expect("honest call after tampering");
        assert_eq!(
            again, honest0,
            "{what}: honest answers changed after the tampering"
        );
    }
    assert!(
        failures.is_empty(),
        "a flipped byte went unnoticed:\n  {}",
        failures.join("\n  ")
    );
}

// ---------------------------------------------------------------------------------------------
// Pre-authentication resources.

/// Bitwise CRC-32C (Castagnoli), independent of the crate under test.
fn crc32c(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &byte in data {
        crc ^= byte as u32;
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0x82F6_3B78
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

/// A valid 32-byte frame header announcing a hello of `frame_len` bytes (what an attacker
/// sends before authenticating, then stalls).
fn huge_header(frame_len: usize) -> [u8; HEADER_LEN] {
    let meta_len = 32u32;
    let payload_len = frame_len as u32 - 64;
    let mut h = [0u8; HEADER_LEN];
    h[0..4].copy_from_slice(&codec::MAGIC.to_le_bytes());
    h[4] = FORMAT_VERSION;
    h[5] = codec::FrameKind::Hello as u8;
    h[8..12].copy_from_slice(&(frame_len as u32).to_le_bytes());
    h[12..16].copy_from_slice(&meta_len.to_le_bytes());
    h[16..20].copy_from_slice(&payload_len.to_le_bytes());
    let crc = crc32c(&h[..24]);
    h[24..28].copy_from_slice(&crc.to_le_bytes());
    h
}

/// A hello claiming `rank` of the fabric `f`, asking for a shared-memory link with `attachment`.
fn rogue_hello(cluster: &str, rank: u32, attachment: Vec<u8>) -> Vec<u8> {
    let mut nonce = [0u8; 32];
    nonce[0] = rank as u8;
    let body = Body::Hello(Hello {
        format_version: FORMAT_VERSION,
        cluster: cluster.to_string(),
        rank,
        world_size: 3,
        recv_window_bytes: 2 * MESH_MAX_FRAME as u64,
        auth_required: true,
        nonce,
        attachment,
        incarnation: 7,
        fingerprint: [0; codec::FINGERPRINT_BYTES],
        identity: String::new(),
    });
    let cfg = CodecConfig {
        max_frame_bytes: MESH_MAX_FRAME,
        payload_checksum: false,
    };
    codec::encode_frame(&body, &[], &cfg).expect("encode hello")
}

/// `VmRSS` (or another `Vm*` field) of `pid`, in bytes.
fn vm(pid: u32, field: &str) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc/<pid>/status");
    s.lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| {
            v.trim_start_matches(':')
                .split_whitespace()
                .next()?
                .parse::<u64>()
                .ok()
        })
        .map(|kb| kb * 1024)
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"))
}

/// Connections that announce a maximum-size frame before authenticating and then stall:
/// half send only the header, half a valid hello first (the header then comes where the
/// authentication answer belongs).
fn stall_with_huge_headers(
    to: SocketAddr,
    n: usize,
    frame_len: usize,
    hello: &[u8],
) -> Vec<TcpStream> {
    (0..n)
        .filter_map(|i| {
            let mut s = TcpStream::connect(to).ok()?;
            if i % 2 == 1 {
                let _ = s.write_all(hello);
            }
            let _ = s.write_all(&huge_header(frame_len));
            Some(s)
        })
        .collect()
}

/// Whether the peer has closed `s` (what it sent before, a refusal, is read and dropped).
fn closed_by_peer(s: &mut TcpStream) -> bool {
    let _ = s.set_read_timeout(Some(Duration::from_millis(5)));
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return false;
            }
            Err(_) => return true,
        }
    }
}

#[test]
fn preauth_max_size_headers_keep_memory_flat() {
    let _machine = crate::support::shared();
    let mut f = Fabric::start("rss");
    let rt = rt();
    let x = hidden_states(3, 5);
    let honest = rt.block_on(honest_call(&f, 0, &x)).expect("honest call");
    let router = f.pid();
    let worker = f.worker_pid("local/cpu0");
    std::thread::sleep(Duration::from_millis(300));
    let base = [vm(router, "VmRSS"), vm(worker, "VmRSS")];
    let hwm_before = vm(router, "VmHWM");
    let client_hello = rogue_hello(&f.topo.name, codec::CLIENT_RANK, Vec::new());
    let worker_hello = rogue_hello(&f.topo.name, 2, Vec::new());
    // 8 on the router's frontend port (64 MiB frames), 8 on its mesh port and 8 on a worker's
    // (16 MiB frames): 768 MiB in the router and 128 MiB in the worker when unbounded.
    let mut held = stall_with_huge_headers(f.topo.frontend, 8, FRONTEND_MAX_FRAME, &client_hello);
    held.extend(stall_with_huge_headers(
        f.topo.router_mesh,
        8,
        MESH_MAX_FRAME,
        &worker_hello,
    ));
    held.extend(stall_with_huge_headers(
        f.topo.workers[0],
        8,
        MESH_MAX_FRAME,
        &worker_hello,
    ));
    let mut peak = base;
    let t0 = Instant::now();
    // Sampled for at least 2.5 s and until the servers have dealt with every connection
    // (refused and closed each): a flat RSS before they read the headers would prove nothing.
    let mut open = held.len();
    while t0.elapsed() < Duration::from_millis(2500) || open > 0 {
        peak[0] = peak[0].max(vm(router, "VmRSS"));
        peak[1] = peak[1].max(vm(worker, "VmRSS"));
        open = held
            .iter_mut()
            .map(closed_by_peer)
            .filter(|closed| !closed)
            .count();
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "{open} of the connections with oversized headers were never closed"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let hwm_after = vm(router, "VmHWM");
    drop(held);
    f.assert_alive();
    let again = rt
        .block_on(honest_call(&f, 0, &x))
        .expect("honest call after the attack");
    assert_eq!(again, honest, "answers changed after the pre-auth attack");
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    eprintln!(
        "router RSS {:.1} -> peak {:.1} MiB (HWM {:.1} -> {:.1}); worker RSS {:.1} -> peak {:.1} MiB",
        mib(base[0]),
        mib(peak[0]),
        mib(hwm_before),
        mib(hwm_after),
        mib(base[1]),
        mib(peak[1])
    );
    assert!(
        peak[0] - base[0] <= FLAT_RSS_BYTES,
        "router RSS grew by {:.1} MiB from 24 unauthenticated connections announcing big frames",
        mib(peak[0] - base[0])
    );
    assert!(
        peak[1] - base[1] <= FLAT_RSS_BYTES,
        "worker RSS grew by {:.1} MiB from 8 unauthenticated connections announcing big frames",
        mib(peak[1] - base[1])
    );
}

/// Ring files of cluster `name` in /dev/shm, with their sizes.
fn ring_files(name: &str) -> Vec<(String, u64)> {
    let prefix = format!(
        "expertmesh-{}-",
        name.chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect::<String>()
    );
    let mut v: Vec<(String, u64)> = std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.flatten()
                .filter_map(|e| {
                    let n = e.file_name().to_string_lossy().into_owned();
                    n.starts_with(&prefix)
                        .then(|| (n, e.metadata().map(|m| m.len()).unwrap_or(0)))
                })
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

#[test]
fn preauth_shm_hello_creates_no_ring() {
    let _machine = crate::support::shared();
    let Some(_shm) = crate::support::shm_room(crate::support::FABRIC_RINGS) else {
        return;
    };
    let mut f = Fabric::start("shm");
    let rt = rt();
    let x = hidden_states(3, 9);
    let honest = rt.block_on(honest_call(&f, 0, &x)).expect("honest call");
    let before = ring_files(&f.topo.name);
    let router = f.pid();
    let base_rss = vm(router, "VmRSS");
    let attachment = |from: u32, to: u32| {
        format!(
            "shm:/dev/shm/expertmesh-{}-{from}to{to}-1-00000000",
            f.topo.name.replace('-', "_")
        )
        .into_bytes()
    };
    // Hellos asking for a shared-memory link, never followed by an authentication answer: to
    // the router's mesh port claiming worker ranks, and to a worker's port claiming the other.
    let mut held = Vec::new();
    for i in 0..4u32 {
        let (to, rank, peer) = if i < 2 {
            (f.topo.router_mesh, 1 + i, 0)
        } else {
            (f.topo.workers[0], 2, 1)
        };
        let mut s = TcpStream::connect(to).expect("connect");
        s.write_all(&rogue_hello(&f.topo.name, rank, attachment(peer, rank)))
            .expect("send hello");
        held.push(s);
    }
    let mut appeared: Vec<(String, u64)> = Vec::new();
    let mut peak_rss = base_rss;
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_millis(2000) {
        for e in ring_files(&f.topo.name) {
            if !before.contains(&e) && !appeared.iter().any(|a| a.0 == e.0) {
                appeared.push(e);
            }
        }
        peak_rss = peak_rss.max(vm(router, "VmRSS"));
        std::thread::sleep(Duration::from_millis(50));
    }
    drop(held);
    f.assert_alive();
    let again = rt
        .block_on(honest_call(&f, 0, &x))
        .expect("honest call after the attack");
    assert_eq!(again, honest);
    let total: u64 = appeared.iter().map(|e| e.1).sum();
    assert!(
        appeared.is_empty(),
        "{} ring files ({:.1} MiB) appeared in /dev/shm for 4 unauthenticated hellos: {:?}",
        appeared.len(),
        total as f64 / (1 << 20) as f64,
        appeared.iter().map(|e| &e.0).collect::<Vec<_>>()
    );
    assert!(
        peak_rss - base_rss <= FLAT_RSS_BYTES,
        "router RSS grew by {} bytes from unauthenticated shm hellos",
        peak_rss - base_rss
    );
}

// ---------------------------------------------------------------------------------------------
// Issue 27: four holes found by probes written from the wire format.

/// The incarnation the router's log gives for the live link of `rank`. Before issue 27 the
/// hello carried it in plaintext (now it is sealed); the rogue is given it here as if it had
/// leaked, so the refusal cannot rest on the rogue not knowing it.
fn live_incarnation(log: &str, rank: u32) -> u64 {
    let peer = format!("peer={rank}");
    log.lines()
        .filter(|l| l.contains("link established") && l.split_whitespace().any(|w| w == peer))
        .filter_map(|l| {
            let at = l.find("incarnation=")? + "incarnation=".len();
            let hex: String = l[at..]
                .chars()
                .take_while(|c| c.is_ascii_hexdigit())
                .collect();
            u64::from_str_radix(&hex, 16).ok()
        })
        .next_back()
        .unwrap_or_else(|| panic!("no 'link established' line for rank {rank} in:\n{log}"))
}

/// Hole 1: a second process holding rank 2's **own** credential, the live rank 2's
/// fingerprint and its incarnation (both then read off the plaintext hello) used to be taken for
/// the live process reconnecting and swapped in: it got other clients' activations and its
/// answers were returned as success. It must be refused and get nothing while rank 2 lives.
#[test]
fn a_duplicate_with_the_ranks_own_credential_and_copied_incarnation_is_refused() {
    let _machine = crate::support::shared();
    let mut f = Fabric::start("dup-inc");
    let rt = rt();
    let x = hidden_states(6, 11);
    let baseline = rt.block_on(honest_call(&f, 0, &x)).expect("honest call");
    let incarnation = live_incarnation(&f.stderr(), 2);
    let links_of_rank2 = |log: &str| {
        log.lines()
            .filter(|l| {
                l.contains("link established") && l.split_whitespace().any(|w| w == "peer=2")
            })
            .count()
    };
    let links_before = links_of_rank2(&f.stderr());
    let dep = expertmesh_worker::deploy::Deployment::load(
        &f.topo.topology,
        "demo-small",
        &f.topo.placement,
        42,
    )
    .expect("the fabric's deployment");
    let fingerprint = dep.fingerprints()[2];
    let (leaked, answers) = rt.block_on(async {
        let (rogue, leaked, sink) = rogue_mesh(&f, 2, |cfg| {
            cfg.protocol.incarnation = incarnation;
            cfg.protocol.fingerprint = fingerprint;
            cfg.protocol.credentials = Some(Arc::clone(&f.creds.worker2));
        })
        .await;
        // Its handshake succeeds (it holds rank 2's key); the router then decides. Until the
        // router has refused it (a hang guard of 60 s: it dials at this machine's pace), then
        // a little longer for it to retry.
        let _ = rogue.wait_connected(&[0], Duration::from_secs(3)).await;
        let refused = |log: &str| {
            log.lines()
                .any(|l| l.contains("refused a second connection") && l.contains("rank 2"))
        };
        let t0 = Instant::now();
        while !refused(&f.stderr()) && t0.elapsed() < Duration::from_secs(60) {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
        let mut answers = Vec::new();
        for layer in 0..4u32 {
            answers.push((layer, honest_call(&f, layer, &x).await));
        }
        rogue.shutdown();
        sink.abort();
        (leaked.load(Ordering::Relaxed), answers)
    });
    f.assert_alive();
    let log = f.stderr();
    assert_eq!(
        links_of_rank2(&log),
        links_before,
        "a duplicate rank 2 with its own credential and the live incarnation {incarnation:016x} \
         was installed in place of the live one (router log):\n{log}"
    );
    assert_eq!(
        leaked, 0,
        "the duplicate rank 2 received {leaked} frames other than its refusal"
    );
    for (layer, a) in answers {
        let a = a.unwrap_or_else(|e| panic!("honest call to layer {layer} failed: {e}"));
        if layer == 0 {
            assert_eq!(
                a, baseline,
                "an answer changed while a duplicate rank 2 tried"
            );
        }
    }
    assert!(
        log.lines()
            .any(|l| l.contains("refused a second connection") && l.contains("rank 2")),
        "no refusal of the duplicate rank 2 in the router's log:\n{log}"
    );
}

/// Hole 2: 8 addresses x 8 connections trickling their hello at 1 byte/s used to hold every
/// handshake place of the frontend port (0 of 80 honest connections got in). Honest
/// frontends must get in and be answered for the whole attack, each without waiting for a
/// stalled handshake to time out (5 s): what is asserted is the mechanism (a newcomer takes
/// a stalled handshake's place at once), not how fast this machine runs a handshake (2 ms
/// measured here; the issue's target was 1 s).
#[test]
fn honest_frontends_get_in_without_waiting_for_stalled_handshakes_while_eight_addresses_slow_loris_the_port()
 {
    let _machine = crate::support::alone();
    let f = Fabric::start("loris-fe");
    let rt = rt();
    let x = hidden_states(2, 5);
    let baseline = rt.block_on(honest_call(&f, 1, &x)).expect("honest call");
    let attack = crate::support::SlowLoris::start(
        f.topo.frontend,
        8,
        8,
        rogue_hello(&f.topo.name, u32::MAX, Vec::new()),
    );
    // Every handshake place taken (64 connections, each stalled for up to the 5 s timeout).
    attack.wait_connected(64);
    let cfg = f.frontend();
    let mut slowest = Duration::ZERO;
    for i in 0..10 {
        let t = Instant::now();
        let conn = rt.block_on(async {
            tokio::time::timeout(
                Duration::from_secs(10),
                FrameConnection::connect(f.topo.frontend, &cfg),
            )
            .await
        });
        let took = t.elapsed();
        let mut conn = conn
            .unwrap_or_else(|_| panic!("honest connection {i} not in after 10 s of the attack"))
            .unwrap_or_else(|e| panic!("honest connection {i} refused during the attack: {e}"));
        slowest = slowest.max(took);
        let got = rt.block_on(call(&mut conn, 1, 1, &x));
        assert_eq!(
            got.as_ref(),
            Ok(&baseline),
            "honest call {i} during the attack"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    println!(
        "slowest of 10 honest connections during the attack: {slowest:?} ({} attack connections)",
        attack.connects()
    );
    let stalled_timeout = cfg.handshake_timeout;
    assert!(
        slowest < stalled_timeout,
        "the slowest of 10 honest connections took {slowest:?} to get in (bound: a stalled \
         handshake's timeout, {stalled_timeout:?}) while 8 addresses slow-lorised the frontend \
         port ({} attack connections)",
        attack.connects()
    );
    drop(attack);
}

/// Hole 4: one frontend's idle connections used to take the whole connection memory budget
/// (64 connections) and lock every other frontend out. One frontend holds at most 16
/// (`--max-connections-per-frontend`); the 17th is refused saying so; another frontend is
/// served meanwhile; a connection closed makes room again. (No idle timeout here: what this
/// test counts must not depend on how long its 64 connections take to open.)
#[test]
fn one_frontends_connections_are_capped() {
    let _machine = crate::support::shared();
    let f = Fabric::start_with(
        "fe-cap",
        &[
            "--max-connections-per-frontend",
            "16",
            "--frontend-idle-timeout-s",
            "0",
        ],
    );
    let rt = rt();
    let x = hidden_states(2, 9);
    let baseline = rt.block_on(honest_call(&f, 2, &x)).expect("honest call");
    let cfg = f.frontend();
    let (mut open, mut refused) = (Vec::new(), Vec::new());
    for i in 0..64u64 {
        let mut conn = rt
            .block_on(FrameConnection::connect(f.topo.frontend, &cfg))
            .unwrap_or_else(|e| panic!("connection {i}: handshake failed: {e}"));
        match rt.block_on(call(&mut conn, i + 1, 2, &x)) {
            Ok(bits) => {
                assert_eq!(bits, baseline, "connection {i}'s answer");
                open.push(conn);
            }
            Err(e) => refused.push(e),
        }
    }
    assert_eq!(
        (open.len(), refused.len()),
        (16, 48),
        "one frontend's 64 connections: {} served, refused: {:?}",
        open.len(),
        refused.first()
    );
    assert!(
        refused.iter().all(|e| e
            .contains("16 connections of frontend \"fe-honest\" are already open")
            && e.contains("--max-connections-per-frontend")),
        "refusals do not say why: {:?}",
        refused.first()
    );
    // Another frontend is served while the first holds its 16.
    let mut other_cfg = FrontendConfig::new(&f.topo.name);
    other_cfg.credentials = Some(Arc::clone(&f.creds.other));
    let mut other = rt
        .block_on(FrameConnection::connect(f.topo.frontend, &other_cfg))
        .expect("another frontend connects");
    assert_eq!(
        rt.block_on(call(&mut other, 1, 2, &x)).as_ref(),
        Ok(&baseline)
    );
    // One closed: its place is free again (the router notices the close when it reads).
    drop(open.pop());
    let t0 = Instant::now();
    let again = loop {
        let mut conn = rt
            .block_on(FrameConnection::connect(f.topo.frontend, &cfg))
            .expect("the first frontend connects again");
        match rt.block_on(call(&mut conn, 1, 2, &x)) {
            Ok(bits) => break bits,
            Err(e) => assert!(
                t0.elapsed() < Duration::from_secs(60),
                "no place freed 60 s after a connection closed: {e}"
            ),
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(again, baseline);
}

/// Connections idle past `--frontend-idle-timeout-s` (here 5 s) are closed with a message
/// saying why; one kept busy (a call every half second from the moment it connects) is not.
#[test]
fn idle_frontend_connections_are_closed_and_busy_ones_kept() {
    let _machine = crate::support::shared();
    let f = Fabric::start_with("fe-idle", &["--frontend-idle-timeout-s", "5"]);
    let rt = rt();
    let x = hidden_states(2, 9);
    let baseline = rt.block_on(honest_call(&f, 2, &x)).expect("honest call");
    let cfg = f.frontend();
    let connect_and_call = || {
        let mut conn = rt
            .block_on(FrameConnection::connect(f.topo.frontend, &cfg))
            .expect("connect");
        assert_eq!(
            rt.block_on(call(&mut conn, 1, 2, &x)).as_ref(),
            Ok(&baseline)
        );
        conn
    };
    let mut idle: Vec<FrameConnection> = (0..3).map(|_| connect_and_call()).collect();
    let mut busy = connect_and_call();
    for i in 0..16u64 {
        std::thread::sleep(Duration::from_millis(500));
        let got = rt.block_on(call(&mut busy, 100 + i, 2, &x));
        assert_eq!(got.as_ref(), Ok(&baseline), "busy connection, call {i}");
    }
    for (i, conn) in idle.iter_mut().enumerate() {
        let r = rt.block_on(async {
            tokio::time::timeout(Duration::from_secs(60), conn.read_frame()).await
        });
        match r {
            Ok(Ok(fr)) => match fr.body() {
                Body::Error(e) => assert!(
                    e.message.contains("idle timeout"),
                    "idle connection {i}: {}",
                    e.message
                ),
                other => panic!("idle connection {i}: unexpected {other:?}"),
            },
            Ok(Err(_)) => {} // closed
            Err(_) => panic!("idle connection {i} still open 60 s after the 5 s idle timeout"),
        }
    }
}

/// The idle timeout does not break a plain client that calls again later: before its next
/// request a `RouterClient` whose connection the router closed for idleness connects again
/// (the router read nothing after deciding), and the call is answered bit for bit.
#[test]
fn a_plain_client_reconnects_after_the_router_closed_it_for_idleness() {
    let _machine = crate::support::shared();
    let f = Fabric::start_with("idle-rc", &["--frontend-idle-timeout-s", "1"]);
    let rt = rt();
    let x = hidden_states(3, 21);
    let mut client = rt
        .block_on(expertmesh_router::client::RouterClient::connect(
            f.topo.frontend,
            &f.frontend(),
        ))
        .expect("client connects");
    let deadline = Some(Duration::from_secs(20));
    let first = rt
        .block_on(client.call(1, &x, HIDDEN, None, deadline))
        .expect("first call");
    let closes = |log: &str| {
        log.lines()
            .filter(|l| l.contains("frontend connection closed: no request or answer for"))
            .count()
    };
    for round in 1..=2 {
        // Call again once the router says it closed the connection (it logs that after its
        // closing frame is written), however long this machine takes to get there.
        let t0 = Instant::now();
        while closes(&f.stderr()) < round {
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "the router did not close the idle connection (round {round}):\n{}",
                f.stderr()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        let again = rt
            .block_on(client.call(1, &x, HIDDEN, None, deadline))
            .unwrap_or_else(|e| panic!("call after {round} idle closes: {e}"));
        assert_eq!(crate::support::bits(&again), crate::support::bits(&first));
    }
}

// ---------------------------------------------------------------------------------------------
// Placement changes.

/// Only a placement admin moves experts (issue 29): a serving frontend's placement change is
/// refused with NotPermitted, naming who may, and changes nothing; its connection goes on
/// serving. The frontend named "admin" (`keys issue --frontend admin`, the router's default
/// `--placement-admins`) applies the same change through `expertmesh rebalance`, and the fabric
/// serves bit for bit as before it.
#[test]
fn only_a_placement_admin_changes_the_placement() {
    let _machine = crate::support::shared();
    let mut f = Fabric::start("placement-admin");
    let rt = rt();
    let x = hidden_states(3, 17);
    let before = rt.block_on(honest_call(&f, 2, &x)).expect("honest call");

    // A serving frontend on an open connection: refused, then served on the same connection.
    let mut conn = rt
        .block_on(FrameConnection::connect(f.topo.frontend, &f.frontend()))
        .expect("honest frontend connects");
    let refused = rt.block_on(apply_placement(
        &mut conn,
        7,
        &[(1, 1, 0)],
        Duration::from_secs(10),
    ));
    match refused {
        Err(ApplyError::NotPermitted(m)) => assert!(
            m.contains("\"fe-honest\"") && m.contains("--placement-admins (admin)"),
            "{m}"
        ),
        other => panic!("a serving frontend's placement change: {other:?}"),
    }
    assert_eq!(
        rt.block_on(call(&mut conn, 8, 2, &x)),
        Ok(before.clone()),
        "the refused frontend's connection goes on serving"
    );

    // The same through the CLI: the honest frontend's credential, then the admin's.
    let dir = f.topo.dir.path().to_owned();
    let swapped = dir.join("swapped.toml");
    let original = std::fs::read_to_string(&f.topo.placement).expect("placement");
    std::fs::write(
        &swapped,
        original
            .replace("experts = \"0-19\"", "experts = \"12-31\"")
            .replace("experts = \"16-31,0-3\"", "experts = \"0-15\""),
    )
    .expect("write the swapped placement");
    let (router, topology) = (f.topo.frontend.to_string(), f.topo.topology.clone());
    let rebalance = |credentials: &Path| {
        crate::support::run(&[
            "rebalance",
            "--router",
            &router,
            "--topology",
            utf8(&topology),
            "--model",
            "demo-small",
            "--placement",
            utf8(&swapped),
            "--credentials",
            utf8(credentials),
            "--timeout-s",
            "60",
        ])
    };
    let r = rebalance(&dir.join("frontend.cred"));
    assert_eq!(r.code, 1, "{}{}", r.stdout, r.stderr);
    assert!(
        r.stderr.contains("may not change the placement")
            && r.stderr.contains("keys issue --frontend"),
        "{}",
        r.stderr
    );
    f.assert_alive();

    let admin = issue(
        &f.topo,
        &f.creds.master,
        &["--frontend", "admin"],
        "admin.cred",
    );
    let r = rebalance(&admin);
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    assert!(r.stdout.contains("is served at version"), "{}", r.stdout);
    f.assert_alive();
    assert_eq!(
        rt.block_on(honest_call(&f, 2, &x)),
        Ok(before),
        "served bit for bit after the change"
    );
}
