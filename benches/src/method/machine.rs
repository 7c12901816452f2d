//! A portable description of the machine and build a bench ran on, for `machine` in the bench
//! JSON: CPU model, family and flags, cores, kernel version, build profile, git revision, and
//! (filled by the benches that measure them) the memory bandwidth probes.
//!
//! Why this exists: two bench files can only be compared knowingly when each says what it ran
//! on (issue 17): a ratio measured on an AVX-512 Zen 4 with a release build and one from an
//! AVX2 Zen 3 debug build differ for reasons that are not regressions. Everything here is read
//! cheaply from the OS (no measurement), so every bench can add it.

use serde_json::{Value, json};
use std::collections::BTreeMap;

/// The fields [`describe`] adds to `machine` (the test holds it to them).
#[cfg(test)]
const FIELDS: [&str; 11] = [
    "cpu_vendor",
    "cpu_family",
    "cpu_model_number",
    "cpu_flags",
    "cpus_allowed",
    "kernel_version",
    "build_profile",
    "git_revision",
    "hypervisor",
    "loadavg_start",
    "loadavg_end",
];

/// Adds the machine description to `extra` (a bench's `machine` fields).
pub fn describe(extra: &mut BTreeMap<String, Value>) {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let field = |key: &str| -> Option<String> {
        cpuinfo
            .lines()
            .find(|l| l.split(':').next().map(str::trim) == Some(key))
            .and_then(|l| l.split_once(':'))
            .map(|(_, v)| v.trim().to_owned())
    };
    let flags: Vec<String> = field("flags")
        .unwrap_or_default()
        .split_whitespace()
        .map(str::to_owned)
        .collect();
    extra.insert("cpu_vendor".into(), json!(field("vendor_id")));
    extra.insert(
        "cpu_family".into(),
        json!(field("cpu family").and_then(|v| v.parse::<u32>().ok())),
    );
    extra.insert(
        "cpu_model_number".into(),
        json!(field("model").and_then(|v| v.parse::<u32>().ok())),
    );
    extra.insert(
        "hypervisor".into(),
        json!(flags.iter().any(|f| f == "hypervisor")),
    );
    extra.insert("cpu_flags".into(), json!(flags));
    extra.insert(
        "cpus_allowed".into(),
        json!(expertmesh_cpu_backend::membw::allowed_cpus()),
    );
    let read = |p: &str| std::fs::read_to_string(p).ok().map(|s| s.trim().to_owned());
    extra.insert(
        "kernel_version".into(),
        json!(read("/proc/sys/kernel/osrelease")),
    );
    extra.insert("loadavg_start".into(), json!(read("/proc/loadavg")));
    // Priority: on a shared machine other jobs take cores from a bench unless it runs at a
    // higher priority (with autogroup scheduling, the autogroup's nice is what counts).
    extra.insert("autogroup".into(), json!(read("/proc/self/autogroup")));
    #[cfg(target_os = "linux")]
    // SAFETY: getpriority only reads the calling process's nice value.
    extra.insert(
        "nice".into(),
        json!(unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) }),
    );
    extra.insert("build_profile".into(), json!(build_profile()));
    let (rev, dirty) = git_revision();
    extra.insert("git_revision".into(), json!(rev));
    extra.insert("git_dirty".into(), json!(dirty));
    extra.insert(
        "git_revision_is".into(),
        json!(if option_env!("EXPERTMESH_GIT_REVISION").is_some() {
            "the build's (EXPERTMESH_GIT_REVISION at build time)"
        } else {
            "HEAD of the repository holding the binary when the bench ran; the build may be older: see binary_modified_unix"
        }),
    );
    let modified = std::env::current_exe()
        .and_then(std::fs::metadata)
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map(|d| d.as_secs());
    extra.insert("binary_modified_unix".into(), json!(modified));
}

