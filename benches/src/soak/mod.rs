//! `expertmesh bench soak`: a small multi-process fabric under continuous checked load with a
//! random fault about once a minute; reports what every call got and how fast the fabric came
//! back after each fault.
//!
//! Why this exists: correctness under faults (issue 16) is a property of hours, not of one
//! scripted test: a soak finds the interleavings the fault suite (`tests/it/faults.rs`) does not
//! script. The fabric is demo-small in exact mode (every answer has golden bits: see
//! [`golden`]) on three CPU workers, every expert on two of them (any one worker may fail),
//! one router (or `--routers N`), each process a separate child ([`cluster`]); with root and
//! `ip netns` the workers and the router run in network namespaces, so partitions (iptables
//! DROP, both ways and one way) and slow links (tc tbf) join the faults.
//!
//! Faults: kill a worker and restart it; SIGSTOP a worker for 5 s; kill and restart the router;
//! SIGSTOP the router for 3 s (clients must get DeadlineExceeded, not hang); with namespaces a
//! 25 s partition (either direction) and a 10 s link throttled to 256 kbit/s. Reported: calls, bit-identical
//! answers, clean errors by code, wrong answers (must be 0), hangs (no answer by deadline +
//! margin on the client's own clock; must be 0), per fault the time from its end to the next
//! success on the experts it touched (`recovery_s`) and to the router logging the worker
//! joined again (`rejoin_s`, where the link was lost), and every process's RSS at start and end.
//! Exit code 1 when any answer was wrong or any call hung.

pub mod cluster;
pub mod golden;

use crate::BenchError;
use crate::method::json::{BenchReport, BenchResult};
use cluster::{Cut, FaultCluster, FaultClusterOptions};
use expertmesh_transport::frontend::FrontendConfig;
use golden::{CallRecord, DriveOptions, Outcome, Reference, Tally};
use serde::Serialize;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// How long a partition lasts, s: past the 5 s idle timeout, so the links are declared dead
/// and redialed while it lasts.
const PARTITION_S: f64 = 25.0;

/// The soak's placement: three workers, every expert of demo-small on two of them.
pub(crate) const SOAK_PLACEMENT: [&str; 3] = ["0-15,24-31", "8-31", "0-7,16-23"];

/// Namespaces or loopback.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NetMode {
    /// Namespaces when permitted, else loopback (said in the output).
    Auto,
    /// Network namespaces (fails without root / `ip netns`).
    Namespaces,
    /// Loopback only (no partitions, no slow links).
    Loopback,
}

impl NetMode {
    /// Every network mode, as `--net` lists them.
    pub const ALL: [NetMode; 3] = [NetMode::Auto, NetMode::Namespaces, NetMode::Loopback];

    /// The name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Namespaces => "namespaces",
            Self::Loopback => "loopback",
        }
    }
}

impl std::str::FromStr for NetMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| format!("unknown network mode {s:?}: give auto, namespaces or loopback"))
    }
}

/// How a soak runs (`bench soak`'s options; [`SoakOptions::default`] is its defaults).
#[derive(Debug, Clone)]
pub struct SoakOptions {
    /// Length of the run in minutes (fractions allowed, e.g. 0.5).
    pub minutes: f64,
    /// Seed of the fault schedule (which fault, which target, when).
    pub seed: u64,
    /// Seconds between faults (each ±20%).
    pub fault_every_s: f64,
    /// Checking clients.
    pub clients: usize,
    /// Router processes; with more than one every client is a failover client over all of
    /// them (`RouterClient::connect_any`).
    pub routers: usize,
    /// Deadline of every call, ms.
    pub deadline_ms: u64,
    /// A call with no answer by deadline + this is a hang, ms.
    pub hang_margin_ms: u64,
    /// Network: namespaces (partitions, slow links) or loopback.
    pub net: NetMode,
    /// Folder for the fabric's files and logs, kept (default: a temporary folder, removed).
    pub dir: Option<PathBuf>,
}

