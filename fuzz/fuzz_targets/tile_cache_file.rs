//! Fuzz the tile cache's file check (`tile_cache::check_file_bytes`, what a worker started with
//! `--tile-cache` runs on a kept file before it serves from it): any bytes are refused with a
//! reason or accepted with the arena at a page boundary filling the rest of the file, never a
//! panic or an allocation sized by a field of the file; a file written for an arena
//! (`file_bytes`, or `file_bytes_by` with a writer line naming any host) is accepted, and any
//! one byte changed in it is refused.
//! Run: `cargo +nightly fuzz run tile_cache_file seeds/tile_cache_file -- -max_total_time=60`.
#![no_main]

use expertmesh_cpu_backend::tile_cache::{check_file_bytes, file_bytes, file_bytes_by};
use libfuzzer_sys::fuzz_target;

const DESCRIPTION: &str = "expertmesh R16 tile cache, fuzz\nsource: fuzz\narena bytes";

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    if mode % 2 == 1 {
        // The rest is a file, checked against an arena size taken from the mode byte's bits.
        let arena = usize::from(mode >> 1) * 97;
        match check_file_bytes(rest, DESCRIPTION, arena) {
            Ok(offset) => {
                assert_eq!(offset % 4096, 0);
                assert_eq!(offset + arena, rest.len());
            }
            Err(why) => assert!(!why.is_empty()),
        }
        return;
    }
    // The rest is an arena: its file is accepted, and refused once any byte changes. Every
    // other one carries a writer line naming a host made of the arena's first bytes.
    let file = if mode % 4 == 2 {
        let host = String::from_utf8_lossy(&rest[..rest.len().min(300)]);
        file_bytes_by(DESCRIPTION, &host, rest)
    } else {
        file_bytes(DESCRIPTION, rest)
    };
    let offset = check_file_bytes(&file, DESCRIPTION, rest.len()).expect("a written file");
    assert_eq!(&file[offset..], rest);
    let at = usize::from(mode) * 31 % file.len();
    let mut bad = file.clone();
    bad[at] ^= 0x20;
    // Header padding after the checksum is not covered: only its zeros' position is.
    let stored = u32::from_le_bytes(file[8..12].try_into().expect("4 bytes")) as usize;
    let header_end = 8 + 4 + stored + 12 + 4 * rest.len().div_ceil(4 << 20) + 4;
    if at < header_end || at >= offset {
        assert!(
            check_file_bytes(&bad, DESCRIPTION, rest.len()).is_err(),
            "byte {at}"
        );
    }
});
