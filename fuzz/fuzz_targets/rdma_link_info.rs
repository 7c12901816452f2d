//! Fuzz the RDMA link info a peer sends (`rdma::wire::decode_link_info`) and the libfabric
//! endpoint description inside it (`decode_fabric_endpoint`). Any bytes give a description or an
//! error, never a panic; what parses encodes back to the same bytes.
//! Run: `cargo +nightly fuzz run rdma_link_info seeds/rdma_link_info -- -max_total_time=60`.
#![no_main]

use expertmesh_transport::rdma::wire;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(info) = wire::decode_link_info(data) {
        let mut again = Vec::new();
        info.encode(&mut again);
        assert_eq!(again, data);
        if let Ok(ep) = wire::decode_fabric_endpoint(info.endpoint) {
            let mut again = Vec::new();
            ep.encode(&mut again);
            assert_eq!(again, info.endpoint);
            assert!(!ep.name.is_empty());
        }
    }
    if let Err(e) = wire::decode_fabric_endpoint(data) {
        assert!(!e.to_string().is_empty());
    }
});
