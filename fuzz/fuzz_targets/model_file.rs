//! Fuzz the model file reader: any bytes give a model or a list of problems, never a panic.
//! Run: `cargo +nightly fuzz run model_file -- -max_total_time=60`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        if let Err(problems) = expertmesh_topology::model_file::model_from_toml_str(text) {
            assert!(!problems.is_empty());
        }
    }
});
