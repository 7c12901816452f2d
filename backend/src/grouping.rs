//! Routing pairs → expert groups: the one place that turns "token t sends slot s to expert e
//! with weight w" into the [`ExpertGroup`]s a backend runs.
//!
//! Why this exists: the worker's dispatch executor, the router's shared-expert runner, the
//! in-process reference layer and the kernel bench all need the same grouping (every pair of
//! one expert together, each expert's tokens ascending, output rows as the caller numbered
//! them). [`Grouping`] does it with buffers sized once: after the first batch at the largest
//! size, building groups allocates nothing.

use crate::{ExpertGroup, ExpertKey};

/// One pushed (token, expert) pair.
#[derive(Clone, Copy, Debug)]
struct Pair {
    expert: u32,
    /// Push order: the tie-breaker that keeps each expert's pairs in the order pushed.
    seq: u32,
    token: u32,
    weight: f32,
    out_row: u32,
}

/// Reusable grouping buffers (see the module docs).
#[derive(Debug, Default)]
pub struct Grouping {
    pairs: Vec<Pair>,
    tokens: Vec<u32>,
    weights: Vec<f32>,
    rows: Vec<u32>,
    /// (expert, first, end) into `tokens`/`weights`/`rows`.
    bounds: Vec<(u32, usize, usize)>,
    /// Capacity kept between batches; always empty outside [`Grouping::with_groups`].
    spare: Vec<ExpertGroup<'static>>,
}

/// Reuse a vector's allocation for a vector of the same element type with another lifetime.
/// Empty in, empty out; the in-place `collect` keeps the allocation (same size and alignment).
fn recycle<'b>(mut v: Vec<ExpertGroup<'_>>) -> Vec<ExpertGroup<'b>> {
    v.clear();
    v.into_iter().map(|_| unreachable!("empty")).collect()
}

impl Grouping {
    /// Buffers for up to `max_pairs` pairs without growing.
    pub fn with_capacity(max_pairs: usize) -> Self {
        Self {
            pairs: Vec::with_capacity(max_pairs),
            tokens: Vec::with_capacity(max_pairs),
            weights: Vec::with_capacity(max_pairs),
            rows: Vec::with_capacity(max_pairs),
            bounds: Vec::with_capacity(max_pairs),
            spare: Vec::with_capacity(max_pairs),
        }
    }

    /// Forget the pairs of the previous batch.
    pub fn clear(&mut self) {
        self.pairs.clear();
    }

    /// Pairs pushed since the last [`Grouping::clear`].
    pub fn len(&self) -> usize {
        self.pairs.len()
    }

    /// Whether no pair was pushed since the last [`Grouping::clear`].
    pub fn is_empty(&self) -> bool {
        self.pairs.is_empty()
    }

    /// Add one pair: input row `token` goes to `expert` with routing `weight`, and its output
    /// row is `out_row`. Push each expert's pairs in ascending token order (token-major order
    /// does that for every expert).
    pub fn push(&mut self, expert: u32, token: u32, weight: f32, out_row: u32) {
        let seq = self.pairs.len() as u32;
        self.pairs.push(Pair {
            expert,
            seq,
            token,
            weight,
            out_row,
        });
    }

    /// Group the pushed pairs by expert (ascending expert id; within an expert, push order)
    /// for MoE layer `layer`, and call `f` with the groups.
    pub fn with_groups<R>(&mut self, layer: u32, f: impl FnOnce(&[ExpertGroup<'_>]) -> R) -> R {
        self.with_groups_keyed(layer, |e| e, f)
    }

    /// [`Grouping::with_groups`], where a group's backend key is `key(pushed id)`: the pairs
    /// are grouped by the id they were pushed with, so distinct ids that map to one key stay
    /// distinct groups (the kernel bench rotates many logical experts over a smaller pool).
    pub fn with_groups_keyed<R>(
        &mut self,
        layer: u32,
        key: impl Fn(u32) -> u32,
        f: impl FnOnce(&[ExpertGroup<'_>]) -> R,
    ) -> R {
        // (expert, seq) keys are unique, so the unstable (allocation-free) sort is deterministic
        // and equal to a stable sort by expert.
        self.pairs.sort_unstable_by_key(|p| (p.expert, p.seq));
        self.tokens.clear();
        self.weights.clear();
        self.rows.clear();
        self.bounds.clear();
        let mut start = 0;
        for (i, p) in self.pairs.iter().enumerate() {
            if i > start && p.expert != self.pairs[start].expert {
                self.bounds.push((self.pairs[start].expert, start, i));
                start = i;
            }
            self.tokens.push(p.token);
            self.weights.push(p.weight);
            self.rows.push(p.out_row);
        }
        if start < self.pairs.len() {
            self.bounds
                .push((self.pairs[start].expert, start, self.pairs.len()));
        }
        let mut groups = recycle(std::mem::take(&mut self.spare));
        groups.extend(self.bounds.iter().map(|&(expert, a, b)| ExpertGroup {
            key: ExpertKey {
                layer,
                expert: key(expert),
            },
            tokens: &self.tokens[a..b],
            weights: &self.weights[a..b],
            out_rows: &self.rows[a..b],
        }));
        let r = f(&groups);
        self.spare = recycle(groups);
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (expert, tokens, weights, output rows) of one group.
    type Flat = (u32, Vec<u32>, Vec<f32>, Vec<u32>);

    #[test]
    fn groups_by_expert_in_push_order() {
        let mut g = Grouping::with_capacity(8);
        // token-major: t0 → e3 (row 0), e1 (row 1); t1 → e1 (row 2), e3 (row 3); t2 → e2 (row 4)
        for (e, t, w, r) in [
            (3, 0, 0.5, 0),
            (1, 0, 0.25, 1),
            (1, 1, 0.75, 2),
            (3, 1, 0.1, 3),
        ] {
            g.push(e, t, w, r);
        }
        g.push(2, 2, 1.0, 4);
        let got: Vec<Flat> = g.with_groups(7, |gs| {
            gs.iter()
                .map(|x| {
                    assert_eq!(x.key.layer, 7);
                    (
                        x.key.expert,
                        x.tokens.to_vec(),
                        x.weights.to_vec(),
                        x.out_rows.to_vec(),
                    )
                })
                .collect()
        });
        assert_eq!(
            got,
            vec![
                (1, vec![0, 1], vec![0.25, 0.75], vec![1, 2]),
                (2, vec![2], vec![1.0], vec![4]),
                (3, vec![0, 1], vec![0.5, 0.1], vec![0, 3]),
            ]
        );
        g.clear();
        assert!(g.is_empty());
        assert_eq!(g.with_groups(0, |gs| gs.len()), 0);
    }
}
