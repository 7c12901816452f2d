//! Prometheus metrics of a router: the operator's view of its traffic.
//!
//! Why this exists: an operator must see what a router does without reading logs: requests and
//! tokens per layer, latency end to end and per stage, errors by code, hedges, the load each
//! device and each expert gets, and the bytes on each link. [`RouterMetrics`] keeps those
//! figures; [`http::MetricsServer`] serves them on `GET /metrics`; the fabric's `--load-stats`
//! writer turns the per-expert counts into the planner's load file.
//!
//! Exporter: `prometheus-client`, the Prometheus project's Rust client, provides the
//! histogram type and the text exposition format. It is used as a library of encoders, not
//! as a global registry: several routers can run in one process (`expertmesh up` with
//! several `[[router]]` tables, the tests' launcher) and each must report its own figures, so
//! every router owns its metrics and its endpoint. (`metrics-exporter-prometheus` was not
//! used: it routes every update through a process-wide recorder keyed by name and labels.)
//!
//! Hot-path cost: counters are preallocated slots (per layer, per (layer, expert), per mesh
//! rank, per error code) updated with one relaxed atomic add each; a latency is one histogram
//! observe (a short uncontended lock, never held across an await); nothing allocates.
//! Everything else (the core's [`RouterStats`]: hedges, batches, responses) is read at
//! scrape time from the snapshot the service publishes anyway.
//!
//! Series (text format 0.0.4; counters end in `_total`):
//!
//! | series | labels | what |
//! | --- | --- | --- |
//! | `expertmesh_router_requests_total` | `layer` | requests the core batched and dispatched |
//! | `expertmesh_router_tokens_total` | `layer` | tokens of those requests |
//! | `expertmesh_router_responses_total` | | requests answered with an output |
//! | `expertmesh_router_errors_total` | `code` | requests answered with an error (refused at the door or failed in the core) |
//! | `expertmesh_router_request_duration_seconds` | | histogram: a request's batch opening to its answer (end to end in the router) |
//! | `expertmesh_router_stage_duration_seconds` | `stage` | histogram: `queue` (batch window), `dispatch` (gate, quantize, plan, encode), `compute` (a part's round trip to its device), `combine` |
//! | `expertmesh_router_expert_tokens_total` | `layer`, `expert` | (token, expert) selections: each routed token counts top_k |
//! | `expertmesh_router_device_pairs_total` | `device` | (token, expert) pairs dispatched to a device (with node dedup a remote node's leader receives, and is counted for, its node's pairs; `expertmesh_worker_pairs_total` counts what each device computed) |
//! | `expertmesh_router_device_parts_total` | `device` | dispatch frames sent to a device |
//! | `expertmesh_router_link_sent_bytes_total` | `peer` | frame bytes sent to a worker (headers included) |
//! | `expertmesh_router_link_received_bytes_total` | `peer` | frame bytes received from a worker |
//! | `expertmesh_router_worker_connected` | `peer` | 1 while the link to the worker is up |
//! | `expertmesh_router_worker_joined` | `peer` | 1 while the worker has joined (link up, its holdings announced): routed to |
//! | `expertmesh_router_worker_losses_total` | `peer` | times the link to the worker was lost |
//! | `expertmesh_router_hedges_total` | | parts re-sent to a replica after their device's hedge timeout |
//! | `expertmesh_router_redispatches_total` | | parts sent again for any reason (hedge, lost link, failed send) |
//! | `expertmesh_router_quarantines_total` | | devices taken out of replica choice |
//! | `expertmesh_router_quarantine_releases_total` | | quarantined devices back after a probe answered in time |
//! | `expertmesh_router_probes_total` | | probes sent to quarantined devices |
//! | `expertmesh_router_stale_results_total` | | frames of another router incarnation dropped |
//! | `expertmesh_router_batches_total` | | batches dispatched |

pub mod http;

use crate::core::RouterStats;
use crate::gating::Routing;
use crate::ranks::RankNames;
use expertmesh_transport::codec::{self, Body, ErrorCode};
use expertmesh_transport::mesh::OutFrame;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Registry, Unit};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Histogram buckets for latencies: 50 µs to about 6.5 s, doubling.
pub fn latency_buckets() -> impl Iterator<Item = f64> {
    exponential_buckets(50e-6, 2.0, 18)
}

/// The stages a router times, in the order of a batch's life.
pub const STAGES: [&str; 4] = ["queue", "dispatch", "compute", "combine"];

