//! `--calibrate BENCH.json`: replace datasheet figures with what `expertmesh bench` measured.
//!
//! Why this exists: datasheet bandwidths are upper bounds no kernel or NIC reaches; a plan's
//! throughput estimate is only as honest as the figures behind it. The bench JSON format is the
//! design brief's (§3): `{"machine": {...}, "results": [{"name", "batch", "achieved", "limit",
//! "unit", "ratio", ...}]}`; several bench files can be merged into one `results` array.
//!
//! Results read (others are ignored and listed as unused):
//! - **device memory bandwidth** ← kernel-bench decode results: `name` starting with `decode-`
//!   (`bench kernels` writes `decode-exact MODEL HH FF`), `unit` `"GB/s"`; `achieved` (weight
//!   bytes actually read per second) becomes the effective bandwidth. Preferred: results naming
//!   the planned model, then the same expert shape (`H{hidden} F{moe_intermediate}`), then any;
//!   among those the `batch` nearest the planned batch (log scale). A result with an `arch` field
//!   applies only to devices of that arch, otherwise to every device.
//! - **network bandwidth** ← `roce_dispatch_throughput` (RoCE NICs) and
//!   `tcp_dispatch_throughput` (TCP NICs), `unit` `"GB/s"`, the largest `batch` (streaming):
//!   `achieved` per NIC, times the node's NICs of that kind.
//! - **network hop latency** ← `roce_dispatch_rtt_p50` / `tcp_dispatch_rtt_p50`, `unit` `"us"`,
//!   the smallest `batch`: one way = `achieved / 2`.
//! - **intra-node links of shared-memory nodes** ← `shm_dispatch_throughput` (GB/s, largest
//!   batch) and `shm_dispatch_rtt_p50` (µs, smallest batch, halved).

use crate::evaluate::{FigureSource, Hardware};
use expertmesh_topology::model::ModelSpec;
use expertmesh_topology::topology::{IntraLinkKind, NicKind, Node, Topology};
use serde::Deserialize;
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
    results: Vec<BenchEntry>,
}

/// The results of one or more bench runs.
#[derive(Clone, Debug, PartialEq)]
pub struct BenchFile {
    /// Where they came from.
    pub path: PathBuf,
    /// The results.
    pub results: Vec<BenchEntry>,
}

