//! Fuzz target: the router's side of a frontend connection, as the router service runs it
//! (credentials of router 0, accepting clients), fed an arbitrary byte stream in arbitrary
//! chunks: plaintext frames capped small until the client's auth answer, sealed records after
//! it (harness: `expertmesh_fuzz::run_frontend_input`). Seeded with authenticated client
//! transcripts (fixed nonces and keys), so mutations reach the sealed record layer.
//!
//! Checks: never panics; a connection is only established for the frontend whose key the
//! seeds hold (a mutated name, rank, nonce or MAC never authenticates); no application frame
//! before authentication; the receive window bounds what is outstanding.
#![no_main]

use expertmesh_fuzz::{FRONTEND_NAME, MAX_FRAME, run_frontend_input};
use expertmesh_transport::codec::CLIENT_RANK;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some(f) = run_frontend_input(data) else {
        return;
    };
    if f.outcome().established {
        let peer = f.conn().peer().expect("established with a peer");
        assert_eq!(
            peer.rank, CLIENT_RANK,
            "a rank established on the frontend port"
        );
        assert_eq!(
            peer.identity, FRONTEND_NAME,
            "another frontend name authenticated"
        );
    } else {
        assert_eq!(
            f.outcome().delivered,
            0,
            "application frames before authentication"
        );
    }
    assert!(f.conn().recv_outstanding() <= 2 * MAX_FRAME as u64);
});
