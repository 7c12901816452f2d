//! Cluster topology, model and placement files: parse, validate, account bytes.
//!
//! Why this crate exists: a cluster builder describes machines, devices and NICs in a topology
//! file, picks a model (a preset or a model file), and assigns experts to devices in a placement
//! file. Everything downstream (the planner, the router, the workers) consumes the validated
//! types from here and never re-reads or re-checks the files. This crate does no network I/O:
//! it only asks the system resolver what a topology's hostnames stand for (to find two listeners
//! on one socket), and never sends anything to the hosts.
//!
//! Every reader reports all problems of a file in one run ([`Problem`]: line:column where known,
//! the item, what to change); see [`diag`] for how.

pub mod diag;
pub mod model;
pub mod model_file;
pub mod placement;
pub mod ranges;
pub mod topology;
pub mod units;

pub use diag::{FileError, Location, Problem};
pub use model::ModelSpec;
pub use model_file::{ResolveError, load_model, resolve_model};
pub use placement::{DeviceUsage, Placement, PlacementFile, SharedLocation};
pub use topology::{Device, DeviceKind, DeviceRank, Node, Topology};
