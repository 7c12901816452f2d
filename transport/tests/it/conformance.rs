//! One conformance suite run against every driver (TCP, shared memory, RDMA on the in-process
//! NIC, on libfabric with feature `libfabric`, and on verbs where a device exists): ordering,
//! frame sizes, many peers, backpressure with bounded memory, peer loss, a restarted peer
//! rejoined, garbage and oversized frames, failed authentication.
//!
//! Why this exists: the fabric relies on every link behaving the same; a driver is only done
//! when this whole file passes against it. Each test body is written once and instantiated per
//! driver by the `conformance!` macro.

use crate::support::{crc32c, free_addrs, peers, result_body};
use bytes::Bytes;
use expertmesh_transport::codec::{self, Body, CodecConfig, ErrorCode, ErrorFrame, Heartbeat};
use expertmesh_transport::crypto::Credentials;
use expertmesh_transport::protocol::{Connection, ProtocolConfig};
use expertmesh_transport::rdma::{DEFAULT_LIBFABRIC_PROVIDER, RdmaProvider};
use expertmesh_transport::{
    LinkKind, Mesh, MeshConfig, MeshEvents, OutFrame, OutputDtype, PeerErrorKind, StartError,
    Transport, TransportEvent,
};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const MAX_FRAME: usize = 256 << 10;

/// A driver of the suite: a link kind and, for RDMA, the NIC under it.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Driver {
    Tcp,
    Shm,
    /// Raw verbs (feature `rdma`, an RDMA device).
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    RdmaVerbs,
    /// The in-process NIC (no faults).
    RdmaInProcess,
    /// libfabric over `tcp;ofi_rxm` (feature `libfabric`).
    #[cfg_attr(not(feature = "libfabric"), allow(dead_code))]
    RdmaLibfabric,
}

/// How long a cluster may take to connect: libfabric's `tcp;ofi_rxm` spends ~50 ms of CPU
/// enabling each endpoint, and the 5-rank test opens 20 of them on a busy 2-core machine.
fn connect_timeout(kind: Driver) -> Duration {
    match kind {
        Driver::RdmaLibfabric => 6 * T,
        _ => T,
    }
}

impl Driver {
    pub(crate) fn kind(self) -> LinkKind {
        match self {
            Self::Tcp => LinkKind::Tcp,
            Self::Shm => LinkKind::Shm,
            _ => LinkKind::Rdma,
        }
    }

    pub(crate) fn provider(self) -> RdmaProvider {
        match self {
            Self::RdmaInProcess => RdmaProvider::InProcess(Default::default()),
            Self::RdmaLibfabric => RdmaProvider::Libfabric(DEFAULT_LIBFABRIC_PROVIDER.into()),
            _ => RdmaProvider::Verbs,
        }
    }
}
const WINDOW: u64 = 2 * MAX_FRAME as u64;
/// How long a test waits for what must happen (a frame, a connection, a rejoin) before calling
/// it a hang: a guard, not a budget (a passing test never waits it out), so it is generous for
/// a busy or slow machine.
const T: Duration = Duration::from_secs(30);

struct Cluster {
    meshes: Vec<Mesh>,
    events: Vec<MeshEvents>,
    addrs: Vec<SocketAddr>,
    _shm_dir: tempfile::TempDir,
}

fn config(kind: Driver, rank: u32, addrs: &[SocketAddr], shm_dir: &std::path::Path) -> MeshConfig {
    let mut c = MeshConfig::new("conformance", rank, peers(addrs, kind.kind()));
    c.rdma_provider = kind.provider();
    c.protocol.codec = CodecConfig {
        max_frame_bytes: MAX_FRAME,
        payload_checksum: true,
    };
    c.protocol.recv_window_bytes = WINDOW;
    // libfabric's tcp;ofi_rxm spends ~50 ms of CPU enabling each endpoint (its message buffer
    // pools), and this suite opens up to 20 at once on a busy machine.
    c.protocol.handshake_timeout = match kind {
        Driver::RdmaLibfabric => Duration::from_secs(10),
        _ => Duration::from_secs(2),
    };
    c.reconnect_initial = Duration::from_millis(5);
    c.reconnect_max = Duration::from_millis(100);
    c.shm.dir = shm_dir.to_path_buf();
    c.shm.ring_bytes = 4 * MAX_FRAME;
    c.shm.spin_us = 5;
    c
}

