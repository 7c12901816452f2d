//! The coordinator against simulated workers that load, fail or vanish, and a second router
//! that hears the workers' announcements late and in any order across workers: every expert
//! keeps an announced owner at every step in both routers' views, and a change ends on the new
//! sets (applied) or the old ones (failed and undone), never between.

use super::*;
use proptest::prelude::*;
use std::collections::BTreeMap;

const ROUTERS: u32 = 1;
const LAYERS: [u32; 2] = [1, 2];

fn coordinator(workers: usize, experts: u32) -> Coordinator {
    let names = (0..ROUTERS as usize + workers)
        .map(|r| format!("rank{r}"))
        .collect();
    Coordinator::new(ROUTERS, names, LAYERS.to_vec(), experts, true)
}

/// An announcement on its way to the second router: (worker rank, version, set, whether the
/// worker settles it once this router confirms it).
type Announcement = (u32, u64, BTreeSet<Expert>, bool);

/// Simulated workers: what each announced, and how each answers a hold.
struct Fabric {
    now: Instant,
    /// What each worker announced, as the coordinating router hears it (at once).
    held: BTreeMap<u32, (u64, BTreeSet<Expert>)>,
    /// The same as the second router hears it: late, per worker in order.
    other: BTreeMap<u32, (u64, BTreeSet<Expert>)>,
    in_flight: VecDeque<Announcement>,
    /// Which worker's oldest announcement the second router hears next (indices into the
    /// workers with one in flight, used in turn; empty: the last such worker).
    order: Vec<usize>,
    turn: usize,
    /// Ranks that refuse any hold that adds experts.
    refuse_gains: BTreeSet<u32>,
    /// Ranks that refuse any hold that only drops experts (a release, an undo of gains).
    refuse_drops: BTreeSet<u32>,
    /// The last hold each rank was sent.
    last_hold: BTreeMap<u32, BTreeSet<Expert>>,
    /// Ranks that never answer a hold.
    silent: BTreeSet<u32>,
    /// Ranks that never answer a hold that only drops experts (a release).
    silent_releases: BTreeSet<u32>,
    answers: Vec<ChangeAction>,
    experts: u32,
}

impl Fabric {
    fn new(c: &mut Coordinator, sets: &[BTreeSet<Expert>], experts: u32) -> Self {
        let now = Instant::now();
        let mut f = Self {
            now,
            held: BTreeMap::new(),
            other: BTreeMap::new(),
            in_flight: VecDeque::new(),
            order: Vec::new(),
            turn: 0,
            refuse_gains: BTreeSet::new(),
            refuse_drops: BTreeSet::new(),
            last_hold: BTreeMap::new(),
            silent: BTreeSet::new(),
            silent_releases: BTreeSet::new(),
            answers: Vec::new(),
            experts,
        };
        for (w, s) in sets.iter().enumerate() {
            let rank = ROUTERS + w as u32;
            f.held.insert(rank, (0, s.clone()));
            f.other.insert(rank, (0, s.clone()));
            let list: Vec<Expert> = s.iter().copied().collect();
            c.on_holding(rank, 0, &list, "", 0, now);
        }
        f
    }

    /// The message of the one answer, which must be `Failed`.
    fn failed(&self) -> &str {
        match &self.answers[..] {
            [ChangeAction::Failed { message, .. }] => message,
            other => panic!("{other:?}"),
        }
    }

    /// Every expert of every layer has an announced owner in both routers' views.
    fn covered(&self) -> bool {
        [&self.held, &self.other].iter().all(|view| {
            LAYERS.iter().all(|&l| {
                (0..self.experts).all(|e| view.values().any(|(_, s)| s.contains(&(l, e))))
            })
        })
    }

