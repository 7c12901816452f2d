//! The roofline: per MoE layer the slowest of memory, compute, network, intra-node and
//! latency, summed into a step time, tokens/s and cost.
//!
//! Why this exists: the throughput estimate is arithmetic over the traffic and hardware figures
//! (see the parent module's docs); keeping it apart from the traffic model lets each be checked
//! against its closed form.

use super::evaluation::{Evaluator, LayerFacts};
use super::hardware::Hardware;
use crate::wire::{ResultRows, WireModel};
use serde::Serialize;

/// Time per step summed over layers, by term, milliseconds.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Terms {
    /// Weight reads.
    pub memory_ms: f64,
    /// Int8 arithmetic.
    pub compute_ms: f64,
    /// NIC transfers.
    pub network_ms: f64,
    /// Intra-node transfers.
    pub intra_node_ms: f64,
    /// Hop latency.
    pub latency_ms: f64,
}

/// Roofline throughput for one batch size.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Roofline {
    /// Tokens per MoE-layer call.
    pub batch: usize,
    /// Calls in flight.
    pub concurrency: usize,
    /// Decode tokens per second through the MoE layers.
    pub tokens_per_s: f64,
    /// One step (all MoE layers) for the C batches, milliseconds.
    pub step_ms: f64,
    /// "memory", "compute", "network", "intra-node" or "latency".
    pub bottleneck: String,
    /// Each term summed over layers (not only where it binds).
    pub terms: Terms,
    /// Share of the step each term binds.
    pub binding_share: Terms,
    /// Device with the most memory time.
    pub busiest_device: String,
    /// Node whose NICs carry the most time (None on one node).
    pub busiest_nic_node: Option<String>,
    /// Summed device price, when every device has one.
    pub usd_per_hour: Option<f64>,
    /// Cost per million tokens, when priced.
    pub usd_per_million_tokens: Option<f64>,
}

impl<'a> Evaluator<'a> {
    /// Roofline decode throughput for `batch` tokens per layer call and `concurrency` calls in
    /// flight.
    pub fn roofline(&self, hw: &Hardware, batch: usize, concurrency: usize) -> Roofline {
        let k = RooflineInputs {
            b: batch.max(1) as f64,
            c: concurrency.max(1) as f64,
            s_bytes: self.model.expert_bytes() as f64,
            shared_layer_bytes: self.model.shared_experts as f64
                * self.model.shared_expert_bytes() as f64,
            wire: &self.wire,
            ops_per_pair: 2.0 * self.model.expert_params() as f64,
            node_of: self
                .topology
                .devices()
                .iter()
                .map(|d| d.node_index())
                .collect(),
            max_intra_lat: hw.node_intra_latency_us.iter().copied().fold(0.0, f64::max),
        };
        let mut sums = RooflineSums {
            terms: [0.0; 5],
            binding: [0.0; 5],
            device_mem_time: vec![0.0; self.topology.devices().len()],
            node_nic_time: vec![0.0; self.topology.nodes().len()],
            step: 0.0,
        };
        for f in &self.layers {
            let (t_mem, t_cmp, t_intra) = device_times(hw, &k, f, &mut sums.device_mem_time);
            let t_nic = network_time(hw, &k, f, &mut sums.node_nic_time);
            let t_lat = 2.0 * (f.p_any_remote * hw.inter_latency_us + k.max_intra_lat) * 1e-6;
            let c = k.c;
            sums.add([c * t_mem, c * t_cmp, c * t_nic, c * t_intra, t_lat]);
        }
        self.roofline_report(batch, concurrency, k.c * k.b, &sums)
    }

    /// Tokens per second through the MoE layers when every device does its weight reads and
    /// its arithmetic one after the other and the devices alone bind: per layer, the busiest
    /// device's expected time for one call of `batch` tokens, each expert slot it holds
    /// streamed whole when the call touches it (`1 − (1 − q)^B`) plus its pairs' int8
    /// operations, summed over layers. This is how a CPU core runs a batch (its kernels stream
    /// each touched expert and compute on it in the same pass: neither hides the other), where
    /// [`Self::roofline`] takes the larger of the busiest memory and the busiest compute time.
    /// A device without `int8_tops` counts memory only; a device holding the shared experts
    /// streams them on every call (their arithmetic is not counted, as in the roofline's
    /// compute term). Network and latency are left out: the figure is for comparing
    /// placements on the same devices (a rebalance's predicted gain).
    pub fn device_serial_tokens_per_s(&self, hw: &Hardware, batch: usize) -> f64 {
        let b = batch.max(1) as f64;
        let s_bytes = self.model.expert_bytes() as f64;
        let shared_bytes =
            self.model.shared_experts as f64 * self.model.shared_expert_bytes() as f64;
        let ops_per_pair = 2.0 * self.model.expert_params() as f64;
        let mut step = 0.0;
        for f in &self.layers {
            let mut busiest: f64 = 0.0;
            for (d, slots) in f.slot_q.iter().enumerate() {
                let touched: f64 = slots.iter().map(|&q| 1.0 - (1.0 - q).powf(b)).sum();
                let mut bytes = s_bytes * touched;
                if f.shared_on == Some(d) {
                    bytes += shared_bytes;
                }
                let memory = bytes / (hw.device_bandwidth_gb_s[d].max(1e-12) * 1e9);
                let compute = hw.device_int8_tops[d].map_or(0.0, |t| {
                    ops_per_pair * b * f.pairs[d] / (t.max(1e-12) * 1e12)
                });
                busiest = busiest.max(memory + compute);
            }
            step += busiest;
        }
        if step > 0.0 { b / step } else { 0.0 }
    }

