//! `expertmesh plan`: place a model's experts on a cluster, write the placement file, and report
//! memory, load balance, traffic, throughput and cost.
//!
//! Why this exists: this is what a cluster builder runs before buying or wiring anything. It
//! wires the planner library (`expertmesh_planner`) to files and a report: statistics in
//! (`--load`, `--coselect`, or `--synthetic-load zipf:S`), a placement out (`--out`, which
//! `expertmesh validate` and the fabric read), optional vLLM/SGLang EPLB maps in and out, the
//! order of a live change from the placement served now (`--from`,
//! `expertmesh_planner::transition`), and a human table or JSON (`--json`). Exit codes: 0 planned; 1 the model does not fit (the
//! shortfall is named per device and in total); 2 usage or input errors (unreadable or malformed
//! files, bad options). It never panics on bad input.
//!
//! Statistics formats are documented in `expertmesh_planner::stats`; the bench results
//! `--calibrate` reads in `expertmesh_planner::calibrate`; the EPLB map in
//! `expertmesh_planner::eplb`; the traffic and roofline model in
//! `expertmesh_planner::evaluate`.

use crate::table::{self, left, right};
use expertmesh_planner::calibrate::{self, BenchFile, Calibration, CalibrationItem};
use expertmesh_planner::eplb::{self, EplbLayers};
use expertmesh_planner::evaluate::{Evaluation, Evaluator, Hardware, Roofline};
use expertmesh_planner::stats::{CoSelection, LoadStats};
use expertmesh_planner::transition::{
    Keep, Transition, TransitionError, keep_in_place, transition,
};
use expertmesh_planner::wire::WireModel;
use expertmesh_planner::{
    self as plan, PlanError, PlanOptions, SharedPolicy, Shortfall, Strategy, capacity,
    describe_shortfall,
};
use expertmesh_router::core::LayerMode;
use expertmesh_topology::diag::FileError;
use expertmesh_topology::model::ModelSpec;
use expertmesh_topology::units::format_bytes;
use expertmesh_topology::{Placement, SharedLocation, Topology, resolve_model};
use serde_json::{Value, json};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// The statistics formats, shown by `expertmesh plan --help`.
const FORMATS_HELP: &str = "\
Statistics files (JSON or CSV, chosen by extension; layers are model layer ids, experts 0..E-1):
  --load      JSON {\"format\": 1, \"kind\": \"expert-load\", \"model\": \"kimi-k2\", \"tokens\": N,
                    \"layers\": [{\"layer\": 1, \"counts\": [c0, c1, ...]}, ...]}
              or SGLang {\"logical_count\": [[...per expert...] per layer]};
              CSV header layer,expert,tokens — one row per (layer, expert), repeats add up.
              counts = tokens routed to the expert; layers left out are planned as uniform.
  --coselect  JSON {\"format\": 1, \"kind\": \"co-selection\", \"tokens\": N,
                    \"layers\": [{\"layer\": 1, \"tokens\": N, \"pairs\": [[a, b, count], ...]}, ...]}
              CSV header layer,expert_a,expert_b,tokens — tokens that chose both a and b.
Exit codes: 0 planned, 1 does not fit (shortfall named), 2 usage or input error.";

/// Arguments of `expertmesh plan`.
#[derive(clap::Args, Debug)]
#[command(after_long_help = FORMATS_HELP)]
pub(crate) struct PlanArgs {
    /// Topology TOML file.
    #[arg(long)]
    topology: PathBuf,
    /// Model preset name or model TOML file.
    #[arg(long)]
    model: String,
    /// Expert-load statistics, JSON or CSV (`layer,expert,tokens`); see the format in the
    /// topology crate's `plan::stats`.
    #[arg(long)]
    load: Option<PathBuf>,
    /// Co-selection statistics, JSON or CSV (`layer,expert_a,expert_b,tokens`): place often
    /// co-selected experts on one node.
    #[arg(long)]
    coselect: Option<PathBuf>,
    /// Plan against synthetic loads instead of a file: `zipf:EXPONENT[:SEED]` (a Zipf law over
    /// each layer's experts, hot experts differing per layer).
    #[arg(long, conflicts_with = "load")]
    synthetic_load: Option<String>,
    /// Write the load statistics used (from --load or --synthetic-load) here (.json or .csv).
    #[arg(long)]
    write_load: Option<PathBuf>,
    /// Plan against synthetic co-selection statistics instead of a file:
    /// `clustered:CLUSTERS:LOCALITY[:SEED]` (each token draws most of its experts from one of
    /// CLUSTERS random clusters; LOCALITY = share of its picks inside the cluster, 0-1).
    #[arg(long, conflicts_with = "coselect")]
    synthetic_coselect: Option<String>,
    /// Write the co-selection statistics used here (.json or .csv).
    #[arg(long)]
    write_coselect: Option<PathBuf>,
    /// Replica slots per MoE layer (default: with statistics one per device, or what memory
    /// allows if less; without statistics none).
    #[arg(long)]
    redundant: Option<u32>,
    /// Placement strategy.
    #[arg(long, value_parser = crate::args::strategy_parser(), default_value = "auto")]
    strategy: Strategy,
    /// Where shared experts run: "router" (the router host, default), "spread" (each layer's on
    /// the device with the most free memory) or a device id ("node/device").
    #[arg(long, default_value = "router")]
    shared: String,
    /// How far above the mean a node's load may go to keep co-selected experts together.
    #[arg(long, default_value_t = 0.05)]
    locality_slack: f64,
    /// Write the placement file here.
    #[arg(long)]
    out: Option<PathBuf>,
    /// The placement the fabric serves now: the plan keeps experts on the devices that serve
    /// them where interchangeable devices allow (same balance and memory), and the report adds
    /// how a live change to it would go (steps of loads, router switch and frees that keep
    /// every expert served and every device within memory; covering replicas where devices
    /// are full).
    #[arg(long)]
    from: Option<PathBuf>,
    /// With --from: how much busier (relative) than the plan's busiest device a device may get
    /// so that experts stay where they are served (0.02 = 2%; 0 moves only what keeps the
    /// plan's balance).
    #[arg(long, default_value_t = expertmesh_planner::transition::REPACK_SLACK)]
    move_slack: f64,
    /// Print the report as JSON (stdout).
    #[arg(long)]
    json: bool,
    /// Bench JSON from `expertmesh bench ... --json` (repeatable): measured bandwidths and
    /// latencies replace datasheet figures, each only for what was measured (kernel results
    /// only for devices of the kind in the file's `machine.device_kind`, a CPU run calibrating
    /// CPU devices only; dispatch results only for links of that kind). The report lists what
    /// changed and what was left alone.
    #[arg(long)]
    calibrate: Vec<PathBuf>,
    /// Tokens per MoE-layer call for the throughput estimate.
    #[arg(long, default_value_t = 64)]
    batch: usize,
    /// Layer calls in flight at once for the throughput estimate.
    #[arg(long, default_value_t = 1)]
    concurrency: usize,
    /// Serving mode whose wire the traffic model counts, as the fabric sends it: exact (q8
    /// out, an f32 row per slot back), exact-bf16 (bf16 rows per slot), accurate (f32 out, a
    /// pre-combined f32 row per device back) or serving (q8 out, a pre-combined bf16 row per
    /// device back; the default of `up` and `router`).
    #[arg(long, default_value = "serving", value_parser = crate::args::mode_parser())]
    mode: LayerMode,
    /// Tokens per micro-batch of the router (one frame per micro-batch and device).
    #[arg(long, default_value_t = 32)]
    micro_batch: usize,
    /// Write the plan as a vLLM/SGLang physical-to-logical expert map (JSON).
    #[arg(long)]
    export_eplb: Option<PathBuf>,
    /// Rows of the exported map.
    #[arg(long, value_parser = crate::args::eplb_layers_parser(), default_value = "all")]
    eplb_layers: EplbLayers,
    /// Turn a vLLM/SGLang/TensorRT-LLM expert map (JSON) into the placement instead of
    /// planning one.
    #[arg(long, conflicts_with_all = ["coselect", "synthetic_coselect", "redundant"])]
    import_eplb: Option<PathBuf>,
}

/// Exit 2 with a message.
struct Usage(String);

impl<E: std::fmt::Display> From<E> for Usage {
    fn from(e: E) -> Usage {
        Usage(e.to_string())
    }
}

/// Batches the throughput sweep shows besides `--batch`.
const SWEEP: [usize; 6] = [1, 8, 32, 64, 128, 256];

/// Run `plan`; prints the report and returns the exit code.
pub(crate) fn run(args: &PlanArgs) -> ExitCode {
    match run_inner(args) {
        Ok(code) => code,
        Err(Usage(msg)) => {
            eprintln!("error: {msg}");
            ExitCode::from(crate::exit::EXIT_USAGE)
        }
    }
}

fn load_topology(path: &Path) -> Result<Topology, Usage> {
    Topology::load(path).map_err(|e| match e {
        FileError::Io { .. } => Usage(e.to_string()),
        FileError::Invalid { .. } => Usage(format!(
            "the topology is invalid (run `expertmesh validate {}`):\n{e}",
            path.display()
        )),
    })
}

fn parse_synthetic(spec: &str, model: &ModelSpec) -> Result<LoadStats, Usage> {
    let parts: Vec<&str> = spec.split(':').collect();
    let bad = || {
        Usage(format!(
            "--synthetic-load \"{spec}\": expected zipf:EXPONENT or zipf:EXPONENT:SEED, e.g. zipf:1.2"
        ))
    };
    if parts.len() < 2 || parts.len() > 3 || parts[0] != "zipf" {
        return Err(bad());
    }
    let s: f64 = parts[1].parse().map_err(|_| bad())?;
    if !(s.is_finite() && (0.0..=10.0).contains(&s)) {
        return Err(Usage(format!(
            "--synthetic-load: exponent {s} must be between 0 and 10"
        )));
    }
    let seed: u64 = match parts.get(2) {
        Some(x) => x.parse().map_err(|_| bad())?,
        None => 1,
    };
    Ok(plan::synthetic::zipf_load(model, s, 1_000_000, seed))
}

fn parse_synthetic_coselect(spec: &str, model: &ModelSpec) -> Result<CoSelection, Usage> {
    let parts: Vec<&str> = spec.split(':').collect();
    let bad = || {
        Usage(format!(
            "--synthetic-coselect \"{spec}\": expected clustered:CLUSTERS:LOCALITY[:SEED], e.g. clustered:16:0.8"
        ))
    };
    if parts.len() < 3 || parts.len() > 4 || parts[0] != "clustered" {
        return Err(bad());
    }
    let clusters: usize = parts[1].parse().map_err(|_| bad())?;
    let locality: f64 = parts[2].parse().map_err(|_| bad())?;
    if clusters == 0 || clusters > model.routed_experts as usize {
        return Err(Usage(format!(
            "--synthetic-coselect: CLUSTERS must be between 1 and the {} experts",
            model.routed_experts
        )));
    }
    if !(0.0..=1.0).contains(&locality) {
        return Err(Usage(
            "--synthetic-coselect: LOCALITY must be between 0 and 1".into(),
        ));
    }
    if model.top_k < 2 {
        return Err(Usage(format!(
            "{} picks one expert per token; co-selection needs top-k with k >= 2",
            model.name
        )));
    }
    let seed: u64 = match parts.get(3) {
        Some(x) => x.parse().map_err(|_| bad())?,
        None => 1,
    };
    let routing = plan::synthetic::ClusteredRouting::new(model, clusters, locality, 0.0, seed);
    Ok(routing.statistics(model, 4096).1)
}

fn shared_policy(s: &str) -> SharedPolicy {
    match s {
        "router" => SharedPolicy::Router,
        "spread" => SharedPolicy::Spread,
        id => SharedPolicy::Device(id.to_owned()),
    }
}

/// Hardware figures for one batch size: topology, then every bench file (what calibration
/// changed and left alone).
fn hardware(
    t: &Topology,
    m: &ModelSpec,
    benches: &[BenchFile],
    batch: usize,
) -> (Hardware, Calibration) {
    let mut hw = Hardware::from_topology(t);
    let cal = calibrate::apply(&mut hw, t, m, benches, batch);
    (hw, cal)
}

fn run_inner(args: &PlanArgs) -> Result<ExitCode, Usage> {
    if args.batch == 0 || args.concurrency == 0 {
        return Err(Usage("--batch and --concurrency must be at least 1".into()));
    }
    if !(args.move_slack.is_finite() && args.move_slack >= 0.0) {
        return Err(Usage("--move-slack must be a non-negative number".into()));
    }
    if !(args.locality_slack.is_finite() && args.locality_slack >= 0.0) {
        return Err(Usage(
            "--locality-slack must be a non-negative number".into(),
        ));
    }
    let mut warnings: Vec<String> = Vec::new();
    let inputs = read_inputs(args, &mut warnings)?;
    let wire =
        expertmesh_fabric::wire_model::wire_model(args.mode, inputs.model.hidden, args.micro_batch)
            .map_err(|e| Usage(format!("--mode: {e}")))?;
    let Placed {
        placement,
        strategy_name,
        redundant,
        mut notes,
    } = match place(args, &inputs, &mut warnings)? {
        Ok(placed) => placed,
        Err(no_fit) => return Ok(no_fit),
    };
    // With --from: the plan changed to keep experts where they are served now (same memory
    // per device, balance within a stated slack), and the live change to it.
    let (placement, live) = match &args.from {
        Some(path) => {
            let (t, m) = (&inputs.topology, &inputs.model);
            let old = Placement::load(path, t, m).map_err(|e| Usage(format!("--from: {e}")))?;
            let how = Keep {
                load: inputs.load.as_ref(),
                coselect: inputs.coselect.as_ref(),
                // A hierarchical plan chose each node's experts: keep them.
                within_nodes: strategy_name != "global",
                slack: args.move_slack,
            };
            let kept = keep_in_place(t, m, &old, &placement, &how)
                .map_err(|e| Usage(format!("--from: {e}")))?;
            let live = transition(t, m, &old, &kept);
            (kept, Some(live))
        }
        None => (placement, None),
    };
    let ev = evaluate(args, &inputs, &placement, &wire, &mut notes);
    let written = write_files(args, &inputs, &placement, &strategy_name, redundant)?;
    let (topology, model, coselect) = (&inputs.topology, &inputs.model, &inputs.coselect);
    let report = Report {
        args,
        topology,
        model,
        placement: &placement,
        strategy: &strategy_name,
        redundant,
        load_source: match (&args.load, &args.synthetic_load) {
            (None, None) if args.synthetic_coselect.is_some() => {
                "implied by the synthetic co-selection counts".into()
            }
            (Some(p), _) => format!("{}", p.display()),
            (None, Some(s)) => format!("synthetic {s}"),
            (None, None) if coselect.is_some() => "implied by the co-selection counts".into(),
            (None, None) => "uniform (no statistics)".into(),
        },
        after: &ev.after,
        before: ev.before.as_ref(),
        before_locality: ev.before_locality.as_ref(),
        chosen: &ev.chosen,
        sweep: &ev.sweep,
        hw: &ev.hw,
        calibration: (!inputs.benches.is_empty()).then_some(&ev.calibration),
        notes: &notes,
        warnings: &warnings,
        written: &written,
        live: live.as_ref(),
    };
    for w in &warnings {
        eprintln!("warning: {w}");
    }
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&report.json()).unwrap_or_default()
        );
    } else {
        print!("{}", report.text());
    }
    Ok(ExitCode::SUCCESS)
}

