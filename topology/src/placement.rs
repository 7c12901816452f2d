//! Placement files: which device holds which experts of every MoE layer, and where the shared
//! experts run.
//!
//! Why this exists: experts are stationary — a worker loads exactly the experts its placement
//! names and keeps them for its whole life — so the placement is the contract between the planner
//! (which writes it), the workers (which load from it) and the router (which dispatches by it).
//! This module reads and writes the file, validates it against a [`Topology`] and a
//! [`ModelSpec`] (coverage, known devices and layers, distinct replicas, memory budgets), and
//! answers the lookups the data path needs ([`Placement::owners`], [`Placement::experts_on`]).
//!
//! # Format 1
//!
//! ```toml
//! format = 1
//! model = "kimi-k2"            # the model's name (cross-checked)
//! cluster = "mi300x-4x8"       # the topology's name (cross-checked)
//! description = "optional"
//!
//! [[assign]]                   # one block per (device, set of layers)
//! layers = "all"               # "all" MoE layers, or ranges "1-30,45", an integer, or an array
//! device = "node0/gpu0"        # a device id from the topology ("node/device")
//! experts = "0-11"             # ranges in slot order: "0-11,200", an integer, or an array
//!
//! [[assign]]                   # a second owner of experts 0-3 = a replica
//! layers = "all"
//! device = "node1/gpu0"
//! experts = "12-23,0-3"
//!
//! [[shared]]                   # required when the model has shared experts
//! layers = "all"
//! device = "router"            # "router" (the router host) or a device id
//! ```
//!
//! Semantics: a layer range selects the MoE layers between its ends, and both ends must be MoE
//! layers. Assignments to the same device accumulate in file order; the order of a device's
//! experts in a layer is its slot order (so a vLLM/SGLang/EPLB `phy2log[layer][slot]` map, with
//! `device = slot / slots_per_device`, is written as one `[[assign]]` per device listing its slots'
//! experts in order, and read back by [`Placement::experts_on`]). A device holds an expert at most
//! once per layer; further owners on other devices are replicas. [`Placement::owners`] lists an
//! expert's owners in rank order.

use crate::diag::{
    Ctx, Field, FileError, Foreign, Problem, Schema, check_format, fields_of, nearest, span_of,
    split, text_or_default,
};
use crate::model::ModelSpec;
use crate::ranges::{ListSpec, RawList, Span, format_list};
use crate::topology::{DeviceRank, Topology};
use crate::units::{SizeUnit, format_bytes, format_bytes_in};
use serde::Deserialize;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::ops::Range;
use std::path::Path;
use toml::Spanned;

/// The only placement format version this build reads.
pub const PLACEMENT_FORMAT: i64 = 1;

/// The word in `device = ...` of a `[[shared]]` block that means the router host.
pub const ROUTER_LOCATION: &str = "router";

/// Where a layer's shared experts run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SharedLocation {
    /// On the router host (not counted against any device budget).
    Router,
    /// On a device (counted against its budget).
    Device(DeviceRank),
}

/// One device's memory use under a placement.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceUsage {
    /// The device.
    pub rank: DeviceRank,
    /// Fewest routed experts it holds in any MoE layer.
    pub experts_per_layer_min: usize,
    /// Most routed experts it holds in any MoE layer.
    pub experts_per_layer_max: usize,
    /// Routed experts over all layers.
    pub experts_total: usize,
    /// Bytes of its routed experts.
    pub routed_bytes: u64,
    /// Bytes of the shared experts placed on it.
    pub shared_bytes: u64,
    /// Its expert memory budget.
    pub budget_bytes: u64,
}

impl DeviceUsage {
    /// Routed + shared bytes.
    pub fn total_bytes(&self) -> u64 {
        // Saturating: a total past 2^64 bytes exceeds any budget, and must not wrap to fit one.
        self.routed_bytes.saturating_add(self.shared_bytes)
    }
    /// True when the experts fit the budget.
    pub fn fits(&self) -> bool {
        self.total_bytes() <= self.budget_bytes
    }
}

/// A validated placement of a model's experts on a topology's devices.
#[derive(Clone, Debug, PartialEq)]
pub struct Placement {
    model: String,
    cluster: String,
    description: String,
    routed_experts: u32,
    /// MoE layer ids, ascending.
    layers: Vec<u32>,
    device_ids: Vec<String>,
    /// `[layer index][device rank]` → experts in slot order.
    slots: Vec<Vec<Vec<u32>>>,
    /// `[layer index]` → CSR offsets (routed_experts + 1) into `owner_ranks`.
    owner_start: Vec<Vec<u32>>,
    /// `[layer index]` → owners of every expert, each expert's owners in rank order.
    owner_ranks: Vec<Vec<DeviceRank>>,
    /// `[layer index]` → where its shared experts run (None when the model has none).
    shared: Vec<Option<SharedLocation>>,
}