async fn cluster(n: usize, kind: Driver) -> Cluster {
    cluster_of(n, n, kind).await
}

/// A cluster of `world` ranks of which the first `started` run.
async fn cluster_of(world: usize, started: usize, kind: Driver) -> Cluster {
    let addrs = free_addrs(world);
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    let mut meshes = Vec::new();
    let mut events = Vec::new();
    for r in 0..started {
        let (m, e) = Mesh::start(config(kind, r as u32, &addrs, dir.path()))
            .await
            .unwrap();
        meshes.push(m);
        events.push(e);
    }
    let c = Cluster {
        meshes,
        events,
        addrs,
        _shm_dir: dir,
    };
    for (r, m) in c.meshes.iter().enumerate() {
        let others: Vec<u32> = (0..started as u32).filter(|&p| p != r as u32).collect();
        m.wait_connected(&others, connect_timeout(kind))
            .await
            .unwrap();
        for &p in &others {
            assert_eq!(
                m.link_kind(p),
                Some(kind.kind()),
                "rank {r} → {p} uses the requested link"
            );
        }
    }
    c
}

fn result_frame(id: u64, rows: u32, hidden: u32, fill: u8) -> OutFrame {
    let body = result_body([id, 3, 1], rows, hidden, OutputDtype::Bf16);
    let len = (rows * hidden * 2) as usize;
    let payload: Vec<u8> = (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ fill)
        .collect();
    OutFrame::with_payload(body, payload)
}

fn check_payload(f: &expertmesh_transport::RecvFrame, fill: u8) {
    assert_eq!(
        f.payload().as_ptr() as usize % 64,
        0,
        "payload is 64-byte aligned"
    );
    for (i, &b) in f.payload().iter().enumerate() {
        assert_eq!(b, (i as u8).wrapping_mul(31) ^ fill, "payload byte {i}");
    }
}

async fn per_peer_ordering(kind: Driver) {
    let mut c = cluster(2, kind).await;
    let n = 300u64;
    let m1 = c.meshes[1].clone();
    let sender = tokio::spawn(async move {
        for i in 0..n {
            let rows = (i % 7) as u32;
            m1.send(0, &result_frame(i, rows, 64, i as u8))
                .await
                .unwrap();
        }
    });
    for i in 0..n {
        let f = c.events[0].recv_frame(T).await.expect("frame");
        assert_eq!(f.peer(), 1);
        assert_eq!(
            f.body().request_id(),
            Some(i),
            "frames arrive in send order"
        );
        check_payload(&f, i as u8);
    }
    sender.await.unwrap();
}

/// Frames the application holds stay intact whatever order it drops them in, while the sender
/// goes on sending (shared memory reads frames in place and frees ring space in order: its
/// producer must never write over a held frame). Each frame is held for at most eight later
/// frames, so the frames from the oldest held one on always fit the ring: the sender is never
/// blocked by a frame that waits for later ones. (A ring that used less of itself, starting
/// over early while the consumer keeps up, deadlocked here in one run of three.)
async fn held_frames_stay_intact_in_any_drop_order(kind: Driver) {
    let mut c = cluster(2, kind).await;
    let n = 400u64;
    // Payloads of 0 to 61 440 bytes: five held frames and the next one fit the window.
    let rows = |i: u64| ((i * 7919) % 31) as u32;
    let m1 = c.meshes[1].clone();
    let sender = tokio::spawn(async move {
        for i in 0..n {
            m1.send(0, &result_frame(i, rows(i), 1024, i as u8))
                .await
                .unwrap();
        }
    });
    let mut held: Vec<(u64, expertmesh_transport::RecvFrame)> = Vec::new();
    let mut rng = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    for i in 0..n {
        let f = c.events[0].recv_frame(T).await.expect("frame");
        assert_eq!(f.body().request_id(), Some(i), "frames arrive in order");
        check_payload(&f, i as u8);
        held.push((i, f));
        let keep = (next() % 6) as usize;
        loop {
            // A frame eight behind goes first; then random ones down to `keep`.
            let at = match held.iter().position(|&(j, _)| i - j >= 8) {
                Some(at) => at,
                None if held.len() > keep => next() as usize % held.len(),
                None => break,
            };
            let (j, f) = held.swap_remove(at);
            check_payload(&f, j as u8); // unchanged while it was held
        }
    }
    for (j, f) in held {
        check_payload(&f, j as u8);
    }
    sender.await.unwrap();
}

