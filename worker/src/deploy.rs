//! One deployment's shared facts: topology, model, placement, ranks, addresses, wire settings.
//!
//! Why this exists: the router and every worker must agree on the cluster name, the rank of
//! each device, where the router listens, the frame size limit and the weights' seed, or they
//! will refuse each other (or worse, disagree silently). Both sides build them here from the
//! same three files, so there is one mapping:
//!
//! * mesh ranks `0..R` are the topology's routers (`[router]`, or one per `[[router]]` table;
//!   one router on the first node when the file has none); the device with topology rank `d`
//!   is mesh rank `R + d`. The mesh rank is internal: every message and log line names a
//!   device by its id and its topology rank ([`Deployment::device_label`]), as
//!   `expertmesh validate` does;
//! * every worker dials every router (router `i`'s mesh listener is its `mesh_port`, by
//!   default its node's `control_port`; frontends connect to its `port`); routers never dial,
//!   and never talk to each other: each has its own gates, shared experts and batches, and
//!   the workers serve them all (fairly, see `process`);
//! * per-node dedup: a router sends a node other than its own one dispatch per micro-batch,
//!   to a leader device of that node, which fans it out (`fanout`); so the devices of a node
//!   that some router is not on dial their lower-ranked node peers over shared memory;
//! * expert weights come from [`crate::weights`]: a converted weights folder (`--weights W`,
//!   whose manifest also names the model and the placement), or synthetic from the seed.

use crate::weights::WeightsError;
use expertmesh_quant::format::QuantSpec;
use expertmesh_router::core::{LayerSetup, SharedSite};
use expertmesh_router::plan::{LayerOwners, Replicas};
use expertmesh_shard::manifest::{Manifest, ManifestError};
use expertmesh_topology::FileError;
use expertmesh_topology::ResolveError;
use expertmesh_topology::model::ModelSpec;
use expertmesh_topology::placement::{Placement, SharedLocation};
use expertmesh_topology::topology::{DeviceRank, Topology};
use expertmesh_transport::codec::{CodecConfig, FINGERPRINT_BYTES};
use expertmesh_transport::crypto::Credentials;
use expertmesh_transport::mesh::{LinkKind, MeshConfig, PeerAddress};
use sha2::{Digest, Sha256};
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// Largest frame on the worker mesh (dispatch payloads and per-slot results). A Kimi-sized
/// micro-batch of 32 tokens returns 32 × 9 slots × 7168 × 4 B = 8.3 MB of per-slot rows.
pub const MAX_FRAME_BYTES: usize = 16 << 20;

/// Bytes of each shared-memory ring (one per direction per worker): two maximum frames, so
/// the credit window (the same two frames) always fits.
pub const SHM_RING_BYTES: usize = 2 * MAX_FRAME_BYTES + 256;

