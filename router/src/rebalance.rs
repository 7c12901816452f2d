//! Live placement changes, the coordinating router's side: a sans-IO state machine from a
//! frontend's "apply this placement" to the workers' confirmations.
//!
//! Why this exists: experts are stationary per token, not forever. A new placement (a plan
//! from live load, a device added or drained) must reach a running fabric with no failed and
//! no wrong call. The workers are the truth about what each device holds: a worker announces
//! its set (`Holding`, with a version) when a link comes up and after every change, every
//! router routes by those announcements ([`crate::core::RouterCore::set_holdings`]) and
//! confirms each one (`Seen`), and a worker computes only experts it holds. So a router and a
//! worker cannot disagree silently: a router never sends an expert to a device that did not
//! say it holds it, and a device releases an expert only once every router has seen a set
//! without it (the `Seen` travels behind every dispatch planned on the older set, on the same
//! link, so the worker has run them all by then).
//!
//! One change, in three steps after a survey (every device is asked what it holds, so the
//! change starts from the truth even when an earlier change's announcements are still on
//! their way to this router), each step one placement version:
//! 1. **Load** (version v): each device that gains experts is asked to hold its old set plus
//!    its gains (`Hold`). It loads them while it serves the others (from its host's shards, or
//!    copied from a current owner through a router when its host has none:
//!    `expertmesh_worker::fetch`), checks them (the shard's checksum against the manifest),
//!    and announces the union: from then on every router may
//!    send it the new experts too (they are the same weights as the old owners').
//! 2. **Release** (v + 1), once every gainer has announced and said its union is *settled*
//!    (`Settled`: every router connected to it confirmed the union, so every router already
//!    routes by it; without this wait a router slower to hear the gainer than the loser would
//!    see the lost experts without any owner): each device that loses experts is asked to hold
//!    exactly its new set. It announces that set at once (routers stop choosing it for the
//!    lost experts) and frees them when every router has confirmed.
//! 3. **Applied**: every device announced its new set and said it settled (every router routes
//!    by the new placement); the frontend gets the version and the experts loaded and
//!    released.
//!
//! A gainer that fails to load (no room, a damaged shard, a backend that cannot grow), is lost,
//! or is still loading at the deadline fails the change: every gainer is asked to hold its old
//! set again (v + 1, the undo), and the frontend gets the reason once they have (or at the
//! next deadline). Nothing was released yet, so every expert kept every owner throughout.
//!
//! Apply checks before anything moves: one change at a time; entries name workers, this
//! router's layers and the model's experts; every worker has announced what it holds (a
//! change needs every device connected); and every expert of every layer keeps an owner in
//! the new placement. Memory: a device needs room for its old set and its gains together
//! (the worker refuses otherwise, failing the change); `planner::transition` orders a change
//! that does not fit into steps of such changes.
//!
//! A worker that restarts after a change loads its placement file again (the handshake still
//! checks each process against the fabric's files). This router re-applies the set it last
//! applied to such a device (an announcement of version 0 that differs from it), once per
//! restart; routers that did not coordinate the change, or a restarted coordinator, do not
//! know it, and the device serves its file's set (correctly: routers route by what it
//! announces). To keep a change across restarts, start the whole fabric with the applied
//! placement (`rebalance --out`).

use crate::core::ClientId;
use std::collections::{BTreeSet, VecDeque};
use std::time::{Duration, Instant};

/// One routed expert: (layer, expert).
pub type Expert = (u32, u32);

