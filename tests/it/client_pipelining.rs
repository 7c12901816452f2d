//! `RouterClient` pipelining against the real fabric: worker processes (this crate's
//! `expertmesh` binary) over TCP, the router service in the test process, one frontend
//! connection with many requests in flight.
//!
//! Checks: requests of different layers, sizes and input dtypes (f32, bf16 bits, f16 bits, with
//! and without router logits) submitted together and waited in reverse and shuffled order give
//! outputs bit-identical to plain `call`s of the same inputs (exact mode); a refused request
//! fails only its own handle; `wait_into` with a wrong-size buffer is refused and the
//! connection goes on; more submits than the in-flight limit complete (the limit waits, it does
//! not fail); dropped handles and a `wait` cancelled by a timeout leave nothing behind; a
//! connection broken with requests in flight fails each of them with the same error.

use crate::support::{bits, rt};
use expertmesh_fabric::local::LocalFabric;
use expertmesh_router::client::{CallHandle, ClientError, HiddenStates, RouterClient};
use expertmesh_router::reference;
use expertmesh_transport::codec::ErrorCode;
use expertmesh_transport::dtype::ActivationDtype;
use expertmesh_transport::mesh::LinkKind;
use half::{bf16, f16};
use std::time::Duration;

fn start_fabric() -> LocalFabric {
    LocalFabric::start(crate::support::demo_options(
        "single-host.toml",
        LinkKind::Tcp,
    ))
    .unwrap()
}

fn connect(rt: &tokio::runtime::Runtime, fabric: &LocalFabric) -> RouterClient {
    rt.block_on(RouterClient::connect(
        fabric.frontend_addr(),
        &fabric.frontend_config(),
    ))
    .unwrap()
}

/// A deterministic permutation of `0..n` (Fisher–Yates with a small LCG).
fn shuffled(n: usize, mut seed: u64) -> Vec<usize> {
    let mut v: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        v.swap(i, (seed >> 33) as usize % (i + 1));
    }
    v
}

/// How a request carries its hidden states.
#[derive(Clone, Copy, Debug)]
enum Input {
    F32,
    Bf16,
    F16,
}

/// One layer call and what a plain `call` of the same input returns.
struct Case {
    layer: u32,
    hidden: usize,
    input: Input,
    /// The f32 values (for bf16/f16: exactly the values the bits encode).
    x: Vec<f32>,
    bits: Vec<u16>,
    logits: Option<Vec<f32>>,
    want: Vec<f32>,
}

impl Case {
    fn new(fabric: &LocalFabric, layer: u32, tokens: usize, input: Input, seed: u64) -> Self {
        let dep = fabric.deployment();
        let h = dep.spec.hidden as usize;
        let raw = reference::synthetic_hidden(seed, tokens, h);
        let (x, bits): (Vec<f32>, Vec<u16>) = match input {
            Input::F32 => (raw, Vec::new()),
            Input::Bf16 => raw
                .iter()
                .map(|&v| (bf16::from_f32(v).to_f32(), bf16::from_f32(v).to_bits()))
                .unzip(),
            Input::F16 => raw
                .iter()
                .map(|&v| (f16::from_f32(v).to_f32(), f16::from_f32(v).to_bits()))
                .unzip(),
        };
        // Every third case brings its own router logits (the negated gate: other experts).
        let logits = seed.is_multiple_of(3).then(|| {
            let gate = reference::synthetic_gate(&dep.spec, dep.seed, layer);
            gate.logits(&x).iter().map(|v| -v).collect()
        });
        Self {
            layer,
            hidden: h,
            input,
            x,
            bits,
            logits,
            want: Vec::new(),
        }
    }

    fn states(&self) -> HiddenStates<'_> {
        match self.input {
            Input::F32 => HiddenStates::F32(&self.x),
            Input::Bf16 => HiddenStates::Bf16Bits(&self.bits),
            Input::F16 => HiddenStates::F16Bits(&self.bits),
        }
    }

    fn dtype(&self) -> ActivationDtype {
        match self.input {
            Input::F32 => ActivationDtype::F32,
            Input::Bf16 => ActivationDtype::Bf16,
            Input::F16 => ActivationDtype::F16,
        }
    }

    /// The answer of a plain, one-at-a-time call on its own connection.
    fn plain(&mut self, rt: &tokio::runtime::Runtime, c: &mut RouterClient) {
        self.want = rt.block_on(self.call(c)).unwrap();
    }

    /// A plain call of this case.
    async fn call(&self, c: &mut RouterClient) -> Result<Vec<f32>, ClientError> {
        let (x, d, l) = (&self.x, self.dtype(), self.logits.as_deref());
        c.call_as(self.layer, x, self.hidden, d, l, None).await
    }

    async fn submit(&self, c: &mut RouterClient) -> Result<CallHandle, ClientError> {
        let l = self.logits.as_deref();
        c.submit(self.layer, self.states(), self.hidden, l, None)
            .await
    }
}

