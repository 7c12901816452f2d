//! The placement planner: where every expert of a model goes on a cluster, and what that will
//! serve — the library behind `expertmesh plan`.
//!
//! Why this exists: cluster builders ask "does Kimi K2 fit on these machines, where does every
//! expert go, what will it serve and at what cost, and what is the bottleneck?" before buying or
//! wiring anything. [`plan`] answers the first two with a [`Placement`] the fabric loads
//! directly; [`evaluate::Evaluator`] answers the rest.
//!
//! # How a plan is made
//!
//! 1. **Memory** ([`capacity`]): shared experts go where [`SharedPolicy`] says (default: the
//!    router host, see there); each device's remaining budget is a whole number of expert slots.
//!    Every MoE layer gets `E + R` slots (`R` = `--redundant`, replica slots per layer), split
//!    over devices in proportion to memory bandwidth within what their memory holds, and spread
//!    evenly over layers. No fit → [`PlanError::DoesNotFit`] with the shortfall per device and in
//!    total.
//! 2. **Experts per layer** ([`packing`]), with expert loads from statistics
//!    ([`stats::LoadStats`]; uniform without):
//!    - *global*: replicate the expert with the highest load per replica until the layer's slots
//!      are used (DeepSeek EPLB), then pack replicas onto devices heaviest first, each onto the
//!      device that ends up lightest, never two replicas of an expert on one device, then improve
//!      by local search; with uniform loads this is a round-robin spread;
//!    - *hierarchical*: first split the layer's experts over nodes — by expert group when the
//!      model's group-limited routing lines up with the nodes (`n_group % nodes == 0`, so a
//!      token's experts stay within `topk_group` groups' nodes), by single experts otherwise —
//!      balancing node loads; with co-selection statistics ([`stats::CoSelection`]), swap
//!      groups/experts between nodes to keep often co-selected ones together while no node's
//!      load exceeds `(1 + locality_slack)` × the mean (or the balanced maximum, if higher);
//!      then replicate and pack inside each node as above.
//!    - *auto* (default): hierarchical when groups line up with nodes or co-selection
//!      statistics are given and the cluster has several nodes; global otherwise.
//! 3. Each device's experts are listed in ascending order; the result is validated by
//!    [`Placement::new`] (coverage, distinct replicas, budgets) before it is returned.
//!
//! Default `R` (when not given): with statistics, one replica slot per device per layer, or as
//! many as the memory left over allows if fewer; without statistics, none.

pub mod calibrate;
pub mod capacity;
pub mod eplb;
pub mod evaluate;
pub mod packing;
pub mod stats;
pub mod synthetic;
pub mod transition;
pub mod wire;

pub use capacity::{SharedPolicy, Shortfall};

use crate::packing::{Affinity, Bin, improve_locality, partition, replicate_and_pack};
use crate::stats::{CoSelection, LoadStats};
use expertmesh_topology::model::ModelSpec;
use expertmesh_topology::placement::Placement;
use expertmesh_topology::topology::Topology;
use expertmesh_topology::units::format_bytes;

/// Most units (experts or groups) per layer the locality swaps handle (they are quadratic);
/// beyond it co-selection statistics are used for the traffic estimate only.
pub const MAX_LOCALITY_UNITS: usize = 1024;

/// How experts are spread over the cluster.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Strategy {
    /// Hierarchical when it helps (groups line up with nodes, or co-selection statistics), else
    /// global.
    #[default]
    Auto,
    /// Replicate and pack over all devices at once.
    Global,
    /// Nodes first, then devices inside each node.
    Hierarchical,
}

impl Strategy {
    /// Every strategy, in the order the command line lists them.
    pub const ALL: [Strategy; 3] = [Strategy::Auto, Strategy::Global, Strategy::Hierarchical];

    /// The name used on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Strategy::Auto => "auto",
            Strategy::Global => "global",
            Strategy::Hierarchical => "hierarchical",
        }
    }
}

impl std::str::FromStr for Strategy {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Strategy::ALL
            .into_iter()
            .find(|x| x.name() == s)
            .ok_or_else(|| {
                let names: Vec<_> = Strategy::ALL.map(Strategy::name).into();
                format!("unknown strategy {s:?}: one of {}", names.join(", "))
            })
    }
}

/// The strategy a plan actually used.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum StrategyUsed {
    /// All devices at once.
    Global,
    /// Expert groups to nodes, then devices.
    HierarchicalGroups,
    /// Co-selected experts to nodes, then devices.
    HierarchicalLocality,
    /// Experts to nodes by load, then devices.
    Hierarchical,
}

