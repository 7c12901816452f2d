//! Batching and dispatch: pending batches, gating, micro-batches, plans and dispatch frames.
//!
//! Why this exists: this is the forward half of a layer call. Requests of one layer join a
//! pending batch; when it closes (window, full, every frontend in it) it is gated once, its
//! activations quantized once (W4A8 modes), split into micro-batches, and each micro-batch
//! planned onto live devices — quarantined ones left out unless an expert has no other live
//! owner — and turned into one `Dispatch` frame per device, its token rows gathered straight
//! into the frame's payload. Recovery re-sends parts through the same planning
//! (`send_pairs`).

use super::{Action, Inflight, LayerSetup, Member, Part, Pending, Request, RouterCore, SharedSite};
use crate::gating::{self, Routing};
use crate::plan::{self, DevicePlan, LayerOwners, PlanError, Replicas};
use bytes::Bytes;
use expertmesh_quant::contract::{self, ComputeMode};
use expertmesh_topology::model::ModelSpec;
use expertmesh_transport::codec::{Body, Dispatch, ErrorCode, OutputLayout};
use expertmesh_transport::dtype::{self, ActivationDtype};
use expertmesh_transport::mesh::OutFrame;
use std::collections::BTreeMap;
use std::time::Instant;

impl RouterCore {
    /// [`RouterCore::submit`]: refused when past its deadline or over the in-flight limit,
    /// else added to its layer's pending batch (dispatched when full or joined by every
    /// frontend).
    pub(super) fn admit(&mut self, req: Request, now: Instant) {
        if req.deadline <= now {
            let msg =
                "deadline exceeded before the request could be batched; give it a longer deadline";
            self.fail_one(
                req.client,
                req.request_id,
                ErrorCode::DeadlineExceeded,
                msg.into(),
            );
            return;
        }
        if self.inflight.len() >= self.cfg.max_inflight_batches {
            self.fail_one(
                req.client,
                req.request_id,
                ErrorCode::Overloaded,
                format!(
                    "router has {} batches in flight (the limit); retry shortly",
                    self.inflight.len()
                ),
            );
            return;
        }
        let layer = req.layer;
        let full = self.pending.get(&layer).is_some_and(|p| {
            p.x.len() / self.spec.hidden as usize + req.tokens > self.cfg.max_batch_tokens
        });
        if full {
            self.flush(layer, now);
        }
        let p = self.pending.entry(layer).or_insert_with(|| Pending {
            members: Vec::new(),
            x: Vec::new(),
            logits: Vec::new(),
            logits_given: Vec::new(),
            clients: Vec::new(),
            flush_at: now + self.cfg.batch_window,
            deadline: req.deadline,
        });
        if !p.clients.contains(&req.client) {
            p.clients.push(req.client);
        }
        let offset = p.x.len() / self.spec.hidden as usize;
        p.members.push(Member {
            client: req.client,
            request_id: req.request_id,
            offset,
            tokens: req.tokens,
            deadline: req.deadline,
            expired: false,
        });
        if p.x.is_empty() {
            p.x = req.x; // a lone request's input is moved, not copied
        } else {
            p.x.extend_from_slice(&req.x);
        }
        let e = self.spec.routed_experts as usize;
        match &req.logits {
            Some(l) => p.logits.extend_from_slice(l),
            None => p.logits.resize(p.logits.len() + req.tokens * e, 0.0),
        }
        p.logits_given
            .extend(std::iter::repeat_n(req.logits.is_some(), req.tokens));
        p.deadline = p.deadline.max(req.deadline);
        let everyone = self.frontends.is_some_and(|n| p.clients.len() >= n);
        if self.cfg.batch_window.is_zero()
            || everyone
            || p.x.len() / self.spec.hidden as usize >= self.cfg.max_batch_tokens
        {
            self.flush(layer, now);
        }
    }

    /// Dispatches every pending batch that holds a request of each of the `open` frontend
    /// connections.
    pub(super) fn flush_joined_by(&mut self, open: usize, now: Instant) {
        let ready: Vec<u32> = self
            .pending
            .iter()
            .filter(|(_, p)| p.clients.len() >= open)
            .map(|(&l, _)| l)
            .collect();
        for l in ready {
            self.flush(l, now);
        }
    }

    /// Dispatches every pending batch whose window has closed by `now`.
    pub(super) fn flush_due(&mut self, now: Instant) {
        let due: Vec<u32> = self
            .pending
            .iter()
            .filter(|(_, p)| p.flush_at <= now)
            .map(|(&l, _)| l)
            .collect();
        for l in due {
            self.flush(l, now);
        }
    }

