//! The `expertmesh` binary's library: the command line and one module per command.
//!
//! Why this exists: it is the binary's edge, the only place with `clap` and `anyhow`. Each
//! command ([`cmd`]) turns arguments into the options of a library below it (the launcher in
//! `expertmesh-fabric`, the benches in `expertmesh-benches`, the planner, the converter, the
//! router client) and the outcome into an exit code ([`exit`]). It is a library as well as a
//! binary so that the integration tests and the fuzz targets can reach [`npy`], the one file
//! format this crate parses itself.

mod args;
pub mod cli;
mod cmd;
pub mod exit;
pub mod npy;
mod table;
