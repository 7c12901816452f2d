//! Running the real `expertmesh` binary from the CLI integration tests: one helper shared by
//! every test file that drives the binary as a user would; and the small helpers the fabric
//! tests share (a client runtime, f32 bits for bit-for-bit comparisons).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

/// The repository root (the binary runs there, so relative example paths work).
pub(crate) fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// What one run of the binary did.
pub(crate) struct Run {
    /// Exit code.
    pub(crate) code: i32,
    /// Standard output.
    pub(crate) stdout: String,
    /// Standard error.
    pub(crate) stderr: String,
}

/// Run `expertmesh ARGS` in the repository root. Fails the test if it panicked or printed a
/// backtrace: bad input must get a message and an exit code, never a panic.
pub(crate) fn run(args: &[&str]) -> Run {
    let o = Command::new(env!("CARGO_BIN_EXE_expertmesh"))
        .args(args)
        .current_dir(root())
        .env("RUST_BACKTRACE", "1")
        .output()
        .expect("run expertmesh");
    let code = o.status.code().expect("exited normally, not by a signal");
    checked(args, code, &o.stdout, &o.stderr)
}

/// [`run`], also giving the CPU time (user and system) the process spent, from `wait4`: a
/// busy machine delays a process without adding to the work it does, so two such figures of
/// one test compare where wall-clock times would not.
pub(crate) fn run_cpu_time(args: &[&str]) -> (Run, std::time::Duration) {
    let out = tempfile::tempdir().unwrap();
    let (stdout, stderr) = (out.path().join("stdout"), out.path().join("stderr"));
    #[allow(clippy::zombie_processes, reason = "reaped by the wait4 below")]
    let child = Command::new(env!("CARGO_BIN_EXE_expertmesh"))
        .args(args)
        .current_dir(root())
        .env("RUST_BACKTRACE", "1")
        .stdout(std::fs::File::create(&stdout).unwrap())
        .stderr(std::fs::File::create(&stderr).unwrap())
        .spawn()
        .expect("run expertmesh");
    let mut status = 0;
    // SAFETY: an all-zero rusage is a valid value for wait4 to fill in.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `child` is this process's own unwaited child; the pointers are to locals.
    let pid = unsafe { libc::wait4(child.id() as i32, &mut status, 0, &mut usage) };
    let error = std::io::Error::last_os_error();
    assert_eq!(pid, child.id() as i32, "wait4: {error}");
    assert!(
        libc::WIFEXITED(status),
        "{args:?} ended by a signal: {status:#x}"
    );
    let tv = |t: libc::timeval| std::time::Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    let cpu = tv(usage.ru_utime) + tv(usage.ru_stime);
    let read = |p: &Path| std::fs::read(p).unwrap();
    let r = checked(
        args,
        libc::WEXITSTATUS(status),
        &read(&stdout),
        &read(&stderr),
    );
    (r, cpu)
}

/// The [`Run`] of `args`, failing the test if it panicked or printed a backtrace.
fn checked(args: &[&str], code: i32, stdout: &[u8], stderr: &[u8]) -> Run {
    let r = Run {
        code,
        stdout: String::from_utf8_lossy(stdout).into_owned(),
        stderr: String::from_utf8_lossy(stderr).into_owned(),
    };
    for bad in ["panicked", "stack backtrace", "RUST_BACKTRACE"] {
        assert!(
            !r.stderr.contains(bad) && !r.stdout.contains(bad),
            "{args:?} printed {bad:?}:\n{}{}",
            r.stdout,
            r.stderr
        );
    }
    r
}

/// The `expertmesh` binary cargo built for these tests.
pub(crate) fn bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_expertmesh"))
}

/// A current-thread runtime for a test's `RouterClient` calls.
pub(crate) fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime")
}

/// One node with a GPU device (gfx90a, GPU index 0) and a CPU device, on fixed loopback ports
/// (tests start it with `ephemeral_ports`).
pub(crate) const GPU_BOX_TOPOLOGY: &str = r#"format = 1
name = "gpu-box"
[router]
node = "box"
port = 47500
[[nodes]]
name = "box"
address = "127.0.0.1"
control_port = 47501
data_port = 47510
intra_link = "pcie"
intra_bandwidth_gb_s = 32
nics = [ { name = "lo", kind = "tcp", speed_gbit_s = 100, mtu = 65536 } ]
devices = [
  { name = "gpu0", kind = "gpu", arch = "gfx90a", expert_memory = "1 GiB", memory_bandwidth_gb_s = 1600, int8_tops = 362, bf16_tflops = 181, gpu_index = 0 },
  { name = "cpu0", kind = "cpu", arch = "cpu", threads = 1, expert_memory = "1 GiB", memory_bandwidth_gb_s = 20 },
]
"#;

