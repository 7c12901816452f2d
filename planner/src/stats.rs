//! Expert-load and co-selection statistics files: what the planner learns from real traffic.
//!
//! Why this exists: load-aware replication and locality need to know which experts are hot and
//! which are chosen together. The router counts both while it serves and exports them in the
//! formats below; `expertmesh plan --load FILE --coselect FILE` reads them back. Both formats
//! come in JSON and CSV (by extension: `.json` / `.csv`; otherwise a file starting with `{` is
//! JSON). Every reader reports the first problem with its place (line:column or the layer and
//! position) and what to change; nothing here panics on bad input.
//!
//! Layers are the model's layer ids (`layer` = the transformer layer index, as in the placement
//! file), experts are routed-expert ids `0..E-1`.
//!
//! # Expert load (`--load`)
//!
//! Tokens routed to each expert, per MoE layer, over a window: `counts[e]` = number of
//! (token, expert `e`) selections. Non-negative finite numbers (integers, or decimals for
//! decayed averages). A layer that is absent, or whose counts are all zero, is treated as
//! uniform (with a warning).
//!
//! ```json
//! {
//!   "format": 1,
//!   "kind": "expert-load",
//!   "model": "kimi-k2",
//!   "tokens": 1048576,
//!   "layers": [
//!     { "layer": 1, "counts": [5133, 812, 90, ...] },
//!     { "layer": 2, "counts": [...] }
//!   ]
//! }
//! ```
//! `format` (1), `kind`, `model` (cross-checked when present) and `tokens` (tokens in the
//! window; informational) are optional; `counts` has exactly E entries.
//! SGLang's expert-distribution dump is accepted too: `{"logical_count": [[...], ...]}` with one
//! row per layer (all `num_layers` layers, or only the MoE layers), or a 3-D
//! `[passes][layers][experts]` array whose passes are summed.
//!
//! ```text
//! # CSV: header line, then one row per (layer, expert); '#' starts a comment line
//! layer,expert,tokens
//! 1,0,5133
//! 1,1,812
//! ```
//! Rows may come in any order; repeated (layer, expert) rows add up (a router may append
//! windows); experts missing from a layer that has rows count 0.
//!
//! # Co-selection (`--coselect`)
//!
//! For each MoE layer, how many tokens chose both experts `a` and `b` among their top-k
//! (`a != b`; the pair is unordered: `(a, b)` and `(b, a)` add up). Only pairs seen need be
//! listed.
//!
//! ```json
//! {
//!   "format": 1,
//!   "kind": "co-selection",
//!   "model": "kimi-k2",
//!   "tokens": 1048576,
//!   "layers": [
//!     { "layer": 1, "tokens": 1048576, "pairs": [[0, 17, 2210], [0, 93, 15], ...] }
//!   ]
//! }
//! ```
//! `tokens` (per layer, else the top-level value) is the number of tokens observed; when absent
//! it is derived as `sum(pair counts) / (k(k-1)/2)`, which is exact when every token chose k
//! distinct experts. CSV: header `layer,expert_a,expert_b,tokens`, one row per pair.
//!
//! Without `--load`, the per-expert load is derived from co-selection counts
//! (`load[a] = sum over b of count(a, b) / (k - 1)`).

use expertmesh_topology::model::ModelSpec;
use serde::Deserialize;
use std::fmt;
use std::io::Write;
use std::path::{Path, PathBuf};

/// The statistics format version this build reads and writes.
pub const STATS_FORMAT: i64 = 1;
/// `kind` of an expert-load file.
pub const LOAD_KIND: &str = "expert-load";
/// `kind` of a co-selection file.
pub const COSELECT_KIND: &str = "co-selection";

/// A statistics file could not be read or is invalid.
#[derive(Debug, thiserror::Error)]
pub enum StatsError {
    /// The file could not be read.
    #[error("cannot read {}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// What failed.
        #[source]
        source: std::io::Error,
    },
    /// The file was read and is invalid.
    #[error("{}: {where_}{message}", path.display())]
    Invalid {
        /// The file.
        path: PathBuf,
        /// `line:column: ` or `layer N: ` or empty.
        where_: String,
        /// What is wrong and what to change.
        message: String,
    },
}

impl StatsError {
    fn invalid(path: &Path, where_: impl fmt::Display, message: impl Into<String>) -> StatsError {
        let w = where_.to_string();
        StatsError::Invalid {
            path: path.to_path_buf(),
            where_: if w.is_empty() { w } else { format!("{w}: ") },
            message: message.into(),
        }
    }
}

/// Tokens per expert for every MoE layer (indexed like [`ModelSpec::moe_layer_ids`]).
#[derive(Clone, Debug, PartialEq)]
pub struct LoadStats {
    experts: usize,
    /// `[MoE layer index]` → counts per expert (None: no data, uniform).
    layers: Vec<Option<Vec<f64>>>,
    /// Tokens in the window, when known.
    tokens: Option<f64>,
    warnings: Vec<String>,
}

impl LoadStats {
    /// Build from per-layer counts (`counts[i]` for the `i`-th MoE layer; None = no data).
    /// Counts must be finite and non-negative, one per routed expert.
    pub fn new(model: &ModelSpec, counts: Vec<Option<Vec<f64>>>) -> Result<LoadStats, String> {
        let layers = model.moe_layer_ids();
        if counts.len() != layers.len() {
            return Err(format!(
                "{} MoE layers expected, got {}",
                layers.len(),
                counts.len()
            ));
        }
        for (li, c) in counts.iter().enumerate() {
            if let Some(c) = c {
                check_counts(c, model.routed_experts as usize)
                    .map_err(|m| format!("layer {}: {m}", layers[li]))?;
            }
        }
        let mut s = LoadStats {
            experts: model.routed_experts as usize,
            layers: counts,
            tokens: None,
            warnings: Vec::new(),
        };
        s.note_uniform_layers(model);
        Ok(s)
    }

