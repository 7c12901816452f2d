//! The files of an emulated cluster: a model with small experts and a wide hidden vector (so
//! the network, not the two cores, binds), a topology of `N` one-CPU nodes on scaled-down TCP
//! NICs with `R` routers, and the planner's balanced placement.

use super::ClusterBenchOptions;
use crate::BenchError;
use expertmesh_planner::{PlanOptions, plan};
use expertmesh_topology::model::ModelSpec;
use expertmesh_topology::{Placement, Topology, resolve_model};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// Where the generated files are, and what they hold.
pub(super) struct ClusterFiles {
    /// Model TOML.
    pub(super) model_path: PathBuf,
    /// Topology TOML.
    pub(super) topology_path: PathBuf,
    /// Placement TOML.
    pub(super) placement_path: PathBuf,
    /// The model.
    pub(super) model: ModelSpec,
    /// The topology.
    pub(super) topology: Topology,
    /// The placement.
    pub(super) placement: Placement,
}

/// The model file: every layer MoE, softmax top-k, no shared expert.
pub(super) fn model_toml(o: &ClusterBenchOptions) -> String {
    format!(
        "# Written by `expertmesh bench cluster`: wide hidden vectors, small experts, so that\n\
         # the network binds on a small machine.\n\
         format = 1\nname = \"emulated\"\n\
         description = \"bench cluster: {layers} MoE layers, {e} experts, top-{k}, H {h}, F {f}\"\n\
         num_layers = {layers}\nfirst_dense_layers = 0\nmoe_layer_step = 1\nhidden = {h}\n\
         routed_experts = {e}\ntop_k = {k}\nmoe_intermediate = {f}\nshared_experts = 0\n\
         shared_intermediate = 0\nshared_expert_gate = false\nscoring = \"softmax\"\n\
         norm_topk_prob = true\nrouted_scaling_factor = 1.0\nn_group = 1\ntopk_group = 1\n\n\
         [quant]\ngroup_size = 32\nscale_dtype = \"bf16\"\nzero_points = false\n",
        layers = o.layers,
        e = o.experts,
        k = o.top_k,
        h = o.hidden,
        f = o.moe_inter,
    )
}

/// The topology file: nodes `n0..`, one CPU device each, one TCP NIC at the scaled line rate;
/// routers on nodes `0..routers` (one `[[router]]` entry each).
pub(super) fn topology_toml(o: &ClusterBenchOptions, routers: usize) -> String {
    let mut t = format!(
        "# Written by `expertmesh bench cluster`: {n} nodes as network namespaces, NICs shaped\n\
         # with tc tbf to {rate} Mbit/s ({scale}).\n\
         format = 1\nname = \"emulated-{n}x1\"\n\
         description = \"emulated cluster: {n} one-CPU nodes on {rate} Mbit/s TCP, {routers} router(s)\"\n\n",
        n = o.nodes,
        rate = o.line_rate_mbit,
        scale = o
            .scaled_from
            .as_deref()
            .unwrap_or("line rate given on the command line"),
    );
    for r in 0..routers {
        let _ = writeln!(t, "[[router]]\nnode = \"n{r}\"\nport = 7000\n");
    }
    let devices: Vec<String> = (0..o.devices_per_node)
        .map(|k| {
            format!(
                "  {{ name = \"cpu{k}\", kind = \"cpu\", arch = \"cpu\", threads = 1, \
                 expert_memory = \"256 MiB\", memory_bandwidth_gb_s = 10 }},"
            )
        })
        .collect();
    for i in 0..o.nodes {
        let _ = writeln!(
            t,
            "[[nodes]]\nname = \"n{i}\"\naddress = \"{addr}\"\ncontrol_port = 7100\n\
             data_port = 7200\nintra_link = \"shm\"\nintra_bandwidth_gb_s = 10\n\
             nics = [{{ name = \"eth0\", kind = \"tcp\", speed_gbit_s = {gbit}, mtu = {mtu} }}]\n\
             devices = [\n{devices}\n]\n",
            addr = super::netns::Emulation::node_address(i),
            gbit = o.line_rate_mbit / 1000.0,
            mtu = o.mtu,
            devices = devices.join("\n"),
        );
    }
    t
}

/// Write the model, topology and placement for `routers` routers into `dir`, and load them back
/// (the same validation every process applies).
pub(super) fn write(
    dir: &Path,
    o: &ClusterBenchOptions,
    routers: usize,
) -> Result<ClusterFiles, BenchError> {
    let model_path = dir.join("model.toml");
    let topology_path = dir.join(format!("topology-{routers}r.toml"));
    let placement_path = dir.join("placement.toml");
    let cannot_write = |p: &Path| BenchError::io(format!("cannot write {}", p.display()));
    std::fs::write(&model_path, model_toml(o)).map_err(cannot_write(&model_path))?;
    std::fs::write(&topology_path, topology_toml(o, routers))
        .map_err(cannot_write(&topology_path))?;
    let model = resolve_model(&model_path.to_string_lossy()).map_err(BenchError::Model)?;
    let topology = Topology::load(&topology_path).map_err(BenchError::File)?;
    let planned =
        plan(&topology, &model, None, None, &PlanOptions::default()).map_err(|cause| {
            BenchError::Plan {
                what: "planning the emulated cluster",
                cause,
            }
        })?;
    let text = format!(
        "# Written by `expertmesh bench cluster`: the planner's balanced placement.\n{}",
        planned.placement.to_toml_string()
    );
    std::fs::write(&placement_path, text).map_err(cannot_write(&placement_path))?;
    let placement =
        Placement::load(&placement_path, &topology, &model).map_err(BenchError::File)?;
    Ok(ClusterFiles {
        model_path,
        topology_path,
        placement_path,
        model,
        topology,
        placement,
    })
}
