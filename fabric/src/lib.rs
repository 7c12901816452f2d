//! A fabric's processes on one host: the launcher (`LocalFabric`: router services in this
//! process, one worker process per device, supervised and shut down cleanly), child processes
//! and signals, per-process credentials, metrics endpoints and the live load file, the default
//! files and placement, and the fabric's wire as the planner models it; and the files that
//! run the same processes on many hosts under a cluster engine (`engines`: Slurm,
//! Kubernetes, systemd).
//!
//! Why this crate exists: `expertmesh up`, the demo, every `expertmesh bench` that starts a
//! fabric and the integration tests all need the same running fabric; none of them should
//! reach into a command module for it. It composes the libraries below it (deployment, worker,
//! router service, transport) into processes. No command-line parsing lives here (that is the
//! `expertmesh` binary's), and no measurement method (that is `expertmesh-benches`').

pub mod auto_rebalance;
pub mod credentials;
pub mod defaults;
pub mod endpoint;
pub mod engines;
pub mod error;
pub mod local;
pub mod observe;
pub mod process;
pub mod wire_model;

pub use error::FabricError;
