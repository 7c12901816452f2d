//! Temporary files and folders held under a lock while their process lives, and the sweep
//! that removes what killed processes left behind.
//!
//! Why this exists: a file that must appear whole (a shard, a manifest, a tile cache file) is
//! written under a temporary name and renamed into place, and a worker or a demo keeps a
//! scratch folder. A process ended by SIGKILL, Ctrl-C or the OOM killer renames and removes
//! nothing, and a temporary shard is as large as the shard, so whoever comes next removes
//! what was left. It must never remove what a live process is still writing.
//!
//! An entry is removed only when every test says its writer is gone:
//!
//! * **The lock.** A writer holds an exclusive `flock` on its temporary file
//!   ([`create_locked`]) or its folder ([`lock_folder`], [`make_locked_folder`]) for as long
//!   as it uses it ([`Held`]); the kernel drops the lock when the process ends, however it
//!   ends. The sweep removes an entry only after taking that lock itself. This holds across
//!   PID namespaces (containers sharing a folder), where process ids say nothing.
//! * **The process id in the name** (`.NAME.tmp-PID-N-R`, `PREFIX<PID>-...`): no process of that
//!   id runs here (`/proc`). This keeps the files of a live writer that takes no lock (an
//!   older version).
//! * **This process's own entries** (its own id in the name) are judged first by the list of
//!   what it holds now, then by the lock (a second open of a file by the same process can
//!   take the lock where `flock` is emulated by process-wide locks, as on NFS): what it does
//!   not hold and nobody has locked was left by an earlier life of the same id (a
//!   container's process 1 restarted).
//!
//! Where there is no `/proc`, or an entry cannot be opened (another user's file), nothing is
//! removed; entries that are not files, folders or links (a FIFO someone put there) are left
//! alone and never opened. On a file system that refuses `flock` writers go on unlocked and
//! the sweep goes by the process id alone.
//!
//! Between a writer's `open` and its `flock` a sweeper in another PID namespace, where the
//! writer's id runs nothing, can take the new entry's lock and remove it. The writer then
//! waits for that lock (a sweeper holds it only while it removes; at most 10 s), and when its
//! path no longer names what it made, makes it again ([`create_locked`],
//! [`make_locked_folder`]).
//! Within one process there is no such moment: creating and locking, and a sweep's choice of
//! what to remove, take one process-wide mutex.
//!
//! [`sigbus`] names a mapped file cut short under the process (the `SIGBUS` that follows).

pub mod sigbus;

use std::collections::HashMap;
use std::fs::{File, OpenOptions, TryLockError};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, PoisonError};

/// Held while an entry is created, locked and listed as held, and while a sweep chooses what
/// to remove: no sweep of this process sees an entry this process made and does not yet hold.
static CREATING: Mutex<()> = Mutex::new(());

fn creating() -> MutexGuard<'static, ()> {
    CREATING.lock().unwrap_or_else(PoisonError::into_inner)
}

/// What this process holds now: (device, inode) of every live [`Held`], and how many hold it.
static HELD: Mutex<Option<HashMap<(u64, u64), usize>>> = Mutex::new(None);

fn with_held<T>(f: impl FnOnce(&mut HashMap<(u64, u64), usize>) -> T) -> T {
    let mut g = HELD.lock().unwrap_or_else(PoisonError::into_inner);
    f(g.get_or_insert_with(HashMap::new))
}

/// (device, inode) of `m`.
#[cfg(unix)]
fn identity(m: &std::fs::Metadata) -> (u64, u64) {
    use std::os::unix::fs::MetadataExt;
    (m.dev(), m.ino())
}

#[cfg(not(unix))]
fn identity(_: &std::fs::Metadata) -> (u64, u64) {
    (0, 0)
}

/// A file or folder this process holds: locked (where the file system has locks) and listed
/// as held, until dropped. Reads, writes and seeks go to the file.
#[derive(Debug)]
pub struct Held {
    file: File,
    id: Option<(u64, u64)>,
}

