//! The requests of one connection that are in flight, and the answers held for their handles.
//!
//! Why this exists: a pipelined [`RouterClient`](super::RouterClient) has several requests on
//! one connection and the router answers them in completion order. Matching answers to
//! requests by id, keeping an answer until its handle asks for it, discarding the answer of a
//! handle that was dropped, and failing what is still in flight when the connection breaks is
//! pure bookkeeping: it lives here, without I/O, so that it can be tested on its own
//! (property tests below).
//!
//! Every request is in one of two states: *in flight* (sent, not answered; it occupies one of
//! the connection's in-flight slots, whether or not its handle still exists) or *answered* (the
//! answer is held until its handle takes it). A dropped handle's request is forgotten as soon
//! as it is answered (or at once, when it already was), so nothing is kept for a handle that no
//! longer exists.

use std::collections::HashMap;

/// The state of one request.
#[derive(Debug)]
enum Slot<T> {
    /// Sent and not answered yet. `abandoned`: its handle is gone, so its answer is discarded
    /// when it comes (it still occupies an in-flight slot until then: the router still works on
    /// it).
    InFlight { abandoned: bool },
    /// Answered; the answer waits for its handle.
    Answered(T),
}

/// What happened to an answer handed to [`Pending::answer`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Delivery {
    /// Held for its handle.
    Held,
    /// Its handle was dropped: the answer was discarded and the request forgotten.
    Discarded,
    /// No request with this id is in flight (already answered, or never sent on this
    /// connection): the answer was ignored.
    Unknown,
}

/// What [`Pending::take`] found for a handle.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Take<T> {
    /// The answer; the request is forgotten.
    Ready(T),
    /// Still in flight.
    InFlight,
    /// No such request (never inserted, or already taken or abandoned).
    Unknown,
}

/// The requests of one connection, by request id: which are in flight, and the answers held
/// for handles that have not asked for them yet. `T` is an answer (the client stores the
/// response frame or the error).
#[derive(Debug)]
pub(crate) struct Pending<T> {
    slots: HashMap<u64, Slot<T>>,
    in_flight: usize,
}

impl<T> Default for Pending<T> {
    fn default() -> Self {
        Self {
            slots: HashMap::new(),
            in_flight: 0,
        }
    }
}

impl<T> Pending<T> {
    /// Requests sent and not answered yet, including those whose handle was dropped.
    pub(crate) fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// Answers held for handles that have not asked for them yet.
    pub(crate) fn held(&self) -> usize {
        self.slots.len() - self.in_flight
    }

    /// Record request `id` as sent. `false` (and nothing changes) when `id` is already known.
    pub(crate) fn insert(&mut self, id: u64) -> bool {
        if self.slots.contains_key(&id) {
            return false;
        }
        self.slots.insert(id, Slot::InFlight { abandoned: false });
        self.in_flight += 1;
        true
    }

    /// The answer to request `id` arrived.
    pub(crate) fn answer(&mut self, id: u64, answer: T) -> Delivery {
        match self.slots.get_mut(&id) {
            Some(Slot::InFlight { abandoned: false }) => {
                self.slots.insert(id, Slot::Answered(answer));
                self.in_flight -= 1;
                Delivery::Held
            }
            Some(Slot::InFlight { abandoned: true }) => {
                self.slots.remove(&id);
                self.in_flight -= 1;
                Delivery::Discarded
            }
            Some(Slot::Answered(_)) | None => Delivery::Unknown,
        }
    }

    /// The handle of request `id` was dropped: discard its answer (now, or when it comes).
    pub(crate) fn abandon(&mut self, id: u64) {
        match self.slots.get_mut(&id) {
            Some(Slot::InFlight { abandoned }) => *abandoned = true,
            Some(Slot::Answered(_)) => {
                self.slots.remove(&id);
            }
            None => {}
        }
    }

    /// The answer of request `id`, if it came (the request is then forgotten).
    pub(crate) fn take(&mut self, id: u64) -> Take<T> {
        match self.slots.get(&id) {
            None | Some(Slot::InFlight { abandoned: true }) => Take::Unknown,
            Some(Slot::InFlight { abandoned: false }) => Take::InFlight,
            Some(Slot::Answered(_)) => match self.slots.remove(&id) {
                Some(Slot::Answered(a)) => Take::Ready(a),
                _ => unreachable!("checked above"),
            },
        }
    }

