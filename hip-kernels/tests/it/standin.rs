//! The production `HipBackend` running the real kernels on the CPU, through the HIP-CPU stand-in.
//!
//! `hip-kernels/standin/` builds a stand-in for `libamdhip64`: the HIP entry points `HipBackend`
//! binds, with the project's unmodified `kernels/*.hip` compiled for the host through ROCm's
//! HIP-CPU. One stand-in library per target branch, so every path through the kernels executes:
//!
//! | branch | compiler | device reports | path |
//! |---|---|---|---|
//! | generic wave 64 | g++ | gfx90a | portable (ids, `__syncthreads`, `__shfl_xor_sync`) |
//! | generic wave 32 | g++ | gfx1030 | portable, 32-lane waves |
//! | gfx90a | clang++ | gfx90a | AMD builtins, sdot4, MFMA i32 16x16x16 i8 |
//! | gfx940 | clang++ | gfx940 | AMD builtins, sdot4, MFMA i32 16x16x32 i8 (the gfx942 path) |
//! | gfx1030 | clang++ | gfx1030 | AMD builtins, wave 32, sdot4, portable prefill |
//! | gfx1100 | clang++ | gfx1100 | AMD builtins, wave 32, sudot4, WMMA i32 16x16x16 iu8 |
//!
//! Each branch: exact mode bit-identical to `CpuBackend` (both output layouts, fused and two-phase
//! decode, f32 and pre-quantized input), accurate mode within `ACCURATE_REL_TOL` of f64, over g32 /
//! g64 / g128, f16 / bf16 scales, zero points, 1–16 token decode, prefill batches and one
//! Kimi-K2-sized expert. Three kernel mutations (a removed barrier, a reversed reduction tree, a
//! wrong prefill row mapping) must each make the check fail. The MFMA / WMMA emulators are checked
//! against AMD's matrix instruction calculator (`matrix_emu.rs`, which runs without the feature).
//!
//! Needs `../shared/third_party/hip-cpu` (or `EXPERTMESH_HIP_CPU`), oneTBB (`libtbb-dev`), g++ and
//! clang++; without HIP-CPU or a compiler each test says "skipped: ..." on stderr and returns. The
//! stand-in cannot show GPU memory-model races (x86 fences are stronger) or speed:
//! `scripts/gpu-check.sh` on a real GPU is the check for those.

use super::backend_check::{check_against_cpu, conformance_cases, kimi_cases};
use super::support::say;
use expertmesh_backend::ExpertBackend;
use expertmesh_hip_kernels::hip::{self, HipBackend};
use expertmesh_hip_kernels::standin::{
    self, Branch, Built, GENERIC32, GENERIC64, GFX90A, GFX940, GFX1030, GFX1100, Mutation,
};
use expertmesh_hip_kernels::testvec::VectorCase;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

/// Build (or reuse) a stand-in under this test target's temporary folder; None after a loud skip.
fn build_standin(branch: Branch, mutation: Option<Mutation>) -> Option<PathBuf> {
    let cache = Path::new(env!("CARGO_TARGET_TMPDIR")).join("hip-standin");
    match standin::build(branch, mutation, &cache) {
        Ok(Built::Library(lib)) => Some(lib),
        Ok(Built::Skipped(why)) => {
            say(&format!("skipped: {why}"));
            None
        }
        Err(e) => panic!("building the {} stand-in: {e}", branch.key),
    }
}

/// The stand-in library of an unmutated branch, built once per test process: a test asking
/// for a branch another test is building waits for that build (two builds at once raced over
/// one work folder); each test that gets no library says so.
fn standin_lib(branch: Branch) -> Option<PathBuf> {
    type Once = Arc<OnceLock<Option<PathBuf>>>;
    static BUILT: OnceLock<Mutex<HashMap<&'static str, Once>>> = OnceLock::new();
    let map = BUILT.get_or_init(|| Mutex::new(HashMap::new()));
    let once: Once = Arc::clone(map.lock().expect("lock").entry(branch.key).or_default());
    let mut first = false;
    let lib = once
        .get_or_init(|| {
            first = true;
            build_standin(branch, None)
        })
        .clone();
    if lib.is_none() && !first {
        say(&format!(
            "skipped: no {} stand-in (see the first skip)",
            branch.key
        ));
    }
    lib
}

/// Open the backend on `branch`'s stand-in and check it; None after a loud skip.
fn run_branch(branch: Branch, cases: &[VectorCase], full: bool) -> Option<Result<usize, String>> {
    let lib = standin_lib(branch)?;
    Some(open_and_check(branch, &lib, cases, full))
}

fn open_and_check(
    branch: Branch,
    lib: &Path,
    cases: &[VectorCase],
    full: bool,
) -> Result<usize, String> {
    let mut hip = HipBackend::with_library(0, lib)
        .map_err(|e| format!("HipBackend on the {} stand-in: {e}", branch.key))?;
    let name = hip.name();
    if name != format!("hip-{}", branch.arch) {
        return Err(format!(
            "the backend says {name}, expected hip-{}",
            branch.arch
        ));
    }
    check_against_cpu(&mut hip, cases, full)
}