    /// The second router hears one announcement (the oldest of the worker `order` picks) and
    /// confirms it; the worker says it settled when it was a change.
    fn deliver(&mut self, c: &mut Coordinator) {
        let mut ranks: Vec<u32> = self.in_flight.iter().map(|a| a.0).collect();
        ranks.sort_unstable();
        ranks.dedup();
        let pick = match self.order.get(self.turn % self.order.len().max(1)) {
            Some(&i) => ranks[i % ranks.len()],
            None => *ranks.last().expect("called with one in flight"),
        };
        self.turn += 1;
        let at = self
            .in_flight
            .iter()
            .position(|a| a.0 == pick)
            .expect("picked from those in flight");
        let (rank, version, set, settles) = self.in_flight.remove(at).expect("found above");
        self.other.insert(rank, (version, set));
        if settles {
            c.on_settled(rank, version, self.now);
        }
    }

    /// Runs the coordinator's actions until it has none and the second router heard every
    /// announcement, answering holds.
    fn run(&mut self, c: &mut Coordinator) {
        loop {
            assert!(self.covered(), "an expert lost its last owner");
            let Some(a) = c.poll_action() else {
                if self.in_flight.is_empty() {
                    break;
                }
                self.deliver(c);
                continue;
            };
            match a {
                ChangeAction::Survey { rank, nonce } => {
                    let (version, set) = self.held[&rank].clone();
                    let list: Vec<Expert> = set.iter().copied().collect();
                    c.on_holding(rank, version, &list, "", nonce, self.now);
                }
                ChangeAction::Hold {
                    rank,
                    version,
                    experts,
                } => {
                    let set: BTreeSet<Expert> = experts.iter().copied().collect();
                    self.last_hold.insert(rank, set.clone());
                    if self.silent.contains(&rank) {
                        continue;
                    }
                    let old = self.held[&rank].1.clone();
                    if self.silent_releases.contains(&rank) && set.is_subset(&old) && set != old {
                        continue;
                    }
                    let drops_only = set.is_subset(&old) && set != old;
                    if (self.refuse_gains.contains(&rank) && !set.is_subset(&old))
                        || (self.refuse_drops.contains(&rank) && drops_only)
                    {
                        let list: Vec<Expert> = old.iter().copied().collect();
                        self.in_flight.push_back((rank, version, old, false));
                        c.on_holding(rank, version, &list, "no room", 0, self.now);
                        continue;
                    }
                    self.held.insert(rank, (version, set.clone()));
                    self.in_flight.push_back((rank, version, set, true));
                    c.on_holding(rank, version, &experts, "", 0, self.now);
                }
                done => self.answers.push(done),
            }
        }
        assert!(self.covered(), "an expert lost its last owner");
    }
}

fn sets(lists: &[&[u32]]) -> Vec<BTreeSet<Expert>> {
    lists
        .iter()
        .map(|l| {
            LAYERS
                .iter()
                .flat_map(|&layer| l.iter().map(move |&e| (layer, e)))
                .collect()
        })
        .collect()
}

fn entries(s: &[BTreeSet<Expert>]) -> Vec<(u32, u32, u32)> {
    s.iter()
        .enumerate()
        .flat_map(|(w, set)| set.iter().map(move |&(l, e)| (ROUTERS + w as u32, l, e)))
        .collect()
}

const T: Duration = Duration::from_secs(30);

