//! When the client gives up on a router: the keepalive that notices a silent router, and the
//! schedule of reconnect attempts over a failover client's routers. Both are pure functions of
//! time (sans-IO), so they are tested here without sockets.
//!
//! Why this exists: a router process that is stopped (SIGSTOP), hung, or cut off by a partition
//! keeps its TCP connections open, so nothing on the socket says it is gone; a client that only
//! waits for answers would wait for its deadline on every call. The keepalive probes a router
//! that has been quiet while calls are outstanding and declares it unresponsive when the probe
//! is not answered in time. A failover client then moves to the next router, trying each with
//! a short connect timeout and waiting a jittered, capped backoff after a round in which none
//! answered, so that many clients do not reconnect in lockstep.
//!
//! The probe (see [`probe_request`]) is a request the router refuses at once from its
//! connection's reader, without involving the batching core, so a router that is merely busy
//! still answers it promptly, and a router whose reader is blocked (window full) answers the
//! requests that free it, which also counts: any frame from the router is a sign of life.

use expertmesh_transport::codec::LayerRequest;
use expertmesh_transport::dtype::ActivationDtype;
use std::hash::{BuildHasher, Hasher};
use std::time::{Duration, Instant};

/// Request ids of keepalive probes have this bit set (ordinary requests count up from 1, so
/// the two never meet).
pub(super) const PROBE_ID_BIT: u64 = 1 << 63;

/// Layer number of a probe: past any model's last layer, so every router refuses it with
/// `NotFound` when it reads it, without computing anything.
pub(crate) const PROBE_LAYER: u32 = u32::MAX;

/// A keepalive probe with id `id` (which has [`PROBE_ID_BIT`] set): no tokens, no payload.
pub(super) fn probe_request(id: u64) -> LayerRequest {
    LayerRequest {
        request_id: id,
        layer: PROBE_LAYER,
        tokens: 0,
        hidden: 0,
        dtype: ActivationDtype::F32,
        logit_experts: 0,
        deadline_us: 0,
    }
}

/// What the keepalive wants done now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum KeepaliveAction {
    /// Nothing.
    Wait,
    /// Send a probe (the caller records it with [`Keepalive::probe_sent`]).
    Probe,
    /// The router said nothing for this long while calls were outstanding, and did not answer
    /// a probe within the keepalive timeout: give it up.
    Unresponsive(Duration),
}

/// The keepalive of one connection. The router is *quiet* while calls are outstanding and
/// nothing has been received from it; after `interval` of quiet a probe is sent (when the
/// writing half is free), and if still nothing has been received `timeout` after the probe,
/// the router is unresponsive. A router that is quiet while the client has nothing outstanding
/// is not probed (the client has no background task; the next call starts the clock).
///
/// Bound: a router that stops answering is declared unresponsive at most
/// `interval + timeout` after the last frame it sent, or after the client's call started when
/// that was later (plus the time a write to it stays blocked, bounded the same way), while the
/// client steps the connection. A router is given up without an unanswered probe only while a
/// write to it is blocked: silence while the caller was away from the client ends in a probe,
/// not in a verdict.
#[derive(Debug, Clone)]
pub(super) struct Keepalive {
    interval: Duration,
    timeout: Duration,
    /// When the router was last heard from, or when the client started waiting on it.
    quiet_since: Instant,
    /// When the outstanding probe was sent.
    probe_at: Option<Instant>,
    /// Whether calls were outstanding at the last poll.
    active: bool,
}

impl Keepalive {
    /// A keepalive for a connection established at `now`.
    pub(super) fn new(interval: Duration, timeout: Duration, now: Instant) -> Self {
        Self {
            interval,
            timeout,
            quiet_since: now,
            probe_at: None,
            active: false,
        }
    }

    /// A frame arrived from the router: it is alive; an outstanding probe is forgotten (its
    /// answer is ignored when it comes).
    pub(super) fn received(&mut self, now: Instant) {
        self.quiet_since = now;
        self.probe_at = None;
    }

    /// Nothing is outstanding any more (the last answer was taken): the silence that follows
    /// is not the router's fault, and the next call starts the clock again.
    pub(super) fn idle(&mut self) {
        self.active = false;
        self.probe_at = None;
    }

    /// A probe was written at `now`.
    pub(super) fn probe_sent(&mut self, now: Instant) {
        self.probe_at = Some(now);
    }

    /// What to do at `now`: `outstanding` says whether the client waits on the router (calls
    /// in flight or a write under way), `can_probe` whether the writing half is free.
    pub(super) fn poll(
        &mut self,
        now: Instant,
        outstanding: bool,
        can_probe: bool,
    ) -> KeepaliveAction {
        if !outstanding {
            self.active = false;
            self.probe_at = None;
            return KeepaliveAction::Wait;
        }
        if !self.active {
            // The client starts waiting now: silence before this is not the router's fault.
            self.active = true;
            self.quiet_since = now;
            self.probe_at = None;
        }
        let quiet = now.saturating_duration_since(self.quiet_since);
        match self.probe_at {
            Some(at) if now.saturating_duration_since(at) >= self.timeout => {
                KeepaliveAction::Unresponsive(quiet)
            }
            Some(_) => KeepaliveAction::Wait,
            // Without a probe only when none can be written: silence the client did not
            // watch (a caller busy elsewhere between two calls) is not the router's fault, so
            // with the writing half free the router is always asked first.
            None if quiet >= self.interval.saturating_add(self.timeout) && !can_probe => {
                KeepaliveAction::Unresponsive(quiet)
            }
            None if quiet >= self.interval && can_probe => KeepaliveAction::Probe,
            None => KeepaliveAction::Wait,
        }
    }

