//! The benches' error: why a bench (or the fault cluster and the soak built on the same
//! method) could not run to its report.
//!
//! Why this exists: every bench is a library function the binary calls (and the integration
//! tests import the soak's fault cluster), so the benches return one typed error their callers
//! can match on, and only the binary turns it into a message and an exit code. Variants go by
//! concern: the options, the fabric and deployment the bench starts, the in-process
//! reference, the checkpoint and conversion, the transport, the emulated network and its
//! processes, the report files, and I/O with what was being done.
//!
//! Every message includes its cause (the lower error's own message, which names the file, the
//! process or the peer), and no variant exposes that cause as [`std::error::Error::source`]:
//! the binary prints errors with their chain (`{:#}`), which would otherwise say it twice.
//! The lower errors stay typed in their variants.

use crate::kernels::EffortError;
use crate::method::json::ReadError;
use crate::method::report::ReportError;
use expertmesh_backend::BackendError;
use expertmesh_checkpoint::convert::ConvertError;
use expertmesh_checkpoint::experts::{ExpertError, Family};
use expertmesh_checkpoint::hf_config::HfConfigError;
use expertmesh_checkpoint::safetensors::SafetensorsError;
use expertmesh_fabric::FabricError;
use expertmesh_planner::PlanError;
use expertmesh_quant::format::FormatError;
use expertmesh_router::client::ClientError;
use expertmesh_topology::{FileError, ResolveError};
use expertmesh_transport::crypto::KeyError;
use expertmesh_transport::mesh::{LinkKind, PeerError, StartError};
use expertmesh_worker::deploy::DeployError;
use expertmesh_worker::weights::WeightsError;
use std::path::PathBuf;
use std::time::Duration;

/// The in-process reference backend of the worker (every expert of some layers on one CPU
/// backend).
type ReferenceBackendError = expertmesh_worker::weights::ReferenceError;
/// A layer run on the in-process reference backend.
type ReferenceLayerError = expertmesh_router::reference::ReferenceError;

