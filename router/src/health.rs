//! Device health as the router core sees it: how long to wait for a device before hedging its
//! share to a replica, and which devices are out of rotation (quarantined).
//!
//! Why this exists: a fixed straggler timeout has to be set for the worst case (seconds), so a
//! paused or gray-failing device makes every call wait that long even when a healthy replica
//! holds all its experts; and a device whose link keeps failing would be used again the moment
//! it reconnects. This module keeps, per (device, layer), a window of recent answer latencies
//! and derives the hedge timeout from it (a high quantile × a factor, between a floor and the
//! configured ceiling); and per device a leaky strike score (straggles, failed sends, lost
//! links, error answers) that quarantines a device repeatedly at fault. A quarantined device is
//! left out of replica choice (unless it is the only owner of an expert) for a backoff that
//! doubles on every relapse; when it runs out, the core mirrors one live part to it as a probe
//! (its answer is checked and thrown away, so the call never waits on it), and a probe
//! answered in time brings the device back.
//!
//! Sans-IO like the core: it takes events and the current time, and holds no clock.

use std::collections::HashMap;
use std::time::{Duration, Instant};

/// Tuning of hedging and quarantine (the hedge ceiling is the router's `straggler_timeout`).
#[derive(Clone, Debug)]
pub struct HedgePolicy {
    /// Latency quantile of the recent window the hedge timeout is based on.
    pub quantile: f64,
    /// Hedge timeout = quantile × factor (then clamped).
    pub factor: f64,
    /// Shortest hedge timeout (absorbs scheduling noise).
    pub floor: Duration,
    /// Samples of a (device, layer) before its own estimate is used (until then the device's
    /// estimate over every layer, and before that the ceiling).
    pub min_samples: usize,
    /// Strike score at which a device is quarantined. Each fault adds 1; each answer in time
    /// multiplies the score by [`HedgePolicy::forgiveness`].
    pub quarantine_score: f64,
    /// Decay of the strike score per answer in time.
    pub forgiveness: f64,
    /// Faults closer together than this count once (one hiccup stalls several parts at once).
    pub strike_gap: Duration,
    /// First quarantine period; it doubles on every relapse up to [`HedgePolicy::backoff_max`].
    pub backoff_initial: Duration,
    /// Longest quarantine period.
    pub backoff_max: Duration,
    /// A probe unanswered this long fails (and the quarantine starts again, doubled).
    pub probe_timeout: Duration,
    /// Answers in time after a release that reset the backoff to its initial value.
    pub answers_to_reset_backoff: u32,
    /// A device's hedge timeout for a layer is at most this many times the fastest other
    /// device's for that layer: a device that is uniformly slow (a throttled link, a gray
    /// failure from its first answer on) never looks late against its own history, but does
    /// against its peers'.
    pub peer_slack: f64,
}

impl Default for HedgePolicy {
    fn default() -> Self {
        Self {
            quantile: 0.95,
            factor: 3.0,
            floor: Duration::from_millis(10),
            min_samples: 8,
            quarantine_score: 3.0,
            forgiveness: 0.9,
            strike_gap: Duration::from_millis(20),
            backoff_initial: Duration::from_millis(500),
            backoff_max: Duration::from_secs(30),
            probe_timeout: Duration::from_secs(1),
            answers_to_reset_backoff: 50,
            peer_slack: 4.0,
        }
    }
}

/// Latencies kept per (device, layer) and per device.
const WINDOW: usize = 64;

/// The most recent latencies of one (device, layer), and the hedge timeout they give.
#[derive(Clone, Debug)]
struct LatencyWindow {
    micros: [u32; WINDOW],
    len: usize,
    next: usize,
    /// The hedge timeout from the current samples (`None`: too few).
    hedge_after: Option<Duration>,
}

impl LatencyWindow {
    fn new() -> Self {
        Self {
            micros: [0; WINDOW],
            len: 0,
            next: 0,
            hedge_after: None,
        }
    }

    fn record(&mut self, latency: Duration, policy: &HedgePolicy, ceiling: Duration) {
        self.micros[self.next] = latency.as_micros().min(u32::MAX as u128) as u32;
        self.next = (self.next + 1) % WINDOW;
        self.len = (self.len + 1).min(WINDOW);
        if self.len < policy.min_samples {
            return;
        }
        let mut sorted = self.micros;
        let s = &mut sorted[..self.len];
        s.sort_unstable();
        let i = ((policy.quantile * self.len as f64).ceil() as usize).clamp(1, self.len) - 1;
        let q = Duration::from_micros(s[i] as u64);
        let t = q.mul_f64(policy.factor).max(policy.floor).min(ceiling);
        self.hedge_after = Some(t);
    }
}

