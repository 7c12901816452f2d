//! Validation of `[router]` / `[[router]]` and of every listening port in the file.
//!
//! Why this exists: routers name a node and claim ports; two listeners on one host and port (two
//! routers, a router and a worker, two workers) are refused here, naming both.

use super::hosts;
use super::hosts::{Addr, Host};
use super::raw::{RawRouter, RawRouters};
use super::types::{RouterSpec, Topology};
use super::validate::{Built, check_required};
use super::values::{Sp, check, port, valid_host};
use crate::diag::{Ctx, Field, did_you_mean, split};
use std::collections::HashMap;

/// The router entries of the file with their item labels ("\[router\]", or "router 2" for the
/// second `[[router]]` table) and spans.
pub(super) fn router_entries(raw: &Field<RawRouters>) -> Vec<(String, &RawRouter, Sp)> {
    let Some(rr) = raw else {
        return Vec::new();
    };
    match rr.get_ref() {
        RawRouters::One(r) => vec![("[router]".to_owned(), r, Some(rr.span()))],
        RawRouters::Many(list) if list.len() == 1 => {
            vec![(
                "[router]".to_owned(),
                list[0].get_ref(),
                Some(list[0].span()),
            )]
        }
        RawRouters::Many(list) => list
            .iter()
            .enumerate()
            .map(|(i, r)| (format!("router {}", i + 1), r.get_ref(), Some(r.span())))
            .collect(),
    }
}

/// Step: one `[router]` / `[[router]]` section.
pub(super) fn validate_router(
    ctx: &mut Ctx<'_>,
    item: &str,
    r: &RawRouter,
    rspan: &Sp,
    built: &Built,
) -> Option<RouterSpec> {
    let nodes = &built.nodes;
    let node = router_node(ctx, item, r, rspan, built);
    let listen = check(ctx, &r.listen_address, item, valid_host("listen_address"));
    let mesh_port = check(ctx, &r.mesh_port, item, port("mesh_port"));
    let port = check_required(
        ctx,
        &r.port,
        item,
        port("port"),
        rspan.clone(),
        "missing `port`; give the port serving frontends connect to",
    );
    let (node, port) = (node?, port.get()?);
    let mesh_port = match mesh_port.get() {
        Some(p) => p,
        None if r.mesh_port.is_some() => return None,
        None => nodes[node].control_port,
    };
    Some(RouterSpec {
        node,
        listen_address: listen.get().unwrap_or_else(|| nodes[node].address.clone()),
        port,
        mesh_port,
    })
}

/// The node the router runs on; an unknown name is reported (one of a node that failed
/// validation is not: that node's problems are already reported; nor is any name while some
/// node has no valid name: it may be the one meant).
pub(super) fn router_node(
    ctx: &mut Ctx<'_>,
    item: &str,
    r: &RawRouter,
    rspan: &Sp,
    built: &Built,
) -> Option<usize> {
    let (nodes, node_names) = (&built.nodes, &built.node_names);
    let (n, span) = match split(&r.node) {
        (None, _) => {
            ctx.at(
                rspan.clone(),
                item,
                "missing `node`; name the node the router runs on",
            );
            return None;
        }
        (Some(n), span) => (n, span),
    };
    let found = nodes.iter().position(|x| x.name == n);
    if found.is_none()
        && !node_names.contains_key(&n)
        && !node_names.is_empty()
        && !built.unnamed_nodes
    {
        let mut names: Vec<(&usize, &String)> = node_names.iter().map(|(k, v)| (v, k)).collect();
        names.sort();
        let hint = did_you_mean(&n, node_names.keys().map(String::as_str), || {
            let listed: Vec<&str> = names.iter().take(8).map(|(_, k)| k.as_str()).collect();
            let more = names.len().saturating_sub(listed.len());
            format!(
                "nodes: {}{}",
                listed.join(", "),
                if more > 0 {
                    format!(" and {more} more")
                } else {
                    String::new()
                }
            )
        });
        ctx.at(span, item, format!("unknown node \"{n}\"; {hint}"));
    }
    found
}

/// Where the listeners of the cluster were written, for locating port collisions: the span of
/// each node's `control_port` and of each device's data port (its own, or its node's base).
#[derive(Default)]
pub(super) struct ListenSpans {
    pub(super) control_port: Vec<Sp>,
    pub(super) data_port: Vec<Sp>,
}

/// Sockets already claimed: (address, port) → who listens there, and the address as written.
pub(super) struct PortClaims {
    pub(super) hosts: HashMap<String, Host>,
    pub(super) taken: HashMap<(Addr, u16), (String, String)>,
}

/// One listener: who, on which written address (and, for a wildcard, which addresses that
/// covers), on which port, and where it was written.
pub(super) struct Listener<'a> {
    pub(super) who: String,
    pub(super) item: &'a str,
    pub(super) host: &'a str,
    pub(super) also: &'a [&'a str],
    pub(super) port: u16,
    pub(super) span: Sp,
}

