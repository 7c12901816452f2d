//! Combine: worker results decoded into place, the router's own shared experts, and a finished
//! batch combined into its requests' outputs.
//!
//! Why this exists: this is the return half of a layer call, where the numerical contract is
//! kept. Each result row is decoded once, straight into its place (per-slot rows into the
//! batch's `[tokens][slots][hidden]` rows, pre-combined rows kept per part); when every part
//! and the router-side shared experts are in, each token is combined in the contract's order
//! (slots in order, or the devices' partial sums in part order, then the shared experts)
//! directly into its request's output buffer, which the answer carries: no batch-wide output
//! and no copy per request.

use super::{Action, Inflight, Member, ResultWire, RouterCore};
use expertmesh_backend::BackendError;
use expertmesh_transport::codec::{ErrorCode, ExpertResult, OutputLayout, WireFormat};
use expertmesh_transport::dtype::{self, DtypeError, OutputDtype};
use std::time::Instant;

impl RouterCore {
    /// [`RouterCore::on_result`]: the answer of a live part is checked against the shape asked
    /// for and decoded into place; the batch completes with its last part (one of wrong shape
    /// counts against its device, as an error answer does). Answers of another
    /// incarnation, of finished batches and of superseded parts are dropped; a probe's answer
    /// releases or re-benches its device.
    pub(super) fn take_result(
        &mut self,
        from: u32,
        res: &ExpertResult,
        payload: &[u8],
        now: Instant,
    ) {
        if !self.own_batch(res.batch_id, from, now) {
            return;
        }
        if self.health.is_probe(from, res.batch_id, res.part) {
            self.probe_answered(from, res, payload, now);
            return;
        }
        let h = self.spec.hidden as usize;
        let wire = self.wire;
        let Some(b) = self.inflight.get_mut(&res.batch_id) else {
            return; // late result of a finished or failed batch
        };
        let Some(part) = b.parts.get_mut(res.part as usize) else {
            return;
        };
        if !part.live || part.rank != from {
            return; // superseded by a re-dispatch
        }
        let expect_rows = match wire.layout {
            OutputLayout::PerSlot => part.plan.pairs(),
            OutputLayout::PreCombined => part.plan.tokens.len(),
        };
        let wrong = res.rows as usize != expect_rows
            || res.layout != wire.layout
            || res.hidden as usize != h
            || payload.len() != expect_rows * h * res.dtype.elem_bytes();
        if wrong {
            let msg = format!(
                "{} returned {} rows of {} values ({} bytes) where {} rows of {h} were expected",
                self.name(from),
                res.rows,
                res.hidden,
                payload.len(),
                expect_rows
            );
            return self.bad_result(from, res.batch_id, res.part as usize, msg, now);
        }
        if b.store_rows(res, payload, wire, h).is_err() {
            let msg = format!("{} sent an undecodable result", self.name(from));
            return self.bad_result(from, res.batch_id, res.part as usize, msg, now);
        }
        if let Some(twin) = b.live_twin(res.part as usize) {
            b.retire(twin, &mut self.replicas.load); // answered here first
        }
        let part = &b.parts[res.part as usize];
        let latency = now.saturating_duration_since(part.sent_at);
        self.metrics.on_part_answered(part.sent_at, now);
        let in_time = !part.straggled;
        b.retire(res.part as usize, &mut self.replicas.load);
        self.stats.result_payload_bytes += payload.len() as u64;
        let (layer, done) = (b.layer, b.outstanding == 0 && !b.shared_pending);
        // Only answers in time feed the latency estimate: a straggle (a paused device) would
        // hold the hedge timeout at its ceiling long after the device recovered.
        if in_time && let Some(ev) = self.health.on_answer(from, layer, latency, now) {
            self.health_event(ev, "it answered a part only it could serve in time");
        }
        if done {
            self.complete(res.batch_id, now);
        }
    }

