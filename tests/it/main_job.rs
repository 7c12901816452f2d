//! The README's main job, `expertmesh demo` on the embedded defaults (single-host topology,
//! demo-small, CPU workers, TCP links, exact mode): it runs on a fresh machine, checks every
//! response bit for bit against the in-process reference, and its output reads as a report (the
//! fabric's lifecycle log lines stay out of it unless asked for).
//!
//! Only the number of rounds is cut (two instead of ten), so the test stays short; the schedule
//! is otherwise the default one, and what it must add up to follows from it: every round calls
//! each of demo-small's MoE layers once per default batch size.

use crate::support::root;
use std::process::Command;

/// The default batch sizes of `demo` (`--batches`).
const BATCHES: [usize; 7] = [1, 2, 4, 8, 16, 32, 64];
/// Rounds this test runs (`--rounds`).
const ROUNDS: usize = 2;

/// Whether `line` is a log event at INFO or below: `<RFC 3339 time>  INFO target: message`, or
/// the JSON form (`EXPERTMESH_LOG_FORMAT=json`) with `"level":"INFO"`.
fn is_chatty_log_line(line: &str) -> bool {
    if [
        "\"level\":\"INFO\"",
        "\"level\":\"DEBUG\"",
        "\"level\":\"TRACE\"",
    ]
    .iter()
    .any(|l| line.contains(l))
    {
        return true;
    }
    let mut words = line.split_whitespace();
    let (Some(time), Some(level)) = (words.next(), words.next()) else {
        return false;
    };
    let timestamp = time.len() >= 20 && time.as_bytes()[4] == b'-' && time.ends_with('Z');
    timestamp && matches!(level, "INFO" | "DEBUG" | "TRACE")
}

#[test]
fn the_main_job_checks_every_response_and_prints_a_report_without_log_lines() {
    let _machine = crate::support::shared();
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("demo.json");
    let out = Command::new(env!("CARGO_BIN_EXE_expertmesh"))
        .args(["demo", "--rounds", &ROUNDS.to_string(), "--json"])
        .arg(&json)
        .current_dir(root())
        // The defaults a fresh machine runs with: the log level and format the user did not set.
        .env_remove("EXPERTMESH_LOG")
        .env_remove("EXPERTMESH_LOG_FORMAT")
        .output()
        .expect("run expertmesh demo");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert_eq!(out.status.code(), Some(0), "{stdout}{stderr}");
    for bad in ["panicked", "stack backtrace"] {
        assert!(!stderr.contains(bad), "{stderr}");
    }
    let layers = expertmesh_topology::model::preset_by_name("demo-small")
        .unwrap()
        .moe_layer_ids()
        .len();
    let calls = ROUNDS * layers * BATCHES.len();
    let tokens = ROUNDS * layers * BATCHES.iter().sum::<usize>();
    assert!(
        stdout.contains(&format!(
            "checked: {calls} of {calls} responses bit-identical to the in-process reference"
        )),
        "{stdout}"
    );
    assert!(stdout.trim_end().ends_with("demo OK"), "{stdout}");
    let chatty: Vec<&str> = stdout
        .lines()
        .chain(stderr.lines())
        .filter(|l| is_chatty_log_line(l))
        .collect();
    assert!(
        chatty.is_empty(),
        "log lines in the middle of the report: {chatty:#?}"
    );

    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(v["ok"], true, "{v:#}");
    assert_eq!(v["mode"], "exact", "{v:#}");
    assert_eq!(v["topology"], "single-host", "{v:#}");
    assert_eq!(v["model"], "demo-small", "{v:#}");
    assert_eq!(v["mismatches"], 0, "{v:#}");
    assert_eq!(v["errors"], 0, "{v:#}");
    assert_eq!(v["calls"].as_u64(), Some(calls as u64), "{v:#}");
    assert_eq!(v["tokens"].as_u64(), Some(tokens as u64), "{v:#}");
    let per_batch = v["per_batch"].as_array().unwrap();
    let batches: Vec<u64> = per_batch
        .iter()
        .map(|b| b["batch"].as_u64().unwrap())
        .collect();
    assert_eq!(batches, BATCHES.map(|b| b as u64), "{v:#}");
    for b in per_batch {
        assert_eq!(b["calls"].as_u64(), Some((ROUNDS * layers) as u64), "{b}");
    }
}

#[test]
fn a_log_line_is_told_from_a_report_line() {
    assert!(is_chatty_log_line(
        "2026-12-04T22:46:49.232732Z  INFO expertmesh_transport::mesh: link established peer=1"
    ));
    assert!(!is_chatty_log_line(
        "2026-12-04T22:46:49.232732Z  WARN expertmesh_router::service: worker slow"
    ));
    assert!(!is_chatty_log_line(
        "  checked: 8 of 8 responses bit-identical to the in-process reference"
    ));
    assert!(is_chatty_log_line(
        r#"{"timestamp":"2026-12-04T22:46:49Z","level":"INFO","fields":{"message":"up"}}"#
    ));
    assert!(!is_chatty_log_line("demo OK"));
    assert!(!is_chatty_log_line(""));
}

/// A schedule the router would refuse, or one with no call, is a usage error (exit 2) before
/// any fabric starts, not a run that reports refused calls and a made-up throughput.
#[test]
fn demo_refuses_schedules_the_router_would_refuse() {
    for (args, says) in [
        (&["--batches", "1,1000"][..], "a batch of 1000 tokens"),
        (&["--batches", "0"][..], "a batch of 0 tokens"),
        (&["--rounds", "0"][..], "both must be at least 1"),
        (&["--clients", "0"][..], "both must be at least 1"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_expertmesh"))
            .arg("demo")
            .args(args)
            .current_dir(root())
            .output()
            .expect("run expertmesh demo");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
        assert!(
            !String::from_utf8_lossy(&out.stdout).contains("starting a local fabric"),
            "{args:?}: nothing started"
        );
    }
}

/// An interrupted demo (Ctrl-C ends it without dropping its temporary folder) leaves a folder
/// named after its process; the next demo removes it, and leaves a running one's alone.
#[test]
fn the_next_demo_removes_an_interrupted_ones_folder() {
    let _machine = crate::support::shared();
    let tmp = tempfile::tempdir().unwrap();
    // No process has this id (Linux ids stay below 2^22); this test's own process runs.
    let stale = tmp.path().join("expertmesh-demo-999999999-AbC123");
    let running = tmp
        .path()
        .join(format!("expertmesh-demo-{}-XyZ789", std::process::id()));
    for d in [&stale, &running] {
        std::fs::create_dir_all(d.join("logs")).unwrap();
        std::fs::write(d.join("logs/worker-0.log"), "a worker's log").unwrap();
    }
    let out = Command::new(env!("CARGO_BIN_EXE_expertmesh"))
        .args(["demo", "--rounds", "1", "--batches", "1", "--quiet"])
        .current_dir(root())
        .env("TMPDIR", tmp.path())
        .output()
        .expect("run expertmesh demo");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(!stale.exists(), "the interrupted demo's folder is left");
    assert!(running.exists(), "a running process's folder was removed");
    let left: Vec<_> = std::fs::read_dir(tmp.path())
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(
        left.len(),
        1,
        "this demo's own folder is removed too: {left:?}"
    );
}
