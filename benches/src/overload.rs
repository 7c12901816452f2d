//! The pipelined-clients overload load: many greedy frontends that keep a fixed number of
//! large requests in flight each, plus one modest frontend that sends one small request at a
//! time, against a running router; with the router process's memory read from `/proc`.
//!
//! Why this exists: issue 15 measured that a router under more load than it can serve lost
//! three quarters of its goodput and kept 600–800 MiB of memory after the load. The same load
//! drives the overload test (`tests/it/overload.rs`, real processes) and the figures in
//! BENCHMARKS.md, so the numbers and the assertions come from one generator.
//!
//! What it measures: goodput (tokens of successful answers per second of the whole run), how
//! each answer ended (output, `Overloaded`, `DeadlineExceeded`, other refusals), the modest
//! client's successes, and the peak of the router's resident memory sampled while the load runs.

use expertmesh_router::client::{CallHandle, ClientError, RouterClient};
use expertmesh_transport::codec::ErrorCode;
use expertmesh_transport::frontend::FrontendConfig;
use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The shape of one load run.
#[derive(Clone, Debug)]
pub struct OverloadLoad {
    /// Greedy frontend connections.
    pub greedy_clients: usize,
    /// Requests each greedy connection keeps in flight (it sends the next one as soon as an
    /// answer, of any kind, arrives).
    pub depth: usize,
    /// Tokens of each greedy request.
    pub tokens: usize,
    /// Tokens of the modest client's requests (`0`: no modest client).
    pub modest_tokens: usize,
    /// MoE layer every request calls.
    pub layer: u32,
    /// The model's hidden size.
    pub hidden: usize,
    /// Deadline the greedy requests carry (`None`: the router's default).
    pub deadline: Option<Duration>,
    /// How long the load runs at least.
    pub duration: Duration,
    /// Answers (of any kind) the modest client must have before the load stops: the run goes
    /// on past `duration` until it has them, so a slow or busy machine measures the same
    /// thing as a fast one, only for longer (`0`: stop at `duration`).
    pub modest_answers: u64,
    /// The longest the load runs, whatever the modest client has.
    pub max_duration: Duration,
}

/// When a load run stops: `duration` has passed and the modest client has its answers, or
/// `max_duration` has passed.
#[derive(Debug)]
struct RunClock {
    min_end: Instant,
    max_end: Instant,
    modest_target: u64,
    modest_answers: AtomicU64,
}

impl RunClock {
    fn new(load: &OverloadLoad) -> RunClock {
        let now = Instant::now();
        RunClock {
            min_end: now + load.duration,
            max_end: now + load.max_duration.max(load.duration),
            modest_target: if load.modest_tokens == 0 {
                0
            } else {
                load.modest_answers
            },
            modest_answers: AtomicU64::new(0),
        }
    }

    /// Whether the load is over.
    fn done(&self) -> bool {
        let now = Instant::now();
        now >= self.max_end
            || (now >= self.min_end
                && self.modest_answers.load(Ordering::Relaxed) >= self.modest_target)
    }
}

/// How the requests of one run ended.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LoadReport {
    /// Greedy requests answered with an output.
    pub ok_requests: u64,
    /// Tokens of those answers.
    pub ok_tokens: u64,
    /// Greedy requests refused with `Overloaded`.
    pub overloaded: u64,
    /// Greedy requests failed with `DeadlineExceeded`.
    pub deadline_exceeded: u64,
    /// Greedy requests failed otherwise (another refusal or a broken connection).
    pub other_failures: u64,
    /// The modest client's requests answered with an output.
    pub modest_ok: u64,
    /// The modest client's requests that failed, for any reason.
    pub modest_failed: u64,
    /// The first failure of the modest client, to say why.
    pub modest_first_error: Option<String>,
    /// Wall time of the run, seconds.
    pub seconds: f64,
    /// Peak resident memory of the router process while the load ran (KiB), when a process id
    /// was given.
    pub rss_peak_kib: Option<u64>,
}

