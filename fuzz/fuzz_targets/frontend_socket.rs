//! Fuzz target: the real async path of a frontend connection over a loopback socket. A
//! `FrameListener` (no credentials: the insecure loopback mode, so arbitrary bytes reach the
//! frame reader after the handshake) accepts one connection per input; the input is written to
//! it and the write side shut; the server runs `IncomingClient::handshake` and then
//! `FrameConnection::read_frame` until the stream ends or breaks, as the router service does
//! (a recoverable bad frame is skipped, anything else closes the connection).
//!
//! Checks: never panics; the server always ends the connection (the client sees end of
//! stream within the handshake timeout), so no input keeps a server task alive.
#![no_main]

use expertmesh_transport::frontend::{FrameListener, FrontendConfig, FrontendError};
use libfuzzer_sys::fuzz_target;
use std::net::SocketAddr;
use std::sync::OnceLock;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::runtime::Runtime;

fn server() -> &'static (Runtime, SocketAddr) {
    static S: OnceLock<(Runtime, SocketAddr)> = OnceLock::new();
    S.get_or_init(|| {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime");
        let mut cfg = FrontendConfig::new("fuzz");
        cfg.codec.max_frame_bytes = 1 << 16;
        cfg.handshake_timeout = Duration::from_secs(2);
        let listener = rt
            .block_on(FrameListener::bind("127.0.0.1:0".parse().unwrap(), cfg))
            .expect("bind");
        let addr = listener.local_addr().expect("address");
        rt.spawn(async move {
            while let Ok(incoming) = listener.accept().await {
                tokio::spawn(async move {
                    let Ok(mut conn) = incoming.handshake().await else {
                        return;
                    };
                    loop {
                        match conn.read_frame().await {
                            Ok(_) => {}
                            Err(FrontendError::BadFrame {
                                recoverable: true, ..
                            }) => {}
                            Err(_) => return,
                        }
                    }
                });
            }
        });
        (rt, addr)
    })
}

fuzz_target!(|data: &[u8]| {
    let (rt, addr) = server();
    rt.block_on(async {
        let Ok(mut s) = tokio::net::TcpStream::connect(*addr).await else {
            return;
        };
        let _ = s.write_all(data).await;
        let _ = s.shutdown().await;
        let mut buf = [0u8; 4096];
        let drained = tokio::time::timeout(Duration::from_secs(4), async {
            loop {
                match s.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
            }
        })
        .await;
        assert!(
            drained.is_ok(),
            "the server kept a connection open after end of input"
        );
    });
});
