//! An in-process NIC with fault injection: the RDMA link's logic tested without hardware.
//!
//! Why this exists: the ring, credit, sequence and poller logic of the RDMA link ([`super`]) must
//! be checked on every build, including against what real NICs do that TCP never does:
//! completions batched, delayed or out of order, completion errors, a write arriving where no
//! receive is posted, a corrupt immediate, a peer that vanishes. This NIC performs a "remote"
//! write as a copy into the peer endpoint's receive ring (both endpoints live in this process,
//! found through a registry by id) and reports completions the way verbs does (one receive
//! consumed per write with immediate), with the faults of [`SimFaults`] applied. Links using it
//! only work between meshes of one process (select it with
//! [`RdmaProvider::InProcess`](super::RdmaProvider::InProcess) in `MeshConfig::rdma_provider`).

use super::RdmaError;
use super::nic::{Completion, Nic, Posted};
use expertmesh_quant::aligned::AlignedVec;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::{Duration, Instant};

/// Faults an in-process endpoint injects. Faults of the receiving side (batching, delay,
/// reordering of its completions, no receives, vanishing) are set on the receiver's endpoint;
/// faults of writes (a failed completion, a corrupt immediate) on the sender's.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SimFaults {
    /// Release completions only when this many are ready (or the oldest has waited 20 ms).
    pub batch: usize,
    /// Make each completion visible this long after its operation.
    pub delay: Duration,
    /// Release each batch of completions in reverse order.
    pub reorder: bool,
    /// Write number n (0-based) of this endpoint completes with an error.
    pub fail_write: Option<u64>,
    /// This endpoint never has a receive posted: a write with immediate to it waits for one
    /// forever, as verbs retries "receiver not ready" without end (`rnr_retry` 7), so the link
    /// can only end by the protocol's idle timeout.
    pub no_receives: bool,
    /// Write number n (0-based) of this endpoint carries a corrupt immediate.
    pub bad_immediate: Option<u64>,
    /// This endpoint vanishes (as its process would) after receiving this many writes.
    pub vanish_after: Option<u64>,
    /// The first this-many posts of this endpoint are refused with "try again", as libfabric's
    /// `tcp;ofi_rxm` refuses writes until its connection is up.
    pub again_first: u32,
}

/// How long a batch may wait for company before it is released anyway.
const BATCH_WAIT: Duration = Duration::from_millis(20);

/// A write waiting at its target for a posted receive ("receiver not ready").
struct Stalled {
    from: Weak<Endpoint>,
    off: usize,
    len: usize,
    imm: u32,
    wr_id: u64,
}

struct Queue {
    pending: VecDeque<(Instant, Completion)>,
    /// Writes to this endpoint waiting for a receive, in arrival order (a queue pair delivers in
    /// order: a later write never overtakes a stalled one).
    stalled: VecDeque<Stalled>,
    posted_receives: u64,
    refused: u32,
    writes: u64,
    received: u64,
    vanished: bool,
}

struct Endpoint {
    id: u64,
    faults: SimFaults,
    capacity: usize,
    recv: AlignedVec<u8>,
    /// Owns the memory `staging_ptr` points into.
    _staging: AlignedVec<u8>,
    recv_ptr: *mut u8,
    staging_ptr: *mut u8,
    queue: Mutex<Queue>,
    peer: Mutex<Option<Weak<Endpoint>>>,
}

// SAFETY: the rings are written through raw pointers the way a NIC writes registered memory:
// the sender's records go to ring bytes the receiver has handed back (credits), and a receiver
// reads a record only after taking its completion from `queue` (the mutex orders the copy
// before the read).
unsafe impl Send for Endpoint {}
// SAFETY: as above.
unsafe impl Sync for Endpoint {}

impl Drop for Endpoint {
    fn drop(&mut self) {
        registry().remove(&self.id);
    }
}