impl Default for SoakOptions {
    fn default() -> Self {
        Self {
            minutes: 10.0,
            seed: 1,
            fault_every_s: 60.0,
            clients: 3,
            routers: 1,
            deadline_ms: 2000,
            hang_margin_ms: 2000,
            net: NetMode::Auto,
            dir: None,
        }
    }
}

impl SoakOptions {
    /// Refuses options a soak cannot run with, naming the option.
    pub fn check(&self) -> Result<(), BenchError> {
        if !(self.minutes > 0.0 && self.minutes <= 24.0 * 60.0) {
            return Err(BenchError::Options("--minutes must be in (0, 1440]".into()));
        }
        if !(1.0..=86_400.0).contains(&self.fault_every_s) || self.clients == 0 || self.routers == 0
        {
            return Err(BenchError::Options(
                "--fault-every-s must be in [1, 86400] (a day), --clients and --routers at least 1"
                    .into(),
            ));
        }
        Ok(())
    }
}

/// What kind of fault.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum FaultKind {
    /// SIGKILL a worker, start it again.
    WorkerKill,
    /// SIGSTOP a worker for 5 s.
    WorkerPause,
    /// SIGKILL the router, start it again.
    RouterRestart,
    /// SIGSTOP the router for 3 s.
    RouterPause,
    /// Drop everything in and out of a worker's namespace for 25 s.
    Partition,
    /// Drop the worker's packets to the routers for 25 s.
    OneWayPartition,
    /// A worker's sends throttled to 256 kbit/s for 10 s (its answers arrive late).
    SlowLink,
}

/// One injected fault and how the fabric came back.
#[derive(Clone, Debug, Serialize)]
pub struct FaultRecord {
    /// Which.
    pub kind: FaultKind,
    /// "cpu1", "router-0".
    pub target: String,
    /// Seconds from the start of the load to the fault.
    pub at_s: f64,
    /// How long the fault lasted, s (a restart: until the new process was ready).
    pub duration_s: f64,
    /// From the fault's end to the next bit-identical answer that needed the target's
    /// experts (all experts for a router), s.
    pub recovery_s: Option<f64>,
    /// From the fault's end to every router logging the worker joined again (faults that
    /// drop the link), or to the restarted router having every worker, s.
    pub rejoin_s: Option<f64>,
    /// Anything that went wrong injecting it.
    pub note: String,
    #[serde(skip)]
    end: Option<Instant>,
    #[serde(skip)]
    experts: Vec<u32>,
}

/// RSS of one process.
#[derive(Clone, Debug, Serialize)]
pub struct RssRecord {
    /// "router-0", "cpu1".
    pub process: String,
    /// At the start of the load, kB.
    pub start_kb: Option<u64>,
    /// At the end, kB (the process may be a restarted one).
    pub end_kb: Option<u64>,
}

/// The whole soak.
#[derive(Clone, Debug, Serialize)]
pub struct SoakReport {
    /// Seconds of load.
    pub seconds: f64,
    /// Namespaces or loopback.
    pub network: String,
    /// Fault schedule seed.
    pub seed: u64,
    /// Counts over every call.
    pub tally: Tally,
    /// p50/p99 latency of the bit-identical answers, s.
    pub ok_latency_p50_s: f64,
    /// See `ok_latency_p50_s`.
    pub ok_latency_p99_s: f64,
    /// Every fault.
    pub faults: Vec<FaultRecord>,
    /// RSS per process.
    pub rss: Vec<RssRecord>,
    /// Up to 10 messages of wrong or hung calls, to start from.
    pub examples: Vec<String>,
}

impl SoakReport {
    /// Whether the run passed: nothing wrong, nothing hung.
    pub fn passed(&self) -> bool {
        self.tally.wrong == 0 && self.tally.hangs == 0
    }

