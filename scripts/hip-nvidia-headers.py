#!/usr/bin/env python3
"""Bring HIP's NVIDIA headers along for scripts/gpu-check.sh.

Copies Debian's /usr/include/hip (ROCm 5.2, with nvidia_detail/) into the git-ignored folder
.hip-nvidia/hip and removes the handful of inline wrappers that no longer compile against CUDA 12
and 13 (texture references, removed in CUDA 12; graph-edge, capture-info, mem-advise and
multi-device-launch signatures changed in CUDA 12.3/13; cudaDeviceProp fields removed in 13).
None of them is used by ExpertMesh's kernels or harness. Everything else is copied unchanged.

Usage: scripts/hip-nvidia-headers.py [SRC=/usr/include/hip] [DEST=.hip-nvidia]
"""
import os
import re
import shutil
import sys

BROKEN = [
    "hipBindTexture", "hipBindTexture2D", "hipBindTextureToArray", "hipUnbindTexture",
    "hipGetTextureAlignmentOffset", "hipChooseDevice", "hipGetDeviceProperties",
    "hipGraphAddDependencies", "hipGraphGetEdges", "hipGraphNodeGetDependencies",
    "hipGraphNodeGetDependentNodes", "hipGraphRemoveDependencies",
    "hipLaunchCooperativeKernelMultiDevice", "hipMemAdvise", "hipMemPrefetchAsync",
    "hipStreamGetCaptureInfo_v2", "hipStreamUpdateCaptureDependencies", "hipCtxCreate",
    "hipDeviceGetAttribute", "hipTexRefSetAddressMode", "hipTexRefSetFilterMode",
    "hipTexRefSetAddress", "hipTexRefSetAddress2D", "hipTexRefSetFormat", "hipTexRefSetFlags",
    "hipTexRefSetArray", "hipTexRefGetAddress", "hipTexRefSetBorderColor", "hipTexRefSetMipmappedArray",
    "hipTexRefGetAddressMode", "hipTexRefGetArray", "hipMemcpyToArray", "hipMemcpyFromArray",
    "hipGetTextureReference", "hipProfilerStart", "hipProfilerStop",
]


def strip_definitions(text, names):
    """Remove every function definition (with its leading template/attribute lines) whose name is
    in `names`: from the start of its declaration to the matching closing brace."""
    out = []
    lines = text.split("\n")
    i = 0
    removed = 0
    pat = re.compile(r"\b(" + "|".join(map(re.escape, names)) + r")\s*\(")
    while i < len(lines):
        line = lines[i]
        m = pat.search(line)
        is_def = m and ("inline" in line or (i > 0 and ("inline" in lines[i - 1] or lines[i - 1].strip().startswith("template"))))
        if is_def and not line.strip().startswith("return"):
            # back up over the declaration prefix lines already emitted (template <...>, __HIP_DEPRECATED)
            while out and (out[-1].strip().startswith("template") or out[-1].strip() in ("__HIP_DEPRECATED", "__HIP_DEPRECATED_MSG")):
                out.pop()
            depth = 0
            seen_open = False
            j = i
            while j < len(lines):
                for ch in lines[j]:
                    if ch == "{":
                        depth += 1
                        seen_open = True
                    elif ch == "}":
                        depth -= 1
                if seen_open and depth == 0:
                    break
                if not seen_open and lines[j].rstrip().endswith(";"):
                    break  # a declaration only
                j += 1
            out.append("/* ExpertMesh: %s removed (does not compile against CUDA >= 12) */" % m.group(1))
            removed += 1
            i = j + 1
            continue
        out.append(line)
        i += 1
    return "\n".join(out), removed


def main():
    src = sys.argv[1] if len(sys.argv) > 1 else "/usr/include/hip"
    dest = sys.argv[2] if len(sys.argv) > 2 else ".hip-nvidia"
    if not os.path.isdir(os.path.join(src, "nvidia_detail")):
        sys.exit("hip-nvidia-headers: %s has no nvidia_detail/ (apt-get install libamdhip64-dev)" % src)
    target = os.path.join(dest, "hip")
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(src, target, symlinks=False)
    api = os.path.join(target, "nvidia_detail", "nvidia_hip_runtime_api.h")
    text, removed = strip_definitions(open(api).read(), BROKEN)
    # cuda_profiler_api.h ships with full CUDA toolkits; keep the include but tolerate its absence.
    text = text.replace("#include <cuda_profiler_api.h>",
                        "#if __has_include(<cuda_profiler_api.h>)\n#include <cuda_profiler_api.h>\n#endif")
    open(api, "w").write(text)
    print("hip-nvidia-headers: copied %s to %s, removed %d CUDA>=12-incompatible wrappers" % (src, target, removed))


if __name__ == "__main__":
    main()
