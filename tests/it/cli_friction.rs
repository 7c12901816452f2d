//! A first-time user's path through `expertmesh up` → `expertmesh infer`, run as a user runs it:
//! the real binary, real worker processes, real sockets on 127.0.0.1.
//!
//! Checks (issue 14, part B): a worker that cannot start makes `up` fail at once naming the
//! device (id and topology rank) with its log; frontends are refused, naming the missing
//! workers, until every worker has connected; `infer --help` and the README say how to make the
//! input; float64 input is converted with a note; host names are accepted; connection and I/O
//! errors are said once; a mesh port is recognised as not the frontend; an input over the
//! router's per-request limit is refused from its header, before its data is read, with exit 1;
//! micro-batches too large for one frame are refused when `up` starts, naming the size that fits.

use expertmesh::npy::{self, NpyDtype};
use expertmesh_fabric::local::{LocalFabric, LocalFabricOptions};
use expertmesh_router::client::RouterClient;
use expertmesh_router::reference;
use std::net::{SocketAddr, TcpListener};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::support::{bin, free_port, root, rt, two_cpu_topology};

struct Run {
    code: Option<i32>,
    stdout: String,
    stderr: String,
    took: Duration,
}

/// Run `cmd` with its output in files (no pipe can fill up), killed after `limit`.
fn run(mut cmd: Command, limit: Duration) -> Run {
    let dir = tempfile::tempdir().unwrap();
    let (out, err) = (dir.path().join("out"), dir.path().join("err"));
    let t = Instant::now();
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .unwrap();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break Some(s);
        }
        if t.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let r = Run {
        code: status.and_then(|s| s.code()),
        stdout: std::fs::read_to_string(&out).unwrap(),
        stderr: std::fs::read_to_string(&err).unwrap(),
        took: t.elapsed(),
    };
    assert!(!r.stderr.contains("panicked"), "{}", r.stderr);
    r
}

fn infer(router: &str, cluster: &str, layer: u32, input: &Path, output: &Path) -> Run {
    let mut c = Command::new(bin());
    c.args(["infer", "--router", router, "--cluster", cluster])
        .args(["--layer", &layer.to_string()])
        .arg("--input")
        .arg(input)
        .arg("--output")
        .arg(output);
    run(c, Duration::from_secs(60))
}

fn options() -> LocalFabricOptions {
    let mut o = LocalFabricOptions::new(
        root().join("examples/single-host.toml"),
        "demo-small",
        root().join("examples/single-host-demo-small.placement.toml"),
    );
    o.exe = bin();
    o.ephemeral_ports = true;
    o.connect_timeout = Duration::from_secs(60);
    o
}

