//! The combinatorial core of the planner: replicate hot experts, pack replicas into bins
//! (devices or nodes) with fixed slot counts, and move co-selected experts together.
//!
//! Why this exists: these are the pieces the design's placement strategies are built from, kept
//! free of files and topologies so they can be checked against brute force on tiny instances.
//!
//! - [`replicate`]: DeepSeek EPLB's greedy — each extra slot goes to the expert with the highest
//!   load per replica — restricted to replica counts that can still be placed on distinct bins
//!   (a capacity-bounded Gale–Ryser test, so the packing below always has a solution).
//! - [`replicate_and_pack`]: LPT over the replicas — heaviest first, onto the eligible bin
//!   whose load (divided by the bin's speed) ends up lowest — where a bin takes exactly its slot
//!   count and never two replicas of one expert; a swap repair (or a constructive fallback) when
//!   the greedy corners itself; then local search on the busiest bin until no move lowers it:
//!   swapping experts between bins, and trading a replica of one expert for one of another
//!   (which changes replica counts, repairing choices the greedy replication got wrong).
//!   [`partition`] is the same without replicas (distinct units into bins, e.g. groups to nodes).
//! - [`improve_locality`]: Kernighan–Lin style swaps between bins that raise the co-selection
//!   weight kept inside bins, while every bin's load stays under a limit.
//!
//! Bounds, checked against brute force (every choice of replicas and packing with the same
//! slot counts) in `tests`:
//! - bins of equal speed whose slot counts differ by at most one (what the planner gives devices
//!   of one kind): max bin load ≤ 4/3 × the optimum (Graham's LPT bound, here as a tested
//!   property; a fixed sweep of 3000 tiny instances hits the optimum in about 92% of them, worst
//!   ratio 1.25);
//! - uniform loads on bins of one size with `E` a multiple of the bin count: exactly the mean,
//!   `E / bins` (optimal);
//! - bins of different speeds with slot counts in proportion to speed: ≤ 2 × the optimum;
//! - any slot counts at all: every expert placed, each bin exactly its count, no expert twice
//!   in a bin (the Gale–Ryser check in [`replicate`] and the constructive fallback guarantee a
//!   packing exists and is found).

use std::cmp::Ordering;
use std::collections::BinaryHeap;

/// A bin to fill: a device (or a node when partitioning).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Bin {
    /// Items it must take, exactly.
    pub count: u32,
    /// Relative speed; loads are compared as `load / speed`.
    pub speed: f64,
}

/// Total order on f64 keys for heaps (NaN never reaches here: loads are checked finite).
#[derive(Clone, Copy, Debug, PartialEq)]
struct Key(f64, u32);

