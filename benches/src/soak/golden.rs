//! Golden answers and the checking client of the fault suite and the soak.
//!
//! Why this exists: under faults the one unforgivable outcome is a call that returns success
//! with a wrong value. In exact mode every answer is bit-identical to the in-process reference
//! whatever device computed it, so each call's input comes with its expected bits ([`Golden`])
//! and every answer is classified ([`Outcome`]): bit-identical, wrong, a clean error (by code),
//! or a hang (no answer by deadline + margin, measured by the client's own clock).

use crate::BenchError;
use expertmesh_cpu_backend::CpuBackend;
use expertmesh_quant::contract::ComputeMode;
use expertmesh_router::client::{ClientError, ClientOptions, RouterClient};
use expertmesh_router::reference;
use expertmesh_topology::model::ModelSpec;
use expertmesh_transport::frontend::FrontendConfig;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// One call with its expected answer.
#[derive(Clone, Debug)]
pub struct Case {
    /// MoE layer.
    pub layer: u32,
    /// Tokens.
    pub tokens: usize,
    /// Hidden states `[tokens][hidden]`.
    pub x: Vec<f32>,
    /// Routed experts of every token (sorted, deduplicated).
    pub experts: Vec<u32>,
    /// Expected output bits.
    pub want: Vec<u32>,
}

/// Inputs and their in-process reference answers (exact mode).
#[derive(Debug)]
pub struct Golden {
    /// Hidden size.
    pub hidden: usize,
    /// The cases.
    pub cases: Vec<Case>,
}

/// A reference for a model and seed: the same synthetic experts the workers load.
pub struct Reference {
    spec: ModelSpec,
    seed: u64,
    backend: CpuBackend,
}

impl Reference {
    /// The reference of `spec` with weights from `seed`.
    pub fn new(spec: &ModelSpec, seed: u64) -> Result<Self, BenchError> {
        let backend =
            expertmesh_worker::weights::reference_backend(spec, seed, &spec.moe_layer_ids(), 1, 64)
                .map_err(BenchError::GoldenBackend)?;
        Ok(Self {
            spec: spec.clone(),
            seed,
            backend,
        })
    }

    /// The case for `x` on `layer`.
    pub fn case(&mut self, layer: u32, x: Vec<f32>) -> Result<Case, BenchError> {
        let h = self.spec.hidden as usize;
        let gate = reference::synthetic_gate(&self.spec, self.seed, layer);
        let (routing, out) = reference::moe_layer_backend(
            &self.spec,
            &gate,
            layer,
            &mut self.backend,
            &x,
            ComputeMode::Exact,
        )
        .map_err(BenchError::GoldenLayer)?;
        let mut experts = routing.experts.clone();
        experts.sort_unstable();
        experts.dedup();
        Ok(Case {
            layer,
            tokens: x.len() / h,
            x,
            experts,
            want: out.iter().map(|v| v.to_bits()).collect(),
        })
    }

    /// `n` cases spread over the MoE layers and `token_counts`, inputs from `salt`.
    pub fn golden(
        &mut self,
        n: usize,
        token_counts: &[usize],
        salt: u64,
    ) -> Result<Golden, BenchError> {
        let layers = self.spec.moe_layer_ids();
        let h = self.spec.hidden as usize;
        let mut cases = Vec::with_capacity(n);
        for i in 0..n {
            let layer = layers[i % layers.len()];
            let t = token_counts[(i / layers.len()) % token_counts.len()];
            let x = reference::synthetic_hidden(salt.wrapping_mul(1_000_003) + i as u64, t, h);
            cases.push(self.case(layer, x)?);
        }
        Ok(Golden { hidden: h, cases })
    }

    /// `n` one-token cases whose routed experts all satisfy `keep` (inputs drawn from `salt`
    /// until enough qualify; at most 200 draws per case).
    pub fn confined(
        &mut self,
        n: usize,
        salt: u64,
        keep: impl Fn(u32) -> bool,
    ) -> Result<Golden, BenchError> {
        let layers = self.spec.moe_layer_ids();
        let h = self.spec.hidden as usize;
        let mut cases = Vec::with_capacity(n);
        let mut draw = 0u64;
        while cases.len() < n {
            if draw >= 200 * n as u64 {
                return Err(BenchError::NotConfined {
                    found: cases.len(),
                    wanted: n,
                });
            }
            let layer = layers[draw as usize % layers.len()];
            let x = reference::synthetic_hidden(salt.wrapping_mul(7_919) + draw, 1, h);
            draw += 1;
            let c = self.case(layer, x)?;
            if c.experts.iter().all(|&e| keep(e)) {
                cases.push(c);
            }
        }
        Ok(Golden { hidden: h, cases })
    }
}

/// Expert ids of a placement range string ("0-15,24-31").
pub(crate) fn parse_experts(s: &str) -> Vec<u32> {
    let mut out = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                if let (Ok(a), Ok(b)) = (a.parse::<u32>(), b.parse::<u32>()) {
                    out.extend(a..=b);
                }
            }
            None => out.extend(part.parse::<u32>().ok()),
        }
    }
    out
}