impl Held {
    /// Locks `file` (at `path`) and lists it as held; an error only when another holds it.
    fn new(file: File, path: &Path) -> io::Result<Self> {
        match file.try_lock() {
            Ok(()) | Err(TryLockError::Error(_)) => {}
            Err(TryLockError::WouldBlock) => {
                return Err(io::Error::new(
                    io::ErrorKind::WouldBlock,
                    format!("{} is locked by another holder", path.display()),
                ));
            }
        }
        Ok(Self::listed(file))
    }

    /// `file`, already locked (or on a file system without locks), listed as held.
    fn listed(file: File) -> Self {
        let id = file.metadata().ok().map(|m| identity(&m));
        if let Some(id) = id {
            with_held(|h| *h.entry(id).or_default() += 1);
        }
        Self { file, id }
    }
}

/// How many times [`create_locked`] and [`make_locked_folder`] make an entry that a sweeper
/// of another PID namespace removes before they hold it.
const MAKE_TRIES: usize = 8;

/// How long [`hold_new`] waits for a sweeper that holds a new entry's lock.
const HOLD_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Holds `made`, an entry this process has just made at `path`, or `None` when a sweeper
/// removed or replaced it first. Waits for the lock: only a sweeper can hold a new entry's
/// lock (it took it between the making and this call), and it holds it only while removing;
/// one that holds it past [`HOLD_WAIT`] (a stopped process) is an error naming the entry.
fn hold_new(made: File, path: &Path) -> io::Result<Option<Held>> {
    let since = std::time::Instant::now();
    loop {
        match made.try_lock() {
            // An error here is a file system without locks: held by its name alone.
            Ok(()) | Err(TryLockError::Error(_)) => break,
            Err(TryLockError::WouldBlock) if since.elapsed() < HOLD_WAIT => {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            Err(TryLockError::WouldBlock) => {
                return Err(io::Error::new(
                    io::ErrorKind::WouldBlock,
                    format!(
                        "{}: another process has held the lock of this new entry for over \
                         {HOLD_WAIT:?} (a sweep stopped mid-removal?); try again",
                        path.display()
                    ),
                ));
            }
        }
    }
    let still = std::fs::symlink_metadata(path).is_ok_and(|now| {
        made.metadata()
            .is_ok_and(|m| identity(&m) == identity(&now))
    });
    Ok(still.then(|| Held::listed(made)))
}

/// The error when every try's entry was removed before it was held.
fn swept_away(path: &Path) -> io::Error {
    io::Error::other(format!(
        "{} was removed as it was made, {MAKE_TRIES} times: another process (in another PID \
         namespace) sweeps this folder and takes new entries for stale; give each container \
         a folder of its own",
        path.display()
    ))
}

impl Drop for Held {
    fn drop(&mut self) {
        if let Some(id) = self.id {
            with_held(|h| {
                if let Some(n) = h.get_mut(&id) {
                    *n -= 1;
                    if *n == 0 {
                        h.remove(&id);
                    }
                }
            });
        }
    }
}

impl std::ops::Deref for Held {
    type Target = File;
    fn deref(&self) -> &File {
        &self.file
    }
}

impl io::Read for Held {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.file.read(buf)
    }
}

impl io::Write for Held {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.file.write(buf)
    }
    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        self.file.write_vectored(bufs)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.file.flush()
    }
}

impl io::Seek for Held {
    fn seek(&mut self, pos: io::SeekFrom) -> io::Result<u64> {
        self.file.seek(pos)
    }
}

/// Creates `path` (never an existing file: an entry of that name left by an earlier life of
/// this process id is removed first, one that another holds is an error) with permission
/// bits `mode` (default 0o666 less the umask), held ([`Held`]) until the returned value is
/// dropped. Write through it, then rename `path` into place before dropping it.
pub fn create_locked(path: &Path, mode: Option<u32>) -> io::Result<Held> {
    let _guard = creating();
    for _ in 0..MAKE_TRIES {
        if let Some(held) = hold_new(create_new(path, mode)?, path)? {
            return Ok(held);
        }
    }
    Err(swept_away(path))
}

