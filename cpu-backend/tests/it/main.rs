//! The CPU backend's integration tests, one binary: results against the scalar reference on every
//! ISA this machine has, and streaming loads.

mod amx;
mod cpu_backend;
mod load_from;
