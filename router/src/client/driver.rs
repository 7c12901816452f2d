//! The client's connection driver: requests written in order, answers routed to their
//! handles, deadlines swept, the keepalive run, a connection the router closed for idleness
//! opened again (with the requests that crossed its close), and (for a failover client) a lost
//! router replaced and its unanswered requests sent again.
//!
//! Why this exists: [`RouterClient`] has no background task; every wait of
//! a caller (`submit` making room or writing, `wait` reading) runs [`RouterClient::progress`],
//! one step bounded by the caller's own deadline, and everything that must happen on time
//! (a deadline, a keepalive probe, a reconnect) happens in such a step. Keeping the steps here
//! keeps the public surface in `client.rs` readable.

use super::link::{Finished, Link, Payload};
use super::liveness::{KeepaliveAction, PROBE_ID_BIT, jitter, probe_request};
use super::pending::{Delivery, Take};
use super::{
    Answer, Call, CallHandle, ClientError, Keepalive, RETAIN_BUFFER_BYTES, RouterClient, lock,
    recoverable_request,
};
use expertmesh_transport::codec::{Body, ErrorCode, LayerRequest};
use expertmesh_transport::frontend::{ClientFrame, FrameConnection, FrontendConfig, FrontendError};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// Connect to `addr` within `limit` (TCP connect and handshake).
pub(super) async fn connect_within(
    addr: SocketAddr,
    cfg: &FrontendConfig,
    limit: Duration,
) -> Result<FrameConnection, ClientError> {
    match tokio::time::timeout(limit, FrameConnection::connect(addr, cfg)).await {
        Ok(r) => r.map_err(ClientError::Transport),
        Err(_) => Err(ClientError::Transport(FrontendError::Io {
            peer: addr,
            source: std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("no connection within {limit:?}"),
            ),
        })),
    }
}

impl RouterClient {
    /// Send `req` (its id assigned here) with `payload`, once a slot is free; see
    /// [`RouterClient::submit`].
    pub(super) async fn submit_payload(
        &mut self,
        mut req: LayerRequest,
        payload: Vec<u8>,
        deadline: Option<std::time::Duration>,
    ) -> Result<CallHandle, ClientError> {
        let budget = deadline.unwrap_or(self.opts.default_deadline);
        // The router is told `deadline` too: a live router's own DeadlineExceeded (which names
        // the devices it waited for) gets a moment to arrive before the client gives up.
        let grace = if deadline.is_some() {
            super::ROUTER_ANSWER_GRACE
        } else {
            std::time::Duration::ZERO
        };
        let due = super::instant_after(budget.saturating_add(grace));
        if let Err(e) = self.replace_if_closed_idle(due).await {
            self.recycle(payload);
            return Err(e);
        }
        if let Err(e) = self.make_room(due, budget).await {
            self.recycle(payload);
            return Err(e);
        }
        let id = self.next_id;
        self.next_id += 1;
        req.request_id = id;
        let inserted = self.pending.insert(id);
        debug_assert!(inserted, "request ids are never reused");
        // Kept until answered: sent again after an idle close, or on another router by a
        // failover client; its buffer is reused once answered ([`RouterClient::reclaim`]).
        let payload = std::sync::Arc::new(payload);
        let call = Call {
            req,
            payload,
            deadline: due,
            budget,
            sent: false,
        };
        self.calls.insert(id, call);
        self.to_send.push_back(id);
        // From here the handle owns the request: if this future is dropped, dropping the
        // handle abandons it, and a write under way is finished by the next call.
        let mut handle = CallHandle {
            request_id: id,
            tokens: req.tokens as usize,
            hidden: req.hidden as usize,
            deadline: due,
            owner: Some(self.abandoned.clone()),
        };
        while self.calls.get(&id).is_some_and(|c| !c.sent) {
            self.progress(due).await;
        }
        // Sent, or answered already: only an error (a frame too large to encode, a broken
        // connection, the deadline) is returned here; an answer waits for `wait`.
        if self.pending.answered_with(id, |a| a.is_err()) {
            handle.redeem();
            return match self.pending.take(id) {
                Take::Ready(Err(e)) => Err(e),
                _ => unreachable!("checked above"),
            };
        }
        Ok(handle)
    }