/// Memory this process may still allocate without pushing the machine into swap or the OOM
/// killer: the kernel's `MemAvailable`, and less when a cgroup (a container, a systemd slice)
/// limits the process to less (`memory.max - memory.current`, cgroup v2). `None` when
/// neither can be read (not Linux).
pub(crate) fn memory_available_bytes() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let available = meminfo
        .lines()
        .find(|l| l.starts_with("MemAvailable:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|kb| kb.parse::<u64>().ok())
        .map(|kb| kb * 1024)?;
    let read = |p: &str| -> Option<u64> { std::fs::read_to_string(p).ok()?.trim().parse().ok() };
    let cgroup = std::fs::read_to_string("/proc/self/cgroup")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("0::").map(str::to_owned))
        })
        .and_then(|path| {
            let dir = format!("/sys/fs/cgroup{}", path.trim_end_matches('/'));
            let max = read(&format!("{dir}/memory.max"))?;
            let current = read(&format!("{dir}/memory.current")).unwrap_or(0);
            Some(max.saturating_sub(current))
        });
    Some(cgroup.map_or(available, |c| c.min(available)))
}

/// Adds what changed during the run: `loadavg_end` and the process's CPU seconds
/// (`cpu_seconds`, user + system) and involuntary context switches (`involuntary_switches`:
/// how often other work took a core from the bench).
pub fn finish(extra: &mut BTreeMap<String, Value>) {
    let read = |p: &str| std::fs::read_to_string(p).ok().map(|s| s.trim().to_owned());
    extra.insert("loadavg_end".into(), json!(read("/proc/loadavg")));
    #[cfg(target_os = "linux")]
    {
        // SAFETY: a zeroed rusage is valid; getrusage writes at most its size.
        let ru = unsafe {
            let mut ru: libc::rusage = std::mem::zeroed();
            (libc::getrusage(libc::RUSAGE_SELF, &mut ru) == 0).then_some(ru)
        };
        if let Some(ru) = ru {
            let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
            extra.insert(
                "cpu_seconds".into(),
                json!(secs(ru.ru_utime) + secs(ru.ru_stime)),
            );
            extra.insert("involuntary_switches".into(), json!(ru.ru_nivcsw));
        }
    }
}

/// "release" or "debug" (whether debug assertions are compiled in), with the opt level when
/// Cargo exposed it.
pub fn build_profile() -> String {
    let base = if cfg!(debug_assertions) {
        "debug"
    } else {
        "release"
    };
    match option_env!("EXPERTMESH_OPT_LEVEL") {
        Some(o) => format!("{base} (opt-level {o})"),
        None => base.to_owned(),
    }
}

/// The git revision of the repository the running binary was built in (found from the
/// binary's path, e.g. `target/release/expertmesh`), and whether its working tree had
/// uncommitted changes when the bench ran; `EXPERTMESH_GIT_REVISION` at build time wins.
/// `(None, None)` outside a repository or without `git`.
pub fn git_revision() -> (Option<String>, Option<bool>) {
    if let Some(rev) = option_env!("EXPERTMESH_GIT_REVISION") {
        return (Some(rev.to_owned()), None);
    }
    let Some(dir) = std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(|p| p.to_path_buf()))
    else {
        return (None, None);
    };
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .arg("-C")
            .arg(&dir)
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
    };
    let rev = git(&["rev-parse", "HEAD"]);
    let dirty = rev
        .as_ref()
        .and_then(|_| git(&["status", "--porcelain", "--untracked-files=no"]))
        .map(|s| !s.is_empty());
    (rev, dirty)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn description_has_every_field() {
        let mut m = BTreeMap::new();
        describe(&mut m);
        finish(&mut m);
        for f in FIELDS {
            assert!(m.contains_key(f), "missing {f}");
        }
        assert!(build_profile().starts_with("debug") || build_profile().starts_with("release"));
        if cfg!(target_os = "linux") {
            assert!(m["kernel_version"].is_string(), "{m:?}");
            assert!(m["cpu_flags"].as_array().is_some_and(|f| !f.is_empty()));
        }
    }
}
