//! A fabric of real `expertmesh router` and `expertmesh worker` processes that faults can be
//! injected into: kill and restart, SIGSTOP and SIGCONT, misconfigured extra workers, and —
//! where network namespaces are permitted — partitions (iptables DROP, both ways or one way)
//! and slow links (tc tbf) between a worker and the routers.
//!
//! Why this exists: the fault suite (`tests/it/faults.rs`) and `expertmesh bench soak` need the
//! same thing: every process of the fabric as a separate child (so any of them, the router
//! included, can be stopped, killed or cut off), golden answers to check every call against,
//! and nothing left behind. Every child gets SIGKILL when the process that started it dies
//! (parent-death signal) and when the cluster is dropped (after a SIGCONT, so a stopped child
//! dies too), on panics as well; namespaces (and the iptables rules and qdiscs inside them)
//! are deleted by [`Emulation`]'s `Drop`.
//!
//! Layout: device `d` is `cpu{d}` on node `h{i}` (one device per node unless
//! [`FaultClusterOptions::node_sizes`] groups them), listening where the topology says (a free loopback port, or 10.77.0.{d+2} in namespace node `d + 1`); routers get their
//! addresses on the command line: two free loopback ports each, or 10.77.0.1 in namespace node 0,
//! where the clients must run too ([`FaultCluster::client_namespace`]).

use crate::BenchError;
use crate::cluster::netns::{Emulation, Shaping, cmd};
use std::net::SocketAddr;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Frontend and mesh ports of the routers inside the namespaces (each run has its own).
const NS_FRONTEND_PORT: u16 = 7400;
const NS_MESH_PORT: u16 = 7500;

/// How to start a fault-injection cluster.
#[derive(Clone, Debug)]
pub struct FaultClusterOptions {
    /// The `expertmesh` binary.
    pub exe: PathBuf,
    /// Folder for the generated topology/placement files and the logs.
    pub dir: PathBuf,
    /// Model preset.
    pub model: String,
    /// Seed of the synthetic weights.
    pub seed: u64,
    /// Experts of each device (`"0-15,24-31"`), one entry per device.
    pub placement: Vec<String>,
    /// Router processes sharing the workers.
    pub routers: usize,
    /// Each worker (and the routers) in its own network namespace.
    pub namespaces: bool,
    /// Devices per node, in device order (empty: one per node). A node of several devices
    /// fans dispatches out among them (loopback only; the routers run on the first node).
    pub node_sizes: Vec<usize>,
    /// Extra arguments of every `expertmesh router` (after `--mode exact`).
    pub router_args: Vec<String>,
    /// How long to wait for a process to load and connect.
    pub ready_timeout: Duration,
    /// `--link-timeout-s` of every router and worker (`None`: their default, 5 s). A test
    /// that tells a mechanism (a hedge, a closed socket, a displaced handshake) from a link
    /// declared dead sets it far past what the mechanism takes, so a slow machine cannot
    /// blur the two.
    pub link_timeout: Option<Duration>,
}

impl FaultClusterOptions {
    /// demo-small, seed 42, one router, on loopback, with the given placement.
    pub fn new(exe: impl Into<PathBuf>, dir: impl Into<PathBuf>, placement: &[&str]) -> Self {
        Self {
            exe: exe.into(),
            dir: dir.into(),
            model: "demo-small".into(),
            seed: 42,
            placement: placement.iter().map(|s| s.to_string()).collect(),
            routers: 1,
            namespaces: false,
            node_sizes: Vec::new(),
            router_args: Vec::new(),
            ready_timeout: Duration::from_secs(90),
            link_timeout: None,
        }
    }
}

/// How a worker is started: the cluster's files, or deliberately wrong ones.
#[derive(Clone, Debug, Default)]
pub struct WorkerOverride {
    /// Another seed (other weights).
    pub seed: Option<u64>,
    /// Another placement file.
    pub placement: Option<PathBuf>,
    /// Another model (preset or file).
    pub model: Option<String>,
}

