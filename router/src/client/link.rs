//! The client's connection, driven one operation (a frame read or a frame write) at a time, so
//! that a caller's future can be dropped at any await without tearing a frame.
//!
//! Why this exists: reading or writing a frame takes several socket operations; a future that
//! is dropped halfway (a `tokio::time::timeout` around [`RouterClient::wait`], a `select!`)
//! would leave half a frame read or written and the stream could no longer be framed. Here the
//! operation owns the connection while it runs and is kept in the [`Link`] when its caller
//! goes away; the next call on the client finishes it first ([`Link::finish`]), and what it
//! read or wrote is accounted for as if nothing had happened.
//!
//! [`RouterClient::wait`]: super::RouterClient::wait

use expertmesh_transport::codec::Body;
use expertmesh_transport::frontend::{ClientFrame, FrameConnection, FrontendError};
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;

/// What a finished operation did.
pub(super) enum Finished {
    /// A frame (or raw bytes) was written, or not; `buf` is the payload buffer, handed back
    /// for reuse.
    Wrote {
        /// The payload buffer.
        buf: Vec<u8>,
        /// Whether the write succeeded.
        result: Result<(), FrontendError>,
    },
    /// A frame was read, or the read failed.
    Read(Result<ClientFrame, FrontendError>),
}

/// An operation in progress; it owns the connection and gives it back when done.
type Op = Pin<Box<dyn Future<Output = (FrameConnection, Finished)> + Send>>;

enum State {
    /// Nothing in progress.
    Idle(FrameConnection),
    /// An operation is in progress (possibly left by a caller that went away).
    Busy(Op),
    /// The connection was closed (after a failure); nothing can be started.
    Closed,
}

/// One frontend connection, one operation at a time. Every `async` method is cancel-safe: an
/// operation that was started runs to completion on the next [`Link::finish`].
pub(super) struct Link {
    state: State,
    peer: SocketAddr,
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match self.state {
            State::Idle(_) => "idle",
            State::Busy(_) => "busy",
            State::Closed => "closed",
        };
        f.debug_struct("Link")
            .field("peer", &self.peer)
            .field("state", &state)
            .finish()
    }
}

impl Link {
    /// Wrap an established connection.
    pub(super) fn new(conn: FrameConnection) -> Self {
        Self {
            peer: conn.peer_addr(),
            state: State::Idle(conn),
        }
    }

    /// The router's address.
    pub(super) fn peer(&self) -> SocketAddr {
        self.peer
    }

    /// Whether an operation is in progress.
    pub(super) fn is_busy(&self) -> bool {
        matches!(self.state, State::Busy(_))
    }

    /// Run the operation in progress to its end and say what it did; `None` when there was
    /// none. Cancel-safe: if this future is dropped, the operation stays in progress.
    pub(super) async fn finish(&mut self) -> Option<Finished> {
        let State::Busy(op) = &mut self.state else {
            return None;
        };
        let (conn, finished) = op.as_mut().await;
        self.state = State::Idle(conn);
        Some(finished)
    }

    /// Start writing a frame of `body` and `payload`. Returns `payload` back when the link is
    /// not idle (busy: call [`Link::finish`] first; or closed).
    pub(super) fn start_write(&mut self, body: Body, payload: Vec<u8>) -> Result<(), Vec<u8>> {
        self.start(payload, move |mut conn, buf| {
            Box::pin(async move {
                let result = conn.write_frame(&body, &buf).await;
                (conn, Finished::Wrote { buf, result })
            })
        })
    }

    /// Start writing `bytes` as they are (tests of malformed frames).
    pub(super) fn start_write_raw(&mut self, bytes: Vec<u8>) -> Result<(), Vec<u8>> {
        self.start(bytes, |mut conn, buf| {
            Box::pin(async move {
                let result = conn.write_raw(&buf).await;
                (conn, Finished::Wrote { buf, result })
            })
        })
    }

    /// Start reading the next frame. `false` when the link is not idle.
    pub(super) fn start_read(&mut self) -> bool {
        self.start(Vec::new(), |mut conn, _| {
            Box::pin(async move {
                let r = conn.read_frame().await;
                (conn, Finished::Read(r))
            })
        })
        .is_ok()
    }

    /// Close the connection (dropping an operation in progress).
    pub(super) fn close(&mut self) {
        self.state = State::Closed;
    }

    fn start(
        &mut self,
        buf: Vec<u8>,
        op: impl FnOnce(FrameConnection, Vec<u8>) -> Op,
    ) -> Result<(), Vec<u8>> {
        match std::mem::replace(&mut self.state, State::Closed) {
            State::Idle(conn) => {
                self.state = State::Busy(op(conn, buf));
                Ok(())
            }
            other => {
                self.state = other;
                Err(buf)
            }
        }
    }
}