/// Why a deployment could not be loaded, or a device, router or endpoint of it looked up.
///
/// Every message includes its cause (the lower error's own message, which names the file), and
/// no variant exposes that cause as [`std::error::Error::source`]: the binary prints errors
/// with their chain (`{:#}`), which would otherwise say it twice. The lower errors stay typed
/// in their variants for callers that match on them.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DeployError {
    /// The topology, placement or model file could not be read or is invalid.
    #[error("{0}")]
    File(FileError),
    /// The model is neither a preset nor a readable, valid model file.
    #[error("{0}")]
    Model(ResolveError),
    /// The converted weights folder's manifest could not be read or is invalid.
    #[error("{0}")]
    Manifest(ManifestError),
    /// The weights folder was converted for another cluster than the topology.
    #[error(
        "{} was converted for cluster {converted_for:?} but the topology is {topology:?}; pass \
         that topology, or convert again with this one (`expertmesh convert --topology ...`)",
        weights.display()
    )]
    OtherCluster {
        /// The weights folder.
        weights: PathBuf,
        /// The cluster its manifest names.
        converted_for: String,
        /// The topology's cluster name.
        topology: String,
    },
    /// The manifest names another model or format than its model file.
    #[error(
        "{}: the manifest says model {manifest_model:?} ({manifest_quant}) but {model_file} says \
         {model:?} ({quant}); the folder was edited: convert again",
        dir.display()
    )]
    ManifestModel {
        /// The weights folder.
        dir: PathBuf,
        /// The model the manifest names.
        manifest_model: String,
        /// The format the manifest names.
        manifest_quant: QuantSpec,
        /// The model file (in the folder).
        model_file: String,
        /// The model the model file names.
        model: String,
        /// The format the model file names.
        quant: QuantSpec,
    },
    /// The manifest's shards are not the topology's devices.
    #[error(
        "{}: the manifest has shards for devices {shards:?} but the topology's devices are \
         {devices:?}; convert again with this topology",
        dir.display()
    )]
    ManifestDevices {
        /// The weights folder.
        dir: PathBuf,
        /// The devices the manifest has shards for, in order.
        shards: Vec<String>,
        /// The topology's devices, in rank order.
        devices: Vec<String>,
    },
    /// A router instance the topology does not declare.
    #[error(
        "router instance {instance} does not exist: topology {cluster} declares {routers} \
         router{} (instances 0..{routers}); add a [[router]] table or pass a smaller --instance",
        if *routers == 1 { "" } else { "s" }
    )]
    NoRouterInstance {
        /// The instance asked for.
        instance: u32,
        /// The topology's cluster name.
        cluster: String,
        /// How many routers it declares.
        routers: u32,
    },
    /// A device that is neither an id nor a rank of the topology.
    #[error("no device {which:?} in topology {cluster}; devices are {}", devices.join(", "))]
    NoDevice {
        /// What was asked for.
        which: String,
        /// The topology's cluster name.
        cluster: String,
        /// Its device ids.
        devices: Vec<String>,
    },
    /// A device rank outside the topology.
    #[error("no device rank {0}")]
    NoDeviceRank(u32),
    /// A node index outside the topology.
    #[error("topology has no node {0}")]
    NoNode(usize),
    /// A router's frontend endpoint was asked of a topology without a router section.
    #[error("topology {cluster} has no [router] section; pass --listen")]
    NoRouterSection {
        /// The topology's cluster name.
        cluster: String,
    },
    /// An endpoint's host name could not be resolved.
    #[error("resolving {endpoint}: {cause}")]
    Resolve {
        /// The endpoint ("host:port").
        endpoint: String,
        /// Why.
        cause: std::io::Error,
    },
    /// An endpoint's host name resolves to no address.
    #[error("{endpoint} resolves to no address")]
    NoAddress {
        /// The endpoint ("host:port").
        endpoint: String,
    },
    /// The file named by `EXPERTMESH_SECRET_FILE` could not be read, is empty, or other
    /// users may read it.
    #[error("the shared secret: {0}")]
    Secret(expertmesh_transport::crypto::KeyError),
}

/// A deployment: the validated files plus the wire settings both sides derive from them.
#[derive(Clone, Debug)]
pub struct Deployment {
    /// The cluster.
    pub topology: Topology,
    /// The model.
    pub spec: ModelSpec,
    /// Where every expert lives.
    pub placement: Placement,
    /// Seed of the synthetic weights (unused when `weights` is set).
    pub seed: u64,
    /// The converted weights folder, when serving a real checkpoint.
    pub weights: Option<Arc<ConvertedWeights>>,
    /// This process's credentials for the mesh and its frontends (its own rank's, from
    /// `--credentials`; or the legacy shared secret from `EXPERTMESH_SECRET`). `None`: no
    /// authentication and no encryption.
    pub credentials: Option<Arc<Credentials>>,
    /// How long a mesh peer may stay silent, in its handshake or after it, before its link is
    /// declared dead and redialled ([`DEFAULT_LINK_TIMEOUT`]; `--link-timeout-s` of `router`,
    /// `worker` and `up`). Heartbeats go every [`HEARTBEAT_INTERVAL`] whatever it is.
    pub link_timeout: Duration,
}

/// Default [`Deployment::link_timeout`]: 5 s, ten heartbeats.
pub const DEFAULT_LINK_TIMEOUT: Duration = Duration::from_secs(5);

/// How often every mesh rank sends a heartbeat on an idle link, whatever its link timeout:
/// one interval for all, because a rank judges whether a peer is live (a second process
/// claiming its rank is refused while it is) by having heard it within two of its own.
pub const HEARTBEAT_INTERVAL: Duration = Duration::from_millis(500);

/// Shortest [`Deployment::link_timeout`]: four heartbeats.
pub const MIN_LINK_TIMEOUT: Duration = Duration::from_secs(2);