    /// Whether request `id` was answered with an answer for which `pred` holds (the answer
    /// stays held).
    pub(crate) fn answered_with(&self, id: u64, pred: impl FnOnce(&T) -> bool) -> bool {
        matches!(self.slots.get(&id), Some(Slot::Answered(a)) if pred(a))
    }

    /// The connection was lost and the requests in flight will be sent again on another:
    /// abandoned ones are forgotten (nobody waits for them; their slots are freed), and the
    /// ids of the others, in increasing order, are returned (they stay in flight).
    pub(crate) fn requeue(&mut self) -> Vec<u64> {
        let before = self.slots.len();
        self.slots
            .retain(|_, s| !matches!(s, Slot::InFlight { abandoned: true }));
        self.in_flight -= before - self.slots.len();
        let mut ids: Vec<u64> = self
            .slots
            .iter()
            .filter(|(_, s)| matches!(s, Slot::InFlight { .. }))
            .map(|(&id, _)| id)
            .collect();
        ids.sort_unstable();
        ids
    }

    /// The connection broke: every request in flight is answered with `fail(id)` (abandoned
    /// ones are forgotten); answers that came before are kept. Returns how many failed.
    pub(crate) fn fail_all(&mut self, mut fail: impl FnMut(u64) -> T) -> usize {
        let mut failed = 0;
        self.slots
            .retain(|_, s| !matches!(s, Slot::InFlight { abandoned: true }));
        for (&id, slot) in self.slots.iter_mut() {
            if matches!(slot, Slot::InFlight { .. }) {
                *slot = Slot::Answered(fail(id));
                failed += 1;
            }
        }
        self.in_flight = 0;
        failed
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    #[test]
    fn answers_are_matched_by_id_in_any_order() {
        let mut p = Pending::default();
        for id in 1..=3 {
            assert!(p.insert(id));
        }
        assert!(!p.insert(2), "ids are unique");
        assert_eq!(p.in_flight(), 3);
        assert_eq!(p.answer(3, "c"), Delivery::Held);
        assert_eq!(p.answer(1, "a"), Delivery::Held);
        assert_eq!((p.in_flight(), p.held()), (1, 2));
        assert_eq!(p.take(2), Take::InFlight);
        assert_eq!(p.take(3), Take::Ready("c"));
        assert_eq!(p.take(3), Take::Unknown, "an answer is taken once");
        assert_eq!(p.answer(3, "again"), Delivery::Unknown);
        assert_eq!(p.answer(2, "b"), Delivery::Held);
        assert_eq!(p.take(2), Take::Ready("b"));
        assert_eq!(p.take(1), Take::Ready("a"));
        assert_eq!((p.in_flight(), p.held()), (0, 0));
    }

    #[test]
    fn an_abandoned_request_keeps_its_slot_until_answered_then_nothing_is_kept() {
        let mut p = Pending::default();
        p.insert(1);
        p.insert(2);
        p.abandon(1);
        assert_eq!(p.in_flight(), 2, "the router still works on it");
        assert_eq!(p.take(1), Take::Unknown);
        assert_eq!(p.answer(1, 10), Delivery::Discarded);
        assert_eq!((p.in_flight(), p.held()), (1, 0));
        assert_eq!(p.answer(2, 20), Delivery::Held);
        p.abandon(2);
        assert_eq!(
            (p.in_flight(), p.held()),
            (0, 0),
            "a held answer is dropped"
        );
        assert_eq!(p.answer(77, 0), Delivery::Unknown);
    }

    #[test]
    fn a_broken_connection_fails_what_is_in_flight_and_keeps_what_came() {
        let mut p = Pending::default();
        for id in 1..=4 {
            p.insert(id);
        }
        p.answer(1, Ok(1));
        p.abandon(2);
        assert_eq!(p.fail_all(|_| Err("closed")), 2);
        assert_eq!((p.in_flight(), p.held()), (0, 3));
        assert_eq!(p.take(1), Take::Ready(Ok(1)));
        assert_eq!(p.take(2), Take::Unknown);
        assert_eq!(p.take(3), Take::Ready(Err("closed")));
        assert_eq!(p.take(4), Take::Ready(Err("closed")));
    }

    #[test]
    fn a_lost_connection_requeues_what_is_waited_for_and_frees_abandoned_slots() {
        let mut p = Pending::default();
        for id in 1..=4 {
            p.insert(id);
        }
        p.answer(2, "b");
        p.abandon(3);
        assert!(p.answered_with(2, |a| *a == "b"));
        assert!(!p.answered_with(1, |_| true));
        assert_eq!(p.requeue(), vec![1, 4]);
        assert_eq!((p.in_flight(), p.held()), (2, 1));
        assert_eq!(p.answer(3, "late"), Delivery::Unknown, "forgotten");
        assert_eq!(p.answer(4, "d"), Delivery::Held);
        assert_eq!(p.take(2), Take::Ready("b"));
        assert_eq!(p.take(4), Take::Ready("d"));
        assert_eq!(p.take(1), Take::InFlight);
    }

    /// One step of a client's life: indices pick among the ids inserted so far.
    #[derive(Debug, Clone)]
    enum Op {
        Insert,
        Answer(usize),
        AnswerUnknown,
        Abandon(usize),
        Take(usize),
        FailAll,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => Just(Op::Insert),
            3 => any::<usize>().prop_map(Op::Answer),
            1 => Just(Op::AnswerUnknown),
            1 => any::<usize>().prop_map(Op::Abandon),
            2 => any::<usize>().prop_map(Op::Take),
            1 => Just(Op::FailAll),
        ]
    }