    /// Before a request goes out on a connection with nothing in flight: if the router has
    /// closed it for idleness (its frontend idle timeout: an error frame `ShuttingDown` naming
    /// no request, already waiting on the socket), connect to the same router again, by `due`.
    /// The router reads nothing more once it has decided a connection is idle, so nothing is
    /// lost; a connection closed any other way is left to the usual path (the request fails,
    /// or a failover client moves on).
    async fn replace_if_closed_idle(&mut self, due: Instant) -> Result<(), ClientError> {
        // Looked at before every request sent with nothing in flight (a yield and a poll of the
        // socket, microseconds): the client cannot know when the router's idle timeout runs
        // out (a router counts it from its last request and its last answer, but older
        // routers from the request alone, which can close a connection right after the
        // answer), so no time since the client's last read proves the connection open.
        if self.pending.in_flight() > 0
            || !self.calls.is_empty()
            || self.broken.is_some()
            || self.link.is_closed()
            || !self.link.write.is_idle()
        {
            return Ok(());
        }
        // Let the runtime look at the socket (a yielded task runs after the I/O driver), then
        // take what is there without waiting.
        tokio::task::yield_now().await;
        let Some(finished) = self.read_now() else {
            return Ok(()); // nothing: the connection is open
        };
        let idle_closed = matches!(
            &finished,
            Finished::Read(Ok(frame)) if matches!(
                frame.body(),
                Body::Error(e) if e.request_id == 0 && e.code == ErrorCode::ShuttingDown
            )
        );
        if !idle_closed {
            self.absorb(finished);
            return Ok(());
        }
        let addr = self.routers[self.current];
        tracing::debug!(router = %addr, "the router closed this idle connection; connecting again");
        // The old link is closed only once the new one is there: a submit cancelled while it
        // connects leaves a link that reads its end and fails the next request (a closed link
        // with no error recorded made it spin until the request's deadline).
        let limit = self
            .opts
            .connect_timeout
            .min(due.saturating_duration_since(Instant::now()));
        match connect_within(addr, &self.cfg, limit).await {
            Ok(conn) => {
                self.use_connection(conn);
                Ok(())
            }
            Err(e) => {
                let peer = self.link.peer();
                self.break_with(e.duplicate(peer));
                Err(e)
            }
        }
    }

    /// Wait until fewer than `max_in_flight` requests are in flight, or `due` (a request of
    /// deadline `budget`).
    async fn make_room(&mut self, due: Instant, budget: Duration) -> Result<(), ClientError> {
        self.collect_abandoned();
        loop {
            self.check_broken()?;
            if self.pending.in_flight() < self.max_in_flight {
                return Ok(());
            }
            if Instant::now() >= due {
                return Err(ClientError::Deadline {
                    request_id: 0,
                    deadline: budget,
                    detail: format!(
                        "{} requests were in flight on {} (max_in_flight) until then",
                        self.pending.in_flight(),
                        self.where_waiting()
                    ),
                });
            }
            self.progress(due).await;
        }
    }

    /// Finish the writes queued or under way, and open again a connection the router closed
    /// for idleness, until `until`.
    pub(super) async fn flush_writes(&mut self, until: Instant) -> Result<(), ClientError> {
        self.collect_abandoned();
        while self.writing.is_some() || !self.to_send.is_empty() || self.reopen {
            self.check_broken()?;
            if Instant::now() >= until {
                return Err(ClientError::Usage(format!(
                    "the connection to {} did not take a write in time",
                    self.where_waiting()
                )));
            }
            self.progress(until).await;
        }
        self.check_broken()
    }

