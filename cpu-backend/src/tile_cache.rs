//! The tile cache: a device's repacked R16 arena kept in a file, so that loading the same
//! experts again maps the tiles instead of repacking them.
//!
//! Why this exists: a load that repacks writes every byte of the arena into memory the process
//! has never touched, and the kernel zeroes each fresh page before the repack writes it. On the
//! machines measured (BENCHMARKS.md) a plain copy into fresh memory runs at about half a mapped
//! read of the same bytes, so no repacking loader reaches a read's speed. A worker that restarts
//! (a crash, an upgrade, a rolling restart) loads the same shard again: with a cache folder it
//! maps the file the first load wrote, checks it, and serves from the page cache. The page
//! cache then holds the tiles once instead of the shard's pages plus a private arena.
//!
//! A cache file (little-endian):
//!
//! ```text
//! magic "EMR16TC1" | u32 description length | description (UTF-8) [+ "\nwriter: " host]
//! | u64 arena bytes
//! | u32 chunk bytes | u32 crc32c of each chunk of the arena | u32 crc32c of all the above
//! | zeros up to the next 4096-byte boundary | the arena, exactly as the repack wrote it
//! ```
//!
//! Invariants:
//! * A file is used only when its description equals the load's byte for byte (the layout
//!   version, a fingerprint of what this build's repack writes for a fixed set of matrices,
//!   the target's architecture and byte order, this crate's version, the source's content id,
//!   every expert's key and shape, the arena's size) and every chunk's crc32c matches: a
//!   stale, foreign, truncated or damaged file is a miss, never wrong weights.
//! * One file per place the source names (a shard's path): new content at that place (a
//!   re-conversion, an upgrade) replaces the old file instead of piling up beside it. A file
//!   whose place is an absolute path that no longer exists (a retired weights folder's shard)
//!   is removed by the cache's next write on the host that wrote it, so tiles of weights gone
//!   do not pile up either; a folder several hosts share (a home folder over NFS) keeps the
//!   files of shards that exist only on another host (each file names its writer's host after
//!   its description, a line the match leaves out: a file stays usable by every host).
//! * A miss replaces the place's file; its stale file is removed before the new one is
//!   written (a disk it filled is not full for its replacement) only when it was read and found
//!   unfit, never after a miss that could not read it (too many open files, an I/O error):
//!   then a write that fails too leaves a good file where it was.
//! * The folder must belong to this user and be writable by no one else (anyone who can write
//!   it chooses the weights), and its parent must not let others replace it (writable by
//!   others only with the sticky bit, as `/tmp`); it is created 0700 and the files 0400.
//! * Files are written under a temporary name and renamed into place, never rewritten: a file
//!   that is mapped is never truncated by us (truncating a mapped file faults its readers).
//!   Other programs must not edit the files in place either; deleting them is safe.
//! * Served tiles are pinned: the mapped file is locked in memory (`mlock`), or, where the
//!   memory lock limit does not allow it, copied into the process's own memory (as a repack
//!   would place it, about half a read's speed) and the map dropped. Either way the checksums
//!   are checked over the very bytes served, which the kernel cannot evict and read back.
//! * No failure of the cache fails a load: a miss repacks, a failed write is reported. The
//!   write runs on a thread of its own after the load (the worker serves meanwhile); a process
//!   that ends before it does leaves a temporary file, which the next write removes.

use crate::layout::{Arena, MatrixDims, R16Matrix, arena_bytes};
use expertmesh_quant::aligned::AlignedVec;
use std::fs;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// First bytes of every cache file.
const MAGIC: &[u8; 8] = b"EMR16TC1";
/// Version of the R16 layout and of this file format; a change makes every old file a miss.
const LAYOUT_VERSION: u32 = 1;
/// Bytes of arena per checksum (checked in parallel).
const CHUNK_BYTES: usize = 4 << 20;
/// Where the arena starts: a page boundary, so a map of it is 64-byte aligned.
const DATA_ALIGN: usize = 4096;

/// A folder of tile cache files ([`crate::CpuBackend::set_tile_cache`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TileCache {
    dir: PathBuf,
    /// Lock a mapped file in memory when the limit allows (tests turn it off to take the copy).
    lock: bool,
    /// The host named as the writer of the files this cache writes (this host's name); only
    /// its own files are removed as retired.
    writer: String,
}

/// Why a load found no usable cache file ([`TileCache::open`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Miss {
    /// What was found, for the load's report.
    pub(crate) why: String,
    /// The place's file was read and cannot serve this load (stale, damaged, foreign, not a
    /// regular file): the write that follows may remove it first. `false` when there is none
    /// or it could not be read (the miss may have been transient and the file good).
    pub(crate) unfit: bool,
}

