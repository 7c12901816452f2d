//! The checkpoint crate's integration tests, one binary: safetensors, `config.json` mapping, expert
//! reading and the lossless INT4 imports.

mod experts;
mod gptq_import;
mod hf_config;
mod packed_import;
mod safetensors;
mod support;
