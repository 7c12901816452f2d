//! The router core under device faults, against simulated workers (the real dispatch executor
//! and CPU backend) that answer after a per-device latency on a virtual clock: adaptive hedge
//! timing, quarantine with probing, answers of another router incarnation, error answers
//! failed over to replicas.

use crate::support::{bits, with_executors};
use expertmesh_quant::contract::ComputeMode;
use expertmesh_router::core::{LayerMode, RouterConfig};
use expertmesh_router::health::HedgePolicy;
use expertmesh_router::reference::{self, LayerWeights};
use expertmesh_router::sim::Sim;
use expertmesh_topology::model::{ModelSpec, preset_by_name};
use expertmesh_transport::codec::ErrorCode;
use std::collections::HashMap;
use std::time::Duration;

const SEED: u64 = 91;

/// `assign[d]` = experts of device d (mesh rank d + 1) in every layer; every device answers
/// after 2 ms (`sim.latency`) and requests are due in 10 s.
fn build(spec: &ModelSpec, assign: &[Vec<u32>]) -> (Sim, HashMap<u32, LayerWeights>) {
    build_in(spec, assign, RouterConfig::default().mode)
}

/// [`build`], serving in `mode`.
fn build_in(
    spec: &ModelSpec,
    assign: &[Vec<u32>],
    mode: LayerMode,
) -> (Sim, HashMap<u32, LayerWeights>) {
    let cfg = RouterConfig {
        batch_window: Duration::ZERO,
        micro_batch_tokens: 64,
        straggler_timeout: Duration::from_secs(3),
        default_deadline: Duration::from_secs(10),
        mode,
        ..RouterConfig::default()
    };
    let mut sim = with_executors(Sim::builder(spec, assign).config(cfg).seed(SEED));
    sim.deadline = Duration::from_secs(10);
    for rank in 1..=assign.len() as u32 {
        sim.latency.insert(rank, Duration::from_millis(2));
    }
    let layers = sim.layers.clone();
    (sim, layers)
}

/// toy-softmax on two devices that both hold every expert.
fn two_replicas() -> (ModelSpec, Sim, HashMap<u32, LayerWeights>) {
    let spec = preset_by_name("toy-softmax").unwrap();
    let all: Vec<u32> = (0..spec.routed_experts).collect();
    let (sim, layers) = build(&spec, &[all.clone(), all]);
    (spec, sim, layers)
}

/// The in-process reference's exact-mode output bits of layer 0 for `x`.
fn exact_bits(spec: &ModelSpec, layers: &HashMap<u32, LayerWeights>, x: &[f32]) -> Vec<u32> {
    let (_, y) = reference::moe_layer(spec, &layers[&0], x, ComputeMode::Exact).unwrap();
    bits(&y)
}

