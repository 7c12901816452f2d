//! The fabric end to end: real worker processes (this crate's `expertmesh` binary) over TCP and
//! shared memory, the router service in the test process, frontends over real sockets.
//!
//! Checks: exact-mode output bit-identical to the in-process reference; accurate mode within
//! tolerance of f64; a killed worker makes affected requests fail within their deadline when
//! there is no replica and complete through a replica when there is one; a restarted worker
//! rejoins; every bad-input case is answered with an error and the next good request on the
//! same connection succeeds.

use crate::support::{bits, demo_options, root, rt};
use expertmesh_cpu_backend::CpuBackend;
use expertmesh_fabric::local::{LocalFabric, LocalFabricOptions};
use expertmesh_quant::contract::ComputeMode;
use expertmesh_router::client::{ClientError, RouterClient};
use expertmesh_router::reference;
use expertmesh_topology::model::ModelSpec;
use expertmesh_transport::codec::{Body, ErrorCode, LayerRequest};
use expertmesh_transport::dtype::ActivationDtype;
use expertmesh_transport::mesh::LinkKind;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// The shared demo-small fabric options in `mode` over `link`.
fn options(link: LinkKind, mode: ComputeMode) -> LocalFabricOptions {
    let mut o = demo_options("single-host.toml", link);
    o.router.mode = mode.into();
    o
}

/// The in-process reference: every expert of every layer on one CPU backend.
pub(crate) struct Reference {
    spec: ModelSpec,
    seed: u64,
    backend: CpuBackend,
}

impl Reference {
    pub(crate) fn new(spec: &ModelSpec, seed: u64) -> Self {
        let backend =
            expertmesh_worker::weights::reference_backend(spec, seed, &spec.moe_layer_ids(), 1, 64)
                .unwrap();
        Self {
            spec: spec.clone(),
            seed,
            backend,
        }
    }

    pub(crate) fn layer(
        &mut self,
        layer: u32,
        x: &[f32],
        mode: ComputeMode,
    ) -> (Vec<u32>, Vec<f32>) {
        let gate = reference::synthetic_gate(&self.spec, self.seed, layer);
        let (r, out) =
            reference::moe_layer_backend(&self.spec, &gate, layer, &mut self.backend, x, mode)
                .unwrap();
        (r.experts, out)
    }
}

/// Calls every MoE layer of `spec` at 1, 7 and 40 tokens (inputs seeded from `seed`) through
/// `client` and asserts each answer bit-identical to `reference`'s exact result; the number of
/// calls. `what` names the check in a failure.
pub(crate) fn every_layer_exact(
    rt: &tokio::runtime::Runtime,
    client: &mut RouterClient,
    reference: &mut Reference,
    spec: &ModelSpec,
    seed: u64,
    what: &str,
) -> usize {
    let h = spec.hidden as usize;
    let mut calls = 0;
    for (i, layer) in spec.moe_layer_ids().into_iter().enumerate() {
        for tokens in [1usize, 7, 40] {
            let x = reference::synthetic_hidden(seed + i as u64 * 10 + tokens as u64, tokens, h);
            let got = rt.block_on(client.call(layer, &x, h, None, None)).unwrap();
            let (_, want) = reference.layer(layer, &x, ComputeMode::Exact);
            assert_eq!(
                bits(&got),
                bits(&want),
                "{what} layer {layer} tokens {tokens}"
            );
            calls += 1;
        }
    }
    calls
}

fn exact_end_to_end(link: LinkKind) {
    exact_end_to_end_with(options(link, ComputeMode::Exact));
}