/// Where a device stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Standing {
    /// Used for replica choice.
    InRotation,
    /// Out of rotation until `until`; then a probe is due.
    Quarantined { until: Instant },
    /// A mirrored part is out to it as a probe.
    Probing {
        batch: u64,
        part: u32,
        sent_at: Instant,
    },
}

#[derive(Clone, Debug)]
struct Device {
    score: f64,
    last_strike: Option<Instant>,
    standing: Standing,
    /// The next quarantine period.
    backoff: Duration,
    /// Answers in time since the last release (resets the backoff after enough).
    good_since_release: u32,
    /// When it last went out of rotation (kept until released): only a part sent after that
    /// brings it back by being answered in time.
    benched_at: Option<Instant>,
    window: LatencyWindow,
}

/// A change of a device's standing, for the core's counters and logs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HealthEvent {
    /// The device was taken out of rotation for `period`.
    Quarantined {
        /// Mesh rank.
        rank: u32,
        /// How long before it is probed.
        period: Duration,
    },
    /// The device answered its probe (or a part only it could serve) in time: back in rotation.
    Released {
        /// Mesh rank.
        rank: u32,
    },
}

/// Per-device latency estimates and quarantine state (see the module docs).
#[derive(Clone, Debug)]
pub struct Health {
    policy: HedgePolicy,
    ceiling: Duration,
    devices: Vec<Device>,
    layers: HashMap<(u32, u32), LatencyWindow>,
    /// Per layer, the two devices with the shortest hedge timeouts (so every device has a
    /// fastest *other* device to be compared with).
    fastest: HashMap<u32, [Option<(Duration, u32)>; 2]>,
}

impl Health {
    /// Health of `ranks` mesh ranks, all in rotation; hedge timeouts at most `ceiling`.
    pub fn new(ranks: usize, ceiling: Duration, policy: HedgePolicy) -> Self {
        let device = Device {
            score: 0.0,
            last_strike: None,
            standing: Standing::InRotation,
            backoff: policy.backoff_initial,
            good_since_release: 0,
            benched_at: None,
            window: LatencyWindow::new(),
        };
        Self {
            devices: vec![device; ranks],
            layers: HashMap::new(),
            fastest: HashMap::new(),
            policy,
            ceiling,
        }
    }

    /// The policy in force.
    pub fn policy(&self) -> &HedgePolicy {
        &self.policy
    }

    /// How long a part sent to `rank` for `layer` may go unanswered before it is hedged.
    pub fn hedge_after(&self, rank: u32, layer: u32) -> Duration {
        let own = self
            .layers
            .get(&(rank, layer))
            .and_then(|w| w.hedge_after)
            .or_else(|| self.devices.get(rank as usize)?.window.hedge_after)
            .unwrap_or(self.ceiling);
        let peer = self
            .fastest
            .get(&layer)
            .and_then(|two| two.iter().flatten().find(|&&(_, r)| r != rank))
            .map(|&(t, _)| t.mul_f64(self.policy.peer_slack).max(self.policy.floor));
        peer.map_or(own, |p| own.min(p))
    }

    /// Refreshes the two fastest devices of `layer` after `rank`'s estimate for it changed.
    fn refresh_fastest(&mut self, layer: u32) {
        let mut two: [Option<(Duration, u32)>; 2] = [None, None];
        for r in 0..self.devices.len() as u32 {
            let Some(t) = self.layers.get(&(r, layer)).and_then(|w| w.hedge_after) else {
                continue;
            };
            match two {
                [None, _] => two[0] = Some((t, r)),
                [Some((t0, _)), _] if t < t0 => two = [Some((t, r)), two[0]],
                [_, None] => two[1] = Some((t, r)),
                [_, Some((t1, _))] if t < t1 => two[1] = Some((t, r)),
                _ => {}
            }
        }
        self.fastest.insert(layer, two);
    }

    /// Whether `rank` is out of rotation (quarantined or being probed).
    pub fn is_quarantined(&self, rank: u32) -> bool {
        self.devices
            .get(rank as usize)
            .is_some_and(|d| d.standing != Standing::InRotation)
    }

    /// Ranks out of rotation now.
    pub fn quarantined(&self) -> Vec<u32> {
        (0..self.devices.len() as u32)
            .filter(|&r| self.is_quarantined(r))
            .collect()
    }

