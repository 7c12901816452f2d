//! `expertmesh validate TOPOLOGY [--model M] [--placement P]`: check the files a deployment is
//! made of, list every problem, or summarize what was found.
//!
//! Why this exists: a cluster builder's first question is "is this right, and does the model
//! fit?". This command answers it before any process starts: exit 0 with a summary table
//! (nodes, devices, memory, experts per device, fit), exit 1 with every problem of every file
//! (each `path:line:column: item: what to change`), exit 2 when a file cannot be read or the
//! arguments are wrong. It never panics on bad input.

use crate::table::{self, left, right};
use expertmesh_topology::diag::{read_text, render_problems, sort_problems, thousands};
use expertmesh_topology::model::{ModelSpec, preset_by_name};
use expertmesh_topology::topology::{DeviceKind, IntraLink};
use expertmesh_topology::units::{SizeUnit, checked_sum, format_bytes, format_bytes_in};
use expertmesh_topology::{
    DeviceUsage, FileError, Placement, PlacementFile, Problem, ResolveError, SharedLocation,
    Topology, resolve_model,
};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// Arguments of `expertmesh validate`.
#[derive(clap::Args, Debug)]
pub(crate) struct ValidateArgs {
    /// Topology TOML file.
    topology: PathBuf,
    /// Model preset name or model TOML file (default: the placement's model, when that is a
    /// preset).
    #[arg(long)]
    model: Option<String>,
    /// Placement TOML file to check against the topology and the model.
    #[arg(long)]
    placement: Option<PathBuf>,
}

/// What went wrong, by exit code.
enum Failure {
    /// Exit 2: a file could not be read, an unknown preset, missing arguments.
    Usage(String),
    /// Exit 1: files were read and have problems (already rendered, one per line, repeats of
    /// one kind summed up), and how many problems there are in all.
    Invalid(Vec<String>, usize),
}

/// The problems found so far: rendered lines, and how many problems they stand for.
#[derive(Default)]
struct Found {
    lines: Vec<String>,
    count: usize,
}

impl Found {
    /// Add a file's problems, rendered with repeats of one kind summed up.
    fn add(&mut self, path: &Path, problems: &[Problem]) {
        if problems.is_empty() {
            return;
        }
        self.lines
            .extend(render_problems(path, problems).lines().map(str::to_owned));
        self.count += problems.len();
    }

    /// Add one problem already rendered.
    fn push(&mut self, line: String) {
        self.lines.push(line);
        self.count += 1;
    }
}

/// Run `validate`; prints the summary (stdout) or the problems (stderr) and returns the exit code.
pub(crate) fn run(args: &ValidateArgs) -> ExitCode {
    let mut out = String::new();
    match validate(args, &mut out) {
        Ok(()) => {
            print!("{out}");
            ExitCode::SUCCESS
        }
        Err(Failure::Usage(msg)) => {
            eprintln!("error: {msg}");
            ExitCode::from(crate::exit::EXIT_USAGE)
        }
        Err(Failure::Invalid(lines, count)) => {
            let mut err = String::new();
            for l in &lines {
                err.push_str(l);
                err.push('\n');
            }
            eprint!("{err}");
            eprintln!(
                "invalid: {} problem{} found",
                thousands(count),
                if count == 1 { "" } else { "s" }
            );
            ExitCode::from(crate::exit::EXIT_INVALID)
        }
    }
}

/// Split a file error into problems to list (invalid) or a usage failure (unreadable).
fn file_problems(e: FileError, problems: &mut Found) -> Result<(), Failure> {
    match e {
        FileError::Io { .. } => Err(Failure::Usage(e.to_string())),
        FileError::Invalid { path, problems: p } => {
            problems.add(&path, &p);
            Ok(())
        }
    }
}

