//! A fabric process's life on one host: dying with its launcher, waiting for a stop signal,
//! and the
//! launcher's loop that restarts workers that exit.
//!
//! Why this exists: `expertmesh up`, `router` and `worker` share one way to run until told to
//! stop (SIGTERM from a cluster engine, or Ctrl-C), and a worker started by the local launcher must never outlive it (parent-death
//! signal), so nothing is left running when a test or `up` ends.

use crate::FabricError;
use crate::local::LocalFabric;
use expertmesh_topology::topology::DeviceRank;
use std::time::Duration;

/// Makes this process exit when its parent does (the local launcher's workers): on Linux a
/// parent-death SIGKILL, and an exit now when the parent is already gone.
#[cfg(target_os = "linux")]
pub fn exit_with_parent() {
    // SAFETY: prctl with PR_SET_PDEATHSIG only sets a signal for this process.
    unsafe {
        libc::prctl(
            libc::PR_SET_PDEATHSIG,
            libc::SIGKILL as libc::c_ulong,
            0,
            0,
            0,
        );
    }
    // SAFETY: getppid has no preconditions.
    if unsafe { libc::getppid() } == 1 {
        std::process::exit(0);
    }
}

/// Does nothing where there is no parent-death signal.
#[cfg(not(target_os = "linux"))]
pub fn exit_with_parent() {}

/// Blocks until SIGTERM (a cluster engine stopping the process: Slurm's `scancel`,
/// Kubernetes, systemd) or SIGINT (Ctrl-C); returns the signal's name.
pub fn wait_for_stop_signal() -> Result<&'static str, FabricError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    Ok(rt.block_on(expertmesh_worker::process::stop_signal()))
}

/// Runs `fabric` until SIGTERM or SIGINT, restarting every worker that exits (checked twice
/// a second); each exit and restart is reported on stderr.
pub fn supervise_until_stopped(fabric: &mut LocalFabric) -> Result<(), FabricError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let mut signal = Box::pin(expertmesh_worker::process::stop_signal());
    loop {
        let stop = rt.block_on(async {
            tokio::select! {
                _ = &mut signal => true,
                _ = tokio::time::sleep(Duration::from_millis(500)) => false,
            }
        });
        if stop {
            return Ok(());
        }
        for (d, status) in fabric.exited_workers() {
            let name = fabric.deployment().device_label(DeviceRank(d as u32));
            eprintln!("worker {name} exited ({status}); restarting");
            if let Err(e) = fabric.restart_worker(d) {
                eprintln!("restart failed: {e:#}");
            }
        }
    }
}
