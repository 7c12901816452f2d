//! Sealed (encrypted) links over real sockets: ranks and frontends holding issued credentials
//! exchange frames of every size (one record, several payload chunks) in order and intact,
//! over TCP and over shared memory set up after authentication; a frontend is served under its
//! own name only; the handshake gate closes connections beyond its limits at once.
//!
//! Why this exists: the sans-IO tests (`protocol`, `crypto`) prove the handshake and the record
//! layer; these prove the drivers use them end to end: the writer seals every frame after its
//! own auth answer, the reader opens in place into the pooled aligned buffer, and the
//! shared-memory ring path travels in a sealed link-info frame.

use crate::support::{expect_frame, free_addrs, peers, result_body};
use bytes::Bytes;
use expertmesh_transport::codec::Body;
use expertmesh_transport::crypto::{Credentials, Key};
use expertmesh_transport::frontend::{FrameConnection, FrameListener, FrontendConfig};
use expertmesh_transport::{
    HandshakeGate, LinkKind, Mesh, MeshConfig, OutFrame, OutputDtype, Transport,
};
use std::sync::Arc;
use std::time::Duration;

const T: Duration = Duration::from_secs(30);

fn frame(id: u64, rows: u32, hidden: u32) -> OutFrame {
    let body = result_body([id, 1, 0], rows, hidden, OutputDtype::F32);
    let n = (rows * hidden * 4) as usize;
    OutFrame::with_payload(
        body,
        Bytes::from(
            (0..n)
                .map(|i| (i * 7 + id as usize) as u8)
                .collect::<Vec<_>>(),
        ),
    )
}

async fn sealed_pair(
    kind: LinkKind,
    dir: &std::path::Path,
) -> (Vec<Mesh>, Vec<expertmesh_transport::MeshEvents>) {
    let master = Key::random().unwrap();
    let addrs = free_addrs(2);
    let (mut meshes, mut events) = (Vec::new(), Vec::new());
    for rank in 0..2u32 {
        let mut c = MeshConfig::new("sealed", rank, peers(&addrs, kind));
        c.protocol.codec.max_frame_bytes = 4 << 20;
        c.protocol.recv_window_bytes = 8 << 20;
        c.shm.dir = dir.to_path_buf();
        c.shm.ring_bytes = 9 << 20;
        c.protocol.credentials = Some(Arc::new(Credentials::issue_rank(
            &master, "sealed", rank, 2, 1,
        )));
        let (m, e) = Mesh::start(c).await.unwrap();
        meshes.push(m);
        events.push(e);
    }
    meshes[1].wait_connected(&[0], T).await.unwrap();
    meshes[0].wait_connected(&[1], T).await.unwrap();
    (meshes, events)
}

