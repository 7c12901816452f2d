//! Validation of one device of a node: its keys, GPU index, NIC and data port.
//!
//! Why this exists: the per-device checks that depend on its node (its NICs, its data port base,
//! the other devices' names and GPU indices) are one step, kept apart from the node's own keys.

use super::device_types::{
    DeviceFields, DeviceTypes, MissingKeyOwner, device_fields, merge_device_type,
    report_missing_device_keys,
};

use super::nodes::NodeDevices;
use super::raw::RawDevice;
use super::types::{Device, DeviceKind, DeviceRank};
use super::validate::{Built, check_required, entry_label, unique_on_node};
use super::values::{Sp, Val, check, port, small_u32, valid_name};
use crate::diag::{Ctx, Field, did_you_mean, split};
use crate::units::format_bytes_in;
use toml::Spanned;

/// Step: one device — name, keys merged with its type, what its kind needs, GPU index, NIC and
/// data port; appended to `built.devices` when complete.
pub(super) fn validate_device(
    ctx: &mut Ctx<'_>,
    types: &DeviceTypes,
    nd: &mut NodeDevices<'_>,
    di: usize,
    rd: &Spanned<RawDevice>,
    built: &mut Built,
) {
    let d = rd.get_ref();
    let dspan = Some(rd.span());
    let dlabel = entry_label(&format!("{} ", nd.node.label), "device", &d.name, di);
    let dname = check_required(
        ctx,
        &d.name,
        &dlabel,
        valid_name("device"),
        dspan.clone(),
        "missing `name`; give the device a name unique on its node (e.g. \"gpu0\")",
    );
    unique_on_node(ctx, &mut nd.dev_names, &dname, &dlabel, "device");
    let own = device_fields(
        ctx,
        &dlabel,
        &d.kind,
        &d.arch,
        &d.memory_total,
        &d.expert_memory,
        &d.memory_bandwidth_gb_s,
        (&d.int8_tops, &d.bf16_tflops),
        &d.threads,
        &d.price_usd_per_hour,
    );
    let merged = merge_device_type(ctx, types, &dlabel, &d.type_name, own);
    let node_name = nd.node.name.get().unwrap_or_default();
    let owner = MissingKeyOwner {
        // A key missing from a device and its (known) type is reported once per type.
        known_type: d
            .type_name
            .as_ref()
            .map(|t| t.get_ref())
            .filter(|t| types.fields.contains_key(*t)),
        device_id: format!("{node_name}/{}", dname.get().unwrap_or_default()),
        span: dspan.clone(),
        label: &dlabel,
    };
    report_missing_device_keys(ctx, &merged, &owner, &mut built.type_missing);
    check_device_consistency(ctx, &merged, &dspan, &dlabel);
    let numa = check(ctx, &d.numa, &dlabel, small_u32("numa", 0, 1023));
    let gpu_index = check(ctx, &d.gpu_index, &dlabel, small_u32("gpu_index", 0, 1023));
    let gpu_index = resolve_gpu_index(ctx, nd, &merged, gpu_index, &dname, &dspan, &dlabel);
    let nic = resolve_device_nic(ctx, nd, &d.nic, &dspan, &dlabel);
    let own_port = check(ctx, &d.data_port, &dlabel, port("data_port"));
    let port_span = own_port.span().or(nd.node.data_port_base.span());
    let data_port = resolve_data_port(ctx, own_port, &nd.node.data_port_base, di, &dspan, &dlabel);
    let (Some(name), Some(kind), Some(arch), Some(expert_memory), Some(bw)) = (
        dname.get(),
        merged.kind.get(),
        merged.arch.get(),
        merged.expert_memory.get(),
        merged.memory_bandwidth_gb_s.get(),
    ) else {
        return;
    };
    let (Some(nic), Some(data_port)) = (nic, data_port) else {
        return;
    };
    built.listen_spans.data_port.push(port_span);
    built.expert_memory_spans.push(merged.expert_memory.span());
    built.devices.push(Device {
        id: format!("{node_name}/{name}"),
        name,
        rank: DeviceRank(built.devices.len() as u32),
        node: built.nodes.len(),
        type_name: d.type_name.as_ref().map(|t| t.get_ref().clone()),
        kind,
        arch,
        memory_total: merged.memory_total.get().map(|m| m.0),
        expert_memory: expert_memory.0,
        expert_memory_unit: expert_memory.1,
        memory_bandwidth_gb_s: bw,
        int8_tops: merged.int8_tops.get(),
        bf16_tflops: merged.bf16_tflops.get(),
        threads: merged.threads.get(),
        price_usd_per_hour: merged.price_usd_per_hour.get(),
        numa: numa.get(),
        nic,
        data_port,
        gpu_index,
    });
}

