//! What a placement will do: expected load per device, destinations and bytes on the wire per
//! token, and a roofline estimate of decode throughput and cost.
//!
//! Why this exists: a cluster builder compares placements (and clusters) by what they serve and
//! where they choke, before anything runs. The model here is deliberately simple, stated, and
//! the same for every placement it compares.
//!
//! # Traffic model
//!
//! Per MoE layer, token `t` picks expert `e` with probability `pi_e = k * load_e / sum(load)`
//! (uniform `k / E` without statistics); a replicated expert's tokens split evenly over its `r_e`
//! replicas (`q = pi_e / r_e` per replica slot). A set of slots (a device, a node, the nodes
//! other than the router's) is *touched* by a token when one of its slots receives it:
//! - without co-selection statistics, a token's k experts are k distinct draws: a set holding
//!   `m = (E / k) * sum(q)` experts' worth of load is missed by all of them with
//!   `P(untouched) = prod_{j<k} (1 - m / (E - j))` — exactly `C(E - m, k) / C(E, k)` with
//!   uniform load (treating slots as independent, `prod(1 - q)`, would undercount touches:
//!   by 6% for one device of 4 experts out of 16 with top-4);
//! - for models with group-limited routing (`n_group > 1`, `topk_group < n_group`) and no
//!   co-selection statistics, tokens are sampled: `topk_group` groups in proportion to their
//!   load, then k experts among theirs in proportion to load (so a plan that keeps groups on
//!   nodes shows the fan-out it saves);
//! - with co-selection statistics (`count(a, b)` = tokens that chose both `a` and `b`), tokens
//!   are sampled ([`SAMPLED_TOKENS`] per layer, seeded by the layer id so every placement is
//!   judged on the same tokens): the first expert in proportion to load, each further one in
//!   proportion to its co-selection counts with the experts already chosen (in proportion to
//!   load when those are all zero). With independent routing this reproduces the load-only model;
//!   with clustered routing it reproduces the clusters. A replicated expert goes to a replica on
//!   a device, else a node, the token already goes to, else the replicas take turns — the
//!   router's preference. Co-selected experts on one node mean fewer nodes per token, which is
//!   what locality buys. Pairwise counts cannot tell an expert's appearances inside its own
//!   cluster from stray ones in other clusters' tokens, so under strongly clustered routing the
//!   estimate errs toward more nodes (conservative: the gain it reports is a lower bound); with
//!   independent routing it matches the load-only model.
//!
//! Bytes are the fabric's own ([`crate::wire::WireModel`], built from the transport codec's
//! frame lengths by the binary): the router sends one dispatch frame per (micro-batch, device)
//! carrying the tokens that device needs (q8 block-32 activations in exact mode, f32 in
//! accurate mode) and their (expert, weight) pairs, and each device answers with one f32 row
//! per (token, slot) in exact mode, one pre-combined row per token otherwise. With per-node
//! deduplication (`node_dedup`, what the fabric does: a remote node's parts are merged into one
//! for a leader device, which fans the pairs out over shared memory) a token crosses the
//! network once per node touched, in one frame per (micro-batch, node), and the leader answers
//! the node's per-slot rows, or one row per token summed over the node's devices; without it
//! (the planner's own default wire) once per device touched.
//! Bytes on the network are those to and from devices on other nodes than the router's; with
//! several routers (`[[router]]`) the calls are spread evenly over them, each judged from its
//! own node. Every device's frames also cross its intra-node link.
//!
//! # Roofline
//!
//! For a batch of `B` tokens per layer call and `C` such batches in flight, each MoE layer takes
//! the slowest of:
//! - **memory**: the busiest device's weight bytes read ÷ its memory bandwidth, bytes =
//!   `expert_bytes * sum over its slots of (1 - (1 - q)^B)` (with uniform load this spreads
//!   `U(B) = E (1 - (1 - k/E)^B)` touched experts over the devices) plus its shared experts;
//! - **compute**: the busiest device's `2 * 3HF` int8 operations per (token, expert) pair ÷ its
//!   `int8_tops` (devices without a figure are skipped);
//! - **network**: the busiest NIC direction's bytes ÷ its bandwidth: a router's node sends the
//!   dispatches to, and receives the results from, every device on another node; that node
//!   receives the dispatches and sends the results. A TCP NIC's bandwidth is its line rate
//!   times the share TCP/IP and Ethernet headers leave at its MTU
//!   ([`crate::wire::tcp_payload_share`]) unless a measured figure replaces it;
//! - **intra-node**: the busiest device link's bytes (its dispatches in, or its results out) ÷
//!   the node's device-to-device bandwidth;
//!
//! each of these ×C (the C batches share the hardware), and
//!
//! - **latency**: `2 * (P(any remote node) * inter-node hop + intra-node hop)` (dispatch and
//!   combine; the C batches overlap it).
//!
//! Summed over the MoE layers this is the time one step of the C batches takes; tokens/s =
//! `C * B / step`. The bottleneck is the term that binds for the most time. Attention and dense
//! layers are not part of the fabric and not modeled. Cost per million tokens = the devices'
//! summed `price_usd_per_hour` ÷ (tokens/s × 3600) × 10^6, when every device has a price.