/// Creates `path` with `mode` (never an existing file; a leftover of an earlier life of this
/// process id is removed first). The caller holds [`CREATING`].
fn create_new(path: &Path, mode: Option<u32>) -> io::Result<File> {
    let open = || {
        let mut o = OpenOptions::new();
        o.read(true).write(true).create_new(true);
        #[cfg(unix)]
        if let Some(mode) = mode {
            std::os::unix::fs::OpenOptionsExt::mode(&mut o, mode);
        }
        o.open(path)
    };
    match open() {
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
            // Our own id and counter in another life's name: stale unless someone holds it.
            match claim(path, true) {
                Claim::Gone => {}
                Claim::Take(c) => {
                    c.remove();
                }
                Claim::Keep => {
                    return Err(io::Error::new(
                        io::ErrorKind::AlreadyExists,
                        format!("{} exists and a live writer holds it", path.display()),
                    ));
                }
            }
            open()
        }
        other => other,
    }
}

/// A temporary name beside `path` for writing it whole: `.NAME.tmp-PID-N-R` (N counts this
/// process's temporary files, R is random: two containers' processes 1 writing into one
/// folder do not pick the same name), which [`temp_owner`] reads back.
pub fn temp_path(path: &Path) -> PathBuf {
    use std::hash::{BuildHasher, Hasher};
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    // Seeded from the operating system's randomness (std's hash keys).
    let r = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish();
    let name = path.file_name().map_or_else(
        || std::borrow::Cow::Borrowed("file"),
        |n| n.to_string_lossy(),
    );
    path.with_file_name(format!(
        ".{name}.tmp-{}-{n}-{:08x}",
        std::process::id(),
        r as u32
    ))
}

/// Writes `bytes` as `path`, whole or not at all: into a held temporary file beside it
/// ([`temp_path`], [`create_locked`]), synced, with exactly the permission bits `mode` when
/// given (whatever the umask), renamed over `path`, and the folder synced so the rename
/// survives a crash. On an error `path` is what it was and the temporary file is removed;
/// the error names the step and the file (creating, writing, syncing, renaming).
pub fn write_whole(path: &Path, bytes: &[u8], mode: Option<u32>) -> io::Result<()> {
    write_whole_as(path, bytes, mode, true)
}

/// Writes an output file a user named: whole or not at all ([`write_whole`], keeping an
/// existing file's permission bits) where `path` is missing or a regular file; written into
/// as it is otherwise (a device such as `/dev/stdout`, or the file a link names, which a
/// rename would replace by a file of its own).
pub fn write_output(path: &Path, bytes: &[u8]) -> io::Result<()> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_file() => {
            #[cfg(unix)]
            let mode = Some(std::os::unix::fs::PermissionsExt::mode(&m.permissions()) & 0o7777);
            #[cfg(not(unix))]
            let mode = None;
            write_whole(path, bytes, mode)
        }
        Ok(_) => std::fs::write(path, bytes),
        Err(_) => write_whole(path, bytes, None),
    }
}

/// [`write_whole`] without the syncs, for scratch files a crash discards anyway (a worker's
/// copies of gained experts): still whole or not at all, never a truncated file, but not
/// waiting for the disk.
pub fn write_whole_unsynced(path: &Path, bytes: &[u8], mode: Option<u32>) -> io::Result<()> {
    write_whole_as(path, bytes, mode, false)
}

fn write_whole_as(path: &Path, bytes: &[u8], mode: Option<u32>, durable: bool) -> io::Result<()> {
    let temp = temp_path(path);
    let step = |what: &'static str, at: &Path| {
        let at = at.display().to_string();
        move |e: io::Error| io::Error::new(e.kind(), format!("{what} {at}: {e}"))
    };
    let mut f = create_locked(&temp, mode).map_err(step("creating", &temp))?;
    let written = (|| {
        io::Write::write_all(&mut f, bytes).map_err(step("writing", &temp))?;
        #[cfg(unix)]
        if let Some(mode) = mode {
            f.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(mode))
                .map_err(step("setting the mode of", &temp))?;
        }
        if durable {
            f.sync_all().map_err(step("syncing", &temp))?;
        }
        std::fs::rename(&temp, path).map_err(step("renaming into place", path))
    })();
    drop(f);
    if written.is_err() {
        let _ = std::fs::remove_file(&temp);
    }
    written?;
    if durable {
        sync_parent(path);
    }
    Ok(())
}

/// Syncs the folder holding `path`, so a rename into it survives a crash (best effort).
pub fn sync_parent(path: &Path) {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
}

