//! The expert worker: everything a device does, from loading its experts to answering dispatches.
//!
//! Why this crate exists: the worker is the "device" of the design, and it is the only library
//! that depends on backend implementations (the CPU backend and the HIP leaf). The router
//! depends only on the `ExpertBackend` trait; the binary composes the two.
//!
//! * [`deploy`] — one deployment's shared facts: ranks, addresses, wire settings.
//! * [`weights`] — which experts a device pins, loaded once; the in-process reference backend.
//! * [`exec`] — dispatch execution: a `Dispatch` frame in, a result frame out.
//! * [`fair`] — round-robin scheduling of dispatches from several routers.
//! * [`fanout`] — a node's leader sharing one dispatch with the node's other devices.
//! * [`fetch`] — copying a gained expert from its owner: the stream's bytes and reassembly.
//! * [`holdings`] — what the device holds during live placement changes, and when a dropped
//!   expert may be freed.
//! * [`metrics`] — Prometheus metrics of a worker.
//! * [`process`] — the worker process: backend choice, mesh loop, compute thread.
//! * [`shared`] — shared experts run on the router host, and the router core around them.

pub mod deploy;
pub mod exec;
pub mod fair;
pub mod fanout;
pub mod fetch;
pub mod holdings;
pub mod metrics;
pub mod process;
pub mod shared;
pub mod weights;