impl Deployment {
    /// Load and cross-validate the three files.
    pub fn load(
        topology: &Path,
        model: &str,
        placement: &Path,
        seed: u64,
    ) -> Result<Self, DeployError> {
        let topo = Topology::load(topology).map_err(DeployError::File)?;
        let spec = expertmesh_topology::resolve_model(model).map_err(DeployError::Model)?;
        let placement = Placement::load(placement, &topo, &spec).map_err(DeployError::File)?;
        Ok(Self {
            topology: topo,
            spec,
            placement,
            seed,
            weights: None,
            credentials: secret_from_env()?,
            link_timeout: DEFAULT_LINK_TIMEOUT,
        })
    }

    /// Load a deployment of the converted weights folder `weights` on `topology`: the model
    /// and the placement come from its manifest, checked against each other and the topology
    /// (weights converted for another cluster or an edited folder are refused).
    pub fn load_converted(topology: &Path, weights: &Path) -> Result<Self, DeployError> {
        let topo = Topology::load(topology).map_err(DeployError::File)?;
        let manifest = Manifest::load(weights).map_err(DeployError::Manifest)?;
        if manifest.topology != topo.name() {
            return Err(DeployError::OtherCluster {
                weights: weights.to_path_buf(),
                converted_for: manifest.topology.clone(),
                topology: topo.name().to_string(),
            });
        }
        let model_path = weights.join(&manifest.model_file);
        let spec =
            expertmesh_topology::model_file::load_model(&model_path).map_err(DeployError::File)?;
        let placement = Placement::load(&weights.join(&manifest.placement_file), &topo, &spec)
            .map_err(DeployError::File)?;
        check_manifest(&manifest, &topo, &spec, weights)?;
        Ok(Self {
            topology: topo,
            spec,
            placement,
            seed: 0,
            weights: Some(Arc::new(ConvertedWeights {
                dir: weights.to_path_buf(),
                manifest,
            })),
            credentials: secret_from_env()?,
            link_timeout: DEFAULT_LINK_TIMEOUT,
        })
    }

    /// Number of routers (mesh ranks `0..router_count()`); at least one.
    pub fn router_count(&self) -> u32 {
        (self.topology.routers().len() as u32).max(1)
    }

    /// Number of mesh ranks (routers + one per device).
    pub fn world_size(&self) -> u32 {
        self.topology.devices().len() as u32 + self.router_count()
    }

    /// Mesh rank of a device.
    pub fn mesh_rank(&self, d: DeviceRank) -> u32 {
        d.0 + self.router_count()
    }

    /// Device of a mesh rank (None for a router).
    pub fn device_of(&self, rank: u32) -> Option<DeviceRank> {
        rank.checked_sub(self.router_count()).map(DeviceRank)
    }

    /// Checks a router instance number against the topology.
    pub fn check_router_instance(&self, instance: u32) -> Result<(), DeployError> {
        if instance >= self.router_count() {
            return Err(DeployError::NoRouterInstance {
                instance,
                cluster: self.topology.name().to_string(),
                routers: self.router_count(),
            });
        }
        Ok(())
    }

    /// Resolve a device given as an id ("node/dev") or a rank number.
    pub fn device(&self, which: &str) -> Result<DeviceRank, DeployError> {
        if let Some(d) = self.topology.device_by_id(which) {
            return Ok(d.rank());
        }
        if let Ok(n) = which.parse::<u32>()
            && (n as usize) < self.topology.devices().len()
        {
            return Ok(DeviceRank(n));
        }
        Err(DeployError::NoDevice {
            which: which.to_string(),
            cluster: self.topology.name().to_string(),
            devices: self
                .topology
                .devices()
                .iter()
                .map(|d| d.id().to_string())
                .collect(),
        })
    }

    /// A device for messages and logs: its id and its topology rank, "local/cpu0 (rank 0)".
    pub fn device_label(&self, d: DeviceRank) -> String {
        match self.topology.device(d) {
            Some(dev) => format!("{} (rank {})", dev.id(), d.0),
            None => format!("device rank {}", d.0),
        }
    }

    /// Names of mesh ranks for messages ("router" or "router 1", "node/device").
    pub fn rank_names(&self) -> Vec<String> {
        let r = self.router_count();
        (0..r)
            .map(|i| {
                if r == 1 {
                    "router".to_string()
                } else {
                    format!("router {i}")
                }
            })
            .chain(self.topology.devices().iter().map(|d| d.id().to_string()))
            .collect()
    }

