//! Frontend connections (router service ↔ serving frontends) over real sockets: request and
//! response, a bad frame answered with an error frame while the connection goes on, garbage
//! closing only that connection, and refused authentication.
//!
//! Why this exists: the router service and `RouterClient` are built on these types; their
//! error handling must be right before anything is layered on top.

use expertmesh_transport::codec::{self, Body, ErrorCode, LayerRequest, LayerResponse};
use expertmesh_transport::crypto::Credentials;
use expertmesh_transport::dtype::{self, ActivationDtype, OutputDtype};
use expertmesh_transport::frontend::{
    FrameConnection, FrameListener, FrontendConfig, FrontendError,
};
use expertmesh_transport::protocol::{Connection, ProtocolConfig};
use std::sync::Arc;
use std::time::Duration;
use std::time::Instant;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const T: Duration = Duration::from_secs(30);

/// A toy service: answers each LayerRequest with `2·x` (decoded from the request's dtype), and
/// bad frames with error frames.
async fn serve(listener: FrameListener) {
    loop {
        let Ok(incoming) = listener.accept().await else {
            return;
        };
        tokio::spawn(async move {
            let Ok(conn) = incoming.handshake().await else {
                return;
            };
            let (mut r, mut w) = conn.split();
            loop {
                match r.read_frame().await {
                    Ok(f) => {
                        let Body::LayerRequest(req) = f.body().clone() else {
                            let _ = w
                                .write_error(0, ErrorCode::Unsupported, "expected a layer request")
                                .await;
                            continue;
                        };
                        let (t, h) = (req.tokens as usize, req.hidden as usize);
                        let mut x = vec![0f32; t * h];
                        dtype::decode_activations(
                            req.dtype,
                            t,
                            h,
                            &f.payload()[req.hidden_range()],
                            &mut x,
                        )
                        .unwrap();
                        let y: Vec<f32> = x.iter().map(|v| 2.0 * v).collect();
                        let mut out = vec![0u8; y.len() * 4];
                        dtype::encode_output(OutputDtype::F32, &y, &mut out).unwrap();
                        let resp = Body::LayerResponse(LayerResponse {
                            request_id: req.request_id,
                            tokens: req.tokens,
                            hidden: req.hidden,
                            dtype: OutputDtype::F32,
                        });
                        if w.write_frame(&resp, &out).await.is_err() {
                            return;
                        }
                    }
                    Err(FrontendError::BadFrame {
                        recoverable: true,
                        request_id,
                        error,
                        ..
                    }) => {
                        let _ = w
                            .write_error(
                                request_id.unwrap_or(0),
                                ErrorCode::BadFrame,
                                &error.to_string(),
                            )
                            .await;
                    }
                    Err(_) => return,
                }
            }
        });
    }
}

async fn start(cfg: FrontendConfig) -> std::net::SocketAddr {
    let l = FrameListener::bind("127.0.0.1:0".parse().unwrap(), cfg)
        .await
        .unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(serve(l));
    addr
}

fn request(id: u64, tokens: u32, hidden: u32) -> (Body, Vec<u8>, Vec<f32>) {
    let x: Vec<f32> = (0..tokens * hidden)
        .map(|i| (i as f32 - 10.0) * 0.25)
        .collect();
    let req = LayerRequest {
        request_id: id,
        layer: 2,
        tokens,
        hidden,
        dtype: ActivationDtype::Bf16,
        logit_experts: 0,
        deadline_us: 1000,
    };
    let mut payload = vec![
        0u8;
        ActivationDtype::Bf16
            .payload_bytes(tokens as usize, hidden as usize)
            .unwrap() as usize
    ];
    dtype::encode_activations(
        ActivationDtype::Bf16,
        tokens as usize,
        hidden as usize,
        &x,
        &mut payload,
    )
    .unwrap();
    (Body::LayerRequest(req), payload, x)
}

