//! A fabric process's life on one host: dying with its launcher, waiting for a stop signal,
//! and the
//! launcher's loop that restarts workers that exit.
//!
//! Why this exists: `expertmesh up`, `router` and `worker` share one way to run until told to
//! stop (SIGTERM from a cluster engine, or Ctrl-C), and a worker started by the local launcher must never outlive it (parent-death
//! signal), so nothing is left running when a test or `up` ends.

use crate::FabricError;
use crate::local::LocalFabric;
use expertmesh_topology::topology::DeviceRank;
use std::time::{Duration, Instant};

/// Makes this process exit when its parent does (the local launcher's workers): on Linux a
/// parent-death SIGKILL, and an exit now when the parent is already gone.
#[cfg(target_os = "linux")]
pub fn exit_with_parent() {
    // SAFETY: prctl with PR_SET_PDEATHSIG only sets a signal for this process.
    unsafe {
        libc::prctl(
            libc::PR_SET_PDEATHSIG,
            libc::SIGKILL as libc::c_ulong,
            0,
            0,
            0,
        );
    }
    // SAFETY: getppid has no preconditions.
    if unsafe { libc::getppid() } == 1 {
        std::process::exit(0);
    }
}

/// Does nothing where there is no parent-death signal.
#[cfg(not(target_os = "linux"))]
pub fn exit_with_parent() {}

/// Blocks until SIGTERM (a cluster engine stopping the process: Slurm's `scancel`,
/// Kubernetes, systemd) or SIGINT (Ctrl-C); returns the signal's name.
pub fn wait_for_stop_signal() -> Result<&'static str, FabricError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    Ok(rt.block_on(expertmesh_worker::process::stop_signal()))
}

/// Runs `fabric` until SIGTERM or SIGINT, restarting every worker that exits (checked twice
/// a second); each exit and restart is reported on stderr. A restart whose process exits
/// before it joins is tried again after a backoff that doubles up to [`RESTART_BACKOFF_MAX`],
/// so a passing cause (a port not yet free, memory held by the exited process) does not leave
/// the fabric without that device for good; one that runs but has not joined in time (a slow
/// load) is left to join, and restarted if it exits. A stop signal that comes during a restart
/// is taken after it, before the next one.
pub fn supervise_until_stopped(fabric: &mut LocalFabric) -> Result<(), FabricError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let mut signal = Box::pin(expertmesh_worker::process::stop_signal());
    let mut restarts = Restarts::default();
    loop {
        let stop = rt.block_on(async {
            tokio::select! {
                _ = &mut signal => true,
                _ = tokio::time::sleep(Duration::from_millis(500)) => false,
            }
        });
        if stop {
            return Ok(());
        }
        let now = Instant::now();
        for (d, status) in fabric.exited_workers() {
            let name = fabric.deployment().device_label(DeviceRank(d as u32));
            eprintln!("worker {name} exited ({status}); restarting");
            restarts.exited(d, now);
        }
        for d in restarts.due(now) {
            let name = fabric.deployment().device_label(DeviceRank(d as u32));
            match fabric.restart_worker(d) {
                Ok(()) => restarts.restarted(d),
                // Started but not joined in time (a slow load): left to join; if it exits,
                // it is restarted then.
                Err(e) if fabric.worker_running(d) => {
                    restarts.restarted(d);
                    eprintln!(
                        "worker {name} did not join in time ({e:#}); it is left running to join"
                    );
                }
                Err(e) => {
                    let wait = restarts.failed(d, Instant::now());
                    eprintln!("restart of worker {name} failed: {e:#}; trying again in {wait:?}");
                }
            }
            let stop = rt.block_on(async {
                tokio::select! {
                    biased;
                    _ = &mut signal => true,
                    _ = std::future::ready(()) => false,
                }
            });
            if stop {
                return Ok(());
            }
        }
    }
}

/// The first wait after a failed restart.
const RESTART_BACKOFF_MIN: Duration = Duration::from_secs(1);
/// The longest wait between restarts of one worker.
pub const RESTART_BACKOFF_MAX: Duration = Duration::from_secs(30);

/// Which workers are down and when each is tried again (sans-IO: instants in, devices out).
#[derive(Debug, Default)]
struct Restarts {
    /// Device → (next attempt, the wait after that attempt fails).
    down: std::collections::BTreeMap<usize, (Instant, Duration)>,
}

impl Restarts {
    /// Worker `d` exited at `now`: restart it at once.
    fn exited(&mut self, d: usize, now: Instant) {
        self.down.insert(d, (now, RESTART_BACKOFF_MIN));
    }

    /// The workers to restart at `now`, in device order.
    fn due(&self, now: Instant) -> Vec<usize> {
        self.down
            .iter()
            .filter(|(_, (at, _))| *at <= now)
            .map(|(&d, _)| d)
            .collect()
    }

    /// Worker `d` is back.
    fn restarted(&mut self, d: usize) {
        self.down.remove(&d);
    }

    /// Restarting worker `d` failed at `now`: the wait before the next attempt.
    fn failed(&mut self, d: usize, now: Instant) -> Duration {
        let wait = self.down.get(&d).map_or(RESTART_BACKOFF_MIN, |&(_, w)| w);
        let next = wait.saturating_mul(2).min(RESTART_BACKOFF_MAX);
        self.down.insert(d, (now + wait, next));
        wait
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_restart_is_tried_again_with_a_capped_doubling_backoff() {
        let t0 = Instant::now();
        let mut r = Restarts::default();
        assert!(r.due(t0).is_empty());
        r.exited(2, t0);
        r.exited(0, t0);
        assert_eq!(r.due(t0), vec![0, 2], "at once, in device order");
        r.restarted(0);
        let mut now = t0;
        let mut waits = Vec::new();
        for _ in 0..8 {
            let wait = r.failed(2, now);
            assert!(r.due(now + wait - Duration::from_millis(1)).is_empty());
            now += wait;
            assert_eq!(r.due(now), vec![2], "tried again, not given up");
            waits.push(wait.as_secs());
        }
        assert_eq!(waits, [1, 2, 4, 8, 16, 30, 30, 30]);
        r.restarted(2);
        assert!(r.due(now + RESTART_BACKOFF_MAX).is_empty());
        // Exiting again after a success starts from the shortest wait.
        r.exited(2, now);
        assert_eq!(r.failed(2, now), RESTART_BACKOFF_MIN);
    }
}
