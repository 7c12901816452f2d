//! The fabric: expert workers, the local cluster launcher, and the CLI wiring.
//!
//! Why this crate exists: it composes topology, kernels, transport and router into running
//! processes. The `expertmesh` binary is a thin `main` over [`cli`].

pub mod bench_json;
pub mod bench_kernels;
pub mod cli;
pub mod models_cmd;
pub mod plan_cmd;
mod table;
pub mod validate_cmd;