impl BenchFile {
    /// Read a bench JSON file.
    pub fn load(path: &Path) -> Result<BenchFile, CalibrateError> {
        let text = std::fs::read_to_string(path).map_err(|source| CalibrateError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        BenchFile::from_json_str(path, &text)
    }

    /// Parse bench JSON text (`path` names it in messages).
    pub fn from_json_str(path: &Path, text: &str) -> Result<BenchFile, CalibrateError> {
        let raw: RawBench = serde_json::from_str(text).map_err(|e| CalibrateError::Invalid {
            path: path.to_path_buf(),
            message: format!(
                "not a bench JSON file ({e}); expected {{\"results\": [{{\"name\", \"batch\", \"achieved\", \"unit\", ...}}]}} as `expertmesh bench ... --json` writes"
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
            results: raw.results,
        })
    }
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

/// Apply the bench results to `hw` for a plan of `model` at `batch` tokens per call. Returns
/// remarks (results that matched nothing in the topology).
pub fn apply(
    hw: &mut Hardware,
    topology: &Topology,
    model: &ModelSpec,
    bench: &BenchFile,
    batch: usize,
) -> Vec<String> {
    let mut notes = Vec::new();
    apply_device_bandwidth(hw, topology, model, bench, batch, &mut notes);
    for (kind, prefix) in [(NicKind::Roce, "roce"), (NicKind::Tcp, "tcp")] {
        apply_network(hw, topology, bench, kind, prefix, &mut notes);
    }
    apply_shm_links(hw, topology, bench);
    if hw.sources.iter().all(|s| !s.from.starts_with("bench:")) {
        notes.push(format!(
            "calibration: {} has no result the planner reads (decode-* GB/s, roce|tcp|shm_dispatch_throughput, *_dispatch_rtt_p50); datasheet figures kept",
            bench.path.display()
        ));
    }
    notes
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

/// Apply step: device memory bandwidth from kernel decode results — the most specific pool
/// (model, then expert shape, then any), one result per arch, nearest the planned batch.
fn apply_device_bandwidth(
    hw: &mut Hardware,
    topology: &Topology,
    model: &ModelSpec,
    bench: &BenchFile,
    batch: usize,
    notes: &mut Vec<String>,
) {
    let decode: Vec<&BenchEntry> = bench
        .results
        .iter()
        .filter(|r| r.name.starts_with("decode-") && r.unit == "GB/s")
        .collect();
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
    // One choice per arch (None = every device).
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
        let mut hit = 0;
        for (d, dev) in topology.devices().iter().enumerate() {
            if arch.as_deref().is_none_or(|a| a == dev.arch()) {
                hw.device_bandwidth_gb_s[d] = best.achieved;
                hit += 1;
            }
        }
        if hit == 0 {
            notes.push(format!(
                "calibration: {} is for arch {}, which no device of {} has; not applied",
                best.name,
                arch.as_deref().unwrap_or("-"),
                topology.name()
            ));
        } else {
            hw.sources.push(source(
                best,
                format!(
                    "effective memory bandwidth ({hit} device{}{})",
                    if hit == 1 { "" } else { "s" },
                    arch.map(|a| format!(", arch {a}")).unwrap_or_default()
                ),
                best.achieved,
                "GB/s",
            ));
        }
    }
}

/// Apply step: network bandwidth and hop latency from the dispatch results of one NIC kind.
fn apply_network(
    hw: &mut Hardware,
    topology: &Topology,
    bench: &BenchFile,
    kind: NicKind,
    prefix: &str,
    notes: &mut Vec<String>,
) {
    let has_kind = |n: &Node| n.nics().iter().any(|c| c.kind() == kind);
    let any_node = topology.nodes().iter().any(has_kind);
    if let Some(r) = largest_batch(bench, &format!("{prefix}_dispatch_throughput"), "GB/s") {
        if !any_node {
            notes.push(format!(
                "calibration: {} measured {prefix}, but the topology has no {prefix} NIC; not applied",
                r.name
            ));
        } else {
            for (n, node) in topology.nodes().iter().enumerate() {
                let mut bw = 0.0;
                for c in node.nics() {
                    bw += if c.kind() == kind {
                        r.achieved
                    } else {
                        hw_nic_share(hw.node_nic_gb_s[n], node.nics().len())
                    };
                }
                if has_kind(node) {
                    hw.node_nic_gb_s[n] = bw;
                }
            }
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
        hw.inter_latency_us = r.achieved / 2.0;
        hw.sources.push(source(
            r,
            "network hop latency (one way = round trip / 2)".into(),
            r.achieved / 2.0,
            "us",
        ));
    }
}

/// Apply step: the device links of shared-memory nodes from the shm dispatch results.
fn apply_shm_links(hw: &mut Hardware, topology: &Topology, bench: &BenchFile) {
    let shm_nodes: Vec<usize> = (0..topology.nodes().len())
        .filter(|&n| {
            topology.nodes()[n]
                .intra_link()
                .is_some_and(|l| l.kind() == IntraLinkKind::Shm)
        })
        .collect();
    if shm_nodes.is_empty() {
        return;
    }
    if let Some(r) = largest_batch(bench, "shm_dispatch_throughput", "GB/s") {
        for &n in &shm_nodes {
            hw.node_intra_gb_s[n] = Some(r.achieved);
        }
        hw.sources.push(source(
            r,
            "shared-memory device link bandwidth".into(),
            r.achieved,
            "GB/s",
        ));
    }
    if let Some(r) = smallest_batch(bench, "shm_dispatch_rtt_p50", "us") {
        for &n in &shm_nodes {
            hw.node_intra_latency_us[n] = r.achieved / 2.0;
        }
        hw.sources.push(source(
            r,
            "shared-memory hop latency (one way)".into(),
            r.achieved / 2.0,
            "us",
        ));
    }
}

/// A NIC's share of a node's current aggregate (for mixed-kind nodes).
fn hw_nic_share(node_total: f64, nics: usize) -> f64 {
    node_total / nics.max(1) as f64
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
        let json = r#"{"machine": {}, "results": [
            {"name": "decode-exact kimi-k2 H7168 F2048", "batch": 1, "achieved": 100.0, "limit": 200.0, "unit": "GB/s", "ratio": 0.5},
            {"name": "decode-exact kimi-k2 H7168 F2048", "batch": 64, "achieved": 150.0, "limit": 200.0, "unit": "GB/s", "ratio": 0.75},
            {"name": "decode-exact qwen3-30b-a3b H2048 F768", "batch": 64, "achieved": 9.0, "limit": 200.0, "unit": "GB/s", "ratio": 0.05},
            {"name": "roce_dispatch_throughput", "batch": 1, "achieved": 5.0, "limit": 50.0, "unit": "GB/s", "ratio": 0.1},
            {"name": "roce_dispatch_throughput", "batch": 256, "achieved": 40.0, "limit": 50.0, "unit": "GB/s", "ratio": 0.8},
            {"name": "roce_dispatch_rtt_p50", "batch": 1, "achieved": 12.0, "limit": 8.0, "unit": "us", "ratio": 1.5}
        ]}"#;
        let bench = BenchFile::from_json_str(Path::new("b.json"), json).unwrap();
        let mut hw = Hardware::from_topology(&t);
        let notes = apply(&mut hw, &t, &m, &bench, 48);
        assert!(notes.is_empty(), "{notes:?}");
        assert!(hw.device_bandwidth_gb_s.iter().all(|&b| b == 150.0));
        // 8 RoCE NICs per node at 40 GB/s each.
        assert!(hw.node_nic_gb_s.iter().all(|&b| (b - 320.0).abs() < 1e-9));
        assert_eq!(hw.inter_latency_us, 6.0);
        let mut hw1 = Hardware::from_topology(&t);
        apply(&mut hw1, &t, &m, &bench, 1);
        assert_eq!(hw1.device_bandwidth_gb_s[0], 100.0);
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
        let notes = apply(&mut hw, &t, &m, &bench, 8);
        assert!(notes.iter().any(|n| n.contains("no tcp NIC")), "{notes:?}");
        assert_eq!(hw.node_nic_gb_s, before.node_nic_gb_s);
    }
}
