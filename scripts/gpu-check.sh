#!/usr/bin/env bash
# gpu-check.sh — build the HIP kernels for an NVIDIA GPU through HIP's NVIDIA headers, check them
# bit for bit against the Rust reference's test vectors, and time decode (exact, accurate) and
# prefill on Kimi-sized experts.
#
#   scripts/gpu-check.sh --prepare      (on a dev machine: writes .gpu-out/vectors.emtv with the
#                                        Rust reference and copies HIP's NVIDIA headers from
#                                        Debian's libamdhip64-dev into .hip-nvidia/; both folders
#                                        are git-ignored and must travel to the GPU machine)
#   scripts/nvcc-local.sh [-D...]       (on a dev machine without a GPU: compiles the harness
#                                        with CUDA's compiler from PyPI and prints each kernel's
#                                        registers and spills; run it before spending device time)
#   scripts/gpu-check.sh [OUT_DIR]      (on the GPU machine: OUT_DIR defaults to $OUT, then
#                                        .gpu-out; writes OUT_DIR/gpu-check.json and the log)
#
# Every CI run already executes the kernels without a GPU, through the HIP-CPU stand-in for the
# HIP runtime (hip-kernels/standin/, `cargo test -p expertmesh-hip-kernels --features hip`): bit
# for bit, every target branch. The stand-in cannot show GPU memory-model races (x86 fences are
# stronger) or speed; this script, on a real GPU, is the check for those.
#
# Needs nvcc (PATH or /usr/local/cuda/bin) and an NVIDIA GPU; no Rust when the vectors were
# prepared. If the HIP NVIDIA headers do not compile with this CUDA, it retries with the CUDA
# runtime directly (EM_HIP_NVIDIA_SHIM) and says so. Then, where compute-sanitizer exists (and
# EM_GPU_SANITIZE is not 0), memcheck, racecheck and synccheck over the bit-exact cases.
# EM_GPU_VARIANTS (see below) builds and times kernel variants side by side.
# Bounded: compile ~1 min, run <= 240 s, sanitizer passes <= 90 s each, each variant <= 240 s.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VECTORS=${EM_VECTORS:-$ROOT/.gpu-out/vectors.emtv}

say() { printf '\n==> %s\n' "$*"; }

if [ "${1:-}" = "--prepare" ]; then
  mkdir -p .gpu-out
  say "writing test vectors with the Rust reference"
  cargo run -q --release -p expertmesh-hip-kernels --example write_test_vectors -- "$VECTORS" || exit 1
  say "copying HIP's NVIDIA headers into .hip-nvidia/"
  python3 scripts/hip-nvidia-headers.py /usr/include/hip .hip-nvidia || exit 1
  echo "prepared: carry .gpu-out and .hip-nvidia to the GPU machine, then run scripts/gpu-check.sh"
  exit 0
fi

OUT_DIR=${1:-${OUT:-$ROOT/.gpu-out}}
mkdir -p "$OUT_DIR"
LOG=$OUT_DIR/gpu-check.log
exec > >(tee "$LOG") 2>&1

NVCC=$(command -v nvcc || true)
[ -z "$NVCC" ] && [ -x /usr/local/cuda/bin/nvcc ] && NVCC=/usr/local/cuda/bin/nvcc
if [ -z "$NVCC" ]; then echo "gpu-check: FAILED: nvcc not found (PATH or /usr/local/cuda/bin)"; exit 2; fi
if ! command -v nvidia-smi >/dev/null; then echo "gpu-check: FAILED: nvidia-smi not found: no NVIDIA driver"; exit 2; fi
say "device"
nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version --format=csv,noheader
"$NVCC" --version | tail -2
CC=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d ' .')
ARCH=sm_${CC:-90}

if [ ! -f "$VECTORS" ]; then
  if command -v cargo >/dev/null; then
    say "no vectors at $VECTORS: writing them with the Rust reference"
    mkdir -p "$(dirname "$VECTORS")"
    cargo run -q --release -p expertmesh-hip-kernels --example write_test_vectors -- "$VECTORS" || exit 1
  else
    echo "gpu-check: FAILED: $VECTORS missing and no cargo here; run scripts/gpu-check.sh --prepare first"
    exit 2
  fi
