//! Helpers shared by the transport's integration tests: free loopback ports, a mesh's peer
//! list, a per-slot result frame's body, and an independent CRC-32C.

use expertmesh_transport::codec::{Body, ExpertResult, OutputLayout};
use expertmesh_transport::{LinkKind, OutputDtype, PeerAddress};
use std::net::SocketAddr;

/// `n` distinct free addresses (loopback unless `EM_TEST_BIND_IP` says), below the kernel's ephemeral range
/// ([`expertmesh_transport::ports`]): a mesh binds them only after other meshes in the same
/// test have dialled out, and a port from the ephemeral range (binding port 0) could be taken
/// by such an outgoing connection in between ("Address already in use", seen in CI).
pub(crate) fn free_addrs(n: usize) -> Vec<SocketAddr> {
    // scripts/rdma-rxe-check.sh points the suite at a Soft-RoCE device's address when the
    // kernel cannot attach rxe to loopback.
    let ip: std::net::IpAddr = std::env::var("EM_TEST_BIND_IP")
        .unwrap_or_else(|_| "127.0.0.1".into())
        .parse()
        .expect("EM_TEST_BIND_IP is an IP address");
    (0..n)
        .map(|_| {
            let port = expertmesh_transport::ports::free_ports(ip, 1).expect("a free port");
            SocketAddr::new(ip, port)
        })
        .collect()
}

/// Every rank at `addrs`, linked by `link`.
pub(crate) fn peers(addrs: &[SocketAddr], link: LinkKind) -> Vec<PeerAddress> {
    addrs
        .iter()
        .map(|&addr| PeerAddress { addr, link })
        .collect()
}

/// A per-slot result: part `part` of batch `batch_id` for `layer`, `rows` rows of `hidden`
/// values in `dtype`.
pub(crate) fn result_body(
    [batch_id, layer, part]: [u64; 3],
    rows: u32,
    hidden: u32,
    dtype: OutputDtype,
) -> Body {
    Body::Result(ExpertResult {
        batch_id,
        layer: layer as u32,
        part: part as u32,
        layout: OutputLayout::PerSlot,
        rows,
        hidden,
        dtype,
    })
}

/// Bitwise CRC-32C (Castagnoli), independent of the crate under test.
pub(crate) fn crc32c(data: &[u8]) -> u32 {
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

/// The next application frame on `events` within `timeout`; panics naming the cause when a
/// link is lost first (a frame sent on it may be lost with it, and waiting out the timeout
/// would hide why) or when nothing arrives in time.
pub(crate) async fn expect_frame(
    events: &mut expertmesh_transport::MeshEvents,
    timeout: std::time::Duration,
) -> expertmesh_transport::RecvFrame {
    use expertmesh_transport::TransportEvent;
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        match tokio::time::timeout_at(deadline, events.recv()).await {
            Ok(Some(TransportEvent::Frame(f))) => return f,
            Ok(Some(TransportEvent::PeerLost(e))) => panic!("a link was lost: {e}"),
            Ok(Some(_)) => continue,
            Ok(None) => panic!("the mesh shut down"),
            Err(_) => panic!("no frame within {timeout:?} (no link was lost)"),
        }
    }
}

/// Held by every test that puts shared-memory rings in `/dev/shm`, so that the room one test
/// finds free is not taken by another before its rings are made: without room a pair falls
/// back to TCP, correctly, and a test asserting shared-memory links would fail for a reason
/// that is not the transport's (a container's `/dev/shm` is 64 MiB by default).
/// (An async mutex: it is held across the test's awaits, on that test's own runtime.)
static SHM: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The `/dev/shm` guard ([`SHM`]) when `/dev/shm` has `need` bytes free (taken first, so the
/// room stays free for the caller); `None`, saying so on the real stderr, where it has not:
/// the caller skips.
pub(crate) async fn shm_room(need: u64) -> Option<tokio::sync::MutexGuard<'static, ()>> {
    let guard = SHM.lock().await;
    // The previous holder's rings may still be on their way out (removed as its tasks end):
    // room that appears within a few seconds is room.
    let mut free = shm_free_bytes();
    for _ in 0..50 {
        if free >= need {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        free = shm_free_bytes();
    }
    if free < need {
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "skipped: /dev/shm has {} MiB free, this test's shared-memory rings need {} MiB",
            free >> 20,
            need >> 20
        );
        return None;
    }
    Some(guard)
}

/// Bytes free in `/dev/shm` (0 where it cannot be read).
fn shm_free_bytes() -> u64 {
    expertmesh_files::free_bytes(std::path::Path::new("/dev/shm")).unwrap_or(0)
}
