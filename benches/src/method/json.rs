//! The bench report format shared by `expertmesh bench kernels|transport|fabric`.
//!
//! Why this exists: every benchmark reports its figures against a limit measured in the same
//! run, in one JSON shape (described in BENCHMARKS.md and `expertmesh bench --help`), so results
//! from different machines and benches can be compared by tools without per-bench parsing:
//! `{"machine": {...}, "results": [{"name", "batch", "achieved", "limit", "unit", "ratio",
//! "better", ...}]}`. `better` says which way the ratio is good: `"higher"` for throughputs,
//! `"lower"` for latencies.
//!
//! Figures from repeated, interleaved measurements ([`BenchResult::from_samples`]) also carry
//! their spread and raw samples: `achieved_p10`/`achieved_p90`, `limit_p10`/`limit_p90`,
//! `ratio_p10`/`ratio_p90` (over the per-repetition ratios), `ratio_median_of_pairs`,
//! `repetitions`, `repetitions_for_10pct` (resampled from this run's ratios: the repetitions at
//! which a 10% change is seen 80% of the time; null when over 61; `_normal`: the normal
//! approximation) and `samples: {"achieved": [...], "limit": [...]}`;
//! a ratio past its limit by more than 2% sets `bench_bug: true`. Reading a report back
//! ([`BenchReport::read`]) accepts files written before these fields existed.

use crate::method::stats::{Spread, paired_ratios, repetitions_for, repetitions_for_resampled};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;

/// Description of the machine a bench ran on.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MachineInfo {
    /// Host name.
    #[serde(default)]
    pub hostname: String,
    /// Operating system.
    #[serde(default)]
    pub os: String,
    /// CPU architecture.
    #[serde(default)]
    pub arch: String,
    /// Logical CPUs available to the process.
    #[serde(default)]
    pub cpus: usize,
    /// CPU model name, when known.
    #[serde(default)]
    pub cpu_model: Option<String>,
    /// Total memory in bytes, when known.
    #[serde(default)]
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
#[derive(Debug, Clone, Serialize, Deserialize)]
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
    #[serde(default)]
    pub better: Better,
    /// Extra fields (limit description, sample counts).
    #[serde(flatten)]
    pub extra: BTreeMap<String, serde_json::Value>,
}

/// Which way a ratio is good.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Better {
    /// Throughputs: a higher ratio is better.
    #[default]
    Higher,
    /// Latencies: a lower ratio is better.
    Lower,
}

