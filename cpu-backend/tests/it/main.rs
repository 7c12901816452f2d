//! The CPU backend's integration tests, one binary: results against the scalar reference on every
//! ISA this machine has, streaming loads, and the tile cache.

mod amx;
mod cpu_backend;
mod load_from;
mod tile_cache;

/// Say something on the real stderr (the test harness captures `print!` of passing tests), so
/// whether a hardware path (AMX, AVX-512) ran shows in every run, never as a silent pass.
pub(crate) fn say(what: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{what}");
}
