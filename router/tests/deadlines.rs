//! Per-request deadlines in the router core (issue 15, item 4), driven sans-IO with simulated
//! workers that answer with zero rows when told to: a request past its own deadline fails
//! alone while the batch it shares goes on for the others; a batch fails as a whole only at
//! the latest of its members' deadlines; a request already past its deadline never reaches a
//! worker; a deadline is capped by the router's maximum.
//!
//! Before per-request deadlines a merged batch took its members' shortest deadline and failed
//! them all: one client sending `deadline_us = 1` failed most of another client's requests.

use expertmesh_router::core::{
    Action, ClientId, LayerSetup, Request, RouterConfig, RouterCore, SharedSite,
};
use expertmesh_router::plan::{LayerOwners, Replicas};
use expertmesh_router::ranks::RankNames;
use expertmesh_router::reference;
use expertmesh_router::service::fresh_incarnation;
use expertmesh_topology::model::{ModelSpec, preset_by_name};
use expertmesh_transport::codec::{Body, ErrorCode, ExpertResult, LayerRequest, OutputLayout};
use expertmesh_transport::dtype::ActivationDtype;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// What one request got: its output, or its error code and message.
type Answer = Result<Vec<f32>, (ErrorCode, String)>;

/// The core with two simulated workers (mesh ranks 1 and 2, half of the experts each); a
/// dispatch is answered only when the test delivers it.
struct Sim {
    spec: ModelSpec,
    core: RouterCore,
    now: Instant,
    /// Dispatches sent and not yet answered: (rank, batch, part, rows, hidden, layout).
    sent: Vec<(u32, ExpertResult)>,
    /// Every answer, by (client, request id), in order (a request answered twice shows up twice).
    answers: HashMap<(ClientId, u64), Vec<Answer>>,
}

impl Sim {
    fn new(window: Duration, max_deadline: Duration) -> Sim {
        let spec = preset_by_name("toy-softmax").unwrap();
        let e = spec.routed_experts;
        let owners: Vec<Vec<u32>> = (0..e).map(|x| vec![1 + (x >= e / 2) as u32]).collect();
        let setups = spec
            .moe_layer_ids()
            .into_iter()
            .map(|l| LayerSetup {
                layer: l,
                gate: reference::synthetic_layer(&spec, 7, l).unwrap().gate,
                owners: LayerOwners {
                    owners: owners.clone(),
                },
                shared: if spec.shared_experts > 0 {
                    SharedSite::Rank(1)
                } else {
                    SharedSite::None
                },
            })
            .collect();
        let mut replicas = Replicas::new(3);
        replicas.alive[0] = false; // the router owns nothing
        let cfg = RouterConfig {
            batch_window: window,
            max_deadline,
            ..RouterConfig::default()
        };
        let names = vec!["router".into(), "dev0".into(), "dev1".into()];
        let core = RouterCore::new(
            spec.clone(),
            cfg,
            setups,
            replicas,
            RankNames::new(names, 1),
            None,
            fresh_incarnation(),
        );
        Sim {
            spec,
            core,
            now: Instant::now(),
            sent: Vec::new(),
            answers: HashMap::new(),
        }
    }

    fn layer(&self) -> u32 {
        self.spec.moe_layer_ids()[0]
    }

    /// Submit `tokens` tokens from `client` due `deadline` from now.
    fn request(&mut self, client: ClientId, request_id: u64, tokens: usize, deadline: Duration) {
        let h = self.spec.hidden as usize;
        let x = reference::synthetic_hidden(request_id, tokens, h);
        let req = Request {
            client,
            request_id,
            layer: self.layer(),
            tokens,
            x,
            logits: None,
            deadline: self.now + deadline,
        };
        self.core.submit(req, self.now);
        self.collect();
    }

    /// Take the core's actions: sends are held for [`Sim::deliver`], answers recorded.
    fn collect(&mut self) {
        loop {
            let actions = std::iter::from_fn(|| self.core.poll_action()).collect::<Vec<_>>();
            if actions.is_empty() {
                return;
            }
            for a in actions {
                match a {
                    Action::Send { rank, frame, .. } => {
                        let Body::Dispatch(d) = &frame.body else {
                            panic!("router sent {:?}", frame.body)
                        };
                        let rows = match d.layout {
                            OutputLayout::PerSlot => d.experts.len() as u32,
                            OutputLayout::PreCombined => d.tokens,
                        };
                        let res = ExpertResult {
                            batch_id: d.batch_id,
                            layer: d.layer,
                            part: d.part,
                            layout: d.layout,
                            rows,
                            hidden: d.hidden,
                            dtype: d.result_dtype,
                        };
                        self.sent.push((rank, res));
                    }
                    Action::Respond {
                        client,
                        request_id,
                        output,
                        ..
                    } => self
                        .answers
                        .entry((client, request_id))
                        .or_default()
                        .push(Ok(output)),
                    Action::Fail {
                        client,
                        request_id,
                        code,
                        message,
                    } => self
                        .answers
                        .entry((client, request_id))
                        .or_default()
                        .push(Err((code, message))),
                }
            }
        }
    }

    /// Let time pass and run the core's timers.
    fn advance(&mut self, d: Duration) {
        self.now += d;
        self.core.on_tick(self.now);
        self.collect();
    }

