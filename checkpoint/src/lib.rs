//! Hugging Face checkpoints: what a checkpoint folder says about its model, and its tensors.
//!
//! Why this crate exists: serving a real model starts from a checkpoint folder (`config.json`
//! plus `*.safetensors`). This crate reads both, bounded and validated, so that the model file
//! (`expertmesh models --from-hf DIR`) and, later, the converter to packed INT4 shards
//! (`expertmesh convert`) are built on one reader. It depends only on the numbers (`quant`) and
//! the model description (`topology`); it does no network I/O.
//!
//! * [`safetensors`] — the safetensors format: header, tensors, multi-file index; mmap.
//! * [`hf_config`] — `config.json` of each supported MoE family → a [`ModelSpec`].
//! * [`convert`] — `expertmesh convert`: checkpoint → one packed shard per device, a router
//!   file and a manifest (bounded memory, parallel, resumable, atomic).
//! * [`experts`] — one checkpoint expert (any family, BF16/F16/F32/FP8) → packed INT4 weights.
//! * [`packed_import`] — a compressed-tensors `pack-quantized` INT4 expert → packed INT4 weights,
//!   losslessly (codes and scale bits copied, no requantization).
//! * [`gptq_import`] — a GPTQ (v1/v2) or AWQ (GEMM) INT4 expert → packed INT4 weights, losslessly
//!   (codes, zero points and scale bits copied; act-order checkpoints refused).
//!
//! [`ModelSpec`]: expertmesh_topology::ModelSpec

pub mod convert;
pub mod experts;
pub mod gptq_import;
pub mod hf_config;
pub mod packed_import;
pub mod safetensors;
