//! The two ends of an expert copy on a worker: the owner's copy server (a thread that reads
//! the asked expert from its host's checked shard and streams it, paced) and the gainer's
//! fetch (asks the router, reassembles the stream, decodes it), both around the sans-IO
//! stream of the parent module.

use super::{Assembly, CHUNK_BYTES, FETCH_BYTES_PER_S, decode_expert, encode_expert};
use crate::deploy::Deployment;
use crate::weights;
use expertmesh_backend::{BackendError, ExpertKey, ExpertShape, ExpertSource, VecSource};
use expertmesh_quant::format::{ExpertWeights, PackedRef};
use expertmesh_transport::codec::{
    Body, MAX_PLACEMENT_MESSAGE_BYTES, Placement, PlacementOp, encode_placement_entries,
};
use expertmesh_transport::mesh::{Mesh, OutFrame, Transport};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// The id of this process's next copy stream (ids never repeat, so a chunk of an abandoned
/// stream is never taken for a later one's).
static NEXT_STREAM: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Copies an owner queues before it refuses more (each is one expert).
const COPY_QUEUE: usize = 8;

/// Chunks the compute loop queues for the loader (each [`super::CHUNK_BYTES`]).
pub(crate) const CHUNK_QUEUE: usize = 64;

/// How long a gainer waits for the next chunk of a copy before it gives up.
pub(crate) const CHUNK_WAIT: Duration = Duration::from_secs(60);

/// One copy asked of this owner: stream (layer, expert) to `router` as stream `id`.
struct Job {
    router: u32,
    id: u64,
    key: ExpertKey,
}

/// The owner's copy server: one thread, a bounded queue.
pub(crate) struct CopyServer {
    jobs: mpsc::SyncSender<Job>,
}

impl CopyServer {
    /// Starts the thread that serves copies of `dep`'s experts from this host's shards.
    pub(crate) fn start(
        dep: Deployment,
        mesh: Mesh,
        handle: tokio::runtime::Handle,
        id: String,
    ) -> std::io::Result<Self> {
        let (jobs, rx) = mpsc::sync_channel::<Job>(COPY_QUEUE);
        std::thread::Builder::new()
            .name("expert-copy".into())
            .spawn(move || {
                for job in rx {
                    let sent = serve(&dep, &mesh, &handle, &job);
                    if let Err(why) = sent {
                        tracing::warn!(worker = %id, layer = job.key.layer, expert = job.key.expert, "expert copy failed: {why}");
                        let frame = chunk_error(job.id, &why);
                        let _ = handle.block_on(mesh.send(job.router, &frame));
                    } else {
                        tracing::info!(worker = %id, layer = job.key.layer, expert = job.key.expert, "expert copied to a gaining device");
                    }
                }
            })?;
        Ok(Self { jobs })
    }

    /// Router `router` asks for a copy of `key` as stream `id`. Refused (answered at once)
    /// when the queue is full.
    pub(crate) fn ask(&self, router: u32, id: u64, key: ExpertKey) -> Result<(), String> {
        self.jobs.try_send(Job { router, id, key }).map_err(|_| {
            format!("{COPY_QUEUE} expert copies are queued on the owner; ask again later")
        })
    }
}

/// Reads `job`'s expert from this host's checked shard and streams it, paced.
fn serve(
    dep: &Deployment,
    mesh: &Mesh,
    handle: &tokio::runtime::Handle,
    job: &Job,
) -> Result<(), String> {
    let keys = [(job.key.layer, job.key.expert)];
    let (mut source, missing) =
        weights::gained_expert_source_on_host(dep, &keys).map_err(|e| e.to_string())?;
    if !missing.is_empty() {
        return Err(format!(
            "layer {} expert {}: this device serves it but its host has no shard with it (it \
             was copied here); ask another owner",
            job.key.layer, job.key.expert
        ));
    }
    let weights = source.expert(0).map_err(|e| e.to_string())?;
    source.finish().map_err(|e| e.to_string())?;
    let bytes = encode_expert(job.key, &weights);
    drop(weights);
    let started = Instant::now();
    let chunks = bytes.len().div_ceil(CHUNK_BYTES).max(1);
    for (i, chunk) in bytes.chunks(CHUNK_BYTES).enumerate() {
        let offset = i * CHUNK_BYTES;
        // Paced: this chunk starts no earlier than the rate allows.
        let due = Duration::from_secs_f64(offset as f64 / FETCH_BYTES_PER_S);
        if let Some(wait) = due.checked_sub(started.elapsed()) {
            std::thread::sleep(wait);
        }
        let mut p = Placement::new(PlacementOp::Chunk, offset as u64, chunk.len());
        p.request_id = job.id;
        p.loaded = u32::from(i + 1 == chunks);
        let frame =
            OutFrame::with_payload(Body::Placement(p), bytes::Bytes::copy_from_slice(chunk));
        handle
            .block_on(mesh.send(job.router, &frame))
            .map_err(|e| format!("sending the copy: {e}"))?;
    }
    Ok(())
}

