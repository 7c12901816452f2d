//! Fuzz target: arbitrary bytes into the frame decoder (header, whole frame, metadata of every
//! kind). It must never panic; a frame that decodes must re-encode to the same bytes.
#![no_main]

use expertmesh_transport::codec::{self, Body, CodecConfig, FrameKind};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    for checksum in [false, true] {
        let cfg = CodecConfig {
            max_frame_bytes: 1 << 20,
            payload_checksum: checksum,
        };
        let _ = codec::decode_header(data, &cfg);
        if let Ok((body, range)) = codec::decode_frame(data, &cfg) {
            // Round trip: what decodes re-encodes to identical bytes (modulo the checksum flag,
            // which follows the config).
            let again = codec::encode_frame(&body, &data[range.clone()], &cfg).expect("re-encode");
            let (body2, range2) = codec::decode_frame(&again, &cfg).expect("decode re-encoded");
            assert_eq!(format!("{body:?}"), format!("{body2:?}"));
            assert_eq!(&data[range], &again[range2]);
        }
    }
    if let Some((&k, meta)) = data.split_first() {
        if let Some(kind) = FrameKind::from_u8(k % 12) {
            if let Ok(b) = Body::decode_meta(kind, meta) {
                let _ = b.expected_payload_len();
            }
        }
    }
});
