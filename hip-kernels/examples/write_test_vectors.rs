//! Writes the standard kernel test vectors (`EMTV`) for the C++ harnesses.
//!
//! Why this exists: scripts/gpu-check.sh runs on GPU machines that may have no Rust toolchain;
//! the vectors are written here, by the Rust reference, and carried along.
//!
//! Usage: `cargo run -p expertmesh-hip-kernels --example write_test_vectors -- OUT.emtv [SEED]`

use expertmesh_hip_kernels::testvec;
use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let Some(path) = args.get(1) else {
        eprintln!("usage: write_test_vectors OUT.emtv [SEED]");
        return ExitCode::from(2);
    };
    let seed = match args.get(2).map(|s| s.parse::<u64>()) {
        None => 20_260_601,
        Some(Ok(s)) => s,
        Some(Err(e)) => {
            eprintln!("bad seed: {e}");
            return ExitCode::from(2);
        }
    };
    let cases = match testvec::standard_cases(seed) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("generating vectors: {e}");
            return ExitCode::FAILURE;
        }
    };
    let bytes = testvec::to_bytes(&cases);
    if let Err(e) = std::fs::write(path, &bytes) {
        eprintln!("writing {path}: {e}");
        return ExitCode::FAILURE;
    }
    println!(
        "wrote {} cases ({} bytes) to {path}",
        cases.len(),
        bytes.len()
    );
    ExitCode::SUCCESS
}
