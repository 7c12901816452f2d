//! The backend's thread pool: the caller and `threads − 1` helper threads run each job
//! together; helpers spin briefly between jobs instead of sleeping.
//!
//! Why this exists: one decode call of a small expert (Qwen3-30B-A3B: 2.4 MB, ~80 µs at the
//! read limit) runs two parallel steps, and a rayon `broadcast` costs 12–14 µs on the 2-vCPU
//! VMs we measure on (waking sleeping threads, and putting the caller to sleep and waking it):
//! a quarter of the call. Here a job is published with one atomic increment that spinning
//! helpers see within a fraction of a microsecond, the caller works on it too (it would
//! otherwise sleep), and it waits for the helpers by spinning: the steps of one call are
//! microseconds apart. A helper that sees no job for [`SPIN`] parks on a condition variable,
//! so an idle backend costs nothing after that and a busy one never sleeps.
//!
//! Threads are a fixed set, started at construction (pinned if asked): no oversubscription, as
//! long as the caller is not itself one of many busy threads on the same cores.
//!
//! A panic inside a job, on any thread, is re-raised on the caller once every thread has left
//! the job (the job borrows the caller's stack, so no thread may still run it).

use std::cell::UnsafeCell;
use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long a helper spins for the next job before it parks.
const SPIN: Duration = Duration::from_micros(50);
/// Spins between clock reads (and, for a waiting caller, before it yields its core).
const SPINS_PER_CHECK: u32 = 256;

/// A job: called once on every thread with the thread's index (`0` is the caller).
type Job = dyn Fn(usize) + Sync;

struct Shared {
    /// Bumped once per job (and once to shut down); helpers run the job of each new value.
    epoch: AtomicU64,
    /// The current job, valid while its epoch's helpers have not all reported `done`.
    job: UnsafeCell<Option<*const Job>>,
    /// Helpers that finished the current job.
    done: AtomicUsize,
    /// A helper's job panicked.
    panicked: AtomicBool,
    shutdown: AtomicBool,
    /// Helpers parked (or about to): the caller wakes them only then.
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
}

// SAFETY: `job` is written only by the caller between jobs (when every helper has reported
// `done` for the previous epoch and none reads it) and read by helpers only after they see the
// new epoch (release/acquire on `epoch`); the job itself is `Sync`.
unsafe impl Sync for Shared {}
// SAFETY: as above; the raw pointer is only dereferenced under that protocol.
unsafe impl Send for Shared {}

/// The caller plus `helpers` threads (see the module docs).
pub(crate) struct SpinPool {
    shared: Arc<Shared>,
    handles: Vec<JoinHandle<()>>,
    /// A job is running (`run` is not reentrant).
    busy: AtomicBool,
}

impl SpinPool {
    /// A pool of `threads` threads in all: the caller and `threads − 1` helpers, helper `i`
    /// (`1 ..`) started with `on_start(i)` (to pin it).
    pub(crate) fn new(
        threads: usize,
        on_start: impl Fn(usize) + Send + Sync + 'static,
    ) -> std::io::Result<Self> {
        let shared = Arc::new(Shared {
            epoch: AtomicU64::new(0),
            job: UnsafeCell::new(None),
            done: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
        });
        let on_start = Arc::new(on_start);
        let mut pool = Self {
            shared,
            handles: Vec::new(),
            busy: AtomicBool::new(false),
        };
        for i in 1..threads.max(1) {
            let (shared, on_start) = (Arc::clone(&pool.shared), Arc::clone(&on_start));
            let handle = std::thread::Builder::new()
                .name(format!("expert-cpu-{i}"))
                .spawn(move || {
                    on_start(i);
                    helper(&shared, i);
                })?;
            // On an error the pool built so far shuts its helpers down when dropped.
            pool.handles.push(handle);
        }
        Ok(pool)
    }

    /// Threads in all, the caller included.
    pub(crate) fn threads(&self) -> usize {
        self.handles.len() + 1
    }

