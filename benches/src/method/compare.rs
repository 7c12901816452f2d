//! `expertmesh bench compare A.json B.json [--report DIR]`: the differences between two bench
//! runs, figure by figure, with their spreads, flagging the ones outside noise.
//!
//! Why this exists: a hardware evaluator (or a reviewer of a kernel change) has two bench files
//! and one question: which figures moved beyond run-to-run noise? Figures are matched by
//! (name, batch, unit); the ratio is compared, since it is what stays meaningful on a shared
//! machine. With raw samples on both sides the per-repetition ratios are compared by a
//! Mann–Whitney test ([`crate::method::stats::judge`]); with spreads only, by whether the p10–p90
//! ranges are disjoint; without either, the verdict is "unknown". The machines' descriptions
//! are compared too, so a difference of CPU, kernel, build or revision is seen first.

use crate::method::json::{BenchReport, BenchResult, Better};
use crate::method::report::{ReportError, esc, page, plot_err, section};
use crate::method::stats::{Spread, Verdict, judge};
use plotters::prelude::*;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// Runs `bench compare` on the files `a` (reference) and `b`: prints the comparison, and
/// writes the page into `report` when given. The verdicts are printed, not returned: moving
/// figures are not an error.
pub fn run(a: &Path, b: &Path, report: Option<&Path>) -> Result<(), crate::BenchError> {
    let ra = BenchReport::read(a)?;
    let rb = BenchReport::read(b)?;
    let (diffs, unmatched) = compare(&ra, &rb);
    print(&ra, &rb, &diffs, &unmatched);
    if let Some(dir) = report {
        let page = write_report(&ra, &rb, &diffs, dir)?;
        println!("wrote {}", page.display());
    }
    Ok(())
}

/// One figure present in both runs.
#[derive(Debug, Clone)]
pub struct Diff {
    /// Result name.
    pub name: String,
    /// Batch.
    pub batch: u64,
    /// Which way the ratio is good.
    pub better: Better,
    /// Ratio in A and B.
    pub ratio: (f64, f64),
    /// Spread of the per-repetition ratios in A and B, when recorded.
    pub spread: (Option<Spread>, Option<Spread>),
    /// B's ratio relative to A's, minus 1.
    pub change: f64,
    /// The change's range from the spreads: B p10 / A p90 − 1 to B p90 / A p10 − 1.
    pub change_range: Option<(f64, f64)>,
    /// Whether the change is outside noise.
    pub verdict: Verdict,
}

impl Diff {
    /// Whether B is worse than A (by its direction), regardless of noise.
    pub fn worse(&self) -> bool {
        match self.better {
            Better::Higher => self.change < 0.0,
            Better::Lower => self.change > 0.0,
        }
    }
}

/// The two runs' figures matched by (name, batch, unit), in A's order; figures in only one
/// run are listed in the second return value.
pub fn compare(a: &BenchReport, b: &BenchReport) -> (Vec<Diff>, Vec<String>) {
    let key = |r: &BenchResult| (r.name.clone(), r.batch, r.unit.clone());
    let mut diffs = Vec::new();
    let mut unmatched = Vec::new();
    for ra in &a.results {
        let Some(rb) = b.results.iter().find(|rb| key(rb) == key(ra)) else {
            unmatched.push(format!("only in A: {} B={}", ra.name, ra.batch));
            continue;
        };
        let (sa, sb) = (ra.ratio_spread(), rb.ratio_spread());
        let verdict = judge(
            &ra.ratio_samples(),
            &rb.ratio_samples(),
            sa.as_ref(),
            sb.as_ref(),
        );
        let change = if ra.ratio > 0.0 {
            rb.ratio / ra.ratio - 1.0
        } else {
            0.0
        };
        let change_range = match (&sa, &sb) {
            (Some(x), Some(y)) if x.p10 > 0.0 && x.p90 > 0.0 => {
                Some((y.p10 / x.p90 - 1.0, y.p90 / x.p10 - 1.0))
            }
            _ => None,
        };
        diffs.push(Diff {
            name: ra.name.clone(),
            batch: ra.batch,
            better: ra.better,
            ratio: (ra.ratio, rb.ratio),
            spread: (sa, sb),
            change,
            change_range,
            verdict,
        });
    }
    for rb in &b.results {
        if !a.results.iter().any(|ra| key(ra) == key(rb)) {
            unmatched.push(format!("only in B: {} B={}", rb.name, rb.batch));
        }
    }
    (diffs, unmatched)
}