#[test]
fn a_paused_replica_is_hedged_in_milliseconds_then_quarantined_then_probed_back() {
    let (spec, mut sim, layers) = two_replicas();
    let h = spec.hidden as usize;
    let want = |x: &[f32]| exact_bits(&spec, &layers, x);
    // Warm up: both devices answer in 2 ms; the hedge timeout settles at the floor.
    for i in 0..40 {
        let x = reference::synthetic_hidden(i, 4, h);
        let (took, out) = sim.call(i, 0, x.clone());
        assert_eq!(bits(&out.unwrap()), want(&x));
        assert!(took <= Duration::from_millis(3), "{took:?}");
    }
    let floor = HedgePolicy::default().floor;
    assert_eq!(sim.core.hedge_after(1, 0), floor);
    assert_eq!(sim.core.hedge_after(2, 0), floor);

    // Device 1 pauses (SIGSTOP): calls are hedged to device 2 after ~10 ms, not 3 s.
    sim.silent.push(1);
    let mut slow = 0;
    for i in 100..120 {
        let x = reference::synthetic_hidden(i, 4, h);
        let (took, out) = sim.call(i, 0, x.clone());
        assert_eq!(bits(&out.unwrap()), want(&x), "hedged answers are exact");
        assert!(
            took <= floor + Duration::from_millis(5),
            "call {i} took {took:?}"
        );
        slow += usize::from(took > Duration::from_millis(3));
    }
    let st = sim.core.stats().clone();
    assert!(st.hedges >= 1 && slow >= 1, "{st:?}");
    // ... and after a few straggles it is out of rotation: calls no longer wait on it.
    assert_eq!(st.quarantines, 1, "{st:?}");
    assert_eq!(sim.core.quarantined(), vec![1]);
    assert!(slow <= 5, "quarantine stops the hedging: {slow} slow calls");
    let sent_before = sim.sent.get(&1).copied().unwrap_or(0);
    for i in 200..210 {
        let x = reference::synthetic_hidden(i, 4, h);
        let (took, _) = sim.call(i, 0, x.clone());
        assert!(took <= Duration::from_millis(3), "{took:?}");
    }
    assert_eq!(
        sim.sent.get(&1).copied().unwrap_or(0),
        sent_before,
        "nothing sent to a quarantined device before its probe"
    );

    // Still paused when the quarantine runs out: the probe goes unanswered, calls do not wait,
    // and the quarantine doubles.
    let period = HedgePolicy::default().backoff_initial;
    sim.run_until(sim.now + period);
    let x = reference::synthetic_hidden(300, 4, h);
    let (took, _) = sim.call(300, 0, x.clone());
    assert!(
        took <= Duration::from_millis(3),
        "a probe never delays a call: {took:?}"
    );
    assert_eq!(sim.core.stats().probes, 1);
    sim.run_until(sim.now + HedgePolicy::default().probe_timeout);
    assert_eq!(sim.core.stats().quarantines, 2);
    assert_eq!(sim.core.stats().quarantine_releases, 0);

    // Resumed: the next probe (after the doubled period) is answered and it is back.
    sim.silent.clear();
    sim.run_until(sim.now + period * 2);
    let x = reference::synthetic_hidden(301, 4, h);
    let _ = sim.call(301, 0, x.clone());
    sim.run_until(sim.now + Duration::from_millis(5));
    assert_eq!(sim.core.stats().probes, 2);
    assert_eq!(sim.core.stats().quarantine_releases, 1);
    assert!(sim.core.quarantined().is_empty());
    let before = sim.sent.get(&1).copied().unwrap_or(0);
    for i in 400..410 {
        let x = reference::synthetic_hidden(i, 4, h);
        let (_, out) = sim.call(i, 0, x.clone());
        assert_eq!(bits(&out.unwrap()), want(&x));
    }
    assert!(sim.sent[&1] > before, "back in replica choice");
}

#[test]
fn a_quarantined_sole_owner_is_still_used_for_its_own_experts() {
    let spec = preset_by_name("toy-softmax").unwrap();
    // device 1 holds experts 0-3 alone, device 2 holds everything
    let (mut sim, layers) = build(&spec, &[(0..4).collect(), (0..8).collect()]);
    let h = spec.hidden as usize;
    let t0 = sim.now;
    // a flapping link: lost and back three times
    for k in 0..3u32 {
        sim.core
            .on_peer_lost(1, t0 + Duration::from_millis(100 * k as u64));
        sim.core.on_peer_up(1);
    }
    assert_eq!(
        sim.core.quarantined(),
        vec![1],
        "a link that keeps failing is benched"
    );
    for i in 0..10 {
        let x = reference::synthetic_hidden(i, 8, h);
        let (_, out) = sim.call(i, 0, x.clone());
        let (_, y) = reference::moe_layer(&spec, &layers[&0], &x, ComputeMode::Exact).unwrap();
        assert_eq!(bits(&out.unwrap()), bits(&y));
    }
    assert_eq!(
        sim.sent.get(&1).copied().unwrap_or(0),
        0,
        "device 2 holds every expert"
    );

    // with device 2 gone, device 1 is the only owner of experts 0-3 and is used
    sim.core.on_peer_lost(2, sim.now);
    let lw = &layers[&0];
    let x = (0..200)
        .map(|s| reference::synthetic_hidden(s, 1, h))
        .find(|x| {
            let r =
                expertmesh_router::gating::route(&spec, &lw.gate.logits(x), &lw.gate.bias).unwrap();
            r.experts.iter().all(|&e| e < 4)
        })
        .unwrap();
    let (_, out) = sim.call(50, 0, x.clone());
    let (_, y) = reference::moe_layer(&spec, lw, &x, ComputeMode::Exact).unwrap();
    assert_eq!(bits(&out.unwrap()), bits(&y));
    assert!(sim.sent[&1] >= 1);
}

