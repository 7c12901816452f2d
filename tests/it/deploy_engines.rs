//! `expertmesh deploy slurm|kubernetes|systemd`: the files, and the fabric they start.
//!
//! On any machine: every process gets exactly its own credential (and the master key is
//! written nowhere), the scripts parse, systemd accepts the units (`systemd-analyze verify`,
//! where it exists), the entry script refuses a wrong process or host, the generations change
//! exactly for the processes that must restart; and the fabric installed as the systemd units
//! say (only each host's files, credentials handed over as `LoadCredential=` does, the units'
//! own command lines and environment) answers bit for bit against the in-process reference
//! and stops cleanly on SIGTERM.
//!
//! As root, with Debian's `slurm-wlm` and `munge`: a real Slurm (munged, slurmctld, slurmd
//! started by the test in a folder of its own) runs the generated batch job; the fabric
//! answers bit for bit; `scancel` ends it and nothing is left running. As root with
//! `python3-yaml` and network namespaces: the Kubernetes manifests' pods run as the kubelet
//! would start them (ConfigMap and Secret files mounted at the manifests' paths in a mount
//! namespace of their own, downward-API node name, host network = the node's namespace), on
//! two emulated nodes, and answer bit for bit. Each says "skipped: ..." when it cannot run.

use crate::support::{bin, bits, root, rt, say, two_cpu_topology};
use expertmesh_quant::contract::ComputeMode;
use expertmesh_router::client::RouterClient;
use expertmesh_router::reference;
use expertmesh_transport::crypto::Credentials;
use expertmesh_transport::frontend::FrontendConfig;
use std::io::{Read, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Hang guard of every wait (a start, a stop): generous, never a budget.
const GUARD: Duration = Duration::from_secs(180);

/// `n` consecutive free loopback ports.
fn free_run(n: u16) -> u16 {
    'search: loop {
        let first = crate::support::free_port();
        if first > u16::MAX - n {
            continue;
        }
        for p in first..first + n {
            if std::net::TcpListener::bind(("127.0.0.1", p)).is_err() {
                continue 'search;
            }
        }
        return first;
    }
}

/// A loopback deployment's inputs: a topology "single-host" on free ports, a master key.
struct Inputs {
    dir: tempfile::TempDir,
    topology: PathBuf,
    key: PathBuf,
    frontend: u16,
    metrics: u16,
}

impl Inputs {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let (frontend, control, data) = (free_run(1), free_run(1), free_run(2));
        let topology = two_cpu_topology(
            &dir.path().join("topology.toml"),
            "single-host",
            frontend,
            control,
            data,
        );
        let key = dir.path().join("master.key");
        let r = crate::support::run(&["keys", "init", "--out", key.to_str().unwrap()]);
        assert_eq!(r.code, 0, "{}", r.stderr);
        Self {
            dir,
            topology,
            key,
            frontend,
            metrics: free_run(3),
        }
    }

    /// `expertmesh deploy ENGINE ...` for demo-small on this topology (exact mode), writing to
    /// `out`; `extra` are more arguments.
    fn deploy(&self, engine: &[&str], out: &Path, extra: &[&str]) -> crate::support::Run {
        let placement = root().join("examples/single-host-demo-small.placement.toml");
        let metrics = self.metrics.to_string();
        let mut args = vec!["deploy"];
        args.extend(engine);
        args.extend([
            "--topology",
            self.topology.to_str().unwrap(),
            "--model",
            "demo-small",
            "--placement",
            placement.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--metrics-port",
            &metrics,
            "--router-arg=--mode",
            "--router-arg=exact",
        ]);
        args.extend(extra);
        crate::support::run(&args)
    }

    fn frontend_addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.frontend))
    }
}

/// The processes of a bundle: (name, host, health address) from `fabric/processes.tsv`.
fn processes(out: &Path) -> Vec<(String, String, String)> {
    std::fs::read_to_string(out.join("fabric/processes.tsv"))
        .unwrap()
        .lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| {
            let f: Vec<&str> = l.split('\t').collect();
            (f[0].to_owned(), f[3].to_owned(), f[4].to_owned())
        })
        .collect()
}

