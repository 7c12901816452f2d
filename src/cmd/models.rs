//! `expertmesh models [MODEL | --from-hf DIR] [--toml]`: the built-in presets, or one model in
//! detail.
//!
//! Why this exists: `M` anywhere on the command line is a preset name or a model file, so users
//! need to see the presets with their sizes, inspect one (a preset or their own file, which this
//! also validates), start a custom model file from a preset (`--toml`), and get the model file
//! of a Hugging Face checkpoint (`--from-hf DIR`, exactly or not at all).

use crate::table::{self, left, right};
use expertmesh_checkpoint::hf_config::load_hf_model;
use expertmesh_topology::model::{ModelSpec, presets};
use expertmesh_topology::model_file::model_to_toml_string;
use expertmesh_topology::resolve_model;
use expertmesh_topology::units::format_bytes;
use std::path::PathBuf;
use std::process::ExitCode;

/// Arguments of `expertmesh models`.
#[derive(clap::Args, Debug)]
#[command(group(clap::ArgGroup::new("one_model").args(["model", "from_hf"])))]
pub(crate) struct ModelsArgs {
    /// Show one model (a preset name or a model TOML file) in detail.
    model: Option<String>,
    /// Show the model of a Hugging Face checkpoint folder, read from DIR/config.json
    /// (deepseek_v3, kimi_k2, glm4_moe, qwen3_moe, qwen2_moe, mixtral,
    /// olmoe). Exit 1 names the key when the config cannot be served exactly; exit 2 when
    /// config.json is missing or not JSON.
    #[arg(long, value_name = "DIR", conflicts_with = "model")]
    from_hf: Option<PathBuf>,
    /// Print the model as a model TOML file (a template for custom models).
    #[arg(long, requires = "one_model")]
    toml: bool,
}

/// Run `models`.
pub(crate) fn run(args: &ModelsArgs) -> ExitCode {
    if let Some(dir) = &args.from_hf {
        return run_from_hf(dir, args.toml);
    }
    let Some(name) = &args.model else {
        print!("{}", list());
        return ExitCode::SUCCESS;
    };
    match resolve_model(name) {
        Ok(m) if args.toml => {
            print!("{}", model_to_toml_string(&m));
            ExitCode::SUCCESS
        }
        Ok(m) => {
            print!("{}", detail(&m));
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!(
                "{}",
                if e.is_usage() {
                    format!("error: {e}")
                } else {
                    e.to_string()
                }
            );
            ExitCode::from(if e.is_usage() {
                crate::exit::EXIT_USAGE
            } else {
                crate::exit::EXIT_INVALID
            })
        }
    }
}

/// `models --from-hf DIR [--toml]`: the checkpoint's model, printed as for a preset.
fn run_from_hf(dir: &std::path::Path, toml: bool) -> ExitCode {
    match load_hf_model(dir) {
        Ok(m) if toml => {
            print!("{}", model_to_toml_string(&m));
            ExitCode::SUCCESS
        }
        Ok(m) => {
            print!("{}", detail(&m));
            ExitCode::SUCCESS
        }
        Err(e) if e.is_usage() => {
            eprintln!("error: {e}");
            ExitCode::from(crate::exit::EXIT_USAGE)
        }
        Err(e) => {
            eprintln!("{e}");
            ExitCode::from(crate::exit::EXIT_INVALID)
        }
    }
}

/// The preset table.
fn list() -> String {
    let rows: Vec<Vec<String>> = presets()
        .iter()
        .map(|m| {
            vec![
                m.name.clone(),
                m.num_layers.to_string(),
                m.moe_layers().to_string(),
                m.routed_experts.to_string(),
                m.top_k.to_string(),
                m.shared_experts.to_string(),
                m.hidden.to_string(),
                m.moe_intermediate.to_string(),
                m.expert_bytes().to_string(),
                format!("{:.2}", m.routed_bytes() as f64 / 1e9),
                format!("{:.2}", m.shared_bytes() as f64 / 1e9),
                format!("g{} {}", m.quant.group_size, m.quant.scale_dtype),
                format!(
                    "{}{}",
                    m.scoring.name(),
                    if m.toy { " (test/demo)" } else { "" }
                ),
            ]
        })
        .collect();
    let t = table::render(
        &[
            left("name"),
            right("layers"),
            right("moe"),
            right("E"),
            right("top-k"),
            right("shared"),
            right("H"),
            right("F"),
            right("expert bytes"),
            right("routed GB"),
            right("shared GB"),
            left("quant"),
            left("scoring"),
        ],
        &rows,
    );
    format!(
        "{t}\n\nINT4 bytes include the 16-bit group scales. Use `expertmesh models NAME` for details, \
         `--toml` to start a model file from a preset; anywhere a model is asked for, a model TOML \
         file path works too.\n"
    )
}

