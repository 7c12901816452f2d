//! Exit codes, and the texts that tell users what each command's codes mean.
//!
//! Why this exists: scripts and cluster engines act on exit codes, so every command uses the
//! same three (0 success, 1 invalid input or mismatched results, 2 usage or I/O error) and
//! says in its `--help` what each means for it; `expertmesh --help` lists them all.

/// Exit code for invalid input (validation failed, results mismatched).
pub const EXIT_INVALID: u8 = 1;
/// Exit code for usage and I/O errors.
pub const EXIT_USAGE: u8 = 2;

/// Exit codes of every command, shown by `expertmesh --help`.
pub(crate) const EXIT_CODES_HELP: &str = "\
Exit codes: 0 success, 1 invalid input or mismatched results, 2 usage or I/O error. Per command:
  models              0 listed or shown; 1 the model file has problems; 2 unknown preset,
                      unreadable file, bad options
  validate            0 valid; 1 problems found (listed with line:column); 2 unreadable file,
                      unknown preset, bad options
  plan                0 planned; 1 the model does not fit (shortfall named); 2 usage or input error
  convert             0 converted; 1 a problem in the checkpoint, config.json or placement (the
                      tensor or file is named) or a failed write (finished shards are kept:
                      re-run to resume); 2 usage
  bench ...           0 measured; 1 (cluster, soak) a wrong answer, a failed or hung call;
                      2 bad options, or a run that could not start
  demo                0 every response matched the reference; 1 mismatched or failed responses;
                      2 usage or start-up error
  up, worker, router  0 stopped cleanly; 2 usage, start-up or I/O error (1 is not used);
                      worker --prepare-tile-cache: 0 tiles kept (or already kept, or no experts
                      to keep), 2 not kept (the reason is printed)
  infer               0 output written; 1 the router answered with an error; 2 usage, I/O or
                      connection error
  rebalance, drain    0 the placement is served (a device that did not confirm its release is
                      named in a warning); 1 the router refused it or the change failed and
                      was undone; 2 usage, file or connection error
  keys init|issue     0 written; 2 the file exists (never overwritten), bad key, topology or
                      options
  deploy ENGINE       0 written; 2 invalid topology, model, placement, weights or key, bad
                      options, or a failed write
Benchmarks and their JSON format: `expertmesh bench --help` and BENCHMARKS.md.";

/// Each command's exit codes, appended to its own --help (after any text it has).
pub(crate) const COMMAND_EXIT_CODES: [(&str, &str); 11] = [
    ("models", MODELS_EXIT),
    ("validate", VALIDATE_EXIT),
    ("plan", PLAN_EXIT),
    ("convert", crate::cmd::convert::CONVERT_EXIT),
    ("demo", DEMO_EXIT),
    ("up", SERVE_EXIT),
    ("worker", SERVE_EXIT),
    ("router", SERVE_EXIT),
    ("infer", INFER_EXIT),
    ("rebalance", REBALANCE_EXIT),
    ("drain", REBALANCE_EXIT),
];
const MODELS_EXIT: &str = "Exit codes: 0 listed or shown; 1 the model file has problems; 2 unknown preset, unreadable file, bad options.";
const VALIDATE_EXIT: &str = "Exit codes: 0 valid; 1 problems found (listed with line:column); 2 unreadable file, unknown preset, bad options.";
const PLAN_EXIT: &str =
    "Exit codes: 0 planned; 1 the model does not fit (shortfall named); 2 usage or input error.";
const DEMO_EXIT: &str = "Exit codes: 0 every response matched the reference; 1 mismatched or failed responses; 2 usage or start-up error.";
const SERVE_EXIT: &str =
    "Exit codes: 0 stopped cleanly; 2 usage, start-up or I/O error (1 is not used).";
const REBALANCE_EXIT: &str = "Exit codes: 0 the placement is served (a device that did not confirm its release is named in a warning); 1 the router refused it or the change failed and was undone; 2 usage, file or connection error.";
const INFER_EXIT: &str = "Exit codes: 0 output written; 1 the router answered with an error; 2 usage, I/O or connection error.";

#[cfg(test)]
mod tests {
    use super::{COMMAND_EXIT_CODES, EXIT_CODES_HELP};

    /// `expertmesh --help` lists the exit codes of every command that states its own.
    #[test]
    fn the_top_level_table_names_every_command() {
        for (command, _) in COMMAND_EXIT_CODES {
            let listed = EXIT_CODES_HELP.lines().any(|l| {
                let names = l.trim_start().split("  ").next().unwrap_or("");
                names.split([',', ' ']).any(|n| n == command)
            });
            assert!(listed, "{command} is missing from:\n{EXIT_CODES_HELP}");
        }
    }
}
