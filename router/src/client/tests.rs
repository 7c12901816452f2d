//! The client against a scripted router over real sockets: answers out of order, error frames
//! for one request, the in-flight bound, a connection that breaks with requests in flight,
//! dropped handles, and futures cancelled in the middle of a frame.
//!
//! Why here and not against the real fabric: the order, timing and failures of the answers
//! are chosen by the test, so every case is deterministic. (`tests/it/client_pipelining.rs` runs
//! the same API against the real router and workers.)

use super::*;
use expertmesh_transport::codec::{self, LayerResponse};
use expertmesh_transport::dtype::OutputDtype;
use expertmesh_transport::frontend::FrameListener;
use std::future::Future;
use std::time::Duration;

/// A hang guard for each test (a busy machine is slow; no test is near it).
const T: Duration = Duration::from_secs(120);
const H: usize = 64;
/// Requests for this layer are refused with `NotFound`.
const BAD_LAYER: u32 = 99;

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Run a test body on a fresh runtime, failing it after [`T`] instead of hanging.
fn run<F: Future<Output = ()>>(f: F) {
    rt().block_on(async { tokio::time::timeout(T, f).await.expect("test timed out") });
}

/// A router stand-in: each connection runs `script` (one task per connection).
async fn serve<S, F>(script: S) -> (SocketAddr, FrontendConfig)
where
    S: Fn(FrameConnection) -> F + Send + Sync + 'static,
    F: Future<Output = ()> + Send + 'static,
{
    serve_with(FrontendConfig::new("client-tests"), script).await
}

/// [`serve`] with connection settings `cfg`.
async fn serve_with<S, F>(cfg: FrontendConfig, script: S) -> (SocketAddr, FrontendConfig)
where
    S: Fn(FrameConnection) -> F + Send + Sync + 'static,
    F: Future<Output = ()> + Send + 'static,
{
    let listener = FrameListener::bind("127.0.0.1:0".parse().unwrap(), cfg.clone())
        .await
        .unwrap();
    let addr = listener.local_addr().unwrap();
    let script = Arc::new(script);
    tokio::spawn(async move {
        while let Ok(incoming) = listener.accept().await {
            let script = script.clone();
            tokio::spawn(async move {
                if let Ok(conn) = incoming.handshake().await {
                    script(conn).await;
                }
            });
        }
    });
    (addr, cfg)
}

/// A request the scripted router read.
struct Req {
    req: LayerRequest,
    x: Vec<f32>,
}

/// The next request, answering keepalive probes on the way as a router does (they are
/// refused at once with `NotFound`).
async fn read_req(conn: &mut FrameConnection) -> Option<Req> {
    loop {
        let f = conn.read_frame().await.ok()?;
        let Body::LayerRequest(req) = f.body().clone() else {
            panic!("expected a layer request, got {:?}", f.body());
        };
        if req.layer == liveness::PROBE_LAYER {
            let m = "past the model's last layer";
            let _ = conn.write_frame(&refusal(req.request_id, m), &[]).await;
            continue;
        }
        return Some(decode_req(req, f.payload()));
    }
}

fn refusal(request_id: u64, message: &str) -> Body {
    Body::Error(codec::ErrorFrame {
        request_id,
        part: None,
        code: ErrorCode::NotFound,
        message: message.into(),
    })
}

fn decode_req(req: LayerRequest, payload: &[u8]) -> Req {
    let (t, h) = (req.tokens as usize, req.hidden as usize);
    let mut x = vec![0f32; t * h];
    dtype::decode_activations(req.dtype, t, h, &payload[req.hidden_range()], &mut x).unwrap();
    Req { req, x }
}

/// The scripted router's answer: `2·x + layer`, or `NotFound` for [`BAD_LAYER`].
fn answer_bytes(r: &Req, cfg: &FrontendConfig) -> Vec<u8> {
    let id = r.req.request_id;
    if r.req.layer == BAD_LAYER {
        let body = Body::Error(codec::ErrorFrame {
            request_id: id,
            part: None,
            code: ErrorCode::NotFound,
            message: format!("layer {BAD_LAYER} is not served"),
        });
        return codec::encode_frame(&body, &[], &cfg.codec).unwrap();
    }
    let y: Vec<f32> = r.x.iter().map(|v| 2.0 * v + r.req.layer as f32).collect();
    let mut out = vec![0u8; y.len() * 4];
    dtype::encode_output(OutputDtype::F32, &y, &mut out).unwrap();
    let body = Body::LayerResponse(LayerResponse {
        request_id: id,
        tokens: r.req.tokens,
        hidden: r.req.hidden,
        dtype: OutputDtype::F32,
    });
    codec::encode_frame(&body, &out, &cfg.codec).unwrap()
}

async fn answer(conn: &mut FrameConnection, r: &Req) {
    let cfg = FrontendConfig::new("client-tests");
    let _ = conn.write_raw(&answer_bytes(r, &cfg)).await;
}

