//! The handshake and authentication: checking the peer's hello, finding the key shared with the
//! identity it claims, and verifying its transcript MAC.
//!
//! Why this exists: this is where a connection decides who the peer is. A hello is checked
//! (version, cluster, rank, world size, window; the fingerprint too without credentials)
//! before it is answered; the answer is an [`Auth`] whose MAC binds the key of the claimed
//! identity ([`Credentials`]: per rank pair, or per frontend) to a hash of both hellos
//! ([`crypto::transcript`]), and the same transcript derives the session keys. With
//! credentials the [`Auth`] also carries the sender's incarnation and fingerprint sealed under
//! a key of that pair and transcript ([`crypto::seal_identity`]), so nothing readable on the
//! wire says which process or which weights a rank is; they are opened and the fingerprint
//! checked once the MAC verified. A peer that cannot produce the MAC never reaches the
//! established state.
//!
//! [`Credentials`]: crate::crypto::Credentials

use super::config::PeerInfo;
use super::connection::{Connection, Event, State};
use super::error::ProtocolError;
use super::link_request::{LinkKind, Setup, negotiate};
use crate::codec::{Auth, Body, CLIENT_RANK, FINGERPRINT_BYTES, FORMAT_VERSION, FrameKind, Hello};
use crate::crypto::{self, Key, Role};

/// The first bytes of a fingerprint in hex, for messages and logs.
pub fn short_hex(fp: &[u8; FINGERPRINT_BYTES]) -> String {
    fp[..6].iter().map(|b| format!("{b:02x}")).collect()
}

/// Who a hello claims to be, for logs ("rank 3", "frontend \"fe-1\"").
pub fn describe_claim(h: &Hello) -> String {
    if h.rank == CLIENT_RANK {
        format!("frontend {:?}", h.identity)
    } else {
        format!("rank {}", h.rank)
    }
}

impl Connection {
    /// The checks a peer's hello must pass before it is answered: version, cluster, rank,
    /// world size, receive window and (when configured) the fingerprint of what it serves.
    pub(super) fn check_hello(&self, h: &Hello) -> Result<(), ProtocolError> {
        if h.format_version != FORMAT_VERSION {
            return Err(ProtocolError::VersionMismatch {
                theirs: h.format_version,
            });
        }
        if h.cluster != self.cfg.cluster {
            let e = ProtocolError::ClusterMismatch {
                ours: self.cfg.cluster.clone(),
                theirs: h.cluster.clone(),
            };
            return Err(e);
        }
        if let Some(expected) = self.expected_peer
            && h.rank != expected
        {
            return Err(ProtocolError::UnexpectedRank {
                expected,
                got: h.rank,
            });
        }
        // A frontend client takes whichever router answers: a router's frontend listener
        // announces its instance as the last rank of its world. A mesh port announces the
        // whole mesh; one of a rank other than 0 (a worker's, typically) is refused here with
        // the rank it announced, so the client can say which port it reached.
        if self.cfg.local_rank == CLIENT_RANK
            && self.expected_peer.is_none()
            && h.rank != 0
            && h.rank.checked_add(1) != Some(h.world_size)
        {
            return Err(ProtocolError::UnexpectedRank {
                expected: h.world_size.saturating_sub(1),
                got: h.rank,
            });
        }
        if self.cfg.clients_only && h.rank != CLIENT_RANK {
            return Err(ProtocolError::AuthFailed(format!(
                "rank {} dialled a router's frontend port: only frontends connect here (mesh \
                 ranks use the mesh port of the topology)",
                h.rank
            )));
        }
        let client_ok = h.rank == CLIENT_RANK && self.cfg.accept_clients;
        let server_ok = self.cfg.local_rank == CLIENT_RANK && h.rank < h.world_size;
        if !client_ok
            && !server_ok
            && (h.rank >= self.cfg.world_size || h.rank == self.cfg.local_rank)
        {
            return Err(ProtocolError::BadRank {
                rank: h.rank,
                world_size: self.cfg.world_size,
            });
        }
        if !client_ok && !server_ok && h.world_size != self.cfg.world_size {
            return Err(ProtocolError::Config(format!(
                "rank {} is configured for {} ranks, this node for {}; use the same rank list everywhere",
                h.rank, h.world_size, self.cfg.world_size
            )));
        }
        if h.recv_window_bytes < self.cfg.codec.max_frame_bytes as u64 {
            return Err(ProtocolError::Config(format!(
                "peer's receive window {} is smaller than max_frame_bytes {}",
                h.recv_window_bytes, self.cfg.codec.max_frame_bytes
            )));
        }
        // With credentials the fingerprint comes sealed in the auth answer and is checked
        // there ([`Connection::on_auth`]); the hello's is zero.
        if self.cfg.credentials.is_none() {
            self.check_fingerprint(h.rank, &h.fingerprint)?;
        }
        Ok(())
    }

    /// Whether `fingerprint` is what rank `rank` must serve (when this end knows).
    fn check_fingerprint(
        &self,
        rank: u32,
        fingerprint: &[u8; FINGERPRINT_BYTES],
    ) -> Result<(), ProtocolError> {
        if let Some(table) = &self.cfg.peer_fingerprints
            && let Some(expected) = table.get(rank as usize)
            && expected != fingerprint
        {
            return Err(ProtocolError::FingerprintMismatch {
                rank,
                theirs: short_hex(fingerprint),
                expected: short_hex(expected),
            });
        }
        Ok(())
    }

