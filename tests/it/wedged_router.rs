//! A router that stops taking a worker's answers must not stop that worker for the other
//! routers. A real `expertmesh worker` process joins two routers played by this test with the
//! deployment's own mesh settings (`Deployment::mesh_config`, so the handshake and the
//! fingerprints are the real ones): router 0 sends more dispatches than its receive window
//! can hold answers for and never takes a frame (its core wedged while its I/O still answers
//! heartbeats, so the worker's send credit never comes back); router 1 then sends one
//! dispatch. The worker must answer router 1 and close router 0's link (and redial it) after
//! its stall bound (60 s, the longest default deadline); before, its compute thread waited on
//! router 0 for ever.
//!
//! Also here, with the same two routers and worker: a worker's error frame names the part of
//! the dispatch it answers.
//!
//! No time is asserted: the waits are hang guards (120 s) against "never".

use expertmesh_transport::codec::{Body, ComputeMode, Dispatch, OutputLayout};
use expertmesh_transport::dtype::{ActivationDtype, OutputDtype};
use expertmesh_transport::mesh::{LinkKind, Mesh, MeshEvents, OutFrame, Transport};
use expertmesh_worker::deploy::Deployment;
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::support::root;

/// Hang guard of every wait: past the worker's 60 s bound on a stalled router.
const GUARD: Duration = Duration::from_secs(120);

/// Tokens of each dispatch (the worker's default `--max-tokens`).
const TOKENS: usize = 64;

/// Payload bytes of one answer: two f32 rows of demo-small's 1024 per token.
const ANSWER_BYTES: u64 = (2 * TOKENS * 1024 * 4) as u64;

/// The worker process; killed on drop.
struct Worker(Child);

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A dispatch of `TOKENS` tokens for `layer`, two of cpu0's experts per token, exact mode
/// with one f32 row per (token, expert) back: 512 KiB of answer for 128 KiB sent.
fn dispatch(batch_id: u64, layer: u32, hidden: usize) -> OutFrame {
    let pairs = 2 * TOKENS;
    let body = Body::Dispatch(Dispatch {
        batch_id,
        layer,
        part: 0,
        tokens: TOKENS as u32,
        hidden: hidden as u32,
        dtype: ActivationDtype::Bf16,
        mode: ComputeMode::Exact,
        layout: OutputLayout::PerSlot,
        result_dtype: OutputDtype::F32,
        expert_counts: vec![2; TOKENS],
        experts: (0..pairs as u32).map(|i| i % 16).collect(),
        weights: vec![0.5; pairs],
    });
    // bf16 0.0625 and -0.0625 in turn: finite activations.
    let payload: Vec<u8> = (0..TOKENS * hidden)
        .flat_map(|i| {
            if i % 2 == 0 {
                [0x80, 0x3d]
            } else {
                [0x80, 0xbd]
            }
        })
        .collect();
    OutFrame::with_payload(body, payload)
}

