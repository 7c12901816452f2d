//! The `expertmesh` package's integration tests, in one binary: the commands, real fabrics of
//! real processes (router, workers) over real sockets and shared memory, faults, security,
//! checkpoints converted and served, and the benches' command line.
//!
//! Why one binary: each test file used to be its own binary linking the whole stack (50 of
//! them across the workspace filled CI's disk once and took most of a cold `cargo test`'s
//! time to link). Every former file is a module here; what several share is in [`support`]
//! and [`hf_support`]. Tests start the `expertmesh` binary cargo built for this package
//! (`CARGO_BIN_EXE_expertmesh`); the ones that need root (network namespaces, iptables) say
//! "skipped" and why when they cannot run.

mod hf_support;
mod support;

mod bench_cli;
mod bench_convert;
mod cli_friction;
mod client_failover;
mod client_pipelining;
mod convert_bad_input;
mod convert_serve;
mod credentials;
mod deploy_engines;
mod emulated_cluster;
mod fabric;
mod faults;
mod hf_support_check;
#[cfg(feature = "hip")]
mod hip_standin;
mod main_job;
mod metrics;
mod models_from_hf;
mod multi_router;
mod node_fanout;
mod overload;
mod plan_cli;
mod rebalance;
mod rejoin_identity;
mod security;
mod validate_examples;
mod validate_holes;
mod wedged_router;
mod wire_modes_e2e;
