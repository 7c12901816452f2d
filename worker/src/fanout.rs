//! Per-node fan-out: a node's leader worker takes one dispatch for the whole node and shares
//! it with the node's other devices over shared memory.
//!
//! Why this exists: with several devices per node, a router that sent each device its own
//! copy of a token would cross the network once per device. With per-node dedup
//! (`expertmesh_router::plan`, [`Replicas::node_dedup`](expertmesh_router::plan::Replicas)),
//! the router sends a remote node one dispatch, to the lowest of its planned devices (the
//! leader), holding every pair the node serves. The leader runs the pairs of its own experts
//! and forwards each other pair to a live device of its node that owns the expert
//! (sub-dispatches over the node-local links, token rows gathered with
//! `dtype::gather_rows`, results asked in f32); when every share has answered it assembles
//! one result in the layout and dtype the router asked for and sends it back. The router sees
//! one part answered by one device, as without dedup.
//!
//! Live placement changes: the node's devices tell each other what they serve (their
//! `Holding` announcements), and the homes follow ([`ExpertHomes::set_held`]). A pair this
//! leader finds on no device of its node, or that a peer no longer holds, fails its dispatch
//! with `PeerUnavailable`: the router sends it to the owners directly (its view can be a step
//! ahead of this leader's during a change).
//!
//! Numerics: per-slot rows are copied, so exact mode stays bit-identical (and exact-bf16 rounds
//! each row once, after assembly, as a device would). Pre-combined rows are summed in a fixed
//! order (the leader's share, then the peers' by rank), so a result does not depend on the
//! order in which shares arrive.
//!
//! This module is sans-IO: [`NodeFanout`] takes dispatches, results, peer losses and time and
//! returns frames to send; the worker process moves them (it never waits on a send to a node
//! peer: those are handed to the runtime, so two devices of a node cannot block each other on
//! credit). Bounds: one pending entry per forwarded router dispatch; the routers bound the
//! dispatches they have in flight (`max_inflight_batches`), and an entry whose peers do not
//! answer within the timeout fails with an error frame naming the device. The table's rules
//! (each entry's waiting count, sub-dispatch ids one to one with the peer shares still out)
//! are checked after every input in debug builds.

use crate::deploy::Deployment;
use crate::exec::ExecError;
use bytes::Bytes;
use expertmesh_topology::placement::SharedLocation;
use expertmesh_topology::topology::DeviceRank;
use expertmesh_transport::codec::{
    Body, Dispatch, ErrorCode, ErrorFrame, ExpertResult, OutputLayout,
};
use expertmesh_transport::dtype::{self, OutputDtype};
use expertmesh_transport::mesh::OutFrame;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};

/// Where one expert of one layer is served, seen from one device.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Home {
    /// This device holds it.
    Local,
    /// Devices of this node hold it (mesh ranks, ascending).
    Peers(Vec<u32>),
    /// No device of this node holds it.
    Elsewhere,
}

/// Which experts a device serves itself and which its node peers serve, per layer.
///
/// It starts from the deployment's placement and follows live placement changes: each device
/// of the node tells the others the routed experts it serves whenever that set changes
/// ([`ExpertHomes::set_held`]), as it tells the routers. Between a change at the routers and
/// its announcement here the two views can differ for a moment; a pair that then finds no
/// device here is answered `PeerUnavailable`, which the router sends to its owner directly
/// ([`NodeFanout::start`]). Shared experts on a device (pseudo-ids past the routed ones) do
/// not move and keep their homes.
#[derive(Clone, Debug, Default)]
pub struct ExpertHomes {
    layers: HashMap<u32, Vec<Home>>,
    names: HashMap<u32, String>,
    /// This device's mesh rank.
    me: u32,
    /// Routed experts per layer (the first ids of each layer's homes).
    routed: u32,
    /// The routed experts each device of the node serves (this one included), by mesh rank,
    /// as last announced: the routed part of `layers` follows from them.
    held: BTreeMap<u32, BTreeSet<(u32, u32)>>,
    /// The version of each device's last announcement taken over its current link (an older
    /// one arriving late is ignored).
    versions: BTreeMap<u32, u64>,
}

impl ExpertHomes {
    /// The homes of every expert for device `d` of a deployment.
    pub fn for_device(dep: &Deployment, d: DeviceRank) -> Self {
        let topo = &dep.topology;
        let node = topo.device(d).map(|x| x.node_index());
        let same_node = |o: DeviceRank| topo.device(o).map(|x| x.node_index()) == node;
        let names = topo
            .devices()
            .iter()
            .map(|x| (dep.mesh_rank(x.rank()), dep.device_label(x.rank())))
            .collect();
        let mut held: BTreeMap<u32, BTreeSet<(u32, u32)>> = topo
            .devices()
            .iter()
            .filter(|x| same_node(x.rank()))
            .map(|x| (dep.mesh_rank(x.rank()), BTreeSet::new()))
            .collect();
        for layer in dep.spec.moe_layer_ids() {
            for e in 0..dep.spec.routed_experts {
                for &o in dep.placement.owners(layer, e) {
                    if let Some(set) = held.get_mut(&dep.mesh_rank(o)) {
                        set.insert((layer, e));
                    }
                }
            }
        }
        let mut homes = Self {
            layers: HashMap::new(),
            names,
            me: dep.mesh_rank(d),
            routed: dep.spec.routed_experts,
            held,
            versions: BTreeMap::new(),
        };
        for layer in dep.spec.moe_layer_ids() {
            // Routed experts from the node's sets (as every later announcement updates them).
            let mut layer_homes: Vec<Home> = (0..dep.spec.routed_experts)
                .map(|e| homes.home_from_held(layer, e))
                .collect();
            // Shared experts that live on a device come as pseudo-ids `routed_experts + i`;
            // they do not move.
            let shared = match dep.placement.shared_location(layer) {
                Some(SharedLocation::Device(x)) if x == d => Home::Local,
                Some(SharedLocation::Device(x)) if same_node(x) => {
                    Home::Peers(vec![dep.mesh_rank(x)])
                }
                _ => Home::Elsewhere,
            };
            layer_homes.extend((0..dep.spec.shared_experts).map(|_| shared.clone()));
            homes.layers.insert(layer, layer_homes);
        }
        homes
    }

