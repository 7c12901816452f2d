//! `--report DIR`: an HTML page with SVG plots of a bench report (ratio against batch per
//! model or link with p10–p90 bars, latency percentiles, the roofline with every measured
//! kernel point), plus the result table and the machine description.
//!
//! Why this exists: tables of numbers do not show how a ratio moves with the batch size, or how
//! far a kernel sits under its roofline (issue 17). The plots are drawn with `plotters`' SVG
//! backend only (no fonts, no bitmap libraries) and embedded inline, so the page is one
//! self-contained file that any browser renders.

use crate::method::json::{BenchReport, BenchResult, Better};
use plotters::coord::ranged1d::{AsRangedCoord, ValueFormatter};
use plotters::prelude::*;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// A report page could not be written.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// Drawing a plot failed.
    #[error("plot {name}: {message}")]
    Plot {
        /// The plot.
        name: String,
        /// What failed.
        message: String,
    },
    /// Writing the page failed.
    #[error("cannot write {}: {source}", path.display())]
    Io {
        /// The file or folder.
        path: PathBuf,
        /// What failed.
        #[source]
        source: std::io::Error,
    },
    /// Writing the JSON failed.
    #[error("{0}")]
    Json(String),
}

/// Plot size in pixels.
const SIZE: (u32, u32) = (1000, 520);

/// Writes the JSON (when `json` is given) and the HTML report (when `dir` is given).
pub fn finish(
    report: &BenchReport,
    json: Option<&Path>,
    dir: Option<&Path>,
) -> Result<(), crate::BenchError> {
    if let Some(p) = json {
        report.write(p)?;
        println!("wrote {}", p.display());
    }
    if let Some(d) = dir {
        let page = write_report(report, d)?;
        println!("wrote {}", page.display());
    }
    Ok(())
}

/// Prints the result table with spreads (see [`BenchReport::print_table`]).
pub fn print_table(report: &BenchReport) {
    report.print_table();
}

/// Writes `DIR/index.html` (the folder is created) and returns its path.
pub(crate) fn write_report(report: &BenchReport, dir: &Path) -> Result<PathBuf, ReportError> {
    std::fs::create_dir_all(dir).map_err(|source| ReportError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    let mut body = String::new();
    let bugs = report.bench_bugs();
    if !bugs.is_empty() {
        let _ = write!(
            body,
            "<p class=bug><b>Bench bugs</b> (ratio past its limit by more than 2%: the limit was not measured as a limit): "
        );
        for b in bugs {
            let _ = write!(
                body,
                "{} B={} ratio {:.3}; ",
                esc(&b.name),
                b.batch,
                b.ratio
            );
        }
        body.push_str("</p>\n");
    }
    let multi = |r: &&BenchResult| report.results.iter().filter(|o| o.name == r.name).count() > 1;
    for better in [Better::Higher, Better::Lower] {
        let rows: Vec<&BenchResult> = report
            .results
            .iter()
            .filter(|r| r.better == better)
            .filter(multi)
            .collect();
        if !rows.is_empty() {
            let title = match better {
                Better::Higher => {
                    "Ratio vs batch (throughputs: achieved / limit, higher is better)"
                }
                Better::Lower => "Ratio vs batch (latencies: achieved / limit, lower is better)",
            };
            section(&mut body, title, &ratio_plot(title, &rows)?);
        }
    }
    let lat: Vec<&BenchResult> = report.results.iter().filter(|r| r.unit == "us").collect();
    if !lat.is_empty() {
        let t = "Latency percentiles (solid: achieved, dashed: limit; median over repetitions)";
        section(&mut body, t, &latency_plot(t, &lat)?);
    }
    let call_lat: Vec<&BenchResult> = report
        .results
        .iter()
        .filter(|r| r.extra.contains_key("latency_us_p10"))
        .collect();
    if !call_lat.is_empty() {
        let t = "Kernel call latency (median, bars p10-p90 over repetitions)";
        section(&mut body, t, &call_latency_plot(t, &call_lat)?);
    }
    if let Some(svg) = roofline_plot(report)? {
        section(
            &mut body,
            "Roofline (measured read bandwidth and int8 peak of this run)",
            &svg,
        );
    }
    body.push_str(&results_table(report));
    body.push_str(&machine_table(report));
    let path = dir.join("index.html");
    std::fs::write(&path, page("expertmesh bench report", &body)).map_err(|source| {
        ReportError::Io {
            path: path.clone(),
            source,
        }
    })?;
    Ok(path)
}

/// A whole HTML page around `body`.
pub fn page(title: &str, body: &str) -> String {
    format!(
        "<!doctype html>\n<html><head><meta charset=utf-8><title>{t}</title><style>\
body{{font-family:sans-serif;margin:1.5em;max-width:1100px}}\
table{{border-collapse:collapse;font-size:13px}}td,th{{border:1px solid #ccc;padding:2px 6px;text-align:right}}\
td:first-child,th:first-child{{text-align:left}}.bug{{color:#b00}}tr.bug td{{background:#fdd}}\
tr.out td{{background:#fed}}</style></head><body>\n<h1>{t}</h1>\n{body}</body></html>\n",
        t = esc(title)
    )
}

/// Appends a section with a heading and an inline SVG.
pub fn section(body: &mut String, title: &str, svg: &str) {
    let _ = write!(body, "<h2>{}</h2>\n{svg}\n", esc(title));
}

/// HTML-escapes `s`.
pub(crate) fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// A plotting error as a [`ReportError`].
pub(crate) fn plot_err(name: &str) -> impl Fn(String) -> ReportError + '_ {
    move |message| ReportError::Plot {
        name: name.to_owned(),
        message,
    }
}

