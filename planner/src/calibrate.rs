//! `--calibrate BENCH.json`: replace datasheet figures with what `expertmesh bench` measured.
//!
//! Why this exists: datasheet bandwidths are upper bounds no kernel or NIC reaches; a plan's
//! throughput estimate is only as honest as the figures behind it. The bench JSON format is
//! described in BENCHMARKS.md and `expertmesh bench --help`: `{"machine": {...}, "results":
//! [{"name", "batch", "achieved", "limit", "unit", "ratio", "better", ...}]}`; several bench
//! files can be merged into one `results` array.
//!
//! A measurement calibrates only what was measured. The `machine` section says which devices
//! the kernel results come from: `device_kind` (`"cpu"` or `"gpu"`, as in topology files),
//! optionally `device_type` (a topology `[device_types]` name) and `backend`. `bench kernels`
//! writes `"device_kind": "cpu"`; a file that names no kind is taken as a CPU measurement (the
//! kernel bench measures the CPU backend), so a laptop's kernels.json never replaces an MI300X's
//! HBM bandwidth. [`apply`] returns what it changed and what it left alone, with reasons.
//!
//! Results read (others are ignored):
//! - **device memory bandwidth** ← kernel-bench decode results: `name` starting with `decode-`
//!   (`bench kernels` writes `decode-exact MODEL HH FF`), `unit` `"GB/s"`; `achieved` (weight
//!   bytes actually read per second) becomes the effective bandwidth of the devices of the
//!   measured kind (and type, when given). Preferred: results naming the planned model, then
//!   the same expert shape (`H{hidden} F{moe_intermediate}`), then any; among those the `batch`
//!   nearest the planned batch (log scale). A result with an `arch` field applies only to
//!   devices of that arch (and, when the file names no device kind, to any kind).
//! - **network bandwidth** ← `roce_dispatch_throughput` (RoCE NICs) and
//!   `tcp_dispatch_throughput` (TCP NICs), `unit` `"GB/s"`, the largest `batch` (streaming):
//!   `achieved` per NIC, times the node's NICs of that kind.
//! - **network hop latency** ← `roce_dispatch_rtt_p50` / `tcp_dispatch_rtt_p50`, `unit` `"us"`,
//!   the smallest `batch`: one way = `achieved / 2`.
//! - **intra-node links of shared-memory nodes** ← `shm_dispatch_throughput` (GB/s, largest
//!   batch) and `shm_dispatch_rtt_p50` (µs, smallest batch, halved). No bench measures xGMI or
//!   PCIe links; they keep their topology figures.

use crate::evaluate::{FigureSource, Hardware, nic_gb_s};
use expertmesh_topology::model::ModelSpec;
use expertmesh_topology::topology::{DeviceKind, IntraLinkKind, NicKind, Node, Topology};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// A bench file could not be used.
#[derive(Debug, thiserror::Error)]
pub enum CalibrateError {
    /// Unreadable.
    #[error("cannot read {}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// What failed.
        #[source]
        source: std::io::Error,
    },
    /// Not a bench JSON file.
    #[error("{}: {message}", path.display())]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
}

/// One bench result (the fields the planner reads).
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct BenchEntry {
    /// What was measured.
    pub name: String,
    /// Batch (tokens).
    #[serde(default)]
    pub batch: u64,
    /// Measured value.
    pub achieved: f64,
    /// Unit of `achieved`.
    #[serde(default)]
    pub unit: String,
    /// Device arch the result applies to, when the bench says.
    #[serde(default)]
    pub arch: Option<String>,
}

#[derive(Deserialize)]
struct RawBench {
    #[serde(default)]
    machine: serde_json::Value,
    results: Vec<BenchEntry>,
}

/// What a bench file's `machine` section says its kernel results were measured on.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Measured {
    /// `machine.device_kind`: `"cpu"` or `"gpu"`. None: the file does not say (taken as CPU).
    pub device_kind: Option<String>,
    /// `machine.device_type`: the topology device type measured, when the file says.
    pub device_type: Option<String>,
    /// `machine.backend`: the backend that ran, when the file says.
    pub backend: Option<String>,
}

impl Measured {
    fn from_machine(machine: &serde_json::Value) -> Measured {
        let text = |k: &str| machine.get(k).and_then(|v| v.as_str()).map(str::to_owned);
        Measured {
            device_kind: text("device_kind"),
            device_type: text("device_type"),
            backend: text("backend"),
        }
    }

    /// The device kind the kernel results calibrate: the file's, else CPU (what `bench
    /// kernels` measures).
    fn kind(&self) -> &str {
        self.device_kind
            .as_deref()
            .unwrap_or(DeviceKind::Cpu.name())
    }