    /// Router `instance`'s mesh endpoint from the topology: its node's address and its
    /// `mesh_port` (the first node's control port when the file has no router section).
    pub fn router_mesh_endpoint(&self, instance: u32) -> Result<SocketAddr, DeployError> {
        self.check_router_instance(instance)?;
        let idx = self.router_node(instance);
        let port = self
            .topology
            .routers()
            .get(instance as usize)
            .map(|r| r.mesh_port());
        let node = self
            .topology
            .nodes()
            .get(idx)
            .ok_or(DeployError::NoNode(idx))?;
        let port = port.unwrap_or(node.control_port());
        resolve(&format!("{}:{}", node.address(), port))
    }

    /// Every router's mesh endpoint, by instance.
    pub fn router_mesh_endpoints(&self) -> Result<Vec<SocketAddr>, DeployError> {
        (0..self.router_count())
            .map(|i| self.router_mesh_endpoint(i))
            .collect()
    }

    /// Where frontends of router `instance` connect, from the topology's router section.
    pub fn router_frontend_endpoint(&self, instance: u32) -> Result<SocketAddr, DeployError> {
        self.check_router_instance(instance)?;
        match self.topology.routers().get(instance as usize) {
            Some(r) => resolve(&r.listen_endpoint()),
            None => Err(DeployError::NoRouterSection {
                cluster: self.topology.name().to_string(),
            }),
        }
    }

    /// A device's worker endpoint from the topology.
    pub fn worker_endpoint(&self, d: DeviceRank) -> Result<SocketAddr, DeployError> {
        let dev = self
            .topology
            .device(d)
            .ok_or(DeployError::NoDeviceRank(d.0))?;
        resolve(&self.topology.data_endpoint(dev))
    }

    /// Whether the devices of `node` fan dispatches out among themselves: the node has two or
    /// more devices and some router runs on another node (that router sends the node one
    /// dispatch per micro-batch).
    pub fn node_fans_out(&self, node: usize) -> bool {
        let devices = self
            .topology
            .devices()
            .iter()
            .filter(|d| d.node_index() == node)
            .count();
        devices >= 2 && (0..self.router_count()).any(|i| self.router_node(i) != node)
    }

    /// The node router `instance` runs on (the first node when the file has no router
    /// section).
    pub fn router_node(&self, instance: u32) -> usize {
        self.topology
            .routers()
            .get(instance as usize)
            .map_or(0, |r| r.node_index())
    }

    /// Mesh ranks of the other devices on device `d`'s node when that node fans out
    /// ([`Deployment::node_fans_out`]); empty otherwise.
    pub fn node_peers(&self, d: DeviceRank) -> Vec<u32> {
        let Some(dev) = self.topology.device(d) else {
            return Vec::new();
        };
        if !self.node_fans_out(dev.node_index()) {
            return Vec::new();
        }
        self.topology
            .devices()
            .iter()
            .filter(|o| o.node_index() == dev.node_index() && o.rank() != d)
            .map(|o| self.mesh_rank(o.rank()))
            .collect()
    }

    /// Mesh settings for `rank`. `routers` are the routers' mesh endpoints by instance (where
    /// workers dial; a router gives its own listen address for its own entry); `devices`
    /// overrides every device's listen address by topology rank (empty: the topology's data
    /// endpoints); `listen` overrides this rank's own listen address (port 0 for an ephemeral
    /// port). A worker dials every router over `link`, and the lower-ranked devices of its
    /// node over shared memory when the node fans out.
    pub fn mesh_config(
        &self,
        rank: u32,
        routers: &[SocketAddr],
        devices: &[SocketAddr],
        listen: SocketAddr,
        link: LinkKind,
    ) -> MeshConfig {
        let world = self.world_size();
        let r_count = self.router_count();
        let node_peers = self
            .device_of(rank)
            .map(|d| self.node_peers(d))
            .unwrap_or_default();
        let peers = (0..world)
            .map(|r| PeerAddress {
                addr: if r == rank {
                    listen
                } else if r < r_count {
                    routers.get(r as usize).copied().unwrap_or(listen)
                } else {
                    self.device_of(r)
                        .and_then(|d| {
                            devices
                                .get(d.0 as usize)
                                .copied()
                                .or_else(|| self.worker_endpoint(d).ok())
                        })
                        .unwrap_or(listen)
                },
                link: if node_peers.contains(&r) {
                    LinkKind::Shm
                } else {
                    link
                },
            })
            .collect();
        let mut cfg = MeshConfig::new(self.topology.name(), rank, peers);
        cfg.dial_ranks = Some(if rank < r_count {
            Vec::new()
        } else {
            (0..r_count)
                .chain(node_peers.iter().copied().filter(|&p| p < rank))
                .collect()
        });
        cfg.protocol.credentials = self.credentials.clone();
        cfg.protocol.codec = CodecConfig {
            max_frame_bytes: MAX_FRAME_BYTES,
            payload_checksum: false,
        };
        cfg.protocol.recv_window_bytes = 2 * MAX_FRAME_BYTES as u64;
        cfg.protocol.idle_timeout = self.link_timeout;
        cfg.protocol.handshake_timeout = self.link_timeout;
        cfg.protocol.heartbeat_interval = HEARTBEAT_INTERVAL;
        cfg.shm.ring_bytes = SHM_RING_BYTES;
        let table = self.fingerprints();
        cfg.protocol.fingerprint = table[rank as usize];
        cfg.protocol.peer_fingerprints = Some(table.into());
        cfg
    }

