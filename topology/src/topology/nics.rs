//! Validation of a node's NICs: kind, speed, MTU for the kind, RoCE GID selection, traffic class.
//!
//! Why this exists: a NIC's keys depend on its kind (RoCE MTU range, GID keys only for RoCE), a
//! concern of its own.

use super::nodes::NodeHeader;
use super::raw::RawNic;
use super::types::{GidSelection, Nic, NicKind};
use super::validate::{check_required, entry_label, unique_on_node};
use super::values::{NIC_KINDS, check, int_in, one_of, positive, small_u32, valid_name};
use crate::diag::{Ctx, Field, span_of};
use std::collections::HashSet;
use std::net::Ipv4Addr;
use toml::Spanned;

/// Step: a node's NICs: the valid ones, and the names of all that have a valid name (what
/// devices' `nic` may refer to).
pub(super) fn validate_nics(
    ctx: &mut Ctx<'_>,
    node: &NodeHeader,
    raw: &Field<Vec<Spanned<RawNic>>>,
) -> (Vec<Nic>, Vec<String>) {
    let raw_nics: &[Spanned<RawNic>] = raw.as_ref().map_or(&[], |n| n.get_ref());
    if raw_nics.is_empty() {
        ctx.at(
            span_of(raw).or(node.span.clone()),
            &node.label,
            "no NICs; add `nics = [{ name = \"eth0\", kind = \"tcp\", speed_gbit_s = 100, mtu = 1500 }]`",
        );
    }
    let mut nics = Vec::new();
    let mut names = Vec::new();
    let mut seen = HashSet::new();
    for (ci, rc) in raw_nics.iter().enumerate() {
        if let Some(nic) = validate_nic(ctx, &node.label, ci, rc, &mut seen) {
            nics.push(nic);
        }
        if let Some(n) = rc.get_ref().name.as_ref().map(|n| n.get_ref())
            && valid_name("NIC")(n.clone()).is_ok()
        {
            names.push(n.clone());
        }
    }
    (nics, names)
}

/// Step: one NIC — name (unique on its node), kind, speed, MTU, GID selection, traffic class.
pub(super) fn validate_nic(
    ctx: &mut Ctx<'_>,
    label: &str,
    ci: usize,
    rc: &Spanned<RawNic>,
    names: &mut HashSet<String>,
) -> Option<Nic> {
    let c = rc.get_ref();
    let cspan = Some(rc.span());
    let clabel = entry_label(&format!("{label} "), "NIC", &c.name, ci);
    let name = check_required(
        ctx,
        &c.name,
        &clabel,
        valid_name("NIC"),
        cspan.clone(),
        "missing `name`; give the interface or RDMA device name",
    );
    unique_on_node(ctx, names, &name, &clabel, "NIC");
    let kind = check_required(
        ctx,
        &c.kind,
        &clabel,
        one_of("kind", NIC_KINDS),
        cspan.clone(),
        "missing `kind`; use kind = \"roce\" or kind = \"tcp\"",
    );
    let speed = check_required(
        ctx,
        &c.speed_gbit_s,
        &clabel,
        positive("speed_gbit_s"),
        cspan.clone(),
        "missing `speed_gbit_s`; give the line rate in Gbit/s (e.g. 400)",
    );
    let mtu = check_required(
        ctx,
        &c.mtu,
        &clabel,
        mtu_for(kind.get()),
        cspan,
        "missing `mtu`; give the interface MTU (1500, or 9000 for jumbo frames)",
    );
    let gid = gid_selection(ctx, &clabel, c, kind.get());
    let traffic_class = gid.1;
    let (Some(kind), Some(speed_gbit_s), Some(mtu)) = (kind.get(), speed.get(), mtu.get()) else {
        return None;
    };
    Some(Nic {
        name: name.get().unwrap_or_default(),
        kind,
        speed_gbit_s,
        mtu,
        gid: gid.0,
        traffic_class,
    })
}

/// The `check` conversion for a NIC's MTU: the range of its kind (TCP's when unknown).
pub(super) fn mtu_for(kind: Option<NicKind>) -> impl FnOnce(i64) -> Result<u32, String> {
    let (lo, hi) = match kind {
        Some(NicKind::Roce) => (1280, 9216),
        _ => (68, 65536),
    };
    move |v| {
        if (lo..=hi).contains(&v) {
            Ok(v as u32)
        } else {
            Err(format!(
                "mtu = {v} is out of range for a {} NIC; use {lo} to {hi} (e.g. 9000 for jumbo frames)",
                kind.map_or("tcp", NicKind::name)
            ))
        }
    }
}

/// Step: a NIC's GID selection (`gid_ipv4` or `gid_index`, RoCE only) and its traffic class.
pub(super) fn gid_selection(
    ctx: &mut Ctx<'_>,
    clabel: &str,
    c: &RawNic,
    kind: Option<NicKind>,
) -> (GidSelection, Option<u8>) {
    let gid_ipv4 = check(ctx, &c.gid_ipv4, clabel, |s: String| {
        s.parse::<Ipv4Addr>()
            .map_err(|_| format!("gid_ipv4 \"{s}\" is not an IPv4 address"))
    });
    let gid_index = check(ctx, &c.gid_index, clabel, small_u32("gid_index", 0, 255));
    let traffic_class = check(ctx, &c.traffic_class, clabel, |v| {
        int_in("traffic_class", 0, 255)(v).map(|v| v as u8)
    });
    if kind == Some(NicKind::Tcp) {
        for (f, key) in [
            (span_of(&c.gid_ipv4), "gid_ipv4"),
            (span_of(&c.gid_index), "gid_index"),
        ] {
            if f.is_some() {
                ctx.at(
                    f,
                    clabel,
                    format!("{key} only applies to kind = \"roce\"; remove it or change kind"),
                );
            }
        }
        return (GidSelection::Auto, traffic_class.get());
    }
    let gid = match (gid_ipv4.get(), gid_index.get()) {
        (Some(_), Some(_)) => {
            ctx.at(
                gid_index.span(),
                clabel,
                "set either gid_ipv4 or gid_index, not both (gid_ipv4 is robust against GID index shifts)",
            );
            GidSelection::Auto
        }
        (Some(ip), None) => GidSelection::Ipv4(ip),
        (None, Some(i)) => GidSelection::Index(i),
        (None, None) => GidSelection::Auto,
    };
    (gid, traffic_class.get())
}
