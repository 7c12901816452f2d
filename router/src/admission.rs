//! Admission of frontend requests: how much work the router takes in, and each connection's
//! fair share of it.
//!
//! Why this exists: a router that reads and decodes every request before it decides to shed
//! it spends its memory and CPU on work it will refuse, and a few greedy connections crowd out
//! the modest ones (issue 15: goodput fell by three quarters and memory grew by 500–800 MiB
//! under pipelined clients). The service asks [`Admission::admit`] from a request's header and
//! metadata, before its payload is read; a refused request is answered `Overloaded` and its
//! payload is skipped, never held.
//!
//! The rule (sans-IO; the service shares one [`Admission`] between its connection tasks, which
//! admit, and the answers' writers, which release once an answer is written, so answers a
//! frontend leaves untaken count against its share). With `C` the router's
//! capacity (`max_requests`, `max_tokens`), a request is admitted when
//! * the router stays within `C` and its connection stays within its fair share of `C` among
//!   the busy connections (those with a request in flight, counting the asking one; at most
//!   `max_per_client` requests), or has nothing in flight (a request larger than a share still
//!   gets its turn): work-conserving, a lone connection may use the whole capacity; or
//! * its connection stays within its guaranteed share, `C` divided by the open connections:
//!   admitted even when the router is full (up to `2C`), so a modest connection is served
//!   however many greedy ones keep the router busy. The guaranteed shares add up to `C`.
//!
//! Otherwise it is shed, a greedy connection first. Bound: at most `2C` (requests and tokens)
//! is admitted at a time.

use crate::core::ClientId;
use std::collections::HashMap;

/// The capacity [`Admission`] shares out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AdmissionLimits {
    /// Requests in flight, all connections together.
    pub max_requests: usize,
    /// Tokens in flight, all connections together.
    pub max_tokens: usize,
    /// Requests in flight on one connection, whatever its share.
    pub max_per_client: usize,
}

/// Why a request was not admitted.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Shed {
    /// The connection is at its fair share of the router's capacity.
    #[error(
        "router at capacity: this connection has {requests} requests ({tokens} tokens) in flight, its fair share among {busy} busy connections is {share_requests} requests and {share_tokens} tokens; send the next request after an answer arrives"
    )]
    OverShare {
        /// The connection's requests in flight.
        requests: usize,
        /// Their tokens.
        tokens: usize,
        /// Connections with requests in flight (counting this one).
        busy: usize,
        /// The connection's share of requests.
        share_requests: usize,
        /// Its share of tokens.
        share_tokens: usize,
    },
    /// The router has its whole capacity in flight.
    #[error(
        "router at capacity: {requests} requests ({tokens} tokens) in flight, the limit is {max_requests} requests and {max_tokens} tokens; retry shortly"
    )]
    Saturated {
        /// Requests in flight.
        requests: usize,
        /// Their tokens.
        tokens: usize,
        /// The router's request limit.
        max_requests: usize,
        /// Its token limit.
        max_tokens: usize,
    },
    /// The router is stopping: it answers what it admitted and takes nothing new.
    #[error(
        "router draining before it stops: it takes no new requests; send this one to another router"
    )]
    Draining,
    /// The connection already has a request of this id in flight: answers name requests by
    /// id, so two at once could not be told apart (and one's tokens would be released for
    /// the other's).
    #[error(
        "request id {request_id} is already in flight on this connection; give each request in flight its own id"
    )]
    DuplicateId {
        /// The id.
        request_id: u64,
    },
}

impl Shed {
    /// The error code a refused request is answered with: a draining router says it is going
    /// away (`ShuttingDown`: a failover client sends its unanswered requests to the next
    /// router), a full one says retry (`Overloaded`).
    pub fn code(&self) -> expertmesh_transport::codec::ErrorCode {
        use expertmesh_transport::codec::ErrorCode;
        match self {
            Shed::Draining => ErrorCode::ShuttingDown,
            Shed::OverShare { .. } | Shed::Saturated { .. } => ErrorCode::Overloaded,
            Shed::DuplicateId { .. } => ErrorCode::InvalidInput,
        }
    }
}

/// One request's place: admitted and not yet released.
#[derive(Debug, Clone, Copy)]
struct Place {
    /// The request's id; once answered, the ticket [`Admission::answered`] gave it.
    key: u64,
    tokens: usize,
    /// Answered (its answer waits to be written): its id is free for a new request, its
    /// capacity is not.
    answered: bool,
}

/// One connection's requests in flight.
#[derive(Debug, Default)]
struct ClientLoad {
    /// Each request admitted and not yet released.
    inflight: Vec<Place>,
    tokens: usize,
    /// The connection has closed: forget it once its last request is released.
    closed: bool,
}