/// The longest writer name kept in a file (a host name is at most 64 bytes on Linux).
const MAX_WRITER: usize = 255;

/// What one load did with the tile cache, for the caller to report.
#[derive(Clone, Debug, PartialEq)]
pub enum TileCacheUse {
    /// No cache folder was set, or the last load used none.
    Unused,
    /// The source cannot name its content (in-memory experts), so nothing derived from it
    /// may be reused: repacked, nothing written.
    NoContentId,
    /// The tiles came from `file`, checked.
    Reused {
        /// The cache file.
        file: PathBuf,
        /// `None`: served from the file's map, locked in memory. Otherwise why the map could
        /// not be locked (usually a memory lock limit too small): the tiles were copied into
        /// the process's own memory instead.
        lock_error: Option<String>,
    },
    /// Repacked (`miss` says why no file was used); `file` is being written for the next load
    /// on a thread of its own, so the load does not wait for the disk
    /// ([`crate::CpuBackend::take_tile_cache_writer`] gives its outcome, `Written` or
    /// `NotWritten`).
    Writing {
        /// The cache file being written.
        file: PathBuf,
        /// Why no file was used.
        miss: String,
    },
    /// Repacked (`miss` says why no file was used), then written to `file` for the next load
    /// in `write_s` seconds.
    Written {
        /// The cache file written.
        file: PathBuf,
        /// Why no file was used.
        miss: String,
        /// Seconds spent writing it.
        write_s: f64,
    },
    /// Repacked (`miss` says why no file was used); writing the cache failed (`error`).
    NotWritten {
        /// Why no file was used.
        miss: String,
        /// Why none could be written.
        error: String,
    },
}

impl TileCacheUse {
    /// Every [`TileCacheUse::outcome`] name, in the variants' order.
    pub const OUTCOMES: [&'static str; 7] = [
        "unused",
        "no_content_id",
        "reused",
        "reused_copied",
        "writing",
        "written",
        "not_written",
    ];

    /// A stable name for what the load did (for metrics labels): one of [`Self::OUTCOMES`];
    /// `reused_copied` is a reuse whose map could not be locked (the tiles were copied).
    pub fn outcome(&self) -> &'static str {
        Self::OUTCOMES[self.outcome_index()]
    }

    /// The index of [`Self::outcome`] in [`Self::OUTCOMES`].
    pub fn outcome_index(&self) -> usize {
        match self {
            TileCacheUse::Unused => 0,
            TileCacheUse::NoContentId => 1,
            TileCacheUse::Reused {
                lock_error: None, ..
            } => 2,
            TileCacheUse::Reused {
                lock_error: Some(_),
                ..
            } => 3,
            TileCacheUse::Writing { .. } => 4,
            TileCacheUse::Written { .. } => 5,
            TileCacheUse::NotWritten { .. } => 6,
        }
    }
}

/// Tiles mapped read-only from a cache file and locked in memory (the arena starts at a page
/// boundary).
pub struct MappedTiles {
    map: memmap2::Mmap,
    data_offset: usize,
}

impl MappedTiles {
    /// The arena's bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.map[self.data_offset..]
    }
}