fi

if [ ! -d .hip-nvidia/hip ] && [ -d /usr/include/hip/nvidia_detail ]; then
  python3 scripts/hip-nvidia-headers.py /usr/include/hip .hip-nvidia
fi

BUILD=$(mktemp -d)
trap 'rm -rf "$BUILD"' EXIT
FLAGS=(-std=c++17 -O3 --fmad=false -prec-div=true -prec-sqrt=true -ftz=false -arch="$ARCH" -x cu
       -diag-suppress 2810,940 -Xcompiler -Wno-deprecated-declarations,-Wno-unused-result,-Wno-return-type)
SRC=hip-kernels/harness/gpu_harness.hip
MODE=""
if [ -d .hip-nvidia/hip ]; then
  say "building the harness and kernels through HIP's NVIDIA headers (.hip-nvidia) for $ARCH"
  if timeout 300 "$NVCC" "${FLAGS[@]}" -D__HIP_PLATFORM_NVIDIA__ -I.hip-nvidia -o "$BUILD/gpu_harness" "$SRC" \
       2>"$BUILD/hip.err"; then
    MODE="hip-nvidia-headers"
    MODE_FLAGS=(-D__HIP_PLATFORM_NVIDIA__ -I.hip-nvidia)
  else
    echo "WARNING: HIP's NVIDIA headers do not compile with this CUDA; first errors:"
    grep -m 10 error "$BUILD/hip.err"
  fi
else
  echo "WARNING: .hip-nvidia/ missing (run scripts/gpu-check.sh --prepare on a machine with libamdhip64-dev)"
fi
if [ -z "$MODE" ]; then
  say "building with the CUDA runtime directly (EM_HIP_NVIDIA_SHIM) for $ARCH"
  timeout 300 "$NVCC" "${FLAGS[@]}" -DEM_HIP_NVIDIA_SHIM -o "$BUILD/gpu_harness" "$SRC" || {
    echo "gpu-check: FAILED: the harness does not compile"; exit 1; }
  MODE="cuda-shim"
  MODE_FLAGS=(-DEM_HIP_NVIDIA_SHIM)
fi

say "running (build mode: $MODE)"
timeout 240 "$BUILD/gpu_harness" "$VECTORS" "$OUT_DIR"
rc=$?
# compute-sanitizer over the bit-exact cases: out-of-bounds and misaligned accesses (memcheck),
# shared-memory hazards (racecheck), barrier misuse (synccheck). The phase-2 wait of the fused
# decode may time out under the sanitizer's slowdown: such a case then fails as a timeout, not a
# race; the sanitizer's own error summary is what this step reports.
SAN=$(command -v compute-sanitizer || true)
[ -z "$SAN" ] && [ -x /usr/local/cuda/bin/compute-sanitizer ] && SAN=/usr/local/cuda/bin/compute-sanitizer
SAN_RESULT="not run (no compute-sanitizer)"
if [ -n "$SAN" ] && [ "${EM_GPU_SANITIZE:-1}" = 1 ]; then
  SAN_RESULT=""
  for tool in memcheck racecheck synccheck; do
    say "compute-sanitizer --tool $tool over the bit-exact cases"
    EM_GPU_CORRECTNESS_ONLY=1 timeout 90 "$SAN" --tool "$tool" --error-exitcode 9 \
      "$BUILD/gpu_harness" "$VECTORS" "$BUILD" 2>&1 | tail -25
    src=${PIPESTATUS[0]}
    case $src in
      0) SAN_RESULT+="$tool clean; " ;;
      9) SAN_RESULT+="$tool FOUND ERRORS; "; [ $rc -eq 0 ] && rc=9 ;;
      124) SAN_RESULT+="$tool did not finish in 90 s; " ;;
      *) SAN_RESULT+="$tool exit $src; " ;;
    esac
  done
fi