/// A `Chunk` that ends stream `id` with why it failed.
pub(crate) fn chunk_error(id: u64, why: &str) -> OutFrame {
    let mut p = Placement::new(PlacementOp::Chunk, 0, 0);
    p.request_id = id;
    let mut end = why.len().min(MAX_PLACEMENT_MESSAGE_BYTES);
    while !why.is_char_boundary(end) {
        end -= 1;
    }
    p.message = why[..end].to_owned();
    OutFrame::new(Body::Placement(p))
}

/// A chunk for the gainer's loader: (stream id, the frame, its payload).
pub(crate) type ChunkMsg = (u64, Placement, Vec<u8>);

/// What a gainer needs to fetch its missing experts.
pub(crate) struct Fetcher {
    /// The router that asked for the change (it relays the copies).
    pub(crate) router: u32,
    /// This worker's mesh rank.
    pub(crate) rank: u32,
    pub(crate) mesh: Mesh,
    pub(crate) handle: tokio::runtime::Handle,
    /// Chunks the compute thread received.
    pub(crate) chunks: mpsc::Receiver<ChunkMsg>,
}

impl Fetcher {
    /// Copies `keys` from their owners, one after the other, as a source.
    pub(crate) fn fetch(&self, dep: &Deployment, keys: &[(u32, u32)]) -> Result<VecSource, String> {
        let (hidden, inter) = (dep.spec.hidden as usize, dep.spec.moe_intermediate as usize);
        let mut out = Vec::with_capacity(keys.len());
        for &(layer, expert) in keys {
            let key = ExpertKey { layer, expert };
            let id = NEXT_STREAM.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
            let mut ask = Placement::new(PlacementOp::Fetch, 0, 1);
            ask.request_id = id;
            let frame = OutFrame::with_payload(
                Body::Placement(ask),
                bytes::Bytes::from(encode_placement_entries(&[(self.rank, layer, expert)])),
            );
            self.handle
                .block_on(self.mesh.send(self.router, &frame))
                .map_err(|e| format!("asking for a copy of layer {layer} expert {expert}: {e}"))?;
            let mut asm = Assembly::new(super::max_stream_bytes(hidden, inter, 32));
            let bytes = loop {
                let (got, p, data) = self.chunks.recv_timeout(CHUNK_WAIT).map_err(|_| {
                    format!("no copy of layer {layer} expert {expert} arrived for {CHUNK_WAIT:?}")
                })?;
                if got != id {
                    continue; // a chunk of an earlier, abandoned stream
                }
                if !p.message.is_empty() {
                    return Err(format!(
                        "copying layer {layer} expert {expert}: {}",
                        p.message
                    ));
                }
                if let Some(b) = asm
                    .add(p.version, &data, p.loaded == 1)
                    .map_err(|e| e.to_string())?
                {
                    break b;
                }
            };
            let w: ExpertWeights =
                decode_expert(&bytes, key, hidden, inter).map_err(|e| e.to_string())?;
            out.push((key, w));
        }
        Ok(VecSource::new(out))
    }
}

/// Two sources one after the other (a gain's experts from the host's shards, then the ones
/// copied from their owners).
pub(crate) struct Chain {
    first: Box<dyn ExpertSource>,
    second: VecSource,
    shapes: Vec<ExpertShape>,
    split: usize,
}

impl Chain {
    pub(crate) fn new(first: Box<dyn ExpertSource>, second: VecSource) -> Self {
        let split = first.shapes().len();
        let shapes = first
            .shapes()
            .iter()
            .chain(second.shapes())
            .cloned()
            .collect();
        Self {
            first,
            second,
            shapes,
            split,
        }
    }
}

impl ExpertSource for Chain {
    fn shapes(&self) -> &[ExpertShape] {
        &self.shapes
    }

    fn expert(&mut self, i: usize) -> Result<ExpertWeights, BackendError> {
        if i < self.split {
            self.first.expert(i)
        } else {
            self.second.expert(i - self.split)
        }
    }

    fn expert_ref(
        &mut self,
        i: usize,
    ) -> Option<Result<(PackedRef<'_>, PackedRef<'_>), BackendError>> {
        if i < self.split {
            self.first.expert_ref(i)
        } else {
            self.second.expert_ref(i - self.split)
        }
    }

    fn finish(&mut self) -> Result<(), BackendError> {
        self.first.finish()?;
        self.second.finish()
    }
}
