//! The RDMA link under the faults real NICs produce, on the in-process NIC
//! (`expertmesh_transport::rdma::sim`): completions batched, delayed or out of order, writes
//! refused until the connection is up, ring wrap, a failed completion, a write with no receive
//! posted, a corrupt immediate, a peer that vanishes.
//!
//! The rule each test checks: a fault is survived (every frame arrives, intact, in order) or it
//! ends the link with a clean error (the sender's call fails naming the peer, or the link is
//! reported lost); a frame is never delivered corrupt, twice or out of order, and nothing hangs.

use crate::support::{free_addrs, peers, result_body};
use expertmesh_transport::codec::CodecConfig;
use expertmesh_transport::rdma::RdmaProvider;
use expertmesh_transport::rdma::sim::SimFaults;
use expertmesh_transport::{
    Body, LinkKind, Mesh, MeshConfig, MeshEvents, OutFrame, OutputDtype, Transport, TransportEvent,
};
use std::time::{Duration, Instant};

const MAX_FRAME: usize = 64 << 10;
/// How long a run may take before it is called a hang: a guard, not a budget (a survived run
/// ends at its last frame, a failed one 2 s after its failure is reported and its last frame
/// came), generous for a busy machine.
const T: Duration = Duration::from_secs(60);

/// Ranks 0 (receiver) and 1 (sender) linked by the in-process NIC with the given faults; `ring`
/// bytes per RDMA ring.
async fn pair(receiver: SimFaults, sender: SimFaults, ring: usize) -> (Vec<Mesh>, Vec<MeshEvents>) {
    let addrs = free_addrs(2);
    let mut meshes = Vec::new();
    let mut events = Vec::new();
    for (rank, faults) in [(0u32, receiver), (1, sender)] {
        let mut c = MeshConfig::new("rdma-faults", rank, peers(&addrs, LinkKind::Rdma));
        c.protocol.codec = CodecConfig {
            max_frame_bytes: MAX_FRAME,
            payload_checksum: true,
        };
        c.protocol.handshake_timeout = Duration::from_secs(2);
        c.protocol.heartbeat_interval = Duration::from_millis(200);
        c.protocol.idle_timeout = idle_timeout(&faults);
        c.reconnect_initial = Duration::from_millis(5);
        c.reconnect_max = Duration::from_millis(50);
        c.shm.ring_bytes = ring;
        c.rdma_provider = RdmaProvider::InProcess(faults);
        let (m, e) = Mesh::start(c).await.unwrap();
        meshes.push(m);
        events.push(e);
    }
    meshes[1].wait_connected(&[0], T).await.unwrap();
    assert_eq!(meshes[1].link_kind(0), Some(LinkKind::Rdma));
    (meshes, events)
}

/// The protocol's idle timeout of a rank whose endpoint has `faults`. A receiver with no
/// receive posted (verbs retries a write to it forever) ends the link only by its idle timeout,
/// and a sender whose every write is refused gives up on a write after its idle timeout, so
/// those ranks use a short one; every other rank a long one, because a heartbeat delayed past a
/// short timeout on a busy machine would end a link the test expects to survive.
fn idle_timeout(faults: &SimFaults) -> Duration {
    if faults.no_receives || faults.again_first == u32::MAX {
        Duration::from_secs(1)
    } else {
        Duration::from_secs(30)
    }
}

/// Frame `id`: a result whose payload size varies with the id (so records of many sizes wrap
/// the ring at many offsets; every 50th is near the frame limit) and whose bytes encode it.
fn frame(id: u64) -> OutFrame {
    let rows = if id % 50 == 49 {
        200
    } else {
        (id * 7 % 23) as u32
    };
    let body = result_body([id, 3, 1], rows, 128, OutputDtype::Bf16);
    OutFrame::with_payload(body, payload(id, rows as usize * 256))
}

/// Frame `id` with no payload: a 100-odd-byte record, so thousands fit in the credit window.
fn tiny_frame(id: u64) -> OutFrame {
    OutFrame::new(result_body([id, 3, 1], 0, 128, OutputDtype::Bf16))
}

fn payload(id: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(29) ^ id as u8)
        .collect()
}