    /// Gate, plan and send a pending batch.
    fn flush(&mut self, layer: u32, now: Instant) {
        let Some(p) = self.pending.remove(&layer) else {
            return;
        };
        let Some(id) = self.open_batch(layer, p, now) else {
            return;
        };
        // Micro-batches: plan and send each chunk of tokens separately.
        let b = &self.inflight[&id];
        let (tokens, slots) = (b.tokens, b.routing.top_k);
        let mb = self.cfg.micro_batch_tokens.max(1);
        let mut start = 0;
        while start < tokens {
            let end = (start + mb).min(tokens);
            let mut pairs = Vec::with_capacity((end - start) * slots);
            pairs.extend(
                (start as u32..end as u32).flat_map(|t| (0..slots as u32).map(move |s| (t, s))),
            );
            if !self.send_pairs(id, &pairs, None, true, now) {
                return;
            }
            start = end;
        }
        self.metrics.on_dispatched(now);
        self.send_probes(id, now);
        if self
            .inflight
            .get(&id)
            .is_some_and(|b| b.outstanding == 0 && !b.shared_pending)
        {
            self.complete(id, now);
        }
    }

    /// Fails, each alone, the members of `p` with a non-finite router logit among their own
    /// tokens (their inputs are finite, checked on arrival, but values near f32's limit
    /// overflow the gate's dot products), naming their own token; returns the batch without
    /// them (`None` when none is left). One request's inputs must not fail its batch-mates.
    fn fail_non_finite_members(
        &mut self,
        p: Pending,
        logits: Vec<f32>,
    ) -> Option<(Pending, Vec<f32>)> {
        let h = self.spec.hidden as usize;
        let e = self.spec.routed_experts as usize;
        let bad = |m: &Member| {
            let rows = &logits[m.offset * e..(m.offset + m.tokens) * e];
            rows.iter()
                .position(|v| !v.is_finite())
                .map(|i| (i / e, i % e, rows[i]))
        };
        if p.members.iter().all(|m| bad(m).is_none()) {
            return Some((p, logits));
        }
        for m in &p.members {
            if let Some((token, expert, value)) = bad(m) {
                let message = format!(
                    "token {token}: router logit for expert {expert} is not finite ({value}): \
                     hidden states this large overflow the gate; check the inputs"
                );
                self.fail_one(m.client, m.request_id, ErrorCode::InvalidInput, message);
            }
        }
        p.retain_members(h, e, &logits, |m| bad(m).is_none())
    }

    /// Gates pending batch `p` of `layer` (the frontend's logits where given, the gate matrix
    /// otherwise), quantizes its activations once in the W4A8 modes and puts it in flight with
    /// no parts yet: its id. `None` when gating failed (its requests are failed) or every
    /// member's inputs overflowed the gate ([`Self::fail_non_finite_members`]).
    fn open_batch(&mut self, layer: u32, mut p: Pending, now: Instant) -> Option<u64> {
        let h = self.spec.hidden as usize;
        let e = self.spec.routed_experts as usize;
        let setup = &self.layers[&layer];
        let mut logits = std::mem::take(&mut p.logits);
        for (t, _) in p.logits_given.iter().enumerate().filter(|(_, g)| !**g) {
            setup
                .gate
                .logits_into(&p.x[t * h..(t + 1) * h], &mut logits[t * e..(t + 1) * e]);
        }
        let (p, logits) = self.fail_non_finite_members(p, logits)?;
        let setup = &self.layers[&layer];
        let tokens = p.x.len() / h;
        let routing = match gating::route(&self.spec, &logits, &setup.gate.bias) {
            Ok(r) => r,
            Err(err) => {
                for m in p.members {
                    self.fail_one(
                        m.client,
                        m.request_id,
                        ErrorCode::InvalidInput,
                        err.to_string(),
                    );
                }
                return None;
            }
        };
        let (routing, shared_weights, shared_pending, shared_local) =
            shared_parts(&self.spec, setup, routing, &p.x);
        let q8 = (self.cfg.mode.compute() == ComputeMode::Exact).then(|| {
            let mut q = vec![0i8; tokens * h];
            let mut d = vec![0f32; tokens * h / 32];
            contract::quantize_activations(&p.x, &mut q, &mut d);
            (q, d)
        });
        let slots = routing.top_k;
        let id = self.issue_batch_id();
        self.stats.batches += 1;
        let batch = Inflight {
            layer,
            tokens,
            members: p.members,
            deadline: p.deadline,
            slot_rows: if self.wire.layout == OutputLayout::PerSlot {
                vec![0f32; tokens * slots * h]
            } else {
                Vec::new()
            },
            partials: BTreeMap::new(),
            routing,
            x: p.x,
            q8,
            shared_local,
            shared_pending,
            shared_weights,
            parts: Vec::new(),
            outstanding: 0,
            opened: p.flush_at.checked_sub(self.cfg.batch_window).unwrap_or(now),
            resends: 0,
        };
        self.inflight.insert(id, batch);
        let b = &self.inflight[&id];
        let (n, r) = (b.members.len(), &b.routing);
        self.metrics.on_batch(layer, n, r, b.opened, now);
        Some(id)
    }