    /// A readable summary.
    pub fn summary(&self) -> String {
        let t = &self.tally;
        let mut s = format!(
            "soak: {:.0} s on {} ({} faults, seed {})\n  calls {}  bit-identical {}  clean errors {} {:?}  wrong {}  hangs {}\n  latency of good answers p50 {:.1} ms p99 {:.1} ms\n",
            self.seconds,
            self.network,
            self.faults.len(),
            self.seed,
            t.calls,
            t.ok,
            t.error_count(),
            t.errors,
            t.wrong,
            t.hangs,
            self.ok_latency_p50_s * 1e3,
            self.ok_latency_p99_s * 1e3
        );
        let show = |v: Option<f64>| v.map_or("-".to_string(), |x| format!("{x:.3} s"));
        for f in &self.faults {
            s.push_str(&format!(
                "  at {:>6.1} s {:<17} {:<8} lasted {:>5.2} s  recovery {:>9}  rejoin {:>9} {}\n",
                f.at_s,
                format!("{:?}", f.kind),
                f.target,
                f.duration_s,
                show(f.recovery_s),
                show(f.rejoin_s),
                f.note
            ));
        }
        for r in &self.rss {
            s.push_str(&format!(
                "  rss {:<9} start {:>7} kB  end {:>7} kB\n",
                r.process,
                r.start_kb.map_or("-".into(), |v| v.to_string()),
                r.end_kb.map_or("-".into(), |v| v.to_string())
            ));
        }
        for e in &self.examples {
            s.push_str(&format!("  example: {e}\n"));
        }
        s.push_str(if self.passed() {
            "PASS: 0 wrong answers, 0 hangs\n"
        } else {
            "FAIL: wrong answers or hung calls (see above)\n"
        });
        s
    }

    /// The bench JSON: ratios for the headline figures, everything under machine.soak.
    pub fn bench_report(&self) -> BenchReport {
        let t = &self.tally;
        let mut report = BenchReport::new();
        report.machine.extra.insert(
            "soak".into(),
            serde_json::to_value(self).unwrap_or(serde_json::Value::Null),
        );
        report.results.push(
            BenchResult::new(
                "soak_bit_identical_calls",
                1,
                t.ok as f64,
                t.calls as f64,
                "calls",
            )
            .with("limit_is", "all calls")
            .with("wrong", t.wrong as u64)
            .with("hangs", t.hangs as u64),
        );
        let worst = |kinds: &[FaultKind], rejoin: bool| {
            self.faults
                .iter()
                .filter(|f| kinds.contains(&f.kind))
                .filter_map(|f| if rejoin { f.rejoin_s } else { f.recovery_s })
                .fold(None, |m: Option<f64>, v| Some(m.map_or(v, |m| m.max(v))))
        };
        let worker = [FaultKind::WorkerKill, FaultKind::WorkerPause];
        let part = [FaultKind::Partition, FaultKind::OneWayPartition];
        for (name, kinds, bound, rejoin) in [
            (
                "soak_worst_recovery_after_worker_fault",
                &worker[..],
                1.0,
                false,
            ),
            (
                "soak_worst_rejoin_after_worker_fault",
                &worker[..],
                1.0,
                true,
            ),
            (
                "soak_worst_rejoin_after_partition_heals",
                &part[..],
                2.0,
                true,
            ),
        ] {
            if let Some(v) = worst(kinds, rejoin) {
                report.results.push(
                    // A bound the run must stay under, not a floor it cannot pass.
                    BenchResult::new(name, 1, v, bound, "s")
                        .with("limit_is", "issue 16 bound")
                        .against_reference(),
                );
            }
        }
        report
    }
}

/// A small deterministic generator for the fault schedule.
struct Xorshift(u64);