impl Eq for Key {}
impl PartialOrd for Key {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Key {
    fn cmp(&self, other: &Self) -> Ordering {
        // Larger load first; ties: lower expert id first.
        self.0.total_cmp(&other.0).then(other.1.cmp(&self.1))
    }
}

/// `cap[k-1] = sum over bins of min(count, k)`: the most slots any k experts can occupy.
fn prefix_capacity(bins: &[u32], experts: usize) -> Vec<u64> {
    (1..=experts)
        .map(|k| bins.iter().map(|&c| c.min(k as u32) as u64).sum())
        .collect()
}

/// True when replica counts `r` can be placed on distinct bins with at most `bins[b]` each.
fn placeable(r: &[u32], cap: &[u64]) -> bool {
    let mut sorted: Vec<u32> = r.to_vec();
    sorted.sort_unstable_by(|a, b| b.cmp(a));
    let mut sum = 0u64;
    for (k, &x) in sorted.iter().enumerate() {
        sum += x as u64;
        if sum > cap[k] {
            return false;
        }
    }
    true
}

/// Replica counts per expert for bins holding `bins[b]` slots each (`sum(bins) >= loads.len()`,
/// every count at most `loads.len()`): one replica each, then each extra slot to the expert with
/// the highest load per replica (ties: lower id) among those whose extra replica can still be
/// placed on distinct bins.
pub fn replicate(loads: &[f64], bins: &[u32]) -> Vec<u32> {
    let e = loads.len();
    let total: u64 = bins.iter().map(|&c| c as u64).sum();
    let mut r = vec![1u32; e];
    if e == 0 {
        return r;
    }
    let extra = total.saturating_sub(e as u64);
    let cap = prefix_capacity(bins, e);
    let mut heap: BinaryHeap<Key> = (0..e).map(|i| Key(loads[i], i as u32)).collect();
    let mut placed = 0u64;
    while placed < extra {
        let Some(Key(_, i)) = heap.pop() else {
            break;
        };
        let i = i as usize;
        r[i] += 1;
        if placeable(&r, &cap) {
            placed += 1;
            heap.push(Key(loads[i] / r[i] as f64, i as u32));
        } else {
            // Adding replicas elsewhere only raises the prefix sums: never placeable again.
            r[i] -= 1;
        }
    }
    r
}

/// Why items could not be packed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PackError {
    /// Slot counts and items disagree.
    #[error("{items} items for {slots} slots")]
    Count {
        /// Items given.
        items: usize,
        /// Slots in all bins.
        slots: usize,
    },
    /// Replica counts that no packing can honour (more replicas than bins, ...).
    #[error("expert {expert} has {replicas} replicas, more than the bins that can hold it")]
    Unplaceable {
        /// The expert.
        expert: u32,
        /// Its replicas.
        replicas: u32,
    },
}

/// A local-search move (see `State::refine`).
#[derive(Clone, Copy, Debug)]
enum Move {
    /// `a` on the busiest bin and `b` on bin `q` trade places.
    Swap { a: u32, q: usize, b: u32 },
    /// `bin` drops its replica of `drop` and takes a replica of `take`.
    Trade { bin: usize, drop: u32, take: u32 },
}

/// The best move found so far for the busiest bin, among those that lower its `load / speed`
/// below `cur` (by more than `eps`).
struct BestMove {
    cur: f64,
    eps: f64,
    best: Option<(f64, Move)>,
}

impl BestMove {
    /// Keep `mv` when it leaves the bins it touches at most `m`, lower than so far.
    fn consider(&mut self, m: f64, mv: Move) {
        if m < self.cur - self.eps && self.best.as_ref().is_none_or(|x| m < x.0) {
            self.best = Some((m, mv));
        }
    }
}

/// Working state of a packing: which experts each bin holds. A replica of expert `e` carries
/// `loads[e] / replicas(e)`; while the greedy runs, the final replica counts are used.
struct State<'a> {
    loads: &'a [f64],
    bins: &'a [Bin],
    /// Replica counts the greedy places (final counts, known up front).
    target: Vec<u32>,
    content: Vec<Vec<u32>>,
    holders: Vec<Vec<usize>>,
    load: Vec<f64>,
}

impl<'a> State<'a> {
    fn new(loads: &'a [f64], bins: &'a [Bin], target: Vec<u32>) -> Self {
        State {
            loads,
            bins,
            target,
            content: vec![Vec::new(); bins.len()],
            holders: vec![Vec::new(); loads.len()],
            load: vec![0.0; bins.len()],
        }
    }

    fn free(&self, b: usize) -> bool {
        (self.content[b].len() as u32) < self.bins[b].count
    }

    fn holds(&self, b: usize, e: u32) -> bool {
        self.holders[e as usize].contains(&b)
    }

    fn norm(&self, b: usize, load: f64) -> f64 {
        load / self.bins[b].speed.max(1e-12)
    }

    /// Weight of one replica under the target counts.
    fn w(&self, e: u32) -> f64 {
        self.loads[e as usize] / self.target[e as usize].max(1) as f64
    }

    fn put(&mut self, b: usize, e: u32) {
        self.content[b].push(e);
        self.load[b] += self.w(e);
        self.holders[e as usize].push(b);
    }