impl Placement {
    /// Build a placement from per-layer device lists and validate it against the topology and
    /// model (the planner's entry point; files go through [`Placement::from_toml_str`]).
    ///
    /// `slots[i][rank]` lists the experts device `rank` holds in the `i`-th MoE layer
    /// (`model.moe_layer_ids()[i]`), in slot order. `shared[i]` says where that layer's shared
    /// experts run (ignored, and may be empty, when the model has none).
    pub fn new(
        topology: &Topology,
        model: &ModelSpec,
        slots: Vec<Vec<Vec<u32>>>,
        shared: Vec<SharedLocation>,
        description: &str,
    ) -> Result<Placement, Vec<Problem>> {
        let mut ctx = Ctx::new("");
        let layers = model.moe_layer_ids();
        let n_dev = topology.devices().len();
        if slots.len() != layers.len() || slots.iter().any(|l| l.len() != n_dev) {
            ctx.report(
                "placement",
                format!(
                    "slots must be [{} MoE layers][{n_dev} devices]; got {} layers",
                    layers.len(),
                    slots.len()
                ),
            );
            return Err(ctx.into_problems());
        }
        let mut clean = slots;
        drop_invalid_experts(&mut ctx, topology, model, &layers, &mut clean);
        let shared = shared_per_layer(&mut ctx, model, layers.len(), shared);
        if let Some(r) = shared.iter().flatten().find_map(|loc| match loc {
            SharedLocation::Device(r) if r.index() >= n_dev => Some(*r),
            _ => None,
        }) {
            ctx.report(
                "placement",
                format!(
                    "shared experts on unknown device rank {r}; the topology has {n_dev} devices"
                ),
            );
            return Err(ctx.into_problems());
        }
        let p = Placement::assemble(topology, model, clean, shared, description);
        p.check(&mut ctx, topology, model);
        if ctx.has_problems() {
            Err(ctx.into_problems())
        } else {
            Ok(p)
        }
    }

    /// Read a placement file and validate it against a topology and model.
    pub fn load(
        path: &Path,
        topology: &Topology,
        model: &ModelSpec,
    ) -> Result<Placement, FileError> {
        let text = crate::diag::read_text(path)?;
        Placement::from_toml_str(&text, topology, model).map_err(|problems| FileError::Invalid {
            path: path.to_path_buf(),
            problems,
        })
    }

    /// Parse placement text and validate it against a topology and model; every problem is
    /// returned.
    pub fn from_toml_str(
        text: &str,
        topology: &Topology,
        model: &ModelSpec,
    ) -> Result<Placement, Vec<Problem>> {
        let (file, mut problems) = PlacementFile::parse(text);
        let Some(file) = file else {
            return Err(problems);
        };
        match file.resolve(text, topology, model) {
            Ok(p) if problems.is_empty() => Ok(p),
            Ok(_) => Err(problems),
            Err(more) => {
                problems.extend(more);
                crate::diag::sort_problems(&mut problems);
                Err(problems)
            }
        }
    }

    fn assemble(
        topology: &Topology,
        model: &ModelSpec,
        slots: Vec<Vec<Vec<u32>>>,
        shared: Vec<Option<SharedLocation>>,
        description: &str,
    ) -> Placement {
        let e = model.routed_experts as usize;
        let mut owner_start = Vec::with_capacity(slots.len());
        let mut owner_ranks = Vec::with_capacity(slots.len());
        for per_dev in &slots {
            let mut counts = vec![0u32; e + 1];
            for list in per_dev {
                for &x in list {
                    counts[x as usize + 1] += 1;
                }
            }
            for i in 0..e {
                counts[i + 1] += counts[i];
            }
            let mut fill = counts.clone();
            let mut ranks = vec![DeviceRank(0); counts[e] as usize];
            // Devices visited in rank order, so each expert's owners come out sorted by rank.
            for (rank, list) in per_dev.iter().enumerate() {
                for &x in list {
                    ranks[fill[x as usize] as usize] = DeviceRank(rank as u32);
                    fill[x as usize] += 1;
                }
            }
            owner_start.push(counts);
            owner_ranks.push(ranks);
        }
        Placement {
            model: model.name.clone(),
            cluster: topology.name().to_owned(),
            description: description.to_owned(),
            routed_experts: model.routed_experts,
            layers: model.moe_layer_ids(),
            device_ids: topology
                .devices()
                .iter()
                .map(|d| d.id().to_owned())
                .collect(),
            slots,
            owner_start,
            owner_ranks,
            shared,
        }
    }

    /// Coverage, shared-expert locations and memory budgets.
    fn check(&self, ctx: &mut Ctx<'_>, topology: &Topology, model: &ModelSpec) {
        // Coverage: group consecutive layers with the same set of orphan experts.
        let mut orphan_runs: Vec<(usize, usize, Vec<u32>)> = Vec::new();
        for li in 0..self.layers.len() {
            let orphans: Vec<u32> = (0..self.routed_experts)
                .filter(|&x| self.owners_at(li, x).is_empty())
                .collect();
            if orphans.is_empty() {
                continue;
            }
            match orphan_runs.last_mut() {
                Some((_, end, o)) if *end + 1 == li && *o == orphans => *end = li,
                _ => orphan_runs.push((li, li, orphans)),
            }
        }
        for (a, b, orphans) in orphan_runs {
            ctx.report(
                self.layer_label(a, b),
                format!(
                    "expert{} {} {} no owner; assign {} to a device",
                    if orphans.len() == 1 { "" } else { "s" },
                    format_list(&orphans),
                    if orphans.len() == 1 { "has" } else { "have" },
                    if orphans.len() == 1 { "it" } else { "them" },
                ),
            );
        }
        if model.shared_experts > 0 {
            let missing: Vec<usize> = (0..self.layers.len())
                .filter(|&li| self.shared[li].is_none())
                .collect();
            if !missing.is_empty() {
                let ids: Vec<u32> = missing.iter().map(|&li| self.layers[li]).collect();
                ctx.report(
                    format!("layers {}", format_list(&ids)),
                    format!(
                        "no location for the shared expert(s) of {}; add a [[shared]] block (device = \"router\" or a device id)",
                        model.name
                    ),
                );
            }
        }
        for u in self.usage(topology, model) {
            if !u.fits() {
                let d = &topology.devices()[u.rank.index()];
                let shared_note = if u.shared_bytes > 0 {
                    format!(" + shared experts {}", format_bytes(u.shared_bytes))
                } else {
                    String::new()
                };
                ctx.report(
                    format!("device \"{}\" (rank {})", d.id(), u.rank),
                    format!(
                        "experts need {} ({} routed experts x {}{shared_note}) but expert_memory is {}; short by {} — move experts to other devices or raise expert_memory",
                        format_bytes(u.total_bytes()),
                        u.experts_total,
                        format_bytes(model.expert_bytes()),
                        budget_as_written(u.budget_bytes, d.expert_memory_unit()),
                        format_bytes(u.total_bytes() - u.budget_bytes),
                    ),
                );
            }
        }
    }

