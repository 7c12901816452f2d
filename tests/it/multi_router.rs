//! Many routers, one expert pool: two router services share the same two worker processes
//! (examples/single-host-2routers.toml), each with its own frontends.
//!
//! Checks: under concurrent load from clients of both routers every answer is bit-identical
//! to the in-process reference (exact mode); a router that stops under load costs only its own
//! requests (the other router's calls all succeed, bit for bit); a router whose clients keep
//! every worker busy with large pipelined batches does not block the other router's small
//! calls. Worker-side fairness (round robin over routers) is unit-tested in
//! `worker/src/fair.rs` against a brute-force model.

use crate::support::{bits, rt};
use expertmesh_fabric::local::LocalFabric;
use expertmesh_router::client::{ClientError, RouterClient};
use expertmesh_transport::codec::ErrorCode;
use expertmesh_transport::frontend::FrontendConfig;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use crate::support::two_routers as start;

/// A set of (layer, input, expected output bits) computed by the in-process reference.
struct Cases {
    hidden: usize,
    cases: Vec<(u32, Vec<f32>, Vec<u32>)>,
}

fn cases(fabric: &LocalFabric, token_counts: &[usize], salt: u64) -> Arc<Cases> {
    let dep = fabric.deployment();
    Arc::new(Cases {
        hidden: dep.spec.hidden as usize,
        cases: crate::support::reference_cases(&dep.spec, dep.seed, token_counts, salt),
    })
}

/// Runs `rounds` rounds over `cases` against `addr`, pipelining `depth` requests; returns
/// (answers bit-identical, wrong answers, errors, of which deadlines). Stops early when `stop`
/// is set or after the chunk with the first error.
fn drive(
    addr: SocketAddr,
    cfg: &FrontendConfig,
    cases: &Cases,
    rounds: usize,
    depth: usize,
    stop: &AtomicBool,
) -> (usize, usize, usize, usize) {
    let rt = rt();
    let Ok(mut client) = rt.block_on(RouterClient::connect(addr, cfg)) else {
        return (0, 0, 1, 0);
    };
    let (mut ok, mut wrong, mut err, mut late) = (0, 0, 0, 0);
    let deadline = |e: &ClientError| usize::from(e.code() == Some(ErrorCode::DeadlineExceeded));
    for _ in 0..rounds {
        for chunk in cases.cases.chunks(depth) {
            if stop.load(Ordering::Relaxed) {
                return (ok, wrong, err, late);
            }
            let mut handles = Vec::new();
            for (layer, x, want) in chunk {
                let d = Some(Duration::from_secs(10));
                match rt.block_on(client.submit(*layer, x, cases.hidden, None, d)) {
                    Ok(hd) => handles.push((hd, want)),
                    Err(e) => (err, late) = (err + 1, late + deadline(&e)),
                }
            }
            for (hd, want) in handles {
                match rt.block_on(client.wait(hd)) {
                    Ok(got) if bits(&got) == **want => ok += 1,
                    Ok(_) => wrong += 1,
                    Err(e) => (err, late) = (err + 1, late + deadline(&e)),
                }
            }
            if err > 0 {
                return (ok, wrong, err, late);
            }
        }
    }
    (ok, wrong, err, late)
}

#[test]
fn clients_of_both_routers_get_bit_identical_answers_under_concurrent_load() {
    let _machine = crate::support::shared();
    let fabric = start();
    let cases = cases(&fabric, &[1, 5, 33], 1);
    let cfg = fabric.frontend_config();
    let addrs: Vec<SocketAddr> = fabric.frontend_addrs().into_iter().flatten().collect();
    assert_eq!(addrs.len(), 2);
    let stop = Arc::new(AtomicBool::new(false));
    let threads: Vec<_> = (0..4)
        .map(|i| {
            let (cases, cfg, stop) = (Arc::clone(&cases), cfg.clone(), Arc::clone(&stop));
            let addr = addrs[i % 2];
            std::thread::spawn(move || drive(addr, &cfg, &cases, 3, 4, &stop))
        })
        .collect();
    for (i, t) in threads.into_iter().enumerate() {
        let (ok, wrong, err, _) = t.join().unwrap();
        assert_eq!(
            (wrong, err),
            (0, 0),
            "client {i} of router {}: {ok} ok",
            i % 2
        );
        assert_eq!(ok, 3 * cases.cases.len(), "client {i}");
    }
    for r in 0..2 {
        let s = fabric.router(r).unwrap().stats();
        assert!(
            s.responses >= 2 * 3 * cases.cases.len() as u64 && s.failures == 0,
            "router {r}: {s:?}"
        );
    }
    fabric.shutdown();
}

