//! The worker crate's integration tests: one test binary, one module per subject.
//!
//! * `core_sim` — the router core against devices running the real dispatch executor:
//!   bit-identical to the reference whatever the placement, failover, deadlines, bad input.
//! * `core_faults` — the router core under device faults on a virtual clock: hedging,
//!   quarantine and probes, stale incarnations, error answers.
//! * `wire_modes` — the serving modes' result wires and tolerances.
//! * `data_path_allocs` — allocations and copies per layer call (it installs the counting
//!   global allocator of this binary; its module doc says why that is safe here).
//! * `support` — the devices that run the real executor, for the router core's simulated
//!   cluster (`expertmesh_router::sim`, the harness every core test here shares with the
//!   router's own tests).

mod core_faults;
mod core_sim;
mod data_path_allocs;
mod support;
mod wire_modes;