    fn layer_label(&self, a: usize, b: usize) -> String {
        if a == b {
            format!("layer {}", self.layers[a])
        } else {
            format!("layers {}-{}", self.layers[a], self.layers[b])
        }
    }

    fn layer_index(&self, layer: u32) -> Option<usize> {
        self.layers.binary_search(&layer).ok()
    }

    fn owners_at(&self, li: usize, expert: u32) -> &[DeviceRank] {
        let s = &self.owner_start[li];
        let e = expert as usize;
        if e + 1 >= s.len() {
            return &[];
        }
        &self.owner_ranks[li][s[e] as usize..s[e + 1] as usize]
    }

    /// The devices holding `expert` of MoE layer `layer`, in rank order (empty for an unknown
    /// layer or expert).
    pub fn owners(&self, layer: u32, expert: u32) -> &[DeviceRank] {
        match self.layer_index(layer) {
            Some(li) => self.owners_at(li, expert),
            None => &[],
        }
    }

    /// The experts `device` holds in MoE layer `layer`, in slot order (empty when none or
    /// unknown).
    pub fn experts_on(&self, device: DeviceRank, layer: u32) -> &[u32] {
        self.layer_index(layer)
            .and_then(|li| self.slots[li].get(device.index()))
            .map_or(&[], Vec::as_slice)
    }

    /// Where the shared experts of `layer` run (None for a model without shared experts or an
    /// unknown layer).
    pub fn shared_location(&self, layer: u32) -> Option<SharedLocation> {
        self.layer_index(layer).and_then(|li| self.shared[li])
    }

    /// The model name it was made for.
    pub fn model_name(&self) -> &str {
        &self.model
    }
    /// The cluster name it was made for.
    pub fn cluster_name(&self) -> &str {
        &self.cluster
    }
    /// Free-text description.
    pub fn description(&self) -> &str {
        &self.description
    }
    /// The MoE layer ids, ascending.
    pub fn layers(&self) -> &[u32] {
        &self.layers
    }
    /// Routed experts per layer.
    pub fn routed_experts(&self) -> u32 {
        self.routed_experts
    }
    /// Number of devices (ranks) it covers.
    pub fn device_count(&self) -> usize {
        self.device_ids.len()
    }
    /// Expert slots over all layers and devices (routed experts plus replicas).
    pub fn total_slots(&self) -> usize {
        self.slots.iter().flatten().map(Vec::len).sum()
    }

    /// Memory use of every device, in rank order.
    pub fn usage(&self, topology: &Topology, model: &ModelSpec) -> Vec<DeviceUsage> {
        let shared_per_layer =
            (model.shared_experts as u64).saturating_mul(model.shared_expert_bytes());
        topology
            .devices()
            .iter()
            .map(|d| {
                let r = d.rank().index();
                let counts: Vec<usize> = self.slots.iter().map(|l| l[r].len()).collect();
                let total: usize = counts.iter().sum();
                let shared_layers = self
                    .shared
                    .iter()
                    .filter(|s| **s == Some(SharedLocation::Device(d.rank())))
                    .count() as u64;
                DeviceUsage {
                    rank: d.rank(),
                    experts_per_layer_min: counts.iter().copied().min().unwrap_or(0),
                    experts_per_layer_max: counts.iter().copied().max().unwrap_or(0),
                    experts_total: total,
                    routed_bytes: (total as u64).saturating_mul(model.expert_bytes()),
                    shared_bytes: shared_layers.saturating_mul(shared_per_layer),
                    budget_bytes: d.expert_memory_bytes(),
                }
            })
            .collect()
    }

    /// Write the placement as a format-1 file: one `[[assign]]` per device and run of
    /// consecutive MoE layers with identical expert lists, `[[shared]]` per run of layers with
    /// the same location. [`Placement::from_toml_str`] reads it back to an equal placement.
    pub fn to_toml_string(&self) -> String {
        let q = |s: &str| toml::Value::String(s.to_owned()).to_string();
        let mut out = format!(
            "format = {PLACEMENT_FORMAT}\nmodel = {}\ncluster = {}\n",
            q(&self.model),
            q(&self.cluster)
        );
        if !self.description.is_empty() {
            out.push_str(&format!("description = {}\n", q(&self.description)));
        }
        let n = self.layers.len();
        let layers_value = |a: usize, b: usize| -> String {
            if a == 0 && b + 1 == n {
                "\"all\"".to_owned()
            } else if a == b {
                self.layers[a].to_string()
            } else {
                format!("\"{}-{}\"", self.layers[a], self.layers[b])
            }
        };
        for (rank, id) in self.device_ids.iter().enumerate() {
            let mut li = 0;
            while li < n {
                let list = &self.slots[li][rank];
                let mut end = li;
                while end + 1 < n && self.slots[end + 1][rank] == *list {
                    end += 1;
                }
                if !list.is_empty() {
                    out.push_str(&format!(
                        "\n[[assign]]\nlayers = {}\ndevice = {}\nexperts = \"{}\"\n",
                        layers_value(li, end),
                        q(id),
                        format_list(list)
                    ));
                }
                li = end + 1;
            }
        }
        let mut li = 0;
        while li < n {
            let Some(loc) = self.shared[li] else {
                li += 1;
                continue;
            };
            let mut end = li;
            while end + 1 < n && self.shared[end + 1] == Some(loc) {
                end += 1;
            }
            let device = match loc {
                SharedLocation::Router => ROUTER_LOCATION.to_owned(),
                SharedLocation::Device(r) => self.device_ids[r.index()].clone(),
            };
            out.push_str(&format!(
                "\n[[shared]]\nlayers = {}\ndevice = {}\n",
                layers_value(li, end),
                q(&device)
            ));
            li = end + 1;
        }
        out
    }
}

