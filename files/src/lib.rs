//! Temporary files and folders held under a lock while their process lives, and the sweep
//! that removes what killed processes left behind.
//!
//! Why this exists: a file that must appear whole (a shard, a manifest, a tile cache file) is
//! written under a temporary name and renamed into place, and a worker or a demo keeps a
//! scratch folder. A process ended by SIGKILL, Ctrl-C or the OOM killer renames and removes
//! nothing, and a temporary shard is as large as the shard, so whoever comes next removes
//! what was left. It must never remove what a live process is still writing.
//!
//! Two facts decide that, and an entry is removed only when both say its writer is gone:
//!
//! * **The lock.** A writer holds an exclusive `flock` on its temporary file
//!   ([`create_locked`]) or its folder ([`lock_folder`]) for as long as it uses it; the
//!   kernel drops the lock when the process ends, however it ends. The sweep removes an entry
//!   only while holding that lock itself. This holds across PID namespaces (containers
//!   sharing a folder), where process ids say nothing.
//! * **The process id in the name** (`.NAME.tmp-PID-N`, `PREFIX<PID>-...`): no process of that
//!   id runs here (`/proc`), or it is the sweeper's own id (only an earlier life of a
//!   container's process 1 can have left that, since this process's own writers hold their
//!   locks). This keeps the files of a live writer that takes no lock (an older version).
//!
//! Where there is no `/proc`, or the entry cannot be opened (another user's file), nothing is
//! removed. On a file system that refuses `flock` (an NFS mount without its lock daemon)
//! writers go on unlocked and the sweep goes by the process id alone. One window is left: between a writer's
//! `open` and its `flock` (microseconds) a sweeper in another PID namespace, where the
//! writer's id runs nothing, could remove the new file; the writer's rename then fails with an
//! error that names the file. Within one process the window is closed ([`create_locked`] and
//! the sweep take one process-wide mutex).

use std::fs::{File, OpenOptions, TryLockError};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, PoisonError};

/// Held while a file is created and locked, and during a sweep: no sweep of this process sees
/// a file this process created and has not locked yet.
static CREATING: Mutex<()> = Mutex::new(());

fn creating() -> MutexGuard<'static, ()> {
    CREATING.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Creates `path` (never an existing file: an entry of that name left by an earlier life of
/// this process id is swept first, one that is locked is an error) with permission bits
/// `mode` (default 0o666 less the umask), and holds an exclusive lock on it for as long as
/// the returned file is open (where the file system has no locks, the file goes unlocked).
/// Write through the returned handle, then rename `path` into place; the lock goes with the
/// handle.
pub fn create_locked(path: &Path, mode: Option<u32>) -> io::Result<File> {
    let _guard = creating();
    let open = || {
        let mut o = OpenOptions::new();
        o.read(true).write(true).create_new(true);
        #[cfg(unix)]
        if let Some(mode) = mode {
            std::os::unix::fs::OpenOptionsExt::mode(&mut o, mode);
        }
        o.open(path)
    };
    let file = match open() {
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
            // Our own id and counter in another life's name: stale unless someone holds it.
            if !remove_if_unlocked(path) {
                return Err(io::Error::new(
                    io::ErrorKind::AlreadyExists,
                    format!("{} exists and a live writer holds it", path.display()),
                ));
            }
            open()?
        }
        other => other?,
    };
    hold(&file, path)?;
    Ok(file)
}

/// Locks folder `dir` (exclusive) for as long as the returned handle is open: a sweep leaves
/// the folder alone meanwhile (where the file system has no locks, the folder goes
/// unlocked). Keep the handle for the folder's life.
pub fn lock_folder(dir: &Path) -> io::Result<File> {
    let f = File::open(dir)?;
    hold(&f, dir)?;
    Ok(f)
}

