//! Fuzz the stream a gained expert is copied in (`expertmesh_worker::fetch`): any bytes decode
//! to an expert of the asked shape or an error, never a panic; and any chunk sequence
//! reassembles within its bound or errors.
//! Run: `cargo +nightly fuzz run fetched_expert -- -max_total_time=60`.
#![no_main]

use expertmesh_backend::ExpertKey;
use expertmesh_worker::fetch::{Assembly, decode_expert};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let key = ExpertKey {
        layer: 1,
        expert: 2,
    };
    if let Ok(w) = decode_expert(data, key, 128, 128) {
        assert_eq!((w.hidden(), w.inter()), (128, 128));
    }
    // The same bytes as chunks: (offset u16, length u8, last bit) records.
    let mut asm = Assembly::new(4096);
    for rec in data.chunks(4) {
        if rec.len() < 4 {
            break;
        }
        let offset = u64::from(u16::from_le_bytes([rec[0], rec[1]]));
        let len = usize::from(rec[2]);
        let last = rec[3] & 1 == 1;
        let chunk = vec![rec[3]; len];
        match asm.add(offset, &chunk, last) {
            Ok(Some(whole)) => {
                assert!(whole.len() <= 4096);
                break;
            }
            Ok(None) => {}
            Err(_) => break,
        }
    }
});
