//! Addresses as people write them: "host:port" with a host name or an IP address.
//!
//! Why this exists: the command line (`--router`, `--listen`, `--metrics`), the launcher and
//! the observers take addresses from people; a name is resolved here once, with a message that
//! says what is wrong (no port, no such host) instead of a bare resolver error.

use std::net::SocketAddr;

/// Why an address could not be used; the message says what to write instead.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EndpointError {
    /// Not "HOST:PORT".
    #[error("{0:?} has no port; write HOST:PORT, e.g. 127.0.0.1:47400")]
    NoPort(String),
    /// The host name did not resolve here (it may on the machine the address is for).
    #[error("cannot resolve {written:?}: {why}")]
    Unresolved {
        /// The address as written.
        written: String,
        /// The resolver's error.
        why: String,
    },
    /// The name resolved to nothing.
    #[error("{0:?} resolves to no address")]
    NoAddress(String),
}

/// An address on the command line: "host:port" with a host name ("localhost:47400") or an IP
/// address; a name is resolved, preferring IPv4 (what the topology's loopback examples use).
pub fn parse_endpoint(s: &str) -> Result<SocketAddr, EndpointError> {
    let addrs = resolve_all(s)?;
    Ok(addrs
        .iter()
        .copied()
        .find(SocketAddr::is_ipv4)
        .unwrap_or(addrs[0]))
}

/// Every address "host:port" resolves to (at least one), or what is wrong.
pub fn resolve_all(s: &str) -> Result<Vec<SocketAddr>, EndpointError> {
    use std::net::ToSocketAddrs;
    if let Ok(a) = s.parse::<SocketAddr>() {
        return Ok(vec![a]);
    }
    if !s.contains(':') {
        return Err(EndpointError::NoPort(s.to_owned()));
    }
    let addrs: Vec<SocketAddr> = s
        .to_socket_addrs()
        .map_err(|e| EndpointError::Unresolved {
            written: s.to_owned(),
            why: e.to_string(),
        })?
        .collect();
    if addrs.is_empty() {
        return Err(EndpointError::NoAddress(s.to_owned()));
    }
    Ok(addrs)
}