use crate::stats::{CoSelection, LoadStats};
use crate::wire::{ResultRows, WireModel};
use expertmesh_quant::synth::{SplitMix64, mix_seed};
use expertmesh_topology::model::ModelSpec;
use expertmesh_topology::placement::{Placement, SharedLocation};
use expertmesh_topology::topology::{IntraLinkKind, NicKind, Topology};
use serde::Serialize;

/// Tokens per micro-batch of the default wire model (the router's default).
pub const DEFAULT_MICRO_BATCH: usize = 32;
/// Default one-way latency of a network hop over RoCE, µs (no measurement given).
pub const ROCE_HOP_US: f64 = 3.0;
/// Default one-way latency of a network hop over TCP, µs.
pub const TCP_HOP_US: f64 = 15.0;
/// Default one-way intra-node hop, µs, per link kind (xGMI, PCIe, shared memory).
pub const INTRA_HOP_US: [(IntraLinkKind, f64); 3] = [
    (IntraLinkKind::Xgmi, 2.0),
    (IntraLinkKind::Pcie, 4.0),
    (IntraLinkKind::Shm, 1.0),
];

/// Where one hardware figure came from.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct FigureSource {
    /// What the figure is ("memory bandwidth of node0/gpu0", ...).
    pub what: String,
    /// The value.
    pub value: f64,
    /// Its unit.
    pub unit: String,
    /// "datasheet (topology file)", "topology `[measured]`", "bench: NAME (batch B)", "default".
    pub from: String,
}

/// The hardware figures the roofline uses.
#[derive(Clone, Debug, PartialEq)]
pub struct Hardware {
    /// Effective memory read bandwidth per device, GB/s.
    pub device_bandwidth_gb_s: Vec<f64>,
    /// Peak int8 TOPS per device, when known.
    pub device_int8_tops: Vec<Option<f64>>,
    /// Network bandwidth per node per direction (all its NICs), GB/s.
    pub node_nic_gb_s: Vec<f64>,
    /// Device link bandwidth inside each node per direction, GB/s (None: no link given).
    pub node_intra_gb_s: Vec<Option<f64>>,
    /// One-way network hop, µs.
    pub inter_latency_us: f64,
    /// One-way intra-node hop per node, µs.
    pub node_intra_latency_us: Vec<f64>,
    /// The node the router runs on (`[router].node`, else the first node).
    pub router_node: usize,
    /// Every router's node (`[[router]]` entries; several routers may share a node); layer
    /// calls are spread evenly over them. `[router_node]` with one router.
    pub router_nodes: Vec<usize>,
    /// Where every figure came from.
    pub sources: Vec<FigureSource>,
}

impl Hardware {
    /// Figures from the topology file: datasheet numbers, replaced by its `[measured]` section
    /// where given, defaults for latencies otherwise.
    pub fn from_topology(t: &Topology) -> Hardware {
        let mut sources = Vec::new();
        let device_bandwidth_gb_s: Vec<f64> = t
            .devices()
            .iter()
            .map(|d| d.memory_bandwidth_gb_s())
            .collect();
        sources.push(FigureSource {
            what: "device memory bandwidth".into(),
            value: summarize(&device_bandwidth_gb_s),
            unit: "GB/s".into(),
            from: "datasheet (topology file)".into(),
        });
        let node_nic_gb_s = node_network_bandwidth(t, &mut sources);
        let inter_latency_us = network_hop_latency(t, &mut sources);
        let (node_intra_gb_s, node_intra_latency_us) = intra_node_links(t, &mut sources);
        Hardware {
            device_bandwidth_gb_s,
            device_int8_tops: t.devices().iter().map(|d| d.int8_tops()).collect(),
            node_nic_gb_s,
            node_intra_gb_s,
            inter_latency_us,
            node_intra_latency_us,
            router_node: t.router().map_or(0, |r| r.node_index()),
            router_nodes: match t.routers() {
                [] => vec![0],
                rs => rs.iter().map(|r| r.node_index()).collect(),
            },
            sources,
        }
    }
}

