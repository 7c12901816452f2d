//! Client connections a `fork()` child closes at once, so the parent's close is the end.
//!
//! Why this exists: a Python process that makes a router client and then forks (gunicorn
//! `--preload`, `multiprocessing` with the fork start method) hands every child a copy of the
//! client's socket. The child may not use it (the binding refuses calls there), and it must
//! not drop the client either (that would take the socket out of the epoll instance the parent
//! shares). But while any child keeps its copy open, the parent's `close()` sends no FIN: the
//! router holds the connection, and its slot, until the children end or its idle timeout.
//!
//! With [`close_client_sockets_in_fork_children`] (the Python binding turns it on when it
//! loads), every client connection made by [`crate::frontend::FrameConnection::connect`] is
//! noted with its two addresses, and a `pthread_atfork` child handler closes the child's copy
//! of each one still open. Closing one descriptor of a shared socket neither ends the
//! connection nor touches the parent's epoll registration (that lasts while any descriptor of
//! the socket is open). A descriptor number can be reused after its socket closed, so the
//! child closes a noted number only when the socket there still has both noted addresses
//! (two live TCP sockets never share them). The note list is bounded ([`NOTES`], the oldest
//! overwritten) and guarded by a spin lock that the fork's prepare handler holds across the
//! fork, so the child reads a consistent list (signals are blocked while a thread holds it,
//! so a handler that forks cannot wait for its own thread); the child handler uses only system
//! calls (`getsockname`, `getpeername`, `close`) and its own stack. Not covered: a fork in
//! the instant between a connection's `connect` and its note (that child keeps its copy, as
//! every child did before).

use std::cell::UnsafeCell;
use std::sync::Once;
use std::sync::atomic::{AtomicBool, Ordering};

/// Client connections noted at most (the oldest note is overwritten by the next).
pub const NOTES: usize = 1024;

/// One noted socket: its descriptor and both addresses as the kernel gave them.
#[derive(Clone, Copy)]
struct Note {
    fd: libc::c_int,
    local: Addr,
    peer: Addr,
}

/// A socket address as `getsockname`/`getpeername` write it.
#[derive(Clone, Copy)]
struct Addr {
    bytes: [u8; std::mem::size_of::<libc::sockaddr_storage>()],
    len: libc::socklen_t,
}

impl Addr {
    const NONE: Addr = Addr {
        bytes: [0; std::mem::size_of::<libc::sockaddr_storage>()],
        len: 0,
    };

    /// The local (`peer == false`) or remote address of socket `fd`.
    fn of(fd: libc::c_int, peer: bool) -> Option<Addr> {
        let mut a = Addr::NONE;
        a.len = a.bytes.len() as libc::socklen_t;
        let p = a.bytes.as_mut_ptr().cast::<libc::sockaddr>();
        // SAFETY: `p` points to `len` writable bytes; the kernel writes at most that many.
        let r = unsafe {
            if peer {
                libc::getpeername(fd, p, &mut a.len)
            } else {
                libc::getsockname(fd, p, &mut a.len)
            }
        };
        (r == 0 && a.len as usize <= a.bytes.len()).then_some(a)
    }

    fn same(&self, other: &Addr) -> bool {
        self.len == other.len
            && self.bytes[..self.len as usize] == other.bytes[..other.len as usize]
    }
}

impl Note {
    /// Whether the socket at `fd` is still the noted connection (a live TCP socket's two
    /// addresses are its own).
    fn still_open(&self) -> bool {
        Addr::of(self.fd, false).is_some_and(|a| a.same(&self.local))
            && Addr::of(self.fd, true).is_some_and(|a| a.same(&self.peer))
    }
}

/// The notes and the next slot to write, behind [`LOCKED`].
struct Notes(UnsafeCell<([Option<Note>; NOTES], usize)>);

// SAFETY: every access holds `LOCKED` (or runs in a fork child, where one thread exists and
// the prepare handler took `LOCKED` before the fork).
unsafe impl Sync for Notes {}

static NOTED: Notes = Notes(UnsafeCell::new(([None; NOTES], 0)));
static LOCKED: AtomicBool = AtomicBool::new(false);
static ENABLED: AtomicBool = AtomicBool::new(false);

fn lock() {
    while LOCKED
        .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
        .is_err()
    {
        std::hint::spin_loop();
    }
}

fn unlock() {
    LOCKED.store(false, Ordering::Release);
}

