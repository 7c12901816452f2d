//! Fair overload through real processes (issue 15, items 4 and 5): `expertmesh up` (the router
//! in that process, two CPU workers as child processes) on free loopback ports, loaded by real
//! frontend connections.
//!
//! * Pipelined greedy clients (16 connections × 16 requests of 256 tokens in flight) plus one
//!   modest client (one 32-token request at a time): the modest client keeps being served,
//!   the tokens answered per CPU second of the router and its workers stay above half of
//!   those of an unloaded run before and after (CPU seconds, not wall-clock ones: the figure
//!   does not move with what else the machine runs; speed itself is `bench fabric`'s) and its
//!   goodput above a fifth of theirs (a floor only a router stalled under the load falls
//!   through), the router's
//!   resident memory (`/proc/<pid>/status`) stays bounded under the load and returns near its
//!   baseline afterwards.
//! * Deadline isolation: a client whose requests carry a 1 µs deadline shares batches with a
//!   client whose requests carry the default one; only the first client's requests fail.
//!
//! The bounds are generous (the machine is a noisy shared VM) but each fails on a router that
//! reads and decodes every request before it sheds (memory rose by 500–700 MiB and stayed; its
//! goodput, measured then per wall-clock second, fell to 0.24 of the unloaded rate) or that
//! fails a merged batch at its members' shortest deadline (84% of the other client's requests
//! failed).

use expertmesh_benches::overload::{
    LoadReport, OverloadLoad, load_input, proc_memory, proc_tree_cpu_seconds, run_load,
};
use expertmesh_transport::codec::{self, Body, ErrorCode, LayerRequest};
use expertmesh_transport::dtype::ActivationDtype;
use expertmesh_transport::frontend::{FrameConnection, FrontendConfig, FrontendError};
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::support::{bin, free_pair, free_port, root, two_cpu_topology};

const HIDDEN: usize = 1024; // demo-small
const LAYER: u32 = 1;

/// `expertmesh up` running in its own process; stopped (SIGINT, then SIGKILL) on drop.
struct Up {
    child: Child,
    addr: SocketAddr,
    /// Where `up`'s stderr goes, when not to the test's ([`Up::start_logged`]).
    log: Option<std::path::PathBuf>,
    _dir: tempfile::TempDir,
}

impl Up {
    fn start() -> Up {
        Self::start_with(&[])
    }

    /// `up` with `extra` arguments.
    fn start_with(extra: &[&str]) -> Up {
        Self::start_as(extra, false)
    }

    /// `up` with `extra` arguments, its stderr kept in a file ([`Up::log`]).
    fn start_logged(extra: &[&str]) -> Up {
        Self::start_as(extra, true)
    }

    fn start_as(extra: &[&str], logged: bool) -> Up {
        let dir = tempfile::tempdir().unwrap();
        let log = logged.then(|| dir.path().join("up.stderr"));
        let stderr = match &log {
            Some(path) => Stdio::from(std::fs::File::create(path).unwrap()),
            None => Stdio::inherit(),
        };
        let topo = two_cpu_topology(
            &dir.path().join("overload.toml"),
            "single-host",
            free_port(),
            free_port(),
            free_pair(),
        );
        let mut child = Command::new(bin())
            .arg("up")
            .arg("--topology")
            .arg(&topo)
            .args(["--model", "demo-small"])
            .arg("--placement")
            .arg(root().join("examples/single-host-demo-small.placement.toml"))
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let addr = loop {
            let line = match lines.next() {
                Some(Ok(l)) => l,
                _ => {
                    let _ = child.kill();
                    panic!("expertmesh up exited before announcing its frontends");
                }
            };
            if let Some(rest) = line.trim().strip_prefix("frontends: ") {
                let a = rest.split_whitespace().next().unwrap();
                break a.parse::<SocketAddr>().unwrap();
            }
        };
        // Keep draining stdout so `up` never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines {});
        Up {
            child,
            addr,
            log,
            _dir: dir,
        }
    }