/// Reads requests in groups of `group` and answers each group in reverse order.
async fn reverse_groups(mut conn: FrameConnection, group: usize) {
    let mut held = Vec::new();
    while let Some(r) = read_req(&mut conn).await {
        held.push(r);
        if held.len() == group {
            for r in held.drain(..).rev() {
                answer(&mut conn, &r).await;
            }
        }
    }
}

fn input(seed: usize, tokens: usize) -> Vec<f32> {
    (0..tokens * H)
        .map(|i| ((i * 7 + seed * 13) % 23) as f32 * 0.25 - 2.0)
        .collect()
}

fn expected(x: &[f32], layer: u32) -> Vec<f32> {
    x.iter().map(|v| 2.0 * v + layer as f32).collect()
}

async fn client(addr: SocketAddr, cfg: &FrontendConfig) -> RouterClient {
    RouterClient::connect(addr, cfg).await.unwrap()
}

#[test]
fn answers_in_any_order_reach_their_handles_and_a_refusal_fails_only_its_own() {
    run(async {
        let (addr, cfg) = serve(|c| reverse_groups(c, 4)).await;
        let mut c = client(addr, &cfg).await;
        let xs: Vec<Vec<f32>> = (0..4).map(|i| input(i, i + 1)).collect();
        let layers = [1, BAD_LAYER, 3, 4];
        let mut handles = Vec::new();
        for (x, &layer) in xs.iter().zip(&layers) {
            handles.push(c.submit(layer, x, H, None, None).await.unwrap());
        }
        assert_eq!(c.in_flight(), 4);
        // Wait in submission order; the router answers 4, 3, 2, 1.
        let mut it = handles.into_iter();
        let h0 = it.next().unwrap();
        assert_eq!(h0.output_len(), H);
        assert_eq!(c.wait(h0).await.unwrap(), expected(&xs[0], 1));
        assert_eq!((c.in_flight(), c.ready()), (0, 3), "the others are held");
        let e = c.wait(it.next().unwrap()).await.unwrap_err();
        assert_eq!(e.code(), Some(ErrorCode::NotFound), "{e}");
        let mut out = vec![0f32; 3 * H];
        c.wait_into(it.next().unwrap(), &mut out).await.unwrap();
        assert_eq!(out, expected(&xs[2], 3));
        assert_eq!(
            c.wait(it.next().unwrap()).await.unwrap(),
            expected(&xs[3], 4)
        );
        assert_eq!((c.in_flight(), c.ready()), (0, 0));
    });
}

#[test]
fn typed_inputs_are_sent_in_their_dtype() {
    run(async {
        let (addr, cfg) = serve(|c| reverse_groups(c, 1)).await;
        let mut c = client(addr, &cfg).await;
        // 1.5 and -0.25 are exact in bf16 and f16.
        let bf = [half_bits_bf16(1.5), half_bits_bf16(-0.25)].repeat(H / 2);
        let h = c
            .submit(2, HiddenStates::Bf16Bits(&bf), H, None, None)
            .await;
        let want: Vec<f32> = [1.5f32, -0.25].repeat(H / 2);
        assert_eq!(c.wait(h.unwrap()).await.unwrap(), expected(&want, 2));
        let f16 = [0x3e00u16, 0xb400].repeat(H / 2); // 1.5, -0.25
        let h = c
            .submit(2, HiddenStates::F16Bits(&f16), H, None, None)
            .await;
        assert_eq!(c.wait(h.unwrap()).await.unwrap(), expected(&want, 2));
    });
}

/// A deadline too long for the clock (`Duration::MAX`, as `keepalive_interval` takes for
/// "never") is no deadline in practice: the call is answered, nothing overflows.
#[test]
fn a_deadline_of_duration_max_is_served_not_an_overflow() {
    run(async {
        let (addr, cfg) = serve(|c| reverse_groups(c, 1)).await;
        let mut c = client(addr, &cfg).await;
        let x = input(0, 2);
        let h = c.submit(5, &x, H, None, Some(Duration::MAX)).await.unwrap();
        assert_eq!(c.wait(h).await.unwrap(), expected(&x, 5));
    });
}

fn half_bits_bf16(v: f32) -> u16 {
    (v.to_bits() >> 16) as u16 // exact for the values used
}

#[test]
fn the_in_flight_limit_makes_submit_wait_not_fail() {
    run(async {
        // The router answers only once it holds 3 requests: a client limited to 3 in flight
        // must read answers before its 4th submit, or it would never get one.
        let (addr, cfg) = serve(|c| reverse_groups(c, 3)).await;
        let mut c = client(addr, &cfg).await;
        c.set_max_in_flight(3);
        let xs: Vec<Vec<f32>> = (0..12).map(|i| input(i, 1 + i % 3)).collect();
        let mut handles = Vec::new();
        for x in &xs {
            handles.push(c.submit(5, x, H, None, None).await.unwrap());
            assert!(c.in_flight() <= 3);
        }
        // Wait in an order unrelated to the answers'.
        let order = [7, 0, 11, 3, 5, 9, 1, 2, 10, 4, 8, 6];
        let mut slots: Vec<Option<CallHandle>> = handles.into_iter().map(Some).collect();
        for i in order {
            let h = slots[i].take().unwrap();
            assert_eq!(c.wait(h).await.unwrap(), expected(&xs[i], 5), "request {i}");
        }
        assert_eq!((c.in_flight(), c.ready()), (0, 0));
    });
}