impl StrategyUsed {
    /// The name used in reports.
    pub fn name(self) -> &'static str {
        match self {
            StrategyUsed::Global => "global",
            StrategyUsed::HierarchicalGroups => "hierarchical-groups",
            StrategyUsed::HierarchicalLocality => "hierarchical-locality",
            StrategyUsed::Hierarchical => "hierarchical",
        }
    }
}

/// What the planner may choose.
#[derive(Clone, Debug, PartialEq)]
pub struct PlanOptions {
    /// Replica slots per layer (None: the default above).
    pub redundant: Option<u32>,
    /// Global, hierarchical or auto.
    pub strategy: Strategy,
    /// Where shared experts go.
    pub shared: SharedPolicy,
    /// How far above the mean a node's load may go for the sake of locality (0.05 = 5%).
    pub locality_slack: f64,
    /// Free text for the placement file.
    pub description: String,
}

impl Default for PlanOptions {
    fn default() -> Self {
        PlanOptions {
            redundant: None,
            strategy: Strategy::Auto,
            shared: SharedPolicy::Router,
            locality_slack: 0.05,
            description: String::new(),
        }
    }
}

/// A plan: the placement and how it was made.
#[derive(Clone, Debug)]
pub struct Plan {
    /// The placement (validated).
    pub placement: Placement,
    /// The strategy used.
    pub strategy: StrategyUsed,
    /// Replica slots per layer.
    pub redundant: u32,
    /// Remarks (fallbacks, locality gains).
    pub notes: Vec<String>,
}

/// Why no plan was made.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    /// The model (with the replicas asked for) does not fit the devices' expert memory.
    #[error("{}", describe_shortfall(.0))]
    DoesNotFit(Box<Shortfall>),
    /// An option cannot be honoured (unknown device, ...).
    #[error("{0}")]
    Options(String),
    /// The planned placement failed validation (a planner bug; the problems are listed).
    #[error("the planned placement failed validation (please report this): {0}")]
    Rejected(String),
}

/// One paragraph naming the shortfall in total and per device.
pub fn describe_shortfall(s: &Shortfall) -> String {
    let mut out = format!(
        "does not fit: needs {} for {} but the devices offer {} of expert_memory ({} usable in whole experts); short by {}",
        format_bytes(s.need_bytes),
        if s.redundant == 0 {
            "its experts".to_owned()
        } else {
            format!("its experts and {} replica slots per layer", s.redundant)
        },
        format_bytes(s.budget_bytes),
        format_bytes(s.usable_bytes),
        format_bytes(s.short_bytes)
    );
    match (s.redundant, s.max_redundant_that_fits) {
        _ if !s.shared_short.is_empty() => {
            for d in &s.shared_short {
                out.push_str(&format!(
                    "; the shared experts alone need {} on device \"{}\" (rank {}), more than its expert_memory of {}",
                    format_bytes(d.need_bytes),
                    d.device,
                    d.rank,
                    format_bytes(d.budget_bytes)
                ));
            }
            out.push_str(
                " — place the shared experts elsewhere (--shared router, or a device with room) or raise that device's expert_memory",
            );
        }
        (r, Some(m)) if r > 0 => out.push_str(&format!(
            "; without replicas it fits (at most {m} replica slots per layer do) — lower --redundant"
        )),
        _ => out.push_str(" — add devices or raise expert_memory"),
    }
    for d in &s.devices {
        out.push_str(&format!(
            "\n  device \"{}\" (rank {}): its even share needs {}, expert_memory is {}; short by {}",
            d.device,
            d.rank,
            format_bytes(d.need_bytes),
            format_bytes(d.budget_bytes),
            format_bytes(d.short_bytes)
        ));
    }
    out
}

/// The most replica slots per layer the devices' memory allows (None: not even the model).
pub fn max_redundant(
    topology: &Topology,
    model: &ModelSpec,
    shared: &SharedPolicy,
) -> Result<Option<u32>, String> {
    let (_, shared_bytes) = capacity::place_shared(topology, model, shared)?;
    let layers = model.moe_layer_ids().len() as u64;
    let e = model.routed_experts as u64;
    let slots: u64 = topology
        .devices()
        .iter()
        .zip(&shared_bytes)
        .map(|(d, &sh)| {
            capacity::slot_capacity(d.expert_memory_bytes(), sh, model.expert_bytes())
                .min(layers * e)
        })
        .sum();
    Ok((slots / layers.max(1))
        .checked_sub(e)
        .map(|r| r.min(e * (topology.devices().len() as u64).saturating_sub(1)))
        .map(|r| r.min(u32::MAX as u64) as u32))
}

