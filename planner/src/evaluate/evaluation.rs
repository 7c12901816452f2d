//! The evaluation of one placement: expected load per device, destinations and bytes on the
//! wire per token.
//!
//! Why this exists: [`Evaluator`] gathers the per-layer facts once (loads, replicas, touch
//! probabilities) and answers the load balance, the traffic and (in `roofline`) the throughput
//! from them.

use super::hardware::Hardware;
use super::roofline::{nic_loads, remote_links, router_nodes};
use super::sampling::{AnchorTokens, GroupTokens, distinct_draw_touch, sampled_touch};
use crate::stats::{CoSelection, LoadStats};
use crate::wire::WireModel;
use expertmesh_topology::model::ModelSpec;
use expertmesh_topology::placement::{Placement, SharedLocation};
use expertmesh_topology::topology::Topology;
use serde::Serialize;

/// Tokens per micro-batch of the default wire model (the router's default).
pub const DEFAULT_MICRO_BATCH: usize = 32;

/// Batch-independent per-layer facts.
#[derive(Clone, Debug)]
pub(super) struct LayerFacts {
    /// Per device: replica slots' per-token probabilities `q`.
    pub(super) slot_q: Vec<Vec<f64>>,
    /// Per device: expected (token, expert) pairs per token.
    pub(super) pairs: Vec<f64>,
    /// Per device: P(touched by a token).
    pub(super) p_device: Vec<f64>,
    /// Per node: P(touched by a token).
    pub(super) p_node: Vec<f64>,
    /// P(a token touches any node other than the router's).
    pub(super) p_any_remote: f64,
    /// Device holding the shared experts, if a device does.
    pub(super) shared_on: Option<usize>,
}

/// Expected load balance of one placement.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LoadBalance {
    /// Mean over layers of (busiest device's expected load ÷ mean device load), loads divided by
    /// device speed relative to the mean speed. 1.0 is perfect.
    pub max_over_mean: f64,
    /// The worst layer's ratio.
    pub max_over_mean_worst: f64,
    /// The layer id of the worst ratio.
    pub worst_layer: u32,
    /// Per device (rank order): its expected load ÷ the mean device load, averaged over layers.
    pub per_device: Vec<f64>,
}

/// Expected traffic per token per MoE layer (mean over layers).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Traffic {
    /// "independent" (load only), "group-limited" (load, tokens confined to `topk_group`
    /// groups) or "co-selection".
    pub model: String,
    /// Devices a token is sent to.
    pub devices_per_token: f64,
    /// Nodes a token is sent to.
    pub nodes_per_token: f64,
    /// Nodes other than the router's a token is sent to.
    pub remote_nodes_per_token: f64,
    /// Network bytes per token per layer, dispatch + results, as the wire model sends them
    /// (frames at full micro-batches; averaged over routers).
    pub network_bytes_per_token: f64,
    /// The same with one copy per remote device (equal to `network_bytes_per_token` unless the
    /// wire model deduplicates per node).
    pub network_bytes_per_token_without_dedup: f64,
    /// Intra-node link bytes per token per layer (every device's dispatches and results).
    pub intra_bytes_per_token: f64,
    /// Of `network_bytes_per_token`, the dispatches (router to devices).
    pub network_dispatch_bytes_per_token: f64,
    /// Of `network_bytes_per_token`, the results (devices to router).
    pub network_result_bytes_per_token: f64,
    /// The wire the bytes are counted on.
    pub wire: WireModel,
}

/// Bytes one node's NICs carry per token per MoE layer.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct NicBytes {
    /// Bytes sent.
    pub sent: f64,
    /// Bytes received.
    pub received: f64,
}

/// Everything the report says about one placement.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Evaluation {
    /// Expected load balance.
    pub load: LoadBalance,
    /// Expected traffic.
    pub traffic: Traffic,
}

/// A placement with its per-layer facts, ready for any batch size.
#[derive(Clone, Debug)]
pub struct Evaluator<'a> {
    pub(super) topology: &'a Topology,
    pub(super) model: &'a ModelSpec,
    pub(super) layers: Vec<LayerFacts>,
    pub(super) layer_ids: Vec<u32>,
    pub(super) coselection: bool,
    pub(super) wire: WireModel,
}

