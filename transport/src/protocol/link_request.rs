//! The link a connection asks for and its setup after authentication.
//!
//! Why this exists: a hello only names the link its sender asks for (shared memory, RDMA, or plain
//! TCP); both ends then agree (`negotiate`), exchange [`LinkInfo`] frames describing their sides,
//! fall back to TCP when either side cannot set the link up, and (shared memory) trade one raw
//! sync byte. These are the link-setup states of [`Connection`], kept apart from the handshake
//! and the credits.

use super::connection::{Connection, Event, State};
use super::error::ProtocolError;
use crate::codec::{Body, LinkInfo};
use std::time::Instant;

/// Prefix of a shared-memory attachment in a hello (followed by the ring file path).
pub const SHM_ATTACHMENT: &[u8] = b"shm:";
/// Prefix of an RDMA attachment in a hello (followed by the queue pair description).
pub const RDMA_ATTACHMENT: &[u8] = b"rdma:";
/// The raw byte each end of a shared-memory link writes on the TCP connection once it has
/// mapped the peer's ring. Any byte is accepted on receipt (only its arrival matters).
pub const SHM_SYNC_BYTE: u8 = 1;

/// Which driver carries the frames of a pair of ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LinkKind {
    /// TCP (any two hosts).
    Tcp,
    /// Shared-memory rings (ranks on one host); the TCP connection stays open for the
    /// handshake and dead-peer detection.
    Shm,
    /// RoCE / InfiniBand RC queue pair (feature `rdma`); set up over the TCP connection.
    Rdma,
}

impl LinkKind {
    /// Name used in logs and reports.
    pub fn name(self) -> &'static str {
        match self {
            Self::Tcp => "tcp",
            Self::Shm => "shm",
            Self::Rdma => "rdma",
        }
    }

    /// The link a hello attachment asks for.
    pub fn of_attachment(attachment: &[u8]) -> Self {
        if attachment.starts_with(SHM_ATTACHMENT) {
            Self::Shm
        } else if attachment.starts_with(RDMA_ATTACHMENT) {
            Self::Rdma
        } else {
            Self::Tcp
        }
    }

    /// The attachment prefix of this link kind (empty for TCP).
    pub fn attachment_prefix(self) -> &'static [u8] {
        match self {
            Self::Tcp => b"",
            Self::Shm => SHM_ATTACHMENT,
            Self::Rdma => RDMA_ATTACHMENT,
        }
    }
}

impl LinkKind {
    /// Every link kind, in the order help texts list them.
    pub const ALL: [LinkKind; 3] = [LinkKind::Tcp, LinkKind::Shm, LinkKind::Rdma];
}

/// A link kind name that is not `tcp`, `shm` or `rdma`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown link kind {0:?}: give tcp, shm or rdma")]
pub struct UnknownLinkKind(pub String);

impl std::str::FromStr for LinkKind {
    type Err = UnknownLinkKind;

    /// The kind named `s` ([`LinkKind::name`]: `tcp`, `shm`, `rdma`; case-insensitive).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|k| k.name().eq_ignore_ascii_case(s.trim()))
            .ok_or_else(|| UnknownLinkKind(s.to_owned()))
    }
}

impl std::fmt::Display for LinkKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The link kind and rank a dialer's first frame asks for: the acceptor asks for the same
/// link in its hello (nothing is created before authentication). A frame that is not a hello
/// asks for TCP from rank `u32::MAX` (the handshake then refuses it).
pub fn requested_link(first: &Body) -> (LinkKind, u32) {
    match first {
        Body::Hello(h) => (LinkKind::of_attachment(&h.attachment), h.rank),
        _ => (LinkKind::Tcp, u32::MAX),
    }
}

/// The link both ends use: the one both hellos ask for, else TCP.
pub(super) fn negotiate(local: LinkKind, peer_attachment: &[u8]) -> LinkKind {
    if local == LinkKind::of_attachment(peer_attachment) {
        local
    } else {
        LinkKind::Tcp
    }
}

/// Progress of the link-setup state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Setup {
    pub(super) kind: LinkKind,
    /// When link setup began (the link infos are due within the handshake timeout).
    pub(super) since: Instant,
    /// This end's link info was queued (`Some(false)`: this end cannot set the link up).
    pub(super) local_info: Option<bool>,
    /// The peer's link info, once received.
    pub(super) peer_info: Option<Vec<u8>>,
    /// When this end finished its own setup (`None`: not yet): the peer's sync byte is due
    /// within the handshake timeout from then.
    pub(super) local_ready_at: Option<Instant>,
    /// The peer's sync byte arrived.
    pub(super) peer_ready: bool,
}

impl Connection {
    /// This end has created its side of the link being set up: `attachment` describes it
    /// (the link prefix and a ring path or queue pair), or is empty when this end could not
    /// create it (the connection then carries frames over TCP). Queues a [`LinkInfo`] frame.
    pub fn link_prepared(&mut self, attachment: Vec<u8>) {
        let State::LinkSetup(s) = &mut self.state else {
            return;
        };
        if s.local_info.is_some() {
            return;
        }
        s.local_info = Some(!attachment.is_empty());
        self.transmit
            .push_back(Body::LinkInfo(LinkInfo { attachment }));
        self.maybe_tcp_fallback();
    }

