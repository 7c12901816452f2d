//! Free ports (on loopback, or on another of this machine's addresses) for the processes a
//! local fabric, a bench or a test starts here.
//!
//! Why this exists: a port found by binding port 0 comes from the kernel's ephemeral range,
//! the range every outgoing connection's local port is also taken from. Between releasing such
//! a port and the new process binding it, any connection made on the machine may take it, and
//! the process fails with "Address already in use" (seen once in a full test run on a 2-vCPU
//! VM: a fault-test worker lost its port to another test's connection). Ports below the
//! ephemeral range (`/proc/sys/net/ipv4/ip_local_port_range`) are never given to outgoing
//! connections: they are picked at random there, checked with a bind, and never handed out
//! twice by one process. Where that range is too small (or unreadable), port 0 is used as
//! before.

use std::collections::BTreeSet;
use std::net::{IpAddr, TcpListener};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

/// Lowest port picked (below it live the well-known and registered services).
const LOWEST: u16 = 10_000;
/// Random tries before falling back to port 0.
const TRIES: usize = 2_000;

/// Ports this process has handed out (never handed out again).
static HANDED: Mutex<BTreeSet<u16>> = Mutex::new(BTreeSet::new());
/// Mixed into each pick, so two calls in one nanosecond still differ.
static CALLS: AtomicU64 = AtomicU64::new(0);

/// The first of `n` consecutive loopback ports (127.0.0.1) that are free now, below the
/// ephemeral range where it leaves room (else from it, as binding port 0 gives them).
///
/// Free means each one could be bound just now: another process may still bind it first,
/// though no outgoing connection will.
///
/// # Errors
///
/// When no such run could be bound (`n` is 0 or the machine's ports are exhausted).
pub fn free_loopback_ports(n: u16) -> std::io::Result<u16> {
    free_ports(IpAddr::from([127, 0, 0, 1]), n)
}

/// [`free_loopback_ports`] on the address `ip` (each port checked with a bind there; an
/// unspecified address such as 0.0.0.0 checks every interface's).
///
/// # Errors
///
/// When no such run could be bound (`n` is 0, `ip` is not this machine's, or its ports are
/// exhausted).
pub fn free_ports(ip: IpAddr, n: u16) -> std::io::Result<u16> {
    if n == 0 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "asked for 0 free ports",
        ));
    }
    let below = ephemeral_low().unwrap_or(0);
    if below >= LOWEST.saturating_add(n).saturating_add(1_000) {
        let span = u64::from(below - LOWEST - n);
        let mut handed = HANDED.lock().unwrap_or_else(|e| e.into_inner());
        for _ in 0..TRIES {
            let base = LOWEST + (mix() % span) as u16;
            if (base..base + n).any(|p| handed.contains(&p)) {
                continue;
            }
            let held: Result<Vec<TcpListener>, _> = (base..base + n)
                .map(|p| TcpListener::bind((ip, p)))
                .collect();
            if held.is_ok() {
                handed.extend(base..base + n);
                return Ok(base);
            }
        }
    }
    let base = ephemeral_run(ip, n)?;
    // Never handed out twice either (several calls of one process, as for up's workers).
    HANDED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .extend(base..base + n);
    Ok(base)
}

/// `n` consecutive ports around one the kernel picks (the ephemeral range).
fn ephemeral_run(ip: IpAddr, n: u16) -> std::io::Result<u16> {
    for _ in 0..TRIES {
        let first = TcpListener::bind((ip, 0))?;
        let base = first.local_addr()?.port();
        let Some(end) = base.checked_add(n) else {
            continue;
        };
        let rest: Result<Vec<TcpListener>, _> = (base + 1..end)
            .map(|p| TcpListener::bind((ip, p)))
            .collect();
        if rest.is_ok() {
            return Ok(base);
        }
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::AddrInUse,
        format!("no {n} consecutive free ports found on {ip}"),
    ))
}

/// The first port of the kernel's ephemeral range, if it can be read.
fn ephemeral_low() -> Option<u16> {
    let text = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok()?;
    text.split_whitespace().next()?.parse().ok()
}

/// A fresh pseudo-random number (SplitMix64 over the clock, the process id and a counter).
fn mix() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mut z = nanos
        ^ (u64::from(std::process::id()) << 32)
        ^ CALLS
            .fetch_add(1, Ordering::Relaxed)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_are_bindable_outside_the_ephemeral_range_and_never_handed_out_twice() {
        let low = ephemeral_low();
        let mut seen = BTreeSet::new();
        for n in [1u16, 2, 3, 1, 2] {
            let base = free_loopback_ports(n).unwrap();
            for p in base..base + n {
                assert!(seen.insert(p), "port {p} handed out twice");
                TcpListener::bind(("127.0.0.1", p)).unwrap();
            }
            if let Some(low) = low.filter(|&l| l >= LOWEST + 1_100) {
                assert!(
                    base >= LOWEST && base + n <= low,
                    "{base}+{n} (range from {low})"
                );
            }
        }
        assert!(free_loopback_ports(0).is_err());
    }
}