/// What the driver must do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChangeAction {
    /// Ask worker `rank` what it holds (a `Survey` numbered `nonce`, answered by a `Holding`
    /// carrying it).
    Survey {
        /// The worker's mesh rank.
        rank: u32,
        /// The survey's number.
        nonce: u64,
    },
    /// Send a `Hold` of `experts` at `version` to worker `rank`.
    Hold {
        /// The worker's mesh rank.
        rank: u32,
        /// The placement version of this step.
        version: u64,
        /// Exactly what it must hold, ascending.
        experts: Vec<Expert>,
    },
    /// Answer the frontend: its placement is served at `version`.
    Applied {
        /// The frontend connection.
        client: ClientId,
        /// Its request id.
        request_id: u64,
        /// The version every device announced.
        version: u64,
        /// Experts loaded over every device.
        loaded: u32,
        /// Experts released over every device.
        released: u32,
        /// From the request to the last announcement.
        took: Duration,
        /// Set when the new placement is served but some device did not confirm releasing
        /// what it lost (it was lost, refused, or did not answer in time): which, and why.
        /// Those releases are not counted in `released`.
        unconfirmed: Option<String>,
    },
    /// Answer the frontend: the change failed (every device is back on its old set, or the
    /// message says which did not confirm it).
    Failed {
        /// The frontend connection.
        client: ClientId,
        /// Its request id.
        request_id: u64,
        /// What went wrong and what to do.
        message: String,
    },
}

/// What a worker announced it holds.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Held {
    version: u64,
    experts: BTreeSet<Expert>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Step {
    /// Asking every device what it holds (the survey's number).
    Survey(u64),
    Load,
    Release,
    Undo,
}

/// The change under way.
#[derive(Debug)]
struct Change {
    client: ClientId,
    request_id: u64,
    started: Instant,
    timeout: Duration,
    deadline: Instant,
    step: Step,
    /// The version of the current step.
    version: u64,
    /// Per worker (rank − routers): its set before the change (its survey answer), and its
    /// new one.
    before: Vec<BTreeSet<Expert>>,
    /// Per worker: whether it answered the survey.
    surveyed: Vec<bool>,
    target: Vec<BTreeSet<Expert>>,
    /// Per worker: the set awaited from it in this step (`None`: nothing awaited).
    awaited: Vec<Option<BTreeSet<Expert>>>,
    /// Per worker: it announced the awaited set; the step waits on until it also says the set
    /// is settled (every router connected to it confirmed it).
    announced: Vec<bool>,
    /// Workers asked to load in step 1 (the undo asks them back).
    gainers: Vec<bool>,
    loaded: u32,
    released: u32,
    /// Why the change is being undone.
    failure: Option<String>,
    /// Devices that refused to return to what they held during the undo.
    undo_refused: Vec<String>,
    /// Why devices did not confirm their release (lost, or silent past the deadline): named in
    /// the answer; their experts are not counted as released.
    unconfirmed: Vec<String>,
}

impl Change {
    /// Worker `w` did not confirm its release: what it was to drop is not counted as released.
    fn release_not_done(&mut self, w: usize) {
        let dropped = self.before[w].difference(&self.target[w]).count() as u32;
        self.released = self.released.saturating_sub(dropped);
    }
}

/// The coordinating router's state. See the module docs.
#[derive(Debug)]
pub struct Coordinator {
    routers: u32,
    /// Labels of the mesh ranks (messages).
    names: Vec<String>,
    layers: Vec<u32>,
    experts: u32,
    held: Vec<Option<Held>>,
    change: Option<Change>,
    /// Per worker, the set the last applied change gave it (re-applied to a restarted worker).
    applied: Option<(u64, Vec<BTreeSet<Expert>>)>,
    /// Surveys started (each change's number).
    surveys: u64,
    /// The highest version this coordinator has sent in a `Hold` (a change's next version is
    /// above it too: a hold no device answered, an undo's that timed out say, may still be
    /// taken by its device later, and a new change reusing its version would be refused).
    sent: u64,
    /// Whether this router coordinates changes (router 0 of the fabric).
    coordinates: bool,
    actions: VecDeque<ChangeAction>,
}

