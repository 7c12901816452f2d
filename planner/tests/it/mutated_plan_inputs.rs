//! Mutated planner inputs never panic the readers: load and co-selection statistics (CSV and
//! JSON), EPLB expert maps and bench JSON either parse or come back as an error with a message.
//!
//! The in-CI stand-in for the `plan_inputs` fuzz target: mutations start from real files (the
//! examples, and files the writers produce), so they reach the semantic checks.

use expertmesh_planner::calibrate::BenchFile;
use expertmesh_planner::eplb;
use expertmesh_planner::stats::{CoSelection, LoadStats};
use expertmesh_topology::Topology;
use expertmesh_topology::model::preset_by_name;
use proptest::prelude::*;

use crate::support::{self, apply, example};
use std::path::Path;

const TOKENS: &[&str] = &[
    ",",
    "\n",
    "[",
    "]",
    "{",
    "}",
    "\"",
    ":",
    "-1",
    "0",
    "1e309",
    "NaN",
    "-0.5",
    "inf",
    "99999999999999999999",
    "4294967296",
    "null",
    "true",
    "\"layers\"",
    "\"pairs\"",
    "\"counts\"",
    "\"layer\"",
    "layer,expert,tokens\n",
    "#",
    "é",
    "\u{0}",
];

/// One to five edits inserting [`TOKENS`].
fn edits() -> impl Strategy<Value = Vec<support::Edit>> {
    support::edits_with(TOKENS)
}

fn single_host() -> Topology {
    Topology::from_toml_str(&example("single-host.toml")).unwrap()
}

/// A map the exporter wrote for demo-small on single-host (16 + 2 slots per device).
fn eplb_example() -> String {
    let m = preset_by_name("demo-small").unwrap();
    let t = single_host();
    let plan = expertmesh_planner::plan(
        &t,
        &m,
        None,
        None,
        &expertmesh_planner::PlanOptions {
            redundant: Some(4),
            ..Default::default()
        },
    )
    .unwrap();
    eplb::export_json(&plan.placement, &t, &m, eplb::EplbLayers::All).unwrap()
}

const BENCH: &str = r#"{"machine": {}, "results": [
  {"name": "decode-exact demo-small H1024 F512", "batch": 8, "achieved": 12.5, "limit": 20.0, "unit": "GB/s", "ratio": 0.625},
  {"name": "tcp_dispatch_rtt_p50", "batch": 1, "achieved": 30.0, "limit": 20.0, "unit": "us", "ratio": 1.5}
]}"#;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn mutated_statistics(edits in edits(), which in 0usize..4) {
        let m = preset_by_name("demo-small").unwrap();
        let (name, file) = [
            ("x.csv", "demo-small-zipf.load.csv"),
            ("x.json", "demo-small-clustered.coselect.json"),
            ("x.json", "demo-small-zipf.load.csv"),
            ("x.csv", "demo-small-clustered.coselect.json"),
        ][which];
        let text = apply(&example(file), &edits);
        let path = Path::new(name);
        if let Err(e) = LoadStats::parse(path, &text, &m) {
            prop_assert!(e.to_string().len() > name.len() + 2, "{}", e);
        }
        if let Err(e) = CoSelection::parse(path, &text, &m) {
            prop_assert!(e.to_string().len() > name.len() + 2, "{}", e);
        }
    }

    #[test]
    fn mutated_eplb_maps_and_bench_files(edits in edits()) {
        let m = preset_by_name("demo-small").unwrap();
        let t = single_host();
        let text = apply(&eplb_example(), &edits);
        if let Ok(map) = eplb::import_str(&text, &t, &m) {
            prop_assert_eq!(map.slots.len(), 4);
        }
        let text = apply(BENCH, &edits);
        if let Err(e) = BenchFile::from_json_str(Path::new("b.json"), &text) {
            prop_assert!(!e.to_string().is_empty());
        }
    }
}

#[test]
fn the_unmutated_examples_parse() {
    let m = preset_by_name("demo-small").unwrap();
    let load = LoadStats::parse(Path::new("x.csv"), &example("demo-small-zipf.load.csv"), &m);
    assert!(load.unwrap().layer(3).is_some());
    let co = CoSelection::parse(
        Path::new("x.json"),
        &example("demo-small-clustered.coselect.json"),
        &m,
    );
    assert!(co.unwrap().layer(0).is_some());
    let map = eplb::import_str(&eplb_example(), &single_host(), &m).unwrap();
    assert_eq!(map.slots_per_device, 18);
    assert!(BenchFile::from_json_str(Path::new("b.json"), BENCH).is_ok());
}