#[test]
fn up_reports_a_worker_that_cannot_start_at_once_by_device_name_and_rank() {
    let _machine = crate::support::shared();
    let dir = tempfile::tempdir().unwrap();
    // cpu0's data port is taken (held by this test); cpu1's is free.
    // Two free ports below the ephemeral range (cpu1's must stay free until `up` binds it).
    let data = expertmesh_transport::ports::free_loopback_ports(2).unwrap();
    let busy = TcpListener::bind(("127.0.0.1", data)).unwrap();
    let topo = two_cpu_topology(
        &dir.path().join("friction.toml"),
        "friction",
        free_port(),
        free_port(),
        data,
    );
    // With a cluster key: the workers' credential files sit beside their logs.
    let key = dir.path().join("cluster.key");
    let k = crate::support::run(&["keys", "init", "--out", key.to_str().unwrap()]);
    assert_eq!(k.code, 0, "{}", k.stderr);
    let mut c = Command::new(bin());
    c.arg("up")
        .arg("--topology")
        .arg(&topo)
        .args(["--model", "demo-small", "--key"])
        .arg(&key);
    let r = run(c, Duration::from_secs(60));
    drop(busy);
    let all = format!("{}{}", r.stdout, r.stderr);
    assert_eq!(
        r.code,
        Some(2),
        "up exits 2 when a worker cannot start:\n{all}"
    );
    assert!(
        r.took < Duration::from_secs(30),
        "reported after {:?}, not at once",
        r.took
    );
    assert!(
        r.stderr
            .contains("worker local/cpu0 (rank 0) failed to start"),
        "names the device and its topology rank:\n{all}"
    );
    assert!(
        r.stderr
            .contains(&format!("cannot listen on 127.0.0.1:{data}")),
        "shows the worker's own error from its log:\n{all}"
    );
    let log = r
        .stderr
        .split(" log (")
        .nth(1)
        .and_then(|s| s.split("):").next())
        .unwrap_or_else(|| panic!("the error names the worker's log:\n{all}"));
    assert!(log.ends_with("worker-0.log"), "{log}");
    let text = std::fs::read_to_string(log).expect("the log is kept after `up` exits");
    assert!(text.contains("cannot listen on"), "{text}");
    let kept = Path::new(log).parent().unwrap();
    let secrets: Vec<_> = std::fs::read_dir(kept)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".cred"))
        .collect();
    assert!(
        secrets.is_empty(),
        "credentials kept with the logs: {secrets:?}"
    );
    assert!(
        kept.join("KEPT-AFTER-A-FAILED-START").exists(),
        "a later fabric's sweep would remove the logs the error names"
    );
    let _ = std::fs::remove_dir_all(kept);
    // Only the worker that failed is blamed (the other one's info line "worker connected …
    // (rank 1)" is no blame).
    let blame: Vec<&str> = all
        .lines()
        .filter(|l| !l.contains(" INFO ") && !l.contains(" DEBUG "))
        .collect();
    assert!(
        !blame
            .iter()
            .any(|l| l.contains("rank 1") || l.contains("ranks [")),
        "{all}"
    );
    assert!(
        !r.stdout.contains("frontends:"),
        "a fabric without all its workers is not announced:\n{all}"
    );
}

/// `expertmesh up` of demo-small on the single-host example and its placement.
fn up_demo_small() -> Command {
    let mut c = Command::new(bin());
    c.arg("up")
        .arg("--topology")
        .arg(root().join("examples/single-host.toml"))
        .args(["--model", "demo-small", "--placement"])
        .arg(root().join("examples/single-host-demo-small.placement.toml"));
    c
}

/// Micro-batches whose parts could not fit one frame are refused when `up` starts (exit 2),
/// saying which size fits, instead of a fabric that fails the calls routed that way.
#[test]
fn up_refuses_micro_batches_that_do_not_fit_a_frame() {
    let mut c = up_demo_small();
    c.args([
        "--mode",
        "exact",
        "--micro-batch",
        "4000",
        "--max-tokens",
        "4000",
        "--max-inflight-tokens",
        "4000",
    ]);
    let r = run(c, Duration::from_secs(60));
    let all = format!("{}{}", r.stdout, r.stderr);
    assert_eq!(r.code, Some(2), "{all}");
    assert!(
        r.stderr
            .contains("micro-batches of 4000 tokens are too large for demo-small"),
        "{all}"
    );
    let fits: usize = r
        .stderr
        .split("use micro-batches of ")
        .nth(1)
        .and_then(|s| s.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("names the size that fits:\n{all}"));
    assert!((1..4000).contains(&fits), "{fits}");
    assert!(
        !r.stdout.contains("frontends:"),
        "nothing was announced:\n{all}"
    );
}