/// Loads to plan with for the `li`-th MoE layer: per-token inclusion probabilities
/// ([`stats::inclusion`]) of the load statistics, of the load the co-selection counts imply, or
/// uniform.
pub fn layer_loads(
    model: &ModelSpec,
    load: Option<&LoadStats>,
    coselect: Option<&CoSelection>,
    li: usize,
) -> Vec<f64> {
    let e = model.routed_experts as usize;
    let raw = match (load, coselect.and_then(|c| c.layer(li))) {
        (Some(l), _) => l.weights(li),
        (None, Some(p)) => p.implied_load(e, model.top_k),
        (None, None) => vec![1.0; e],
    };
    stats::inclusion(&raw, model.top_k)
}

/// The expected work of the busiest device, summed over the MoE layers: per layer, the
/// largest share of the layer's routed (token, expert) pairs one device serves under `load`
/// (an expert's load split evenly among its owners; every layer weighs the same, since every
/// token passes every layer). With alike devices a placement's throughput is inversely
/// proportional to it, so `busiest_load(old) / busiest_load(new)` is the gain a change
/// predicts (what `expertmesh bench rebalance` and the router's automatic rebalancing use).
pub fn busiest_load(
    topology: &Topology,
    model: &ModelSpec,
    placement: &Placement,
    load: &LoadStats,
) -> f64 {
    model
        .moe_layer_ids()
        .into_iter()
        .enumerate()
        .map(|(li, layer)| {
            let w = load.weights(li);
            let total: f64 = w.iter().sum();
            let share = |e: u32| {
                let owners = placement.owners(layer, e).len().max(1) as f64;
                w.get(e as usize).copied().unwrap_or(0.0) / total.max(f64::MIN_POSITIVE) / owners
            };
            topology
                .devices()
                .iter()
                .map(|d| {
                    placement
                        .experts_on(d.rank(), layer)
                        .iter()
                        .map(|&e| share(e))
                        .sum::<f64>()
                })
                .fold(0.0, f64::max)
        })
        .sum()
}

/// Plan a placement of `model` on `topology`.
pub fn plan(
    topology: &Topology,
    model: &ModelSpec,
    load: Option<&LoadStats>,
    coselect: Option<&CoSelection>,
    options: &PlanOptions,
) -> Result<Plan, PlanError> {
    let mut notes = Vec::new();
    let redundant = choose_redundant(
        topology,
        model,
        load.is_some() || coselect.is_some(),
        options,
    )?;
    let layout = match capacity::layout(topology, model, &options.shared, redundant)
        .map_err(PlanError::Options)?
    {
        Ok(l) => l,
        Err(s) => return Err(PlanError::DoesNotFit(Box::new(s))),
    };
    let strategy = choose_strategy(topology, model, coselect, options, &mut notes);
    let stats = LayerStats { load, coselect };
    let placed = place_layers(topology, model, stats, options, &layout, strategy)?;
    if !placed.fallback_layers.is_empty() {
        notes.push(format!(
            "layers {}: node slot counts do not allow {}; placed globally there",
            expertmesh_topology::ranges::format_list(&placed.fallback_layers),
            strategy.name()
        ));
    }
    let (kept_before, kept_after, kept_total) = placed.kept;
    if kept_total > 0.0 {
        notes.push(format!(
            "locality: co-selected pairs kept inside a node {:.1}% -> {:.1}% (node loads within {:.0}% of the mean)",
            100.0 * kept_before / kept_total,
            100.0 * kept_after / kept_total,
            100.0 * options.locality_slack
        ));
    }
    let placement = Placement::new(
        topology,
        model,
        placed.slots,
        layout.shared.clone(),
        &options.description,
    )
    .map_err(|problems| {
        PlanError::Rejected(
            problems
                .iter()
                .map(|p| p.to_string())
                .collect::<Vec<_>>()
                .join("; "),
        )
    })?;
    Ok(Plan {
        placement,
        strategy,
        redundant,
        notes,
    })
}

