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
//! As root, with Debian's `slurm-wlm` and `munge`: a real two-node Slurm (munged, slurmctld
//! and one slurmd per node, each node a network namespace, started by the test in a folder of
//! its own) runs the generated batch job, each task on its node; the fabric answers bit for
//! bit, a killed worker task is restarted on its node and the fabric answers again, and
//! `scancel` ends it with nothing left running. Converted weights are served from per-host
//! folders holding only what `hosts/HOST.files` lists. As root with
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

/// `n` consecutive free loopback ports, all of them kept from later picks of this process (a
/// run built on a single picked port left its others free to hand out again: a topology's
/// control port once equalled a device's data port).
fn free_run(n: u16) -> u16 {
    expertmesh_transport::ports::free_loopback_ports(n).expect("free loopback ports")
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
        self.deploy_on(&self.topology, &example_placement(), engine, out, extra)
    }

    /// [`Inputs::deploy`] of `topology` with `placement`.
    fn deploy_on(
        &self,
        topology: &Path,
        placement: &Path,
        engine: &[&str],
        out: &Path,
        extra: &[&str],
    ) -> crate::support::Run {
        let metrics = self.metrics.to_string();
        let mut args = vec!["deploy"];
        args.extend(engine);
        args.extend([
            "--topology",
            topology.to_str().unwrap(),
            "--model",
            "demo-small",
            "--placement",
            placement.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--router-arg=--mode",
            "--router-arg=exact",
        ]);
        // This fabric's free metrics ports, unless the caller gives its own.
        if !extra.contains(&"--metrics-port") {
            args.extend(["--metrics-port", &metrics]);
        }
        args.extend(extra);
        crate::support::run(&args)
    }

    /// Deploy demo-small on the two emulated nodes ([`two_node_files`]), node-a and node-b on
    /// the engine's hosts `hosts`, with this master key and a frontend "fe"; asserts it was
    /// written. Returns the topology and placement.
    fn deploy_two_nodes(
        &self,
        engine: &[&str],
        out: &Path,
        hosts: [&str; 2],
        extra: &[&str],
    ) -> (PathBuf, PathBuf) {
        let (topology, placement) = two_node_files(self.dir.path());
        let (a, b) = (
            format!("node-a={}", hosts[0]),
            format!("node-b={}", hosts[1]),
        );
        let key = self.key.to_str().unwrap();
        let mut args = vec!["--key", key, "--frontend", "fe", "--host", &a, "--host", &b];
        args.extend(extra);
        let r = self.deploy_on(&topology, &placement, engine, out, &args);
        assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
        (topology, placement)
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
    http_get(addr, path)?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// The whole answer (head and body) to `GET path` at `addr`.
fn http_get(addr: &str, path: &str) -> Option<String> {
    let a: SocketAddr = addr.parse().ok()?;
    let mut s = std::net::TcpStream::connect_timeout(&a, Duration::from_secs(5)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    s.write_all(format!("GET {path} HTTP/1.0\r\n\r\n").as_bytes())
        .ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    Some(text)
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

/// The example placement of demo-small on a one-node "single-host" topology.
fn example_placement() -> PathBuf {
    root().join("examples/single-host-demo-small.placement.toml")
}

/// The in-process reference of demo-small layer `layer` (seed 42) for `x`, as bits.
fn reference_bits(topology: &Path, placement: &Path, layer: u32, x: &[f32]) -> Vec<u32> {
    let dep =
        expertmesh_worker::deploy::Deployment::load(topology, "demo-small", placement, 42).unwrap();
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
/// bit for bit against the reference (demo-small on `topology` with the example placement).
fn check_answers(router: SocketAddr, cred: &Path, topology: &Path) {
    check_answers_placed(router, cred, topology, &example_placement(), "single-host");
}

/// [`check_answers`] for fabric `cluster` with `placement`.
fn check_answers_placed(
    router: SocketAddr,
    cred: &Path,
    topology: &Path,
    placement: &Path,
    cluster: &str,
) {
    let rt = rt();
    let mut cfg = FrontendConfig::new(cluster);
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
            reference_bits(topology, placement, layer, &x),
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
        if engine[0] == "kubernetes" {
            use std::os::unix::fs::PermissionsExt;
            let secrets = out.join("kubernetes/credentials.yaml");
            let mode = std::fs::metadata(&secrets).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o600, "the Secrets' manifest");
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
                        // Only what it says about these units counts: it also loads the
                        // machine's own units, whose complaints vary from one systemd and
                        // distribution to another.
                        let said = String::from_utf8_lossy(&v.stderr);
                        let names: Vec<String> = units
                            .iter()
                            .map(|u| u.file_name().unwrap().to_string_lossy().into_owned())
                            .collect();
                        let ours: Vec<&str> = said
                            .lines()
                            .filter(|l| names.iter().any(|n| l.contains(n.as_str())))
                            .collect();
                        assert!(
                            ours.is_empty(),
                            "systemd-analyze verify: {}",
                            ours.join("\n")
                        );
                        if !v.status.success() || !said.is_empty() {
                            say(&format!(
                                "note: systemd-analyze verify said nothing about these units, but: {said}"
                            ));
                        }
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
    let placement = example_placement();
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

/// The Kubernetes bundle's `processes.yaml` in `out`.
fn process_manifests(out: &Path) -> String {
    std::fs::read_to_string(out.join("kubernetes/processes.yaml")).unwrap()
}

/// The manifest documents of process `name` (`router-0`, `worker-1`) in the bundle `out`,
/// joined (its Deployment first).
fn process_manifest(out: &Path, name: &str) -> String {
    let all = process_manifests(out);
    let docs: Vec<&str> = all.split("\n---\n").filter(|d| d.contains(name)).collect();
    assert!(!docs.is_empty(), "no manifest of {name}");
    docs.join("\n---\n")
}

/// The systemd unit of process `name` (`router-0`, `worker-1`) for the single-host topology's
/// node, in the bundle `out`.
fn systemd_unit(out: &Path, name: &str) -> String {
    std::fs::read_to_string(out.join(format!(
        "systemd/local/expertmesh-single-host-{name}.service"
    )))
    .unwrap()
}

/// The `expertmesh.io/generation` annotations of `processes.yaml`, in process order.
fn generations(out: &Path) -> Vec<String> {
    process_manifests(out)
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
            // A double-quoted assignment, as systemd reads it: `\"`, `\\` and `%%` unescaped.
            let v = match v.strip_prefix('"').and_then(|q| q.strip_suffix('"')) {
                Some(q) => q
                    .replace("\\\"", "\"")
                    .replace("\\\\", "\\")
                    .replace("%%", "%"),
                None => v.to_owned(),
            };
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

/// Paths with spaces: the unit keeps a `--bin` path whole (its environment assignment quoted)
/// and lets the service read files under home folders (where the README's weights live);
/// Slurm refuses an output folder its `#SBATCH` lines cannot hold, saying what to do.
#[test]
fn deploy_files_keep_paths_with_spaces_whole_or_refuse_them() {
    let inputs = Inputs::new();
    let out = inputs.dir.path().join("out");
    let bin = "/opt/em bin/expert%mesh";
    let r = inputs.deploy(&["systemd"], &out, &["--bin", bin]);
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    let units: Vec<PathBuf> = files_under(&out.join("systemd"))
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "service"))
        .collect();
    assert!(!units.is_empty());
    for path in &units {
        let u = parse_unit(path);
        let got = u.env.iter().find(|(k, _)| k == "EXPERTMESH_BIN");
        assert_eq!(
            got.map(|(_, v)| v.as_str()),
            Some(bin),
            "{}",
            path.display()
        );
        let text = std::fs::read_to_string(path).unwrap();
        assert!(text.contains("ProtectHome=read-only\n"), "{text}");
    }
    let spaced = inputs.dir.path().join("my bundle");
    let r = inputs.deploy(&["slurm"], &spaced, &[]);
    assert_eq!(r.code, 2, "{}{}", r.stdout, r.stderr);
    assert!(
        r.stderr.contains("#SBATCH --output cannot hold spaces"),
        "{}",
        r.stderr
    );
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

/// Whether this process runs as root (Slurm's daemons, namespaces and mounts need it).
fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// Whether `program` is on PATH (or at an absolute path) and runs.
fn have(program: &str) -> bool {
    Command::new("sh")
        .arg("-c")
        .arg(format!("command -v {program}"))
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// A two-node Slurm cluster of this test's own, each node a network namespace of an emulated
/// cluster (node i at 10.77.0.i+1, `expertmesh_benches::cluster::netns`): munged (its socket
/// in the test's folder, reachable from every namespace), slurmctld on node 0 and one slurmd
/// per node (`-N n0`, `-N n1`; spool, pid and log files per node through `%n`), all in the
/// foreground as children, entered with `nsenter --net` (which keeps /sys, so slurmd finds
/// its cgroups); every Slurm command runs in node 0's namespace. The daemons are stopped on
/// drop, then the namespaces deleted.
struct Slurm {
    dir: tempfile::TempDir,
    conf: PathBuf,
    daemons: Vec<(String, Child)>,
    emulation: expertmesh_benches::cluster::netns::Emulation,
}

/// The emulated nodes' links: fast enough that they never bind (these tests check answers,
/// not speed).
const FAST_LINKS: expertmesh_benches::cluster::netns::Shaping =
    expertmesh_benches::cluster::netns::Shaping {
        rate_mbit: 1000.0,
        burst_bytes: 1 << 20,
        latency_ms: 50.0,
        mtu: 1500,
    };

/// The Slurm node names of the emulated nodes.
const SLURM_NODES: [&str; 2] = ["n0", "n1"];

impl Slurm {
    /// Start it, or say why it cannot run here.
    fn start() -> Result<Self, String> {
        use expertmesh_benches::cluster::netns::Emulation;
        if !is_root() {
            return Err("not root".into());
        }
        for p in [
            "munged",
            "slurmctld",
            "slurmd",
            "sbatch",
            "scancel",
            "squeue",
            "sinfo",
            "nsenter",
        ] {
            if !have(p) {
                return Err(format!(
                    "no {p} (Debian's slurm-wlm and munge; .ci/run installs them)"
                ));
            }
        }
        let emulation = Emulation::create(2, FAST_LINKS).map_err(|e| e.to_string())?;
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let d = dir.path();
        for sub in ["munge", "state", "log"] {
            std::fs::create_dir_all(d.join(sub)).map_err(|e| e.to_string())?;
        }
        use std::os::unix::fs::PermissionsExt;
        let key = d.join("munge/munge.key");
        let mut bytes = [0u8; 1024];
        std::fs::File::open("/dev/urandom")
            .and_then(|mut f| f.read_exact(&mut bytes))
            .map_err(|e| e.to_string())?;
        std::fs::write(&key, bytes).map_err(|e| e.to_string())?;
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o400))
            .map_err(|e| e.to_string())?;
        std::fs::set_permissions(d.join("munge"), std::fs::Permissions::from_mode(0o700))
            .map_err(|e| e.to_string())?;
        let socket = d.join("munge/munge.socket");
        let host = hostname();
        let conf = d.join("slurm.conf");
        let p = |s: &str| d.join(s).display().to_string();
        let mut text = format!(
            "ClusterName=emtest\nSlurmctldHost={host}({ctl})\nSlurmctldPort=46817\nSlurmdPort=46818\n\
             SlurmUser=root\nSlurmdUser=root\nAuthType=auth/munge\nAuthInfo=socket={sock}\nCredType=cred/munge\n\
             StateSaveLocation={state}\nSlurmdSpoolDir={spool}\nSlurmctldPidFile={ctldpid}\nSlurmdPidFile={dpid}\n\
             SlurmctldLogFile={ctldlog}\nSlurmdLogFile={dlog}\nProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\n\
             JobAcctGatherType=jobacct_gather/none\nSchedulerType=sched/backfill\nSelectType=select/cons_tres\n\
             SelectTypeParameters=CR_Core\nReturnToService=2\nKillWait=30\nMpiDefault=none\n",
            ctl = Emulation::node_address(0),
            sock = socket.display(),
            state = p("state"),
            spool = p("spool-%n"),
            ctldpid = p("slurmctld.pid"),
            dpid = p("slurmd-%n.pid"),
            ctldlog = p("log/slurmctld.log"),
            dlog = p("log/slurmd-%n.log"),
        );
        for (i, n) in SLURM_NODES.iter().enumerate() {
            text += &format!(
                "NodeName={n} NodeHostname={host} NodeAddr={} CPUs=2 State=UNKNOWN\n",
                Emulation::node_address(i)
            );
        }
        text += &format!(
            "PartitionName=em Nodes={} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES\n",
            SLURM_NODES.join(",")
        );
        std::fs::write(&conf, text).map_err(|e| e.to_string())?;
        let mut s = Slurm {
            conf,
            daemons: Vec::new(),
            dir,
            emulation,
        };
        s.spawn(
            "munged",
            None,
            &[
                "-F".into(),
                "--force".into(),
                format!("--key-file={}", key.display()),
                format!("--socket={}", socket.display()),
                format!(
                    "--pid-file={}",
                    s.dir.path().join("munge/munged.pid").display()
                ),
                format!(
                    "--log-file={}",
                    s.dir.path().join("log/munged.log").display()
                ),
                format!("--seed-file={}", s.dir.path().join("munge/seed").display()),
            ],
        )?;
        let t0 = Instant::now();
        while !socket.exists() {
            if t0.elapsed() > GUARD || s.exited().is_some() {
                return Err(format!("munged did not start: {}", s.log("munged.out")));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let conf = s.conf.display().to_string();
        s.spawn(
            "slurmctld",
            Some(0),
            &["-D".into(), "-f".into(), conf.clone()],
        )?;
        for (i, n) in SLURM_NODES.iter().enumerate() {
            let args = [
                "-D".into(),
                "-f".into(),
                conf.clone(),
                "-N".into(),
                (*n).into(),
            ];
            s.spawn("slurmd", Some(i), &args)?;
        }
        let t0 = Instant::now();
        loop {
            let state = s.command("sinfo", &["-h", "-o", "%T %D"]);
            if state.trim() == "idle 2" {
                return Ok(s);
            }
            if let Some(dead) = s.exited() {
                return Err(format!(
                    "{dead} exited at start: {} {}",
                    s.log(&format!("{dead}.out")),
                    s.log("slurmd-n0.log")
                ));
            }
            if t0.elapsed() > GUARD {
                return Err(format!(
                    "the Slurm nodes never became idle (sinfo: {state:?}); slurmctld: {} slurmd n0: {}",
                    s.log("slurmctld.log"),
                    s.log("slurmd-n0.log")
                ));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Start daemon `program` in node `node`'s network namespace (munged: in this one).
    fn spawn(&mut self, program: &str, node: Option<usize>, args: &[String]) -> Result<(), String> {
        let name = match node {
            Some(i) => format!("{program}-{i}"),
            None => program.to_owned(),
        };
        let log = std::fs::File::create(self.dir.path().join(format!("log/{name}.out")))
            .map_err(|e| e.to_string())?;
        let mut c = match node {
            Some(i) => {
                let mut c = Command::new("nsenter");
                c.arg(format!("--net=/run/netns/{}", self.emulation.node_ns(i)))
                    .arg(program);
                c
            }
            None => Command::new(program),
        };
        let child = c
            .args(args)
            .env("SLURM_CONF", &self.conf)
            .stdin(Stdio::null())
            .stdout(log.try_clone().map_err(|e| e.to_string())?)
            .stderr(log)
            .spawn()
            .map_err(|e| format!("{program}: {e}"))?;
        self.daemons.push((name, child));
        Ok(())
    }

    fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self.dir.path().join("log").join(name)).unwrap_or_default()
    }

    /// The name of a daemon that has exited, if one has.
    fn exited(&mut self) -> Option<String> {
        self.daemons
            .iter_mut()
            .find_map(|(name, c)| c.try_wait().ok().flatten().map(|_| name.clone()))
    }

    /// A Slurm client command run in node 0's namespace, with `env`: its stdout (stderr
    /// appended).
    fn command_with(&self, program: &str, args: &[&str], env: &[(&str, &Path)]) -> String {
        let o = Command::new("nsenter")
            .arg(format!("--net=/run/netns/{}", self.emulation.node_ns(0)))
            .arg(program)
            .args(args)
            .env("SLURM_CONF", &self.conf)
            .envs(env.iter().copied())
            .output()
            .unwrap_or_else(|e| panic!("{program}: {e}"));
        format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        )
    }

    fn command(&self, program: &str, args: &[&str]) -> String {
        self.command_with(program, args, &[])
    }
}

impl Drop for Slurm {
    fn drop(&mut self) {
        let _ = self.command("scancel", &["--user", "root"]);
        for (_, c) in self.daemons.iter_mut().rev() {
            // SAFETY: kill has no memory preconditions; the pid is our own child's.
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
            let t0 = Instant::now();
            while c.try_wait().ok().flatten().is_none() && t0.elapsed() < Duration::from_secs(30) {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Pids of the processes whose command line mentions `needle`.
fn processes_mentioning(needle: &str) -> Vec<(u32, String)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(cmd) = std::fs::read(e.path().join("cmdline")) else {
            continue;
        };
        let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
        if cmd.contains(needle) && pid != std::process::id() {
            out.push((pid, cmd));
        }
    }
    out
}

/// Waits until the job's output file holds `what`; fails with the output when the job ends
/// first.
fn wait_output(slurm: &Slurm, out_file: &Path, job: &str, what: &str) -> String {
    let t0 = Instant::now();
    loop {
        let text = std::fs::read_to_string(out_file).unwrap_or_default();
        if text.contains(what) {
            return text;
        }
        let queued = slurm.command("squeue", &["-h", "-j", job, "-o", "%T"]);
        assert!(
            t0.elapsed() < GUARD && !queued.trim().is_empty(),
            "job {job} ({queued:?}) never printed {what:?}:\n{text}\nslurmd n0: {}",
            slurm.log("slurmd-n0.log")
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Whether the router whose metrics are at `addr` (from node `node`'s namespace) counts
/// worker `peer` as joined (`expertmesh_router_worker_joined`).
fn joined_in(
    emulation: &expertmesh_benches::cluster::netns::Emulation,
    node: usize,
    addr: &str,
    peer: &str,
) -> bool {
    let (a, want) = (
        addr.to_owned(),
        format!("expertmesh_router_worker_joined{{peer=\"{peer}\"}} 1"),
    );
    in_namespace(&emulation.node_ns(node), move || http_get(&a, "/metrics"))
        .is_some_and(|text| text.lines().any(|l| l.contains(&want)))
}

#[test]
fn a_real_slurm_job_on_two_nodes_serves_restarts_a_dead_task_and_scancel_ends_it() {
    use expertmesh_benches::cluster::netns::Emulation;
    let slurm = match Slurm::start() {
        Ok(s) => s,
        Err(why) => {
            say(&format!("skipped: the Slurm job test ({why})"));
            return;
        }
    };
    let _machine = crate::support::shared();
    let inputs = Inputs::new();
    let dir = inputs.dir.path();
    let out = dir.join("bundle");
    let (topology, placement) =
        inputs.deploy_two_nodes(&["slurm", "--restarts", "1"], &out, ["n0", "n1"], &[]);
    let sbatch = out.join("slurm/expertmesh.sbatch");
    let exe = bin();
    let submitted = slurm.command_with(
        "sbatch",
        &["--parsable", sbatch.to_str().unwrap()],
        &[("EXPERTMESH_BIN", exe.as_path())],
    );
    let job = submitted.trim().split(';').next().unwrap().to_owned();
    assert!(
        !job.is_empty() && job.chars().all(|c| c.is_ascii_digit()),
        "sbatch: {submitted}"
    );
    let out_file = out.join(format!("slurm/expertmesh-{job}.out"));
    wait_output(&slurm, &out_file, &job, "fabric two-nodes ready");
    let router: SocketAddr = format!("{}:47400", Emulation::node_address(0))
        .parse()
        .unwrap();
    let fe = out.join("frontends/fe.cred");
    let check = || {
        let (fe, topology, placement) = (fe.clone(), topology.clone(), placement.clone());
        in_namespace(&slurm.emulation.node_ns(0), move || {
            check_answers_placed(router, &fe, &topology, &placement, "two-nodes")
        });
    };
    check();
    // A task dies: the entry script restarts it on its node and the fabric answers again.
    let bundle = out.display().to_string();
    let on_b = |c: &String| c.contains(&bundle) && c.contains(" worker ");
    let worker: Vec<(u32, String)> = processes_mentioning("--device node-b/cpu1")
        .into_iter()
        .filter(|(_, c)| on_b(c))
        .collect();
    assert_eq!(worker.len(), 1, "{worker:?}");
    // SAFETY: kill has no memory preconditions; the pid is the job's worker process.
    unsafe { libc::kill(worker[0].0 as i32, libc::SIGKILL) };
    wait_output(&slurm, &out_file, &job, "restart 1 of 1");
    let procs = processes(&out);
    let t0 = Instant::now();
    loop {
        let back = processes_mentioning("--device node-b/cpu1")
            .into_iter()
            .any(|(pid, c)| pid != worker[0].0 && on_b(&c));
        // The router stays ready throughout (a lost worker does not take it out of
        // service); its metrics say when the restarted worker has joined it again.
        if back && joined_in(&slurm.emulation, 0, &procs[0].2, "node-b/cpu1") {
            break;
        }
        assert!(t0.elapsed() < GUARD, "the restarted worker never rejoined");
        std::thread::sleep(Duration::from_millis(100));
    }
    check();
    // scancel: every process drains and exits; the job ends; nothing is left running.
    let cancel = slurm.command("scancel", &[&job]);
    assert!(cancel.trim().is_empty(), "scancel: {cancel}");
    let t0 = Instant::now();
    while !slurm
        .command("squeue", &["-h", "-j", &job])
        .trim()
        .is_empty()
        || !processes_mentioning(&bundle).is_empty()
    {
        assert!(
            t0.elapsed() < GUARD,
            "still running after scancel: {:?}",
            processes_mentioning(&bundle)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let text = std::fs::read_to_string(&out_file).unwrap();
    assert!(text.contains("router 0: SIGTERM: draining"), "{text}");
    assert!(text.contains("router 0: stopped"), "{text}");
    assert_eq!(
        text.matches("SIGTERM: finishing queued dispatches").count(),
        2,
        "{text}"
    );
    say(
        "ran: a two-node Slurm job of the fabric: bit for bit, a killed task restarted, scancel clean",
    );
}

/// Two nodes, "node-a" (the router and cpu0) and "node-b" (cpu1), at the emulated nodes'
/// addresses, and demo-small placed across them.
fn two_node_files(dir: &Path) -> (PathBuf, PathBuf) {
    use expertmesh_benches::cluster::netns::Emulation;
    let node = |name: &str, i: usize, device: &str| {
        format!(
            "[[nodes]]\nname = \"{name}\"\naddress = \"{}\"\ncontrol_port = 47401\ndata_port = 47410\n\
             nics = [ {{ name = \"eth0\", kind = \"tcp\", speed_gbit_s = 10, mtu = 1500 }} ]\n\
             devices = [ {{ name = \"{device}\", kind = \"cpu\", arch = \"cpu\", threads = 1, expert_memory = \"256 MiB\", memory_bandwidth_gb_s = 20 }} ]\n",
            Emulation::node_address(i)
        )
    };
    let topology = dir.join("two-nodes.toml");
    std::fs::write(
        &topology,
        format!(
            "format = 1\nname = \"two-nodes\"\n[router]\nnode = \"node-a\"\nport = 47400\n{}{}",
            node("node-a", 0, "cpu0"),
            node("node-b", 1, "cpu1")
        ),
    )
    .unwrap();
    let placement = dir.join("two-nodes.placement.toml");
    let text = std::fs::read_to_string(example_placement())
        .unwrap()
        .replace("cluster = \"single-host\"", "cluster = \"two-nodes\"")
        .replace("local/cpu0", "node-a/cpu0")
        .replace("local/cpu1", "node-b/cpu1");
    std::fs::write(&placement, text).unwrap();
    (topology, placement)
}

/// Every YAML document of `files`, parsed by PyYAML (an independent parser) into JSON: with
/// Debian's Python (where python3-yaml installs it), else the `python3` on PATH.
fn yaml_documents(files: &[PathBuf]) -> Result<Vec<serde_json::Value>, String> {
    let script = "import sys, json, yaml\njson.dump([d for f in sys.argv[1:] for d in yaml.safe_load_all(open(f)) if d], sys.stdout)";
    let mut errors = Vec::new();
    for python in ["/usr/bin/python3", "python3"] {
        let o = match Command::new(python)
            .arg("-c")
            .arg(script)
            .args(files)
            .output()
        {
            Ok(o) => o,
            Err(e) => {
                errors.push(format!("{python}: {e}"));
                continue;
            }
        };
        if o.status.success() {
            return serde_json::from_slice(&o.stdout).map_err(|e| e.to_string());
        }
        let stderr = String::from_utf8_lossy(&o.stderr);
        errors.push(format!(
            "{python}: {}",
            stderr.lines().last().unwrap_or_default()
        ));
    }
    Err(errors.join("; "))
}

/// Run `f` on a thread inside network namespace `ns` (its sockets live there).
fn in_namespace<T: Send + 'static>(ns: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let ns = ns.to_owned();
    std::thread::spawn(move || {
        expertmesh_benches::cluster::netns::enter(&ns).unwrap();
        f()
    })
    .join()
    .unwrap()
}

/// Mount points the test created on the host (removed again, innermost first).
struct MountPoints(Vec<PathBuf>);

impl Drop for MountPoints {
    fn drop(&mut self) {
        for p in self.0.iter().rev() {
            let _ = std::fs::remove_dir(p);
        }
    }
}

/// A pod of the manifests started as the kubelet would: the container's command and
/// environment (the node name from the downward API), its volumes bind-mounted at their
/// mount paths in a mount namespace of its own, in its node's network namespace (host
/// network). Returns the child and its health address.
struct PodStart<'a> {
    emulation: &'a expertmesh_benches::cluster::netns::Emulation,
    volumes: &'a Path,
    scratch: &'a Path,
    logs: &'a Path,
    hosts: [&'a str; 2],
}

impl PodStart<'_> {
    fn start(
        &self,
        deployment: &serde_json::Value,
        created: &mut MountPoints,
    ) -> (String, Child, usize, String) {
        use expertmesh_benches::cluster::netns::Emulation;
        let pod = &deployment["spec"]["template"]["spec"];
        let host = pod["nodeSelector"]["kubernetes.io/hostname"]
            .as_str()
            .unwrap();
        let node = self.hosts.iter().position(|h| *h == host).unwrap();
        assert_eq!(pod["hostNetwork"], true);
        let c = &pod["containers"][0];
        let process = c["command"][2].as_str().unwrap().to_owned();
        let mut script = String::from("set -e\n");
        for m in c["volumeMounts"].as_array().unwrap() {
            let v = pod["volumes"]
                .as_array()
                .unwrap()
                .iter()
                .find(|v| v["name"] == m["name"])
                .unwrap();
            let source = if let Some(cm) = v["configMap"]["name"].as_str() {
                self.volumes.join(cm)
            } else if let Some(secret) = v["secret"]["secretName"].as_str() {
                // The kubelet writes a Secret's files with the volume's defaultMode (0644
                // when none is given).
                use std::os::unix::fs::PermissionsExt;
                let mode = v["secret"]["defaultMode"].as_u64().unwrap_or(0o644) as u32;
                let folder = self.volumes.join(secret);
                for f in std::fs::read_dir(&folder).unwrap().flatten() {
                    let perm = std::fs::Permissions::from_mode(mode);
                    std::fs::set_permissions(f.path(), perm).unwrap();
                }
                folder
            } else if let Some(path) = v["hostPath"]["path"].as_str() {
                // The host's own folder (the host's /dev/shm: node peers' rings).
                PathBuf::from(path)
            } else if v.get("emptyDir").is_some() {
                let p = self
                    .scratch
                    .join(format!("{process}-{}", m["name"].as_str().unwrap()));
                std::fs::create_dir_all(&p).unwrap();
                p
            } else {
                panic!("volume {v} is not one this test mounts");
            };
            let target = PathBuf::from(m["mountPath"].as_str().unwrap());
            let mut missing = Vec::new();
            let mut t = target.clone();
            while !t.exists() {
                missing.push(t.clone());
                t = t.parent().unwrap().to_path_buf();
            }
            for p in missing.into_iter().rev() {
                std::fs::create_dir(&p).unwrap();
                created.0.push(p);
            }
            script += &format!(
                "mount --bind '{}' '{}'\n",
                source.display(),
                target.display()
            );
        }
        script += "exec \"$@\"\n";
        let env: Vec<(String, String)> = c["env"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| {
                let value = match e["valueFrom"]["fieldRef"]["fieldPath"].as_str() {
                    Some("spec.nodeName") => host.to_owned(),
                    Some(other) => panic!("downward-API field {other} not emulated"),
                    None => e["value"].as_str().unwrap().to_owned(),
                };
                (e["name"].as_str().unwrap().to_owned(), value)
            })
            .collect();
        let command: Vec<&str> = c["command"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap())
            .collect();
        let log = std::fs::File::create(self.logs.join(format!("{process}.log"))).unwrap();
        let child = Command::new("ip")
            .args(["netns", "exec", &self.emulation.node_ns(node)])
            .args(["unshare", "--mount", "--propagation", "private"])
            .args(["sh", "-c", &script, "pod"])
            .args(&command)
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/ready");
        let port = c["ports"][0]["containerPort"].as_u64().unwrap();
        let health = format!("{}:{port}", Emulation::node_address(node));
        (process, child, node, health)
    }
}

#[test]
fn kubernetes_pods_started_as_the_kubelet_would_serve_bit_for_bit_on_two_nodes() {
    use expertmesh_benches::cluster::netns::Emulation;
    if !is_root() || !have("unshare") {
        say("skipped: the Kubernetes pods test (needs root and unshare)");
        return;
    }
    if let Err(e) = yaml_documents(&[]) {
        say(&format!(
            "skipped: the Kubernetes pods test (python3 with PyYAML, Debian's python3-yaml: {e})"
        ));
        return;
    }
    let _machine = crate::support::shared();
    let emulation = match Emulation::create(2, FAST_LINKS) {
        Ok(e) => e,
        Err(e) => {
            say(&format!("skipped: the Kubernetes pods test ({e})"));
            return;
        }
    };
    let inputs = Inputs::new();
    let dir = inputs.dir.path();
    let out = dir.join("out");
    let exe = bin();
    let (topology, placement) = inputs.deploy_two_nodes(
        &["kubernetes", "--image", "registry.example/expertmesh:test"],
        &out,
        ["k8s-a", "k8s-b"],
        &["--bin", exe.to_str().unwrap()],
    );
    let docs = yaml_documents(&files_under(&out.join("kubernetes"))).expect("the manifests parse");
    // What the kubelet mounts: each ConfigMap and Secret as a folder of files.
    let volumes = dir.join("volumes");
    for d in &docs {
        let data = match d["kind"].as_str() {
            Some("ConfigMap") => &d["data"],
            Some("Secret") => &d["stringData"],
            _ => continue,
        };
        let folder = volumes.join(d["metadata"]["name"].as_str().unwrap());
        std::fs::create_dir_all(&folder).unwrap();
        for (file, text) in data.as_object().unwrap() {
            std::fs::write(folder.join(file), text.as_str().unwrap()).unwrap();
        }
    }
    let logs = dir.join("logs");
    let scratch = dir.join("empty-dirs");
    std::fs::create_dir_all(&logs).unwrap();
    let starter = PodStart {
        emulation: &emulation,
        volumes: &volumes,
        scratch: &scratch,
        logs: &logs,
        hosts: ["k8s-a", "k8s-b"],
    };
    let mut created = MountPoints(Vec::new());
    let mut children = Children::default();
    let mut health = Vec::new();
    for d in docs.iter().filter(|d| d["kind"] == "Deployment") {
        let (process, child, node, addr) = starter.start(d, &mut created);
        children.0.push((process, child));
        health.push((node, addr));
    }
    assert_eq!(children.0.len(), 3);
    // The readiness probes, from each pod's node (the kubelet probes the host network).
    for (node, addr) in &health {
        let t0 = Instant::now();
        loop {
            let a = addr.clone();
            let ns = emulation.node_ns(*node);
            if in_namespace(&ns, move || http_status(&a, "/ready")) == Some(200) {
                break;
            }
            children.check_running(&logs);
            assert!(t0.elapsed() < GUARD, "{addr}/ready never answered 200");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    // A frontend on node-a calls the router's port.
    let router: SocketAddr = format!("{}:47400", Emulation::node_address(0))
        .parse()
        .unwrap();
    let fe = out.join("frontends/fe.cred");
    in_namespace(&emulation.node_ns(0), move || {
        check_answers_placed(router, &fe, &topology, &placement, "two-nodes")
    });
    // Termination: SIGTERM to each container's process; every one exits 0.
    children.stop_all(&logs);
    let router_log = std::fs::read_to_string(logs.join("router-0.log")).unwrap();
    assert!(router_log.contains("SIGTERM: draining"), "{router_log}");
    say(
        "ran: the Kubernetes pods as the kubelet would start them, on two emulated nodes: bit for bit",
    );
}

#[test]
fn converted_weights_serve_when_each_host_holds_only_its_listed_files() {
    use crate::hf_support::tiny::{TinySpec, WeightFormat, random_tokens, write_tiny_checkpoint};
    use expertmesh_fabric::local::{LocalFabric, LocalFabricOptions};
    if !is_root() || !have("unshare") {
        say(
            "skipped: the per-host weights test (needs root and unshare for a private mount of the weights path)",
        );
        return;
    }
    let _machine = crate::support::shared();
    let inputs = Inputs::new();
    let dir = inputs.dir.path();
    // Two hosts on loopback addresses: node-a (router, cpu0) and node-b (cpu1).
    let (frontend, control, data) = (free_run(1), free_run(1), free_run(1));
    let node = |name: &str, addr: &str, device: &str| {
        format!(
            "[[nodes]]\nname = \"{name}\"\naddress = \"{addr}\"\ncontrol_port = {control}\ndata_port = {data}\n\
             nics = [ {{ name = \"lo\", kind = \"tcp\", speed_gbit_s = 100, mtu = 65536 }} ]\n\
             devices = [ {{ name = \"{device}\", kind = \"cpu\", arch = \"cpu\", threads = 1, expert_memory = \"256 MiB\", memory_bandwidth_gb_s = 20 }} ]\n"
        )
    };
    let topology = dir.join("two-hosts.toml");
    std::fs::write(
        &topology,
        format!(
            "format = 1\nname = \"two-hosts\"\n[router]\nnode = \"node-a\"\nport = {frontend}\n{}{}",
            node("node-a", "127.0.0.1", "cpu0"),
            node("node-b", "127.0.0.2", "cpu1")
        ),
    )
    .unwrap();
    let spec = TinySpec::for_model_type("qwen3_moe").with_dtype(WeightFormat::Bf16);
    let ck = write_tiny_checkpoint(&dir.join("ckpt"), &spec);
    let weights = dir.join("weights");
    let r = crate::support::run(&[
        "convert",
        "--threads",
        "2",
        "--checkpoint",
        ck.dir.to_str().unwrap(),
        "--topology",
        topology.to_str().unwrap(),
        "--out",
        weights.to_str().unwrap(),
    ]);
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    // The weights' path on every host; each host's copy holds only what hosts/HOST.files lists.
    let on_hosts = "/srv/expertmesh-deploy-test-weights";
    let out = dir.join("out");
    let r = crate::support::run(&[
        "deploy",
        "systemd",
        "--topology",
        topology.to_str().unwrap(),
        "--weights",
        weights.to_str().unwrap(),
        "--weights-on-hosts",
        on_hosts,
        "--out",
        out.to_str().unwrap(),
        "--install-dir",
        out.to_str().unwrap(),
        "--key",
        inputs.key.to_str().unwrap(),
        "--frontend",
        "fe",
        "--metrics-port",
        &free_run(3).to_string(),
        "--bin",
        bin().to_str().unwrap(),
        "--router-arg=--mode",
        "--router-arg=exact",
    ]);
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    let mut host_dirs = std::collections::BTreeMap::new();
    for host in ["node-a", "node-b"] {
        let list = std::fs::read_to_string(out.join(format!("hosts/{host}.files"))).unwrap();
        let mine = dir.join(format!("host-{host}"));
        std::fs::create_dir_all(&mine).unwrap();
        let mut n = 0;
        for f in list
            .lines()
            .filter_map(|l| l.strip_prefix(&format!("{on_hosts}/")))
        {
            std::fs::copy(weights.join(f), mine.join(f)).unwrap();
            n += 1;
        }
        // The manifest, model, placement, and the host's own shard(s) or router file.
        assert_eq!(n, if host == "node-a" { 5 } else { 4 }, "{list}");
        host_dirs.insert(host, mine);
    }
    let mut created = MountPoints(Vec::new());
    std::fs::create_dir(on_hosts).unwrap();
    created.0.push(PathBuf::from(on_hosts));
    let logs = dir.join("logs");
    std::fs::create_dir_all(&logs).unwrap();
    let mut children = Children::default();
    for (name, host, _) in processes(&out) {
        let unit = parse_unit(&out.join(format!(
            "systemd/{host}/expertmesh-two-hosts-{name}.service"
        )));
        let creds = dir.join(format!("run/credentials/{name}"));
        std::fs::create_dir_all(&creds).unwrap();
        let (cred_name, src) = unit.credential.expect("a LoadCredential= line");
        std::fs::copy(&src, creds.join(&cred_name)).unwrap();
        let script = format!(
            "set -e\nmount --bind '{}' '{on_hosts}'\nexec \"$@\"\n",
            host_dirs[host.as_str()].display()
        );
        let log = std::fs::File::create(logs.join(format!("{name}.log"))).unwrap();
        let child = Command::new("unshare")
            .args([
                "--mount",
                "--propagation",
                "private",
                "sh",
                "-c",
                &script,
                "unit",
            ])
            .args(&unit.exec)
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .envs(
                unit.env
                    .iter()
                    .filter(|(k, _)| k != "EXPERTMESH_NODE")
                    .map(|(k, v)| (k.as_str(), v.as_str())),
            )
            .env("EXPERTMESH_NODE", &host)
            .env("CREDENTIALS_DIRECTORY", &creds)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        children.0.push((name, child));
    }
    for (_, _, health) in processes(&out) {
        wait_ready(&health, &mut children, &logs);
    }
    // The oracle: the same converted weights served whole by the local launcher (exact mode
    // is placement-independent; convert_serve.rs checks that path against the reference).
    let mut o = LocalFabricOptions::new(topology.clone(), "", "");
    o.weights = Some(weights.clone());
    o.exe = bin();
    o.ephemeral_ports = true;
    o.router.mode = ComputeMode::Exact.into();
    o.connect_timeout = Duration::from_secs(60);
    let whole = LocalFabric::start(o).unwrap();
    let rt = rt();
    let mut cfg = FrontendConfig::new("two-hosts");
    cfg.credentials = Some(Arc::new(
        Credentials::load(&out.join("frontends/fe.cred")).unwrap(),
    ));
    let router = SocketAddr::from(([127, 0, 0, 1], frontend));
    let mut deployed = rt.block_on(RouterClient::connect(router, &cfg)).unwrap();
    let mut local = rt
        .block_on(RouterClient::connect(
            whole.frontend_addr(),
            &whole.frontend_config(),
        ))
        .unwrap();
    let dep = expertmesh_worker::deploy::Deployment::load_converted(&topology, &weights).unwrap();
    let h = dep.spec.hidden as usize;
    let layers = dep.spec.moe_layer_ids();
    assert!(!layers.is_empty());
    for &layer in &layers {
        let x: Vec<f32> = random_tokens(9, h, 7 + u64::from(layer))
            .iter()
            .map(|&v| v as f32)
            .collect();
        let deadline = Some(Duration::from_secs(60));
        let got = rt
            .block_on(deployed.call(layer, &x, h, None, deadline))
            .unwrap();
        let want = rt
            .block_on(local.call(layer, &x, h, None, deadline))
            .unwrap();
        assert_eq!(bits(&got), bits(&want), "layer {layer}");
    }
    whole.shutdown();
    children.stop_all(&logs);
    say(&format!(
        "ran: converted weights from per-host folders, {} layers bit for bit",
        layers.len()
    ));
}

#[test]
fn a_later_deploy_removes_what_the_earlier_one_wrote_and_it_does_not() {
    let inputs = Inputs::new();
    let out = inputs.dir.path().join("out");
    let key = inputs.key.to_str().unwrap();
    let two = root().join("examples/single-host-2routers.toml");
    let r = inputs.deploy_on(
        &two,
        &example_placement(),
        &["systemd"],
        &out,
        &["--key", key],
    );
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    let router1 = [
        out.join("credentials/router-1.cred"),
        out.join("systemd/local/expertmesh-single-host-router-1.service"),
    ];
    assert!(router1.iter().all(|p| p.exists()));
    // A file of the user's own in the folder is never touched.
    let mine = out.join("systemd/notes.txt");
    std::fs::write(&mine, "mine").unwrap();
    // The same cluster with one router: router 1's files go, the rest is rewritten.
    let one = inputs.topology.clone();
    let redeploy = || {
        let r = inputs.deploy_on(
            &one,
            &example_placement(),
            &["systemd"],
            &out,
            &["--key", key],
        );
        assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
        r
    };
    let r = redeploy();
    for p in &router1 {
        assert!(!p.exists(), "{} left behind", p.display());
    }
    assert!(r.stdout.contains("removed 2 files"), "{}", r.stdout);
    assert!(out.join("credentials/router-0.cred").exists());
    assert_eq!(std::fs::read_to_string(&mine).unwrap(), "mine");
    // A list that names paths outside the folder removes nothing there.
    let outside = inputs.dir.path().join("outside.txt");
    std::fs::write(&outside, "keep").unwrap();
    std::fs::write(
        out.join(".expertmesh-deploy-files"),
        format!("../outside.txt\n{}\n", outside.display()),
    )
    .unwrap();
    redeploy();
    assert_eq!(std::fs::read_to_string(&outside).unwrap(), "keep");
}

/// A worker's `--tile-cache` folder is writable under `ProtectSystem=strict`, and `hosts.txt`
/// creates it (private) before the units start; a relative one is refused.
#[test]
fn a_systemd_worker_may_write_its_tile_cache_and_hosts_txt_creates_it() {
    let inputs = Inputs::new();
    let key = inputs.key.to_str().unwrap();
    let out = inputs.dir.path().join("out");
    let args = [
        "--key",
        key,
        "--worker-arg=--tile-cache",
        "--worker-arg=/var/cache/em-test/tiles",
    ];
    let r = inputs.deploy(&["systemd"], &out, &args);
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    let read = |p: &str| std::fs::read_to_string(out.join(p)).unwrap();
    let worker = read("systemd/local/expertmesh-single-host-worker-0.service");
    assert!(
        worker.contains("\nReadWritePaths=-/var/cache/em-test/tiles\n"),
        "{worker}"
    );
    assert!(worker.contains("\nLimitMEMLOCK=infinity\n"), "{worker}");
    let router = read("systemd/local/expertmesh-single-host-router-0.service");
    assert!(!router.contains("ReadWritePaths"), "{router}");
    let hosts = read("systemd/hosts.txt");
    // Copied as root's files: never `rsync -a` of a folder (it would give the copying user's
    // owner and mode to /etc/systemd/system and to the files root runs).
    assert!(!hosts.contains("rsync -a "), "{hosts}");
    for line in hosts.lines().filter(|l| l.contains("rsync ")) {
        assert!(line.contains("--chown=root:root"), "{line}");
        assert!(
            !line.contains("/systemd/local/ "),
            "unit files, not their folder: {line}"
        );
    }
    let mkdir = hosts
        .find("mkdir -p -m 700 /var/cache/em-test/tiles")
        .unwrap_or_else(|| panic!("no mkdir of the tile cache in\n{hosts}"));
    let enable = hosts.find("systemctl enable --now").expect("enable");
    assert!(
        mkdir < enable,
        "the folder is made before the units start:\n{hosts}"
    );
    let r = inputs.deploy(
        &["systemd"],
        &inputs.dir.path().join("out2"),
        &[
            "--key",
            key,
            "--worker-arg=--tile-cache",
            "--worker-arg=tiles",
        ],
    );
    assert_eq!(r.code, 2, "{}{}", r.stdout, r.stderr);
    assert!(
        r.stderr
            .contains("--tile-cache tiles: give an absolute path"),
        "{}",
        r.stderr
    );
}

/// `deploy kubernetes` (with `engine_args` after the image) of workers with a tile cache in
/// `inputs`' folder `empty-dir`: the output folder, the tile cache folder (not made) and
/// `processes.yaml`.
fn kubernetes_with_tile_cache(inputs: &Inputs, engine_args: &[&str]) -> (PathBuf, PathBuf, String) {
    let key = inputs.key.to_str().unwrap();
    let out = inputs.dir.path().join("out");
    let tiles = inputs.dir.path().join("empty-dir");
    let tiles_arg = format!("--worker-arg=--tile-cache={}", tiles.display());
    let args = ["--key", key, tiles_arg.as_str()];
    let mut k8s = vec!["kubernetes", "--image", "registry.example/expertmesh:1"];
    k8s.extend(engine_args);
    let r = inputs.deploy(&k8s, &out, &args);
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    let manifests = process_manifests(&out);
    (out, tiles, manifests)
}

/// On Kubernetes a worker's `--tile-cache` folder is an emptyDir (kept across the
/// container's restarts) with `IPC_LOCK` to lock the tiles, and `launch.sh` makes the folder
/// private before the worker starts (an emptyDir starts world-writable; the worker refuses a
/// folder others can write).
#[test]
fn a_kubernetes_worker_keeps_its_tile_cache_in_a_private_empty_dir() {
    use std::os::unix::fs::PermissionsExt;
    let inputs = Inputs::new();
    let (out, tiles, manifests) = kubernetes_with_tile_cache(&inputs, &[]);
    // Per Deployment document: the workers mount it and may lock memory, the router neither.
    let docs: Vec<&str> = manifests.split("\n---\n").collect();
    let mount = format!("\"mountPath\": \"{}\"", tiles.display());
    let workers: Vec<&&str> = docs.iter().filter(|d| d.contains("worker-")).collect();
    assert_eq!(workers.len(), 2, "{manifests}");
    for d in &workers {
        assert!(d.contains(&mount) && d.contains("\"tile-cache\""), "{d}");
        assert!(d.contains("IPC_LOCK"), "{d}");
    }
    let router = docs.iter().find(|d| d.contains("router-0")).unwrap();
    assert!(
        !router.contains("tile-cache") && !router.contains("IPC_LOCK"),
        "{router}"
    );
    // Every process's pod sees the host's /dev/shm (its node peers' rings are there), not
    // an in-memory one of its own.
    let deployments: Vec<&&str> = docs
        .iter()
        .filter(|d| d.contains("\"kind\": \"Deployment\""))
        .collect();
    assert_eq!(deployments.len(), 3, "{manifests}");
    for d in deployments {
        let host_shm = "- \"hostPath\":\n            \"path\": \"/dev/shm\"\n            \"type\": \"Directory\"\n          \"name\": \"dshm\"";
        assert!(d.contains(host_shm), "no host /dev/shm volume: {d}");
        assert!(
            !d.contains("\"medium\": \"Memory\"\n          \"name\": \"dshm\""),
            "{d}"
        );
    }

    // The kubelet's emptyDir: world-writable. launch.sh makes it private, then runs the worker.
    std::fs::create_dir(&tiles).unwrap();
    std::fs::set_permissions(&tiles, std::fs::Permissions::from_mode(0o777)).unwrap();
    let o = Command::new("sh")
        .arg(out.join("fabric/launch.sh"))
        .arg("worker-0")
        .env("EXPERTMESH_BIN", "/bin/true")
        .env_remove("EXPERTMESH_NODE")
        .env_remove("SLURMD_NODENAME")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&tiles), 0o700);
    // A folder already in use is left as it is (the worker refuses it if it is not private);
    // a missing one is created private whatever the umask.
    std::fs::write(tiles.join("kept.r16"), b"x").unwrap();
    std::fs::set_permissions(&tiles, std::fs::Permissions::from_mode(0o755)).unwrap();
    let launch = |env_umask: &str| {
        Command::new("sh")
            .arg("-c")
            .arg(format!("umask {env_umask}; exec sh \"$0\" worker-0"))
            .arg(out.join("fabric/launch.sh"))
            .env("EXPERTMESH_BIN", "/bin/true")
            .env_remove("EXPERTMESH_NODE")
            .env_remove("SLURMD_NODENAME")
            .output()
            .unwrap()
    };
    assert!(launch("022").status.success());
    assert_eq!(mode(&tiles), 0o755);
    std::fs::remove_dir_all(&tiles).unwrap();
    assert!(launch("000").status.success());
    assert_eq!(mode(&tiles), 0o700);
}

/// The shell command of a manifest's list item containing `needle` (a quoted YAML string,
/// unquoted).
fn yaml_command(doc: &str, needle: &str) -> String {
    doc.lines()
        .find(|l| l.contains(needle))
        .unwrap_or_else(|| panic!("no {needle:?} in\n{doc}"))
        .trim()
        .trim_start_matches("- ")
        .strip_prefix('"')
        .and_then(|l| l.strip_suffix('"'))
        .expect("a quoted YAML string")
        .replace("\\\"", "\"")
}

/// `--run-as-user UID:GID`: every pod runs as that user (not root), and a worker's tile cache
/// folder (an emptyDir, which the kubelet makes root's and world-writable, and which a
/// non-root process cannot make private) is given to it by an init container running as
/// root; the init container's command, run here on such a folder, leaves it that user's and
/// private (mode 0700), as the worker requires.
#[test]
fn kubernetes_pods_run_as_the_user_asked_and_their_tile_cache_is_theirs() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let inputs = Inputs::new();
    let (_out, tiles, manifests) =
        kubernetes_with_tile_cache(&inputs, &["--run-as-user", "1000:2000"]);
    let docs: Vec<&str> = manifests.split("\n---\n").collect();
    let workers: Vec<&&str> = docs.iter().filter(|d| d.contains("worker-")).collect();
    assert_eq!(workers.len(), 2, "{manifests}");
    let router = docs.iter().find(|d| d.contains("router-0")).unwrap();
    for d in workers.iter().map(|d| **d).chain([*router]) {
        for want in [
            "\"runAsUser\": 1000",
            "\"runAsGroup\": 2000",
            "\"runAsNonRoot\": true",
        ] {
            assert!(d.contains(want), "{want} missing:\n{d}");
        }
    }
    // Every process has a credential: an init container copies it as the user's own, and
    // the probes ask the process's address. Only workers have a tile cache to give.
    for d in workers.iter().map(|d| **d).chain([*router]) {
        assert!(d.contains("credential-owner"), "{d}");
        assert!(d.contains("\"host\": \"127.0.0.1\""), "{d}");
    }
    assert!(!router.contains("tile-cache-owner"), "{router}");
    let copy = yaml_command(router, "cp -L");
    // The init container's command, as the worker's manifest gives it.
    let worker = workers[0];
    assert!(
        worker.contains("initContainers") && worker.contains("tile-cache-owner"),
        "{worker}"
    );
    let command = yaml_command(worker, "chown 1000:2000");
    assert_eq!(
        command, "chown 1000:2000 \"$0\" && chmod 700 \"$0\"",
        "{worker}"
    );
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        say("skipped: running the init container's chown (needs root)");
        return;
    }
    // An emptyDir as the kubelet makes it (root's, world-writable), and a container's command.
    let empty_dir = |p: &Path| {
        std::fs::create_dir(p).unwrap();
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o777)).unwrap();
    };
    let sh = |command: &str, args: &[&Path]| {
        let ran = Command::new("sh")
            .arg("-c")
            .arg(command)
            .args(args)
            .status();
        assert!(ran.unwrap().success(), "{command}");
    };
    empty_dir(&tiles);
    sh(&command, &[&tiles]);
    let meta = std::fs::metadata(&tiles).unwrap();
    assert_eq!(
        (meta.uid(), meta.gid(), meta.mode() & 0o777),
        (1000, 2000, 0o700)
    );
    // The credential copy, on a Secret volume's layout (root's files behind links into a
    // data folder) and an emptyDir: the user's own file, 0600 (what the loader requires).
    let secret = inputs.dir.path().join("secret");
    std::fs::create_dir_all(secret.join("..data")).unwrap();
    std::fs::write(secret.join("..data/router-0.cred"), "the credential\n").unwrap();
    std::fs::set_permissions(
        secret.join("..data/router-0.cred"),
        std::fs::Permissions::from_mode(0o400),
    )
    .unwrap();
    std::os::unix::fs::symlink("..data/router-0.cred", secret.join("router-0.cred")).unwrap();
    let creds = inputs.dir.path().join("creds");
    empty_dir(&creds);
    sh(&copy, &[&secret, &creds]);
    let file = creds.join("router-0.cred");
    let meta = std::fs::symlink_metadata(&file).unwrap();
    assert!(meta.file_type().is_file(), "a copy, not a link");
    assert_eq!(
        (meta.uid(), meta.gid(), meta.mode() & 0o777),
        (1000, 2000, 0o600)
    );
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "the credential\n");
    let dir = std::fs::metadata(&creds).unwrap();
    assert_eq!((dir.uid(), dir.mode() & 0o777), (1000, 0o700));
}

#[test]
fn a_systemd_router_may_write_its_load_file_and_only_there() {
    let inputs = Inputs::new();
    let key = inputs.key.to_str().unwrap();
    let out = inputs.dir.path().join("out");
    let stats = [
        "--router-arg=--load-stats",
        "--router-arg=/var/lib/em-test/load.json",
    ];
    let mut args = vec!["--key", key];
    args.extend(stats);
    let r = inputs.deploy(&["systemd"], &out, &args);
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    let unit = |name: &str| systemd_unit(&out, name);
    let router = unit("router-0");
    assert!(router.contains("\nProtectSystem=strict\n"), "{router}");
    assert!(
        router.contains("\nReadWritePaths=/var/lib/em-test\n"),
        "{router}"
    );
    assert!(!unit("worker-0").contains("ReadWritePaths"));
    // A relative load file cannot be written under ProtectSystem=strict: refused, saying so.
    let r = inputs.deploy(
        &["systemd"],
        &inputs.dir.path().join("out2"),
        &[
            "--key",
            key,
            "--router-arg=--load-stats",
            "--router-arg=load.json",
        ],
    );
    assert_eq!(r.code, 2, "{}{}", r.stdout, r.stderr);
    assert!(r.stderr.contains("absolute path"), "{}", r.stderr);
}

/// A supervised process (`EXPERTMESH_RESTARTS`) told to stop while `launch.sh` waits to restart
/// it is not started again: the script exits 0 after the pause. (It used to start the process
/// once more, which nothing then told to stop.)
#[test]
fn launch_sh_told_to_stop_between_restarts_starts_nothing_more() {
    use std::io::{BufRead, BufReader};
    use std::os::unix::fs::PermissionsExt;
    let inputs = Inputs::new();
    let out = inputs.dir.path().join("out-slurm");
    let r = inputs.deploy(&["slurm"], &out, &[]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    // A process that fails at once, counting its starts.
    let starts = inputs.dir.path().join("starts");
    let stub = inputs.dir.path().join("stub.sh");
    std::fs::write(
        &stub,
        format!("#!/bin/sh\necho x >> '{}'\nexit 1\n", starts.display()),
    )
    .unwrap();
    std::fs::set_permissions(&stub, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut child = Command::new("sh")
        .arg(out.join("fabric/launch.sh"))
        .arg("router-0")
        .env("EXPERTMESH_BIN", &stub)
        .env("EXPERTMESH_RESTARTS", "5")
        // A pause no loaded machine outlasts: the stop comes during it.
        .env("EXPERTMESH_RESTART_PAUSE_S", "120")
        .env_remove("EXPERTMESH_NODE")
        .env_remove("SLURMD_NODENAME")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    // The first failure: launch.sh says when it restarts, and pauses.
    loop {
        line.clear();
        assert!(
            stderr.read_line(&mut line).unwrap() > 0,
            "launch.sh ended early"
        );
        if line.contains("restart 1 of 5") {
            break;
        }
    }
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let t0 = std::time::Instant::now();
    let status = child.wait().unwrap();
    let count = std::fs::read_to_string(&starts).unwrap().lines().count();
    assert_eq!(count, 1, "started again after the stop");
    assert_eq!(status.code(), Some(0), "a requested stop exits 0");
    assert!(
        t0.elapsed() < std::time::Duration::from_secs(100),
        "the stop waited out the pause"
    );
}

/// `--host` values that are not host names (a path would put systemd units outside `--out`)
/// and metrics ports a process could not bind (0, or one the topology gives another
/// listener on the same node) are refused, exit 2, naming the flag.
#[test]
fn deploy_refuses_host_names_and_metrics_ports_that_cannot_work() {
    let inputs = Inputs::new();
    let out = inputs.dir.path().join("out");
    let deploy = |extra: &[&str]| inputs.deploy(&["systemd"], &out, extra);
    let frontend = inputs.frontend.to_string();
    for (extra, says) in [
        (
            vec!["--host", "local=/etc/systemd/system"],
            "is not a host name",
        ),
        (vec!["--host", "local=.."], "is not a host name"),
        (vec!["--host", "local=10.0.0.7"], "is an address"),
        (vec!["--metrics-port", "0"], "--metrics-port 0"),
        (
            vec!["--metrics-port", frontend.as_str()],
            "router 0's frontend port",
        ),
        // Extra arguments parse as the router and the worker would parse them.
        (vec!["--router-arg=--mdoe"], "unexpected argument '--mdoe'"),
        (
            vec!["--worker-arg=--link-timeout-s", "--worker-arg=1"],
            "four heartbeats",
        ),
        // A flag deploy sets itself: every worker would refuse it twice.
        (
            vec!["--worker-arg=--metrics=127.0.0.1:9"],
            "deploy sets --metrics for every worker itself",
        ),
        // An address no machine can use (only one this machine cannot resolve passes).
        (vec!["--worker-arg=--router=router-0"], "has no port"),
        // A flag that needs another the user did not give (deploy adds neither).
        (vec!["--worker-arg=--prepare-tile-cache"], "--tile-cache"),
    ] {
        let r = deploy(&extra);
        assert_eq!(r.code, 2, "{extra:?}: {}{}", r.stdout, r.stderr);
        assert!(r.stderr.contains(says), "{extra:?}: {}", r.stderr);
        assert!(!out.join("systemd").exists(), "{extra:?}: written anyway");
    }
    let r = deploy(&["--host", "local=node-7.example"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    // A host name only the cluster resolves is no reason to refuse an extra argument.
    let r = deploy(&["--worker-arg=--router=router-0.cluster.invalid:47400"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
}

/// A topology deploy cannot run is refused before anything is written: one without a
/// `[router]` section (every router would exit asking for --listen), and one on loopback
/// whose router listens on 0.0.0.0 without --key (the router refuses to start
/// unauthenticated off loopback).
#[test]
fn topologies_whose_processes_could_not_start_are_refused() {
    let inputs = Inputs::new();
    let text = std::fs::read_to_string(&inputs.topology).unwrap();
    let cases = [
        (
            "no-router.toml",
            {
                let (head, rest) = text.split_once("[router]").expect("a [router] table");
                let nodes = rest.find("[[nodes]]").expect("nodes after it");
                format!("{head}{}", &rest[nodes..])
            },
            "has no [router] section",
        ),
        (
            "open-router.toml",
            text.replacen("[router]\n", "[router]\nlisten_address = \"0.0.0.0\"\n", 1),
            "--key MASTER",
        ),
    ];
    for (name, edited, needle) in cases {
        assert_ne!(edited, text, "{name}: the edit applies");
        let topology = inputs.dir.path().join(name);
        std::fs::write(&topology, &edited).unwrap();
        let out = inputs.dir.path().join(format!("out-{name}"));
        let r = inputs.deploy_on(&topology, &example_placement(), &["slurm"], &out, &[]);
        assert_eq!(r.code, 2, "{name}: {}{}", r.stdout, r.stderr);
        assert!(r.stderr.contains(needle), "{name}: {}", r.stderr);
        assert!(!out.join("fabric").exists(), "{name}: nothing written");
    }
    // Paths the processes read on the hosts must be absolute.
    let out = inputs.dir.path().join("out-relative");
    let r = inputs.deploy(&["slurm", "--bundle-path", "shared/em"], &out, &[]);
    refused(&r, "must be absolute");
    let r = inputs.deploy(&["slurm", "--weights-on-hosts", "/w"], &out, &[]);
    refused(&r, "--weights");
    // A Slurm option's value is one word on its #SBATCH line: a line break would add lines
    // to the script.
    let r = inputs.deploy(&["slurm", "--partition", "gpu\n#SBATCH --mem=1"], &out, &[]);
    refused(&r, "--partition");
}

/// Under Kubernetes a router's `--load-stats` folder is a volume of its pod (the image's
/// folders may not exist or be writable, and a restarted container resumes the file); a
/// relative path is refused.
#[test]
fn a_kubernetes_router_keeps_its_load_file_in_a_volume() {
    let inputs = Inputs::new();
    let out = inputs.dir.path().join("out");
    let k8s = ["kubernetes", "--image", "registry.example/expertmesh:1"];
    let stats = [
        "--router-arg=--load-stats",
        "--router-arg=/var/lib/em-test/load.json",
    ];
    let r = inputs.deploy(&k8s, &out, &stats);
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    let router = process_manifest(&out, "router-0");
    assert!(
        router.contains(
            "\"mountPath\": \"/var/lib/em-test\"\n              \"name\": \"load-stats\""
        ) && router.contains("- \"emptyDir\": {}\n          \"name\": \"load-stats\""),
        "{router}"
    );
    let workers = ["worker-0", "worker-1"].map(|w| process_manifest(&out, w));
    // Each pod reserves what its process needs: a CPU device's threads and expert memory
    // (the topology's 1 thread and 256 MiB), a core for the router.
    let requests = |memory: &str| {
        format!("\"requests\":\n              \"cpu\": \"1\"{memory}\n          \"startupProbe\"")
    };
    for d in &workers {
        assert!(!d.contains("load-stats"), "{d}");
        let memory = "\n              \"memory\": \"268435456\"";
        assert!(d.contains(&requests(memory)), "{d}");
    }
    assert!(router.contains(&requests("")), "{router}");
    let out2 = inputs.dir.path().join("out2");
    let relative = ["--router-arg=--load-stats", "--router-arg=load.json"];
    let r = inputs.deploy(&k8s, &out2, &relative);
    refused(&r, "absolute path");
}

/// `r` is a deploy refused before anything started (exit 2), saying `needle`.
fn refused(r: &crate::support::Run, needle: &str) {
    assert_eq!(r.code, 2, "{}{}", r.stdout, r.stderr);
    assert!(r.stderr.contains(needle), "{}", r.stderr);
}

/// An engine lets a router finish its drain: its stop timeout is the router's
/// `--drain-timeout-s` and 30 s more (at least 60 s, the workers' too).
#[test]
fn a_router_gets_its_drain_before_the_engine_kills_it() {
    let inputs = Inputs::new();
    let key = inputs.key.to_str().unwrap();
    let drain = ["--key", key, "--router-arg=--drain-timeout-s=120"];
    let out = inputs.dir.path().join("out");
    let r = inputs.deploy(&["systemd"], &out, &drain);
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    let unit = |name: &str| systemd_unit(&out, name);
    assert!(unit("router-0").contains("\nTimeoutStopSec=150\n"));
    assert!(unit("worker-0").contains("\nTimeoutStopSec=60\n"));
    let k8s = ["kubernetes", "--image", "registry.example/expertmesh:1"];
    let out = inputs.dir.path().join("out-k8s");
    let r = inputs.deploy(&k8s, &out, &drain);
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    let router = process_manifest(&out, "router-0");
    assert!(
        router.contains("\"terminationGracePeriodSeconds\": 150"),
        "{router}"
    );
    let worker = process_manifest(&out, "worker-0");
    assert!(
        worker.contains("\"terminationGracePeriodSeconds\": 60"),
        "{worker}"
    );
}

/// A Slurm job of GPU workers says how it sees its GPUs where Slurm schedules them as
/// generic resources (a job gets none it did not ask for), and takes extra `#SBATCH`
/// directives, each one word.
#[test]
fn slurm_jobs_take_extra_directives_and_say_how_to_see_their_gpus() {
    let inputs = Inputs::new();
    let examples = crate::support::root().join("examples");
    let deploy = |out: &str, extra: &[&str]| {
        let out = inputs.dir.path().join(out);
        let mut args = vec![
            "deploy".to_string(),
            "slurm".into(),
            "--topology".into(),
            examples.join("mi300x-4x8.toml").display().to_string(),
            "--model".into(),
            "kimi-k2".into(),
            "--placement".into(),
            examples
                .join("mi300x-4x8-kimi-k2.placement.toml")
                .display()
                .to_string(),
            "--key".into(),
            inputs.key.display().to_string(),
            "--out".into(),
            out.display().to_string(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        (crate::support::run(&args), out)
    };
    let (r, _) = deploy("plain", &[]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(
        r.stdout
            .contains("GPU devices per host: node0 8, node1 8, node2 8, node3 8")
            && r.stdout.contains("--sbatch-arg=--gres=gpu:N"),
        "{}",
        r.stdout
    );
    let (r, out) = deploy(
        "gres",
        &["--sbatch-arg=--gres=gpu:8", "--sbatch-arg=--qos=serve"],
    );
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(!r.stdout.contains("GPU devices per host"), "{}", r.stdout);
    let script = std::fs::read_to_string(out.join("slurm/expertmesh.sbatch")).unwrap();
    let directives: Vec<&str> = script
        .lines()
        .filter(|l| l.starts_with("#SBATCH"))
        .collect();
    assert!(
        directives.ends_with(&["#SBATCH --gres=gpu:8", "#SBATCH --qos=serve"]),
        "{directives:?}"
    );
    for bad in ["--sbatch-arg=--gres gpu:8", "--sbatch-arg=gres=gpu:8"] {
        let (r, out) = deploy("bad", &[bad]);
        assert_eq!(r.code, 2, "{bad}: {}", r.stdout);
        assert!(
            r.stderr.contains("one sbatch option as one word"),
            "{}",
            r.stderr
        );
        assert!(!out.exists(), "{bad}: written anyway");
    }
}