/// Polls `done` every `poll` until it holds; panics naming `what` after two minutes. For what
/// the fabric guarantees will happen (a log line written, an announcement heard), not a time
/// budget: the bound only keeps a broken run from hanging, so a slow or busy machine passes.
pub(crate) fn wait_for(what: &str, poll: std::time::Duration, mut done: impl FnMut() -> bool) {
    let until = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while !done() {
        assert!(std::time::Instant::now() < until, "{what}");
        std::thread::sleep(poll);
    }
}

/// `topology` with a third CPU device `cpu2` (256 MiB, one thread) after its last device,
/// written to `out`.
pub(crate) fn with_third_cpu(topology: &Path, out: &Path) -> PathBuf {
    let third = "  { name = \"cpu2\", kind = \"cpu\", arch = \"cpu\", threads = 1, \
                 expert_memory = \"256 MiB\", memory_bandwidth_gb_s = 20, numa = 0 },\n";
    let text = std::fs::read_to_string(topology)
        .unwrap()
        .replace("numa = 0 },\n]", &format!("numa = 0 }},\n{third}]"));
    assert!(text.contains("cpu2"), "{text}");
    std::fs::write(out, text).unwrap();
    out.to_path_buf()
}

/// Say something on the real stderr (the harness captures `eprintln!`): a skip or a "ran: ..."
/// line then shows in every run, never as a silent pass.
#[cfg_attr(not(any(feature = "hip", feature = "libfabric")), allow(dead_code))]
pub(crate) fn say(what: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{what}");
}

/// A layer call of `x` (rows of `hidden` f32 values) to `layer` with a 20 s deadline, as a
/// frontend sends it: its body and payload.
pub(crate) fn f32_layer_request(
    id: u64,
    layer: u32,
    hidden: usize,
    x: &[f32],
) -> (expertmesh_transport::codec::Body, Vec<u8>) {
    use expertmesh_transport::codec::{Body, LayerRequest};
    use expertmesh_transport::dtype::{self, ActivationDtype};
    let tokens = x.len() / hidden;
    let mut payload =
        vec![0u8; ActivationDtype::F32.payload_bytes(tokens, hidden).unwrap() as usize];
    dtype::encode_activations(ActivationDtype::F32, tokens, hidden, x, &mut payload).unwrap();
    let body = Body::LayerRequest(LayerRequest {
        request_id: id,
        layer,
        tokens: tokens as u32,
        hidden: hidden as u32,
        dtype: ActivationDtype::F32,
        logit_experts: 0,
        deadline_us: 20_000_000,
    });
    (body, payload)
}

/// The bits of `v`, to compare outputs bit for bit.
pub(crate) fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// A free loopback port, below the ephemeral range ([`expertmesh_transport::ports`]: no
/// outgoing connection takes it before the process it is for binds it).
pub(crate) fn free_port() -> u16 {
    expertmesh_transport::ports::free_loopback_ports(1).expect("a free loopback port")
}

/// A free port whose successor is free too (the two workers' data ports).
pub(crate) fn free_pair() -> u16 {
    expertmesh_transport::ports::free_loopback_ports(2).expect("two free loopback ports")
}

/// Writes a one-node topology named `name` at `path`: a router on `frontend`, and two
/// one-thread CPU workers on 127.0.0.1 whose data ports are `data` and `data + 1`.
pub(crate) fn two_cpu_topology(
    path: &std::path::Path,
    name: &str,
    frontend: u16,
    control: u16,
    data: u16,
) -> PathBuf {
    std::fs::write(
        path,
        format!(
            r#"format = 1
name = "{name}"
[router]
node = "local"
port = {frontend}
[[nodes]]
name = "local"
address = "127.0.0.1"
control_port = {control}
data_port = {data}
intra_link = "shm"
intra_bandwidth_gb_s = 10
nics = [ {{ name = "lo", kind = "tcp", speed_gbit_s = 100, mtu = 65536 }} ]
devices = [
  {{ name = "cpu0", kind = "cpu", arch = "cpu", threads = 1, expert_memory = "256 MiB", memory_bandwidth_gb_s = 20 }},
  {{ name = "cpu1", kind = "cpu", arch = "cpu", threads = 1, expert_memory = "256 MiB", memory_bandwidth_gb_s = 20 }},
]
"#
        ),
    )
    .unwrap();
    path.to_path_buf()
}

