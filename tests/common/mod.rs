//! Running the real `expertmesh` binary from the CLI integration tests: one helper shared by
//! every test file that drives the binary as a user would; and the small helpers the fabric
//! tests share (a client runtime, f32 bits for bit-for-bit comparisons).
#![allow(dead_code)] // each test file uses a subset

use std::path::PathBuf;
use std::process::Command;

/// The repository root (the binary runs there, so relative example paths work).
pub(crate) fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// What one run of the binary did.
pub(crate) struct Run {
    /// Exit code.
    pub(crate) code: i32,
    /// Standard output.
    pub(crate) stdout: String,
    /// Standard error.
    pub(crate) stderr: String,
}

/// Run `expertmesh ARGS` in the repository root. Fails the test if it panicked or printed a
/// backtrace: bad input must get a message and an exit code, never a panic.
pub(crate) fn run(args: &[&str]) -> Run {
    let o = Command::new(env!("CARGO_BIN_EXE_expertmesh"))
        .args(args)
        .current_dir(root())
        .env("RUST_BACKTRACE", "1")
        .output()
        .expect("run expertmesh");
    let r = Run {
        code: o.status.code().expect("exited normally, not by a signal"),
        stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
    };
    for bad in ["panicked", "stack backtrace", "RUST_BACKTRACE"] {
        assert!(
            !r.stderr.contains(bad) && !r.stdout.contains(bad),
            "{args:?} printed {bad:?}:\n{}{}",
            r.stdout,
            r.stderr
        );
    }
    r
}

/// A current-thread runtime for a test's `RouterClient` calls.
pub(crate) fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime")
}

/// The bits of `v`, to compare outputs bit for bit.
pub(crate) fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}