    /// Read a load file (JSON or CSV, see the module doc).
    pub fn load(path: &Path, model: &ModelSpec) -> Result<LoadStats, StatsError> {
        let text = read(path)?;
        LoadStats::parse(path, &text, model)
    }

    /// Parse load-file text; `path` picks the format (by extension, else by the first
    /// character) and names the file in messages.
    pub fn parse(path: &Path, text: &str, model: &ModelSpec) -> Result<LoadStats, StatsError> {
        if is_json(path, text) {
            parse_load_json(path, text, model)
        } else {
            parse_load_csv(path, text, model)
        }
    }

    /// Counts of the `li`-th MoE layer (None when the file had no data for it).
    pub fn layer(&self, li: usize) -> Option<&[f64]> {
        self.layers.get(li).and_then(|l| l.as_deref())
    }

    /// Number of MoE layers covered (with or without data).
    pub fn layer_count(&self) -> usize {
        self.layers.len()
    }

    /// Loads to plan with for the `li`-th MoE layer: the counts, or all ones when there is no
    /// data (or only zeros).
    pub fn weights(&self, li: usize) -> Vec<f64> {
        match self.layer(li) {
            Some(c) if c.iter().any(|&x| x > 0.0) => c.to_vec(),
            _ => vec![1.0; self.experts],
        }
    }

    /// Tokens in the window, when the file said.
    pub fn tokens(&self) -> Option<f64> {
        self.tokens
    }

    /// Remarks made while reading (layers without data, ...).
    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }

    fn note_uniform_layers(&mut self, model: &ModelSpec) {
        let ids = model.moe_layer_ids();
        let missing: Vec<u32> = self
            .layers
            .iter()
            .enumerate()
            .filter(|(_, c)| c.as_ref().is_none_or(|c| c.iter().all(|&x| x == 0.0)))
            .map(|(li, _)| ids[li])
            .collect();
        if !missing.is_empty() && missing.len() < ids.len() {
            self.warnings.push(format!(
                "no load data for layer{} {}; {} planned as uniform",
                if missing.len() == 1 { "" } else { "s" },
                expertmesh_topology::ranges::format_list(&missing),
                if missing.len() == 1 {
                    "it is"
                } else {
                    "they are"
                }
            ));
        } else if missing.len() == ids.len() {
            self.warnings
                .push("the load file has no non-zero counts; planned as uniform".into());
        }
    }

    /// The file as JSON (format 1, `kind = "expert-load"`).
    pub fn to_json(&self, model: &ModelSpec) -> String {
        let ids = model.moe_layer_ids();
        let mut out = String::new();
        out.push_str(&format!(
            "{{\n  \"format\": {STATS_FORMAT},\n  \"kind\": \"{LOAD_KIND}\",\n  \"model\": {},\n",
            json_string(&model.name)
        ));
        if let Some(t) = self.tokens {
            out.push_str(&format!("  \"tokens\": {},\n", json_number(t)));
        }
        out.push_str("  \"layers\": [");
        let mut first = true;
        for (li, c) in self.layers.iter().enumerate() {
            let Some(c) = c else { continue };
            if !first {
                out.push(',');
            }
            first = false;
            let nums: Vec<String> = c.iter().map(|&x| json_number(x)).collect();
            out.push_str(&format!(
                "\n    {{ \"layer\": {}, \"counts\": [{}] }}",
                ids[li],
                nums.join(", ")
            ));
        }
        out.push_str("\n  ]\n}\n");
        out
    }

    /// The file as CSV (`layer,expert,tokens`).
    pub fn to_csv(&self, model: &ModelSpec) -> String {
        let ids = model.moe_layer_ids();
        let mut out = String::from("layer,expert,tokens\n");
        for (li, c) in self.layers.iter().enumerate() {
            let Some(c) = c else { continue };
            for (e, &x) in c.iter().enumerate() {
                out.push_str(&format!("{},{e},{}\n", ids[li], json_number(x)));
            }
        }
        out
    }

    /// Write JSON (`.json`) or CSV (any other extension).
    pub fn write(&self, path: &Path, model: &ModelSpec) -> std::io::Result<()> {
        let mut f = std::fs::File::create(path)?;
        f.write_all(self.text_for(path, model).as_bytes())?;
        f.sync_all()
    }

    /// Write like [`LoadStats::write`], whole or not at all ([`expertmesh_files::write_whole`]:
    /// a temporary file beside `path`, renamed over it), so a reader (`expertmesh plan
    /// --load`) never sees a half-written file while a router refreshes it.
    pub fn write_atomic(&self, path: &Path, model: &ModelSpec) -> std::io::Result<()> {
        expertmesh_files::write_whole(path, self.text_for(path, model).as_bytes(), None)
    }

    /// The file's text in the format `path`'s extension asks for (JSON for `.json`, else CSV).
    fn text_for(&self, path: &Path, model: &ModelSpec) -> String {
        if path.extension().is_some_and(|e| e == "json") {
            self.to_json(model)
        } else {
            self.to_csv(model)
        }
    }

    /// Set the number of tokens in the window.
    pub fn with_tokens(mut self, tokens: f64) -> LoadStats {
        self.tokens = Some(tokens);
        self
    }
}