/// Hardware step: each node's network bandwidth, all NICs per direction (line rate — for a TCP
/// NIC the share its headers leave at its MTU — or the measured inter-node bandwidth per NIC).
fn node_network_bandwidth(t: &Topology, sources: &mut Vec<FigureSource>) -> Vec<f64> {
    let nic_measured = t.measured().inter_node().and_then(|m| m.bandwidth_gb_s());
    let node_nic_gb_s: Vec<f64> = t
        .nodes()
        .iter()
        .map(|n| {
            n.nics()
                .iter()
                .map(|c| {
                    nic_measured.unwrap_or_else(|| {
                        let share = match c.kind() {
                            NicKind::Tcp => crate::wire::tcp_payload_share(c.mtu()),
                            _ => 1.0,
                        };
                        c.speed_gbit_s() / 8.0 * share
                    })
                })
                .sum()
        })
        .collect();
    sources.push(FigureSource {
        what: "network bandwidth per node (all NICs, per direction)".into(),
        value: summarize(&node_nic_gb_s),
        unit: "GB/s".into(),
        from: if nic_measured.is_some() {
            "topology [measured] inter_node (per NIC)".into()
        } else {
            "NIC line rate (topology file; TCP NICs: less TCP/IP and Ethernet headers at their MTU)"
                .into()
        },
    });
    node_nic_gb_s
}

/// Hardware step: the one-way network hop (measured, else the RoCE or, with any TCP NIC, the
/// TCP default).
fn network_hop_latency(t: &Topology, sources: &mut Vec<FigureSource>) -> f64 {
    let measured = t.measured().inter_node().and_then(|m| m.latency_us());
    let inter_latency_us = measured.unwrap_or_else(|| {
        let any_tcp = t
            .nodes()
            .iter()
            .flat_map(|n| n.nics())
            .any(|c| c.kind() == NicKind::Tcp);
        if any_tcp { TCP_HOP_US } else { ROCE_HOP_US }
    });
    sources.push(FigureSource {
        what: "network hop latency (one way)".into(),
        value: inter_latency_us,
        unit: "us".into(),
        from: if measured.is_some() {
            "topology [measured] inter_node".into()
        } else {
            "default (RoCE 3 us, TCP 15 us)".into()
        },
    });
    inter_latency_us
}

/// Hardware step: each node's device-link bandwidth and one-way hop (measured, else the
/// node's `intra_*` keys, else the default hop of its link kind).
fn intra_node_links(t: &Topology, sources: &mut Vec<FigureSource>) -> (Vec<Option<f64>>, Vec<f64>) {
    let intra_measured = t.measured().intra_node();
    let node_intra_gb_s: Vec<Option<f64>> = t
        .nodes()
        .iter()
        .map(|n| {
            intra_measured
                .and_then(|m| m.bandwidth_gb_s())
                .or(n.intra_link().map(|l| l.bandwidth_gb_s()))
        })
        .collect();
    let node_intra_latency_us: Vec<f64> = t
        .nodes()
        .iter()
        .map(|n| {
            intra_measured
                .and_then(|m| m.latency_us())
                .or(n.intra_link().and_then(|l| l.latency_us()))
                .or(n.intra_link().map(|l| {
                    INTRA_HOP_US
                        .iter()
                        .find(|(k, _)| *k == l.kind())
                        .map_or(4.0, |x| x.1)
                }))
                .unwrap_or(0.0)
        })
        .collect();
    if let Some(bw) = node_intra_gb_s.iter().flatten().copied().reduce(f64::min) {
        sources.push(FigureSource {
            what: "intra-node device link bandwidth (slowest node)".into(),
            value: bw,
            unit: "GB/s".into(),
            from: if intra_measured.and_then(|m| m.bandwidth_gb_s()).is_some() {
                "topology [measured] intra_node".into()
            } else {
                "intra_bandwidth_gb_s (topology file)".into()
            },
        });
    }
    (node_intra_gb_s, node_intra_latency_us)
}

/// One number for a list that is usually uniform: the value, or the minimum when they differ.
fn summarize(v: &[f64]) -> f64 {
    v.iter()
        .copied()
        .fold(f64::INFINITY, f64::min)
        .min(f64::MAX)
}

/// Tokens sampled per layer to estimate fan-out from co-selection statistics.
pub const SAMPLED_TOKENS: usize = 512;

/// Sampling in proportion to fixed weights: cumulative sums and a binary search.
struct Cdf {
    /// `(item, cumulative weight up to and including it)`, positive weights only.
    cum: Vec<(u32, f64)>,
}

