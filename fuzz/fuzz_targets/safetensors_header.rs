//! Fuzz the safetensors header parser: any bytes, claimed to be a file of any length, give
//! validated tensors (each inside the file, none overlapping) or an error, never a panic.
//! Run: `cargo +nightly fuzz run safetensors_header -- -max_total_time=60`.
#![no_main]

use expertmesh_checkpoint::safetensors::parse_header;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The bytes as a whole file, and as the prefix of longer files (the reader may be handed
    // just the header).
    let len = data.len() as u64;
    for file_len in [len, len.saturating_add(4096), u64::MAX] {
        if let Ok(tensors) = parse_header(data, file_len) {
            for t in &tensors {
                assert!(t.data.start <= t.data.end && t.data.end as u64 <= file_len);
                assert_eq!(t.num_bytes(), t.num_elements() * t.dtype.size());
            }
            for pair in tensors.windows(2) {
                assert!(pair[0].data.end <= pair[1].data.start);
            }
        }
    }
});