    /// Device `rank` of this node (this one included) serves the routed `experts` (layer,
    /// expert) as of its placement `version`: the homes of every routed expert follow. An
    /// announcement older than the last one taken from `rank` (announcements to node peers
    /// are sent without waiting, so two can cross), a rank that is not on this node, and
    /// layers or experts the model does not have are ignored.
    pub fn set_held(
        &mut self,
        rank: u32,
        version: u64,
        experts: impl IntoIterator<Item = (u32, u32)>,
    ) {
        let Some(set) = self.held.get_mut(&rank) else {
            return;
        };
        let last = self.versions.entry(rank).or_insert(version);
        if version < *last {
            return;
        }
        *last = version;
        let new: BTreeSet<(u32, u32)> = experts.into_iter().collect();
        // Only the experts this announcement adds or drops change home (a large model has
        // tens of thousands of (layer, expert) pairs; a change moves a few).
        let changed: Vec<(u32, u32)> = set.symmetric_difference(&new).copied().collect();
        *set = new;
        for (layer, e) in changed {
            if e >= self.routed {
                continue;
            }
            let home = self.home_from_held(layer, e);
            if let Some(slot) = self
                .layers
                .get_mut(&layer)
                .and_then(|h| h.get_mut(e as usize))
            {
                *slot = home;
            }
        }
    }

    /// Where routed expert `e` of `layer` is, from what the node's devices announced.
    fn home_from_held(&self, layer: u32, e: u32) -> Home {
        let key = (layer, e);
        if self.held.get(&self.me).is_some_and(|s| s.contains(&key)) {
            return Home::Local;
        }
        // BTreeMap order: ascending ranks.
        let peers: Vec<u32> = self
            .held
            .iter()
            .filter(|&(&r, s)| r != self.me && s.contains(&key))
            .map(|(&r, _)| r)
            .collect();
        if peers.is_empty() {
            Home::Elsewhere
        } else {
            Home::Peers(peers)
        }
    }

    /// The other devices of this node (mesh ranks, ascending).
    pub fn node_peers(&self) -> Vec<u32> {
        self.held
            .keys()
            .copied()
            .filter(|&r| r != self.me)
            .collect()
    }

    /// Device `rank`'s link came up (again): its versions start over (a restarted worker
    /// counts from 0); what it last announced stands until it announces again.
    pub fn new_link(&mut self, rank: u32) {
        self.versions.remove(&rank);
    }

    /// Whether every pair of `d` is for an expert this device holds (the usual case: no
    /// fan-out).
    pub fn all_local(&self, d: &Dispatch) -> bool {
        let Some(homes) = self.layers.get(&d.layer) else {
            return true; // the executor reports the unknown layer
        };
        d.experts
            .iter()
            .all(|&e| homes.get(e as usize) == Some(&Home::Local))
    }

    fn home(&self, layer: u32, expert: u32) -> Option<&Home> {
        self.layers.get(&layer)?.get(expert as usize)
    }

    fn name(&self, rank: u32) -> String {
        self.names
            .get(&rank)
            .cloned()
            .unwrap_or_else(|| format!("mesh rank {rank}"))
    }
}

/// A share of a forwarded dispatch.
#[derive(Debug)]
struct Share {
    /// `None`: this device.
    rank: Option<u32>,
    /// Row of the assembled result each of this share's result rows belongs to.
    targets: Vec<u32>,
    /// The share's f32 rows once answered.
    rows: Option<Vec<f32>>,
}

/// A router dispatch being served by several devices of the node.
#[derive(Debug)]
struct Pending {
    router: u32,
    /// The generation of the router's link the dispatch came on (the answer goes back on it).
    generation: u64,
    batch_id: u64,
    part: u32,
    layer: u32,
    layout: OutputLayout,
    dtype: OutputDtype,
    rows: usize,
    started: Instant,
    shares: Vec<Share>,
    waiting: usize,
}

impl Pending {
    /// The error frame that fails this dispatch at its router.
    fn error(&self, code: ErrorCode, message: String) -> ToRouter {
        ToRouter {
            router: self.router,
            generation: self.generation,
            frame: OutFrame::new(Body::Error(ErrorFrame {
                request_id: self.batch_id,
                part: Some(self.part),
                code,
                message,
            })),
        }
    }
}

/// What to do with a forwarded dispatch: run `local` here (then hand its result to
/// [`NodeFanout::on_local`]) and send each of `remote` to its rank.
#[derive(Debug)]
pub struct Forward {
    /// Key of the pending entry.
    pub key: u64,
    /// This device's share (a dispatch and its payload), if any.
    pub local: Option<(Dispatch, Vec<u8>)>,
    /// The peers' shares: (mesh rank, frame).
    pub remote: Vec<(u32, OutFrame)>,
}