impl LoadReport {
    /// Successful tokens per second, greedy and modest clients together.
    pub fn goodput(&self, modest_tokens: usize) -> f64 {
        let tokens = self.ok_tokens + self.modest_ok * modest_tokens as u64;
        tokens as f64 / self.seconds.max(1e-9)
    }
}

/// A process's resident memory from `/proc/<pid>/status`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProcMemory {
    /// `VmRSS`: resident now (KiB).
    pub rss_kib: u64,
    /// `VmHWM`: the peak resident size since the process started (KiB).
    pub hwm_kib: u64,
}

/// Read `VmRSS` and `VmHWM` of process `pid` (`None` off Linux or when it has exited).
pub fn proc_memory(pid: u32) -> Option<ProcMemory> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
    };
    Some(ProcMemory {
        rss_kib: field("VmRSS:")?,
        hwm_kib: field("VmHWM:")?,
    })
}

/// CPU seconds (user + system) that the process whose `/proc` stat file is `stat_path` has
/// used (`None` when it cannot be read: the process has exited, or this is not Linux).
pub fn cpu_seconds_at(stat_path: &str) -> Option<f64> {
    let text = std::fs::read_to_string(stat_path).ok()?;
    // Fields after the command name in parentheses: utime and stime are 14 and 15.
    let rest = text.rsplit_once(')')?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let get = |i: usize| f.get(i).and_then(|x| x.parse::<u64>().ok());
    // SAFETY: sysconf only reads a configuration value.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    Some((get(11)? + get(12)?) as f64 / hz)
}

/// CPU seconds (user + system) used by process `pid` and its live child processes (those
/// `/proc/<pid>/task/*/children` lists; `expertmesh up`'s workers). `None` when `pid` cannot be
/// read, or its children cannot be listed (a kernel without `CONFIG_PROC_CHILDREN`). A rate
/// per CPU second does not move with what else the machine runs, as a rate per wall-clock
/// second does.
pub fn proc_tree_cpu_seconds(pid: u32) -> Option<f64> {
    let mut total = cpu_seconds_at(&format!("/proc/{pid}/stat"))?;
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    for task in tasks.flatten() {
        let children = std::fs::read_to_string(task.path().join("children")).ok()?;
        for child in children.split_whitespace() {
            total += cpu_seconds_at(&format!("/proc/{child}/stat")).unwrap_or(0.0);
        }
    }
    Some(total)
}

/// Shared tallies of the greedy clients.
#[derive(Default)]
struct Tally {
    ok_requests: AtomicU64,
    ok_tokens: AtomicU64,
    overloaded: AtomicU64,
    deadline_exceeded: AtomicU64,
    other: AtomicU64,
}

impl Tally {
    fn count(&self, r: &Result<Vec<f32>, ClientError>, tokens: usize) {
        let c = match r {
            Ok(_) => {
                self.ok_tokens.fetch_add(tokens as u64, Ordering::Relaxed);
                &self.ok_requests
            }
            Err(e) if e.code() == Some(ErrorCode::Overloaded) => &self.overloaded,
            Err(e) if e.code() == Some(ErrorCode::DeadlineExceeded) => &self.deadline_exceeded,
            Err(_) => &self.other,
        };
        c.fetch_add(1, Ordering::Relaxed);
    }
}

