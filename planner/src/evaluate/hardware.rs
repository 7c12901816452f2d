//! The hardware figures an evaluation uses: bandwidths, latencies and prices per device, NIC
//! and intra-node link, each with where it came from.
//!
//! Why this exists: a figure may come from the topology file, a measurement (`[measured]`,
//! calibration) or a default; the evaluation reads them through [`Hardware`] so that a report can
//! say which figure it used.

use expertmesh_topology::topology::{IntraLinkKind, Nic, NicKind, Topology};
use serde::Serialize;

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

/// One NIC's bandwidth per direction before calibration: the topology's measured inter-node
/// bandwidth (per NIC) when it has one, else its line rate (for a TCP NIC, the share its
/// headers leave at its MTU).
pub(crate) fn nic_gb_s(t: &Topology, c: &Nic) -> f64 {
    t.measured()
        .inter_node()
        .and_then(|m| m.bandwidth_gb_s())
        .unwrap_or_else(|| {
            let share = match c.kind() {
                NicKind::Tcp => crate::wire::tcp_payload_share(c.mtu()),
                _ => 1.0,
            };
            c.speed_gbit_s() / 8.0 * share
        })
}

/// Hardware step: each node's network bandwidth, all NICs per direction (line rate — for a TCP
/// NIC the share its headers leave at its MTU — or the measured inter-node bandwidth per NIC).
pub(super) fn node_network_bandwidth(t: &Topology, sources: &mut Vec<FigureSource>) -> Vec<f64> {
    let nic_measured = t.measured().inter_node().and_then(|m| m.bandwidth_gb_s());
    let node_nic_gb_s: Vec<f64> = t
        .nodes()
        .iter()
        .map(|n| n.nics().iter().map(|c| nic_gb_s(t, c)).sum())
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
pub(super) fn network_hop_latency(t: &Topology, sources: &mut Vec<FigureSource>) -> f64 {
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
pub(super) fn intra_node_links(
    t: &Topology,
    sources: &mut Vec<FigureSource>,
) -> (Vec<Option<f64>>, Vec<f64>) {
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
pub(super) fn summarize(v: &[f64]) -> f64 {
    v.iter()
        .copied()
        .fold(f64::INFINITY, f64::min)
        .min(f64::MAX)
}