async fn frames_of_every_size_arrive_in_order_and_intact(kind: LinkKind) {
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    let (meshes, mut events) = sealed_pair(kind, dir.path()).await;
    assert_eq!(meshes[1].link_kind(0), Some(kind));
    // Sizes: no payload, one chunk, exactly one chunk, several chunks with a short tail.
    let shapes = [
        (0u32, 4u32),
        (1, 16),
        (1, 65_536),
        (3, 70_000),
        (2, 180_000),
    ];
    for round in 0..3u64 {
        for (i, &(rows, hidden)) in shapes.iter().enumerate() {
            let id = round * 10 + i as u64;
            let f = frame(id, rows, hidden);
            meshes[1].send(0, &f).await.unwrap();
            let got = expect_frame(&mut events[0], T).await;
            assert_eq!(got.body().request_id(), Some(id), "in order");
            assert_eq!(got.payload(), &f.payload[..], "frame {id} intact");
            assert_eq!(
                got.payload().as_ptr() as usize % 64,
                0,
                "payload stays aligned"
            );
            // And back the other way.
            meshes[0].send(1, &f).await.unwrap();
            let back = expect_frame(&mut events[1], T).await;
            assert_eq!(back.payload(), &f.payload[..]);
        }
    }
    for m in &meshes {
        m.shutdown();
    }
    if kind == LinkKind::Shm {
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            0,
            "ring files unlinked"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sealed_tcp_frames_arrive_in_order_and_intact() {
    frames_of_every_size_arrive_in_order_and_intact(LinkKind::Tcp).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_set_up_after_authentication_carries_frames() {
    // Two rings of 9 MiB.
    let Some(_shm) = crate::support::shm_room(24 << 20).await else {
        return;
    };
    frames_of_every_size_arrive_in_order_and_intact(LinkKind::Shm).await;
}

async fn echo_server(l: FrameListener) {
    while let Ok(inc) = l.accept().await {
        tokio::spawn(async move {
            let Ok(mut c) = inc.handshake().await else {
                return;
            };
            assert!(c.is_encrypted());
            while let Ok(f) = c.read_frame().await {
                let body = f.body().clone();
                let payload = f.payload().to_vec();
                if c.write_frame(&body, &payload).await.is_err() {
                    return;
                }
            }
        });
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frontend_is_served_sealed_under_its_own_name_only() {
    let master = Key::random().unwrap();
    let mut server = FrontendConfig::new("fe-cluster");
    server.credentials = Some(Arc::new(Credentials::issue_rank(
        &master,
        "fe-cluster",
        0,
        3,
        1,
    )));
    let l = FrameListener::bind("127.0.0.1:0".parse().unwrap(), server)
        .await
        .unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(echo_server(l));
    let mut client = FrontendConfig::new("fe-cluster");
    client.credentials = Some(Arc::new(Credentials::issue_frontend(
        &master,
        "fe-cluster",
        "alice",
        1,
    )));
    let mut c = FrameConnection::connect(addr, &client).await.unwrap();
    assert!(c.is_encrypted());
    let f = frame(9, 2, 300_000);
    c.write_frame(&f.body, &f.payload).await.unwrap();
    let back = tokio::time::timeout(T, c.read_frame())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(back.payload(), &f.payload[..]);
    // Alice's key relabelled as bob's: the router derives bob's key, which differs.
    let text = Credentials::issue_frontend(&master, "fe-cluster", "alice", 1)
        .to_file_text()
        .replace("frontend = alice", "frontend = bob");
    let mut forged = client.clone();
    forged.credentials = Some(Arc::new(Credentials::parse(&text, "forged").unwrap()));
    let e = FrameConnection::connect(addr, &forged)
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("authentication"), "{e}");
    // The honest connection goes on.
    c.write_frame(&f.body, &f.payload).await.unwrap();
    tokio::time::timeout(T, c.read_frame())
        .await
        .unwrap()
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_beyond_the_handshake_limit_are_closed_at_once() {
    use tokio::io::AsyncReadExt;
    let mut server = FrontendConfig::new("gate");
    server.handshake_gate = HandshakeGate::new(2, 64);
    server.handshake_timeout = Duration::from_secs(600);
    let gate = server.handshake_gate.clone();
    let l = FrameListener::bind("127.0.0.1:0".parse().unwrap(), server)
        .await
        .unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(echo_server(l));
    // Two silent connections hold the source address's two handshake places.
    let _a = tokio::net::TcpStream::connect(addr).await.unwrap();
    let _b = tokio::net::TcpStream::connect(addr).await.unwrap();
    let deadline = tokio::time::Instant::now() + T;
    while gate.in_progress() < 2 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "handshakes not admitted"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // A third is closed before anything is read from it, long before the silent ones' 600 s
    // handshake timeout could free a place (the wait is a hang guard, not a budget).
    let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut b = [0u8; 1];
    let r = tokio::time::timeout(2 * T, c.read(&mut b)).await;
    assert!(
        matches!(r, Ok(Ok(0)) | Ok(Err(_))),
        "third connection not closed: {r:?}"
    );
    assert_eq!(gate.in_progress(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_beyond_the_memory_budget_is_told_why_and_closed() {
    let mut server = FrontendConfig::new("budget");
    server.codec.max_frame_bytes = 1 << 20;
    // Room for one connection's reservation (two maximum frames), not two.
    server.memory_budget = expertmesh_transport::MemoryBudget::new(3 << 20);
    server.credentials = Some(Arc::new(Credentials::shared_secret(b"budget test")));
    let l = FrameListener::bind("127.0.0.1:0".parse().unwrap(), server.clone())
        .await
        .unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(echo_server(l));
    let mut client = server.clone();
    client.memory_budget = expertmesh_transport::MemoryBudget::new(u64::MAX);
    let mut first = FrameConnection::connect(addr, &client).await.unwrap();
    // The server reserves a connection's buffers after its side of the handshake, which can end
    // after the client's: one echoed frame proves the first connection holds its reservation
    // before the second asks for one (otherwise either could be the one refused).
    let fr = frame(1, 1, 64);
    first.write_frame(&fr.body, &fr.payload).await.unwrap();
    tokio::time::timeout(T, first.read_frame())
        .await
        .unwrap()
        .unwrap();
    let mut second = FrameConnection::connect(addr, &client).await.unwrap();
    let f = tokio::time::timeout(T, second.read_frame())
        .await
        .unwrap()
        .unwrap();
    match f.body() {
        Body::Error(e) => assert!(e.message.contains("memory budget"), "{}", e.message),
        other => panic!("expected an error frame, got {other:?}"),
    }
    // The first connection is still served.
    let fr = frame(2, 1, 64);
    first.write_frame(&fr.body, &fr.payload).await.unwrap();
    tokio::time::timeout(T, first.read_frame())
        .await
        .unwrap()
        .unwrap();
}