/// Request limits that would refuse requests for ever (no token allowed, or requests larger
/// than the router ever admits at once) are refused when `up` starts (exit 2), naming the
/// option to change, instead of a fabric that answers "at capacity, retry" to an idle router.
#[test]
fn up_refuses_request_limits_that_no_request_could_pass() {
    for (limits, says) in [
        (["--max-tokens", "0"], "set --max-tokens to 1 or more"),
        (
            ["--max-tokens", "3000"],
            "raise --max-inflight-tokens to at least --max-tokens",
        ),
        (
            ["--max-inflight-tokens", "0"],
            "set --max-inflight-tokens to at least --max-tokens",
        ),
    ] {
        let mut c = up_demo_small();
        c.args(["--micro-batch", "8"]).args(limits);
        let r = run(c, Duration::from_secs(60));
        let all = format!("{}{}", r.stdout, r.stderr);
        assert_eq!(r.code, Some(2), "{all}");
        assert!(r.stderr.contains(says), "{all}");
        assert!(
            !r.stdout.contains("frontends:"),
            "nothing was announced:\n{all}"
        );
    }
}

/// A request size whose answer (f32 rows) could not go back in one frontend frame is refused
/// when `up` starts, naming the most tokens that fit: such requests were computed and their
/// answers never sent.
#[test]
fn up_refuses_requests_whose_answer_cannot_fit_a_frame() {
    let mut c = up_demo_small();
    c.args([
        "--micro-batch",
        "8",
        "--max-tokens",
        "20000",
        "--max-inflight-tokens",
        "20000",
    ]);
    let r = run(c, Duration::from_secs(60));
    let all = format!("{}{}", r.stdout, r.stderr);
    assert_eq!(r.code, Some(2), "{all}");
    assert!(
        r.stderr
            .contains("the answer to a request of 20000 tokens (`--max-tokens`) is"),
        "{all}"
    );
    let fits: usize = r
        .stderr
        .split("lower --max-tokens to ")
        .nth(1)
        .and_then(|s| s.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("names the size that fits:\n{all}"));
    // demo-small's answers are 1,024 f32 values (4 KiB) a token; frames hold 64 MiB.
    assert!((16_000..16_384).contains(&fits), "{fits}");
    assert!(
        !r.stdout.contains("frontends:"),
        "nothing was announced:\n{all}"
    );
}

/// A device given by mistake for a topology is refused once past any real file's size (it
/// used to be read until the process was killed), and a JSON file is told that these files
/// are TOML.
#[test]
fn validate_refuses_an_endless_file_and_names_json() {
    let r = crate::support::run(&["validate", "/dev/zero"]);
    assert_eq!(r.code, 2, "{}{}", r.stdout, r.stderr);
    assert!(
        r.stderr.contains("/dev/zero") && r.stderr.contains("more than 256 MiB"),
        "{}",
        r.stderr
    );
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("topology.json");
    std::fs::write(&json, "{\"format\": 1, \"name\": \"x\"}\n").unwrap();
    let r = crate::support::run(&["validate", json.to_str().unwrap()]);
    assert_eq!(r.code, 1, "{}{}", r.stdout, r.stderr);
    let all = format!("{}{}", r.stdout, r.stderr);
    assert!(all.contains("looks like JSON"), "{all}");
}

