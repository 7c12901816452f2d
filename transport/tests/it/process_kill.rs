//! A peer *process* killed with SIGKILL (or frozen with SIGSTOP) mid-stream, over TCP and shared
//! memory: the survivor's pending sends fail with an error naming the rank (for a frozen peer,
//! after the idle timeout, also a send blocked in the write itself because the peer's socket
//! buffers are full), a `PeerLost` event is emitted, later sends fail fast, and no
//! shared-memory segment is left behind.
//!
//! Why this exists: an in-process shutdown closes sockets politely; a crashed process does not.
//! The child rank is this same test binary re-executed with `EXPERTMESH_CHILD_*` variables.

use crate::support::{peers, result_body};
use expertmesh_transport::{
    LinkKind, Mesh, MeshConfig, OutFrame, OutputDtype, Transport, TransportEvent,
};
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::Duration;

const T: Duration = Duration::from_secs(30);

/// The receive window of most cases: the sender waits for credit long before the socket
/// buffers or the 1 MiB ring are full.
const SMALL_WINDOW: u64 = 512 << 10;
/// A window larger than loopback socket buffers hold: a sender to a frozen peer blocks in the
/// write, with credit left. (A shared-memory link caps its window at what its ring holds, so
/// there the sender waits for credit, as in the cases above.)
const LARGE_WINDOW: u64 = 256 << 20;

fn config(
    kind: LinkKind,
    rank: u32,
    addrs: &[SocketAddr],
    dir: &std::path::Path,
    window: u64,
) -> MeshConfig {
    let mut c = MeshConfig::new("kill-test", rank, peers(addrs, kind));
    c.protocol.codec.max_frame_bytes = 256 << 10;
    c.protocol.recv_window_bytes = window;
    c.shm.dir = dir.to_path_buf();
    c.shm.ring_bytes = 1 << 20;
    c.shm.spin_us = 0;
    c.protocol.heartbeat_interval = Duration::from_millis(100);
    // Long enough that a loaded machine's stall of either process (heartbeats every 100 ms)
    // is not taken for a silent peer before the failure the test makes.
    c.protocol.idle_timeout = IDLE;
    c
}

/// The links' idle timeout (a stopped peer is declared silent after it).
const IDLE: Duration = Duration::from_secs(5);

fn frame() -> OutFrame {
    let body = result_body([1, 0, 0], 100, 300, OutputDtype::Bf16);
    OutFrame::with_payload(body, vec![1u8; 60_000])
}

/// The child rank: joins the mesh and never consumes what it receives. Its spec (in
/// `EXPERTMESH_CHILD_SPEC`): `tcp|shm,ADDR0,ADDR1,DIR,WINDOW[,IDLE_MS]`.
#[test]
fn child_rank() {
    let Ok(spec) = std::env::var("EXPERTMESH_CHILD_SPEC") else {
        return; // not a child invocation
    };
    let parts: Vec<&str> = spec.split(',').collect();
    let kind = if parts[0] == "shm" {
        LinkKind::Shm
    } else {
        LinkKind::Tcp
    };
    let addrs: Vec<SocketAddr> = parts[1..3].iter().map(|a| a.parse().unwrap()).collect();
    let dir = std::path::PathBuf::from(parts[3]);
    let window: u64 = parts[4].parse().unwrap();
    let mut cfg = config(kind, 1, &addrs, &dir, window);
    if let Some(idle_ms) = parts.get(5) {
        cfg.protocol.idle_timeout = Duration::from_millis(idle_ms.parse().unwrap());
    }
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let (_mesh, _events) = Mesh::start(cfg).await.unwrap();
        // Hold everything; the parent kills us. Give up after a while in case it does not.
        tokio::time::sleep(Duration::from_secs(30)).await;
    });
}

