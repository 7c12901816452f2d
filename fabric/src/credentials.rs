//! Credentials for a fabric's processes: whom a credential is for, issuing one from the
//! cluster master key, loading a process's own, and the local launcher's per-process files.
//!
//! Why this exists: every principal must authenticate with its own keys (a worker's file
//! cannot act as another rank, a frontend's cannot join the mesh); `expertmesh keys issue`,
//! `expertmesh up --key` and every serving command (`--credentials`, `--insecure`) share this
//! logic. The derivation itself is [`expertmesh_transport::crypto`]'s. Running without
//! credentials is allowed on loopback (tests, the demo; logged at info) and elsewhere only when
//! the operator says `--insecure` (a warning at start); the legacy `EXPERTMESH_SECRET` still
//! works and still encrypts, but any holder can claim any rank: a warning says so.

use crate::FabricError;
use expertmesh_transport::crypto::{self, Credentials, Identity, Key};
use expertmesh_worker::deploy::Deployment;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Whom a credential is for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Principal {
    /// A device (worker), by id or topology rank.
    Device(String),
    /// A router instance.
    Router(u32),
    /// A named frontend.
    Frontend(String),
}

impl Principal {
    /// "device N/D", "router I" or "frontend \"NAME\"", for messages.
    pub fn describe(&self) -> String {
        match self {
            Self::Device(d) => format!("device {d}"),
            Self::Router(i) => format!("router {i}"),
            Self::Frontend(n) => format!("frontend {n:?}"),
        }
    }
}

/// Issues `who`'s credential for the cluster of `topo`.
pub fn issue(
    master: &Key,
    topo: &expertmesh_topology::topology::Topology,
    who: &Principal,
) -> Result<Credentials, FabricError> {
    let routers = (topo.routers().len() as u32).max(1);
    let world = routers + topo.devices().len() as u32;
    let cluster = topo.name();
    Ok(match who {
        Principal::Router(i) => {
            if *i >= routers {
                return Err(FabricError::NoSuchRouter {
                    instance: *i,
                    routers,
                });
            }
            Credentials::issue_rank(master, cluster, *i, world, routers)
        }
        Principal::Device(d) => {
            let rank = match topo.device_by_id(d) {
                Some(dev) => dev.rank().0,
                None => match d.parse::<u32>() {
                    Ok(n) if (n as usize) < topo.devices().len() => n,
                    _ => {
                        return Err(FabricError::NoSuchDevice {
                            which: d.clone(),
                            devices: topo.devices().iter().map(|x| x.id().to_string()).collect(),
                        });
                    }
                },
            };
            Credentials::issue_rank(master, cluster, routers + rank, world, routers)
        }
        Principal::Frontend(name) => {
            if name.is_empty() || name.len() > expertmesh_transport::codec::MAX_IDENTITY_BYTES {
                return Err(FabricError::FrontendName);
            }
            Credentials::issue_frontend(master, cluster, name, routers)
        }
    })
}

/// How a serving process authenticates: its credential file (`--credentials`), and whether
/// it may run without one off loopback (`--insecure`).
#[derive(Debug, Clone, Default)]
pub struct Security {
    /// This process's credential file (`expertmesh keys issue`).
    pub credentials: Option<PathBuf>,
    /// Run without credentials on a non-loopback address (unauthenticated, unencrypted).
    pub insecure: bool,
}

impl Security {
    /// Loads the credential file, if given.
    pub fn load(&self) -> Result<Option<Arc<Credentials>>, FabricError> {
        self.credentials
            .as_deref()
            .map(|p| Credentials::load(p).map(Arc::new).map_err(FabricError::Key))
            .transpose()
    }

    /// Sets `dep`'s credentials for mesh rank `rank` (the file given, or the legacy secret)
    /// and checks the run may go on without them at `addrs`.
    pub fn apply_rank(
        &self,
        dep: &mut Deployment,
        rank: u32,
        addrs: &[SocketAddr],
    ) -> Result<(), FabricError> {
        if let Some(c) = self.load()? {
            c.check_rank(dep.topology.name(), rank)
                .map_err(FabricError::WrongCredentials)?;
            dep.credentials = Some(c);
        }
        check_security(dep.credentials.as_deref(), self.insecure, addrs)
    }

    /// A frontend's credentials (the file given, or the legacy secret from the environment)
    /// for `cluster`, checked against reaching `addrs`.
    pub fn frontend(
        &self,
        cluster: &str,
        addrs: &[SocketAddr],
    ) -> Result<Option<Arc<Credentials>>, FabricError> {
        let creds = match self.load()? {
            Some(c) => {
                c.check_frontend(cluster)
                    .map_err(FabricError::WrongCredentials)?;
                Some(c)
            }
            None => expertmesh_worker::deploy::secret_from_env()?,
        };
        check_security(creds.as_deref(), self.insecure, addrs)?;
        Ok(creds)
    }
}

