//! The planner's integration tests, one binary: mutated planner inputs never panic the readers.

mod mutated_plan_inputs;
mod support;