/// Holds folder `dir` ([`Held`]) until the returned value is dropped: a sweep leaves it
/// alone meanwhile. For a folder this process makes, [`make_locked_folder`] closes the
/// moment between making and holding it.
pub fn lock_folder(dir: &Path) -> io::Result<Held> {
    Held::new(File::open(dir)?, dir)
}

/// Makes a folder with `make` (say, a `tempfile::Builder`) and holds it ([`lock_folder`]) in
/// one step no sweep of this process comes between; `path` names the folder `make` made.
/// Where a sweeper of another PID namespace removes the new folder before it is held, `make`
/// runs again (a new name each time, as a `tempfile::Builder` gives). `make` runs under this
/// crate's mutex: it must not call [`create_locked`], [`write_whole`] or a sweep (they would
/// wait for themselves).
pub fn make_locked_folder<T>(
    mut make: impl FnMut() -> io::Result<T>,
    path: impl Fn(&T) -> &Path,
) -> io::Result<(T, Held)> {
    let _guard = creating();
    let mut last = None;
    for _ in 0..MAKE_TRIES {
        let made = make()?;
        let dir = path(&made).to_path_buf();
        let held = match File::open(&dir) {
            Ok(f) => hold_new(f, &dir)?,
            Err(e) if e.kind() == io::ErrorKind::NotFound => None,
            Err(e) => return Err(e),
        };
        if let Some(held) = held {
            return Ok((made, held));
        }
        last = Some(dir);
    }
    Err(swept_away(last.as_deref().unwrap_or(Path::new("folder"))))
}

/// Whether another open file description holds `f`'s lock (a live writer or creator, in this
/// process or another): `false` when the lock is free (taken and given back at once) or the
/// file system has no locks.
pub fn held_by_another(f: &File) -> bool {
    match f.try_lock() {
        Ok(()) => {
            let _ = f.unlock();
            false
        }
        Err(TryLockError::WouldBlock) => true,
        Err(TryLockError::Error(_)) => false,
    }
}

/// Whether no process `pid` runs on this host (`false` where there is no `/proc`: then
/// nothing is judged gone).
pub fn process_gone(pid: u32) -> bool {
    Path::new("/proc/self").exists() && !Path::new("/proc").join(pid.to_string()).exists()
}

/// Removes each entry of `dir` (file, folder with what it holds, or link) whose name `owner`
/// maps to the id of a process that is gone, or to this process's own id where this process
/// does not hold it, and that no process holds locked; returns the paths removed. Best
/// effort: what cannot be listed, opened, locked or removed stays.
pub fn remove_left_by_gone_processes(
    dir: &Path,
    owner: impl Fn(&str) -> Option<u32>,
) -> Vec<PathBuf> {
    // Chosen (and locked) under the mutex; removed after it, so a large folder's removal
    // holds up no writer of this process.
    let chosen: Vec<Claimed> = {
        let _guard = creating();
        let Ok(entries) = std::fs::read_dir(dir) else {
            return Vec::new();
        };
        let me = std::process::id();
        entries
            .flatten()
            .filter_map(|e| {
                let pid = e.file_name().to_str().and_then(&owner)?;
                if pid != me && !process_gone(pid) {
                    return None;
                }
                match claim(&e.path(), pid == me) {
                    Claim::Take(c) => Some(c),
                    Claim::Gone | Claim::Keep => None,
                }
            })
            .collect()
    };
    chosen
        .into_iter()
        .filter_map(|c| {
            let path = c.path.clone();
            c.remove().then_some(path)
        })
        .collect()
}

/// What [`claim`] found.
enum Claim {
    /// Nothing is there any more.
    Gone,
    /// Someone holds it, it cannot be opened or it is not a file, folder or link: left.
    Keep,
    /// Free: taken (locked by us) for removal.
    Take(Claimed),
}

/// An entry a sweep took: its lock (none for a link) until it is removed.
struct Claimed {
    path: PathBuf,
    kind: Kind,
    lock: Option<File>,
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Link,
    File,
    Folder,
}

