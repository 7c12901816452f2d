//! The bytes RDMA endpoints describe themselves with: the link info a side sends in the sealed
//! link-info frame, and the libfabric provider's endpoint description inside it.
//!
//! Why this exists: these come from the peer, so they are parsed like any untrusted bytes (the
//! peer authenticated, but a bug or an old build must give an error, not a panic or a wrong
//! endpoint). Kept apart from the providers, and compiled in every build, so one fuzz target
//! (`fuzz/fuzz_targets/rdma_link_info.rs`) and the unit tests reach them without a NIC.

use super::RdmaError;

/// A side's RDMA link info (after the protocol's `rdma:` prefix): which provider it uses, its
/// ring size, and the provider's endpoint description.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinkInfo<'a> {
    /// The provider tag (1 verbs, 2 libfabric, 3 in-process).
    pub provider_tag: u8,
    /// Bytes in each ring.
    pub ring_capacity: u64,
    /// The provider's endpoint description.
    pub endpoint: &'a [u8],
}

impl LinkInfo<'_> {
    /// Appends the encoding to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.push(self.provider_tag);
        out.extend_from_slice(&self.ring_capacity.to_le_bytes());
        out.extend_from_slice(self.endpoint);
    }
}

/// Parses a link info.
pub fn decode_link_info(b: &[u8]) -> Result<LinkInfo<'_>, RdmaError> {
    let (&provider_tag, rest) = b
        .split_first()
        .ok_or_else(|| RdmaError::BadPeerInfo("empty link info".into()))?;
    let (cap, endpoint) = rest
        .split_at_checked(8)
        .ok_or_else(|| RdmaError::BadPeerInfo(format!("link info of {} bytes", b.len())))?;
    let mut c = [0u8; 8];
    c.copy_from_slice(cap);
    Ok(LinkInfo {
        provider_tag,
        ring_capacity: u64::from_le_bytes(c),
        endpoint,
    })
}

/// A libfabric endpoint: the provider name (both ends must use the same string), the address
/// from `fi_getname`, and the receive ring's remote base and key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FabricEndpoint<'a> {
    /// libfabric provider, e.g. `tcp;ofi_rxm`.
    pub provider: &'a [u8],
    /// The endpoint address from `fi_getname` (never empty).
    pub name: &'a [u8],
    /// Remote base of the receive ring (its address when the provider uses virtual addresses,
    /// else 0).
    pub base: u64,
    /// Remote key of the receive ring.
    pub key: u64,
}

impl FabricEndpoint<'_> {
    /// Appends the encoding to `out` (`provider` at most 255 bytes, `name` at most 65535).
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.push(self.provider.len().min(255) as u8);
        out.extend_from_slice(&self.provider[..self.provider.len().min(255)]);
        let n = self.name.len().min(u16::MAX as usize);
        out.extend_from_slice(&(n as u16).to_le_bytes());
        out.extend_from_slice(&self.name[..n]);
        out.extend_from_slice(&self.base.to_le_bytes());
        out.extend_from_slice(&self.key.to_le_bytes());
    }
}

/// Parses a libfabric endpoint description.
pub fn decode_fabric_endpoint(b: &[u8]) -> Result<FabricEndpoint<'_>, RdmaError> {
    let bad = |why: &str| RdmaError::BadPeerInfo(format!("libfabric endpoint: {why}"));
    let (&plen, rest) = b.split_first().ok_or_else(|| bad("empty"))?;
    let (provider, rest) = rest
        .split_at_checked(plen as usize)
        .ok_or_else(|| bad("short provider name"))?;
    let (nlen, rest) = rest.split_at_checked(2).ok_or_else(|| bad("short"))?;
    let nlen = u16::from_le_bytes([nlen[0], nlen[1]]) as usize;
    if nlen == 0 || rest.len() != nlen + 16 {
        return Err(bad("malformed address"));
    }
    let (name, tail) = rest.split_at(nlen);
    let mut base = [0u8; 8];
    let mut key = [0u8; 8];
    base.copy_from_slice(&tail[..8]);
    key.copy_from_slice(&tail[8..16]);
    Ok(FabricEndpoint {
        provider,
        name,
        base: u64::from_le_bytes(base),
        key: u64::from_le_bytes(key),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_info_round_trips_and_short_input_is_an_error() {
        let info = LinkInfo {
            provider_tag: 2,
            ring_capacity: 32 << 20,
            endpoint: b"endpoint bytes",
        };
        let mut b = Vec::new();
        info.encode(&mut b);
        assert_eq!(decode_link_info(&b).unwrap(), info);
        for cut in 0..9 {
            assert!(decode_link_info(&b[..cut]).is_err(), "{cut} bytes");
        }
    }

    #[test]
    fn fabric_endpoint_round_trips_and_every_truncation_is_an_error() {
        let ep = FabricEndpoint {
            provider: b"tcp;ofi_rxm",
            name: &[2, 0, 0x9c, 0x40, 127, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0],
            base: 0x7f00_1234_0000,
            key: 1,
        };
        let mut b = Vec::new();
        ep.encode(&mut b);
        assert_eq!(decode_fabric_endpoint(&b).unwrap(), ep);
        for cut in 0..b.len() {
            assert!(decode_fabric_endpoint(&b[..cut]).is_err(), "{cut} bytes");
        }
        b.push(0);
        assert!(decode_fabric_endpoint(&b).is_err(), "a trailing byte");
    }
}
