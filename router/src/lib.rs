//! The token router: gating, top-k, dispatch planning and combine, plus the router service.
//!
//! Why this crate exists: it turns a MoE layer call (hidden states for some tokens) into expert
//! choices, sends each token's activations only to the devices that own its experts, and combines
//! the results in a fixed order. It also holds the in-process reference MoE layer that the fabric
//! is checked against.
//!
//! * [`admission`] — which frontend requests the router takes in: capacity and fair shares.
//! * [`client`] — `RouterClient`, what a serving frontend links.
//! * [`confirmations`] — when a router may confirm a worker's announcement (`Seen`).
//! * [`core`] — the sans-IO router state machine: batching, dispatch, failover, combine.
//! * [`gating`] — logits → (expert, weight) slots for every scoring family.
//! * [`health`] — device health: adaptive hedge timeouts and quarantine with probing.
//! * [`metrics`] — Prometheus metrics of a router and the `/metrics` endpoint.
//! * [`plan`] — dispatch planning: destinations, deduplication, replica choice.
//! * [`ranks`] — the names of the mesh ranks (routers first, their number given).
//! * [`reference`](mod@reference) — the in-process reference MoE layer and its f64 twin.
//! * [`relay`] — copies of gained experts relayed between devices (sans-IO).
//! * [`service`] — the router service: the I/O driver around the core.
//! * `sim` — a simulated cluster the core's tests drive it with (cargo feature `sim`, enabled
//!   by the router's and the worker's dev-dependencies only).

pub mod admission;
pub mod client;
pub mod confirmations;
pub mod core;
pub mod gating;
pub mod health;
pub mod metrics;
pub mod plan;
pub mod ranks;
pub mod rebalance;
pub mod reference;
pub mod relay;
pub mod service;
#[cfg(any(test, feature = "sim"))]
pub mod sim;
