//! The client's own deadlines and its failover between routers, through real processes.
//!
//! Checks: (a) on a fabric with two routers sharing the workers
//! (examples/single-host-2routers.toml), clients given both routers keep working when one
//! router stops under load: every call succeeds with the bit-identical answer of the in-process
//! reference (exact mode), none is wrong, none hangs, and the clients that used the stopped
//! router moved to the other; `infer` given both routers, the stopped one first, answers
//! through the other; (b) a router process (`expertmesh up`) stopped with SIGSTOP: a
//! call with a 2 s deadline returns DeadlineExceeded within 2.5 s (before the client kept its
//! deadline it waited as long as the router was stopped), and after SIGCONT the same client's
//! next call is answered bit for bit; (c) a failover client given two `up` processes leaves the
//! one that is SIGSTOPped within the keepalive bound and gets the other's bit-identical answer.

use crate::support::{bits, free_pair, free_port, root, rt};
use expertmesh_router::client::{ClientOptions, RouterClient};
use expertmesh_router::reference;
use expertmesh_transport::codec::ErrorCode;
use expertmesh_transport::frontend::FrontendConfig;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::support::two_routers;

/// (layer, input, expected output bits) from the in-process reference.
type Cases = crate::support::RefCases;

fn cases(spec: &expertmesh_topology::model::ModelSpec, seed: u64, tokens: &[usize]) -> Cases {
    crate::support::reference_cases(spec, seed, tokens, 7)
}

/// What one client saw.
#[derive(Debug, Default)]
struct Tally {
    ok: usize,
    wrong: usize,
    errors: Vec<String>,
    failovers: u64,
}

/// `rounds` rounds over `cases` (hidden size `hidden`), four requests pipelined at a time,
/// through a failover client given `routers` in that order; every answer taken counts in
/// `done`.
fn drive(
    routers: &[SocketAddr],
    cfg: &FrontendConfig,
    cases: &Cases,
    hidden: usize,
    rounds: usize,
    done: &std::sync::atomic::AtomicUsize,
) -> Tally {
    let rt = rt();
    let mut t = Tally::default();
    let connect = RouterClient::connect_any(routers, cfg, ClientOptions::default());
    let mut c = match rt.block_on(connect) {
        Ok(c) => c,
        Err(e) => {
            t.errors.push(format!("connect: {e}"));
            return t;
        }
    };
    for _ in 0..rounds {
        for chunk in cases.chunks(4) {
            let mut handles = Vec::new();
            for (layer, x, want) in chunk {
                let d = Some(Duration::from_secs(10));
                match rt.block_on(c.submit(*layer, x, hidden, None, d)) {
                    Ok(hd) => handles.push((hd, want)),
                    Err(e) => t.errors.push(e.to_string()),
                }
            }
            for (hd, want) in handles {
                done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                match rt.block_on(c.wait(hd)) {
                    Ok(got) if bits(&got) == **want => t.ok += 1,
                    Ok(_) => t.wrong += 1,
                    Err(e) => t.errors.push(e.to_string()),
                }
            }
        }
    }
    t.failovers = c.failovers();
    t
}

#[test]
fn failover_clients_get_every_answer_bit_for_bit_when_a_router_stops_under_load() {
    // No time bound (every call answered bit for bit, whenever): the machine is shared.
    let _machine = crate::support::shared();
    let mut fabric = two_routers();
    let dep = fabric.deployment();
    let spec = dep.spec.clone();
    let h = spec.hidden as usize;
    let cases = Arc::new(cases(&spec, dep.seed, &[1, 6]));
    let cfg = fabric.frontend_config();
    let addrs: Vec<SocketAddr> = fabric.frontend_addrs().into_iter().flatten().collect();
    assert_eq!(addrs.len(), 2);
    // Clients 0 and 2 start on router 1 (the one that stops), 1 and 3 on router 0. Each makes
    // 480 calls; router 1 stops once 100 have been answered in all, so every client is still
    // calling then however fast or slow the machine is.
    let done = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let rounds = 60;
    let threads: Vec<_> = (0..4)
        .map(|i| {
            let (cases, cfg, done) = (Arc::clone(&cases), cfg.clone(), Arc::clone(&done));
            let order = if i % 2 == 0 {
                vec![addrs[1], addrs[0]]
            } else {
                vec![addrs[0], addrs[1]]
            };
            std::thread::spawn(move || drive(&order, &cfg, &cases, h, rounds, &done))
        })
        .collect();
    let t0 = std::time::Instant::now();
    while done.load(std::sync::atomic::Ordering::Relaxed) < 100 {
        assert!(t0.elapsed() < Duration::from_secs(60), "no progress");
        std::thread::sleep(Duration::from_millis(2));
    }
    fabric.stop_router(1);
    let tallies: Vec<Tally> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    for (i, t) in tallies.iter().enumerate() {
        assert_eq!(t.wrong, 0, "client {i}: {t:?}");
        assert!(t.errors.is_empty(), "client {i}: {t:?}");
        assert_eq!(t.ok, rounds * cases.len(), "client {i}: {t:?}");
    }
    // The clients that started on router 1 were still calling when it stopped.
    assert!(
        tallies[0].failovers >= 1 && tallies[2].failovers >= 1,
        "{tallies:?}"
    );
    let s = fabric.router(0).unwrap().stats();
    assert_eq!(s.failures, 0, "router 0: {s:?}");
    // `infer` given both routers, the stopped one first: it answers through the other.
    let dir = tempfile::tempdir().unwrap();
    let (input, output) = (dir.path().join("x.npy"), dir.path().join("y.npy"));
    let (layer, x, want) = &cases[1];
    let tokens = x.len() / h;
    let npy = expertmesh::npy::encode(tokens, h, x, expertmesh::npy::NpyDtype::F32);
    std::fs::write(&input, npy).unwrap();
    let run = crate::support::run(&[
        "infer",
        "--router",
        &format!("{},{}", addrs[1], addrs[0]),
        "--cluster",
        &cfg.cluster,
        "--layer",
        &layer.to_string(),
        "--input",
        input.to_str().unwrap(),
        "--output",
        output.to_str().unwrap(),
    ]);
    assert_eq!(run.code, 0, "{}{}", run.stdout, run.stderr);
    let y = expertmesh::npy::read(&output).unwrap();
    assert_eq!(bits(&y.data), *want, "infer's answer through router 0");
    fabric.shutdown();
}