impl TileCache {
    /// A cache in `dir` (created 0700 on first write).
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            lock: true,
            writer: writer_name(&host_name()),
        }
    }

    /// For tests: name `host` as the writer of the files this cache writes (as if it ran on
    /// that host).
    #[doc(hidden)]
    pub fn with_writer(mut self, host: &str) -> Self {
        self.writer = writer_name(host);
        self
    }

    /// For tests: never lock a mapped file, so kept tiles are copied into owned memory (what
    /// happens where the memory lock limit is too small; a test running as root cannot make
    /// `mlock` fail).
    #[doc(hidden)]
    pub fn without_lock(mut self) -> Self {
        self.lock = false;
        self
    }

    /// The cache folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The file that holds the arena of whatever lives at `place`.
    pub(crate) fn file_for(&self, place: &str) -> PathBuf {
        self.dir
            .join(format!("{:016x}.r16", fnv1a64(place.as_bytes())))
    }

    /// The matrices `dims` from the cache file of `place`, which must carry `description`,
    /// checked on `threads` threads, with why the file's map could not be locked (then the
    /// tiles were copied into owned memory). `Err`: why the file could not be used (a miss).
    pub(crate) fn open(
        &self,
        place: &str,
        description: &str,
        dims: &[MatrixDims],
        threads: usize,
    ) -> Result<(Vec<R16Matrix>, PathBuf, Option<String>), Miss> {
        let unread = |why: String| Miss { why, unfit: false };
        if !self.dir.exists() {
            return Err(unread(format!(
                "no cache file in {} yet (the folder is made on the first write)",
                self.dir.display()
            )));
        }
        check_private_folder(&self.dir, false).map_err(unread)?;
        let path = self.file_for(place);
        // The place's file was read and found unfit (`unfit`), or could not be read.
        let miss = |unfit: bool, what: String| Miss {
            why: format!("{}: {what}; it will be replaced", path.display()),
            unfit,
        };
        let fail = |what: String| miss(true, what);
        let unreadable = |what: String| miss(false, what);
        // Without blocking: a FIFO put there would wait for a writer for ever.
        let mut file = match expertmesh_files::open_nonblocking(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(unread(format!("no cache file {} yet", path.display())));
            }
            Err(e) => return Err(unreadable(format!("cannot open it: {e}"))),
        };
        if !file.metadata().is_ok_and(|m| m.is_file()) {
            return Err(fail("not a regular file".into()));
        }
        let want = arena_bytes(dims);
        let header = read_header(&mut file, description, want).map_err(|e| match e {
            HeaderError::Unfit(what) => fail(what),
            HeaderError::Io(what) => unreadable(what),
        })?;
        let len = file
            .metadata()
            .map_err(|e| unreadable(e.to_string()))?
            .len();
        if len != (header.data_offset + want) as u64 {
            return Err(fail(format!(
                "holds {len} bytes, the arena needs {want} after a {}-byte header (truncated?)",
                header.data_offset
            )));
        }
        // SAFETY: the file is read through the map only; the cache's writers never modify a
        // file in place (temporary name, then rename), and the folder is private to this user.
        let map = unsafe { memmap2::Mmap::map(&file) }
            .map_err(|e| unreadable(format!("cannot map it: {e}")))?;
        // Locking faults every page in too (one pass over the page tables). Without the lock
        // the kernel could evict pages and read them back unchecked: copy instead.
        let lock = if self.lock {
            map.lock().map_err(|e| e.to_string())
        } else {
            Err("not asked to lock".to_string())
        };
        let arena = match &lock {
            Ok(()) => Arena::Mapped(MappedTiles {
                map,
                data_offset: header.data_offset,
            }),
            Err(_) => {
                // Read, not copied from the map: a page that cannot be read (a bad block, a
                // file gone from a network mount) is an error here, where through the map it
                // is SIGBUS, and the worker would die on it at every start.
                drop(map);
                let mut owned = AlignedVec::<u8>::zeroed(want);
                io::Seek::seek(&mut file, io::SeekFrom::Start(header.data_offset as u64))
                    .and_then(|_| file.read_exact(&mut owned))
                    .map_err(|e| unreadable(format!("cannot read its tiles: {e}")))?;
                Arena::Owned(owned)
            }
        };
        if let Some(bad) = first_bad_chunk(&arena, &header.chunk_crcs, threads) {
            return Err(fail(format!(
                "chunk {bad} of its tiles does not match its checksum (damaged)"
            )));
        }
        let matrices = R16Matrix::over_arena(dims, Arc::new(arena))
            .ok_or_else(|| fail("the arena does not fit the experts".into()))?;
        Ok((matrices, path, lock.err()))
    }

    /// Write `arena` as the file of `place`, carrying `description` (temporary name, then
    /// rename over the place's previous file), after the load's `miss`. Not synced: a file
    /// torn by a crash fails its checksums and is replaced.
    pub(crate) fn store(
        &self,
        place: &str,
        description: &str,
        arena: &[u8],
        miss: &Miss,
    ) -> Result<PathBuf, String> {
        check_private_folder(&self.dir, true)?;
        remove_stale_temps(&self.dir);
        let path = self.file_for(place);
        if miss.unfit {
            // The place's file was read and cannot serve: removed first, so a disk it fills is
            // not full for its replacement (a process that mapped it keeps it). A file the
            // miss could not read may be good: only the rename below replaces it.
            let _ = fs::remove_file(&path);
        }
        let tmp = expertmesh_files::temp_path(&path);
        let header = encode_header(&with_writer(description, &self.writer), arena);
        // A new file only this user may read, locked until it is renamed (the lock goes with
        // the handle): a sweep leaves it alone. One that could not be made is not ours.
        let mut f = expertmesh_files::create_locked(&tmp, Some(0o400)).map_err(|e| {
            format!(
                "cannot create {} ({e}): the next load repacks again; free space, make the \
                 folder writable or pick another",
                tmp.display()
            )
        })?;
        let written = (|| -> io::Result<()> {
            f.write_all(&header)?;
            f.write_all(arena)?;
            fs::rename(&tmp, &path)
        })();
        drop(f);
        if let Err(e) = written {
            let _ = fs::remove_file(&tmp);
            return Err(format!(
                "cannot write {} ({e}): the next load repacks again; free space, make the \
                 folder writable or pick another",
                path.display()
            ));
        }
        self.remove_retired(&path);
        Ok(path)
    }

    /// Removes the cache files (other than `keep`) whose place is an absolute path that no
    /// longer exists: the shard they were repacked from is gone (its weights folder retired),
    /// so nothing will ask for them again. Only names this cache makes, whose name is the
    /// hash of the place their header states, written by this host (or by a version that did
    /// not name its writer): in a folder several hosts share, a place absent here may be
    /// another host's live shard. A place that cannot be looked at (a network mount away, no
    /// permission) is left alone. Removing a file a process has mapped is safe. Best effort.
    fn remove_retired(&self, keep: &Path) {
        let Ok(entries) = fs::read_dir(&self.dir) else {
            return;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let ours = entry.file_name().to_str().is_some_and(|n| {
                n.strip_suffix(".r16")
                    .is_some_and(|h| h.len() == 16 && h.bytes().all(|b| b.is_ascii_hexdigit()))
            });
            if !ours || path == keep {
                continue;
            }
            let Some((place, writer)) = expertmesh_files::open_nonblocking(&path)
                .ok()
                .filter(|f| f.metadata().is_ok_and(|m| m.is_file()))
                .and_then(|mut f| stated_place(&mut f))
            else {
                continue;
            };
            let gone = writer.is_none_or(|w| w == self.writer)
                && Path::new(&place).is_absolute()
                && self.file_for(&place) == path
                && matches!(fs::symlink_metadata(&place), Err(e) if e.kind() == io::ErrorKind::NotFound);
            if gone {
                let _ = fs::remove_file(&path);
            }
        }
    }
}

