//! A mapped file cut short under the process: the `SIGBUS` that follows, explained.
//!
//! Why this exists: the converter maps every checkpoint file, and a worker maps its shards'
//! indexes and its tile cache. When another program truncates such a file in place (a
//! download tool rewriting it, `truncate`, a copy over it without a rename), the next read of a
//! page past the new end raises `SIGBUS` (as does a page a full tmpfs cannot supply), and the process ended with nothing but "Bus error":
//! no file, no cause, no next step. [`install`] sets a handler that, for a fault at an address
//! inside a file mapping (`BUS_ADRERR`), writes which file it was, what happened and what to
//! do to stderr, then raises the signal's default action, which ends the process as before
//! (the exit status still says `SIGBUS`, and a core dump is taken where they are enabled).
//! Any other `SIGBUS` ends it the same way, unexplained. With several threads faulting at
//! once, the first reports (one `write`) and the others wait for the end.
//!
//! The handler is async-signal-safe: it reads `/proc/self/maps` with `open`/`read` into
//! buffers on the faulting thread's stack (no allocation, no lock) and writes with `write`.
//! It runs on that thread's own stack, not the alternate signal stack, which is too small for
//! its buffers; a fault on a mapped file read leaves the stack usable.

/// Installs the handler for this process (idempotent; a no-op outside Linux). Call it early in
/// `main`: a later `sigaction(SIGBUS)` by anything else replaces it.
pub fn install() {
    #[cfg(target_os = "linux")]
    imp::install();
}

/// The mapping of `/proc/self/maps` text that holds `addr`: its path (the bytes after the
/// inode field; empty for an anonymous mapping). Used by the handler on its stack buffers, and
/// by tests on whole text.
#[cfg_attr(not(target_os = "linux"), allow(dead_code))]
fn path_of(maps_line: &[u8], addr: usize) -> Option<&[u8]> {
    let (range, rest) = split_field(maps_line)?;
    let dash = range.iter().position(|&b| b == b'-')?;
    let start = hex(&range[..dash])?;
    let end = hex(&range[dash + 1..])?;
    if !(start <= addr && addr < end) {
        return None;
    }
    // perms, offset, dev, inode, then spaces and the path (which may hold spaces).
    let mut rest = rest;
    for _ in 0..4 {
        rest = split_field(rest)?.1;
    }
    let path = trim_start(rest);
    Some(path.strip_suffix(b"\n").unwrap_or(path))
}

/// The first space-separated field and what follows it (leading spaces skipped).
fn split_field(s: &[u8]) -> Option<(&[u8], &[u8])> {
    let s = trim_start(s);
    let end = s
        .iter()
        .position(|&b| b == b' ' || b == b'\n')
        .unwrap_or(s.len());
    if end == 0 {
        return None;
    }
    Some((&s[..end], &s[end..]))
}

fn trim_start(s: &[u8]) -> &[u8] {
    let skip = s.iter().take_while(|&&b| b == b' ').count();
    &s[skip..]
}

/// A lowercase or uppercase hexadecimal number of at most 16 digits.
fn hex(s: &[u8]) -> Option<usize> {
    if s.is_empty() || s.len() > 16 {
        return None;
    }
    let mut v: usize = 0;
    for &b in s {
        let d = match b {
            b'0'..=b'9' => b - b'0',
            b'a'..=b'f' => b - b'a' + 10,
            b'A'..=b'F' => b - b'A' + 10,
            _ => return None,
        };
        v = v.checked_mul(16)?.checked_add(usize::from(d))?;
    }
    Some(v)
}

#[cfg(target_os = "linux")]
mod imp {
    use super::path_of;
    use std::sync::Once;
    use std::sync::atomic::{AtomicBool, Ordering};

    /// Bytes of `/proc/self/maps` read at a time.
    const CHUNK: usize = 4096;
    /// The longest line kept whole: a path of `PATH_MAX` bytes plus the fields before it.
    const LINE: usize = 4096 + 256;

    pub(super) fn install() {
        static ONCE: Once = Once::new();
        ONCE.call_once(|| {
            // SAFETY: a zeroed sigaction is a valid starting point; the handler has the
            // SA_SIGINFO signature and is async-signal-safe (module docs).
            unsafe {
                let mut sa: libc::sigaction = std::mem::zeroed();
                sa.sa_sigaction = handler as *const () as usize;
                sa.sa_flags = libc::SA_SIGINFO;
                libc::sigemptyset(&mut sa.sa_mask);
                libc::sigaction(libc::SIGBUS, &sa, std::ptr::null_mut());
            }
        });
    }

    /// Write all of `bytes` to stderr (best effort).
    fn say(bytes: &[u8]) {
        let mut at = 0;
        while at < bytes.len() {
            // SAFETY: the pointer and length name initialized bytes of `bytes`.
            let n = unsafe { libc::write(2, bytes[at..].as_ptr().cast(), bytes.len() - at) };
            if n <= 0 {
                return;
            }
            at += n as usize;
        }
    }