/// Plan step: replica slots per layer — as asked, or the default (see the module doc) — and
/// no more than the devices can hold distinct copies of.
fn choose_redundant(
    topology: &Topology,
    model: &ModelSpec,
    has_stats: bool,
    options: &PlanOptions,
) -> Result<u32, PlanError> {
    let n_dev = topology.devices().len() as u32;
    let redundant = match options.redundant {
        Some(r) => r,
        None if has_stats => max_redundant(topology, model, &options.shared)
            .map_err(PlanError::Options)?
            .unwrap_or(0)
            .min(n_dev),
        None => 0,
    };
    let e = model.routed_experts;
    if redundant as u64 > e as u64 * (n_dev as u64).saturating_sub(1) {
        return Err(PlanError::Options(format!(
            "--redundant {redundant} asks for more replicas than {n_dev} devices can hold distinct copies of ({} at most: every expert on every device)",
            e as u64 * (n_dev as u64).saturating_sub(1)
        )));
    }
    Ok(redundant)
}

/// Plan step: the strategy to use (see [`Strategy`]), with remarks on what it cannot do here.
fn choose_strategy(
    topology: &Topology,
    model: &ModelSpec,
    coselect: Option<&CoSelection>,
    options: &PlanOptions,
    notes: &mut Vec<String>,
) -> StrategyUsed {
    let e = model.routed_experts;
    let nodes = topology
        .nodes()
        .iter()
        .filter(|n| n.device_count() > 0)
        .count();
    let groups_align = model.n_group > 1 && nodes >= 2 && model.n_group as usize % nodes == 0;
    let strategy = match options.strategy {
        Strategy::Global => StrategyUsed::Global,
        Strategy::Auto if groups_align => StrategyUsed::HierarchicalGroups,
        Strategy::Auto if coselect.is_some() && nodes >= 2 => StrategyUsed::HierarchicalLocality,
        Strategy::Auto => StrategyUsed::Global,
        Strategy::Hierarchical if groups_align => StrategyUsed::HierarchicalGroups,
        Strategy::Hierarchical if coselect.is_some() => StrategyUsed::HierarchicalLocality,
        Strategy::Hierarchical => StrategyUsed::Hierarchical,
    };
    if coselect.is_some() && e as usize > MAX_LOCALITY_UNITS && strategy != StrategyUsed::Global {
        notes.push(format!(
            "{e} experts per layer: more than the {MAX_LOCALITY_UNITS} the locality swaps handle; co-selection statistics are used for the traffic estimate only"
        ));
    }
    if options.strategy == Strategy::Hierarchical && nodes < 2 {
        notes.push("one node: hierarchical placement is the same as global".into());
    }
    strategy
}

/// The statistics a plan is made with.
#[derive(Clone, Copy)]
struct LayerStats<'a> {
    load: Option<&'a LoadStats>,
    coselect: Option<&'a CoSelection>,
}

/// What placing the layers gave: the slots, the layers placed globally as a fallback, and the
/// co-selection weight kept inside nodes (before and after the locality swaps, and in all).
struct Placed {
    slots: Vec<Vec<Vec<u32>>>,
    fallback_layers: Vec<u32>,
    kept: (f64, f64, f64),
}

/// Plan step: experts per device for every MoE layer, each device's list ascending.
fn place_layers(
    topology: &Topology,
    model: &ModelSpec,
    stats: LayerStats<'_>,
    options: &PlanOptions,
    layout: &capacity::SlotLayout,
    strategy: StrategyUsed,
) -> Result<Placed, PlanError> {
    let ids = model.moe_layer_ids();
    let speeds: Vec<f64> = topology
        .devices()
        .iter()
        .map(|d| d.memory_bandwidth_gb_s())
        .collect();
    let mut placed = Placed {
        slots: Vec::with_capacity(ids.len()),
        fallback_layers: Vec::new(),
        kept: (0.0, 0.0, 0.0),
    };
    for (li, &layer) in ids.iter().enumerate() {
        let loads = layer_loads(model, stats.load, stats.coselect, li);
        let counts = &layout.counts[li];
        let hierarchical = match strategy {
            StrategyUsed::Global => None,
            _ => {
                let r = hierarchical_layer(
                    topology,
                    model,
                    &loads,
                    counts,
                    &speeds,
                    strategy,
                    stats.coselect.and_then(|c| c.layer(li)),
                    options.locality_slack,
                )
                .map_err(PlanError::Rejected)?;
                if r.is_none() {
                    placed.fallback_layers.push(layer);
                }
                r
            }
        };
        let mut per_device = match hierarchical {
            Some((p, before, after, total)) => {
                placed.kept.0 += before;
                placed.kept.1 += after;
                placed.kept.2 += total;
                p
            }
            None => global_layer(&loads, counts, &speeds)
                .map_err(|err| PlanError::Rejected(format!("layer {layer}: {err}")))?,
        };
        for list in &mut per_device {
            list.sort_unstable();
        }
        placed.slots.push(per_device);
    }
    Ok(placed)
}