#[test]
fn answers_to_another_router_incarnation_are_dropped_and_counted() {
    let spec = preset_by_name("toy-softmax").unwrap();
    let all: Vec<u32> = (0..spec.routed_experts).collect();
    let (mut old, layers) = build(&spec, std::slice::from_ref(&all));
    let (mut new, _) = build(&spec, &[all]);
    old.core.set_incarnation(0x1111);
    new.core.set_incarnation(0x2222);
    let h = spec.hidden as usize;
    // The old router dispatches batch 1 of its incarnation; the worker computes it.
    let x_old = reference::synthetic_hidden(1, 3, h);
    old.request(1, 0, &x_old);
    let stale = old.queue.pop().unwrap();
    assert_eq!(stale.batch, 0x1111_0000_0001);
    // The restarted router has its own batch 1 in flight (another input) when the old
    // answer reaches it: dropped, counted, and the live batch is answered right.
    new.latency.insert(1, Duration::from_millis(50));
    let x_new = reference::synthetic_hidden(2, 3, h);
    new.request(7, 0, &x_new);
    let Ok((res, bytes)) = &stale.answer else {
        panic!("the worker answered")
    };
    new.core.on_result(1, res, bytes, new.now);
    new.core.on_worker_error(
        1,
        stale.batch,
        Some(stale.part),
        ErrorCode::Internal,
        "old",
        new.now,
    );
    assert_eq!(new.core.stats().stale_results, 2);
    assert!(new.replies.is_empty(), "the stale answer completed nothing");
    // its own answer completes it exactly
    new.run_until(new.now + Duration::from_millis(60));
    let out = new.take(7).expect("answered");
    let (_, y) = reference::moe_layer(&spec, &layers[&0], &x_new, ComputeMode::Exact).unwrap();
    assert_eq!(bits(&out.unwrap()), bits(&y));
}

#[test]
fn an_error_answer_goes_to_a_replica_when_one_holds_the_experts() {
    let spec = preset_by_name("toy-softmax").unwrap();
    let all: Vec<u32> = (0..spec.routed_experts).collect();
    let (mut sim, layers) = build(&spec, &[all.clone(), all]);
    let h = spec.hidden as usize;
    // device 1 says its experts are not loaded (a worker started with another placement)
    sim.erroring.insert(1, ErrorCode::NotFound);
    for i in 0..10 {
        sim.run_until(sim.now + Duration::from_millis(25));
        let x = reference::synthetic_hidden(i, 4, h);
        let (_, out) = sim.call(i, 0, x.clone());
        let (_, y) = reference::moe_layer(&spec, &layers[&0], &x, ComputeMode::Exact).unwrap();
        assert_eq!(bits(&out.expect("failed over")), bits(&y));
    }
    assert_eq!(sim.core.quarantined(), vec![1]);

    // without a replica the device's error is the answer
    let (mut sim, _) = build(&spec, &[(0..8).collect()]);
    sim.erroring.insert(1, ErrorCode::NotFound);
    let x = reference::synthetic_hidden(3, 2, h);
    let (_, out) = sim.call(1, 0, x.clone());
    let (code, msg) = out.unwrap_err();
    assert_eq!(code, ErrorCode::NotFound);
    assert!(msg.contains("node0/dev0"), "{msg}");
}

