//! Property tests of the frame codec and payload dtypes: every frame kind round-trips through
//! encode/decode and through the streaming decoder under arbitrary chunking; truncated,
//! bit-flipped and random inputs are rejected without panicking; dtype conversions match
//! independent oracles.
//!
//! Why this exists: the codec parses untrusted bytes from every peer and frontend; these
//! properties (and the fuzz target in `fuzz/`) are its safety net.

use expertmesh_transport::codec::*;
use expertmesh_transport::dtype::*;
use half::{bf16, f16};
use proptest::prelude::*;

fn act_dtype() -> impl Strategy<Value = ActivationDtype> {
    prop_oneof![
        Just(ActivationDtype::Bf16),
        Just(ActivationDtype::F16),
        Just(ActivationDtype::F32),
        Just(ActivationDtype::Fp8E4m3),
        Just(ActivationDtype::Q8Block32),
    ]
}

fn out_dtype() -> impl Strategy<Value = OutputDtype> {
    prop_oneof![Just(OutputDtype::F32), Just(OutputDtype::Bf16)]
}

fn layout() -> impl Strategy<Value = OutputLayout> {
    prop_oneof![Just(OutputLayout::PerSlot), Just(OutputLayout::PreCombined)]
}

fn small_string(max: usize) -> impl Strategy<Value = String> {
    proptest::collection::vec(any::<char>(), 0..max).prop_map(move |cs| {
        let mut s: String = cs.into_iter().collect();
        while s.len() > max {
            s.pop();
        }
        s
    })
}

fn dispatch() -> impl Strategy<Value = Body> {
    (
        any::<u64>(),
        any::<u32>(),
        any::<u32>(),
        proptest::collection::vec(0u16..9, 0..12),
        1u32..4,
        act_dtype(),
        any::<bool>(),
        layout(),
    )
        .prop_flat_map(|(id, layer, mb, counts, h32, dtype, exact, layout)| {
            let pairs: usize = counts.iter().map(|&c| c as usize).sum();
            (
                Just((id, layer, mb, counts, h32, dtype, exact, layout)),
                proptest::collection::vec(any::<u32>(), pairs),
                proptest::collection::vec(any::<f32>(), pairs),
            )
        })
        .prop_map(
            |((id, layer, mb, counts, h32, dtype, exact, layout), experts, weights)| {
                Body::Dispatch(Dispatch {
                    batch_id: id,
                    layer,
                    part: mb,
                    tokens: counts.len() as u32,
                    hidden: h32 * 32,
                    dtype,
                    mode: if exact {
                        ComputeMode::Exact
                    } else {
                        ComputeMode::Accurate
                    },
                    layout,
                    result_dtype: if exact {
                        OutputDtype::F32
                    } else {
                        OutputDtype::Bf16
                    },
                    expert_counts: counts,
                    experts,
                    weights,
                })
            },
        )
}

