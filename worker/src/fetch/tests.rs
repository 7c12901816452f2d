//! The fetched-expert stream: every packed format round-trips bit for bit, chunks reassemble
//! in any order, and damaged, foreign or oversized streams are refused.

use super::*;
use expertmesh_quant::synth::synthetic_expert;
use proptest::prelude::*;

const KEY: ExpertKey = ExpertKey {
    layer: 3,
    expert: 17,
};

fn spec(group: u32, bf16: bool, zero_points: bool) -> QuantSpec {
    QuantSpec {
        group_size: group,
        scale_dtype: if bf16 {
            ScaleDtype::Bf16
        } else {
            ScaleDtype::F16
        },
        zero_points,
    }
}

fn same(a: &ExpertWeights, b: &ExpertWeights) -> bool {
    let m = |x: &PackedMatrix, y: &PackedMatrix| {
        x.nibbles() == y.nibbles()
            && x.scales() == y.scales()
            && x.zeros() == y.zeros()
            && (x.rows(), x.cols(), x.spec()) == (y.rows(), y.cols(), y.spec())
    };
    m(a.w13(), b.w13()) && m(a.w2(), b.w2())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn every_format_round_trips_through_chunks_in_any_order(
        group in prop::sample::select(vec![32u32, 64, 128]),
        bf16 in any::<bool>(),
        zero_points in any::<bool>(),
        hidden_blocks in 1usize..5,
        inter_blocks in 1usize..4,
        seed in any::<u64>(),
        chunk in 256usize..8000,
        order in any::<u64>(),
    ) {
        let (hidden, inter) = (128 * hidden_blocks, 128 * inter_blocks);
        let s = spec(group, bf16, zero_points);
        let w = synthetic_expert(s, hidden, inter, seed, KEY.layer, KEY.expert).unwrap();
        let bytes = encode_expert(KEY, &w);
        prop_assert!(bytes.len() <= max_stream_bytes(hidden, inter, group as usize));
        // Chunks delivered in a shuffled order.
        let mut chunks: Vec<(usize, &[u8])> =
            bytes.chunks(chunk).enumerate().map(|(i, c)| (i * chunk, c)).collect();
        let n = chunks.len();
        let mut rng = expertmesh_quant::synth::SplitMix64::new(order);
        for i in (1..n).rev() {
            chunks.swap(i, rng.below(i as u64 + 1) as usize);
        }
        let mut a = Assembly::new(max_stream_bytes(hidden, inter, group as usize));
        let mut whole = None;
        for (k, &(at, c)) in chunks.iter().enumerate() {
            let last = at + c.len() == bytes.len();
            let got = a.add(at as u64, c, last).unwrap();
            prop_assert_eq!(got.is_some(), k + 1 == n);
            whole = whole.or(got);
        }
        let whole = whole.unwrap();
        prop_assert_eq!(&whole, &bytes);
        let back = decode_expert(&whole, KEY, hidden, inter).unwrap();
        prop_assert!(same(&w, &back));
    }

    #[test]
    fn garbage_is_refused_without_a_panic(bytes in proptest::collection::vec(any::<u8>(), 0..400)) {
        prop_assert!(decode_expert(&bytes, KEY, 128, 128).is_err());
    }
}

#[test]
fn a_damaged_foreign_or_oversized_stream_is_refused() {
    let s = spec(32, true, false);
    let w = synthetic_expert(s, 256, 128, 7, KEY.layer, KEY.expert).unwrap();
    let bytes = encode_expert(KEY, &w);
    let mut damaged = bytes.clone();
    damaged[HEADER_BYTES + 10] ^= 1;
    assert_eq!(
        decode_expert(&damaged, KEY, 256, 128).unwrap_err(),
        FetchError::Checksum
    );
    let other = ExpertKey {
        layer: 3,
        expert: 18,
    };
    assert!(matches!(
        decode_expert(&bytes, other, 256, 128),
        Err(FetchError::Mismatch { .. })
    ));
    assert!(matches!(
        decode_expert(&bytes, KEY, 512, 128),
        Err(FetchError::Mismatch { .. })
    ));
    // A stream longer than the expert can be is refused chunk by chunk, before it is held.
    let mut a = Assembly::new(1000);
    assert!(a.add(990, &[0; 20], false).is_err());
    // An end before bytes already received, a second end, overlapping other bytes.
    let mut a = Assembly::new(1000);
    assert_eq!(a.add(100, &[1; 50], false).unwrap(), None);
    assert!(a.add(0, &[1; 50], true).is_err());
    assert!(a.add(120, &[2; 10], false).is_err());
    assert_eq!(a.add(150, &[3; 10], true).unwrap(), None);
    assert!(a.add(160, &[3; 1], true).is_err());
    assert_eq!(
        a.add(0, &[4; 100], false).unwrap().map(|b| b.len()),
        Some(160)
    );
}

#[test]
fn the_fuzz_seed_is_a_valid_stream_of_the_current_format() {
    let seed = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fuzz/seeds/fetched_expert/valid-128x128-g32-bf16.bin");
    let bytes = std::fs::read(&seed).unwrap();
    let key = ExpertKey {
        layer: 1,
        expert: 2,
    };
    let w = decode_expert(&bytes, key, 128, 128).unwrap();
    assert_eq!(w.spec(), spec(32, true, false));
    // Re-encoded, it is the same bytes.
    assert_eq!(encode_expert(key, &w), bytes);
}