    /// Roofline step: tokens/s, the bottleneck, the terms, the busiest device and NIC, and
    /// cost, from the per-layer sums (`tokens_per_step` = C × B).
    pub(super) fn roofline_report(
        &self,
        batch: usize,
        concurrency: usize,
        tokens_per_step: f64,
        sums: &RooflineSums,
    ) -> Roofline {
        let t = self.topology;
        let (n_dev, n_nodes) = (t.devices().len(), t.nodes().len());
        let (terms, binding, step) = (&sums.terms, &sums.binding, sums.step);
        let names = ["memory", "compute", "network", "intra-node", "latency"];
        let bi = (0..5)
            .max_by(|&a, &b| binding[a].total_cmp(&binding[b]))
            .unwrap_or(0);
        let tokens_per_s = if step > 0.0 {
            tokens_per_step / step
        } else {
            0.0
        };
        let prices: Option<f64> = t
            .devices()
            .iter()
            .map(|d| d.price_usd_per_hour())
            .sum::<Option<f64>>();
        let share = |x: f64| if step > 0.0 { x / step } else { 0.0 };
        let busiest_device = (0..n_dev)
            .max_by(|&a, &b| sums.device_mem_time[a].total_cmp(&sums.device_mem_time[b]))
            .map_or_else(String::new, |d| t.devices()[d].id().to_owned());
        let busiest_nic_node = (n_nodes > 1)
            .then(|| {
                (0..n_nodes)
                    .max_by(|&a, &b| sums.node_nic_time[a].total_cmp(&sums.node_nic_time[b]))
                    .map(|n| t.nodes()[n].name().to_owned())
            })
            .flatten();
        Roofline {
            batch,
            concurrency,
            tokens_per_s,
            step_ms: step * 1e3,
            bottleneck: names[bi].into(),
            terms: Terms {
                memory_ms: terms[0] * 1e3,
                compute_ms: terms[1] * 1e3,
                network_ms: terms[2] * 1e3,
                intra_node_ms: terms[3] * 1e3,
                latency_ms: terms[4] * 1e3,
            },
            binding_share: Terms {
                memory_ms: share(binding[0]),
                compute_ms: share(binding[1]),
                network_ms: share(binding[2]),
                intra_node_ms: share(binding[3]),
                latency_ms: share(binding[4]),
            },
            busiest_device,
            busiest_nic_node,
            usd_per_hour: prices,
            usd_per_million_tokens: prices
                .filter(|_| tokens_per_s > 0.0)
                .map(|p| p / (tokens_per_s * 3600.0) * 1e6),
        }
    }
}

/// What the roofline's per-layer terms need, fixed for one call.
pub(super) struct RooflineInputs<'a> {
    /// Tokens per layer call (B).
    pub(super) b: f64,
    /// Calls in flight (C).
    pub(super) c: f64,
    /// Bytes of one routed expert.
    pub(super) s_bytes: f64,
    /// Bytes of one layer's shared experts.
    pub(super) shared_layer_bytes: f64,
    /// The bytes on the wire.
    pub(super) wire: &'a WireModel,
    /// Int8 operations per (token, expert) pair.
    pub(super) ops_per_pair: f64,
    /// Each device's node.
    pub(super) node_of: Vec<usize>,
    /// The slowest intra-node hop, µs.
    pub(super) max_intra_lat: f64,
}

/// The roofline's sums over MoE layers.
pub(super) struct RooflineSums {
    /// Memory, compute, network, intra-node and latency time, each summed over layers.
    pub(super) terms: [f64; 5],
    /// Per term, the time of the layers where it binds.
    pub(super) binding: [f64; 5],
    /// Memory time per device.
    pub(super) device_mem_time: Vec<f64>,
    /// NIC time per node.
    pub(super) node_nic_time: Vec<f64>,
    /// Time of one step (the binding term of every layer, summed).
    pub(super) step: f64,
}

impl RooflineSums {
    /// Add one layer's terms; the largest binds.
    pub(super) fn add(&mut self, parts: [f64; 5]) {
        let (imax, tmax) = parts
            .iter()
            .copied()
            .enumerate()
            .fold((0, 0.0), |a, (i, x)| if x > a.1 { (i, x) } else { a });
        for (acc, x) in self.terms.iter_mut().zip(parts) {
            *acc += x;
        }
        self.binding[imax] += tmax;
        self.step += tmax;
    }
}