fn registry() -> MutexGuard<'static, HashMap<u64, Weak<Endpoint>>> {
    static REGISTRY: OnceLock<Mutex<HashMap<u64, Weak<Endpoint>>>> = OnceLock::new();
    REGISTRY
        .get_or_init(|| Mutex::new(HashMap::new()))
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// One in-process endpoint.
pub(crate) struct SimNic {
    ep: Arc<Endpoint>,
}

impl SimNic {
    /// An endpoint with two rings of `capacity` bytes.
    pub(crate) fn new(capacity: usize, faults: SimFaults) -> Self {
        static NEXT_ID: AtomicU64 = AtomicU64::new(1);
        let mut recv = AlignedVec::zeroed(capacity);
        let mut staging = AlignedVec::zeroed(capacity);
        let (recv_ptr, staging_ptr) = (recv.as_mut_ptr(), staging.as_mut_ptr());
        let ep = Arc::new(Endpoint {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            faults,
            capacity,
            recv,
            _staging: staging,
            recv_ptr,
            staging_ptr,
            queue: Mutex::new(Queue {
                pending: VecDeque::new(),
                stalled: VecDeque::new(),
                posted_receives: 0,
                refused: 0,
                writes: 0,
                received: 0,
                vanished: false,
            }),
            peer: Mutex::new(None),
        });
        registry().insert(ep.id, Arc::downgrade(&ep));
        Self { ep }
    }

    fn err(detail: impl Into<String>) -> RdmaError {
        RdmaError::Provider {
            provider: "in-process NIC".into(),
            detail: detail.into(),
        }
    }

    /// A write from this endpoint to `peer`: lands now, or waits at the peer for a receive.
    /// Returns the sender's completion when there is one already.
    fn deliver(&self, peer: &Arc<Endpoint>, w: Stalled) -> Option<Completion> {
        let mut q = lock(&peer.queue);
        if q.vanished {
            return Some(Completion::Failed(
                "remote endpoint gone (transport retry counter exceeded)".into(),
            ));
        }
        if q.posted_receives == 0 || !q.stalled.is_empty() {
            q.stalled.push_back(w);
            return None;
        }
        Some(peer.land(&mut q, &self.ep, &w))
    }
}

impl Endpoint {
    /// Lands a write from `from` into this endpoint's ring (the caller holds `q`, this
    /// endpoint's queue, and has checked a receive is posted); the sender's completion.
    fn land(&self, q: &mut Queue, from: &Endpoint, w: &Stalled) -> Completion {
        if w.off + w.len > self.capacity || w.off + w.len > from.capacity {
            return Completion::Failed(
                "remote access error: write outside the registered ring".into(),
            );
        }
        // SAFETY: both ranges lie inside their rings (checked); this endpoint's bytes there
        // were released by it (credits), and it reads them only after taking the completion
        // queued below under the lock the caller holds; the sender leaves its staging bytes
        // alone until it takes the returned completion.
        unsafe {
            std::ptr::copy_nonoverlapping(
                from.staging_ptr.add(w.off),
                self.recv_ptr.add(w.off),
                w.len,
            )
        };
        q.posted_receives -= 1;
        q.pending.push_back((
            Instant::now() + self.faults.delay,
            Completion::Received { imm: w.imm },
        ));
        q.received += 1;
        if self.faults.vanish_after == Some(q.received) {
            q.vanished = true;
        }
        Completion::Sent { wr_id: w.wr_id }
    }

    /// Queues `done` on this endpoint's completion queue.
    fn complete(&self, done: Completion) {
        lock(&self.queue)
            .pending
            .push_back((Instant::now() + self.faults.delay, done));
    }
}

impl Nic for SimNic {
    fn local_info(&self) -> Vec<u8> {
        self.ep.id.to_le_bytes().to_vec()
    }