/// What planning reads: the cluster, the model, the statistics, the bench files and the
/// planner's options.
struct Inputs {
    topology: Topology,
    model: ModelSpec,
    load: Option<LoadStats>,
    coselect: Option<CoSelection>,
    benches: Vec<BenchFile>,
    shared: SharedPolicy,
    options: PlanOptions,
}

/// Step 1: read the topology, the model, the statistics (their warnings into `warnings`) and
/// the bench files; build the planner's options.
fn read_inputs(args: &PlanArgs, warnings: &mut Vec<String>) -> Result<Inputs, Usage> {
    let topology = load_topology(&args.topology)?;
    let model = resolve_model(&args.model)?;
    let load: Option<LoadStats> = match (&args.load, &args.synthetic_load) {
        (Some(p), _) => Some(LoadStats::load(p, &model)?),
        (None, Some(spec)) => Some(parse_synthetic(spec, &model)?),
        (None, None) => None,
    };
    if let Some(l) = &load {
        warnings.extend(l.warnings().iter().cloned());
    }
    let coselect: Option<CoSelection> = match (&args.coselect, &args.synthetic_coselect) {
        (Some(p), _) => Some(CoSelection::load(p, &model)?),
        (None, Some(spec)) => Some(parse_synthetic_coselect(spec, &model)?),
        (None, None) => None,
    };
    if let Some(c) = &coselect {
        warnings.extend(c.warnings().iter().cloned());
    }
    let benches: Vec<BenchFile> = args
        .calibrate
        .iter()
        .map(|p| BenchFile::load(p))
        .collect::<Result<_, _>>()?;
    let shared = shared_policy(&args.shared);
    let options = PlanOptions {
        redundant: args.redundant,
        strategy: args.strategy,
        shared: shared.clone(),
        locality_slack: args.locality_slack,
        description: String::new(),
    };
    Ok(Inputs {
        topology,
        model,
        load,
        coselect,
        benches,
        shared,
        options,
    })
}

