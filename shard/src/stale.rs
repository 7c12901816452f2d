//! What a killed process leaves behind (temporary files and folders named after its process
//! id), and how a later process removes it.
//!
//! Why this exists: a process ended by SIGKILL, Ctrl-C or the OOM killer drops nothing, so the
//! converter's temporary shard files, a demo's folder and a worker's cache of copied experts
//! would stay for ever (a temporary shard is as large as the shard). Each is named with its
//! process id, and whoever comes next removes those whose process no longer runs. The test is
//! `/proc/<pid>` on this host: where there is no `/proc` nothing is removed, and a process of
//! another PID namespace sharing the folder would be taken for gone.

use std::path::Path;

/// Whether no process `pid` runs on this host (`false` where there is no `/proc`: then
/// nothing is judged gone).
pub fn process_gone(pid: u32) -> bool {
    Path::new("/proc/self").exists() && !Path::new("/proc").join(pid.to_string()).exists()
}

/// Removes each entry of `dir` (file or folder) whose name `owner` maps to the id of a process
/// that is gone. Best effort: what cannot be listed or removed stays.
pub fn remove_left_by_gone_processes(dir: &Path, owner: impl Fn(&str) -> Option<u32>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(&owner) else {
            continue;
        };
        if pid == std::process::id() || !process_gone(pid) {
            continue;
        }
        // Not following links: a link is removed, never what it points at.
        let _ = match e.file_type() {
            Ok(t) if t.is_dir() => std::fs::remove_dir_all(e.path()),
            _ => std::fs::remove_file(e.path()),
        };
    }
}

/// The process id in `name` when it is `PREFIX<pid>` or `PREFIX<pid>-...`.
pub fn pid_after(prefix: &str, name: &str) -> Option<u32> {
    name.strip_prefix(prefix)?.split('-').next()?.parse().ok()
}

/// The process id in a temporary file's name as the shard writer, the manifest and the
/// converter make them: `.NAME.tmp-PID` or `.NAME.tmp-PID-N`.
pub fn temp_owner(name: &str) -> Option<u32> {
    let (_, rest) = name.strip_prefix('.')?.rsplit_once(".tmp-")?;
    pid_after("", rest)
}

/// Removes from `dir` the temporary files ([`temp_owner`]) of processes that are gone.
pub fn remove_stale_temps(dir: &Path) {
    remove_left_by_gone_processes(dir, temp_owner);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_give_their_process() {
        assert_eq!(temp_owner(".device-0001.emshard.tmp-4242-3"), Some(4242));
        assert_eq!(temp_owner(".manifest.json.tmp-17"), Some(17));
        assert_eq!(temp_owner("device-0001.emshard"), None);
        assert_eq!(temp_owner(".device.tmp-x"), None);
        assert_eq!(pid_after("em-", "em-12-abc"), Some(12));
        assert_eq!(pid_after("em-", "em-12"), Some(12));
        assert_eq!(pid_after("em-", "other-12"), None);
    }
}