/// Options of a demo-small fabric on `examples/TOPOLOGY` with its demo-small placement: the
/// test binary, free ports, `link` links, exact mode with a short batch window, generous
/// deadlines (the settings the fabric tests share; tests change what they test).
pub(crate) fn demo_options(
    topology: &str,
    link: expertmesh_transport::mesh::LinkKind,
) -> expertmesh_fabric::local::LocalFabricOptions {
    use expertmesh_fabric::local::LocalFabricOptions;
    use expertmesh_quant::contract::ComputeMode;
    use expertmesh_router::core::RouterConfig;
    use std::time::Duration;
    let mut o = LocalFabricOptions::new(
        root().join("examples").join(topology),
        "demo-small",
        root().join("examples/single-host-demo-small.placement.toml"),
    );
    o.exe = PathBuf::from(env!("CARGO_BIN_EXE_expertmesh"));
    o.ephemeral_ports = true;
    o.link = link;
    o.router = RouterConfig {
        mode: ComputeMode::Exact.into(),
        batch_window: Duration::from_micros(100),
        micro_batch_tokens: 16,
        default_deadline: Duration::from_secs(20),
        ..RouterConfig::default()
    };
    o.connect_timeout = Duration::from_secs(60);
    o
}

/// A fabric of `examples/single-host-2routers.toml` (two routers sharing two CPU workers) on
/// free ports, exact mode, TCP links.
pub(crate) fn two_routers() -> expertmesh_fabric::local::LocalFabric {
    use expertmesh_fabric::local::LocalFabric;
    let o = demo_options(
        "single-host-2routers.toml",
        expertmesh_transport::mesh::LinkKind::Tcp,
    );
    let fabric = LocalFabric::start(o).expect("fabric with two routers starts");
    assert_eq!(fabric.deployment().router_count(), 2);
    fabric
}

/// The machine, as the tests of this binary share it. Tests that start fabrics (processes,
/// sockets, shared memory) hold it shared and run side by side; tests that assert wall-clock
/// bounds (recovery within 1-2 s of a fault, goodput under overload against the unloaded
/// rate, the emulated cluster against the planner's prediction) hold it alone, so what they
/// measure is the fabric and not a neighbour test's load. Tests that only read files take
/// neither.
static MACHINE: RwLock<()> = RwLock::new(());

/// Share the machine with the other fabric tests (see [`MACHINE`]).
pub(crate) fn shared() -> RwLockReadGuard<'static, ()> {
    MACHINE.read().unwrap_or_else(|e| e.into_inner())
}

/// Have the machine to this test alone (see [`MACHINE`]).
pub(crate) fn alone() -> RwLockWriteGuard<'static, ()> {
    MACHINE.write().unwrap_or_else(|e| e.into_inner())
}

/// Held by every test that puts shared-memory rings in `/dev/shm` (a two-worker fabric needs
/// four rings of 32 MiB), so that the room one test finds free is not taken by another before
/// its fabric starts: a fabric without room falls back to TCP links, correctly, and a test
/// asserting shared-memory links would fail for a reason that is not the fabric's.
static SHM: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Shared-memory rings of a two-worker fabric (two per worker).
pub(crate) const FABRIC_RINGS: u64 = 4;

/// The `/dev/shm` guard ([`SHM`]) when `/dev/shm` has room for `rings` rings of a worker's
/// size (taken first, so the room stays free for the caller); `None`, saying so, where it has
/// not (a container's 64 MiB `/dev/shm`): the caller skips what needs shared memory.
pub(crate) fn shm_room(rings: u64) -> Option<std::sync::MutexGuard<'static, ()>> {
    let guard = SHM.lock().unwrap_or_else(|e| e.into_inner());
    let need = rings * expertmesh_worker::deploy::SHM_RING_BYTES as u64;
    // The previous holder's rings may still be on their way out (removed as its tasks end):
    // room that appears within a few seconds is room.
    let mut free = shm_free_bytes();
    for _ in 0..50 {
        if free >= need {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
        free = shm_free_bytes();
    }
    if free < need {
        say(&format!(
            "skipped: /dev/shm has {} MiB free, shared-memory links here need {} MiB",
            free >> 20,
            need >> 20
        ));
        return None;
    }
    Some(guard)
}

/// Bytes free in `/dev/shm` (0 where it cannot be read).
fn shm_free_bytes() -> u64 {
    expertmesh_files::free_bytes(std::path::Path::new("/dev/shm")).unwrap_or(0)
}