fn conformance(branch: Branch) {
    if !hip::compiled_targets().contains(&branch.arch) {
        panic!(
            "this build has no {} code object (built: {:?}, skipped by the compiler: {:?}); the {} stand-in needs \
             it: build with EXPERTMESH_HIP_TARGETS including {}",
            branch.arch,
            hip::compiled_targets(),
            hip::skipped_targets(),
            branch.key,
            branch.arch
        );
    }
    let Some(result) = run_branch(branch, conformance_cases(), true) else {
        return;
    };
    match result {
        Ok(n) => say(&format!(
            "ran: HipBackend over the HIP-CPU stand-in, {} branch (device {}): {n} batches, exact bit-identical to \
             CpuBackend, accurate within tolerance",
            branch.key, branch.arch
        )),
        Err(e) => panic!("{} branch: {e}", branch.key),
    }
}

#[test]
fn standin_generic_wave64_matches_the_cpu_backend() {
    conformance(GENERIC64);
}

/// A live placement change on the HIP backend: gains while loaded (the device table grows; the
/// last gain staged on another thread and installed, as a worker gains them),
/// refusals that change nothing, releases, gains back into freed slots; bit-identical to the CPU
/// backend throughout.
#[test]
fn standin_backend_gains_and_releases_experts_while_loaded() {
    let Some(lib) = standin_lib(GENERIC64) else {
        return;
    };
    let mut hip = HipBackend::with_library(0, &lib).expect("HipBackend on the stand-in");
    match super::backend_check::check_live_changes(&mut hip) {
        Ok(n) => say(&format!(
            "ran: HipBackend over the HIP-CPU stand-in gained and released experts while loaded, {n} batches \
             bit-identical to CpuBackend"
        )),
        Err(e) => panic!("{e}"),
    }
}

#[test]
fn standin_generic_wave32_matches_the_cpu_backend() {
    conformance(GENERIC32);
}

#[test]
fn standin_gfx90a_mfma_16x16x16_matches_the_cpu_backend() {
    conformance(GFX90A);
}

#[test]
fn standin_gfx940_mfma_16x16x32_matches_the_cpu_backend() {
    conformance(GFX940);
}

#[test]
fn standin_gfx1030_wave32_matches_the_cpu_backend() {
    conformance(GFX1030);
}

#[test]
fn standin_gfx1100_wmma_matches_the_cpu_backend() {
    conformance(GFX1100);
}

/// A Kimi-K2-sized expert through the MFMA branch (decode and prefill): the kernels' indexing at
/// the largest shape served.
#[test]
fn standin_runs_a_kimi_sized_expert() {
    let Some(result) = run_branch(GFX90A, kimi_cases(), false) else {
        return;
    };
    let n = result.unwrap_or_else(|e| panic!("Kimi-sized expert on gfx90a: {e}"));
    say(&format!(
        "ran: Kimi-sized expert (H 7168, F 2048) on the gfx90a stand-in: {n} batches"
    ));
}

/// The check above can fail: each mutation of the kernels (applied to a copy) makes it report a
/// difference from CpuBackend on the branch whose path it breaks.
#[test]
fn kernel_mutations_fail_the_standin_check() {
    let decode_case = &conformance_cases()[..1];
    let prefill_case = std::slice::from_ref(
        conformance_cases()
            .iter()
            .rev()
            .find(|c| c.groups.iter().any(|g| g.count >= 16))
            .expect("a prefill case"),
    );
    let mutations = [
        (
            GENERIC64,
            Mutation {
                name: "no-barrier-before-swiglu",
                file: "decode.hip",
                from: "sh.rows[team + EM_TEAMS * r][t] = P[r][t];\n        }\n        em_sync();\n",
                to: "sh.rows[team + EM_TEAMS * r][t] = P[r][t];\n        }\n",
            },
            decode_case,
        ),
        (
            GENERIC64,
            Mutation {
                name: "reversed-xor-tree",
                file: "em_device.h",
                from: "for (int w = EM_LANES / 2; w > 0; w /= 2) p = p + em_shfl_xor(p, w);",
                to: "for (int w = 1; w < EM_LANES; w *= 2) p = p + em_shfl_xor(p, w);",
            },
            decode_case,
        ),
        (
            GFX90A,
            Mutation {
                name: "wrong-prefill-row-mapping",
                file: "prefill.hip",
                from: "return EM_ENTRIES * (lane / 16) + e;",
                to: "return (lane / 16) + EM_ENTRIES * e;",
            },
            prefill_case,
        ),
    ];
    for (branch, m, cases) in mutations {
        let Some(lib) = build_standin(branch, Some(m)) else {
            return;
        };
        match open_and_check(branch, &lib, cases, true) {
            Ok(n) => panic!(
                "mutation {} of kernels/{} on the {} branch passed the check ({n} batches): the check cannot see it",
                m.name, m.file, branch.key
            ),
            Err(e) => {
                assert!(
                    e.contains("differ from CpuBackend"),
                    "mutation {}: unexpected failure: {e}",
                    m.name
                );
                say(&format!("mutation {} ({}) caught: {e}", m.name, branch.key));
            }
        }
    }
}