    /// The answer for `handle`, driving the connection until it arrives or its deadline passes
    /// (which answers it with [`ClientError::Deadline`]).
    pub(super) async fn wait_answer(&mut self, mut handle: CallHandle) -> Answer {
        if !handle.belongs_to(&self.abandoned) {
            return Err(ClientError::Usage(format!(
                "request {} was submitted on another RouterClient; wait on that one",
                handle.request_id
            )));
        }
        let id = handle.request_id;
        loop {
            self.collect_abandoned();
            match self.pending.take(id) {
                Take::Ready(answer) => {
                    handle.redeem();
                    return answer;
                }
                Take::InFlight => {}
                Take::Unknown => {
                    handle.redeem();
                    let m = format!("request {id} is not known on this connection");
                    return Err(ClientError::Protocol(m));
                }
            }
            self.progress(handle.deadline).await;
        }
    }

    /// One step, returning by `until` at the latest: answer overdue requests, run the
    /// keepalive, replace a lost router, start the next write and a read, and wait for one of
    /// them (or the next timer).
    pub(super) async fn progress(&mut self, until: Instant) {
        let now = Instant::now();
        self.collect_abandoned();
        if self.judging_due(now) {
            // Answers already received count before a deadline or the router's silence is
            // judged: the caller may have been away from the client while they arrived.
            self.absorb_ready().await;
        }
        self.expire_overdue(now);
        if self.link.is_closed() {
            if self.reopen && self.broken.is_none() {
                self.reopen_step(until).await;
            } else if self.failover && self.broken.is_none() && !self.calls.is_empty() {
                self.reconnect_step(until).await;
            }
            return;
        }
        self.run_keepalive(now);
        if self.link.is_closed() {
            return;
        }
        self.start_next_write();
        self.link.read.start_read();
        let wake = [
            Some(until),
            self.next_deadline(),
            self.keepalive.next_event(self.link.write.is_idle()),
        ]
        .into_iter()
        .flatten()
        .min()
        .unwrap_or(until);
        let finished = tokio::select! {
            biased;
            Some(f) = self.link.read.finish() => Some(f),
            Some(f) = self.link.write.finish() => Some(f),
            _ = tokio::time::sleep_until(wake.into()) => None,
        };
        if let Some(f) = finished {
            self.absorb(f);
        }
    }

    /// Whether a deadline or the keepalive has something to judge at `now`.
    fn judging_due(&self, now: Instant) -> bool {
        let due = |t: Option<Instant>| t.is_some_and(|t| t <= now);
        let keepalive = self.keepalive.next_event(self.link.write.is_idle());
        !self.link.is_closed() && (due(self.next_deadline()) || due(keepalive))
    }

    /// Take, without waiting, the frames the router has already sent and a write that has
    /// ended. At most one frame per call in flight and one more (a probe's answer, or the
    /// router's closing frame): the rest waits for the next step.
    async fn absorb_ready(&mut self) {
        // Let the runtime look at the socket first (a yielded task runs after the I/O
        // driver): a caller away from the client left its readiness unseen.
        tokio::task::yield_now().await;
        for _ in 0..self.calls.len() + 2 {
            if self.link.is_closed() {
                return;
            }
            match self.read_now() {
                Some(finished) => self.absorb(finished),
                None => break,
            }
        }
        if !self.link.is_closed()
            && let Some(Some(finished)) = poll_once(self.link.write.finish())
        {
            self.absorb(finished);
        }
    }

    /// The next frame (or the read's failure) if the socket already holds it, without
    /// waiting; `None` leaves the read started for a later step.
    fn read_now(&mut self) -> Option<Finished> {
        self.link.read.start_read();
        poll_once(self.link.read.finish()).flatten()
    }