/// The placement and how it came about.
struct Placed {
    placement: Placement,
    strategy_name: String,
    redundant: u32,
    notes: Vec<String>,
}

/// Step 2: the placement, imported or planned; `Ok(Err(code))` when the model does not fit
/// (the shortfall already reported).
fn place(
    args: &PlanArgs,
    inputs: &Inputs,
    warnings: &mut Vec<String>,
) -> Result<Result<Placed, ExitCode>, Usage> {
    let (topology, model) = (&inputs.topology, &inputs.model);
    let Some(path) = &args.import_eplb else {
        return match plan::plan(
            topology,
            model,
            inputs.load.as_ref(),
            inputs.coselect.as_ref(),
            &inputs.options,
        ) {
            Ok(p) => Ok(Ok(Placed {
                placement: p.placement,
                strategy_name: p.strategy.name().to_owned(),
                redundant: p.redundant,
                notes: p.notes,
            })),
            Err(PlanError::DoesNotFit(s)) => {
                Ok(Err(report_no_fit(args, topology, model, &s, warnings)))
            }
            Err(e) => Err(Usage(e.to_string())),
        };
    };
    let map = eplb::import(path, topology, model).map_err(Usage)?;
    warnings.extend(map.warnings.iter().cloned());
    let (locs, shared_bytes) =
        capacity::place_shared(topology, model, &inputs.shared).map_err(Usage)?;
    if let Some(s) = import_shortfall(topology, model, &map.slots, &shared_bytes) {
        return Ok(Err(report_no_fit(args, topology, model, &s, warnings)));
    }
    let slots_total: usize = map
        .slots
        .iter()
        .map(|l| l.iter().map(Vec::len).sum::<usize>())
        .max()
        .unwrap_or(0);
    let description = format!("imported from {}", path.display());
    let p = Placement::new(topology, model, map.slots, locs, &description).map_err(|problems| {
        Usage(format!(
            "{} does not make a valid placement:\n{}",
            path.display(),
            problems
                .iter()
                .map(|p| format!("  {p}"))
                .collect::<Vec<_>>()
                .join("\n")
        ))
    })?;
    let r = slots_total.saturating_sub(model.routed_experts as usize) as u32;
    Ok(Ok(Placed {
        placement: p,
        strategy_name: "imported".to_owned(),
        redundant: r,
        notes: Vec::new(),
    }))
}