/// Rows grouped into series by name, each sorted by batch.
fn series<'a>(rows: &[&'a BenchResult]) -> BTreeMap<&'a str, Vec<&'a BenchResult>> {
    let mut m: BTreeMap<&str, Vec<&BenchResult>> = BTreeMap::new();
    for r in rows {
        m.entry(r.name.as_str()).or_default().push(r);
    }
    for v in m.values_mut() {
        v.sort_by_key(|r| r.batch);
    }
    m
}

/// The x range (log scale) covering every row's batch.
fn batch_range(rows: &[&BenchResult]) -> std::ops::Range<f64> {
    let lo = rows.iter().map(|r| r.batch.max(1)).min().unwrap_or(1) as f64;
    let hi = rows.iter().map(|r| r.batch.max(1)).max().unwrap_or(1) as f64;
    (lo / 1.5)..(hi * 1.5)
}

/// The chart a plot draws its marks in: a log x axis, and `Y`.
type LogXChart<'a, 'b, Y> = ChartContext<'a, SVGBackend<'b>, Cartesian2d<LogCoord<f64>, Y>>;

/// The name and the tick labels of an axis.
type Axis<'f> = (&'f str, &'f dyn Fn(&f64) -> String);

/// The scaffolding every plot shares: the SVG canvas, the chart with `x` on a log axis and
/// `y` on the other, the mesh with both axis names, and the legend box at `legend`; `draw`
/// adds the plot's own marks (a line per series with [`series_line`], bars, reference lines,
/// a roofline).
fn log_x_chart<Y>(
    title: &str,
    (x, x_axis): (std::ops::Range<f64>, Axis<'_>),
    (y, y_axis): (Y, Axis<'_>),
    legend: SeriesLabelPosition,
    draw: impl for<'a, 'b> FnOnce(&mut LogXChart<'a, 'b, Y::CoordDescType>) -> Result<(), ReportError>,
) -> Result<String, ReportError>
where
    Y: AsRangedCoord<Value = f64>,
    Y::CoordDescType: Ranged<ValueType = f64> + ValueFormatter<f64>,
{
    let err = plot_err(title);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
        let mut chart = ChartBuilder::on(&root)
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(x.log_scale(), y)
            .map_err(|e| err(e.to_string()))?;
        chart
            .configure_mesh()
            .x_desc(x_axis.0)
            .y_desc(y_axis.0)
            .x_label_formatter(x_axis.1)
            .y_label_formatter(y_axis.1)
            .draw()
            .map_err(|e| err(e.to_string()))?;
        draw(&mut chart)?;
        chart
            .configure_series_labels()
            .position(legend)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(|e| err(e.to_string()))?;
        root.present().map_err(|e| err(e.to_string()))?;
    }
    Ok(svg)
}

/// The x axis of a plot against the batch: every row's batch on a log scale.
fn batch_x(rows: &[&BenchResult]) -> (std::ops::Range<f64>, Axis<'static>) {
    fn label(x: &f64) -> String {
        format!("{x:.0}")
    }
    (
        batch_range(rows),
        ("batch (tokens per call / frame)", &label),
    )
}

/// Series `i`'s line through `points` in its palette color, with dots and a legend entry
/// named `name`; returns the color for the series' other marks.
fn series_line<Y: Ranged<ValueType = f64>>(
    chart: &mut LogXChart<'_, '_, Y>,
    (i, name): (usize, &str),
    points: Vec<(f64, f64)>,
    err: &dyn Fn(String) -> ReportError,
) -> Result<RGBAColor, ReportError> {
    let c = Palette99::pick(i).to_rgba();
    chart
        .draw_series(LineSeries::new(points.clone(), c.stroke_width(2)))
        .map_err(|e| err(e.to_string()))?
        .label(name)
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2)));
    chart
        .draw_series(points.iter().map(|&p| Circle::new(p, 3, c.filled())))
        .map_err(|e| err(e.to_string()))?;
    Ok(c)
}