    /// What every mesh rank serves, by rank, as the fingerprints the handshake checks: SHA-256
    /// over the model (its parsed spec), the weights' identity (the synthetic seed; or the
    /// converted folder's conversion fingerprint and the rank's own file's size and crc32c as
    /// the manifest records them, so no weight file is read) and the rank's part of the
    /// placement (a device: the routed and shared experts it holds in every layer; a router:
    /// its instance and the whole placement, which it plans with). The router and every worker
    /// compute the same table from the same files, and the handshake refuses a rank whose
    /// hello carries another: a worker started with another seed, weights folder, model or
    /// placement is refused at join, with the reason logged on both sides.
    pub fn fingerprints(&self) -> Vec<[u8; FINGERPRINT_BYTES]> {
        let mut base = Sha256::new();
        base.update(b"expertmesh fingerprint v1\0");
        base.update(serde_json::to_vec(&self.spec).unwrap_or_default());
        match &self.weights {
            None => {
                base.update(b"synthetic\0");
                base.update(self.seed.to_le_bytes());
            }
            Some(w) => {
                base.update(b"converted\0");
                base.update(w.manifest.fingerprint.as_bytes());
            }
        }
        let layers = self.spec.moe_layer_ids();
        (0..self.world_size())
            .map(|rank| {
                let mut h = base.clone();
                match self.device_of(rank) {
                    None => {
                        h.update(b"\0router\0");
                        h.update(rank.to_le_bytes());
                        if let Some(w) = &self.weights {
                            let r = &w.manifest.router;
                            h.update(r.bytes.to_le_bytes());
                            h.update(r.crc32c.to_le_bytes());
                        }
                        for &l in &layers {
                            self.hash_layer_placement(&mut h, l);
                        }
                    }
                    Some(d) => {
                        h.update(b"\0device\0");
                        h.update(d.0.to_le_bytes());
                        if let Some(s) = self
                            .weights
                            .as_ref()
                            .and_then(|w| w.manifest.shards.get(d.0 as usize))
                        {
                            h.update(s.bytes.to_le_bytes());
                            h.update(s.crc32c.to_le_bytes());
                        }
                        for &l in &layers {
                            let experts = self.placement.experts_on(d, l);
                            let shared_here = matches!(
                                self.placement.shared_location(l),
                                Some(SharedLocation::Device(x)) if x == d
                            );
                            h.update(l.to_le_bytes());
                            h.update((experts.len() as u32).to_le_bytes());
                            experts.iter().for_each(|e| h.update(e.to_le_bytes()));
                            h.update([u8::from(shared_here)]);
                        }
                    }
                }
                h.finalize().into()
            })
            .collect()
    }

    /// Feeds layer `l`'s whole placement (every expert's owners, where its shared experts
    /// run) to `h`.
    fn hash_layer_placement(&self, h: &mut Sha256, l: u32) {
        h.update(l.to_le_bytes());
        for e in 0..self.spec.routed_experts {
            let owners = self.placement.owners(l, e);
            h.update((owners.len() as u32).to_le_bytes());
            owners.iter().for_each(|d| h.update(d.0.to_le_bytes()));
        }
        let shared = match self.placement.shared_location(l) {
            Some(SharedLocation::Device(d)) => d.0,
            _ => u32::MAX,
        };
        h.update(shared.to_le_bytes());
    }