/// Experts per device for one layer, all devices at once.
fn global_layer(
    loads: &[f64],
    counts: &[u32],
    speeds: &[f64],
) -> Result<Vec<Vec<u32>>, packing::PackError> {
    let bins: Vec<Bin> = counts
        .iter()
        .zip(speeds)
        .map(|(&count, &speed)| Bin { count, speed })
        .collect();
    replicate_and_pack(loads, &bins)
}

/// Expert slots, most slots on one device, and the summed speed of the devices with slots, of
/// every node for one layer.
struct NodeSlots {
    slots: Vec<u64>,
    max_dev: Vec<u64>,
    speed: Vec<f64>,
}

impl NodeSlots {
    /// The node figures of one layer with `counts` slots per device.
    fn new(topology: &Topology, counts: &[u32], speeds: &[f64]) -> NodeSlots {
        let nodes = topology.nodes();
        NodeSlots {
            slots: nodes
                .iter()
                .map(|n| n.device_ranks().map(|r| counts[r.index()] as u64).sum())
                .collect(),
            max_dev: nodes
                .iter()
                .map(|n| {
                    n.device_ranks()
                        .map(|r| counts[r.index()] as u64)
                        .max()
                        .unwrap_or(0)
                })
                .collect(),
            speed: nodes
                .iter()
                .map(|n| {
                    n.device_ranks()
                        .filter(|r| counts[r.index()] > 0)
                        .map(|r| speeds[r.index()])
                        .sum()
                })
                .collect(),
        }
    }
}

/// Experts per device for one layer, nodes first. None when the node slot counts cannot hold
/// the node split (the caller places the layer globally). Also returns the co-selection weight
/// kept inside nodes before and after the locality swaps, and the layer's total.
#[allow(clippy::too_many_arguments)]
#[allow(clippy::type_complexity)]
fn hierarchical_layer(
    topology: &Topology,
    model: &ModelSpec,
    loads: &[f64],
    counts: &[u32],
    speeds: &[f64],
    strategy: StrategyUsed,
    pairs: Option<&stats::LayerPairs>,
    slack: f64,
) -> Result<Option<(Vec<Vec<u32>>, f64, f64, f64)>, String> {
    let e = model.routed_experts as usize;
    let n_nodes = topology.nodes().len();
    let node = NodeSlots::new(topology, counts, speeds);
    // Units: groups (contiguous expert ids, as group-limited routing views them) or experts.
    let unit_size = if strategy == StrategyUsed::HierarchicalGroups {
        e / model.n_group as usize
    } else {
        1
    };
    let units = e / unit_size;
    let live: Vec<usize> = (0..n_nodes).filter(|&n| node.slots[n] > 0).collect();
    let Some(quota) = node_quotas(&node, strategy, e, unit_size, &live) else {
        return Ok(None);
    };
    let unit_w: Vec<f64> = (0..units)
        .map(|u| loads[u * unit_size..(u + 1) * unit_size].iter().sum())
        .collect();
    let bins: Vec<Bin> = (0..n_nodes)
        .map(|n| Bin {
            count: (quota[n] / unit_size as u64) as u32,
            speed: node.speed[n].max(1e-9),
        })
        .collect();
    let split = partition(&unit_w, &bins).map_err(|err| err.to_string())?;
    let mut bin_of = vec![0usize; units];
    for (n, us) in split.iter().enumerate() {
        for &u in us {
            bin_of[u as usize] = n;
        }
    }
    let (before, after, total) = match pairs.filter(|_| units <= MAX_LOCALITY_UNITS) {
        Some(lp) => locality_swaps(lp, unit_size, &unit_w, &bins, &live, slack, &mut bin_of),
        None => (0.0, 0.0, 0.0),
    };
    let per_device = pack_inside_nodes(topology, loads, counts, speeds, unit_size, &bin_of)?;
    Ok(Some((per_device, before, after, total)))
}

