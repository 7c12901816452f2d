//! Helpers shared by the C++-building tests of this binary.

use std::path::Path;
use std::process::Command;

/// Say something on the real stderr (the test harness captures `eprintln!`), so a skip or a
/// "ran: ..." line shows in every run, never as a silent pass.
pub(crate) fn say(what: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{what}");
}

/// This crate's directory.
pub(crate) fn manifest() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// True when `tool --version` runs.
pub(crate) fn have(tool: &str) -> bool {
    Command::new(tool)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}