/// A slow-loris attack on one listener (issue 27): from each of `sources` (loopback
/// addresses other than 127.0.0.1), `per_source` connections that trickle `prefix` one byte
/// a second, each reconnecting 50 ms after the listener closes it, until dropped.
pub(crate) struct SlowLoris {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    connects: std::sync::Arc<std::sync::atomic::AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl SlowLoris {
    /// Starts the attack on `to` from 127.0.0.2, 127.0.0.3, ... (`sources` addresses).
    pub(crate) fn start(
        to: std::net::SocketAddr,
        sources: u8,
        per_source: usize,
        prefix: Vec<u8>,
    ) -> SlowLoris {
        use std::sync::Arc;
        use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
        let stop = Arc::new(AtomicBool::new(false));
        let connects = Arc::new(AtomicU64::new(0));
        let (stop2, connects2) = (Arc::clone(&stop), Arc::clone(&connects));
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a tokio runtime");
            rt.block_on(async move {
                let prefix = Arc::new(prefix);
                let mut tasks = Vec::new();
                for s in 0..sources {
                    let src = std::net::SocketAddr::from(([127, 0, 0, 2 + s], 0));
                    for _ in 0..per_source {
                        let (stop, connects, prefix) = (
                            Arc::clone(&stop2),
                            Arc::clone(&connects2),
                            Arc::clone(&prefix),
                        );
                        tasks.push(tokio::spawn(async move {
                            while !stop.load(Ordering::Relaxed) {
                                trickle(src, to, &prefix, &stop, &connects).await;
                                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                            }
                        }));
                    }
                }
                for t in tasks {
                    let _ = t.await;
                }
            });
        });
        SlowLoris {
            stop,
            connects,
            thread: Some(thread),
        }
    }

    /// Waits (up to 60 s) until `n` connections are open, then a second more so each has
    /// started its stall; fails the test if they never were.
    pub(crate) fn wait_connected(&self, n: u64) {
        let t0 = std::time::Instant::now();
        while self.connects() < n && t0.elapsed() < std::time::Duration::from_secs(60) {
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        std::thread::sleep(std::time::Duration::from_secs(1));
        assert!(
            self.connects() >= n,
            "the slow-loris attack opened only {} connections (bind 127.0.0.2 and up?)",
            self.connects()
        );
    }

    /// Connections opened so far.
    pub(crate) fn connects(&self) -> u64 {
        self.connects.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// One slow-loris connection: connect from `src`, then one byte of `prefix` a second until
/// the listener closes it (a write fails) or `stop`.
async fn trickle(
    src: std::net::SocketAddr,
    to: std::net::SocketAddr,
    prefix: &[u8],
    stop: &std::sync::atomic::AtomicBool,
    connects: &std::sync::atomic::AtomicU64,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(socket) = tokio::net::TcpSocket::new_v4() else {
        return;
    };
    if socket.bind(src).is_err() {
        return;
    }
    let connect = tokio::time::timeout(std::time::Duration::from_secs(1), socket.connect(to));
    let Ok(Ok(mut stream)) = connect.await else {
        return;
    };
    connects.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    for b in prefix {
        if stop.load(std::sync::atomic::Ordering::Relaxed) || stream.write_all(&[*b]).await.is_err()
        {
            return;
        }
        // Wait a second in slices, watching for the listener closing the connection (a read
        // of 0 bytes or an error) and for `stop`.
        let mut sink = [0u8; 256];
        for _ in 0..10 {
            if stop.load(std::sync::atomic::Ordering::Relaxed) {
                return;
            }
            let read = std::time::Duration::from_millis(100);
            match tokio::time::timeout(read, stream.read(&mut sink)).await {
                Ok(Ok(0)) | Ok(Err(_)) => return,
                Ok(Ok(_)) | Err(_) => {}
            }
        }
    }
}

impl Drop for SlowLoris {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// (layer, input, expected output bits) of layer calls.
pub(crate) type RefCases = Vec<(u32, Vec<f32>, Vec<u32>)>;

/// Calls of every MoE layer of `spec` with each of `tokens` tokens (inputs varied by `salt`),
/// answered by the in-process exact reference: one CPU backend holding every expert of the
/// synthetic weights of `seed` (bit-identical to the fabric in exact mode).
pub(crate) fn reference_cases(
    spec: &expertmesh_topology::model::ModelSpec,
    seed: u64,
    tokens: &[usize],
    salt: u64,
) -> RefCases {
    use expertmesh_quant::contract::ComputeMode;
    use expertmesh_router::reference;
    let h = spec.hidden as usize;
    let layers = spec.moe_layer_ids();
    let mut backend: expertmesh_cpu_backend::CpuBackend =
        expertmesh_worker::weights::reference_backend(spec, seed, &layers, 1, 64).unwrap();
    let mut out = Vec::new();
    for (i, &layer) in layers.iter().enumerate() {
        for &t in tokens {
            let x = reference::synthetic_hidden(salt + i as u64 * 100 + t as u64, t, h);
            let gate = reference::synthetic_gate(spec, seed, layer);
            let (_, want) = reference::moe_layer_backend(
                spec,
                &gate,
                layer,
                &mut backend,
                &x,
                ComputeMode::Exact,
            )
            .unwrap();
            out.push((layer, x, bits(&want)));
        }
    }
    out
}