impl Cdf {
    fn new(items: impl IntoIterator<Item = (u32, f64)>) -> Cdf {
        let mut acc = 0.0;
        let cum = items
            .into_iter()
            .filter(|&(_, w)| w > 0.0 && w.is_finite())
            .map(|(x, w)| {
                acc += w;
                (x, acc)
            })
            .collect();
        Cdf { cum }
    }

    /// An item not in `taken` (rejection sampling, then a scan); None when all are taken.
    fn pick(&self, taken: &[u32], rng: &mut SplitMix64) -> Option<u32> {
        let total = self.cum.last()?.1;
        for _ in 0..32 {
            let u = rng.next_f64() * total;
            let i = self
                .cum
                .partition_point(|&(_, c)| c <= u)
                .min(self.cum.len() - 1);
            let x = self.cum[i].0;
            if !taken.contains(&x) {
                return Some(x);
            }
        }
        // Most of the mass is taken: draw among what is left.
        let left: Vec<(u32, f64)> = self
            .cum
            .iter()
            .scan(0.0, |prev, &(x, c)| {
                let w = c - *prev;
                *prev = c;
                Some((x, w))
            })
            .filter(|(x, _)| !taken.contains(x))
            .collect();
        if left.is_empty() {
            return None;
        }
        Cdf::new(left).pick(&[], rng)
    }
}

/// A token's experts from co-selection counts: the first in proportion to load, the others in
/// proportion to how often each was chosen together with the first (the anchor); in proportion
/// to load when the anchor's recorded partners run out.
struct AnchorTokens {
    partners: Vec<Cdf>,
    by_load: Cdf,
    k: usize,
    experts: usize,
}

impl AnchorTokens {
    fn new(lp: &crate::stats::LayerPairs, pi: &[f64], k: usize) -> AnchorTokens {
        let e = pi.len();
        let mut rows: Vec<Vec<(u32, f64)>> = vec![Vec::new(); e];
        for &(a, b, c) in &lp.pairs {
            rows[a as usize].push((b, c));
            rows[b as usize].push((a, c));
        }
        AnchorTokens {
            partners: rows.into_iter().map(Cdf::new).collect(),
            by_load: Cdf::new(pi.iter().enumerate().map(|(x, &w)| (x as u32, w))),
            k: k.min(e),
            experts: e,
        }
    }

    fn draw(&self, rng: &mut SplitMix64, chosen: &mut Vec<u32>) {
        chosen.clear();
        while chosen.len() < self.k {
            let x = match chosen.first() {
                Some(&anchor) => self.partners[anchor as usize].pick(chosen, rng),
                None => None,
            }
            .or_else(|| self.by_load.pick(chosen, rng))
            .or_else(|| (0..self.experts as u32).find(|x| !chosen.contains(x)));
            match x {
                Some(x) => chosen.push(x),
                None => break,
            }
        }
    }
}

/// A token's experts under group-limited routing: `topk_group` distinct groups in proportion
/// to their load, then `k` distinct experts among those groups' in proportion to load.
struct GroupTokens {
    pi: Vec<f64>,
    groups: Cdf,
    by_load: Cdf,
    group_size: usize,
    topk_group: usize,
    k: usize,
}

impl GroupTokens {
    fn new(pi: &[f64], n_group: usize, topk_group: usize, k: usize) -> GroupTokens {
        let gs = pi.len() / n_group.max(1);
        GroupTokens {
            pi: pi.to_vec(),
            groups: Cdf::new(
                (0..n_group).map(|g| (g as u32, pi[g * gs..(g + 1) * gs].iter().sum())),
            ),
            by_load: Cdf::new(pi.iter().enumerate().map(|(x, &w)| (x as u32, w))),
            group_size: gs,
            topk_group: topk_group.min(n_group),
            k: k.min(pi.len()),
        }
    }

    fn draw(&self, rng: &mut SplitMix64, chosen: &mut Vec<u32>) {
        let mut groups: Vec<u32> = Vec::with_capacity(self.topk_group);
        while groups.len() < self.topk_group {
            match self.groups.pick(&groups, rng) {
                Some(g) => groups.push(g),
                None => break,
            }
        }
        let gs = self.group_size;
        let allowed = Cdf::new(groups.iter().flat_map(|&g| {
            (g as usize * gs..(g as usize + 1) * gs).map(|x| (x as u32, self.pi[x]))
        }));
        chosen.clear();
        while chosen.len() < self.k {
            match allowed
                .pick(chosen, rng)
                .or_else(|| self.by_load.pick(chosen, rng))
            {
                Some(x) => chosen.push(x),
                None => break,
            }
        }
    }
}