/// Roofline step: one layer's memory, compute and intra-node link time — each the busiest
/// device's; every device's memory time is added to `device_mem_time`.
pub(super) fn device_times(
    hw: &Hardware,
    k: &RooflineInputs,
    f: &LayerFacts,
    device_mem_time: &mut [f64],
) -> (f64, f64, f64) {
    let mut t_mem: f64 = 0.0;
    let mut t_cmp: f64 = 0.0;
    let mut t_intra: f64 = 0.0;
    for (d, mem_time) in device_mem_time.iter_mut().enumerate() {
        let mut bytes: f64 = f.slot_q[d]
            .iter()
            .map(|&q| k.s_bytes * (1.0 - (1.0 - q).powf(k.b)))
            .sum();
        if f.shared_on == Some(d) {
            bytes += k.shared_layer_bytes;
        }
        let tm = bytes / (hw.device_bandwidth_gb_s[d].max(1e-12) * 1e9);
        *mem_time += tm;
        t_mem = t_mem.max(tm);
        if let Some(tops) = hw.device_int8_tops[d] {
            let ops = k.ops_per_pair * k.b * f.pairs[d];
            t_cmp = t_cmp.max(ops / (tops.max(1e-12) * 1e12));
        }
        if let Some(bw) = hw.node_intra_gb_s[k.node_of[d]] {
            let (p, pairs) = (f.p_device[d], f.pairs[d]);
            let bytes = k
                .wire
                .dispatch_bytes(k.b, p, pairs)
                .max(k.wire.result_bytes(k.b, p, pairs));
            t_intra = t_intra.max(bytes / (bw.max(1e-12) * 1e9));
        }
    }
    (t_mem, t_cmp, t_intra)
}

/// The routers' nodes, one entry per router (the router node when none are listed).
pub(super) fn router_nodes(hw: &Hardware) -> Vec<usize> {
    if hw.router_nodes.is_empty() {
        vec![hw.router_node]
    } else {
        hw.router_nodes.clone()
    }
}

/// Bytes between a router and one other node for a call of `b` tokens.
pub(super) struct RemoteLink {
    /// The other node.
    pub(super) node: usize,
    /// Dispatch bytes the router sends it.
    pub(super) dispatch: f64,
    /// Result bytes it sends back.
    pub(super) result: f64,
}

/// The links a router on node `router` uses for one layer call of `b` tokens: one per device
/// on another node, or with per-node deduplication one per other node touched.
pub(super) fn remote_links(
    wire: &WireModel,
    b: f64,
    f: &LayerFacts,
    node_of: &[usize],
    router: usize,
) -> Vec<RemoteLink> {
    if wire.node_dedup {
        let mut pairs = vec![0.0; f.p_node.len()];
        for (d, &n) in node_of.iter().enumerate() {
            pairs[n] += f.pairs[d];
        }
        let result_rows = |n: usize| match wire.result_rows {
            ResultRows::PerSlot => pairs[n],
            ResultRows::PerToken => f.p_node[n],
        };
        return (0..f.p_node.len())
            .filter(|&n| n != router)
            .map(|n| RemoteLink {
                node: n,
                dispatch: wire.dispatch_bytes(b, f.p_node[n], pairs[n]),
                result: wire.result_bytes(b, f.p_node[n], result_rows(n)),
            })
            .collect();
    }
    (0..node_of.len())
        .filter(|&d| node_of[d] != router)
        .map(|d| RemoteLink {
            node: node_of[d],
            dispatch: wire.dispatch_bytes(b, f.p_device[d], f.pairs[d]),
            result: wire.result_bytes(b, f.p_device[d], f.pairs[d]),
        })
        .collect()
}

/// Bytes each node's NICs send and receive for one layer call of `b` tokens, the calls spread
/// evenly over the routers: `(sent, received)` per node.
pub(super) fn nic_loads(
    hw: &Hardware,
    wire: &WireModel,
    b: f64,
    f: &LayerFacts,
    node_of: &[usize],
    n_nodes: usize,
) -> (Vec<f64>, Vec<f64>) {
    let routers = router_nodes(hw);
    let share = 1.0 / routers.len() as f64;
    let (mut out, mut inn) = (vec![0.0; n_nodes], vec![0.0; n_nodes]);
    for &r in &routers {
        for l in remote_links(wire, b, f, node_of, r) {
            out[r] += share * l.dispatch;
            inn[l.node] += share * l.dispatch;
            out[l.node] += share * l.result;
            inn[r] += share * l.result;
        }
    }
    (out, inn)
}

/// Roofline step: one layer's network time — the busiest NIC direction's, the layer calls
/// spread evenly over the routers; each node's NIC time is added to `node_nic_time`.
pub(super) fn network_time(
    hw: &Hardware,
    k: &RooflineInputs,
    f: &LayerFacts,
    node_nic_time: &mut [f64],
) -> f64 {
    let n_nodes = node_nic_time.len();
    if n_nodes <= 1 {
        return 0.0;
    }
    let (out, inn) = nic_loads(hw, k.wire, k.b, f, &k.node_of, n_nodes);
    let mut t_nic: f64 = 0.0;
    for n in 0..n_nodes {
        let tn = out[n].max(inn[n]) / (hw.node_nic_gb_s[n].max(1e-12) * 1e9);
        node_nic_time[n] += tn;
        t_nic = t_nic.max(tn);
    }
    t_nic
}
