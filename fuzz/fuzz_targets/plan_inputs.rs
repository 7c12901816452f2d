//! Fuzz the planner's input readers: load and co-selection statistics (JSON and CSV), EPLB
//! expert maps and bench JSON. Any bytes give a value or an error, never a panic.
//! Run: `cargo +nightly fuzz run plan_inputs -- -max_total_time=60`.
#![no_main]

use expertmesh_planner::calibrate::BenchFile;
use expertmesh_planner::eplb;
use expertmesh_planner::stats::{CoSelection, LoadStats};
use expertmesh_topology::Topology;
use expertmesh_topology::model::preset_by_name;
use libfuzzer_sys::fuzz_target;
use std::path::Path;

const TOPOLOGY: &str = r#"
format = 1
name = "fuzz"
[[nodes]]
name = "n0"
address = "127.0.0.1"
control_port = 7000
data_port = 7100
intra_link = "shm"
intra_bandwidth_gb_s = 10
nics = [{ name = "lo", kind = "tcp", speed_gbit_s = 100, mtu = 65536 }]
devices = [
  { name = "c0", kind = "cpu", arch = "cpu", threads = 1, expert_memory = "1 GiB", memory_bandwidth_gb_s = 20 },
  { name = "c1", kind = "cpu", arch = "cpu", threads = 1, expert_memory = "1 GiB", memory_bandwidth_gb_s = 20 },
]
"#;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let model = preset_by_name("toy-grouped").expect("preset");
    let topology = Topology::from_toml_str(TOPOLOGY).expect("topology");
    for name in ["x.json", "x.csv"] {
        let _ = LoadStats::parse(Path::new(name), text, &model);
        let _ = CoSelection::parse(Path::new(name), text, &model);
    }
    let _ = eplb::import_str(text, &topology, &model);
    let _ = BenchFile::from_json_str(Path::new("b.json"), text);
});
