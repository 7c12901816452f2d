//! The rules the core's state keeps between any two inputs, checked after every input in debug
//! builds.
//!
//! Why this exists: the core's bookkeeping is spread over maps and counters that must agree —
//! a batch's outstanding count and its parts, each device's load and the parts it holds, a
//! batch's members and its rows. A slip in one of them shows up much later and far away, as a
//! hang, a wrong answer or a request answered twice. So, as TigerBeetle does, every input the
//! driver feeds the core ends with a check of all of them ([`RouterCore::check_invariants`])
//! whenever debug assertions are on (every test, every debug run of the fabric), and a broken
//! rule panics at the input that broke it, naming the rule. Release builds skip it.

use super::{Inflight, Member, Pending, RouterCore};
use expertmesh_transport::codec::OutputLayout;
use std::fmt::Display;

impl RouterCore {
    /// [`RouterCore::check_invariants`] when debug assertions are on; nothing otherwise.
    #[inline]
    pub(super) fn debug_check(&self) {
        if cfg!(debug_assertions) {
            self.check_invariants();
        }
    }

    /// Panics, naming the rule, unless the state is consistent:
    /// * batches in flight and pending stay within the in-flight limit plus one pending batch
    ///   per layer (a request is refused at the limit; each layer's pending batch, opened below
    ///   it, may still go out past it once);
    /// * a pending batch belongs to a served layer, holds fewer tokens than a full batch, and its
    ///   members, rows, logits, frontends and deadline agree ([`RouterCore::check_pending`]);
    /// * a batch in flight waits on something, and its outstanding count, parts, members and
    ///   rows agree, and twins name each other ([`RouterCore::check_inflight`]);
    /// * each device's load is the (token, expert) pairs of the live parts it holds.
    pub(super) fn check_invariants(&self) {
        let limit = self.cfg.max_inflight_batches + self.layers.len();
        assert!(
            self.inflight.len() + self.pending.len() <= limit,
            "{} batches in flight and {} pending: over the limit {} plus one per layer",
            self.inflight.len(),
            self.pending.len(),
            self.cfg.max_inflight_batches
        );
        for (&layer, p) in &self.pending {
            self.check_pending(layer, p);
        }
        let mut load = vec![0u64; self.replicas.load.len()];
        for (&id, b) in &self.inflight {
            self.check_inflight(id, b);
            for p in b.parts.iter().filter(|p| p.live) {
                load[p.rank as usize] += p.plan.pairs() as u64;
            }
        }
        assert_eq!(
            load, self.replicas.load,
            "each device's load is the pairs of the live parts it holds"
        );
    }

    /// The rules of the pending batch of `layer`.
    fn check_pending(&self, layer: u32, p: &Pending) {
        let what = format!("pending batch of layer {layer}");
        assert!(
            self.layers.contains_key(&layer),
            "{what}: a layer not served"
        );
        let (h, e) = (self.spec.hidden as usize, self.spec.routed_experts as usize);
        let tokens = p.x.len() / h;
        assert_eq!(p.x.len(), tokens * h, "{what}: whole rows of input");
        assert!(
            tokens < self.cfg.max_batch_tokens,
            "{what}: {tokens} tokens, a full batch is dispatched at once"
        );
        check_members(&p.members, tokens, &what);
        assert_eq!(p.logits.len(), tokens * e, "{what}: a logits row per token");
        assert_eq!(
            p.logits_given.len(),
            tokens,
            "{what}: logits flags per token"
        );
        let mut clients: Vec<_> = p.members.iter().map(|m| m.client).collect();
        clients.sort_unstable();
        clients.dedup();
        let mut listed = p.clients.clone();
        listed.sort_unstable();
        assert_eq!(listed, clients, "{what}: its frontends are its members'");
        let latest = p.members.iter().map(|m| m.deadline).max();
        assert_eq!(
            Some(p.deadline),
            latest,
            "{what}: its deadline is the latest"
        );
    }

