//! `expertmesh convert`: a Hugging Face checkpoint folder → a converted weights folder.
//!
//! Why this exists: it is the command-line edge of [`expertmesh_checkpoint::convert`]: it
//! reads the model from `config.json`, picks the packed format that keeps an INT4 checkpoint
//! lossless, resolves the placement (a file, or the planner's balanced default), shows a
//! progress bar (bytes, GB/s, ETA) and prints what was written and the conversion error per
//! layer. Exit codes: 0 converted; 1 the checkpoint, its config or the placement has a problem
//! (named), or writing failed (disk full: nothing written is corrupted, re-run to resume);
//! 2 usage.

use crate::exit::EXIT_INVALID;
use anyhow::anyhow;
use clap::Args;
use expertmesh_checkpoint::convert::{
    ConvertJob, Progress, convert, keeps_shared_dense, routed_is_int4,
};
use expertmesh_checkpoint::experts::source_quant;
use expertmesh_checkpoint::hf_config::load_hf_model_and_family;
use expertmesh_checkpoint::safetensors::Checkpoint;
use expertmesh_planner::{self as plan, PlanOptions};
use expertmesh_topology::model::ModelSpec;
use expertmesh_topology::placement::Placement;
use expertmesh_topology::topology::Topology;
use indicatif::{ProgressBar, ProgressStyle};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

/// Exit codes of `convert`, shown in its --help.
pub(crate) const CONVERT_EXIT: &str = "Exit codes: 0 converted; 1 the checkpoint, its config.json or the placement has a problem (the tensor or file is named), or writing failed (e.g. disk full: finished shards are kept, re-run to resume); 2 usage.";

/// `expertmesh convert`.
#[derive(Args, Debug)]
pub(crate) struct ConvertArgs {
    /// Hugging Face checkpoint folder (config.json + *.safetensors).
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// Topology file: one shard is written per device.
    #[arg(long)]
    pub topology: PathBuf,
    /// Placement file (default: the planner's balanced placement for this topology).
    #[arg(long)]
    pub placement: Option<PathBuf>,
    /// Output folder (created; a re-run keeps the shards that are already complete).
    #[arg(long)]
    pub out: PathBuf,
    /// Conversion threads (default: every core). Hashing the source files for the manifest
    /// takes a quarter of them beside the conversion, all of them when every shard is kept.
    #[arg(long, value_parser = crate::args::threads_parser())]
    pub threads: Option<usize>,
    /// Quantize shared experts to INT4 even when the checkpoint keeps them unquantized (an
    /// INT4 checkpoint with BF16 shared experts, like Kimi K2-Thinking, serves them at BF16 on
    /// the router by default: lossless, at the cost of router memory).
    #[arg(long)]
    pub quantize_shared: bool,
    /// Float checkpoints: quantize with a searched u4 zero point per group (asymmetric, 4.625
    /// instead of 4.5 bits per weight; lower error on heavy-tailed weights). INT4 checkpoints
    /// keep their own format.
    #[arg(long)]
    pub zero_points: bool,
}

/// Run `expertmesh convert`.
pub(crate) fn run(args: &ConvertArgs) -> ExitCode {
    match convert_checked(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(EXIT_INVALID)
        }
    }
}

/// The model of the checkpoint with the packed format its experts keep losslessly (or, for a
/// float checkpoint, the default format, with zero points when asked).
fn model_of(
    args: &ConvertArgs,
    ckpt: &Checkpoint,
) -> anyhow::Result<(ModelSpec, expertmesh_checkpoint::experts::Family)> {
    let (mut spec, family) =
        load_hf_model_and_family(&args.checkpoint).map_err(|e| anyhow!("{e}"))?;
    spec.quant = source_quant(ckpt, &spec, family).map_err(|e| anyhow!("{e}"))?;
    if args.zero_points {
        if routed_is_int4(ckpt, &spec, family) {
            anyhow::bail!(
                "--zero-points applies to float checkpoints; this one is INT4 ({}) and is \
                 imported in its own format",
                spec.quant
            );
        }
        spec.quant.zero_points = true;
    }
    Ok((spec, family))
}
/// The placement: the file given (checked against topology and model), or a balanced plan.
fn placement_of(
    args: &ConvertArgs,
    topo: &Topology,
    spec: &ModelSpec,
) -> anyhow::Result<(Placement, String)> {
    if let Some(p) = &args.placement {
        // Read once (up to the text files' limit), so the text kept is the text checked.
        let text = expertmesh_topology::diag::read_text(p).map_err(|e| anyhow!("{e}"))?;
        let placement = Placement::from_toml_str(&text, topo, spec).map_err(|problems| {
            let e = expertmesh_topology::FileError::Invalid {
                path: p.clone(),
                problems,
            };
            anyhow!("{e}")
        })?;
        return Ok((placement, text));
    }
    let opts = PlanOptions {
        description: format!("balanced default of expertmesh convert for {}", spec.name),
        ..PlanOptions::default()
    };
    let p = plan::plan(topo, spec, None, None, &opts).map_err(|e| {
        anyhow!(
            "no placement of {} fits {}: {e}; see `expertmesh plan`",
            spec.name,
            topo.name()
        )
    })?;
    let text = p.placement.to_toml_string();
    Ok((p.placement, text))
}

