//! The transport's integration tests, one binary: the codec's properties, the driver conformance
//! suite, attacks, sealed links, frontends, mesh links and killed peer processes.

mod attacks;
mod codec_props;
mod conformance;
mod frontend;
mod mesh_links;
mod process_kill;
mod sealed_links;
mod support;
