//! Physical-to-logical expert maps as vLLM, SGLang and DeepSeek EPLB use them, so a plan can
//! move between systems (`expertmesh plan --export-eplb FILE` / `--import-eplb FILE`).
//!
//! Why this exists: every serving system that balances experts converges on one artefact, a
//! per-layer array `phy2log[layer][slot]` naming the logical expert in each physical slot, with
//! slots numbered device-major (`device = slot / slots_per_device`). Writing and reading it lets
//! a plan made here run there, and a map recorded there be checked, evaluated and served here.
//!
//! # File
//!
//! Written: `{"physical_to_logical_map": [[e, e, ...], ...]}` — exactly SGLang's
//! `--init-expert-location` JSON (which takes no other keys). Rows are all `num_layers` model
//! layers (SGLang's convention; dense layers get the trivial map `slot % E`), or only the MoE
//! layers with `--eplb-layers moe` (the row order of vLLM's `physical_to_logical_map` state).
//! Every device must hold the same number of slots in every layer (these systems require it).
//!
//! Read: the same, or `{"phy2log": ...}`, or TensorRT-LLM's
//! `{"initial_global_assignments": {"LAYER": [...]}}` keyed by model layer id. A 2-D map with
//! `num_layers` rows is indexed by layer id, one with as many rows as MoE layers by MoE layer.
//! The slot count must be a multiple of the topology's device count; slot `s` goes to device rank
//! `s / (slots / devices)`. DeepSeek's EPLB may put two replicas of one expert on one device;
//! they are merged into one (the device holds it once) with a warning — the slot is then unused.

use expertmesh_topology::model::ModelSpec;
use expertmesh_topology::placement::Placement;
use expertmesh_topology::topology::{DeviceRank, Topology};
use serde_json::Value;
use std::path::Path;

/// Which rows an exported map has.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum EplbLayers {
    /// One row per model layer (SGLang).
    #[default]
    All,
    /// One row per MoE layer (vLLM's state tensor).
    Moe,
}

impl EplbLayers {
    /// Both row choices, in the order the command line lists them.
    pub const ALL: [EplbLayers; 2] = [EplbLayers::All, EplbLayers::Moe];

    /// The name used on the command line.
    pub fn name(self) -> &'static str {
        match self {
            EplbLayers::All => "all",
            EplbLayers::Moe => "moe",
        }
    }
}

impl std::str::FromStr for EplbLayers {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        EplbLayers::ALL
            .into_iter()
            .find(|x| x.name() == s)
            .ok_or_else(|| format!("unknown map rows {s:?}: one of all, moe"))
    }
}

/// `phy2log` rows of a placement, one per MoE layer, slots device-major in each device's slot
/// order. Err when devices hold different numbers of slots.
pub fn phy2log(placement: &Placement, topology: &Topology) -> Result<Vec<Vec<u32>>, String> {
    let n = topology.devices().len();
    let mut per_device: Option<usize> = None;
    let mut rows = Vec::with_capacity(placement.layers().len());
    for &layer in placement.layers() {
        let mut row = Vec::new();
        for d in 0..n {
            let list = placement.experts_on(DeviceRank(d as u32), layer);
            match per_device {
                None => per_device = Some(list.len()),
                Some(c) if c != list.len() => {
                    return Err(format!(
                        "device \"{}\" holds {} experts in layer {layer} but others hold {c}; vLLM/SGLang maps need the same slot count on every device in every layer (choose --redundant so that experts + replicas divide evenly by the {n} devices, on devices of one kind)",
                        topology.devices()[d].id(),
                        list.len()
                    ));
                }
                Some(_) => {}
            }
            row.extend_from_slice(list);
        }
        rows.push(row);
    }
    Ok(rows)
}

/// The export file's text.
pub fn export_json(
    placement: &Placement,
    topology: &Topology,
    model: &ModelSpec,
    layers: EplbLayers,
) -> Result<String, String> {
    let moe_rows = phy2log(placement, topology)?;
    let slots = moe_rows.first().map_or(0, Vec::len);
    let e = model.routed_experts as usize;
    let rows: Vec<Vec<u32>> = match layers {
        EplbLayers::Moe => moe_rows,
        EplbLayers::All => (0..model.num_layers)
            .map(|l| match placement.layers().binary_search(&l) {
                Ok(i) => moe_rows[i].clone(),
                Err(_) => (0..slots).map(|s| (s % e.max(1)) as u32).collect(),
            })
            .collect(),
    };
    let body: Vec<String> = rows
        .iter()
        .map(|r| {
            format!(
                "    [{}]",
                r.iter().map(u32::to_string).collect::<Vec<_>>().join(", ")
            )
        })
        .collect();
    Ok(format!(
        "{{\n  \"physical_to_logical_map\": [\n{}\n  ]\n}}\n",
        body.join(",\n")
    ))
}