async fn tiny_and_max_size_frames(kind: Driver) {
    let mut c = cluster(2, kind).await;
    // Tiny: an error frame with an empty message, no payload.
    let tiny = OutFrame::new(Body::Error(ErrorFrame {
        request_id: 9,
        part: None,
        code: ErrorCode::Overloaded,
        message: String::new(),
    }));
    c.meshes[0].send(1, &tiny).await.unwrap();
    let f = c.events[1].recv_frame(T).await.unwrap();
    assert_eq!(f.body(), &tiny.body);
    assert!(f.payload().is_empty());
    // Maximum: payload filling the frame to exactly MAX_FRAME bytes.
    let probe = result_frame(1, 0, 0, 0);
    let head = codec::head_len(&probe.body);
    let hidden = 256u32;
    let rows = ((MAX_FRAME - head) / (hidden as usize * 2)) as u32;
    let big = result_frame(2, rows, hidden, 0x5A);
    let total = codec::frame_len(&big.body, big.payload.len());
    assert!(
        total <= MAX_FRAME && total + 512 > MAX_FRAME,
        "frame of {total} bytes is near the maximum"
    );
    c.meshes[0].send(1, &big).await.unwrap();
    let f = c.events[1].recv_frame(T).await.unwrap();
    assert_eq!(f.frame_len(), total);
    check_payload(&f, 0x5A);
    // One byte too many is refused before sending, naming the peer; the link stays usable.
    let over = result_frame(3, rows + 1, hidden, 0);
    let err = c.meshes[0].send(1, &over).await.unwrap_err();
    assert_eq!(err.peer, 1);
    assert!(
        matches!(
            err.kind,
            PeerErrorKind::BadFrame(codec::CodecError::TooLarge { .. })
        ),
        "{err}"
    );
    c.meshes[0]
        .send(1, &result_frame(4, 1, 8, 1))
        .await
        .unwrap();
    let f = c.events[1].recv_frame(T).await.unwrap();
    assert_eq!(f.body().request_id(), Some(4));
}

async fn many_peers_at_once(kind: Driver) {
    let n = 5usize;
    let per_pair = 25u64;
    let mut c = cluster(n, kind).await;
    let mut tasks = Vec::new();
    for from in 0..n {
        let m = c.meshes[from].clone();
        tasks.push(tokio::spawn(async move {
            for i in 0..per_pair {
                for to in 0..n as u32 {
                    if to as usize != from {
                        let id = (from as u64) << 32 | i;
                        if let Err(e) = m.send(to, &result_frame(id, 2, 128, from as u8)).await {
                            panic!("send {from} -> {to} (frame {i}): {e}");
                        }
                    }
                }
            }
        }));
    }
    for (to, ev) in c.events.iter_mut().enumerate() {
        let mut next = vec![0u64; n];
        for _ in 0..(n as u64 - 1) * per_pair {
            let f = crate::support::expect_frame(ev, T).await;
            let from = f.peer() as usize;
            assert_ne!(from, to);
            let id = f.body().request_id().unwrap();
            assert_eq!(id >> 32, from as u64);
            assert_eq!(
                id & 0xFFFF_FFFF,
                next[from],
                "ordering from rank {from} to {to}"
            );
            next[from] += 1;
            check_payload(&f, from as u8);
        }
    }
    for t in tasks {
        t.await.unwrap();
    }
}

