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

use crate::diag::{Ctx, Field, FileError, RawBytes, Schema, fields_of, nearest, span_of, split};
use crate::units::format_bytes;
use serde::Deserialize;
use std::collections::{BTreeMap, HashMap};
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

/// Where the router service runs.
#[derive(Clone, Debug, PartialEq)]
pub struct RouterSpec {
    node: usize,
    listen_address: String,
    port: u16,
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
}

/// A validated cluster topology.
#[derive(Clone, Debug, PartialEq)]
pub struct Topology {
    name: String,
    description: String,
    nodes: Vec<Node>,
    devices: Vec<Device>,
    router: Option<RouterSpec>,
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
    /// The router section, when given.
    pub fn router(&self) -> Option<&RouterSpec> {
        self.router.as_ref()
    }
    /// Measured per-tier numbers.
    pub fn measured(&self) -> MeasuredTiers {
        self.measured
    }
    /// Sum of all devices' expert memory budgets.
    pub fn total_expert_memory(&self) -> u64 {
        self.devices.iter().map(|d| d.expert_memory).sum()
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
    router: Field<RawRouter>,
    measured: Option<RawMeasured>,
    device_types: Option<BTreeMap<String, Spanned<RawDeviceType>>>,
    nodes: Field<Vec<Spanned<RawNode>>>,
}

#[derive(Deserialize)]
struct RawRouter {
    node: Field<String>,
    listen_address: Field<String>,
    port: Field<i64>,
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

fn schema() -> Schema {
    Schema::new("", fields_of::<RawTopology>(), None)
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
    memory_total: Val<u64>,
    expert_memory: Val<u64>,
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
            b.bytes().map_err(|e| format!("{key}: {e}")).and_then(|v| {
                if v == 0 {
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
        threads: check(ctx, threads, item, |v| {
            int_in("threads", 1, 4096)(v).map(|v| v as u32)
        }),
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

fn validate(ctx: &mut Ctx<'_>, raw: &RawTopology) -> Option<Topology> {
    match split(&raw.format) {
        (None, _) => ctx.at(
            None,
            "top level",
            "missing `format`; add `format = 1` at the top of the file",
        ),
        (Some(TOPOLOGY_FORMAT), _) => {}
        (Some(v), span) => ctx.at(
            span,
            "top level",
            format!("unsupported format {v}; this build reads topology format {TOPOLOGY_FORMAT}"),
        ),
    }
    let name = check(ctx, &raw.name, "top level", valid_name("cluster"));
    if name.is_absent() {
        ctx.at(
            None,
            "top level",
            "missing `name`; add the cluster name, e.g. `name = \"my-cluster\"`",
        );
    }
    let description = raw
        .description
        .as_ref()
        .map(|d| d.get_ref().clone())
        .unwrap_or_default();

    // Device types.
    let mut types: HashMap<String, DeviceFields> = HashMap::new();
    let mut type_spans: HashMap<String, Range<usize>> = HashMap::new();
    // (type, key) → what the key is, and the devices that lack it.
    let mut type_missing: BTreeMap<(String, &'static str), (&'static str, Vec<String>)> =
        BTreeMap::new();
    for (tname, t) in raw.device_types.iter().flatten() {
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
        types.insert(tname.clone(), fields);
        type_spans.insert(tname.clone(), t.span());
    }

    let raw_nodes: &[Spanned<RawNode>] = raw.nodes.as_ref().map_or(&[], |n| n.get_ref());
    if raw_nodes.is_empty() {
        ctx.at(
            span_of(&raw.nodes),
            "top level",
            "no nodes; add at least one [[nodes]] table with its devices and NICs",
        );
    }

    let mut nodes = Vec::new();
    let mut devices = Vec::new();
    let mut node_names: HashMap<String, usize> = HashMap::new();
    for (ni, rn) in raw_nodes.iter().enumerate() {
        let nspan = Some(rn.span());
        let r = rn.get_ref();
        let label = match r.name.as_ref() {
            Some(n) => format!("node \"{}\"", n.get_ref()),
            None => format!("node #{}", ni + 1),
        };
        let nname = check(ctx, &r.name, &label, valid_name("node"));
        if nname.is_absent() {
            ctx.at(
                nspan.clone(),
                &label,
                "missing `name`; give the node a unique name",
            );
        }
        if let Some(n) = nname.get()
            && let Some(prev) = node_names.insert(n.clone(), ni)
        {
            ctx.at(
                nname.span(),
                &label,
                format!(
                    "node name \"{n}\" is already used by node #{}; node names must be unique",
                    prev + 1
                ),
            );
        }
        let address = check(ctx, &r.address, &label, valid_host("address"));
        if address.is_absent() {
            ctx.at(
                nspan.clone(),
                &label,
                "missing `address`; give the node's IP address or hostname",
            );
        }
        let data_address = check(ctx, &r.data_address, &label, valid_host("data_address"));
        let control_port = check(ctx, &r.control_port, &label, |v| {
            int_in("control_port", 1, 65535)(v).map(|v| v as u16)
        });
        if control_port.is_absent() {
            ctx.at(
                nspan.clone(),
                &label,
                "missing `control_port`; give the port for control connections (1-65535)",
            );
        }
        let data_port_base = check(ctx, &r.data_port, &label, |v| {
            int_in("data_port", 1, 65535)(v).map(|v| v as u16)
        });

        // NICs.
        let mut nics = Vec::new();
        let mut nic_names: Vec<String> = Vec::new();
        let raw_nics: &[Spanned<RawNic>] = r.nics.as_ref().map_or(&[], |n| n.get_ref());
        if raw_nics.is_empty() {
            ctx.at(
                span_of(&r.nics).or(nspan.clone()),
                &label,
                "no NICs; add `nics = [{ name = \"eth0\", kind = \"tcp\", speed_gbit_s = 100, mtu = 1500 }]`",
            );
        }
        for (ci, rc) in raw_nics.iter().enumerate() {
            let c = rc.get_ref();
            let cspan = Some(rc.span());
            let clabel = match c.name.as_ref() {
                Some(n) => format!("{label} NIC \"{}\"", n.get_ref()),
                None => format!("{label} NIC #{}", ci + 1),
            };
            let cname = check(ctx, &c.name, &clabel, valid_name("NIC"));
            if cname.is_absent() {
                ctx.at(
                    cspan.clone(),
                    &clabel,
                    "missing `name`; give the interface or RDMA device name",
                );
            }
            if let Some(n) = cname.get() {
                if nic_names.contains(&n) {
                    ctx.at(
                        cname.span(),
                        &clabel,
                        format!(
                            "NIC name \"{n}\" appears twice on this node; names must be unique"
                        ),
                    );
                }
                nic_names.push(n);
            }
            let kind = check(ctx, &c.kind, &clabel, one_of("kind", NIC_KINDS));
            if kind.is_absent() {
                ctx.at(
                    cspan.clone(),
                    &clabel,
                    "missing `kind`; use kind = \"roce\" or kind = \"tcp\"",
                );
            }
            let speed = check(ctx, &c.speed_gbit_s, &clabel, positive("speed_gbit_s"));
            if speed.is_absent() {
                ctx.at(
                    cspan.clone(),
                    &clabel,
                    "missing `speed_gbit_s`; give the line rate in Gbit/s (e.g. 400)",
                );
            }
            let (mtu_lo, mtu_hi) = match kind.get() {
                Some(NicKind::Roce) => (1280, 9216),
                _ => (68, 65536),
            };
            let mtu = check(ctx, &c.mtu, &clabel, |v| {
                if (mtu_lo..=mtu_hi).contains(&v) {
                    Ok(v as u32)
                } else {
                    Err(format!(
                        "mtu = {v} is out of range for a {} NIC; use {mtu_lo} to {mtu_hi} (e.g. 9000 for jumbo frames)",
                        kind.get().map_or("tcp", NicKind::name)
                    ))
                }
            });
            if mtu.is_absent() {
                ctx.at(
                    cspan.clone(),
                    &clabel,
                    "missing `mtu`; give the interface MTU (1500, or 9000 for jumbo frames)",
                );
            }
            let gid_ipv4 = check(ctx, &c.gid_ipv4, &clabel, |s: String| {
                s.parse::<Ipv4Addr>()
                    .map_err(|_| format!("gid_ipv4 \"{s}\" is not an IPv4 address"))
            });
            let gid_index = check(ctx, &c.gid_index, &clabel, |v| {
                int_in("gid_index", 0, 255)(v).map(|v| v as u32)
            });
            let traffic_class = check(ctx, &c.traffic_class, &clabel, |v| {
                int_in("traffic_class", 0, 255)(v).map(|v| v as u8)
            });
            let mut gid = GidSelection::Auto;
            if kind.get() == Some(NicKind::Tcp) {
                for (f, key) in [
                    (span_of(&c.gid_ipv4), "gid_ipv4"),
                    (span_of(&c.gid_index), "gid_index"),
                ] {
                    if f.is_some() {
                        ctx.at(
                            f,
                            &clabel,
                            format!(
                                "{key} only applies to kind = \"roce\"; remove it or change kind"
                            ),
                        );
                    }
                }
            } else {
                match (gid_ipv4.get(), gid_index.get()) {
                    (Some(_), Some(_)) => ctx.at(
                        gid_index.span(),
                        &clabel,
                        "set either gid_ipv4 or gid_index, not both (gid_ipv4 is robust against GID index shifts)",
                    ),
                    (Some(ip), None) => gid = GidSelection::Ipv4(ip),
                    (None, Some(i)) => gid = GidSelection::Index(i),
                    (None, None) => {}
                }
            }
            if let (Some(kind), Some(speed), Some(mtu)) = (kind.get(), speed.get(), mtu.get()) {
                nics.push(Nic {
                    name: cname.get().unwrap_or_default(),
                    kind,
                    speed_gbit_s: speed,
                    mtu,
                    gid,
                    traffic_class: traffic_class.get(),
                });
            }
        }

        // Devices.
        let raw_devs: &[Spanned<RawDevice>] = r.devices.as_ref().map_or(&[], |d| d.get_ref());
        if raw_devs.is_empty() {
            ctx.at(
                span_of(&r.devices).or(nspan.clone()),
                &label,
                "no devices; add `devices = [...]` with at least one gpu or cpu device",
            );
        }
        let first_rank = devices.len() as u32;
        let mut dev_names: Vec<String> = Vec::new();
        let mut gpu_indices: HashMap<u32, String> = HashMap::new();
        let mut gpu_count = 0u32;
        for (di, rd) in raw_devs.iter().enumerate() {
            let d = rd.get_ref();
            let dspan = Some(rd.span());
            let dlabel = match d.name.as_ref() {
                Some(n) => format!("{label} device \"{}\"", n.get_ref()),
                None => format!("{label} device #{}", di + 1),
            };
            let dname = check(ctx, &d.name, &dlabel, valid_name("device"));
            if dname.is_absent() {
                ctx.at(
                    dspan.clone(),
                    &dlabel,
                    "missing `name`; give the device a name unique on its node (e.g. \"gpu0\")",
                );
            }
            if let Some(n) = dname.get() {
                if dev_names.contains(&n) {
                    ctx.at(
                        dname.span(),
                        &dlabel,
                        format!(
                            "device name \"{n}\" appears twice on this node; names must be unique"
                        ),
                    );
                }
                dev_names.push(n);
            }
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
            let type_name = d.type_name.as_ref().map(|t| t.get_ref().clone());
            let merged = match &type_name {
                None => own,
                Some(t) => match types.get(t) {
                    Some(tf) => own.or(tf),
                    None => {
                        let hint = match nearest(t, types.keys().map(String::as_str)) {
                            Some(n) => format!("did you mean \"{n}\"?"),
                            None if types.is_empty() => {
                                "add a [device_types.NAME] table or remove `type`".to_owned()
                            }
                            None => format!(
                                "defined types: {}",
                                types.keys().cloned().collect::<Vec<_>>().join(", ")
                            ),
                        };
                        ctx.at(
                            span_of(&d.type_name),
                            &dlabel,
                            format!("unknown device type \"{t}\"; {hint}"),
                        );
                        // Keys the unknown type would have supplied are not reported as missing.
                        own.or(&DeviceFields::unknown())
                    }
                },
            };
            // A key missing from a device and its (known) type is reported once per type below,
            // not once per device.
            let known_type = type_name.as_ref().filter(|t| types.contains_key(*t));
            let device_id = format!(
                "{}/{}",
                nname.get().unwrap_or_default(),
                dname.get().unwrap_or_default()
            );
            let mut missing = |v: bool, key: &'static str, what: &'static str| {
                if !v {
                    return;
                }
                match known_type {
                    Some(t) => type_missing
                        .entry((t.clone(), key))
                        .or_insert_with(|| (what, Vec::new()))
                        .1
                        .push(device_id.clone()),
                    None => ctx.at(
                        dspan.clone(),
                        &dlabel,
                        format!(
                            "missing `{key}` ({what}); set it on the device (or use a [device_types.NAME] template via `type`)"
                        ),
                    ),
                }
            };
            missing(merged.kind.is_absent(), "kind", "\"gpu\" or \"cpu\"");
            missing(
                merged.arch.is_absent(),
                "arch",
                "e.g. \"gfx942\" or \"cpu\"",
            );
            missing(
                merged.expert_memory.is_absent(),
                "expert_memory",
                "memory budget for experts, e.g. \"176 GB\"",
            );
            missing(
                merged.memory_bandwidth_gb_s.is_absent(),
                "memory_bandwidth_gb_s",
                "memory read bandwidth in GB/s",
            );
            let kind = merged.kind.get();
            if kind == Some(DeviceKind::Gpu) {
                missing(
                    merged.int8_tops.is_absent(),
                    "int8_tops",
                    "peak dense int8 TOPS",
                );
                missing(
                    merged.bf16_tflops.is_absent(),
                    "bf16_tflops",
                    "peak dense bf16 TFLOPS",
                );
            }
            if kind == Some(DeviceKind::Cpu) {
                missing(
                    merged.threads.is_absent(),
                    "threads",
                    "worker thread-pool size for the CPU backend",
                );
            }
            match (kind, merged.arch.get()) {
                (Some(DeviceKind::Gpu), Some(a)) if a == "cpu" => ctx.at(
                    merged.arch.span().or(dspan.clone()),
                    &dlabel,
                    "a gpu device needs a gfx arch (e.g. \"gfx942\"), not \"cpu\"",
                ),
                (Some(DeviceKind::Cpu), Some(a)) if a != "cpu" => ctx.at(
                    merged.arch.span().or(dspan.clone()),
                    &dlabel,
                    format!("a cpu device has arch = \"cpu\", not \"{a}\""),
                ),
                _ => {}
            }
            if kind == Some(DeviceKind::Gpu) && merged.threads.get().is_some() {
                ctx.at(
                    merged.threads.span().or(dspan.clone()),
                    &dlabel,
                    "threads only applies to cpu devices; remove it",
                );
            }
            if let (Some(total), Some(budget)) =
                (merged.memory_total.get(), merged.expert_memory.get())
                && budget > total
            {
                ctx.at(
                    merged.expert_memory.span().or(dspan.clone()),
                    &dlabel,
                    format!(
                        "expert_memory {} exceeds memory_total {}; lower expert_memory",
                        format_bytes(budget),
                        format_bytes(total)
                    ),
                );
            }
            let numa = check(ctx, &d.numa, &dlabel, |v| {
                int_in("numa", 0, 1023)(v).map(|v| v as u32)
            });
            let gpu_index = check(ctx, &d.gpu_index, &dlabel, |v| {
                int_in("gpu_index", 0, 1023)(v).map(|v| v as u32)
            });
            let gpu_index = match kind {
                Some(DeviceKind::Gpu) => {
                    let idx = gpu_index.get().unwrap_or(gpu_count);
                    gpu_count += 1;
                    if let Some(prev) = gpu_indices.insert(idx, dname.get().unwrap_or_default()) {
                        ctx.at(
                            gpu_index.span().or(dspan.clone()),
                            &dlabel,
                            format!(
                                "gpu_index {idx} is already used by device \"{prev}\" on this node; set distinct gpu_index values"
                            ),
                        );
                    }
                    Some(idx)
                }
                _ => {
                    if gpu_index.get().is_some() {
                        ctx.at(
                            gpu_index.span(),
                            &dlabel,
                            "gpu_index only applies to gpu devices; remove it",
                        );
                    }
                    None
                }
            };
            let nic = match split(&d.nic) {
                (Some(n), span) => match nic_names.iter().position(|x| *x == n) {
                    Some(i) => Some(i),
                    None => {
                        let hint = match nearest(&n, nic_names.iter().map(String::as_str)) {
                            Some(s) => format!("did you mean \"{s}\"?"),
                            None => format!("this node's NICs: {}", nic_names.join(", ")),
                        };
                        ctx.at(span, &dlabel, format!("unknown NIC \"{n}\"; {hint}"));
                        None
                    }
                },
                (None, _) if raw_nics.len() == 1 => Some(0),
                (None, _) if raw_nics.is_empty() => None,
                (None, _) => {
                    ctx.at(
                        dspan.clone(),
                        &dlabel,
                        format!(
                            "missing `nic`; this node has {} NICs ({}), say which one this device sends through",
                            raw_nics.len(),
                            nic_names.join(", ")
                        ),
                    );
                    None
                }
            };
            let own_port = check(ctx, &d.data_port, &dlabel, |v| {
                int_in("data_port", 1, 65535)(v).map(|v| v as u16)
            });
            let data_port = match (own_port, &data_port_base) {
                (Val::Ok(p, _), _) => Some(p),
                (Val::Invalid, _) | (Val::Absent, Val::Invalid) => None,
                (Val::Absent, Val::Ok(base, bspan)) => {
                    let p = *base as u32 + di as u32;
                    if p > 65535 {
                        ctx.at(
                            bspan.clone(),
                            &dlabel,
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
                        &dlabel,
                        "no data port; set `data_port` on the node (device i uses data_port + i) or on the device",
                    );
                    None
                }
            };
            let (Some(dn), Some(kind), Some(arch), Some(expert_memory), Some(bw)) = (
                dname.get(),
                kind,
                merged.arch.get(),
                merged.expert_memory.get(),
                merged.memory_bandwidth_gb_s.get(),
            ) else {
                continue;
            };
            let (Some(nic), Some(data_port)) = (nic, data_port) else {
                continue;
            };
            let rank = DeviceRank(devices.len() as u32);
            devices.push(Device {
                id: format!("{}/{dn}", nname.get().unwrap_or_default()),
                name: dn,
                rank,
                node: nodes.len(),
                type_name: type_name.clone(),
                kind,
                arch,
                memory_total: merged.memory_total.get(),
                expert_memory,
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

        // Intra-node link.
        let link_kind = check(ctx, &r.intra_link, &label, one_of("intra_link", LINK_KINDS));
        let link_bw = check(
            ctx,
            &r.intra_bandwidth_gb_s,
            &label,
            positive("intra_bandwidth_gb_s"),
        );
        let link_lat = check(
            ctx,
            &r.intra_latency_us,
            &label,
            non_negative("intra_latency_us"),
        );
        if raw_devs.len() >= 2 {
            if link_kind.is_absent() {
                ctx.at(
                    nspan.clone(),
                    &label,
                    "missing `intra_link` (the node has several devices); use \"xgmi\", \"pcie\" or \"shm\"",
                );
            }
            if link_bw.is_absent() {
                ctx.at(
                    nspan.clone(),
                    &label,
                    "missing `intra_bandwidth_gb_s` (the node has several devices); give the device-to-device bandwidth in GB/s",
                );
            }
        }
        let intra_link = match (link_kind.get(), link_bw.get()) {
            (Some(kind), Some(bw)) => Some(IntraLink {
                kind,
                bandwidth_gb_s: bw,
                latency_us: link_lat.get(),
            }),
            (Some(_), None) if link_bw.is_absent() && raw_devs.len() < 2 => {
                ctx.at(
                    link_kind.span(),
                    &label,
                    "intra_link needs intra_bandwidth_gb_s too",
                );
                None
            }
            _ => None,
        };

        if let (Some(name), Some(address), Some(control_port)) =
            (nname.get(), address.get(), control_port.get())
        {
            let data_address = data_address.get().unwrap_or_else(|| address.clone());
            nodes.push(Node {
                name,
                address,
                data_address,
                control_port,
                intra_link,
                nics,
                device_ranks: first_rank..devices.len() as u32,
            });
        } else {
            // Keep ranks consistent with nodes: drop this node's devices.
            devices.truncate(first_rank as usize);
        }
    }

    for ((tname, key), (what, devices)) in type_missing {
        let n = devices.len();
        let shown = if n <= 4 {
            devices.join(", ")
        } else {
            format!("{}, ... ({n} in all)", devices[..3].join(", "))
        };
        ctx.at(
            type_spans.get(&tname).cloned(),
            format!("device type \"{tname}\""),
            format!(
                "missing `{key}` ({what}), needed by device{} {shown}; set it here or on each device",
                if n == 1 { "" } else { "s" }
            ),
        );
    }

    // Router.
    let mut router = None;
    if let Some(rr) = &raw.router {
        let rspan = Some(rr.span());
        let r = rr.get_ref();
        let item = "[router]";
        let node = match split(&r.node) {
            (None, _) => {
                ctx.at(
                    rspan.clone(),
                    item,
                    "missing `node`; name the node the router runs on",
                );
                None
            }
            (Some(n), span) => match nodes.iter().position(|x| x.name == n) {
                Some(i) => Some(i),
                None => {
                    if !node_names.contains_key(&n) {
                        let hint = match nearest(&n, node_names.keys().map(String::as_str)) {
                            Some(s) => format!("did you mean \"{s}\"?"),
                            None => format!(
                                "nodes: {}",
                                nodes
                                    .iter()
                                    .map(|x| x.name.as_str())
                                    .collect::<Vec<_>>()
                                    .join(", ")
                            ),
                        };
                        ctx.at(span, item, format!("unknown node \"{n}\"; {hint}"));
                    }
                    None
                }
            },
        };
        let listen = check(ctx, &r.listen_address, item, valid_host("listen_address"));
        let port = check(ctx, &r.port, item, |v| {
            int_in("port", 1, 65535)(v).map(|v| v as u16)
        });
        if port.is_absent() {
            ctx.at(
                rspan,
                item,
                "missing `port`; give the port serving frontends connect to",
            );
        }
        if let (Some(node), Some(port)) = (node, port.get()) {
            router = Some(RouterSpec {
                node,
                listen_address: listen.get().unwrap_or_else(|| nodes[node].address.clone()),
                port,
            });
        }
    }

    // Port collisions between everything that listens on one machine.
    let mut used: HashMap<(String, u16), String> = HashMap::new();
    let mut claim = |ctx: &mut Ctx<'_>, host: &str, port: u16, who: String, item: &str| {
        let key = (host.to_ascii_lowercase(), port);
        match used.get(&key) {
            Some(prev) => ctx.report(
                item,
                format!(
                    "{who} uses port {port} on {host}, which {prev} already uses; give it another port"
                ),
            ),
            None => {
                used.insert(key, who);
            }
        }
    };
    for node in &nodes {
        let label = format!("node \"{}\"", node.name);
        claim(
            ctx,
            &node.address,
            node.control_port,
            format!("{label} control_port"),
            &label,
        );
        for rank in node.device_ranks() {
            let d = &devices[rank.index()];
            let item = format!("{label} device \"{}\"", d.name);
            claim(
                ctx,
                &node.address,
                d.data_port,
                format!("device \"{}\" data port", d.id),
                &item,
            );
        }
    }
    if let Some(r) = &router {
        claim(
            ctx,
            &nodes[r.node].address,
            r.port,
            "the router port".to_owned(),
            "[router]",
        );
    }

    // Measured tiers.
    let mut measured = MeasuredTiers::default();
    if let Some(m) = &raw.measured {
        for (tier, slot, key) in [
            (&m.intra_node, &mut measured.intra_node, "intra_node"),
            (&m.inter_node, &mut measured.inter_node, "inter_node"),
        ] {
            if let Some(t) = tier {
                let item = format!("[measured] {key}");
                let tr = t.get_ref();
                let bw = check(ctx, &tr.bandwidth_gb_s, &item, positive("bandwidth_gb_s"));
                let lat = check(ctx, &tr.latency_us, &item, non_negative("latency_us"));
                *slot = Some(TierMeasure {
                    bandwidth_gb_s: bw.get(),
                    latency_us: lat.get(),
                });
            }
        }
    }

    let name = name.get()?;
    Some(Topology {
        name,
        description,
        nodes,
        devices,
        router,
        measured,
    })
}

#[cfg(test)]
mod tests;
