//! Recovery: what the core does when a device is lost, slow, wrong or benched.
//!
//! Why this exists: a layer call must end — answered or failed with a clear error — whatever a
//! device does. A lost link or failed send re-plans the device's parts onto live replicas; an
//! error answer that is the device's own does the same when replicas hold the experts; a part
//! unanswered past its device's hedge timeout is re-sent to a replica (or waited on until the
//! deadline when none exists); a request past its own deadline fails alone, a batch past the
//! latest of its members' deadlines fails naming the devices it waits for. Faults feed device
//! health ([`crate::health`]): a device at fault repeatedly is quarantined and later probed
//! with a mirrored part. Answers of another router incarnation are dropped here too.

use super::{Action, Part, RouterCore};
use crate::health::HealthEvent;
use expertmesh_transport::codec::{ErrorCode, ExpertResult, OutputLayout};
use std::time::{Duration, Instant};

/// Why a part is sent again, and where to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Resend {
    /// Its device was lost or a send to it failed: to other owners.
    Lost,
    /// Its device has not answered in time: to other owners, and only when another live owner
    /// exists for all its experts (the device stays alive).
    Straggler,
    /// Its node's leader could not serve it through its node (a peer unreachable, or a live
    /// placement change it had not heard of yet): to the devices themselves, without
    /// per-node dedup.
    WithoutDedup,
}

impl RouterCore {
    /// Probes past their timeout fail (their devices' quarantine doubles).
    pub(super) fn expire_probes(&mut self, now: Instant) {
        for ev in self.health.expire_probes(now) {
            self.health_event(ev, "its probe went unanswered");
        }
        self.probes
            .retain(|&r, _| self.health.probe_of(r).is_some());
    }

    /// Per batch in flight: members past their own deadline fail alone, a batch past its
    /// deadline fails naming the devices it waits for, parts past their hedge time are charged
    /// to their device and re-sent to a replica when one exists.
    pub(super) fn watch_inflight(&mut self, now: Instant) {
        let ids: Vec<u64> = self.inflight.keys().copied().collect();
        for id in ids {
            self.expire_members(id, now);
            let Some(b) = self.inflight.get(&id) else {
                continue;
            };
            if b.deadline <= now {
                let waiting: Vec<String> = b
                    .parts
                    .iter()
                    .filter(|p| p.live)
                    .map(|p| self.name(p.rank))
                    .collect();
                let msg = format!(
                    "deadline exceeded: layer {} still waiting for {}; the device may be overloaded or down",
                    b.layer,
                    waiting.join(", ")
                );
                self.fail_batch(id, ErrorCode::DeadlineExceeded, msg);
                continue;
            }
            let slow: Vec<usize> = b
                .parts
                .iter()
                .enumerate()
                .filter(|(_, p)| p.live && p.hedge_at <= now)
                .map(|(i, _)| i)
                .collect();
            for i in slow {
                self.straggled(id, i, now);
                // Re-send only when another owner exists; otherwise keep waiting until the
                // deadline (the part's clock restarts so this is not retried every tick).
                self.redispatch(id, i, now, Resend::Straggler);
            }
        }
    }