#[test]
fn a_stopped_router_costs_only_its_own_requests() {
    let _machine = crate::support::shared();
    let mut fabric = start();
    let cases = cases(&fabric, &[1, 8], 2);
    let cfg = fabric.frontend_config();
    let addrs: Vec<SocketAddr> = fabric.frontend_addrs().into_iter().flatten().collect();
    let stop = Arc::new(AtomicBool::new(false));
    // router 1's client keeps both workers busy until its router goes away
    let doomed = {
        let (cases, cfg, stop) = (Arc::clone(&cases), cfg.clone(), Arc::clone(&stop));
        let addr = addrs[1];
        std::thread::spawn(move || drive(addr, &cfg, &cases, 1000, 8, &stop))
    };
    let survivor = {
        let (cases, cfg, stop) = (Arc::clone(&cases), cfg.clone(), Arc::clone(&stop));
        let addr = addrs[0];
        std::thread::spawn(move || drive(addr, &cfg, &cases, 40, 4, &stop))
    };
    std::thread::sleep(Duration::from_millis(400));
    fabric.stop_router(1);
    let (ok, wrong, err, _) = survivor.join().unwrap();
    assert_eq!(
        (wrong, err),
        (0, 0),
        "router 0's client after router 1 stopped ({ok} ok)"
    );
    assert_eq!(ok, 40 * cases.cases.len());
    stop.store(true, Ordering::Relaxed);
    let (_, wrong1, err1, _) = doomed.join().unwrap();
    assert_eq!(wrong1, 0, "router 1 never answered wrongly");
    assert!(
        err1 > 0,
        "router 1's client saw its router go away as an error"
    );
    // the workers are still serving router 0 normally
    let s = fabric.router(0).unwrap().stats();
    assert_eq!(s.failures, 0, "{s:?}");
    fabric.shutdown();
}

#[test]
fn a_saturating_router_does_not_block_the_other() {
    let _machine = crate::support::shared();
    let fabric = start();
    let big = cases(&fabric, &[64], 3);
    let small = cases(&fabric, &[1], 4);
    let cfg = fabric.frontend_config();
    let addrs: Vec<SocketAddr> = fabric.frontend_addrs().into_iter().flatten().collect();
    let stop = Arc::new(AtomicBool::new(false));
    let heavy_rounds = Arc::new(AtomicUsize::new(0));
    // three clients of router 1 keep 64-token requests pipelined 8 deep until stopped; one
    // whose request misses its deadline (a slow machine: router 1 is saturated by design)
    // connects again and goes on loading; any other failure, or running out of rounds, stops
    // it (counted in `heavy_rounds`)
    let heavy: Vec<_> = (0..3)
        .map(|_| {
            let (cases, cfg, stop) = (Arc::clone(&big), cfg.clone(), Arc::clone(&stop));
            let rounds = Arc::clone(&heavy_rounds);
            let addr = addrs[1];
            std::thread::spawn(move || {
                let mut total = (0, 0, 0, 0);
                loop {
                    let (ok, wrong, err, late) = drive(addr, &cfg, &cases, 10_000, 8, &stop);
                    total = (total.0 + ok, total.1 + wrong, total.2 + err, total.3 + late);
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    if err == 0 || err > late {
                        rounds.fetch_add(1, Ordering::Relaxed);
                        break;
                    }
                }
                total
            })
        })
        .collect();
    // Router 1 is loaded before the small calls start (a sleep would let them run before the
    // heavy clients' first answers on a slow machine, and pass without testing anything).
    let router1 = fabric.router(1).unwrap();
    crate::support::wait_for(
        "router 1's heavy clients never got answers",
        Duration::from_millis(10),
        || router1.stats().responses >= 8,
    );
    // router 0's client: 1-token calls, each must finish within its 10 s deadline, bit-exact
    let (ok, wrong, err, _) = drive(addrs[0], &cfg, &small, 10, 1, &AtomicBool::new(false));
    assert_eq!(
        (wrong, err),
        (0, 0),
        "small calls of router 0 while router 1 saturates"
    );
    assert_eq!(ok, 10 * small.cases.len());
    assert_eq!(
        heavy_rounds.load(Ordering::Relaxed),
        0,
        "router 1's clients were still loading the workers during the small calls"
    );
    stop.store(true, Ordering::Relaxed);
    for h in heavy {
        let (ok, wrong, err, late) = h.join().unwrap();
        assert_eq!(
            (wrong, err - late),
            (0, 0),
            "heavy client: {ok} ok, {late} missed their deadlines"
        );
        if late > 0 {
            crate::support::say(&format!(
                "heavy client of the saturated router: {ok} served, {late} missed their deadlines"
            ));
        }
    }
    fabric.shutdown();
}
