//! The fabric's error: why a local fabric, its credentials, its observers or its default files
//! could not be set up.
//!
//! Why this exists: the launcher is a library (the binary, the benches and the tests start
//! fabrics), so it returns one typed error its callers can match on, and only the binary turns
//! it into a message and an exit code. Every message includes its cause (the lower error's own
//! message, which names the file or the process), and no variant exposes that cause as
//! [`std::error::Error::source`]: the binary prints errors with their chain (`{:#}`), which
//! would otherwise say it twice. The lower errors stay typed in their variants.

use expertmesh_planner::PlanError;
use expertmesh_router::metrics::http::MetricsServerError;
use expertmesh_router::service::ServiceError;
use expertmesh_topology::{FileError, ResolveError};
use expertmesh_transport::codec::CodecError;
use expertmesh_transport::crypto::KeyError;
use expertmesh_worker::deploy::DeployError;
use expertmesh_worker::process::WorkerError;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// Why a fabric (or a part of one) could not start or be changed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FabricError {
    /// The deployment could not be loaded, or a device, router or endpoint of it looked up.
    #[error("{0}")]
    Deploy(DeployError),
    /// A router's core (its gates, its shared experts) could not be built.
    #[error("{0}")]
    Worker(WorkerError),
    /// The topology file could not be read or is invalid.
    #[error("{0}")]
    Topology(FileError),
    /// The model is neither a preset nor a readable, valid model file.
    #[error("{0}")]
    Model(ResolveError),
    /// The planner found no placement of the model on the cluster.
    #[error("no placement of {model} fits {cluster}: {cause}; see `expertmesh plan`")]
    NoPlacement {
        /// The model's name.
        model: String,
        /// The cluster's name.
        cluster: String,
        /// Why.
        cause: PlanError,
    },
    /// A master key or credential file could not be read or written.
    #[error("{0}")]
    Key(KeyError),
    /// The credential file given is not for this cluster, rank or role.
    #[error("--credentials: {0}")]
    WrongCredentials(String),
    /// No credentials, on an address other hosts can reach, without `--insecure`.
    #[error(
        "no credentials for non-loopback address(es) {}: pass --credentials FILE (make one \
         with `expertmesh keys init` and `expertmesh keys issue`), or --insecure to run \
         unauthenticated and unencrypted",
        exposed.join(", ")
    )]
    Insecure {
        /// The non-loopback addresses.
        exposed: Vec<String>,
    },
    /// A credential was asked for a router the topology does not declare.
    #[error("router {instance} does not exist: the topology has {routers} router(s)")]
    NoSuchRouter {
        /// The instance asked for.
        instance: u32,
        /// How many routers the topology declares.
        routers: u32,
    },
    /// A credential was asked for a device that is neither an id nor a rank of the topology.
    #[error("no device {which:?} in the topology; devices are {}", devices.join(", "))]
    NoSuchDevice {
        /// What was asked for.
        which: String,
        /// The topology's device ids.
        devices: Vec<String>,
    },
    /// A frontend name that is empty or too long.
    #[error("a frontend name must be 1 to 255 bytes")]
    FrontendName,
    /// A router service could not start.
    #[error("router {instance}: {cause}")]
    RouterStart {
        /// The router instance.
        instance: u32,
        /// Why.
        cause: ServiceError,
    },
    /// A router service started without a mesh address.
    #[error("router {0}'s mesh has no address")]
    RouterMeshAddress(u32),
    /// A worker process exited before it connected.
    #[error(
        "worker {worker} failed to start: it exited ({status}) before connecting to the \
         router\n{log_tail}"
    )]
    WorkerExited {
        /// The device, as "node/device (rank N)".
        worker: String,
        /// Its exit status.
        status: String,
        /// The last lines of its log.
        log_tail: String,
    },
    /// Worker processes did not connect in time.
    #[error("workers {} did not connect within {timeout:?}\n{log_tail}", workers.join(", "))]
    WorkersTimeout {
        /// The devices still missing, as "node/device (rank N)".
        workers: Vec<String>,
        /// How long the launcher waited.
        timeout: Duration,
        /// The last lines of their logs.
        log_tail: String,
    },
    /// A router instance the fabric does not have.
    #[error("router {0} does not exist")]
    UnknownRouter(usize),
    /// A restarted router's core did not take every worker up in time.
    #[error("router {0} restarted but its core did not take every worker up")]
    RouterNotTakingUp(usize),
    /// A device the fabric does not have.
    #[error("no device {0}")]
    UnknownDevice(usize),
    /// A worker that is not running was asked to take a signal.
    #[error("worker {0} is not running")]
    WorkerNotRunning(usize),
    /// A signal could not be sent to a worker.
    #[error("signal {signal} to worker {worker}: {cause}")]
    Signal {
        /// The signal.
        signal: i32,
        /// The device rank.
        worker: usize,
        /// Why.
        cause: std::io::Error,
    },
    /// A restarted worker connected but a router did not take it up in time.
    #[error("worker {0} connected but a router did not take it up")]
    WorkerNotTakenUp(String),
    /// `--metrics` ports past the last port.
    #[error("--metrics {base}: process {process} would need a port past 65535")]
    MetricsPort {
        /// The base address.
        base: SocketAddr,
        /// The process (routers first, then workers).
        process: usize,
    },
    /// A router's `/metrics` endpoint could not start.
    #[error("router {instance}: {cause}")]
    RouterMetrics {
        /// The router instance.
        instance: usize,
        /// Why.
        cause: MetricsServerError,
    },
    /// `--load-stats-every` is not a positive number of seconds.
    #[error("--load-stats-every {0}: give a positive number of seconds")]
    LoadStatsEvery(f64),
    /// The automatic rebalancing options are out of range.
    #[error("--auto-rebalance: {0}")]
    AutoRebalance(String),
    /// The routers' counts do not form load statistics of the model.
    #[error("load statistics: {0}")]
    LoadStats(String),
    /// The live load file exists but cannot be read as this model's load statistics (to be
    /// resumed from).
    #[error(
        "--load-stats: {} exists but cannot be resumed from ({cause}); move it away or give another file",
        path.display()
    )]
    ResumeLoadStats {
        /// The file.
        path: PathBuf,
        /// Why.
        cause: expertmesh_planner::stats::StatsError,
    },
    /// The live load file could not be written.
    #[error("--load-stats: cannot write {}: {cause}", path.display())]
    WriteLoadStats {
        /// The file.
        path: PathBuf,
        /// Why.
        cause: std::io::Error,
    },
    /// The transport codec refused a frame shape while measuring the wire model.
    #[error("{0}")]
    Wire(CodecError),
    /// An I/O operation failed; `what` says which (a file, a process, a port).
    #[error("{what}: {cause}")]
    IoWhile {
        /// What was being done.
        what: String,
        /// Why.
        cause: std::io::Error,
    },
    /// An I/O error whose own message says all there is (a temporary file, a pipe, a runtime).
    #[error("{0}")]
    Io(std::io::Error),
    /// The files for a cluster engine (`expertmesh deploy`) could not be made: the message
    /// names the option or file and what to do.
    #[error("{0}")]
    Engine(String),
}