fn body() -> impl Strategy<Value = Body> {
    prop_oneof![
        (
            small_string(255),
            any::<u32>(),
            any::<u32>(),
            any::<u64>(),
            any::<bool>(),
            any::<[u8; 32]>(),
            proptest::collection::vec(any::<u8>(), 0..64),
            (any::<u64>(), any::<[u8; 32]>())
        )
            .prop_map(
                |(cluster, rank, world_size, w, auth, nonce, attachment, (inc, fp))| {
                    Body::Hello(Hello {
                        format_version: FORMAT_VERSION,
                        cluster,
                        rank,
                        world_size,
                        recv_window_bytes: w,
                        auth_required: auth,
                        nonce,
                        attachment,
                        incarnation: inc,
                        fingerprint: fp,
                        identity: String::new(),
                    })
                }
            ),
        (
            proptest::option::of(any::<[u8; 32]>()),
            proptest::option::of(proptest::collection::vec(
                any::<u8>(),
                SEALED_IDENTITY_BYTES
            )),
        )
            .prop_map(|(mac, id)| Body::Auth(Auth {
                mac,
                identity: id.map(|v| v.try_into().unwrap()),
            })),
        dispatch(),
        (
            any::<u64>(),
            any::<u32>(),
            any::<u32>(),
            layout(),
            0u32..9,
            0u32..40,
            out_dtype()
        )
            .prop_map(
                |(request_id, layer, micro_batch, layout, rows, hidden, dtype)| Body::Result(
                    ExpertResult {
                        batch_id: request_id,
                        layer,
                        part: micro_batch,
                        layout,
                        rows,
                        hidden,
                        dtype
                    }
                )
            ),
        (
            any::<u64>(),
            prop::option::of(0..NO_PART),
            any::<u16>(),
            small_string(300)
        )
            .prop_map(|(request_id, part, code, message)| {
                Body::Error(ErrorFrame {
                    request_id,
                    part,
                    code: ErrorCode::from_u16(code),
                    message,
                })
            }),
        (any::<u64>(), any::<u64>())
            .prop_map(|(seq, sent_at_us)| Body::Heartbeat(Heartbeat { seq, sent_at_us })),
        any::<u64>().prop_map(|bytes| Body::Credit(Credit { bytes })),
        (
            any::<u64>(),
            any::<u32>(),
            0u32..6,
            1u32..3,
            act_dtype(),
            0u32..5,
            any::<u64>()
        )
            .prop_map(
                |(request_id, layer, tokens, h32, dtype, logit_experts, deadline_us)| {
                    Body::LayerRequest(LayerRequest {
                        request_id,
                        layer,
                        tokens,
                        hidden: h32 * 32,
                        dtype,
                        logit_experts,
                        deadline_us,
                    })
                }
            ),
        (any::<u64>(), 0u32..6, 0u32..70, out_dtype()).prop_map(
            |(request_id, tokens, hidden, dtype)| {
                Body::LayerResponse(LayerResponse {
                    request_id,
                    tokens,
                    hidden,
                    dtype,
                })
            }
        ),
        (
            1u8..11,
            any::<u64>(),
            any::<u64>(),
            0u32..20,
            any::<[u32; 3]>(),
            small_string(300)
        )
            .prop_map(
                |(op, request_id, version, entries, [millis, loaded, released], message)| {
                    let op = [
                        PlacementOp::Hold,
                        PlacementOp::Holding,
                        PlacementOp::Seen,
                        PlacementOp::Apply,
                        PlacementOp::Applied,
                        PlacementOp::Survey,
                        PlacementOp::Settled,
                        PlacementOp::Fetch,
                        PlacementOp::Chunk,
                        PlacementOp::Ack,
                    ][op as usize - 1];
                    Body::Placement(Placement {
                        op,
                        request_id,
                        version,
                        entries,
                        millis,
                        loaded,
                        released,
                        message,
                    })
                }
            ),
    ]
}

proptest! {
    #[test]
    fn placement_entries_round_trip_and_a_wrong_length_is_refused(
        entries in proptest::collection::vec(any::<(u32, u32, u32)>(), 0..40),
        cut in 1usize..12,
    ) {
        let payload = encode_placement_entries(&entries);
        let p = Placement::new(PlacementOp::Hold, 1, entries.len());
        prop_assert_eq!(placement_entries(&p, &payload).unwrap(), entries.clone());
        let mut short = payload.clone();
        short.truncate(payload.len().saturating_sub(cut));
        let short_is_refused = entries.is_empty() || placement_entries(&p, &short).is_err();
        prop_assert!(short_is_refused);
    }
}

fn frame() -> impl Strategy<Value = (Body, Vec<u8>)> {
    body().prop_flat_map(|b| {
        let n = b.expected_payload_len().unwrap() as usize;
        (Just(b), proptest::collection::vec(any::<u8>(), n))
    })
}

fn cfg(checksum: bool) -> CodecConfig {
    CodecConfig {
        max_frame_bytes: 1 << 20,
        payload_checksum: checksum,
    }
}