#[test]
fn a_broken_connection_fails_every_request_in_flight_with_the_same_error() {
    run(async {
        // Answers the second request, then closes.
        let (addr, cfg) = serve(|mut conn| async move {
            let mut reqs = Vec::new();
            for _ in 0..3 {
                reqs.push(read_req(&mut conn).await.unwrap());
            }
            answer(&mut conn, &reqs[1]).await;
        })
        .await;
        let mut c = client(addr, &cfg).await;
        let xs: Vec<Vec<f32>> = (0..3).map(|i| input(i, 2)).collect();
        let mut hs = Vec::new();
        for x in &xs {
            hs.push(c.submit(7, x, H, None, None).await.unwrap());
        }
        let h2 = hs.pop().unwrap();
        let h1 = hs.pop().unwrap();
        let e0 = c.wait(hs.pop().unwrap()).await.unwrap_err();
        assert!(
            matches!(e0, ClientError::Transport(FrontendError::Closed { .. })),
            "{e0}"
        );
        let e2 = c.wait(h2).await.unwrap_err();
        assert_eq!(e2.to_string(), e0.to_string());
        assert_eq!(
            c.wait(h1).await.unwrap(),
            expected(&xs[1], 7),
            "an answer that came before the break stays valid"
        );
        let e = c.submit(7, &xs[0], H, None, None).await.unwrap_err();
        assert_eq!(e.to_string(), e0.to_string());
        let e = c.call(7, &xs[0], H, None, None).await.unwrap_err();
        assert_eq!(e.to_string(), e0.to_string());
    });
}

#[test]
fn dropped_handles_free_their_slot_and_leave_no_answer_behind() {
    run(async {
        let (addr, cfg) = serve(|c| reverse_groups(c, 3)).await;
        let mut c = client(addr, &cfg).await;
        let xs: Vec<Vec<f32>> = (0..6).map(|i| input(i, 1)).collect();
        // Dropped while in flight: discarded when answered.
        let a = c.submit(1, &xs[0], H, None, None).await.unwrap();
        let b = c.submit(1, &xs[1], H, None, None).await.unwrap();
        drop(a);
        let d = c.submit(1, &xs[2], H, None, None).await.unwrap();
        drop(d);
        assert_eq!(c.in_flight(), 3, "the router still computes them");
        // The router answers d, b, a: d's answer is discarded on the way to b's, a's is still
        // on the wire (and is discarded by the next wait).
        assert_eq!(c.wait(b).await.unwrap(), expected(&xs[1], 1));
        assert_eq!((c.in_flight(), c.ready()), (1, 0));
        // Dropped after its answer was held: freed at the next call.
        let e = c.submit(1, &xs[3], H, None, None).await.unwrap();
        let f = c.submit(1, &xs[4], H, None, None).await.unwrap();
        let g = c.submit(1, &xs[5], H, None, None).await.unwrap();
        assert_eq!(c.wait(e).await.unwrap(), expected(&xs[3], 1));
        assert_eq!(c.ready(), 2);
        drop(f);
        assert_eq!(c.wait(g).await.unwrap(), expected(&xs[5], 1));
        assert_eq!((c.in_flight(), c.ready()), (0, 0));
    });
}

#[test]
fn wrong_buffers_and_foreign_handles_are_refused_and_the_connection_goes_on() {
    run(async {
        let (addr, cfg) = serve(|c| reverse_groups(c, 1)).await;
        let mut c = client(addr, &cfg).await;
        let mut other = client(addr, &cfg).await;
        let x = input(1, 2);
        let h = c.submit(3, &x, H, None, None).await.unwrap();
        let mut short = vec![0f32; 2 * H - 1];
        let e = c.wait_into(h, &mut short).await.unwrap_err();
        assert!(matches!(e, ClientError::Usage(_)), "{e}");
        assert!(e.to_string().contains("2 tokens x 64 = 128"), "{e}");
        let h = c.submit(3, &x, H, None, None).await.unwrap();
        let e = other.wait(h).await.unwrap_err();
        assert!(matches!(e, ClientError::Usage(_)), "{e}");
        assert!(e.to_string().contains("another RouterClient"), "{e}");
        assert_eq!(c.call(3, &x, H, None, None).await.unwrap(), expected(&x, 3));
        assert_eq!((c.in_flight(), c.ready()), (0, 0));
        assert_eq!(
            other.call(4, &x, H, None, None).await.unwrap(),
            expected(&x, 4)
        );
        // Input that cannot be encoded is refused before anything is sent.
        let e = c.submit(3, &x[..H + 1], H, None, None).await.unwrap_err();
        assert!(matches!(e, ClientError::Input(_)), "{e}");
        assert_eq!(c.in_flight(), 0);
    });
}

