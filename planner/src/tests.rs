//! The planner on random clusters against independent checks (coverage, budgets, distinct
//! replicas, exact fit/no-fit), and on the example clusters.

use super::*;
use crate::evaluate::{Evaluator, Hardware};
use crate::synthetic::{ClusteredRouting, zipf_load};
use expertmesh_topology::model::preset_by_name;
use expertmesh_topology::placement::SharedLocation;
use expertmesh_topology::topology::DeviceRank;
use proptest::prelude::*;
use std::path::Path;

fn example(name: &str) -> Topology {
    Topology::load(
        &Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../examples")
            .join(name),
    )
    .unwrap()
}

/// A cluster of `nodes[i]` devices per node; device budgets in expert slots plus a remainder.
pub(crate) fn cluster(nodes: &[Vec<(u64, u64, u32)>], expert_bytes: u64) -> Topology {
    let mut t = String::from("format = 1\nname = \"prop\"\n");
    for (n, devs) in nodes.iter().enumerate() {
        t.push_str(&format!(
            "[[nodes]]\nname = \"n{n}\"\naddress = \"10.0.0.{}\"\ncontrol_port = 7000\ndata_port = 7100\nintra_link = \"pcie\"\nintra_bandwidth_gb_s = 20\nnics = [{{ name = \"eth0\", kind = \"tcp\", speed_gbit_s = 100, mtu = 9000 }}]\ndevices = [\n",
            n + 1
        ));
        for (d, &(slots, extra, bw)) in devs.iter().enumerate() {
            t.push_str(&format!(
                "  {{ name = \"c{d}\", kind = \"cpu\", arch = \"cpu\", threads = 1, expert_memory = {}, memory_bandwidth_gb_s = {bw} }},\n",
                slots * expert_bytes + extra % (expert_bytes - 1) + 1
            ));
        }
        t.push_str("]\n");
    }
    Topology::from_toml_str(&t).unwrap_or_else(|p| panic!("{p:?}\n{t}"))
}

fn models() -> Vec<ModelSpec> {
    ["toy-softmax", "toy-grouped", "toy-mixtral", "demo-small"]
        .iter()
        .map(|n| preset_by_name(n).unwrap())
        .collect()
}

/// Independent check of a plan: every expert of every MoE layer placed, no device holds an
/// expert twice in a layer, each layer has exactly E + R slots, every device within budget.
fn check_plan(t: &Topology, m: &ModelSpec, p: &Plan) -> Result<(), TestCaseError> {
    let e = m.routed_experts;
    let mut bytes = vec![0u64; t.devices().len()];
    for &layer in p.placement.layers() {
        let mut owners = vec![0u32; e as usize];
        let mut slots = 0usize;
        for d in t.devices() {
            let list = p.placement.experts_on(d.rank(), layer);
            let mut seen = std::collections::HashSet::new();
            for &x in list {
                prop_assert!(x < e);
                prop_assert!(
                    seen.insert(x),
                    "layer {} device {} holds {} twice",
                    layer,
                    d.id(),
                    x
                );
                owners[x as usize] += 1;
            }
            slots += list.len();
            bytes[d.rank().index()] += list.len() as u64 * m.expert_bytes();
        }
        prop_assert!(
            owners.iter().all(|&o| o >= 1),
            "layer {} has an unplaced expert",
            layer
        );
        prop_assert_eq!(slots, (e + p.redundant) as usize);
        if m.shared_experts > 0
            && let Some(SharedLocation::Device(r)) = p.placement.shared_location(layer)
        {
            bytes[r.index()] += m.shared_experts as u64 * m.shared_expert_bytes();
        }
    }
    for d in t.devices() {
        prop_assert!(
            bytes[d.rank().index()] <= d.expert_memory_bytes(),
            "device {} uses {} of {}",
            d.id(),
            bytes[d.rank().index()],
            d.expert_memory_bytes()
        );
    }
    Ok(())
}

/// (model index, devices per node as (slots, extra bytes, bandwidth), replicas, seed, shared).
type Case = (usize, Vec<Vec<(u64, u64, u32)>>, u32, u64, u8);

