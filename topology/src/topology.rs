//! Topology files: the cluster a fabric runs on — nodes, their devices and NICs, the router.
//!
//! Why this exists: the launcher starts one worker per device, the transport picks NICs and
//! ports, the planner weighs memory budgets, bandwidths and prices — all from one hand-written
//! file. This module reads that file (format 1, spec below), reports every problem in one run,
//! and hands out a validated [`Topology`] whose devices have stable ids (`"node/device"`) and
//! ranks (file order: nodes in order, devices in order within each node).
//!
//! # Format 1
//!
//! ```toml
//! format = 1
//! name = "mi300x-4x8"                  # cluster name: letters, digits, '.', '_', '-'
//! description = "optional free text"
//!
//! [router]                              # optional: where the router service runs
//! node = "node0"                        # a node name below
//! listen_address = "0.0.0.0"            # optional, default: that node's address
//! port = 7000                           # where serving frontends connect
//! # mesh_port = 7101                     # optional: where it listens for workers (default: the node's control_port)
//! # Several routers sharing one expert pool: write `[[router]]` tables instead, one per router
//! # (e.g. one per frontend host); router i is mesh rank i and every worker dials every router.
//! # Two routers on one node need distinct `port`s and all but one a `mesh_port`.
//!
//! [measured]                            # optional, measured per-tier numbers
//! intra_node = { bandwidth_gb_s = 48.0, latency_us = 2.5 }
//! inter_node = { bandwidth_gb_s = 45.0, latency_us = 4.0 }
//!
//! [device_types.mi300x]                 # optional templates; a device's own keys win
//! kind = "gpu"                          # "gpu" | "cpu"
//! arch = "gfx942"                       # gfx target for gpu ("gfx90a", "gfx942", "gfx1100", ...); "cpu" for cpu
//! memory_total = "192 GB"               # optional; expert_memory must not exceed it
//! expert_memory = "176 GB"              # budget for pinned experts: integer bytes or "N GB"/"N GiB"/...
//! memory_bandwidth_gb_s = 5300          # device memory read bandwidth, GB/s
//! int8_tops = 2614.9                    # peak dense int8 TOPS   (required for gpu)
//! bf16_tflops = 1307.4                  # peak dense bf16 TFLOPS (required for gpu)
//! price_usd_per_hour = 2.0              # optional
//! # threads = 8                         # cpu devices only (required there): worker thread-pool size
//!
//! [[nodes]]
//! name = "node0"
//! address = "10.0.0.1"                  # IP or hostname; control connections
//! data_address = "10.1.0.1"             # optional, default: address; workers' data sockets
//! control_port = 7100
//! data_port = 7200                      # device i of this node listens on data_port + i ...
//! intra_link = "xgmi"                   # "xgmi" | "pcie" | "shm" (required with 2+ devices)
//! intra_bandwidth_gb_s = 64             # device-to-device, per direction (required with 2+ devices)
//! intra_latency_us = 2.0                # optional
//! nics = [
//!   { name = "rdma0", kind = "roce", speed_gbit_s = 400, mtu = 9000, gid_ipv4 = "10.1.0.1", traffic_class = 106 },
//! ]
//! devices = [                           # ... unless the device sets its own data_port
//!   { name = "gpu0", type = "mi300x", numa = 0, nic = "rdma0", gpu_index = 0 },
//! ]
//! ```
//!
//! NIC keys: `name`, `kind` (`"roce"` | `"tcp"`), `speed_gbit_s`, `mtu` (Ethernet MTU; 1280–9216
//! for RoCE, 68–65536 for TCP), RoCE GID selection by `gid_ipv4` (match the GID carrying this IPv4
//! address) or `gid_index` (not both; neither = pick the RoCE v2 GID of the data address),
//! `traffic_class` (0–255, the IP TOS byte, e.g. 106 = DSCP 26 + ECT).
//! Device keys: `name`, optional `type` (a `[device_types.X]` entry), every device-type key,
//! `numa`, `nic` (required when the node has several NICs), `data_port`, `gpu_index` (gpu only;
//! default: order among the node's gpu devices).

use crate::diag::{
    Ctx, Field, FileError, Foreign, RawBytes, Schema, check_format, did_you_mean, fields_of,
    nearest, span_of, split, text_or_default,
};
use crate::units::{SizeUnit, checked_sum, format_bytes_in};
use hosts::{Addr, Host};
use serde::Deserialize;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::net::{IpAddr, Ipv4Addr};
use std::ops::Range;
use std::path::Path;
use toml::Spanned;

/// The only topology format version this build reads.
pub const TOPOLOGY_FORMAT: i64 = 1;

/// A device's rank: its position in file order (nodes in order, devices in order). The fabric
/// starts one worker per device and numbers the workers by rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DeviceRank(pub u32);

impl DeviceRank {
    /// The rank as an index into [`Topology::devices`].
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for DeviceRank {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// What a device is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DeviceKind {
    /// A GPU (HIP backend).
    Gpu,
    /// A CPU worker (the packed-INT4 CPU backend).
    Cpu,
}

impl DeviceKind {
    /// The name used in files.
    pub fn name(self) -> &'static str {
        match self {
            DeviceKind::Gpu => "gpu",
            DeviceKind::Cpu => "cpu",
        }
    }
}

/// What a NIC speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum NicKind {
    /// RDMA over Converged Ethernet (v2), through ibverbs.
    Roce,
    /// Plain TCP.
    Tcp,
}

impl NicKind {
    /// The name used in files.
    pub fn name(self) -> &'static str {
        match self {
            NicKind::Roce => "roce",
            NicKind::Tcp => "tcp",
        }
    }
}

/// How a RoCE NIC's GID is chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GidSelection {
    /// Pick the RoCE v2 GID of the node's data address (also the value for TCP NICs).
    Auto,
    /// The GID carrying this IPv4 address (robust against index shifts).
    Ipv4(Ipv4Addr),
    /// A fixed GID table index.
    Index(u32),
}

/// The link between devices inside a node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum IntraLinkKind {
    /// AMD Infinity Fabric (xGMI) peer links.
    Xgmi,
    /// PCIe peer-to-peer or through host memory.
    Pcie,
    /// Shared host memory (CPU workers on one host).
    Shm,
}

impl IntraLinkKind {
    /// The name used in files.
    pub fn name(self) -> &'static str {
        match self {
            IntraLinkKind::Xgmi => "xgmi",
            IntraLinkKind::Pcie => "pcie",
            IntraLinkKind::Shm => "shm",
        }
    }
}

/// The intra-node link of a node.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct IntraLink {
    kind: IntraLinkKind,
    bandwidth_gb_s: f64,
    latency_us: Option<f64>,
}

impl IntraLink {
    /// The link technology.
    pub fn kind(&self) -> IntraLinkKind {
        self.kind
    }
    /// Device-to-device bandwidth per direction, GB/s.
    pub fn bandwidth_gb_s(&self) -> f64 {
        self.bandwidth_gb_s
    }
    /// Device-to-device latency, microseconds, when given.
    pub fn latency_us(&self) -> Option<f64> {
        self.latency_us
    }
}

/// A measured bandwidth/latency for one tier.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TierMeasure {
    bandwidth_gb_s: Option<f64>,
    latency_us: Option<f64>,
}

impl TierMeasure {
    /// Measured bandwidth, GB/s.
    pub fn bandwidth_gb_s(&self) -> Option<f64> {
        self.bandwidth_gb_s
    }
    /// Measured latency, microseconds.
    pub fn latency_us(&self) -> Option<f64> {
        self.latency_us
    }
}

/// Optional measured numbers per tier.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct MeasuredTiers {
    intra_node: Option<TierMeasure>,
    inter_node: Option<TierMeasure>,
}

impl MeasuredTiers {
    /// Between devices of one node.
    pub fn intra_node(&self) -> Option<TierMeasure> {
        self.intra_node
    }
    /// Between nodes, over the network.
    pub fn inter_node(&self) -> Option<TierMeasure> {
        self.inter_node
    }
}

/// A network interface of a node.
#[derive(Clone, Debug, PartialEq)]
pub struct Nic {
    name: String,
    kind: NicKind,
    speed_gbit_s: f64,
    mtu: u32,
    gid: GidSelection,
    traffic_class: Option<u8>,
}

impl Nic {
    /// Device or interface name (`mlx5_0`, `eth0`, `lo`).
    pub fn name(&self) -> &str {
        &self.name
    }
    /// RoCE or TCP.
    pub fn kind(&self) -> NicKind {
        self.kind
    }
    /// Line rate, Gbit/s.
    pub fn speed_gbit_s(&self) -> f64 {
        self.speed_gbit_s
    }
    /// Ethernet MTU.
    pub fn mtu(&self) -> u32 {
        self.mtu
    }
    /// GID selection (RoCE).
    pub fn gid(&self) -> GidSelection {
        self.gid
    }
    /// Traffic class byte, when set.
    pub fn traffic_class(&self) -> Option<u8> {
        self.traffic_class
    }
    /// The RDMA path MTU this Ethernet MTU allows (largest of 4096/2048/1024/512/256 that fits
    /// with the RoCE v2 headers), for RoCE NICs.
    pub fn rdma_path_mtu(&self) -> Option<u32> {
        if self.kind != NicKind::Roce {
            return None;
        }
        // Ethernet payload minus IPv4 (20) + UDP (8) + BTH (12) + ICRC (4) + some extension room.
        let room = self.mtu.saturating_sub(20 + 8 + 12 + 4 + 28);
        [4096, 2048, 1024, 512, 256]
            .into_iter()
            .find(|m| *m <= room)
    }
}