/// Why a bench could not run to its report.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BenchError {
    // --- options
    /// An option is out of range; the message names it and what it takes.
    #[error("{0}")]
    Options(String),
    /// The kernel bench's pool or time budget does not fit the machine.
    #[error("{0}")]
    Effort(EffortError),
    /// `--nice` could not be applied.
    #[error("--nice {nice}: {cause}")]
    Nice {
        /// The niceness asked for.
        nice: i32,
        /// Why.
        cause: std::io::Error,
    },
    /// The fault cluster's node sizes do not match its devices.
    #[error(
        "node sizes {sizes:?} must add up to the {devices} devices (one per node with namespaces)"
    )]
    NodeSizes {
        /// Devices per node.
        sizes: Vec<usize>,
        /// Devices in the placement.
        devices: usize,
    },
    /// A built-in model preset the bench runs is missing.
    #[error("{0} preset")]
    NoPreset(String),

    // --- the fabric, the deployment and the files the bench writes
    /// A local fabric (or its default files or wire model) could not start.
    #[error("{0}")]
    Fabric(Box<FabricError>),
    /// The deployment could not be loaded, or a device or endpoint of it looked up.
    #[error("{0}")]
    Deploy(Box<DeployError>),
    /// A device's converted weights could not be loaded.
    #[error("{0}")]
    Weights(Box<WeightsError>),
    /// A topology, model or placement file the bench wrote could not be read back.
    #[error("{0}")]
    File(FileError),
    /// The model file the bench wrote is not a valid model.
    #[error("{0}")]
    Model(ResolveError),
    /// The planner found no placement for the bench's cluster; `what` says which.
    #[error("{what}: {cause}")]
    Plan {
        /// What was being planned.
        what: &'static str,
        /// Why.
        cause: PlanError,
    },
    /// A converted folder the bench made has no weights in its deployment.
    #[error("no weights")]
    NoWeights,
    /// The worker load from a tile cache did not do what it measures (keep, then map).
    #[error("worker load from the tile cache: {0}")]
    TileCache(String),

    // --- the in-process reference and the backends
    /// The in-process reference backend could not be built.
    #[error("{0}")]
    ReferenceBackend(ReferenceBackendError),
    /// A layer run on the in-process reference failed.
    #[error("{0}")]
    ReferenceLayer(ReferenceLayerError),
    /// The golden answers' reference backend could not be built.
    #[error("reference: {0}")]
    GoldenBackend(ReferenceBackendError),
    /// A golden answer's layer run failed.
    #[error("reference: {0}")]
    GoldenLayer(ReferenceLayerError),
    /// The golden inputs do not route to the wanted experts often enough.
    #[error("only {found} of {wanted} inputs route to the wanted experts")]
    NotConfined {
        /// Inputs found.
        found: usize,
        /// Inputs wanted.
        wanted: usize,
    },
    /// A backend refused to start, load or run.
    #[error("{0}")]
    Backend(BackendError),
    /// A device's backend refused its shard's experts.
    #[error("{device}: {cause}")]
    DeviceBackend {
        /// The device's id.
        device: String,
        /// Why.
        cause: BackendError,
    },
    /// Weights could not be generated or quantized.
    #[error("{0}")]
    Format(FormatError),

    // --- checkpoints and conversion
    /// The synthetic checkpoint could not be written or read.
    #[error("{0}")]
    Checkpoint(Box<SafetensorsError>),
    /// A checkpoint tensor could not be read as f32 values.
    #[error("{}: {cause}", dir.display())]
    Tensor {
        /// The checkpoint folder.
        dir: PathBuf,
        /// Why.
        cause: Box<SafetensorsError>,
    },
    /// The checkpoint's config.json could not be read as a model.
    #[error("{0}")]
    HfConfig(HfConfigError),
    /// The checkpoint's config reads as another model family than the bench wrote.
    #[error("the config reads as {0:?}")]
    Family(Family),
    /// The checkpoint's expert tensors could not be named or their format read.
    #[error("{0}")]
    Expert(Box<ExpertError>),
    /// The conversion failed.
    #[error("converting: {0}")]
    Convert(Box<ConvertError>),
    /// A conversion into a fresh folder reported a shard kept from before.
    #[error("a fresh folder kept a shard")]
    ShardKept,

    // --- routers, the transport and its peers
    /// A frontend's call (or its connection) failed.
    #[error("{0}")]
    Client(Box<ClientError>),
    /// A frontend of router `router` could not connect.
    #[error("router {router}: {cause}")]
    RouterClient {
        /// The router instance.
        router: usize,
        /// Why.
        cause: Box<ClientError>,
    },
    /// A router did not answer a call in time after start.
    #[error("router {router} not ready after 60 s: {cause} ({last})")]
    NotReady {
        /// The router instance.
        router: usize,
        /// The last attempt's error.
        cause: Box<BenchError>,
        /// The attempt's error before it.
        last: String,
    },
    /// The mesh of the transport bench could not start or connect.
    #[error("{0}")]
    Mesh(StartError),
    /// A frame could not be sent to a peer.
    #[error("{0}")]
    Peer(PeerError),
    /// The peer did not acknowledge a burst of frames.
    #[error("no {0} ack from rank 1")]
    NoAck(String),
    /// The peer did not answer a ping.
    #[error("no answer from rank 1")]
    NoAnswer,
    /// The link asked for fell back to another kind.
    #[error("{} link could not be set up (fell back to {got:?})", link.name())]
    LinkFallback {
        /// The link asked for.
        link: LinkKind,
        /// The link set up instead.
        got: Option<LinkKind>,
    },
    /// A key or credential could not be made.
    #[error("{0}")]
    Key(KeyError),
    /// A task of the bench failed (panicked or was cancelled).
    #[error("{0}")]
    Join(tokio::task::JoinError),
    /// A thread of the bench panicked; the message names it.
    #[error("{0} panicked")]
    Panicked(&'static str),

    // --- the emulated network and the processes in it
    /// A system command (`ip`, `tc`, `iptables`) failed.
    #[error("`{program} {}` failed: {stderr}", args.join(" "))]
    Command {
        /// The program.
        program: String,
        /// Its arguments.
        args: Vec<String>,
        /// What it printed on stderr.
        stderr: String,
    },
    /// Creating the first namespace failed: no permission (or no iproute2).
    #[error("network namespaces not permitted: {0}")]
    NamespacesNotPermitted(Box<BenchError>),
    /// A thread could not enter a namespace.
    #[error("setns({path}): {cause}")]
    Setns {
        /// The namespace file.
        path: String,
        /// Why.
        cause: std::io::Error,
    },
    /// A command's output is not the JSON expected.
    #[error("{what}: not JSON: {cause}")]
    NotJson {
        /// The command.
        what: String,
        /// Why.
        cause: serde_json::Error,
    },
    /// A process of the emulated cluster exited (the message names it and its status).
    #[error("{0}")]
    ProcessExited(String),
    /// A process of the fault cluster exited while starting.
    #[error("{process} exited ({status}):\n{log_tail}")]
    ExitedAtStart {
        /// "router 0" or "worker cpu1".
        process: String,
        /// Its exit status.
        status: String,
        /// The last lines of its log.
        log_tail: String,
    },
    /// A router of the fault cluster did not start listening in time.
    #[error("router {router} did not start:\n{log_tail}")]
    RouterDidNotStart {
        /// The router instance.
        router: usize,
        /// The last lines of its log.
        log_tail: String,
    },
    /// A worker of the fault cluster did not load its experts in time.
    #[error("worker cpu{device} did not load:\n{log_tail}")]
    WorkerDidNotLoad {
        /// The device.
        device: usize,
        /// The last lines of its log.
        log_tail: String,
    },
    /// A router did not take a worker up in time.
    #[error(
        "router {router} did not take worker {worker} up within {timeout:?}\n{router_log}\n{worker_log}"
    )]
    NotTakenUp {
        /// The router instance.
        router: usize,
        /// The device's id.
        worker: String,
        /// How long it waited.
        timeout: Duration,
        /// The last lines of the router's log.
        router_log: String,
        /// The last lines of the worker's log.
        worker_log: String,
    },
    /// A process that is not running was asked to pause or resume ("router 0", "worker 1").
    #[error("{0} is not running")]
    NotRunning(String),
    /// A signal could not be sent to a process.
    #[error("signal {signal} to {pid}: {cause}")]
    Signal {
        /// The signal.
        signal: i32,
        /// The process.
        pid: u32,
        /// Why.
        cause: std::io::Error,
    },
    /// A stopped process's threads did not all stop.
    #[error("process {0} did not stop within 2 s")]
    DidNotStop(u32),
    /// A fault needs network namespaces and the cluster runs on loopback.
    #[error("partitions and slow links need network namespaces")]
    NeedsNamespaces,
    /// No run of consecutive free loopback ports was found.
    #[error("no {0} consecutive free ports")]
    NoConsecutivePorts(usize),
    /// An address the bench built does not parse.
    #[error("{0}")]
    Address(std::net::AddrParseError),

    // --- reports
    /// A bench report could not be read.
    #[error("{0}")]
    ReadReport(ReadError),
    /// A report page could not be written.
    #[error("{0}")]
    Report(ReportError),
    /// A bench report (JSON) could not be written.
    #[error("cannot write bench report {}: {cause}", path.display())]
    WriteReport {
        /// The file.
        path: PathBuf,
        /// Why.
        cause: std::io::Error,
    },
    /// JSON could not be written or read.
    #[error("{0}")]
    Json(serde_json::Error),
    /// The routers' counts do not form load statistics of the model.
    #[error("load statistics: {0}")]
    LoadStats(String),

    // --- I/O
    /// An I/O operation failed; `what` says which (a file, a process, a port).
    #[error("{what}: {cause}")]
    IoWhile {
        /// What was being done.
        what: String,
        /// Why.
        cause: std::io::Error,
    },
    /// An I/O error whose own message says all there is (a socket, a temporary file).
    #[error("{0}")]
    Io(std::io::Error),
}