fn validate(args: &ValidateArgs, out: &mut String) -> Result<(), Failure> {
    let mut problems = Found::default();

    let topology = match Topology::load(&args.topology) {
        Ok(t) => Some(t),
        Err(e) => {
            file_problems(e, &mut problems)?;
            None
        }
    };

    // The placement is parsed leniently: its own problems and its cross-check problems are
    // listed together, in file order.
    let mut placement_problems: Vec<Problem> = Vec::new();
    let placement_file = read_placement(args, &mut placement_problems, &mut problems)?;
    let model = read_model(args, placement_file.as_ref(), &mut problems)?;

    let placement = match (&topology, &model, &placement_file) {
        (Some(t), Some(m), Some((_, file, text))) => match file.resolve(text, t, m) {
            Ok(p) if placement_problems.is_empty() => Some(p),
            Ok(_) => None,
            Err(p) => {
                placement_problems.extend(p);
                None
            }
        },
        _ => None,
    };
    if let Some(path) = &args.placement {
        sort_problems(&mut placement_problems);
        problems.add(path, &placement_problems);
    }

    if let (Some(t), Some(m), None) = (&topology, &model, &args.placement)
        && let Some(p) = routed_fit_problem(&args.topology, t, m)
    {
        problems.push(p);
    }

    if problems.count > 0 {
        return Err(Failure::Invalid(problems.lines, problems.count));
    }
    let Some(topology) = topology else {
        return Err(Failure::Usage("no topology".into()));
    };
    summarize(
        out,
        &args.topology,
        &topology,
        model.as_ref(),
        args.placement.as_deref().zip(placement.as_ref()),
    );
    Ok(())
}

/// Validate step: read and leniently parse the placement file, if any (its parse problems to
/// `placement_problems`, an invalid file's to `problems`); its path, contents and text.
fn read_placement<'a>(
    args: &'a ValidateArgs,
    placement_problems: &mut Vec<Problem>,
    problems: &mut Found,
) -> Result<Option<(&'a Path, PlacementFile, String)>, Failure> {
    Ok(match &args.placement {
        None => None,
        Some(path) => match read_text(path) {
            Ok(text) => {
                let (file, p) = PlacementFile::parse(&text);
                *placement_problems = p;
                file.map(|f| (path.as_path(), f, text))
            }
            Err(e) => {
                file_problems(e, problems)?;
                None
            }
        },
    })
}

/// Validate step: the model, from `--model` or else the placement's preset.
fn read_model(
    args: &ValidateArgs,
    placement_file: Option<&(&Path, PlacementFile, String)>,
    problems: &mut Found,
) -> Result<Option<ModelSpec>, Failure> {
    Ok(match (&args.model, placement_file) {
        (Some(m), _) => match resolve_model(m) {
            Ok(spec) => Some(spec),
            Err(ResolveError::File(e)) => {
                file_problems(e, problems)?;
                None
            }
            Err(e) => return Err(Failure::Usage(e.to_string())),
        },
        (None, Some((path, file, _))) => match preset_by_name(file.model_name()) {
            Some(spec) => Some(spec),
            None => {
                return Err(Failure::Usage(format!(
                    "{} is for model \"{}\", which is not a built-in preset; pass --model with its model file",
                    path.display(),
                    file.model_name()
                )));
            }
        },
        (None, None) => None,
    })
}

/// Validate step: a model whose routed experts exceed the whole cluster's expert memory fits
/// no placement.
fn routed_fit_problem(path: &Path, t: &Topology, m: &ModelSpec) -> Option<String> {
    let need = m.routed_bytes();
    let have = t.total_expert_memory();
    (need > have).then(|| {
        format!(
            "{}: model \"{}\" needs {} for its routed experts but the {} devices offer {} of expert_memory in total; short by {} — add devices or raise expert_memory",
            path.display(),
            m.name,
            format_bytes(need),
            t.devices().len(),
            as_written(have, t.expert_memory_unit()),
            format_bytes(need - have)
        )
    })
}

/// Bytes in decimal units, then in binary units when that is how they were written
/// (`536.87 MB (512.00 MiB)`), for messages that compare them with decimal figures.
fn as_written(bytes: u64, unit: SizeUnit) -> String {
    match unit {
        SizeUnit::Decimal => format_bytes(bytes),
        SizeUnit::Binary => format!("{} ({})", format_bytes(bytes), format_bytes_in(bytes, unit)),
    }
}

fn percent(part: u64, whole: u64) -> String {
    if whole == 0 {
        "-".into()
    } else {
        format!("{:.1}%", 100.0 * part as f64 / whole as f64)
    }
}