/// Bodies containing NaN weights compare unequal to themselves; compare their encodings.
fn same(a: &Body, b: &Body) -> bool {
    let c = cfg(false);
    let pa = vec![0u8; a.expected_payload_len().unwrap() as usize];
    encode_frame(a, &pa, &c).unwrap() == encode_frame(b, &pa, &c).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, max_shrink_iters: 200, ..ProptestConfig::default() })]

    #[test]
    fn every_kind_round_trips((b, payload) in frame(), checksum in any::<bool>()) {
        let c = cfg(checksum);
        let bytes = encode_frame(&b, &payload, &c).unwrap();
        prop_assert_eq!(bytes.len(), frame_len(&b, payload.len()));
        let (decoded, range) = decode_frame(&bytes, &c).unwrap();
        prop_assert!(same(&decoded, &b));
        prop_assert_eq!(&bytes[range.clone()], &payload[..]);
        prop_assert_eq!(range.start % PAYLOAD_ALIGN, 0);
    }

    #[test]
    fn stream_decoder_handles_any_chunking(frames in proptest::collection::vec(frame(), 1..5), cuts in proptest::collection::vec(1usize..300, 1..40)) {
        let c = cfg(true);
        let mut stream = Vec::new();
        for (b, p) in &frames {
            stream.extend(encode_frame(b, p, &c).unwrap());
        }
        let mut dec = StreamDecoder::new(c);
        let mut out = Vec::new();
        let mut pos = 0;
        let mut i = 0;
        while pos < stream.len() {
            let n = cuts[i % cuts.len()].min(stream.len() - pos);
            dec.push(&stream[pos..pos + n]);
            pos += n;
            i += 1;
            while let Some(f) = dec.next_frame().unwrap() {
                out.push(f);
            }
        }
        prop_assert_eq!(out.len(), frames.len());
        for ((b, p), (db, dp)) in frames.iter().zip(&out) {
            prop_assert!(same(b, db));
            prop_assert_eq!(p, dp);
        }
    }

    #[test]
    fn truncation_is_an_error((b, payload) in frame(), cut in any::<prop::sample::Index>()) {
        let c = cfg(false);
        let bytes = encode_frame(&b, &payload, &c).unwrap();
        let n = cut.index(bytes.len());
        prop_assert!(decode_frame(&bytes[..n], &c).is_err());
    }

    #[test]
    fn any_bit_flip_in_a_checksummed_frame_is_detected((b, payload) in frame(), bit in any::<prop::sample::Index>()) {
        let c = cfg(true);
        let mut bytes = encode_frame(&b, &payload, &c).unwrap();
        let i = bit.index(bytes.len() * 8);
        bytes[i / 8] ^= 1 << (i % 8);
        prop_assert!(decode_frame(&bytes, &c).is_err(), "flip of bit {} undetected", i);
    }

    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let c = cfg(false);
        let _ = decode_frame(&bytes, &c);
        let mut d = StreamDecoder::new(c);
        d.push(&bytes);
        let _ = d.next_frame();
    }

    #[test]
    fn random_metadata_after_a_valid_header_never_panics(kind in 1u8..10, meta in proptest::collection::vec(any::<u8>(), 0..200)) {
        if let Some(k) = FrameKind::from_u8(kind) {
            let _ = Body::decode_meta(k, &meta);
        }
    }

    #[test]
    fn bf16_and_f16_match_the_half_crate(xs in proptest::collection::vec(any::<f32>(), 1..64)) {
        let n = xs.len();
        for (dtype, width) in [(ActivationDtype::Bf16, 2), (ActivationDtype::F16, 2), (ActivationDtype::F32, 4)] {
            let mut buf = vec![0u8; n * width];
            encode_activations(dtype, 1, n, &xs, &mut buf).unwrap();
            let mut back = vec![0f32; n];
            decode_activations(dtype, 1, n, &buf, &mut back).unwrap();
            for (x, y) in xs.iter().zip(&back) {
                let expect = match dtype {
                    ActivationDtype::Bf16 => bf16::from_f32(*x).to_f32(),
                    ActivationDtype::F16 => f16::from_f32(*x).to_f32(),
                    _ => *x,
                };
                prop_assert!(expect.to_bits() == y.to_bits() || (expect.is_nan() && y.is_nan()));
            }
        }
    }

    #[test]
    fn fp8_error_is_within_e4m3_precision(rows in proptest::collection::vec(proptest::collection::vec(-1e4f32..1e4, 8), 1..4)) {
        let hidden = 8;
        let tokens = rows.len();
        let xs: Vec<f32> = rows.concat();
        let mut buf = vec![0u8; ActivationDtype::Fp8E4m3.payload_bytes(tokens, hidden).unwrap() as usize];
        encode_activations(ActivationDtype::Fp8E4m3, tokens, hidden, &xs, &mut buf).unwrap();
        let mut back = vec![0f32; xs.len()];
        decode_activations(ActivationDtype::Fp8E4m3, tokens, hidden, &buf, &mut back).unwrap();
        for t in 0..tokens {
            let amax = rows[t].iter().fold(0f64, |m, &x| m.max((x as f64).abs()));
            let scale = amax / 448.0;
            for i in 0..hidden {
                let x = rows[t][i] as f64;
                let y = back[t * hidden + i] as f64;
                // Normals: half an ulp of a 3-bit mantissa (2^-4 relative); subnormals: 2^-10 · scale.
                let bound = x.abs() * 2f64.powi(-4) + scale * 2f64.powi(-10) + 1e-6 * amax;
                prop_assert!((x - y).abs() <= bound, "x {} y {} bound {}", x, y, bound);
            }
        }
    }

    #[test]
    fn q8_matches_the_exact_mode_contract(xs in proptest::collection::vec(-100f32..100.0, 64)) {
        let (tokens, hidden) = (2, 32);
        let mut buf = vec![0u8; ActivationDtype::Q8Block32.payload_bytes(tokens, hidden).unwrap() as usize];
        encode_activations(ActivationDtype::Q8Block32, tokens, hidden, &xs, &mut buf).unwrap();
        let mut codes = vec![0i8; 64];
        let mut scales = vec![0f32; 2];
        q8_split(tokens, hidden, &buf, &mut codes, &mut scales).unwrap();
        // Independent restatement of contract §1.
        for b in 0..2 {
            let blk = &xs[b * 32..(b + 1) * 32];
            let amax = blk.iter().fold(0f32, |m, &x| m.max(x.abs()));
            if amax < 2f32.powi(-96) {
                prop_assert_eq!(scales[b], 0.0);
                continue;
            }
            let d = amax / 127.0;
            let inv = 127.0 / amax;
            prop_assert_eq!(scales[b].to_bits(), d.to_bits());
            for j in 0..32 {
                let q = (blk[j] * inv).round_ties_even().clamp(-127.0, 127.0) as i8;
                prop_assert_eq!(codes[b * 32 + j], q);
            }
        }
        let mut back = vec![0f32; 64];
        decode_activations(ActivationDtype::Q8Block32, tokens, hidden, &buf, &mut back).unwrap();
        for i in 0..64 {
            prop_assert_eq!(back[i].to_bits(), (codes[i] as f32 * scales[i / 32]).to_bits());
        }
    }
}

#[test]
fn layer_request_logits_follow_the_states_aligned() {
    let r = LayerRequest {
        request_id: 1,
        layer: 0,
        tokens: 3,
        hidden: 32,
        dtype: ActivationDtype::Bf16,
        logit_experts: 5,
        deadline_us: 0,
    };
    assert_eq!(r.hidden_range(), 0..192);
    assert_eq!(r.logits_range(), Some(192..192 + 60));
    assert_eq!(Body::LayerRequest(r).expected_payload_len().unwrap(), 252);
}

#[test]
fn oversized_length_prefix_is_rejected_before_allocation() {
    let c = cfg(false);
    let mut bytes = encode_frame(&Body::Credit(Credit { bytes: 1 }), &[], &c).unwrap();
    bytes[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
    let crc = crc32c::crc32c(&bytes[..24]);
    bytes[24..28].copy_from_slice(&crc.to_le_bytes());
    assert!(matches!(
        decode_header(&bytes, &c),
        Err(CodecError::TooLarge { .. })
    ));
}