    /// What `up` has written to its stderr so far ([`Up::start_logged`]).
    fn log(&self) -> String {
        self.log
            .as_ref()
            .and_then(|p| std::fs::read_to_string(p).ok())
            .unwrap_or_default()
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// CPU seconds `up` (the router) and its worker processes have used (`None` where the
    /// kernel cannot list a process's children).
    fn cpu_seconds(&self) -> Option<f64> {
        proc_tree_cpu_seconds(self.pid())
    }

    fn rss_mib(&self) -> f64 {
        proc_memory(self.pid()).expect("router alive").rss_kib as f64 / 1024.0
    }
}

impl Drop for Up {
    fn drop(&mut self) {
        // SAFETY: kill with a valid signal on our own child's pid.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGINT) };
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(5) {
            if self.child.try_wait().ok().flatten().is_some() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A layer call of `tokens` deterministic f32 hidden states with a 20 s deadline: its body
/// and payload.
fn f32_request(id: u64, tokens: usize) -> (Body, Vec<u8>) {
    let x: Vec<f32> = (0..tokens * HIDDEN)
        .map(|i| ((i * 7919) % 2001) as f32 / 1000.0 - 1.0)
        .collect();
    crate::support::f32_layer_request(id, LAYER, HIDDEN, &x)
}

fn frontend() -> FrontendConfig {
    FrontendConfig::new("single-host")
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn load(
    greedy_clients: usize,
    depth: usize,
    modest_tokens: usize,
    deadline: Option<Duration>,
    secs: u64,
) -> OverloadLoad {
    OverloadLoad {
        greedy_clients,
        depth,
        tokens: 256,
        modest_tokens,
        layer: LAYER,
        hidden: HIDDEN,
        deadline,
        duration: Duration::from_secs(secs),
        // The load goes on until the modest client has 5 answers (a busy machine takes
        // longer to give them, not fewer): what is asserted is that it is served, not how
        // much fits in its seconds.
        modest_answers: 5,
        max_duration: Duration::from_secs(180),
    }
}

fn show(what: &str, r: &LoadReport, modest_tokens: usize) {
    eprintln!(
        "{what}: goodput {:.0} tokens/s over {:.1} s; greedy ok {} overloaded {} deadline {} other {}; modest ok {} failed {} ({:?}); peak RSS {:?} MiB",
        r.goodput(modest_tokens),
        r.seconds,
        r.ok_requests,
        r.overloaded,
        r.deadline_exceeded,
        r.other_failures,
        r.modest_ok,
        r.modest_failed,
        r.modest_first_error,
        r.rss_peak_kib.map(|k| k / 1024)
    );
}

#[test]
fn pipelined_greedy_clients_keep_goodput_fairness_and_memory_bounded() {
    let _machine = crate::support::alone();
    // Saturated, every admitted request waits behind the others' admitted work: on this 2-vCPU
    // VM the default 2048 in-flight tokens are 7-9 s of it (5 modest calls took 46-49 s), close
    // to the default 10 s deadline, and one run lost 2 of 5 modest calls to it. What is asserted
    // is that the modest client is served, not how fast this machine drains the queue: the
    // requests that carry no deadline get 30 s.
    let up = Up::start_with(&["--deadline-ms", "30000"]);
    let rt = rt();
    let cfg = frontend();
    // Warm up (first allocations, links), then the unloaded work: one client, two in flight.
    // Each phase is weighed by the CPU seconds the router and its workers spent on it, not by
    // its wall-clock seconds: what a router that wastes work under overload loses is tokens
    // per CPU second, and that does not move with whatever else this machine runs (a rate per
    // wall-clock second does: this test's own load generator shares the cores).
    // (A router that stalls rather than works, which CPU seconds cannot see, is caught by the
    // looser wall-clock floor below.)
    let phase = |what: &str, l: OverloadLoad, modest_tokens: usize, pid: Option<u32>| {
        let cpu = up.cpu_seconds();
        let r = rt.block_on(run_load(up.addr, &cfg, &l, pid)).unwrap();
        let cpu = up
            .cpu_seconds()
            .zip(cpu)
            .map(|(after, before)| after - before);
        let tokens = r.ok_tokens + r.modest_ok * modest_tokens as u64;
        eprintln!("{what}: {tokens} tokens answered for {cpu:.2?} CPU s of the router and workers");
        show(what, &r, modest_tokens);
        let per_cpu = cpu.map(|cpu| tokens as f64 / cpu.max(0.01));
        (r, per_cpu)
    };
    phase("warm-up", load(1, 2, 0, None, 1), 0, None);
    let baseline = up.rss_mib();
    let (unloaded, unloaded_per_cpu) = phase("unloaded", load(1, 2, 0, None, 3), 0, None);
    let modest = 32;
    let (loaded, loaded_per_cpu) = phase(
        "16 x 16 pipelined + modest",
        load(16, 16, modest, None, 6),
        modest,
        Some(up.pid()),
    );
    // The unloaded work again after the load: the ratio below compares the load with both
    // sides of it.
    let (unloaded_after, after_per_cpu) = phase("unloaded, after", load(1, 2, 0, None, 3), 0, None);
    // The memory returns once the queued work is done: look every 100 ms for up to 10 s (a
    // busy machine gets longer, an idle one does not wait out a fixed pause).
    let settled = Instant::now();
    let mut after = up.rss_mib();
    while after > baseline + 64.0 && settled.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(100));
        after = up.rss_mib();
    }
    let peak = loaded.rss_peak_kib.unwrap() as f64 / 1024.0;
    let hwm = proc_memory(up.pid()).unwrap().hwm_kib as f64 / 1024.0;
    eprintln!(
        "router RSS: baseline {baseline:.0} MiB, peak under load {peak:.0} MiB (VmHWM {hwm:.0}), {after:.0} MiB {:.1} s after",
        settled.elapsed().as_secs_f64()
    );
    let ratio = match (loaded_per_cpu, unloaded_per_cpu, after_per_cpu) {
        (Some(l), Some(u), Some(a)) => Some(l / ((u + a) / 2.0)),
        _ => None,
    };
    let wall = loaded.goodput(modest) / ((unloaded.goodput(0) + unloaded_after.goodput(0)) / 2.0);
    eprintln!(
        "under overload / unloaded: tokens answered per CPU second {ratio:.2?}, per second {wall:.2}"
    );

    let modest_total = loaded.modest_ok + loaded.modest_failed;
    // At most one in ten fails, and one failure is allowed in a short sample: the run stops
    // after 5 modest answers, and on a 2-vCPU machine one of them can meet its deadline behind
    // the greedy clients' work already queued on a worker (seen once here: 4 of 5).
    assert!(
        loaded.modest_ok >= 3 && loaded.modest_failed <= (modest_total / 10).max(1),
        "the modest client is served: at least 3 requests, at most one in ten (or one) fails ({} of {modest_total}; first failure {:?})",
        loaded.modest_ok,
        loaded.modest_first_error
    );
    match ratio {
        Some(ratio) => assert!(
            ratio >= 0.5,
            "tokens answered per CPU second of the router and its workers under overload stay at least half of those unloaded: {ratio:.2}"
        ),
        None => crate::support::say(
            "skipped: tokens per CPU second (this kernel does not list a process's children in /proc)",
        ),
    }
    // A floor far below what any run shows (0.86 here), bracketed by the unloaded runs: only
    // a router that stalls under overload (no CPU spent, nothing answered) falls through it.
    assert!(
        wall >= 0.2,
        "goodput under overload fell to {wall:.2} of the unloaded rate"
    );
    assert!(
        peak <= baseline + 256.0,
        "router memory under overload stays within baseline + 256 MiB: {peak:.0} MiB (baseline {baseline:.0})"
    );
    assert!(
        after <= baseline + 64.0,
        "router memory returns near its baseline within 10 s of the load (+64 MiB at most): {after:.0} MiB (baseline {baseline:.0})"
    );
}

/// Client A of the deadline test: `depth` requests of `tokens` tokens in flight on a raw
/// frontend connection, each with `deadline_us = 1` on the wire (the client library would give
/// such a request up before sending it), for `secs` seconds. Returns (outputs,
/// DeadlineExceeded refusals, other answers).
async fn one_microsecond_client(
    addr: SocketAddr,
    tokens: usize,
    depth: usize,
    secs: u64,
) -> (u64, u64, u64) {
    let conn = FrameConnection::connect(addr, &frontend()).await.unwrap();
    let (mut reader, mut writer) = conn.split();
    let payload: Vec<u8> = load_input(tokens, HIDDEN, 5)
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let end = Instant::now() + Duration::from_secs(secs);
    let (mut sent, mut in_flight, mut tally) = (0u64, 0usize, (0, 0, 0));
    loop {
        if Instant::now() < end && in_flight < depth {
            sent += 1;
            let req = LayerRequest {
                request_id: sent,
                layer: LAYER,
                tokens: tokens as u32,
                hidden: HIDDEN as u32,
                dtype: ActivationDtype::F32,
                logit_experts: 0,
                deadline_us: 1,
            };
            writer
                .write_frame(&Body::LayerRequest(req), &payload)
                .await
                .unwrap();
            in_flight += 1;
            continue;
        }
        if in_flight == 0 {
            return tally;
        }
        let frame = reader.read_frame().await.unwrap();
        in_flight -= 1;
        match frame.body() {
            Body::LayerResponse(_) => tally.0 += 1,
            Body::Error(e) if e.code == ErrorCode::DeadlineExceeded => tally.1 += 1,
            _ => tally.2 += 1,
        }
    }
}

#[test]
fn a_short_deadline_fails_only_its_own_requests() {
    let _machine = crate::support::alone();
    let up = Up::start();
    let rt = rt();
    // Client A: 8 requests of 32 tokens in flight, each with a 1 µs deadline. Client B (the
    // "modest" client of the load): one 32-token request at a time with the router's default
    // deadline. The router batches the two clients' requests together (a batch holds up to
    // 256 tokens and goes as soon as both connections have a request in it).
    let b = load(0, 0, 32, None, 6);
    let ((a_ok, a_deadline, a_other), r) = rt.block_on(async {
        let a = tokio::spawn(one_microsecond_client(up.addr, 32, 8, 6));
        let r = run_load(up.addr, &frontend(), &b, None).await.unwrap();
        (a.await.unwrap(), r)
    });
    eprintln!(
        "deadline 1 us (A): {a_ok} answered, {a_deadline} DeadlineExceeded, {a_other} other; default deadline (B): {} ok, {} failed ({:?})",
        r.modest_ok, r.modest_failed, r.modest_first_error
    );
    assert!(
        a_deadline > 0 && a_ok == 0 && a_other == 0,
        "client A's requests fail with DeadlineExceeded: {a_ok} answered, {a_deadline} DeadlineExceeded, {a_other} other"
    );
    assert!(
        r.modest_ok >= 5 && r.modest_failed == 0,
        "every one of client B's requests succeeds ({} ok, {} failed; first failure {:?})",
        r.modest_ok,
        r.modest_failed,
        r.modest_first_error
    );
}

/// A frontend that stops in the middle of an admitted request's payload (a client host that
/// died mid-frame) holds that request's share of the router's capacity only until the frame
/// timeout: the router closes its connection and gives the share back. Here the stalled
/// request is 64 tokens, the router's whole `--max-inflight-tokens`, so a 64-token call on
/// another connection is served only once the share is back. Without the timeout the stalled
/// connection stays open (this test's 60 s cap).
#[test]
fn a_request_stalled_mid_frame_gives_its_share_back() {
    let _machine = crate::support::shared();
    let up = Up::start_with(&[
        "--frontend-frame-timeout-s",
        "1",
        "--max-tokens",
        "64",
        "--max-inflight-tokens",
        "64",
    ]);
    let rt = rt();
    let cfg = frontend();
    let request = f32_request;
    rt.block_on(async {
        let mut stalled = FrameConnection::connect(up.addr, &cfg).await.unwrap();
        let (body, payload) = request(1, 64);
        let mut head = Vec::new();
        codec::encode_head(&body, &payload, &cfg.codec, &mut head).unwrap();
        stalled.write_raw(&head).await.unwrap();
        stalled
            .write_raw(&payload[..payload.len() / 2])
            .await
            .unwrap();
        let end = tokio::time::timeout(Duration::from_secs(60), stalled.read_frame())
            .await
            .expect("the router still holds a request stalled mid-frame after 60 s");
        assert!(end.is_err(), "no answer to half a request: {end:?}");

        let mut other = FrameConnection::connect(up.addr, &cfg).await.unwrap();
        let (body, payload) = request(2, 64);
        other.write_frame(&body, &payload).await.unwrap();
        let answer = tokio::time::timeout(Duration::from_secs(60), other.read_frame())
            .await
            .expect("no answer within 60 s")
            .unwrap();
        assert!(
            matches!(answer.body(), Body::LayerResponse(r) if r.request_id == 2 && r.tokens == 64),
            "the whole capacity is free again: {:?}",
            answer.body()
        );
    });
}

/// A frontend that sends requests and never reads its answers: once an answer has waited the
/// idle timeout for it, the router shuts its connection down (before, the router's writes and
/// its reader, waiting for the answers' places, waited on it for ever, holding the socket and
/// the answers). The router goes on serving others.
#[test]
fn a_client_that_never_takes_its_answers_is_closed_after_the_idle_timeout() {
    let _machine = crate::support::shared();
    let up = Up::start_logged(&["--frontend-idle-timeout-s", "1", "--max-tokens", "64"]);
    let rt = rt();
    let cfg = frontend();
    // 160 answers of 64 tokens (256 KiB each, 40 MiB): more than the sockets hold.
    let requests = 160u64;
    let (_, payload) = f32_request(0, 64);
    let request = |id: u64| f32_request(id, 64).0;
    let read = rt.block_on(async {
        let c = FrameConnection::connect(up.addr, &cfg).await.unwrap();
        let (mut r, mut w) = c.split();
        let sent = payload.clone();
        // The requests go out from a task of their own: the router stops reading them once
        // its answers' places are taken, and this write then waits until the end.
        let writer = tokio::spawn(async move {
            for id in 1..=requests {
                if w.write_frame(&request(id), &sent).await.is_err() {
                    break;
                }
            }
        });
        let waited = "a client that takes no answer";
        wait_for_log(
            &up,
            "its answers were not taken for the idle timeout",
            waited,
        )
        .await;
        let answers = answers_until_the_end(&mut r).await;
        let _ = tokio::time::timeout(Duration::from_secs(60), writer).await;
        answers
    });
    assert!(
        read < requests,
        "every answer was still delivered ({read}): the connection was not shut down"
    );
    serves_another(&rt, &up, &request(1), &payload);
}

/// Wait (up to 120 s) until `up`'s log says `line`; the panic names what was `waited` for.
async fn wait_for_log(up: &Up, line: &str, waited: &str) {
    let t0 = Instant::now();
    while !up.log().contains(line) {
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "the router still holds {waited} after 120 s:\n{}",
            up.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Read answers until the connection ends (within 60 s of the last frame); how many came.
async fn answers_until_the_end(r: &mut expertmesh_transport::frontend::FrameReader) -> u64 {
    let mut answers = 0u64;
    loop {
        match tokio::time::timeout(Duration::from_secs(60), r.read_frame()).await {
            Ok(Ok(f)) if matches!(f.body(), Body::LayerResponse(_)) => answers += 1,
            Ok(Ok(_)) => {}
            Ok(Err(_)) => return answers,
            Err(_) => panic!("the connection did not end within 60 s"),
        }
    }
}

/// The router goes on serving: a new connection's request (`body`, `payload`) is answered.
fn serves_another(rt: &tokio::runtime::Runtime, up: &Up, body: &Body, payload: &[u8]) {
    let answer = rt.block_on(async {
        let mut c = FrameConnection::connect(up.addr, &frontend())
            .await
            .unwrap();
        c.write_frame(body, payload).await.unwrap();
        c.read_frame().await.unwrap()
    });
    assert!(
        matches!(answer.body(), Body::LayerResponse(_)),
        "{:?}",
        answer.body()
    );
}

/// A frontend that sends its requests, closes its sending side and then never reads: once the
/// router has answered them (or their deadlines passed), it waits the frame timeout for the
/// answers to be taken and then shuts the connection down (`finish_writes`), instead of
/// holding the socket and the answers for ever. Here each answer (4,096 tokens, 16 MiB) is
/// more than the sockets hold, so one computed in time is enough; the router goes on serving
/// others.
#[test]
fn a_client_done_sending_that_never_reads_is_closed_after_the_frame_timeout() {
    let _machine = crate::support::shared();
    // A frame timeout of 3 s: each 16 MiB request frame must arrive within it of its header
    // while the workers keep both cores busy (milliseconds over loopback).
    let up = Up::start_logged(&[
        "--frontend-frame-timeout-s",
        "3",
        "--max-tokens",
        "4096",
        "--max-inflight-tokens",
        "16384",
    ]);
    let rt = rt();
    let cfg = frontend();
    let (requests, tokens) = (4u64, 4096);
    let (_, payload) = f32_request(0, tokens);
    let request = |id: u64| {
        let (mut body, _) = f32_request(id, tokens);
        if let Body::LayerRequest(r) = &mut body {
            // The router waits for the answers (or this deadline and a grace of 5 s) before
            // the frame timeout starts; a DeadlineExceeded answer is small, but one of the four
            // computed within it already fills the sockets. Answers computed sooner end the
            // wait sooner: a long deadline costs a fast machine nothing.
            r.deadline_us = 300_000_000;
        }
        body
    };
    let read = rt.block_on(async {
        let c = FrameConnection::connect(up.addr, &cfg).await.unwrap();
        let (mut r, mut w) = c.split();
        for id in 1..=requests {
            w.write_frame(&request(id), &payload).await.unwrap();
        }
        drop(w); // done sending
        let waited = "a client done sending that takes no answer";
        wait_for_log(&up, "an answer was not taken within", waited).await;
        answers_until_the_end(&mut r).await
    });
    assert!(
        read < requests,
        "every answer was still delivered ({read}): the connection was not shut down"
    );
    serves_another(&rt, &up, &request(1), &payload);
}

/// A frontend that sends its requests and then closes its side of the connection (done
/// sending: `shutdown(SHUT_WR)`, which dropping the write half does) still gets every answer,
/// then the end of the stream.
#[test]
fn a_client_that_closes_its_sending_side_gets_every_answer() {
    let _machine = crate::support::shared();
    let up = Up::start();
    let rt = rt();
    let cfg = frontend();
    let requests = 8u64;
    let (mut ids, end) = rt.block_on(async {
        let c = FrameConnection::connect(up.addr, &cfg).await.unwrap();
        let (mut r, mut w) = c.split();
        for id in 1..=requests {
            let (body, payload) = f32_request(id, 16);
            w.write_frame(&body, &payload).await.unwrap();
        }
        drop(w);
        let mut ids = Vec::new();
        let end = loop {
            let read = tokio::time::timeout(Duration::from_secs(60), r.read_frame()).await;
            match read.expect("the connection neither answered nor ended within 60 s") {
                Ok(f) => match f.body() {
                    Body::LayerResponse(answer) => ids.push(answer.request_id),
                    other => panic!("not an answer: {other:?}"),
                },
                Err(e) => break e,
            }
        };
        (ids, end)
    });
    ids.sort_unstable();
    assert_eq!(
        ids,
        (1..=requests).collect::<Vec<_>>(),
        "answers before the end ({end})"
    );
    assert!(
        matches!(end, FrontendError::Closed { .. }),
        "the router ends the stream cleanly after the answers: {end}"
    );
}

/// Answers, or refusals, the router has given: `responses_total` plus every `errors_total`.
fn handled(metrics: &str) -> (f64, f64) {
    let (_, body) = crate::metrics::http_get(metrics);
    let s = crate::metrics::Scrape::parse(&body);
    (
        s.sum("expertmesh_router_responses_total", &[])
            + s.sum("expertmesh_router_errors_total", &[]),
        s.sum("expertmesh_router_errors_total", &[("code", "overloaded")]),
    )
}

/// The most bytes loopback TCP can hold between a router that writes and a client that does
/// not read: the largest send buffer plus the largest receive buffer (`tcp_wmem`,
/// `tcp_rmem`), or `None` where they cannot be read.
fn socket_buffer_bytes() -> Option<u64> {
    let max = |f: &str| -> Option<u64> {
        let text = std::fs::read_to_string(f).ok()?;
        text.split_whitespace().last()?.parse().ok()
    };
    Some(max("/proc/sys/net/ipv4/tcp_wmem")? + max("/proc/sys/net/ipv4/tcp_rmem")?)
}

/// A frontend's untaken answers hold its share of the router's capacity until they are
/// written: a client that sends one request at a time, each after the router has answered
/// the one before, and reads none, is refused (`Overloaded`) once its untaken answers are
/// more than the sockets hold plus the router's capacity (one request), instead of the router
/// keeping up to 32 answers per connection (the connection's places) outside admission.
/// Nothing here depends on how fast the machine is: every request goes after the one before
/// is answered.
#[test]
fn untaken_answers_hold_their_share_of_the_capacity_until_written() {
    let _machine = crate::support::shared();
    // Answers large enough that the sockets hold at most 16 of them: 4 MiB (1,024 tokens) or
    // 12 MiB (3,072 tokens, a frame's worth).
    let buffers = socket_buffer_bytes();
    let tokens = match buffers {
        Some(b) if b <= 64 << 20 => 1024,
        Some(b) if b <= 192 << 20 => 3072,
        _ => {
            crate::support::say(&format!(
                "skipped: loopback socket buffers ({buffers:?} bytes) hold more than 16 of the \
                 largest answers"
            ));
            return;
        }
    };
    // `up --metrics P` serves the router at P and its two workers at P+1 and P+2.
    let port = expertmesh_transport::ports::free_loopback_ports(3).expect("three free ports");
    let metrics = format!("http://127.0.0.1:{port}/metrics");
    let listen = metrics
        .trim_start_matches("http://")
        .trim_end_matches("/metrics");
    let tokens_arg = tokens.to_string();
    let up = Up::start_with(&[
        "--max-tokens",
        &tokens_arg,
        "--max-inflight-tokens",
        &tokens_arg,
        "--deadline-ms",
        "60000",
        "--metrics",
        listen,
    ]);
    let rt = rt();
    let (body, payload) = f32_request(0, tokens);
    let request = |id: u64| match &body {
        Body::LayerRequest(r) => Body::LayerRequest(LayerRequest {
            request_id: id,
            ..*r
        }),
        other => unreachable!("{other:?}"),
    };
    // At most 30 requests: fewer than the connection's 32 places (the router reads every one
    // whatever it does with their answers), more than the sockets (at most 16 answers) and
    // one share hold.
    let most = 30u64;
    let (sent, refused) = rt.block_on(async {
        let c = FrameConnection::connect(up.addr, &frontend())
            .await
            .unwrap();
        let (_reader, mut w) = c.split();
        let (before, _) = handled(&metrics);
        let mut sent = 0u64;
        while sent < most {
            sent += 1;
            w.write_frame(&request(sent), &payload).await.unwrap();
            // Until the router has answered (or refused) it: 60 s, a hang guard.
            let t0 = Instant::now();
            loop {
                let (now, refused) = handled(&metrics);
                if refused > 0.0 {
                    return (sent, refused);
                }
                if now >= before + sent as f64 {
                    break;
                }
                assert!(
                    t0.elapsed() < Duration::from_secs(60),
                    "request {sent} not answered within 60 s"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        (sent, 0.0)
    });
    println!("refused at request {sent} of at most {most} ({refused} refusals)");
    assert!(
        refused > 0.0,
        "{most} answers of {tokens} tokens left untaken, one after another, and none refused: \
         untaken answers do not count against the connection's share"
    );
    // Once the router has seen the first connection close (soon, not at once), a new one is
    // admitted within its guaranteed share: retried until then (60 s, a hang guard).
    let t0 = Instant::now();
    let answer = loop {
        let answer = rt.block_on(async {
            let mut c = FrameConnection::connect(up.addr, &frontend())
                .await
                .unwrap();
            c.write_frame(&request(1), &payload).await.unwrap();
            let read = tokio::time::timeout(Duration::from_secs(60), c.read_frame()).await;
            read.expect("an answer within 60 s").unwrap()
        });
        let overloaded = matches!(answer.body(), Body::Error(e) if e.code == ErrorCode::Overloaded);
        if !overloaded || t0.elapsed() > Duration::from_secs(60) {
            break answer;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(
        matches!(answer.body(), Body::LayerResponse(_)),
        "a new connection after the one that read nothing closed: {:?}",
        answer.body()
    );
}
