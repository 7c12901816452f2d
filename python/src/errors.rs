//! The client's errors as Python exceptions.
//!
//! Why this exists: Python code handles a refused call by the router's stable error code
//! (`except expertmesh.DeviceDown:`), not by parsing messages. The classes live in
//! `expertmesh/_errors.py` (with their docs); this module classifies a [`ClientError`] and asks
//! `_errors._from_native` for the exception, so the mapping is written once, in Python.

use expertmesh_router::client::ClientError;
use expertmesh_transport::codec::{CodecError, ErrorCode};
use expertmesh_transport::frontend::FrontendError;
use expertmesh_transport::protocol::ProtocolError;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;

/// Why a blocking call did not return a value.
pub(crate) enum Failure {
    /// The client's error.
    Client(ClientError),
    /// A signal handler raised (Ctrl-C) while the call was blocked.
    Interrupted(PyErr),
    /// The client was closed.
    Closed,
    /// A call from a signal handler while a call on the same client runs on this thread.
    Reentrant,
    /// A call in a `fork()` child on a client made by this process id before the fork.
    Forked(u32),
}

static FROM_NATIVE: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

impl Failure {
    /// The Python exception.
    pub(crate) fn into_pyerr(self, py: Python<'_>) -> PyErr {
        match self {
            Failure::Client(e) => client_error(py, &e),
            Failure::Interrupted(e) => e,
            Failure::Closed => PyValueError::new_err("the RouterClient was closed"),
            Failure::Reentrant => PyRuntimeError::new_err(
                "this RouterClient is in a call on this thread (a signal handler interrupted \
                 it): a call from the handler would wait for itself; use another client there, \
                 or close() this one",
            ),
            Failure::Forked(pid) => PyRuntimeError::new_err(format!(
                "this RouterClient was made in process {pid}, before fork(): its connection \
                 belongs to that process (two processes on one connection would read each \
                 other's answers); make a new RouterClient in this process"
            )),
        }
    }
}

/// Classify `e` as `_errors._from_native(kind, code, request_id, message, detail)` expects.
fn classify(e: &ClientError) -> (&'static str, Option<u16>, Option<u64>, String) {
    match e {
        ClientError::Server {
            request_id,
            code,
            message,
        } => (
            "server",
            Some(code.to_u16()),
            Some(*request_id),
            message.clone(),
        ),
        ClientError::Transport(FrontendError::Handshake { source, .. }) => match source {
            ProtocolError::AuthFailed(m) => ("server", Some(8), None, m.clone()),
            ProtocolError::Refused { code, message } => {
                ("server", Some(code.to_u16()), None, message.clone())
            }
            other => ("connection", None, None, other.to_string()),
        },
        // A frame that could not be encoded or decoded while the stream stays framed fails
        // only its request; the connection goes on, so it is not ConnectionFailed. Too large
        // to send is the caller's input (fewer tokens per request); anything else came from
        // the router.
        ClientError::Transport(FrontendError::BadFrame {
            recoverable: true,
            error: CodecError::TooLarge { .. },
            ..
        }) => ("input", None, None, e.to_string()),
        ClientError::Transport(FrontendError::BadFrame {
            recoverable: true,
            request_id,
            ..
        }) => ("protocol", None, *request_id, e.to_string()),
        ClientError::Transport(t) => ("connection", None, None, t.to_string()),
        ClientError::Input(m) => ("input", None, None, m.clone()),
        ClientError::Usage(m) => ("usage", None, None, m.clone()),
        ClientError::Protocol(m) => ("protocol", None, None, m.clone()),
        // The client's own deadline: the same exception as the router's DeadlineExceeded.
        ClientError::Deadline { request_id, .. } => (
            "server",
            Some(ErrorCode::DeadlineExceeded.to_u16()),
            (*request_id != 0).then_some(*request_id),
            e.to_string(),
        ),
        ClientError::Unresponsive { .. } => ("connection", None, None, e.to_string()),
        other => ("protocol", None, None, other.to_string()),
    }
}

fn client_error(py: Python<'_>, e: &ClientError) -> PyErr {
    let (kind, code, request_id, message) = classify(e);
    let detail = e.to_string();
    let make = FROM_NATIVE.get_or_try_init(py, || -> PyResult<_> {
        Ok(py
            .import("expertmesh._errors")?
            .getattr("_from_native")?
            .unbind())
    });
    let exc = make.and_then(|f| f.bind(py).call1((kind, code, request_id, message, &detail)));
    match exc {
        Ok(exc) => PyErr::from_value(exc),
        Err(import_failed) => import_failed,
    }
}