#[test]
fn a_wait_cancelled_in_the_middle_of_a_frame_leaves_the_stream_framed() {
    run(async {
        // Answers the first request in two halves 2 s apart, then the second.
        let (addr, cfg) = serve(|mut conn| async move {
            let cfg = FrontendConfig::new("client-tests");
            let r1 = read_req(&mut conn).await.unwrap();
            let r2 = read_req(&mut conn).await.unwrap();
            let bytes = answer_bytes(&r1, &cfg);
            let (head, tail) = bytes.split_at(bytes.len() / 2);
            conn.write_raw(head).await.unwrap();
            tokio::time::sleep(Duration::from_secs(2)).await;
            conn.write_raw(tail).await.unwrap();
            answer(&mut conn, &r2).await;
            while read_req(&mut conn).await.is_some() {}
        })
        .await;
        let mut c = client(addr, &cfg).await;
        let (x1, x2) = (input(1, 3), input(2, 2));
        let h1 = c.submit(1, &x1, H, None, None).await.unwrap();
        let h2 = c.submit(2, &x2, H, None, None).await.unwrap();
        let t = tokio::time::timeout(Duration::from_millis(100), c.wait(h1)).await;
        assert!(t.is_err(), "the first answer is still half-sent");
        assert_eq!(c.wait(h2).await.unwrap(), expected(&x2, 2));
        assert_eq!(
            (c.in_flight(), c.ready()),
            (0, 0),
            "the abandoned answer was discarded"
        );
    });
}

#[test]
fn a_submit_cancelled_in_the_middle_of_its_write_is_finished_by_the_next_call() {
    run(async {
        let (addr, cfg) = serve(|c| reverse_groups(c, 1)).await;
        let mut c = client(addr, &cfg).await;
        // 16 MiB of f32: more than the sockets take in one poll.
        let big = vec![0.5f32; 16 << 18];
        let t = tokio::time::timeout(Duration::ZERO, c.submit(1, &big, H, None, None)).await;
        drop(t); // cancelled mid-write, or (unlikely) done: either way the handle is dropped
        let x = input(3, 4);
        assert_eq!(c.call(6, &x, H, None, None).await.unwrap(), expected(&x, 6));
        assert_eq!((c.in_flight(), c.ready()), (0, 0));
    });
}

#[test]
fn a_request_too_large_to_frame_fails_at_submit_and_the_connection_goes_on() {
    run(async {
        let mut cfg = FrontendConfig::new("client-tests");
        cfg.codec.max_frame_bytes = 1 << 20;
        let (addr, cfg) = serve_with(cfg, |c| reverse_groups(c, 1)).await;
        let mut c = client(addr, &cfg).await;
        let big = vec![0.5f32; (1 << 18) + H]; // 1 MiB + a row of f32
        let e = c.submit(1, &big, H, None, None).await.unwrap_err();
        // Refused before its payload is copied, saying how many tokens fit.
        let per_token = H * 4;
        let fit = (1 << 20) / per_token - 1;
        assert!(
            matches!(&e, ClientError::Input(m) if m.contains(&format!("at most {fit} tokens"))),
            "{e}"
        );
        assert_eq!(c.in_flight(), 0, "nothing was sent");
        let x = input(2, 3);
        assert_eq!(c.call(2, &x, H, None, None).await.unwrap(), expected(&x, 2));
    });
}

/// Fast keepalive settings for the tests: a silent router is given up after 2.5 s (probes
/// every 500 ms, each given 2 s: the scripted router shares the client's runtime, so a stall
/// of this thread delays the probe's answer too; a busy machine's stalls stay well inside).
const QUICK_GIVE_UP: Duration = Duration::from_millis(2500);

fn quick() -> ClientOptions {
    ClientOptions {
        keepalive_interval: Duration::from_millis(500),
        keepalive_timeout: Duration::from_secs(2),
        connect_timeout: Duration::from_secs(2),
        min_backoff: Duration::from_millis(10),
        max_backoff: Duration::from_millis(100),
        ..ClientOptions::default()
    }
}

/// Reads requests (answering probes) and never answers them; closes after `hold`.
async fn swallow(mut conn: FrameConnection, hold: Duration) {
    let _ =
        tokio::time::timeout(hold, async { while read_req(&mut conn).await.is_some() {} }).await;
}

/// Reads frames and answers nothing, not even probes (a stopped process: the kernel still
/// takes the bytes).
async fn frozen(mut conn: FrameConnection) {
    while conn.read_frame().await.is_ok() {}
}