/// Waits until `ok` holds, polling; panics naming `what` after [`GUARD`].
async fn wait_until(what: &str, mut ok: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !ok() {
        assert!(t0.elapsed() < GUARD, "{what}: not within {GUARD:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The first result or error frame for `batch_id` on `events`, or `None` after [`GUARD`].
async fn answer_to(events: &mut MeshEvents, batch_id: u64) -> Option<Body> {
    let t0 = Instant::now();
    while let Some(left) = GUARD.checked_sub(t0.elapsed()) {
        let f = events.recv_frame(left).await?;
        match f.body() {
            Body::Result(r) if r.batch_id == batch_id => return Some(f.body().clone()),
            Body::Error(e) if e.request_id == batch_id => return Some(f.body().clone()),
            _ => continue, // the worker's holdings announcement
        }
    }
    None
}

/// Two routers played by this test (their meshes and events, from
/// `examples/single-host-2routers.toml`) and a real worker for `local/cpu0` (mesh rank
/// `rank`) that has joined both.
struct TwoRouters {
    dep: Deployment,
    rt: tokio::runtime::Runtime,
    meshes: [(Mesh, MeshEvents); 2],
    rank: u32,
    _worker: Worker,
}

impl TwoRouters {
    fn start() -> Self {
        let topology = root().join("examples/single-host-2routers.toml");
        let placement = root().join("examples/single-host-demo-small.placement.toml");
        let dep = Deployment::load(&topology, "demo-small", &placement, 42).unwrap();
        let base = expertmesh_transport::ports::free_loopback_ports(3).unwrap();
        let addr = |i: u16| SocketAddr::from(([127, 0, 0, 1], base + i));
        let (r0, r1, worker_listen) = (addr(0), addr(1), addr(2));
        let rt = crate::support::rt();
        let start = |instance: u32, listen: SocketAddr| {
            rt.block_on(Mesh::start(dep.mesh_config(
                instance,
                &[],
                &[],
                listen,
                LinkKind::Tcp,
            )))
            .expect("a router's mesh starts")
        };
        let meshes = [start(0, r0), start(1, r1)];
        let rank = dep.mesh_rank(dep.device("local/cpu0").unwrap());
        let worker = Worker(
            Command::new(env!("CARGO_BIN_EXE_expertmesh"))
                .args(["worker", "--topology"])
                .arg(&topology)
                .args(["--model", "demo-small", "--placement"])
                .arg(&placement)
                .args(["--seed", "42", "--device", "local/cpu0", "--threads", "1"])
                .args(["--exit-with-parent"])
                .arg(format!("--router={r0},{r1}"))
                .arg(format!("--listen={worker_listen}"))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .spawn()
                .unwrap(),
        );
        rt.block_on(wait_until("the worker joined both routers", || {
            meshes
                .iter()
                .all(|(m, _)| m.link_generation(rank) == Some(1))
        }));
        Self {
            dep,
            rt,
            meshes,
            rank,
            _worker: worker,
        }
    }
}

impl Drop for TwoRouters {
    fn drop(&mut self) {
        for (m, _) in &self.meshes {
            m.shutdown();
        }
    }
}

#[test]
fn a_router_that_takes_no_answers_does_not_stop_the_worker_for_the_other_router() {
    // Shared: nothing here depends on how fast the machine is.
    let _g = crate::support::shared();
    let mut setup = TwoRouters::start();
    let (dep, rt, rank) = (&setup.dep, &setup.rt, setup.rank);
    // Router 0's events are never read.
    let [(wedged, _), (healthy, healthy_events)] = &mut setup.meshes;
    rt.block_on(async {
        let layer = dep.spec.moe_layer_ids()[0];
        let hidden = dep.spec.hidden as usize;
        assert_eq!(hidden, 1024, "ANSWER_BYTES counts demo-small's rows");
        // Router 0: 96 dispatches, 48 MiB of answers against its 32 MiB receive window, and
        // not one frame taken (`_wedged_events` is never read). Sent from a task: the
        // worker's own window ends router 0's sends once it stops computing.
        let sender = {
            let wedged = wedged.clone();
            tokio::spawn(async move {
                for id in 1..=96u64 {
                    if wedged
                        .send(rank, &dispatch(id, layer, hidden))
                        .await
                        .is_err()
                    {
                        break;
                    }
                }
            })
        };
        // Once router 0's window has no room for another answer: the worker's next answer
        // to it waits for credit that never comes (or, with the fix, has waited out its
        // stall bound already and the link was closed).
        wait_until("router 0's window is full of untaken answers", || {
            wedged
                .peer_stats(rank)
                .is_some_and(|s| s.recv_window - s.recv_outstanding < ANSWER_BYTES)
                || wedged.link_generation(rank) != Some(1)
        })
        .await;
        healthy
            .send(rank, &dispatch(1_000, layer, hidden))
            .await
            .expect("router 1 sends its dispatch");
        match answer_to(healthy_events, 1_000).await {
            Some(Body::Result(r)) => assert_eq!(r.rows as usize, 2 * TOKENS),
            other => panic!(
                "router 1's dispatch was not answered while router 0 took no answers: {other:?}"
            ),
        }
        // Router 0's link was closed after the worker's stall bound, and redialled.
        wait_until("the worker redialled router 0", || {
            wedged.link_generation(rank).is_some_and(|g| g >= 2)
        })
        .await;
        sender.abort();
    });
}

/// A worker's error frame names the part of the dispatch it answers, as its results do (the
/// router tells a quarantine probe's error from a live part's by it).
#[test]
fn a_workers_error_names_the_part_it_answers() {
    let _g = crate::support::shared();
    let mut setup = TwoRouters::start();
    let layer = setup.dep.spec.moe_layer_ids()[0];
    let hidden = setup.dep.spec.hidden as usize;
    let routed = setup.dep.spec.routed_experts;
    let mut frame = dispatch(5, layer, hidden);
    let Body::Dispatch(d) = &mut frame.body else {
        unreachable!("a dispatch")
    };
    d.part = 3;
    d.experts.fill(routed + 1); // no such expert
    let (mesh, events) = &mut setup.meshes[1];
    let answer = setup.rt.block_on(async {
        mesh.send(setup.rank, &frame).await.expect("sent");
        answer_to(events, 5).await
    });
    match answer {
        Some(Body::Error(e)) => assert_eq!(e.part, Some(3), "{e:?}"),
        other => panic!("a dispatch of an expert that does not exist was answered {other:?}"),
    }
}