/// An `expertmesh up` child; stopped processes are continued, and the child interrupted (then
/// killed) when this is dropped, even when the test fails.
struct Up {
    child: std::process::Child,
    frontend: SocketAddr,
    _dir: tempfile::TempDir,
}

impl Up {
    /// `up` on examples/single-host.toml with ports picked free, exact mode.
    fn start() -> Up {
        use std::io::BufRead;
        let dir = tempfile::tempdir().unwrap();
        let topo = std::fs::read_to_string(root().join("examples/single-host.toml")).unwrap();
        let (front, control, data) = (free_port(), free_port(), free_pair());
        let topo = topo
            .replace("port = 47400", &format!("port = {front}"))
            .replace("control_port = 47401", &format!("control_port = {control}"))
            .replace("data_port = 47410", &format!("data_port = {data}"));
        let path = dir.path().join("topology.toml");
        std::fs::write(&path, topo).unwrap();
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_expertmesh"))
            .arg("up")
            .arg("--topology")
            .arg(&path)
            .args(["--model", "demo-small"])
            .arg("--placement")
            .arg(root().join("examples/single-host-demo-small.placement.toml"))
            .args(["--mode", "exact"])
            .current_dir(root())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::inherit())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let mut lines = std::io::BufReader::new(stdout).lines();
        let mut frontend = None;
        for line in lines.by_ref() {
            let line = line.unwrap();
            if let Some(rest) = line.trim().strip_prefix("frontends: ") {
                frontend = rest.split_whitespace().next().and_then(|a| a.parse().ok());
                break;
            }
        }
        // Keep reading, so that `up` can print until it exits.
        std::thread::spawn(move || lines.for_each(drop));
        let mut up = Up {
            child,
            frontend: "0.0.0.0:0".parse().unwrap(),
            _dir: dir,
        };
        up.frontend = frontend.expect("up printed where frontends connect");
        assert_eq!(up.frontend.port(), front);
        up
    }

    fn signal(&self, sig: i32) {
        // SAFETY: a signal to our own child process.
        unsafe { libc::kill(self.child.id() as i32, sig) };
    }
}