    /// Whether kernel result `r` describes device `dev`.
    fn covers(&self, r: &BenchEntry, dev: &expertmesh_topology::Device) -> bool {
        let kind_ok = if self.device_kind.is_none() && r.arch.is_some() {
            true
        } else {
            dev.kind().name() == self.kind()
        };
        kind_ok
            && self
                .device_type
                .as_deref()
                .is_none_or(|t| dev.type_name() == Some(t))
            && r.arch.as_deref().is_none_or(|a| a == dev.arch())
    }

    /// "cpu devices (backend cpu-avx2x2)", for messages.
    fn describe(&self) -> String {
        let mut s = format!("{} devices", self.kind());
        if let Some(t) = &self.device_type {
            s += &format!(" of type {t}");
        }
        match (&self.device_kind, &self.backend) {
            (None, _) => s += " (assumed: its machine section names no device_kind)",
            (Some(_), Some(b)) => s += &format!(" (backend {b})"),
            (Some(_), None) => {}
        }
        s
    }
}

/// The results of one or more bench runs.
#[derive(Clone, Debug, PartialEq)]
pub struct BenchFile {
    /// Where they came from.
    pub path: PathBuf,
    /// What the kernel results were measured on.
    pub measured: Measured,
    /// The results.
    pub results: Vec<BenchEntry>,
}

impl BenchFile {
    /// Read a bench JSON file.
    pub fn load(path: &Path) -> Result<BenchFile, CalibrateError> {
        let io = |source| CalibrateError::Io {
            path: path.to_path_buf(),
            source,
        };
        let text = expertmesh_topology::diag::read_capped_text(path)
            .map_err(io)?
            .map_err(|at| {
                io(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("byte {at}: the file is not UTF-8 text"),
                ))
            })?;
        BenchFile::from_json_str(path, &text)
    }

    /// Parse bench JSON text (`path` names it in messages).
    pub fn from_json_str(path: &Path, text: &str) -> Result<BenchFile, CalibrateError> {
        let raw: RawBench = serde_json::from_str(text).map_err(|e| CalibrateError::Invalid {
            path: path.to_path_buf(),
            message: format!(
                "not a bench JSON file ({e}); expected {{\"machine\": {{...}}, \"results\": [{{\"name\", \"batch\", \"achieved\", \"unit\", ...}}]}} as `expertmesh bench ... --json` writes"
            ),
        })?;
        if let Some(bad) = raw
            .results
            .iter()
            .find(|r| !r.achieved.is_finite() || r.achieved <= 0.0)
        {
            return Err(CalibrateError::Invalid {
                path: path.to_path_buf(),
                message: format!(
                    "result \"{}\" (batch {}) has achieved = {}; a measured figure must be a positive number",
                    bad.name, bad.batch, bad.achieved
                ),
            });
        }
        Ok(BenchFile {
            path: path.to_path_buf(),
            measured: Measured::from_machine(&raw.machine),
            results: raw.results,
        })
    }

    fn decode_results(&self) -> impl Iterator<Item = &BenchEntry> {
        self.results
            .iter()
            .filter(|r| r.name.starts_with("decode-") && r.unit == "GB/s")
    }
}

/// One figure calibration changed, or left on its topology value.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CalibrationItem {
    /// The figure ("memory bandwidth", "network bandwidth per roce NIC", ...).
    pub figure: String,
    /// What it applies to ("32 gpu devices of type mi300x", ...).
    pub applies_to: String,
    /// The value the plan uses.
    pub value: f64,
    /// The value before calibration (changed figures only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub was: Option<f64>,
    /// Unit of `value` and `was`.
    pub unit: String,
    /// Where the new value comes from, or why the topology's was kept.
    pub why: String,
}

/// What `--calibrate` did: the figures it changed and the ones it left alone.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Calibration {
    /// Figures replaced by bench results.
    pub changed: Vec<CalibrationItem>,
    /// Figures that keep their topology (datasheet or `[measured]`) value.
    pub left_alone: Vec<CalibrationItem>,
    /// Remarks (results that matched nothing in the topology).
    #[serde(skip)]
    pub notes: Vec<String>,
}

/// What has been calibrated so far, over all bench files.
struct Touched {
    devices: Vec<bool>,
    /// NIC kinds calibrated, with the bandwidth per NIC measured.
    nics: Vec<(NicKind, f64)>,
    latency: bool,
    shm_bandwidth: bool,
    shm_latency: bool,
}

fn log_distance(a: u64, b: usize) -> f64 {
    ((a.max(1) as f64).ln() - (b.max(1) as f64).ln()).abs()
}

