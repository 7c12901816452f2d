// em_device.h — the few device primitives the kernels need, for AMD (hip-clang) and NVIDIA (nvcc
// through HIP's NVIDIA headers).
//
// Why this file exists: the kernels are written once and compiled for gfx9 / gfx10 / gfx11 (wave64
// and wave32) and, for verification, for NVIDIA GPUs. Everything target-specific sits behind these
// small functions: thread and block ids, workgroup barrier, agent-scope fences and atomics, the
// cross-lane xor shuffle of the reduction tree, a bounded sleep. On AMD they are clang builtins only
// (no ROCm device library calls), so the kernels also build with -nogpulib for targets whose
// device libraries the installed ROCm lacks (gfx1100 with Debian's ROCm 5.2).
#ifndef EM_DEVICE_H
#define EM_DEVICE_H

#if defined(EM_HIP_NVIDIA_SHIM)
// Fallback for CUDA toolkits the bundled HIP NVIDIA headers do not compile with (see
// scripts/gpu-check.sh): the CUDA runtime directly, which is all these kernels touch.
#include <cuda_runtime.h>
#else
#include <hip/hip_runtime.h>
#endif

#include "em_abi.h"
#include "em_contract.h"

#if !defined(EM_DEVICE_AMD) && !defined(EM_DEVICE_NV) && \
    (defined(__HIP_DEVICE_COMPILE__) || defined(__CUDA_ARCH__))
#error "em_device.h: unknown device target"
#endif

#if defined(EM_DEVICE_AMD)
#define EM_WAVE __AMDGCN_WAVEFRONT_SIZE
#elif !defined(EM_WAVE)
#define EM_WAVE 32  // the portable path: NVIDIA's warp (a host build may choose 64)
#endif

// Kernel entry points have C linkage so the Rust runtime finds them by name.
#define EM_KERNEL extern "C" __global__ __launch_bounds__(EM_WG_THREADS)

__device__ inline uint32_t em_tid() {
#if defined(EM_DEVICE_AMD)
    return __builtin_amdgcn_workitem_id_x();
#else
    return threadIdx.x;
#endif
}

__device__ inline uint32_t em_bid() {
#if defined(EM_DEVICE_AMD)
    return __builtin_amdgcn_workgroup_id_x();
#else
    return blockIdx.x;
#endif
}

__device__ inline uint32_t em_bid_y() {
#if defined(EM_DEVICE_AMD)
    return __builtin_amdgcn_workgroup_id_y();
#else
    return blockIdx.y;
#endif
}

// Workgroup barrier with workgroup-scope release/acquire (LDS and global).
__device__ inline void em_sync() {
#if defined(EM_DEVICE_AMD)
    __builtin_amdgcn_fence(__ATOMIC_RELEASE, "workgroup");
    __builtin_amdgcn_s_barrier();
    __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "workgroup");
#else
    __syncthreads();
#endif
}

// Agent (whole device) scope sequentially consistent fence. On AMD it writes back and
// invalidates the CU's vector L1 as the memory model requires.
__device__ inline void em_fence_agent() {
#if defined(EM_DEVICE_AMD)
    __builtin_amdgcn_fence(__ATOMIC_SEQ_CST, "agent");
#else
    __threadfence();
#endif
}

__device__ inline uint32_t em_atomic_add_agent(uint32_t* p, uint32_t v) {
#if defined(EM_DEVICE_AMD)
    return __hip_atomic_fetch_add(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
#else
    return atomicAdd(p, v);
#endif
}

__device__ inline void em_atomic_or_agent(uint32_t* p, uint32_t v) {
#if defined(EM_DEVICE_AMD)
    (void)__hip_atomic_fetch_or(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
#else
    (void)atomicOr(p, v);
#endif
}

// A load that observes other workgroups' completed writes (bypasses the non-coherent L1).
__device__ inline uint32_t em_load_relaxed_agent(const uint32_t* p) {
#if defined(EM_DEVICE_AMD)
    return __hip_atomic_load(p, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
#else
    return *(const volatile uint32_t*)p;
#endif
}

// 16 bytes written by other workgroups of this launch (phase-1 output read in phase 2), read
// through L2 only.
__device__ inline em_u32x4 em_load_coherent16(const void* p) {
    em_u32x4 w;
#if defined(EM_DEVICE_AMD)
    const uint32_t* u = (const uint32_t*)p;
    for (int i = 0; i < 4; ++i) w.v[i] = em_load_relaxed_agent(u + i);
#else
    const uint4 v = __ldcg((const uint4*)p);
    w.v[0] = v.x;
    w.v[1] = v.y;
    w.v[2] = v.z;
    w.v[3] = v.w;
#endif
    return w;
}

__device__ inline float em_load_coherent_f32(const float* p) {
#if defined(EM_DEVICE_AMD)
    return em_bits_f32(em_load_relaxed_agent((const uint32_t*)p));
#else
    return __ldcg(p);
#endif
}

__device__ inline int32_t em_load_coherent_i32(const int32_t* p) {
#if defined(EM_DEVICE_AMD)
    return (int32_t)em_load_relaxed_agent((const uint32_t*)p);
#else
    return __ldcg(p);
#endif
}

__device__ inline void em_sleep() {
#if defined(EM_DEVICE_AMD)
    __builtin_amdgcn_s_sleep(2);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
    __nanosleep(200);
#elif defined(EM_HOST_SLEEP)
    EM_HOST_SLEEP();  // a host build (the HIP-CPU stand-in)
#endif
}

// Cross-lane exchange with lane ^ mask (mask < 16, so it stays inside a 16-lane team). Every lane
// of the wave must execute it.
__device__ inline float em_shfl_xor(float v, int mask) {
#if defined(EM_DEVICE_AMD)
    const int lane = (int)(em_tid() & (EM_WAVE - 1));
    return em_bits_f32((uint32_t)__builtin_amdgcn_ds_bpermute((lane ^ mask) << 2, (int)em_f32_bits(v)));
#else
    return __shfl_xor_sync(0xFFFFFFFFu, v, mask, 16);
#endif
}

// Contract §3 halving tree over the 16 lanes of a team: after it every lane holds the row result.
__device__ inline float em_tree16(float p) {
    for (int w = EM_LANES / 2; w > 0; w /= 2) p = p + em_shfl_xor(p, w);
    return p;
}

// A matrix view of one expert's W13 or W2.
__device__ inline EmMatView em_view(const EmShape& s, const EmExpertPtrs& e, int w2) {
    EmMatView m;
    const uint32_t rows = w2 ? s.hidden : 2 * s.inter;
    const uint32_t cols = w2 ? s.inter : s.hidden;
    m.nibbles = w2 ? e.w2_nibbles : e.w13_nibbles;
    m.scales = w2 ? e.w2_scales : e.w13_scales;
    m.zeros = w2 ? e.w2_zeros : e.w13_zeros;
    m.rows = rows;
    m.cols = cols;
    m.groups_per_row = (cols / EM_BLOCK) >> s.group_shift;
    m.group_shift = s.group_shift;
    m.zero_bytes_per_row = (m.groups_per_row + 1) / 2;
    m.scale_is_bf16 = s.scale_is_bf16;
    return m;
}

#endif  // EM_DEVICE_H