/// A machine in the cluster.
#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    name: String,
    address: String,
    data_address: String,
    control_port: u16,
    intra_link: Option<IntraLink>,
    nics: Vec<Nic>,
    device_ranks: Range<u32>,
}

impl Node {
    /// Node name (unique in the cluster).
    pub fn name(&self) -> &str {
        &self.name
    }
    /// Control address (IP or hostname).
    pub fn address(&self) -> &str {
        &self.address
    }
    /// Address the workers' data sockets use (defaults to [`Node::address`]).
    pub fn data_address(&self) -> &str {
        &self.data_address
    }
    /// Control port.
    pub fn control_port(&self) -> u16 {
        self.control_port
    }
    /// `address:control_port`, IPv6 bracketed.
    pub fn control_endpoint(&self) -> String {
        endpoint(&self.address, self.control_port)
    }
    /// The intra-node link (absent only on single-device nodes that did not give one).
    pub fn intra_link(&self) -> Option<IntraLink> {
        self.intra_link
    }
    /// The node's NICs, in file order.
    pub fn nics(&self) -> &[Nic] {
        &self.nics
    }
    /// The ranks of this node's devices.
    pub fn device_ranks(&self) -> impl Iterator<Item = DeviceRank> + use<> {
        self.device_ranks.clone().map(DeviceRank)
    }
    /// Number of devices on this node.
    pub fn device_count(&self) -> usize {
        self.device_ranks.len()
    }
}

/// One device: one worker process pinning its experts.
#[derive(Clone, Debug, PartialEq)]
pub struct Device {
    id: String,
    name: String,
    rank: DeviceRank,
    node: usize,
    type_name: Option<String>,
    kind: DeviceKind,
    arch: String,
    memory_total: Option<u64>,
    expert_memory: u64,
    expert_memory_unit: SizeUnit,
    memory_bandwidth_gb_s: f64,
    int8_tops: Option<f64>,
    bf16_tflops: Option<f64>,
    threads: Option<u32>,
    price_usd_per_hour: Option<f64>,
    numa: Option<u32>,
    nic: usize,
    data_port: u16,
    gpu_index: Option<u32>,
}

impl Device {
    /// Stable id `"node/device"`.
    pub fn id(&self) -> &str {
        &self.id
    }
    /// Device name within its node.
    pub fn name(&self) -> &str {
        &self.name
    }
    /// Rank (file order).
    pub fn rank(&self) -> DeviceRank {
        self.rank
    }
    /// Index of its node in [`Topology::nodes`].
    pub fn node_index(&self) -> usize {
        self.node
    }
    /// The `[device_types.X]` template it used, if any.
    pub fn type_name(&self) -> Option<&str> {
        self.type_name.as_deref()
    }
    /// GPU or CPU.
    pub fn kind(&self) -> DeviceKind {
        self.kind
    }
    /// `gfx942`, `gfx90a`, `gfx1100`, ..., or `cpu`.
    pub fn arch(&self) -> &str {
        &self.arch
    }
    /// Physical memory, when given.
    pub fn memory_total_bytes(&self) -> Option<u64> {
        self.memory_total
    }
    /// Memory budget for pinned experts, bytes.
    pub fn expert_memory_bytes(&self) -> u64 {
        self.expert_memory
    }
    /// The units `expert_memory` was written in (reports show it in the same).
    pub fn expert_memory_unit(&self) -> SizeUnit {
        self.expert_memory_unit
    }
    /// Memory read bandwidth, GB/s.
    pub fn memory_bandwidth_gb_s(&self) -> f64 {
        self.memory_bandwidth_gb_s
    }
    /// Peak dense int8 TOPS (always set for GPUs).
    pub fn int8_tops(&self) -> Option<f64> {
        self.int8_tops
    }
    /// Peak dense bf16 TFLOPS (always set for GPUs).
    pub fn bf16_tflops(&self) -> Option<f64> {
        self.bf16_tflops
    }
    /// Worker thread-pool size (CPU devices).
    pub fn threads(&self) -> Option<u32> {
        self.threads
    }
    /// Price per device-hour, USD.
    pub fn price_usd_per_hour(&self) -> Option<f64> {
        self.price_usd_per_hour
    }
    /// NUMA node, when given.
    pub fn numa(&self) -> Option<u32> {
        self.numa
    }
    /// Index of the NIC it sends through in its node's [`Node::nics`].
    pub fn nic_index(&self) -> usize {
        self.nic
    }
    /// The worker's data port.
    pub fn data_port(&self) -> u16 {
        self.data_port
    }
    /// HIP device ordinal on its node (GPUs).
    pub fn gpu_index(&self) -> Option<u32> {
        self.gpu_index
    }
}

/// Where one router service runs.
#[derive(Clone, Debug, PartialEq)]
pub struct RouterSpec {
    node: usize,
    listen_address: String,
    port: u16,
    mesh_port: u16,
}

impl RouterSpec {
    /// Index of its node in [`Topology::nodes`].
    pub fn node_index(&self) -> usize {
        self.node
    }
    /// Address it listens on for serving frontends.
    pub fn listen_address(&self) -> &str {
        &self.listen_address
    }
    /// Port it listens on for serving frontends.
    pub fn port(&self) -> u16 {
        self.port
    }
    /// `listen_address:port`, IPv6 bracketed.
    pub fn listen_endpoint(&self) -> String {
        endpoint(&self.listen_address, self.port)
    }
    /// Port it listens on for workers (the mesh), on its node's address; default: the
    /// node's `control_port`.
    pub fn mesh_port(&self) -> u16 {
        self.mesh_port
    }
}

/// A validated cluster topology.
#[derive(Clone, Debug, PartialEq)]
pub struct Topology {
    name: String,
    description: String,
    nodes: Vec<Node>,
    devices: Vec<Device>,
    routers: Vec<RouterSpec>,
    measured: MeasuredTiers,
}

impl Topology {
    /// Read and validate a topology file.
    pub fn load(path: &Path) -> Result<Topology, FileError> {
        let text = crate::diag::read_text(path)?;
        Topology::from_toml_str(&text).map_err(|problems| FileError::Invalid {
            path: path.to_path_buf(),
            problems,
        })
    }

    /// Parse and validate topology text; every problem is returned.
    pub fn from_toml_str(text: &str) -> Result<Topology, Vec<crate::diag::Problem>> {
        let mut ctx = Ctx::new(text);
        let Some(raw) = ctx.parse::<RawTopology>(&schema()) else {
            return Err(ctx.into_problems());
        };
        let topo = validate(&mut ctx, &raw);
        match topo {
            Some(t) if !ctx.has_problems() => Ok(t),
            _ => Err(ctx.into_problems()),
        }
    }

    /// Cluster name.
    pub fn name(&self) -> &str {
        &self.name
    }
    /// Free-text description.
    pub fn description(&self) -> &str {
        &self.description
    }
    /// Nodes in file order.
    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }
    /// Devices in rank order.
    pub fn devices(&self) -> &[Device] {
        &self.devices
    }
    /// The device of a rank.
    pub fn device(&self, rank: DeviceRank) -> Option<&Device> {
        self.devices.get(rank.index())
    }
    /// Look a device up by its id `"node/device"`.
    pub fn device_by_id(&self, id: &str) -> Option<&Device> {
        self.devices.iter().find(|d| d.id == id)
    }
    /// The node a device is on.
    pub fn node_of(&self, device: &Device) -> &Node {
        &self.nodes[device.node]
    }
    /// The NIC a device sends through.
    pub fn nic_of(&self, device: &Device) -> &Nic {
        &self.nodes[device.node].nics[device.nic]
    }
    /// `data_address:data_port` of a device's worker, IPv6 bracketed.
    pub fn data_endpoint(&self, device: &Device) -> String {
        endpoint(&self.nodes[device.node].data_address, device.data_port)
    }
    /// The first router (`[router]`, or the first `[[router]]` entry), when given.
    pub fn router(&self) -> Option<&RouterSpec> {
        self.routers.first()
    }
    /// Every router, in file order (empty when the file has no router section). Router `i`
    /// is mesh rank `i`; several routers share the same workers.
    pub fn routers(&self) -> &[RouterSpec] {
        &self.routers
    }
    /// Measured per-tier numbers.
    pub fn measured(&self) -> MeasuredTiers {
        self.measured
    }
    /// Sum of all devices' expert memory budgets (validation refuses a topology whose sum
    /// does not fit in 64 bits).
    pub fn total_expert_memory(&self) -> u64 {
        checked_sum(self.devices.iter().map(|d| d.expert_memory)).unwrap_or(u64::MAX)
    }
    /// The units to show cluster-wide expert memory in: binary when every device's
    /// `expert_memory` was written in binary units, else decimal.
    pub fn expert_memory_unit(&self) -> SizeUnit {
        let binary = !self.devices.is_empty()
            && self
                .devices
                .iter()
                .all(|d| d.expert_memory_unit == SizeUnit::Binary);
        if binary {
            SizeUnit::Binary
        } else {
            SizeUnit::Decimal
        }
    }
}

