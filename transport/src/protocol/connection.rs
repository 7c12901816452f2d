//! One end of one connection: its state, its queues, and the dispatch of received frames to the
//! handshake, link setup, credits and heartbeats.
//!
//! Why this exists: [`Connection`] is the sans-IO core every driver wraps; this module holds what
//! all its concerns share (the state, the transmit and event queues, closing) and routes each
//! received frame to the concern that handles it in the current state.

use super::config::{PeerInfo, ProtocolConfig};
use super::error::ProtocolError;
use super::link_request::{LinkKind, Setup};
use crate::codec::{
    Auth, Body, CLIENT_RANK, ErrorFrame, FORMAT_VERSION, Hello, NONCE_BYTES,
    PRE_AUTH_MAX_FRAME_BYTES,
};
use crate::crypto::{Key, Role, SessionKeys};
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

/// Something that happened on the connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// Authenticated, and both hellos asked for a shared-memory or RDMA link: the driver must
    /// set up its side from the peer's attachment, then call [`Connection::link_ready`] or
    /// [`Connection::link_setup_failed`].
    LinkSetup {
        /// The link to set up.
        kind: LinkKind,
        /// The peer (its attachment describes its side of the link).
        peer: PeerInfo,
    },
    /// Handshake, authentication and any link setup completed.
    Established(PeerInfo),
    /// The connection is closed; no further frames are accepted or produced.
    Closed(ProtocolError),
}

/// What the driver should do with a frame it passed to [`Connection::handle_frame`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Disposition {
    /// A protocol frame, fully handled.
    Consumed,
    /// An application frame: deliver it, and call [`Connection::release`] with its length once
    /// the application is done with it.
    Deliver,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum State {
    AwaitHello,
    AwaitAuth,
    /// Authenticated; the shared-memory or RDMA link is being set up.
    LinkSetup(Setup),
    Established,
    Closed(ProtocolError),
}

/// One end of one connection, without I/O.
#[derive(Debug)]
pub struct Connection {
    pub(super) cfg: Arc<ProtocolConfig>,
    pub(super) expected_peer: Option<u32>,
    pub(super) state: State,
    pub(super) peer: Option<PeerInfo>,
    pub(super) send_credit: u64,
    pub(super) recv_outstanding: u64,
    pub(super) release_pending: u64,
    pub(super) started: Instant,
    pub(super) last_rx: Instant,
    pub(super) last_tx: Instant,
    /// When [`Connection::handle_timeout`] last ran: a gap of more than two heartbeat
    /// intervals means this end was not running (see `heartbeats`).
    pub(super) last_timer: Instant,
    /// The `last_rx` a stall's grace set (a second stall without a frame in between gets no
    /// second grace: a starved host still notices a dead peer).
    pub(super) graced_rx: Option<Instant>,
    pub(super) heartbeat_seq: u64,
    pub(super) heartbeat_queued: bool,
    pub(super) transmit: VecDeque<Body>,
    pub(super) transmit_raw: Option<u8>,
    pub(super) events: VecDeque<Event>,
    pub(super) local_link: LinkKind,
    pub(super) role: Role,
    pub(super) local_hello_meta: Vec<u8>,
    /// The key shared with the peer, once its hello named who it is (credentials only).
    pub(super) pair_key: Option<Key>,
    pub(super) transcript: [u8; 32],
    pub(super) session: Option<SessionKeys>,
    /// Who the peer's hello claimed to be, for refusal logs.
    pub(super) claimed: Option<String>,
}

impl Connection {
    /// A new connection end. `expected_peer` is the rank dialled (`None` when accepting, and
    /// for a frontend client, which serves under whichever router rank answers);
    /// `nonce` must be fresh random bytes; `attachment` goes into our hello. Queues our hello.
    pub fn new(
        cfg: Arc<ProtocolConfig>,
        expected_peer: Option<u32>,
        nonce: [u8; NONCE_BYTES],
        attachment: Vec<u8>,
        now: Instant,
    ) -> Self {
        let local_link = LinkKind::of_attachment(&attachment);
        let identity = cfg
            .credentials
            .as_ref()
            .and_then(|c| c.frontend_name())
            .filter(|_| cfg.local_rank == CLIENT_RANK)
            .unwrap_or_default()
            .to_owned();
        let hello = Hello {
            format_version: FORMAT_VERSION,
            cluster: cfg.cluster.clone(),
            rank: cfg.local_rank,
            world_size: cfg.world_size,
            recv_window_bytes: cfg.recv_window_bytes,
            auth_required: cfg.credentials.is_some(),
            nonce,
            attachment,
            // With credentials these travel sealed in the auth answer instead (issue 27).
            incarnation: if cfg.credentials.is_some() {
                0
            } else {
                cfg.incarnation
            },
            fingerprint: if cfg.credentials.is_some() {
                [0; crate::codec::FINGERPRINT_BYTES]
            } else {
                cfg.fingerprint
            },
            identity,
        };
        let local_hello_meta = crate::codec::hello_meta(&hello);
        // A frontend client always dials (it takes whichever router answers).
        let role = if expected_peer.is_some() || cfg.local_rank == CLIENT_RANK {
            Role::Dialer
        } else {
            Role::Acceptor
        };
        let mut transmit = VecDeque::with_capacity(8);
        transmit.push_back(Body::Hello(hello));
        Self {
            cfg,
            expected_peer,
            state: State::AwaitHello,
            peer: None,
            send_credit: 0,
            recv_outstanding: 0,
            release_pending: 0,
            started: now,
            last_rx: now,
            last_tx: now,
            last_timer: now,
            graced_rx: None,
            heartbeat_seq: 0,
            heartbeat_queued: false,
            transmit,
            transmit_raw: None,
            events: VecDeque::with_capacity(4),
            local_link,
            role,
            local_hello_meta,
            pair_key: None,
            transcript: [0; 32],
            session: None,
            claimed: None,
        }
    }

