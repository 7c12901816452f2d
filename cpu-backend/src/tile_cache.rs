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
//! magic "EMR16TC1" | u32 description length | description (UTF-8) | u64 arena bytes
//! | u32 chunk bytes | u32 crc32c of each chunk of the arena | u32 crc32c of all the above
//! | zeros up to the next 4096-byte boundary | the arena, exactly as the repack wrote it
//! ```
//!
//! Invariants:
//! * A file is used only when its description equals the load's byte for byte (the layout
//!   version, this crate's version, the source's content id, every expert's key and shape, the
//!   arena's size) and every chunk's crc32c matches: a stale, foreign, truncated or damaged
//!   file is a miss, never wrong weights.
//! * The folder must belong to this user and be writable by no one else (anyone who can write
//!   it chooses the weights); it is created 0700 and the files 0400.
//! * Files are written under a temporary name and renamed into place, never rewritten: a file
//!   that is mapped is never truncated by us (truncating a mapped file faults its readers).
//!   Other programs must not edit the files in place either; deleting them is safe.
//! * No failure of the cache fails a load: a miss repacks, a failed write is reported.
//!   Mapped tiles are pinned (`mlock`) where the memory lock limit allows; otherwise the kernel
//!   may evict them under memory pressure and read them back from the file (slower, still
//!   correct).

use crate::layout::{MatrixDims, R16Matrix, arena_bytes};
use std::fs::{self, File};
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
/// Longest description read from a file (a damaged length field must not allocate gigabytes).
const MAX_DESCRIPTION: usize = 64 << 20;

/// A folder of tile cache files ([`crate::CpuBackend::set_tile_cache`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TileCache {
    dir: PathBuf,
}

/// What one load did with the tile cache, for the caller to report.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TileCacheUse {
    /// No cache folder was set, or the last load used none.
    Unused,
    /// The source cannot name its content (in-memory experts), so nothing derived from it
    /// may be reused: repacked, nothing written.
    NoContentId,
    /// The tiles came from `file`, checked; `pinned`: locked in memory.
    Mapped {
        /// The cache file.
        file: PathBuf,
        /// Locked in memory (`mlock`); `false` where the lock limit was too small.
        pinned: bool,
    },
    /// Repacked (`miss` says why no file was used), then written to `file` for the next load.
    Written {
        /// The cache file written.
        file: PathBuf,
        /// Why no file was used.
        miss: String,
    },
    /// Repacked (`miss` says why no file was used); writing the cache failed (`error`).
    NotWritten {
        /// Why no file was used.
        miss: String,
        /// Why none could be written.
        error: String,
    },
}

/// Tiles mapped read-only from a checked cache file (the arena starts at a page boundary).
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
        Self { dir: dir.into() }
    }

    /// The cache folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The file that holds the arena `description` names.
    fn file_for(&self, description: &str) -> PathBuf {
        self.dir
            .join(format!("{:016x}.r16", fnv1a64(description.as_bytes())))
    }

    /// The matrices `dims` from the cache file `description` names, checked on `threads`
    /// threads. `Err`: why the file could not be used (a miss).
    pub(crate) fn open(
        &self,
        description: &str,
        dims: &[MatrixDims],
        threads: usize,
    ) -> Result<(Vec<R16Matrix>, PathBuf, bool), String> {
        if !self.dir.exists() {
            return Err(format!(
                "no cache file in {} yet (the folder is made on the first write)",
                self.dir.display()
            ));
        }
        check_private_folder(&self.dir, false)?;
        let path = self.file_for(description);
        let mut file = match File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(format!("no cache file {} yet", path.display()));
            }
            Err(e) => return Err(format!("cannot open {}: {e}", path.display())),
        };
        let fail = |what: String| format!("{}: {what}; it will be replaced", path.display());
        let want = arena_bytes(dims);
        let header = read_header(&mut file, description, want).map_err(fail)?;
        let len = file.metadata().map_err(|e| fail(e.to_string()))?.len();
        if len != (header.data_offset + want) as u64 {
            return Err(fail(format!(
                "holds {len} bytes, the arena needs {want} after a {}-byte header (truncated?)",
                header.data_offset
            )));
        }
        // SAFETY: the file is read through the map only; the cache's writers never modify a
        // file in place (temporary name, then rename), and the folder is private to this user.
        let map = unsafe { memmap2::Mmap::map(&file) }
            .map_err(|e| fail(format!("cannot map it: {e}")))?;
        // Locking faults every page in too (one pass over the page tables); without the lock
        // the checksums' reads fault them in.
        let pinned = map.lock().is_ok();
        let tiles = MappedTiles {
            map,
            data_offset: header.data_offset,
        };
        if let Some(bad) = first_bad_chunk(tiles.bytes(), &header.chunk_crcs, threads) {
            return Err(fail(format!(
                "chunk {bad} of its tiles does not match its checksum (damaged)"
            )));
        }
        let matrices = R16Matrix::over_arena(dims, Arc::new(crate::layout::Arena::Mapped(tiles)))
            .ok_or_else(|| fail("the arena does not fit the experts".into()))?;
        Ok((matrices, path, pinned))
    }

    /// Write `arena` as the file `description` names (temporary name, then rename).
    pub(crate) fn store(&self, description: &str, arena: &[u8]) -> Result<PathBuf, String> {
        check_private_folder(&self.dir, true)?;
        let path = self.file_for(description);
        let tmp = self.dir.join(format!(
            ".{}.tmp-{}-{}",
            path.file_name()
                .map_or_else(String::new, |n| n.to_string_lossy().into_owned()),
            std::process::id(),
            fnv1a64(format!("{:?}", std::time::SystemTime::now()).as_bytes()) & 0xffff_ffff
        ));
        let header = encode_header(description, arena);
        let written = (|| -> io::Result<()> {
            let mut f = create_read_only(&tmp)?;
            f.write_all(&header)?;
            f.write_all(arena)?;
            f.sync_data()?;
            fs::rename(&tmp, &path)
        })();
        if let Err(e) = written {
            let _ = fs::remove_file(&tmp);
            return Err(format!(
                "cannot write {} ({e}): the next load repacks again; free space or pick \
                 another folder",
                path.display()
            ));
        }
        Ok(path)
    }
}

