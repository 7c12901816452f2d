//! Cluster topology, model and placement files: parse, validate, account bytes.
//!
//! Why this crate exists: a cluster builder describes machines, devices and NICs in a topology
//! file, picks a model (a preset or a model file), and assigns experts to devices in a placement
//! file. Everything downstream (the planner, the router, the workers) consumes the validated
//! types from here and never re-reads or re-checks the files. This crate does no network I/O.

pub mod model;