impl Better {
    /// The direction for a unit: times (`us`, `ms`, `s`) are latencies, anything else a rate.
    pub(crate) fn for_unit(unit: &str) -> Better {
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
pub(crate) fn table_header(name_width: usize) -> String {
    format!(
        "{:<name_width$} {:>6} {:>12} {:>12} {:>8} {:>7} {:>13} {:>4}  {}",
        "name", "batch", "achieved", "limit", "unit", "ratio", "ratio p10-p90", "reps", "direction"
    )
}

/// One result as a table row under [`table_header`] (the spread columns blank for a result
/// without repetitions; `BENCH BUG` after the direction when the ratio is past its limit).
pub(crate) fn table_row(r: &BenchResult, name_width: usize) -> String {
    let (spread, reps) = match r.ratio_spread() {
        Some(s) => (format!("{:.3}-{:.3}", s.p10, s.p90), s.n.to_string()),
        None => (String::new(), String::new()),
    };
    let tag = if r.is_bench_bug() {
        "  BENCH BUG"
    } else if r.is_against_reference() {
        "  (limit: a reference, not a bound)"
    } else {
        ""
    };
    format!(
        "{:<name_width$} {:>6} {:>12.3} {:>12.3} {:>8} {:>7.3} {spread:>13} {reps:>4}  {} is better{tag}",
        r.name,
        r.batch,
        r.achieved,
        r.limit,
        r.unit,
        r.ratio,
        r.better.name(),
    )
}

impl BenchResult {
    /// Mark the limit as a reference to beat, not a bound the result cannot pass (JSON:
    /// `"limit_role": "reference"`; by default a limit is `"bound"`, what the machine or the
    /// format allows at all). The report then never calls a ratio past it a bench bug.
    pub fn against_reference(self) -> Self {
        self.with("limit_role", "reference")
    }

    /// Whether the limit is a reference to beat ([`BenchResult::against_reference`]).
    pub fn is_against_reference(&self) -> bool {
        self.extra.get("limit_role").and_then(|v| v.as_str()) == Some("reference")
    }

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

    /// A result from interleaved repetitions: `achieved[i]` and `limit[i]` were measured
    /// back to back. `achieved` and `limit` are the medians (`ratio` = their quotient, as
    /// always); the spreads, the per-repetition ratios' p10–p90, the raw samples, the
    /// repetitions a 10% difference needs at this noise, and `bench_bug` are added.
    pub(crate) fn from_samples(
        name: impl Into<String>,
        batch: u64,
        achieved: &[f64],
        limit: &[f64],
        unit: &str,
    ) -> Self {
        let (a, l) = (Spread::of(achieved), Spread::of(limit));
        let ratios = Spread::of(&paired_ratios(achieved, limit));
        let mut r = Self::new(name, batch, a.median, l.median, unit)
            .with("achieved_p10", a.p10)
            .with("achieved_p90", a.p90)
            .with("limit_p10", l.p10)
            .with("limit_p90", l.p90)
            .with("ratio_median_of_pairs", ratios.median)
            .with("ratio_p10", ratios.p10)
            .with("ratio_p90", ratios.p90)
            .with("repetitions", a.n)
            .with(
                "repetitions_for_10pct",
                repetitions_for_resampled(&paired_ratios(achieved, limit), 0.10),
            )
            .with(
                "repetitions_for_10pct_normal",
                repetitions_for(&ratios, 0.10),
            )
            .with(
                "samples",
                serde_json::json!({"achieved": achieved, "limit": limit}),
            );
        if r.is_bench_bug() {
            r = r.with("bench_bug", true);
        }
        r
    }

    /// Whether the ratio is past its limit by more than 2% ([`BUG_MARGIN`]): a throughput
    /// above 1.02 of its limit, or a latency below 1/1.02 of its floor in the median and in
    /// nine repetitions of ten (`ratio_p90`, when recorded: the tail of a floor's own round
    /// trips is scheduling noise, so one lucky p99 is not a bug). A limit is what the machine
    /// can do at all, so such a ratio means the limit was measured badly, not that the thing
    /// beat it.
    ///
    /// A result whose limit is a reference to beat ([`BenchResult::against_reference`]) is never
    /// one: passing it is the point.
    pub(crate) fn is_bench_bug(&self) -> bool {
        if self.limit <= 0.0 || self.is_against_reference() {
            return false;
        }
        match self.better {
            Better::Higher => self.ratio > BUG_MARGIN,
            Better::Lower => {
                let p90 = self.extra_f64("ratio_p90").unwrap_or(self.ratio);
                self.ratio < 1.0 / BUG_MARGIN && p90 < 1.0 / BUG_MARGIN
            }
        }
    }

    /// The raw samples of `which` (`"achieved"` or `"limit"`), empty when not recorded.
    pub fn samples(&self, which: &str) -> Vec<f64> {
        self.extra
            .get("samples")
            .and_then(|s| s.get(which))
            .and_then(|v| v.as_array())
            .map(|a| a.iter().filter_map(|x| x.as_f64()).collect())
            .unwrap_or_default()
    }

    /// The per-repetition ratios from the raw samples (empty when not recorded).
    pub(crate) fn ratio_samples(&self) -> Vec<f64> {
        paired_ratios(&self.samples("achieved"), &self.samples("limit"))
    }

    /// The ratio's spread: from the raw samples, else from `ratio_p10`/`ratio_p90`, else none.
    pub(crate) fn ratio_spread(&self) -> Option<Spread> {
        let raw = self.ratio_samples();
        if !raw.is_empty() {
            return Some(Spread::of(&raw));
        }
        let f = |k: &str| self.extra.get(k).and_then(|v| v.as_f64());
        Some(Spread {
            n: self.extra.get("repetitions")?.as_u64()? as usize,
            median: self.ratio,
            p10: f("ratio_p10")?,
            p90: f("ratio_p90")?,
        })
    }

    /// A numeric extra field.
    pub(crate) fn extra_f64(&self, key: &str) -> Option<f64> {
        self.extra.get(key).and_then(|v| v.as_f64())
    }
}

/// How far past 1 a ratio may be before it is reported as a bench bug (2%).
pub(crate) const BUG_MARGIN: f64 = 1.02;

impl Default for BenchReport {
    fn default() -> Self {
        Self::new()
    }
}

/// A whole bench report.
#[derive(Debug, Clone, Serialize, Deserialize)]
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
        crate::method::machine::describe(&mut machine.extra);
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
        if let Some(line) = self.power_line() {
            println!("{line}");
        }
    }