    /// [`RouterCore::on_worker_error`].
    pub(super) fn take_worker_error(
        &mut self,
        from: u32,
        request_id: u64,
        part: Option<u32>,
        code: ErrorCode,
        message: &str,
        now: Instant,
    ) {
        if !self.own_batch(request_id, from, now) {
            return;
        }
        let probe = self.health.probe_of(from);
        // An error naming the probe's part counts against the probe, and against a live part
        // only if that very part is live on the device too; one naming no part may be the
        // probe's or any live part's of this batch on the device, so all are taken as failed
        // (taking it for the probe's alone could leave a failed part waiting for its
        // deadline).
        let for_probe = match part {
            Some(p) => probe == Some((request_id, p)),
            None => probe.is_some_and(|(b, _)| b == request_id),
        };
        if for_probe {
            self.fault(from, now, "its probe was answered with an error");
            self.probes.remove(&from);
        }
        // The device's live parts the error answers; a part whose twin still waits is retired,
        // whatever the error: the twin answers for its pairs (or fails them with its own
        // error).
        let (mut covered, mut parts) = (Vec::new(), Vec::new());
        if let Some(b) = self.inflight.get(&request_id) {
            for (i, p) in b.parts.iter().enumerate() {
                if p.live && p.rank == from && part.is_none_or(|n| n as usize == i) {
                    if b.live_twin(i).is_some() {
                        covered.push(i);
                    } else {
                        parts.push(i);
                    }
                }
            }
        }
        if covered.is_empty() && parts.is_empty() {
            return; // a finished batch, a superseded part, or the probe's answer
        }
        let device_fault = matches!(
            code,
            ErrorCode::Internal
                | ErrorCode::Overloaded
                | ErrorCode::PeerUnavailable
                | ErrorCode::NotFound
                | ErrorCode::ShuttingDown
                | ErrorCode::Other(_)
        );
        if device_fault {
            self.fault(from, now, "it answered with an error");
        }
        if let Some(b) = self.inflight.get_mut(&request_id) {
            for &i in &covered {
                b.retire(i, &mut self.replicas.load);
            }
        }
        if parts.is_empty() {
            return;
        }
        if code == ErrorCode::PeerUnavailable && self.replicas.node_dedup {
            tracing::warn!(
                leader = %self.name(from), message,
                "a node leader could not serve its share through its node (a peer unreachable, or a placement change it had not heard of yet); sending it to the devices directly"
            );
            for i in parts {
                self.redispatch(request_id, i, now, Resend::WithoutDedup);
            }
            return;
        }
        if device_fault && parts.iter().all(|&i| self.can_resend(request_id, i)) {
            tracing::warn!(
                device = %self.name(from), ?code, message,
                "a device answered with an error; its share goes to a replica"
            );
            for i in parts {
                self.redispatch(request_id, i, now, Resend::Lost);
            }
            return;
        }
        let msg = format!("{}: {message}", self.name(from));
        self.fail_batch(request_id, code, msg);
    }

    /// Device `from` answered live part `i` of batch `id` with rows of the wrong shape or that
    /// do not decode (`msg` says which): a fault of the device, as an error answer is; the part
    /// goes on without it (its twin, or a replica) or the batch fails with `msg`.
    pub(super) fn bad_result(&mut self, from: u32, id: u64, i: usize, msg: String, now: Instant) {
        self.fault(from, now, "it answered with a result of the wrong shape");
        if self.can_resend(id, i) {
            tracing::warn!(device = %self.name(from), "{msg}; its share goes to a replica");
            self.redispatch(id, i, now, Resend::Lost);
        } else {
            self.fail_batch(id, ErrorCode::Internal, msg);
        }
    }

    /// [`RouterCore::on_peer_lost`].
    pub(super) fn peer_lost(&mut self, rank: u32, now: Instant) {
        if let Some(a) = self.replicas.alive.get_mut(rank as usize) {
            *a = false;
        }
        self.fault(rank, now, "its link was lost");
        self.replicas.load[rank as usize] = 0;
        let affected: Vec<(u64, usize)> = self
            .inflight
            .iter()
            .flat_map(|(&id, b)| {
                b.parts
                    .iter()
                    .enumerate()
                    .filter(|(_, p)| p.live && p.rank == rank)
                    .map(move |(i, _)| (id, i))
            })
            .collect();
        for (id, i) in affected {
            self.redispatch(id, i, now, Resend::Lost);
        }
    }

    /// [`RouterCore::on_send_failed`].
    pub(super) fn send_failed(&mut self, rank: u32, batch: u64, part: u32, now: Instant) {
        if self.health.is_probe(rank, batch, part) {
            self.fault(rank, now, "sending its probe failed");
            self.probes.remove(&rank);
            return;
        }
        if self.live_part(rank, batch, part) {
            if let Some(a) = self.replicas.alive.get_mut(rank as usize) {
                *a = false;
            }
            self.fault(rank, now, "a send to it failed");
            self.redispatch(batch, part as usize, now, Resend::Lost);
        }
    }

