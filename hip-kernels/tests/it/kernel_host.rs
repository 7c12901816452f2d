//! The HIP kernels' arithmetic checked on the CPU, and the HIP backend's behaviour without a GPU.
//!
//! * The Rust reference writes the standard test vectors; they read back identically.
//! * `harness/host_check.cpp` — the kernels' own contract functions and work decomposition,
//!   compiled with g++ — reproduces the Rust reference bit for bit from the vector file (and
//!   rejects a file whose reference was tampered with, so the check can fail).
//! * The kernel argument blocks have the same layout in C and Rust.
//! * `HipBackend` reports a clear error where it cannot run (no feature, no runtime, no device),
//!   and on a machine with an AMD GPU runs the vectors and compares bit for bit.
//!
//! g++ is required for the C++ checks; without it they print "skipped: g++ not found" and return.

use expertmesh_backend::{BackendError, ExpertBackend, ExpertGroup, ExpertKey};
use expertmesh_hip_kernels::hip::HipBackend;
use expertmesh_hip_kernels::kernel_abi;
use expertmesh_hip_kernels::testvec::{self, VectorCase};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

pub(crate) const SEED: u64 = 20_260_601;

fn harness_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("harness")
}

fn cases() -> &'static Vec<VectorCase> {
    static CASES: OnceLock<Vec<VectorCase>> = OnceLock::new();
    CASES.get_or_init(|| testvec::standard_cases(SEED).expect("standard cases generate"))
}

/// The host check binary, compiled once per test process; None (after a loud skip) without g++.
fn host_check() -> Option<&'static Path> {
    static BIN: OnceLock<Option<(tempfile::TempDir, PathBuf)>> = OnceLock::new();
    BIN.get_or_init(|| {
        let dir = tempfile::tempdir().expect("tempdir");
        let bin = dir.path().join("host_check");
        let src = harness_dir().join("host_check.cpp");
        let out = match Command::new("g++")
            .args([
                "-std=c++17",
                "-O2",
                "-ffp-contract=off",
                "-fno-fast-math",
                "-Wall",
                "-Wextra",
                "-o",
            ])
            .arg(&bin)
            .arg(&src)
            .output()
        {
            Ok(out) => out,
            Err(e) => {
                skip(&format!(
                    "skipped: g++ not found ({e}); the kernel host check needs a C++17 compiler"
                ));
                return None;
            }
        };
        assert!(
            out.status.success(),
            "g++ failed on {}:\n{}",
            src.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        // Warnings are shown, not fatal: another compiler version may add some.
        if !out.stderr.is_empty() {
            skip(&format!(
                "note: g++ warned on {}:\n{}",
                src.display(),
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        Some((dir, bin))
    })
    .as_ref()
    .map(|(_, bin)| bin.as_path())
}

fn write_vectors(cases: &[VectorCase]) -> tempfile::NamedTempFile {
    let file = tempfile::Builder::new()
        .suffix(".emtv")
        .tempfile()
        .expect("temp file");
    std::fs::write(file.path(), testvec::to_bytes(cases)).expect("write vectors");
    file
}

fn run_host_check(bin: &Path, file: &Path) -> (bool, String) {
    let out = Command::new(bin)
        .arg(file)
        .output()
        .expect("run host_check");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[test]
fn vectors_roundtrip_through_a_file() {
    let file = write_vectors(cases());
    let bytes = std::fs::read(file.path()).unwrap();
    let back = testvec::from_bytes(&bytes).expect("vectors parse");
    assert_eq!(&back, cases());
    // The standard set covers what the kernels must handle.
    assert!(
        back.iter().any(|c| c.hidden % 256 != 0),
        "K not a multiple of 256"
    );
    assert!(
        back.iter().any(|c| c.groups.iter().any(|g| g.count == 0)),
        "zero-token experts"
    );
    assert!(
        back.iter().any(|c| c.groups.iter().any(|g| g.count > 16)),
        "groups beyond one prefill tile"
    );
    assert!(back.iter().any(|c| c.spec.zero_points) && back.iter().any(|c| !c.spec.zero_points));
}

#[test]
fn host_path_reproduces_the_rust_reference_bit_for_bit() {
    let Some(bin) = host_check() else { return };
    let file = write_vectors(cases());
    let (ok, text) = run_host_check(bin, file.path());
    assert!(ok, "host check failed:\n{text}");
    // 1 tree self-test + 5 checks per case, all passed.
    let want = format!("host-check: {} passed, 0 failed", 1 + 5 * cases().len());
    assert!(text.contains(&want), "expected `{want}` in:\n{text}");
}

#[test]
fn host_check_fails_on_a_wrong_reference() {
    let Some(bin) = host_check() else { return };
    let mut bad = vec![cases()[0].clone()];
    let v = bad[0].y_exact[3];
    bad[0].y_exact[3] = f32::from_bits(v.to_bits() ^ 1); // one ulp off
    let w = bad[0].y_combined[5];
    bad[0].y_combined[5] = w + 1.0;
    let file = write_vectors(&bad);
    let (ok, text) = run_host_check(bin, file.path());
    assert!(!ok, "a one-ulp reference change went unnoticed:\n{text}");
    assert!(
        text.contains("FAIL decode")
            && text.contains("FAIL combine")
            && text.contains("FAIL prefill"),
        "{text}"
    );
    // A corrupt file is rejected with a message, not a crash.
    let mut bytes = std::fs::read(file.path()).unwrap();
    bytes[40] ^= 0xFF;
    std::fs::write(file.path(), &bytes).unwrap();
    let out = Command::new(bin).arg(file.path()).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("checksum"));
}

#[test]
fn kernel_argument_layout_matches_the_c_header() {
    let Some(bin) = host_check() else { return };
    let out = Command::new(bin)
        .arg("--abi")
        .output()
        .expect("run host_check --abi");
    assert!(out.status.success());
    let c_side: Vec<(String, String, usize)> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| {
            let mut it = l.split_whitespace();
            let (s, f, o) = (it.next().unwrap(), it.next().unwrap(), it.next().unwrap());
            (s.to_string(), f.to_string(), o.parse().unwrap())
        })
        .collect();
    let rust_side: Vec<(String, String, usize)> = kernel_abi::layout()
        .into_iter()
        .map(|(s, f, o)| (s.to_string(), f.to_string(), o))
        .collect();
    assert_eq!(c_side, rust_side);
}

/// Build a backend batch from a vector case.
pub(crate) struct CaseBatch {
    groups_tokens: Vec<Vec<u32>>,
    groups_weights: Vec<Vec<f32>>,
    groups_rows: Vec<Vec<u32>>,
}

impl CaseBatch {
    pub(crate) fn new(c: &VectorCase) -> Self {
        let (mut t, mut w, mut r) = (Vec::new(), Vec::new(), Vec::new());
        let mut p = 0usize;
        for g in &c.groups {
            let n = g.count as usize;
            t.push(c.pair_token[p..p + n].to_vec());
            w.push(c.pair_weight[p..p + n].to_vec());
            r.push(c.pair_out[p..p + n].to_vec());
            p += n;
        }
        Self {
            groups_tokens: t,
            groups_weights: w,
            groups_rows: r,
        }
    }

    pub(crate) fn groups<'a>(&'a self, c: &VectorCase) -> Vec<ExpertGroup<'a>> {
        c.groups
            .iter()
            .enumerate()
            .map(|(i, g)| ExpertGroup {
                key: ExpertKey {
                    layer: 0,
                    expert: g.expert,
                },
                tokens: &self.groups_tokens[i],
                weights: &self.groups_weights[i],
                out_rows: &self.groups_rows[i],
            })
            .collect()
    }
}

