//! Prometheus metrics of a worker: what one device computes and sends.
//!
//! Why this exists: the router sees a device only from outside (a part's round trip); the
//! worker's own figures say where the time goes on the device (compute per dispatch), how
//! much load it carries per layer and expert, which errors it answers, and the bytes on each
//! of its links. [`WorkerMetrics`] keeps them; the router crate's
//! [`MetricsServer`] serves them when the
//! worker runs with `--metrics ADDR`. Encoding and cost rules are the router's
//! ([`expertmesh_router::metrics`]): preallocated atomic slots, one histogram observe per
//! dispatch, nothing allocated on the data path; every series carries a `device` label.
//!
//! Series:
//!
//! | series | labels | what |
//! | --- | --- | --- |
//! | `expertmesh_worker_dispatches_total` | `layer` | dispatches computed here |
//! | `expertmesh_worker_tokens_total` | `layer` | tokens of those dispatches |
//! | `expertmesh_worker_pairs_total` | `layer` | (token, expert) pairs computed |
//! | `expertmesh_worker_expert_pairs_total` | `layer`, `expert` | pairs computed per expert |
//! | `expertmesh_worker_errors_total` | `code` | error frames answered |
//! | `expertmesh_worker_compute_duration_seconds` | | histogram: one dispatch's execution |
//! | `expertmesh_worker_link_sent_bytes_total` | `peer` | frame bytes sent per peer |
//! | `expertmesh_worker_link_received_bytes_total` | `peer` | frame bytes received per peer |
//! | `expertmesh_worker_link_connected` | `peer` | 1 while the link is up |
//! | `expertmesh_worker_link_losses_total` | `peer` | times the link was lost |
//! | `expertmesh_worker_dropped_dispatches_total` | | queued dispatches dropped with a lost router |
//! | `expertmesh_worker_load_duration_seconds` | | gauge: the start's load of the experts |
//! | `expertmesh_worker_load_bytes` | | gauge: packed expert bytes that load took in |
//! | `expertmesh_worker_tile_cache` | `outcome` | gauge: 1 for what the load did with `--tile-cache` (`reused`, `written`, ...), 0 for the rest |
//! | `expertmesh_worker_tile_cache_write_duration_seconds` | | gauge: the tile file's background write (0 until written) |

use expertmesh_cpu_backend::tile_cache::TileCacheUse;
use expertmesh_router::metrics::http::MetricsServer;
use expertmesh_router::metrics::{
    ErrorCounts, Slots, encode_counter, encode_counters, encode_gauges, encode_histograms,
    latency_buckets, per_label,
};
use expertmesh_transport::codec::{self, Body, Dispatch};
use expertmesh_transport::mesh::OutFrame;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::encoding::EncodeMetric;
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::time::Instant;

/// The metrics of a worker of `dep` (made before the experts load, so the load is counted;
/// [`serve`] starts their endpoint).
pub fn new(dep: &crate::deploy::Deployment) -> Arc<WorkerMetrics> {
    let experts = (dep.spec.routed_experts + dep.spec.shared_experts) as usize;
    Arc::new(WorkerMetrics::new(
        &dep.spec.moe_layer_ids(),
        experts,
        &dep.rank_names(),
    ))
}

/// The `/metrics` endpoint of `metrics` (the worker at mesh rank `rank` of `dep`) when
/// `listen` is given, its address printed on stdout and logged.
pub fn serve(
    metrics: &Arc<WorkerMetrics>,
    dep: &crate::deploy::Deployment,
    rank: u32,
    listen: Option<SocketAddr>,
    ready: expertmesh_router::metrics::http::Readiness,
) -> Result<Option<MetricsServer>, crate::process::WorkerError> {
    let names = dep.rank_names();
    let Some(listen) = listen else {
        return Ok(None);
    };
    let device = names.get(rank as usize).cloned().unwrap_or_default();
    let server = MetricsServer::start_with_readiness(listen, metrics.registry(&device), ready)
        .map_err(|cause| crate::process::WorkerError::Metrics {
            worker: device.clone(),
            cause,
        })?;
    tracing::info!(worker = %device, url = %server.url(), "serving metrics");
    println!("expertmesh worker {device} metrics at {}", server.url());
    Ok(Some(server))
}