/// Durations past what a deadline can hold (they made the router panic when a connection,
/// a drain or a rebalancing step first added them to the clock), negative or not numbers are
/// refused before anything starts (exit 2), naming the flag and the range it takes.
#[test]
fn duration_flags_out_of_range_are_refused_naming_the_flag() {
    for (flag, value) in [
        ("--frontend-idle-timeout-s", "18446744073709551615"),
        ("--frontend-frame-timeout-s", "86401"),
        ("--deadline-ms", "18446744073709551615"),
        ("--straggler-ms", "90000000"),
        ("--auto-rebalance-timeout-s", "1e19"),
        ("--auto-rebalance-every", "NaN"),
        ("--auto-rebalance-every", "-5"),
        ("--auto-rebalance-every", "0"),
        ("--auto-rebalance-timeout-s", "1e-12"),
        ("--load-stats-every", "1e19"),
    ] {
        let mut c = up_demo_small();
        c.arg(format!("{flag}={value}"));
        let r = run(c, Duration::from_secs(60));
        let all = format!("{}{}", r.stdout, r.stderr);
        assert_eq!(r.code, Some(2), "{flag} {value}: {all}");
        assert!(r.stderr.contains(flag), "{flag} {value}: {all}");
        assert!(
            !r.stdout.contains("frontends:"),
            "{flag} {value}: nothing was announced:\n{all}"
        );
    }
    let r = crate::support::run(&["router", "--drain-timeout-s=-5"]);
    assert_eq!(r.code, 2, "{}{}", r.stdout, r.stderr);
    assert!(r.stderr.contains("--drain-timeout-s"), "{}", r.stderr);
    // A link timeout shorter than four of a peer's heartbeats would drop healthy links.
    for sub in ["router", "worker", "up"] {
        for value in ["1.9", "0", "NaN", "86401"] {
            let r = crate::support::run(&[sub, &format!("--link-timeout-s={value}")]);
            assert_eq!(r.code, 2, "{sub} {value}: {}{}", r.stdout, r.stderr);
            assert!(
                r.stderr.contains("--link-timeout-s") && r.stderr.contains("four heartbeats"),
                "{sub} {value}: {}",
                r.stderr
            );
        }
    }
    // Thread counts: at least one, at most a topology's bound (a typo of 100000 made that
    // many threads and their buffers before anything said no).
    for args in [
        &["router"][..],
        &["worker"],
        &["convert"],
        &["bench", "kernels"],
        &["bench", "convert"],
    ] {
        for value in ["0", "4097"] {
            let mut a = args.to_vec();
            let flag = format!("--threads={value}");
            a.push(&flag);
            let r = crate::support::run(&a);
            assert_eq!(r.code, 2, "{a:?}: {}{}", r.stdout, r.stderr);
            assert!(
                r.stderr.contains("--threads") && r.stderr.contains("4096"),
                "{a:?}: {}",
                r.stderr
            );
        }
    }
    // A rebalancing step needs some time: zero, NaN and past a day are refused before any
    // file is read or any router is asked.
    for value in ["0", "NaN", "86401"] {
        let r = crate::support::run(&[
            "rebalance",
            "--topology",
            "/nonexistent/topology.toml",
            "--router",
            "127.0.0.1:1",
            "--placement",
            "/nonexistent/placement.toml",
            &format!("--timeout-s={value}"),
        ]);
        assert_eq!(r.code, 2, "--timeout-s {value}: {}{}", r.stdout, r.stderr);
        assert!(
            r.stderr.contains("--timeout-s") && !r.stderr.contains("/nonexistent"),
            "--timeout-s {value}: {}",
            r.stderr
        );
    }
}

