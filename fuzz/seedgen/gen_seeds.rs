//! Writes the seed corpora under `fuzz/seeds/` for the current frame format: one valid frame
//! of every kind (`decode_frame`), a handshake stream (`stream_protocol`), a sealed stream
//! (`sealed_reader`), two small device shards (`shard_file`) and safetensors files
//! (`safetensors_header`), and authenticated transcripts recorded by running an honest peer
//! against the fuzzed end's fixed nonce and keys (`frontend_handshake`, `mesh_handshake`).
//!
//! Why this exists: seeds must be regenerated whenever the frame format, the handshake or the
//! shard format changes (a version bump makes every old seed stop at the header check). Run it
//! from `fuzz/`: `cargo run --release --example gen_seeds`.

use expertmesh_fuzz::{
    FUZZED_NONCE, Fuzzed, PEER_NONCE, frontend_client_config, frontend_server_config,
    honest_exchange, mesh_config, run_frontend_input, run_mesh_input,
};
use expertmesh_transport::codec::{
    self, Auth, Body, CLIENT_RANK, CodecConfig, ComputeMode, Credit, Dispatch, ErrorCode,
    ErrorFrame, ExpertResult, FORMAT_VERSION, Heartbeat, Hello, LayerRequest, LayerResponse,
    LinkInfo, OutputLayout, Placement, PlacementOp, encode_placement_entries,
};
use expertmesh_transport::crypto::{Key, Sealer};
use expertmesh_transport::{ActivationDtype, OutputDtype};
use std::path::Path;

fn write(dir: &str, name: &str, bytes: &[u8]) {
    let d = Path::new("seeds").join(dir);
    std::fs::create_dir_all(&d).expect("create seed dir");
    std::fs::write(d.join(name), bytes).expect("write seed");
}

fn frame(body: &Body, payload: &[u8]) -> Vec<u8> {
    let cfg = CodecConfig {
        max_frame_bytes: 1 << 20,
        payload_checksum: false,
    };
    codec::encode_frame(body, payload, &cfg).expect("valid seed frame")
}

fn hello(rank: u32, attachment: &[u8], identity: &str) -> Body {
    Body::Hello(Hello {
        format_version: FORMAT_VERSION,
        cluster: "fuzz".into(),
        rank,
        world_size: 3,
        recv_window_bytes: 1 << 17,
        auth_required: true,
        nonce: [3; 32],
        attachment: attachment.to_vec(),
        incarnation: 0x1234,
        fingerprint: [5; 32],
        identity: identity.into(),
    })
}

/// One valid frame of every kind, with and without payload checksums.
fn every_kind() -> Vec<(Body, Vec<u8>)> {
    vec![
        (hello(1, b"", ""), vec![]),
        (hello(CLIENT_RANK, b"", "fe-fuzz"), vec![]),
        (hello(2, b"shm:", ""), vec![]),
        (
            Body::Auth(Auth {
                mac: Some([4; 32]),
                identity: Some([5; expertmesh_transport::codec::SEALED_IDENTITY_BYTES]),
            }),
            vec![],
        ),
        (
            Body::Auth(Auth {
                mac: None,
                identity: None,
            }),
            vec![],
        ),
        (
            Body::LinkInfo(LinkInfo {
                attachment: b"shm:/dev/shm/expertmesh-fuzz-1to0-1-00".to_vec(),
            }),
            vec![],
        ),
        (
            Body::Dispatch(Dispatch {
                batch_id: 7,
                layer: 1,
                part: 0,
                tokens: 2,
                hidden: 16,
                dtype: ActivationDtype::F32,
                mode: ComputeMode::Exact,
                layout: OutputLayout::PerSlot,
                result_dtype: OutputDtype::F32,
                expert_counts: vec![2, 1],
                experts: vec![5, 9, 9],
                weights: vec![0.7, 0.3, 1.0],
            }),
            vec![0x3f; 2 * 16 * 4],
        ),
        (
            Body::Result(ExpertResult {
                batch_id: 7,
                layer: 1,
                part: 0,
                layout: OutputLayout::PerSlot,
                rows: 3,
                hidden: 16,
                dtype: OutputDtype::F32,
            }),
            vec![0x40; 3 * 16 * 4],
        ),
        (
            Body::Error(ErrorFrame {
                request_id: 9,
                part: None,
                code: ErrorCode::Overloaded,
                message: "router has 64 batches in flight".into(),
            }),
            vec![],
        ),
        (
            Body::Heartbeat(Heartbeat {
                seq: 3,
                sent_at_us: 1000,
            }),
            vec![],
        ),
        (Body::Credit(Credit { bytes: 65536 }), vec![]),
        (layer_request(11), vec![0x3e; 3 * 16 * 4]),
        (
            Body::LayerResponse(LayerResponse {
                request_id: 11,
                tokens: 3,
                hidden: 16,
                dtype: OutputDtype::F32,
            }),
            vec![0x3d; 3 * 16 * 4],
        ),
        (
            Body::Placement(Placement::new(PlacementOp::Hold, 2, 2)),
            encode_placement_entries(&[(1, 0, 3), (1, 0, 4)]),
        ),
    ]
}