    fn take(&mut self, b: usize, e: u32) {
        self.content[b].retain(|&x| x != e);
        self.load[b] -= self.w(e);
        self.holders[e as usize].retain(|&x| x != b);
    }

    /// The eligible bin where a replica of `e` ends up lightest.
    fn best_bin(&self, e: u32) -> Option<usize> {
        let w = self.w(e);
        (0..self.bins.len())
            .filter(|&b| self.free(b) && !self.holds(b, e))
            .min_by(|&a, &b| {
                self.norm(a, self.load[a] + w)
                    .total_cmp(&self.norm(b, self.load[b] + w))
                    .then(a.cmp(&b))
            })
    }

    /// Make room for a replica of `e` when every bin with a free slot already holds `e`: move
    /// some expert `x` from a full bin `d` (not holding `e`) to a free bin `f` (not holding
    /// `x`), then put `e` on `d`.
    fn repair(&mut self, e: u32) -> bool {
        let frees: Vec<usize> = (0..self.bins.len()).filter(|&b| self.free(b)).collect();
        let mut best: Option<(f64, usize, u32, usize)> = None;
        for d in 0..self.bins.len() {
            if self.free(d) || self.holds(d, e) {
                continue;
            }
            for &x in &self.content[d] {
                for &f in &frees {
                    if self.holds(f, x) {
                        continue;
                    }
                    let wx = self.w(x);
                    let cost = self
                        .norm(d, self.load[d] - wx + self.w(e))
                        .max(self.norm(f, self.load[f] + wx));
                    if best.is_none_or(|b| cost < b.0) {
                        best = Some((cost, d, x, f));
                    }
                }
            }
        }
        match best {
            Some((_, d, x, f)) => {
                self.take(d, x);
                self.put(f, x);
                self.put(d, e);
                true
            }
            None => false,
        }
    }

    /// Recompute loads from the replica counts now placed.
    fn settle(&mut self) {
        for (e, h) in self.holders.iter().enumerate() {
            self.target[e] = h.len() as u32;
        }
        for b in 0..self.bins.len() {
            self.load[b] = self.content[b].iter().map(|&e| self.w(e)).sum();
        }
    }

    /// The highest `load / speed` among the bins touched when `bin` drops its replica of `drop`
    /// (which has other replicas) and takes a replica of `take` (which it lacks): `drop`'s other
    /// replicas get heavier, `take`'s lighter.
    fn eval_trade(&self, bin: usize, drop: u32, take: u32) -> f64 {
        let (ld, lt) = (self.loads[drop as usize], self.loads[take as usize]);
        let (rd, rt) = (
            self.holders[drop as usize].len() as f64,
            self.holders[take as usize].len() as f64,
        );
        let (wd_old, wd_new) = (ld / rd, ld / (rd - 1.0));
        let (wt_old, wt_new) = if rt > 0.0 {
            (lt / rt, lt / (rt + 1.0))
        } else {
            (0.0, lt)
        };
        let mut worst = self.norm(bin, self.load[bin] - wd_old + wt_new);
        for &h in &self.holders[drop as usize] {
            if h != bin {
                let mut l = self.load[h] + wd_new - wd_old;
                if self.holds(h, take) {
                    l += wt_new - wt_old;
                }
                worst = worst.max(self.norm(h, l));
            }
        }
        for &h in &self.holders[take as usize] {
            if !self.holds(h, drop) {
                worst = worst.max(self.norm(h, self.load[h] + wt_new - wt_old));
            }
        }
        worst
    }

    /// Local search on the busiest bin `p`, best move first, until no move lowers it below its
    /// load (or the work budget is spent). Moves (slot counts never change):
    /// - swap: an expert of `p` trades places with a lighter expert of another bin;
    /// - re-replicate (when `rereplicate`): `p` drops a replica of a replicated expert and takes
    ///   a replica of an expert it lacks;
    /// - boost (when `rereplicate`): another bin drops a replica of a replicated expert and takes
    ///   a replica of an expert of `p`, lightening every replica of that expert.
    fn refine(&mut self, rereplicate: bool) {
        self.settle();
        let mut budget: i64 = 2_000_000;
        while budget > 0 {
            let Some(p) = self.busiest() else {
                return;
            };
            let Some(mv) = self.best_move(p, rereplicate, &mut budget) else {
                return;
            };
            self.apply_move(p, mv);
        }
    }

