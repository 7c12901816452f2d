//! The quant crate's integration tests, one binary: the packed format, the searched quantizer, and
//! the searched quantizer against its oracle.

mod format;
mod search;
mod search_oracle;