async fn backpressure_bounds_memory(kind: Driver) {
    let mut c = cluster(2, kind).await;
    let frame = result_frame(0, 100, 300, 0); // 60 000-byte payload
    let cost =
        expertmesh_transport::mesh::credit_cost(codec::frame_len(&frame.body, frame.payload.len()));
    let sent = Arc::new(AtomicUsize::new(0));
    let total = 40usize;
    let m1 = c.meshes[1].clone();
    let sent2 = Arc::clone(&sent);
    let sender = tokio::spawn(async move {
        for i in 0..total {
            let mut f = result_frame(i as u64, 100, 300, 0);
            f.payload = Bytes::clone(&f.payload);
            m1.send(0, &f).await.unwrap();
            sent2.fetch_add(1, Ordering::SeqCst);
        }
    });
    // The receiver does not consume: the sender fills its window (however long that takes on
    // a busy machine), then stalls there.
    let max_in_window = (WINDOW / cost) as usize;
    let t0 = Instant::now();
    while sent.load(Ordering::SeqCst) < max_in_window.saturating_sub(1) && t0.elapsed() < T {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let stalled_at = sent.load(Ordering::SeqCst);
    assert!(
        stalled_at <= max_in_window,
        "sent {stalled_at} frames, window admits {max_in_window}"
    );
    assert!(
        stalled_at >= max_in_window.saturating_sub(1),
        "sender used its window ({stalled_at})"
    );
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(
        sent.load(Ordering::SeqCst),
        stalled_at,
        "no progress without credit"
    );
    let rx = c.meshes[0].peer_stats(1).unwrap();
    assert!(rx.recv_outstanding <= rx.recv_window, "{rx:?}");
    assert!(
        rx.recv_pool_bytes <= 2 * WINDOW,
        "receive buffers bounded: {rx:?}"
    );
    let tx = c.meshes[1].peer_stats(0).unwrap();
    assert!(tx.send_credit < cost, "sender is out of credit: {tx:?}");
    // Consume slowly: everything arrives, in order, and memory stays bounded throughout.
    for i in 0..total {
        let f = c.events[0].recv_frame(T).await.expect("frame");
        assert_eq!(f.body().request_id(), Some(i as u64));
        let st = c.meshes[0].peer_stats(1).unwrap();
        assert!(st.recv_outstanding <= st.recv_window);
        assert!(st.recv_pool_bytes <= 2 * WINDOW, "{st:?}");
        drop(f);
    }
    sender.await.unwrap();
}

async fn peer_disconnect_fails_pending_sends(kind: Driver) {
    let mut c = cluster(2, kind).await;
    let m1 = c.meshes[1].clone();
    // Fill the window so that later sends are pending on credit.
    let pending = tokio::spawn(async move {
        loop {
            if let Err(e) = m1.send(0, &result_frame(1, 100, 300, 0)).await {
                return e;
            }
        }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!pending.is_finished(), "sender waits for credit");
    // Rank 0 goes away mid-stream.
    c.meshes[0].shutdown();
    let ev0 = c.events.remove(0);
    drop(ev0);
    let err = tokio::time::timeout(T, pending)
        .await
        .expect("pending send fails promptly")
        .unwrap();
    assert_eq!(err.peer, 0, "error names the peer: {err}");
    assert!(err.to_string().starts_with("rank 0:"), "{err}");
    // The survivor reports the loss and later sends fail fast, naming the peer.
    let lost = loop {
        match tokio::time::timeout(T, c.events[0].recv())
            .await
            .expect("event")
        {
            Some(TransportEvent::PeerLost(e)) => break e,
            Some(_) => continue,
            None => panic!("event stream ended"),
        }
    };
    assert_eq!(lost.peer, 0);
    let err = c.meshes[1]
        .send(0, &result_frame(2, 1, 8, 0))
        .await
        .unwrap_err();
    assert_eq!(err.peer, 0);
}

/// A peer that goes away and comes back (a new process for the rank, same address) is joined
/// again over the same kind of link, and frames flow both ways on the new link.
async fn a_restarted_peer_is_rejoined(kind: Driver) {
    let mut c = cluster(2, kind).await;
    c.meshes[1]
        .send(0, &result_frame(1, 3, 64, 1))
        .await
        .unwrap();
    let f = c.events[0]
        .recv_frame(T)
        .await
        .expect("frame before the restart");
    check_payload(&f, 1);
    drop(f);
    c.meshes[1].shutdown();
    drop(c.events.remove(1));
    drop(c.meshes.remove(1));
    // The new process binds the same address once the old one's listener is gone.
    let t0 = Instant::now();
    let (m1, mut e1) = loop {
        match Mesh::start(config(kind, 1, &c.addrs, c._shm_dir.path())).await {
            Ok(started) => break started,
            Err(StartError::Bind { .. }) if t0.elapsed() < T => {
                tokio::time::sleep(Duration::from_millis(20)).await
            }
            Err(e) => panic!("restarting rank 1: {e}"),
        }
    };
    m1.wait_connected(&[0], T).await.unwrap();
    // Until rank 0 has seen the old link die, it refuses the new process (a live rank is never
    // taken over), so the first links may close again: send until a frame gets through.
    let t0 = Instant::now();
    let mut id = 2u64;
    let f = loop {
        if m1.send(0, &result_frame(id, 5, 64, id as u8)).await.is_ok()
            && let Some(f) = c.events[0].recv_frame(Duration::from_secs(1)).await
        {
            break f;
        }
        assert!(t0.elapsed() < T, "the restarted peer was never rejoined");
        id += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let got = f.body().request_id().expect("a result");
    assert!((2..=id).contains(&got), "frame {got} after the restart");
    check_payload(&f, got as u8);
    drop(f);
    // The rejoined link is of the driver's kind, or TCP when one side could not set up its
    // part during the restart (the documented fallback, with a warning); frames flow either way.
    let rejoined = m1.link_kind(0);
    assert!(
        rejoined == Some(kind.kind()) || rejoined == Some(LinkKind::Tcp),
        "rejoined over {rejoined:?}"
    );
    // And the other way, on the link now up.
    c.meshes[0]
        .send(1, &result_frame(1000, 4, 64, 7))
        .await
        .unwrap();
    // (Rank 0's refusals of the first attempts may arrive first, as error frames.)
    let f = loop {
        let f = e1.recv_frame(T).await.expect("frame to the restarted peer");
        match f.body() {
            Body::Error(e) => assert!(e.message.contains("live"), "unexpected error frame: {e:?}"),
            _ => break f,
        }
    };
    assert_eq!(f.body().request_id(), Some(1000));
    check_payload(&f, 7);
    m1.shutdown();
}

async fn garbage_and_oversized_frames_close_only_that_connection(kind: Driver) {
    // Rank 2 of 3 never starts: the test impersonates it without racing its redials.
    let mut c = cluster_of(3, 2, kind).await;
    let target = c.addrs[0];
    // 1. Garbage bytes instead of a hello.
    let mut s = tokio::net::TcpStream::connect(target).await.unwrap();
    s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n and more garbage....")
        .await
        .unwrap();
    let mut buf = Vec::new();
    let _ = tokio::time::timeout(T, s.read_to_end(&mut buf))
        .await
        .expect("closed promptly");
    assert!(buf.is_empty(), "nothing is answered to garbage");
    // 2. A valid header announcing an oversized frame.
    let mut s = tokio::net::TcpStream::connect(target).await.unwrap();
    let mut hdr = codec::encode_frame(
        &Body::Heartbeat(Heartbeat {
            seq: 1,
            sent_at_us: 2,
        }),
        &[],
        &CodecConfig::default(),
    )
    .unwrap();
    hdr.truncate(codec::HEADER_LEN);
    hdr[8..12].copy_from_slice(&(u32::MAX - 63).to_le_bytes());
    let crc = crc32c(&hdr[..24]);
    hdr[24..28].copy_from_slice(&crc.to_le_bytes());
    s.write_all(&hdr).await.unwrap();
    let mut buf = Vec::new();
    tokio::time::timeout(T, s.read_to_end(&mut buf))
        .await
        .expect("closed promptly")
        .ok();
    assert!(buf.is_empty(), "nothing is answered to an oversized header");
    // 3. An established link: a valid handshake as rank 2, then an oversized length prefix.
    let mut s = tokio::net::TcpStream::connect(target).await.unwrap();
    let mut pc = ProtocolConfig::new("conformance", 2, 3);
    pc.codec = CodecConfig {
        max_frame_bytes: MAX_FRAME,
        payload_checksum: true,
    };
    pc.recv_window_bytes = WINDOW;
    let mut conn = Connection::new(Arc::new(pc), Some(0), [3; 32], Vec::new(), Instant::now());
    manual_handshake(&mut s, &mut conn).await;
    s.write_all(&hdr).await.unwrap();
    let mut buf = Vec::new();
    tokio::time::timeout(T, s.read_to_end(&mut buf))
        .await
        .expect("closed promptly")
        .ok();
    // Rank 0 reports the loss of that connection with the codec error.
    let lost = loop {
        match tokio::time::timeout(T, c.events[0].recv())
            .await
            .expect("event")
        {
            Some(TransportEvent::PeerLost(e)) if e.peer == 2 => break e,
            Some(_) => continue,
            None => panic!("events ended"),
        }
    };
    assert!(
        lost.to_string().contains("exceeds the configured maximum"),
        "{lost}"
    );
    // Other peers are unaffected.
    c.meshes[1]
        .send(0, &result_frame(77, 1, 8, 7))
        .await
        .unwrap();
    let f = c.events[0].recv_frame(T).await.unwrap();
    assert_eq!((f.peer(), f.body().request_id()), (1, Some(77)));
    c.meshes[0]
        .send(1, &result_frame(78, 1, 8, 7))
        .await
        .unwrap();
    assert_eq!(
        c.events[1].recv_frame(T).await.unwrap().body().request_id(),
        Some(78)
    );
    assert!(!c.meshes[0].is_connected(2));
}

async fn manual_handshake(s: &mut tokio::net::TcpStream, conn: &mut Connection) {
    let codec = CodecConfig {
        max_frame_bytes: MAX_FRAME,
        payload_checksum: true,
    };
    let mut dec = codec::StreamDecoder::new(codec);
    loop {
        while let Some(b) = conn.poll_transmit() {
            s.write_all(&codec::encode_frame(&b, &[], &codec).unwrap())
                .await
                .unwrap();
        }
        if conn.is_established() {
            return;
        }
        let mut buf = [0u8; 4096];
        let n = tokio::time::timeout(T, s.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert!(n > 0, "peer closed during handshake");
        dec.push(&buf[..n]);
        while let Some((body, _)) = dec.next_frame().unwrap() {
            conn.handle_frame(Instant::now(), &body, 0).unwrap();
        }
    }
}

async fn failed_authentication_is_refused(kind: Driver) {
    let addrs = free_addrs(2);
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    let mut c0 = config(kind, 0, &addrs, dir.path());
    c0.protocol.credentials = Some(Arc::new(Credentials::shared_secret(b"right secret")));
    let mut c1 = config(kind, 1, &addrs, dir.path());
    c1.protocol.credentials = Some(Arc::new(Credentials::shared_secret(b"wrong secret")));
    let (m0, _e0) = Mesh::start(c0.clone()).await.unwrap();
    let (m1, _e1) = Mesh::start(c1).await.unwrap();
    let err = m1
        .wait_connected(&[0], Duration::from_millis(400))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("[0]"), "{err}");
    assert!(!m0.is_connected(1));
    // The send names the refused handshake once one has been refused (a loaded machine may
    // take longer than the wait above for the first dial to be refused).
    let guard = std::time::Instant::now();
    let send_err = loop {
        let e = m1.send(0, &result_frame(1, 1, 8, 0)).await.unwrap_err();
        if e.to_string().contains("authentication") || guard.elapsed() > Duration::from_secs(30) {
            break e;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(send_err.peer, 0);
    assert!(
        send_err.to_string().contains("authentication"),
        "{send_err}"
    );
    // No shared-memory segment is left behind by the refused attempts.
    // Rings go with the tasks the shutdown aborts, as they end: looked for until none is
    // left (T: a hang guard).
    m1.shutdown();
    let guard = std::time::Instant::now();
    let mut leftovers = std::fs::read_dir(dir.path()).unwrap().count();
    while leftovers > 0 && guard.elapsed() < T {
        tokio::time::sleep(Duration::from_millis(20)).await;
        leftovers = std::fs::read_dir(dir.path()).unwrap().count();
    }
    assert_eq!(leftovers, 0, "ring files left after refused handshakes");
    // The right secret connects.
    let mut c1 = config(kind, 1, &addrs, dir.path());
    c1.protocol.credentials = Some(Arc::new(Credentials::shared_secret(b"right secret")));
    // On the first one's address, which its listener frees as its aborted task ends.
    let guard = std::time::Instant::now();
    let (m1, _e1) = loop {
        match Mesh::start(c1.clone()).await {
            Err(StartError::Bind { source, .. })
                if source.kind() == std::io::ErrorKind::AddrInUse && guard.elapsed() < T =>
            {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            started => break started.unwrap(),
        }
    };
    m1.wait_connected(&[0], T).await.unwrap();
    m0.shutdown();
    m1.shutdown();
}

macro_rules! conformance {
    ($modname:ident, $kind:expr, $guard:expr) => {
        mod $modname {
            use super::*;
            macro_rules! case {
                ($name:ident) => {
                    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                    async fn $name() {
                        let Some(_held) = $guard().await else {
                            return;
                        };
                        super::$name($kind).await;
                    }
                };
            }
            case!(per_peer_ordering);
            case!(held_frames_stay_intact_in_any_drop_order);
            case!(tiny_and_max_size_frames);
            case!(many_peers_at_once);
            case!(backpressure_bounds_memory);
            case!(peer_disconnect_fails_pending_sends);
            case!(a_restarted_peer_is_rejoined);
            case!(garbage_and_oversized_frames_close_only_that_connection);
            case!(failed_authentication_is_refused);
        }
    };
}

/// What a case holds while it runs (the `/dev/shm` guard for shared-memory cases); `None`
/// from a case's guard function: skipped (said by the guard).
type Held = Option<tokio::sync::MutexGuard<'static, ()>>;

async fn always() -> Option<Held> {
    Some(None)
}

/// The most a shared-memory case's rings take: five ranks, two rings of 1 MiB per pair.
async fn shm_rings() -> Option<Held> {
    crate::support::shm_room(48 << 20).await.map(Some)
}

conformance!(tcp, Driver::Tcp, always);
conformance!(shm, Driver::Shm, shm_rings);
conformance!(rdma_in_process, Driver::RdmaInProcess, always);
#[cfg(feature = "libfabric")]
conformance!(rdma_libfabric, Driver::RdmaLibfabric, always);

#[cfg(feature = "rdma")]
async fn rdma_device_present() -> Option<Held> {
    rdma_device_listed().then_some(None)
}

#[cfg(feature = "rdma")]
fn rdma_device_listed() -> bool {
    let present = std::fs::read_dir("/sys/class/infiniband")
        .map(|mut d| d.next().is_some())
        .unwrap_or(false);
    if !present {
        // Written to the real stderr (not the captured eprintln!) so the skip is visible.
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "skipped: no RDMA device (/sys/class/infiniband is empty)"
        );
    }
    present
}

#[cfg(feature = "rdma")]
conformance!(rdma_verbs, Driver::RdmaVerbs, rdma_device_present);

/// When shared memory cannot be set up (here: the ring directory does not exist, as with a
/// missing or full /dev/shm), the pair falls back to TCP with a warning and still works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_failure_falls_back_to_tcp() {
    let addrs = free_addrs(2);
    let missing = std::path::Path::new("/nonexistent-expertmesh-shm-dir");
    let mut meshes = Vec::new();
    let mut events = Vec::new();
    for r in 0..2 {
        let (m, e) = Mesh::start(config(Driver::Shm, r, &addrs, missing))
            .await
            .unwrap();
        meshes.push(m);
        events.push(e);
    }
    meshes[1].wait_connected(&[0], T).await.unwrap();
    assert_eq!(meshes[1].link_kind(0), Some(LinkKind::Tcp));
    meshes[1].send(0, &result_frame(5, 3, 16, 9)).await.unwrap();
    let f = events[0].recv_frame(T).await.unwrap();
    check_payload(&f, 9);
}