fn endpoint(host: &str, port: u16) -> String {
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

// ---------------------------------------------------------------------------------------------
// Raw structs: what serde reads. Every field optional so that missing keys are reported together.

#[derive(Deserialize)]
struct RawTopology {
    format: Field<i64>,
    name: Field<String>,
    description: Field<String>,
    router: Field<RawRouters>,
    measured: Option<RawMeasured>,
    device_types: Option<BTreeMap<String, Spanned<RawDeviceType>>>,
    nodes: Field<Vec<Spanned<RawNode>>>,
}

#[derive(Deserialize)]
struct RawRouter {
    node: Field<String>,
    listen_address: Field<String>,
    port: Field<i64>,
    mesh_port: Field<i64>,
}

/// `[router]` (one table) or `[[router]]` (an array of tables, one per router instance).
enum RawRouters {
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
struct RawMeasured {
    intra_node: Field<RawTier>,
    inter_node: Field<RawTier>,
}

#[derive(Deserialize)]
struct RawTier {
    bandwidth_gb_s: Field<f64>,
    latency_us: Field<f64>,
}

#[derive(Deserialize)]
struct RawNode {
    name: Field<String>,
    address: Field<String>,
    data_address: Field<String>,
    control_port: Field<i64>,
    data_port: Field<i64>,
    intra_link: Field<String>,
    intra_bandwidth_gb_s: Field<f64>,
    intra_latency_us: Field<f64>,
    nics: Field<Vec<Spanned<RawNic>>>,
    devices: Field<Vec<Spanned<RawDevice>>>,
}

#[derive(Deserialize)]
struct RawNic {
    name: Field<String>,
    kind: Field<String>,
    speed_gbit_s: Field<f64>,
    mtu: Field<i64>,
    gid_ipv4: Field<String>,
    gid_index: Field<i64>,
    traffic_class: Field<i64>,
}

/// Keys shared by `[device_types.X]` and devices.
#[derive(Deserialize)]
struct RawDeviceType {
    kind: Field<String>,
    arch: Field<String>,
    memory_total: Field<RawBytes>,
    expert_memory: Field<RawBytes>,
    memory_bandwidth_gb_s: Field<f64>,
    int8_tops: Field<f64>,
    bf16_tflops: Field<f64>,
    threads: Field<i64>,
    price_usd_per_hour: Field<f64>,
}

#[derive(Deserialize)]
struct RawDevice {
    name: Field<String>,
    #[serde(rename = "type")]
    type_name: Field<String>,
    numa: Field<i64>,
    nic: Field<String>,
    data_port: Field<i64>,
    gpu_index: Field<i64>,
    kind: Field<String>,
    arch: Field<String>,
    memory_total: Field<RawBytes>,
    expert_memory: Field<RawBytes>,
    memory_bandwidth_gb_s: Field<f64>,
    int8_tops: Field<f64>,
    bf16_tflops: Field<f64>,
    threads: Field<i64>,
    price_usd_per_hour: Field<f64>,
}

/// The top-level keys of a topology file (to recognize one passed as another kind of file).
pub(crate) fn top_level_keys() -> &'static [&'static str] {
    fields_of::<RawTopology>()
}

fn schema() -> Schema {
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

// ---------------------------------------------------------------------------------------------
// Validation helpers.

type Sp = Option<Range<usize>>;

/// A value that may be absent, present but invalid (already reported), or valid.
#[derive(Clone, Debug)]
enum Val<T> {
    Absent,
    Invalid,
    Ok(T, Sp),
}

impl<T: Clone> Val<T> {
    fn or(self, fallback: &Val<T>) -> Val<T> {
        match self {
            Val::Absent => fallback.clone(),
            v => v,
        }
    }
    fn get(&self) -> Option<T> {
        match self {
            Val::Ok(v, _) => Some(v.clone()),
            _ => None,
        }
    }
    fn span(&self) -> Sp {
        match self {
            Val::Ok(_, s) => s.clone(),
            _ => None,
        }
    }
    fn is_absent(&self) -> bool {
        matches!(self, Val::Absent)
    }
}

fn check<T: Clone, U>(
    ctx: &mut Ctx<'_>,
    f: &Field<T>,
    item: &str,
    convert: impl FnOnce(T) -> Result<U, String>,
) -> Val<U> {
    match split(f) {
        (None, _) => Val::Absent,
        (Some(v), span) => match convert(v) {
            Ok(u) => Val::Ok(u, span),
            Err(msg) => {
                ctx.at(span, item, msg);
                Val::Invalid
            }
        },
    }
}

fn int_in(key: &'static str, lo: i64, hi: i64) -> impl FnOnce(i64) -> Result<i64, String> {
    move |v| {
        if (lo..=hi).contains(&v) {
            Ok(v)
        } else {
            Err(format!("{key} = {v} is out of range; use {lo} to {hi}"))
        }
    }
}

/// A port number (1-65535) as a `check` conversion.
fn port(key: &'static str) -> impl FnOnce(i64) -> Result<u16, String> {
    move |v| int_in(key, 1, 65535)(v).map(|v| v as u16)
}

/// An integer in `lo..=hi` as a `u32`, as a `check` conversion.
fn small_u32(key: &'static str, lo: i64, hi: i64) -> impl FnOnce(i64) -> Result<u32, String> {
    move |v| int_in(key, lo, hi)(v).map(|v| v as u32)
}

fn positive(key: &'static str) -> impl FnOnce(f64) -> Result<f64, String> {
    move |v| {
        if v.is_finite() && v > 0.0 {
            Ok(v)
        } else {
            Err(format!("{key} = {v} must be a positive number"))
        }
    }
}

fn non_negative(key: &'static str) -> impl FnOnce(f64) -> Result<f64, String> {
    move |v| {
        if v.is_finite() && v >= 0.0 {
            Ok(v)
        } else {
            Err(format!("{key} = {v} must be zero or a positive number"))
        }
    }
}

fn valid_name(what: &'static str) -> impl FnOnce(String) -> Result<String, String> {
    move |s| {
        if s.is_empty() || s.len() > 64 {
            Err(format!("{what} name \"{s}\" must be 1 to 64 characters"))
        } else if let Some(c) = s
            .chars()
            .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
        {
            Err(format!(
                "{what} name \"{s}\" contains '{c}'; use only letters, digits, '.', '_' and '-'"
            ))
        } else {
            Ok(s)
        }
    }
}

fn valid_host(key: &'static str) -> impl FnOnce(String) -> Result<String, String> {
    move |s| {
        if is_valid_host(&s) {
            Ok(s)
        } else {
            Err(format!(
                "{key} \"{s}\" is neither an IP address nor a valid hostname"
            ))
        }
    }
}

/// An IPv4/IPv6 address or an RFC 1123 hostname.
pub fn is_valid_host(s: &str) -> bool {
    if s.parse::<IpAddr>().is_ok() {
        return true;
    }
    !s.is_empty()
        && s.len() <= 253
        && s.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        })
        && !s.chars().all(|c| c.is_ascii_digit() || c == '.')
}

fn one_of<T: Copy>(
    key: &'static str,
    options: &'static [(&'static str, T)],
) -> impl FnOnce(String) -> Result<T, String> {
    move |s| {
        if let Some((_, v)) = options.iter().find(|(n, _)| *n == s) {
            return Ok(*v);
        }
        let names: Vec<&str> = options.iter().map(|(n, _)| *n).collect();
        let hint = match nearest(&s, names.iter().copied()) {
            Some(n) => format!("; did you mean \"{n}\"?"),
            None => String::new(),
        };
        Err(format!(
            "{key} \"{s}\" is not one of {}{hint}",
            names
                .iter()
                .map(|n| format!("\"{n}\""))
                .collect::<Vec<_>>()
                .join(", ")
        ))
    }
}

const DEVICE_KINDS: &[(&str, DeviceKind)] = &[("gpu", DeviceKind::Gpu), ("cpu", DeviceKind::Cpu)];
const NIC_KINDS: &[(&str, NicKind)] = &[("roce", NicKind::Roce), ("tcp", NicKind::Tcp)];
const LINK_KINDS: &[(&str, IntraLinkKind)] = &[
    ("xgmi", IntraLinkKind::Xgmi),
    ("pcie", IntraLinkKind::Pcie),
    ("shm", IntraLinkKind::Shm),
];