fn source(e: &BenchEntry, what: String, value: f64, unit: &str) -> FigureSource {
    FigureSource {
        what,
        value,
        unit: unit.into(),
        from: format!("bench: {} (batch {})", e.name, e.batch),
    }
}

/// A changed figure's `why`: the result and the file it came from.
fn from_bench(bench: &BenchFile, e: &BenchEntry) -> String {
    format!(
        "bench: {} (batch {}) in {}",
        e.name,
        e.batch,
        bench.path.display()
    )
}

/// Apply the bench results to `hw` for a plan of `model` at `batch` tokens per call: each
/// measurement replaces only the figures of what it measured. Returns what changed, what was
/// left alone and why, and remarks.
pub fn apply(
    hw: &mut Hardware,
    topology: &Topology,
    model: &ModelSpec,
    benches: &[BenchFile],
    batch: usize,
) -> Calibration {
    let mut cal = Calibration::default();
    if benches.is_empty() {
        return cal;
    }
    let mut touched = Touched {
        devices: vec![false; topology.devices().len()],
        nics: Vec::new(),
        latency: false,
        shm_bandwidth: false,
        shm_latency: false,
    };
    for bench in benches {
        let before = cal.changed.len();
        apply_device_bandwidth(hw, topology, model, bench, batch, &mut cal, &mut touched);
        for (kind, prefix) in [(NicKind::Roce, "roce"), (NicKind::Tcp, "tcp")] {
            apply_network(hw, topology, bench, kind, prefix, &mut cal, &mut touched);
        }
        apply_shm_links(hw, topology, bench, &mut cal, &mut touched);
        if cal.changed.len() == before {
            cal.notes.push(format!(
                "calibration: {} changed nothing (results read: decode-* GB/s for devices of the measured kind, roce|tcp|shm_dispatch_throughput, *_dispatch_rtt_p50 for links the topology has); topology figures kept",
                bench.path.display()
            ));
        }
    }
    left_alone_devices(hw, topology, benches, &touched, &mut cal);
    left_alone_links(hw, topology, &touched, &mut cal);
    cal
}

/// The result named `name` in `unit` with the largest batch (the last of equals).
fn largest_batch<'a>(bench: &'a BenchFile, name: &str, unit: &str) -> Option<&'a BenchEntry> {
    bench
        .results
        .iter()
        .filter(|r| r.name == name && r.unit == unit)
        .max_by_key(|r| r.batch)
}

/// The result named `name` in `unit` with the smallest batch (the first of equals).
fn smallest_batch<'a>(bench: &'a BenchFile, name: &str, unit: &str) -> Option<&'a BenchEntry> {
    bench
        .results
        .iter()
        .filter(|r| r.name == name && r.unit == unit)
        .min_by_key(|r| r.batch)
}