    /// Answer every request whose deadline passed with [`ClientError::Deadline`], freeing its
    /// slot (its late answer is discarded).
    fn expire_overdue(&mut self, now: Instant) {
        if !self.calls.values().any(|c| c.deadline <= now) {
            return;
        }
        let detail = self.where_waiting();
        let overdue: Vec<u64> = self
            .calls
            .iter()
            .filter(|(_, c)| c.deadline <= now)
            .map(|(&id, _)| id)
            .collect();
        for id in overdue {
            let Some(call) = self.calls.remove(&id) else {
                continue;
            };
            let budget = call.budget;
            self.reclaim(call);
            let e = ClientError::Deadline {
                request_id: id,
                deadline: budget,
                detail: detail.clone(),
            };
            self.pending.answer(id, Err(e));
            tracing::debug!(request_id = id, router = %detail, "request passed its deadline on the client");
        }
        let calls = &self.calls;
        self.to_send.retain(|id| calls.contains_key(id));
    }

    /// The earliest deadline of a request in flight.
    fn next_deadline(&self) -> Option<Instant> {
        self.calls.values().map(|c| c.deadline).min()
    }

    /// What the client waits on, for error messages: the router, or why there is none.
    fn where_waiting(&self) -> String {
        match &self.lost {
            Some(why) => format!("no router connected ({why})"),
            None => format!("router {}", self.peer_addr()),
        }
    }

    /// Send a probe or give the router up, as the keepalive says.
    fn run_keepalive(&mut self, now: Instant) {
        let outstanding = self.pending.in_flight() > 0 || self.link.write.is_busy();
        let can_probe = self.link.write.is_idle();
        match self.keepalive.poll(now, outstanding, can_probe) {
            KeepaliveAction::Wait => {}
            KeepaliveAction::Probe => {
                let id = PROBE_ID_BIT | self.next_probe;
                self.next_probe += 1;
                let body = Body::LayerRequest(probe_request(id));
                if self
                    .link
                    .write
                    .start_write(body, Payload::Owned(Vec::new()))
                    .is_ok()
                {
                    self.writing = Some(id);
                }
            }
            KeepaliveAction::Unresponsive(silent) => {
                let router = self.link.peer();
                self.lose_router(ClientError::Unresponsive { router, silent });
            }
        }
    }

    /// Start writing the next queued request, when the writing half is free.
    fn start_next_write(&mut self) {
        if !self.link.write.is_idle() {
            return;
        }
        while let Some(id) = self.to_send.pop_front() {
            let Some(call) = self.calls.get_mut(&id) else {
                continue; // answered (its deadline passed) before it was written
            };
            let mut req = call.req;
            if req.deadline_us != 0 {
                // The router is told the rest of the caller's deadline (the client's own
                // deadline is ROUTER_ANSWER_GRACE later); a request sent again carries what is
                // left of it.
                let left = call
                    .deadline
                    .saturating_duration_since(Instant::now())
                    .saturating_sub(super::ROUTER_ANSWER_GRACE);
                req.deadline_us = super::wire_micros(left).max(1);
            }
            // The call keeps its payload until answered; the write holds another reference.
            let payload = Payload::Shared(std::sync::Arc::clone(&call.payload));
            match self
                .link
                .write
                .start_write(Body::LayerRequest(req), payload)
            {
                Ok(()) => self.writing = Some(id),
                Err(p) => self.recycle_payload(p),
            }
            return;
        }
    }

