//! Mutated example files never panic the readers: every mutation either still validates or comes
//! back as a list of problems, each with a non-empty message.
//!
//! This is the in-CI stand-in for a fuzz target: the mutations (byte edits plus TOML-shaped
//! tokens such as brackets, quotes, huge and non-finite numbers) start from real files, so they
//! reach deep into validation instead of stopping at the first syntax error.

use expertmesh_topology::model::preset_by_name;
use expertmesh_topology::{Placement, PlacementFile, Problem, Topology, model_file};
use proptest::prelude::*;

use crate::support::{self, apply, example};

const TOKENS: &[&str] = &[
    "=",
    "[",
    "]",
    "[[",
    "]]",
    "{",
    "}",
    "\"",
    ",",
    "\n",
    "#",
    "-1",
    "0",
    "1e309",
    "nan",
    "inf",
    "-inf",
    "99999999999999999999",
    "4294967296",
    "\"all\"",
    "\"0-4294967295\"",
    "\"5-1\"",
    "[[nodes]]",
    "[[assign]]",
    "[router]",
    "true",
    "\"\"",
    "\"router\"",
    "é",
    "\u{0}",
];

/// One to five edits inserting [`TOKENS`].
fn edits() -> impl Strategy<Value = Vec<support::Edit>> {
    support::edits(TOKENS)
}

fn assert_reported(problems: &[Problem]) {
    assert!(!problems.is_empty());
    for p in problems {
        assert!(!p.message().is_empty(), "{p:?}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn mutated_topologies(edits in edits(), which in 0usize..4) {
        let name = ["single-host.toml", "mi300x-4x8.toml", "rx7900xtx-8x4.toml", "mi210-4x4.toml"][which];
        let text = apply(&example(name), &edits);
        if let Err(p) = Topology::from_toml_str(&text) {
            assert_reported(&p);
        }
    }

    #[test]
    fn mutated_placements(edits in edits(), which in 0usize..2) {
        let (topo, model, file) = [
            ("single-host.toml", "demo-small", "single-host-demo-small.placement.toml"),
            ("mi300x-4x8.toml", "kimi-k2", "mi300x-4x8-kimi-k2.placement.toml"),
        ][which];
        let t = Topology::from_toml_str(&example(topo)).unwrap();
        let m = preset_by_name(model).unwrap();
        let text = apply(&example(file), &edits);
        if let Err(p) = Placement::from_toml_str(&text, &t, &m) {
            assert_reported(&p);
        }
        let _ = PlacementFile::from_toml_str(&text);
    }

    #[test]
    fn mutated_models(edits in edits(), which in 0usize..3) {
        let name = ["kimi-k2", "toy-grouped", "mixtral-8x7b"][which];
        let text = model_file::model_to_toml_string(&preset_by_name(name).unwrap());
        let text = apply(&text, &edits);
        if let Err(p) = model_file::model_from_toml_str(&text) {
            assert_reported(&p);
        }
    }
}