/// The router's admitted work and each connection's part of it. See the module docs.
#[derive(Debug)]
pub struct Admission {
    limits: AdmissionLimits,
    clients: HashMap<ClientId, ClientLoad>,
    /// Connections with at least one request in flight.
    busy: usize,
    /// Open connections ([`Admission::open`] minus [`Admission::close`]).
    open: usize,
    requests: usize,
    tokens: usize,
    /// [`Admission::drain`] was called: nothing more is admitted.
    draining: bool,
    /// The last ticket [`Admission::answered`] gave.
    tickets: u64,
}

impl Admission {
    /// Nothing in flight yet.
    pub fn new(limits: AdmissionLimits) -> Self {
        Self {
            limits: AdmissionLimits {
                max_requests: limits.max_requests.max(1),
                max_tokens: limits.max_tokens.max(1),
                max_per_client: limits.max_per_client.max(1),
            },
            clients: HashMap::new(),
            busy: 0,
            open: 0,
            requests: 0,
            tokens: 0,
            draining: false,
            tickets: 0,
        }
    }

    /// Admit nothing more (the router is stopping); what is in flight is still released.
    pub fn drain(&mut self) {
        self.draining = true;
    }

    /// Whether [`Admission::drain`] was called.
    pub fn is_draining(&self) -> bool {
        self.draining
    }

    /// Requests and tokens in flight, all connections together.
    pub fn in_flight(&self) -> (usize, usize) {
        (self.requests, self.tokens)
    }

    /// Requests and tokens `client` has in flight.
    pub fn client_in_flight(&self, client: ClientId) -> (usize, usize) {
        self.clients
            .get(&client)
            .map_or((0, 0), |c| (c.inflight.len(), c.tokens))
    }

    /// Admit request `request_id` of `tokens` tokens from `client`, or say why not.
    pub fn admit(&mut self, client: ClientId, request_id: u64, tokens: usize) -> Result<(), Shed> {
        if self.draining {
            return Err(Shed::Draining);
        }
        if self.clients.get(&client).is_some_and(|c| {
            c.inflight
                .iter()
                .any(|p| !p.answered && p.key == request_id)
        }) {
            return Err(Shed::DuplicateId { request_id });
        }
        let limits = self.limits;
        let (requests, tokens_in) = self.client_in_flight(client);
        // Within a share of the capacity among `n` connections, this request included.
        let within = |n: usize| {
            let share_requests = (limits.max_requests / n.max(1))
                .max(1)
                .min(limits.max_per_client);
            requests < share_requests && tokens_in + tokens <= limits.max_tokens / n.max(1)
        };
        // Below `times` × the capacity, this request included.
        let below = |times: usize| {
            self.requests < times * limits.max_requests
                && self.tokens + tokens <= times * limits.max_tokens
        };
        let busy = self.busy + usize::from(requests == 0);
        let admitted =
            (below(1) && (requests == 0 || within(busy))) || (below(2) && within(self.open.max(1)));
        if !admitted {
            return Err(if requests > 0 {
                Shed::OverShare {
                    requests,
                    tokens: tokens_in,
                    busy,
                    share_requests: (limits.max_requests / busy)
                        .max(1)
                        .min(limits.max_per_client),
                    share_tokens: limits.max_tokens / busy,
                }
            } else {
                Shed::Saturated {
                    requests: self.requests,
                    tokens: self.tokens,
                    max_requests: limits.max_requests,
                    max_tokens: limits.max_tokens,
                }
            });
        }
        let c = self.clients.entry(client).or_default();
        if c.inflight.is_empty() {
            self.busy += 1;
        }
        c.inflight.push(Place {
            key: request_id,
            tokens,
            answered: false,
        });
        c.tokens += tokens;
        self.requests += 1;
        self.tokens += tokens;
        Ok(())
    }

    /// Request `request_id` of `client` ended without an answer to write (refused after its
    /// admission): its share is free. A request that was not admitted (or already answered)
    /// is ignored.
    pub fn release(&mut self, client: ClientId, request_id: u64) {
        self.free(client, |p| !p.answered && p.key == request_id);
    }

    /// Request `request_id` of `client` has been answered (or failed) and its answer waits to
    /// be written: its id is free from now on (the client may send a request of that id once
    /// it has read the answer), its share stays taken until [`Admission::release_answered`]
    /// with the ticket returned (`None`: the request was not admitted).
    pub fn answered(&mut self, client: ClientId, request_id: u64) -> Option<u64> {
        let c = self.clients.get_mut(&client)?;
        let p = c
            .inflight
            .iter_mut()
            .find(|p| !p.answered && p.key == request_id)?;
        self.tickets += 1;
        p.key = self.tickets;
        p.answered = true;
        Some(self.tickets)
    }