/// A frame for a router: the assembled result or the error of a forwarded dispatch.
#[derive(Debug)]
pub struct ToRouter {
    /// The router's mesh rank.
    pub router: u32,
    /// The generation of the router's link the dispatch came on: the frame is sent on that
    /// link only (`Mesh::send_on`), never to a restarted router.
    pub generation: u64,
    /// The frame.
    pub frame: OutFrame,
}

/// The leader's bookkeeping of forwarded dispatches (sans-IO).
#[derive(Debug)]
pub struct NodeFanout {
    homes: ExpertHomes,
    hidden: usize,
    timeout: Duration,
    next_id: u64,
    pending: HashMap<u64, Pending>,
    /// Sub-dispatch id → (pending key, share index).
    subs: HashMap<u64, (u64, usize)>,
    /// Sub-dispatch ids whose answer has been taken in and waits in the worker's queue
    /// ([`NodeFanout::claim`]).
    claimed: std::collections::HashSet<u64>,
}

impl NodeFanout {
    /// A fan-out for a device with `homes`, rows of `hidden` values; a forwarded dispatch
    /// whose peers do not all answer within `timeout` fails. Sub-dispatch ids start at
    /// `prefix` in their high 32 bits: given a random one per fan-out (so per worker process;
    /// `expertmesh_router::service::fresh_incarnation`), a node peer's answer to an earlier
    /// process of this leader can never match a new one's entry.
    pub fn new(homes: ExpertHomes, hidden: usize, timeout: Duration, prefix: u32) -> Self {
        Self {
            homes,
            hidden,
            timeout,
            next_id: (u64::from(prefix) << 32) | 1,
            pending: HashMap::new(),
            subs: HashMap::new(),
            claimed: std::collections::HashSet::new(),
        }
    }

    /// Whether an answer (result or error) of `from` to sub-dispatch `id`, just received, is
    /// to be queued: only the first for a share still pending, from the peer it went to.
    /// Anything else (late, unsolicited, a copy) is dropped on arrival, so what a node peer
    /// sends cannot grow the worker's queue past one answer per forwarded share.
    pub fn claim(&mut self, from: u32, id: u64) -> bool {
        let Some(&(key, share)) = self.subs.get(&id) else {
            return false;
        };
        let sent_to = self
            .pending
            .get(&key)
            .and_then(|p| p.shares.get(share))
            .and_then(|s| s.rank);
        sent_to == Some(from) && self.claimed.insert(id)
    }

    /// Device `rank` of this node (this one included) serves the routed `experts` as of
    /// `version` ([`ExpertHomes::set_held`]).
    pub fn set_held(
        &mut self,
        rank: u32,
        version: u64,
        experts: impl IntoIterator<Item = (u32, u32)>,
    ) {
        self.homes.set_held(rank, version, experts);
    }

    /// Node peer `rank`'s link came up (again) ([`ExpertHomes::new_link`]).
    pub fn new_link(&mut self, rank: u32) {
        self.homes.new_link(rank);
    }

    /// The other devices of this node (mesh ranks, ascending).
    pub fn node_peers(&self) -> Vec<u32> {
        self.homes.node_peers()
    }

    /// Whether `d` needs the node's other devices.
    pub fn needs_forwarding(&self, d: &Dispatch) -> bool {
        !self.homes.all_local(d)
    }

    /// Forwarded dispatches waiting for peers.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// Splits router `from`'s dispatch `d` (which came on link generation `generation`) into
    /// this device's share and one share per peer (each pair to this device when it holds the
    /// expert, else to the lowest live peer of the node holding it). Fails naming the expert
    /// when no live device of the node holds one (`PeerUnavailable`: the router then sends
    /// the pairs to their owners directly) or the layer has no such expert (`NotFound`).
    pub fn start(
        &mut self,
        from: u32,
        generation: u64,
        d: &Dispatch,
        payload: &[u8],
        is_live: impl Fn(u32) -> bool,
        now: Instant,
    ) -> Result<Forward, ExecError> {
        // Nothing is kept unless every share could be made (an error leaves the table as it
        // was).
        let dest = self.destinations(d, &is_live)?;
        let per_slot = d.layout == OutputLayout::PerSlot;
        // shares in a fixed order: this device first, then peers by rank
        let mut order: Vec<Option<u32>> = dest.clone();
        order.sort_unstable();
        order.dedup();
        let key = self.take_id();
        let mut shares = Vec::with_capacity(order.len());
        let mut local = None;
        let mut remote = Vec::new();
        let mut subs = Vec::new();
        for who in order {
            let (sub, rows, targets) = sub_dispatch(d, &dest, who, per_slot);
            let mut bytes = Vec::new();
            dtype::gather_rows(
                d.dtype,
                d.tokens as usize,
                d.hidden as usize,
                payload,
                &rows,
                &mut bytes,
            )
            .map_err(|e| ExecError {
                code: ErrorCode::BadFrame,
                message: format!("dispatch payload: {e}"),
            })?;
            let mut sub = sub;
            match who {
                None => local = Some((sub, bytes)),
                Some(r) => {
                    sub.batch_id = self.take_id();
                    subs.push((sub.batch_id, (key, shares.len())));
                    let frame = OutFrame::with_payload(Body::Dispatch(sub), Bytes::from(bytes));
                    remote.push((r, frame));
                }
            }
            shares.push(Share {
                rank: who,
                targets,
                rows: None,
            });
        }
        let rows = if per_slot {
            d.experts.len()
        } else {
            d.tokens as usize
        };
        self.pending.insert(
            key,
            Pending {
                router: from,
                generation,
                batch_id: d.batch_id,
                part: d.part,
                layer: d.layer,
                layout: d.layout,
                dtype: d.result_dtype,
                rows,
                started: now,
                waiting: shares.len(),
                shares,
            },
        );
        self.subs.extend(subs);
        self.debug_check();
        Ok(Forward { key, local, remote })
    }