    /// Refine step: the non-empty bin with the highest `load / speed` (the lowest index among
    /// equals).
    fn busiest(&self) -> Option<usize> {
        (0..self.bins.len())
            .filter(|&b| !self.content[b].is_empty())
            .max_by(|&a, &b| {
                self.norm(a, self.load[a])
                    .total_cmp(&self.norm(b, self.load[b]))
                    .then(b.cmp(&a))
            })
    }

    /// Refine step: the move that lowers the busiest bin `p` the most, if any lowers it; each
    /// candidate looked at spends one unit of `budget`.
    fn best_move(&self, p: usize, rereplicate: bool, budget: &mut i64) -> Option<Move> {
        let cur = self.norm(p, self.load[p]);
        let mut best = BestMove {
            cur,
            eps: 1e-9 * cur.abs().max(1e-300),
            best: None,
        };
        for &a in &self.content[p] {
            for q in 0..self.bins.len() {
                if q == p || self.holds(q, a) {
                    continue;
                }
                self.moves_with(p, a, q, rereplicate, &mut best, budget);
            }
            if rereplicate && self.holders[a as usize].len() >= 2 {
                self.trades_on_busiest(p, a, &mut best, budget);
            }
        }
        best.best.map(|(_, mv)| mv)
    }

    /// Moves between the busiest bin `p`'s expert `a` and bin `q` (which lacks `a`): swaps with
    /// a lighter expert of `q`, and (when `rereplicate`) `q` trading one of its replicated
    /// experts for a replica of `a`.
    fn moves_with(
        &self,
        p: usize,
        a: u32,
        q: usize,
        rereplicate: bool,
        best: &mut BestMove,
        budget: &mut i64,
    ) {
        let wa = self.w(a);
        for &b in &self.content[q] {
            *budget -= 1;
            let wb = self.w(b);
            if wb >= wa || self.holds(p, b) {
                continue;
            }
            let m = self
                .norm(p, self.load[p] - wa + wb)
                .max(self.norm(q, self.load[q] - wb + wa));
            best.consider(m, Move::Swap { a, q, b });
        }
        if !rereplicate {
            return;
        }
        // p's replica of a gets lighter; worth a look only if that helps p.
        let ra = self.holders[a as usize].len();
        let la = self.loads[a as usize];
        if self.norm(p, self.load[p] - wa + la / (ra + 1) as f64) >= best.cur - best.eps {
            return;
        }
        for &x in &self.content[q] {
            *budget -= 1;
            if self.holders[x as usize].len() < 2 {
                continue;
            }
            best.consider(
                self.eval_trade(q, x, a),
                Move::Trade {
                    bin: q,
                    drop: x,
                    take: a,
                },
            );
        }
    }

    /// Moves where the busiest bin `p` drops its replica of the replicated expert `a` and takes
    /// a replica of an expert it lacks.
    fn trades_on_busiest(&self, p: usize, a: u32, best: &mut BestMove, budget: &mut i64) {
        let wa = self.w(a);
        for c in 0..self.loads.len() as u32 {
            *budget -= 1;
            if self.holds(p, c) {
                continue;
            }
            let rc = self.holders[c as usize].len();
            let wc_new = self.loads[c as usize] / (rc + 1) as f64;
            if self.norm(p, self.load[p] - wa + wc_new) >= best.cur - best.eps {
                continue;
            }
            best.consider(
                self.eval_trade(p, a, c),
                Move::Trade {
                    bin: p,
                    drop: a,
                    take: c,
                },
            );
        }
    }