    pub(super) fn on_link_info(&mut self, l: &LinkInfo) -> Result<(), ProtocolError> {
        if let State::LinkSetup(s) = &mut self.state {
            let kind = s.kind;
            if !l.attachment.is_empty() && LinkKind::of_attachment(&l.attachment) != kind {
                let e = ProtocolError::Config(format!(
                    "the peer described a {} link where both asked for {}",
                    LinkKind::of_attachment(&l.attachment).name(),
                    kind.name()
                ));
                return Err(self.fail(e, true));
            }
            s.peer_info = Some(l.attachment.clone());
        }
        self.maybe_tcp_fallback();
        Ok(())
    }

    /// The peer's description of its side of the link being set up (its [`LinkInfo`]), once
    /// received and usable.
    pub fn peer_link_info(&self) -> Option<&[u8]> {
        match &self.state {
            State::LinkSetup(s) => s.peer_info.as_deref().filter(|a| !a.is_empty()),
            _ => None,
        }
    }

    /// Whether this end waits for the peer's [`LinkInfo`].
    pub fn awaits_link_info(&self) -> bool {
        matches!(&self.state, State::LinkSetup(s) if s.peer_info.is_none())
    }

    /// Either side could not set the link up: the connection is a TCP link from now on.
    pub(super) fn maybe_tcp_fallback(&mut self) {
        let State::LinkSetup(s) = &self.state else {
            return;
        };
        let local_failed = s.local_info == Some(false);
        let peer_failed = s.peer_info.as_ref().is_some_and(|a| a.is_empty());
        if (local_failed && s.peer_info.is_some()) || (peer_failed && s.local_info.is_some()) {
            self.state = State::Established;
            if let Some(peer) = self.peer.clone() {
                self.events.push_back(Event::Established(peer));
            }
        }
    }

    /// The link being set up, while this end has not finished its own setup.
    pub fn pending_link(&self) -> Option<LinkKind> {
        match &self.state {
            State::LinkSetup(s) if s.local_ready_at.is_none() => Some(s.kind),
            _ => None,
        }
    }

    /// Whether the connection waits for raw setup bytes from the peer ([`Self::handle_raw`]).
    pub fn awaits_raw(&self) -> bool {
        matches!(&self.state, State::LinkSetup(s) if s.kind == LinkKind::Shm && !s.peer_ready)
    }

    /// This end has set up its side of the link (mapped the peer's ring, connected the queue
    /// pair) after both [`LinkInfo`]s were exchanged. A shared-memory link queues its sync
    /// byte; an RDMA link is established.
    pub fn link_ready(&mut self, now: Instant) {
        let State::LinkSetup(s) = &mut self.state else {
            return;
        };
        let infos_ok =
            s.local_info == Some(true) && s.peer_info.as_ref().is_some_and(|a| !a.is_empty());
        if s.local_ready_at.is_some() || !infos_ok {
            return;
        }
        s.local_ready_at = Some(now);
        if s.kind == LinkKind::Shm {
            self.transmit_raw = Some(SHM_SYNC_BYTE);
        }
        self.maybe_established();
    }

    /// This end could not set up its side of the link: closes without notifying the peer (it
    /// learns from the closed connection). The error starts with "link setup".
    pub fn link_setup_failed(&mut self, why: impl std::fmt::Display) -> ProtocolError {
        self.fail(ProtocolError::Closed(format!("link setup: {why}")), false)
    }

    /// Raw bytes to write on the stream outside any frame (the shared-memory sync byte).
    pub fn poll_transmit_raw(&mut self) -> Option<u8> {
        self.transmit_raw.take()
    }

    /// Feeds raw bytes read from the stream during link setup; returns how many were used (at
    /// most one: the peer's sync byte).
    pub fn handle_raw(&mut self, bytes: &[u8]) -> Result<usize, ProtocolError> {
        if let State::Closed(e) = &self.state {
            return Err(e.clone());
        }
        if bytes.is_empty() {
            return Ok(0);
        }
        if !self.awaits_raw() {
            let e = ProtocolError::Closed(format!(
                "{} unexpected raw bytes outside the shared-memory link setup",
                bytes.len()
            ));
            return Err(self.fail(e, false));
        }
        if let State::LinkSetup(s) = &mut self.state {
            s.peer_ready = true;
        }
        self.maybe_established();
        Ok(1)
    }

    /// Completes link setup once both ends are ready (an RDMA link needs no sync byte).
    pub(super) fn maybe_established(&mut self) {
        let State::LinkSetup(s) = &self.state else {
            return;
        };
        if s.local_ready_at.is_some() && (s.peer_ready || s.kind != LinkKind::Shm) {
            self.state = State::Established;
            if let Some(peer) = self.peer.clone() {
                self.events.push_back(Event::Established(peer));
            }
        }
    }
}
