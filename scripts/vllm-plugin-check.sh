#!/usr/bin/env bash
# Checks that the Python at $1 has vLLM on its CPU platform and the expertmesh plugin's entry
# point (scripts/vllm-venv.sh and .ci/run run it after installing the package).
set -euo pipefail
"$1" - <<'PYEOF'
from importlib.metadata import entry_points
import vllm
from vllm.platforms import current_platform
assert current_platform.is_cpu(), f"vLLM selected {type(current_platform).__name__}, not the CPU"
names = [ep.name for ep in entry_points(group="vllm.general_plugins")]
assert "expertmesh" in names, f"the expertmesh plugin entry point is missing: {names}"
print(f"vLLM {vllm.__version__} on {type(current_platform).__name__}; plugins: {names}")
PYEOF