impl fmt::Display for SharedLocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SharedLocation::Router => f.write_str(ROUTER_LOCATION),
            SharedLocation::Device(r) => write!(f, "rank {r}"),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The file, before it meets a topology and a model.

/// The top-level keys of a placement file (to recognize one passed as another kind of file).
pub(crate) fn top_level_keys() -> &'static [&'static str] {
    fields_of::<RawPlacement>()
}

/// A budget in decimal units, followed by the binary size it was written as (`268.44 MB
/// (256.00 MiB)`), so that it compares with the decimal figures next to it.
fn budget_as_written(bytes: u64, unit: SizeUnit) -> String {
    match unit {
        SizeUnit::Decimal => format_bytes(bytes),
        SizeUnit::Binary => format!(
            "{} ({})",
            format_bytes(bytes),
            format_bytes_in(bytes, SizeUnit::Binary)
        ),
    }
}

#[derive(Deserialize)]
struct RawPlacement {
    format: Field<i64>,
    model: Field<String>,
    cluster: Field<String>,
    description: Field<String>,
    assign: Field<Vec<Spanned<RawAssign>>>,
    shared: Field<Vec<Spanned<RawShared>>>,
}

#[derive(Deserialize)]
struct RawAssign {
    layers: Field<RawList>,
    device: Field<String>,
    experts: Field<RawList>,
}

#[derive(Deserialize)]
struct RawShared {
    layers: Field<RawList>,
    device: Field<String>,
}

/// (assignment number, assignment that listed it first, device rank) of a repeated expert.
type DupKey = (usize, usize, usize);

/// One `[[assign]]` or `[[shared]]` block after syntax checks.
#[derive(Clone, Debug)]
struct Block {
    number: usize,
    span: Option<Range<usize>>,
    layers: ListSpec,
    layers_span: Option<Range<usize>>,
    device: String,
    device_span: Option<Range<usize>>,
    experts: Vec<Span>,
    experts_span: Option<Range<usize>>,
}

/// A placement file that is syntactically valid, not yet checked against a topology and model.
#[derive(Clone, Debug)]
pub struct PlacementFile {
    model: String,
    model_span: Option<Range<usize>>,
    cluster: String,
    cluster_span: Option<Range<usize>>,
    description: String,
    assign: Vec<Block>,
    shared: Vec<Block>,
}

impl PlacementFile {
    /// Read a placement file and check what can be checked without a topology and model; any
    /// problem fails it (see [`PlacementFile::parse`] for the lenient form).
    pub fn load(path: &Path) -> Result<(PlacementFile, String), FileError> {
        let text = crate::diag::read_text(path)?;
        match PlacementFile::from_toml_str(&text) {
            Ok(f) => Ok((f, text)),
            Err(problems) => Err(FileError::Invalid {
                path: path.to_path_buf(),
                problems,
            }),
        }
    }

    /// Parse placement text strictly: any problem (syntax, unknown keys, types, required keys,
    /// range syntax) fails it.
    pub fn from_toml_str(text: &str) -> Result<PlacementFile, Vec<Problem>> {
        match PlacementFile::parse(text) {
            (Some(f), p) if p.is_empty() => Ok(f),
            (_, p) => Err(p),
        }
    }

    /// Parse placement text leniently: every problem found without a topology and model, plus
    /// the file made of the blocks that parsed (None when the text is not valid TOML, a value
    /// has the wrong type, or the header is unusable). Resolving that partial file reports the
    /// cross-check problems in the same run.
    pub fn parse(text: &str) -> (Option<PlacementFile>, Vec<Problem>) {
        let mut ctx = Ctx::new(text);
        let schema = Schema::new("", fields_of::<RawPlacement>(), None)
            .table(
                "assign",
                Schema::new("assignment", fields_of::<RawAssign>(), None),
            )
            .table(
                "shared",
                Schema::new("shared block", fields_of::<RawShared>(), None),
            )
            .root(
                "placement file",
                vec![
                    Foreign {
                        what: "topology file",
                        keys: crate::topology::top_level_keys(),
                        hint: "pass it as the topology (the first argument)",
                    },
                    Foreign {
                        what: "model file",
                        keys: crate::model_file::top_level_keys(),
                        hint: "pass it with --model",
                    },
                ],
            );
        let Some(raw) = ctx.parse::<RawPlacement>(&schema) else {
            return (None, ctx.into_problems());
        };
        let header_ok = check_header(&mut ctx, &raw);
        if raw.assign.as_ref().is_none_or(|a| a.get_ref().is_empty()) {
            ctx.at(
                span_of(&raw.assign),
                "top level",
                "no [[assign]] blocks; add one per device with its layers and experts",
            );
        }
        let assign = parse_blocks(&mut ctx, &raw.assign, "assignment", |a| {
            (&a.layers, &a.device, Some(&a.experts))
        });
        let shared = parse_blocks(&mut ctx, &raw.shared, "shared block", |s| {
            (&s.layers, &s.device, None)
        });
        if !header_ok {
            return (None, ctx.into_problems());
        }
        let (model, model_span) = split(&raw.model);
        let (cluster, cluster_span) = split(&raw.cluster);
        let file = PlacementFile {
            model: model.unwrap_or_default(),
            model_span,
            cluster: cluster.unwrap_or_default(),
            cluster_span,
            description: text_or_default(&raw.description),
            assign,
            shared,
        };
        (Some(file), ctx.into_problems())
    }

    /// The model name the file names.
    pub fn model_name(&self) -> &str {
        &self.model
    }

