//! The numbers of ExpertMesh: how expert weights are laid out and how an expert FFN is computed.
//!
//! Why this crate exists: it is the ground floor every other crate builds on, and it depends on
//! nothing of ours. The file parser needs byte counts ([`format::QuantSpec`]), the transport
//! quantizes activations by the contract, the backends and the HIP kernels implement the
//! contract, the router's reference layer runs the scalar oracle. None of those should pull in a
//! kernel or a socket to get them.
//!
//! * [`format`](mod@format) — the canonical packed INT4 layout (disk = CPU = GPU source of truth), quantizers.
//! * [`search`] — the searched INT4 quantizer (least-squares scale / zero point search, error reports).
//! * [`contract`] — the exact W4A8 contract: activation quantization, reduction order, `exp`.
//! * [`reference`](mod@reference) — scalar oracle implementations (exact, accurate, f64).
//! * [`synth`] — deterministic synthetic weights from `(seed, layer, expert)` and the RNG.
//! * [`fp8`] — the OCP FP8 E4M3FN encoder and decoder (wire activations, checkpoint weights).
//! * [`aligned`] — 64-byte aligned fixed-size buffers.

pub mod aligned;
pub mod contract;
pub mod format;
pub mod fp8;
pub mod reference;
pub mod search;
pub mod synth;