    pub(super) fn on_hello(&mut self, h: &Hello) -> Result<(), ProtocolError> {
        self.claimed = Some(describe_claim(h));
        if let Err(e) = self.check_hello(h) {
            return Err(self.fail(e, true));
        }
        self.peer = Some(PeerInfo {
            rank: h.rank,
            recv_window_bytes: h.recv_window_bytes,
            attachment: h.attachment.clone(),
            incarnation: h.incarnation,
            identity: h.identity.clone(),
        });
        let mac = match self.peer_key(h) {
            Ok(None) => None,
            Ok(Some(key)) => {
                let peer_meta = crate::codec::hello_meta(h);
                let (d, a) = match self.role {
                    Role::Dialer => (&self.local_hello_meta, &peer_meta),
                    Role::Acceptor => (&peer_meta, &self.local_hello_meta),
                };
                self.transcript = crypto::transcript(d, a);
                self.session = Some(crypto::session_keys(&key, &self.transcript, self.role));
                let mac = crypto::auth_mac(&key, self.role, &self.transcript);
                let sealed = crypto::seal_identity(
                    &key,
                    &self.transcript,
                    self.role,
                    self.cfg.incarnation,
                    &self.cfg.fingerprint,
                );
                self.pair_key = Some(key);
                Some((mac, sealed))
            }
            Err(e) => return Err(self.fail(e, true)),
        };
        self.transmit.push_back(Body::Auth(Auth {
            mac: mac.map(|m| m.0),
            identity: mac.map(|m| m.1),
        }));
        self.state = State::AwaitAuth;
        Ok(())
    }

    /// The key shared with the peer the hello claims to be: `Ok(None)` in insecure mode (both
    /// ends without credentials); an error when one end has credentials and the other not, or
    /// this end holds no key for the claimed rank or frontend.
    pub(super) fn peer_key(&self, h: &Hello) -> Result<Option<Key>, ProtocolError> {
        let claim = describe_claim(h);
        let Some(creds) = &self.cfg.credentials else {
            if h.auth_required {
                return Err(ProtocolError::AuthFailed(format!(
                    "{claim} authenticates with credentials and this node has none; give it --credentials"
                )));
            }
            return Ok(None);
        };
        if !h.auth_required {
            return Err(ProtocolError::AuthFailed(format!(
                "{claim} runs without credentials (insecure) and this node requires authentication; give it --credentials"
            )));
        }
        let cluster = &self.cfg.cluster;
        let me = self.cfg.local_rank;
        let key = if me == CLIENT_RANK {
            let name = creds.frontend_name().unwrap_or_default();
            creds.router_key(cluster, h.rank, name)
        } else if h.rank == CLIENT_RANK {
            if h.identity.is_empty() && *creds.identity() != crypto::Identity::SharedSecret {
                return Err(ProtocolError::AuthFailed(
                    "a frontend without a name (its credential is not a frontend's)".into(),
                ));
            }
            creds.client_key(cluster, me, &h.identity)
        } else {
            creds.rank_key(cluster, me, h.rank)
        };
        key.map(Some).ok_or_else(|| {
            ProtocolError::AuthFailed(format!(
                "this node's credential holds no key for {claim} (is it the right credential for rank {me}?)"
            ))
        })
    }

    pub(super) fn on_auth(&mut self, a: &Auth) -> Result<(), ProtocolError> {
        let Some(mut peer) = self.peer.clone() else {
            return Err(self.fail(
                ProtocolError::UnexpectedFrame {
                    kind: FrameKind::Auth,
                    state: "before the peer's hello",
                },
                true,
            ));
        };
        if let Some(key) = self.pair_key.clone() {
            let claim = self.claimed.clone().unwrap_or_default();
            let Some(mac) = a.mac else {
                return Err(self.fail(
                    ProtocolError::AuthFailed(format!(
                        "{claim} sent no authentication but this node requires it"
                    )),
                    true,
                ));
            };
            if !crypto::verify_auth_mac(&key, self.role.peer(), &self.transcript, &mac) {
                return Err(self.fail(
                    ProtocolError::AuthFailed(format!(
                        "{claim} answered with a wrong MAC: it does not hold that identity's key (another rank's or another cluster's credential), or the handshake was tampered with"
                    )),
                    true,
                ));
            }
            let opened = a
                .identity
                .as_ref()
                .and_then(|s| crypto::open_identity(&key, &self.transcript, self.role.peer(), s));
            let Some((incarnation, fingerprint)) = opened else {
                return Err(self.fail(
                    ProtocolError::AuthFailed(format!(
                        "{claim} sent no sealed identity, or one that does not open under its key"
                    )),
                    true,
                ));
            };
            if let Err(e) = self.check_fingerprint(peer.rank, &fingerprint) {
                return Err(self.fail(e, true));
            }
            peer.incarnation = incarnation;
            self.peer = Some(peer.clone());
        }
        self.send_credit = peer.recv_window_bytes;
        let kind = negotiate(self.local_link, &peer.attachment);
        if kind == LinkKind::Tcp {
            self.state = State::Established;
            self.events.push_back(Event::Established(peer));
        } else {
            self.state = State::LinkSetup(Setup {
                kind,
                since: self.last_rx,
                local_info: None,
                peer_info: None,
                local_ready_at: None,
                peer_ready: false,
            });
            self.events.push_back(Event::LinkSetup { kind, peer });
        }
        Ok(())
    }
}