fn exact_end_to_end_with(o: LocalFabricOptions) {
    let link = o.link;
    let fabric = LocalFabric::start(o).unwrap();
    for rank in [1, 2] {
        assert_eq!(
            fabric.service().link_kind(rank),
            Some(link),
            "worker {rank} runs over the requested link"
        );
    }
    let spec = fabric.deployment().spec.clone();
    let h = spec.hidden as usize;
    let mut reference = Reference::new(&spec, fabric.deployment().seed);
    let rt = rt();
    let mut client = rt
        .block_on(RouterClient::connect(
            fabric.frontend_addr(),
            &fabric.frontend_config(),
        ))
        .unwrap();
    every_layer_exact(
        &rt,
        &mut client,
        &mut reference,
        &spec,
        0,
        &format!("{link:?}"),
    );
    // One call also against the scalar oracle itself (not just the CPU backend).
    let layer = spec.moe_layer_ids()[0];
    let x = reference::synthetic_hidden(5, 3, h);
    let got = rt.block_on(client.call(layer, &x, h, None, None)).unwrap();
    let lw = reference::synthetic_layer(&spec, fabric.deployment().seed, layer).unwrap();
    let (_, oracle) = reference::moe_layer(&spec, &lw, &x, ComputeMode::Exact).unwrap();
    assert_eq!(bits(&got), bits(&oracle));
    // router logits from the frontend: the router gates with them instead of its gate matrix
    // (here the same logits, so the same answer; and different logits change the routing)
    let gate = reference::synthetic_gate(&spec, fabric.deployment().seed, layer);
    let logits = gate.logits(&x);
    let got_l = rt
        .block_on(client.call(layer, &x, h, Some(&logits), None))
        .unwrap();
    assert_eq!(
        bits(&got_l),
        bits(&oracle),
        "frontend logits equal to the gate's give the same output"
    );
    let flipped: Vec<f32> = logits.iter().map(|v| -v).collect();
    let got_f = rt
        .block_on(client.call(layer, &x, h, Some(&flipped), None))
        .unwrap();
    assert_ne!(
        bits(&got_f),
        bits(&oracle),
        "the router used the frontend's logits"
    );
    // bf16 input: the router decodes it exactly, so the reference sees the bf16-rounded values.
    let xb: Vec<f32> = x
        .iter()
        .map(|&v| half::bf16::from_f32(v).to_f32())
        .collect();
    let got = rt
        .block_on(client.call_as(layer, &x, h, ActivationDtype::Bf16, None, None))
        .unwrap();
    let (_, want) = reference.layer(layer, &xb, ComputeMode::Exact);
    assert_eq!(bits(&got), bits(&want), "bf16 input");
    let stats = fabric.service().stats();
    assert!(stats.responses >= 16 && stats.failures == 0, "{stats:?}");
    fabric.shutdown();
}

#[test]
fn exact_over_tcp_is_bit_identical_to_the_reference() {
    let _machine = crate::support::shared();
    exact_end_to_end(LinkKind::Tcp);
}

/// A fabric's temporary folder holds its workers' logs and, with a cluster key, their
/// credential files; a fabric killed with SIGKILL (or by the OOM killer) runs no cleanup and
/// left it in the temporary folder for ever. A fabric that starts removes the folders of
/// fabrics whose process is gone, and leaves a live process's, and one kept after a failed
/// start (the error named its logs), alone.
#[test]
fn a_starting_fabric_removes_the_folders_killed_fabrics_left() {
    let _machine = crate::support::shared();
    let tmp = std::env::temp_dir();
    // A process id no process can have: above the kernel's largest.
    let gone_pid = expertmesh_files::pid_past_max();
    let folder = |pid: u32, tag: &str| {
        let d = tmp.join(format!("expertmesh-fabric-{pid}-{tag}"));
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("worker-0.log"), "log").unwrap();
        std::fs::write(d.join("device-0.cred"), "secret").unwrap();
        d
    };
    let killed = folder(gone_pid, "killedtest");
    let kept = folder(gone_pid, "keptteste");
    std::fs::write(kept.join("KEPT-AFTER-A-FAILED-START"), "").unwrap();
    // This test's parent (the test runner or a shell) runs.
    let live = folder(std::os::unix::process::parent_id(), "livetest");
    let fabric = LocalFabric::start(options(LinkKind::Tcp, ComputeMode::Exact)).unwrap();
    let own = fabric.log_dir().to_path_buf();
    let own_name = own.file_name().unwrap().to_string_lossy().into_owned();
    assert!(
        own_name.starts_with(&format!("expertmesh-fabric-{}-", std::process::id())),
        "{own_name}"
    );
    assert!(
        !killed.exists(),
        "a killed fabric's folder was left: {killed:?}"
    );
    assert!(
        kept.exists(),
        "a folder kept after a failed start was removed"
    );
    assert!(live.exists(), "a live process's folder was removed");
    fabric.shutdown();
    assert!(!own.exists(), "the fabric's own folder outlived it");
    for d in [kept, live] {
        std::fs::remove_dir_all(d).unwrap();
    }
}