    /// [`RouterCore::on_send_refused`]: the device is charged a fault (its quarantine, with
    /// probes, brings it back once it takes frames again) and the part goes to a replica, or
    /// its batch fails; its link stays up, so it is not marked lost.
    pub(super) fn send_refused(&mut self, rank: u32, batch: u64, part: u32, now: Instant) {
        if self.health.is_probe(rank, batch, part) {
            self.fault(
                rank,
                now,
                "its probe could not be sent (its backlog is full)",
            );
            self.probes.remove(&rank);
            return;
        }
        if self.live_part(rank, batch, part) {
            self.fault(
                rank,
                now,
                "it is not taking its frames (its backlog is full)",
            );
            self.redispatch(batch, part as usize, now, Resend::Lost);
        }
    }

    /// Whether part `part` of batch `batch` is live on `rank`.
    fn live_part(&self, rank: u32, batch: u64, part: u32) -> bool {
        self.inflight
            .get(&batch)
            .and_then(|b| b.parts.get(part as usize))
            .is_some_and(|p| p.live && p.rank == rank)
    }

    /// Fail, each alone, the members of batch `id` whose own deadline has passed while the
    /// batch goes on for the others (a short deadline fails only its own request). The batch
    /// as a whole fails at the latest of its members' deadlines ([`Self::on_tick`]).
    fn expire_members(&mut self, id: u64, now: Instant) {
        let Some(b) = self.inflight.get_mut(&id) else {
            return;
        };
        if b.deadline <= now {
            return; // every member is due: the whole batch fails, naming the devices
        }
        let mut due = Vec::new();
        for m in b
            .members
            .iter_mut()
            .filter(|m| !m.expired && m.deadline <= now)
        {
            m.expired = true;
            due.push((m.client, m.request_id));
        }
        if due.is_empty() {
            return;
        }
        let layer = b.layer;
        let live: Vec<u32> = b.parts.iter().filter(|p| p.live).map(|p| p.rank).collect();
        let waiting: Vec<String> = live.into_iter().map(|r| self.name(r)).collect();
        let msg = format!(
            "deadline exceeded: the request's own deadline passed while layer {layer} waited for {}; give it a longer deadline, or the device may be overloaded",
            if waiting.is_empty() {
                "the router".to_owned()
            } else {
                waiting.join(", ")
            }
        );
        for (client, request_id) in due {
            self.fail_one(client, request_id, ErrorCode::DeadlineExceeded, msg.clone());
        }
    }

    /// Whether part `i` of batch `id` can go on without its device: its twin still waits, or
    /// another live device holds its experts.
    pub(super) fn can_resend(&self, id: u64, i: usize) -> bool {
        self.inflight
            .get(&id)
            .is_some_and(|b| b.live_twin(i).is_some())
            || self.has_other_owner(id, i)
    }

    /// Whether every expert of part `i` of batch `id` has a live owner other than the part's
    /// device.
    fn has_other_owner(&self, id: u64, i: usize) -> bool {
        let Some(b) = self.inflight.get(&id) else {
            return false;
        };
        let Some(part) = b.parts.get(i) else {
            return false;
        };
        let owners = &self.owners_ext[&b.layer];
        part.plan.pair_targets().all(|(t, s)| {
            let e = b.routing.experts_of(t as usize)[s as usize];
            owners.owners[e as usize]
                .iter()
                .any(|&r| r != part.rank && self.replicas.alive[r as usize])
        })
    }

    /// Most parts one batch may re-send: four per mesh rank, and some (a batch legitimately
    /// re-sends a part once per device that fails it, or a hedge; past this every owner is
    /// failing its parts at once).
    pub(super) fn max_resends(&self) -> usize {
        16 + 4 * self.replicas.alive.len()
    }

