//! The `expertmesh` binary: a thin entry point over `expertmesh_fabric::cli`.

fn main() -> std::process::ExitCode {
    expertmesh_fabric::cli::main()
}