/// The description a cache file must carry to hold the arena of `experts` (key and shape, in
/// load order) from the source named `content_id`.
pub(crate) fn description(
    content_id: &str,
    experts: &[expertmesh_backend::ExpertShape],
    dims: &[MatrixDims],
) -> String {
    use std::fmt::Write as _;
    let mut d = format!(
        "expertmesh R16 tile cache, layout {LAYOUT_VERSION}, expertmesh-cpu-backend {}\n\
         source: {content_id}\n",
        env!("CARGO_PKG_VERSION")
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

/// The header of `file`, which must carry `description` and an arena of `arena_bytes`.
fn read_header(file: &mut File, description: &str, arena_bytes: usize) -> Result<Header, String> {
    let mut fixed = [0u8; 12];
    read_exact(file, &mut fixed)?;
    if &fixed[..8] != MAGIC {
        return Err("not a tile cache file of this layout".into());
    }
    let dlen = u32::from_le_bytes(fixed[8..].try_into().expect("4 bytes")) as usize;
    if dlen != description.len() || dlen > MAX_DESCRIPTION {
        return Err("made for other experts, another conversion or another version".into());
    }
    let mut desc = vec![0u8; dlen + 12];
    read_exact(file, &mut desc)?;
    if &desc[..dlen] != description.as_bytes() {
        return Err("made for other experts, another conversion or another version".into());
    }
    // Checked before anything is sized by it: a damaged field must not allocate.
    let stated = u64::from_le_bytes(desc[dlen..dlen + 8].try_into().expect("8 bytes"));
    if stated != arena_bytes as u64 {
        return Err(format!(
            "its header states {stated} bytes of tiles, the experts need {arena_bytes} (damaged)"
        ));
    }
    let chunk = u32::from_le_bytes(desc[dlen + 8..].try_into().expect("4 bytes")) as usize;
    if chunk != CHUNK_BYTES {
        return Err(format!("chunks of {chunk} bytes, not {CHUNK_BYTES}"));
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

fn read_exact(file: &mut File, buf: &mut [u8]) -> Result<(), String> {
    file.read_exact(buf).map_err(|e| match e.kind() {
        io::ErrorKind::UnexpectedEof => "shorter than its header (truncated)".to_string(),
        _ => format!("cannot read it: {e}"),
    })
}

/// The first chunk of `arena` whose crc32c is not `crcs`' (checked on up to `threads`
/// threads), or `None`.
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
            .map(|t| s.spawn(move || check(t * per)))
            .collect();
        let mut bad = check(0);
        for h in helpers {
            let found = h.join().unwrap_or(Some(0));
            bad = match (bad, found) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
        }
        bad
    })
}

/// A new file only this user may read (never an existing one: `create_new`).
fn create_read_only(path: &Path) -> io::Result<File> {
    let mut o = fs::OpenOptions::new();
    o.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut o, 0o400);
    o.open(path)
}

/// `dir` must be a folder of this user that no one else can write; with `create`, a missing
/// one is made (mode 0700).
fn check_private_folder(dir: &Path, create: bool) -> Result<(), String> {
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
    check_owner(dir, &meta)
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