    /// The model: what each id's handle must see.
    #[derive(Debug, Clone, PartialEq)]
    enum Model {
        InFlight { abandoned: bool },
        Answered(u64),
        Gone,
    }

    proptest! {
        /// Against a model: every answer reaches its own handle exactly once, whatever the
        /// order; abandoned requests leave nothing behind once answered; `in_flight` counts
        /// exactly the unanswered requests (so a client that inserts only below its limit
        /// never exceeds it); a break fails exactly the requests in flight.
        #[test]
        fn matches_a_model(ops in proptest::collection::vec(op(), 1..200)) {
            const LIMIT: usize = 4;
            let mut p = Pending::default();
            let mut model: BTreeMap<u64, Model> = BTreeMap::new();
            let mut next = 1u64;
            let pick = |model: &BTreeMap<u64, Model>, i: usize| {
                (!model.is_empty()).then(|| *model.keys().nth(i % model.len()).unwrap())
            };
            for op in ops {
                match op {
                    Op::Insert => {
                        if p.in_flight() < LIMIT {
                            prop_assert!(p.insert(next));
                            model.insert(next, Model::InFlight { abandoned: false });
                            next += 1;
                        }
                    }
                    Op::Answer(i) => {
                        let Some(id) = pick(&model, i) else { continue };
                        let want = match model[&id] {
                            Model::InFlight { abandoned: false } => {
                                model.insert(id, Model::Answered(id * 1000));
                                Delivery::Held
                            }
                            Model::InFlight { abandoned: true } => {
                                model.insert(id, Model::Gone);
                                Delivery::Discarded
                            }
                            _ => Delivery::Unknown,
                        };
                        prop_assert_eq!(p.answer(id, id * 1000), want);
                    }
                    Op::AnswerUnknown => prop_assert_eq!(p.answer(next + 5, 0), Delivery::Unknown),
                    Op::Abandon(i) => {
                        let Some(id) = pick(&model, i) else { continue };
                        p.abandon(id);
                        let m = model.get_mut(&id).unwrap();
                        *m = match m {
                            Model::InFlight { .. } => Model::InFlight { abandoned: true },
                            _ => Model::Gone,
                        };
                    }
                    Op::Take(i) => {
                        let Some(id) = pick(&model, i) else { continue };
                        let want = match model[&id].clone() {
                            Model::Answered(v) => {
                                model.insert(id, Model::Gone);
                                Take::Ready(v)
                            }
                            Model::InFlight { abandoned: false } => Take::InFlight,
                            _ => Take::Unknown,
                        };
                        prop_assert_eq!(p.take(id), want);
                    }
                    Op::FailAll => {
                        let mut want = 0;
                        for (id, m) in model.iter_mut() {
                            match m {
                                Model::InFlight { abandoned: false } => {
                                    *m = Model::Answered(u64::MAX - id);
                                    want += 1;
                                }
                                Model::InFlight { abandoned: true } => *m = Model::Gone,
                                _ => {}
                            }
                        }
                        prop_assert_eq!(p.fail_all(|id| u64::MAX - id), want);
                    }
                }
                let in_flight = model
                    .values()
                    .filter(|m| matches!(m, Model::InFlight { .. }))
                    .count();
                let held = model.values().filter(|m| matches!(m, Model::Answered(_))).count();
                prop_assert_eq!(p.in_flight(), in_flight);
                prop_assert!(p.in_flight() <= LIMIT);
                prop_assert_eq!(p.held(), held);
            }
        }
    }
}