impl Drop for Up {
    fn drop(&mut self) {
        self.signal(libc::SIGCONT);
        self.signal(libc::SIGINT);
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(10) {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn a_call_to_a_stopped_router_process_ends_at_its_deadline() {
    // The bounds are the deadline itself and 10x it: the machine is shared.
    let _machine = crate::support::shared();
    let up = Up::start();
    let spec = expertmesh_topology::model::preset_by_name("demo-small").unwrap();
    let h = spec.hidden as usize;
    let layer = spec.moe_layer_ids()[0];
    let rt = rt();
    let cfg = FrontendConfig::new("single-host");
    let mut c = rt
        .block_on(RouterClient::connect(up.frontend, &cfg))
        .unwrap();
    let x = reference::synthetic_hidden(3, 4, h);
    let want = rt.block_on(c.call(layer, &x, h, None, None)).unwrap();
    up.signal(libc::SIGSTOP);
    std::thread::sleep(Duration::from_millis(100));
    let t = Instant::now();
    // (A watchdog, so that a client that does not keep its deadline fails the test instead of
    // hanging it.)
    let call = c.call(layer, &x, h, None, Some(Duration::from_secs(2)));
    let r = rt.block_on(async { tokio::time::timeout(Duration::from_secs(60), call).await });
    let took = t.elapsed();
    let r = r.unwrap_or_else(|_| panic!("no answer after {took:?} on a 2 s deadline"));
    let e = r.expect_err("the router is stopped");
    eprintln!("a 2 s call to a stopped router returned after {took:?}: {e}");
    assert_eq!(e.code(), Some(ErrorCode::DeadlineExceeded), "{e}");
    // Never before the deadline; that its own timer ended it is the error's kind
    // (DeadlineExceeded, not a keepalive's Unresponsive); the 60 s watchdog is the hang guard.
    assert!(
        took >= Duration::from_secs(2),
        "a 2 s deadline returned after {took:?}"
    );
    assert!(e.to_string().contains(&up.frontend.to_string()), "{e}");
    // Stopped a while longer, then continued: the late answer is discarded, the client goes on.
    std::thread::sleep(Duration::from_millis(1500));
    up.signal(libc::SIGCONT);
    let again = rt.block_on(c.call(layer, &x, h, None, Some(Duration::from_secs(20))));
    assert_eq!(bits(&again.unwrap()), bits(&want));
    assert_eq!((c.in_flight(), c.ready()), (0, 0));
}

#[test]
fn a_failover_client_leaves_a_stopped_router_process_within_the_keepalive_bound() {
    // The one time bound is the keepalive's own, from below: the machine is shared.
    let _machine = crate::support::shared();
    // Two fabrics of the same model, seed and placement: either answers every call alike.
    let (a, b) = (Up::start(), Up::start());
    let spec = expertmesh_topology::model::preset_by_name("demo-small").unwrap();
    let h = spec.hidden as usize;
    let layer = spec.moe_layer_ids()[1];
    let rt = rt();
    let cfg = FrontendConfig::new("single-host");
    let opts = ClientOptions::default();
    let bound = opts.keepalive_interval + opts.keepalive_timeout;
    let routers = [a.frontend, b.frontend];
    let connect = RouterClient::connect_any(&routers, &cfg, opts);
    let mut c = rt.block_on(connect).unwrap();
    assert_eq!(c.peer_addr(), a.frontend);
    let x = reference::synthetic_hidden(11, 5, h);
    let want = rt.block_on(c.call(layer, &x, h, None, None)).unwrap();
    a.signal(libc::SIGSTOP);
    let t = Instant::now();
    let call = c.call(layer, &x, h, None, Some(Duration::from_secs(10)));
    let got = rt.block_on(async { tokio::time::timeout(Duration::from_secs(60), call).await });
    let took = t.elapsed();
    let got = got.unwrap_or_else(|_| panic!("no answer after {took:?}"));
    eprintln!("answered by the other router {took:?} after the first was stopped");
    assert_eq!(
        bits(&got.unwrap()),
        bits(&want),
        "answered by the other router"
    );
    assert_eq!((c.failovers(), c.peer_addr()), (1, b.frontend));
    // Not before the keepalive's bound; answered within the call's 10 s deadline after one
    // failover, so the keepalive (not the deadline) moved it: no upper bound of its own.
    assert!(took >= bound, "keepalive bound {bound:?}, took {took:?}");
    // Router a stays stopped: later calls go to b at once.
    // (What "at once" guarantees: no second failover, no wait on a; not a time budget.)
    let again = rt.block_on(c.call(layer, &x, h, None, None)).unwrap();
    assert_eq!(bits(&again), bits(&want));
    assert_eq!((c.failovers(), c.peer_addr()), (1, b.frontend));
}

/// A router draining before it stops (SIGTERM: `RouterService::drain`) refuses new requests
/// with ShuttingDown; a failover client then sends them to the other router, and a plain
/// client gets that code with the reason. Every answer is bit for bit the same.
#[test]
fn a_draining_router_hands_new_requests_to_the_next_router() {
    let _machine = crate::support::shared();
    let fabric = two_routers();
    let addrs: Vec<SocketAddr> = fabric.frontend_addrs().into_iter().flatten().collect();
    assert_eq!(addrs.len(), 2);
    let spec = fabric.deployment().spec.clone();
    let h = spec.hidden as usize;
    let layer = spec.moe_layer_ids()[0];
    let rt = rt();
    let cfg = fabric.frontend_config();
    let mut failover = rt
        .block_on(RouterClient::connect_any(
            &addrs,
            &cfg,
            ClientOptions::default(),
        ))
        .unwrap();
    let mut plain = rt.block_on(RouterClient::connect(addrs[0], &cfg)).unwrap();
    assert_eq!(failover.peer_addr(), addrs[0]);
    let x = reference::synthetic_hidden(31, 6, h);
    let deadline = Some(Duration::from_secs(60));
    let want = rt
        .block_on(failover.call(layer, &x, h, None, deadline))
        .unwrap();
    // Nothing is in flight: the drain ends at once, with nothing left unanswered.
    assert_eq!(fabric.router(0).unwrap().drain(Duration::from_secs(60)), 0);
    for _ in 0..3 {
        let got = rt
            .block_on(failover.call(layer, &x, h, None, deadline))
            .expect("answered by the other router");
        assert_eq!(bits(&got), bits(&want));
    }
    assert_eq!((failover.failovers(), failover.peer_addr()), (1, addrs[1]));
    let e = rt
        .block_on(plain.call(layer, &x, h, None, deadline))
        .expect_err("the draining router takes nothing new");
    assert_eq!(e.code(), Some(ErrorCode::ShuttingDown), "{e}");
    assert!(e.to_string().contains("draining"), "{e}");
}
