//! The client's connection as two halves, each driven one operation (a frame read, or a frame
//! write) at a time, so that a caller's future can be dropped at any await without tearing a
//! frame, and so that reading never waits for a write or a write for a read.
//!
//! Why this exists: reading or writing a frame takes several socket operations; a future that
//! is dropped halfway (the client's own deadline, a `tokio::time::timeout` around
//! [`RouterClient::wait`], a `select!`) would leave half a frame read or written and the stream
//! could no longer be framed. Here each operation owns its half of the connection while it runs
//! and is kept in the [`Half`] when its caller goes away; the next call on the client finishes
//! it first ([`Half::finish`]), and what it read or wrote is accounted for as if nothing had
//! happened. The halves are independent: a write to a router that stopped reading (its window
//! full, or the process stopped) does not keep the client from reading the answers that free
//! it, and a read that waits for a silent router does not keep the client from sending a
//! keepalive probe.
//!
//! [`RouterClient::wait`]: super::RouterClient::wait

use expertmesh_transport::codec::Body;
use expertmesh_transport::frontend::{
    ClientFrame, FrameConnection, FrameReader, FrameWriter, FrontendError,
};
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;

/// The payload of a frame to write: owned (probes, raw bytes; handed back for reuse when
/// written) or shared with the request's call, which keeps it until answered to send it again
/// (after an idle close, or on another router).
pub(super) enum Payload {
    /// The client's buffer; it comes back in [`Finished::Wrote`].
    Owned(Vec<u8>),
    /// A request's payload, also held by its call.
    Shared(Arc<Vec<u8>>),
}

impl Payload {
    fn bytes(&self) -> &[u8] {
        match self {
            Payload::Owned(b) => b,
            Payload::Shared(b) => b,
        }
    }
}

/// What a finished operation did.
pub(super) enum Finished {
    /// A frame (or raw bytes) was written, or not; `payload` is handed back for reuse.
    Wrote {
        /// The payload.
        payload: Payload,
        /// Whether the write succeeded.
        result: Result<(), FrontendError>,
    },
    /// A frame was read, or the read failed.
    Read(Result<ClientFrame, FrontendError>),
}

/// An operation in progress; it owns its half and gives it back when done.
type Op<C> = Pin<Box<dyn Future<Output = (C, Finished)> + Send>>;

enum State<C> {
    /// Nothing in progress.
    Idle(C),
    /// An operation is in progress (possibly left by a caller that went away).
    Busy(Op<C>),
    /// The connection was closed (after a failure); nothing can be started.
    Closed,
}

/// One half of the connection, one operation at a time. [`Half::finish`] is cancel-safe: an
/// operation that was started runs to completion on the next call.
pub(super) struct Half<C> {
    state: State<C>,
}

impl<C: Send + 'static> Half<C> {
    fn new(c: C) -> Self {
        Self {
            state: State::Idle(c),
        }
    }

    /// Whether an operation is in progress.
    pub(super) fn is_busy(&self) -> bool {
        matches!(self.state, State::Busy(_))
    }

    /// Whether an operation can be started now.
    pub(super) fn is_idle(&self) -> bool {
        matches!(self.state, State::Idle(_))
    }

    /// Run the operation in progress to its end and say what it did; `None` when there was
    /// none (and then it returns at once). Cancel-safe: if this future is dropped, the
    /// operation stays in progress.
    pub(super) async fn finish(&mut self) -> Option<Finished> {
        let State::Busy(op) = &mut self.state else {
            return None;
        };
        let (c, finished) = op.as_mut().await;
        self.state = State::Idle(c);
        Some(finished)
    }

    /// Start `op` on the idle half; `Err(payload)` when the half is busy or closed.
    fn start(
        &mut self,
        payload: Payload,
        op: impl FnOnce(C, Payload) -> Op<C>,
    ) -> Result<(), Payload> {
        match std::mem::replace(&mut self.state, State::Closed) {
            State::Idle(c) => {
                self.state = State::Busy(op(c, payload));
                Ok(())
            }
            other => {
                self.state = other;
                Err(payload)
            }
        }
    }
}

impl std::fmt::Debug for Half<FrameReader> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(state_name(&self.state))
    }
}

impl std::fmt::Debug for Half<FrameWriter> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(state_name(&self.state))
    }
}

fn state_name<C>(s: &State<C>) -> &'static str {
    match s {
        State::Idle(_) => "idle",
        State::Busy(_) => "busy",
        State::Closed => "closed",
    }
}

impl Half<FrameWriter> {
    /// Start writing a frame of `body` and `payload`. Returns `payload` back when the half is
    /// not idle (busy: finish it first; or closed).
    pub(super) fn start_write(&mut self, body: Body, payload: Payload) -> Result<(), Payload> {
        self.start(payload, move |mut w, payload| {
            Box::pin(async move {
                let result = w.write_frame(&body, payload.bytes()).await;
                (w, Finished::Wrote { payload, result })
            })
        })
    }

    /// Start writing `bytes` as they are (tests of malformed frames).
    pub(super) fn start_write_raw(&mut self, bytes: Vec<u8>) -> Result<(), Payload> {
        self.start(Payload::Owned(bytes), |mut w, payload| {
            Box::pin(async move {
                let result = w.write_raw(payload.bytes()).await;
                (w, Finished::Wrote { payload, result })
            })
        })
    }
}

impl Half<FrameReader> {
    /// Start reading the next frame. `false` when the half is not idle.
    pub(super) fn start_read(&mut self) -> bool {
        self.start(Payload::Owned(Vec::new()), |mut r, _| {
            Box::pin(async move {
                let res = r.read_frame().await;
                (r, Finished::Read(res))
            })
        })
        .is_ok()
    }
}

/// One frontend connection: a reading half and a writing half, each with at most one
/// operation in progress.
pub(super) struct Link {
    /// The reading half.
    pub(super) read: Half<FrameReader>,
    /// The writing half.
    pub(super) write: Half<FrameWriter>,
    peer: SocketAddr,
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Link")
            .field("peer", &self.peer)
            .field("read", &self.read)
            .field("write", &self.write)
            .finish()
    }
}

impl Link {
    /// Wrap an established connection.
    pub(super) fn new(conn: FrameConnection) -> Self {
        let peer = conn.peer_addr();
        let (r, w) = conn.split();
        Self {
            read: Half::new(r),
            write: Half::new(w),
            peer,
        }
    }

    /// The router's address.
    pub(super) fn peer(&self) -> SocketAddr {
        self.peer
    }

    /// Whether the connection was closed.
    pub(super) fn is_closed(&self) -> bool {
        matches!(self.read.state, State::Closed) && matches!(self.write.state, State::Closed)
    }

    /// Close the connection (dropping the operations in progress).
    pub(super) fn close(&mut self) {
        self.read.state = State::Closed;
        self.write.state = State::Closed;
    }
}