    /// Re-send part `i` of batch `id` ([`Resend`] says why and where to). A part whose twin
    /// (its hedge, or the part it hedges) still waits is not re-sent: a lost one is retired
    /// (the twin covers its pairs), a straggling one waits on with its twin. A straggler is
    /// hedged with a twin on one device that holds all its experts when there is one
    /// ([`Self::hedge`]); otherwise its pairs are re-planned and it is superseded.
    fn redispatch(&mut self, id: u64, i: usize, now: Instant, why: Resend) {
        let Some(b) = self.inflight.get(&id) else {
            return;
        };
        if !b.parts[i].live {
            return;
        }
        if b.live_twin(i).is_some() {
            let b = self.inflight.get_mut(&id).expect("checked above");
            match why {
                Resend::Straggler => self.keep_waiting(id, i, now),
                Resend::Lost | Resend::WithoutDedup => b.retire(i, &mut self.replicas.load),
            }
            return;
        }
        if why == Resend::Straggler && self.hedge(id, i, now) {
            return;
        }
        if why == Resend::Straggler && !self.has_other_owner(id, i) {
            // Keep waiting (until the deadline), and look again later: a replica may come
            // back.
            self.keep_waiting(id, i, now);
            return;
        }
        let max_resends = self.max_resends();
        let b = self.inflight.get_mut(&id).expect("checked above");
        b.resends += 1;
        if b.resends > max_resends {
            // Every owner failing its part at once (full backlogs, error answers) would bounce
            // it between them until the deadline, a part and a payload copy each time, on the
            // core thread every client shares.
            let rank = b.parts[i].rank;
            let msg = format!(
                "{}: the devices holding this batch's experts failed its parts {max_resends} \
                 times (full backlogs, error answers, or hedges that failed too); gave up \
                 before the deadline",
                self.name(rank)
            );
            self.fail_batch(id, ErrorCode::PeerUnavailable, msg);
            return;
        }
        let part = &b.parts[i];
        let rank = part.rank;
        let mut pairs = Vec::with_capacity(part.plan.pairs());
        pairs.extend(part.plan.pair_targets());
        b.retire(i, &mut self.replicas.load);
        self.stats.parts_redispatched += 1;
        if why == Resend::Straggler {
            self.stats.hedges += 1;
        }
        let (avoid, dedup) = match why {
            Resend::WithoutDedup => (None, false),
            Resend::Lost | Resend::Straggler => (Some(rank), true),
        };
        if self.send_pairs(id, &pairs, avoid, dedup, now)
            && self
                .inflight
                .get(&id)
                .is_some_and(|b| b.outstanding == 0 && !b.shared_pending)
        {
            self.complete(id, now);
        }
    }

    /// Part `i` of batch `id` waits on (until the deadline, or its twin's answer) and is
    /// looked at again later.
    fn keep_waiting(&mut self, id: u64, i: usize, now: Instant) {
        let Some(b) = self.inflight.get_mut(&id) else {
            return;
        };
        let part = &mut b.parts[i];
        let wait = self.health.hedge_after(part.rank, b.layer);
        part.hedge_at = now + wait.max(STRAGGLER_RECHECK);
    }