impl PortClaims {
    /// Claim a listener's socket; one already claimed by another listener is reported at the
    /// listener's port.
    pub(super) fn claim(&mut self, ctx: &mut Ctx<'_>, l: Listener<'_>) {
        let Some(host) = self.hosts.get(l.host).cloned() else {
            return;
        };
        let mut addrs = host.addrs.clone();
        if host.wildcard {
            for h in l.also {
                addrs.extend(
                    self.hosts
                        .get(*h)
                        .map_or(&[][..], |x| &x.addrs)
                        .iter()
                        .cloned(),
                );
            }
        }
        let clash = addrs.iter().find_map(|a| {
            self.taken
                .get(&(a.clone(), l.port))
                .map(|p| (a.clone(), p.clone()))
        });
        if let Some((addr, (prev, prev_host))) = clash {
            let msg = self.clash_message(&l, &host, &addr, &prev, &prev_host);
            ctx.at(l.span.clone(), l.item, msg);
        }
        for a in addrs {
            self.taken
                .entry((a, l.port))
                .or_insert_with(|| (l.who.clone(), l.host.to_owned()));
        }
    }

    /// `{who} uses port P on {host}, which {prev} already uses[ on {prev host} (why that is the
    /// same socket)]; give it another port`.
    pub(super) fn clash_message(
        &self,
        l: &Listener<'_>,
        host: &Host,
        addr: &Addr,
        prev: &str,
        prev_host: &str,
    ) -> String {
        let (who, port, written) = (&l.who, l.port, l.host);
        if prev_host.eq_ignore_ascii_case(written) {
            return format!(
                "{who} uses port {port} on {written}, which {prev} already uses; give it another port"
            );
        }
        let ip = match addr {
            Addr::Ip(ip) => ip.to_string(),
            Addr::Name(n) => n.clone(),
        };
        let mut why = Vec::new();
        if host.wildcard {
            why.push(format!("{written} listens on every address of its node"));
        }
        for h in [written, prev_host] {
            if self.hosts.get(h).is_some_and(|x| x.resolved_name) {
                why.push(format!("{h} resolves to {ip}"));
            }
        }
        let why = if why.is_empty() {
            String::new()
        } else {
            format!(" ({}: the same socket)", why.join(", "))
        };
        format!(
            "{who} uses port {port} on {written}, which {prev} already uses on {prev_host}{why}; give it another port"
        )
    }
}

/// Where a router entry's ports were written.
pub(super) struct RouterSpans {
    pub(super) item: String,
    pub(super) port: Sp,
    pub(super) mesh_port: Sp,
}

/// Step: port collisions between everything that listens, on one machine or on addresses that
/// resolve to one machine.
pub(super) fn check_port_collisions(
    ctx: &mut Ctx<'_>,
    t: &Topology,
    spans: &ListenSpans,
    routers: &[RouterSpans],
) {
    let written = t
        .nodes
        .iter()
        .flat_map(|n| [n.address.as_str(), n.data_address.as_str()])
        .chain(t.routers.iter().map(|r| r.listen_address.as_str()));
    let mut claims = PortClaims {
        hosts: hosts::resolve_all(written),
        taken: HashMap::new(),
    };
    for (ni, node) in t.nodes.iter().enumerate() {
        let label = format!("node \"{}\"", node.name);
        claims.claim(
            ctx,
            Listener {
                who: format!("{label} control_port"),
                item: &label,
                host: &node.address,
                also: &[],
                port: node.control_port,
                span: spans.control_port.get(ni).cloned().flatten(),
            },
        );
        for rank in node.device_ranks() {
            let d = &t.devices[rank.index()];
            let item = format!("{label} device \"{}\"", d.name);
            claims.claim(
                ctx,
                Listener {
                    who: format!("device \"{}\" data port", d.id),
                    item: &item,
                    host: &node.data_address,
                    also: &[],
                    port: d.data_port,
                    span: spans.data_port.get(rank.index()).cloned().flatten(),
                },
            );
        }
    }
    claim_router_ports(ctx, t, routers, &mut claims);
}

/// The routers' frontend ports and mesh ports. A router's mesh listener on its node's
/// `control_port` is that node's control listener (already claimed); a second router on the
/// node needs its own `mesh_port`.
pub(super) fn claim_router_ports(
    ctx: &mut Ctx<'_>,
    t: &Topology,
    routers: &[RouterSpans],
    claims: &mut PortClaims,
) {
    let mut control_used: HashMap<usize, &str> = HashMap::new();
    for (r, sp) in t.routers.iter().zip(routers) {
        let node = &t.nodes[r.node];
        let who = if t.routers.len() == 1 {
            "the router port".to_owned()
        } else {
            format!("the {} port", sp.item)
        };
        claims.claim(
            ctx,
            Listener {
                who,
                item: &sp.item,
                host: &r.listen_address,
                also: &[node.address.as_str(), node.data_address.as_str()],
                port: r.port,
                span: sp.port.clone(),
            },
        );
        if r.mesh_port != node.control_port {
            claims.claim(
                ctx,
                Listener {
                    who: format!("the {} mesh_port", sp.item),
                    item: &sp.item,
                    host: &node.address,
                    also: &[],
                    port: r.mesh_port,
                    span: sp.mesh_port.clone(),
                },
            );
        } else if let Some(first) = control_used.insert(r.node, &sp.item) {
            ctx.at(
                sp.mesh_port.clone(),
                &sp.item,
                format!(
                    "{first} already listens for workers on node \"{}\"'s control_port {}; \
                     give this router its own `mesh_port`",
                    node.name, node.control_port
                ),
            );
        }
    }
}
