//! The fabric: expert workers, the local cluster launcher, and the CLI wiring.
//!
//! Why this crate exists: it composes topology, kernels, transport and router into running
//! processes. The `expertmesh` binary is a thin `main` over [`cli`].

pub mod bench_cli;
pub mod bench_fabric;
pub mod bench_json;
pub mod bench_kernels;
pub mod bench_transport;
pub mod cli;
pub mod cmd_fabric;
pub mod demo;
pub mod deploy;
pub mod local;
pub mod models_cmd;
pub mod npy;
pub mod plan_cmd;
pub mod plan_default;
mod table;
pub mod validate_cmd;
pub mod worker;