    /// When [`Keepalive::poll`] may next have something to do (`None`: not while nothing is
    /// outstanding, or never); `can_probe` as for `poll`. While no probe can be written, the
    /// next thing to do is the verdict (the write's end wakes the caller sooner): the probe's
    /// time, already past, would have the caller step without waiting until then.
    pub(super) fn next_event(&self, can_probe: bool) -> Option<Instant> {
        if !self.active {
            return None;
        }
        // `None` too when the instant is past what `Instant` holds (a keepalive turned off
        // with `Duration::MAX`).
        match self.probe_at {
            Some(at) => at.checked_add(self.timeout),
            None if can_probe => self.quiet_since.checked_add(self.interval),
            None => self
                .quiet_since
                .checked_add(self.interval.saturating_add(self.timeout)),
        }
    }
}

/// The reconnect schedule of a failover client over `n` routers: try them in turn starting
/// after the one that was lost; after a round in which none answered, wait a backoff that
/// doubles from `base` up to `cap`, each wait drawn uniformly from its upper half (jitter).
#[derive(Debug, Clone)]
pub(super) struct Reconnect {
    n: usize,
    base: Duration,
    cap: Duration,
    /// The router to try next.
    next: usize,
    /// Attempts made in this round.
    tried: usize,
    /// Rounds that failed since the last success.
    rounds: u32,
    /// No attempt before this.
    not_before: Option<Instant>,
}

impl Reconnect {
    /// A schedule over `n` routers (at least 1), connected to router `current`.
    pub(super) fn new(n: usize, current: usize, base: Duration, cap: Duration) -> Self {
        let n = n.max(1);
        let base = base.min(Duration::from_secs(3600));
        Self {
            n,
            base,
            // (at most an hour, so that `Instant + wait` cannot overflow)
            cap: cap.max(base).min(Duration::from_secs(3600)),
            next: (current + 1) % n,
            tried: 0,
            rounds: 0,
            not_before: None,
        }
    }

    /// The router to try at `now`, or the instant to wait for first.
    pub(super) fn attempt(&self, now: Instant) -> Result<usize, Instant> {
        match self.not_before {
            Some(t) if now < t => Err(t),
            _ => Ok(self.next),
        }
    }

    /// The attempt on router `i` failed at `now`; `jitter` in [0, 1).
    pub(super) fn failed(&mut self, i: usize, now: Instant, jitter: f64) {
        self.next = (i + 1) % self.n;
        self.tried += 1;
        self.not_before = None;
        if self.tried >= self.n {
            self.tried = 0;
            let exp = self.base.saturating_mul(1u32 << self.rounds.min(16));
            let full = exp.min(self.cap);
            self.rounds = self.rounds.saturating_add(1);
            let wait = full.mul_f64(0.5 + 0.5 * jitter.clamp(0.0, 1.0));
            self.not_before = Some(now + wait);
        }
    }

    /// Router `i` answered: the next loss starts trying after it, with no backoff.
    pub(super) fn connected(&mut self, i: usize) {
        self.next = (i + 1) % self.n;
        self.tried = 0;
        self.rounds = 0;
        self.not_before = None;
    }
}