/// Per-token inclusion probabilities from loads: `pi_e = min(1, c * load_e)` with `c` chosen so
/// that `sum(pi) = k` (each token picks k distinct experts, so no expert can be in more than
/// every token). With all loads zero, uniform `k / E`.
pub fn inclusion(loads: &[f64], top_k: u32) -> Vec<f64> {
    let e = loads.len();
    if e == 0 {
        return Vec::new();
    }
    let k = (top_k as usize).min(e) as f64;
    let positive = loads.iter().filter(|&&x| x > 0.0).count();
    if positive == 0 {
        return vec![k / e as f64; e];
    }
    if positive as f64 <= k {
        // Every expert with load is in every token; the rest share what is left.
        let rest = (k - positive as f64) / (e - positive).max(1) as f64;
        return loads
            .iter()
            .map(|&x| if x > 0.0 { 1.0 } else { rest })
            .collect();
    }
    // Scale to the largest load first so sums cannot overflow.
    let top = loads.iter().copied().fold(0.0, f64::max);
    let loads: Vec<f64> = loads.iter().map(|&x| x.max(0.0) / top).collect();
    let mut order: Vec<usize> = (0..e).collect();
    order.sort_by(|&a, &b| loads[b].total_cmp(&loads[a]));
    let mut tail: f64 = loads.iter().sum();
    let mut capped = 0usize;
    let mut c = k / tail;
    while capped < e && loads[order[capped]] * c > 1.0 {
        tail -= loads[order[capped]];
        capped += 1;
        c = (k - capped as f64) / tail.max(1e-300);
    }
    loads.iter().map(|&x| (x * c).min(1.0)).collect()
}

/// Co-selection counts of one MoE layer.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerPairs {
    /// Tokens observed.
    pub tokens: f64,
    /// `(a, b, count)` with `a < b`, sorted, each pair once.
    pub pairs: Vec<(u32, u32, f64)>,
}

impl LayerPairs {
    /// Merge raw `(a, b, count)` triples: order each pair, sum repeats, drop zero counts.
    pub fn from_raw(tokens: f64, raw: Vec<(u32, u32, f64)>) -> LayerPairs {
        let mut v: Vec<(u32, u32, f64)> = raw
            .into_iter()
            .map(|(a, b, c)| if a < b { (a, b, c) } else { (b, a, c) })
            .collect();
        v.sort_by_key(|&(a, b, _)| (a, b));
        let mut pairs: Vec<(u32, u32, f64)> = Vec::with_capacity(v.len());
        for (a, b, c) in v {
            match pairs.last_mut() {
                Some(last) if last.0 == a && last.1 == b => last.2 += c,
                _ => pairs.push((a, b, c)),
            }
        }
        pairs.retain(|p| p.2 > 0.0);
        LayerPairs { tokens, pairs }
    }

    /// Per-expert load implied by the pairs: `sum over b of count(a, b) / (k - 1)`.
    pub fn implied_load(&self, experts: usize, top_k: u32) -> Vec<f64> {
        let mut load = vec![0.0; experts];
        let div = (top_k.max(2) - 1) as f64;
        for &(a, b, c) in &self.pairs {
            load[a as usize] += c / div;
            load[b as usize] += c / div;
        }
        load
    }
}

/// Co-selection statistics for every MoE layer (indexed like [`ModelSpec::moe_layer_ids`]).
#[derive(Clone, Debug, PartialEq)]
pub struct CoSelection {
    experts: usize,
    layers: Vec<Option<LayerPairs>>,
    warnings: Vec<String>,
}

impl CoSelection {
    /// Build from per-layer pair counts (None = no data for that layer).
    pub fn new(model: &ModelSpec, layers: Vec<Option<LayerPairs>>) -> Result<CoSelection, String> {
        let ids = model.moe_layer_ids();
        if layers.len() != ids.len() {
            return Err(format!(
                "{} MoE layers expected, got {}",
                ids.len(),
                layers.len()
            ));
        }
        let e = model.routed_experts;
        for (li, l) in layers.iter().enumerate() {
            if let Some(l) = l {
                if !(l.tokens.is_finite() && l.tokens > 0.0) {
                    return Err(format!(
                        "layer {}: tokens must be a positive number",
                        ids[li]
                    ));
                }
                for &(a, b, c) in &l.pairs {
                    if a >= e || b >= e || a == b || !(c.is_finite() && c >= 0.0) {
                        return Err(format!("layer {}: bad pair ({a}, {b}, {c})", ids[li]));
                    }
                }
            }
        }
        Ok(CoSelection {
            experts: e as usize,
            layers,
            warnings: Vec::new(),
        })
    }

    /// Read a co-selection file (JSON or CSV, see the module doc).
    pub fn load(path: &Path, model: &ModelSpec) -> Result<CoSelection, StatsError> {
        let text = read(path)?;
        CoSelection::parse(path, &text, model)
    }

    /// Parse co-selection text; `path` picks the format and names the file in messages.
    pub fn parse(path: &Path, text: &str, model: &ModelSpec) -> Result<CoSelection, StatsError> {
        if is_json(path, text) {
            parse_cosel_json(path, text, model)
        } else {
            parse_cosel_csv(path, text, model)
        }
    }

    /// Pairs of the `li`-th MoE layer.
    pub fn layer(&self, li: usize) -> Option<&LayerPairs> {
        self.layers.get(li).and_then(Option::as_ref)
    }