/// Fan-out by sampling [`SAMPLED_TOKENS`] tokens from `draw` (seeded by the layer, so every
/// placement is judged on the same tokens): per-device and per-node touch probabilities and
/// P(any remote node). Replica choice as the router makes it: a replica on a device the token
/// already goes to, else on a node it already goes to, else the replicas take turns.
fn sampled_touch(
    placement: &Placement,
    layer: u32,
    node_of: &[usize],
    n_nodes: usize,
    router_node: usize,
    mut draw: impl FnMut(&mut SplitMix64, &mut Vec<u32>),
) -> (Vec<f64>, Vec<f64>, f64) {
    let n_dev = node_of.len();
    let mut rng = SplitMix64::new(mix_seed(&[layer as u64, 0x5a3b1e]));
    let (mut dev_hits, mut node_hits, mut remote_hits) =
        (vec![0u32; n_dev], vec![0u32; n_nodes], 0u32);
    let mut chosen: Vec<u32> = Vec::new();
    let mut dev_stamp = vec![u32::MAX; n_dev];
    let mut node_stamp = vec![u32::MAX; n_nodes];
    for t in 0..SAMPLED_TOKENS as u32 {
        draw(&mut rng, &mut chosen);
        let mut remote = false;
        for (slot, &x) in chosen.iter().enumerate() {
            let owners = placement.owners(layer, x);
            if owners.is_empty() {
                continue;
            }
            let d = owners
                .iter()
                .find(|r| dev_stamp[r.index()] == t)
                .or_else(|| owners.iter().find(|r| node_stamp[node_of[r.index()]] == t))
                .unwrap_or(&owners[(t as usize + slot) % owners.len()])
                .index();
            if dev_stamp[d] != t {
                dev_stamp[d] = t;
                dev_hits[d] += 1;
            }
            let n = node_of[d];
            if node_stamp[n] != t {
                node_stamp[n] = t;
                node_hits[n] += 1;
                remote |= n != router_node;
            }
        }
        remote_hits += remote as u32;
    }
    let f = |x: u32| x as f64 / SAMPLED_TOKENS as f64;
    (
        dev_hits.into_iter().map(f).collect(),
        node_hits.into_iter().map(f).collect(),
        f(remote_hits),
    )
}

