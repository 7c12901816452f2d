//! Building the HIP-CPU stand-in for `libamdhip64` (test support).
//!
//! Why this exists: no machine here has an AMD GPU, yet the production [`crate::hip::HipBackend`]
//! and the real kernels should execute in every test run. `hip-kernels/standin/` holds a host
//! implementation of the HIP entry points the backend binds (`em_standin_api.cpp`) and the
//! project's unmodified `kernels/*.hip` compiled for the host through ROCm's HIP-CPU, one library
//! per target branch (`em_standin_branch.cpp`, AMD builtins mapped by `em_amd_builtins.h`, matrix
//! instructions emulated by `em_matrix_emu.h`). This module compiles those libraries; the
//! backend opens one through [`crate::hip::HipBackend::with_library`] or
//! [`crate::hip::LIBRARY_ENV`]. It lives in the library, not in one test, because the kernels'
//! tests and the binary's end-to-end test (a worker serving through a router) both build it.
//!
//! Nothing here is used in serving: it only runs compilers. Needs HIP-CPU (the shared third-party
//! copy or `EXPERTMESH_HIP_CPU`), oneTBB (`libtbb-dev`), g++ and, for the AMD branches, clang++.
//! What the stand-in cannot show: GPU memory-model races (x86 fences are stronger) and speed.

use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::process::Command;

/// A target branch of the kernels: which path through them a stand-in executes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Branch {
    /// Short name, e.g. `gfx90a` or `generic-wave64`.
    pub key: &'static str,
    /// The arch the stand-in's device reports: the backend loads this target's code objects, and
    /// the stand-in refuses any other target's.
    pub arch: &'static str,
    /// Built with clang++ (the AMD branches: vector types and clang builtins) or g++.
    pub clang: bool,
    /// Preprocessor definitions selecting the branch.
    pub defines: &'static [&'static str],
}

/// The portable path (NVIDIA-style ids, `__syncthreads`, `__shfl_xor_sync`) with 64-lane waves,
/// on a device reporting gfx90a.
pub const GENERIC64: Branch = Branch {
    key: "generic-wave64",
    arch: "gfx90a",
    clang: false,
    defines: &["-DEM_WAVE=64"],
};
/// The portable path with 32-lane waves, on a device reporting gfx1030: NVIDIA's path, with the
/// decode work-item shapes measured on an NVIDIA GPU (`EM_NV_SHAPES`: two W13 tiles per phase-1
/// item, four W2 rows per team), so CI checks those shapes bit for bit without a GPU.
pub const GENERIC32: Branch = Branch {
    key: "generic-wave32",
    arch: "gfx1030",
    clang: false,
    defines: &["-DEM_WAVE=32", "-DEM_NV_SHAPES=1"],
};
/// AMD builtins, sdot4, MFMA i32 16x16x16 i8 (MI200).
pub const GFX90A: Branch = Branch {
    key: "gfx90a",
    arch: "gfx90a",
    clang: true,
    defines: &[
        "-DEM_DEVICE_AMD=1",
        "-D__gfx90a__",
        "-D__AMDGCN_WAVEFRONT_SIZE=64",
    ],
};
/// AMD builtins, sdot4, MFMA i32 16x16x32 i8: the MI300 (gfx940/gfx942) path; gfx940 because
/// Debian's ROCm 5.2 builds code objects for gfx940 but not gfx942.
pub const GFX940: Branch = Branch {
    key: "gfx940",
    arch: "gfx940",
    clang: true,
    defines: &[
        "-DEM_DEVICE_AMD=1",
        "-D__gfx940__",
        "-D__AMDGCN_WAVEFRONT_SIZE=64",
    ],
};
/// AMD builtins, 32-lane waves, sdot4, the portable prefill (RX 6000).
pub const GFX1030: Branch = Branch {
    key: "gfx1030",
    arch: "gfx1030",
    clang: true,
    defines: &[
        "-DEM_DEVICE_AMD=1",
        "-D__gfx1030__",
        "-D__AMDGCN_WAVEFRONT_SIZE=32",
    ],
};
/// AMD builtins, 32-lane waves, sudot4, WMMA i32 16x16x16 iu8 (RX 7000).
pub const GFX1100: Branch = Branch {
    key: "gfx1100",
    arch: "gfx1100",
    clang: true,
    defines: &[
        "-DEM_DEVICE_AMD=1",
        "-D__gfx1100__",
        "-D__AMDGCN_WAVEFRONT_SIZE=32",
    ],
};