/// The evaluations the report compares, and the throughput roofline.
struct Evaluated {
    hw: Hardware,
    calibration: Calibration,
    after: Evaluation,
    before: Option<Evaluation>,
    before_locality: Option<Evaluation>,
    sweep: Vec<Roofline>,
    chosen: Roofline,
}

/// Step 3: evaluate the placement against its baselines — no statistics and no replicas
/// ("before balancing"), the same without co-selection ("before locality") — and sweep the
/// roofline over batch sizes; calibration notes go to `notes`.
fn evaluate(
    args: &PlanArgs,
    inputs: &Inputs,
    placement: &Placement,
    wire: &WireModel,
    notes: &mut Vec<String>,
) -> Evaluated {
    let (topology, model) = (&inputs.topology, &inputs.model);
    let (load, coselect) = (inputs.load.as_ref(), inputs.coselect.as_ref());
    let baseline = plan::plan(
        topology,
        model,
        None,
        None,
        &PlanOptions {
            redundant: Some(0),
            strategy: Strategy::Global,
            ..inputs.options.clone()
        },
    )
    .ok();
    let no_locality = match (coselect, &args.import_eplb) {
        (Some(_), None) => plan::plan(topology, model, load, None, &inputs.options).ok(),
        _ => None,
    };
    let (hw, calibration) = hardware(topology, model, &inputs.benches, args.batch);
    notes.extend(calibration.notes.iter().cloned());
    let router = hw.router_node;
    let evaluator =
        Evaluator::new(topology, model, placement, load, coselect, router).with_wire(wire.clone());
    let after = evaluator.evaluate(&hw);
    let evaluate_other = |b: &plan::Plan| {
        Evaluator::new(topology, model, &b.placement, load, coselect, router)
            .with_wire(wire.clone())
            .evaluate(&hw)
    };
    let before = baseline.as_ref().map(evaluate_other);
    let before_locality = no_locality.as_ref().map(evaluate_other);
    let mut batches: Vec<usize> = SWEEP.to_vec();
    if !batches.contains(&args.batch) {
        batches.push(args.batch);
        batches.sort_unstable();
    }
    let sweep: Vec<Roofline> = batches
        .iter()
        .map(|&b| {
            let (hw_b, _) = hardware(topology, model, &inputs.benches, b);
            evaluator.roofline(&hw_b, b, args.concurrency)
        })
        .collect();
    let chosen = sweep
        .iter()
        .find(|r| r.batch == args.batch)
        .cloned()
        .unwrap_or_else(|| evaluator.roofline(&hw, args.batch, args.concurrency));
    Evaluated {
        hw,
        calibration,
        after,
        before,
        before_locality,
        sweep,
        chosen,
    }
}