    /// The cluster name the file names.
    pub fn cluster_name(&self) -> &str {
        &self.cluster
    }

    /// Check against a topology and model and build the [`Placement`]. `text` is the file's text
    /// (for line:column in messages).
    pub fn resolve(
        &self,
        text: &str,
        topology: &Topology,
        model: &ModelSpec,
    ) -> Result<Placement, Vec<Problem>> {
        let mut ctx = Ctx::new(text);
        self.check_names(&mut ctx, topology, model);
        if ctx.has_problems() {
            // Everything below would only restate the mismatch.
            return Err(ctx.into_problems());
        }
        let layers = model.moe_layer_ids();
        let slots = self.resolve_assignments(&mut ctx, topology, model, &layers);
        let shared = self.resolve_shared(&mut ctx, topology, model, &layers);
        // The whole-placement checks run even after problems above, so that coverage and
        // budgets are reported in the same run.
        let p = Placement::assemble(topology, model, slots, shared, &self.description);
        p.check(&mut ctx, topology, model);
        if ctx.has_problems() {
            Err(ctx.into_problems())
        } else {
            Ok(p)
        }
    }

    /// Resolve step: the file's `model` and `cluster` against the model and topology given.
    fn check_names(&self, ctx: &mut Ctx<'_>, topology: &Topology, model: &ModelSpec) {
        let top = "top level";
        if self.model != model.name {
            ctx.at(
                self.model_span.clone(),
                top,
                format!(
                    "placement is for model \"{}\" but the model given is \"{}\"; pass --model {} or fix `model`",
                    self.model, model.name, self.model
                ),
            );
        }
        if self.cluster != topology.name() {
            ctx.at(
                self.cluster_span.clone(),
                top,
                format!(
                    "placement is for cluster \"{}\" but the topology is \"{}\"; use the matching topology or fix `cluster`",
                    self.cluster,
                    topology.name()
                ),
            );
        }
    }

    /// Resolve step: the `[[assign]]` blocks, in file order, into `[layer index][rank]` slot
    /// lists; experts that do not exist, and experts a device is given twice, are reported.
    fn resolve_assignments(
        &self,
        ctx: &mut Ctx<'_>,
        topology: &Topology,
        model: &ModelSpec,
        layers: &[u32],
    ) -> Vec<Vec<Vec<u32>>> {
        let mut fill = SlotFill::new(layers.len(), topology.devices().len());
        for b in &self.assign {
            let item = format!("assignment #{}", b.number);
            let rank = self.device_rank(ctx, topology, b, &item, false);
            let lis = layer_indices(ctx, model, layers, b, &item);
            report_nonexistent_experts(ctx, model, b, &item);
            // Out-of-range experts are reported above; the rest still count, so that coverage
            // and duplicates are checked in the same run.
            let (Some(Some(rank)), Some(lis)) = (rank, lis) else {
                continue;
            };
            if let Err(listed) = fill.place(model, b, rank.index(), lis, layers) {
                ctx.at(
                    b.experts_span.clone().or(b.span.clone()),
                    item,
                    format!(
                        "the assignments up to this one list {listed} expert slots (layers x \
                         experts, summed), more than the {MAX_LISTED_SLOTS} a placement may \
                         list; a device holds an expert once per layer: list each once"
                    ),
                );
                break;
            }
        }
        self.report_duplicates(ctx, topology, fill.dups);
        fill.slots
    }

    /// Resolve step: report the experts devices were given more than once, per (assignment,
    /// earlier assignment, device).
    fn report_duplicates(&self, ctx: &mut Ctx<'_>, topology: &Topology, dups: Dups) {
        for ((number, prev, r), (experts, layer_ids)) in dups {
            let experts: Vec<u32> = experts.into_iter().collect();
            let layer_ids: Vec<u32> = layer_ids.into_iter().collect();
            let span = self
                .assign
                .iter()
                .find(|b| b.number == number)
                .and_then(|b| b.experts_span.clone().or(b.span.clone()));
            let whom = if prev == number {
                "earlier in the same assignment".to_owned()
            } else {
                format!("by assignment #{prev}")
            };
            ctx.at(
                span,
                format!("assignment #{number}"),
                format!(
                    "experts {} in layers {} are already on device \"{}\" ({whom}); a device holds an expert once per layer — put replicas on other devices",
                    format_list(&experts),
                    format_list(&layer_ids),
                    topology.devices()[r].id()
                ),
            );
        }
    }

    /// Resolve step: the `[[shared]]` blocks into one location per MoE layer (at most one
    /// block per layer; none at all for a model without shared experts).
    fn resolve_shared(
        &self,
        ctx: &mut Ctx<'_>,
        topology: &Topology,
        model: &ModelSpec,
        layers: &[u32],
    ) -> Vec<Option<SharedLocation>> {
        let mut shared: Vec<Option<SharedLocation>> = vec![None; layers.len()];
        // The block that gave each layer its location.
        let mut given_by = vec![0usize; layers.len()];
        if model.shared_experts == 0
            && let Some(first) = self.shared.first()
        {
            ctx.at(
                first.span.clone(),
                format!("shared block #{}", first.number),
                format!(
                    "{} has no shared experts; remove the [[shared]] blocks",
                    model.name
                ),
            );
            return shared;
        }
        for b in &self.shared {
            let item = format!("shared block #{}", b.number);
            let loc = self.device_rank(ctx, topology, b, &item, true);
            let lis = layer_indices(ctx, model, layers, b, &item);
            let (Some(loc), Some(lis)) = (loc, lis) else {
                continue;
            };
            let loc = loc.map_or(SharedLocation::Router, SharedLocation::Device);
            // Layers given a location already: by this block (named twice) or an earlier one.
            let mut twice: BTreeMap<usize, BTreeSet<u32>> = BTreeMap::new();
            for li in lis {
                if shared[li].is_some() {
                    twice.entry(given_by[li]).or_default().insert(layers[li]);
                } else {
                    shared[li] = Some(loc);
                    given_by[li] = b.number;
                }
            }
            for (by, layer_ids) in twice {
                let layer_ids: Vec<u32> = layer_ids.into_iter().collect();
                let whom = if by == b.number {
                    "are named twice in this block".to_owned()
                } else {
                    format!("already have a shared-expert location from shared block #{by}")
                };
                ctx.at(
                    b.span.clone(),
                    &item,
                    format!(
                        "layers {} {whom}; each layer gets one",
                        format_list(&layer_ids)
                    ),
                );
            }
        }
        shared
    }