    /// The router's view of every MoE layer: gate, owners as mesh ranks, shared site. Gates
    /// come from the router file of converted weights (synthetic from the seed otherwise).
    pub fn layer_setups(&self) -> Result<Vec<LayerSetup>, WeightsError> {
        let e = self.spec.routed_experts;
        let mut gates = crate::weights::Gates::open(self)?;
        self.spec
            .moe_layer_ids()
            .into_iter()
            .map(|layer| {
                let owners = (0..e)
                    .map(|x| {
                        self.placement
                            .owners(layer, x)
                            .iter()
                            .map(|&d| self.mesh_rank(d))
                            .collect()
                    })
                    .collect();
                let shared = if self.spec.shared_experts == 0 {
                    SharedSite::None
                } else {
                    match self.placement.shared_location(layer) {
                        Some(SharedLocation::Device(d)) => SharedSite::Rank(self.mesh_rank(d)),
                        _ => SharedSite::Router,
                    }
                };
                Ok(LayerSetup {
                    layer,
                    gate: gates.layer(self, layer)?,
                    owners: LayerOwners { owners },
                    shared,
                })
            })
            .collect()
    }

    /// Replica-choice state of router `instance`: every worker alive, no router a
    /// destination, locality from that router's node.
    pub fn replicas(&self, instance: u32) -> Replicas {
        let world = self.world_size() as usize;
        let r_count = self.router_count() as usize;
        let mut r = Replicas::new(world);
        for i in 0..r_count {
            r.alive[i] = false;
            r.node[i] = self.router_node(i as u32) as u32;
        }
        for (i, d) in self.topology.devices().iter().enumerate() {
            r.node[r_count + i] = d.node_index() as u32;
        }
        r.local_node = Some(r.node.get(instance as usize).copied().unwrap_or(0));
        r.node_dedup = true;
        r
    }

    /// Whether the shared experts are served dense at the checkpoint's precision (converted
    /// weights that kept them unquantized); the router runs them.
    pub fn shared_dense(&self) -> bool {
        self.weights
            .as_ref()
            .is_some_and(|w| w.manifest.shared_dense)
    }

    /// Whether any layer runs its shared experts on a device (a worker gets them as extra
    /// slots of its parts).
    pub fn shared_on_a_device(&self) -> bool {
        self.spec.shared_experts > 0
            && self.spec.moe_layer_ids().iter().any(|&l| {
                matches!(
                    self.placement.shared_location(l),
                    Some(SharedLocation::Device(_))
                )
            })
    }

    /// Whether any layer runs its shared experts on the router.
    pub fn shared_on_router(&self) -> bool {
        self.spec.shared_experts > 0
            && self.spec.moe_layer_ids().iter().any(|&l| {
                !matches!(
                    self.placement.shared_location(l),
                    Some(SharedLocation::Device(_))
                )
            })
    }
}

/// The manifest's file name within a converted weights folder.
pub const MANIFEST_FILE: &str = expertmesh_shard::manifest::MANIFEST_FILE;

/// A converted weights folder and its manifest.
#[derive(Clone, Debug)]
pub struct ConvertedWeights {
    /// The folder.
    pub dir: PathBuf,
    /// Its manifest.
    pub manifest: Manifest,
}

impl ConvertedWeights {
    /// Path of a file named in the manifest.
    pub fn path(&self, file: &str) -> PathBuf {
        self.dir.join(file)
    }
}

/// The manifest agrees with the topology and the model it names.
fn check_manifest(
    m: &Manifest,
    topo: &Topology,
    spec: &ModelSpec,
    dir: &Path,
) -> Result<(), DeployError> {
    // The cluster name was checked before the placement was read (its message is clearer).
    if m.model != spec.name || m.quant != spec.quant {
        return Err(DeployError::ManifestModel {
            dir: dir.to_path_buf(),
            manifest_model: m.model.clone(),
            manifest_quant: m.quant,
            model_file: m.model_file.clone(),
            model: spec.name.clone(),
            quant: spec.quant,
        });
    }
    let ids: Vec<String> = topo.devices().iter().map(|x| x.id().to_string()).collect();
    let shard_ids: Vec<String> = m.shards.iter().map(|s| s.device.clone()).collect();
    if ids != shard_ids {
        return Err(DeployError::ManifestDevices {
            dir: dir.to_path_buf(),
            shards: shard_ids,
            devices: ids,
        });
    }
    Ok(())
}