fn layer_request(id: u64) -> Body {
    Body::LayerRequest(LayerRequest {
        request_id: id,
        layer: 0,
        tokens: 3,
        hidden: 16,
        dtype: ActivationDtype::F32,
        logit_experts: 0,
        deadline_us: 1_000_000,
    })
}

fn decode_frame_seeds() {
    for (i, (body, payload)) in every_kind().iter().enumerate() {
        write(
            "decode_frame",
            &format!("seed{i:02}"),
            &frame(body, payload),
        );
        let cfg = CodecConfig {
            max_frame_bytes: 1 << 20,
            payload_checksum: true,
        };
        let crc = codec::encode_frame(body, payload, &cfg).expect("valid");
        write("decode_frame", &format!("seed{i:02}-crc"), &crc);
    }
}

fn stream_protocol_seeds() {
    // ctl 0x3c: chunks of 15 bytes, no checksum, no credentials.
    let mut s = vec![0x3c];
    s.extend(frame(&hello(1, b"", ""), &[]));
    s.extend(frame(
        &Body::Auth(Auth {
            mac: None,
            identity: None,
        }),
        &[],
    ));
    s.extend(frame(
        &Body::Heartbeat(Heartbeat {
            seq: 1,
            sent_at_us: 5,
        }),
        &[],
    ));
    s.extend(frame(&Body::Credit(Credit { bytes: 4096 }), &[]));
    let (b, p) = &every_kind()[7];
    s.extend(frame(b, p));
    write("stream_protocol", "seed00", &s);
}

fn sealed_reader_seeds() {
    // Raw mode (even first byte): a sealed stream of every post-auth kind under the target's key.
    let mut sealer = Sealer::new(&Key::from_bytes([9; 32]));
    let mut raw = vec![0u8];
    for (body, payload) in every_kind().iter().skip(5) {
        let bytes = frame(body, payload);
        let h = codec::head_len(body);
        let mut out = Vec::new();
        sealer
            .seal_frame(&bytes[..h], &bytes[h..], &mut out)
            .expect("seal");
        raw.extend(out);
    }
    write("sealed_reader", "raw00", &raw);
    // Tamper mode (odd first byte): flip position, bit, then frame material.
    let mut t = vec![1u8, 0x10, 0x00, 3];
    t.extend((0..200u8).map(|i| i.wrapping_mul(37)));
    write("sealed_reader", "tamper00", &t);
    let mut t = vec![1u8, 0x02, 0x00, 5];
    t.extend(
        b"hello sealed world, this is a frame body"
            .iter()
            .cycle()
            .take(300),
    );
    write("sealed_reader", "tamper01", &t);
}