/// One worker's metrics (shared by its compute loop and its `/metrics` endpoint).
pub struct WorkerMetrics {
    /// MoE layer ids, ascending.
    layers: Vec<u32>,
    /// Routed plus shared experts per layer (shared experts have ids from the routed count on).
    experts: usize,
    /// Mesh rank names (routers, then device ids).
    ranks: Vec<String>,
    dispatches: Slots,
    tokens: Slots,
    pairs: Slots,
    expert_pairs: Slots,
    errors: ErrorCounts,
    compute: Histogram,
    link_sent: Slots,
    link_received: Slots,
    connected: Slots,
    losses: Slots,
    dropped: Slots,
    load: LoadFigures,
}

/// What the start's load did; f64 values are kept as their bits.
#[derive(Default)]
struct LoadFigures {
    seconds: AtomicU64,
    bytes: AtomicU64,
    /// Index into [`TileCacheUse::OUTCOMES`].
    tile_cache: AtomicUsize,
    tile_write_seconds: AtomicU64,
}

impl std::fmt::Debug for WorkerMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerMetrics")
            .field("layers", &self.layers)
            .finish_non_exhaustive()
    }
}

impl WorkerMetrics {
    /// Metrics for a worker of a model with `layers` MoE layers and `experts` expert ids per
    /// layer (routed and shared), in a mesh whose ranks are named `ranks`.
    pub fn new(layers: &[u32], experts: usize, ranks: &[String]) -> Self {
        let mut layers = layers.to_vec();
        layers.sort_unstable();
        layers.dedup();
        let (l, n) = (layers.len(), ranks.len());
        Self {
            experts,
            ranks: ranks.to_vec(),
            dispatches: Slots::new(l),
            tokens: Slots::new(l),
            pairs: Slots::new(l),
            expert_pairs: Slots::new(l * experts),
            errors: ErrorCounts::default(),
            compute: Histogram::new(latency_buckets()),
            link_sent: Slots::new(n),
            link_received: Slots::new(n),
            connected: Slots::new(n),
            losses: Slots::new(n),
            dropped: Slots::new(1),
            load: LoadFigures::default(),
            layers,
        }
    }

    /// The start's load took `seconds` and brought in `bytes` of packed experts.
    pub fn on_loaded(&self, seconds: f64, bytes: u64) {
        self.load.seconds.store(seconds.to_bits(), Relaxed);
        self.load.bytes.store(bytes, Relaxed);
    }

    /// What the load did with the tile cache; called again when a background write ends.
    pub fn on_tile_cache(&self, used: &TileCacheUse) {
        self.load.tile_cache.store(used.outcome_index(), Relaxed);
        if let TileCacheUse::Written { write_s, .. } = used {
            self.load
                .tile_write_seconds
                .store(write_s.to_bits(), Relaxed);
        }
    }

    /// Dispatch `d` was executed here, starting at `started`.
    pub fn on_executed(&self, d: &Dispatch, started: Instant) {
        self.compute.observe(started.elapsed().as_secs_f64());
        let Ok(i) = self.layers.binary_search(&d.layer) else {
            return;
        };
        self.dispatches.add(i, 1);
        self.tokens.add(i, u64::from(d.tokens));
        self.pairs.add(i, d.experts.len() as u64);
        let base = i * self.experts;
        for &e in &d.experts {
            if (e as usize) < self.experts {
                self.expert_pairs.add(base + e as usize, 1);
            }
        }
    }

    /// A frame went to mesh rank `rank` (an error frame is counted by its code).
    pub fn on_sent(&self, rank: u32, frame: &OutFrame) {
        let bytes = codec::frame_len(&frame.body, frame.payload.len());
        self.link_sent.add(rank as usize, bytes as u64);
        if let Body::Error(e) = &frame.body {
            self.errors.add(e.code);
        }
    }