/// The place a cache file's header states (its description's `place:` line) and the host it
/// names as its writer (`None` in files of versions that named none), when the file starts
/// like one of this layout.
fn stated_place(file: &mut impl Read) -> Option<(String, Option<String>)> {
    let mut fixed = [0u8; 12];
    file.read_exact(&mut fixed).ok()?;
    if &fixed[..8] != MAGIC {
        return None;
    }
    let dlen = u32::from_le_bytes(fixed[8..].try_into().expect("4 bytes")) as usize;
    // Descriptions are a few lines per expert: a damaged length must not allocate much.
    if dlen > 16 << 20 {
        return None;
    }
    let mut desc = vec![0u8; dlen];
    file.read_exact(&mut desc).ok()?;
    let text = std::str::from_utf8(&desc).ok()?;
    let place = text.lines().find_map(|l| l.strip_prefix("place: "))?;
    let writer = text
        .rsplit_once("\nwriter: ")
        .map(|(_, w)| w)
        .filter(|w| !w.contains('\n'));
    Some((place.to_owned(), writer.map(str::to_owned)))
}

/// What a file written by `writer` (a [`writer_name`]) carries: `description`, then the
/// writer line (which the match leaves out: [`carries`]).
fn with_writer(description: &str, writer: &str) -> String {
    format!("{description}\nwriter: {writer}")
}

/// This host's name (`gethostname`; empty where it cannot be read).
fn host_name() -> String {
    #[cfg(unix)]
    {
        let mut buf = [0u8; 256];
        // SAFETY: gethostname writes at most `buf.len()` bytes into the buffer we own.
        if unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } == 0 {
            let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
            return String::from_utf8_lossy(&buf[..end]).into_owned();
        }
    }
    String::new()
}

/// `host` as a writer line may carry it: one line, control characters replaced, at most
/// [`MAX_WRITER`] bytes; "unnamed" when empty.
fn writer_name(host: &str) -> String {
    let mut w = String::new();
    for c in host.trim().chars() {
        let c = if c.is_control() { '?' } else { c };
        if w.len() + c.len_utf8() > MAX_WRITER {
            break;
        }
        w.push(c);
    }
    if w.is_empty() { "unnamed".into() } else { w }
}

/// The description a cache file must carry to hold the arena of `experts` (key and shape, in
/// load order) from the source `content` (its place, and what its content is there).
pub(crate) fn description(
    content: &expertmesh_backend::ContentId,
    experts: &[expertmesh_backend::ExpertShape],
    dims: &[MatrixDims],
) -> String {
    use std::fmt::Write as _;
    let mut d = format!(
        "expertmesh R16 tile cache, layout {LAYOUT_VERSION} (repack fingerprint {:016x}), \
         {} {}-endian, expertmesh-cpu-backend {}\nplace: {}\nsource: {}\n",
        repack_fingerprint(),
        std::env::consts::ARCH,
        if cfg!(target_endian = "little") {
            "little"
        } else {
            "big"
        },
        env!("CARGO_PKG_VERSION"),
        content.place,
        content.id
    );
    for s in experts {
        let _ = writeln!(
            d,
            "expert {}: hidden {}, inter {}, {:?}",
            s.key, s.hidden, s.inter, s.quant
        );
    }
    let _ = write!(d, "arena bytes {}", arena_bytes(dims));
    d
}