/// Every branch, in the order of the table in ARCHITECTURE.md.
pub const BRANCHES: [Branch; 6] = [GENERIC64, GENERIC32, GFX90A, GFX940, GFX1030, GFX1100];

/// A textual change to one kernel source file (applied to a copy), for tests that prove a broken
/// kernel fails the check.
#[derive(Clone, Copy, Debug)]
pub struct Mutation {
    /// Short name.
    pub name: &'static str,
    /// File under `kernels/`.
    pub file: &'static str,
    /// Text replaced (its first occurrence; it must occur).
    pub from: &'static str,
    /// Replacement.
    pub to: &'static str,
}

/// What [`build`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Built {
    /// The library, ready to open.
    Library(PathBuf),
    /// A prerequisite is missing on this machine; the reason, for a loud skip.
    Skipped(String),
}

/// This crate's directory.
fn manifest() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// HIP-CPU's include directory: `$EXPERTMESH_HIP_CPU/include`, else the shared third-party copy
/// next to the repository (`../shared/third_party/hip-cpu`).
pub fn hip_cpu_include() -> Option<PathBuf> {
    let root = std::env::var_os("EXPERTMESH_HIP_CPU")
        .map(PathBuf::from)
        .unwrap_or_else(|| manifest().join("../../shared/third_party/hip-cpu"));
    let include = root.join("include");
    include
        .join("hip/hip_runtime.h")
        .is_file()
        .then_some(include)
}

fn have(tool: &str) -> bool {
    Command::new(tool)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Every file of a directory, sorted by name, into the hash.
fn hash_dir(dir: &Path, h: &mut impl Hasher) -> Result<(), String> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| format!("read {}: {e}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    for f in files {
        f.file_name().hash(h);
        std::fs::read(&f)
            .map_err(|e| format!("read {}: {e}", f.display()))?
            .hash(h);
    }
    Ok(())
}

fn run(cxx: &str, args: &[String], what: &str) -> Result<(), String> {
    let out = Command::new(cxx)
        .args(args)
        .output()
        .map_err(|e| format!("run {cxx}: {e}"))?;
    if out.status.success() {
        return Ok(());
    }
    Err(format!(
        "{cxx} failed building the stand-in ({what}); HIP-CPU needs oneTBB (apt-get install libtbb-dev):\n{}",
        String::from_utf8_lossy(&out.stderr)
            .lines()
            .take(40)
            .collect::<Vec<_>>()
            .join("\n")
    ))
}