#[tokio::test]
async fn request_response_and_recoverable_bad_frame() {
    let cfg = FrontendConfig::new("fe");
    let addr = start(cfg.clone()).await;
    let mut c = FrameConnection::connect(addr, &cfg).await.unwrap();
    let (body, payload, x) = request(11, 3, 64);
    c.write_frame(&body, &payload).await.unwrap();
    let f = tokio::time::timeout(T, c.read_frame())
        .await
        .unwrap()
        .unwrap();
    let Body::LayerResponse(r) = f.body() else {
        panic!("{:?}", f.body())
    };
    assert_eq!((r.request_id, r.tokens, r.hidden), (11, 3, 64));
    let mut y = vec![0f32; x.len()];
    dtype::decode_output(OutputDtype::F32, f.payload(), &mut y).unwrap();
    for (a, b) in x.iter().zip(&y) {
        // x values are exact in bf16 (multiples of 0.25 below 2^8).
        assert_eq!(*b, 2.0 * a);
    }
    // An unexpected kind is answered with an error frame; the connection goes on.
    let bad = Body::LayerResponse(LayerResponse {
        request_id: 13,
        tokens: 1,
        hidden: 4,
        dtype: OutputDtype::F32,
    });
    c.write_frame(&bad, &[0u8; 16]).await.unwrap();
    let f = tokio::time::timeout(T, c.read_frame())
        .await
        .unwrap()
        .unwrap();
    assert!(matches!(f.body(), Body::Error(e) if e.code == ErrorCode::Unsupported));
    let (body, payload, _) = request(14, 1, 32);
    c.write_frame(&body, &payload).await.unwrap();
    let f = tokio::time::timeout(T, c.read_frame())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(f.body().request_id(), Some(14));
}

/// A raw socket that completed the client handshake, for injecting malformed frames.
async fn raw_client(
    addr: std::net::SocketAddr,
    cfg: &FrontendConfig,
) -> (tokio::net::TcpStream, codec::StreamDecoder) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut p = ProtocolConfig::new(cfg.cluster.clone(), codec::CLIENT_RANK, 1);
    p.codec = cfg.codec;
    p.recv_window_bytes = 2 * cfg.codec.max_frame_bytes as u64;
    p.credentials = cfg.credentials.clone();
    let mut conn = Connection::new(Arc::new(p), None, [9; 32], Vec::new(), Instant::now());
    let mut dec = codec::StreamDecoder::new(cfg.codec);
    loop {
        while let Some(b) = conn.poll_transmit() {
            s.write_all(&codec::encode_frame(&b, &[], &cfg.codec).unwrap())
                .await
                .unwrap();
        }
        if conn.is_established() {
            return (s, dec);
        }
        let mut buf = [0u8; 4096];
        let n = tokio::time::timeout(T, s.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert!(n > 0);
        dec.push(&buf[..n]);
        while let Some((b, _)) = dec.next_frame().unwrap() {
            conn.handle_frame(Instant::now(), &b, 0).unwrap();
        }
    }
}