/// RDMA links between the router (this process) and real worker processes, on libfabric's
/// `tcp;ofi_rxm` provider over loopback: the RDMA link's data path (one write with immediate per
/// frame into the peer's registered ring) between processes, no RDMA NIC needed.
#[cfg(feature = "libfabric")]
#[test]
fn exact_over_rdma_on_libfabric_is_bit_identical_to_the_reference() {
    let _machine = crate::support::shared();
    let mut o = options(LinkKind::Rdma, ComputeMode::Exact);
    o.rdma_provider = "libfabric".parse().unwrap();
    exact_end_to_end_with(o);
    crate::support::say(
        "ran: the fabric over RDMA links on libfabric (tcp;ofi_rxm) between processes, bit-identical",
    );
}

#[test]
fn exact_over_shared_memory_is_bit_identical_to_the_reference() {
    let _machine = crate::support::shared();
    if let Some(_shm) = crate::support::shm_room(crate::support::FABRIC_RINGS) {
        exact_end_to_end(LinkKind::Shm);
    }
}

/// Workers each in a PID namespace of their own (as containers that share `/dev/shm` are),
/// the router in this one, over shared memory: each end judges the other's ring by the lock
/// its creator holds, not by a process id that means nothing across namespaces (the router's
/// id runs no process in a worker's namespace). Every worker's link is shared memory, and
/// the answers bit-identical.
#[test]
fn workers_in_pid_namespaces_of_their_own_serve_over_shared_memory() {
    let _machine = crate::support::shared();
    let Some(_shm) = crate::support::shm_room(crate::support::FABRIC_RINGS) else {
        return;
    };
    // As root a PID namespace; otherwise inside a user namespace of one's own, where allowed.
    // The wrapper below starts the worker exactly so (util-linux's setpriv and unshare).
    let works = |args: &[&str]| {
        std::process::Command::new("setpriv")
            .args(["--pdeathsig", "KILL", "unshare"])
            .args(args)
            .args(["--pid", "--fork", "--mount-proc", "--kill-child", "true"])
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    let Some(user) = [&[][..], &["--user", "--map-root-user"][..]]
        .into_iter()
        .find(|a| works(a))
    else {
        crate::support::say(
            "skipped: cannot make PID namespaces here (`setpriv ... unshare --pid` as root, or \
             with `--user --map-root-user` where user namespaces are allowed)",
        );
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let wrapper = dir.path().join("in-a-pid-namespace");
    // `unshare --fork` ignores SIGTERM: the wrapper passes the launcher's stop on to the
    // worker (the namespace's first process) so it stops as it would anywhere else, and
    // `unshare` dies with the wrapper (so does the worker) if the launcher has to kill it.
    std::fs::write(
        &wrapper,
        format!(
            "#!/bin/sh\n\
             trap 'kill -TERM $(cat /proc/$u/task/$u/children 2>/dev/null) 2>/dev/null \
             || pkill -TERM -P \"$u\" 2>/dev/null' TERM INT\n\
             setpriv --pdeathsig KILL \
             unshare {} --pid --fork --mount-proc --kill-child '{}' \"$@\" &\n\
             u=$!\n\
             s=0\n\
             while :; do\n\
             wait \"$u\"; s=$?\n\
             if [ \"$s\" -gt 128 ] && kill -0 \"$u\" 2>/dev/null; then continue; fi\n\
             break\n\
             done\n\
             exit \"$s\"\n",
            user.join(" "),
            env!("CARGO_BIN_EXE_expertmesh")
        ),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut o = options(LinkKind::Shm, ComputeMode::Exact);
    o.exe = wrapper;
    exact_end_to_end_with(o);
    crate::support::say(&format!(
        "ran: workers in PID namespaces of their own{}, over shared memory, bit-identical",
        if user.is_empty() {
            ""
        } else {
            " (in user namespaces)"
        }
    ));
}

#[test]
fn accurate_mode_is_within_tolerance_of_f64() {
    let _machine = crate::support::shared();
    let fabric = LocalFabric::start(options(LinkKind::Tcp, ComputeMode::Accurate)).unwrap();
    let spec = fabric.deployment().spec.clone();
    let h = spec.hidden as usize;
    let rt = rt();
    let mut client = rt
        .block_on(RouterClient::connect(
            fabric.frontend_addr(),
            &fabric.frontend_config(),
        ))
        .unwrap();
    let layer = spec.moe_layer_ids()[1];
    let x = reference::synthetic_hidden(77, 12, h);
    let got = rt.block_on(client.call(layer, &x, h, None, None)).unwrap();
    let lw = reference::synthetic_layer(&spec, fabric.deployment().seed, layer).unwrap();
    let logits = lw.gate.logits(&x);
    let routing = expertmesh_router::gating::route(&spec, &logits, &lw.gate.bias).unwrap();
    let truth = reference::moe_layer_f64(&lw, &x, &routing);
    let err = reference::rel_error_vs_rms(&got, &truth);
    assert!(err < 1e-4, "accurate error {err}");
    fabric.shutdown();
}

/// Single tokens whose experts all lie in `allowed` (and ones that need some outside it).
fn tokens_by_experts(
    r: &mut Reference,
    layer: u32,
    allowed: std::ops::Range<u32>,
) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let h = r.spec.hidden as usize;
    let (mut inside, mut outside) = (Vec::new(), Vec::new());
    for seed in 0..400 {
        let x = reference::synthetic_hidden(10_000 + seed, 1, h);
        let (experts, _) = r.layer(layer, &x, ComputeMode::Exact);
        if experts.iter().all(|e| allowed.contains(e)) {
            if inside.len() < 3 {
                inside.push(x);
            }
        } else if outside.len() < 3 {
            outside.push(x);
        }
        if inside.len() == 3 && outside.len() == 3 {
            break;
        }
    }
    assert!(
        inside.len() == 3 && outside.len() == 3,
        "could not find test tokens"
    );
    (inside, outside)
}

#[test]
fn a_killed_worker_fails_requests_in_time_or_they_complete_through_a_replica_and_it_rejoins() {
    let _machine = crate::support::shared();
    // Placement: cpu0 holds 0-19, cpu1 holds 16-31 and replicas of 0-3. Killing cpu1 leaves
    // experts 20-31 without an owner; everything else is still served.
    let mut opts = options(LinkKind::Tcp, ComputeMode::Exact);
    opts.router.default_deadline = Duration::from_secs(3);
    let mut fabric = LocalFabric::start(opts).unwrap();
    let spec = fabric.deployment().spec.clone();
    let h = spec.hidden as usize;
    let layer = spec.moe_layer_ids()[2];
    let mut r = Reference::new(&spec, fabric.deployment().seed);
    let (servable, unservable) = tokens_by_experts(&mut r, layer, 0..20);
    let rt = rt();
    let mut client = rt
        .block_on(RouterClient::connect(
            fabric.frontend_addr(),
            &fabric.frontend_config(),
        ))
        .unwrap();

    // Kill while a stream of requests is in flight: nothing may hang past its deadline.
    let mut busy = rt
        .block_on(RouterClient::connect(
            fabric.frontend_addr(),
            &fabric.frontend_config(),
        ))
        .unwrap();
    let big = reference::synthetic_hidden(3, 64, h);
    let in_flight = rt.spawn(async move {
        let mut outcomes = Vec::new();
        for _ in 0..6 {
            let t = Instant::now();
            outcomes.push((
                busy.call(layer, &big, h, None, Some(Duration::from_secs(3)))
                    .await
                    .map(|_| ()),
                t.elapsed(),
            ));
        }
        outcomes
    });
    std::thread::sleep(Duration::from_millis(30));
    fabric.kill_worker(1).unwrap();
    let outcomes = rt.block_on(in_flight).unwrap();
    for (res, took) in &outcomes {
        assert!(
            *took < Duration::from_secs(30),
            "a request took {took:?}, past its 3 s deadline"
        );
        if let Err(e) = res {
            assert!(
                matches!(
                    e.code(),
                    Some(ErrorCode::PeerUnavailable | ErrorCode::DeadlineExceeded)
                ),
                "{e}"
            );
        }
    }

    // Without a replica: an error naming the device, well within the deadline.
    for x in &unservable {
        let t = Instant::now();
        let e = rt
            .block_on(client.call(layer, x, h, None, Some(Duration::from_secs(3))))
            .unwrap_err();
        // A hang guard (the answer is due at the 3 s deadline at the latest; a loaded machine
        // may deliver it late).
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "took {:?}",
            t.elapsed()
        );
        match &e {
            ClientError::Server { code, message, .. } => {
                assert!(
                    matches!(
                        code,
                        ErrorCode::PeerUnavailable | ErrorCode::DeadlineExceeded
                    ),
                    "{e}"
                );
                assert!(message.contains("local/cpu1"), "{message}");
            }
            other => panic!("expected a router error, got {other}"),
        }
    }
    // With a replica (or a surviving owner): completes, bit-identical (a call that must
    // succeed gets a deadline a loaded machine cannot miss; the 3 s default is for failures).
    let ample = Some(Duration::from_secs(60));
    for x in &servable {
        let got = rt.block_on(client.call(layer, x, h, None, ample)).unwrap();
        let (_, want) = r.layer(layer, x, ComputeMode::Exact);
        assert_eq!(bits(&got), bits(&want));
    }
    // The worker restarts and rejoins: everything is served again.
    fabric.restart_worker(1).unwrap();
    for x in unservable.iter().chain(&servable) {
        let got = rt.block_on(client.call(layer, x, h, None, ample)).unwrap();
        let (_, want) = r.layer(layer, x, ComputeMode::Exact);
        assert_eq!(bits(&got), bits(&want));
    }
    fabric.shutdown();
}

#[test]
fn bad_input_gets_an_error_and_the_connection_stays_usable() {
    let _machine = crate::support::shared();
    let fabric = LocalFabric::start(options(LinkKind::Tcp, ComputeMode::Exact)).unwrap();
    let spec = fabric.deployment().spec.clone();
    let h = spec.hidden as usize;
    let layer = spec.moe_layer_ids()[0];
    let rt = rt();
    let mut c = rt
        .block_on(RouterClient::connect(
            fabric.frontend_addr(),
            &fabric.frontend_config(),
        ))
        .unwrap();
    let good = reference::synthetic_hidden(1, 2, h);
    let expect_err = |res: Result<Vec<f32>, ClientError>, code: ErrorCode, needle: &str| {
        let e = res.unwrap_err();
        assert_eq!(e.code(), Some(code), "{e}");
        assert!(
            e.to_string().contains(needle),
            "{e} should mention {needle:?}"
        );
    };
    // wrong hidden size
    let x = vec![0.5f32; 2 * (h + 32)];
    expect_err(
        rt.block_on(c.call(layer, &x, h + 32, None, None)),
        ErrorCode::InvalidInput,
        "hidden size",
    );
    assert!(rt.block_on(c.call(layer, &good, h, None, None)).is_ok());
    // unknown layer
    expect_err(
        rt.block_on(c.call(99, &good, h, None, None)),
        ErrorCode::NotFound,
        "layer 99",
    );
    assert!(rt.block_on(c.call(layer, &good, h, None, None)).is_ok());
    // too many tokens
    let many = vec![0.1f32; 300 * h];
    expect_err(
        rt.block_on(c.call(layer, &many, h, None, None)),
        ErrorCode::InvalidInput,
        "300 tokens",
    );
    assert!(rt.block_on(c.call(layer, &good, h, None, None)).is_ok());
    // NaN and Inf
    for bad in [f32::NAN, f32::INFINITY] {
        let mut x = good.clone();
        x[h + 5] = bad;
        expect_err(
            rt.block_on(c.call(layer, &x, h, None, None)),
            ErrorCode::InvalidInput,
            "token 1 element 5",
        );
        assert!(rt.block_on(c.call(layer, &good, h, None, None)).is_ok());
    }
    // wrong-size logits
    let logits = vec![0.0f32; 2 * 5];
    expect_err(
        rt.block_on(c.call(layer, &good, h, Some(&logits), None)),
        ErrorCode::InvalidInput,
        "logits",
    );
    // a malformed frame with an intact header: nonzero padding between metadata and payload
    let body = Body::LayerRequest(LayerRequest {
        request_id: 4242,
        layer,
        tokens: 1,
        hidden: h as u32,
        dtype: ActivationDtype::F32,
        logit_experts: 0,
        deadline_us: 0,
    });
    let mut bytes = expertmesh_transport::codec::encode_frame(
        &body,
        &vec![0u8; 4 * h],
        &fabric.frontend_config().codec,
    )
    .unwrap();
    let payload_start = bytes.len() - 4 * h;
    bytes[payload_start - 1] = 0xAB;
    rt.block_on(c.write_raw(&bytes)).unwrap();
    // the malformed frame's error comes back first, naming the request; then a good call works
    let e = rt.block_on(c.call(layer, &good, h, None, None));
    match e {
        Err(ClientError::Server { code, .. }) => assert_eq!(code, ErrorCode::BadFrame),
        Ok(_) => {}
        Err(other) => panic!("{other}"),
    }
    // and garbage that breaks framing closes only that connection
    let mut g = rt
        .block_on(RouterClient::connect(
            fabric.frontend_addr(),
            &fabric.frontend_config(),
        ))
        .unwrap();
    rt.block_on(g.write_raw(&[0xFFu8; 64])).unwrap();
    assert!(rt.block_on(g.call(layer, &good, h, None, None)).is_err());
    let again = rt.block_on(c.call(layer, &good, h, None, None)).unwrap();
    let mut r = Reference::new(&spec, fabric.deployment().seed);
    let (_, want) = r.layer(layer, &good, ComputeMode::Exact);
    assert_eq!(
        bits(&again),
        bits(&want),
        "the connection still works after every bad request"
    );
    fabric.shutdown();
}

#[test]
fn infer_command_reads_and_writes_npy() {
    let _machine = crate::support::shared();
    let fabric = LocalFabric::start(options(LinkKind::Tcp, ComputeMode::Exact)).unwrap();
    let spec = fabric.deployment().spec.clone();
    let h = spec.hidden as usize;
    let layer = spec.moe_layer_ids()[3];
    let dir = tempfile::tempdir().unwrap();
    let x = reference::synthetic_hidden(8, 5, h);
    let input = dir.path().join("x.npy");
    let output = dir.path().join("y.npy");
    // bf16 bits as uint16, as a frontend with bf16 activations would write them
    std::fs::write(
        &input,
        expertmesh::npy::encode(5, h, &x, expertmesh::npy::NpyDtype::Bf16Bits),
    )
    .unwrap();
    let status = std::process::Command::new(env!("CARGO_BIN_EXE_expertmesh"))
        .args([
            "infer",
            "--router",
            &fabric.frontend_addr().to_string(),
            "--cluster",
            "single-host",
            "--layer",
            &layer.to_string(),
        ])
        .arg("--input")
        .arg(&input)
        .arg("--output")
        .arg(&output)
        .status()
        .unwrap();
    assert!(status.success());
    let y = expertmesh::npy::read(&output).unwrap();
    assert_eq!((y.rows, y.cols), (5, h));
    let xb: Vec<f32> = x
        .iter()
        .map(|&v| half::bf16::from_f32(v).to_f32())
        .collect();
    let mut r = Reference::new(&spec, fabric.deployment().seed);
    let (_, want) = r.layer(layer, &xb, ComputeMode::Exact);
    assert_eq!(bits(&y.data), bits(&want));
    // an unknown layer: exit 1 with the router's reason
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_expertmesh"))
        .args([
            "infer",
            "--router",
            &fabric.frontend_addr().to_string(),
            "--cluster",
            "single-host",
            "--layer",
            "77",
        ])
        .arg("--input")
        .arg(&input)
        .arg("--output")
        .arg(&output)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("layer 77"));
    fabric.shutdown();
}