    fn take_id(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    /// Per pair of `d`, the device that runs it (`None`: this device).
    fn destinations(
        &self,
        d: &Dispatch,
        is_live: &impl Fn(u32) -> bool,
    ) -> Result<Vec<Option<u32>>, ExecError> {
        d.experts
            .iter()
            .map(|&e| match self.homes.home(d.layer, e) {
                Some(Home::Local) => Ok(None),
                Some(Home::Peers(p)) => p.iter().copied().find(|&r| is_live(r)).map(Some).ok_or_else(|| {
                    let names: Vec<String> = p.iter().map(|&r| self.homes.name(r)).collect();
                    ExecError {
                        code: ErrorCode::PeerUnavailable,
                        message: format!(
                            "layer {} expert {e}: its device(s) on this node ({}) are not connected to this node's leader",
                            d.layer,
                            names.join(", ")
                        ),
                    }
                }),
                // The router routes by a placement this leader has not heard of yet (a live
                // change: the gaining device's announcement is on its way), or the two
                // disagree: the router sends the pair to its owner directly.
                Some(Home::Elsewhere) => Err(ExecError {
                    code: ErrorCode::PeerUnavailable,
                    message: format!(
                        "layer {} expert {e} is on no device of this node as its leader knows it (a placement change not announced here yet?)",
                        d.layer
                    ),
                }),
                None => Err(ExecError {
                    code: ErrorCode::NotFound,
                    message: format!("layer {} has no expert {e}", d.layer),
                }),
            })
            .collect()
    }

    /// This device's share of pending `key` ran: its result frame.
    pub fn on_local(&mut self, key: u64, res: &ExpertResult, payload: &[u8]) -> Option<ToRouter> {
        self.checked(|f| {
            let shares = &f.pending.get(&key)?.shares;
            let share = shares.iter().position(|s| s.rank.is_none())?;
            f.answer(key, share, None, res, payload)
        })
    }

    /// This device's share of pending `key` failed: the router gets the error.
    pub fn on_local_error(&mut self, key: u64, e: ExecError) -> Option<ToRouter> {
        self.checked(|f| f.fail(key, e.code, e.message))
    }

    /// A peer answered a share. Results that belong to nothing pending (late, after a
    /// failure or timeout) are ignored.
    pub fn on_result(&mut self, from: u32, res: &ExpertResult, payload: &[u8]) -> Option<ToRouter> {
        self.checked(|f| {
            f.claimed.remove(&res.batch_id);
            let (key, share) = f.subs.remove(&res.batch_id)?;
            f.answer(key, share, Some(from), res, payload)
        })
    }

    /// Share `share` of pending `key` answered (by peer `from`, or by this device): its rows
    /// are kept, or the dispatch fails when the answer does not fit the share.
    fn answer(
        &mut self,
        key: u64,
        share: usize,
        from: Option<u32>,
        res: &ExpertResult,
        payload: &[u8],
    ) -> Option<ToRouter> {
        let hidden = self.hidden;
        let p = self.pending.get_mut(&key)?;
        let s = p.shares.get_mut(share)?;
        let mut rows = vec![0f32; s.targets.len() * hidden];
        let ok = s.rank == from
            && res.rows as usize == s.targets.len()
            && res.hidden as usize == hidden
            && dtype::decode_output(res.dtype, payload, &mut rows).is_ok();
        if !ok {
            let who = from.map_or_else(|| "this device".to_owned(), |r| self.homes.name(r));
            let msg = format!("{who} answered a forwarded share with a result of the wrong shape");
            return self.fail(key, ErrorCode::Internal, msg);
        }
        if s.rows.replace(rows).is_none() {
            p.waiting -= 1;
        }
        self.finish_if_done(key)
    }

    /// A peer answered a share with an error: the router gets it, naming the peer.
    pub fn on_error(
        &mut self,
        from: u32,
        request_id: u64,
        code: ErrorCode,
        message: &str,
    ) -> Option<ToRouter> {
        self.checked(|f| {
            let &(key, share) = f.subs.get(&request_id)?;
            let sender = f.pending.get(&key)?.shares.get(share)?.rank;
            if sender != Some(from) {
                return None; // not the peer this share went to
            }
            f.subs.remove(&request_id);
            f.claimed.remove(&request_id);
            let msg = format!("{} (node peer): {message}", f.homes.name(from));
            // The peer no longer holds an expert this leader forwarded to it (it changed its
            // set and its announcement had not arrived): the router sends the pairs to their
            // owners directly, as for an unreachable peer.
            let code = if code == ErrorCode::NotFound {
                ErrorCode::PeerUnavailable
            } else {
                code
            };
            f.fail(key, code, msg)
        })
    }

    /// The link to peer `rank` is lost: every dispatch waiting on it fails.
    pub fn on_peer_lost(&mut self, rank: u32) -> Vec<ToRouter> {
        let keys: Vec<u64> = self
            .pending
            .iter()
            .filter(|(_, p)| {
                p.shares
                    .iter()
                    .any(|s| s.rank == Some(rank) && s.rows.is_none())
            })
            .map(|(&k, _)| k)
            .collect();
        let msg = format!(
            "{} (node peer) was lost while serving a forwarded share",
            self.homes.name(rank)
        );
        self.checked(|f| {
            keys.into_iter()
                .filter_map(|k| f.fail(k, ErrorCode::PeerUnavailable, msg.clone()))
                .collect()
        })
    }

    /// Pending `key` fails at once with `PeerUnavailable` and `message` (its shares could not
    /// be sent): the router sends its pairs to the devices directly.
    pub fn abandon(&mut self, key: u64, message: String) -> Option<ToRouter> {
        self.checked(|f| f.fail(key, ErrorCode::PeerUnavailable, message))
    }

    /// Pending dispatches older than the timeout fail, naming the peers that did not answer.
    pub fn expire(&mut self, now: Instant) -> Vec<ToRouter> {
        let late: Vec<(u64, String)> = self
            .pending
            .iter()
            .filter(|(_, p)| now.duration_since(p.started) >= self.timeout)
            .map(|(&k, p)| {
                let who: Vec<String> = p
                    .shares
                    .iter()
                    .filter(|s| s.rows.is_none())
                    .filter_map(|s| s.rank)
                    .map(|r| self.homes.name(r))
                    .collect();
                (k, who.join(", "))
            })
            .collect();
        self.checked(|f| {
            late.into_iter()
                .filter_map(|(k, who)| {
                    let msg = format!(
                        "node peer(s) {who} did not answer a forwarded share within {:?}",
                        f.timeout
                    );
                    f.fail(k, ErrorCode::PeerUnavailable, msg)
                })
                .collect()
        })
    }

    /// Runs `op` on the table, then checks its invariants when debug assertions are on
    /// ([`NodeFanout::check_invariants`]): every public input but `start` (which checks at its
    /// end) goes through here.
    fn checked<T>(&mut self, op: impl FnOnce(&mut Self) -> T) -> T {
        let out = op(self);
        self.debug_check();
        out
    }

    /// [`NodeFanout::check_invariants`] when debug assertions are on; nothing otherwise.
    fn debug_check(&self) {
        if cfg!(debug_assertions) {
            self.check_invariants();
        }
    }

    /// Panics, naming the rule, unless the table is consistent (checked after every input in
    /// debug builds, as TigerBeetle does, so a slip panics where it happens rather than
    /// surfacing later as a lost or doubled answer):
    /// * an entry's `waiting` count is its shares not yet answered, it has one local share at
    ///   most, and an answered share holds a row per target;
    /// * the sub-dispatch ids map one to one onto the peer shares not yet answered;
    /// * every id handed out lies below the next one.
    fn check_invariants(&self) {
        let mut waiting_on_peers = 0;
        for (&key, p) in &self.pending {
            assert!(key < self.next_id, "entry {key}: an id not yet handed out");
            let unanswered = p.shares.iter().filter(|s| s.rows.is_none()).count();
            assert_eq!(
                p.waiting, unanswered,
                "entry {key}: waiting counts the shares not yet answered"
            );
            let local = p.shares.iter().filter(|s| s.rank.is_none()).count();
            assert!(local <= 1, "entry {key}: {local} local shares");
            for s in &p.shares {
                if let Some(rows) = &s.rows {
                    let want = s.targets.len() * self.hidden;
                    assert_eq!(rows.len(), want, "entry {key}: a row per target");
                }
            }
            waiting_on_peers += p
                .shares
                .iter()
                .filter(|s| s.rank.is_some() && s.rows.is_none())
                .count();
        }
        for (&sub, &(key, i)) in &self.subs {
            assert!(
                sub < self.next_id,
                "sub-dispatch {sub}: an id not yet handed out"
            );
            let share = self.pending.get(&key).and_then(|p| p.shares.get(i));
            assert!(
                share.is_some_and(|s| s.rank.is_some() && s.rows.is_none()),
                "sub-dispatch {sub}: maps to share {i} of entry {key}, not a peer share waiting"
            );
        }
        assert_eq!(
            self.subs.len(),
            waiting_on_peers,
            "one sub-dispatch id per peer share not yet answered"
        );
        assert!(
            self.claimed.iter().all(|id| self.subs.contains_key(id)),
            "a claimed answer belongs to a sub-dispatch still waiting"
        );
    }

    fn fail(&mut self, key: u64, code: ErrorCode, message: String) -> Option<ToRouter> {
        let p = self.pending.remove(&key)?;
        self.subs.retain(|_, (k, _)| *k != key);
        let subs = &self.subs;
        self.claimed.retain(|id| subs.contains_key(id));
        Some(p.error(code, message))
    }

    fn finish_if_done(&mut self, key: u64) -> Option<ToRouter> {
        if self.pending.get(&key)?.waiting > 0 {
            return None;
        }
        let p = self.pending.remove(&key)?;
        let h = self.hidden;
        let mut out = vec![0f32; p.rows * h];
        for s in &p.shares {
            let rows = s.rows.as_deref().unwrap_or(&[]);
            for (i, &t) in s.targets.iter().enumerate() {
                let (dst, src) = (&mut out[t as usize * h..][..h], &rows[i * h..][..h]);
                match p.layout {
                    OutputLayout::PerSlot => dst.copy_from_slice(src),
                    OutputLayout::PreCombined => dst.iter_mut().zip(src).for_each(|(a, b)| *a += b),
                }
            }
        }
        let mut bytes = vec![0u8; out.len() * p.dtype.elem_bytes()];
        if let Err(e) = dtype::encode_output(p.dtype, &out, &mut bytes) {
            let msg = format!("assembling a forwarded result: {e}");
            return Some(p.error(ErrorCode::Internal, msg));
        }
        let res = ExpertResult {
            batch_id: p.batch_id,
            layer: p.layer,
            part: p.part,
            layout: p.layout,
            rows: p.rows as u32,
            hidden: h as u32,
            dtype: p.dtype,
        };
        Some(ToRouter {
            router: p.router,
            generation: p.generation,
            frame: OutFrame::with_payload(Body::Result(res), Bytes::from(bytes)),
        })
    }
}

/// The share of `d` for `who`: its dispatch, the tokens of `d` whose rows
/// it needs (ascending), and the assembled-result row of each of its result rows.
fn sub_dispatch(
    d: &Dispatch,
    dest: &[Option<u32>],
    who: Option<u32>,
    per_slot: bool,
) -> (Dispatch, Vec<u32>, Vec<u32>) {
    // Per-slot rows are copied into the answer, so a share is asked for the router's own
    // dtype (bf16 rows are rounded per row: the same bits, and a share never outgrows the
    // answer's frame); pre-combined rows are summed here first, so they come in f32.
    let mut sub = Dispatch {
        batch_id: d.batch_id,
        layer: d.layer,
        part: d.part,
        tokens: 0,
        hidden: d.hidden,
        dtype: d.dtype,
        mode: d.mode,
        layout: d.layout,
        result_dtype: if per_slot {
            d.result_dtype
        } else {
            OutputDtype::F32
        },
        expert_counts: Vec::new(),
        experts: Vec::new(),
        weights: Vec::new(),
    };
    let mut rows = Vec::new();
    let mut targets = Vec::new();
    let mut p = 0usize;
    for (t, &c) in d.expert_counts.iter().enumerate() {
        let mut n = 0u16;
        for _ in 0..c {
            if dest[p] == who {
                sub.experts.push(d.experts[p]);
                sub.weights.push(d.weights[p]);
                if per_slot {
                    targets.push(p as u32);
                }
                n += 1;
            }
            p += 1;
        }
        if n > 0 {
            rows.push(t as u32);
            sub.expert_counts.push(n);
            if !per_slot {
                targets.push(t as u32);
            }
        }
    }
    sub.tokens = rows.len() as u32;
    (sub, rows, targets)
}

#[cfg(test)]
mod tests {
    use super::*;
    use expertmesh_transport::codec::ComputeMode;
    use expertmesh_transport::dtype::ActivationDtype;