/// The device keys that a `[device_types.X]` entry may also provide, parsed.
#[derive(Clone)]
struct DeviceFields {
    kind: Val<DeviceKind>,
    arch: Val<String>,
    memory_total: Val<(u64, SizeUnit)>,
    expert_memory: Val<(u64, SizeUnit)>,
    memory_bandwidth_gb_s: Val<f64>,
    int8_tops: Val<f64>,
    bf16_tflops: Val<f64>,
    threads: Val<u32>,
    price_usd_per_hour: Val<f64>,
}

impl DeviceFields {
    fn or(self, t: &DeviceFields) -> DeviceFields {
        DeviceFields {
            kind: self.kind.or(&t.kind),
            arch: self.arch.or(&t.arch),
            memory_total: self.memory_total.or(&t.memory_total),
            expert_memory: self.expert_memory.or(&t.expert_memory),
            memory_bandwidth_gb_s: self.memory_bandwidth_gb_s.or(&t.memory_bandwidth_gb_s),
            int8_tops: self.int8_tops.or(&t.int8_tops),
            bf16_tflops: self.bf16_tflops.or(&t.bf16_tflops),
            threads: self.threads.or(&t.threads),
            price_usd_per_hour: self.price_usd_per_hour.or(&t.price_usd_per_hour),
        }
    }