async fn next_frame(
    s: &mut tokio::net::TcpStream,
    dec: &mut codec::StreamDecoder,
) -> (Body, Vec<u8>) {
    loop {
        if let Some(f) = dec.next_frame().unwrap() {
            return f;
        }
        let mut buf = [0u8; 65536];
        let n = tokio::time::timeout(T, s.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert!(n > 0, "server closed the connection");
        dec.push(&buf[..n]);
    }
}

#[tokio::test]
async fn intact_header_with_bad_metadata_is_answered_and_the_connection_goes_on() {
    let cfg = FrontendConfig::new("fe");
    let addr = start(cfg.clone()).await;
    let (mut s, mut dec) = raw_client(addr, &cfg).await;
    // Valid header, but the payload is 64 bytes shorter than the metadata describes.
    let (body, payload, _) = request(12, 2, 32);
    let mut raw = codec::encode_frame(&body, &payload, &cfg.codec).unwrap();
    let short = raw.len() - 64;
    raw.truncate(short);
    let payload_len = (short - codec::head_len(&body)) as u32;
    raw[8..12].copy_from_slice(&(short as u32).to_le_bytes());
    raw[16..20].copy_from_slice(&payload_len.to_le_bytes());
    let crc = crc32c::crc32c(&raw[..24]);
    raw[24..28].copy_from_slice(&crc.to_le_bytes());
    s.write_all(&raw).await.unwrap();
    let (b, _) = next_frame(&mut s, &mut dec).await;
    let Body::Error(e) = b else { panic!("{b:?}") };
    assert_eq!((e.request_id, e.code), (12, ErrorCode::BadFrame));
    assert!(e.message.contains("payload"), "{}", e.message);
    // Same connection, valid request: served.
    let (body, payload, _) = request(15, 1, 32);
    s.write_all(&codec::encode_frame(&body, &payload, &cfg.codec).unwrap())
        .await
        .unwrap();
    let (b, _) = next_frame(&mut s, &mut dec).await;
    assert_eq!(b.request_id(), Some(15));
    // A broken header (bad magic) is not recoverable: the server closes the connection.
    s.write_all(&[0u8; 64]).await.unwrap();
    let mut rest = Vec::new();
    let _ = tokio::time::timeout(T, s.read_to_end(&mut rest))
        .await
        .expect("closed");
    assert!(rest.is_empty());
}

#[tokio::test]
async fn garbage_closes_only_that_connection_and_auth_failures_are_refused() {
    let mut cfg = FrontendConfig::new("fe");
    cfg.credentials = Some(Arc::new(Credentials::shared_secret(b"k")));
    let addr = start(cfg.clone()).await;
    let mut good = FrameConnection::connect(addr, &cfg).await.unwrap();
    // Garbage on another socket: closed without an answer.
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(&[0xAB; 100]).await.unwrap();
    let mut buf = Vec::new();
    let _ = tokio::time::timeout(T, s.read_to_end(&mut buf))
        .await
        .expect("closed");
    // Wrong secret: refused with a clear error.
    let mut wrong = cfg.clone();
    wrong.credentials = Some(Arc::new(Credentials::shared_secret(b"nope")));
    let err = FrameConnection::connect(addr, &wrong).await.unwrap_err();
    assert!(
        err.to_string().contains("authentication") || err.to_string().contains("refused"),
        "{err}"
    );
    // No secret at all: refused too.
    let mut none = cfg.clone();
    none.credentials = None;
    assert!(FrameConnection::connect(addr, &none).await.is_err());
    // The good connection is unaffected.
    let (body, payload, _) = request(1, 1, 32);
    good.write_frame(&body, &payload).await.unwrap();
    let f = tokio::time::timeout(T, good.read_frame())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(f.body().request_id(), Some(1));
}

/// A client that stops sending in the middle of a frame (its header read, half its payload
/// sent) is closed once the frame timeout passes, instead of holding the server's reader
/// (and, in the router, its request's share of the capacity) for as long as its socket stays
/// open. Without the timeout this test waits out its 30 s cap and fails.
#[tokio::test]
async fn a_client_that_stops_mid_frame_is_closed_after_the_frame_timeout() {
    let mut cfg = FrontendConfig::new("fe");
    cfg.frame_timeout = Some(Duration::from_millis(300));
    let addr = start(cfg.clone()).await;
    let (mut s, _) = raw_client(addr, &cfg).await;
    let (body, payload, _) = request(21, 64, 256);
    let raw = codec::encode_frame(&body, &payload, &cfg.codec).unwrap();
    s.write_all(&raw[..raw.len() / 2]).await.unwrap();
    let mut rest = Vec::new();
    let ended = tokio::time::timeout(T, s.read_to_end(&mut rest)).await;
    assert!(
        ended.is_ok(),
        "the server still holds a connection stalled mid-frame after {T:?}"
    );
    assert!(rest.is_empty(), "no answer to half a frame: {rest:?}");
}

/// After a read stopped mid-frame, the stream is no longer framed: every later read fails at
/// once, however valid the client's next bytes look (they must never be taken for a frame);
/// `shut_down` then ends the connection for the client too.
#[tokio::test]
async fn after_a_stall_nothing_more_is_read_and_shut_down_ends_the_connection() {
    let mut cfg = FrontendConfig::new("fe");
    cfg.frame_timeout = Some(Duration::from_millis(300));
    let listener = FrameListener::bind("127.0.0.1:0".parse().unwrap(), cfg.clone())
        .await
        .unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move {
        listener
            .accept()
            .await
            .unwrap()
            .handshake()
            .await
            .unwrap()
            .split()
    });
    let (mut s, _) = raw_client(addr, &cfg).await;
    // The writing half stays alive: only `shut_down` can end the connection below.
    let (mut r, _w) = tokio::time::timeout(T, server).await.unwrap().unwrap();
    let (body, payload, _) = request(31, 8, 64);
    let raw = codec::encode_frame(&body, &payload, &cfg.codec).unwrap();
    s.write_all(&raw[..raw.len() / 2]).await.unwrap();
    let first = tokio::time::timeout(T, r.read_frame())
        .await
        .expect("the stall ends");
    let Err(FrontendError::Io { source, .. }) = &first else {
        panic!("{first:?}")
    };
    assert_eq!(source.kind(), std::io::ErrorKind::TimedOut, "{source}");
    // The rest of that frame and a whole valid one: not read as frames.
    s.write_all(&raw[raw.len() / 2..]).await.unwrap();
    s.write_all(&raw).await.unwrap();
    let again = tokio::time::timeout(T, r.read_frame())
        .await
        .expect("at once");
    assert!(
        matches!(&again, Err(FrontendError::Io { source, .. }) if source.to_string().contains("did not arrive within")),
        "{again:?}"
    );
    let mut rest = Vec::new();
    let open = tokio::time::timeout(Duration::from_millis(200), s.read_to_end(&mut rest)).await;
    assert!(open.is_err(), "the connection ended before shut_down");
    r.shut_down();
    let ended = tokio::time::timeout(T, s.read_to_end(&mut rest)).await;
    assert!(
        ended.is_ok(),
        "the client did not see the end after shut_down"
    );
}
