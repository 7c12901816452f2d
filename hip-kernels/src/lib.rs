//! The HIP leaf: packed-INT4 expert kernels for AMD GPUs and the backend that runs them.
//!
//! Why this crate exists: it is the only crate that declares kernel FFI and the only one whose
//! build needs `hipcc`. It sits at the edge of the crate graph: it implements
//! `expertmesh_backend::ExpertBackend` on the format and contract of `expertmesh_quant`, and only
//! the worker (and the binary) depend on it. A kernel edit rebuilds this crate and its users, not
//! the file parser or the transport.
//!
//! * [`hip`] — the HIP backend (real with `--features hip`, a stub reporting `NotCompiled`
//!   otherwise).
//! * [`kernel_abi`] — Rust mirrors of the HIP kernels' argument blocks.
//! * [`testvec`] — kernel test vectors (the `EMTV` file the C++ harnesses read).
//! * [`standin`] — builds the HIP-CPU stand-in for the HIP runtime, on which the backend and the
//!   real kernels run without a GPU (test support).

pub mod hip;
pub mod kernel_abi;
pub mod standin;
pub mod testvec;