#[test]
fn frontends_are_refused_naming_the_missing_workers_until_every_worker_is_up() {
    let _machine = crate::support::shared();
    let dir = tempfile::tempdir().unwrap();
    // Workers that take two seconds to start: this binary behind a shell script.
    let slow = dir.path().join("slow-expertmesh");
    std::fs::write(
        &slow,
        format!("#!/bin/sh\nsleep 2\nexec '{}' \"$@\"\n", bin().display()),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&slow, std::fs::Permissions::from_mode(0o755)).unwrap();
    let port = free_port();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let mut o = options();
    o.exe = slow;
    o.frontend_listen = Some(addr);
    let cfg = expertmesh_transport::frontend::FrontendConfig::new("single-host");
    // The fabric lives in its own thread for the whole test: workers die with the thread
    // that started them.
    let (started_tx, started_rx) = std::sync::mpsc::channel();
    let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
    let owner = std::thread::spawn(move || {
        let f = LocalFabric::start(o).map(|f| (f.deployment().spec.clone(), f));
        match f {
            Ok((spec, f)) => {
                started_tx.send(Ok(spec)).unwrap();
                let _ = stop_rx.recv_timeout(Duration::from_secs(60));
                f.shutdown();
            }
            Err(e) => started_tx.send(Err(format!("{e:#}"))).unwrap(),
        }
    });
    let rt = rt();
    let t = Instant::now();
    let refusal = loop {
        assert!(t.elapsed() < Duration::from_secs(30), "never refused");
        match rt.block_on(RouterClient::connect(addr, &cfg)) {
            Err(e) if e.to_string().contains("refused the connection") => break e.to_string(),
            Err(_) => std::thread::sleep(Duration::from_millis(20)), // not listening yet
            Ok(_) => panic!("a frontend was accepted before the workers connected"),
        }
    };
    assert!(
        refusal.contains("have not connected yet") && refusal.contains("local/cpu0 (rank 0)"),
        "{refusal}"
    );
    let spec = started_rx
        .recv_timeout(Duration::from_secs(60))
        .unwrap()
        .unwrap();
    let h = spec.hidden as usize;
    let mut c = rt.block_on(RouterClient::connect(addr, &cfg)).unwrap();
    let x = reference::synthetic_hidden(3, 2, h);
    let y = rt.block_on(c.call(1, &x, h, None, None)).unwrap();
    assert_eq!(y.len(), 2 * h, "served once every worker is up");
    stop_tx.send(()).unwrap();
    owner.join().unwrap();
}

#[test]
fn help_and_readme_say_how_to_make_the_input() {
    let _machine = crate::support::shared();
    let mut c = Command::new(bin());
    c.args(["infer", "--help"]);
    let r = run(c, Duration::from_secs(60));
    assert_eq!(r.code, Some(0));
    for want in [
        "import numpy as np",
        ".astype(np.float32)",
        "np.save(\"x.npy\", x)",
        "[tokens, hidden]",
        "uint16",
        "float64",
    ] {
        assert!(
            r.stdout.contains(want),
            "infer --help lacks {want:?}:\n{}",
            r.stdout
        );
    }
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    // The first screen: the newcomer path, up then infer, with the NumPy recipe.
    let first: String = readme.lines().take(45).collect::<Vec<_>>().join("\n");
    for want in [
        "expertmesh up",
        "import numpy as np",
        "np.save(",
        "expertmesh infer",
    ] {
        assert!(first.contains(want), "README's first screen lacks {want:?}");
    }
    assert!(first.find("expertmesh up") < first.find("expertmesh infer"));
}