/// Build (or reuse from `cache`) the stand-in library for `branch`, with `mutation` applied to a
/// copy of the kernels. The library's folder is named by a hash of every source it is built from,
/// so an edit to a kernel or to the stand-in rebuilds it; concurrent builders of the same library
/// each write a private file and rename it into place.
pub fn build(branch: Branch, mutation: Option<Mutation>, cache: &Path) -> Result<Built, String> {
    let Some(hip_cpu) = hip_cpu_include() else {
        return Ok(Built::Skipped(format!(
            "HIP-CPU not found (../shared/third_party/hip-cpu or EXPERTMESH_HIP_CPU): the {} stand-in cannot be \
             built",
            branch.key
        )));
    };
    let cxx = if branch.clang { "clang++" } else { "g++" };
    for tool in [cxx, "g++"] {
        if !have(tool) {
            return Ok(Built::Skipped(format!(
                "{tool} not found: the {} stand-in cannot be built",
                branch.key
            )));
        }
    }
    let standin = manifest().join("standin");
    let mut kernels = manifest().join("kernels");
    let mut h = std::collections::hash_map::DefaultHasher::new();
    hash_dir(&standin, &mut h)?;
    hash_dir(&kernels, &mut h)?;
    hash_dir(&hip_cpu.join("hip"), &mut h)?;
    (branch, mutation.map(|m| (m.name, m.file, m.from, m.to))).hash(&mut h);
    let tag = match mutation {
        Some(m) => format!("{}-{}", branch.key, m.name),
        None => branch.key.to_string(),
    };
    let dir = cache.join(format!("{tag}-{:016x}", h.finish()));
    let lib = dir.join("libem_hip_standin.so");
    if lib.is_file() {
        return Ok(Built::Library(lib));
    }
    let work = work_dir(&dir);
    std::fs::create_dir_all(&work).map_err(|e| format!("create {}: {e}", work.display()))?;
    if let Some(m) = mutation {
        kernels = mutated_copy(&kernels, &work.join("kernels"), m)?;
    }
    let s = |p: &Path| p.display().to_string();
    let common: Vec<String> = [
        "-std=c++17",
        "-O2",
        "-fPIC",
        "-fvisibility=hidden",
        "-ffp-contract=off",
        "-fno-fast-math",
    ]
    .map(String::from)
    .to_vec();
    let branch_o = work.join("branch.o");
    let mut args = common.clone();
    // HIP-CPU's own headers are noisy under both compilers (unknown attributes, simd clones);
    // build.rs compiles the kernels themselves with -Wall.
    args.extend([
        "-w".into(),
        format!("-I{}", s(&hip_cpu)),
        format!("-I{}", s(&kernels)),
    ]);
    args.extend(branch.defines.iter().map(|d| d.to_string()));
    args.push(format!("-DEM_STANDIN_ARCH=\"{}\"", branch.arch));
    args.push(format!("-DEM_STANDIN_NAME=\"{tag}\""));
    args.extend([
        "-c".into(),
        s(&standin.join("em_standin_branch.cpp")),
        "-o".into(),
        s(&branch_o),
    ]);
    run(cxx, &args, "kernels")?;
    let api_o = work.join("api.o");
    let mut args = common;
    args.extend([
        "-Wall".into(),
        "-Wextra".into(),
        "-Werror".into(),
        "-c".into(),
        s(&standin.join("em_standin_api.cpp")),
        "-o".into(),
        s(&api_o),
    ]);
    run("g++", &args, "runtime")?;
    let tmp = work.join("libem_hip_standin.so");
    let args: Vec<String> = vec![
        "-shared".into(),
        "-Wl,-Bsymbolic".into(),
        "-Wl,--no-undefined".into(),
        "-o".into(),
        s(&tmp),
        s(&api_o),
        s(&branch_o),
        "-ltbb".into(),
        "-lpthread".into(),
    ];
    run(cxx, &args, "link")?;
    std::fs::rename(&tmp, &lib).map_err(|e| format!("move the stand-in into place: {e}"))?;
    let _ = std::fs::remove_dir_all(&work);
    Ok(Built::Library(lib))
}

/// A private work folder under `dir` per builder: two builders of the same library
/// (processes, or threads of one test process) never share an object file, nor remove each
/// other's.
fn work_dir(dir: &Path) -> PathBuf {
    static BUILDS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = BUILDS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    dir.join(format!("work-{}-{n}", std::process::id()))
}

/// Copy `kernels` to `to` with `m` applied; Err when its text no longer occurs (the kernel changed
/// and the mutation would silently be a no-op).
fn mutated_copy(kernels: &Path, to: &Path, m: Mutation) -> Result<PathBuf, String> {
    std::fs::create_dir_all(to).map_err(|e| format!("create {}: {e}", to.display()))?;
    let entries = std::fs::read_dir(kernels).map_err(|e| format!("read kernels: {e}"))?;
    for entry in entries {
        let path = entry.map_err(|e| e.to_string())?.path();
        let mut text =
            std::fs::read_to_string(&path).map_err(|e| format!("read {}: {e}", path.display()))?;
        let name = path.file_name().unwrap_or_default().to_owned();
        if name == m.file {
            if !text.contains(m.from) {
                return Err(format!(
                    "mutation {}: `{}` no longer appears in kernels/{}; update the mutation",
                    m.name, m.from, m.file
                ));
            }
            text = text.replacen(m.from, m.to, 1);
        }
        std::fs::write(to.join(&name), text).map_err(|e| format!("write kernel copy: {e}"))?;
    }
    Ok(to.to_path_buf())
}