/// Refuses to run without credentials on a non-loopback address unless `insecure`, and says
/// at start how this process's traffic is protected.
pub fn check_security(
    creds: Option<&Credentials>,
    insecure: bool,
    addrs: &[SocketAddr],
) -> Result<(), FabricError> {
    let exposed: Vec<String> = addrs
        .iter()
        .filter(|a| !a.ip().is_loopback())
        .map(ToString::to_string)
        .collect();
    match creds.map(Credentials::identity) {
        Some(Identity::SharedSecret) => tracing::warn!(
            "authenticating with the shared secret EXPERTMESH_SECRET: links are encrypted, but \
             any holder of the secret can claim any rank or frontend; issue per-process \
             credentials with `expertmesh keys issue` and pass --credentials"
        ),
        Some(_) => {
            tracing::info!("credentials loaded: every TCP link is authenticated and encrypted")
        }
        None if exposed.is_empty() => tracing::info!(
            "no credentials: links are unauthenticated and unencrypted (allowed on loopback only)"
        ),
        None if insecure => tracing::warn!(
            "running --insecure on {}: all traffic is unauthenticated and unencrypted; anyone \
             who reaches these ports can join the mesh or read activations",
            exposed.join(", ")
        ),
        None => return Err(FabricError::Insecure { exposed }),
    }
    Ok(())
}

/// Credentials a local fabric issues for its own processes from a master key: one file per
/// worker (passed with `--credentials`), the routers' in memory, and a frontend's for clients.
#[derive(Debug, Clone)]
pub struct LocalCredentials {
    master: Key,
    cluster: String,
    dir: PathBuf,
}

impl LocalCredentials {
    /// Reads the master key at `key` for the cluster of `dep`; files go to `dir`.
    pub fn new(key: &Path, dep: &Deployment, dir: &Path) -> Result<Self, FabricError> {
        let master = crypto::load_master_key(key)?;
        Ok(Self {
            master,
            cluster: dep.topology.name().to_owned(),
            dir: dir.to_path_buf(),
        })
    }

    /// Router `instance`'s credentials.
    pub fn router(&self, dep: &Deployment, instance: u32) -> Arc<Credentials> {
        Arc::new(Credentials::issue_rank(
            &self.master,
            &self.cluster,
            instance,
            dep.world_size(),
            dep.router_count(),
        ))
    }

    /// Writes device `d`'s credential file and returns its path. Issuing is deterministic, so
    /// a file already there with the same text is kept (a restarted worker reads it again); one
    /// with other text (left in a caller's folder by an earlier fabric of another key or
    /// topology) is replaced, never handed to the worker.
    pub(crate) fn worker_file(&self, dep: &Deployment, d: u32) -> Result<PathBuf, FabricError> {
        let path = self.dir.join(format!("device-{d}.cred"));
        let text = Credentials::issue_rank(
            &self.master,
            &self.cluster,
            dep.router_count() + d,
            dep.world_size(),
            dep.router_count(),
        )
        .to_file_text();
        match std::fs::read_to_string(&path) {
            Ok(old) if old == text => return Ok(path),
            Ok(_) => {
                std::fs::remove_file(&path)
                    .map_err(FabricError::io("replacing a stale credential file"))?;
            }
            Err(_) => {}
        }
        crypto::write_secret_file(&path, &text)?;
        Ok(path)
    }

    /// Frontend `name`'s credentials.
    pub fn frontend(&self, dep: &Deployment, name: &str) -> Arc<Credentials> {
        Arc::new(Credentials::issue_frontend(
            &self.master,
            &self.cluster,
            name,
            dep.router_count(),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn insecure_is_needed_off_loopback_only() {
        let lo: SocketAddr = "127.0.0.1:1".parse().unwrap();
        let ext: SocketAddr = "10.0.0.1:1".parse().unwrap();
        assert!(check_security(None, false, &[lo]).is_ok());
        let e = check_security(None, false, &[lo, ext])
            .unwrap_err()
            .to_string();
        assert!(e.contains("--insecure") && e.contains("10.0.0.1"), "{e}");
        assert!(check_security(None, true, &[ext]).is_ok());
        let c = Credentials::shared_secret(b"s");
        assert!(check_security(Some(&c), false, &[ext]).is_ok());
    }
}