/// Hierarchical step: experts per node — an equal share of the groups per live node, or the
/// largest device's slots plus a water-filled share of the rest. None when the node slot counts
/// do not allow it.
fn node_quotas(
    node: &NodeSlots,
    strategy: StrategyUsed,
    e: usize,
    unit_size: usize,
    live: &[usize],
) -> Option<Vec<u64>> {
    let n_nodes = node.slots.len();
    let units = e / unit_size;
    let mut quota = vec![0u64; n_nodes];
    if strategy == StrategyUsed::HierarchicalGroups {
        if live.is_empty() || units % live.len() != 0 {
            return None;
        }
        for &n in live {
            quota[n] = (units / live.len() * unit_size) as u64;
        }
    } else {
        let lower = &node.max_dev;
        let base: u64 = lower.iter().sum();
        let rest = (e as u64).checked_sub(base)?;
        let caps: Vec<u64> = (0..n_nodes).map(|n| node.slots[n] - lower[n]).collect();
        let w: Vec<f64> = node.slots.iter().map(|&s| s as f64).collect();
        let extra = capacity::water_fill(rest, &w, &caps)?;
        for n in 0..n_nodes {
            quota[n] = lower[n] + extra[n];
        }
    }
    let fits = (0..n_nodes).all(|n| quota[n] <= node.slots[n] && node.max_dev[n] <= quota[n]);
    fits.then_some(quota)
}

/// Hierarchical step: swap units between nodes to keep co-selected ones together while no
/// node's load exceeds `(1 + slack)` × the mean (or the current maximum, if higher). Returns
/// the co-selection weight kept inside nodes before and after, and the layer's total.
fn locality_swaps(
    lp: &stats::LayerPairs,
    unit_size: usize,
    unit_w: &[f64],
    bins: &[Bin],
    live: &[usize],
    slack: f64,
    bin_of: &mut [usize],
) -> (f64, f64, f64) {
    let units = unit_w.len();
    let mut aff = Affinity::new(units);
    for &(a, b, c) in &lp.pairs {
        aff.add(a as usize / unit_size, b as usize / unit_size, c);
    }
    let total = lp.pairs.iter().map(|p| p.2).sum();
    let before = aff.kept(bin_of);
    let node_speeds: Vec<f64> = bins.iter().map(|b| b.speed).collect();
    let mut node_load = vec![0.0; bins.len()];
    for u in 0..units {
        node_load[bin_of[u]] += unit_w[u];
    }
    let current_max = (0..bins.len())
        .map(|n| node_load[n] / node_speeds[n])
        .fold(0.0, f64::max);
    let live_speed: f64 = live.iter().map(|&n| node_speeds[n]).sum();
    let mean = unit_w.iter().sum::<f64>() / live_speed.max(1e-12);
    let limit = current_max.max((1.0 + slack) * mean);
    improve_locality(bin_of, unit_w, &node_speeds, &aff, limit, 8);
    let after = aff.kept(bin_of);
    (before, after, total)
}

/// Hierarchical step: inside each node, replicate and pack its units' experts over its devices.
fn pack_inside_nodes(
    topology: &Topology,
    loads: &[f64],
    counts: &[u32],
    speeds: &[f64],
    unit_size: usize,
    bin_of: &[usize],
) -> Result<Vec<Vec<u32>>, String> {
    let units = bin_of.len();
    let mut per_device = vec![Vec::new(); counts.len()];
    for (n, node) in topology.nodes().iter().enumerate() {
        let experts: Vec<u32> = (0..units)
            .filter(|&u| bin_of[u] == n)
            .flat_map(|u| (u * unit_size) as u32..((u + 1) * unit_size) as u32)
            .collect();
        let ranks: Vec<usize> = node.device_ranks().map(|r| r.index()).collect();
        if experts.is_empty() {
            continue;
        }
        let sub_loads: Vec<f64> = experts.iter().map(|&x| loads[x as usize]).collect();
        let sub_bins: Vec<Bin> = ranks
            .iter()
            .map(|&r| Bin {
                count: counts[r],
                speed: speeds[r],
            })
            .collect();
        let packed = replicate_and_pack(&sub_loads, &sub_bins)
            .map_err(|err| format!("node {}: {err}", node.name()))?;
        for (i, list) in packed.into_iter().enumerate() {
            per_device[ranks[i]] = list.into_iter().map(|j| experts[j as usize]).collect();
        }
    }
    Ok(per_device)
}

#[cfg(test)]
mod tests;
