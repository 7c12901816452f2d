//! Test support for end-to-end tests of the Hugging Face checkpoint converter: tiny checkpoint
//! folders of every supported family and weight format ([`tiny`]), and an f64 reference of
//! each family's MoE block written from the published modeling code ([`reference`]).
//!
//! Why this exists: the converter must be tested on folders that look like the published
//! checkpoints, against the math the published models compute; neither may come from the code
//! under test (`checkpoint/src` writes nothing, `router/src` is not used here). Include it from
//! a test file with `mod hf_support;`.

pub(crate) mod reference;
pub(crate) mod tiny;