/// The id of a received frame, after checking its payload against [`frame`].
fn check(f: &expertmesh_transport::RecvFrame) -> u64 {
    let id = f.body().request_id().expect("a result frame");
    assert_eq!(
        f.payload(),
        payload(id, f.payload().len()),
        "frame {id} arrived intact"
    );
    let Body::Result(r) = f.body() else {
        unreachable!()
    };
    assert_eq!(
        f.payload().len(),
        r.rows as usize * 256,
        "frame {id} has its length"
    );
    id
}

/// Sends `n` frames from rank 1 to rank 0 and collects what arrives: (ids received in order,
/// errors the sender saw, links reported lost on either side).
async fn run(meshes: &[Mesh], events: &mut [MeshEvents], n: u64) -> (Vec<u64>, Vec<String>, usize) {
    run_frames(meshes, events, n, frame).await
}

/// [`run`] with frames from `make`.
async fn run_frames(
    meshes: &[Mesh],
    events: &mut [MeshEvents],
    n: u64,
    make: fn(u64) -> OutFrame,
) -> (Vec<u64>, Vec<String>, usize) {
    let m1 = meshes[1].clone();
    let mut sender = tokio::spawn(async move {
        let mut errors = Vec::new();
        for id in 0..n {
            if let Err(e) = m1.send(0, &make(id)).await {
                errors.push(e.to_string());
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }
        errors
    });
    let mut got = Vec::new();
    let mut lost = 0;
    let mut errors: Option<Vec<String>> = None;
    let t0 = Instant::now();
    let mut idle_since = Instant::now();
    while t0.elapsed() < T {
        match tokio::time::timeout(Duration::from_millis(50), events[0].recv()).await {
            Ok(Some(TransportEvent::Frame(f))) => {
                let id = check(&f);
                if let Some(&last) = got.last() {
                    assert!(
                        id > last,
                        "frame {id} after {last}: never twice, never out of order"
                    );
                }
                got.push(id);
                idle_since = Instant::now();
                if id + 1 == n {
                    break;
                }
            }
            Ok(Some(TransportEvent::PeerLost(_))) => lost += 1,
            Ok(Some(_)) => {}
            Ok(None) => break,
            Err(_) => {
                lost += count_lost(&mut events[1]);
                if errors.is_none() && sender.is_finished() {
                    errors = Some((&mut sender).await.unwrap());
                }
                // A failure was reported and nothing came for 2 s since: what was lost with
                // the link will not come. Without a reported failure the run waits for its
                // last frame (however slow the machine), up to the hang guard `T`.
                let failed = lost > 0 || errors.as_ref().is_some_and(|e| !e.is_empty());
                if failed && idle_since.elapsed() > Duration::from_secs(2) {
                    break;
                }
            }
        }
    }
    lost += count_lost(&mut events[1]);
    let errors = match errors {
        Some(errors) => errors,
        None => tokio::time::timeout(T, sender)
            .await
            .expect("the sender never hangs")
            .unwrap(),
    };
    (got, errors, lost)
}

/// Links reported lost among the events waiting on `events`.
fn count_lost(events: &mut MeshEvents) -> usize {
    let mut lost = 0;
    while let Some(ev) = events.try_recv() {
        if matches!(ev, TransportEvent::PeerLost(_)) {
            lost += 1;
        }
    }
    lost
}

async fn survived(receiver: SimFaults, sender: SimFaults, ring: usize) {
    let (meshes, mut events) = pair(receiver, sender, ring).await;
    let n = 400;
    let (got, errors, lost) = run(&meshes, &mut events, n).await;
    assert!(errors.is_empty(), "sends failed: {errors:?}");
    assert_eq!(lost, 0, "no link was lost");
    assert_eq!(got, (0..n).collect::<Vec<_>>(), "every frame, in order");
}

/// A fault that must end the link cleanly: some frames may be lost with it, the rest arrive
/// intact and in order (checked in `run`), and the failure is reported.
async fn clean_failure(receiver: SimFaults, sender: SimFaults) -> (Vec<u64>, Vec<String>) {
    let (meshes, mut events) = pair(receiver, sender, 4 * MAX_FRAME).await;
    let (got, errors, lost) = run(&meshes, &mut events, 200).await;
    assert!(
        !errors.is_empty() || lost > 0,
        "the fault was neither survived nor reported (received {} of 200)",
        got.len()
    );
    for e in &errors {
        assert!(e.starts_with("rank 0:"), "a send error names the peer: {e}");
    }
    (got, errors)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_delayed_and_reordered_completions_are_survived() {
    let receiver = SimFaults {
        batch: 8,
        delay: Duration::from_micros(300),
        reorder: true,
        ..Default::default()
    };
    let sender = SimFaults {
        batch: 5,
        reorder: true,
        ..Default::default()
    };
    survived(receiver, sender, 4 * MAX_FRAME).await;
}

/// More writes in flight than receives posted (the receiver's completions show late, so it
/// re-posts late): the extra writes wait for receives, as verbs' RNR retries make them, and
/// every frame still arrives in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_beyond_the_posted_receives_wait_for_them() {
    let receiver = SimFaults {
        batch: 64,
        delay: Duration::from_millis(3),
        ..Default::default()
    };
    let (meshes, mut events) = pair(receiver, SimFaults::default(), 4 * MAX_FRAME).await;
    let n = 3000;
    let (got, errors, lost) = run_frames(&meshes, &mut events, n, tiny_frame).await;
    assert!(errors.is_empty() && lost == 0, "{errors:?} lost {lost}");
    assert_eq!(got, (0..n).collect::<Vec<_>>(), "every frame, in order");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_refused_until_the_connection_is_up_are_retried() {
    let sender = SimFaults {
        again_first: 200,
        ..Default::default()
    };
    survived(SimFaults::default(), sender, 4 * MAX_FRAME).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_ring_wraps_many_times() {
    // The smallest ring the mesh accepts: two maximal frames and their record headers.
    survived(
        SimFaults {
            reorder: true,
            batch: 3,
            ..Default::default()
        },
        SimFaults::default(),
        2 * MAX_FRAME + 128,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_write_completion_ends_the_link_cleanly() {
    let sender = SimFaults {
        fail_write: Some(20),
        ..Default::default()
    };
    let (got, _) = clean_failure(SimFaults::default(), sender).await;
    assert!(
        got.len() >= 15,
        "frames before the failed write arrived: {got:?}"
    );
}

/// Verbs retries a write that finds no receive posted without end (`rnr_retry` 7): nothing
/// lands, the receiver hears nothing from the sender and closes the link at its idle timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_with_no_receive_posted_fails_cleanly() {
    let receiver = SimFaults {
        no_receives: true,
        ..Default::default()
    };
    let (got, errors) = clean_failure(receiver, SimFaults::default()).await;
    assert!(
        got.is_empty(),
        "nothing can land without a receive: {got:?}"
    );
    assert!(!errors.is_empty());
}

/// A provider that refuses every write ("try again" forever, as libfabric's `tcp;ofi_rxm` does
/// when its peer is gone): nothing lands, every send fails naming the peer (by the writer's
/// bound, the sender's idle timeout, or a link already lost), and nothing hangs. The writer's
/// bound itself is checked in `rdma::tests`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_refused_forever_end_the_link_cleanly() {
    let sender = SimFaults {
        again_first: u32::MAX,
        ..Default::default()
    };
    // Few frames: each send on a link that comes back (the mesh redials) waits the idle
    // timeout again before it fails.
    let (meshes, mut events) = pair(SimFaults::default(), sender, 4 * MAX_FRAME).await;
    let (got, errors, _) = run(&meshes, &mut events, 3).await;
    assert!(
        got.is_empty(),
        "nothing can land when every write is refused: {got:?}"
    );
    assert_eq!(errors.len(), 3, "every send failed: {errors:?}");
    for e in &errors {
        assert!(e.starts_with("rank 0:"), "a send error names the peer: {e}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_immediate_ends_the_link_cleanly() {
    let sender = SimFaults {
        bad_immediate: Some(30),
        ..Default::default()
    };
    let (got, _) = clean_failure(SimFaults::default(), sender).await;
    assert!(
        got.len() >= 25,
        "frames before the corrupt one arrived: {got:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vanished_peer_ends_the_link_cleanly() {
    let receiver = SimFaults {
        vanish_after: Some(40),
        ..Default::default()
    };
    clean_failure(receiver, SimFaults::default()).await;
}