/// Error codes by wire number (1..=10; index 0 collects codes this build does not name).
const CODE_SLOTS: usize = 16;

/// The `code` label of an error code: its name in snake case (`invalid_input`), or
/// `code_N` for a number this build does not name.
pub fn code_label(code: ErrorCode) -> String {
    let name = match code {
        ErrorCode::Internal => "internal",
        ErrorCode::BadFrame => "bad_frame",
        ErrorCode::Unsupported => "unsupported",
        ErrorCode::InvalidInput => "invalid_input",
        ErrorCode::Overloaded => "overloaded",
        ErrorCode::DeadlineExceeded => "deadline_exceeded",
        ErrorCode::PeerUnavailable => "peer_unavailable",
        ErrorCode::AuthFailed => "auth_failed",
        ErrorCode::NotFound => "not_found",
        ErrorCode::ShuttingDown => "shutting_down",
        ErrorCode::NotPermitted => "not_permitted",
        other => return format!("code_{}", other.to_u16()),
    };
    name.to_owned()
}

/// Counters per error code: one slot per wire number below [`CODE_SLOTS`] (codes this build
/// may not name, a newer peer's, keep a series each), the rest (0, and numbers from
/// [`CODE_SLOTS`] on) in slot 0, labelled `other` (one stable series: labelling it by the
/// last such code seen moved every count to that code's series).
#[derive(Debug, Default)]
pub struct ErrorCounts {
    slots: [AtomicU64; CODE_SLOTS],
}

impl ErrorCounts {
    /// Count one error with `code`.
    pub fn add(&self, code: ErrorCode) {
        let n = code.to_u16() as usize;
        let slot = if n < CODE_SLOTS { n } else { 0 };
        self.slots[slot].fetch_add(1, Relaxed);
    }

    /// (label, count) of every code seen.
    pub fn snapshot(&self) -> Vec<(String, u64)> {
        let mut out = Vec::new();
        for (n, c) in self.slots.iter().enumerate() {
            let v = c.load(Relaxed);
            if v == 0 {
                continue;
            }
            let label = if n == 0 {
                "other".to_owned()
            } else {
                code_label(ErrorCode::from_u16(n as u16))
            };
            out.push((label, v));
        }
        out
    }
}

/// Preallocated counters, one per slot.
#[derive(Debug)]
pub struct Slots(Box<[AtomicU64]>);