/// "32 gpu devices of type mi300x", "2 cpu devices (local/cpu0, local/cpu1)": the devices
/// `ranks` of `topology`, grouped by kind and type (or arch).
fn describe_devices(topology: &Topology, ranks: &[usize]) -> String {
    let mut groups: Vec<(String, Vec<&str>)> = Vec::new();
    for &d in ranks {
        let dev = &topology.devices()[d];
        let key = match dev.type_name() {
            Some(t) => format!("{} device{{s}} of type {t}", dev.kind().name()),
            None => format!("{} device{{s}} (arch {})", dev.kind().name(), dev.arch()),
        };
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, ids)) => ids.push(dev.id()),
            None => groups.push((key, vec![dev.id()])),
        }
    }
    groups
        .iter()
        .map(|(key, ids)| {
            let plural = if ids.len() == 1 { "" } else { "s" };
            let mut s = format!("{} {}", ids.len(), key.replace("{s}", plural));
            if ids.len() <= 4 {
                s += &format!(": {}", ids.join(", "));
            }
            s
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// Apply step: device memory bandwidth from kernel decode results — the most specific pool
/// (model, then expert shape, then any), one result per arch, nearest the planned batch, on the
/// devices of the kind (and type) the file measured.
fn apply_device_bandwidth(
    hw: &mut Hardware,
    topology: &Topology,
    model: &ModelSpec,
    bench: &BenchFile,
    batch: usize,
    cal: &mut Calibration,
    touched: &mut Touched,
) {
    let decode: Vec<&BenchEntry> = bench.decode_results().collect();
    let shape = format!("H{} F{}", model.hidden, model.moe_intermediate);
    let by_model: Vec<&BenchEntry> = decode
        .iter()
        .copied()
        .filter(|r| r.name.split_whitespace().any(|w| w == model.name))
        .collect();
    let by_shape: Vec<&BenchEntry> = decode
        .iter()
        .copied()
        .filter(|r| r.name.contains(&shape))
        .collect();
    let pool = [by_model, by_shape, decode.clone()]
        .into_iter()
        .find(|p| !p.is_empty())
        .unwrap_or_default();
    // One choice per arch (None = every device of the measured kind).
    let mut archs: Vec<Option<String>> = pool.iter().map(|r| r.arch.clone()).collect();
    archs.sort();
    archs.dedup();
    for arch in archs {
        let Some(best) = pool
            .iter()
            .filter(|r| r.arch == arch)
            .min_by(|a, b| log_distance(a.batch, batch).total_cmp(&log_distance(b.batch, batch)))
        else {
            continue;
        };
        let hits: Vec<usize> = (0..topology.devices().len())
            .filter(|&d| bench.measured.covers(best, &topology.devices()[d]))
            .collect();
        let Some(&first) = hits.first() else {
            cal.notes.push(format!(
                "calibration: {} measured {}{}; no device of {} is one, so its decode results were not applied",
                bench.path.display(),
                bench.measured.describe(),
                arch.as_deref()
                    .map(|a| format!(", arch {a}"))
                    .unwrap_or_default(),
                topology.name()
            ));
            continue;
        };
        let was = hw.device_bandwidth_gb_s[first];
        for &d in &hits {
            hw.device_bandwidth_gb_s[d] = best.achieved;
            touched.devices[d] = true;
        }
        cal.changed.push(CalibrationItem {
            figure: "memory bandwidth".into(),
            applies_to: describe_devices(topology, &hits),
            value: best.achieved,
            was: Some(was),
            unit: "GB/s".into(),
            why: format!(
                "{}, measured on {}",
                from_bench(bench, best),
                bench.measured.describe()
            ),
        });
        hw.sources.push(source(
            best,
            format!(
                "effective memory bandwidth ({} device{}, {}{})",
                hits.len(),
                if hits.len() == 1 { "" } else { "s" },
                bench.measured.kind(),
                arch.map(|a| format!(", arch {a}")).unwrap_or_default()
            ),
            best.achieved,
            "GB/s",
        ));
    }
}

/// Left-alone step: devices no bench result described keep their topology bandwidth; one item
/// per kind and type, saying what the bench files measured instead.
fn left_alone_devices(
    hw: &Hardware,
    topology: &Topology,
    benches: &[BenchFile],
    touched: &Touched,
    cal: &mut Calibration,
) {
    let measured: Vec<String> = benches
        .iter()
        .filter(|b| b.decode_results().next().is_some())
        .map(|b| format!("{} measured {}", b.path.display(), b.measured.describe()))
        .collect();
    let why = if measured.is_empty() {
        "no bench file has decode-* GB/s results (`expertmesh bench kernels`)".to_owned()
    } else {
        format!(
            "{}; a measurement calibrates only devices of the kind it was measured on",
            measured.join("; ")
        )
    };
    let mut groups: Vec<Vec<usize>> = Vec::new();
    for (d, dev) in topology.devices().iter().enumerate() {
        if touched.devices[d] {
            continue;
        }
        let same = |&g: &usize| {
            let o = &topology.devices()[g];
            o.kind() == dev.kind() && o.type_name() == dev.type_name() && o.arch() == dev.arch()
        };
        match groups.iter_mut().find(|g| same(&g[0])) {
            Some(g) => g.push(d),
            None => groups.push(vec![d]),
        }
    }
    for g in groups {
        cal.left_alone.push(CalibrationItem {
            figure: "memory bandwidth".into(),
            applies_to: describe_devices(topology, &g),
            value: hw.device_bandwidth_gb_s[g[0]],
            was: None,
            unit: "GB/s".into(),
            why: why.clone(),
        });
    }
}

/// Apply step: network bandwidth and hop latency from the dispatch results of one NIC kind.
fn apply_network(
    hw: &mut Hardware,
    topology: &Topology,
    bench: &BenchFile,
    kind: NicKind,
    prefix: &str,
    cal: &mut Calibration,
    touched: &mut Touched,
) {
    let has_kind = |n: &Node| n.nics().iter().any(|c| c.kind() == kind);
    let any_node = topology.nodes().iter().any(has_kind);
    if let Some(r) = largest_batch(bench, &format!("{prefix}_dispatch_throughput"), "GB/s") {
        if !any_node {
            cal.notes.push(format!(
                "calibration: {} measured {prefix}, but the topology has no {prefix} NIC; not applied",
                r.name
            ));
        } else {
            let was = touched
                .nics
                .iter()
                .find(|(k, _)| *k == kind)
                .map(|&(_, v)| v)
                .unwrap_or_else(|| nic_datasheet(topology, kind));
            touched.nics.retain(|(k, _)| *k != kind);
            touched.nics.push((kind, r.achieved));
            // Each node NIC by NIC: a calibrated kind's measured rate, the others' own figure
            // (a node's total is not split evenly over NICs of different speeds).
            for (n, node) in topology.nodes().iter().enumerate() {
                if !has_kind(node) {
                    continue;
                }
                hw.node_nic_gb_s[n] = node
                    .nics()
                    .iter()
                    .map(|c| {
                        touched
                            .nics
                            .iter()
                            .find(|(k, _)| *k == c.kind())
                            .map_or_else(|| nic_gb_s(topology, c), |&(_, v)| v)
                    })
                    .sum();
            }
            cal.changed.push(CalibrationItem {
                figure: format!("network bandwidth per {prefix} NIC"),
                applies_to: describe_nics(topology, kind),
                value: r.achieved,
                was: Some(was),
                unit: "GB/s".into(),
                why: from_bench(bench, r),
            });
            hw.sources.push(source(
                r,
                format!("network bandwidth per {prefix} NIC"),
                r.achieved,
                "GB/s",
            ));
        }
    }
    if let Some(r) = smallest_batch(bench, &format!("{prefix}_dispatch_rtt_p50"), "us")
        && any_node
    {
        let was = hw.inter_latency_us;
        hw.inter_latency_us = r.achieved / 2.0;
        touched.latency = true;
        cal.changed.push(CalibrationItem {
            figure: "network hop latency (one way = round trip / 2)".into(),
            applies_to: format!("every network hop ({prefix} measured)"),
            value: r.achieved / 2.0,
            was: Some(was),
            unit: "us".into(),
            why: from_bench(bench, r),
        });
        hw.sources.push(source(
            r,
            "network hop latency (one way = round trip / 2)".into(),
            r.achieved / 2.0,
            "us",
        ));
    }
}

/// The bandwidth of the first NIC of `kind` before calibration.
fn nic_datasheet(topology: &Topology, kind: NicKind) -> f64 {
    topology
        .nodes()
        .iter()
        .flat_map(|n| n.nics())
        .find(|c| c.kind() == kind)
        .map_or(0.0, |c| nic_gb_s(topology, c))
}

/// "32 roce NICs on 4 nodes".
fn describe_nics(topology: &Topology, kind: NicKind) -> String {
    let nics = |n: &Node| n.nics().iter().filter(|c| c.kind() == kind).count();
    let count: usize = topology.nodes().iter().map(nics).sum();
    let nodes = topology.nodes().iter().filter(|n| nics(n) > 0).count();
    format!(
        "{count} {} NIC{} on {nodes} node{}",
        kind.name(),
        if count == 1 { "" } else { "s" },
        if nodes == 1 { "" } else { "s" }
    )
}

/// The nodes whose device link is `kind`.
fn nodes_with_link(topology: &Topology, kind: IntraLinkKind) -> Vec<usize> {
    (0..topology.nodes().len())
        .filter(|&n| {
            topology.nodes()[n]
                .intra_link()
                .is_some_and(|l| l.kind() == kind)
        })
        .collect()
}

/// Apply step: the device links of shared-memory nodes from the shm dispatch results.
fn apply_shm_links(
    hw: &mut Hardware,
    topology: &Topology,
    bench: &BenchFile,
    cal: &mut Calibration,
    touched: &mut Touched,
) {
    let shm_nodes = nodes_with_link(topology, IntraLinkKind::Shm);
    if shm_nodes.is_empty() {
        return;
    }
    let applies_to = describe_links(topology, &shm_nodes, IntraLinkKind::Shm);
    if let Some(r) = largest_batch(bench, "shm_dispatch_throughput", "GB/s") {
        let was = hw.node_intra_gb_s[shm_nodes[0]];
        for &n in &shm_nodes {
            hw.node_intra_gb_s[n] = Some(r.achieved);
        }
        touched.shm_bandwidth = true;
        cal.changed.push(CalibrationItem {
            figure: "device link bandwidth inside a node".into(),
            applies_to: applies_to.clone(),
            value: r.achieved,
            was,
            unit: "GB/s".into(),
            why: from_bench(bench, r),
        });
        hw.sources.push(source(
            r,
            "shared-memory device link bandwidth".into(),
            r.achieved,
            "GB/s",
        ));
    }
    if let Some(r) = smallest_batch(bench, "shm_dispatch_rtt_p50", "us") {
        let was = hw.node_intra_latency_us[shm_nodes[0]];
        for &n in &shm_nodes {
            hw.node_intra_latency_us[n] = r.achieved / 2.0;
        }
        touched.shm_latency = true;
        cal.changed.push(CalibrationItem {
            figure: "device link latency inside a node (one way)".into(),
            applies_to,
            value: r.achieved / 2.0,
            was: Some(was),
            unit: "us".into(),
            why: from_bench(bench, r),
        });
        hw.sources.push(source(
            r,
            "shared-memory hop latency (one way)".into(),
            r.achieved / 2.0,
            "us",
        ));
    }
}

/// "shm links of 1 node: local".
fn describe_links(topology: &Topology, nodes: &[usize], kind: IntraLinkKind) -> String {
    let names: Vec<&str> = nodes.iter().map(|&n| topology.nodes()[n].name()).collect();
    let mut s = format!(
        "{} links of {} node{}",
        kind.name(),
        names.len(),
        if names.len() == 1 { "" } else { "s" }
    );
    if names.len() <= 4 {
        s += &format!(": {}", names.join(", "));
    }
    s
}

/// Left-alone step: NIC kinds, the network hop and the device links no result measured.
fn left_alone_links(hw: &Hardware, topology: &Topology, touched: &Touched, cal: &mut Calibration) {
    let mut item = |figure: String, applies_to: String, value: f64, unit: &str, why: String| {
        cal.left_alone.push(CalibrationItem {
            figure,
            applies_to,
            value,
            was: None,
            unit: unit.into(),
            why,
        })
    };
    let kinds = [NicKind::Roce, NicKind::Tcp];
    let present: Vec<NicKind> = kinds
        .into_iter()
        .filter(|&k| {
            topology
                .nodes()
                .iter()
                .any(|n| n.nics().iter().any(|c| c.kind() == k))
        })
        .collect();
    for &k in present
        .iter()
        .filter(|k| !touched.nics.iter().any(|(t, _)| t == *k))
    {
        item(
            format!("network bandwidth per {} NIC", k.name()),
            describe_nics(topology, k),
            nic_datasheet(topology, k),
            "GB/s",
            format!("no {}_dispatch_throughput result", k.name()),
        );
    }
    if !present.is_empty() && !touched.latency {
        item(
            "network hop latency (one way)".into(),
            "every network hop".into(),
            hw.inter_latency_us,
            "us",
            "no *_dispatch_rtt_p50 result for a NIC kind the topology has".into(),
        );
    }
    for kind in [IntraLinkKind::Xgmi, IntraLinkKind::Pcie, IntraLinkKind::Shm] {
        let nodes = nodes_with_link(topology, kind);
        let Some(&first) = nodes.first() else {
            continue;
        };
        let applies_to = describe_links(topology, &nodes, kind);
        let (bw_why, lat_why) = if kind == IntraLinkKind::Shm {
            (
                (!touched.shm_bandwidth).then(|| "no shm_dispatch_throughput result".to_owned()),
                (!touched.shm_latency).then(|| "no shm_dispatch_rtt_p50 result".to_owned()),
            )
        } else {
            let why = format!("no bench measures {} links", kind.name());
            (Some(why.clone()), Some(why))
        };
        if let (Some(why), Some(bw)) = (bw_why, hw.node_intra_gb_s[first]) {
            let figure = "device link bandwidth inside a node".to_owned();
            item(figure, applies_to.clone(), bw, "GB/s", why);
        }
        if let Some(why) = lat_why {
            let figure = "device link latency inside a node (one way)".to_owned();
            item(
                figure,
                applies_to,
                hw.node_intra_latency_us[first],
                "us",
                why,
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use expertmesh_topology::model::preset_by_name;

    fn topo() -> Topology {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/mi300x-4x8.toml");
        Topology::load(&path).unwrap()
    }

    #[test]
    fn decode_and_transport_results_replace_datasheet_figures() {
        let t = topo();
        let m = preset_by_name("kimi-k2").unwrap();
        let json = r#"{"machine": {"device_kind": "gpu"}, "results": [
            {"name": "decode-exact kimi-k2 H7168 F2048", "batch": 1, "achieved": 100.0, "limit": 200.0, "unit": "GB/s", "ratio": 0.5},
            {"name": "decode-exact kimi-k2 H7168 F2048", "batch": 64, "achieved": 150.0, "limit": 200.0, "unit": "GB/s", "ratio": 0.75},
            {"name": "decode-exact qwen3-30b-a3b H2048 F768", "batch": 64, "achieved": 9.0, "limit": 200.0, "unit": "GB/s", "ratio": 0.05},
            {"name": "roce_dispatch_throughput", "batch": 1, "achieved": 5.0, "limit": 50.0, "unit": "GB/s", "ratio": 0.1},
            {"name": "roce_dispatch_throughput", "batch": 256, "achieved": 40.0, "limit": 50.0, "unit": "GB/s", "ratio": 0.8},
            {"name": "roce_dispatch_rtt_p50", "batch": 1, "achieved": 12.0, "limit": 8.0, "unit": "us", "ratio": 1.5}
        ]}"#;
        let bench = BenchFile::from_json_str(Path::new("b.json"), json).unwrap();
        let mut hw = Hardware::from_topology(&t);
        let cal = apply(&mut hw, &t, &m, std::slice::from_ref(&bench), 48);
        assert!(cal.notes.is_empty(), "{:?}", cal.notes);
        assert!(hw.device_bandwidth_gb_s.iter().all(|&b| b == 150.0));
        // 8 RoCE NICs per node at 40 GB/s each.
        assert!(hw.node_nic_gb_s.iter().all(|&b| (b - 320.0).abs() < 1e-9));
        assert_eq!(hw.inter_latency_us, 6.0);
        let mut hw1 = Hardware::from_topology(&t);
        apply(&mut hw1, &t, &m, &[bench], 1);
        assert_eq!(hw1.device_bandwidth_gb_s[0], 100.0);
    }

    /// A node with NICs of two kinds: each NIC keeps its own figure until its kind is
    /// measured (the node's total is not split evenly over NICs of different speeds).
    #[test]
    fn nodes_with_two_nic_kinds_are_calibrated_nic_by_nic() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/mi300x-4x8.toml");
        let text: String = std::fs::read_to_string(path)
            .unwrap()
            .lines()
            .map(|l| {
                if l.trim_start().starts_with("{ name = \"mlx5_7\"") {
                    "  { name = \"mlx5_7\", kind = \"tcp\", speed_gbit_s = 10, mtu = 1500 },"
                        .to_owned()
                } else {
                    l.to_owned()
                }
            })
            .collect::<Vec<_>>()
            .join("\n");
        let t = Topology::from_toml_str(&text).unwrap();
        let m = preset_by_name("kimi-k2").unwrap();
        let tcp_line = 10.0 / 8.0 * crate::wire::tcp_payload_share(1500);
        let roce = r#"{"name": "roce_dispatch_throughput", "batch": 256, "achieved": 40.0, "limit": 50.0, "unit": "GB/s", "ratio": 0.8}"#;
        let tcp = r#"{"name": "tcp_dispatch_throughput", "batch": 256, "achieved": 1.0, "limit": 1.2, "unit": "GB/s", "ratio": 0.8}"#;
        let file = |results: &[&str]| {
            let json = format!(
                r#"{{"machine": {{"device_kind": "gpu"}}, "results": [{}]}}"#,
                results.join(",")
            );
            BenchFile::from_json_str(Path::new("b.json"), &json).unwrap()
        };
        let mut hw = Hardware::from_topology(&t);
        let before = hw.node_nic_gb_s.clone();
        assert!(
            before
                .iter()
                .all(|&b| (b - (7.0 * 50.0 + tcp_line)).abs() < 1e-9)
        );
        let cal = apply(&mut hw, &t, &m, &[file(&[roce])], 48);
        for &b in &hw.node_nic_gb_s {
            assert!((b - (7.0 * 40.0 + tcp_line)).abs() < 1e-9, "{b}");
        }
        let changed = cal
            .changed
            .iter()
            .find(|c| c.figure.contains("roce"))
            .unwrap();
        assert_eq!(
            changed.was,
            Some(50.0),
            "the RoCE NIC's own datasheet figure"
        );
        let mut hw = Hardware::from_topology(&t);
        apply(&mut hw, &t, &m, &[file(&[roce, tcp])], 48);
        for &b in &hw.node_nic_gb_s {
            assert!((b - (7.0 * 40.0 + 1.0)).abs() < 1e-9, "both measured: {b}");
        }
    }

    #[test]
    fn unusable_files_say_why() {
        for (text, want) in [
            ("{}", "not a bench JSON"),
            ("[1]", "not a bench JSON"),
            (
                r#"{"results": [{"name": "x", "achieved": -1}]}"#,
                "positive",
            ),
        ] {
            let e = BenchFile::from_json_str(Path::new("b.json"), text).unwrap_err();
            assert!(e.to_string().contains(want), "{text}: {e}");
        }
        let t = topo();
        let m = preset_by_name("kimi-k2").unwrap();
        let bench = BenchFile::from_json_str(
            Path::new("b.json"),
            r#"{"results": [{"name": "tcp_dispatch_throughput", "batch": 8, "achieved": 3.0, "unit": "GB/s"}]}"#,
        )
        .unwrap();
        let mut hw = Hardware::from_topology(&t);
        let before = hw.clone();
        let cal = apply(&mut hw, &t, &m, &[bench], 8);
        let notes = &cal.notes;
        assert!(notes.iter().any(|n| n.contains("no tcp NIC")), "{notes:?}");
        assert!(cal.changed.is_empty(), "{:?}", cal.changed);
        assert_eq!(hw.node_nic_gb_s, before.node_nic_gb_s);
    }

    /// A kernels.json as `bench kernels` writes it on a CPU: 11 GB/s.
    const CPU_KERNELS: &str = r#"{"machine": {"device_kind": "cpu", "backend": "cpu-avx2x2"}, "results": [
        {"name": "decode-exact kimi-k2 H7168 F2048", "batch": 64, "achieved": 11.0, "limit": 12.0, "unit": "GB/s", "ratio": 0.9}
    ]}"#;

    fn single_host() -> Topology {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/single-host.toml");
        Topology::load(&path).unwrap()
    }

    #[test]
    fn a_cpu_measurement_leaves_gpus_on_their_datasheet() {
        let t = topo();
        let m = preset_by_name("kimi-k2").unwrap();
        for text in [
            CPU_KERNELS.to_owned(),
            // An older file whose machine section names no device kind: still a CPU run.
            CPU_KERNELS.replace(
                r#""device_kind": "cpu", "backend": "cpu-avx2x2""#,
                r#""cpus": 2"#,
            ),
        ] {
            let bench = BenchFile::from_json_str(Path::new("kernels.json"), &text).unwrap();
            let mut hw = Hardware::from_topology(&t);
            let before = hw.clone();
            let cal = apply(&mut hw, &t, &m, &[bench], 64);
            assert_eq!(hw.device_bandwidth_gb_s, before.device_bandwidth_gb_s);
            assert!(cal.changed.is_empty(), "{:?}", cal.changed);
            let mem = cal
                .left_alone
                .iter()
                .find(|i| i.figure == "memory bandwidth")
                .expect("device bandwidth listed as left alone");
            assert_eq!(mem.value, 5300.0);
            assert_eq!(mem.applies_to, "32 gpu devices of type mi300x");
            assert!(
                mem.why.contains("kernels.json measured cpu devices"),
                "{}",
                mem.why
            );
            assert!(
                cal.notes.iter().any(|n| n.contains("not applied")),
                "{:?}",
                cal.notes
            );
            // RoCE NICs and xGMI links are listed as left alone too.
            let figures: Vec<&str> = cal.left_alone.iter().map(|i| i.figure.as_str()).collect();
            assert!(
                figures.contains(&"network bandwidth per roce NIC"),
                "{figures:?}"
            );
            assert!(
                cal.left_alone
                    .iter()
                    .any(|i| i.why == "no bench measures xgmi links"),
                "{:?}",
                cal.left_alone
            );
        }
    }

    #[test]
    fn a_cpu_measurement_calibrates_cpu_devices() {
        let t = single_host();
        let m = preset_by_name("kimi-k2").unwrap();
        let bench = BenchFile::from_json_str(Path::new("kernels.json"), CPU_KERNELS).unwrap();
        let mut hw = Hardware::from_topology(&t);
        let cal = apply(&mut hw, &t, &m, &[bench], 64);
        assert_eq!(hw.device_bandwidth_gb_s, vec![11.0, 11.0]);
        assert_eq!(cal.changed.len(), 1, "{:?}", cal.changed);
        let c = &cal.changed[0];
        assert_eq!(c.was, Some(20.0));
        assert_eq!(
            c.applies_to,
            "2 cpu devices (arch cpu): local/cpu0, local/cpu1"
        );
        assert!(c.why.contains("backend cpu-avx2x2"), "{}", c.why);
        assert!(
            cal.left_alone
                .iter()
                .all(|i| i.figure != "memory bandwidth")
        );
        // A GPU-only measurement leaves these CPU workers alone.
        let gpu = CPU_KERNELS.replace(r#""device_kind": "cpu""#, r#""device_kind": "gpu""#);
        let bench = BenchFile::from_json_str(Path::new("gpu.json"), &gpu).unwrap();
        let mut hw = Hardware::from_topology(&t);
        let cal = apply(&mut hw, &t, &m, &[bench], 64);
        assert_eq!(hw.device_bandwidth_gb_s, vec![20.0, 20.0]);
        assert!(cal.changed.is_empty());
    }
}
