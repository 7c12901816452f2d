//! Mutation helpers for the "mutated inputs never panic a reader" tests: the example files,
//! byte edits with format-shaped tokens, and applying them.
//!
//! The planner's integration tests include this same file (`planner/tests/it/support.rs`,
//! through `#[path]`), so both crates mutate their inputs one way.

use proptest::prelude::*;
use std::path::Path;

/// The text of `examples/{name}` of the workspace.
pub(crate) fn example(name: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../examples")
        .join(name);
    std::fs::read_to_string(path).unwrap()
}

/// One edit of a file's bytes.
#[derive(Clone, Debug)]
pub(crate) enum Edit {
    /// Delete up to `len` bytes at `at` (modulo the length).
    Delete { at: usize, len: usize },
    /// Insert a token at `at` (modulo the length).
    Insert { at: usize, token: &'static str },
    /// Replace the byte at `at` (modulo the length) with a printable byte.
    Replace { at: usize, byte: u8 },
}

/// `text` after `edits`, in order (invalid UTF-8 replaced).
pub(crate) fn apply(text: &str, edits: &[Edit]) -> String {
    let mut bytes = text.as_bytes().to_vec();
    for e in edits {
        let n = bytes.len().max(1);
        match *e {
            Edit::Delete { at, len } => {
                let at = (at % n).min(bytes.len());
                let end = (at + len).min(bytes.len());
                bytes.drain(at..end);
            }
            Edit::Insert { at, token } => {
                let at = (at % n).min(bytes.len());
                bytes.splice(at..at, token.bytes());
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

/// One to five edits, inserting tokens drawn from `tokens`.
pub(crate) fn edits(tokens: &'static [&'static str]) -> impl Strategy<Value = Vec<Edit>> {
    proptest::collection::vec(
        prop_oneof![
            (any::<usize>(), 1usize..40).prop_map(|(at, len)| Edit::Delete { at, len }),
            (any::<usize>(), any::<usize>()).prop_map(move |(at, token)| Edit::Insert {
                at,
                token: tokens[token % tokens.len()],
            }),
            (any::<usize>(), 32u8..127).prop_map(|(at, byte)| Edit::Replace { at, byte }),
        ],
        1..6,
    )
}