    /// `rank` answered a part of `layer` in time, `latency` after it was sent. A device out of
    /// rotation that answers in time a part sent since it went out (it was used as the only
    /// owner of an expert) is back; one sent before (in flight when its faults benched it) is
    /// no sign it recovered.
    pub fn on_answer(
        &mut self,
        rank: u32,
        layer: u32,
        latency: Duration,
        now: Instant,
    ) -> Option<HealthEvent> {
        let (policy, ceiling) = (&self.policy, self.ceiling);
        let d = self.devices.get_mut(rank as usize)?;
        d.window.record(latency, policy, ceiling);
        self.layers
            .entry((rank, layer))
            .or_insert_with(LatencyWindow::new)
            .record(latency, policy, ceiling);
        self.refresh_fastest(layer);
        let (policy, d) = (&self.policy, &mut self.devices[rank as usize]);
        d.score *= policy.forgiveness;
        d.good_since_release = d.good_since_release.saturating_add(1);
        if d.good_since_release >= policy.answers_to_reset_backoff {
            d.backoff = policy.backoff_initial;
        }
        let sent_since_benched = d
            .benched_at
            .is_some_and(|t| now.checked_sub(latency).is_some_and(|sent| sent >= t));
        (d.standing != Standing::InRotation && sent_since_benched).then(|| self.release(rank))
    }

    /// `rank` was at fault (a straggling part, a failed send, a lost link, an error answer).
    /// Returns the quarantine it starts, if the strike score reaches the limit.
    pub fn on_fault(&mut self, rank: u32, now: Instant) -> Option<HealthEvent> {
        let policy = &self.policy;
        let d = self.devices.get_mut(rank as usize)?;
        if d.last_strike
            .is_some_and(|t| now.saturating_duration_since(t) < policy.strike_gap)
        {
            return None;
        }
        d.last_strike = Some(now);
        d.score += 1.0;
        match d.standing {
            Standing::InRotation if d.score >= policy.quarantine_score => {
                Some(self.quarantine(rank, now))
            }
            // A quarantined device that fails again waits out its (unchanged) period; a probe
            // failing is handled by `on_probe_failed`.
            _ => None,
        }
    }

    /// Ranks whose quarantine has run out and that have no probe out: the core should mirror a
    /// live part to each.
    pub fn probes_due(&self, now: Instant) -> Vec<u32> {
        self.devices
            .iter()
            .enumerate()
            .filter(|(_, d)| matches!(d.standing, Standing::Quarantined { until } if until <= now))
            .map(|(r, _)| r as u32)
            .collect()
    }

    /// A probe (part `part` of batch `batch`) went to `rank`.
    pub fn probe_sent(&mut self, rank: u32, batch: u64, part: u32, now: Instant) {
        if let Some(d) = self.devices.get_mut(rank as usize) {
            d.standing = Standing::Probing {
                batch,
                part,
                sent_at: now,
            };
        }
    }

    /// Whether (`batch`, `part`) is the probe out to `rank`.
    pub fn is_probe(&self, rank: u32, batch: u64, part: u32) -> bool {
        self.devices.get(rank as usize).is_some_and(|d| {
            matches!(d.standing, Standing::Probing { batch: b, part: p, .. } if b == batch && p == part)
        })
    }

    /// The probe out to `rank` was answered correctly at `now`: the device is back (when in
    /// time) or quarantined again.
    pub fn on_probe_answered(&mut self, rank: u32, layer: u32, now: Instant) -> HealthEvent {
        let sent_at = match self.devices.get(rank as usize).map(|d| d.standing) {
            Some(Standing::Probing { sent_at, .. }) => sent_at,
            _ => now,
        };
        let latency = now.saturating_duration_since(sent_at);
        if latency > self.policy.probe_timeout {
            return self.quarantine(rank, now);
        }
        let (policy, ceiling) = (&self.policy, self.ceiling);
        if let Some(d) = self.devices.get_mut(rank as usize) {
            d.window.record(latency, policy, ceiling);
        }
        self.layers
            .entry((rank, layer))
            .or_insert_with(LatencyWindow::new)
            .record(latency, policy, ceiling);
        self.release(rank)
    }

    /// The probe out to `rank` failed (an error answer, a wrong shape, a failed send, a lost
    /// link): quarantined again for a doubled period.
    pub fn on_probe_failed(&mut self, rank: u32, now: Instant) -> HealthEvent {
        self.quarantine(rank, now)
    }

    /// Probes unanswered past the probe timeout fail: those devices are quarantined again.
    pub fn expire_probes(&mut self, now: Instant) -> Vec<HealthEvent> {
        let late: Vec<u32> = self
            .devices
            .iter()
            .enumerate()
            .filter(|(_, d)| matches!(d.standing, Standing::Probing { sent_at, .. } if now.saturating_duration_since(sent_at) >= self.policy.probe_timeout))
            .map(|(r, _)| r as u32)
            .collect();
        late.into_iter().map(|r| self.quarantine(r, now)).collect()
    }