    /// Every held dispatch is answered (zero rows).
    fn deliver(&mut self) {
        for (rank, res) in std::mem::take(&mut self.sent) {
            let bytes = vec![0u8; res.rows as usize * res.hidden as usize * res.dtype.elem_bytes()];
            self.core.on_result(rank, &res, &bytes, self.now);
            self.collect();
        }
    }

    fn answer(&self, client: ClientId, request_id: u64) -> &[Answer] {
        self.answers
            .get(&(client, request_id))
            .map_or(&[], Vec::as_slice)
    }
}

fn code(a: &[Answer]) -> Vec<Option<ErrorCode>> {
    a.iter().map(|r| r.as_ref().err().map(|e| e.0)).collect()
}

#[test]
fn a_short_deadline_fails_only_its_own_request_and_the_batch_goes_on() {
    let mut sim = Sim::new(Duration::from_millis(1), Duration::from_secs(60));
    // Client 1 asks for 100 µs, client 2 for 5 s; both join the same pending batch.
    sim.request(1, 10, 3, Duration::from_micros(100));
    sim.request(2, 20, 4, Duration::from_secs(5));
    assert!(sim.sent.is_empty(), "the batch waits for its window");
    // The window closes (the batch is dispatched as one) and client 1's deadline passes.
    sim.advance(Duration::from_millis(2));
    assert!(!sim.sent.is_empty(), "one batch dispatched");
    assert_eq!(code(sim.answer(1, 10)), [Some(ErrorCode::DeadlineExceeded)]);
    let (_, msg) = sim.answer(1, 10)[0].as_ref().unwrap_err();
    assert!(msg.contains("own deadline"), "{msg}");
    assert!(
        sim.answer(2, 20).is_empty(),
        "client 2 is not failed with it"
    );
    // The workers answer: client 2 gets its output, client 1 nothing more.
    sim.deliver();
    let b = sim.answer(2, 20);
    assert_eq!(code(b), [None], "{b:?}");
    assert_eq!(
        b[0].as_ref().unwrap().len(),
        4 * sim.spec.hidden as usize,
        "client 2's own rows"
    );
    assert_eq!(sim.answer(1, 10).len(), 1, "client 1 is answered once");
    assert_eq!(sim.core.inflight(), 0);
}

#[test]
fn a_batch_fails_as_a_whole_only_at_its_latest_deadline() {
    let mut sim = Sim::new(Duration::from_millis(1), Duration::from_secs(60));
    sim.request(1, 10, 2, Duration::from_millis(1));
    sim.request(2, 20, 2, Duration::from_millis(50));
    // The next timer is the earlier member's deadline, not the later one.
    let next = sim.core.next_timeout().unwrap();
    assert!(next <= sim.now + Duration::from_millis(1), "{next:?}");
    sim.advance(Duration::from_millis(2));
    assert_eq!(code(sim.answer(1, 10)), [Some(ErrorCode::DeadlineExceeded)]);
    assert!(sim.answer(2, 20).is_empty());
    let next = sim.core.next_timeout().unwrap();
    assert!(
        next > sim.now + Duration::from_millis(40),
        "next timer at the later deadline: {:?} from now",
        next - sim.now
    );
    // The workers never answer: at 50 ms the batch fails, naming the devices it waits for.
    sim.advance(Duration::from_millis(49));
    assert_eq!(code(sim.answer(2, 20)), [Some(ErrorCode::DeadlineExceeded)]);
    let (_, msg) = sim.answer(2, 20)[0].as_ref().unwrap_err();
    assert!(msg.contains("still waiting for dev"), "{msg}");
    assert_eq!(sim.answer(1, 10).len(), 1, "client 1 is not failed twice");
    assert_eq!(sim.core.inflight(), 0);
    // Late answers of the failed batch are ignored.
    sim.deliver();
    assert_eq!(sim.answer(2, 20).len(), 1);
}

#[test]
fn a_request_already_past_its_deadline_never_reaches_a_worker() {
    let mut sim = Sim::new(Duration::ZERO, Duration::from_secs(60));
    sim.request(1, 10, 2, Duration::ZERO);
    assert_eq!(code(sim.answer(1, 10)), [Some(ErrorCode::DeadlineExceeded)]);
    assert!(sim.sent.is_empty(), "nothing dispatched for it");
    assert_eq!(sim.core.inflight(), 0);
    // The next request (another client, a normal deadline) is served as usual.
    sim.request(2, 20, 2, Duration::from_secs(5));
    sim.deliver();
    assert_eq!(code(sim.answer(2, 20)), [None]);
}

#[test]
fn deadlines_are_capped_by_the_router_maximum() {
    let sim = Sim::new(Duration::ZERO, Duration::from_secs(30));
    let v = sim.core.validator();
    let req = |deadline_us| LayerRequest {
        request_id: 1,
        layer: sim.layer(),
        tokens: 1,
        hidden: sim.spec.hidden,
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
    let h = sim.spec.hidden as usize;
    let x: Vec<u8> = reference::synthetic_hidden(1, 1, h)
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let now = Instant::now();
    let r = v.validate(1, &req(u64::MAX), &x, now).unwrap();
    assert_eq!(r.deadline, now + Duration::from_secs(30));
}