/// Say why a test skipped on the real stderr (the test harness captures `eprintln!`), so the
/// skip shows in every run, never as a silent pass.
fn skip(why: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{why}");
}

#[test]
fn hip_backend_on_this_machine() {
    let mut backend = match HipBackend::new(0) {
        Ok(b) => b,
        Err(e @ BackendError::NotCompiled { .. }) => {
            assert!(e.to_string().contains("--features hip"));
            skip(&format!("skipped: HIP backend not compiled in ({e})"));
            return;
        }
        Err(e @ BackendError::NoDevice { .. }) => {
            assert!(
                e.to_string().starts_with("no hip device available: "),
                "{e}"
            );
            skip(&format!("skipped: no HIP device ({e})"));
            return;
        }
        Err(e) => panic!("HipBackend::new failed unexpectedly: {e}"),
    };
    // A real AMD GPU: the conformance set (the standard cases, 1-16 token decode, prefill) and a
    // Kimi-sized expert against the CPU backend, as the HIP-CPU stand-in runs it for every
    // branch: exact bit for bit, accurate within tolerance, both layouts and decode modes.
    let n = super::backend_check::check_against_cpu(
        &mut backend,
        super::backend_check::conformance_cases(),
        true,
    )
    .unwrap_or_else(|e| panic!("{}: {e}", backend.name()));
    let k = super::backend_check::check_against_cpu(
        &mut backend,
        super::backend_check::kimi_cases(),
        false,
    )
    .unwrap_or_else(|e| panic!("{} (Kimi-sized): {e}", backend.name()));
    skip(&format!(
        "ran: {} on this machine's GPU: {} batches match the CPU backend",
        backend.name(),
        n + k
    ));
}