    /// Stands in for an unknown device type: nothing it would supply is reported as missing.
    fn unknown() -> DeviceFields {
        DeviceFields {
            kind: Val::Invalid,
            arch: Val::Invalid,
            memory_total: Val::Invalid,
            expert_memory: Val::Invalid,
            memory_bandwidth_gb_s: Val::Invalid,
            int8_tops: Val::Invalid,
            bf16_tflops: Val::Invalid,
            threads: Val::Invalid,
            price_usd_per_hour: Val::Invalid,
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn device_fields(
    ctx: &mut Ctx<'_>,
    item: &str,
    kind: &Field<String>,
    arch: &Field<String>,
    memory_total: &Field<RawBytes>,
    expert_memory: &Field<RawBytes>,
    memory_bandwidth_gb_s: &Field<f64>,
    (int8_tops, bf16_tflops): (&Field<f64>, &Field<f64>),
    threads: &Field<i64>,
    price_usd_per_hour: &Field<f64>,
) -> DeviceFields {
    let bytes = |key: &'static str| {
        move |b: RawBytes| {
            b.bytes_unit()
                .map_err(|e| format!("{key}: {e}"))
                .and_then(|v| {
                    if v.0 == 0 {
                        Err(format!("{key} must be more than 0 bytes"))
                    } else {
                        Ok(v)
                    }
                })
        }
    };
    DeviceFields {
        kind: check(ctx, kind, item, one_of("kind", DEVICE_KINDS)),
        arch: check(ctx, arch, item, |s: String| {
            if s == "cpu" || is_gfx_target(&s) {
                Ok(s)
            } else {
                Err(format!(
                    "arch \"{s}\" is not a gfx target (\"gfx90a\", \"gfx942\", \"gfx1100\", ...) or \"cpu\""
                ))
            }
        }),
        memory_total: check(ctx, memory_total, item, bytes("memory_total")),
        expert_memory: check(ctx, expert_memory, item, bytes("expert_memory")),
        memory_bandwidth_gb_s: check(
            ctx,
            memory_bandwidth_gb_s,
            item,
            positive("memory_bandwidth_gb_s"),
        ),
        int8_tops: check(ctx, int8_tops, item, positive("int8_tops")),
        bf16_tflops: check(ctx, bf16_tflops, item, positive("bf16_tflops")),
        threads: check(ctx, threads, item, small_u32("threads", 1, 4096)),
        price_usd_per_hour: check(
            ctx,
            price_usd_per_hour,
            item,
            non_negative("price_usd_per_hour"),
        ),
    }
}

/// `gfx` followed by 2–6 lowercase hex digits/letters (`gfx90a`, `gfx942`, `gfx1100`).
fn is_gfx_target(s: &str) -> bool {
    s.strip_prefix("gfx").is_some_and(|rest| {
        (2..=6).contains(&rest.len())
            && rest
                .chars()
                .all(|c| c.is_ascii_digit() || ('a'..='f').contains(&c))
    })
}

// ---------------------------------------------------------------------------------------------
// Validation.

/// (type, key) → what the key is, and the devices that lack it.
type TypeMissing = BTreeMap<(String, &'static str), (&'static str, Vec<String>)>;

/// The `[device_types.X]` templates, parsed, with where each is defined.
struct DeviceTypes {
    fields: HashMap<String, DeviceFields>,
    spans: HashMap<String, Range<usize>>,
}

/// What the node steps have built so far.
#[derive(Default)]
struct Built {
    nodes: Vec<Node>,
    devices: Vec<Device>,
    /// Every valid node name → its position in the file (also for nodes that failed).
    node_names: HashMap<String, usize>,
    /// Some `[[nodes]]` entry has no valid name (so a name referring to it may look unknown).
    unnamed_nodes: bool,
    type_missing: TypeMissing,
    /// Where the kept nodes' and devices' ports were written.
    listen_spans: ListenSpans,
    /// Where each kept device's `expert_memory` was written (on it or on its type).
    expert_memory_spans: Vec<Sp>,
}

/// A node's own keys, checked (its NICs, devices and link are separate steps).
struct NodeHeader {
    label: String,
    span: Sp,
    name: Val<String>,
    address: Val<String>,
    data_address: Val<String>,
    control_port: Val<u16>,
    data_port_base: Val<u16>,
}

/// What the devices of one node share while they are checked in order.
struct NodeDevices<'a> {
    node: &'a NodeHeader,
    nic_names: &'a [String],
    nic_count: usize,
    dev_names: HashSet<String>,
    gpu_indices: HashMap<u32, String>,
    gpu_count: u32,
}

/// Check a parsed topology file section by section, reporting every problem into `ctx`.
fn validate(ctx: &mut Ctx<'_>, raw: &RawTopology) -> Option<Topology> {
    check_format(ctx, &raw.format, "topology", TOPOLOGY_FORMAT);
    let name = check_required(
        ctx,
        &raw.name,
        "top level",
        valid_name("cluster"),
        None,
        "missing `name`; add the cluster name, e.g. `name = \"my-cluster\"`",
    );
    let description = text_or_default(&raw.description);
    let types = validate_device_types(ctx, &raw.device_types);
    let mut built = validate_nodes(ctx, &types, &raw.nodes);
    report_type_missing(ctx, &types, std::mem::take(&mut built.type_missing));
    let raw_routers = router_entries(&raw.router);
    let routers: Vec<RouterSpec> = raw_routers
        .iter()
        .filter_map(|(item, r, span)| validate_router(ctx, item, r, span, &built))
        .collect();
    let measured = raw
        .measured
        .as_ref()
        .map(|m| validate_measured(ctx, m))
        .unwrap_or_default();
    check_total_memory(ctx, &built);
    let topology = Topology {
        name: name.get().unwrap_or_default(),
        description,
        nodes: built.nodes,
        devices: built.devices,
        routers,
        measured,
    };
    if topology.routers.len() == raw_routers.len() {
        let spans: Vec<RouterSpans> = raw_routers
            .iter()
            .map(|(item, r, _)| RouterSpans {
                item: item.clone(),
                port: span_of(&r.port),
                mesh_port: span_of(&r.mesh_port),
            })
            .collect();
        check_port_collisions(ctx, &topology, &built.listen_spans, &spans);
    }
    name.get().map(|_| topology)
}

/// Step: the devices' expert memory adds up to a byte count that fits in 64 bits; the device
/// whose budget takes the sum past it is named.
fn check_total_memory(ctx: &mut Ctx<'_>, built: &Built) {
    let mut total = 0u64;
    for (i, d) in built.devices.iter().enumerate() {
        match total.checked_add(d.expert_memory) {
            Some(t) => total = t,
            None => {
                let node = &built.nodes[d.node];
                ctx.at(
                    built.expert_memory_spans.get(i).cloned().flatten(),
                    format!("node \"{}\" device \"{}\"", node.name, d.name),
                    format!(
                        "expert_memory {} brings the devices' total to {}; lower expert_memory to what the device has",
                        format_bytes_in(d.expert_memory, d.expert_memory_unit),
                        crate::units::TOO_MANY_BYTES
                    ),
                );
                return;
            }
        }
    }
}

/// `check`, then report `missing` at `span` when the key is absent.
fn check_required<T: Clone, U: Clone>(
    ctx: &mut Ctx<'_>,
    f: &Field<T>,
    item: &str,
    convert: impl FnOnce(T) -> Result<U, String>,
    span: Sp,
    missing: &str,
) -> Val<U> {
    let v = check(ctx, f, item, convert);
    if v.is_absent() {
        ctx.at(span, item, missing);
    }
    v
}

/// `{prefix}{what} "name"`, or `{prefix}{what} #n` (counting from 1) for an entry without a name.
fn entry_label(prefix: &str, what: &str, name: &Field<String>, index: usize) -> String {
    match name.as_ref() {
        Some(n) => format!("{prefix}{what} \"{}\"", n.get_ref()),
        None => format!("{prefix}{what} #{}", index + 1),
    }
}

/// Report a NIC or device name used twice on one node, and record the name.
fn unique_on_node(
    ctx: &mut Ctx<'_>,
    names: &mut HashSet<String>,
    name: &Val<String>,
    item: &str,
    what: &str,
) {
    if let Some(n) = name.get()
        && !names.insert(n.clone())
    {
        ctx.at(
            name.span(),
            item,
            format!("{what} name \"{n}\" appears twice on this node; names must be unique"),
        );
    }
}

/// Step: parse the `[device_types.X]` templates.
fn validate_device_types(
    ctx: &mut Ctx<'_>,
    raw: &Option<BTreeMap<String, Spanned<RawDeviceType>>>,
) -> DeviceTypes {
    let mut types = DeviceTypes {
        fields: HashMap::new(),
        spans: HashMap::new(),
    };
    for (tname, t) in raw.iter().flatten() {
        let item = format!("device type \"{tname}\"");
        let tr = t.get_ref();
        if let Err(e) = valid_name("device type")(tname.clone()) {
            ctx.at(Some(t.span()), &item, e);
        }
        let fields = device_fields(
            ctx,
            &item,
            &tr.kind,
            &tr.arch,
            &tr.memory_total,
            &tr.expert_memory,
            &tr.memory_bandwidth_gb_s,
            (&tr.int8_tops, &tr.bf16_tflops),
            &tr.threads,
            &tr.price_usd_per_hour,
        );
        types.fields.insert(tname.clone(), fields);
        types.spans.insert(tname.clone(), t.span());
    }
    types
}

/// Step: every `[[nodes]]` table, in file order (which gives the ranks).
fn validate_nodes(
    ctx: &mut Ctx<'_>,
    types: &DeviceTypes,
    raw_nodes: &Field<Vec<Spanned<RawNode>>>,
) -> Built {
    let list: &[Spanned<RawNode>] = raw_nodes.as_ref().map_or(&[], |n| n.get_ref());
    if list.is_empty() {
        ctx.at(
            span_of(raw_nodes),
            "top level",
            "no nodes; add at least one [[nodes]] table with its devices and NICs",
        );
    }
    let mut built = Built::default();
    for (ni, rn) in list.iter().enumerate() {
        validate_node(ctx, types, &mut built, ni, rn);
    }
    built
}

/// Step: one node — its keys, NICs, devices and intra-node link; kept when its own keys are
/// valid (its devices are dropped otherwise, so that ranks stay consistent with nodes).
fn validate_node(
    ctx: &mut Ctx<'_>,
    types: &DeviceTypes,
    built: &mut Built,
    ni: usize,
    rn: &Spanned<RawNode>,
) {
    let r = rn.get_ref();
    let header = validate_node_header(ctx, ni, rn, &mut built.node_names);
    built.unnamed_nodes |= header.name.get().is_none();
    let (nics, nic_names) = validate_nics(ctx, &header, &r.nics);
    let first_rank = built.devices.len() as u32;
    let mut nd = NodeDevices {
        node: &header,
        nic_names: &nic_names,
        nic_count: r.nics.as_ref().map_or(0, |n| n.get_ref().len()),
        dev_names: HashSet::new(),
        gpu_indices: HashMap::new(),
        gpu_count: 0,
    };
    let raw_devs: &[Spanned<RawDevice>] = r.devices.as_ref().map_or(&[], |d| d.get_ref());
    if raw_devs.is_empty() {
        ctx.at(
            span_of(&r.devices).or(header.span.clone()),
            &header.label,
            "no devices; add `devices = [...]` with at least one gpu or cpu device",
        );
    }
    for (di, rd) in raw_devs.iter().enumerate() {
        validate_device(ctx, types, &mut nd, di, rd, built);
    }
    let intra_link = validate_intra_link(ctx, &header, r, raw_devs.len());
    if let (Some(name), Some(address), Some(control_port)) = (
        header.name.get(),
        header.address.get(),
        header.control_port.get(),
    ) {
        let data_address = header.data_address.get().unwrap_or_else(|| address.clone());
        built
            .listen_spans
            .control_port
            .push(header.control_port.span());
        built.nodes.push(Node {
            name,
            address,
            data_address,
            control_port,
            intra_link,
            nics,
            device_ranks: first_rank..built.devices.len() as u32,
        });
    } else {
        built.devices.truncate(first_rank as usize);
        built.listen_spans.data_port.truncate(first_rank as usize);
        built.expert_memory_spans.truncate(first_rank as usize);
    }
}

/// Step: a node's name (unique in the cluster), addresses and ports.
fn validate_node_header(
    ctx: &mut Ctx<'_>,
    ni: usize,
    rn: &Spanned<RawNode>,
    node_names: &mut HashMap<String, usize>,
) -> NodeHeader {
    let span = Some(rn.span());
    let r = rn.get_ref();
    let label = entry_label("", "node", &r.name, ni);
    let name = check_required(
        ctx,
        &r.name,
        &label,
        valid_name("node"),
        span.clone(),
        "missing `name`; give the node a unique name",
    );
    if let Some(n) = name.get()
        && let Some(prev) = node_names.insert(n.clone(), ni)
    {
        ctx.at(
            name.span(),
            &label,
            format!(
                "node name \"{n}\" is already used by node #{}; node names must be unique",
                prev + 1
            ),
        );
    }
    let address = check_required(
        ctx,
        &r.address,
        &label,
        valid_host("address"),
        span.clone(),
        "missing `address`; give the node's IP address or hostname",
    );
    let data_address = check(ctx, &r.data_address, &label, valid_host("data_address"));
    let control_port = check_required(
        ctx,
        &r.control_port,
        &label,
        port("control_port"),
        span.clone(),
        "missing `control_port`; give the port for control connections (1-65535)",
    );
    let data_port_base = check(ctx, &r.data_port, &label, port("data_port"));
    NodeHeader {
        label,
        span,
        name,
        address,
        data_address,
        control_port,
        data_port_base,
    }
}

/// Step: a node's NICs: the valid ones, and the names of all that have a valid name (what
/// devices' `nic` may refer to).
fn validate_nics(
    ctx: &mut Ctx<'_>,
    node: &NodeHeader,
    raw: &Field<Vec<Spanned<RawNic>>>,
) -> (Vec<Nic>, Vec<String>) {
    let raw_nics: &[Spanned<RawNic>] = raw.as_ref().map_or(&[], |n| n.get_ref());
    if raw_nics.is_empty() {
        ctx.at(
            span_of(raw).or(node.span.clone()),
            &node.label,
            "no NICs; add `nics = [{ name = \"eth0\", kind = \"tcp\", speed_gbit_s = 100, mtu = 1500 }]`",
        );
    }
    let mut nics = Vec::new();
    let mut names = Vec::new();
    let mut seen = HashSet::new();
    for (ci, rc) in raw_nics.iter().enumerate() {
        if let Some(nic) = validate_nic(ctx, &node.label, ci, rc, &mut seen) {
            nics.push(nic);
        }
        if let Some(n) = rc.get_ref().name.as_ref().map(|n| n.get_ref())
            && valid_name("NIC")(n.clone()).is_ok()
        {
            names.push(n.clone());
        }
    }
    (nics, names)
}

/// Step: one NIC — name (unique on its node), kind, speed, MTU, GID selection, traffic class.
fn validate_nic(
    ctx: &mut Ctx<'_>,
    label: &str,
    ci: usize,
    rc: &Spanned<RawNic>,
    names: &mut HashSet<String>,
) -> Option<Nic> {
    let c = rc.get_ref();
    let cspan = Some(rc.span());
    let clabel = entry_label(&format!("{label} "), "NIC", &c.name, ci);
    let name = check_required(
        ctx,
        &c.name,
        &clabel,
        valid_name("NIC"),
        cspan.clone(),
        "missing `name`; give the interface or RDMA device name",
    );
    unique_on_node(ctx, names, &name, &clabel, "NIC");
    let kind = check_required(
        ctx,
        &c.kind,
        &clabel,
        one_of("kind", NIC_KINDS),
        cspan.clone(),
        "missing `kind`; use kind = \"roce\" or kind = \"tcp\"",
    );
    let speed = check_required(
        ctx,
        &c.speed_gbit_s,
        &clabel,
        positive("speed_gbit_s"),
        cspan.clone(),
        "missing `speed_gbit_s`; give the line rate in Gbit/s (e.g. 400)",
    );
    let mtu = check_required(
        ctx,
        &c.mtu,
        &clabel,
        mtu_for(kind.get()),
        cspan,
        "missing `mtu`; give the interface MTU (1500, or 9000 for jumbo frames)",
    );
    let gid = gid_selection(ctx, &clabel, c, kind.get());
    let traffic_class = gid.1;
    let (Some(kind), Some(speed_gbit_s), Some(mtu)) = (kind.get(), speed.get(), mtu.get()) else {
        return None;
    };
    Some(Nic {
        name: name.get().unwrap_or_default(),
        kind,
        speed_gbit_s,
        mtu,
        gid: gid.0,
        traffic_class,
    })
}

/// The `check` conversion for a NIC's MTU: the range of its kind (TCP's when unknown).
fn mtu_for(kind: Option<NicKind>) -> impl FnOnce(i64) -> Result<u32, String> {
    let (lo, hi) = match kind {
        Some(NicKind::Roce) => (1280, 9216),
        _ => (68, 65536),
    };
    move |v| {
        if (lo..=hi).contains(&v) {
            Ok(v as u32)
        } else {
            Err(format!(
                "mtu = {v} is out of range for a {} NIC; use {lo} to {hi} (e.g. 9000 for jumbo frames)",
                kind.map_or("tcp", NicKind::name)
            ))
        }
    }
}

/// Step: a NIC's GID selection (`gid_ipv4` or `gid_index`, RoCE only) and its traffic class.
fn gid_selection(
    ctx: &mut Ctx<'_>,
    clabel: &str,
    c: &RawNic,
    kind: Option<NicKind>,
) -> (GidSelection, Option<u8>) {
    let gid_ipv4 = check(ctx, &c.gid_ipv4, clabel, |s: String| {
        s.parse::<Ipv4Addr>()
            .map_err(|_| format!("gid_ipv4 \"{s}\" is not an IPv4 address"))
    });
    let gid_index = check(ctx, &c.gid_index, clabel, small_u32("gid_index", 0, 255));
    let traffic_class = check(ctx, &c.traffic_class, clabel, |v| {
        int_in("traffic_class", 0, 255)(v).map(|v| v as u8)
    });
    if kind == Some(NicKind::Tcp) {
        for (f, key) in [
            (span_of(&c.gid_ipv4), "gid_ipv4"),
            (span_of(&c.gid_index), "gid_index"),
        ] {
            if f.is_some() {
                ctx.at(
                    f,
                    clabel,
                    format!("{key} only applies to kind = \"roce\"; remove it or change kind"),
                );
            }
        }
        return (GidSelection::Auto, traffic_class.get());
    }
    let gid = match (gid_ipv4.get(), gid_index.get()) {
        (Some(_), Some(_)) => {
            ctx.at(
                gid_index.span(),
                clabel,
                "set either gid_ipv4 or gid_index, not both (gid_ipv4 is robust against GID index shifts)",
            );
            GidSelection::Auto
        }
        (Some(ip), None) => GidSelection::Ipv4(ip),
        (None, Some(i)) => GidSelection::Index(i),
        (None, None) => GidSelection::Auto,
    };
    (gid, traffic_class.get())
}

/// Step: one device — name, keys merged with its type, what its kind needs, GPU index, NIC and
/// data port; appended to `built.devices` when complete.
fn validate_device(
    ctx: &mut Ctx<'_>,
    types: &DeviceTypes,
    nd: &mut NodeDevices<'_>,
    di: usize,
    rd: &Spanned<RawDevice>,
    built: &mut Built,
) {
    let d = rd.get_ref();
    let dspan = Some(rd.span());
    let dlabel = entry_label(&format!("{} ", nd.node.label), "device", &d.name, di);
    let dname = check_required(
        ctx,
        &d.name,
        &dlabel,
        valid_name("device"),
        dspan.clone(),
        "missing `name`; give the device a name unique on its node (e.g. \"gpu0\")",
    );
    unique_on_node(ctx, &mut nd.dev_names, &dname, &dlabel, "device");
    let own = device_fields(
        ctx,
        &dlabel,
        &d.kind,
        &d.arch,
        &d.memory_total,
        &d.expert_memory,
        &d.memory_bandwidth_gb_s,
        (&d.int8_tops, &d.bf16_tflops),
        &d.threads,
        &d.price_usd_per_hour,
    );
    let merged = merge_device_type(ctx, types, &dlabel, &d.type_name, own);
    let node_name = nd.node.name.get().unwrap_or_default();
    let owner = MissingKeyOwner {
        // A key missing from a device and its (known) type is reported once per type.
        known_type: d
            .type_name
            .as_ref()
            .map(|t| t.get_ref())
            .filter(|t| types.fields.contains_key(*t)),
        device_id: format!("{node_name}/{}", dname.get().unwrap_or_default()),
        span: dspan.clone(),
        label: &dlabel,
    };
    report_missing_device_keys(ctx, &merged, &owner, &mut built.type_missing);
    check_device_consistency(ctx, &merged, &dspan, &dlabel);
    let numa = check(ctx, &d.numa, &dlabel, small_u32("numa", 0, 1023));
    let gpu_index = check(ctx, &d.gpu_index, &dlabel, small_u32("gpu_index", 0, 1023));
    let gpu_index = resolve_gpu_index(ctx, nd, &merged, gpu_index, &dname, &dspan, &dlabel);
    let nic = resolve_device_nic(ctx, nd, &d.nic, &dspan, &dlabel);
    let own_port = check(ctx, &d.data_port, &dlabel, port("data_port"));
    let port_span = own_port.span().or(nd.node.data_port_base.span());
    let data_port = resolve_data_port(ctx, own_port, &nd.node.data_port_base, di, &dspan, &dlabel);
    let (Some(name), Some(kind), Some(arch), Some(expert_memory), Some(bw)) = (
        dname.get(),
        merged.kind.get(),
        merged.arch.get(),
        merged.expert_memory.get(),
        merged.memory_bandwidth_gb_s.get(),
    ) else {
        return;
    };
    let (Some(nic), Some(data_port)) = (nic, data_port) else {
        return;
    };
    built.listen_spans.data_port.push(port_span);
    built.expert_memory_spans.push(merged.expert_memory.span());
    built.devices.push(Device {
        id: format!("{node_name}/{name}"),
        name,
        rank: DeviceRank(built.devices.len() as u32),
        node: built.nodes.len(),
        type_name: d.type_name.as_ref().map(|t| t.get_ref().clone()),
        kind,
        arch,
        memory_total: merged.memory_total.get().map(|m| m.0),
        expert_memory: expert_memory.0,
        expert_memory_unit: expert_memory.1,
        memory_bandwidth_gb_s: bw,
        int8_tops: merged.int8_tops.get(),
        bf16_tflops: merged.bf16_tflops.get(),
        threads: merged.threads.get(),
        price_usd_per_hour: merged.price_usd_per_hour.get(),
        numa: numa.get(),
        nic,
        data_port,
        gpu_index,
    });
}

/// Step: a device's own keys over those of its `type`; an unknown type is reported (with a
/// hint) and stands in for every key it might have supplied.
fn merge_device_type(
    ctx: &mut Ctx<'_>,
    types: &DeviceTypes,
    dlabel: &str,
    type_name: &Field<String>,
    own: DeviceFields,
) -> DeviceFields {
    let Some(t) = type_name.as_ref().map(|t| t.get_ref()) else {
        return own;
    };
    if let Some(tf) = types.fields.get(t) {
        return own.or(tf);
    }
    let hint = did_you_mean(t, types.fields.keys().map(String::as_str), || {
        if types.fields.is_empty() {
            "add a [device_types.NAME] table or remove `type`".to_owned()
        } else {
            format!(
                "defined types: {}",
                types.fields.keys().cloned().collect::<Vec<_>>().join(", ")
            )
        }
    });
    ctx.at(
        span_of(type_name),
        dlabel,
        format!("unknown device type \"{t}\"; {hint}"),
    );
    // Keys the unknown type would have supplied are not reported as missing.
    own.or(&DeviceFields::unknown())
}

/// Who hears about a device's missing key: its known type (once per type, listing the
/// devices), else the device itself.
struct MissingKeyOwner<'a> {
    known_type: Option<&'a String>,
    device_id: String,
    span: Sp,
    label: &'a str,
}

