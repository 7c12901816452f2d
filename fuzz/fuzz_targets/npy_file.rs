//! Fuzz the `.npy` reader behind `expertmesh infer` (hidden states and logits from files a user
//! or a frontend hands over): any bytes give an array or a format error naming the problem,
//! never a panic or an allocation the file's length does not back; an array that parses has
//! the shape it claims, and written back as f32 it parses to the same bits.
//! Run: `cargo +nightly fuzz run npy_file seeds/npy_file -- -max_total_time=60`.
#![no_main]

use expertmesh::npy::{NpyDtype, NpyError, encode, parse};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    match parse("fuzz.npy", data) {
        Ok(a) => {
            assert_eq!(a.rows * a.cols, a.data.len(), "shape and data disagree");
            assert!(
                a.data.len() * a.dtype.size() <= data.len(),
                "more data than bytes"
            );
            let again = parse("again.npy", &encode(a.rows, a.cols, &a.data, NpyDtype::F32))
                .expect("an array written as f32 reads back");
            assert_eq!((again.rows, again.cols), (a.rows, a.cols));
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&again.data), bits(&a.data), "f32 does not round-trip");
        }
        Err(NpyError::Format { what, .. }) => assert!(!what.is_empty()),
        Err(e) => panic!("parsing bytes cannot fail with I/O: {e}"),
    }
});
