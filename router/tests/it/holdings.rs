//! The router core routes by what workers announce they hold (live placement changes,
//! issue 29): an announcement moves ownership for new batches, an expert nobody holds fails
//! the calls that need it with a message saying so, and an announcement from a router rank or
//! naming an expert outside the model changes nothing.

use expertmesh_router::core::{RouterConfig, SharedSite};
use expertmesh_router::reference;
use expertmesh_router::sim::{Sim, ZeroRows};
use expertmesh_topology::model::preset_by_name;
use expertmesh_transport::codec::ErrorCode;

#[test]
fn announcements_move_ownership_and_an_unowned_expert_fails_naming_why() {
    let spec = preset_by_name("toy-softmax").unwrap();
    let e = spec.routed_experts;
    let mut sim = Sim::builder(&spec, &[(0..e / 2).collect(), (e / 2..e).collect()])
        .shared(SharedSite::None)
        .config(RouterConfig::default())
        .build(|_, _| Box::new(ZeroRows));
    let layers = spec.moe_layer_ids();
    let all: Vec<(u32, u32)> = layers
        .iter()
        .flat_map(|&l| (0..e).map(move |x| (l, x)))
        .collect();
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

/// What a router's readiness counts: the routed experts no live worker owns, following links
/// lost and joined and what workers announce.
#[test]
fn experts_without_a_live_owner_follow_links_and_announcements() {
    let spec = preset_by_name("toy-softmax").unwrap();
    let e = spec.routed_experts;
    let mut sim = Sim::builder(&spec, &[(0..e / 2).collect(), (e / 2..e).collect()])
        .shared(SharedSite::None)
        .config(RouterConfig::default())
        .build(|_, _| Box::new(ZeroRows));
    let layers = spec.moe_layer_ids();
    let n = layers.len();
    let all: Vec<(u32, u32)> = layers
        .iter()
        .flat_map(|&l| (0..e).map(move |x| (l, x)))
        .collect();
    let first_half: Vec<(u32, u32)> = all.iter().copied().filter(|p| p.1 < e / 2).collect();
    assert_eq!(sim.core.uncovered_experts(), 0, "both devices up");
    // Rank 2 (the second half) lost: its experts have no live owner; joining again is not
    // enough, its announcement is.
    let now = sim.now;
    sim.core.on_peer_lost(2, now);
    assert_eq!(sim.core.uncovered_experts(), (e - e / 2) as usize * n);
    sim.core.on_peer_joining(2);
    assert_eq!(sim.core.uncovered_experts(), (e - e / 2) as usize * n);
    // Rank 1 takes every expert: covered without rank 2.
    sim.core.set_holdings(1, &all).unwrap();
    assert_eq!(sim.core.uncovered_experts(), 0);
    // Rank 2 back; rank 1 keeps the first half and is then lost: the first half is bare.
    sim.core.on_peer_up(2);
    sim.core.set_holdings(1, &first_half).unwrap();
    assert_eq!(sim.core.uncovered_experts(), 0);
    sim.core.on_peer_lost(1, now);
    assert_eq!(sim.core.uncovered_experts(), (e / 2) as usize * n);
}