    /// Run `job(i)` on every thread (`i = 0` on the caller), returning when all are done.
    pub(crate) fn run(&self, job: &(dyn Fn(usize) + Sync)) {
        let helpers = self.handles.len();
        if helpers == 0 {
            job(0);
            return;
        }
        assert!(
            !self.busy.swap(true, Ordering::Acquire),
            "SpinPool::run is not reentrant"
        );
        let s = &*self.shared;
        // SAFETY: no helper reads `job` now (all reported `done` for the previous epoch, or
        // none has run yet), and the borrow outlives every use: this function returns only
        // after every helper reported `done` for this epoch.
        unsafe {
            let erased: *const Job = std::mem::transmute::<&(dyn Fn(usize) + Sync), &Job>(job);
            *s.job.get() = Some(erased);
        }
        s.done.store(0, Ordering::Relaxed);
        s.epoch.fetch_add(1, Ordering::SeqCst);
        if s.sleepers.load(Ordering::SeqCst) > 0 {
            let _g = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        let mine = panic::catch_unwind(AssertUnwindSafe(|| job(0)));
        let mut spins = 0u32;
        while s.done.load(Ordering::Acquire) < helpers {
            std::hint::spin_loop();
            spins += 1;
            if spins >= SPINS_PER_CHECK {
                // A helper may be off its core (more runnable threads than cores).
                std::thread::yield_now();
                spins = 0;
            }
        }
        let theirs = s.panicked.swap(false, Ordering::Relaxed);
        self.busy.store(false, Ordering::Release);
        if let Err(p) = mine {
            panic::resume_unwind(p);
        }
        assert!(!theirs, "a CPU backend helper thread panicked in a job");
    }
}

/// A helper's loop: wait for a new epoch (spinning, then parked), run its job, report.
fn helper(s: &Shared, index: usize) {
    let mut seen = 0u64;
    loop {
        let mut since = Instant::now();
        let mut spins = 0u32;
        seen = loop {
            let e = s.epoch.load(Ordering::Acquire);
            if e != seen {
                break e;
            }
            std::hint::spin_loop();
            spins += 1;
            if spins < SPINS_PER_CHECK {
                continue;
            }
            spins = 0;
            if since.elapsed() < SPIN {
                continue;
            }
            let mut g = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.sleepers.fetch_add(1, Ordering::SeqCst);
            while s.epoch.load(Ordering::SeqCst) == seen {
                g = s.wake.wait(g).unwrap_or_else(|e| e.into_inner());
            }
            s.sleepers.fetch_sub(1, Ordering::SeqCst);
            drop(g);
            since = Instant::now();
        };
        if s.shutdown.load(Ordering::Acquire) {
            return;
        }
        // SAFETY: the epoch was published after `job` was written (acquire above) and the
        // caller keeps the job alive until this helper reports `done`.
        let job = unsafe { &*(*s.job.get()).expect("a job for every epoch") };
        if panic::catch_unwind(AssertUnwindSafe(|| job(index))).is_err() {
            s.panicked.store(true, Ordering::Relaxed);
        }
        s.done.fetch_add(1, Ordering::Release);
    }
}

impl Drop for SpinPool {
    fn drop(&mut self) {
        let s = &*self.shared;
        s.shutdown.store(true, Ordering::Release);
        s.epoch.fetch_add(1, Ordering::SeqCst);
        {
            let _g = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every thread runs every job exactly once, with its own index, across parks (a pause
    /// longer than the spin) and back-to-back jobs.
    #[test]
    fn every_thread_runs_every_job_once() {
        for threads in [1, 2, 3, 5] {
            let pool = SpinPool::new(threads, |_| {}).unwrap();
            assert_eq!(pool.threads(), threads);
            for round in 0..300 {
                let hits: Vec<AtomicUsize> = (0..threads).map(|_| AtomicUsize::new(0)).collect();
                pool.run(&|i| {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                });
                assert!(
                    hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
                    "round {round}"
                );
                if round % 100 == 99 {
                    std::thread::sleep(SPIN * 3);
                }
            }
        }
    }

    /// A panic on a helper or on the caller reaches the caller after every thread left the
    /// job, and the pool keeps working.
    #[test]
    fn panics_reach_the_caller_and_the_pool_goes_on() {
        let pool = SpinPool::new(3, |_| {}).unwrap();
        for bad in [0usize, 2] {
            let r = panic::catch_unwind(AssertUnwindSafe(|| {
                pool.run(&|i| {
                    if i == bad {
                        panic!("job failed on thread {i}");
                    }
                })
            }));
            assert!(r.is_err(), "a panic on thread {bad} was reported");
            let n = AtomicUsize::new(0);
            pool.run(&|_| {
                n.fetch_add(1, Ordering::Relaxed);
            });
            assert_eq!(n.load(Ordering::Relaxed), 3);
        }
    }
}