#[test]
fn up_serves_until_interrupted() {
    let _machine = crate::support::shared();
    use std::io::BufRead;
    // The example topology as it is, on free ports (its own may be taken: another clone's
    // tests, a stray `up`, an outgoing connection of the ephemeral range).
    let dir = tempfile::tempdir().unwrap();
    let (front, control, data) = (
        crate::support::free_port(),
        crate::support::free_port(),
        crate::support::free_pair(),
    );
    let example = std::fs::read_to_string(root().join("examples/single-host.toml")).unwrap();
    let topology = dir.path().join("single-host.toml");
    let moved = example
        .replace("port = 47400", &format!("port = {front}"))
        .replace("control_port = 47401", &format!("control_port = {control}"))
        .replace("data_port = 47410", &format!("data_port = {data}"));
    assert_ne!(moved, example, "the example's ports were rewritten");
    std::fs::write(&topology, moved).unwrap();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_expertmesh"))
        .arg("up")
        .arg("--topology")
        .arg(&topology)
        .args(["--model", "demo-small"])
        .arg("--placement")
        .arg(root().join("examples/single-host-demo-small.placement.toml"))
        .args(["--mode", "exact"]) // compared bit for bit below; `up` defaults to serving
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut lines = std::io::BufReader::new(stdout).lines();
    let (mut addr, mut said) = (None, String::new());
    for line in lines.by_ref() {
        let line = line.unwrap();
        said.push_str(&line);
        said.push('\n');
        if let Some(rest) = line.trim().strip_prefix("frontends: ") {
            addr = rest
                .split_whitespace()
                .next()
                .map(|a| a.parse::<std::net::SocketAddr>().unwrap());
            break;
        }
    }
    let addr = addr.expect("up printed where frontends connect");
    assert_eq!(addr.port(), front, "the topology's [router] port");
    // All on one host: batches are not cut (the largest batch, 256 tokens by default, fits a
    // frame of demo-small's exact mode).
    assert!(
        said.contains("micro-batches of 256 tokens"),
        "up says its micro-batch:\n{said}"
    );
    let spec = expertmesh_topology::model::preset_by_name("demo-small").unwrap();
    let h = spec.hidden as usize;
    let x = reference::synthetic_hidden(1, 3, h);
    let rt = rt();
    let cfg = expertmesh_transport::frontend::FrontendConfig::new("single-host");
    let mut c = rt.block_on(RouterClient::connect(addr, &cfg)).unwrap();
    let got = rt.block_on(c.call(1, &x, h, None, None)).unwrap();
    let mut r = Reference::new(&spec, 42);
    let (_, want) = r.layer(1, &x, ComputeMode::Exact);
    assert_eq!(bits(&got), bits(&want));
    // SAFETY: sending SIGINT to our own child process.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let t = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            assert!(status.success(), "up exited with {status}");
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "up did not stop on Ctrl-C within 60 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_worker_that_stops_answering_fails_only_the_requests_that_need_it_within_their_deadline() {
    let _machine = crate::support::shared();
    let mut opts = options(LinkKind::Tcp, ComputeMode::Exact);
    opts.router.straggler_timeout = Duration::from_millis(300);
    let fabric = LocalFabric::start(opts).unwrap();
    let spec = fabric.deployment().spec.clone();
    let h = spec.hidden as usize;
    let layer = spec.moe_layer_ids()[1];
    let mut r = Reference::new(&spec, fabric.deployment().seed);
    // cpu1 holds 16-31 (0-3 as replicas); tokens whose experts are all in 0..16 need only cpu0.
    let (cpu0_only, needs_cpu1) = tokens_by_experts(&mut r, layer, 0..16);
    let rt = rt();
    let mut c = rt
        .block_on(RouterClient::connect(
            fabric.frontend_addr(),
            &fabric.frontend_config(),
        ))
        .unwrap();
    fabric.signal_worker(1, libc::SIGSTOP).unwrap();
    for x in &needs_cpu1 {
        let t = Instant::now();
        let res = rt.block_on(c.call(layer, x, h, None, Some(Duration::from_millis(1500))));
        let took = t.elapsed();
        // experts 16-19 have a replica on cpu0 (hedged after 300 ms); 20-31 do not
        match res {
            Ok(got) => {
                let (_, want) = r.layer(layer, x, ComputeMode::Exact);
                assert_eq!(bits(&got), bits(&want));
            }
            Err(e) => {
                assert!(
                    matches!(
                        e.code(),
                        Some(ErrorCode::DeadlineExceeded | ErrorCode::PeerUnavailable)
                    ),
                    "{e}"
                );
                assert!(e.to_string().contains("local/cpu1"), "{e}");
            }
        }
        // A hang guard: a stopped worker must not hold the call past its deadline for good.
        assert!(
            took < Duration::from_secs(30),
            "answered after {took:?}, deadline 1.5 s"
        );
    }
    for x in &cpu0_only {
        let got = rt.block_on(c.call(layer, x, h, None, None)).unwrap();
        let (_, want) = r.layer(layer, x, ComputeMode::Exact);
        assert_eq!(
            bits(&got),
            bits(&want),
            "requests that do not need the stopped worker are served"
        );
    }
    fabric.signal_worker(1, libc::SIGCONT).unwrap();
    fabric.shutdown();
}

