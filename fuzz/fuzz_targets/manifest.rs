//! Fuzz the weights folder's `manifest.json` reader: any bytes give a manifest (every file it
//! names inside the folder) or an error, never a panic; a manifest that parses writes back to
//! JSON that parses to the same manifest.
//! Run: `cargo +nightly fuzz run manifest seeds/manifest -- -max_total_time=60`.
#![no_main]

use expertmesh_shard::manifest::{Manifest, check_file_name};
use libfuzzer_sys::fuzz_target;
use std::path::Path;

fuzz_target!(|data: &[u8]| {
    let path = Path::new("fuzz/manifest.json");
    if let Ok(m) = Manifest::parse(data, path) {
        for name in [&m.model_file, &m.placement_file, &m.router.file]
            .into_iter()
            .chain(m.shards.iter().map(|s| &s.file))
        {
            assert!(check_file_name(name).is_ok(), "{name:?} accepted");
        }
        let text = serde_json::to_vec(&m).expect("a manifest serializes");
        let again = Manifest::parse(&text, path).expect("a written manifest reads back");
        assert_eq!(again, m);
    }
});
