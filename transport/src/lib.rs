//! Activation transport: the sans-IO frame codec and the TCP, shared-memory and RoCE drivers.
//!
//! Why this crate exists: it is the only crate that touches sockets, shared memory and verbs.
//! Everything above it exchanges typed frames with ranks and never sees a file descriptor.