impl BenchError {
    /// A closure wrapping an I/O error with what was being done.
    pub(crate) fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> Self {
        let what = what.into();
        move |cause| Self::IoWhile { what, cause }
    }
}

/// `From` for the lower errors that bench code propagates with `?` as they are (their own
/// message says all; no variant makes them a source). The large ones are boxed in their
/// variants, so that a `Result<_, BenchError>` stays small.
macro_rules! from_cause {
    ($($variant:ident($ty:ty)),* $(,)?) => {
        $(impl From<$ty> for BenchError {
            fn from(e: $ty) -> Self {
                Self::$variant(e.into())
            }
        })*
    };
}

from_cause!(
    Effort(EffortError),
    Fabric(FabricError),
    Deploy(DeployError),
    Weights(WeightsError),
    Backend(BackendError),
    Format(FormatError),
    Checkpoint(SafetensorsError),
    Expert(ExpertError),
    Convert(ConvertError),
    Client(ClientError),
    Mesh(StartError),
    Peer(PeerError),
    Key(KeyError),
    Join(tokio::task::JoinError),
    Address(std::net::AddrParseError),
    ReadReport(ReadError),
    Report(ReportError),
    Json(serde_json::Error),
    Io(std::io::Error),
);

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error;

    /// The messages built from several fields read as they did when they were formatted in
    /// place, and none exposes its cause as a source.
    #[test]
    fn messages_read_as_before() {
        let e = BenchError::Command {
            program: "ip".into(),
            args: vec!["netns".into(), "add".into(), "x".into()],
            stderr: "denied".into(),
        };
        assert_eq!(e.to_string(), "`ip netns add x` failed: denied");
        let e = BenchError::NamespacesNotPermitted(Box::new(e));
        assert_eq!(
            e.to_string(),
            "network namespaces not permitted: `ip netns add x` failed: denied"
        );
        assert!(e.source().is_none());
        let e = BenchError::LinkFallback {
            link: LinkKind::Shm,
            got: Some(LinkKind::Tcp),
        };
        assert_eq!(
            e.to_string(),
            "shm link could not be set up (fell back to Some(Tcp))"
        );
        let e = BenchError::io("picking free ports")(std::io::Error::other("none"));
        assert_eq!(e.to_string(), "picking free ports: none");
        assert!(e.source().is_none());
    }
}
