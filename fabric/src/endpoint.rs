//! Addresses as people write them: "host:port" with a host name or an IP address.
//!
//! Why this exists: the command line (`--router`, `--listen`, `--metrics`), the launcher and
//! the observers take addresses from people; a name is resolved here once, with a message that
//! says what is wrong (no port, no such host) instead of a bare resolver error.

use std::net::SocketAddr;

/// An address on the command line: "host:port" with a host name ("localhost:47400") or an IP
/// address; a name is resolved, preferring IPv4 (what the topology's loopback examples use).
pub fn parse_endpoint(s: &str) -> Result<SocketAddr, String> {
    let addrs = resolve_all(s)?;
    Ok(addrs
        .iter()
        .copied()
        .find(SocketAddr::is_ipv4)
        .unwrap_or(addrs[0]))
}

/// Every address "host:port" resolves to (at least one), or a message saying what is wrong.
pub fn resolve_all(s: &str) -> Result<Vec<SocketAddr>, String> {
    use std::net::ToSocketAddrs;
    if let Ok(a) = s.parse::<SocketAddr>() {
        return Ok(vec![a]);
    }
    if !s.contains(':') {
        return Err(format!(
            "{s:?} has no port; write HOST:PORT, e.g. 127.0.0.1:47400"
        ));
    }
    let addrs: Vec<SocketAddr> = s
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve {s:?}: {e}"))?
        .collect();
    if addrs.is_empty() {
        return Err(format!("{s:?} resolves to no address"));
    }
    Ok(addrs)
}