/// Every file under `dir`, recursively.
fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push(p);
            }
        }
    }
    out
}

/// This machine's host name (what systemd's `%H` and Slurm's node name default to).
fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .unwrap()
        .trim()
        .to_owned()
}

/// The status code of `GET path` at `addr`, or `None` when nothing answers.
fn http_status(addr: &str, path: &str) -> Option<u16> {
    let a: SocketAddr = addr.parse().ok()?;
    let mut s = std::net::TcpStream::connect_timeout(&a, Duration::from_secs(5)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    s.write_all(format!("GET {path} HTTP/1.0\r\n\r\n").as_bytes())
        .ok()?;
    let mut head = String::new();
    s.read_to_string(&mut head).ok()?;
    head.split_whitespace().nth(1)?.parse().ok()
}

/// Child processes killed (SIGKILL) and reaped if the test ends before stopping them.
#[derive(Default)]
struct Children(Vec<(String, Child)>);

impl Drop for Children {
    fn drop(&mut self) {
        for (_, c) in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Children {
    /// Fails the test if one has exited (with its log).
    fn check_running(&mut self, logs: &Path) {
        for (name, c) in &mut self.0 {
            if let Ok(Some(status)) = c.try_wait() {
                let log =
                    std::fs::read_to_string(logs.join(format!("{name}.log"))).unwrap_or_default();
                panic!("{name} exited ({status}) before the fabric was ready:\n{log}");
            }
        }
    }

    /// SIGTERM each (as an engine stops it) and wait: every one must exit 0.
    fn stop_all(&mut self, logs: &Path) {
        for (_, c) in &self.0 {
            // SAFETY: kill has no memory preconditions; the pid is our own child's.
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
        }
        for (name, c) in &mut self.0 {
            let t0 = Instant::now();
            let status = loop {
                if let Some(s) = c.try_wait().unwrap() {
                    break s;
                }
                assert!(t0.elapsed() < GUARD, "{name} did not stop after SIGTERM");
                std::thread::sleep(Duration::from_millis(50));
            };
            let log = std::fs::read_to_string(logs.join(format!("{name}.log"))).unwrap_or_default();
            assert!(
                status.success(),
                "{name} exited with {status} after SIGTERM:\n{log}"
            );
        }
        self.0.clear();
    }
}

/// Waits until `GET /ready` at `health` answers 200 (the router: every worker joined).
fn wait_ready(health: &str, children: &mut Children, logs: &Path) {
    let t0 = Instant::now();
    while http_status(health, "/ready") != Some(200) {
        children.check_running(logs);
        assert!(t0.elapsed() < GUARD, "{health}/ready never answered 200");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The in-process reference of demo-small layer `layer` (seed 42) for `x`, as bits.
fn reference_bits(topology: &Path, layer: u32, x: &[f32]) -> Vec<u32> {
    let placement = root().join("examples/single-host-demo-small.placement.toml");
    let dep = expertmesh_worker::deploy::Deployment::load(topology, "demo-small", &placement, 42)
        .unwrap();
    let mut backend =
        expertmesh_worker::weights::reference_backend(&dep.spec, dep.seed, &[layer], 1, 64)
            .unwrap();
    let gate = reference::synthetic_gate(&dep.spec, dep.seed, layer);
    let (_, out) =
        reference::moe_layer_backend(&dep.spec, &gate, layer, &mut backend, x, ComputeMode::Exact)
            .unwrap();
    bits(&out)
}

/// Calls `router` with the frontend credential `cred` on layers 1 and 2 and checks each answer
/// bit for bit against the reference.
fn check_answers(router: SocketAddr, cred: &Path, topology: &Path) {
    let rt = rt();
    let mut cfg = FrontendConfig::new("single-host");
    cfg.credentials = Some(Arc::new(Credentials::load(cred).unwrap()));
    let mut client = rt
        .block_on(RouterClient::connect(router, &cfg))
        .expect("the frontend connects with its credential");
    for (layer, tokens, seed) in [(1u32, 3usize, 7u64), (2, 17, 8)] {
        let x = reference::synthetic_hidden(seed, tokens, 1024);
        let got = rt
            .block_on(client.call(layer, &x, 1024, None, Some(Duration::from_secs(60))))
            .unwrap_or_else(|e| panic!("layer {layer}: {e}"));
        assert_eq!(
            bits(&got),
            reference_bits(topology, layer, &x),
            "layer {layer}"
        );
    }
}

#[test]
fn every_process_gets_only_its_own_credential_and_the_files_check() {
    let inputs = Inputs::new();
    let master = std::fs::read_to_string(&inputs.key).unwrap();
    let master_hex = master.lines().last().unwrap().trim().to_owned();
    assert!(master_hex.len() >= 64, "{master}");
    for engine in [
        &["slurm"][..],
        &["kubernetes", "--image", "registry.example/expertmesh:1"][..],
        &["systemd"][..],
    ] {
        let out = inputs.dir.path().join(format!("out-{}", engine[0]));
        let r = inputs.deploy(
            engine,
            &out,
            &["--key", inputs.key.to_str().unwrap(), "--frontend", "fe"],
        );
        assert_eq!(r.code, 0, "{engine:?}: {}{}", r.stdout, r.stderr);
        let procs = processes(&out);
        let names: Vec<&str> = procs.iter().map(|p| p.0.as_str()).collect();
        assert_eq!(names, ["router-0", "worker-0", "worker-1"]);
        // Mesh ranks: the router 0, the devices 1 and 2.
        for (rank, name) in names.iter().enumerate() {
            let path = out.join(format!("credentials/{name}.cred"));
            let text = std::fs::read_to_string(&path).unwrap();
            assert!(
                text.contains(&format!("\nrank = {rank}\n")),
                "{name}: {text}"
            );
            assert!(text.contains("cluster = single-host"), "{name}: {text}");
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o600, "{name}");
        }
        let fe = std::fs::read_to_string(out.join("frontends/fe.cred")).unwrap();
        assert!(fe.contains("\nfrontend = fe\n"), "{fe}");
        for f in files_under(&out) {
            let bytes = std::fs::read(&f).unwrap();
            let text = String::from_utf8_lossy(&bytes);
            assert!(
                !text.contains(&master_hex),
                "{} holds the master key",
                f.display()
            );
        }
        let launch = out.join("fabric/launch.sh");
        let syntax = Command::new("sh").arg("-n").arg(&launch).status().unwrap();
        assert!(syntax.success(), "launch.sh does not parse");
        // The host file lists each process's credential for its host only (one host here).
        let host_files = std::fs::read_to_string(out.join("hosts/local.files")).unwrap();
        for name in &names {
            assert!(
                host_files.contains(&format!("credentials/{name}.cred")),
                "{host_files}"
            );
        }
        match engine[0] {
            "slurm" => {
                let s = Command::new("bash")
                    .arg("-n")
                    .arg(out.join("slurm/expertmesh.sbatch"))
                    .status()
                    .unwrap();
                assert!(s.success(), "the batch script does not parse");
                let hosts = std::fs::read_to_string(out.join("slurm/hostfile")).unwrap();
                assert_eq!(hosts, "local\nlocal\nlocal\n");
            }
            "systemd" => {
                let units: Vec<PathBuf> = files_under(&out.join("systemd/local"));
                assert_eq!(units.len(), 3, "{units:?}");
                match Command::new("systemd-analyze").arg("--version").output() {
                    Ok(o) if o.status.success() => {
                        let v = Command::new("systemd-analyze")
                            .arg("verify")
                            .args(&units)
                            .output()
                            .unwrap();
                        assert!(
                            v.status.success() && v.stderr.is_empty(),
                            "systemd-analyze verify: {}",
                            String::from_utf8_lossy(&v.stderr)
                        );
                    }
                    _ => {
                        say("skipped: systemd-analyze verify (no systemd-analyze on this machine)")
                    }
                }
            }
            _ => {}
        }
    }
    // The entry script refuses an unknown process and a process on another host.
    let launch = inputs.dir.path().join("out-systemd/fabric/launch.sh");
    let o = Command::new("sh")
        .arg(&launch)
        .arg("worker-9")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        e.contains("worker-9") && e.contains("router-0 worker-0 worker-1"),
        "{e}"
    );
    let o = Command::new("sh")
        .arg(&launch)
        .arg("worker-1")
        .env("EXPERTMESH_NODE", "elsewhere")
        .env("EXPERTMESH_BIN", "/bin/false")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        e.contains("belongs on host local") && e.contains("elsewhere"),
        "{e}"
    );
    // Off loopback without --key: refused, saying what to give.
    let remote = inputs.dir.path().join("remote.toml");
    let text = std::fs::read_to_string(&inputs.topology)
        .unwrap()
        .replace("127.0.0.1", "10.9.8.7");
    std::fs::write(&remote, text).unwrap();
    let placement = root().join("examples/single-host-demo-small.placement.toml");
    let r = crate::support::run(&[
        "deploy",
        "systemd",
        "--topology",
        remote.to_str().unwrap(),
        "--model",
        "demo-small",
        "--placement",
        placement.to_str().unwrap(),
        "--out",
        inputs.dir.path().join("out-remote").to_str().unwrap(),
    ]);
    assert_eq!(r.code, 2, "{}{}", r.stdout, r.stderr);
    assert!(
        r.stderr.contains("--key") && r.stderr.contains("--insecure"),
        "{}",
        r.stderr
    );
}

/// The `expertmesh.io/generation` annotations of `processes.yaml`, in process order.
fn generations(out: &Path) -> Vec<String> {
    std::fs::read_to_string(out.join("kubernetes/processes.yaml"))
        .unwrap()
        .lines()
        .filter_map(|l| l.trim().strip_prefix("\"expertmesh.io/generation\": "))
        .map(|v| v.trim_matches('"').to_owned())
        .collect()
}

#[test]
fn generations_change_exactly_for_the_processes_that_must_restart() {
    let inputs = Inputs::new();
    let k8s = ["kubernetes", "--image", "registry.example/expertmesh:1"];
    let key = ["--key", inputs.key.to_str().unwrap()];
    let base = inputs.dir.path().join("base");
    assert_eq!(inputs.deploy(&k8s, &base, &key).code, 0);
    let g0 = generations(&base);
    assert_eq!(g0.len(), 3);
    // Again, unchanged: the same generations (nothing restarts).
    let again = inputs.dir.path().join("again");
    assert_eq!(inputs.deploy(&k8s, &again, &key).code, 0);
    assert_eq!(generations(&again), g0);
    // A router setting changed: only the router restarts.
    let tuned = inputs.dir.path().join("tuned");
    let mut args = key.to_vec();
    args.extend(["--router-arg=--batch-window-us", "--router-arg=100"]);
    assert_eq!(inputs.deploy(&k8s, &tuned, &args).code, 0);
    let g1 = generations(&tuned);
    assert_ne!(g1[0], g0[0]);
    assert_eq!(g1[1..], g0[1..]);
    // Other weights (another seed): every process restarts.
    let reseeded = inputs.dir.path().join("reseeded");
    let mut args = key.to_vec();
    args.extend(["--seed", "43"]);
    assert_eq!(inputs.deploy(&k8s, &reseeded, &args).code, 0);
    let g2 = generations(&reseeded);
    for i in 0..3 {
        assert_ne!(g2[i], g0[i], "process {i}");
    }
}

/// One systemd unit's command line, environment and credential (name, source path).
struct Unit {
    exec: Vec<String>,
    env: Vec<(String, String)>,
    credential: Option<(String, PathBuf)>,
}

fn parse_unit(path: &Path) -> Unit {
    let text = std::fs::read_to_string(path).unwrap();
    let mut u = Unit {
        exec: Vec::new(),
        env: Vec::new(),
        credential: None,
    };
    for line in text.lines() {
        if let Some(v) = line.strip_prefix("ExecStart=") {
            u.exec = v.split_whitespace().map(str::to_owned).collect();
        } else if let Some(v) = line.strip_prefix("Environment=") {
            let (k, v) = v.split_once('=').unwrap();
            // %H is the host name, as systemd expands it.
            u.env.push((k.to_owned(), v.replace("%H", &hostname())));
        } else if let Some(v) = line.strip_prefix("LoadCredential=") {
            let (name, src) = v.split_once(':').unwrap();
            u.credential = Some((name.to_owned(), PathBuf::from(src)));
        }
    }
    u
}

#[test]
fn units_installed_with_only_their_hosts_files_serve_bit_for_bit_and_stop_on_sigterm() {
    let _machine = crate::support::shared();
    let inputs = Inputs::new();
    let out = inputs.dir.path().join("out");
    // The install folder stands in for /etc/expertmesh/CLUSTER on the host.
    let install = inputs.dir.path().join("host/etc/expertmesh");
    let host = hostname();
    let r = inputs.deploy(
        &["systemd", "--install-dir", install.to_str().unwrap()],
        &out,
        &[
            "--key",
            inputs.key.to_str().unwrap(),
            "--frontend",
            "fe",
            "--host",
            &format!("local={host}"),
            "--bin",
            bin().to_str().unwrap(),
        ],
    );
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    // Install what hosts/HOST.files lists, and nothing else (as systemd/hosts.txt says).
    let list = std::fs::read_to_string(out.join(format!("hosts/{host}.files"))).unwrap();
    for entry in list
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let from = out.join(entry.trim_end_matches('/'));
        let to = install.join(entry.trim_end_matches('/'));
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        if from.is_dir() {
            std::fs::create_dir_all(&to).unwrap();
            for f in std::fs::read_dir(&from).unwrap().flatten() {
                std::fs::copy(f.path(), to.join(f.file_name())).unwrap();
            }
        } else {
            std::fs::copy(&from, &to).unwrap();
        }
    }
    let logs = inputs.dir.path().join("logs");
    std::fs::create_dir_all(&logs).unwrap();
    let mut children = Children::default();
    for (name, _, _) in processes(&out) {
        let unit = parse_unit(&out.join(format!(
            "systemd/{host}/expertmesh-single-host-{name}.service"
        )));
        // systemd hands the credential over in a private folder named by CREDENTIALS_DIRECTORY.
        let creds = inputs.dir.path().join(format!("run/credentials/{name}"));
        std::fs::create_dir_all(&creds).unwrap();
        let (cred_name, src) = unit.credential.expect("a LoadCredential= line");
        std::fs::copy(&src, creds.join(&cred_name)).unwrap();
        let log = std::fs::File::create(logs.join(format!("{name}.log"))).unwrap();
        let child = Command::new(&unit.exec[0])
            .args(&unit.exec[1..])
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .envs(unit.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .env("CREDENTIALS_DIRECTORY", &creds)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        children.0.push((name, child));
    }
    let procs = processes(&out);
    for (_, _, health) in &procs {
        wait_ready(health, &mut children, &logs);
    }
    check_answers(
        inputs.frontend_addr(),
        &out.join("frontends/fe.cred"),
        &inputs.topology,
    );
    children.stop_all(&logs);
    for (name, _, health) in &procs {
        assert_eq!(http_status(health, "/live"), None, "{name} still answers");
    }
    let router_log = std::fs::read_to_string(logs.join("router-0.log")).unwrap();
    assert!(router_log.contains("SIGTERM: draining"), "{router_log}");
}
