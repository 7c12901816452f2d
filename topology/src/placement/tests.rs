//! Unit and property tests of placement files: lookups against brute force, each validation
//! problem, all problems at once, and writer/reader round trips.

use super::*;
use crate::model::preset_by_name;
use proptest::prelude::*;

fn examples_dir() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples")
}

fn topo(name: &str) -> Topology {
    Topology::load(&examples_dir().join(name)).unwrap()
}

fn rendered(p: &[Problem]) -> String {
    p.iter()
        .map(|p| p.to_string())
        .collect::<Vec<_>>()
        .join("\n")
}

fn line_of(text: &str, needle: &str) -> usize {
    let at = text
        .find(needle)
        .unwrap_or_else(|| panic!("{needle} not in text"));
    text[..at].matches('\n').count() + 1
}

const DEMO: &str = include_str!("../../../examples/single-host-demo-small.placement.toml");

fn demo_problems(text: &str) -> Vec<Problem> {
    let t = topo("single-host.toml");
    let m = preset_by_name("demo-small").unwrap();
    match Placement::from_toml_str(text, &t, &m) {
        Ok(_) => panic!("expected problems"),
        Err(p) => p,
    }
}

/// Owners of every (layer, expert) recomputed by scanning every device's list.
fn brute_owners(p: &Placement, layer: u32, expert: u32) -> Vec<DeviceRank> {
    (0..p.device_count())
        .map(|r| DeviceRank(r as u32))
        .filter(|&r| p.experts_on(r, layer).contains(&expert))
        .collect()
}

#[test]
fn demo_example_lookups() {
    let t = topo("single-host.toml");
    let m = preset_by_name("demo-small").unwrap();
    let p = Placement::from_toml_str(DEMO, &t, &m).unwrap();
    assert_eq!(p.layers(), [0, 1, 2, 3]);
    let cpu0 = DeviceRank(0);
    let cpu1 = DeviceRank(1);
    let want0: Vec<u32> = (0..20).collect();
    let want1: Vec<u32> = (16..32).chain(0..4).collect();
    for layer in 0..4 {
        assert_eq!(p.experts_on(cpu0, layer), want0.as_slice());
        assert_eq!(p.experts_on(cpu1, layer), want1.as_slice());
        assert_eq!(p.owners(layer, 2), [cpu0, cpu1]);
        assert_eq!(p.owners(layer, 10), [cpu0]);
        assert_eq!(p.owners(layer, 17), [cpu0, cpu1]);
        assert_eq!(p.owners(layer, 25), [cpu1]);
        assert_eq!(p.shared_location(layer), Some(SharedLocation::Router));
    }
    // unknown layer / expert / device give empty answers, not panics
    assert!(p.owners(4, 0).is_empty());
    assert!(p.owners(0, 32).is_empty());
    assert!(p.experts_on(DeviceRank(9), 0).is_empty());
    assert_eq!(p.shared_location(7), None);
    assert_eq!(p.total_slots(), 4 * (20 + 20));
    let u = p.usage(&t, &m);
    assert_eq!(u[0].experts_total, 80);
    assert_eq!(u[0].routed_bytes, 80 * m.expert_bytes());
    assert_eq!(u[0].shared_bytes, 0);
    assert!(u.iter().all(DeviceUsage::fits));
}

#[test]
fn kimi_k2_example_on_mi300x() {
    let t = topo("mi300x-4x8.toml");
    let m = preset_by_name("kimi-k2").unwrap();
    let p = Placement::load(
        &examples_dir().join("mi300x-4x8-kimi-k2.placement.toml"),
        &t,
        &m,
    )
    .unwrap();
    assert_eq!(p.layers().len(), 60);
    assert_eq!(p.layers()[0], 1);
    // expert 96 belongs to node1/gpu0 (rank 8) and is replicated on node0/gpu0 (rank 0)
    assert_eq!(p.owners(1, 96), [DeviceRank(0), DeviceRank(8)]);
    assert_eq!(p.owners(60, 97), [DeviceRank(8)]);
    let mut want: Vec<u32> = (0..12).collect();
    want.push(96);
    assert_eq!(p.experts_on(DeviceRank(0), 30), want.as_slice());
    for e in 0..384 {
        assert_eq!(p.owners(1, e), brute_owners(&p, 1, e).as_slice());
    }
    let u = p.usage(&t, &m);
    assert_eq!(u[0].experts_per_layer_min, 13);
    assert_eq!(u[0].routed_bytes, 13 * 60 * 24_772_608);
    assert!(u.iter().all(DeviceUsage::fits));
}