/// Step: a device's kind against its arch and `threads`, and its expert budget against its
/// memory.
pub(super) fn check_device_consistency(
    ctx: &mut Ctx<'_>,
    merged: &DeviceFields,
    dspan: &Sp,
    dlabel: &str,
) {
    let kind = merged.kind.get();
    match (kind, merged.arch.get()) {
        (Some(DeviceKind::Gpu), Some(a)) if a == "cpu" => ctx.at(
            merged.arch.span().or(dspan.clone()),
            dlabel,
            "a gpu device needs a gfx arch (e.g. \"gfx942\"), not \"cpu\"",
        ),
        (Some(DeviceKind::Cpu), Some(a)) if a != "cpu" => ctx.at(
            merged.arch.span().or(dspan.clone()),
            dlabel,
            format!("a cpu device has arch = \"cpu\", not \"{a}\""),
        ),
        _ => {}
    }
    if kind == Some(DeviceKind::Gpu) && merged.threads.get().is_some() {
        ctx.at(
            merged.threads.span().or(dspan.clone()),
            dlabel,
            "threads only applies to cpu devices; remove it",
        );
    }
    if let (Some((total, tunit)), Some((budget, bunit))) =
        (merged.memory_total.get(), merged.expert_memory.get())
        && budget > total
    {
        ctx.at(
            merged.expert_memory.span().or(dspan.clone()),
            dlabel,
            format!(
                "expert_memory {} exceeds memory_total {}; lower expert_memory",
                format_bytes_in(budget, bunit),
                format_bytes_in(total, tunit)
            ),
        );
    }
}

/// Step: a GPU's HIP ordinal — given, or its order among the node's GPUs — unique on its node;
/// `gpu_index` on another kind of device is reported.
pub(super) fn resolve_gpu_index(
    ctx: &mut Ctx<'_>,
    nd: &mut NodeDevices<'_>,
    merged: &DeviceFields,
    given: Val<u32>,
    dname: &Val<String>,
    dspan: &Sp,
    dlabel: &str,
) -> Option<u32> {
    if merged.kind.get() != Some(DeviceKind::Gpu) {
        if given.get().is_some() {
            ctx.at(
                given.span(),
                dlabel,
                "gpu_index only applies to gpu devices; remove it",
            );
        }
        return None;
    }
    let idx = given.get().unwrap_or(nd.gpu_count);
    nd.gpu_count += 1;
    if let Some(prev) = nd.gpu_indices.insert(idx, dname.get().unwrap_or_default()) {
        ctx.at(
            given.span().or(dspan.clone()),
            dlabel,
            format!(
                "gpu_index {idx} is already used by device \"{prev}\" on this node; set distinct gpu_index values"
            ),
        );
    }
    Some(idx)
}

/// Step: the NIC a device sends through — the one it names, or its node's only NIC.
pub(super) fn resolve_device_nic(
    ctx: &mut Ctx<'_>,
    nd: &NodeDevices<'_>,
    nic: &Field<String>,
    dspan: &Sp,
    dlabel: &str,
) -> Option<usize> {
    match split(nic) {
        (Some(n), span) => {
            let found = nd.nic_names.iter().position(|x| *x == n);
            if found.is_none() {
                let hint = did_you_mean(&n, nd.nic_names.iter().map(String::as_str), || {
                    format!("this node's NICs: {}", nd.nic_names.join(", "))
                });
                ctx.at(span, dlabel, format!("unknown NIC \"{n}\"; {hint}"));
            }
            found
        }
        (None, _) if nd.nic_count == 1 => Some(0),
        (None, _) if nd.nic_count == 0 => None,
        (None, _) => {
            ctx.at(
                dspan.clone(),
                dlabel,
                format!(
                    "missing `nic`; this node has {} NICs ({}), say which one this device sends through",
                    nd.nic_count,
                    nd.nic_names.join(", ")
                ),
            );
            None
        }
    }
}

/// Step: a device's data port — its own, or its node's `data_port` plus its index there.
pub(super) fn resolve_data_port(
    ctx: &mut Ctx<'_>,
    own: Val<u16>,
    base: &Val<u16>,
    di: usize,
    dspan: &Sp,
    dlabel: &str,
) -> Option<u16> {
    match (own, base) {
        (Val::Ok(p, _), _) => Some(p),
        (Val::Invalid, _) | (Val::Absent, Val::Invalid) => None,
        (Val::Absent, Val::Ok(base, bspan)) => {
            let p = *base as u32 + di as u32;
            if p > 65535 {
                ctx.at(
                    bspan.clone(),
                    dlabel,
                    format!(
                        "data_port {base} + device index {di} = {p} exceeds 65535; lower the node's data_port"
                    ),
                );
                None
            } else {
                Some(p as u16)
            }
        }
        (Val::Absent, Val::Absent) => {
            ctx.at(
                dspan.clone(),
                dlabel,
                "no data port; set `data_port` on the node (device i uses data_port + i) or on the device",
            );
            None
        }
    }
}
