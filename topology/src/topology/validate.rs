//! Validation of a whole topology file, section by section.
//!
//! Why this exists: the entry of validation; it runs the section steps (device types, nodes,
//! routers, measured tiers) in file order, collects every problem in one run, and checks what
//! spans sections (total memory).

use super::device_types::{TypeMissing, report_type_missing, validate_device_types};
use super::nodes::validate_nodes;
use super::raw::{RawMeasured, RawTier, RawTopology};
use super::routers::{
    ListenSpans, RouterSpans, check_port_collisions, router_entries, validate_router,
};

use super::types::{
    Device, MeasuredTiers, Node, RouterSpec, TOPOLOGY_FORMAT, TierMeasure, Topology,
};

use super::values::{Sp, Val, check, non_negative, positive, valid_name};
use crate::diag::{Ctx, Field, check_format, span_of, text_or_default};
use crate::units::format_bytes_in;
use std::collections::{HashMap, HashSet};

/// What the node steps have built so far.
#[derive(Default)]
pub(super) struct Built {
    pub(super) nodes: Vec<Node>,
    pub(super) devices: Vec<Device>,
    /// Every valid node name → its position in the file (also for nodes that failed).
    pub(super) node_names: HashMap<String, usize>,
    /// Some `[[nodes]]` entry has no valid name (so a name referring to it may look unknown).
    pub(super) unnamed_nodes: bool,
    pub(super) type_missing: TypeMissing,
    /// Where the kept nodes' and devices' ports were written.
    pub(super) listen_spans: ListenSpans,
    /// Where each kept device's `expert_memory` was written (on it or on its type).
    pub(super) expert_memory_spans: Vec<Sp>,
}

/// Check a parsed topology file section by section, reporting every problem into `ctx`.
pub(super) fn validate(ctx: &mut Ctx<'_>, raw: &RawTopology) -> Option<Topology> {
    check_format(ctx, &raw.format, "topology", TOPOLOGY_FORMAT);
    let name = check_required(
        ctx,
        &raw.name,
        "top level",
        valid_name("cluster"),
        None,
        "missing `name`; add the cluster name, e.g. `name = \"my-cluster\"`",
    );
    let description = text_or_default(&raw.description);
    let types = validate_device_types(ctx, &raw.device_types);
    let mut built = validate_nodes(ctx, &types, &raw.nodes);
    report_type_missing(ctx, &types, std::mem::take(&mut built.type_missing));
    let raw_routers = router_entries(&raw.router);
    let routers: Vec<RouterSpec> = raw_routers
        .iter()
        .filter_map(|(item, r, span)| validate_router(ctx, item, r, span, &built))
        .collect();
    let measured = raw
        .measured
        .as_ref()
        .map(|m| validate_measured(ctx, m))
        .unwrap_or_default();
    check_total_memory(ctx, &built);
    let topology = Topology {
        name: name.get().unwrap_or_default(),
        description,
        nodes: built.nodes,
        devices: built.devices,
        routers,
        measured,
    };
    if topology.routers.len() == raw_routers.len() {
        let spans: Vec<RouterSpans> = raw_routers
            .iter()
            .map(|(item, r, _)| RouterSpans {
                item: item.clone(),
                port: span_of(&r.port),
                mesh_port: span_of(&r.mesh_port),
            })
            .collect();
        check_port_collisions(ctx, &topology, &built.listen_spans, &spans);
    }
    name.get().map(|_| topology)
}

/// Step: the devices' expert memory adds up to a byte count that fits in 64 bits; the device
/// whose budget takes the sum past it is named.
pub(super) fn check_total_memory(ctx: &mut Ctx<'_>, built: &Built) {
    let mut total = 0u64;
    for (i, d) in built.devices.iter().enumerate() {
        match total.checked_add(d.expert_memory) {
            Some(t) => total = t,
            None => {
                let node = &built.nodes[d.node];
                ctx.at(
                    built.expert_memory_spans.get(i).cloned().flatten(),
                    format!("node \"{}\" device \"{}\"", node.name, d.name),
                    format!(
                        "expert_memory {} brings the devices' total to {}; lower expert_memory to what the device has",
                        format_bytes_in(d.expert_memory, d.expert_memory_unit),
                        crate::units::TOO_MANY_BYTES
                    ),
                );
                return;
            }
        }
    }
}

/// `check`, then report `missing` at `span` when the key is absent.
pub(super) fn check_required<T: Clone, U: Clone>(
    ctx: &mut Ctx<'_>,
    f: &Field<T>,
    item: &str,
    convert: impl FnOnce(T) -> Result<U, String>,
    span: Sp,
    missing: &str,
) -> Val<U> {
    let v = check(ctx, f, item, convert);
    if v.is_absent() {
        ctx.at(span, item, missing);
    }
    v
}

/// `{prefix}{what} "name"`, or `{prefix}{what} #n` (counting from 1) for an entry without a name.
pub(super) fn entry_label(prefix: &str, what: &str, name: &Field<String>, index: usize) -> String {
    match name.as_ref() {
        Some(n) => format!("{prefix}{what} \"{}\"", n.get_ref()),
        None => format!("{prefix}{what} #{}", index + 1),
    }
}

/// Report a NIC or device name used twice on one node, and record the name.
pub(super) fn unique_on_node(
    ctx: &mut Ctx<'_>,
    names: &mut HashSet<String>,
    name: &Val<String>,
    item: &str,
    what: &str,
) {
    if let Some(n) = name.get()
        && !names.insert(n.clone())
    {
        ctx.at(
            name.span(),
            item,
            format!("{what} name \"{n}\" appears twice on this node; names must be unique"),
        );
    }
}

/// Step: the optional `[measured]` numbers per tier.
pub(super) fn validate_measured(ctx: &mut Ctx<'_>, m: &RawMeasured) -> MeasuredTiers {
    MeasuredTiers {
        intra_node: validate_tier(ctx, &m.intra_node, "intra_node"),
        inter_node: validate_tier(ctx, &m.inter_node, "inter_node"),
    }
}

/// One `[measured]` tier, when given.
pub(super) fn validate_tier(
    ctx: &mut Ctx<'_>,
    tier: &Field<RawTier>,
    key: &str,
) -> Option<TierMeasure> {
    let t = tier.as_ref()?;
    let item = format!("[measured] {key}");
    let tr = t.get_ref();
    let bw = check(ctx, &tr.bandwidth_gb_s, &item, positive("bandwidth_gb_s"));
    let lat = check(ctx, &tr.latency_us, &item, non_negative("latency_us"));
    Some(TierMeasure {
        bandwidth_gb_s: bw.get(),
        latency_us: lat.get(),
    })
}
