//! A placement for `expertmesh up` when none is given.
//!
//! Why this exists: a user trying a topology and a model should get a running fabric without
//! writing a placement first. The default spreads each layer's experts round-robin over the
//! devices (equal counts, ±1) with shared experts on the router; `expertmesh plan` computes
//! better ones (load-aware, replicated) and writes files `up --placement` takes.

use anyhow::anyhow;
use expertmesh_topology::placement::{Placement, SharedLocation};
use expertmesh_topology::topology::Topology;
use std::path::{Path, PathBuf};

/// Write a round-robin placement to a temporary file; returns its path and the directory guard.
pub fn balanced_placement_file(
    topology: &Path,
    model: &str,
) -> anyhow::Result<(PathBuf, Option<tempfile::TempDir>)> {
    let topo = Topology::load(topology).map_err(|e| anyhow!("{e}"))?;
    let spec = expertmesh_topology::resolve_model(model).map_err(|e| anyhow!("{e}"))?;
    let n = topo.devices().len();
    let layers = spec.moe_layer_ids();
    let slots: Vec<Vec<Vec<u32>>> = layers
        .iter()
        .map(|_| {
            (0..n)
                .map(|d| {
                    (0..spec.routed_experts)
                        .filter(|e| *e as usize % n == d)
                        .collect()
                })
                .collect()
        })
        .collect();
    let shared = vec![SharedLocation::Router; layers.len()];
    let p = Placement::new(&topo, &spec, slots, shared, "round-robin default of expertmesh up")
        .map_err(|problems| {
            let list: Vec<String> = problems.iter().map(|p| format!("  {p}")).collect();
            anyhow!("the default round-robin placement does not fit; run `expertmesh plan` and pass --placement:\n{}", list.join("\n"))
        })?;
    let dir = tempfile::Builder::new()
        .prefix("expertmesh-up-")
        .tempdir()?;
    let path = dir.path().join("placement.toml");
    std::fs::write(&path, p.to_toml_string())?;
    Ok((path, Some(dir)))
}
