//! Fuzz the placement reader against a real topology and model (the single-host example and
//! `demo-small`): any bytes give a placement or a list of problems, never a panic; a placement
//! that validates survives a write/read round trip unchanged.
//! Run: `cargo +nightly fuzz run placement_file -- -max_total_time=60`.
#![no_main]

use expertmesh_topology::model::preset_by_name;
use expertmesh_topology::{Placement, Topology};
use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;

fn topology() -> &'static Topology {
    static T: OnceLock<Topology> = OnceLock::new();
    T.get_or_init(|| {
        Topology::from_toml_str(include_str!("../../examples/single-host.toml"))
            .expect("the example topology is valid")
    })
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let model = preset_by_name("demo-small").expect("preset");
    match Placement::from_toml_str(text, topology(), &model) {
        Ok(p) => {
            let back = Placement::from_toml_str(&p.to_toml_string(), topology(), &model)
                .expect("a written placement reads back");
            assert_eq!(back, p);
        }
        Err(problems) => assert!(!problems.is_empty()),
    }
});
