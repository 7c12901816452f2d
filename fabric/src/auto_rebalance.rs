//! Automatic rebalancing: router 0 replans the placement from the load it routed and applies
//! the new one live when the planner predicts enough gain.
//!
//! Why this exists: traffic drifts, and an operator should not have to run `plan --load` and
//! `rebalance` by hand to follow it. Every `every`, this loop takes the per-expert counts the
//! router routed since the last round (its metrics, the same ones `--load-stats` writes),
//! plans a placement for them (`expertmesh_planner::plan`, replicas allowed), and compares the
//! busiest device's load under the served and the planned placement
//! (`expertmesh_planner::busiest_load`). When the predicted gain reaches `min_gain`, it
//! applies the change through the router's own coordinator ([`PlacementHandle`]), in the steps
//! `planner::transition` orders so that every device's memory suffices: the same protocol as
//! `expertmesh rebalance`, with no failed and no wrong call. A round with too few tokens
//! routed decides nothing, and its window grows into the next round's.
//!
//! The loop assumes it is the one changing the placement: it plans each change from the
//! placement it last applied (the fabric's file at start). A change applied by hand in
//! between can make its next change refused by a device without room, which undoes it
//! (nothing is served wrong); restart the router with the new placement file after changing
//! placement by hand. Router 0 sees only the traffic routed through it: with several routers
//! it plans from its share.

use crate::FabricError;
use crate::observe::load_stats;
use expertmesh_planner::stats::LoadStats;
use expertmesh_planner::transition;
use expertmesh_router::metrics::RouterMetrics;
use expertmesh_router::service::PlacementHandle;
use expertmesh_topology::model::ModelSpec;
use expertmesh_topology::placement::Placement;
use expertmesh_topology::topology::Topology;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Rounds kept for [`AutoRebalancer::rounds`]: a router runs for months, a round every
/// `--auto-rebalance-every` (each is logged as it happens).
pub const KEPT_ROUNDS: usize = 1024;

/// When and how the loop rebalances (`--auto-rebalance-*`).
#[derive(Debug, Clone)]
pub struct AutoOptions {
    /// Time between rounds.
    pub every: Duration,
    /// The predicted gain (busiest device's load before / after) a change needs.
    pub min_gain: f64,
    /// Tokens a round needs routed before it decides anything.
    pub min_tokens: u64,
    /// How long each step of a change may take.
    pub timeout: Duration,
}

/// What one round did.
#[derive(Debug, Clone, PartialEq)]
pub enum Round {
    /// Too few tokens were routed since the last round to plan from.
    TooLittleTraffic {
        /// Tokens routed in the window.
        tokens: u64,
    },
    /// The predicted gain was below the threshold; the placement stays.
    Kept {
        /// Busiest device's load served / planned.
        predicted_gain: f64,
    },
    /// A change was applied.
    Applied {
        /// Busiest device's load served / planned.
        predicted_gain: f64,
        /// The version the last step was served at.
        version: u64,
        /// Experts loaded and released over every step.
        loaded: u32,
        /// Experts released over every step.
        released: u32,
        /// Steps the change took (more than one when a device lacked room).
        steps: usize,
    },
    /// Planning or applying failed (the fabric serves the last placement applied).
    Failed {
        /// What went wrong.
        message: String,
    },
}

/// What a round decides from the load of its window (sans-IO: no clock, no router).
///
/// Returns the placement to apply and its predicted gain, or the gain when it stays.
///
/// # Errors
/// The planner cannot place the model on the topology (the message says why).
pub fn decide(
    topology: &Topology,
    spec: &ModelSpec,
    served: &Placement,
    window: &LoadStats,
    min_gain: f64,
) -> Result<(Option<Placement>, f64), String> {
    let opts = expertmesh_planner::PlanOptions {
        description: "rebalanced automatically from the routed load".into(),
        ..expertmesh_planner::PlanOptions::default()
    };
    let planned = expertmesh_planner::plan(topology, spec, Some(window), None, &opts)
        .map_err(|e| format!("planning from the routed load: {e}"))?
        .placement;
    let before = expertmesh_planner::busiest_load(topology, spec, served, window);
    let after = expertmesh_planner::busiest_load(topology, spec, &planned, window);
    let gain = before / after.max(f64::MIN_POSITIVE);
    Ok(((gain >= min_gain).then_some(planned), gain))
}