    /// When the next probe times out (the core's timer; a quarantine running out needs no
    /// timer: the probe goes with the next batch).
    pub fn next_timeout(&self) -> Option<Instant> {
        self.devices
            .iter()
            .filter_map(|d| match d.standing {
                Standing::Probing { sent_at, .. } => Some(sent_at + self.policy.probe_timeout),
                _ => None,
            })
            .min()
    }

    /// The probe out to `rank` (batch, part), if any.
    pub fn probe_of(&self, rank: u32) -> Option<(u64, u32)> {
        match self.devices.get(rank as usize)?.standing {
            Standing::Probing { batch, part, .. } => Some((batch, part)),
            _ => None,
        }
    }

    fn quarantine(&mut self, rank: u32, now: Instant) -> HealthEvent {
        let max = self.policy.backoff_max;
        let d = &mut self.devices[rank as usize];
        let period = d.backoff;
        d.backoff = (d.backoff * 2).min(max);
        if d.standing == Standing::InRotation {
            d.benched_at = Some(now);
        }
        d.standing = Standing::Quarantined {
            until: now + period,
        };
        d.good_since_release = 0;
        HealthEvent::Quarantined { rank, period }
    }

    fn release(&mut self, rank: u32) -> HealthEvent {
        let d = &mut self.devices[rank as usize];
        d.standing = Standing::InRotation;
        d.score = 0.0;
        d.last_strike = None;
        d.good_since_release = 0;
        d.benched_at = None;
        HealthEvent::Released { rank }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn the_hedge_timeout_follows_the_observed_latency_within_floor_and_ceiling() {
        let mut h = Health::new(3, Duration::from_secs(3), HedgePolicy::default());
        let now = Instant::now();
        assert_eq!(
            h.hedge_after(1, 0),
            Duration::from_secs(3),
            "no samples: the ceiling"
        );
        for i in 0..7 {
            h.on_answer(1, 0, ms(4 + i % 2), now);
        }
        assert_eq!(
            h.hedge_after(1, 0),
            Duration::from_secs(3),
            "too few samples"
        );
        h.on_answer(1, 0, ms(4), now);
        // p95 of {4, 5} ms is 5 ms, × 3 = 15 ms
        assert_eq!(h.hedge_after(1, 0), ms(15));
        // another layer of the same device falls back to the device's estimate
        assert_eq!(h.hedge_after(1, 7), ms(15));
        // fast answers: the floor
        for _ in 0..WINDOW {
            h.on_answer(2, 0, Duration::from_micros(100), now);
        }
        assert_eq!(h.hedge_after(2, 0), HedgePolicy::default().floor);
        // slow answers: the ceiling
        for _ in 0..WINDOW {
            h.on_answer(2, 1, Duration::from_secs(2), now);
        }
        assert_eq!(h.hedge_after(2, 1), Duration::from_secs(3));
    }

    #[test]
    fn a_uniformly_slow_device_is_hedged_against_its_fastest_peer() {
        let p = HedgePolicy::default();
        let mut h = Health::new(3, Duration::from_secs(3), p.clone());
        let now = Instant::now();
        // Device 0 is slow from its first answer on (a throttled link): against its own
        // history it never looks late.
        for _ in 0..WINDOW {
            h.on_answer(0, 5, ms(500), now);
        }
        assert_eq!(h.hedge_after(0, 5), Duration::from_secs(1) + ms(500));
        // Its replica answers layer 5 in 5 ms: device 0 is hedged after peer_slack × the
        // replica's 15 ms.
        for _ in 0..WINDOW {
            h.on_answer(1, 5, ms(5), now);
        }
        assert_eq!(h.hedge_after(1, 5), ms(15));
        assert_eq!(h.hedge_after(0, 5), ms(15).mul_f64(p.peer_slack));
        // The fastest device is compared with the next fastest, never with itself.
        for _ in 0..WINDOW {
            h.on_answer(2, 5, ms(4), now);
        }
        assert_eq!(h.hedge_after(2, 5), ms(12));
        assert_eq!(h.hedge_after(1, 5), ms(15), "own estimate below 4 × 12 ms");
        assert_eq!(h.hedge_after(0, 5), ms(12).mul_f64(p.peer_slack));
        // Another layer has no peers yet: only the device's own estimate.
        assert_eq!(h.hedge_after(0, 6), Duration::from_secs(1) + ms(500));
    }

    #[test]
    fn repeated_faults_quarantine_with_doubling_backoff_and_a_probe_brings_it_back() {
        let p = HedgePolicy::default();
        let mut h = Health::new(2, Duration::from_secs(3), p.clone());
        let t0 = Instant::now();
        assert_eq!(h.on_fault(1, t0), None);
        // faults within the strike gap count once
        assert_eq!(h.on_fault(1, t0 + ms(1)), None);
        assert_eq!(h.on_fault(1, t0 + ms(30)), None);
        let q = h.on_fault(1, t0 + ms(60));
        assert_eq!(
            q,
            Some(HealthEvent::Quarantined {
                rank: 1,
                period: p.backoff_initial
            })
        );
        assert!(h.is_quarantined(1) && !h.is_quarantined(0));
        let t1 = t0 + ms(60);
        assert!(h.probes_due(t1 + ms(100)).is_empty());
        assert_eq!(h.probes_due(t1 + p.backoff_initial), vec![1]);
        // a probe that times out: quarantined again, twice as long
        let t2 = t1 + p.backoff_initial;
        h.probe_sent(1, 9, 4, t2);
        assert!(h.is_probe(1, 9, 4) && !h.is_probe(1, 9, 3));
        assert!(h.expire_probes(t2 + ms(10)).is_empty());
        let t3 = t2 + p.probe_timeout;
        assert_eq!(
            h.expire_probes(t3),
            vec![HealthEvent::Quarantined {
                rank: 1,
                period: p.backoff_initial * 2
            }]
        );
        assert!(h.probes_due(t3 + p.backoff_initial).is_empty());
        let t4 = t3 + p.backoff_initial * 2;
        assert_eq!(h.probes_due(t4), vec![1]);
        h.probe_sent(1, 11, 0, t4);
        assert_eq!(
            h.on_probe_answered(1, 0, t4 + ms(3)),
            HealthEvent::Released { rank: 1 }
        );
        assert!(!h.is_quarantined(1));
        // one fault after the release does not quarantine again at once
        assert_eq!(h.on_fault(1, t4 + ms(100)), None);
    }

    /// A part answered in time brings a benched device back only if it was sent after the
    /// device went out of rotation: one already in flight then says nothing of its recovery.
    #[test]
    fn only_a_part_sent_since_the_quarantine_brings_a_device_back() {
        let p = HedgePolicy::default();
        let mut h = Health::new(2, Duration::from_secs(3), p.clone());
        let t0 = Instant::now();
        let mut q = None;
        for i in 0..4 {
            q = q.or(h.on_fault(1, t0 + p.strike_gap * i));
        }
        assert!(q.is_some() && h.is_quarantined(1));
        let benched = t0 + p.strike_gap * 2;
        // Sent 15 ms before the quarantine, answered 5 ms after it: still out.
        assert_eq!(h.on_answer(1, 0, ms(20), benched + ms(5)), None);
        assert!(h.is_quarantined(1));
        // Sent since (the only owner of an expert), answered in time: back.
        assert_eq!(
            h.on_answer(1, 0, ms(2), benched + ms(10)),
            Some(HealthEvent::Released { rank: 1 })
        );
        assert!(!h.is_quarantined(1));
        // Benched again later: the new spell counts from its own start, through a probe too.
        let t1 = benched + Duration::from_secs(10);
        let mut q = None;
        for i in 0..4 {
            q = q.or(h.on_fault(1, t1 + p.strike_gap * i));
        }
        let Some(HealthEvent::Quarantined { period, .. }) = q else {
            panic!("quarantined again: {q:?}")
        };
        let benched = t1 + p.strike_gap * 2;
        assert_eq!(h.on_answer(1, 0, ms(20), benched + ms(1)), None);
        let due = benched + period;
        assert_eq!(h.probes_due(due), vec![1]);
        h.probe_sent(1, 3, 0, due);
        assert_eq!(
            h.on_answer(1, 0, ms(2), due + ms(1)),
            Some(HealthEvent::Released { rank: 1 })
        );
    }

    #[test]
    fn answers_in_time_forgive_occasional_faults() {
        let mut h = Health::new(2, Duration::from_secs(3), HedgePolicy::default());
        let mut t = Instant::now();
        // one fault in ten answers never reaches the limit
        for _ in 0..50 {
            t += ms(100);
            assert_eq!(h.on_fault(1, t), None);
            for _ in 0..9 {
                h.on_answer(1, 0, ms(2), t);
            }
        }
        assert!(!h.is_quarantined(1));
    }
}
