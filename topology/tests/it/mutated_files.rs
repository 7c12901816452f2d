//! Mutated example files never panic the readers: every mutation either still validates or comes
//! back as a list of problems, each with a non-empty message.
//!
//! This is the in-CI stand-in for a fuzz target: the mutations (byte edits plus TOML-shaped
//! tokens such as brackets, quotes, huge and non-finite numbers) start from real files, so they
//! reach deep into validation instead of stopping at the first syntax error.

use expertmesh_topology::model::preset_by_name;
use expertmesh_topology::{Placement, PlacementFile, Problem, Topology, model_file};
use proptest::prelude::*;
use std::path::Path;

fn example(name: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../examples")
        .join(name);
    std::fs::read_to_string(path).unwrap()
}

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

#[derive(Clone, Debug)]
enum Edit {
    Delete { at: usize, len: usize },
    Insert { at: usize, token: usize },
    Replace { at: usize, byte: u8 },
}

fn apply(text: &str, edits: &[Edit]) -> String {
    let mut bytes = text.as_bytes().to_vec();
    for e in edits {
        let n = bytes.len().max(1);
        match *e {
            Edit::Delete { at, len } => {
                let at = at % n;
                let end = (at + len).min(bytes.len());
                bytes.drain(at.min(bytes.len())..end);
            }
            Edit::Insert { at, token } => {
                let at = (at % n).min(bytes.len());
                let t = TOKENS[token % TOKENS.len()].as_bytes();
                bytes.splice(at..at, t.iter().copied());
            }
            Edit::Replace { at, byte } => {
                if !bytes.is_empty() {
                    let at = at % bytes.len();
                    bytes[at] = byte;
                }
            }
        }
    }
    String::from_utf8_lossy(&bytes).into_owned()
}

fn edits() -> impl Strategy<Value = Vec<Edit>> {
    proptest::collection::vec(
        prop_oneof![
            (any::<usize>(), 1usize..40).prop_map(|(at, len)| Edit::Delete { at, len }),
            (any::<usize>(), any::<usize>()).prop_map(|(at, token)| Edit::Insert { at, token }),
            (any::<usize>(), 32u8..127).prop_map(|(at, byte)| Edit::Replace { at, byte }),
        ],
        1..6,
    )
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