/// Step: the keys a device of its kind needs, from the device or its type.
fn report_missing_device_keys(
    ctx: &mut Ctx<'_>,
    merged: &DeviceFields,
    owner: &MissingKeyOwner<'_>,
    type_missing: &mut TypeMissing,
) {
    let kind = merged.kind.get();
    let gpu = kind == Some(DeviceKind::Gpu);
    let cpu = kind == Some(DeviceKind::Cpu);
    let needed: [(bool, bool, &'static str, &'static str); 7] = [
        (true, merged.kind.is_absent(), "kind", "\"gpu\" or \"cpu\""),
        (
            true,
            merged.arch.is_absent(),
            "arch",
            "e.g. \"gfx942\" or \"cpu\"",
        ),
        (
            true,
            merged.expert_memory.is_absent(),
            "expert_memory",
            "memory budget for experts, e.g. \"176 GB\"",
        ),
        (
            true,
            merged.memory_bandwidth_gb_s.is_absent(),
            "memory_bandwidth_gb_s",
            "memory read bandwidth in GB/s",
        ),
        (
            gpu,
            merged.int8_tops.is_absent(),
            "int8_tops",
            "peak dense int8 TOPS",
        ),
        (
            gpu,
            merged.bf16_tflops.is_absent(),
            "bf16_tflops",
            "peak dense bf16 TFLOPS",
        ),
        (
            cpu,
            merged.threads.is_absent(),
            "threads",
            "worker thread-pool size for the CPU backend",
        ),
    ];
    for (applies, absent, key, what) in needed {
        if !(applies && absent) {
            continue;
        }
        match owner.known_type {
            Some(t) => type_missing
                .entry((t.clone(), key))
                .or_insert_with(|| (what, Vec::new()))
                .1
                .push(owner.device_id.clone()),
            None => ctx.at(
                owner.span.clone(),
                owner.label,
                format!(
                    "missing `{key}` ({what}); set it on the device (or use a [device_types.NAME] template via `type`)"
                ),
            ),
        }
    }
}