    const H: usize = 4;

    /// Layer 0: experts 0-1 here, 2-3 on peer 5, 4 on peers 6 and 7, 5 on no device of the
    /// node.
    fn homes() -> ExpertHomes {
        let layer = vec![
            Home::Local,
            Home::Local,
            Home::Peers(vec![5]),
            Home::Peers(vec![5]),
            Home::Peers(vec![6, 7]),
            Home::Elsewhere,
        ];
        let mut held: BTreeMap<u32, BTreeSet<(u32, u32)>> =
            [4, 5, 6, 7].map(|r| (r, BTreeSet::new())).into();
        for (e, h) in layer.iter().enumerate() {
            let ranks = match h {
                Home::Local => vec![4],
                Home::Peers(p) => p.clone(),
                Home::Elsewhere => vec![],
            };
            for r in ranks {
                held.get_mut(&r).unwrap().insert((0, e as u32));
            }
        }
        ExpertHomes {
            layers: HashMap::from([(0, layer)]),
            names: HashMap::from([(5, "b/cpu1".into()), (7, "b/cpu3".into())]),
            me: 4,
            routed: 6,
            held,
            versions: BTreeMap::new(),
        }
    }

    #[test]
    fn homes_follow_the_sets_the_node_announces() {
        let mut f = NodeFanout::new(homes(), H, Duration::from_secs(5), 1);
        assert_eq!(f.node_peers(), vec![5, 6, 7]);
        // Peer 5 gives up expert 2 and takes expert 5; this device (rank 4) gives up expert 1
        // and takes expert 3 (which peer 5 keeps too).
        f.set_held(5, 2, [(0, 3), (0, 5)]);
        f.set_held(4, 2, [(0, 0), (0, 3)]);
        // A rank of another node, and an unknown layer or expert, change nothing.
        f.set_held(9, 2, [(0, 2)]);
        f.set_held(6, 2, [(0, 4), (3, 1), (0, 99)]);
        // An older announcement of peer 5 arriving late is ignored...
        f.set_held(5, 1, [(0, 2), (0, 3)]);
        let want = [
            Home::Local,
            Home::Elsewhere,
            Home::Elsewhere,
            Home::Local,
            Home::Peers(vec![6, 7]),
            Home::Peers(vec![5]),
        ];
        for (e, w) in want.iter().enumerate() {
            assert_eq!(f.homes.home(0, e as u32), Some(w), "expert {e}");
            // The incremental update agrees with the homes computed from the sets afresh.
            assert_eq!(w, &f.homes.home_from_held(0, e as u32), "expert {e}");
        }
        // Expert 2 is now on no device of the node: the router sends it directly.
        let (d, p) = dispatch(&[1], &[2], OutputLayout::PerSlot);
        let e = f.start(9, 1, &d, &p, |_| true, Instant::now()).unwrap_err();
        assert_eq!(e.code, ErrorCode::PeerUnavailable);
        // Expert 5 goes to peer 5, expert 3 stays here.
        let (d, p) = dispatch(&[2], &[3, 5], OutputLayout::PerSlot);
        let fwd = f.start(9, 1, &d, &p, |_| true, Instant::now()).unwrap();
        assert_eq!(fwd.local.as_ref().unwrap().0.experts, vec![3]);
        assert_eq!(fwd.remote.len(), 1);
        assert_eq!(fwd.remote[0].0, 5);
        // ...unless its link came up again (a restarted worker counts from 0).
        f.new_link(5);
        f.set_held(5, 0, [(0, 2), (0, 3)]);
        assert_eq!(f.homes.home(0, 2), Some(&Home::Peers(vec![5])));
        assert_eq!(f.homes.home(0, 5), Some(&Home::Elsewhere));
    }