fn link(l: Option<IntraLink>) -> String {
    match l {
        None => "-".into(),
        Some(l) => format!("{} {} GB/s", l.kind().name(), l.bandwidth_gb_s()),
    }
}

fn summarize(
    out: &mut String,
    path: &Path,
    t: &Topology,
    model: Option<&ModelSpec>,
    placement: Option<(&Path, &Placement)>,
) {
    use std::fmt::Write;
    summarize_cluster(out, path, t);
    summarize_nodes(out, t);
    let usage = match (model, placement) {
        (Some(m), Some((_, p))) => Some(p.usage(t, m)),
        _ => None,
    };
    summarize_devices(out, t, model, usage.as_deref());
    if let Some(m) = model {
        summarize_model(out, t, m, placement.zip(usage.as_deref()));
    }
    let _ = writeln!(out, "valid");
}

/// Summary step 1: the cluster's headline, description and router.
fn summarize_cluster(out: &mut String, path: &Path, t: &Topology) {
    use std::fmt::Write;
    let gpus = t
        .devices()
        .iter()
        .filter(|d| d.kind() == DeviceKind::Gpu)
        .count();
    let cpus = t.devices().len() - gpus;
    let kinds = match (gpus, cpus) {
        (g, 0) => format!("{g} gpu"),
        (0, c) => format!("{c} cpu"),
        (g, c) => format!("{g} gpu, {c} cpu"),
    };
    let _ = writeln!(
        out,
        "cluster \"{}\" ({}): {} node{}, {} device{} ({kinds}), expert memory {} in total",
        t.name(),
        path.display(),
        t.nodes().len(),
        if t.nodes().len() == 1 { "" } else { "s" },
        t.devices().len(),
        if t.devices().len() == 1 { "" } else { "s" },
        format_bytes_in(t.total_expert_memory(), t.expert_memory_unit())
    );
    if !t.description().is_empty() {
        let _ = writeln!(out, "  {}", t.description());
    }
    if let Some(r) = t.router() {
        let _ = writeln!(
            out,
            "router on node \"{}\", frontends connect to {}",
            t.nodes()[r.node_index()].name(),
            r.listen_endpoint()
        );
    }
    let _ = writeln!(out);
}

/// Summary step 2: the node table.
fn summarize_nodes(out: &mut String, t: &Topology) {
    use std::fmt::Write;
    // Nodes.
    let rows: Vec<Vec<String>> = t
        .nodes()
        .iter()
        .map(|n| {
            let mut nic_groups: BTreeMap<String, usize> = BTreeMap::new();
            for c in n.nics() {
                *nic_groups
                    .entry(format!("{} {} Gbit/s", c.kind().name(), c.speed_gbit_s()))
                    .or_default() += 1;
            }
            let nics = nic_groups
                .into_iter()
                .map(|(k, v)| format!("{v} x {k}"))
                .collect::<Vec<_>>()
                .join(", ");
            vec![
                n.name().to_owned(),
                n.address().to_owned(),
                n.data_address().to_owned(),
                n.control_port().to_string(),
                n.device_count().to_string(),
                nics,
                link(n.intra_link()),
            ]
        })
        .collect();
    let _ = writeln!(
        out,
        "{}\n",
        table::render(
            &[
                left("node"),
                left("address"),
                left("data address"),
                right("control"),
                right("devices"),
                left("NICs"),
                left("intra-node"),
            ],
            &rows,
        )
    );
}