    /// A frame of `bytes` bytes came from mesh rank `rank`.
    pub fn on_received(&self, rank: u32, bytes: usize) {
        self.link_received.add(rank as usize, bytes as u64);
    }

    /// The link to mesh rank `rank` came up, or was lost with `dropped` queued dispatches.
    pub fn on_link(&self, rank: u32, up: bool, dropped: usize) {
        self.connected.set(rank as usize, up as u64);
        if !up {
            self.losses.add(rank as usize, 1);
            self.dropped.add(0, dropped as u64);
        }
    }

    /// A registry serving these metrics, every series labelled with `device`.
    pub fn registry(self: &Arc<Self>, device: &str) -> Registry {
        let mut r = Registry::with_labels(
            [(
                std::borrow::Cow::Borrowed("device"),
                std::borrow::Cow::Owned(device.to_owned()),
            )]
            .into_iter(),
        );
        r.register_collector(Box::new(Arc::clone(self)));
        r
    }

    fn per_peer<'a>(&'a self, s: &'a Slots) -> impl Iterator<Item = ([(&'a str, String); 1], u64)> {
        (0..s.len()).map(move |r| {
            let name = self
                .ranks
                .get(r)
                .cloned()
                .unwrap_or_else(|| format!("rank {r}"));
            ([("peer", name)], s.get(r))
        })
    }

    fn encode_work(&self, enc: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
        encode_counters(
            enc,
            "expertmesh_worker_dispatches",
            "Dispatches computed on this device, per MoE layer.",
            None,
            per_label("layer", &self.layers, &self.dispatches),
        )?;
        encode_counters(
            enc,
            "expertmesh_worker_tokens",
            "Tokens of the dispatches computed, per MoE layer.",
            None,
            per_label("layer", &self.layers, &self.tokens),
        )?;
        encode_counters(
            enc,
            "expertmesh_worker_pairs",
            "(token, expert) pairs computed, per MoE layer.",
            None,
            per_label("layer", &self.layers, &self.pairs),
        )?;
        let e = self.experts;
        let experts = self.layers.iter().enumerate().flat_map(|(i, l)| {
            (0..e).filter_map(move |x| {
                let v = self.expert_pairs.get(i * e + x);
                (v > 0).then(|| ([("layer", l.to_string()), ("expert", x.to_string())], v))
            })
        });
        encode_counters(
            enc,
            "expertmesh_worker_expert_pairs",
            "(token, expert) pairs computed per expert (experts this device has served).",
            None,
            experts,
        )?;
        let errors: Vec<([(&str, String); 1], u64)> = self
            .errors
            .snapshot()
            .into_iter()
            .map(|(c, v)| ([("code", c)], v))
            .collect();
        encode_counters(
            enc,
            "expertmesh_worker_errors",
            "Error frames this device answered, by error code.",
            None,
            errors,
        )?;
        encode_histograms(
            enc,
            "expertmesh_worker_compute_duration",
            "Execution time of one dispatch on this device.",
            "",
            &[("", &self.compute)],
        )
    }
}

impl Collector for WorkerMetrics {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        self.encode_work(&mut enc)?;
        encode_counters(
            &mut enc,
            "expertmesh_worker_link_sent",
            "Frame bytes sent to each peer, headers included.",
            Some(&Unit::Bytes),
            self.per_peer(&self.link_sent),
        )?;
        encode_counters(
            &mut enc,
            "expertmesh_worker_link_received",
            "Frame bytes received from each peer, headers included.",
            Some(&Unit::Bytes),
            self.per_peer(&self.link_received),
        )?;
        encode_gauges(
            &mut enc,
            "expertmesh_worker_link_connected",
            "1 while the link to the peer is up.",
            self.per_peer(&self.connected).map(|(l, v)| (l, v as i64)),
        )?;
        encode_counters(
            &mut enc,
            "expertmesh_worker_link_losses",
            "Times the link to the peer was lost.",
            None,
            self.per_peer(&self.losses),
        )?;
        encode_counter(
            &mut enc,
            "expertmesh_worker_dropped_dispatches",
            "Queued dispatches dropped because their router's link was lost.",
            self.dropped.get(0),
        )?;
        self.encode_load(&mut enc)
    }
}