impl Coordinator {
    /// A coordinator for a fabric whose mesh ranks are `names` (the first `routers` are the
    /// routers), serving `layers` of a model with `experts` routed experts per layer.
    ///
    /// Only one router of a fabric coordinates (`coordinates`: router 0), so two changes never
    /// overwrite each other's sets; the others refuse a change and name it.
    pub fn new(
        routers: u32,
        names: Vec<String>,
        layers: Vec<u32>,
        experts: u32,
        coordinates: bool,
    ) -> Self {
        let world = names.len();
        Self {
            routers,
            names,
            layers,
            experts,
            held: vec![None; world],
            change: None,
            applied: None,
            surveys: 0,
            sent: 0,
            coordinates,
            actions: VecDeque::new(),
        }
    }

    fn workers(&self) -> usize {
        self.held.len().saturating_sub(self.routers as usize)
    }

    fn name(&self, rank: u32) -> String {
        self.names
            .get(rank as usize)
            .cloned()
            .unwrap_or_else(|| format!("mesh rank {rank}"))
    }

    /// The highest version any worker announced.
    pub fn version(&self) -> u64 {
        self.held
            .iter()
            .flatten()
            .map(|h| h.version)
            .max()
            .unwrap_or(0)
    }

    /// Whether a change is under way.
    pub fn busy(&self) -> bool {
        self.change.is_some()
    }

    /// The next action to take.
    pub fn poll_action(&mut self) -> Option<ChangeAction> {
        self.actions.pop_front()
    }

    /// When [`Coordinator::on_tick`] must run next.
    pub fn next_timeout(&self) -> Option<Instant> {
        self.change.as_ref().map(|c| c.deadline)
    }

    /// Apply the placement `entries` ((mesh rank, layer, expert); every worker of the fabric
    /// is targeted, one without entries is emptied) asked by `client`'s `request_id`, within
    /// `timeout`. The answer comes as an action.
    ///
    /// # Errors
    /// Why the change cannot start (nothing was sent): answer it at once.
    pub fn apply(
        &mut self,
        client: ClientId,
        request_id: u64,
        entries: &[(u32, u32, u32)],
        timeout: Duration,
        now: Instant,
    ) -> Result<(), String> {
        if !self.coordinates {
            return Err(format!(
                "{} coordinates live placement changes (one coordinator, so that two changes \
                 never overwrite each other); send the change to its frontend",
                self.name(0)
            ));
        }
        if self.change.is_some() {
            return Err(
                "a placement change is under way; wait for its answer and try again".into(),
            );
        }
        let (routers, n) = (self.routers, self.workers());
        let mut target = vec![BTreeSet::new(); n];
        for &(rank, layer, expert) in entries {
            if rank < routers || (rank - routers) as usize >= n {
                return Err(format!(
                    "mesh rank {rank} is not a worker of this fabric (workers are {routers}..{})",
                    routers as usize + n
                ));
            }
            if !self.layers.contains(&layer) || expert >= self.experts {
                return Err(format!(
                    "{} is given layer {layer} expert {expert}, which this router does not serve \
                     (layers {:?}, {} experts each)",
                    self.name(rank),
                    self.layers,
                    self.experts
                ));
            }
            target[(rank - routers) as usize].insert((layer, expert));
        }
        if let Some(w) = (0..n).find(|&w| self.held[routers as usize + w].is_none()) {
            return Err(format!(
                "{} has not announced what it holds (not connected): a live change needs every \
                 device connected; start it, or apply a placement without it once it is removed \
                 from the topology",
                self.name(routers + w as u32)
            ));
        }
        for &l in &self.layers {
            for e in 0..self.experts {
                if !target.iter().any(|t| t.contains(&(l, e))) {
                    return Err(format!(
                        "layer {l} expert {e} has no owner in the new placement: every expert needs one"
                    ));
                }
            }
        }
        // Step 0: what every device holds now, asked afresh (an announcement of an earlier
        // change may still be on its way here).
        self.surveys += 1;
        let survey = self.surveys;
        for w in 0..n {
            self.actions.push_back(ChangeAction::Survey {
                rank: routers + w as u32,
                nonce: survey,
            });
        }
        self.change = Some(Change {
            client,
            request_id,
            started: now,
            timeout,
            deadline: now + timeout,
            step: Step::Survey(survey),
            version: 0,
            awaited: vec![None; n],
            announced: vec![false; n],
            gainers: vec![false; n],
            loaded: 0,
            released: 0,
            failure: None,
            unconfirmed: Vec::new(),
            undo_refused: Vec::new(),
            before: vec![BTreeSet::new(); n],
            surveyed: vec![false; n],
            target,
        });
        Ok(())
    }