# Kernel variants (EM_GPU_VARIANTS="name=-DMACRO=V -D...;name2=..."): the harness built once per
# variant, in parallel, then each run alone: correctness (every variant must stay bit-identical)
# and the timings, OUT_DIR/variant-NAME.json each, and a table of ratios to compare.
# EM_GPU_DECODE_ONLY=1 times exact decode only (no accurate decode, no prefill).
if [ -n "${EM_GPU_VARIANTS:-}" ]; then
  say "building kernel variants: $EM_GPU_VARIANTS"
  IFS=';' read -ra VARIANTS <<<"$EM_GPU_VARIANTS"
  pids=()
  for v in "${VARIANTS[@]}"; do
    name=${v%%=*}
    read -ra vflags <<<"${v#*=}"
    timeout 300 "$NVCC" "${FLAGS[@]}" "${MODE_FLAGS[@]}" "${vflags[@]}" -o "$BUILD/variant-$name" "$SRC" \
      2>"$BUILD/variant-$name.err" &
    pids+=($!)
  done
  wait "${pids[@]}"  # not a bare wait: that would also wait for the log's tee
  for v in "${VARIANTS[@]}"; do
    name=${v%%=*}
    say "variant $name (${v#*=})"
    if [ ! -x "$BUILD/variant-$name" ]; then
      echo "variant $name: does not compile"; grep -m 5 error "$BUILD/variant-$name.err"; [ $rc -eq 0 ] && rc=1; continue
    fi
    mkdir -p "$BUILD/out-$name"
    timeout 240 "$BUILD/variant-$name" "$VECTORS" "$BUILD/out-$name" | grep -vE '^PASS'
    vrc=${PIPESTATUS[0]}
    cp "$BUILD/out-$name/gpu-check.json" "$OUT_DIR/variant-$name.json" 2>/dev/null
    [ $vrc -ne 0 ] && { echo "variant $name: FAILED (exit $vrc)"; [ $rc -eq 0 ] && rc=1; }
  done
  say "variants: decode exact, achieved / copy bandwidth per batch size"
  python3 - "$OUT_DIR" "$EM_GPU_VARIANTS" <<'PY'
import json, sys
out, spec = sys.argv[1], sys.argv[2]
print(f"{'variant':<10} {'checks':>9} " + " ".join(f"B={b:<4}" for b in (1, 2, 4, 8, 16)) + "  worst")
for v in spec.split(';'):
    name = v.split('=', 1)[0]
    try:
        j = json.load(open(f"{out}/variant-{name}.json"))
    except OSError:
        print(f"{name:<10} no result"); continue
    exact = [x for x in j['results'] if x.get('name') == 'decode_exact_kimi_k2']
    r = {x['batch']: x['ratio'] for x in exact}
    k = {x['batch']: x.get('kernel_ratio', 0) for x in exact}
    checks = f"{j['correctness_passed']}/{j['correctness_passed'] + j['correctness_failed']}"
    print(f"{name:<10} {checks:>9} " + " ".join(f"{r.get(b, 0):<6.3f}" for b in (1, 2, 4, 8, 16))
          + f"  {j['decode_worst_ratio']:.3f}   kernel alone B=1 {k.get(1, 0):.3f} B=16 {k.get(16, 0):.3f}")
    acc = {x['batch']: x['ratio'] for x in j['results'] if x.get('name') == 'decode_accurate_kimi_k2'}
    pre = {x['tokens']: x['tops'] for x in j['results'] if x.get('name') == 'prefill_exact_kimi_k2'}
    if acc or pre:
        print(f"{'':<10} accurate B=1/4/16 " + " / ".join(f"{acc.get(b, 0):.3f}" for b in (1, 4, 16))
              + "   prefill TOPS T=256/1024 " + " / ".join(f"{pre.get(t, 0):.2f}" for t in (256, 1024)))
PY
fi

say "summary"
echo "compute-sanitizer: $SAN_RESULT"
if [ $rc -eq 0 ]; then
  echo "gpu-check: PASSED: exact mode bit-identical to the Rust reference on every case; accurate mode within tolerance"
elif [ $rc -eq 9 ]; then
  echo "gpu-check: FAILED: compute-sanitizer found errors (above)"
elif [ $rc -eq 124 ]; then
  echo "gpu-check: FAILED: the harness exceeded 240 s"
else
  echo "gpu-check: FAILED (harness exit $rc): see the FAIL lines above"
fi
echo "results: $OUT_DIR/gpu-check.json, log: $LOG (build mode: $MODE)"
exit $rc
