//! Timers: the handshake deadline, heartbeats and the idle timeout.
//!
//! Why this exists: a dead or partitioned peer must be noticed without I/O in the core. The
//! driver asks when to wake ([`Connection::poll_timeout`]) and reports the time
//! ([`Connection::handle_timeout`]); an established end sends a heartbeat after
//! `heartbeat_interval` without sending, and closes after `idle_timeout` without receiving.
//!
//! A driver calls [`Connection::handle_timeout`] at least once per heartbeat interval while the
//! link is established (that is when the next heartbeat is due). A longer gap means this end
//! was not running: its process or thread was stalled (a loaded host, a paused VM, a debugger),
//! and the frames the peer sent meanwhile may still sit unread in the socket or ring. Closing
//! for idleness right then would drop a live link because the timer task happened to run
//! before the reader. So after such a gap the peer gets one more heartbeat interval to be heard
//! (time for the driver to read what is pending); a peer that is really gone is still noticed,
//! one interval later. The grace is given once per frame heard, so a host starved stall after
//! stall still closes a link whose peer says nothing.

use super::connection::{Connection, State};
use super::error::ProtocolError;
use crate::codec::{Body, Heartbeat};
use std::time::Instant;

impl Connection {
    /// When [`Self::handle_timeout`] must next be called.
    pub fn poll_timeout(&self) -> Option<Instant> {
        match self.state {
            State::Closed(_) => None,
            State::AwaitHello | State::AwaitAuth => Some(self.started + self.cfg.handshake_timeout),
            State::LinkSetup(ref s) => {
                Some(s.local_ready_at.unwrap_or(s.since) + self.cfg.handshake_timeout)
            }
            State::Established => Some(
                (self.last_tx + self.cfg.heartbeat_interval)
                    .min(self.last_rx + self.cfg.idle_timeout),
            ),
        }
    }

    /// Advances timers to `now`: handshake deadline, idle timeout, heartbeats.
    pub fn handle_timeout(&mut self, now: Instant) {
        match self.state {
            State::Closed(_) => {}
            State::AwaitHello | State::AwaitAuth => {
                if now >= self.started + self.cfg.handshake_timeout {
                    self.fail(
                        ProtocolError::HandshakeTimeout(self.cfg.handshake_timeout),
                        false,
                    );
                }
            }
            State::LinkSetup(ref s) => {
                if now >= s.local_ready_at.unwrap_or(s.since) + self.cfg.handshake_timeout {
                    self.fail(
                        ProtocolError::HandshakeTimeout(self.cfg.handshake_timeout),
                        false,
                    );
                }
            }
            State::Established => {
                let unobserved = now.saturating_duration_since(self.last_timer);
                self.last_timer = now;
                if unobserved > 2 * self.cfg.heartbeat_interval
                    && self.graced_rx != Some(self.last_rx)
                {
                    // This end was stalled (see the module docs): judge the peer one heartbeat
                    // interval from now, after the driver has read what arrived meanwhile. Once
                    // per frame heard: stall after stall with nothing read closes as usual.
                    let grace = self
                        .cfg
                        .idle_timeout
                        .saturating_sub(self.cfg.heartbeat_interval);
                    if let Some(from) = now.checked_sub(grace).filter(|&f| f > self.last_rx) {
                        self.last_rx = from;
                        self.graced_rx = Some(from);
                    }
                }
                let idle = now.saturating_duration_since(self.last_rx);
                if idle >= self.cfg.idle_timeout {
                    self.fail(ProtocolError::IdleTimeout(idle), false);
                    return;
                }
                if now.saturating_duration_since(self.last_tx) >= self.cfg.heartbeat_interval
                    && !self.heartbeat_queued
                {
                    self.heartbeat_seq += 1;
                    let us = now.saturating_duration_since(self.started).as_micros() as u64;
                    self.transmit.push_back(Body::Heartbeat(Heartbeat {
                        seq: self.heartbeat_seq,
                        sent_at_us: us,
                    }));
                    self.heartbeat_queued = true;
                    // Count the heartbeat as sent now, so the timer does not fire again at once.
                    self.last_tx = now;
                }
            }
        }
    }
}
