//! The bench report format shared by `expertmesh bench kernels|transport|fabric`.
//!
//! Why this exists: every benchmark reports its figures against a limit measured in the same
//! run, in one JSON shape (described in BENCHMARKS.md and `expertmesh bench --help`), so results
//! from different machines and benches can be compared by tools without per-bench parsing:
//! `{"machine": {...}, "results": [{"name", "batch", "achieved", "limit", "unit", "ratio",
//! "better", ...}]}`. `better` says which way the ratio is good: `"higher"` for throughputs,
//! `"lower"` for latencies.

use serde::Serialize;
use std::collections::BTreeMap;
use std::path::Path;

/// Description of the machine a bench ran on.
#[derive(Debug, Clone, Serialize)]
pub struct MachineInfo {
    /// Host name.
    pub hostname: String,
    /// Operating system.
    pub os: String,
    /// CPU architecture.
    pub arch: String,
    /// Logical CPUs available to the process.
    pub cpus: usize,
    /// CPU model name, when known.
    pub cpu_model: Option<String>,
    /// Total memory in bytes, when known.
    pub memory_bytes: Option<u64>,
    /// Bench-specific additions (devices, NICs, settings).
    #[serde(flatten)]
    pub extra: BTreeMap<String, serde_json::Value>,
}

impl MachineInfo {
    /// Detects what can be read cheaply from the OS.
    pub fn detect() -> Self {
        let read = |p: &str| std::fs::read_to_string(p).ok();
        let cpu_model = read("/proc/cpuinfo").and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_owned())
        });
        let memory_bytes = read("/proc/meminfo").and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
                .map(|kb| kb * 1024)
        });
        Self {
            hostname: read("/proc/sys/kernel/hostname")
                .map(|h| h.trim().to_owned())
                .unwrap_or_default(),
            os: std::env::consts::OS.to_owned(),
            arch: std::env::consts::ARCH.to_owned(),
            cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
            cpu_model,
            memory_bytes,
            extra: BTreeMap::new(),
        }
    }
}

/// One measured figure against its same-run limit.
#[derive(Debug, Clone, Serialize)]
pub struct BenchResult {
    /// What was measured (`tcp_dispatch_throughput`, ...).
    pub name: String,
    /// Batch size (tokens, requests) of the measurement.
    pub batch: u64,
    /// The measured value.
    pub achieved: f64,
    /// The limit measured in the same run.
    pub limit: f64,
    /// Unit of `achieved` and `limit` (`GB/s`, `us`, ...).
    pub unit: String,
    /// `achieved / limit`.
    pub ratio: f64,
    /// Which way `ratio` is good: `"higher"` (throughputs) or `"lower"` (latencies).
    pub better: Better,
    /// Extra fields (limit description, sample counts).
    #[serde(flatten)]
    pub extra: BTreeMap<String, serde_json::Value>,
}

/// Which way a ratio is good.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Better {
    /// Throughputs: a higher ratio is better.
    Higher,
    /// Latencies: a lower ratio is better.
    Lower,
}

impl Better {
    /// The direction for a unit: times (`us`, `ms`, `s`) are latencies, anything else a rate.
    pub fn for_unit(unit: &str) -> Better {
        match unit {
            "us" | "ms" | "s" | "ns" => Better::Lower,
            _ => Better::Higher,
        }
    }

    /// "higher" or "lower", as in the JSON.
    pub fn name(self) -> &'static str {
        match self {
            Better::Higher => "higher",
            Better::Lower => "lower",
        }
    }
}

/// Header of the tables every bench prints (then one [`table_row`] per result).
pub fn table_header(name_width: usize) -> String {
    format!(
        "{:<name_width$} {:>6} {:>12} {:>12} {:>8} {:>7}  {}",
        "name", "batch", "achieved", "limit", "unit", "ratio", "direction"
    )
}