/// The legacy shared secret from `EXPERTMESH_SECRET` or the file named by
/// `EXPERTMESH_SECRET_FILE`, as credentials (every holder can act as any rank; links are
/// still encrypted). Prefer per-process credentials (`expertmesh keys issue`).
pub fn secret_from_env() -> Result<Option<Arc<Credentials>>, DeployError> {
    let secret =
        expertmesh_transport::crypto::legacy_secret_from_env().map_err(DeployError::Secret)?;
    Ok(secret.map(|s| Arc::new(Credentials::shared_secret(&s))))
}

fn resolve(endpoint: &str) -> Result<SocketAddr, DeployError> {
    endpoint
        .to_socket_addrs()
        .map_err(|cause| DeployError::Resolve {
            endpoint: endpoint.to_string(),
            cause,
        })?
        .next()
        .ok_or_else(|| DeployError::NoAddress {
            endpoint: endpoint.to_string(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The messages built from several fields read as they did when they were formatted in
    /// place (the binary's users and tests see them).
    #[test]
    fn messages_read_as_before() {
        let e = DeployError::NoRouterInstance {
            instance: 2,
            cluster: "lab".into(),
            routers: 1,
        };
        assert_eq!(
            e.to_string(),
            "router instance 2 does not exist: topology lab declares 1 router (instances \
             0..1); add a [[router]] table or pass a smaller --instance"
        );
        let e = DeployError::OtherCluster {
            weights: "w".into(),
            converted_for: "a".into(),
            topology: "b".into(),
        };
        assert_eq!(
            e.to_string(),
            "w was converted for cluster \"a\" but the topology is \"b\"; pass that topology, \
             or convert again with this one (`expertmesh convert --topology ...`)"
        );
        let e = DeployError::NoDevice {
            which: "x".into(),
            cluster: "lab".into(),
            devices: vec!["n/a".into(), "n/b".into()],
        };
        assert_eq!(
            e.to_string(),
            "no device \"x\" in topology lab; devices are n/a, n/b"
        );
        let e = crate::process::WorkerError::RouterCount {
            given: 1,
            cluster: "lab".into(),
            routers: 2,
        };
        assert_eq!(
            e.to_string(),
            "1 router address was given but topology lab declares 2 routers; pass one --router \
             per router, in the topology's order"
        );
    }

    /// The link timeout reaches every rank's mesh protocol (idle and handshake timeouts);
    /// heartbeats keep one interval, four of them within the shortest timeout.
    #[test]
    fn the_link_timeout_sets_idle_handshake_and_heartbeats() {
        let ex = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples");
        let mut dep = Deployment::load(
            &ex.join("single-host.toml"),
            "demo-small",
            &ex.join("single-host-demo-small.placement.toml"),
            42,
        )
        .unwrap();
        assert_eq!(dep.link_timeout, DEFAULT_LINK_TIMEOUT);
        let routers = dep.router_mesh_endpoints().unwrap();
        let listen: SocketAddr = "127.0.0.1:0".parse().unwrap();
        for secs in [5.0, 60.0, 2.0] {
            dep.link_timeout = Duration::from_secs_f64(secs);
            for rank in 0..dep.world_size() {
                let cfg = dep.mesh_config(rank, &routers, &[], listen, LinkKind::Tcp);
                let p = &cfg.protocol;
                assert_eq!(p.idle_timeout, dep.link_timeout, "rank {rank}");
                assert_eq!(p.handshake_timeout, dep.link_timeout, "rank {rank}");
                assert_eq!(p.heartbeat_interval, HEARTBEAT_INTERVAL);
                p.validate().unwrap();
            }
        }
        assert!(MIN_LINK_TIMEOUT >= HEARTBEAT_INTERVAL * 4);
    }

    /// No variant exposes its cause as a source: the message already says it, and the
    /// binary's `{:#}` would say it twice.
    #[test]
    fn causes_are_in_the_message_only() {
        use std::error::Error;
        let error = std::io::Error::new(std::io::ErrorKind::NotFound, "gone");
        let e = DeployError::Secret(expertmesh_transport::crypto::KeyError::Io {
            path: "s".into(),
            error,
        });
        assert_eq!(e.to_string(), "the shared secret: s: gone");
        assert!(e.source().is_none());
    }
}
