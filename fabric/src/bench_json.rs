//! The bench JSON format of DESIGN.md §3, shared by every `expertmesh bench` subcommand.
//!
//! Why this exists: hardware evaluators compare machines by these files, so every bench writes
//! the same shape: `{"machine": {...}, "results": [{"name", "batch", "achieved", "limit",
//! "unit", "ratio", ...}]}` with `limit` measured in the same run and `ratio = achieved / limit`.

use serde::Serialize;
use serde_json::{Map, Value};

/// One measured figure.
#[derive(Debug, Clone, Serialize)]
pub struct BenchResult {
    /// What was measured.
    pub name: String,
    /// Batch size (tokens).
    pub batch: u64,
    /// The measured value.
    pub achieved: f64,
    /// The same-run limit it is compared with.
    pub limit: f64,
    /// Unit of `achieved` and `limit`.
    pub unit: String,
    /// `achieved / limit`.
    pub ratio: f64,
    /// Extra fields (flattened into the object).
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl BenchResult {
    /// A result with `ratio` computed.
    pub fn new(name: impl Into<String>, batch: u64, achieved: f64, limit: f64, unit: &str) -> Self {
        Self {
            name: name.into(),
            batch,
            achieved,
            limit,
            unit: unit.into(),
            ratio: if limit > 0.0 { achieved / limit } else { 0.0 },
            extra: Map::new(),
        }
    }

    /// Add an extra field.
    pub fn with(mut self, key: &str, value: impl Into<Value>) -> Self {
        self.extra.insert(key.into(), value.into());
        self
    }
}

/// A whole bench report.
#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    /// Where it ran.
    pub machine: Map<String, Value>,
    /// What was measured.
    pub results: Vec<BenchResult>,
}

impl BenchReport {
    /// An empty report for this machine.
    pub fn new() -> Self {
        Self {
            machine: machine_info(),
            results: Vec::new(),
        }
    }

    /// Print the results as a table.
    pub fn print_table(&self) {
        println!(
            "{:<44} {:>6} {:>12} {:>12} {:>8} {:>7}",
            "name", "batch", "achieved", "limit", "unit", "ratio"
        );
        for r in &self.results {
            println!(
                "{:<44} {:>6} {:>12.3} {:>12.3} {:>8} {:>7.3}",
                r.name, r.batch, r.achieved, r.limit, r.unit, r.ratio
            );
        }
    }

    /// Write the JSON file.
    pub fn write(&self, path: &std::path::Path) -> anyhow::Result<()> {
        use anyhow::Context;
        std::fs::write(path, serde_json::to_string_pretty(self)?)
            .with_context(|| format!("cannot write bench JSON to {}", path.display()))
    }
}

impl Default for BenchReport {
    fn default() -> Self {
        Self::new()
    }
}

/// CPU model, core count, memory, caches, OS: what a reader needs to interpret the ratios.
pub fn machine_info() -> Map<String, Value> {
    let mut m = Map::new();
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let field = |name: &str| {
        cpuinfo
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split(':').nth(1))
            .map(|v| v.trim().to_string())
    };
    m.insert(
        "cpu".into(),
        field("model name")
            .unwrap_or_else(|| "unknown".into())
            .into(),
    );
    if let Some(mhz) = field("cpu MHz").and_then(|v| v.parse::<f64>().ok()) {
        m.insert("cpu_mhz".into(), mhz.into());
    }
    m.insert(
        "cores".into(),
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
            .into(),
    );
    m.insert(
        "llc_bytes".into(),
        expertmesh_hip_kernels::cpu::membw::last_level_cache_bytes().into(),
    );
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    if let Some(kb) = meminfo
        .lines()
        .find(|l| l.starts_with("MemTotal"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse::<u64>().ok())
    {
        m.insert("memory_bytes".into(), (kb * 1024).into());
    }
    m.insert(
        "isa".into(),
        expertmesh_hip_kernels::cpu::kernels::Isa::detect()
            .name()
            .into(),
    );
    m.insert("os".into(), std::env::consts::OS.into());
    m.insert("arch".into(), std::env::consts::ARCH.into());
    m
}