/// Step: a device's kind against its arch and `threads`, and its expert budget against its
/// memory.
fn check_device_consistency(ctx: &mut Ctx<'_>, merged: &DeviceFields, dspan: &Sp, dlabel: &str) {
    let kind = merged.kind.get();
    match (kind, merged.arch.get()) {
        (Some(DeviceKind::Gpu), Some(a)) if a == "cpu" => ctx.at(
            merged.arch.span().or(dspan.clone()),
            dlabel,
            "a gpu device needs a gfx arch (e.g. \"gfx942\"), not \"cpu\"",
        ),
        (Some(DeviceKind::Cpu), Some(a)) if a != "cpu" => ctx.at(
            merged.arch.span().or(dspan.clone()),
            dlabel,
            format!("a cpu device has arch = \"cpu\", not \"{a}\""),
        ),
        _ => {}
    }
    if kind == Some(DeviceKind::Gpu) && merged.threads.get().is_some() {
        ctx.at(
            merged.threads.span().or(dspan.clone()),
            dlabel,
            "threads only applies to cpu devices; remove it",
        );
    }
    if let (Some((total, tunit)), Some((budget, bunit))) =
        (merged.memory_total.get(), merged.expert_memory.get())
        && budget > total
    {
        ctx.at(
            merged.expert_memory.span().or(dspan.clone()),
            dlabel,
            format!(
                "expert_memory {} exceeds memory_total {}; lower expert_memory",
                format_bytes_in(budget, bunit),
                format_bytes_in(total, tunit)
            ),
        );
    }
}

/// Step: a GPU's HIP ordinal — given, or its order among the node's GPUs — unique on its node;
/// `gpu_index` on another kind of device is reported.
fn resolve_gpu_index(
    ctx: &mut Ctx<'_>,
    nd: &mut NodeDevices<'_>,
    merged: &DeviceFields,
    given: Val<u32>,
    dname: &Val<String>,
    dspan: &Sp,
    dlabel: &str,
) -> Option<u32> {
    if merged.kind.get() != Some(DeviceKind::Gpu) {
        if given.get().is_some() {
            ctx.at(
                given.span(),
                dlabel,
                "gpu_index only applies to gpu devices; remove it",
            );
        }
        return None;
    }
    let idx = given.get().unwrap_or(nd.gpu_count);
    nd.gpu_count += 1;
    if let Some(prev) = nd.gpu_indices.insert(idx, dname.get().unwrap_or_default()) {
        ctx.at(
            given.span().or(dspan.clone()),
            dlabel,
            format!(
                "gpu_index {idx} is already used by device \"{prev}\" on this node; set distinct gpu_index values"
            ),
        );
    }
    Some(idx)
}

/// Step: the NIC a device sends through — the one it names, or its node's only NIC.
fn resolve_device_nic(
    ctx: &mut Ctx<'_>,
    nd: &NodeDevices<'_>,
    nic: &Field<String>,
    dspan: &Sp,
    dlabel: &str,
) -> Option<usize> {
    match split(nic) {
        (Some(n), span) => {
            let found = nd.nic_names.iter().position(|x| *x == n);
            if found.is_none() {
                let hint = did_you_mean(&n, nd.nic_names.iter().map(String::as_str), || {
                    format!("this node's NICs: {}", nd.nic_names.join(", "))
                });
                ctx.at(span, dlabel, format!("unknown NIC \"{n}\"; {hint}"));
            }
            found
        }
        (None, _) if nd.nic_count == 1 => Some(0),
        (None, _) if nd.nic_count == 0 => None,
        (None, _) => {
            ctx.at(
                dspan.clone(),
                dlabel,
                format!(
                    "missing `nic`; this node has {} NICs ({}), say which one this device sends through",
                    nd.nic_count,
                    nd.nic_names.join(", ")
                ),
            );
            None
        }
    }
}

/// Step: a device's data port — its own, or its node's `data_port` plus its index there.
fn resolve_data_port(
    ctx: &mut Ctx<'_>,
    own: Val<u16>,
    base: &Val<u16>,
    di: usize,
    dspan: &Sp,
    dlabel: &str,
) -> Option<u16> {
    match (own, base) {
        (Val::Ok(p, _), _) => Some(p),
        (Val::Invalid, _) | (Val::Absent, Val::Invalid) => None,
        (Val::Absent, Val::Ok(base, bspan)) => {
            let p = *base as u32 + di as u32;
            if p > 65535 {
                ctx.at(
                    bspan.clone(),
                    dlabel,
                    format!(
                        "data_port {base} + device index {di} = {p} exceeds 65535; lower the node's data_port"
                    ),
                );
                None
            } else {
                Some(p as u16)
            }
        }
        (Val::Absent, Val::Absent) => {
            ctx.at(
                dspan.clone(),
                dlabel,
                "no data port; set `data_port` on the node (device i uses data_port + i) or on the device",
            );
            None
        }
    }
}

/// Step: a node's intra-node link, required when it has several devices.
fn validate_intra_link(
    ctx: &mut Ctx<'_>,
    node: &NodeHeader,
    r: &RawNode,
    n_devices: usize,
) -> Option<IntraLink> {
    let label = &node.label;
    let link_kind = check(ctx, &r.intra_link, label, one_of("intra_link", LINK_KINDS));
    let link_bw = check(
        ctx,
        &r.intra_bandwidth_gb_s,
        label,
        positive("intra_bandwidth_gb_s"),
    );
    let link_lat = check(
        ctx,
        &r.intra_latency_us,
        label,
        non_negative("intra_latency_us"),
    );
    if n_devices >= 2 {
        if link_kind.is_absent() {
            ctx.at(
                node.span.clone(),
                label,
                "missing `intra_link` (the node has several devices); use \"xgmi\", \"pcie\" or \"shm\"",
            );
        }
        if link_bw.is_absent() {
            ctx.at(
                node.span.clone(),
                label,
                "missing `intra_bandwidth_gb_s` (the node has several devices); give the device-to-device bandwidth in GB/s",
            );
        }
    }
    match (link_kind.get(), link_bw.get()) {
        (Some(kind), Some(bw)) => Some(IntraLink {
            kind,
            bandwidth_gb_s: bw,
            latency_us: link_lat.get(),
        }),
        (Some(_), None) if link_bw.is_absent() && n_devices < 2 => {
            ctx.at(
                link_kind.span(),
                label,
                "intra_link needs intra_bandwidth_gb_s too",
            );
            None
        }
        _ => None,
    }
}

/// Step: report each key missing from a device type and all of its devices, once per type.
fn report_type_missing(ctx: &mut Ctx<'_>, types: &DeviceTypes, type_missing: TypeMissing) {
    for ((tname, key), (what, devices)) in type_missing {
        let n = devices.len();
        let shown = if n <= 4 {
            devices.join(", ")
        } else {
            format!("{}, ... ({n} in all)", devices[..3].join(", "))
        };
        ctx.at(
            types.spans.get(&tname).cloned(),
            format!("device type \"{tname}\""),
            format!(
                "missing `{key}` ({what}), needed by device{} {shown}; set it here or on each device",
                if n == 1 { "" } else { "s" }
            ),
        );
    }
}

/// The router entries of the file with their item labels ("[router]", or "router 2" for the
/// second `[[router]]` table) and spans.
fn router_entries(raw: &Field<RawRouters>) -> Vec<(String, &RawRouter, Sp)> {
    let Some(rr) = raw else {
        return Vec::new();
    };
    match rr.get_ref() {
        RawRouters::One(r) => vec![("[router]".to_owned(), r, Some(rr.span()))],
        RawRouters::Many(list) if list.len() == 1 => {
            vec![(
                "[router]".to_owned(),
                list[0].get_ref(),
                Some(list[0].span()),
            )]
        }
        RawRouters::Many(list) => list
            .iter()
            .enumerate()
            .map(|(i, r)| (format!("router {}", i + 1), r.get_ref(), Some(r.span())))
            .collect(),
    }
}

/// Step: one `[router]` / `[[router]]` section.
fn validate_router(
    ctx: &mut Ctx<'_>,
    item: &str,
    r: &RawRouter,
    rspan: &Sp,
    built: &Built,
) -> Option<RouterSpec> {
    let nodes = &built.nodes;
    let node = router_node(ctx, item, r, rspan, built);
    let listen = check(ctx, &r.listen_address, item, valid_host("listen_address"));
    let mesh_port = check(ctx, &r.mesh_port, item, port("mesh_port"));
    let port = check_required(
        ctx,
        &r.port,
        item,
        port("port"),
        rspan.clone(),
        "missing `port`; give the port serving frontends connect to",
    );
    let (node, port) = (node?, port.get()?);
    let mesh_port = match mesh_port.get() {
        Some(p) => p,
        None if r.mesh_port.is_some() => return None,
        None => nodes[node].control_port,
    };
    Some(RouterSpec {
        node,
        listen_address: listen.get().unwrap_or_else(|| nodes[node].address.clone()),
        port,
        mesh_port,
    })
}