/// The machine fields that differ between the runs (`key: A -> B`).
pub(crate) fn machine_differences(a: &BenchReport, b: &BenchReport) -> Vec<String> {
    let fields = [
        "cpu_model_number",
        "cpu_family",
        "cpu_isa",
        "kernel_version",
        "build_profile",
        "git_revision",
        "threads",
        "backend",
        "read_bandwidth_probe_best",
        "llc_bytes",
    ];
    let mut out = Vec::new();
    if a.machine.cpu_model != b.machine.cpu_model {
        out.push(format!(
            "cpu_model: {:?} -> {:?}",
            a.machine.cpu_model, b.machine.cpu_model
        ));
    }
    if a.machine.cpus != b.machine.cpus {
        out.push(format!("cpus: {} -> {}", a.machine.cpus, b.machine.cpus));
    }
    for f in fields {
        let (x, y) = (a.machine.extra.get(f), b.machine.extra.get(f));
        if x != y {
            let s = |v: Option<&serde_json::Value>| v.map_or("-".to_owned(), |v| v.to_string());
            out.push(format!("{f}: {} -> {}", s(x), s(y)));
        }
    }
    // The limits themselves: a ratio moves when its limit does (another memory placement of
    // a VM's cores, other load), so say so when they differ by more than 5%.
    for f in ["read_bandwidth_gbs_median", "int8_peak_tops_median"] {
        let get = |r: &BenchReport| r.machine.extra.get(f).and_then(|v| v.as_f64());
        if let (Some(x), Some(y)) = (get(a), get(b))
            && x > 0.0
            && (y / x - 1.0).abs() > 0.05
        {
            out.push(format!(
                "{f}: {x:.3} -> {y:.3} ({:+.0}%)",
                (y / x - 1.0) * 100.0
            ));
        }
    }
    out
}

fn spread_text(s: &Option<Spread>) -> String {
    s.as_ref().map_or("no spread".to_owned(), |s| {
        format!("{:.3}-{:.3} n={}", s.p10, s.p90, s.n)
    })
}

/// Prints the comparison: machine differences, then one line per figure; `*` marks a change
/// outside noise (`worse` or `better` by the figure's direction).
pub fn print(a: &BenchReport, b: &BenchReport, diffs: &[Diff], unmatched: &[String]) {
    for d in machine_differences(a, b) {
        println!("machine differs: {d}");
    }
    println!(
        "{:<44} {:>5} {:>8} {:>20} {:>8} {:>20} {:>8}  verdict",
        "name", "batch", "ratio A", "A p10-p90", "ratio B", "B p10-p90", "change"
    );
    for d in diffs {
        let verdict = match d.verdict {
            Verdict::Outside if d.worse() => "* worse, outside noise",
            Verdict::Outside => "* better, outside noise",
            Verdict::WithinNoise => "within noise",
            Verdict::Unknown => "unknown (no spread)",
        };
        println!(
            "{:<44} {:>5} {:>8.3} {:>20} {:>8.3} {:>20} {:>+7.1}%  {verdict}",
            d.name,
            d.batch,
            d.ratio.0,
            spread_text(&d.spread.0),
            d.ratio.1,
            spread_text(&d.spread.1),
            d.change * 100.0
        );
    }
    for u in unmatched {
        println!("{u}");
    }
    let out = diffs
        .iter()
        .filter(|d| d.verdict == Verdict::Outside)
        .count();
    println!(
        "{} figures compared, {out} outside noise ({} worse)",
        diffs.len(),
        diffs
            .iter()
            .filter(|d| d.verdict == Verdict::Outside && d.worse())
            .count()
    );
}