    /// Hedges straggling part `i` of batch `id`: the same pairs go to the least loaded live
    /// device (in rotation if one is) that holds every one of their experts, as the part's
    /// twin; both stay live and the first answer is taken. `false` (nothing sent) when no such
    /// device exists.
    fn hedge(&mut self, id: u64, i: usize, now: Instant) -> bool {
        let Some(b) = self.inflight.get(&id) else {
            return false;
        };
        let part = &b.parts[i];
        let owners = &self.owners_ext[&b.layer];
        let expert = |(t, s): (u32, u32)| b.routing.experts_of(t as usize)[s as usize] as usize;
        let Some(first) = part.plan.pair_targets().next().map(expert) else {
            return false;
        };
        let holds_all = |r: u32| {
            part.plan
                .pair_targets()
                .all(|p| owners.owners[expert(p)].contains(&r))
        };
        // Devices in rotation first (a quarantined one straggled too, but its answer still
        // counts if it comes first), then the least loaded.
        let target = owners.owners[first]
            .iter()
            .copied()
            .filter(|&r| r != part.rank && self.replicas.alive[r as usize] && holds_all(r))
            .min_by_key(|&r| {
                let benched = self.health.is_quarantined(r);
                (benched, self.replicas.load[r as usize], r)
            });
        let Some(rank) = target else {
            return false;
        };
        // A hedge is a re-send like any other: bounded per batch (a hedge whose device fails
        // it leaves the part without a twin, to be hedged again).
        if b.resends >= self.max_resends() {
            return false;
        }
        let mut plan = part.plan.clone();
        plan.rank = rank;
        let twin = b.parts.len() as u32;
        let (frame, payload_len) = self.part_frame(b, id, twin, &plan);
        let pairs = plan.pairs() as u64;
        self.stats.parts_sent += 1;
        self.stats.parts_redispatched += 1;
        self.stats.hedges += 1;
        self.stats.dispatch_payload_bytes += payload_len as u64;
        self.replicas.load[rank as usize] += pairs;
        let hedge_after = self.health.hedge_after(rank, b.layer);
        let b = self.inflight.get_mut(&id).expect("checked above");
        b.resends += 1;
        // A twin retired earlier (its device failed it) lets go of this part.
        if let Some(old) = b.parts[i].twin.replace(twin) {
            b.parts[old as usize].twin = None;
        }
        b.parts.push(Part {
            rank,
            plan,
            sent_at: now,
            hedge_at: now + hedge_after,
            straggled: false,
            live: true,
            twin: Some(i as u32),
        });
        b.outstanding += 1;
        tracing::debug!(device = %self.name(rank), batch = id, part = twin, hedged = i, "hedge sent");
        self.actions.push_back(Action::Send {
            rank,
            frame,
            batch: id,
            part: twin,
        });
        self.keep_waiting(id, i, now);
        true
    }

    /// Part `i` of batch `id` is past its hedge time: charge its device once.
    fn straggled(&mut self, id: u64, i: usize, now: Instant) {
        let Some(part) = self.inflight.get_mut(&id).and_then(|b| b.parts.get_mut(i)) else {
            return;
        };
        if std::mem::replace(&mut part.straggled, true) {
            return;
        }
        let rank = part.rank;
        self.fault(rank, now, "it straggled past its hedge timeout");
    }

    /// A fault of `rank` (a straggle, a failed send, a lost link, an error answer): its probe
    /// fails when one is out, else it counts towards quarantine.
    fn fault(&mut self, rank: u32, now: Instant, why: &str) {
        let ev = if self.health.probe_of(rank).is_some() {
            self.probes.remove(&rank);
            Some(self.health.on_probe_failed(rank, now))
        } else {
            self.health.on_fault(rank, now)
        };
        if let Some(ev) = ev {
            self.health_event(ev, why);
        }
    }

    /// Counts and logs a change of a device's standing.
    pub(super) fn health_event(&mut self, ev: HealthEvent, why: &str) {
        match ev {
            HealthEvent::Quarantined { rank, period } => {
                self.stats.quarantines += 1;
                tracing::info!(
                    device = %self.name(rank), ?period,
                    "device quarantined ({why}): left out of replica choice, probed after the period"
                );
            }
            HealthEvent::Released { rank } => {
                self.stats.quarantine_releases += 1;
                tracing::info!(device = %self.name(rank), "device back in rotation ({why})");
            }
        }
    }