    /// A one-token dispatch (request 77) of expert 2, forwarded whole to its peer: the
    /// fan-out, the peer's rank and the sub-dispatch id.
    fn forwarded_to_one_peer() -> (NodeFanout, u32, u64) {
        let mut f = NodeFanout::new(homes(), H, Duration::from_secs(5), 1);
        let (d, p) = dispatch(&[1], &[2], OutputLayout::PerSlot);
        let fwd = f.start(9, 1, &d, &p, |_| true, Instant::now()).unwrap();
        let (rank, frame) = &fwd.remote[0];
        let Body::Dispatch(sub) = &frame.body else {
            panic!("a dispatch")
        };
        let (rank, id) = (*rank, sub.batch_id);
        (f, rank, id)
    }

    #[test]
    fn a_peer_that_no_longer_holds_a_forwarded_expert_sends_the_pairs_back_to_the_router() {
        let (mut f, rank, id) = forwarded_to_one_peer();
        let t = f
            .on_error(rank, id, ErrorCode::NotFound, "no expert 2 here")
            .unwrap();
        let Body::Error(e) = &t.frame.body else {
            panic!("an error")
        };
        assert_eq!(
            (e.request_id, e.part, e.code),
            (77, Some(3), ErrorCode::PeerUnavailable)
        );
        assert!(e.message.contains("b/cpu1"), "{}", e.message);
    }

