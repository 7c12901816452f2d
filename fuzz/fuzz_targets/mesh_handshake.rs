//! Fuzz target: the router's side (rank 0) of a mesh connection, as the mesh accepts it
//! (credentials of rank 0 in a 3-rank cluster), fed an arbitrary byte stream: plaintext frames
//! capped small until the dialer's auth answer, then sealed records, the link-info exchange
//! and the shared-memory sync byte when the dialer's hello asks for shared memory (harness:
//! `expertmesh_fuzz::run_mesh_input`). Seeded with authenticated transcripts of workers 1
//! (TCP, then sealed application frames) and 2 (shared memory).
//!
//! Checks: never panics; only ranks whose pair keys the seeds hold establish (a mutated rank,
//! cluster, nonce or MAC never authenticates); no application frame before authentication;
//! the receive window bounds what is outstanding.
#![no_main]

use expertmesh_fuzz::{MAX_FRAME, run_mesh_input};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some(f) = run_mesh_input(data) else {
        return;
    };
    if f.outcome().established {
        let peer = f.conn().peer().expect("established with a peer");
        assert!(
            peer.rank == 1 || peer.rank == 2,
            "rank {} authenticated without its key",
            peer.rank
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
