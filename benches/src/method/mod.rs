//! The measurement method every bench shares.
//!
//! Why this exists: a figure is only worth its limit. Each figure is a ratio against a limit
//! measured in the same run on the same machine ([`roofline`] for kernels; the transport and
//! fabric benches measure theirs beside the thing measured), taken as the median of interleaved
//! repetitions with its p10–p90 spread ([`stats`]), written in one JSON format with the
//! machine's description ([`json`], [`machine`]), drawn as an HTML page ([`report`]), and
//! compared run to run with a test that knows noise ([`compare`]).

pub mod compare;
pub mod json;
pub mod machine;
pub mod report;
pub mod roofline;
pub mod stats;