    /// A node peer's answers are queued only once per forwarded share, and only from the peer
    /// the share went to: copies, strangers and answers to nothing pending are dropped on
    /// arrival (they could otherwise fill the worker's queue).
    #[test]
    fn only_the_first_answer_to_a_pending_share_is_taken_in() {
        let (mut f, rank, id) = forwarded_to_one_peer();
        assert!(!f.claim(rank + 1, id), "another peer");
        assert!(!f.claim(rank, id + 1000), "nothing pending");
        assert!(f.claim(rank, id));
        assert!(!f.claim(rank, id), "a copy");
        f.check_invariants();
        // Answered (here with an error): nothing of it is claimed any more.
        f.on_error(rank, id, ErrorCode::NotFound, "gone").unwrap();
        assert!(!f.claim(rank, id));
        f.check_invariants();
    }

    /// A dispatch of `counts.len()` tokens whose f32 rows hold the token index.
    fn dispatch(counts: &[u16], experts: &[u32], layout: OutputLayout) -> (Dispatch, Vec<u8>) {
        let t = counts.len();
        let x: Vec<f32> = (0..t * H).map(|i| (i / H) as f32).collect();
        let mut payload = vec![0u8; t * H * 4];
        dtype::encode_activations(ActivationDtype::F32, t, H, &x, &mut payload).unwrap();
        let d = Dispatch {
            batch_id: 77,
            layer: 0,
            part: 3,
            tokens: t as u32,
            hidden: H as u32,
            dtype: ActivationDtype::F32,
            mode: ComputeMode::Exact,
            layout,
            result_dtype: OutputDtype::F32,
            expert_counts: counts.to_vec(),
            experts: experts.to_vec(),
            weights: experts.iter().map(|&e| 0.5 + e as f32).collect(),
        };
        (d, payload)
    }

    /// What "running" a share gives: per pair, a row of token·100 + expert (per slot), or per
    /// token the weighted sum over its pairs (pre-combined).
    fn run_share(d: &Dispatch, payload: &[u8]) -> Vec<f32> {
        let mut x = vec![0f32; d.tokens as usize * H];
        dtype::decode_activations(d.dtype, d.tokens as usize, H, payload, &mut x).unwrap();
        let mut out = Vec::new();
        let mut p = 0;
        for (t, &c) in d.expert_counts.iter().enumerate() {
            let token = x[t * H];
            let mut acc = 0f32;
            for _ in 0..c {
                let v = token * 100.0 + d.experts[p] as f32;
                if d.layout == OutputLayout::PerSlot {
                    out.extend(std::iter::repeat_n(v, H));
                } else {
                    acc += d.weights[p] * v;
                }
                p += 1;
            }
            if d.layout == OutputLayout::PreCombined {
                out.extend(std::iter::repeat_n(acc, H));
            }
        }
        out
    }

    fn result_frame(d: &Dispatch, rows: &[f32]) -> (ExpertResult, Vec<u8>) {
        let mut bytes = vec![0u8; rows.len() * 4];
        dtype::encode_output(OutputDtype::F32, rows, &mut bytes).unwrap();
        let res = ExpertResult {
            batch_id: d.batch_id,
            layer: d.layer,
            part: d.part,
            layout: d.layout,
            rows: (rows.len() / H) as u32,
            hidden: H as u32,
            dtype: OutputDtype::F32,
        };
        (res, bytes)
    }