/// How one call ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Bit-identical to the reference.
    Ok,
    /// Returned as success with other bits.
    Wrong,
    /// A clean error: the router's code ("PeerUnavailable") or "connection" / "connect".
    Error(String),
    /// No answer by deadline + margin (the client gave up on its own).
    Hang,
}

/// One call as a client saw it.
#[derive(Clone, Debug)]
pub struct CallRecord {
    /// Which client.
    pub client: usize,
    /// Index of the case.
    pub case: usize,
    /// When it was sent.
    pub start: Instant,
    /// How long until it ended.
    pub latency: Duration,
    /// How it ended.
    pub outcome: Outcome,
    /// The error message, for errors.
    pub message: String,
}

/// What a checking client does.
#[derive(Clone, Debug)]
pub struct DriveOptions {
    /// Routers to use, in order of preference: a client reconnects to the next one when its
    /// connection fails.
    pub routers: Vec<SocketAddr>,
    /// Handshake settings.
    pub frontend: FrontendConfig,
    /// Namespace to run in (`None`: this one).
    pub namespace: Option<String>,
    /// Deadline of every call.
    pub deadline: Duration,
    /// Past deadline + margin the client stops waiting and counts a hang.
    pub margin: Duration,
    /// Pause after a failed connect (so a router that is down is not hammered).
    pub reconnect_pause: Duration,
    /// Pause between calls.
    pub think: Duration,
    /// One failover client over every router (`RouterClient::connect_any`: it moves to the
    /// next router by itself) instead of a plain client per router that this driver replaces
    /// when its connection breaks.
    pub failover: bool,
}

/// A client that calls until `stop` is set, cycling through `golden`'s cases from `first`,
/// checking every answer. Returns every call.
pub fn drive(
    id: usize,
    opts: &DriveOptions,
    golden: &Golden,
    first: usize,
    stop: &AtomicBool,
) -> Vec<CallRecord> {
    drive_until(id, opts, golden, first, &|_| stop.load(Ordering::Relaxed))
}

/// [`drive`] until `done(the calls so far)` says so (asked before each call).
pub fn drive_until(
    id: usize,
    opts: &DriveOptions,
    golden: &Golden,
    first: usize,
    done: &dyn Fn(&[CallRecord]) -> bool,
) -> Vec<CallRecord> {
    let mut out = Vec::new();
    if let Some(ns) = &opts.namespace
        && let Err(e) = crate::cluster::netns::enter(ns)
    {
        out.push(error_record(
            id,
            0,
            Instant::now(),
            "connect",
            e.to_string(),
        ));
        return out;
    }
    let Ok(rt) = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    else {
        return out;
    };
    let mut client: Option<RouterClient> = None;
    let mut router = 0usize;
    let mut i = first;
    while !done(&out) {
        let case_ix = i % golden.cases.len();
        let case = &golden.cases[case_ix];
        let start = Instant::now();
        if client.is_none() {
            match connect(&rt, opts, router) {
                Ok(c) => client = Some(c),
                Err((outcome, message)) => {
                    let hang = outcome == Outcome::Hang;
                    out.push(CallRecord {
                        outcome,
                        ..error_record(id, case_ix, start, "connect", message)
                    });
                    router += 1;
                    if !hang {
                        std::thread::sleep(opts.reconnect_pause);
                    }
                    continue;
                }
            }
        }
        let c = client.as_mut().expect("connected above");
        let call = c.call(
            case.layer,
            &case.x,
            golden.hidden,
            None,
            Some(opts.deadline),
        );
        let limit = opts.deadline + opts.margin;
        let res = rt.block_on(async { tokio::time::timeout(limit, call).await });
        let latency = start.elapsed();
        let (outcome, message) = match res {
            Ok(Ok(got))
                if got.len() == case.want.len()
                    && got.iter().zip(&case.want).all(|(g, w)| g.to_bits() == *w) =>
            {
                (Outcome::Ok, String::new())
            }
            Ok(Ok(_)) => (Outcome::Wrong, String::new()),
            Ok(Err(e)) => {
                let code = error_kind(&e);
                if code == "connection" {
                    client = None;
                    router += 1;
                }
                (Outcome::Error(code), e.to_string())
            }
            Err(_) => {
                client = None;
                router += 1;
                (Outcome::Hang, "no answer by deadline + margin".to_string())
            }
        };
        out.push(CallRecord {
            client: id,
            case: case_ix,
            start,
            latency,
            outcome,
            message,
        });
        i += 1;
        if !opts.think.is_zero() {
            std::thread::sleep(opts.think);
        }
    }
    out
}

