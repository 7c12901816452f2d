#!/usr/bin/env bash
# fuzz-stable.sh — build every fuzz target with libFuzzer's coverage instrumentation on the
# stable toolchain and fuzz each for a while, starting from its seeds; any crash fails.
#
# Why this exists: `cargo +nightly fuzz` needs nightly and cargo-fuzz, which a fresh machine
# (and CI) does not have, so the targets went unbuilt and unrun between sessions. rustc's stable
# `-Cpasses=sancov-module` and `-Cllvm-args=-sanitizer-coverage-*` give libFuzzer the same
# coverage feedback (no AddressSanitizer: the targets are safe Rust, and a panic is the crash).
# The manifest target found a real bug this way on its first stable run (fuzz/README.md).
#
# Usage: scripts/fuzz-stable.sh [SECONDS_PER_TARGET] [TARGET...]
#   SECONDS_PER_TARGET  default 10 (0: run each target over its seeds once, no fuzzing)
#   TARGET...           default every file in fuzz/fuzz_targets/
#   FUZZ_RUNS=N         instead of a time: N inputs per target (libFuzzer seed 1) from a fresh
#                       corpus of the seeds, a run whose length does not depend on the machine's
#                       speed (the inputs still differ between runs: the code under test hashes
#                       with random keys, which steers the coverage feedback)
# CI runs `scripts/fuzz-stable.sh 0`: every target builds and passes its seeds, with no random
# inputs that could fail a run on a crash nobody has seen.
# Needs a C++ compiler (libfuzzer-sys builds libFuzzer). Builds into target/fuzz-stable; the
# corpora grow in target/fuzz-stable/corpus/<target> (seeds copied in first, kept between
# runs); a crash leaves its input in target/fuzz-stable/artifacts/<target>/ and is named at the
# end. Exit 0: no crash; 1: a target crashed; 2: the build failed.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
SECONDS_EACH=${1:-10}
shift || true
if [ "$#" -gt 0 ]; then
  TARGETS=("$@")
else
  mapfile -t TARGETS < <(ls fuzz/fuzz_targets | sed 's/\.rs$//' | sort)
fi
TRIPLE=$(rustc -vV | sed -n 's/^host: //p')
OUT=$ROOT/target/fuzz-stable
SANCOV="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing -Cdebug-assertions -Coverflow-checks"
bins=()
for t in "${TARGETS[@]}"; do bins+=(--bin "$t"); done
# --target: the flags reach the fuzzed code only, not build scripts and proc macros (which
# would not link without libFuzzer's hooks).
if ! (cd fuzz && RUSTFLAGS="$SANCOV" cargo build --release --target "$TRIPLE" \
        --target-dir "$OUT" "${bins[@]}"); then
  echo "fuzz-stable: the fuzz targets did not build"
  exit 2
fi
# Keep mutated host names in topology files away from the resolver (see topology_file.rs).
export EXPERTMESH_RESOLVE_HOSTS=0
# The file targets' seeds are the repository's examples.
example_seeds() {
  case "$1" in
    topology_file) ls examples/*.toml | grep -v -e '\.placement\.toml$' -e '\.model\.toml$' ;;
    model_file) ls examples/*.model.toml ;;
    placement_file) ls examples/single-host-demo-small.placement.toml ;;
    plan_inputs) ls examples/*.load.csv examples/*.coselect.json ;;
  esac
}
crashed=()
for t in "${TARGETS[@]}"; do
  corpus=$OUT/corpus/$t
  artifacts=$OUT/artifacts/$t
  # FUZZ_RUNS starts from the seeds alone.
  if [ -n "${FUZZ_RUNS:-}" ]; then rm -rf "$corpus"; fi
  mkdir -p "$corpus" "$artifacts"
  # Seeds join the corpus once (a corpus kept from earlier runs keeps what it found).
  for f in fuzz/seeds/"$t"/* $(example_seeds "$t"); do
    if [ -f "$f" ] && [ ! -e "$corpus/$(basename "$f")" ]; then cp "$f" "$corpus"/; fi
  done
  log=$OUT/$t.log
  if [ -n "${FUZZ_RUNS:-}" ]; then
    args=("$corpus" -runs="$FUZZ_RUNS" -seed=1 -max_len=65536)
  elif [ "$SECONDS_EACH" = 0 ]; then
    args=("$corpus"/*)
    [ -e "${args[0]}" ] || { echo "$t: no seeds, nothing to run"; continue; }
  else
    args=("$corpus" -max_total_time="$SECONDS_EACH" -max_len=65536)
  fi
  if "$OUT/$TRIPLE/release/$t" -artifact_prefix="$artifacts/" "${args[@]}" >"$log" 2>&1; then
    runs=$(sed -n 's/^Done \([0-9]*\) runs.*/\1/p' "$log" | tail -1)
    cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 || true)
    if [ -n "$runs" ]; then
      echo "$t: no crash ($runs runs${cov:+, $cov}, corpus $(ls "$corpus" | wc -l))"
    else
      echo "$t: no crash (its $(ls "$corpus" | wc -l) inputs run once)"
    fi
  else
    echo "$t: CRASH — input in $artifacts/, log $log:"
    grep -B2 -A12 'panicked\|deadly signal\|ERROR: libFuzzer' "$log" | head -40 || tail -20 "$log"
    crashed+=("$t")
  fi
done
if [ "${#crashed[@]}" -gt 0 ]; then
  echo "fuzz-stable: ${#crashed[@]} target(s) crashed: ${crashed[*]}"
  exit 1
fi
echo "fuzz-stable: ${#TARGETS[@]} target(s), no crash"
