//! The limit `python -m expertmesh.bench` compares the Python client against: the same call
//! loop run by the Rust client alone, without Python, in the same process and run.
//!
//! Why this exists: the Python client's overhead (argument checks, borrowing the arrays, the
//! GIL release, building exceptions) is only visible against the Rust client on the same
//! fabric, at the same moment, with the same inputs. Both loops do exactly the same calls: a
//! depth of 1 is sequential `submit` + `wait_into` (one latency per call); a depth of `d` keeps
//! `d` requests in flight on one connection (wait the oldest, submit the next).

use crate::array::{self, Elem};
use crate::errors::Failure;
use crate::{Blocking, block, connect_any, frontend_config, resolve, runtime};
use expertmesh_router::client::{CallHandle, ClientError, HiddenStates, RouterClient};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Most iterations of one bench loop (its latencies are kept: 8 bytes each).
const MAX_ITERATIONS: usize = 100_000_000;
/// Most requests one bench loop keeps in flight.
const MAX_DEPTH: usize = 1024;

/// Run ``iterations`` MoE calls of ``x`` (float32 ``[tokens, hidden]``) through ``layer`` with
/// the Rust client on its own connection, the GIL released, ``depth`` requests in flight.
/// Returns ``(elapsed_ns, latencies_ns)``: the loop's wall time and, for ``depth == 1``, each
/// call's latency (empty otherwise). Used by ``python -m expertmesh.bench``.
#[pyfunction]
#[pyo3(name = "_rust_loop", signature = (addr, cluster, secret, layer, x, iterations, depth = 1, warmup = 10))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn rust_loop(
    py: Python<'_>,
    addr: &Bound<'_, PyAny>,
    cluster: &str,
    secret: Option<&Bound<'_, PyAny>>,
    layer: u32,
    x: &Bound<'_, PyAny>,
    iterations: usize,
    depth: usize,
    warmup: usize,
) -> PyResult<(u64, Vec<u64>)> {
    let addrs = resolve(py, addr)?;
    let cfg = frontend_config(cluster, secret)?;
    let v = array::view(x, "x")?;
    if v.elem != Elem::F32 {
        return Err(PyTypeError::new_err("x: the bench sends float32"));
    }
    if depth == 0 || iterations == 0 {
        return Err(PyValueError::new_err(
            "depth and iterations: at least 1 each",
        ));
    }
    // Bounded: one latency (8 bytes) is kept per iteration, one handle per depth.
    if iterations > MAX_ITERATIONS || depth > MAX_DEPTH {
        return Err(PyValueError::new_err(format!(
            "iterations at most {MAX_ITERATIONS} and depth at most {MAX_DEPTH} (a router takes \
             32 requests per connection in flight)"
        )));
    }
    let (tokens, hidden) = (v.rows, v.cols);
    let raw = v.raw::<f32>();
    let rt = runtime()?;
    let r = py.detach(|| {
        let mut client = block(
            Blocking::plain(&rt),
            connect_any(&addrs, &cfg, Duration::from_secs(10)),
        )?;
        // SAFETY: `v` keeps `x` alive until this function returns; it is only read.
        let x = unsafe { raw.slice() };
        let mut out = vec![0f32; tokens * hidden];
        block(Blocking::plain(&rt), async {
            run(&mut client, layer, x, hidden, &mut out, warmup, depth).await?;
            let t = Instant::now();
            let lat = run(&mut client, layer, x, hidden, &mut out, iterations, depth).await?;
            Ok((t.elapsed().as_nanos() as u64, lat))
        })
    });
    drop(v);
    r.map_err(|e: Failure| e.into_pyerr(py))
}

/// `n` calls with `depth` in flight; per-call latencies when `depth == 1`.
async fn run(
    c: &mut RouterClient,
    layer: u32,
    x: &[f32],
    hidden: usize,
    out: &mut [f32],
    n: usize,
    depth: usize,
) -> Result<Vec<u64>, ClientError> {
    let mut lat = Vec::new();
    if depth == 1 {
        lat.reserve(n);
        for _ in 0..n {
            let t = Instant::now();
            let h = c
                .submit(layer, HiddenStates::F32(x), hidden, None, None)
                .await?;
            c.wait_into(h, out).await?;
            lat.push(t.elapsed().as_nanos() as u64);
        }
        return Ok(lat);
    }
    let mut q: VecDeque<CallHandle> = VecDeque::with_capacity(depth);
    for _ in 0..n {
        if q.len() == depth
            && let Some(h) = q.pop_front()
        {
            c.wait_into(h, out).await?;
        }
        q.push_back(
            c.submit(layer, HiddenStates::F32(x), hidden, None, None)
                .await?,
        );
    }
    while let Some(h) = q.pop_front() {
        c.wait_into(h, out).await?;
    }
    Ok(lat)
}
