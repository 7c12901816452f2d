//! The two ends of an expert copy on a worker: the owner's copy server (a thread that reads
//! the asked expert from its host's checked shard and streams it, paced) and the gainer's
//! fetch (asks the router, reassembles the stream, decodes it), both around the sans-IO
//! stream of the parent module.

use super::{Assembly, CHUNK_BYTES, FETCH_BYTES_PER_S, WINDOW_BYTES, decode_expert, encode_expert};
use crate::deploy::Deployment;
use crate::weights;
use expertmesh_backend::{BackendError, ExpertKey, ExpertShape, ExpertSource};
use expertmesh_quant::format::{ExpertWeights, PackedRef};
use expertmesh_transport::codec::{
    Body, COPY_CANCELLED, Placement, PlacementOp, encode_placement_entries,
};
use expertmesh_transport::mesh::{Mesh, OutFrame, Transport};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// The id of this process's next copy stream (ids never repeat, so a chunk of an abandoned
/// stream is never taken for a later one's).
static NEXT_STREAM: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Copies an owner queues before it refuses more (each is one expert, a few bytes queued:
/// the copies themselves run one at a time).
const COPY_QUEUE: usize = 1024;

/// Acknowledgements the compute loop queues for the copy thread.
const ACK_QUEUE: usize = 256;

/// Chunks the compute loop queues for the loader (each [`super::CHUNK_BYTES`]).
pub(crate) const CHUNK_QUEUE: usize = 64;

/// How long a gainer waits for the next chunk of a copy, and an owner for the gainer's next
/// acknowledgement, before it gives up.
pub(crate) const CHUNK_WAIT: Duration = Duration::from_secs(60);

/// Streams the router cancelled (their asker is gone) that this owner remembers, so one still
/// queued is never started: the newest this many.
const CANCELLED_KEPT: usize = 1024;

/// Why a copy ended early when its router cancelled it (no error goes back: nobody waits).
const CANCELLED: &str = "the gaining device is gone: the router cancelled the copy";

/// One copy asked of this owner: stream (layer, expert) to `router` as stream `id`.
struct Job {
    router: u32,
    id: u64,
    key: ExpertKey,
}

/// The streams of experts this device was copied, kept on local disk so it can copy them on
/// in turn (its host has no shard with them): one file per expert in a folder of its own,
/// created on first use, removed when the expert is released and when the worker exits.
///
/// The folder is made fresh, private (mode 0700) and with a random name in the shared
/// temporary folder, never taken over from a path someone else could have made first: what it
/// holds goes to other devices as weights, checked by an unkeyed checksum only.
pub(crate) struct CopyCache {
    rank: u32,
    /// Made on first use, with the lock held on it for its life (a sweep by another worker
    /// leaves it alone); `None` when it could not be made (nothing is kept then).
    dir: std::sync::OnceLock<Option<(tempfile::TempDir, expertmesh_files::Held)>>,
}

impl CopyCache {
    /// The cache of the worker with mesh rank `rank` in this process (nothing on disk yet).
    pub(crate) fn new(rank: u32) -> Self {
        Self {
            rank,
            dir: std::sync::OnceLock::new(),
        }
    }

    /// The folder, made on the first call (removing first the caches killed workers left
    /// behind: their process is gone).
    fn folder(&self) -> Option<&std::path::Path> {
        let made = self.dir.get_or_init(|| {
            let tmp = std::env::temp_dir();
            remove_orphans(&tmp);
            let prefix = format!("{CACHE_PREFIX}{}-{}-", std::process::id(), self.rank);
            let private = {
                use std::os::unix::fs::PermissionsExt;
                std::fs::Permissions::from_mode(0o700)
            };
            let made = expertmesh_files::make_locked_folder(
                || {
                    tempfile::Builder::new()
                        .prefix(&prefix)
                        .permissions(private.clone())
                        .tempdir_in(&tmp)
                },
                tempfile::TempDir::path,
            );
            match made {
                Ok(d) => Some(d),
                Err(e) => {
                    tracing::warn!(
                        dir = %tmp.display(),
                        "cannot make a folder for copied experts ({e}); other devices will copy them from another owner"
                    );
                    None
                }
            }
        });
        made.as_ref().map(|(d, _)| d.path())
    }

    /// `key`'s file in the folder, once the folder is made.
    fn path(&self, key: ExpertKey) -> Option<std::path::PathBuf> {
        Some(self.dir.get()?.as_ref()?.0.path().join(file_name(key)))
    }

    /// Keeps `key`'s stream, whole or not at all (a temporary file renamed into place: a full
    /// disk must not leave a truncated stream that [`CopyCache::get`] would serve). A failure
    /// only means this device cannot copy it on: logged, and the copy itself goes on.
    pub(crate) fn put(&self, key: ExpertKey, stream: &[u8]) {
        let Some(dir) = self.folder() else {
            return;
        };
        // Whole or not at all, unsynced: the folder goes with the process.
        let path = dir.join(file_name(key));
        if let Err(e) = expertmesh_files::write_whole_unsynced(&path, stream, Some(0o600)) {
            tracing::warn!(
                layer = key.layer,
                expert = key.expert,
                dir = %dir.display(),
                "keeping a copied expert for copying it on failed ({e}); other devices will copy it from another owner"
            );
        }
    }

    /// `key`'s stream, when this device was copied it.
    pub(crate) fn get(&self, key: ExpertKey) -> Option<Vec<u8>> {
        std::fs::read(self.path(key)?).ok()
    }

    /// Forgets `key` (released).
    pub(crate) fn remove(&self, key: ExpertKey) {
        if let Some(p) = self.path(key) {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// The name of a copy cache folder: this, the worker's process id, `-`, its mesh rank, `-`
/// and random characters.
const CACHE_PREFIX: &str = "expertmesh-copies-";

/// Removes the copy caches in `tmp` whose process is gone (Linux: no `/proc/PID`; elsewhere,
/// or without `/proc`, nothing is removed) and that no process holds locked: a live worker in
/// another PID namespace sharing this `tmp` holds its folder's lock.
fn remove_orphans(tmp: &std::path::Path) {
    expertmesh_files::remove_left_by_gone_processes(tmp, |name| {
        expertmesh_files::pid_after(CACHE_PREFIX, name)
    });
}

// The folder goes with the cache: `TempDir` removes it when dropped.

/// The file of `key`'s stream in a cache folder.
fn file_name(key: ExpertKey) -> String {
    format!("layer{}-expert{}.emxf", key.layer, key.expert)
}

/// The owner's copy server: one thread, a bounded queue.
pub(crate) struct CopyServer {
    jobs: mpsc::SyncSender<Job>,
    acks: mpsc::SyncSender<(u64, u64)>,
    /// Streams cancelled by their router (the newest [`CANCELLED_KEPT`]).
    cancelled: std::sync::Arc<std::sync::Mutex<std::collections::VecDeque<u64>>>,
}

impl CopyServer {
    /// Starts the thread that serves copies of `dep`'s experts from this host's shards.
    pub(crate) fn start(
        dep: Deployment,
        cache: std::sync::Arc<CopyCache>,
        mesh: Mesh,
        handle: tokio::runtime::Handle,
        id: String,
    ) -> std::io::Result<Self> {
        let (jobs, rx) = mpsc::sync_channel::<Job>(COPY_QUEUE);
        let (acks, acked) = mpsc::sync_channel::<(u64, u64)>(ACK_QUEUE);
        let cancelled: std::sync::Arc<std::sync::Mutex<std::collections::VecDeque<u64>>> =
            std::sync::Arc::default();
        let skip = std::sync::Arc::clone(&cancelled);
        std::thread::Builder::new()
            .name("expert-copy".into())
            .spawn(move || {
                let mut shards = weights::HostShards::new(dep);
                for job in rx {
                    let gone = |id| {
                        skip.lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .contains(&id)
                    };
                    let sent = if gone(job.id) {
                        Err(CANCELLED.to_owned())
                    } else {
                        serve(&mut shards, &cache, &mesh, &handle, &job, &acked)
                    };
                    if sent.as_ref().is_err_and(|why| why == CANCELLED) {
                        tracing::info!(worker = %id, layer = job.key.layer, expert = job.key.expert, "expert copy cancelled: {CANCELLED}");
                    } else if let Err(why) = sent {
                        tracing::warn!(worker = %id, layer = job.key.layer, expert = job.key.expert, "expert copy failed: {why}");
                        let frame =
                            OutFrame::new(Body::Placement(Placement::chunk_error(job.id, &why)));
                        let _ = handle.block_on(mesh.send(job.router, &frame));
                    } else {
                        tracing::info!(worker = %id, layer = job.key.layer, expert = job.key.expert, "expert copied to a gaining device");
                    }
                }
            })?;
        Ok(Self {
            jobs,
            acks,
            cancelled,
        })
    }

    /// The gainer of stream `id` has `bytes` of it (dropped when the queue is full: the
    /// next acknowledgement covers it); [`COPY_CANCELLED`] bytes: the router cancelled it
    /// (remembered, so that a copy still queued is never started).
    pub(crate) fn ack(&self, id: u64, bytes: u64) {
        if bytes == COPY_CANCELLED {
            let mut c = self.cancelled.lock().unwrap_or_else(|e| e.into_inner());
            if c.len() == CANCELLED_KEPT {
                c.pop_front();
            }
            c.push_back(id);
        }
        let _ = self.acks.try_send((id, bytes));
    }

    /// Router `router` asks for a copy of `key` as stream `id`. Refused (answered at once)
    /// when the queue is full.
    pub(crate) fn ask(&self, router: u32, id: u64, key: ExpertKey) -> Result<(), String> {
        self.jobs.try_send(Job { router, id, key }).map_err(|_| {
            format!("{COPY_QUEUE} expert copies are queued on the owner; ask again later")
        })
    }
}

/// Reads `job`'s expert from this host's checked shards (each checked once per copy thread;
/// or, when this device was copied it,
/// the stream it kept) and streams it, paced, with at most [`WINDOW_BYTES`] unacknowledged by
/// the gainer (`acked`).
fn serve(
    shards: &mut weights::HostShards,
    cache: &CopyCache,
    mesh: &Mesh,
    handle: &tokio::runtime::Handle,
    job: &Job,
    acked: &mpsc::Receiver<(u64, u64)>,
) -> Result<(), String> {
    let bytes = if let Some(weights) = shards.expert(job.key).map_err(|e| e.to_string())? {
        encode_expert(job.key, &weights)
    } else {
        // Copied here: the stream kept (its CRC-32C goes along and is checked at the end).
        cache.get(job.key).ok_or_else(|| {
            format!(
                "layer {} expert {}: this device serves it but neither its host's shards nor its \
                 copies hold it; ask another owner",
                job.key.layer, job.key.expert
            )
        })?
    };
    stream(&bytes, job.id, acked, CHUNK_WAIT, |frame| {
        handle
            .block_on(mesh.send(job.router, &frame))
            .map_err(|e| format!("sending the copy: {e}"))
    })
}

/// Sends `bytes` as stream `id`'s chunks through `send`, paced at [`FETCH_BYTES_PER_S`] and
/// never more than [`WINDOW_BYTES`] past what the gainer acknowledged (`acked`: (stream,
/// bytes received)); gives up when no acknowledgement comes for `wait`, and stops at once
/// when the router cancels the stream ([`COPY_CANCELLED`] bytes; `Err` [`CANCELLED`]).
pub(crate) fn stream(
    bytes: &[u8],
    id: u64,
    acked: &mpsc::Receiver<(u64, u64)>,
    wait: Duration,
    mut send: impl FnMut(OutFrame) -> Result<(), String>,
) -> Result<(), String> {
    let started = Instant::now();
    let chunks = bytes.len().div_ceil(CHUNK_BYTES).max(1);
    let mut confirmed = 0usize;
    let cancelled = || Err(CANCELLED.to_owned());
    for (i, chunk) in bytes.chunks(CHUNK_BYTES).enumerate() {
        let offset = i * CHUNK_BYTES;
        // What came meanwhile: a cancel stops the stream before its next chunk.
        while let Ok((got, n)) = acked.try_recv() {
            if got == id && n == COPY_CANCELLED {
                return cancelled();
            }
            if got == id {
                confirmed = confirmed.max(n as usize);
            }
        }
        // Windowed: wait for the gainer's acknowledgements to come within reach.
        while offset + chunk.len() > confirmed + WINDOW_BYTES {
            match acked.recv_timeout(wait) {
                Ok((got, COPY_CANCELLED)) if got == id => return cancelled(),
                Ok((got, n)) if got == id => confirmed = confirmed.max(n as usize),
                Ok(_) => {} // an acknowledgement of an earlier stream
                Err(_) => {
                    return Err(format!(
                        "the gaining device acknowledged nothing for {wait:?}; copy abandoned"
                    ));
                }
            }
        }
        // Paced: this chunk starts no earlier than the rate allows.
        let due = Duration::from_secs_f64(offset as f64 / FETCH_BYTES_PER_S);
        if let Some(pause) = due.checked_sub(started.elapsed()) {
            std::thread::sleep(pause);
        }
        let mut p = Placement::new(PlacementOp::Chunk, offset as u64, chunk.len());
        p.request_id = id;
        p.loaded = u32::from(i + 1 == chunks);
        send(OutFrame::with_payload(
            Body::Placement(p),
            bytes::Bytes::copy_from_slice(chunk),
        ))?;
    }
    Ok(())
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
    /// Chunks the compute thread received; it drops its end when the change is superseded.
    pub(crate) chunks: mpsc::Receiver<ChunkMsg>,
    /// Set by the compute thread when a newer hold no longer wants the experts being copied
    /// (an undo, a newer step): the copy under way is cancelled at its owner and no other is
    /// asked for.
    pub(crate) superseded: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// Where each copied stream is kept, so this device can copy it on.
    pub(crate) cache: std::sync::Arc<CopyCache>,
}

impl Fetcher {
    /// Copies `key` from a device that serves it. A copy this device gives up (no chunk for
    /// [`CHUNK_WAIT`], a malformed stream, the change superseded) is cancelled at its owner
    /// (through the router), whose one copy thread would otherwise stream on, or wait for
    /// acknowledgements, while the copies queued behind it wait.
    fn fetch_one(&self, dep: &Deployment, key: ExpertKey) -> Result<ExpertWeights, String> {
        let (layer, expert) = (key.layer, key.expert);
        if self.superseded.load(std::sync::atomic::Ordering::Relaxed) {
            return Err(SUPERSEDED.into());
        }
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
        let (hidden, inter) = (dep.spec.hidden as usize, dep.spec.moe_intermediate as usize);
        let stream = (key, id, super::max_stream_bytes(hidden, inter, 32));
        let bytes = receive(&self.chunks, &self.superseded, stream, CHUNK_WAIT, |n| {
            self.ack(id, n)
        })
        .inspect_err(|(_, cancel)| {
            if *cancel {
                // Best effort: a lost link cancels it at the router anyway.
                let _ = self.ack(id, COPY_CANCELLED);
            }
        });
        let bytes = bytes.map_err(|(why, _)| why)?;
        let w = decode_expert(&bytes, key, hidden, inter).map_err(|e| e.to_string())?;
        self.cache.put(key, &bytes);
        Ok(w)
    }
}

/// The stream `id` of `key` (at most `max_bytes`), assembled from the `chunks` as they come,
/// each acknowledged through `ack` (bytes received). `Err((why, cancel))`: `cancel` when the
/// owner may still be streaming (this device gave the copy up: no chunk for `wait`, a
/// malformed stream, `superseded` set), not when the owner ended it or an acknowledgement
/// could not be sent (the link to the router is down: the router cancels it then).
pub(crate) fn receive(
    chunks: &mpsc::Receiver<ChunkMsg>,
    superseded: &std::sync::atomic::AtomicBool,
    (key, id, max_bytes): (ExpertKey, u64, usize),
    wait: Duration,
    mut ack: impl FnMut(u64) -> Result<(), String>,
) -> Result<Vec<u8>, (String, bool)> {
    let (layer, expert) = (key.layer, key.expert);
    let mut asm = Assembly::new(max_bytes);
    let mut received = 0u64;
    loop {
        // The compute thread drops its end of the queue when the change is superseded, which
        // ends this wait at once.
        let (got, p, data) = chunks.recv_timeout(wait).map_err(|_| {
            let why = if superseded.load(std::sync::atomic::Ordering::Relaxed) {
                SUPERSEDED.to_owned()
            } else {
                format!("no copy of layer {layer} expert {expert} arrived for {wait:?}")
            };
            (why, true)
        })?;
        if got != id {
            continue; // a chunk of an earlier, abandoned stream
        }
        if !p.message.is_empty() {
            return Err((
                format!("copying layer {layer} expert {expert}: {}", p.message),
                false,
            ));
        }
        let whole = asm
            .add(p.version, &data, p.loaded == 1)
            .map_err(|e| (e.to_string(), true))?;
        received += data.len() as u64;
        ack(received).map_err(|why| (why, false))?;
        if let Some(b) = whole {
            return Ok(b);
        }
    }
}

/// Why a gainer stopped copying: a newer hold does not want the experts.
const SUPERSEDED: &str =
    "a newer placement change no longer wants the experts being copied; copy cancelled";

/// The experts a gainer copies from their owners, as a source that copies each when the
/// backend asks for it (one copied expert in memory at a time, next to the arena it goes
/// into). The first is copied up front: its packed format is the conversion's, and every
/// shape is known before the backend starts.
pub(crate) struct FetchSource {
    fetcher: Fetcher,
    dep: Deployment,
    shapes: Vec<ExpertShape>,
    first: Option<ExpertWeights>,
}

impl FetchSource {
    /// The copies of `keys` (not empty), the first one made now.
    pub(crate) fn new(
        fetcher: Fetcher,
        dep: Deployment,
        keys: &[(u32, u32)],
    ) -> Result<Self, String> {
        let key = |&(layer, expert): &(u32, u32)| ExpertKey { layer, expert };
        let head = keys.first().ok_or("no expert to copy")?;
        let first = fetcher.fetch_one(&dep, key(head))?;
        let (hidden, inter, quant) = (first.hidden(), first.inter(), first.spec());
        let shapes = keys
            .iter()
            .map(|k| ExpertShape {
                key: key(k),
                hidden,
                inter,
                quant,
            })
            .collect();
        Ok(Self {
            fetcher,
            dep,
            shapes,
            first: Some(first),
        })
    }
}

impl ExpertSource for FetchSource {
    fn shapes(&self) -> &[ExpertShape] {
        &self.shapes
    }

    fn expert(&mut self, i: usize) -> Result<ExpertWeights, BackendError> {
        if i == 0
            && let Some(w) = self.first.take()
        {
            return Ok(w);
        }
        let shape = *self
            .shapes
            .get(i)
            .ok_or_else(|| BackendError::Source(format!("no copied expert {i}")))?;
        let w = self
            .fetcher
            .fetch_one(&self.dep, shape.key)
            .map_err(BackendError::Source)?;
        if w.spec() != shape.quant {
            return Err(BackendError::Source(format!(
                "the copy of layer {} expert {} is packed as {:?}, the first copy as {:?}",
                shape.key.layer,
                shape.key.expert,
                w.spec(),
                shape.quant
            )));
        }
        Ok(w)
    }
}

impl Fetcher {
    /// Tells the owner of stream `id` (through the router) that `bytes` of it arrived.
    fn ack(&self, id: u64, bytes: u64) -> Result<(), String> {
        let mut p = Placement::new(PlacementOp::Ack, bytes, 0);
        p.request_id = id;
        self.handle
            .block_on(
                self.mesh
                    .send(self.router, &OutFrame::new(Body::Placement(p))),
            )
            .map_err(|e| format!("acknowledging a copy: {e}"))
    }
}

/// Two sources one after the other (a gain's experts from the host's shards, then the ones
/// copied from their owners).
pub(crate) struct Chain {
    first: Box<dyn ExpertSource>,
    second: FetchSource,
    shapes: Vec<ExpertShape>,
    split: usize,
}

impl Chain {
    pub(crate) fn new(first: Box<dyn ExpertSource>, second: FetchSource) -> Self {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A gainer's copy: a whole stream is assembled and each chunk acknowledged; what the
    /// gainer gives up (no chunk in time, a malformed stream, the change superseded) says
    /// "cancel it at the owner", what the owner ended or a failed acknowledgement does not.
    #[test]
    fn a_copy_the_gainer_gives_up_is_one_to_cancel_and_one_the_owner_ended_is_not() {
        use expertmesh_quant::format::{QuantSpec, ScaleDtype};
        use std::sync::atomic::AtomicBool;
        let key = ExpertKey {
            layer: 2,
            expert: 5,
        };
        let spec = QuantSpec {
            group_size: 32,
            scale_dtype: ScaleDtype::Bf16,
            zero_points: false,
        };
        let w = expertmesh_quant::synth::synthetic_expert(spec, 64, 32, 3, 2, 5).unwrap();
        let bytes = super::super::encode_expert(key, &w);
        let max = super::super::max_stream_bytes(64, 32, 32);
        let chunk = |id: u64, at: usize, data: &[u8], last: bool| {
            let mut p = Placement::new(PlacementOp::Chunk, at as u64, data.len());
            p.request_id = id;
            p.loaded = u32::from(last);
            (id, p, data.to_vec())
        };
        let wait = Duration::from_secs(120); // a hang guard: every case ends without it
        let no = AtomicBool::new(false);
        let half = bytes.len() / 2;

        // Whole, in two chunks, a chunk of another stream between them: acknowledged twice.
        let (tx, rx) = mpsc::sync_channel(8);
        tx.send(chunk(9, 0, &bytes[..half], false)).unwrap();
        tx.send(chunk(8, 0, b"old", false)).unwrap();
        tx.send(chunk(9, half, &bytes[half..], true)).unwrap();
        let mut acks = Vec::new();
        let got = receive(&rx, &no, (key, 9, max), wait, |n| {
            acks.push(n);
            Ok(())
        });
        assert_eq!(got, Ok(bytes.clone()));
        assert_eq!(acks, vec![half as u64, bytes.len() as u64]);

        // The owner ended it: not to cancel.
        let (tx, rx) = mpsc::sync_channel(8);
        tx.send((9, Placement::chunk_error(9, "no copy here"), Vec::new()))
            .unwrap();
        let (why, cancel) = receive(&rx, &no, (key, 9, max), wait, |_| Ok(())).unwrap_err();
        assert!(!cancel && why.contains("no copy here"), "{why}");

        // An acknowledgement that cannot be sent (the link is down): not to cancel.
        let (tx, rx) = mpsc::sync_channel(8);
        tx.send(chunk(9, 0, &bytes[..half], false)).unwrap();
        let (_, cancel) =
            receive(&rx, &no, (key, 9, max), wait, |_| Err("link down".into())).unwrap_err();
        assert!(!cancel);

        // Longer than the expert can be: to cancel (the owner would stream on).
        let (tx, rx) = mpsc::sync_channel(8);
        tx.send(chunk(9, max, b"past the end", false)).unwrap();
        let (_, cancel) = receive(&rx, &no, (key, 9, max), wait, |_| Ok(())).unwrap_err();
        assert!(cancel);

        // Superseded: the compute thread sets the flag and drops its end; the wait ends at
        // once, to cancel.
        let (tx, rx) = mpsc::sync_channel::<ChunkMsg>(8);
        let yes = AtomicBool::new(true);
        drop(tx);
        let (why, cancel) = receive(&rx, &yes, (key, 9, max), wait, |_| Ok(())).unwrap_err();
        assert!(cancel && why == SUPERSEDED, "{why}");

        // No chunk within the wait: to cancel.
        let (_tx, rx) = mpsc::sync_channel::<ChunkMsg>(8);
        let short = Duration::from_millis(10);
        let (why, cancel) = receive(&rx, &no, (key, 9, max), short, |_| Ok(())).unwrap_err();
        assert!(cancel && why.contains("arrived for"), "{why}");
    }

    /// The cache's folder is made on first use, private (0700) and uniquely named after the
    /// process and rank; a stream put is read back, a removed one is gone, and the folder goes
    /// with the cache.
    #[test]
    fn the_copy_cache_keeps_streams_in_a_private_folder_of_its_own() {
        use std::os::unix::fs::PermissionsExt;
        let cache = CopyCache::new(7);
        let key = ExpertKey {
            layer: 3,
            expert: 11,
        };
        assert_eq!(cache.get(key), None, "nothing on disk before the first put");
        cache.put(key, b"a stream");
        let dir = cache.folder().expect("the folder is made").to_path_buf();
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        let ours = format!("{CACHE_PREFIX}{}-7-", std::process::id());
        assert!(name.starts_with(&ours) && name.len() > ours.len(), "{name}");
        let mode = std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700, "{}", dir.display());
        assert_eq!(cache.get(key).as_deref(), Some(&b"a stream"[..]));
        cache.remove(key);
        assert_eq!(cache.get(key), None);
        drop(cache);
        assert!(!dir.exists(), "the folder goes with the cache");
    }

    /// Removed: a dead worker's cache, and one of this process's id it does not hold (an
    /// earlier life of the id). Kept: a running process's, the one this process holds, and
    /// what is not a cache.
    #[test]
    fn a_cache_left_by_a_dead_worker_is_removed_and_a_live_ones_kept() {
        let tmp = std::env::temp_dir().join(format!("em-cache-test-{}", std::process::id()));
        std::fs::create_dir_all(&tmp).unwrap();
        let me = std::process::id();
        // A process id no live process has (above the kernel's maximum).
        let dead = tmp.join(format!("{CACHE_PREFIX}4294967294-3"));
        let earlier = tmp.join(format!("{CACHE_PREFIX}{me}-3"));
        let running = tmp.join(format!(
            "{CACHE_PREFIX}{}-3",
            std::os::unix::process::parent_id()
        ));
        let held = tmp.join(format!("{CACHE_PREFIX}{me}-4"));
        let other = tmp.join("something-else");
        for d in [&dead, &earlier, &running, &held, &other] {
            std::fs::create_dir_all(d).unwrap();
        }
        let hold = expertmesh_files::lock_folder(&held).unwrap();
        remove_orphans(&tmp);
        assert!(!dead.exists() && !earlier.exists());
        assert!(running.exists() && held.exists() && other.exists());
        drop(hold);
        std::fs::remove_dir_all(&tmp).unwrap();
    }

    fn offset_of(frame: &OutFrame) -> (u64, usize, bool) {
        match &frame.body {
            Body::Placement(p) => (p.version, p.entries as usize, p.loaded == 1),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn an_owner_keeps_at_most_a_window_ahead_of_the_acknowledgements_and_gives_up_without_them() {
        let bytes: Vec<u8> = (0..9 * CHUNK_BYTES + 17).map(|i| i as u8).collect();
        let (ack, acked) = mpsc::sync_channel(64);
        // Acknowledge every chunk as it "arrives", checking the window before each.
        let mut sent: Vec<(u64, usize, bool)> = Vec::new();
        let mut got = 0u64;
        stream(&bytes, 7, &acked, Duration::from_secs(5), |frame| {
            let (at, len, last) = offset_of(&frame);
            assert!(
                at as usize + len <= got as usize + WINDOW_BYTES,
                "{at} past the window"
            );
            sent.push((at, len, last));
            // A stale stream's acknowledgement first, then this one's.
            ack.send((6, u64::MAX)).unwrap();
            got += len as u64;
            ack.send((7, got)).unwrap();
            Ok(())
        })
        .unwrap();
        assert_eq!(sent.len(), 10);
        assert_eq!(got as usize, bytes.len());
        assert!(sent.last().unwrap().2 && sent.iter().filter(|s| s.2).count() == 1);
        // No acknowledgements: the window's worth goes out, then the copy is abandoned.
        let (_keep, silent) = mpsc::sync_channel::<(u64, u64)>(1);
        let mut n = 0;
        let err = stream(&bytes, 8, &silent, Duration::from_millis(50), |_| {
            n += 1;
            Ok(())
        })
        .unwrap_err();
        assert_eq!(n, WINDOW_BYTES / CHUNK_BYTES);
        assert!(err.contains("acknowledged nothing"), "{err}");
        // Cancelled by the router after its first chunk (the gainer is gone): nothing more
        // goes out, and no wait for acknowledgements that will not come.
        let (ack, acked) = mpsc::sync_channel(64);
        let mut n = 0;
        let err = stream(&bytes, 9, &acked, Duration::from_secs(3600), |_| {
            n += 1;
            ack.send((9, COPY_CANCELLED)).unwrap();
            Ok(())
        })
        .unwrap_err();
        assert_eq!((n, err.as_str()), (1, CANCELLED));
    }
}