    /// Every device answered the survey: the load step starts (version one above any
    /// announced or sent).
    fn start_load(&mut self, now: Instant) {
        let (routers, version) = (self.routers, self.version().max(self.sent) + 1);
        let Some(c) = self.change.as_mut() else {
            return;
        };
        c.step = Step::Load;
        c.version = version;
        c.deadline = now + c.timeout;
        let mut holds = Vec::new();
        for w in 0..c.before.len() {
            let union: BTreeSet<Expert> = c.before[w].union(&c.target[w]).copied().collect();
            if union.len() > c.before[w].len() {
                c.loaded += (union.len() - c.before[w].len()) as u32;
                c.gainers[w] = true;
                holds.push((routers + w as u32, union.clone()));
                c.awaited[w] = Some(union);
                c.announced[w] = false;
            }
        }
        for (rank, set) in holds {
            self.hold(rank, version, &set);
        }
        self.advance(now);
    }

    fn hold(&mut self, rank: u32, version: u64, experts: &BTreeSet<Expert>) {
        self.sent = self.sent.max(version);
        self.actions.push_back(ChangeAction::Hold {
            rank,
            version,
            experts: experts.iter().copied().collect(),
        });
    }

    /// Worker `rank` announced it holds `experts` at `version`; `message` is why it refused
    /// or failed a `Hold` (empty when it did not); `survey` is the survey it answers (0: none).
    pub fn on_holding(
        &mut self,
        rank: u32,
        version: u64,
        experts: &[Expert],
        message: &str,
        survey: u64,
        now: Instant,
    ) {
        let Some(slot) = self.held.get_mut(rank as usize) else {
            return;
        };
        let set: BTreeSet<Expert> = experts.iter().copied().collect();
        *slot = Some(Held {
            version,
            experts: set.clone(),
        });
        let Some(w) = rank.checked_sub(self.routers).map(|w| w as usize) else {
            return;
        };
        let name = self.name(rank);
        let Some(c) = self.change.as_mut() else {
            // A restarted worker (version 0) back on its placement file: give it what the
            // last change gave it, once.
            if let Some((v, sets)) = &self.applied
                && version == 0
                && message.is_empty()
                && sets.get(w).is_some_and(|s| *s != set)
            {
                let (v, target) = (*v, sets[w].clone());
                tracing::warn!(
                    worker = %name,
                    version = v,
                    "a restarted worker announced its placement file's experts; re-applying the last change's set"
                );
                self.hold(rank, v, &target);
            }
            return;
        };
        if let Step::Survey(n) = c.step {
            if n == survey && survey != 0 && w < c.before.len() {
                c.before[w] = set;
                c.surveyed[w] = true;
                if c.surveyed.iter().all(|&s| s) {
                    self.start_load(now);
                }
            }
            return;
        }
        let Some(want) = c.awaited.get(w).cloned().flatten() else {
            return;
        };
        if !message.is_empty() && version >= c.version {
            let why = format!("{name}: {message}");
            c.awaited[w] = None;
            if c.step == Step::Release {
                c.release_not_done(w); // refused: named in the answer
            }
            self.fail(why, now);
        } else if version >= c.version {
            // (An older announcement, a stale hold's refusal say, changes nothing here.)
            c.announced[w] = set == want;
        }
        self.advance(now);
    }