/// The counts routed between two cumulative snapshots, as load statistics. The window's tokens
/// are its busiest layer's: each token routes to `top_k` experts of a layer, so a layer's
/// tokens are its window counts over `top_k` (the snapshots' own token figure is the most of
/// any layer's cumulative tokens, whose difference undercounts a window where another layer
/// was the busiest: earlier A 1000, B 0, later A 1000, B 1900 gave 0 instead of 1900).
///
/// # Errors
/// The model does not match the snapshots (cannot happen for snapshots of one router).
pub fn window(
    spec: &ModelSpec,
    earlier: &LoadStats,
    later: &LoadStats,
) -> Result<LoadStats, String> {
    let counts: Vec<Option<Vec<f64>>> = (0..later.layer_count())
        .map(|li| {
            later.layer(li).map(|now| {
                let before = earlier.layer(li).unwrap_or(&[]);
                now.iter()
                    .enumerate()
                    .map(|(e, &c)| (c - before.get(e).copied().unwrap_or(0.0)).max(0.0))
                    .collect()
            })
        })
        .collect();
    let top_k = f64::from(spec.top_k.max(1));
    let tokens = counts
        .iter()
        .flatten()
        .map(|row| row.iter().sum::<f64>() / top_k)
        .fold(0.0, f64::max);
    Ok(LoadStats::new(spec, counts)?.with_tokens(tokens))
}

/// The loop, on its own thread; dropping it stops it (a change under way goes on in the
/// router's coordinator; the loop stops waiting for it and applies no further step).
#[derive(Debug)]
pub struct AutoRebalancer {
    stop: Option<mpsc::Sender<()>>,
    stopping: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
    rounds: Arc<Mutex<Vec<Round>>>,
}

/// What a round works with.
struct Loop {
    opts: AutoOptions,
    handle: PlacementHandle,
    metrics: Arc<RouterMetrics>,
    topology: Topology,
    spec: ModelSpec,
    served: Placement,
    stopping: Arc<AtomicBool>,
}

impl AutoRebalancer {
    /// Starts rebalancing the fabric that serves `served` on `topology` through router 0's
    /// `handle`, planning from its `metrics`.
    ///
    /// # Errors
    /// Options out of range, or the thread could not start.
    pub fn start(
        opts: AutoOptions,
        handle: PlacementHandle,
        metrics: Arc<RouterMetrics>,
        topology: Topology,
        spec: ModelSpec,
        served: Placement,
    ) -> Result<Self, FabricError> {
        if opts.every.is_zero() || !(opts.min_gain.is_finite() && opts.min_gain >= 1.0) {
            return Err(FabricError::AutoRebalance(format!(
                "give a positive period and a minimum gain of at least 1 (not {:?} and {})",
                opts.every, opts.min_gain
            )));
        }
        let rounds: Arc<Mutex<Vec<Round>>> = Arc::default();
        let stopping = Arc::new(AtomicBool::new(false));
        let mut l = Loop {
            stopping: Arc::clone(&stopping),
            opts,
            handle,
            metrics,
            topology,
            spec,
            served,
        };
        let (stop, stopped) = mpsc::channel::<()>();
        let record = Arc::clone(&rounds);
        let thread = std::thread::Builder::new()
            .name("auto-rebalance".into())
            .spawn(move || {
                let mut last = l.snapshot();
                while matches!(
                    stopped.recv_timeout(l.opts.every),
                    Err(mpsc::RecvTimeoutError::Timeout)
                ) {
                    let now = l.snapshot();
                    let round = match (&last, &now) {
                        (Ok(a), Ok(b)) => l.round(a, b),
                        (Err(e), _) | (_, Err(e)) => Round::Failed { message: e.clone() },
                    };
                    // Too little traffic: the window grows until it has enough. Otherwise
                    // the next window starts after this round (a change's own traffic is not
                    // planned from twice).
                    if !matches!(round, Round::TooLittleTraffic { .. }) {
                        last = l.snapshot();
                    }
                    l.log(&round);
                    let mut kept = record.lock().unwrap_or_else(|e| e.into_inner());
                    if kept.len() == KEPT_ROUNDS {
                        kept.remove(0);
                    }
                    kept.push(round);
                }
            })
            .map_err(FabricError::io("starting the automatic rebalancing thread"))?;
        Ok(Self {
            stop: Some(stop),
            stopping,
            thread: Some(thread),
            rounds,
        })
    }