    /// The rules of batch `id` in flight.
    fn check_inflight(&self, id: u64, b: &Inflight) {
        let what = format!("batch {id:#x} (layer {})", b.layer);
        let h = self.spec.hidden as usize;
        let live = b.parts.iter().filter(|p| p.live).count();
        assert_eq!(
            b.outstanding, live,
            "{what}: outstanding parts are the parts not yet answered"
        );
        assert!(
            b.outstanding > 0 || b.shared_pending,
            "{what}: waits on nothing, yet it was neither completed nor failed"
        );
        for (i, p) in b.parts.iter().enumerate() {
            assert_eq!(
                p.plan.rank, p.rank,
                "{what}: a part goes where it was planned"
            );
            assert!(p.hedge_at >= p.sent_at, "{what}: hedged before it was sent");
            if let Some(t) = p.twin {
                let back = b.parts.get(t as usize);
                assert!(
                    back.is_some_and(|q| q.twin == Some(i as u32) && q.rank != p.rank),
                    "{what}: part {i}'s twin {t} names it back, on another device"
                );
            }
        }
        check_members(&b.members, b.tokens, &what);
        assert_eq!(b.x.len(), b.tokens * h, "{what}: a row of input per token");
        assert_eq!(b.routing.tokens(), b.tokens, "{what}: routing per token");
        let latest = b.members.iter().map(|m| m.deadline).max();
        assert_eq!(
            Some(b.deadline),
            latest,
            "{what}: its deadline is the latest"
        );
        match self.wire.layout {
            OutputLayout::PerSlot => {
                let rows = b.tokens * b.routing.top_k * h;
                assert_eq!(b.slot_rows.len(), rows, "{what}: a row per (token, slot)");
                assert!(b.partials.is_empty(), "{what}: per-slot rows only");
            }
            OutputLayout::PreCombined => {
                assert!(b.slot_rows.is_empty(), "{what}: pre-combined rows only");
                for &part in b.partials.keys() {
                    let answered = b.parts.get(part as usize).is_some_and(|p| !p.live);
                    assert!(answered, "{what}: rows kept for part {part}, not answered");
                    if let Some(t) = b.parts[part as usize].twin {
                        assert!(
                            !b.partials.contains_key(&t),
                            "{what}: rows kept for both twins {part} and {t}"
                        );
                    }
                }
            }
        }
        if b.shared_pending {
            let rows = b.tokens * self.spec.shared_experts as usize * h;
            assert_eq!(
                b.shared_local.len(),
                rows,
                "{what}: room for the shared experts"
            );
        }
    }
}

/// The members of a batch of `tokens` tokens follow each other without gaps, in offset order.
fn check_members(members: &[Member], tokens: usize, what: &impl Display) {
    assert!(!members.is_empty(), "{what}: a batch without requests");
    let mut offset = 0;
    for m in members {
        assert_eq!(m.offset, offset, "{what}: member rows follow each other");
        offset += m.tokens;
    }
    assert_eq!(offset, tokens, "{what}: its members' tokens are its tokens");
}

#[cfg(test)]
mod tests {
    use crate::core::RouterConfig;
    use crate::sim::{Sim, ZeroRows};
    use expertmesh_topology::model::preset_by_name;
    use std::time::Duration;

    /// A batch in flight on two devices that hold their answers.
    fn one_batch_in_flight() -> Sim {
        let spec = preset_by_name("toy-softmax").unwrap();
        let cfg = RouterConfig {
            batch_window: Duration::ZERO,
            ..RouterConfig::default()
        };
        let mut sim = Sim::builder(&spec, &[(0..4).collect(), (4..8).collect()])
            .config(cfg)
            .build(|_, _| Box::new(ZeroRows));
        sim.hold = true;
        let x = crate::reference::synthetic_hidden(1, 6, spec.hidden as usize);
        sim.request(1, spec.moe_layer_ids()[0], &x);
        assert_eq!(sim.core.inflight(), 1);
        sim.core.check_invariants();
        sim
    }

    #[test]
    fn a_consistent_state_passes_through_a_whole_call() {
        let mut sim = one_batch_in_flight();
        sim.deliver(); // every input checks the invariants on the way
        assert!(sim.take(1).expect("answered").is_ok());
        sim.core.check_invariants();
    }

    #[test]
    #[should_panic(expected = "outstanding parts are the parts not yet answered")]
    fn an_outstanding_count_that_disagrees_with_the_parts_trips_the_check() {
        let mut sim = one_batch_in_flight();
        let b = sim.core.inflight.values_mut().next().unwrap();
        b.outstanding += 1;
        sim.core.check_invariants();
    }

    #[test]
    #[should_panic(expected = "each device's load is the pairs of the live parts it holds")]
    fn a_load_that_disagrees_with_the_parts_trips_the_check() {
        let mut sim = one_batch_in_flight();
        sim.core.replicas.load[1] += 1;
        sim.core.check_invariants();
    }
}
