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
//!
//! # Modules
//!
//! `types` (the validated topology, re-exported here), `raw` (what serde reads, and the
//! schema), `values` (checks of single values), `validate` (the whole file, section by
//! section), `device_types` (device keys and `[device_types.X]` templates), `nodes`, `nics`,
//! `devices` and `routers` (each section's checks; `routers` also claims every listening
//! port), `hosts` (host-name resolution).

mod device_types;
mod devices;
mod hosts;
mod nics;
mod nodes;
mod raw;
mod routers;
#[cfg(test)]
mod tests;
mod types;
mod validate;
mod values;

pub(crate) use raw::top_level_keys;
pub use types::{
    Device, DeviceKind, DeviceRank, GidSelection, IntraLink, IntraLinkKind, MeasuredTiers, Nic,
    NicKind, Node, RouterSpec, TOPOLOGY_FORMAT, TierMeasure, Topology, endpoint,
};
pub use values::is_valid_host;

/// Most threads one CPU device's backend may run (a topology's `threads`, and the `--threads`
/// flags that override it): more than any server has cores, few enough that a typo is refused
/// before thousands of threads and their per-thread buffers are made.
pub const MAX_THREADS: u32 = 4096;