/// Takes the exclusive lock of `f` (at `path`): an error only when another holds it; a file
/// system without locks leaves it unlocked.
fn hold(f: &File, path: &Path) -> io::Result<()> {
    match f.try_lock() {
        Ok(()) | Err(TryLockError::Error(_)) => Ok(()),
        Err(TryLockError::WouldBlock) => Err(io::Error::new(
            io::ErrorKind::WouldBlock,
            format!("{} is locked by another process", path.display()),
        )),
    }
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

/// Removes each entry of `dir` (file or folder) whose name `owner` maps to the id of a process
/// that is gone (or to this process's own id) and that no process holds locked; returns the
/// paths removed. Best effort: what cannot be listed, locked or removed stays.
pub fn remove_left_by_gone_processes(
    dir: &Path,
    owner: impl Fn(&str) -> Option<u32>,
) -> Vec<PathBuf> {
    let _guard = creating();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let me = std::process::id();
    let mut removed = Vec::new();
    for e in entries.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(&owner) else {
            continue;
        };
        if (pid == me || process_gone(pid)) && remove_if_unlocked(&e.path()) {
            removed.push(e.path());
        }
    }
    removed
}

/// Removes `path` (a file, a folder with what it holds, or a link itself, never what it points
/// at) when no process holds it locked; whether it is gone.
fn remove_if_unlocked(path: &Path) -> bool {
    let Ok(meta) = std::fs::symlink_metadata(path) else {
        return true;
    };
    if meta.file_type().is_symlink() {
        return std::fs::remove_file(path).is_ok();
    }
    let Ok(f) = File::open(path) else {
        return false;
    };
    // Held by a live writer: kept. A file system without locks leaves the process id alone
    // to decide (its writers could not lock either).
    if let Err(TryLockError::WouldBlock) = f.try_lock() {
        return false;
    }
    // Still the entry locked (not replaced since it was opened): remove it under the lock.
    let same = std::fs::symlink_metadata(path).is_ok_and(|now| same_file(&now, &f));
    if !same {
        return false;
    }
    let removed = if meta.is_dir() {
        std::fs::remove_dir_all(path)
    } else {
        std::fs::remove_file(path)
    };
    removed.is_ok()
}

#[cfg(unix)]
fn same_file(meta: &std::fs::Metadata, f: &File) -> bool {
    use std::os::unix::fs::MetadataExt;
    f.metadata()
        .is_ok_and(|m| m.dev() == meta.dev() && m.ino() == meta.ino())
}

#[cfg(not(unix))]
fn same_file(_: &std::fs::Metadata, _: &File) -> bool {
    false
}

/// The process id in `name` when it is `PREFIX<pid>` or `PREFIX<pid>-...`.
pub fn pid_after(prefix: &str, name: &str) -> Option<u32> {
    name.strip_prefix(prefix)?.split('-').next()?.parse().ok()
}

/// The process id in a temporary file's name as the shard writer, the manifest and the
/// converter make them: `.NAME.tmp-PID` or `.NAME.tmp-PID-N`.
pub fn temp_owner(name: &str) -> Option<u32> {
    let (_, rest) = name.strip_prefix('.')?.rsplit_once(".tmp-")?;
    pid_after("", rest)
}

/// Removes from `dir` the temporary files ([`temp_owner`]) that writers which are gone left.
pub fn remove_stale_temps(dir: &Path) {
    remove_left_by_gone_processes(dir, temp_owner);
}

#[cfg(test)]
mod tests {
    use super::*;

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

    /// A process id that runs no process: past the kernel's largest.
    fn gone_pid() -> u32 {
        std::fs::read_to_string("/proc/sys/kernel/pid_max")
            .ok()
            .and_then(|s| s.trim().parse::<u32>().ok())
            .map_or(4_194_305, |m| m + 1)
    }

    /// What the sweep removes: entries of gone processes (or this one) that nobody holds
    /// locked; it keeps a locked one whatever its name says (a live writer of another PID
    /// namespace), and one of a running process that takes no lock (an older writer).
    #[test]
    fn the_sweep_removes_exactly_the_unlocked_entries_of_gone_writers() {
        let d = tempfile::tempdir().unwrap();
        let gone = gone_pid();
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

    /// A name left by an earlier life of this process id is taken over; one a live writer
    /// holds is refused, and its file untouched.
    #[test]
    fn creating_takes_over_only_an_unlocked_leftover() {
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