    /// The answer of [`Admission::answered`]'s `ticket` is written (or dropped with its
    /// connection): its share is free.
    pub fn release_answered(&mut self, client: ClientId, ticket: u64) {
        self.free(client, |p| p.answered && p.key == ticket);
    }

    /// Frees `client`'s place that `which` picks, if any.
    fn free(&mut self, client: ClientId, which: impl Fn(&Place) -> bool) {
        let Some(c) = self.clients.get_mut(&client) else {
            return;
        };
        let Some(i) = c.inflight.iter().position(which) else {
            return;
        };
        let tokens = c.inflight.swap_remove(i).tokens;
        c.tokens -= tokens;
        self.requests -= 1;
        self.tokens -= tokens;
        if c.inflight.is_empty() {
            self.busy -= 1;
            if c.closed {
                self.clients.remove(&client);
            }
        }
    }

    /// A connection has opened (it counts for the guaranteed shares from now on).
    pub fn open(&mut self) {
        self.open += 1;
    }

    /// `client` has closed. Its requests still in flight keep their share until released
    /// (the router still holds their work).
    pub fn close(&mut self, client: ClientId) {
        self.open = self.open.saturating_sub(1);
        match self.clients.get_mut(&client) {
            Some(c) if !c.inflight.is_empty() => c.closed = true,
            Some(_) => {
                self.clients.remove(&client);
            }
            None => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> AdmissionLimits {
        AdmissionLimits {
            max_requests: 8,
            max_tokens: 1024,
            max_per_client: 6,
        }
    }

    #[test]
    fn a_draining_router_admits_nothing_and_still_releases() {
        let mut a = Admission::new(limits());
        a.open();
        a.admit(1, 1, 16).unwrap();
        a.admit(2, 2, 16).unwrap();
        a.drain();
        assert_eq!(a.admit(3, 3, 1), Err(Shed::Draining));
        assert_eq!(a.admit(1, 4, 1), Err(Shed::Draining));
        assert_eq!(a.in_flight(), (2, 32));
        a.release(1, 1);
        a.release(2, 2);
        assert_eq!(a.in_flight(), (0, 0));
        assert!(Shed::Draining.to_string().contains("another router"));
    }

    /// An id already in flight on a connection is refused (its release would free the other
    /// request's tokens); on another connection, or once answered, it is admitted.
    #[test]
    fn an_id_in_flight_on_its_connection_is_refused() {
        let mut a = Admission::new(limits());
        a.open();
        a.open();
        a.admit(1, 7, 256).unwrap();
        assert_eq!(a.admit(1, 7, 1), Err(Shed::DuplicateId { request_id: 7 }));
        assert_eq!(a.in_flight(), (1, 256), "the refusal took nothing");
        a.admit(2, 7, 1).unwrap();
        a.release(1, 7);
        assert_eq!(a.in_flight(), (1, 1));
        a.admit(1, 7, 1).unwrap();
        assert_eq!(
            Shed::DuplicateId { request_id: 7 }.code(),
            expertmesh_transport::codec::ErrorCode::InvalidInput
        );
    }

    #[test]
    fn a_lone_connection_may_use_the_capacity_up_to_its_own_limit() {
        let mut a = Admission::new(limits());
        a.open();
        for id in 0..4 {
            a.admit(1, id, 256).unwrap();
        }
        // 1024 tokens in flight: the token capacity is used up.
        assert!(matches!(a.admit(1, 9, 1), Err(Shed::OverShare { .. })));
        let mut a = Admission::new(limits());
        a.open();
        for id in 0..6 {
            a.admit(1, id, 1).unwrap();
        }
        let e = a.admit(1, 9, 1).unwrap_err();
        assert!(
            matches!(
                e,
                Shed::OverShare {
                    share_requests: 6,
                    ..
                }
            ),
            "{e:?}"
        );
    }

    #[test]
    fn a_greedy_connection_is_shed_while_a_modest_one_is_served() {
        let mut a = Admission::new(limits());
        a.open();
        a.open();
        // The greedy connection takes everything while the other is idle.
        for id in 0..4 {
            a.admit(1, id, 256).unwrap();
        }
        // The modest connection still gets a request within its guaranteed share (half of the
        // capacity: two connections are open), past the capacity.
        a.admit(2, 100, 32).unwrap();
        // The greedy one is now over its share (2 busy: 512 tokens each) until it drains.
        a.release(1, 0);
        assert!(a.admit(1, 10, 256).is_err());
        a.release(1, 1);
        a.release(1, 2);
        // 256 in flight, 256 more fits its share of 512 ...
        a.admit(1, 11, 256).unwrap();
        // ... a third does not.
        assert!(a.admit(1, 12, 256).is_err());
        // The modest connection's next request fits its share.
        a.release(2, 100);
        a.admit(2, 101, 32).unwrap();
        a.admit(2, 102, 32).unwrap();
        assert_eq!(a.in_flight(), (4, 256 + 256 + 64));
    }

    #[test]
    fn the_router_as_a_whole_stays_within_twice_its_capacity() {
        let mut a = Admission::new(AdmissionLimits {
            max_requests: 4,
            max_tokens: 1 << 20,
            max_per_client: 32,
        });
        // Four connections with one request each: the capacity is used up, and each is at its
        // share (one request).
        for c in 1..=4 {
            a.open();
            a.admit(c, 0, 1).unwrap();
        }
        for c in 1..=4 {
            let e = a.admit(c, 1, 1).unwrap_err();
            assert!(matches!(e, Shed::OverShare { .. }), "client {c}: {e:?}");
        }
        // New connections are within their guaranteed shares: admitted up to twice the
        // capacity.
        for c in 5..=8 {
            a.open();
            a.admit(c, 0, 1).unwrap();
        }
        a.open();
        let e = a.admit(9, 0, 1).unwrap_err();
        assert!(matches!(e, Shed::Saturated { requests: 8, .. }), "{e:?}");
        assert_eq!(a.in_flight(), (8, 8));
    }

    #[test]
    fn a_request_larger_than_a_share_waits_for_room_not_forever() {
        let mut a = Admission::new(limits()); // 1024 tokens
        // Two connections keep 512 tokens each in flight: the router is full.
        a.open();
        a.open();
        for c in [1, 2] {
            a.admit(c, 0, 256).unwrap();
            a.admit(c, 1, 256).unwrap();
        }
        // A third connection: a small request fits its guaranteed share (1024 / 3), a 512-token
        // one does not and the router is full: shed, then admitted once there is room.
        a.open();
        a.admit(3, 0, 32).unwrap();
        a.release(3, 0);
        assert!(matches!(a.admit(3, 1, 512), Err(Shed::Saturated { .. })));
        a.release(1, 0);
        a.release(1, 1);
        a.admit(3, 1, 512).unwrap();
    }

    #[test]
    fn release_frees_only_admitted_requests_and_forgets_closed_connections() {
        let mut a = Admission::new(limits());
        a.open();
        a.admit(1, 7, 10).unwrap();
        a.admit(1, 9, 20).unwrap();
        a.release(1, 8); // never admitted: ignored
        a.release(2, 7); // unknown connection: ignored
        assert_eq!(a.in_flight(), (2, 30));
        a.close(1);
        a.release(1, 7);
        assert_eq!(a.client_in_flight(1), (1, 20));
        a.release(1, 9);
        assert_eq!(a.in_flight(), (0, 0));
        assert!(a.clients.is_empty() && a.busy == 0);
    }

    /// An answered request frees its id at once (the client may reuse it) and its share
    /// only when the answer is written; releases by id and by ticket never free each other's.
    #[test]
    fn an_answered_request_frees_its_id_at_once_and_its_share_when_written() {
        let mut a = Admission::new(limits());
        a.open();
        a.admit(1, 7, 600).unwrap();
        assert_eq!(a.admit(1, 7, 10), Err(Shed::DuplicateId { request_id: 7 }));
        let ticket = a.answered(1, 7).expect("admitted");
        assert_eq!(a.answered(1, 7), None, "answered once");
        assert_eq!(a.in_flight(), (1, 600), "the share stays until written");
        // The id is free: a new request of id 7 is admitted (within the capacity).
        a.admit(1, 7, 400).unwrap();
        assert_eq!(a.in_flight(), (2, 1000));
        // Over the capacity while the first answer is unwritten (a lone connection).
        assert!(a.admit(1, 8, 100).is_err());
        a.release(1, 7); // the unanswered request 7, not the answered one
        assert_eq!(a.in_flight(), (1, 600));
        a.release_answered(1, ticket + 1); // no such ticket: ignored
        assert_eq!(a.in_flight(), (1, 600));
        a.release_answered(1, ticket);
        assert_eq!(a.in_flight(), (0, 0));
        a.admit(1, 8, 100).unwrap();
        assert_eq!(a.answered(2, 8), None, "unknown connection");
    }
}