/// One fabric (library launcher, real worker processes), then `infer` as a user runs it.
#[test]
fn infer_as_a_user_runs_it() {
    let _machine = crate::support::shared();
    let fabric = LocalFabric::start(options()).unwrap();
    let spec = fabric.deployment().spec.clone();
    let h = spec.hidden as usize;
    let dir = tempfile::tempdir().unwrap();
    let front = fabric.frontend_addr();
    let x = reference::synthetic_hidden(11, 3, h);
    let (x32, x64) = (dir.path().join("x32.npy"), dir.path().join("x64.npy"));
    std::fs::write(&x32, npy::encode(3, h, &x, NpyDtype::F32)).unwrap();
    std::fs::write(&x64, npy::encode(3, h, &x, NpyDtype::F64)).unwrap();
    let (y32, y64) = (dir.path().join("y32.npy"), dir.path().join("y64.npy"));

    // 3. the worker's log names its device by id and topology rank
    let log = std::fs::read_to_string(fabric.log_dir().join("worker-0.log")).unwrap();
    assert!(log.contains("worker local/cpu0 (rank 0) ready"), "{log}");
    assert!(!log.contains("rank 1"), "{log}");

    // 4. a host name for --router
    let r = infer(
        &format!("localhost:{}", front.port()),
        "single-host",
        1,
        &x32,
        &y32,
    );
    assert_eq!(r.code, Some(0), "{}", r.stderr);

    // 2. float64 input: converted to f32 with a note, same answer
    let r = infer(&front.to_string(), "single-host", 1, &x64, &y64);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    assert!(
        r.stderr.contains("float64") && r.stderr.contains("converted to float32"),
        "{}",
        r.stderr
    );
    assert_eq!(npy::read(&y64).unwrap(), npy::read(&y32).unwrap());

    // 4. errors said once: wrong cluster, closed port, unwritable output
    let r = infer(&front.to_string(), "no-such-cluster", 1, &x32, &y32);
    assert_eq!(r.code, Some(2));
    assert_eq!(
        r.stderr.matches("belongs to cluster").count(),
        1,
        "{}",
        r.stderr
    );
    let closed = format!("127.0.0.1:{}", free_port());
    let r = infer(&closed, "single-host", 1, &x32, &y32);
    assert_eq!(r.code, Some(2));
    assert_eq!(
        r.stderr.matches("onnection refused").count(),
        1,
        "{}",
        r.stderr
    );
    assert!(r.stderr.contains("is the router running"), "{}", r.stderr);
    let nowhere = dir.path().join("no-such-dir/y.npy");
    let r = infer(&front.to_string(), "single-host", 1, &x32, &nowhere);
    assert_eq!(r.code, Some(2));
    assert_eq!(
        r.stderr.matches("No such file or directory").count(),
        1,
        "{}",
        r.stderr
    );

    // 4. a mesh port is not the frontend: a worker's, and the router's port for workers
    let worker = log
        .split("listening on ")
        .nth(1)
        .and_then(|s| s.split(',').next())
        .expect("the worker log says where it listens")
        .to_string();
    let mesh = fabric.service().mesh_addr().unwrap().to_string();
    for (port, what) in [
        (&worker, "a worker's mesh port (device rank 0)"),
        (&mesh, "mesh port"),
    ] {
        let r = infer(port, "single-host", 1, &x32, &y32);
        assert_eq!(r.code, Some(2), "{port}: {}", r.stderr);
        assert!(
            r.stderr.contains(what) && r.stderr.contains("not the router's frontend port"),
            "{port}: {}",
            r.stderr
        );
        assert!(!r.stderr.contains("receive window"), "{}", r.stderr);
    }

    // 5. too many tokens: refused from the header (the 4 GB of data are a sparse file's hole,
    //    never read), exit 1
    let huge = dir.path().join("huge.npy");
    let mut header =
        format!("{{'descr': '<f4', 'fortran_order': False, 'shape': (1000000, {h}), }}");
    header.push_str(&" ".repeat(63 - (10 + header.len()) % 64));
    header.push('\n');
    let mut bytes = b"\x93NUMPY\x01\x00".to_vec();
    bytes.extend_from_slice(&(header.len() as u16).to_le_bytes());
    bytes.extend_from_slice(header.as_bytes()); // 4 GB of data announced
    std::fs::write(&huge, &bytes).unwrap();
    let data = 1_000_000 * h as u64 * 4;
    let file = std::fs::OpenOptions::new().write(true).open(&huge).unwrap();
    file.set_len(bytes.len() as u64 + data).unwrap(); // a hole: no disk used
    drop(file);
    for (input, tokens) in [(huge, 1_000_000usize), (dir.path().join("257.npy"), 257)] {
        if tokens == 257 {
            let x = reference::synthetic_hidden(1, 257, h);
            std::fs::write(&input, npy::encode(257, h, &x, NpyDtype::F32)).unwrap();
        }
        let r = infer(&front.to_string(), "single-host", 1, &input, &y32);
        assert_eq!(r.code, Some(1), "{tokens} tokens: {}", r.stderr);
        assert!(
            r.stderr.contains(&format!("{tokens} tokens"))
                && r.stderr.contains("1 to 256 tokens")
                && r.stderr.contains("split"),
            "{}",
            r.stderr
        );
        assert!(r.took < Duration::from_secs(60), "took {:?}", r.took);
    }
    fabric.shutdown();
}