    /// Runs a forwarded dispatch to the end (peers answer in reverse order) and returns the
    /// assembled rows the router gets.
    fn serve(layout: OutputLayout) -> (Vec<f32>, Vec<f32>) {
        // token 0: experts 0, 2; token 1: 4; token 2: 1, 3, 4
        let (d, payload) = dispatch(&[2, 1, 3], &[0, 2, 4, 1, 3, 4], layout);
        let mut f = NodeFanout::new(homes(), H, Duration::from_secs(5), 1);
        assert!(f.needs_forwarding(&d));
        let now = Instant::now();
        let fwd = f.start(9, 1, &d, &payload, |r| r != 6, now).unwrap();
        let ranks: Vec<u32> = fwd.remote.iter().map(|(r, _)| *r).collect();
        assert_eq!(ranks, [5, 7], "expert 4 skips dead peer 6");
        let (sub, sub_payload) = fwd.local.as_ref().unwrap();
        assert_eq!(sub.experts, [0, 1]);
        let (res, bytes) = result_frame(sub, &run_share(sub, sub_payload));
        assert!(f.on_local(fwd.key, &res, &bytes).is_none());
        let mut last = None;
        for (r, frame) in fwd.remote.iter().rev() {
            let Body::Dispatch(sd) = &frame.body else {
                panic!("a dispatch")
            };
            let (res, bytes) = result_frame(sd, &run_share(sd, &frame.payload));
            last = f.on_result(*r, &res, &bytes);
        }
        let done = last.expect("assembled once every share answered");
        assert_eq!(done.router, 9);
        let Body::Result(res) = &done.frame.body else {
            panic!("a result")
        };
        assert_eq!((res.batch_id, res.part), (77, 3));
        let mut got = vec![0f32; res.rows as usize * H];
        dtype::decode_output(res.dtype, &done.frame.payload, &mut got).unwrap();
        (got, run_share(&d, &payload))
    }

    #[test]
    fn per_slot_rows_are_assembled_in_the_dispatch_order() {
        let (got, direct) = serve(OutputLayout::PerSlot);
        assert_eq!(got, direct);
    }

    #[test]
    fn pre_combined_rows_are_summed_per_token() {
        let (got, direct) = serve(OutputLayout::PreCombined);
        for (g, w) in got.iter().zip(&direct) {
            assert!((g - w).abs() <= 1e-4 * w.abs().max(1.0), "{g} vs {w}");
        }
    }

    #[test]
    fn an_unknown_expert_id_is_not_taken_for_a_local_one() {
        let mut f = NodeFanout::new(homes(), H, Duration::from_secs(5), 1);
        let (d, p) = dispatch(&[1], &[9], OutputLayout::PerSlot);
        assert!(f.needs_forwarding(&d));
        let e = f.start(9, 1, &d, &p, |_| true, Instant::now()).unwrap_err();
        assert_eq!(e.code, ErrorCode::NotFound);
    }

    #[test]
    fn experts_without_a_live_home_on_the_node_go_back_to_the_router() {
        let mut f = NodeFanout::new(homes(), H, Duration::from_secs(5), 1);
        let (d, p) = dispatch(&[1], &[5], OutputLayout::PerSlot);
        let e = f.start(9, 1, &d, &p, |_| true, Instant::now()).unwrap_err();
        assert_eq!(e.code, ErrorCode::PeerUnavailable);
        assert_eq!(f.pending(), 0);
        let (d, p) = dispatch(&[1], &[2], OutputLayout::PerSlot);
        let e = f
            .start(9, 1, &d, &p, |_| false, Instant::now())
            .unwrap_err();
        assert_eq!(e.code, ErrorCode::PeerUnavailable);
        assert!(e.message.contains("b/cpu1"), "{}", e.message);
        assert_eq!(f.pending(), 0);
    }

    /// A fan-out with one dispatch forwarded (a local share and one for peer 5): its key.
    fn one_forwarded() -> (NodeFanout, u64) {
        let (d, p) = dispatch(&[2], &[0, 2], OutputLayout::PerSlot);
        let mut f = NodeFanout::new(homes(), H, Duration::from_secs(5), 1);
        let fwd = f.start(9, 1, &d, &p, |_| true, Instant::now()).unwrap();
        f.check_invariants();
        (f, fwd.key)
    }

    #[test]
    #[should_panic(expected = "waiting counts the shares not yet answered")]
    fn a_waiting_count_that_disagrees_with_the_shares_trips_the_check() {
        let (mut f, key) = one_forwarded();
        f.pending.get_mut(&key).unwrap().waiting += 1;
        f.check_invariants();
    }

    #[test]
    #[should_panic(expected = "one sub-dispatch id per peer share not yet answered")]
    fn a_lost_sub_dispatch_id_trips_the_check() {
        let (mut f, _) = one_forwarded();
        f.subs.clear();
        f.check_invariants();
    }

    #[test]
    fn a_lost_or_silent_peer_fails_the_dispatch_once() {
        let (d, p) = dispatch(&[2], &[0, 2], OutputLayout::PerSlot);
        let mut f = NodeFanout::new(homes(), H, Duration::from_secs(5), 1);
        let now = Instant::now();
        let fwd = f.start(9, 1, &d, &p, |_| true, now).unwrap();
        let failed = f.on_peer_lost(5);
        assert_eq!(failed.len(), 1);
        let Body::Error(e) = &failed[0].frame.body else {
            panic!("an error")
        };
        assert_eq!(
            (e.request_id, e.part, e.code),
            (77, Some(3), ErrorCode::PeerUnavailable)
        );
        // a late answer belongs to nothing
        let Body::Dispatch(sd) = &fwd.remote[0].1.body else {
            panic!()
        };
        let (res, bytes) = result_frame(sd, &run_share(sd, &fwd.remote[0].1.payload));
        assert!(f.on_result(5, &res, &bytes).is_none());
        // a silent peer: the timeout fails it
        let fwd = f.start(9, 1, &d, &p, |_| true, now).unwrap();
        assert!(f.expire(now + Duration::from_secs(4)).is_empty());
        let late = f.expire(now + Duration::from_secs(5));
        assert_eq!(late.len(), 1);
        assert_eq!(f.pending(), 0);
        let _ = fwd;
    }
}