#[test]
fn a_swap_loads_first_releases_after_and_answers_with_the_counts() {
    let mut c = coordinator(2, 4);
    let before = sets(&[&[0, 1], &[2, 3]]);
    let target = sets(&[&[2, 3], &[0, 1]]);
    let mut f = Fabric::new(&mut c, &before, 4);
    c.apply(7, 9, &entries(&target), T, f.now).unwrap();
    // Step 0 asks every device what it holds; an announcement that is not the survey's
    // answer (an earlier one still on its way) does not count.
    let surveys: Vec<ChangeAction> = std::iter::from_fn(|| c.poll_action()).collect();
    assert_eq!(surveys.len(), 2);
    assert!(matches!(
        surveys[0],
        ChangeAction::Survey { rank: 1, nonce: 1 }
    ));
    let stale: Vec<Expert> = target[0].iter().copied().collect();
    c.on_holding(ROUTERS, 0, &stale, "", 0, f.now);
    assert!(c.poll_action().is_none());
    for a in surveys {
        let ChangeAction::Survey { rank, nonce } = a else {
            unreachable!()
        };
        let (version, set) = f.held[&rank].clone();
        let list: Vec<Expert> = set.iter().copied().collect();
        c.on_holding(rank, version, &list, "", nonce, f.now);
    }
    // Step 1 asks both for the union, at one version above what they announced.
    let first: Vec<ChangeAction> = std::iter::from_fn(|| c.poll_action()).collect();
    assert_eq!(first.len(), 2);
    for a in &first {
        let ChangeAction::Hold {
            version, experts, ..
        } = a
        else {
            panic!("{a:?}")
        };
        assert_eq!((*version, experts.len()), (1, 8));
    }
    for a in first {
        c.actions.push_back(a);
    }
    f.run(&mut c);
    assert_eq!(
        f.answers,
        vec![ChangeAction::Applied {
            client: 7,
            request_id: 9,
            version: 2,
            loaded: 8,
            released: 8,
            took: Duration::ZERO,
            unconfirmed: None,
        }]
    );
    for (w, t) in target.iter().enumerate() {
        assert_eq!(&f.held[&(ROUTERS + w as u32)].1, t);
    }
    assert!(!c.busy());
    assert_eq!(c.version(), 2);
}