fn convert_checked(args: &ConvertArgs) -> anyhow::Result<()> {
    let ckpt = Checkpoint::open(&args.checkpoint).map_err(|e| anyhow!("{e}"))?;
    let (spec, family) = model_of(args, &ckpt)?;
    let topo = Topology::load(&args.topology).map_err(|e| anyhow!("{e}"))?;
    let (placement, placement_text) = placement_of(args, &topo, &spec)?;
    let threads = args
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, std::num::NonZero::get));
    let job = ConvertJob {
        ckpt: &ckpt,
        family,
        spec: &spec,
        topology: &topo,
        placement: &placement,
        placement_text: &placement_text,
        out: &args.out,
        threads: threads.max(1),
        shared_dense: !args.quantize_shared && keeps_shared_dense(&ckpt, &spec, family),
    };
    if job.shared_dense {
        eprintln!(
            "shared experts stay at the checkpoint's precision (the routed experts are INT4, the \
             shared ones are not): the router runs them; --quantize-shared packs them instead"
        );
    }
    eprintln!(
        "expertmesh convert: {} ({family:?}, {}) → {} shards in {} ({threads} threads)",
        spec.name,
        spec.quant,
        topo.devices().len(),
        args.out.display()
    );
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template(
            "{bar:40} {bytes}/{total_bytes} {binary_bytes_per_sec} ETA {eta} {msg}",
        )
        .expect("a valid template"),
    );
    let started = Instant::now();
    let report = convert(&job, &|p| match p {
        Progress::Verifying { shards } => {
            eprintln!(
                "verifying the {shards} shard files an earlier run left (kept if they match)"
            );
        }
        Progress::Checking { experts } => {
            eprintln!("checking the tensors of the {experts} experts to convert");
        }
        Progress::Start { experts, bytes } => {
            bar.set_length(bytes);
            bar.set_message(format!("0/{experts} experts"));
        }
        Progress::Done { bytes, .. } => bar.inc(bytes),
    });
    bar.finish_and_clear();
    let report = report.map_err(|e| anyhow!("{e}"))?;
    let secs = started.elapsed().as_secs_f64();
    let m = &report.manifest;
    let written = report.shard_bytes_written;
    println!(
        "converted {} ({}) in {secs:.1} s: {} shards written, {} kept from an earlier run; {:.2} GB of source experts read ({:.2} GB/s), {:.2} GB written",
        m.model,
        m.source.weight_format,
        report.shards_written,
        report.shards_kept,
        report.source_bytes_converted as f64 / 1e9,
        report.source_bytes_converted as f64 / 1e9 / secs.max(1e-9),
        written as f64 / 1e9
    );
    let hashed: u64 = m.source.files.iter().map(|f| f.bytes).sum();
    println!(
        "source files hashed for the manifest beside it: {:.2} GB in {:.1} s ({:.2} GB/s on {} thread{})",
        hashed as f64 / 1e9,
        report.hashing_seconds,
        hashed as f64 / 1e9 / report.hashing_seconds.max(1e-9),
        report.hashing_threads,
        if report.hashing_threads == 1 { "" } else { "s" },
    );
    println!("layer  experts  rel_error_mean  rel_error_max");
    for l in &m.layers {
        println!(
            "{:5}  {:7}  {:14.5}  {:13.5}",
            l.layer, l.experts, l.rel_error_mean, l.rel_error_max
        );
    }
    println!(
        "serve it: expertmesh up --topology {} --weights {}",
        args.topology.display(),
        args.out.display()
    );
    Ok(())
}