    /// Account for a finished operation.
    fn absorb(&mut self, finished: Finished) {
        let now = Instant::now();
        match finished {
            Finished::Wrote { payload, result } => {
                self.recycle_payload(payload);
                let id = self.writing.take();
                match (id, result) {
                    (Some(id), Ok(())) if id & PROBE_ID_BIT != 0 => self.keepalive.probe_sent(now),
                    (Some(id), Ok(())) => {
                        if let Some(c) = self.calls.get_mut(&id) {
                            c.sent = true;
                        }
                    }
                    (None, Ok(())) => {}
                    (_, Err(e)) => self.fail_one_or_all(e),
                }
            }
            Finished::Read(Ok(frame)) => {
                self.keepalive.received(now);
                self.route(frame);
                if self.pending.in_flight() == 0 && !self.link.write.is_busy() {
                    // The caller may not step again before its next call.
                    self.keepalive.idle();
                }
            }
            Finished::Read(Err(e)) => {
                self.keepalive.received(now);
                self.fail_one_or_all(e);
            }
        }
    }

    /// A frame from the router: the answer to one request, a probe's answer, or a sign the
    /// connection is broken.
    fn route(&mut self, frame: ClientFrame) {
        let (id, refusal) = match frame.body() {
            Body::LayerResponse(r) => (r.request_id, None),
            Body::Error(e) if e.request_id & PROBE_ID_BIT != 0 => return, // a probe's answer
            Body::Error(e) if e.request_id == 0 && e.code == ErrorCode::ShuttingDown => {
                // Closed for idleness (a draining router names each request it refuses): the
                // router decided so with nothing in flight and read nothing after, so the
                // requests sent since crossed its frame unread and go again, on a new
                // connection to the same router (a failover client's too: it is not lost).
                self.reopen_after_idle_close(&e.message);
                return;
            }
            Body::Error(e) if self.failover && e.code == ErrorCode::ShuttingDown => {
                // The router is going away: its unanswered requests go to the next one.
                let m = format!("shutting down: {}", e.message);
                self.lose_router(ClientError::Protocol(m));
                return;
            }
            Body::Error(e) if e.request_id != 0 => (
                e.request_id,
                Some(ClientError::Server {
                    request_id: e.request_id,
                    code: e.code,
                    message: e.message.clone(),
                }),
            ),
            Body::Error(e) => {
                tracing::warn!(peer = %self.link.peer(), code = ?e.code, message = %e.message,
                    "the router reported an error that names no request");
                return;
            }
            other => {
                let m = format!("unexpected frame from the router: {other:?}");
                self.lose_router(ClientError::Protocol(m));
                return;
            }
        };
        self.deliver(id, refusal.map_or(Ok(frame), Err));
    }

    fn deliver(&mut self, id: u64, answer: Answer) {
        if let Some(call) = self.calls.remove(&id) {
            self.reclaim(call);
            self.reopened_unanswered = false;
        }
        if self.pending.answer(id, answer) == Delivery::Unknown {
            tracing::debug!(request_id = id, "ignored an answer to no request in flight");
        }
    }

    /// A failed read or write: when the stream is still framed and the error names a request
    /// (a frame that could not be encoded or decoded), only that request fails; otherwise the
    /// router is lost.
    fn fail_one_or_all(&mut self, e: FrontendError) {
        match recoverable_request(&e) {
            Some(id) => self.deliver(id, Err(ClientError::Transport(e))),
            None => self.lose_router(ClientError::Transport(e)),
        }
    }

    /// The router is unusable: close the connection; a failover client keeps its unanswered
    /// requests for the next router, a plain one fails them all with `e`.
    fn lose_router(&mut self, e: ClientError) {
        if !self.failover {
            self.break_with(e);
            return;
        }
        let peer = self.link.peer();
        let again = self.requeue_unanswered();
        tracing::warn!(%peer, error = %e, unanswered = again, "router lost; failing over");
        self.lost = Some(format!("{peer} was lost: {e}"));
    }

    /// Close the connection and queue every unanswered request (abandoned ones forgotten) to
    /// be written again, in id order, on the next one. Returns how many.
    fn requeue_unanswered(&mut self) -> usize {
        self.link.close();
        self.writing = None;
        self.to_send.clear();
        let again = self.pending.requeue();
        self.calls.retain(|id, _| again.binary_search(id).is_ok());
        for &id in &again {
            if let Some(c) = self.calls.get_mut(&id) {
                c.sent = false;
                self.to_send.push_back(id);
            }
        }
        again.len()
    }