    /// Remarks made while reading.
    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }

    /// The per-expert load implied by the pairs, as load statistics.
    pub fn implied_load(&self, model: &ModelSpec) -> LoadStats {
        let counts = self
            .layers
            .iter()
            .map(|l| {
                l.as_ref()
                    .map(|l| l.implied_load(self.experts, model.top_k))
            })
            .collect();
        LoadStats::new(model, counts).unwrap_or_else(|_| LoadStats {
            experts: self.experts,
            layers: vec![None; model.moe_layer_ids().len()],
            tokens: None,
            warnings: Vec::new(),
        })
    }

    /// The file as JSON (format 1, `kind = "co-selection"`).
    pub fn to_json(&self, model: &ModelSpec) -> String {
        let ids = model.moe_layer_ids();
        let mut out = format!(
            "{{\n  \"format\": {STATS_FORMAT},\n  \"kind\": \"{COSELECT_KIND}\",\n  \"model\": {},\n  \"layers\": [",
            json_string(&model.name)
        );
        let mut first = true;
        for (li, l) in self.layers.iter().enumerate() {
            let Some(l) = l else { continue };
            if !first {
                out.push(',');
            }
            first = false;
            let pairs: Vec<String> = l
                .pairs
                .iter()
                .map(|&(a, b, c)| format!("[{a}, {b}, {}]", json_number(c)))
                .collect();
            out.push_str(&format!(
                "\n    {{ \"layer\": {}, \"tokens\": {}, \"pairs\": [{}] }}",
                ids[li],
                json_number(l.tokens),
                pairs.join(", ")
            ));
        }
        out.push_str("\n  ]\n}\n");
        out
    }

    /// The file as CSV (`layer,expert_a,expert_b,tokens`). CSV carries no token totals; they
    /// are derived again on reading.
    pub fn to_csv(&self, model: &ModelSpec) -> String {
        let ids = model.moe_layer_ids();
        let mut out = String::from("layer,expert_a,expert_b,tokens\n");
        for (li, l) in self.layers.iter().enumerate() {
            let Some(l) = l else { continue };
            for &(a, b, c) in &l.pairs {
                out.push_str(&format!("{},{a},{b},{}\n", ids[li], json_number(c)));
            }
        }
        out
    }

    /// Write JSON (`.json`) or CSV (any other extension).
    pub fn write(&self, path: &Path, model: &ModelSpec) -> std::io::Result<()> {
        let text = if path.extension().is_some_and(|e| e == "json") {
            self.to_json(model)
        } else {
            self.to_csv(model)
        };
        let mut f = std::fs::File::create(path)?;
        f.write_all(text.as_bytes())?;
        f.sync_all()
    }
}

// ---------------------------------------------------------------------------------------------