#[test]
fn a_release_waits_until_every_gainer_says_every_router_routes_by_its_gains() {
    let mut c = coordinator(2, 2);
    let before = sets(&[&[0], &[1]]);
    let target = sets(&[&[1], &[0]]);
    let f = Fabric::new(&mut c, &before, 2);
    c.apply(1, 1, &entries(&target), T, f.now).unwrap();
    // Every device answers the survey and loads its gains; no router has confirmed them yet.
    let mut unions = Vec::new();
    while let Some(a) = c.poll_action() {
        match a {
            ChangeAction::Survey { rank, nonce } => {
                let list: Vec<Expert> = f.held[&rank].1.iter().copied().collect();
                c.on_holding(rank, 0, &list, "", nonce, f.now);
            }
            ChangeAction::Hold {
                rank,
                version,
                experts,
            } => {
                assert_eq!(version, 1);
                c.on_holding(rank, version, &experts, "", 0, f.now);
                unions.push(rank);
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(unions, [ROUTERS, ROUTERS + 1]);
    // One gainer settled, the other settled only an older version: no release yet.
    c.on_settled(ROUTERS + 1, 1, f.now);
    c.on_settled(ROUTERS, 0, f.now);
    assert_eq!(c.poll_action(), None);
    // A settle before the announcement does not count either (a restarted link's).
    c.on_settled(ROUTERS, 1, f.now);
    let releases: Vec<ChangeAction> = std::iter::from_fn(|| c.poll_action()).collect();
    assert_eq!(releases.len(), 2, "{releases:?}");
    for (w, a) in releases.iter().enumerate() {
        let want: Vec<Expert> = target[w].iter().copied().collect();
        assert_eq!(
            a,
            &ChangeAction::Hold {
                rank: ROUTERS + w as u32,
                version: 2,
                experts: want
            }
        );
    }
}

#[test]
fn a_gainer_that_refuses_undoes_the_change_and_nothing_is_released() {
    let mut c = coordinator(3, 4);
    let before = sets(&[&[0, 1], &[2, 3], &[0, 1, 2, 3]]);
    let target = sets(&[&[0, 1, 2], &[2, 3, 0], &[1, 3]]);
    let mut f = Fabric::new(&mut c, &before, 4);
    f.refuse_gains.insert(ROUTERS + 1);
    c.apply(1, 2, &entries(&target), T, f.now).unwrap();
    f.run(&mut c);
    let message = f.failed();
    assert!(
        message.contains("rank2: no room") && message.contains("undone"),
        "{message}"
    );
    for (w, b) in before.iter().enumerate() {
        assert_eq!(&f.held[&(ROUTERS + w as u32)].1, b, "worker {w}");
    }
    // The next change starts above the undo's version.
    assert_eq!(c.version(), 2);
}

/// Two workers (0-1 and 2-3 on both layers) asked to move to 0-1-2 and 3-0, with `tweak`
/// applied to the simulated workers first, run until the coordinator waits: (coordinator,
/// workers, sets before, target sets).
fn two_worker_change(
    tweak: impl FnOnce(&mut Fabric) -> bool,
) -> (
    Coordinator,
    Fabric,
    Vec<BTreeSet<Expert>>,
    Vec<BTreeSet<Expert>>,
) {
    let mut c = coordinator(2, 4);
    let before = sets(&[&[0, 1], &[2, 3]]);
    let target = sets(&[&[0, 1, 2], &[3, 0]]);
    let mut f = Fabric::new(&mut c, &before, 4);
    tweak(&mut f);
    c.apply(1, 2, &entries(&target), T, f.now).unwrap();
    f.run(&mut c);
    (c, f, before, target)
}

/// A device lost before it confirmed a release: the new placement is served (every gain was
/// confirmed first), so the change is applied, but the release it never confirmed is not
/// counted as done.
#[test]
fn a_device_lost_during_the_release_is_not_counted_as_released() {
    let (mut c, mut f, _, _) = two_worker_change(|f| f.silent_releases.insert(ROUTERS + 1));
    assert!(f.answers.is_empty(), "waiting for the release");
    c.on_peer_lost(ROUTERS + 1, f.now);
    f.run(&mut c);
    let [
        ChangeAction::Applied {
            released, loaded, ..
        },
    ] = &f.answers[..]
    else {
        panic!("{:?}", f.answers)
    };
    // Expert 2 of both layers was rank2's to release; rank1 released nothing.
    assert_eq!((*loaded, *released), (4, 0), "{:?}", f.answers);
    let ChangeAction::Applied { unconfirmed, .. } = &f.answers[0] else {
        unreachable!()
    };
    let why = unconfirmed.as_deref().unwrap_or_default();
    assert!(why.contains("rank2 was lost"), "{why}");
    assert!(!c.busy());
}

/// A device silent past the release step's deadline, or one refusing its release: the new
/// placement is served (every gain was confirmed first), so the answer is Applied, naming the
/// device, with its release not counted; and the applied sets are what a restarted worker is
/// given again (a Failed answer told callers the change was not served).
#[test]
fn a_release_not_confirmed_in_time_or_refused_still_answers_applied() {
    for refuse in [false, true] {
        let (mut c, mut f, before, target) =
            two_worker_change(|f| f.silent_releases.insert(ROUTERS + 1));
        assert!(f.answers.is_empty(), "waiting for the release");
        if refuse {
            let held: Vec<Expert> = f.held[&(ROUTERS + 1)].1.iter().copied().collect();
            // The release step is version 2 (the load was 1).
            c.on_holding(ROUTERS + 1, 2, &held, "cannot free", 0, f.now);
        } else {
            c.on_tick(f.now + 3 * T);
        }
        f.run(&mut c);
        let [
            ChangeAction::Applied {
                loaded,
                released,
                unconfirmed,
                ..
            },
        ] = &f.answers[..]
        else {
            panic!("refuse {refuse}: {:?}", f.answers)
        };
        assert_eq!((*loaded, *released), (4, 0), "refuse {refuse}");
        let why = unconfirmed.as_deref().unwrap_or_default();
        let named = if refuse {
            "rank2: cannot free"
        } else {
            "rank2 did not confirm"
        };
        assert!(why.contains(named), "refuse {refuse}: {why}");
        assert!(!c.busy());
        // Worker 0 restarts on its file's set: it is given the applied set again.
        let list: Vec<Expert> = before[0].iter().copied().collect();
        c.on_holding(ROUTERS, 0, &list, "", 0, f.now);
        let want: Vec<Expert> = target[0].iter().copied().collect();
        assert!(
            matches!(c.poll_action(), Some(ChangeAction::Hold { rank: ROUTERS, experts, .. }) if experts == want),
            "refuse {refuse}"
        );
    }
}

#[test]
fn a_lost_or_silent_gainer_fails_the_change_and_the_others_return() {
    for lost in [true, false] {
        let (mut c, mut f, before, _) = two_worker_change(|f| f.silent.insert(ROUTERS + 1));
        assert!(f.answers.is_empty());
        if lost {
            // (Its announced set stays in `f.held`: coverage here is about what the
            // coordinator asks, not about a device that died.)
            c.on_peer_lost(ROUTERS + 1, f.now);
        } else {
            c.on_tick(f.now + T - Duration::from_millis(1));
            assert!(c.busy());
            c.on_tick(f.now + T);
            // The silent one is asked back too, and the undo waits for it until its own
            // deadline.
            f.run(&mut c);
            assert!(f.answers.is_empty());
            c.on_tick(f.now + 2 * T);
        }
        f.run(&mut c);
        let message = f.failed();
        let why = if lost { "was lost" } else { "timed out" };
        assert!(
            message.contains(why) && message.contains("rank2"),
            "{message}"
        );
        // A lost gainer cannot be asked back: the answer says so.
        assert_eq!(message.contains("rank2 not connected"), lost, "{message}");
        assert_eq!(f.held[&ROUTERS].1, before[0]);
        assert!(!c.busy());
    }
}

/// A gainer lost after it loaded and settled its gains, while another still loads: the
/// change is undone, not carried on to the release (a loser would drop an expert whose only
/// new owner was the lost device).
#[test]
fn a_gainer_lost_after_settling_its_gains_fails_the_change() {
    let (mut c, mut f, before, _) = two_worker_change(|f| f.silent.insert(ROUTERS + 1));
    assert!(f.answers.is_empty() && c.busy(), "rank2 still loads");
    c.on_peer_lost(ROUTERS, f.now);
    f.run(&mut c);
    // The undo asks rank2 back, which is silent: answered at its deadline.
    c.on_tick(f.now + 2 * T);
    f.run(&mut c);
    let message = f.failed();
    assert!(
        message.contains("rank1 was lost after loading its gains"),
        "{message}"
    );
    assert_eq!(f.held[&(ROUTERS + 1)].1, before[1], "nothing was released");
    assert!(!c.busy());
}

/// A device that refuses to go back during an undo is named, and the answer does not say
/// every device is back on what it held: the undo ended by the others' answers (rank2 lost,
/// not asked back) or by its deadline (rank2 silent).
#[test]
fn an_undo_a_device_refuses_is_named_in_the_answer() {
    for lost in [true, false] {
        let (mut c, mut f, _, _) = two_worker_change(|f| {
            f.silent.insert(ROUTERS + 1);
            f.refuse_drops.insert(ROUTERS)
        });
        if lost {
            c.on_peer_lost(ROUTERS + 1, f.now);
        } else {
            c.on_tick(f.now + T);
        }
        f.run(&mut c);
        c.on_tick(f.now + 2 * T);
        f.run(&mut c);
        let message = f.failed();
        assert!(
            message.contains("refused to go back") && message.contains("rank1: no room"),
            "{lost}: {message}"
        );
        assert!(
            !message.contains("every connected device is back"),
            "{message}"
        );
        assert!(!c.busy());
    }
}

/// A gainer lost during the release: the gains it alone was to own stay with their previous
/// owners (asked to keep them, at a new version), and the answer says so.
#[test]
fn a_gainer_lost_during_the_release_leaves_its_gains_with_their_old_owners() {
    // rank1 gains expert 2 from rank2, whose release waits (it does not answer drops).
    let (mut c, mut f, _, _) = two_worker_change(|f| f.silent_releases.insert(ROUTERS + 1));
    assert!(
        f.answers.is_empty() && c.busy(),
        "rank2's release under way"
    );
    let release = f.last_hold[&(ROUTERS + 1)].clone();
    assert!(
        LAYERS.iter().all(|&l| !release.contains(&(l, 2))),
        "{release:?}"
    );
    c.on_peer_lost(ROUTERS, f.now);
    f.run(&mut c);
    let keep = &f.last_hold[&(ROUTERS + 1)];
    assert!(LAYERS.iter().all(|&l| keep.contains(&(l, 2))), "{keep:?}");
    let [
        ChangeAction::Applied {
            unconfirmed,
            released,
            ..
        },
    ] = &f.answers[..]
    else {
        panic!("{:?}", f.answers)
    };
    let why = unconfirmed.as_deref().unwrap_or_default();
    assert!(why.contains("rank1 was lost during the release"), "{why}");
    assert_eq!(*released, 0, "expert 2 was kept");
    assert!(!c.busy());
}

#[test]
fn a_device_lost_or_silent_during_the_survey_fails_the_change_before_anything_moves() {
    for lost in [true, false] {
        let mut c = coordinator(2, 4);
        let before = sets(&[&[0, 1], &[2, 3]]);
        let f = Fabric::new(&mut c, &before, 4);
        c.apply(1, 2, &entries(&sets(&[&[2, 3], &[0, 1]])), T, f.now)
            .unwrap();
        // Only worker 1 answers.
        while let Some(a) = c.poll_action() {
            if let ChangeAction::Survey { rank: 1, nonce } = a {
                let list: Vec<Expert> = before[0].iter().copied().collect();
                c.on_holding(1, 0, &list, "", nonce, f.now);
            }
        }
        if lost {
            c.on_peer_lost(2, f.now);
        } else {
            c.on_tick(f.now + T);
        }
        let Some(ChangeAction::Failed { message, .. }) = c.poll_action() else {
            panic!("no answer")
        };
        assert!(
            message.contains("rank2") && message.contains("nothing moved"),
            "{message}"
        );
        assert!(c.poll_action().is_none() && !c.busy());
    }
}

#[test]
fn a_change_that_cannot_start_says_why_and_sends_nothing() {
    let mut c = coordinator(2, 4);
    let before = sets(&[&[0, 1], &[2, 3]]);
    let f = Fabric::new(&mut c, &before, 4);
    let ok = entries(&sets(&[&[0, 1, 2], &[2, 3]]));
    type Case = (Vec<(u32, u32, u32)>, &'static str);
    let cases: Vec<Case> = vec![
        (vec![(0, 1, 0)], "not a worker"),
        (vec![(3, 1, 0)], "not a worker"),
        ([ok.clone(), vec![(1, 9, 0)]].concat(), "does not serve"),
        ([ok.clone(), vec![(1, 1, 4)]].concat(), "does not serve"),
        (entries(&sets(&[&[0, 1], &[2]])), "expert 3 has no owner"),
    ];
    for (e, want) in cases {
        let err = c.apply(1, 1, &e, T, f.now).unwrap_err();
        assert!(err.contains(want), "{err}");
        assert!(c.poll_action().is_none());
    }
    c.on_peer_lost(ROUTERS, f.now);
    let err = c.apply(1, 1, &ok, T, f.now).unwrap_err();
    assert!(err.contains("rank1 has not announced"), "{err}");
    let list: Vec<Expert> = before[0].iter().copied().collect();
    c.on_holding(ROUTERS, 0, &list, "", 0, f.now);
    c.apply(1, 1, &ok, T, f.now).unwrap();
    let err = c.apply(1, 2, &ok, T, f.now).unwrap_err();
    assert!(err.contains("under way"), "{err}");
}

#[test]
fn a_worker_restarted_on_its_placement_file_gets_the_applied_set_again() {
    let mut c = coordinator(2, 2);
    let before = sets(&[&[0], &[1]]);
    let target = sets(&[&[1], &[0]]);
    let mut f = Fabric::new(&mut c, &before, 2);
    c.apply(1, 1, &entries(&target), T, f.now).unwrap();
    f.run(&mut c);
    assert!(matches!(f.answers[..], [ChangeAction::Applied { .. }]));
    // Worker 0 restarts: version 0, its file's set.
    let list: Vec<Expert> = before[0].iter().copied().collect();
    c.on_holding(ROUTERS, 0, &list, "", 0, f.now);
    let want: Vec<Expert> = target[0].iter().copied().collect();
    assert_eq!(
        c.poll_action(),
        Some(ChangeAction::Hold {
            rank: ROUTERS,
            version: 2,
            experts: want
        })
    );
}

/// A change whose holds nobody answered (load and undo both past their deadlines): the next
/// change's versions are above every version sent, not reused (a silent device may still take
/// the old hold later, and would then refuse the new one of the same version).
#[test]
fn a_change_after_one_nobody_answered_uses_versions_never_sent() {
    let (mut c, mut f, _, target) = two_worker_change(|f| {
        f.silent.insert(ROUTERS);
        f.silent.insert(ROUTERS + 1)
    });
    c.on_tick(f.now + T);
    f.run(&mut c);
    c.on_tick(f.now + 2 * T);
    f.run(&mut c);
    assert!(!c.busy(), "{:?}", f.answers);
    f.failed();
    // Every device still announces version 0; the holds went out at 1 (load) and 2 (undo).
    assert_eq!(c.version(), 0);
    f.silent.clear();
    f.answers.clear();
    c.apply(1, 3, &entries(&target), T, f.now).unwrap();
    let mut versions = Vec::new();
    while let Some(a) = c.poll_action() {
        match a {
            ChangeAction::Survey { rank, nonce } => {
                let (version, set) = f.held[&rank].clone();
                let list: Vec<Expert> = set.iter().copied().collect();
                c.on_holding(rank, version, &list, "", nonce, f.now);
            }
            ChangeAction::Hold { version, .. } => versions.push(version),
            other => panic!("{other:?}"),
        }
    }
    assert!(
        !versions.is_empty() && versions.iter().all(|&v| v > 2),
        "the new change's holds: versions {versions:?} (1 and 2 were sent before)"
    );
}

fn placement(workers: usize, experts: u32) -> impl Strategy<Value = Vec<BTreeSet<Expert>>> {
    // Each expert of each layer gets a non-empty set of owners (a bit mask over workers).
    proptest::collection::vec(1u32..(1 << workers), LAYERS.len() * experts as usize).prop_map(
        move |masks| {
            let mut s = vec![BTreeSet::new(); workers];
            for (i, m) in masks.into_iter().enumerate() {
                let (l, e) = (LAYERS[i / experts as usize], (i % experts as usize) as u32);
                for (w, set) in s.iter_mut().enumerate() {
                    if m & (1 << w) != 0 {
                        set.insert((l, e));
                    }
                }
            }
            s
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn every_change_keeps_an_owner_per_expert_and_ends_on_the_new_or_the_old_sets(
        before in placement(3, 3),
        target in placement(3, 3),
        refuse in proptest::option::of(0u32..3),
        order in proptest::collection::vec(0usize..3, 0..8),
    ) {
        let mut c = coordinator(3, 3);
        let mut f = Fabric::new(&mut c, &before, 3);
        f.order = order;
        if let Some(w) = refuse {
            f.refuse_gains.insert(ROUTERS + w);
        }
        c.apply(1, 1, &entries(&target), T, f.now).unwrap();
        f.run(&mut c);
        prop_assert_eq!(f.answers.len(), 1);
        let gains = |w: usize| !target[w].is_subset(&before[w]);
        let refused = refuse.is_some_and(|w| gains(w as usize));
        let end = match &f.answers[0] {
            ChangeAction::Applied { loaded, released, .. } => {
                prop_assert!(!refused);
                let l: usize = (0..3).map(|w| target[w].difference(&before[w]).count()).sum();
                let r: usize = (0..3).map(|w| before[w].difference(&target[w]).count()).sum();
                prop_assert_eq!((*loaded as usize, *released as usize), (l, r));
                &target
            }
            ChangeAction::Failed { .. } => {
                prop_assert!(refused);
                &before
            }
            ChangeAction::Hold { .. } | ChangeAction::Survey { .. } => {
                unreachable!("holds and surveys are answered by the fabric")
            }
        };
        for w in 0..3 {
            prop_assert_eq!(&f.held[&(ROUTERS + w as u32)].1, &end[w]);
        }
    }
}