/// A hash of the arena this build's repack writes for a fixed set of experts (every group
/// size, both scale types, with and without zero points): a change to the R16 layout or to
/// how it is written makes every file an older build kept a miss, whether or not anyone
/// remembered to raise [`LAYOUT_VERSION`]. Computed once per process (a few hundred KiB).
fn repack_fingerprint() -> u64 {
    static FINGERPRINT: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *FINGERPRINT.get_or_init(|| {
        use expertmesh_quant::format::{QuantSpec, ScaleDtype};
        let mut experts = Vec::new();
        for (i, (group_size, scale_dtype, zero_points)) in [
            (32, ScaleDtype::Bf16, false),
            (32, ScaleDtype::F16, true),
            (64, ScaleDtype::F16, false),
            (128, ScaleDtype::Bf16, true),
        ]
        .into_iter()
        .enumerate()
        {
            let spec = QuantSpec {
                group_size,
                scale_dtype,
                zero_points,
            };
            let w = expertmesh_quant::synth::synthetic_expert(spec, 256, 128, 7, 0, i as u32)
                .expect("a valid synthetic expert");
            experts.push(w.into_parts());
        }
        let ms: Vec<&expertmesh_quant::format::PackedMatrix> =
            experts.iter().flat_map(|(a, b)| [a, b]).collect();
        let owned = R16Matrix::pack_all(&ms);
        // A worker repacks views of its mapped shard (`PackedRef` over little-endian arrays):
        // that path's reads go into the fingerprint too.
        let scales: Vec<Vec<u8>> = ms
            .iter()
            .map(|m| m.scales().iter().flat_map(|v| v.to_le_bytes()).collect())
            .collect();
        let views: Vec<expertmesh_quant::format::PackedRef<'_>> = ms
            .iter()
            .zip(&scales)
            .map(|(m, sc)| {
                expertmesh_quant::format::PackedRef::new(
                    "fingerprint",
                    m.spec(),
                    m.rows(),
                    m.cols(),
                    m.nibbles(),
                    sc,
                    m.zeros(),
                )
                .expect("the views of valid matrices")
            })
            .collect();
        let dims: Vec<MatrixDims> = ms.iter().map(|m| (m.rows(), m.cols(), m.spec())).collect();
        let viewed: Result<_, std::convert::Infallible> =
            R16Matrix::pack_streamed(&dims, |i, write| {
                write(&views[i]);
                Ok(())
            });
        let viewed = match viewed {
            Ok(v) => v,
            Err(e) => match e {},
        };
        let hash = |packed: &[R16Matrix]| packed.first().map_or(0, |m| fnv1a64(&m.arena()[..]));
        hash(&owned) ^ hash(&viewed).rotate_left(1)
    })
}

/// What a file's header says, once its description and arena size matched.
struct Header {
    chunk_crcs: Vec<u32>,
    data_offset: usize,
}

fn encode_header(description: &str, arena: &[u8]) -> Vec<u8> {
    let mut h = Vec::with_capacity(64 + description.len());
    h.extend_from_slice(MAGIC);
    h.extend_from_slice(&(description.len() as u32).to_le_bytes());
    h.extend_from_slice(description.as_bytes());
    h.extend_from_slice(&(arena.len() as u64).to_le_bytes());
    h.extend_from_slice(&(CHUNK_BYTES as u32).to_le_bytes());
    for c in arena.chunks(CHUNK_BYTES) {
        h.extend_from_slice(&crc32c::crc32c(c).to_le_bytes());
    }
    let crc = crc32c::crc32c(&h);
    h.extend_from_slice(&crc.to_le_bytes());
    h.resize(h.len().next_multiple_of(DATA_ALIGN), 0);
    h
}