    /// [`RouterCore::run_deferred`]: the router's own shared experts of every batch waiting for
    /// them; a batch whose parts are all in completes.
    pub(super) fn run_router_shared(&mut self, now: Instant) {
        let ids: Vec<u64> = self
            .inflight
            .iter()
            .filter(|(_, b)| b.shared_pending)
            .map(|(&id, _)| id)
            .collect();
        for id in ids {
            let mode = self.cfg.mode.compute();
            let Some(b) = self.inflight.get_mut(&id) else {
                continue;
            };
            let res = match self.shared_runner.as_mut() {
                Some(r) => r.run(b.layer, &b.x, b.tokens, mode, &mut b.shared_local),
                None => Err(BackendError::NotLoaded),
            };
            b.shared_pending = false;
            if self.cfg.mode.results() == ResultWire::SlotsBf16 {
                // Every expert output is rounded to bf16, wherever it ran (the contract of
                // exact-bf16: the same bits with the shared experts on a worker).
                dtype::round_to_bf16(&mut b.shared_local);
            }
            let layer = b.layer;
            let done = b.outstanding == 0;
            match res {
                Err(msg) => self.fail_batch(
                    id,
                    ErrorCode::Internal,
                    format!("shared expert of layer {layer} on the router: {msg}"),
                ),
                Ok(()) if done => self.complete(id, now),
                Ok(()) => {}
            }
        }
    }

    /// Combine a finished batch and answer its requests (`now`: when combining starts, for
    /// the metrics' combine stage).
    pub(super) fn complete(&mut self, id: u64, now: Instant) {
        let Some(b) = self.inflight.remove(&id) else {
            return;
        };
        let h = self.spec.hidden as usize;
        let shared = if b.shared_local.is_empty() {
            0
        } else {
            self.spec.shared_experts as usize
        };
        let slots = b.routing.top_k;
        // Each request's output is combined in place in the buffer its response carries: no
        // batch-wide output and no per-request copy. Per token the order of additions is the
        // contract's (slots in order, then shared), whatever request it belongs to.
        let mut outs: Vec<Vec<f32>> = b.members.iter().map(|m| vec![0f32; m.tokens * h]).collect();
        match self.wire.layout {
            OutputLayout::PerSlot => {
                for t in 0..b.tokens {
                    let o = member_row(&b.members, &mut outs, t, h);
                    let w = b.routing.weights_of(t);
                    for s in 0..slots {
                        let y = &b.slot_rows[(t * slots + s) * h..(t * slots + s + 1) * h];
                        // Routed slots carry their weight; remote shared slots carry 1.0, and
                        // acc + 1.0·y == acc + y exactly, as the contract adds shared outputs.
                        let ws = w[s];
                        for (a, &v) in o.iter_mut().zip(y) {
                            *a += ws * v;
                        }
                    }
                }
            }
            OutputLayout::PreCombined => {
                for (tokens, rows) in b.partials.values() {
                    for (j, &t) in tokens.iter().enumerate() {
                        let o = member_row(&b.members, &mut outs, t as usize, h);
                        for (a, &v) in o.iter_mut().zip(&rows[j * h..(j + 1) * h]) {
                            *a += v;
                        }
                    }
                }
            }
        }
        for t in 0..b.tokens {
            let o = member_row(&b.members, &mut outs, t, h);
            let gate = b.shared_weights.get(t).copied();
            for i in 0..shared {
                let y = &b.shared_local[(t * shared + i) * h..(t * shared + i + 1) * h];
                match gate {
                    Some(g) => o.iter_mut().zip(y).for_each(|(a, &v)| *a += g * v),
                    None => o.iter_mut().zip(y).for_each(|(a, &v)| *a += v),
                }
            }
        }
        // Only the requests answered: a member already failed past its deadline was counted
        // as that error, its latency is not a request's duration; one whose output overflowed
        // is failed alone ([`not_finite`]).
        let opened = b.opened;
        let mut answered = Vec::with_capacity(b.members.len());
        for (m, output) in b.members.into_iter().zip(outs).filter(|(m, _)| !m.expired) {
            let x = &b.x[m.offset * h..(m.offset + m.tokens) * h];
            match not_finite(&output, x, h) {
                Some((code, message)) => self.fail_one(m.client, m.request_id, code, message),
                None => answered.push((m, output)),
            }
        }
        self.metrics.on_completed(opened, answered.len(), now);
        for (m, output) in answered {
            self.stats.responses += 1;
            self.stats.tokens += m.tokens as u64;
            self.actions.push_back(Action::Respond {
                client: m.client,
                request_id: m.request_id,
                tokens: m.tokens,
                output,
            });
        }
    }
}

/// Input magnitude past which an output overflow is put down to the input: a conservative
/// worst case. Through gate/up sums over the hidden size (~7k), SwiGLU's product and the down
/// sum over the intermediate size (~2k), |x| = 1e12 can reach about 1e35·|w|³ with aligned
/// signs; smaller inputs do not overflow a sound device, so there the device is suspect.
const OVERFLOWING_INPUT: f32 = 1e12;

