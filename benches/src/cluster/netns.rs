//! The emulated network: one network namespace per node and a "switch" namespace holding a
//! bridge, each node joined to it by a veth pair whose two ends are rate-limited with `tc tbf`
//! (node → switch: what the node's NIC sends; switch → node: what it receives), and the
//! processes started inside those namespaces.
//!
//! Why this exists: `bench cluster` needs real NIC limits between real processes on one
//! machine. Everything created here carries a per-run prefix (`emc-<pid>-<n>-`), so parallel runs
//! do not collide, and is removed by [`Emulation`]'s `Drop` — on errors and panics — and by
//! the Ctrl-C / SIGTERM handler installed by [`install_signal_cleanup`].

use crate::BenchError;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;

/// Namespaces and child processes to remove if the process is interrupted.
static LIVE: Mutex<Vec<(Vec<String>, Vec<u32>)>> = Mutex::new(Vec::new());

/// The rate limit of every NIC.
#[derive(Clone, Copy, Debug)]
pub struct Shaping {
    /// Line rate, Mbit/s.
    pub rate_mbit: f64,
    /// Token-bucket size, bytes (at least one MTU-sized frame; larger allows longer bursts
    /// above the rate).
    pub burst_bytes: u64,
    /// Longest a packet may wait in the queue before it is dropped, ms (sets the queue size).
    pub latency_ms: f64,
    /// MTU of every veth (and of the topology's NICs).
    pub mtu: u32,
}