fn read(path: &Path) -> Result<String, StatsError> {
    let bytes = expertmesh_topology::diag::read_capped(path).map_err(|source| StatsError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    String::from_utf8(bytes).map_err(|e| {
        StatsError::invalid(
            path,
            format!("byte {}", e.utf8_error().valid_up_to()),
            "the file is not UTF-8 text",
        )
    })
}

fn is_json(path: &Path, text: &str) -> bool {
    match path.extension().and_then(|e| e.to_str()) {
        Some("json") => true,
        Some("csv") => false,
        _ => text.trim_start().starts_with('{'),
    }
}

fn json_string(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// Integers without a fraction, others with enough digits to round-trip.
fn json_number(x: f64) -> String {
    if x.fract() == 0.0 && x.abs() < 9.0e15 {
        format!("{}", x as i64)
    } else {
        format!("{x}")
    }
}

fn check_counts(c: &[f64], experts: usize) -> Result<(), String> {
    if c.len() != experts {
        return Err(format!(
            "{} counts given, the model has {experts} routed experts; give one count per expert",
            c.len()
        ));
    }
    if let Some((e, x)) = c
        .iter()
        .enumerate()
        .find(|(_, x)| !(x.is_finite() && **x >= 0.0))
    {
        return Err(format!(
            "count of expert {e} is {x}; counts must be finite and non-negative"
        ));
    }
    Ok(())
}

/// Index of a model layer id among the MoE layers, or a message naming the valid ones.
fn moe_index(model: &ModelSpec, layer: i64) -> Result<usize, String> {
    let ids = model.moe_layer_ids();
    let (first, last) = (ids[0], ids[ids.len() - 1]);
    u32::try_from(layer)
        .ok()
        .and_then(|l| ids.binary_search(&l).ok())
        .ok_or_else(|| {
            format!(
                "layer {layer} is not a MoE layer of {} (MoE layers are {first}-{last}{})",
                model.name,
                if model.moe_layer_step > 1 {
                    format!(", every {}th", model.moe_layer_step)
                } else {
                    String::new()
                }
            )
        })
}

fn json_error(path: &Path, e: &serde_json::Error) -> StatsError {
    let msg = e.to_string();
    // serde_json appends " at line L column C"; keep the message and put the place in front.
    let msg = match msg.rfind(" at line ") {
        Some(i) => msg[..i].to_owned(),
        None => msg,
    };
    StatsError::invalid(
        path,
        format!("{}:{}", e.line(), e.column()),
        format!("{msg}; see the statistics format in `expertmesh plan --help`"),
    )
}

fn check_header(
    path: &Path,
    format: Option<i64>,
    kind: Option<&str>,
    want_kind: &str,
    model_name: Option<&str>,
    model: &ModelSpec,
) -> Result<(), StatsError> {
    if let Some(f) = format
        && f != STATS_FORMAT
    {
        return Err(StatsError::invalid(
            path,
            "",
            format!("unsupported format {f}; this build reads statistics format {STATS_FORMAT}"),
        ));
    }
    if let Some(k) = kind
        && k != want_kind
    {
        return Err(StatsError::invalid(
            path,
            "",
            format!(
                "this is a \"{k}\" file, but a \"{want_kind}\" file is expected here; pass it with the other option (--load for expert-load, --coselect for co-selection)"
            ),
        ));
    }
    if let Some(m) = model_name
        && m != model.name
    {
        return Err(StatsError::invalid(
            path,
            "",
            format!(
                "statistics are for model \"{m}\" but the model given is \"{}\"; use statistics recorded with this model",
                model.name
            ),
        ));
    }
    Ok(())
}

#[derive(Deserialize)]
struct RawLoadFile {
    format: Option<i64>,
    kind: Option<String>,
    model: Option<String>,
    tokens: Option<f64>,
    layers: Option<Vec<RawLoadLayer>>,
    logical_count: Option<serde_json::Value>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLoadLayer {
    layer: i64,
    counts: Vec<f64>,
}

fn parse_load_json(path: &Path, text: &str, model: &ModelSpec) -> Result<LoadStats, StatsError> {
    let raw: RawLoadFile = serde_json::from_str(text).map_err(|e| json_error(path, &e))?;
    check_header(
        path,
        raw.format,
        raw.kind.as_deref(),
        LOAD_KIND,
        raw.model.as_deref(),
        model,
    )?;
    let n = model.moe_layer_ids().len();
    let experts = model.routed_experts as usize;
    let mut counts: Vec<Option<Vec<f64>>> = vec![None; n];
    match (raw.layers, raw.logical_count) {
        (Some(layers), None) => {
            for (i, l) in layers.into_iter().enumerate() {
                let at = format!("layers[{i}] (layer {})", l.layer);
                let li =
                    moe_index(model, l.layer).map_err(|m| StatsError::invalid(path, &at, m))?;
                if counts[li].is_some() {
                    return Err(StatsError::invalid(
                        path,
                        &at,
                        "this layer is listed twice; give each layer once",
                    ));
                }
                check_counts(&l.counts, experts).map_err(|m| StatsError::invalid(path, &at, m))?;
                counts[li] = Some(l.counts);
            }
        }
        (None, Some(lc)) => counts = logical_count_rows(path, &lc, model)?,
        (Some(_), Some(_)) => {
            return Err(StatsError::invalid(
                path,
                "",
                "both `layers` and `logical_count` are present; keep one",
            ));
        }
        (None, None) => {
            return Err(StatsError::invalid(
                path,
                "",
                "no `layers` array (expertmesh format) and no `logical_count` array (SGLang); add one",
            ));
        }
    }
    if let Some(t) = raw.tokens
        && !(t.is_finite() && t >= 0.0)
    {
        return Err(StatsError::invalid(
            path,
            "tokens",
            "must be a non-negative number",
        ));
    }
    let mut s = LoadStats::new(model, counts).map_err(|m| StatsError::invalid(path, "", m))?;
    s.tokens = raw.tokens;
    Ok(s)
}

/// SGLang `logical_count`: `[layers][experts]` or `[passes][layers][experts]`.
fn logical_count_rows(
    path: &Path,
    v: &serde_json::Value,
    model: &ModelSpec,
) -> Result<Vec<Option<Vec<f64>>>, StatsError> {
    let bad = |m: String| StatsError::invalid(path, "logical_count", m);
    let as_matrix = |v: &serde_json::Value| -> Result<Vec<Vec<f64>>, StatsError> {
        let rows = v
            .as_array()
            .ok_or_else(|| bad("expected an array of per-layer arrays".into()))?;
        rows.iter()
            .enumerate()
            .map(|(r, row)| {
                row.as_array()
                    .ok_or_else(|| bad(format!("row {r} is not an array of numbers")))?
                    .iter()
                    .enumerate()
                    .map(|(e, x)| {
                        x.as_f64()
                            .ok_or_else(|| bad(format!("row {r} entry {e} is not a number")))
                    })
                    .collect()
            })
            .collect()
    };
    let top = v
        .as_array()
        .ok_or_else(|| bad("expected an array".into()))?;
    let is_3d = top
        .first()
        .and_then(|r| r.as_array())
        .and_then(|r| r.first())
        .is_some_and(|x| x.is_array());
    let matrix = if is_3d {
        let mut sum: Option<Vec<Vec<f64>>> = None;
        for pass in top {
            let m = as_matrix(pass)?;
            match &mut sum {
                None => sum = Some(m),
                Some(s) => {
                    if s.len() != m.len() || s.iter().zip(&m).any(|(a, b)| a.len() != b.len()) {
                        return Err(bad("passes have different shapes".into()));
                    }
                    for (a, b) in s.iter_mut().zip(&m) {
                        for (x, y) in a.iter_mut().zip(b) {
                            *x += y;
                        }
                    }
                }
            }
        }
        sum.unwrap_or_default()
    } else {
        as_matrix(v)?
    };
    let ids = model.moe_layer_ids();
    let rows_are_all_layers = matrix.len() == model.num_layers as usize;
    if !rows_are_all_layers && matrix.len() != ids.len() {
        return Err(bad(format!(
            "{} rows; expected one per layer ({}) or one per MoE layer ({})",
            matrix.len(),
            model.num_layers,
            ids.len()
        )));
    }
    let mut out = vec![None; ids.len()];
    for (li, &id) in ids.iter().enumerate() {
        let row = if rows_are_all_layers {
            &matrix[id as usize]
        } else {
            &matrix[li]
        };
        check_counts(row, model.routed_experts as usize)
            .map_err(|m| bad(format!("layer {id}: {m}")))?;
        out[li] = Some(row.clone());
    }
    Ok(out)
}

/// CSV lines: (line number, fields), comments and blank lines skipped, header checked.
fn csv_rows<'a>(
    path: &Path,
    text: &'a str,
    header: &[&str],
) -> Result<Vec<(usize, Vec<&'a str>)>, StatsError> {
    let mut rows = Vec::new();
    let mut saw_header = false;
    for (i, line) in text.lines().enumerate() {
        let line_no = i + 1;
        let t = line.trim();
        if t.is_empty() || t.starts_with('#') {
            continue;
        }
        let fields: Vec<&str> = t.split(',').map(str::trim).collect();
        if !saw_header {
            let ok = fields.len() == header.len()
                && fields
                    .iter()
                    .zip(header)
                    .all(|(a, b)| a.eq_ignore_ascii_case(b));
            if !ok {
                return Err(StatsError::invalid(
                    path,
                    format!("{line_no}:1"),
                    format!(
                        "expected the header line `{}`, found `{t}`",
                        header.join(",")
                    ),
                ));
            }
            saw_header = true;
            continue;
        }
        if fields.len() != header.len() {
            return Err(StatsError::invalid(
                path,
                format!("{line_no}:1"),
                format!(
                    "{} fields, expected {} ({})",
                    fields.len(),
                    header.len(),
                    header.join(",")
                ),
            ));
        }
        rows.push((line_no, fields));
    }
    if !saw_header {
        return Err(StatsError::invalid(
            path,
            "",
            format!(
                "the file is empty; it needs the header line `{}` and data rows",
                header.join(",")
            ),
        ));
    }
    Ok(rows)
}

/// 1-based column of `field`, a slice of `line` (both borrow the file's text), in bytes.
fn column_of(line: &str, field: &str) -> usize {
    let start = line.as_ptr() as usize;
    let at = field.as_ptr() as usize;
    if at >= start && at <= start + line.len() {
        at - start + 1
    } else {
        line.find(field).map_or(1, |p| p + 1)
    }
}

fn csv_int(
    path: &Path,
    text_line: &str,
    line_no: usize,
    field: &str,
    what: &str,
) -> Result<i64, StatsError> {
    field.parse::<i64>().map_err(|_| {
        StatsError::invalid(
            path,
            format!("{line_no}:{}", column_of(text_line, field)),
            format!("{what} \"{field}\" is not an integer"),
        )
    })
}

fn csv_count(path: &Path, text_line: &str, line_no: usize, field: &str) -> Result<f64, StatsError> {
    match field.parse::<f64>() {
        Ok(x) if x.is_finite() && x >= 0.0 => Ok(x),
        _ => Err(StatsError::invalid(
            path,
            format!("{line_no}:{}", column_of(text_line, field)),
            format!("tokens \"{field}\" must be a finite non-negative number"),
        )),
    }
}

fn parse_load_csv(path: &Path, text: &str, model: &ModelSpec) -> Result<LoadStats, StatsError> {
    let lines: Vec<&str> = text.lines().collect();
    let rows = csv_rows(path, text, &["layer", "expert", "tokens"])?;
    let experts = model.routed_experts as usize;
    let mut counts: Vec<Option<Vec<f64>>> = vec![None; model.moe_layer_ids().len()];
    for (line_no, f) in rows {
        let line = lines[line_no - 1];
        let layer = csv_int(path, line, line_no, f[0], "layer")?;
        let li = moe_index(model, layer).map_err(|m| {
            StatsError::invalid(path, format!("{line_no}:{}", column_of(line, f[0])), m)
        })?;
        let e = csv_int(path, line, line_no, f[1], "expert")?;
        if e < 0 || e as usize >= experts {
            return Err(StatsError::invalid(
                path,
                format!("{line_no}:{}", column_of(line, f[1])),
                format!(
                    "expert {e} does not exist ({} has experts 0-{})",
                    model.name,
                    experts - 1
                ),
            ));
        }
        let x = csv_count(path, line, line_no, f[2])?;
        counts[li].get_or_insert_with(|| vec![0.0; experts])[e as usize] += x;
    }
    LoadStats::new(model, counts).map_err(|m| StatsError::invalid(path, "", m))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCoselFile {
    format: Option<i64>,
    kind: Option<String>,
    model: Option<String>,
    tokens: Option<f64>,
    layers: Vec<RawCoselLayer>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCoselLayer {
    layer: i64,
    tokens: Option<f64>,
    pairs: Vec<(u32, u32, f64)>,
}

fn derive_tokens(pairs: &[(u32, u32, f64)], top_k: u32) -> f64 {
    let per_token = (top_k as f64) * (top_k as f64 - 1.0) / 2.0;
    let total: f64 = pairs.iter().map(|p| p.2).sum();
    if per_token > 0.0 {
        total / per_token
    } else {
        0.0
    }
}

fn finish_layer(
    path: &Path,
    at: &str,
    tokens: Option<f64>,
    raw: Vec<(u32, u32, f64)>,
    model: &ModelSpec,
) -> Result<LayerPairs, StatsError> {
    let e = model.routed_experts;
    for (i, &(a, b, c)) in raw.iter().enumerate() {
        let bad = |m: String| StatsError::invalid(path, format!("{at} pair {i}"), m);
        if a >= e || b >= e {
            return Err(bad(format!(
                "expert {} does not exist ({} has experts 0-{})",
                a.max(b),
                model.name,
                e - 1
            )));
        }
        if a == b {
            return Err(bad(format!(
                "pairs join two different experts; ({a}, {b}) names one"
            )));
        }
        if !(c.is_finite() && c >= 0.0) {
            return Err(bad(format!(
                "count {c} must be a finite non-negative number"
            )));
        }
    }
    let mut lp = LayerPairs::from_raw(0.0, raw);
    let t = match tokens {
        Some(t) if t.is_finite() && t > 0.0 => t,
        Some(t) => {
            return Err(StatsError::invalid(
                path,
                at,
                format!("tokens {t} must be a positive number"),
            ));
        }
        None => derive_tokens(&lp.pairs, model.top_k),
    };
    lp.tokens = t;
    Ok(lp)
}

fn parse_cosel_json(path: &Path, text: &str, model: &ModelSpec) -> Result<CoSelection, StatsError> {
    let raw: RawCoselFile = serde_json::from_str(text).map_err(|e| json_error(path, &e))?;
    check_header(
        path,
        raw.format,
        raw.kind.as_deref(),
        COSELECT_KIND,
        raw.model.as_deref(),
        model,
    )?;
    let mut layers: Vec<Option<LayerPairs>> = vec![None; model.moe_layer_ids().len()];
    for (i, l) in raw.layers.into_iter().enumerate() {
        let at = format!("layers[{i}] (layer {})", l.layer);
        let li = moe_index(model, l.layer).map_err(|m| StatsError::invalid(path, &at, m))?;
        if layers[li].is_some() {
            return Err(StatsError::invalid(
                path,
                &at,
                "this layer is listed twice; give each layer once",
            ));
        }
        let lp = finish_layer(path, &at, l.tokens.or(raw.tokens), l.pairs, model)?;
        layers[li] = (!lp.pairs.is_empty()).then_some(lp);
    }
    finish_cosel(path, model, layers)
}

fn parse_cosel_csv(path: &Path, text: &str, model: &ModelSpec) -> Result<CoSelection, StatsError> {
    let lines: Vec<&str> = text.lines().collect();
    let rows = csv_rows(path, text, &["layer", "expert_a", "expert_b", "tokens"])?;
    let n = model.moe_layer_ids().len();
    let mut raw: Vec<Vec<(u32, u32, f64)>> = vec![Vec::new(); n];
    let e = model.routed_experts as i64;
    for (line_no, f) in rows {
        let line = lines[line_no - 1];
        let layer = csv_int(path, line, line_no, f[0], "layer")?;
        let li = moe_index(model, layer).map_err(|m| {
            StatsError::invalid(path, format!("{line_no}:{}", column_of(line, f[0])), m)
        })?;
        let mut ab = [0u32; 2];
        for (k, field) in [f[1], f[2]].into_iter().enumerate() {
            let x = csv_int(path, line, line_no, field, "expert")?;
            if x < 0 || x >= e {
                return Err(StatsError::invalid(
                    path,
                    format!("{line_no}:{}", column_of(line, field)),
                    format!(
                        "expert {x} does not exist ({} has experts 0-{})",
                        model.name,
                        e - 1
                    ),
                ));
            }
            ab[k] = x as u32;
        }
        if ab[0] == ab[1] {
            return Err(StatsError::invalid(
                path,
                format!("{line_no}:1"),
                "a pair joins two different experts; expert_a equals expert_b",
            ));
        }
        let c = csv_count(path, line, line_no, f[3])?;
        raw[li].push((ab[0], ab[1], c));
    }
    let ids = model.moe_layer_ids();
    let mut layers = Vec::with_capacity(n);
    for (li, r) in raw.into_iter().enumerate() {
        if r.is_empty() {
            layers.push(None);
        } else {
            let lp = finish_layer(path, &format!("layer {}", ids[li]), None, r, model)?;
            layers.push((!lp.pairs.is_empty()).then_some(lp));
        }
    }
    finish_cosel(path, model, layers)
}

fn finish_cosel(
    path: &Path,
    model: &ModelSpec,
    layers: Vec<Option<LayerPairs>>,
) -> Result<CoSelection, StatsError> {
    if model.top_k < 2 {
        return Err(StatsError::invalid(
            path,
            "",
            format!(
                "{} chooses one expert per token (top-1); co-selection needs top-k with k >= 2",
                model.name
            ),
        ));
    }
    let ids = model.moe_layer_ids();
    let missing: Vec<u32> = layers
        .iter()
        .enumerate()
        .filter(|(_, l)| l.is_none())
        .map(|(li, _)| ids[li])
        .collect();
    let mut c = CoSelection::new(model, layers).map_err(|m| StatsError::invalid(path, "", m))?;
    if missing.len() == ids.len() {
        return Err(StatsError::invalid(
            path,
            "",
            "no co-selection pairs with a non-zero count; nothing to plan with",
        ));
    }
    if !missing.is_empty() {
        c.warnings.push(format!(
            "no co-selection data for layer{} {}",
            if missing.len() == 1 { "" } else { "s" },
            expertmesh_topology::ranges::format_list(&missing)
        ));
    }
    Ok(c)
}

#[cfg(test)]
mod tests {
    use super::*;
    use expertmesh_topology::model::preset_by_name;

    fn toy() -> ModelSpec {
        preset_by_name("toy-grouped").unwrap() // layers 1-2 MoE, 16 experts, top-4
    }

    fn tmp(name: &str, text: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("em-stats-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    }

    #[test]
    fn load_csv_and_json_agree_and_round_trip() {
        let m = toy();
        let mut csv = String::from("# window 1\nlayer,expert,tokens\n");
        for e in 0..16 {
            csv.push_str(&format!("1,{e},{}\n", 100 - e));
        }
        csv.push_str("2,3,7\n2,3,5\n");
        let a = LoadStats::load(&tmp("a.csv", &csv), &m).unwrap();
        assert_eq!(a.layer(0).unwrap()[15], 85.0);
        assert_eq!(a.layer(1).unwrap()[3], 12.0, "repeated rows add up");
        assert_eq!(a.layer(1).unwrap()[4], 0.0);
        let b = LoadStats::load(&tmp("b.json", &a.to_json(&m)), &m).unwrap();
        assert_eq!(a.layers, b.layers);
        let c = LoadStats::load(&tmp("c.csv", &b.to_csv(&m)), &m).unwrap();
        assert_eq!(a.layers, c.layers);
    }

    #[test]
    fn atomic_write_replaces_the_file_whole() {
        let m = toy();
        let dir = std::env::temp_dir().join(format!("em-stats-atomic-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for name in ["live.json", "live.csv"] {
            let p = dir.join(name);
            let mut c = vec![0.0; 16];
            c[5] = 40.0;
            let s = LoadStats::new(&m, vec![Some(c), None])
                .unwrap()
                .with_tokens(10.0);
            s.write_atomic(&p, &m).unwrap();
            let first = LoadStats::load(&p, &m).unwrap();
            assert_eq!(first.layer(0).unwrap()[5], 40.0);
            let s2 = LoadStats::new(&m, vec![Some(vec![1.0; 16]), None]).unwrap();
            s2.write_atomic(&p, &m).unwrap();
            assert_eq!(LoadStats::load(&p, &m).unwrap().layer(0).unwrap()[5], 1.0);
        }
        let left: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.contains(".tmp-"))
            .collect();
        assert!(left.is_empty(), "temporary files left: {left:?}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn sglang_logical_count_rows_by_layer() {
        let m = toy(); // 3 layers, MoE layers 1 and 2
        let row = |v: f64| format!("[{}]", vec![v.to_string(); 16].join(","));
        let all = format!(
            "{{\"logical_count\": [{}, {}, {}]}}",
            row(0.0),
            row(1.0),
            row(2.0)
        );
        let s = LoadStats::load(&tmp("l.json", &all), &m).unwrap();
        assert_eq!(s.layer(0).unwrap()[0], 1.0);
        assert_eq!(s.layer(1).unwrap()[0], 2.0);
        let passes = format!(
            "{{\"logical_count\": [[{}, {}], [{}, {}]]}}",
            row(1.0),
            row(2.0),
            row(3.0),
            row(4.0)
        );
        let s = LoadStats::load(&tmp("p.json", &passes), &m).unwrap();
        assert_eq!(s.layer(0).unwrap()[0], 4.0);
        assert_eq!(s.layer(1).unwrap()[0], 6.0);
    }

    #[test]
    fn bad_load_files_name_the_place() {
        let m = toy();
        let cases: &[(&str, &str, &str)] = &[
            ("x.csv", "layer,expert,tokens\n1,16,5\n", "2:3"),
            ("x.csv", "layer,expert,tokens\n0,1,5\n", "not a MoE layer"),
            ("x.csv", "layer,expert,tokens\n1,1,-5\n", "2:5"),
            ("x.csv", "layer,expert,tokens\n1, 1,x\n", "2:6"),
            ("x.csv", "layer,expert,tokens\n1,1,NaN\n", "non-negative"),
            ("x.csv", "layer,expert\n1,1\n", "header"),
            ("x.csv", "", "empty"),
            ("x.csv", "layer,expert,tokens\n1,1\n", "2 fields"),
            (
                "x.json",
                "{\"layers\": [{\"layer\": 1, \"counts\": [1]}]}",
                "1 counts",
            ),
            (
                "x.json",
                "{\"layers\": [{\"layer\": 1, \"counts\": [1,",
                "1:",
            ),
            (
                "x.json",
                "{\"kind\": \"co-selection\", \"layers\": []}",
                "--coselect",
            ),
            (
                "x.json",
                "{\"model\": \"other\", \"layers\": []}",
                "\"other\"",
            ),
            ("x.json", "{}", "no `layers`"),
            ("x.json", "[1, 2]", "invalid type"),
            ("x.json", "{\"logical_count\": [[1]]}", "rows"),
        ];
        for (name, text, want) in cases {
            let e = LoadStats::load(&tmp(name, text), &m).unwrap_err();
            let s = e.to_string();
            assert!(s.contains(want), "{text:?}: {s}");
        }
        let e = LoadStats::load(Path::new("/nonexistent/x.csv"), &m).unwrap_err();
        assert!(matches!(e, StatsError::Io { .. }));
    }

    #[test]
    fn coselection_csv_json_and_derived_tokens() {
        let m = toy(); // top-4: 6 pairs per token
        let csv = "layer,expert_a,expert_b,tokens\n1,0,1,6\n1,1,0,6\n1,2,3,12\n2,5,4,3\n2,4,5,3\n";
        let c = CoSelection::load(&tmp("c.csv", csv), &m).unwrap();
        let l = c.layer(0).unwrap();
        assert_eq!(l.pairs, vec![(0, 1, 12.0), (2, 3, 12.0)]);
        assert!(
            (l.tokens - 4.0).abs() < 1e-12,
            "24 pair counts / 6 = 4 tokens"
        );
        let d = CoSelection::load(&tmp("d.json", &c.to_json(&m)), &m).unwrap();
        assert_eq!(c.layers, d.layers);
        let load = c.implied_load(&m);
        assert_eq!(load.layer(0).unwrap()[0], 4.0);
        for (text, want) in [
            ("layer,expert_a,expert_b,tokens\n1,3,3,1\n", "different"),
            ("layer,expert_a,expert_b,tokens\n1,3,99,1\n", "2:5"),
            ("layer,expert_a,expert_b,tokens\n", "no co-selection pairs"),
        ] {
            let e = CoSelection::load(&tmp("e.csv", text), &m).unwrap_err();
            assert!(e.to_string().contains(want), "{text:?}: {e}");
        }
        let e = CoSelection::load(
            &tmp(
                "f.json",
                "{\"layers\": [{\"layer\": 1, \"pairs\": [[0, 1, -2]]}]}",
            ),
            &m,
        )
        .unwrap_err();
        assert!(e.to_string().contains("non-negative"), "{e}");
    }
}