    /// The router closed this connection for idleness (its `ShuttingDown` frame naming no
    /// request, `message`) while requests were on their way to it: queue them again and
    /// connect to the same router at the next step ([`RouterClient::reopen_step`]).
    fn reopen_after_idle_close(&mut self, message: &str) {
        let peer = self.link.peer();
        if self.reopened_unanswered && self.pending.in_flight() > 0 {
            // Sent again once already and closed again before any answer: not a race with
            // the router's decision any more.
            let m = format!(
                "{peer} closed the connection for idleness again before answering the requests \
                 sent again after its last idle close: {message}"
            );
            self.lose_router(ClientError::Protocol(m));
            return;
        }
        let again = self.requeue_unanswered();
        self.reopened_unanswered = again > 0;
        tracing::debug!(%peer, resent = again, "the router closed this connection for \
            idleness before reading the requests sent since; connecting again");
        self.lost = Some(format!("{peer} {message}"));
        self.reopen = true;
    }

    /// One attempt to connect again to the router that closed the connection for idleness, by
    /// `until`; the requests queued go out on it. Refused (not merely cut short by the
    /// caller's wait): a failover client gives the router up (its requests go to the next),
    /// a plain one's connection is broken with that error.
    async fn reopen_step(&mut self, until: Instant) {
        let addr = self.routers[self.current];
        let now = Instant::now();
        let wake = self.next_deadline().map_or(until, |d| d.min(until));
        let limit = self
            .opts
            .connect_timeout
            .min(wake.saturating_duration_since(now));
        if limit.is_zero() {
            return;
        }
        match connect_within(addr, &self.cfg, limit).await {
            Ok(conn) => {
                self.use_connection(conn);
                self.reopen = false;
                self.lost = None;
            }
            // Cut short by the caller's wait, not refused: try again at the next step.
            Err(_) if limit < self.opts.connect_timeout && Instant::now() >= now + limit => {}
            Err(e) => {
                self.reopen = false;
                self.lose_router(e);
            }
        }
    }

    /// Talk to the router over `conn` from now on (the old link closed), its keepalive
    /// started afresh.
    fn use_connection(&mut self, conn: FrameConnection) {
        self.link.close();
        self.link = Link::new(conn);
        self.keepalive = Keepalive::new(
            self.opts.keepalive_interval,
            self.opts.keepalive_timeout,
            Instant::now(),
        );
    }

    /// One attempt to connect to the next router (or the wait before it), by `until`.
    async fn reconnect_step(&mut self, until: Instant) {
        let now = Instant::now();
        let wake = self.next_deadline().map_or(until, |d| d.min(until));
        let i = match self.reconnect.attempt(now) {
            Ok(i) => i,
            Err(t) => {
                tokio::time::sleep_until(t.min(wake).into()).await;
                return;
            }
        };
        let addr = self.routers[i];
        let left = wake.saturating_duration_since(now);
        let limit = self.opts.connect_timeout.min(left);
        if limit.is_zero() {
            return;
        }
        match connect_within(addr, &self.cfg, limit).await {
            Ok(conn) => self.install(i, conn),
            // Cut short by the caller's wait, not refused: try this router again next time.
            Err(_) if limit < self.opts.connect_timeout && Instant::now() >= now + limit => {}
            Err(e) => {
                tracing::debug!(router = %addr, error = %e, "reconnect attempt failed");
                let prev = self.lost.take().unwrap_or_default();
                let lost = prev.split(" (then: ").next().unwrap_or_default().to_owned();
                self.lost = Some(format!("{lost} (then: {e})"));
                self.reconnect.failed(i, Instant::now(), jitter());
            }
        }
    }

