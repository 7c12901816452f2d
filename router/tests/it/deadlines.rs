//! Per-request deadlines in the router core (issue 15, item 4), driven sans-IO with simulated
//! workers that answer with zero rows when told to: a request past its own deadline fails
//! alone while the batch it shares goes on for the others; a batch fails as a whole only at
//! the latest of its members' deadlines; a request already past its deadline never reaches a
//! worker; a deadline is capped by the router's maximum. Also the other way one request could
//! fail its batch-mates: finite inputs so large that the gate's logits overflow fail that
//! request alone, and so do finite inputs whose expert outputs overflow.
//!
//! Before per-request deadlines a merged batch took its members' shortest deadline and failed
//! them all: one client sending `deadline_us = 1` failed most of another client's requests.

use expertmesh_router::core::{ClientId, RouterConfig, SharedSite};
use expertmesh_router::reference;
use expertmesh_router::sim::{Answer, Sim, SimWorker, WorkerAnswer, ZeroRows};
use expertmesh_topology::model::preset_by_name;
use expertmesh_transport::codec::Dispatch;
use expertmesh_transport::codec::{ErrorCode, LayerRequest};
use expertmesh_transport::dtype::ActivationDtype;
use std::time::{Duration, Instant};

/// The core with two simulated devices (mesh ranks 1 and 2, half of the experts each) that
/// answer with zero rows; every answer is held until the test delivers it ([`Sim::deliver`]).
fn cluster(window: Duration, max_deadline: Duration) -> Sim {
    let spec = preset_by_name("toy-softmax").unwrap();
    let e = spec.routed_experts;
    let shared = if spec.shared_experts > 0 {
        SharedSite::Rank(1)
    } else {
        SharedSite::None
    };
    let cfg = RouterConfig {
        batch_window: window,
        max_deadline,
        ..RouterConfig::default()
    };
    let mut sim = Sim::builder(&spec, &[(0..e / 2).collect(), (e / 2..e).collect()])
        .shared(shared)
        .config(cfg)
        .seed(7)
        .device_prefix("dev")
        .build(|_, _| Box::new(ZeroRows));
    sim.hold = true;
    sim
}

/// The MoE layer the requests go to.
fn layer(sim: &Sim) -> u32 {
    sim.core.spec().moe_layer_ids()[0]
}

/// Submit `tokens` tokens from `client` due `deadline` from now, and take the core's actions.
fn request(sim: &mut Sim, client: ClientId, request_id: u64, tokens: usize, deadline: Duration) {
    let h = sim.core.spec().hidden as usize;
    let x = reference::synthetic_hidden(request_id, tokens, h);
    let layer = layer(sim);
    sim.submit(client, request_id, layer, x, deadline);
    sim.pump();
}

fn code(a: &[&Answer]) -> Vec<Option<ErrorCode>> {
    a.iter().map(|r| r.as_ref().err().map(|e| e.0)).collect()
}

#[test]
fn a_short_deadline_fails_only_its_own_request_and_the_batch_goes_on() {
    let mut sim = cluster(Duration::from_millis(1), Duration::from_secs(60));
    // Client 1 asks for 100 µs, client 2 for 5 s; both join the same pending batch.
    request(&mut sim, 1, 10, 3, Duration::from_micros(100));
    request(&mut sim, 2, 20, 4, Duration::from_secs(5));
    assert!(sim.queue.is_empty(), "the batch waits for its window");
    // The window closes (the batch is dispatched as one) and client 1's deadline passes.
    sim.advance(Duration::from_millis(2));
    assert!(!sim.queue.is_empty(), "one batch dispatched");
    assert_eq!(
        code(&sim.replies_to(1, 10)),
        [Some(ErrorCode::DeadlineExceeded)]
    );
    let (_, msg) = sim.replies_to(1, 10)[0].as_ref().unwrap_err();
    assert!(msg.contains("own deadline"), "{msg}");
    assert!(
        sim.replies_to(2, 20).is_empty(),
        "client 2 is not failed with it"
    );
    // The workers answer: client 2 gets its output, client 1 nothing more.
    sim.deliver();
    let b = sim.replies_to(2, 20);
    assert_eq!(code(&b), [None], "{b:?}");
    assert_eq!(
        b[0].as_ref().unwrap().len(),
        4 * sim.core.spec().hidden as usize,
        "client 2's own rows"
    );
    assert_eq!(sim.replies_to(1, 10).len(), 1, "client 1 is answered once");
    assert_eq!(sim.core.inflight(), 0);
    // One request was answered: the latency histogram counts it alone (client 1's failure is
    // counted as its error, not as a request's duration).
    let registry =
        expertmesh_router::metrics::registry_of(std::sync::Arc::clone(sim.core.metrics()));
    let mut text = String::new();
    prometheus_client::encoding::prometheus_text::encode(&mut text, &registry).unwrap();
    let count = text
        .lines()
        .find_map(|l| l.strip_prefix("expertmesh_router_request_duration_seconds_count "))
        .unwrap_or_else(|| panic!("no request duration in:\n{text}"));
    assert_eq!(count.trim().parse::<f64>().unwrap(), 1.0, "{text}");
}

