//! Copies of gained experts relayed through a router: which owner streams each, where its
//! chunks and acknowledgements go, and what happens when an owner cannot copy or a link is
//! lost (sans-IO: frames in as facts, sends out as actions).
//!
//! Why this exists: a device gaining an expert its host has no weights for asks its router
//! for a copy (`expertmesh_worker::fetch`); the router knows who serves the expert now and
//! is the one link both devices have. Each copy is one stream: the owner's `Chunk`s go to the
//! gainer under the gainer's stream id, the gainer's `Ack`s to the owner under the relay's. An
//! owner that refuses before sending anything (it has no copy it can read) hands the stream
//! to the next owner; after a byte went out, an error ends the stream at the gainer. The
//! service drives it ([`crate::service`]) and turns actions into frames.

use std::collections::HashMap;

/// Copies one router relays at once (each gainer copies one expert at a time).
pub const MAX_RELAYS: usize = 1024;

/// Copies one gainer may have under way here at once: its current one and a few it gave up
/// (each ends when its owner's wait for an acknowledgement does). Every copy may hold an
/// owner's window of chunks on their way to the gainer in this router's memory, so a gainer
/// that asks for copies without end and reads none holds at most this many windows here.
pub const MAX_RELAYS_PER_GAINER: usize = 8;

/// What the driver must send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RelayAction {
    /// Ask `owner` to stream (layer, expert) `key` as relay stream `id` (a `Fetch`).
    Ask {
        /// The owner's mesh rank.
        owner: u32,
        /// The relay's stream id.
        id: u64,
        /// (layer, expert).
        key: (u32, u32),
    },
    /// End `gainer`'s stream `gainer_id` with `why` (a `Chunk` with a message).
    Refuse {
        /// The gainer's mesh rank.
        gainer: u32,
        /// The gainer's stream id.
        gainer_id: u64,
        /// What went wrong.
        why: String,
    },
    /// Pass the gainer's acknowledgement of `bytes` to `owner` as relay stream `id`.
    Ack {
        /// The owner's mesh rank.
        owner: u32,
        /// The relay's stream id.
        id: u64,
        /// Bytes the gainer has.
        bytes: u64,
    },
}

/// Where a chunk from an owner goes (`Relays::chunk`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChunkRoute {
    /// On to `gainer` as its stream `gainer_id`.
    Forward {
        /// The gainer's mesh rank.
        gainer: u32,
        /// The gainer's stream id.
        gainer_id: u64,
    },
    /// Nowhere: the owner could not copy before a byte went out, so this asks the next owner
    /// (always a `RelayAction::Ask`).
    Next(RelayAction),
}

#[derive(Debug, Clone)]
struct Relay {
    gainer: u32,
    gainer_id: u64,
    owner: u32,
    key: (u32, u32),
    /// Owners to ask next if this one refuses before sending anything.
    others: Vec<u32>,
    /// Whether a chunk reached the gainer.
    started: bool,
}

/// The copies under way. See the module docs.
#[derive(Debug, Default)]
pub struct Relays {
    relays: HashMap<u64, Relay>,
    next: u64,
}

impl Relays {
    /// Copies under way.
    pub fn len(&self) -> usize {
        self.relays.len()
    }

    /// Whether none is under way.
    pub fn is_empty(&self) -> bool {
        self.relays.is_empty()
    }

    /// Worker `from` asks for a copy as its stream `gainer_id`: `entries` must be exactly one
    /// (its own rank, layer, expert); `owners` are the live, connected owners of the expert
    /// (the asker among them is skipped).
    pub fn fetch(
        &mut self,
        from: u32,
        gainer_id: u64,
        entries: &[(u32, u32, u32)],
        owners: Vec<u32>,
    ) -> RelayAction {
        let refuse = |why: String| RelayAction::Refuse {
            gainer: from,
            gainer_id,
            why,
        };
        let [(rank, layer, expert)] = entries[..] else {
            return refuse("a fetch names exactly one expert".into());
        };
        if rank != from {
            return refuse(format!("a fetch names mesh rank {rank}, not the asker's"));
        }
        if self.relays.len() >= MAX_RELAYS {
            return refuse(format!(
                "{MAX_RELAYS} expert copies are under way here; ask again later"
            ));
        }
        let own = self.relays.values().filter(|r| r.gainer == from).count();
        if own >= MAX_RELAYS_PER_GAINER {
            return refuse(format!(
                "{own} copies for this device are under way here already (at most \
                 {MAX_RELAYS_PER_GAINER}); ask again once they end"
            ));
        }
        let mut others: Vec<u32> = owners.into_iter().filter(|&r| r != from).collect();
        if others.is_empty() {
            return refuse(format!(
                "no other connected device serves layer {layer} expert {expert} now, and its \
                 weights are not on the gaining device's host; copy its shard there"
            ));
        }
        self.next += 1;
        let id = self.next;
        // Start at a different owner for each copy (spread), then the others in turn.
        let start = (id as usize) % others.len();
        others.rotate_left(start);
        let owner = others.remove(0);
        let key = (layer, expert);
        self.relays.insert(
            id,
            Relay {
                gainer: from,
                gainer_id,
                owner,
                key,
                others,
                started: false,
            },
        );
        RelayAction::Ask { owner, id, key }
    }