/// Writes `DIR/index.html`: the relative change of every figure with its range from the
/// spreads (red: outside noise), and the table.
pub(crate) fn write_report(
    a: &BenchReport,
    b: &BenchReport,
    diffs: &[Diff],
    dir: &Path,
) -> Result<PathBuf, ReportError> {
    std::fs::create_dir_all(dir).map_err(|source| ReportError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    let mut body = String::new();
    for d in machine_differences(a, b) {
        let _ = writeln!(body, "<p>machine differs: {}</p>", esc(&d));
    }
    if !diffs.is_empty() {
        let t =
            "Change of each ratio, B / A - 1 (bars: from the p10-p90 spreads; red: outside noise)";
        section(&mut body, t, &change_plot(t, diffs)?);
    }
    body.push_str("<table><tr><th>name</th><th>batch</th><th>ratio A</th><th>A p10-p90</th><th>ratio B</th><th>B p10-p90</th><th>change</th><th>verdict</th></tr>\n");
    for d in diffs {
        let class = if d.verdict == Verdict::Outside {
            " class=out"
        } else {
            ""
        };
        let _ = writeln!(
            body,
            "<tr{class}><td>{}</td><td>{}</td><td>{:.3}</td><td>{}</td><td>{:.3}</td><td>{}</td><td>{:+.1}%</td><td>{:?}</td></tr>",
            esc(&d.name),
            d.batch,
            d.ratio.0,
            spread_text(&d.spread.0),
            d.ratio.1,
            spread_text(&d.spread.1),
            d.change * 100.0,
            d.verdict
        );
    }
    body.push_str("</table>\n");
    let path = dir.join("index.html");
    std::fs::write(&path, page("expertmesh bench compare", &body)).map_err(|source| {
        ReportError::Io {
            path: path.clone(),
            source,
        }
    })?;
    Ok(path)
}

/// A forest plot: one row per figure, the change in percent with its range.
fn change_plot(title: &str, diffs: &[Diff]) -> Result<String, ReportError> {
    let err = plot_err(title);
    let lo = diffs
        .iter()
        .map(|d| d.change_range.map_or(d.change, |r| r.0.min(d.change)))
        .fold(-0.05f64, f64::min)
        * 100.0;
    let hi = diffs
        .iter()
        .map(|d| d.change_range.map_or(d.change, |r| r.1.max(d.change)))
        .fold(0.05f64, f64::max)
        * 100.0;
    let labels: Vec<String> = diffs
        .iter()
        .map(|d| format!("{} B={}", d.name, d.batch))
        .collect();
    let n = diffs.len();
    let height = (60 + 18 * n as u32).max(200);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (900, height)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
        let mut chart = ChartBuilder::on(&root)
            .margin(10)
            .x_label_area_size(35)
            .y_label_area_size(330)
            .build_cartesian_2d((lo * 1.1)..(hi * 1.1), -0.5f64..(n as f64 - 0.5))
            .map_err(|e| err(e.to_string()))?;
        chart
            .configure_mesh()
            .y_labels(n.max(1))
            .y_label_formatter(&|y| {
                let i = y.round();
                if (y - i).abs() < 1e-6 && i >= 0.0 && (i as usize) < n {
                    labels[n - 1 - i as usize].clone()
                } else {
                    String::new()
                }
            })
            .x_desc("change of ratio, %")
            .draw()
            .map_err(|e| err(e.to_string()))?;
        chart
            .draw_series(LineSeries::new(
                vec![(0.0, -0.5), (0.0, n as f64 - 0.5)],
                BLACK,
            ))
            .map_err(|e| err(e.to_string()))?;
        for (i, d) in diffs.iter().enumerate() {
            let y = (n - 1 - i) as f64;
            let c = if d.verdict == Verdict::Outside {
                RED
            } else {
                BLUE
            };
            if let Some((a, b)) = d.change_range {
                chart
                    .draw_series(std::iter::once(ErrorBar::new_horizontal(
                        y,
                        a * 100.0,
                        d.change * 100.0,
                        b * 100.0,
                        c.filled(),
                        6,
                    )))
                    .map_err(|e| err(e.to_string()))?;
            }
            chart
                .draw_series(std::iter::once(Circle::new(
                    (d.change * 100.0, y),
                    4,
                    c.filled(),
                )))
                .map_err(|e| err(e.to_string()))?;
        }
        root.present().map_err(|e| err(e.to_string()))?;
    }
    Ok(svg)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::method::json::MachineInfo;

    fn report(rows: Vec<BenchResult>) -> BenchReport {
        BenchReport {
            machine: MachineInfo::detect(),
            results: rows,
        }
    }

    /// `n` samples around `center` with a ±`noise` relative wobble (deterministic).
    fn wobble(center: f64, noise: f64, n: usize, phase: usize) -> Vec<f64> {
        (0..n)
            .map(|i| center * (1.0 + noise * (((i * 7 + phase) % 11) as f64 / 5.0 - 1.0)))
            .collect()
    }

    #[test]
    fn compare_flags_shifts_outside_noise_only() {
        let lim = vec![10.0; 15];
        let row = |c: f64, phase| {
            BenchResult::from_samples("k", 1, &wobble(c, 0.04, 15, phase), &lim, "GB/s")
        };
        let a = report(vec![row(8.0, 0)]);
        let same = report(vec![row(8.0, 3)]);
        let worse = report(vec![row(7.0, 5)]);
        let (d, u) = compare(&a, &same);
        assert!(u.is_empty());
        assert_eq!(d[0].verdict, Verdict::WithinNoise);
        let (d, _) = compare(&a, &worse);
        assert_eq!(d[0].verdict, Verdict::Outside);
        assert!(d[0].worse());
        assert!((d[0].change - (-0.125)).abs() < 0.02, "{}", d[0].change);
        let (lo, hi) = d[0].change_range.unwrap();
        assert!(lo < d[0].change && d[0].change < hi);
        // A latency that went up is worse.
        let lat =
            |c: f64| BenchResult::from_samples("l", 1, &wobble(c, 0.02, 9, 1), &[1.0; 9], "us");
        let (d, _) = compare(&report(vec![lat(50.0)]), &report(vec![lat(60.0)]));
        assert_eq!(d[0].verdict, Verdict::Outside);
        assert!(d[0].worse());
    }

    #[test]
    fn machine_differences_name_a_moved_limit() {
        let mut a = report(vec![]);
        let mut b = report(vec![]);
        a.machine
            .extra
            .insert("read_bandwidth_gbs_median".into(), 35.0.into());
        b.machine
            .extra
            .insert("read_bandwidth_gbs_median".into(), 44.0.into());
        let d = machine_differences(&a, &b);
        assert!(
            d.iter()
                .any(|l| l.contains("read_bandwidth_gbs_median") && l.contains("+26%")),
            "{d:?}"
        );
        b.machine
            .extra
            .insert("read_bandwidth_gbs_median".into(), 35.5.into());
        assert!(machine_differences(&a, &b).is_empty());
    }

    #[test]
    fn compare_without_samples_uses_spreads_or_says_unknown() {
        let plain = |ratio: f64| BenchResult::new("p", 2, ratio, 1.0, "GB/s");
        let (d, _) = compare(&report(vec![plain(0.5)]), &report(vec![plain(0.9)]));
        assert_eq!(d[0].verdict, Verdict::Unknown);
        let (_, u) = compare(&report(vec![plain(0.5)]), &report(vec![]));
        assert_eq!(u, ["only in A: p B=2"]);
    }

    #[test]
    fn compare_page_plots_every_figure() {
        let lim = vec![10.0; 9];
        let r = |c: f64| {
            report(vec![BenchResult::from_samples(
                "k",
                1,
                &wobble(c, 0.03, 9, 0),
                &lim,
                "GB/s",
            )])
        };
        let (a, b) = (r(8.0), r(6.0));
        let (d, _) = compare(&a, &b);
        let dir = std::env::temp_dir().join(format!("em-compare-{}", std::process::id()));
        let html = std::fs::read_to_string(write_report(&a, &b, &d, &dir).unwrap()).unwrap();
        assert!(html.contains("<svg") && html.contains("class=out"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