impl<'a> Evaluator<'a> {
    /// Work out per-layer probabilities for `placement` under the statistics given (uniform
    /// without load statistics; independent slots without co-selection).
    pub fn new(
        topology: &'a Topology,
        model: &'a ModelSpec,
        placement: &Placement,
        load: Option<&LoadStats>,
        coselect: Option<&CoSelection>,
        router_node: usize,
    ) -> Evaluator<'a> {
        let ids = model.moe_layer_ids();
        let e = model.routed_experts as usize;
        let n_dev = topology.devices().len();
        let n_nodes = topology.nodes().len();
        let node_of: Vec<usize> = topology.devices().iter().map(|d| d.node_index()).collect();
        let mut layers = Vec::with_capacity(ids.len());
        for (li, &layer) in ids.iter().enumerate() {
            let pi = crate::layer_loads(model, load, coselect, li);
            let r: Vec<usize> = (0..e as u32)
                .map(|x| placement.owners(layer, x).len().max(1))
                .collect();
            let mut slot_q = vec![Vec::new(); n_dev];
            for (d, sq) in slot_q.iter_mut().enumerate() {
                for &x in
                    placement.experts_on(expertmesh_topology::topology::DeviceRank(d as u32), layer)
                {
                    sq.push(pi[x as usize] / r[x as usize] as f64);
                }
            }
            let pairs: Vec<f64> = slot_q.iter().map(|v| v.iter().sum()).collect();
            let pairs_lp = coselect.and_then(|c| c.layer(li));
            let grouped = model.n_group > 1 && model.topk_group < model.n_group;
            let (p_device, p_node, p_any_remote) = match pairs_lp {
                Some(lp) => {
                    let tokens = AnchorTokens::new(lp, &pi, model.top_k as usize);
                    sampled_touch(placement, layer, &node_of, n_nodes, router_node, |r, c| {
                        tokens.draw(r, c)
                    })
                }
                None if grouped => {
                    let tokens = GroupTokens::new(
                        &pi,
                        model.n_group as usize,
                        model.topk_group as usize,
                        model.top_k as usize,
                    );
                    sampled_touch(placement, layer, &node_of, n_nodes, router_node, |r, c| {
                        tokens.draw(r, c)
                    })
                }
                None => distinct_draw_touch(
                    &pairs,
                    e,
                    model.top_k as usize,
                    &node_of,
                    n_nodes,
                    router_node,
                ),
            };
            let shared_on = match placement.shared_location(layer) {
                Some(SharedLocation::Device(r)) => Some(r.index()),
                _ => None,
            };
            layers.push(LayerFacts {
                slot_q,
                pairs,
                p_device,
                p_node,
                p_any_remote,
                shared_on,
            });
        }
        Evaluator {
            topology,
            model,
            layers,
            layer_ids: ids,
            coselection: coselect.is_some(),
            wire: WireModel::exact(model.hidden, DEFAULT_MICRO_BATCH),
        }
    }

    /// Count bytes on `wire` instead of the default (exact mode, micro-batches of
    /// [`DEFAULT_MICRO_BATCH`] tokens, computed from the frame layout).
    pub fn with_wire(mut self, wire: WireModel) -> Self {
        self.wire = wire;
        self
    }

    /// The wire model bytes are counted on.
    pub fn wire(&self) -> &WireModel {
        &self.wire
    }

    /// Expected load balance and traffic.
    pub fn evaluate(&self, hw: &Hardware) -> Evaluation {
        let n_dev = self.topology.devices().len();
        let mean_speed = hw.device_bandwidth_gb_s.iter().sum::<f64>() / n_dev.max(1) as f64;
        let mut ratios = Vec::with_capacity(self.layers.len());
        let mut per_device = vec![0.0; n_dev];
        for f in &self.layers {
            let norm: Vec<f64> = f
                .pairs
                .iter()
                .zip(&hw.device_bandwidth_gb_s)
                .map(|(p, s)| p * mean_speed / s.max(1e-12))
                .collect();
            let mean = norm.iter().sum::<f64>() / n_dev.max(1) as f64;
            let max = norm.iter().copied().fold(0.0, f64::max);
            ratios.push(if mean > 0.0 { max / mean } else { 1.0 });
            for (acc, x) in per_device.iter_mut().zip(&norm) {
                *acc += if mean > 0.0 { x / mean } else { 1.0 };
            }
        }
        let (worst_i, worst) = ratios
            .iter()
            .copied()
            .enumerate()
            .fold((0, 0.0), |a, (i, r)| if r > a.1 { (i, r) } else { a });
        let nl = self.layers.len().max(1) as f64;
        Evaluation {
            load: LoadBalance {
                max_over_mean: ratios.iter().sum::<f64>() / nl,
                max_over_mean_worst: worst,
                worst_layer: self.layer_ids.get(worst_i).copied().unwrap_or(0),
                per_device: per_device.iter().map(|x| x / nl).collect(),
            },
            traffic: self.traffic(hw),
        }
    }

    /// Evaluation step: destinations and bytes per token per layer, averaged over layers and
    /// routers (frames counted at full micro-batches).
    pub(super) fn traffic(&self, hw: &Hardware) -> Traffic {
        let nl = self.layers.len().max(1) as f64;
        let node_of: Vec<usize> = self
            .topology
            .devices()
            .iter()
            .map(|d| d.node_index())
            .collect();
        let routers = router_nodes(hw);
        let share = 1.0 / routers.len() as f64;
        let w = &self.wire;
        let m = w.micro_batch_tokens as f64;
        let per_device = WireModel {
            node_dedup: false,
            ..w.clone()
        };
        let (mut devs, mut nodes, mut remote) = (0.0, 0.0, 0.0);
        let (mut disp, mut res, mut no_dedup, mut intra) = (0.0, 0.0, 0.0, 0.0);
        for f in &self.layers {
            devs += f.p_device.iter().sum::<f64>();
            nodes += f.p_node.iter().sum::<f64>();
            for &r in &routers {
                remote += share
                    * (0..f.p_node.len())
                        .filter(|&n| n != r)
                        .map(|n| f.p_node[n])
                        .sum::<f64>();
                for l in remote_links(w, m, f, &node_of, r) {
                    disp += share * l.dispatch / m;
                    res += share * l.result / m;
                }
                for l in remote_links(&per_device, m, f, &node_of, r) {
                    no_dedup += share * (l.dispatch + l.result) / m;
                }
            }
            intra += (0..f.p_device.len())
                .map(|d| {
                    per_device.dispatch_bytes(m, f.p_device[d], f.pairs[d])
                        + per_device.result_bytes(m, f.p_device[d], f.pairs[d])
                })
                .sum::<f64>()
                / m;
        }
        Traffic {
            model: if self.coselection {
                "co-selection".into()
            } else if self.model.n_group > 1 && self.model.topk_group < self.model.n_group {
                "group-limited".into()
            } else {
                "independent".into()
            },
            devices_per_token: devs / nl,
            nodes_per_token: nodes / nl,
            remote_nodes_per_token: remote / nl,
            network_bytes_per_token: (disp + res) / nl,
            network_bytes_per_token_without_dedup: no_dedup / nl,
            intra_bytes_per_token: intra / nl,
            network_dispatch_bytes_per_token: disp / nl,
            network_result_bytes_per_token: res / nl,
            wire: w.clone(),
        }
    }

    /// Bytes each node's NICs send and receive per token per MoE layer (mean over layers) for
    /// calls of `batch` tokens spread evenly over the routers: the fabric's frames, without
    /// TCP/IP or Ethernet headers. What `bench cluster` compares with the NIC counters.
    pub fn nic_bytes_per_token(&self, hw: &Hardware, batch: usize) -> Vec<NicBytes> {
        let n_nodes = self.topology.nodes().len();
        let node_of: Vec<usize> = self
            .topology
            .devices()
            .iter()
            .map(|d| d.node_index())
            .collect();
        let b = batch.max(1) as f64;
        let nl = self.layers.len().max(1) as f64;
        let mut sums = vec![
            NicBytes {
                sent: 0.0,
                received: 0.0
            };
            n_nodes
        ];
        for f in &self.layers {
            let (out, inn) = nic_loads(hw, &self.wire, b, f, &node_of, n_nodes);
            for (n, s) in sums.iter_mut().enumerate() {
                s.sent += out[n] / b / nl;
                s.received += inn[n] / b / nl;
            }
        }
        sums
    }
}
