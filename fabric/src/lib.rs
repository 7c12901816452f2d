//! The `expertmesh` command line: every command, the local cluster launcher, the demo and the
//! benches.
//!
//! Why this crate exists: it is the binary's edge. It composes the files (topology, planner),
//! the router and the worker into running processes and reports; errors become `anyhow` and
//! exit codes here and nowhere below. The `expertmesh` binary is a thin `main` over [`cli`].

pub mod bench_cli;
pub mod bench_cluster;
pub mod bench_compare;
pub mod bench_convert;
pub mod bench_fabric;
pub mod bench_json;
pub mod bench_kernels;
pub mod bench_machine;
pub mod bench_overload;
pub mod bench_report;
pub mod bench_roofline;
pub mod bench_soak;
pub mod bench_stats;
pub mod bench_transport;
pub mod cli;
pub mod cmd_fabric;
pub mod convert_cmd;
pub mod demo;
pub mod keys_cmd;
pub mod local;
pub mod models_cmd;
pub mod npy;
pub mod observe;
pub mod plan_cmd;
pub mod plan_default;
mod table;
pub mod validate_cmd;
pub mod wire_bytes;