/// The (lo, hi) of the positive values, widened by 1.5 each way for a log axis.
fn log_bounds(values: impl Iterator<Item = f64>) -> std::ops::Range<f64> {
    let (lo, hi) = values
        .filter(|v| *v > 0.0)
        .fold((f64::MAX, 0f64), |(a, b), v| (a.min(v), b.max(v)));
    (lo / 1.5)..(hi * 1.5)
}

/// Ratio against batch, one line per series, p10–p90 bars, the 1.0 and 1.02 lines.
fn ratio_plot(title: &str, rows: &[&BenchResult]) -> Result<String, ReportError> {
    let err = plot_err(title);
    let hi = rows
        .iter()
        .map(|r| r.ratio_spread().map_or(r.ratio, |s| s.p90.max(r.ratio)))
        .fold(1.1f64, f64::max)
        * 1.05;
    let y_fmt = |y: &f64| format!("{y:.2}");
    log_x_chart(
        title,
        batch_x(rows),
        (0f64..hi, ("ratio", &y_fmt)),
        SeriesLabelPosition::UpperRight,
        |chart| {
            let r = chart.x_range();
            for (y, style) in [(1.0, BLACK.stroke_width(1)), (1.02, RED.stroke_width(1))] {
                chart
                    .draw_series(DashedLineSeries::new(
                        vec![(r.start, y), (r.end, y)],
                        6,
                        4,
                        style,
                    ))
                    .map_err(|e| err(e.to_string()))?;
            }
            for (i, (name, pts)) in series(rows).into_iter().enumerate() {
                let line = pts
                    .iter()
                    .map(|r| (r.batch.max(1) as f64, r.ratio))
                    .collect();
                let c = series_line(chart, (i, name), line, &err)?;
                chart
                    .draw_series(pts.iter().filter_map(|r| {
                        let s = r.ratio_spread()?;
                        let x = r.batch.max(1) as f64;
                        Some(ErrorBar::new_vertical(
                            x,
                            s.p10,
                            r.ratio,
                            s.p90,
                            c.filled(),
                            8,
                        ))
                    }))
                    .map_err(|e| err(e.to_string()))?;
            }
            Ok(())
        },
    )
}

/// Achieved (solid) and limit (dashed) latency against batch, log scales.
fn latency_plot(title: &str, rows: &[&BenchResult]) -> Result<String, ReportError> {
    let err = plot_err(title);
    let y = log_bounds(rows.iter().flat_map(|r| [r.achieved, r.limit])).log_scale();
    let y_fmt = |y: &f64| format!("{y:.0}");
    log_x_chart(
        title,
        batch_x(rows),
        (y, ("round trip, us", &y_fmt)),
        SeriesLabelPosition::UpperLeft,
        |chart| {
            for (i, (name, pts)) in series(rows).into_iter().enumerate() {
                let at = |v: fn(&BenchResult) -> f64| -> Vec<(f64, f64)> {
                    pts.iter().map(|r| (r.batch.max(1) as f64, v(r))).collect()
                };
                let c = series_line(chart, (i, name), at(|r| r.achieved), &err)?;
                chart
                    .draw_series(DashedLineSeries::new(
                        at(|r| r.limit),
                        5,
                        4,
                        c.stroke_width(1),
                    ))
                    .map_err(|e| err(e.to_string()))?;
            }
            Ok(())
        },
    )
}