/// For the fuzz target: checks `file`, a whole cache file's bytes, as a load does against
/// `description` and an arena of `arena_bytes` (header, size, every chunk's checksum); the
/// arena's offset in it when all pass, else why not. Never panics; allocates nothing sized by
/// a field of the file.
#[doc(hidden)]
pub fn check_file_bytes(
    file: &[u8],
    description: &str,
    arena_bytes: usize,
) -> Result<usize, String> {
    let header = read_header(&mut io::Cursor::new(file), description, arena_bytes)
        .map_err(HeaderError::into_message)?;
    if file.len() != header.data_offset + arena_bytes {
        return Err(format!(
            "holds {} bytes, the arena needs {arena_bytes} after a {}-byte header (truncated?)",
            file.len(),
            header.data_offset
        ));
    }
    match first_bad_chunk(&file[header.data_offset..], &header.chunk_crcs, 1) {
        Some(bad) => Err(format!(
            "chunk {bad} of its tiles does not match its checksum"
        )),
        None => Ok(header.data_offset),
    }
}

/// For the fuzz target: the whole cache file that keeps `arena` under `description`, as a
/// version that named no writer wrote it.
#[doc(hidden)]
pub fn file_bytes(description: &str, arena: &[u8]) -> Vec<u8> {
    let mut f = encode_header(description, arena);
    f.extend_from_slice(arena);
    f
}

/// For the fuzz target: the whole cache file host `writer` (any text: made a writer name as
/// a cache does) writes for `arena` under `description`.
#[doc(hidden)]
pub fn file_bytes_by(description: &str, writer: &str, arena: &[u8]) -> Vec<u8> {
    file_bytes(&with_writer(description, &writer_name(writer)), arena)
}

/// Why a file's header was refused: what it holds (the file cannot serve) or an error
/// reading it (it might).
#[derive(Debug)]
enum HeaderError {
    Unfit(String),
    Io(String),
}

impl HeaderError {
    fn into_message(self) -> String {
        match self {
            HeaderError::Unfit(m) | HeaderError::Io(m) => m,
        }
    }
}

impl From<&str> for HeaderError {
    fn from(what: &str) -> Self {
        HeaderError::Unfit(what.into())
    }
}

/// Whether `stored`, a file's description, is `description` with at most a writer line after
/// it (which the match leaves out: a file any host wrote serves every host).
fn carries(stored: &[u8], description: &str) -> bool {
    stored
        .strip_prefix(description.as_bytes())
        .is_some_and(|rest| {
            rest.is_empty()
                || rest
                    .strip_prefix(b"\nwriter: ")
                    .is_some_and(|w| w.len() <= MAX_WRITER && !w.contains(&b'\n'))
        })
}

/// The header of `file`, which must carry `description` (and perhaps a writer line) and an
/// arena of `arena_bytes`.
fn read_header(
    file: &mut impl Read,
    description: &str,
    arena_bytes: usize,
) -> Result<Header, HeaderError> {
    const OTHER: &str = "made for other experts, another conversion or another version";
    let mut fixed = [0u8; 12];
    read_exact(file, &mut fixed)?;
    if &fixed[..8] != MAGIC {
        return Err("not a tile cache file of this layout".into());
    }
    let dlen = u32::from_le_bytes(fixed[8..].try_into().expect("4 bytes")) as usize;
    // Checked before anything is sized by it.
    if dlen < description.len() || dlen > description.len() + "\nwriter: ".len() + MAX_WRITER {
        return Err(OTHER.into());
    }
    let mut desc = vec![0u8; dlen + 12];
    read_exact(file, &mut desc)?;
    if !carries(&desc[..dlen], description) {
        return Err(OTHER.into());
    }
    // Checked before anything is sized by it: a damaged field must not allocate.
    let stated = u64::from_le_bytes(desc[dlen..dlen + 8].try_into().expect("8 bytes"));
    if stated != arena_bytes as u64 {
        return Err(HeaderError::Unfit(format!(
            "its header states {stated} bytes of tiles, the experts need {arena_bytes} (damaged)"
        )));
    }
    let chunk = u32::from_le_bytes(desc[dlen + 8..].try_into().expect("4 bytes")) as usize;
    if chunk != CHUNK_BYTES {
        return Err(HeaderError::Unfit(format!(
            "chunks of {chunk} bytes, not {CHUNK_BYTES}"
        )));
    }
    let chunks = arena_bytes.div_ceil(CHUNK_BYTES);
    let mut tail = vec![0u8; (chunks + 1) * 4];
    read_exact(file, &mut tail)?;
    let (crcs, stored) = tail.split_at(chunks * 4);
    let mut crc = crc32c::crc32c(&fixed);
    crc = crc32c::crc32c_append(crc, &desc);
    crc = crc32c::crc32c_append(crc, crcs);
    if crc.to_le_bytes() != stored {
        return Err("its header does not match its checksum (damaged)".into());
    }
    let header_len = 12 + desc.len() + tail.len();
    Ok(Header {
        chunk_crcs: crcs
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
            .collect(),
        data_offset: header_len.next_multiple_of(DATA_ALIGN),
    })
}