    /// `Some(Some(rank))` for a device, `Some(None)` for the router (when allowed), `None` after
    /// reporting an unknown device.
    fn device_rank(
        &self,
        ctx: &mut Ctx<'_>,
        topology: &Topology,
        b: &Block,
        item: &str,
        router_ok: bool,
    ) -> Option<Option<DeviceRank>> {
        if router_ok && b.device == ROUTER_LOCATION {
            return Some(None);
        }
        if let Some(d) = topology.device_by_id(&b.device) {
            return Some(Some(d.rank()));
        }
        let ids = topology.devices().iter().map(|d| d.id());
        let hint = match nearest(&b.device, ids) {
            Some(s) => format!("did you mean \"{s}\"?"),
            None if topology.devices().len() <= 8 => format!(
                "devices of \"{}\": {}",
                topology.name(),
                topology
                    .devices()
                    .iter()
                    .map(|d| d.id())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            None => "device ids are \"node/device\" as in the topology file".to_owned(),
        };
        let router = if router_ok { " (or \"router\")" } else { "" };
        ctx.at(
            b.device_span.clone(),
            item,
            format!("unknown device \"{}\"{router}; {hint}", b.device),
        );
        None
    }
}

/// Experts a device was given more than once, and the layers where.
type Dups = BTreeMap<DupKey, (BTreeSet<u32>, BTreeSet<u32>)>;

/// The most expert slots the `[[assign]]` blocks of one placement may list (each block's
/// layers times its distinct experts, summed over blocks, so blocks that repeat each other
/// count each time): far above any real placement (Kimi K2 with a replica of every expert
/// lists 46,080), it bounds the time and memory a file of repeated blocks can make resolving
/// take. Ranges repeated within one block are merged first, at the cost of the ranges.
pub const MAX_LISTED_SLOTS: u64 = 1 << 24;

/// The slot lists being filled from `[[assign]]` blocks, in file order.
///
/// What a device already holds in a layer is kept as disjoint expert ranges, each with the
/// block that listed it ([`Held`]), so the work and memory follow the ranges the file lists,
/// not the model's expert count times its layers times its devices.
struct SlotFill {
    /// `[layer index][rank]` → experts in slot order.
    slots: Vec<Vec<Vec<u32>>>,
    /// `[layer index][rank]` → the experts placed there, as ranges with their block.
    held: Vec<Vec<Held>>,
    dups: Dups,
    /// Slots listed so far (layers x experts of each block placed, repeats included).
    listed: u64,
}

impl SlotFill {
    /// Empty slot lists for `n_layers` MoE layers of `n_dev` devices.
    fn new(n_layers: usize, n_dev: usize) -> SlotFill {
        SlotFill {
            slots: vec![vec![Vec::new(); n_dev]; n_layers],
            held: (0..n_layers)
                .map(|_| (0..n_dev).map(|_| Held::default()).collect())
                .collect(),
            dups: BTreeMap::new(),
            listed: 0,
        }
    }

