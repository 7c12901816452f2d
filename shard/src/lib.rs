//! Converted weights on disk: one packed-INT4 shard file per device, one router file, and the
//! manifest that ties them to a model and a placement.
//!
//! Why this crate exists: `expertmesh convert` writes these files once and every serving
//! process (`up`, `router`, `worker` with `--weights`) reads only its own part of them. Writer
//! and reader live together so the format is defined in one place; the crate depends only on
//! the packed format (`quant`), so the worker can load shards without the checkpoint reader.
//!
//! * [`file`](mod@file) — the shard format: atomic streaming writer, bounds-checked mmap reader.
//! * [`manifest`] — `manifest.json`: files, checksums, source hashes, per-layer error.
//!
//! Temporary files are held locked while written (`expertmesh_files`), so a sweep of what
//! killed writers left never removes a live one.

pub mod file;
pub mod manifest;

pub use file::{ShardError, ShardFile, ShardIndex, ShardKind, ShardSummary, ShardWriter};
pub use manifest::{Manifest, ManifestError};

/// The name of device `rank`'s shard in a weights folder.
pub fn device_shard_name(rank: u32) -> String {
    format!("device-{rank:04}.emshard")
}

/// The router file's name in a weights folder.
pub const ROUTER_SHARD_NAME: &str = "router.emshard";

/// Name of the router's gate weight tensor `[experts, hidden]` of `layer`.
pub fn gate_weight_name(layer: u32) -> String {
    format!("layers.{layer}.gate.weight")
}

/// Name of the router's selection-bias tensor `[experts]` of `layer` (zeros for families
/// without one).
pub fn gate_bias_name(layer: u32) -> String {
    format!("layers.{layer}.gate.bias")
}

/// Name of the shared experts' per-token gate `[hidden]` of `layer` (Qwen2-MoE's
/// `shared_expert_gate`).
pub fn shared_gate_name(layer: u32) -> String {
    format!("layers.{layer}.shared_gate.weight")
}

/// Names of shared expert `index` of `layer` kept dense at the checkpoint's precision in the
/// router file: `[gate [F, H], up [F, H], down [H, F]]`.
pub fn shared_dense_names(layer: u32, index: u32) -> [String; 3] {
    ["gate", "up", "down"].map(|p| format!("layers.{layer}.shared.{index}.{p}"))
}