#[test]
fn deepseek_example_has_per_layer_shared_locations() {
    let t = topo("mi210-4x4.toml");
    let m = preset_by_name("deepseek-v3").unwrap();
    let p = Placement::load(
        &examples_dir().join("mi210-4x4-deepseek-v3.placement.toml"),
        &t,
        &m,
    )
    .unwrap();
    assert_eq!(
        p.shared_location(3),
        Some(SharedLocation::Device(DeviceRank(0)))
    );
    assert_eq!(
        p.shared_location(18),
        Some(SharedLocation::Device(DeviceRank(4)))
    );
    assert_eq!(
        p.shared_location(60),
        Some(SharedLocation::Device(DeviceRank(12)))
    );
    let u = p.usage(&t, &m);
    assert_eq!(u[0].shared_bytes, 15 * m.shared_expert_bytes());
    assert_eq!(u[4].shared_bytes, 15 * m.shared_expert_bytes());
    assert_eq!(u[8].shared_bytes, 14 * m.shared_expert_bytes());
    assert_eq!(u[1].shared_bytes, 0);
}

#[test]
fn every_problem_is_reported_in_one_run() {
    let text = r#"format = 1
model = "demo-small"
cluster = "single-host"

[[assign]]
layers = "all"
device = "local/cpu9"
experts = "0-15"

[[assign]]
layers = "0-3"
device = "local/cpu1"
experts = "16-31,20"

[[assign]]
layers = "2-7"
device = "local/cpu0"
experts = "0-3"

[[assign]]
layers = 1
device = "local/cpu0"
experts = [30, "40-41"]

[[assign]]
layers = "all"
devise = "local/cpu0"
experts = "0-1"
"#;
    let p = demo_problems(text);
    let all = rendered(&p);
    let expect = [(
        line_of(text, "devise"),
        "assignment #5: unknown key \"devise\"; did you mean \"device\"?",
    )];
    for (line, needle) in expect {
        let hit = p.iter().find(|q| q.to_string().contains(needle));
        let hit = hit.unwrap_or_else(|| panic!("missing {needle:?} in\n{all}"));
        assert_eq!(hit.location().map(|l| l.line()), Some(line), "{all}");
    }
    // The unknown key stops nothing: the missing device of #5 is reported too.
    assert!(all.contains("assignment #5: missing `device`"), "{all}");
    // Parse stage problems are reported before the cross-checks; run again without #5.
    let text = text
        .split("\n[[assign]]\nlayers = \"all\"\ndevise")
        .next()
        .unwrap();
    let p = demo_problems(text);
    let all = rendered(&p);
    let expect = [
        (
            line_of(text, "cpu9"),
            "assignment #1: unknown device \"local/cpu9\"; did you mean \"local/cpu0\"?",
        ),
        (
            line_of(text, "16-31,20"),
            "assignment #2: experts 20 in layers 0-3 are already on device \"local/cpu1\" (earlier in the same assignment)",
        ),
        (
            line_of(text, "2-7"),
            "assignment #3: layer 7 does not exist; demo-small has layers 0-3 (MoE layers 0-3)",
        ),
        (
            line_of(text, "\"40-41\""),
            "assignment #4: experts 40-41 do not exist; demo-small has experts 0-31",
        ),
    ];
    for (line, needle) in expect {
        let hit = p.iter().find(|q| q.to_string().contains(needle));
        let hit = hit.unwrap_or_else(|| panic!("missing {needle:?} in\n{all}"));
        assert_eq!(hit.location().map(|l| l.line()), Some(line), "{all}");
    }
    // Coverage is checked in the same run: experts 0-15 have no owner (their assignment named an
    // unknown device), grouped over all four layers; shared experts have no location.
    assert!(
        all.contains("layers 0-3: experts 0-15 have no owner; assign them to a device"),
        "{all}"
    );
    assert!(
        all.contains("layers 0-3: no location for the shared expert(s) of demo-small"),
        "{all}"
    );
}

#[test]
fn replicas_on_one_device_name_both_assignments() {
    let text = DEMO.replace("experts = \"16-31,0-3\"", "experts = \"16-31,0-3\"\n\n[[assign]]\nlayers = \"1-2\"\ndevice = \"local/cpu1\"\nexperts = \"5,3\"");
    let all = rendered(&demo_problems(&text));
    assert!(
        all.contains("assignment #3: experts 3 in layers 1,2 are already on device \"local/cpu1\" (by assignment #2)"),
        "{all}"
    );
}