/// Kernel call latency against batch with p10–p90 bars, log scales.
fn call_latency_plot(title: &str, rows: &[&BenchResult]) -> Result<String, ReportError> {
    let err = plot_err(title);
    let f = |r: &BenchResult, k: &str| r.extra_f64(k).unwrap_or(0.0);
    let y = log_bounds(
        rows.iter()
            .flat_map(|r| [f(r, "latency_us_p10"), f(r, "latency_us_p90")]),
    )
    .log_scale();
    let y_fmt = |y: &f64| format!("{y:.0}");
    log_x_chart(
        title,
        batch_x(rows),
        (y, ("one call, us", &y_fmt)),
        SeriesLabelPosition::UpperLeft,
        |chart| {
            for (i, (name, pts)) in series(rows).into_iter().enumerate() {
                let line = pts
                    .iter()
                    .map(|r| (r.batch.max(1) as f64, f(r, "latency_us")))
                    .collect();
                let c = series_line(chart, (i, name), line, &err)?;
                chart
                    .draw_series(pts.iter().map(|r| {
                        let x = r.batch.max(1) as f64;
                        let (p10, p90) = (f(r, "latency_us_p10"), f(r, "latency_us_p90"));
                        ErrorBar::new_vertical(x, p10, f(r, "latency_us"), p90, c.filled(), 8)
                    }))
                    .map_err(|e| err(e.to_string()))?;
            }
            Ok(())
        },
    )
}

/// The roofline min(peak, bandwidth × intensity) and each kernel result at its intensity
/// (none without a measured bandwidth and peak).
fn roofline_plot(report: &BenchReport) -> Result<Option<String>, ReportError> {
    let m = &report.machine.extra;
    let get = |k: &str| m.get(k).and_then(|v| v.as_f64()).filter(|v| *v > 0.0);
    let (Some(bw), Some(peak)) = (
        get("read_bandwidth_gbs_median"),
        get("int8_peak_tops_median"),
    ) else {
        return Ok(None);
    };
    let pts: Vec<&BenchResult> = report
        .results
        .iter()
        .filter(|r| r.extra_f64("ops_per_byte").is_some() && r.extra_f64("int8_tops").is_some())
        .filter(|r| r.extra.get("mode").and_then(|v| v.as_str()) == Some("exact"))
        // Cache-resident rows (`bench kernels --cache-resident`) read no DRAM: not on this roof.
        .filter(|r| !r.name.starts_with("kernel-ceiling-"))
        .collect();
    let title = "roofline";
    let err = plot_err(title);
    let ridge = peak * 1e12 / (bw * 1e9);
    let xs = pts.iter().filter_map(|r| r.extra_f64("ops_per_byte"));
    let (xlo, xhi) = xs.fold((ridge / 4.0, ridge * 4.0), |(a, b), v| (a.min(v), b.max(v)));
    let roof = |x: f64| (bw * 1e9 * x / 1e12).min(peak);
    let (x0, x1) = (xlo / 2.0, xhi * 2.0);
    let x_axis: Axis<'_> = ("arithmetic intensity, int8 ops per weight byte", &|x| {
        format!("{x:.1}")
    });
    let y_axis: Axis<'_> = ("int8 TOPS", &|y| format!("{y:.3}"));
    let y = ((roof(x0) / 4.0)..(peak * 1.5)).log_scale();
    let svg = log_x_chart(
        title,
        (x0..x1, x_axis),
        (y, y_axis),
        SeriesLabelPosition::LowerRight,
        |chart| {
            let line: Vec<(f64, f64)> = (0..=200)
                .map(|i| {
                    let x = x0 * (x1 / x0).powf(i as f64 / 200.0);
                    (x, roof(x))
                })
                .collect();
            chart
                .draw_series(LineSeries::new(line, BLACK.stroke_width(2)))
                .map_err(|e| err(e.to_string()))?
                .label(format!("roofline: {bw:.1} GB/s read, {peak:.3} int8 TOPS"))
                .legend(|(x, y)| {
                    PathElement::new(vec![(x, y), (x + 18, y)], BLACK.stroke_width(2))
                });
            for (i, (name, rs)) in series(&pts).into_iter().enumerate() {
                let c = Palette99::pick(i).to_rgba();
                let p: Vec<(f64, f64)> = rs
                    .iter()
                    .filter_map(|r| Some((r.extra_f64("ops_per_byte")?, r.extra_f64("int8_tops")?)))
                    .collect();
                chart
                    .draw_series(p.iter().map(|&q| Circle::new(q, 4, c.filled())))
                    .map_err(|e| err(e.to_string()))?
                    .label(name)
                    .legend(move |(x, y)| Circle::new((x + 9, y), 4, c.filled()));
            }
            Ok(())
        },
    )?;
    Ok(Some(svg))
}