/// Summary step 3: the device table, with the experts each holds (placement `usage`) or
/// would hold (even split).
fn summarize_devices(
    out: &mut String,
    t: &Topology,
    model: Option<&ModelSpec>,
    usage: Option<&[DeviceUsage]>,
) {
    use std::fmt::Write;
    let even = model.map(|m| {
        let n = t.devices().len().max(1) as u64;
        let per_layer = (m.routed_experts as u64).div_ceil(n);
        (
            per_layer,
            per_layer
                .saturating_mul(m.moe_layers() as u64)
                .saturating_mul(m.expert_bytes()),
        )
    });
    let mut cols = vec![
        right("rank"),
        left("device"),
        left("kind"),
        left("arch"),
        right("expert memory"),
        right("mem GB/s"),
        left("nic"),
        right("data port"),
    ];
    if model.is_some() {
        cols.push(right(if usage.is_some() {
            "experts/layer"
        } else {
            "experts/layer (even split)"
        }));
        cols.push(right("expert bytes"));
        cols.push(right("used"));
        cols.push(left("fit"));
    }
    let mut rows = Vec::new();
    for d in t.devices() {
        let mut row = vec![
            d.rank().to_string(),
            d.id().to_owned(),
            d.kind().name().to_owned(),
            d.arch().to_owned(),
            format_bytes_in(d.expert_memory_bytes(), d.expert_memory_unit()),
            format!("{}", d.memory_bandwidth_gb_s()),
            t.nic_of(d).name().to_owned(),
            d.data_port().to_string(),
        ];
        let budget = d.expert_memory_bytes();
        if let Some(u) = usage.map(|u| u[d.rank().index()]) {
            row.push(if u.experts_per_layer_min == u.experts_per_layer_max {
                u.experts_per_layer_min.to_string()
            } else {
                format!("{}-{}", u.experts_per_layer_min, u.experts_per_layer_max)
            });
            row.push(format_bytes(u.total_bytes()));
            row.push(percent(u.total_bytes(), budget));
            row.push(if u.fits() { "ok" } else { "NO" }.into());
        } else if let Some((per_layer, bytes)) = even {
            row.push(per_layer.to_string());
            row.push(format_bytes(bytes));
            row.push(percent(bytes, budget));
            row.push(if bytes <= budget { "ok" } else { "no" }.into());
        }
        rows.push(row);
    }
    let _ = writeln!(out, "{}\n", table::render(&cols, &rows));
}

/// Summary step 4: the model, and the placement's totals or the model's fit.
fn summarize_model(
    out: &mut String,
    t: &Topology,
    m: &ModelSpec,
    placement: Option<((&Path, &Placement), &[DeviceUsage])>,
) {
    use std::fmt::Write;
    let shared = if m.shared_experts > 0 {
        format!(
            ", shared experts {} ({} per layer)",
            format_bytes(m.shared_bytes()),
            m.shared_experts
        )
    } else {
        String::new()
    };
    let _ = writeln!(
        out,
        "model \"{}\": {} MoE layers x {} experts (top-{}), {} per expert, routed experts {}{shared}",
        m.name,
        m.moe_layers(),
        m.routed_experts,
        m.top_k,
        format_bytes(m.expert_bytes()),
        format_bytes(m.routed_bytes()),
    );
    match placement {
        Some(((ppath, p), u)) => {
            let experts = p.layers().len() * p.routed_experts() as usize;
            let slots = p.total_slots();
            let shared_at: Vec<String> = {
                let mut locs: Vec<String> = p
                    .layers()
                    .iter()
                    .filter_map(|&l| p.shared_location(l))
                    .map(|s| match s {
                        SharedLocation::Router => "router".to_owned(),
                        SharedLocation::Device(r) => t.devices()[r.index()].id().to_owned(),
                    })
                    .collect();
                locs.dedup();
                locs
            };
            let used = checked_sum(u.iter().map(|x| x.total_bytes())).unwrap_or(u64::MAX);
            let unit = t.expert_memory_unit();
            let _ = writeln!(
                out,
                "placement ({}): {} experts in {} slots ({} replicas){}; every device fits, {} of {} expert memory used ({})",
                ppath.display(),
                experts,
                slots,
                slots - experts,
                if shared_at.is_empty() {
                    String::new()
                } else {
                    format!("; shared experts on {}", shared_at.join(", "))
                },
                format_bytes_in(used, unit),
                format_bytes_in(t.total_expert_memory(), unit),
                percent(used, t.total_expert_memory())
            );
        }
        _ => {
            let _ = writeln!(
                out,
                "fit: routed experts need {} of {} expert memory ({}); no placement given (--placement P checks one)",
                format_bytes_in(m.routed_bytes(), t.expert_memory_unit()),
                format_bytes_in(t.total_expert_memory(), t.expert_memory_unit()),
                percent(m.routed_bytes(), t.total_expert_memory())
            );
        }
    }
}