#[test]
fn a_deadline_is_kept_by_the_client_whatever_the_router_does_and_frees_the_slot() {
    run(async {
        // The first request is answered only after the call returned (the deadline comes
        // first by construction, however slow this machine); the rest at once.
        let returned = Arc::new(tokio::sync::Notify::new());
        let told = Arc::clone(&returned);
        let (addr, cfg) = serve(move |mut conn| {
            let told = Arc::clone(&told);
            async move {
                let Some(r1) = read_req(&mut conn).await else {
                    return;
                };
                told.notified().await;
                answer(&mut conn, &r1).await;
                while let Some(r) = read_req(&mut conn).await {
                    answer(&mut conn, &r).await;
                }
            }
        })
        .await;
        let mut c = client(addr, &cfg).await;
        c.set_max_in_flight(1);
        let x = input(1, 2);
        let t0 = std::time::Instant::now();
        let e = c
            .call(1, &x, H, None, Some(Duration::from_millis(200)))
            .await
            .unwrap_err();
        let took = t0.elapsed();
        assert_eq!(e.code(), Some(ErrorCode::DeadlineExceeded), "{e}");
        assert!(
            matches!(e, ClientError::Deadline { request_id: 1, .. }),
            "{e}"
        );
        assert!(
            e.to_string().contains(&addr.to_string()),
            "names the router: {e}"
        );
        assert!(
            took >= Duration::from_millis(200),
            "returned after {took:?}"
        );
        assert_eq!(c.in_flight(), 0, "the slot is free at the deadline");
        returned.notify_one();
        // The late answer of request 1 arrives while request 2 waits: discarded, not taken
        // for request 2's.
        let y = input(2, 2);
        assert_eq!(c.call(3, &y, H, None, None).await.unwrap(), expected(&y, 3));
        assert_eq!((c.in_flight(), c.ready()), (0, 0));
    });
}

#[test]
fn a_frozen_router_is_given_up_by_the_keepalive_and_named() {
    run(async {
        let (addr, cfg) = serve(frozen).await;
        let mut c = RouterClient::connect_with(addr, &cfg, quick())
            .await
            .unwrap();
        let x = input(1, 1);
        let t0 = std::time::Instant::now();
        let e = c.call(1, &x, H, None, None).await.unwrap_err();
        let took = t0.elapsed();
        assert!(
            matches!(e, ClientError::Unresponsive { router, .. } if router == addr),
            "{e}"
        );
        assert!(e.to_string().contains(&addr.to_string()), "{e}");
        // Not before the keepalive's bound; after it, only the test's hang guard.
        assert!(
            took >= QUICK_GIVE_UP,
            "keepalive bound {QUICK_GIVE_UP:?}, took {took:?}"
        );
        // No failover on a plain client: later calls fail with the same error.
        let e2 = c.call(1, &x, H, None, None).await.unwrap_err();
        assert_eq!(e2.to_string(), e.to_string());
    });
}

/// Answers each request `delay` after it came (and keepalive probes at once).
async fn answers_late(conn: FrameConnection, delay: Duration) {
    let (mut r, w) = conn.split();
    let w = Arc::new(tokio::sync::Mutex::new(w));
    while let Ok(f) = r.read_frame().await {
        let Body::LayerRequest(req) = f.body().clone() else {
            return;
        };
        let w = w.clone();
        if req.layer == liveness::PROBE_LAYER {
            let body = refusal(req.request_id, "probe");
            let _ = w.lock().await.write_frame(&body, &[]).await;
            continue;
        }
        let req = decode_req(req, f.payload());
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            let bytes = answer_bytes(&req, &FrontendConfig::new("client-tests"));
            let _ = w.lock().await.write_raw(&bytes).await;
        });
    }
}

#[test]
fn a_slow_router_that_answers_probes_is_not_given_up() {
    run(async {
        // Answers each request after twice the keepalive's bound of silence, and probes at
        // once.
        let (addr, cfg) = serve(|conn| answers_late(conn, 2 * QUICK_GIVE_UP)).await;
        let mut c = RouterClient::connect_with(addr, &cfg, quick())
            .await
            .unwrap();
        let x = input(4, 3);
        assert_eq!(c.call(2, &x, H, None, None).await.unwrap(), expected(&x, 2));
        assert_eq!(c.call(2, &x, H, None, None).await.unwrap(), expected(&x, 2));
    });
}

/// Two scripted routers: `first` (the one a client uses first) and a healthy one.
async fn pair<S, F>(first: S) -> (Vec<SocketAddr>, FrontendConfig)
where
    S: Fn(FrameConnection) -> F + Send + Sync + 'static,
    F: Future<Output = ()> + Send + 'static,
{
    let (a, cfg) = serve(first).await;
    let (b, _) = serve(|c| reverse_groups(c, 1)).await;
    (vec![a, b], cfg)
}

#[test]
fn a_failover_client_sends_unanswered_requests_again_to_the_next_router() {
    run(async {
        // The first router answers request 2 of three, then closes the connection.
        let (addrs, cfg) = pair(|mut conn| async move {
            let mut reqs = Vec::new();
            for _ in 0..3 {
                let Some(r) = read_req(&mut conn).await else {
                    return;
                };
                reqs.push(r);
            }
            answer(&mut conn, &reqs[1]).await;
        })
        .await;
        let mut c = RouterClient::connect_any(&addrs, &cfg, quick())
            .await
            .unwrap();
        assert_eq!(c.peer_addr(), addrs[0]);
        let xs: Vec<Vec<f32>> = (0..3).map(|i| input(i, i + 1)).collect();
        let mut hs = Vec::new();
        for x in &xs {
            hs.push(
                c.submit(3, x, H, None, Some(Duration::from_secs(5)))
                    .await
                    .unwrap(),
            );
        }
        for (h, x) in hs.into_iter().zip(&xs) {
            assert_eq!(c.wait(h).await.unwrap(), expected(x, 3));
        }
        assert_eq!((c.failovers(), c.peer_addr()), (1, addrs[1]));
        assert_eq!((c.in_flight(), c.ready()), (0, 0));
        let y = input(9, 2);
        assert_eq!(c.call(4, &y, H, None, None).await.unwrap(), expected(&y, 4));
    });
}