#[test]
fn a_batch_fails_as_a_whole_only_at_its_latest_deadline() {
    let mut sim = cluster(Duration::from_millis(1), Duration::from_secs(60));
    request(&mut sim, 1, 10, 2, Duration::from_millis(1));
    request(&mut sim, 2, 20, 2, Duration::from_millis(50));
    // The next timer is the earlier member's deadline, not the later one.
    let next = sim.core.next_timeout().unwrap();
    assert!(next <= sim.now + Duration::from_millis(1), "{next:?}");
    sim.advance(Duration::from_millis(2));
    assert_eq!(
        code(&sim.replies_to(1, 10)),
        [Some(ErrorCode::DeadlineExceeded)]
    );
    assert!(sim.replies_to(2, 20).is_empty());
    let next = sim.core.next_timeout().unwrap();
    assert!(
        next > sim.now + Duration::from_millis(40),
        "next timer at the later deadline: {:?} from now",
        next - sim.now
    );
    // The workers never answer: at 50 ms the batch fails, naming the devices it waits for.
    sim.advance(Duration::from_millis(49));
    assert_eq!(
        code(&sim.replies_to(2, 20)),
        [Some(ErrorCode::DeadlineExceeded)]
    );
    let (_, msg) = sim.replies_to(2, 20)[0].as_ref().unwrap_err();
    assert!(msg.contains("still waiting for dev"), "{msg}");
    assert_eq!(
        sim.replies_to(1, 10).len(),
        1,
        "client 1 is not failed twice"
    );
    assert_eq!(sim.core.inflight(), 0);
    // Late answers of the failed batch are ignored.
    sim.deliver();
    assert_eq!(sim.replies_to(2, 20).len(), 1);
}

#[test]
fn a_request_already_past_its_deadline_never_reaches_a_worker() {
    let mut sim = cluster(Duration::ZERO, Duration::from_secs(60));
    request(&mut sim, 1, 10, 2, Duration::ZERO);
    assert_eq!(
        code(&sim.replies_to(1, 10)),
        [Some(ErrorCode::DeadlineExceeded)]
    );
    assert!(sim.queue.is_empty(), "nothing dispatched for it");
    assert_eq!(sim.core.inflight(), 0);
    // The next request (another client, a normal deadline) is served as usual.
    request(&mut sim, 2, 20, 2, Duration::from_secs(5));
    sim.deliver();
    assert_eq!(code(&sim.replies_to(2, 20)), [None]);
}

#[test]
fn deadlines_are_capped_by_the_router_maximum() {
    let sim = cluster(Duration::ZERO, Duration::from_secs(30));
    let v = sim.core.validator();
    let req = |deadline_us| LayerRequest {
        request_id: 1,
        layer: layer(&sim),
        tokens: 1,
        hidden: sim.core.spec().hidden,
        dtype: ActivationDtype::F32,
        logit_experts: 0,
        deadline_us,
    };
    assert_eq!(v.deadline_of(&req(u64::MAX)), Duration::from_secs(30));
    assert_eq!(v.deadline_of(&req(31_000_000)), Duration::from_secs(30));
    assert_eq!(v.deadline_of(&req(1)), Duration::from_micros(1));
    // 0: the default (10 s), under the cap.
    assert_eq!(v.deadline_of(&req(0)), Duration::from_secs(10));
    // And a decoded request carries the capped deadline.
    let h = sim.core.spec().hidden as usize;
    let x: Vec<u8> = reference::synthetic_hidden(1, 1, h)
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let now = Instant::now();
    let r = v.validate(1, &req(u64::MAX), &x, now).unwrap();
    assert_eq!(r.deadline, now + Duration::from_secs(30));
}

