//! Credit-based flow control: send credit taken and returned, received bytes released and
//! credited back, and the invariants that tie them to the windows.
//!
//! Why this exists: the receiver's memory stays bounded by its window only if every end counts
//! the same way. Each end announces its receive window `W`; a sender holds at most the credit the
//! peer gave it, a receiver refuses a peer past its window ([`ProtocolError::CreditViolation`]) and
//! returns released bytes in [`Credit`] frames of at least `W/4` (less when the window is barely
//! larger than the largest frame, so a drained receiver never leaves its peer starved). `Connection::check_invariants`
//! asserts the accounting (debug builds) at every change of it.

use super::connection::{Connection, Disposition, State};
use super::error::ProtocolError;
use crate::codec::{Body, Credit};

impl Connection {
    /// Bytes this end may still send before it must wait for credit.
    pub fn send_credit(&self) -> u64 {
        self.send_credit
    }

    /// Bytes of application frames received and not yet released.
    pub fn recv_outstanding(&self) -> u64 {
        self.recv_outstanding
    }

    /// Takes `frame_len` bytes of send credit for an application frame. `Ok(false)`: wait for
    /// credit (retry after the next received frame); `Err`: the connection is closed or the frame
    /// can never fit.
    pub fn try_reserve(&mut self, frame_len: u64) -> Result<bool, ProtocolError> {
        match &self.state {
            State::Closed(e) => return Err(e.clone()),
            State::Established => {}
            _ => {
                return Err(ProtocolError::Closed(
                    "connection not established yet".into(),
                ));
            }
        }
        let window = self.peer.as_ref().map_or(0, |p| p.recv_window_bytes);
        if frame_len > window {
            return Err(ProtocolError::FrameExceedsWindow {
                len: frame_len,
                window,
            });
        }
        let taken = self.send_credit >= frame_len;
        if taken {
            self.send_credit -= frame_len;
        }
        self.check_invariants();
        Ok(taken)
    }

    /// Returns credit taken by [`Self::try_reserve`] for a frame that was not sent after all.
    /// Credit never exceeds the peer's window: an honest peer's grants and this end's
    /// reservations add up to at most its window, so the cap only holds back a peer that
    /// granted more than it has (as a [`Credit`] frame past the window is capped).
    pub fn unreserve(&mut self, frame_len: u64) {
        let window = self.peer_window();
        self.send_credit = self.send_credit.saturating_add(frame_len).min(window);
        self.check_invariants();
    }

    /// The application is done with a delivered frame of `frame_len` bytes; may queue a
    /// [`Credit`] frame.
    pub fn release(&mut self, frame_len: u64) {
        debug_assert!(
            frame_len <= self.recv_outstanding,
            "released {frame_len} bytes with only {} delivered and unreleased",
            self.recv_outstanding
        );
        self.recv_outstanding = self.recv_outstanding.saturating_sub(frame_len);
        if !self.is_established() {
            return;
        }
        self.release_pending += frame_len;
        if self.release_pending >= self.credit_return_threshold() {
            self.transmit.push_back(Body::Credit(Credit {
                bytes: self.release_pending,
            }));
            self.release_pending = 0;
        }
        self.check_invariants();
    }

    /// Released bytes are returned once they reach `W/4`, or sooner when holding them back could
    /// starve the peer: with the largest frame costing `M`, a peer whose every frame was released
    /// has `W - pending` credit, so `pending` must stay at most `W - M` (a ring-capped window,
    /// shared memory or RDMA, can be barely larger than `M`).
    fn credit_return_threshold(&self) -> u64 {
        let window = self.cfg.recv_window_bytes;
        let max_cost = (crate::codec::PAYLOAD_ALIGN
            + crate::codec::align_up(self.cfg.codec.max_frame_bytes)) as u64;
        (window / 4).min(window.saturating_sub(max_cost) + 1).max(1)
    }

    /// A [`Credit`] frame from the peer: `bytes` more may be sent.
    pub(super) fn on_credit(&mut self, bytes: u64) {
        self.send_credit = self.send_credit.saturating_add(bytes);
        let window = self.peer_window();
        if self.send_credit > window {
            // More credit than the window: a broken peer; cap instead of trusting it.
            self.send_credit = window;
        }
    }

    /// An application frame of `frame_len` bytes arrived: it counts against this end's
    /// window until released; past the window the peer broke its credit and is closed.
    pub(super) fn on_application_frame(
        &mut self,
        frame_len: u64,
    ) -> Result<Disposition, ProtocolError> {
        self.recv_outstanding = self.recv_outstanding.saturating_add(frame_len);
        if self.recv_outstanding > self.cfg.recv_window_bytes {
            let err = ProtocolError::CreditViolation {
                outstanding: self.recv_outstanding,
                window: self.cfg.recv_window_bytes,
            };
            return Err(self.fail(err, true));
        }
        Ok(Disposition::Deliver)
    }

    /// The peer's receive window: the most send credit this end may hold (0 before its hello).
    fn peer_window(&self) -> u64 {
        self.peer.as_ref().map_or(0, |p| p.recv_window_bytes)
    }

    /// Asserts the flow-control accounting (debug builds; nothing in release builds):
    /// - send credit is never above the peer's window (0 before the peer's hello), so this
    ///   end never has more bytes in flight than the peer can buffer;
    /// - while open, received-and-unreleased bytes are within this end's window (a peer past
    ///   it has been closed with [`ProtocolError::CreditViolation`]);
    /// - released bytes not yet credited back stay under the `W/4` batching threshold (a full
    ///   batch is queued as a [`Credit`] frame at once).
    pub(super) fn check_invariants(&self) {
        debug_assert!(
            self.send_credit <= self.peer_window(),
            "send credit {} above the peer's window {}",
            self.send_credit,
            self.peer_window()
        );
        if !matches!(self.state, State::Closed(_)) {
            debug_assert!(
                self.recv_outstanding <= self.cfg.recv_window_bytes,
                "{} bytes outstanding past the receive window {} on an open connection",
                self.recv_outstanding,
                self.cfg.recv_window_bytes
            );
        }
        let threshold = (self.cfg.recv_window_bytes / 4).max(1);
        debug_assert!(
            self.release_pending < threshold,
            "{} released bytes not credited back, batching threshold {threshold}",
            self.release_pending
        );
    }
}
