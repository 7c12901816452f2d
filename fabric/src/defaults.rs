//! The files a local fabric runs with when none are given: the embedded single-host example
//! (topology, and its placement of `demo-small`), or a balanced placement planned on the spot.
//!
//! Why this exists: a user trying a topology and a model should get a running fabric without
//! writing a placement first, and `demo` and `bench fabric` run from any directory. A planned
//! placement uses the planner's defaults (balanced packing, no statistics, shared experts on
//! the router) and is written to a temporary file; for load-aware, replicated placements run
//! `expertmesh plan` and pass `--placement`.

use crate::FabricError;
use expertmesh_planner::{self as plan, PlanOptions};
use expertmesh_topology::topology::Topology;
use std::path::{Path, PathBuf};

/// Plan a balanced placement and write it to a temporary file; returns its path and the
/// directory guard (the file lives as long as the guard).
pub fn balanced_placement_file(
    topology: &Path,
    model: &str,
) -> Result<(PathBuf, Option<tempfile::TempDir>), FabricError> {
    let topo = Topology::load(topology).map_err(FabricError::Topology)?;
    let spec = expertmesh_topology::resolve_model(model).map_err(FabricError::Model)?;
    let opts = PlanOptions {
        description: "balanced default of expertmesh up".into(),
        ..PlanOptions::default()
    };
    let p =
        plan::plan(&topo, &spec, None, None, &opts).map_err(|cause| FabricError::NoPlacement {
            model: spec.name.clone(),
            cluster: topo.name().to_string(),
            cause,
        })?;
    let dir = tempfile::Builder::new()
        .prefix("expertmesh-up-")
        .tempdir()?;
    let path = dir.path().join("placement.toml");
    std::fs::write(&path, p.placement.to_toml_string())?;
    Ok((path, Some(dir)))
}

/// The single-host example topology, embedded so the demo runs from any directory.
pub const SINGLE_HOST_TOPOLOGY: &str = include_str!("../../examples/single-host.toml");
/// Its placement of `demo-small`.
pub(crate) const SINGLE_HOST_PLACEMENT: &str =
    include_str!("../../examples/single-host-demo-small.placement.toml");

/// The files a local run uses: the given ones, or the embedded single-host topology and (for
/// `demo-small`) its placement written to `dir`, or a balanced plan. The returned guard keeps a
/// planned placement's temporary file alive.
pub fn local_files(
    dir: &std::path::Path,
    topology: Option<&std::path::Path>,
    model: &str,
    placement: Option<&std::path::Path>,
) -> Result<(PathBuf, PathBuf, Option<tempfile::TempDir>), FabricError> {
    let topo = match topology {
        Some(p) => p.to_path_buf(),
        None => {
            let p = dir.join("single-host.toml");
            std::fs::write(&p, SINGLE_HOST_TOPOLOGY)?;
            p
        }
    };
    Ok(match placement {
        Some(p) => (topo, p.to_path_buf(), None),
        None if model == "demo-small" && topology.is_none() => {
            let p = dir.join("single-host-demo-small.placement.toml");
            std::fs::write(&p, SINGLE_HOST_PLACEMENT)?;
            (topo, p, None)
        }
        None => {
            let (p, guard) = balanced_placement_file(&topo, model)?;
            (topo, p, guard)
        }
    })
}