/// The node the router runs on; an unknown name is reported (one of a node that failed
/// validation is not: that node's problems are already reported; nor is any name while some
/// node has no valid name: it may be the one meant).
fn router_node(
    ctx: &mut Ctx<'_>,
    item: &str,
    r: &RawRouter,
    rspan: &Sp,
    built: &Built,
) -> Option<usize> {
    let (nodes, node_names) = (&built.nodes, &built.node_names);
    let (n, span) = match split(&r.node) {
        (None, _) => {
            ctx.at(
                rspan.clone(),
                item,
                "missing `node`; name the node the router runs on",
            );
            return None;
        }
        (Some(n), span) => (n, span),
    };
    let found = nodes.iter().position(|x| x.name == n);
    if found.is_none()
        && !node_names.contains_key(&n)
        && !node_names.is_empty()
        && !built.unnamed_nodes
    {
        let mut names: Vec<(&usize, &String)> = node_names.iter().map(|(k, v)| (v, k)).collect();
        names.sort();
        let hint = did_you_mean(&n, node_names.keys().map(String::as_str), || {
            let listed: Vec<&str> = names.iter().take(8).map(|(_, k)| k.as_str()).collect();
            let more = names.len().saturating_sub(listed.len());
            format!(
                "nodes: {}{}",
                listed.join(", "),
                if more > 0 {
                    format!(" and {more} more")
                } else {
                    String::new()
                }
            )
        });
        ctx.at(span, item, format!("unknown node \"{n}\"; {hint}"));
    }
    found
}

/// Where the listeners of the cluster were written, for locating port collisions: the span of
/// each node's `control_port` and of each device's data port (its own, or its node's base).
#[derive(Default)]
struct ListenSpans {
    control_port: Vec<Sp>,
    data_port: Vec<Sp>,
}

/// Sockets already claimed: (address, port) → who listens there, and the address as written.
struct PortClaims {
    hosts: HashMap<String, Host>,
    taken: HashMap<(Addr, u16), (String, String)>,
}

/// One listener: who, on which written address (and, for a wildcard, which addresses that
/// covers), on which port, and where it was written.
struct Listener<'a> {
    who: String,
    item: &'a str,
    host: &'a str,
    also: &'a [&'a str],
    port: u16,
    span: Sp,
}

impl PortClaims {
    /// Claim a listener's socket; one already claimed by another listener is reported at the
    /// listener's port.
    fn claim(&mut self, ctx: &mut Ctx<'_>, l: Listener<'_>) {
        let Some(host) = self.hosts.get(l.host).cloned() else {
            return;
        };
        let mut addrs = host.addrs.clone();
        if host.wildcard {
            for h in l.also {
                addrs.extend(
                    self.hosts
                        .get(*h)
                        .map_or(&[][..], |x| &x.addrs)
                        .iter()
                        .cloned(),
                );
            }
        }
        let clash = addrs.iter().find_map(|a| {
            self.taken
                .get(&(a.clone(), l.port))
                .map(|p| (a.clone(), p.clone()))
        });
        if let Some((addr, (prev, prev_host))) = clash {
            let msg = self.clash_message(&l, &host, &addr, &prev, &prev_host);
            ctx.at(l.span.clone(), l.item, msg);
        }
        for a in addrs {
            self.taken
                .entry((a, l.port))
                .or_insert_with(|| (l.who.clone(), l.host.to_owned()));
        }
    }

    /// `{who} uses port P on {host}, which {prev} already uses[ on {prev host} (why that is the
    /// same socket)]; give it another port`.
    fn clash_message(
        &self,
        l: &Listener<'_>,
        host: &Host,
        addr: &Addr,
        prev: &str,
        prev_host: &str,
    ) -> String {
        let (who, port, written) = (&l.who, l.port, l.host);
        if prev_host.eq_ignore_ascii_case(written) {
            return format!(
                "{who} uses port {port} on {written}, which {prev} already uses; give it another port"
            );
        }
        let ip = match addr {
            Addr::Ip(ip) => ip.to_string(),
            Addr::Name(n) => n.clone(),
        };
        let mut why = Vec::new();
        if host.wildcard {
            why.push(format!("{written} listens on every address of its node"));
        }
        for h in [written, prev_host] {
            if self.hosts.get(h).is_some_and(|x| x.resolved_name) {
                why.push(format!("{h} resolves to {ip}"));
            }
        }
        let why = if why.is_empty() {
            String::new()
        } else {
            format!(" ({}: the same socket)", why.join(", "))
        };
        format!(
            "{who} uses port {port} on {written}, which {prev} already uses on {prev_host}{why}; give it another port"
        )
    }
}

/// Where a router entry's ports were written.
struct RouterSpans {
    item: String,
    port: Sp,
    mesh_port: Sp,
}

/// Step: port collisions between everything that listens, on one machine or on addresses that
/// resolve to one machine.
fn check_port_collisions(
    ctx: &mut Ctx<'_>,
    t: &Topology,
    spans: &ListenSpans,
    routers: &[RouterSpans],
) {
    let written = t
        .nodes
        .iter()
        .flat_map(|n| [n.address.as_str(), n.data_address.as_str()])
        .chain(t.routers.iter().map(|r| r.listen_address.as_str()));
    let mut claims = PortClaims {
        hosts: hosts::resolve_all(written),
        taken: HashMap::new(),
    };
    for (ni, node) in t.nodes.iter().enumerate() {
        let label = format!("node \"{}\"", node.name);
        claims.claim(
            ctx,
            Listener {
                who: format!("{label} control_port"),
                item: &label,
                host: &node.address,
                also: &[],
                port: node.control_port,
                span: spans.control_port.get(ni).cloned().flatten(),
            },
        );
        for rank in node.device_ranks() {
            let d = &t.devices[rank.index()];
            let item = format!("{label} device \"{}\"", d.name);
            claims.claim(
                ctx,
                Listener {
                    who: format!("device \"{}\" data port", d.id),
                    item: &item,
                    host: &node.data_address,
                    also: &[],
                    port: d.data_port,
                    span: spans.data_port.get(rank.index()).cloned().flatten(),
                },
            );
        }
    }
    claim_router_ports(ctx, t, routers, &mut claims);
}

/// The routers' frontend ports and mesh ports. A router's mesh listener on its node's
/// `control_port` is that node's control listener (already claimed); a second router on the
/// node needs its own `mesh_port`.
fn claim_router_ports(
    ctx: &mut Ctx<'_>,
    t: &Topology,
    routers: &[RouterSpans],
    claims: &mut PortClaims,
) {
    let mut control_used: HashMap<usize, &str> = HashMap::new();
    for (r, sp) in t.routers.iter().zip(routers) {
        let node = &t.nodes[r.node];
        let who = if t.routers.len() == 1 {
            "the router port".to_owned()
        } else {
            format!("the {} port", sp.item)
        };
        claims.claim(
            ctx,
            Listener {
                who,
                item: &sp.item,
                host: &r.listen_address,
                also: &[node.address.as_str(), node.data_address.as_str()],
                port: r.port,
                span: sp.port.clone(),
            },
        );
        if r.mesh_port != node.control_port {
            claims.claim(
                ctx,
                Listener {
                    who: format!("the {} mesh_port", sp.item),
                    item: &sp.item,
                    host: &node.address,
                    also: &[],
                    port: r.mesh_port,
                    span: sp.mesh_port.clone(),
                },
            );
        } else if let Some(first) = control_used.insert(r.node, &sp.item) {
            ctx.at(
                sp.mesh_port.clone(),
                &sp.item,
                format!(
                    "{first} already listens for workers on node \"{}\"'s control_port {}; \
                     give this router its own `mesh_port`",
                    node.name, node.control_port
                ),
            );
        }
    }
}

/// Step: the optional `[measured]` numbers per tier.
fn validate_measured(ctx: &mut Ctx<'_>, m: &RawMeasured) -> MeasuredTiers {
    MeasuredTiers {
        intra_node: validate_tier(ctx, &m.intra_node, "intra_node"),
        inter_node: validate_tier(ctx, &m.inter_node, "inter_node"),
    }
}

/// One `[measured]` tier, when given.
fn validate_tier(ctx: &mut Ctx<'_>, tier: &Field<RawTier>, key: &str) -> Option<TierMeasure> {
    let t = tier.as_ref()?;
    let item = format!("[measured] {key}");
    let tr = t.get_ref();
    let bw = check(ctx, &tr.bandwidth_gb_s, &item, positive("bandwidth_gb_s"));
    let lat = check(ctx, &tr.latency_us, &item, non_negative("latency_us"));
    Some(TierMeasure {
        bandwidth_gb_s: bw.get(),
        latency_us: lat.get(),
    })
}

mod hosts;
#[cfg(test)]
mod tests;