/// Cases over every layer, several sizes and every input dtype.
fn cases(fabric: &LocalFabric, rt: &tokio::runtime::Runtime, n: usize) -> Vec<Case> {
    let layers = fabric.deployment().spec.moe_layer_ids();
    let sizes = [1usize, 7, 40, 3, 16, 64, 2, 23];
    let inputs = [Input::F32, Input::Bf16, Input::F16];
    let mut plain = connect(rt, fabric);
    (0..n)
        .map(|i| {
            let layer = layers[i % layers.len()];
            let tokens = sizes[i % sizes.len()];
            let mut c = Case::new(fabric, layer, tokens, inputs[i % 3], 100 + i as u64);
            c.plain(rt, &mut plain);
            c
        })
        .collect()
}

/// Submit every case on `c`, then wait them in `order`, each compared bit for bit with its
/// plain call; even positions use `wait_into`.
async fn submit_all_wait_in(c: &mut RouterClient, cases: &[Case], order: &[usize]) {
    let mut handles = Vec::new();
    for case in cases {
        handles.push(Some(case.submit(c).await.unwrap()));
        assert!(c.in_flight() <= c.max_in_flight());
    }
    for (k, &i) in order.iter().enumerate() {
        let h = handles[i].take().unwrap();
        let got = if k % 2 == 0 {
            let mut out = vec![f32::NAN; h.output_len()];
            c.wait_into(h, &mut out).await.unwrap();
            out
        } else {
            c.wait(h).await.unwrap()
        };
        let case = &cases[i];
        assert_eq!(
            bits(&got),
            bits(&case.want),
            "case {i}: layer {} {:?} {} tokens, logits {}",
            case.layer,
            case.input,
            got.len() / case.hidden,
            case.logits.is_some()
        );
    }
    assert_eq!((c.in_flight(), c.ready()), (0, 0));
}

#[test]
fn pipelined_requests_are_bit_identical_to_plain_calls_in_any_wait_order() {
    let _machine = crate::support::shared();
    let fabric = start_fabric();
    let rt = rt();
    let cases = cases(&fabric, &rt, 16);
    let mut c = connect(&rt, &fabric);
    let reverse: Vec<usize> = (0..cases.len()).rev().collect();
    rt.block_on(submit_all_wait_in(&mut c, &cases, &reverse));
    for seed in [1, 2] {
        let order = shuffled(cases.len(), seed);
        rt.block_on(submit_all_wait_in(&mut c, &cases, &order));
    }
    // Two micro-batches in flight and a plain call on the same connection between them.
    rt.block_on(async {
        let a = cases[2].submit(&mut c).await.unwrap();
        let b = cases[5].submit(&mut c).await.unwrap();
        let mid = cases[7].call(&mut c).await.unwrap();
        assert_eq!(bits(&mid), bits(&cases[7].want));
        assert_eq!(bits(&c.wait(b).await.unwrap()), bits(&cases[5].want));
        assert_eq!(bits(&c.wait(a).await.unwrap()), bits(&cases[2].want));
    });
    fabric.shutdown();
}