    /// A chunk of relay stream `id` from `from`; `failed`: it carries an error; `last`: it
    /// ends the stream. `None`: drop it (an unknown stream, another device's).
    pub fn chunk(&mut self, from: u32, id: u64, failed: bool, last: bool) -> Option<ChunkRoute> {
        let relay = self.relays.get_mut(&id)?;
        if relay.owner != from {
            return None;
        }
        if failed && !relay.started && !relay.others.is_empty() {
            let owner = relay.others.remove(0);
            relay.owner = owner;
            return Some(ChunkRoute::Next(RelayAction::Ask {
                owner,
                id,
                key: relay.key,
            }));
        }
        relay.started = true;
        let out = ChunkRoute::Forward {
            gainer: relay.gainer,
            gainer_id: relay.gainer_id,
        };
        if failed || last {
            self.relays.remove(&id);
        }
        Some(out)
    }

    /// Gainer `from` acknowledges `bytes` of its stream `gainer_id`; [`COPY_CANCELLED`]
    /// bytes: it gave the copy up, which ends the relay here (the owner's later chunks are
    /// dropped) and is passed on so the owner stops.
    ///
    /// [`COPY_CANCELLED`]: expertmesh_transport::codec::COPY_CANCELLED
    pub fn ack(&mut self, from: u32, gainer_id: u64, bytes: u64) -> Option<RelayAction> {
        let (&id, r) = self
            .relays
            .iter()
            .find(|(_, r)| r.gainer == from && r.gainer_id == gainer_id)?;
        let action = RelayAction::Ack {
            owner: r.owner,
            id,
            bytes,
        };
        if bytes == expertmesh_transport::codec::COPY_CANCELLED {
            self.relays.remove(&id);
        }
        Some(action)
    }

