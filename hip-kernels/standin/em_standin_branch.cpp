// em_standin_branch.cpp — the project's unmodified kernels (kernels/*.hip) compiled for the host
// through HIP-CPU, for one target branch, as the stand-in's kernel table.
//
// Why this exists: each AMD target takes a different path through the kernels (wave 64 or 32,
// MFMA 16x16x16 or 16x16x32, WMMA, dot instructions, or the portable path). The tests build this
// file once per branch, each into its own stand-in library, so that every path executes:
//   generic (g++):   -DEM_WAVE=64 or 32, no EM_DEVICE_AMD: the portable path (NVIDIA-style ids,
//                    __syncthreads, __shfl_xor_sync, plain loads)
//   AMD (clang++):   -DEM_DEVICE_AMD=1 -D__gfxNNN__ -D__AMDGCN_WAVEFRONT_SIZE=64|32: the AMD
//                    path, its builtins mapped by em_amd_builtins.h
// plus -DEM_STANDIN_ARCH="gfx90a" (the arch the device reports and whose code objects it accepts)
// and -DEM_STANDIN_NAME="...". Link with em_standin_api.cpp, -ltbb -lpthread.
#include <hip/hip_runtime.h>

#include <chrono>
#include <cstring>
#include <thread>

#include "em_standin.h"

#if defined(EM_DEVICE_AMD)
#include "em_amd_builtins.h"
#else
// The portable branch's CUDA-only names, onto HIP-CPU (its __shfl_xor honours the width).
#define __shfl_xor_sync(mask, v, lane_mask, width) __shfl_xor((v), (lane_mask), (width))
#define __ldcg(p) (*(p))
// The fused decode kernel's bounded wait sleeps, so its limit is time, not this machine's speed.
#define EM_HOST_SLEEP() std::this_thread::sleep_for(std::chrono::microseconds(10))
#endif

// Found through -I hip-kernels/kernels (or a mutated copy of it, for the tests that prove a
// broken kernel fails the check).
#include "activations.hip"
#include "decode.hip"
#include "prefill.hip"

#ifndef EM_STANDIN_ARCH
#error "define EM_STANDIN_ARCH (the gfx target this stand-in reports)"
#endif
#ifndef EM_STANDIN_NAME
#error "define EM_STANDIN_NAME (the branch's name)"
#endif

namespace {

// Unpack the argument block (the kernel's single by-value parameter) and run the whole grid.
template <typename Args, void (*Kernel)(Args)>
int launch(uint32_t gx, uint32_t gy, uint32_t gz, uint32_t bx, uint32_t by, uint32_t bz, void** params) {
    Args a;
    memcpy(&a, params[0], sizeof a);
    hipLaunchKernelGGL(Kernel, dim3(gx, gy, gz), dim3(bx, by, bz), 0, nullptr, a);
    return hipDeviceSynchronize() == hipSuccess ? 0 : 1;
}

const EmStandinKernel KERNELS[] = {
    {"em_quantize_activations", "activations", launch<EmQuantArgs, em_quantize_activations>, EM_WG_THREADS},
    {"em_combine_slots", "activations", launch<EmCombineArgs, em_combine_slots>, EM_WG_THREADS},
    {"em_decode_exact", "decode", launch<EmFfnArgs, em_decode_exact>, EM_WG_THREADS},
    {"em_decode_accurate", "decode", launch<EmFfnArgs, em_decode_accurate>, EM_WG_THREADS},
    {"em_prefill_exact_w13", "prefill", launch<EmFfnArgs, em_prefill_exact_w13>, EM_PREFILL_WAVES * EM_WAVE},
    {"em_prefill_exact_w2", "prefill", launch<EmFfnArgs, em_prefill_exact_w2>, EM_PREFILL_WAVES * EM_WAVE},
};

const EmStandinBranch BRANCH = {EM_STANDIN_NAME, EM_STANDIN_ARCH, EM_WAVE, KERNELS, sizeof KERNELS / sizeof KERNELS[0]};

}  // namespace

const EmStandinBranch& em_standin_branch() { return BRANCH; }
