//! The `expertmesh` binary: a thin entry point over [`expertmesh::cli::main`].

fn main() -> std::process::ExitCode {
    expertmesh::cli::main()
}