impl Slots {
    /// `n` counters at zero.
    pub fn new(n: usize) -> Self {
        Self((0..n).map(|_| AtomicU64::new(0)).collect())
    }
    /// Add `v` to slot `i` (ignored when out of range).
    #[inline]
    pub fn add(&self, i: usize, v: u64) {
        if let Some(c) = self.0.get(i) {
            c.fetch_add(v, Relaxed);
        }
    }
    /// Set slot `i` to `v`.
    #[inline]
    pub fn set(&self, i: usize, v: u64) {
        if let Some(c) = self.0.get(i) {
            c.store(v, Relaxed);
        }
    }
    /// Slot `i`'s value (0 when out of range).
    pub fn get(&self, i: usize) -> u64 {
        self.0.get(i).map_or(0, |c| c.load(Relaxed))
    }
    /// Number of slots.
    pub fn len(&self) -> usize {
        self.0.len()
    }
    /// Whether there are no slots.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// The series of `slots`, slot `i` labelled `key = labels[i]` (e.g. per MoE layer).
pub fn per_label<T: std::fmt::Display>(
    key: &'static str,
    labels: &[T],
    slots: &Slots,
) -> Vec<([(&'static str, String); 1], u64)> {
    labels
        .iter()
        .enumerate()
        .map(|(i, l)| ([(key, l.to_string())], slots.get(i)))
        .collect()
}

/// Encode a counter family `name` with one sample per `(labels, value)`.
pub fn encode_counters<L>(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    unit: Option<&Unit>,
    samples: impl IntoIterator<Item = (L, u64)>,
) -> Result<(), std::fmt::Error>
where
    L: prometheus_client::encoding::EncodeLabelSet,
{
    let mut m = enc.encode_descriptor(name, help, unit, MetricType::Counter)?;
    for (labels, v) in samples {
        ConstCounter::new(v).encode(m.encode_family(&labels)?)?;
    }
    Ok(())
}

/// Encode one unlabelled counter `name`.
pub fn encode_counter(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    value: u64,
) -> Result<(), std::fmt::Error> {
    ConstCounter::new(value).encode(enc.encode_descriptor(name, help, None, MetricType::Counter)?)
}

/// Encode a gauge family `name` with one sample per `(labels, value)`.
pub fn encode_gauges<L>(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    samples: impl IntoIterator<Item = (L, i64)>,
) -> Result<(), std::fmt::Error>
where
    L: prometheus_client::encoding::EncodeLabelSet,
{
    let mut m = enc.encode_descriptor(name, help, None, MetricType::Gauge)?;
    for (labels, v) in samples {
        ConstGauge::new(v).encode(m.encode_family(&labels)?)?;
    }
    Ok(())
}

/// Encode histograms `name` (seconds), one per `(label value, histogram)` under `label`.
pub fn encode_histograms(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    label: &str,
    hists: &[(&str, &Histogram)],
) -> Result<(), std::fmt::Error> {
    let mut m = enc.encode_descriptor(name, help, Some(&Unit::Seconds), MetricType::Histogram)?;
    if label.is_empty() {
        if let Some((_, h)) = hists.first() {
            h.encode(m)?;
        }
        return Ok(());
    }
    for (value, h) in hists {
        h.encode(m.encode_family(&[(label, *value)])?)?;
    }
    Ok(())
}

/// A registry holding one collector, ready for [`http::MetricsServer::start`].
pub fn registry_of(collector: impl Collector) -> Registry {
    let mut r = Registry::default();
    r.register_collector(Box::new(collector));
    r
}

/// A router's metrics, shared by its core thread (updates), its service (link bytes, refusals)
/// and its `/metrics` endpoint and load-statistics writer (reads).
pub struct RouterMetrics {
    /// MoE layer ids served, ascending (index = layer slot).
    layers: Vec<u32>,
    /// Routed experts per layer.
    experts: usize,
    /// Mesh rank names (routers first, then device ids "node/device").
    ranks: Vec<String>,
    /// Number of router ranks at the front of `ranks`.
    routers: usize,
    requests: Slots,
    tokens: Slots,
    /// `[layer slot * experts + expert]`.
    expert_tokens: Slots,
    errors: ErrorCounts,
    device_pairs: Slots,
    device_parts: Slots,
    link_sent: Slots,
    link_received: Slots,
    connected: Slots,
    joined: Slots,
    losses: Slots,
    request_latency: Histogram,
    /// By [`STAGES`] order.
    stages: [Histogram; 4],
    /// The core's counters as the service last published them.
    stats: Arc<Mutex<RouterStats>>,
}

impl std::fmt::Debug for RouterMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RouterMetrics")
            .field("layers", &self.layers)
            .field("experts", &self.experts)
            .finish_non_exhaustive()
    }
}

impl RouterMetrics {
    /// Metrics for a router serving `layers` (any order) of a model with `experts` routed
    /// experts, whose mesh ranks are named `ranks` (routers first, then the devices).
    pub fn new(layers: &[u32], experts: usize, ranks: &RankNames) -> Self {
        let mut layers = layers.to_vec();
        layers.sort_unstable();
        layers.dedup();
        let routers = (ranks.routers() as usize).min(ranks.len());
        let n = ranks.len();
        let hist = || Histogram::new(latency_buckets());
        Self {
            experts,
            ranks: ranks.names().to_vec(),
            routers,
            requests: Slots::new(layers.len()),
            tokens: Slots::new(layers.len()),
            expert_tokens: Slots::new(layers.len() * experts),
            errors: ErrorCounts::default(),
            device_pairs: Slots::new(n),
            device_parts: Slots::new(n),
            link_sent: Slots::new(n),
            link_received: Slots::new(n),
            connected: Slots::new(n),
            joined: Slots::new(n),
            losses: Slots::new(n),
            request_latency: hist(),
            stages: [hist(), hist(), hist(), hist()],
            stats: Arc::default(),
            layers,
        }
    }

    /// The slot of layer `layer`.
    #[inline]
    fn layer_slot(&self, layer: u32) -> Option<usize> {
        self.layers.binary_search(&layer).ok()
    }

    /// The cell the service publishes the core's counters into.
    pub fn stats_cell(&self) -> &Arc<Mutex<RouterStats>> {
        &self.stats
    }