    /// The path of the file mapping that holds `addr`, copied into `out` (`LINE` bytes; the
    /// path's length is returned), or `None` when no file mapping holds it.
    fn mapped_file(addr: usize, out: &mut [u8]) -> Option<usize> {
        // SAFETY: a NUL-terminated path; the descriptor is closed below.
        let fd = unsafe {
            libc::open(
                c"/proc/self/maps".as_ptr(),
                libc::O_RDONLY | libc::O_CLOEXEC,
            )
        };
        if fd < 0 {
            return None;
        }
        let mut chunk = [0u8; CHUNK];
        let mut line = [0u8; LINE];
        let mut len = 0;
        let mut found = None;
        'read: loop {
            // SAFETY: `chunk` is CHUNK writable bytes.
            let n = unsafe { libc::read(fd, chunk.as_mut_ptr().cast(), CHUNK) };
            if n <= 0 {
                break;
            }
            for &b in &chunk[..n as usize] {
                if b != b'\n' {
                    if len < LINE {
                        line[len] = b;
                        len += 1;
                    }
                    continue;
                }
                if let Some(path) = path_of(&line[..len], addr)
                    && path.first() == Some(&b'/')
                {
                    out[..path.len()].copy_from_slice(path);
                    found = Some(path.len());
                    break 'read;
                }
                len = 0;
            }
        }
        // SAFETY: `fd` is open and ours.
        unsafe { libc::close(fd) };
        found
    }

    /// What the report says before and after the file's path.
    const HEAD: &[u8] = b"\nexpertmesh: stopped by SIGBUS: the file ";
    const TAIL: &[u8] = b" could not be read where this process had it mapped: it was cut short \
        (another program truncated or rewrote it in place), or, on a tmpfs such as /dev/shm, \
        the file system is full. The process stops here; files it was writing are left \
        incomplete under temporary names, which the next run removes. Let the other program \
        finish (or put the file back whole, or free room), then run again; replace files by \
        renaming a complete copy over them, never by writing into them.\n";

    /// Set by the first thread to enter the handler: it alone reports and ends the process
    /// (with several threads reading a cut file, each faults).
    static REPORTING: AtomicBool = AtomicBool::new(false);

    extern "C" fn handler(sig: libc::c_int, info: *mut libc::siginfo_t, _: *mut libc::c_void) {
        if REPORTING.swap(true, Ordering::AcqRel) {
            // Another thread reports and raises the default action, which ends every thread.
            loop {
                // SAFETY: pause() only waits for a signal.
                unsafe { libc::pause() };
            }
        }
        // SAFETY: the kernel passes a valid siginfo for an SA_SIGINFO handler.
        let (code, addr) = unsafe { ((*info).si_code, (*info).si_addr() as usize) };
        let mut msg = [0u8; HEAD.len() + LINE + TAIL.len()];
        if code == libc::BUS_ADRERR
            && let Some(n) = mapped_file(addr, &mut msg[HEAD.len()..][..LINE])
        {
            msg[..HEAD.len()].copy_from_slice(HEAD);
            let end = HEAD.len() + n;
            msg[end..end + TAIL.len()].copy_from_slice(TAIL);
            say(&msg[..end + TAIL.len()]);
        }
        // The default action ends the process: raised here (SIGBUS is blocked until the
        // handler returns, then delivered), so a SIGBUS that was not a fault (kill, raise)
        // ends it too; a fault's access would also fault again.
        // SAFETY: signal() and raise() are async-signal-safe.
        unsafe {
            libc::signal(sig, libc::SIG_DFL);
            libc::raise(sig);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::path_of;

    #[test]
    fn a_maps_line_gives_the_path_of_the_address_inside_it() {
        let line = b"7f2c4a000000-7f2c4a021000 r--s 00001000 fd:01 123456     /data/ckpt/model 1.safetensors\n";
        assert_eq!(
            path_of(line, 0x7f2c4a000000),
            Some(&b"/data/ckpt/model 1.safetensors"[..])
        );
        assert_eq!(
            path_of(line, 0x7f2c4a020fff),
            Some(&b"/data/ckpt/model 1.safetensors"[..])
        );
        assert_eq!(path_of(line, 0x7f2c4a021000), None, "end is exclusive");
        assert_eq!(path_of(line, 0x7f2c49ffffff), None);
        let anon = b"7ffd1000-7ffd2000 rw-p 00000000 00:00 0 \n";
        assert_eq!(path_of(anon, 0x7ffd1800), Some(&b""[..]));
        let deleted = b"10-20 r--s 0 fd:01 7 /tmp/x (deleted)";
        assert_eq!(path_of(deleted, 0x10), Some(&b"/tmp/x (deleted)"[..]));
        for bad in [&b""[..], b"zz-20 r 0 0 0 /a", b"10 r 0 0 0 /a", b"10-20"] {
            assert_eq!(
                path_of(bad, 0x10),
                None,
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    /// This process's own maps: a file it maps is found at an address inside the map.
    #[cfg(target_os = "linux")]
    #[test]
    fn this_process_finds_a_file_it_maps() {
        use std::os::fd::AsRawFd;
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("mapped.bin");
        std::fs::write(&file, vec![7u8; 3 * 4096]).unwrap();
        let f = std::fs::File::open(&file).unwrap();
        // SAFETY: a read-only shared map of an open file, unmapped below.
        let at = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                3 * 4096,
                libc::PROT_READ,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                0,
            )
        };
        assert_ne!(at, libc::MAP_FAILED);
        let maps = std::fs::read("/proc/self/maps").unwrap();
        let found: Vec<&[u8]> = maps
            .split_inclusive(|&b| b == b'\n')
            .filter_map(|l| path_of(l, at as usize + 5000))
            .collect();
        // SAFETY: mapped above with this length.
        unsafe { libc::munmap(at, 3 * 4096) };
        let want = std::fs::canonicalize(&file).unwrap();
        assert_eq!(found, vec![want.as_os_str().as_encoded_bytes()]);
    }
}
