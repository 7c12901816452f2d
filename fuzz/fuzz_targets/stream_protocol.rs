//! Fuzz target: an arbitrary byte stream, cut into arbitrary chunks, through the streaming
//! decoder and into the protocol state machine (handshake, credits, heartbeats, timeouts) in plaintext. It
//! must never panic, and the state machine's invariants must hold.
#![no_main]

use expertmesh_transport::codec::{CodecConfig, StreamDecoder};
use expertmesh_transport::crypto::{Credentials, Key};
use expertmesh_transport::protocol::{Connection, ProtocolConfig};
use libfuzzer_sys::fuzz_target;
use std::sync::Arc;
use std::time::{Duration, Instant};

fuzz_target!(|data: &[u8]| {
    let Some((&ctl, rest)) = data.split_first() else {
        return;
    };
    let mut cfg = ProtocolConfig::new("fuzz", 0, 4);
    cfg.codec = CodecConfig {
        max_frame_bytes: 1 << 16,
        payload_checksum: ctl & 1 == 1,
    };
    cfg.recv_window_bytes = 1 << 17;
    if ctl & 2 == 2 {
        cfg.credentials = Some(Arc::new(Credentials::issue_rank(
            &Key::from_bytes([7; 32]),
            "fuzz",
            0,
            4,
            1,
        )));
    }
    let now = Instant::now();
    let mut conn = Connection::new(Arc::new(cfg.clone()), None, [1; 32], Vec::new(), now);
    let mut dec = StreamDecoder::new(cfg.codec);
    let chunk = (ctl as usize >> 2).max(1);
    let mut t = now;
    for piece in rest.chunks(chunk) {
        dec.push(piece);
        loop {
            match dec.next_frame() {
                Ok(Some((body, payload))) => {
                    t += Duration::from_millis(7);
                    let _ = conn.handle_frame(t, &body, 64 + payload.len() as u64);
                    if conn.recv_outstanding() > 0 {
                        conn.release(64 + payload.len() as u64);
                    }
                    let _ = conn.try_reserve(1000);
                }
                Ok(None) => break,
                Err(_) => return,
            }
        }
        conn.handle_timeout(t);
        while conn.poll_transmit().is_some() {}
        while conn.poll_event().is_some() {}
        assert!(conn.recv_outstanding() <= cfg.recv_window_bytes);
    }
});