/// The results as an HTML table with spreads; bench bugs highlighted.
fn results_table(report: &BenchReport) -> String {
    let mut t = String::from(
        "<h2>Results</h2>\n<table><tr><th>name</th><th>batch</th><th>achieved</th><th>limit</th><th>unit</th><th>ratio</th><th>ratio p10-p90</th><th>reps</th><th>better</th></tr>\n",
    );
    for r in &report.results {
        let spread = r
            .ratio_spread()
            .map_or(String::new(), |s| format!("{:.3}-{:.3}", s.p10, s.p90));
        let n = r
            .extra
            .get("repetitions")
            .map_or(String::new(), |v| v.to_string());
        let class = if r.is_bench_bug() { " class=bug" } else { "" };
        let _ = writeln!(
            t,
            "<tr{class}><td>{}</td><td>{}</td><td>{:.3}</td><td>{:.3}</td><td>{}</td><td>{:.3}</td><td>{spread}</td><td>{n}</td><td>{}</td></tr>",
            esc(&r.name),
            r.batch,
            r.achieved,
            r.limit,
            esc(&r.unit),
            r.ratio,
            r.better.name()
        );
    }
    t.push_str("</table>\n");
    t
}

/// The machine description as an HTML table (long arrays shortened).
fn machine_table(report: &BenchReport) -> String {
    let m = &report.machine;
    let mut t = String::from("<h2>Machine</h2>\n<table>\n");
    let mut row = |k: &str, v: String| {
        let _ = writeln!(
            t,
            "<tr><td>{}</td><td style=text-align:left>{}</td></tr>",
            esc(k),
            esc(&v)
        );
    };
    row("cpu_model", m.cpu_model.clone().unwrap_or_default());
    row("cpus", m.cpus.to_string());
    row("os / arch", format!("{} / {}", m.os, m.arch));
    for (k, v) in &m.extra {
        if k == "read_bandwidth_probes" {
            continue;
        }
        let mut s = v.to_string();
        if s.len() > 300 {
            s.truncate(300);
            s.push_str(" ...");
        }
        row(k, s);
    }
    t.push_str("</table>\n");
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn report_page_has_every_plot_and_the_bugs() {
        let mut report = BenchReport::new();
        for b in [1u64, 4, 16] {
            let a = [10.0 + b as f64, 11.0, 10.5];
            let l = [20.0, 21.0, 19.0];
            report.results.push(
                BenchResult::from_samples("decode-exact m H1 F1", b, &a, &l, "GB/s")
                    .with("ops_per_byte", 4.0 * b as f64)
                    .with("int8_tops", 0.04 * b as f64)
                    .with("mode", "exact")
                    .with("latency_us", 100.0 * b as f64)
                    .with("latency_us_p10", 90.0 * b as f64)
                    .with("latency_us_p90", 120.0 * b as f64),
            );
            report.results.push(BenchResult::from_samples(
                "tcp_dispatch_rtt_p50",
                b,
                &[50.0, 55.0],
                &[40.0, 41.0],
                "us",
            ));
        }
        report
            .results
            .push(BenchResult::from_samples("bug", 2, &[3.0], &[2.0], "GB/s"));
        let m = &mut report.machine.extra;
        m.insert("read_bandwidth_gbs_median".into(), 20.0.into());
        m.insert("int8_peak_tops_median".into(), 0.5.into());
        let dir = std::env::temp_dir().join(format!("em-report-{}", std::process::id()));
        let page = write_report(&report, &dir).unwrap();
        let html = std::fs::read_to_string(page).unwrap();
        assert_eq!(
            html.matches("<svg").count(),
            5,
            "two ratio plots, latency, call latency, roofline"
        );
        assert!(html.contains("Bench bugs") && html.contains("class=bug"));
        assert!(html.contains("roofline: 20.0 GB/s read"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