    /// Mirrors one live part of batch `id` to each live device whose quarantine ran out and
    /// that holds every expert of that part: its probe. The probe's answer is checked and
    /// dropped ([`RouterCore::on_result`]); the batch never waits on it.
    pub(super) fn send_probes(&mut self, id: u64, now: Instant) {
        for rank in self.health.probes_due(now) {
            if !self.replicas.alive.get(rank as usize).is_some_and(|&a| a) {
                continue; // not connected: probed once it is back
            }
            let Some(b) = self.inflight.get(&id) else {
                return;
            };
            let owners = &self.owners_ext[&b.layer];
            let holds = |p: &Part| {
                p.plan.pair_targets().all(|(t, s)| {
                    let e = b.routing.experts_of(t as usize)[s as usize];
                    owners.owners[e as usize].contains(&rank)
                })
            };
            let live_part = |p: &&Part| p.live && p.rank != rank && holds(p);
            let Some(src) = b.parts.iter().find(live_part) else {
                continue;
            };
            let mut plan = src.plan.clone();
            plan.rank = rank;
            let part_id = b.parts.len() as u32;
            let (frame, _) = self.part_frame(b, id, part_id, &plan);
            let rows = match self.wire.layout {
                OutputLayout::PerSlot => plan.pairs(),
                OutputLayout::PreCombined => plan.tokens.len(),
            };
            let layer = b.layer;
            let b = self.inflight.get_mut(&id).expect("checked above");
            b.parts.push(Part {
                rank,
                plan,
                sent_at: now,
                hedge_at: now,
                straggled: false,
                live: false,
                twin: None,
            });
            self.health.probe_sent(rank, id, part_id, now);
            self.probes.insert(rank, (layer, rows));
            self.stats.probes += 1;
            tracing::debug!(device = %self.name(rank), batch = id, part = part_id, "probe sent");
            self.actions.push_back(Action::Send {
                rank,
                frame,
                batch: id,
                part: part_id,
            });
        }
    }

    /// The probe out to `from` was answered: back in rotation when the answer has the shape
    /// asked for and came in time, quarantined again otherwise.
    pub(super) fn probe_answered(
        &mut self,
        from: u32,
        res: &ExpertResult,
        payload: &[u8],
        now: Instant,
    ) {
        let Some((layer, rows)) = self.probes.remove(&from) else {
            return;
        };
        let h = self.spec.hidden as usize;
        let fits = res.rows as usize == rows
            && res.layout == self.wire.layout
            && res.hidden as usize == h
            && payload.len() == rows * h * res.dtype.elem_bytes();
        let ev = if fits {
            self.health.on_probe_answered(from, layer, now)
        } else {
            self.health.on_probe_failed(from, now)
        };
        let why = if fits {
            "it answered its probe"
        } else {
            "it answered its probe with a result of the wrong shape"
        };
        self.health_event(ev, why);
    }

    /// Whether batch id `id` (of a result or error frame from `from`) was issued by this
    /// incarnation. A frame of another one (an earlier router process on this rank) is dropped
    /// and counted, with a warning at most every [`STALE_WARN_EVERY`].
    pub(super) fn own_batch(&mut self, id: u64, from: u32, now: Instant) -> bool {
        if id >> 32 == u64::from(self.incarnation) {
            return true;
        }
        if id == 0 {
            return false; // an error about a frame the worker could not read
        }
        self.stats.stale_results += 1;
        let (batch, mine) = (format!("{id:016x}"), format!("{:08x}", self.incarnation));
        tracing::debug!(from = %self.name(from), batch, incarnation = mine, "dropped a frame of another router incarnation");
        if self
            .last_stale_warn
            .is_none_or(|t| now.saturating_duration_since(t) >= STALE_WARN_EVERY)
        {
            self.last_stale_warn = Some(now);
            tracing::warn!(
                from = %self.name(from), batch, incarnation = mine,
                dropped = self.stats.stale_results,
                "dropping answers to another router incarnation (work an earlier router process on this rank dispatched)"
            );
        }
        false
    }
}

/// How soon a straggling part without another live owner is looked at again (a replica may
/// have come back).
const STRAGGLER_RECHECK: Duration = Duration::from_millis(25);

/// Least time between two warnings about stale frames (each is counted and logged at debug).
const STALE_WARN_EVERY: Duration = Duration::from_secs(5);