/// One model in detail.
fn detail(m: &ModelSpec) -> String {
    let layers = m.moe_layer_ids();
    let moe = match (layers.first(), layers.last()) {
        (Some(a), Some(b)) if m.moe_layer_step <= 1 => format!("{a}-{b}"),
        _ => expertmesh_topology::ranges::format_list(&layers),
    };
    let mut s = format!("{} — {}\n", m.name, m.description);
    let mut kv = |k: &str, v: String| s.push_str(&format!("  {k:<24} {v}\n"));
    kv(
        "layers",
        format!("{} ({} MoE: {moe})", m.num_layers, m.moe_layers()),
    );
    kv("hidden (H)", m.hidden.to_string());
    kv(
        "routed experts (E)",
        format!("{} per layer, top-{}", m.routed_experts, m.top_k),
    );
    kv("expert intermediate (F)", m.moe_intermediate.to_string());
    kv(
        "shared experts",
        if m.shared_experts == 0 {
            "none".into()
        } else {
            format!(
                "{} per layer, intermediate {}{}",
                m.shared_experts,
                m.shared_intermediate,
                if m.shared_expert_gate {
                    ", output scaled by sigmoid(shared_expert_gate · x)"
                } else {
                    ""
                }
            )
        },
    );
    kv(
        "scoring",
        format!(
            "{}, norm_topk_prob {}, routed_scaling_factor {}",
            m.scoring.name(),
            m.norm_topk_prob,
            m.routed_scaling_factor
        ),
    );
    kv(
        "groups",
        if m.n_group > 1 {
            format!("{} groups, keep {}", m.n_group, m.topk_group)
        } else {
            "none".into()
        },
    );
    kv(
        "quantization",
        format!("{} ({} bits/weight)", m.quant, m.quant.bits_per_weight()),
    );
    kv(
        "bytes per expert",
        format!(
            "{} ({} B, {} params)",
            format_bytes(m.expert_bytes()),
            m.expert_bytes(),
            m.expert_params()
        ),
    );
    kv("bytes per MoE layer", format_bytes(m.layer_routed_bytes()));
    kv(
        "routed expert bytes",
        format!(
            "{} ({} B)",
            format_bytes(m.routed_bytes()),
            m.routed_bytes()
        ),
    );
    kv("shared expert bytes", format_bytes(m.shared_bytes()));
    kv(
        "dispatch per token",
        format!("{} B per destination (bf16)", m.token_bytes_bf16()),
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use expertmesh_topology::model::preset_by_name;

    #[test]
    fn list_has_every_preset_with_its_bytes() {
        let l = list();
        for m in presets() {
            let row = l
                .lines()
                .find(|r| r.split_whitespace().next() == Some(m.name.as_str()))
                .unwrap_or_else(|| panic!("{} missing from\n{l}", m.name));
            assert!(row.contains(&m.expert_bytes().to_string()), "{row}");
        }
        // Kimi K2's routed bytes as published in the research note (B.4): 570.76 GB.
        assert!(
            l.lines()
                .any(|r| r.starts_with("kimi-k2 ") && r.contains("570.76")),
            "{l}"
        );
    }

    #[test]
    fn detail_shows_layers_and_bytes() {
        let d = detail(&preset_by_name("deepseek-v3").unwrap());
        assert!(d.contains("61 (58 MoE: 3-60)"), "{d}");
        assert!(d.contains("24772608 B"), "{d}");
        assert!(d.contains("8 groups, keep 4"), "{d}");
    }
}
