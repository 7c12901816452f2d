//! The round's decision on the shipped two-device topology: skewed load on a load-blind
//! placement is worth a change, the planner's own placement for that load is not, too little
//! traffic decides nothing; and windows subtract cumulative counts.

use super::*;
use expertmesh_topology::model::preset_by_name;
use std::path::Path;

fn files() -> (Topology, ModelSpec, Placement) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples");
    let topo = Topology::load(&root.join("single-host.toml")).unwrap();
    let spec = preset_by_name("demo-small").unwrap();
    let served = Placement::load(
        &root.join("single-host-demo-small.placement.toml"),
        &topo,
        &spec,
    )
    .unwrap();
    (topo, spec, served)
}

/// Counts with experts 20..32 (held only by the second device) `hot` times the others.
fn skewed(spec: &ModelSpec, hot: f64) -> LoadStats {
    let e = spec.routed_experts as usize;
    let row: Vec<f64> = (0..e)
        .map(|i| if i >= 20 { 100.0 * hot } else { 100.0 })
        .collect();
    let layers = spec.moe_layer_ids().len();
    LoadStats::new(spec, vec![Some(row); layers])
        .unwrap()
        .with_tokens(1000.0)
}

#[test]
fn skewed_load_is_worth_a_change_and_the_planned_placement_is_not_changed_again() {
    let (topo, spec, served) = files();
    let load = skewed(&spec, 8.0);
    let (planned, gain) = decide(&topo, &spec, &served, &load, 1.2).unwrap();
    let planned = planned.unwrap_or_else(|| panic!("gain {gain} should exceed 1.2"));
    // The independent figure: the second device serves 16..32 plus 0..4 of each layer.
    let share: f64 = (16..32)
        .chain(0..4)
        .map(|e| {
            let w = if e >= 20 { 800.0 } else { 100.0 };
            // 0..4 and 16..20 have two owners on the served placement.
            if (0..4).contains(&e) || (16..20).contains(&e) {
                w / 2.0
            } else {
                w
            }
        })
        .sum::<f64>()
        / (20.0 * 100.0 + 12.0 * 800.0);
    let layers = spec.moe_layer_ids().len() as f64;
    let before = expertmesh_planner::busiest_load(&topo, &spec, &served, &load);
    assert!(
        (before - layers * share).abs() < 1e-9,
        "{before} vs {}",
        layers * share
    );
    assert!(gain >= 1.2, "{gain}");
    // The planner's placement for this load, asked again, stays.
    let (again, gain) = decide(&topo, &spec, &planned, &load, 1.2).unwrap();
    assert!(again.is_none(), "gain {gain}");
    assert!(gain < 1.2, "{gain}");
}

#[test]
fn a_window_is_the_difference_of_two_cumulative_snapshots() {
    let (_, spec, _) = files();
    let earlier = skewed(&spec, 2.0);
    let later = skewed(&spec, 5.0).with_tokens(2500.0);
    let w = window(&spec, &earlier, &later).unwrap();
    // Every layer routed 12 experts x 300 more: 3600 / top_k tokens.
    assert_eq!(w.tokens(), Some(3600.0 / f64::from(spec.top_k)));
    let row = w.layer(0).unwrap();
    assert_eq!((row[0], row[31]), (0.0, 300.0));
    // Uneven history: layer A busy before, layer B busy in the window. The snapshots' tokens
    // (the most of any layer's, cumulative) do not move; the window is B's tokens.
    let k = f64::from(spec.top_k);
    let layers = spec.moe_layer_ids().len();
    let rows = |a: f64, b: f64| {
        let mut v = vec![Some(vec![a * k / 32.0; 32]); layers];
        v[1] = Some(vec![b * k / 32.0; 32]);
        LoadStats::new(&spec, v).unwrap()
    };
    let w = window(
        &spec,
        &rows(1000.0, 0.0).with_tokens(1000.0),
        &rows(1000.0, 1900.0).with_tokens(1900.0),
    )
    .unwrap();
    assert_eq!(w.tokens(), Some(1900.0));
    // A later snapshot never has less; if one did (a reset), the window does not go negative.
    let back = window(&spec, &later, &earlier).unwrap();
    assert!(back.layer(0).unwrap().iter().all(|&c| c == 0.0));
}