/// From now on, a `fork()` child of this process closes its copies of this process's client
/// connections (module docs). Idempotent.
pub fn close_client_sockets_in_fork_children() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: the three handlers are `extern "C"` functions that live for the process.
        let r = unsafe { libc::pthread_atfork(Some(prepare), Some(parent), Some(child)) };
        if r == 0 {
            ENABLED.store(true, Ordering::Release);
        } else {
            tracing::warn!(
                errno = r,
                "pthread_atfork failed: fork() children will keep copies of client connections"
            );
        }
    });
}

/// Note client socket `fd` (just connected) if [`close_client_sockets_in_fork_children`] is
/// on.
pub(crate) fn note_client_socket(fd: libc::c_int) {
    if !ENABLED.load(Ordering::Acquire) {
        return;
    }
    let (Some(local), Some(peer)) = (Addr::of(fd, false), Addr::of(fd, true)) else {
        return;
    };
    // Signals are blocked while the lock is held: a handler that forks on this thread would
    // otherwise wait in `prepare` for a lock its own thread holds.
    // SAFETY: a zeroed sigset is valid storage; sigfillset and pthread_sigmask only write it.
    let (mut all, mut was): (libc::sigset_t, libc::sigset_t) = unsafe { std::mem::zeroed() };
    // SAFETY: as above; both sets outlive the calls.
    unsafe {
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_BLOCK, &all, &mut was);
    }
    lock();
    // SAFETY: `LOCKED` is held.
    let (notes, next) = unsafe { &mut *NOTED.0.get() };
    notes[*next] = Some(Note { fd, local, peer });
    *next = (*next + 1) % NOTES;
    unlock();
    // SAFETY: restores the mask saved above.
    unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &was, std::ptr::null_mut()) };
}

extern "C" fn prepare() {
    lock();
}

extern "C" fn parent() {
    unlock();
}

extern "C" fn child() {
    // SAFETY: one thread runs in the child, and the prepare handler took the lock before the
    // fork: nobody else touches the notes.
    let (notes, _) = unsafe { &mut *NOTED.0.get() };
    close_noted(notes);
    unlock();
}

/// Close each noted descriptor whose socket still has both noted addresses, and forget every
/// note (async-signal-safe: system calls and the stack only).
fn close_noted(notes: &mut [Option<Note>]) {
    // Only slots that hold a note are written: the child's copy of the rest stays shared.
    for slot in notes.iter_mut().filter(|n| n.is_some()) {
        if let Some(n) = slot.take()
            && n.still_open()
        {
            // SAFETY: `n.fd` is open and is the noted connection (both addresses match).
            unsafe { libc::close(n.fd) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::os::fd::AsRawFd;

    fn note(s: &std::net::TcpStream) -> Note {
        let fd = s.as_raw_fd();
        Note {
            fd,
            local: Addr::of(fd, false).unwrap(),
            peer: Addr::of(fd, true).unwrap(),
        }
    }

    /// Only a descriptor that still is the noted connection is closed (its peer reads the end
    /// of the stream: it was the last descriptor); one whose number another connection now
    /// holds, and a number that holds nothing, are left alone.
    #[test]
    fn a_noted_connection_is_closed_and_a_reused_number_is_not() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let kept = std::net::TcpStream::connect(addr).unwrap();
        let (mut server_side, _) = listener.accept().unwrap();
        let mut notes = [Some(note(&kept))];
        close_noted(&mut notes);
        assert!(notes[0].is_none());
        std::mem::forget(kept); // its descriptor is closed
        server_side
            .set_read_timeout(Some(std::time::Duration::from_secs(30)))
            .unwrap();
        let mut byte = [0u8; 1];
        assert_eq!(
            server_side.read(&mut byte).unwrap(),
            0,
            "the peer did not see the connection end"
        );
        // The number reused by another connection (the note's addresses are the old one's).
        let old = std::net::TcpStream::connect(addr).unwrap();
        let stale = note(&old);
        drop(old);
        let other = std::net::TcpStream::connect(addr).unwrap();
        let other_note = note(&other);
        let mut notes = [Some(Note {
            fd: other.as_raw_fd(),
            ..stale
        })];
        close_noted(&mut notes);
        assert!(
            other_note.still_open(),
            "another socket on a reused number was closed"
        );
        // A number that holds nothing: nothing happens.
        let mut notes = [Some(Note {
            fd: 100_000,
            ..stale
        })];
        close_noted(&mut notes);
    }
}