/// A device whose results have the wrong shape (one row short) is charged as one that answers
/// with an error: its parts go to a replica and it is quarantined; without a replica the call
/// fails naming the rows. (The batch failed at the first such answer, replica or not, and the
/// device was never charged.)
#[test]
fn a_result_of_the_wrong_shape_goes_to_a_replica_when_one_holds_the_experts() {
    let spec = preset_by_name("toy-softmax").unwrap();
    let all: Vec<u32> = (0..spec.routed_experts).collect();
    let (mut sim, layers) = build(&spec, &[all.clone(), all]);
    let h = spec.hidden as usize;
    sim.wrong_shape.push(1);
    for i in 0..10 {
        sim.run_until(sim.now + Duration::from_millis(25));
        let x = reference::synthetic_hidden(i, 4, h);
        let (_, out) = sim.call(i, 0, x.clone());
        assert_eq!(
            bits(&out.expect("failed over")),
            exact_bits(&spec, &layers, &x)
        );
    }
    assert_eq!(sim.core.quarantined(), vec![1]);

    let (mut sim, _) = build(&spec, &[(0..8).collect()]);
    sim.wrong_shape.push(1);
    let x = reference::synthetic_hidden(3, 2, h);
    let (_, out) = sim.call(1, 0, x);
    let (code, msg) = out.unwrap_err();
    assert_eq!(code, ErrorCode::Internal);
    assert!(msg.contains("rows") && msg.contains("node0/dev0"), "{msg}");
}

/// A device whose link is up but which does not take its frames (the driver's backlog for it
/// is full) has its parts sent to a replica at once, is quarantined, and comes back through
/// its probes once it takes frames again: it is not marked lost, as a failed send marks it.
#[test]
fn a_backlogged_device_is_worked_around_and_probed_back_not_lost() {
    let (spec, mut sim, layers) = two_replicas();
    let h = spec.hidden as usize;
    let want = |x: &[f32]| exact_bits(&spec, &layers, x);
    sim.backlogged.push(1);
    let gap = HedgePolicy::default().strike_gap;
    for i in 0..20 {
        // Faults closer together than the strike gap count once.
        sim.run_until(sim.now + gap);
        let x = reference::synthetic_hidden(500 + i, 4, h);
        let (took, out) = sim.call(500 + i, 0, x.clone());
        assert_eq!(bits(&out.unwrap()), want(&x), "served by the replica");
        assert!(took <= Duration::from_millis(3), "at once: {took:?}");
    }
    assert_eq!(sim.core.quarantined(), vec![1]);
    // It takes frames again: the next probe after its quarantine brings it back.
    sim.backlogged.clear();
    let period = HedgePolicy::default().backoff_initial;
    let before = sim.core.stats().quarantine_releases;
    for round in 0..4u64 {
        sim.run_until(sim.now + period * (1 << round));
        let x = reference::synthetic_hidden(600 + round, 4, h);
        let _ = sim.call(600 + round, 0, x);
        sim.run_until(sim.now + Duration::from_millis(5));
        if sim.core.stats().quarantine_releases > before {
            break;
        }
    }
    assert!(
        sim.core.stats().quarantine_releases > before,
        "probed back: {:?}",
        sim.core.stats()
    );
    assert!(sim.core.quarantined().is_empty());
}