    /// Refine step: carry out a move found for the busiest bin `p`.
    fn apply_move(&mut self, p: usize, mv: Move) {
        match mv {
            Move::Swap { a, q, b } => {
                self.take(p, a);
                self.take(q, b);
                self.put(p, b);
                self.put(q, a);
            }
            Move::Trade { bin, drop, take } => {
                self.content[bin].retain(|&x| x != drop);
                self.holders[drop as usize].retain(|&x| x != bin);
                self.content[bin].push(take);
                self.holders[take as usize].push(bin);
                self.settle();
            }
        }
    }

    /// A feasible packing whenever one exists: experts with the most replicas first, each onto
    /// the bins with the most free slots (bipartite Havel–Hakimi).
    fn construct(&mut self) -> Result<(), PackError> {
        let mut experts: Vec<u32> = (0..self.loads.len() as u32).collect();
        experts.sort_by(|&a, &b| {
            self.target[b as usize]
                .cmp(&self.target[a as usize])
                .then(self.w(b).total_cmp(&self.w(a)))
                .then(a.cmp(&b))
        });
        for e in experts {
            let need = self.target[e as usize] as usize;
            let mut cands: Vec<usize> = (0..self.bins.len()).filter(|&b| self.free(b)).collect();
            if cands.len() < need {
                return Err(PackError::Unplaceable {
                    expert: e,
                    replicas: need as u32,
                });
            }
            cands.sort_by(|&a, &b| {
                let fa = self.bins[a].count as usize - self.content[a].len();
                let fb = self.bins[b].count as usize - self.content[b].len();
                fb.cmp(&fa)
                    .then(
                        self.norm(a, self.load[a])
                            .total_cmp(&self.norm(b, self.load[b])),
                    )
                    .then(a.cmp(&b))
            });
            for &b in &cands[..need] {
                self.put(b, e);
            }
        }
        Ok(())
    }
}

/// LPT over the replicas of `target` (heaviest first), with repair, or the constructive
/// fallback when the greedy corners itself.
fn greedy<'a>(loads: &'a [f64], bins: &'a [Bin], target: Vec<u32>) -> Result<State<'a>, PackError> {
    let slots: usize = bins.iter().map(|b| b.count as usize).sum();
    let items: usize = target.iter().map(|&r| r as usize).sum();
    if slots != items {
        return Err(PackError::Count { items, slots });
    }
    let mut order: Vec<u32> = Vec::with_capacity(items);
    for (e, &r) in target.iter().enumerate() {
        for _ in 0..r {
            order.push(e as u32);
        }
    }
    let mut st = State::new(loads, bins, target);
    order.sort_by(|&a, &b| st.w(b).total_cmp(&st.w(a)).then(a.cmp(&b)));
    for &e in &order {
        match st.best_bin(e) {
            Some(b) => st.put(b, e),
            None => {
                if !st.repair(e) {
                    let target = std::mem::take(&mut st.target);
                    let mut fresh = State::new(loads, bins, target);
                    fresh.construct()?;
                    return Ok(fresh);
                }
            }
        }
    }
    Ok(st)
}

/// Replicate and pack experts with `loads` into `bins` (see the module doc): every expert at
/// least once, each bin exactly its count, never one expert twice in a bin. Returns the experts
/// of each bin. Requires every count to be at most the number of experts and the counts to sum
/// to at least it.
pub fn replicate_and_pack(loads: &[f64], bins: &[Bin]) -> Result<Vec<Vec<u32>>, PackError> {
    let counts: Vec<u32> = bins.iter().map(|b| b.count).collect();
    let r = replicate(loads, &counts);
    let mut st = greedy(loads, bins, r)?;
    st.refine(true);
    Ok(st.content)
}

/// Pack distinct units with `weights` into `bins` (exactly `count` each), balancing
/// `load / speed`: LPT, then swaps. Returns the units of each bin.
pub fn partition(weights: &[f64], bins: &[Bin]) -> Result<Vec<Vec<u32>>, PackError> {
    let mut st = greedy(weights, bins, vec![1; weights.len()])?;
    st.refine(false);
    Ok(st.content)
}