/// Finite hidden states near f32's limit (they pass the NaN/Inf check on arrival) overflow the
/// gate's dot products: that request fails alone, naming its own token, and the request that
/// shares its batch is answered.
#[test]
fn inputs_that_overflow_the_gate_fail_only_their_own_request() {
    let mut sim = cluster(Duration::from_millis(1), Duration::from_secs(60));
    let h = sim.core.spec().hidden as usize;
    let layer = layer(&sim);
    request(&mut sim, 1, 10, 3, Duration::from_secs(5));
    let mut huge = reference::synthetic_hidden(20, 2, h);
    for v in &mut huge[h..] {
        *v = v.signum() * f32::MAX; // token 1 of this request
    }
    sim.submit(2, 20, layer, huge, Duration::from_secs(5));
    sim.pump();
    sim.advance(Duration::from_millis(2));
    let failed = sim.replies_to(2, 20);
    assert_eq!(code(&failed), [Some(ErrorCode::InvalidInput)], "{failed:?}");
    let (_, msg) = failed[0].as_ref().unwrap_err();
    assert!(
        msg.starts_with("token 1:") && msg.contains("not finite"),
        "{msg}"
    );
    sim.deliver();
    let ok = sim.replies_to(1, 10);
    assert_eq!(code(&ok), [None], "{ok:?}");
    assert_eq!(ok[0].as_ref().unwrap().len(), 3 * h);
    assert_eq!(sim.core.inflight(), 0);
}

/// A device whose first answer overflowed (rows of +inf, what SiLU(g)·u of hidden states
/// near 1e20 gives in f32) and whose later answers are rows of zeros.
struct OverflowsOnce(bool);

impl SimWorker for OverflowsOnce {
    fn answer(&mut self, d: &Dispatch, payload: &[u8]) -> WorkerAnswer {
        let (res, rows) = ZeroRows.answer(d, payload)?;
        if std::mem::replace(&mut self.0, true) {
            return Ok((res, rows));
        }
        let inf: Vec<u8> = rows
            .chunks(4)
            .flat_map(|_| f32::INFINITY.to_le_bytes())
            .collect();
        Ok((res, inf.into()))
    }
}

/// Expert outputs that are not finite fail that request alone, naming its first token,
/// instead of an answer of infinities marked as success: as the client's (InvalidInput)
/// when the token's hidden states are large enough to overflow (|x| past 1e12), else as a
/// device's (Internal); the core goes on serving.
#[test]
fn outputs_that_overflow_fail_their_request_naming_the_token() {
    let spec = preset_by_name("toy-softmax").unwrap();
    let e = spec.routed_experts;
    let cfg = RouterConfig {
        batch_window: Duration::from_millis(1),
        ..RouterConfig::default()
    };
    // One device holds every expert (and no shared one on the router), so a batch is one
    // dispatch and one answer.
    assert_eq!(spec.shared_experts, 0, "toy-softmax has no shared experts");
    let h = spec.hidden as usize;
    for (scale, want, says) in [
        (
            1.0,
            ErrorCode::Internal,
            "a device's output is not finite (",
        ),
        (
            1e13,
            ErrorCode::InvalidInput,
            "the layer's output is not finite (",
        ),
    ] {
        let mut sim = Sim::builder(&spec, &[(0..e).collect()])
            .config(cfg.clone())
            .seed(7)
            .device_prefix("dev")
            .build(|_, _| Box::new(OverflowsOnce(false)));
        let layer = layer(&sim);
        let mut x = reference::synthetic_hidden(10, 3, h);
        x.iter_mut().for_each(|v| *v *= scale);
        sim.submit(1, 10, layer, x, Duration::from_secs(5));
        sim.pump();
        sim.advance(Duration::from_millis(2));
        let failed = sim.replies_to(1, 10);
        assert_eq!(code(&failed), [Some(want)], "{failed:?}");
        let (_, msg) = failed[0].as_ref().unwrap_err();
        assert!(msg.starts_with("token 0:") && msg.contains(says), "{msg}");
        request(&mut sim, 1, 11, 2, Duration::from_secs(5));
        sim.advance(Duration::from_millis(2));
        let ok = sim.replies_to(1, 11);
        assert_eq!(code(&ok), [None], "{ok:?}");
        assert_eq!(ok[0].as_ref().unwrap().len(), 2 * h);
        assert_eq!(sim.core.inflight(), 0);
    }
}
