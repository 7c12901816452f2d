//! Fuzz the topology file reader: any bytes give a topology or a list of problems, never a panic.
//! Run: `EXPERTMESH_RESOLVE_HOSTS=0 cargo +nightly fuzz run topology_file -- -max_total_time=60`
//! (seed: `examples/*.toml`); the variable keeps mutated host names away from the resolver.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        if let Err(problems) = expertmesh_topology::Topology::from_toml_str(text) {
            assert!(!problems.is_empty());
        }
    }
});