impl Xorshift {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Start the fabric, load it, inject faults for `soak.minutes`, report.
pub fn run(soak: &SoakOptions) -> Result<SoakReport, BenchError> {
    let namespaces = match soak.net {
        NetMode::Loopback => false,
        NetMode::Namespaces => true,
        NetMode::Auto => match cluster::namespaces_permitted() {
            Ok(()) => true,
            Err(why) => {
                println!(
                    "network namespaces not permitted ({why}): loopback, no partitions or slow links"
                );
                false
            }
        },
    };
    let (_tmp, dir) = match &soak.dir {
        Some(d) => (None, d.clone()),
        None => {
            let t = tempfile::Builder::new()
                .prefix("expertmesh-soak-")
                .tempdir()?;
            let p = t.path().to_path_buf();
            (Some(t), p)
        }
    };
    let exe = std::env::current_exe().map_err(BenchError::io("finding the expertmesh binary"))?;
    let mut opts = FaultClusterOptions::new(exe, &dir, &SOAK_PLACEMENT);
    opts.routers = soak.routers;
    opts.namespaces = namespaces;
    let spec = expertmesh_topology::model::preset_by_name(&opts.model)
        .ok_or_else(|| BenchError::NoPreset(opts.model.clone()))?;
    println!(
        "soak: computing golden answers, starting the fabric in {}",
        dir.display()
    );
    let golden = Arc::new(Reference::new(&spec, opts.seed)?.golden(96, &[1, 4, 16], 1)?);
    let mut fabric = FaultCluster::start(opts)?;
    let drive = DriveOptions {
        routers: (0..soak.routers).map(|i| fabric.frontend_addr(i)).collect(),
        frontend: FrontendConfig::new("faults"),
        namespace: fabric.client_namespace(),
        deadline: Duration::from_millis(soak.deadline_ms),
        margin: Duration::from_millis(soak.hang_margin_ms),
        reconnect_pause: Duration::from_millis(50),
        think: Duration::ZERO,
        failover: soak.routers > 1,
    };
    let rss_start: Vec<(String, Option<u64>)> = fabric
        .processes()
        .into_iter()
        .map(|(n, pid)| (n, cluster::rss_kb(pid)))
        .collect();
    let stop = Arc::new(AtomicBool::new(false));
    let t0 = Instant::now();
    let clients = golden::spawn_clients(soak.clients, &drive, &golden, &stop);
    let total = Duration::from_secs_f64(soak.minutes * 60.0);
    let faults = inject_faults(&mut fabric, soak, t0, total);
    stop.store(true, Ordering::Relaxed);
    let records = golden::join_clients(clients);
    let seconds = t0.elapsed().as_secs_f64();
    let rss: Vec<RssRecord> = rss_start
        .into_iter()
        .map(|(process, start_kb)| {
            let end_kb = fabric
                .processes()
                .into_iter()
                .find(|(n, _)| *n == process)
                .and_then(|(_, pid)| cluster::rss_kb(pid));
            RssRecord {
                process,
                start_kb,
                end_kb,
            }
        })
        .collect();
    Ok(build_report(
        soak, namespaces, seconds, t0, faults, rss, &records, &golden,
    ))
}

/// The report of a finished run.
#[allow(clippy::too_many_arguments)] // the run's parts, gathered once at its end
fn build_report(
    opts: &SoakOptions,
    namespaces: bool,
    seconds: f64,
    t0: Instant,
    faults: Vec<FaultRecord>,
    rss: Vec<RssRecord>,
    records: &[CallRecord],
    golden: &golden::Golden,
) -> SoakReport {
    let faults = faults
        .into_iter()
        .map(|f| with_recovery(f, records, golden))
        .collect();
    SoakReport {
        seconds,
        network: if namespaces { "namespaces" } else { "loopback" }.into(),
        seed: opts.seed,
        tally: Tally::of(records),
        ok_latency_p50_s: golden::ok_latency_percentile(records, 50.0),
        ok_latency_p99_s: golden::ok_latency_percentile(records, 99.0),
        faults,
        rss,
        examples: records
            .iter()
            .filter(|r| matches!(r.outcome, Outcome::Wrong | Outcome::Hang))
            .take(10)
            .map(|r| {
                format!(
                    "client {} case {} at {:.2} s: {:?} after {:.2} s {}",
                    r.client,
                    r.case,
                    r.start.duration_since(t0).as_secs_f64(),
                    r.outcome,
                    r.latency.as_secs_f64(),
                    r.message
                )
            })
            .collect(),
    }
}

/// The fault loop (this thread: children are started from it, so their parent-death signal
/// stays armed until the run ends).
fn inject_faults(
    fabric: &mut FaultCluster,
    opts: &SoakOptions,
    t0: Instant,
    total: Duration,
) -> Vec<FaultRecord> {
    let mut rng = Xorshift(opts.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let mut kinds = vec![
        FaultKind::WorkerKill,
        FaultKind::WorkerPause,
        FaultKind::RouterRestart,
        FaultKind::RouterPause,
    ];
    if fabric.has_namespaces() {
        kinds.extend([
            FaultKind::Partition,
            FaultKind::OneWayPartition,
            FaultKind::SlowLink,
        ]);
    }
    // Room a fault needs to end before the run does (a partition lasts longest).
    let room = if fabric.has_namespaces() {
        Duration::from_secs_f64(PARTITION_S + 2.0)
    } else {
        Duration::from_secs(12)
    };
    let mut out = Vec::new();
    let every = opts.fault_every_s;
    let mut next = every * (0.5 + 0.2 * rng.unit());
    loop {
        let wait_until = t0 + Duration::from_secs_f64(next);
        // A fault needs room to end before the run does.
        if wait_until + room > t0 + total {
            break;
        }
        std::thread::sleep(wait_until.saturating_duration_since(Instant::now()));
        let kind = kinds[rng.below(kinds.len())];
        let target = match kind {
            FaultKind::RouterRestart | FaultKind::RouterPause => rng.below(opts.routers),
            _ => rng.below(fabric.devices()),
        };
        let rec = inject_one(fabric, kind, target, t0);
        println!(
            "  fault at {:.1} s: {:?} {} ({:.2} s){}",
            rec.at_s,
            rec.kind,
            rec.target,
            rec.duration_s,
            if rec.note.is_empty() {
                String::new()
            } else {
                format!(": {}", rec.note)
            }
        );
        out.push(rec);
        next += every * (0.8 + 0.4 * rng.unit());
    }
    std::thread::sleep((t0 + total).saturating_duration_since(Instant::now()));
    out
}

/// Inject one fault, wait for its end, measure the rejoin.
fn inject_one(
    fabric: &mut FaultCluster,
    kind: FaultKind,
    target: usize,
    t0: Instant,
) -> FaultRecord {
    let start = Instant::now();
    let worker_fault = !matches!(kind, FaultKind::RouterRestart | FaultKind::RouterPause);
    let name = if worker_fault {
        format!("cpu{target}")
    } else {
        format!("router-{target}")
    };
    let experts = if worker_fault {
        golden::parse_experts(fabric.experts_of(target))
    } else {
        Vec::new()
    };
    let joins = if worker_fault {
        fabric.joins_all(target)
    } else {
        Vec::new()
    };
    let (result, end) = match kind {
        FaultKind::WorkerKill => {
            fabric.kill_worker(target);
            std::thread::sleep(Duration::from_millis(500));
            let r = fabric.start_worker(target);
            let end = r.as_ref().map_or_else(|_| Instant::now(), |t| *t);
            (r.map(|_| ()), end)
        }
        FaultKind::WorkerPause => timed(fabric, 5.0, |f, on| f.pause_worker(target, on)),
        FaultKind::RouterRestart => {
            fabric.kill_router(target);
            let r = fabric.start_router(target);
            (r, Instant::now())
        }
        FaultKind::RouterPause => timed(fabric, 3.0, |f, on| f.pause_router(target, on)),
        FaultKind::Partition | FaultKind::OneWayPartition => {
            let cut = if kind == FaultKind::Partition {
                Cut::BothWays
            } else {
                Cut::WorkerToRouter
            };
            timed(fabric, PARTITION_S, |f, on| {
                if on {
                    f.partition(target, cut)
                } else {
                    f.heal(target)
                }
            })
        }
        FaultKind::SlowLink => timed(fabric, 10.0, |f, on| f.slow_link(target, on.then_some(256))),
    };
    let mut note = result.err().map(|e| format!("{e:#}")).unwrap_or_default();
    let rejoin_s = match kind {
        FaultKind::RouterRestart => {
            let zero = vec![0; fabric.joins_all(0).len()];
            let mut last = Ok(end);
            for d in 0..fabric.devices() {
                last = fabric.wait_joined_all(d, &zero, Duration::from_secs(30));
                if last.is_err() {
                    break;
                }
            }
            match last {
                Ok(t) => Some(t.saturating_duration_since(end).as_secs_f64()),
                Err(e) => {
                    note.push_str(&format!("not every worker rejoined: {e:#}"));
                    None
                }
            }
        }
        FaultKind::RouterPause => None,
        _ => worker_rejoin(fabric, target, &joins, kind, end, &mut note),
    };
    FaultRecord {
        kind,
        target: name,
        at_s: start.duration_since(t0).as_secs_f64(),
        duration_s: end.duration_since(start).as_secs_f64(),
        recovery_s: None,
        rejoin_s,
        note,
        end: Some(end),
        experts,
    }
}

/// Apply a fault (`on` = true), hold it `seconds`, undo it; (result, end).
fn timed(
    fabric: &mut FaultCluster,
    seconds: f64,
    mut f: impl FnMut(&mut FaultCluster, bool) -> Result<(), BenchError>,
) -> (Result<(), BenchError>, Instant) {
    if let Err(e) = f(fabric, true) {
        return (Err(e), Instant::now());
    }
    std::thread::sleep(Duration::from_secs_f64(seconds));
    let r = f(fabric, false);
    (r, Instant::now())
}

/// Seconds from `end` until every router logged worker `d` joined again: faults that always
/// drop the link wait up to 30 s (and say so when it did not come back); pauses and slow
/// links only count a rejoin seen within 5 s (the link may have been kept).
fn worker_rejoin(
    fabric: &FaultCluster,
    d: usize,
    before: &[usize],
    kind: FaultKind,
    end: Instant,
    note: &mut String,
) -> Option<f64> {
    let must = matches!(
        kind,
        FaultKind::WorkerKill | FaultKind::Partition | FaultKind::OneWayPartition
    );
    let wait = if must { 30 } else { 5 };
    match fabric.wait_joined_all(d, before, Duration::from_secs(wait)) {
        Ok(t) => Some(t.saturating_duration_since(end).as_secs_f64()),
        Err(_) if !must => None,
        Err(e) => {
            let first = format!("{e:#}");
            note.push_str(&format!(
                "did not rejoin within {wait} s: {}",
                first.lines().next().unwrap_or("")
            ));
            None
        }
    }
}

/// Fill in `recovery_s`: from the fault's end to the end of the first bit-identical answer
/// sent after it that needed the fault's experts (any call for a router fault).
fn with_recovery(
    mut f: FaultRecord,
    records: &[CallRecord],
    golden: &golden::Golden,
) -> FaultRecord {
    let Some(end) = f.end else { return f };
    f.recovery_s = records
        .iter()
        .filter(|r| r.start >= end && r.outcome == Outcome::Ok)
        .find(|r| {
            f.experts.is_empty()
                || golden.cases[r.case]
                    .experts
                    .iter()
                    .any(|e| f.experts.contains(e))
        })
        .map(|r| (r.start + r.latency).duration_since(end).as_secs_f64());
    f
}