    /// Append block `b`'s existing experts to device `r` in the MoE layers `lis` (indices into
    /// `layers`, the MoE layer ids); experts the device already holds there (from an earlier
    /// block, or listed twice by this one) are recorded as duplicates instead. `Err(listed)`
    /// (nothing placed) when the block would bring the slots listed past [`MAX_LISTED_SLOTS`].
    fn place(
        &mut self,
        model: &ModelSpec,
        b: &Block,
        r: usize,
        mut lis: Vec<usize>,
        layers: &[u32],
    ) -> Result<(), u64> {
        let e_max = model.routed_experts as u64;
        let number = b.number as u32;
        // The block's experts in the order it lists them, each once (`parts`), and those it
        // lists more than once (`again`).
        let mut own = Held::default();
        let mut parts = Vec::new();
        let mut again = Vec::new();
        let mut count = 0u64;
        for &(lo, hi) in &b.experts {
            if lo >= e_max {
                continue;
            }
            let (lo, hi) = (lo as u32, hi.min(e_max - 1) as u32);
            let new = |a: u32, z: u32| {
                parts.push((a, z));
                count += u64::from(z - a) + 1;
            };
            own.take(lo, hi, number, new, |a, z, _| again.push((a, z)));
        }
        // As sorted disjoint ranges (the repeats of many ranges cost the ranges, not their
        // experts).
        let again = merged(again);
        let listed = self.listed + count * lis.len() as u64;
        if listed > MAX_LISTED_SLOTS {
            return Err(listed);
        }
        self.listed = listed;
        lis.sort_unstable();
        // Layers the block names more than once: every expert it places there, twice.
        let named_again: BTreeSet<usize> = lis
            .windows(2)
            .filter(|w| w[0] == w[1])
            .map(|w| w[0])
            .collect();
        lis.dedup();
        for li in lis {
            let list = &mut self.slots[li][r];
            let dups = &mut self.dups;
            let twice = named_again.contains(&li);
            // Experts this block places here and also lists again: duplicates of its own.
            let mut own_dups = Vec::new();
            for &(lo, hi) in &parts {
                let new = |a: u32, z: u32| {
                    list.extend(a..=z);
                    if twice {
                        own_dups.extend(a..=z);
                    } else {
                        // The repeated ranges that meet a..=z, clipped to it.
                        let from = again.partition_point(|&(_, hi)| hi < a);
                        for &(lo, hi) in again[from..].iter().take_while(|&&(lo, _)| lo <= z) {
                            own_dups.extend(lo.max(a)..=hi.min(z));
                        }
                    }
                };
                self.held[li][r].take(lo, hi, number, new, |a, z, prev| {
                    let entry = dups.entry((b.number, prev as usize, r)).or_default();
                    entry.0.extend(a..=z);
                    entry.1.insert(layers[li]);
                });
            }
            if !own_dups.is_empty() {
                let entry = dups.entry((b.number, b.number, r)).or_default();
                entry.0.extend(own_dups);
                entry.1.insert(layers[li]);
            }
        }
        Ok(())
    }
}

/// `ranges` sorted and merged into disjoint ranges (touching ones joined).
fn merged(mut ranges: Vec<(u32, u32)>) -> Vec<(u32, u32)> {
    ranges.sort_unstable();
    let mut out: Vec<(u32, u32)> = Vec::with_capacity(ranges.len());
    for (lo, hi) in ranges {
        match out.last_mut() {
            Some((_, z)) if lo <= z.saturating_add(1) => *z = (*z).max(hi),
            _ => out.push((lo, hi)),
        }
    }
    out
}

/// Disjoint ranges of experts, each with the block that listed it first.
#[derive(Default)]
struct Held(BTreeMap<u32, (u32, u32)>);

impl Held {
    /// Take experts `lo..=hi` for block `number`: `new(a, z)` for each part not held yet (in
    /// order), `old(a, z, block)` for each part already held (by `block`).
    fn take(
        &mut self,
        lo: u32,
        hi: u32,
        number: u32,
        mut new: impl FnMut(u32, u32),
        mut old: impl FnMut(u32, u32, u32),
    ) {
        // The ranges that meet lo..=hi: the last one starting at or below lo, and those
        // starting inside.
        let first = self
            .0
            .range(..=lo)
            .next_back()
            .filter(|(_, (z, _))| *z >= lo)
            .map(|(&a, _)| a)
            .unwrap_or(lo);
        let meeting: Vec<(u32, u32, u32)> = self
            .0
            .range(first..=hi)
            .map(|(&a, &(z, by))| (a, z, by))
            .collect();
        // `at`: the first expert of lo..=hi not accounted for yet.
        let mut at = lo;
        let mut fresh = Vec::new();
        for (a, z, by) in meeting {
            if a > at {
                fresh.push((at, a - 1));
            }
            old(a.max(lo), z.min(hi), by);
            at = at.max(z.saturating_add(1));
        }
        if at <= hi {
            fresh.push((at, hi));
        }
        for (a, z) in fresh {
            new(a, z);
            self.0.insert(a, (z, number));
        }
    }
}

/// Report the expert ranges of an `[[assign]]` block that reach past the model's experts.
fn report_nonexistent_experts(ctx: &mut Ctx<'_>, model: &ModelSpec, b: &Block, item: &str) {
    let e = model.routed_experts as u64;
    for &(lo, hi) in &b.experts {
        if hi < e {
            continue;
        }
        let first = lo.max(e);
        let which = if first == hi {
            format!("expert {hi} does not exist")
        } else {
            format!("experts {first}-{hi} do not exist")
        };
        ctx.at(
            b.experts_span.clone(),
            item,
            format!(
                "{which}; {} has experts 0-{}",
                model.name,
                model.routed_experts.saturating_sub(1)
            ),
        );
    }
}

/// Parse step: the header — `format`, and the `model` and `cluster` the file is for. False
/// when the file cannot be used (an unsupported format, or no model or cluster name).
fn check_header(ctx: &mut Ctx<'_>, raw: &RawPlacement) -> bool {
    let top = "top level";
    let mut ok = check_format(ctx, &raw.format, "placement", PLACEMENT_FORMAT);
    if raw.model.is_none() {
        ctx.at(
            None,
            top,
            "missing `model`; name the model this placement is for, e.g. model = \"kimi-k2\"",
        );
        ok = false;
    }
    if raw.cluster.is_none() {
        ctx.at(
            None,
            top,
            "missing `cluster`; name the topology this placement is for (its `name`)",
        );
        ok = false;
    }
    ok
}

/// The keys of an `[[assign]]` or `[[shared]]` block: layers, device and (assignments only)
/// experts.
type BlockKeys<'a> = (
    &'a Field<RawList>,
    &'a Field<String>,
    Option<&'a Field<RawList>>,
);

/// Parse step: the usable blocks of one kind (`what`: "assignment" or "shared block"),
/// numbered from 1 in file order.
fn parse_blocks<T>(
    ctx: &mut Ctx<'_>,
    raw: &Field<Vec<Spanned<T>>>,
    what: &str,
    keys: impl Fn(&T) -> BlockKeys<'_>,
) -> Vec<Block> {
    let list: &[Spanned<T>] = raw.as_ref().map_or(&[], |a| a.get_ref());
    let mut blocks = Vec::new();
    for (i, rb) in list.iter().enumerate() {
        let (layers, device, experts) = keys(rb.get_ref());
        if let Some(b) = parse_block(ctx, i + 1, what, rb.span(), layers, device, experts) {
            blocks.push(b);
        }
    }
    blocks
}

