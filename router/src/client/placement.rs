//! Asking a router to apply a placement to the running fabric (the frontend side of
//! [`crate::rebalance`]).
//!
//! Why this exists: `expertmesh rebalance` and the rebalance bench send the same request and
//! read the same answer; the frame details live here once.

use expertmesh_transport::codec::{
    Body, ErrorCode, Placement, PlacementOp, encode_placement_entries,
};
use expertmesh_transport::frontend::{FrameConnection, FrontendError};
use std::time::Duration;

/// A placement the router reports served.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Applied {
    /// The placement version every device announced.
    pub version: u64,
    /// Experts loaded over every device.
    pub loaded: u32,
    /// Experts released over every device.
    pub released: u32,
    /// From the router taking the request to the last device's announcement.
    pub took: Duration,
    /// Set when some device did not confirm releasing what it lost (lost, refused, or
    /// silent past the step's timeout): which, and why. The placement is served; those
    /// releases are not counted in `released`.
    pub unconfirmed: Option<String>,
}

impl Applied {
    /// What a router's `Applied` answer says.
    pub fn of(p: &Placement) -> Self {
        Self {
            version: p.version,
            loaded: p.loaded,
            released: p.released,
            took: Duration::from_millis(u64::from(p.millis)),
            unconfirmed: (!p.message.is_empty()).then(|| p.message.clone()),
        }
    }
}

/// Why a placement was not applied.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ApplyError {
    /// The router refused the change or it failed; the message says why and what the fabric
    /// serves (the old placement, or which devices did not confirm).
    #[error("{0}")]
    Refused(String),
    /// This frontend may not change the placement (it is not one of the router's placement
    /// admins, `router --placement-admins`); nothing was changed.
    #[error("{0}")]
    NotPermitted(String),
    /// The connection to the router failed.
    #[error("{0}")]
    Transport(#[from] FrontendError),
    /// No answer came within the wait.
    #[error("no answer from the router within {0:?}")]
    NoAnswer(Duration),
    /// The router answered with another frame, or an answer to another request.
    #[error("the router answered with an unexpected {0} frame")]
    Unexpected(String),
}

/// How long the answer to a change whose steps each get `timeout` may take: the survey, the
/// load and release steps, and an undo after a failure, plus 10 s. The client waits this
/// long; the router keeps a connection that is done sending open this long for it.
pub(crate) fn answer_within(timeout: Duration) -> Duration {
    4 * timeout + Duration::from_secs(10)
}

/// Asks the router on `conn` to apply `entries` ((mesh rank, layer, expert); every worker of
/// the fabric is targeted, one without entries is emptied), each step of the change within
/// `timeout`, and waits for its answer (the survey, the load and release steps, and an undo
/// each get the timeout).
pub async fn apply_placement(
    conn: &mut FrameConnection,
    request_id: u64,
    entries: &[(u32, u32, u32)],
    timeout: Duration,
) -> Result<Applied, ApplyError> {
    let mut p = Placement::new(PlacementOp::Apply, 0, entries.len());
    p.request_id = request_id;
    p.millis = u32::try_from(timeout.as_millis()).unwrap_or(u32::MAX);
    conn.write_frame(&Body::Placement(p), &encode_placement_entries(entries))
        .await?;
    let wait = answer_within(timeout);
    let frame = tokio::time::timeout(wait, conn.read_frame())
        .await
        .map_err(|_| ApplyError::NoAnswer(wait))??;
    match frame.body() {
        Body::Placement(p) if p.op == PlacementOp::Applied && p.request_id != request_id => {
            Err(ApplyError::Unexpected(format!(
                "Applied (of request {}, not this request {request_id})",
                p.request_id
            )))
        }
        Body::Error(e) if e.request_id != request_id && e.request_id != 0 => {
            Err(ApplyError::Unexpected(format!(
                "Error (of request {}, not this request {request_id}: {})",
                e.request_id, e.message
            )))
        }
        Body::Placement(p) if p.op == PlacementOp::Applied => Ok(Applied::of(p)),
        Body::Error(e) if e.code == ErrorCode::NotPermitted => {
            Err(ApplyError::NotPermitted(e.message.clone()))
        }
        Body::Error(e) => Err(ApplyError::Refused(e.message.clone())),
        other => Err(ApplyError::Unexpected(format!("{:?}", other.kind()))),
    }
}
