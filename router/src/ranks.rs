//! How the router names the mesh ranks it talks to, in messages, logs and metrics.
//!
//! Why this exists: mesh ranks are the routers first, then one rank per device, and a device
//! is named by its topology name and its topology rank (its mesh rank minus the number of
//! routers). How many routers there are comes from the deployment
//! (`Deployment::router_count`), never guessed from the names, so the core, the service and
//! the metrics name every rank alike whatever the names look like.

/// The names of the mesh ranks: the routers (the first [`RankNames::routers`]), then the
/// devices.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RankNames {
    names: Vec<String>,
    routers: u32,
}

impl RankNames {
    /// `names[r]` names mesh rank `r`; the first `routers` ranks are the routers.
    pub fn new(names: Vec<String>, routers: u32) -> Self {
        Self { names, routers }
    }

    /// The number of routers (mesh ranks `0..routers()`).
    pub fn routers(&self) -> u32 {
        self.routers
    }

    /// The names, by mesh rank.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// The number of named ranks.
    pub fn len(&self) -> usize {
        self.names.len()
    }

    /// Whether no rank is named.
    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }

    /// How messages name mesh rank `rank`: a router by its name, a device by its name and its
    /// topology rank (`"node0/cpu1 (rank 1)"`).
    pub fn label(&self, rank: u32) -> String {
        let routers = self.routers.max(1);
        match self.names.get(rank as usize) {
            Some(n) if rank < routers => n.clone(),
            Some(n) => format!("{n} (rank {})", rank - routers),
            None if rank == 0 => "router".into(),
            None => format!("device rank {}", rank.saturating_sub(routers)),
        }
    }

    /// [`RankNames::label`] of every named rank.
    pub fn labels(&self) -> Vec<String> {
        (0..self.names.len() as u32)
            .map(|r| self.label(r))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_are_named_with_their_topology_rank_whatever_their_names() {
        let names = ["router 0", "router 1", "cpu0", "node1/cpu0"].map(String::from);
        let r = RankNames::new(names.to_vec(), 2);
        assert_eq!(
            r.labels(),
            [
                "router 0",
                "router 1",
                "cpu0 (rank 0)",
                "node1/cpu0 (rank 1)"
            ]
        );
        assert_eq!(r.label(7), "device rank 5");
        assert_eq!(RankNames::default().label(0), "router");
    }
}