    /// This connection's per-direction session keys, once the peer's hello is in (with
    /// credentials only). The driver seals every frame it writes after this end's [`Auth`],
    /// and opens every frame it reads after the peer's [`Auth`], with them.
    pub fn session_keys(&self) -> Option<&SessionKeys> {
        self.session.as_ref()
    }

    /// Whether frames after `body` on the wire are sealed (it is an [`Auth`] with a MAC).
    pub fn seals_after(body: &Body) -> bool {
        matches!(body, Body::Auth(Auth { mac: Some(_), .. }))
    }

    /// Who the peer's hello claimed to be ("rank 3", "frontend \"fe\""), once received.
    pub fn claimed_peer(&self) -> Option<&str> {
        self.claimed.as_deref()
    }

    /// Whether the handshake has completed and the connection is open.
    pub fn is_established(&self) -> bool {
        self.state == State::Established
    }

    /// The error that closed the connection, if it is closed.
    pub fn close_reason(&self) -> Option<&ProtocolError> {
        match &self.state {
            State::Closed(e) => Some(e),
            _ => None,
        }
    }

    /// The peer's hello, once received.
    pub fn peer(&self) -> Option<&PeerInfo> {
        self.peer.as_ref()
    }

    pub(super) fn fail(&mut self, err: ProtocolError, notify_peer: bool) -> ProtocolError {
        if let State::Closed(e) = &self.state {
            return e.clone();
        }
        if notify_peer {
            self.transmit.clear();
            self.transmit.push_back(Body::Error(ErrorFrame {
                request_id: 0,
                part: None,
                code: err.wire_code(),
                message: err.to_string(),
            }));
        } else {
            self.transmit.clear();
        }
        self.transmit_raw = None;
        self.state = State::Closed(err.clone());
        self.events.push_back(Event::Closed(err.clone()));
        err
    }

    /// Closes the connection locally (no frame is sent).
    pub fn close(&mut self, reason: impl Into<String>) {
        self.fail(ProtocolError::Closed(reason.into()), false);
    }

    /// Records that the transport itself failed (I/O error, peer gone).
    pub fn transport_failed(&mut self, err: ProtocolError) {
        self.fail(err, false);
    }

    /// Feeds one received, decoded frame of `frame_len` bytes.
    pub fn handle_frame(
        &mut self,
        now: Instant,
        body: &Body,
        frame_len: u64,
    ) -> Result<Disposition, ProtocolError> {
        let result = self.dispatch_frame(now, body, frame_len);
        self.check_invariants();
        result
    }

    /// [`Self::handle_frame`] without the invariant check: hands the frame to the concern
    /// that handles it in the current state, or refuses it.
    fn dispatch_frame(
        &mut self,
        now: Instant,
        body: &Body,
        frame_len: u64,
    ) -> Result<Disposition, ProtocolError> {
        self.last_rx = now;
        if matches!(self.state, State::AwaitHello | State::AwaitAuth)
            && frame_len > PRE_AUTH_MAX_FRAME_BYTES as u64
        {
            return Err(self.fail(ProtocolError::PreAuthTooLarge { len: frame_len }, true));
        }
        match (&self.state, body) {
            (State::Closed(e), _) => Err(e.clone()),
            (_, Body::Error(e)) if !self.is_established() => Err(self.fail(
                ProtocolError::Refused {
                    code: e.code,
                    message: e.message.clone(),
                },
                false,
            )),
            (State::AwaitHello, Body::Hello(h)) => {
                self.on_hello(h)?;
                Ok(Disposition::Consumed)
            }
            (State::AwaitAuth, Body::Auth(a)) => {
                self.on_auth(a)?;
                Ok(Disposition::Consumed)
            }
            (State::LinkSetup(s), Body::LinkInfo(l)) if s.peer_info.is_none() => {
                self.on_link_info(l)?;
                Ok(Disposition::Consumed)
            }
            (State::Established, Body::Heartbeat(_)) => Ok(Disposition::Consumed),
            (State::Established, Body::Credit(c)) => {
                self.on_credit(c.bytes);
                Ok(Disposition::Consumed)
            }
            (State::Established, b) if b.kind().is_application() => {
                self.on_application_frame(frame_len)
            }
            (state, b) => {
                let where_ = match state {
                    State::AwaitHello => "before the peer's hello",
                    State::AwaitAuth => "while waiting for authentication",
                    State::LinkSetup(_) => "during link setup",
                    _ => "after the handshake",
                };
                Err(self.fail(
                    ProtocolError::UnexpectedFrame {
                        kind: b.kind(),
                        state: where_,
                    },
                    true,
                ))
            }
        }
    }

    /// The next protocol frame to send (hello, auth, credit, heartbeat, or an error before
    /// closing). Application frames are sent by the driver directly after [`Self::try_reserve`].
    pub fn poll_transmit(&mut self) -> Option<Body> {
        let b = self.transmit.pop_front();
        if matches!(b, Some(Body::Heartbeat(_))) {
            self.heartbeat_queued = false;
        }
        b
    }

    /// Whether protocol frames are waiting in [`Self::poll_transmit`].
    pub fn has_transmit(&self) -> bool {
        !self.transmit.is_empty()
    }

    /// Records that a frame was written at `now` (postpones the next heartbeat).
    pub fn on_transmit(&mut self, now: Instant) {
        self.last_tx = now;
    }

    /// The next event.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }
}