/// Batch-independent per-layer facts.
#[derive(Clone, Debug)]
struct LayerFacts {
    /// Per device: replica slots' per-token probabilities `q`.
    slot_q: Vec<Vec<f64>>,
    /// Per device: expected (token, expert) pairs per token.
    pairs: Vec<f64>,
    /// Per device: P(touched by a token).
    p_device: Vec<f64>,
    /// Per node: P(touched by a token).
    p_node: Vec<f64>,
    /// P(a token touches any node other than the router's).
    p_any_remote: f64,
    /// Device holding the shared experts, if a device does.
    shared_on: Option<usize>,
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
    topology: &'a Topology,
    model: &'a ModelSpec,
    layers: Vec<LayerFacts>,
    layer_ids: Vec<u32>,
    coselection: bool,
    wire: WireModel,
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
    fn traffic(&self, hw: &Hardware) -> Traffic {
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

    /// Roofline step: tokens/s, the bottleneck, the terms, the busiest device and NIC, and
    /// cost, from the per-layer sums (`tokens_per_step` = C × B).
    fn roofline_report(
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
struct RooflineInputs<'a> {
    /// Tokens per layer call (B).
    b: f64,
    /// Calls in flight (C).
    c: f64,
    /// Bytes of one routed expert.
    s_bytes: f64,
    /// Bytes of one layer's shared experts.
    shared_layer_bytes: f64,
    /// The bytes on the wire.
    wire: &'a WireModel,
    /// Int8 operations per (token, expert) pair.
    ops_per_pair: f64,
    /// Each device's node.
    node_of: Vec<usize>,
    /// The slowest intra-node hop, µs.
    max_intra_lat: f64,
}

/// The roofline's sums over MoE layers.
struct RooflineSums {
    /// Memory, compute, network, intra-node and latency time, each summed over layers.
    terms: [f64; 5],
    /// Per term, the time of the layers where it binds.
    binding: [f64; 5],
    /// Memory time per device.
    device_mem_time: Vec<f64>,
    /// NIC time per node.
    node_nic_time: Vec<f64>,
    /// Time of one step (the binding term of every layer, summed).
    step: f64,
}

impl RooflineSums {
    /// Add one layer's terms; the largest binds.
    fn add(&mut self, parts: [f64; 5]) {
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

/// P(a set holding `pairs` expected (token, expert) pairs per token is missed by a token's
/// `k` distinct experts out of `e`): `prod_{j<k} (1 - m / (e - j))` with `m = pairs * e / k`
/// experts' worth of load (exact for uniform load: `C(e - m, k) / C(e, k)`).
fn untouched(pairs: f64, e: usize, k: usize) -> f64 {
    let (ef, m) = (e as f64, pairs * e as f64 / k.max(1) as f64);
    (0..k.min(e))
        .map(|j| (1.0 - m / (ef - j as f64)).clamp(0.0, 1.0))
        .product()
}

/// P(touched by a token) per device and per node, and P(any node other than the router's),
/// from each device's expected pairs per token ([`untouched`]).
fn distinct_draw_touch(
    pairs: &[f64],
    e: usize,
    k: usize,
    node_of: &[usize],
    n_nodes: usize,
    router_node: usize,
) -> (Vec<f64>, Vec<f64>, f64) {
    let mut node_pairs = vec![0.0; n_nodes];
    for (d, &p) in pairs.iter().enumerate() {
        node_pairs[node_of[d]] += p;
    }
    let remote: f64 = (0..n_nodes)
        .filter(|&n| n != router_node)
        .map(|n| node_pairs[n])
        .sum();
    (
        pairs.iter().map(|&p| 1.0 - untouched(p, e, k)).collect(),
        node_pairs
            .iter()
            .map(|&p| 1.0 - untouched(p, e, k))
            .collect(),
        if n_nodes > 1 {
            1.0 - untouched(remote, e, k)
        } else {
            0.0
        },
    )
}

/// Roofline step: one layer's memory, compute and intra-node link time — each the busiest
/// device's; every device's memory time is added to `device_mem_time`.
fn device_times(
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
fn router_nodes(hw: &Hardware) -> Vec<usize> {
    if hw.router_nodes.is_empty() {
        vec![hw.router_node]
    } else {
        hw.router_nodes.clone()
    }
}

/// Bytes between a router and one other node for a call of `b` tokens.
struct RemoteLink {
    /// The other node.
    node: usize,
    /// Dispatch bytes the router sends it.
    dispatch: f64,
    /// Result bytes it sends back.
    result: f64,
}

/// The links a router on node `router` uses for one layer call of `b` tokens: one per device
/// on another node, or with per-node deduplication one per other node touched.
fn remote_links(
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
fn nic_loads(
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
fn network_time(
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{PlanOptions, plan};
    use expertmesh_topology::model::preset_by_name;
    use std::path::Path;

    /// Kimi K2 spread evenly over 32 MI300X: every roofline term against its closed form.
    #[test]
    fn roofline_terms_match_closed_forms() {
        let t = Topology::load(
            &Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/mi300x-4x8.toml"),
        )
        .unwrap();
        let m = preset_by_name("kimi-k2").unwrap();
        let p = plan(&t, &m, None, None, &PlanOptions::default()).unwrap();
        let hw = Hardware::from_topology(&t);
        let ev = Evaluator::new(&t, &m, &p.placement, None, None, hw.router_node);
        let (e, k, layers) = (384.0f64, 8.0f64, 60.0);
        let q = k / e;
        // P(a set of m experts is missed by a token's 8 distinct experts) = C(384 - m, 8) / C(384, 8).
        let miss = |m: f64| (0..8).map(|j| 1.0 - m / (e - j as f64)).product::<f64>();
        let s = m.expert_bytes() as f64;
        for b in [1usize, 8, 64, 256] {
            let r = ev.roofline(&hw, b, 1);
            // U(B) touched experts spread over 32 devices, read at 5300 GB/s.
            let u = e * (1.0 - (1.0 - q).powf(b as f64));
            let memory = layers * u / 32.0 * s / 5300e9 * 1e3;
            assert!((r.terms.memory_ms - memory).abs() < 1e-9 * memory, "B={b}");
            // Exact mode: the router's node receives one f32 row (4 x 7168 bytes) per slot on
            // each of the 24 devices of the other nodes (12 experts each), plus a 64-byte
            // result frame per (micro-batch of 32, device) touched, over 8 x 400 Gbit/s
            // (RoCE: line rate); the dispatches (q8) going out are fewer bytes.
            let bf = b as f64;
            let p_dev = 1.0 - miss(12.0);
            let (full, rest) = ((bf / 32.0).floor(), bf % 32.0);
            let mut frames = full * (1.0 - (1.0 - p_dev).powi(32));
            if rest > 0.0 {
                frames += 1.0 - (1.0 - p_dev).powf(rest);
            }
            let per_device = frames * 64.0 + bf * 12.0 * q * 4.0 * 7168.0;
            let network = layers * 24.0 * per_device / 400e9 * 1e3;
            assert!(
                (r.terms.network_ms - network).abs() < 1e-9 * network,
                "B={b}"
            );
            // Dispatch + combine: a RoCE hop (3 us) when any remote node is touched, plus the
            // xGMI hop (2 us).
            let any_remote = 1.0 - miss(288.0);
            let latency = layers * 2.0 * (any_remote * 3.0 + 2.0) * 1e-3;
            assert!(
                (r.terms.latency_ms - latency).abs() < 1e-9 * latency,
                "B={b}"
            );
            // Int8 compute: B k pairs spread over 32 devices at 2614.9 TOPS.
            let compute =
                layers * 2.0 * m.expert_params() as f64 * b as f64 * k / 32.0 / 2614.9e12 * 1e3;
            assert!(
                (r.terms.compute_ms - compute).abs() < 1e-9 * compute,
                "B={b}"
            );
            let step = r.step_ms / 1e3;
            assert!((r.tokens_per_s - b as f64 / step).abs() < 1e-6 * r.tokens_per_s);
            let cost = 64.0 / (r.tokens_per_s * 3600.0) * 1e6;
            assert!((r.usd_per_million_tokens.unwrap() - cost).abs() < 1e-9 * cost);
        }
        let tr = ev.evaluate(&hw).traffic;
        let remote = 3.0 * (1.0 - miss(96.0));
        assert!((tr.remote_nodes_per_token - remote).abs() < 1e-12);
        // Per token, frames at full micro-batches of 32: q8 activations (7168 + 896 scales +
        // 2 bytes) per device touched and 8 bytes per pair out, an f32 row per slot back.
        let p_dev = 1.0 - miss(12.0);
        let frames = (1.0 - (1.0 - p_dev).powi(32)) / 32.0;
        let dispatch = 24.0 * (frames * 96.0 + p_dev * 8066.0 + 12.0 * q * 8.0);
        let result = 24.0 * (frames * 64.0 + 12.0 * q * 28672.0);
        assert!((tr.network_dispatch_bytes_per_token - dispatch).abs() < 1e-6 * dispatch);
        assert!((tr.network_result_bytes_per_token - result).abs() < 1e-6 * result);
        assert!((tr.network_bytes_per_token - dispatch - result).abs() < 1e-6 * result);
        let devices = 32.0 * (1.0 - miss(12.0));
        assert!((tr.devices_per_token - devices).abs() < 1e-12);
    }

    /// A star of `n` one-CPU nodes on 100 Mbit/s TCP, with one router or one per node.
    fn star(n: usize, routers: usize) -> Topology {
        let mut text = String::from("format = 1\nname = \"star\"\n");
        for r in 0..routers {
            text += &format!("[[router]]\nnode = \"n{r}\"\nport = 7000\n");
        }
        for i in 0..n {
            text += &format!(
                "[[nodes]]\nname = \"n{i}\"\naddress = \"10.9.0.{}\"\ncontrol_port = 7100\ndata_port = 7200\nnics = [{{ name = \"eth0\", kind = \"tcp\", speed_gbit_s = 0.1, mtu = 9000 }}]\ndevices = [{{ name = \"cpu0\", kind = \"cpu\", arch = \"cpu\", threads = 1, expert_memory = \"64 MiB\", memory_bandwidth_gb_s = 20 }}]\n",
                i + 1
            );
        }
        Topology::from_toml_str(&text).unwrap_or_else(|p| panic!("{p:?}"))
    }

    /// One router per node spreads the network load: with the network binding, tokens/s grow
    /// with the routers, and every NIC direction is counted.
    #[test]
    fn routers_per_node_scale_a_network_bound_cluster() {
        let m = preset_by_name("demo-small").unwrap();
        let tps = |routers: usize| {
            let t = star(4, routers);
            let p = plan(&t, &m, None, None, &PlanOptions::default()).unwrap();
            let hw = Hardware::from_topology(&t);
            assert_eq!(hw.router_nodes.len(), routers);
            let ev = Evaluator::new(&t, &m, &p.placement, None, None, hw.router_node);
            let r = ev.roofline(&hw, 64, 1);
            assert_eq!(r.bottleneck, "network");
            (r.tokens_per_s, ev.evaluate(&hw).traffic)
        };
        let (one, tr1) = tps(1);
        {
            let t = star(4, 1);
            let p = plan(&t, &m, None, None, &PlanOptions::default()).unwrap();
            let hw = Hardware::from_topology(&t);
            let ev = Evaluator::new(&t, &m, &p.placement, None, None, 0);
            let nic = ev.nic_bytes_per_token(&hw, 32);
            let tr = ev.evaluate(&hw).traffic;
            // One router: its node receives every remote result and sends every dispatch.
            assert!((nic[0].received - tr.network_result_bytes_per_token).abs() < 1e-6);
            assert!((nic[0].sent - tr.network_dispatch_bytes_per_token).abs() < 1e-6);
            let rest: f64 = nic[1..].iter().map(|n| n.sent).sum();
            assert!((rest - nic[0].received).abs() < 1e-6);
        }
        let (four, tr4) = tps(4);
        // Each router sees 3 of 4 devices remote either way: same bytes per token.
        assert!((tr1.network_bytes_per_token - tr4.network_bytes_per_token).abs() < 1e-6);
        // The single router's NIC receives every remote result; four routers split that over
        // four NICs, each also receiving the others' dispatches.
        let scale = four / one;
        assert!(scale > 3.0 && scale < 4.0, "{scale}");
        // The network term against its closed form for one router: results dominate.
        let t = star(4, 1);
        let p = plan(&t, &m, None, None, &PlanOptions::default()).unwrap();
        let hw = Hardware::from_topology(&t);
        let ev = Evaluator::new(&t, &m, &p.placement, None, None, 0);
        // B = 64 is two full micro-batches of 32, as the per-token figure counts frames.
        assert_eq!(ev.wire().micro_batch_tokens, 32);
        let per_token = tr1.network_result_bytes_per_token;
        let bw = 0.1e9 / 8.0 * (8948.0 / 9038.0);
        let expect = m.moe_layers() as f64 * 64.0 / bw;
        let r = ev.roofline(&hw, 64, 1);
        assert!(
            (r.terms.network_ms / 1e3 - expect * per_token).abs() < 1e-9 * r.terms.network_ms,
            "{} vs {}",
            r.terms.network_ms,
            expect * per_token * 1e3
        );
    }

    /// Per-node dedup: a token crosses to a remote node once, so dispatch bytes drop with
    /// 8 devices per node; per-slot rows are the same bytes; pre-combined rows are one per node.
    #[test]
    fn node_dedup_sends_once_per_node() {
        let t = Topology::load(
            &Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/mi300x-4x8.toml"),
        )
        .unwrap();
        let m = preset_by_name("kimi-k2").unwrap();
        let p = plan(&t, &m, None, None, &PlanOptions::default()).unwrap();
        let hw = Hardware::from_topology(&t);
        let traffic = |w: WireModel| {
            Evaluator::new(&t, &m, &p.placement, None, None, 0)
                .with_wire(w)
                .evaluate(&hw)
                .traffic
        };
        let dedup = |w: WireModel| WireModel {
            node_dedup: true,
            ..w
        };
        let (e, d) = (
            traffic(WireModel::exact(m.hidden, 32)),
            traffic(dedup(WireModel::exact(m.hidden, 32))),
        );
        assert!(d.network_dispatch_bytes_per_token < 0.5 * e.network_dispatch_bytes_per_token);
        let rows = |t: &Traffic| t.network_result_bytes_per_token;
        assert!((rows(&d) - rows(&e)).abs() < 0.01 * rows(&e));
        assert!((d.network_bytes_per_token_without_dedup - e.network_bytes_per_token).abs() < 1e-6);
        let a = traffic(dedup(WireModel::accurate(m.hidden, 32)));
        // One pre-combined f32 row per remote node touched.
        let per_node = a.network_result_bytes_per_token / a.remote_nodes_per_token;
        assert!((per_node - 4.0 * 7168.0).abs() < 64.0, "{per_node}");
    }

    /// A token's k experts are distinct: with uniform load a set of m experts is missed with
    /// probability C(E - m, k) / C(E, k), not (1 - k/E)^m.
    #[test]
    fn touches_follow_distinct_draws() {
        // 4 of 16 experts, top-4: 1 pair per token expected.
        let miss = untouched(1.0, 16, 4);
        assert!((miss - 495.0 / 1820.0).abs() < 1e-12, "{miss}");
        assert!(miss < 0.75f64.powi(4));
        assert_eq!(untouched(0.0, 16, 4), 1.0);
        assert_eq!(untouched(4.0, 16, 4), 0.0);
    }
}
