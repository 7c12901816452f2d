//! Packed INT4 experts: the format, the exact-mode numerical contract, the CPU reference, and
//! the kernels that run experts (CPU SIMD always; HIP behind the `hip` feature).
//!
//! Why this crate exists: it is the only place that knows how expert weights are laid out in
//! memory and how an expert FFN is computed. Everything above it (worker, router, planner) sees
//! [`format::ExpertWeights`], byte counts from [`format::QuantSpec`], and, once the backends
//! land, the `ExpertBackend` trait. Kernel FFI is declared here and nowhere else.
//!
//! * [`format`] — the canonical packed layout (disk = CPU = GPU source of truth), quantizer.
//! * [`contract`] — the exact W4A8 contract: activation quantization, reduction order, `exp`.
//! * [`reference`] — scalar oracle implementations (exact, accurate, f64).
//! * [`synth`] — deterministic synthetic weights from `(seed, layer, expert)`.
//! * [`backend`] — the `ExpertBackend` trait (no implementation dependencies).
//! * [`cpu`] — the CPU backend: R16 repack, scalar/AVX2/AVX-512 VNNI kernels, work scheduling.
//! * [`aligned`] — 64-byte aligned fixed-size buffers.
//! * [`kernel_abi`] — Rust mirrors of the HIP kernels' argument blocks.
//! * [`testvec`] — kernel test vectors (the `EMTV` file the C++ harnesses read).
//! * [`hip`] — the HIP backend (real with `--features hip`, a stub reporting `NotCompiled`
//!   otherwise).

pub mod aligned;
pub mod backend;
pub mod contract;
pub mod cpu;
pub mod format;
pub mod hip;
pub mod kernel_abi;
pub mod reference;
pub mod synth;
pub mod testvec;