fn frontend_seeds() {
    let mut server = Fuzzed::new(frontend_server_config(), None, FUZZED_NONCE, false);
    let mut client = Fuzzed::new(frontend_client_config(), Some(0), PEER_NONCE, false);
    let (mut stream, ok) = honest_exchange(&mut server, &mut client);
    assert!(ok, "honest frontend handshake against the fuzzed end");
    let payload = vec![0x3e; 3 * 16 * 4];
    let mut app = client.seal_app(&layer_request(1), &payload);
    app.extend(client.seal_app(
        &Body::Heartbeat(Heartbeat {
            seq: 1,
            sent_at_us: 9,
        }),
        &[],
    ));
    app.extend(client.seal_app(&layer_request(2), &payload));
    server
        .push(&app)
        .expect("the fuzzed end opens the sealed requests");
    assert_eq!(
        server.outcome().delivered,
        2,
        "both sealed requests delivered"
    );
    stream.extend(app);
    for (name, ctl) in [("auth00", 0x3f), ("auth01", 0x07), ("auth02", 0xbf)] {
        let mut s = vec![ctl];
        s.extend(&stream);
        // The seed replays in the target: authenticated, both requests delivered.
        let f = run_frontend_input(&s).expect("non-empty");
        assert!(
            f.outcome().established,
            "{name} does not authenticate in the target"
        );
        assert_eq!(
            f.outcome().delivered,
            2,
            "{name}: sealed requests not delivered"
        );
        write("frontend_handshake", name, &s);
    }
    // Unauthenticated openings: a hello without credentials, and a header announcing a
    // maximum-size frame.
    let mut s = vec![0x3f];
    let mut h = hello(CLIENT_RANK, b"", "fe-fuzz");
    if let Body::Hello(x) = &mut h {
        x.auth_required = false;
        x.world_size = 1;
    }
    s.extend(frame(&h, &[]));
    s.extend(frame(
        &Body::Auth(Auth {
            mac: None,
            identity: None,
        }),
        &[],
    ));
    write("frontend_handshake", "insecure00", &s);
    let mut big = frame(&layer_request(3), &[0u8; 3 * 16 * 4]);
    big.truncate(64);
    let mut s = vec![0x3f];
    s.extend(big);
    write("frontend_handshake", "preauth00", &s);
}

fn frontend_socket_seeds() {
    // An insecure client (the server runs without credentials on loopback): hello, empty auth,
    // then requests, a heartbeat, and a request with bad metadata (recoverable).
    let mut h = hello(CLIENT_RANK, b"", "");
    if let Body::Hello(x) = &mut h {
        x.cluster = "fuzz".into();
        x.auth_required = false;
        x.world_size = 1;
        x.incarnation = 0;
        x.fingerprint = [0; 32];
    }
    let mut s = frame(&h, &[]);
    s.extend(frame(
        &Body::Auth(Auth {
            mac: None,
            identity: None,
        }),
        &[],
    ));
    let payload = vec![0x3e; 3 * 16 * 4];
    s.extend(frame(&layer_request(1), &payload));
    s.extend(frame(
        &Body::Heartbeat(Heartbeat {
            seq: 1,
            sent_at_us: 2,
        }),
        &[],
    ));
    let mut bad = frame(&layer_request(2), &payload);
    bad[32 + 20] = 0xff; // the dtype byte: still framed, a recoverable bad frame
    s.extend(&bad);
    s.extend(frame(&layer_request(3), &payload));
    write("frontend_socket", "insecure00", &s);
    write("frontend_socket", "hello00", &frame(&h, &[]));
}

fn mesh_seeds() {
    for (rank, shm) in [(1u32, false), (2, true)] {
        let mut acceptor = Fuzzed::new(mesh_config(0), None, FUZZED_NONCE, shm);
        let mut dialer = Fuzzed::new(mesh_config(rank), Some(0), PEER_NONCE, shm);
        let (mut stream, ok) = honest_exchange(&mut acceptor, &mut dialer);
        assert!(ok, "honest mesh handshake of rank {rank} (shm {shm})");
        if !shm {
            let (b, p) = &every_kind()[7];
            stream.extend(dialer.seal_app(b, p));
            stream.extend(dialer.seal_app(&Body::Credit(Credit { bytes: 1 << 15 }), &[]));
            stream.extend(dialer.seal_app(
                &Body::Heartbeat(Heartbeat {
                    seq: 2,
                    sent_at_us: 3,
                }),
                &[],
            ));
        }
        for (i, ctl) in [0x3fu8, 0x0b].into_iter().enumerate() {
            let mut s = vec![ctl];
            s.extend(&stream);
            let f = run_mesh_input(&s).expect("non-empty");
            assert!(
                f.outcome().established,
                "rank {rank} seed does not authenticate in the target: {:?} {:?} {:?}",
                f.conn().close_reason(),
                f.conn().pending_link(),
                f.conn().awaits_link_info()
            );
            assert_eq!(
                f.outcome().delivered,
                if shm { 0 } else { 1 },
                "rank {rank}: frames"
            );
            write("mesh_handshake", &format!("rank{rank}-{i}"), &s);
        }
    }
}