/// A client for router `router` (modulo the list), or a failover client over all of them;
/// or how connecting ended: a clean error, or a hang (no end by deadline + margin).
fn connect(
    rt: &tokio::runtime::Runtime,
    opts: &DriveOptions,
    router: usize,
) -> Result<RouterClient, (Outcome, String)> {
    let addr = opts.routers[router % opts.routers.len()];
    let limit = opts.deadline + opts.margin;
    let connected = rt.block_on(async {
        if opts.failover {
            let o = ClientOptions {
                default_deadline: opts.deadline,
                ..ClientOptions::default()
            };
            let connect = RouterClient::connect_any(&opts.routers, &opts.frontend, o);
            tokio::time::timeout(limit, connect).await
        } else {
            let connect = RouterClient::connect(addr, &opts.frontend);
            tokio::time::timeout(limit, connect).await
        }
    });
    match connected {
        Ok(Ok(c)) => Ok(c),
        Ok(Err(e)) => Err((Outcome::Error("connect".into()), e.to_string())),
        Err(_) => Err((Outcome::Hang, format!("connect to {addr} did not finish"))),
    }
}

/// The router's error code, or "connection" for a broken connection, or the error kind.
pub fn error_kind(e: &ClientError) -> String {
    match e.code() {
        Some(code) => format!("{code:?}"),
        None => match e {
            ClientError::Transport(_) => "connection".to_string(),
            other => {
                let s = other.to_string();
                if s.to_ascii_lowercase().contains("deadline") {
                    "DeadlineExceeded".to_string()
                } else {
                    s.split(':').next().unwrap_or("error").to_string()
                }
            }
        },
    }
}

fn error_record(id: usize, case: usize, start: Instant, kind: &str, message: String) -> CallRecord {
    CallRecord {
        client: id,
        case,
        start,
        latency: start.elapsed(),
        outcome: Outcome::Error(kind.to_string()),
        message,
    }
}

/// Counts over a set of calls.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Tally {
    /// Calls (connect attempts that failed included).
    pub calls: usize,
    /// Bit-identical answers.
    pub ok: usize,
    /// Answers marked success with wrong values.
    pub wrong: usize,
    /// Calls with no answer by deadline + margin.
    pub hangs: usize,
    /// Clean errors by code.
    pub errors: std::collections::BTreeMap<String, usize>,
}

impl Tally {
    /// Count `records`.
    pub fn of<'a>(records: impl IntoIterator<Item = &'a CallRecord>) -> Self {
        let mut t = Tally::default();
        for r in records {
            t.calls += 1;
            match &r.outcome {
                Outcome::Ok => t.ok += 1,
                Outcome::Wrong => t.wrong += 1,
                Outcome::Hang => t.hangs += 1,
                Outcome::Error(code) => *t.errors.entry(code.clone()).or_insert(0) += 1,
            }
        }
        t
    }

    /// Clean errors of every code.
    pub fn error_count(&self) -> usize {
        self.errors.values().sum()
    }
}

/// Latency percentile `p` (0-100) of the successful calls among `records`, seconds.
pub fn ok_latency_percentile<'a>(records: impl IntoIterator<Item = &'a CallRecord>, p: f64) -> f64 {
    let mut v: Vec<f64> = records
        .into_iter()
        .filter(|r| r.outcome == Outcome::Ok)
        .map(|r| r.latency.as_secs_f64())
        .collect();
    v.sort_by(f64::total_cmp);
    crate::method::stats::percentile(&v, p)
}

/// Start `n` checking clients on threads; `stop` ends them. Join with [`join_clients`].
pub fn spawn_clients(
    n: usize,
    opts: &DriveOptions,
    golden: &Arc<Golden>,
    stop: &Arc<AtomicBool>,
) -> Vec<std::thread::JoinHandle<Vec<CallRecord>>> {
    let stop = Arc::clone(stop);
    spawn_clients_until(n, opts, golden, move |_| stop.load(Ordering::Relaxed))
}

/// [`spawn_clients`], each client calling until `done(its calls so far)` says so (asked
/// before each call).
pub fn spawn_clients_until(
    n: usize,
    opts: &DriveOptions,
    golden: &Arc<Golden>,
    done: impl Fn(&[CallRecord]) -> bool + Clone + Send + 'static,
) -> Vec<std::thread::JoinHandle<Vec<CallRecord>>> {
    (0..n)
        .map(|id| {
            let (mut o, golden, done) = (opts.clone(), Arc::clone(golden), done.clone());
            // Spread the clients over the routers.
            let n = o.routers.len();
            if n > 1 && !o.failover {
                o.routers.rotate_left(id % n);
            }
            std::thread::spawn(move || drive_until(id, &o, &golden, id * 7, &done))
        })
        .collect()
}

/// Every call of the clients, in start order.
pub fn join_clients(handles: Vec<std::thread::JoinHandle<Vec<CallRecord>>>) -> Vec<CallRecord> {
    let mut all: Vec<CallRecord> = handles
        .into_iter()
        .flat_map(|h| h.join().unwrap_or_default())
        .collect();
    all.sort_by_key(|r| r.start);
    all
}