/// A map read from a file: per MoE layer, per device rank, the experts in slot order.
#[derive(Clone, Debug, PartialEq)]
pub struct ImportedMap {
    /// `[MoE layer index][device rank]` → experts.
    pub slots: Vec<Vec<Vec<u32>>>,
    /// Slots per device in the file.
    pub slots_per_device: usize,
    /// Merged duplicates and other remarks.
    pub warnings: Vec<String>,
}

fn rows_of(v: &Value) -> Option<Vec<Vec<i64>>> {
    v.as_array()?
        .iter()
        .map(|r| r.as_array()?.iter().map(Value::as_i64).collect())
        .collect()
}

/// Read a map (see the module doc).
pub fn import(path: &Path, topology: &Topology, model: &ModelSpec) -> Result<ImportedMap, String> {
    let text = expertmesh_topology::diag::read_capped_text(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?
        .map_err(|at| format!("{}: byte {at}: the file is not UTF-8 text", path.display()))?;
    import_str(&text, topology, model).map_err(|m| format!("{}: {m}", path.display()))
}

/// Parse map text (see the module doc).
pub fn import_str(
    text: &str,
    topology: &Topology,
    model: &ModelSpec,
) -> Result<ImportedMap, String> {
    let v: Value = serde_json::from_str(text).map_err(|e| {
        format!("not JSON ({e}); expected {{\"physical_to_logical_map\": [[...], ...]}}")
    })?;
    let ids = model.moe_layer_ids();
    let rows = rows_per_moe_layer(&v, model, &ids)?;
    let spd = slots_per_device(&rows, &ids, topology)?;
    split_over_devices(&rows, &ids, spd, topology, model)
}

/// Import step: one row of expert ids per MoE layer, from whichever of the known keys the file
/// has.
fn rows_per_moe_layer(v: &Value, model: &ModelSpec, ids: &[u32]) -> Result<Vec<Vec<i64>>, String> {
    if let Some(m) = v.get("physical_to_logical_map").or(v.get("phy2log")) {
        rows_of_map(m, model, ids)
    } else if let Some(obj) = v
        .get("initial_global_assignments")
        .and_then(Value::as_object)
    {
        rows_of_assignments(obj, model, ids)
    } else {
        Err("no `physical_to_logical_map`, `phy2log` or `initial_global_assignments` found".into())
    }
}

/// A 2-D map: rows per model layer (the MoE layers' are kept) or per MoE layer.
fn rows_of_map(m: &Value, model: &ModelSpec, ids: &[u32]) -> Result<Vec<Vec<i64>>, String> {
    let shape_hint = "an array of per-layer arrays of integer expert ids";
    let rows = rows_of(m).ok_or_else(|| format!("the map is not {shape_hint}"))?;
    if rows.len() == model.num_layers as usize {
        Ok(ids.iter().map(|&l| rows[l as usize].clone()).collect())
    } else if rows.len() == ids.len() {
        Ok(rows)
    } else {
        Err(format!(
            "the map has {} rows; {} has {} layers ({} of them MoE) — give one row per layer or per MoE layer",
            rows.len(),
            model.name,
            model.num_layers,
            ids.len()
        ))
    }
}

/// TensorRT-LLM's `initial_global_assignments`: rows keyed by model layer id, one for every
/// MoE layer.
fn rows_of_assignments(
    obj: &serde_json::Map<String, Value>,
    model: &ModelSpec,
    ids: &[u32],
) -> Result<Vec<Vec<i64>>, String> {
    let mut by_layer: Vec<Option<Vec<i64>>> = vec![None; ids.len()];
    for (k, row) in obj {
        let layer: u32 = k
            .trim()
            .parse()
            .map_err(|_| format!("initial_global_assignments key \"{k}\" is not a layer id"))?;
        let li = ids.binary_search(&layer).map_err(|_| {
            format!(
                "initial_global_assignments names layer {layer}, which is not a MoE layer of {}",
                model.name
            )
        })?;
        let r = row
            .as_array()
            .and_then(|a| a.iter().map(Value::as_i64).collect::<Option<Vec<i64>>>())
            .ok_or_else(|| format!("layer {layer}: not an array of integer expert ids"))?;
        by_layer[li] = Some(r);
    }
    let missing: Vec<u32> = (0..ids.len())
        .filter(|&i| by_layer[i].is_none())
        .map(|i| ids[i])
        .collect();
    if !missing.is_empty() {
        return Err(format!(
            "initial_global_assignments lacks MoE layers {}; give every MoE layer",
            expertmesh_topology::ranges::format_list(&missing)
        ));
    }
    Ok(by_layer.into_iter().flatten().collect())
}

/// Import step: the slots per device — every row the same length, a multiple of the devices.
fn slots_per_device(rows: &[Vec<i64>], ids: &[u32], topology: &Topology) -> Result<usize, String> {
    let n_dev = topology.devices().len();
    let slots = rows.first().map_or(0, Vec::len);
    if let Some((i, r)) = rows.iter().enumerate().find(|(_, r)| r.len() != slots) {
        return Err(format!(
            "layer {} has {} slots but layer {} has {slots}; every layer has the same slots",
            ids[i],
            r.len(),
            ids[0]
        ));
    }
    if slots == 0 || slots % n_dev != 0 {
        return Err(format!(
            "{slots} slots per layer is not a multiple of the {n_dev} devices of \"{}\"; slots are numbered device-major, slots_per_device = slots / devices",
            topology.name()
        ));
    }
    Ok(slots / n_dev)
}

/// Import step: each row's slots to devices (device-major), merging an expert a device already
/// holds (with a warning); an expert that does not exist fails the import.
fn split_over_devices(
    rows: &[Vec<i64>],
    ids: &[u32],
    spd: usize,
    topology: &Topology,
    model: &ModelSpec,
) -> Result<ImportedMap, String> {
    let n_dev = topology.devices().len();
    let e = model.routed_experts as i64;
    let mut warnings = Vec::new();
    let mut merged = 0usize;
    let mut merged_at: Vec<String> = Vec::new();
    let mut out = Vec::with_capacity(rows.len());
    for (li, row) in rows.iter().enumerate() {
        let mut per_dev: Vec<Vec<u32>> = vec![Vec::with_capacity(spd); n_dev];
        for (s, &x) in row.iter().enumerate() {
            if x < 0 || x >= e {
                return Err(format!(
                    "layer {} slot {s}: expert {x} does not exist ({} has experts 0-{})",
                    ids[li],
                    model.name,
                    e - 1
                ));
            }
            let d = &mut per_dev[s / spd];
            if d.contains(&(x as u32)) {
                merged += 1;
                if merged_at.len() < 3 {
                    merged_at.push(format!(
                        "layer {} device \"{}\" expert {x}",
                        ids[li],
                        topology.devices()[s / spd].id()
                    ));
                }
            } else {
                d.push(x as u32);
            }
        }
        out.push(per_dev);
    }
    if merged > 0 {
        warnings.push(format!(
            "{merged} replica slot{} held an expert its device already holds ({}{}); merged — those slots stay unused",
            if merged == 1 { "" } else { "s" },
            merged_at.join(", "),
            if merged > 3 { ", ..." } else { "" }
        ));
    }
    Ok(ImportedMap {
        slots: out,
        slots_per_device: spd,
        warnings,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use expertmesh_topology::model::preset_by_name;
    use expertmesh_topology::placement::SharedLocation;

    #[test]
    fn row_choices_and_strategies_parse_by_their_names_only() {
        for x in EplbLayers::ALL {
            assert_eq!(x.name().parse::<EplbLayers>(), Ok(x));
        }
        for x in crate::Strategy::ALL {
            assert_eq!(x.name().parse::<crate::Strategy>(), Ok(x));
        }
        let e = "MoE".parse::<EplbLayers>().unwrap_err();
        assert!(e.contains("\"MoE\"") && e.contains("all, moe"), "{e}");
        let e = "greedy".parse::<crate::Strategy>().unwrap_err();
        assert!(e.contains("auto, global, hierarchical"), "{e}");
    }

    fn topo() -> Topology {
        Topology::from_toml_str(
            r#"
format = 1
name = "t"
[[nodes]]
name = "n0"
address = "10.0.0.1"
control_port = 7000
data_port = 7100
intra_link = "pcie"
intra_bandwidth_gb_s = 20
nics = [{ name = "eth0", kind = "tcp", speed_gbit_s = 100, mtu = 9000 }]
devices = [
  { name = "c0", kind = "cpu", arch = "cpu", threads = 1, expert_memory = "1 GiB", memory_bandwidth_gb_s = 20 },
  { name = "c1", kind = "cpu", arch = "cpu", threads = 1, expert_memory = "1 GiB", memory_bandwidth_gb_s = 20 },
]
"#,
        )
        .unwrap()
    }

    #[test]
    fn export_then_import_gives_the_same_placement() {
        let t = topo();
        let m = preset_by_name("toy-grouped").unwrap(); // 3 layers, MoE 1-2, 16 experts, shared
        let slots = vec![
            vec![(0..8).chain([9]).collect(), (8..16).chain([0]).collect()],
            vec![(8..16).chain([1]).collect(), (0..8).chain([15]).collect()],
        ];
        let p = Placement::new(&t, &m, slots, vec![SharedLocation::Router; 2], "").unwrap();
        for layers in [EplbLayers::All, EplbLayers::Moe] {
            let json = export_json(&p, &t, &m, layers).unwrap();
            let v: Value = serde_json::from_str(&json).unwrap();
            let rows = v["physical_to_logical_map"].as_array().unwrap();
            assert_eq!(rows.len(), if layers == EplbLayers::All { 3 } else { 2 });
            let back = import_str(&json, &t, &m).unwrap();
            assert_eq!(back.slots_per_device, 9);
            assert!(back.warnings.is_empty());
            let q =
                Placement::new(&t, &m, back.slots, vec![SharedLocation::Router; 2], "").unwrap();
            for &l in p.layers() {
                for d in 0..2 {
                    assert_eq!(
                        p.experts_on(DeviceRank(d), l),
                        q.experts_on(DeviceRank(d), l)
                    );
                }
            }
        }
    }

    #[test]
    fn duplicates_on_one_device_are_merged_with_a_warning() {
        let t = topo();
        let m = preset_by_name("toy-softmax").unwrap(); // 2 MoE layers, 8 experts
        let json = r#"{"initial_global_assignments": {"0": [0,1,2,3,3, 4,5,6,7,0], "1": [0,1,2,3,4, 5,6,7,0,1]}}"#;
        let map = import_str(json, &t, &m).unwrap();
        assert_eq!(map.slots[0][0], vec![0, 1, 2, 3]);
        assert_eq!(map.warnings.len(), 1, "{:?}", map.warnings);
        assert!(map.warnings[0].contains("expert 3"), "{:?}", map.warnings);
    }

    #[test]
    fn bad_maps_say_what_is_wrong() {
        let t = topo();
        let m = preset_by_name("toy-softmax").unwrap();
        for (text, want) in [
            ("{", "not JSON"),
            ("{}", "no `physical_to_logical_map`"),
            (r#"{"phy2log": [[0,1,2]]}"#, "rows"),
            (r#"{"phy2log": [[0,1,2],[0,1,2]]}"#, "multiple"),
            (r#"{"phy2log": [[0,1,2,9],[0,1,2,3]]}"#, "expert 9"),
            (r#"{"phy2log": [[0,1],[0,1,2,3]]}"#, "same slots"),
            (r#"{"phy2log": [["a"],[1]]}"#, "not an array"),
            (r#"{"initial_global_assignments": {"0": [0,1]}}"#, "lacks"),
            (
                r#"{"initial_global_assignments": {"7": [0,1]}}"#,
                "not a MoE layer",
            ),
        ] {
            let err = import_str(text, &t, &m).unwrap_err();
            assert!(err.contains(want), "{text}: {err}");
        }
    }

    #[test]
    fn uneven_devices_cannot_be_exported() {
        let t = topo();
        let m = preset_by_name("toy-softmax").unwrap();
        let slots = vec![vec![(0..5).collect(), (5..8).collect()]; 2];
        let p = Placement::new(&t, &m, slots, vec![], "").unwrap();
        let err = export_json(&p, &t, &m, EplbLayers::All).unwrap_err();
        assert!(err.contains("same slot count"), "{err}");
    }
}
