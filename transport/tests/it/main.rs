//! The transport's integration tests, one binary: the codec's properties, the driver conformance
//! suite, attacks, sealed links, frontends, mesh links, killed peer processes and the RDMA link
//! under injected NIC faults.

mod attacks;
mod codec_props;
mod conformance;
mod frontend;
mod mesh_links;
mod process_kill;
mod rdma_faults;
mod sealed_links;
mod support;
