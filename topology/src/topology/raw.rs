//! Raw topology structs: what serde reads, before any check.
//!
//! Why this exists: every field is optional (and spanned) so that all missing or mistyped keys are
//! reported together with line:column; the schema lists the known keys for nearest-key hints and
//! recognizes another kind of file passed as a topology.

use crate::diag::{Field, Foreign, RawBytes, Schema, fields_of};
use serde::Deserialize;
use std::collections::BTreeMap;
use toml::Spanned;

#[derive(Deserialize)]
pub(super) struct RawTopology {
    pub(super) format: Field<i64>,
    pub(super) name: Field<String>,
    pub(super) description: Field<String>,
    pub(super) router: Field<RawRouters>,
    pub(super) measured: Option<RawMeasured>,
    pub(super) device_types: Option<BTreeMap<String, Spanned<RawDeviceType>>>,
    pub(super) nodes: Field<Vec<Spanned<RawNode>>>,
}

#[derive(Deserialize)]
pub(super) struct RawRouter {
    pub(super) node: Field<String>,
    pub(super) listen_address: Field<String>,
    pub(super) port: Field<i64>,
    pub(super) mesh_port: Field<i64>,
}

/// `[router]` (one table) or `[[router]]` (an array of tables, one per router instance).
pub(super) enum RawRouters {
    One(RawRouter),
    Many(Vec<Spanned<RawRouter>>),
}

impl<'de> Deserialize<'de> for RawRouters {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = RawRouters;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a [router] table or [[router]] tables")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, m: A) -> Result<RawRouters, A::Error> {
                RawRouter::deserialize(serde::de::value::MapAccessDeserializer::new(m))
                    .map(RawRouters::One)
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, s: A) -> Result<RawRouters, A::Error> {
                Vec::deserialize(serde::de::value::SeqAccessDeserializer::new(s))
                    .map(RawRouters::Many)
            }
        }
        d.deserialize_any(V)
    }
}

#[derive(Deserialize)]
pub(super) struct RawMeasured {
    pub(super) intra_node: Field<RawTier>,
    pub(super) inter_node: Field<RawTier>,
}

#[derive(Deserialize)]
pub(super) struct RawTier {
    pub(super) bandwidth_gb_s: Field<f64>,
    pub(super) latency_us: Field<f64>,
}

#[derive(Deserialize)]
pub(super) struct RawNode {
    pub(super) name: Field<String>,
    pub(super) address: Field<String>,
    pub(super) data_address: Field<String>,
    pub(super) control_port: Field<i64>,
    pub(super) data_port: Field<i64>,
    pub(super) intra_link: Field<String>,
    pub(super) intra_bandwidth_gb_s: Field<f64>,
    pub(super) intra_latency_us: Field<f64>,
    pub(super) nics: Field<Vec<Spanned<RawNic>>>,
    pub(super) devices: Field<Vec<Spanned<RawDevice>>>,
}

#[derive(Deserialize)]
pub(super) struct RawNic {
    pub(super) name: Field<String>,
    pub(super) kind: Field<String>,
    pub(super) speed_gbit_s: Field<f64>,
    pub(super) mtu: Field<i64>,
    pub(super) gid_ipv4: Field<String>,
    pub(super) gid_index: Field<i64>,
    pub(super) traffic_class: Field<i64>,
}

/// Keys shared by `[device_types.X]` and devices.
#[derive(Deserialize)]
pub(super) struct RawDeviceType {
    pub(super) kind: Field<String>,
    pub(super) arch: Field<String>,
    pub(super) memory_total: Field<RawBytes>,
    pub(super) expert_memory: Field<RawBytes>,
    pub(super) memory_bandwidth_gb_s: Field<f64>,
    pub(super) int8_tops: Field<f64>,
    pub(super) bf16_tflops: Field<f64>,
    pub(super) threads: Field<i64>,
    pub(super) price_usd_per_hour: Field<f64>,
}

#[derive(Deserialize)]
pub(super) struct RawDevice {
    pub(super) name: Field<String>,
    #[serde(rename = "type")]
    pub(super) type_name: Field<String>,
    pub(super) numa: Field<i64>,
    pub(super) nic: Field<String>,
    pub(super) data_port: Field<i64>,
    pub(super) gpu_index: Field<i64>,
    pub(super) kind: Field<String>,
    pub(super) arch: Field<String>,
    pub(super) memory_total: Field<RawBytes>,
    pub(super) expert_memory: Field<RawBytes>,
    pub(super) memory_bandwidth_gb_s: Field<f64>,
    pub(super) int8_tops: Field<f64>,
    pub(super) bf16_tflops: Field<f64>,
    pub(super) threads: Field<i64>,
    pub(super) price_usd_per_hour: Field<f64>,
}

/// The top-level keys of a topology file (to recognize one passed as another kind of file).
pub(crate) fn top_level_keys() -> &'static [&'static str] {
    fields_of::<RawTopology>()
}

pub(super) fn schema() -> Schema {
    Schema::new("", fields_of::<RawTopology>(), None)
        .root(
            "topology file",
            vec![
                Foreign {
                    what: "placement file",
                    keys: crate::placement::top_level_keys(),
                    hint: "pass it with --placement",
                },
                Foreign {
                    what: "model file",
                    keys: crate::model_file::top_level_keys(),
                    hint: "pass it with --model",
                },
            ],
        )
        .table(
            "router",
            Schema::new("[router]", fields_of::<RawRouter>(), None),
        )
        .table(
            "measured",
            Schema::new("[measured]", fields_of::<RawMeasured>(), None)
                .table(
                    "intra_node",
                    Schema::new("intra_node", fields_of::<RawTier>(), None),
                )
                .table(
                    "inter_node",
                    Schema::new("inter_node", fields_of::<RawTier>(), None),
                ),
        )
        .map(
            "device_types",
            Schema::new("device type", fields_of::<RawDeviceType>(), None),
        )
        .table(
            "nodes",
            Schema::new("node", fields_of::<RawNode>(), Some("name"))
                .table(
                    "nics",
                    Schema::new("NIC", fields_of::<RawNic>(), Some("name")),
                )
                .table(
                    "devices",
                    Schema::new("device", fields_of::<RawDevice>(), Some("name")),
                ),
        )
}