fn arb_case() -> impl proptest::strategy::Strategy<Value = Case> {
    (
        0usize..4,
        prop::collection::vec(
            prop::collection::vec((0u64..40, 0u64..u64::MAX, 50u32..400), 1..4),
            1..4,
        ),
        0u32..12,
        any::<u64>(),
        0u8..3,
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn plans_cover_every_expert_within_budget_on_distinct_devices(
        (mi, nodes, redundant, seed, shared) in arb_case(),
        with_load in any::<bool>(),
        strategy in prop_oneof![Just(super::Strategy::Auto), Just(super::Strategy::Global), Just(super::Strategy::Hierarchical)],
    ) {
        let m = models().swap_remove(mi);
        let t = cluster(&nodes, m.expert_bytes());
        let load = zipf_load(&m, 1.2, 10_000, seed);
        let shared_policy = match shared {
            0 => SharedPolicy::Router,
            1 => SharedPolicy::Spread,
            _ => SharedPolicy::Device(t.devices()[0].id().to_owned()),
        };
        let opts = PlanOptions {
            redundant: Some(redundant),
            strategy,
            shared: shared_policy.clone(),
            ..PlanOptions::default()
        };
        let layers = m.moe_layer_ids().len() as u64;
        let e = m.routed_experts as u64;
        let result = plan(&t, &m, with_load.then_some(&load), None, &opts);
        // Exact oracle for the router policy: whole-expert capacity over all devices, each
        // device holding an expert at most once per layer.
        if shared_policy == SharedPolicy::Router {
            let cap: u64 = t.devices().iter().map(|d| (d.expert_memory_bytes() / m.expert_bytes()).min(layers * e)).sum();
            let fits = cap >= layers * (e + redundant as u64)
                && redundant as u64 <= e * (t.devices().len() as u64 - 1);
            prop_assert_eq!(result.is_ok(), fits, "{:?}", result.as_ref().err());
        }
        match result {
            Ok(p) => check_plan(&t, &m, &p)?,
            Err(PlanError::DoesNotFit(s)) => {
                prop_assert!(s.short_bytes > 0 || s.need_bytes > s.usable_bytes);
            }
            Err(PlanError::Options(_)) => {}
            Err(PlanError::Rejected(msg)) => prop_assert!(false, "planner bug: {}", msg),
        }
    }
}

#[test]
fn kimi_k2_on_the_example_clusters_is_even_and_valid() {
    let m = preset_by_name("kimi-k2").unwrap();
    for name in ["mi300x-4x8.toml", "rx7900xtx-8x4.toml"] {
        let t = example(name);
        let p = plan(&t, &m, None, None, &PlanOptions::default()).unwrap();
        assert_eq!(p.strategy, StrategyUsed::Global);
        assert_eq!(p.redundant, 0);
        for d in t.devices() {
            for &l in p.placement.layers() {
                assert_eq!(p.placement.experts_on(d.rank(), l).len(), 12, "{name}");
            }
        }
        assert_eq!(p.placement.shared_location(1), Some(SharedLocation::Router));
        // The written file reads back to the same placement.
        let text = p.placement.to_toml_string();
        let back = Placement::from_toml_str(&text, &t, &m).unwrap();
        assert_eq!(back, p.placement);
    }
}

#[test]
fn zipf_load_is_balanced_by_replication() {
    let m = preset_by_name("kimi-k2").unwrap();
    let t = example("mi300x-4x8.toml");
    let load = zipf_load(&m, 1.0, 1_000_000, 11);
    let hw = Hardware::from_topology(&t);
    let plain = plan(&t, &m, None, None, &PlanOptions::default()).unwrap();
    let aware = plan(&t, &m, Some(&load), None, &PlanOptions::default()).unwrap();
    assert_eq!(
        aware.redundant, 32,
        "one replica slot per device by default"
    );
    let before = Evaluator::new(&t, &m, &plain.placement, Some(&load), None, 0).evaluate(&hw);
    let after = Evaluator::new(&t, &m, &aware.placement, Some(&load), None, 0).evaluate(&hw);
    assert!(
        before.load.max_over_mean > 3.0,
        "Zipf(1) without balancing: {}",
        before.load.max_over_mean
    );
    assert!(
        after.load.max_over_mean < 1.1,
        "after replication: {}",
        after.load.max_over_mean
    );
}

#[test]
fn deepseek_groups_stay_on_their_nodes() {
    let m = preset_by_name("deepseek-v3").unwrap(); // 8 groups of 32, topk_group 4
    let t = example("mi210-4x4.toml");
    let load = zipf_load(&m, 0.8, 100_000, 5);
    let p = plan(&t, &m, Some(&load), None, &PlanOptions::default()).unwrap();
    assert_eq!(p.strategy, StrategyUsed::HierarchicalGroups);
    for &l in p.placement.layers() {
        for g in 0..8u32 {
            let mut nodes = std::collections::BTreeSet::new();
            for x in g * 32..(g + 1) * 32 {
                for r in p.placement.owners(l, x) {
                    nodes.insert(t.devices()[r.index()].node_index());
                }
            }
            assert_eq!(nodes.len(), 1, "layer {l} group {g} spans nodes {nodes:?}");
        }
    }
}

/// Mean nodes per token over `tokens` fresh tokens per sampled layer, each token sent once per
/// node holding one of its experts (a replica on a node already targeted first, else the
/// lowest rank).
fn sampled_nodes_per_token(
    t: &Topology,
    m: &ModelSpec,
    p: &Placement,
    routing: &ClusteredRouting,
    tokens: usize,
) -> f64 {
    let layers = [0usize, 30, 59];
    let mut total = 0.0;
    for &li in &layers {
        let layer = m.moe_layer_ids()[li];
        for tok in routing.sample(li, tokens) {
            let mut nodes = std::collections::BTreeSet::new();
            for x in tok {
                let owners = p.owners(layer, x);
                let pick = owners
                    .iter()
                    .find(|r| nodes.contains(&t.devices()[r.index()].node_index()))
                    .or(owners.first())
                    .copied()
                    .unwrap_or(DeviceRank(0));
                nodes.insert(t.devices()[pick.index()].node_index());
            }
            total += nodes.len() as f64;
        }
    }
    total / (layers.len() * tokens) as f64
}

/// Co-selection statistics from clustered routing: the locality plan sends real (sampled)
/// tokens to fewer nodes, the traffic model sees the gain, and its estimate is conservative
/// (pairwise statistics cannot tell a cluster's own picks from stray ones, so it
/// over-estimates fan-out under strong clustering) and exact-ish without clusters.
#[test]
fn locality_cuts_fan_out_and_the_model_sees_it() {
    let m = preset_by_name("kimi-k2").unwrap();
    let t = example("mi300x-4x8.toml");
    let hw = Hardware::from_topology(&t);
    let opts = PlanOptions::default();
    // Clustered: 16 clusters of 24 experts, 85% of picks inside the token's cluster.
    let routing = ClusteredRouting::new(&m, 16, 0.85, 0.0, 9);
    let (load, co) = routing.statistics(&m, 3000);
    let plain = plan(&t, &m, Some(&load), None, &opts).unwrap();
    let local = plan(&t, &m, Some(&load), Some(&co), &opts).unwrap();
    assert_eq!(local.strategy, StrategyUsed::HierarchicalLocality);
    let est =
        |p: &Plan| Evaluator::new(&t, &m, &p.placement, Some(&load), Some(&co), 0).evaluate(&hw);
    let (ev_plain, ev_local) = (est(&plain), est(&local));
    let real_plain = sampled_nodes_per_token(&t, &m, &plain.placement, &routing, 2000);
    let real_local = sampled_nodes_per_token(&t, &m, &local.placement, &routing, 2000);
    assert!(
        real_local < 0.7 * real_plain,
        "sampled {real_local} vs {real_plain}"
    );
    assert!(
        ev_local.traffic.nodes_per_token < 0.8 * ev_plain.traffic.nodes_per_token,
        "model {} vs {}",
        ev_local.traffic.nodes_per_token,
        ev_plain.traffic.nodes_per_token
    );
    for (estimate, real) in [
        (ev_plain.traffic.nodes_per_token, real_plain),
        (ev_local.traffic.nodes_per_token, real_local),
    ] {
        assert!(
            estimate >= 0.97 * real && estimate <= 1.3 * real,
            "estimate {estimate} vs sampled {real}"
        );
    }
    assert!(
        ev_local.load.max_over_mean < 1.25,
        "{}",
        ev_local.load.max_over_mean
    );
    // Without clusters (every pick uniform) the estimate matches the sampled tokens closely.
    let uniform = ClusteredRouting::new(&m, 1, 0.0, 0.0, 4);
    let (load_u, co_u) = uniform.statistics(&m, 3000);
    let ev = Evaluator::new(&t, &m, &plain.placement, Some(&load_u), Some(&co_u), 0).evaluate(&hw);
    let real = sampled_nodes_per_token(&t, &m, &plain.placement, &uniform, 2000);
    let estimate = ev.traffic.nodes_per_token;
    assert!(
        (estimate - real).abs() / real < 0.03,
        "estimate {estimate} vs sampled {real}"
    );
}

#[test]
fn too_small_a_cluster_reports_the_shortfall_per_device() {
    let m = preset_by_name("kimi-k2").unwrap();
    let t = example("rx7900xtx-1x2.toml");
    match plan(&t, &m, None, None, &PlanOptions::default()) {
        Err(PlanError::DoesNotFit(s)) => {
            assert_eq!(s.devices.len(), 2);
            assert!(s.short_bytes > 500_000_000_000, "{}", s.short_bytes);
            let msg = describe_shortfall(&s);
            assert!(msg.contains("short by"), "{msg}");
            assert!(msg.contains("xtx0/gpu1"), "{msg}");
        }
        other => panic!("expected no fit, got {:?}", other.map(|p| p.strategy)),
    }
}

#[test]
fn the_busiest_load_counts_each_devices_share_with_replicas_splitting_their_expert() {
    let m = preset_by_name("toy-softmax").unwrap();
    let e = m.routed_experts;
    let layers = m.moe_layer_ids().len();
    let slots = (e as usize * layers) as u64;
    let t = cluster(&[vec![(slots, 0, 20), (slots, 0, 20)]], m.expert_bytes());
    let shared = vec![SharedLocation::Router; layers];
    let placement = |d0: Vec<u32>, d1: Vec<u32>| {
        Placement::new(&t, &m, vec![vec![d0, d1]; layers], shared.clone(), "test").unwrap()
    };
    let half = e / 2;
    let blocks = placement((0..half).collect(), (half..e).collect());
    let uniform = LoadStats::new(&m, vec![None; layers]).unwrap();
    let got = busiest_load(&t, &m, &blocks, &uniform);
    assert!((got - 0.5 * layers as f64).abs() < 1e-12, "{got}");
    // Expert 0 takes e times the load of each other one (total 2e - 1).
    let mut hot = vec![1.0; e as usize];
    hot[0] = e as f64;
    let skewed = LoadStats::new(&m, vec![Some(hot); layers]).unwrap();
    let total = (2 * e - 1) as f64;
    let got = busiest_load(&t, &m, &blocks, &skewed);
    let want = layers as f64 * (e + half - 1) as f64 / total;
    assert!((got - want).abs() < 1e-12, "{got} vs {want}");
    // Expert 0 on both devices: each serves half of its load.
    let replicated = placement(
        (0..half).collect(),
        std::iter::once(0).chain(half..e).collect(),
    );
    let got = busiest_load(&t, &m, &replicated, &skewed);
    let d0 = e as f64 / 2.0 + (half - 1) as f64;
    let d1 = e as f64 / 2.0 + (e - half) as f64;
    let want = layers as f64 * d0.max(d1) / total;
    assert!((got - want).abs() < 1e-12, "{got} vs {want}");
    assert!(busiest_load(&t, &m, &blocks, &skewed) > got);
}