/// Which packets a partition drops, seen from the worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cut {
    /// Nothing in or out of the worker's namespace.
    BothWays,
    /// The worker's packets to the routers are dropped; the routers' still arrive.
    WorkerToRouter,
}

/// One child process and where its output goes.
#[derive(Debug)]
pub struct Proc {
    child: Child,
    log: PathBuf,
    /// When it was started.
    pub started: Instant,
}

impl Proc {
    /// Process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Its combined stdout/stderr log.
    pub fn log(&self) -> &Path {
        &self.log
    }

    fn signal(&self, sig: i32) -> Result<(), BenchError> {
        // SAFETY: kill(2) on a child this process started and has not reaped.
        if unsafe { libc::kill(self.child.id() as libc::pid_t, sig) } != 0 {
            return Err(BenchError::Signal {
                signal: sig,
                pid: self.child.id(),
                cause: std::io::Error::last_os_error(),
            });
        }
        Ok(())
    }

    /// SIGSTOP and wait (up to 2 s) until every thread shows as stopped (a signal reaches a
    /// running thread a little later), or SIGCONT.
    fn pause(&self, stop: bool) -> Result<(), BenchError> {
        if !stop {
            return self.signal(libc::SIGCONT);
        }
        self.signal(libc::SIGSTOP)?;
        let until = Instant::now() + Duration::from_secs(2);
        while !all_threads_stopped(self.child.id()) {
            if Instant::now() > until {
                return Err(BenchError::DidNotStop(self.child.id()));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok(())
    }

    /// SIGCONT (a stopped child dies too), SIGKILL, reap.
    fn kill(mut self) {
        let _ = self.signal(libc::SIGCONT);
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Exit status, if it has exited.
    fn exited(&mut self) -> Option<String> {
        self.child.try_wait().ok().flatten().map(|s| s.to_string())
    }
}

/// Whether every thread of `pid` is in state T (stopped).
fn all_threads_stopped(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    tasks.flatten().all(|t| {
        let stat = std::fs::read_to_string(t.path().join("stat")).unwrap_or_default();
        // The state follows the command name in parentheses.
        stat.rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('T'))
    })
}

/// VmRSS of `pid` in kB.
pub(crate) fn rss_kb(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = s.lines().find(|l| l.starts_with("VmRSS:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// The running cluster.
pub struct FaultCluster {
    opts: FaultClusterOptions,
    topology: PathBuf,
    placement: PathBuf,
    routers: Vec<Option<Proc>>,
    workers: Vec<Option<Proc>>,
    extras: Vec<Proc>,
    /// (frontend, mesh) address of each router.
    router_addrs: Vec<(SocketAddr, SocketAddr)>,
    /// Listen address of each worker (as in the topology).
    worker_addrs: Vec<SocketAddr>,
    /// Device ids ("h1/cpu2").
    ids: Vec<String>,
    /// Restarts so far, per process name (log file suffixes).
    starts: std::collections::HashMap<String, usize>,
    net: Option<Emulation>,
}

impl std::fmt::Debug for FaultCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FaultCluster")
            .field("routers", &self.router_addrs)
            .field("namespaces", &self.net.is_some())
            .finish()
    }
}

/// Whether this machine lets us create network namespaces and run iptables and tc in them;
/// `Err` says why not (tests print it after "skipped:").
pub fn namespaces_permitted() -> Result<(), String> {
    let name = format!("emf-probe-{}", std::process::id());
    // `netns::cmd` names the program, its arguments and its stderr when it fails.
    let run = |args: &[&str]| cmd(args[0], &args[1..]).map_err(|e| e.to_string());
    run(&["ip", "netns", "add", &name])?;
    let r = run(&["ip", "netns", "exec", &name, "iptables", "-L", "-n"]).and_then(|_| {
        run(&[
            "ip", "netns", "exec", &name, "tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate",
            "1mbit", "burst", "2048", "latency", "10ms",
        ])
    });
    let _ = run(&["ip", "netns", "del", &name]);
    r
}

impl FaultCluster {
    /// Write the files, start the routers and the workers, and wait until every router has
    /// taken every worker up.
    pub fn start(opts: FaultClusterOptions) -> Result<Self, BenchError> {
        std::fs::create_dir_all(&opts.dir)
            .map_err(BenchError::io(format!("creating {}", opts.dir.display())))?;
        let topology = opts.dir.join("topology.toml");
        let placement = opts.dir.join("placement.toml");
        let n = opts.placement.len();
        let sizes = if opts.node_sizes.is_empty() {
            vec![1; n]
        } else {
            opts.node_sizes.clone()
        };
        if sizes.iter().sum::<usize>() != n || (opts.namespaces && sizes.iter().any(|&k| k != 1)) {
            return Err(BenchError::NodeSizes { sizes, devices: n });
        }
        // Loopback: every port at once (held until all are picked, so none repeats).
        let free = if opts.namespaces {
            Vec::new()
        } else {
            free_ports(2 * opts.routers)?
        };
        let worker_addrs: Vec<SocketAddr> = if opts.namespaces {
            (0..n)
                .map(|d| format!("{}:7600", Emulation::node_address(d + 1)).parse())
                .collect::<Result<_, _>>()?
        } else {
            loopback_worker_ports(&sizes)?
        };
        std::fs::write(
            &topology,
            topology_toml(&worker_addrs, &sizes, opts.routers),
        )?;
        let ids: Vec<String> = sizes
            .iter()
            .enumerate()
            .flat_map(|(node, &k)| std::iter::repeat_n(node, k))
            .enumerate()
            .map(|(d, node)| format!("h{node}/cpu{d}"))
            .collect();
        std::fs::write(
            &placement,
            placement_toml(&opts.model, &ids, &opts.placement),
        )?;

        let net = if opts.namespaces {
            let shaping = Shaping {
                rate_mbit: 10_000.0,
                burst_bytes: 4 << 20,
                latency_ms: 50.0,
                mtu: 9000,
            };
            Some(Emulation::create(opts.placement.len() + 1, shaping)?)
        } else {
            None
        };
        let router_addrs = (0..opts.routers)
            .map(|i| match net {
                Some(_) => router_ns_addresses(i),
                None => Ok((free[2 * i], free[2 * i + 1])),
            })
            .collect::<Result<Vec<_>, BenchError>>()?;
        let mut c = Self {
            topology,
            placement,
            routers: (0..opts.routers).map(|_| None).collect(),
            workers: (0..opts.placement.len()).map(|_| None).collect(),
            extras: Vec::new(),
            router_addrs,
            worker_addrs,
            ids,
            starts: Default::default(),
            net,
            opts,
        };
        for i in 0..c.opts.routers {
            c.start_router(i)?;
        }
        for d in 0..c.workers.len() {
            c.spawn_worker(d)?;
        }
        for d in 0..c.workers.len() {
            c.wait_worker_ready(d)?;
        }
        for d in 0..c.workers.len() {
            c.wait_joined(d, 0, c.opts.ready_timeout)?;
        }
        Ok(c)
    }

    /// Number of worker devices.
    pub fn devices(&self) -> usize {
        self.workers.len()
    }

    /// The device id of device `d` ("h0/cpu0").
    pub fn device_id(&self, d: usize) -> String {
        self.ids[d].clone()
    }

    /// A placement file's text for this cluster's devices: device `d` holds `experts[d]`.
    pub fn placement_text(&self, experts: &[String]) -> String {
        placement_toml(&self.opts.model, &self.ids, experts)
    }

    /// Where router `i`'s frontends connect.
    pub fn frontend_addr(&self, i: usize) -> SocketAddr {
        self.router_addrs[i].0
    }

    /// Router `i`'s mesh address (where workers connect).
    pub fn router_mesh_addr(&self, i: usize) -> SocketAddr {
        self.router_addrs[i].1
    }

    /// The namespace client threads must enter first (`netns::enter`), when there is one.
    pub fn client_namespace(&self) -> Option<String> {
        self.net.as_ref().map(|e| e.node_ns(0))
    }

    /// Whether the workers run in network namespaces.
    pub(crate) fn has_namespaces(&self) -> bool {
        self.net.is_some()
    }

    /// The topology file.
    pub fn topology(&self) -> &Path {
        &self.topology
    }

    /// The folder of files and logs.
    pub fn dir(&self) -> &Path {
        &self.opts.dir
    }

    /// The placement (experts) of device `d`, as given.
    pub fn experts_of(&self, d: usize) -> &str {
        &self.opts.placement[d]
    }

    /// Start (or restart) router `i` and wait until it listens.
    pub fn start_router(&mut self, i: usize) -> Result<(), BenchError> {
        if let Some(p) = self.routers[i].take() {
            p.kill();
        }
        let (front, mesh) = self.router_addrs[i];
        let mut args = self.deploy_args(&WorkerOverride::default());
        args.extend(
            [
                "--instance".to_string(),
                i.to_string(),
                "--listen".into(),
                front.to_string(),
                "--mesh-listen".into(),
                mesh.to_string(),
                "--mode".into(),
                "exact".into(),
            ]
            .into_iter()
            .chain(self.opts.router_args.iter().cloned()),
        );
        let name = format!("router-{i}");
        let p = self.spawn(&name, 0, "router", &args)?;
        self.routers[i] = Some(p);
        let until = Instant::now() + self.opts.ready_timeout;
        loop {
            if self.log_text_router(i).contains("frontends connect") {
                return Ok(());
            }
            if let Some(s) = self.routers[i].as_mut().and_then(Proc::exited) {
                return Err(BenchError::ExitedAtStart {
                    process: format!("router {i}"),
                    status: s,
                    log_tail: self.log_tail_router(i),
                });
            }
            if Instant::now() > until {
                return Err(BenchError::RouterDidNotStart {
                    router: i,
                    log_tail: self.log_tail_router(i),
                });
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// SIGKILL router `i` (it stays down until [`FaultCluster::start_router`]).
    pub fn kill_router(&mut self, i: usize) {
        if let Some(p) = self.routers[i].take() {
            p.kill();
        }
    }

    /// SIGSTOP (`stop`: returns once every thread has stopped) or SIGCONT router `i`.
    pub fn pause_router(&self, i: usize, stop: bool) -> Result<(), BenchError> {
        let p = self.routers[i]
            .as_ref()
            .ok_or_else(|| BenchError::NotRunning(format!("router {i}")))?;
        p.pause(stop)
    }

    /// SIGSTOP (`stop`: returns once every thread has stopped) or SIGCONT worker `d`.
    pub fn pause_worker(&self, d: usize, stop: bool) -> Result<(), BenchError> {
        let p = self.workers[d]
            .as_ref()
            .ok_or_else(|| BenchError::NotRunning(format!("worker {d}")))?;
        p.pause(stop)
    }

    /// SIGKILL worker `d`.
    pub fn kill_worker(&mut self, d: usize) {
        if let Some(p) = self.workers[d].take() {
            p.kill();
        }
    }

    /// Start worker `d` (killing the old one) and wait until it has loaded its experts;
    /// returns the moment its "ready" line was seen. It joins the routers on its own.
    pub fn start_worker(&mut self, d: usize) -> Result<Instant, BenchError> {
        self.kill_worker(d);
        self.spawn_worker(d)?;
        self.wait_worker_ready(d)
    }

    /// Start one more worker process claiming device `d`, with `how` (another seed, model or
    /// placement file; or nothing: a duplicate). Returns its index among the extras; it runs
    /// until it is killed or the cluster is dropped.
    pub fn start_extra_worker(
        &mut self,
        d: usize,
        how: &WorkerOverride,
    ) -> Result<usize, BenchError> {
        let mut args = self.worker_args(d, how);
        // Another process for the device listens elsewhere (as on another host).
        let listen = match &self.net {
            Some(_) => format!("{}:{}", self.worker_addrs[d].ip(), 7601 + self.extras.len()),
            None => "127.0.0.1:0".to_string(),
        };
        if let Some(i) = args.iter().position(|a| a == "--listen") {
            args[i + 1] = listen;
        }
        let name = format!("extra-{}-cpu{d}", self.extras.len());
        let p = self.spawn(&name, d + 1, "worker", &args)?;
        self.extras.push(p);
        Ok(self.extras.len() - 1)
    }

    /// The extra worker `k`'s process (pid, log).
    pub fn extra(&mut self, k: usize) -> &mut Proc {
        &mut self.extras[k]
    }

    /// Whether extra worker `k` has exited (and how).
    pub fn extra_exited(&mut self, k: usize) -> Option<String> {
        self.extras[k].exited()
    }

    /// Every live process: ("router-0" / "cpu1", pid).
    pub fn processes(&self) -> Vec<(String, u32)> {
        let r = self
            .routers
            .iter()
            .enumerate()
            .filter_map(|(i, p)| p.as_ref().map(|p| (format!("router-{i}"), p.pid())));
        let w = self
            .workers
            .iter()
            .enumerate()
            .filter_map(|(d, p)| p.as_ref().map(|p| (format!("cpu{d}"), p.pid())));
        r.chain(w).collect()
    }

    /// Worker `d`'s pid, while it runs.
    pub fn worker_pid(&self, d: usize) -> Option<u32> {
        self.workers[d].as_ref().map(Proc::pid)
    }

    /// Router `i`'s pid, while it runs.
    pub fn router_pid(&self, i: usize) -> Option<u32> {
        self.routers[i].as_ref().map(Proc::pid)
    }

    /// How many times router `i`'s current log says `device` connected (a worker join).
    pub fn joins_seen(&self, i: usize, d: usize) -> usize {
        let id = self.device_id(d);
        self.log_text_router(i)
            .lines()
            .filter(|l| l.contains(&id) && is_join_line(l))
            .count()
    }

    /// Wait until router `i` has logged more than `before` joins of device `d` (every router
    /// when `i` is `None`... see [`FaultCluster::wait_joined_all`]); the moment it was seen.
    pub(crate) fn wait_joined(
        &self,
        d: usize,
        before: usize,
        timeout: Duration,
    ) -> Result<Instant, BenchError> {
        self.wait_joined_on(0, d, before, timeout)
    }

    fn wait_joined_on(
        &self,
        i: usize,
        d: usize,
        before: usize,
        timeout: Duration,
    ) -> Result<Instant, BenchError> {
        let until = Instant::now() + timeout;
        loop {
            if self.joins_seen(i, d) > before {
                return Ok(Instant::now());
            }
            if Instant::now() > until {
                return Err(BenchError::NotTakenUp {
                    router: i,
                    worker: self.device_id(d),
                    timeout,
                    router_log: self.log_tail_router(i),
                    worker_log: self.log_tail_worker(d),
                });
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// [`FaultCluster::wait_joined`] on every running router; joins counted from `before`
    /// (one count per router).
    pub(crate) fn wait_joined_all(
        &self,
        d: usize,
        before: &[usize],
        timeout: Duration,
    ) -> Result<Instant, BenchError> {
        let mut last = Instant::now();
        for (i, &b) in before.iter().enumerate() {
            if self.routers[i].is_some() {
                last = self.wait_joined_on(i, d, b, timeout)?;
            }
        }
        Ok(last)
    }

    /// Joins of device `d` each router has logged so far.
    pub(crate) fn joins_all(&self, d: usize) -> Vec<usize> {
        (0..self.routers.len())
            .map(|i| self.joins_seen(i, d))
            .collect()
    }

    /// Cut worker `d` off from the routers (namespaces only).
    pub fn partition(&self, d: usize, cut: Cut) -> Result<(), BenchError> {
        let ns = self.worker_ns(d)?;
        let chains: &[&str] = match cut {
            Cut::BothWays => &["INPUT", "OUTPUT"],
            Cut::WorkerToRouter => &["OUTPUT"],
        };
        // `-w`: iptables-legacy holds one lock for every namespace; two partitions begun at
        // once wait for it instead of failing (iptables-nft ignores the flag).
        for chain in chains {
            let dir = if *chain == "OUTPUT" { "-o" } else { "-i" };
            cmd(
                "ip",
                &[
                    "netns", "exec", &ns, "iptables", "-w", "-I", chain, dir, "eth0", "-j", "DROP",
                ],
            )?;
        }
        Ok(())
    }

    /// Remove every partition rule of worker `d`.
    pub fn heal(&self, d: usize) -> Result<(), BenchError> {
        let ns = self.worker_ns(d)?;
        cmd("ip", &["netns", "exec", &ns, "iptables", "-w", "-F"])
    }

    /// Throttle what worker `d` sends to `kbit` kbit/s (tc tbf with a deep queue: its answers
    /// arrive late rather than lost), namespaces only; `None` restores the plain link.
    pub fn slow_link(&self, d: usize, kbit: Option<u32>) -> Result<(), BenchError> {
        let ns = self.worker_ns(d)?;
        let (rate, latency) = match kbit {
            Some(k) => (format!("{k}kbit"), "10s"),
            None => ("10000mbit".to_string(), "50ms"),
        };
        cmd(
            "ip",
            &[
                "netns", "exec", &ns, "tc", "qdisc", "replace", "dev", "eth0", "root", "tbf",
                "rate", &rate, "burst", "65536", "latency", latency,
            ],
        )
    }

    fn worker_ns(&self, d: usize) -> Result<String, BenchError> {
        match &self.net {
            Some(e) => Ok(e.node_ns(d + 1)),
            None => Err(BenchError::NeedsNamespaces),
        }
    }

    /// The last lines of router `i`'s log.
    pub fn log_tail_router(&self, i: usize) -> String {
        tail(&self.opts.dir.join(format!("router-{i}.log")), 12)
    }

    /// The last lines of worker `d`'s log.
    pub(crate) fn log_tail_worker(&self, d: usize) -> String {
        tail(&self.opts.dir.join(format!("cpu{d}.log")), 12)
    }

    fn log_text_router(&self, i: usize) -> String {
        std::fs::read_to_string(self.opts.dir.join(format!("router-{i}.log"))).unwrap_or_default()
    }

    /// `--topology --model --placement --seed` (and `--link-timeout-s`) of a process.
    fn deploy_args(&self, how: &WorkerOverride) -> Vec<String> {
        let placement = how.placement.as_ref().unwrap_or(&self.placement);
        let timeout = self
            .opts
            .link_timeout
            .map(|t| ["--link-timeout-s".to_string(), t.as_secs_f64().to_string()]);
        [
            "--topology".into(),
            self.topology.display().to_string(),
            "--model".into(),
            how.model.clone().unwrap_or_else(|| self.opts.model.clone()),
            "--placement".into(),
            placement.display().to_string(),
            "--seed".into(),
            how.seed.unwrap_or(self.opts.seed).to_string(),
        ]
        .into_iter()
        .chain(timeout.into_iter().flatten())
        .collect()
    }

    fn worker_args(&self, d: usize, how: &WorkerOverride) -> Vec<String> {
        let mut args = self.deploy_args(how);
        let listen = self.worker_addrs[d].to_string();
        args.extend([
            "--device".into(),
            self.device_id(d),
            "--listen".into(),
            listen,
            "--max-tokens".into(),
            "64".into(),
            "--threads".into(),
            "1".into(),
            "--exit-with-parent".into(),
        ]);
        for (_, mesh) in &self.router_addrs {
            args.push("--router".into());
            args.push(mesh.to_string());
        }
        args
    }

    fn spawn_worker(&mut self, d: usize) -> Result<(), BenchError> {
        let args = self.worker_args(d, &WorkerOverride::default());
        let p = self.spawn(&format!("cpu{d}"), d + 1, "worker", &args)?;
        self.workers[d] = Some(p);
        Ok(())
    }

    fn wait_worker_ready(&mut self, d: usize) -> Result<Instant, BenchError> {
        let until = Instant::now() + self.opts.ready_timeout;
        let log = self.opts.dir.join(format!("cpu{d}.log"));
        loop {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            if text.contains(" ready: ") {
                return Ok(Instant::now());
            }
            if let Some(s) = self.workers[d].as_mut().and_then(Proc::exited) {
                return Err(BenchError::ExitedAtStart {
                    process: format!("worker cpu{d}"),
                    status: s,
                    log_tail: tail(&log, 12),
                });
            }
            if Instant::now() > until {
                return Err(BenchError::WorkerDidNotLoad {
                    device: d,
                    log_tail: tail(&log, 12),
                });
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Start `expertmesh <sub> args` as process `name` (log `name.log`; earlier logs of the
    /// same name are kept as `name.N.log`), in namespace node `node` when there are namespaces.
    fn spawn(
        &mut self,
        name: &str,
        node: usize,
        sub: &str,
        args: &[String],
    ) -> Result<Proc, BenchError> {
        let n = self.starts.entry(name.to_string()).or_insert(0);
        let log = self.opts.dir.join(format!("{name}.log"));
        if *n > 0 && log.exists() {
            let _ = std::fs::rename(&log, self.opts.dir.join(format!("{name}.{n}.log")));
        }
        *n += 1;
        let file = std::fs::File::create(&log)
            .map_err(BenchError::io(format!("creating {}", log.display())))?;
        let mut cmd = match &self.net {
            Some(e) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", &e.node_ns(node)])
                    .arg(&self.opts.exe);
                c
            }
            None => Command::new(&self.opts.exe),
        };
        cmd.arg(sub).args(args);
        if self.net.is_some() {
            // Namespace addresses are not loopback: the links run unauthenticated on purpose.
            cmd.arg("--insecure");
        }
        cmd.env("EXPERTMESH_LOG", "info")
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(file.try_clone()?)
            .stderr(file);
        // SAFETY: the closure runs in the child between fork and exec and only calls prctl,
        // which is async-signal-safe.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(
                    libc::PR_SET_PDEATHSIG,
                    libc::SIGKILL as libc::c_ulong,
                    0,
                    0,
                    0,
                );
                Ok(())
            });
        }
        let child = cmd.spawn().map_err(BenchError::io(format!(
            "starting {}",
            self.opts.exe.display()
        )))?;
        Ok(Proc {
            child,
            log,
            started: Instant::now(),
        })
    }
}

impl Drop for FaultCluster {
    fn drop(&mut self) {
        for p in self.extras.drain(..) {
            p.kill();
        }
        for p in self.workers.iter_mut().filter_map(Option::take) {
            p.kill();
        }
        for p in self.routers.iter_mut().filter_map(Option::take) {
            p.kill();
        }
        // `net` (namespaces, their iptables rules and qdiscs) is dropped after this.
    }
}

/// A router log line saying a worker joined (`worker connected`), not a refusal or a loss.
fn is_join_line(l: &str) -> bool {
    l.contains("connected")
        && !l.contains("not connected")
        && !l.contains("disconnected")
        && !l.contains("refus")
}

/// `n` free loopback ports (all listeners held until every port is picked).
fn free_ports(n: usize) -> Result<Vec<SocketAddr>, BenchError> {
    (0..n)
        .map(|_| {
            let port = expertmesh_transport::ports::free_loopback_ports(1)
                .map_err(BenchError::io("picking free ports"))?;
            Ok(SocketAddr::from(([127, 0, 0, 1], port)))
        })
        .collect()
}

/// (frontend, mesh) of router `i` in namespace node 0.
fn router_ns_addresses(i: usize) -> Result<(SocketAddr, SocketAddr), BenchError> {
    let ip = Emulation::node_address(0);
    let f = format!("{ip}:{}", NS_FRONTEND_PORT + i as u16).parse()?;
    let m = format!("{ip}:{}", NS_MESH_PORT + i as u16).parse()?;
    Ok((f, m))
}

/// Listen addresses of the devices on loopback: each node's devices on consecutive free ports
/// (a node's devices listen at its data port + their index, as the topology says).
fn loopback_worker_ports(sizes: &[usize]) -> Result<Vec<SocketAddr>, BenchError> {
    let mut out = Vec::new();
    for &k in sizes.iter().filter(|&&k| k > 0) {
        let run = u16::try_from(k).map_err(|_| BenchError::NoConsecutivePorts(k))?;
        let base = expertmesh_transport::ports::free_loopback_ports(run)
            .map_err(|_| BenchError::NoConsecutivePorts(k))?;
        out.extend((0..k as u16).map(|i| SocketAddr::from(([127, 0, 0, 1], base + i))));
    }
    Ok(out)
}

/// The topology: node `h{i}` holds the next `sizes[i]` devices (`cpu{d}`, listening at
/// `workers[d]`: the node's data port + its index there; the routers dial workers there too,
/// as in a real deployment); the routers run on node h0. Router ports are placeholders
/// (routers get their addresses on the command line).
pub(crate) fn topology_toml(workers: &[SocketAddr], sizes: &[usize], routers: usize) -> String {
    let mut s = String::from(
        "# Generated by the fault suite; router addresses come from the command line.\n\
         format = 1\nname = \"faults\"\n\n",
    );
    for i in 0..routers {
        s.push_str(&format!(
            "[[router]]\nnode = \"h0\"\nport = {}\nmesh_port = {}\n\n",
            47600 + 2 * i,
            47601 + 2 * i
        ));
    }
    let mut d = 0;
    for (node, &k) in sizes.iter().enumerate() {
        let a = workers[d];
        s.push_str(&format!(
            "[[nodes]]\nname = \"h{node}\"\naddress = \"{}\"\ncontrol_port = {}\ndata_port = {}\n",
            a.ip(),
            47690 + node,
            a.port()
        ));
        if k > 1 {
            s.push_str("intra_link = \"shm\"\nintra_bandwidth_gb_s = 10\n");
        }
        s.push_str("nics = [{ name = \"eth0\", kind = \"tcp\", speed_gbit_s = 10, mtu = 9000 }]\ndevices = [\n");
        for _ in 0..k {
            s.push_str(&format!(
                "  {{ name = \"cpu{d}\", kind = \"cpu\", arch = \"cpu\", threads = 1, expert_memory = \"256 MiB\", memory_bandwidth_gb_s = 20 }},\n"
            ));
            d += 1;
        }
        s.push_str("]\n\n");
    }
    s
}

/// The placement: device `ids[d]` holds `experts[d]` in every layer; the shared expert on the
/// router.
pub fn placement_toml(model: &str, ids: &[String], experts: &[String]) -> String {
    let mut s = format!("format = 1\nmodel = \"{model}\"\ncluster = \"faults\"\n\n");
    for (id, e) in ids.iter().zip(experts) {
        s.push_str(&format!(
            "[[assign]]\nlayers = \"all\"\ndevice = \"{id}\"\nexperts = \"{e}\"\n\n"
        ));
    }
    s.push_str("[[shared]]\nlayers = \"all\"\ndevice = \"router\"\n");
    s
}

/// Run a command; an error names it and its stderr.
/// The last `n` lines of a file, with its name.
fn tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    let from = lines.len().saturating_sub(n);
    format!(
        "--- {} (last {n} lines):\n{}",
        path.display(),
        lines[from..].join("\n")
    )
}