#[test]
fn dense_layers_are_rejected() {
    let t = topo("mi300x-4x8.toml");
    let m = preset_by_name("kimi-k2").unwrap();
    let text = std::fs::read_to_string(examples_dir().join("mi300x-4x8-kimi-k2.placement.toml"))
        .unwrap()
        .replacen("layers = \"all\"", "layers = \"0-60\"", 1);
    let all = rendered(&Placement::from_toml_str(&text, &t, &m).unwrap_err());
    assert!(
        all.contains("assignment #1: layer 0 is a dense layer of kimi-k2; its MoE layers are 1-60"),
        "{all}"
    );
}

#[test]
fn over_budget_names_device_need_and_shortfall() {
    let t_text = std::fs::read_to_string(examples_dir().join("single-host.toml"))
        .unwrap()
        .replacen(
            "expert_memory = \"256 MiB\"",
            "expert_memory = \"50 MB\"",
            1,
        );
    let t = Topology::from_toml_str(&t_text).unwrap();
    let m = preset_by_name("demo-small").unwrap();
    let p = Placement::from_toml_str(DEMO, &t, &m).unwrap_err();
    assert_eq!(p.len(), 1, "{}", rendered(&p));
    let need = 80 * m.expert_bytes(); // 20 experts x 4 layers
    assert_eq!(need, 70_778_880);
    assert_eq!(
        p[0].to_string(),
        "device \"local/cpu0\" (rank 0): experts need 70.78 MB (80 routed experts x 0.88 MB) but \
         expert_memory is 50.00 MB; short by 20.78 MB — move experts to other devices or raise \
         expert_memory"
    );
}

#[test]
fn model_and_cluster_mismatch_are_reported_alone() {
    let t = topo("single-host.toml");
    let m = preset_by_name("toy-softmax").unwrap();
    let text = DEMO.replace("cluster = \"single-host\"", "cluster = \"other\"");
    let p = Placement::from_toml_str(&text, &t, &m).unwrap_err();
    let all = rendered(&p);
    assert_eq!(p.len(), 2, "{all}");
    assert!(
        all.contains(
            "placement is for model \"demo-small\" but the model given is \"toy-softmax\""
        ),
        "{all}"
    );
    assert!(
        all.contains("placement is for cluster \"other\" but the topology is \"single-host\""),
        "{all}"
    );
}

#[test]
fn shared_blocks_are_checked() {
    // twice for the same layers
    let text = format!("{DEMO}\n[[shared]]\nlayers = \"2-3\"\ndevice = \"local/cpu1\"\n");
    let all = rendered(&demo_problems(&text));
    assert!(
        all.contains(
            "shared block #2: layers 2,3 already have a shared-expert location from shared block #1"
        ),
        "{all}"
    );
    // the same layer twice in one block: that block is named, not an earlier one
    let text = DEMO.replace(
        "[[shared]]\nlayers = \"all\"",
        "[[shared]]\nlayers = \"0-3,3\"",
    );
    assert_ne!(text, DEMO, "the example's [[shared]] block changed");
    let all = rendered(&demo_problems(&text));
    assert!(
        all.contains("shared block #1: layers 3 are named twice in this block"),
        "{all}"
    );
    // unknown device, with "router" offered
    let text = DEMO.replace("device = \"router\"", "device = \"routr\"");
    let all = rendered(&demo_problems(&text));
    assert!(
        all.contains("unknown device \"routr\" (or \"router\")"),
        "{all}"
    );
    // a model without shared experts
    let t = topo("single-host.toml");
    let m = preset_by_name("toy-softmax").unwrap();
    let text = "format = 1\nmodel = \"toy-softmax\"\ncluster = \"single-host\"\n\
                [[assign]]\nlayers = \"all\"\ndevice = \"local/cpu0\"\nexperts = \"0-7\"\n\
                [[shared]]\nlayers = \"all\"\ndevice = \"router\"\n";
    let all = rendered(&Placement::from_toml_str(text, &t, &m).unwrap_err());
    assert!(
        all.contains("toy-softmax has no shared experts; remove the [[shared]] blocks"),
        "{all}"
    );
}