    /// The last [`KEPT_ROUNDS`] rounds, oldest first.
    pub fn rounds(&self) -> Vec<Round> {
        self.rounds
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

impl Drop for AutoRebalancer {
    fn drop(&mut self) {
        self.stopping.store(true, Ordering::Release);
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Loop {
    fn snapshot(&self) -> Result<LoadStats, String> {
        load_stats(&self.spec, std::slice::from_ref(&self.metrics), None).map_err(|e| e.to_string())
    }

    /// Decides from the window between two snapshots and applies what it decided.
    fn round(&mut self, earlier: &LoadStats, later: &LoadStats) -> Round {
        let w = match window(&self.spec, earlier, later) {
            Ok(w) => w,
            Err(message) => return Round::Failed { message },
        };
        let tokens = w.tokens().unwrap_or(0.0) as u64;
        if tokens < self.opts.min_tokens {
            return Round::TooLittleTraffic { tokens };
        }
        let (planned, predicted_gain) = match decide(
            &self.topology,
            &self.spec,
            &self.served,
            &w,
            self.opts.min_gain,
        ) {
            Ok(d) => d,
            Err(message) => return Round::Failed { message },
        };
        let Some(planned) = planned else {
            return Round::Kept { predicted_gain };
        };
        match self.apply(&planned) {
            Ok((version, loaded, released, steps)) => Round::Applied {
                predicted_gain,
                version,
                loaded,
                released,
                steps,
            },
            Err(message) => Round::Failed { message },
        }
    }

    /// Applies `planned` in the steps that fit memory; the served placement follows each
    /// step applied. Returns (version, loaded, released, steps).
    fn apply(&mut self, planned: &Placement) -> Result<(u64, u32, u32, usize), String> {
        let plan = transition::transition(&self.topology, &self.spec, &self.served, planned)
            .map_err(|e| format!("ordering the change: {e}"))?;
        let (mut version, mut loaded, mut released) = (0, 0, 0);
        let steps = plan.steps.len();
        let shared: Vec<_> = self
            .spec
            .moe_layer_ids()
            .into_iter()
            .map(|l| {
                self.served
                    .shared_location(l)
                    .unwrap_or(expertmesh_topology::placement::SharedLocation::Router)
            })
            .collect();
        for (i, step) in plan.steps.iter().enumerate() {
            if self.stopping.load(Ordering::Acquire) {
                return Err(format!("stopped after step {i} of {steps}"));
            }
            let applied = self
                .handle
                .apply(
                    transition::mesh_entries(&self.topology, &self.spec, &step.owners),
                    self.opts.timeout,
                    Some(&self.stopping),
                )
                .map_err(|e| format!("step {} of {steps}: {e}", i + 1))?;
            version = applied.version;
            loaded += applied.loaded;
            released += applied.released;
            self.served = Placement::new(
                &self.topology,
                &self.spec,
                step.owners.clone(),
                shared.clone(),
                "rebalanced automatically from the routed load",
            )
            .map_err(|p| format!("step {} of {steps} as a placement: {p:?}", i + 1))?;
        }
        Ok((version, loaded, released, steps))
    }

    fn log(&self, round: &Round) {
        match round {
            Round::TooLittleTraffic { tokens } => {
                tracing::debug!(
                    tokens,
                    "automatic rebalancing: too little traffic to plan from"
                )
            }
            Round::Kept { predicted_gain } => tracing::info!(
                predicted_gain,
                min_gain = self.opts.min_gain,
                "automatic rebalancing: the placement stays"
            ),
            Round::Applied {
                predicted_gain,
                version,
                loaded,
                released,
                steps,
            } => tracing::info!(
                predicted_gain,
                version,
                loaded,
                released,
                steps,
                "automatic rebalancing: new placement served"
            ),
            Round::Failed { message } => {
                tracing::warn!("automatic rebalancing: {message}")
            }
        }
    }
}

#[cfg(test)]
mod tests;
