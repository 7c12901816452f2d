//! The leaner wire and the batch window end to end: real worker processes over TCP and shared
//! memory, the router service in the test process, frontends over real sockets.
//!
//! Checks: exact-bf16 bit-identical to the reference whose expert outputs are rounded to bf16;
//! serving mode within its stated tolerance of the f64 reference (RMS < 2%, worst element
//! < 12% of the output RMS, as exact mode; `worker/tests/it/wire_modes.rs` states and tests the
//! bf16 part separately) with a fraction of exact mode's result bytes; and a lone frontend does
//! not wait for a long batch window, while one with a second (idle) frontend connected does.

use crate::support::{bits, demo_options, rt};
use expertmesh_fabric::local::{LocalFabric, LocalFabricOptions};
use expertmesh_quant::contract::ComputeMode;
use expertmesh_router::client::RouterClient;
use expertmesh_router::core::LayerMode;
use expertmesh_router::reference::{self, ExpertRounding};
use expertmesh_transport::mesh::LinkKind;
use std::time::{Duration, Instant};

/// The shared demo-small fabric options in `mode` over `link`, batching for `window`.
fn options(link: LinkKind, mode: LayerMode, window: Duration) -> LocalFabricOptions {
    let mut o = demo_options("single-host.toml", link);
    o.router.mode = mode;
    o.router.batch_window = window;
    o
}

/// Calls `layer` with 20 tokens in `mode` over `link`; returns the output and the result
/// payload bytes the router received.
fn serve(link: LinkKind, mode: LayerMode, layer: u32, x: &[f32]) -> (Vec<f32>, u64) {
    let fabric = LocalFabric::start(options(link, mode, Duration::from_micros(100))).unwrap();
    let h = fabric.deployment().spec.hidden as usize;
    let rt = rt();
    let cfg = fabric.frontend_config();
    let mut c = rt
        .block_on(RouterClient::connect(fabric.frontend_addr(), &cfg))
        .unwrap();
    let got = rt.block_on(c.call(layer, x, h, None, None)).unwrap();
    let bytes = fabric.service().stats().result_payload_bytes;
    fabric.shutdown();
    (got, bytes)
}

#[test]
fn exact_bf16_and_serving_over_real_links() {
    let _machine = crate::support::shared();
    let spec = expertmesh_topology::model::preset_by_name("demo-small").unwrap();
    let h = spec.hidden as usize;
    let layer = spec.moe_layer_ids()[2];
    let x = reference::synthetic_hidden(31, 20, h);
    let mut be = expertmesh_worker::weights::reference_backend(&spec, 42, &[layer], 1, 64).unwrap();
    let gate = reference::synthetic_gate(&spec, 42, layer);
    let (m, r) = (ComputeMode::Exact, ExpertRounding::Bf16);
    let (routing, want_bf16) =
        reference::moe_layer_backend_rounded(&spec, &gate, layer, &mut be, &x, m, r).unwrap();
    let lw = reference::synthetic_layer(&spec, 42, layer).unwrap();
    let truth = reference::moe_layer_f64(&lw, &x, &routing);
    let (_, exact_bytes) = serve(LinkKind::Tcp, LayerMode::Exact, layer, &x);
    for link in [LinkKind::Tcp, LinkKind::Shm] {
        let _shm = match link {
            LinkKind::Shm => match crate::support::shm_room(crate::support::FABRIC_RINGS) {
                Some(guard) => Some(guard),
                None => continue,
            },
            _ => None,
        };
        let (got, bytes) = serve(link, LayerMode::ExactBf16, layer, &x);
        assert_eq!(bits(&got), bits(&want_bf16), "exact-bf16 over {link:?}");
        assert_eq!(
            bytes * 2,
            exact_bytes,
            "exact-bf16 sends half of exact's result bytes"
        );
        let (got, bytes) = serve(link, LayerMode::Serving, layer, &x);
        let (worst, rms) = (
            reference::rel_error_vs_rms(&got, &truth),
            reference::rms_error(&got, &truth),
        );
        assert!(
            worst < 0.12 && rms < 0.02,
            "serving over {link:?}: worst {worst}, rms {rms}"
        );
        assert!(
            bytes * 4 <= exact_bytes,
            "serving: {bytes} result bytes vs exact's {exact_bytes}"
        );
    }
}

#[test]
fn a_lone_frontend_does_not_wait_for_the_batch_window() {
    let _machine = crate::support::shared();
    // Long enough that a lone call, which never waits for it, stays far below its half on a
    // loaded machine.
    let window = Duration::from_secs(5);
    let fabric = LocalFabric::start(options(LinkKind::Tcp, LayerMode::Serving, window)).unwrap();
    let h = fabric.deployment().spec.hidden as usize;
    let x = reference::synthetic_hidden(3, 1, h);
    let rt = rt();
    let cfg = fabric.frontend_config();
    let addr = fabric.frontend_addr();
    let mut c = rt.block_on(RouterClient::connect(addr, &cfg)).unwrap();
    rt.block_on(c.call(1, &x, h, None, None)).unwrap();
    let t = Instant::now();
    rt.block_on(c.call(1, &x, h, None, None)).unwrap();
    let alone = t.elapsed();
    assert!(alone < window / 2, "a lone frontend waited {alone:?}");
    let _idle = rt.block_on(RouterClient::connect(addr, &cfg)).unwrap();
    // The service counts the connection once its side of the handshake is done.
    let t0 = Instant::now();
    while fabric.service().frontends_open() < 2 {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the router did not count the second connection in 60 s"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let t = Instant::now();
    rt.block_on(c.call(1, &x, h, None, None)).unwrap();
    let with_idle = t.elapsed();
    assert!(
        with_idle >= window,
        "with a second frontend connected the window applies: {with_idle:?}"
    );
    fabric.shutdown();
}