    /// How many repetitions a 10% change needs in this run (`repetitions_for_10pct` over the
    /// figures that have it), as one line; none when no figure has repetitions.
    pub(crate) fn power_line(&self) -> Option<String> {
        let with: Vec<&BenchResult> = self
            .results
            .iter()
            .filter(|r| r.extra.contains_key("repetitions_for_10pct"))
            .collect();
        if with.is_empty() {
            return None;
        }
        let mut n: Vec<u64> = with
            .iter()
            .filter_map(|r| r.extra["repetitions_for_10pct"].as_u64())
            .collect();
        n.sort_unstable();
        let over = with.len() - n.len();
        let median = n.get(n.len() / 2).map_or("-".to_owned(), |m| m.to_string());
        Some(format!(
            "repetitions for a 10% change of a ratio to be seen 80% of the time (resampled from this run): median {median} over {} figures, {over} need more than 61",
            with.len()
        ))
    }

    /// Reads a report written by [`BenchReport::write`] (or by an older version).
    pub fn read(path: &Path) -> Result<BenchReport, ReadError> {
        let text = std::fs::read_to_string(path).map_err(|source| ReadError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        serde_json::from_str(&text).map_err(|source| ReadError::Json {
            path: path.to_path_buf(),
            source,
        })
    }

    /// The report as JSON, `bench_bug: true` on every result past its limit.
    fn to_json(&self) -> Result<serde_json::Value, serde_json::Error> {
        let mut v = serde_json::to_value(self)?;
        if let Some(rows) = v["results"].as_array_mut() {
            for (row, r) in rows.iter_mut().zip(&self.results) {
                if r.is_bench_bug()
                    && let Some(o) = row.as_object_mut()
                {
                    o.insert("bench_bug".into(), true.into());
                }
            }
        }
        Ok(v)
    }

    /// The bench bugs among the results (ratios past their limit, [`BenchResult::is_bench_bug`]).
    pub(crate) fn bench_bugs(&self) -> Vec<&BenchResult> {
        self.results.iter().filter(|r| r.is_bench_bug()).collect()
    }

    /// Writes the report as pretty JSON; every result past its limit carries `bench_bug`
    /// (those made from one sample too, not only [`BenchResult::from_samples`]'s).
    pub fn write(&self, path: &Path) -> Result<(), crate::BenchError> {
        let text = serde_json::to_string_pretty(&self.to_json()?)?;
        std::fs::write(path, text).map_err(|cause| crate::BenchError::WriteReport {
            path: path.to_path_buf(),
            cause,
        })
    }
}

/// A bench report could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// Unreadable file.
    #[error("cannot read {}: {source}", path.display())]
    Io {
        /// The file.
        path: std::path::PathBuf,
        /// What failed.
        #[source]
        source: std::io::Error,
    },
    /// Not a bench report.
    #[error("{} is not a bench report: {source}", path.display())]
    Json {
        /// The file.
        path: std::path::PathBuf,
        /// What failed.
        #[source]
        source: serde_json::Error,
    },
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
        assert!(table_row(&r.results[1], 10).ends_with("lower is better  BENCH BUG"));
        // Written, a one-sample row past its limit says so too; one within it does not.
        let written = r.to_json().unwrap();
        assert_eq!(written["results"][1]["bench_bug"], true);
        assert!(written["results"][0].get("bench_bug").is_none());
        // The same ratio against a reference is the result doing better than it, not a bug.
        let reference = r.results[1].clone().against_reference();
        assert!(!reference.is_bench_bug());
        assert!(table_row(&reference, 10).ends_with("(limit: a reference, not a bound)"));
        assert!(table_row(&r.results[0], 10).ends_with("higher is better"));
        assert!(v["machine"]["cpus"].as_u64().unwrap() >= 1);
    }

    #[test]
    fn json_round_trip_keeps_raw_samples_and_spreads() {
        let a = [10.0, 11.0, 9.0, 10.5, 30.0];
        let l = [20.0, 20.0, 20.0, 21.0, 20.0];
        let r = BenchResult::from_samples("k", 4, &a, &l, "GB/s");
        assert_eq!(r.achieved, 10.5);
        assert_eq!(r.limit, 20.0);
        assert_eq!(r.ratio, 10.5 / 20.0);
        assert!(!r.extra.contains_key("bench_bug"));
        let report = BenchReport {
            machine: MachineInfo::detect(),
            results: vec![r],
        };
        let dir = std::env::temp_dir().join(format!("em-json-rt-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("r.json");
        report.write(&path).unwrap();
        let back = BenchReport::read(&path).unwrap();
        let b = &back.results[0];
        assert_eq!(b.samples("achieved"), a);
        assert_eq!(b.samples("limit"), l);
        assert_eq!(b.ratio_samples().len(), 5);
        assert_eq!(b.better, Better::Higher);
        let s = b.ratio_spread().unwrap();
        assert_eq!((s.n, s.p10, s.p90), (5, 0.45, 1.5));
        std::fs::remove_dir_all(&dir).unwrap();
        // A file from before spreads and `better` existed still reads.
        let old = r#"{"machine": {"hostname": "h", "os": "linux", "arch": "x86_64", "cpus": 2},
            "results": [{"name": "x", "batch": 1, "achieved": 1.0, "limit": 2.0,
            "unit": "GB/s", "ratio": 0.5}]}"#;
        let v: BenchReport = serde_json::from_str(old).unwrap();
        assert_eq!(v.results[0].better, Better::Higher);
        assert!(v.results[0].ratio_spread().is_none());
    }

    #[test]
    fn ratios_past_the_limit_are_bench_bugs() {
        let up = BenchResult::from_samples("t", 1, &[10.3, 10.3], &[10.0, 10.0], "GB/s");
        assert!(up.is_bench_bug());
        assert_eq!(up.extra["bench_bug"], true);
        assert!(!BenchResult::new("t", 1, 10.2, 10.0, "GB/s").is_bench_bug());
        assert!(BenchResult::new("l", 1, 9.0, 10.0, "us").is_bench_bug());
        assert!(!BenchResult::new("l", 1, 30.0, 10.0, "us").is_bench_bug());
        // A latency under its floor in the median but not in most repetitions: noise.
        let lucky = BenchResult::from_samples("l", 1, &[9.0, 9.0, 12.0], &[10.0; 3], "us");
        assert!(lucky.ratio < 0.98 && !lucky.is_bench_bug());
        let always = BenchResult::from_samples("l", 1, &[9.0, 9.0, 9.5], &[10.0; 3], "us");
        assert!(always.is_bench_bug());
    }
}