#[test]
fn refusals_wrong_buffers_dropped_handles_and_the_limit_affect_only_their_own_requests() {
    let _machine = crate::support::shared();
    let fabric = start_fabric();
    let rt = rt();
    let cases = cases(&fabric, &rt, 8);
    let mut c = connect(&rt, &fabric);
    let h = fabric.deployment().spec.hidden as usize;
    rt.block_on(async {
        // A refused request (unknown layer) among good ones fails only its own handle.
        let a = cases[0].submit(&mut c).await.unwrap();
        let bad = c.submit(99, &cases[1].x, h, None, None).await.unwrap();
        let b = cases[1].submit(&mut c).await.unwrap();
        assert_eq!(bits(&c.wait(b).await.unwrap()), bits(&cases[1].want));
        let e = c.wait(bad).await.unwrap_err();
        assert_eq!(e.code(), Some(ErrorCode::NotFound), "{e}");
        assert!(e.to_string().contains("layer 99"), "{e}");
        assert_eq!(bits(&c.wait(a).await.unwrap()), bits(&cases[0].want));

        // A wrong-size buffer is refused; the connection and the other handles go on.
        let a = cases[2].submit(&mut c).await.unwrap();
        let b = cases[3].submit(&mut c).await.unwrap();
        let mut wrong = vec![0f32; a.output_len() + 1];
        let e = c.wait_into(a, &mut wrong).await.unwrap_err();
        assert!(matches!(e, ClientError::Usage(_)), "{e}");
        assert_eq!(bits(&c.wait(b).await.unwrap()), bits(&cases[3].want));

        // More submits than the limit: they wait for answers, none fails.
        for limit in [32, 3] {
            c.set_max_in_flight(limit);
            let n = 3 * limit + 1;
            let order = shuffled(n, limit as u64);
            let many: Vec<&Case> = (0..n).map(|i| &cases[i % cases.len()]).collect();
            let mut handles = Vec::new();
            for case in &many {
                handles.push(Some(case.submit(&mut c).await.unwrap()));
                assert!(c.in_flight() <= limit);
            }
            for i in order {
                let got = c.wait(handles[i].take().unwrap()).await.unwrap();
                assert_eq!(bits(&got), bits(&many[i].want), "limit {limit} request {i}");
            }
        }
        c.set_max_in_flight(32);

        // Dropped handles keep nothing; a wait cancelled by a timeout abandons only its handle.
        let mut kept = Vec::new();
        for (i, case) in cases.iter().enumerate() {
            let handle = case.submit(&mut c).await.unwrap();
            if i % 2 == 0 {
                kept.push((i, handle));
            }
        }
        let first = kept.remove(0).1;
        let _ = tokio::time::timeout(Duration::ZERO, c.wait(first)).await;
        for (i, handle) in kept {
            assert_eq!(bits(&c.wait(handle).await.unwrap()), bits(&cases[i].want));
        }
        assert_eq!(c.ready(), 0, "no answer is held for a dropped handle");
        let got = cases[7].call(&mut c).await.unwrap();
        assert_eq!(bits(&got), bits(&cases[7].want));
        assert_eq!(c.ready(), 0);
    });
    fabric.shutdown();
}

#[test]
fn a_connection_broken_with_requests_in_flight_fails_each_with_the_same_error() {
    let _machine = crate::support::shared();
    let fabric = start_fabric();
    let rt = rt();
    let cases = cases(&fabric, &rt, 6);
    let mut c = connect(&rt, &fabric);
    rt.block_on(async {
        let mut handles = Vec::new();
        for case in &cases {
            handles.push(case.submit(&mut c).await.unwrap());
        }
        // Bytes that cannot be framed: the router closes this connection.
        c.write_raw(&[0xFFu8; 64]).await.unwrap();
        let mut errors = Vec::new();
        // A request after the garbage is never read by the router.
        match cases[0].submit(&mut c).await {
            Ok(h) => errors.push(c.wait(h).await.unwrap_err().to_string()),
            Err(e) => errors.push(e.to_string()),
        }
        for (i, h) in handles.into_iter().enumerate().rev() {
            match c.wait(h).await {
                Ok(got) => assert_eq!(bits(&got), bits(&cases[i].want)),
                Err(e) => {
                    assert!(matches!(e, ClientError::Transport(_)), "{e}");
                    errors.push(e.to_string());
                }
            }
        }
        let e = cases[1].submit(&mut c).await.unwrap_err();
        errors.push(e.to_string());
        assert!(
            errors.iter().all(|e| *e == errors[0]),
            "one error for all: {errors:#?}"
        );
        assert!(errors[0].contains("router connection"), "{}", errors[0]);
    });
    // Other connections are not affected.
    let mut other = connect(&rt, &fabric);
    let case = &cases[4];
    let got = rt.block_on(case.submit(&mut other)).unwrap();
    assert_eq!(
        bits(&rt.block_on(other.wait(got)).unwrap()),
        bits(&case.want)
    );
    fabric.shutdown();
}