/// Both owners of the experts slower than their hedge timeout (a load spike on each): a hedge
/// stays beside the part it hedges and the first answer of the two is taken, so every call is
/// answered when the first device answers: bit-exact per slot, and pre-combined (accurate
/// mode) within its tolerance of f64 (one twin's rows only, never both). A hedge that
/// superseded its part bounced the pairs between the two owners, each late answer dropped,
/// until the batch gave up ("failed its parts ... times").
#[test]
fn parts_slower_than_their_hedge_timeout_on_both_owners_are_answered_by_the_first() {
    for mode in [LayerMode::Exact, LayerMode::Accurate] {
        let spec = preset_by_name("toy-softmax").unwrap();
        let all: Vec<u32> = (0..spec.routed_experts).collect();
        let (mut sim, layers) = build_in(&spec, &[all.clone(), all], mode);
        let h = spec.hidden as usize;
        let check = |i: u64, x: &[f32], y: &[f32]| match mode {
            LayerMode::Exact => {
                assert_eq!(bits(y), exact_bits(&spec, &layers, x), "{mode:?} call {i}")
            }
            _ => {
                let lw = &layers[&0];
                let routing =
                    expertmesh_router::gating::route(&spec, &lw.gate.logits(x), &lw.gate.bias)
                        .unwrap();
                let truth = reference::moe_layer_f64(lw, x, &routing);
                let err = reference::rel_error_vs_rms(y, &truth);
                assert!(
                    err < 1e-4,
                    "{mode:?} call {i}: error {err} of the output RMS"
                );
            }
        };
        for i in 0..40 {
            let x = reference::synthetic_hidden(i, 4, h);
            let (_, out) = sim.call(i, 0, x.clone());
            check(i, &x, &out.unwrap());
        }
        let floor = HedgePolicy::default().floor;
        assert_eq!(sim.core.hedge_after(1, 0), floor);
        let slow = floor * 5;
        sim.latency.insert(1, slow);
        sim.latency.insert(2, slow);
        let before = sim.core.stats().clone();
        for i in 100..130 {
            let x = reference::synthetic_hidden(i, 4, h);
            let (took, out) = sim.call(i, 0, x.clone());
            let y = out.unwrap_or_else(|e| panic!("{mode:?} call {i} failed: {e:?}"));
            check(i, &x, &y);
            assert!(
                took <= slow + Duration::from_millis(1),
                "{mode:?} call {i}: {took:?}"
            );
        }
        let st = sim.core.stats();
        let (hedges, parts) = (st.hedges - before.hedges, st.parts_sent - before.parts_sent);
        assert!(hedges >= 1, "{mode:?}: the slow parts were hedged: {st:?}");
        assert!(
            parts <= 2 * (parts - hedges),
            "{mode:?}: at most one hedge per part: {hedges} hedges among {parts} parts sent"
        );
        assert_eq!(st.failures, before.failures);
    }
}

/// Both owners slow, every part hedged to the other; then one owner's link is lost with its
/// answers (originals and hedges) unsent: each of its parts is retired where its twin on the
/// other owner still waits, nothing is sent again, and the call is answered by the surviving
/// owner, bit-exact.
#[test]
fn a_lost_owner_leaves_its_parts_to_their_waiting_twins() {
    let (spec, mut sim, layers) = two_replicas();
    let h = spec.hidden as usize;
    for i in 0..40 {
        let _ = sim.call(i, 0, reference::synthetic_hidden(i, 4, h));
    }
    let floor = HedgePolicy::default().floor;
    let slow = floor * 5;
    sim.latency.insert(1, slow);
    sim.latency.insert(2, slow);
    let x = reference::synthetic_hidden(500, 8, h);
    let start = sim.now;
    let before = sim.core.stats().clone();
    sim.request(500, 0, &x);
    sim.run_until(start + floor * 2);
    let hedges = sim.core.stats().hedges - before.hedges;
    assert!(hedges >= 2, "both owners' parts hedged: {hedges}");
    let sent = sim.core.stats().parts_sent;
    // Device 2's link goes: its queued answers never come.
    sim.queue.retain(|f| f.rank != 2);
    sim.down.push(2);
    sim.core.on_peer_lost(2, sim.now);
    assert_eq!(sim.core.stats().parts_sent, sent, "nothing sent again");
    sim.run_until(start + slow * 3);
    let (at, out) = sim.take_timed(500).expect("answered");
    assert_eq!(bits(&out.unwrap()), exact_bits(&spec, &layers, &x));
    assert!(
        at <= start + floor * 2 + slow + Duration::from_millis(1),
        "{:?}",
        at - start
    );
}