/// Step 4: write the requested files (placement, EPLB map, statistics); what was written.
fn write_files(
    args: &PlanArgs,
    inputs: &Inputs,
    placement: &Placement,
    strategy_name: &str,
    redundant: u32,
) -> Result<Vec<String>, Usage> {
    let (topology, model) = (&inputs.topology, &inputs.model);
    let mut written = Vec::new();
    if let Some(out) = &args.out {
        let header = format!(
            "# Written by `expertmesh plan` ({}): {} on {}, strategy {strategy_name}, {redundant} replica slot{} per MoE layer.\n# Check it with: expertmesh validate {} --placement {}\n",
            env!("CARGO_PKG_VERSION"),
            model.name,
            topology.name(),
            if redundant == 1 { "" } else { "s" },
            args.topology.display(),
            out.display()
        );
        write_file(out, &(header + &placement.to_toml_string()))?;
        written.push(format!("placement: {}", out.display()));
    }
    if let Some(path) = &args.export_eplb {
        let text = eplb::export_json(placement, topology, model, args.eplb_layers)
            .map_err(|e| Usage(format!("cannot export the EPLB map: {e}")))?;
        write_file(path, &text)?;
        written.push(format!("EPLB map: {}", path.display()));
    }
    if let Some(path) = &args.write_load {
        let Some(l) = &inputs.load else {
            return Err(Usage(
                "--write-load needs load statistics (--load or --synthetic-load)".into(),
            ));
        };
        let text = if is_json_path(path) {
            l.to_json(model)
        } else {
            l.to_csv(model)
        };
        write_file(path, &text)?;
        written.push(format!("load statistics: {}", path.display()));
    }
    if let Some(path) = &args.write_coselect {
        let Some(c) = &inputs.coselect else {
            return Err(Usage(
                "--write-coselect needs co-selection statistics (--coselect or --synthetic-coselect)"
                    .into(),
            ));
        };
        let text = if is_json_path(path) {
            c.to_json(model)
        } else {
            c.to_csv(model)
        };
        write_file(path, &text)?;
        written.push(format!("co-selection statistics: {}", path.display()));
    }
    Ok(written)
}

fn is_json_path(path: &Path) -> bool {
    path.extension().is_some_and(|e| e == "json")
}

/// Write a file whole or not at all ([`expertmesh_files::write_whole`]).
fn write_file(path: &Path, text: &str) -> Result<(), Usage> {
    if path.file_name().is_none() {
        return Err(Usage(format!("{} is not a file path", path.display())));
    }
    expertmesh_files::write_whole(path, text.as_bytes(), None)
        .map_err(|e| Usage(format!("cannot write {}: {e}", path.display())))
}

/// Budget check of an imported map (bytes per device against budgets).
fn import_shortfall(
    t: &Topology,
    m: &ModelSpec,
    slots: &[Vec<Vec<u32>>],
    shared_bytes: &[u64],
) -> Option<Shortfall> {
    let mut need = shared_bytes.to_vec();
    for layer in slots {
        for (d, list) in layer.iter().enumerate() {
            need[d] += list.len() as u64 * m.expert_bytes();
        }
    }
    let devices: Vec<capacity::DeviceShortfall> = t
        .devices()
        .iter()
        .zip(&need)
        .filter(|(d, n)| **n > d.expert_memory_bytes())
        .map(|(d, &n)| capacity::DeviceShortfall {
            rank: d.rank().0,
            device: d.id().to_owned(),
            need_bytes: n,
            budget_bytes: d.expert_memory_bytes(),
            short_bytes: n - d.expert_memory_bytes(),
        })
        .collect();
    if devices.is_empty() {
        return None;
    }
    let total: u64 = need.iter().sum();
    let budget = t.total_expert_memory();
    Some(Shortfall {
        need_bytes: total,
        budget_bytes: budget,
        usable_bytes: budget,
        short_bytes: devices.iter().map(|d| d.short_bytes).sum(),
        redundant: 0,
        max_redundant_that_fits: None,
        devices,
        shared_short: Vec::new(),
    })
}

fn report_no_fit(
    args: &PlanArgs,
    t: &Topology,
    m: &ModelSpec,
    s: &Shortfall,
    warnings: &[String],
) -> ExitCode {
    for w in warnings {
        eprintln!("warning: {w}");
    }
    if args.json {
        let v = json!({
            "model": m.name,
            "cluster": t.name(),
            "fits": false,
            "shortfall": s,
            "warnings": warnings,
        });
        println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
    }
    eprintln!(
        "{} on {} ({} devices): {}",
        m.name,
        t.name(),
        t.devices().len(),
        describe_shortfall(s)
    );
    ExitCode::from(crate::exit::EXIT_INVALID)
}