    /// Use router `i` from now on and queue the unanswered requests on it.
    fn install(&mut self, i: usize, conn: FrameConnection) {
        self.use_connection(conn);
        self.current = i;
        self.reconnect.connected(i);
        self.lost = None;
        self.failovers += 1;
        let mut ids: Vec<u64> = self.to_send.drain(..).collect();
        ids.sort_unstable();
        self.to_send.extend(ids);
        tracing::info!(router = %self.routers[i], resent = self.to_send.len(), "connected to router after losing one");
    }

    /// The connection is unusable: close it and fail every request in flight with `e`.
    pub(super) fn break_with(&mut self, e: ClientError) {
        if self.broken.is_some() {
            return;
        }
        let peer = self.link.peer();
        let failed = self.pending.fail_all(|_| Err(e.duplicate(peer)));
        tracing::debug!(%peer, failed, error = %e, "router connection broken");
        self.link.close();
        self.calls.clear();
        self.to_send.clear();
        self.writing = None;
        self.broken = Some(e);
    }

    pub(super) fn check_broken(&self) -> Result<(), ClientError> {
        match &self.broken {
            Some(e) => Err(e.duplicate(self.link.peer())),
            None => Ok(()),
        }
    }

    /// Forget the requests of dropped handles (their answers are discarded when they come).
    pub(super) fn collect_abandoned(&mut self) {
        let ids: Vec<u64> = lock(&self.abandoned).drain(..).collect();
        for id in ids {
            self.pending.abandon(id);
            if let Some(at) = self.to_send.iter().position(|&q| q == id) {
                // Not written yet: never sent, so its slot is free at once.
                self.to_send.remove(at);
                self.calls.remove(&id);
                self.pending
                    .answer(id, Err(ClientError::Usage("abandoned".into())));
            }
        }
    }

    /// A zeroed buffer of `len` bytes: a kept one when there is one (the last kept that is
    /// large enough, else the last kept), a new one otherwise.
    pub(super) fn take_buffer(&mut self, len: usize) -> Vec<u8> {
        let at = self
            .spares
            .iter()
            .rposition(|b| b.capacity() >= len)
            .or_else(|| self.spares.len().checked_sub(1));
        let mut b = at.map_or_else(Vec::new, |i| self.spares.swap_remove(i));
        self.spare_bytes -= b.capacity();
        b.clear();
        b.resize(len, 0);
        b
    }

    /// Keep `buf` for a later request while the kept buffers stay within
    /// [`RETAIN_BUFFER_BYTES`] in all (requests in flight hold theirs until answered, so a
    /// pipelining caller reuses several).
    pub(super) fn recycle(&mut self, buf: Vec<u8>) {
        if buf.capacity() > 0 && self.spare_bytes + buf.capacity() <= RETAIN_BUFFER_BYTES {
            self.spare_bytes += buf.capacity();
            self.spares.push(buf);
        }
    }

    /// Keep a written payload's buffer for reuse: an owned one always, a shared one when its
    /// call is over (a call still in flight holds another reference).
    fn recycle_payload(&mut self, p: Payload) {
        match p {
            Payload::Owned(b) => self.recycle(b),
            Payload::Shared(p) => {
                if let Ok(b) = std::sync::Arc::try_unwrap(p) {
                    self.recycle(b);
                }
            }
        }
    }

    /// Keep the buffer of a call that is over (answered, failed or past its deadline) for
    /// reuse, unless a write still holds it.
    fn reclaim(&mut self, call: Call) {
        if let Ok(b) = std::sync::Arc::try_unwrap(call.payload) {
            self.recycle(b);
        }
    }
}

/// Polls `f` once, without waiting: its output when it is ready now.
fn poll_once<F: std::future::Future>(f: F) -> Option<F::Output> {
    let mut f = std::pin::pin!(f);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    match f.as_mut().poll(&mut cx) {
        std::task::Poll::Ready(v) => Some(v),
        std::task::Poll::Pending => None,
    }
}
