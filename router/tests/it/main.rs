//! The router crate's integration tests: one test binary, one module per subject.
//!
//! * `deadlines` — per-request deadlines in the router core, on the simulated cluster.
//! * `hf_semantics` — gating against re-implementations of the published routers.
//! * `holdings` — the core routes by what workers announce they hold (live placement changes).
//!
//! The simulated cluster the core's tests drive it with is not a module of this binary but
//! `expertmesh_router::sim` (cargo feature `sim`, enabled by this crate's dev-dependency on
//! itself): the worker crate's core tests use the same harness with devices that run the real
//! executor, and they cannot reach a test module of this crate.

mod deadlines;
mod hf_semantics;
mod holdings;
