//! Validation of `[[nodes]]`: each node's own keys, its devices in order, its intra-node link.
//!
//! Why this exists: nodes give the ranks (file order) and own the NICs and devices; this step
//! walks them and hands each device to [`super::devices`].

use super::device_types::DeviceTypes;
use super::devices::validate_device;
use super::nics::validate_nics;
use super::raw::{RawDevice, RawNode};
use super::types::{IntraLink, Node};
use super::validate::{Built, check_required, entry_label};
use super::values::{
    LINK_KINDS, Sp, Val, check, non_negative, one_of, port, positive, valid_host, valid_name,
};

use crate::diag::{Ctx, Field, span_of};
use std::collections::{HashMap, HashSet};
use toml::Spanned;

/// A node's own keys, checked (its NICs, devices and link are separate steps).
pub(super) struct NodeHeader {
    pub(super) label: String,
    pub(super) span: Sp,
    pub(super) name: Val<String>,
    pub(super) address: Val<String>,
    pub(super) data_address: Val<String>,
    pub(super) control_port: Val<u16>,
    pub(super) data_port_base: Val<u16>,
}

/// What the devices of one node share while they are checked in order.
pub(super) struct NodeDevices<'a> {
    pub(super) node: &'a NodeHeader,
    pub(super) nic_names: &'a [String],
    pub(super) nic_count: usize,
    pub(super) dev_names: HashSet<String>,
    pub(super) gpu_indices: HashMap<u32, String>,
    pub(super) gpu_count: u32,
}

/// Step: every `[[nodes]]` table, in file order (which gives the ranks).
pub(super) fn validate_nodes(
    ctx: &mut Ctx<'_>,
    types: &DeviceTypes,
    raw_nodes: &Field<Vec<Spanned<RawNode>>>,
) -> Built {
    let list: &[Spanned<RawNode>] = raw_nodes.as_ref().map_or(&[], |n| n.get_ref());
    if list.is_empty() {
        ctx.at(
            span_of(raw_nodes),
            "top level",
            "no nodes; add at least one [[nodes]] table with its devices and NICs",
        );
    }
    let mut built = Built::default();
    for (ni, rn) in list.iter().enumerate() {
        validate_node(ctx, types, &mut built, ni, rn);
    }
    built
}

/// Step: one node — its keys, NICs, devices and intra-node link; kept when its own keys are
/// valid (its devices are dropped otherwise, so that ranks stay consistent with nodes).
pub(super) fn validate_node(
    ctx: &mut Ctx<'_>,
    types: &DeviceTypes,
    built: &mut Built,
    ni: usize,
    rn: &Spanned<RawNode>,
) {
    let r = rn.get_ref();
    let header = validate_node_header(ctx, ni, rn, &mut built.node_names);
    built.unnamed_nodes |= header.name.get().is_none();
    let (nics, nic_names) = validate_nics(ctx, &header, &r.nics);
    let first_rank = built.devices.len() as u32;
    let mut nd = NodeDevices {
        node: &header,
        nic_names: &nic_names,
        nic_count: r.nics.as_ref().map_or(0, |n| n.get_ref().len()),
        dev_names: HashSet::new(),
        gpu_indices: HashMap::new(),
        gpu_count: 0,
    };
    let raw_devs: &[Spanned<RawDevice>] = r.devices.as_ref().map_or(&[], |d| d.get_ref());
    if raw_devs.is_empty() {
        ctx.at(
            span_of(&r.devices).or(header.span.clone()),
            &header.label,
            "no devices; add `devices = [...]` with at least one gpu or cpu device",
        );
    }
    for (di, rd) in raw_devs.iter().enumerate() {
        validate_device(ctx, types, &mut nd, di, rd, built);
    }
    let intra_link = validate_intra_link(ctx, &header, r, raw_devs.len());
    if let (Some(name), Some(address), Some(control_port)) = (
        header.name.get(),
        header.address.get(),
        header.control_port.get(),
    ) {
        let data_address = header.data_address.get().unwrap_or_else(|| address.clone());
        built
            .listen_spans
            .control_port
            .push(header.control_port.span());
        built.nodes.push(Node {
            name,
            address,
            data_address,
            control_port,
            intra_link,
            nics,
            device_ranks: first_rank..built.devices.len() as u32,
        });
    } else {
        built.devices.truncate(first_rank as usize);
        built.listen_spans.data_port.truncate(first_rank as usize);
        built.expert_memory_spans.truncate(first_rank as usize);
    }
}

/// Step: a node's name (unique in the cluster), addresses and ports.
pub(super) fn validate_node_header(
    ctx: &mut Ctx<'_>,
    ni: usize,
    rn: &Spanned<RawNode>,
    node_names: &mut HashMap<String, usize>,
) -> NodeHeader {
    let span = Some(rn.span());
    let r = rn.get_ref();
    let label = entry_label("", "node", &r.name, ni);
    let name = check_required(
        ctx,
        &r.name,
        &label,
        valid_name("node"),
        span.clone(),
        "missing `name`; give the node a unique name",
    );
    if let Some(n) = name.get()
        && let Some(prev) = node_names.insert(n.clone(), ni)
    {
        ctx.at(
            name.span(),
            &label,
            format!(
                "node name \"{n}\" is already used by node #{}; node names must be unique",
                prev + 1
            ),
        );
    }
    let address = check_required(
        ctx,
        &r.address,
        &label,
        valid_host("address"),
        span.clone(),
        "missing `address`; give the node's IP address or hostname",
    );
    let data_address = check(ctx, &r.data_address, &label, valid_host("data_address"));
    let control_port = check_required(
        ctx,
        &r.control_port,
        &label,
        port("control_port"),
        span.clone(),
        "missing `control_port`; give the port for control connections (1-65535)",
    );
    let data_port_base = check(ctx, &r.data_port, &label, port("data_port"));
    NodeHeader {
        label,
        span,
        name,
        address,
        data_address,
        control_port,
        data_port_base,
    }
}

/// Step: a node's intra-node link, required when it has several devices.
pub(super) fn validate_intra_link(
    ctx: &mut Ctx<'_>,
    node: &NodeHeader,
    r: &RawNode,
    n_devices: usize,
) -> Option<IntraLink> {
    let label = &node.label;
    let link_kind = check(ctx, &r.intra_link, label, one_of("intra_link", LINK_KINDS));
    let link_bw = check(
        ctx,
        &r.intra_bandwidth_gb_s,
        label,
        positive("intra_bandwidth_gb_s"),
    );
    let link_lat = check(
        ctx,
        &r.intra_latency_us,
        label,
        non_negative("intra_latency_us"),
    );
    if n_devices >= 2 {
        if link_kind.is_absent() {
            ctx.at(
                node.span.clone(),
                label,
                "missing `intra_link` (the node has several devices); use \"xgmi\", \"pcie\" or \"shm\"",
            );
        }
        if link_bw.is_absent() {
            ctx.at(
                node.span.clone(),
                label,
                "missing `intra_bandwidth_gb_s` (the node has several devices); give the device-to-device bandwidth in GB/s",
            );
        }
    }
    match (link_kind.get(), link_bw.get()) {
        (Some(kind), Some(bw)) => Some(IntraLink {
            kind,
            bandwidth_gb_s: bw,
            latency_us: link_lat.get(),
        }),
        (Some(_), None) if link_bw.is_absent() && n_devices < 2 => {
            ctx.at(
                link_kind.span(),
                label,
                "intra_link needs intra_bandwidth_gb_s too",
            );
            None
        }
        _ => None,
    }
}
