//! Every `expertmesh bench` target as a library, and the measurement method they share.
//!
//! Why this crate exists: a hardware evaluator's figures must mean the same thing in every
//! bench, so the method lives once ([`method`]: the machine description, roofline limits
//! measured in the same run, interleaved repetitions and their statistics, the JSON format, the
//! HTML report, run-to-run comparison), and each target is a library function that takes plain
//! options and returns a report. The `expertmesh` binary parses the command line and calls
//! them; the integration tests that need a soak cluster or a load generator import them from
//! here. Targets: [`kernels`] (expert FFN kernels against memory bandwidth and the int8 peak),
//! [`transport`] (frames over TCP and shared memory against raw sockets and memcpy),
//! [`fabric`] (one MoE layer through a local fabric against the same layer in-process),
//! [`convert`] (checkpoint conversion and shard loads against a raw read), [`overload`]
//! (pipelined clients past the router's limits), [`cluster`] (an emulated multi-node cluster in
//! network namespaces against the planner's prediction) and [`soak`] (faults under checked
//! load). The criterion benches are in `benches/benches/`.

pub mod cluster;
pub mod convert;
pub mod error;
pub mod fabric;
pub mod kernels;
pub mod method;
pub mod overload;
pub mod rebalance;
pub mod soak;
pub mod transport;

pub use error::BenchError;