/// One result as a table row under [`table_header`].
pub fn table_row(r: &BenchResult, name_width: usize) -> String {
    format!(
        "{:<name_width$} {:>6} {:>12.3} {:>12.3} {:>8} {:>7.3}  {} is better",
        r.name,
        r.batch,
        r.achieved,
        r.limit,
        r.unit,
        r.ratio,
        r.better.name()
    )
}

impl BenchResult {
    /// A result; `ratio` is computed (0 when the limit is not positive) and which way it is
    /// good follows from the unit ([`Better::for_unit`]).
    pub fn new(name: impl Into<String>, batch: u64, achieved: f64, limit: f64, unit: &str) -> Self {
        Self {
            name: name.into(),
            batch,
            achieved,
            limit,
            unit: unit.to_owned(),
            ratio: if limit > 0.0 { achieved / limit } else { 0.0 },
            better: Better::for_unit(unit),
            extra: BTreeMap::new(),
        }
    }

    /// Adds an extra field.
    pub fn with(mut self, key: &str, value: impl Into<serde_json::Value>) -> Self {
        self.extra.insert(key.to_owned(), value.into());
        self
    }
}

impl Default for BenchReport {
    fn default() -> Self {
        Self::new()
    }
}

/// A whole bench report.
#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    /// The machine.
    pub machine: MachineInfo,
    /// The figures.
    pub results: Vec<BenchResult>,
}

impl BenchReport {
    /// An empty report for this machine, with CPU details the kernel figures depend on
    /// (clock, last-level cache, SIMD level) in `machine`.
    pub fn new() -> Self {
        let mut machine = MachineInfo::detect();
        if let Some(mhz) = std::fs::read_to_string("/proc/cpuinfo").ok().and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("cpu MHz"))
                .and_then(|l| l.split(':').nth(1))
                .and_then(|v| v.trim().parse::<f64>().ok())
        }) {
            machine.extra.insert("cpu_mhz".into(), mhz.into());
        }
        machine.extra.insert(
            "llc_bytes".into(),
            expertmesh_cpu_backend::membw::last_level_cache_bytes().into(),
        );
        machine.extra.insert(
            "cpu_isa".into(),
            expertmesh_cpu_backend::kernels::Isa::detect().name().into(),
        );
        Self {
            machine,
            results: Vec::new(),
        }
    }

    /// Prints the results as a table (ratio = achieved / limit; the last column says which
    /// way it is good).
    pub fn print_table(&self) {
        println!("{}", table_header(44));
        for r in &self.results {
            println!("{}", table_row(r, 44));
        }
    }

    /// Writes the report as pretty JSON.
    pub fn write(&self, path: &Path) -> anyhow::Result<()> {
        let text = serde_json::to_string_pretty(self)?;
        std::fs::write(path, text)
            .map_err(|e| anyhow::anyhow!("cannot write bench report {}: {e}", path.display()))
    }
}

/// Percentile (nearest rank) of sorted samples; 0 for none.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn report_has_the_documented_shape() {
        let r = BenchReport {
            machine: MachineInfo::detect(),
            results: vec![
                BenchResult::new("x", 8, 3.0, 4.0, "GB/s"),
                BenchResult::new("y", 8, 3.0, 4.0, "us"),
            ],
        };
        let v: serde_json::Value = serde_json::to_value(&r).unwrap();
        let res = &v["results"][0];
        for k in [
            "name", "batch", "achieved", "limit", "unit", "ratio", "better",
        ] {
            assert!(res.get(k).is_some(), "missing {k}");
        }
        assert_eq!(res["ratio"], 0.75);
        assert_eq!(res["better"], "higher");
        assert_eq!(v["results"][1]["better"], "lower");
        assert!(table_row(&r.results[1], 10).ends_with("lower is better"));
        assert!(v["machine"]["cpus"].as_u64().unwrap() >= 1);
    }

    #[test]
    fn percentile_is_nearest_rank() {
        let s: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&s, 50.0), 50.0);
        assert_eq!(percentile(&s, 99.0), 99.0);
        assert_eq!(percentile(&s, 100.0), 100.0);
        assert_eq!(percentile(&[7.0], 99.0), 7.0);
    }
}
