//! Per-process credentials end to end: `expertmesh keys init|issue` on the command line, and a
//! local fabric whose router, workers and frontend each run with their own issued credentials
//! (issue 15 items 1 and 2).
//!
//! Checks: key and credential files are private (0600) and never overwritten; a fabric with
//! credentials answers bit-identically to the scalar oracle over TCP and shared memory; the
//! activations a frontend sends are not readable on the wire (a proxy sees no plaintext); a
//! frontend without credentials, with another cluster's or with a worker's credential is
//! refused with a reason, and the honest connection goes on.

use expertmesh_fabric::local::{LocalFabric, LocalFabricOptions};
use expertmesh_quant::contract::ComputeMode;
use expertmesh_router::client::RouterClient;
use expertmesh_router::reference;
use expertmesh_transport::crypto::{self, Credentials, Key};
use expertmesh_transport::mesh::LinkKind;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::{Arc, Mutex};

fn mode_of(p: &Path) -> u32 {
    std::fs::metadata(p).unwrap().permissions().mode() & 0o777
}

#[test]
fn keys_cli_writes_private_files_and_never_overwrites() {
    let _machine = crate::support::shared();
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("cluster.key");
    let k = key.to_str().unwrap();
    let topo = crate::support::root().join("examples/single-host.toml");
    let t = topo.to_str().unwrap();
    let r = crate::support::run(&["keys", "init", "--out", k]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(mode_of(&key), 0o600);
    let before = std::fs::read(&key).unwrap();
    let r = crate::support::run(&["keys", "init", "--out", k]);
    assert_eq!(r.code, 2);
    assert!(r.stderr.contains("refusing to overwrite"), "{}", r.stderr);
    // A folder that does not exist: its cause, not a refusal to overwrite.
    let nowhere = dir.path().join("no-such-folder/cluster.key");
    let r = crate::support::run(&["keys", "init", "--out", nowhere.to_str().unwrap()]);
    assert_eq!(r.code, 2);
    assert!(
        r.stderr.contains("os error 2") && !r.stderr.contains("overwrite"),
        "{}",
        r.stderr
    );
    assert_eq!(
        std::fs::read(&key).unwrap(),
        before,
        "the key was overwritten"
    );
    let w = dir.path().join("w.cred");
    let r = crate::support::run(&[
        "keys",
        "issue",
        "--key",
        k,
        "--topology",
        t,
        "--device",
        "local/cpu1",
        "--out",
        w.to_str().unwrap(),
    ]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(mode_of(&w), 0o600);
    let c = Credentials::load(&w).unwrap();
    assert_eq!(
        *c.identity(),
        crypto::Identity::Rank(2),
        "device 1 is mesh rank 2"
    );
    let master = crypto::load_master_key(&key).unwrap();
    assert_eq!(
        c.rank_key("single-host", 2, 0),
        Some(crypto::pair_key(&master, "single-host", 2, 0))
    );
    let r = crate::support::run(&[
        "keys",
        "issue",
        "--key",
        k,
        "--topology",
        t,
        "--device",
        "local/gpu9",
        "--out",
        dir.path().join("x").to_str().unwrap(),
    ]);
    assert_eq!(r.code, 2);
    assert!(r.stderr.contains("local/cpu0, local/cpu1"), "{}", r.stderr);
    // A credential file others can read is refused when loaded.
    std::fs::set_permissions(&w, std::fs::Permissions::from_mode(0o644)).unwrap();
    let e = Credentials::load(&w).unwrap_err().to_string();
    assert!(e.contains("chmod 600"), "{e}");
}

fn options(link: LinkKind, key: &Path) -> LocalFabricOptions {
    let mut o = crate::support::demo_options("single-host.toml", link);
    o.key = Some(key.to_path_buf());
    o
}

/// A TCP proxy that records every byte the client sends.
async fn recording_proxy(
    target: std::net::SocketAddr,
) -> (std::net::SocketAddr, Arc<Mutex<Vec<u8>>>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let seen2 = Arc::clone(&seen);
    tokio::spawn(async move {
        while let Ok((c, _)) = l.accept().await {
            let s = tokio::net::TcpStream::connect(target).await.unwrap();
            let (mut cr, mut cw) = c.into_split();
            let (mut sr, mut sw) = s.into_split();
            let seen = Arc::clone(&seen2);
            tokio::spawn(async move {
                let mut b = vec![0u8; 1 << 16];
                while let Ok(n) = cr.read(&mut b).await {
                    if n == 0 || sw.write_all(&b[..n]).await.is_err() {
                        break;
                    }
                    seen.lock().unwrap().extend_from_slice(&b[..n]);
                }
            });
            tokio::spawn(async move {
                let _ = tokio::io::copy(&mut sr, &mut cw).await;
            });
        }
    });
    (addr, seen)
}

fn secure_fabric_end_to_end(link: LinkKind) {
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("cluster.key");
    crypto::write_secret_file(&key, &crypto::master_key_text(&Key::random().unwrap())).unwrap();
    let fabric = LocalFabric::start(options(link, &key)).unwrap();
    assert_eq!(fabric.service().link_kind(1), Some(link));
    let creds: Vec<_> = std::fs::read_dir(fabric.log_dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "cred"))
        .collect();
    assert_eq!(creds.len(), 2, "one credential file per worker");
    assert!(creds.iter().all(|p| mode_of(p) == 0o600));
    let dep = fabric.deployment();
    let spec = dep.spec.clone();
    let h = spec.hidden as usize;
    let layer = spec.moe_layer_ids()[0];
    let lw = reference::synthetic_layer(&spec, dep.seed, layer).unwrap();
    let rt = crate::support::rt();
    let cfg = fabric.frontend_config();
    assert!(cfg.credentials.is_some());
    let (proxy, seen) = rt.block_on(recording_proxy(fabric.frontend_addr()));
    let mut client = rt.block_on(RouterClient::connect(proxy, &cfg)).unwrap();
    // Distinctive activations: their f32 bytes must never appear on the wire.
    let x: Vec<f32> = (0..4 * h).map(|i| 1.0 + i as f32 / 4096.0).collect();
    let got = rt.block_on(client.call(layer, &x, h, None, None)).unwrap();
    let (_, oracle) = reference::moe_layer(&spec, &lw, &x, ComputeMode::Exact).unwrap();
    assert_eq!(
        crate::support::bits(&got),
        crate::support::bits(&oracle),
        "{link:?}"
    );
    let wire = seen.lock().unwrap().clone();
    let plain: Vec<u8> = x[..64]
        .iter()
        .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
        .collect();
    let plain_f32: Vec<u8> = x[..16].iter().flat_map(|v| v.to_le_bytes()).collect();
    assert!(wire.len() > 4 * h, "the proxy saw the request");
    assert!(
        !wire.windows(plain.len()).any(|w| w == plain)
            && !wire.windows(plain_f32.len()).any(|w| w == plain_f32),
        "activations readable on the wire"
    );
    // Refused: no credentials, another cluster's key, a worker's credential as a frontend.
    let mut none = cfg.clone();
    none.credentials = None;
    let other =
        Credentials::issue_frontend(&Key::from_bytes([7; 32]), dep.topology.name(), "local", 1);
    let worker = Credentials::load(&creds[0]).unwrap();
    for (what, c) in [
        ("none", None),
        ("other cluster key", Some(other)),
        ("worker's", Some(worker)),
    ] {
        let mut f = none.clone();
        f.credentials = c.map(Arc::new);
        let e = rt
            .block_on(RouterClient::connect(fabric.frontend_addr(), &f))
            .err()
            .unwrap_or_else(|| panic!("{what}: connected"));
        assert!(e.to_string().contains("authentication"), "{what}: {e}");
    }
    // The honest client goes on.
    let got = rt.block_on(client.call(layer, &x, h, None, None)).unwrap();
    assert_eq!(crate::support::bits(&got), crate::support::bits(&oracle));
    fabric.shutdown();
}

#[test]
fn fabric_with_issued_credentials_over_tcp() {
    let _machine = crate::support::shared();
    secure_fabric_end_to_end(LinkKind::Tcp);
}

#[test]
fn fabric_with_issued_credentials_over_shm() {
    let _machine = crate::support::shared();
    let Some(_shm) = crate::support::shm_room(crate::support::FABRIC_RINGS) else {
        return;
    };
    secure_fabric_end_to_end(LinkKind::Shm);
}

/// A local fabric whose log folder (given by the caller) still holds the credential files of
/// an earlier fabric with another master key replaces them: its workers join and serve, where
/// the old files would have failed every handshake.
#[test]
fn a_stale_credential_file_in_a_given_log_folder_is_replaced() {
    let _machine = crate::support::shared();
    let dir = tempfile::tempdir().unwrap();
    let logs = dir.path().join("logs");
    for (i, name) in ["first.key", "second.key"].iter().enumerate() {
        let key = dir.path().join(name);
        crypto::write_secret_file(&key, &crypto::master_key_text(&Key::random().unwrap())).unwrap();
        let mut o = options(LinkKind::Tcp, &key);
        o.log_dir = Some(logs.clone());
        let fabric = LocalFabric::start(o).unwrap_or_else(|e| panic!("fabric {i}: {e:#}"));
        let spec = fabric.deployment().spec.clone();
        let h = spec.hidden as usize;
        let layer = spec.moe_layer_ids()[0];
        let rt = crate::support::rt();
        let mut client = rt
            .block_on(RouterClient::connect(
                fabric.frontend_addr(),
                &fabric.frontend_config(),
            ))
            .unwrap();
        let x = vec![0.5f32; h];
        rt.block_on(client.call(layer, &x, h, None, None))
            .unwrap_or_else(|e| panic!("fabric {i}: {e}"));
        fabric.shutdown();
    }
}
