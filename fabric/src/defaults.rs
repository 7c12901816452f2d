//! A placement for `expertmesh up` (and the demo with another topology) when none is given.
//!
//! Why this exists: a user trying a topology and a model should get a running fabric without
//! writing a placement first. This runs the planner with its defaults (balanced packing, no
//! statistics, shared experts on the router) and writes the result to a temporary file; for
//! load-aware, replicated placements run `expertmesh plan` and pass `--placement`.

use anyhow::anyhow;
use expertmesh_planner::{self as plan, PlanOptions};
use expertmesh_topology::topology::Topology;
use std::path::{Path, PathBuf};

/// Plan a balanced placement and write it to a temporary file; returns its path and the
/// directory guard (the file lives as long as the guard).
pub fn balanced_placement_file(
    topology: &Path,
    model: &str,
) -> anyhow::Result<(PathBuf, Option<tempfile::TempDir>)> {
    let topo = Topology::load(topology).map_err(|e| anyhow!("{e}"))?;
    let spec = expertmesh_topology::resolve_model(model).map_err(|e| anyhow!("{e}"))?;
    let opts = PlanOptions {
        description: "balanced default of expertmesh up".into(),
        ..PlanOptions::default()
    };
    let p = plan::plan(&topo, &spec, None, None, &opts).map_err(|e| {
        anyhow!(
            "no placement of {} fits {}: {e}; see `expertmesh plan`",
            spec.name,
            topo.name()
        )
    })?;
    let dir = tempfile::Builder::new()
        .prefix("expertmesh-up-")
        .tempdir()?;
    let path = dir.path().join("placement.toml");
    std::fs::write(&path, p.placement.to_toml_string())?;
    Ok((path, Some(dir)))
}