#[test]
fn header_and_block_keys_are_required() {
    let text = "[[assign]]\nexperts = \"0-3\"\n[[shared]]\n";
    let all = rendered(&PlacementFile::from_toml_str(text).unwrap_err());
    for needle in [
        "top level: missing `format`",
        "top level: missing `model`",
        "top level: missing `cluster`",
        "1:1: assignment #1: missing `layers`",
        "1:1: assignment #1: missing `device`",
        "3:1: shared block #1: missing `layers`",
    ] {
        assert!(all.contains(needle), "missing {needle:?} in\n{all}");
    }
    let all = rendered(
        &PlacementFile::from_toml_str("format = 1\nmodel = \"m\"\ncluster = \"c\"\n").unwrap_err(),
    );
    assert!(all.contains("no [[assign]] blocks"), "{all}");
}

#[test]
fn range_and_type_errors_carry_locations() {
    let text = DEMO.replace("experts = \"0-19\"", "experts = \"19-0\"");
    let p = PlacementFile::from_toml_str(&text).unwrap_err();
    assert_eq!(p.len(), 1);
    assert_eq!(p[0].location().unwrap().line(), line_of(&text, "19-0"));
    assert!(
        p[0].message()
            .contains("range \"19-0\" runs backwards; write it as \"0-19\""),
        "{}",
        p[0]
    );

    let text = DEMO.replace("experts = \"0-19\"", "experts = 1.5");
    let p = PlacementFile::from_toml_str(&text).unwrap_err();
    assert_eq!(p.len(), 1);
    let loc = p[0].location().unwrap();
    assert_eq!((loc.line(), loc.column()), (line_of(&text, "1.5"), 11));
    assert_eq!(p[0].item(), "assignment #1");
    assert!(
        p[0].message().starts_with("`experts`: wrong type"),
        "{}",
        p[0]
    );
}

#[test]
fn programmatic_placements_are_validated_the_same_way() {
    let t = topo("single-host.toml");
    let m = preset_by_name("demo-small").unwrap();
    let layer: Vec<Vec<u32>> = vec![(0..16).collect(), (16..32).chain([16]).collect()];
    let mut slots = vec![layer; 4];
    slots[2][0].retain(|&e| e != 5);
    slots[3][0].push(99);
    let p = Placement::new(&t, &m, slots, vec![SharedLocation::Router; 4], "").unwrap_err();
    let all = rendered(&p);
    assert!(
        all.contains("layer 0 device \"local/cpu1\": experts 16 are listed more than once"),
        "{all}"
    );
    assert!(
        all.contains(
            "layer 3 device \"local/cpu0\": experts 99 do not exist (demo-small has experts 0-31)"
        ),
        "{all}"
    );
    assert!(
        all.contains("layer 2: expert 5 has no owner; assign it to a device"),
        "{all}"
    );

    let slots = vec![vec![(0..16).collect(), (16..32).collect()]; 4];
    let p = Placement::new(
        &t,
        &m,
        slots,
        vec![SharedLocation::Device(DeviceRank(1)); 4],
        "d",
    )
    .unwrap();
    assert_eq!(
        p.shared_location(0),
        Some(SharedLocation::Device(DeviceRank(1)))
    );
    let back = Placement::from_toml_str(&p.to_toml_string(), &t, &m).unwrap();
    assert_eq!(back, p);
}

#[test]
fn writer_output_is_compact() {
    let t = topo("mi300x-4x8.toml");
    let m = preset_by_name("kimi-k2").unwrap();
    let p = Placement::load(
        &examples_dir().join("mi300x-4x8-kimi-k2.placement.toml"),
        &t,
        &m,
    )
    .unwrap();
    let text = p.to_toml_string();
    assert_eq!(text.matches("[[assign]]").count(), 32, "{text}");
    assert!(
        text.contains(
            "[[assign]]\nlayers = \"all\"\ndevice = \"node0/gpu0\"\nexperts = \"0-11,96\"\n"
        ),
        "{text}"
    );
    assert_eq!(Placement::from_toml_str(&text, &t, &m).unwrap(), p);
}

/// A topology text with `per_node` devices on each of `nodes` nodes, generous budgets.
fn topology_text(nodes: usize, per_node: usize) -> String {
    let mut s = String::from("format = 1\nname = \"prop\"\n");
    for n in 0..nodes {
        s.push_str(&format!(
            "[[nodes]]\nname = \"n{n}\"\naddress = \"10.0.0.{}\"\ncontrol_port = 100\ndata_port = 200\n\
             intra_link = \"shm\"\nintra_bandwidth_gb_s = 10\n\
             nics = [{{ name = \"lo\", kind = \"tcp\", speed_gbit_s = 10, mtu = 1500 }}]\ndevices = [\n",
            n + 1
        ));
        for d in 0..per_node {
            s.push_str(&format!(
                "  {{ name = \"d{d}\", kind = \"cpu\", arch = \"cpu\", threads = 1, expert_memory = \"1 GB\", memory_bandwidth_gb_s = 1 }},\n"
            ));
        }
        s.push_str("]\n");
    }
    s
}