#[test]
fn a_failover_client_leaves_a_frozen_router_within_the_keepalive_bound() {
    run(async {
        let (addrs, cfg) = pair(frozen).await;
        let mut c = RouterClient::connect_any(&addrs, &cfg, quick())
            .await
            .unwrap();
        let x = input(5, 4);
        let t0 = std::time::Instant::now();
        let got = c.call(6, &x, H, None, Some(Duration::from_secs(30))).await;
        assert_eq!(got.unwrap(), expected(&x, 6));
        // The keepalive's bound, then the other router (answered within the 30 s deadline
        // after one failover: the keepalive, not the deadline, moved it).
        println!("answered by the next router after {:?}", t0.elapsed());
        assert_eq!(c.failovers(), 1);
    });
}

#[test]
fn a_failover_client_skips_a_refused_router_and_times_out_cleanly_when_none_answers() {
    run(async {
        // A port nothing listens on (bound, then closed).
        let dead = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap()
        };
        let (live, cfg) = serve(|c| reverse_groups(c, 1)).await;
        let mut c = RouterClient::connect_any(&[dead, live], &cfg, quick())
            .await
            .unwrap();
        assert_eq!(c.peer_addr(), live);
        let x = input(1, 1);
        assert_eq!(c.call(1, &x, H, None, None).await.unwrap(), expected(&x, 1));
        // Only dead routers: every call ends at its deadline with a clean error.
        let (swallower, _) = serve(|c| swallow(c, Duration::from_millis(50))).await;
        let mut c = RouterClient::connect_any(&[swallower, dead], &cfg, quick())
            .await
            .unwrap();
        let t0 = std::time::Instant::now();
        let d = Duration::from_millis(600);
        let e = c.call(1, &x, H, None, Some(d)).await.unwrap_err();
        let took = t0.elapsed();
        assert_eq!(e.code(), Some(ErrorCode::DeadlineExceeded), "{e}");
        // Not before its deadline; after it, only a hang guard (a busy machine is slow).
        assert!(took >= d && took < d + Duration::from_secs(30), "{took:?}");
        // the swallower accepts again and swallows: never a hang, never an answer
        let e = c.call(1, &x, H, None, Some(d)).await.unwrap_err();
        assert_eq!(e.code(), Some(ErrorCode::DeadlineExceeded), "{e}");
        assert_eq!(c.in_flight(), 0);
        let e = RouterClient::connect_any(&[dead, dead], &cfg, quick())
            .await
            .unwrap_err();
        assert!(e.to_string().contains("no router answered"), "{e}");
    });
}

#[test]
fn a_router_shutting_down_hands_its_requests_to_the_next_one() {
    run(async {
        let (addrs, cfg) = pair(|mut conn| async move {
            while let Some(r) = read_req(&mut conn).await {
                let body = Body::Error(codec::ErrorFrame {
                    request_id: r.req.request_id,
                    part: None,
                    code: ErrorCode::ShuttingDown,
                    message: "the router is stopping".into(),
                });
                let _ = conn.write_frame(&body, &[]).await;
            }
        })
        .await;
        let mut c = RouterClient::connect_any(&addrs, &cfg, quick())
            .await
            .unwrap();
        let x = input(3, 2);
        assert_eq!(c.call(8, &x, H, None, None).await.unwrap(), expected(&x, 8));
        assert_eq!((c.failovers(), c.peer_addr()), (1, addrs[1]));
        // A plain client sees the refusal.
        let mut plain = client(addrs[0], &cfg).await;
        let e = plain.call(8, &x, H, None, None).await.unwrap_err();
        assert_eq!(e.code(), Some(ErrorCode::ShuttingDown), "{e}");
    });
}

/// A router may close an idle connection right after the client read an answer (one that counts
/// its idle timeout from the last request alone did, after a slow answer): the next call
/// still finds the router's `ShuttingDown` frame and connects again, however soon it follows
/// the answer.
#[test]
fn a_connection_closed_for_idleness_right_after_an_answer_is_replaced_before_the_next_call() {
    run(async {
        let closed = Arc::new(tokio::sync::Notify::new());
        let (told, late) = (Arc::clone(&closed), Arc::new(tokio::sync::Mutex::new(None)));
        let late_seen = Arc::clone(&late);
        let (addr, cfg, accepted) = serve_first_then_in_order(move |mut conn| {
            let (told, late) = (Arc::clone(&told), Arc::clone(&late_seen));
            async move {
                // One answer, then closed for idleness at once.
                let Some(r) = read_req(&mut conn).await else {
                    return;
                };
                answer(&mut conn, &r).await;
                close_for_idleness(&mut conn).await;
                // Kept open: once the idle frame is there, no request goes out on this
                // connection (the client looks for the frame before sending, and its steps
                // read before they write).
                let mut late = late.lock().await;
                told.notify_one();
                *late = Some(read_req(&mut conn).await.map(|r| r.req.request_id));
            }
        })
        .await;
        let mut c = client(addr, &cfg).await;
        let x = input(5, 2);
        assert_eq!(c.call(3, &x, H, None, None).await.unwrap(), expected(&x, 3));
        closed.notified().await;
        let again = c.call(3, &x, H, None, None).await;
        assert_eq!(again.unwrap(), expected(&x, 3));
        assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 2);
        // The old connection ended (the client closed it) without another request.
        assert_eq!(
            *late.lock().await,
            Some(None),
            "a request went out on the closed connection"
        );
    });
}

