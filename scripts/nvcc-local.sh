#!/usr/bin/env bash
# nvcc-local.sh — compile the GPU harness for an NVIDIA target on a machine without a GPU or a
# CUDA install, and print each kernel's registers, stack and spills: the check to run before
# spending lent device time (scripts/gpu-check.sh) on a kernel change.
#
#   scripts/nvcc-local.sh [-DMACRO=V ...]     (flags go to nvcc, e.g. -DEM_PHASE1_TILES=1)
#
# Fetches NVIDIA's CUDA 13.0 compiler wheels from PyPI (nvcc, crt, nvvm, runtime headers, cccl)
# once into .cuda-local/ (git-ignored, ~300 MB), then builds hip-kernels/harness/gpu_harness.hip
# through HIP's NVIDIA headers (.hip-nvidia/, from `scripts/gpu-check.sh --prepare`) for sm_90
# with gpu-check.sh's flags. Needs python3 with pip and network access for the first run; the
# binary it links is not run here. ARCH=sm_80 etc. picks another target.
set -euo pipefail
cd "$(dirname "$0")/.."
CUDA=.cuda-local
ARCH=${ARCH:-sm_90}
if [ ! -x "$CUDA/nvidia/cu13/bin/nvcc" ]; then
  echo "fetching the CUDA 13.0 compiler wheels into $CUDA/ (once)"
  mkdir -p "$CUDA/wheels"
  python3 -m pip download -q --no-deps -d "$CUDA/wheels" 'nvidia-cuda-nvcc==13.0.*' \
    'nvidia-cuda-crt==13.0.*' 'nvidia-nvvm==13.0.*' 'nvidia-cuda-runtime==13.0.*' \
    'nvidia-cuda-cccl==13.0.*'
  for w in "$CUDA"/wheels/*.whl; do python3 -m zipfile -e "$w" "$CUDA"; done
  chmod +x "$CUDA"/nvidia/cu13/bin/* "$CUDA"/nvidia/cu13/nvvm/bin/*
fi
if [ ! -d .hip-nvidia/hip ]; then
  python3 scripts/hip-nvidia-headers.py /usr/include/hip .hip-nvidia
fi
export PATH="$PWD/$CUDA/nvidia/cu13/bin:$PATH"
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
nvcc -std=c++17 -O3 --fmad=false -prec-div=true -prec-sqrt=true -ftz=false -arch="$ARCH" -x cu \
  -diag-suppress 2810,940 -Xcompiler -Wno-deprecated-declarations,-Wno-unused-result,-Wno-return-type \
  -D__HIP_PLATFORM_NVIDIA__ -I.hip-nvidia "$@" -Xptxas -v -c -o "$out/harness.o" \
  hip-kernels/harness/gpu_harness.hip 2>"$out/log" || { grep -E "error" "$out/log"; exit 1; }
# One line per kernel: name, registers, stack frame and spills.
awk '/Compiling entry function/ { match($0, /'"'"'[^'"'"']+'"'"'/); name = substr($0, RSTART + 1, RLENGTH - 2) }
     /bytes stack frame/ { frame = $0 }
     /Used [0-9]+ registers/ && name != "" {
       match($0, /Used [0-9]+ registers/); regs = substr($0, RSTART + 5, RLENGTH - 15)
       gsub(/^ +/, "", frame); printf "%-26s %3s registers  %s\n", name, regs, frame; name = "" }' "$out/log"
