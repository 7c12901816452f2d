//! The stand-in's MFMA / WMMA emulators (`hip-kernels/standin/em_matrix_emu.h`) against AMD's
//! matrix instruction calculator (`../shared/third_party/amd-matrix-calculator`): where every
//! element of A, B, C and D lives, and a product computed through those registers. Runs without the
//! `hip` feature (it needs g++ and Python 3 with tabulate; without them it says "skipped: ...").

use super::support::{have, manifest, say};
use std::path::Path;
use std::process::Command;

/// One instruction's layout as AMD's calculator prints it: lines of
/// `<op> <matrix> <row> <col> <lane> <slot>` for matrix_emu_check.cpp.
fn calculator_layout(python: &str, calc: &Path, op: usize, arch: &str, instr: &str) -> Vec<String> {
    let mut lines = Vec::new();
    for m in ['A', 'B', 'C', 'D'] {
        let out = Command::new(python)
            .arg(calc)
            .args([
                "--architecture",
                arch,
                "--instruction",
                instr,
                "--register-layout",
            ])
            .arg(format!("--{m}-matrix"))
            .output()
            .expect("run the matrix calculator");
        assert!(
            out.status.success(),
            "matrix calculator failed for {instr} {m}:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8_lossy(&out.stdout);
        let mut row: Option<usize> = None;
        for line in text.lines().filter(|l| l.starts_with('|')) {
            let cells: Vec<&str> = line.trim_matches('|').split('|').map(str::trim).collect();
            if cells[0].contains('[') {
                continue; // the header: "A[M][K] | 0 | 1 | ..."
            }
            if !cells[0].is_empty() {
                row = Some(cells[0].parse().expect("row index"));
            }
            let r = row.expect("a row before its continuation line");
            for (col, cell) in cells[1..].iter().enumerate() {
                if cell.is_empty() {
                    continue;
                }
                // v<reg>{<lane>} or v<reg>{<lane>}.[<hi>:<lo>]
                let (reg, rest) = cell[1..].split_once('{').expect("v<reg>{lane}");
                let (lane, bits) = rest.split_once('}').expect("{lane}");
                let reg: usize = reg.parse().expect("register");
                let lane: usize = lane.parse().expect("lane");
                let slot = match bits.strip_prefix(".[") {
                    Some(b) => {
                        let lo: usize = b
                            .trim_end_matches(']')
                            .split(':')
                            .nth(1)
                            .expect("lo bit")
                            .parse()
                            .expect("bit");
                        reg * 4 + lo / 8
                    }
                    None => reg,
                };
                // A and B are printed row-major as A[M][K] and B[K][N]; C and D as [M][N].
                lines.push(format!("{op} {m} {r} {col} {lane} {slot}"));
            }
        }
    }
    lines
}

/// The MFMA / WMMA emulators against AMD's matrix instruction calculator, for every coordinate of
/// A, B, C and D; and a corrupted layout fails the same check.
#[test]
fn matrix_emulators_follow_amds_calculator() {
    let calc =
        manifest().join("../../shared/third_party/amd-matrix-calculator/matrix_calculator.py");
    if !calc.is_file() {
        say(
            "skipped: AMD's matrix instruction calculator not found (../shared/third_party/amd-matrix-calculator)",
        );
        return;
    }
    let python = ["python3", "/usr/bin/python3"].into_iter().find(|p| {
        Command::new(p)
            .args(["-c", "import tabulate"])
            .output()
            .is_ok_and(|o| o.status.success())
    });
    let Some(python) = python else {
        say(
            "skipped: the matrix calculator needs Python 3 with tabulate (apt-get install python3-tabulate)",
        );
        return;
    };
    if !have("g++") {
        say("skipped: g++ not found: the matrix emulator check cannot be built");
        return;
    }
    let mut layout = Vec::new();
    for (op, arch, instr) in [
        (0, "cdna2", "v_mfma_i32_16x16x16i8"),
        (1, "cdna3", "v_mfma_i32_16x16x32_i8"),
        (2, "rdna3", "v_wmma_i32_16x16x16_iu8"),
    ] {
        let lines = calculator_layout(python, &calc, op, arch, instr);
        // Every element of the four 16x16(xK) matrices is placed at least once.
        let k = if op == 1 { 32 } else { 16 };
        assert!(
            lines.len() >= 2 * 16 * k + 2 * 256,
            "{instr}: only {} layout entries",
            lines.len()
        );
        layout.extend(lines);
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let bin = dir.path().join("matrix_emu_check");
    let out = Command::new("g++")
        .args(["-std=c++17", "-O1", "-Wall", "-Wextra", "-o"])
        .arg(&bin)
        .arg(manifest().join("standin/matrix_emu_check.cpp"))
        .output()
        .expect("run g++");
    assert!(
        out.status.success(),
        "g++ failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Warnings are shown, not fatal: another compiler version may add some.
    if !out.stderr.is_empty() {
        eprintln!(
            "note: g++ warned:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let run = |lines: &[String]| {
        use std::io::Write;
        let mut child = Command::new(&bin)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("run matrix_emu_check");
        child
            .stdin
            .take()
            .expect("stdin")
            .write_all(lines.join("\n").as_bytes())
            .expect("write layout");
        let out = child.wait_with_output().expect("wait");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    };
    let (ok, text) = run(&layout);
    assert!(ok, "the emulators disagree with AMD's layouts:\n{text}");
    assert_eq!(text.matches("PASS").count(), 3, "{text}");
    say(&format!(
        "ran: MFMA/WMMA emulators against AMD's calculator ({} layout entries)",
        layout.len()
    ));
    // Moving one D element to another lane in the calculator's layout must fail.
    let mut wrong = layout.clone();
    let i = wrong
        .iter()
        .position(|l| l.starts_with("2 D 3 5 "))
        .expect("WMMA D[3][5]");
    let f: Vec<&str> = wrong[i].split(' ').collect();
    let lane: usize = f[4].parse().expect("lane");
    wrong[i] = format!("2 D 3 5 {} {}", (lane + 1) % 32, f[5]);
    let (ok, text) = run(&wrong);
    assert!(
        !ok && text.contains("FAIL v_wmma_i32_16x16x16_iu8"),
        "{text}"
    );
}