/// [`Placement::new`] step: drop (and report) experts that do not exist or that a device lists
/// twice in one layer.
fn drop_invalid_experts(
    ctx: &mut Ctx<'_>,
    topology: &Topology,
    model: &ModelSpec,
    layers: &[u32],
    slots: &mut [Vec<Vec<u32>>],
) {
    for (li, per_dev) in slots.iter_mut().enumerate() {
        for (rank, list) in per_dev.iter_mut().enumerate() {
            let mut seen = vec![false; model.routed_experts as usize];
            let mut bad = Vec::new();
            let mut dup = Vec::new();
            list.retain(|&e| match seen.get_mut(e as usize) {
                None => {
                    bad.push(e);
                    false
                }
                Some(s) if *s => {
                    dup.push(e);
                    false
                }
                Some(s) => {
                    *s = true;
                    true
                }
            });
            let item = format!(
                "layer {} device \"{}\"",
                layers[li],
                topology.devices()[rank].id()
            );
            if !bad.is_empty() {
                ctx.report(
                    &item,
                    format!(
                        "experts {} do not exist ({} has experts 0-{})",
                        format_list(&bad),
                        model.name,
                        model.routed_experts.saturating_sub(1)
                    ),
                );
            }
            if !dup.is_empty() {
                ctx.report(
                    &item,
                    format!(
                        "experts {} are listed more than once; a device holds an expert once per layer (replicas go on distinct devices)",
                        format_list(&dup)
                    ),
                );
            }
        }
    }
}

/// [`Placement::new`] step: one shared-expert location per MoE layer (none for a model without
/// shared experts; a list of the wrong length is reported).
fn shared_per_layer(
    ctx: &mut Ctx<'_>,
    model: &ModelSpec,
    n_layers: usize,
    shared: Vec<SharedLocation>,
) -> Vec<Option<SharedLocation>> {
    if model.shared_experts == 0 {
        return vec![None; n_layers];
    }
    if shared.len() != n_layers {
        ctx.report(
            "placement",
            format!(
                "{} has {} shared expert(s) per layer; give a location for each of its {} MoE layers (got {})",
                model.name,
                model.shared_experts,
                n_layers,
                shared.len()
            ),
        );
        return vec![None; n_layers];
    }
    shared.into_iter().map(Some).collect()
}

fn parse_block(
    ctx: &mut Ctx<'_>,
    number: usize,
    what: &str,
    span: Range<usize>,
    layers: &Field<RawList>,
    device: &Field<String>,
    experts: Option<&Field<RawList>>,
) -> Option<Block> {
    let item = format!("{what} #{number}");
    let mut ok = true;
    let layers_spec = match layers {
        None => {
            ctx.at(
                Some(span.clone()),
                &item,
                "missing `layers`; use \"all\", a range like \"1-60\", or a layer number",
            );
            ok = false;
            None
        }
        Some(l) => match l.get_ref().spec(Some("all")) {
            Ok(s) => Some(s),
            Err(e) => {
                ctx.at(Some(l.span()), &item, format!("layers: {e}"));
                ok = false;
                None
            }
        },
    };
    let (dev, dev_span) = split(device);
    if dev.is_none() {
        ctx.at(
            Some(span.clone()),
            &item,
            if experts.is_some() {
                "missing `device`; give a device id \"node/device\" from the topology"
            } else {
                "missing `device`; give \"router\" or a device id \"node/device\""
            },
        );
        ok = false;
    }
    let mut expert_ranges = Vec::new();
    let mut experts_span = None;
    if let Some(ef) = experts {
        match ef {
            None => {
                ctx.at(
                    Some(span.clone()),
                    &item,
                    "missing `experts`; list them like \"0-11\" or [0, 5, \"7-9\"]",
                );
                ok = false;
            }
            Some(e) => {
                experts_span = Some(e.span());
                match e.get_ref().spec(None) {
                    Ok(ListSpec::Ranges(r)) => expert_ranges = r,
                    Ok(ListSpec::Keyword) => {}
                    Err(msg) => {
                        ctx.at(Some(e.span()), &item, format!("experts: {msg}"));
                        ok = false;
                    }
                }
            }
        }
    }
    if !ok {
        return None;
    }
    Some(Block {
        number,
        span: Some(span),
        layers: layers_spec?,
        layers_span: layers.as_ref().map(Spanned::span),
        device: dev?,
        device_span: dev_span,
        experts: expert_ranges,
        experts_span,
    })
}

/// Indices (into `layers`) selected by a block's `layers`, or None after reporting.
fn layer_indices(
    ctx: &mut Ctx<'_>,
    model: &ModelSpec,
    layers: &[u32],
    b: &Block,
    item: &str,
) -> Option<Vec<usize>> {
    let ranges = match &b.layers {
        ListSpec::Keyword => return Some((0..layers.len()).collect()),
        ListSpec::Ranges(r) => r,
    };
    let moe = || {
        let ids = model.moe_layer_ids();
        if model.moe_layer_step <= 1 {
            format!(
                "{}-{}",
                ids.first().copied().unwrap_or(0),
                ids.last().copied().unwrap_or(0)
            )
        } else {
            format_list(&ids)
        }
    };
    let mut out = Vec::new();
    let mut ok = true;
    for &(lo, hi) in ranges {
        for end in [lo, hi] {
            if end >= model.num_layers as u64 {
                ctx.at(
                    b.layers_span.clone(),
                    item,
                    format!(
                        "layer {end} does not exist; {} has layers 0-{} (MoE layers {})",
                        model.name,
                        model.num_layers.saturating_sub(1),
                        moe()
                    ),
                );
                ok = false;
            } else if !model.is_moe_layer(end as u32) {
                ctx.at(
                    b.layers_span.clone(),
                    item,
                    format!(
                        "layer {end} is a dense layer of {}; its MoE layers are {}",
                        model.name,
                        moe()
                    ),
                );
                ok = false;
            }
            if lo == hi {
                break;
            }
        }
        if ok {
            let a = layers.partition_point(|&l| (l as u64) < lo);
            let z = layers.partition_point(|&l| (l as u64) <= hi);
            out.extend(a..z);
        }
    }
    ok.then_some(out)
}

#[cfg(test)]
mod tests;