/// A client that has every one of its connection's slots taken (the client's default window
/// is the router's per-connection limit) by requests waiting for a stopped worker still hears
/// the router answer its keepalive probes: each request ends with the router's own answer at
/// its deadline (past the client's keepalive bound of 3 s), not with the client giving up a
/// live router.
#[test]
fn a_full_window_waiting_for_a_stopped_worker_keeps_the_router_alive_to_its_client() {
    let _machine = crate::support::shared();
    let opts = options(LinkKind::Tcp, ComputeMode::Exact);
    let fabric = LocalFabric::start(opts).unwrap();
    let spec = fabric.deployment().spec.clone();
    let h = spec.hidden as usize;
    let layer = spec.moe_layer_ids()[1];
    let mut r = Reference::new(&spec, fabric.deployment().seed);
    // Tokens that need an expert only cpu1 holds (20-31: 16-19 have replicas on cpu0), so no
    // request is answered before its deadline and frees a slot early.
    let (_, needs_cpu1) = tokens_by_experts(&mut r, layer, 0..20);
    assert!(!needs_cpu1.is_empty());
    let rt = rt();
    let mut c = rt
        .block_on(RouterClient::connect(
            fabric.frontend_addr(),
            &fabric.frontend_config(),
        ))
        .unwrap();
    let window = expertmesh_router::client::DEFAULT_MAX_IN_FLIGHT;
    fabric.signal_worker(1, libc::SIGSTOP).unwrap();
    let deadline = Duration::from_millis(4500);
    let handles: Vec<_> = (0..window)
        .map(|i| {
            let x = &needs_cpu1[i % needs_cpu1.len()];
            rt.block_on(c.submit(layer, x.as_slice(), h, None, Some(deadline)))
                .unwrap()
        })
        .collect();
    for handle in handles {
        match rt.block_on(c.wait(handle)) {
            Ok(_) => panic!("answered although it needs the stopped worker"),
            Err(e) => assert!(
                matches!(
                    e.code(),
                    Some(ErrorCode::DeadlineExceeded | ErrorCode::PeerUnavailable)
                ),
                "the router's answer, not the client giving it up: {e}"
            ),
        }
    }
    fabric.signal_worker(1, libc::SIGCONT).unwrap();
    fabric.shutdown();
}

