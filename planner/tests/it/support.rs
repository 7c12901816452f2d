//! Helpers of the planner's integration tests: the mutation helpers are the topology crate's
//! own file, included here so that both crates' "mutated inputs never panic" tests mutate
//! their inputs one way.

#[path = "../../../topology/tests/it/support.rs"]
mod mutate;

pub(crate) use mutate::{Edit, apply, edits as edits_with, example};