/// Why a request's combined `output` (rows of `hidden`, from inputs `x`) cannot be its
/// answer: the first value that is not finite, named by token and column, as the client's
/// (InvalidInput: the token's hidden states are past [`OVERFLOWING_INPUT`]) or as a device's
/// (Internal). Inputs are finite (checked on arrival) and so are the gate's logits, but
/// hidden states near f32's limit can still overflow the experts' arithmetic: that request
/// fails alone instead of being answered with infinities marked as success.
fn not_finite(output: &[f32], x: &[f32], hidden: usize) -> Option<(ErrorCode, String)> {
    let i = output.iter().position(|v| !v.is_finite())?;
    let (token, column, value) = (i / hidden, i % hidden, output[i]);
    let largest = x[token * hidden..(token + 1) * hidden]
        .iter()
        .fold(0f32, |m, v| m.max(v.abs()));
    Some(if largest >= OVERFLOWING_INPUT {
        let message = format!(
            "token {token}: the layer's output is not finite ({value} at hidden column \
             {column}): hidden states this large (|x| up to {largest:e}) overflow the experts' \
             f32 arithmetic; scale the inputs down"
        );
        (ErrorCode::InvalidInput, message)
    } else {
        let message = format!(
            "token {token}: a device's output is not finite ({value} at hidden column {column}) \
             for inputs of |x| up to {largest:e}: check the workers' logs and the converted \
             weights (expertmesh convert reports each layer's error)"
        );
        (ErrorCode::Internal, message)
    })
}

impl Inflight {
    /// The twin of part `i` (see `Part::twin`), while it waits for its answer.
    pub(super) fn live_twin(&self, i: usize) -> Option<usize> {
        let t = self.parts.get(i)?.twin? as usize;
        self.parts.get(t).filter(|p| p.live).map(|_| t)
    }

    /// Part `i` no longer waits for an answer (its twin's answer came first, or its device
    /// failed it while the twin waits): no longer outstanding, nor in its device's `load`.
    pub(super) fn retire(&mut self, i: usize, load: &mut [u64]) {
        let part = &mut self.parts[i];
        if !std::mem::replace(&mut part.live, false) {
            return;
        }
        self.outstanding -= 1;
        let l = &mut load[part.rank as usize];
        *l = l.saturating_sub(part.plan.pairs() as u64);
    }

    /// Decodes the answer of part `res.part` (`payload`, checked to hold the rows the part
    /// asked for) into place: per-slot rows straight into the batch's per-slot rows,
    /// pre-combined rows as the part's partial sums. A worker that answers a bf16 request in
    /// f32 (an older build ignores the byte) is rounded here: the same bits.
    fn store_rows(
        &mut self,
        res: &ExpertResult,
        payload: &[u8],
        wire: WireFormat,
        h: usize,
    ) -> Result<(), DtypeError> {
        // One copy in: each row is decoded straight into its place (per-slot: the batch's
        // per-slot rows; pre-combined: the part's rows).
        let part = &self.parts[res.part as usize];
        let row_bytes = h * res.dtype.elem_bytes();
        let round = wire.result == OutputDtype::Bf16 && res.dtype != OutputDtype::Bf16;
        match wire.layout {
            OutputLayout::PerSlot => {
                let slots = self.routing.top_k;
                part.plan
                    .pair_targets()
                    .enumerate()
                    .try_for_each(|(i, (t, s))| {
                        let dst = &mut self.slot_rows[(t as usize * slots + s as usize) * h..][..h];
                        let src = &payload[i * row_bytes..(i + 1) * row_bytes];
                        dtype::decode_output(res.dtype, src, dst)?;
                        if round {
                            dtype::round_to_bf16(dst);
                        }
                        Ok(())
                    })
            }
            OutputLayout::PreCombined => {
                let mut rows = vec![0f32; part.plan.tokens.len() * h];
                dtype::decode_output(res.dtype, payload, &mut rows)?;
                if round {
                    dtype::round_to_bf16(&mut rows);
                }
                self.partials
                    .insert(res.part, (part.plan.tokens.clone(), rows));
                Ok(())
            }
        }
    }
}

/// Batch token `t`'s row in its request's output buffer (`members` in offset order).
fn member_row<'a>(
    members: &[Member],
    outs: &'a mut [Vec<f32>],
    t: usize,
    h: usize,
) -> &'a mut [f32] {
    let i = members.partition_point(|m| m.offset <= t) - 1;
    let r = t - members[i].offset;
    &mut outs[i][r * h..(r + 1) * h]
}
