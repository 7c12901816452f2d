//! The router core routes by what workers announce they hold (live placement changes,
//! issue 29): an announcement moves ownership for new batches, an expert nobody holds fails
//! the calls that need it with a message saying so, and an announcement from a router rank or
//! naming an expert outside the model changes nothing.

use expertmesh_router::core::{RouterConfig, SharedSite};
use expertmesh_router::reference;
use expertmesh_router::sim::{Sim, ZeroRows};
use expertmesh_topology::model::{ModelSpec, preset_by_name};
use expertmesh_transport::codec::ErrorCode;

/// toy-softmax on two devices (ranks 1 and 2), each holding half of the experts: the model,
/// the simulated router, its MoE layers and every (layer, expert) pair.
fn two_halves() -> (ModelSpec, Sim, Vec<u32>, Vec<(u32, u32)>) {
    let spec = preset_by_name("toy-softmax").unwrap();
    let e = spec.routed_experts;
    let sim = Sim::builder(&spec, &[(0..e / 2).collect(), (e / 2..e).collect()])
        .shared(SharedSite::None)
        .config(RouterConfig::default())
        .build(|_, _| Box::new(ZeroRows));
    let layers = spec.moe_layer_ids();
    let all: Vec<(u32, u32)> = layers
        .iter()
        .flat_map(|&l| (0..e).map(move |x| (l, x)))
        .collect();
    (spec, sim, layers, all)
}

#[test]
fn announcements_move_ownership_and_an_unowned_expert_fails_naming_why() {
    let (spec, mut sim, layers, all) = two_halves();
    let e = spec.routed_experts;
    let x = reference::synthetic_hidden(3, 8, spec.hidden as usize);
    // Device 1 (rank 2) hands everything to device 0 (rank 1): new batches go to rank 1 only.
    assert_eq!(sim.core.set_holdings(1, &all), Ok(vec![]));
    assert_eq!(sim.core.set_holdings(2, &[]), Ok(vec![]));
    let sent_before = sim.sent.get(&2).copied().unwrap_or(0);
    let (_, answer) = sim.call(1, layers[0], x.clone());
    assert!(answer.is_ok(), "{answer:?}");
    assert_eq!(sim.sent.get(&2).copied().unwrap_or(0), sent_before);
    assert!(sim.sent.get(&1).copied().unwrap_or(0) > 0);
    // Nobody holds layer 0's experts now: the call fails and says why.
    let rest: Vec<(u32, u32)> = all.iter().copied().filter(|p| p.0 != layers[0]).collect();
    let orphans = sim.core.set_holdings(1, &rest).unwrap();
    assert_eq!(orphans.len(), e as usize);
    assert!(orphans.iter().all(|&(l, _)| l == layers[0]));
    let (_, answer) = sim.call(2, layers[0], x.clone());
    let (code, message) = answer.unwrap_err();
    assert_eq!(code, ErrorCode::PeerUnavailable);
    assert!(message.contains("has no owner"), "{message}");
    // Refused: a router's rank, a rank past the workers, an expert outside the model.
    let holdings = sim.core.stats().holdings;
    assert!(
        sim.core
            .set_holdings(0, &all)
            .unwrap_err()
            .contains("not a worker")
    );
    assert!(
        sim.core
            .set_holdings(3, &all)
            .unwrap_err()
            .contains("not a worker")
    );
    let err = sim.core.set_holdings(1, &[(layers[0], e)]).unwrap_err();
    assert!(err.contains("outside the model"), "{err}");
    assert_eq!(sim.core.stats().holdings, holdings);
    // Given back, the layer is served again.
    assert_eq!(sim.core.set_holdings(2, &all), Ok(vec![]));
    let (_, answer) = sim.call(3, layers[0], x);
    assert!(answer.is_ok(), "{answer:?}");
}

/// What a router's readiness counts: the routed experts no joined worker owns, following
/// who joined and what workers announce.
#[test]
fn experts_without_a_joined_owner_follow_joins_and_announcements() {
    let (spec, mut sim, layers, all) = two_halves();
    let e = spec.routed_experts;
    let n = layers.len();
    let first_half: Vec<(u32, u32)> = all.iter().copied().filter(|p| p.1 < e / 2).collect();
    let mut joined = std::collections::BTreeSet::new();
    let uncovered = |sim: &Sim, joined: &std::collections::BTreeSet<u32>| {
        sim.core.uncovered_experts(|r| joined.contains(&r))
    };
    // No worker joined yet (however the core starts): every expert is bare.
    assert_eq!(uncovered(&sim, &joined), e as usize * n);
    joined.insert(1);
    assert_eq!(uncovered(&sim, &joined), (e - e / 2) as usize * n);
    joined.insert(2);
    assert_eq!(uncovered(&sim, &joined), 0);
    // Rank 2 (the second half) gone: its experts are bare until rank 1 takes them all.
    joined.remove(&2);
    assert_eq!(uncovered(&sim, &joined), (e - e / 2) as usize * n);
    sim.core.set_holdings(1, &all).unwrap();
    assert_eq!(uncovered(&sim, &joined), 0);
    // Rank 2 back; rank 1 keeps the first half and is then gone: the first half is bare.
    joined.insert(2);
    sim.core.set_holdings(1, &first_half).unwrap();
    assert_eq!(uncovered(&sim, &joined), 0);
    joined.remove(&1);
    assert_eq!(uncovered(&sim, &joined), (e / 2) as usize * n);
}