/// Kills the child when the test ends, even on a failed assertion (a SIGSTOPped child would
/// otherwise stay behind).
struct ChildGuard(std::process::Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// This test binary re-executed as [`child_rank`] with `spec` (see there), killed when the
/// guard is dropped.
fn spawn_child(spec: &str) -> ChildGuard {
    let child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "process_kill::child_rank",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("EXPERTMESH_CHILD_SPEC", spec)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    ChildGuard(child)
}

/// How the child is made to fail.
#[derive(Clone, Copy, PartialEq)]
enum Failure {
    /// SIGKILL: its sockets are closed by the kernel.
    Kill,
    /// SIGSTOP: it stays connected but silent; only the idle timeout can tell.
    Stop,
    /// SIGSTOP before anything is sent to it over TCP, with a receive window larger than the
    /// socket buffers: the sender blocks in the write itself (with credit left), and the idle
    /// timeout must end that write too (a frozen peer's kernel keeps answering TCP's window
    /// probes, so the socket alone would wait for ever).
    StopBeforeSends,
}

async fn failed_peer(kind: LinkKind, how: Failure) {
    // Below the ephemeral range: the child binds its port later, and no outgoing connection
    // may take it meanwhile.
    let base = expertmesh_transport::ports::free_loopback_ports(2).unwrap();
    let addrs: Vec<SocketAddr> = (base..base + 2)
        .map(|p| SocketAddr::from(([127, 0, 0, 1], p)))
        .collect();
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    let window = if how == Failure::StopBeforeSends {
        LARGE_WINDOW
    } else {
        SMALL_WINDOW
    };
    let mut cfg = config(kind, 0, &addrs, dir.path(), window);
    if how == Failure::StopBeforeSends {
        // Room for the checks made while the peer is frozen (a cancelled send of 100 ms
        // included) before the idle timeout ends the link, on a slow or busy machine too.
        cfg.protocol.idle_timeout = Duration::from_secs(10);
    }
    let (mesh, mut events) = Mesh::start(cfg).await.unwrap();
    let spec = format!(
        "{},{},{},{},{window}",
        if kind == LinkKind::Shm { "shm" } else { "tcp" },
        addrs[0],
        addrs[1],
        dir.path().display()
    );
    let mut child = spawn_child(&spec);
    mesh.wait_connected(&[1], T).await.unwrap();
    assert_eq!(mesh.link_kind(1), Some(kind));
    let mut started = std::time::Instant::now();
    if how == Failure::StopBeforeSends {
        // SAFETY: signalling our own child process.
        unsafe { libc::kill(child.0.id() as libc::pid_t, libc::SIGSTOP) };
    }
    let m = mesh.clone();
    let pending = tokio::spawn(async move {
        loop {
            if let Err(e) = m.send(1, &frame()).await {
                return e;
            }
        }
    });
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert!(
        !pending.is_finished(),
        "sender waits for credit from the non-consuming child, or for room"
    );
    if how == Failure::StopBeforeSends {
        // Once the stopped child's socket is full the writer is busy: a second send takes
        // credit, then waits for it; cancelled there, it gives the credit back. (Probed until
        // then: a loaded machine may not have filled the socket yet, and a probe that is
        // written just adds to it.)
        let guard = std::time::Instant::now();
        loop {
            let stats = mesh.peer_stats(1).expect("the link is up");
            assert!(
                stats.send_credit > 0,
                "the sender waits in the write, not for credit: {stats:?}"
            );
            let waited =
                tokio::time::timeout(Duration::from_millis(100), mesh.send(1, &frame())).await;
            if waited.is_err() {
                let after = mesh.peer_stats(1).expect("the link is up");
                assert_eq!(
                    after.send_credit, stats.send_credit,
                    "a send cancelled before it was written keeps no credit"
                );
                break;
            }
            assert!(
                guard.elapsed() < Duration::from_secs(30),
                "the writer never got busy with the child stopped: {waited:?}"
            );
        }
    } else {
        started = std::time::Instant::now();
    }
    match how {
        Failure::Kill => {
            child.0.kill().unwrap(); // SIGKILL
            let _ = child.0.wait();
        }
        Failure::Stop => {
            // SAFETY: signalling our own child process.
            unsafe { libc::kill(child.0.id() as libc::pid_t, libc::SIGSTOP) };
        }
        Failure::StopBeforeSends => {}
    }
    let err = tokio::time::timeout(T, pending)
        .await
        .expect("pending send fails")
        .unwrap();
    assert_eq!(err.peer, 1, "{err}");
    if how == Failure::Kill {
        // The peer's side failed: not reported as a local close.
        assert!(
            err.to_string().contains("connection failed") && !err.to_string().contains("locally"),
            "{err}"
        );
    }
    if how != Failure::Kill {
        assert!(
            err.to_string().contains("silent"),
            "idle timeout reported: {err}"
        );
        assert!(
            started.elapsed() >= IDLE * 4 / 5,
            "not before the idle timeout"
        );
    }
    let lost = loop {
        match tokio::time::timeout(T, events.recv()).await.expect("event") {
            Some(TransportEvent::PeerLost(e)) => break e,
            Some(_) => continue,
            None => panic!("events ended"),
        }
    };
    assert_eq!(lost.peer, 1);
    let again = mesh.send(1, &frame()).await.unwrap_err();
    assert_eq!(again.peer, 1);
    let left: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .collect();
    assert!(left.is_empty(), "segments left behind: {left:?}");
    mesh.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_peer_process_tcp() {
    failed_peer(LinkKind::Tcp, Failure::Kill).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_peer_process_shm() {
    // Two rings of 1 MiB.
    let Some(_shm) = crate::support::shm_room(8 << 20).await else {
        return;
    };
    failed_peer(LinkKind::Shm, Failure::Kill).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopped_peer_process_times_out_tcp() {
    failed_peer(LinkKind::Tcp, Failure::Stop).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopped_peer_process_times_out_shm() {
    // Two rings of 1 MiB.
    let Some(_shm) = crate::support::shm_room(8 << 20).await else {
        return;
    };
    failed_peer(LinkKind::Shm, Failure::Stop).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_blocked_on_a_frozen_peer_ends_at_the_idle_timeout() {
    failed_peer(LinkKind::Tcp, Failure::StopBeforeSends).await;
}

/// A frozen peer process whose rank is taken over by a new process before the idle timeout
/// (its link silent past the live window): the mesh replaces the old link and reports it lost
/// before the new one is up, so the application does not wait for answers on the old link
/// until their deadlines.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_link_replaced_by_a_new_process_is_reported_lost_first() {
    let base = expertmesh_transport::ports::free_loopback_ports(3).unwrap();
    let addrs: Vec<SocketAddr> = (base..base + 3)
        .map(|p| SocketAddr::from(([127, 0, 0, 1], p)))
        .collect();
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    // An idle timeout far past the live window (two 100 ms heartbeats) and this test: only
    // the new connection can end the old link, however slow the machine.
    let idle = Duration::from_secs(600);
    let tcp = |rank, a: [SocketAddr; 2]| {
        let mut c = config(LinkKind::Tcp, rank, &a, dir.path(), SMALL_WINDOW);
        c.protocol.idle_timeout = idle;
        c
    };
    let (mesh, mut events) = Mesh::start(tcp(0, [addrs[0], addrs[1]])).await.unwrap();
    let spec = format!(
        "tcp,{},{},{},{SMALL_WINDOW},{}",
        addrs[0],
        addrs[1],
        dir.path().display(),
        idle.as_millis()
    );
    let child = spawn_child(&spec);
    mesh.wait_connected(&[1], T).await.unwrap();
    // SAFETY: signalling our own child process.
    unsafe { libc::kill(child.0.id() as libc::pid_t, libc::SIGSTOP) };
    // The same rank again, from this process (its own listening address).
    let (second, _second_events) = Mesh::start(tcp(1, [addrs[0], addrs[2]])).await.unwrap();
    // Rank 1's notices: up (the child), then the takeover.
    let mut seen: Vec<String> = Vec::new();
    while seen.iter().filter(|s| *s == "up").count() < 2 {
        let ev = tokio::time::timeout(T, events.recv())
            .await
            .expect("an event within 30 s")
            .expect("events go on");
        match ev {
            TransportEvent::PeerLost(e) if e.peer == 1 => seen.push(format!("lost: {e}")),
            TransportEvent::PeerUp { peer: 1, .. } => seen.push("up".into()),
            _ => {}
        }
    }
    assert_eq!(seen.len(), 3, "up, lost, up: {seen:?}");
    assert!(
        seen[1].starts_with("lost") && seen[1].contains("superseded"),
        "{seen:?}"
    );
    second.shutdown();
    mesh.shutdown();
}