/// Deterministic, finite hidden states for `tokens` rows (values in [-1, 1)).
pub fn load_input(tokens: usize, hidden: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..tokens * hidden)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// Run `load` against the router at `addr`, sampling the memory of process `router_pid` every
/// 20 ms while it runs. Each greedy connection keeps `depth` requests in flight and sends the
/// next one as soon as any answer arrives (an `Overloaded` refusal included: the harshest
/// client); the modest client waits for each answer before it sends the next request.
/// Connection failures at the start are errors; later ones are counted as failures.
pub async fn run_load(
    addr: SocketAddr,
    cfg: &FrontendConfig,
    load: &OverloadLoad,
    router_pid: Option<u32>,
) -> Result<LoadReport, ClientError> {
    let tally = Arc::new(Tally::default());
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = router_pid.map(|pid| {
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || {
            let mut peak = 0;
            while !stop.load(Ordering::Relaxed) {
                if let Some(m) = proc_memory(pid) {
                    peak = peak.max(m.rss_kib);
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            peak
        })
    });
    // Every connection is open before any request is sent (a fleet of frontends connected
    // at start), so the router's shares count all of them from the first request.
    let mut clients = Vec::new();
    for _ in 0..load.greedy_clients {
        clients.push(RouterClient::connect(addr, cfg).await?);
    }
    let modest = match load.modest_tokens {
        0 => None,
        _ => Some(RouterClient::connect(addr, cfg).await?),
    };
    let clock = Arc::new(RunClock::new(load));
    let greedy: Vec<_> = clients
        .into_iter()
        .enumerate()
        .map(|(c, client)| {
            let x = load_input(load.tokens, load.hidden, c as u64 + 1);
            let (load, tally, clock) = (load.clone(), Arc::clone(&tally), Arc::clone(&clock));
            tokio::spawn(greedy_client(client, x, load, tally, clock))
        })
        .collect();
    let modest = modest.map(|client| {
        let clock = Arc::clone(&clock);
        tokio::spawn(modest_client(client, load.clone(), clock))
    });
    let start = Instant::now();
    for g in greedy {
        let _ = g.await;
    }
    let (modest_ok, modest_failed, modest_first_error) = match modest {
        Some(m) => m
            .await
            .unwrap_or((0, 1, Some("modest client panicked".into()))),
        None => (0, 0, None),
    };
    let seconds = start.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    let rss_peak_kib = sampler.and_then(|s| s.join().ok());
    Ok(LoadReport {
        ok_requests: tally.ok_requests.load(Ordering::Relaxed),
        ok_tokens: tally.ok_tokens.load(Ordering::Relaxed),
        overloaded: tally.overloaded.load(Ordering::Relaxed),
        deadline_exceeded: tally.deadline_exceeded.load(Ordering::Relaxed),
        other_failures: tally.other.load(Ordering::Relaxed),
        modest_ok,
        modest_failed,
        modest_first_error,
        seconds,
        rss_peak_kib,
    })
}

/// One greedy connection: `depth` requests in flight until the run is over, then every
/// outstanding answer is collected.
async fn greedy_client(
    mut client: RouterClient,
    x: Vec<f32>,
    load: OverloadLoad,
    tally: Arc<Tally>,
    clock: Arc<RunClock>,
) {
    client.set_max_in_flight(load.depth.max(1));
    let mut handles: VecDeque<CallHandle> = VecDeque::new();
    loop {
        while !clock.done() && handles.len() < load.depth.max(1) {
            match client
                .submit(load.layer, &x, load.hidden, None, load.deadline)
                .await
            {
                Ok(h) => handles.push_back(h),
                Err(e) => {
                    // The client's own refusals (a deadline it could not send in time) count
                    // like the router's; a broken connection ends this client.
                    let broken = matches!(e, ClientError::Transport(_));
                    tally.count(&Err(e), load.tokens);
                    if broken {
                        return;
                    }
                }
            }
        }
        let Some(h) = handles.pop_front() else {
            return;
        };
        let r = client.wait(h).await;
        let broken = matches!(r, Err(ClientError::Transport(_)));
        tally.count(&r, load.tokens);
        if broken {
            return;
        }
    }
}

/// The modest connection: one request at a time until the run is over. Returns (successes,
/// failures, the first failure).
async fn modest_client(
    mut client: RouterClient,
    load: OverloadLoad,
    clock: Arc<RunClock>,
) -> (u64, u64, Option<String>) {
    let x = load_input(load.modest_tokens, load.hidden, 999);
    let (mut ok, mut failed, mut first) = (0, 0, None);
    while !clock.done() {
        let answer = client.call(load.layer, &x, load.hidden, None, None).await;
        clock.modest_answers.fetch_add(1, Ordering::Relaxed);
        match answer {
            Ok(_) => ok += 1,
            Err(e) => {
                failed += 1;
                first.get_or_insert_with(|| e.to_string());
                if matches!(e, ClientError::Transport(_)) {
                    break;
                }
            }
        }
    }
    (ok, failed, first)
}