impl FabricError {
    /// A closure wrapping an I/O error with what was being done.
    pub(crate) fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> Self {
        let what = what.into();
        move |cause| Self::IoWhile { what, cause }
    }
}

impl From<DeployError> for FabricError {
    fn from(e: DeployError) -> Self {
        Self::Deploy(e)
    }
}

impl From<WorkerError> for FabricError {
    fn from(e: WorkerError) -> Self {
        Self::Worker(e)
    }
}

impl From<KeyError> for FabricError {
    fn from(e: KeyError) -> Self {
        Self::Key(e)
    }
}

impl From<std::io::Error> for FabricError {
    fn from(e: std::io::Error) -> Self {
        Self::Io(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error;

    /// The messages built from several fields read as they did when they were formatted in
    /// place, and none exposes its cause as a source.
    #[test]
    fn messages_read_as_before() {
        let e = FabricError::WorkerExited {
            worker: "local/cpu0 (rank 0)".into(),
            status: "exit status: 2".into(),
            log_tail: "--- last lines\n".into(),
        };
        assert_eq!(
            e.to_string(),
            "worker local/cpu0 (rank 0) failed to start: it exited (exit status: 2) before \
             connecting to the router\n--- last lines\n"
        );
        let e = FabricError::Insecure {
            exposed: vec!["10.0.0.1:1".into(), "10.0.0.2:1".into()],
        };
        assert_eq!(
            e.to_string(),
            "no credentials for non-loopback address(es) 10.0.0.1:1, 10.0.0.2:1: pass \
             --credentials FILE (make one with `expertmesh keys init` and `expertmesh keys \
             issue`), or --insecure to run unauthenticated and unencrypted"
        );
        let e = FabricError::io("killing a worker")(std::io::Error::other("gone"));
        assert_eq!(e.to_string(), "killing a worker: gone");
        assert!(e.source().is_none());
    }
}