impl WorkerMetrics {
    fn encode_load(&self, enc: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let seconds = |a: &AtomicU64| f64::from_bits(a.load(Relaxed));
        encode_gauge(
            enc,
            "expertmesh_worker_load_duration",
            "Seconds the start's load of this device's experts took (read or map, repack, checks).",
            &Unit::Seconds,
            seconds(&self.load.seconds),
        )?;
        encode_gauge(
            enc,
            "expertmesh_worker_load",
            "Bytes of packed experts the start's load brought in.",
            &Unit::Bytes,
            self.load.bytes.load(Relaxed) as i64,
        )?;
        let now = self.load.tile_cache.load(Relaxed);
        encode_gauges(
            enc,
            "expertmesh_worker_tile_cache",
            "1 for what the start's load did with the tile cache (reused: mapped from it; \
             reused_copied: copied, the map could not be locked; writing, written, not_written: \
             repacked and keeping the tiles; unused; no_content_id), 0 for the others.",
            TileCacheUse::OUTCOMES
                .iter()
                .enumerate()
                .map(|(i, o)| ([("outcome", *o)], i64::from(i == now))),
        )?;
        encode_gauge(
            enc,
            "expertmesh_worker_tile_cache_write_duration",
            "Seconds the background write of the tile file took (0 until it is written).",
            &Unit::Seconds,
            seconds(&self.load.tile_write_seconds),
        )
    }
}

/// Encode one unlabelled gauge `name` of `value` in `unit`.
fn encode_gauge<N>(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    unit: &Unit,
    value: N,
) -> Result<(), std::fmt::Error>
where
    ConstGauge<N>: EncodeMetric,
{
    ConstGauge::new(value).encode(enc.encode_descriptor(
        name,
        help,
        Some(unit),
        MetricType::Gauge,
    )?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use expertmesh_transport::codec::{ErrorCode, ErrorFrame};

    #[test]
    fn counts_carry_the_device_label() {
        let ranks: Vec<String> = ["router", "n/cpu0"].map(String::from).to_vec();
        let m = Arc::new(WorkerMetrics::new(&[1, 2], 4, &ranks));
        m.on_sent(
            0,
            &OutFrame::new(Body::Error(ErrorFrame {
                request_id: 1,
                part: None,
                code: ErrorCode::NotFound,
                message: "x".into(),
            })),
        );
        m.on_received(0, 64);
        m.on_link(0, false, 3);
        m.on_loaded(1.5, 4096);
        m.on_tile_cache(&TileCacheUse::Writing {
            file: "t".into(),
            miss: "none kept".into(),
        });
        m.on_tile_cache(&TileCacheUse::Written {
            file: "t".into(),
            miss: "none kept".into(),
            write_s: 0.25,
        });
        let r = m.registry("n/cpu0");
        let mut s = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut s, &r).unwrap();
        for want in [
            "expertmesh_worker_errors_total{device=\"n/cpu0\",code=\"not_found\"} 1\n",
            "expertmesh_worker_link_received_bytes_total{device=\"n/cpu0\",peer=\"router\"} 64\n",
            "expertmesh_worker_dropped_dispatches_total{device=\"n/cpu0\"} 3\n",
            "expertmesh_worker_dispatches_total{device=\"n/cpu0\",layer=\"2\"} 0\n",
            "expertmesh_worker_load_duration_seconds{device=\"n/cpu0\"} 1.5\n",
            "expertmesh_worker_load_bytes{device=\"n/cpu0\"} 4096\n",
            "expertmesh_worker_tile_cache{device=\"n/cpu0\",outcome=\"written\"} 1\n",
            "expertmesh_worker_tile_cache{device=\"n/cpu0\",outcome=\"writing\"} 0\n",
            "expertmesh_worker_tile_cache_write_duration_seconds{device=\"n/cpu0\"} 0.25\n",
        ] {
            assert!(s.contains(want), "missing {want:?} in:\n{s}");
        }
    }
}