    /// A request was refused or failed with `code`.
    #[inline]
    pub fn on_error(&self, code: ErrorCode) {
        self.errors.add(code);
    }

    /// A frame went to mesh rank `rank`: its bytes, and for a dispatch its part and pairs.
    #[inline]
    pub fn on_sent(&self, rank: u32, frame: &OutFrame) {
        let r = rank as usize;
        self.link_sent
            .add(r, codec::frame_len(&frame.body, frame.payload.len()) as u64);
        if let Body::Dispatch(d) = &frame.body {
            self.device_parts.add(r, 1);
            self.device_pairs.add(r, d.experts.len() as u64);
        }
    }

    /// A frame of `bytes` bytes came from mesh rank `rank`.
    #[inline]
    pub fn on_received(&self, rank: u32, bytes: usize) {
        self.link_received.add(rank as usize, bytes as u64);
    }

    /// The link to mesh rank `rank` came up (`true`) or was lost.
    pub fn on_link(&self, rank: u32, up: bool) {
        self.connected.set(rank as usize, up as u64);
        if !up {
            self.losses.add(rank as usize, 1);
        }
    }

    /// Worker `rank` joined this router (its link is up and it announced what it holds: the
    /// core may route to it), or left.
    pub fn on_joined(&self, rank: u32, joined: bool) {
        self.joined.set(rank as usize, joined as u64);
    }

    /// Tokens routed to each expert so far, per layer served: `(layer, counts[expert])`.
    pub fn expert_load(&self) -> Vec<(u32, Vec<u64>)> {
        let e = self.experts;
        self.layers
            .iter()
            .enumerate()
            .map(|(i, &l)| {
                (
                    l,
                    (0..e).map(|x| self.expert_tokens.get(i * e + x)).collect(),
                )
            })
            .collect()
    }

    /// Tokens of requests batched so far for `layer`.
    pub fn layer_tokens(&self, layer: u32) -> u64 {
        self.layer_slot(layer).map_or(0, |i| self.tokens.get(i))
    }

    /// Label of mesh rank `r`.
    fn rank_label(&self, r: usize) -> String {
        self.ranks
            .get(r)
            .cloned()
            .unwrap_or_else(|| format!("rank {r}"))
    }