/// Everything the report shows.
struct Report<'a> {
    args: &'a PlanArgs,
    topology: &'a Topology,
    model: &'a ModelSpec,
    placement: &'a Placement,
    strategy: &'a str,
    redundant: u32,
    load_source: String,
    after: &'a Evaluation,
    before: Option<&'a Evaluation>,
    before_locality: Option<&'a Evaluation>,
    chosen: &'a Roofline,
    sweep: &'a [Roofline],
    hw: &'a Hardware,
    /// What --calibrate changed and left alone (None without --calibrate).
    calibration: Option<&'a Calibration>,
    notes: &'a [String],
    warnings: &'a [String],
    written: &'a [String],
    /// The live change from `--from` (None without it).
    live: Option<&'a Result<Transition, TransitionError>>,
}

/// The plural ending of a count ("1 node", "2 nodes").
fn plural(n: usize) -> &'static str {
    if n == 1 { "" } else { "s" }
}

/// A figure for reading: four significant digits (a link's 12.48 GB/s, not
/// 12.482843810046665); a whole number as it is (50, not 50.00).
fn figure(v: f64) -> String {
    if v.fract() == 0.0 || !v.is_finite() {
        return format!("{v}");
    }
    let digits = v.abs().log10().floor() as i32 + 1;
    let decimals = (4 - digits).clamp(0, 6) as usize;
    format!("{v:.decimals$}")
}

/// The calibration section of the text report: each figure changed (old → new, from which
/// result) and each left alone (its value, and why no result applied).
fn text_calibration(cal: &Calibration, out: &mut String) {
    let _ = writeln!(out, "calibration (--calibrate):");
    let line = |out: &mut String, tag: &str, i: &CalibrationItem| {
        let value = match i.was {
            Some(was) => format!("{} -> {} {}", figure(was), figure(i.value), i.unit),
            None => format!("{} {}", figure(i.value), i.unit),
        };
        let _ = writeln!(
            out,
            "  {tag}: {} for {}: {value}; {}",
            i.figure, i.applies_to, i.why
        );
    };
    if cal.changed.is_empty() {
        let _ = writeln!(out, "  changed: nothing");
    }
    for i in &cal.changed {
        line(out, "changed", i);
    }
    for i in &cal.left_alone {
        line(out, "left alone", i);
    }
}

/// Loads, covering replicas and frees over a transition's steps.
fn live_counts(t: &Transition) -> (usize, usize, usize) {
    let covers = t
        .steps
        .iter()
        .flat_map(|s| &s.loads)
        .filter(|m| m.cover)
        .count();
    let frees = t.steps.iter().map(|s| s.frees.len()).sum();
    (t.loads(), covers, frees)
}

/// The live-change section of the text report: the steps, and each device's peak against
/// its room.
fn text_live(
    topology: &Topology,
    from: &Path,
    live: &Result<Transition, TransitionError>,
    out: &mut String,
) {
    let t = match live {
        Ok(t) => t,
        Err(e) => {
            let _ = writeln!(
                out,
                "live change from {}: not possible: {e}",
                from.display()
            );
            return;
        }
    };
    let (loads, covers, frees) = live_counts(t);
    let _ = writeln!(
        out,
        "live change from {}: {} step(s), {loads} expert loads ({covers} covering replicas), \
         {frees} frees",
        from.display(),
        t.steps.len()
    );
    for (i, s) in t.steps.iter().enumerate().take(8) {
        let c = s.loads.iter().filter(|m| m.cover).count();
        let _ = writeln!(
            out,
            "  step {}: load {} ({c} covering), switch, free {}",
            i + 1,
            s.loads.len(),
            s.frees.len()
        );
    }
    if t.steps.len() > 8 {
        let _ = writeln!(out, "  ... {} more steps", t.steps.len() - 8);
    }
    let peak = t.peak_slots();
    for d in topology.devices() {
        let r = d.rank().index();
        let _ = writeln!(
            out,
            "  {}: peak {} of {} expert slots",
            d.id(),
            peak[r],
            t.slots[r]
        );
    }
}

/// The live change as JSON: counts, per-step counts, each device's peak and room; or the
/// reason it cannot be made.
fn live_json(live: &Result<Transition, TransitionError>) -> Value {
    match live {
        Err(e) => json!({ "possible": false, "error": e.to_string() }),
        Ok(t) => {
            let (loads, covers, frees) = live_counts(t);
            json!({
                "possible": true,
                "steps": t.steps.len(),
                "loads": loads,
                "covers": covers,
                "frees": frees,
                "step_list": t.steps.iter().map(|s| json!({
                    "loads": s.loads.len(),
                    "covers": s.loads.iter().filter(|m| m.cover).count(),
                    "frees": s.frees.len(),
                })).collect::<Vec<_>>(),
                "peak_slots": t.peak_slots(),
                "slots": t.slots,
            })
        }
    }
}

fn kb(bytes: f64) -> String {
    format!("{:.1} KB", bytes / 1e3)
}

fn shared_text(t: &Topology, p: &Placement) -> String {
    let mut locs: Vec<String> = p
        .layers()
        .iter()
        .filter_map(|&l| p.shared_location(l))
        .map(|s| match s {
            SharedLocation::Router => "the router host".to_owned(),
            SharedLocation::Device(r) => t.devices()[r.index()].id().to_owned(),
        })
        .collect();
    locs.sort();
    locs.dedup();
    match locs.len() {
        0 => "no shared experts".into(),
        1 => format!("shared experts on {}", locs[0]),
        n => format!("shared experts on {n} devices"),
    }
}