    /// Worker `rank` says every router connected to it confirmed its set of `version`: no
    /// router routes by an older set of it any more. A step waits for this from every device
    /// it asked, after their announcements: so a release never starts while another router
    /// still routes by a gainer's set without its gains (an expert would have no owner there).
    pub fn on_settled(&mut self, rank: u32, version: u64, now: Instant) {
        let Some(w) = rank.checked_sub(self.routers).map(|w| w as usize) else {
            return;
        };
        let Some(c) = self.change.as_mut() else {
            return;
        };
        if matches!(c.step, Step::Survey(_)) || version < c.version {
            return;
        }
        if c.announced.get(w) == Some(&true) && c.awaited[w].is_some() {
            c.awaited[w] = None;
            self.advance(now);
        }
    }

    /// The link to worker `rank` was lost: what it holds is unknown until it announces again.
    pub fn on_peer_lost(&mut self, rank: u32, now: Instant) {
        let Some(slot) = self.held.get_mut(rank as usize) else {
            return;
        };
        *slot = None;
        let Some(w) = rank.checked_sub(self.routers).map(|w| w as usize) else {
            return;
        };
        let name = self.name(rank);
        let Some(c) = self.change.as_mut() else {
            return;
        };
        if matches!(c.step, Step::Survey(_)) {
            let c = self.change.take().expect("matched above");
            self.actions.push_back(ChangeAction::Failed {
                client: c.client,
                request_id: c.request_id,
                message: format!("{name} was lost before the change started; nothing moved"),
            });
            return;
        }
        let settled_gainer = matches!(c.step, Step::Load)
            && c.gainers.get(w) == Some(&true)
            && c.awaited.get(w).is_some_and(Option::is_none);
        let releasing_gainer = c.step == Step::Release && c.gainers.get(w) == Some(&true);
        if settled_gainer {
            // Its gains went with it: a release after this step would leave an expert whose
            // only new owner it was without any (and a restarted worker comes back on its
            // placement file, without them).
            self.fail(
                format!("{name} was lost after loading its gains (they went with it)"),
                now,
            );
        } else if c.awaited.get(w).is_some_and(Option::is_some) {
            c.awaited[w] = None;
            match c.step {
                Step::Load => self.fail(format!("{name} was lost while loading its gains"), now),
                // The new placement is served (every gain was confirmed before any release):
                // the change is applied, but this device's release is not counted as done.
                Step::Release => {
                    c.release_not_done(w);
                    c.unconfirmed
                        .push(format!("{name} was lost before confirming it"));
                }
                Step::Undo => {
                    let why = c.failure.take().unwrap_or_default();
                    c.failure = Some(format!(
                        "{why}; and {name} was lost before it confirmed its return to the old set"
                    ));
                }
                Step::Survey(_) => {}
            }
        }
        if releasing_gainer {
            self.keep_lost_gains(w, &name, now);
        }
        self.advance(now);
    }

    /// Release step: gainer `g` (`name`) was lost. Its gains that no other connected device
    /// holds in the new placement would have no owner once their old owners release them: the
    /// old owners keep them (their new set and those experts, at a new version; every device
    /// still awaited is asked again at that version, since the step waits for one version).
    fn keep_lost_gains(&mut self, g: usize, name: &str, now: Instant) {
        let routers = self.routers as usize;
        let connected: Vec<bool> = self.held[routers..].iter().map(Option::is_some).collect();
        let Some(c) = self.change.as_mut() else {
            return;
        };
        let orphans: BTreeSet<Expert> = c.target[g]
            .difference(&c.before[g])
            .filter(|e| {
                !(0..c.target.len())
                    .any(|w| w != g && connected.get(w) == Some(&true) && c.target[w].contains(e))
            })
            .copied()
            .collect();
        let mut kept = 0usize;
        let mut keepers = Vec::new();
        for w in 0..c.before.len() {
            if w == g || connected.get(w) != Some(&true) {
                continue;
            }
            let keep: Vec<Expert> = c.before[w]
                .intersection(&orphans)
                .filter(|e| !c.target[w].contains(e))
                .copied()
                .collect();
            if !keep.is_empty() {
                kept += keep.len();
                c.released = c.released.saturating_sub(keep.len() as u32);
                c.target[w].extend(keep);
                keepers.push(w);
            }
        }
        if keepers.is_empty() {
            return;
        }
        c.version += 1;
        c.deadline = now + c.timeout;
        let version = c.version;
        let mut holds = Vec::new();
        for w in 0..c.before.len() {
            if keepers.contains(&w) || c.awaited[w].is_some() {
                c.awaited[w] = Some(c.target[w].clone());
                c.announced[w] = false;
                holds.push((self.routers + w as u32, c.target[w].clone()));
            }
        }
        c.unconfirmed.push(format!(
            "{name} was lost during the release: {kept} of its gains stay with their previous \
             owners (it was their only new owner)"
        ));
        for (rank, set) in holds {
            self.hold(rank, version, &set);
        }
    }