    /// `(peer label, value)` for every worker rank.
    fn per_worker<'a>(
        &'a self,
        s: &'a Slots,
    ) -> impl Iterator<Item = ([(&'a str, String); 1], u64)> {
        (self.routers..s.len()).map(move |r| ([("peer", self.rank_label(r))], s.get(r)))
    }

    fn encode_traffic(&self, enc: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
        encode_counters(
            enc,
            "expertmesh_router_requests",
            "Requests the router batched and dispatched, per MoE layer.",
            None,
            per_label("layer", &self.layers, &self.requests),
        )?;
        encode_counters(
            enc,
            "expertmesh_router_tokens",
            "Tokens of the requests batched, per MoE layer.",
            None,
            per_label("layer", &self.layers, &self.tokens),
        )?;
        let stats = self.stats.lock().unwrap_or_else(|e| e.into_inner()).clone();
        encode_counter(
            enc,
            "expertmesh_router_responses",
            "Requests answered with an output.",
            stats.responses,
        )?;
        let errors: Vec<([(&str, String); 1], u64)> = self
            .errors
            .snapshot()
            .into_iter()
            .map(|(c, v)| ([("code", c)], v))
            .collect();
        encode_counters(
            enc,
            "expertmesh_router_errors",
            "Requests answered with an error, by error code (refused at the door or failed in the core).",
            None,
            errors,
        )?;
        for (name, help, v) in [
            (
                "expertmesh_router_hedges",
                "Parts hedged because their device had not answered within its hedge timeout: sent to a replica as well (the first answer of the two is taken), or re-planned where no one replica holds all their experts.",
                stats.hedges,
            ),
            (
                "expertmesh_router_redispatches",
                "Parts sent again for any reason (hedge, lost link, failed send, a node leader that could not reach a peer).",
                stats.parts_redispatched,
            ),
            (
                "expertmesh_router_quarantines",
                "Times a device was taken out of replica choice (quarantined).",
                stats.quarantines,
            ),
            (
                "expertmesh_router_quarantine_releases",
                "Times a quarantined device answered its probe in time and came back.",
                stats.quarantine_releases,
            ),
            (
                "expertmesh_router_probes",
                "Probes sent to devices whose quarantine ran out.",
                stats.probes,
            ),
            (
                "expertmesh_router_stale_results",
                "Result and error frames dropped because they belong to another router incarnation.",
                stats.stale_results,
            ),
        ] {
            encode_counter(enc, name, help, v)?;
        }
        encode_counter(
            enc,
            "expertmesh_router_batches",
            "Batches dispatched.",
            stats.batches,
        )
    }

    fn encode_load(&self, enc: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let e = self.experts;
        let experts = self.layers.iter().enumerate().flat_map(|(i, l)| {
            (0..e).map(move |x| {
                (
                    [("layer", l.to_string()), ("expert", x.to_string())],
                    self.expert_tokens.get(i * e + x),
                )
            })
        });
        encode_counters(
            enc,
            "expertmesh_router_expert_tokens",
            "Routed (token, expert) selections per expert: each token counts top_k.",
            None,
            experts,
        )?;
        let device = |s: &Slots| {
            (self.routers..s.len())
                .map(|r| ([("device", self.rank_label(r))], s.get(r)))
                .collect::<Vec<_>>()
        };
        encode_counters(
            enc,
            "expertmesh_router_device_pairs",
            "(token, expert) pairs dispatched to each device (a remote node's leader is sent its node's pairs; expertmesh_worker_pairs_total counts what each device computed).",
            None,
            device(&self.device_pairs),
        )?;
        encode_counters(
            enc,
            "expertmesh_router_device_parts",
            "Dispatch frames sent to each device.",
            None,
            device(&self.device_parts),
        )
    }

    fn encode_links(&self, enc: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
        encode_counters(
            enc,
            "expertmesh_router_link_sent",
            "Frame bytes sent to each worker, headers included.",
            Some(&Unit::Bytes),
            self.per_worker(&self.link_sent),
        )?;
        encode_counters(
            enc,
            "expertmesh_router_link_received",
            "Frame bytes received from each worker, headers included.",
            Some(&Unit::Bytes),
            self.per_worker(&self.link_received),
        )?;
        encode_gauges(
            enc,
            "expertmesh_router_worker_connected",
            "1 while the link to the worker is up.",
            self.per_worker(&self.connected).map(|(l, v)| (l, v as i64)),
        )?;
        encode_gauges(
            enc,
            "expertmesh_router_worker_joined",
            "1 while the worker has joined this router (link up, and it announced what it holds): the router routes to it.",
            self.per_worker(&self.joined).map(|(l, v)| (l, v as i64)),
        )?;
        encode_counters(
            enc,
            "expertmesh_router_worker_losses",
            "Times the link to the worker was lost.",
            None,
            self.per_worker(&self.losses),
        )
    }
}

impl Collector for RouterMetrics {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        self.encode_traffic(&mut enc)?;
        encode_histograms(
            &mut enc,
            "expertmesh_router_request_duration",
            "Requests from their batch opening to their answer, in the router.",
            "",
            &[("", &self.request_latency)],
        )?;
        let stages: Vec<(&str, &Histogram)> =
            STAGES.iter().copied().zip(self.stages.iter()).collect();
        encode_histograms(
            &mut enc,
            "expertmesh_router_stage_duration",
            "Time per stage: queue (batch window), dispatch (gate, quantize, plan, encode), compute (a part's round trip to its device), combine.",
            "stage",
            &stages,
        )?;
        self.encode_load(&mut enc)?;
        self.encode_links(&mut enc)
    }
}

/// The core's side of the metrics: the shared [`RouterMetrics`], recorded by the core thread.
pub struct CoreMetrics {
    shared: Arc<RouterMetrics>,
}

impl std::fmt::Debug for CoreMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.shared.fmt(f)
    }
}

impl CoreMetrics {
    /// See [`RouterMetrics::new`].
    pub fn new(layers: &[u32], experts: usize, ranks: &RankNames) -> Self {
        Self {
            shared: Arc::new(RouterMetrics::new(layers, experts, ranks)),
        }
    }

    /// The shared metrics (for the service, the endpoint, the load writer).
    pub fn shared(&self) -> &Arc<RouterMetrics> {
        &self.shared
    }

