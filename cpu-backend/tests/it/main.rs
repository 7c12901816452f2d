//! The CPU backend's integration tests, one binary: results against the scalar reference on every
//! ISA this machine has, streaming loads, and the tile cache.

mod amx;
mod cpu_backend;
mod load_from;
mod tile_cache;