    /// Plan `pairs` of batch `id` (avoiding `avoid` in addition to dead ranks, and quarantined
    /// ranks unless an expert has no other live owner) and send them. With `dedup` off (a
    /// node's leader could not reach a peer), every pair goes to the device chosen for it, not
    /// through its node's leader. Returns false when the batch failed.
    pub(super) fn send_pairs(
        &mut self,
        id: u64,
        pairs: &[(u32, u32)],
        avoid: Option<u32>,
        dedup: bool,
        now: Instant,
    ) -> bool {
        let Some(b) = self.inflight.get(&id) else {
            return false;
        };
        let owners = &self.owners_ext[&b.layer];
        let mut replicas = self.replicas.clone();
        if let Some(r) = avoid {
            replicas.alive[r as usize] = false;
        }
        replicas.node_dedup &= dedup;
        let benched = self.health.quarantined();
        let plans = match plan_around(&b.routing, owners, replicas, pairs, &benched) {
            Ok(p) => p,
            Err(PlanError::NoLiveOwner { expert, owners }) => {
                let who: Vec<String> = owners.iter().map(|&r| self.name(r)).collect();
                let what = if expert >= self.spec.routed_experts {
                    format!("shared expert {}", expert - self.spec.routed_experts)
                } else {
                    format!("expert {expert}")
                };
                let msg = if who.is_empty() {
                    format!(
                        "layer {}: {what} has no owner: no device announced it (after a live \
                         placement change, apply a placement that places it)",
                        b.layer
                    )
                } else {
                    format!(
                        "layer {}: {what} is unavailable: {} down and the placement has no other replica",
                        b.layer,
                        who.join(", ")
                    )
                };
                self.fail_batch(id, ErrorCode::PeerUnavailable, msg);
                return false;
            }
            Err(err) => {
                self.fail_batch(id, ErrorCode::Internal, err.to_string());
                return false;
            }
        };
        for plan in plans {
            let b = self.inflight.get(&id).expect("checked above");
            let part_id = b.parts.len() as u32;
            let (frame, payload_len) = self.part_frame(b, id, part_id, &plan);
            self.stats.parts_sent += 1;
            self.stats.dispatch_payload_bytes += payload_len as u64;
            self.replicas.load[plan.rank as usize] += plan.pairs() as u64;
            let rank = plan.rank;
            let b = self.inflight.get_mut(&id).expect("checked above");
            b.parts.push(Part {
                rank,
                plan,
                sent_at: now,
                hedge_at: now + self.health.hedge_after(rank, b.layer),
                straggled: false,
                live: true,
                twin: None,
            });
            b.outstanding += 1;
            self.actions.push_back(Action::Send {
                rank,
                frame,
                batch: id,
                part: part_id,
            });
        }
        true
    }

    /// The dispatch frame of part `part_id` of batch `id` (in flight as `b`) for `plan`, and
    /// its payload's length.
    pub(super) fn part_frame(
        &self,
        b: &Inflight,
        id: u64,
        part_id: u32,
        plan: &DevicePlan,
    ) -> (OutFrame, usize) {
        let h = self.spec.hidden as usize;
        let mode = self.cfg.mode.compute();
        let n = plan.tokens.len();
        let (dtype, payload) = dispatch_payload(b, &plan.tokens, h, mode, self.cfg.accurate_dtype);
        let dispatch = Dispatch {
            batch_id: id,
            layer: b.layer,
            part: part_id,
            tokens: n as u32,
            hidden: h as u32,
            dtype,
            mode,
            layout: self.wire.layout,
            result_dtype: self.wire.result,
            expert_counts: plan.counts.iter().map(|&c| c as u16).collect(),
            experts: plan.experts.clone(),
            weights: plan.weights.clone(),
        };
        let len = payload.len();
        (
            OutFrame::with_payload(Body::Dispatch(dispatch), Bytes::from(payload)),
            len,
        )
    }

    /// The id of a new batch: this incarnation in the high 32 bits, a sequence number
    /// (1.., wrapping) in the low.
    fn issue_batch_id(&mut self) -> u64 {
        let seq = self.next_batch;
        self.next_batch = if seq >= u64::from(u32::MAX) {
            1
        } else {
            seq + 1
        };
        (u64::from(self.incarnation) << 32) | seq
    }
}