fn rdma_link_info_seeds() {
    use expertmesh_transport::rdma::wire::{FabricEndpoint, LinkInfo};
    let mut endpoint = Vec::new();
    FabricEndpoint {
        provider: b"tcp;ofi_rxm",
        name: &[2, 0, 0x9c, 0x40, 127, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0],
        base: 0,
        key: 1,
    }
    .encode(&mut endpoint);
    for (i, (tag, ep)) in [(2u8, endpoint.as_slice()), (3, &7u64.to_le_bytes()[..])]
        .into_iter()
        .enumerate()
    {
        let mut b = Vec::new();
        LinkInfo {
            provider_tag: tag,
            ring_capacity: 32 << 20,
            endpoint: ep,
        }
        .encode(&mut b);
        write("rdma_link_info", &format!("seed{i}"), &b);
    }
}

/// `shard_file`: two small device shards as `convert` writes them (G32 bf16 symmetric, and
/// G128 f16 with zero points), each with two experts and a router tensor, so mutations start
/// past the header check.
fn shard_file_seeds() {
    use expertmesh_quant::format::{QuantSpec, ScaleDtype};
    use expertmesh_quant::synth::synthetic_expert;
    use expertmesh_shard::file::{ShardIndex, ShardKind, ShardWriter};
    let specs = [
        QuantSpec::G32_BF16,
        QuantSpec {
            group_size: 128,
            scale_dtype: ScaleDtype::F16,
            zero_points: true,
        },
    ];
    let dir = std::env::temp_dir().join(format!("gen-seeds-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temporary folder");
    for (i, quant) in specs.into_iter().enumerate() {
        let path = dir.join(format!("seed{i}.shard"));
        let index = ShardIndex {
            kind: ShardKind::Device,
            fingerprint: "fuzz".into(),
            device: Some("local/cpu0".into()),
            quant,
            hidden: 128,
            experts: Vec::new(),
            tensors: Vec::new(),
        };
        let mut w = ShardWriter::create(&path, index).expect("create seed shard");
        for e in 0..2u32 {
            let x = synthetic_expert(quant, 128, 128, 7, 1, e).expect("synthetic expert");
            w.add_expert(1, e, &x, 0.01).expect("add expert");
        }
        w.add_tensor_f32("layers.1.gate.weight", &[2, 2], &[1.0, -2.0, 0.5, 0.0])
            .expect("add tensor");
        w.finish().expect("finish seed shard");
        write(
            "shard_file",
            &format!("seed{i}"),
            &std::fs::read(&path).expect("read seed shard"),
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `safetensors_header`: small files as Hugging Face writes them (8-byte little-endian header
/// length, the JSON header, the tensors' bytes), so mutations start from a valid header.
fn safetensors_header_seeds() {
    let headers = [
        r#"{"__metadata__":{"format":"pt"},"model.layers.1.mlp.experts.0.gate_proj.weight":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,12]},"model.layers.1.mlp.gate.weight":{"dtype":"F32","shape":[2],"data_offsets":[12,20]}}"#,
        r#"{"w":{"dtype":"F8_E4M3","shape":[4,4],"data_offsets":[0,16]},"w_scale_inv":{"dtype":"F32","shape":[1,1],"data_offsets":[16,20]},"e":{"dtype":"I64","shape":[0],"data_offsets":[20,20]}}"#,
    ];
    for (i, header) in headers.iter().enumerate() {
        let mut file = (header.len() as u64).to_le_bytes().to_vec();
        file.extend_from_slice(header.as_bytes());
        file.extend((0..20u8).map(|b| b.wrapping_mul(37)));
        write("safetensors_header", &format!("seed{i}"), &file);
    }
}

fn main() {
    safetensors_header_seeds();
    shard_file_seeds();
    decode_frame_seeds();
    stream_protocol_seeds();
    sealed_reader_seeds();
    frontend_seeds();
    frontend_socket_seeds();
    mesh_seeds();
    rdma_link_info_seeds();
    println!("seeds written under fuzz/seeds/");
}