    /// Past the deadline of the step under way: a load still waited for fails the change; a
    /// release or an undo still waited for is answered with the devices that did not confirm.
    pub fn on_tick(&mut self, now: Instant) {
        let Some(c) = self.change.as_ref() else {
            return;
        };
        if now < c.deadline {
            return;
        }
        let late: Vec<String> = c
            .awaited
            .iter()
            .enumerate()
            .filter(|(_, a)| a.is_some())
            .map(|(w, _)| self.name(self.routers + w as u32))
            .collect();
        let (step, timeout) = (c.step, c.timeout);
        if matches!(step, Step::Survey(_)) {
            let late: Vec<String> = c
                .surveyed
                .iter()
                .enumerate()
                .filter(|(_, s)| !**s)
                .map(|(w, _)| self.name(self.routers + w as u32))
                .collect();
            let c = self.change.take().expect("checked above");
            self.actions.push_back(ChangeAction::Failed {
                client: c.client,
                request_id: c.request_id,
                message: format!(
                    "{} did not say what they hold within {timeout:?}; nothing moved",
                    late.join(", ")
                ),
            });
            return;
        }
        match step {
            Step::Load => self.fail(
                format!(
                    "timed out after {timeout:?} waiting for {} to load their gains and for every \
                     router to confirm them",
                    late.join(", ")
                ),
                now,
            ),
            Step::Survey(_) => unreachable!("answered above"),
            // The new placement is served (every gain was confirmed before any release): the
            // change is applied; the releases not confirmed are named and not counted.
            Step::Release => {
                let c = self.change.as_mut().expect("checked above");
                for w in 0..c.awaited.len() {
                    if c.awaited[w].take().is_some() {
                        c.release_not_done(w);
                    }
                }
                c.unconfirmed.push(format!(
                    "{} did not confirm it within {timeout:?}",
                    late.join(", ")
                ));
                self.finish_release(now);
            }
            Step::Undo => {
                let c = self.change.take().expect("checked above");
                let refused = if c.undo_refused.is_empty() {
                    String::new()
                } else {
                    format!(
                        "; and some refused to go back to what they held ({})",
                        c.undo_refused.join("; ")
                    )
                };
                self.actions.push_back(ChangeAction::Failed {
                    client: c.client,
                    request_id: c.request_id,
                    message: format!(
                        "{}; and {} did not confirm their return to the old set within \
                         {timeout:?}{refused}",
                        c.failure.unwrap_or_default(),
                        late.join(", ")
                    ),
                });
            }
        }
    }