/// Takes `path` for removal when no one holds it; `own`: its name carries this process's id,
/// so what this process holds ([`Held`]) decides, not the lock. Never follows a link and
/// never opens what is not a file or folder (a FIFO would block the open).
fn claim(path: &Path, own: bool) -> Claim {
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Claim::Gone,
        Err(_) => return Claim::Keep,
    };
    let t = meta.file_type();
    let kind = if t.is_symlink() {
        Kind::Link
    } else if t.is_dir() {
        Kind::Folder
    } else if t.is_file() {
        Kind::File
    } else {
        return Claim::Keep;
    };
    if own && with_held(|h| h.contains_key(&identity(&meta))) {
        return Claim::Keep;
    }
    if kind == Kind::Link {
        return Claim::Take(Claimed {
            path: path.to_path_buf(),
            kind,
            lock: None,
        });
    }
    let Ok(f) = open_no_block(path) else {
        return Claim::Keep;
    };
    // A shared lock: it conflicts with a writer's exclusive one, and unlike an exclusive
    // lock it can be taken through this read-only handle where locks are emulated with POSIX
    // locks (NFS), which refuse an exclusive lock on a file not open for writing.
    match f.try_lock_shared() {
        Err(TryLockError::WouldBlock) => return Claim::Keep,
        Ok(()) => {}
        // A file system without locks leaves the process id to decide.
        Err(TryLockError::Error(e)) if no_locks_here(&e) => {}
        Err(TryLockError::Error(_)) => return Claim::Keep,
    }
    // Still the entry that was looked at (not replaced meanwhile).
    if !f.metadata().is_ok_and(|m| identity(&m) == identity(&meta)) {
        return Claim::Keep;
    }
    Claim::Take(Claimed {
        path: path.to_path_buf(),
        kind,
        lock: Some(f),
    })
}

impl Claimed {
    /// Removes the entry (still the one locked, unless it is a link); whether it did.
    fn remove(self) -> bool {
        if let Some(f) = &self.lock {
            let same = std::fs::symlink_metadata(&self.path)
                .is_ok_and(|now| f.metadata().is_ok_and(|m| identity(&m) == identity(&now)));
            if !same {
                return false;
            }
        }
        let removed = match self.kind {
            Kind::Folder => std::fs::remove_dir_all(&self.path),
            Kind::File | Kind::Link => std::fs::remove_file(&self.path),
        };
        removed.is_ok()
    }
}

/// Whether `e`, from taking a lock, says the file system has no locks (rather than that this
/// lock could not be taken).
fn no_locks_here(e: &io::Error) -> bool {
    #[cfg(unix)]
    if let Some(code) = e.raw_os_error() {
        return code == libc::ENOLCK || code == libc::EOPNOTSUPP || code == libc::ENOSYS;
    }
    e.kind() == io::ErrorKind::Unsupported
}

/// Opens `path` read-only without following a last-component link and without blocking (a
/// FIFO swapped in after the type check would otherwise block the open).
fn open_no_block(path: &Path) -> io::Result<File> {
    open_read(path, true)
}

/// Bytes free to this user on the file system holding `dir` (`statvfs`: available blocks times
/// the fragment size); `None` where it cannot be read (no such folder, not Unix).
pub fn free_bytes(dir: &Path) -> Option<u64> {
    #[cfg(unix)]
    {
        use std::os::unix::ffi::OsStrExt;
        let path = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
        // SAFETY: statvfs writes into the zeroed struct we own; the path is a valid C string.
        unsafe {
            let mut st: libc::statvfs = std::mem::zeroed();
            if libc::statvfs(path.as_ptr(), &mut st) != 0 {
                return None;
            }
            Some(st.f_bavail as u64 * st.f_frsize as u64)
        }
    }
    #[cfg(not(unix))]
    {
        let _ = dir;
        None
    }
}

/// Opens `path` to read without blocking: a FIFO put where a file should be would otherwise
/// wait for a writer for ever. Links are followed; check what was opened through the handle
/// (`File::metadata`), not by path.
pub fn open_nonblocking(path: &Path) -> io::Result<File> {
    open_read(path, false)
}

fn open_read(path: &Path, no_follow: bool) -> io::Result<File> {
    let mut o = OpenOptions::new();
    o.read(true);
    #[cfg(unix)]
    {
        let follow = if no_follow { libc::O_NOFOLLOW } else { 0 };
        std::os::unix::fs::OpenOptionsExt::custom_flags(&mut o, libc::O_NONBLOCK | follow);
    }
    #[cfg(not(unix))]
    let _ = no_follow;
    o.open(path)
}