/// A quarantined device that alone holds some experts serves its live part of a batch while
/// a probe (a mirror of another device's part) is out to it in the same batch: the probe's
/// error counts against the probe, and the live part beside it is still answered, not sent
/// again (an error frame names its part). Taken for the live part's, the error failed the
/// batch, since no other device holds those experts.
#[test]
fn a_probes_error_does_not_fail_the_live_part_beside_it() {
    let spec = preset_by_name("toy-softmax").unwrap();
    let all: Vec<u32> = (0..spec.routed_experts).collect();
    let half: Vec<u32> = (0..spec.routed_experts / 2).collect();
    let (mut sim, layers) = build(&spec, &[all, half]);
    let h = spec.hidden as usize;
    // Device 1 (mesh rank 1) stops taking frames until it is quarantined; calls that need
    // its own experts fail meanwhile, which is not what this test is about.
    sim.backlogged.push(1);
    let gap = HedgePolicy::default().strike_gap;
    for i in 0..20 {
        sim.run_until(sim.now + gap);
        let _ = sim.call(i, 0, reference::synthetic_hidden(i, 4, h));
        if sim.core.quarantined() == vec![1] {
            break;
        }
    }
    assert_eq!(sim.core.quarantined(), vec![1]);
    // It takes frames again, but answers its probe with an error.
    sim.backlogged.clear();
    sim.failing_probes.insert(1, ErrorCode::Internal);
    let period = HedgePolicy::default().backoff_initial;
    let before = sim.core.stats().clone();
    for round in 0..6u64 {
        sim.run_until(sim.now + period * (1 << round));
        let x = reference::synthetic_hidden(700 + round, 8, h);
        let (_, out) = sim.call(700 + round, 0, x.clone());
        if sim.core.stats().probes == before.probes {
            continue; // no probe went out with this call
        }
        let y = out.expect("the live parts are answered whatever the probe's answer");
        assert_eq!(bits(&y), exact_bits(&spec, &layers, &x));
        let after = sim.core.stats();
        assert_eq!(after.failures, before.failures);
        assert_eq!(
            after.parts_redispatched, before.parts_redispatched,
            "the live part on the device was not taken for failed"
        );
        return;
    }
    panic!("no probe went out: {:?}", sim.core.stats());
}

/// Every owner failing a part at once (both replicas' backlogs full, or both answering with a
/// device error, or one paused while every hedge to the other fails) does not bounce the part
/// between them until the deadline: the batch fails
/// after a bounded number of re-sends, naming a device, long before its 10 s deadline, and
/// the core goes on serving once a device takes frames again.
#[test]
fn parts_every_owner_fails_at_once_are_not_resent_without_end() {
    // The third case: one owner paused (its parts straggle), the other answering every part
    // with an error, so each hedge of a straggling part fails and it is hedged again.
    for case in ["backlogged", "erroring", "paused and erroring"] {
        let (spec, mut sim, layers) = two_replicas();
        let h = spec.hidden as usize;
        if case == "paused and erroring" {
            // Hedge timeouts at their floor: a straggling part is hedged every 25 ms.
            for i in 0..40 {
                let _ = sim.call(i, 0, reference::synthetic_hidden(i, 4, h));
            }
            sim.sent.clear();
        }
        match case {
            "backlogged" => sim.backlogged.extend([1, 2]),
            "erroring" => {
                sim.erroring.insert(1, ErrorCode::Overloaded);
                sim.erroring.insert(2, ErrorCode::Overloaded);
            }
            _ => {
                sim.silent.push(1);
                sim.erroring.insert(2, ErrorCode::Overloaded);
            }
        }
        let x = reference::synthetic_hidden(900, 4, h);
        let (took, out) = sim.call(900, 0, x.clone());
        let (code, msg) = out.expect_err("every owner fails");
        assert_eq!(code, ErrorCode::PeerUnavailable, "{msg}");
        assert!(msg.contains("gave up before the deadline"), "{msg}");
        assert!(took < Duration::from_secs(10), "{case}: {took:?}");
        let sent: usize = sim.sent.values().sum();
        assert!(sent <= 64, "{case}: {sent} dispatches sent");
        // A device takes frames again: served, exact.
        sim.erroring.clear();
        sim.backlogged.clear();
        sim.silent.clear();
        sim.run_until(sim.now + Duration::from_secs(60));
        let (_, out) = sim.call(901, 0, x.clone());
        assert_eq!(bits(&out.unwrap()), exact_bits(&spec, &layers, &x));
    }
}