/// A router stand-in whose first connection runs `first` and every later one answers in
/// order; and the count of connections it accepted.
async fn serve_first_then_in_order<S, F>(
    first: S,
) -> (
    SocketAddr,
    FrontendConfig,
    Arc<std::sync::atomic::AtomicUsize>,
)
where
    S: Fn(FrameConnection) -> F + Send + Sync + 'static,
    F: Future<Output = ()> + Send + 'static,
{
    let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = Arc::clone(&accepted);
    let (addr, cfg) = serve(move |conn| {
        let n = count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let script: std::pin::Pin<Box<dyn Future<Output = ()> + Send>> = if n == 0 {
            Box::pin(first(conn))
        } else {
            Box::pin(reverse_groups(conn, 1))
        };
        script
    })
    .await;
    (addr, cfg, accepted)
}

/// What a router sends as it closes a connection for idleness: `ShuttingDown` naming no
/// request.
async fn close_for_idleness(conn: &mut FrameConnection) {
    let body = Body::Error(codec::ErrorFrame {
        request_id: 0,
        part: None,
        code: ErrorCode::ShuttingDown,
        message: "closed: no request or answer for 1s and none in flight".into(),
    });
    let _ = conn.write_frame(&body, &[]).await;
}

/// A request sent at the instant the router decides the connection is idle crosses the
/// router's `ShuttingDown` frame naming no request. The router read nothing after deciding
/// (its reader drops a head read at that instant), so the client sends the request again on
/// a new connection to the same router and the call succeeds; it failed with the closed
/// connection before. The scripted router reads the request's frame and never answers it.
#[test]
fn a_request_that_crosses_an_idle_close_is_sent_again_on_a_new_connection() {
    run(async {
        let (addr, cfg, accepted) = serve_first_then_in_order(|mut conn| {
            async move {
                let Some(r) = read_req(&mut conn).await else {
                    return;
                };
                answer(&mut conn, &r).await;
                // The next request arrives as the router decides: closed for idleness.
                if read_req(&mut conn).await.is_none() {
                    return;
                }
                close_for_idleness(&mut conn).await;
            }
        })
        .await;
        let mut c = client(addr, &cfg).await;
        let x = input(5, 2);
        assert_eq!(c.call(3, &x, H, None, None).await.unwrap(), expected(&x, 3));
        let y = input(3, 7);
        let again = c.call(4, &y, H, None, None).await;
        assert_eq!(again.unwrap(), expected(&y, 4));
        assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 2);
        // Later calls go on the new connection.
        assert_eq!(c.call(3, &x, H, None, None).await.unwrap(), expected(&x, 3));
    });
}

/// The buffers a client keeps for reuse stay within `RETAIN_BUFFER_BYTES` in all, whatever
/// comes back, and a request takes a kept buffer large enough for it when there is one.
#[test]
fn kept_request_buffers_are_bounded_and_reused() {
    run(async {
        let (addr, cfg) = serve(|conn| reverse_groups(conn, 1)).await;
        let mut c = client(addr, &cfg).await;
        let kept = |c: &RouterClient| {
            let sum = c.spares.iter().map(Vec::capacity).sum::<usize>();
            assert_eq!(c.spare_bytes, sum, "the kept bytes' running sum");
            sum
        };
        for _ in 0..40 {
            c.recycle(Vec::with_capacity(RETAIN_BUFFER_BYTES / 8));
        }
        assert!(kept(&c) <= RETAIN_BUFFER_BYTES, "{} bytes kept", kept(&c));
        assert_eq!(c.spares.len(), 8);
        c.recycle(Vec::with_capacity(RETAIN_BUFFER_BYTES + 1));
        assert!(kept(&c) <= RETAIN_BUFFER_BYTES);
        let b = c.take_buffer(1000);
        assert!(b.len() == 1000 && b.iter().all(|&v| v == 0));
        assert_eq!(c.spares.len(), 7, "a kept buffer was taken");
        // Calls in flight hold their buffers; answered, they come back within the bound.
        let x = input(1, 4);
        let handles: Vec<_> = submit_calls(&mut c, &x, 6).await;
        for h in handles {
            assert_eq!(c.wait(h).await.unwrap(), expected(&x, 3));
        }
        assert!(kept(&c) <= RETAIN_BUFFER_BYTES);
        assert_eq!(
            c.spares.len(),
            7,
            "the answered calls' buffers were kept again"
        );
    });
}

