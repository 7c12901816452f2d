//! Fuzz target: the TCP link's frame reader after authentication (the sealed record layer:
//! length prefix, sealed head, header check, sealed payload), in two modes chosen by the
//! first byte.
//!
//! - Raw: arbitrary bytes opened record after record with a fixed key. Never panics; never
//!   asks for more than the announced, bounded lengths.
//! - Tamper: frames built from the input are sealed, one byte of the sealed stream (position
//!   and bit from the input) is flipped, and the stream is opened again. Every record before
//!   the flipped one opens to exactly what was sealed; the flipped one never opens (a tampered
//!   frame is always detected); nothing after it is read.
#![no_main]

use expertmesh_transport::OutputDtype;
use expertmesh_transport::codec::{self, Body, CodecConfig, ErrorCode, ErrorFrame, LayerResponse};
use expertmesh_transport::crypto::{self, Key, Opener, Sealer};
use libfuzzer_sys::fuzz_target;

const CFG: CodecConfig = CodecConfig {
    max_frame_bytes: 1 << 16,
    payload_checksum: false,
};

fn key() -> Key {
    Key::from_bytes([9; 32])
}

/// Frames made from `data`: pieces of it as error messages and as f32 response payloads.
fn frames(data: &[u8]) -> Vec<Vec<u8>> {
    data.chunks(64)
        .take(8)
        .enumerate()
        .map(|(i, piece)| {
            let (body, payload) = if i % 2 == 0 {
                let message: String = piece.iter().map(|&b| (b'a' + b % 26) as char).collect();
                let body = Body::Error(ErrorFrame {
                    request_id: i as u64,
                    part: None,
                    code: ErrorCode::BadFrame,
                    message,
                });
                (body, Vec::new())
            } else {
                let mut p = piece.to_vec();
                p.resize(piece.len().div_ceil(4) * 4, 0);
                let body = Body::LayerResponse(LayerResponse {
                    request_id: i as u64,
                    tokens: 1,
                    hidden: (p.len() / 4) as u32,
                    dtype: OutputDtype::F32,
                });
                (body, p)
            };
            let mut head = Vec::new();
            codec::encode_head(&body, &payload, &CFG, &mut head).expect("valid frame");
            head.extend_from_slice(&payload);
            head
        })
        .collect()
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    if mode & 1 == 0 {
        let mut opener = Opener::new(&key());
        let mut at = 0;
        while at < rest.len() {
            match crypto::open_frame(&mut opener, &rest[at..], &CFG) {
                Ok((plain, used)) => {
                    assert!(used > 0 && plain.len() <= CFG.max_frame_bytes);
                    let _ = codec::decode_frame(&plain, &CFG);
                    at += used;
                }
                Err(_) => break,
            }
        }
        return;
    }
    if rest.len() < 3 {
        return;
    }
    let pos = u16::from_le_bytes([rest[0], rest[1]]) as usize;
    let mask = 1u8 << (rest[2] & 7);
    let plain = frames(&rest[3..]);
    if plain.is_empty() {
        return;
    }
    let mut sealer = Sealer::new(&key());
    let mut stream = Vec::new();
    let mut bounds = Vec::new();
    for f in &plain {
        let h = codec::decode_header(f, &CFG).expect("own frame");
        let head_len = h.payload_offset();
        let mut out = Vec::new();
        sealer
            .seal_frame(&f[..head_len], &f[head_len..], &mut out)
            .expect("seal");
        bounds.push((stream.len(), stream.len() + out.len()));
        stream.extend_from_slice(&out);
    }
    let flip = pos % stream.len();
    stream[flip] ^= mask;
    let hit = bounds
        .iter()
        .position(|&(s, e)| (s..e).contains(&flip))
        .expect("in a record");
    let mut opener = Opener::new(&key());
    let mut at = 0;
    for (i, f) in plain.iter().enumerate() {
        let r = crypto::open_frame(&mut opener, &stream[at..], &CFG);
        if i < hit {
            let (got, used) = r.expect("an untouched record opens");
            assert_eq!(&got, f, "record {i} opened to other bytes");
            at += used;
        } else {
            assert!(
                r.is_err(),
                "record {i} with a flipped byte at {flip} opened"
            );
            break;
        }
    }
});