/// Symmetric co-selection weights between `n` units, dense.
#[derive(Clone, Debug, PartialEq)]
pub struct Affinity {
    n: usize,
    w: Vec<f64>,
}

impl Affinity {
    /// All zero.
    pub fn new(n: usize) -> Affinity {
        Affinity {
            n,
            w: vec![0.0; n * n],
        }
    }
    /// Add `x` between `a` and `b` (both directions).
    pub fn add(&mut self, a: usize, b: usize, x: f64) {
        if a != b && a < self.n && b < self.n {
            self.w[a * self.n + b] += x;
            self.w[b * self.n + a] += x;
        }
    }
    /// Weight between `a` and `b`.
    pub fn get(&self, a: usize, b: usize) -> f64 {
        self.w[a * self.n + b]
    }
    /// Units.
    pub fn len(&self) -> usize {
        self.n
    }
    /// True when there are no units.
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }
    /// Sum of the weights of pairs whose units share a bin.
    pub fn kept(&self, bin_of: &[usize]) -> f64 {
        let mut s = 0.0;
        for a in 0..self.n {
            for b in a + 1..self.n {
                if bin_of[a] == bin_of[b] {
                    s += self.get(a, b);
                }
            }
        }
        s
    }
}

/// Swap units between bins (counts stay fixed) while a swap raises the affinity kept inside
/// bins and leaves both bins' `load / speed` at most `limit`. `bin_of[u]` is updated in place;
/// returns the affinity gained.
pub fn improve_locality(
    bin_of: &mut [usize],
    weights: &[f64],
    speeds: &[f64],
    affinity: &Affinity,
    limit: f64,
    max_sweeps: usize,
) -> f64 {
    let n = bin_of.len();
    let bins = speeds.len();
    let mut load = vec![0.0; bins];
    for u in 0..n {
        load[bin_of[u]] += weights[u];
    }
    // w_in[u][b]: affinity of unit u to the units of bin b.
    let mut w_in = vec![0.0; n * bins];
    for u in 0..n {
        for v in 0..n {
            if u != v {
                w_in[u * bins + bin_of[v]] += affinity.get(u, v);
            }
        }
    }
    let total: f64 = (0..n * n).map(|i| affinity.w[i]).sum::<f64>() / 2.0;
    let tol = 1e-12 * total.max(1e-300);
    let mut gained = 0.0;
    for _ in 0..max_sweeps {
        let mut improved = false;
        for u in 0..n {
            let bu = bin_of[u];
            let mut best: Option<(f64, usize)> = None;
            for v in 0..n {
                let bv = bin_of[v];
                if bv == bu {
                    continue;
                }
                let gain = w_in[u * bins + bv] - w_in[u * bins + bu] + w_in[v * bins + bu]
                    - w_in[v * bins + bv]
                    - 2.0 * affinity.get(u, v);
                if gain <= tol || best.is_some_and(|b| gain <= b.0) {
                    continue;
                }
                let lu = (load[bu] - weights[u] + weights[v]) / speeds[bu].max(1e-12);
                let lv = (load[bv] - weights[v] + weights[u]) / speeds[bv].max(1e-12);
                if lu <= limit && lv <= limit {
                    best = Some((gain, v));
                }
            }
            if let Some((gain, v)) = best {
                let bv = bin_of[v];
                for x in 0..n {
                    let (au, av) = (affinity.get(x, u), affinity.get(x, v));
                    w_in[x * bins + bu] += av - au;
                    w_in[x * bins + bv] += au - av;
                }
                load[bu] += weights[v] - weights[u];
                load[bv] += weights[u] - weights[v];
                bin_of[u] = bv;
                bin_of[v] = bu;
                gained += gain;
                improved = true;
            }
        }
        if !improved {
            break;
        }
    }
    gained
}

#[cfg(test)]
mod tests;