/// Run a system command (`ip`, `tc`, `iptables`) with `args`; an error names the command and
/// its stderr. The cluster and soak benches change namespaces, links and filters only
/// through this.
pub fn cmd(program: &str, args: &[&str]) -> Result<(), BenchError> {
    let out = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(BenchError::io(format!(
            "cannot run {program} (are iproute2 and iptables installed?)"
        )))?;
    if !out.status.success() {
        return Err(BenchError::Command {
            program: program.to_string(),
            args: args.iter().map(ToString::to_string).collect(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(())
}

/// A running emulation: namespaces (nodes and the switch) and the processes inside them.
pub struct Emulation {
    prefix: String,
    nodes: usize,
    created: Vec<String>,
    children: Vec<(String, Child)>,
}

impl Emulation {
    /// The namespace name of node `i`.
    pub fn node_ns(&self, i: usize) -> String {
        format!("{}n{i}", self.prefix)
    }

    fn switch_ns(&self) -> String {
        format!("{}sw", self.prefix)
    }

    /// The address of node `i` (10.77.0.i+1; every run has its own switch, so addresses of
    /// parallel runs never meet).
    pub fn node_address(i: usize) -> String {
        format!("10.77.0.{}", i + 1)
    }

    /// Build `nodes` node namespaces around a bridge, each link shaped as `shaping` says.
    /// Fails with "network namespaces not permitted: ..." when `ip netns add` does.
    pub fn create(nodes: usize, shaping: Shaping) -> Result<Emulation, BenchError> {
        if !(1..=200).contains(&nodes) {
            return Err(BenchError::Options("--nodes must be 1-200".into()));
        }
        let mut e = Emulation {
            // Unique per emulation: one process (a test binary) may run several at once.
            prefix: format!("emc-{}-{}-", std::process::id(), {
                static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
                NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            }),
            nodes,
            created: Vec::new(),
            children: Vec::new(),
        };
        let sw = e.switch_ns();
        cmd("ip", &["netns", "add", &sw])
            .map_err(|err| BenchError::NamespacesNotPermitted(Box::new(err)))?;
        e.created.push(sw.clone());
        e.register();
        cmd("ip", &["-n", &sw, "link", "set", "lo", "up"])?;
        cmd("ip", &["-n", &sw, "link", "add", "br0", "type", "bridge"])?;
        cmd("ip", &["-n", &sw, "link", "set", "br0", "up"])?;
        for i in 0..nodes {
            e.add_node(i, shaping)?;
        }
        Ok(e)
    }

    /// One node: its namespace, the veth pair to the switch, addresses, MTU and shaping.
    fn add_node(&mut self, i: usize, s: Shaping) -> Result<(), BenchError> {
        let (ns, sw) = (self.node_ns(i), self.switch_ns());
        cmd("ip", &["netns", "add", &ns])?;
        self.created.push(ns.clone());
        self.register();
        let port = format!("v{i}");
        let mtu = s.mtu.to_string();
        cmd(
            "ip",
            &[
                "-n", &ns, "link", "add", "eth0", "type", "veth", "peer", "name", &port, "netns",
                &sw,
            ],
        )?;
        let addr = format!("{}/24", Self::node_address(i));
        cmd("ip", &["-n", &ns, "addr", "add", &addr, "dev", "eth0"])?;
        cmd("ip", &["-n", &ns, "link", "set", "eth0", "mtu", &mtu, "up"])?;
        cmd("ip", &["-n", &ns, "link", "set", "lo", "up"])?;
        cmd(
            "ip",
            &[
                "-n", &sw, "link", "set", &port, "master", "br0", "mtu", &mtu, "up",
            ],
        )?;
        shape(&ns, "eth0", s)?;
        shape(&sw, &port, s)
    }

    /// Start `args` (the first is the program) inside node `i`'s namespace; its output goes to
    /// `log`.
    pub fn spawn(&mut self, i: usize, args: &[String], log: &Path) -> Result<(), BenchError> {
        let ns = self.node_ns(i);
        let file = std::fs::File::create(log)
            .map_err(BenchError::io(format!("cannot create {}", log.display())))?;
        let child = Command::new("ip")
            .args(["netns", "exec", &ns])
            .args(args)
            .stdin(Stdio::null())
            .stdout(file.try_clone()?)
            .stderr(file)
            .spawn()
            .map_err(BenchError::io("cannot start a process in a namespace"))?;
        let name = format!("{} ({})", args[1..].join(" "), log.display());
        self.children.push((name, child));
        self.register();
        Ok(())
    }

    /// The first child that has exited, with its status and name.
    pub fn exited(&mut self) -> Option<String> {
        self.children.iter_mut().find_map(|(name, c)| {
            c.try_wait()
                .ok()
                .flatten()
                .map(|s| format!("{name} exited ({s})"))
        })
    }

    /// Bytes node `i`'s NIC has sent and received so far.
    pub(crate) fn nic_bytes(&self, i: usize) -> Result<(u64, u64), BenchError> {
        let ns = self.node_ns(i);
        let out = Command::new("ip")
            .args(["-n", &ns, "-s", "-j", "link", "show", "dev", "eth0"])
            .output()
            .map_err(BenchError::io("cannot run ip"))?;
        let v: serde_json::Value =
            serde_json::from_slice(&out.stdout).map_err(|cause| BenchError::NotJson {
                what: format!("ip -s -j link show in {ns}"),
                cause,
            })?;
        let stats = &v[0]["stats64"];
        let get = |dir: &str| stats[dir]["bytes"].as_u64().unwrap_or(0);
        Ok((get("tx"), get("rx")))
    }

    /// Packets the tbf qdiscs dropped and TCP segments retransmitted so far, over every node
    /// (both ends of every link): a healthy run keeps both near zero.
    pub(crate) fn drops_and_retransmits(&self) -> (u64, u64) {
        let run = |args: &[&str]| -> String {
            Command::new("ip")
                .args(args)
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
                .unwrap_or_default()
        };
        let qdisc_drops = |ns: &str, dev: &str| -> u64 {
            let text = run(&[
                "netns", "exec", ns, "tc", "-s", "-j", "qdisc", "show", "dev", dev,
            ]);
            let v: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
            v[0]["drops"].as_u64().unwrap_or(0)
        };
        let (mut drops, mut retrans) = (0, 0);
        for i in 0..self.nodes {
            let ns = self.node_ns(i);
            drops += qdisc_drops(&ns, "eth0") + qdisc_drops(&self.switch_ns(), &format!("v{i}"));
            let snmp = run(&["netns", "exec", &ns, "cat", "/proc/net/snmp"]);
            let tcp: Vec<&str> = snmp.lines().filter(|l| l.starts_with("Tcp:")).collect();
            if let [names, values] = tcp[..] {
                let col = names.split_whitespace().position(|n| n == "RetransSegs");
                let val = col.and_then(|c| values.split_whitespace().nth(c));
                retrans += val.and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
            }
        }
        (drops, retrans)
    }

    /// CPU seconds (user + system) the processes of this emulation and this process have used.
    pub(crate) fn cpu_seconds(&self) -> f64 {
        let at = |path: &str| crate::overload::cpu_seconds_at(path).unwrap_or(0.0);
        let mut total = at("/proc/self/stat");
        for (_, c) in &self.children {
            total += at(&format!("/proc/{}/stat", c.id()));
        }
        total
    }

    /// Number of nodes.
    pub fn nodes(&self) -> usize {
        self.nodes
    }

    /// Record what exists now for the signal handler.
    fn register(&self) {
        let pids: Vec<u32> = self.children.iter().map(|(_, c)| c.id()).collect();
        if let Ok(mut live) = LIVE.lock() {
            live.retain(|(names, _)| !names.iter().any(|n| n.starts_with(&self.prefix)));
            live.push((self.created.clone(), pids));
        }
    }

    /// Stop every process (SIGTERM, then SIGKILL after a grace period).
    pub(crate) fn stop_processes(&mut self) {
        for (_, c) in &mut self.children {
            // SAFETY: kill only signals a child this process started and has not yet reaped.
            unsafe {
                libc::kill(c.id() as libc::pid_t, libc::SIGTERM);
            }
        }
        let until = std::time::Instant::now() + std::time::Duration::from_secs(3);
        for (_, c) in &mut self.children {
            while c.try_wait().ok().flatten().is_none() && std::time::Instant::now() < until {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
        self.children.clear();
        self.register();
    }
}

impl Drop for Emulation {
    fn drop(&mut self) {
        self.stop_processes();
        for ns in self.created.iter().rev() {
            let _ = cmd("ip", &["netns", "del", ns]);
        }
        if let Ok(mut live) = LIVE.lock() {
            live.retain(|(names, _)| !names.iter().any(|n| n.starts_with(&self.prefix)));
        }
    }
}

/// `tc tbf` on `dev` in namespace `ns`.
fn shape(ns: &str, dev: &str, s: Shaping) -> Result<(), BenchError> {
    let rate = format!("{}kbit", (s.rate_mbit * 1000.0).round().max(8.0) as u64);
    let burst = s.burst_bytes.max(u64::from(s.mtu) + 64).to_string();
    let latency = format!("{}ms", s.latency_ms.max(1.0));
    cmd(
        "ip",
        &[
            "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", &rate,
            "burst", &burst, "latency", &latency,
        ],
    )
}

/// Move the calling thread into namespace `ns` (sockets it opens afterwards live there).
pub fn enter(ns: &str) -> Result<(), BenchError> {
    let path = format!("/var/run/netns/{ns}");
    let f = std::fs::File::open(&path).map_err(BenchError::io(format!("cannot open {path}")))?;
    // SAFETY: setns with an open namespace file descriptor changes this thread's network
    // namespace only; the descriptor stays valid for the call.
    let rc = unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) };
    if rc != 0 {
        return Err(BenchError::Setns {
            path,
            cause: std::io::Error::last_os_error(),
        });
    }
    Ok(())
}

/// On Ctrl-C or SIGTERM: kill the processes and delete the namespaces of every live emulation,
/// then exit 130.
pub fn install_signal_cleanup() {
    std::thread::spawn(|| {
        let Ok(rt) = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        else {
            return;
        };
        rt.block_on(async {
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending().await } } => {}
            }
        });
        let live = LIVE.lock().map(|l| l.clone()).unwrap_or_default();
        for (names, pids) in live {
            for pid in pids {
                // SAFETY: kill only signals; these are children this process started.
                unsafe {
                    libc::kill(pid as libc::pid_t, libc::SIGKILL);
                }
            }
            for ns in names.iter().rev() {
                let _ = cmd("ip", &["netns", "del", ns]);
            }
        }
        eprintln!("interrupted: emulated cluster removed");
        std::process::exit(130);
    });
}