/// A number in [0, 1) that differs between processes and calls (for backoff jitter; not
/// cryptographic).
pub(super) fn jitter() -> f64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(Instant::now().elapsed().as_nanos());
    (h.finish() >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn a_quiet_router_is_probed_then_given_up_and_any_frame_clears_it() {
        let t0 = Instant::now();
        let mut k = Keepalive::new(100 * MS, 200 * MS, t0);
        // idle: never probed however long
        assert_eq!(k.poll(t0 + 10_000 * MS, false, true), KeepaliveAction::Wait);
        assert_eq!(k.next_event(true), None);
        // a call starts at 10 s: the clock starts then
        let s = t0 + 10_000 * MS;
        assert_eq!(k.poll(s, true, true), KeepaliveAction::Wait);
        assert_eq!(k.next_event(true), Some(s + 100 * MS));
        assert_eq!(k.poll(s + 99 * MS, true, true), KeepaliveAction::Wait);
        assert_eq!(k.poll(s + 100 * MS, true, true), KeepaliveAction::Probe);
        k.probe_sent(s + 100 * MS);
        assert_eq!(k.next_event(true), Some(s + 300 * MS));
        assert_eq!(k.poll(s + 299 * MS, true, true), KeepaliveAction::Wait);
        assert_eq!(
            k.poll(s + 300 * MS, true, true),
            KeepaliveAction::Unresponsive(300 * MS)
        );
        // an answer before the timeout clears the probe
        let mut k = Keepalive::new(100 * MS, 200 * MS, t0);
        k.poll(t0, true, true);
        assert_eq!(k.poll(t0 + 100 * MS, true, true), KeepaliveAction::Probe);
        k.probe_sent(t0 + 100 * MS);
        k.received(t0 + 150 * MS);
        assert_eq!(k.poll(t0 + 400 * MS, true, true), KeepaliveAction::Probe);
    }

    #[test]
    fn a_router_that_blocks_the_probe_is_given_up_after_interval_plus_timeout() {
        let t0 = Instant::now();
        let mut k = Keepalive::new(100 * MS, 200 * MS, t0);
        k.poll(t0, true, false);
        // Nothing to do before the verdict while the probe cannot be written (the caller
        // sleeps until then instead of stepping at once from the probe's time on).
        assert_eq!(k.next_event(false), Some(t0 + 300 * MS));
        assert_eq!(k.next_event(true), Some(t0 + 100 * MS));
        assert_eq!(k.poll(t0 + 200 * MS, true, false), KeepaliveAction::Wait);
        assert_eq!(
            k.poll(t0 + 300 * MS, true, false),
            KeepaliveAction::Unresponsive(300 * MS)
        );
    }

    #[test]
    fn reconnects_go_round_the_routers_with_capped_jittered_backoff() {
        let t0 = Instant::now();
        let mut r = Reconnect::new(3, 1, 50 * MS, 400 * MS);
        assert_eq!(r.attempt(t0), Ok(2), "starts after the lost router");
        r.failed(2, t0, 0.0);
        assert_eq!(r.attempt(t0), Ok(0));
        r.failed(0, t0, 0.0);
        assert_eq!(r.attempt(t0), Ok(1));
        r.failed(1, t0, 0.0);
        // a whole round failed: wait half of 50 ms at the least jitter
        assert_eq!(r.attempt(t0), Err(t0 + 25 * MS));
        assert_eq!(r.attempt(t0 + 25 * MS), Ok(2));
        let mut waits = Vec::new();
        let mut now = t0 + 25 * MS;
        for _ in 0..8 {
            for _ in 0..3 {
                let i = r.attempt(now).unwrap();
                r.failed(i, now, 0.999);
            }
            let until = r.attempt(now).unwrap_err();
            waits.push(until - now);
            now = until;
        }
        assert!(waits.windows(2).all(|w| w[0] <= w[1]), "{waits:?}");
        assert!(waits.iter().all(|w| *w <= 400 * MS), "capped: {waits:?}");
        assert!(*waits.last().unwrap() > 390 * MS, "{waits:?}");
        r.connected(0);
        assert_eq!(r.attempt(now), Ok(1), "no backoff after a success");
    }

    #[test]
    fn silence_after_the_last_answer_is_not_counted_against_the_next_call() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut k = Keepalive::new(ms(1000), ms(2000), t0);
        assert_eq!(k.poll(t0, true, true), KeepaliveAction::Wait);
        // The answer arrives and the call returns without another poll.
        k.received(t0 + ms(10));
        k.idle();
        // The client comes back 5 s later with a new call: the router is not blamed.
        let later = t0 + ms(5000);
        assert_eq!(k.poll(later, true, true), KeepaliveAction::Wait);
        assert_eq!(k.poll(later + ms(999), true, true), KeepaliveAction::Wait);
        assert_eq!(k.poll(later + ms(1000), true, true), KeepaliveAction::Probe);
    }

    /// A caller that submits, then does something else for longer than interval + timeout
    /// before it waits: the router is probed first, not given up for silence nobody watched.
    #[test]
    fn silence_while_the_caller_was_away_ends_in_a_probe_not_a_verdict() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut k = Keepalive::new(ms(1000), ms(2000), t0);
        assert_eq!(k.poll(t0, true, true), KeepaliveAction::Wait);
        let back = t0 + ms(3500);
        assert_eq!(k.poll(back, true, true), KeepaliveAction::Probe);
        k.probe_sent(back);
        assert_eq!(k.poll(back + ms(1999), true, true), KeepaliveAction::Wait);
        assert_eq!(
            k.poll(back + ms(2000), true, true),
            KeepaliveAction::Unresponsive(ms(5500)),
            "an unanswered probe still ends it"
        );
    }

    #[test]
    fn a_keepalive_of_duration_max_never_fires() {
        let t0 = Instant::now();
        let mut k = Keepalive::new(Duration::MAX, Duration::MAX, t0);
        assert_eq!(k.poll(t0, true, true), KeepaliveAction::Wait);
        let later = t0 + Duration::from_secs(86_400 * 365);
        assert_eq!(k.poll(later, true, true), KeepaliveAction::Wait);
        assert_eq!(k.next_event(true), None);
    }

    #[test]
    fn jitter_is_in_the_unit_interval_and_varies() {
        let v: Vec<f64> = (0..64).map(|_| jitter()).collect();
        assert!(v.iter().all(|x| (0.0..1.0).contains(x)));
        assert!(v.iter().any(|x| *x != v[0]));
    }
}