    /// Worker `rank`'s link is gone: the copies it was streaming end at their gainers
    /// (`name` is its label), the copies it asked for are cancelled at their owners (an `Ack`
    /// of [`COPY_CANCELLED`](expertmesh_transport::codec::COPY_CANCELLED) bytes: the owner's
    /// one copy thread would wait for its acknowledgements, and the copies queued behind).
    pub fn lost(&mut self, rank: u32, name: &str) -> Vec<RelayAction> {
        let mut out = Vec::new();
        self.relays.retain(|&id, r| {
            if r.owner == rank {
                out.push(RelayAction::Refuse {
                    gainer: r.gainer,
                    gainer_id: r.gainer_id,
                    why: format!(
                        "the device copying the expert ({name}) was lost; the change is undone"
                    ),
                });
            } else if r.gainer == rank {
                out.push(RelayAction::Ack {
                    owner: r.owner,
                    id,
                    bytes: expertmesh_transport::codec::COPY_CANCELLED,
                });
            }
            r.owner != rank && r.gainer != rank
        });
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ask(a: &RelayAction) -> (u32, u64) {
        match a {
            RelayAction::Ask { owner, id, .. } => (*owner, *id),
            other => panic!("{other:?}"),
        }
    }

    fn next(route: Option<ChunkRoute>) -> RelayAction {
        match route {
            Some(ChunkRoute::Next(a)) => a,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn chunks_go_to_the_gainer_and_acknowledgements_to_the_owner_until_the_last() {
        let mut r = Relays::default();
        let a = r.fetch(5, 40, &[(5, 1, 7)], vec![3, 5]);
        assert_eq!(
            a,
            RelayAction::Ask {
                owner: 3,
                id: 1,
                key: (1, 7)
            }
        );
        // Another device's chunk under this id, or an unknown id: dropped.
        assert_eq!(r.chunk(4, 1, false, false), None);
        assert_eq!(r.chunk(3, 9, false, false), None);
        let fwd = ChunkRoute::Forward {
            gainer: 5,
            gainer_id: 40,
        };
        assert_eq!(r.chunk(3, 1, false, false), Some(fwd.clone()));
        assert_eq!(
            r.ack(5, 40, 1 << 20),
            Some(RelayAction::Ack {
                owner: 3,
                id: 1,
                bytes: 1 << 20
            })
        );
        assert_eq!(r.ack(5, 41, 1), None);
        assert_eq!(r.chunk(3, 1, false, true), Some(fwd));
        assert!(r.is_empty());
        assert_eq!(r.chunk(3, 1, false, false), None);
    }

    /// A gainer that gives a copy up (its `Ack` of `COPY_CANCELLED` bytes) has the cancel
    /// passed to the owner and the relay ended here: the owner's later chunks are dropped and
    /// the copy no longer counts against the gainer's share.
    #[test]
    fn a_copy_the_gainer_gives_up_is_cancelled_at_its_owner_and_ends_here() {
        use expertmesh_transport::codec::COPY_CANCELLED;
        let mut r = Relays::default();
        let (owner, id) = ask(&r.fetch(5, 40, &[(5, 1, 7)], vec![3]));
        assert!(matches!(
            r.chunk(owner, id, false, false),
            Some(ChunkRoute::Forward { .. })
        ));
        assert_eq!(
            r.ack(5, 40, COPY_CANCELLED),
            Some(RelayAction::Ack {
                owner,
                id,
                bytes: COPY_CANCELLED
            })
        );
        assert!(r.is_empty());
        assert_eq!(r.chunk(owner, id, false, false), None);
        assert_eq!(r.ack(5, 40, 1), None);
    }

    /// A gainer past its share of copies is refused; another gainer is still served, and
    /// the first is again once one of its copies ends.
    #[test]
    fn one_gainer_holds_at_most_its_share_of_the_relays() {
        let mut r = Relays::default();
        for id in 0..MAX_RELAYS_PER_GAINER as u64 {
            let a = r.fetch(5, 100 + id, &[(5, 1, id as u32)], vec![3]);
            assert!(matches!(a, RelayAction::Ask { owner: 3, .. }), "{a:?}");
        }
        let refused = r.fetch(5, 200, &[(5, 1, 30)], vec![3]);
        assert!(
            matches!(&refused, RelayAction::Refuse { gainer: 5, gainer_id: 200, why } if why.contains("at most")),
            "{refused:?}"
        );
        let other = r.fetch(6, 300, &[(6, 1, 30)], vec![3]);
        assert!(
            matches!(other, RelayAction::Ask { owner: 3, .. }),
            "{other:?}"
        );
        // Gainer 5's first copy ends (its last chunk): it may ask again.
        assert!(r.chunk(3, 1, false, true).is_some());
        let again = r.fetch(5, 201, &[(5, 1, 30)], vec![3]);
        assert!(
            matches!(again, RelayAction::Ask { owner: 3, .. }),
            "{again:?}"
        );
    }

    #[test]
    fn an_owner_that_cannot_copy_hands_over_before_a_byte_went_out_and_not_after() {
        let mut r = Relays::default();
        let (first, id) = ask(&r.fetch(9, 1, &[(9, 2, 3)], vec![1, 2, 3]));
        // Refusal before any chunk: the next owner is asked, and so on, then the gainer hears.
        let (second, again) = ask(&next(r.chunk(first, id, true, false)));
        assert_eq!(again, id);
        assert_ne!(second, first);
        assert_eq!(
            r.chunk(first, id, false, false),
            None,
            "the old owner is out"
        );
        let (third, _) = ask(&next(r.chunk(second, id, true, false)));
        let mut all = vec![first, second, third];
        all.sort_unstable();
        assert_eq!(all, [1, 2, 3]);
        assert_eq!(
            r.chunk(third, id, true, false),
            Some(ChunkRoute::Forward {
                gainer: 9,
                gainer_id: 1
            })
        );
        assert!(r.is_empty());
        // After a byte went out, an error ends the stream at the gainer.
        let (o, id) = ask(&r.fetch(9, 2, &[(9, 2, 3)], vec![1, 2]));
        r.chunk(o, id, false, false).unwrap();
        assert!(matches!(
            r.chunk(o, id, true, false),
            Some(ChunkRoute::Forward { .. })
        ));
        assert!(r.is_empty());
    }

    #[test]
    fn bad_requests_and_lost_links_answer_the_gainer() {
        let mut r = Relays::default();
        for (entries, owners, want) in [
            (vec![], vec![1], "exactly one"),
            (vec![(4, 1, 1), (4, 1, 2)], vec![1], "exactly one"),
            (vec![(3, 1, 1)], vec![1], "not the asker's"),
            (vec![(4, 1, 1)], vec![4], "no other connected device"),
        ] {
            match r.fetch(4, 8, &entries, owners) {
                RelayAction::Refuse {
                    gainer,
                    gainer_id,
                    why,
                } => {
                    assert_eq!((gainer, gainer_id), (4, 8));
                    assert!(why.contains(want), "{why}");
                }
                other => panic!("{other:?}"),
            }
        }
        // Spread: copies start at different owners.
        let (a, _) = ask(&r.fetch(4, 1, &[(4, 1, 1)], vec![1, 2]));
        let (b, b_id) = ask(&r.fetch(5, 1, &[(5, 1, 1)], vec![1, 2]));
        assert_ne!(a, b);
        // The owner of the first is lost: its gainer hears; the second's gainer is lost: its
        // owner is told to cancel the stream (it would wait for acknowledgements).
        let lost = r.lost(a, "dev-a");
        assert_eq!(lost.len(), 1);
        assert!(
            matches!(&lost[0], RelayAction::Refuse { gainer: 4, why, .. } if why.contains("dev-a"))
        );
        let cancel = r.lost(5, "dev-5");
        assert_eq!(
            cancel,
            vec![RelayAction::Ack {
                owner: b,
                id: b_id,
                bytes: expertmesh_transport::codec::COPY_CANCELLED
            }]
        );
        assert!(r.is_empty());
    }
}