#[test]
fn a_gpu_device_without_hip_falls_back_to_the_cpu_backend_with_a_log_line() {
    let _machine = crate::support::shared();
    let dir = tempfile::tempdir().unwrap();
    let topo = dir.path().join("gpu-box.toml");
    std::fs::write(&topo, crate::support::GPU_BOX_TOPOLOGY).unwrap();
    let (placement, _guard) =
        expertmesh_fabric::defaults::balanced_placement_file(&topo, "demo-small").unwrap();
    let mut o = LocalFabricOptions::new(&topo, "demo-small", &placement);
    o.exe = PathBuf::from(env!("CARGO_BIN_EXE_expertmesh"));
    o.ephemeral_ports = true;
    let fabric = LocalFabric::start(o).unwrap();
    let log = std::fs::read_to_string(fabric.log_dir().join("worker-0.log")).unwrap();
    assert!(
        log.contains("falling back to the CPU backend"),
        "worker 0 log:\n{log}"
    );
    let spec = fabric.deployment().spec.clone();
    let h = spec.hidden as usize;
    let x = reference::synthetic_hidden(2, 4, h);
    let rt = rt();
    let mut c = rt
        .block_on(RouterClient::connect(
            fabric.frontend_addr(),
            &fabric.frontend_config(),
        ))
        .unwrap();
    let got = rt.block_on(c.call(2, &x, h, None, None)).unwrap();
    let mut r = Reference::new(&spec, fabric.deployment().seed);
    let (_, want) = r.layer(2, &x, ComputeMode::Exact);
    assert_eq!(bits(&got), bits(&want));
    fabric.shutdown();
}
