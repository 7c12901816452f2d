//! The placement planner (WIP).

pub mod capacity;
pub mod packing;
pub mod stats;