    /// Answers the change whose release step is over: applied (every gain was confirmed
    /// before any release, so the new placement is served), naming the devices that did not
    /// confirm their release or refused it.
    fn finish_release(&mut self, now: Instant) {
        let Some(mut c) = self.change.take() else {
            return;
        };
        c.unconfirmed.extend(c.failure.take());
        let unconfirmed = (!c.unconfirmed.is_empty()).then(|| {
            format!(
                "the new placement (version {}) is served, but not every release was confirmed: \
                 {} (a device that still holds experts it lost only uses memory; routers route \
                 by what it announces)",
                c.version,
                c.unconfirmed.join("; ")
            )
        });
        self.applied = Some((c.version, c.target));
        self.actions.push_back(ChangeAction::Applied {
            client: c.client,
            request_id: c.request_id,
            version: c.version,
            loaded: c.loaded,
            released: c.released,
            took: now.saturating_duration_since(c.started),
            unconfirmed,
        });
    }

    /// Fail the change during its load: every gainer is asked back to its old set.
    fn fail(&mut self, why: String, now: Instant) {
        let routers = self.routers;
        let Some(c) = self.change.as_mut() else {
            return;
        };
        if c.step == Step::Undo {
            // A device that refused to go back: the answer must not say it is back.
            c.undo_refused.push(why);
            return;
        }
        if c.step != Step::Load {
            // A release cannot be undone (the new owners serve already); say so at the end.
            c.failure.get_or_insert(why);
            return;
        }
        c.step = Step::Undo;
        c.version += 1;
        c.deadline = now + c.timeout;
        c.failure = Some(why);
        let version = c.version;
        let mut holds = Vec::new();
        let mut gone = Vec::new();
        for w in 0..c.before.len() {
            if c.gainers[w] && self.held[routers as usize + w].is_some() {
                c.awaited[w] = Some(c.before[w].clone());
                c.announced[w] = false;
                holds.push((routers + w as u32, c.before[w].clone()));
            } else {
                if c.gainers[w] {
                    gone.push(
                        self.names
                            .get(routers as usize + w)
                            .cloned()
                            .unwrap_or_default(),
                    );
                }
                c.awaited[w] = None;
            }
        }
        if !gone.is_empty() {
            let why = c.failure.take().unwrap_or_default();
            c.failure = Some(format!(
                "{why} ({} not connected: when it returns it announces what it holds, and routers \
                 route by that)",
                gone.join(", ")
            ));
        }
        for (rank, set) in holds {
            self.hold(rank, version, &set);
        }
    }

    /// Moves to the next step when nothing is awaited in this one.
    fn advance(&mut self, now: Instant) {
        let routers = self.routers;
        let Some(c) = self.change.as_mut() else {
            return;
        };
        if c.awaited.iter().any(Option::is_some) {
            return;
        }
        match c.step {
            Step::Survey(_) => {}
            Step::Load => {
                c.step = Step::Release;
                c.version += 1;
                c.deadline = now + c.timeout;
                let version = c.version;
                let mut holds = Vec::new();
                for w in 0..c.before.len() {
                    let union: BTreeSet<Expert> =
                        c.before[w].union(&c.target[w]).copied().collect();
                    if union.len() > c.target[w].len() {
                        c.released += (union.len() - c.target[w].len()) as u32;
                        c.awaited[w] = Some(c.target[w].clone());
                        c.announced[w] = false;
                        holds.push((routers + w as u32, c.target[w].clone()));
                    }
                }
                for (rank, set) in holds {
                    self.hold(rank, version, &set);
                }
                self.advance(now);
            }
            Step::Release => self.finish_release(now),
            Step::Undo => {
                let c = self.change.take().expect("matched above");
                let message = if c.undo_refused.is_empty() {
                    format!(
                        "the placement change failed and was undone (every connected device is \
                         back on what it held): {}",
                        c.failure.unwrap_or_default()
                    )
                } else {
                    format!(
                        "the placement change failed: {}; undoing it, some devices refused to go \
                         back to what they held ({}): they serve what they announced, and routers \
                         route by that",
                        c.failure.unwrap_or_default(),
                        c.undo_refused.join("; ")
                    )
                };
                self.actions.push_back(ChangeAction::Failed {
                    client: c.client,
                    request_id: c.request_id,
                    message,
                });
            }
        }
    }
}

#[cfg(test)]
mod tests;