/// Random placement inputs: for each layer and expert a non-empty owner set (bitmask), and a
/// random slot order per device; a shared location per layer.
fn placement_strategy(
    layers: usize,
    experts: usize,
    devices: usize,
) -> impl Strategy<Value = (Vec<Vec<u32>>, Vec<u64>, Vec<usize>)> {
    let masks = proptest::collection::vec(
        proptest::collection::vec(1u32..(1u32 << devices), experts),
        layers,
    );
    let orders = proptest::collection::vec(any::<u64>(), layers * devices);
    let shared = proptest::collection::vec(0..=devices, layers);
    (masks, orders, shared)
}

/// A topology size, a model, and placement inputs sized for them.
#[allow(clippy::type_complexity)]
fn case() -> impl Strategy<
    Value = (
        usize,
        usize,
        &'static str,
        (Vec<Vec<u32>>, Vec<u64>, Vec<usize>),
    ),
> {
    (
        1usize..3,
        1usize..4,
        prop_oneof![
            Just("toy-grouped"),
            Just("toy-softmax"),
            Just("toy-mixtral")
        ],
    )
        .prop_flat_map(|(nodes, per_node, model)| {
            let m = preset_by_name(model).unwrap();
            (
                Just(nodes),
                Just(per_node),
                Just(model),
                placement_strategy(
                    m.moe_layers() as usize,
                    m.routed_experts as usize,
                    nodes * per_node,
                ),
            )
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn writer_and_reader_round_trip((nodes, per_node, model_name, (masks, orders, shared_pick)) in case()) {
        let t = Topology::from_toml_str(&topology_text(nodes, per_node)).unwrap();
        let m = preset_by_name(model_name).unwrap();
        let n_dev = t.devices().len();
        let layers = m.moe_layer_ids();
        // Build slots: device lists from the masks, then a seeded rotation/reversal as slot order.
        let mut slots = vec![vec![Vec::new(); n_dev]; layers.len()];
        for (li, per_expert) in masks.iter().enumerate() {
            for (e, mask) in per_expert.iter().enumerate() {
                for (r, list) in slots[li].iter_mut().enumerate() {
                    if mask & (1 << r) != 0 {
                        list.push(e as u32);
                    }
                }
            }
            for (r, list) in slots[li].iter_mut().enumerate() {
                if !list.is_empty() {
                    let k = (orders[li * n_dev + r] % list.len() as u64) as usize;
                    list.rotate_left(k);
                    if orders[li * n_dev + r] & 1 == 1 {
                        list.reverse();
                    }
                }
            }
        }
        let shared: Vec<SharedLocation> = shared_pick
            .iter()
            .map(|&s| if s == n_dev { SharedLocation::Router } else { SharedLocation::Device(DeviceRank(s as u32)) })
            .collect();
        let p = Placement::new(&t, &m, slots.clone(), shared, "round trip").unwrap();
        // lookups agree with the input and with brute force
        for (li, &layer) in layers.iter().enumerate() {
            for (r, list) in slots[li].iter().enumerate() {
                prop_assert_eq!(p.experts_on(DeviceRank(r as u32), layer), list.as_slice());
            }
            for e in 0..m.routed_experts {
                let owners = p.owners(layer, e);
                let brute = brute_owners(&p, layer, e);
                prop_assert_eq!(owners, brute.as_slice());
                prop_assert!(!owners.is_empty());
            }
        }
        let text = p.to_toml_string();
        let back = Placement::from_toml_str(&text, &t, &m);
        prop_assert!(back.is_ok(), "{}\n{}", text, rendered(&back.clone().unwrap_err()));
        prop_assert_eq!(back.unwrap(), p);
    }
}

/// The slot filling as it was written first: one table entry per expert of every (layer,
/// device) touched, each listed expert looked up one at a time. The oracle of [`SlotFill`].
fn brute_fill(
    model: &ModelSpec,
    blocks: &[(Block, usize, Vec<usize>)],
    layers: &[u32],
    n_dev: usize,
) -> (Vec<Vec<Vec<u32>>>, Dups) {
    let e_max = model.routed_experts as u64;
    let mut slots = vec![vec![Vec::new(); n_dev]; layers.len()];
    let mut first_by = vec![vec![vec![0usize; e_max as usize]; n_dev]; layers.len()];
    let mut dups: Dups = BTreeMap::new();
    for (b, r, lis) in blocks {
        for &li in lis {
            for &(lo, hi) in &b.experts {
                if lo >= e_max {
                    continue;
                }
                for e in lo as u32..=hi.min(e_max - 1) as u32 {
                    match first_by[li][*r][e as usize] {
                        0 => {
                            slots[li][*r].push(e);
                            first_by[li][*r][e as usize] = b.number;
                        }
                        prev => {
                            let entry = dups.entry((b.number, prev, *r)).or_default();
                            entry.0.insert(e);
                            entry.1.insert(layers[li]);
                        }
                    }
                }
            }
        }
    }
    (slots, dups)
}

fn random_block(number: usize, experts: Vec<(u64, u64)>) -> Block {
    Block {
        number,
        span: None,
        layers: ListSpec::Keyword,
        layers_span: None,
        device: String::new(),
        device_span: None,
        experts,
        experts_span: None,
    }
}

proptest! {
    /// Slot lists and duplicates from ranges held as intervals equal the per-expert table's,
    /// whatever the blocks repeat or overlap (ranges past the model's experts included).
    #[test]
    fn slot_filling_by_ranges_equals_the_per_expert_table(
        raw in prop::collection::vec(
            (
                0usize..3,
                prop::collection::vec(0usize..4, 0..6),
                prop::collection::vec((0u64..14, 0u64..6), 1..5),
            ),
            1..7,
        )
    ) {
        let mut model = preset_by_name("demo-small").unwrap();
        model.routed_experts = 12;
        let layers = [1u32, 2, 3, 4];
        let blocks: Vec<(Block, usize, Vec<usize>)> = raw
            .into_iter()
            .enumerate()
            .map(|(i, (r, lis, spans))| {
                let experts = spans.into_iter().map(|(lo, len)| (lo, lo + len)).collect();
                (random_block(i + 1, experts), r, lis)
            })
            .collect();
        let (want_slots, want_dups) = brute_fill(&model, &blocks, &layers, 3);
        let mut fill = SlotFill::new(layers.len(), 3);
        for (b, r, lis) in &blocks {
            prop_assert!(fill.place(&model, b, *r, lis.clone(), &layers).is_ok());
        }
        prop_assert_eq!(&fill.slots, &want_slots);
        prop_assert_eq!(&fill.dups, &want_dups);
    }
}

/// Ranges a block repeats cost what its distinct experts cost (the duplicate is reported
/// once), and blocks that list more slots than MAX_LISTED_SLOTS in all are refused naming the
/// bound, instead of resolving taking minutes and memory in proportion.
#[test]
fn repeated_ranges_are_reported_once_and_listing_past_the_bound_is_refused() {
    let t = topo("single-host.toml");
    let header = |model: &str| {
        format!(
            "format = 1\nmodel = \"{model}\"\ncluster = \"{}\"\n",
            t.name()
        )
    };
    let block = |experts: &str| {
        format!(
            "\n[[assign]]\nlayers = \"all\"\ndevice = \"local/cpu0\"\nexperts = \"{experts}\"\n"
        )
    };
    let problems = |text: &str, m: &ModelSpec| match Placement::from_toml_str(text, &t, m) {
        Ok(_) => panic!("expected problems"),
        Err(p) => rendered(&p),
    };
    let demo = preset_by_name("demo-small").unwrap();
    let text = header("demo-small") + &block(&vec!["0-31"; 20_000].join(","));
    let p = problems(&text, &demo);
    assert_eq!(
        p.matches("earlier in the same assignment").count(),
        1,
        "{p}"
    );
    let k2 = preset_by_name("kimi-k2").unwrap();
    let per_block = u64::from(k2.routed_experts) * k2.moe_layer_ids().len() as u64;
    let blocks = (MAX_LISTED_SLOTS / per_block + 2) as usize;
    let text = header("kimi-k2") + &block("0-383").repeat(blocks);
    let p = problems(&text, &k2);
    assert!(
        p.contains(&format!("more than the {MAX_LISTED_SLOTS}")),
        "{}",
        &p[p.len().saturating_sub(2000)..]
    );
    assert!(
        p.contains(&format!("assignment #{}", blocks - 1)),
        "the block that passes it is named"
    );
}