fn read_exact(file: &mut impl Read, buf: &mut [u8]) -> Result<(), HeaderError> {
    file.read_exact(buf).map_err(|e| match e.kind() {
        io::ErrorKind::UnexpectedEof => "shorter than its header (truncated)".into(),
        _ => HeaderError::Io(format!("cannot read it: {e}")),
    })
}

/// The first chunk of `arena` whose crc32c is not `crcs`' (checked on up to `threads`
/// threads; where a thread cannot be started, its share is checked here), or `None`.
fn first_bad_chunk(arena: &[u8], crcs: &[u32], threads: usize) -> Option<usize> {
    let chunks: Vec<&[u8]> = arena.chunks(CHUNK_BYTES).collect();
    if chunks.len() != crcs.len() {
        return Some(chunks.len().min(crcs.len()));
    }
    let threads = threads.clamp(1, chunks.len().max(1));
    let per = chunks.len().div_ceil(threads).max(1);
    let check = |first: usize| {
        (first..(first + per).min(chunks.len())).find(|&i| crc32c::crc32c(chunks[i]) != crcs[i])
    };
    std::thread::scope(|s| {
        let helpers: Vec<_> = (1..threads)
            .map(|t| {
                std::thread::Builder::new()
                    .spawn_scoped(s, move || check(t * per))
                    .map_err(|_| t)
            })
            .collect();
        let mut bad = check(0);
        for h in helpers {
            let found = match h {
                Ok(h) => h.join().unwrap_or(Some(0)),
                Err(t) => check(t * per),
            };
            bad = match (bad, found) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
        }
        bad
    })
}

/// Removes the temporary files of writers that are gone from the (private, checked) cache
/// folder `dir`: only names this module makes (`.HASH.r16.tmp-PID-N`, HASH 16 hex digits),
/// that no writer holds locked and whose process no longer runs on this host, or that carry
/// this process's id but that it is not writing (left by an earlier life of a container's
/// process 1); see [`expertmesh_files`]. Best effort.
fn remove_stale_temps(dir: &Path) {
    expertmesh_files::remove_left_by_gone_processes(dir, temp_owner);
}

/// The process id in a temporary file's name `.HASH.r16.tmp-PID-N-R` (HASH 16 hex digits; R
/// random hex, absent in files of earlier versions).
fn temp_owner(name: &str) -> Option<u32> {
    let rest = name.strip_prefix('.')?;
    let (hash, rest) = rest.split_once(".r16.tmp-")?;
    if hash.len() != 16 || !hash.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    // PID-N (earlier versions) or PID-N-R ([`expertmesh_files::temp_path`]: R random hex).
    let mut parts = rest.split('-');
    let pid = parts.next()?;
    let n = parts.next()?;
    let r = parts.next();
    let fine = !n.is_empty()
        && n.bytes().all(|b| b.is_ascii_digit())
        && r.is_none_or(|r| !r.is_empty() && r.bytes().all(|b| b.is_ascii_hexdigit()))
        && parts.next().is_none();
    fine.then_some(())?;
    pid.parse().ok()
}

/// `dir` must be a folder of this user that no one else can write; with `create`, a missing
/// one is made (mode 0700).
fn check_private_folder(dir: &Path, create: bool) -> Result<(), String> {
    // `tiles/` would follow a link where `tiles` does not; `.`, `..` and `/` have no parent
    // to check.
    let text = dir.to_string_lossy();
    let trimmed = text.trim_end_matches('/');
    let last = trimmed.rsplit('/').next().unwrap_or_default();
    if last.is_empty() || last == "." || last == ".." {
        return Err(format!(
            "tile cache folder {}: name a folder of its own (not `.`, `..` or `/`)",
            dir.display()
        ));
    }
    let dir = Path::new(trimmed);
    if create && !dir.exists() {
        let mut b = fs::DirBuilder::new();
        b.recursive(true);
        #[cfg(unix)]
        std::os::unix::fs::DirBuilderExt::mode(&mut b, 0o700);
        b.create(dir)
            .map_err(|e| format!("cannot create the tile cache folder {}: {e}", dir.display()))?;
    }
    let meta = fs::symlink_metadata(dir)
        .map_err(|e| format!("tile cache folder {}: {e}", dir.display()))?;
    if !meta.is_dir() {
        return Err(format!(
            "tile cache folder {} is not a folder (a link or a file)",
            dir.display()
        ));
    }
    check_owner(dir, &meta)?;
    check_parent(dir)
}

