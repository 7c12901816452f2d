//! The validated topology: what the rest of the fabric reads.
//!
//! Why this exists: every other module of `topology` builds these types; callers only ever see them
//! (through the re-exports of [`crate::topology`]), never the raw file structs. Accessors only:
//! the values were checked when the file was read.

use super::raw::{RawTopology, schema};
use super::validate::validate;
use crate::diag::{Ctx, FileError};
use crate::units::{SizeUnit, checked_sum};
use std::fmt;
use std::net::Ipv4Addr;
use std::ops::Range;
use std::path::Path;

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
    pub(super) kind: IntraLinkKind,
    pub(super) bandwidth_gb_s: f64,
    pub(super) latency_us: Option<f64>,
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
    pub(super) bandwidth_gb_s: Option<f64>,
    pub(super) latency_us: Option<f64>,
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
    pub(super) intra_node: Option<TierMeasure>,
    pub(super) inter_node: Option<TierMeasure>,
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
    pub(super) name: String,
    pub(super) kind: NicKind,
    pub(super) speed_gbit_s: f64,
    pub(super) mtu: u32,
    pub(super) gid: GidSelection,
    pub(super) traffic_class: Option<u8>,
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
    pub(super) name: String,
    pub(super) address: String,
    pub(super) data_address: String,
    pub(super) control_port: u16,
    pub(super) intra_link: Option<IntraLink>,
    pub(super) nics: Vec<Nic>,
    pub(super) device_ranks: Range<u32>,
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
    pub(super) id: String,
    pub(super) name: String,
    pub(super) rank: DeviceRank,
    pub(super) node: usize,
    pub(super) type_name: Option<String>,
    pub(super) kind: DeviceKind,
    pub(super) arch: String,
    pub(super) memory_total: Option<u64>,
    pub(super) expert_memory: u64,
    pub(super) expert_memory_unit: SizeUnit,
    pub(super) memory_bandwidth_gb_s: f64,
    pub(super) int8_tops: Option<f64>,
    pub(super) bf16_tflops: Option<f64>,
    pub(super) threads: Option<u32>,
    pub(super) price_usd_per_hour: Option<f64>,
    pub(super) numa: Option<u32>,
    pub(super) nic: usize,
    pub(super) data_port: u16,
    pub(super) gpu_index: Option<u32>,
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
    pub(super) node: usize,
    pub(super) listen_address: String,
    pub(super) port: u16,
    pub(super) mesh_port: u16,
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
    pub(super) name: String,
    pub(super) description: String,
    pub(super) nodes: Vec<Node>,
    pub(super) devices: Vec<Device>,
    pub(super) routers: Vec<RouterSpec>,
    pub(super) measured: MeasuredTiers,
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

/// `host:port`, an IPv6 address bracketed (`[::1]:9400`).
pub fn endpoint(host: &str, port: u16) -> String {
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}
