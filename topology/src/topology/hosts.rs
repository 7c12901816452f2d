//! Which listeners of a topology share a socket: every written address resolved to the IPs it
//! stands for, so that `localhost` and `127.0.0.1` (or two spellings of one host) are seen as
//! one machine.
//!
//! Resolution goes through the system resolver (`std::net::ToSocketAddrs`: the hosts file, then
//! DNS); nothing is ever sent to the hosts themselves. IP literals are not resolved, nor are
//! special-use names that no resolver should be asked about (RFC 6761 / 2606: `.invalid`,
//! `.test`, `.example`, `example.com|net|org`, and mDNS `.local`; `localhost` is loopback by
//! definition). `EXPERTMESH_RESOLVE_HOSTS=0` turns resolution off (fuzzing, sandboxes without a
//! resolver). Hostnames are resolved once each, on a few threads, within [`RESOLVE_BUDGET`]; a
//! name that is not resolved (in time, or at all) is compared by its spelling, as before.

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, ToSocketAddrs};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

/// How long resolving the hostnames of one file may take in all.
pub(super) const RESOLVE_BUDGET: Duration = Duration::from_secs(2);

/// Resolver threads per file.
const RESOLVER_THREADS: usize = 4;

/// What one listening address stands for.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(super) enum Addr {
    /// An IP address.
    Ip(IpAddr),
    /// A hostname that did not resolve, by its lower-case spelling.
    Name(String),
}

/// One address as written, and what it stands for.
#[derive(Clone, Debug)]
pub(super) struct Host {
    /// The addresses a listener on it occupies.
    pub(super) addrs: Vec<Addr>,
    /// A hostname (not an IP literal) that resolved: messages say what it resolved to.
    pub(super) resolved_name: bool,
    /// `0.0.0.0` or `::`: every address of its machine.
    pub(super) wildcard: bool,
}

/// Resolve every distinct written address once.
pub(super) fn resolve_all<'a>(written: impl IntoIterator<Item = &'a str>) -> HashMap<String, Host> {
    let distinct: HashSet<&str> = written.into_iter().collect();
    let resolve = std::env::var("EXPERTMESH_RESOLVE_HOSTS").map_or(true, |v| v != "0");
    let names: Vec<String> = distinct
        .iter()
        .filter(|h| resolve && h.parse::<IpAddr>().is_err() && !special_use(h))
        .map(|h| h.to_string())
        .collect();
    let resolved = resolve_names(names);
    distinct
        .into_iter()
        .map(|h| (h.to_owned(), host(h, resolved.get(h))))
        .collect()
}

/// Names no resolver is asked about: reserved for documentation and tests, never registered
/// (RFC 2606, RFC 6761), loopback by definition, or multicast DNS.
fn special_use(name: &str) -> bool {
    let n = name.trim_end_matches('.').to_ascii_lowercase();
    let tld = n.rsplit('.').next().unwrap_or("");
    matches!(tld, "invalid" | "test" | "example" | "localhost" | "local")
        || n == "localhost"
        || ["example.com", "example.net", "example.org"]
            .iter()
            .any(|d| n == *d || n.ends_with(&format!(".{d}")))
}

/// What `written` stands for, given what the resolver said for a hostname.
fn host(written: &str, resolved: Option<&Vec<IpAddr>>) -> Host {
    if let Ok(ip) = written.parse::<IpAddr>() {
        return Host {
            addrs: vec![Addr::Ip(ip)],
            resolved_name: false,
            wildcard: ip.is_unspecified(),
        };
    }
    let lower = written.to_ascii_lowercase();
    let mut ips: Vec<IpAddr> = resolved.cloned().unwrap_or_default();
    let localhost = lower == "localhost" || lower.ends_with(".localhost");
    // A name for loopback occupies whichever loopback address the resolver lists first, so it is
    // taken to collide with an explicit 127.0.0.1 or ::1 (RFC 6761: localhost is loopback).
    if localhost || ips.iter().any(IpAddr::is_loopback) {
        for lo in [
            IpAddr::V4(Ipv4Addr::LOCALHOST),
            IpAddr::V6(Ipv6Addr::LOCALHOST),
        ] {
            if !ips.contains(&lo) {
                ips.push(lo);
            }
        }
    }
    if ips.is_empty() {
        return Host {
            addrs: vec![Addr::Name(lower)],
            resolved_name: false,
            wildcard: false,
        };
    }
    Host {
        addrs: ips.into_iter().map(Addr::Ip).collect(),
        resolved_name: true,
        wildcard: false,
    }
}

/// Resolve hostnames on a few threads until all are done or the budget is spent; a name missing
/// from the result did not resolve (in time).
fn resolve_names(names: Vec<String>) -> HashMap<String, Vec<IpAddr>> {
    let mut out = HashMap::new();
    if names.is_empty() {
        return out;
    }
    let total = names.len();
    let queue = Arc::new(Mutex::new(names));
    let (tx, rx) = mpsc::channel();
    for _ in 0..RESOLVER_THREADS.min(total) {
        let queue = Arc::clone(&queue);
        let tx = tx.clone();
        // Detached: a lookup that outlives the budget finishes (or times out) on its own and
        // its answer is dropped.
        std::thread::spawn(move || {
            loop {
                let next = queue.lock().ok().and_then(|mut q| q.pop());
                let Some(name) = next else { break };
                let ips: Vec<IpAddr> = (name.as_str(), 0)
                    .to_socket_addrs()
                    .map(|a| a.map(|s| s.ip()).collect())
                    .unwrap_or_default();
                if tx.send((name, ips)).is_err() {
                    break;
                }
            }
        });
    }
    drop(tx);
    let deadline = Instant::now() + RESOLVE_BUDGET;
    while out.len() < total {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok((name, ips)) => {
                out.insert(name, ips);
            }
            Err(_) => break,
        }
    }
    out.retain(|_, ips| !ips.is_empty());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn special_use_names_are_not_looked_up() {
        for n in [
            "a.invalid",
            "host-b.example",
            "x.test",
            "node.local",
            "www.example.com",
        ] {
            assert!(special_use(n), "{n}");
        }
        for n in [
            "node0",
            "gpu-host.cluster.internal",
            "examples.com",
            "invalidate",
        ] {
            assert!(!special_use(n), "{n}");
        }
    }

    #[test]
    fn literals_names_and_loopback() {
        let hosts = resolve_all(["127.0.0.1", "localhost", "0.0.0.0", "no-such-host.invalid"]);
        let lo = Addr::Ip(IpAddr::V4(Ipv4Addr::LOCALHOST));
        assert_eq!(hosts["127.0.0.1"].addrs, vec![lo.clone()]);
        assert!(hosts["localhost"].addrs.contains(&lo));
        assert!(hosts["localhost"].resolved_name);
        assert!(hosts["0.0.0.0"].wildcard);
        assert_eq!(
            hosts["no-such-host.invalid"].addrs,
            vec![Addr::Name("no-such-host.invalid".into())]
        );
    }
}