/// Others must not be able to replace `dir`: its parent is writable only by its owner, or
/// has the sticky bit (as `/tmp`: there only an entry's owner may rename or remove it).
#[cfg(target_os = "linux")]
fn check_parent(dir: &Path) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    let parent = match dir.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => std::env::current_dir().map_err(|e| format!("the current folder: {e}"))?,
    };
    let meta = fs::metadata(&parent)
        .map_err(|e| format!("the tile cache folder's parent {}: {e}", parent.display()))?;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    let writable_by_others = meta.mode() & 0o022 != 0 && meta.mode() & 0o1000 == 0;
    if writable_by_others || (meta.uid() != me && meta.uid() != 0) {
        return Err(format!(
            "tile cache folder {}: its parent {} (owner uid {}, mode {:o}) lets others replace \
             the folder; it must belong to uid {me} or root and be writable by no one else \
             unless sticky (as /tmp): pick a folder under a private parent",
            dir.display(),
            parent.display(),
            meta.uid(),
            meta.mode() & 0o7777
        ));
    }
    Ok(())
}

/// Elsewhere nothing is checked ([`check_owner`] refuses the cache first).
#[cfg(not(target_os = "linux"))]
fn check_parent(_dir: &Path) -> Result<(), String> {
    Ok(())
}

/// The folder `dir` (`meta`) belongs to this user and no one else can write it.
#[cfg(target_os = "linux")]
fn check_owner(dir: &Path, meta: &fs::Metadata) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    if meta.uid() != me || meta.mode() & 0o022 != 0 {
        return Err(format!(
            "tile cache folder {} is not private (owner uid {}, mode {:o}; it must belong to \
             uid {me} and be writable by no one else: anyone who can write it chooses the \
             weights): `chmod 700` it or pick another folder",
            dir.display(),
            meta.uid(),
            meta.mode() & 0o7777
        ));
    }
    Ok(())
}

/// Elsewhere the owner cannot be checked the same way: no cache.
#[cfg(not(target_os = "linux"))]
fn check_owner(_dir: &Path, _meta: &fs::Metadata) -> Result<(), String> {
    Err("the tile cache is implemented on Linux only".into())
}

/// FNV-1a, 64 bits: a file name for a description (the description itself is compared).
fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A miss names whether the place's file was read and found unfit (the write may remove
    /// it first) or could not be read (it may be good: only a finished write replaces it).
    #[test]
    fn a_miss_says_whether_the_file_was_read_and_found_unfit() {
        let tmp = tempfile::tempdir().unwrap();
        let cache = TileCache::new(tmp.path().join("tiles"));
        // The checks that fail come before the experts' sizes matter.
        let open = |place: &str| cache.open(place, "d", &[], 1).map(|_| ()).unwrap_err();
        // No folder, then no file: nothing to remove.
        assert!(!open("a").unfit);
        check_private_folder(cache.dir(), true).unwrap();
        assert!(!open("a").unfit);
        // A file that cannot be opened (a symbolic link to itself: ELOOP, as root too).
        std::os::unix::fs::symlink(cache.file_for("a"), cache.file_for("a")).unwrap();
        let m = open("a");
        assert!(!m.unfit && m.why.contains("cannot open it"), "{m:?}");
        // Files read and found unfit: not a cache file, another description, not regular.
        fs::write(cache.file_for("b"), b"not a cache file at all").unwrap();
        assert!(open("b").unfit);
        fs::write(cache.file_for("c"), file_bytes("other", &[0u8; 64])).unwrap();
        let m = open("c");
        assert!(m.unfit && m.why.contains("other experts"), "{m:?}");
        fs::create_dir(cache.file_for("d")).unwrap();
        assert!(open("d").unfit);
    }

    /// A file's writer line is left out of the match (any host's file serves every host) and
    /// bounded; what follows the description must be exactly one such line.
    #[test]
    fn the_match_leaves_out_one_writer_line_and_nothing_else() {
        assert!(carries(b"desc", "desc"));
        assert!(carries(b"desc\nwriter: host-a", "desc"));
        assert!(carries(b"desc\nwriter: ", "desc"));
        assert!(!carries(b"desc\nwriter: a\nb", "desc"));
        assert!(!carries(b"desc\nplace: x", "desc"));
        assert!(!carries(b"desc ", "desc"));
        assert!(!carries(b"des", "desc"));
        let long = format!("desc\nwriter: {}", "h".repeat(MAX_WRITER + 1));
        assert!(!carries(long.as_bytes(), "desc"));
        assert_eq!(writer_name(" h1\n"), "h1");
        assert_eq!(writer_name("a\tb"), "a?b");
        assert_eq!(writer_name(""), "unnamed");
        assert_eq!(writer_name(&"é".repeat(200)).len(), 254);
    }
}
