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
use std::sync::atomic::{AtomicU64, Ordering};
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
    let shown = ConvertProgress::new(
        ProgressBar::new(0),
        ProgressBar::new(0),
        ProgressBar::new(0),
    );
    let started = Instant::now();
    let report = convert(&job, &|p| shown.on(p));
    shown.finish();
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

/// What `convert` shows while it runs: a line per preparation step, a bar of the shard files
/// an earlier run left as they are read for their checksums (whole: minutes on a large
/// resumed output), a bar of the experts checked before anything is written (a cold FP8 or
/// GPTQ checkpoint reads a few small tensors per expert there), then a bar of the source bytes
/// converted with the experts done.
struct ConvertProgress {
    verified: ProgressBar,
    checked: ProgressBar,
    converted: ProgressBar,
    /// Experts done and to do (the converted bar's message).
    done: AtomicU64,
    total: AtomicU64,
}

impl ConvertProgress {
    /// Shows on `verified`, `checked` and `converted` (hidden bars in tests).
    fn new(verified: ProgressBar, checked: ProgressBar, converted: ProgressBar) -> Self {
        verified.set_style(
            ProgressStyle::with_template("{bar:40} {pos}/{len} shard files verified, {elapsed}")
                .expect("a valid template"),
        );
        checked.set_style(
            ProgressStyle::with_template("{bar:40} {pos}/{len} experts checked, {elapsed}")
                .expect("a valid template"),
        );
        converted.set_style(
            ProgressStyle::with_template(
                "{bar:40} {bytes}/{total_bytes} {binary_bytes_per_sec} ETA {eta} {msg}",
            )
            .expect("a valid template"),
        );
        Self {
            verified,
            checked,
            converted,
            done: AtomicU64::new(0),
            total: AtomicU64::new(0),
        }
    }

    fn on(&self, p: Progress) {
        match p {
            Progress::Verifying { shards } => {
                eprintln!(
                    "verifying the {shards} shard files an earlier run left (kept if they match)"
                );
                self.verified.set_length(shards);
                self.verified.reset_elapsed();
            }
            Progress::Verified { shards } => self.verified.inc(shards),
            Progress::Checking { experts } => {
                self.verified.finish_and_clear();
                eprintln!("checking the tensors of the {experts} experts to convert");
                self.checked.set_length(experts);
                self.checked.reset_elapsed();
            }
            Progress::Checked { experts } => self.checked.inc(experts),
            Progress::Start { experts, bytes } => {
                self.verified.finish_and_clear();
                self.checked.finish_and_clear();
                self.total.store(experts, Ordering::Relaxed);
                self.converted.set_length(bytes);
                self.converted.set_message(format!("0/{experts} experts"));
            }
            Progress::Done { experts, bytes } => {
                let done = self.done.fetch_add(experts, Ordering::Relaxed) + experts;
                let total = self.total.load(Ordering::Relaxed);
                self.converted.inc(bytes);
                self.converted
                    .set_message(format!("{done}/{total} experts"));
            }
        }
    }

    fn finish(&self) {
        self.verified.finish_and_clear();
        self.checked.finish_and_clear();
        self.converted.finish_and_clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The verified and checked bars count against the counts announced, and the converted
    /// bar's message counts experts as they are done (it said "0/N experts" for a whole run).
    #[test]
    fn the_bars_count_checked_and_converted_experts() {
        let p = ConvertProgress::new(
            ProgressBar::hidden(),
            ProgressBar::hidden(),
            ProgressBar::hidden(),
        );
        p.on(Progress::Verifying { shards: 2 });
        p.on(Progress::Verified { shards: 1 });
        p.on(Progress::Verified { shards: 1 });
        assert_eq!((p.verified.position(), p.verified.length()), (2, Some(2)));
        p.on(Progress::Checking { experts: 3 });
        for _ in 0..3 {
            p.on(Progress::Checked { experts: 1 });
        }
        assert_eq!((p.checked.position(), p.checked.length()), (3, Some(3)));
        p.on(Progress::Start {
            experts: 5,
            bytes: 500,
        });
        assert_eq!(p.converted.message(), "0/5 experts");
        p.on(Progress::Done {
            experts: 2,
            bytes: 200,
        });
        p.on(Progress::Done {
            experts: 1,
            bytes: 100,
        });
        assert_eq!(p.converted.message(), "3/5 experts");
        assert_eq!(
            (p.converted.position(), p.converted.length()),
            (300, Some(500))
        );
    }
}
