//! The topology crate's integration tests, one binary: mutated example files never panic the
//! readers.

mod mutated_files;
mod support;
