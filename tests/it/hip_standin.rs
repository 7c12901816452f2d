//! A GPU worker on the production HIP backend, over the HIP-CPU stand-in for the HIP runtime
//! (`hip-kernels/standin/`), serving through a real router (feature `hip`).
//!
//! The fabric: one GPU device (gfx90a) whose worker process opens the stand-in with
//! `--hip-library` and runs the real kernels' gfx90a branch (MFMA prefill) on the CPU, and one
//! CPU device. Every MoE layer of demo-small at 1, 7 and 40 tokens (decode and prefill batches on
//! the GPU worker) is bit-identical to the in-process CPU reference, before and after the two
//! devices swap their experts live (`expertmesh rebalance`: the HIP backend gains and releases
//! experts while loaded). Skips loudly where the stand-in cannot be built (no HIP-CPU, no
//! clang++).

use crate::fabric::{Reference, every_layer_exact};
use crate::support::rt;
use expertmesh_fabric::local::{LocalFabric, LocalFabricOptions};
use expertmesh_hip_kernels::standin::{self, Built, GFX90A};
use expertmesh_router::client::RouterClient;
use std::path::{Path, PathBuf};

#[test]
fn a_hip_worker_over_the_standin_serves_bit_identical_to_the_cpu_reference() {
    let _machine = crate::support::shared();
    let cache = Path::new(env!("CARGO_TARGET_TMPDIR")).join("hip-standin");
    let lib = match standin::build(GFX90A, None, &cache) {
        Ok(Built::Library(lib)) => lib,
        Ok(Built::Skipped(why)) => {
            crate::support::say(&format!("skipped: {why}"));
            return;
        }
        Err(e) => panic!("building the gfx90a stand-in: {e}"),
    };
    let dir = tempfile::tempdir().unwrap();
    let topo = dir.path().join("gpu-box.toml");
    std::fs::write(&topo, crate::support::GPU_BOX_TOPOLOGY).unwrap();
    let (placement, _guard) =
        expertmesh_fabric::defaults::balanced_placement_file(&topo, "demo-small").unwrap();
    let mut o = LocalFabricOptions::new(&topo, "demo-small", &placement);
    o.exe = PathBuf::from(env!("CARGO_BIN_EXE_expertmesh"));
    o.ephemeral_ports = true;
    o.hip_library = Some(lib);
    let fabric = LocalFabric::start(o).unwrap();
    let log = std::fs::read_to_string(fabric.log_dir().join("worker-0.log")).unwrap();
    assert!(
        log.contains("on hip-gfx90a") && !log.contains("falling back"),
        "worker 0 should serve on the HIP backend over the stand-in; its log:\n{log}"
    );
    let spec = fabric.deployment().spec.clone();
    let rt = rt();
    let mut client = rt
        .block_on(RouterClient::connect(
            fabric.frontend_addr(),
            &fabric.frontend_config(),
        ))
        .unwrap();
    let mut reference = Reference::new(&spec, fabric.deployment().seed);
    let mut calls = every_layer_exact(&rt, &mut client, &mut reference, &spec, 100, "as placed:");
    // A live placement change (issue 29): the GPU device and the CPU device swap their experts
    // while the fabric runs, so the HIP backend gains and releases experts while loaded.
    let swapped = dir.path().join("swapped.toml");
    std::fs::write(
        &swapped,
        crate::convert_serve::swapped(fabric.deployment()).to_toml_string(),
    )
    .unwrap();
    let (code, text) = crate::convert_serve::rebalance_args(
        &fabric,
        &topo,
        &["--model".as_ref(), "demo-small".as_ref()],
        &swapped,
    );
    assert_eq!(
        code,
        Some(0),
        "rebalance onto the swapped placement:\n{text}"
    );
    calls += every_layer_exact(
        &rt,
        &mut client,
        &mut reference,
        &spec,
        100,
        "after the swap:",
    );
    let stats = fabric.service().stats();
    assert!(stats.failures == 0, "{stats:?}");
    crate::support::say(&format!(
        "ran: a worker on HipBackend over the gfx90a stand-in served {calls} calls through the router, \
         bit-identical to the CPU reference, before and after swapping its experts with the CPU device live"
    ));
    fabric.shutdown();
}