/// A router that closes the connection for idleness again, before answering the requests the
/// client sent again after its first idle close, is no longer racing its own decision: the
/// call fails with a protocol error saying so, instead of reconnecting for ever.
#[test]
fn a_second_idle_close_before_any_answer_fails_the_call() {
    run(async {
        let (addr, cfg) = serve(|mut conn| async move {
            // Every connection: read a request, then close for idleness.
            if read_req(&mut conn).await.is_some() {
                close_for_idleness(&mut conn).await;
            }
        })
        .await;
        let mut c = client(addr, &cfg).await;
        let x = input(5, 2);
        let e = c.call(3, &x, H, None, None).await.unwrap_err();
        assert!(
            matches!(&e, ClientError::Protocol(m) if m.contains("idleness again")),
            "{e}"
        );
    });
}

/// Submit `n` calls of `x` to layer 3.
async fn submit_calls(c: &mut RouterClient, x: &[f32], n: usize) -> Vec<CallHandle> {
    let mut handles = Vec::new();
    for _ in 0..n {
        handles.push(c.submit(3, x, H, None, None).await.unwrap());
    }
    handles
}

/// A router stand-in on a runtime of its own (`script` per connection), so it answers while
/// the test's runtime is blocked: a caller busy elsewhere between `submit` and `wait`.
fn serve_elsewhere<S, F>(script: S) -> (tokio::runtime::Runtime, SocketAddr, FrontendConfig)
where
    S: Fn(FrameConnection) -> F + Send + Sync + 'static,
    F: Future<Output = ()> + Send + 'static,
{
    let server = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let (addr, cfg) = server.block_on(serve(script));
    (server, addr, cfg)
}

/// Answers that arrived while the caller was away from the client (longer than a request's
/// deadline and than the keepalive's whole bound) are the calls' answers: neither a
/// `DeadlineExceeded` nor an unresponsive router is made of silence the client did not watch.
#[test]
fn answers_that_arrived_while_the_caller_was_away_are_returned() {
    let written = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = written.clone();
    let (_server, addr, cfg) = serve_elsewhere(move |mut conn| {
        let counter = counter.clone();
        async move {
            while let Some(r) = read_req(&mut conn).await {
                answer(&mut conn, &r).await;
                counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
        }
    });
    run(async {
        let mut c = RouterClient::connect_with(addr, &cfg, quick())
            .await
            .unwrap();
        let x = input(5, 2);
        let with_deadline = c
            .submit(3, &x, H, None, Some(Duration::from_millis(200)))
            .await
            .unwrap();
        let without = c.submit(3, &x, H, None, None).await.unwrap();
        // Busy elsewhere: past the deadline (200 + 250 ms of grace) and the keepalive's bound,
        // and until the router has answered both, however slowly.
        let away = std::time::Instant::now();
        while away.elapsed() < QUICK_GIVE_UP + Duration::from_millis(300)
            || written.load(std::sync::atomic::Ordering::SeqCst) < 2
        {
            assert!(away.elapsed() < T, "the router never answered both");
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(c.wait(with_deadline).await.unwrap(), expected(&x, 3));
        assert_eq!(c.wait(without).await.unwrap(), expected(&x, 3));
        assert_eq!(c.call(3, &x, H, None, None).await.unwrap(), expected(&x, 3));
    });
}

/// A router still computing when the caller comes back after longer than the keepalive's
/// bound is probed, not given up: it answers the probe, then the call. (This router answers a
/// request only once it has been probed, so the call can only succeed through a probe; the
/// probe is given 3 s, which no stall of the router's thread on a busy machine outlasts.)
#[test]
fn a_router_still_computing_when_the_caller_comes_back_is_probed_not_given_up() {
    let (_server, addr, cfg) = serve_elsewhere(|mut conn| async move {
        let mut held = Vec::new();
        while let Ok(f) = conn.read_frame().await {
            let Body::LayerRequest(req) = f.body().clone() else {
                return;
            };
            if req.layer == liveness::PROBE_LAYER {
                let _ = conn
                    .write_frame(&refusal(req.request_id, "probe"), &[])
                    .await;
                for r in held.drain(..) {
                    answer(&mut conn, &r).await;
                }
                continue;
            }
            held.push(decode_req(req, f.payload()));
        }
    });
    run(async {
        let opts = ClientOptions {
            keepalive_interval: Duration::from_millis(100),
            keepalive_timeout: Duration::from_secs(3),
            ..quick()
        };
        let mut c = RouterClient::connect_with(addr, &cfg, opts).await.unwrap();
        let x = input(6, 2);
        let h = c.submit(3, &x, H, None, None).await.unwrap();
        // Away past interval + timeout (3.1 s): silence nobody watched.
        std::thread::sleep(Duration::from_millis(3300));
        assert_eq!(c.wait(h).await.unwrap(), expected(&x, 3));
    });
}