    /// A batch of `layer` with `requests` requests and the gate's `routing` was closed at
    /// `now`; its window opened at `opened`. Counts requests, tokens and each routed expert's
    /// tokens (ids at or past the routed experts, shared experts on a worker, are not load),
    /// and times the queue stage.
    pub fn on_batch(
        &self,
        layer: u32,
        requests: usize,
        routing: &Routing,
        opened: Instant,
        now: Instant,
    ) {
        let m = &*self.shared;
        let tokens = routing.tokens();
        if let Some(i) = m.layer_slot(layer) {
            m.requests.add(i, requests as u64);
            m.tokens.add(i, tokens as u64);
            let base = i * m.experts;
            for &e in &routing.experts {
                if (e as usize) < m.experts {
                    m.expert_tokens.add(base + e as usize, 1);
                }
            }
        }
        m.stages[0].observe(now.saturating_duration_since(opened).as_secs_f64());
    }

    /// The batch closed at `closed` has handed all its parts to the driver.
    pub fn on_dispatched(&self, closed: Instant) {
        self.shared.stages[1].observe(closed.elapsed().as_secs_f64());
    }

    /// A part sent at `sent_at` was answered at `now`.
    pub fn on_part_answered(&self, sent_at: Instant, now: Instant) {
        self.shared.stages[2].observe(now.saturating_duration_since(sent_at).as_secs_f64());
    }

    /// A batch whose window opened at `opened`, holding `requests` answered requests, was
    /// combined (combining began at `combine_started`) and its answers are being handed out:
    /// each request's end-to-end latency is recorded, however long the batch took.
    pub fn on_completed(&self, opened: Instant, requests: usize, combine_started: Instant) {
        let now = Instant::now();
        let m = &*self.shared;
        m.stages[3].observe(now.saturating_duration_since(combine_started).as_secs_f64());
        let d = now.saturating_duration_since(opened).as_secs_f64();
        for _ in 0..requests {
            m.request_latency.observe(d);
        }
    }

    /// A request failed in the core with `code`.
    #[inline]
    pub fn on_error(&self, code: ErrorCode) {
        self.shared.on_error(code);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn text(m: RouterMetrics) -> String {
        let r = registry_of(m);
        let mut s = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut s, &r).unwrap();
        s
    }

    #[test]
    fn counts_reach_the_text() {
        let ranks: Vec<String> = ["router", "n/cpu0", "n/cpu1"].map(String::from).to_vec();
        let core = CoreMetrics::new(&[3, 1], 4, &RankNames::new(ranks, 1));
        let routing = Routing {
            top_k: 2,
            experts: vec![0, 3, 3, 4], // 4 is a remote shared expert's pseudo-id: not load
            weights: vec![0.5; 4],
        };
        let t0 = Instant::now();
        core.on_batch(3, 2, &routing, t0, t0 + Duration::from_millis(1));
        core.on_dispatched(t0);
        core.on_part_answered(t0, Instant::now());
        core.on_completed(t0, 2, t0);
        core.on_error(ErrorCode::InvalidInput);
        core.on_error(ErrorCode::from_u16(77));
        let shared = Arc::clone(core.shared());
        assert_eq!(
            shared.expert_load(),
            vec![(1, vec![0; 4]), (3, vec![1, 0, 0, 2])]
        );
        assert_eq!(shared.layer_tokens(3), 2);
        shared.on_link(1, true);
        shared.on_link(2, false);
        shared.on_received(2, 100);
        drop(core);
        let s = text(Arc::into_inner(shared).unwrap());
        for want in [
            "expertmesh_router_requests_total{layer=\"3\"} 2\n",
            "expertmesh_router_requests_total{layer=\"1\"} 0\n",
            "expertmesh_router_tokens_total{layer=\"3\"} 2\n",
            "expertmesh_router_errors_total{code=\"invalid_input\"} 1\n",
            "expertmesh_router_errors_total{code=\"other\"} 1\n",
            "expertmesh_router_expert_tokens_total{layer=\"3\",expert=\"3\"} 2\n",
            "expertmesh_router_request_duration_seconds_count 2\n",
            "expertmesh_router_stage_duration_seconds_count{stage=\"queue\"} 1\n",
            "expertmesh_router_link_received_bytes_total{peer=\"n/cpu1\"} 100\n",
            "expertmesh_router_worker_connected{peer=\"n/cpu0\"} 1\n",
            "expertmesh_router_worker_losses_total{peer=\"n/cpu1\"} 1\n",
        ] {
            assert!(s.contains(want), "missing {want:?} in:\n{s}");
        }
        assert!(!s.contains("peer=\"router\""), "{s}");
    }
}