/// Plans `pairs` with the `benched` (quarantined) ranks left out of replica choice, except
/// for experts that no other live rank holds: their benched owners are let back in, one
/// expert at a time, so quarantine never makes an expert unavailable.
fn plan_around(
    routing: &Routing,
    owners: &LayerOwners,
    mut replicas: Replicas,
    pairs: &[(u32, u32)],
    benched: &[u32],
) -> Result<Vec<DevicePlan>, PlanError> {
    let mut out: Vec<u32> = benched
        .iter()
        .copied()
        .filter(|&r| replicas.alive.get(r as usize) == Some(&true))
        .collect();
    for &r in &out {
        replicas.alive[r as usize] = false;
    }
    loop {
        match plan::plan_dispatch(routing, owners, &replicas, Some(pairs)) {
            Err(PlanError::NoLiveOwner { owners: o, .. }) if o.iter().any(|r| out.contains(r)) => {
                for r in o {
                    if let Some(i) = out.iter().position(|&x| x == r) {
                        out.swap_remove(i);
                        replicas.alive[r as usize] = true;
                    }
                }
            }
            other => return other,
        }
    }
}

/// The activation payload of one part: exact mode sends the batch's q8 rows of `tokens`
/// (quantized once per batch), accurate mode encodes their f32 rows in `accurate_dtype`; either
/// way the rows are gathered straight into the frame's bytes.
fn dispatch_payload(
    b: &Inflight,
    tokens: &[u32],
    h: usize,
    mode: ComputeMode,
    accurate_dtype: ActivationDtype,
) -> (ActivationDtype, Vec<u8>) {
    let n = tokens.len();
    match (&b.q8, mode) {
        (Some((q, d)), ComputeMode::Exact) => {
            let dt = ActivationDtype::Q8Block32;
            let mut buf = vec![0u8; dt.payload_bytes(n, h).expect("shape validated") as usize];
            let nb = h / 32;
            for (j, &t) in tokens.iter().enumerate() {
                let t = t as usize;
                let (q, d) = (&q[t * h..(t + 1) * h], &d[t * nb..(t + 1) * nb]);
                dtype::write_q8_row(&mut buf, n, h, j, q, d);
            }
            (dt, buf)
        }
        _ => {
            let bytes = accurate_dtype.payload_bytes(n, h).expect("shape validated") as usize;
            let mut buf = vec![0u8; bytes];
            dtype::encode_activations_gather(accurate_dtype, h, &b.x, tokens, &mut buf)
                .expect("inputs validated finite");
            (accurate_dtype, buf)
        }
    }
}

/// A batch's shared-expert parts: the routing (with the shared experts appended as slots when
/// they live on a worker), each token's shared weight (Qwen2-MoE's `sigmoid(shared_gate · x)`;
/// empty for weight 1), whether they run on the router (in `run_deferred`, after this batch's
/// dispatch frames have been handed to the driver, so they overlap with the workers), and the
/// buffer they write there.
fn shared_parts(
    spec: &ModelSpec,
    setup: &LayerSetup,
    routing: Routing,
    x: &[f32],
) -> (Routing, Vec<f32>, bool, Vec<f32>) {
    let shared = spec.shared_experts as usize;
    let (e, h) = (spec.routed_experts, spec.hidden as usize);
    let shared_weights = if spec.shared_expert_gate && shared > 0 {
        setup.gate.shared_weights(x)
    } else {
        Vec::new()
    };
    let routing = match setup.shared {
        SharedSite::Rank(_) if shared > 0 => {
            with_remote_shared(&routing, e, shared, &shared_weights)
        }
        _ => routing,
    };
    let pending = setup.shared == SharedSite::Router && shared > 0;
    let local = if pending {
        vec![0f32; x.len() / h * shared * h]
    } else {
        Vec::new()
    };
    (routing, shared_weights, pending, local)
}

/// `routing` with a layer's shared experts (pseudo-ids `routed_experts + i`, weight 1, or the
/// token's `shared_weights` entry when the model gates them) appended to every token as extra
/// slots, for shared experts that live on a worker.
fn with_remote_shared(
    routing: &Routing,
    routed_experts: u32,
    shared: usize,
    shared_weights: &[f32],
) -> Routing {
    let tokens = routing.tokens();
    let slots = routing.top_k + shared;
    let mut experts = Vec::with_capacity(tokens * slots);
    let mut weights = Vec::with_capacity(tokens * slots);
    for t in 0..tokens {
        experts.extend_from_slice(routing.experts_of(t));
        weights.extend_from_slice(routing.weights_of(t));
        experts.extend((0..shared as u32).map(|i| routed_experts + i));
        let w = shared_weights.get(t).copied().unwrap_or(1.0);
        weights.extend(std::iter::repeat_n(w, shared));
    }
    Routing {
        top_k: slots,
        experts,
        weights,
    }
}