impl Report<'_> {
    fn text(&self) -> String {
        let mut out = String::new();
        self.text_memory(&mut out);
        self.text_balance(&mut out);
        self.text_traffic(&mut out);
        self.text_roofline(&mut out);
        if let (Some(live), Some(from)) = (self.live, &self.args.from) {
            text_live(self.topology, from, live, &mut out);
        }
        self.text_footer(&mut out);
        out
    }

    /// Text step 1: the headline, the load source and the memory table per device.
    fn text_memory(&self, out: &mut String) {
        let (t, m, p) = (self.topology, self.model, self.placement);
        let _ = writeln!(
            out,
            "plan: {} on {} ({} device{} on {} node{}) — strategy {}, {} replica slot{} per MoE layer, {}",
            m.name,
            t.name(),
            t.devices().len(),
            plural(t.devices().len()),
            t.nodes().len(),
            plural(t.nodes().len()),
            self.strategy,
            self.redundant,
            plural(self.redundant as usize),
            shared_text(t, p)
        );
        let _ = writeln!(out, "expert load: {}\n", self.load_source);

        // Memory per device.
        let usage = p.usage(t, m);
        let rows: Vec<Vec<String>> = usage
            .iter()
            .map(|u| {
                let d = &t.devices()[u.rank.index()];
                vec![
                    u.rank.to_string(),
                    d.id().to_owned(),
                    if u.experts_per_layer_min == u.experts_per_layer_max {
                        u.experts_per_layer_min.to_string()
                    } else {
                        format!("{}-{}", u.experts_per_layer_min, u.experts_per_layer_max)
                    },
                    format_bytes(u.total_bytes()),
                    format_bytes(u.budget_bytes),
                    format!(
                        "{:.1}%",
                        100.0 * u.total_bytes() as f64 / u.budget_bytes.max(1) as f64
                    ),
                    if u.fits() {
                        "ok".to_owned()
                    } else {
                        format!("short {}", format_bytes(u.total_bytes() - u.budget_bytes))
                    },
                    format!("{:.2}", self.after.load.per_device[u.rank.index()]),
                ]
            })
            .collect();
        let _ = writeln!(
            out,
            "{}",
            table::render(
                &[
                    right("rank"),
                    left("device"),
                    right("experts/layer"),
                    right("used"),
                    right("budget"),
                    right("use"),
                    left("fit"),
                    right("load/mean"),
                ],
                &rows
            )
        );
        let used: u64 = usage.iter().map(|u| u.total_bytes()).sum();
        let budget = t.total_expert_memory();
        let _ = writeln!(
            out,
            "memory: {} of {} expert memory used ({:.1}%); every device fits\n",
            format_bytes(used),
            format_bytes(budget),
            100.0 * used as f64 / budget.max(1) as f64
        );
    }

    /// Text step 2: the load balance before and after.
    fn text_balance(&self, out: &mut String) {
        // Load balance.
        let _ = writeln!(
            out,
            "expected load per device, max/mean over devices (1.00 = perfect), mean over layers and worst layer:"
        );
        if let Some(b) = self.before {
            let _ = writeln!(
                out,
                "  before (balanced packing, no statistics, no replicas): {:.2} (worst {:.2}, layer {})",
                b.load.max_over_mean, b.load.max_over_mean_worst, b.load.worst_layer
            );
        }
        let _ = writeln!(
            out,
            "  after  (this plan):                                     {:.2} (worst {:.2}, layer {})\n",
            self.after.load.max_over_mean,
            self.after.load.max_over_mean_worst,
            self.after.load.worst_layer
        );
    }

    /// Text step 3: the traffic per token, before and after, and the locality gain.
    fn text_traffic(&self, out: &mut String) {
        let t = self.topology;
        // Traffic.
        let tr = &self.after.traffic;
        let w = &tr.wire;
        let _ = writeln!(
            out,
            "traffic per token per MoE layer ({} model; {} mode wire: {} activations out, {} {} rows back, one frame per micro-batch of {} and device):",
            tr.model,
            w.mode,
            w.dispatch_dtype,
            w.result_dtype,
            match w.result_rows {
                expertmesh_planner::wire::ResultRows::PerSlot => "per-slot",
                expertmesh_planner::wire::ResultRows::PerToken => "pre-combined",
            },
            w.micro_batch_tokens
        );
        let _ = writeln!(
            out,
            "  destinations: {:.2} devices on {:.2} nodes ({:.2} other than the router's)",
            tr.devices_per_token, tr.nodes_per_token, tr.remote_nodes_per_token
        );
        let _ = writeln!(
            out,
            "  network: {} ({} dispatch + {} results){}; intra-node links: {}",
            kb(tr.network_bytes_per_token),
            kb(tr.network_dispatch_bytes_per_token),
            kb(tr.network_result_bytes_per_token),
            if w.node_dedup {
                format!(
                    " with per-node dedup ({} without)",
                    kb(tr.network_bytes_per_token_without_dedup)
                )
            } else {
                ", one copy per device".to_owned()
            },
            kb(tr.intra_bytes_per_token)
        );
        if let Some(b) = self.before {
            let _ = writeln!(
                out,
                "  before (balanced packing, no statistics, no replicas): {:.2} nodes per token, network {}",
                b.traffic.nodes_per_token,
                kb(b.traffic.network_bytes_per_token)
            );
        }
        if let Some(b) = self.before_locality.filter(|_| t.nodes().len() > 1) {
            let x = b.traffic.nodes_per_token;
            let y = tr.nodes_per_token;
            let _ = writeln!(
                out,
                "  locality: nodes per token {:.2} -> {:.2} ({:+.1}%), network bytes {} -> {} vs the same plan without co-selection",
                x,
                y,
                100.0 * (y - x) / x.max(1e-12),
                kb(b.traffic.network_bytes_per_token),
                kb(tr.network_bytes_per_token)
            );
        }
        let _ = writeln!(out);
    }

    /// Text step 4: the roofline sweep and the chosen batch's throughput and cost.
    fn text_roofline(&self, out: &mut String) {
        // Roofline.
        let _ = writeln!(
            out,
            "decode throughput, roofline (MoE layers only; batch = tokens per layer call, {} call{} in flight):",
            self.args.concurrency,
            if self.args.concurrency == 1 { "" } else { "s" }
        );
        let rows: Vec<Vec<String>> = self
            .sweep
            .iter()
            .map(|r| {
                vec![
                    r.batch.to_string(),
                    format!("{:.0}", r.tokens_per_s),
                    format!("{:.3}", r.step_ms),
                    r.bottleneck.clone(),
                    format!("{:.3}", r.terms.memory_ms),
                    format!("{:.3}", r.terms.compute_ms),
                    format!("{:.3}", r.terms.network_ms),
                    format!("{:.3}", r.terms.intra_node_ms),
                    format!("{:.3}", r.terms.latency_ms),
                    r.usd_per_million_tokens
                        .map_or("-".into(), |c| format!("{c:.3}")),
                ]
            })
            .collect();
        let _ = writeln!(
            out,
            "{}",
            table::render(
                &[
                    right("batch"),
                    right("tokens/s"),
                    right("step ms"),
                    left("bottleneck"),
                    right("memory ms"),
                    right("compute ms"),
                    right("network ms"),
                    right("intra ms"),
                    right("latency ms"),
                    right("$/M tokens"),
                ],
                &rows
            )
        );
        let c = self.chosen;
        let _ = writeln!(
            out,
            "at batch {} x {}: {:.0} tokens/s, bottleneck {} (busiest device {}{}){}",
            c.batch,
            c.concurrency,
            c.tokens_per_s,
            c.bottleneck,
            c.busiest_device,
            c.busiest_nic_node
                .as_ref()
                .map(|n| format!(", busiest NIC node {n}"))
                .unwrap_or_default(),
            match (c.usd_per_million_tokens, c.usd_per_hour) {
                (Some(cost), Some(h)) => format!(", ${cost:.3} per million tokens (${h:.2}/h)"),
                _ => ", no cost (not every device has price_usd_per_hour)".into(),
            }
        );
    }

    /// Text step 5: the figures used, notes and files written.
    fn text_footer(&self, out: &mut String) {
        let _ = writeln!(out, "figures used:");
        for s in &self.hw.sources {
            let _ = writeln!(
                out,
                "  {}: {} {} ({})",
                s.what,
                figure(s.value),
                s.unit,
                s.from
            );
        }
        if let Some(cal) = self.calibration {
            text_calibration(cal, out);
        }
        for n in self.notes {
            let _ = writeln!(out, "note: {n}");
        }
        for w in self.written {
            let _ = writeln!(out, "wrote {w}");
        }
        if self.written.is_empty() {
            let _ = writeln!(
                out,
                "(no file written; --out PLACEMENT writes the placement)"
            );
        }
    }

    fn json(&self) -> Value {
        let (t, m, p) = (self.topology, self.model, self.placement);
        let devices: Vec<Value> = p
            .usage(t, m)
            .iter()
            .map(|u| {
                let d = &t.devices()[u.rank.index()];
                json!({
                    "rank": u.rank.0,
                    "device": d.id(),
                    "node": t.node_of(d).name(),
                    "experts_per_layer_min": u.experts_per_layer_min,
                    "experts_per_layer_max": u.experts_per_layer_max,
                    "experts_total": u.experts_total,
                    "routed_bytes": u.routed_bytes,
                    "shared_bytes": u.shared_bytes,
                    "used_bytes": u.total_bytes(),
                    "budget_bytes": u.budget_bytes,
                    "fits": u.fits(),
                    "shortfall_bytes": u.total_bytes().saturating_sub(u.budget_bytes),
                    "load_over_mean": self.after.load.per_device[u.rank.index()],
                })
            })
            .collect();
        json!({
            "model": m.name,
            "cluster": t.name(),
            "fits": true,
            "strategy": self.strategy,
            "redundant_per_layer": self.redundant,
            "shared": shared_text(t, p),
            "load_source": self.load_source,
            "memory": {
                "devices": devices,
                "used_bytes": p.usage(t, m).iter().map(|u| u.total_bytes()).sum::<u64>(),
                "budget_bytes": t.total_expert_memory(),
            },
            "load": {
                "before": self.before.map(|b| &b.load),
                "after": &self.after.load,
            },
            "traffic": &self.after.traffic,
            "traffic_before": self.before.map(|b| &b.traffic),
            "traffic_without_coselection_placement": self.before_locality.map(|b| &b.traffic),
            "roofline": self.chosen,
            "roofline_sweep": self.sweep,
            "figures": &self.hw.sources,
            "calibration": self.calibration,
            "notes": self.notes,
            "warnings": self.warnings,
            "written": self.written,
            "live_change": self.live.map(live_json),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::{figure, plural};

    #[test]
    fn figures_read_as_four_significant_digits_and_counts_agree() {
        assert_eq!(figure(12.482843810046665), "12.48");
        assert_eq!(figure(0.000123456), "0.000123"); // at most six decimals
        assert_eq!(figure(1234.5678), "1235");
        assert_eq!(figure(50.0), "50");
        assert_eq!(figure(0.0), "0");
        assert_eq!((plural(1), plural(2), plural(0)), ("", "s", "s"));
    }
}
