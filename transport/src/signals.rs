//! Stop signals and the native libraries linked beside the transport.
//!
//! Why this exists: libraries linked for RDMA can install SIGINT/SIGTERM handlers from their
//! load-time constructors (libfabric 1.17's PSM providers, `libpsm_infinipath` and
//! `libpsm2`, do, and end the process with status 1). Tokio's signal registration keeps a
//! handler it finds in place and calls it after its own, so such a handler ended `up`, a
//! router or a worker with status 1 in the middle of its graceful stop (seen with
//! `--features libfabric`: `up` exited 1 on Ctrl-C without printing "stopping"). A process
//! resets both signals to their default action once, before it registers its own handlers; its
//! graceful stop then closes every link (and every libfabric object) on the way out.

use std::sync::Once;

/// The current action of `sig`, or None if it cannot be read.
fn action(sig: libc::c_int) -> Option<libc::sighandler_t> {
    // SAFETY: a zeroed sigaction is a valid plain C struct; with a null new action sigaction
    // only writes the current one into `old`.
    let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
    // SAFETY: as above; `old` outlives the call.
    let r = unsafe { libc::sigaction(sig, std::ptr::null(), &mut old) };
    (r == 0).then_some(old.sa_sigaction)
}

/// Installs `handler` (SIG_DFL, SIG_IGN or a function) for `sig`, with an empty mask and no
/// flags; whether it was installed.
fn set_action(sig: libc::c_int, handler: libc::sighandler_t) -> bool {
    // SAFETY: a zeroed sigaction is a valid plain C struct (empty mask, no flags).
    let mut act: libc::sigaction = unsafe { std::mem::zeroed() };
    act.sa_sigaction = handler;
    // SAFETY: `act` is a valid action for a catchable signal; the old action is not asked for.
    unsafe { libc::sigaction(sig, &act, std::ptr::null_mut()) == 0 }
}

/// Resets SIGINT and SIGTERM to their default action where a handler is installed (by a linked
/// library: the process has registered none yet), once per process; later calls do nothing, so
/// they never remove a handler the process registered after the first. Returns the signals
/// reset by this call.
pub fn reset_stop_handlers_set_by_libraries() -> Vec<&'static str> {
    static ONCE: Once = Once::new();
    let mut reset = Vec::new();
    ONCE.call_once(|| {
        for (sig, name) in [(libc::SIGINT, "SIGINT"), (libc::SIGTERM, "SIGTERM")] {
            let Some(current) = action(sig) else {
                continue;
            };
            if current != libc::SIG_DFL
                && current != libc::SIG_IGN
                && set_action(sig, libc::SIG_DFL)
            {
                reset.push(name);
            }
        }
    });
    reset
}

#[cfg(test)]
mod tests {
    use super::*;

    extern "C" fn library_handler(_: libc::c_int) {}

    /// A handler installed before the first call (as a library constructor would) is reset;
    /// one installed after it is left alone. (The only test of the crate that touches
    /// SIGTERM's disposition.)
    #[test]
    fn a_library_handler_is_reset_once_and_later_handlers_are_kept() {
        let handler = library_handler as extern "C" fn(libc::c_int) as libc::sighandler_t;
        assert!(set_action(libc::SIGTERM, handler));
        assert!(reset_stop_handlers_set_by_libraries().contains(&"SIGTERM"));
        assert_eq!(action(libc::SIGTERM), Some(libc::SIG_DFL));
        assert!(set_action(libc::SIGTERM, handler));
        assert!(reset_stop_handlers_set_by_libraries().is_empty());
        assert_eq!(action(libc::SIGTERM), Some(handler));
        assert!(set_action(libc::SIGTERM, libc::SIG_DFL));
    }
}