    fn connect(&self, peer: &[u8]) -> Result<(), RdmaError> {
        let id = u64::from_le_bytes(
            peer.try_into()
                .map_err(|_| RdmaError::BadPeerInfo(format!("{} bytes", peer.len())))?,
        );
        let found = registry().get(&id).cloned();
        match found.and_then(|w| w.upgrade()) {
            Some(p) => {
                *lock(&self.ep.peer) = Some(Arc::downgrade(&p));
                Ok(())
            }
            None => Err(Self::err(format!(
                "no endpoint {id} in this process (the in-process NIC links meshes of one process only)"
            ))),
        }
    }

    fn ring_capacity(&self) -> usize {
        self.ep.capacity
    }

    fn recv_ring(&self) -> *const u8 {
        self.ep.recv.as_ptr()
    }

    fn staging(&self) -> *mut u8 {
        self.ep.staging_ptr
    }

    fn post_write(
        &self,
        off: usize,
        len: usize,
        imm: u32,
        wr_id: u64,
    ) -> Result<Posted, RdmaError> {
        let n = {
            let mut q = lock(&self.ep.queue);
            if q.vanished {
                return Err(Self::err("this endpoint vanished (injected)"));
            }
            if q.refused < self.ep.faults.again_first {
                q.refused += 1;
                return Ok(Posted::Again);
            }
            q.writes += 1;
            q.writes - 1
        };
        let f = &self.ep.faults;
        let imm = if f.bad_immediate == Some(n) {
            imm ^ 0x00FF_FF00
        } else {
            imm
        };
        let peer = lock(&self.ep.peer).as_ref().and_then(Weak::upgrade);
        let done = if f.fail_write == Some(n) {
            Some(Completion::Failed(format!(
                "injected: write {n} completed with IBV_WC_REM_OP_ERR"
            )))
        } else {
            match peer {
                Some(p) => {
                    let from = Arc::downgrade(&self.ep);
                    self.deliver(
                        &p,
                        Stalled {
                            from,
                            off,
                            len,
                            imm,
                            wr_id,
                        },
                    )
                }
                None => Some(Completion::Failed(
                    "remote endpoint gone (transport retry counter exceeded)".into(),
                )),
            }
        };
        if let Some(done) = done {
            self.ep.complete(done);
        }
        Ok(Posted::Accepted)
    }

    fn needs_receives(&self) -> bool {
        true
    }

    fn post_recv(&self) -> Result<(), RdmaError> {
        if self.ep.faults.no_receives {
            return Ok(());
        }
        // A write stalled for want of a receive lands now; its sender's completion is queued
        // after this endpoint's lock is released (never two endpoints' locks at once).
        let landed = {
            let mut q = lock(&self.ep.queue);
            q.posted_receives += 1;
            match q.stalled.pop_front() {
                // A sender that is gone: its write dies with it.
                Some(w) => w.from.upgrade().map(|from| {
                    let done = self.ep.land(&mut q, &from, &w);
                    (from, done)
                }),
                None => None,
            }
        };
        if let Some((from, done)) = landed {
            from.complete(done);
        }
        Ok(())
    }

    fn poll(&self, out: &mut Vec<Completion>, max: usize) -> Result<(), RdmaError> {
        let now = Instant::now();
        let f = &self.ep.faults;
        let mut q = lock(&self.ep.queue);
        if q.vanished {
            return Err(Self::err("this endpoint vanished (injected)"));
        }
        let ready = q.pending.iter().take_while(|(t, _)| *t <= now).count();
        if ready == 0 {
            return Ok(());
        }
        let oldest_waited = now.saturating_duration_since(q.pending[0].0) >= BATCH_WAIT;
        if f.batch > 1 && ready < f.batch && !oldest_waited {
            return Ok(());
        }
        let take = ready.min(max);
        let start = out.len();
        out.extend(q.pending.drain(..take).map(|(_, c)| c));
        if f.reorder {
            out[start..].reverse();
        }
        Ok(())
    }
}