/// The process id in `name` when it is `PREFIX<pid>` or `PREFIX<pid>-...`.
pub fn pid_after(prefix: &str, name: &str) -> Option<u32> {
    name.strip_prefix(prefix)?.split('-').next()?.parse().ok()
}

/// The process id in a temporary file's name as [`temp_path`] makes them (`.NAME.tmp-PID-N-R`)
/// and earlier versions did (`.NAME.tmp-PID`, `.NAME.tmp-PID-N`).
pub fn temp_owner(name: &str) -> Option<u32> {
    let (_, rest) = name.strip_prefix('.')?.rsplit_once(".tmp-")?;
    pid_after("", rest)
}

/// Removes from `dir` the temporary files ([`temp_owner`]) that writers which are gone left.
pub fn remove_stale_temps(dir: &Path) {
    remove_left_by_gone_processes(dir, temp_owner);
}

/// A process id no process can have, one past the kernel's largest (`/proc/sys/kernel/pid_max`;
/// Linux's ceiling, 2^22, where that cannot be read): what tests of the sweeps use for an
/// entry whose writer is gone, since a just-exited child's id could be reused meanwhile.
pub fn pid_past_max() -> u32 {
    std::fs::read_to_string("/proc/sys/kernel/pid_max")
        .ok()
        .and_then(|s| s.trim().parse::<u32>().ok())
        .map_or(4_194_305, |m| m + 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A folder's file system reports room; a folder that is not there, none.
    #[test]
    fn free_bytes_reads_the_file_system_of_a_folder() {
        let dir = tempfile::tempdir().unwrap();
        assert!(free_bytes(dir.path()).is_some_and(|b| b > 0));
        assert_eq!(free_bytes(&dir.path().join("missing")), None);
    }

    #[test]
    fn names_give_their_process() {
        assert_eq!(temp_owner(".device-0001.emshard.tmp-4242-3"), Some(4242));
        assert_eq!(temp_owner(".manifest.json.tmp-17"), Some(17));
        assert_eq!(temp_owner("device-0001.emshard"), None);
        assert_eq!(temp_owner(".device.tmp-x"), None);
        assert_eq!(pid_after("em-", "em-12-abc"), Some(12));
        assert_eq!(pid_after("em-", "em-12"), Some(12));
        assert_eq!(pid_after("em-", "other-12"), None);
    }

    /// Held shared by the tests that expect a dropped [`Held`] to be unlocked at once, and
    /// alone by the test that spawns a process: between its fork and its exec the child
    /// shares this process's open files, so a lock dropped meanwhile stays taken until the
    /// exec closes them (harmless in use: a sweep keeps the entry a moment longer).
    static SPAWNING: std::sync::RwLock<()> = std::sync::RwLock::new(());

    fn no_spawn() -> std::sync::RwLockReadGuard<'static, ()> {
        SPAWNING.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// What the sweep removes: entries of gone processes (or this one) that nobody holds
    /// locked; it keeps a locked one whatever its name says (a live writer of another PID
    /// namespace), and one of a running process that takes no lock (an older writer).
    #[test]
    fn the_sweep_removes_exactly_the_unlocked_entries_of_gone_writers() {
        let _no_spawn = no_spawn();
        let d = tempfile::tempdir().unwrap();
        let gone = super::pid_past_max();
        let me = std::process::id();
        let parent = std::os::unix::process::parent_id();
        let name = |pid: u32, n: u32| format!(".shard.emshard.tmp-{pid}-{n}");
        // Removed: unlocked, of a gone process or of this one.
        for n in [name(gone, 1), name(me, 2)] {
            std::fs::write(d.path().join(n), b"x").unwrap();
        }
        let stale_dir = d.path().join(name(gone, 3));
        std::fs::create_dir(&stale_dir).unwrap();
        std::fs::write(stale_dir.join("inside"), b"x").unwrap();
        // Kept: held locked (a file and a folder), of a running process, not a temp name.
        let held = create_locked(&d.path().join(name(gone, 4)), None).unwrap();
        let held_mine = create_locked(&d.path().join(name(me, 5)), None).unwrap();
        let held_dir = d.path().join(name(gone, 6));
        std::fs::create_dir(&held_dir).unwrap();
        let dir_lock = lock_folder(&held_dir).unwrap();
        std::fs::write(d.path().join(name(parent, 7)), b"x").unwrap();
        std::fs::write(d.path().join("notes.txt"), b"x").unwrap();
        // A link is removed, never what it points at.
        let target = d.path().join("target");
        std::fs::write(&target, b"keep").unwrap();
        std::os::unix::fs::symlink(&target, d.path().join(name(gone, 8))).unwrap();

        remove_stale_temps(d.path());
        let left = |n: &str| d.path().join(n).symlink_metadata().is_ok();
        for n in [name(gone, 1), name(me, 2), name(gone, 3), name(gone, 8)] {
            assert!(!left(&n), "{n} left behind");
        }
        for n in [
            name(gone, 4),
            name(me, 5),
            name(gone, 6),
            name(parent, 7),
            "notes.txt".into(),
            "target".into(),
        ] {
            assert!(left(&n), "{n} removed");
        }
        assert_eq!(std::fs::read(&target).unwrap(), b"keep");

        // Their writers gone (the handles dropped), the next sweep removes them.
        drop((held, held_mine, dir_lock));
        remove_stale_temps(d.path());
        for n in [name(gone, 4), name(me, 5), name(gone, 6)] {
            assert!(!left(&n), "{n} left behind once unlocked");
        }
    }

    /// A lock held by another handle (in this process or another) is seen, and left held; a
    /// free one is seen free and left free.
    #[test]
    fn a_held_lock_is_seen_from_another_handle() {
        let _no_spawn = no_spawn();
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("ring");
        let creator = create_locked(&p, Some(0o600)).unwrap();
        let other = File::open(&p).unwrap();
        assert!(held_by_another(&other));
        assert!(held_by_another(&other), "the check took nothing");
        drop(creator);
        assert!(!held_by_another(&other));
        assert!(
            !held_by_another(&File::open(&p).unwrap()),
            "and gave it back"
        );
    }

    /// A FIFO named like a leftover is never opened (the open would block the sweep) nor
    /// removed; a folder this process made and holds is kept, and removed once let go.
    #[test]
    fn a_fifo_is_left_alone_and_a_made_folder_is_held() {
        let _no_spawn = no_spawn();
        let d = tempfile::tempdir().unwrap();
        let fifo = d.path().join(format!(".x.tmp-{}-1", super::pid_past_max()));
        let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: mkfifo on a valid C string path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let me = std::process::id();
        let (made, held) = make_locked_folder(
            || {
                let p = d.path().join(format!(".y.tmp-{me}-2"));
                std::fs::create_dir(&p).map(|()| p)
            },
            |p| p.as_path(),
        )
        .unwrap();
        assert!(remove_left_by_gone_processes(d.path(), temp_owner).is_empty());
        assert!(fifo.symlink_metadata().is_ok() && made.exists());
        drop(held);
        assert_eq!(
            remove_left_by_gone_processes(d.path(), temp_owner),
            vec![made.clone()]
        );
        assert!(!made.exists());
    }

    /// A file written whole replaces the old one with exactly the mode asked (whatever the
    /// umask), leaves no temporary file, and its temporary name gives this process back; a
    /// write that fails leaves the old file and nothing else.
    #[test]
    fn a_file_written_whole_replaces_the_old_and_leaves_nothing_else() {
        let _no_spawn = no_spawn();
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("run.sh");
        std::fs::write(&p, b"old").unwrap();
        write_whole(&p, b"new", Some(0o750)).unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"new");
        let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o750);
        let names: Vec<_> = std::fs::read_dir(d.path()).unwrap().flatten().collect();
        assert_eq!(names.len(), 1, "{names:?}");
        let t = temp_path(&p);
        let t = t.file_name().unwrap().to_str().unwrap();
        assert_eq!(temp_owner(t), Some(std::process::id()), "{t}");
        // A folder where the file should be: the rename fails; the folder stays, alone.
        let q = d.path().join("taken");
        std::fs::create_dir(&q).unwrap();
        std::fs::write(q.join("inside"), b"x").unwrap();
        assert!(write_whole(&q, b"new", None).is_err());
        let names: Vec<_> = std::fs::read_dir(d.path()).unwrap().flatten().collect();
        assert_eq!(names.len(), 2, "{names:?}");
        assert_eq!(std::fs::read(q.join("inside")).unwrap(), b"x");
    }

    /// Where the sweeper child of [`what_is_made_is_held_though_another_namespace_sweeps`]
    /// sweeps, given by its parent.
    const SWEEP_DIR: &str = "EXPERTMESH_FILES_TEST_SWEEP_DIR";

    /// Not a test of its own: the sweeper child of
    /// [`what_is_made_is_held_though_another_namespace_sweeps`], which runs this test binary
    /// again with only this test and the folder in its environment. Alone it does nothing.
    #[test]
    fn sweeper_child() {
        let Some(dir) = std::env::var_os(SWEEP_DIR).map(PathBuf::from) else {
            return;
        };
        let parent = std::os::unix::process::parent_id();
        let gone = super::pid_past_max();
        std::fs::write(dir.join("ready"), b"").unwrap();
        // Every temporary name's writer looks gone to this sweeper, as a writer in another
        // PID namespace does: only the lock keeps an entry.
        while !dir.join("stop").exists() && !process_gone(parent) {
            remove_left_by_gone_processes(&dir, |n| n.starts_with('.').then_some(gone));
        }
    }

    /// Kills the sweeper child however the test ends.
    struct Sweeper(std::process::Child);

    impl Drop for Sweeper {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    /// A file or folder this process makes is held at its path once made, even while another
    /// process sweeps the folder taking every unlocked entry for stale (a sweeper in another
    /// PID namespace): between a make and its lock the sweeper may take and remove the new
    /// entry, and then the entry is made again, never handed out removed or refused.
    #[test]
    fn what_is_made_is_held_though_another_namespace_sweeps() {
        let _spawning = SPAWNING.write().unwrap_or_else(PoisonError::into_inner);
        let d = tempfile::tempdir().unwrap();
        let child = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "tests::sweeper_child",
                "--quiet",
                "--test-threads=1",
            ])
            .env(SWEEP_DIR, d.path())
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let mut sweeper = Sweeper(child);
        while !d.path().join("ready").exists() {
            assert!(
                sweeper.0.try_wait().unwrap().is_none(),
                "the sweeper child ended"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let at_its_path = |p: &Path, held: &Held| {
            let now = std::fs::symlink_metadata(p)
                .unwrap_or_else(|e| panic!("{} held but not there: {e}", p.display()));
            assert_eq!(identity(&now), identity(&held.metadata().unwrap()));
        };
        let mut names = 0..;
        for n in 0..3000 {
            let p = d.path().join(format!(".x.tmp-1-{n}"));
            let held = create_locked(&p, None).unwrap();
            at_its_path(&p, &held);
            std::fs::remove_file(&p).unwrap();
            drop(held);
            let (dir, held) = make_locked_folder(
                || {
                    let q = d.path().join(format!(".y.tmp-1-{}", names.next().unwrap()));
                    std::fs::create_dir(&q).map(|()| q)
                },
                |q| q.as_path(),
            )
            .unwrap();
            at_its_path(&dir, &held);
            std::fs::remove_dir(&dir).unwrap();
        }
        std::fs::write(d.path().join("stop"), b"").unwrap();
        let status = sweeper.0.wait().unwrap();
        assert!(status.success(), "the sweeper child: {status}");
    }

    /// A name left by an earlier life of this process id is taken over; one a live writer
    /// holds is refused, and its file untouched.
    #[test]
    fn creating_takes_over_only_an_unlocked_leftover() {
        let _no_spawn = no_spawn();
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join(".x.tmp-1-1");
        std::fs::write(&p, b"old").unwrap();
        let mut f = create_locked(&p, None).unwrap();
        std::io::Write::write_all(&mut f, b"new").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"new");
        let e = create_locked(&p, None).unwrap_err();
        assert!(e.to_string().contains("a live writer holds it"), "{e}");
        assert_eq!(std::fs::read(&p).unwrap(), b"new");
        drop(f);
        assert!(create_locked(&p, Some(0o400)).is_ok());
    }
}
